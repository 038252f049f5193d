//! The processes of the `gvisor` backend, besides `runsc` itself. All three are modes of
//! the small helper binary (`kruntimes-sandbox-holder`), which every sandbox sees
//! read-only at [`HELPER_INSIDE`]:
//!
//! - **init** ([`INIT_ARG`], inside): the container's PID 1. It reaps orphans and ends the
//!   container when the runtime server's lifeline (its fd 3) closes, so that no sandbox
//!   outlives its server.
//! - **exec** ([`EXEC_ARG`], on the host): what the runtime server starts for each
//!   program. It runs `runsc exec` with a process spec for the launcher, forwards the
//!   signals it gets (`runsc exec` forwards none: a SIGTERM ends it and leaves the program
//!   running) and ends as the program did. While it lives it holds the write end of a
//!   control pipe whose read end the launcher watches; when it dies, however it dies, the
//!   launcher kills the program's whole tree.
//! - **launch** ([`LAUNCH_ARG`], inside, as the sandbox's root with the capabilities it
//!   needs): starts a PID namespace whose init waits for the program (when that init
//!   ends, every process the program left behind, `setsid` or not, dies with it), and
//!   starts the program there, confined as in the `namespaces` backend (every capability
//!   dropped, the sandbox user, `no_new_privs`, the same seccomp filters). The program's
//!   wait status travels back to `exec` over a status pipe.
//!
//! The descriptors a program is given (fds 3, 4, ...: a function's request and response
//! pipes) pass through `runsc exec --pass-fd`; the control and status pipes follow them.
#![allow(unsafe_code)]

use std::convert::Infallible;
use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;

use nix::libc;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, SigmaskHow, Signal, sigprocmask};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{ForkResult, fork};

use super::Confine;
use super::confine::{self, Exec};

/// The first argument of the container's init.
pub const INIT_ARG: &str = "__gvisor-init";
/// The first argument of the host-side process that runs one program.
pub const EXEC_ARG: &str = "__gvisor-exec";
/// The first argument of the launcher inside the sandbox.
pub const LAUNCH_ARG: &str = "__gvisor-launch";
/// Where every sandbox sees the helper binary.
pub const HELPER_INSIDE: &str = "/.kruntimes/helper";

/// What the launcher may do before it confines the program: start PID and mount
/// namespaces and mount /proc, switch users, drop the bounding set, and signal the
/// program (another user). The program keeps none of them.
const LAUNCHER_CAPS: &[&str] = &[
    "CAP_SYS_ADMIN",
    "CAP_SETUID",
    "CAP_SETGID",
    "CAP_SETPCAP",
    "CAP_KILL",
];

/// The signals `exec` forwards to the program.
const FORWARDED: &[Signal] = &[
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
];

/// A status record: the program's wait status.
const STATUS_WAIT: i32 = 0;
/// A status record: the errno that kept the program from starting.
const STATUS_START: i32 = 1;
/// A status record: the program has exec'd.
const STATUS_STARTED: i32 = 2;

/// The largest environment the launcher reads.
const ENV_MAX: u64 = 4 << 20;

/// The exit code of `exec` when it, or the sandbox, failed before the program ran.
pub const EXEC_FAILED: i32 = 125;

/// One program in one running container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Container {
    pub runsc: PathBuf,
    /// `runsc`'s global flags (`--root`, `--platform`, ...), before the subcommand.
    pub flags: Vec<OsString>,
    pub id: String,
    /// The user and group the program runs as, inside.
    pub uid: u32,
    pub gid: u32,
    /// The program's working directory, inside.
    pub cwd: PathBuf,
    /// `RLIMIT_NPROC` inside: the sandbox's pids limit (the host's pids limit also counts
    /// the sandbox kernel's threads, so it is only a backstop).
    pub nproc: Option<u64>,
    /// Whether the server waits for the start report (on the descriptor after the
    /// program's extra ones).
    pub report: bool,
}

