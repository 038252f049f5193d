//! `GET /v1/namespaces/{ns}/runs/{name}/logs`: a Run's stdout or stderr, proxied from the
//! runtimed of the worker that runs it (docs/task-mode.md).
//!
//! 1. The bearer token comes from `Authorization` (missing or malformed: 401).
//! 2. The Run is read with the gateway's own identity, and the caller is authorized to
//!    `get` it ([`Authorizer::authorize`](crate::Authorizer::authorize)). A Run that does
//!    not exist is reported as 404 only to a caller who may `get` that name: the existence
//!    of Runs is no business of callers without access, so they get 401 or 403 either way.
//! 3. A Run not yet running on a worker is 409 `NotStarted`; with `follow=true` the gateway
//!    first watches that one Run for up to the configured start wait.
//! 4. The owner is the Pod `status.assignedPod`, if its UID is still
//!    `status.assignedPodUID` (otherwise the worker is gone: 409 `WorkerGone`), at its
//!    `status.podIP` and the container port named `runtimed`.
//! 5. runtimed's `RunLogs` is called with the caller's token, which runtimed authorizes
//!    again itself, and its chunks become the response body. With worker TLS
//!    configured ([`crate::GatewayConfig::worker_tls`]) the call uses mutual TLS and the
//!    worker must prove it is the assigned Pod (its certificate names it); without, plain
//!    HTTP/2.
//!
//! gRPC errors before the first byte become HTTP errors: `NOT_FOUND` 404,
//! `FAILED_PRECONDITION` 409, `INVALID_ARGUMENT` 400, `UNAUTHENTICATED` 401,
//! `PERMISSION_DENIED` 403, `UNAVAILABLE` and deadlines 503,
//! anything else 502. Without `follow`, the gateway waits for the first chunk before it
//! answers, so an error the worker reports as the stream's first item maps too; with
//! `follow`, it answers 200 as soon as runtimed accepts the call (the first output may be
//! minutes away), so runtimed reports request errors as the call's status. An error after
//! the response started ends the body abnormally: the client sees a truncated chunked body
//! (HTTP/1.1) or a reset stream (HTTP/2), never a clean end.
//!
//! A following stream re-authorizes its caller whenever a revocation flushes the
//! authorizer's cache ([`Authorizer::invalidations`](crate::Authorizer::invalidations)),
//! and every cache TTL as a backstop, while it streams or waits for output. A 401 or 403
//! ends it like a failing worker does (a truncated body, or a reset HTTP/2 stream); a
//! client that asks again gets that 401 or 403 as an ordinary error answer. An
//! unavailable API server leaves the stream to the next re-check.
//!
//! `attempt=N` is passed to runtimed as is; the gateway always asks the worker the Run is
//! assigned to now, which knows the attempts it ran itself.
//!
//! When that worker is gone (4. fails) or does not hold the attempt (runtimed answers
//! `NOT_FOUND`; with `follow`, only once the Run ended), the gateway reads the attempt from the log store instead
//! ([`crate::log_store`]): the logs of finished Runs outlive their workers and restarts of
//! `kruntimes up`. A finished Run whose logs are in no store is 410 `LogsGone`.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::pin::pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kruntimes_api::admission::{is_dns1123_label, is_dns1123_subdomain};
use kruntimes_api::{Phase, Run};
use kruntimes_proto::runtime::v1::{LogChunk, LogStream};
use kruntimes_proto::runtimed::v1::RunLogsRequest;
use kruntimes_proto::runtimed::v1::runtimed_client::RuntimedClient;
use kruntimes_wire::worker::{WorkerTls, worker_channel, worker_identity};
use kube::ResourceExt;
use kube::api::{Api, WatchEvent, WatchParams};
use tokio::sync::watch;
use tokio::time::Instant;
use tonic::transport::Channel;

use crate::authz::AuthzError;
use crate::error::HttpError;
use crate::metrics::{GaugeGuard, Metrics};
use crate::server::AppState;

/// The name of the worker Pod's container port that runtimed listens on.
pub const RUNTIMED_PORT_NAME: &str = "runtimed";

