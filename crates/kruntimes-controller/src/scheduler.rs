//! The scheduler: places Pending Runs on the ready workers of their Runtime.
//!
//! It is a kube-runtime [`Controller`] over Runtimes. A change to any Run or to any worker
//! Pod of a Runtime requeues that Runtime; the controller never runs two reconciles of one
//! Runtime at once and folds the triggers that arrive meanwhile into one more pass. So under
//! load one pass places a whole batch.
//!
//! Each pass is level-based: it takes the Runtime's non-terminal Runs and its Pods from the
//! scheduler's watch caches, computes a [`placement::plan`], and writes each placement to
//! the Run's status subresource with the `resourceVersion` it read. The caches are the
//! reflectors that also trigger the passes, so a pass triggered by a change already sees
//! it. A placement this scheduler wrote but the Run watch has not delivered yet is
//! *assumed* (as kube-scheduler does): until the cache shows a newer version of the Run
//! than the one the placement was written over, the pass counts the written version, so
//! capacity is never counted twice. A 409 means the Run changed meanwhile (cancelled,
//! deleted, or scheduled by a previous leader); the pass leaves it and the next pass sees
//! the change. Capacity is never overcommitted because only the leader schedules and a pass
//! counts every Run that holds capacity before placing any.
//!
//! Reading caches instead of listing keeps a pass independent of how many finished Runs
//! the namespace holds.
//!
//! Each pass also publishes `Runtime.status.usedRuns`: the slots held by the Runs that
//! hold capacity, counted from the same view (assumed placements included), so it follows
//! every Run change within a pass. It is written only when it differs from what the
//! Runtime shows, at most once per [`USAGE_WRITE_INTERVAL`] per Runtime (a later pass
//! writes what changed meanwhile). The Runtime controller writes the other counts.
//!
//! A Run that cannot be placed says why ([`crate::unschedulable`]): `Scheduled=False` with
//! the reason `RuntimeNotFound`, `ExceedsWorkerCapacity`, `WaitingForWorkers` or
//! `NoCapacity`, and an Event each time the reason changes.
//!
//! A Scheduled Run that its worker has not claimed within the claim bound is taken back
//! and placed elsewhere ([`crate::rebalance`]); that worker gets nothing new for one bound.
//!
//! A resumed session (one with `status.snapshot`) prefers the worker that keeps its
//! Snapshot's local copy (`status.localCopy` of the Snapshot, read from a Snapshot watch
//! cache; [`placement::plan_preferring`]). The cache is never waited for: a Snapshot it
//! does not show yet, or a cluster without the Snapshot kind, means no preference.
//!
//! It never starts, claims or ends Runs: runtimed moves them on from Scheduled.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kruntimes_api::run::RunCondition;
use kruntimes_api::{Phase, Run, Runtime, Snapshot, capacity};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tracing::{debug, warn};

use crate::error::{Error, is_conflict, is_not_found};
use crate::events::{
    EXCEEDS_WORKER_CAPACITY, Events, NO_CAPACITY, NOT_CLAIMED, RUNTIME_NOT_FOUND,
    WAITING_FOR_WORKERS,
};
use crate::placement::{self, Placement};
use crate::rebalance::{self, Suspects, UnassignHook, Unassigned};
use crate::status::{now_rfc3339, set_condition};
use crate::unschedulable::{self, Teller, WAIT_BEFORE_TELLING, Why};

/// The label that ties a worker Pod to its Runtime.
pub const RUNTIME_LABEL: &str = "kruntimes.io/runtime";
/// The condition type the scheduler sets.
pub const SCHEDULED_CONDITION: &str = "Scheduled";
/// Status writes in flight at once within one pass.
const WRITE_CONCURRENCY: usize = 16;
/// How soon a pass that met a conflict runs again (the change that caused it also
/// triggers a pass through the watch; this bounds the wait if that event is late).
const CONFLICT_REQUEUE: Duration = Duration::from_millis(200);
/// The longest a Runtime goes without a pass. Passes read caches and cost little; this
/// bounds how long a Run waits if a trigger is ever missed.
const RESYNC: Duration = Duration::from_secs(2);
/// How long a pass waits for the caches' first full list before it looks again.
const CACHE_WAIT: Duration = Duration::from_millis(200);
/// The longest one placement write may take before the pass gives up on it.
const BIND_TIMEOUT: Duration = Duration::from_secs(10);
/// How soon a pass that failed runs again.
const ERROR_REQUEUE: Duration = Duration::from_secs(1);

