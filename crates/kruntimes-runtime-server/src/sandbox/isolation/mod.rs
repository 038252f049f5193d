//! Starting a program in its own session, process group and (optionally) cgroup, and
//! signalling its group; with the `namespaces` sandbox, starting a sandbox's holder in new
//! namespaces and starting programs inside a sandbox.
//!
//! This is the only module of the crate with `unsafe` code: the `pre_exec` hook that runs
//! in the forked child before `exec` ([`spawn`]), the holder's own start-up ([`holder`],
//! run in a fresh single-threaded process) and the system calls of confinement
//! ([`confine`]: seccomp, Landlock, pidfds). Everything the hook does is
//! async-signal-safe: `write(2)` of `"0"` to already open `cgroup.procs` files (the kernel
//! moves the writing process), `setsid(2)`, for extra descriptors (a function's request and
//! response pipes) `fcntl(F_DUPFD_CLOEXEC)` and `dup2(2)`, and for a sandbox `unshare(2)`
//! or `setns(2)`, `fork(2)`, `prctl(2)`, `setresuid(2)` and friends, `chdir(2)`,
//! `landlock_restrict_self(2)` and `seccomp(2)` on data prepared before the fork. The
//! module never decides when to kill; the executor, the function table and the sessions do.

pub mod confine;
pub mod gvisor;
pub mod holder;
pub mod launcher;
pub mod warm;

use std::ffi::{CString, OsString};
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::Command;

/// A standard stream of a program.
#[derive(Debug)]
pub enum Stdio {
    /// `/dev/null`.
    Null,
    /// A pipe whose other end is the [`Child`]'s `stdin`, `stdout` or `stderr`.
    Piped,
    /// This descriptor (a log file, say).
    Fd(OwnedFd),
}

impl Stdio {
    pub fn null() -> Self {
        Self::Null
    }

    pub fn piped() -> Self {
        Self::Piped
    }
}

impl From<File> for Stdio {
    fn from(file: File) -> Self {
        Self::Fd(file.into())
    }
}

impl From<OwnedFd> for Stdio {
    fn from(fd: OwnedFd) -> Self {
        Self::Fd(fd)
    }
}

impl From<Stdio> for std::process::Stdio {
    fn from(stdio: Stdio) -> Self {
        match stdio {
            Stdio::Null => std::process::Stdio::null(),
            Stdio::Piped => std::process::Stdio::piped(),
            Stdio::Fd(fd) => std::process::Stdio::from(fd),
        }
    }
}

/// A started program: a child of the server, or a program a sandbox's init started (see
/// [`launcher`]). Dropping it does not kill the program.
#[derive(Debug)]
pub struct Child {
    pub stdin: Option<tokio::process::ChildStdin>,
    pub stdout: Option<tokio::process::ChildStdout>,
    pub stderr: Option<tokio::process::ChildStderr>,
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    Host(tokio::process::Child),
    Launched(launcher::Launched),
}

impl Child {
    fn host(mut child: tokio::process::Child) -> Self {
        Self {
            stdin: child.stdin.take(),
            stdout: child.stdout.take(),
            stderr: child.stderr.take(),
            inner: Inner::Host(child),
        }
    }

    fn launched(
        launched: launcher::Launched,
        stdin: Option<tokio::process::ChildStdin>,
        stdout: Option<tokio::process::ChildStdout>,
        stderr: Option<tokio::process::ChildStderr>,
    ) -> Self {
        Self {
            stdin,
            stdout,
            stderr,
            inner: Inner::Launched(launched),
        }
    }

    /// Its host pid (the id of its process group and session), until it has been waited
    /// for.
    pub fn id(&self) -> Option<u32> {
        match &self.inner {
            Inner::Host(child) => child.id(),
            Inner::Launched(launched) => launched.id(),
        }
    }

