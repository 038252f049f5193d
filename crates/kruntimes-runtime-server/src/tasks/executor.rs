//! Task executions: workspaces, supervision, termination and results.
//!
//! The executor owns the in-memory table of executions (keyed by Run UID + attempt), each
//! execution's workspace `ROOT/<run-uid>/<attempt>/` and the one supervisor task per
//! running execution that waits for the program, enforces the timeout, carries out
//! cancellation (SIGTERM to the process group and the cgroup, the grace period, then
//! SIGKILL of the whole cgroup) and records the result. It writes nothing outside the
//! workspace (and its cgroup), never routes or reorders work, and knows nothing of gRPC.
//!
//! Layout of one workspace:
//!
//! ```text
//! ROOT/<run-uid>/<attempt>/
//!   work/         the program's cwd and HOME; the source files
//!   tmp/          TMPDIR
//!   stdout.log    the whole stdout (without a log store)
//!   stderr.log    the whole stderr (without a log store)
//!   outputs       KRUNTIME_OUTPUTS
//! ```
//!
//! With a log store ([`ExecutorConfig::log_dir`], `--log-dir`), the two log files are
//! written there instead, as `LOG_DIR/<run-uid>/<attempt>/{stdout,stderr}.log`
//! ([`kruntimes_api::logstore`]), outside the disposable workspace: they outlive the
//! execution's [`Executor::forget`], the runtime server and its worker. Whoever keeps the
//! store removes them (`kruntimes up` does, when the Run is deleted or the store is full).
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fs::File;
use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use cap_std::fs::{Dir, OpenOptions, OpenOptionsExt};
use nix::sys::signal::Signal;
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::ids::{self, ExecutionKey, IdError};
use crate::interpreter::Adapter;
use crate::sandbox::Sandbox;
use crate::sandbox::cgroup::{CgroupError, CgroupParent, ExecCgroup};
use crate::sandbox::isolation::{self, Place, SpawnSpec};
use crate::tasks::outputs::{self, MAX_OUTPUTS_FILE_BYTES};

/// At most this many source files per execution.
pub const MAX_SOURCE_FILES: usize = 256;
/// All source file contents together are at most 1 MiB.
pub const MAX_SOURCE_BYTES: usize = 1024 * 1024;
/// At most this many arguments.
pub const MAX_ARGS: usize = kruntimes_api::run::MAX_TASK_ARGS;
/// All arguments together are at most 256 KiB.
pub const MAX_ARGS_BYTES: usize = 256 * 1024;
/// At most this many request environment variables.
pub const MAX_ENV: usize = kruntimes_api::run::MAX_ENV_VARS;
/// All request environment names and values together are at most 256 KiB.
pub const MAX_ENV_BYTES: usize = 256 * 1024;
/// Environment names with this prefix are the server's.
pub const RESERVED_ENV_PREFIX: &str = "KRUNTIME_";
/// How long to wait for a killed cgroup to empty before giving up on removing it.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);

/// The server's settings that executions depend on.
#[derive(Debug, Clone)]
pub struct ExecutorConfig {
    pub root: PathBuf,
    pub adapter: Adapter,
    pub interpreter: PathBuf,
    pub default_grace: Duration,
    /// PATH given to programs.
    pub path_var: String,
    /// `None`: process groups only.
    pub cgroups: Option<CgroupParent>,
    /// The `namespaces` backend; `None`: the `process` backend.
    pub sandboxes: Option<std::sync::Arc<crate::sandbox::Sandboxes>>,
    /// The log store that stdout and stderr go to; `None`: the workspace.
    pub log_dir: Option<PathBuf>,
}

/// A validated request to start an execution.
#[derive(Debug, Clone)]
pub struct ExecuteSpec {
    pub key: ExecutionKey,
    pub files: Vec<SourceFileSpec>,
    pub entrypoint: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub timeout: Option<Duration>,
    pub grace: Option<Duration>,
    /// Identifies the inputs, for idempotent repeats.
    pub digest: [u8; 32],
}

#[derive(Debug, Clone)]
pub struct SourceFileSpec {
    pub path: String,
    pub content: Vec<u8>,
    pub executable: bool,
}

/// Why a request was refused before anything started.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error(transparent)]
    Id(#[from] IdError),
    #[error("{what}: {detail}")]
    Invalid { what: &'static str, detail: String },
}

impl ExecuteSpec {
    /// Validates every untrusted part. `digest` must identify all of the inputs.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        key: ExecutionKey,
        files: Vec<SourceFileSpec>,
        entrypoint: String,
        args: Vec<String>,
        env: Vec<(String, String)>,
        timeout: Option<Duration>,
        grace: Option<Duration>,
        digest: [u8; 32],
    ) -> Result<Self, RequestError> {
        let invalid = |what, detail: String| RequestError::Invalid { what, detail };
        let paths = validate_files(&files)?;
        if !paths.contains(entrypoint.as_str()) {
            ids::validate_command(&entrypoint)?;
        }
        if args.len() > MAX_ARGS {
            return Err(invalid("args", format!("more than {MAX_ARGS} arguments")));
        }
        if args.iter().map(String::len).sum::<usize>() > MAX_ARGS_BYTES {
            return Err(invalid(
                "args",
                format!("exceed {MAX_ARGS_BYTES} bytes together"),
            ));
        }
        if args.iter().any(|a| a.contains('\0')) {
            return Err(invalid("args", "an argument contains NUL".to_owned()));
        }
        validate_env(&env)?;
        Ok(Self {
            key,
            files,
            entrypoint,
            args,
            env,
            timeout: timeout.filter(|t| !t.is_zero()),
            grace,
            digest,
        })
    }
}