/// How long connecting to a worker's runtimed may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long runtimed may take to accept a `RunLogs` call (and, without `follow`, to send
/// the first chunk).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How many worker channels the gateway keeps open at most.
const MAX_CHANNELS: usize = 256;
/// Watches of one Run while waiting for it to start ask the server to end them after at
/// most this long; the wait then resumes with a new watch.
const MAX_WATCH_SECONDS: u32 = 290;

// ---------------------------------------------------------------------------------------
// The request
// ---------------------------------------------------------------------------------------

/// What the query string asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct LogsQuery {
    stream: LogStream,
    follow: bool,
    /// 0 means the Run's current attempt.
    attempt: u32,
}

impl LogsQuery {
    fn parse(pairs: &[(String, String)]) -> Result<LogsQuery, HttpError> {
        let mut query = LogsQuery {
            stream: LogStream::Stdout,
            follow: false,
            attempt: 0,
        };
        let mut seen: Vec<&str> = Vec::new();
        for (key, value) in pairs {
            if seen.contains(&key.as_str()) {
                return Err(HttpError::bad_request(format!(
                    "query parameter {key:?} is given more than once"
                )));
            }
            match key.as_str() {
                "stream" => {
                    query.stream = match value.as_str() {
                        "stdout" => LogStream::Stdout,
                        "stderr" => LogStream::Stderr,
                        _ => {
                            return Err(HttpError::bad_request(
                                "query parameter \"stream\" must be stdout or stderr",
                            ));
                        }
                    }
                }
                "follow" => {
                    query.follow = match value.as_str() {
                        "true" => true,
                        "false" => false,
                        _ => {
                            return Err(HttpError::bad_request(
                                "query parameter \"follow\" must be true or false",
                            ));
                        }
                    }
                }
                "attempt" => {
                    query.attempt = value.parse::<u32>().map_err(|_| {
                        HttpError::bad_request(
                            "query parameter \"attempt\" must be a number from 1 (0 or absent: the current attempt)",
                        )
                    })?;
                }
                other => {
                    return Err(HttpError::bad_request(format!(
                        "unknown query parameter {:?}; the logs take stream, follow and attempt",
                        other.chars().take(64).collect::<String>()
                    )));
                }
            }
            seen.push(key);
        }
        Ok(query)
    }
}

/// The bearer token of the request; 401 when there is none or it is malformed.
pub(crate) fn bearer_token(headers: &HeaderMap) -> Result<&str, HttpError> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let Some(value) = values.next() else {
        return Err(HttpError::unauthorized(
            "this request needs an Authorization: Bearer <token> header",
        ));
    };
    if values.next().is_some() {
        return Err(HttpError::unauthorized(
            "the request has more than one Authorization header",
        ));
    }
    let malformed =
        || HttpError::unauthorized("the Authorization header is not \"Bearer <token>\"");
    let text = value.to_str().map_err(|_| malformed())?;
    let (scheme, token) = text.trim().split_once(' ').ok_or_else(malformed)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer")
        || token.is_empty()
        || token.contains(|c: char| c.is_ascii_whitespace())
    {
        return Err(malformed());
    }
    Ok(token)
}

/// The handler of [`crate::server::LOGS_ROUTE`].
pub(crate) async fn logs(
    State(state): State<Arc<AppState>>,
    path: Result<Path<(String, String)>, PathRejection>,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
    headers: HeaderMap,
) -> Response {
    let token = match bearer_token(&headers) {
        Ok(token) => token,
        Err(e) => return e.into_response(),
    };
    match serve_logs(&state, path, query, token).await {
        Ok(response) => response,
        Err(e) => e.scrubbed(token).into_response(),
    }
}

