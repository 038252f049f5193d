//! The JSON of session mode (docs/session-mode.md): operations and WebSocket frames in,
//! events, replies, status, listings out, and their translation to and from runtimed's
//! messages. Pure functions: no I/O.
//!
//! Binary fields (command stdin, file contents, output chunks) are standard base64 with
//! padding. Operations are parsed strictly: an unknown field, two kinds of operation in one,
//! or a malformed base64 string is a 400, never silently ignored.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::http::StatusCode;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use kruntimes_proto::runtime::v1 as rs;
use kruntimes_proto::runtimed::v1::SessionInfo;
use kruntimes_wire::ownership::RunEntry;
use rs::session_operation_event::Event;
use rs::session_operation_request::Operation;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::error::HttpError;

pub use kruntimes_api::lifecycle::MAX_OPERATION_ID_BYTES;
use kruntimes_api::lifecycle::workspace_path_problem;
/// The longest operation timeout a request may ask for; the owner caps it further at the
/// session's operation timeout.
const MAX_TIMEOUT_SECONDS: f64 = 24.0 * 60.0 * 60.0;

// ---------------------------------------------------------------------------------------
// Operations
// ---------------------------------------------------------------------------------------

/// One operation as a client sends it.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct OperationJson {
    #[serde(default)]
    pub operation_id: Option<String>,
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
    #[serde(default)]
    pub command: Option<CommandJson>,
    #[serde(default)]
    pub write_file: Option<WriteFileJson>,
    #[serde(default)]
    pub make_directory: Option<MakeDirectoryJson>,
    #[serde(default)]
    pub delete: Option<DeleteJson>,
    #[serde(default)]
    pub rename: Option<RenameJson>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct CommandJson {
    #[serde(default)]
    pub argv: Option<Vec<String>>,
    #[serde(default)]
    pub shell: Option<String>,
    /// base64.
    #[serde(default)]
    pub stdin: Option<String>,
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct WriteFileJson {
    pub path: String,
    /// base64; absent: an empty file.
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default)]
    pub executable: bool,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct MakeDirectoryJson {
    pub path: String,
    #[serde(default)]
    pub parents: bool,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct DeleteJson {
    pub path: String,
    #[serde(default)]
    pub recursive: bool,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct RenameJson {
    pub from: String,
    pub to: String,
}

/// One operation from JSON (an object, parsed strictly); 400 otherwise.
pub(crate) fn parse_operation(json: &[u8]) -> Result<OperationJson, HttpError> {
    let starts_as_object = json
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|b| *b == b'{');
    if !starts_as_object {
        return Err(HttpError::bad_request(
            "the operation is malformed: not a JSON object",
        ));
    }
    serde_json::from_slice(json)
        .map_err(|e| HttpError::bad_request(format!("the operation is malformed: {e}")))
}

/// 400 unless `id` is 1..128 bytes of `[A-Za-z0-9._-]`.
pub(crate) fn check_operation_id(id: &str) -> Result<(), HttpError> {
    if kruntimes_api::lifecycle::is_operation_id(id) {
        Ok(())
    } else {
        Err(HttpError::bad_request(format!(
            "an operation ID is 1 to {MAX_OPERATION_ID_BYTES} bytes of [A-Za-z0-9._-]"
        )))
    }
}

/// 400 unless `path` is a workspace path ([`workspace_path_problem`]); `allow_empty`: the
/// empty path names the workspace itself. The path is not echoed (it may hold anything).
pub(crate) fn check_path(field: &str, path: &str, allow_empty: bool) -> Result<(), HttpError> {
    match workspace_path_problem(path, allow_empty) {
        None => Ok(()),
        Some(problem) => Err(HttpError::bad_request(format!(
            "{field} {problem}; paths are relative to the workspace, without '.' or '..'"
        ))),
    }
}

fn decode(field: &str, text: Option<String>) -> Result<Vec<u8>, HttpError> {
    match text {
        None => Ok(Vec::new()),
        Some(text) => BASE64
            .decode(text.as_bytes())
            .map_err(|_| HttpError::bad_request(format!("{field} is not standard base64"))),
    }
}

impl OperationJson {
    /// The operation as runtimed takes it (`id` is the owner's to fill in).
    pub fn into_request(self) -> Result<rs::SessionOperationRequest, HttpError> {
        let OperationJson {
            operation_id,
            timeout_seconds,
            command,
            write_file,
            make_directory,
            delete,
            rename,
        } = self;
        if let Some(id) = &operation_id {
            check_operation_id(id)?;
        }
        let timeout = match timeout_seconds {
            None => None,
            Some(secs) if secs.is_finite() && secs > 0.0 && secs <= MAX_TIMEOUT_SECONDS => {
                let d = Duration::from_secs_f64(secs);
                Some(kruntimes_proto::prost_types::Duration {
                    seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
                    nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
                })
            }
            Some(_) => {
                return Err(HttpError::bad_request(
                    "timeoutSeconds must be a number of seconds above 0 (at most one day)",
                ));
            }
        };
        let kinds = [
            command.is_some(),
            write_file.is_some(),
            make_directory.is_some(),
            delete.is_some(),
            rename.is_some(),
        ];
        if kinds.iter().filter(|k| **k).count() != 1 {
            return Err(HttpError::bad_request(
                "an operation has exactly one of command, writeFile, makeDirectory, delete or rename",
            ));
        }
        let operation = if let Some(command) = command {
            Operation::Command(command.into_proto()?)
        } else if let Some(w) = write_file {
            check_path("writeFile.path", &w.path, false)?;
            Operation::WriteFile(rs::WriteFile {
                path: w.path,
                content: decode("writeFile.content", w.content)?,
                executable: w.executable,
            })
        } else if let Some(m) = make_directory {
            check_path("makeDirectory.path", &m.path, false)?;
            Operation::MakeDirectory(rs::MakeDirectory {
                path: m.path,
                parents: m.parents,
            })
        } else if let Some(d) = delete {
            check_path("delete.path", &d.path, false)?;
            Operation::Delete(rs::DeletePath {
                path: d.path,
                recursive: d.recursive,
            })
        } else if let Some(r) = rename {
            check_path("rename.from", &r.from, false)?;
            check_path("rename.to", &r.to, false)?;
            Operation::Rename(rs::RenamePath {
                from: r.from,
                to: r.to,
            })
        } else {
            // Counted above: exactly one is set.
            return Err(HttpError::bad_request("the operation is empty"));
        };
        Ok(rs::SessionOperationRequest {
            id: None,
            operation_id: operation_id.unwrap_or_default(),
            operation: Some(operation),
            timeout,
        })
    }
}

impl CommandJson {
    fn into_proto(self) -> Result<rs::Command, HttpError> {
        let (argv, shell) = match (self.argv, self.shell) {
            (Some(argv), None) if !argv.is_empty() => (argv, String::new()),
            (None, Some(shell)) if !shell.is_empty() => (Vec::new(), shell),
            _ => {
                return Err(HttpError::bad_request(
                    "a command has exactly one of a non-empty argv or a non-empty shell line",
                ));
            }
        };
        let cwd = self.cwd.unwrap_or_default();
        // Empty: the workspace itself.
        check_path("command.cwd", &cwd, true)?;
        Ok(rs::Command {
            argv,
            shell,
            stdin: decode("command.stdin", self.stdin)?,
            cwd,
            env: self
                .env
                .unwrap_or_default()
                .into_iter()
                .map(|(name, value)| rs::EnvVar { name, value })
                .collect(),
        })
    }
}

// ---------------------------------------------------------------------------------------
// WebSocket frames from the client
// ---------------------------------------------------------------------------------------

/// A frame the client sent, checked.
#[derive(Debug)]
pub(crate) enum ClientFrame {
    Send(rs::SessionOperationRequest),
    Cancel { operation_id: String },
    Heartbeat,
}

/// Why a frame was refused, and the operation it named, if any.
#[derive(Debug)]
pub(crate) struct FrameError {
    pub operation_id: Option<String>,
    pub error: HttpError,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawFrame {
    #[serde(rename = "type")]
    type_: String,
    #[serde(default)]
    operation: Option<Box<RawValue>>,
    #[serde(default)]
    operation_id: Option<String>,
}

/// Just the operation ID of a malformed operation, for the rejection.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct IdOnly {
    #[serde(default)]
    operation_id: Option<String>,
}

/// Parses and checks one text frame: `send`, `cancel` or `heartbeat`.
pub(crate) fn parse_frame(text: &str) -> Result<ClientFrame, FrameError> {
    let refuse = |operation_id: Option<String>, message: String| FrameError {
        operation_id,
        error: HttpError::bad_request(message),
    };
    // serde would also take a struct from a JSON array; a frame is an object.
    if !text.trim_start().starts_with('{') {
        return Err(refuse(
            None,
            "the frame is not a session frame: not a JSON object".into(),
        ));
    }
    let raw: RawFrame = serde_json::from_str(text)
        .map_err(|e| refuse(None, format!("the frame is not a session frame: {e}")))?;
    match raw.type_.as_str() {
        "send" => {
            let Some(operation) = raw.operation else {
                return Err(refuse(None, "a send frame carries an operation".into()));
            };
            if raw.operation_id.is_some() {
                return Err(refuse(
                    None,
                    "a send frame names its operation ID inside the operation".into(),
                ));
            }
            let id = || {
                serde_json::from_str::<IdOnly>(operation.get())
                    .ok()
                    .and_then(|i| i.operation_id)
                    .filter(|id| check_operation_id(id).is_ok())
            };
            let parsed =
                parse_operation(operation.get().as_bytes()).map_err(|error| FrameError {
                    operation_id: id(),
                    error,
                })?;
            parsed
                .into_request()
                .map(ClientFrame::Send)
                .map_err(|error| FrameError {
                    operation_id: id(),
                    error,
                })
        }
        "cancel" => {
            if raw.operation.is_some() {
                return Err(refuse(None, "a cancel frame carries no operation".into()));
            }
            let operation_id = raw.operation_id.unwrap_or_default();
            check_operation_id(&operation_id).map_err(|error| FrameError {
                operation_id: None,
                error,
            })?;
            Ok(ClientFrame::Cancel { operation_id })
        }
        "heartbeat" => {
            if raw.operation.is_some() || raw.operation_id.is_some() {
                return Err(refuse(None, "a heartbeat frame carries nothing".into()));
            }
            Ok(ClientFrame::Heartbeat)
        }
        other => Err(refuse(
            None,
            format!(
                "unknown frame type {:?}; frames are send, cancel and heartbeat",
                other.chars().take(32).collect::<String>()
            ),
        )),
    }
}

// ---------------------------------------------------------------------------------------
// Frames and lines to the client
// ---------------------------------------------------------------------------------------

/// A frame to the client (WebSocket text frame, or one NDJSON line).
#[derive(Debug, Serialize, PartialEq)]
#[serde(
    tag = "type",
    rename_all = "camelCase",
    rename_all_fields = "camelCase"
)]
pub(crate) enum ServerFrame {
    Event(EventJson),
    Rejected {
        #[serde(skip_serializing_if = "Option::is_none")]
        operation_id: Option<String>,
        status: u16,
        reason: String,
        message: String,
    },
    Cancelled {
        operation_id: String,
        found: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        state: Option<&'static str>,
    },
    Heartbeat {
        #[serde(skip_serializing_if = "Option::is_none")]
        lease_expires_at: Option<String>,
    },
    Error {
        #[serde(skip_serializing_if = "Option::is_none")]
        operation_id: Option<String>,
        status: u16,
        reason: String,
        message: String,
    },
}

