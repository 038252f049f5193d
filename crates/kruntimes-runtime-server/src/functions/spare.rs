//! The python adapter's warm spare: one launcher per server that has already started and
//! imported what the launcher needs, waiting on its request pipe for a bind frame.
//!
//! Owns starting the spare (in its own session, its own cgroup `fn-spare` when cgroups are
//! used, its own directory `ROOT/functions/spare`, with stdout and stderr on /dev/null),
//! keeping at most one ready and at most one being started, retrying a failed start a few
//! times with backoff, handing the ready one to a registration, and killing the spare at
//! shutdown. It never binds a spare to a registration (the `python` module moves it into
//! the registration's cgroup and sends the bind frame), never decides whether a
//! registration may use one (the parent module does), and is never listed as a
//! registration. A previous server's spare is cleaned up with its `fn-*` cgroups and
//! `ROOT/functions`; without cgroups it exits by itself once its request pipe closes.
#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::net::unix::pipe;
use tokio::sync::watch;

use super::python::{LAUNCHER, MAX_FRAME_BYTES, PythonWorker, read_frame};
use super::{CGROUP_PREFIX, DRAIN_LIMIT, lock, stopped};
use crate::interpreter::Adapter;
use crate::sandbox::cgroup::{CgroupError, CgroupParent, ExecCgroup};
use crate::sandbox::isolation::{self, SpawnError, SpawnSpec, Stdio};
use crate::tasks::executor;

/// How long a spare may take to start and import before it is given up.
const START_LIMIT: Duration = Duration::from_secs(30);
/// Starts tried in a row before the pool waits for the next registration to try again.
const START_ATTEMPTS: u32 = 4;
/// The wait after the first failed start; doubled after each further one.
const FIRST_BACKOFF: Duration = Duration::from_millis(200);