    /// Waits for it to end. Cancel-safe.
    pub async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        match &mut self.inner {
            Inner::Host(child) => child.wait().await,
            Inner::Launched(launched) => launched.wait().await,
        }
    }

    pub fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        match &mut self.inner {
            Inner::Host(child) => child.try_wait(),
            Inner::Launched(launched) => launched.try_wait(),
        }
    }

    /// Sends it SIGKILL (it alone, not its group).
    pub fn start_kill(&mut self) -> std::io::Result<()> {
        match &mut self.inner {
            Inner::Host(child) => child.start_kill(),
            Inner::Launched(launched) => launched.start_kill(),
        }
    }

    /// Whether a sandbox's init started it.
    pub fn is_launched(&self) -> bool {
        matches!(self.inner, Inner::Launched(_))
    }
}

/// What to start.
#[derive(Debug)]
pub struct SpawnSpec {
    pub program: OsString,
    pub args: Vec<OsString>,
    /// The complete environment; nothing is inherited from the server.
    pub env: Vec<(String, String)>,
    pub cwd: PathBuf,
    /// Usually [`Stdio::Null`]; a pipe for programs that read a request on stdin.
    pub stdin: Stdio,
    /// Usually a log file; pipes where the caller captures the stream itself.
    pub stdout: Stdio,
    pub stderr: Stdio,
    /// `cgroup.procs` of the execution's cgroup, open for writing, when cgroups are used.
    pub cgroup_procs: Option<File>,
    /// Descriptors the child gets as fds 3, 4, ... in this order (at most
    /// [`MAX_EXTRA_FDS`]), without close-on-exec. The caller's copies stay close-on-exec
    /// and are closed when `spawn` returns, so the caller keeps only its own pipe ends.
    pub extra_fds: Vec<OwnedFd>,
    /// Where the program runs: on the host, as a sandbox's holder in new namespaces, or
    /// inside a sandbox.
    pub place: Place,
}

/// Where a program runs.
#[derive(Debug, Default)]
pub enum Place {
    /// The server's own namespaces (the `process` backend).
    #[default]
    Host,
    /// New mount, PID, network, IPC and UTS namespaces, after joining the given cgroups:
    /// a sandbox's holder, whose first child becomes the sandbox's PID 1.
    NewNamespaces { cgroups: std::sync::Arc<[File]> },
    /// Inside a sandbox (see [`Enter`]).
    Sandbox(Enter),
    /// On the host, after joining the given cgroups: `runsc run` (the processes it
    /// leaves, the sandbox kernel and its file proxy, stay there).
    Joined { cgroups: std::sync::Arc<[File]> },
    /// Inside a `gvisor` sandbox: `helper` (on the host) runs the program there through
    /// `runsc exec` (see [`gvisor`]).
    Gvisor {
        helper: PathBuf,
        container: gvisor::Container,
    },
}

/// How a program enters a sandbox. In the forked child: join the sandbox's cgroups, then
/// its namespaces through the holder's pidfd; fork once more (only a child of the joining
/// process is in the sandbox's PID namespace) and wait there, mirroring the program's
/// exit; the grandchild drops every capability and privilege, switches to the sandbox's
/// user, changes into `cwd`, applies Landlock and seccomp, and execs. `cwd` is a path
/// inside the sandbox: a descriptor opened outside it would point outside its root.
#[derive(Debug)]
pub struct Enter {
    /// The holder's init (the sandbox's PID 1), as a pidfd. Shared, so that a sandbox
    /// destroyed meanwhile cannot close it (and let its number be reused) before the fork.
    pub pidfd: std::sync::Arc<OwnedFd>,
    /// `cgroup.procs` of the sandbox's limit cgroups (cgroup v1 controllers), open for
    /// writing.
    pub cgroups: std::sync::Arc<[File]>,
    pub confine: Confine,
    /// The sandbox's launcher: its init starts the program (see [`launcher`]). Without
    /// it, the program is started by a fork of the server that enters the sandbox.
    pub launcher: Option<std::sync::Arc<launcher::Launcher>>,
}

