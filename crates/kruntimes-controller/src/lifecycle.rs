//! The Run lifecycle controller: what the controller-manager does to one Run at a time.
//!
//! - **Cancellation before assignment.** A Pending Run with a `spec.termination` request
//!   becomes Cancelled (reason `Cancelled`, `completionTime` set). Once a Run is assigned,
//!   its runtimed owns cancellation; this controller leaves it alone. A Drain request on a
//!   Run that was never placed has nothing to drain and ends the same way.
//! - **TTL cleanup.** A terminal Run with `spec.ttlSecondsAfterFinished` is deleted that
//!   long after its `status.completionTime`. The reconcile requeues itself for the exact
//!   moment; nothing polls. The delete carries the UID and `resourceVersion` it decided on,
//!   so a Run whose TTL was just changed is re-read, not deleted.
//!
//! - **Stale-worker recovery with fencing.** A Scheduled or Running Run whose assigned Pod
//!   is fenced — the Pod with exactly `assignedPodUID` is gone, or it is deleting and out of
//!   rotation — lost its worker. After a fresh read of the Pod confirms the fence, the
//!   attempt ends as an infrastructure failure (reason `WorkerLost`): the Run goes back to
//!   Pending for its next attempt, or ends Failed when `retryPolicy` allows no more
//!   (`kruntimes_api::lifecycle`). A session Run that was Ready (Ready or Finalizing) ends
//!   Failed instead: its workspace was on that worker, and a Ready session never moves.
//!   Unless it asks for `mode.session.onWorkerLoss: ResumeFromSnapshot` and its
//!   `status.snapshot` names a Snapshot that is Ready (read afresh): then it is resumed
//!   from it as a Suspended Run is (Pending, `status.incarnation` + 1, reason `WorkerLost`),
//!   losing what changed since that Snapshot.
//!   A Pod event requeues the Runs assigned to that Pod.
//!
//! - **Ready follows the phase.** Every write here that takes a function or session Run out
//!   of Ready (worker lost: back to Pending or Failed; cancelled) sets `Ready=False` with
//!   the same reason (`WorkerLost`, `Cancelled`), so no Run outside Ready says `Ready=True`.
//!
//! - **Registration cleanup of orphans.** A deleting Run that still carries the
//!   `kruntimes.io/registration-cleanup` finalizer is runtimed's to clean up while its
//!   assigned Pod stands. When it has no assignment (a retried Run waiting for a worker), or
//!   its assigned Pod is fenced (confirmed by a fresh read, as above), no Pod-local
//!   registration can still be serving it, so this controller removes the finalizer.
//!
//! - **Suspend and resume** (`spec.suspend`, session Runs; the rules are
//!   [`kruntimes_api::lifecycle::suspend_action`]). A Suspended Run whose `spec.suspend`
//!   is no longer true is resumed ([`resume`]): back to Pending with its
//!   `status.incarnation` one higher, `status.snapshot` kept, its assignment cleared; the scheduler then places it,
//!   preferring the worker that keeps the Snapshot's local copy. A Pending or Scheduled Run
//!   with `spec.suspend: true` and a `status.snapshot` (resumed, then suspended again
//!   before it was placed) goes straight back to Suspended: nothing ran since the
//!   Snapshot. Without a snapshot it waits until it is Ready, and its worker captures it
//!   (Ready → Suspended is the owning worker's write, never this controller's). A
//!   Suspended Run with a termination request is Cancelled as a Run with no worker is;
//!   a deleting one has no assignment, so its registration finalizer is released. Both
//!   writes are conditional on the `resourceVersion` the decision was made from, so a
//!   concurrent change of `spec.suspend` is never lost: the write conflicts and the Run is
//!   decided again.
//!
//! Each of these transitions, once written, is also told in an Event on the Run
//! ([`crate::events`]: `WorkerLost`, `Retrying`, `Cancelled`), best-effort.
//!
//! Every decision is made from the Run as read, with an exhaustive match on its phase; every
//! write is conditional on its `resourceVersion`.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kruntimes_api::lifecycle::{
    AfterFailure, REGISTRATION_FINALIZER, SuspendAction, record_infrastructure_failure,
    record_resume, record_suspend, suspend_action,
};
use kruntimes_api::lifecycle::{RESUMED_REASON, SUSPENDED_REASON};
use kruntimes_api::run::{TerminationMode, WorkerLossPolicy};
use kruntimes_api::snapshot::SnapshotPhase;
use kruntimes_api::{Phase, Run, Snapshot};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use tracing::{debug, info, warn};

