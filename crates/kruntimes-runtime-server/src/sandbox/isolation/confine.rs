//! The confinement of a program inside a `namespaces` sandbox: the seccomp filters, the
//! Landlock ruleset, and entering the sandbox between fork and exec.
//!
//! Built once (the filters) or once per sandbox (the ruleset, whose paths are the
//! sandbox's own) before any fork; [`enter`] only uses them.
#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::ffi::CString;
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

use super::{Confine, Enter};

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
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("io_uring_enter", libc::SYS_io_uring_enter),
    ("io_uring_register", libc::SYS_io_uring_register),
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
    let mut filters = vec![denied, clone3];
    #[cfg(target_arch = "x86_64")]
    filters.push(x32());
    Ok(filters)
}

/// x32 system calls (numbers with bit 30 set) pass the x86-64 architecture check and would
/// match none of the rules: answer them all `ENOSYS`. seccompiler matches exact numbers
/// only, so this three-instruction program is written out: load the number, jump if it is
/// at least 0x40000000, allow or refuse.
#[cfg(target_arch = "x86_64")]
fn x32() -> BpfProgram {
    use seccompiler::sock_filter;
    const BPF_LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const BPF_JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
    const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K
    vec![
        // seccomp_data.nr is at offset 0.
        sock_filter {
            code: BPF_LD_W_ABS,
            jt: 0,
            jf: 0,
            k: 0,
        },
        sock_filter {
            code: BPF_JGE_K,
            jt: 1,
            jf: 0,
            k: 0x4000_0000,
        },
        sock_filter {
            code: BPF_RET_K,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ALLOW,
        },
        sock_filter {
            code: BPF_RET_K,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
        },
    ]
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

/// SIGKILL to the process behind `pidfd` (pidfd_send_signal(2)); a process that is gone
/// already is fine.
pub fn pidfd_kill(pidfd: &OwnedFd) {
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_send_signal on a descriptor we own, with no siginfo.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0u32,
        );
    }
}

/// Whether the process behind `pidfd` has ended (a pidfd polls readable then).
pub fn pidfd_exited(pidfd: &OwnedFd) -> bool {
    pidfd_ends_within(pidfd, std::time::Duration::ZERO)
}

/// Whether the process behind `pidfd` ends within `limit` (blocks up to `limit`). A
/// process's pidfd polls readable only once all its threads are gone.
pub fn pidfd_ends_within(pidfd: &OwnedFd, limit: std::time::Duration) -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    use std::os::fd::AsFd;
    let deadline = std::time::Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let timeout = PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX);
        let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, timeout) {
            Ok(n) => return n > 0,
            Err(nix::errno::Errno::EINTR) if !left.is_zero() => {}
            Err(_) => return false,
        }
    }
}

/// The highest capability number of the running kernel.
pub fn cap_last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(63)
}

/// The program's `execve` arguments, prepared before any fork: the paths to try (the
/// program itself when it names a path, else each `PATH` entry joined with it, searched
/// inside the sandbox as `execvp` would), `argv` and `envp` with their NULL-terminated
/// pointer arrays, and the stack of the launching child.
pub struct Exec {
    candidates: Vec<CString>,
    _argv: Vec<CString>,
    _envp: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    envp_ptrs: Vec<*const libc::c_char>,
    stack: Box<[u8]>,
}

// SAFETY: the pointers point into the CStrings owned by the same value, which is never
// changed after `Exec::new`; sharing or sending it shares only immutable data.
unsafe impl Send for Exec {}
// SAFETY: as above.
unsafe impl Sync for Exec {}

/// The launching child's stack: it only runs the confinement system calls and `execve`.
const STACK_BYTES: usize = 64 * 1024;

