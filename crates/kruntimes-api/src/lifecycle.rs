//! Status transitions shared by the controller-manager and runtimed: conditions in the
//! Kubernetes style, timestamps, and the retry policy for infrastructure failures.
//!
//! Pure functions over [`RunStatus`]; the callers write the result with the
//! `resourceVersion` they read.
//!
//! Retry policy (`spec.retryPolicy`): an infrastructure failure (a lost worker, a broken
//! runtime server, an execution that vanished) ends the current attempt. If attempts remain
//! ([`RetryPolicy::max_attempts`], default 1: no retry unless asked for) the Run goes back to
//! Pending with `attempt` raised by one, its assignment cleared and the condition
//! `Scheduled=False, reason=Backoff`; the scheduler places it again once
//! `backoffSeconds` have passed since that condition's `lastTransitionTime`. Otherwise the
//! Run ends Failed with the failure's reason. What the program itself did (a non-zero exit,
//! invalid outputs, a timeout) is never retried.
//!
//! [`RetryPolicy::max_attempts`]: crate::run::RetryPolicy

use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp, Unit};

use crate::phase::Phase;
use crate::run::{RunCondition, RunSpec, RunStatus};

/// The condition type the scheduler sets when it places a Run.
pub const SCHEDULED_CONDITION: &str = "Scheduled";
/// The reason of `Scheduled=False` while a retried Run waits out its backoff.
pub const BACKOFF_REASON: &str = "Backoff";
/// The reason of `Scheduled=False` on a Run whose Runtime does not exist in its namespace.
/// Decisive for a client that waits: nothing places the Run until someone creates the
/// Runtime.
pub const RUNTIME_NOT_FOUND_REASON: &str = "RuntimeNotFound";
/// The reason of `Scheduled=False` on a Run that waits for a free slot on a ready worker.
pub const NO_CAPACITY_REASON: &str = "NoCapacity";
/// The reason of `Scheduled=False` on a Run that asks for more slots than a worker has.
pub const EXCEEDS_WORKER_CAPACITY_REASON: &str = "ExceedsWorkerCapacity";
/// The reason of `Scheduled=False` on a Run whose Runtime has no ready worker yet.
pub const WAITING_FOR_WORKERS_REASON: &str = "WaitingForWorkers";
/// The reason (and Event reason) of a session the controller-manager ended for idleness.
pub const IDLE_TIMEOUT_REASON: &str = "IdleTimeout";
/// The reason of `Scheduled=False` on a Run taken back from a worker that did not start it
/// within the claim bound; it is placed again.
pub const NOT_CLAIMED_REASON: &str = "NotClaimed";

/// Why a Run that is not placed waits: the reason and message of its `Scheduled=False`
/// condition, if it has one.
pub fn unscheduled_reason(status: Option<&RunStatus>) -> Option<(&str, &str)> {
    let condition = status?
        .conditions
        .iter()
        .find(|c| c.type_ == SCHEDULED_CONDITION && c.status == "False")?;
    Some((
        condition.reason.as_deref().unwrap_or_default(),
        condition.message.as_deref().unwrap_or_default(),
    ))
}
/// Messages written into status are cut to this many bytes.
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// The condition type that says whether a function or session accepts traffic.
pub const READY_CONDITION: &str = "Ready";
/// The finalizer runtimed adds to function and session Runs before it registers them, so
/// that their Pod-local registration is cleaned up before the Run object goes (design
/// document 000, "Cleanup and Finalization").
pub const REGISTRATION_FINALIZER: &str = "kruntimes.io/registration-cleanup";

/// Sets the `Ready` condition: `ready` with a CamelCase `reason` and a bounded message.
pub fn set_ready(
    status: &mut RunStatus,
    ready: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) {
    set_condition(
        &mut status.conditions,
        RunCondition {
            type_: READY_CONDITION.to_string(),
            status: if ready { "True" } else { "False" }.to_string(),
            reason: Some(reason.to_string()),
            message: (!message.is_empty()).then(|| bounded_message(message)),
            last_transition_time: Some(now_rfc3339()),
            observed_generation: generation,
        },
    );
}

/// The `Ready` condition of a status transition that takes a function or session Run out
/// of Ready (to Finalizing, back to Pending for a retry, or to a terminal phase), or that
/// ends it before it was Ready: `Ready=False` with the transition's specific CamelCase
/// `reason` (`WorkerLost`, `Cancelled`, `IdleTimeout`, `LeaseExpired`, `Drained`,
/// `RegistrationLost`, ...) and a bounded message. Every writer of such a transition calls
/// it (runtimed and the controller-manager), so no Run outside Ready says `Ready=True`. A
/// task Run has no Ready condition and gets none. Idempotent: repeating it keeps the
/// condition's `lastTransitionTime`.
pub fn leave_ready(
    spec: &RunSpec,
    status: &mut RunStatus,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) {
    if spec.mode.function.is_none() && spec.mode.session.is_none() {
        return;
    }
    set_ready(status, false, reason, message, generation);
}

/// Whether the Run's `Ready` condition is `True`.
pub fn is_ready(status: Option<&RunStatus>) -> bool {
    status.is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == READY_CONDITION && c.status == "True")
    })
}

