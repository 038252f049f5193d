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
//! A Run that cannot be placed says why in an Event ([`crate::events`]): its Runtime does
//! not exist (`RuntimeNotFound`), it asks for more slots than a worker has
//! (`ExceedsWorker`), or it has waited [`NO_CAPACITY_AFTER`] for a free slot
//! (`NoCapacity`), once per Run and reason; `NoCapacity` at most once per
//! [`NO_CAPACITY_EVERY`] per Runtime, to the longest-waiting Run not told yet, so that a
//! burst queued behind busy workers does not cost a write per Run.
//!
//! It never starts, claims or ends Runs: runtimed moves them on from Scheduled.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kruntimes_api::run::RunCondition;
use kruntimes_api::{Phase, Run, Runtime};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tracing::{debug, warn};

use crate::error::{Error, is_conflict, is_not_found};
use crate::events::{EXCEEDS_WORKER, Events, NO_CAPACITY, RUNTIME_NOT_FOUND};
use crate::placement::{self, Placement};
use crate::status::{now_rfc3339, set_condition};

/// The label that ties a worker Pod to its Runtime.
pub const RUNTIME_LABEL: &str = "kruntimes.io/runtime";
/// The condition type the scheduler sets.
pub const SCHEDULED_CONDITION: &str = "Scheduled";
/// Status writes in flight at once within one pass.
const WRITE_CONCURRENCY: usize = 16;
/// Page size of the scheduler's lists.
const LIST_PAGE: u32 = 500;
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
/// How long a Run waits for a slot before it gets a [`NO_CAPACITY`] Event.
pub const NO_CAPACITY_AFTER: Duration = Duration::from_secs(2);
/// The shortest time between two [`NO_CAPACITY`] Events of one Runtime.
pub const NO_CAPACITY_EVERY: Duration = Duration::from_secs(1);
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
    /// Placements written and not yet seen in `runs`, by Run UID.
    assumed: Mutex<HashMap<String, Assumed>>,
    /// The last `usedRuns` written, by (namespace, Runtime).
    usage: Mutex<HashMap<(String, String), Usage>>,
    events: Events,
    /// When each Runtime's last [`NO_CAPACITY`] Event went out, by (namespace, Runtime).
    no_capacity_told: Mutex<HashMap<(String, String), Instant>>,
}

/// An Event on each Pending Run of `namespace` that names the missing Runtime `runtime`.
fn report_missing_runtime(context: &Context, runtime: &str, namespace: Option<&str>) {
    for run in context.runs.state() {
        if run.spec.runtime != runtime
            || run.metadata.namespace.as_deref() != namespace
            || !run.phase().is_schedulable()
        {
            continue;
        }
        context.events.publish_once(
            &run,
            EventType::Warning,
            RUNTIME_NOT_FOUND,
            SCHEDULE_ACTION,
            || {
                format!(
                    "Runtime {runtime} does not exist in namespace {}; the Run waits until it does",
                    namespace.unwrap_or_default()
                )
            },
        );
    }
}

/// Runs the scheduler until its watches end. Cancel it by dropping the future.
pub(crate) async fn run(client: Client, identity: String, events: Events) -> Result<(), Error> {
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
    let context = Arc::new(Context {
        client,
        identity,
        runs,
        pods,
        assumed: Mutex::new(HashMap::new()),
        usage: Mutex::new(HashMap::new()),
        events,
        no_capacity_told: Mutex::new(HashMap::new()),
    });
    let missing = context.clone();
    Controller::new(runtimes, watcher::Config::default())
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
        .run(reconcile, error_policy, context)
        .for_each(|result| {
            let context = missing.clone();
            async move {
                match result {
                    Ok((object, _)) => debug!(runtime = %object, "scheduler pass done"),
                    // A Run or Pod names a Runtime that does not exist (yet): nothing to
                    // place; its Pending Runs say so.
                    Err(kube::runtime::controller::Error::ObjectNotFound(object)) => {
                        debug!(runtime = %object, "no such Runtime; its Runs wait");
                        report_missing_runtime(&context, &object.name, object.namespace.as_deref());
                    }
                    Err(error) => warn!(error = %error, "scheduler pass failed"),
                }
            }
        })
        .await;
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
    let mut params = params.limit(LIST_PAGE);
    let mut items = Vec::new();
    loop {
        let page = api.list(&params).await.map_err(|source| Error::List {
            what,
            namespace: namespace.to_string(),
            source,
        })?;
        items.extend(page.items);
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(items),
        }
    }
}

