//! Session mode's HTTP API (docs/session-mode.md, "HTTP API"), under
//! `/v1/namespaces/{ns}/runtimes/{runtime}/sessions/{runUID}` (the base):
//!
//! | route | runtimed call |
//! | --- | --- |
//! | `GET {base}` | `GetSession` |
//! | `POST {base}:renew` | `RenewSessionLease` |
//! | `GET {base}/operations:ws` | the WebSocket ([`ws`]): `RenewSessionLease`, `SendOperation`, `CancelOperation` |
//! | `POST {base}/operations` | `SendOperation`, its events streamed back as NDJSON |
//! | `POST {base}/operations/{id}:cancel` | `CancelOperation` |
//! | `GET {base}/files` | `DownloadFile` (a file's bytes, streamed; `archive=tar`: a directory as a tar stream), or `ListFiles` for a directory |
//! | `PUT {base}/files` | `UploadFile`: the body streamed into a file, or with `archive=tar` extracted into a directory ([`transfer`]) |
//!
//! Every call is routed like an invocation ([`crate::route`]): the Run is found in its
//! Runtime's ownership cache, the caller is authorized to `get` it (cached 30 s, checked
//! again for every call), and runtimed is called with the caller's credential and the
//! bounded decision. The gateway owns no session state: the owner runtimed queues, orders
//! and numbers the operations, and decides what a Finalizing session still accepts.
//!
//! An operation is admitted when its first event (`queued`) arrives: until then an error is
//! an HTTP status (or a `rejected` frame), after it the events are streamed and a broken
//! stream is reported in-band as an `error` line or frame, since the operation may go on.
//! Dropping a `SendOperation` call never cancels its operation.

pub(crate) mod transfer;
pub(crate) mod wire;
pub mod ws;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kruntimes_proto::runtime::v1 as rs;
use kruntimes_proto::runtimed::v1::{
    CancelOperationRequest, ListFilesRequest, SendOperationRequest, SessionInfo, SessionRoute,
};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;
use tonic::Streaming;

use crate::error::HttpError;
use crate::logs::bearer_token;
use crate::route::{self, Call, RunPath, Serving, Upstream, grpc_error};
use crate::server::AppState;
use wire::{EventBody, ServerFrame};

/// The status of a session (GET) and its lease renewal (POST `{runUID}:renew`).
pub const SESSION_ROUTE: &str = "/v1/namespaces/{ns}/runtimes/{runtime}/sessions/{target}";
/// The WebSocket of a session.
pub const OPERATIONS_WS_ROUTE: &str =
    "/v1/namespaces/{ns}/runtimes/{runtime}/sessions/{uid}/operations:ws";
/// One operation, its events as NDJSON.
pub const OPERATIONS_ROUTE: &str =
    "/v1/namespaces/{ns}/runtimes/{runtime}/sessions/{uid}/operations";
/// One operation run to its end, its result as one JSON object.
pub const OPERATIONS_EXECUTE_ROUTE: &str =
    "/v1/namespaces/{ns}/runtimes/{runtime}/sessions/{uid}/operations:execute";
/// Cancelling an operation (POST `{operationId}:cancel`).
pub const OPERATION_ROUTE: &str =
    "/v1/namespaces/{ns}/runtimes/{runtime}/sessions/{uid}/operations/{target}";
/// Reading a file or listing a directory.
pub const FILES_ROUTE: &str = "/v1/namespaces/{ns}/runtimes/{runtime}/sessions/{uid}/files";

/// How long a unary session call (status, renew, cancel, read, list) may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the owner may take to admit an operation (its `queued` event) before the
/// gateway gives up; the operation may have been admitted anyway.
pub(crate) const ADMISSION_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest workspace path (docs/session-mode.md, "Files").
const MAX_PATH_BYTES: usize = 4096;
/// The longest page token taken.
const MAX_PAGE_TOKEN_BYTES: usize = 4096;
/// The largest listing page (docs/session-mode.md, "Files").
const MAX_LIST_LIMIT: u32 = 1000;

type SessionPath = Result<Path<(String, String, String)>, PathRejection>;
type OperationPath = Result<Path<(String, String, String, String)>, PathRejection>;

