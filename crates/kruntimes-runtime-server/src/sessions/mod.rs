//! Session mode: stateful agent sandboxes (design document 001, "Runtime Server
//! Contract"; the `SessionRuntime` service of `runtime.proto`; `docs/session-mode.md`).
//!
//! Owns the table of sessions keyed by Run UID (one attempt each), each session's
//! directory `ROOT/sessions/<run-uid>/` and cgroup `ss-<run-uid>-<attempt>`, the lifecycle
//! (register, close with SIGTERM → grace → SIGKILL of everything the session ran, purge),
//! and running one operation at a time per session: a command (submodule `command`) or a
//! file operation (submodule [`files`], every path resolved beneath the workspace by the
//! kernel after the lexical checks of [`paths`]); plus reads and paged listings
//! ([`cursor`] holds the page token). It never queues, orders, retries or numbers
//! operations (runtimed does), and knows nothing of gRPC.
//!
//! Layout of one session:
//!
//! ```text
//! ROOT/sessions/<run-uid>/
//!   workspace/    every command's cwd root and HOME; every path of the API is relative to it
//!   artifacts/    $KRUNTIME_ARTIFACTS_DIR of every command; not reachable by the file calls
//!   tmp/          TMPDIR of every command
//! ```
//!
//! Nothing a command starts outlives its operation: when the command ends (exit, timeout,
//! close, or the caller dropping the call) whatever is left in the session's cgroup (or,
//! without cgroups, in the command's process group) is killed. Without cgroups a process
//! that calls `setsid()` escapes that and is not found again (`ISOLATION_PROCESS_GROUP`).
//!
//! Sessions do not survive a server restart: at startup `ROOT/sessions` is removed and every
//! leftover `ss-*` cgroup killed; at shutdown every session is closed and purged.
//!
//! Behaviour the contract leaves to the server, as this one does it:
//!
//! - Termination: a timeout or CloseSession sends SIGTERM to the command's process group
//!   and every process of the session's cgroup, then SIGKILL to all of them after the grace
//!   period (CloseSession's, cut to 5 minutes, else `--session-termination-grace`, 2 s by
//!   default; a timeout always uses the flag). A caller that drops the call gets SIGKILL at
//!   once. `Completed` is sent once the processes are gone (the cgroup is empty; without
//!   one, the process group, waited for at most 1 s).
//! - Attempts: a call for an attempt lower than the one held fails FAILED_PRECONDITION
//!   (GetSessionStatus too); a higher one is NOT_FOUND, except CloseSession, which closes
//!   the attempt it covers.
//! - A registration that cannot prepare its directory leaves nothing on disk and the
//!   session FAILED (`WorkspaceFailed`) until it is registered again or purged.
//! - Listings skip names that are not UTF-8 (no path of the API can name them) and
//!   describe a symlink as itself (`symlink`, never `directory`, size 0).
//! - Writes follow a final symlink only beneath the workspace and set the mode (0644 or
//!   0755) also on a file that existed; delete and rename never follow a final symlink.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use tokio::sync::{OwnedMutexGuard, mpsc, watch};
use tokio::time::Instant;

use crate::ids::{self, ExecutionKey};
use crate::interpreter::Adapter;
use crate::sandbox::cgroup::{CgroupParent, ExecCgroup};
use crate::tasks::executor::{self, RequestError, SourceFileSpec};

mod command;
pub mod cursor;
pub mod files;
mod parked;
pub mod paths;
pub mod service;
pub mod snapshot;
pub mod transfer;

use files::{FsError, FsReason};
use paths::PathError;

/// An operation may take this long unless the request says otherwise, and no longer.
pub const MAX_OPERATION_TIMEOUT: Duration = Duration::from_secs(300);
/// A command's stdin is at most this long.
pub const MAX_STDIN_BYTES: usize = 1024 * 1024;
/// At most this many arguments in `argv`.
pub const MAX_ARGV: usize = 1024;
/// All of `argv` together, and `shell`, are at most this long.
pub const MAX_COMMAND_BYTES: usize = 128 * 1024;
/// Each of a command's stdout and stderr carries at most this much per operation.
pub const MAX_STREAM_BYTES: usize = 1024 * 1024;
/// One output event carries at most this much.
pub const CHUNK_BYTES: usize = crate::logs::CHUNK_BYTES;
/// A listing page holds this many entries unless the request says otherwise.
pub const DEFAULT_LIST_LIMIT: usize = 100;
/// A listing page holds at most this many entries.
pub const MAX_LIST_LIMIT: usize = 1000;
/// `SessionStatus.message` and `OperationCompleted.message` are at most this long.
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024;
/// How long to wait for killed processes to end and their pipes to close.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);
/// How long closing waits, after the grace period, for the running operation to end.
const STOP_LIMIT: Duration = Duration::from_secs(10);
/// Events buffered for a slow caller before the command's output waits (each at most
/// [`CHUNK_BYTES`]).
const EVENT_BUFFER: usize = 16;
/// An upload whose caller sends nothing for this long is abandoned.
pub const TRANSFER_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Each session's cgroup is `ss-<run-uid>-<attempt>` under the server's parent.
const CGROUP_PREFIX: &str = "ss-";

