//! The launcher of a `namespaces` sandbox: its PID 1 starts the sandbox's programs.
//!
//! Without it, every program of a sandbox started with a fork of the runtime server (a
//! large multi-threaded process: copying its page tables and the TLB shootdowns on its
//! other CPUs), then joined the sandbox's limit cgroups (on cgroup v1 each write to
//! `cgroup.procs` waits for an RCU grace period) and its namespaces, and forked once more
//! there. The holder's init is small and single-threaded, and it is already in the
//! sandbox's namespaces and limit cgroups: a program it starts needs none of that.
//!
//! The holder gets one end of a `SOCK_SEQPACKET` socket (see [`super::holder`]). The
//! server sends one message per program: the user, the working directory inside, the
//! program, its arguments and environment (inline, or in a sealed memfd when large), and
//! as `SCM_RIGHTS` its stdin, stdout, stderr and extra descriptors, the sandbox's Landlock
//! ruleset and, with cgroup v2, the execution cgroup to join. The init starts the program
//! with `clone(CLONE_VM | CLONE_VFORK)` (no copy of even its own small memory): the child
//! restores the signal mask and OOM score the init changed for itself, becomes the leader
//! of a new session, takes its descriptors, and is confined exactly as before (every
//! capability dropped, the sandbox user, `no_new_privs`, Landlock, seccomp; see
//! [`super::confine::confine_and_exec`]) before it execs. The init answers with the
//! program's pid in the sandbox and a pidfd of it (the server reads its host pid from the
//! pidfd), or the errno that kept it from starting; when it reaps the program it sends
//! its wait status. Answers carry the request's id, so requests may overlap.
//!
//! A warm sandbox's init serves no launch before its writable paths are bound, and the
//! server never asks before. When the sandbox ends, the socket reaches end-of-file: a
//! launch in flight fails with `ESRCH` (as joining a sandbox whose PID 1 is gone did), and
//! a program whose end was not reported ended with it (`SIGKILL`).
#![allow(unsafe_code)]

use std::collections::{HashMap, HashSet};
use std::ffi::{CString, OsStr, OsString};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::libc;
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;

use super::confine::{self, Exec};
use super::{Child, Confine, Enter, MAX_EXTRA_FDS, SpawnError, SpawnSpec, Stdio};

/// A request's fixed header: kind, id, uid, gid, descriptor counts, payload carrier and
/// length.
const HEADER: usize = 25;
/// Payloads up to this size travel in the message itself; larger ones in a memfd.
pub const MAX_INLINE: usize = 32 * 1024;
/// The largest payload (arguments and environment together).
pub const MAX_PAYLOAD: usize = 4 * 1024 * 1024;
/// At most this many cgroups to join (cgroup v2: the execution's).
const MAX_CGROUPS: usize = 1;
/// At most this many descriptors in one request.
const MAX_FDS: usize = 3 + MAX_EXTRA_FDS + 1 + MAX_CGROUPS + 1;
/// An answer: kind, id, two integers.
const ANSWER: usize = 17;
/// How long the init may take to start a program (it answers once the program has
/// exec'd or failed).
const START_LIMIT: Duration = Duration::from_secs(30);
/// The init moves every descriptor it hands to a program at or above this number, so that
/// placing them at 0, 1, 2, ... cannot overwrite one not yet placed.
const HIGH_FD: RawFd = 3 + MAX_EXTRA_FDS as RawFd + 8;

/// A launcher socket pair: (the server's end, the holder's end), both close-on-exec
/// (the same kind as a warm sandbox's control socket).
pub fn socket_pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    super::warm::control_pair()
}

// ---------------------------------------------------------------------------------------
// The payload

fn put(buffer: &mut Vec<u8>, bytes: &[u8]) {
    buffer.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    buffer.extend_from_slice(bytes);
}

/// What the init needs to build the program's `execve` arguments.
#[derive(Debug, PartialEq, Eq)]
struct Payload {
    cwd: Vec<u8>,
    program: OsString,
    args: Vec<OsString>,
    env: Vec<(String, String)>,
}

impl Payload {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        put(&mut out, &self.cwd);
        put(&mut out, self.program.as_bytes());
        out.extend_from_slice(&(self.args.len() as u32).to_le_bytes());
        for arg in &self.args {
            put(&mut out, arg.as_bytes());
        }
        out.extend_from_slice(&(self.env.len() as u32).to_le_bytes());
        for (name, value) in &self.env {
            put(&mut out, name.as_bytes());
            put(&mut out, value.as_bytes());
        }
        out
    }

    /// `None` when `bytes` is not a payload [`Payload::encode`] wrote.
    fn decode(bytes: &[u8]) -> Option<Self> {
        let mut rest = bytes;
        // cwd, program, the arguments, the environment: each a length and its bytes.
        let take = |rest: &mut &[u8]| -> Option<Vec<u8>> {
            let (head, tail) = rest.split_first_chunk::<4>()?;
            let len = usize::try_from(u32::from_le_bytes(*head)).ok()?;
            if tail.len() < len {
                return None;
            }
            let (value, tail) = tail.split_at(len);
            *rest = tail;
            Some(value.to_vec())
        };
        let cwd = take(&mut rest)?;
        let program = OsString::from(OsStr::from_bytes(&take(&mut rest)?));
        let count = |rest: &mut &[u8]| -> Option<usize> {
            let (head, tail) = rest.split_first_chunk::<4>()?;
            *rest = tail;
            usize::try_from(u32::from_le_bytes(*head)).ok()
        };
        let nargs = count(&mut rest)?;
        // Each argument takes at least its 4-byte length: a count beyond that is a lie.
        if nargs > rest.len() / 4 {
            return None;
        }
        let mut args = Vec::with_capacity(nargs);
        for _ in 0..nargs {
            args.push(OsString::from(OsStr::from_bytes(&take(&mut rest)?)));
        }
        let nenv = count(&mut rest)?;
        if nenv > rest.len() / 8 {
            return None;
        }
        let mut env = Vec::with_capacity(nenv);
        for _ in 0..nenv {
            let name = String::from_utf8(take(&mut rest)?).ok()?;
            let value = String::from_utf8(take(&mut rest)?).ok()?;
            env.push((name, value));
        }
        rest.is_empty().then_some(Self {
            cwd,
            program,
            args,
            env,
        })
    }
}

