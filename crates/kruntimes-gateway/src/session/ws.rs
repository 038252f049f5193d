//! `GET {base}/operations:ws`: a session's WebSocket (docs/session-mode.md, "WebSocket
//! frames").
//!
//! Opening takes a permit of the WebSocket connection limit
//! ([`crate::GatewayConfig::max_session_connections`], non-blocking: 429 when none is free),
//! which the connection holds until it closes; the route is outside the request limit, so
//! open sockets never use up the slots of ordinary requests. Then the caller is authorized
//! and the lease renewed (`RenewSessionLease`) before the upgrade, so that a missing token,
//! a refused caller or an ended session is an ordinary HTTP error.
//!
//! Frames are handled one at a time, in the order they arrive, and each gets exactly one
//! reply, in the same order:
//!
//! - `send`: `SendOperation`, and the reply is the operation's first event (`queued`) once
//!   the owner has admitted it, or `rejected`. Only then is the next frame read, so sends
//!   are admitted in order. The operation's later events are pumped to the socket by a task
//!   of their own;
//! - `cancel`: `CancelOperation`; `cancelled`, or `rejected`;
//! - `heartbeat`: `RenewSessionLease`; `heartbeat` with the new expiry, or `rejected`;
//! - anything malformed: `rejected` (400).
//!
//! `error` frames are never replies: they say that an operation's events were cut off, or
//! that the connection ends (authorization lapsed, the gateway shuts down). Every call
//! authorizes again (from the cache, bounded to its 30 s TTL); a 401 or 403 ends the
//! connection after the rejection. An idle connection re-checks its caller too: whenever a
//! revocation flushes the authorizer's cache, and every TTL as a backstop; a 401 or 403
//! then ends it with an `error` frame and close code 1008 (policy).
//!
//! Everything the client receives goes through one writer task and one bounded channel, so
//! frames never interleave and a client that stops reading stalls its own operations'
//! pumps, never the gateway (a write that stalls for [`WRITE_STALL`] ends the connection).
//! Closing the socket cancels nothing: the pumps stop, the operations run on.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, close_code};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use futures::{SinkExt, StreamExt};
use kruntimes_proto::runtime::v1 as rs;
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio::task::JoinSet;

use super::wire::{self, ClientFrame, ServerFrame};
use super::{OperationEvents, SessionPath, admit, call_cancel, call_status, finish, parse_path};
use crate::error::HttpError;
use crate::logs::bearer_token;
use crate::metrics::GaugeGuard;
use crate::route::{self, RunPath, Serving, Upstream};
use crate::server::AppState;

/// The largest frame a client may send: a 1 MiB file in base64 and its envelope.
pub const MAX_MESSAGE_BYTES: usize = 2 * 1024 * 1024;
/// Each socket's read buffer. tungstenite allocates it at once for every socket, 128 KiB
/// by default (with as much again for the write buffer), which made an idle socket cost
/// about 245 KiB (issue 14 item 9); a frame larger than this is read into a buffer of its
/// own size, which goes when the frame has been handled.
pub const READ_BUFFER_BYTES: usize = 4 * 1024;
/// Frames are written to the socket as they are sent, not gathered first (the writer
/// flushes every frame anyway).
const WRITE_BUFFER_BYTES: usize = 0;
/// What one socket may have waiting to be written at most, when writes stall.
const MAX_WRITE_BUFFER_BYTES: usize = 4 * MAX_MESSAGE_BYTES;
/// Frames waiting for the writer, at most.
const WRITER_CAPACITY: usize = 64;
/// Operations one connection follows at once, at most (more than a session's queue holds).
const MAX_PUMPS: usize = 64;
/// A write to the client that makes no progress for this long ends the connection.
const WRITE_STALL: Duration = Duration::from_secs(60);
/// How long the writer may take to flush its last frames once the connection ends.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// The handler of [`super::OPERATIONS_WS_ROUTE`].
pub(crate) async fn operations_ws(
    State(state): State<Arc<AppState>>,
    path: SessionPath,
    headers: HeaderMap,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let Ok(permit) = state.session_connections.clone().try_acquire_owned() else {
        state.metrics.session_connections_rejected.inc();
        tracing::debug!(
            limit = state.max_session_connections,
            "session connection limit reached; 429"
        );
        let refused = wire::too_many_connections(state.max_session_connections);
        return finish(&state, "open", "", Err(refused));
    };
    let token = match bearer_token(&headers) {
        Ok(token) => token,
        Err(e) => return finish(&state, "open", "", Err(e)),
    };
    // Subscribed before the caller is authorized, so that a revocation between the two is
    // seen by the connection.
    let invalidations = state.authorizer.invalidations();
    let opened = async {
        let upgrade = upgrade.map_err(|e| {
            HttpError::new(
                e.status(),
                "BadRequest",
                format!("this route takes a WebSocket upgrade: {}", e.body_text()),
            )
        })?;
        let (namespace, runtime, uid) = parse_path(path)?;
        let path = RunPath::new(namespace, runtime, &uid)?;
        let upstream = route::upstream(&state, &path, token, Serving::Session).await?;
        // Opening renews the lease.
        call_status(&state, &upstream, &path, token, true).await?;
        Ok((path, upgrade))
    }
    .await;
    let (path, upgrade) = match opened {
        Ok(opened) => opened,
        Err(e) => return finish(&state, "open", token, Err(e)),
    };
    let connection_state = state.clone();
    let token = token.to_string();
    let response = upgrade
        .read_buffer_size(READ_BUFFER_BYTES)
        .write_buffer_size(WRITE_BUFFER_BYTES)
        .max_write_buffer_size(MAX_WRITE_BUFFER_BYTES)
        .max_message_size(MAX_MESSAGE_BYTES)
        .max_frame_size(MAX_MESSAGE_BYTES)
        .on_upgrade(move |socket| {
            serve(connection_state, path, token, socket, permit, invalidations)
        });
    finish(&state, "open", "", Ok(response))
}