impl ServerFrame {
    /// The reply to a refused frame.
    pub fn rejected(operation_id: Option<String>, error: &HttpError) -> ServerFrame {
        ServerFrame::Rejected {
            operation_id,
            status: error.status().as_u16(),
            reason: error.reason().to_string(),
            message: error.message().to_string(),
        }
    }

    /// A problem not tied to one frame: an operation's events were cut off, the
    /// connection's authorization lapsed, the gateway is shutting down.
    pub fn error(operation_id: Option<String>, error: &HttpError) -> ServerFrame {
        ServerFrame::Error {
            operation_id,
            status: error.status().as_u16(),
            reason: error.reason().to_string(),
            message: error.message().to_string(),
        }
    }

    /// The JSON text.
    pub fn to_json(&self) -> String {
        // Serialising these plain structs cannot fail (no maps with non-string keys, no
        // custom serialisers); an empty object is a safe fallback all the same.
        serde_json::to_string(self).unwrap_or_else(|_| "{}".to_string())
    }
}

/// One event of an operation.
#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub(crate) struct EventJson {
    pub operation_id: String,
    pub sequence: u64,
    #[serde(flatten)]
    pub body: EventBody,
}

#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub(crate) enum EventBody {
    Queued {
        position: u32,
    },
    Started {},
    Output {
        stream: &'static str,
        /// base64.
        data: String,
        truncated: bool,
    },
    Completed(CompletedJson),
}

