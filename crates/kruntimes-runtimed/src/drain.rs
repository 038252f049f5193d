//! Drain on a normal shutdown of the worker (design document 001, "Deletion Cleanup": on a
//! normal Runtime Pod shutdown, runtimed drains its Running, Ready and Finalizing
//! registrations before it exits and removes the registration-cleanup finalizer only after
//! the Pod-local close or unregister succeeded).
//!
//! The whole drain, and each of its steps, is bounded by one deadline ([`DRAIN_GRACE`] from
//! the start of the shutdown; with [`STOP_GRACE`] for what follows it, runtimed exits within
//! [`EXIT_GRACE`], inside the local provisioner's 10 s between SIGTERM and SIGKILL and a
//! Pod's default `terminationGracePeriodSeconds` of 30 s). In order:
//!
//! 1. **No claim in flight.** The claim gate closes ([`crate::claims`]) and the drain waits
//!    for every claim or registration already past it, so what it reads next is all this
//!    worker holds, and nothing is claimed or registered after that read. It waits at most
//!    half of its time ([`CLAIM_WAIT_SHARE`]); a Run whose claim is still in flight then is
//!    left alone (it would race with the drain) and reported.
//! 2. **A fresh read** of the Runs assigned to this Pod (a list from the API; the cache only
//!    if the list fails), fenced by Pod UID and attempt.
//! 3. **Concurrently** (at most [`CONCURRENCY`] at once), while tasks run on:
//!    - **Functions and sessions** (Running, Ready, Finalizing): stop accepting,
//!      `UnregisterFunction` or `CloseSession` with purge (each call bounded by what is left
//!      of the deadline), then remove the finalizer, then write the end with
//!      `Ready=False/WorkerShutdown`: a function goes back to Pending to register on the
//!      next ready worker (`WorkerRestarted`: the attempt advances, fencing the old
//!      registration, but no retry is consumed, `status.workerRestarts`); a session not
//!      Ready yet follows its `retryPolicy` (back to Pending for the next attempt, else
//!      Failed); a Ready
//!      session is first suspended ([`crate::sessions::suspend_for_shutdown`]: its files go
//!      to a Snapshot, the Run is written Suspended with `spec.suspend` untouched, so the
//!      controller resumes it on the next ready worker), and only when that cannot finish
//!      [`SUSPEND_RESERVE`] before the deadline (or there is no snapshot store) does it
//!      fail as a Finalizing session does (its workspace was here). A
//!      close or unregister that failed keeps the finalizer and writes nothing: the
//!      controller's recovery takes over once the Pod is gone.
//!    - **Sessions that idle expiry ended** (`Timeout/IdleTimeout`) whose Workspace commit
//!      is still to be made here (it failed and waits for its retry, and the session is
//!      held here or by the runtime server) are committed, leaving the close its time, then
//!      closed and purged: their files would go with the worker. Their Run has ended
//!      already; nothing is written.
//!    - **Scheduled Runs** never claimed here are handed back: Pending, unassigned, the
//!      same attempt (nothing of it ran), `Scheduled=False/WorkerShutdown`.
//!    - **Tasks** still running get until [`TASK_RESERVE`] before the deadline to finish
//!      (their reconcile writes the end as usual); then each is recorded as the
//!      infrastructure failure `WorkerShutdown` (retried per `retryPolicy`) and, once that
//!      is written, cancelled.
//!
//! What the drain could not finish is named in its [`DrainReport`] and logged; the
//! controller's stale-worker recovery ends it (`WorkerLost`) once the Pod is gone, as after a
//! hard loss. The drain writes status itself (the reconciler claims nothing any more): each
//! write reads the Run from the API, re-checks that it is still this worker's attempt and in
//! the phase drained, and is conditional on that `resourceVersion`; a conflict reads again.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use kruntimes_api::lifecycle::{
    self, AfterFailure, REGISTRATION_FINALIZER, SCHEDULED_CONDITION, now_rfc3339, set_condition,
};
use kruntimes_api::run::{ModeKind, RunCondition};
use kruntimes_api::{Phase, Run, RunStatus};
use kruntimes_proto::runtime::v1 as rs;
use kube::api::{ListParams, PostParams};
use kube::{Resource, ResourceExt};
use tokio::time::{Instant, timeout_at};
use tracing::{info, warn};