use crate::error::{Error, is_conflict, is_not_found};
use crate::events::{Events, RETRYING};
use crate::placement::is_ready_worker;
use crate::scheduler::RUNTIME_LABEL;
use crate::status::{leave_ready, now_rfc3339};

/// The reason written when a Run's worker is lost.
pub const WORKER_LOST_REASON: &str = "WorkerLost";

/// The reason written on a Run cancelled before assignment.
pub const CANCELLED_REASON: &str = "Cancelled";
/// The `action` of the Events of stale-worker recovery.
const RECOVER: &str = "Recover";
/// How soon a reconcile that met a conflict runs again.
const CONFLICT_REQUEUE: Duration = Duration::from_millis(200);
/// How soon a reconcile that failed runs again.
const ERROR_REQUEUE: Duration = Duration::from_secs(1);

pub(crate) struct Context {
    pub client: Client,
    pub events: Events,
    /// Worker Pods as last watched; a miss here is confirmed by a fresh read.
    pub pods: Store<Pod>,
}

/// Runs the lifecycle controller until its watch ends. Cancel it by dropping the future.
pub(crate) async fn run(client: Client, events: Events) -> Result<(), Error> {
    let runs = Api::<Run>::all(client.clone());
    let (pods, pod_writer) = reflector::store();
    let pod_events = reflector::reflector(
        pod_writer,
        watcher(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default().labels(RUNTIME_LABEL),
        ),
    )
    .touched_objects()
    .default_backoff();
    let controller = Controller::new(runs, watcher::Config::default());
    let runs_store = controller.store();
    // A Pod change (deletion above all) requeues the Runs assigned to that Pod.
    controller
        .watches_stream(pod_events, move |pod: Pod| {
            let name = pod.name_any();
            let namespace = pod.namespace();
            runs_store
                .state()
                .into_iter()
                .filter(|run| {
                    run.namespace() == namespace
                        && run.status.as_ref().and_then(|s| s.assigned_pod.as_deref())
                            == Some(name.as_str())
                })
                .map(|run| ObjectRef::from_obj(&*run))
                .collect::<Vec<_>>()
        })
        .run(
            reconcile,
            error_policy,
            Arc::new(Context {
                client,
                events,
                pods,
            }),
        )
        .for_each(|result| async move {
            if let Err(error) = result {
                warn!(error = %error, "Run lifecycle reconcile failed");
            }
        })
        .await;
    Err(Error::ControllerStopped {
        controller: "run lifecycle",
    })
}

fn error_policy(run: Arc<Run>, error: &Error, _: Arc<Context>) -> Action {
    warn!(run = %run.name_any(), error = %error, "Run lifecycle reconcile failed; retrying");
    Action::requeue(ERROR_REQUEUE)
}

/// What to do with one Run, decided from the Run alone and the current time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Nothing to do until the Run changes.
    Wait,
    /// Write phase Cancelled.
    Cancel,
    /// Delete the Run now: its TTL has passed.
    Delete,
    /// Look again after this long: the TTL has not passed yet.
    RequeueAfter(Duration),
    /// Assigned: check that the assigned Pod still stands.
    CheckWorker,
    /// Deleting with the registration finalizer: remove it unless a worker still owns it.
    ReleaseRegistration,
    /// Suspended and `spec.suspend` no longer true: back to Pending ([`resume`]).
    Resume,
    /// Pending or Scheduled, `spec.suspend: true` and a snapshot: back to Suspended.
    Resuspend,
}

/// Decides what the lifecycle controller does with `run` at time `now`.
pub(crate) fn decide(run: &Run, now: Timestamp) -> Decision {
    if run.metadata.deletion_timestamp.is_some() {
        return if run.finalizers().iter().any(|f| f == REGISTRATION_FINALIZER) {
            Decision::ReleaseRegistration
        } else {
            Decision::Wait
        };
    }
    let suspension = suspend_action(&run.spec, run.status.as_ref());
    match run.phase() {
        Phase::Pending => match run.spec.termination.as_ref().map(|t| t.mode) {
            Some(TerminationMode::Immediate | TerminationMode::Drain) => Decision::Cancel,
            None if suspension == SuspendAction::Resuspend => Decision::Resuspend,
            None => Decision::Wait,
        },
        Phase::Scheduled if suspension == SuspendAction::Resuspend => Decision::Resuspend,
        // Assigned: the Run's runtimed owns it now, as long as its worker stands.
        Phase::Scheduled | Phase::Running | Phase::Ready | Phase::Finalizing => {
            Decision::CheckWorker
        }
        // Not placed, nothing runs: ended as a Run with no worker, or resumed.
        Phase::Suspended => match run.spec.termination.as_ref().map(|t| t.mode) {
            Some(TerminationMode::Immediate | TerminationMode::Drain) => Decision::Cancel,
            None if suspension == SuspendAction::Resume => Decision::Resume,
            None => Decision::Wait,
        },
        Phase::Succeeded | Phase::Failed | Phase::Timeout | Phase::Cancelled => ttl(run, now),
    }
}