/// What ended a wait of the connection's loop.
enum Input {
    Shutdown,
    Received(Option<Result<Message, axum::Error>>),
    PumpEnded,
    /// The authorizer's cache was flushed, or a TTL passed: is the caller still allowed?
    Recheck,
}

/// Whether the connection goes on after a frame.
#[derive(Debug, PartialEq, Eq)]
enum Flow {
    Continue,
    /// End the connection with this close code.
    Close(u16),
}

/// One open connection: its session, the caller's credential (kept in memory for the
/// calls it makes, never logged), the writer's channel and the pumps.
struct Connection {
    state: Arc<AppState>,
    path: RunPath,
    token: String,
    out: mpsc::Sender<Message>,
    pumps: JoinSet<()>,
}

impl Connection {
    async fn reply(&self, frame: ServerFrame) {
        // A closed writer means the client is gone; the reader notices next.
        let _ = self.out.send(Message::Text(frame.to_json().into())).await;
    }

    async fn upstream(&self) -> Result<Upstream, HttpError> {
        route::upstream(&self.state, &self.path, &self.token, Serving::Session).await
    }

    /// The way to the worker for new work (an operation): refused while the session is
    /// being suspended.
    async fn upstream_for_work(&self) -> Result<Upstream, HttpError> {
        route::upstream(
            &self.state,
            &self.path,
            &self.token,
            Serving::SessionMutation,
        )
        .await
    }