/// Checks source files against the limits every request with files shares (task
/// executions and function registrations): at most [`MAX_SOURCE_FILES`] files and
/// [`MAX_SOURCE_BYTES`] of content, safe relative paths, no path twice, no path that is
/// also a directory of another. Returns the set of paths.
pub fn validate_files(files: &[SourceFileSpec]) -> Result<BTreeSet<&str>, RequestError> {
    let invalid = |detail: String| RequestError::Invalid {
        what: "files",
        detail,
    };
    if files.len() > MAX_SOURCE_FILES {
        return Err(invalid(format!("more than {MAX_SOURCE_FILES} files")));
    }
    let mut total = 0usize;
    let mut seen = BTreeSet::new();
    for file in files {
        ids::validate_source_path(&file.path)?;
        if !seen.insert(file.path.as_str()) {
            return Err(invalid(format!(
                "path {} appears twice",
                ids::bounded(&file.path)
            )));
        }
        total += file.content.len();
    }
    if total > MAX_SOURCE_BYTES {
        return Err(invalid(format!(
            "contents exceed {MAX_SOURCE_BYTES} bytes together"
        )));
    }
    // A file may not also be a directory of another (`a` and `a/b`).
    for path in &seen {
        let dir = format!("{path}/");
        if seen.iter().any(|other| other.starts_with(&dir)) {
            return Err(invalid(format!(
                "{} is both a file and a directory",
                ids::bounded(path)
            )));
        }
    }
    Ok(seen)
}

/// Checks a request's environment: at most [`MAX_ENV`] variables and [`MAX_ENV_BYTES`]
/// together, well-formed names and values, none with the [`RESERVED_ENV_PREFIX`].
pub fn validate_env(env: &[(String, String)]) -> Result<(), RequestError> {
    let invalid = |detail: String| RequestError::Invalid {
        what: "env",
        detail,
    };
    if env.len() > MAX_ENV {
        return Err(invalid(format!("more than {MAX_ENV} variables")));
    }
    if env.iter().map(|(n, v)| n.len() + v.len()).sum::<usize>() > MAX_ENV_BYTES {
        return Err(invalid(format!("exceeds {MAX_ENV_BYTES} bytes together")));
    }
    for (name, value) in env {
        let name_ok =
            !name.is_empty() && name.len() <= 256 && !name.contains('=') && !name.contains('\0');
        if !name_ok || value.contains('\0') {
            return Err(invalid(format!(
                "variable {:?} is malformed",
                ids::bounded(name)
            )));
        }
        if name.starts_with(RESERVED_ENV_PREFIX) {
            return Err(invalid(format!(
                "{} is reserved (prefix {RESERVED_ENV_PREFIX})",
                ids::bounded(name)
            )));
        }
    }
    Ok(())
}

/// The `PATH` of every program the server starts (tasks, function handlers, session
/// commands), whatever the server's own environment holds: nothing of `kruntimes up`'s
/// environment reaches a sandbox (docs/task-mode.md, "Environment").
pub const PROGRAM_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// [`PROGRAM_PATH`], behind the directory of the Runtime's interpreter when that is not on
/// it (so that `python3` in a program is the interpreter the Runtime runs).
pub fn program_path(interpreter: &Path) -> String {
    match interpreter.parent().and_then(Path::to_str) {
        Some(dir) if !dir.is_empty() && !PROGRAM_PATH.split(':').any(|d| d == dir) => {
            format!("{dir}:{PROGRAM_PATH}")
        }
        Some(_) | None => PROGRAM_PATH.to_owned(),
    }
}

/// The environment every program of the server starts with, before the request's own
/// variables and the server's `KRUNTIME_*` ones: PATH ([`program_path`]), HOME (the work
/// directory), TMPDIR, LANG, and for python unbuffered output without bytecode files.
/// Nothing else: spawning clears the environment first.
pub(crate) fn base_env(
    path_var: &str,
    adapter: Adapter,
    work: &Path,
    tmp: &Path,
) -> Vec<(String, String)> {
    let mut env = vec![
        ("PATH".to_owned(), path_var.to_owned()),
        ("HOME".to_owned(), work.display().to_string()),
        ("TMPDIR".to_owned(), tmp.display().to_string()),
        ("LANG".to_owned(), "C.UTF-8".to_owned()),
    ];
    if adapter == Adapter::Python {
        // Unbuffered, so that logs stream while the program runs.
        env.push(("PYTHONUNBUFFERED".to_owned(), "1".to_owned()));
        env.push(("PYTHONDONTWRITEBYTECODE".to_owned(), "1".to_owned()));
    }
    env
}

/// Where an execution is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Running,
    Succeeded,
    Failed,
    TimedOut,
    Cancelled,
}

impl State {
    pub fn is_terminal(self) -> bool {
        match self {
            State::Running => false,
            State::Succeeded | State::Failed | State::TimedOut | State::Cancelled => true,
        }
    }
}

/// What is known of an execution at one moment.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub key: ExecutionKey,
    pub state: State,
    pub reason: &'static str,
    pub message: String,
    pub retryable: bool,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub outputs: BTreeMap<String, String>,
    pub start_time: SystemTime,
    pub finish_time: Option<SystemTime>,
    pub termination_requested: bool,
}