// ---------------------------------------------------------------------------------------
// The server's side

/// A started program, as the reader hands it to the launching caller.
struct Started {
    pidfd: OwnedFd,
    /// Its pid inside the sandbox, and on the host.
    sandbox_pid: i32,
    host_pid: u32,
    exit: oneshot::Receiver<i32>,
}

/// The answer to a launch: the program, or the errno that kept it from starting.
type Launch = Result<Started, i32>;

#[derive(Default)]
struct State {
    next: u64,
    /// Launches waiting for the init's answer, by request id.
    starts: HashMap<u64, oneshot::Sender<Launch>>,
    /// Programs whose end is not reported yet, by pid inside the sandbox.
    exits: HashMap<i32, oneshot::Sender<i32>>,
    /// The socket reached end-of-file (or failed): the sandbox has ended.
    closed: bool,
}

/// The server's end of one sandbox's launcher socket.
pub struct Launcher {
    socket: AsyncFd<OwnedFd>,
    state: Mutex<State>,
    /// The sandbox's init, once known: killed when the socket fails other than by the
    /// init's end, so that "ended with the sandbox" holds for every program.
    init: std::sync::OnceLock<Arc<OwnedFd>>,
}

impl std::fmt::Debug for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launcher")
            .field("socket", &self.socket.get_ref().as_raw_fd())
            .finish_non_exhaustive()
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A launch's waiter, until its answer has been taken. If the launching caller gives up
/// (a timeout, or its future dropped), the waiter is removed, so that a later answer finds
/// no one and the reader kills the program; an answer already delivered but not taken is
/// killed here.
struct Pending<'a> {
    launcher: &'a Launcher,
    id: u64,
    answer: Option<oneshot::Receiver<Launch>>,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        lock(&self.launcher.state).starts.remove(&self.id);
        if let Some(mut answer) = self.answer.take() {
            answer.close();
            if let Ok(Ok(started)) = answer.try_recv() {
                confine::pidfd_kill(&started.pidfd);
            }
        }
    }
}

