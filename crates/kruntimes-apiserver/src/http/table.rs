//! `meta.k8s.io/v1` Table output for `kubectl get`.

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use crate::resources::{ResourceDef, TableKind};

/// The client asked for a Table.
pub fn wants_table(accept: &str) -> bool {
    accept.contains("as=Table")
}

/// Which object each row carries (`includeObject`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IncludeObject {
    None,
    Metadata,
    Object,
}

impl IncludeObject {
    pub fn parse(text: Option<&str>) -> IncludeObject {
        match text {
            Some("None") => IncludeObject::None,
            Some("Object") => IncludeObject::Object,
            _ => IncludeObject::Metadata,
        }
    }
}

fn column(name: &str, kind: &str, format: &str, description: &str) -> Value {
    json!({"name": name, "type": kind, "format": format, "description": description, "priority": 0})
}

fn columns(def: &ResourceDef) -> Vec<Value> {
    let name = column(
        "Name",
        "string",
        "name",
        "Name must be unique within a namespace.",
    );
    let age = column("Age", "date", "", "Time since the object was created.");
    match def.table {
        TableKind::Run => vec![
            name,
            column(
                "Runtime",
                "string",
                "",
                "The Runtime that executes the Run.",
            ),
            column("Mode", "string", "", "task, function or session."),
            column("Phase", "string", "", "The lifecycle phase."),
            column(
                "Reason",
                "string",
                "",
                "Why the Run waits: the reason of its first False condition.",
            ),
            age,
        ],
        TableKind::Snapshot => vec![
            name,
            column("Run", "string", "", "The session Run it captures."),
            column("Reason", "string", "", "Checkpoint, Suspend or Commit."),
            column(
                "Phase",
                "string",
                "",
                "Pending, Capturing, Ready or Failed.",
            ),
            column(
                "Size",
                "integer",
                "",
                "Bytes of the captured files, uncompressed.",
            ),
            column("Files", "integer", "", "Files captured."),
            age,
        ],
        TableKind::Workspace => vec![
            name,
            column("Head", "string", "", "The latest committed Snapshot."),
            column("Commits", "integer", "", "Commits made so far."),
            column(
                "Last-Used",
                "string",
                "",
                "When a session last restored or committed it.",
            ),
            age,
        ],
        TableKind::Runtime => vec![
            name,
            column("Replicas", "integer", "", "Desired workers."),
            column("Ready", "integer", "", "Ready workers."),
            age,
        ],
        TableKind::Namespace | TableKind::Pod => {
            vec![name, column("Status", "string", "", "The phase."), age]
        }
        TableKind::AccessToken => vec![
            name,
            column("User", "string", "", "Who the token authenticates as."),
            column("Expires", "string", "", "When the token stops working."),
            age,
        ],
        TableKind::Event => vec![
            column("Last Seen", "string", "", "When the event was last seen."),
            column("Type", "string", "", "Normal or Warning."),
            column("Reason", "string", "", "Why the event happened."),
            column("Object", "string", "", "The object the event is about."),
            column("Message", "string", "", "What happened."),
        ],
        TableKind::Plain => vec![name, age],
    }
}

/// A Kubernetes-style age: `45s`, `5m10s`, `3h`, `2d`.
pub fn age(created: Option<&str>, now: DateTime<Utc>) -> String {
    let Some(created) = created.and_then(|c| DateTime::parse_from_rfc3339(c).ok()) else {
        return "<unknown>".into();
    };
    let secs = (now - created.with_timezone(&Utc)).num_seconds().max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 600 => format!("{}m{}s", s / 60, s % 60),
        s if s < 3 * 3600 => format!("{}m", s / 60),
        s if s < 8 * 3600 => format!("{}h{}m", s / 3600, (s % 3600) / 60),
        s if s < 2 * 86400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

fn str_at<'a>(object: &'a Value, pointer: &str) -> &'a str {
    object
        .pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or("")
}