fn ttl(run: &Run, now: Timestamp) -> Decision {
    let Some(ttl) = run.spec.ttl_seconds_after_finished else {
        return Decision::Wait;
    };
    let completed = run
        .status
        .as_ref()
        .and_then(|s| s.completion_time.as_deref())
        .and_then(|t| t.parse::<Timestamp>().ok());
    let Some(completed) = completed else {
        // Without a completion time there is nothing to count from; the writer of the
        // terminal phase sets it, and that update triggers another reconcile.
        debug!(run = %run.name_any(), "terminal Run has no valid completionTime; TTL waits");
        return Decision::Wait;
    };
    let deadline = completed.saturating_add(SignedDuration::from_secs(i64::from(ttl.max(0))));
    let Ok(deadline) = deadline else {
        return Decision::Wait;
    };
    let left = now.duration_until(deadline);
    if left <= SignedDuration::ZERO {
        return Decision::Delete;
    }
    match Duration::try_from(left) {
        Ok(left) => Decision::RequeueAfter(left),
        Err(_) => Decision::Delete,
    }
}

async fn reconcile(run: Arc<Run>, context: Arc<Context>) -> Result<Action, Error> {
    let name = run.name_any();
    let namespace = run.namespace().ok_or_else(|| Error::MissingField {
        kind: "Run",
        name: name.clone(),
        field: "metadata.namespace",
    })?;
    let api = Api::<Run>::namespaced(context.client.clone(), &namespace);
    match decide(&run, Timestamp::now()) {
        Decision::Wait => Ok(Action::await_change()),
        Decision::RequeueAfter(left) => Ok(Action::requeue(left)),
        Decision::Cancel => {
            // A session with a Workspace that no worker holds commits its suspend first.
            if !promote(&run, &namespace, &context).await? {
                return Ok(Action::requeue(CONFLICT_REQUEUE));
            }
            cancel(&api, &run, &namespace, &context.events).await
        }
        Decision::Delete => delete(&api, &run, &namespace).await,
        Decision::CheckWorker => check_worker(&api, &run, &namespace, &context).await,
        Decision::ReleaseRegistration => {
            if !promote(&run, &namespace, &context).await? {
                return Ok(Action::requeue(CONFLICT_REQUEUE));
            }
            release_registration(&api, &run, &namespace, &context).await
        }
        Decision::Resume => match resume(&api, &run).await? {
            Written::Yes => {
                let note = format!("resumed as incarnation {}", run.incarnation() + 1);
                let events = &context.events;
                events.publish(&*run, EventType::Normal, RESUMED_REASON, "Resume", &note);
                Ok(Action::await_change())
            }
            Written::Conflict => Ok(Action::requeue(CONFLICT_REQUEUE)),
            Written::Gone => Ok(Action::await_change()),
        },
        Decision::Resuspend => resuspend(&api, &run, &namespace, &context.events).await,
    }
}

/// What a conditional status write came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// Written over the `resourceVersion` it was decided from.
    Yes,
    /// The Run changed since (409): nothing written; decide again from a fresh read.
    Conflict,
    /// The Run is gone.
    Gone,
}

/// Resumes the Suspended session `run` as read: writes, conditional on its
/// `resourceVersion`, phase Pending with `status.incarnation` + 1, `status.snapshot` kept
/// and the assignment cleared ([`kruntimes_api::lifecycle::record_resume`]).
///
/// Guarantees: nothing is written unless `run` is still the current version, so a
/// `spec.suspend` set again after `run` was read is never overwritten by a resume decided
/// from the older spec ([`Written::Conflict`]). Assumes the caller decided from `run` that
/// a resume is due ([`SuspendAction::Resume`]); it checks that again and writes nothing
/// ([`Written::Conflict`]) when it is not.
///
/// Errors: any API failure other than a conflict or a missing Run.
pub async fn resume(api: &Api<Run>, run: &Run) -> Result<Written, Error> {
    if run.phase() != Phase::Suspended
        || suspend_action(&run.spec, run.status.as_ref()) != SuspendAction::Resume
    {
        return Ok(Written::Conflict);
    }
    let mut updated = run.clone();
    let generation = updated.meta().generation;
    record_resume(
        updated.status.get_or_insert_with(Default::default),
        generation,
    );
    let name = run.name_any();
    match api
        .replace_status(&name, &PostParams::default(), &updated)
        .await
    {
        Ok(_) => {
            info!(run = %name, incarnation = updated.incarnation(), "session resumed");
            Ok(Written::Yes)
        }
        Err(error) if is_conflict(&error) => Ok(Written::Conflict),
        Err(error) if is_not_found(&error) => Ok(Written::Gone),
        Err(source) => Err(Error::WriteRunStatus {
            namespace: run.namespace().unwrap_or_default(),
            name,
            source,
        }),
    }
}

