//! The `scale` subresource of Runtimes: an `autoscaling/v1` Scale whose `spec.replicas` is
//! the Runtime's `spec.replicas`, so `kubectl scale runtime NAME --replicas N` works (GET,
//! PUT and PATCH, as on a real server for a CRD with `subresources.scale`).
//!
//! A write changes only `spec.replicas` of the Runtime, through the same admission and
//! optimistic concurrency as a write of the main resource: a Scale that carries
//! `metadata.resourceVersion` is refused with 409 when the Runtime changed meanwhile.

use axum::http::{Method, StatusCode, header};
use axum::response::Response;
use serde_json::{Value, json};

use super::handlers::{
    Ctx, commit_update, json_response, load, off_runtime, parse_body, patch_error,
};
use crate::error::{ApiError, Cause};
use crate::patch::{self, PatchKind};
use crate::store::Stored;

/// Answers one request on `NAME/scale`.
pub async fn handle(ctx: &Ctx<'_>, method: &Method, name: &str) -> Result<Response, ApiError> {
    match *method {
        Method::GET => {
            let current = load(ctx, name)?;
            Ok(json_response(StatusCode::OK, &scale_of(&current)))
        }
        Method::PUT => {
            let desired = parse_body(ctx).await?;
            let current = load(ctx, name)?;
            write(ctx, name, &current, &desired).await
        }
        Method::PATCH => {
            let content_type = ctx.header(header::CONTENT_TYPE).to_string();
            let kind = PatchKind::from_content_type(&content_type)
                .filter(|k| *k != PatchKind::Apply)
                .ok_or_else(|| ApiError::unsupported_media_type(&content_type))?;
            let def = ctx.def();
            let parsed = off_runtime(ctx.state, &ctx.body, move |b| patch::parse(kind, b))
                .await?
                .map_err(|e| patch_error(def, name, e))?;
            for _ in 0..16 {
                let current = load(ctx, name)?;
                let mut desired = scale_of(&current);
                patch::apply_parsed(&mut desired, &parsed)
                    .map_err(|e| patch_error(def, name, e))?;
                match write(ctx, name, &current, &desired).await {
                    Err(e) if e.code == StatusCode::CONFLICT && !pins_version(&parsed) => continue,
                    other => return other,
                }
            }
            Err(ApiError::conflict(def, name))
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

/// Whether a patch sets `metadata.resourceVersion` (then a conflict is the caller's).
fn pins_version(parsed: &patch::Parsed) -> bool {
    match parsed {
        patch::Parsed::Merge(value) => value.pointer("/metadata/resourceVersion").is_some(),
        _ => true,
    }
}

/// The Scale of a stored Runtime.
fn scale_of(stored: &Stored) -> Value {
    let object = &stored.object;
    let meta = |field: &str| object.pointer(&format!("/metadata/{field}")).cloned();
    let mut metadata = json!({"resourceVersion": stored.rv.to_string()});
    for field in ["name", "namespace", "uid", "creationTimestamp"] {
        if let Some(value) = meta(field) {
            metadata[field] = value;
        }
    }
    let spec_replicas = object
        .pointer("/spec/replicas")
        .and_then(Value::as_i64)
        .unwrap_or(1);
    let status_replicas = object
        .pointer("/status/replicas")
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let mut status = json!({"replicas": status_replicas});
    if let Some(selector) = object.pointer("/status/selector").and_then(Value::as_str) {
        status["selector"] = json!(selector);
    }
    json!({
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": metadata,
        "spec": {"replicas": spec_replicas},
        "status": status,
    })
}

/// Writes `desired` (a Scale) onto the Runtime `current`.
async fn write(
    ctx: &Ctx<'_>,
    name: &str,
    current: &Stored,
    desired: &Value,
) -> Result<Response, ApiError> {
    let def = ctx.def();
    if let Some(kind) = desired.get("kind").and_then(Value::as_str)
        && kind != "Scale"
    {
        return Err(ApiError::bad_request(format!(
            "the body must be an autoscaling/v1 Scale, not {kind}"
        )));
    }
    if let Some(rv) = desired
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        && !rv.is_empty()
        && rv.parse::<u64>().ok() != Some(current.rv)
    {
        return Err(ApiError::conflict(def, name));
    }
    let invalid = |message: &str| {
        ApiError::invalid(
            def,
            name,
            vec![Cause {
                reason: "FieldValueInvalid".into(),
                message: message.into(),
                field: "spec.replicas".into(),
            }],
        )
    };
    let replicas = desired
        .pointer("/spec/replicas")
        .and_then(Value::as_i64)
        .ok_or_else(|| invalid("Required value: an integer"))?;
    if !(0..=1000).contains(&replicas) {
        return Err(invalid("must be between 0 and 1000"));
    }
    let mut next = (*current.object).clone();
    match next.get_mut("spec").and_then(Value::as_object_mut) {
        Some(spec) => {
            spec.insert("replicas".into(), json!(replicas));
        }
        None => next["spec"] = json!({"replicas": replicas}),
    }
    commit_update(ctx, name, current, next, false).await?;
    let stored = load(ctx, name)?;
    Ok(json_response(StatusCode::OK, &scale_of(&stored)))
}
