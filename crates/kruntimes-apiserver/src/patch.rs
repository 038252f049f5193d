//! PATCH bodies: JSON merge patch, JSON patch (RFC 6902) and the strategic-merge and
//! apply content types kubectl sends, applied to a stored object.

use serde_json::Value;

/// The patch formats the server understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchKind {
    Merge,
    Json,
    StrategicMerge,
    Apply,
}

impl PatchKind {
    pub fn from_content_type(content_type: &str) -> Option<PatchKind> {
        let media = content_type.split(';').next().unwrap_or("").trim();
        match media {
            "application/merge-patch+json" => Some(PatchKind::Merge),
            "application/json-patch+json" => Some(PatchKind::Json),
            "application/strategic-merge-patch+json" => Some(PatchKind::StrategicMerge),
            "application/apply-patch+yaml" | "application/apply-patch+json" => {
                Some(PatchKind::Apply)
            }
            _ => None,
        }
    }
}

/// Why a patch could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum PatchError {
    /// The body is not a patch of its declared kind (400).
    #[error("{0}")]
    Malformed(String),
    /// The patch is well formed but does not apply: a failed `test` or a bad path (422).
    #[error("{0}")]
    Failed(String),
}

/// Applies `body` of `kind` to `doc` in place.
pub fn apply(doc: &mut Value, kind: PatchKind, body: &[u8]) -> Result<(), PatchError> {
    match kind {
        PatchKind::Merge | PatchKind::StrategicMerge => {
            let patch: Value = serde_json::from_slice(body)
                .map_err(|e| PatchError::Malformed(format!("invalid merge patch: {e}")))?;
            if !patch.is_object() {
                return Err(PatchError::Malformed(
                    "a merge patch must be a JSON object".into(),
                ));
            }
            json_patch::merge(doc, &patch);
            Ok(())
        }
        PatchKind::Apply => {
            let patch: Value = parse_yaml_or_json(body)?;
            if !patch.is_object() {
                return Err(PatchError::Malformed(
                    "an apply patch must be an object".into(),
                ));
            }
            json_patch::merge(doc, &patch);
            Ok(())
        }
        PatchKind::Json => {
            let ops: Vec<json_patch::PatchOperation> = serde_json::from_slice(body)
                .map_err(|e| PatchError::Malformed(format!("invalid JSON patch: {e}")))?;
            for op in &ops {
                // Kubernetes: `test` with value null succeeds on a missing member, which is
                // how kube-runtime's finalizer helper says "there are no finalizers yet".
                if let json_patch::PatchOperation::Test(test) = op
                    && test.value.is_null()
                    && doc.pointer(test.path.as_str()).is_none()
                {
                    continue;
                }
                json_patch::patch(doc, std::slice::from_ref(op)).map_err(|e| {
                    PatchError::Failed(format!("the JSON patch did not apply: {e}"))
                })?;
            }
            Ok(())
        }
    }
}

/// Parses an apply body, which is YAML (JSON is YAML too).
pub fn parse_yaml_or_json(body: &[u8]) -> Result<Value, PatchError> {
    if let Ok(v) = serde_json::from_slice::<Value>(body) {
        return Ok(v);
    }
    serde_yaml::from_slice::<Value>(body)
        .map_err(|e| PatchError::Malformed(format!("invalid YAML: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn finalizer_helper_sequences() {
        let mut doc = json!({"metadata": {"name": "a"}});
        let add = br#"[{"op":"test","path":"/metadata/finalizers","value":null},{"op":"add","path":"/metadata/finalizers","value":["x"]}]"#;
        apply(&mut doc, PatchKind::Json, add).expect("add");
        assert_eq!(doc["metadata"]["finalizers"], json!(["x"]));
        // The same test now fails: finalizers exist.
        assert!(matches!(
            apply(&mut doc.clone(), PatchKind::Json, add),
            Err(PatchError::Failed(_))
        ));
        let remove = br#"[{"op":"test","path":"/metadata/finalizers/0","value":"x"},{"op":"remove","path":"/metadata/finalizers/0"}]"#;
        apply(&mut doc, PatchKind::Json, remove).expect("remove");
        assert_eq!(doc["metadata"]["finalizers"], json!([]));
        let wrong = br#"[{"op":"test","path":"/metadata/finalizers/0","value":"y"},{"op":"remove","path":"/metadata/finalizers/0"}]"#;
        assert!(matches!(
            apply(&mut doc, PatchKind::Json, wrong),
            Err(PatchError::Failed(_))
        ));
    }

    #[test]
    fn merge_patch_removes_with_null() {
        let mut doc = json!({"spec": {"a": 1, "b": 2}});
        apply(&mut doc, PatchKind::Merge, br#"{"spec":{"a":null,"c":3}}"#).expect("merge");
        assert_eq!(doc, json!({"spec": {"b": 2, "c": 3}}));
        assert!(matches!(
            apply(&mut doc, PatchKind::Merge, b"[1]"),
            Err(PatchError::Malformed(_))
        ));
        assert!(matches!(
            apply(&mut doc, PatchKind::Json, b"{}"),
            Err(PatchError::Malformed(_))
        ));
    }
}
