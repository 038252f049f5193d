//! The confinement of a program inside a `namespaces` sandbox: the seccomp filters, the
//! Landlock ruleset, and entering the sandbox between fork and exec.
//!
//! Built once (the filters) or once per sandbox (the ruleset, whose paths are the
//! sandbox's own) before any fork; [`enter`] only uses them.
#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;

use landlock::{
    ABI, Access, AccessFs, CompatLevel, Compatible, PathBeneath, PathFd, Ruleset, RulesetAttr,
    RulesetCreatedAttr, Scope,
};
use nix::libc;
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use super::Enter;

/// System calls a sandboxed program never needs, each refused with `EPERM`: mounting and
/// changing roots, tracing other processes or reading their memory, loading kernels,
/// modules or BPF programs, the kernel keyring, performance counters, rebooting, joining
/// namespaces, swap, accounting, the clock, the kernel log, quotas, file handles, and
/// userfaultfd. `unshare` and `clone` are refused only with `CLONE_NEWUSER` (a new user
/// namespace would give the program capabilities over new namespaces of its own); `clone3`,
/// whose flags seccomp cannot read, answers `ENOSYS`, so that the C library falls back to
/// `clone`.
pub const DENIED: &[(&str, i64)] = &[
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("pivot_root", libc::SYS_pivot_root),
    ("chroot", libc::SYS_chroot),
    ("open_tree", libc::SYS_open_tree),
    ("move_mount", libc::SYS_move_mount),
    ("fsopen", libc::SYS_fsopen),
    ("fsconfig", libc::SYS_fsconfig),
    ("fsmount", libc::SYS_fsmount),
    ("fspick", libc::SYS_fspick),
    ("mount_setattr", libc::SYS_mount_setattr),
    ("ptrace", libc::SYS_ptrace),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    ("bpf", libc::SYS_bpf),
    ("keyctl", libc::SYS_keyctl),
    ("add_key", libc::SYS_add_key),
    ("request_key", libc::SYS_request_key),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("reboot", libc::SYS_reboot),
    ("setns", libc::SYS_setns),
    ("swapon", libc::SYS_swapon),
    ("swapoff", libc::SYS_swapoff),
    ("acct", libc::SYS_acct),
    ("settimeofday", libc::SYS_settimeofday),
    ("clock_settime", libc::SYS_clock_settime),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("adjtimex", libc::SYS_adjtimex),
    ("syslog", libc::SYS_syslog),
    ("quotactl", libc::SYS_quotactl),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("userfaultfd", libc::SYS_userfaultfd),
    #[cfg(target_arch = "x86_64")]
    ("iopl", libc::SYS_iopl),
    #[cfg(target_arch = "x86_64")]
    ("ioperm", libc::SYS_ioperm),
];

/// System calls refused only when their first argument (the flags) asks for a new user
/// namespace.
pub const DENIED_WITH_NEWUSER: &[(&str, i64)] =
    &[("unshare", libc::SYS_unshare), ("clone", libc::SYS_clone)];

#[cfg(target_arch = "x86_64")]
const ARCH: TargetArch = TargetArch::x86_64;
#[cfg(target_arch = "aarch64")]
const ARCH: TargetArch = TargetArch::aarch64;

/// The sandbox's seccomp filters: the `EPERM` list (with the `CLONE_NEWUSER` rules), then
/// `clone3` answering `ENOSYS`. Every other system call is allowed; a call made for another
/// architecture's ABI kills the process (seccompiler checks the architecture first).
pub fn filters() -> Result<Vec<BpfProgram>, String> {
    let newuser = || {
        SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(libc::CLONE_NEWUSER as u64),
            libc::CLONE_NEWUSER as u64,
        )
        .and_then(|condition| SeccompRule::new(vec![condition]))
        .map_err(|e| format!("seccomp rule: {e}"))
    };
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED.iter().map(|(_, nr)| (*nr, Vec::new())).collect();
    for (_, nr) in DENIED_WITH_NEWUSER {
        rules.insert(*nr, vec![newuser()?]);
    }
    let denied = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        ARCH,
    )
    .and_then(BpfProgram::try_from)
    .map_err(|e| format!("seccomp filter: {e}"))?;
    let clone3 = SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        ARCH,
    )
    .and_then(BpfProgram::try_from)
    .map_err(|e| format!("seccomp filter: {e}"))?;
    Ok(vec![denied, clone3])
}

/// The Landlock ABI the kernel offers, or why it offers none.
pub fn landlock_abi() -> Result<i32, String> {
    // SAFETY: landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION) reads no
    // memory and only returns the ABI version (or -1 with errno).
    let version = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            1u32, // LANDLOCK_CREATE_RULESET_VERSION
        )
    };
    if version < 0 {
        let error = std::io::Error::last_os_error();
        return Err(match error.raw_os_error() {
            Some(libc::EOPNOTSUPP) => "Landlock is built into the kernel but not enabled".into(),
            Some(libc::ENOSYS) => "the kernel has no Landlock".into(),
            _ => format!("Landlock is not usable: {error}"),
        });
    }
    i32::try_from(version).map_err(|_| format!("Landlock answered version {version}"))
}

/// The ABI this crate asks for; older kernels get what they offer (best effort), which
/// [`landlock_abi`] reports.
const LANDLOCK_ABI: ABI = ABI::V6;

