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

/// Checks (Strict) or prunes unknown fields of a kruntimes kind, or checks a stored
/// Kubernetes kind against its type (crate::builtin).
pub fn check_fields(
    def: &ResourceDef,
    object: &mut Value,
    validation: FieldValidation,
) -> Result<(), ApiError> {
    // A client still writing the earlier template shape gets it upgraded, not pruned.
    if is_runtime(def)
        && let Some(spec) = object.get_mut("spec")
    {
        kruntimes_api::runtime::upgrade_legacy_template(spec);
    }
    let Some(schema) = crd_schema(def) else {
        let name = object
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        return crate::builtin::check(def, &name, object, validation);
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

/// The most schema violations one answer lists.
const MAX_SCHEMA_CAUSES: usize = 16;
/// The deepest a checked object may nest (the kinds' schemas nest far less).
const MAX_SCHEMA_DEPTH: usize = 32;

/// Checks `value` against the structural CRD `schema`: types, `nullable`, `required`,
/// `enum` and the range of `format: int32` integers, each violation worded as Kubernetes
/// words it (`spec.mode.task.args[0]: Invalid value: "integer": must be of type string`).
/// Bounds (lengths, minimums) are left to the admission rules. `apiVersion`, `kind` and
/// `metadata` at the root are the server's.
fn schema_violations(
    value: &Value,
    schema: &Value,
    path: &str,
    depth: usize,
    out: &mut Vec<Cause>,
) {
    if out.len() >= MAX_SCHEMA_CAUSES {
        return;
    }
    let field = if path.is_empty() { "<root>" } else { path };
    if depth > MAX_SCHEMA_DEPTH {
        out.push(Cause {
            reason: "FieldValueInvalid".into(),
            message: format!("Invalid value: nested deeper than {MAX_SCHEMA_DEPTH} levels"),
            field: field.into(),
        });
        return;
    }
    if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true)) {
        return;
    }
    if value.is_null() {
        if schema.get("nullable") != Some(&Value::Bool(true)) && schema.get("type").is_some() {
            out.push(Cause {
                reason: "FieldValueTypeInvalid".into(),
                message: format!(
                    "Invalid value: \"null\": must be of type {}",
                    schema["type"].as_str().unwrap_or("object")
                ),
                field: field.into(),
            });
        }
        return;
    }
    let found = json_type(value);
    if let Some(expected) = schema.get("type").and_then(Value::as_str) {
        let matches = match expected {
            "integer" => value.is_i64() || value.is_u64(),
            "number" => value.is_number(),
            other => other == found,
        };
        if !matches {
            out.push(Cause {
                reason: "FieldValueTypeInvalid".into(),
                message: format!("Invalid value: \"{found}\": must be of type {expected}"),
                field: field.into(),
            });
            return;
        }
        if expected == "integer" && schema.get("format").and_then(Value::as_str) == Some("int32") {
            let fits = value.as_i64().is_some_and(|n| i32::try_from(n).is_ok());
            if !fits {
                out.push(Cause {
                    reason: "FieldValueInvalid".into(),
                    message: format!(
                        "Invalid value: {value}: must be a 32-bit integer (from {} to {})",
                        i32::MIN,
                        i32::MAX
                    ),
                    field: field.into(),
                });
                return;
            }
        }
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(value)
    {
        let words: Vec<String> = allowed.iter().map(Value::to_string).collect();
        out.push(Cause {
            reason: "FieldValueNotSupported".into(),
            message: format!(
                "Unsupported value: {}: supported values: {}",
                bounded_value(value),
                words.join(", ")
            ),
            field: field.into(),
        });
        return;
    }
    let join = |key: &str| {
        if path.is_empty() {
            key.to_string()
        } else {
            format!("{path}.{key}")
        }
    };
    match value {
        Value::Object(map) => {
            for key in schema
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
            {
                if !map.contains_key(key) {
                    out.push(Cause {
                        reason: "FieldValueRequired".into(),
                        message: "Required value".into(),
                        field: join(key),
                    });
                }
            }
            let props = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties").filter(|s| s.is_object());
            for (key, child) in map {
                if path.is_empty() && matches!(key.as_str(), "apiVersion" | "kind" | "metadata") {
                    continue;
                }
                let child_schema = props.and_then(|p| p.get(key)).or(additional);
                // Unknown fields are pruned or refused by `check_fields`, not here.
                if let Some(child_schema) = child_schema {
                    schema_violations(child, child_schema, &join(key), depth + 1, out);
                }
            }
        }
        Value::Array(list) => {
            if let Some(items) = schema.get("items") {
                for (i, child) in list.iter().enumerate() {
                    schema_violations(child, items, &format!("{path}[{i}]"), depth + 1, out);
                }
            }
        }
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => {}
    }
}

/// The JSON type of `value`, in the words of OpenAPI.
fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// A value as it is echoed in a message: its JSON, cut to 64 characters.
fn bounded_value(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(64) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

/// Decodes a kruntimes kind. The object is first checked against the kind's CRD schema, so
/// a malformed object is refused with the field and the rule in words; serde's own message
/// (Rust type names, backticks) is never shown to a client.
fn decode<T: serde::de::DeserializeOwned>(
    def: &ResourceDef,
    name: &str,
    object: &Value,
) -> Result<T, ApiError> {
    if let Some(schema) = crd_schema(def) {
        let mut violations = Vec::new();
        schema_violations(object, schema, "", 0, &mut violations);
        if !violations.is_empty() {
            return Err(ApiError::invalid(def, name, violations));
        }
    }
    serde_json::from_value::<T>(object.clone()).map_err(|error| {
        // The schema allowed what the types refuse: a gap between the two, said in words.
        tracing::warn!(kind = def.kind, name, error = %error, "an object the schema allows does not decode");
        ApiError::invalid(
            def,
            name,
            vec![Cause {
                reason: "FieldValueInvalid".into(),
                message: format!("Invalid value: does not match the {} schema", def.kind),
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

fn is_snapshot(def: &ResourceDef) -> bool {
    def.group == kruntimes_api::GROUP && def.kind == "Snapshot"
}

fn is_workspace(def: &ResourceDef) -> bool {
    def.group == kruntimes_api::GROUP && def.kind == "Workspace"
}

/// Admission for a new object (its status already dropped where the kind has a status
/// subresource).
pub fn admit_create(def: &ResourceDef, name: &str, object: &Value) -> Result<(), ApiError> {
    if is_run(def) {
        if object.get("spec").is_none() {
            return Err(required(def, name, "spec"));
        }
        let run: kruntimes_api::Run = decode(def, name, object)?;
        let mut errors = kruntimes_api::admission::validate_create(&run.spec);
        errors.extend(kruntimes_api::admission::validate_workspace_lock(
            name, &run.spec,
        ));
        if !errors.is_empty() {
            return Err(ApiError::invalid(def, name, causes(errors)));
        }
    } else if is_runtime(def) {
        if object.get("spec").is_none() {
            return Err(required(def, name, "spec"));
        }
        let runtime: kruntimes_api::Runtime = decode(def, name, object)?;
        // The name, or a name `generateName` may give (five lower-case letters or digits).
        let named = match &runtime.metadata.name {
            Some(name) => name.clone(),
            None => format!("{name}xxxxx"),
        };
        let mut errors = kruntimes_api::admission::validate_runtime_name(&named);
        errors.extend(kruntimes_api::admission::validate_runtime(&runtime.spec));
        if !errors.is_empty() {
            return Err(ApiError::invalid(def, name, causes(errors)));
        }
    } else if is_snapshot(def) {
        if object.get("spec").is_none() {
            return Err(required(def, name, "spec"));
        }
        let snapshot: kruntimes_api::Snapshot = decode(def, name, object)?;
        let errors = kruntimes_api::admission::validate_snapshot_create(&snapshot);
        if !errors.is_empty() {
            return Err(ApiError::invalid(def, name, causes(errors)));
        }
    } else if is_workspace(def) {
        let workspace: kruntimes_api::Workspace = decode(def, name, object)?;
        let errors = kruntimes_api::admission::validate_workspace(&workspace.spec);
        if !errors.is_empty() {
            return Err(ApiError::invalid(def, name, causes(errors)));
        }
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
        let runtime: kruntimes_api::Runtime = decode(def, name, new)?;
        let errors = kruntimes_api::admission::validate_runtime(&runtime.spec);
        if !status_write && !errors.is_empty() {
            return Err(ApiError::invalid(def, name, causes(errors)));
        }
    } else if is_snapshot(def) {
        let old_snapshot: kruntimes_api::Snapshot = decode(def, name, old)?;
        let new_snapshot: kruntimes_api::Snapshot = decode(def, name, new)?;
        let errors = if status_write {
            kruntimes_api::admission::validate_snapshot_status(
                old_snapshot.status.as_ref(),
                new_snapshot.status.as_ref(),
            )
        } else {
            kruntimes_api::admission::validate_snapshot_update(
                &old_snapshot.spec,
                &new_snapshot.spec,
            )
        };
        if !errors.is_empty() {
            return Err(ApiError::invalid(def, name, causes(errors)));
        }
    } else if is_workspace(def) {
        let old_workspace: kruntimes_api::Workspace = decode(def, name, old)?;
        let new_workspace: kruntimes_api::Workspace = decode(def, name, new)?;
        let errors = if status_write {
            kruntimes_api::admission::validate_workspace_status(
                old_workspace.status.as_ref(),
                new_workspace.status.as_ref(),
            )
        } else {
            kruntimes_api::admission::validate_workspace(&new_workspace.spec)
        };
        if !errors.is_empty() {
            return Err(ApiError::invalid(def, name, causes(errors)));
        }
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
    fn a_runtime_name_must_be_a_label_given_or_generated() {
        let def = resources::find("kruntimes.io", "v1alpha1", "runtimes").expect("runtimes");
        let named = |name: &str| json!({"metadata": {"name": name}, "spec": {}});
        admit_create(def, "python", &named("python")).expect("a label");
        for bad in ["Python", "py.3", &"a".repeat(64)] {
            let err = admit_create(def, bad, &named(bad)).expect_err(bad);
            assert_eq!(err.code, 422, "{bad}");
            assert!(err.message.contains("DNS-1123 label"), "{}", err.message);
        }
        let generated = |prefix: &str| json!({"metadata": {"generateName": prefix}, "spec": {}});
        admit_create(def, "py-", &generated("py-")).expect("a generated label");
        let prefix = "a".repeat(59);
        admit_create(def, &prefix, &generated(&prefix)).expect_err("64 with the suffix");
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

    fn run(spec: Value) -> Value {
        json!({"apiVersion": "kruntimes.io/v1alpha1", "kind": "Run", "metadata": {"name": "a"}, "spec": spec})
    }

    /// Issue 15 item 2: a task with inline source and no entrypoint was refused with
    /// serde's `spec: missing field entrypoint`.
    #[test]
    fn a_task_with_inline_source_needs_no_entrypoint() {
        let def = resources::find("kruntimes.io", "v1alpha1", "runs").expect("runs");
        let inline =
            run(json!({"runtime": "bash", "mode": {"task": {}}, "source": {"inline": "echo hi"}}));
        admit_create(def, "a", &inline).expect("inline source without an entrypoint");
        let neither = run(json!({"runtime": "bash", "mode": {"task": {}}}));
        let err = admit_create(def, "a", &neither).expect_err("neither");
        assert_eq!(err.code.as_u16(), 422);
        assert!(
            err.message.contains("spec.mode.task.entrypoint: Required value: a task needs an entrypoint unless spec.source.inline"),
            "{}",
            err.message
        );
    }

    /// Issue 15 item 2: admission errors name the field and the rule in words, never a raw
    /// serde message (Rust types, backticks, "missing field").
    #[test]
    fn malformed_runs_are_refused_with_the_field_and_the_rule_in_words() {
        let def = resources::find("kruntimes.io", "v1alpha1", "runs").expect("runs");
        let cases = [
            (
                json!({"runtime": "bash", "mode": {"task": {"entrypoint": "m", "args": ["a", 7]}}}),
                "spec.mode.task.args[1]: Invalid value: \"integer\": must be of type string",
            ),
            (
                json!({"mode": {"task": {"entrypoint": "m"}}}),
                "spec.runtime: Required value",
            ),
            (
                json!({"runtime": "bash", "mode": {"task": {"entrypoint": 5}}}),
                "spec.mode.task.entrypoint: Invalid value: \"integer\": must be of type string",
            ),
            (
                json!({"runtime": "bash", "mode": "task"}),
                "spec.mode: Invalid value: \"string\": must be of type object",
            ),
            (
                json!({"runtime": "bash", "mode": {"task": {"entrypoint": "m"}}, "termination": {"mode": "Later"}}),
                "spec.termination.mode: Unsupported value: \"Later\": supported values: \"Drain\", \"Immediate\"",
            ),
            (
                json!({"runtime": "bash", "mode": {"task": {"entrypoint": "m"}}, "retryPolicy": {"maxAttempts": 4_294_967_296_i64}}),
                "spec.retryPolicy.maxAttempts: Invalid value: 4294967296: must be a 32-bit integer",
            ),
            (
                json!({"runtime": "bash", "mode": {"task": {"entrypoint": "m"}}, "retryPolicy": {}}),
                "spec.retryPolicy.maxAttempts: Required value",
            ),
            (
                json!({"runtime": "bash", "mode": {"task": {"entrypoint": "m"}}, "env": [{"name": null}]}),
                "spec.env[0].name: Invalid value: \"null\": must be of type string",
            ),
        ];
        for (spec, expected) in cases {
            let err = admit_create(def, "a", &run(spec.clone())).expect_err("malformed");
            assert_eq!(err.code.as_u16(), 422, "{spec}");
            assert!(err.message.contains(expected), "{spec}: {}", err.message);
            for serde_words in ["`", "missing field", "invalid type", "i32", "expected"] {
                assert!(
                    !err.message.contains(serde_words),
                    "{spec}: {}",
                    err.message
                );
            }
        }
    }

    #[test]
    fn a_snapshot_spec_is_immutable_and_its_status_bounded() {
        let def = resources::find("kruntimes.io", "v1alpha1", "snapshots").expect("snapshots");
        let snapshot = |spec: Value, status: Value| {
            json!({"apiVersion": "kruntimes.io/v1alpha1", "kind": "Snapshot",
                   "metadata": {"name": "s"}, "spec": spec, "status": status})
        };
        let old = snapshot(json!({"source": {"run": {"name": "r1"}}}), json!({}));
        admit_create(def, "s", &old).expect("a Snapshot of r1");
        let err = admit_create(def, "s", &json!({"metadata": {"name": "s"}})).expect_err("no spec");
        assert_eq!(err.code.as_u16(), 422);
        let err = admit_create(
            def,
            "s",
            &snapshot(
                json!({"source": {"run": {"name": "r1"}}, "reason": "Later"}),
                json!({}),
            ),
        )
        .expect_err("unknown reason");
        assert!(
            err.message.contains("spec.reason: Unsupported value"),
            "{}",
            err.message
        );
        // A spec change is refused, naming the field; the same spec passes.
        let moved = snapshot(json!({"source": {"run": {"name": "r2"}}}), json!({}));
        let err = admit_update(def, "s", &old, &moved, false).expect_err("source changed");
        assert_eq!(err.code.as_u16(), 422);
        assert!(
            err.message.contains("spec.source: field is immutable"),
            "{}",
            err.message
        );
        admit_update(def, "s", &old, &old, false).expect("unchanged");
        // Status: bounded, Ready is final.
        let ready = snapshot(
            json!({"source": {"run": {"name": "r1"}}}),
            json!({"phase": "Ready", "files": 3}),
        );
        admit_update(def, "s", &old, &ready, true).expect("Ready");
        let back = snapshot(
            json!({"source": {"run": {"name": "r1"}}}),
            json!({"phase": "Capturing"}),
        );
        let err = admit_update(def, "s", &ready, &back, true).expect_err("Ready is final");
        assert!(err.message.contains("status.phase"), "{}", err.message);
        let negative = snapshot(
            json!({"source": {"run": {"name": "r1"}}}),
            json!({"sizeBytes": -1}),
        );
        let err = admit_update(def, "s", &old, &negative, true).expect_err("negative size");
        assert!(err.message.contains("status.sizeBytes"), "{}", err.message);
    }

    #[test]
    fn a_null_optional_field_is_accepted() {
        let def = resources::find("kruntimes.io", "v1alpha1", "runs").expect("runs");
        let obj = run(
            json!({"runtime": "bash", "mode": {"task": {"entrypoint": "m"}, "function": null}, "timeout": null}),
        );
        admit_create(def, "a", &obj).expect("nulls of optional fields");
    }
}