/// What a program gives up before `execve` (see `confine`): every capability, root, and
/// the system calls and paths its filters deny; then it changes into `cwd`.
#[derive(Debug)]
pub struct Confine {
    /// A path inside the sandbox.
    pub cwd: CString,
    pub uid: u32,
    pub gid: u32,
    /// The highest capability number of the kernel (`/proc/sys/kernel/cap_last_cap`).
    pub cap_last: u32,
    /// The Landlock ruleset, when the kernel has Landlock.
    pub ruleset: Option<std::sync::Arc<OwnedFd>>,
    /// seccomp filters, installed in this order.
    pub filters: std::sync::Arc<Vec<seccompiler::BpfProgram>>,
    /// What `getppid()` must return once the death signal is set: the process that waits
    /// for the program (0 when it is outside the program's PID namespace, 1 when it is
    /// that namespace's init). Anything else means it is gone already.
    pub parent: nix::libc::pid_t,
}

/// At most this many extra descriptors are passed to a child.
pub const MAX_EXTRA_FDS: usize = 8;

/// Why a program did not start.
#[derive(Debug, thiserror::Error)]
#[error("failed to start {program:?}")]
pub struct SpawnError {
    pub program: OsString,
    #[source]
    pub source: std::io::Error,
}

/// Starts the program. The child first joins the cgroup (when given), then becomes the
/// leader of a new session and process group whose id is its pid, then receives the extra
/// descriptors as fds 3, 4, ..., then execs. Its stdin, stdout and stderr are the given
/// ones. Dropping the returned [`Child`] does not kill it.
///
/// Assumption about the extra descriptors: Rust's standard library reports a failed
/// `exec` to the parent through a close-on-exec pipe of its own. Were that pipe's write end
/// fd 3 or 4 in the child, the `dup2` below would replace it and a failed `exec` would show
/// as a child that dies at once instead of a spawn error. In the server the low
/// descriptors are taken at startup for good (the async runtime's epoll and wake-up fds,
/// the listening socket), so that pipe is never there.
#[allow(unsafe_code)]
pub fn spawn(spec: SpawnSpec) -> Result<Child, SpawnError> {
    let SpawnSpec {
        program,
        args,
        env,
        cwd,
        stdin,
        stdout,
        stderr,
        cgroup_procs,
        extra_fds,
        place,
    } = spec;
    if extra_fds.len() > MAX_EXTRA_FDS {
        return Err(SpawnError {
            program,
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("more than {MAX_EXTRA_FDS} extra descriptors"),
            ),
        });
    }
    // Plain numbers for the child: the closure must not own (and so never drop) them.
    let mut sources: [RawFd; MAX_EXTRA_FDS] = [-1; MAX_EXTRA_FDS];
    for (slot, fd) in sources.iter_mut().zip(&extra_fds) {
        *slot = fd.as_raw_fd();
    }
    let extra = extra_fds.len();
    // In a sandbox the program is exec'd by our own launching child, with arguments
    // prepared now (no allocation may happen after the fork).
    let exec = match &place {
        Place::Sandbox(_) => match confine::Exec::new(&program, &args, &env) {
            Some(exec) => Some(exec),
            None => {
                return Err(SpawnError {
                    program,
                    source: std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        "an argument or variable contains a NUL byte",
                    ),
                });
            }
        },
        _ => None,
    };
    // A `gvisor` program is started by the helper, which runs it in the sandbox.
    let (program, args) = match &place {
        Place::Gvisor { helper, container } => (
            helper.clone().into_os_string(),
            // The start-report pipe (the last extra descriptor) is the helper's, not the
            // program's.
            container.exec_args(extra - usize::from(container.report), &program, &args),
        ),
        _ => (program, args),
    };
    let mut command = Command::new(&program);
    command.args(&args).env_clear().envs(env);
    if matches!(place, Place::Gvisor { .. }) {
        command.current_dir("/");
    }
    if matches!(place, Place::Host) {
        // Joining a mount namespace moves the working directory to its root; `Enter`
        // changes directory inside the sandbox instead.
        command.current_dir(&cwd);
    }
    command
        .stdin(std::process::Stdio::from(stdin))
        .stdout(std::process::Stdio::from(stdout))
        .stderr(std::process::Stdio::from(stderr))
        .kill_on_drop(false);
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe operations are allowed. It allocates nothing and takes no lock:
    // `<&File as Write>::write_all` on a 1-byte slice is a single write(2) on a
    // descriptor opened before the fork (it is O_CLOEXEC, so it closes at exec), and
    // `setsid` is the setsid(2) system call. The extra descriptors are moved with
    // fcntl(2) and dup2(2), both async-signal-safe, on a fixed-size array copied into the
    // closure: first each source is duplicated to a number at or above 3 + extra (with
    // close-on-exec, so the copies vanish at exec), which no target can overwrite, then
    // each copy is dup2'd onto its target 3 + i (dup2 clears close-on-exec on the target).
    // The sources are open in the parent until `spawn` returns, so they are open in the
    // child. Errors are returned as `io::Error` built from an errno, which does not
    // allocate either. A holder's `unshare(2)` is one system call; entering a sandbox is
    // `confine::enter`, whose own safety comment covers it, on an `Enter` built before
    // the fork and only borrowed here.
    unsafe {
        command.pre_exec(move || {
            if let Some(procs) = &cgroup_procs {
                let mut procs: &File = procs;
                procs.write_all(b"0")?;
            }
            nix::unistd::setsid()
                .map_err(|errno| std::io::Error::from_raw_os_error(errno as i32))?;
            let mut moved: [RawFd; MAX_EXTRA_FDS] = [-1; MAX_EXTRA_FDS];
            // At most MAX_EXTRA_FDS + 3, so the cast cannot truncate.
            let above = 3 + extra as RawFd;
            for (copy, source) in moved.iter_mut().zip(sources.iter()).take(extra) {
                let fd = nix::libc::fcntl(*source, nix::libc::F_DUPFD_CLOEXEC, above);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                *copy = fd;
            }
            for (i, fd) in moved.iter().take(extra).enumerate() {
                if nix::libc::dup2(*fd, 3 + i as RawFd) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // Nothing the server inherited without close-on-exec (its parent's
            // descriptors), and no signal it inherited ignored, reaches the program.
            close_on_exec_from(3 + extra as RawFd);
            default_dispositions();
            match &place {
                Place::Host | Place::Gvisor { .. } => Ok(()),
                Place::Joined { cgroups } => join_cgroups(cgroups),
                Place::NewNamespaces { cgroups } => {
                    join_cgroups(cgroups)?;
                    if nix::libc::unshare(NAMESPACES) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                }
                // SAFETY: we are in the forked child before exec (see `confine::enter`).
                Place::Sandbox(enter) => match &exec {
                    Some(exec) => confine::enter(enter, exec),
                    None => Err(std::io::Error::from_raw_os_error(nix::libc::EINVAL)),
                },
            }
        });
    }
    let spawned = command
        .spawn()
        .map(Child::host)
        .map_err(|source| SpawnError { program, source });
    // The child has its copies (or never started); ours must close, or the child never
    // sees end-of-file on a pipe whose other end only the caller holds.
    drop(extra_fds);
    spawned
}