/// Sends a Pending or Scheduled session with `spec.suspend: true` and a `status.snapshot`
/// straight back to Suspended, with that snapshot: nothing ran since it was taken.
async fn resuspend(
    api: &Api<Run>,
    run: &Run,
    namespace: &str,
    events: &Events,
) -> Result<Action, Error> {
    let Some(snapshot) = run.status.as_ref().and_then(|s| s.snapshot.clone()) else {
        // A fork created suspended: first its source becomes `status.snapshot` (a Run
        // enters Suspended only from a status that names its Snapshot), then it suspends.
        let Some(source) = run.spec.fork_source() else {
            return Ok(Action::await_change());
        };
        let mut named = run.clone();
        named.status.get_or_insert_with(Default::default).snapshot =
            Some(kruntimes_api::run::RunSnapshotRef {
                name: source.name.clone(),
                uri: None,
                last_sequence: None,
            });
        // Its watch event brings the Run back, to the Resuspend.
        return Ok(write_status(api, &named, namespace).await?.0);
    };
    let Some(mut updated) = carry_auto_suspend_marker(api, run, namespace).await? else {
        return Ok(Action::requeue(CONFLICT_REQUEUE));
    };
    let generation = updated.meta().generation;
    let status = updated.status.get_or_insert_with(Default::default);
    record_suspend(&run.spec, status, snapshot, generation);
    let (action, written) = write_status(api, &updated, namespace).await?;
    if written {
        let note = "suspended again before it was placed; it resumes from the same Snapshot";
        info!(run = %run.name_any(), namespace, "{note}");
        events.publish(run, EventType::Normal, SUSPENDED_REASON, "Suspend", note);
    }
    Ok(action)
}

/// Whether the Run's assigned worker is fenced: the Pod with exactly `assignedPodUID` is
/// gone, or it is deleting and out of rotation. A miss in the cache is confirmed by a fresh
/// read. `None` when the Run has no assignment. On `Some(false)` the worker stands.
async fn fenced(run: &Run, namespace: &str, context: &Context) -> Result<Option<String>, Error> {
    let status = run.status.clone().unwrap_or_default();
    let (Some(pod_name), Some(pod_uid)) = (
        status.assigned_pod.as_deref(),
        status.assigned_pod_uid.as_deref(),
    ) else {
        return Ok(Some("the Run has no worker".to_string()));
    };
    let cached = context
        .pods
        .get(&ObjectRef::new(pod_name).within(namespace));
    if cached.as_deref().is_some_and(|pod| stands(pod, pod_uid)) {
        return Ok(None);
    }
    // The cache may lag behind a Pod created a moment ago: confirm with a fresh read.
    let pods = Api::<Pod>::namespaced(context.client.clone(), namespace);
    let fresh = pods.get_opt(pod_name).await.map_err(|source| Error::List {
        what: "pods",
        namespace: namespace.to_string(),
        source,
    })?;
    Ok(match &fresh {
        Some(pod) if stands(pod, pod_uid) => None,
        Some(_) => Some(format!(
            "worker Pod {pod_name} (UID {pod_uid}) was replaced or is stopping"
        )),
        None => Some(format!("worker Pod {pod_name} (UID {pod_uid}) is gone")),
    })
}

async fn release_registration(
    api: &Api<Run>,
    run: &Run,
    namespace: &str,
    context: &Context,
) -> Result<Action, Error> {
    let Some(why) = fenced(run, namespace, context).await? else {
        // Its runtimed cleans up and removes the finalizer.
        return Ok(Action::await_change());
    };
    let name = run.name_any();
    let finalizers: Vec<String> = run
        .finalizers()
        .iter()
        .filter(|f| *f != REGISTRATION_FINALIZER)
        .cloned()
        .collect();
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": run.resource_version(), "finalizers": finalizers}
    });
    match api
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {
            info!(run = %name, namespace, why, "registration finalizer released");
            Ok(Action::await_change())
        }
        Err(error) if is_conflict(&error) => Ok(Action::requeue(CONFLICT_REQUEUE)),
        Err(error) if is_not_found(&error) => Ok(Action::await_change()),
        Err(source) => Err(Error::WriteRunStatus {
            namespace: namespace.to_string(),
            name,
            source,
        }),
    }
}