/// The server's settings that sessions depend on.
#[derive(Debug, Clone)]
pub struct SessionsConfig {
    /// The server's root; sessions live under `root/sessions`.
    pub root: PathBuf,
    pub adapter: Adapter,
    /// The bash that runs `shell` commands.
    pub shell: PathBuf,
    /// PATH given to commands.
    pub path_var: String,
    /// `None`: process groups only.
    pub cgroups: Option<CgroupParent>,
    /// The `namespaces` backend; `None`: the `process` backend.
    pub sandboxes: Option<std::sync::Arc<crate::sandbox::Sandboxes>>,
    /// SIGTERM → SIGKILL when CloseSession gives no grace period, and after a timeout.
    pub termination_grace: Duration,
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error(transparent)]
    Path(#[from] PathError),
    #[error(transparent)]
    Token(#[from] cursor::TokenError),
    #[error("{what}: {detail}")]
    Invalid { what: &'static str, detail: String },
    #[error("session {key} already exists with different inputs")]
    Conflict { key: ExecutionKey },
    #[error("session attempt {key} is older than the registered attempt {registered}")]
    StaleAttempt { key: ExecutionKey, registered: u32 },
    #[error("session {key} is unknown")]
    NotFound { key: ExecutionKey },
    #[error("session {key} is {state} ({reason}), not ready")]
    NotReady {
        key: ExecutionKey,
        state: SessionState,
        reason: &'static str,
    },
    #[error("session {key} is running operation {running}")]
    Busy { key: ExecutionKey, running: String },
    /// Refused by what the session is doing (a capture, a restore, an operation, a
    /// transfer) or has done; `reason` is the `x-kruntimes-reason` of the status.
    #[error("session {key}: {detail}")]
    Refused {
        key: ExecutionKey,
        reason: &'static str,
        detail: String,
    },
    #[error("session {key} could not be registered: {message}")]
    WorkspaceFailed { key: ExecutionKey, message: String },
    #[error("{0}")]
    File(#[source] FsError),
    #[error("{0}")]
    Transfer(#[source] transfer::TransferError),
    #[error("the runtime server is shutting down")]
    ShuttingDown,
    #[error("failed to open the workspace of session {key}")]
    Workspace {
        key: ExecutionKey,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to remove the directory {path} of a session")]
    Remove {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("a task of the runtime server failed")]
    Task(#[source] tokio::task::JoinError),
}

// ---------------------------------------------------------------------------------------
// Requests

/// A validated RegisterSession request.
#[derive(Debug, Clone)]
pub struct RegisterSpec {
    pub key: ExecutionKey,
    pub files: Vec<SourceFileSpec>,
    pub env: Vec<(String, String)>,
    /// Identifies the inputs (files and env), for idempotent repeats.
    pub digest: [u8; 32],
}

impl RegisterSpec {
    /// Checks files and env with the limits of task executions.
    pub fn new(
        key: ExecutionKey,
        files: Vec<SourceFileSpec>,
        env: Vec<(String, String)>,
        digest: [u8; 32],
    ) -> Result<Self, RequestError> {
        executor::validate_files(&files)?;
        executor::validate_env(&env)?;
        Ok(Self {
            key,
            files,
            env,
            digest,
        })
    }
}

/// What a command runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Program {
    /// Executed directly (`argv[0]` looked up on PATH when it has no '/').
    Argv(Vec<String>),
    /// One line for `bash -c`.
    Shell(String),
}

/// A validated command.
#[derive(Debug, Clone)]
pub struct CommandSpec {
    pub program: Program,
    pub stdin: Vec<u8>,
    /// Relative to the workspace; "" is the workspace.
    pub cwd: String,
    /// Overrides the registered env for this command only.
    pub env: Vec<(String, String)>,
}

impl CommandSpec {
    /// Checks exactly one of `argv` and `shell`, and every bound of `runtime.proto`'s
    /// `Command`.
    pub fn new(
        argv: Vec<String>,
        shell: String,
        stdin: Vec<u8>,
        cwd: String,
        env: Vec<(String, String)>,
    ) -> Result<Self, SessionError> {
        let invalid = |detail: String| SessionError::Invalid {
            what: "command",
            detail,
        };
        let program = match (argv.is_empty(), shell.is_empty()) {
            (false, true) => {
                if argv.len() > MAX_ARGV {
                    return Err(invalid(format!("argv has more than {MAX_ARGV} arguments")));
                }
                if argv.iter().map(String::len).sum::<usize>() > MAX_COMMAND_BYTES {
                    return Err(invalid(format!(
                        "argv exceeds {MAX_COMMAND_BYTES} bytes together"
                    )));
                }
                if argv.iter().any(|a| a.contains('\0')) || argv[0].is_empty() {
                    return Err(invalid(
                        "argv[0] is empty or an argument contains NUL".to_owned(),
                    ));
                }
                Program::Argv(argv)
            }
            (true, false) => {
                if shell.len() > MAX_COMMAND_BYTES || shell.contains('\0') {
                    return Err(invalid(format!(
                        "shell is over {MAX_COMMAND_BYTES} bytes or contains NUL"
                    )));
                }
                Program::Shell(shell)
            }
            (true, true) => return Err(invalid("one of argv or shell is required".to_owned())),
            (false, false) => return Err(invalid("argv and shell exclude each other".to_owned())),
        };
        if stdin.len() > MAX_STDIN_BYTES {
            return Err(invalid(format!(
                "stdin is {} bytes, more than {MAX_STDIN_BYTES}",
                stdin.len()
            )));
        }
        paths::validate_path("cwd", &cwd, true)?;
        paths::validate_command_env(&env)?;
        Ok(Self {
            program,
            stdin,
            cwd,
            env,
        })
    }
}

/// One mutation.
#[derive(Debug, Clone)]
pub enum OperationKind {
    Command(CommandSpec),
    WriteFile {
        path: String,
        content: Vec<u8>,
        executable: bool,
    },
    MakeDirectory {
        path: String,
        parents: bool,
    },
    Delete {
        path: String,
        recursive: bool,
    },
    Rename {
        from: String,
        to: String,
    },
}

impl OperationKind {
    /// Checks the paths and the bounds of a file operation (commands are checked by
    /// [`CommandSpec::new`]).
    pub fn validate(&self) -> Result<(), SessionError> {
        match self {
            OperationKind::Command(_) => Ok(()),
            OperationKind::WriteFile { path, content, .. } => {
                paths::validate_path("path", path, false)?;
                if content.len() > files::MAX_FILE_BYTES {
                    return Err(SessionError::Invalid {
                        what: "write_file",
                        detail: format!(
                            "content is {} bytes, more than {}",
                            content.len(),
                            files::MAX_FILE_BYTES
                        ),
                    });
                }
                Ok(())
            }
            OperationKind::MakeDirectory { path, .. } | OperationKind::Delete { path, .. } => {
                Ok(paths::validate_path("path", path, false)?)
            }
            OperationKind::Rename { from, to } => {
                paths::validate_path("from", from, false)?;
                Ok(paths::validate_path("to", to, false)?)
            }
        }
    }

    fn name(&self) -> &'static str {
        match self {
            OperationKind::Command(_) => "command",
            OperationKind::WriteFile { .. } => "write_file",
            OperationKind::MakeDirectory { .. } => "make_directory",
            OperationKind::Delete { .. } => "delete",
            OperationKind::Rename { .. } => "rename",
        }
    }
}

/// A validated StreamSessionOperation request.
#[derive(Debug, Clone)]
pub struct OperationSpec {
    pub key: ExecutionKey,
    pub operation_id: String,
    pub kind: OperationKind,
    pub timeout: Duration,
}

impl OperationSpec {
    /// Checks the operation ID, the operation and the timeout (absent or zero: the
    /// maximum; more than [`MAX_OPERATION_TIMEOUT`] is refused).
    pub fn new(
        key: ExecutionKey,
        operation_id: String,
        kind: OperationKind,
        timeout: Option<Duration>,
    ) -> Result<Self, SessionError> {
        paths::validate_operation_id(&operation_id)?;
        kind.validate()?;
        let timeout = timeout
            .filter(|t| !t.is_zero())
            .unwrap_or(MAX_OPERATION_TIMEOUT);
        if timeout > MAX_OPERATION_TIMEOUT {
            return Err(SessionError::Invalid {
                what: "timeout",
                detail: format!("must be at most {} s", MAX_OPERATION_TIMEOUT.as_secs()),
            });
        }
        Ok(Self {
            key,
            operation_id,
            kind,
            timeout,
        })
    }
}

// ---------------------------------------------------------------------------------------
// Results

/// Where a session is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionState {
    Registering,
    Ready,
    Closing,
    Closed,
    Failed,
}

impl std::fmt::Display for SessionState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SessionState::Registering => "registering",
            SessionState::Ready => "ready",
            SessionState::Closing => "closing",
            SessionState::Closed => "closed",
            SessionState::Failed => "failed",
        })
    }
}

/// What is known of a session at one moment.
#[derive(Debug, Clone)]
pub struct SessionSnapshot {
    pub key: ExecutionKey,
    pub state: SessionState,
    /// Registered, Registering, Closing, Closed or WorkspaceFailed.
    pub reason: &'static str,
    pub message: String,
    pub running_operation_id: Option<String>,
    pub registered_at: SystemTime,
    pub workspace_dir: PathBuf,
    pub artifacts_dir: PathBuf,
    pub operations: u64,
}

/// Which of a command's output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputStream {
    Stdout,
    Stderr,
}

/// How an operation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperationState {
    Succeeded,
    Failed,
    Cancelled,
    TimedOut,
}

/// What one of a command's streams produced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamTotals {
    /// Every byte the command wrote, sent or not.
    pub bytes: u64,
    /// Whether output was cut at [`MAX_STREAM_BYTES`].
    pub truncated: bool,
}

/// The end of an operation.
#[derive(Debug, Clone)]
pub struct Completion {
    pub state: OperationState,
    /// Completed, NonZeroExitCode, Signaled, StartFailed, Timeout, Cancelled,
    /// SessionClosed, or a file operation's [`FsReason`].
    pub reason: &'static str,
    /// At most [`MAX_MESSAGE_BYTES`]; never command output.
    pub message: String,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub duration: Duration,
    pub stdout: StreamTotals,
    pub stderr: StreamTotals,
}

impl Completion {
    fn new(state: OperationState, reason: &'static str, message: String) -> Self {
        Self {
            state,
            reason,
            message: clip(&message, MAX_MESSAGE_BYTES),
            exit_code: None,
            signal: None,
            duration: Duration::ZERO,
            stdout: StreamTotals::default(),
            stderr: StreamTotals::default(),
        }
    }

    fn succeeded() -> Self {
        Self::new(OperationState::Succeeded, "Completed", String::new())
    }

    fn failed(reason: &'static str, message: String) -> Self {
        Self::new(OperationState::Failed, reason, message)
    }
}

/// One event of an operation, in the order the caller sees them.
#[derive(Debug, Clone)]
pub enum OperationEvent {
    Started,
    Output {
        stream: OutputStream,
        data: Vec<u8>,
        truncated: bool,
    },
    Completed(Completion),
}

/// At most `max` bytes of `s` from its start, cut on a character boundary.
fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

// ---------------------------------------------------------------------------------------
// Sessions

/// What the running operation is told to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Control {
    Run,
    /// The session closes: SIGTERM now, SIGKILL after this grace period.
    Terminate(Duration),
    /// SIGKILL now.
    Kill,
}

struct Info {
    state: SessionState,
    reason: &'static str,
    message: String,
    running: Option<String>,
    operations: u64,
    /// `Capturing` or `Restoring` while a snapshot is taken or restored.
    snapshot: Option<&'static str>,
    /// Uploads and downloads in flight.
    transfers: u32,
    /// Uploads ever begun (a restore needs a session nothing has written to).
    uploads: u64,
    /// A snapshot was restored into the session (a second restore is refused).
    restored: bool,
    /// What its last capture archived (whether its files may be parked at its close).
    captured: Option<parked::Captured>,
}

impl Info {
    /// A snapshot (or parked files) went into the session: a second restore is refused, and
    /// what an earlier capture archived is not what it holds now.
    fn mark_restored(&mut self) {
        self.restored = true;
        self.captured = None;
    }
}