fn cells(def: &ResourceDef, object: &Value, now: DateTime<Utc>) -> Vec<Value> {
    let name = json!(str_at(object, "/metadata/name"));
    let age = json!(age(
        object
            .pointer("/metadata/creationTimestamp")
            .and_then(Value::as_str),
        now
    ));
    match def.table {
        TableKind::Run => {
            let mode = ["task", "function", "session"]
                .into_iter()
                .find(|m| object.pointer(&format!("/spec/mode/{m}")).is_some())
                .unwrap_or("");
            let phase = match str_at(object, "/status/phase") {
                "" => "Pending",
                p => p,
            };
            // As the CRD's printer column: `.status.conditions[?(@.status=="False")].reason`.
            let reason = object
                .pointer("/status/conditions")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .find(|c| c.get("status").and_then(Value::as_str) == Some("False"))
                .and_then(|c| c.get("reason").and_then(Value::as_str))
                .unwrap_or("");
            vec![
                name,
                json!(str_at(object, "/spec/runtime")),
                json!(mode),
                json!(phase),
                json!(reason),
                age,
            ]
        }
        TableKind::Snapshot => {
            let phase = match str_at(object, "/status/phase") {
                "" => "Pending",
                p => p,
            };
            let count = |pointer: &str| object.pointer(pointer).cloned().unwrap_or(json!(null));
            vec![
                name,
                json!(str_at(object, "/spec/source/run/name")),
                json!(match str_at(object, "/spec/reason") {
                    "" => "Checkpoint",
                    r => r,
                }),
                json!(phase),
                count("/status/sizeBytes"),
                count("/status/files"),
                age,
            ]
        }
        TableKind::Workspace => {
            // kubectl's word for an absent value: a Workspace never committed to has none.
            let or_none = |pointer: &str| match str_at(object, pointer) {
                "" => json!("<none>"),
                value => json!(value),
            };
            vec![
                name,
                or_none("/status/head/name"),
                object
                    .pointer("/status/commits")
                    .cloned()
                    .unwrap_or(json!(0)),
                or_none("/status/lastUsedTime"),
                age,
            ]
        }
        TableKind::Runtime => {
            let replicas = object
                .pointer("/spec/replicas")
                .cloned()
                .unwrap_or(json!(0));
            let ready = object
                .pointer("/status/readyReplicas")
                .cloned()
                .unwrap_or(json!(0));
            vec![name, replicas, ready, age]
        }
        TableKind::Namespace | TableKind::Pod => {
            vec![name, json!(str_at(object, "/status/phase")), age]
        }
        TableKind::AccessToken => {
            let expires = match str_at(object, "/spec/expirationTimestamp") {
                "" => "never",
                e => e,
            };
            vec![
                name,
                json!(str_at(object, "/spec/user/username")),
                json!(expires),
                age,
            ]
        }
        TableKind::Event => {
            let (seen, kind, reason, regarding, message) = crate::events::table_fields(object);
            vec![
                json!(crate::http::table::age(seen.as_deref(), now)),
                json!(kind),
                json!(reason),
                json!(regarding),
                json!(message),
            ]
        }
        TableKind::Plain => vec![name, age],
    }
}

fn row(def: &ResourceDef, object: &Value, include: IncludeObject, now: DateTime<Utc>) -> Value {
    let mut row = json!({"cells": cells(def, object, now)});
    match include {
        IncludeObject::None => {}
        IncludeObject::Metadata => {
            row["object"] = json!({
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": object.get("metadata").cloned().unwrap_or(json!({})),
            });
        }
        IncludeObject::Object => row["object"] = object.clone(),
    }
    row
}

/// A Table of `objects`.
pub fn table<'a>(
    def: &ResourceDef,
    objects: impl Iterator<Item = &'a Value>,
    resource_version: &str,
    continue_token: Option<&str>,
    include: IncludeObject,
) -> Value {
    let now = Utc::now();
    let rows: Vec<Value> = objects.map(|o| row(def, o, include, now)).collect();
    let mut metadata = json!({"resourceVersion": resource_version});
    if let Some(token) = continue_token {
        metadata["continue"] = json!(token);
    }
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": metadata,
        "columnDefinitions": columns(def),
        "rows": rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_like_kubectl() {
        let now = DateTime::parse_from_rfc3339("2026-01-01T12:00:00Z")
            .expect("time")
            .with_timezone(&Utc);
        let cases = [
            ("2026-01-01T11:59:15Z", "45s"),
            ("2026-01-01T11:55:00Z", "5m0s"),
            ("2026-01-01T11:00:00Z", "60m"),
            ("2026-01-01T07:30:00Z", "4h30m"),
            ("2025-12-30T12:00:00Z", "2d"),
        ];
        for (created, want) in cases {
            assert_eq!(age(Some(created), now), want, "{created}");
        }
        assert_eq!(age(None, now), "<unknown>");
    }
}