/// runtimed's name of the session `path` addresses, as the gateway sends it (hop 0).
pub(crate) fn session_route(path: &RunPath) -> SessionRoute {
    SessionRoute {
        namespace: path.namespace.clone(),
        runtime: path.runtime.clone(),
        run_uid: path.uid.clone(),
        hops: 0,
        expected_attempt: 0,
        expected_pod_uid: String::new(),
    }
}

/// Finishes a handler: scrubs the token out of an error, counts the call by status code.
fn finish(
    state: &AppState,
    call: &'static str,
    token: &str,
    result: Result<Response, HttpError>,
) -> Response {
    let response = match result {
        Ok(response) => response,
        Err(e) => e.scrubbed(token).into_response(),
    };
    state
        .metrics
        .count_session_call(call, response.status().as_u16());
    response
}

/// Runs a handler's `body` with the caller's bearer token (401 without one) and finishes
/// its answer ([`finish`]).
async fn answer<Fut>(
    state: &AppState,
    call: &'static str,
    headers: &HeaderMap,
    body: impl FnOnce(String) -> Fut,
) -> Response
where
    Fut: Future<Output = Result<Response, HttpError>>,
{
    let token = match bearer_token(headers) {
        Ok(token) => token.to_string(),
        Err(e) => return finish(state, call, "", Err(e)),
    };
    let result = body(token.clone()).await;
    finish(state, call, &token, result)
}

/// The session a path names, and the way to its worker for an authorized caller.
async fn session_upstream(
    state: &AppState,
    (namespace, runtime, uid): (String, String, String),
    uid_of: fn(&str) -> Result<&str, HttpError>,
    token: &str,
    serving: Serving,
) -> Result<(RunPath, Upstream), HttpError> {
    let path = RunPath::new(namespace, runtime, uid_of(&uid)?)?;
    let upstream = route::upstream(state, &path, token, serving).await?;
    Ok((path, upstream))
}

/// A path segment that is the Run UID itself.
fn plain(uid: &str) -> Result<&str, HttpError> {
    Ok(uid)
}

/// The UID of `GET .../sessions/{target}`: the segment, without a `:verb`.
fn status_uid(target: &str) -> Result<&str, HttpError> {
    if target.contains(':') {
        return Err(HttpError::not_found(
            "no such route; a session's status is GET .../sessions/UID",
        ));
    }
    Ok(target)
}

/// The UID of `POST .../sessions/{target}`: `UID:renew`.
fn renew_uid(target: &str) -> Result<&str, HttpError> {
    target.strip_suffix(":renew").ok_or_else(|| {
        HttpError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "a session takes POST only as .../sessions/UID:renew",
        )
    })
}

fn parse_path(path: SessionPath) -> Result<(String, String, String), HttpError> {
    let Path(parts) = path.map_err(|e| HttpError::bad_request(format!("malformed path: {e}")))?;
    Ok(parts)
}

fn json(value: &impl serde::Serialize) -> Result<Response, HttpError> {
    let body = serde_json::to_vec(value)
        .map_err(|e| HttpError::internal(format!("failed to encode the answer: {e}")))?;
    let mut response = Response::new(Body::from(body));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(response)
}

// ---------------------------------------------------------------------------------------
// Status and lease
// ---------------------------------------------------------------------------------------

/// `GetSession`, or with `renew` `RenewSessionLease`.
pub(crate) async fn call_status(
    state: &AppState,
    upstream: &Upstream,
    path: &RunPath,
    token: &str,
    renew: bool,
) -> Result<SessionInfo, HttpError> {
    let mut request = upstream.request(session_route(path), token);
    request.set_timeout(CALL_TIMEOUT);
    let mut client = upstream.client.clone();
    let (answer, call) = if renew {
        (client.renew_session_lease(request).await, Call::RENEW)
    } else {
        (client.get_session(request).await, Call::READ)
    };
    answer.map(tonic::Response::into_inner).map_err(|status| {
        upstream.failed(state, &status);
        grpc_error(&status, call)
    })
}

