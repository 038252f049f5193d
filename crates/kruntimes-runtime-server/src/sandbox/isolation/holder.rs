//! A `namespaces` sandbox's holder: the small process that owns the sandbox's namespaces
//! for its whole life.
//!
//! The runtime server starts its own binary as `kruntimes-runtime-server __sandbox-holder
//! ...` in new mount, PID, network, IPC and UTS namespaces (see `Place::NewNamespaces`),
//! with a ready pipe as fd 3 and the server's lifeline as fd 4. The holder forks once: the
//! child is PID 1 of the new PID namespace (the "init"), builds the sandbox's filesystem,
//! brings up loopback, reports `ready` (or `error: ...`) on the ready pipe, then reaps
//! orphans until it is killed, told to stop, or the server's lifeline reaches end-of-file
//! (the server died). When the init ends, the kernel kills everything in its PID namespace.
//! The parent waits for the init and ends with it; killing the parent kills the init
//! (parent-death signal).
//!
//! The filesystem: a read-only tmpfs root holding read-only binds of the system
//! directories (`/usr`, `/etc`, `/bin`, `/sbin`, `/lib*`, kept as symlinks where the host
//! has symlinks), a private `/dev` (null, zero, full, random, urandom, tty and a private
//! `/dev/shm`), a fresh `/proc` of the new PID namespace (other users' processes hidden), a
//! private `/tmp`, and the given writable paths bound at their host paths, `nosuid` and
//! `nodev`. Nothing else of the host is reachable.
#![allow(unsafe_code)]

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};

use nix::libc;
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, SigmaskHow, Signal, sigprocmask};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{ForkResult, Pid, fork, pivot_root};

/// The first argument that makes the runtime server's binary a holder.
pub const HOLDER_ARG: &str = "__sandbox-holder";

/// The host directories every sandbox sees, read-only (those that exist).
pub const SYSTEM_DIRS: &[&str] = &[
    "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
];

/// The device nodes bound into the sandbox's `/dev`.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

/// The holder's settings, from its command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolderArgs {
    /// An empty host directory the new root is built on (inside the holder's own mount
    /// namespace only).
    pub stage: PathBuf,
    /// Host paths bound writable at the same path inside (directories or files).
    pub writable: Vec<PathBuf>,
    /// The size of the private `/tmp`, in bytes.
    pub tmp_bytes: u64,
    /// A warm sandbox: the control socket that binds the writable paths of the Run that
    /// takes it, once (see `warm`), follows the launcher socket.
    pub bind_later: bool,
    /// fd 5 is the launcher socket: the init starts the sandbox's programs (see
    /// `launcher`).
    pub launcher: bool,
}

impl HolderArgs {
    /// The launcher socket's descriptor, when there is one.
    pub fn launcher_fd(&self) -> Option<i32> {
        self.launcher.then_some(5)
    }

    /// The control socket's descriptor in a warm sandbox's holder: after the launcher's.
    pub fn control_fd(&self) -> Option<i32> {
        self.bind_later.then_some(5 + i32::from(self.launcher))
    }

    /// The command line after [`HOLDER_ARG`].
    pub fn to_args(&self) -> Vec<OsString> {
        let mut args = vec![
            OsString::from(HOLDER_ARG),
            "--stage".into(),
            self.stage.clone().into_os_string(),
            "--tmp-bytes".into(),
            self.tmp_bytes.to_string().into(),
        ];
        for path in &self.writable {
            args.push("--writable".into());
            args.push(path.clone().into_os_string());
        }
        if let Some(fd) = self.launcher_fd() {
            args.push("--launcher-fd".into());
            args.push(fd.to_string().into());
        }
        if let Some(fd) = self.control_fd() {
            args.push("--control-fd".into());
            args.push(fd.to_string().into());
        }
        args
    }