impl Snapshot {
    fn running(key: ExecutionKey) -> Self {
        Self {
            key,
            state: State::Running,
            reason: "Running",
            message: String::new(),
            retryable: false,
            exit_code: None,
            signal: None,
            outputs: BTreeMap::new(),
            start_time: SystemTime::now(),
            finish_time: None,
            termination_requested: false,
        }
    }

    fn finish(&mut self, state: State, reason: &'static str, message: String) {
        self.state = state;
        self.reason = reason;
        self.message = message;
        self.finish_time = Some(SystemTime::now());
    }
}

/// What the supervisor is asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Control {
    Run,
    /// SIGTERM, grace, SIGKILL; ends Cancelled.
    Cancel,
    /// SIGKILL now (Forget, shutdown after grace).
    Kill,
}

struct Execution {
    key: ExecutionKey,
    dir: PathBuf,
    /// `None` for executions recovered from disk after a server restart.
    digest: Option<[u8; 32]>,
    snapshot: watch::Sender<Snapshot>,
    control: watch::Sender<Control>,
}

/// Why an executor call failed.
#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("execution {key} already exists with different inputs")]
    Conflict { key: ExecutionKey },
    #[error("execution {key} is unknown")]
    NotFound { key: ExecutionKey },
    #[error("the logs of execution {key} were removed from the log store")]
    LogsRemoved { key: ExecutionKey },
    #[error("the runtime server is shutting down")]
    ShuttingDown,
    #[error("failed to prepare workspace {path}")]
    Workspace {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to prepare the cgroup of execution {key}")]
    Cgroup {
        key: ExecutionKey,
        #[source]
        source: crate::sandbox::cgroup::CgroupError,
    },
    #[error("execution {key} did not stop within {limit:?}")]
    StillRunning { key: ExecutionKey, limit: Duration },
    #[error("failed to remove workspace {path}")]
    Remove {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The table of executions and their supervisors.
pub struct Executor {
    config: ExecutorConfig,
    executions: Mutex<BTreeMap<ExecutionKey, Arc<Execution>>>,
    accepting: AtomicBool,
}

impl Executor {
    /// Creates the root and takes over what a previous server left in it: each workspace
    /// becomes a FAILED execution with reason `ServerRestarted` (retryable), and any
    /// process still in its cgroup is killed.
    pub fn new(config: ExecutorConfig) -> Result<Arc<Self>, ExecutorError> {
        std::fs::create_dir_all(&config.root).map_err(|source| ExecutorError::Workspace {
            path: config.root.clone(),
            source,
        })?;
        let executor = Arc::new(Self {
            config,
            executions: Mutex::new(BTreeMap::new()),
            accepting: AtomicBool::new(true),
        });
        executor.recover();
        Ok(executor)
    }

    pub fn config(&self) -> &ExecutorConfig {
        &self.config
    }

    pub fn accepting(&self) -> bool {
        self.accepting.load(Ordering::SeqCst)
    }

    fn table(&self) -> std::sync::MutexGuard<'_, BTreeMap<ExecutionKey, Arc<Execution>>> {
        // A panic while holding this lock leaves only a map behind; keep serving.
        self.executions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The directory of the execution's two log files: its attempt's in the log store, or
    /// its workspace.
    fn logs_dir(&self, key: &ExecutionKey) -> PathBuf {
        let Some(store) = &self.config.log_dir else {
            return self.exec_dir(key);
        };
        // Both components are validated (a UUID and a number), so the store's own check
        // only confirms it.
        kruntimes_api::logstore::attempt_dir(store, key.run_uid(), key.attempt())
            .unwrap_or_else(|| self.exec_dir(key))
    }

    /// Removes the attempt's directory of the log store (an execution that never started).
    fn remove_stored_logs(&self, key: &ExecutionKey) {
        if self.config.log_dir.is_none() {
            return;
        }
        let dir = self.logs_dir(key);
        let _ = std::fs::remove_dir_all(&dir);
        if let Some(run) = dir.parent() {
            // Fails while another attempt of the Run keeps its logs there.
            let _ = std::fs::remove_dir(run);
        }
    }

    fn exec_dir(&self, key: &ExecutionKey) -> PathBuf {
        // Both components are validated: a UUID and a number.
        self.config
            .root
            .join(key.run_uid())
            .join(key.attempt().to_string())
    }

    fn recover(&self) {
        let Ok(runs) = std::fs::read_dir(&self.config.root) else {
            return;
        };
        for run in runs.flatten() {
            let name = run.file_name();
            let Some(uid) = name.to_str() else { continue };
            if ids::validate_run_uid(uid).is_err() {
                continue;
            }
            let Ok(attempts) = std::fs::read_dir(run.path()) else {
                continue;
            };
            for attempt in attempts.flatten() {
                let Some(attempt) = attempt.file_name().to_str().and_then(|a| a.parse().ok())
                else {
                    continue;
                };
                let Ok(key) = ExecutionKey::new(uid, attempt) else {
                    continue;
                };
                if let Some(parent) = &self.config.cgroups {
                    let cgroup = parent.child(&key.component());
                    if cgroup.exists()
                        && let Err(e) = clean_leftover_cgroup(&cgroup)
                    {
                        tracing::warn!(execution = %key, error = %e, "leftover cgroup not cleaned");
                    }
                }
                let mut snapshot = Snapshot::running(key.clone());
                if let Ok(meta) = std::fs::metadata(self.exec_dir(&key))
                    && let Ok(modified) = meta.modified()
                {
                    snapshot.start_time = modified;
                }
                snapshot.retryable = true;
                snapshot.finish(
                    State::Failed,
                    "ServerRestarted",
                    "the runtime server restarted while it held this execution; its result is unknown"
                        .to_owned(),
                );
                tracing::warn!(execution = %key, "recovered an execution left by a previous server");
                let execution = Arc::new(Execution {
                    dir: self.exec_dir(&key),
                    key: key.clone(),
                    digest: None,
                    snapshot: watch::Sender::new(snapshot),
                    control: watch::Sender::new(Control::Run),
                });
                self.table().insert(key, execution);
            }
        }
    }

    /// Starts an execution, or returns the existing one for the same identity and inputs.
    ///
    /// A program that cannot be started (no such command, not executable) is a FAILED
    /// execution with reason `StartFailed`, not an error. Errors: a conflicting repeat,
    /// shutdown, and failures to prepare the workspace or cgroup (nothing is left behind).
    pub fn execute(self: &Arc<Self>, spec: ExecuteSpec) -> Result<Snapshot, ExecutorError> {
        let execution = {
            let mut table = self.table();
            if let Some(existing) = table.get(&spec.key) {
                return match existing.digest {
                    Some(d) if d != spec.digest => Err(ExecutorError::Conflict {
                        key: spec.key.clone(),
                    }),
                    _ => Ok(existing.snapshot.borrow().clone()),
                };
            }
            if !self.accepting() {
                return Err(ExecutorError::ShuttingDown);
            }
            let execution = Arc::new(Execution {
                key: spec.key.clone(),
                dir: self.exec_dir(&spec.key),
                digest: Some(spec.digest),
                snapshot: watch::Sender::new(Snapshot::running(spec.key.clone())),
                control: watch::Sender::new(Control::Run),
            });
            table.insert(spec.key.clone(), execution.clone());
            execution
        };
        match self.start(&execution, &spec) {
            Ok(()) => Ok(execution.snapshot.borrow().clone()),
            Err(e) => {
                self.table().remove(&spec.key);
                let _ = std::fs::remove_dir_all(&execution.dir);
                self.remove_run_dir_if_empty(&spec.key);
                self.remove_stored_logs(&spec.key);
                Err(e)
            }
        }
    }

    fn start(
        self: &Arc<Self>,
        execution: &Arc<Execution>,
        spec: &ExecuteSpec,
    ) -> Result<(), ExecutorError> {
        let dir = &execution.dir;
        let ws_err = |path: &Path| {
            let path = path.to_owned();
            move |source| ExecutorError::Workspace { path, source }
        };
        let (work, tmp) = create_workspace(dir, &spec.files)
            .map_err(|(path, source)| ExecutorError::Workspace { path, source })?;
        let logs = self.logs_dir(&spec.key);
        if logs != *dir {
            create_private_dir(&logs).map_err(ws_err(&logs))?;
        }
        let stdout_path = logs.join(kruntimes_api::logstore::STDOUT_FILE);
        let stderr_path = logs.join(kruntimes_api::logstore::STDERR_FILE);
        let outputs_path = dir.join("outputs");
        let stdout = File::create(&stdout_path).map_err(ws_err(&stdout_path))?;
        let stderr = File::create(&stderr_path).map_err(ws_err(&stderr_path))?;

        let cgroup = match &self.config.cgroups {
            Some(parent) => {
                let cgroup = parent.child(&spec.key.component());
                let cg_err = |source| ExecutorError::Cgroup {
                    key: spec.key.clone(),
                    source,
                };
                cgroup.create().map_err(cg_err)?;
                Some(cgroup)
            }
            None => None,
        };
        let cgroup_procs = match &cgroup {
            Some(cg) => match cg.open_procs() {
                Ok(file) => Some(file),
                Err(source) => {
                    let _ = cg.remove();
                    return Err(ExecutorError::Cgroup {
                        key: spec.key.clone(),
                        source,
                    });
                }
            },
            None => None,
        };

        let (program, mut args) = self.command_line(spec);
        args.extend(spec.args.iter().map(OsString::from));
        let mut env = base_env(&self.config.path_var, self.config.adapter, &work, &tmp);
        env.extend(spec.env.iter().cloned());
        env.extend([
            (
                "KRUNTIME_OUTPUTS".to_owned(),
                outputs_path.display().to_string(),
            ),
            ("KRUNTIME_WORKSPACE".to_owned(), work.display().to_string()),
            ("KRUNTIME_RUN_UID".to_owned(), spec.key.run_uid().to_owned()),
            (
                "KRUNTIME_ATTEMPT".to_owned(),
                spec.key.attempt().to_string(),
            ),
            ("KRUNTIME_EXECUTION".to_owned(), spec.key.to_string()),
        ]);
        let launch = Launch {
            program,
            args,
            env,
            work: work.clone(),
            stdout,
            stderr,
            cgroup,
            cgroup_procs,
            timeout: spec.timeout,
            grace: spec.grace.unwrap_or(self.config.default_grace),
            outputs_path: outputs_path.clone(),
        };
        let Some(sandboxes) = self.config.sandboxes.clone() else {
            launch.start(execution);
            return Ok(());
        };
        // The program's outputs file is bound into the sandbox, so it must exist.
        File::create(&outputs_path).map_err(ws_err(&outputs_path))?;
        let execution = execution.clone();
        let name = spec.key.component();
        tokio::spawn(async move {
            let writable = vec![work, tmp, outputs_path];
            match sandboxes
                .create(&name, writable, launch.cgroup.as_ref())
                .await
            {
                Ok(sandbox) => launch.start_in(&execution, sandbox).await,
                Err(e) => {
                    if let Some(cg) = &launch.cgroup {
                        let _ = cg.remove();
                    }
                    tracing::warn!(execution = %execution.key, error = %e, "sandbox not created");
                    execution.snapshot.send_modify(|s| {
                        s.retryable = true;
                        s.finish(State::Failed, "StartFailed", e.to_string());
                    });
                }
            }
        });
        Ok(())
    }

    fn command_line(&self, spec: &ExecuteSpec) -> (OsString, Vec<OsString>) {
        let interpreter = self.config.interpreter.clone().into_os_string();
        if spec.files.iter().any(|f| f.path == spec.entrypoint) {
            (interpreter, vec![OsString::from(&spec.entrypoint)])
        } else if self
            .config
            .adapter
            .interpreter_names()
            .contains(&spec.entrypoint.as_str())
        {
            (interpreter, Vec::new())
        } else {
            (OsString::from(&spec.entrypoint), Vec::new())
        }
    }

    fn get(&self, key: &ExecutionKey) -> Result<Arc<Execution>, ExecutorError> {
        self.table()
            .get(key)
            .cloned()
            .ok_or_else(|| ExecutorError::NotFound { key: key.clone() })
    }

    pub fn status(&self, key: &ExecutionKey) -> Result<Snapshot, ExecutorError> {
        Ok(self.get(key)?.snapshot.borrow().clone())
    }

    /// The execution's stdout and stderr log files. [`ExecutorError::LogsRemoved`] when the
    /// execution has ended and the log store's keeper removed them (both are created
    /// before the execution starts).
    pub fn log_paths(&self, key: &ExecutionKey) -> Result<(PathBuf, PathBuf), ExecutorError> {
        let execution = self.get(key)?;
        let dir = self.logs_dir(key);
        if self.config.log_dir.is_some()
            && execution.snapshot.borrow().state.is_terminal()
            && !dir.join(kruntimes_api::logstore::STDOUT_FILE).exists()
        {
            return Err(ExecutorError::LogsRemoved { key: key.clone() });
        }
        Ok((
            dir.join(kruntimes_api::logstore::STDOUT_FILE),
            dir.join(kruntimes_api::logstore::STDERR_FILE),
        ))
    }

    /// A receiver that sees every change of the execution's snapshot.
    pub fn subscribe(
        &self,
        key: &ExecutionKey,
    ) -> Result<watch::Receiver<Snapshot>, ExecutorError> {
        Ok(self.get(key)?.snapshot.subscribe())
    }

    /// Waits until the execution is terminal or `limit` passes; returns the snapshot then.
    pub async fn wait(
        &self,
        key: &ExecutionKey,
        limit: Duration,
    ) -> Result<Snapshot, ExecutorError> {
        let mut rx = self.subscribe(key)?;
        let _ = tokio::time::timeout(limit, rx.wait_for(|s| s.state.is_terminal())).await;
        let snapshot = rx.borrow().clone();
        Ok(snapshot)
    }

    pub fn list(&self) -> Vec<Snapshot> {
        self.table()
            .values()
            .map(|e| e.snapshot.borrow().clone())
            .collect()
    }

    /// Requests cancellation; returns the snapshot. Unknown executions return `None`.
    pub fn cancel(&self, key: &ExecutionKey) -> Option<Snapshot> {
        let execution = self.table().get(key).cloned()?;
        let requested = execution.control.send_if_modified(|c| {
            if *c == Control::Run && !execution.snapshot.borrow().state.is_terminal() {
                *c = Control::Cancel;
                true
            } else {
                false
            }
        });
        if requested {
            // Visible at once; the supervisor sends the signals.
            execution.snapshot.send_if_modified(|s| {
                let changed = !s.state.is_terminal() && !s.termination_requested;
                if changed {
                    s.termination_requested = true;
                }
                changed
            });
        }
        let snapshot = execution.snapshot.borrow().clone();
        Some(snapshot)
    }

    /// Kills the execution if it runs (no grace), waits for it to end (at most `limit`),
    /// then removes its workspace and its entry. Returns whether anything existed.
    pub async fn forget(&self, key: &ExecutionKey, limit: Duration) -> Result<bool, ExecutorError> {
        let execution = self.table().get(key).cloned();
        if let Some(execution) = &execution {
            execution.control.send_replace(Control::Kill);
            let mut rx = execution.snapshot.subscribe();
            let ended = tokio::time::timeout(limit, rx.wait_for(|s| s.state.is_terminal())).await;
            if ended.is_err() {
                return Err(ExecutorError::StillRunning {
                    key: key.clone(),
                    limit,
                });
            }
        }
        let dir = self.exec_dir(key);
        let existed_on_disk = dir.exists();
        if existed_on_disk {
            std::fs::remove_dir_all(&dir).map_err(|source| ExecutorError::Remove {
                path: dir.clone(),
                source,
            })?;
        }
        self.remove_run_dir_if_empty(key);
        self.table().remove(key);
        Ok(execution.is_some() || existed_on_disk)
    }

    fn remove_run_dir_if_empty(&self, key: &ExecutionKey) {
        // Fails while another attempt of the Run still has a workspace.
        let _ = std::fs::remove_dir(self.config.root.join(key.run_uid()));
    }

    /// Stops accepting executions, cancels every running one (SIGTERM, then SIGKILL after
    /// its grace period) and waits for all of them, at most `limit`.
    pub async fn shutdown(&self, limit: Duration) {
        self.accepting.store(false, Ordering::SeqCst);
        let executions: Vec<Arc<Execution>> = self.table().values().cloned().collect();
        let deadline = Instant::now() + limit;
        for execution in &executions {
            execution.control.send_if_modified(|c| {
                if *c == Control::Run {
                    *c = Control::Cancel;
                    true
                } else {
                    false
                }
            });
        }
        for execution in &executions {
            let mut rx = execution.snapshot.subscribe();
            let _ = tokio::time::timeout_at(deadline, rx.wait_for(|s| s.state.is_terminal())).await;
        }
        if let Some(parent) = &self.config.cgroups {
            parent.remove_if_empty();
        }
    }
}

/// Creates the workspace `dir` of an execution or a registration: `work` holding the source
/// files, and an empty `tmp`. A `dir` that exists was left by a Forget or an unregister that
/// could not finish; this identity is ours, so it is removed first.
/// Returns the paths of `work` and `tmp`; an error comes with the path it concerns.
/// Creates `dir` and its missing parents, the last one readable by its owner only.
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

pub(crate) fn create_workspace(
    dir: &Path,
    files: &[SourceFileSpec],
) -> Result<(PathBuf, PathBuf), (PathBuf, std::io::Error)> {
    let at = |path: &Path| {
        let path = path.to_owned();
        move |e| (path, e)
    };
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(at(dir))?;
    }
    let work = dir.join("work");
    let tmp = dir.join("tmp");
    std::fs::create_dir_all(&work).map_err(at(&work))?;
    std::fs::create_dir(&tmp).map_err(at(&tmp))?;
    write_sources(&work, files).map_err(at(&work))?;
    Ok((work, tmp))
}

/// Kills everything in a cgroup that a previous server left, waits (at most
/// [`DRAIN_LIMIT`]) for it to empty, and removes it.
pub(crate) fn clean_leftover_cgroup(cgroup: &ExecCgroup) -> Result<(), CgroupError> {
    cgroup
        .kill_all()
        .and_then(|()| cgroup.wait_empty_blocking(DRAIN_LIMIT))
        .and_then(|_| cgroup.remove())
}

/// Kills and removes every cgroup under `parent` whose name starts with `prefix` (a
/// previous server's `what`s: registrations, sessions).
pub(crate) fn clean_leftover_cgroups(parent: &CgroupParent, prefix: &str, what: &str) {
    let Ok(entries) = std::fs::read_dir(parent.path()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(prefix) || !entry.path().is_dir() {
            continue;
        }
        match clean_leftover_cgroup(&parent.child(name)) {
            Ok(()) => tracing::warn!(cgroup = %name, "killed the {what} of a previous server"),
            Err(e) => tracing::warn!(cgroup = %name, error = %e, "leftover cgroup not cleaned"),
        }
    }
}

/// Writes the source files beneath `work` (each path resolved beneath it by the kernel).
pub(crate) fn write_sources(work: &Path, files: &[SourceFileSpec]) -> std::io::Result<()> {
    if files.is_empty() {
        return Ok(());
    }
    // Every path is resolved beneath `work` by the kernel (openat2 RESOLVE_BENEATH where
    // available), so even a validated path cannot leave it.
    let dir = Dir::open_ambient_dir(work, cap_std::ambient_authority())?;
    for file in files {
        let path = Path::new(&file.path);
        if let Some(parent) = path.parent()
            && !parent.as_os_str().is_empty()
        {
            dir.create_dir_all(parent)?;
        }
        let mut options = OpenOptions::new();
        options
            .write(true)
            .create_new(true)
            .mode(if file.executable { 0o755 } else { 0o644 });
        let mut handle = dir.open_with(path, &options)?;
        std::io::Write::write_all(&mut handle, &file.content)?;
    }
    Ok(())
}

/// How the supervisor came to end the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Timeout,
    Cancel,
}