#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub(crate) struct CompletedJson {
    pub state: &'static str,
    pub reason: String,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    pub duration_ms: f64,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
}

/// The answer of `POST {base}/operations:execute`: one operation, run to its end, in one
/// JSON object. For a command that ran to an end, `exitCode` is the machine view's exit
/// code (the design document `fn/machines/machines.go`): the program's own code; 128 +
/// the signal that killed it; 124 with `timedOut` when its timeout killed it; 127 (126)
/// for a program whose start failed because it does not exist (cannot be executed).
#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ExecuteJson {
    pub operation_id: String,
    /// The sequence number of the operation's `completed` event.
    pub sequence: u64,
    pub state: &'static str,
    pub reason: String,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub duration_ms: f64,
    /// base64 of what the command wrote, at most 1 MiB of each stream.
    pub stdout: String,
    pub stderr: String,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
}

/// The most bytes of one output stream an `operations:execute` answer holds (the runtime
/// server sends no more than this of a stream either).
pub(crate) const MAX_EXECUTE_STREAM_BYTES: usize = 1024 * 1024;

/// What `operations:execute` gathers of an operation's events.
#[derive(Debug, Default)]
pub(crate) struct Gathered {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
}

impl Gathered {
    /// Appends an `output` event's bytes (base64, as the event carries them), keeping at
    /// most [`MAX_EXECUTE_STREAM_BYTES`] of each stream.
    pub fn output(&mut self, stream: &str, data: &str, truncated: bool) {
        let (buffer, cut) = if stream == "stderr" {
            (&mut self.stderr, &mut self.stderr_truncated)
        } else {
            (&mut self.stdout, &mut self.stdout_truncated)
        };
        *cut |= truncated;
        let Ok(bytes) = BASE64.decode(data) else {
            // The gateway encoded it itself: never malformed.
            *cut = true;
            return;
        };
        let room = MAX_EXECUTE_STREAM_BYTES.saturating_sub(buffer.len());
        if bytes.len() > room {
            *cut = true;
        }
        buffer.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    /// The answer once the operation completed with `completed` (event `sequence`);
    /// `command` when the operation was a command.
    pub fn answer(
        mut self,
        command: bool,
        operation_id: String,
        sequence: u64,
        completed: CompletedJson,
    ) -> ExecuteJson {
        let timed_out = command && completed.state == "TimedOut";
        let exit_code = match (completed.exit_code, completed.signal) {
            _ if !command => None,
            _ if timed_out => Some(124),
            (Some(code), _) => Some(code),
            (None, Some(signal)) => Some(128 + signal),
            (None, None) if completed.reason == "StartFailed" => {
                let code = start_failure_code(&completed.message);
                if code.is_some() {
                    // As a shell says it: the reason on stderr.
                    self.stderr.extend_from_slice(completed.message.as_bytes());
                    self.stderr.push(b'\n');
                }
                code
            }
            (None, None) => None,
        };
        ExecuteJson {
            operation_id,
            sequence,
            state: completed.state,
            reason: completed.reason,
            message: completed.message,
            exit_code,
            signal: completed.signal,
            timed_out,
            duration_ms: completed.duration_ms,
            stdout: BASE64.encode(&self.stdout),
            stderr: BASE64.encode(&self.stderr),
            stdout_truncated: self.stdout_truncated || completed.stdout_truncated,
            stderr_truncated: self.stderr_truncated || completed.stderr_truncated,
        }
    }
}

/// The shell's exit code for a program the runtime server could not start, from its
/// `StartFailed` message: only the spawn's own failure (`failed to start "PROGRAM": …`,
/// the working directory was opened and the sandbox entered before it) counts, by the
/// `(os error N)` it ends with: 127 for a program that does not exist (ENOENT), 126 for
/// one that cannot be executed (EACCES, ENOEXEC, EISDIR). Any other start failure is the
/// machine's, not the program's: `None`.
pub(crate) fn start_failure_code(message: &str) -> Option<i32> {
    let errno: i32 = message
        .strip_prefix("failed to start ")?
        .strip_suffix(')')?
        .rsplit_once("(os error ")?
        .1
        .parse()
        .ok()?;
    match errno {
        libc_errno::ENOENT => Some(127),
        libc_errno::EACCES | libc_errno::ENOEXEC | libc_errno::EISDIR => Some(126),
        _ => None,
    }
}

/// The Linux error numbers [`start_failure_code`] knows.
mod libc_errno {
    pub const ENOENT: i32 = 2;
    pub const ENOEXEC: i32 = 8;
    pub const EACCES: i32 = 13;
    pub const EISDIR: i32 = 21;
}

/// An operation state as the JSON writes it.
pub(crate) fn operation_state(state: rs::OperationState) -> Option<&'static str> {
    match state {
        rs::OperationState::Unspecified => None,
        rs::OperationState::Queued => Some("Queued"),
        rs::OperationState::Running => Some("Running"),
        rs::OperationState::Succeeded => Some("Succeeded"),
        rs::OperationState::Failed => Some("Failed"),
        rs::OperationState::Cancelled => Some("Cancelled"),
        rs::OperationState::TimedOut => Some("TimedOut"),
    }
}

