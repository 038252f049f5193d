//! A sandbox's session connection (design document 001, "SDK Sandbox and Session Model";
//! docs/session-mode.md, "WebSocket frames"): [`Session::send`], [`Session::receive`],
//! [`Session::cancel`] and [`Session::close`] over the gateway's WebSocket, which this
//! module hides.
//!
//! One task owns the socket. It writes the caller's frames in the order they are given,
//! and reads the gateway's: the gateway answers every frame with exactly one reply, in
//! order (`queued` event or `rejected` for a send, `cancelled` or `rejected` for a cancel,
//! `heartbeat` or `rejected` for a heartbeat), so each reply goes to the call that waits
//! for it; events go to [`Session::receive`]. With a lease, the task also sends a heartbeat
//! every third of the lease (never shown to the caller; a refused one is reported by
//! [`Session::receive`]).
//!
//! Everything is bounded: events not yet received wait in a queue of at most
//! [`MAX_UNREAD_EVENTS`]; beyond it the task stops reading the socket (the gateway then
//! holds the operations' events back) until [`Session::receive`] catches up, so a caller
//! that sends must also receive. A reply that does not come within [`REPLY_TIMEOUT`], or a
//! connection that breaks after a frame was written, leaves that call's outcome unknown
//! ([`SandboxError::OutcomeUnknown`]): a send may have been queued, a cancel may have taken
//! effect. Closing or dropping a session closes the connection only: operations run on.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use futures::{SinkExt, StreamExt};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;

use crate::endpoint::bounded;
use crate::sandbox::SandboxError;

pub use kruntimes_api::lifecycle::MAX_OPERATION_ID_BYTES;
/// The largest file written or read, and the largest command stdin: 1 MiB.
pub const MAX_FILE_BYTES: usize = 1024 * 1024;
/// A command's stdout and stderr are each cut at 1 MiB by the runtime server
/// ([`Completed::stdout_truncated`] says when).
pub const MAX_STREAM_BYTES: usize = 1024 * 1024;
/// How long a send, cancel or heartbeat waits for its reply before its outcome is unknown.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(120);
/// Events received from the gateway and not yet taken by [`Session::receive`], at most.
pub const MAX_UNREAD_EVENTS: usize = 1024;
/// Events of other operations that [`Session::run`] keeps for [`Session::receive`], at most.
pub const MAX_KEPT_EVENTS: usize = 4096;
/// The largest frame taken from the gateway (an output chunk is at most 64 KiB).
const MAX_FRAME_BYTES: usize = 4 * 1024 * 1024;
/// Frames waiting for the socket task, at most.
const REQUESTS: usize = 16;
/// Events handed to the caller's side at once, at most (the rest wait in the task).
const EVENTS: usize = 64;
/// How long closing waits for the gateway to close its side.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// The shortest heartbeat interval.
const MIN_HEARTBEAT: Duration = Duration::from_millis(100);

// ---------------------------------------------------------------------------------------
// Operations
// ---------------------------------------------------------------------------------------

/// A program to run in the sandbox: exactly one of `argv` (executed directly) or `shell`
/// (one line for the Runtime's shell).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Command {
    /// The program and its arguments.
    pub argv: Vec<String>,
    /// A shell line, instead of `argv`.
    pub shell: Option<String>,
    /// Given on standard input (at most 1 MiB); empty: none.
    pub stdin: Vec<u8>,
    /// The working directory, relative to the workspace.
    pub cwd: Option<String>,
    /// Environment variables for this command only.
    pub env: BTreeMap<String, String>,
}

impl Command {
    /// Runs `argv` directly.
    pub fn argv<I, S>(argv: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Command {
            argv: argv.into_iter().map(Into::into).collect(),
            ..Command::default()
        }
    }

    /// Runs `line` with the Runtime's shell (`bash -c`).
    pub fn shell(line: impl Into<String>) -> Command {
        Command {
            shell: Some(line.into()),
            ..Command::default()
        }
    }
}

/// What an operation does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OperationKind {
    /// Run a program.
    Command(Command),
    /// Create or replace a regular file (at most 1 MiB); its directory must exist.
    WriteFile {
        /// Relative to the workspace.
        path: String,
        /// The file's bytes.
        content: Vec<u8>,
        /// Mode 0755 instead of 0644.
        executable: bool,
    },
    /// Create a directory (with `parents`, its missing parents too).
    MakeDirectory {
        /// Relative to the workspace.
        path: String,
        /// Create missing parents; succeed if it exists.
        parents: bool,
    },
    /// Remove a file or an empty directory (with `recursive`, any directory).
    Delete {
        /// Relative to the workspace.
        path: String,
        /// Remove a directory and everything beneath it.
        recursive: bool,
    },
    /// Rename `from` to `to`.
    Rename {
        /// Relative to the workspace.
        from: String,
        /// Relative to the workspace.
        to: String,
    },
}

/// One mutation of the sandbox, run in the session's order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operation {
    /// 1..128 bytes of `[A-Za-z0-9._-]`, unique in the session; `None`: the owner assigns
    /// `op-<n>`.
    pub operation_id: Option<String>,
    /// Its own limit, capped at the session's operation timeout; `None`: that timeout.
    pub timeout: Option<Duration>,
    /// What it does.
    pub kind: OperationKind,
}

impl Operation {
    /// An operation of `kind` with no ID and no timeout of its own.
    pub fn new(kind: OperationKind) -> Operation {
        Operation {
            operation_id: None,
            timeout: None,
            kind,
        }
    }

    /// Runs `command`.
    pub fn command(command: Command) -> Operation {
        Operation::new(OperationKind::Command(command))
    }

    /// Writes `content` to `path`.
    pub fn write_file(path: impl Into<String>, content: Vec<u8>, executable: bool) -> Operation {
        Operation::new(OperationKind::WriteFile {
            path: path.into(),
            content,
            executable,
        })
    }