/// Waits for the program, enforces timeout and cancellation, kills what is left of the
/// execution when the program ends, and records the result.
/// A program ready to start (its workspace, logs and cgroup made).
struct Launch {
    program: OsString,
    args: Vec<OsString>,
    env: Vec<(String, String)>,
    work: PathBuf,
    stdout: File,
    stderr: File,
    cgroup: Option<ExecCgroup>,
    cgroup_procs: Option<File>,
    timeout: Option<Duration>,
    grace: Duration,
    outputs_path: PathBuf,
}

impl Launch {
    /// Starts the program on the host and its supervisor; a program that does not start
    /// fails the execution with `StartFailed`.
    fn start(self, execution: &Arc<Execution>) {
        if let Some((spec, after)) = self.spawn_spec(execution, None) {
            after.started(execution, isolation::spawn(spec), None);
        }
    }

    /// As [`Launch::start`], in `sandbox` (under `gvisor`, once the program has started
    /// there).
    async fn start_in(self, execution: &Arc<Execution>, mut sandbox: Sandbox) {
        match self.spawn_spec(execution, Some(&sandbox)) {
            Some((spec, after)) => {
                let spawned = isolation::spawn_started(spec).await;
                after.started(execution, spawned, Some(sandbox));
            }
            None => sandbox.destroy().await,
        }
    }

