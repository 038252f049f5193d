//! The ownership/readiness cache of one runtimed, and of the gateway (design document 000,
//! "Runtime Gateway").
//!
//! Two watches, kept for the invoke path so that it never reads the API synchronously:
//!
//! - the function and session Runs of this worker's Runtime and namespace
//!   (`spec.runtime=R`), indexed by Run UID: mode, name, phase, Ready condition, attempt,
//!   assigned Pod and its UID, deletion;
//! - the worker Pods of that Runtime (label `kruntimes.io/runtime=R`), by name: UID,
//!   address (`status.podIP` and the container port named `runtimed`), readiness.
//!
//! Entries are replaced whole on every event, and a relist (`Init` … `InitDone`) swaps in a
//! complete new table, so a reader never sees half an update. The cache may lag behind the
//! API: the owner checks a forwarded call's expectations against its own view.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kruntimes_api::lifecycle;
use kruntimes_api::run::ModeKind;
use kruntimes_api::{Phase, Run};
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tracing::warn;

/// The label that names a worker Pod's Runtime.
pub const RUNTIME_LABEL: &str = "kruntimes.io/runtime";
/// The name of the worker Pod's container port that runtimed listens on.
pub const RUNTIMED_PORT_NAME: &str = "runtimed";

/// What the cache knows of one function or session Run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunEntry {
    /// Function or session (task Runs are not cached).
    pub mode: ModeKind,
    pub name: String,
    pub uid: String,
    pub phase: Phase,
    /// The `Ready` condition is `True`.
    pub ready: bool,
    pub attempt: u32,
    pub assigned_pod: Option<String>,
    pub assigned_pod_uid: Option<String>,
    pub deleting: bool,
    /// `spec.suspend: true`: the session is asked to suspend (its worker captures it while
    /// Ready; new operations are refused meanwhile), unless its worker said it cannot now
    /// (`Suspended=False/SnapshotRetrying` or `NoSnapshotStore`): the session then keeps
    /// serving until the next try.
    pub suspend: bool,
    /// The suspend is its owner's, for idleness or an expired lease, and still valid
    /// ([`lifecycle::auto_suspended`]): an authorized call wakes the session.
    pub auto_suspended: bool,
    /// The last operation sequence number its latest Snapshot holds
    /// (`status.snapshot.lastSequence`): a Suspended session's last; 0 without one.
    pub snapshot_sequence: u64,
}

impl RunEntry {
    fn of(run: &Run) -> Option<RunEntry> {
        let mode = match run.spec.mode.kind()? {
            ModeKind::Task => return None,
            mode @ (ModeKind::Function | ModeKind::Session) => mode,
        };
        let status = run.status.as_ref();
        Some(RunEntry {
            mode,
            name: run.name_any(),
            uid: run.uid()?,
            phase: run.phase(),
            ready: lifecycle::is_ready(status),
            attempt: u32::try_from(lifecycle::attempt(status)).unwrap_or(1),
            assigned_pod: status.and_then(|s| s.assigned_pod.clone()),
            assigned_pod_uid: status.and_then(|s| s.assigned_pod_uid.clone()),
            deleting: run.metadata.deletion_timestamp.is_some(),
            suspend: run.spec.suspend_requested()
                && !lifecycle::suspend_deferred(status, run.metadata.generation),
            auto_suspended: lifecycle::auto_suspended(run),
            snapshot_sequence: status
                .and_then(|s| s.snapshot.as_ref())
                .and_then(|s| s.last_sequence)
                .and_then(|n| u64::try_from(n).ok())
                .unwrap_or(0),
        })
    }

    /// Registered and not being deleted: calls may be routed to its owner. A function
    /// serves while Ready (with the Ready condition); a session while Ready or Finalizing
    /// (a draining session still answers status, reads and listings; its owner refuses new
    /// operations).
    pub fn serving(&self) -> bool {
        let phase_serves = match self.phase {
            Phase::Ready => self.ready || self.mode == ModeKind::Session,
            Phase::Finalizing => self.mode == ModeKind::Session,
            // Its files are in a Snapshot; no worker holds it.
            Phase::Pending
            | Phase::Scheduled
            | Phase::Running
            | Phase::Suspended
            | Phase::Succeeded
            | Phase::Failed
            | Phase::Timeout
            | Phase::Cancelled => false,
        };
        phase_serves && !self.deleting && self.assigned_pod_uid.is_some()
    }
}

/// What the cache knows of one worker Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodEntry {
    pub uid: String,
    pub addr: Option<SocketAddr>,
    pub ready: bool,
    pub deleting: bool,
}