/// Why a spare did not start.
#[derive(Debug, thiserror::Error)]
pub(super) enum SpareError {
    #[error("failed to prepare the spare's directory {path}")]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to prepare the spare's cgroup")]
    Cgroup(#[source] CgroupError),
    #[error("failed to create the spare's pipes")]
    Pipe(#[source] std::io::Error),
    #[error("failed to start the spare interpreter")]
    Spawn(#[source] SpawnError),
    #[error("the spare interpreter {0}")]
    NotReady(&'static str),
}

/// A started launcher that has imported its modules and waits for a bind frame.
pub(super) struct Spare {
    pub(super) worker: PythonWorker,
    pub(super) pid: u32,
}

impl Spare {
    /// Kills a spare that is still in its own process group (not yet moved into a
    /// registration's cgroup, so nothing of a registration runs in it) and reaps it.
    pub(super) async fn kill(mut self) {
        isolation::signal_group(self.pid, Signal::SIGKILL);
        let _ = tokio::time::timeout(DRAIN_LIMIT, self.worker.child.wait()).await;
    }

    fn alive(&mut self) -> bool {
        matches!(self.worker.child.try_wait(), Ok(None))
    }
}

/// The server's one warm spare.
pub(super) struct SparePool {
    interpreter: PathBuf,
    path_var: String,
    /// `ROOT/functions/spare`: the spare's cwd and HOME; not a registration's workspace.
    dir: PathBuf,
    cgroup: Option<ExecCgroup>,
    ready: Mutex<Option<Spare>>,
    /// Held by the one task that starts a spare.
    starter: Arc<tokio::sync::Mutex<()>>,
    /// The process group of the spare being started; 0 when none.
    starting_pid: AtomicU32,
    closed: watch::Sender<bool>,
}

impl SparePool {
    pub(super) fn new(
        interpreter: PathBuf,
        path_var: String,
        functions_dir: PathBuf,
        cgroups: Option<&CgroupParent>,
    ) -> Arc<Self> {
        Arc::new(Self {
            interpreter,
            path_var,
            dir: functions_dir.join("spare"),
            cgroup: cgroups.map(|parent| parent.child(&format!("{CGROUP_PREFIX}spare"))),
            ready: Mutex::new(None),
            starter: Arc::new(tokio::sync::Mutex::new(())),
            starting_pid: AtomicU32::new(0),
            closed: watch::Sender::new(false),
        })
    }

    fn closed(&self) -> bool {
        *self.closed.borrow()
    }

    /// The ready spare, if there is one and it is alive; a dead one is reaped.
    pub(super) async fn take(&self) -> Option<Spare> {
        let mut spare = lock(&self.ready).take()?;
        if spare.alive() {
            return Some(spare);
        }
        tracing::debug!(
            pid = spare.pid,
            "the spare interpreter died while it waited"
        );
        spare.kill().await;
        None
    }

    /// Starts a spare in the background unless one is ready, one is being started, or the
    /// pool is closed. A start that fails is tried again after a backoff, at most
    /// [`START_ATTEMPTS`] times; the next call starts over.
    pub(super) fn replenish(self: &Arc<Self>) {
        if self.closed() || lock(&self.ready).is_some() {
            return;
        }
        let Ok(guard) = self.starter.clone().try_lock_owned() else {
            return;
        };
        let this = self.clone();
        tokio::spawn(async move {
            let _guard = guard;
            let mut closed = this.closed.subscribe();
            let mut backoff = FIRST_BACKOFF;
            for attempt in 1..=START_ATTEMPTS {
                if this.closed() || lock(&this.ready).is_some() {
                    return;
                }
                match this.start(&mut closed).await {
                    Ok(spare) => {
                        let refused = {
                            let mut ready = lock(&this.ready);
                            if this.closed() {
                                Some(spare)
                            } else {
                                *ready = Some(spare);
                                None
                            }
                        };
                        if let Some(spare) = refused {
                            spare.kill().await;
                        }
                        return;
                    }
                    Err(e) => {
                        tracing::debug!(attempt, error = %e, "no spare interpreter");
                    }
                }
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = stopped(&mut closed) => return,
                }
                backoff *= 2;
            }
            tracing::warn!(
                attempts = START_ATTEMPTS,
                "the spare interpreter does not start; registrations start their own"
            );
        });
    }

    /// Starts one spare and waits until it has imported what the launcher needs.
    async fn start(&self, closed: &mut watch::Receiver<bool>) -> Result<Spare, SpareError> {
        let tmp = self.dir.join("tmp");
        std::fs::create_dir_all(&tmp).map_err(|source| SpareError::Dir {
            path: tmp.clone(),
            source,
        })?;
        let cgroup_procs = match &self.cgroup {
            Some(cgroup) => {
                cgroup.create().map_err(SpareError::Cgroup)?;
                Some(cgroup.open_procs().map_err(SpareError::Cgroup)?)
            }
            None => None,
        };
        let (request_read, request_write) = std::io::pipe().map_err(SpareError::Pipe)?;
        let (response_read, response_write) = std::io::pipe().map_err(SpareError::Pipe)?;
        let requests =
            pipe::Sender::from_owned_fd(OwnedFd::from(request_write)).map_err(SpareError::Pipe)?;
        let responses = pipe::Receiver::from_owned_fd(OwnedFd::from(response_read))
            .map_err(SpareError::Pipe)?;
        let child = isolation::spawn(SpawnSpec {
            program: self.interpreter.clone().into_os_string(),
            args: ["-u", "-B", "-I", "-c", LAUNCHER, "--spare"]
                .into_iter()
                .map(OsString::from)
                .collect(),
            env: executor::base_env(&self.path_var, Adapter::Python, &self.dir, &tmp),
            cwd: self.dir.clone(),
            stdin: Stdio::null(),
            stdout: Stdio::null(),
            stderr: Stdio::null(),
            cgroup_procs,
            extra_fds: vec![request_read.into(), response_write.into()],
            place: isolation::Place::Host,
        })
        .map_err(SpareError::Spawn)?;
        let pid = child.id().unwrap_or_default();
        self.starting_pid.store(pid, Ordering::SeqCst);
        let mut spare = Spare {
            worker: PythonWorker {
                slot: 0,
                child,
                requests,
                responses,
            },
            pid,
        };
        let outcome = tokio::select! {
            biased;
            frame = read_frame(&mut spare.worker.responses, MAX_FRAME_BYTES) => match frame {
                Ok(body) if body == br#"{"spare":true}"# => Ok(()),
                Ok(_) => Err(SpareError::NotReady("sent an unexpected frame")),
                Err(_) => Err(SpareError::NotReady("exited before it was ready")),
            },
            _ = spare.worker.child.wait() => Err(SpareError::NotReady("exited before it was ready")),
            () = tokio::time::sleep(START_LIMIT) => Err(SpareError::NotReady("took too long to start")),
            () = stopped(closed) => Err(SpareError::NotReady("was stopped by shutdown")),
        };
        self.starting_pid.store(0, Ordering::SeqCst);
        match outcome {
            Ok(()) => {
                tracing::debug!(pid, "spare interpreter ready");
                Ok(spare)
            }
            Err(e) => {
                spare.kill().await;
                Err(e)
            }
        }
    }

    /// Stops starting spares, kills the ready one and one being started, and removes the
    /// spare's cgroup and directory.
    pub(super) async fn close(&self) {
        self.closed.send_replace(true);
        isolation::signal_group(self.starting_pid.load(Ordering::SeqCst), Signal::SIGKILL);
        // The starting task notices `closed` (or the kill) and ends.
        let _ = tokio::time::timeout(DRAIN_LIMIT, self.starter.lock()).await;
        let ready = lock(&self.ready).take();
        if let Some(spare) = ready {
            spare.kill().await;
        }
        if let Some(cgroup) = &self.cgroup {
            let removed = match cgroup.kill_all() {
                Ok(()) => match cgroup.wait_empty(DRAIN_LIMIT).await {
                    Ok(_) => cgroup.remove(),
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            };
            if let Err(e) = removed {
                tracing::warn!(error = %e, "the spare's cgroup not removed");
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
