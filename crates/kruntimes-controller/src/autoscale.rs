//! Warm pools that scale (`Runtime.spec.scaling`): the scheduler's pass over a Runtime also
//! decides how many workers it needs, from the same view it places by.
//!
//! `spec.replicas` is the output, as a HorizontalPodAutoscaler writes a Deployment's
//! replicas: the Runtime controller and its provisioner keep that many workers, and a
//! `kubectl scale` (the scale subresource) holds until demand says otherwise.
//!
//! The rule, with `per` the slots of a worker ([`kruntimes_api::capacity`]):
//! - **free** slots are those of the workers that exist or are starting (`spec.replicas`
//!   less the workers being retired) minus the slots held; **need** is the slots the
//!   waiting Runs ask for plus `warmRuns`.
//! - **Up**: while free < need, or fewer than `minReplicas` workers, `spec.replicas` grows by
//!   what covers the gap, never beyond `maxReplicas`. A worker being retired is taken back
//!   first (its mark removed) rather than starting another.
//! - **Down**: a ready worker that has held nothing for `scaleDownDelaySeconds` is retired
//!   when the others still leave `need` free and at least `minReplicas` remain (beyond
//!   `maxReplicas`, without the delay). One at a time: the worker is marked
//!   [`RETIRING_ANNOTATION`] with the `spec.replicas` that no longer counts it (this
//!   scheduler places nothing more there, from the moment it decides, whatever its cache
//!   shows), then the Runs assigned to it are listed afresh
//!   from the API: only when none is left is `spec.replicas` lowered, and the provisioner
//!   stops the marked worker first (Ready=False, SIGTERM: runtimed drains; an idle worker
//!   holds nothing, so nothing is lost). If a Run is found, the mark is removed.
//! - A marked worker is **counted** while `spec.replicas` is above the replicas in its mark
//!   (the lowering has not happened yet): only then may it be taken back, or its
//!   retirement finished by lowering `spec.replicas`. Once `spec.replicas` is at or below
//!   the mark, the provisioner may be stopping it: it is never taken back and never
//!   lowers `spec.replicas` again. (Counting Pods against `spec.replicas` instead lowered
//!   it twice for one retirement while another worker had no Pod yet, and the provisioner
//!   then stopped a busy worker.)
//!
//! Nothing here holds a lock across an await; the decision is pure ([`decide`]).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kruntimes_api::runtime::RuntimeScaling;
use kruntimes_api::{Run, Runtime, capacity};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::placement::{self, Plan, RETIRING_ANNOTATION, is_ready_worker, is_retiring};

/// What the autoscaler remembers between passes.
#[derive(Default)]
pub(crate) struct State {
    /// Since when each worker (by namespace, Runtime and Pod name) has held nothing.
    idle_since: Mutex<HashMap<Key, Instant>>,
    /// Workers this scheduler decided to retire (namespace, Runtime, Pod name), with the
    /// `spec.replicas` that no longer counts each, before its Pod cache shows the mark.
    retiring: Mutex<HashMap<Key, i32>>,
}

/// (namespace, Runtime, Pod name).
type Key = (String, String, String);

fn key(namespace: &str, runtime: &str, pod: &str) -> Key {
    (namespace.to_string(), runtime.to_string(), pod.to_string())
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl State {
    /// Marks, in the scheduler's copy of the Pods, the workers this scheduler is retiring,
    /// so a pass places nothing there before the Pod cache shows the annotation.
    pub(crate) fn mark(&self, namespace: &str, runtime: &str, pods: &mut [Pod]) {
        let mut retiring = lock(&self.retiring);
        let present: HashSet<String> = pods.iter().map(ResourceExt::name_any).collect();
        retiring
            .retain(|(ns, rt, name), _| ns != namespace || rt != runtime || present.contains(name));
        for pod in pods.iter_mut() {
            if let Some(at) = retiring.get(&key(namespace, runtime, &pod.name_any())) {
                pod.metadata
                    .annotations
                    .get_or_insert_with(Default::default)
                    .insert(RETIRING_ANNOTATION.to_string(), at.to_string());
            }
        }
    }
}

/// One worker as the decision sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    pub name: String,
    /// Ready and not deleting.
    pub ready: bool,
    pub retiring: bool,
    /// For a retiring worker, the `spec.replicas` that no longer counts it (from its mark;
    /// `None` when the mark carries no number).
    pub retired_at: Option<i32>,
    /// Slots held.
    pub used: i64,
    /// How long it has held nothing (`None` while it holds something or is not ready).
    pub idle_for: Option<Duration>,
}