/// The invoke URL of a function Run behind the gateway at `gateway` (`https://HOST:PORT`):
/// `GATEWAY/v1/namespaces/NS/runtimes/RUNTIME/functions/UID:invoke`. The immutable UID in
/// the path means a deleted and recreated Run of the same name is never addressed by it.
pub fn function_invoke_url(gateway: &str, namespace: &str, runtime: &str, uid: &str) -> String {
    format!(
        "{}/v1/namespaces/{namespace}/runtimes/{runtime}/functions/{uid}:invoke",
        gateway.trim_end_matches('/')
    )
}

/// The longest session operation ID (docs/session-mode.md, "Operations").
pub const MAX_OPERATION_ID_BYTES: usize = 128;

/// Whether `id` is a session operation ID: 1 to [`MAX_OPERATION_ID_BYTES`] bytes of
/// `[A-Za-z0-9._-]`. The SDK, the gateway, runtimed and the runtime server all check it.
pub fn is_operation_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_OPERATION_ID_BYTES
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The longest session workspace path (docs/session-mode.md, "Files").
pub const MAX_WORKSPACE_PATH_BYTES: usize = 4096;
/// The longest component of a session workspace path.
pub const MAX_WORKSPACE_COMPONENT_BYTES: usize = 255;

/// What is wrong with a session workspace path, or `None` when it is one: '/'-separated,
/// relative, at most [`MAX_WORKSPACE_PATH_BYTES`], no NUL, every component 1 to
/// [`MAX_WORKSPACE_COMPONENT_BYTES`] bytes and neither `.` nor `..`. The empty path (the
/// workspace itself) passes only with `allow_empty`. Lexical only: the runtime server still
/// resolves every path beneath the workspace (symlinks included) and checks these rules
/// itself; the gateway and the SDK check them so that a bad path is a 400 at once.
pub fn workspace_path_problem(path: &str, allow_empty: bool) -> Option<&'static str> {
    if path.is_empty() {
        return (!allow_empty).then_some("is empty");
    }
    if path.len() > MAX_WORKSPACE_PATH_BYTES {
        return Some("is longer than 4096 bytes");
    }
    if path.contains('\0') {
        return Some("contains NUL");
    }
    if path.starts_with('/') {
        return Some("is absolute; paths are relative to the workspace");
    }
    for component in path.split('/') {
        if component.is_empty() {
            return Some("has an empty component (a doubled or trailing '/')");
        }
        if component == "." || component == ".." {
            return Some("has a '.' or '..' component");
        }
        if component.len() > MAX_WORKSPACE_COMPONENT_BYTES {
            return Some("has a component longer than 255 bytes");
        }
    }
    None
}

/// The base URL of a Ready session Run: `{gateway}/v1/namespaces/{ns}/runtimes/{runtime}/sessions/{uid}`
/// (design document 001, "HTTP API"). Status, operations and files hang from it.
pub fn session_url(gateway: &str, namespace: &str, runtime: &str, uid: &str) -> String {
    format!(
        "{}/v1/namespaces/{namespace}/runtimes/{runtime}/sessions/{uid}",
        gateway.trim_end_matches('/')
    )
}

/// Now, as RFC 3339 with microseconds (as `MicroTime` writes it), so that latencies derived
/// from status timestamps stay meaningful below one second.
pub fn now_rfc3339() -> String {
    Timestamp::now()
        .round(Unit::Microsecond)
        .map_or_else(|_| Timestamp::now().to_string(), |t| t.to_string())
}

/// Sets `condition` in `conditions`, replacing one of the same type. `lastTransitionTime`
/// keeps its old value when the condition's status does not change.
pub fn set_condition(conditions: &mut Vec<RunCondition>, mut condition: RunCondition) {
    match conditions.iter_mut().find(|c| c.type_ == condition.type_) {
        Some(existing) => {
            if existing.status == condition.status {
                condition.last_transition_time = existing.last_transition_time.take();
            }
            *existing = condition;
        }
        None => conditions.push(condition),
    }
}

/// `text` cut to at most [`MAX_MESSAGE_BYTES`] on a character boundary.
pub fn bounded_message(text: &str) -> String {
    if text.len() <= MAX_MESSAGE_BYTES {
        return text.to_string();
    }
    let mut end = MAX_MESSAGE_BYTES - 3;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

/// Attempts in all that `spec` allows, the first one included.
pub fn max_attempts(spec: &RunSpec) -> i32 {
    spec.retry_policy
        .as_ref()
        .map_or(1, |p| p.max_attempts.max(1))
}

/// The current attempt of a Run (1 before it is claimed).
pub fn attempt(status: Option<&RunStatus>) -> i32 {
    status.and_then(|s| s.attempt).unwrap_or(1).max(1)
}

/// What an infrastructure failure of the current attempt leads to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterFailure {
    /// Back to Pending as this attempt.
    Retry { next_attempt: i32 },
    /// No attempt left: Failed.
    Exhausted,
}

