//! Test support: what a cluster's API server would refuse of a Run, from the Run CRD
//! alone. The structural part of the schema (types, required fields, bounds, enums,
//! patterns) is checked by a small walker here; the CEL rules (`x-kubernetes-validations`,
//! transition rules on update) by kube-cel's evaluator, which kube's `cel` feature brings.
//! Formats are not checked: the CRDs use none.

use kube::CustomResourceExt;
use serde_json::{Value, json};

use crate::RunSpec;

/// The `openAPIV3Schema` of `K`'s CRD.
pub fn schema<K: CustomResourceExt>() -> Value {
    let crd = serde_json::to_value(K::crd()).expect("the CRD serializes");
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

/// The Run CRD's `openAPIV3Schema`.
pub fn run_schema() -> Value {
    let crd = serde_json::to_value(crate::crds::run_crd()).expect("the CRD serializes");
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

/// What the schema refuses of a Run with `spec` (created, or updated from `old`), one
/// line per failure; empty when it is accepted.
pub fn refusals(schema: &Value, spec: &RunSpec, old: Option<&RunSpec>) -> Vec<String> {
    let object = |spec: &RunSpec| {
        json!({
            "apiVersion": "kruntimes.io/v1alpha1",
            "kind": "Run",
            "metadata": {"name": "r", "namespace": "default"},
            "spec": spec,
        })
    };
    object_refusals(schema, &object(spec), old.map(object).as_ref())
}

/// What the schema refuses of `object` (created, or updated from `old`).
pub fn object_refusals(schema: &Value, object: &Value, old: Option<&Value>) -> Vec<String> {
    let mut refused = Vec::new();
    structural(schema, object, "", &mut refused);
    if let Err(errors) = kube::core::cel::Validator::new().validate(schema, object, old) {
        refused.extend(errors.iter().map(ToString::to_string));
    }
    refused
}

fn structural(schema: &Value, value: &Value, path: &str, refused: &mut Vec<String>) {
    let mut refuse = |what: &str| refused.push(format!("{path}: {what}"));
    if value.is_null() {
        if schema["nullable"] != true {
            refuse("must not be null");
        }
        return;
    }
    if let Some(allowed) = schema["enum"].as_array()
        && !allowed.contains(value)
    {
        refuse("not one of the enum's values");
    }
    let over = |bound: &str, n: usize| schema[bound].as_u64().is_some_and(|b| n as u64 > b);
    let under = |bound: &str, n: usize| schema[bound].as_u64().is_some_and(|b| (n as u64) < b);
    match schema["type"].as_str() {
        Some("string") => {
            let Some(text) = value.as_str() else {
                return refuse("must be a string");
            };
            let chars = text.chars().count();
            if over("maxLength", chars) || under("minLength", chars) {
                refuse("length out of bounds");
            }
            if let Some(pattern) = schema["pattern"].as_str()
                && !regex::Regex::new(pattern)
                    .expect("the CRD's pattern compiles")
                    .is_match(text)
            {
                refuse(&format!("does not match {pattern}"));
            }
        }
        Some("integer") => {
            let Some(n) = value.as_i64() else {
                return refuse("must be an integer");
            };
            if schema["minimum"].as_f64().is_some_and(|m| (n as f64) < m)
                || schema["maximum"].as_f64().is_some_and(|m| (n as f64) > m)
            {
                refuse("out of range");
            }
        }
        Some("boolean") if !value.is_boolean() => refuse("must be a boolean"),
        Some("array") => {
            let Some(items) = value.as_array() else {
                return refuse("must be an array");
            };
            if over("maxItems", items.len()) || under("minItems", items.len()) {
                refuse("item count out of bounds");
            }
            for (i, item) in items.iter().enumerate() {
                structural(&schema["items"], item, &format!("{path}[{i}]"), refused);
            }
        }
        Some("object") => {
            let Some(fields) = value.as_object() else {
                return refuse("must be an object");
            };
            if over("maxProperties", fields.len()) {
                refuse("too many properties");
            }
            for required in schema["required"].as_array().into_iter().flatten() {
                if let Some(name) = required.as_str()
                    && !fields.contains_key(name)
                {
                    refuse(&format!("{name} is required"));
                }
            }
            for (name, field) in fields {
                let at = format!("{path}.{name}");
                match schema["properties"].get(name) {
                    Some(property) => structural(property, field, &at, refused),
                    // An unknown field is pruned, not refused.
                    None if schema["additionalProperties"].is_object() => {
                        structural(&schema["additionalProperties"], field, &at, refused)
                    }
                    None => {}
                }
            }
        }
        _ => {}
    }
}
