//! The Run phase and its classification.
//!
//! Every helper is an exhaustive `match` with no wildcard, so adding a phase breaks the
//! build wherever it must be classified (ARCHITECTURE.md, "Lifecycles").

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `Pending → Scheduled → Running → Ready → Finalizing → Succeeded | Failed | Timeout | Cancelled`,
/// plus `Suspended` for session Runs (`Ready → Suspended → Pending`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum Phase {
    /// Accepted, not yet placed on a worker.
    Pending,
    /// Assigned to a worker that has not started it yet.
    Scheduled,
    /// Executing (a task) or registering (a function or session).
    Running,
    /// A function or session is registered and accepts traffic.
    Ready,
    /// A session drains accepted work and exports artifacts before it ends.
    Finalizing,
    /// A session whose files are captured in a Ready Snapshot (`status.snapshot`): not
    /// placed, holding no capacity, accepting no traffic. Not terminal: clearing
    /// `spec.suspend` sends it back to Pending (a resume).
    Suspended,
    Succeeded,
    Failed,
    Timeout,
    Cancelled,
}

impl Phase {
    /// Every phase, in lifecycle order.
    pub const ALL: [Phase; 10] = [
        Phase::Pending,
        Phase::Scheduled,
        Phase::Running,
        Phase::Ready,
        Phase::Finalizing,
        Phase::Suspended,
        Phase::Succeeded,
        Phase::Failed,
        Phase::Timeout,
        Phase::Cancelled,
    ];

    /// The phase name as written in `status.phase`.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Pending => "Pending",
            Phase::Scheduled => "Scheduled",
            Phase::Running => "Running",
            Phase::Ready => "Ready",
            Phase::Finalizing => "Finalizing",
            Phase::Suspended => "Suspended",
            Phase::Succeeded => "Succeeded",
            Phase::Failed => "Failed",
            Phase::Timeout => "Timeout",
            Phase::Cancelled => "Cancelled",
        }
    }

    /// Parses a `status.phase` value; `None` for anything that is not a phase name.
    pub fn parse(text: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.as_str() == text)
    }

    /// The Run has ended and will never change phase again.
    pub fn is_terminal(self) -> bool {
        match self {
            Phase::Succeeded | Phase::Failed | Phase::Timeout | Phase::Cancelled => true,
            Phase::Pending
            | Phase::Scheduled
            | Phase::Running
            | Phase::Ready
            | Phase::Finalizing
            | Phase::Suspended => false,
        }
    }

    /// The Run is placed on a worker and not yet ended.
    pub fn is_active(self) -> bool {
        match self {
            Phase::Scheduled | Phase::Running | Phase::Ready | Phase::Finalizing => true,
            Phase::Pending
            | Phase::Suspended
            | Phase::Succeeded
            | Phase::Failed
            | Phase::Timeout
            | Phase::Cancelled => false,
        }
    }

    /// The Run counts against its worker's run slots.
    pub fn holds_capacity(self) -> bool {
        match self {
            Phase::Scheduled | Phase::Running | Phase::Ready | Phase::Finalizing => true,
            Phase::Pending
            | Phase::Suspended
            | Phase::Succeeded
            | Phase::Failed
            | Phase::Timeout
            | Phase::Cancelled => false,
        }
    }

    /// The scheduler may still place the Run.
    pub fn is_schedulable(self) -> bool {
        match self {
            Phase::Pending => true,
            Phase::Scheduled
            | Phase::Running
            | Phase::Ready
            | Phase::Finalizing
            | Phase::Suspended
            | Phase::Succeeded
            | Phase::Failed
            | Phase::Timeout
            | Phase::Cancelled => false,
        }
    }

    /// The gateway may route new invocations or session operations to the Run.
    pub fn accepts_traffic(self) -> bool {
        match self {
            Phase::Ready => true,
            Phase::Pending
            | Phase::Scheduled
            | Phase::Running
            | Phase::Finalizing
            | Phase::Suspended
            | Phase::Succeeded
            | Phase::Failed
            | Phase::Timeout
            | Phase::Cancelled => false,
        }
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One row per phase: (phase, terminal, active, holds capacity, schedulable, traffic).
    const TABLE: [(Phase, bool, bool, bool, bool, bool); 10] = [
        (Phase::Pending, false, false, false, true, false),
        (Phase::Scheduled, false, true, true, false, false),
        (Phase::Running, false, true, true, false, false),
        (Phase::Ready, false, true, true, false, true),
        (Phase::Finalizing, false, true, true, false, false),
        // Not terminal, not placed, holds nothing, not scheduled (a resume sends it to
        // Pending first), no traffic.
        (Phase::Suspended, false, false, false, false, false),
        (Phase::Succeeded, true, false, false, false, false),
        (Phase::Failed, true, false, false, false, false),
        (Phase::Timeout, true, false, false, false, false),
        (Phase::Cancelled, true, false, false, false, false),
    ];

    #[test]
    fn every_phase_is_classified() {
        assert_eq!(TABLE.len(), Phase::ALL.len());
        for (phase, terminal, active, capacity, schedulable, traffic) in TABLE {
            assert_eq!(phase.is_terminal(), terminal, "{phase} is_terminal");
            assert_eq!(phase.is_active(), active, "{phase} is_active");
            assert_eq!(phase.holds_capacity(), capacity, "{phase} holds_capacity");
            assert_eq!(
                phase.is_schedulable(),
                schedulable,
                "{phase} is_schedulable"
            );
            assert_eq!(phase.accepts_traffic(), traffic, "{phase} accepts_traffic");
            assert!(
                !(phase.is_terminal() && phase.is_active()),
                "{phase} cannot be both"
            );
        }
    }

    #[test]
    fn names_round_trip() {
        for phase in Phase::ALL {
            assert_eq!(Phase::parse(phase.as_str()), Some(phase));
            let json = serde_json::to_string(&phase).expect("phase serializes");
            assert_eq!(json, format!("\"{}\"", phase.as_str()));
        }
        assert_eq!(Phase::parse("ready"), None);
    }
}