/// The attempts that ended with a graceful restart of their worker (`status.workerRestarts`):
/// they do not count against `retryPolicy.maxAttempts`.
pub fn worker_restarts(status: Option<&RunStatus>) -> i32 {
    status.and_then(|s| s.worker_restarts).unwrap_or(0).max(0)
}

/// Decides what an infrastructure failure of the Run's current attempt leads to. The
/// attempts its worker's restarts ended ([`record_worker_restart`]) are not counted.
pub fn after_infrastructure_failure(spec: &RunSpec, status: Option<&RunStatus>) -> AfterFailure {
    let current = attempt(status);
    if current.saturating_sub(worker_restarts(status)) < max_attempts(spec) {
        AfterFailure::Retry {
            next_attempt: current + 1,
        }
    } else {
        AfterFailure::Exhausted
    }
}

/// Applies an infrastructure failure to `status`: back to Pending for the next attempt, or
/// Failed when none is left. `reason` is CamelCase (for example `WorkerLost`); `message` is
/// bounded here. Either way a function or session Run leaves Ready: `Ready=False` with
/// `reason` ([`leave_ready`]).
pub fn record_infrastructure_failure(
    spec: &RunSpec,
    status: &mut RunStatus,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) -> AfterFailure {
    let decision = after_infrastructure_failure(spec, Some(status));
    leave_ready(spec, status, reason, message, generation);
    let message = bounded_message(message);
    match &decision {
        AfterFailure::Retry { next_attempt } => {
            status.phase = Some(Phase::Pending);
            status.attempt = Some(*next_attempt);
            status.assigned_pod = None;
            status.assigned_pod_uid = None;
            status.start_time = None;
            status.exit_code = None;
            status.outputs.clear();
            status.reason = Some(reason.to_string());
            status.message = Some(message.clone());
            set_condition(
                &mut status.conditions,
                RunCondition {
                    type_: SCHEDULED_CONDITION.to_string(),
                    status: "False".to_string(),
                    reason: Some(BACKOFF_REASON.to_string()),
                    message: Some(format!(
                        "attempt {} ended ({reason}); attempt {next_attempt} waits for a worker",
                        next_attempt - 1
                    )),
                    last_transition_time: Some(now_rfc3339()),
                    observed_generation: generation,
                },
            );
        }
        AfterFailure::Exhausted => {
            status.phase = Some(Phase::Failed);
            status.reason = Some(reason.to_string());
            status.message = Some(message);
            status.completion_time = Some(now_rfc3339());
        }
    }
    decision
}

/// The reason written on a function Run whose worker shut down gracefully: it registers
/// again on another worker without consuming a retry.
pub const WORKER_RESTARTED_REASON: &str = "WorkerRestarted";

/// Applies a graceful shutdown of the worker to a function Run's `status`: back to Pending
/// for registration on the next ready worker, with no backoff, `Ready=False` and
/// `Scheduled=False` with [`WORKER_RESTARTED_REASON`]. The attempt advances (the fence: a
/// late write of the old registration cannot land) and so does `status.workerRestarts`, so
/// the retries `retryPolicy` allows are left as they were ([`after_infrastructure_failure`]).
pub fn record_worker_restart(
    spec: &RunSpec,
    status: &mut RunStatus,
    message: &str,
    generation: Option<i64>,
) {
    let next_attempt = attempt(Some(status)).saturating_add(1);
    leave_ready(spec, status, WORKER_RESTARTED_REASON, message, generation);
    status.phase = Some(Phase::Pending);
    status.attempt = Some(next_attempt);
    status.worker_restarts = Some(worker_restarts(Some(status)).saturating_add(1));
    status.assigned_pod = None;
    status.assigned_pod_uid = None;
    status.start_time = None;
    status.endpoint = None;
    status.reason = Some(WORKER_RESTARTED_REASON.to_string());
    status.message = Some(bounded_message(message));
    set_condition(
        &mut status.conditions,
        RunCondition {
            type_: SCHEDULED_CONDITION.to_string(),
            status: "False".to_string(),
            reason: Some(WORKER_RESTARTED_REASON.to_string()),
            message: Some(format!(
                "attempt {} ended as its worker shut down; attempt {next_attempt} registers on the next ready worker (no retry consumed)",
                next_attempt - 1
            )),
            last_transition_time: Some(now_rfc3339()),
            observed_generation: generation,
        },
    );
}

/// When a Pending Run may be placed again: `None` when it may be placed now, otherwise the
/// end of its backoff.
pub fn backoff_until(spec: &RunSpec, status: Option<&RunStatus>) -> Option<Timestamp> {
    let seconds = spec.retry_policy.as_ref()?.backoff_seconds?;
    if seconds <= 0 {
        return None;
    }
    let condition = status?.conditions.iter().find(|c| {
        c.type_ == SCHEDULED_CONDITION
            && c.status == "False"
            && c.reason.as_deref() == Some(BACKOFF_REASON)
    })?;
    let since: Timestamp = condition.last_transition_time.as_deref()?.parse().ok()?;
    let until = since
        .checked_add(SignedDuration::from_secs(i64::from(seconds)))
        .ok()?;
    (until > Timestamp::now()).then_some(until)
}