/// `GET {base}` (the session's status) and `GET {base}:…` (no such route).
pub(crate) async fn status(
    State(state): State<Arc<AppState>>,
    path: SessionPath,
    headers: HeaderMap,
) -> Response {
    let state = &*state;
    answer(state, "status", &headers, |token| async move {
        let (path, upstream) = session_upstream(
            state,
            parse_path(path)?,
            status_uid,
            &token,
            Serving::Session,
        )
        .await?;
        let info = call_status(state, &upstream, &path, &token, false).await?;
        json(&wire::status(&path.uid, info))
    })
    .await
}

/// `POST {base}:renew`: a heartbeat; answers the status.
pub(crate) async fn renew(
    State(state): State<Arc<AppState>>,
    path: SessionPath,
    headers: HeaderMap,
) -> Response {
    let state = &*state;
    answer(state, "renew", &headers, |token| async move {
        let (namespace, runtime, target) = parse_path(path)?;
        let run_path = RunPath::new(namespace.clone(), runtime.clone(), renew_uid(&target)?)?;
        if let Some(entry) = route::asleep(state, &run_path, &token).await? {
            // Answered here: a heartbeat never wakes a session its owner suspended.
            return json(&wire::asleep_status(&run_path.uid, &entry));
        }
        let (path, upstream) = session_upstream(
            state,
            (namespace, runtime, target),
            renew_uid,
            &token,
            Serving::Session,
        )
        .await?;
        let info = call_status(state, &upstream, &path, &token, true).await?;
        json(&wire::status(&path.uid, info))
    })
    .await
}

// ---------------------------------------------------------------------------------------
// Operations
// ---------------------------------------------------------------------------------------

/// The events of one admitted operation, as frames, until its `completed` event or the
/// first sign that the rest will not come (then one `error` frame).
pub(crate) struct OperationEvents {
    stream: Streaming<rs::SessionOperationEvent>,
    operation_id: String,
    completed: bool,
    ended: bool,
    shutdown: watch::Receiver<bool>,
    counter: Counter,
}

impl OperationEvents {
    fn frame(&mut self, event: rs::SessionOperationEvent) -> Option<ServerFrame> {
        let json = wire::event(event)?;
        if matches!(json.body, EventBody::Completed(_)) {
            self.completed = true;
        }
        self.counter.inc();
        Some(ServerFrame::Event(json))
    }

    fn cut_off(&mut self, why: String) -> ServerFrame {
        self.ended = true;
        let id = &self.operation_id;
        ServerFrame::error(
            Some(id.clone()),
            &HttpError::new(
                StatusCode::BAD_GATEWAY,
                "OutcomeUnknown",
                format!(
                    "the events of operation {id} were cut off ({why}); it may or may not run to its end"
                ),
            ),
        )
    }

    /// The next frame; `None` once the operation completed or was cut off.
    pub(crate) async fn next(&mut self) -> Option<ServerFrame> {
        loop {
            if self.ended {
                return None;
            }
            let received = tokio::select! {
                biased;
                _ = self.shutdown.wait_for(|down| *down) => None,
                received = self.stream.message() => Some(received),
            };
            let Some(received) = received else {
                return Some(self.cut_off("the gateway is shutting down".to_string()));
            };
            match received {
                Ok(Some(event)) => {
                    if let Some(frame) = self.frame(event) {
                        return Some(frame);
                    }
                }
                Ok(None) if self.completed => {
                    self.ended = true;
                    return None;
                }
                Ok(None) => {
                    return Some(
                        self.cut_off("the worker ended the stream before completion".into()),
                    );
                }
                Err(status) => {
                    let why = format!("{:?}: {}", status.code(), status.message());
                    return Some(self.cut_off(why));
                }
            }
        }
    }
}