/// How long a written placement is assumed at most; the Run watch delivers it long before.
const ASSUME_FOR: Duration = Duration::from_secs(60);
/// The `action` of the scheduler's Events.
const SCHEDULE_ACTION: &str = "Schedule";
/// The shortest time between two `usedRuns` writes of one Runtime.
pub const USAGE_WRITE_INTERVAL: Duration = Duration::from_millis(250);
/// How long a written `usedRuns` is taken as current while the Runtime watch has not shown
/// it yet.
const USAGE_ECHO_WAIT: Duration = Duration::from_secs(2);

/// The last `usedRuns` write this scheduler made to one Runtime.
struct Usage {
    /// The value written; `None` when the write failed.
    used: Option<i32>,
    at: Instant,
}

/// A placement written by this scheduler.
struct Assumed {
    /// The Run's resourceVersion the placement was written over.
    over: String,
    /// The Run as written.
    written: Run,
    at: Instant,
}

/// What each scheduler pass needs.
pub(crate) struct Context {
    pub client: Client,
    /// The identity of this controller-manager, written into the Scheduled condition.
    pub identity: String,
    runs: Store<Run>,
    pods: Store<Pod>,
    /// Snapshots as last watched: where resumed sessions' local copies are.
    snapshots: Store<Snapshot>,
    /// Placements written and not yet seen in `runs`, by Run UID.
    assumed: Mutex<HashMap<String, Assumed>>,
    /// The last `usedRuns` written, by (namespace, Runtime).
    usage: Mutex<HashMap<(String, String), Usage>>,
    events: Events,
    /// Writes why Runs are not placed.
    teller: Teller,
    /// (namespace, Runtime) pairs that Runs name but that do not exist, to tell their Runs.
    missing: Mutex<HashSet<(String, String)>>,
    missing_added: tokio::sync::Notify,
    /// How long a worker has to claim a Run placed on it.
    claim_timeout: Duration,
    /// Workers that did not claim in time.
    suspects: Suspects,
    unassign_hook: Option<UnassignHook>,
    /// What the autoscaler of scaling Runtimes remembers ([`crate::autoscale`]).
    autoscale: crate::autoscale::State,
}

/// The scheduler's settings.
pub(crate) struct Settings {
    pub identity: String,
    pub claim_timeout: Duration,
    pub unassign_hook: Option<UnassignHook>,
}

/// Tells each Pending Run of a Runtime that does not exist so, as Runtimes are reported
/// missing; runs until dropped. A fresh read of the Runtime confirms it is missing first:
/// the Runtime cache may be behind one created a moment ago.
async fn tell_missing(context: Arc<Context>) {
    loop {
        context.missing_added.notified().await;
        let batch: Vec<(String, String)> = match context.missing.lock() {
            Ok(mut missing) => missing.drain().collect(),
            Err(_) => return,
        };
        for (namespace, runtime) in batch {
            let cached = context.runs.state();
            let waiting: Vec<&Run> = cached
                .iter()
                .map(|run| &**run)
                .filter(|run| {
                    run.spec.runtime == runtime
                        && run.metadata.namespace.as_deref() == Some(namespace.as_str())
                        && placement::is_queued(run)
                        && !unschedulable::shows(run, RUNTIME_NOT_FOUND)
                })
                .collect();
            if waiting.is_empty() {
                continue;
            }
            let api = Api::<Runtime>::namespaced(context.client.clone(), &namespace);
            match tokio::time::timeout(BIND_TIMEOUT, api.get_opt(&runtime)).await {
                Ok(Ok(None)) => {}
                // It exists: its own pass places these Runs.
                Ok(Ok(Some(_))) => continue,
                Ok(Err(_)) | Err(_) => {
                    debug!(runtime = %runtime, "cannot confirm that the Runtime is missing; looking again");
                    again_later(&context, namespace, runtime, ERROR_REQUEUE);
                    continue;
                }
            }
            let message = format!(
                "Runtime {runtime} does not exist in namespace {namespace}; the Run waits until it does"
            );
            let tells = waiting
                .into_iter()
                .map(|run| {
                    let why = Why {
                        reason: RUNTIME_NOT_FOUND,
                        message: message.clone(),
                    };
                    (run, why)
                })
                .collect();
            let runs_api = Api::<Run>::namespaced(context.client.clone(), &namespace);
            let key = (namespace.clone(), runtime.clone());
            if let Some(wait) = context
                .teller
                .tell(&runs_api, &context.events, key, tells)
                .await
            {
                again_later(&context, namespace, runtime, wait);
            }
        }
    }
}