impl Container {
    /// The helper's command line (after its binary) that runs `program` with `extra`
    /// descriptors.
    pub fn exec_args(&self, extra: usize, program: &OsStr, args: &[OsString]) -> Vec<OsString> {
        let mut line: Vec<OsString> =
            vec![EXEC_ARG.into(), "--runsc".into(), self.runsc.clone().into()];
        for flag in &self.flags {
            line.extend(["--flag".into(), flag.clone()]);
        }
        line.extend([
            "--id".into(),
            self.id.clone().into(),
            "--uid".into(),
            self.uid.to_string().into(),
            "--gid".into(),
            self.gid.to_string().into(),
            "--cwd".into(),
            self.cwd.clone().into(),
            "--extra".into(),
            extra.to_string().into(),
        ]);
        if let Some(nproc) = self.nproc {
            line.extend(["--nproc".into(), nproc.to_string().into()]);
        }
        if self.report {
            line.extend(["--report".into(), "1".into()]);
        }
        line.push("--".into());
        line.push(program.to_owned());
        line.extend(args.iter().cloned());
        line
    }

    /// The inverse of [`Container::exec_args`] (without [`EXEC_ARG`]).
    pub fn parse(line: &[OsString]) -> Result<(Self, usize, OsString, Vec<OsString>), String> {
        let mut container = Self {
            runsc: PathBuf::new(),
            flags: Vec::new(),
            id: String::new(),
            uid: 0,
            gid: 0,
            cwd: PathBuf::from("/"),
            nproc: None,
            report: false,
        };
        let mut extra = 0usize;
        let mut rest = line.iter();
        let number = |v: &OsString, what: &str| -> Result<u64, String> {
            v.to_str()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| format!("{what}: not a number"))
        };
        loop {
            let Some(flag) = rest.next() else {
                return Err("no program".into());
            };
            if flag == "--" {
                break;
            }
            let value = rest
                .next()
                .ok_or_else(|| format!("{} needs a value", flag.to_string_lossy()))?;
            match flag.to_str() {
                Some("--runsc") => container.runsc = value.into(),
                Some("--flag") => container.flags.push(value.clone()),
                Some("--id") => {
                    container.id = value.to_str().ok_or("--id: not UTF-8")?.to_owned();
                }
                Some("--uid") => {
                    container.uid =
                        u32::try_from(number(value, "--uid")?).map_err(|e| e.to_string())?;
                }
                Some("--gid") => {
                    container.gid =
                        u32::try_from(number(value, "--gid")?).map_err(|e| e.to_string())?;
                }
                Some("--cwd") => container.cwd = value.into(),
                Some("--extra") => {
                    extra =
                        usize::try_from(number(value, "--extra")?).map_err(|e| e.to_string())?;
                    if extra > super::MAX_EXTRA_FDS {
                        return Err("--extra: too many descriptors".into());
                    }
                }
                Some("--nproc") => container.nproc = Some(number(value, "--nproc")?),
                Some("--report") => container.report = value == "1",
                _ => return Err(format!("unknown flag {}", flag.to_string_lossy())),
            }
        }
        let program = rest.next().ok_or("no program")?.clone();
        if container.runsc.as_os_str().is_empty() || container.id.is_empty() {
            return Err("--runsc and --id are required".into());
        }
        Ok((container, extra, program, rest.cloned().collect()))
    }
}

/// The container's init: closes the mount points gVisor made for the writable paths
/// (`args`), says `ready` on fd 4, then reaps orphans until the lifeline (fd 3) closes.
pub fn init_main(args: &[OsString]) -> ! {
    // SAFETY: fds 3 and 4 are the lifeline and the ready pipe that `runsc run --pass-fd`
    // gave this process; nothing else owns them.
    let (lifeline, mut ready) = unsafe { (File::from_raw_fd(3), File::from_raw_fd(4)) };
    // gVisor creates missing mount points (a workspace beneath the private /tmp, say)
    // world-writable; the sandbox user must not write beside its workspace. They are
    // this init's (root's), so it may change their mode without any capability.
    for path in args {
        for dir in std::path::Path::new(path).ancestors().skip(1) {
            if dir == std::path::Path::new("/") {
                break;
            }
            use std::os::unix::fs::PermissionsExt;
            if let Ok(meta) = std::fs::symlink_metadata(dir)
                && meta.is_dir()
                && meta.permissions().mode() & 0o7777 == 0o777
            {
                let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755));
            }
        }
    }
    let _ = ready.write_all(b"ready\n");
    drop(ready);
    super::holder::serve(&lifeline, None, None)
}