fn duration_ms(d: Option<&kruntimes_proto::prost_types::Duration>) -> f64 {
    d.and_then(|d| Duration::try_from(*d).ok())
        .unwrap_or_default()
        .as_secs_f64()
        * 1000.0
}

/// The JSON of an event; `None` for an event without a payload (which runtimed never
/// sends).
pub(crate) fn event(event: rs::SessionOperationEvent) -> Option<EventJson> {
    let body = match event.event? {
        Event::Queued(q) => EventBody::Queued {
            position: q.position,
        },
        Event::Started(_) => EventBody::Started {},
        Event::Output(o) => EventBody::Output {
            stream: match o.stream() {
                rs::LogStream::Stderr => "stderr",
                rs::LogStream::Stdout | rs::LogStream::Unspecified => "stdout",
            },
            data: BASE64.encode(&o.data),
            truncated: o.truncated,
        },
        Event::Completed(c) => EventBody::Completed(CompletedJson {
            state: operation_state(c.state()).unwrap_or("Unknown"),
            reason: c.reason,
            message: c.message,
            exit_code: c.exit_code,
            signal: c.signal,
            duration_ms: duration_ms(c.duration.as_ref()),
            stdout_bytes: c.stdout_bytes,
            stderr_bytes: c.stderr_bytes,
            stdout_truncated: c.stdout_truncated,
            stderr_truncated: c.stderr_truncated,
        }),
    };
    Some(EventJson {
        operation_id: event.operation_id,
        sequence: event.sequence,
        body,
    })
}