struct Session {
    key: ExecutionKey,
    digest: [u8; 32],
    dir: PathBuf,
    workspace: PathBuf,
    artifacts: PathBuf,
    tmp: PathBuf,
    /// The registered environment, given to every command.
    env: Vec<(String, String)>,
    cgroup: Option<ExecCgroup>,
    /// The `namespaces` sandbox every command runs in (from registration until closing).
    sandbox: Mutex<Option<crate::sandbox::Sandbox>>,
    registered_at: SystemTime,
    info: Mutex<Info>,
    /// Held by the one operation that runs (taken with `try_lock`, so a second fails at
    /// once) and by closing.
    slot: Arc<tokio::sync::Mutex<()>>,
    /// Only moves forward: Run → Terminate → Kill.
    control: watch::Sender<Control>,
    /// The process group of the running command; 0 when none.
    pgid: AtomicU32,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves only plain data behind; keep serving.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Session {
    fn info(&self) -> MutexGuard<'_, Info> {
        lock(&self.info)
    }

    fn snapshot(&self) -> SessionSnapshot {
        let info = self.info();
        SessionSnapshot {
            key: self.key.clone(),
            state: info.state,
            reason: info.reason,
            message: info.message.clone(),
            running_operation_id: info.running.clone(),
            registered_at: self.registered_at,
            workspace_dir: self.workspace.clone(),
            artifacts_dir: self.artifacts.clone(),
            operations: info.operations,
        }
    }

    /// Fails unless the session accepts operations, reads and listings.
    fn ready(&self) -> Result<(), SessionError> {
        let info = self.info();
        match info.state {
            SessionState::Ready => Ok(()),
            state @ (SessionState::Registering
            | SessionState::Closing
            | SessionState::Closed
            | SessionState::Failed) => Err(SessionError::NotReady {
                key: self.key.clone(),
                state,
                reason: info.reason,
            }),
        }
    }

    /// SIGKILL to everything of the session: its cgroup when there is one, and the running
    /// command's process group.
    fn kill_processes(&self) {
        crate::sandbox::isolation::signal_group(
            self.pgid.load(Ordering::SeqCst),
            nix::sys::signal::Signal::SIGKILL,
        );
        if let Some(cgroup) = &self.cgroup
            && let Err(e) = cgroup.kill_all()
        {
            tracing::warn!(session = %self.key, error = %e, "cgroup kill failed");
        }
    }

    /// Waits (at most [`DRAIN_LIMIT`]) for the session's cgroup to empty; whether it did
    /// (`true` without a cgroup). What stays is logged.
    async fn wait_cgroup_empty(&self) -> bool {
        let Some(cgroup) = &self.cgroup else {
            return true;
        };
        match cgroup.wait_empty(DRAIN_LIMIT).await {
            Ok(true) => true,
            Ok(false) => {
                tracing::warn!(session = %self.key, "cgroup still populated after kill");
                false
            }
            Err(e) => {
                tracing::warn!(session = %self.key, error = %e, "cgroup not drained");
                false
            }
        }
    }
}

/// The one operation a session runs; dropping it frees the session for the next one.
struct Running {
    session: Arc<Session>,
    _slot: OwnedMutexGuard<()>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut info = self.session.info();
        info.running = None;
        info.operations += 1;
    }
}

/// A capture or a restore: holds the operation slot, and marks the session so that
/// operations and transfers are refused with its reason; dropping it makes the session
/// READY for them again.
struct Exclusive {
    session: Arc<Session>,
    _slot: OwnedMutexGuard<()>,
}

impl Drop for Exclusive {
    fn drop(&mut self) {
        self.session.info().snapshot = None;
    }
}

/// An upload or a download in flight.
struct InFlight {
    session: Arc<Session>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut info = self.session.info();
        info.transfers = info.transfers.saturating_sub(1);
    }
}

impl Session {
    fn refused(&self, reason: &'static str, detail: impl Into<String>) -> SessionError {
        SessionError::Refused {
            key: self.key.clone(),
            reason,
            detail: detail.into(),
        }
    }

    /// Fails while a snapshot is taken or restored.
    fn check_snapshot(&self, info: &Info, what: &str) -> Result<(), SessionError> {
        match info.snapshot {
            Some(reason) => Err(self.refused(
                reason,
                format!(
                    "{what} is refused while the session's snapshot is {}",
                    reason.to_lowercase()
                ),
            )),
            None => Ok(()),
        }
    }

    /// Records an upload or a download, refused while a snapshot is taken or restored.
    fn begin_transfer(self: &Arc<Self>, upload: bool) -> Result<InFlight, SessionError> {
        let mut info = self.info();
        self.check_snapshot(&info, if upload { "an upload" } else { "a download" })?;
        info.transfers += 1;
        if upload {
            info.uploads += 1;
        }
        Ok(InFlight {
            session: self.clone(),
        })
    }
}

/// Waits until the session is told to stop (closing or shutdown).
async fn stopped(mut control: watch::Receiver<Control>) {
    loop {
        if *control.borrow_and_update() != Control::Run {
            return;
        }
        if control.changed().await.is_err() {
            return;
        }
    }
}

/// Every session of the server.
pub struct Sessions {
    config: SessionsConfig,
    /// `root/sessions`.
    dir: PathBuf,
    /// By Run UID: one attempt each.
    table: Mutex<BTreeMap<String, Arc<Session>>>,
    /// Serialises registering and closing per Run UID.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    accepting: AtomicBool,
    /// The workspaces of suspended sessions kept for a resume here ([`parked`]).
    parked: Arc<parked::ParkedFiles>,
}

impl Sessions {
    /// Takes over `root/sessions`: what a previous server left there is killed (its `ss-*`
    /// cgroups) and removed. The directory is made again by the first registration.
    pub fn new(config: SessionsConfig) -> Result<Arc<Self>, SessionError> {
        let dir = config.root.join("sessions");
        if let Some(parent) = &config.cgroups {
            executor::clean_leftover_cgroups(parent, CGROUP_PREFIX, "session");
        }
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => tracing::warn!(dir = %dir.display(), "removed sessions of a previous server"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(SessionError::Remove { path: dir, source }),
        }
        // Created by the first registration: a server that never holds a session (task
        // mode) writes nothing here.
        Ok(Arc::new(Self {
            config,
            parked: Arc::new(parked::ParkedFiles::new(&dir)),
            dir,
            table: Mutex::new(BTreeMap::new()),
            locks: Mutex::new(HashMap::new()),
            accepting: AtomicBool::new(true),
        }))
    }

    pub fn config(&self) -> &SessionsConfig {
        &self.config
    }