    /// What to spawn, and what the supervisor needs after; `None` (the execution failed)
    /// when the sandbox cannot be entered.
    fn spawn_spec(
        self,
        execution: &Arc<Execution>,
        sandbox: Option<&Sandbox>,
    ) -> Option<(SpawnSpec, AfterSpawn)> {
        let Launch {
            program,
            args,
            env,
            work,
            stdout,
            stderr,
            cgroup,
            cgroup_procs,
            timeout,
            grace,
            outputs_path,
        } = self;
        let place = match sandbox.map(|s| s.enter(&work)) {
            Some(Ok(place)) => place,
            Some(Err(e)) => {
                not_started(execution, &cgroup, true, e.to_string(), None);
                return None;
            }
            None => Place::Host,
        };
        let spec = SpawnSpec {
            program,
            args,
            env,
            cwd: work,
            stdin: isolation::Stdio::null(),
            stdout: stdout.into(),
            stderr: stderr.into(),
            cgroup_procs,
            extra_fds: Vec::new(),
            place,
        };
        Some((
            spec,
            AfterSpawn {
                cgroup,
                timeout,
                grace,
                outputs_path,
            },
        ))
    }
}

/// What the supervisor of a started program needs.
struct AfterSpawn {
    cgroup: Option<ExecCgroup>,
    timeout: Option<Duration>,
    grace: Duration,
    outputs_path: PathBuf,
}

