//! Drain on a normal shutdown of the worker (design document 001, "Deletion Cleanup": on a
//! normal Runtime Pod shutdown, runtimed drains its Running, Ready and Finalizing
//! registrations before it exits and removes the registration-cleanup finalizer only after
//! the Pod-local close or unregister succeeded).
//!
//! Once shutdown begins, [`crate::reconcile`] claims nothing more and leaves function and
//! session Runs to this drain; task Runs keep their reconcile, so a program that ends within
//! the grace is reported as usual. Then, bounded by [`DRAIN_GRACE`]:
//!
//! - **Functions and sessions** of this worker (fenced by Pod UID and attempt): stop
//!   accepting, `UnregisterFunction` or `CloseSession` with purge, then write the end with
//!   `Ready=False/WorkerShutdown`: a function, or a session not Ready yet, follows its
//!   `retryPolicy` (back to Pending for the next attempt, else Failed); a Ready or Finalizing
//!   session fails (its workspace was here; a Ready session never moves). Then the finalizer
//!   goes. A close or unregister that failed keeps the finalizer (the controller's recovery
//!   takes over once the Pod is gone).
//! - **Tasks** still running: they get the rest of the grace to finish; then they are
//!   recorded as an infrastructure failure `WorkerShutdown` (retried per `retryPolicy`) and
//!   cancelled.
//!
//! The drain writes status itself (the reconciler is stopping): each write reads the Run
//! from the API, re-checks that it is still this worker's and in the phase drained, and is
//! conditional on that `resourceVersion`; a conflict reads again.

use std::time::{Duration, Instant};

use kruntimes_api::lifecycle::{self, AfterFailure, REGISTRATION_FINALIZER, now_rfc3339};
use kruntimes_api::run::ModeKind;
use kruntimes_api::{Phase, Run, RunStatus};
use kruntimes_proto::runtime::v1 as rs;
use kube::api::PostParams;
use kube::{Resource, ResourceExt};
use tracing::{info, warn};

use crate::executions::Key;
use crate::reconcile::Context;

/// How long the drain may take in all. The local provisioner sends SIGKILL 10 s after
/// SIGTERM (`LocalConfig::grace`); a Pod's default `terminationGracePeriodSeconds` is 30 s.
pub const DRAIN_GRACE: Duration = Duration::from_secs(8);
/// The reason written on what a shutdown of the worker ended.
pub const SHUTDOWN_REASON: &str = "WorkerShutdown";
/// Conflicting writes retried per Run before the drain gives up on it.
const WRITE_TRIES: usize = 5;

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
        attempt: u32::try_from(lifecycle::attempt(Some(status))).unwrap_or(1),
    })
}

/// Whether the drain handles `run` now, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drained {
    Function,
    Session,
    Task,
}

fn drained(run: &Run) -> Option<Drained> {
    let active = match run.phase() {
        Phase::Running | Phase::Ready | Phase::Finalizing => true,
        Phase::Pending
        | Phase::Scheduled
        | Phase::Succeeded
        | Phase::Failed
        | Phase::Timeout
        | Phase::Cancelled => false,
    };
    if !active || run.metadata.deletion_timestamp.is_some() {
        return None;
    }
    match run.spec.mode.kind()? {
        ModeKind::Function => Some(Drained::Function),
        ModeKind::Session => Some(Drained::Session),
        ModeKind::Task => Some(Drained::Task),
    }
}