/// Reports `runtime` missing again after `wait`.
fn again_later(context: &Arc<Context>, namespace: String, runtime: String, wait: Duration) {
    let context = Arc::downgrade(context);
    tokio::spawn(async move {
        tokio::time::sleep(wait).await;
        if let Some(context) = context.upgrade() {
            context.note_missing(namespace, runtime);
        }
    });
}

/// Runs the scheduler until its watches end. Cancel it by dropping the future.
pub(crate) async fn run(client: Client, settings: Settings, events: Events) -> Result<(), Error> {
    let Settings {
        identity,
        claim_timeout,
        unassign_hook,
    } = settings;
    let runtimes = Api::<Runtime>::all(client.clone());
    let (runs, runs_writer) = reflector::store();
    let run_events = reflector::reflector(
        runs_writer,
        watcher(Api::<Run>::all(client.clone()), watcher::Config::default()),
    )
    .default_backoff()
    .touched_objects();
    let (pods, pods_writer) = reflector::store();
    let pod_events = reflector::reflector(
        pods_writer,
        watcher(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default().labels(RUNTIME_LABEL),
        ),
    )
    .default_backoff()
    .touched_objects();
    let (snapshots, snapshots_writer) = reflector::store();
    let snapshot_events = reflector::reflector(
        snapshots_writer,
        watcher(
            Api::<Snapshot>::all(client.clone()),
            watcher::Config::default(),
        ),
    )
    .default_backoff()
    .for_each(|_| std::future::ready(()));
    let context = Arc::new(Context {
        client,
        identity,
        runs,
        pods,
        snapshots,
        assumed: Mutex::new(HashMap::new()),
        usage: Mutex::new(HashMap::new()),
        events,
        teller: Teller::default(),
        missing: Mutex::new(HashSet::new()),
        missing_added: tokio::sync::Notify::new(),
        claim_timeout,
        suspects: Suspects::default(),
        unassign_hook,
        autoscale: crate::autoscale::State::default(),
    });
    let missing = context.clone();
    let passes = Controller::new(runtimes, watcher::Config::default())
        // The reflectors update their stores before they pass an event on, so the pass
        // an event triggers sees it.
        .watches_stream(run_events, |run: Run| {
            let namespace = run.namespace()?;
            Some(ObjectRef::<Runtime>::new(&run.spec.runtime).within(&namespace))
        })
        .watches_stream(pod_events, |pod: Pod| {
            let namespace = pod.namespace()?;
            let runtime = pod.labels().get(RUNTIME_LABEL)?;
            Some(ObjectRef::<Runtime>::new(runtime).within(&namespace))
        })
        .run(reconcile, error_policy, context.clone())
        .for_each(|result| {
            let context = missing.clone();
            async move {
                match result {
                    Ok((object, _)) => debug!(runtime = %object, "scheduler pass done"),
                    // A Run or Pod names a Runtime that does not exist (yet): nothing to
                    // place; its Pending Runs say so.
                    Err(kube::runtime::controller::Error::ObjectNotFound(object)) => {
                        debug!(runtime = %object, "no such Runtime; its Runs wait");
                        if let Some(namespace) = object.namespace {
                            context.note_missing(namespace, object.name);
                        }
                    }
                    Err(error) => warn!(error = %error, "scheduler pass failed"),
                }
            }
        });
    tokio::select! {
        () = passes => {}
        () = tell_missing(context.clone()) => {}
        () = snapshot_events => {}
    }
    Err(Error::ControllerStopped {
        controller: "scheduler",
    })
}