    /// Parses what [`HolderArgs::to_args`] wrote (without the program name and
    /// [`HOLDER_ARG`]).
    pub fn parse(args: &[OsString]) -> Result<Self, String> {
        let mut stage = None;
        let mut writable = Vec::new();
        let mut tmp_bytes = None;
        let mut control_fd = None;
        let mut launcher_fd = None;
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let value = it
                .next()
                .ok_or_else(|| format!("{} needs a value", flag.to_string_lossy()))?;
            let absolute = || {
                let path = PathBuf::from(value);
                if path.is_absolute() {
                    Ok(path)
                } else {
                    Err(format!("{} is not absolute", path.display()))
                }
            };
            match flag.to_str() {
                Some("--stage") => stage = Some(absolute()?),
                Some("--writable") => writable.push(absolute()?),
                Some("--tmp-bytes") => {
                    tmp_bytes = Some(
                        value
                            .to_str()
                            .and_then(|v| v.parse().ok())
                            .ok_or("--tmp-bytes is not a number")?,
                    );
                }
                Some(flag @ ("--control-fd" | "--launcher-fd")) => {
                    let fd: i32 = value
                        .to_str()
                        .and_then(|v| v.parse().ok())
                        .ok_or_else(|| format!("{flag} is not a number"))?;
                    if flag == "--control-fd" {
                        control_fd = Some(fd);
                    } else {
                        launcher_fd = Some(fd);
                    }
                }
                _ => return Err(format!("unknown flag {}", flag.to_string_lossy())),
            }
        }
        let parsed = Self {
            stage: stage.ok_or("--stage is missing")?,
            writable,
            tmp_bytes: tmp_bytes.ok_or("--tmp-bytes is missing")?,
            bind_later: control_fd.is_some(),
            launcher: launcher_fd.is_some(),
        };
        // The descriptors follow one another from 5, in this order.
        if parsed.control_fd() != control_fd || parsed.launcher_fd() != launcher_fd {
            return Err("unexpected descriptor numbers".into());
        }
        Ok(parsed)
    }
}

/// The holder's `main` (never returns).
pub fn main(args: &[OsString]) -> ! {
    let args = match HolderArgs::parse(args) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("sandbox holder: {e}");
            std::process::exit(2);
        }
    };
    let fds: Vec<i32> = [Some(3), Some(4), args.launcher_fd(), args.control_fd()]
        .into_iter()
        .flatten()
        .collect();
    for &fd in &fds {
        // SAFETY: fcntl(F_GETFD) only reads the flags of a descriptor number.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            eprintln!("sandbox holder: descriptor {fd} is not open");
            std::process::exit(2);
        }
        // None of them may reach a program of the sandbox, whatever else closes them.
        // SAFETY: fcntl(F_SETFD) sets the flags of a descriptor number.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    // SAFETY: fds 3 and 4 are open (checked above), were passed to us for this purpose by
    // the runtime server, and nothing else in this process owns them.
    let (ready, lifeline) = unsafe { (File::from_raw_fd(3), File::from_raw_fd(4)) };
    // SAFETY: as above, for the control socket of a warm sandbox and the launcher socket
    // (checked open above).
    let control = args
        .control_fd()
        .map(|fd| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) });
    // SAFETY: as above.
    let launcher = args
        .launcher_fd()
        .map(|fd| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) });
    // The holder must outlive any OOM in its sandbox: the OOM killer never picks it. Its
    // programs get back the score it had.
    let original = std::fs::read_to_string("/proc/self/oom_score_adj")
        .ok()
        .and_then(|v| std::ffi::CString::new(v.trim()).ok())
        .unwrap_or_else(|| c"0".to_owned());
    let _ = std::fs::write("/proc/self/oom_score_adj", "-1000");
    let launcher = launcher.map(|socket| (socket, super::launcher::Served::new(original)));
    // SAFETY: this process is single-threaded (no thread has been started), so the child
    // may do anything after fork.
    match unsafe { fork() } {
        Ok(ForkResult::Child) => init(&args, ready, lifeline, control, launcher),
        Ok(ForkResult::Parent { child }) => {
            drop(ready);
            drop(lifeline);
            drop(control);
            drop(launcher);
            loop {
                match waitpid(child, None) {
                    Ok(WaitStatus::Exited(_, code)) => std::process::exit(code),
                    Ok(WaitStatus::Signaled(..)) => std::process::exit(137),
                    Ok(_) | Err(nix::errno::Errno::EINTR) => continue,
                    Err(_) => std::process::exit(1),
                }
            }
        }
        Err(e) => {
            let mut ready = ready;
            let _ = writeln!(ready, "error: fork: {e}");
            std::process::exit(1);
        }
    }
}