/// Whether `pod` is the exact assigned worker and still in rotation (not fenced).
fn stands(pod: &Pod, uid: &str) -> bool {
    pod.uid().as_deref() == Some(uid)
        && (pod.metadata.deletion_timestamp.is_none() || is_ready_worker(pod))
}

async fn check_worker(
    api: &Api<Run>,
    run: &Run,
    namespace: &str,
    context: &Context,
) -> Result<Action, Error> {
    if run
        .status
        .as_ref()
        .is_none_or(|s| s.assigned_pod.is_none() || s.assigned_pod_uid.is_none())
    {
        return Ok(Action::await_change());
    }
    let Some(gone) = fenced(run, namespace, context).await? else {
        return Ok(Action::await_change());
    };
    let name = run.name_any();
    let mut updated = run.clone();
    let generation = updated.meta().generation;
    if session_was_ready(run) {
        if let Some(snapshot) = resumable_snapshot(run, namespace, context).await? {
            // onWorkerLoss: ResumeFromSnapshot, and a Ready Snapshot to resume from.
            let status = updated.status.get_or_insert_with(Default::default);
            leave_ready(&run.spec, status, WORKER_LOST_REASON, &gone, generation);
            record_resume(status, generation);
            let message = format!(
                "{gone}; resumed from Snapshot {snapshot} (onWorkerLoss: ResumeFromSnapshot): \
                 what changed since it was taken is lost"
            );
            status.reason = Some(WORKER_LOST_REASON.to_string());
            status.message = Some(message.clone());
            let (action, written) = write_status(api, &updated, namespace).await?;
            if written {
                info!(run = %name, namespace, snapshot, "worker lost; Ready session resumed from its last Snapshot");
                let events = &context.events;
                events.publish(
                    run,
                    EventType::Warning,
                    WORKER_LOST_REASON,
                    RECOVER,
                    &message,
                );
            }
            return Ok(action);
        }
        // A Ready session's workspace lived on that worker: never moved, never retried.
        let kept = workspace_note(run, namespace, context).await;
        let status = updated.status.get_or_insert_with(Default::default);
        status.phase = Some(Phase::Failed);
        status.reason = Some(WORKER_LOST_REASON.to_string());
        status.message = Some(kruntimes_api::lifecycle::bounded_message(&format!(
            "{gone}; a Ready session is never moved to another worker{kept}"
        )));
        status.completion_time = Some(now_rfc3339());
        leave_ready(&run.spec, status, WORKER_LOST_REASON, &gone, generation);
        let (action, written) = write_status(api, &updated, namespace).await?;
        if written {
            info!(run = %name, namespace, "worker lost; Ready session failed");
            let note = format!("{gone}; the Ready session failed (it never moves)");
            let events = &context.events;
            events.publish(run, EventType::Warning, WORKER_LOST_REASON, RECOVER, &note);
        }
        return Ok(action);
    }
    // Retried or failed, a function or session leaves Ready too (Ready=False/WorkerLost:
    // record_infrastructure_failure sets it).
    let status = updated.status.get_or_insert_with(Default::default);
    let decision =
        record_infrastructure_failure(&run.spec, status, WORKER_LOST_REASON, &gone, generation);
    let (action, written) = write_status(api, &updated, namespace).await?;
    let events = &context.events;
    match (written, decision) {
        (false, _) => {}
        (true, AfterFailure::Retry { next_attempt }) => {
            info!(run = %name, namespace, next_attempt, "worker lost; Run retried");
            let note = format!("{gone}; the attempt ended");
            events.publish(run, EventType::Warning, WORKER_LOST_REASON, RECOVER, &note);
            let note = format!("attempt {next_attempt} waits for a worker");
            events.publish(run, EventType::Normal, RETRYING, RECOVER, &note);
        }
        (true, AfterFailure::Exhausted) => {
            info!(run = %name, namespace, "worker lost; no attempt left, Run failed");
            let note = format!("{gone}; no attempt left, the Run failed");
            events.publish(run, EventType::Warning, WORKER_LOST_REASON, RECOVER, &note);
        }
    }
    Ok(action)
}

/// [`crate::workspaces::promote_suspend`], its API error as the reconcile's (tried again);
/// `false`: not done yet, look again soon.
async fn promote(run: &Run, namespace: &str, context: &Context) -> Result<bool, Error> {
    crate::workspaces::promote_suspend(&context.client, run)
        .await
        .map_err(|source| Error::List {
            what: "workspaces",
            namespace: namespace.to_string(),
            source,
        })
}