use crate::reconcile::Context;
use crate::sessions::workspaces::Ended;
use crate::tasks::executions::Key;

/// How long the drain may take in all, from the start of the shutdown.
pub const DRAIN_GRACE: Duration = Duration::from_secs(8);
/// What runtimed allows itself after the drain (the reconciler and the gRPC server stop).
pub const STOP_GRACE: Duration = Duration::from_secs(1);
/// From SIGTERM (or stdin closing) to exit, at most: inside the local provisioner's grace
/// before SIGKILL (`LocalConfig::grace`, 10 s; a test of the `kruntimes` crate checks it).
pub const EXIT_GRACE: Duration = Duration::from_secs(DRAIN_GRACE.as_secs() + STOP_GRACE.as_secs());
/// How long before the deadline running tasks are ended (their write and Cancel).
pub const TASK_RESERVE: Duration = Duration::from_secs(1);
/// The longest SIGTERM→SIGKILL grace a drained session's processes get.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// The share of the drain's time it waits for claims in flight (one in this many).
pub const CLAIM_WAIT_SHARE: u32 = 2;
/// Runs drained at once.
const CONCURRENCY: usize = 16;
/// The reason written on what a shutdown of the worker ended.
pub const SHUTDOWN_REASON: &str = "WorkerShutdown";
/// What a Ready session's suspend leaves of the drain's time for closing it as before, when
/// the suspend cannot finish.
const SUSPEND_RESERVE: Duration = Duration::from_secs(2);
/// Conflicting writes retried per Run before the drain gives up on it.
const WRITE_TRIES: usize = 5;

/// A point of the drain where a test may pause it. A seam for the interleaving tests (a
/// close that hangs, a write that keeps conflicting); production passes no hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DrainPoint {
    /// Before the unregister or close of the Run named.
    Closing(String),
    /// Before a status write of the Run named, after the read it is conditional on.
    Writing(String),
}

/// What a test injects at each [`DrainPoint`] (see [`drain_until`]).
pub type DrainHook = Arc<dyn Fn(DrainPoint) -> BoxFuture<'static, ()> + Send + Sync>;

/// What a drain did, by Run name.
#[derive(Debug, Default, Clone)]
pub struct DrainReport {
    /// Functions and sessions closed or unregistered, finalizer removed, end written.
    pub drained: Vec<String>,
    /// Tasks still running at the end, recorded `WorkerShutdown` and then cancelled.
    pub tasks_ended: Vec<String>,
    /// Scheduled Runs never claimed here, handed back to Pending.
    pub handed_back: Vec<String>,
    /// Ready sessions suspended to a Snapshot, resumed on the next ready worker.
    pub suspended: Vec<String>,
    /// Ready sessions that could not be suspended, and why: closed and ended as in
    /// `drained` (where they are named too).
    pub not_suspended: Vec<(String, String)>,
    /// What was left undrained, and why: the controller's recovery ends it.
    pub left: Vec<(String, String)>,
    /// Runs whose claim or registration was still in flight when the drain stopped waiting
    /// for it (also in `left`).
    pub claims_in_flight: Vec<String>,
}

/// The attempt of `run` if it is this worker's (fenced by Pod UID), else `None`.
fn own_key(context: &Context, run: &Run) -> Option<Key> {
    let status = run.status.as_ref()?;
    let own = context.own_uid_now()?;
    if status.assigned_pod.as_deref() != Some(context.pod_name.as_str())
        || status.assigned_pod_uid.as_deref() != Some(own.as_str())
    {
        return None;
    }
    Some(Key {
        uid: run.uid()?,
        attempt: crate::tasks::executions::fenced_attempt(Some(status)),
    })
}

/// Whether the drain handles `run` now, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drained {
    Function,
    Session,
    Task,
    /// Assigned here, never claimed.
    Unclaimed,
    /// A session that idle expiry ended, its commit still to be made here.
    IdleCommit,
}