    /// The same operation under `id`.
    pub fn with_id(mut self, id: impl Into<String>) -> Operation {
        self.operation_id = Some(id.into());
        self
    }

    /// The same operation with its own `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> Operation {
        self.timeout = Some(timeout);
        self
    }

    /// The operation's JSON (docs/session-mode.md, "Operations"), checked first: an
    /// [`SandboxError::BadRequest`] names what is wrong, and nothing is sent.
    pub fn to_json(&self) -> Result<Value, SandboxError> {
        let bad = |problem: &str| SandboxError::BadRequest {
            problem: problem.to_string(),
        };
        let mut operation = serde_json::Map::new();
        if let Some(id) = &self.operation_id {
            check_operation_id(id)?;
            operation.insert("operationId".into(), json!(id));
        }
        if let Some(timeout) = self.timeout {
            if timeout.is_zero() {
                return Err(bad("an operation's timeout must be above zero"));
            }
            operation.insert("timeoutSeconds".into(), json!(timeout.as_secs_f64()));
        }
        let (key, value) = match &self.kind {
            OperationKind::Command(command) => {
                let mut body = serde_json::Map::new();
                match (&command.shell, command.argv.is_empty()) {
                    (None, false) => {
                        body.insert("argv".into(), json!(command.argv));
                    }
                    (Some(line), true) if !line.is_empty() => {
                        body.insert("shell".into(), json!(line));
                    }
                    _ => {
                        return Err(bad(
                            "a command has exactly one of a non-empty argv or a non-empty shell line",
                        ));
                    }
                }
                if command.stdin.len() > MAX_FILE_BYTES {
                    return Err(bad("a command's stdin is at most 1 MiB"));
                }
                if !command.stdin.is_empty() {
                    body.insert("stdin".into(), json!(BASE64.encode(&command.stdin)));
                }
                if let Some(cwd) = &command.cwd {
                    body.insert("cwd".into(), json!(cwd));
                }
                if !command.env.is_empty() {
                    body.insert("env".into(), json!(command.env));
                }
                ("command", Value::Object(body))
            }
            OperationKind::WriteFile {
                path,
                content,
                executable,
            } => {
                if content.len() > MAX_FILE_BYTES {
                    return Err(SandboxError::TooLarge {
                        what: format!("{path} ({} bytes)", content.len()),
                        limit: MAX_FILE_BYTES,
                    });
                }
                (
                    "writeFile",
                    json!({"path": path, "content": BASE64.encode(content), "executable": executable}),
                )
            }
            OperationKind::MakeDirectory { path, parents } => {
                ("makeDirectory", json!({"path": path, "parents": parents}))
            }
            OperationKind::Delete { path, recursive } => {
                ("delete", json!({"path": path, "recursive": recursive}))
            }
            OperationKind::Rename { from, to } => ("rename", json!({"from": from, "to": to})),
        };
        operation.insert(key.into(), value);
        Ok(Value::Object(operation))
    }
}

/// [`SandboxError::BadRequest`] unless `id` is 1..128 bytes of `[A-Za-z0-9._-]`.
pub fn check_operation_id(id: &str) -> Result<(), SandboxError> {
    if kruntimes_api::lifecycle::is_operation_id(id) {
        Ok(())
    } else {
        Err(SandboxError::BadRequest {
            problem: format!(
                "an operation ID is 1 to {MAX_OPERATION_ID_BYTES} bytes of [A-Za-z0-9._-]"
            ),
        })
    }
}

// ---------------------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------------------

/// Where an output chunk came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputStream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// How an operation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OperationState {
    /// It did what it was asked (a command exited 0).
    Succeeded,
    /// A command exited non-zero or was killed, or the filesystem refused a file operation.
    Failed,
    /// It was cancelled (or the session closed) before it ended.
    Cancelled,
    /// It ran out of time.
    TimedOut,
    /// A state this SDK does not know.
    Unknown,
}

impl OperationState {
    fn parse(text: &str) -> OperationState {
        match text {
            "Succeeded" => OperationState::Succeeded,
            "Failed" => OperationState::Failed,
            "Cancelled" => OperationState::Cancelled,
            "TimedOut" => OperationState::TimedOut,
            _ => OperationState::Unknown,
        }
    }

    /// The state as the API writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            OperationState::Succeeded => "Succeeded",
            OperationState::Failed => "Failed",
            OperationState::Cancelled => "Cancelled",
            OperationState::TimedOut => "TimedOut",
            OperationState::Unknown => "Unknown",
        }
    }
}

/// The end of an operation. A command's exit code is a result, not an error: exit code 3
/// is a [`OperationState::Failed`] operation with reason `NonZeroExitCode`.
#[derive(Clone, Debug, PartialEq)]
pub struct Completed {
    /// How it ended.
    pub state: OperationState,
    /// CamelCase, stable: `Completed`, `NonZeroExitCode`, `Signaled`, `Timeout`, …
    pub reason: String,
    /// Bounded; never command output.
    pub message: String,
    /// A command's exit code, when it exited.
    pub exit_code: Option<i32>,
    /// The signal that killed a command, when one did.
    pub signal: Option<i32>,
    /// How long it ran.
    pub duration: Duration,
    /// Bytes each stream produced, and whether it was cut at 1 MiB.
    pub stdout_bytes: u64,
    /// Bytes of standard error.
    pub stderr_bytes: u64,
    /// Standard output was cut at 1 MiB.
    pub stdout_truncated: bool,
    /// Standard error was cut at 1 MiB.
    pub stderr_truncated: bool,
}