/// How long a `gvisor` program may take to start.
const GVISOR_START_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Starts the program as [`spawn`] does; inside a `namespaces` sandbox with a launcher,
/// through it; inside a `gvisor` sandbox, also waits until it has started there (or
/// failed to: the same error `spawn` gives elsewhere, such as a program that does not
/// exist).
pub async fn spawn_started(mut spec: SpawnSpec) -> Result<Child, SpawnError> {
    if let Place::Sandbox(Enter {
        launcher: Some(_), ..
    }) = &spec.place
        && let Place::Sandbox(enter) = std::mem::take(&mut spec.place)
        && let Some(launcher) = &enter.launcher
    {
        return launcher.launch(spec, &enter).await;
    }
    let Place::Gvisor { container, .. } = &mut spec.place else {
        return spawn(spec);
    };
    let program = spec.program.clone();
    let failed = |source| SpawnError {
        program: program.clone(),
        source,
    };
    let (report_read, report_write) = std::io::pipe().map_err(failed)?;
    container.report = true;
    spec.extra_fds.push(report_write.into());
    let mut child = spawn(spec)?;
    let read = tokio::task::spawn_blocking(move || {
        let mut word = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(report_read, 5), &mut word)
            .map(|_| word)
    });
    let word = match tokio::time::timeout(GVISOR_START_LIMIT, read).await {
        Ok(Ok(Ok(word))) => word,
        Ok(Ok(Err(e))) => return Err(failed(e)),
        Ok(Err(e)) => return Err(failed(std::io::Error::other(e))),
        Err(_) => {
            let _ = child.start_kill();
            let _ = child.wait().await;
            return Err(failed(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the sandbox did not start it within {GVISOR_START_LIMIT:?}"),
            )));
        }
    };
    match word.as_slice() {
        [b'e', a, b, c, d] => {
            let _ = child.wait().await;
            Err(failed(std::io::Error::from_raw_os_error(
                i32::from_ne_bytes([*a, *b, *c, *d]),
            )))
        }
        // Started, or the helper ended without a word: its exit says the rest.
        _ => Ok(child),
    }
}