fn drained(run: &Run) -> Option<Drained> {
    if run.metadata.deletion_timestamp.is_some() {
        return None;
    }
    match run.phase() {
        Phase::Running | Phase::Ready | Phase::Finalizing => {}
        Phase::Scheduled => return Some(Drained::Unclaimed),
        Phase::Timeout if crate::sessions::awaits_idle_commit(run) => {
            return Some(Drained::IdleCommit);
        }
        // Not placed (a Suspended session's files are in its Snapshot), or ended.
        Phase::Pending
        | Phase::Suspended
        | Phase::Succeeded
        | Phase::Failed
        | Phase::Timeout
        | Phase::Cancelled => {
            return None;
        }
    }
    match run.spec.mode.kind()? {
        ModeKind::Function => Some(Drained::Function),
        ModeKind::Session => Some(Drained::Session),
        ModeKind::Task => Some(Drained::Task),
    }
}

/// How one Run's drain ended.
enum Step {
    Drained(String),
    Suspended(String),
    /// A Ready session closed and ended as before, as it could not be suspended, and why.
    NotSuspended(String, String),
    HandedBack(String),
    TaskEnded(String),
    /// Nothing to do any more (another writer ended it, or it left this worker).
    Gone,
    Left(String, String),
}

/// Drains this worker within [`DRAIN_GRACE`] (see the module documentation).
pub async fn drain(context: &Context) -> DrainReport {
    drain_until(context, Instant::now() + DRAIN_GRACE, None).await
}

/// Drains this worker by `deadline`. Never fails: what it cannot finish is in the report,
/// left to the controller's recovery of the worker. `hook` is the test seam of
/// [`DrainPoint`]; production passes `None`.
pub async fn drain_until(
    context: &Context,
    deadline: Instant,
    hook: Option<&DrainHook>,
) -> DrainReport {
    let started = Instant::now();
    let claims_until = started + deadline.saturating_duration_since(started) / CLAIM_WAIT_SHARE;
    let in_flight = context.claims.close_and_wait(claims_until).await;
    let mut report = DrainReport {
        left: in_flight
            .iter()
            .map(|name| {
                (
                    name.clone(),
                    "its claim or registration was still in flight".to_string(),
                )
            })
            .collect(),
        claims_in_flight: in_flight,
        ..DrainReport::default()
    };
    let runs: Vec<Run> = current_runs(context, deadline)
        .await
        .into_iter()
        .filter(|run| !report.claims_in_flight.contains(&run.name_any()))
        .collect();
    let (registrations, tasks) = tokio::join!(
        drain_registrations(context, &runs, deadline, hook),
        drain_tasks(context, deadline, &report.claims_in_flight, hook),
    );
    for step in registrations.into_iter().chain(tasks) {
        match step {
            Step::Drained(name) => report.drained.push(name),
            Step::Suspended(name) => report.suspended.push(name),
            Step::NotSuspended(name, why) => {
                report.drained.push(name.clone());
                report.not_suspended.push((name, why));
            }
            Step::HandedBack(name) => report.handed_back.push(name),
            Step::TaskEnded(name) => report.tasks_ended.push(name),
            Step::Gone => {}
            Step::Left(name, why) => report.left.push((name, why)),
        }
    }
    if !report.left.is_empty() {
        warn!(left = ?report.left, "drain: left undrained (the controller's recovery ends them once the Pod is gone)");
    }
    info!(
        drained = ?report.drained,
        suspended = ?report.suspended,
        not_suspended = ?report.not_suspended,
        tasks_ended = ?report.tasks_ended,
        handed_back = ?report.handed_back,
        left = report.left.len(),
        elapsed_ms = started.elapsed().as_millis(),
        "runtimed drained"
    );
    report
}

/// What is left of the time until `deadline` (at least a millisecond, for a call timeout).
fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// The Runs assigned to this Pod now, read from the API (the cache may lag behind a claim
/// that just completed); the cache when the list fails.
async fn current_runs(context: &Context, deadline: Instant) -> Vec<Run> {
    let params = ListParams::default().fields(&format!("status.assignedPod={}", context.pod_name));
    let api = context.api();
    match timeout_at(deadline, kruntimes_api::paging::list_all(&api, &params)).await {
        Ok(Ok(list)) => list,
        Ok(Err(error)) => {
            warn!(error = %error, "drain: listing the Runs failed; draining what the cache holds");
            cached(context)
        }
        Err(_) => {
            warn!("drain: listing the Runs timed out; draining what the cache holds");
            cached(context)
        }
    }
}