/// PID 1 of the sandbox.
fn init(
    args: &HolderArgs,
    mut ready: File,
    lifeline: File,
    control: Option<std::os::fd::OwnedFd>,
    launcher: Option<Launcher>,
) -> ! {
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes integers only.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
    match build(args) {
        Ok(()) => {
            let _ = ready.write_all(b"ready\n");
        }
        Err(e) => {
            let mut line = format!("error: {e}");
            line.truncate(900);
            let _ = writeln!(ready, "{line}");
            std::process::exit(1);
        }
    }
    drop(ready);
    serve(&lifeline, control, launcher)
}

/// The launcher socket and its state.
type Launcher = (std::os::fd::OwnedFd, super::launcher::Served);

fn fail(what: impl std::fmt::Display) -> impl FnOnce(nix::errno::Errno) -> String {
    move |e| format!("{what}: {e}")
}

fn io_fail(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> String {
    move |e| format!("{what}: {e}")
}

/// `path` (absolute) beneath `stage`.
fn staged(stage: &Path, path: &Path) -> PathBuf {
    stage.join(path.strip_prefix("/").unwrap_or(path))
}

fn tmpfs(target: &Path, flags: MsFlags, options: &str) -> Result<(), String> {
    mount(Some("tmpfs"), target, Some("tmpfs"), flags, Some(options))
        .map_err(fail(format_args!("mount tmpfs on {}", target.display())))
}

/// Binds `source` on `target`, then makes the bind read-only (or not), `nosuid`, `nodev`.
fn bind(source: &Path, target: &Path, read_only: bool) -> Result<(), String> {
    mount(
        Some(source),
        target,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(fail(format_args!("bind {}", source.display())))?;
    let mut flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    mount(None::<&str>, target, None::<&str>, flags, None::<&str>)
        .map_err(fail(format_args!("remount {}", target.display())))?;
    // The remount reaches the top mount only; submounts of the recursive bind (say a
    // separate /usr/local) get the same attributes through mount_setattr(AT_RECURSIVE).
    set_recursive(target, read_only)
}

/// `struct mount_attr` of mount_setattr(2).
#[repr(C)]
pub(super) struct MountAttr {
    pub(super) attr_set: u64,
    pub(super) attr_clr: u64,
    pub(super) propagation: u64,
    pub(super) userns_fd: u64,
}

/// Makes every mount beneath `target` `nosuid`, `nodev` and (when asked) read-only. A
/// kernel without mount_setattr (before 5.12) keeps the top mount's attributes only.
fn set_recursive(target: &Path, read_only: bool) -> Result<(), String> {
    const MOUNT_ATTR_RDONLY: u64 = 0x1;
    const MOUNT_ATTR_NOSUID: u64 = 0x2;
    const MOUNT_ATTR_NODEV: u64 = 0x4;
    let path = std::ffi::CString::new(target.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{} contains NUL", target.display()))?;
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_NOSUID
            | MOUNT_ATTR_NODEV
            | if read_only { MOUNT_ATTR_RDONLY } else { 0 },
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: mount_setattr reads the NUL-terminated path and the `MountAttr` we own for
    // the duration of the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::AT_RECURSIVE as libc::c_uint,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc != 0 {
        let error = std::io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::ENOSYS) {
            return Err(format!("mount_setattr {}: {error}", target.display()));
        }
    }
    Ok(())
}

/// Builds the sandbox's root and moves into it.
fn build(args: &HolderArgs) -> Result<(), String> {
    let stage = &args.stage;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(fail("make / private"))?;
    tmpfs(
        stage,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        "mode=0755,size=16m",
    )?;
    for dir in SYSTEM_DIRS {
        let host = Path::new(dir);
        let target = staged(stage, host);
        match std::fs::symlink_metadata(host) {
            Err(_) => continue,
            Ok(meta) if meta.file_type().is_symlink() => {
                let link =
                    std::fs::read_link(host).map_err(io_fail(format_args!("readlink {dir}")))?;
                std::os::unix::fs::symlink(&link, &target)
                    .map_err(io_fail(format_args!("symlink {dir}")))?;
            }
            Ok(meta) if meta.is_dir() => {
                std::fs::create_dir(&target).map_err(io_fail(format_args!("mkdir {dir}")))?;
                bind(host, &target, true)?;
            }
            Ok(_) => continue,
        }
    }
    build_dev(stage)?;
    let proc_dir = stage.join("proc");
    std::fs::create_dir(&proc_dir).map_err(io_fail("mkdir /proc"))?;
    let proc_flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount(
        Some("proc"),
        &proc_dir,
        Some("proc"),
        proc_flags,
        Some("hidepid=invisible"),
    )
    .or_else(|_| {
        mount(
            Some("proc"),
            &proc_dir,
            Some("proc"),
            proc_flags,
            Some("hidepid=2"),
        )
    })
    .map_err(fail("mount /proc"))?;
    let tmp = stage.join("tmp");
    std::fs::create_dir(&tmp).map_err(io_fail("mkdir /tmp"))?;
    tmpfs(
        &tmp,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        &format!("mode=1777,size={}", args.tmp_bytes.max(4096)),
    )?;
    for path in &args.writable {
        let target = staged(stage, path);
        let meta = std::fs::metadata(path).map_err(io_fail(format_args!("{}", path.display())))?;
        if meta.is_dir() {
            std::fs::create_dir_all(&target)
                .map_err(io_fail(format_args!("mkdir {}", path.display())))?;
        } else {
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(io_fail(format_args!("mkdir {}", parent.display())))?;
            }
            File::create(&target).map_err(io_fail(format_args!("create {}", path.display())))?;
        }
        bind(path, &target, false)?;
    }
    nix::unistd::chdir(stage).map_err(fail("chdir to the new root"))?;
    pivot_root(".", ".").map_err(fail("pivot_root"))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(fail("detach the old root"))?;
    nix::unistd::chdir("/").map_err(fail("chdir /"))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REMOUNT
            | MsFlags::MS_BIND
            | MsFlags::MS_RDONLY
            | MsFlags::MS_NOSUID
            | MsFlags::MS_NODEV,
        None::<&str>,
    )
    .map_err(fail("make / read-only"))?;
    nix::unistd::sethostname("sandbox").map_err(fail("sethostname"))?;
    loopback_up()
}