impl Exec {
    /// `None` when an argument contains a NUL byte.
    pub fn new(
        program: &std::ffi::OsStr,
        args: &[std::ffi::OsString],
        env: &[(String, String)],
    ) -> Option<Self> {
        use std::os::unix::ffi::OsStrExt;
        let bytes = program.as_bytes();
        let candidates = if bytes.contains(&b'/') {
            vec![CString::new(bytes).ok()?]
        } else {
            let path = env
                .iter()
                .rev()
                .find(|(k, _)| k == "PATH")
                .map_or("/usr/local/bin:/usr/bin:/bin", |(_, v)| v.as_str());
            path.split(':')
                .filter(|dir| !dir.is_empty())
                .map(|dir| {
                    let mut full = dir.as_bytes().to_vec();
                    full.push(b'/');
                    full.extend_from_slice(bytes);
                    CString::new(full).ok()
                })
                .collect::<Option<Vec<_>>>()?
        };
        let argv = std::iter::once(program)
            .chain(args.iter().map(|a| a.as_os_str()))
            .map(|a| CString::new(a.as_bytes()).ok())
            .collect::<Option<Vec<_>>>()?;
        let envp = env
            .iter()
            .map(|(k, v)| CString::new(format!("{k}={v}")).ok())
            .collect::<Option<Vec<_>>>()?;
        let pointers = |strings: &[CString]| {
            strings
                .iter()
                .map(|s| s.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect::<Vec<_>>()
        };
        Some(Self {
            argv_ptrs: pointers(&argv),
            envp_ptrs: pointers(&envp),
            _argv: argv,
            _envp: envp,
            candidates,
            stack: vec![0u8; STACK_BYTES].into_boxed_slice(),
        })
    }

    /// The launching child's initial stack pointer: the 16-byte-aligned top of the stack
    /// (it grows down).
    pub(super) fn stack_top(&self) -> *mut libc::c_void {
        let base = self.stack.as_ptr() as usize;
        ((base + self.stack.len()) & !15) as *mut libc::c_void
    }
}

/// What the launching child reads: the sandbox, the program, and where to report a
/// failure before `execve`.
struct Launch<'a> {
    enter: &'a Enter,
    exec: &'a Exec,
    errors: libc::c_int,
}

