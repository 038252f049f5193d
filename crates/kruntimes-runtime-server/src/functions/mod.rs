//! Function registrations and their invocations (design document 000, "Runtime Server
//! Boundary"; the `FunctionRuntime` service of `runtime.proto`).
//!
//! Owns the table of registrations keyed by Run UID (one generation per Run UID), each
//! registration's workspace `ROOT/functions/<run-uid>/<attempt>/`, its cgroup
//! `fn-<run-uid>-<attempt>` and its adapter: for python one persistent interpreter that
//! imports the handler once and answers invocations over two pipes (the launcher,
//! `function_launcher.py`, is embedded in the binary), for bash one `bash HANDLER` per
//! invocation with the request on stdin. It enforces one invocation in flight per
//! registration, the bounds of requests and results, invocation timeouts (a python
//! interpreter that times out or dies is killed with its whole cgroup and restarted before
//! the next invocation), and unregistering (kill everything, remove the workspace). It
//! knows nothing of gRPC, never retries an invocation and never queues one.
//!
//! Layout of one registration:
//!
//! ```text
//! ROOT/functions/<run-uid>/<attempt>/
//!   work/         cwd and HOME of the adapter; the source files
//!   tmp/          TMPDIR
//!   stdout.log    python: the interpreter's stdout (each invocation reports its share)
//!   stderr.log    python: the interpreter's stderr
//! ```
//!
//! `ROOT/functions` is not a Run UID, so the task executor's recovery skips it.
//! Registrations do not survive a server restart: at startup everything under
//! `ROOT/functions` is removed and every leftover `fn-*` cgroup is killed.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::os::fd::OwnedFd;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use nix::sys::signal::Signal;
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::process::Child;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::cgroup::{CgroupError, CgroupParent, ExecCgroup};
use crate::executor::{self, RequestError, SourceFileSpec};
use crate::ids::{self, ExecutionKey};
use crate::interpreter::Adapter;
use crate::isolation::{self, SpawnError, SpawnSpec};
use crate::logs::{self, Tail, TailCollector};

/// The longest handler accepted.
pub const MAX_HANDLER_BYTES: usize = 1024;
/// The longest request payload accepted.
pub const MAX_PAYLOAD_BYTES: usize = 1024 * 1024;
/// The longest result returned; a longer one fails the invocation with `ResultTooLarge`.
pub const MAX_RESULT_BYTES: usize = 1024 * 1024;
/// The longest invocation ID accepted.
pub const MAX_INVOCATION_ID_BYTES: usize = 128;
/// `InvocationError.message` is at most this long (its start kept).
pub const MAX_ERROR_MESSAGE_BYTES: usize = 4 * 1024;
/// `InvocationError.traceback` is at most this long (its end, the innermost frames, kept).
pub const MAX_TRACEBACK_BYTES: usize = 16 * 1024;
/// Each of an invocation's stdout and stderr tails is at most this long, marker included.
pub const INVOCATION_LOG_LIMIT_BYTES: u64 = 64 * 1024;
/// Loading a handler may take this long unless the request says otherwise.
pub const DEFAULT_LOAD_TIMEOUT: Duration = Duration::from_secs(30);
/// A longer requested load timeout is cut to this.
pub const MAX_LOAD_TIMEOUT: Duration = Duration::from_secs(600);
/// An invocation may take this long unless the request says otherwise.
pub const DEFAULT_INVOKE_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest invocation timeout accepted.
pub const MAX_INVOKE_TIMEOUT: Duration = Duration::from_secs(300);
/// The longest frame read from a python interpreter: a 1 MiB result, escaped inside a JSON
/// string, stays far below it.
const MAX_FRAME_BYTES: u32 = 16 * 1024 * 1024;
/// A python registration's log file is emptied after an invocation once it is this long
/// (the interpreter appends, so emptying it between invocations is safe).
const LOG_ROTATE_BYTES: u64 = 4 * 1024 * 1024;
/// How long to wait for killed processes to end and their cgroup to empty.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);
/// How long an interpreter that closed its response pipe may take to exit by itself before
/// it is killed (so its own exit status is reported).
const EXIT_GRACE: Duration = Duration::from_secs(1);
/// How long unregistering waits for an in-flight invocation to notice and end.
const STOP_LIMIT: Duration = Duration::from_secs(10);
/// Each registration's cgroup is `fn-<run-uid>-<attempt>` under the server's parent.
const CGROUP_PREFIX: &str = "fn-";
/// The python adapter's launcher, run with `python3 -c`.
const LAUNCHER: &str = include_str!("function_launcher.py");

/// The server's settings that registrations depend on.
#[derive(Debug, Clone)]
pub struct FunctionsConfig {
    /// The server's root; registrations live under `root/functions`.
    pub root: PathBuf,
    pub adapter: Adapter,
    pub interpreter: PathBuf,
    /// PATH given to programs.
    pub path_var: String,
    /// `None`: process groups only.
    pub cgroups: Option<CgroupParent>,
}

/// A validated RegisterFunction request.
#[derive(Debug, Clone)]
pub struct RegisterSpec {
    pub key: ExecutionKey,
    pub files: Vec<SourceFileSpec>,
    pub handler: String,
    pub env: Vec<(String, String)>,
    pub load_timeout: Duration,
    /// Identifies the configuration (files, handler, env), for idempotent repeats.
    pub digest: [u8; 32],
}

impl RegisterSpec {
    /// Validates every untrusted part with the limits of task executions (files, env) and
    /// the adapter's handler syntax. `digest` must identify the configuration.
    pub fn new(
        key: ExecutionKey,
        files: Vec<SourceFileSpec>,
        handler: String,
        env: Vec<(String, String)>,
        load_timeout: Option<Duration>,
        adapter: Adapter,
        digest: [u8; 32],
    ) -> Result<Self, RequestError> {
        let paths = executor::validate_files(&files)?;
        validate_handler(adapter, &handler, &paths)?;
        executor::validate_env(&env)?;
        Ok(Self {
            key,
            files,
            handler,
            env,
            load_timeout: load_timeout
                .filter(|t| !t.is_zero())
                .unwrap_or(DEFAULT_LOAD_TIMEOUT)
                .min(MAX_LOAD_TIMEOUT),
            digest,
        })
    }
}

/// Checks a handler: for bash a path of one of `files`; for python `module:function` or
/// `module.function`, both dotted identifiers.
pub fn validate_handler(
    adapter: Adapter,
    handler: &str,
    files: &BTreeSet<&str>,
) -> Result<(), RequestError> {
    let invalid = |detail: String| RequestError::Invalid {
        what: "handler",
        detail,
    };
    if handler.is_empty() || handler.len() > MAX_HANDLER_BYTES {
        return Err(invalid(format!("must be 1 to {MAX_HANDLER_BYTES} bytes")));
    }
    match adapter {
        Adapter::Bash => {
            ids::validate_source_path(handler)?;
            if !files.contains(handler) {
                return Err(invalid(format!(
                    "{} is not one of the files",
                    ids::bounded(handler)
                )));
            }
        }
        Adapter::Python => {
            let (module, function) = match handler.split_once(':') {
                Some(parts) => parts,
                None => handler.rsplit_once('.').unwrap_or(("", handler)),
            };
            if !is_dotted_identifier(module) || !is_dotted_identifier(function) {
                return Err(invalid(format!(
                    "{} is not \"module:function\" or \"module.function\" (dotted Python identifiers)",
                    ids::bounded(handler)
                )));
            }
        }
    }
    Ok(())
}

fn is_dotted_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.split('.').all(|part| {
            let mut chars = part.chars();
            chars.next().is_some_and(|c| c == '_' || c.is_alphabetic())
                && chars.all(|c| c == '_' || c.is_alphanumeric())
        })
}

/// A validated InvokeFunction request.
#[derive(Debug, Clone)]
pub struct InvokeSpec {
    pub invocation_id: String,
    /// One JSON value, UTF-8, at most [`MAX_PAYLOAD_BYTES`].
    pub payload: String,
    pub timeout: Duration,
}