// ---------------------------------------------------------------------------------------
// Status, cancel answers, listings
// ---------------------------------------------------------------------------------------

/// The session's status (`GET {base}`, `POST {base}:renew`).
#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub(crate) struct StatusJson {
    #[serde(rename = "runUID")]
    pub run_uid: String,
    pub run_name: String,
    pub phase: String,
    pub state: &'static str,
    pub served_by: String,
    pub hops: u32,
    pub attempt: u32,
    pub queued: u32,
    pub running_operation_id: String,
    pub last_sequence: u64,
    pub queue_size: u32,
    pub operation_timeout_seconds: u64,
    pub lease_timeout_seconds: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_expires_at: Option<String>,
}

/// A session state as the JSON writes it.
pub(crate) fn session_state(state: rs::SessionState) -> &'static str {
    match state {
        rs::SessionState::Unspecified => "Unknown",
        rs::SessionState::NotFound => "NotFound",
        rs::SessionState::Registering => "Registering",
        rs::SessionState::Ready => "Ready",
        rs::SessionState::Closing => "Closing",
        rs::SessionState::Closed => "Closed",
        rs::SessionState::Failed => "Failed",
    }
}

/// When the lease expires, RFC 3339; `None` without a lease.
pub(crate) fn lease_expires_at(info: &SessionInfo) -> Option<String> {
    info.lease_expires_at.as_ref().map(ToString::to_string)
}

/// The `state` of a session its owner suspended on its own (it holds no worker).
pub(crate) const ASLEEP_STATE: &str = "Suspended";

/// The status JSON answered to a heartbeat for the session of `entry` while it sleeps
/// ([`crate::route::asleep`]): its phase, the state `Suspended`, no lease (a suspended
/// session's lease does not run), and once Suspended the last sequence number its Snapshot
/// holds. Nothing of a worker's view: no worker holds it.
pub(crate) fn asleep_status(run_uid: &str, entry: &RunEntry) -> StatusJson {
    StatusJson {
        run_uid: run_uid.to_string(),
        run_name: entry.name.clone(),
        phase: entry.phase.as_str().to_string(),
        state: ASLEEP_STATE,
        served_by: String::new(),
        hops: 0,
        attempt: entry.attempt,
        queued: 0,
        running_operation_id: String::new(),
        last_sequence: if entry.phase == kruntimes_api::Phase::Suspended {
            entry.snapshot_sequence
        } else {
            0
        },
        queue_size: 0,
        operation_timeout_seconds: 0,
        lease_timeout_seconds: 0,
        lease_expires_at: None,
    }
}

/// The status JSON of `info` for the session `run_uid`.
pub(crate) fn status(run_uid: &str, info: SessionInfo) -> StatusJson {
    let operation_timeout = info
        .operation_timeout
        .and_then(|d| Duration::try_from(d).ok())
        .unwrap_or_default();
    StatusJson {
        run_uid: run_uid.to_string(),
        state: session_state(info.state()),
        lease_expires_at: lease_expires_at(&info),
        run_name: info.run_name,
        phase: info.phase,
        served_by: info.served_by,
        hops: info.hops,
        attempt: info.attempt,
        queued: info.queued,
        running_operation_id: info.running_operation_id,
        last_sequence: info.last_sequence,
        queue_size: info.queue_size,
        // Whole seconds, rounded up.
        operation_timeout_seconds: operation_timeout.as_secs()
            + u64::from(operation_timeout.subsec_nanos() > 0),
        lease_timeout_seconds: info.lease_timeout_seconds,
    }
}

/// The answer of `POST {base}/operations/{id}:cancel`.
#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub(crate) struct CancelJson {
    pub operation_id: String,
    pub found: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<&'static str>,
}

/// One page of a directory.
#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub(crate) struct FilePageJson {
    pub entries: Vec<FileEntryJson>,
    pub next_page_token: String,
}

#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub(crate) struct FileEntryJson {
    pub path: String,
    pub directory: bool,
    pub size_bytes: u64,
    pub symlink: bool,
}

pub(crate) fn file_page(page: rs::ListSessionFilesResponse) -> FilePageJson {
    FilePageJson {
        entries: page
            .entries
            .into_iter()
            .map(|e| FileEntryJson {
                path: e.path,
                directory: e.directory,
                size_bytes: e.size_bytes,
                symlink: e.symlink,
            })
            .collect(),
        next_page_token: page.next_page_token,
    }
}

