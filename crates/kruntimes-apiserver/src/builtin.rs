//! The Kubernetes kinds the server stores for the install and the Kubernetes provisioner
//! (Deployments, ReplicaSets, Services, Secrets, ConfigMaps, PodDisruptionBudgets,
//! NetworkPolicies, CustomResourceDefinitions), checked as a cluster checks them: an object
//! must decode as its Kubernetes type (k8s-openapi's, which refuses wrong types, missing
//! required fields and bad base64), unknown fields are refused (`fieldValidation=Strict`,
//! kubectl's default) or dropped, and a workload's selector must select its template.
//!
//! Unknown fields are found by a round trip: what decoding into the type and encoding
//! again leaves out was not a field of the type.

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::{ApiError, Cause};
use crate::kinds::FieldValidation;
use crate::resources::ResourceDef;

/// The most unknown fields one answer names.
const MAX_NAMED: usize = 16;

/// Checks (and, under Prune, prunes) `object` when `def` is one of the stored Kubernetes
/// kinds; other kinds are left alone.
pub fn check(
    def: &ResourceDef,
    name: &str,
    object: &mut Value,
    validation: FieldValidation,
) -> Result<(), ApiError> {
    use k8s_openapi::api::{apps, core, networking, policy};
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions;
    match (def.group, def.kind) {
        // A body without a spec (a status write) has no selector to check.
        ("apps", "Deployment") => {
            let d: apps::v1::Deployment = typed(def, name, object, validation)?;
            match d.spec {
                Some(spec) => {
                    selects_template(def, name, &spec.selector, spec.template.metadata.as_ref())
                }
                None => Ok(()),
            }
        }
        ("apps", "ReplicaSet") => {
            let r: apps::v1::ReplicaSet = typed(def, name, object, validation)?;
            match r.spec {
                Some(spec) => {
                    let template = spec.template.as_ref().and_then(|t| t.metadata.as_ref());
                    selects_template(def, name, &spec.selector, template)
                }
                None => Ok(()),
            }
        }
        ("", "Service") => typed::<core::v1::Service>(def, name, object, validation).map(drop),
        ("", "Secret") => {
            typed::<core::v1::Secret>(def, name, object, validation)?;
            fold_string_data(object);
            Ok(())
        }
        ("", "ConfigMap") => typed::<core::v1::ConfigMap>(def, name, object, validation).map(drop),
        ("policy", "PodDisruptionBudget") => {
            typed::<policy::v1::PodDisruptionBudget>(def, name, object, validation).map(drop)
        }
        ("networking.k8s.io", "NetworkPolicy") => {
            typed::<networking::v1::NetworkPolicy>(def, name, object, validation).map(drop)
        }
        ("apiextensions.k8s.io", "CustomResourceDefinition") => {
            typed::<apiextensions::v1::CustomResourceDefinition>(def, name, object, validation)
                .map(drop)
        }
        _ => Ok(()),
    }
}

/// Moves a Secret's write-only `stringData` into `data` (base64), as a cluster does: it is
/// never stored, and its keys win over `data`'s.
fn fold_string_data(object: &mut Value) {
    use base64::Engine;
    let Some(map) = object.as_object_mut() else {
        return;
    };
    let Some(Value::Object(strings)) = map.remove("stringData") else {
        return;
    };
    let data = map
        .entry("data")
        .or_insert_with(|| Value::Object(Default::default()));
    if !data.is_object() {
        *data = Value::Object(Default::default());
    }
    if let Some(data) = data.as_object_mut() {
        for (key, value) in strings {
            if let Some(text) = value.as_str() {
                let encoded = base64::engine::general_purpose::STANDARD.encode(text);
                data.insert(key, Value::String(encoded));
            }
        }
    }
}

/// Decodes `object` as `T`, then refuses or prunes what `T` does not declare.
fn typed<T: DeserializeOwned + Serialize>(
    def: &ResourceDef,
    name: &str,
    object: &mut Value,
    validation: FieldValidation,
) -> Result<T, ApiError> {
    let decoded: T = serde_json::from_value(object.clone()).map_err(|error| {
        // ApiError bounds the message it answers with.
        let message = format!("Invalid value: does not decode as a {}: {error}", def.kind);
        ApiError::invalid(
            def,
            name,
            vec![Cause {
                reason: "FieldValueInvalid".into(),
                message,
                field: "<root>".into(),
            }],
        )
    })?;
    let encoded = serde_json::to_value(&decoded)
        .map_err(|error| ApiError::internal("re-encoding a decoded object", &error))?;
    let mut unknown = Vec::new();
    unknown_fields(
        object,
        &encoded,
        "",
        validation == FieldValidation::Prune,
        &mut unknown,
    );
    if validation == FieldValidation::Strict && !unknown.is_empty() {
        let named: Vec<String> = unknown
            .iter()
            .take(MAX_NAMED)
            .map(|f| format!("unknown field \"{f}\""))
            .collect();
        return Err(ApiError::bad_request(format!(
            "strict decoding error: {}",
            named.join(", ")
        )));
    }
    Ok(decoded)
}