    pub fn accepting(&self) -> bool {
        self.accepting.load(Ordering::SeqCst)
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

    /// Runs `work` under the Run UID's lock, in its own task: a caller that goes away does
    /// not interrupt a registration or a close halfway.
    async fn locked<T, F, Fut>(self: &Arc<Self>, uid: String, work: F) -> Result<T, SessionError>
    where
        T: Send + 'static,
        F: FnOnce(Arc<Self>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<T, SessionError>> + Send + 'static,
    {
        let this = self.clone();
        tokio::spawn(async move {
            let uid_lock = this.uid_lock(&uid);
            let guard = uid_lock.clone().lock_owned().await;
            let result = work(this.clone()).await;
            drop(guard);
            this.release_uid_lock(&uid, uid_lock);
            result
        })
        .await
        .map_err(SessionError::Task)?
    }

    /// The session of exactly `key`: `NotFound` for an unknown Run UID or a higher attempt
    /// than the one held, `StaleAttempt` for a lower one.
    fn find(&self, key: &ExecutionKey) -> Result<Arc<Session>, SessionError> {
        let session = lock(&self.table)
            .get(key.run_uid())
            .cloned()
            .ok_or_else(|| SessionError::NotFound { key: key.clone() })?;
        match session.key.attempt().cmp(&key.attempt()) {
            std::cmp::Ordering::Equal => Ok(session),
            std::cmp::Ordering::Less => Err(SessionError::NotFound { key: key.clone() }),
            std::cmp::Ordering::Greater => Err(SessionError::StaleAttempt {
                key: key.clone(),
                registered: session.key.attempt(),
            }),
        }
    }

    /// Prepares a session and returns once it is READY, or the existing one for the same
    /// identity and inputs.
    ///
    /// Errors: other inputs for a registered identity (`Conflict`), an attempt older than
    /// the registered one (`StaleAttempt`), a closed identity (`NotReady`), shutdown, and a
    /// workspace or cgroup that cannot be prepared (`WorkspaceFailed`: nothing is left on
    /// disk, and the session stays FAILED until it is registered again or purged). A higher
    /// attempt first closes and purges the registered one; a FAILED one is replaced.
    pub async fn register(
        self: &Arc<Self>,
        spec: RegisterSpec,
    ) -> Result<SessionSnapshot, SessionError> {
        let uid = spec.key.run_uid().to_owned();
        self.locked(
            uid,
            move |this| async move { this.register_locked(spec).await },
        )
        .await
    }

    async fn register_locked(&self, spec: RegisterSpec) -> Result<SessionSnapshot, SessionError> {
        if !self.accepting() {
            return Err(SessionError::ShuttingDown);
        }
        let uid = spec.key.run_uid().to_owned();
        let current = lock(&self.table).get(&uid).cloned();
        if let Some(current) = current {
            let state = current.info().state;
            match current.key.attempt().cmp(&spec.key.attempt()) {
                std::cmp::Ordering::Greater => {
                    return Err(SessionError::StaleAttempt {
                        key: spec.key,
                        registered: current.key.attempt(),
                    });
                }
                std::cmp::Ordering::Equal if state == SessionState::Failed => {
                    self.close_locked(&current, Duration::ZERO, true).await?;
                }
                std::cmp::Ordering::Equal if current.digest != spec.digest => {
                    return Err(SessionError::Conflict { key: spec.key });
                }
                std::cmp::Ordering::Equal => {
                    current.ready()?;
                    return Ok(current.snapshot());
                }
                std::cmp::Ordering::Less => {
                    tracing::info!(session = %current.key, attempt = spec.key.attempt(), "a new attempt replaces the session");
                    self.close_locked(&current, self.config.termination_grace, true)
                        .await?;
                }
            }
        }
        let dir = self.dir.join(&uid);
        let session =
            Arc::new(Session {
                key: spec.key.clone(),
                digest: spec.digest,
                workspace: dir.join("workspace"),
                artifacts: dir.join("artifacts"),
                tmp: dir.join("tmp"),
                dir,
                env: spec.env,
                cgroup: self.config.cgroups.as_ref().map(|parent| {
                    parent.child(&format!("{CGROUP_PREFIX}{}", spec.key.component()))
                }),
                sandbox: Mutex::new(None),
                registered_at: SystemTime::now(),
                info: Mutex::new(Info {
                    state: SessionState::Registering,
                    reason: "Registering",
                    message: String::new(),
                    running: None,
                    operations: 0,
                    snapshot: None,
                    transfers: 0,
                    uploads: 0,
                    restored: false,
                    captured: None,
                }),
                slot: Arc::new(tokio::sync::Mutex::new(())),
                control: watch::Sender::new(Control::Run),
                pgid: AtomicU32::new(0),
            });
        lock(&self.table).insert(uid, session.clone());
        let prepared = {
            let session = session.clone();
            let files = spec.files;
            tokio::task::spawn_blocking(move || prepare(&session, &files)).await
        };
        let mut failure = match prepared {
            Ok(Ok(())) => None,
            Ok(Err(message)) => Some(message),
            Err(e) => Some(format!("the preparing task failed: {e}")),
        };
        if failure.is_none()
            && let Some(sandboxes) = &self.config.sandboxes
        {
            let name = format!("{CGROUP_PREFIX}{}", session.key.component());
            let writable = vec![
                session.workspace.clone(),
                session.artifacts.clone(),
                session.tmp.clone(),
            ];
            match sandboxes
                .create(&name, writable, session.cgroup.as_ref())
                .await
            {
                Ok(sandbox) => *lock(&session.sandbox) = Some(sandbox),
                Err(e) => {
                    failure = Some(e.to_string());
                    let _ = remove_path(&session.dir);
                }
            }
        }
        let mut info = session.info();
        match failure {
            None => {
                info.state = SessionState::Ready;
                info.reason = "Registered";
                drop(info);
                tracing::info!(session = %session.key, "registered");
                Ok(session.snapshot())
            }
            Some(message) => {
                let message = clip(&message, MAX_MESSAGE_BYTES);
                tracing::warn!(session = %session.key, error = %message, "registration failed");
                info.state = SessionState::Failed;
                info.reason = "WorkspaceFailed";
                info.message = message.clone();
                drop(info);
                Err(SessionError::WorkspaceFailed {
                    key: session.key.clone(),
                    message,
                })
            }
        }
    }

    /// The session of `key`; `None` when the server holds none for its Run UID, or only a
    /// lower attempt. Errors: `StaleAttempt`.
    pub fn status(&self, key: &ExecutionKey) -> Result<Option<SessionSnapshot>, SessionError> {
        match self.find(key) {
            Ok(session) => Ok(Some(session.snapshot())),
            Err(SessionError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every session, ordered by Run UID.
    pub fn list(&self) -> Vec<SessionSnapshot> {
        lock(&self.table).values().map(|s| s.snapshot()).collect()
    }

    /// Ends the session of `key`'s Run UID when its attempt is at most `key`'s: refuses new
    /// operations, SIGTERM to the running command (its process group and cgroup), waits up
    /// to `grace` (the server's when `None`) for it to end, then SIGKILLs everything of the
    /// session and waits for the cgroup to empty. Without `purge` the directory stays
    /// (CLOSED); with it the directory and the session are removed. Idempotent. Returns
    /// whether a session existed and, unless purged, its status.
    ///
    /// With `purge` and `park` (a capture's digest), the workspace and artifacts are parked
    /// for a resume here instead of removed when the session's last capture archived
    /// exactly them ([`parked`]); with `purge` and no `park`, the Run's parked files are
    /// removed too.
    ///
    /// Errors: a session of a higher attempt (`StaleAttempt`), a directory that cannot be
    /// removed. Runs in its own task.
    pub async fn close(
        self: &Arc<Self>,
        key: ExecutionKey,
        grace: Option<Duration>,
        purge: bool,
        park: Option<String>,
    ) -> Result<(bool, Option<SessionSnapshot>), SessionError> {
        let grace = grace.unwrap_or(self.config.termination_grace);
        let uid = key.run_uid().to_owned();
        self.locked(uid, move |this| async move {
            let current = lock(&this.table).get(key.run_uid()).cloned();
            let Some(session) = current else {
                if purge && park.is_none() {
                    this.forget_parked(key.run_uid()).await;
                }
                return Ok((false, None));
            };
            if session.key.attempt() > key.attempt() {
                return Err(SessionError::StaleAttempt {
                    key,
                    registered: session.key.attempt(),
                });
            }
            if purge {
                this.close_parking(&session, grace, park.as_deref()).await?;
            } else {
                this.close_locked(&session, grace, false).await?;
            }
            Ok((true, (!purge).then(|| session.snapshot())))
        })
        .await
    }

    /// Closes and purges one session, parking its files when `park` names the digest of a
    /// capture that archived exactly them ([`parked`]); without `park`, the Run's parked
    /// files go too. The caller holds its Run UID's lock.
    async fn close_parking(
        &self,
        session: &Arc<Session>,
        grace: Duration,
        park: Option<&str>,
    ) -> Result<(), SessionError> {
        let uid = session.key.run_uid();
        let Some(digest) = park else {
            self.forget_parked(uid).await;
            return self.close_locked(session, grace, true).await;
        };
        // The sandbox's user owns the files (read before closing destroys the sandbox).
        let owner = lock(&session.sandbox).as_ref().map(|s| s.owner());
        // Closed first: nothing runs in it or writes to it once its processes are gone.
        self.close_locked(session, grace, false).await?;
        // Nothing may still write to the files: no operation holds the slot (a close that
        // gave up waiting for one goes on without it), no transfer is in flight, and the
        // session had a sandbox, whose end killed every process it ran (without one, a
        // process that left its process group could outlive the close).
        let slot = session.slot.clone().try_lock_owned().ok();
        let exact = {
            let info = session.info();
            let quiet =
                slot.is_some() && owner.is_some() && info.running.is_none() && info.transfers == 0;
            info.captured
                .as_ref()
                .filter(|c| {
                    quiet
                        && c.digest == digest
                        && c.complete
                        && c.operations == info.operations
                        && c.uploads == info.uploads
                })
                .cloned()
        };
        match exact {
            Some(captured) => {
                // Renames, and a walk that gives every entry to the sandbox's user: off the
                // async threads.
                let parked = self.parked.clone();
                let (run_uid, dir) = (uid.to_owned(), session.dir.clone());
                let files = captured.files;
                let done = tokio::task::spawn_blocking(move || {
                    parked.park(&run_uid, &dir, &captured, owner)
                })
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
                match done {
                    Ok(()) => tracing::info!(session = %session.key, files, "files parked"),
                    Err(e) => {
                        tracing::warn!(session = %session.key, error = %e, "files not parked; removed")
                    }
                }
            }
            None => {
                tracing::info!(session = %session.key, "files not parked: they are not exactly the last capture's");
                self.forget_parked(uid).await;
            }
        }
        drop(slot);
        self.close_locked(session, grace, true).await
    }

    /// Removes the Run's parked files, off the async threads.
    async fn forget_parked(&self, run_uid: &str) {
        let parked = self.parked.clone();
        let run_uid = run_uid.to_owned();
        if let Err(e) = tokio::task::spawn_blocking(move || parked.forget(&run_uid)).await {
            tracing::warn!(error = %e, "parked files not removed");
        }
    }

    /// Closes one session; the caller holds its Run UID's lock.
    async fn close_locked(
        &self,
        session: &Arc<Session>,
        grace: Duration,
        purge: bool,
    ) -> Result<(), SessionError> {
        let stop = {
            let mut info = session.info();
            match info.state {
                SessionState::Registering | SessionState::Ready | SessionState::Closing => {
                    info.state = SessionState::Closing;
                    info.reason = "Closing";
                    true
                }
                SessionState::Closed | SessionState::Failed => false,
            }
        };
        if stop {
            tracing::info!(session = %session.key, grace_ms = grace.as_millis() as u64, "closing");
            session.control.send_if_modified(|c| {
                let run = *c == Control::Run;
                if run {
                    *c = Control::Terminate(grace);
                }
                run
            });
            // The running operation sends SIGTERM, then SIGKILL after `grace`, and frees
            // the slot once its processes are gone.
            let slot = tokio::time::timeout(
                grace.saturating_add(STOP_LIMIT),
                session.slot.clone().lock_owned(),
            )
            .await;
            session.control.send_replace(Control::Kill);
            if slot.is_err() {
                tracing::warn!(session = %session.key, "the running operation did not end; killing everything of the session");
            }
            session.kill_processes();
            let sandbox = lock(&session.sandbox).take();
            if let Some(mut sandbox) = sandbox {
                sandbox.destroy().await;
            }
            if session.wait_cgroup_empty().await
                && let Some(cgroup) = &session.cgroup
                && let Err(e) = cgroup.remove()
            {
                tracing::warn!(session = %session.key, error = %e, "cgroup not removed");
            }
            let mut info = session.info();
            info.state = SessionState::Closed;
            info.reason = "Closed";
            info.message.clear();
            drop(info);
            drop(slot);
            tracing::info!(session = %session.key, "closed");
        } else {
            // A session that failed while Ready (its sandbox was lost) still holds its
            // sandbox's remains (limit cgroups, a gVisor container's state) and its cgroup.
            let sandbox = lock(&session.sandbox).take();
            if let Some(mut sandbox) = sandbox {
                session.kill_processes();
                sandbox.destroy().await;
                if session.wait_cgroup_empty().await
                    && let Some(cgroup) = &session.cgroup
                    && let Err(e) = cgroup.remove()
                {
                    tracing::warn!(session = %session.key, error = %e, "cgroup not removed");
                }
            }
        }
        if purge {
            remove_path(&session.dir).map_err(|source| SessionError::Remove {
                path: session.dir.clone(),
                source,
            })?;
            let mut table = lock(&self.table);
            if table
                .get(session.key.run_uid())
                .is_some_and(|s| Arc::ptr_eq(s, session))
            {
                table.remove(session.key.run_uid());
            }
            drop(table);
            tracing::info!(session = %session.key, "purged");
        }
        Ok(())
    }

    /// Starts one operation and returns its events; the last is `Completed` unless the
    /// caller drops the receiver first, which kills what the operation runs.
    ///
    /// Errors, before anything runs: shutdown, an unknown or stale session, one that is not
    /// READY, and an operation already running (`Busy`).
    pub fn start_operation(
        self: &Arc<Self>,
        spec: OperationSpec,
    ) -> Result<mpsc::Receiver<OperationEvent>, SessionError> {
        if !self.accepting() {
            return Err(SessionError::ShuttingDown);
        }
        let session = self.find(&spec.key)?;
        session.ready()?;
        session.check_snapshot(&session.info(), "an operation")?;
        let slot = session.slot.clone().try_lock_owned().map_err(|_| {
            // A capture or a restore that began meanwhile holds the slot: say so.
            let info = session.info();
            match session.check_snapshot(&info, "an operation") {
                Err(e) => e,
                Ok(()) => SessionError::Busy {
                    key: session.key.clone(),
                    running: info.running.clone().unwrap_or_default(),
                },
            }
        })?;
        {
            // Closing marks the session before it takes the slot: checked again under the
            // same lock that records the operation.
            let mut info = session.info();
            if info.state != SessionState::Ready {
                return Err(SessionError::NotReady {
                    key: session.key.clone(),
                    state: info.state,
                    reason: info.reason,
                });
            }
            info.running = Some(spec.operation_id.clone());
        }
        let running = Running {
            session,
            _slot: slot,
        };
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let this = self.clone();
        tokio::spawn(async move { this.run(running, spec, tx).await });
        Ok(rx)
    }

    async fn run(&self, running: Running, spec: OperationSpec, tx: mpsc::Sender<OperationEvent>) {
        let started = Instant::now();
        let deadline = started + spec.timeout;
        let session = running.session.clone();
        let kind = spec.kind.name();
        let mut completion = if tx.send(OperationEvent::Started).await.is_err() {
            // The caller left before anything ran.
            Completion::new(
                OperationState::Cancelled,
                "Cancelled",
                "the caller went away".to_owned(),
            )
        } else {
            match spec.kind {
                OperationKind::Command(command) => {
                    command::run(
                        &self.config,
                        &session,
                        &spec.operation_id,
                        command,
                        deadline,
                        &tx,
                    )
                    .await
                }
                other => run_file_operation(&session, other, deadline, spec.timeout, &tx).await,
            }
        };
        completion.duration = started.elapsed();
        tracing::info!(
            session = %session.key,
            operation = %spec.operation_id,
            kind,
            state = ?completion.state,
            reason = completion.reason,
            exit_code = ?completion.exit_code,
            duration_ms = completion.duration.as_millis() as u64,
            "operation ended"
        );
        // Free the session first: a caller that sends the next operation as soon as it
        // sees this one complete must not find it still running.
        drop(running);
        let _ = tx.send(OperationEvent::Completed(completion)).await;
    }

    /// Reads one file of the workspace (see [`files::read`]).
    pub async fn read_file(
        &self,
        key: &ExecutionKey,
        path: String,
    ) -> Result<files::FileContent, SessionError> {
        paths::validate_path("path", &path, false)?;
        let session = self.ready_session(key)?;
        self.blocking(&session, move |ws| files::read(ws, &path))
            .await
    }

    /// One page of a workspace directory (see [`files::list`]). `limit` 0 means
    /// [`DEFAULT_LIST_LIMIT`]; more than [`MAX_LIST_LIMIT`] is refused, as is a malformed
    /// token or one made for another directory. Returns the entries and the next token
    /// (empty when no later entry was seen).
    pub async fn list_files(
        &self,
        key: &ExecutionKey,
        dir: String,
        limit: u32,
        page_token: &str,
    ) -> Result<(Vec<files::Entry>, String), SessionError> {
        paths::validate_path("path", &dir, true)?;
        let limit = match limit as usize {
            0 => DEFAULT_LIST_LIMIT,
            n @ 1..=MAX_LIST_LIMIT => n,
            n => {
                return Err(SessionError::Invalid {
                    what: "limit",
                    detail: format!("{n} is not in 1..={MAX_LIST_LIMIT}"),
                });
            }
        };
        let after = if page_token.is_empty() {
            None
        } else {
            Some(cursor::decode(page_token, &dir)?)
        };
        let session = self.ready_session(key)?;
        let listing = {
            let dir = dir.clone();
            self.blocking(&session, move |ws| {
                files::list(ws, &dir, after.as_deref(), limit)
            })
            .await?
        };
        let next = match (listing.more, listing.entries.last()) {
            (true, Some(last)) => cursor::encode(&dir, &last.name),
            _ => String::new(),
        };
        Ok((listing.entries, next))
    }

    /// Receives a whole file (or an archive) into the workspace (see [`transfer::upload`]):
    /// `parts` are the data and the `end` after the header. The upload stops, leaving
    /// nothing, when `parts` fails, ends early or stays silent for
    /// [`TRANSFER_IDLE_TIMEOUT`], and when the session closes. It bypasses the operation
    /// slot: it runs beside commands, as reads do.
    pub async fn upload<S>(
        &self,
        key: &ExecutionKey,
        mut spec: transfer::UploadSpec,
        mut parts: S,
    ) -> Result<transfer::Uploaded, SessionError>
    where
        S: tokio_stream::Stream<Item = Result<transfer::UploadPart, SessionError>>
            + Send
            + Unpin
            + 'static,
    {
        paths::validate_path("path", &spec.path, false)?;
        if spec.max_bytes == 0 {
            spec.max_bytes = transfer::DEFAULT_MAX_BYTES;
        }
        let session = self.ready_session(key)?;
        // Held by the blocking half: a caller that goes away does not end the transfer
        // before its last rename.
        let in_flight = session.begin_transfer(true)?;
        let owner = lock(&session.sandbox).as_ref().map(|s| s.owner());
        let (tx, mut rx) = mpsc::channel(transfer::CHANNEL_CHUNKS);
        let stop = Arc::new(AtomicBool::new(false));
        let workspace = session.workspace.clone();
        let mut task = {
            let stop = stop.clone();
            let key = session.key.clone();
            tokio::task::spawn_blocking(move || {
                let _in_flight = in_flight;
                let ws = files::open_workspace(&workspace)
                    .map_err(|source| SessionError::Workspace { key, source })?;
                transfer::upload(&ws, &spec, &mut rx, &stop, owner).map_err(SessionError::Transfer)
            })
        };
        let pump = pump(&session, &mut parts, &tx, "upload");
        let pumped = tokio::select! {
            joined = &mut task => return joined.map_err(SessionError::Task)?,
            pumped = pump => pumped,
        };
        if pumped.is_some() {
            stop.store(true, Ordering::SeqCst);
        }
        drop(tx);
        let result = task.await.map_err(SessionError::Task)?;
        match (pumped, result) {
            (_, Ok(done)) => Ok(done),
            (Some(why), Err(_)) => Err(why),
            (None, Err(e)) => Err(e),
        }
    }

    /// Streams a whole file (or, with `archive`, a directory as a tar stream; "" is the
    /// workspace) out of the workspace: a header, then data chunks, or one error. The
    /// stream stops when the receiver is dropped or the session closes.
    pub fn download(
        &self,
        key: &ExecutionKey,
        path: String,
        archive: bool,
    ) -> Result<mpsc::Receiver<Result<transfer::DownloadPart, transfer::TransferError>>, SessionError>
    {
        paths::validate_path("path", &path, archive)?;
        let session = self.ready_session(key)?;
        let in_flight = session.begin_transfer(false)?;
        let (tx, rx) = mpsc::channel(transfer::CHANNEL_CHUNKS);
        let stop = Arc::new(AtomicBool::new(false));
        let workspace = session.workspace.clone();
        let mut control = session.control.subscribe();
        // Ends the watcher when the download ends: the watcher's clone of the sender must
        // not keep the stream open after the last chunk.
        let (done, mut finished) = tokio::sync::oneshot::channel::<()>();
        {
            let stop = stop.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                loop {
                    if *control.borrow_and_update() != Control::Run {
                        stop.store(true, Ordering::SeqCst);
                        return;
                    }
                    tokio::select! {
                        _ = &mut finished => return,
                        () = tx.closed() => return,
                        changed = control.changed() => if changed.is_err() { return },
                    }
                }
            });
        }
        tokio::task::spawn_blocking(move || {
            let _done = done;
            let _in_flight = in_flight;
            let result = files::open_workspace(&workspace)
                .map_err(|e| {
                    transfer::TransferError::new(
                        transfer::TransferReason::IoError,
                        format!("the workspace cannot be opened: {e}"),
                    )
                })
                .and_then(|ws| transfer::download(&ws, &path, archive, &tx, &stop));
            if let Err(e) = result
                && e.reason != transfer::TransferReason::Stopped
            {
                let _ = tx.blocking_send(Err(e));
            }
        });
        Ok(rx)
    }

    /// Marks a READY session as capturing or restoring (`what`), holding its operation
    /// slot. Refused (`Refused`, FAILED_PRECONDITION) while an operation, a transfer or
    /// another snapshot runs; with `fresh`, also once the session has run an operation or
    /// taken an upload (`NotFresh`).
    fn begin_snapshot(
        &self,
        key: &ExecutionKey,
        what: &'static str,
        fresh: bool,
    ) -> Result<Exclusive, SessionError> {
        if !self.accepting() {
            return Err(SessionError::ShuttingDown);
        }
        let session = self.find(key)?;
        let verb = what.to_lowercase();
        let not_ready = |info: &Info| {
            session.refused(
                "NotReady",
                format!(
                    "{verb} needs a READY session, not {} ({})",
                    info.state, info.reason
                ),
            )
        };
        {
            let info = session.info();
            if info.state != SessionState::Ready {
                return Err(not_ready(&info));
            }
            session.check_snapshot(&info, &verb)?;
        }
        let slot = session.slot.clone().try_lock_owned().map_err(|_| {
            let info = session.info();
            session
                .check_snapshot(&info, &verb)
                .err()
                .unwrap_or_else(|| {
                    session.refused(
                        "OperationRunning",
                        format!(
                            "{verb} is refused while operation {} runs",
                            info.running.clone().unwrap_or_default()
                        ),
                    )
                })
        })?;
        // Checked again under the lock that records it: closing marks the session before
        // it takes the slot, and transfers do not take the slot at all.
        let mut info = session.info();
        if info.state != SessionState::Ready {
            return Err(not_ready(&info));
        }
        if info.transfers > 0 {
            return Err(session.refused(
                "Transferring",
                format!("{verb} is refused while an upload or a download is in flight"),
            ));
        }
        if fresh && (info.operations > 0 || info.uploads > 0 || info.restored) {
            return Err(session.refused(
                "NotFresh",
                format!(
                    "{verb} needs a freshly registered session; this one has run {} operations, taken {} uploads{}",
                    info.operations,
                    info.uploads,
                    if info.restored { " and a restore" } else { "" }
                ),
            ));
        }
        info.snapshot = Some(what);
        drop(info);
        Ok(Exclusive {
            session,
            _slot: slot,
        })
    }

    /// Captures the session's files (see [`snapshot::capture`]): data chunks, then one
    /// summary, or one error. The capture stops, and the session is READY again, when the
    /// receiver is dropped or the session closes; a receiver that is not read holds it
    /// (the channel is bounded).
    ///
    /// Errors, before anything is read: shutdown, an unknown or stale session, and one
    /// that is not READY, runs an operation or a transfer, or is captured or restored
    /// (`Refused`).
    #[allow(clippy::type_complexity)]
    pub fn capture(
        &self,
        key: &ExecutionKey,
        limits: snapshot::Limits,
    ) -> Result<mpsc::Receiver<Result<snapshot::CapturePart, transfer::TransferError>>, SessionError>
    {
        let exclusive = self.begin_snapshot(key, "Capturing", false)?;
        let (tx, rx) = mpsc::channel(transfer::CHANNEL_CHUNKS);
        let dir = exclusive.session.dir.clone();
        let control = exclusive.session.control.subscribe();
        let runtime = tokio::runtime::Handle::current();
        let key = key.clone();
        // Tells the walk to stop when the session closes (a send stops by itself): ends
        // with the capture, whose guard drops `done`.
        let stop = Arc::new(AtomicBool::new(false));
        let (done, finished) = tokio::sync::oneshot::channel::<()>();
        {
            let stop = stop.clone();
            let control = control.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = finished => {}
                    () = stopped(control) => stop.store(true, Ordering::SeqCst),
                }
            });
        }
        tokio::task::spawn_blocking(move || {
            let _done = done;
            let started = Instant::now();
            // Each chunk waits for room in the channel, for the caller to leave, for the
            // session to close, or TRANSFER_IDLE_TIMEOUT (a caller that stopped reading
            // holds the session in Capturing no longer than that), whichever comes first.
            let send_within = |item: Result<snapshot::CapturePart, transfer::TransferError>| {
                runtime.block_on(async {
                    tokio::select! {
                        sent = tokio::time::timeout(TRANSFER_IDLE_TIMEOUT, tx.send(item)) => match sent {
                            Ok(Ok(())) => Ok(()),
                            Ok(Err(_)) => Err(transfer::TransferError::new(
                                transfer::TransferReason::Stopped,
                                "the caller went away",
                            )),
                            Err(_) => Err(transfer::TransferError::new(
                                transfer::TransferReason::Stopped,
                                format!(
                                    "the caller read nothing for {} s",
                                    TRANSFER_IDLE_TIMEOUT.as_secs()
                                ),
                            )),
                        },
                        () = stopped(control.clone()) => Err(transfer::TransferError::new(
                            transfer::TransferReason::Stopped,
                            "the session closed during the capture",
                        )),
                    }
                })
            };
            let session = exclusive.session.clone();
            // The session leaves Capturing before the caller hears how the capture ended
            // (the summary: every byte was read by then), so a call made on that answer
            // never finds it still capturing; on a failure, once the walk is over.
            let mut exclusive = Some(exclusive);
            let mut send = |part: snapshot::CapturePart| {
                if let snapshot::CapturePart::Summary(summary) = &part {
                    // Recorded before the caller can hear of it: a close that parks the
                    // files on this summary's word finds it.
                    let mut info = session.info();
                    info.captured = Some(parked::Captured {
                        digest: summary.digest.clone(),
                        complete: summary.skipped == 0,
                        operations: info.operations,
                        uploads: info.uploads,
                        files: summary.files,
                        size_bytes: summary.size_bytes,
                    });
                    drop(info);
                    exclusive.take();
                }
                send_within(Ok(part))
            };
            let result = snapshot::capture(&dir, limits, &stop, &mut send);
            drop(exclusive);
            match result {
                Ok(()) => {
                    tracing::info!(session = %key, duration_ms = started.elapsed().as_millis() as u64, "captured");
                }
                Err(e) if e.reason == transfer::TransferReason::Stopped => {
                    tracing::info!(session = %key, error = %e, "capture stopped");
                }
                Err(e) => {
                    tracing::info!(session = %key, error = %e, "capture failed");
                    // Bounded as the chunks are: the error never waits on a stalled caller.
                    let _ = send_within(Err(e));
                }
            }
        });
        Ok(rx)
    }