/// `/dev/null`, opened once, for the standard streams a program does not use.
fn dev_null() -> std::io::Result<RawFd> {
    static NULL: std::sync::OnceLock<std::fs::File> = std::sync::OnceLock::new();
    if let Some(file) = NULL.get() {
        return Ok(file.as_raw_fd());
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")?;
    Ok(NULL.get_or_init(|| file).as_raw_fd())
}

impl Launcher {
    /// Takes the server's end of the socket and starts reading the init's answers (on the
    /// current tokio runtime).
    pub fn start(socket: OwnedFd) -> std::io::Result<Arc<Self>> {
        nix::fcntl::fcntl(
            &socket,
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
        )
        .map_err(std::io::Error::from)?;
        // The init names each program it started in its credentials, which the kernel
        // translates into this process's PID namespace: the program's host pid (its
        // process group's id), even if it has ended and been reaped meanwhile.
        nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::PassCred, &true)
            .map_err(std::io::Error::from)?;
        // SAFETY: `OwnedFd` returns the same open descriptor for as long as it lives, and
        // the `AsyncFd` owns it.
        let socket = unsafe { AsyncFd::register(socket) }?;
        let launcher = Arc::new(Self {
            socket,
            state: Mutex::new(State::default()),
            init: std::sync::OnceLock::new(),
        });
        tokio::spawn(launcher.clone().read());
        Ok(launcher)
    }

    /// Whether the sandbox's init has gone (its socket ended).
    pub fn closed(&self) -> bool {
        lock(&self.state).closed
    }

    /// Names the sandbox's init (once it is known).
    pub fn set_init(&self, pidfd: Arc<OwnedFd>) {
        let _ = self.init.set(pidfd);
    }

    async fn read(self: Arc<Self>) {
        let failure = loop {
            let Ok(mut guard) = self.socket.readable().await else {
                break Some("the socket cannot be polled".to_owned());
            };
            match guard.try_io(|socket| receive_answer(socket.get_ref().as_raw_fd())) {
                Ok(Ok(Some(received))) => {
                    if let Err(e) = self.dispatch(received) {
                        break Some(e);
                    }
                }
                Ok(Ok(None)) => break None,
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => break Some(e.to_string()),
                Err(_would_block) => {}
            }
        };
        if let Some(reason) = failure {
            // Nothing reads the init's answers from here on: end the sandbox, as its
            // programs' waiters are told below.
            tracing::warn!(%reason, "the sandbox's launcher socket failed; ending the sandbox");
            if let Some(init) = self.init.get() {
                confine::pidfd_kill(init);
            }
        }
        let mut state = lock(&self.state);
        state.closed = true;
        for (_, waiter) in state.starts.drain() {
            let _ = waiter.send(Err(libc::ESRCH));
        }
        // Dropping the senders tells every waiter its program ended with the sandbox.
        state.exits.clear();
    }

    /// Hands an answer to its waiter; `Err` when the answer is unusable (the socket is
    /// then given up and the sandbox ended).
    fn dispatch(&self, received: Received) -> Result<(), String> {
        let Received {
            answer,
            pidfd,
            host_pid,
        } = received;
        let mut state = lock(&self.state);
        match answer {
            Answer::Started { id, pid } => {
                let (Some(pidfd), Some(host_pid)) = (pidfd, host_pid) else {
                    // Dropped by the kernel (this process out of descriptors): the program
                    // runs and cannot be supervised.
                    return Err(format!("launch {id} was answered without its pidfd"));
                };
                let (tx, exit) = oneshot::channel();
                state.exits.insert(pid, tx);
                let started = Started {
                    pidfd,
                    sandbox_pid: pid,
                    host_pid,
                    exit,
                };
                match state.starts.remove(&id) {
                    Some(waiter) => {
                        if let Err(Ok(started)) = waiter.send(Ok(started)) {
                            confine::pidfd_kill(&started.pidfd);
                        }
                    }
                    // The caller gave up: nothing would supervise the program.
                    None => confine::pidfd_kill(&started.pidfd),
                }
            }
            Answer::Failed { id, errno } => {
                if let Some(waiter) = state.starts.remove(&id) {
                    let _ = waiter.send(Err(errno));
                }
            }
            Answer::Exited { pid, status } => {
                if let Some(waiter) = state.exits.remove(&pid) {
                    let _ = waiter.send(status);
                }
            }
        }
        Ok(())
    }

    /// Starts `spec`'s program in the sandbox `enter` names (see the module's comment).
    pub async fn launch(&self, spec: SpawnSpec, enter: &Enter) -> Result<Child, SpawnError> {
        let program = spec.program.clone();
        let failed = |source: std::io::Error| SpawnError {
            program: program.clone(),
            source,
        };
        let invalid = |message: &str| {
            failed(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                message.to_owned(),
            ))
        };
        if spec.extra_fds.len() > MAX_EXTRA_FDS {
            return Err(invalid("too many extra descriptors"));
        }
        let payload = Payload {
            cwd: enter.confine.cwd.as_bytes().to_vec(),
            program: spec.program,
            args: spec.args,
            env: spec.env,
        };
        if payload.program.as_bytes().contains(&0)
            || payload.args.iter().any(|a| a.as_bytes().contains(&0))
            || payload
                .env
                .iter()
                .any(|(k, v)| k.contains('\0') || v.contains('\0'))
        {
            return Err(invalid("an argument or variable contains a NUL byte"));
        }
        let payload = payload.encode();
        if payload.len() > MAX_PAYLOAD {
            return Err(invalid("the arguments and environment are too large"));
        }
        // The program's standard streams: its end, and ours when piped.
        let mut theirs: Vec<OwnedFd> = Vec::new();
        let mut raw: Vec<RawFd> = Vec::new();
        let mut ours: [Option<OwnedFd>; 3] = [None, None, None];
        for (slot, stdio) in [spec.stdin, spec.stdout, spec.stderr]
            .into_iter()
            .enumerate()
        {
            match stdio {
                Stdio::Null => raw.push(dev_null().map_err(failed)?),
                Stdio::Fd(fd) => {
                    raw.push(fd.as_raw_fd());
                    theirs.push(fd);
                }
                Stdio::Piped => {
                    let (read, write) = std::io::pipe().map_err(failed)?;
                    let (mine, child) = if slot == 0 {
                        (OwnedFd::from(write), OwnedFd::from(read))
                    } else {
                        (OwnedFd::from(read), OwnedFd::from(write))
                    };
                    raw.push(child.as_raw_fd());
                    theirs.push(child);
                    ours[slot] = Some(mine);
                }
            }
        }
        raw.extend(spec.extra_fds.iter().map(AsRawFd::as_raw_fd));
        let io = raw.len();
        if let Some(ruleset) = &enter.confine.ruleset {
            raw.push(ruleset.as_raw_fd());
        }
        // The sandbox's limit cgroups are the init's already (it joined them before it
        // unshared its namespaces): the program inherits them. It joins only the
        // execution's cgroup (cgroup v2), which is not the init's: killing everything in
        // that cgroup must not end the sandbox.
        let cgroups: Vec<RawFd> = spec.cgroup_procs.iter().map(AsRawFd::as_raw_fd).collect();
        if cgroups.len() > MAX_CGROUPS {
            return Err(invalid("too many cgroups to join"));
        }
        raw.extend(&cgroups);
        let memfd = if payload.len() > MAX_INLINE {
            let memfd = sealed_memfd(&payload).map_err(failed)?;
            raw.push(memfd.as_raw_fd());
            Some(memfd)
        } else {
            None
        };
        // Our ends of the pipes, ready before the request goes: nothing may fail once the
        // program runs.
        let [stdin, stdout, stderr] = ours;
        let stdin = stdin
            .map(|fd| tokio::process::ChildStdin::from_std(std::process::ChildStdin::from(fd)))
            .transpose()
            .map_err(failed)?;
        let stdout = stdout
            .map(|fd| tokio::process::ChildStdout::from_std(std::process::ChildStdout::from(fd)))
            .transpose()
            .map_err(failed)?;
        let stderr = stderr
            .map(|fd| tokio::process::ChildStderr::from_std(std::process::ChildStderr::from(fd)))
            .transpose()
            .map_err(failed)?;
        let (tx, rx) = oneshot::channel();
        let id = {
            let mut state = lock(&self.state);
            if state.closed {
                return Err(failed(std::io::Error::from_raw_os_error(libc::ESRCH)));
            }
            state.next += 1;
            let id = state.next;
            state.starts.insert(id, tx);
            id
        };
        let mut pending = Pending {
            launcher: self,
            id,
            answer: Some(rx),
        };
        let mut message = Vec::with_capacity(HEADER + payload.len());
        message.push(b'L');
        message.extend_from_slice(&id.to_le_bytes());
        message.extend_from_slice(&enter.confine.uid.to_le_bytes());
        message.extend_from_slice(&enter.confine.gid.to_le_bytes());
        message.push(io as u8);
        message.push(u8::from(enter.confine.ruleset.is_some()));
        message.push(cgroups.len() as u8);
        message.push(u8::from(memfd.is_some()));
        message.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        debug_assert_eq!(message.len(), HEADER);
        if memfd.is_none() {
            message.extend_from_slice(&payload);
        }
        loop {
            let mut guard = self.socket.writable().await.map_err(failed)?;
            match guard.try_io(|socket| {
                let cmsgs = [ControlMessage::ScmRights(&raw)];
                sendmsg::<()>(
                    socket.get_ref().as_raw_fd(),
                    &[IoSlice::new(&message)],
                    &cmsgs,
                    MsgFlags::MSG_NOSIGNAL,
                    None,
                )
                .map_err(std::io::Error::from)
            }) {
                Ok(Ok(_)) => break,
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EPIPE) => {
                    return Err(failed(std::io::Error::from_raw_os_error(libc::ESRCH)));
                }
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => return Err(failed(e)),
                Err(_would_block) => {}
            }
        }
        // The init has its copies now.
        drop(theirs);
        drop(spec.extra_fds);
        drop(memfd);
        let Some(answer) = pending.answer.as_mut() else {
            return Err(failed(std::io::Error::from_raw_os_error(libc::ESRCH)));
        };
        let answer = tokio::time::timeout(START_LIMIT, answer).await;
        // Taken: from here on the program is the caller's (or was never started).
        pending.answer = None;
        let started = match answer {
            Ok(Ok(Ok(started))) => started,
            Ok(Ok(Err(errno))) => return Err(failed(std::io::Error::from_raw_os_error(errno))),
            Ok(Err(_)) => return Err(failed(std::io::Error::from_raw_os_error(libc::ESRCH))),
            Err(_) => {
                return Err(failed(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the sandbox did not start it within {START_LIMIT:?}"),
                )));
            }
        };
        let launched = Launched {
            pid: Some(started.host_pid),
            sandbox_pid: started.sandbox_pid,
            pidfd: started.pidfd,
            exit: Some(started.exit),
            status: None,
        };
        Ok(Child::launched(launched, stdin, stdout, stderr))
    }
}

