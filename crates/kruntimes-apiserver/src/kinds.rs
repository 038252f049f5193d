//! Kind-specific admission: decoding into the typed kruntimes kinds, the Run admission rules
//! from `kruntimes-api`, and unknown-field detection against the CRD schema.

use serde_json::Value;

use crate::error::{ApiError, Cause};
use crate::http::openapi::crd_schema;
use crate::resources::ResourceDef;

/// How the client asked unknown fields to be treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldValidation {
    Strict,
    /// Drop unknown fields (pruning, as for a structural CRD schema).
    Prune,
}

impl FieldValidation {
    pub fn parse(text: Option<&str>) -> FieldValidation {
        match text {
            Some("Strict") => FieldValidation::Strict,
            _ => FieldValidation::Prune,
        }
    }
}

/// Fields of `value` that `schema` does not declare, as dotted paths; removes them when
/// `prune` is set. `metadata` is left to the server.
fn unknown_fields(
    value: &mut Value,
    schema: &Value,
    path: &str,
    prune: bool,
    out: &mut Vec<String>,
) {
    if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true)) {
        return;
    }
    match value {
        Value::Object(map) => {
            if let Some(props) = schema.get("properties").and_then(Value::as_object) {
                let mut unknown = Vec::new();
                for (key, child) in map.iter_mut() {
                    if path.is_empty() && matches!(key.as_str(), "apiVersion" | "kind" | "metadata")
                    {
                        continue;
                    }
                    let child_path = if path.is_empty() {
                        key.clone()
                    } else {
                        format!("{path}.{key}")
                    };
                    match props.get(key) {
                        Some(child_schema) => {
                            unknown_fields(child, child_schema, &child_path, prune, out)
                        }
                        None => {
                            out.push(child_path);
                            unknown.push(key.clone());
                        }
                    }
                }
                if prune {
                    for key in unknown {
                        map.remove(&key);
                    }
                }
            } else if let Some(items) = schema.get("additionalProperties").filter(|s| s.is_object())
            {
                for (key, child) in map.iter_mut() {
                    unknown_fields(child, items, &format!("{path}.{key}"), prune, out);
                }
            }
        }
        Value::Array(list) => {
            if let Some(items) = schema.get("items") {
                for (i, child) in list.iter_mut().enumerate() {
                    unknown_fields(child, items, &format!("{path}[{i}]"), prune, out);
                }
            }
        }
        _ => {}
    }
}

/// Checks (Strict) or prunes unknown fields of a kruntimes kind.
pub fn check_fields(
    def: &ResourceDef,
    object: &mut Value,
    validation: FieldValidation,
) -> Result<(), ApiError> {
    let Some(schema) = crd_schema(def) else {
        return Ok(());
    };
    let mut unknown = Vec::new();
    unknown_fields(
        object,
        schema,
        "",
        validation == FieldValidation::Prune,
        &mut unknown,
    );
    if validation == FieldValidation::Strict && !unknown.is_empty() {
        let list: Vec<String> = unknown
            .iter()
            .take(16)
            .map(|f| format!("unknown field \"{f}\""))
            .collect();
        return Err(ApiError::bad_request(format!(
            "strict decoding error: {}",
            list.join(", ")
        )));
    }
    Ok(())
}

fn decode<T: serde::de::DeserializeOwned>(
    def: &ResourceDef,
    name: &str,
    object: &Value,
) -> Result<T, ApiError> {
    serde_json::from_value::<T>(object.clone()).map_err(|e| {
        ApiError::invalid(
            def,
            name,
            vec![Cause {
                reason: "FieldValueInvalid".into(),
                message: e.to_string(),
                field: "spec".into(),
            }],
        )
    })
}

fn causes(errors: Vec<kruntimes_api::admission::FieldError>) -> Vec<Cause> {
    errors
        .into_iter()
        .map(|e| Cause {
            reason: e.reason.as_str().into(),
            message: e.message,
            field: e.field,
        })
        .collect()
}

fn is_run(def: &ResourceDef) -> bool {
    def.group == kruntimes_api::GROUP && def.kind == "Run"
}

fn is_runtime(def: &ResourceDef) -> bool {
    def.group == kruntimes_api::GROUP && def.kind == "Runtime"
}

/// Admission for a new object (its status already dropped where the kind has a status
/// subresource).
pub fn admit_create(def: &ResourceDef, name: &str, object: &Value) -> Result<(), ApiError> {
    if is_run(def) {
        if object.get("spec").is_none() {
            return Err(required(def, name, "spec"));
        }
        let run: kruntimes_api::Run = decode(def, name, object)?;
        let errors = kruntimes_api::admission::validate_create(&run.spec);
        if !errors.is_empty() {
            return Err(ApiError::invalid(def, name, causes(errors)));
        }
    } else if is_runtime(def) {
        if object.get("spec").is_none() {
            return Err(required(def, name, "spec"));
        }
        let _: kruntimes_api::Runtime = decode(def, name, object)?;
    }
    Ok(())
}