    /// Restores a snapshot into a freshly registered session (see [`snapshot::restore`]):
    /// `parts` are the data and the `end` after the header. It stops, leaving the session
    /// as it was, when `parts` fails, ends early or stays silent for
    /// [`TRANSFER_IDLE_TIMEOUT`], and when the session closes.
    ///
    /// Errors: those of [`Sessions::capture`], a session that is not fresh (`Refused`,
    /// `NotFresh`), and the snapshot's (`Transfer`: `SnapshotInvalid`,
    /// `InsufficientStorage`, `Stopped`).
    pub async fn restore<S>(
        &self,
        key: &ExecutionKey,
        limits: snapshot::Limits,
        digest: Option<[u8; 32]>,
        mut parts: S,
    ) -> Result<snapshot::Restored, SessionError>
    where
        S: tokio_stream::Stream<Item = Result<transfer::UploadPart, SessionError>>
            + Send
            + Unpin
            + 'static,
    {
        let exclusive = self.begin_snapshot(key, "Restoring", true)?;
        let session = exclusive.session.clone();
        let owner = lock(&session.sandbox).as_ref().map(|s| s.owner());
        let (tx, mut rx) = mpsc::channel(transfer::CHANNEL_CHUNKS);
        let stop = Arc::new(AtomicBool::new(false));
        let mut task = {
            let stop = stop.clone();
            let dir = session.dir.clone();
            tokio::task::spawn_blocking(move || {
                let restored = snapshot::restore(&dir, limits, digest, &mut rx, &stop, owner)
                    .map_err(SessionError::Transfer);
                if restored.is_ok() {
                    exclusive.session.info().mark_restored();
                }
                drop(exclusive);
                restored
            })
        };
        let pump = pump(&session, &mut parts, &tx, "restore");
        let pumped = tokio::select! {
            joined = &mut task => return joined.map_err(SessionError::Task)?,
            pumped = pump => pumped,
        };
        if pumped.is_some() {
            stop.store(true, Ordering::SeqCst);
        }
        drop(tx);
        let result = task.await.map_err(SessionError::Task)?;
        let result = match (pumped, result) {
            (_, Ok(done)) => Ok(done),
            (Some(why), Err(_)) => Err(why),
            (None, Err(e)) => Err(e),
        };
        match result {
            Ok(done) => {
                tracing::info!(session = %session.key, files = done.files, bytes = done.size_bytes, "restored");
                Ok(done)
            }
            Err(SessionError::Transfer(e)) if e.reason == transfer::TransferReason::Incomplete => {
                Err(SessionError::Transfer(transfer::TransferError::new(
                    transfer::TransferReason::SnapshotInvalid,
                    e.message,
                )))
            }
            Err(e) => Err(e),
        }
    }