    /// Replies `rejected` for a frame of `call` that failed with `error`; a credential that
    /// no longer works ends the connection.
    async fn refuse(
        &self,
        call: &'static str,
        operation_id: Option<String>,
        error: HttpError,
    ) -> Flow {
        let error = error.scrubbed(&self.token);
        let status = error.status();
        self.state.metrics.count_session_call(call, status.as_u16());
        self.reply(ServerFrame::rejected(operation_id, &error))
            .await;
        if matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
            let ended = HttpError::new(
                status,
                error.reason().to_string(),
                "the connection's authorization ended; reconnect with a token that may get this Run",
            );
            self.reply(ServerFrame::error(None, &ended)).await;
            return Flow::Close(close_code::POLICY);
        }
        Flow::Continue
    }

    /// Authorizes the caller again; a 401 or 403 ends the connection with an `error` frame.
    /// Anything else (the session ended, the API is unreachable) is left to the next call.
    async fn recheck(&self) -> Flow {
        let Err(error) = self.upstream().await else {
            return Flow::Continue;
        };
        let status = error.status();
        if !matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
            return Flow::Continue;
        }
        tracing::debug!(run_uid = self.path.uid, %status, "session connection's authorization revoked");
        let ended = HttpError::new(
            status,
            error.reason().to_string(),
            "the connection's authorization was revoked; reconnect with a token that may get this Run",
        );
        self.reply(ServerFrame::error(None, &ended)).await;
        Flow::Close(close_code::POLICY)
    }

    async fn handle(&mut self, text: &str) -> Flow {
        match wire::parse_frame(text) {
            Ok(ClientFrame::Send(operation)) => self.send(operation).await,
            Ok(ClientFrame::Cancel { operation_id }) => self.cancel(operation_id).await,
            Ok(ClientFrame::Heartbeat) => self.heartbeat().await,
            Err(e) => self.refuse("frame", e.operation_id, e.error).await,
        }
    }

    async fn send(&mut self, operation: rs::SessionOperationRequest) -> Flow {
        let requested =
            (!operation.operation_id.is_empty()).then(|| operation.operation_id.clone());
        if self.pumps.len() >= MAX_PUMPS {
            let busy = HttpError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "TooManyRequests",
                format!(
                    "this connection follows {MAX_PUMPS} operations already; wait for one to complete"
                ),
            );
            return self.refuse("send", requested, busy).await;
        }
        let upstream = match self.upstream_for_work().await {
            Ok(upstream) => upstream,
            Err(e) => return self.refuse("send", requested, e).await,
        };
        match admit(&self.state, &upstream, &self.path, operation, &self.token).await {
            Ok((first, events)) => {
                self.state.metrics.count_session_call("send", 200);
                self.reply(first).await;
                self.pumps.spawn(pump(events, self.out.clone()));
                Flow::Continue
            }
            Err(e) => self.refuse("send", requested, e).await,
        }
    }

    async fn cancel(&mut self, operation_id: String) -> Flow {
        let upstream = match self.upstream().await {
            Ok(upstream) => upstream,
            Err(e) => return self.refuse("cancel", Some(operation_id), e).await,
        };
        let answer = call_cancel(
            &self.state,
            &upstream,
            &self.path,
            operation_id.clone(),
            &self.token,
        )
        .await;
        match answer {
            Ok(answer) => {
                self.state.metrics.count_session_call("cancel", 200);
                self.reply(ServerFrame::Cancelled {
                    operation_id: answer.operation_id,
                    found: answer.found,
                    state: answer.state,
                })
                .await;
                Flow::Continue
            }
            Err(e) => self.refuse("cancel", Some(operation_id), e).await,
        }
    }

    async fn heartbeat(&mut self) -> Flow {
        // A session its owner suspended is not woken by a heartbeat: no lease runs.
        match route::asleep(&self.state, &self.path, &self.token).await {
            Ok(Some(_)) => {
                self.state.metrics.count_session_call("heartbeat", 200);
                self.reply(ServerFrame::Heartbeat {
                    lease_expires_at: None,
                })
                .await;
                return Flow::Continue;
            }
            Ok(None) => {}
            Err(e) => return self.refuse("heartbeat", None, e).await,
        }
        let upstream = match self.upstream().await {
            Ok(upstream) => upstream,
            Err(e) => return self.refuse("heartbeat", None, e).await,
        };
        match call_status(&self.state, &upstream, &self.path, &self.token, true).await {
            Ok(info) => {
                self.state.metrics.count_session_call("heartbeat", 200);
                self.reply(ServerFrame::Heartbeat {
                    lease_expires_at: wire::lease_expires_at(&info),
                })
                .await;
                Flow::Continue
            }
            Err(e) => self.refuse("heartbeat", None, e).await,
        }
    }
}

/// Forwards an operation's events to the writer until they end or the client is gone.
async fn pump(mut events: OperationEvents, out: mpsc::Sender<Message>) {
    while let Some(frame) = events.next().await {
        if out
            .send(Message::Text(frame.to_json().into()))
            .await
            .is_err()
        {
            return;
        }
    }
}

/// The close code and reason RFC 6455 (section 7.4.1) gives a read that failed with
/// `error`: 1009 for a message or frame over the size limit, 1007 for a text frame that is
/// not UTF-8, 1002 for any other protocol violation. `None` when the connection itself
/// failed (nothing can be sent any more).
fn violation(error: &axum::Error) -> Option<(u16, &'static str)> {
    use tokio_tungstenite::tungstenite::Error;
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        if let Some(e) = e.downcast_ref::<Error>() {
            return match e {
                Error::Capacity(_) => Some((close_code::SIZE, "message too big")),
                Error::Utf8(_) => Some((close_code::INVALID, "text frame is not UTF-8")),
                Error::Protocol(_) => Some((close_code::PROTOCOL, "protocol violation")),
                Error::ConnectionClosed
                | Error::AlreadyClosed
                | Error::Io(_)
                | Error::Tls(_)
                | Error::WriteBufferFull(_)
                | Error::Url(_)
                | Error::Http(_)
                | Error::HttpFormat(_)
                | Error::AttackAttempt => None,
            };
        }
        source = e.source();
    }
    None
}