/// Drains this worker (see the module documentation). Never fails: what it cannot finish
/// within the grace is left to the controller's recovery of the worker.
pub async fn drain(context: &Context) {
    let started = Instant::now();
    let runs = context.assigned_runs();
    let mut registrations = 0usize;
    for run in &runs {
        let Some(key) = own_key(context, run) else {
            continue;
        };
        match drained(run) {
            Some(Drained::Function) => {
                registrations += 1;
                if let Err(error) = crate::functions::unregister(context, &key).await {
                    warn!(run = %run.name_any(), error = %error, "drain: UnregisterFunction failed; the finalizer stays");
                    continue;
                }
                end_registration(context, run, &key, false).await;
            }
            Some(Drained::Session) => {
                registrations += 1;
                if let Err(error) =
                    crate::sessions::close(context, &key, "the worker shuts down", true).await
                {
                    warn!(run = %run.name_any(), error = %error, "drain: CloseSession failed; the finalizer stays");
                    continue;
                }
                end_registration(context, run, &key, true).await;
            }
            Some(Drained::Task) | None => {}
        }
    }
    // Tasks: the rest of the grace to finish (their reconcile writes the end).
    let deadline = started + DRAIN_GRACE;
    loop {
        let running: Vec<_> = context
            .assigned_runs()
            .into_iter()
            .filter(|run| drained(run) == Some(Drained::Task) && own_key(context, run).is_some())
            .collect();
        if running.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            for run in running {
                if let Some(key) = own_key(context, &run) {
                    end_task(context, &run, &key).await;
                }
            }
            break;
        }
        // The store offers no change notification: look again shortly, within the grace.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    info!(
        registrations,
        elapsed_ms = started.elapsed().as_millis(),
        "runtimed drained"
    );
}

/// Writes how a drained function or session ends (`session`: a session Run), then removes
/// the finalizer.
async fn end_registration(context: &Context, run: &Run, key: &Key, session: bool) {
    let message = "the worker shut down; its registration was closed";
    let written = write(context, run, key, |current, status, generation| {
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
    let Some(written) = written else { return };
    let finalizers: Vec<String> = written
        .finalizers()
        .iter()
        .filter(|f| *f != REGISTRATION_FINALIZER)
        .cloned()
        .collect();
    if finalizers.len() == written.finalizers().len() {
        return;
    }
    match crate::functions::patch_finalizers(&written, context, finalizers).await {
        Ok(Some(_)) => {
            info!(run = %run.name_any(), phase = %written.phase(), "drain: registration closed, end written, finalizer removed")
        }
        Ok(None) => {
            warn!(run = %run.name_any(), "drain: the Run changed before its finalizer was removed")
        }
        Err(error) => {
            warn!(run = %run.name_any(), error = %error, "drain: removing the finalizer failed")
        }
    }
}

/// A task still running when the grace is over: record an infrastructure failure (retried
/// per `retryPolicy`), then cancel it. Written first, so that the Cancelled end the waiter
/// then records finds the Run no longer Running and writes nothing.
async fn end_task(context: &Context, run: &Run, key: &Key) {
    let message = "the worker shut down before the program ended";
    write(context, run, key, |current, status, generation| {
        lifecycle::record_infrastructure_failure(
            &current.spec,
            status,
            SHUTDOWN_REASON,
            message,
            generation,
        );
    })
    .await;
    if context.executions.mark_cancelled(key)
        && let Err(status) = context
            .task
            .clone()
            .cancel(rs::CancelRequest { id: Some(key.id()) })
            .await
    {
        warn!(run = %run.name_any(), error = %status, "drain: Cancel failed");
    }
}

/// Reads the Run, re-checks that it is still this attempt on this worker and active,
/// applies `change` to its status and writes it, conditional on what was read. The Run as
/// written, or `None` when it is no longer this worker's to end (or the writes failed).
async fn write(
    context: &Context,
    run: &Run,
    key: &Key,
    change: impl Fn(&Run, &mut RunStatus, Option<i64>),
) -> Option<Run> {
    let api = context.api();
    let name = run.name_any();
    for _ in 0..WRITE_TRIES {
        let current = match api.get_opt(&name).await {
            Ok(Some(current)) => current,
            Ok(None) => return None,
            Err(error) => {
                warn!(run = %name, error = %error, "drain: reading the Run failed");
                return None;
            }
        };
        if own_key(context, &current).as_ref() != Some(key) || drained(&current).is_none() {
            return None;
        }
        let mut updated = current.clone();
        let generation = updated.meta().generation;
        change(
            &current,
            updated.status.get_or_insert_with(RunStatus::default),
            generation,
        );
        match api
            .replace_status(&name, &PostParams::default(), &updated)
            .await
        {
            Ok(written) => return Some(written),
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(kube::Error::Api(status)) if status.code == 404 => return None,
            Err(error) => {
                warn!(run = %name, error = %error, "drain: writing the end failed");
                return None;
            }
        }
    }
    warn!(run = %name, "drain: the Run kept changing; its end is left to the recovery");
    None
}