/// Sends `operation` to the session and waits for its admission, its first event.
///
/// Returns that event's frame and the rest of the events. Errors before admission are the
/// HTTP errors of [`grpc_error`] (429 queue full, 409 Finalizing or a repeated ID, …); no
/// admission within [`ADMISSION_TIMEOUT`] is a 504 whose outcome is unknown.
pub(crate) async fn admit(
    state: &AppState,
    upstream: &Upstream,
    path: &RunPath,
    operation: rs::SessionOperationRequest,
    token: &str,
) -> Result<(ServerFrame, OperationEvents), HttpError> {
    let request = upstream.request(
        SendOperationRequest {
            route: Some(session_route(path)),
            operation: Some(operation),
        },
        token,
    );
    let mut client = upstream.client.clone();
    let call = async {
        let mut stream = client.send_operation(request).await?.into_inner();
        let first = stream.message().await?;
        Ok::<_, tonic::Status>((first, stream))
    };
    let (first, stream) = match tokio::time::timeout(ADMISSION_TIMEOUT, call).await {
        Err(_) => {
            return Err(HttpError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "OutcomeUnknown",
                format!(
                    "the worker did not admit the operation within {}s; it may or may not have been queued",
                    ADMISSION_TIMEOUT.as_secs()
                ),
            ));
        }
        Ok(Err(status)) => {
            upstream.failed(state, &status);
            return Err(grpc_error(&status, Call::OPERATION));
        }
        Ok(Ok(answer)) => answer,
    };
    let Some(first) = first else {
        return Err(HttpError::new(
            StatusCode::BAD_GATEWAY,
            "OutcomeUnknown",
            "the worker ended the operation's events before admitting it; it may or may not have been queued",
        ));
    };
    let mut events = OperationEvents {
        stream,
        operation_id: first.operation_id.clone(),
        completed: false,
        ended: false,
        shutdown: state.shutdown.clone(),
        counter: state.metrics.session_events.clone(),
    };
    let frame = match events.frame(first) {
        Some(frame) => frame,
        None => events.cut_off("the worker admitted it without an event".into()),
    };
    Ok((frame, events))
}

/// The operation in a request `body` to the session `path` names, sent for an authorized
/// caller and admitted ([`admit`]): whether it is a command, its first frame and its
/// other events.
async fn admit_body(
    state: &AppState,
    path: SessionPath,
    body: &[u8],
    token: &str,
) -> Result<(bool, ServerFrame, OperationEvents), HttpError> {
    let parts = parse_path(path)?;
    let operation = wire::parse_operation(body)?.into_request()?;
    let command = matches!(
        operation.operation,
        Some(rs::session_operation_request::Operation::Command(_))
    );
    let (path, upstream) =
        session_upstream(state, parts, plain, token, Serving::SessionMutation).await?;
    let (first, events) = admit(state, &upstream, &path, operation, token).await?;
    Ok((command, first, events))
}

/// `POST {base}/operations`: one operation in the JSON body; its events as NDJSON lines,
/// one frame per line, an `error` line if they are cut off.
pub(crate) async fn send(
    State(state): State<Arc<AppState>>,
    path: SessionPath,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let state = &*state;
    answer(state, "send", &headers, |token| async move {
        let (_, first, events) = admit_body(state, path, &body, &token).await?;
        let rest = futures::stream::unfold(events, |mut events| async move {
            let frame = events.next().await?;
            Some((frame, events))
        });
        let lines = futures::StreamExt::map(
            futures::StreamExt::chain(futures::stream::once(async { first }), rest),
            |frame| {
                let mut line = frame.to_json();
                line.push('\n');
                Ok::<_, std::convert::Infallible>(Bytes::from(line))
            },
        );
        let mut response = Response::new(Body::from_stream(lines));
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-ndjson"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        Ok(response)
    })
    .await
}