impl AfterSpawn {
    /// Supervises the program, or fails the execution with `StartFailed`.
    fn started(
        self,
        execution: &Arc<Execution>,
        spawned: Result<isolation::Child, isolation::SpawnError>,
        sandbox: Option<Sandbox>,
    ) {
        let AfterSpawn {
            cgroup,
            timeout,
            grace,
            outputs_path,
        } = self;
        let child = match spawned {
            Ok(child) => child,
            Err(e) => {
                let retryable = !matches!(
                    e.source.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied
                );
                tracing::info!(execution = %execution.key, error = %e.source, "program did not start");
                let message = format!("{e}: {}", e.source);
                not_started(execution, &cgroup, retryable, message, sandbox);
                return;
            }
        };
        tracing::debug!(execution = %execution.key, pid = child.id(), "started");
        tokio::spawn(supervise(
            execution.clone(),
            child,
            cgroup,
            sandbox,
            timeout,
            grace,
            outputs_path,
        ));
    }
}

/// Fails an execution whose program did not start (and ends its sandbox).
fn not_started(
    execution: &Arc<Execution>,
    cgroup: &Option<ExecCgroup>,
    retryable: bool,
    message: String,
    sandbox: Option<Sandbox>,
) {
    if let Some(cg) = cgroup {
        let _ = cg.remove();
    }
    if let Some(mut sandbox) = sandbox {
        tokio::spawn(async move { sandbox.destroy().await });
    }
    execution.snapshot.send_modify(|s| {
        s.retryable = retryable;
        s.finish(State::Failed, "StartFailed", message);
    });
}

