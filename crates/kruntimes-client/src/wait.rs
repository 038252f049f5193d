//! Waiting on one Run through a watch (kube-runtime's `await_condition`): until its phase
//! settles, or until it is gone. Nothing here polls. Shared by function Runs and sandboxes,
//! which turn a [`WaitError`] into their own errors.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use kruntimes_api::{Phase, Run};
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::wait::await_condition;

/// Why a wait ended without its condition.
#[derive(Debug)]
pub(crate) enum WaitError {
    /// The limit passed; the Run was last seen in this phase, saying `why` it was not
    /// placed (`REASON: MESSAGE` of its `Scheduled=False`, or empty).
    TimedOut { phase: Phase, why: String },
    /// The Run was deleted (or replaced by another of the same name).
    Deleted,
    /// The watch failed.
    Watch(kube::runtime::wait::Error),
}

/// Watches the Run `name` (whose phase was `first` when the wait began) until `settled`
/// says its phase is final for this wait, at most `limit`; calls `on_update` with every
/// state seen. Returns the Run as it settled.
pub(crate) async fn until_phase(
    api: &Api<Run>,
    name: &str,
    uid: Option<&str>,
    first: Phase,
    limit: Duration,
    on_update: impl Fn(&Run) + Send + Sync,
    settled: impl Fn(Phase) -> bool + Send + Sync,
) -> Result<Run, WaitError> {
    let last = Mutex::new((first, String::new()));
    let condition = |run: Option<&Run>| match run {
        None => true,
        Some(run) if uid.is_some() && run.uid().as_deref() != uid => true,
        Some(run) => {
            on_update(run);
            let phase = run.phase();
            *last.lock().unwrap_or_else(PoisonError::into_inner) = (phase, why_not_placed(run));
            settled(phase)
        }
    };
    let waited = tokio::time::timeout(limit, await_condition(api.clone(), name, condition)).await;
    match waited {
        Err(_elapsed) => {
            let (phase, why) = last.lock().unwrap_or_else(PoisonError::into_inner).clone();
            Err(WaitError::TimedOut { phase, why })
        }
        Ok(Err(source)) => Err(WaitError::Watch(source)),
        Ok(Ok(None)) => Err(WaitError::Deleted),
        Ok(Ok(Some(run))) if uid.is_some() && run.uid().as_deref() != uid => {
            Err(WaitError::Deleted)
        }
        Ok(Ok(Some(run))) => Ok(run),
    }
}

/// Watches the Run `name` with UID `uid` until it no longer exists (or another Run holds
/// the name), at most `limit`.
pub(crate) async fn until_gone(
    api: &Api<Run>,
    name: &str,
    uid: &str,
    limit: Duration,
) -> Result<(), WaitError> {
    let last_phase = Mutex::new(Phase::Pending);
    let condition = |run: Option<&Run>| match run {
        None => true,
        Some(run) => {
            *last_phase.lock().unwrap_or_else(PoisonError::into_inner) = run.phase();
            run.uid().as_deref() != Some(uid)
        }
    };
    match tokio::time::timeout(limit, await_condition(api.clone(), name, condition)).await {
        Err(_elapsed) => Err(WaitError::TimedOut {
            phase: *last_phase.lock().unwrap_or_else(PoisonError::into_inner),
            why: String::new(),
        }),
        Ok(Err(source)) => Err(WaitError::Watch(source)),
        Ok(Ok(_)) => Ok(()),
    }
}

/// `REASON: MESSAGE` of the Run's `Scheduled=False` condition (why the scheduler has not
/// placed it), or empty.
pub(crate) fn why_not_placed(run: &Run) -> String {
    match kruntimes_api::lifecycle::unscheduled_reason(run.status.as_ref()) {
        Some((reason, message)) if !reason.is_empty() => format!("{reason}: {message}"),
        Some(_) | None => String::new(),
    }
}

/// `; WHY` for an error message, or nothing when `why` is empty.
pub(crate) fn why_text(why: &str) -> String {
    if why.is_empty() {
        String::new()
    } else {
        format!("; not placed: {why}")
    }
}

/// Ready, or an ending instead: what waiting for Ready stops at.
pub(crate) fn ready_or_ended(phase: Phase) -> bool {
    match phase {
        Phase::Ready | Phase::Succeeded | Phase::Failed | Phase::Timeout | Phase::Cancelled => true,
        // A Suspended session becomes Ready only through a resume (Pending first).
        Phase::Pending
        | Phase::Scheduled
        | Phase::Running
        | Phase::Finalizing
        | Phase::Suspended => false,
    }
}