impl PodEntry {
    fn of(pod: &Pod) -> Option<PodEntry> {
        let ip: Option<IpAddr> = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.as_deref())
            .and_then(|ip| ip.parse().ok());
        let port = pod
            .spec
            .as_ref()
            .into_iter()
            .flat_map(|spec| spec.containers.iter())
            .flat_map(|container| container.ports.iter().flatten())
            .find(|port| port.name.as_deref() == Some(RUNTIMED_PORT_NAME))
            .and_then(|port| u16::try_from(port.container_port).ok())
            .filter(|port| *port != 0);
        let ready = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        Some(PodEntry {
            uid: pod.uid()?,
            addr: ip.zip(port).map(|(ip, port)| SocketAddr::new(ip, port)),
            ready,
            deleting: pod.metadata.deletion_timestamp.is_some(),
        })
    }
}

/// The two tables and whether each has been listed once.
#[derive(Debug)]
pub struct Ownership {
    runs: RwLock<HashMap<String, RunEntry>>,
    pods: RwLock<HashMap<String, PodEntry>>,
    synced: watch::Sender<(bool, bool)>,
    /// Bumped after every change of the Run table.
    runs_changed: watch::Sender<u64>,
}

impl Default for Ownership {
    fn default() -> Ownership {
        Ownership {
            runs: RwLock::new(HashMap::new()),
            pods: RwLock::new(HashMap::new()),
            synced: watch::Sender::new((false, false)),
            runs_changed: watch::Sender::new(0),
        }
    }
}

fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    // A panic while holding the lock leaves a plain map behind; keep serving.
    lock.read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Ownership {
    /// The function Run with this UID, if the cache knows it.
    pub fn run(&self, uid: &str) -> Option<RunEntry> {
        read(&self.runs).get(uid).cloned()
    }

    /// The worker Pod of this name, if the cache knows it.
    pub fn pod(&self, name: &str) -> Option<PodEntry> {
        read(&self.pods).get(name).cloned()
    }

    /// Whether both tables have been listed at least once.
    pub fn synced(&self) -> bool {
        let (runs, pods) = *self.synced.borrow();
        runs && pods
    }

    /// Waits until both tables have been listed, at most `limit`; whether they have.
    pub async fn wait_synced(&self, limit: std::time::Duration) -> bool {
        let mut synced = self.synced.subscribe();
        let listed = synced.wait_for(|(runs, pods)| *runs && *pods);
        matches!(tokio::time::timeout(limit, listed).await, Ok(Ok(_)))
    }

    /// The addresses of the Runtime's ready workers (not deleting), in name order.
    pub fn ready_workers(&self) -> Vec<SocketAddr> {
        self.ready_workers_named()
            .into_iter()
            .map(|(_, addr)| addr)
            .collect()
    }

    /// The names of every worker Pod of the Runtime the cache knows, in any state.
    pub fn worker_names(&self) -> Vec<String> {
        read(&self.pods).keys().cloned().collect()
    }

    /// The Pod names and addresses of the Runtime's ready workers (not deleting), in name
    /// order: the name, with the namespace, is what a TLS client verifies the worker as
    /// (`worker::worker_identity`).
    pub fn ready_workers_named(&self) -> Vec<(String, SocketAddr)> {
        let pods = read(&self.pods);
        let mut ready: Vec<(String, SocketAddr)> = pods
            .iter()
            .filter(|(_, p)| p.ready && !p.deleting)
            .filter_map(|(name, p)| Some((name.clone(), p.addr?)))
            .collect();
        ready.sort();
        ready
    }

    /// Keeps both tables up to date until the future is dropped.
    pub async fn run_watches(self: Arc<Self>, client: Client, namespace: String, runtime: String) {
        let runs = Api::<Run>::namespaced(client.clone(), &namespace);
        let pods = Api::<Pod>::namespaced(client, &namespace);
        let run_config = watcher::Config::default().fields(&format!("spec.runtime={runtime}"));
        let pod_config = watcher::Config::default().labels(&format!("{RUNTIME_LABEL}={runtime}"));
        let runs_task = {
            let this = self.clone();
            async move {
                let mut events = watcher(runs, run_config).default_backoff().boxed();
                let mut fresh: Option<HashMap<String, RunEntry>> = None;
                while let Some(event) = events.next().await {
                    match event {
                        Ok(event) => this.apply_run(event, &mut fresh),
                        Err(error) => warn!(error = %error, "watching function Runs"),
                    }
                }
            }
        };
        let pods_task = {
            let this = self.clone();
            async move {
                let mut events = watcher(pods, pod_config).default_backoff().boxed();
                let mut fresh: Option<HashMap<String, PodEntry>> = None;
                while let Some(event) = events.next().await {
                    match event {
                        Ok(event) => this.apply_pod(event, &mut fresh),
                        Err(error) => warn!(error = %error, "watching worker Pods"),
                    }
                }
            }
        };
        futures::join!(runs_task, pods_task);
    }

    /// The Run with this UID once the cache shows it serving, or as it stands after
    /// `limit`: the cache may lag a moment behind the Ready a client has already seen.
    pub async fn wait_serving(&self, uid: &str, limit: std::time::Duration) -> Option<RunEntry> {
        let mut changed = self.runs_changed.subscribe();
        let wait = async {
            loop {
                let entry = self.run(uid);
                if entry.as_ref().is_some_and(RunEntry::serving) {
                    return;
                }
                if changed.changed().await.is_err() {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(limit, wait).await;
        self.run(uid)
    }

    fn apply_run(&self, event: watcher::Event<Run>, fresh: &mut Option<HashMap<String, RunEntry>>) {
        self.apply_run_event(event, fresh);
        self.runs_changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn apply_run_event(
        &self,
        event: watcher::Event<Run>,
        fresh: &mut Option<HashMap<String, RunEntry>>,
    ) {
        match event {
            watcher::Event::Apply(run) => {
                if let Some(entry) = RunEntry::of(&run) {
                    write(&self.runs).insert(entry.uid.clone(), entry);
                }
            }
            watcher::Event::Delete(run) => {
                if let Some(uid) = run.uid() {
                    write(&self.runs).remove(&uid);
                }
            }
            watcher::Event::Init => *fresh = Some(HashMap::new()),
            watcher::Event::InitApply(run) => {
                if let (Some(table), Some(entry)) = (fresh.as_mut(), RunEntry::of(&run)) {
                    table.insert(entry.uid.clone(), entry);
                }
            }
            watcher::Event::InitDone => {
                if let Some(table) = fresh.take() {
                    *write(&self.runs) = table;
                }
                self.synced.send_modify(|(runs, _)| *runs = true);
            }
        }
    }

    fn apply_pod(&self, event: watcher::Event<Pod>, fresh: &mut Option<HashMap<String, PodEntry>>) {
        match event {
            watcher::Event::Apply(pod) => {
                if let Some(entry) = PodEntry::of(&pod) {
                    write(&self.pods).insert(pod.name_any(), entry);
                }
            }
            watcher::Event::Delete(pod) => {
                write(&self.pods).remove(&pod.name_any());
            }
            watcher::Event::Init => *fresh = Some(HashMap::new()),
            watcher::Event::InitApply(pod) => {
                if let (Some(table), Some(entry)) = (fresh.as_mut(), PodEntry::of(&pod)) {
                    table.insert(pod.name_any(), entry);
                }
            }
            watcher::Event::InitDone => {
                if let Some(table) = fresh.take() {
                    *write(&self.pods) = table;
                }
                self.synced.send_modify(|(_, pods)| *pods = true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruntimes_api::run::{FunctionMode, RunMode};
    use kruntimes_api::{RunSpec, RunStatus};

    fn function_run(phase: Phase, ready: bool) -> Run {
        let mut spec = RunSpec::task("python", "main.py");
        spec.mode = RunMode {
            function: Some(FunctionMode {
                handler: "main:handle".into(),
                idle_timeout_seconds: None,
                concurrency: None,
            }),
            ..RunMode::default()
        };
        let mut run = Run::new("f", spec);
        run.metadata.uid = Some("u1".into());
        let mut status = RunStatus {
            phase: Some(phase),
            attempt: Some(2),
            assigned_pod: Some("w".into()),
            assigned_pod_uid: Some("w-uid".into()),
            ..RunStatus::default()
        };
        lifecycle::set_ready(&mut status, ready, "FunctionRegistered", "", None);
        run.status = Some(status);
        run
    }

    #[test]
    fn only_ready_registered_function_runs_serve() {
        for phase in Phase::ALL {
            let entry = RunEntry::of(&function_run(phase, true)).expect("a function Run");
            assert_eq!(entry.serving(), phase == Phase::Ready, "{phase}");
            assert_eq!(entry.attempt, 2);
        }
        let not_ready = RunEntry::of(&function_run(Phase::Ready, false)).expect("entry");
        assert!(!not_ready.serving());
        let task = Run::new("t", RunSpec::task("python", "main.py"));
        assert!(RunEntry::of(&task).is_none());
    }

    #[test]
    fn a_relist_replaces_the_whole_table() {
        let cache = Ownership::default();
        let mut fresh = None;
        cache.apply_run(
            watcher::Event::Apply(function_run(Phase::Ready, true)),
            &mut fresh,
        );
        assert!(cache.run("u1").is_some());
        assert!(!cache.synced());
        cache.apply_run(watcher::Event::Init, &mut fresh);
        assert!(
            cache.run("u1").is_some(),
            "kept until the relist is complete"
        );
        cache.apply_run(watcher::Event::InitDone, &mut fresh);
        assert!(cache.run("u1").is_none(), "gone from the relist");
        cache.apply_pod(watcher::Event::Init, &mut None);
        let mut pods = Some(HashMap::new());
        cache.apply_pod(watcher::Event::InitDone, &mut pods);
        assert!(cache.synced());
    }
}