fn cached(context: &Context) -> Vec<Run> {
    context
        .assigned_runs()
        .into_iter()
        .map(|run| (*run).clone())
        .collect()
}

/// Every function, session and unclaimed Run of this worker in `runs`, concurrently.
async fn drain_registrations(
    context: &Context,
    runs: &[Run],
    deadline: Instant,
    hook: Option<&DrainHook>,
) -> Vec<Step> {
    let mut work: Vec<(&Run, Key, Drained)> = runs
        .iter()
        .filter_map(|run| {
            let key = own_key(context, run)?;
            match drained(run)? {
                Drained::Task => None,
                kind => Some((run, key, kind)),
            }
        })
        .collect();
    // Of the sessions idle expiry ended, only those still held here have a commit to make
    // (the others were committed and closed when they ended).
    if work.iter().any(|(_, _, kind)| *kind == Drained::IdleCommit) {
        // Bounded by a share of the time, so the rest of the drain still has its time.
        let list_until = Instant::now() + left(deadline) / CLAIM_WAIT_SHARE;
        let listed = timeout_at(list_until, crate::sessions::list(context))
            .await
            .ok()
            .flatten()
            .unwrap_or_default();
        work.retain(|(_, key, kind)| {
            *kind != Drained::IdleCommit
                || context
                    .sessions
                    .get(&key.uid)
                    .is_some_and(|s| s.fenced == key.attempt)
                || listed.iter().any(|s| {
                    s.id.as_ref()
                        .is_some_and(|id| id.run_uid == key.uid && id.attempt == key.attempt)
                })
        });
    }
    // The futures are made first, so the stream holds futures, not a closure over borrows.
    let steps: Vec<_> = work
        .into_iter()
        .map(|(run, key, kind)| drain_one(context, run, key, kind, deadline, hook))
        .collect();
    futures::stream::iter(steps)
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await
}

/// One function, session or unclaimed Run, bounded by the deadline.
async fn drain_one(
    context: &Context,
    run: &Run,
    key: Key,
    kind: Drained,
    deadline: Instant,
    hook: Option<&DrainHook>,
) -> Step {
    let step = async {
        match kind {
            Drained::Unclaimed => hand_back(context, run, &key, deadline, hook).await,
            Drained::IdleCommit => commit_idle(context, run, &key, deadline).await,
            _ => {
                let session = kind == Drained::Session;
                drain_registration(context, run, &key, session, deadline, hook).await
            }
        }
    };
    match timeout_at(deadline, step).await {
        Ok(step) => step,
        Err(_) => Step::Left(run.name_any(), "the drain's deadline passed".to_string()),
    }
}

/// Closes or unregisters one function or session, removes its finalizer, writes its end.
async fn drain_registration(
    context: &Context,
    run: &Run,
    key: &Key,
    session: bool,
    deadline: Instant,
    hook: Option<&DrainHook>,
) -> Step {
    let name = run.name_any();
    let mut not_suspended = None;
    if session && run.phase() == Phase::Ready && run.spec.termination.is_none() {
        // Suspend it rather than end it, leaving time to close it as before if that fails.
        let until = deadline
            .checked_sub(SUSPEND_RESERVE)
            .filter(|until| *until > Instant::now())
            .unwrap_or(deadline);
        match timeout_at(
            until,
            crate::sessions::suspend_for_shutdown(context, run, key),
        )
        .await
        {
            Ok(Ok(true)) => return Step::Suspended(name),
            Ok(Ok(false)) => {
                not_suspended = Some(
                    "no snapshot store, or no state of the session on this worker".to_string(),
                );
            }
            Ok(Err(why)) => {
                warn!(run = %name, error = %why, "drain: the session could not be suspended; it is closed and ends");
                not_suspended = Some(why);
            }
            Err(_) => {
                warn!(run = %name, "drain: suspending the session took too long; it is closed and ends");
                not_suspended = Some("its suspend did not finish in time".to_string());
            }
        }
    }
    match (
        close_and_end(context, run, key, session, deadline, hook).await,
        not_suspended,
    ) {
        (Step::Drained(name), Some(why)) => Step::NotSuspended(name, why),
        (step, _) => step,
    }
}