/// `POST {base}/operations:execute`: one operation in the JSON body (as for `POST
/// {base}/operations`: the same queue, admission and wake), run to its end; the answer is
/// one JSON object ([`wire::ExecuteJson`]) with its outcome and up to 1 MiB of each output
/// stream. A non-zero exit is a successful call. What did not run to an end is an error,
/// never an exit code: events cut off after admission (a lost worker, a broken transport)
/// are 502 `OutcomeUnknown`; the other errors are [`executed`]'s.
pub(crate) async fn execute(
    State(state): State<Arc<AppState>>,
    path: SessionPath,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let state = &*state;
    answer(state, "execute", &headers, |token| async move {
        let (command, first, mut events) = admit_body(state, path, &body, &token).await?;
        let mut gathered = wire::Gathered::default();
        let mut frame = Some(first);
        while let Some(next) = frame {
            match next {
                ServerFrame::Event(event) => match event.body {
                    EventBody::Output {
                        stream,
                        data,
                        truncated,
                    } => gathered.output(stream, &data, truncated),
                    EventBody::Completed(completed) => {
                        return executed(command, gathered.answer(
                            command,
                            event.operation_id,
                            event.sequence,
                            completed,
                        ));
                    }
                    EventBody::Queued { .. } | EventBody::Started {} => {}
                },
                ServerFrame::Error {
                    status,
                    reason,
                    message,
                    ..
                }
                | ServerFrame::Rejected {
                    status,
                    reason,
                    message,
                    ..
                } => {
                    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
                    return Err(HttpError::new(status, reason, message));
                }
                ServerFrame::Cancelled { .. } | ServerFrame::Heartbeat { .. } => {}
            }
            frame = events.next().await;
        }
        Err(HttpError::new(
            StatusCode::BAD_GATEWAY,
            "OutcomeUnknown",
            "the operation's events ended without its completion; it may or may not have run to its end",
        ))
    })
    .await
}

/// The answer of `operations:execute` for a completed operation: the result, or the error
/// that says it did not run to an end on a working machine. A command has an exit code
/// exactly when it ran to an end; one without is an error. A cancelled operation (by the
/// session's close: 409 `SessionClosed`; by a cancel call: 409 `OperationCancelled`) is an
/// error whatever it carries. For a command that never started: its working directory's
/// problem is the caller's (404 `NotFound`, 400 for the others, the runtime server's reason
/// kept); a lost sandbox is 503 `SandboxLost`; any other reason the machine could not run
/// it is 502 with that reason.
fn executed(command: bool, result: wire::ExecuteJson) -> Result<Response, HttpError> {
    let id = &result.operation_id;
    let reason = result.reason.as_str();
    if result.state == "Cancelled" {
        return Err(if reason == "SessionClosed" {
            HttpError::new(
                StatusCode::CONFLICT,
                "SessionClosed",
                format!(
                    "the session was closed while operation {id} ran; it did not run to its end"
                ),
            )
        } else {
            HttpError::new(
                StatusCode::CONFLICT,
                "OperationCancelled",
                format!("operation {id} was cancelled before it ran to its end"),
            )
        });
    }
    if reason == "SandboxLost" {
        return Err(HttpError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "SandboxLost",
            format!(
                "the session's sandbox ended while operation {id} ran: {}",
                result.message
            ),
        ));
    }
    if !command || result.exit_code.is_some() {
        return json(&result);
    }
    let status = match reason {
        "NotFound" => StatusCode::NOT_FOUND,
        "PathEscapes" | "NotADirectory" | "IsADirectory" | "InvalidPath" => StatusCode::BAD_REQUEST,
        _ => StatusCode::BAD_GATEWAY,
    };
    Err(HttpError::new(
        status,
        reason.to_string(),
        format!("operation {id} could not run: {}", result.message),
    ))
}

/// `CancelOperation`.
pub(crate) async fn call_cancel(
    state: &AppState,
    upstream: &Upstream,
    path: &RunPath,
    operation_id: String,
    token: &str,
) -> Result<wire::CancelJson, HttpError> {
    let mut request = upstream.request(
        CancelOperationRequest {
            route: Some(session_route(path)),
            operation_id: operation_id.clone(),
        },
        token,
    );
    request.set_timeout(CALL_TIMEOUT);
    let answer = upstream
        .client
        .clone()
        .cancel_operation(request)
        .await
        .map_err(|status| {
            upstream.failed(state, &status);
            grpc_error(&status, Call::CANCEL)
        })?
        .into_inner();
    Ok(wire::CancelJson {
        operation_id,
        found: answer.found,
        state: wire::operation_state(answer.state()),
    })
}

/// `POST {base}/operations/{operationId}:cancel`.
pub(crate) async fn cancel(
    State(state): State<Arc<AppState>>,
    path: OperationPath,
    headers: HeaderMap,
) -> Response {
    let state = &*state;
    answer(state, "cancel", &headers, |token| async move {
        let Path((namespace, runtime, uid, target)) =
            path.map_err(|e| HttpError::bad_request(format!("malformed path: {e}")))?;
        let Some(operation_id) = target.strip_suffix(":cancel") else {
            return Err(HttpError::not_found(
                "no such route; cancel with POST .../operations/ID:cancel",
            ));
        };
        wire::check_operation_id(operation_id)?;
        let (path, upstream) = session_upstream(
            state,
            (namespace, runtime, uid),
            plain,
            &token,
            Serving::Session,
        )
        .await?;
        let answer = call_cancel(state, &upstream, &path, operation_id.to_string(), &token).await?;
        json(&answer)
    })
    .await
}

