//! Binding a Run's writable paths into a sandbox built ahead of time (a warm sandbox).
//!
//! A warm sandbox's holder is started with no writable paths and one end of a
//! `SOCK_SEQPACKET` control socket. When a Run takes the sandbox, the runtime server
//! clones each writable host path as a detached mount (`open_tree(OPEN_TREE_CLONE |
//! AT_RECURSIVE)`, in the host's mount namespace) and sends the target paths and the
//! mounts' descriptors in one message (`SCM_RIGHTS`). The holder's init, PID 1 inside the
//! sandbox's mount namespace and still privileged there, makes each detached tree
//! private, `nosuid` and `nodev` (`mount_setattr`), attaches it at its host path
//! (`move_mount`), answers `ok` or `error: ...` and closes its end: a warm sandbox is
//! bound once, for one Run, and never again. No program of the sandbox runs before the
//! answer, so the moment its read-only root is writable (to make the mount points) is
//! seen by no program.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{
    AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, recvmsg,
    sendmsg, socketpair,
};

/// At most this many paths are bound in one message.
pub const MAX_BINDS: usize = 8;
/// The largest request or answer.
pub const MAX_MESSAGE: usize = 16 * 1024;

/// A control socket pair: (the server's end, the holder's end), both close-on-exec.
pub fn control_pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(std::io::Error::from)
}

/// A detached copy of the mount tree at `path` (a directory or a file), from this
/// process's mount namespace.
pub fn clone_tree(path: &Path) -> std::io::Result<OwnedFd> {
    // From <linux/mount.h>: OPEN_TREE_CLONE = 1, OPEN_TREE_CLOEXEC = O_CLOEXEC.
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::other("the path contains NUL"))?;
    // SAFETY: open_tree reads the NUL-terminated path for the duration of the call and
    // returns a new descriptor (or -1), which we own from here on.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            c_path.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint | libc::AT_RECURSIVE as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Server side: sends `targets` with their detached mounts over `control` and waits (at