fn error_policy(runtime: Arc<Runtime>, error: &Error, _: Arc<Context>) -> Action {
    warn!(runtime = %runtime.name_any(), error = %error, "scheduler pass failed; retrying");
    Action::requeue(ERROR_REQUEUE)
}

/// Lists every object that matches `params`, following continue tokens.
pub(crate) async fn list_all<K>(
    api: &Api<K>,
    params: ListParams,
    what: &'static str,
    namespace: &str,
) -> Result<Vec<K>, Error>
where
    K: Clone + DeserializeOwned + std::fmt::Debug,
{
    kruntimes_api::paging::list_all(api, &params)
        .await
        .map_err(|source| Error::List {
            what,
            namespace: namespace.to_string(),
            source,
        })
}

impl Context {
    /// Reports that Runs name `runtime` in `namespace` and it does not exist.
    fn note_missing(&self, namespace: String, runtime: String) {
        if let Ok(mut missing) = self.missing.lock() {
            missing.insert((namespace, runtime));
        }
        self.missing_added.notify_one();
    }

    /// Records a placement written over version `over` of the Run `uid`.
    fn assume(&self, uid: String, over: String, written: Run) {
        if let Ok(mut assumed) = self.assumed.lock() {
            let now = Instant::now();
            assumed.retain(|_, a| now.duration_since(a.at) < ASSUME_FOR);
            assumed.insert(
                uid,
                Assumed {
                    over,
                    written,
                    at: now,
                },
            );
        }
    }

    /// The non-terminal Runs of one Runtime from the cache, with this scheduler's
    /// placements that the cache does not show yet.
    fn runs_of(&self, namespace: &str, runtime: &str) -> Vec<Run> {
        let cached = self.runs.state();
        let Ok(mut assumed) = self.assumed.lock() else {
            return Vec::new();
        };
        let mut runs = Vec::new();
        for run in cached.iter() {
            // No allocation before the cheap tests: the cache holds every finished Run too.
            if run.metadata.namespace.as_deref() != Some(namespace) || run.spec.runtime != runtime {
                continue;
            }
            let uid = run.metadata.uid.as_deref().unwrap_or_default();
            let current: &Run = match assumed.get(uid) {
                // The cache still shows the version the placement was written over.
                Some(a) if run.metadata.resource_version.as_deref() == Some(a.over.as_str()) => {
                    &a.written
                }
                // The cache shows a newer version: the placement or a later change.
                Some(_) => {
                    assumed.remove(uid);
                    run
                }
                None => run,
            };
            if !current.phase().is_terminal() {
                runs.push(current.clone());
            }
        }
        runs
    }
}

/// One scheduler pass over one Runtime.
/// The worker that keeps a local copy of the Snapshot a resumed session `run` restores from,
/// as the Snapshot cache shows it: only a Ready Snapshot of this Run.
fn local_copy(
    snapshots: &Store<Snapshot>,
    namespace: &str,
    run: &Run,
) -> Option<placement::Preferred> {
    let name = run.status.as_ref()?.snapshot.as_ref()?.name.as_str();
    let snapshot = snapshots.get(&ObjectRef::new(name).within(namespace))?;
    if snapshot.spec.run_name() != run.name_any()
        || snapshot.phase() != kruntimes_api::snapshot::SnapshotPhase::Ready
    {
        return None;
    }
    let copy = snapshot.status.as_ref()?.local_copy.as_ref()?;
    Some(placement::Preferred {
        pod_name: copy.pod.clone(),
        pod_uid: copy.pod_uid.clone(),
    })
}

