//! Sandbox backends: `process` (trusted workloads: a process group and an execution
//! cgroup) and `namespaces` (hardened: one set of namespaces per task execution, function
//! registration or session, with a read-only system view, the workspace as the only
//! writable host path, no network but loopback, a non-root user without capabilities,
//! seccomp, Landlock where the kernel has it, and memory, pids and CPU limits).
//!
//! This module decides whether the machine supports `namespaces`, owns the server-wide
//! parts (the seccomp filters, the lifeline every holder watches, where limit cgroups
//! go), and creates and destroys sandboxes. The system calls are `isolation`'s.
//!
//! Submodules: [`isolation`] (the crate's only `unsafe` code: starting a process in its
//! own session and cgroup, a sandbox's holder, entering a sandbox, the `gvisor` helper's
//! modes), [`cgroup`] (execution cgroups), [`limits`] (a sandbox's cgroup limits) and
//! [`runsc`] (`gvisor` containers).
// `deny`, not `forbid`: `isolation`, a submodule, allows the `unsafe` code it must have.
#![deny(unsafe_code)]

pub mod cgroup;
pub mod isolation;
pub mod limits;
pub mod runsc;

use std::collections::VecDeque;
use std::ffi::CString;
use std::fs::File;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use nix::sys::signal::Signal;

use cgroup::ExecCgroup;
use isolation::confine::{self, Grant};
use isolation::holder::{HolderArgs, SYSTEM_DIRS};
use isolation::{Child, Confine, Enter, Place, SpawnSpec, Stdio};
use limits::{LimitGroup, LimitParents, Limits};
use runsc::{Gvisor, Running, Runsc};

/// Which backend runs programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxKind {
    /// The server's own namespaces and user: for trusted workloads only.
    Process,
    /// Namespaces, seccomp, Landlock and cgroup limits.
    Namespaces,
    /// gVisor (`runsc`): a kernel of its own in user space, plus the same user, seccomp
    /// and limits.
    Gvisor,
}

impl std::fmt::Display for SandboxKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Process => "process",
            Self::Namespaces => "namespaces",
            Self::Gvisor => "gvisor",
        })
    }
}

/// How long a holder may take to build its sandbox.
const READY_LIMIT: Duration = Duration::from_secs(10);
/// The longest `ready`/`error` line a holder writes.
const READY_LINE_MAX: usize = 1024;
/// At most this many workspace entries are handed to the sandbox user at creation.
const CHOWN_MAX_ENTRIES: usize = 100_000;

/// Why a sandbox could not be made or used.
#[derive(Debug, thiserror::Error)]
#[error("sandbox: {0}")]
pub struct SandboxError(pub String);

/// The settings of the `namespaces` backend.
#[derive(Debug, Clone)]
pub struct NamespacesConfig {
    /// The runtime server's root (holds the holders' staging directory).
    pub root: PathBuf,
    /// The user and group programs run as, outside and inside.
    pub uid: u32,
    pub gid: u32,
    pub limits: Limits,
    /// The size of each sandbox's private `/tmp`.
    pub tmp_bytes: u64,
    /// The v2 parent of execution cgroups, when cgroups are used.
    pub cgroup_parent: Option<PathBuf>,
    /// `Some` for the `gvisor` backend: which `runsc`.
    pub gvisor: Option<Runsc>,
    /// `namespaces`: the sandbox's init starts its programs (see
    /// `isolation::launcher`); without it each program starts from a fork of the server.
    pub launcher: bool,
}

/// Host pids a `gvisor` sandbox may use beyond its pids limit: the host counts the
/// sandbox kernel's threads too, so the limit proper is `RLIMIT_NPROC` inside.
const GVISOR_HOST_PIDS: u64 = 512;
/// Host memory a `gvisor` sandbox may use beyond its memory limit: the sandbox kernel's
/// own (its heap, page tables, and one host process per sandboxed process), which the
/// host cgroup counts with the programs'.
const GVISOR_HOST_MEMORY: u64 = 192 << 20;

/// The server-wide part of the `namespaces` backend.
#[derive(Debug)]
pub struct Sandboxes {
    config: NamespacesConfig,
    exe: PathBuf,
    stage: PathBuf,
    filters: Arc<Vec<seccompiler::BpfProgram>>,
    cap_last: u32,
    limits: Option<LimitParents>,
    /// Whether the kernel has Landlock (asked once).
    landlock: bool,
    /// The `gvisor` backend's containers, when that is the backend.
    gvisor: Option<Arc<Gvisor>>,
    /// What is enforced, for logs and Capabilities.
    pub enforcement: String,
    /// Every holder gets the read end; the write end is never written and closes only
    /// when this process ends, which tells every holder to end its sandbox.
    lifeline_read: OwnedFd,
    _lifeline_write: OwnedFd,
    /// Warm sandboxes (`namespaces` only): built ahead of time, each taken by one Run.
    pool: Arc<Pool>,
}