async fn supervise(
    execution: Arc<Execution>,
    mut child: isolation::Child,
    cgroup: Option<ExecCgroup>,
    mut sandbox: Option<Sandbox>,
    timeout: Option<Duration>,
    grace: Duration,
    outputs_path: PathBuf,
) {
    let oom_before = sandbox.as_ref().map(Sandbox::oom_kills);
    let key = execution.key.clone();
    // The child is the leader of its own process group.
    let pgid = child.id().unwrap_or(0);
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut control = execution.control.subscribe();
    let mut ending: Option<Ending> = None;
    let mut kill_at: Option<Instant> = None;
    let mut killed = false;

    let terminate = |ending: Ending| {
        execution
            .snapshot
            .send_modify(|s| s.termination_requested = true);
        tracing::info!(execution = %key, ?ending, "terminating");
        isolation::signal_group(pgid, Signal::SIGTERM);
        if let Some(cg) = &cgroup {
            let _ = cg.signal_outside_group(Signal::SIGTERM, pgid);
        }
    };
    let kill_everything = || {
        isolation::signal_group(pgid, Signal::SIGKILL);
        if let Some(cg) = &cgroup
            && let Err(e) = cg.kill_all()
        {
            tracing::warn!(execution = %key, error = %e, "cgroup kill failed");
        }
    };

    let exit = loop {
        let control_now = *control.borrow_and_update();
        match control_now {
            Control::Run => {}
            Control::Cancel => {
                if ending.is_none() {
                    ending = Some(Ending::Cancel);
                    terminate(Ending::Cancel);
                    kill_at = Some(Instant::now() + grace);
                }
            }
            Control::Kill => {
                if ending.is_none() {
                    ending = Some(Ending::Cancel);
                    execution
                        .snapshot
                        .send_modify(|s| s.termination_requested = true);
                }
                if !killed {
                    killed = true;
                    kill_at = None;
                    kill_everything();
                }
            }
        }
        tokio::select! {
            status = child.wait() => break status,
            _ = sleep_until_opt(deadline), if ending.is_none() && deadline.is_some() => {
                ending = Some(Ending::Timeout);
                terminate(Ending::Timeout);
                kill_at = Some(Instant::now() + grace);
            }
            _ = sleep_until_opt(kill_at), if kill_at.is_some() => {
                kill_at = None;
                killed = true;
                kill_everything();
            }
            changed = control.changed() => {
                if changed.is_err() {
                    // The execution's sender lives as long as `execution`; cannot happen.
                    continue;
                }
            }
        }
    };

    // The program has ended (and is reaped); nothing it started may outlive it. With a
    // cgroup, kill through it only: the reaped leader's pid may name no group any more.
    match &cgroup {
        Some(cg) => {
            if let Err(e) = cg.kill_all() {
                tracing::warn!(execution = %key, error = %e, "cgroup kill failed");
            }
        }
        None => isolation::signal_group(pgid, Signal::SIGKILL),
    }
    if let Some(cg) = &cgroup {
        match cg.wait_empty(DRAIN_LIMIT).await {
            Ok(true) => {
                if let Err(e) = cg.remove() {
                    tracing::warn!(execution = %key, error = %e, "cgroup not removed");
                }
            }
            Ok(false) => {
                tracing::warn!(execution = %key, "cgroup still populated after kill");
            }
            Err(e) => tracing::warn!(execution = %key, error = %e, "cgroup not drained"),
        }
    }
    let oom_killed = match (&sandbox, oom_before) {
        (Some(sandbox), Some(before)) if sandbox.oom_kills() > before => {
            Some(sandbox.oom_message("program"))
        }
        _ => None,
    };
    if let Some(sandbox) = &mut sandbox {
        sandbox.destroy().await;
    }

    execution.snapshot.send_modify(|s| match exit {
        Err(e) => {
            s.retryable = true;
            s.finish(
                State::Failed,
                "WaitFailed",
                format!("failed to wait for the program: {e}"),
            );
        }
        Ok(status) => {
            s.exit_code = status.code();
            s.signal = status.signal();
            match ending {
                Some(Ending::Timeout) => {
                    s.finish(
                        State::TimedOut,
                        "Timeout",
                        match timeout {
                            Some(t) => format!("exceeded its timeout of {:.3} s", t.as_secs_f64()),
                            None => "exceeded its timeout".to_owned(),
                        },
                    );
                }
                Some(Ending::Cancel) => {
                    s.finish(State::Cancelled, "Cancelled", "cancelled".to_owned());
                }
                None if oom_killed.is_some() => s.finish(
                    State::Failed,
                    "OOMKilled",
                    oom_killed.clone().unwrap_or_default(),
                ),
                None => classify_exit(s, status, &outputs_path),
            }
        }
    });
    let snapshot = execution.snapshot.borrow().clone();
    tracing::info!(
        execution = %key,
        state = ?snapshot.state,
        reason = snapshot.reason,
        exit_code = ?snapshot.exit_code,
        "finished"
    );
}