/// What a pass should do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Hold,
    /// Grow `spec.replicas` to this.
    ScaleUp(i32),
    /// Take these workers back from retirement.
    Unretire(Vec<String>),
    /// Retire this idle worker, then lower `spec.replicas` by one.
    Retire(String),
    /// A marked worker is still counted in `spec.replicas` (above its mark): finish its
    /// retirement.
    FinishRetire(String),
}

/// The decision for a Runtime of `replicas` workers of `per` slots, whose waiting Runs ask
/// for `waiting` slots. Also: the soonest a worker's cool-down ends, for the next look.
pub fn decide(
    scaling: &RuntimeScaling,
    per: i32,
    replicas: i32,
    workers: &[Worker],
    waiting: i64,
) -> (Decision, Option<Duration>) {
    let per = i64::from(per.max(1));
    let min = i64::from(scaling.min_replicas.max(1));
    let max = i64::from(scaling.max_replicas).max(min);
    let retiring: Vec<&Worker> = workers.iter().filter(|w| w.retiring).collect();
    // Retiring workers that `spec.replicas` still counts: it is above the replicas in their
    // mark. The others the provisioner may be stopping; they are never taken back. (Not
    // "Pods minus replicas": a replica whose Pod does not exist yet would make a worker
    // whose lowering already happened look counted, and lower replicas a second time.)
    let still_counted: Vec<&Worker> = retiring
        .iter()
        .copied()
        .filter(|w| w.retired_at.is_some_and(|at| replicas > at))
        .collect();
    let counted = still_counted.len() as i64;
    let effective = (i64::from(replicas) - counted).max(0);
    let used: i64 = workers.iter().filter(|w| !w.retiring).map(|w| w.used).sum();
    let free = effective * per - used;
    let need = waiting + i64::from(scaling.warm_runs());
    if free < need || effective < min {
        if counted > 0 {
            // Still counted, so not being stopped yet: take them back.
            return (
                Decision::Unretire(still_counted.iter().map(|w| w.name.clone()).collect()),
                None,
            );
        }
        let short = (need - free).max(0);
        let target = (effective + (short + per - 1) / per).max(min).min(max);
        if target > i64::from(replicas) {
            return (
                Decision::ScaleUp(i32::try_from(target).unwrap_or(i32::MAX)),
                None,
            );
        }
        return (Decision::Hold, None);
    }
    // Retirement under way: the worker goes once `spec.replicas` no longer counts it.
    if let Some(worker) = still_counted.first() {
        return (Decision::FinishRetire(worker.name.clone()), None);
    }
    if !retiring.is_empty() {
        return (Decision::Hold, None);
    }
    if effective <= min || free - per < need {
        return (Decision::Hold, None);
    }
    let delay = if effective > max {
        Duration::ZERO
    } else {
        scaling.scale_down_delay()
    };
    let mut idle: Vec<&Worker> = workers
        .iter()
        .filter(|w| w.ready && !w.retiring && w.used == 0)
        .collect();
    idle.sort_by(|a, b| b.idle_for.cmp(&a.idle_for).then(a.name.cmp(&b.name)));
    match idle.first() {
        Some(worker) if worker.idle_for.is_some_and(|f| f >= delay) => {
            (Decision::Retire(worker.name.clone()), None)
        }
        Some(worker) => (
            Decision::Hold,
            worker.idle_for.map(|f| delay.saturating_sub(f)),
        ),
        None => (Decision::Hold, None),
    }
}