/// At most this many warm sandboxes may be asked for.
pub const MAX_WARM: usize = 64;
/// After this many failed pre-builds in a row, the pool stops building (takes build
/// inline, as without a pool).
const WARM_FAILURES_MAX: u32 = 5;

/// Warm sandboxes: never-used sandboxes with no Run-specific part yet (no writable
/// paths, no Landlock ruleset), refilled in the background after each take. A sandbox
/// leaves the pool once and is destroyed by the Run that took it; none ever returns.
#[derive(Debug, Default)]
struct Pool {
    state: std::sync::Mutex<PoolState>,
    /// Wakes the refiller (a take, or the pool closing).
    wake: tokio::sync::Notify,
    /// Held by the refiller while it builds one; closing waits for it.
    building: tokio::sync::Mutex<()>,
}

#[derive(Debug, Default)]
struct PoolState {
    target: usize,
    ready: VecDeque<Sandbox>,
    closed: bool,
    /// Names warm sandboxes (`warm-<n>`): never reused on this server.
    serial: u64,
}

/// Starts the `namespaces` backend: checks that this machine supports it by creating (and
/// destroying) one sandbox. `Err` says why it cannot be used.
pub async fn start(config: NamespacesConfig) -> Result<Arc<Sandboxes>, String> {
    if !nix::unistd::geteuid().is_root() {
        return Err(
            "it needs root (it creates mount and PID namespaces and switches to the sandbox user)"
                .into(),
        );
    }
    for ns in ["mnt", "pid", "net", "ipc", "uts"] {
        if !Path::new("/proc/self/ns").join(ns).exists() {
            return Err(format!("the kernel has no {ns} namespaces"));
        }
    }
    let backend = Arc::new(Sandboxes::new(config)?);
    if let Some(gvisor) = &backend.gvisor {
        gvisor.clean_leftovers().await;
    }
    let mut probe = backend
        .create("probe", Vec::new(), None)
        .await
        .map_err(|e| e.0)?;
    probe.destroy().await;
    Ok(backend)
}

/// Whether `namespaces` works here, for a caller that chooses the backend of many workers
/// at once (`kruntimes up`): one probe sandbox in a scratch root. `Ok` is what it enforces.
pub async fn probe(scratch: &Path, gvisor: Option<Runsc>) -> Result<String, String> {
    let config = NamespacesConfig {
        root: scratch.to_owned(),
        uid: 65534,
        gid: 65534,
        limits: Limits::default(),
        tmp_bytes: 1 << 20,
        cgroup_parent: None,
        gvisor,
        launcher: true,
    };
    let result = start(config).await;
    let result = match result {
        Ok(backend) => {
            backend.remove_limit_parents();
            Ok(backend.enforcement.clone())
        }
        Err(reason) => Err(reason),
    };
    let _ = std::fs::remove_dir_all(scratch);
    result
}

