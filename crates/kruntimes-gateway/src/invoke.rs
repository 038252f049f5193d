//! `POST /v1/namespaces/{ns}/runtimes/{runtime}/functions/{uid}:invoke`: one invocation of
//! a Ready function Run (design document 000, "Invoke Contract"; docs/function-mode.md).
//!
//! 1. The invocation ID (`X-Kruntime-Invocation-ID`, 1 to 128 bytes; generated when absent)
//!    is validated by [`invocation_id`], a middleware around every route, and echoed on
//!    every answer, 413 and 429 included.
//! 2. The bearer token (401 without one), the path (400), the body: one JSON value (400).
//! 3. The Run is looked up by UID in the watch-backed function cache of its Runtime
//!    ([`FunctionCaches`], the same [`Ownership`] cache runtimed keeps): unknown → 404.
//! 4. The caller must be allowed to `get` that Run ([`crate::Authorizer`], cached 30 s).
//! 5. A worker of the Runtime is chosen ([`InvokeRouting`]) and runtimed's `Invoke` is called
//!    with the credential and the bounded decision (`x-kruntimes-authorized-until`).
//!    runtimed decides readiness and ownership, and forwards once to the owner if needed.
//! 6. Nothing is retried after dispatch. A failed handler is a 200 whose body says
//!    `"outcome": "Failed"`; a platform failure is an error status with the error body.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use kruntimes_api::admission::is_dns1123_label;
use kruntimes_proto::runtime::v1 as rs;
use kruntimes_proto::runtimed::v1::InvokeRequest;
use kruntimes_proto::runtimed::v1::runtimed_client::RuntimedClient;
use kruntimes_runtimed::ownership::Ownership;
use serde::Serialize;
use serde_json::value::RawValue;
use tokio::task::JoinHandle;

use crate::authz::{DEFAULT_TTL, token_expiry};
use crate::error::HttpError;
use crate::logs::bearer_token;
use crate::metrics::GaugeGuard;
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
/// How long the first request of a Runtime waits for its cache to be listed.
const SYNC_WAIT: Duration = Duration::from_secs(5);
/// The most Runtimes whose function caches the gateway keeps.
const MAX_CACHES: usize = 256;
/// runtimed gets this much longer than the invocation timeout before the gateway gives up.
const CALL_SLACK: Duration = Duration::from_secs(10);

/// How the gateway picks the runtimed it calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum InvokeRouting {
    /// The owner's runtimed when the cache knows it; any ready worker otherwise (standalone).
    #[default]
    Owner,
    /// Any ready worker of the Runtime, in turn, as a Kubernetes Service would; the worker
    /// forwards to the owner.
    Service,
}

/// One Runtime's function cache and the task that keeps it.
struct Cached {
    ownership: Arc<Ownership>,
    task: JoinHandle<()>,
    used: Instant,
}

/// The function caches of the Runtimes invoked so far, started on first use, at most
/// [`MAX_CACHES`] (the least recently used is stopped first).
#[derive(Default)]
pub(crate) struct FunctionCaches {
    caches: Mutex<HashMap<(String, String), Cached>>,
    turn: AtomicUsize,
}

impl Drop for FunctionCaches {
    fn drop(&mut self) {
        for cached in self
            .caches
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
        {
            cached.task.abort();
        }
    }
}