async fn serve_logs(
    state: &AppState,
    path: Result<Path<(String, String)>, PathRejection>,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
    token: &str,
) -> Result<Response, HttpError> {
    let Path((namespace, name)) =
        path.map_err(|e| HttpError::bad_request(format!("malformed path: {e}")))?;
    if !is_dns1123_label(&namespace) {
        return Err(HttpError::bad_request(
            "the namespace must be a DNS-1123 label",
        ));
    }
    if !is_dns1123_subdomain(&name) {
        return Err(HttpError::bad_request(
            "the Run name must be a DNS-1123 subdomain",
        ));
    }
    let Query(pairs) =
        query.map_err(|e| HttpError::bad_request(format!("malformed query: {e}")))?;
    let query = LogsQuery::parse(&pairs)?;
    // Subscribed before the caller is authorized, so that a revocation between the two is
    // seen by the stream.
    let invalidations = state.authorizer.invalidations();

    let runs: Api<Run> = Api::namespaced(state.client.clone(), &namespace);
    let run = match runs.get_opt(&name).await {
        Ok(run) => run,
        Err(e) => return Err(api_unavailable("read the Run", &e)),
    };
    let Some(run) = run else {
        // Only a caller who may get this name learns that it does not exist.
        state
            .authorizer
            .authorize(token, &namespace, &name, "")
            .await?;
        return Err(run_not_found(&namespace, &name));
    };
    let run_uid = run.uid().unwrap_or_default();
    state
        .authorizer
        .authorize(token, &namespace, &name, &run_uid)
        .await?;

    let assignment = match placement(&run) {
        Placement::OnWorker(assignment) => assignment,
        Placement::NotYet(_) if query.follow => wait_for_start(state, &runs, &run).await?,
        Placement::NotYet(phase) => {
            return Err(HttpError::not_started(format!(
                "Run {namespace}/{name} is {phase} and not running on a worker yet; ask with follow=true to wait for it"
            )));
        }
        Placement::Never(phase) => return Err(never_started(&namespace, &name, phase)),
    };

    let addr = match resolve_owner(state, &namespace, &name, &assignment).await {
        Ok(addr) => addr,
        Err(e) if e.reason() == "WorkerGone" => {
            return crate::log_store::serve(state, &run, query.stream, query.attempt, e).await;
        }
        Err(e) => return Err(e),
    };
    let recheck = query.follow.then(|| Recheck {
        authorizer: state.authorizer.clone(),
        invalidations,
        backstop: backstop(),
        token: token.to_string(),
        namespace: namespace.clone(),
        name: name.clone(),
        run_uid: run_uid.clone(),
    });
    let request = RunLogsRequest {
        namespace: namespace.clone(),
        name: name.clone(),
        run_uid,
        attempt: query.attempt,
        stream: query.stream as i32,
        follow: query.follow,
        offset: 0,
    };
    let body = match call_run_logs(state, &assignment.pod, addr, request, token, recheck).await {
        Ok(body) => body,
        // An attempt the worker no longer holds (it forgets the earlier attempts of a
        // retried Run) may still be in the log store. With follow, only once the Run
        // ended: before, a worker that has just been assigned the Run may not know it yet,
        // and the stored file would end the stream early.
        Err(e)
            if e.status() == axum::http::StatusCode::NOT_FOUND
                && (!query.follow || run.phase().is_terminal()) =>
        {
            return crate::log_store::serve(state, &run, query.stream, query.attempt, e).await;
        }
        Err(e) => return Err(e),
    };
    tracing::debug!(namespace, run = name, worker = %addr, follow = query.follow, "streaming Run logs");
    Ok(octet_stream(body))
}

/// An answer of raw bytes: never sniffed, never cached.
pub(crate) fn octet_stream(body: Body) -> Response {
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
}

fn run_not_found(namespace: &str, name: &str) -> HttpError {
    HttpError::not_found(format!(
        "runs.kruntimes.io \"{name}\" not found in namespace \"{namespace}\""
    ))
}

fn api_unavailable(what: &str, error: &kube::Error) -> HttpError {
    tracing::warn!(error = %error, "the gateway could not {what}");
    HttpError::unavailable(format!("the gateway could not {what}: {error}"))
}

// ---------------------------------------------------------------------------------------
// Where the Run runs
// ---------------------------------------------------------------------------------------

/// The worker a Run is assigned to.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Assignment {
    pod: String,
    pod_uid: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Placement {
    /// Running, or was, on this worker.
    OnWorker(Assignment),
    /// Not running on a worker yet; it may still start.
    NotYet(Phase),
    /// Ended without ever running on a worker.
    Never(Phase),
}