/// One autoscaler pass over a scaling Runtime, after the scheduler planned `plan` over
/// `pods` and `runs` (the Runtime's non-terminal Runs). Returns when to look again.
pub(crate) async fn pass(
    client: &Client,
    state: &State,
    runtime: &Runtime,
    namespace: &str,
    pods: &[Pod],
    runs: &[Run],
    plan: &Plan,
) -> Option<Duration> {
    let scaling = runtime.spec.scaling.as_ref()?;
    if runtime.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let per = runtime.spec.runs_per_worker();
    let mut used = placement::used_slots(runs, per)
        .into_iter()
        .map(|(pod, slots)| (pod.to_string(), slots))
        .collect::<HashMap<String, i64>>();
    for placed in &plan.placements {
        *used.entry(placed.pod_name.clone()).or_default() +=
            capacity::slots(&runs[placed.run].spec, per);
    }
    let waiting: i64 = plan
        .waiting_runs
        .iter()
        .map(|&i| capacity::slots(&runs[i].spec, per))
        .sum();
    let now = Instant::now();
    let name = runtime.name_any();
    let workers: Vec<Worker> = {
        let mut idle_since = lock(&state.idle_since);
        let live: Vec<&Pod> = pods
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect();
        let names: HashSet<String> = live.iter().map(|p| p.name_any()).collect();
        idle_since.retain(|(ns, rt, pod), _| ns != namespace || *rt != name || names.contains(pod));
        live.iter()
            .map(|pod| {
                let pod_name = pod.name_any();
                let ready = is_ready_worker(pod);
                let held = used.get(&pod_name).copied().unwrap_or(0);
                let entry = key(namespace, &name, &pod_name);
                let idle_for = if ready && held == 0 {
                    Some(now.duration_since(*idle_since.entry(entry).or_insert(now)))
                } else {
                    idle_since.remove(&entry);
                    None
                };
                Worker {
                    name: pod_name,
                    ready,
                    retiring: is_retiring(pod),
                    retired_at: placement::retired_at(pod),
                    used: held,
                    idle_for,
                }
            })
            .collect()
    };
    let (decision, wake) = decide(scaling, per, runtime.spec.replicas, &workers, waiting);
    tracing::trace!(runtime = %name, ?workers, waiting, ?decision, ?wake, "autoscaler");
    let runtimes = Api::<Runtime>::namespaced(client.clone(), namespace);
    let pods_api = Api::<Pod>::namespaced(client.clone(), namespace);
    match decision {
        Decision::Hold => {}
        Decision::ScaleUp(target) => {
            info!(runtime = %name, namespace, from = runtime.spec.replicas, to = target, waiting, "scaling up");
            if let Err(error) = set_replicas(&runtimes, &name, runtime.spec.replicas, target).await
            {
                warn!(runtime = %name, error = %error, "scaling up failed");
                return Some(Duration::from_secs(1));
            }
        }
        Decision::Unretire(workers) => {
            for worker in workers {
                info!(runtime = %name, namespace, pod = %worker, "taking a retiring worker back");
                unmark(state, &pods_api, &key(namespace, &name, &worker)).await;
            }
        }
        Decision::Retire(worker) | Decision::FinishRetire(worker) => {
            // The replicas that no longer count this worker, in its mark.
            let target = runtime.spec.replicas.saturating_sub(1).max(1);
            lock(&state.retiring).insert(key(namespace, &name, &worker), target);
            let marked = pods_api
                .patch(
                    &worker,
                    &PatchParams::default(),
                    &Patch::Merge(
                        json!({"metadata": {"annotations": {RETIRING_ANNOTATION: target.to_string()}}}),
                    ),
                )
                .await;
            if let Err(error) = marked {
                warn!(runtime = %name, pod = %worker, error = %error, "marking a worker to retire failed");
                lock(&state.retiring).remove(&key(namespace, &name, &worker));
                return Some(Duration::from_secs(1));
            }
            // Re-check against the current state, not the cache: a Run assigned there
            // keeps the worker.
            match holds_runs(client, namespace, &worker).await {
                Ok(false) => {
                    info!(runtime = %name, namespace, pod = %worker, to = target, "retiring an idle worker");
                    if let Err(error) =
                        set_replicas(&runtimes, &name, runtime.spec.replicas, target).await
                    {
                        warn!(runtime = %name, error = %error, "scaling down failed");
                        return Some(Duration::from_secs(1));
                    }
                }
                Ok(true) => {
                    debug!(runtime = %name, pod = %worker, "a Run is assigned to the worker; it stays");
                    unmark(state, &pods_api, &key(namespace, &name, &worker)).await;
                }
                Err(error) => {
                    warn!(runtime = %name, pod = %worker, error = %error, "cannot list the worker's Runs");
                    return Some(Duration::from_secs(1));
                }
            }
        }
    }
    wake
}