async fn reconcile(runtime: Arc<Runtime>, context: Arc<Context>) -> Result<Action, Error> {
    let name = runtime.name_any();
    let namespace = runtime.namespace().ok_or_else(|| Error::MissingField {
        kind: "Runtime",
        name: name.clone(),
        field: "metadata.namespace",
    })?;
    let runs_api = Api::<Run>::namespaced(context.client.clone(), &namespace);
    // A partial cache would hide Runs that hold capacity: place nothing before the first
    // full list of both. Never block a pass on it: look again shortly. The bound matters:
    // `Store::wait_until_ready` (kube-runtime 5) keeps only the waker of the last task that
    // polled it, so of two passes (two Runtimes) waiting at startup one may never be woken,
    // and a pass that never ends holds every later pass of its Runtime.
    let ready = async {
        context.runs.wait_until_ready().await.is_ok()
            && context.pods.wait_until_ready().await.is_ok()
    };
    if !tokio::time::timeout(CACHE_WAIT, ready)
        .await
        .unwrap_or(false)
    {
        debug!(runtime = %name, "scheduler caches not synced yet");
        return Ok(Action::requeue(CACHE_WAIT));
    }
    let mut pods: Vec<Pod> = context
        .pods
        .state()
        .iter()
        .filter(|pod| {
            pod.namespace().as_deref() == Some(namespace.as_str())
                && pod.labels().get(RUNTIME_LABEL) == Some(&name)
        })
        .map(|pod| (**pod).clone())
        .collect();
    // Workers this scheduler is retiring get nothing, whatever the cache shows yet.
    context.autoscale.mark(&namespace, &name, &mut pods);
    let mut runs = context.runs_of(&namespace, &name);
    // A retried Run waits out its backoff before it is placed again; an unclaimed
    // placement is looked at again when its bound is up.
    let mut wake: Option<Duration> = None;
    if let Some(again) = take_back_unclaimed(&runs_api, &mut runs, &context).await {
        wake = Some(wake.map_or(again, |w| w.min(again)));
    }
    // Placements below add to the count; the write after them publishes the sum.
    let used: i64 = placement::used_slots(&runs, runtime.spec.runs_per_worker())
        .values()
        .sum();
    let runs: Vec<Run> = runs
        .into_iter()
        .filter(|run| {
            let pending = matches!(run.phase(), Phase::Pending);
            match kruntimes_api::lifecycle::backoff_until(&run.spec, run.status.as_ref()) {
                Some(until) if pending => {
                    let left = kruntimes_api::lifecycle::until(until);
                    wake = Some(wake.map_or(left, |w| w.min(left)));
                    false
                }
                Some(_) | None => true,
            }
        })
        .collect();
    // A worker that did not claim in time gets nothing new for a while.
    let eligible: Vec<Pod> = pods
        .iter()
        .filter(|pod| !context.suspects.is_suspect(pod.metadata.uid.as_deref()))
        .cloned()
        .collect();
    let plan =
        placement::plan_preferring(runtime.spec.runs_per_worker(), &eligible, &runs, |run| {
            local_copy(&context.snapshots, &namespace, run)
        });
    // A scaling Runtime's replicas follow the demand this plan leaves.
    if let Some(again) = crate::autoscale::pass(
        &context.client,
        &context.autoscale,
        &runtime,
        &namespace,
        &pods,
        &runs,
        &plan,
    )
    .await
    {
        wake = Some(wake.map_or(again, |w| w.min(again)));
    }
    let (tells, tell_later) = why_not_placed(&runtime, &pods, &eligible, &runs, &plan);
    if let Some(later) = tell_later {
        wake = Some(wake.map_or(later, |w| w.min(later)));
    }
    if let Some(again) = context
        .teller
        .tell(
            &runs_api,
            &context.events,
            (namespace.clone(), name.clone()),
            tells,
        )
        .await
    {
        wake = Some(wake.map_or(again, |w| w.min(again)));
    }
    if plan.placements.is_empty() {
        if let Some(again) = publish_usage(&runtime, &namespace, used, &context).await {
            wake = Some(wake.map_or(again, |w| w.min(again)));
        }
        let idle = Action::requeue(wake.map_or(RESYNC, |w| w.min(RESYNC)));
        debug!(
            runtime = %name,
            namespace = %namespace,
            pods = pods.len(),
            ready = pods.iter().filter(|p| placement::is_ready_worker(p)).count(),
            runs = runs.len(),
            waiting = plan.waiting,
            "scheduler pass placed nothing"
        );
        return Ok(idle);
    }
    let per_worker = runtime.spec.runs_per_worker();
    let results: Vec<Result<i64, (String, kube::Error)>> = futures::stream::iter(plan.placements)
        .map(|placement| {
            bind(
                &runs_api,
                &runs[placement.run],
                placement,
                per_worker,
                &context,
            )
        })
        .buffer_unordered(WRITE_CONCURRENCY)
        .collect()
        .await;
    let mut conflicts = 0usize;
    let mut bound = 0usize;
    let mut first_error = None;
    let mut used = used;
    for result in results {
        match result {
            Ok(slots) => {
                bound += 1;
                used += slots;
            }
            Err((_, error)) if is_conflict(&error) || is_not_found(&error) => conflicts += 1,
            Err(failure) => {
                first_error.get_or_insert(failure);
            }
        }
    }
    debug!(
        runtime = %name,
        namespace = %namespace,
        placed = bound,
        conflicts,
        waiting = plan.waiting,
        "scheduler pass"
    );
    if let Some(again) = publish_usage(&runtime, &namespace, used, &context).await {
        wake = Some(wake.map_or(again, |w| w.min(again)));
    }
    if let Some((run, source)) = first_error {
        return Err(Error::WriteRunStatus {
            namespace,
            name: run,
            source,
        });
    }
    Ok(if conflicts > 0 {
        Action::requeue(wake.map_or(CONFLICT_REQUEUE, |w| w.min(CONFLICT_REQUEUE)))
    } else {
        Action::requeue(wake.map_or(RESYNC, |w| w.min(RESYNC)))
    })
}