/// A session that idle expiry ended, its commit still to be made: committed (leaving the
/// close its time), then closed and purged, committed or not (its workspace goes with the
/// worker). Nothing is written: the Run has ended.
async fn commit_idle(context: &Context, run: &Run, key: &Key, deadline: Instant) -> Step {
    let name = run.name_any();
    let committed = commit_before_close(context, run, key, deadline).await;
    let grace = CLOSE_GRACE.min(left(deadline) / 2);
    let closed =
        crate::sessions::close_within(context, key, "the worker shuts down", grace, left(deadline))
            .await;
    match (committed, closed) {
        (Some(ended), Ok(())) => {
            match ended {
                Ended::Committed => {
                    info!(run = %name, "drain: the session idle expiry ended was committed and closed");
                }
                Ended::Nothing => {
                    info!(run = %name, "drain: the session idle expiry ended was closed; nothing of it was left to commit here");
                }
            }
            Step::Drained(name)
        }
        (None, _) => {
            warn!(run = %name, "drain: the Workspace of a session idle expiry ended was not committed; its head stays");
            Step::Left(
                name,
                "its Workspace commit was not made before the shutdown; its head stays".to_string(),
            )
        }
        (Some(_), Err(error)) => Step::Left(name, format!("the close failed: {error}")),
    }
}

/// Commits a session with a Workspace before it is closed, leaving the close its time
/// ([`SUSPEND_RESERVE`]): with less than that left, it is not tried. `None`: the commit
/// was not made.
async fn commit_before_close(
    context: &Context,
    run: &Run,
    key: &Key,
    deadline: Instant,
) -> Option<Ended> {
    let until = deadline
        .checked_sub(SUSPEND_RESERVE)
        .filter(|until| *until > Instant::now())?;
    timeout_at(
        until,
        crate::sessions::workspaces::commit_for_shutdown(context, run, key, until),
    )
    .await
    .ok()
    .flatten()
}

/// Closes or unregisters, removes the finalizer, writes the end.
async fn close_and_end(
    context: &Context,
    run: &Run,
    key: &Key,
    session: bool,
    deadline: Instant,
    hook: Option<&DrainHook>,
) -> Step {
    let name = run.name_any();
    if let Some(hook) = hook {
        hook(DrainPoint::Closing(name.clone())).await;
    }
    if session && run.spec.workspace.is_some() {
        let committed = commit_before_close(context, run, key, deadline).await;
        if committed.is_none() {
            warn!(run = %name, "drain: the session's Workspace was not committed; its head stays");
        }
    }
    let closed = if session {
        let grace = CLOSE_GRACE.min(left(deadline) / 2);
        crate::sessions::close_within(context, key, "the worker shuts down", grace, left(deadline))
            .await
    } else {
        crate::functions::unregister_within(context, key, Some(left(deadline))).await
    };
    if let Err(error) = closed {
        warn!(run = %name, error = %error, "drain: the close failed; the finalizer stays");
        return Step::Left(name, format!("the close failed: {error}"));
    }
    // The registration is gone: the finalizer may go, before the end is written (once the
    // Run is back to Pending, the scheduler may place it on another worker, whose
    // registration the finalizer then guards).
    if let Err(why) = remove_finalizer(context, run, key).await {
        return Step::Left(name, why);
    }
    let message = "the worker shut down; its registration was closed";
    let written = write(context, run, key, hook, |current, status, generation| {
        let was_ready = matches!(current.phase(), Phase::Ready | Phase::Finalizing);
        if session && was_ready {
            // Its workspace was here: a Ready session is never moved.
            status.phase = Some(Phase::Failed);
            status.reason = Some(SHUTDOWN_REASON.to_string());
            status.message = Some(format!(
                "{message}; a Ready session is never moved to another worker"
            ));
            status.completion_time = Some(now_rfc3339());
            lifecycle::leave_ready(&current.spec, status, SHUTDOWN_REASON, message, generation);
        } else if !session {
            // Nothing of a function stays here: it registers again on the next ready
            // worker, and its retries are left for real failures.
            lifecycle::record_worker_restart(&current.spec, status, message, generation);
            info!(run = %current.name_any(), attempt = ?status.attempt, "drain: function re-registers elsewhere (WorkerRestarted)");
        } else {
            let decision = lifecycle::record_infrastructure_failure(
                &current.spec,
                status,
                SHUTDOWN_REASON,
                message,
                generation,
            );
            if let AfterFailure::Retry { next_attempt } = decision {
                info!(run = %current.name_any(), next_attempt, "drain: Run retried");
            }
        }
    })
    .await;
    match written {
        Ok(Some(written)) => {
            info!(run = %name, phase = %written.phase(), "drain: registration closed, finalizer removed, end written");
            Step::Drained(name)
        }
        Ok(None) => Step::Gone,
        Err(why) => Step::Left(name, why),
    }
}