impl InvokeSpec {
    /// Checks the bounds and that the payload is one JSON value.
    pub fn new(
        invocation_id: String,
        payload: Vec<u8>,
        timeout: Option<Duration>,
    ) -> Result<Self, RequestError> {
        let invalid = |what, detail: String| RequestError::Invalid { what, detail };
        if invocation_id.len() > MAX_INVOCATION_ID_BYTES || invocation_id.contains('\0') {
            return Err(invalid(
                "invocation_id",
                format!("must be at most {MAX_INVOCATION_ID_BYTES} bytes without NUL"),
            ));
        }
        if payload.len() > MAX_PAYLOAD_BYTES {
            return Err(invalid(
                "payload",
                format!("is {} bytes, more than {MAX_PAYLOAD_BYTES}", payload.len()),
            ));
        }
        if let Err(e) = serde_json::from_slice::<IgnoredAny>(&payload) {
            return Err(invalid("payload", format!("is not one JSON value: {e}")));
        }
        let payload = String::from_utf8(payload)
            .map_err(|_| invalid("payload", "is not UTF-8".to_owned()))?;
        let timeout = timeout
            .filter(|t| !t.is_zero())
            .unwrap_or(DEFAULT_INVOKE_TIMEOUT);
        if timeout > MAX_INVOKE_TIMEOUT {
            return Err(invalid(
                "timeout",
                format!("must be at most {} s", MAX_INVOKE_TIMEOUT.as_secs()),
            ));
        }
        Ok(Self {
            invocation_id,
            payload,
            timeout,
        })
    }
}

/// Whether a registration accepts invocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FunctionState {
    Ready,
    /// Fatal: the interpreter could not be restarted.
    Failed,
}

/// What is known of a registration at one moment.
#[derive(Debug, Clone)]
pub struct FunctionSnapshot {
    pub registration_id: String,
    pub key: ExecutionKey,
    pub state: FunctionState,
    /// Registered, InterpreterLost, or Unregistering while it is being removed.
    pub reason: &'static str,
    pub message: String,
    pub in_flight: bool,
    pub registered_at: SystemTime,
    pub last_activity: SystemTime,
    pub invocations: u64,
}

/// How an invocation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    Failed,
    TimedOut,
}

/// Why an invocation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvocationError {
    /// The exception's type (python), or NonZeroExitCode, InterpreterExited,
    /// ResultNotJson, ResultTooLarge, Timeout.
    pub kind: String,
    pub message: String,
    pub traceback: String,
}

impl InvocationError {
    fn new(kind: &str, message: String) -> Self {
        Self {
            kind: kind.to_owned(),
            message: clip_start(&message, MAX_ERROR_MESSAGE_BYTES),
            traceback: String::new(),
        }
    }
}

/// The result of one invocation.
#[derive(Debug, Clone)]
pub struct Invocation {
    pub outcome: Outcome,
    /// SUCCEEDED: one JSON value.
    pub result: Vec<u8>,
    pub error: Option<InvocationError>,
    pub stdout: Tail,
    pub stderr: Tail,
    pub duration: Duration,
}

impl Invocation {
    fn failed(kind: &str, message: String) -> (Outcome, Vec<u8>, Option<InvocationError>) {
        (
            Outcome::Failed,
            Vec::new(),
            Some(InvocationError::new(kind, message)),
        )
    }
}

/// What UnregisterFunction names.
#[derive(Debug, Clone)]
pub enum UnregisterTarget {
    /// Exactly this generation.
    Id(String),
    /// Any generation of the Run UID with an attempt up to and including this one.
    UpTo(ExecutionKey),
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum FunctionError {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("registration {key} already exists with a different configuration")]
    Conflict { key: ExecutionKey },
    #[error("registration attempt {key} is older than the registered attempt {registered}")]
    StaleAttempt { key: ExecutionKey, registered: u32 },
    #[error("registration {id} is unknown")]
    NotFound { id: String },
    #[error("registration {id} has an invocation in flight")]
    Busy { id: String },
    #[error("registration {id} is failed ({reason}): {message}")]
    Failed {
        id: String,
        reason: &'static str,
        message: String,
    },
    #[error("registration {id} is being unregistered")]
    Unregistering { id: String },
    #[error("LoadFailed: {detail}")]
    LoadFailed { key: ExecutionKey, detail: String },
    #[error("registration {key} was unregistered while it loaded")]
    Cancelled { key: ExecutionKey },
    #[error("the runtime server is shutting down")]
    ShuttingDown,
    #[error("failed to prepare workspace {path}")]
    Workspace {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to prepare the cgroup of registration {key}")]
    Cgroup {
        key: ExecutionKey,
        #[source]
        source: CgroupError,
    },
    #[error("failed to start the adapter of registration {key}")]
    Spawn {
        key: ExecutionKey,
        #[source]
        source: SpawnError,
    },
    #[error("failed to talk to the adapter of registration {key}")]
    Io {
        key: ExecutionKey,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to remove workspace {path}")]
    Remove {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("a task of the runtime server failed")]
    Task(#[source] tokio::task::JoinError),
}

// ---------------------------------------------------------------------------------------
// Frames between the server and the python launcher

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("the stream ended")]
    Closed,
    #[error("a frame of {len} bytes exceeds the limit of {limit}")]
    TooLarge { len: u64, limit: u32 },
    #[error("frame I/O failed")]
    Io(#[source] std::io::Error),
}

/// One frame: a 4-byte big-endian length, then `body`.
pub fn encode_frame(body: &[u8]) -> Result<Vec<u8>, FrameError> {
    let len = u32::try_from(body.len()).map_err(|_| FrameError::TooLarge {
        len: body.len() as u64,
        limit: u32::MAX,
    })?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(body);
    Ok(frame)
}

/// Reads one frame's body, refusing one longer than `limit` before reading it.
pub async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    limit: u32,
) -> Result<Vec<u8>, FrameError> {
    let io = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            FrameError::Closed
        } else {
            FrameError::Io(e)
        }
    };
    let mut header = [0u8; 4];
    reader.read_exact(&mut header).await.map_err(io)?;
    let len = u32::from_be_bytes(header);
    if len > limit {
        return Err(FrameError::TooLarge {
            len: u64::from(len),
            limit,
        });
    }
    let mut body = vec![0u8; len as usize];
    reader.read_exact(&mut body).await.map_err(io)?;
    Ok(body)
}

#[derive(Serialize)]
struct RequestFrame<'a> {
    id: &'a str,
    payload: &'a str,
}

/// Every frame the launcher sends: ready, a result, or a failure.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ResponseFrame {
    ready: bool,
    ok: bool,
    result: Option<String>,
    #[serde(rename = "type")]
    kind: String,
    message: String,
    traceback: String,
}