/// Takes back each Scheduled Run of `runs` that its worker has not claimed within the claim
/// bound ([`crate::rebalance`]), replacing it in `runs` by the Pending Run written. Returns
/// when the next placement's bound is up.
async fn take_back_unclaimed(
    api: &Api<Run>,
    runs: &mut [Run],
    context: &Context,
) -> Option<Duration> {
    let now = k8s_openapi::jiff::Timestamp::now();
    let bound = context.claim_timeout;
    let mut next: Option<Duration> = None;
    for run in runs.iter_mut() {
        match rebalance::overdue(run, now, bound) {
            None => continue,
            Some(Err(left)) => {
                next = Some(next.map_or(left, |n| n.min(left)));
                continue;
            }
            Some(Ok(())) => {}
        }
        let status = run.status.clone().unwrap_or_default();
        let pod = status.assigned_pod.unwrap_or_default();
        let pod_uid = status.assigned_pod_uid.unwrap_or_default();
        let hook = context.unassign_hook.as_ref();
        let outcome =
            tokio::time::timeout(BIND_TIMEOUT, rebalance::unassign(api, run, bound, hook)).await;
        match outcome {
            Ok(Ok(Unassigned::Done(written))) => {
                warn!(run = %run.name_any(), pod = %pod, "worker did not claim the Run in time; placing it again");
                context.suspects.suspect(&pod_uid, bound);
                let note = format!(
                    "worker Pod {pod} did not start the Run within {}s; it is placed again",
                    bound.as_secs()
                );
                context.events.publish(
                    run,
                    EventType::Warning,
                    NOT_CLAIMED,
                    SCHEDULE_ACTION,
                    &note,
                );
                if let (Some(uid), Some(over)) = (run.uid(), run.resource_version()) {
                    context.assume(uid, over, (*written).clone());
                }
                *run = *written;
            }
            Ok(Ok(Unassigned::Changed)) => {
                debug!(run = %run.name_any(), "the unclaimed Run changed meanwhile; left alone");
            }
            Ok(Err(error)) => {
                warn!(run = %run.name_any(), error = %error, "cannot take back an unclaimed Run; retrying");
                next = Some(next.map_or(ERROR_REQUEUE, |n| n.min(ERROR_REQUEUE)));
            }
            Err(_) => {
                warn!(run = %run.name_any(), "taking back an unclaimed Run timed out; retrying");
                next = Some(next.map_or(ERROR_REQUEUE, |n| n.min(ERROR_REQUEUE)));
            }
        }
    }
    next
}