/// What happened to an operation.
#[derive(Clone, Debug, PartialEq)]
pub enum EventKind {
    /// Admitted into the session's queue behind `position` others.
    Queued {
        /// Mutations ahead of it, the running one included.
        position: u32,
    },
    /// It started running.
    Started,
    /// A chunk of a command's output, in order.
    Output {
        /// Which stream.
        stream: OutputStream,
        /// The bytes.
        data: Vec<u8>,
        /// The stream was cut at its 1 MiB bound here; nothing later of it comes.
        truncated: bool,
    },
    /// It ended; nothing more comes for it.
    Completed(Completed),
    /// Its events were cut off before it completed (the worker's stream broke, the
    /// gateway shut down): it may or may not run to its end. Nothing more comes for it on
    /// this connection.
    Failed {
        /// An HTTP-like status.
        status: u16,
        /// Machine-readable.
        reason: String,
        /// Bounded.
        message: String,
    },
}

impl EventKind {
    /// Whether nothing more comes for the operation after this event.
    pub fn is_final(&self) -> bool {
        matches!(self, EventKind::Completed(_) | EventKind::Failed { .. })
    }
}

/// One event of one operation. `sequence` is the session's, in the order the owner
/// produced the events (an operation sent on another connection leaves gaps here).
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// The operation.
    pub operation_id: String,
    /// The session's sequence number of this event.
    pub sequence: u64,
    /// What happened.
    pub kind: EventKind,
}

/// What a cancel found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cancelled {
    /// Whether the operation was queued or running; `false` for an unknown or already
    /// finished one.
    pub found: bool,
    /// Its state after the request (`Cancelled`, or how it had already ended).
    pub state: Option<OperationState>,
}

// ---------------------------------------------------------------------------------------
// Frames from the gateway
// ---------------------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct FrameJson {
    #[serde(rename = "type")]
    type_: String,
    #[serde(default)]
    operation_id: Option<String>,
    #[serde(default)]
    sequence: u64,
    #[serde(default)]
    queued: Option<QueuedJson>,
    #[serde(default)]
    started: Option<Value>,
    #[serde(default)]
    output: Option<OutputJson>,
    #[serde(default)]
    completed: Option<CompletedJson>,
    #[serde(default)]
    status: Option<u16>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    found: Option<bool>,
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    lease_expires_at: Option<String>,
}

#[derive(Debug, Deserialize)]
struct QueuedJson {
    #[serde(default)]
    position: u32,
}

#[derive(Debug, Deserialize)]
struct OutputJson {
    #[serde(default)]
    stream: String,
    #[serde(default)]
    data: String,
    #[serde(default)]
    truncated: bool,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CompletedJson {
    #[serde(default)]
    state: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    message: String,
    #[serde(default)]
    exit_code: Option<i32>,
    #[serde(default)]
    signal: Option<i32>,
    #[serde(default)]
    duration_ms: f64,
    #[serde(default)]
    stdout_bytes: u64,
    #[serde(default)]
    stderr_bytes: u64,
    #[serde(default)]
    stdout_truncated: bool,
    #[serde(default)]
    stderr_truncated: bool,
}

/// A frame from the gateway, read.
#[derive(Debug, PartialEq)]
enum Frame {
    /// An event; `admission` when it is the `queued` reply to a send.
    Event {
        event: Event,
        admission: bool,
    },
    Rejected {
        operation_id: Option<String>,
        status: u16,
        reason: String,
        message: String,
    },
    Cancelled(Cancelled),
    Heartbeat {
        lease_expires_at: Option<String>,
    },
    /// The connection ends.
    ConnectionError {
        status: u16,
        reason: String,
        message: String,
    },
    /// A frame type this SDK does not know: skipped.
    Unknown,
}

fn parse_frame(text: &str) -> Result<Frame, String> {
    let frame: FrameJson =
        serde_json::from_str(text).map_err(|e| format!("a frame is not JSON: {e}"))?;
    let status = frame.status.unwrap_or(0);
    let reason = frame.reason.unwrap_or_default();
    let message = bounded(&frame.message.unwrap_or_default());
    Ok(match frame.type_.as_str() {
        "event" => {
            let operation_id = frame.operation_id.unwrap_or_default();
            let (kind, admission) = if let Some(q) = frame.queued {
                (
                    EventKind::Queued {
                        position: q.position,
                    },
                    true,
                )
            } else if frame.started.is_some() {
                (EventKind::Started, false)
            } else if let Some(o) = frame.output {
                let data = BASE64
                    .decode(o.data.as_bytes())
                    .map_err(|_| "an output event's data is not base64".to_string())?;
                let stream = match o.stream.as_str() {
                    "stderr" => OutputStream::Stderr,
                    _ => OutputStream::Stdout,
                };
                (
                    EventKind::Output {
                        stream,
                        data,
                        truncated: o.truncated,
                    },
                    false,
                )
            } else if let Some(c) = frame.completed {
                (
                    EventKind::Completed(Completed {
                        state: OperationState::parse(&c.state),
                        reason: c.reason,
                        message: bounded(&c.message),
                        exit_code: c.exit_code,
                        signal: c.signal,
                        duration: Duration::try_from_secs_f64(c.duration_ms / 1000.0)
                            .unwrap_or_default(),
                        stdout_bytes: c.stdout_bytes,
                        stderr_bytes: c.stderr_bytes,
                        stdout_truncated: c.stdout_truncated,
                        stderr_truncated: c.stderr_truncated,
                    }),
                    false,
                )
            } else {
                return Ok(Frame::Unknown);
            };
            Frame::Event {
                event: Event {
                    operation_id,
                    sequence: frame.sequence,
                    kind,
                },
                admission,
            }
        }
        "rejected" => Frame::Rejected {
            operation_id: frame.operation_id,
            status,
            reason,
            message,
        },
        "cancelled" => Frame::Cancelled(Cancelled {
            found: frame.found.unwrap_or(false),
            state: frame.state.as_deref().map(OperationState::parse),
        }),
        "heartbeat" => Frame::Heartbeat {
            lease_expires_at: frame.lease_expires_at,
        },
        "error" => match frame.operation_id {
            Some(operation_id) => Frame::Event {
                event: Event {
                    operation_id,
                    sequence: 0,
                    kind: EventKind::Failed {
                        status,
                        reason,
                        message,
                    },
                },
                admission: false,
            },
            None => Frame::ConnectionError {
                status,
                reason,
                message,
            },
        },
        _ => Frame::Unknown,
    })
}

// ---------------------------------------------------------------------------------------
// The socket task
// ---------------------------------------------------------------------------------------

/// A call waiting for its reply.
enum Pending {
    Send(oneshot::Sender<Result<String, SandboxError>>),
    Cancel {
        operation_id: String,
        reply: oneshot::Sender<Result<Cancelled, SandboxError>>,
    },
    /// `None`: the private heartbeat.
    Heartbeat(Option<oneshot::Sender<Result<Option<String>, SandboxError>>>),
}

impl Pending {
    /// The connection ended before the reply: the frame may or may not have taken effect.
    fn fail(self) {
        match self {
            Pending::Send(reply) => {
                let _ = reply.send(Err(SandboxError::OutcomeUnknown {
                    operation_id: None,
                    what: "the connection closed before the operation's admission was seen; \
                           it may or may not have been queued"
                        .into(),
                }));
            }
            Pending::Cancel {
                operation_id,
                reply,
            } => {
                let _ = reply.send(Err(SandboxError::OutcomeUnknown {
                    what: format!(
                        "the connection closed before the cancel of {operation_id} was answered; \
                         it may or may not have taken effect"
                    ),
                    operation_id: Some(operation_id),
                }));
            }
            Pending::Heartbeat(Some(reply)) => {
                let _ = reply.send(Err(SandboxError::Closed));
            }
            Pending::Heartbeat(None) => {}
        }
    }
}

/// What the caller asks the socket task to do.
enum Request {
    Send {
        frame: String,
        reply: oneshot::Sender<Result<String, SandboxError>>,
    },
    Cancel {
        frame: String,
        operation_id: String,
        reply: oneshot::Sender<Result<Cancelled, SandboxError>>,
    },
    Heartbeat(oneshot::Sender<Result<Option<String>, SandboxError>>),
    Close,
}

type Delivery = Result<Event, SandboxError>;

/// The socket task's state.
struct Socket<S> {
    sink: futures::stream::SplitSink<WebSocketStream<S>, Message>,
    pending: VecDeque<Pending>,
    unread: VecDeque<Delivery>,
}

impl<S> Socket<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    /// Writes `frame`; the caller's reply is pending once it is out.
    async fn write(&mut self, frame: String, pending: Pending) -> bool {
        match self.sink.send(Message::Text(frame.into())).await {
            Ok(()) => {
                self.pending.push_back(pending);
                true
            }
            Err(_) => {
                pending.fail();
                false
            }
        }
    }

