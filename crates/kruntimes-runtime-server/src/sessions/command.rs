//! One command of a session: started in the session's cgroup and its own process group,
//! in a working directory resolved beneath the workspace, with stdout and stderr streamed
//! as they are produced.
//!
//! Owns the command's environment (the server's base, the registered env, the command's
//! overrides, then `KRUNTIME_*`), feeding stdin, bounding each stream at
//! [`MAX_STREAM_BYTES`] per operation while still draining it (so the command never blocks
//! on a full pipe), the timeout, the session closing (SIGTERM, then SIGKILL after the
//! grace period), the caller going away (SIGKILL at once), and killing whatever the
//! command leaves behind when it ends. It never decides whether a session accepts a
//! command.
#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::os::fd::AsRawFd;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{
    CHUNK_BYTES, CommandSpec, Completion, Control, DRAIN_LIMIT, MAX_STREAM_BYTES, OperationEvent,
    OperationState, OutputStream, Program, Session, SessionsConfig, StreamTotals, files,
};
use crate::ids;
use crate::sandbox::isolation::{self, SpawnSpec, Stdio};
use crate::tasks::executor;

/// Without a cgroup, how long to wait for a killed process group to be gone (its members
/// are reaped by whoever inherits them, usually at once).
const GROUP_LIMIT: Duration = Duration::from_secs(1);
/// How often to look.
const GROUP_POLL: Duration = Duration::from_millis(2);
/// After a SIGKILL that nobody here sent, how long to wait for the sandbox's end before
/// calling it the command's own: a sandbox killed from outside is gone within
/// milliseconds, so only a SIGKILL from inside the sandbox (the command's own, another
/// program's, `kill -9 -1`) waits this long. A sandbox slower to end is reported lost by
/// the next command.
const SANDBOX_END_LIMIT: Duration = Duration::from_secs(1);

/// Why the command was ended from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Timeout,
    SessionClosed,
    CallerGone,
}

/// What one stream has produced so far; readable even when its reader was abandoned.
#[derive(Default)]
struct Counter {
    bytes: AtomicU64,
    truncated: AtomicBool,
}

impl Counter {
    fn totals(&self) -> StreamTotals {
        StreamTotals {
            bytes: self.bytes.load(Ordering::SeqCst),
            truncated: self.truncated.load(Ordering::SeqCst),
        }
    }
}