impl Sandboxes {
    /// Prepares the backend: the seccomp filters, the staging directory, the limit
    /// cgroups' parents and the lifeline.
    pub fn new(config: NamespacesConfig) -> Result<Self, String> {
        // The small holder binary beside this one starts faster; this binary is a holder
        // too when started with HOLDER_ARG.
        let me = std::env::current_exe()
            .map_err(|e| format!("cannot find this server's binary: {e}"))?;
        let exe = me
            .parent()
            .map(|dir| dir.join("kruntimes-sandbox-holder"))
            .filter(|holder| holder.is_file())
            .unwrap_or(me);
        let stage = config.root.join(".sandbox-stage");
        std::fs::create_dir_all(&stage)
            .map_err(|e| format!("cannot create {}: {e}", stage.display()))?;
        let filters = Arc::new(confine::filters()?);
        let limits = match LimitParents::discover(&config.root, config.cgroup_parent.as_deref()) {
            Ok(parents) => {
                parents.clean_leftovers();
                Some(parents)
            }
            Err(reason) => {
                tracing::warn!(%reason, "sandbox limits unavailable: memory, pids and CPU are not limited");
                None
            }
        };
        let landlock = confine::landlock_abi();
        let gvisor = match config.gvisor.clone() {
            Some(runsc) => Some(Arc::new(Gvisor::new(runsc, &config.root, exe.clone())?)),
            None => None,
        };
        let enforcement = match &gvisor {
            Some(gvisor) => format!(
                "gvisor ({}, platform {}); no network but loopback; uid {} without capabilities; seccomp ({} denied system calls); limits {}",
                gvisor.version,
                config.gvisor.as_ref().map_or("", |r| r.platform.as_str()),
                config.uid,
                confine::DENIED.len() + confine::DENIED_WITH_NEWUSER.len() + 1,
                match &limits {
                    Some(LimitParents::V1(_)) => format!(
                        "cgroup v1 on the whole sandbox {}, RLIMIT_NPROC inside",
                        describe(config.limits)
                    ),
                    Some(LimitParents::V2) => format!(
                        "cgroup v2 on the whole sandbox {}, RLIMIT_NPROC inside",
                        describe(config.limits)
                    ),
                    None => "RLIMIT_NPROC inside only".to_owned(),
                }
            ),
            None => format!(
                "namespaces mnt,pid,net,ipc,uts; uid {} without capabilities; seccomp ({} denied system calls); landlock {}; limits {}",
                config.uid,
                confine::DENIED.len() + confine::DENIED_WITH_NEWUSER.len() + 1,
                match &landlock {
                    Ok(abi) => format!("ABI {abi}"),
                    Err(reason) => format!("not enforced ({reason})"),
                },
                match &limits {
                    Some(LimitParents::V1(_)) => format!("cgroup v1 {}", describe(config.limits)),
                    Some(LimitParents::V2) => format!("cgroup v2 {}", describe(config.limits)),
                    None => "none".to_owned(),
                }
            ),
        };
        let (read, write) = std::io::pipe().map_err(|e| format!("lifeline pipe: {e}"))?;
        Ok(Self {
            config,
            exe,
            stage,
            filters,
            cap_last: confine::cap_last_cap(),
            limits,
            landlock: landlock.is_ok(),
            gvisor,
            enforcement,
            lifeline_read: read.into(),
            _lifeline_write: write.into(),
            pool: Arc::default(),
        })
    }

    /// Keeps `size` warm sandboxes ready (`namespaces` only; 0, or another backend,
    /// keeps none). Failed pre-builds are logged and retried with a growing pause, at
    /// most [`WARM_FAILURES_MAX`] in a row; a take never waits for the pool.
    pub fn start_pool(self: &Arc<Self>, size: usize) {
        if size == 0 || self.kind() != SandboxKind::Namespaces {
            return;
        }
        lock(&self.pool.state).target = size.min(MAX_WARM);
        let pool = self.pool.clone();
        let backend = Arc::downgrade(self);
        tokio::spawn(refill(backend, pool));
    }

    /// How many warm sandboxes are ready now.
    pub fn warm_ready(&self) -> usize {
        lock(&self.pool.state).ready.len()
    }

    /// Stops refilling and destroys every warm sandbox (waiting for one being built).
    pub async fn close_pool(&self) {
        lock(&self.pool.state).closed = true;
        self.pool.wake.notify_one();
        let _building = self.pool.building.lock().await;
        let ready: Vec<Sandbox> = lock(&self.pool.state).ready.drain(..).collect();
        for mut sandbox in ready {
            sandbox.destroy().await;
        }
    }

    fn take_warm(&self) -> Option<Sandbox> {
        let taken = lock(&self.pool.state).ready.pop_front();
        if taken.is_some() {
            self.pool.wake.notify_one();
        }
        taken
    }

    /// Removes the per-server parents of limit cgroups once every sandbox is gone.
    pub fn remove_limit_parents(&self) {
        if let Some(limits) = &self.limits {
            limits.remove_if_empty();
        }
    }

    /// `namespaces` or `gvisor`.
    pub fn kind(&self) -> SandboxKind {
        if self.gvisor.is_some() {
            SandboxKind::Gvisor
        } else {
            SandboxKind::Namespaces
        }
    }

    pub fn uid(&self) -> (u32, u32) {
        (self.config.uid, self.config.gid)
    }

    /// Creates sandbox `name` (one path component, unique on this server) whose writable
    /// host paths are `writable` (directories or files, bound at the same path; handed to
    /// the sandbox user). Its programs run in `exec` (their v2 cgroup) when given.
    pub async fn create(
        self: &Arc<Self>,
        name: &str,
        writable: Vec<PathBuf>,
        exec: Option<&ExecCgroup>,
    ) -> Result<Sandbox, SandboxError> {
        let started = std::time::Instant::now();
        for path in &writable {
            hand_over(path, self.config.uid, self.config.gid).map_err(|e| {
                SandboxError(format!(
                    "cannot hand {} to the sandbox user: {e}",
                    path.display()
                ))
            })?;
        }
        if let Some(mut warm) = self.take_warm() {
            match warm.bind(&writable, exec).await {
                Ok(()) => {
                    tracing::debug!(
                        sandbox = name,
                        warm = %warm.container.name,
                        ready_us = started.elapsed().as_micros() as u64,
                        "warm sandbox taken"
                    );
                    return Ok(warm);
                }
                Err(e) => {
                    tracing::warn!(sandbox = name, error = %e, "a warm sandbox could not be bound; building one");
                    warm.destroy().await;
                }
            }
        }
        self.build(name, writable, exec, false).await
    }