fn classify_exit(s: &mut Snapshot, status: std::process::ExitStatus, outputs_path: &Path) {
    let parsed = read_outputs(outputs_path);
    match (status.code(), parsed) {
        (Some(0), Ok(outputs)) => {
            s.outputs = outputs;
            s.finish(State::Succeeded, "Completed", String::new());
        }
        (Some(0), Err(e)) => {
            let reason = e.reason();
            s.finish(State::Failed, reason, e.to_string());
        }
        (Some(code), parsed) => {
            let mut message = format!("exited with code {code}");
            match parsed {
                Ok(outputs) => s.outputs = outputs,
                Err(e) => message.push_str(&format!("; outputs ignored: {e}")),
            }
            s.finish(State::Failed, "NonZeroExitCode", message);
        }
        (None, _) => {
            let signal = status.signal().unwrap_or(0);
            s.finish(
                State::Failed,
                "Signaled",
                format!("killed by signal {signal}"),
            );
        }
    }
}

/// Reads the outputs file, at most [`MAX_OUTPUTS_FILE_BYTES`] + 1 bytes of it; a missing
/// file means no outputs.
fn read_outputs(path: &Path) -> Result<BTreeMap<String, String>, outputs::OutputsError> {
    let file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(_) => {
            return Err(outputs::OutputsError::Invalid {
                line: 0,
                detail: "the outputs file cannot be opened",
            });
        }
    };
    let mut bytes = Vec::new();
    if let Err(e) = file
        .take(MAX_OUTPUTS_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
    {
        return Err(outputs::OutputsError::Invalid {
            line: 0,
            detail: if e.kind() == std::io::ErrorKind::IsADirectory {
                "the outputs path is a directory"
            } else {
                "the outputs file cannot be read"
            },
        });
    }
    outputs::parse(&bytes)
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The digest of anything that identifies a request's inputs.
pub fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_get_the_fixed_path_and_the_interpreters_directory() {
        assert_eq!(program_path(Path::new("/usr/bin/python3")), PROGRAM_PATH);
        assert_eq!(
            program_path(Path::new("/opt/py/bin/python3")),
            format!("/opt/py/bin:{PROGRAM_PATH}")
        );
        let env = base_env(
            &program_path(Path::new("/usr/bin/bash")),
            Adapter::Bash,
            Path::new("/w"),
            Path::new("/t"),
        );
        assert_eq!(
            env,
            vec![
                ("PATH".to_owned(), PROGRAM_PATH.to_owned()),
                ("HOME".to_owned(), "/w".to_owned()),
                ("TMPDIR".to_owned(), "/t".to_owned()),
                ("LANG".to_owned(), "C.UTF-8".to_owned()),
            ]
        );
    }
}