/// Runs the command to its end and returns how it ended (its duration is the caller's).
pub(super) async fn run(
    config: &SessionsConfig,
    session: &Arc<Session>,
    operation_id: &str,
    command: CommandSpec,
    deadline: Instant,
    tx: &mpsc::Sender<OperationEvent>,
) -> Completion {
    let CommandSpec {
        program,
        stdin,
        cwd,
        env: overrides,
    } = command;
    // The working directory is opened beneath the workspace and handed to the child as
    // /proc/self/fd/N: the child changes into exactly the directory resolved here (its
    // copy of the descriptor is open until exec), with no path to swap meanwhile.
    let cwd_dir = match files::open_workspace(&session.workspace) {
        Ok(ws) => match files::open_dir(&ws, &cwd) {
            Ok(dir) => dir,
            Err(e) => return Completion::failed(e.reason.as_str(), format!("cwd {e}")),
        },
        Err(e) => {
            return Completion::failed("IoError", format!("the workspace cannot be opened: {e}"));
        }
    };
    // Inside a sandbox the directory is named by its path: the path is the same inside (the
    // workspace is bound at its host path) and resolves within the sandbox's own view.
    let lost = super::lock(&session.sandbox)
        .as_ref()
        .is_some_and(crate::sandbox::Sandbox::lost);
    if lost {
        return sandbox_lost(session);
    }
    let (place, oom) = {
        let sandbox = super::lock(&session.sandbox);
        match &*sandbox {
            Some(sandbox) => match sandbox.enter(&session.workspace.join(&cwd)) {
                Ok(place) => (place, Some(sandbox.oom_kills())),
                Err(e) => return Completion::failed("StartFailed", e.to_string()),
            },
            None if config.sandboxes.is_some() => {
                return Completion::failed(
                    "StartFailed",
                    "the session's sandbox is gone".to_owned(),
                );
            }
            None => (isolation::Place::Host, None),
        }
    };
    let cwd_path = PathBuf::from(format!("/proc/self/fd/{}", cwd_dir.as_raw_fd()));
    let (program, args): (OsString, Vec<OsString>) = match program {
        Program::Argv(mut argv) => {
            let first = argv.remove(0);
            (first.into(), argv.into_iter().map(OsString::from).collect())
        }
        Program::Shell(line) => (
            config.shell.clone().into_os_string(),
            vec![OsString::from("-c"), OsString::from(line)],
        ),
    };
    let mut env = executor::base_env(
        &config.path_var,
        config.adapter,
        &session.workspace,
        &session.tmp,
    );
    env.extend(session.env.iter().cloned());
    env.extend(overrides);
    env.extend([
        (
            "KRUNTIME_ARTIFACTS_DIR".to_owned(),
            session.artifacts.display().to_string(),
        ),
        (
            "KRUNTIME_WORKSPACE".to_owned(),
            session.workspace.display().to_string(),
        ),
        (
            "KRUNTIME_RUN_UID".to_owned(),
            session.key.run_uid().to_owned(),
        ),
        (
            "KRUNTIME_ATTEMPT".to_owned(),
            session.key.attempt().to_string(),
        ),
        ("KRUNTIME_OPERATION_ID".to_owned(), operation_id.to_owned()),
    ]);
    let cgroup_procs = match &session.cgroup {
        Some(cgroup) => match cgroup.open_procs() {
            Ok(procs) => Some(procs),
            Err(e) => {
                tracing::error!(session = %session.key, error = %crate::tasks::service::chain(&e), "cgroup not usable");
                return Completion::failed(
                    "StartFailed",
                    "the session's cgroup cannot be joined".to_owned(),
                );
            }
        },
        None => None,
    };
    let shown = program.to_string_lossy().into_owned();
    let spawned = isolation::spawn_started(SpawnSpec {
        program,
        args,
        env,
        cwd: cwd_path,
        stdin: if stdin.is_empty() {
            Stdio::null()
        } else {
            Stdio::piped()
        },
        stdout: Stdio::piped(),
        stderr: Stdio::piped(),
        cgroup_procs,
        extra_fds: Vec::new(),
        place,
    })
    .await;
    drop(cwd_dir);
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) if oom.is_some() && e.source.raw_os_error() == Some(nix::libc::ESRCH) => {
            // Joining the sandbox found its PID 1 gone.
            return sandbox_lost(session);
        }
        Err(e) => {
            return Completion::failed(
                "StartFailed",
                format!("failed to start {:?}: {}", ids::bounded(&shown), e.source),
            );
        }
    };
    let pgid = child.id().unwrap_or(0);
    session.pgid.store(pgid, Ordering::SeqCst);

    let stdin_task = child.stdin.take().map(|mut pipe| {
        tokio::spawn(async move {
            // A command that exits without reading all of it closes the pipe (EPIPE).
            let _ = pipe.write_all(&stdin).await;
        })
    });
    let stdout_count = Arc::new(Counter::default());
    let stderr_count = Arc::new(Counter::default());
    let mut readers = Vec::new();
    if let Some(pipe) = child.stdout.take() {
        readers.push(tokio::spawn(pump(
            pipe,
            OutputStream::Stdout,
            tx.clone(),
            stdout_count.clone(),
        )));
    }
    if let Some(pipe) = child.stderr.take() {
        readers.push(tokio::spawn(pump(
            pipe,
            OutputStream::Stderr,
            tx.clone(),
            stderr_count.clone(),
        )));
    }

    let terminate = || {
        isolation::signal_group(pgid, Signal::SIGTERM);
        if let Some(cgroup) = &session.cgroup {
            let _ = cgroup.signal_outside_group(Signal::SIGTERM, pgid);
        }
    };
    let kill = || {
        isolation::signal_group(pgid, Signal::SIGKILL);
        if let Some(cgroup) = &session.cgroup
            && let Err(e) = cgroup.kill_all()
        {
            tracing::warn!(session = %session.key, error = %e, "cgroup kill failed");
        }
    };
    let mut control = session.control.subscribe();
    let mut control_open = true;
    let mut ending: Option<Ending> = None;
    let mut kill_at: Option<Instant> = None;
    let mut killed = false;
    let mut caller_gone = false;
    let status = loop {
        let now = *control.borrow_and_update();
        match now {
            Control::Run => {}
            Control::Terminate(grace) => {
                if ending.is_none() {
                    ending = Some(Ending::SessionClosed);
                    terminate();
                    kill_at = Some(Instant::now() + grace);
                }
            }
            Control::Kill => {
                if ending.is_none() {
                    ending = Some(Ending::SessionClosed);
                }
                if !killed {
                    killed = true;
                    kill_at = None;
                    kill();
                }
            }
        }
        tokio::select! {
            status = child.wait() => break status,
            () = tokio::time::sleep_until(deadline), if ending.is_none() => {
                ending = Some(Ending::Timeout);
                terminate();
                kill_at = Some(Instant::now() + config.termination_grace);
            }
            () = sleep_until_opt(kill_at), if kill_at.is_some() => {
                kill_at = None;
                killed = true;
                kill();
            }
            changed = control.changed(), if control_open => control_open = changed.is_ok(),
            () = tx.closed(), if !caller_gone => {
                // Nobody will see the result: stop at once.
                caller_gone = true;
                ending = ending.or(Some(Ending::CallerGone));
                if !killed {
                    killed = true;
                    kill_at = None;
                    kill();
                }
            }
        }
    };

    // The command has ended (and is reaped): nothing it started outlives it. That also
    // closes the pipes that its background processes hold. With a cgroup, kill through it
    // only: the reaped leader's pid may name no group any more.
    match &session.cgroup {
        Some(cgroup) => {
            if let Err(e) = cgroup.kill_all() {
                tracing::warn!(session = %session.key, error = %e, "cgroup kill failed");
            }
        }
        None => isolation::signal_group(pgid, Signal::SIGKILL),
    }
    // Completed means gone: wait for the killed processes to end.
    match &session.cgroup {
        Some(cgroup) => match cgroup.wait_empty(DRAIN_LIMIT).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(session = %session.key, "cgroup still populated after kill")
            }
            Err(e) => tracing::warn!(session = %session.key, error = %e, "cgroup not drained"),
        },
        None => {
            let deadline = Instant::now() + GROUP_LIMIT;
            while isolation::group_exists(pgid) && Instant::now() < deadline {
                tokio::time::sleep(GROUP_POLL).await;
            }
        }
    }
    session.pgid.store(0, Ordering::SeqCst);
    if let Some(task) = stdin_task {
        task.abort();
    }
    // Without a cgroup an escaped process may still hold a pipe: stop reading after a while.
    let drained = tokio::time::timeout(DRAIN_LIMIT, async {
        for reader in &mut readers {
            let _ = reader.await;
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(session = %session.key, "an output pipe stayed open after the command ended; stopped reading it");
        for reader in &readers {
            reader.abort();
        }
    }

    let mut completion = match status {
        Err(e) => Completion::failed("IoError", format!("failed to wait for the command: {e}")),
        Ok(status) => {
            let mut completion = match (ending, status.code()) {
                (Some(Ending::Timeout), _) => Completion::new(
                    OperationState::TimedOut,
                    "Timeout",
                    "exceeded its timeout; the command and everything it started were killed"
                        .to_owned(),
                ),
                (Some(Ending::SessionClosed), _) => Completion::new(
                    OperationState::Cancelled,
                    "SessionClosed",
                    "the session was closed".to_owned(),
                ),
                (Some(Ending::CallerGone), _) => Completion::new(
                    OperationState::Cancelled,
                    "Cancelled",
                    "the caller went away".to_owned(),
                ),
                (None, Some(0)) => Completion::succeeded(),
                (None, Some(code)) => {
                    Completion::failed("NonZeroExitCode", format!("exited with code {code}"))
                }
                (None, None) => Completion::failed(
                    "Signaled",
                    format!("killed by signal {}", status.signal().unwrap_or_default()),
                ),
            };
            let oom_killed = oom.and_then(|before| {
                super::lock(&session.sandbox)
                    .as_ref()
                    .filter(|s| s.oom_kills() > before)
                    .map(|s| s.oom_message("command"))
            });
            // A SIGKILL nobody here sent, in a sandbox, may be the sandbox ending under the
            // command; its programs see that before the sandbox's end is complete (under
            // gvisor `runsc exec` fails while the kernel's threads still exit).
            if oom_killed.is_none()
                && oom.is_some()
                && ending.is_none()
                && status.signal() == Some(nix::libc::SIGKILL)
                && sandbox_ends(session).await
            {
                completion = sandbox_lost(session);
            } else if let Some(message) = oom_killed {
                completion = Completion::failed("OOMKilled", message);
                // Under gvisor the OOM killer ends the whole sandbox kernel: the next
                // command gets a new one (the workspace is the same host directory).
                let revival = super::lock(&session.sandbox)
                    .as_ref()
                    .and_then(crate::sandbox::Sandbox::revival);
                if let Some(revival) = revival
                    && let Err(e) = revival.revive().await
                {
                    tracing::warn!(session = %session.key, error = %e, "the sandbox could not be replaced");
                }
            }
            completion.exit_code = status.code();
            completion.signal = status.signal();
            completion
        }
    };
    completion.stdout = stdout_count.totals();
    completion.stderr = stderr_count.totals();
    completion
}

/// Whether the session's sandbox ends on its own within [`SANDBOX_END_LIMIT`].
async fn sandbox_ends(session: &Session) -> bool {
    let Some(ends_within) = super::lock(&session.sandbox)
        .as_ref()
        .map(crate::sandbox::Sandbox::ends_within)
    else {
        return false;
    };
    tokio::task::spawn_blocking(move || ends_within(SANDBOX_END_LIMIT))
        .await
        .unwrap_or(false)
}

/// The session's sandbox ended on its own: with it the session's processes and /tmp are
/// lost. The session fails rather than refusing every later command.
fn sandbox_lost(session: &Session) -> Completion {
    let message = "the session's sandbox ended unexpectedly".to_owned();
    tracing::warn!(session = %session.key, "{message}");
    let mut info = session.info();
    // A session already closing keeps going to Closed.
    if matches!(
        info.state,
        super::SessionState::Registering | super::SessionState::Ready
    ) {
        info.state = super::SessionState::Failed;
        info.reason = "SandboxLost";
        info.message = message.clone();
    }
    drop(info);
    Completion::failed("SandboxLost", message)
}

/// Reads one stream to its end, sending it in chunks of at most [`CHUNK_BYTES`] until
/// [`MAX_STREAM_BYTES`] are sent (the chunk that crosses the bound is cut and marked
/// `truncated`); later bytes are counted and dropped. Keeps reading when the caller is gone.
async fn pump(
    mut reader: impl AsyncRead + Unpin,
    stream: OutputStream,
    tx: mpsc::Sender<OperationEvent>,
    count: Arc<Counter>,
) {
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut sent = 0usize;
    let mut sending = true;
    loop {
        let n = match reader.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        count.bytes.fetch_add(n as u64, Ordering::SeqCst);
        if !sending {
            continue;
        }
        let room = MAX_STREAM_BYTES - sent;
        let (take, truncated) = if n > room { (room, true) } else { (n, false) };
        sent += take;
        if truncated {
            count.truncated.store(true, Ordering::SeqCst);
            sending = false;
        }
        let event = OperationEvent::Output {
            stream,
            data: buf[..take].to_vec(),
            truncated,
        };
        if tx.send(event).await.is_err() {
            sending = false;
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