impl ResponseFrame {
    fn error(self) -> InvocationError {
        InvocationError {
            kind: clip_start(&self.kind, 256),
            message: clip_start(&self.message, MAX_ERROR_MESSAGE_BYTES),
            traceback: clip_end(&self.traceback, MAX_TRACEBACK_BYTES),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Registrations

struct Info {
    state: FunctionState,
    reason: &'static str,
    message: String,
    in_flight: bool,
    last_activity: SystemTime,
    invocations: u64,
    unregistering: bool,
}

/// The log files a python interpreter appends to, and the server's handles to measure and
/// read them.
struct LogFiles {
    stdout_path: PathBuf,
    stderr_path: PathBuf,
    stdout: File,
    stderr: File,
}

impl LogFiles {
    fn create(dir: &Path) -> std::io::Result<Self> {
        let open = |path: &Path| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(path)
        };
        let stdout_path = dir.join("stdout.log");
        let stderr_path = dir.join("stderr.log");
        Ok(Self {
            stdout: open(&stdout_path)?,
            stderr: open(&stderr_path)?,
            stdout_path,
            stderr_path,
        })
    }

    /// Handles for an interpreter: appending, so that emptying a file is safe.
    fn for_child(&self) -> std::io::Result<(File, File)> {
        let open = |path: &Path| OpenOptions::new().append(true).open(path);
        Ok((open(&self.stdout_path)?, open(&self.stderr_path)?))
    }

    fn lengths(&self) -> (u64, u64) {
        let len = |f: &File| f.metadata().map(|m| m.len()).unwrap_or(0);
        (len(&self.stdout), len(&self.stderr))
    }

    /// What was appended since `start`, bounded.
    fn since(&self, start: (u64, u64)) -> (Tail, Tail) {
        let (out_end, err_end) = self.lengths();
        let span = |file: &File, start: u64, end: u64| {
            logs::read_span_tail(file, start, end, INVOCATION_LOG_LIMIT_BYTES).unwrap_or_else(|e| {
                tracing::warn!(error = %e, "invocation log not read");
                empty_tail()
            })
        };
        (
            span(&self.stdout, start.0, out_end),
            span(&self.stderr, start.1, err_end),
        )
    }

    /// Empties a file that grew past [`LOG_ROTATE_BYTES`]; only between invocations.
    fn rotate(&self) {
        for file in [&self.stdout, &self.stderr] {
            if file.metadata().is_ok_and(|m| m.len() > LOG_ROTATE_BYTES) {
                let _ = file.set_len(0);
            }
        }
    }
}

fn empty_tail() -> Tail {
    Tail {
        data: Vec::new(),
        truncated: false,
        total_bytes: 0,
    }
}

/// One running python interpreter that has loaded the handler.
struct PythonWorker {
    child: Child,
    requests: pipe::Sender,
    responses: pipe::Receiver,
}

struct PythonState {
    /// `None` after the interpreter was killed or died: started again before the next
    /// invocation.
    worker: Option<PythonWorker>,
    logs: LogFiles,
}

enum AdapterState {
    Bash,
    Python(Box<PythonState>),
}

/// Why loading a handler failed.
#[derive(Debug)]
enum LoadError {
    /// The import or the lookup raised.
    Raised(InvocationError),
    Exited(Option<ExitStatus>),
    TimedOut(Duration),
    Protocol(String),
    Stopped,
    Spawn(SpawnError),
    Io(std::io::Error),
    Cgroup(CgroupError),
}

impl LoadError {
    /// Bounded text for a status message; never handler output.
    fn describe(&self) -> String {
        match self {
            LoadError::Raised(e) => {
                let mut text = format!("{}: {}", e.kind, clip_start(&e.message, 1024));
                if !e.traceback.is_empty() {
                    text.push('\n');
                    text.push_str(&clip_end(&e.traceback, 2048));
                }
                text
            }
            LoadError::Exited(status) => {
                format!(
                    "the interpreter {} before the handler was loaded",
                    describe_exit(*status)
                )
            }
            LoadError::TimedOut(limit) => format!(
                "loading the handler took longer than {:.3} s",
                limit.as_secs_f64()
            ),
            LoadError::Protocol(detail) => format!("the launcher misbehaved: {detail}"),
            LoadError::Stopped => "the registration was stopped".to_owned(),
            LoadError::Spawn(e) => format!("{e}: {}", e.source),
            LoadError::Io(e) => format!("pipe setup failed: {e}"),
            LoadError::Cgroup(e) => e.to_string(),
        }
    }
}

fn describe_exit(status: Option<ExitStatus>) -> String {
    match status {
        Some(s) => match (s.code(), s.signal()) {
            (Some(code), _) => format!("exited with code {code}"),
            (None, Some(signal)) => format!("was killed by signal {signal}"),
            (None, None) => "ended".to_owned(),
        },
        None => "ended (its exit status is unknown)".to_owned(),
    }
}

struct Registration {
    id: String,
    key: ExecutionKey,
    digest: [u8; 32],
    dir: PathBuf,
    work: PathBuf,
    handler: String,
    interpreter: PathBuf,
    /// The complete environment of the adapter's processes.
    env: Vec<(String, String)>,
    load_timeout: Duration,
    cgroup: Option<ExecCgroup>,
    registered_at: SystemTime,
    info: Mutex<Info>,
    /// The adapter: held by the one invocation in flight (taken with `try_lock`, so an
    /// overlapping one fails at once) and by unregistering.
    adapter: Arc<tokio::sync::Mutex<AdapterState>>,
    /// Becomes true once, when the registration is unregistered or the server stops.
    stop: watch::Sender<bool>,
    /// The process group of the interpreter or of the bash invocation; 0 when none.
    pgid: AtomicU32,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves only plain data behind; keep serving.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    // A dropped sender means the registration is gone: stopped as well.
    let _ = stop.wait_for(|stopped| *stopped).await;
}

impl Registration {
    fn info(&self) -> MutexGuard<'_, Info> {
        lock(&self.info)
    }

    fn snapshot(&self) -> FunctionSnapshot {
        let info = self.info();
        FunctionSnapshot {
            registration_id: self.id.clone(),
            key: self.key.clone(),
            state: info.state,
            reason: if info.unregistering {
                "Unregistering"
            } else {
                info.reason
            },
            message: info.message.clone(),
            in_flight: info.in_flight,
            registered_at: self.registered_at,
            last_activity: info.last_activity,
            invocations: info.invocations,
        }
    }

    /// Fails unless the registration accepts invocations.
    fn usable(&self) -> Result<(), FunctionError> {
        let info = self.info();
        if info.unregistering {
            return Err(FunctionError::Unregistering {
                id: self.id.clone(),
            });
        }
        match info.state {
            FunctionState::Ready => Ok(()),
            FunctionState::Failed => Err(FunctionError::Failed {
                id: self.id.clone(),
                reason: info.reason,
                message: info.message.clone(),
            }),
        }
    }

    fn fail(&self, reason: &'static str, message: String) {
        let mut info = self.info();
        info.state = FunctionState::Failed;
        info.reason = reason;
        info.message = message;
    }

    /// SIGKILL to everything of the registration: the cgroup when there is one, else the
    /// adapter's process group.
    fn kill_processes(&self) {
        match &self.cgroup {
            Some(cgroup) => {
                if let Err(e) = cgroup.kill_all() {
                    tracing::warn!(registration = %self.id, error = %e, "cgroup kill failed");
                }
            }
            None => isolation::signal_group(self.pgid.load(Ordering::SeqCst), Signal::SIGKILL),
        }
    }

    async fn wait_cgroup_empty(&self) {
        if let Some(cgroup) = &self.cgroup {
            match cgroup.wait_empty(DRAIN_LIMIT).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(registration = %self.id, "cgroup still populated after kill");
                }
                Err(e) => tracing::warn!(registration = %self.id, error = %e, "cgroup not drained"),
            }
        }
    }

    /// Kills an interpreter and everything else of the registration, and reaps it. With
    /// `grace`, an interpreter that is already ending gets that long to exit by itself
    /// first, so that its own status is reported.
    async fn kill_worker(
        &self,
        worker: Option<PythonWorker>,
        grace: Option<Duration>,
    ) -> Option<ExitStatus> {
        let mut worker = worker?;
        let mut status = None;
        if let Some(grace) = grace {
            status = tokio::time::timeout(grace, worker.child.wait())
                .await
                .ok()
                .and_then(Result::ok);
        }
        self.kill_processes();
        if status.is_none() {
            status = tokio::time::timeout(DRAIN_LIMIT, worker.child.wait())
                .await
                .ok()
                .and_then(Result::ok);
        }
        self.pgid.store(0, Ordering::SeqCst);
        self.wait_cgroup_empty().await;
        status
    }

    /// Starts an interpreter and waits, at most `limit`, until it has loaded the handler.
    /// On failure nothing of it is left running.
    async fn start_python(
        &self,
        logs: &LogFiles,
        limit: Duration,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<PythonWorker, LoadError> {
        let (request_read, request_write) = std::io::pipe().map_err(LoadError::Io)?;
        let (response_read, response_write) = std::io::pipe().map_err(LoadError::Io)?;
        let requests =
            pipe::Sender::from_owned_fd(OwnedFd::from(request_write)).map_err(LoadError::Io)?;
        let responses =
            pipe::Receiver::from_owned_fd(OwnedFd::from(response_read)).map_err(LoadError::Io)?;
        let (stdout, stderr) = logs.for_child().map_err(LoadError::Io)?;
        let cgroup_procs = match &self.cgroup {
            Some(cgroup) => Some(cgroup.open_procs().map_err(LoadError::Cgroup)?),
            None => None,
        };
        let child = isolation::spawn(SpawnSpec {
            program: self.interpreter.clone().into_os_string(),
            args: [
                "-u",
                "-B",
                "-I",
                "-c",
                LAUNCHER,
                &self.handler,
                self.key.run_uid(),
                &self.key.attempt().to_string(),
            ]
            .into_iter()
            .map(OsString::from)
            .collect(),
            env: self.env.clone(),
            cwd: self.work.clone(),
            stdin: Stdio::null(),
            stdout: stdout.into(),
            stderr: stderr.into(),
            cgroup_procs,
            extra_fds: vec![request_read.into(), response_write.into()],
        })
        .map_err(LoadError::Spawn)?;
        self.pgid
            .store(child.id().unwrap_or_default(), Ordering::SeqCst);
        let mut worker = PythonWorker {
            child,
            requests,
            responses,
        };
        enum Loaded {
            Frame(Result<Vec<u8>, FrameError>),
            Exited,
            TimedOut,
            Stopped,
        }
        let loaded = tokio::select! {
            biased;
            frame = read_frame(&mut worker.responses, MAX_FRAME_BYTES) => Loaded::Frame(frame),
            _ = worker.child.wait() => Loaded::Exited,
            () = tokio::time::sleep(limit) => Loaded::TimedOut,
            () = stopped(stop) => Loaded::Stopped,
        };
        let error = match loaded {
            Loaded::Frame(Ok(body)) => match serde_json::from_slice::<ResponseFrame>(&body) {
                Ok(frame) if frame.ready => return Ok(worker),
                Ok(frame) if !frame.ok => LoadError::Raised(frame.error()),
                Ok(_) => {
                    LoadError::Protocol("the first frame is neither ready nor an error".into())
                }
                Err(e) => LoadError::Protocol(format!("the first frame is not JSON: {e}")),
            },
            Loaded::Frame(Err(FrameError::TooLarge { len, limit })) => {
                LoadError::Protocol(format!("a frame of {len} bytes exceeds {limit}"))
            }
            Loaded::Frame(Err(_)) | Loaded::Exited => {
                let status = self.kill_worker(Some(worker), Some(EXIT_GRACE)).await;
                return Err(LoadError::Exited(status));
            }
            Loaded::TimedOut => LoadError::TimedOut(limit),
            Loaded::Stopped => LoadError::Stopped,
        };
        self.kill_worker(Some(worker), None).await;
        Err(error)
    }

    /// Runs one invocation on the adapter the caller holds.
    async fn invoke(
        &self,
        adapter: &mut AdapterState,
        spec: &InvokeSpec,
    ) -> Result<Invocation, FunctionError> {
        let mut stop = self.stop.subscribe();
        match adapter {
            AdapterState::Bash => self.invoke_bash(spec, &mut stop).await,
            AdapterState::Python(state) => self.invoke_python(state, spec, &mut stop).await,
        }
    }

    async fn invoke_python(
        &self,
        state: &mut PythonState,
        spec: &InvokeSpec,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Invocation, FunctionError> {
        let started = Instant::now();
        // An interpreter that died since the last invocation is replaced first.
        if let Some(worker) = &mut state.worker
            && !matches!(worker.child.try_wait(), Ok(None))
        {
            tracing::info!(registration = %self.id, "interpreter died while idle; restarting it");
            let dead = state.worker.take();
            self.kill_worker(dead, None).await;
        }
        let worker = match state.worker.take() {
            Some(worker) => worker,
            None => match self
                .start_python(&state.logs, self.load_timeout, stop)
                .await
            {
                Ok(worker) => worker,
                Err(LoadError::Stopped) => {
                    return Err(FunctionError::Unregistering {
                        id: self.id.clone(),
                    });
                }
                Err(e) => {
                    let message = clip_start(
                        &format!("the interpreter could not be restarted: {}", e.describe()),
                        MAX_ERROR_MESSAGE_BYTES,
                    );
                    tracing::warn!(registration = %self.id, %message, "registration failed");
                    self.fail("InterpreterLost", message.clone());
                    return Err(FunctionError::Failed {
                        id: self.id.clone(),
                        reason: "InterpreterLost",
                        message,
                    });
                }
            },
        };
        let worker = state.worker.insert(worker);
        let body = serde_json::to_vec(&RequestFrame {
            id: &spec.invocation_id,
            payload: &spec.payload,
        })
        .map_err(|e| FunctionError::Io {
            key: self.key.clone(),
            source: std::io::Error::other(e),
        })?;
        let frame = encode_frame(&body).map_err(|e| FunctionError::Io {
            key: self.key.clone(),
            source: std::io::Error::other(e),
        })?;
        let logs_start = state.logs.lengths();
        let deadline = Instant::now() + spec.timeout;

        enum Ending {
            Response(Result<Vec<u8>, FrameError>),
            Exited,
            TimedOut,
            Stopped,
        }
        let ending = {
            let PythonWorker {
                child,
                requests,
                responses,
            } = worker;
            let exchange = async {
                requests.write_all(&frame).await.map_err(FrameError::Io)?;
                read_frame(responses, MAX_FRAME_BYTES).await
            };
            tokio::select! {
                biased;
                response = exchange => Ending::Response(response),
                _ = child.wait() => Ending::Exited,
                () = tokio::time::sleep_until(deadline) => Ending::TimedOut,
                () = stopped(stop) => Ending::Stopped,
            }
        };
        // Unregistering kills the interpreter right after it sets `stop`; a death seen
        // first is that kill, not the handler's doing.
        let ending = match ending {
            Ending::Response(Ok(_)) => ending,
            _ if *stop.borrow() => Ending::Stopped,
            _ => ending,
        };
        let (outcome, result, error) = match ending {
            Ending::Response(Ok(body)) => match serde_json::from_slice::<ResponseFrame>(&body) {
                Ok(frame) if frame.ok => match frame.result {
                    Some(text) if text.len() > MAX_RESULT_BYTES => Invocation::failed(
                        "ResultTooLarge",
                        format!(
                            "the result is {} bytes of JSON, more than {MAX_RESULT_BYTES}",
                            text.len()
                        ),
                    ),
                    Some(text) if serde_json::from_str::<IgnoredAny>(&text).is_ok() => {
                        (Outcome::Succeeded, text.into_bytes(), None)
                    }
                    _ => Invocation::failed(
                        "ResultNotJson",
                        "the handler's result is not one JSON value".to_owned(),
                    ),
                },
                Ok(frame) if !frame.ready => (Outcome::Failed, Vec::new(), Some(frame.error())),
                parsed => {
                    let detail = match parsed {
                        Err(e) => format!("a response that is not JSON ({e})"),
                        Ok(_) => "an unexpected frame".to_owned(),
                    };
                    let worker = state.worker.take();
                    self.kill_worker(worker, None).await;
                    Invocation::failed(
                        "InterpreterExited",
                        format!(
                            "the interpreter sent {detail}; it was killed and is restarted before the next invocation"
                        ),
                    )
                }
            },
            Ending::Response(Err(_)) | Ending::Exited => {
                let worker = state.worker.take();
                let status = self.kill_worker(worker, Some(EXIT_GRACE)).await;
                Invocation::failed(
                    "InterpreterExited",
                    format!(
                        "the interpreter {} during the invocation; it is restarted before the next one",
                        describe_exit(status)
                    ),
                )
            }
            Ending::TimedOut => {
                let worker = state.worker.take();
                self.kill_worker(worker, None).await;
                (
                    Outcome::TimedOut,
                    Vec::new(),
                    Some(InvocationError::new(
                        "Timeout",
                        format!(
                            "exceeded its timeout of {:.3} s; the interpreter was killed and is restarted before the next invocation",
                            spec.timeout.as_secs_f64()
                        ),
                    )),
                )
            }
            Ending::Stopped => {
                let worker = state.worker.take();
                self.kill_worker(worker, None).await;
                return Err(FunctionError::Unregistering {
                    id: self.id.clone(),
                });
            }
        };
        let (stdout, stderr) = state.logs.since(logs_start);
        state.logs.rotate();
        Ok(Invocation {
            outcome,
            result,
            error,
            stdout,
            stderr,
            duration: started.elapsed(),
        })
    }

    async fn invoke_bash(
        &self,
        spec: &InvokeSpec,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Invocation, FunctionError> {
        let started = Instant::now();
        let mut env = self.env.clone();
        env.push((
            "KRUNTIME_INVOCATION_ID".to_owned(),
            spec.invocation_id.clone(),
        ));
        let cgroup_procs = match &self.cgroup {
            Some(cgroup) => Some(
                cgroup
                    .open_procs()
                    .map_err(|source| FunctionError::Cgroup {
                        key: self.key.clone(),
                        source,
                    })?,
            ),
            None => None,
        };
        let mut child = isolation::spawn(SpawnSpec {
            program: self.interpreter.clone().into_os_string(),
            args: vec![OsString::from(&self.handler)],
            env,
            cwd: self.work.clone(),
            stdin: Stdio::piped(),
            stdout: Stdio::piped(),
            stderr: Stdio::piped(),
            cgroup_procs,
            extra_fds: Vec::new(),
        })
        .map_err(|source| FunctionError::Spawn {
            key: self.key.clone(),
            source,
        })?;
        self.pgid
            .store(child.id().unwrap_or_default(), Ordering::SeqCst);
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let mut result = Vec::new();
        let mut result_total = 0u64;
        let mut errors = TailCollector::new(INVOCATION_LOG_LIMIT_BYTES);
        // Write the request while reading both streams: a script that writes before it
        // reads its whole stdin never deadlocks against us.
        let mut io = Box::pin(async {
            let write = async {
                if let Some(mut stdin) = stdin {
                    // A script that exits without reading its stdin closes the pipe (EPIPE).
                    let _ = stdin.write_all(spec.payload.as_bytes()).await;
                }
            };
            let read_result = async {
                if let Some(stdout) = stdout {
                    result_total = read_bounded(stdout, &mut result, MAX_RESULT_BYTES + 1).await;
                }
            };
            let read_errors = async {
                if let Some(stderr) = stderr {
                    collect(stderr, &mut errors).await;
                }
            };
            tokio::join!(write, read_result, read_errors);
        });
        let deadline = started + spec.timeout;
        enum Ending {
            Exited(std::io::Result<ExitStatus>),
            TimedOut,
            Stopped,
        }
        let mut io_done = false;
        let ending = loop {
            tokio::select! {
                () = &mut io, if !io_done => io_done = true,
                status = child.wait() => break Ending::Exited(status),
                () = tokio::time::sleep_until(deadline) => break Ending::TimedOut,
                () = stopped(stop) => break Ending::Stopped,
            }
        };
        // Unregistering kills the script right after it sets `stop`.
        let ending = match ending {
            Ending::Exited(Ok(status)) if status.success() => Ending::Exited(Ok(status)),
            _ if *stop.borrow() => Ending::Stopped,
            _ => ending,
        };
        // Nothing an invocation started outlives it; that also closes the pipes that
        // background processes may hold.
        self.kill_processes();
        if !matches!(ending, Ending::Exited(_)) {
            let _ = tokio::time::timeout(DRAIN_LIMIT, child.wait()).await;
        }
        if !io_done {
            let _ = tokio::time::timeout(DRAIN_LIMIT, &mut io).await;
        }
        drop(io);
        self.pgid.store(0, Ordering::SeqCst);
        self.wait_cgroup_empty().await;
        let stderr = errors.finish();
        let (outcome, result, error) = match ending {
            Ending::Stopped => {
                return Err(FunctionError::Unregistering {
                    id: self.id.clone(),
                });
            }
            Ending::TimedOut => (
                Outcome::TimedOut,
                Vec::new(),
                Some(InvocationError::new(
                    "Timeout",
                    format!(
                        "exceeded its timeout of {:.3} s",
                        spec.timeout.as_secs_f64()
                    ),
                )),
            ),
            Ending::Exited(Err(source)) => {
                return Err(FunctionError::Io {
                    key: self.key.clone(),
                    source,
                });
            }
            Ending::Exited(Ok(status)) => match (status.code(), status.signal()) {
                (Some(0), _) => bash_result(&result, result_total),
                (Some(code), _) => {
                    let mut message = format!("exited with code {code}");
                    if let Some(line) = last_line(&stderr.data) {
                        message.push_str(": ");
                        message.push_str(&clip_start(line, 1024));
                    }
                    Invocation::failed("NonZeroExitCode", message)
                }
                (None, signal) => Invocation::failed(
                    "InterpreterExited",
                    format!("bash was killed by signal {}", signal.unwrap_or_default()),
                ),
            },
        };
        Ok(Invocation {
            outcome,
            result,
            error,
            stdout: empty_tail(),
            stderr,
            duration: started.elapsed(),
        })
    }

    /// Kills everything of the registration and removes its cgroup and workspace.
    async fn destroy(&self) -> Result<(), FunctionError> {
        self.kill_processes();
        if let Some(cgroup) = &self.cgroup {
            match cgroup.wait_empty(DRAIN_LIMIT).await {
                Ok(true) => {
                    if let Err(e) = cgroup.remove() {
                        tracing::warn!(registration = %self.id, error = %e, "cgroup not removed");
                    }
                }
                Ok(false) => {
                    tracing::warn!(registration = %self.id, "cgroup still populated after kill");
                }
                Err(e) => tracing::warn!(registration = %self.id, error = %e, "cgroup not drained"),
            }
        }
        match std::fs::remove_dir_all(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(FunctionError::Remove {
                    path: self.dir.clone(),
                    source,
                });
            }
        }
        // Fails while another attempt of the Run still has a workspace.
        if let Some(run_dir) = self.dir.parent() {
            let _ = std::fs::remove_dir(run_dir);
        }
        Ok(())
    }
}

/// Reads a stream to its end, keeping its first `limit` bytes; returns its whole length.
async fn read_bounded(mut reader: impl AsyncRead + Unpin, kept: &mut Vec<u8>, limit: usize) -> u64 {
    let mut chunk = vec![0u8; 64 * 1024];
    let mut total = 0u64;
    loop {
        match reader.read(&mut chunk).await {
            Ok(0) | Err(_) => return total,
            Ok(n) => {
                total += n as u64;
                let room = limit.saturating_sub(kept.len());
                kept.extend_from_slice(&chunk[..n.min(room)]);
            }
        }
    }
}

/// Reads a stream to its end into a bounded tail.
async fn collect(mut reader: impl AsyncRead + Unpin, tail: &mut TailCollector) {
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        match reader.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => tail.push(&chunk[..n]),
        }
    }
}