/// The host side of one program (see the module's documentation).
pub fn exec_main(args: &[OsString]) -> ! {
    match run_exec(args) {
        Ok(never) => match never {},
        Err(message) => {
            let _ = writeln!(std::io::stderr(), "kruntimes: {message}");
            std::process::exit(EXEC_FAILED)
        }
    }
}

/// Moves `fd` to a number at or above `low`, close-on-exec.
fn lift(fd: OwnedFd, low: RawFd) -> Result<OwnedFd, String> {
    // SAFETY: fcntl(2) on a descriptor we own; the new one is ours alone.
    let moved = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, low) };
    if moved < 0 {
        return Err(format!("fcntl: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `moved` is a new descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(moved) })
}

/// Puts `fd` at exactly `target`, without close-on-exec (for `runsc exec` to inherit).
fn place(fd: &OwnedFd, target: RawFd) -> Result<(), String> {
    // SAFETY: dup2(2) onto a number this process does not use otherwise (see `run_exec`).
    if unsafe { libc::dup2(fd.as_raw_fd(), target) } < 0 {
        return Err(format!("dup2: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

fn pipe() -> Result<(OwnedFd, OwnedFd), String> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))
}

fn utf8(value: &OsStr, what: &str) -> Result<String, String> {
    value
        .to_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("{what} is not UTF-8"))
}

fn run_exec(args: &[OsString]) -> Result<Infallible, String> {
    let (container, extra, program, program_args) = Container::parse(args)?;
    // With `report`, fd 3 + extra is the server's start-report pipe: moved out of the way
    // of the fixed numbers below.
    let mut report = match container.report {
        true => {
            // SAFETY: fd 3 + extra is the report pipe the server passed; owned from here.
            let fd = unsafe { OwnedFd::from_raw_fd(3 + extra as RawFd) };
            Some(File::from(lift(fd, 3 + extra as RawFd + 8)?))
        }
        false => None,
    };
    // Descriptors: 0-2 are the program's; 3..3+extra its extra ones; then the launcher's
    // control and status pipes and the process spec, at fixed numbers.
    let first = 3 + extra as RawFd;
    let (control_fd, status_fd, env_fd, spec_fd) = (first, first + 1, first + 2, first + 3);
    let mut launch: Vec<String> = vec![
        HELPER_INSIDE.into(),
        LAUNCH_ARG.into(),
        "--uid".into(),
        container.uid.to_string(),
        "--gid".into(),
        container.gid.to_string(),
        "--cwd".into(),
        utf8(container.cwd.as_os_str(), "the working directory")?,
        "--extra".into(),
        extra.to_string(),
    ];
    // `runsc exec` ignores a process spec's rlimits: the launcher sets it.
    if let Some(nproc) = container.nproc {
        launch.extend(["--nproc".into(), nproc.to_string()]);
    }
    launch.extend(["--".into(), utf8(&program, "the program")?]);
    for arg in &program_args {
        launch.push(utf8(arg, "an argument")?);
    }
    // The program's environment travels in a file of its own (NUL-separated `K=V`), not
    // in the launcher's: gVisor shows every process's /proc/PID/environ to the whole
    // sandbox, and the launcher's children keep its environment.
    let mut env = Vec::new();
    for (key, value) in std::env::vars_os() {
        if key.as_bytes().contains(&b'=') {
            return Err("a variable's name contains '='".into());
        }
        env.extend_from_slice(key.as_bytes());
        env.push(b'=');
        env.extend_from_slice(value.as_bytes());
        env.push(0);
    }
    let spec = serde_json::json!({
        "user": {"uid": 0, "gid": 0},
        "args": launch,
        "env": [],
        "cwd": "/",
        "capabilities": {
            "bounding": LAUNCHER_CAPS,
            "effective": LAUNCHER_CAPS,
            "permitted": LAUNCHER_CAPS,
        },
        "noNewPrivileges": false,
    });
    let spec = serde_json::to_vec(&spec).map_err(|e| format!("process spec: {e}"))?;
    let spec = memfd(c"kruntimes-process", &spec)?;
    let env = memfd(c"kruntimes-env", &env)?;
    let (control_read, control_write) = pipe()?;
    let (status_read, status_write) = pipe()?;
    // Lift everything above the fixed numbers first (a new pipe may sit on one of them),
    // then put the three the child inherits in place.
    let above = spec_fd + 1;
    let control_read = lift(control_read, above)?;
    let status_write = lift(status_write, above)?;
    let spec = lift(spec, above)?;
    let env = lift(env, above)?;
    let control_write = lift(control_write, above)?;
    let status_read = lift(status_read, above)?;
    place(&control_read, control_fd)?;
    place(&status_write, status_fd)?;
    place(&env, env_fd)?;
    place(&spec, spec_fd)?;
    drop((control_read, status_write, env, spec));

    let mut command = std::process::Command::new(&container.runsc);
    command
        .args(&container.flags)
        .arg("exec")
        .arg("--process")
        .arg(format!("/dev/fd/{spec_fd}"));
    for fd in 3..=env_fd {
        command.arg("--pass-fd").arg(format!("{fd}:{fd}"));
    }
    command
        .arg(&container.id)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin");
    // SAFETY: between fork and exec: setpgid(2) and sigprocmask(2), both
    // async-signal-safe. Its own process group keeps a SIGTERM meant for the program (sent
    // to this process's group) from ending `runsc exec`; the mask this process sets up
    // below must not reach it.
    unsafe {
        command.pre_exec(|| {
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            Ok(())
        });
    }
    let mut mask = SigSet::empty();
    for signal in FORWARDED {
        mask.add(*signal);
    }
    sigprocmask(SigmaskHow::SIG_BLOCK, Some(&mask), None)
        .map_err(|e| format!("sigprocmask: {e}"))?;
    let signals = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(|e| format!("signalfd: {e}"))?;
    let child = command.spawn();
    // Only `runsc exec` (and through it the sandbox) may hold these now: the program's
    // pipes must see end-of-file when the program ends, not when this process does.
    for fd in 3..=spec_fd {
        // SAFETY: closing descriptors this process was given or placed, which nothing else
        // in it uses.
        unsafe { libc::close(fd) };
    }
    let mut child = child.map_err(|e| format!("cannot run {}: {e}", container.runsc.display()))?;

    let mut control = File::from(control_write);
    let mut status = Vec::new();
    let mut chunk = [0u8; 64];
    // The first decisive record: the program's wait status, or why it did not start.
    let mut outcome: Option<(i32, i32)> = None;
    loop {
        let mut fds = [
            PollFd::new(status_read.as_fd(), PollFlags::POLLIN),
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(format!("poll: {e}")),
        }
        while let Ok(Some(info)) = signals.read_signal() {
            // The launcher sends it to the program's process group. A control pipe that
            // is gone (the launcher ended) is fine: so has the program.
            let _ = control.write_all(&[info.ssi_signo as u8]);
        }
        if fds[0].any().unwrap_or(true) {
            match nix::unistd::read(&status_read, &mut chunk) {
                Ok(0) => break,
                Ok(n) => {
                    status.extend_from_slice(&chunk[..n]);
                    while status.len() >= 8 {
                        let record: Vec<u8> = status.drain(..8).collect();
                        let field = |at: usize| {
                            i32::from_ne_bytes([
                                record[at],
                                record[at + 1],
                                record[at + 2],
                                record[at + 3],
                            ])
                        };
                        let (tag, value) = (field(0), field(4));
                        match tag {
                            STATUS_STARTED => tell(&mut report, b"s"),
                            STATUS_START => {
                                let mut word = vec![b'e'];
                                word.extend_from_slice(&value.to_ne_bytes());
                                tell(&mut report, &word);
                                outcome.get_or_insert((tag, value));
                            }
                            _ => {
                                outcome.get_or_insert((tag, value));
                            }
                        }
                    }
                }
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(format!("status pipe: {e}")),
            }
        }
    }
    // Never started and never said so: the server's wait ends at end-of-file.
    drop(report);
    let runsc = child.wait().map_err(|e| format!("runsc exec: {e}"))?;
    drop(control);
    match outcome {
        Some((STATUS_WAIT, raw)) => mirror(raw),
        Some((STATUS_START, errno)) => {
            let _ = writeln!(
                std::io::stderr(),
                "kruntimes: failed to start {:?}: {}",
                program,
                std::io::Error::from_raw_os_error(errno)
            );
            std::process::exit(127)
        }
        _ => {
            // The program never reported: the sandbox ended under it (an OOM kill ends
            // the whole sandbox kernel), or it never started. It is gone either way.
            let _ = writeln!(
                std::io::stderr(),
                "kruntimes: the sandbox ended before the program did (runsc exec {runsc})"
            );
            mirror(libc::SIGKILL)
        }
    }
}

/// Writes the start report to the server (once: the pipe closes after it).
fn tell(report: &mut Option<File>, word: &[u8]) {
    if let Some(mut pipe) = report.take() {
        let _ = pipe.write_all(word);
    }
}

/// A memory file holding `bytes`, its offset back at the start.
fn memfd(name: &std::ffi::CStr, bytes: &[u8]) -> Result<OwnedFd, String> {
    use std::io::{Seek, SeekFrom};
    let fd = nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
        .map_err(|e| format!("memfd_create: {e}"))?;
    let mut file = File::from(fd);
    file.write_all(bytes)
        .and_then(|()| file.seek(SeekFrom::Start(0)))
        .map_err(|e| format!("memfd: {e}"))?;
    Ok(file.into())
}

/// Ends this process as the program ended: the same exit code, or the same signal.
fn mirror(raw: i32) -> ! {
    confine::end_as(raw)
}

/// The launcher inside the sandbox (see the module's documentation).
pub fn launch_main(args: &[OsString]) -> ! {
    match run_launch(args) {
        Ok(never) => match never {},
        Err(message) => {
            let _ = writeln!(std::io::stderr(), "kruntimes: {message}");
            std::process::exit(EXEC_FAILED)
        }
    }
}

/// Writes one status record to `fd` (a pipe: one write of 8 bytes is atomic).
fn report(fd: RawFd, tag: i32, value: i32) {
    let mut record = [0u8; 8];
    record[..4].copy_from_slice(&tag.to_ne_bytes());
    record[4..].copy_from_slice(&value.to_ne_bytes());
    // SAFETY: write(2) of a local buffer.
    unsafe { libc::write(fd, record.as_ptr().cast(), record.len()) };
}

fn run_launch(args: &[OsString]) -> Result<Infallible, String> {
    let mut rest = args.iter();
    let (mut uid, mut gid, mut cwd, mut extra, mut nproc) = (None, None, None, None, None);
    loop {
        let flag = rest.next().ok_or("no program")?;
        if flag == "--" {
            break;
        }
        let value = rest
            .next()
            .and_then(|v| v.to_str())
            .ok_or("a flag needs a value")?;
        match flag.to_str() {
            Some("--uid") => uid = value.parse::<u32>().ok(),
            Some("--gid") => gid = value.parse::<u32>().ok(),
            Some("--cwd") => cwd = Some(value.to_owned()),
            Some("--nproc") => nproc = value.parse::<u64>().ok(),
            Some("--extra") => {
                extra = value
                    .parse::<RawFd>()
                    .ok()
                    .filter(|n| *n <= super::MAX_EXTRA_FDS as RawFd)
            }
            _ => return Err(format!("unknown flag {}", flag.to_string_lossy())),
        }
    }
    let (Some(uid), Some(gid), Some(cwd), Some(extra)) = (uid, gid, cwd, extra) else {
        return Err("--uid, --gid, --cwd and --extra are required".into());
    };
    let program = rest.next().ok_or("no program")?;
    let program_args: Vec<OsString> = rest.cloned().collect();
    let (control, status, env_fd) = (3 + extra, 4 + extra, 5 + extra);
    // SAFETY: the environment file `exec` passed as fd `env_fd`; owned here from now on.
    let mut env_file = unsafe { File::from_raw_fd(env_fd) };
    let mut env_bytes = Vec::new();
    std::io::Read::read_to_end(
        &mut std::io::Read::take(&mut env_file, ENV_MAX),
        &mut env_bytes,
    )
    .map_err(|e| format!("the environment: {e}"))?;
    drop(env_file);
    let env: Vec<(String, String)> = env_bytes
        .split(|b| *b == 0)
        .filter(|pair| !pair.is_empty())
        .filter_map(|pair| {
            let text = String::from_utf8_lossy(pair);
            let (key, value) = text.split_once('=')?;
            Some((key.to_owned(), value.to_owned()))
        })
        .collect();
    let exec = Exec::new(program, &program_args, &env).ok_or("an argument contains NUL")?;
    let confine = Confine {
        cwd: CString::new(cwd.as_bytes()).map_err(|_| "the working directory contains NUL")?,
        uid,
        gid,
        cap_last: confine::cap_last_cap(),
        ruleset: None,
        filters: std::sync::Arc::new(confine::filters()?),
        parent: 1,
    };
    // A PID namespace whose init waits for the program, and a mount namespace for its own
    // /proc (only the program's processes).
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWPID | nix::sched::CloneFlags::CLONE_NEWNS)
        .map_err(|e| format!("PID and mount namespaces: {e}"))?;
    let mut chld = SigSet::empty();
    chld.add(Signal::SIGCHLD);
    // `runsc exec` passes the signals it gets to this process: the program gets them
    // from `exec` over the control pipe instead, so they stay blocked here (and in the
    // namespace's init; the program starts with none blocked).
    let mut blocked = chld;
    for signal in FORWARDED {
        blocked.add(*signal);
    }
    sigprocmask(SigmaskHow::SIG_BLOCK, Some(&blocked), None)
        .map_err(|e| format!("sigprocmask: {e}"))?;
    let signals = SignalFd::with_flags(&chld, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(|e| format!("signalfd: {e}"))?;
    // SAFETY: this process is single-threaded (nothing here starts a thread), so the child
    // may allocate and take locks.
    let init = match unsafe { fork() }.map_err(|e| format!("fork: {e}"))? {
        ForkResult::Child => namespace_init(&confine, &exec, nproc, control, status),
        ForkResult::Parent { child } => child,
    };
    // SAFETY: the status pipe is the namespace init's to write; ours closes.
    unsafe { libc::close(status) };
    // SAFETY: the control pipe's read end, given as fd `control`; owned here from now on.
    let control = unsafe { OwnedFd::from_raw_fd(control) };
    let mut chunk = [0u8; 64];
    loop {
        let mut fds = [
            PollFd::new(control.as_fd(), PollFlags::POLLIN),
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(format!("poll: {e}")),
        }
        if fds[0].any().unwrap_or(true) {
            match nix::unistd::read(&control, &mut chunk) {
                Ok(0) | Err(nix::errno::Errno::EBADF) => {
                    // `exec` is gone: end the program and everything it started.
                    let _ = nix::sys::signal::kill(init, Signal::SIGKILL);
                    let _ = waitpid(init, None);
                    std::process::exit(0);
                }
                Ok(n) => {
                    for byte in &chunk[..n] {
                        if let Ok(signal) = Signal::try_from(i32::from(*byte)) {
                            let _ = nix::sys::signal::killpg(init, signal);
                        }
                    }
                }
                Err(_) => {}
            }
        }
        while let Ok(Some(_)) = signals.read_signal() {}
        if !matches!(
            waitpid(init, Some(WaitPidFlag::WNOHANG)),
            Ok(WaitStatus::StillAlive)
        ) {
            std::process::exit(0);
        }
    }
}

/// PID 1 of the program's namespace: starts the program, reaps everything, and when the
/// program has ended kills whatever it left behind and reports its status.
fn namespace_init(
    confine_: &Confine,
    exec: &Exec,
    nproc: Option<u64>,
    control: RawFd,
    status: RawFd,
) -> ! {
    // SAFETY: plain system calls on integers in a fresh single-threaded child.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
        // The launcher is in the parent namespace: it shows as 0 (1 would mean it is gone).
        if libc::getppid() != 0 {
            libc::_exit(EXEC_FAILED);
        }
        libc::close(control);
        // The program's process group: the launcher signals it as a whole.
        libc::setpgid(0, 0);
    }
    use nix::mount::{MsFlags, mount};
    let proc_mounted = mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .and_then(|()| {
        mount(
            Some("proc"),
            "/proc",
            Some("proc"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            None::<&str>,
        )
    });
    if let Err(e) = proc_mounted {
        report(status, STATUS_START, e as i32);
        std::process::exit(0);
    }
    // The program's own word on its start: its copy of the write end closes at a
    // successful exec; on failure it writes the errno.
    let (exec_read, exec_write) = match nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC) {
        Ok(ends) => ends,
        Err(e) => {
            report(status, STATUS_START, e as i32);
            std::process::exit(0)
        }
    };
    // SAFETY: single-threaded (a fresh child of a single-threaded process).
    let program = match unsafe { fork() } {
        Ok(ForkResult::Child) => {
            // SAFETY: system calls on integers and prepared data; `confine_and_exec` runs
            // in this single-threaded child, its documented context.
            unsafe {
                let mut none: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut none);
                libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
                libc::close(status);
                drop(exec_read);
                // The sandbox's pids limit: counted per user, so across the sandbox.
                let mut errno = 0;
                if let Some(n) = nproc {
                    let limit = libc::rlimit {
                        rlim_cur: n,
                        rlim_max: n,
                    };
                    if libc::setrlimit(libc::RLIMIT_NPROC, &limit) != 0 {
                        errno = nix::errno::Errno::last() as i32;
                    }
                }
                if errno == 0 {
                    errno = confine::confine_and_exec(confine_, exec);
                }
                libc::write(
                    exec_write.as_raw_fd(),
                    (&errno as *const i32).cast(),
                    std::mem::size_of::<i32>(),
                );
                libc::_exit(127)
            }
        }
        Ok(ForkResult::Parent { child }) => child,
        Err(e) => {
            report(status, STATUS_START, e as i32);
            std::process::exit(0)
        }
    };
    drop(exec_write);
    let mut errno = [0u8; 4];
    match nix::unistd::read(&exec_read, &mut errno) {
        Ok(4) => report(status, STATUS_START, i32::from_ne_bytes(errno)),
        _ => report(status, STATUS_STARTED, 0),
    }
    drop(exec_read);
    let mut raw = 0;
    loop {
        let mut wait_status = 0;
        // SAFETY: waitpid(2) into a local integer.
        let pid = unsafe { libc::waitpid(-1, &mut wait_status, 0) };
        if pid == program.as_raw() {
            raw = wait_status;
            break;
        }
        if pid < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            break;
        }
    }
    // SAFETY: kill(2): every other process of this namespace (the caller is its init).
    unsafe { libc::kill(-1, libc::SIGKILL) };
    report(status, STATUS_WAIT, raw);
    std::process::exit(0)
}