/// The condition type of a session's suspension: `Suspended=True` while it is Suspended
/// (reason [`SUSPENDED_REASON`]), `Suspended=False` once it is resumed (reason
/// [`RESUMED_REASON`]).
pub const SUSPENDED_CONDITION: &str = "Suspended";
/// The reason of `Suspended=True`, and of `Ready=False` while a session is Suspended.
pub const SUSPENDED_REASON: &str = "Suspended";
/// The reason of `Suspended=False` and of `Scheduled=False` on a resumed session that waits
/// to be placed again.
pub const RESUMED_REASON: &str = "Resumed";

/// The annotation the owning worker sets, with `spec.suspend: true`, when it suspends a
/// session for idleness (`spec.mode.session.autoSuspendAfter`) or for an expired lease
/// with auto-suspend set: its value is the Run's `status.incarnation` at that moment. It
/// makes the suspend wakeable (a call through the gateway withdraws it), and only while
/// [`auto_suspended`] holds: an explicit `spec.suspend: true` carries none, and a resume
/// bumps the incarnation, so a marker left behind never makes a later explicit suspend
/// wakeable.
pub const AUTO_SUSPENDED_ANNOTATION: &str = "kruntimes.io/auto-suspended";

/// Whether `run` carries a valid auto-suspend marker: `spec.suspend: true` and
/// [`AUTO_SUSPENDED_ANNOTATION`] equal to its current incarnation. Such a suspend is
/// withdrawn by the next authorized session call (the gateway wakes it); any other suspend
/// is the user's and is never withdrawn by a call.
pub fn auto_suspended(run: &crate::Run) -> bool {
    run.spec.suspend_requested()
        && run
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(AUTO_SUSPENDED_ANNOTATION))
            .is_some_and(|value| value.trim() == run.incarnation().to_string())
}

/// Whether a status write may move a Run from `from` to `to`, as far as `Suspended` is
/// concerned (every other pair is left to the other rules and returns `true`):
///
/// - into Suspended: from Ready (the owning worker, once the Snapshot is Ready), or from
///   Pending or Scheduled when the Run already has `status.snapshot` to come back to (a
///   resumed session suspended again before it was placed: `has_snapshot`);
/// - out of Suspended: to Pending (a resume), or to a terminal phase (deleted, released or
///   cancelled while suspended: nothing runs, so nothing needs draining);
/// - nothing else (Suspended → Scheduled/Running/Ready/Finalizing skips the placement).
pub fn suspend_transition_allowed(from: Phase, to: Phase, has_snapshot: bool) -> bool {
    if from == to {
        return true;
    }
    match (from, to) {
        (Phase::Ready, Phase::Suspended) => true,
        (Phase::Pending | Phase::Scheduled, Phase::Suspended) => has_snapshot,
        (
            Phase::Running
            | Phase::Finalizing
            | Phase::Succeeded
            | Phase::Failed
            | Phase::Timeout
            | Phase::Cancelled,
            Phase::Suspended,
        ) => false,
        (Phase::Suspended, Phase::Pending) => true,
        (Phase::Suspended, to) if to.is_terminal() => true,
        (Phase::Suspended, _) => false,
        _ => true,
    }
}

/// What the controller does with a session Run because of `spec.suspend`, given its
/// current status (pure; the caller writes the result with the `resourceVersion` it read):
///
/// - Suspended and `spec.suspend` no longer true: [`SuspendAction::Resume`];
/// - Pending or Scheduled with `spec.suspend: true` and a `status.snapshot` (a resumed
///   session suspended again before it was placed): [`SuspendAction::Resuspend`], straight
///   back to Suspended without a capture, since nothing ran since the Snapshot;
/// - anything else: [`SuspendAction::None`]. In particular a Pending or Scheduled Run with
///   no Snapshot waits until it is Ready and its worker captures it, and a Ready one is the
///   owning worker's to capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SuspendAction {
    None,
    Resume,
    Resuspend,
}

/// Decides the [`SuspendAction`] for a Run (see there).
pub fn suspend_action(spec: &RunSpec, status: Option<&RunStatus>) -> SuspendAction {
    if spec.mode.session.is_none() {
        return SuspendAction::None;
    }
    let phase = status.and_then(|s| s.phase).unwrap_or(Phase::Pending);
    // A fork created with `spec.suspend: true` goes to Suspended to its source Snapshot.
    let has_snapshot = status.is_some_and(|s| s.snapshot.is_some()) || spec.is_fork();
    let ending = spec.termination.is_some();
    match phase {
        Phase::Suspended if !spec.suspend_requested() && !ending => SuspendAction::Resume,
        Phase::Pending | Phase::Scheduled
            if spec.suspend_requested() && has_snapshot && !ending =>
        {
            SuspendAction::Resuspend
        }
        Phase::Pending
        | Phase::Scheduled
        | Phase::Running
        | Phase::Ready
        | Phase::Finalizing
        | Phase::Suspended
        | Phase::Succeeded
        | Phase::Failed
        | Phase::Timeout
        | Phase::Cancelled => SuspendAction::None,
    }
}