/// What a session with a Workspace that lost its worker leaves behind, for its message: the
/// worker could not commit, so the Workspace keeps the head it had (empty when the Workspace
/// cannot be read: the message then says so).
async fn workspace_note(run: &Run, namespace: &str, context: &Context) -> String {
    let Some(reference) = &run.spec.workspace else {
        return String::new();
    };
    let api = Api::<kruntimes_api::Workspace>::namespaced(context.client.clone(), namespace);
    match api.get_opt(&reference.name).await {
        Ok(Some(workspace)) => {
            let status = workspace.status.unwrap_or_default();
            match (status.head, status.head_run) {
                (Some(head), Some(by)) => format!(
                    "; nothing was committed: Workspace {} keeps its head, commit {} of Run {}",
                    reference.name, head.name, by.name
                ),
                (Some(head), None) => format!(
                    "; nothing was committed: Workspace {} keeps its head, commit {}",
                    reference.name, head.name
                ),
                (None, _) => format!(
                    "; nothing was committed: Workspace {} has no commit yet",
                    reference.name
                ),
            }
        }
        Ok(None) => format!(
            "; nothing was committed: Workspace {} does not exist",
            reference.name
        ),
        Err(e) => format!(
            "; nothing was committed to Workspace {} (its head could not be read: {})",
            reference.name,
            kruntimes_api::lifecycle::bounded_message(&e.to_string())
        ),
    }
}

/// Whether `run` is a session its controller resumed from its last Snapshot after losing
/// its worker during its owner's auto-suspend, and nothing changed its spec since: Pending
/// or Scheduled as incarnation N+1 with `status.reason` WorkerLost, its `Suspended=False`
/// condition written for the spec's current generation, `spec.suspend` still true and the
/// `kruntimes.io/auto-suspended` marker naming incarnation N.
fn lost_during_auto_suspend(run: &Run) -> bool {
    let Some(status) = run.status.as_ref() else {
        return false;
    };
    let marker = run
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(kruntimes_api::lifecycle::AUTO_SUSPENDED_ANNOTATION))
        .and_then(|v| v.trim().parse::<i64>().ok());
    let resumed_for_this_spec = status.conditions.iter().any(|c| {
        c.type_ == kruntimes_api::lifecycle::SUSPENDED_CONDITION
            && c.reason.as_deref() == Some(RESUMED_REASON)
            && c.observed_generation == run.metadata.generation
    });
    run.spec.suspend_requested()
        && status.reason.as_deref() == Some(WORKER_LOST_REASON)
        && resumed_for_this_spec
        && marker == Some(run.incarnation() - 1)
}

/// Before a session that lost its worker during its owner's auto-suspend goes back to
/// Suspended ([`lost_during_auto_suspend`]): the marker moves to the new incarnation, so
/// the session stays wakeable ([`kruntimes_api::lifecycle::auto_suspended`] compares the
/// marker with the incarnation; left as it was, the suspend would be taken for the user's
/// and no call would ever wake it). Done here, once the incarnation was raised and no
/// worker owns the Run, so a worker that was only slow and wrote Suspended itself wins the
/// race with the resume, and its marker stays right. Written conditional on the
/// `resourceVersion` read: `None` on a conflict (decide again from the current Run).
/// Returns the Run to write the status on.
async fn carry_auto_suspend_marker(
    api: &Api<Run>,
    run: &Run,
    namespace: &str,
) -> Result<Option<Run>, Error> {
    if !lost_during_auto_suspend(run) {
        return Ok(Some(run.clone()));
    }
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": run.resource_version(),
            "annotations": {
                kruntimes_api::lifecycle::AUTO_SUSPENDED_ANNOTATION: run.incarnation().to_string(),
            },
        }
    });
    let name = run.name_any();
    match api
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(patched) => Ok(Some(patched)),
        Err(error) if is_conflict(&error) || is_not_found(&error) => Ok(None),
        Err(source) => Err(Error::WriteRunStatus {
            namespace: namespace.to_string(),
            name,
            source,
        }),
    }
}