/// A memfd holding `payload`, sealed against changes.
fn sealed_memfd(payload: &[u8]) -> std::io::Result<OwnedFd> {
    use nix::sys::memfd::{MFdFlags, memfd_create};
    let fd = memfd_create(
        c"kruntimes-launch",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )
    .map_err(std::io::Error::from)?;
    let mut file = std::fs::File::from(fd);
    std::io::Write::write_all(&mut file, payload)?;
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: fcntl(F_ADD_SEALS) on a descriptor we own, with an integer argument.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file.into())
}

/// A program the init started.
#[derive(Debug)]
pub struct Launched {
    /// Its host pid (also its process group's id), until it has been waited for.
    pid: Option<u32>,
    /// Its pid inside the sandbox.
    sandbox_pid: i32,
    pidfd: OwnedFd,
    /// Its wait status, once the init has reaped it.
    exit: Option<oneshot::Receiver<i32>>,
    status: Option<ExitStatus>,
}

/// The status of a program whose end the init could not report: it ended with its
/// sandbox, killed.
const KILLED: i32 = libc::SIGKILL;

impl Launched {
    pub fn id(&self) -> Option<u32> {
        if self.status.is_some() {
            return None;
        }
        self.pid
    }

    /// Cancel-safe: the answer stays until it has been read.
    pub async fn wait(&mut self) -> std::io::Result<ExitStatus> {
        if let Some(status) = self.status {
            return Ok(status);
        }
        let raw = match self.exit.as_mut() {
            Some(exit) => exit.await.unwrap_or(KILLED),
            None => KILLED,
        };
        Ok(self.ended(raw))
    }

    pub fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        if let Some(status) = self.status {
            return Ok(Some(status));
        }
        let raw = match self.exit.as_mut().map(oneshot::Receiver::try_recv) {
            Some(Ok(raw)) => raw,
            Some(Err(oneshot::error::TryRecvError::Empty)) => return Ok(None),
            Some(Err(oneshot::error::TryRecvError::Closed)) | None => KILLED,
        };
        Ok(Some(self.ended(raw)))
    }

    fn ended(&mut self, raw: i32) -> ExitStatus {
        let status = ExitStatus::from_raw(raw);
        self.exit = None;
        self.status = Some(status);
        self.pid = None;
        status
    }

    /// SIGKILL through the pidfd (a reaped program is not signalled).
    pub fn start_kill(&mut self) -> std::io::Result<()> {
        if self.status.is_none() {
            confine::pidfd_kill(&self.pidfd);
        }
        Ok(())
    }

    /// Its pid inside the sandbox.
    pub fn sandbox_pid(&self) -> i32 {
        self.sandbox_pid
    }
}

// ---------------------------------------------------------------------------------------
// Answers

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Started { id: u64, pid: i32 },
    Failed { id: u64, errno: i32 },
    Exited { pid: i32, status: i32 },
}

impl Answer {
    fn encode(self) -> [u8; ANSWER] {
        let (kind, id, a, b) = match self {
            Answer::Started { id, pid } => (b'S', id, pid, 0),
            Answer::Failed { id, errno } => (b'F', id, errno, 0),
            Answer::Exited { pid, status } => (b'E', 0, pid, status),
        };
        let mut out = [0u8; ANSWER];
        out[0] = kind;
        out[1..9].copy_from_slice(&id.to_le_bytes());
        out[9..13].copy_from_slice(&a.to_le_bytes());
        out[13..17].copy_from_slice(&b.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let bytes: &[u8; ANSWER] = bytes.try_into().ok()?;
        let id = u64::from_le_bytes(bytes[1..9].try_into().ok()?);
        let a = i32::from_le_bytes(bytes[9..13].try_into().ok()?);
        let b = i32::from_le_bytes(bytes[13..17].try_into().ok()?);
        match bytes[0] {
            b'S' => Some(Answer::Started { id, pid: a }),
            b'F' => Some(Answer::Failed { id, errno: a }),
            b'E' => Some(Answer::Exited { pid: a, status: b }),
            _ => None,
        }
    }
}

/// One answer as received: what it says, the pidfd it carries (a `Started`), and the pid
/// its credentials name, in this process's PID namespace.
struct Received {
    answer: Answer,
    pidfd: Option<OwnedFd>,
    host_pid: Option<u32>,
}

/// Server side: one answer (`None` at end-of-file).
fn receive_answer(socket: RawFd) -> std::io::Result<Option<Received>> {
    let mut buffer = [0u8; ANSWER + 1];
    let mut space = nix::cmsg_space!([RawFd; 2], libc::ucred);
    let mut iov = [IoSliceMut::new(&mut buffer)];
    let msg = recvmsg::<()>(
        socket,
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
    )
    .map_err(std::io::Error::from)?;
    let mut fds = received(&msg);
    let host_pid = msg.cmsgs().ok().and_then(|mut cmsgs| {
        cmsgs.find_map(|cmsg| match cmsg {
            ControlMessageOwned::ScmCredentials(credentials) => {
                u32::try_from(credentials.pid()).ok().filter(|pid| *pid > 0)
            }
            _ => None,
        })
    });
    let bytes = msg.bytes;
    if bytes == 0 {
        return Ok(None);
    }
    let answer = Answer::decode(&buffer[..bytes]).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the launcher sent an unknown answer",
        )
    })?;
    Ok(Some(Received {
        answer,
        pidfd: fds.pop(),
        host_pid,
    }))
}