fn close(code: u16, reason: &'static str) -> Message {
    Message::Close(Some(CloseFrame {
        code,
        reason: reason.into(),
    }))
}

/// Serves one upgraded connection until the client closes it, the gateway shuts down or
/// the connection's authorization ends.
async fn serve(
    state: Arc<AppState>,
    path: RunPath,
    token: String,
    socket: WebSocket,
    permit: OwnedSemaphorePermit,
    mut invalidations: tokio::sync::watch::Receiver<u64>,
) {
    let _permit = permit;
    let _open = GaugeGuard::new(&state.metrics.session_connections);
    let (mut sink, mut stream) = socket.split();
    let (out, mut queued) = mpsc::channel::<Message>(WRITER_CAPACITY);
    let writer = tokio::spawn(async move {
        while let Some(message) = queued.recv().await {
            let closing = matches!(message, Message::Close(_));
            match tokio::time::timeout(WRITE_STALL, sink.send(message)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return,
            }
            if closing {
                return;
            }
        }
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, sink.close()).await;
    });
    tracing::debug!(
        namespace = path.namespace,
        runtime = path.runtime,
        run_uid = path.uid,
        "session connection open"
    );
    let mut shutdown = state.shutdown.clone();
    let ttl = crate::authz::DEFAULT_TTL;
    let mut backstop = tokio::time::interval_at(tokio::time::Instant::now() + ttl, ttl);
    backstop.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut connection = Connection {
        state,
        path,
        token,
        out,
        pumps: JoinSet::new(),
    };
    loop {
        let input = tokio::select! {
            _ = shutdown.wait_for(|down| *down) => Input::Shutdown,
            received = stream.next() => Input::Received(received),
            Some(_) = connection.pumps.join_next(), if !connection.pumps.is_empty() => Input::PumpEnded,
            Ok(()) = invalidations.changed() => Input::Recheck,
            _ = backstop.tick() => Input::Recheck,
        };
        let flow = match input {
            Input::PumpEnded => Flow::Continue,
            Input::Recheck => connection.recheck().await,
            Input::Shutdown => {
                let down = HttpError::unavailable(
                    "the gateway is shutting down; operations go on, reconnect to send more",
                );
                connection.reply(ServerFrame::error(None, &down)).await;
                Flow::Close(close_code::AWAY)
            }
            Input::Received(None | Some(Ok(Message::Close(_)))) => break,
            Input::Received(Some(Err(e))) => match violation(&e) {
                Some((code, reason)) => {
                    tracing::debug!(code, reason, "session connection broke the protocol");
                    let _ = connection.out.send(close(code, reason)).await;
                    break;
                }
                None => break,
            },
            Input::Received(Some(Ok(Message::Text(text)))) => {
                connection.handle(text.as_str()).await
            }
            Input::Received(Some(Ok(Message::Binary(_)))) => {
                let binary = HttpError::bad_request("frames are JSON text, not binary");
                connection.refuse("frame", None, binary).await
            }
            Input::Received(Some(Ok(Message::Ping(_) | Message::Pong(_)))) => Flow::Continue,
        };
        if let Flow::Close(code) = flow {
            let _ = connection
                .out
                .send(close(code, "session connection closed"))
                .await;
            break;
        }
    }
    // The operations go on; only their events stop here.
    connection.pumps.abort_all();
    // Dropping the connection drops its writer handle (a destructuring `let` would keep
    // the unnamed fields alive to the end of the function, and the writer would wait for
    // them): the writer then flushes, closes the socket and ends.
    let path = connection.path.clone();
    drop(connection);
    let abort = writer.abort_handle();
    if tokio::time::timeout(CLOSE_TIMEOUT, writer).await.is_err() {
        abort.abort();
        tracing::debug!(
            run_uid = path.uid,
            "session connection writer did not finish; cut"
        );
    }
    tracing::debug!(run_uid = path.uid, "session connection closed");
}
