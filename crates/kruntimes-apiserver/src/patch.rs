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
    /// The patch is well formed but does not apply: a failed `test` or a bad path, or a
    /// result nested deeper than [`MAX_OBJECT_DEPTH`] (422).
    #[error("{0}")]
    Failed(String),
    /// The JSON patch has more than [`MAX_JSON_PATCH_OPERATIONS`] operations, or its
    /// `copy` and `move` operations take more than [`MAX_JSON_PATCH_COPIED`] (413).
    #[error("{0}")]
    TooLarge(String),
}

/// The most operations one JSON patch may carry (the Kubernetes API server's limit).
pub const MAX_JSON_PATCH_OPERATIONS: usize = 10_000;
/// The most a JSON patch's `copy` and `move` operations may take together, counted as
/// one per JSON value plus the bytes of each string and key. Without it a few dozen
/// `{"op":"copy","from":"","path":"/x"}` double the object each time.
pub const MAX_JSON_PATCH_COPIED: usize = 3 * 1024 * 1024;
/// The deepest nesting (objects and arrays) a patched object may reach: the depth
/// serde_json reads back, so the store can load what it wrote, and the recursive
/// clone, compare, serialise and drop of a value stay far from the stack's end.
pub const MAX_OBJECT_DEPTH: usize = 127;

/// A patch body, decoded once and applied to each try of an update.
#[derive(Debug, Clone)]
pub enum Parsed {
    /// A merge patch (JSON merge, strategic merge as a merge, or an apply body).
    Merge(Value),
    /// An RFC 6902 JSON patch, at most [`MAX_JSON_PATCH_OPERATIONS`] long.
    Json(Vec<json_patch::PatchOperation>),
}

/// Decodes `body` of `kind` (bounded, see [`crate::decode`]).
pub fn parse(kind: PatchKind, body: &[u8]) -> Result<Parsed, PatchError> {
    match kind {
        PatchKind::Merge | PatchKind::StrategicMerge => {
            let patch = crate::decode::json(body)
                .map_err(|e| PatchError::Malformed(format!("invalid merge patch: {e}")))?;
            if !patch.is_object() {
                return Err(PatchError::Malformed(
                    "a merge patch must be a JSON object".into(),
                ));
            }
            Ok(Parsed::Merge(patch))
        }
        PatchKind::Apply => {
            let patch = crate::decode::yaml_or_json(body)
                .map_err(|e| PatchError::Malformed(e.to_string()))?;
            if !patch.is_object() {
                return Err(PatchError::Malformed(
                    "an apply patch must be an object".into(),
                ));
            }
            Ok(Parsed::Merge(patch))
        }
        PatchKind::Json => {
            let ops: Vec<json_patch::PatchOperation> = serde_json::from_slice(body)
                .map_err(|e| PatchError::Malformed(format!("invalid JSON patch: {e}")))?;
            if ops.len() > MAX_JSON_PATCH_OPERATIONS {
                return Err(PatchError::TooLarge(format!(
                    "the allowed operations in a JSON patch is limited to {MAX_JSON_PATCH_OPERATIONS}, got {}",
                    ops.len()
                )));
            }
            Ok(Parsed::Json(ops))
        }
    }
}