fn placement(run: &Run) -> Placement {
    let assignment = run.status.as_ref().and_then(|status| {
        let pod = status.assigned_pod.as_deref().filter(|p| !p.is_empty())?;
        let pod_uid = status
            .assigned_pod_uid
            .as_deref()
            .filter(|u| !u.is_empty())?;
        Some(Assignment {
            pod: pod.to_string(),
            pod_uid: pod_uid.to_string(),
        })
    });
    let phase = run.phase();
    match phase {
        // Scheduled has an assignedPod, but its runtimed has not claimed the Run yet; a
        // Suspended session is on no worker until it is resumed and placed again.
        Phase::Pending | Phase::Scheduled | Phase::Suspended => Placement::NotYet(phase),
        Phase::Running | Phase::Ready | Phase::Finalizing => {
            assignment.map_or(Placement::NotYet(phase), Placement::OnWorker)
        }
        Phase::Succeeded | Phase::Failed | Phase::Timeout | Phase::Cancelled => {
            assignment.map_or(Placement::Never(phase), Placement::OnWorker)
        }
    }
}

fn never_started(namespace: &str, name: &str, phase: Phase) -> HttpError {
    HttpError::not_started(format!(
        "Run {namespace}/{name} ended {phase} without running on a worker; it has no logs"
    ))
}

/// Watches the Run until it runs on a worker, for at most `wait`.
async fn wait_for_start(
    state: &AppState,
    runs: &Api<Run>,
    run: &Run,
) -> Result<Assignment, HttpError> {
    let _waiting = GaugeGuard::new(&state.metrics.waiting_for_start);
    let wait = state.start_wait;
    let namespace = run.namespace().unwrap_or_default();
    let name = run.name_any();
    let uid = run.uid();
    let deadline = Instant::now() + wait;
    let timed_out = || {
        HttpError::not_started(format!(
            "Run {namespace}/{name} did not start running on a worker within {}s",
            wait.as_secs()
        ))
    };
    let gone = || {
        HttpError::not_found(format!(
            "Run {namespace}/{name} was deleted while waiting for it to start"
        ))
    };
    // Whether a version of the Run settles the wait.
    let settle = |run: &Run| -> Option<Result<Assignment, HttpError>> {
        if run.uid() != uid {
            return Some(Err(gone()));
        }
        match placement(run) {
            Placement::OnWorker(assignment) => Some(Ok(assignment)),
            Placement::NotYet(_) => None,
            Placement::Never(phase) => Some(Err(never_started(&namespace, &name, phase))),
        }
    };
    let mut version = run.resource_version().unwrap_or_default();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out());
        }
        let seconds = u32::try_from(left.as_secs().saturating_add(1))
            .unwrap_or(MAX_WATCH_SECONDS)
            .min(MAX_WATCH_SECONDS);
        let params = WatchParams::default()
            .fields(&format!("metadata.name={name}"))
            .timeout(seconds);
        let events = match tokio::time::timeout_at(deadline, runs.watch(&params, &version)).await {
            Err(_) => return Err(timed_out()),
            Ok(Err(e)) => return Err(api_unavailable("watch the Run", &e)),
            Ok(Ok(events)) => events,
        };
        let mut events = pin!(events);
        loop {
            let event = match tokio::time::timeout_at(deadline, events.try_next()).await {
                Err(_) => return Err(timed_out()),
                Ok(Err(e)) => return Err(api_unavailable("watch the Run", &e)),
                // The server ended the watch; resume from the last version seen.
                Ok(Ok(None)) => break,
                Ok(Ok(Some(event))) => event,
            };
            match event {
                WatchEvent::Added(run) | WatchEvent::Modified(run) => {
                    if let Some(settled) = settle(&run) {
                        return settled;
                    }
                    version = run.resource_version().unwrap_or(version);
                }
                WatchEvent::Deleted(_) => return Err(gone()),
                WatchEvent::Bookmark(bookmark) => {
                    version = bookmark.metadata.resource_version;
                }
                WatchEvent::Error(status) if status.code == 410 => {
                    // Our version was compacted away: read the Run afresh and watch on.
                    let current = match runs.get_opt(&name).await {
                        Ok(Some(current)) => current,
                        Ok(None) => return Err(gone()),
                        Err(e) => return Err(api_unavailable("read the Run", &e)),
                    };
                    if let Some(settled) = settle(&current) {
                        return settled;
                    }
                    version = current.resource_version().unwrap_or_default();
                    break;
                }
                WatchEvent::Error(status) => {
                    tracing::warn!(code = status.code, reason = %status.reason, "watching a Run failed");
                    return Err(HttpError::unavailable(format!(
                        "the gateway could not watch the Run: {} {}",
                        status.code, status.message
                    )));
                }
            }
        }
    }
}