/// The descriptors a received message carried, owned.
fn received(msg: &nix::sys::socket::RecvMsg<'_, '_, ()>) -> Vec<OwnedFd> {
    let mut fds = Vec::new();
    if let Ok(cmsgs) = msg.cmsgs() {
        for cmsg in cmsgs {
            if let ControlMessageOwned::ScmRights(list) = cmsg {
                // SAFETY: the kernel installed these descriptors in this process for us;
                // nothing else owns them.
                fds.extend(
                    list.into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
    }
    fds
}

// ---------------------------------------------------------------------------------------
// The init's side

/// The init's launcher state.
pub(super) struct Served {
    /// The seccomp filters (the same the server would install), built at the first launch.
    filters: Option<Arc<Vec<seccompiler::BpfProgram>>>,
    cap_last: u32,
    /// What the init's OOM score adjustment was before it protected itself.
    oom_score_adj: CString,
    /// Programs started and not yet reaped, by pid.
    launched: HashSet<i32>,
    /// Whether the kernel has Landlock: then no program starts without a ruleset.
    landlock: bool,
}

impl Served {
    pub(super) fn new(oom_score_adj: CString) -> Self {
        Self {
            filters: None,
            cap_last: confine::cap_last_cap(),
            oom_score_adj,
            launched: HashSet::new(),
            landlock: confine::landlock_abi().is_ok(),
        }
    }

    /// Serves one request from `socket`; false at end-of-file (the server gave the
    /// sandbox up, or is gone).
    pub(super) fn serve_one(&mut self, socket: RawFd) -> bool {
        let mut buffer = vec![0u8; HEADER + MAX_INLINE];
        let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
        let (bytes, fds, truncated) = {
            let mut iov = [IoSliceMut::new(&mut buffer)];
            match recvmsg::<()>(
                socket,
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
            ) {
                Ok(msg) => (
                    msg.bytes,
                    received(&msg),
                    msg.flags
                        .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC),
                ),
                Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => return true,
                Err(_) => return false,
            }
        };
        if bytes == 0 {
            return false;
        }
        let id = buffer
            .get(1..9)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u64::from_le_bytes);
        let answer = match self.launch(&buffer[..bytes], truncated, fds) {
            Ok(pid) => match confine::pidfd_open(pid as u32) {
                Ok(pidfd) => {
                    if send_answer(socket, Answer::Started { id, pid }, Some((&pidfd, pid))) {
                        self.launched.insert(pid);
                    } else {
                        // Nobody will supervise it.
                        confine::pidfd_kill(&pidfd);
                    }
                    return true;
                }
                Err(e) => {
                    // It is this process's unreaped child, so the pid is still its.
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                    Answer::Failed {
                        id,
                        errno: e.raw_os_error().unwrap_or(libc::ESRCH),
                    }
                }
            },
            Err(errno) => Answer::Failed { id, errno },
        };
        send_answer(socket, answer, None);
        true
    }

    /// Tells the server that a program it started has ended (other processes the init
    /// reaps are orphans of the sandbox, not reported).
    pub(super) fn reaped(&mut self, socket: Option<RawFd>, pid: i32, status: i32) {
        if self.launched.remove(&pid)
            && let Some(socket) = socket
        {
            let _ = send_answer(socket, Answer::Exited { pid, status }, None);
        }
    }

    /// Starts the request's program; its pid, or the errno that kept it from starting.
    fn launch(&mut self, message: &[u8], truncated: bool, fds: Vec<OwnedFd>) -> Result<i32, i32> {
        if truncated || message.len() < HEADER || message[0] != b'L' {
            return Err(libc::EMSGSIZE);
        }
        let word = |at: usize| {
            u32::from_le_bytes([
                message[at],
                message[at + 1],
                message[at + 2],
                message[at + 3],
            ])
        };
        let uid = word(9);
        let gid = word(13);
        let io = usize::from(message[17]);
        let ruleset = message[18] == 1;
        let cgroups = usize::from(message[19]);
        let in_memfd = message[20] == 1;
        let length = word(21) as usize;
        let wanted = io + usize::from(ruleset) + cgroups + usize::from(in_memfd);
        if !(3..=3 + MAX_EXTRA_FDS).contains(&io)
            || cgroups > MAX_CGROUPS
            || fds.len() != wanted
            || length > MAX_PAYLOAD
        {
            return Err(libc::EINVAL);
        }
        // Whatever asks, no program of a sandbox runs as root, or unwalled where the kernel
        // has Landlock.
        if uid == 0 || gid == 0 || (self.landlock && !ruleset) {
            return Err(libc::EPERM);
        }
        // Every descriptor moves at or above HIGH_FD (see there).
        let mut high = Vec::with_capacity(fds.len());
        for fd in &fds {
            high.push(
                nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(HIGH_FD))
                    // SAFETY: the kernel just returned this descriptor; we own it.
                    .map(|raw| unsafe { OwnedFd::from_raw_fd(raw) })
                    .map_err(|e| e as i32)?,
            );
        }
        drop(fds);
        let mut rest = high.into_iter();
        let io_fds: Vec<OwnedFd> = rest.by_ref().take(io).collect();
        let ruleset = ruleset.then(|| rest.next()).flatten().map(Arc::new);
        let cgroup_fds: Vec<OwnedFd> = rest.by_ref().take(cgroups).collect();
        let payload = if in_memfd {
            let memfd = rest.next().ok_or(libc::EINVAL)?;
            read_memfd(memfd, length)?
        } else {
            let inline = &message[HEADER..];
            if inline.len() != length {
                return Err(libc::EINVAL);
            }
            inline.to_vec()
        };
        let payload = Payload::decode(&payload).ok_or(libc::EINVAL)?;
        let exec = Exec::new(&payload.program, &payload.args, &payload.env).ok_or(libc::EINVAL)?;
        let cwd = CString::new(payload.cwd).map_err(|_| libc::EINVAL)?;
        let filters = match &self.filters {
            Some(filters) => filters.clone(),
            None => {
                let filters = Arc::new(confine::filters().map_err(|_| libc::EINVAL)?);
                self.filters = Some(filters.clone());
                filters
            }
        };
        let confine = Confine {
            cwd,
            uid,
            gid,
            cap_last: self.cap_last,
            ruleset,
            filters,
            // The init is the program's parent.
            parent: 1,
        };
        let io_raw: Vec<RawFd> = io_fds.iter().map(AsRawFd::as_raw_fd).collect();
        let cgroup_raw: Vec<RawFd> = cgroup_fds.iter().map(AsRawFd::as_raw_fd).collect();
        // SAFETY: see `start`; every pointer it hands the child points into values that
        // live until it returns.
        unsafe { start(&io_raw, &cgroup_raw, &self.oom_score_adj, &confine, &exec) }
    }
}