// ---------------------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------------------

/// What `GET {base}/files` asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct FilesQuery {
    path: String,
    directory: bool,
    /// 0: the runtime server's default page.
    limit: u32,
    page_token: String,
    /// `limit` or `pageToken` was given: a listing.
    paged: bool,
    /// `archive=tar`: a directory as a tar stream (GET) or extracted from one (PUT).
    archive: bool,
    /// `executable=true`: an uploaded file gets mode 0755 (PUT only).
    executable: bool,
}

impl FilesQuery {
    fn parse(pairs: &[(String, String)]) -> Result<FilesQuery, HttpError> {
        let mut query = FilesQuery::default();
        let mut seen: Vec<&str> = Vec::new();
        for (key, value) in pairs {
            if seen.contains(&key.as_str()) {
                return Err(HttpError::bad_request(format!(
                    "query parameter {key:?} is given more than once"
                )));
            }
            match key.as_str() {
                "path" => {
                    if value.len() > MAX_PATH_BYTES {
                        return Err(HttpError::bad_request(format!(
                            "the path is longer than {MAX_PATH_BYTES} bytes"
                        )));
                    }
                    query.path = value.clone();
                }
                "directory" => {
                    query.directory = match value.as_str() {
                        "true" => true,
                        "false" => false,
                        _ => {
                            return Err(HttpError::bad_request(
                                "query parameter \"directory\" must be true or false",
                            ));
                        }
                    };
                }
                "limit" => {
                    query.limit = value
                        .parse::<u32>()
                        .ok()
                        .filter(|l| (1..=MAX_LIST_LIMIT).contains(l))
                        .ok_or_else(|| {
                            HttpError::bad_request(format!(
                                "query parameter \"limit\" must be 1 to {MAX_LIST_LIMIT}"
                            ))
                        })?;
                    query.paged = true;
                }
                "archive" => {
                    if value != "tar" {
                        return Err(HttpError::bad_request(
                            "query parameter \"archive\" must be tar",
                        ));
                    }
                    query.archive = true;
                }
                "executable" => {
                    query.executable = match value.as_str() {
                        "true" => true,
                        "false" => false,
                        _ => {
                            return Err(HttpError::bad_request(
                                "query parameter \"executable\" must be true or false",
                            ));
                        }
                    };
                }
                "pageToken" => {
                    if value.len() > MAX_PAGE_TOKEN_BYTES {
                        return Err(HttpError::bad_request("the page token is malformed"));
                    }
                    query.page_token = value.clone();
                    query.paged = true;
                }
                other => {
                    return Err(HttpError::bad_request(format!(
                        "unknown query parameter {:?}; files take path, directory, limit, pageToken, archive and executable",
                        other.chars().take(64).collect::<String>()
                    )));
                }
            }
            seen.push(key);
        }
        Ok(query)
    }

    /// Whether the answer is a listing without reading first: asked for one, or the
    /// workspace itself (an empty path).
    fn listing(&self) -> bool {
        self.directory || self.paged || self.path.is_empty()
    }
}