/// The address of the runtimed that owns `assignment`.
async fn resolve_owner(
    state: &AppState,
    namespace: &str,
    name: &str,
    assignment: &Assignment,
) -> Result<SocketAddr, HttpError> {
    let pods: Api<Pod> = Api::namespaced(state.client.clone(), namespace);
    let pod = match pods.get_opt(&assignment.pod).await {
        Ok(pod) => pod,
        Err(e) => return Err(api_unavailable("read the worker Pod", &e)),
    };
    let worker_gone = || {
        HttpError::worker_gone(format!(
            "the worker that ran Run {namespace}/{name} (Pod {}, UID {}) is gone; its logs are no longer available",
            assignment.pod, assignment.pod_uid
        ))
    };
    let Some(pod) = pod else {
        return Err(worker_gone());
    };
    if pod.uid().as_deref() != Some(assignment.pod_uid.as_str()) {
        return Err(worker_gone());
    }
    let unreachable = |why: &str| {
        HttpError::unavailable(format!(
            "the worker of Run {namespace}/{name} (Pod {}) cannot be reached: {why}",
            assignment.pod
        ))
    };
    let ip = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .filter(|ip| !ip.is_empty())
        .ok_or_else(|| unreachable("the Pod has no IP yet"))?;
    let ip: IpAddr = ip
        .parse()
        .map_err(|_| unreachable("the Pod's IP is malformed"))?;
    let port = pod
        .spec
        .as_ref()
        .into_iter()
        .flat_map(|spec| spec.containers.iter())
        .flat_map(|container| container.ports.iter().flatten())
        .find(|port| port.name.as_deref() == Some(RUNTIMED_PORT_NAME))
        .map(|port| port.container_port)
        .ok_or_else(|| unreachable("the Pod has no container port named runtimed"))?;
    let port = u16::try_from(port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| unreachable("the Pod's runtimed port is out of range"))?;
    Ok(SocketAddr::new(ip, port))
}

// ---------------------------------------------------------------------------------------
// runtimed
// ---------------------------------------------------------------------------------------

/// A worker: its identity (what TLS verifies it as, `worker_identity`) and its runtimed's
/// address.
type WorkerKey = (String, SocketAddr);

/// Channels to workers' runtimeds, one per worker identity and address, at most
/// [`MAX_CHANNELS`]
/// (the oldest goes first). A channel connects lazily and reconnects by itself. With TLS,
/// each presents the gateway's client certificate and verifies the worker as its worker
/// identity (its Pod name in its namespace, `worker_identity`).
pub(crate) struct WorkerChannels {
    tls: Option<WorkerTls>,
    channels: Mutex<VecDeque<(WorkerKey, Channel)>>,
}

impl WorkerChannels {
    /// Channels with mutual TLS when `tls` is given, plaintext otherwise.
    pub(crate) fn new(tls: Option<WorkerTls>) -> WorkerChannels {
        WorkerChannels {
            tls,
            channels: Mutex::default(),
        }
    }

    /// The channel to worker Pod `pod` of `namespace` at `addr`.
    pub(crate) fn get(
        &self,
        namespace: &str,
        pod: &str,
        addr: SocketAddr,
    ) -> Result<Channel, HttpError> {
        let identity = worker_identity(namespace, pod);
        let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, channel)) = channels
            .iter()
            .find(|((i, a), _)| *i == identity && *a == addr)
        {
            return Ok(channel.clone());
        }
        let channel = worker_channel(addr, &identity, self.tls.as_ref(), CONNECT_TIMEOUT)
            .map_err(|e| {
                tracing::warn!(pod, worker = %addr, error = %e, "cannot configure a worker channel");
                HttpError::unavailable(format!("worker {pod} cannot be reached: {e}"))
            })?;
        if channels.len() >= MAX_CHANNELS {
            channels.pop_front();
        }
        channels.push_back(((identity, addr), channel.clone()));
        Ok(channel)
    }

    /// Drops the channel to worker Pod `pod` of `namespace` at `addr`.
    pub(crate) fn forget(&self, namespace: &str, pod: &str, addr: SocketAddr) {
        let identity = worker_identity(namespace, pod);
        self.channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|((i, a), _)| !(*i == identity && *a == addr));
    }
}