/// The reason of `Suspended=False` while the owner cannot store a requested suspend's
/// snapshot (its store failed): the session serves on, and the capture is tried again.
pub const SNAPSHOT_RETRYING_REASON: &str = "SnapshotRetrying";
/// The reason of `Suspended=False` when no snapshot store is configured: the session serves
/// on; a suspend is not possible on this worker.
pub const NO_SNAPSHOT_STORE_REASON: &str = "NoSnapshotStore";

/// Whether the owner deferred the suspend that generation `generation` of the Run asks for
/// (`Suspended=False` with [`SNAPSHOT_RETRYING_REASON`] or [`NO_SNAPSHOT_STORE_REASON`],
/// observed at that generation): the session keeps taking operations meanwhile, so the
/// gateway and the SDK do not refuse them as suspending. A condition left from an earlier
/// request (the suspend was withdrawn and asked again since) does not count: the owner
/// tries the new request first.
pub fn suspend_deferred(status: Option<&RunStatus>, generation: Option<i64>) -> bool {
    status.is_some_and(|s| {
        s.conditions.iter().any(|c| {
            c.type_ == SUSPENDED_CONDITION
                && c.status == "False"
                && matches!(
                    c.reason.as_deref(),
                    Some(SNAPSHOT_RETRYING_REASON | NO_SNAPSHOT_STORE_REASON)
                )
                && c.observed_generation.is_some()
                && c.observed_generation == generation
        })
    })
}

/// Applies a resume to the status of a Suspended session: back to Pending with
/// `incarnation` + 1, the worker assignment and start time cleared, `status.snapshot`
/// kept (the new worker restores from it), `Suspended=False/Resumed` and
/// `Scheduled=False/Resumed` (it waits to be placed).
///
/// Suspended time counts for neither clock: the idle clock restarts at the resume
/// (`status.session.lastActivityTime` is set to now), and `spec.timeout`, which counts
/// from `startTime`, counts from the new incarnation's start (the new worker sets
/// `startTime`). So `spec.timeout` bounds each incarnation's placed time, not the sum of
/// all of them: a cumulative bound would need a `status` counter of placed time, which
/// nothing keeps yet.
pub fn record_resume(status: &mut RunStatus, generation: Option<i64>) {
    let next = status.incarnation.unwrap_or(1).max(1) + 1;
    status
        .session
        .get_or_insert_with(Default::default)
        .last_activity_time = Some(now_rfc3339());
    status.phase = Some(Phase::Pending);
    status.incarnation = Some(next);
    status.assigned_pod = None;
    status.assigned_pod_uid = None;
    status.start_time = None;
    status.endpoint = None;
    status.reason = Some(RESUMED_REASON.to_string());
    status.message = Some(format!("resumed as incarnation {next}"));
    let now = now_rfc3339();
    set_condition(
        &mut status.conditions,
        RunCondition {
            type_: SUSPENDED_CONDITION.to_string(),
            status: "False".to_string(),
            reason: Some(RESUMED_REASON.to_string()),
            message: Some(format!("resumed as incarnation {next}")),
            last_transition_time: Some(now.clone()),
            observed_generation: generation,
        },
    );
    set_condition(
        &mut status.conditions,
        RunCondition {
            type_: SCHEDULED_CONDITION.to_string(),
            status: "False".to_string(),
            reason: Some(RESUMED_REASON.to_string()),
            message: Some("resumed; waits for a worker".to_string()),
            last_transition_time: Some(now),
            observed_generation: generation,
        },
    );
}

/// Applies a suspension to `status` (the owning worker after a Ready Snapshot, or the
/// controller for a [`SuspendAction::Resuspend`]): Suspended, the assignment cleared (the
/// slot is released), `status.snapshot` set to `snapshot`, `Ready=False/Suspended` and
/// `Suspended=True/Suspended`.
pub fn record_suspend(
    spec: &RunSpec,
    status: &mut RunStatus,
    snapshot: crate::run::RunSnapshotRef,
    generation: Option<i64>,
) {
    let message = format!("suspended to Snapshot {}", snapshot.name);
    leave_ready(spec, status, SUSPENDED_REASON, &message, generation);
    status.phase = Some(Phase::Suspended);
    status.assigned_pod = None;
    status.assigned_pod_uid = None;
    status.endpoint = None;
    status.reason = Some(SUSPENDED_REASON.to_string());
    status.message = Some(bounded_message(&message));
    status.snapshot = Some(snapshot);
    set_condition(
        &mut status.conditions,
        RunCondition {
            type_: SUSPENDED_CONDITION.to_string(),
            status: "True".to_string(),
            reason: Some(SUSPENDED_REASON.to_string()),
            message: Some(bounded_message(&message)),
            last_transition_time: Some(now_rfc3339()),
            observed_generation: generation,
        },
    );
}