/// Why each Run the plan leaves unplaced waits, longest-waiting first after the Runs that
/// can never fit. A waiting Run is told only after [`WAIT_BEFORE_TELLING`], unless it
/// already says it is not placed for another reason.
fn why_not_placed<'a>(
    runtime: &Runtime,
    pods: &[Pod],
    eligible: &[Pod],
    runs: &'a [Run],
    plan: &placement::Plan,
) -> (Vec<(&'a Run, Why)>, Option<Duration>) {
    let name = runtime.name_any();
    let per_worker = runtime.spec.runs_per_worker();
    let mut tells = Vec::new();
    for &index in &plan.never_fits {
        let run = &runs[index];
        let requested = capacity::slots(&run.spec, per_worker);
        tells.push((
            run,
            Why {
                reason: EXCEEDS_WORKER_CAPACITY,
                message: format!(
                    "the Run asks for {requested} run slots; a worker of Runtime {name} has {per_worker}"
                ),
            },
        ));
    }
    let mut next: Option<Duration> = None;
    if plan.waiting_runs.is_empty() {
        return (tells, next);
    }
    let used = placement::used_slots(runs, per_worker);
    let ready: Vec<&Pod> = eligible
        .iter()
        .filter(|p| placement::is_ready_worker(p))
        .collect();
    let free: Vec<i64> = ready
        .iter()
        .map(|p| {
            let taken = p
                .metadata
                .name
                .as_deref()
                .and_then(|n| used.get(n))
                .copied()
                .unwrap_or(0);
            (i64::from(per_worker) - taken).max(0)
        })
        .collect();
    let free_total: i64 = free.iter().sum();
    let free_max = free.iter().copied().max().unwrap_or(0);
    let total = i64::from(per_worker) * i64::try_from(ready.len()).unwrap_or(i64::MAX);
    let left_out = pods.len() - eligible.len();
    let now = k8s_openapi::jiff::Timestamp::now();
    for &index in &plan.waiting_runs {
        let run = &runs[index];
        let requested = capacity::slots(&run.spec, per_worker);
        let why = if ready.is_empty() {
            let not_claiming = if left_out > 0 {
                format!(", {left_out} left out for not starting the Runs placed on them")
            } else {
                String::new()
            };
            Why {
                reason: WAITING_FOR_WORKERS,
                message: format!(
                    "Runtime {name} has no ready worker yet ({} workers{not_claiming}); the Run waits for one",
                    pods.len()
                ),
            }
        } else {
            let ahead = if free_max >= requested {
                "; Runs ahead of it in the queue come first"
            } else {
                ""
            };
            Why {
                reason: NO_CAPACITY,
                message: format!(
                    "requested {requested} run slots; free {free_total} of {total} on {} ready workers of Runtime {name} ({per_worker} each, at most {free_max} free on one){ahead}; the Run waits its turn",
                    ready.len()
                ),
            }
        };
        let waited = run
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|created| now.duration_since(created.0).unsigned_abs());
        let told_otherwise = kruntimes_api::lifecycle::unscheduled_reason(run.status.as_ref())
            .is_some_and(|(reason, _)| {
                [
                    NO_CAPACITY,
                    WAITING_FOR_WORKERS,
                    EXCEEDS_WORKER_CAPACITY,
                    RUNTIME_NOT_FOUND,
                ]
                .contains(&reason)
            });
        if let Some(waited) = waited
            && !told_otherwise
            && waited < WAIT_BEFORE_TELLING
        {
            let left = WAIT_BEFORE_TELLING - waited;
            next = Some(next.map_or(left, |n| n.min(left)));
            continue;
        }
        tells.push((run, why));
    }
    (tells, next)
}