/// The Snapshot a Ready session that lost its worker resumes from instead of failing: only
/// when the Run asks for it (`mode.session.onWorkerLoss: ResumeFromSnapshot`; the default
/// `Fail` keeps design document 001's rule), is Ready (a Finalizing one was ending), and
/// its `status.snapshot` names a Snapshot that is Ready now (read afresh). `None` otherwise:
/// the session fails as before.
async fn resumable_snapshot(
    run: &Run,
    namespace: &str,
    context: &Context,
) -> Result<Option<String>, Error> {
    let asks = run
        .spec
        .mode
        .session
        .as_ref()
        .and_then(|s| s.on_worker_loss)
        == Some(WorkerLossPolicy::ResumeFromSnapshot);
    let Some(reference) = run.status.as_ref().and_then(|s| s.snapshot.as_ref()) else {
        return Ok(None);
    };
    if !asks || run.phase() != Phase::Ready {
        return Ok(None);
    }
    let snapshots = Api::<Snapshot>::namespaced(context.client.clone(), namespace);
    match snapshots.get_opt(&reference.name).await {
        Ok(Some(snapshot)) if snapshot.phase() == SnapshotPhase::Ready => {
            Ok(Some(reference.name.clone()))
        }
        Ok(_) => Ok(None),
        Err(source) => Err(Error::ReadSnapshot {
            namespace: namespace.to_string(),
            name: reference.name.clone(),
            source,
        }),
    }
}

/// A session Run that reached Ready (it is Ready or Finalizing): losing its worker is
/// terminal (design document 001), unless [`resumable_snapshot`] finds one to resume from.
fn session_was_ready(run: &Run) -> bool {
    run.spec.mode.session.is_some() && matches!(run.phase(), Phase::Ready | Phase::Finalizing)
}

/// Writes `updated`'s status with the resourceVersion it was read at, and says whether it
/// was written. A conflict requeues the Run soon; a Run that is gone needs nothing more.
async fn write_status(
    api: &Api<Run>,
    updated: &Run,
    namespace: &str,
) -> Result<(Action, bool), Error> {
    let name = updated.name_any();
    match api
        .replace_status(&name, &PostParams::default(), updated)
        .await
    {
        // The write's own watch event brings the Run back (for its TTL, for example).
        Ok(_) => Ok((Action::await_change(), true)),
        Err(error) if is_conflict(&error) => Ok((Action::requeue(CONFLICT_REQUEUE), false)),
        Err(error) if is_not_found(&error) => Ok((Action::await_change(), false)),
        Err(source) => Err(Error::WriteRunStatus {
            namespace: namespace.to_string(),
            name,
            source,
        }),
    }
}

async fn cancel(
    api: &Api<Run>,
    run: &Run,
    namespace: &str,
    events: &Events,
) -> Result<Action, Error> {
    let name = run.name_any();
    let mut updated = run.clone();
    let generation = updated.meta().generation;
    let status = updated.status.get_or_insert_with(Default::default);
    status.phase = Some(Phase::Cancelled);
    status.completion_time = Some(now_rfc3339());
    status.reason = Some(CANCELLED_REASON.to_string());
    let message = if run.phase() == Phase::Suspended {
        "termination was requested while the session was suspended"
    } else {
        "termination was requested before the Run was scheduled"
    };
    status.message = Some(message.to_string());
    leave_ready(&run.spec, status, CANCELLED_REASON, message, generation);
    let (action, written) = write_status(api, &updated, namespace).await?;
    if written {
        info!(run = %name, namespace, "Run cancelled before assignment");
        events.publish(run, EventType::Normal, CANCELLED_REASON, "Cancel", message);
    }
    Ok(action)
}