/// The payload of a memfd of `length` bytes.
fn read_memfd(memfd: OwnedFd, length: usize) -> Result<Vec<u8>, i32> {
    let file = std::fs::File::from(memfd);
    let size = file.metadata().map_err(|_| libc::EINVAL)?.len();
    if size != length as u64 {
        return Err(libc::EINVAL);
    }
    let mut payload = vec![0u8; length];
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut payload, 0).map_err(|_| libc::EIO)?;
    Ok(payload)
}

/// Sends an answer; a `Started` carries the program's pidfd, and its pid in this
/// process's credentials (the kernel gives the server its host pid). Whether it was sent.
fn send_answer(socket: RawFd, answer: Answer, program: Option<(&OwnedFd, i32)>) -> bool {
    let bytes = answer.encode();
    let mut cmsgs = Vec::new();
    let fds: Vec<RawFd> = program.iter().map(|(fd, _)| fd.as_raw_fd()).collect();
    // Naming another process's pid takes CAP_SYS_ADMIN over the PID namespace, which the
    // init has; the uid and gid are its own.
    let credentials = program.map(|(_, pid)| {
        nix::sys::socket::UnixCredentials::from(libc::ucred {
            pid,
            uid: nix::unistd::getuid().as_raw(),
            gid: nix::unistd::getgid().as_raw(),
        })
    });
    if !fds.is_empty() {
        cmsgs.push(ControlMessage::ScmRights(&fds));
    }
    if let Some(credentials) = &credentials {
        cmsgs.push(ControlMessage::ScmCredentials(credentials));
    }
    loop {
        match sendmsg::<()>(
            socket,
            &[IoSlice::new(&bytes)],
            &cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Err(nix::errno::Errno::EINTR) => continue,
            // The server reads every answer; it being gone is the lifeline's business.
            sent => return sent.is_ok(),
        }
    }
}

/// What the launching child reads; it lives in the init's memory, which it shares.
struct Start<'a> {
    io: &'a [RawFd],
    cgroups: &'a [RawFd],
    oom_score_adj: &'a CString,
    confine: &'a Confine,
    exec: &'a Exec,
    errors: RawFd,
}

/// Starts the program: `clone(CLONE_VM | CLONE_VFORK)`, so this process sleeps until the
/// child has exec'd (the error pipe closes) or failed (its errno arrives).
///
/// # Safety
///
/// Only in the init, which is single-threaded. Every descriptor in `io` and `cgroups` is
/// at or above [`HIGH_FD`] (so `dup2` onto 0, 1, 2, ... overwrites none of them).
unsafe fn start(
    io: &[RawFd],
    cgroups: &[RawFd],
    oom_score_adj: &CString,
    confine: &Confine,
    exec: &Exec,
) -> Result<i32, i32> {
    let errno = || {
        std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL)
    };
    let mut errors = [0 as libc::c_int; 2];
    // SAFETY: pipe2 fills the two-integer array we own.
    if unsafe { libc::pipe2(errors.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(errno());
    }
    // SAFETY: both ends were just made and are ours.
    let (read_end, write_end) = unsafe {
        (
            OwnedFd::from_raw_fd(errors[0]),
            OwnedFd::from_raw_fd(errors[1]),
        )
    };
    // The write end must survive the child's dup2 onto its low descriptors; the original
    // closes here, or the read below would never see end-of-file.
    let write_end = {
        let low = write_end;
        nix::fcntl::fcntl(&low, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(HIGH_FD))
            // SAFETY: the kernel just returned this descriptor; we own it.
            .map(|raw| unsafe { OwnedFd::from_raw_fd(raw) })
            .map_err(|e| e as i32)?
    };
    let arg = Start {
        io,
        cgroups,
        oom_score_adj,
        confine,
        exec,
        errors: write_end.as_raw_fd(),
    };
    let stack = exec.stack_top();
    // SAFETY: the child runs `launch_child` on the stack `exec` owns, in our memory, while
    // we sleep (CLONE_VFORK); `arg` lives until clone returns, which is after the child
    // has exec'd or exited.
    let child = unsafe {
        libc::clone(
            launch_child,
            stack,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            &arg as *const Start as *mut libc::c_void,
        )
    };
    if child < 0 {
        return Err(errno());
    }
    drop(write_end);
    let mut word = [0u8; 4];
    let read = nix::unistd::read(&read_end, &mut word);
    if read == Ok(4) {
        let mut status = 0;
        // SAFETY: waitpid on our own child, with a status integer we own.
        unsafe { libc::waitpid(child, &mut status, 0) };
        return Err(i32::from_ne_bytes(word));
    }
    Ok(child)
}

/// The launching child: takes its descriptors and session, joins cgroups (v2), restores
/// the signal mask and OOM score, then is confined and execs; on failure writes the errno
/// to the pipe and exits. Runs in the init's memory, which sleeps meanwhile.
extern "C" fn launch_child(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `Start` that `start` keeps alive until this child has exec'd
    // or exited (CLONE_VFORK).
    let start = unsafe { &*(arg as *const Start) };
    // SAFETY: system calls on prepared data only; see `prepare`.
    let errno = match unsafe { prepare(start) } {
        // SAFETY: this is the launching child; see `confine_and_exec`.
        Ok(()) => unsafe { confine::confine_and_exec(start.confine, start.exec) },
        Err(errno) => errno,
    };
    // SAFETY: write(2) of an integer to our end of the pipe, then _exit(2).
    unsafe {
        libc::write(
            start.errors,
            &errno as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>(),
        );
        libc::_exit(127)
    }
}