/// The reason of a 429 from the WebSocket connection limit, for reuse by the handlers.
pub(crate) fn too_many_connections(limit: usize) -> HttpError {
    HttpError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "TooManyRequests",
        format!("the gateway is serving its limit of {limit} session connections; retry later"),
    )
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn send(operation: Value) -> Result<rs::SessionOperationRequest, FrameError> {
        match parse_frame(&json!({"type": "send", "operation": operation}).to_string()) {
            Ok(ClientFrame::Send(request)) => Ok(request),
            Ok(other) => panic!("not a send: {other:?}"),
            Err(e) => Err(e),
        }
    }

    #[test]
    fn commands_translate_to_runtimed() {
        let request = send(json!({
            "operationId": "op.1_a-b",
            "timeoutSeconds": 1.5,
            "command": {"argv": ["ls", "-l"], "stdin": "aGk=", "cwd": "src",
                        "env": {"B": "2", "A": "1"}}
        }))
        .expect("valid");
        assert_eq!(request.operation_id, "op.1_a-b");
        assert_eq!(
            request.timeout,
            Some(kruntimes_proto::prost_types::Duration {
                seconds: 1,
                nanos: 500_000_000
            })
        );
        let Some(Operation::Command(command)) = request.operation else {
            panic!("not a command");
        };
        assert_eq!(command.argv, vec!["ls", "-l"]);
        assert_eq!(command.stdin, b"hi");
        assert_eq!(command.cwd, "src");
        let env: Vec<(&str, &str)> = command
            .env
            .iter()
            .map(|e| (e.name.as_str(), e.value.as_str()))
            .collect();
        assert_eq!(env, vec![("A", "1"), ("B", "2")]);

        let request = send(json!({"command": {"shell": "make test | tail -5"}})).expect("shell");
        assert_eq!(request.operation_id, "");
        assert_eq!(request.timeout, None);
        assert!(
            matches!(request.operation, Some(Operation::Command(c)) if c.shell == "make test | tail -5" && c.argv.is_empty())
        );
    }

    #[test]
    fn file_operations_translate_to_runtimed() {
        let write =
            send(json!({"writeFile": {"path": "a/b.txt", "content": "AAEC", "executable": true}}))
                .expect("write");
        assert!(matches!(write.operation, Some(Operation::WriteFile(w))
            if w.path == "a/b.txt" && w.content == [0, 1, 2] && w.executable));
        let empty = send(json!({"writeFile": {"path": "e"}})).expect("empty file");
        assert!(
            matches!(empty.operation, Some(Operation::WriteFile(w)) if w.content.is_empty() && !w.executable)
        );
        let mkdir =
            send(json!({"makeDirectory": {"path": "a/b", "parents": true}})).expect("mkdir");
        assert!(matches!(mkdir.operation, Some(Operation::MakeDirectory(m)) if m.parents));
        let delete = send(json!({"delete": {"path": "a", "recursive": true}})).expect("delete");
        assert!(matches!(delete.operation, Some(Operation::Delete(d)) if d.recursive));
        let rename = send(json!({"rename": {"from": "a.txt", "to": "b.txt"}})).expect("rename");
        assert!(
            matches!(rename.operation, Some(Operation::Rename(r)) if r.from == "a.txt" && r.to == "b.txt")
        );
    }

    #[test]
    fn malformed_operations_are_refused_with_their_id() {
        for (operation, expected) in [
            (json!({}), "exactly one of"),
            (
                json!({"command": {"shell": "x"}, "delete": {"path": "a"}}),
                "exactly one of",
            ),
            (
                json!({"command": {"argv": ["a"], "shell": "x"}}),
                "exactly one of a non-empty argv",
            ),
            (json!({"command": {"argv": []}}), "non-empty argv"),
            (json!({"command": {"shell": ""}}), "non-empty"),
            (
                json!({"command": {"shell": "x", "stdin": "not base64!"}}),
                "command.stdin is not standard base64",
            ),
            (
                json!({"writeFile": {"path": "a", "content": "%%%"}}),
                "writeFile.content",
            ),
            (json!({"comand": {"shell": "x"}}), "unknown field"),
            (
                json!({"command": {"shell": "x", "user": "root"}}),
                "unknown field",
            ),
            (
                json!({"command": {"shell": "x"}, "timeoutSeconds": 0}),
                "timeoutSeconds",
            ),
            (
                json!({"command": {"shell": "x"}, "timeoutSeconds": -1}),
                "timeoutSeconds",
            ),
            (
                json!({"command": {"shell": "x"}, "timeoutSeconds": 1e12}),
                "timeoutSeconds",
            ),
            (json!({"delete": {}}), "missing field"),
        ] {
            let mut with_id = operation.clone();
            if let Some(map) = with_id.as_object_mut() {
                map.insert("operationId".into(), json!("mine"));
            }
            let e = send(with_id).expect_err(&operation.to_string());
            assert_eq!(e.error.status(), StatusCode::BAD_REQUEST, "{operation}");
            assert!(
                e.error.message().contains(expected),
                "{operation}: {}",
                e.error
            );
            assert_eq!(e.operation_id.as_deref(), Some("mine"), "{operation}");
        }
    }

    /// Issue 14 item 8: such paths reached the runtime server and failed there as
    /// `RuntimeServerError`; the gateway refuses them with 400 first.
    #[test]
    fn operations_with_paths_outside_the_workspace_are_refused() {
        let nul = "a\u{0}b";
        for bad in ["..", "../etc", "/etc/passwd", "", "a//b", nul] {
            for operation in [
                json!({"writeFile": {"path": bad}}),
                json!({"makeDirectory": {"path": bad}}),
                json!({"delete": {"path": bad}}),
                json!({"rename": {"from": bad, "to": "b"}}),
                json!({"rename": {"from": "a", "to": bad}}),
            ] {
                let e = send(operation.clone()).expect_err("a bad path");
                assert_eq!(e.error.status(), StatusCode::BAD_REQUEST, "{operation}");
                assert!(
                    e.error.message().contains("path") || e.error.message().contains("rename"),
                    "{}",
                    e.error
                );
            }
            if !bad.is_empty() {
                let e = send(json!({"command": {"shell": "ls", "cwd": bad}})).expect_err("cwd");
                assert_eq!(e.error.status(), StatusCode::BAD_REQUEST, "{bad:?}");
            }
        }
        assert!(send(json!({"command": {"shell": "ls", "cwd": ""}})).is_ok());
        assert!(send(json!({"command": {"shell": "ls", "cwd": "src/a"}})).is_ok());
    }

    #[test]
    fn operation_ids_are_bounded() {
        assert!(check_operation_id("op-1").is_ok());
        assert!(check_operation_id(&"a".repeat(128)).is_ok());
        for bad in ["", "a b", "a/b", "é", "a:cancel", &"a".repeat(129)] {
            assert!(check_operation_id(bad).is_err(), "{bad:?}");
            let e = send(json!({"operationId": bad, "command": {"shell": "x"}})).expect_err(bad);
            assert_eq!(e.operation_id, None, "an invalid ID is not echoed: {bad:?}");
        }
    }

    #[test]
    fn control_frames_parse() {
        assert!(matches!(
            parse_frame(r#"{"type":"cancel","operationId":"op-3"}"#),
            Ok(ClientFrame::Cancel { operation_id }) if operation_id == "op-3"
        ));
        assert!(matches!(
            parse_frame(r#"{"type":"heartbeat"}"#),
            Ok(ClientFrame::Heartbeat)
        ));
        for (frame, expected) in [
            (r#"{"type":"cancel"}"#, "operation ID"),
            (r#"{"type":"cancel","operationId":"../x"}"#, "operation ID"),
            (
                r#"{"type":"heartbeat","operationId":"x"}"#,
                "carries nothing",
            ),
            (r#"{"type":"send"}"#, "carries an operation"),
            (
                r#"{"type":"send","operationId":"x","operation":{"command":{"shell":"x"}}}"#,
                "inside the operation",
            ),
            (r#"{"type":"exec"}"#, "unknown frame type"),
            (r#"{"kind":"send"}"#, "not a session frame"),
            (r#"["send"]"#, "not a session frame"),
            ("not json", "not a session frame"),
        ] {
            let e = parse_frame(frame).expect_err(frame);
            assert_eq!(e.error.status(), StatusCode::BAD_REQUEST);
            assert!(e.error.message().contains(expected), "{frame}: {}", e.error);
        }
    }

    fn json_of(frame: &ServerFrame) -> Value {
        serde_json::from_str(&frame.to_json()).expect("json")
    }

    #[test]
    fn events_serialise_as_documented() {
        let ev = |sequence, event| rs::SessionOperationEvent {
            operation_id: "op-1".into(),
            sequence,
            event: Some(event),
        };
        let frames: Vec<Value> = [
            ev(1, Event::Queued(rs::OperationQueued { position: 0 })),
            ev(2, Event::Started(rs::OperationStarted {})),
            ev(
                3,
                Event::Output(rs::OperationOutput {
                    stream: rs::LogStream::Stdout as i32,
                    data: b"hello\n".to_vec(),
                    truncated: false,
                }),
            ),
            ev(
                4,
                Event::Completed(rs::OperationCompleted {
                    state: rs::OperationState::Succeeded as i32,
                    reason: "Completed".into(),
                    message: String::new(),
                    exit_code: Some(0),
                    signal: None,
                    duration: Some(kruntimes_proto::prost_types::Duration {
                        seconds: 0,
                        nanos: 3_100_000,
                    }),
                    stdout_bytes: 6,
                    stderr_bytes: 0,
                    stdout_truncated: false,
                    stderr_truncated: false,
                }),
            ),
        ]
        .into_iter()
        .map(|e| json_of(&ServerFrame::Event(event(e).expect("payload"))))
        .collect();
        assert_eq!(
            frames,
            vec![
                json!({"type": "event", "operationId": "op-1", "sequence": 1, "queued": {"position": 0}}),
                json!({"type": "event", "operationId": "op-1", "sequence": 2, "started": {}}),
                json!({"type": "event", "operationId": "op-1", "sequence": 3,
                       "output": {"stream": "stdout", "data": "aGVsbG8K", "truncated": false}}),
                json!({"type": "event", "operationId": "op-1", "sequence": 4,
                       "completed": {"state": "Succeeded", "reason": "Completed", "message": "",
                                     "exitCode": 0, "durationMs": 3.1, "stdoutBytes": 6,
                                     "stderrBytes": 0, "stdoutTruncated": false,
                                     "stderrTruncated": false}}),
            ]
        );
        assert!(
            event(rs::SessionOperationEvent {
                operation_id: "x".into(),
                sequence: 9,
                event: None
            })
            .is_none()
        );
    }

    #[test]
    fn replies_serialise_as_documented() {
        let busy = HttpError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "TooManyRequests",
            "the session's queue is full: 32 operations wait, the most it holds",
        );
        assert_eq!(
            json_of(&ServerFrame::rejected(Some("op-9".into()), &busy)),
            json!({"type": "rejected", "operationId": "op-9", "status": 429,
                   "reason": "TooManyRequests", "message": "the session's queue is full: 32 operations wait, the most it holds"})
        );
        assert_eq!(
            json_of(&ServerFrame::Cancelled {
                operation_id: "op-3".into(),
                found: true,
                state: Some("Cancelled")
            }),
            json!({"type": "cancelled", "operationId": "op-3", "found": true, "state": "Cancelled"})
        );
        assert_eq!(
            json_of(&ServerFrame::Heartbeat {
                lease_expires_at: Some("2026-11-30T10:00:00Z".into())
            }),
            json!({"type": "heartbeat", "leaseExpiresAt": "2026-11-30T10:00:00Z"})
        );
        assert_eq!(
            json_of(&ServerFrame::Heartbeat {
                lease_expires_at: None
            }),
            json!({"type": "heartbeat"})
        );
        let down = HttpError::unavailable("shutting down");
        assert_eq!(
            json_of(&ServerFrame::error(None, &down)),
            json!({"type": "error", "status": 503, "reason": "ServiceUnavailable", "message": "shutting down"})
        );
    }

    #[test]
    fn status_serialises_as_documented() {
        let info = SessionInfo {
            run_name: "sandbox-x".into(),
            phase: "Ready".into(),
            state: rs::SessionState::Ready as i32,
            served_by: "bash-0".into(),
            hops: 0,
            attempt: 1,
            queued: 0,
            running_operation_id: String::new(),
            last_sequence: 12,
            lease_timeout_seconds: 30,
            lease_expires_at: Some(kruntimes_proto::prost_types::Timestamp {
                seconds: 1_796_032_800,
                nanos: 0,
            }),
            queue_size: 32,
            operation_timeout: Some(kruntimes_proto::prost_types::Duration {
                seconds: 300,
                nanos: 0,
            }),
        };
        let value = serde_json::to_value(status("u-1", info)).expect("json");
        assert_eq!(
            value,
            json!({"runUID": "u-1", "runName": "sandbox-x", "phase": "Ready", "state": "Ready",
                   "servedBy": "bash-0", "hops": 0, "attempt": 1, "queued": 0,
                   "runningOperationId": "", "lastSequence": 12, "queueSize": 32,
                   "operationTimeoutSeconds": 300, "leaseTimeoutSeconds": 30,
                   "leaseExpiresAt": "2026-11-30T10:00:00Z"})
        );
        let without_lease = status("u", SessionInfo::default());
        assert_eq!(without_lease.lease_expires_at, None);
        assert_eq!(without_lease.state, "Unknown");
    }

    #[test]
    fn pages_serialise_as_documented() {
        let page = file_page(rs::ListSessionFilesResponse {
            entries: vec![rs::FileEntry {
                path: "build.log".into(),
                directory: false,
                size_bytes: 1024,
                symlink: false,
            }],
            next_page_token: "eyJ2IjoxfQ".into(),
        });
        assert_eq!(
            serde_json::to_value(page).expect("json"),
            json!({"entries": [{"path": "build.log", "directory": false, "sizeBytes": 1024, "symlink": false}],
                   "nextPageToken": "eyJ2IjoxfQ"})
        );
    }

    #[test]
    fn a_program_that_cannot_start_gets_the_shells_exit_code() {
        assert_eq!(
            start_failure_code("failed to start \"nope\": No such file or directory (os error 2)"),
            Some(127)
        );
        assert_eq!(
            start_failure_code("failed to start \"./x\": Permission denied (os error 13)"),
            Some(126)
        );
        for other in [
            "the session's sandbox is gone",
            "the session's cgroup cannot be joined",
            "failed to start \"x\": Resource temporarily unavailable (os error 11)",
            "(os error )",
            "failed to start \"x\": (os error 99999999999999)",
            "the sandbox: No such file or directory (os error 2)",
        ] {
            assert_eq!(start_failure_code(other), None, "{other}");
        }
    }
}