    /// Restores a freshly registered session from this server's parked files of its Run
    /// that were parked with `digest` ([`parked`]): they are moved into place as a
    /// restore's extracted files are, with no data read.
    ///
    /// Errors: those of [`Sessions::restore`] before anything is read, `Refused` with
    /// reason `NoParkedFiles` when none were parked with that digest for the session's
    /// user (the session stays fresh), and `Transfer` when they cannot be moved (the
    /// session's files are as they were; the parked ones are removed).
    pub async fn restore_parked(
        &self,
        key: &ExecutionKey,
        digest: &str,
    ) -> Result<snapshot::Restored, SessionError> {
        let exclusive = self.begin_snapshot(key, "Restoring", true)?;
        let session = exclusive.session.clone();
        let owner = lock(&session.sandbox).as_ref().map(|s| s.owner());
        let Some((dir, parked)) = self.parked.take(key.run_uid(), digest, owner) else {
            return Err(session.refused(
                "NoParkedFiles",
                format!("this server holds no parked files of the Run with digest {digest}"),
            ));
        };
        let session_dir = session.dir.clone();
        let adopted = tokio::task::spawn_blocking(move || {
            let adopted = snapshot::adopt(&session_dir, &dir, owner);
            if let Err(e) = remove_path(&dir) {
                tracing::warn!(dir = %dir.display(), error = %e, "parked files not removed");
            }
            if adopted.is_ok() {
                exclusive.session.info().mark_restored();
            }
            drop(exclusive);
            adopted
        })
        .await
        .map_err(SessionError::Task)?;
        adopted.map_err(SessionError::Transfer)?;
        tracing::info!(session = %session.key, files = parked.files, bytes = parked.size_bytes, "restored from parked files");
        Ok(snapshot::Restored {
            files: parked.files,
            size_bytes: parked.size_bytes,
        })
    }