/// The namespaces of a sandbox: mount, PID, network, IPC and UTS.
pub const NAMESPACES: nix::libc::c_int = nix::libc::CLONE_NEWNS
    | nix::libc::CLONE_NEWPID
    | nix::libc::CLONE_NEWNET
    | nix::libc::CLONE_NEWIPC
    | nix::libc::CLONE_NEWUTS;

/// Marks every descriptor from `first` on close-on-exec (async-signal-safe: system calls
/// on integers). Where close_range(2) cannot (before Linux 5.11), each descriptor below
/// the open-files limit is marked one by one.
#[allow(unsafe_code)]
fn close_on_exec_from(first: RawFd) {
    // From <linux/close_range.h>.
    const CLOSE_RANGE_CLOEXEC: nix::libc::c_uint = 4;
    // SAFETY: close_range, getrlimit and fcntl on integers and a local struct only.
    unsafe {
        if nix::libc::syscall(
            nix::libc::SYS_close_range,
            first as nix::libc::c_uint,
            nix::libc::c_uint::MAX,
            CLOSE_RANGE_CLOEXEC,
        ) == 0
        {
            return;
        }
        let mut limit = nix::libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        let top = if nix::libc::getrlimit(nix::libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur.min(1 << 20) as RawFd
        } else {
            1024
        };
        for fd in first..top {
            nix::libc::fcntl(fd, nix::libc::F_SETFD, nix::libc::FD_CLOEXEC);
        }
    }
}

/// Gives every signal its default disposition (async-signal-safe): an ignored signal
/// stays ignored across exec, and a program must not start with one its starter ignored.
/// The raw system call, because the C library's refuses the signals it keeps for itself;
/// a zeroed kernel `sigaction` is SIG_DFL with no flags and an empty mask.
#[allow(unsafe_code)]
fn default_dispositions() {
    let default = [0u64; 4];
    for signal in 1..=64 {
        if signal != nix::libc::SIGKILL && signal != nix::libc::SIGSTOP {
            // SAFETY: rt_sigaction reads the zeroed `default` we own; no old action.
            unsafe {
                nix::libc::syscall(
                    nix::libc::SYS_rt_sigaction,
                    signal,
                    default.as_ptr(),
                    std::ptr::null_mut::<u64>(),
                    8usize,
                );
            }
        }
    }
}

/// Joins each cgroup whose `cgroup.procs` is open in `files` (async-signal-safe).
fn join_cgroups(files: &[File]) -> std::io::Result<()> {
    for procs in files {
        let mut procs: &File = procs;
        procs.write_all(b"0")?;
    }
    Ok(())
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

/// Whether process group `pgid` still has a member (an exited member counts until it is
/// reaped). Never true for "every process" or our own group.
pub fn group_exists(pgid: u32) -> bool {
    let Ok(raw) = i32::try_from(pgid) else {
        return false;
    };
    if raw <= 1 {
        return false;
    }
    !matches!(
        killpg(Pid::from_raw(raw), None),
        Err(nix::errno::Errno::ESRCH)
    )
}
