//! Kubernetes Events on Runs from runtimed: what happens to a Run at its worker. A
//! registration that failed (retried or not), a task or session that could not start, a
//! session whose lease expired, a timeout, a cancellation carried out here, the drain of a
//! Run when the worker shuts down. `kubectl describe run NAME` and `kubectl get events
//! --field-selector involvedObject.name=NAME` show them, beside the controller-manager's.
//!
//! The one hook is the status write: [`status_written`] runs after every status write of
//! runtimed that landed (the reconciler's and the drain's), and decides from the written
//! status alone. runtimed writes a terminal phase, or Pending after an infrastructure
//! failure, once per attempt (each write is conditional on the resourceVersion it read, and
//! a reconcile never rewrites an ended Run), so each such write is one Event. A Run that
//! Succeeded, or a task whose program exited non-zero, is the program's own outcome and
//! gets none (a Run's status says it; a busy worker would otherwise write an Event per
//! task).
//!
//! Events go through the bounded writer of `kruntimes-wire`: they never block or fail a
//! reconcile.

use kruntimes_api::lifecycle;
use kruntimes_api::run::ModeKind;
use kruntimes_api::{Phase, Run};
use kube::runtime::events::EventType;

pub use kruntimes_wire::events::Events;

/// The `reportingController` of runtimed's Events (the instance is the worker's Pod name).
pub const REPORTING_CONTROLLER: &str = "kruntimes.io/runtimed";
/// The reason of the Event on a Run sent back to Pending for another attempt.
pub const RETRYING: &str = "Retrying";
/// What a task whose program exited non-zero ends with: its own outcome, no Event.
const NON_ZERO_EXIT: &str = "NonZeroExitCode";

/// The Event that a status write leaves, if any: type, reason, action, note.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub type_: EventType,
    pub reason: String,
    pub action: &'static str,
    pub note: String,
}

/// What `written` (a Run as runtimed just wrote it) reports: the end of the attempt, and
/// for a retried Run a second `Retrying` report.
pub fn reports(written: &Run) -> Vec<Report> {
    let Some(status) = written.status.as_ref() else {
        return Vec::new();
    };
    let phase = written.phase();
    let reason = status.reason.clone().unwrap_or_default();
    if reason.is_empty() {
        return Vec::new();
    }
    let message = status.message.clone().unwrap_or_default();
    let action = action(written, phase, &reason);
    match phase {
        Phase::Pending if reason == lifecycle::WORKER_RESTARTED_REASON => {
            // Its worker shut down: it registers elsewhere, and no retry was consumed.
            let attempt = status.attempt.unwrap_or(2);
            vec![Report {
                type_: EventType::Normal,
                reason,
                action,
                note: format!(
                    "attempt {} ended: {message}; attempt {attempt} registers on the next ready worker (no retry consumed)",
                    attempt - 1
                ),
            }]
        }
        Phase::Pending => {
            // runtimed writes Pending only after an infrastructure failure it retries.
            let attempt = status.attempt.unwrap_or(2);
            vec![
                Report {
                    type_: EventType::Warning,
                    reason,
                    action,
                    note: format!("attempt {} ended: {message}", attempt - 1),
                },
                Report {
                    type_: EventType::Normal,
                    reason: RETRYING.to_string(),
                    action,
                    note: format!("attempt {attempt} waits for a worker"),
                },
            ]
        }
        Phase::Cancelled => vec![Report {
            type_: EventType::Normal,
            reason,
            action,
            note: message,
        }],
        Phase::Failed if reason == NON_ZERO_EXIT => Vec::new(),
        Phase::Failed | Phase::Timeout => vec![Report {
            type_: EventType::Warning,
            reason,
            action,
            note: message,
        }],
        Phase::Scheduled
        | Phase::Running
        | Phase::Ready
        | Phase::Finalizing
        | Phase::Suspended
        | Phase::Succeeded => Vec::new(),
    }
}

/// What runtimed did that the Event is about.
fn action(run: &Run, phase: Phase, reason: &str) -> &'static str {
    if reason == crate::drain::SHUTDOWN_REASON || reason == lifecycle::WORKER_RESTARTED_REASON {
        return "Drain";
    }
    match phase {
        Phase::Cancelled => return "Cancel",
        Phase::Timeout => return "Stop",
        _ => {}
    }
    match run.spec.mode.kind() {
        Some(ModeKind::Function) => "Register",
        Some(ModeKind::Session) => "Serve",
        Some(ModeKind::Task) | None => "Execute",
    }
}

/// Publishes what `written` reports (see [`reports`]); never blocks.
pub fn status_written(events: &Events, written: &Run) {
    for report in reports(written) {
        events.publish(
            written,
            report.type_,
            &report.reason,
            report.action,
            &report.note,
        );
    }
}

#[cfg(test)]
mod tests {
    use kruntimes_api::{Run, RunSpec, RunStatus};

    use super::*;

    fn written(phase: Phase, reason: &str, attempt: i32) -> Run {
        let mut run = Run::new("r", RunSpec::task("bash", "main.sh"));
        run.status = Some(RunStatus {
            phase: Some(phase),
            reason: Some(reason.to_string()),
            message: Some("why".to_string()),
            attempt: Some(attempt),
            ..RunStatus::default()
        });
        run
    }

    #[test]
    fn ends_and_retries_are_reported_and_the_programs_own_outcomes_are_not() {
        let retried = reports(&written(Phase::Pending, "RuntimeServerLost", 2));
        assert_eq!(retried.len(), 2);
        assert_eq!(retried[0].reason, "RuntimeServerLost");
        assert_eq!(retried[0].note, "attempt 1 ended: why");
        assert_eq!(retried[1].reason, RETRYING);
        assert_eq!(retried[1].note, "attempt 2 waits for a worker");

        let drained = reports(&written(Phase::Failed, crate::drain::SHUTDOWN_REASON, 1));
        assert_eq!(drained.len(), 1);
        assert_eq!(drained[0].action, "Drain");
        assert_eq!(drained[0].type_, EventType::Warning);

        let cancelled = reports(&written(Phase::Cancelled, "Cancelled", 1));
        assert_eq!(cancelled[0].type_, EventType::Normal);
        assert_eq!(cancelled[0].action, "Cancel");

        assert!(reports(&written(Phase::Succeeded, "Completed", 1)).is_empty());
        assert!(reports(&written(Phase::Failed, NON_ZERO_EXIT, 1)).is_empty());
        assert!(reports(&written(Phase::Running, "", 1)).is_empty());
        assert!(reports(&written(Phase::Ready, "FunctionRegistered", 1)).is_empty());
    }
}