    fn ready_session(&self, key: &ExecutionKey) -> Result<Arc<Session>, SessionError> {
        if !self.accepting() {
            return Err(SessionError::ShuttingDown);
        }
        let session = self.find(key)?;
        session.ready()?;
        Ok(session)
    }

    /// Runs a file call on the workspace off the async threads.
    async fn blocking<T: Send + 'static>(
        &self,
        session: &Session,
        work: impl FnOnce(&cap_std::fs::Dir) -> Result<T, FsError> + Send + 'static,
    ) -> Result<T, SessionError> {
        let workspace = session.workspace.clone();
        let key = session.key.clone();
        tokio::task::spawn_blocking(move || {
            let ws = files::open_workspace(&workspace)
                .map_err(|source| SessionError::Workspace { key, source })?;
            work(&ws).map_err(SessionError::File)
        })
        .await
        .map_err(SessionError::Task)?
    }

    /// Stops accepting work and closes and purges every session, within `limit`.
    pub async fn shutdown(&self, limit: Duration) {
        self.accepting.store(false, Ordering::SeqCst);
        let mut uids: BTreeSet<String> = lock(&self.table).keys().cloned().collect();
        uids.extend(lock(&self.locks).keys().cloned());
        let deadline = Instant::now() + limit;
        for uid in uids {
            let close = async {
                let uid_lock = self.uid_lock(&uid);
                let guard = uid_lock.clone().lock_owned().await;
                let current = lock(&self.table).get(&uid).cloned();
                if let Some(session) = current
                    && let Err(e) = self
                        .close_locked(&session, self.config.termination_grace, true)
                        .await
                {
                    tracing::warn!(session = %session.key, error = %e, "not removed at shutdown");
                }
                drop(guard);
                self.release_uid_lock(&uid, uid_lock);
            };
            if tokio::time::timeout_at(deadline, close).await.is_err() {
                tracing::warn!("sessions not all closed before the shutdown deadline");
                break;
            }
        }
    }
}

/// Feeds the parts of an upload (or a restore: `what`) to its blocking half through `tx`,
/// until they end (`None`), fail, stay silent for [`TRANSFER_IDLE_TIMEOUT`] or the session
/// closes (the error), or the blocking half stops taking them (`None`).
async fn pump<S, P>(
    session: &Session,
    parts: &mut S,
    tx: &mpsc::Sender<P>,
    what: &str,
) -> Option<SessionError>
where
    S: tokio_stream::Stream<Item = Result<P, SessionError>> + Unpin,
{
    use tokio_stream::StreamExt as _;
    let mut control = session.control.subscribe();
    loop {
        if *control.borrow_and_update() != Control::Run {
            return Some(SessionError::Transfer(transfer::TransferError::new(
                transfer::TransferReason::Stopped,
                format!("the session closed during the {what}"),
            )));
        }
        let next = tokio::select! {
            next = tokio::time::timeout(TRANSFER_IDLE_TIMEOUT, parts.next()) => next,
            changed = control.changed() => {
                if changed.is_err() {
                    return None;
                }
                continue;
            }
        };
        match next {
            Err(_) => {
                return Some(SessionError::Transfer(transfer::TransferError::new(
                    transfer::TransferReason::Incomplete,
                    format!(
                        "the {what} sent nothing for {} s",
                        TRANSFER_IDLE_TIMEOUT.as_secs()
                    ),
                )));
            }
            Ok(None) => return None,
            Ok(Some(Err(e))) => return Some(e),
            Ok(Some(Ok(part))) => {
                if tx.send(part).await.is_err() {
                    return None;
                }
            }
        }
    }
}