/// How long from now until `t` (zero when it has passed).
pub fn until(t: Timestamp) -> Duration {
    Duration::try_from(Timestamp::now().duration_until(t)).unwrap_or(Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::RetryPolicy;

    /// Issue 19 item 4: only the owner's marker of this incarnation, with the suspend
    /// still asked, makes a suspend wakeable; an explicit one (no marker, or one left from
    /// an earlier incarnation) never is.
    #[test]
    fn only_a_current_auto_suspend_marker_is_wakeable() {
        let mut run = crate::Run::new("s", RunSpec::task("rt", "x"));
        run.status = Some(RunStatus {
            incarnation: Some(2),
            ..RunStatus::default()
        });
        run.spec.suspend = Some(true);
        assert!(!auto_suspended(&run), "explicit: no marker");
        let mark = |run: &mut crate::Run, value: &str| {
            run.metadata.annotations = Some(
                [(AUTO_SUSPENDED_ANNOTATION.to_string(), value.to_string())]
                    .into_iter()
                    .collect(),
            );
        };
        mark(&mut run, "2");
        assert!(auto_suspended(&run));
        mark(&mut run, "1");
        assert!(!auto_suspended(&run), "a marker of an earlier incarnation");
        mark(&mut run, "2");
        run.spec.suspend = Some(false);
        assert!(!auto_suspended(&run), "not asked to suspend");
    }

    /// Issue 19.6: a function whose worker shut down gracefully consumed a retry (and one
    /// with `maxAttempts: 1` failed). Now the attempt advances without counting.
    #[test]
    fn a_worker_restart_advances_the_attempt_without_consuming_a_retry() {
        let mut spec = RunSpec::task("bash", "main.sh");
        spec.retry_policy = Some(RetryPolicy {
            max_attempts: 2,
            ..RetryPolicy::default()
        });
        let mut status = RunStatus {
            phase: Some(Phase::Ready),
            attempt: Some(1),
            assigned_pod: Some("w".to_string()),
            ..RunStatus::default()
        };
        for restart in 1..=3 {
            record_worker_restart(&spec, &mut status, "the worker shut down", Some(1));
            assert_eq!(status.phase, Some(Phase::Pending));
            assert_eq!(status.attempt, Some(1 + restart));
            assert_eq!(status.worker_restarts, Some(restart));
            assert_eq!(status.assigned_pod, None);
            assert_eq!(status.reason.as_deref(), Some(WORKER_RESTARTED_REASON));
            assert_eq!(backoff_until(&spec, Some(&status)), None);
            assert_eq!(
                after_infrastructure_failure(&spec, Some(&status)),
                AfterFailure::Retry {
                    next_attempt: 2 + restart
                },
                "the one retry of maxAttempts 2 is still there"
            );
        }
        // A real failure then uses the retry, and the next one exhausts it.
        record_infrastructure_failure(&spec, &mut status, "WorkerLost", "lost", Some(1));
        assert_eq!(status.phase, Some(Phase::Pending));
        assert_eq!(
            after_infrastructure_failure(&spec, Some(&status)),
            AfterFailure::Exhausted
        );
    }

    #[test]
    fn workspace_paths_are_relative_and_plain() {
        for ok in [
            "a",
            "a/b.txt",
            ".hidden",
            "a..b",
            "...",
            "x/y/z",
            &"c".repeat(255),
        ] {
            assert_eq!(workspace_path_problem(ok, false), None, "{ok:?}");
        }
        assert_eq!(workspace_path_problem("", true), None);
        let long_component = "c".repeat(256);
        let long_path = "a/".repeat(2049);
        for bad in [
            "",
            "/etc/passwd",
            "..",
            "../x",
            "a/../../x",
            "./a",
            "a/.",
            "a//b",
            "a/",
            "a\0b",
            long_component.as_str(),
            long_path.as_str(),
        ] {
            assert!(workspace_path_problem(bad, false).is_some(), "{bad:?}");
        }
        assert!(workspace_path_problem("..", true).is_some());
    }

    fn cond(status: &str, time: &str) -> RunCondition {
        RunCondition {
            type_: "Scheduled".into(),
            status: status.into(),
            last_transition_time: Some(time.into()),
            ..RunCondition::default()
        }
    }

    #[test]
    fn transition_time_moves_only_when_status_changes() {
        let mut conditions = vec![cond("False", "t0")];
        set_condition(&mut conditions, cond("False", "t1"));
        assert_eq!(conditions[0].last_transition_time.as_deref(), Some("t0"));
        set_condition(&mut conditions, cond("True", "t2"));
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].last_transition_time.as_deref(), Some("t2"));
    }

    #[test]
    fn now_parses_back() {
        let text = now_rfc3339();
        assert!(text.parse::<Timestamp>().is_ok(), "{text}");
    }

    fn spec(max: Option<i32>, backoff: Option<i32>) -> RunSpec {
        let mut spec = RunSpec::task("bash", "true");
        spec.retry_policy = max.map(|max_attempts| RetryPolicy {
            max_attempts,
            backoff_seconds: backoff,
        });
        spec
    }

    fn running(attempt: i32) -> RunStatus {
        RunStatus {
            phase: Some(Phase::Running),
            attempt: Some(attempt),
            assigned_pod: Some("bash-abcde".into()),
            assigned_pod_uid: Some("uid".into()),
            start_time: Some(now_rfc3339()),
            ..RunStatus::default()
        }
    }

    #[test]
    fn without_a_policy_a_failure_is_final() {
        let mut status = running(1);
        let d =
            record_infrastructure_failure(&spec(None, None), &mut status, "WorkerLost", "m", None);
        assert_eq!(d, AfterFailure::Exhausted);
        assert_eq!(status.phase, Some(Phase::Failed));
        assert_eq!(status.reason.as_deref(), Some("WorkerLost"));
        assert!(status.completion_time.is_some());
    }

    #[test]
    fn a_retry_clears_the_assignment_and_raises_the_attempt() {
        let mut status = running(1);
        let d = record_infrastructure_failure(
            &spec(Some(3), None),
            &mut status,
            "WorkerLost",
            "m",
            Some(1),
        );
        assert_eq!(d, AfterFailure::Retry { next_attempt: 2 });
        assert_eq!(status.phase, Some(Phase::Pending));
        assert_eq!(status.attempt, Some(2));
        assert_eq!(status.assigned_pod, None);
        assert_eq!(status.assigned_pod_uid, None);
        assert_eq!(status.start_time, None);
        assert_eq!(status.completion_time, None);
        // The last attempt allowed is final.
        let mut last = running(3);
        let d =
            record_infrastructure_failure(&spec(Some(3), None), &mut last, "WorkerLost", "m", None);
        assert_eq!(d, AfterFailure::Exhausted);
        assert_eq!(last.phase, Some(Phase::Failed));
    }

    #[test]
    fn backoff_counts_from_the_retry() {
        let mut status = running(1);
        record_infrastructure_failure(
            &spec(Some(2), Some(30)),
            &mut status,
            "WorkerLost",
            "m",
            None,
        );
        assert!(backoff_until(&spec(Some(2), Some(30)), Some(&status)).is_some());
        // No backoff configured: placeable at once.
        assert_eq!(backoff_until(&spec(Some(2), None), Some(&status)), None);
        // Backoff passed long ago.
        status.conditions[0].last_transition_time = Some("2020-01-01T00:00:00Z".into());
        assert_eq!(backoff_until(&spec(Some(2), Some(30)), Some(&status)), None);
    }

    #[test]
    fn messages_are_bounded_on_char_boundaries() {
        let long = "é".repeat(2000);
        let cut = bounded_message(&long);
        assert!(cut.len() <= MAX_MESSAGE_BYTES);
        assert!(cut.ends_with("..."));
        assert_eq!(bounded_message("short"), "short");
    }

    fn ready_condition(status: &RunStatus) -> Option<(String, Option<String>)> {
        status
            .conditions
            .iter()
            .find(|c| c.type_ == READY_CONDITION)
            .map(|c| (c.status.clone(), c.reason.clone()))
    }

    fn function_spec(max: i32) -> RunSpec {
        let mut spec = spec(Some(max), None);
        spec.mode = crate::run::RunMode {
            function: Some(crate::run::FunctionMode {
                handler: "h.sh".into(),
                idle_timeout_seconds: None,
                concurrency: None,
            }),
            ..crate::run::RunMode::default()
        };
        spec
    }

    #[test]
    fn leaving_ready_sets_ready_false_for_functions_and_sessions_only() {
        let mut status = running(1);
        set_ready(&mut status, true, "FunctionRegistered", "", None);
        leave_ready(&function_spec(1), &mut status, "Drained", "bye", Some(3));
        assert_eq!(
            ready_condition(&status),
            Some(("False".into(), Some("Drained".into())))
        );
        let mut task = running(1);
        leave_ready(&spec(None, None), &mut task, "Cancelled", "", None);
        assert_eq!(
            ready_condition(&task),
            None,
            "a task Run gets no Ready condition"
        );
    }

    /// Regression (issue 15.3): a retried or failed function kept Ready=True.
    #[test]
    fn an_infrastructure_failure_takes_a_function_out_of_ready() {
        for (max, phase) in [(2, Phase::Pending), (1, Phase::Failed)] {
            let mut status = running(1);
            set_ready(&mut status, true, "FunctionRegistered", "", None);
            record_infrastructure_failure(
                &function_spec(max),
                &mut status,
                "WorkerLost",
                "gone",
                None,
            );
            assert_eq!(status.phase, Some(phase));
            assert_eq!(
                ready_condition(&status),
                Some(("False".into(), Some("WorkerLost".into()))),
                "{phase}"
            );
        }
    }

    fn session_spec(suspend: Option<bool>) -> RunSpec {
        let mut spec = RunSpec::task("bash", "unused");
        spec.mode = crate::run::RunMode {
            session: Some(crate::run::SessionMode::default()),
            ..Default::default()
        };
        spec.suspend = suspend;
        spec
    }

    fn with_phase(phase: Phase, snapshot: bool) -> RunStatus {
        RunStatus {
            phase: Some(phase),
            snapshot: snapshot.then(|| crate::run::RunSnapshotRef {
                name: "s-1".into(),
                uri: None,
                last_sequence: Some(4),
            }),
            incarnation: Some(1),
            assigned_pod: Some("w-0".into()),
            assigned_pod_uid: Some("uid-0".into()),
            ..RunStatus::default()
        }
    }

    #[test]
    fn suspended_is_entered_from_ready_and_left_to_pending_or_an_end() {
        for from in Phase::ALL {
            for to in Phase::ALL {
                for snapshot in [false, true] {
                    let allowed = suspend_transition_allowed(from, to, snapshot);
                    let expected = match (from, to) {
                        _ if from == to => true,
                        (Phase::Ready, Phase::Suspended) => true,
                        (Phase::Pending | Phase::Scheduled, Phase::Suspended) => snapshot,
                        (_, Phase::Suspended) => false,
                        (Phase::Suspended, Phase::Pending) => true,
                        (Phase::Suspended, to) => to.is_terminal(),
                        // Not this rule's business.
                        _ => true,
                    };
                    assert_eq!(allowed, expected, "{from} -> {to} (snapshot {snapshot})");
                }
            }
        }
    }

    #[test]
    fn suspend_actions_follow_spec_suspend_and_the_snapshot() {
        use SuspendAction::{None as Nothing, Resume, Resuspend};
        let cases = [
            // (spec.suspend, phase, has snapshot, action)
            (Some(false), Phase::Suspended, true, Resume),
            (None, Phase::Suspended, true, Resume),
            (Some(true), Phase::Suspended, true, Nothing),
            (Some(true), Phase::Pending, true, Resuspend),
            (Some(true), Phase::Scheduled, true, Resuspend),
            // No snapshot to come back to: wait for Ready, the worker captures.
            (Some(true), Phase::Pending, false, Nothing),
            (Some(true), Phase::Scheduled, false, Nothing),
            (Some(true), Phase::Running, true, Nothing),
            (Some(true), Phase::Ready, true, Nothing),
            (Some(false), Phase::Ready, true, Nothing),
            (Some(false), Phase::Cancelled, true, Nothing),
        ];
        for (suspend, phase, snapshot, action) in cases {
            assert_eq!(
                suspend_action(&session_spec(suspend), Some(&with_phase(phase, snapshot))),
                action,
                "{suspend:?} {phase} {snapshot}"
            );
        }
        // Never for a task, and never once termination is asked for.
        let mut task = RunSpec::task("bash", "x");
        task.suspend = Some(false);
        assert_eq!(
            suspend_action(&task, Some(&with_phase(Phase::Suspended, true))),
            Nothing
        );
        let mut ending = session_spec(None);
        ending.termination = Some(crate::run::Termination {
            mode: crate::run::TerminationMode::Immediate,
        });
        assert_eq!(
            suspend_action(&ending, Some(&with_phase(Phase::Suspended, true))),
            Nothing
        );
    }

    #[test]
    fn a_resume_raises_the_incarnation_keeps_the_snapshot_and_clears_the_worker() {
        let mut status = with_phase(Phase::Suspended, true);
        record_resume(&mut status, Some(3));
        assert_eq!(status.phase, Some(Phase::Pending));
        assert_eq!(status.incarnation, Some(2));
        assert_eq!(
            status.snapshot.as_ref().map(|s| s.name.as_str()),
            Some("s-1")
        );
        assert_eq!(status.assigned_pod, None);
        assert_eq!(status.assigned_pod_uid, None);
        let suspended = status
            .conditions
            .iter()
            .find(|c| c.type_ == SUSPENDED_CONDITION)
            .expect("Suspended condition");
        assert_eq!(suspended.status, "False");
        assert_eq!(suspended.observed_generation, Some(3));
        // A second resume after a second suspension counts on.
        record_suspend(
            &session_spec(Some(true)),
            &mut status,
            crate::run::RunSnapshotRef {
                name: "s-2".into(),
                uri: None,
                last_sequence: None,
            },
            Some(4),
        );
        assert_eq!(status.phase, Some(Phase::Suspended));
        assert!(!is_ready(Some(&status)));
        record_resume(&mut status, Some(5));
        assert_eq!(status.incarnation, Some(3));
        assert_eq!(
            status.snapshot.as_ref().map(|s| s.name.as_str()),
            Some("s-2")
        );
    }

    #[test]
    fn a_deferral_counts_only_at_the_generation_it_was_observed_at() {
        let deferred = |reason: &str, observed: Option<i64>| RunStatus {
            conditions: vec![RunCondition {
                type_: SUSPENDED_CONDITION.to_string(),
                status: "False".to_string(),
                reason: Some(reason.to_string()),
                message: None,
                last_transition_time: None,
                observed_generation: observed,
            }],
            ..RunStatus::default()
        };
        let retrying = deferred(SNAPSHOT_RETRYING_REASON, Some(4));
        assert!(suspend_deferred(Some(&retrying), Some(4)));
        // The suspend was withdrawn and asked again since: the owner tries it anew.
        assert!(!suspend_deferred(Some(&retrying), Some(6)));
        assert!(suspend_deferred(
            Some(&deferred(NO_SNAPSHOT_STORE_REASON, Some(2))),
            Some(2)
        ));
        assert!(!suspend_deferred(
            Some(&deferred(RESUMED_REASON, Some(2))),
            Some(2)
        ));
        assert!(!suspend_deferred(
            Some(&deferred(SNAPSHOT_RETRYING_REASON, None)),
            None
        ));
        assert!(!suspend_deferred(None, Some(1)));
    }
}