/// Enters the sandbox described by `e` and runs `exec` there; in the forked child of
/// `spawn`, between fork and exec. Never returns on success: this process (the
/// "intermediate") waits for the program and mirrors its end (see [`wait_and_mirror`]).
/// Returns the error that kept the program from starting.
///
/// Joining a PID namespace only moves the caller's children into it, so the program is a
/// child: started with `CLONE_VM | CLONE_VFORK` (it shares this process's memory, on a
/// stack of its own, and this process sleeps until it has exec'd or failed), which
/// spares copying the server's page tables a second time.
///
/// # Safety
///
/// Only between fork and exec in a child of [`super::spawn`]: the child is
/// single-threaded, and everything here and in the launching child is a plain system call
/// on data prepared before the fork (no allocation, no lock).
pub(super) unsafe fn enter(e: &Enter, exec: &Exec) -> std::io::Result<()> {
    super::join_cgroups(&e.cgroups)?;
    // SAFETY: plain system calls on integers, and clone(2) with a stack that `exec` owns
    // (this process's copy of it, which the launching child shares); see the safety
    // section.
    unsafe {
        if libc::setns(
            std::os::fd::AsRawFd::as_raw_fd(&*e.pidfd),
            super::NAMESPACES,
        ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        let mut errors = [0 as libc::c_int; 2];
        if libc::pipe2(errors.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let launch = Launch {
            enter: e,
            exec,
            errors: errors[1],
        };
        let child = libc::clone(
            launch_program,
            exec.stack_top(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            &launch as *const Launch as *mut libc::c_void,
        );
        libc::close(errors[1]);
        if child < 0 {
            let error = std::io::Error::last_os_error();
            libc::close(errors[0]);
            return Err(error);
        }
        // The child has exec'd (the pipe closed: nothing to read) or failed (its errno).
        let mut errno: libc::c_int = 0;
        let read = libc::read(
            errors[0],
            &mut errno as *mut libc::c_int as *mut libc::c_void,
            std::mem::size_of::<libc::c_int>(),
        );
        libc::close(errors[0]);
        if read == std::mem::size_of::<libc::c_int>() as isize {
            let mut status = 0;
            libc::waitpid(child, &mut status, 0);
            return Err(std::io::Error::from_raw_os_error(errno));
        }
        wait_and_mirror(child)
    }
}

/// The launching child: confines itself and execs the program; on failure writes the
/// errno to the pipe and exits. Runs in the intermediate's memory, which sleeps meanwhile.
extern "C" fn launch_program(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `Launch` that `enter` keeps alive until this child has exec'd
    // or exited (CLONE_VFORK).
    let launch = unsafe { &*(arg as *const Launch) };
    // SAFETY: system calls on prepared data only; see `confine_and_exec`.
    let errno = unsafe { confine_and_exec(&launch.enter.confine, launch.exec) };
    // SAFETY: write(2) of an integer to our end of the pipe, then _exit(2).
    unsafe {
        libc::write(
            launch.errors,
            &errno as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>(),
        );
        libc::_exit(127)
    }
}

/// Drops every privilege, switches to the sandbox user, changes directory, applies
/// Landlock and seccomp and execs the program; returns the errno that stopped it.
///
/// # Safety
///
/// Only in the launching child. The user and group changes use the raw system calls: the
/// C library's wrappers would signal the threads it believes this process has.
pub(super) unsafe fn confine_and_exec(e: &Confine, exec: &Exec) -> libc::c_int {
    let errno = || {
        std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL)
    };
    // SAFETY: plain system calls on integers and prepared NUL-terminated strings.
    unsafe {
        for cap in 0..=e.cap_last {
            // EINVAL for numbers this kernel does not know: nothing to drop.
            libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0);
        }
        if libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) != 0
            || libc::syscall(libc::SYS_setresgid, e.gid, e.gid, e.gid) != 0
            // Leaving uid 0 clears the permitted, effective and ambient capabilities.
            || libc::syscall(libc::SYS_setresuid, e.uid, e.uid, e.uid) != 0
            // The program dies with the process that waits for it. Set after the user
            // change, which clears it; that process is outside the sandbox's PID
            // namespace, so it shows as parent 0 (1 would mean it is gone already).
            || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0
            || libc::getppid() != e.parent
            || libc::chdir(e.cwd.as_ptr()) != 0
            || libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
        {
            return errno();
        }
        if let Some(ruleset) = &e.ruleset
            && libc::syscall(
                libc::SYS_landlock_restrict_self,
                std::os::fd::AsRawFd::as_raw_fd(&**ruleset),
                0u32,
            ) != 0
        {
            return errno();
        }
    }
    for filter in e.filters.iter() {
        // prctl(NO_NEW_PRIVS) and seccomp(2) on the prepared program; no allocation.
        if seccompiler::apply_filter(filter).is_err() {
            return errno();
        }
    }
    // As execvp: try each candidate; a missing or unreachable one moves on, EACCES is
    // remembered, anything else stops the search.
    let mut result = libc::ENOENT;
    for candidate in &exec.candidates {
        // SAFETY: NUL-terminated strings and NULL-terminated pointer arrays owned by `exec`.
        unsafe {
            libc::execve(
                candidate.as_ptr(),
                exec.argv_ptrs.as_ptr(),
                exec.envp_ptrs.as_ptr(),
            );
        }
        match errno() {
            libc::ENOENT | libc::ENOTDIR => {}
            libc::EACCES => result = libc::EACCES,
            other => return other,
        }
    }
    result
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
        end_as(status)
    }
}

/// Ends this process as a child with wait status `status` ended: the same exit code, or
/// the same signal (its default action restored and unblocked, then raised).
/// Async-signal-safe: system calls on integers only.
pub(super) fn end_as(status: libc::c_int) -> ! {
    // SAFETY: plain system calls on integers and a local signal set.
    unsafe {
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