/// Whether any Run not yet ended is assigned to the worker `pod`, read from the API.
async fn holds_runs(client: &Client, namespace: &str, pod: &str) -> Result<bool, kube::Error> {
    let runs = kruntimes_api::paging::list_all(
        &Api::<Run>::namespaced(client.clone(), namespace),
        &ListParams::default().fields(&format!("status.assignedPod={pod}")),
    )
    .await?;
    Ok(runs.iter().any(|run| !run.phase().is_terminal()))
}

async fn unmark(state: &State, pods: &Api<Pod>, worker: &Key) {
    let result = pods
        .patch(
            &worker.2,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {RETIRING_ANNOTATION: null}}})),
        )
        .await;
    if let Err(error) = result
        && !crate::error::is_not_found(&error)
    {
        warn!(pod = %worker.2, error = %error, "removing a worker's retiring mark failed");
        return;
    }
    lock(&state.retiring).remove(worker);
}

/// Moves `spec.replicas` from `from` (what the decision saw) to `to`, only if the Runtime
/// still has `from`: read afresh and replaced with its `resourceVersion`, so a change made
/// meanwhile (a `kubectl scale`) is never overwritten; the next pass decides again.
async fn set_replicas(
    runtimes: &Api<Runtime>,
    name: &str,
    from: i32,
    to: i32,
) -> Result<(), kube::Error> {
    let mut current = runtimes.get(name).await?;
    if current.spec.replicas != from {
        debug!(runtime = %name, from, seen = current.spec.replicas, "replicas changed meanwhile");
        return Ok(());
    }
    current.spec.replicas = to;
    match runtimes
        .replace(name, &kube::api::PostParams::default(), &current)
        .await
    {
        Ok(_) => Ok(()),
        Err(error) if crate::error::is_conflict(&error) => Ok(()),
        Err(error) => Err(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scaling(min: i32, max: i32, warm: i32) -> RuntimeScaling {
        RuntimeScaling {
            min_replicas: min,
            max_replicas: max,
            warm_runs: Some(warm),
            scale_down_delay_seconds: Some(60),
        }
    }

    fn worker(name: &str, used: i64, idle_secs: Option<u64>) -> Worker {
        Worker {
            name: name.into(),
            ready: true,
            retiring: false,
            retired_at: None,
            used,
            idle_for: idle_secs.map(Duration::from_secs),
        }
    }

    #[test]
    fn demand_adds_workers_up_to_the_maximum() {
        let s = scaling(1, 8, 2);
        // 8 slots, 7 held: 1 free < 2 warm: one more worker.
        let (d, _) = decide(&s, 8, 1, &[worker("a", 7, None)], 0);
        assert_eq!(d, Decision::ScaleUp(2));
        // 20 sandboxes waiting on one empty worker: 22 needed, 8 free: two more (24).
        let (d, _) = decide(&s, 8, 1, &[worker("a", 0, Some(0))], 20);
        assert_eq!(d, Decision::ScaleUp(3));
        // Workers still starting count as free: no second increase while they start.
        let (d, _) = decide(&s, 8, 4, &[worker("a", 8, None)], 12);
        assert_eq!(d, Decision::Hold);
        // Never beyond the maximum.
        let (d, _) = decide(&s, 8, 1, &[worker("a", 8, None)], 500);
        assert_eq!(d, Decision::ScaleUp(8));
        let (d, _) = decide(&s, 8, 8, &[worker("a", 8, None)], 500);
        assert_eq!(d, Decision::Hold);
        // Below the minimum (a kubectl scale to 0): back to it.
        let (d, _) = decide(&scaling(2, 8, 0), 8, 0, &[], 0);
        assert_eq!(d, Decision::ScaleUp(2));
    }

    #[test]
    fn idle_workers_go_after_the_delay_one_at_a_time_never_below_the_minimum() {
        let s = scaling(1, 8, 2);
        let busy = worker("a", 1, None);
        // Idle for 30 s of 60: wait the other 30.
        let (d, wake) = decide(&s, 8, 2, &[busy.clone(), worker("b", 0, Some(30))], 0);
        assert_eq!(d, Decision::Hold);
        assert_eq!(wake, Some(Duration::from_secs(30)));
        let (d, _) = decide(&s, 8, 2, &[busy.clone(), worker("b", 0, Some(60))], 0);
        assert_eq!(d, Decision::Retire("b".into()));
        // Not when the others would not leave the warm headroom.
        let (d, _) = decide(
            &s,
            8,
            2,
            &[worker("a", 7, None), worker("b", 0, Some(90))],
            0,
        );
        assert_eq!(d, Decision::Hold);
        // Never below the minimum.
        let (d, _) = decide(&s, 8, 1, &[worker("b", 0, Some(90))], 0);
        assert_eq!(d, Decision::Hold);
        // Beyond the maximum, at once.
        let (d, _) = decide(&scaling(1, 1, 0), 8, 2, &[busy, worker("b", 0, Some(0))], 0);
        assert_eq!(d, Decision::Retire("b".into()));
    }

    #[test]
    fn a_retiring_worker_is_taken_back_before_another_starts_and_finished_otherwise() {
        let s = scaling(1, 8, 2);
        let mut retiring = worker("b", 0, Some(90));
        retiring.retiring = true;
        retiring.retired_at = Some(1);
        let (d, _) = decide(&s, 8, 2, &[worker("a", 8, None), retiring.clone()], 0);
        assert_eq!(d, Decision::Unretire(vec!["b".into()]));
        // Still counted in replicas: finish; already not counted: wait for the provisioner.
        let (d, _) = decide(&s, 8, 2, &[worker("a", 0, None), retiring.clone()], 0);
        assert_eq!(d, Decision::FinishRetire("b".into()));
        let (d, _) = decide(&s, 8, 1, &[worker("a", 0, None), retiring.clone()], 0);
        assert_eq!(d, Decision::Hold);
        // Once lowered, never taken back, even when demand rises before it is stopped.
        let (d, _) = decide(&s, 8, 1, &[worker("a", 8, None), retiring], 40);
        assert_eq!(d, Decision::ScaleUp(7));
    }

    /// Found in review: replicas 3, workers a (busy), b (idle, retired: replicas lowered to
    /// 2) and a third replica with no Pod yet (starting, or in crash backoff). Counting
    /// retiring workers as "Pods minus replicas" saw b as still counted (2 Pods, replicas
    /// 2) and lowered replicas again, to 1: the provisioner then stopped a busy worker.
    /// The mark says which replicas no longer count b, so the second pass holds.
    #[test]
    fn a_retirement_lowers_replicas_once_while_another_worker_has_no_pod_yet() {
        let s = scaling(1, 8, 2);
        let mut b = worker("b", 0, Some(90));
        b.retiring = true;
        b.retired_at = Some(2);
        let (d, _) = decide(&s, 8, 2, &[worker("a", 3, None), b.clone()], 0);
        assert_eq!(d, Decision::Hold);
        // Demand meanwhile: a new worker, never b back.
        let (d, _) = decide(&s, 8, 2, &[worker("a", 8, None), b.clone()], 8);
        assert_eq!(d, Decision::ScaleUp(3));
        // A mark without a number (never written by this version) is not counted either.
        b.retired_at = None;
        let (d, _) = decide(&s, 8, 2, &[worker("a", 3, None), b], 0);
        assert_eq!(d, Decision::Hold);
    }
}