    /// Builds a sandbox; `warm`: with no writable paths yet and a control socket to bind
    /// them later, once ([`Sandbox::bind`]).
    async fn build(
        self: &Arc<Self>,
        name: &str,
        writable: Vec<PathBuf>,
        exec: Option<&ExecCgroup>,
        warm: bool,
    ) -> Result<Sandbox, SandboxError> {
        let started = std::time::Instant::now();
        let mut host_limits = self.config.limits;
        if self.gvisor.is_some() {
            host_limits.pids = host_limits.pids.map(|p| p + GVISOR_HOST_PIDS);
            host_limits.memory_bytes = host_limits
                .memory_bytes
                .map(|m| m.saturating_add(GVISOR_HOST_MEMORY));
        }
        let limits = match &self.limits {
            Some(parents) => Some(
                parents
                    .create(name, host_limits, exec)
                    .map_err(SandboxError)?,
            ),
            None => None,
        };
        let prepared = started.elapsed();
        // From here on, a failure destroys what was made (holder, limit cgroups) once.
        let mut sandbox = Sandbox {
            holder: None,
            init: None,
            control: None,
            launcher: None,
            pidfd: None,
            ruleset: None,
            cgroups: Arc::from(Vec::new()),
            limits,
            container: Arc::new(Slot {
                running: std::sync::Mutex::new(None),
                name: name.to_owned(),
                writable: writable.clone(),
                generation: std::sync::atomic::AtomicU32::new(0),
                replacing: tokio::sync::Mutex::new(()),
            }),
            backend: self.clone(),
        };
        if self.gvisor.is_some() {
            if let Err(e) = sandbox.run_container().await {
                sandbox.destroy().await;
                return Err(e);
            }
            tracing::debug!(
                sandbox = name,
                ready_us = started.elapsed().as_micros() as u64,
                "gvisor sandbox created"
            );
            return Ok(sandbox);
        }
        let built = sandbox.start_holder(&writable, warm);
        let spawned = started.elapsed();
        let built = match built {
            Ok(ready) => ready.await.and_then(|()| sandbox.attach()),
            Err(e) => Err(e),
        };
        let built = match built {
            // A warm sandbox's ruleset names the Run's writable paths: made when bound.
            Ok(()) if !warm => sandbox.build_ruleset(&writable),
            other => other,
        };
        let ready = started.elapsed();
        if let Err(e) = built {
            sandbox.destroy().await;
            return Err(e);
        }
        tracing::debug!(
            sandbox = name,
            prepared_us = prepared.as_micros() as u64,
            spawned_us = spawned.as_micros() as u64,
            ready_and_attached_us = ready.as_micros() as u64,
            "sandbox created"
        );
        Ok(sandbox)
    }
}

fn describe(limits: Limits) -> String {
    let show = |v: Option<u64>| v.map_or("unlimited".to_owned(), |v| v.to_string());
    format!(
        "memory={} pids={} cpu_millis={}",
        show(limits.memory_bytes),
        show(limits.pids),
        show(limits.cpu_millis)
    )
}

/// Reads the holder's one line (until end-of-file, at most [`READY_LINE_MAX`] bytes).
pub(crate) async fn read_line(pipe: std::io::PipeReader) -> std::io::Result<String> {
    tokio::task::spawn_blocking(move || {
        let mut text = Vec::new();
        pipe.take(READY_LINE_MAX as u64).read_to_end(&mut text)?;
        let text = String::from_utf8_lossy(&text);
        Ok(text.lines().next().unwrap_or_default().trim().to_owned())
    })
    .await
    .map_err(std::io::Error::other)?
}

/// Hands `path` (and, for a directory, everything beneath it, without following symlinks)
/// to the sandbox user. Runs before any program of the sandbox does.
fn hand_over(path: &Path, uid: u32, gid: u32) -> std::io::Result<()> {
    let mut pending = vec![path.to_owned()];
    let mut seen = 0usize;
    while let Some(path) = pending.pop() {
        seen += 1;
        if seen > CHOWN_MAX_ENTRIES {
            return Err(std::io::Error::other(format!(
                "more than {CHOWN_MAX_ENTRIES} entries"
            )));
        }
        std::os::unix::fs::lchown(&path, Some(uid), Some(gid))?;
        let meta = std::fs::symlink_metadata(&path)?;
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path)? {
                pending.push(entry?.path());
            }
        }
    }
    Ok(())
}