/// Writes `Runtime.status.usedRuns = used` unless the Runtime shows it already (or this
/// scheduler wrote it a moment ago and the watch has not shown it yet). Returns when to look
/// again if the write had to wait for [`USAGE_WRITE_INTERVAL`] or failed. A failed write
/// is logged and never fails the pass: placing Runs matters more than the count.
async fn publish_usage(
    runtime: &Runtime,
    namespace: &str,
    used: i64,
    context: &Context,
) -> Option<Duration> {
    let used = i32::try_from(used).unwrap_or(i32::MAX);
    let name = runtime.name_any();
    if runtime.status.as_ref().and_then(|s| s.used_runs) == Some(used) {
        return None;
    }
    let key = (namespace.to_string(), name.clone());
    {
        let Ok(usage) = context.usage.lock() else {
            return None;
        };
        if let Some(last) = usage.get(&key) {
            let since = last.at.elapsed();
            if last.used == Some(used) && since < USAGE_ECHO_WAIT {
                return None;
            }
            if since < USAGE_WRITE_INTERVAL {
                return Some(USAGE_WRITE_INTERVAL - since);
            }
        }
    }
    let patch = serde_json::json!({"status": {"usedRuns": used}});
    let api = Api::<Runtime>::namespaced(context.client.clone(), namespace);
    let params = PatchParams::default();
    let patch = Patch::Merge(&patch);
    let write = api.patch_status(&name, &params, &patch);
    let outcome = tokio::time::timeout(BIND_TIMEOUT, write).await;
    let written = matches!(outcome, Ok(Ok(_)));
    if let Ok(mut usage) = context.usage.lock() {
        usage.insert(
            key,
            Usage {
                used: written.then_some(used),
                at: Instant::now(),
            },
        );
    }
    match outcome {
        Ok(Ok(_)) => {
            debug!(runtime = %name, namespace, used, "Runtime usedRuns written");
            None
        }
        Ok(Err(error)) if is_not_found(&error) => None,
        Ok(Err(error)) => {
            warn!(runtime = %name, namespace, error = %error, "cannot write the Runtime's usedRuns; retrying");
            Some(ERROR_REQUEUE)
        }
        Err(_) => {
            warn!(runtime = %name, namespace, "writing the Runtime's usedRuns timed out; retrying");
            Some(ERROR_REQUEUE)
        }
    }
}

/// Writes one placement: phase Scheduled, the assigned Pod and its UID, a session's
/// `incarnation` (1 on its first placement), and the Scheduled condition, through the status subresource with the Run's `resourceVersion` as read.
/// Returns the slots the placement took (none when the write timed out: its outcome is
/// unknown until the watch shows it).
async fn bind(
    api: &Api<Run>,
    run: &Run,
    placement: Placement,
    per_worker: i32,
    context: &Context,
) -> Result<i64, (String, kube::Error)> {
    let identity = context.identity.as_str();
    let name = run.name_any();
    let mut updated = run.clone();
    let generation = updated.meta().generation;
    let status = updated.status.get_or_insert_with(Default::default);
    status.phase = Some(Phase::Scheduled);
    if run.spec.mode.session.is_some() {
        // 1 when first placed; a resume raised it already.
        status.incarnation = Some(status.incarnation.unwrap_or(1).max(1));
    }
    status.assigned_pod = Some(placement.pod_name.clone());
    status.assigned_pod_uid = Some(placement.pod_uid.clone());
    set_condition(
        &mut status.conditions,
        RunCondition {
            type_: SCHEDULED_CONDITION.to_string(),
            status: "True".to_string(),
            reason: Some("Scheduled".to_string()),
            message: Some(format!(
                "assigned to Pod {} by {identity}",
                placement.pod_name
            )),
            last_transition_time: Some(now_rfc3339()),
            observed_generation: generation,
        },
    );
    let params = PostParams::default();
    let write = api.replace_status(&name, &params, &updated);
    let Ok(result) = tokio::time::timeout(BIND_TIMEOUT, write).await else {
        warn!(run = %name, "placement write timed out; the next pass re-reads the Run");
        return Ok(0);
    };
    match result {
        Ok(written) => {
            debug!(run = %name, pod = %placement.pod_name, "Run scheduled");
            if let (Some(uid), Some(over)) = (run.uid(), run.resource_version()) {
                context.assume(uid, over, written);
            }
            // What it holds, as the gate counts it (an exclusive session holds every slot).
            Ok(capacity::slots(&run.spec, per_worker))
        }
        Err(error) => {
            if is_conflict(&error) {
                debug!(run = %name, "Run changed since it was read; the next pass re-reads it");
            }
            Err((name, error))
        }
    }
}