/// The HTTP answer for a gRPC error of runtimed.
fn map_status(status: &tonic::Status, addr: SocketAddr) -> HttpError {
    use tonic::Code;
    let detail = status.message();
    match status.code() {
        Code::NotFound => HttpError::not_found(format!("the worker has no such logs: {detail}")),
        Code::FailedPrecondition => {
            HttpError::conflict(format!("the worker cannot serve these logs: {detail}"))
        }
        Code::InvalidArgument => {
            HttpError::bad_request(format!("the worker refused the request: {detail}"))
        }
        Code::Unauthenticated => {
            HttpError::unauthorized(format!("the worker refused the caller: {detail}"))
        }
        Code::PermissionDenied => {
            HttpError::forbidden(format!("the worker refused the caller: {detail}"))
        }
        Code::Unavailable | Code::DeadlineExceeded => {
            HttpError::unavailable(format!("the worker at {addr} is unavailable: {detail}"))
        }
        other => {
            HttpError::bad_gateway(format!("the worker at {addr} failed: {other:?}: {detail}"))
        }
    }
}

/// Calls `RunLogs` and turns its chunks into a response body.
async fn call_run_logs(
    state: &AppState,
    pod: &str,
    addr: SocketAddr,
    request: RunLogsRequest,
    token: &str,
    recheck: Option<Recheck>,
) -> Result<Body, HttpError> {
    let follow = request.follow;
    let namespace = request.namespace.clone();
    let mut client = RuntimedClient::new(state.workers.get(&namespace, pod, addr)?);
    let request = crate::route::with_token(request, token);
    let call = async {
        let mut stream = client.run_logs(request).await?.into_inner();
        // Without follow the whole stream is already written: wait for its first item, so
        // that an error there still becomes an HTTP error.
        let first = if follow {
            None
        } else {
            stream.message().await?
        };
        Ok::<_, tonic::Status>((stream, first, follow))
    };
    let (stream, first, follow) = match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(status)) => {
            if status.code() == tonic::Code::Unavailable {
                state.workers.forget(&namespace, pod, addr);
            }
            tracing::debug!(worker = %addr, code = ?status.code(), "RunLogs failed");
            return Err(map_status(&status, addr));
        }
        Err(_) => {
            return Err(HttpError::unavailable(format!(
                "the worker at {addr} did not answer within {}s",
                CALL_TIMEOUT.as_secs()
            )));
        }
    };
    // A stream that ended at once (`first` is None without follow) is an empty body.
    let ended = !follow && first.is_none();
    let chunks = ChunkStream {
        first,
        stream,
        ended,
        shutdown: state.shutdown.clone(),
        recheck,
        metrics: state.metrics.clone(),
        addr,
    };
    Ok(Body::from_stream(
        futures::stream::unfold(chunks, ChunkStream::next).boxed(),
    ))
}

/// A TTL interval whose first tick is one TTL from now.
fn backstop() -> tokio::time::Interval {
    let ttl = crate::authz::DEFAULT_TTL;
    let mut interval = tokio::time::interval_at(Instant::now() + ttl, ttl);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval
}

/// What a following stream needs to authorize its caller again: on every flush of the
/// authorizer's cache, and every TTL. Holds the caller's token in memory for as long as
/// the stream is open; it is never logged.
struct Recheck {
    authorizer: Arc<crate::Authorizer>,
    invalidations: watch::Receiver<u64>,
    backstop: tokio::time::Interval,
    token: String,
    namespace: String,
    name: String,
    run_uid: String,
}

impl Recheck {
    /// Resolves when the caller should be authorized again.
    async fn due(&mut self) {
        tokio::select! {
            Ok(()) = self.invalidations.changed() => {}
            _ = self.backstop.tick() => {}
        }
    }