fn build_dev(stage: &Path) -> Result<(), String> {
    let dev = stage.join("dev");
    std::fs::create_dir(&dev).map_err(io_fail("mkdir /dev"))?;
    tmpfs(
        &dev,
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        "mode=0755,size=64k",
    )?;
    for name in DEVICES {
        let host = Path::new("/dev").join(name);
        if !host.exists() {
            continue;
        }
        let target = dev.join(name);
        File::create(&target).map_err(io_fail(format_args!("create /dev/{name}")))?;
        mount(
            Some(&host),
            &target,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(fail(format_args!("bind /dev/{name}")))?;
    }
    for (name, to) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(to, dev.join(name))
            .map_err(io_fail(format_args!("symlink /dev/{name}")))?;
    }
    let shm = dev.join("shm");
    std::fs::create_dir(&shm).map_err(io_fail("mkdir /dev/shm"))?;
    tmpfs(
        &shm,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        "mode=1777,size=64m",
    )
}

/// Sets `lo` up in the sandbox's (otherwise empty) network namespace.
fn loopback_up() -> Result<(), String> {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0")
        .or_else(|_| {
            // Before `lo` is up, binding 127.0.0.1 may fail; any datagram socket will do.
            std::net::UdpSocket::bind("0.0.0.0:0")
        })
        .map_err(io_fail("socket for loopback"))?;
    // SAFETY: `ifreq` is plain data; zeroed is a valid value.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (slot, byte) in request.ifr_name.iter_mut().zip(b"lo\0") {
        *slot = *byte as libc::c_char;
    }
    request.ifr_ifru.ifru_flags = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    // SAFETY: SIOCSIFFLAGS reads the `ifreq` we own for the duration of the call.
    let rc = unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCSIFFLAGS, &request) };
    if rc < 0 {
        return Err(format!(
            "bring up loopback: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

/// Reaps orphans until told to stop or the lifeline ends; in a warm sandbox, binds the
/// writable paths of the one request `control` brings, then closes it; once bound (or
/// from the start, in a sandbox built for its Run), starts the programs `launcher` asks
/// for and reports their ends.
pub(super) fn serve(
    lifeline: &File,
    mut control: Option<std::os::fd::OwnedFd>,
    mut launcher: Option<Launcher>,
) -> ! {
    let mut mask = SigSet::empty();
    for signal in [
        Signal::SIGCHLD,
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
    ] {
        mask.add(signal);
    }
    if sigprocmask(SigmaskHow::SIG_BLOCK, Some(&mask), None).is_err() {
        std::process::exit(1);
    }
    let Ok(signals) = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
    else {
        std::process::exit(1);
    };
    loop {
        let mut fds = vec![
            PollFd::new(lifeline.as_fd(), PollFlags::POLLIN),
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
        ];
        if let Some(control) = &control {
            fds.push(PollFd::new(control.as_fd(), PollFlags::POLLIN));
        } else if let Some((socket, _)) = &launcher {
            // Not before a warm sandbox is bound.
            fds.push(PollFd::new(socket.as_fd(), PollFlags::POLLIN));
        }
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(_) => std::process::exit(1),
        }
        let third_ready = fds.get(2).is_some_and(|fd| fd.any().unwrap_or(true));
        let control_ready = third_ready && control.is_some();
        let launch_ready = third_ready && control.is_none();
        let lifeline_ready = fds[0].any().unwrap_or(true);
        drop(fds);
        if lifeline_ready {
            // The server is gone (or wrote, which it never does): end the sandbox. This
            // process is its init; every other process it may signal goes first, so that
            // nothing depends on the init's exit alone (gVisor keeps a container whose
            // init ended alive while exec'd processes remain).
            let _ = nix::sys::signal::kill(Pid::from_raw(-1), Signal::SIGKILL);
            std::process::exit(0);
        }
        if control_ready && let Some(socket) = control.take() {
            // One request at most: the socket is closed after it, so a sandbox is bound
            // for one Run only.
            if let Some(request) = super::warm::receive(socket.as_raw_fd()) {
                let result =
                    request.and_then(|(targets, trees)| super::warm::attach(&targets, trees));
                super::warm::answer(socket.as_raw_fd(), &result);
            }
        }
        if launch_ready
            && let Some((socket, served)) = &mut launcher
            && !served.serve_one(socket.as_raw_fd())
        {
            // The server gave the sandbox up; the lifeline or a signal ends it.
            launcher = None;
        }
        while let Ok(Some(info)) = signals.read_signal() {
            if info.ssi_signo != Signal::SIGCHLD as u32 {
                std::process::exit(0);
            }
        }
        loop {
            let mut status = 0;
            // SAFETY: waitpid with WNOHANG and a status integer we own.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
            if let Some((socket, served)) = &mut launcher {
                served.reaped(Some(socket.as_raw_fd()), pid, status);
            }
        }
    }
}

/// Whether `arg` is [`HOLDER_ARG`].
pub fn is_holder(arg: Option<&OsStr>) -> bool {
    arg == Some(OsStr::new(HOLDER_ARG))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn arguments_round_trip() {
        let args = HolderArgs {
            stage: "/r/stage".into(),
            writable: vec!["/r/ws".into(), "/r/outputs".into()],
            tmp_bytes: 1 << 20,
            bind_later: false,
            launcher: true,
        };
        let line = args.to_args();
        assert_eq!(HolderArgs::parse(&line[1..]).unwrap(), args);
        let warm = HolderArgs {
            writable: Vec::new(),
            bind_later: true,
            ..args.clone()
        };
        assert_eq!(HolderArgs::parse(&warm.to_args()[1..]).unwrap(), warm);
        assert_eq!((warm.launcher_fd(), warm.control_fd()), (Some(5), Some(6)));
        let bare = HolderArgs {
            launcher: false,
            ..warm.clone()
        };
        assert_eq!(HolderArgs::parse(&bare.to_args()[1..]).unwrap(), bare);
        assert_eq!(bare.control_fd(), Some(5));
        let swapped: Vec<std::ffi::OsString> = ["--stage", "/s", "--tmp-bytes", "1"]
            .into_iter()
            .chain(["--control-fd", "5", "--launcher-fd", "6"])
            .map(Into::into)
            .collect();
        assert!(HolderArgs::parse(&swapped).is_err());
        assert_eq!(line[0], HOLDER_ARG);
        assert_eq!(HolderArgs::parse(&line[1..]).unwrap(), args);
        assert!(HolderArgs::parse(&["--stage".into(), "rel".into()]).is_err());
        assert!(HolderArgs::parse(&["--bogus".into(), "x".into()]).is_err());
        assert!(HolderArgs::parse(&["--stage".into()]).is_err());
    }
}
