//! Bounded decoding of request bodies. Every body is at most [`crate::http::MAX_BODY`]
//! bytes before it gets here; this module bounds what parsing it may cost.
//!
//! - JSON goes through `serde_json`, which refuses nesting beyond 128 levels as it reads.
//! - YAML goes through `serde-saphyr` with a [`Budget`]: nesting (block and flow) beyond
//!   [`MAX_DEPTH`] levels, more than [`MAX_YAML_NODES`] nodes, and alias expansion beyond
//!   its defaults are refused while streaming, so a hostile document is refused in time
//!   linear in the bytes read before the breach. `serde_yaml` (libyaml) parsed a whole
//!   document before checking its depth: 100,000 nested brackets cost seconds of CPU.
//! - Protobuf goes through `prost`, which has its own recursion limit, into a fixed set of
//!   shallow kinds ([`crate::protobuf`]).
//!
//! Even bounded, decoding a large body is CPU work: [`crate::http::handlers`] runs it on the
//! blocking pool, under a permit, for bodies over [`INLINE_DECODE`] bytes, so it never holds
//! an async worker that other requests need. This module never touches the store.

use serde_json::Value;
use serde_saphyr::budget::{Budget, BudgetBreach};

/// The deepest nesting of collections a YAML body may have. Kubernetes objects nest far
/// less (a Pod spec is about 15 levels).
pub const MAX_DEPTH: usize = 64;
/// The most nodes (scalars and collections) a YAML body may have.
pub const MAX_YAML_NODES: usize = 250_000;
/// Bodies up to this size are decoded in place; larger ones on the blocking pool.
pub const INLINE_DECODE: usize = 64 * 1024;

/// Why a body could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("the request body is nested deeper than {MAX_DEPTH} levels")]
    TooDeep,
    #[error("the request body is too large to decode: {0}")]
    OverBudget(String),
    #[error("the request body is not valid JSON: {0}")]
    Json(#[source] serde_json::Error),
    #[error("the request body is not valid YAML: {0}")]
    Yaml(String),
}

/// Decodes a JSON body.
pub fn json(body: &[u8]) -> Result<Value, DecodeError> {
    serde_json::from_slice(body).map_err(DecodeError::Json)
}

fn options() -> serde_saphyr::Options {
    let mut budget = Budget::default();
    budget.max_depth = MAX_DEPTH;
    budget.flow_nesting_limit = MAX_DEPTH;
    budget.max_nodes = MAX_YAML_NODES;
    budget.max_documents = 1;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    options
}

fn yaml_error(error: serde_saphyr::Error) -> DecodeError {
    // Without the snippet, which quotes the input back.
    let error = error.without_snippet();
    match error {
        serde_saphyr::Error::Budget {
            breach: BudgetBreach::Depth { .. },
            ..
        } => return DecodeError::TooDeep,
        serde_saphyr::Error::Budget { breach, .. } => {
            return DecodeError::OverBudget(format!("{breach:?}"));
        }
        serde_saphyr::Error::AliasExpansionLimitExceeded { .. }
        | serde_saphyr::Error::AliasReplayLimitExceeded { .. }
        | serde_saphyr::Error::AliasReplayStackDepthExceeded { .. } => {
            return DecodeError::OverBudget("alias expansion".into());
        }
        _ => {}
    }
    let text = error.to_string();
    let first = text.lines().next().unwrap_or("");
    let first = first.strip_prefix("error: ").unwrap_or(first);
    if first.contains("recursion limit exceeded") || first.contains("budget breached: Depth") {
        // The flow-nesting limit of the parser, below the depth budget, or a depth breach
        // reported through a wrapping error (an alias).
        return DecodeError::TooDeep;
    }
    if first.contains("budget breached") {
        return DecodeError::OverBudget(first.to_string());
    }
    DecodeError::Yaml(first.to_string())
}

/// Decodes a YAML body (JSON is YAML too, and is tried first).
pub fn yaml_or_json(body: &[u8]) -> Result<Value, DecodeError> {
    if let Ok(value) = serde_json::from_slice::<Value>(body) {
        return Ok(value);
    }
    serde_saphyr::from_slice_with_options::<Value>(body, options()).map_err(yaml_error)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use serde_json::json;

    use super::*;

    fn repeated(unit: &str, times: usize, tail: &str) -> Vec<u8> {
        let mut body = unit.repeat(times).into_bytes();
        body.extend_from_slice(tail.as_bytes());
        body
    }

    /// Issue 14 item 3: each nesting form YAML has (flow sequences and maps, compact block
    /// sequences, complex keys) is refused as too deep, at once.
    #[test]
    fn deep_yaml_of_every_form_is_refused_as_too_deep_quickly() {
        let cases = [
            ("flow sequences", {
                let mut b = repeated("[", 100_000, "");
                b.extend(repeated("]", 100_000, ""));
                b
            }),
            ("unclosed flow", repeated("[a, ", 100_000, "x")),
            ("flow maps", repeated("{a: ", 100_000, "x")),
            ("compact block sequences", repeated("- ", 100_000, "x")),
            ("complex keys", repeated("? ", 100_000, "x")),
        ];
        for (what, body) in cases {
            let started = Instant::now();
            let result = yaml_or_json(&body);
            assert!(
                matches!(result, Err(DecodeError::TooDeep)),
                "{what}: {result:?}"
            );
            // Generous, for debug builds on a loaded machine; it was seconds before.
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "{what} took {:?}",
                started.elapsed()
            );
        }
    }

    #[test]
    fn ordinary_yaml_and_json_decode() {
        let yaml = b"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: a\n  labels: {x: 'y'}\nspec:\n  finalizers: [kubernetes]\n";
        assert_eq!(
            yaml_or_json(yaml).expect("yaml"),
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "a", "labels": {"x": "y"}}, "spec": {"finalizers": ["kubernetes"]}})
        );
        assert_eq!(
            yaml_or_json(br#"{"a": [1]}"#).expect("json"),
            json!({"a": [1]})
        );
        let just_under = {
            let mut b = repeated("[", MAX_DEPTH - 1, "");
            b.extend(repeated("]", MAX_DEPTH - 1, ""));
            b.insert(0, b' ');
            b
        };
        assert!(yaml_or_json(&just_under).is_ok());
        assert!(matches!(
            yaml_or_json(b"a: [b\n"),
            Err(DecodeError::Yaml(_))
        ));
    }

    #[test]
    fn alias_expansion_is_bounded() {
        let mut body = String::from("a: &a [x, x, x, x, x, x, x, x, x]\n");
        for (name, prev) in [
            ("b", "a"),
            ("c", "b"),
            ("d", "c"),
            ("e", "d"),
            ("f", "e"),
            ("g", "f"),
            ("h", "g"),
        ] {
            body.push_str(&format!(
                "{name}: &{name} [{}]\n",
                vec![format!("*{prev}"); 9].join(", ")
            ));
        }
        let result = yaml_or_json(body.as_bytes());
        assert!(
            matches!(result, Err(DecodeError::OverBudget(_))),
            "{result:?}"
        );
    }
}