/// Removes the registration-cleanup finalizer while the Run is still this attempt on this
/// worker (conditional on what was read; a conflict reads again).
async fn remove_finalizer(context: &Context, run: &Run, key: &Key) -> Result<(), String> {
    let api = context.api();
    let name = run.name_any();
    let mut current = run.clone();
    for _ in 0..WRITE_TRIES {
        if own_key(context, &current).as_ref() != Some(key) {
            return Ok(());
        }
        let finalizers: Vec<String> = current
            .finalizers()
            .iter()
            .filter(|f| *f != REGISTRATION_FINALIZER)
            .cloned()
            .collect();
        if finalizers.len() == current.finalizers().len() {
            return Ok(());
        }
        match crate::functions::patch_finalizers(&current, context, finalizers).await {
            Ok(Some(_)) => return Ok(()),
            Ok(None) => {}
            Err(error) => return Err(format!("removing the finalizer failed: {error}")),
        }
        current = match api.get_opt(&name).await {
            Ok(Some(current)) => current,
            Ok(None) => return Ok(()),
            Err(error) => return Err(format!("reading the Run failed: {error}")),
        };
    }
    Err("the Run kept changing before its finalizer was removed".to_string())
}

/// A Run assigned here and never claimed: back to Pending for another worker, with the same
/// attempt (nothing of it ran here). What a claim that lost its write may have registered
/// for it here is closed first.
async fn hand_back(
    context: &Context,
    run: &Run,
    key: &Key,
    deadline: Instant,
    hook: Option<&DrainHook>,
) -> Step {
    let name = run.name_any();
    let closed = match run.spec.mode.kind() {
        Some(ModeKind::Function) if context.registrations.get(&key.uid).is_some() => {
            crate::functions::unregister_within(context, key, Some(left(deadline))).await
        }
        Some(ModeKind::Session) if context.sessions.get(&key.uid).is_some() => {
            let grace = CLOSE_GRACE.min(left(deadline) / 2);
            crate::sessions::close_within(
                context,
                key,
                "the worker shuts down",
                grace,
                left(deadline),
            )
            .await
        }
        _ => Ok(()),
    };
    if let Err(error) = closed {
        return Step::Left(name, format!("the close failed: {error}"));
    }
    let written = write(context, run, key, hook, |current, status, generation| {
        if current.phase() != Phase::Scheduled {
            return;
        }
        status.phase = Some(Phase::Pending);
        status.assigned_pod = None;
        status.assigned_pod_uid = None;
        status.reason = Some(SHUTDOWN_REASON.to_string());
        status.message = Some(
            "the worker shut down before it claimed the Run; it waits for another worker"
                .to_string(),
        );
        set_condition(
            &mut status.conditions,
            RunCondition {
                type_: SCHEDULED_CONDITION.to_string(),
                status: "False".to_string(),
                reason: Some(SHUTDOWN_REASON.to_string()),
                message: Some(format!(
                    "worker Pod {} shut down before it claimed the Run",
                    context.pod_name
                )),
                last_transition_time: Some(now_rfc3339()),
                observed_generation: generation,
            },
        );
    })
    .await;
    match written {
        Ok(Some(_)) => {
            info!(run = %name, "drain: an unclaimed Run handed back");
            Step::HandedBack(name)
        }
        Ok(None) => Step::Gone,
        Err(why) => Step::Left(name, why),
    }
}