/// The keys of `given` that `known` (its round trip through the type) lacks, as dotted
/// paths; removed from `given` when `prune` is set. A null is never a field of its own.
fn unknown_fields(
    given: &mut Value,
    known: &Value,
    path: &str,
    prune: bool,
    out: &mut Vec<String>,
) {
    match (given, known) {
        (Value::Object(map), Value::Object(known_map)) => {
            let mut gone = Vec::new();
            for (key, child) in map.iter_mut() {
                if path.is_empty() && matches!(key.as_str(), "apiVersion" | "kind") {
                    continue;
                }
                let child_path = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match known_map.get(key) {
                    Some(known_child) => {
                        unknown_fields(child, known_child, &child_path, prune, out)
                    }
                    None if child.is_null() => {}
                    None => {
                        out.push(child_path);
                        gone.push(key.clone());
                    }
                }
            }
            if prune {
                for key in gone {
                    map.remove(&key);
                }
            }
        }
        (Value::Array(list), Value::Array(known_list)) => {
            for (i, (child, known_child)) in list.iter_mut().zip(known_list).enumerate() {
                unknown_fields(child, known_child, &format!("{path}[{i}]"), prune, out);
            }
        }
        _ => {}
    }
}

/// A workload's selector must select its Pod template, as a cluster requires.
fn selects_template(
    def: &ResourceDef,
    name: &str,
    selector: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    template: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
) -> Result<(), ApiError> {
    let invalid = |field: &str, message: &str| {
        ApiError::invalid(
            def,
            name,
            vec![Cause {
                reason: "FieldValueInvalid".into(),
                message: format!("Invalid value: {message}"),
                field: field.into(),
            }],
        )
    };
    let labels = template.and_then(|m| m.labels.clone()).unwrap_or_default();
    let match_labels = selector.match_labels.clone().unwrap_or_default();
    if match_labels.is_empty() && selector.match_expressions.is_none() {
        return Err(invalid(
            "spec.selector",
            "empty selector is invalid for deployment",
        ));
    }
    if selector.match_expressions.is_some() {
        // Expressions are stored as given; only matchLabels is compared here.
        return Ok(());
    }
    if match_labels.iter().any(|(k, v)| labels.get(k) != Some(v)) {
        return Err(invalid(
            "spec.template.metadata.labels",
            "`selector` does not match template `labels`",
        ));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    fn deployments() -> &'static ResourceDef {
        crate::resources::find("apps", "v1", "deployments").unwrap()
    }

    fn deployment() -> Value {
        json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "d", "namespace": "n"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": "a"}},
                "template": {
                    "metadata": {"labels": {"app": "a"}},
                    "spec": {"containers": [{"name": "c", "image": "i", "args": ["x"]}]}
                }
            }
        })
    }

    #[test]
    fn a_valid_deployment_is_kept_as_given() {
        let mut object = deployment();
        check(deployments(), "d", &mut object, FieldValidation::Strict).unwrap();
        assert_eq!(object, deployment());
    }

    #[test]
    fn unknown_fields_are_refused_by_name_or_pruned() {
        let mut object = deployment();
        object["spec"]["template"]["spec"]["containers"][0]["bogus"] = json!(1);
        object["spec"]["extra"] = json!({"a": 1});
        let refused = check(
            deployments(),
            "d",
            &mut object.clone(),
            FieldValidation::Strict,
        )
        .unwrap_err()
        .message;
        assert!(
            refused.contains("unknown field \"spec.template.spec.containers[0].bogus\"")
                && refused.contains("unknown field \"spec.extra\""),
            "{refused}"
        );
        check(deployments(), "d", &mut object, FieldValidation::Prune).unwrap();
        assert_eq!(object, deployment());
    }

    #[test]
    fn wrong_types_missing_fields_and_a_selector_that_misses_its_template_are_invalid() {
        let mut wrong_type = deployment();
        wrong_type["spec"]["replicas"] = json!("two");
        let mut missing = deployment();
        missing["spec"].as_object_mut().unwrap().remove("selector");
        let mut mismatch = deployment();
        mismatch["spec"]["selector"]["matchLabels"]["app"] = json!("b");
        for (mut object, says) in [
            (wrong_type, "does not decode as a Deployment"),
            (missing, "selector"),
            (mismatch, "`selector` does not match template `labels`"),
        ] {
            let error = check(deployments(), "d", &mut object, FieldValidation::Prune)
                .unwrap_err()
                .message;
            assert!(error.contains(says), "{error}");
            assert!(error.contains("is invalid"), "{error}");
        }
    }

    #[test]
    fn a_secrets_string_data_is_stored_as_data_and_a_status_write_needs_no_spec() {
        let secrets = crate::resources::find("", "v1", "secrets").unwrap();
        let mut secret = json!({
            "metadata": {"name": "s"},
            "data": {"a": "eA==", "b": "eA=="},
            "stringData": {"b": "hi"}
        });
        check(secrets, "s", &mut secret, FieldValidation::Strict).unwrap();
        assert_eq!(
            secret,
            json!({"metadata": {"name": "s"}, "data": {"a": "eA==", "b": "aGk="}})
        );
        let mut status = json!({"metadata": {"name": "d"}, "status": {"replicas": 3}});
        check(deployments(), "d", &mut status, FieldValidation::Strict).unwrap();
    }

    #[test]
    fn a_secret_must_carry_base64() {
        let secrets = crate::resources::find("", "v1", "secrets").unwrap();
        let mut good = json!({"metadata": {"name": "s"}, "data": {"k": "aGk="}});
        check(secrets, "s", &mut good, FieldValidation::Strict).unwrap();
        let mut bad = json!({"metadata": {"name": "s"}, "data": {"k": "not base64!"}});
        assert!(check(secrets, "s", &mut bad, FieldValidation::Strict).is_err());
    }
}