    /// `Some(status)` when the caller may no longer get the Run (401 or 403); `None` when
    /// it still may, or the API server could not say (the next re-check asks again).
    async fn revoked(&self) -> Option<u16> {
        match self
            .authorizer
            .authorize(&self.token, &self.namespace, &self.name, &self.run_uid)
            .await
        {
            Ok(_) => None,
            Err(e @ (AuthzError::Unauthenticated | AuthzError::Forbidden { .. })) => {
                Some(e.http_status())
            }
            Err(AuthzError::Unavailable(e)) => {
                tracing::debug!(error = %e, "re-authorizing a logs stream failed; streaming on");
                None
            }
        }
    }
}

/// Resolves when `recheck` is due; never without one.
async fn recheck_due(recheck: &mut Option<Recheck>) {
    match recheck {
        Some(recheck) => recheck.due().await,
        None => std::future::pending().await,
    }
}

/// What ended a wait of [`ChunkStream::next`].
enum Next {
    Shutdown,
    Recheck,
    Item(Result<Option<LogChunk>, tonic::Status>),
}

/// The state of one proxied logs stream.
struct ChunkStream {
    first: Option<LogChunk>,
    stream: tonic::Streaming<LogChunk>,
    ended: bool,
    shutdown: watch::Receiver<bool>,
    /// Only a following stream re-checks its caller.
    recheck: Option<Recheck>,
    metrics: Arc<Metrics>,
    addr: SocketAddr,
}

impl ChunkStream {
    fn yield_chunk(self, chunk: LogChunk) -> Option<(Result<Bytes, std::io::Error>, ChunkStream)> {
        self.metrics.log_bytes.inc_by(chunk.data.len() as u64);
        Some((Ok(Bytes::from(chunk.data)), self))
    }

    fn fail(mut self, why: String) -> Option<(Result<Bytes, std::io::Error>, ChunkStream)> {
        self.ended = true;
        self.metrics.log_streams_failed.inc();
        Some((Err(std::io::Error::other(why)), self))
    }