/// What Landlock may grant beneath one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant {
    /// Read and execute files, list directories.
    ReadExecute,
    /// Read and write existing files (and device ioctls), list directories: `/dev`, `/proc`.
    ReadWriteFiles,
    /// Everything: the workspace, private `/tmp` and the like.
    Full,
}

/// A Landlock ruleset for one sandbox: every access is refused except what `grants` give
/// beneath their paths (opened through `/proc/<init>/root`, so the sandbox's own mounts),
/// and signals and abstract Unix sockets cannot leave the sandbox's domain. `None` when the
/// kernel has no Landlock.
pub fn ruleset(grants: &[(PathBuf, Grant)]) -> Result<Option<OwnedFd>, String> {
    let abi = LANDLOCK_ABI;
    let read_execute = AccessFs::from_read(abi);
    let read_write_files =
        AccessFs::from_read(abi) | AccessFs::WriteFile | AccessFs::Truncate | AccessFs::IoctlDev;
    let full = AccessFs::from_all(abi);
    let mut created = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(full)
        .and_then(|r| r.scope(Scope::Signal | Scope::AbstractUnixSocket))
        .and_then(|r| r.create())
        .map_err(|e| format!("Landlock ruleset: {e}"))?;
    for (path, grant) in grants {
        let access = match grant {
            Grant::ReadExecute => read_execute,
            Grant::ReadWriteFiles => read_write_files,
            Grant::Full => full,
        };
        let fd = PathFd::new(path).map_err(|e| format!("Landlock path {}: {e}", path.display()))?;
        created = created
            .add_rule(PathBeneath::new(fd, access))
            .map_err(|e| format!("Landlock rule for {}: {e}", path.display()))?;
    }
    Ok(created.into())
}

/// A pidfd for `pid` (pidfd_open(2)).
pub fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    let pid =
        libc::pid_t::try_from(pid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: pidfd_open takes two integers and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| std::io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: the kernel just returned this descriptor, which nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The highest capability number of the running kernel.
pub fn cap_last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(63)
}

/// Enters the sandbox described by `e`; in the forked child of `spawn`, between fork and
/// exec. Returns (in the grandchild) when the program may be exec'd; the intermediate
/// process never returns (see [`wait_and_mirror`]).
///
/// # Safety
///
/// Only between fork and exec in a child of [`super::spawn`]: the child is
/// single-threaded, so forking it again is sound, and everything here is a plain system
/// call on data prepared before the fork (no allocation, no lock).
pub(super) unsafe fn enter(e: &Enter) -> std::io::Result<()> {
    let check = |rc: libc::c_long| {
        if rc < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    super::join_cgroups(&e.cgroups)?;
    // SAFETY: plain system calls on integers and on NUL-terminated strings (`cwd`)
    // prepared before the fork; see the function's safety section.
    unsafe {
        check(libc::setns(e.pidfd, super::NAMESPACES).into())?;
        let child = libc::fork();
        check(child.into())?;
        if child > 0 {
            wait_and_mirror(child);
        }
        // The program: it dies with the process that waits for it.
        check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0).into())?;
        for cap in 0..=e.cap_last {
            // EINVAL for numbers this kernel does not know: nothing to drop.
            libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0);
        }
        check(libc::setgroups(0, std::ptr::null()).into())?;
        check(libc::setresgid(e.gid, e.gid, e.gid).into())?;
        // Leaving uid 0 clears the permitted, effective and ambient capabilities.
        check(libc::setresuid(e.uid, e.uid, e.uid).into())?;
        check(libc::chdir(e.cwd.as_ptr()).into())?;
        check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0).into())?;
        if let Some(ruleset) = e.ruleset {
            check(libc::syscall(
                libc::SYS_landlock_restrict_self,
                ruleset,
                0u32,
            ))?;
        }
    }
    for filter in e.filters.iter() {
        // prctl(NO_NEW_PRIVS) and seccomp(2) on the prepared program; no allocation.
        seccompiler::apply_filter(filter).map_err(|_| std::io::Error::last_os_error())?;
    }
    Ok(())
}

/// The intermediate process: closes every descriptor (among them the standard library's
/// exec-error pipe, so that `spawn` returns once the program has exec'd, and the program's
/// pipes, so that only the program holds them), blocks every signal (a SIGTERM sent to the
/// process group reaches the program, not this waiter), waits for the program and ends the
/// same way: the same exit code, or the same signal.
///
/// # Safety
///
/// As [`enter`]: between fork and exec, single-threaded, system calls only.
unsafe fn wait_and_mirror(child: libc::pid_t) -> ! {
    // SAFETY: see the function's safety section.
    unsafe {
        if libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32) != 0 {
            for fd in 0..1024 {
                libc::close(fd);
            }
        }
        let no_core = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::setrlimit(libc::RLIMIT_CORE, &no_core);
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::sigprocmask(libc::SIG_SETMASK, &all, std::ptr::null_mut());
        let mut status: libc::c_int = 0;
        loop {
            let waited = libc::waitpid(child, &mut status, 0);
            if waited == child {
                break;
            }
            if waited < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                libc::_exit(127);
            }
        }
        if libc::WIFEXITED(status) {
            libc::_exit(libc::WEXITSTATUS(status));
        }
        let signal = libc::WTERMSIG(status);
        libc::signal(signal, libc::SIG_DFL);
        let mut one: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut one);
        libc::sigaddset(&mut one, signal);
        libc::sigprocmask(libc::SIG_UNBLOCK, &one, std::ptr::null_mut());
        libc::kill(libc::getpid(), signal);
        libc::_exit(128 + signal)
    }
}
