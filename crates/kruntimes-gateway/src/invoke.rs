//! `POST /v1/namespaces/{ns}/runtimes/{runtime}/functions/{uid}:invoke`: one invocation of
//! a Ready function Run (design document 000, "Invoke Contract"; docs/function-mode.md).
//!
//! 1. The invocation ID (`X-Kruntime-Invocation-ID`, 1 to 128 bytes; generated when absent)
//!    is validated by [`invocation_id`], a middleware around every route, and echoed on
//!    every answer, 413 and 429 included.
//! 2. The bearer token (401 without one), the path (400), the body: one JSON value (400).
//! 3. The Run is routed as every call for a Run of a Runtime ([`crate::route`]): looked up
//!    by UID in the Runtime's watch-backed ownership cache (unknown or not serving → 404),
//!    authorized (`get`, cached 30 s), sent to a worker ([`crate::InvokeRouting`]) with the
//!    credential and the bounded decision. runtimed decides readiness and ownership, and
//!    forwards once to the owner if needed.
//! 4. Nothing is retried after dispatch. A failed handler is a 200 whose body says
//!    `"outcome": "Failed"`; a platform failure is an error status with the error body.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

use axum::body::{Body, Bytes};
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use kruntimes_proto::runtime::v1 as rs;
use kruntimes_proto::runtimed::v1::InvokeRequest;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::error::HttpError;
use crate::logs::bearer_token;
use crate::metrics::GaugeGuard;
use crate::route::{self, Call, RunPath, Serving, grpc_error};
use crate::server::AppState;

/// The header that carries the caller's invocation ID.
pub const INVOCATION_ID_HEADER: &str = "x-kruntime-invocation-id";
/// The header that names the worker Pod that ran the invocation.
pub const SERVED_BY_HEADER: &str = "x-kruntime-served-by";
/// The header that says whether runtimed forwarded the call to the owner (1) or not (0).
pub const HOPS_HEADER: &str = "x-kruntime-hops";
/// The longest invocation ID (ARCHITECTURE.md, "Limits").
pub const MAX_INVOCATION_ID_BYTES: usize = 128;
/// The route of an invocation.
pub const INVOKE_ROUTE: &str = "/v1/namespaces/{ns}/runtimes/{runtime}/functions/{target}";
/// runtimed gets this much longer than the invocation timeout before the gateway gives up.
const CALL_SLACK: Duration = Duration::from_secs(10);

/// Validates, or generates, the invocation ID of invoke requests and echoes it on every
/// answer. Other routes pass through untouched.
pub(crate) async fn invocation_id(mut request: Request, next: Next) -> Response {
    if !request.uri().path().contains("/functions/") {
        return next.run(request).await;
    }
    let id = match request.headers().get(INVOCATION_ID_HEADER) {
        Some(value) => {
            let valid = value.len() <= MAX_INVOCATION_ID_BYTES
                && !value.is_empty()
                && value
                    .to_str()
                    .is_ok_and(|v| v.chars().all(|c| c.is_ascii_graphic()));
            if !valid {
                let mut response = HttpError::bad_request(format!(
                    "the X-Kruntime-Invocation-ID header must be 1 to {MAX_INVOCATION_ID_BYTES} printable ASCII bytes"
                ))
                .into_response();
                // Every answer carries an ID; this one cannot echo the caller's, so it gets
                // a fresh one to quote.
                if let Ok(value) = HeaderValue::from_str(&generated_id()) {
                    response
                        .headers_mut()
                        .insert(HeaderName::from_static(INVOCATION_ID_HEADER), value);
                }
                return response;
            }
            value.clone()
        }
        None => {
            let generated = generated_id();
            match HeaderValue::from_str(&generated) {
                Ok(value) => {
                    request
                        .headers_mut()
                        .insert(INVOCATION_ID_HEADER, value.clone());
                    value
                }
                Err(_) => return HttpError::internal("invocation ID").into_response(),
            }
        }
    };
    let mut response = next.run(request).await;
    response
        .headers_mut()
        .insert(HeaderName::from_static(INVOCATION_ID_HEADER), id);
    response
}