/// `GET {base}/files?path=P[&directory=true][&limit=N][&pageToken=T]`: a file's bytes, or
/// a listing page of a directory.
pub(crate) async fn files(
    State(state): State<Arc<AppState>>,
    path: SessionPath,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
    headers: HeaderMap,
) -> Response {
    let state = &*state;
    answer(state, "files", &headers, |token| async move {
        let parts = parse_path(path)?;
        let Query(pairs) =
            query.map_err(|e| HttpError::bad_request(format!("malformed query: {e}")))?;
        let query = FilesQuery::parse(&pairs)?;
        // Empty: the workspace itself.
        wire::check_path("path", &query.path, true)?;
        let (path, upstream) =
            session_upstream(state, parts, plain, &token, Serving::Session).await?;
        let failed = |status: tonic::Status| {
            upstream.failed(state, &status);
            grpc_error(&status, Call::READ)
        };
        if query.executable {
            return Err(HttpError::bad_request(
                "query parameter \"executable\" is for uploads (PUT)",
            ));
        }
        if query.archive || !query.listing() {
            match transfer::download(
                state,
                &upstream,
                &path,
                query.path.clone(),
                query.archive,
                &token,
            )
            .await?
            {
                transfer::Download::Stream(response) => return Ok(response),
                transfer::Download::Directory => {}
            }
        }
        let mut request = upstream.request(
            ListFilesRequest {
                route: Some(session_route(&path)),
                path: query.path,
                limit: query.limit,
                page_token: query.page_token,
            },
            &token,
        );
        request.set_timeout(CALL_TIMEOUT);
        let page = upstream
            .client
            .clone()
            .list_files(request)
            .await
            .map_err(&failed)?
            .into_inner();
        json(&wire::file_page(page))
    })
    .await
}

/// `PUT {base}/files?path=P[&executable=true][&archive=tar]`: the body, streamed, becomes
/// the file at P (or, with `archive=tar`, is extracted into the new or empty directory P).
pub(crate) async fn put_files(
    State(state): State<Arc<AppState>>,
    path: SessionPath,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let state = &*state;
    let headers = &headers;
    answer(state, "upload", headers, |token| async move {
        let parts = parse_path(path)?;
        let Query(pairs) =
            query.map_err(|e| HttpError::bad_request(format!("malformed query: {e}")))?;
        let query = FilesQuery::parse(&pairs)?;
        if query.directory || query.paged {
            return Err(HttpError::bad_request(
                "an upload takes path, executable and archive",
            ));
        }
        wire::check_path("path", &query.path, false)?;
        // Authorized before a byte of the body is read.
        let (path, upstream) =
            session_upstream(state, parts, plain, &token, Serving::SessionMutation).await?;
        let upload = transfer::UploadQuery {
            path: query.path,
            executable: query.executable,
            archive: query.archive,
        };
        transfer::upload(state, &upstream, &path, upload, headers, body, &token).await
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
        items
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn files_queries_read_or_list() {
        let read = FilesQuery::parse(&pairs(&[("path", "a/b.txt")])).expect("read");
        assert!(!read.listing());
        assert_eq!(read.path, "a/b.txt");
        let workspace = FilesQuery::parse(&[]).expect("workspace");
        assert!(workspace.listing());
        let dir = FilesQuery::parse(&pairs(&[("path", "src"), ("directory", "true")])).expect("d");
        assert!(dir.listing());
        assert_eq!(dir.limit, 0);
        let page = FilesQuery::parse(&pairs(&[
            ("path", "src"),
            ("limit", "1000"),
            ("pageToken", "eyJ2IjoxfQ"),
        ]))
        .expect("page");
        assert!(page.listing());
        assert_eq!((page.limit, page.page_token.as_str()), (1000, "eyJ2IjoxfQ"));
        let token_only =
            FilesQuery::parse(&pairs(&[("path", "src"), ("pageToken", "t")])).expect("token");
        assert!(token_only.listing());
    }

    #[test]
    fn files_queries_are_checked() {
        for (query, expected) in [
            (vec![("limit", "0")], "1 to 1000"),
            (vec![("limit", "1001")], "1 to 1000"),
            (vec![("limit", "-1")], "1 to 1000"),
            (vec![("limit", "ten")], "1 to 1000"),
            (vec![("directory", "yes")], "true or false"),
            (vec![("path", "a"), ("path", "b")], "more than once"),
            (vec![("recursive", "true")], "unknown query parameter"),
        ] {
            let e = FilesQuery::parse(&pairs(&query)).expect_err(expected);
            assert_eq!(e.status(), StatusCode::BAD_REQUEST);
            assert!(e.message().contains(expected), "{query:?}: {e}");
        }
        let long = "a".repeat(MAX_PATH_BYTES + 1);
        assert!(FilesQuery::parse(&pairs(&[("path", &long)])).is_err());
    }
}