/// # Safety
///
/// Only in the launching child: plain system calls on integers and prepared strings.
unsafe fn prepare(start: &Start) -> Result<(), libc::c_int> {
    let errno = || {
        std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL)
    };
    // SAFETY: see the function's safety section.
    unsafe {
        // The init blocks the signals it reads through a signalfd; the program must not
        // start with them blocked.
        // Nor with the signals the init ignores (a Rust program ignores SIGPIPE). This
        // child has its own copy of the init's dispositions (no CLONE_SIGHAND). Reset
        // before unblocking.
        super::default_dispositions();
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        if libc::setsid() < 0 {
            return Err(errno());
        }
        for (target, fd) in start.io.iter().enumerate() {
            if libc::dup2(*fd, target as RawFd) < 0 {
                return Err(errno());
            }
        }
        // Nothing else of the init's reaches the program.
        super::close_on_exec_from(start.io.len() as RawFd);
        for procs in start.cgroups {
            if libc::write(*procs, b"0".as_ptr() as *const libc::c_void, 1) != 1 {
                return Err(errno());
            }
        }
        // The init never lets the OOM killer pick it; its programs get the score the
        // runtime server's programs have.
        let fd = libc::open(
            c"/proc/self/oom_score_adj".as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        );
        if fd < 0 {
            return Err(errno());
        }
        let value = start.oom_score_adj.as_bytes();
        let written = libc::write(fd, value.as_ptr() as *const libc::c_void, value.len());
        libc::close(fd);
        if written != value.len() as isize {
            return Err(errno());
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_round_trips_and_a_damaged_one_is_refused() {
        let payload = Payload {
            cwd: b"/work".to_vec(),
            program: "bash".into(),
            args: vec!["-c".into(), "echo ok".into(), "".into()],
            env: vec![
                ("PATH".into(), "/usr/bin".into()),
                ("EMPTY".into(), "".into()),
            ],
        };
        let bytes = payload.encode();
        assert_eq!(Payload::decode(&bytes).unwrap(), payload);
        for cut in 0..bytes.len() {
            assert!(Payload::decode(&bytes[..cut]).is_none(), "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(Payload::decode(&longer).is_none());
        // A count far beyond what follows is refused before anything is allocated.
        let mut lying = Vec::new();
        put(&mut lying, b"/");
        put(&mut lying, b"true");
        lying.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(Payload::decode(&lying).is_none());
    }

    // The tests below play the sandbox's init on the other end of the socket: a test
    // double, to force orders the real init cannot be made to produce on cue (an answer
    // after its caller gave up, the init gone mid-launch). The real init is exercised by
    // the session, task and escape tests.

    fn enter() -> Enter {
        Enter {
            pidfd: Arc::new(confine::pidfd_open(std::process::id()).unwrap()),
            cgroups: Arc::from(Vec::<std::fs::File>::new()),
            confine: Confine {
                cwd: c"/".to_owned(),
                uid: 65534,
                gid: 65534,
                cap_last: 40,
                ruleset: None,
                filters: Arc::new(Vec::new()),
                parent: 1,
            },
            launcher: None,
        }
    }

    fn spec() -> SpawnSpec {
        SpawnSpec {
            program: "true".into(),
            args: vec!["x".repeat(MAX_INLINE).into()],
            env: vec![("PATH".into(), "/usr/bin".into())],
            cwd: "/".into(),
            stdin: Stdio::Null,
            stdout: Stdio::Piped,
            stderr: Stdio::Null,
            cgroup_procs: None,
            extra_fds: Vec::new(),
            place: super::super::Place::Host,
        }
    }

    /// Starts a launch on `launcher` in a task.
    fn launch(launcher: &Arc<Launcher>) -> tokio::task::JoinHandle<Result<Child, SpawnError>> {
        let launcher = launcher.clone();
        tokio::spawn(async move { launcher.launch(spec(), &enter()).await })
    }

    /// The fake init: one request's id, its payload checked, its descriptors closed.
    async fn request(init: &Arc<OwnedFd>) -> u64 {
        let init = init.clone();
        tokio::task::spawn_blocking(move || {
            let mut buffer = vec![0u8; HEADER + MAX_INLINE];
            let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
            let mut iov = [IoSliceMut::new(&mut buffer)];
            let msg = recvmsg::<()>(
                init.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC,
            )
            .unwrap();
            let fds = received(&msg);
            let bytes = msg.bytes;
            // stdin, stdout, stderr, and the payload (over MAX_INLINE) in a memfd.
            assert_eq!(fds.len(), 4);
            assert_eq!(bytes, HEADER);
            assert_eq!(buffer[20], 1, "the payload travels in a memfd");
            let length = u32::from_le_bytes(buffer[21..25].try_into().unwrap()) as usize;
            let payload = read_memfd(fds.into_iter().last().unwrap(), length).unwrap();
            let payload = Payload::decode(&payload).unwrap();
            assert_eq!(payload.program, "true");
            assert_eq!(payload.args[0].len(), MAX_INLINE);
            u64::from_le_bytes(buffer[1..9].try_into().unwrap())
        })
        .await
        .unwrap()
    }

    /// A real process standing for the program, and a pidfd of it.
    fn program() -> (std::process::Child, OwnedFd) {
        let child = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap();
        let pidfd = confine::pidfd_open(child.id()).unwrap();
        (child, pidfd)
    }

    /// Waits (with the deadline) until the process behind `pidfd` has been killed.
    async fn assert_killed(mut process: std::process::Child, pidfd: OwnedFd) {
        assert!(
            tokio::task::spawn_blocking(move || confine::pidfd_ends_within(&pidfd, DEADLINE))
                .await
                .unwrap(),
            "the program was not killed"
        );
        assert_eq!(process.wait().unwrap().signal(), Some(libc::SIGKILL));
    }

    fn pair() -> (Arc<Launcher>, Arc<OwnedFd>) {
        let (ours, theirs) = socket_pair().unwrap();
        // The fake init's reads fail rather than hang a test.
        let limit = nix::sys::time::TimeVal::new(DEADLINE.as_secs() as libc::time_t, 0);
        nix::sys::socket::setsockopt(&theirs, nix::sys::socket::sockopt::ReceiveTimeout, &limit)
            .unwrap();
        (Launcher::start(ours).unwrap(), Arc::new(theirs))
    }

    const DEADLINE: Duration = Duration::from_secs(20);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn answers_reach_their_launches_and_an_end_reported_before_the_wait_is_kept() {
        let (launcher, init) = pair();
        let first = launch(&launcher);
        let first_id = request(&init).await;
        let second = launch(&launcher);
        let second_id = request(&init).await;
        assert_ne!(first_id, second_id);
        // Answered out of order: the second fails, the first starts and ends at once.
        send_answer(
            init.as_raw_fd(),
            Answer::Failed {
                id: second_id,
                errno: libc::ENOENT,
            },
            None,
        );
        let (mut process, pidfd) = program();
        send_answer(
            init.as_raw_fd(),
            Answer::Started {
                id: first_id,
                pid: 42,
            },
            Some((&pidfd, process.id() as i32)),
        );
        send_answer(
            init.as_raw_fd(),
            Answer::Exited {
                pid: 42,
                status: 3 << 8,
            },
            None,
        );
        let error = second.await.unwrap().unwrap_err();
        assert_eq!(error.source.kind(), std::io::ErrorKind::NotFound);
        let mut child = first.await.unwrap().unwrap();
        assert!(child.is_launched());
        // The host pid, read from the pidfd the init sent.
        assert_eq!(child.id(), Some(process.id()));
        assert!(child.stdout.is_some() && child.stdin.is_none());
        let status = tokio::time::timeout(DEADLINE, child.wait())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(status.code(), Some(3));
        assert_eq!(child.id(), None);
        assert_eq!(child.try_wait().unwrap(), Some(status));
        process.kill().unwrap();
        process.wait().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_program_whose_launch_was_given_up_is_killed_when_its_answer_comes() {
        let (launcher, init) = pair();
        let given_up = launch(&launcher);
        let id = request(&init).await;
        given_up.abort();
        assert!(given_up.await.unwrap_err().is_cancelled());
        let (process, pidfd) = program();
        send_answer(
            init.as_raw_fd(),
            Answer::Started { id, pid: 9 },
            Some((&pidfd, process.id() as i32)),
        );
        assert_killed(process, pidfd).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_init_gone_fails_launches_and_ends_its_programs() {
        let (launcher, init) = pair();
        let first = launch(&launcher);
        let id = request(&init).await;
        let (mut process, pidfd) = program();
        send_answer(
            init.as_raw_fd(),
            Answer::Started { id, pid: 5 },
            Some((&pidfd, process.id() as i32)),
        );
        let mut child = first.await.unwrap().unwrap();
        let pending = launch(&launcher);
        request(&init).await;
        assert_eq!(child.try_wait().unwrap(), None);
        // The init dies: its end of the socket closes.
        drop(init);
        let error = pending.await.unwrap().unwrap_err();
        assert_eq!(error.source.raw_os_error(), Some(libc::ESRCH));
        let status = tokio::time::timeout(DEADLINE, child.wait())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        assert!(launcher.closed());
        let error = launch(&launcher).await.unwrap().unwrap_err();
        assert_eq!(error.source.raw_os_error(), Some(libc::ESRCH));
        process.kill().unwrap();
        process.wait().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_program_answered_but_not_taken_when_its_launch_is_dropped_is_killed() {
        let (launcher, init) = pair();
        let enter = enter();
        let mut launching = Box::pin(launcher.launch(spec(), &enter));
        // Driven until its request has arrived; then it waits for the answer.
        let id = tokio::select! {
            _ = launching.as_mut() => panic!("the launch ended without an answer"),
            id = request(&init) => id,
        };
        let (process, pidfd) = program();
        send_answer(
            init.as_raw_fd(),
            Answer::Started { id, pid: 11 },
            Some((&pidfd, process.id() as i32)),
        );
        // The reader hands the answer over (the waiter leaves the table) ...
        let until = std::time::Instant::now() + DEADLINE;
        while !lock(&launcher.state).starts.is_empty() {
            assert!(
                std::time::Instant::now() < until,
                "the answer was not handed over"
            );
            tokio::task::yield_now().await;
        }
        // ... and the launch is dropped before it takes it.
        drop(launching);
        assert_killed(process, pidfd).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_answer_that_cannot_be_supervised_ends_the_sandbox() {
        let (launcher, init) = pair();
        // A process standing for the sandbox's init.
        let (mut sandbox, sandbox_pidfd) = program();
        launcher.set_init(Arc::new(sandbox_pidfd));
        let pending = launch(&launcher);
        let id = request(&init).await;
        // A start without the program's pidfd (as when the kernel dropped it).
        send_answer(init.as_raw_fd(), Answer::Started { id, pid: 3 }, None);
        let error = pending.await.unwrap().unwrap_err();
        assert_eq!(error.source.raw_os_error(), Some(libc::ESRCH));
        assert!(launcher.closed());
        let ended = tokio::task::spawn_blocking(move || sandbox.wait().unwrap())
            .await
            .unwrap();
        assert_eq!(ended.signal(), Some(libc::SIGKILL));
    }

    #[test]
    fn answers_round_trip() {
        for answer in [
            Answer::Started { id: 7, pid: 42 },
            Answer::Failed {
                id: u64::MAX,
                errno: libc::ENOENT,
            },
            Answer::Exited { pid: 3, status: 9 },
        ] {
            assert_eq!(Answer::decode(&answer.encode()), Some(answer));
        }
        assert_eq!(Answer::decode(b"X"), None);
        let mut unknown = Answer::Started { id: 1, pid: 1 }.encode();
        unknown[0] = b'Z';
        assert_eq!(Answer::decode(&unknown), None);
    }
}
