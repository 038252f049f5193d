//! Function registrations and their invocations (design document 000, "Runtime Server
//! Boundary"; the `FunctionRuntime` service of `runtime.proto`).
//!
//! Owns the table of registrations keyed by Run UID (one generation per Run UID), each
//! registration's workspace `ROOT/functions/<run-uid>/<attempt>/`, its cgroup
//! `fn-<run-uid>-<attempt>` and its adapter: for python one persistent interpreter that
//! imports the handler once and answers invocations over two pipes (the launcher,
//! `launcher.py`, is embedded in the binary), for bash one `bash HANDLER` per
//! invocation with the request on stdin. It enforces one invocation in flight per
//! registration, the bounds of requests and results, invocation timeouts (a python
//! interpreter that times out or dies is killed with its whole cgroup and restarted before
//! the next invocation), and unregistering (kill everything, remove the workspace). It
//! knows nothing of gRPC, never retries an invocation and never queues one.
//!
//! This module holds the table, the requests' validation and the registration lifecycle;
//! the submodule `python` the persistent interpreter, its launcher and the frames they
//! exchange; the submodule `bash` the per-invocation script runs.
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
//! The python adapter keeps one warm spare (submodule `spare`) from its first registration
//! on: a launcher already started in `ROOT/functions/spare/` and its own cgroup
//! `fn-spare`, which a registration takes instead of starting an interpreter unless its
//! env sets a variable that only takes effect at interpreter start (`spare_eligible`);
//! anything that goes wrong before the handler's code runs falls back to starting one.
//! Restarts after a timeout or a death always start their own.
//!
//! `ROOT/functions` is not a Run UID, so the task executor's recovery skips it.
//! Registrations do not survive a server restart: at startup everything under
//! `ROOT/functions` is removed and every leftover `fn-*` cgroup (the spare's included) is
//! killed.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use nix::sys::signal::Signal;
use serde::de::IgnoredAny;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::ids::{self, ExecutionKey};
use crate::interpreter::Adapter;
use crate::logs::{self, Tail};
use crate::sandbox::Sandbox;
use crate::sandbox::cgroup::{CgroupError, CgroupParent, ExecCgroup};
use crate::sandbox::isolation::{self, Place, SpawnError};
use crate::tasks::executor::{self, RequestError, SourceFileSpec};

mod bash;
mod python;
pub mod service;
mod spare;

use python::{BindError, LoadError, LogFiles, PythonState};
use spare::{Spare, SparePool};

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
/// The most invocations one registration runs at once (its interpreters).
pub const MAX_CONCURRENCY: u32 = 64;
/// An invocation may take this long unless the request says otherwise.
pub const DEFAULT_INVOKE_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest invocation timeout accepted.
pub const MAX_INVOKE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long to wait for killed processes to end and their cgroup to empty.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);
/// How long unregistering waits for an in-flight invocation to notice and end.
const STOP_LIMIT: Duration = Duration::from_secs(10);
/// Each registration's cgroup is `fn-<run-uid>-<attempt>` under the server's parent.
const CGROUP_PREFIX: &str = "fn-";

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
    /// The `namespaces` backend; `None`: the `process` backend.
    pub sandboxes: Option<std::sync::Arc<crate::sandbox::Sandboxes>>,
}

/// A validated RegisterFunction request.
#[derive(Debug, Clone)]
pub struct RegisterSpec {
    pub key: ExecutionKey,
    pub files: Vec<SourceFileSpec>,
    pub handler: String,
    pub env: Vec<(String, String)>,
    pub load_timeout: Duration,
    /// How many invocations may run at once: 1 to [`MAX_CONCURRENCY`].
    pub concurrency: usize,
    /// Identifies the configuration (files, handler, env, concurrency), for idempotent
    /// repeats.
    pub digest: [u8; 32],
}