/// Builds warm sandboxes while the pool is below its target.
async fn refill(backend: Weak<Sandboxes>, pool: Arc<Pool>) {
    let mut failures = 0u32;
    loop {
        let woken = pool.wake.notified();
        let (need, closed) = {
            let state = lock(&pool.state);
            (state.ready.len() < state.target, state.closed)
        };
        if closed {
            return;
        }
        if !need {
            woken.await;
            continue;
        }
        let Some(sandboxes) = backend.upgrade() else {
            return;
        };
        let building = pool.building.lock().await;
        let name = {
            let mut state = lock(&pool.state);
            if state.closed {
                return;
            }
            state.serial += 1;
            format!("warm-{}", state.serial)
        };
        let built = sandboxes.build(&name, Vec::new(), None, true).await;
        drop(sandboxes);
        match built {
            Ok(sandbox) => {
                failures = 0;
                let refused = {
                    let mut state = lock(&pool.state);
                    if state.closed {
                        Some(sandbox)
                    } else {
                        state.ready.push_back(sandbox);
                        None
                    }
                };
                if let Some(mut sandbox) = refused {
                    sandbox.destroy().await;
                }
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(sandbox = %name, error = %e, failures, "a warm sandbox could not be built");
                if failures >= WARM_FAILURES_MAX {
                    tracing::error!(
                        failures,
                        "warm sandboxes disabled after repeated failures; sandboxes are built when taken"
                    );
                    lock(&pool.state).target = 0;
                    return;
                }
                drop(building);
                // A pause before the retry (not a synchronisation): 50 ms, doubling.
                tokio::time::sleep(Duration::from_millis(50 << failures)).await;
                continue;
            }
        }
        drop(building);
    }
}

/// One sandbox: its holder, the pidfd of its PID 1, its Landlock ruleset and its limits.
#[derive(Debug)]
pub struct Sandbox {
    holder: Option<Child>,
    /// The host pid of its PID 1 (the holder's init).
    init: Option<u32>,
    /// A warm sandbox's control socket, until it is bound (once).
    control: Option<OwnedFd>,
    /// Its init's launcher socket (`namespaces`, unless turned off).
    launcher: Option<Arc<isolation::launcher::Launcher>>,
    pidfd: Option<Arc<OwnedFd>>,
    ruleset: Option<Arc<OwnedFd>>,
    /// `cgroup.procs` of the limit cgroups, opened once for every program.
    cgroups: Arc<[File]>,
    limits: Option<LimitGroup>,
    /// `gvisor`: the running container (replaced when an OOM kill ended the last one).
    container: Arc<Slot>,
    backend: Arc<Sandboxes>,
}

/// A `gvisor` sandbox's container, and what it takes to start another.
#[derive(Debug)]
struct Slot {
    running: std::sync::Mutex<Option<Running>>,
    name: String,
    writable: Vec<PathBuf>,
    /// How many containers this sandbox has started.
    generation: std::sync::atomic::AtomicU32,
    /// One replacement at a time.
    replacing: tokio::sync::Mutex<()>,
}

/// Replaces a `gvisor` sandbox's container whose kernel has ended (see
/// [`Sandbox::revival`]); holds no lock of the caller's.
#[derive(Debug)]
pub struct Revival {
    backend: Arc<Sandboxes>,
    slot: Arc<Slot>,
    cgroups: Arc<[File]>,
    /// The container to replace (another caller may have replaced it already).
    id: Option<String>,
}

impl Revival {
    /// Replaces the container the OOM killer hit: a process killed there takes the whole
    /// sandbox kernel down, though it may take a moment to end. The old one is killed
    /// for sure; the new one has the same writable host paths and a new `/tmp`.
    /// `Ok(false)` when another caller replaced it already.
    pub async fn revive(self) -> Result<bool, SandboxError> {
        let _one = self.slot.replacing.lock().await;
        let old = {
            let mut running = lock(&self.slot.running);
            if running.as_ref().map(|r| &r.id) != self.id.as_ref() {
                return Ok(false);
            }
            running.take()
        };
        if let (Some(gvisor), Some(old)) = (&self.backend.gvisor, old) {
            gvisor.remove(old).await;
        }
        run_container(&self.backend, &self.slot, self.cgroups).await?;
        tracing::info!(sandbox = %self.slot.name, "gvisor sandbox replaced after its kernel ended");
        Ok(true)
    }
}