async fn delete(api: &Api<Run>, run: &Run, namespace: &str) -> Result<Action, Error> {
    let name = run.name_any();
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: run.metadata.uid.clone(),
            resource_version: run.metadata.resource_version.clone(),
        }),
        ..DeleteParams::background()
    };
    match api.delete(&name, &params).await {
        Ok(_) => {
            info!(run = %name, namespace, "Run deleted after its TTL");
            Ok(Action::await_change())
        }
        Err(error) if is_conflict(&error) => Ok(Action::requeue(CONFLICT_REQUEUE)),
        Err(error) if is_not_found(&error) => Ok(Action::await_change()),
        Err(source) => Err(Error::DeleteRun {
            namespace: namespace.to_string(),
            name,
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use kruntimes_api::run::Termination;
    use kruntimes_api::{RunSpec, RunStatus};

    use super::*;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + secs).expect("valid timestamp")
    }

    fn run(phase: Option<Phase>) -> Run {
        let mut run = Run::new("r", RunSpec::task("bash", "main.sh"));
        run.status = phase.map(|phase| RunStatus {
            phase: Some(phase),
            completion_time: Some(at(0).to_string()),
            ..RunStatus::default()
        });
        run
    }

    #[test]
    fn pending_with_termination_is_cancelled_and_nothing_else_is() {
        for phase in Phase::ALL {
            for mode in [TerminationMode::Immediate, TerminationMode::Drain] {
                let mut r = run(Some(phase));
                r.spec.termination = Some(Termination { mode });
                let expected = match phase {
                    Phase::Pending | Phase::Suspended => Decision::Cancel,
                    Phase::Scheduled | Phase::Running | Phase::Ready | Phase::Finalizing => {
                        Decision::CheckWorker
                    }
                    Phase::Succeeded | Phase::Failed | Phase::Timeout | Phase::Cancelled => {
                        Decision::Wait
                    }
                };
                assert_eq!(decide(&r, at(0)), expected, "{phase} {mode:?}");
            }
        }
        let mut no_status = run(None);
        no_status.spec.termination = Some(Termination {
            mode: TerminationMode::Immediate,
        });
        assert_eq!(decide(&no_status, at(0)), Decision::Cancel);
    }

    #[test]
    fn ttl_counts_from_completion_time_for_terminal_phases_only() {
        for phase in Phase::ALL {
            let mut r = run(Some(phase));
            r.spec.ttl_seconds_after_finished = Some(10);
            let (before, after) = (decide(&r, at(4)), decide(&r, at(10)));
            if phase.is_terminal() {
                assert_eq!(before, Decision::RequeueAfter(Duration::from_secs(6)));
                assert_eq!(after, Decision::Delete);
            } else if phase.is_active() {
                assert_eq!(
                    (before, after),
                    (Decision::CheckWorker, Decision::CheckWorker)
                );
            } else {
                assert_eq!((before, after), (Decision::Wait, Decision::Wait), "{phase}");
            }
        }
    }

    #[test]
    fn suspended_sessions_resume_and_resumed_ones_resuspend() {
        let session = |phase: Phase, suspend: Option<bool>, snapshot: bool| {
            let mut r = run(Some(phase));
            r.spec.mode = kruntimes_api::run::RunMode {
                session: Some(Default::default()),
                ..Default::default()
            };
            r.spec.suspend = suspend;
            if let Some(status) = r.status.as_mut() {
                status.snapshot = snapshot.then(|| kruntimes_api::run::RunSnapshotRef {
                    name: "s-1".into(),
                    uri: None,
                    last_sequence: None,
                });
            }
            r
        };
        let cases = [
            (Phase::Suspended, Some(false), true, Decision::Resume),
            (Phase::Suspended, None, true, Decision::Resume),
            (Phase::Suspended, Some(true), true, Decision::Wait),
            (Phase::Pending, Some(true), true, Decision::Resuspend),
            (Phase::Scheduled, Some(true), true, Decision::Resuspend),
            // No snapshot: placed as usual, captured by its worker once Ready.
            (Phase::Pending, Some(true), false, Decision::Wait),
            (Phase::Scheduled, Some(true), false, Decision::CheckWorker),
            // Ready: the owning worker's to capture.
            (Phase::Ready, Some(true), true, Decision::CheckWorker),
        ];
        for (phase, suspend, snapshot, expected) in cases {
            let r = session(phase, suspend, snapshot);
            assert_eq!(
                decide(&r, at(0)),
                expected,
                "{phase} {suspend:?} {snapshot}"
            );
        }
        // A termination request wins over a resume: the Run ends as one with no worker.
        let mut ending = session(Phase::Suspended, Some(false), true);
        ending.spec.termination = Some(Termination {
            mode: TerminationMode::Drain,
        });
        assert_eq!(decide(&ending, at(0)), Decision::Cancel);
    }

    #[test]
    fn ttl_waits_without_ttl_or_completion_time() {
        let r = run(Some(Phase::Succeeded));
        assert_eq!(decide(&r, at(100)), Decision::Wait);
        let mut r = run(Some(Phase::Failed));
        r.spec.ttl_seconds_after_finished = Some(0);
        if let Some(status) = r.status.as_mut() {
            status.completion_time = Some("yesterday".into());
        }
        assert_eq!(decide(&r, at(100)), Decision::Wait);
        if let Some(status) = r.status.as_mut() {
            status.completion_time = Some(at(0).to_string());
        }
        assert_eq!(decide(&r, at(0)), Decision::Delete);
    }

    #[test]
    fn deleting_runs_are_left_alone() {
        let mut r = run(Some(Phase::Succeeded));
        r.spec.ttl_seconds_after_finished = Some(0);
        r.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(0)));
        assert_eq!(decide(&r, at(5)), Decision::Wait);
    }

    #[test]
    fn deleting_runs_with_the_registration_finalizer_are_released_when_orphaned() {
        for phase in Phase::ALL {
            let mut r = run(Some(phase));
            r.metadata.deletion_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(0)));
            r.metadata.finalizers = Some(vec![REGISTRATION_FINALIZER.to_string()]);
            assert_eq!(decide(&r, at(5)), Decision::ReleaseRegistration, "{phase}");
        }
    }
}