/// Admission for a change of the main resource (`status_write` false) or of `/status`.
pub fn admit_update(
    def: &ResourceDef,
    name: &str,
    old: &Value,
    new: &Value,
    status_write: bool,
) -> Result<(), ApiError> {
    if is_run(def) {
        let new_run: kruntimes_api::Run = decode(def, name, new)?;
        let errors = if status_write {
            let old_run: kruntimes_api::Run = decode(def, name, old)?;
            let mut errors = kruntimes_api::admission::validate_status_update(
                old_run.status.as_ref(),
                new_run.status.as_ref(),
            );
            errors.extend(
                new_run
                    .status
                    .as_ref()
                    .map(kruntimes_api::admission::validate_status)
                    .unwrap_or_default(),
            );
            errors
        } else {
            let old_run: kruntimes_api::Run = decode(def, name, old)?;
            kruntimes_api::admission::validate_update(&old_run.spec, &new_run.spec)
        };
        if !errors.is_empty() {
            return Err(ApiError::invalid(def, name, causes(errors)));
        }
    } else if is_runtime(def) {
        let _: kruntimes_api::Runtime = decode(def, name, new)?;
    } else if def.group == "rbac.authorization.k8s.io"
        && matches!(def.kind, "RoleBinding" | "ClusterRoleBinding")
        && old.get("roleRef") != new.get("roleRef")
    {
        return Err(ApiError::invalid(
            def,
            name,
            vec![Cause {
                reason: "FieldValueInvalid".into(),
                message: "cannot change roleRef".into(),
                field: "roleRef".into(),
            }],
        ));
    } else if def.store_key == crate::auth::ACCESS_TOKENS && old.get("spec") != new.get("spec") {
        return Err(ApiError::invalid(
            def,
            name,
            vec![Cause {
                reason: "FieldValueForbidden".into(),
                message: "an AccessToken's spec is immutable; delete it to revoke the token".into(),
                field: "spec".into(),
            }],
        ));
    }
    Ok(())
}

fn required(def: &ResourceDef, name: &str, field: &str) -> ApiError {
    ApiError::invalid(
        def,
        name,
        vec![Cause {
            reason: "FieldValueRequired".into(),
            message: "Required value".into(),
            field: field.into(),
        }],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources;
    use serde_json::json;

    #[test]
    fn strict_validation_names_unknown_fields_and_prune_drops_them() {
        let def = resources::find("kruntimes.io", "v1alpha1", "runs").expect("runs");
        let mut obj = json!({
            "apiVersion": "kruntimes.io/v1alpha1", "kind": "Run", "metadata": {"name": "a", "labels": {"x": "y"}},
            "spec": {"runtime": "py", "mode": {"task": {"entrypoint": "m", "bogus": 1}}, "typo": true}
        });
        let err = check_fields(def, &mut obj.clone(), FieldValidation::Strict).expect_err("strict");
        assert!(err.message.contains("spec.typo"), "{}", err.message);
        assert!(
            err.message.contains("spec.mode.task.bogus"),
            "{}",
            err.message
        );
        check_fields(def, &mut obj, FieldValidation::Prune).expect("prune");
        assert!(obj.pointer("/spec/typo").is_none());
        assert!(obj.pointer("/spec/mode/task/bogus").is_none());
        assert_eq!(obj.pointer("/metadata/labels/x"), Some(&json!("y")));
    }

    #[test]
    fn run_admission_maps_to_invalid_with_causes() {
        let def = resources::find("kruntimes.io", "v1alpha1", "runs").expect("runs");
        let obj = json!({"metadata": {"name": "a"}, "spec": {"runtime": "py", "mode": {}}});
        let err = admit_create(def, "a", &obj).expect_err("no mode");
        assert_eq!(err.code.as_u16(), 422);
        assert!(err.message.contains("spec.mode"), "{}", err.message);
        let old = json!({"metadata": {"name": "a"}, "spec": {"runtime": "py", "mode": {"task": {"entrypoint": "m"}}}});
        let new = json!({"metadata": {"name": "a"}, "spec": {"runtime": "py", "mode": {"function": {"handler": "h"}}}});
        let err = admit_update(def, "a", &old, &new, false).expect_err("mode change");
        assert!(
            err.message.contains("spec.mode: field is immutable"),
            "{}",
            err.message
        );
    }
}