/// `gvisor`: starts a container (in the limit cgroups) and makes it the slot's.
async fn run_container(
    backend: &Sandboxes,
    slot: &Slot,
    cgroups: Arc<[File]>,
) -> Result<(), SandboxError> {
    let Some(gvisor) = &backend.gvisor else {
        return Err(SandboxError("not a gvisor sandbox".into()));
    };
    let generation = slot
        .generation
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let id = if generation == 0 {
        slot.name.clone()
    } else {
        format!("{}.{generation}", slot.name)
    };
    let lifeline = backend
        .lifeline_read
        .try_clone()
        .map_err(|e| SandboxError(format!("lifeline descriptor: {e}")))?;
    let running = gvisor
        .run(
            &id,
            &slot.writable,
            backend.config.tmp_bytes,
            cgroups,
            lifeline,
        )
        .await
        .map_err(SandboxError)?;
    *lock(&slot.running) = Some(running);
    Ok(())
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Sandbox {
    /// `gvisor`: starts the sandbox's first container.
    async fn run_container(&mut self) -> Result<(), SandboxError> {
        if let Some(group) = &self.limits {
            self.cgroups = Arc::from(group.open_procs().map_err(SandboxError)?);
        }
        run_container(&self.backend, &self.container, self.cgroups.clone()).await
    }

    /// Whether the sandbox has ended on its own (its PID 1, or for `gvisor` its kernel,
    /// is gone): its programs, `/tmp` and background state are lost.
    pub fn lost(&self) -> bool {
        if self.backend.gvisor.is_some() {
            return lock(&self.container.running)
                .as_ref()
                .is_none_or(Running::ended);
        }
        self.pidfd
            .as_ref()
            .is_some_and(|p| confine::pidfd_exited(p))
    }

    /// Whether the sandbox ends on its own within `limit` (see [`Sandbox::lost`]). Blocks
    /// up to `limit` without holding the sandbox. A sandbox's end is seen by its programs
    /// before it is complete: under `gvisor`, `runsc exec` fails while the sandbox kernel's
    /// threads are still exiting.
    pub fn ends_within(&self) -> impl FnOnce(Duration) -> bool + Send + 'static {
        // A pidfd to wait on, or the answer already known.
        let watch: Result<OwnedFd, bool> = if self.backend.gvisor.is_some() {
            match &*lock(&self.container.running) {
                Some(running) => running.watch().map_err(|_| false),
                None => Err(true),
            }
        } else {
            match &self.pidfd {
                Some(pidfd) => pidfd.try_clone().map_err(|_| false),
                None => Err(false),
            }
        };
        move |limit| match watch {
            Ok(pidfd) => confine::pidfd_ends_within(&pidfd, limit),
            Err(known) => known,
        }
    }

    /// `gvisor`: what replaces the container after an OOM kill (which ends its kernel),
    /// for the caller to run without holding its own locks. `None` for
    /// `namespaces`, whose OOM kills end only the process.
    pub fn revival(&self) -> Option<Revival> {
        self.backend.gvisor.as_ref()?;
        Some(Revival {
            backend: self.backend.clone(),
            slot: self.container.clone(),
            cgroups: self.cgroups.clone(),
            id: lock(&self.container.running).as_ref().map(|r| r.id.clone()),
        })
    }

    /// Opens the limit cgroups' `cgroup.procs` (kept for every program of the sandbox) and
    /// starts the holder; the returned future waits for its `ready`.
    fn start_holder(
        &mut self,
        writable: &[PathBuf],
        warm: bool,
    ) -> Result<impl std::future::Future<Output = Result<(), SandboxError>> + use<>, SandboxError>
    {
        let err =
            |what: &'static str| move |e: std::io::Error| SandboxError(format!("{what}: {e}"));
        if let Some(group) = &self.limits {
            self.cgroups = Arc::from(group.open_procs().map_err(SandboxError)?);
        }
        let (ready_read, ready_write) = std::io::pipe().map_err(err("ready pipe"))?;
        let lifeline = self
            .backend
            .lifeline_read
            .try_clone()
            .map_err(err("lifeline descriptor"))?;
        let args = HolderArgs {
            stage: self.backend.stage.clone(),
            writable: writable.to_vec(),
            tmp_bytes: self.backend.config.tmp_bytes,
            bind_later: warm,
            launcher: self.backend.config.launcher,
        };
        let mut extra_fds = vec![OwnedFd::from(ready_write), lifeline];
        if args.launcher {
            let (ours, theirs) =
                isolation::launcher::socket_pair().map_err(err("launcher socket"))?;
            self.launcher =
                Some(isolation::launcher::Launcher::start(ours).map_err(err("launcher socket"))?);
            extra_fds.push(theirs);
        }
        if warm {
            let (ours, theirs) = isolation::warm::control_pair().map_err(err("control socket"))?;
            self.control = Some(ours);
            extra_fds.push(theirs);
        }
        let holder = isolation::spawn(SpawnSpec {
            program: self.backend.exe.clone().into_os_string(),
            args: args.to_args(),
            env: Vec::new(),
            cwd: PathBuf::from("/"),
            stdin: Stdio::null(),
            stdout: Stdio::null(),
            stderr: Stdio::null(),
            cgroup_procs: None,
            extra_fds,
            place: Place::NewNamespaces {
                cgroups: self.cgroups.clone(),
            },
        })
        .map_err(|e| SandboxError(format!("the holder did not start: {}", e.source)))?;
        self.holder = Some(holder);
        Ok(async move {
            let line = match tokio::time::timeout(READY_LIMIT, read_line(ready_read)).await {
                Ok(Ok(line)) => line,
                Ok(Err(e)) => return Err(SandboxError(format!("the holder's ready pipe: {e}"))),
                Err(_) => {
                    return Err(SandboxError(format!(
                        "the holder was not ready within {READY_LIMIT:?}"
                    )));
                }
            };
            if line == "ready" {
                return Ok(());
            }
            let reason = line.strip_prefix("error: ").unwrap_or(&line);
            Err(SandboxError(if reason.is_empty() {
                "the holder ended before it was ready".to_owned()
            } else {
                format!("the holder failed: {reason}")
            }))
        })
    }

    /// Finds the holder's init and opens its pidfd.
    fn attach(&mut self) -> Result<(), SandboxError> {
        let holder = self
            .holder
            .as_ref()
            .and_then(|h| h.id())
            .ok_or_else(|| SandboxError("the holder has ended".into()))?;
        let children = std::fs::read_to_string(format!("/proc/{holder}/task/{holder}/children"))
            .map_err(|e| SandboxError(format!("cannot find the holder's init: {e}")))?;
        let init: u32 = children
            .split_whitespace()
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| SandboxError("the holder has no init".into()))?;
        let pidfd = Arc::new(
            confine::pidfd_open(init)
                .map_err(|e| SandboxError(format!("pidfd of the sandbox's init: {e}")))?,
        );
        if let Some(launcher) = &self.launcher {
            launcher.set_init(pidfd.clone());
        }
        self.pidfd = Some(pidfd);
        self.init = Some(init);
        Ok(())
    }

    /// Builds the Landlock ruleset on the sandbox's own mounts.
    fn build_ruleset(&mut self, writable: &[PathBuf]) -> Result<(), SandboxError> {
        let init = self
            .init
            .ok_or_else(|| SandboxError("the sandbox has no init".into()))?;
        if self.backend.landlock {
            let inside = |path: &Path| {
                PathBuf::from(format!("/proc/{init}/root"))
                    .join(path.strip_prefix("/").unwrap_or(path))
            };
            let mut grants = Vec::new();
            for dir in SYSTEM_DIRS {
                let path = inside(Path::new(dir));
                if std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
                    grants.push((path, Grant::ReadExecute));
                }
            }
            grants.push((inside(Path::new("/dev")), Grant::ReadWriteFiles));
            grants.push((inside(Path::new("/proc")), Grant::ReadWriteFiles));
            grants.push((inside(Path::new("/tmp")), Grant::Full));
            grants.push((inside(Path::new("/dev/shm")), Grant::Full));
            for path in writable {
                grants.push((inside(path), Grant::Full));
            }
            self.ruleset = confine::ruleset(&grants)
                .map_err(SandboxError)?
                .map(Arc::new);
            // The init's pid named our sandbox while the ruleset was built only if it is
            // still alive (the pidfd says so; a pid is reused only once reaped).
            if self.lost() {
                self.ruleset = None;
                return Err(SandboxError("the sandbox ended while it was built".into()));
            }
        }
        Ok(())
    }

    /// A warm sandbox, taken by a Run: binds the Run's writable paths (handed to the
    /// sandbox user already) at their host paths, builds the Landlock ruleset on them and,
    /// on cgroup v2, writes the limits into the Run's execution cgroup. Once only: the
    /// control socket is given up here, and the holder closes its end after one request.
    async fn bind(
        &mut self,
        writable: &[PathBuf],
        exec: Option<&ExecCgroup>,
    ) -> Result<(), SandboxError> {
        let control = self
            .control
            .take()
            .ok_or_else(|| SandboxError("the sandbox was bound already".into()))?;
        if self.lost() {
            return Err(SandboxError("the warm sandbox has ended".into()));
        }
        if writable.len() > isolation::warm::MAX_BINDS {
            return Err(SandboxError(format!(
                "{} writable paths (at most {})",
                writable.len(),
                isolation::warm::MAX_BINDS
            )));
        }
        let trees = writable
            .iter()
            .map(|path| {
                isolation::warm::clone_tree(path).map_err(|e| {
                    SandboxError(format!("clone the mount of {}: {e}", path.display()))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let targets = writable.to_vec();
        tokio::task::spawn_blocking(move || {
            isolation::warm::request(&control, &targets, &trees, READY_LIMIT)
        })
        .await
        .map_err(|e| SandboxError(format!("the binding task failed: {e}")))?
        .map_err(SandboxError)?;
        self.build_ruleset(writable)?;
        if let Some(parents @ LimitParents::V2) = &self.backend.limits {
            self.limits = Some(
                parents
                    .create(&self.container.name, self.backend.config.limits, exec)
                    .map_err(SandboxError)?,
            );
        }
        Ok(())
    }

    /// The host pid of the sandbox's PID 1 (the holder's init), while it lives.
    pub fn init_pid(&self) -> Option<u32> {
        self.init
    }

    /// Where a program of this sandbox runs, with `cwd` its working directory inside.
    pub fn enter(&self, cwd: &Path) -> Result<Place, SandboxError> {
        if let Some(gvisor) = &self.backend.gvisor {
            let id = lock(&self.container.running)
                .as_ref()
                .map(|c| c.id.clone())
                .ok_or_else(|| SandboxError("the sandbox is gone".into()))?;
            let (uid, gid) = self.backend.uid();
            return Ok(Place::Gvisor {
                helper: gvisor.helper().to_owned(),
                container: isolation::gvisor::Container {
                    runsc: gvisor.binary().to_owned(),
                    flags: gvisor.flags(),
                    id,
                    uid,
                    gid,
                    cwd: cwd.to_owned(),
                    nproc: self.backend.config.limits.pids,
                    report: false,
                },
            });
        }
        let pidfd = self
            .pidfd
            .as_ref()
            .ok_or_else(|| SandboxError("the sandbox is gone".into()))?;
        let cwd = CString::new(cwd.as_os_str().as_bytes())
            .map_err(|_| SandboxError("the working directory contains NUL".into()))?;
        let (uid, gid) = self.backend.uid();
        Ok(Place::Sandbox(Enter {
            pidfd: pidfd.clone(),
            cgroups: self.cgroups.clone(),
            confine: Confine {
                cwd,
                uid,
                gid,
                cap_last: self.backend.cap_last,
                ruleset: self.ruleset.clone(),
                filters: self.backend.filters.clone(),
                parent: 0,
            },
            launcher: self.launcher.clone(),
        }))
    }

    /// The user and group the sandbox's programs run as.
    pub fn owner(&self) -> (u32, u32) {
        self.backend.uid()
    }

    /// How many processes the OOM killer has killed in this sandbox.
    pub fn oom_kills(&self) -> u64 {
        self.limits.as_ref().map_or(0, LimitGroup::oom_kills)
    }

    /// Why `what` (a command, a program, a handler) ended when the OOM killer ended one of
    /// its processes.
    pub fn oom_message(&self, what: &str) -> String {
        match self.backend.config.limits.memory_bytes {
            Some(bytes) => format!(
                "the out-of-memory killer ended a process of the {what} (the sandbox's memory limit is {bytes} bytes)"
            ),
            None => format!("the out-of-memory killer ended a process of the {what}"),
        }
    }

    /// Kills everything in the sandbox (the holder's init is PID 1 of its PID namespace:
    /// when it dies, every process in the namespace dies) and removes its limit cgroups.
    pub async fn destroy(&mut self) {
        let container = lock(&self.container.running).take();
        if let (Some(gvisor), Some(container)) = (&self.backend.gvisor, container) {
            gvisor.remove(container).await;
        }
        // Through the pidfd first: a raw pid could name another process once the init has
        // been reaped.
        if let Some(pidfd) = &self.pidfd {
            confine::pidfd_kill(pidfd);
        }
        if let Some(mut holder) = self.holder.take() {
            if let Some(pid) = holder.id() {
                isolation::signal_group(pid, Signal::SIGKILL);
            }
            let _ = holder.start_kill();
            let _ = holder.wait().await;
        }
        self.pidfd = None;
        self.ruleset = None;
        self.control = None;
        self.launcher = None;
        if let Some(limits) = self.limits.take() {
            limits.remove(Duration::from_secs(5)).await;
        }
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if let Some(container) = lock(&self.container.running).as_ref() {
            // Destroy was not awaited: end the sandbox kernel; the next server with this
            // root removes what runsc keeps of it.
            container.kill();
        }
        if let Some(holder) = &mut self.holder {
            // Destroy was not awaited: kill without waiting (the runtime reaps it).
            if let Some(pid) = holder.id() {
                isolation::signal_group(pid, Signal::SIGKILL);
            }
            let _ = holder.start_kill();
        }
    }
}