    /// Takes one frame from the gateway; `false` when the connection must end.
    fn read(&mut self, text: &str) -> bool {
        let frame = match parse_frame(text) {
            Ok(frame) => frame,
            Err(problem) => return self.protocol_error(problem),
        };
        match frame {
            Frame::Unknown => true,
            Frame::Event { event, admission } => {
                if admission {
                    match self.pending.pop_front() {
                        Some(Pending::Send(reply)) => {
                            let _ = reply.send(Ok(event.operation_id.clone()));
                        }
                        other => return self.mismatch(other, "an admission"),
                    }
                }
                self.unread.push_back(Ok(event));
                true
            }
            Frame::Rejected {
                operation_id,
                status,
                reason,
                message,
            } => {
                let rejected = SandboxError::Rejected {
                    operation_id,
                    status,
                    reason,
                    message,
                };
                match self.pending.pop_front() {
                    Some(Pending::Send(reply)) => {
                        let _ = reply.send(Err(rejected));
                    }
                    Some(Pending::Cancel { reply, .. }) => {
                        let _ = reply.send(Err(rejected));
                    }
                    Some(Pending::Heartbeat(Some(reply))) => {
                        let _ = reply.send(Err(rejected));
                    }
                    Some(Pending::Heartbeat(None)) => {
                        self.unread
                            .push_back(Err(SandboxError::Heartbeat(Box::new(rejected))));
                    }
                    None => return self.mismatch(None, "a rejection"),
                }
                true
            }
            Frame::Cancelled(cancelled) => match self.pending.pop_front() {
                Some(Pending::Cancel { reply, .. }) => {
                    let _ = reply.send(Ok(cancelled));
                    true
                }
                other => self.mismatch(other, "a cancel's answer"),
            },
            Frame::Heartbeat { lease_expires_at } => match self.pending.pop_front() {
                Some(Pending::Heartbeat(reply)) => {
                    if let Some(reply) = reply {
                        let _ = reply.send(Ok(lease_expires_at));
                    }
                    true
                }
                other => self.mismatch(other, "a heartbeat's answer"),
            },
            Frame::ConnectionError {
                status,
                reason,
                message,
            } => {
                self.unread.push_back(Err(SandboxError::ConnectionEnded {
                    status,
                    reason,
                    message,
                }));
                true
            }
        }
    }

    fn mismatch(&mut self, pending: Option<Pending>, what: &str) -> bool {
        if let Some(pending) = pending {
            pending.fail();
        }
        self.protocol_error(format!(
            "the gateway sent {what} that answers no waiting call"
        ))
    }

    fn protocol_error(&mut self, problem: String) -> bool {
        self.unread
            .push_back(Err(SandboxError::Protocol { problem }));
        false
    }
}