/// Which helper mode `arg` names, if any.
pub fn mode(arg: Option<&OsStr>) -> Option<fn(&[OsString]) -> !> {
    match arg.map(OsStr::as_bytes) {
        Some(b"__gvisor-init") => Some(init_main),
        Some(b"__gvisor-exec") => Some(exec_main),
        Some(b"__gvisor-launch") => Some(launch_main),
        _ => None,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn exec_arguments_round_trip() {
        let container = Container {
            runsc: "/usr/bin/runsc".into(),
            flags: vec!["--root=/r".into(), "--network=none".into()],
            id: "ss-a-1".into(),
            uid: 65534,
            gid: 65533,
            cwd: "/r/ws/sub dir".into(),
            nproc: Some(64),
            report: true,
        };
        let line = container.exec_args(2, OsStr::new("sh"), &["-c".into(), "--".into()]);
        assert_eq!(line[0], EXEC_ARG);
        let (parsed, extra, program, args) = Container::parse(&line[1..]).unwrap();
        assert_eq!(parsed, container);
        assert_eq!(extra, 2);
        assert_eq!(program, "sh");
        assert_eq!(args, ["-c", "--"]);
        assert!(Container::parse(&["--id".into()]).is_err());
        assert!(
            Container::parse(&["--extra".into(), "99".into(), "--".into(), "x".into()]).is_err()
        );
        assert!(Container::parse(&["--".into(), "x".into()]).is_err());
    }
}