/// Applies a decoded patch to `doc` in place.
pub fn apply_parsed(doc: &mut Value, patch: &Parsed) -> Result<(), PatchError> {
    match patch {
        Parsed::Merge(patch) => {
            json_patch::merge(doc, patch);
            Ok(())
        }
        Parsed::Json(ops) => {
            let mut copied = 0usize;
            for op in ops {
                check_growth(doc, op, &mut copied)?;
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

/// Applies `body` of `kind` to `doc` in place.
pub fn apply(doc: &mut Value, kind: PatchKind, body: &[u8]) -> Result<(), PatchError> {
    apply_parsed(doc, &parse(kind, body)?)
}

/// The nesting depth (0 for a scalar) and the size (one per value plus the bytes of each
/// string and key) of `value`, measured without recursion.
fn shape(value: &Value) -> (usize, usize) {
    let (mut depth, mut size) = (0, 0);
    let mut stack = vec![(value, 0usize)];
    while let Some((value, level)) = stack.pop() {
        size += 1;
        match value {
            Value::Array(items) => {
                depth = depth.max(level + 1);
                stack.extend(items.iter().map(|v| (v, level + 1)));
            }
            Value::Object(map) => {
                depth = depth.max(level + 1);
                for (key, v) in map {
                    size += key.len();
                    stack.push((v, level + 1));
                }
            }
            Value::String(text) => size += text.len(),
            Value::Null | Value::Bool(_) | Value::Number(_) => {}
        }
    }
    (depth, size)
}

/// Refuses an operation that would nest `doc` deeper than [`MAX_OBJECT_DEPTH`], or whose
/// `copy` or `move` would take the patch past [`MAX_JSON_PATCH_COPIED`] (`copied` is the
/// running total). Checked before each operation, so no intermediate document grows past
/// either bound. A value at a pointer of N tokens sits inside N objects or arrays.
fn check_growth(
    doc: &Value,
    op: &json_patch::PatchOperation,
    copied: &mut usize,
) -> Result<(), PatchError> {
    use json_patch::PatchOperation as Op;
    let tokens = |pointer: &str| pointer.matches('/').count();
    let (path, depth) = match op {
        Op::Add(add) => (add.path.as_str(), shape(&add.value).0),
        Op::Replace(replace) => (replace.path.as_str(), shape(&replace.value).0),
        Op::Move(json_patch::MoveOperation { from, path })
        | Op::Copy(json_patch::CopyOperation { from, path }) => {
            // A missing source is json_patch's error to report.
            let Some(source) = doc.pointer(from.as_str()) else {
                return Ok(());
            };
            let (depth, size) = shape(source);
            *copied = copied.saturating_add(size);
            if *copied > MAX_JSON_PATCH_COPIED {
                return Err(PatchError::TooLarge(format!(
                    "the copy and move operations of the JSON patch take more than {MAX_JSON_PATCH_COPIED} (values plus bytes of strings)"
                )));
            }
            (path.as_str(), depth)
        }
        Op::Remove(_) | Op::Test(_) => return Ok(()),
    };
    if tokens(path) + depth > MAX_OBJECT_DEPTH {
        return Err(PatchError::Failed(format!(
            "the JSON patch would nest the object deeper than {MAX_OBJECT_DEPTH} levels at {:?}",
            path.chars().take(256).collect::<String>()
        )));
    }
    Ok(())
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

    fn nested(depth: usize) -> Value {
        (0..depth).fold(json!(1), |inner, _| json!({ "a": inner }))
    }

    /// `copies` operations, each copying the whole object into a new member of itself.
    fn doubled(copies: usize) -> Vec<u8> {
        let ops: Vec<Value> = (0..copies)
            .map(|i| json!({"op": "copy", "from": "", "path": format!("/x{i}")}))
            .collect();
        serde_json::to_vec(&ops).expect("serialise")
    }

    /// Regression (fuzzing, json_patch target): each `copy` of the whole object into
    /// itself doubled it, so a 1 KiB patch of 40 copies asked for terabytes.
    #[test]
    fn json_patch_copies_cannot_double_the_object_without_bound() {
        let mut doc = json!({"metadata": {"name": "a", "labels": {"app": "web"}}, "spec": {"x": "y".repeat(100)}});
        // 16 doublings are 65536 copies (under 100 MB) without the bound: still safe to
        // run before the fix.
        let err = apply(&mut doc, PatchKind::Json, &doubled(16)).expect_err("must be refused");
        assert!(matches!(err, PatchError::TooLarge(_)), "{err:?}");
        // A few copies of a small object are fine.
        let mut doc = json!({"metadata": {"name": "a"}});
        apply(&mut doc, PatchKind::Json, &doubled(3)).expect("small copies apply");
    }

    /// Regression (fuzzing, json_patch target): `add` put a value of depth 100 inside
    /// another one, and the stored object was nested deeper than the store reads back
    /// (and, repeated, deeper than a recursive drop survives).
    #[test]
    fn json_patch_cannot_nest_the_object_deeper_than_the_store_reads() {
        let mut doc = json!({"metadata": {"name": "a"}, "spec": {}});
        let first = json!([{"op": "add", "path": "/spec/deep", "value": nested(100)}]);
        apply(&mut doc, PatchKind::Json, first.to_string().as_bytes()).expect("depth 102 applies");
        let inner = format!("/spec/deep{}", "/a".repeat(99));
        let second = json!([{"op": "add", "path": inner, "value": nested(100)}]);
        let err = apply(&mut doc, PatchKind::Json, second.to_string().as_bytes())
            .expect_err("must be refused");
        assert!(matches!(err, PatchError::Failed(_)), "{err:?}");
        // Moving a deep subtree below itself again is refused the same way.
        let moved = json!([
            {"op": "add", "path": "/spec/other", "value": {}},
            {"op": "move", "from": "/spec/deep", "path": format!("/spec/other{}", "/b".repeat(0))},
            {"op": "copy", "from": "/spec/other", "path": format!("/spec/other{}/x", "/a".repeat(60))}
        ]);
        let err = apply(&mut doc, PatchKind::Json, moved.to_string().as_bytes())
            .expect_err("must be refused");
        assert!(matches!(err, PatchError::Failed(_)), "{err:?}");
        // What does apply, the store reads back.
        let bytes = serde_json::to_vec(&doc).expect("serialise");
        serde_json::from_slice::<Value>(&bytes).expect("the store reads the object back");
    }

    /// The bound is exactly what serde_json reads back.
    #[test]
    fn max_object_depth_is_what_serde_json_reads() {
        let at = serde_json::to_vec(&nested(MAX_OBJECT_DEPTH)).expect("serialise");
        serde_json::from_slice::<Value>(&at).expect("MAX_OBJECT_DEPTH reads back");
        let over = serde_json::to_vec(&nested(MAX_OBJECT_DEPTH + 1)).expect("serialise");
        assert!(serde_json::from_slice::<Value>(&over).is_err());
    }

    #[test]
    fn json_patch_operations_are_bounded() {
        let op = json!({"op": "test", "path": "/metadata/name", "value": "a"});
        let mut doc = json!({"metadata": {"name": "a"}});
        let many =
            serde_json::to_vec(&vec![op.clone(); MAX_JSON_PATCH_OPERATIONS + 1]).expect("ser");
        assert!(matches!(
            apply(&mut doc, PatchKind::Json, &many),
            Err(PatchError::TooLarge(_))
        ));
        let most = serde_json::to_vec(&vec![op; MAX_JSON_PATCH_OPERATIONS]).expect("ser");
        apply(&mut doc, PatchKind::Json, &most).expect("the limit itself applies");
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