impl RegisterSpec {
    /// Validates every untrusted part with the limits of task executions (files, env) and
    /// the adapter's handler syntax. `digest` must identify the configuration.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        key: ExecutionKey,
        files: Vec<SourceFileSpec>,
        handler: String,
        env: Vec<(String, String)>,
        load_timeout: Option<Duration>,
        concurrency: u32,
        adapter: Adapter,
        digest: [u8; 32],
    ) -> Result<Self, RequestError> {
        let paths = executor::validate_files(&files)?;
        validate_handler(adapter, &handler, &paths)?;
        executor::validate_env(&env)?;
        if concurrency > MAX_CONCURRENCY {
            return Err(RequestError::Invalid {
                what: "concurrency",
                detail: format!("is {concurrency}, more than {MAX_CONCURRENCY}"),
            });
        }
        Ok(Self {
            key,
            files,
            handler,
            env,
            load_timeout: load_timeout
                .filter(|t| !t.is_zero())
                .unwrap_or(DEFAULT_LOAD_TIMEOUT)
                .min(MAX_LOAD_TIMEOUT),
            concurrency: concurrency.max(1) as usize,
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

/// Whether a registration with the request's `env` may take the warm spare: not when it
/// sets a variable that only an interpreter's start reads (`PYTHON*` other than
/// `PYTHONPATH`, which the launcher applies itself, and the locale, which decides the
/// encoding of stdio and file names).
fn spare_eligible(env: &[(String, String)]) -> bool {
    !env.iter().any(|(name, _)| {
        (name.starts_with("PYTHON") && name != "PYTHONPATH")
            || name == "LANG"
            || name.starts_with("LC_")
    })
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
    /// Invocations running now: 0 to the registration's concurrency.
    pub in_flight: u32,
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
    #[error("registration {id} has {slots} invocation(s) in flight, its concurrency")]
    Busy { id: String, slots: usize },
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
    #[error("the sandbox of registration {key} failed: {message}")]
    Sandbox { key: ExecutionKey, message: String },
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
// Registrations

struct Info {
    state: FunctionState,
    reason: &'static str,
    message: String,
    in_flight: u32,
    last_activity: SystemTime,
    invocations: u64,
    unregistering: bool,
}

fn empty_tail() -> Tail {
    Tail {
        data: Vec::new(),
        truncated: false,
        total_bytes: 0,
    }
}

enum AdapterState {
    /// A bash process per invocation; the slot's index.
    Bash(usize),
    Python(Box<PythonState>),
}

/// Counts one invocation in flight from [`InFlight::start`] until it is dropped (also when
/// the invocation's task panics), which also marks the registration's last activity.
struct InFlight(Arc<Registration>);

impl InFlight {
    fn start(registration: Arc<Registration>) -> InFlight {
        {
            let mut info = registration.info();
            info.in_flight += 1;
            info.invocations += 1;
        }
        InFlight(registration)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut info = self.0.info();
        info.in_flight = info.in_flight.saturating_sub(1);
        info.last_activity = SystemTime::now();
    }
}

/// One of a registration's `concurrency` places for an invocation.
struct Slot {
    /// Held by the invocation the slot serves (taken with `try_lock`, so that an
    /// invocation finding every slot held fails at once) and by unregistering.
    adapter: Arc<tokio::sync::Mutex<AdapterState>>,
    /// The process group of the slot's interpreter or bash invocation; 0 when none.
    pgid: AtomicU32,
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
    /// Whether the registration's programs run in a `namespaces` sandbox.
    sandboxed: bool,
    /// That sandbox, from registration until the registration is destroyed.
    sandbox: Mutex<Option<Sandbox>>,
    registered_at: SystemTime,
    info: Mutex<Info>,
    /// The places for invocations; at least one.
    slots: Vec<Slot>,
    /// Becomes true once, when the registration is unregistered or the server stops.
    stop: watch::Sender<bool>,
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

    /// SIGKILL to everything of the registration: the cgroup when there is one, else every
    /// slot's process group.
    fn kill_processes(&self) {
        match &self.cgroup {
            Some(cgroup) => {
                if let Err(e) = cgroup.kill_all() {
                    tracing::warn!(registration = %self.id, error = %e, "cgroup kill failed");
                }
            }
            None => {
                for slot in &self.slots {
                    isolation::signal_group(slot.pgid.load(Ordering::SeqCst), Signal::SIGKILL);
                }
            }
        }
    }

    /// SIGKILL to what the slot's interpreter or invocation started. With a single slot
    /// that is everything of the registration ([`Self::kill_processes`]: also a process
    /// that left the slot's process group). With more, only the slot's process group: the
    /// other slots' invocations go on, and a process that left the group lives until the
    /// registration ends.
    fn kill_slot(&self, slot: usize) {
        if self.slots.len() == 1 {
            self.kill_processes();
        } else if let Some(slot) = self.slots.get(slot) {
            isolation::signal_group(slot.pgid.load(Ordering::SeqCst), Signal::SIGKILL);
        }
    }

    /// After [`Self::kill_slot`] and the reaping of the slot's process: forgets its group
    /// and, with a single slot, waits for the cgroup to empty.
    async fn slot_killed(&self, slot: usize) {
        if let Some(slot) = self.slots.get(slot) {
            slot.pgid.store(0, Ordering::SeqCst);
        }
        if self.slots.len() == 1 {
            self.wait_cgroup_empty().await;
        }
    }

    /// Records the process group of what the slot runs now.
    fn set_slot_group(&self, slot: usize, pgid: u32) {
        if let Some(slot) = self.slots.get(slot) {
            slot.pgid.store(pgid, Ordering::SeqCst);
        }
    }

    /// Waits (at most [`DRAIN_LIMIT`]) for the registration's cgroup to empty after a kill;
    /// whether it did (`false` without a cgroup). What stays is logged.
    async fn wait_cgroup_empty(&self) -> bool {
        let Some(cgroup) = &self.cgroup else {
            return false;
        };
        match cgroup.wait_empty(DRAIN_LIMIT).await {
            Ok(true) => true,
            Ok(false) => {
                tracing::warn!(registration = %self.id, "cgroup still populated after kill");
                false
            }
            Err(e) => {
                tracing::warn!(registration = %self.id, error = %e, "cgroup not drained");
                false
            }
        }
    }

    /// Where the registration's programs start.
    fn place(&self) -> Result<Place, FunctionError> {
        match lock(&self.sandbox).as_ref() {
            Some(sandbox) => sandbox
                .enter(&self.work)
                .map_err(|e| FunctionError::Sandbox {
                    key: self.key.clone(),
                    message: e.0,
                }),
            None if self.sandboxed => Err(FunctionError::Sandbox {
                key: self.key.clone(),
                message: "the sandbox is gone".to_owned(),
            }),
            None => Ok(Place::Host),
        }
    }

    /// How many processes the OOM killer has ended in the registration's sandbox.
    fn oom_kills(&self) -> u64 {
        lock(&self.sandbox).as_ref().map_or(0, Sandbox::oom_kills)
    }

    /// Why the handler's process ended, when the OOM killer ended it.
    fn oom_message(&self) -> String {
        lock(&self.sandbox).as_ref().map_or_else(
            || "the out-of-memory killer ended a process of the handler".to_owned(),
            |s| s.oom_message("handler"),
        )
    }

    /// Runs one invocation on the adapter the caller holds.
    async fn invoke(
        &self,
        adapter: &mut AdapterState,
        spec: &InvokeSpec,
    ) -> Result<Invocation, FunctionError> {
        let mut stop = self.stop.subscribe();
        let oom_before = self.oom_kills();
        // Taken now, so that it names the sandbox kernel this invocation ran in: one that a
        // concurrent invocation has already replaced is not replaced again.
        let revival = lock(&self.sandbox).as_ref().and_then(Sandbox::revival);
        let mut invocation = match adapter {
            AdapterState::Bash(slot) => self.invoke_bash(*slot, spec, &mut stop).await,
            AdapterState::Python(state) => self.invoke_python(state, spec, &mut stop).await,
        }?;
        // With several slots, another slot's process may be the one the OOM killer ended:
        // only an invocation whose own process died (not one whose handler raised or
        // timed out) is the OOM killer's.
        let own_process_died = self.slots.len() == 1
            || invocation.error.as_ref().is_some_and(|e| {
                matches!(e.kind.as_str(), "InterpreterExited" | "NonZeroExitCode")
            });
        if invocation.outcome != Outcome::Succeeded
            && own_process_died
            && self.oom_kills() > oom_before
        {
            // The OOM killer ended the invocation's process (the bash script, or the
            // python interpreter, which the next invocation starts again).
            invocation.error = Some(InvocationError::new("OOMKilled", self.oom_message()));
            // Under gvisor the OOM killer ends the whole sandbox kernel: the next
            // invocation gets a new one (the workspace is the same host directory).
            if let Some(revival) = revival
                && let Err(e) = revival.revive().await
            {
                tracing::warn!(registration = %self.id, error = %e, "the sandbox could not be replaced");
            }
        }
        Ok(invocation)
    }

    /// Loads the handler in one slot's interpreter: binds `spare` when given (falling back
    /// to a new interpreter when the spare cannot be bound), else starts one.
    async fn load_python(
        &self,
        state: &mut PythonState,
        spare: Option<Spare>,
    ) -> Result<(), LoadError> {
        let mut stop = self.stop.subscribe();
        let limit = self.load_timeout;
        let bound = match spare {
            Some(spare) => match self.bind_python(spare, &state.logs, limit, &mut stop).await {
                Ok(worker) => Some(Ok(worker)),
                Err(BindError::Load(e)) => Some(Err(e)),
                Err(BindError::Fallback(detail)) => {
                    tracing::debug!(registration = %self.id, %detail, "the spare was not bound; starting an interpreter");
                    None
                }
            },
            None => None,
        };
        let worker = match bound {
            Some(result) => result?,
            None => self.start_python(&state.logs, limit, &mut stop).await?,
        };
        state.worker = Some(worker);
        Ok(())
    }

    /// Takes every slot, waiting for its invocation to end, and kills its interpreter.
    async fn kill_workers(&self) {
        for slot in &self.slots {
            let mut adapter = slot.adapter.lock().await;
            if let AdapterState::Python(state) = &mut *adapter {
                self.kill_worker(state.worker.take(), None).await;
            }
        }
    }

    /// Kills everything of the registration and removes its cgroup and workspace.
    async fn destroy(&self) -> Result<(), FunctionError> {
        self.kill_processes();
        let sandbox = lock(&self.sandbox).take();
        if let Some(mut sandbox) = sandbox {
            sandbox.destroy().await;
        }
        if let Some(cgroup) = &self.cgroup
            && self.wait_cgroup_empty().await
            && let Err(e) = cgroup.remove()
        {
            tracing::warn!(registration = %self.id, error = %e, "cgroup not removed");
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
    /// Python only: the warm spare.
    spares: Option<Arc<SparePool>>,
}

impl Functions {
    /// Takes over `root/functions`: what a previous server left there is killed (its
    /// `fn-*` cgroups) and removed.
    pub fn new(config: FunctionsConfig) -> Result<Arc<Self>, FunctionError> {
        let dir = config.root.join("functions");
        if let Some(parent) = &config.cgroups {
            executor::clean_leftover_cgroups(parent, CGROUP_PREFIX, "registration");
        }
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {
                tracing::warn!(dir = %dir.display(), "removed registrations of a previous server")
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(FunctionError::Remove { path: dir, source }),
        }
        // A warm spare starts outside any sandbox, so sandboxed servers keep none.
        let spares = (config.adapter == Adapter::Python && config.sandboxes.is_none()).then(|| {
            SparePool::new(
                config.interpreter.clone(),
                config.path_var.clone(),
                dir.clone(),
                config.cgroups.as_ref(),
            )
        });
        Ok(Arc::new(Self {
            config,
            dir,
            table: Mutex::new(BTreeMap::new()),
            locks: Mutex::new(HashMap::new()),
            loading: Mutex::new(HashMap::new()),
            accepting: AtomicBool::new(true),
            spares,
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
        if let Some(sandboxes) = &self.config.sandboxes {
            let name = format!("{CGROUP_PREFIX}{}", spec.key.component());
            let writable = vec![registration.work.clone(), registration.dir.join("tmp")];
            match sandboxes
                .create(&name, writable, registration.cgroup.as_ref())
                .await
            {
                Ok(sandbox) => *lock(&registration.sandbox) = Some(sandbox),
                Err(e) => {
                    if let Err(cleanup) = registration.destroy().await {
                        tracing::warn!(registration = %registration.id, error = %cleanup, "failed registration not removed");
                    }
                    return Err(FunctionError::Sandbox {
                        key: spec.key,
                        message: e.0,
                    });
                }
            }
        }
        lock(&self.loading).insert(uid.clone(), registration.clone());
        let spare = spare_eligible(&spec.env);
        let loaded = self.load(&registration, spare).await;
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
                registration.kill_workers().await;
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
        let adapters = prepared?;
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
            sandboxed: self.config.sandboxes.is_some(),
            sandbox: Mutex::new(None),
            registered_at: now,
            info: Mutex::new(Info {
                state: FunctionState::Ready,
                reason: "Registered",
                message: String::new(),
                in_flight: 0,
                last_activity: now,
                invocations: 0,
                unregistering: false,
            }),
            slots: adapters
                .into_iter()
                .map(|adapter| Slot {
                    adapter: Arc::new(tokio::sync::Mutex::new(adapter)),
                    pgid: AtomicU32::new(0),
                })
                .collect(),
            stop: watch::Sender::new(false),
        })
    }

    fn prepare_in(
        &self,
        dir: &Path,
        cgroup: Option<&ExecCgroup>,
        spec: &RegisterSpec,
    ) -> Result<Vec<AdapterState>, FunctionError> {
        executor::create_workspace(dir, &spec.files)
            .map_err(|(path, source)| FunctionError::Workspace { path, source })?;
        if let Some(cgroup) = cgroup {
            cgroup.create().map_err(|source| FunctionError::Cgroup {
                key: spec.key.clone(),
                source,
            })?;
        }
        (0..spec.concurrency)
            .map(|slot| {
                Ok(match self.config.adapter {
                    Adapter::Bash => AdapterState::Bash(slot),
                    Adapter::Python => AdapterState::Python(Box::new(PythonState {
                        worker: None,
                        logs: LogFiles::create(dir, slot).map_err(|source| {
                            FunctionError::Workspace {
                                path: dir.to_owned(),
                                source,
                            }
                        })?,
                    })),
                })
            })
            .collect()
    }

    /// Python: loads the handler in every slot's interpreter, all at once, and waits for
    /// them all. The first slot takes the warm spare when `spare_eligible` and one is
    /// ready (then the next spare starts in the background); the others start
    /// interpreters. A failure of any slot is the registration's: the caller's cleanup
    /// kills the interpreters that did load. Bash: nothing to load (the handler was
    /// checked to be one of the files).
    async fn load(
        &self,
        registration: &Registration,
        spare_eligible: bool,
    ) -> Result<(), LoadError> {
        let mut adapters = Vec::with_capacity(registration.slots.len());
        for slot in &registration.slots {
            adapters.push(slot.adapter.lock().await);
        }
        if !adapters
            .iter()
            .any(|a| matches!(**a, AdapterState::Python(_)))
        {
            return Ok(());
        }
        // The first spare is started by the first registration, so that a server that
        // never registers a function (task mode) keeps none.
        let mut spare = match &self.spares {
            Some(spares) => {
                let spare = match spare_eligible {
                    true => spares.take().await,
                    false => None,
                };
                spares.replenish();
                spare
            }
            None => None,
        };
        let loads = adapters.iter_mut().map(|adapter| {
            let spare = spare.take();
            async move {
                match &mut **adapter {
                    AdapterState::Bash(_) => Ok(()),
                    AdapterState::Python(state) => registration.load_python(state, spare).await,
                }
            }
        });
        futures::future::join_all(loads).await.into_iter().collect()
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
    /// unregistered (also when an unregister interrupts the invocation), every slot
    /// already serving an invocation (`Busy`, at once), shutdown, and broken pipes or
    /// spawns. The invocation runs in its own task: a caller that goes away does not leave
    /// the interpreter halfway through a request.
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
        let mut adapter = registration
            .slots
            .iter()
            .find_map(|slot| slot.adapter.clone().try_lock_owned().ok())
            .ok_or_else(|| FunctionError::Busy {
                id: registration.id.clone(),
                slots: registration.slots.len(),
            })?;
        // Unregistering marks the registration before it takes the slots.
        registration.usable()?;
        let in_flight = InFlight::start(registration.clone());
        let this = self.clone();
        tokio::spawn(async move {
            let result = match registration.invoke(&mut adapter, &spec).await {
                // Stopped by shutdown rather than by an unregister.
                Err(FunctionError::Unregistering { .. }) if !this.accepting() => {
                    Err(FunctionError::ShuttingDown)
                }
                result => result,
            };
            drop(in_flight);
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
        // Ends the in-flight invocations at once; they notice `stop` and release their
        // slots.
        registration.kill_processes();
        if tokio::time::timeout(STOP_LIMIT, registration.kill_workers())
            .await
            .is_err()
        {
            tracing::warn!(
                registration = %registration.id,
                "an in-flight invocation did not end; removing the registration anyway"
            );
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
        if let Some(spares) = &self.spares {
            spares.close().await;
        }
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

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
    fn clipping_keeps_char_boundaries() {
        assert_eq!(clip_start("héllo", 2), "h");
        assert_eq!(clip_start("short", 10), "short");
        let long = "é".repeat(1000);
        let end = clip_end(&long, 200);
        assert!(end.len() <= 200, "{}", end.len());
        assert!(end.starts_with("[kruntimes: "));
        assert!(end.ends_with('é'));
    }

    #[test]
    fn only_variables_read_at_interpreter_start_keep_a_registration_off_the_spare() {
        let env = |names: &[&str]| -> Vec<(String, String)> {
            names
                .iter()
                .map(|n| ((*n).to_owned(), "1".to_owned()))
                .collect()
        };
        assert!(spare_eligible(&env(&[])));
        assert!(spare_eligible(&env(&[
            "PYTHONPATH",
            "HOME",
            "MY_PYTHONX",
            "LANGUAGE"
        ])));
        for cold in [
            "PYTHONHASHSEED",
            "PYTHONUTF8",
            "PYTHON",
            "LANG",
            "LC_ALL",
            "LC_CTYPE",
        ] {
            assert!(!spare_eligible(&env(&["A", cold])), "{cold}");
        }
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