impl Context {
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
    let pods: Vec<Pod> = context
        .pods
        .state()
        .iter()
        .filter(|pod| {
            pod.namespace().as_deref() == Some(namespace.as_str())
                && pod.labels().get(RUNTIME_LABEL) == Some(&name)
        })
        .map(|pod| (**pod).clone())
        .collect();
    let runs = context.runs_of(&namespace, &name);
    // Placements below add to the count; the write after them publishes the sum.
    let used: i64 = placement::used_slots(&runs).values().sum();
    // A retried Run waits out its backoff before it is placed again.
    let mut wake: Option<Duration> = None;
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
    let plan = placement::plan(runtime.spec.runs_per_worker(), &pods, &runs);
    let per_worker = runtime.spec.runs_per_worker();
    for &index in &plan.never_fits {
        let run = &runs[index];
        let requested = run.spec.requested_runs();
        warn!(
            run = %run.name_any(),
            runtime = %name,
            requested,
            runs_per_worker = per_worker,
            "Run asks for more run slots than a worker of its Runtime has; it stays Pending"
        );
        context.events.publish_once(run, EventType::Warning, EXCEEDS_WORKER, SCHEDULE_ACTION, || {
            format!(
                "the Run asks for {requested} run slots; a worker of Runtime {name} has {per_worker}"
            )
        });
    }
    // A Run that has waited a moment for a slot says so once; one placed within that moment
    // gets no Event. In a long queue (a burst) at most one such Event per Runtime per
    // NO_CAPACITY_EVERY, to the Run that has waited longest and was not told yet, so a
    // burst does not add a write per Run.
    let key = (namespace.clone(), name.clone());
    let may_report = context.no_capacity_told.lock().is_ok_and(|told| {
        told.get(&key)
            .is_none_or(|at| at.elapsed() >= NO_CAPACITY_EVERY)
    });
    if may_report && !plan.waiting_runs.is_empty() {
        let ready = pods
            .iter()
            .filter(|p| placement::is_ready_worker(p))
            .count();
        let now = k8s_openapi::jiff::Timestamp::now();
        for &index in &plan.waiting_runs {
            let run = &runs[index];
            let waited = run
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|created| now.duration_since(created.0));
            if waited.is_some_and(|w| w.unsigned_abs() < NO_CAPACITY_AFTER) {
                continue;
            }
            let requested = run.spec.requested_runs();
            let told = context.events.publish_once(run, EventType::Warning, NO_CAPACITY, SCHEDULE_ACTION, || {
                format!(
                    "no worker of Runtime {name} has {requested} free run slots ({ready} ready workers of {per_worker} slots each); the Run waits its turn"
                )
            });
            if told {
                if let Ok(mut last) = context.no_capacity_told.lock() {
                    last.insert(key, Instant::now());
                }
                break;
            }
        }
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
    let results: Vec<Result<i64, (String, kube::Error)>> = futures::stream::iter(plan.placements)
        .map(|placement| bind(&runs_api, &runs[placement.run], placement, &context))
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

/// Writes one placement: phase Scheduled, the assigned Pod and its UID, and the Scheduled
/// condition, through the status subresource with the Run's `resourceVersion` as read.
/// Returns the slots the placement took (none when the write timed out: its outcome is
/// unknown until the watch shows it).
async fn bind(
    api: &Api<Run>,
    run: &Run,
    placement: Placement,
    context: &Context,
) -> Result<i64, (String, kube::Error)> {
    let identity = context.identity.as_str();
    let name = run.name_any();
    let mut updated = run.clone();
    let generation = updated.meta().generation;
    let status = updated.status.get_or_insert_with(Default::default);
    status.phase = Some(Phase::Scheduled);
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
            Ok(i64::from(run.spec.requested_runs()))
        }
        Err(error) => {
            if is_conflict(&error) {
                debug!(run = %name, "Run changed since it was read; the next pass re-reads it");
            }
            Err((name, error))
        }
    }
}