/// The result of a bash invocation that exited 0: its stdout when that is one JSON value
/// (one trailing newline ignored), else the JSON string of the text.
fn bash_result(stdout: &[u8], total: u64) -> (Outcome, Vec<u8>, Option<InvocationError>) {
    if total > MAX_RESULT_BYTES as u64 {
        return Invocation::failed(
            "ResultTooLarge",
            format!("stdout is {total} bytes, more than {MAX_RESULT_BYTES}"),
        );
    }
    let text = stdout.strip_suffix(b"\n").unwrap_or(stdout);
    let Ok(text) = std::str::from_utf8(text) else {
        return Invocation::failed(
            "ResultNotJson",
            "stdout is neither JSON nor UTF-8 text".to_owned(),
        );
    };
    if serde_json::from_str::<IgnoredAny>(text).is_ok() {
        return (Outcome::Succeeded, text.as_bytes().to_vec(), None);
    }
    match serde_json::to_vec(text) {
        Ok(json) if json.len() <= MAX_RESULT_BYTES => (Outcome::Succeeded, json, None),
        Ok(json) => Invocation::failed(
            "ResultTooLarge",
            format!(
                "stdout as a JSON string is {} bytes, more than {MAX_RESULT_BYTES}",
                json.len()
            ),
        ),
        Err(e) => Invocation::failed("ResultNotJson", format!("stdout cannot be encoded: {e}")),
    }
}