/// A random invocation ID for callers that sent none: 32 hex digits.
fn generated_id() -> String {
    use sha2::{Digest, Sha256};
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let seed = format!(
        "{:?}-{}-{}",
        SystemTime::now(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    hex::encode(&Sha256::digest(seed.as_bytes())[..16])
}

/// The JSON body of an answered invocation.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct InvocationBody<'a> {
    invocation_id: &'a str,
    run: RunRef<'a>,
    /// `Succeeded`, `Failed` or `TimedOut`.
    outcome: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<ErrorBody<'a>>,
    stdout: std::borrow::Cow<'a, str>,
    stderr: std::borrow::Cow<'a, str>,
    duration_seconds: f64,
    served_by: &'a str,
    hops: u32,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct RunRef<'a> {
    namespace: &'a str,
    name: &'a str,
    uid: &'a str,
    attempt: u32,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    #[serde(rename = "type")]
    type_: &'a str,
    message: &'a str,
    traceback: &'a str,
}

/// The handler of [`INVOKE_ROUTE`].
pub(crate) async fn invoke(
    State(state): State<Arc<AppState>>,
    path: Result<Path<(String, String, String)>, PathRejection>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let _in_flight = GaugeGuard::new(&state.metrics.invocations_in_flight);
    let started = Instant::now();
    let token = match bearer_token(&headers) {
        Ok(token) => token,
        Err(e) => return e.into_response(),
    };
    let answer = serve(&state, path, &headers, body, token).await;
    let (response, result) = match answer {
        Ok((response, outcome)) => (response, outcome),
        Err(e) => {
            let e = e.scrubbed(token);
            let label = match e.status() {
                StatusCode::TOO_MANY_REQUESTS => "rejected",
                _ => "error",
            };
            (e.into_response(), label)
        }
    };
    state
        .metrics
        .count_invocation(result, started.elapsed().as_secs_f64());
    response
}

async fn serve(
    state: &AppState,
    path: Result<Path<(String, String, String)>, PathRejection>,
    headers: &HeaderMap,
    body: Bytes,
    token: &str,
) -> Result<(Response, &'static str), HttpError> {
    let Path((namespace, runtime, target)) =
        path.map_err(|e| HttpError::bad_request(format!("malformed path: {e}")))?;
    let uid = target.strip_suffix(":invoke").ok_or_else(|| {
        HttpError::not_found("no such route; invoke with .../functions/UID:invoke")
    })?;
    let path = RunPath::new(namespace, runtime, uid)?;
    if serde_json::from_slice::<serde::de::IgnoredAny>(&body).is_err() {
        return Err(HttpError::bad_request(
            "the request body must be one JSON value",
        ));
    }
    let invocation_id = headers
        .get(INVOCATION_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();

    let upstream = route::upstream(state, &path, token, Serving::Function).await?;
    let RunPath {
        namespace,
        runtime,
        uid,
    } = path;
    let mut call = upstream.request(
        InvokeRequest {
            namespace: namespace.clone(),
            runtime: runtime.clone(),
            run_uid: uid.clone(),
            invocation_id: invocation_id.clone(),
            payload: body.to_vec(),
            timeout: None,
            hops: 0,
            expected_attempt: 0,
            expected_pod_uid: String::new(),
        },
        token,
    );
    call.set_timeout(kruntimes_wire::worker::DEFAULT_INVOKE_TIMEOUT + CALL_SLACK);
    let response = match upstream.client.clone().invoke(call).await {
        Ok(response) => response.into_inner(),
        Err(status) => {
            upstream.failed(state, &status);
            tracing::debug!(
                namespace, runtime, run_uid = uid, invocation_id, worker = %upstream.addr,
                pod = upstream.pod, code = ?status.code(), "invocation refused"
            );
            return Err(grpc_error(&status, Call::INVOKE));
        }
    };
    let invocation = response.invocation.unwrap_or_default();
    let outcome = match invocation.outcome() {
        rs::InvocationOutcome::Succeeded => "Succeeded",
        rs::InvocationOutcome::Failed => "Failed",
        rs::InvocationOutcome::TimedOut => "TimedOut",
        rs::InvocationOutcome::Unspecified => {
            return Err(HttpError::bad_gateway(
                "the worker answered without an invocation outcome",
            ));
        }
    };
    let result =
        if outcome == "Succeeded" {
            let text = std::str::from_utf8(&invocation.result).map_err(|_| {
                HttpError::bad_gateway("the worker returned a result that is not UTF-8")
            })?;
            Some(serde_json::from_str::<&RawValue>(text).map_err(|_| {
                HttpError::bad_gateway("the worker returned a result that is not JSON")
            })?)
        } else {
            None
        };
    let error = invocation.error.as_ref();
    let tail = |t: &Option<rs::LogTail>| match t {
        Some(t) => String::from_utf8_lossy(&t.data).into_owned().into(),
        None => "".into(),
    };
    let body = InvocationBody {
        invocation_id: &invocation_id,
        run: RunRef {
            namespace: &namespace,
            name: &response.run_name,
            uid: &uid,
            attempt: response.attempt,
        },
        outcome,
        result,
        error: error.filter(|_| outcome != "Succeeded").map(|e| ErrorBody {
            type_: &e.r#type,
            message: &e.message,
            traceback: &e.traceback,
        }),
        stdout: tail(&invocation.stdout),
        stderr: tail(&invocation.stderr),
        duration_seconds: invocation
            .duration
            .and_then(|d| Duration::try_from(d).ok())
            .unwrap_or_default()
            .as_secs_f64(),
        served_by: &response.served_by,
        hops: response.hops,
    };
    let json = serde_json::to_vec(&body)
        .map_err(|e| HttpError::internal(format!("failed to encode the answer: {e}")))?;
    let mut http = Response::new(Body::from(json));
    let h = http.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Ok(value) = HeaderValue::from_str(&response.served_by) {
        h.insert(HeaderName::from_static(SERVED_BY_HEADER), value);
    }
    h.insert(
        HeaderName::from_static(HOPS_HEADER),
        HeaderValue::from(response.hops),
    );
    let label = match outcome {
        "Succeeded" => "succeeded",
        "Failed" => "failed",
        _ => "timed_out",
    };
    Ok((http, label))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_are_fresh_and_short() {
        let (a, b) = (generated_id(), generated_id());
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
    }
}