/// Tasks: until [`TASK_RESERVE`] before the deadline to finish; then the ones still running
/// are ended, concurrently.
async fn drain_tasks(
    context: &Context,
    deadline: Instant,
    skip: &[String],
    hook: Option<&DrainHook>,
) -> Vec<Step> {
    let end_at = deadline.checked_sub(TASK_RESERVE).unwrap_or(deadline);
    let running = loop {
        let running: Vec<Run> = context
            .assigned_runs()
            .into_iter()
            .filter(|run| drained(run) == Some(Drained::Task) && own_key(context, run).is_some())
            .filter(|run| !skip.contains(&run.name_any()))
            .map(|run| (*run).clone())
            .collect();
        if running.is_empty() || Instant::now() >= end_at {
            break running;
        }
        // The store offers no change notification: look again shortly, within the grace.
        tokio::time::sleep(Duration::from_millis(50).min(left(end_at))).await;
    };
    let steps: Vec<_> = running
        .iter()
        .map(|run| end_task_by(context, run, deadline, hook))
        .collect();
    futures::stream::iter(steps)
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await
}

/// [`end_task`], bounded by the deadline.
async fn end_task_by(
    context: &Context,
    run: &Run,
    deadline: Instant,
    hook: Option<&DrainHook>,
) -> Step {
    let Some(key) = own_key(context, run) else {
        return Step::Gone;
    };
    match timeout_at(deadline, end_task(context, run, &key, hook)).await {
        Ok(step) => step,
        Err(_) => Step::Left(run.name_any(), "the drain's deadline passed".to_string()),
    }
}

/// A task still running when its time is over: record an infrastructure failure (retried
/// per `retryPolicy`), then cancel it. Cancelled only once that end is written: the
/// Cancelled end the waiter then records finds the Run no longer Running and writes
/// nothing. A write that failed cancels nothing (the Run would end Cancelled, not
/// WorkerShutdown); the recovery ends it once the Pod is gone.
async fn end_task(context: &Context, run: &Run, key: &Key, hook: Option<&DrainHook>) -> Step {
    let name = run.name_any();
    let message = "the worker shut down before the program ended";
    let written = write(context, run, key, hook, |current, status, generation| {
        lifecycle::record_infrastructure_failure(
            &current.spec,
            status,
            SHUTDOWN_REASON,
            message,
            generation,
        );
    })
    .await;
    match written {
        Ok(Some(_)) => {}
        Ok(None) => return Step::Gone,
        Err(why) => return Step::Left(name, why),
    }
    if context.executions.mark_cancelled(key)
        && let Err(status) = context
            .task
            .clone()
            .cancel(rs::CancelRequest { id: Some(key.id()) })
            .await
    {
        warn!(run = %name, error = %status, "drain: Cancel failed");
    }
    Step::TaskEnded(name)
}

/// Reads the Run, re-checks that it is still this attempt on this worker and in a phase
/// drained, applies `change` to its status and writes it, conditional on what was read.
/// The Run as written; `None` when it is no longer this worker's to end; an error when the
/// writes failed.
async fn write(
    context: &Context,
    run: &Run,
    key: &Key,
    hook: Option<&DrainHook>,
    change: impl Fn(&Run, &mut RunStatus, Option<i64>),
) -> Result<Option<Run>, String> {
    let api = context.api();
    let name = run.name_any();
    for _ in 0..WRITE_TRIES {
        let current = match api.get_opt(&name).await {
            Ok(Some(current)) => current,
            Ok(None) => return Ok(None),
            Err(error) => return Err(format!("reading the Run failed: {error}")),
        };
        if own_key(context, &current).as_ref() != Some(key) || drained(&current).is_none() {
            return Ok(None);
        }
        let mut updated = current.clone();
        let generation = updated.meta().generation;
        change(
            &current,
            updated.status.get_or_insert_with(RunStatus::default),
            generation,
        );
        if let Some(hook) = hook {
            hook(DrainPoint::Writing(name.clone())).await;
        }
        match api
            .replace_status(&name, &PostParams::default(), &updated)
            .await
        {
            Ok(written) => {
                crate::events::status_written(&context.events, &written);
                return Ok(Some(written));
            }
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(None),
            Err(error) => {
                warn!(run = %name, error = %error, "drain: writing the end failed");
                return Err(format!("writing the end failed: {error}"));
            }
        }
    }
    warn!(run = %name, "drain: the Run kept changing; its end is left to the recovery");
    Err("the Run kept changing; its end was not written".to_string())
}