/// Creates the session's directory (a leftover of an earlier attempt is removed first),
/// writes the files into the workspace and creates the cgroup; on failure removes what it
/// made and returns why.
fn prepare(session: &Session, files: &[SourceFileSpec]) -> Result<(), String> {
    let result = (|| -> Result<(), String> {
        let at = |path: &Path| {
            let path = path.to_owned();
            move |e: std::io::Error| format!("failed to prepare {}: {e}", path.display())
        };
        remove_path(&session.dir).map_err(at(&session.dir))?;
        if let Some(sessions) = session.dir.parent() {
            std::fs::create_dir_all(sessions).map_err(at(sessions))?;
        }
        std::fs::create_dir(&session.dir).map_err(at(&session.dir))?;
        for dir in [&session.workspace, &session.artifacts, &session.tmp] {
            std::fs::create_dir(dir).map_err(at(dir))?;
        }
        executor::write_sources(&session.workspace, files).map_err(at(&session.workspace))?;
        if let Some(cgroup) = &session.cgroup {
            cgroup.create().map_err(|e| {
                format!(
                    "failed to prepare the cgroup: {}",
                    crate::tasks::service::chain(&e)
                )
            })?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = remove_path(&session.dir);
        if let Some(cgroup) = &session.cgroup {
            let _ = cgroup.remove();
        }
    }
    result
}

/// Removes whatever is at `path` (a directory with everything beneath it, without
/// following symlinks); nothing there, or a parent that is not a directory, is success.
fn remove_path(path: &Path) -> std::io::Result<()> {
    let result = match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) => Err(e),
    };
    match result {
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                || e.raw_os_error() == Some(nix::libc::ENOTDIR) =>
        {
            Ok(())
        }
        result => result,
    }
}

/// Runs a file operation off the async threads; a timeout, a close or a caller that goes
/// away stops a recursive delete between two entries (the other calls are single system
/// calls and finish).
async fn run_file_operation(
    session: &Arc<Session>,
    kind: OperationKind,
    deadline: Instant,
    timeout: Duration,
    tx: &mpsc::Sender<OperationEvent>,
) -> Completion {
    let stop = Arc::new(AtomicBool::new(false));
    let workspace = session.workspace.clone();
    // In a sandbox, what the server creates belongs to the sandbox user, who must be able
    // to change it.
    let owner = lock(&session.sandbox).as_ref().map(|s| s.owner());
    let mut task = {
        let stop = stop.clone();
        tokio::task::spawn_blocking(move || -> Result<(), FsError> {
            let ws = files::open_workspace(&workspace).map_err(|e| FsError {
                reason: FsReason::IoError,
                path: String::new(),
                detail: Some(ids::bounded(&format!(
                    "the workspace cannot be opened: {e}"
                ))),
            })?;
            match kind {
                OperationKind::WriteFile {
                    path,
                    content,
                    executable,
                } => files::write(&ws, &path, &content, executable, owner),
                OperationKind::MakeDirectory { path, parents } => {
                    files::make_directory(&ws, &path, parents, owner)
                }
                OperationKind::Delete { path, recursive } => {
                    files::delete(&ws, &path, recursive, &stop)
                }
                OperationKind::Rename { from, to } => files::rename(&ws, &from, &to),
                // Commands never come here.
                OperationKind::Command(_) => Ok(()),
            }
        })
    };
    let mut control = session.control.subscribe();
    let mut stopped_by: Option<(OperationState, &'static str, String)> = None;
    let mut control_open = true;
    let joined = loop {
        if stopped_by.is_none() && *control.borrow_and_update() != Control::Run {
            stop.store(true, Ordering::SeqCst);
            stopped_by = Some((
                OperationState::Cancelled,
                "SessionClosed",
                "the session was closed".to_owned(),
            ));
        }
        tokio::select! {
            joined = &mut task => break joined,
            () = tokio::time::sleep_until(deadline), if stopped_by.is_none() => {
                stop.store(true, Ordering::SeqCst);
                stopped_by = Some((
                    OperationState::TimedOut,
                    "Timeout",
                    format!("exceeded its timeout of {:.3} s", timeout.as_secs_f64()),
                ));
            }
            changed = control.changed(), if control_open => control_open = changed.is_ok(),
            () = tx.closed(), if stopped_by.is_none() => {
                stop.store(true, Ordering::SeqCst);
                stopped_by = Some((
                    OperationState::Cancelled,
                    "Cancelled",
                    "the caller went away".to_owned(),
                ));
            }
        }
    };
    match joined {
        Ok(Ok(())) => Completion::succeeded(),
        Ok(Err(e)) if e.reason == FsReason::Stopped => match stopped_by {
            Some((state, reason, message)) => Completion::new(state, reason, message),
            None => Completion::new(OperationState::Cancelled, "Cancelled", e.to_string()),
        },
        Ok(Err(e)) => Completion::failed(e.reason.as_str(), e.to_string()),
        Err(e) => {
            tracing::error!(session = %session.key, error = %e, "file operation task failed");
            Completion::failed("IoError", "the file operation failed".to_owned())
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn key() -> ExecutionKey {
        ExecutionKey::new("2c24c1f0-9f8f-4f80-82d5-3dd16a12d1e6", 1).unwrap()
    }

    #[test]
    fn commands_need_exactly_one_program() {
        let cmd = |argv: &[&str], shell: &str| {
            CommandSpec::new(
                argv.iter().map(|s| (*s).to_owned()).collect(),
                shell.to_owned(),
                Vec::new(),
                String::new(),
                Vec::new(),
            )
        };
        assert_eq!(
            cmd(&["ls", "-l"], "").unwrap().program,
            Program::Argv(vec!["ls".into(), "-l".into()])
        );
        assert_eq!(
            cmd(&[], "echo hi").unwrap().program,
            Program::Shell("echo hi".into())
        );
        assert!(cmd(&[], "").is_err());
        assert!(cmd(&["ls"], "ls").is_err());
        assert!(cmd(&[""], "").is_err());
        assert!(cmd(&["a\0b"], "").is_err());
        assert!(cmd(&[], "a\0").is_err());
        let many: Vec<&str> = vec!["x"; MAX_ARGV + 1];
        assert!(cmd(&many, "").is_err());
        assert!(cmd(&[], &"x".repeat(MAX_COMMAND_BYTES + 1)).is_err());
        let big_stdin = CommandSpec::new(
            vec!["cat".into()],
            String::new(),
            vec![0; MAX_STDIN_BYTES + 1],
            String::new(),
            Vec::new(),
        );
        assert!(big_stdin.is_err());
        let bad_cwd = CommandSpec::new(
            vec!["ls".into()],
            String::new(),
            Vec::new(),
            "../x".into(),
            Vec::new(),
        );
        assert!(matches!(bad_cwd, Err(SessionError::Path(_))));
    }

    #[test]
    fn operations_check_ids_paths_and_timeouts() {
        let write = |path: &str, size: usize| OperationKind::WriteFile {
            path: path.to_owned(),
            content: vec![0; size],
            executable: false,
        };
        let spec = OperationSpec::new(key(), "op-1".into(), write("a", 1), None).unwrap();
        assert_eq!(spec.timeout, MAX_OPERATION_TIMEOUT);
        let spec =
            OperationSpec::new(key(), "op-1".into(), write("a", 1), Some(Duration::ZERO)).unwrap();
        assert_eq!(spec.timeout, MAX_OPERATION_TIMEOUT);
        assert!(
            OperationSpec::new(
                key(),
                "op-1".into(),
                write("a", 1),
                Some(MAX_OPERATION_TIMEOUT + Duration::from_millis(1))
            )
            .is_err()
        );
        assert!(OperationSpec::new(key(), "op 1".into(), write("a", 1), None).is_err());
        assert!(OperationSpec::new(key(), "op".into(), write("../a", 1), None).is_err());
        assert!(
            OperationSpec::new(
                key(),
                "op".into(),
                write("a", files::MAX_FILE_BYTES + 1),
                None
            )
            .is_err()
        );
        let rename = |from: &str, to: &str| OperationKind::Rename {
            from: from.to_owned(),
            to: to.to_owned(),
        };
        assert!(rename("a", "b").validate().is_ok());
        assert!(rename("a", "/b").validate().is_err());
        assert!(rename("a/", "b").validate().is_err());
        let mkdir = OperationKind::MakeDirectory {
            path: String::new(),
            parents: true,
        };
        assert!(mkdir.validate().is_err());
    }

    #[test]
    fn clipping_keeps_char_boundaries() {
        assert_eq!(clip("héllo", 2), "h");
        assert_eq!(clip("short", 10), "short");
    }
}