/// Runs the connection until the caller closes it or the gateway does.
async fn run_socket<S>(
    socket: WebSocketStream<S>,
    mut requests: mpsc::Receiver<Request>,
    events: mpsc::Sender<Delivery>,
    heartbeat: Option<Duration>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (sink, mut stream) = socket.split();
    let mut socket = Socket {
        sink,
        pending: VecDeque::new(),
        unread: VecDeque::new(),
    };
    let mut ticker = heartbeat.map(|every| {
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker
    });
    let heartbeat_frame = json!({"type": "heartbeat"}).to_string();
    let mut closing = false;
    loop {
        let tick = async {
            match ticker.as_mut() {
                Some(ticker) => {
                    ticker.tick().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            request = requests.recv(), if !closing => match request {
                None | Some(Request::Close) => {
                    closing = true;
                    if socket.sink.send(Message::Close(None)).await.is_err() {
                        break;
                    }
                }
                Some(Request::Send { frame, reply }) => {
                    if !socket.write(frame, Pending::Send(reply)).await {
                        break;
                    }
                }
                Some(Request::Cancel { frame, operation_id, reply }) => {
                    if !socket.write(frame, Pending::Cancel { operation_id, reply }).await {
                        break;
                    }
                }
                Some(Request::Heartbeat(reply)) => {
                    if !socket.write(heartbeat_frame.clone(), Pending::Heartbeat(Some(reply))).await {
                        break;
                    }
                }
            },
            _ = tick, if !closing => {
                if !socket.write(heartbeat_frame.clone(), Pending::Heartbeat(None)).await {
                    break;
                }
            }
            permit = events.reserve(), if !socket.unread.is_empty() => match permit {
                Ok(permit) => {
                    if let Some(delivery) = socket.unread.pop_front() {
                        permit.send(delivery);
                    }
                }
                // The session was dropped.
                Err(_) => break,
            },
            message = stream.next(), if socket.unread.len() < MAX_UNREAD_EVENTS => match message {
                None | Some(Err(_)) | Some(Ok(Message::Close(_))) => break,
                Some(Ok(Message::Text(text))) => {
                    if !socket.read(text.as_str()) {
                        break;
                    }
                }
                Some(Ok(Message::Binary(_))) => {
                    socket.protocol_error("the gateway sent a binary frame".into());
                    break;
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
            },
            _ = tokio::time::sleep(CLOSE_TIMEOUT), if closing => break,
        }
    }
    for pending in socket.pending.drain(..) {
        pending.fail();
    }
    // What was received is still delivered, then the end.
    for delivery in socket.unread.drain(..) {
        if events.send(delivery).await.is_err() {
            break;
        }
    }
}

// ---------------------------------------------------------------------------------------
// The session
// ---------------------------------------------------------------------------------------

/// An open connection to a sandbox's session: see the module documentation. Dropping it
/// closes the connection abruptly; [`Session::close`] closes it cleanly. Neither cancels
/// anything.
pub struct Session {
    requests: mpsc::Sender<Request>,
    events: mpsc::Receiver<Delivery>,
    /// Events of other operations that [`Session::run`] received, for
    /// [`Session::receive`].
    kept: VecDeque<Event>,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("kept", &self.kept.len())
            .finish_non_exhaustive()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// How often to send heartbeats for a lease of `lease`: a third of it, at least
/// [`MIN_HEARTBEAT`].
pub fn heartbeat_interval(lease: Duration) -> Duration {
    (lease / 3).max(MIN_HEARTBEAT)
}

/// The socket configuration of a session: frames bounded.
pub(crate) fn socket_config() -> tokio_tungstenite::tungstenite::protocol::WebSocketConfig {
    tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
        .max_message_size(Some(MAX_FRAME_BYTES))
        .max_frame_size(Some(MAX_FRAME_BYTES))
}

async fn reply<T>(
    answer: oneshot::Receiver<Result<T, SandboxError>>,
    operation_id: Option<&str>,
    what: &str,
) -> Result<T, SandboxError> {
    match tokio::time::timeout(REPLY_TIMEOUT, answer).await {
        Ok(Ok(result)) => result,
        Ok(Err(_)) => Err(SandboxError::OutcomeUnknown {
            operation_id: operation_id.map(str::to_string),
            what: format!("the connection ended before {what} was answered"),
        }),
        Err(_) => Err(SandboxError::OutcomeUnknown {
            operation_id: operation_id.map(str::to_string),
            what: format!("no answer to {what} within {}s", REPLY_TIMEOUT.as_secs()),
        }),
    }
}

impl Session {
    /// A session over an open WebSocket; with `heartbeat`, a heartbeat goes out at that
    /// interval.
    pub(crate) fn start<S>(socket: WebSocketStream<S>, heartbeat: Option<Duration>) -> Session
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (requests, requests_rx) = mpsc::channel(REQUESTS);
        let (events_tx, events) = mpsc::channel(EVENTS);
        let task = tokio::spawn(run_socket(socket, requests_rx, events_tx, heartbeat));
        Session {
            requests,
            events,
            kept: VecDeque::new(),
            task: Some(task),
        }
    }

    async fn request(&self, request: Request) -> Result<(), SandboxError> {
        self.requests
            .send(request)
            .await
            .map_err(|_| SandboxError::Closed)
    }

    /// Sends `operation` and returns its ID once the session has admitted it (its `queued`
    /// event, which [`Session::receive`] returns too). Sends on one session are admitted
    /// in the order they are made.
    ///
    /// Errors: [`SandboxError::BadRequest`] or [`SandboxError::TooLarge`] before sending;
    /// [`SandboxError::Rejected`] when the session refused it (429 queue full, 409
    /// draining or a repeated ID, …; it did not run); [`SandboxError::Closed`] when the
    /// connection was closed already (not sent); [`SandboxError::OutcomeUnknown`] when
    /// the connection broke or no answer came after it was sent.
    pub async fn send(&self, operation: &Operation) -> Result<String, SandboxError> {
        let frame = json!({"type": "send", "operation": operation.to_json()?}).to_string();
        let (tx, answer) = oneshot::channel();
        self.request(Request::Send { frame, reply: tx }).await?;
        reply(answer, operation.operation_id.as_deref(), "the operation").await
    }

    /// Asks the session to cancel `operation_id` (queued: it ends cancelled without
    /// running; running: its processes are killed). Its `completed` event follows.
    pub async fn cancel(&self, operation_id: &str) -> Result<Cancelled, SandboxError> {
        check_operation_id(operation_id)?;
        let frame = json!({"type": "cancel", "operationId": operation_id}).to_string();
        let (tx, answer) = oneshot::channel();
        self.request(Request::Cancel {
            frame,
            operation_id: operation_id.to_string(),
            reply: tx,
        })
        .await?;
        reply(answer, Some(operation_id), "the cancel").await
    }

    /// Renews the lease now; returns when it expires next (RFC 3339), `None` without a
    /// lease. The session does this by itself while open.
    pub async fn heartbeat(&self) -> Result<Option<String>, SandboxError> {
        let (tx, answer) = oneshot::channel();
        self.request(Request::Heartbeat(tx)).await?;
        reply(answer, None, "the heartbeat").await
    }

    /// The next event of the operations sent on this session, in order.
    ///
    /// Errors: [`SandboxError::Heartbeat`] when a private heartbeat was refused (the
    /// session may have ended), [`SandboxError::ConnectionEnded`] when the gateway ends
    /// the connection, [`SandboxError::Protocol`], then [`SandboxError::Closed`] for good
    /// once the connection is closed and every event has been received.
    pub async fn receive(&mut self) -> Result<Event, SandboxError> {
        if let Some(event) = self.kept.pop_front() {
            return Ok(event);
        }
        self.receive_new().await
    }

    async fn receive_new(&mut self) -> Result<Event, SandboxError> {
        self.events
            .recv()
            .await
            .unwrap_or(Err(SandboxError::Closed))
    }

    /// Sends `operation` and receives until it completes, calling `on_output` with each
    /// chunk of its output as it arrives. Events of other operations received meanwhile
    /// are kept for [`Session::receive`] (at most [`MAX_KEPT_EVENTS`]).
    ///
    /// Returns how it ended, whatever that is (a non-zero exit is a [`Completed`] too).
    /// Errors: those of [`Session::send`]; [`SandboxError::OutcomeUnknown`] when its
    /// events are cut off before it completes.
    pub async fn run(
        &mut self,
        operation: &Operation,
        mut on_output: impl FnMut(OutputStream, &[u8]),
    ) -> Result<Completed, SandboxError> {
        let id = self.send(operation).await?;
        self.follow(&id, &mut on_output).await
    }

    /// Receives the events of `operation_id` until it completes (see [`Session::run`]). A
    /// connection that ends first leaves its outcome unknown.
    pub async fn follow(
        &mut self,
        operation_id: &str,
        on_output: &mut impl FnMut(OutputStream, &[u8]),
    ) -> Result<Completed, SandboxError> {
        loop {
            let event = match self.receive_new().await {
                Ok(event) => event,
                // The operation goes on without this connection.
                Err(SandboxError::Closed | SandboxError::ConnectionEnded { .. }) => {
                    return Err(SandboxError::OutcomeUnknown {
                        operation_id: Some(operation_id.to_string()),
                        what: format!(
                            "the connection closed before operation {operation_id} completed; it goes on"
                        ),
                    });
                }
                Err(e) => return Err(e),
            };
            if event.operation_id != operation_id {
                if self.kept.len() >= MAX_KEPT_EVENTS {
                    return Err(SandboxError::BadRequest {
                        problem: format!(
                            "more than {MAX_KEPT_EVENTS} events of other operations arrived \
                             while following {operation_id}; receive them first"
                        ),
                    });
                }
                self.kept.push_back(event);
                continue;
            }
            match event.kind {
                EventKind::Queued { .. } | EventKind::Started => {}
                EventKind::Output { stream, data, .. } => on_output(stream, &data),
                EventKind::Completed(completed) => return Ok(completed),
                EventKind::Failed {
                    status,
                    reason,
                    message,
                } => {
                    return Err(SandboxError::OutcomeUnknown {
                        operation_id: Some(event.operation_id),
                        what: format!("its events were cut off ({status} {reason}: {message})"),
                    });
                }
            }
        }
    }

    /// Runs `command` to its end (see [`Session::run`]).
    pub async fn exec(
        &mut self,
        command: Command,
        on_output: impl FnMut(OutputStream, &[u8]),
    ) -> Result<Completed, SandboxError> {
        self.run(&Operation::command(command), on_output).await
    }

    /// Writes `content` to `path` and waits for the write to complete.
    pub async fn write_file(
        &mut self,
        path: &str,
        content: Vec<u8>,
        executable: bool,
    ) -> Result<Completed, SandboxError> {
        self.run(&Operation::write_file(path, content, executable), |_, _| {})
            .await
    }

    /// Closes the connection cleanly. Operations run on; the sandbox stays.
    pub async fn close(mut self) {
        let _ = self.requests.send(Request::Close).await;
        if let Some(mut task) = self.task.take()
            && tokio::time::timeout(CLOSE_TIMEOUT * 2, &mut task)
                .await
                .is_err()
        {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio_tungstenite::tungstenite::protocol::Role;

    use super::*;

    #[test]
    fn operations_serialise_as_documented() {
        let mut command = Command::argv(["ls", "-l"]);
        command.stdin = b"hi".to_vec();
        command.cwd = Some("src".into());
        command.env.insert("K".into(), "v".into());
        let op = Operation::command(command)
            .with_id("op-1")
            .with_timeout(Duration::from_millis(1500));
        assert_eq!(
            op.to_json().expect("valid"),
            json!({"operationId": "op-1", "timeoutSeconds": 1.5,
                   "command": {"argv": ["ls", "-l"], "stdin": "aGk=", "cwd": "src", "env": {"K": "v"}}})
        );
        assert_eq!(
            Operation::command(Command::shell("make test | tail -5"))
                .to_json()
                .expect("shell"),
            json!({"command": {"shell": "make test | tail -5"}})
        );
        assert_eq!(
            Operation::write_file("a/b.txt", vec![0, 1, 2], false)
                .to_json()
                .expect("write"),
            json!({"writeFile": {"path": "a/b.txt", "content": "AAEC", "executable": false}})
        );
        let kinds = [
            (
                OperationKind::MakeDirectory {
                    path: "a/b".into(),
                    parents: true,
                },
                json!({"makeDirectory": {"path": "a/b", "parents": true}}),
            ),
            (
                OperationKind::Delete {
                    path: "a".into(),
                    recursive: true,
                },
                json!({"delete": {"path": "a", "recursive": true}}),
            ),
            (
                OperationKind::Rename {
                    from: "a.txt".into(),
                    to: "b.txt".into(),
                },
                json!({"rename": {"from": "a.txt", "to": "b.txt"}}),
            ),
        ];
        for (kind, expected) in kinds {
            assert_eq!(Operation::new(kind).to_json().expect("valid"), expected);
        }
    }

    #[test]
    fn bad_operations_are_refused_before_sending() {
        let mut both = Command::argv(["ls"]);
        both.shell = Some("ls".into());
        for op in [
            Operation::command(Command::default()),
            Operation::command(both),
            Operation::command(Command::shell("")),
            Operation::command(Command::shell("x")).with_id("a b"),
            Operation::command(Command::shell("x")).with_id("x".repeat(129)),
            Operation::command(Command::shell("x")).with_timeout(Duration::ZERO),
        ] {
            assert!(
                matches!(op.to_json(), Err(SandboxError::BadRequest { .. })),
                "{op:?}"
            );
        }
        let big = Operation::write_file("big", vec![0; MAX_FILE_BYTES + 1], false);
        assert!(matches!(big.to_json(), Err(SandboxError::TooLarge { .. })));
    }

    #[test]
    fn frames_parse() {
        let frame = |text: &str| parse_frame(text).expect(text);
        assert_eq!(
            frame(r#"{"type":"event","operationId":"op-1","sequence":1,"queued":{"position":2}}"#),
            Frame::Event {
                event: Event {
                    operation_id: "op-1".into(),
                    sequence: 1,
                    kind: EventKind::Queued { position: 2 }
                },
                admission: true
            }
        );
        assert_eq!(
            frame(r#"{"type":"event","operationId":"op-1","sequence":2,"started":{}}"#),
            Frame::Event {
                event: Event {
                    operation_id: "op-1".into(),
                    sequence: 2,
                    kind: EventKind::Started
                },
                admission: false
            }
        );
        let Frame::Event { event, .. } = frame(
            r#"{"type":"event","operationId":"op-1","sequence":3,"output":{"stream":"stderr","data":"aGVsbG8K","truncated":true}}"#,
        ) else {
            panic!("not an event");
        };
        assert_eq!(
            event.kind,
            EventKind::Output {
                stream: OutputStream::Stderr,
                data: b"hello\n".to_vec(),
                truncated: true
            }
        );
        let Frame::Event { event, .. } = frame(
            r#"{"type":"event","operationId":"op-1","sequence":4,"completed":{"state":"Failed","reason":"NonZeroExitCode","message":"","exitCode":3,"durationMs":3.5,"stdoutBytes":6,"stderrBytes":0,"stdoutTruncated":false,"stderrTruncated":false,"later":1}}"#,
        ) else {
            panic!("not an event");
        };
        let EventKind::Completed(completed) = event.kind else {
            panic!("not completed");
        };
        assert_eq!(completed.state, OperationState::Failed);
        assert_eq!(completed.exit_code, Some(3));
        assert_eq!(completed.duration, Duration::from_micros(3500));
        assert_eq!(
            frame(
                r#"{"type":"rejected","operationId":"op-9","status":429,"reason":"TooManyRequests","message":"full"}"#
            ),
            Frame::Rejected {
                operation_id: Some("op-9".into()),
                status: 429,
                reason: "TooManyRequests".into(),
                message: "full".into()
            }
        );
        assert_eq!(
            frame(r#"{"type":"cancelled","operationId":"op-3","found":true,"state":"Cancelled"}"#),
            Frame::Cancelled(Cancelled {
                found: true,
                state: Some(OperationState::Cancelled)
            })
        );
        assert_eq!(
            frame(r#"{"type":"heartbeat","leaseExpiresAt":"2026-11-30T10:00:00Z"}"#),
            Frame::Heartbeat {
                lease_expires_at: Some("2026-11-30T10:00:00Z".into())
            }
        );
        assert!(matches!(
            frame(
                r#"{"type":"error","operationId":"op-1","status":502,"reason":"OutcomeUnknown","message":"cut"}"#
            ),
            Frame::Event {
                event: Event {
                    kind: EventKind::Failed { status: 502, .. },
                    ..
                },
                admission: false
            }
        ));
        assert!(matches!(
            frame(
                r#"{"type":"error","status":503,"reason":"ServiceUnavailable","message":"down"}"#
            ),
            Frame::ConnectionError { status: 503, .. }
        ));
        assert_eq!(frame(r#"{"type":"news"}"#), Frame::Unknown);
        assert!(parse_frame("not json").is_err());
        assert!(
            parse_frame(r#"{"type":"event","operationId":"x","output":{"data":"%%"}}"#).is_err()
        );
    }

    /// A gateway that answers every frame as the real one does, in order.
    async fn fake_gateway(mut socket: WebSocketStream<tokio::io::DuplexStream>) {
        let mut sequence = 0u64;
        let mut next = |id: &str, body: Value| {
            sequence += 1;
            let mut frame = json!({"type": "event", "operationId": id, "sequence": sequence});
            if let (Some(frame), Some(body)) = (frame.as_object_mut(), body.as_object()) {
                frame.extend(body.clone());
            }
            Message::Text(frame.to_string().into())
        };
        let mut count = 0;
        while let Some(Ok(Message::Text(text))) = socket.next().await {
            let frame: Value = serde_json::from_str(text.as_str()).expect("json");
            let replies = match frame["type"].as_str() {
                Some("send") => {
                    count += 1;
                    let id = frame["operation"]["operationId"]
                        .as_str()
                        .map_or_else(|| format!("op-{count}"), str::to_string);
                    if id == "refused" {
                        vec![Message::Text(
                            json!({"type": "rejected", "operationId": id, "status": 429,
                                   "reason": "TooManyRequests", "message": "full"})
                            .to_string()
                            .into(),
                        )]
                    } else {
                        vec![
                            next(&id, json!({"queued": {"position": 0}})),
                            next(&id, json!({"started": {}})),
                            next(&id, json!({"output": {"stream": "stdout", "data": "aGkK", "truncated": false}})),
                            next(&id, json!({"completed": {"state": "Failed", "reason": "NonZeroExitCode",
                                "message": "", "exitCode": 3, "durationMs": 1.0}})),
                        ]
                    }
                }
                Some("cancel") => vec![Message::Text(
                    json!({"type": "cancelled", "operationId": frame["operationId"], "found": false})
                        .to_string()
                        .into(),
                )],
                Some("heartbeat") => vec![Message::Text(
                    json!({"type": "heartbeat", "leaseExpiresAt": "2026-11-30T10:00:00Z"})
                        .to_string()
                        .into(),
                )],
                _ => vec![],
            };
            for reply in replies {
                if socket.send(reply).await.is_err() {
                    return;
                }
            }
        }
    }

    #[tokio::test]
    async fn replies_reach_their_calls_and_events_reach_receive() {
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let client = WebSocketStream::from_raw_socket(client_io, Role::Client, None).await;
        let server = WebSocketStream::from_raw_socket(server_io, Role::Server, None).await;
        let gateway = tokio::spawn(fake_gateway(server));
        // Private heartbeats go out all along; their replies never reach receive().
        let mut session = Session::start(client, Some(MIN_HEARTBEAT));

        let first = session
            .send(&Operation::command(Command::shell("exit 3")))
            .await
            .expect("admitted");
        assert_eq!(first, "op-1");
        let refused = session
            .send(&Operation::command(Command::shell("x")).with_id("refused"))
            .await
            .expect_err("refused");
        assert!(
            matches!(&refused, SandboxError::Rejected { status: 429, .. }),
            "{refused:?}"
        );
        assert!(!refused.outcome_unknown());
        let cancelled = session.cancel("op-1").await.expect("answered");
        assert!(!cancelled.found);
        assert_eq!(
            session.heartbeat().await.expect("renewed").as_deref(),
            Some("2026-11-30T10:00:00Z")
        );
        let mut seen = Vec::new();
        for _ in 0..4 {
            let event = session.receive().await.expect("event");
            assert_eq!(event.operation_id, "op-1");
            seen.push(event.sequence);
        }
        assert_eq!(seen, vec![1, 2, 3, 4]);

        // run() follows one operation to its end, with its output.
        let mut output = Vec::new();
        let completed = session
            .exec(Command::argv(["false"]), |stream, data| {
                assert_eq!(stream, OutputStream::Stdout);
                output.extend_from_slice(data);
            })
            .await
            .expect("completed");
        assert_eq!(completed.exit_code, Some(3));
        assert_eq!(completed.state, OperationState::Failed);
        assert_eq!(output, b"hi\n");

        session.close().await;
        gateway
            .await
            .expect("the fake gateway ends when the client closes");
    }

    #[tokio::test]
    async fn a_lost_connection_leaves_a_send_unknown() {
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let client = WebSocketStream::from_raw_socket(client_io, Role::Client, None).await;
        let mut server = WebSocketStream::from_raw_socket(server_io, Role::Server, None).await;
        let mut session = Session::start(client, None);
        // The gateway reads the send and goes away without answering.
        let gateway = tokio::spawn(async move {
            let frame = server.next().await;
            drop(server);
            frame
        });
        let lost = session
            .send(&Operation::command(Command::shell("x")))
            .await
            .expect_err("no answer");
        assert!(lost.outcome_unknown(), "{lost:?}");
        assert!(matches!(
            gateway.await.expect("gateway"),
            Some(Ok(Message::Text(_)))
        ));
        assert!(matches!(session.receive().await, Err(SandboxError::Closed)));
        let late = session
            .send(&Operation::command(Command::shell("x")))
            .await
            .expect_err("closed");
        assert!(matches!(late, SandboxError::Closed), "{late:?}");
        assert!(!late.outcome_unknown());
    }

    #[test]
    fn heartbeats_come_thrice_per_lease() {
        assert_eq!(
            heartbeat_interval(Duration::from_secs(30)),
            Duration::from_secs(10)
        );
        assert_eq!(heartbeat_interval(Duration::from_millis(30)), MIN_HEARTBEAT);
    }
}
