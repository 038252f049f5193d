//! Starting a program in its own session, process group and (optionally) cgroup, and
//! signalling its group.
//!
//! This is the only module of the crate with `unsafe` code: the `pre_exec` hook that runs
//! in the forked child before `exec`. Everything the hook does is async-signal-safe: one
//! `write(2)` of `"0"` to an already open `cgroup.procs` (the kernel moves the writing
//! process) and `setsid(2)`. The module never decides when to kill; the executor does.

use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::process::Stdio;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

/// What to start.
#[derive(Debug)]
pub struct SpawnSpec {
    pub program: OsString,
    pub args: Vec<OsString>,
    /// The complete environment; nothing is inherited from the server.
    pub env: Vec<(String, String)>,
    pub cwd: PathBuf,
    pub stdout: File,
    pub stderr: File,
    /// `cgroup.procs` of the execution's cgroup, open for writing, when cgroups are used.
    pub cgroup_procs: Option<File>,
}

/// Why a program did not start.
#[derive(Debug, thiserror::Error)]
#[error("failed to start {program:?}")]
pub struct SpawnError {
    pub program: OsString,
    #[source]
    pub source: std::io::Error,
}

/// Starts the program. The child first joins the cgroup (when given), then becomes the
/// leader of a new session and process group whose id is its pid, then execs. Its stdin
/// is `/dev/null`; stdout and stderr are the given files. Dropping the returned [`Child`]
/// does not kill it.
#[allow(unsafe_code)]
pub fn spawn(spec: SpawnSpec) -> Result<Child, SpawnError> {
    let SpawnSpec {
        program,
        args,
        env,
        cwd,
        stdout,
        stderr,
        cgroup_procs,
    } = spec;
    let mut command = Command::new(&program);
    command
        .args(&args)
        .env_clear()
        .envs(env)
        .current_dir(&cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::from(stderr))
        .kill_on_drop(false);
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe operations are allowed. It allocates nothing and takes no lock:
    // `<&File as Write>::write_all` on a 1-byte slice is a single write(2) on a
    // descriptor opened before the fork (it is O_CLOEXEC, so it closes at exec), and
    // `setsid` is the setsid(2) system call. Errors are returned as `io::Error` built from
    // an errno, which does not allocate either.
    unsafe {
        command.pre_exec(move || {
            if let Some(procs) = &cgroup_procs {
                let mut procs: &File = procs;
                procs.write_all(b"0")?;
            }
            nix::unistd::setsid()
                .map_err(|errno| std::io::Error::from_raw_os_error(errno as i32))?;
            Ok(())
        });
    }
    command
        .spawn()
        .map_err(|source| SpawnError { program, source })
}

/// Sends `signal` to process group `pgid`. A group that no longer exists is not an error.
pub fn signal_group(pgid: u32, signal: Signal) {
    let Ok(raw) = i32::try_from(pgid) else {
        return;
    };
    if raw <= 1 {
        // Never signal "every process" (-1) or our own group (0) by accident.
        return;
    }
    let _ = killpg(Pid::from_raw(raw), signal);
}