impl FunctionCaches {
    async fn get(
        &self,
        client: &kube::Client,
        namespace: &str,
        runtime: &str,
    ) -> Result<Arc<Ownership>, HttpError> {
        let ownership = {
            let mut caches = self.caches.lock().unwrap_or_else(PoisonError::into_inner);
            let key = (namespace.to_string(), runtime.to_string());
            if let Some(cached) = caches.get_mut(&key) {
                cached.used = Instant::now();
                cached.ownership.clone()
            } else {
                if caches.len() >= MAX_CACHES
                    && let Some(oldest) = caches
                        .iter()
                        .min_by_key(|(_, c)| c.used)
                        .map(|(k, _)| k.clone())
                    && let Some(evicted) = caches.remove(&oldest)
                {
                    evicted.task.abort();
                }
                let ownership = Arc::new(Ownership::default());
                let task = tokio::spawn(ownership.clone().run_watches(
                    client.clone(),
                    namespace.to_string(),
                    runtime.to_string(),
                ));
                caches.insert(
                    key,
                    Cached {
                        ownership: ownership.clone(),
                        task,
                        used: Instant::now(),
                    },
                );
                ownership
            }
        };
        if !ownership.synced() && !ownership.wait_synced(SYNC_WAIT).await {
            return Err(HttpError::unavailable(format!(
                "the gateway's cache of Runtime {namespace}/{runtime} is not synced yet"
            )));
        }
        Ok(ownership)
    }
}

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
                return HttpError::bad_request(format!(
                    "the X-Kruntime-Invocation-ID header must be 1 to {MAX_INVOCATION_ID_BYTES} printable ASCII bytes"
                ))
                .into_response();
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
    if !is_dns1123_label(&namespace) || !is_dns1123_label(&runtime) {
        return Err(HttpError::bad_request(
            "the namespace and the Runtime must be DNS-1123 labels",
        ));
    }
    if uid.is_empty()
        || uid.len() > 64
        || !uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    {
        return Err(HttpError::bad_request(
            "the function is addressed by its Run UID",
        ));
    }
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

    let ownership = state
        .functions
        .get(&state.client, &namespace, &runtime)
        .await?;
    let entry = match ownership.run(uid) {
        Some(entry) if entry.serving() => Some(entry),
        // The cache may lag a moment behind the Ready the client has already seen.
        _ => {
            ownership
                .wait_serving(uid, kruntimes_runtimed::invoke::CACHE_GRACE)
                .await
        }
    };
    let entry = entry.ok_or_else(|| {
        HttpError::not_found(format!(
            "no function Run with UID {uid} in Runtime {namespace}/{runtime}"
        ))
    })?;
    state
        .authorizer
        .authorize(token, &namespace, &entry.name, uid)
        .await?;
    let until = decision_until(token);

    let (pod, addr) = pick_worker(state, &ownership, &entry)?;
    let mut call = tonic::Request::new(InvokeRequest {
        namespace: namespace.clone(),
        runtime: runtime.clone(),
        run_uid: uid.to_string(),
        invocation_id: invocation_id.clone(),
        payload: body.to_vec(),
        timeout: None,
        hops: 0,
        expected_attempt: 0,
        expected_pod_uid: String::new(),
    });
    let metadata = call.metadata_mut();
    if let Ok(value) = format!("Bearer {token}").parse() {
        metadata.insert("authorization", value);
    }
    if let Ok(value) = until.to_string().parse() {
        metadata.insert(kruntimes_runtimed::invoke::AUTHORIZED_UNTIL, value);
    }
    call.set_timeout(kruntimes_runtimed::invoke::DEFAULT_TIMEOUT + CALL_SLACK);
    let mut client = RuntimedClient::new(state.workers.get(&pod, addr)?);
    let response = match client.invoke(call).await {
        Ok(response) => response.into_inner(),
        Err(status) => {
            if status.code() == tonic::Code::Unavailable && status.message().contains("transport") {
                state.workers.forget(&pod, addr);
            }
            tracing::debug!(
                namespace, runtime, run_uid = uid, invocation_id, worker = %addr, pod,
                code = ?status.code(), "invocation refused"
            );
            return Err(map_status(&status));
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
            uid,
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

/// Until when runtimed may reuse this authorization (Unix milliseconds): the cache TTL, but
/// never past the token's own expiry.
fn decision_until(token: &str) -> u128 {
    let now = SystemTime::now();
    let mut until = now + DEFAULT_TTL;
    if let Some(expiry) = token_expiry(token) {
        until = until.min(expiry);
    }
    until
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// The runtimed to call, as its Pod name (what TLS verifies it as) and address: the owner
/// when routing by owner and the cache knows it, else any ready worker of the Runtime in
/// turn.
fn pick_worker(
    state: &AppState,
    ownership: &Ownership,
    entry: &kruntimes_runtimed::ownership::RunEntry,
) -> Result<(String, SocketAddr), HttpError> {
    if state.invoke_routing == InvokeRouting::Owner
        && let (Some(pod), Some(uid)) = (&entry.assigned_pod, &entry.assigned_pod_uid)
        && let Some(owner) = ownership.pod(pod)
        && owner.uid == *uid
        && owner.ready
        && !owner.deleting
        && let Some(addr) = owner.addr
    {
        return Ok((pod.clone(), addr));
    }
    let mut workers = ownership.ready_workers_named();
    if workers.is_empty() {
        return Err(HttpError::unavailable(
            "the function's Runtime has no ready worker",
        ));
    }
    let turn = state.functions.turn.fetch_add(1, Ordering::Relaxed);
    let index = turn % workers.len();
    Ok(workers.swap_remove(index))
}

/// The HTTP answer for a gRPC error of runtimed.
fn map_status(status: &tonic::Status) -> HttpError {
    use tonic::Code;
    let detail = status.message();
    match status.code() {
        Code::NotFound => HttpError::not_found(detail.to_string()),
        Code::InvalidArgument => HttpError::bad_request(detail.to_string()),
        Code::ResourceExhausted => HttpError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "TooManyRequests",
            format!("an invocation of this function is already in flight: {detail}"),
        ),
        Code::PermissionDenied => HttpError::forbidden(detail.to_string()),
        Code::Unavailable | Code::Aborted => HttpError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "NotReady",
            detail.to_string(),
        ),
        Code::DeadlineExceeded | Code::Cancelled => HttpError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "OutcomeUnknown",
            format!(
                "the worker did not answer in time; the invocation may or may not have run: {detail}"
            ),
        ),
        other => HttpError::bad_gateway(format!(
            "the worker failed ({other:?}); the invocation may or may not have run: {detail}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_errors_map_to_the_invoke_contract() {
        use tonic::Code;
        for (code, status) in [
            (Code::NotFound, StatusCode::NOT_FOUND),
            (Code::InvalidArgument, StatusCode::BAD_REQUEST),
            (Code::ResourceExhausted, StatusCode::TOO_MANY_REQUESTS),
            (Code::PermissionDenied, StatusCode::FORBIDDEN),
            (Code::Unavailable, StatusCode::SERVICE_UNAVAILABLE),
            (Code::Aborted, StatusCode::SERVICE_UNAVAILABLE),
            (Code::DeadlineExceeded, StatusCode::GATEWAY_TIMEOUT),
            (Code::Internal, StatusCode::BAD_GATEWAY),
        ] {
            assert_eq!(
                map_status(&tonic::Status::new(code, "x")).status(),
                status,
                "{code:?}"
            );
        }
    }

    #[test]
    fn decisions_never_outlive_the_ttl() {
        let until = decision_until("not-a-jwt");
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        assert!(until > now && until <= now + DEFAULT_TTL.as_millis() + 5);
    }

    #[test]
    fn generated_ids_are_fresh_and_short() {
        let (a, b) = (generated_id(), generated_id());
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
    }
}