/// most `limit`) for the holder's answer. Blocking: call it off the async runtime.
pub fn request(
    control: &OwnedFd,
    targets: &[PathBuf],
    trees: &[OwnedFd],
    limit: Duration,
) -> Result<(), String> {
    if targets.len() != trees.len() || targets.len() > MAX_BINDS {
        return Err(format!("cannot bind {} paths at once", targets.len()));
    }
    let mut payload = Vec::new();
    for path in targets {
        payload.extend_from_slice(path.as_os_str().as_encoded_bytes());
        payload.push(0);
    }
    if payload.len() > MAX_MESSAGE {
        return Err("the writable paths are too long".into());
    }
    if payload.is_empty() {
        payload.push(0);
    }
    let fds: Vec<RawFd> = trees.iter().map(AsRawFd::as_raw_fd).collect();
    let cmsgs = [ControlMessage::ScmRights(&fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsgs };
    sendmsg::<()>(
        control.as_raw_fd(),
        &[IoSlice::new(&payload)],
        cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(|e| format!("send to the holder: {e}"))?;
    let timeout = nix::sys::time::TimeVal::new(
        limit.as_secs() as libc::time_t,
        limit.subsec_micros() as libc::suseconds_t,
    );
    nix::sys::socket::setsockopt(control, nix::sys::socket::sockopt::ReceiveTimeout, &timeout)
        .map_err(|e| format!("control socket timeout: {e}"))?;
    let mut answer = vec![0u8; 1024];
    let n = loop {
        match nix::sys::socket::recv(control.as_raw_fd(), &mut answer, MsgFlags::empty()) {
            Ok(n) => break n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(nix::errno::Errno::EAGAIN) => {
                return Err(format!("the holder did not bind within {limit:?}"));
            }
            Err(e) => return Err(format!("the holder's answer: {e}")),
        }
    };
    let answer = String::from_utf8_lossy(&answer[..n]);
    let answer = answer.trim();
    if answer == "ok" {
        return Ok(());
    }
    Err(match answer.strip_prefix("error: ") {
        Some(reason) => format!("the holder could not bind: {reason}"),
        None if answer.is_empty() => "the holder ended before it bound".to_owned(),
        None => format!("the holder answered {answer:?}"),
    })
}

/// One request: the target paths and their detached mounts, in order.
pub type Request = (Vec<PathBuf>, Vec<OwnedFd>);

/// Holder side: one request read from `control` (`None` at end-of-file: the server gave
/// the sandbox up without using it).
pub fn receive(control: RawFd) -> Option<Result<Request, String>> {
    let mut buffer = vec![0u8; MAX_MESSAGE];
    let mut space = nix::cmsg_space!([RawFd; MAX_BINDS]);
    let (bytes, fds, truncated) = loop {
        let mut iov = [IoSliceMut::new(&mut buffer)];
        match recvmsg::<()>(
            control,
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(msg) => {
                let mut fds = Vec::new();
                if let Ok(cmsgs) = msg.cmsgs() {
                    for cmsg in cmsgs {
                        if let ControlMessageOwned::ScmRights(received) = cmsg {
                            // SAFETY: the kernel installed these descriptors in this
                            // process for us; nothing else owns them.
                            fds.extend(
                                received
                                    .into_iter()
                                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                            );
                        }
                    }
                }
                let truncated = msg
                    .flags
                    .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
                break (msg.bytes, fds, truncated);
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Some(Err(format!("receive: {e}"))),
        }
    };
    if bytes == 0 {
        return None;
    }
    if truncated {
        return Some(Err("the request was too large".into()));
    }
    let mut targets = Vec::new();
    for part in buffer[..bytes].split(|b| *b == 0) {
        if part.is_empty() {
            continue;
        }
        let path =
            PathBuf::from(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(part));
        let plain = path.is_absolute()
            && path
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
        if !plain || path == Path::new("/") {
            return Some(Err(format!(
                "{} is not a plain absolute path",
                path.display()
            )));
        }
        targets.push(path);
    }
    if targets.len() != fds.len() {
        return Some(Err(format!(
            "{} paths but {} mounts",
            targets.len(),
            fds.len()
        )));
    }
    Some(Ok((targets, fds)))
}

/// Holder side: answers the request.
pub fn answer(control: RawFd, result: &Result<(), String>) {
    let mut line = match result {
        Ok(()) => "ok".to_owned(),
        Err(e) => format!("error: {e}"),
    };
    line.truncate(900);
    let _ = nix::sys::socket::send(control, line.as_bytes(), MsgFlags::MSG_NOSIGNAL);
}

/// Holder side, inside the sandbox's mount namespace: makes each detached tree private,
/// `nosuid` and `nodev` and attaches it at its target, creating the mount point (the
/// root is made writable for this and read-only again, whatever happens).
pub fn attach(targets: &[PathBuf], trees: Vec<OwnedFd>) -> Result<(), String> {
    use nix::mount::{MsFlags, mount};
    let ro = MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount(None::<&str>, "/", None::<&str>, ro, None::<&str>)
        .map_err(|e| format!("make / writable: {e}"))?;
    let result = targets
        .iter()
        .zip(trees)
        .try_for_each(|(target, tree)| attach_one(target, tree));
    if let Err(e) = mount(
        None::<&str>,
        "/",
        None::<&str>,
        ro | MsFlags::MS_RDONLY,
        None::<&str>,
    ) {
        // A root left writable must not host a program: end the sandbox.
        eprintln!("sandbox holder: make / read-only again: {e}");
        std::process::exit(1);
    }
    result
}

fn attach_one(target: &Path, tree: OwnedFd) -> Result<(), String> {
    const MOUNT_ATTR_NOSUID: u64 = 0x2;
    const MOUNT_ATTR_NODEV: u64 = 0x4;
    /// From <linux/mount.h>.
    const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
    let meta = nix::sys::stat::fstat(&tree).map_err(|e| format!("stat the mount: {e}"))?;
    let is_dir = meta.st_mode & libc::S_IFMT == libc::S_IFDIR;
    if is_dir {
        std::fs::create_dir_all(target).map_err(|e| format!("mkdir {}: {e}", target.display()))?;
    } else {
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| format!("mkdir {}: {e}", parent.display()))?;
        }
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(target)
            .map_err(|e| format!("create {}: {e}", target.display()))?;
    }
    let attr = super::holder::MountAttr {
        attr_set: MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        attr_clr: 0,
        propagation: libc::MS_PRIVATE,
        userns_fd: 0,
    };
    let empty = c"";
    // SAFETY: mount_setattr reads the empty NUL-terminated path and the `MountAttr` we
    // own for the duration of the call; `tree` is an open descriptor.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            (libc::AT_EMPTY_PATH | libc::AT_RECURSIVE) as libc::c_uint,
            &attr as *const super::holder::MountAttr,
            std::mem::size_of::<super::holder::MountAttr>(),
        )
    };
    if rc != 0 {
        return Err(format!(
            "mount_setattr {}: {}",
            target.display(),
            std::io::Error::last_os_error()
        ));
    }
    let c_target = CString::new(target.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{} contains NUL", target.display()))?;
    // SAFETY: move_mount reads both NUL-terminated paths for the duration of the call;
    // `tree` is an open descriptor of a detached mount.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            c_target.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if rc != 0 {
        return Err(format!(
            "move_mount {}: {}",
            target.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}