    async fn next(mut self) -> Option<(Result<Bytes, std::io::Error>, ChunkStream)> {
        if let Some(first) = self.first.take()
            && !first.data.is_empty()
        {
            return self.yield_chunk(first);
        }
        if self.ended {
            return None;
        }
        loop {
            let next = tokio::select! {
                biased;
                _ = self.shutdown.wait_for(|stopping| *stopping) => Next::Shutdown,
                () = recheck_due(&mut self.recheck) => Next::Recheck,
                item = self.stream.message() => Next::Item(item),
            };
            let item = match next {
                Next::Shutdown => return self.fail("the gateway is shutting down".to_string()),
                Next::Recheck => {
                    let Some(recheck) = &self.recheck else {
                        continue;
                    };
                    if let Some(status) = recheck.revoked().await {
                        tracing::debug!(
                            namespace = recheck.namespace,
                            run = recheck.name,
                            status,
                            "a following logs stream's authorization was revoked; ending it"
                        );
                        self.ended = true;
                        self.metrics.log_streams_revoked.inc();
                        let why = format!(
                            "the caller's authorization was revoked ({status}); ask again with a token that may get this Run"
                        );
                        return Some((Err(std::io::Error::other(why)), self));
                    }
                    continue;
                }
                Next::Item(item) => item,
            };
            match item {
                Ok(Some(chunk)) if chunk.data.is_empty() => continue,
                Ok(Some(chunk)) => return self.yield_chunk(chunk),
                Ok(None) => return None,
                Err(status) => {
                    tracing::warn!(worker = %self.addr, code = ?status.code(), message = %status.message(), "a Run's logs stream failed midway");
                    let why = format!("the worker's logs stream failed: {:?}", status.code());
                    return self.fail(why);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use kruntimes_api::{RunSpec, RunStatus};

    fn pairs(query: &[(&str, &str)]) -> Vec<(String, String)> {
        query
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn queries_parse_strictly() {
        assert_eq!(
            LogsQuery::parse(&[]).ok(),
            Some(LogsQuery {
                stream: LogStream::Stdout,
                follow: false,
                attempt: 0
            })
        );
        assert_eq!(
            LogsQuery::parse(&pairs(&[
                ("stream", "stderr"),
                ("follow", "true"),
                ("attempt", "3")
            ]))
            .ok(),
            Some(LogsQuery {
                stream: LogStream::Stderr,
                follow: true,
                attempt: 3
            })
        );
        for bad in [
            vec![("stream", "both")],
            vec![("follow", "yes")],
            vec![("attempt", "-1")],
            vec![("attempt", "x")],
            vec![("folow", "true")],
            vec![("follow", "true"), ("follow", "false")],
        ] {
            let error = LogsQuery::parse(&pairs(&bad)).err();
            assert_eq!(
                error.map(|e| e.status()),
                Some(StatusCode::BAD_REQUEST),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn bearer_tokens_are_required_and_well_formed() {
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            if let Ok(value) = HeaderValue::from_str(value) {
                headers.insert(header::AUTHORIZATION, value);
            }
            headers
        };
        assert_eq!(bearer_token(&with("Bearer abc.def")).ok(), Some("abc.def"));
        assert_eq!(bearer_token(&with("bearer  abc")).ok(), Some("abc"));
        for bad in ["", "Bearer", "Bearer ", "Basic abc", "Bearer a b", "abc"] {
            assert_eq!(
                bearer_token(&with(bad)).err().map(|e| e.status()),
                Some(StatusCode::UNAUTHORIZED),
                "{bad:?}"
            );
        }
        let mut twice = with("Bearer a");
        twice.append(header::AUTHORIZATION, HeaderValue::from_static("Bearer b"));
        assert!(bearer_token(&twice).is_err());
    }

    fn run_in(phase: Option<Phase>, assigned: bool) -> Run {
        let mut run = Run::new("r", RunSpec::task("python", "main.py"));
        run.status = Some(RunStatus {
            phase,
            assigned_pod: assigned.then(|| "worker-abcde".to_string()),
            assigned_pod_uid: assigned.then(|| "pod-uid".to_string()),
            ..RunStatus::default()
        });
        run
    }

    #[test]
    fn every_phase_has_a_placement() {
        let on = Placement::OnWorker(Assignment {
            pod: "worker-abcde".into(),
            pod_uid: "pod-uid".into(),
        });
        assert_eq!(
            placement(&run_in(None, false)),
            Placement::NotYet(Phase::Pending)
        );
        for phase in Phase::ALL {
            let expected_assigned = match phase {
                Phase::Pending | Phase::Scheduled | Phase::Suspended => Placement::NotYet(phase),
                Phase::Running
                | Phase::Ready
                | Phase::Finalizing
                | Phase::Succeeded
                | Phase::Failed
                | Phase::Timeout
                | Phase::Cancelled => on.clone(),
            };
            assert_eq!(
                placement(&run_in(Some(phase), true)),
                expected_assigned,
                "{phase}"
            );
            let expected_unassigned = if phase.is_terminal() {
                Placement::Never(phase)
            } else {
                Placement::NotYet(phase)
            };
            assert_eq!(
                placement(&run_in(Some(phase), false)),
                expected_unassigned,
                "{phase}"
            );
        }
    }

    #[test]
    fn grpc_errors_map_to_http_statuses() {
        let addr = SocketAddr::from(([127, 0, 0, 1], 1));
        for (code, status) in [
            (tonic::Code::NotFound, StatusCode::NOT_FOUND),
            (tonic::Code::FailedPrecondition, StatusCode::CONFLICT),
            (tonic::Code::InvalidArgument, StatusCode::BAD_REQUEST),
            (tonic::Code::Unauthenticated, StatusCode::UNAUTHORIZED),
            (tonic::Code::PermissionDenied, StatusCode::FORBIDDEN),
            (tonic::Code::Unavailable, StatusCode::SERVICE_UNAVAILABLE),
            (
                tonic::Code::DeadlineExceeded,
                StatusCode::SERVICE_UNAVAILABLE,
            ),
            (tonic::Code::Internal, StatusCode::BAD_GATEWAY),
            (tonic::Code::Unknown, StatusCode::BAD_GATEWAY),
        ] {
            let error = map_status(&tonic::Status::new(code, "detail"), addr);
            assert_eq!(error.status(), status, "{code:?}");
            assert!(error.message().contains("detail"), "{error}");
        }
    }
}