/// The last non-empty line of `data`, when it is UTF-8 text.
fn last_line(data: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(data).ok()?;
    text.lines()
        .rev()
        .map(str::trim_end)
        .find(|l| !l.is_empty())
}

/// At most `max` bytes of `s` from its start, cut on a character boundary.
fn clip_start(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// At most `max` bytes of `s` from its end, behind the truncation marker of log tails when
/// earlier bytes are dropped, cut on a character boundary.
fn clip_end(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let (keep, _) = logs::tail_plan(s.len() as u64, max as u64);
    let mut start = s.len() - keep as usize;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    // The marker for fewer dropped bytes is never longer than the one planned for.
    format!("{}{}", logs::truncation_marker(start as u64), &s[start..])
}

// ---------------------------------------------------------------------------------------
// The table

/// Every registration of the server.
pub struct Functions {
    config: FunctionsConfig,
    /// `root/functions`.
    dir: PathBuf,
    /// By Run UID: one generation each.
    table: Mutex<BTreeMap<String, Arc<Registration>>>,
    /// Serialises registering and unregistering per Run UID, so concurrent calls for one
    /// Run never start two interpreters.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Registrations that are loading, so that unregistering and shutdown can stop them.
    loading: Mutex<HashMap<String, Arc<Registration>>>,
    accepting: AtomicBool,
}

impl Functions {
    /// Takes over `root/functions`: what a previous server left there is killed (its
    /// `fn-*` cgroups) and removed.
    pub fn new(config: FunctionsConfig) -> Result<Arc<Self>, FunctionError> {
        let dir = config.root.join("functions");
        if let Some(parent) = &config.cgroups {
            clean_leftover_cgroups(parent);
        }
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {
                tracing::warn!(dir = %dir.display(), "removed registrations of a previous server")
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(FunctionError::Remove { path: dir, source }),
        }
        Ok(Arc::new(Self {
            config,
            dir,
            table: Mutex::new(BTreeMap::new()),
            locks: Mutex::new(HashMap::new()),
            loading: Mutex::new(HashMap::new()),
            accepting: AtomicBool::new(true),
        }))
    }

    pub fn accepting(&self) -> bool {
        self.accepting.load(Ordering::SeqCst)
    }

    pub fn adapter(&self) -> Adapter {
        self.config.adapter
    }

    fn uid_lock(&self, uid: &str) -> Arc<tokio::sync::Mutex<()>> {
        lock(&self.locks).entry(uid.to_owned()).or_default().clone()
    }

    fn release_uid_lock(&self, uid: &str, held: Arc<tokio::sync::Mutex<()>>) {
        let mut locks = lock(&self.locks);
        drop(held);
        if locks.get(uid).is_some_and(|l| Arc::strong_count(l) == 1) {
            locks.remove(uid);
        }
    }

    fn find(&self, registration_id: &str) -> Result<Arc<Registration>, FunctionError> {
        let not_found = || FunctionError::NotFound {
            id: ids::bounded(registration_id),
        };
        let uid = uid_of(registration_id).ok_or_else(not_found)?;
        lock(&self.table)
            .get(uid)
            .filter(|r| r.id == registration_id)
            .cloned()
            .ok_or_else(not_found)
    }

    /// Registers a handler and returns once it is ready (python: imported), or returns the
    /// existing registration for the same Run UID, attempt and configuration.
    ///
    /// Errors: a different configuration for the same attempt (`Conflict`), an attempt
    /// older than the registered one (`StaleAttempt`), a handler that does not load
    /// (`LoadFailed`, nothing left behind), an unregister that arrived meanwhile
    /// (`Cancelled`), shutdown, and failures to prepare the workspace or cgroup. A higher
    /// attempt first unregisters the registered generation. The work runs in its own task:
    /// a caller that goes away does not interrupt it halfway.
    pub async fn register(
        self: &Arc<Self>,
        spec: RegisterSpec,
    ) -> Result<FunctionSnapshot, FunctionError> {
        let this = self.clone();
        tokio::spawn(async move {
            if !this.accepting() {
                return Err(FunctionError::ShuttingDown);
            }
            let uid = spec.key.run_uid().to_owned();
            let uid_lock = this.uid_lock(&uid);
            let guard = uid_lock.clone().lock_owned().await;
            let result = this.register_locked(spec).await;
            drop(guard);
            this.release_uid_lock(&uid, uid_lock);
            result
        })
        .await
        .map_err(FunctionError::Task)?
    }

    async fn register_locked(&self, spec: RegisterSpec) -> Result<FunctionSnapshot, FunctionError> {
        if !self.accepting() {
            return Err(FunctionError::ShuttingDown);
        }
        let uid = spec.key.run_uid().to_owned();
        let current = lock(&self.table).get(&uid).cloned();
        if let Some(current) = current {
            match current.key.attempt().cmp(&spec.key.attempt()) {
                std::cmp::Ordering::Equal if current.digest == spec.digest => {
                    return Ok(current.snapshot());
                }
                std::cmp::Ordering::Equal => {
                    return Err(FunctionError::Conflict { key: spec.key });
                }
                std::cmp::Ordering::Greater => {
                    return Err(FunctionError::StaleAttempt {
                        key: spec.key,
                        registered: current.key.attempt(),
                    });
                }
                std::cmp::Ordering::Less => {
                    tracing::info!(old = %current.id, attempt = spec.key.attempt(), "a new generation replaces the registration");
                    self.teardown(&current).await?;
                }
            }
        }
        let registration = Arc::new(self.prepare(&spec)?);
        lock(&self.loading).insert(uid.clone(), registration.clone());
        let loaded = self.load(&registration).await;
        lock(&self.loading).remove(&uid);
        let stopped = *registration.stop.borrow();
        let error = match loaded {
            Ok(()) if !stopped => None,
            Ok(()) | Err(LoadError::Stopped) => Some(if self.accepting() {
                FunctionError::Cancelled {
                    key: spec.key.clone(),
                }
            } else {
                FunctionError::ShuttingDown
            }),
            Err(LoadError::Spawn(source)) => Some(FunctionError::Spawn {
                key: spec.key.clone(),
                source,
            }),
            Err(LoadError::Cgroup(source)) => Some(FunctionError::Cgroup {
                key: spec.key.clone(),
                source,
            }),
            Err(e) => Some(FunctionError::LoadFailed {
                key: spec.key.clone(),
                detail: clip_start(&e.describe(), MAX_ERROR_MESSAGE_BYTES),
            }),
        };
        if let Some(error) = error {
            tracing::info!(registration = %registration.id, error = %error, "registration failed");
            let cleanup = async {
                let mut adapter = registration.adapter.lock().await;
                if let AdapterState::Python(state) = &mut *adapter {
                    registration.kill_worker(state.worker.take(), None).await;
                }
                drop(adapter);
                registration.destroy().await
            };
            if let Err(e) = cleanup.await {
                tracing::warn!(registration = %registration.id, error = %e, "failed registration not removed");
            }
            return Err(error);
        }
        tracing::info!(registration = %registration.id, handler = %registration.handler, "registered");
        let snapshot = registration.snapshot();
        lock(&self.table).insert(uid, registration);
        Ok(snapshot)
    }

    /// Creates the workspace (sources written), the cgroup and the adapter's state;
    /// removes what it made on failure.
    fn prepare(&self, spec: &RegisterSpec) -> Result<Registration, FunctionError> {
        let dir = self
            .dir
            .join(spec.key.run_uid())
            .join(spec.key.attempt().to_string());
        let cgroup = self
            .config
            .cgroups
            .as_ref()
            .map(|parent| parent.child(&format!("{CGROUP_PREFIX}{}", spec.key.component())));
        let prepared = self.prepare_in(&dir, cgroup.as_ref(), spec);
        if prepared.is_err() {
            if let Some(cgroup) = &cgroup {
                let _ = cgroup.remove();
            }
            let _ = std::fs::remove_dir_all(&dir);
            if let Some(run_dir) = dir.parent() {
                let _ = std::fs::remove_dir(run_dir);
            }
        }
        let adapter = prepared?;
        let now = SystemTime::now();
        let work = dir.join("work");
        let tmp = dir.join("tmp");
        let mut env = executor::base_env(&self.config.path_var, self.config.adapter, &work, &tmp);
        env.extend(spec.env.iter().cloned());
        env.extend([
            ("KRUNTIME_RUN_UID".to_owned(), spec.key.run_uid().to_owned()),
            (
                "KRUNTIME_ATTEMPT".to_owned(),
                spec.key.attempt().to_string(),
            ),
            ("KRUNTIME_WORKSPACE".to_owned(), work.display().to_string()),
        ]);
        Ok(Registration {
            id: format!(
                "fn-{}-{}-{:08x}",
                spec.key.run_uid(),
                spec.key.attempt(),
                rand::random::<u32>()
            ),
            key: spec.key.clone(),
            digest: spec.digest,
            dir,
            work,
            handler: spec.handler.clone(),
            interpreter: self.config.interpreter.clone(),
            env,
            load_timeout: spec.load_timeout,
            cgroup,
            registered_at: now,
            info: Mutex::new(Info {
                state: FunctionState::Ready,
                reason: "Registered",
                message: String::new(),
                in_flight: false,
                last_activity: now,
                invocations: 0,
                unregistering: false,
            }),
            adapter: Arc::new(tokio::sync::Mutex::new(adapter)),
            stop: watch::Sender::new(false),
            pgid: AtomicU32::new(0),
        })
    }

    fn prepare_in(
        &self,
        dir: &Path,
        cgroup: Option<&ExecCgroup>,
        spec: &RegisterSpec,
    ) -> Result<AdapterState, FunctionError> {
        let ws_err = |path: &Path| {
            let path = path.to_owned();
            move |source| FunctionError::Workspace { path, source }
        };
        if dir.exists() {
            // Left by an unregister that could not finish; this identity is ours.
            std::fs::remove_dir_all(dir).map_err(ws_err(dir))?;
        }
        let work = dir.join("work");
        let tmp = dir.join("tmp");
        std::fs::create_dir_all(&work).map_err(ws_err(&work))?;
        std::fs::create_dir(&tmp).map_err(ws_err(&tmp))?;
        executor::write_sources(&work, &spec.files).map_err(ws_err(&work))?;
        if let Some(cgroup) = cgroup {
            cgroup.create().map_err(|source| FunctionError::Cgroup {
                key: spec.key.clone(),
                source,
            })?;
        }
        Ok(match self.config.adapter {
            Adapter::Bash => AdapterState::Bash,
            Adapter::Python => AdapterState::Python(Box::new(PythonState {
                worker: None,
                logs: LogFiles::create(dir).map_err(ws_err(dir))?,
            })),
        })
    }

    /// Python: starts the interpreter and waits until the handler is loaded. Bash: nothing
    /// to load (the handler was checked to be one of the files).
    async fn load(&self, registration: &Registration) -> Result<(), LoadError> {
        let mut adapter = registration.adapter.lock().await;
        match &mut *adapter {
            AdapterState::Bash => Ok(()),
            AdapterState::Python(state) => {
                let mut stop = registration.stop.subscribe();
                let worker = registration
                    .start_python(&state.logs, registration.load_timeout, &mut stop)
                    .await?;
                state.worker = Some(worker);
                Ok(())
            }
        }
    }

    pub fn status(&self, registration_id: &str) -> Result<FunctionSnapshot, FunctionError> {
        Ok(self.find(registration_id)?.snapshot())
    }

    /// Every registration, ordered by Run UID.
    pub fn list(&self) -> Vec<FunctionSnapshot> {
        lock(&self.table).values().map(|r| r.snapshot()).collect()
    }

    /// Runs one invocation. A handler that fails is a FAILED or TIMED_OUT [`Invocation`],
    /// not an error.
    ///
    /// Errors: an unknown registration (`NotFound`), one that is failed or being
    /// unregistered (also when an unregister interrupts the invocation), an invocation
    /// already in flight (`Busy`, at once), shutdown, and broken pipes or spawns. The
    /// invocation runs in its own task: a caller that goes away does not leave the
    /// interpreter halfway through a request.
    pub async fn invoke(
        self: &Arc<Self>,
        registration_id: &str,
        spec: InvokeSpec,
    ) -> Result<Invocation, FunctionError> {
        let registration = self.find(registration_id)?;
        if !self.accepting() {
            return Err(FunctionError::ShuttingDown);
        }
        registration.usable()?;
        let mut adapter =
            registration
                .adapter
                .clone()
                .try_lock_owned()
                .map_err(|_| FunctionError::Busy {
                    id: registration.id.clone(),
                })?;
        // Unregistering marks the registration before it takes the adapter.
        registration.usable()?;
        {
            let mut info = registration.info();
            info.in_flight = true;
            info.invocations += 1;
        }
        let this = self.clone();
        tokio::spawn(async move {
            let result = match registration.invoke(&mut adapter, &spec).await {
                // Stopped by shutdown rather than by an unregister.
                Err(FunctionError::Unregistering { .. }) if !this.accepting() => {
                    Err(FunctionError::ShuttingDown)
                }
                result => result,
            };
            {
                let mut info = registration.info();
                info.in_flight = false;
                info.last_activity = SystemTime::now();
            }
            drop(adapter);
            match &result {
                Ok(invocation) => tracing::debug!(
                    registration = %registration.id,
                    invocation = %spec.invocation_id,
                    outcome = ?invocation.outcome,
                    "invoked"
                ),
                Err(e) => tracing::info!(
                    registration = %registration.id,
                    invocation = %spec.invocation_id,
                    error = %e,
                    "invocation failed"
                ),
            }
            result
        })
        .await
        .map_err(FunctionError::Task)?
    }

    /// Unregisters: stops new invocations, kills an in-flight one and the adapter (the
    /// whole cgroup), removes the workspace and cgroup, forgets the registration. Also
    /// stops a registration of the Run that is still loading when `target` covers it.
    /// Returns whether anything existed. Runs in its own task.
    pub async fn unregister(
        self: &Arc<Self>,
        target: UnregisterTarget,
    ) -> Result<bool, FunctionError> {
        let this = self.clone();
        tokio::spawn(async move {
            let (uid, mut existed) = match &target {
                UnregisterTarget::Id(id) => match uid_of(id) {
                    Some(uid) => (uid.to_owned(), false),
                    None => return Ok(false),
                },
                UnregisterTarget::UpTo(key) => {
                    // A registration still loading is stopped now rather than after its
                    // load (which may take up to its load timeout).
                    let loading = lock(&this.loading)
                        .get(key.run_uid())
                        .filter(|r| r.key.attempt() <= key.attempt())
                        .cloned();
                    if let Some(registration) = &loading {
                        registration.stop.send_replace(true);
                    }
                    (key.run_uid().to_owned(), loading.is_some())
                }
            };
            let uid_lock = this.uid_lock(&uid);
            let guard = uid_lock.clone().lock_owned().await;
            let current = lock(&this.table)
                .get(&uid)
                .cloned()
                .filter(|r| match &target {
                    UnregisterTarget::Id(id) => r.id == *id,
                    UnregisterTarget::UpTo(key) => r.key.attempt() <= key.attempt(),
                });
            let result = match current {
                Some(registration) => {
                    existed = true;
                    this.teardown(&registration).await
                }
                None => Ok(()),
            };
            drop(guard);
            this.release_uid_lock(&uid, uid_lock);
            result.map(|()| existed)
        })
        .await
        .map_err(FunctionError::Task)?
    }

    /// Removes one registration; the caller holds its Run UID's lock.
    async fn teardown(&self, registration: &Arc<Registration>) -> Result<(), FunctionError> {
        registration.info().unregistering = true;
        registration.stop.send_replace(true);
        // Ends an in-flight invocation at once; it notices `stop` and releases the adapter.
        registration.kill_processes();
        match tokio::time::timeout(STOP_LIMIT, registration.adapter.clone().lock_owned()).await {
            Ok(mut adapter) => {
                if let AdapterState::Python(state) = &mut *adapter {
                    registration.kill_worker(state.worker.take(), None).await;
                }
            }
            Err(_) => tracing::warn!(
                registration = %registration.id,
                "the in-flight invocation did not end; removing the registration anyway"
            ),
        }
        registration.destroy().await?;
        let mut table = lock(&self.table);
        if table
            .get(registration.key.run_uid())
            .is_some_and(|r| Arc::ptr_eq(r, registration))
        {
            table.remove(registration.key.run_uid());
        }
        drop(table);
        tracing::info!(registration = %registration.id, "unregistered");
        Ok(())
    }

    /// Stops accepting registrations and invocations, stops loading ones, and unregisters
    /// every registration, within `limit`.
    pub async fn shutdown(&self, limit: Duration) {
        self.accepting.store(false, Ordering::SeqCst);
        for registration in lock(&self.loading).values() {
            registration.stop.send_replace(true);
        }
        let mut uids: BTreeSet<String> = lock(&self.table).keys().cloned().collect();
        uids.extend(lock(&self.locks).keys().cloned());
        let deadline = Instant::now() + limit;
        for uid in uids {
            let teardown = async {
                let uid_lock = self.uid_lock(&uid);
                let guard = uid_lock.clone().lock_owned().await;
                let current = lock(&self.table).get(&uid).cloned();
                if let Some(registration) = current
                    && let Err(e) = self.teardown(&registration).await
                {
                    tracing::warn!(registration = %registration.id, error = %e, "not removed at shutdown");
                }
                drop(guard);
                self.release_uid_lock(&uid, uid_lock);
            };
            if tokio::time::timeout_at(deadline, teardown).await.is_err() {
                tracing::warn!("registrations not all removed before the shutdown deadline");
                break;
            }
        }
    }
}

/// The Run UID inside a registration ID (`fn-<uid>-<attempt>-<random>`).
fn uid_of(registration_id: &str) -> Option<&str> {
    let uid = registration_id.strip_prefix("fn-")?.get(..36)?;
    ids::validate_run_uid(uid).ok()?;
    Some(uid)
}

/// Kills and removes every `fn-*` cgroup under `parent` (a previous server's).
fn clean_leftover_cgroups(parent: &CgroupParent) {
    let Ok(entries) = std::fs::read_dir(parent.path()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(CGROUP_PREFIX) || !entry.path().is_dir() {
            continue;
        }
        let cgroup = parent.child(name);
        let cleaned = cgroup
            .kill_all()
            .and_then(|()| cgroup.wait_empty_blocking(DRAIN_LIMIT))
            .and_then(|_| cgroup.remove());
        match cleaned {
            Ok(()) => tracing::warn!(cgroup = %name, "killed a registration of a previous server"),
            Err(e) => tracing::warn!(cgroup = %name, error = %e, "leftover cgroup not cleaned"),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip() {
        let mut stream = Vec::new();
        for body in [&b"{}"[..], b"", br#"{"id":"x","payload":"[1,2]"}"#] {
            stream.extend(encode_frame(body).unwrap());
        }
        assert_eq!(&stream[..4], &[0, 0, 0, 2]);
        let mut reader = &stream[..];
        assert_eq!(read_frame(&mut reader, 1024).await.unwrap(), b"{}");
        assert_eq!(read_frame(&mut reader, 1024).await.unwrap(), b"");
        assert_eq!(
            read_frame(&mut reader, 1024).await.unwrap(),
            br#"{"id":"x","payload":"[1,2]"}"#
        );
        assert!(matches!(
            read_frame(&mut reader, 1024).await,
            Err(FrameError::Closed)
        ));
    }

    #[tokio::test]
    async fn frames_refuse_oversized_and_truncated_input() {
        let frame = encode_frame(&[b'x'; 100]).unwrap();
        assert!(matches!(
            read_frame(&mut &frame[..], 99).await,
            Err(FrameError::TooLarge {
                len: 100,
                limit: 99
            })
        ));
        // A header that promises more than the stream holds, and a torn header.
        assert!(matches!(
            read_frame(&mut &frame[..50], 1024).await,
            Err(FrameError::Closed)
        ));
        assert!(matches!(
            read_frame(&mut &frame[..3], 1024).await,
            Err(FrameError::Closed)
        ));
    }

    #[test]
    fn response_frames_parse() {
        let ok: ResponseFrame = serde_json::from_str(r#"{"ok":true,"result":"[1]"}"#).unwrap();
        assert!(ok.ok && !ok.ready);
        assert_eq!(ok.result.as_deref(), Some("[1]"));
        let ready: ResponseFrame = serde_json::from_str(r#"{"ready":true}"#).unwrap();
        assert!(ready.ready);
        let failed: ResponseFrame = serde_json::from_str(
            r#"{"ok":false,"type":"ValueError","message":"bad","traceback":"tb"}"#,
        )
        .unwrap();
        let error = failed.error();
        assert_eq!(error.kind, "ValueError");
        assert_eq!(error.message, "bad");
        assert_eq!(error.traceback, "tb");
    }

    #[test]
    fn python_handlers() {
        let none = BTreeSet::new();
        for ok in [
            "main:handler",
            "pkg.mod:fn",
            "pkg.mod.fn",
            "m:Class.method",
            "_m:_f",
        ] {
            assert!(validate_handler(Adapter::Python, ok, &none).is_ok(), "{ok}");
        }
        for bad in [
            "", "main", ":fn", "main:", "a..b:f", "1mod:f", "m:f-x", "m:f g", "../x:f", "m/x:f",
        ] {
            assert!(
                validate_handler(Adapter::Python, bad, &none).is_err(),
                "{bad:?}"
            );
        }
        assert!(
            validate_handler(Adapter::Python, &format!("m:{}", "f".repeat(1024)), &none).is_err()
        );
    }

    #[test]
    fn bash_handlers_are_files() {
        let files = BTreeSet::from(["handler.sh", "lib/x.sh"]);
        assert!(validate_handler(Adapter::Bash, "handler.sh", &files).is_ok());
        assert!(validate_handler(Adapter::Bash, "lib/x.sh", &files).is_ok());
        assert!(validate_handler(Adapter::Bash, "other.sh", &files).is_err());
        assert!(validate_handler(Adapter::Bash, "../handler.sh", &files).is_err());
    }

    #[test]
    fn invoke_requests_are_bounded_json() {
        assert!(InvokeSpec::new("i".into(), b"{\"a\":1}".to_vec(), None).is_ok());
        assert!(InvokeSpec::new("i".into(), b" 42 ".to_vec(), None).is_ok());
        for bad in [&b""[..], b"{", b"nope", b"1 2", b"\"\xff\""] {
            assert!(
                InvokeSpec::new("i".into(), bad.to_vec(), None).is_err(),
                "{bad:?}"
            );
        }
        let big = format!("\"{}\"", "x".repeat(MAX_PAYLOAD_BYTES));
        assert!(InvokeSpec::new("i".into(), big.into_bytes(), None).is_err());
        assert!(InvokeSpec::new("x".repeat(129), b"1".to_vec(), None).is_err());
        assert!(InvokeSpec::new("x".repeat(128), b"1".to_vec(), None).is_ok());
        let spec = InvokeSpec::new("i".into(), b"1".to_vec(), Some(Duration::ZERO)).unwrap();
        assert_eq!(spec.timeout, DEFAULT_INVOKE_TIMEOUT);
        assert!(
            InvokeSpec::new("i".into(), b"1".to_vec(), Some(Duration::from_secs(301))).is_err()
        );
    }

    #[test]
    fn bash_results() {
        let (outcome, result, _) = bash_result(b"{\"a\": 1}\n", 9);
        assert_eq!(outcome, Outcome::Succeeded);
        assert_eq!(result, b"{\"a\": 1}");
        let (_, result, _) = bash_result(b"hello world\n", 12);
        assert_eq!(result, b"\"hello world\"");
        let (_, result, _) = bash_result(b"two\nlines\n\n", 11);
        assert_eq!(result, b"\"two\\nlines\\n\"");
        let (_, result, _) = bash_result(b"", 0);
        assert_eq!(result, b"\"\"");
        let (outcome, _, error) = bash_result(b"x", MAX_RESULT_BYTES as u64 + 1);
        assert_eq!(outcome, Outcome::Failed);
        assert_eq!(error.unwrap().kind, "ResultTooLarge");
        let (_, _, error) = bash_result(b"\xff\xfe", 2);
        assert_eq!(error.unwrap().kind, "ResultNotJson");
    }

    #[test]
    fn clipping_keeps_char_boundaries() {
        assert_eq!(clip_start("héllo", 2), "h");
        assert_eq!(clip_start("short", 10), "short");
        let long = "é".repeat(1000);
        let end = clip_end(&long, 200);
        assert!(end.len() <= 200, "{}", end.len());
        assert!(end.starts_with("[kruntimes: "));
        assert!(end.ends_with('é'));
        assert_eq!(last_line(b"a\nlast one\n\n"), Some("last one"));
        assert_eq!(last_line(b""), None);
    }

    #[test]
    fn registration_ids_carry_the_run_uid() {
        let uid = "2c24c1f0-9f8f-4f80-82d5-3dd16a12d1e6";
        assert_eq!(uid_of(&format!("fn-{uid}-3-0badcafe")), Some(uid));
        assert_eq!(
            uid_of("fn-../../../etc/passwd-and-more-than-36-chars"),
            None
        );
        assert_eq!(uid_of("x"), None);
        assert_eq!(uid_of(""), None);
    }
}
