//! What a finished Run means for krt's exit code and its last words, like `docker run`.

use kruntimes_api::{Phase, RunStatus};

/// Exit code when a Run timed out (like `timeout(1)`).
pub const EXIT_TIMEOUT: u8 = 124;
/// Exit code when a Run was cancelled (like a shell after Ctrl-C).
pub const EXIT_CANCELLED: u8 = 130;
/// Exit code for an error in krt itself, or a failure without an exit code.
pub const EXIT_ERROR: u8 = 1;
/// `krt invoke`: the handler failed (raised, or exited non-zero). Not 2, which clap uses
/// for usage errors.
pub const EXIT_HANDLER_FAILED: u8 = 3;
/// `krt invoke`: the outcome is unknown (a 502 or 504 of the gateway, a connection that
/// broke after the request was sent, no answer in time): the handler may or may not have
/// run.
pub const EXIT_OUTCOME_UNKNOWN: u8 = 4;

/// krt's exit code for a Run in `phase` with `exit_code`: the task's own code when it has
/// one, 124 for Timeout, 130 for Cancelled, 1 for a failure without a (non-zero) code.
pub fn exit_code(phase: Phase, exit_code: Option<i32>) -> u8 {
    match phase {
        Phase::Succeeded => 0,
        Phase::Failed => match exit_code {
            Some(code) if (1..=255).contains(&code) => code as u8,
            // No code (a signal, a start failure), or a failure despite exit 0 (invalid
            // outputs), or a code a process cannot exit with.
            Some(_) | None => EXIT_ERROR,
        },
        Phase::Timeout => EXIT_TIMEOUT,
        Phase::Cancelled => EXIT_CANCELLED,
        // Not finished: only reached if a caller gives up waiting.
        Phase::Pending
        | Phase::Scheduled
        | Phase::Running
        | Phase::Ready
        | Phase::Finalizing
        | Phase::Suspended => EXIT_ERROR,
    }
}

/// The one line krt prints to stderr when a Run ended other than by its program's own
/// verdict: nothing for Succeeded or for a plain non-zero exit (the program said it all),
/// `krt: run NAME PHASE: REASON: MESSAGE` otherwise.
pub fn reason_line(name: &str, phase: Phase, status: Option<&RunStatus>) -> Option<String> {
    // A reason that repeats the phase (`Timeout`, `Cancelled`) adds nothing.
    let reason = status
        .and_then(|s| s.reason.as_deref())
        .filter(|r| !r.is_empty() && *r != phase.as_str());
    let message = status
        .and_then(|s| s.message.as_deref())
        .filter(|m| !m.is_empty());
    let code = status.and_then(|s| s.exit_code);
    match phase {
        Phase::Succeeded => return None,
        Phase::Failed => {
            let plain_exit = code.is_some_and(|c| c != 0)
                && matches!(reason, None | Some("NonZeroExitCode" | "Error"));
            if plain_exit {
                return None;
            }
        }
        Phase::Timeout | Phase::Cancelled => {}
        Phase::Pending
        | Phase::Scheduled
        | Phase::Running
        | Phase::Ready
        | Phase::Finalizing
        | Phase::Suspended => {}
    }
    let mut line = format!("krt: run {name} {}", phase.as_str());
    match (reason, message) {
        (Some(r), Some(m)) => line.push_str(&format!(": {r}: {m}")),
        (Some(r), None) => line.push_str(&format!(": {r}")),
        (None, Some(m)) => line.push_str(&format!(": {m}")),
        (None, None) => {}
    }
    // One line: a message with newlines would break it.
    Some(line.replace(['\n', '\r'], " "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: Option<i32>, reason: Option<&str>, message: Option<&str>) -> RunStatus {
        RunStatus {
            exit_code: code,
            reason: reason.map(str::to_string),
            message: message.map(str::to_string),
            ..RunStatus::default()
        }
    }

    #[test]
    fn exit_codes_map_like_docker_run() {
        assert_eq!(exit_code(Phase::Succeeded, Some(0)), 0);
        assert_eq!(exit_code(Phase::Succeeded, None), 0);
        assert_eq!(exit_code(Phase::Failed, Some(3)), 3);
        assert_eq!(exit_code(Phase::Failed, Some(255)), 255);
        assert_eq!(exit_code(Phase::Failed, None), 1);
        assert_eq!(exit_code(Phase::Failed, Some(0)), 1);
        assert_eq!(exit_code(Phase::Failed, Some(256)), 1);
        assert_eq!(exit_code(Phase::Failed, Some(-9)), 1);
        assert_eq!(exit_code(Phase::Timeout, None), 124);
        assert_eq!(exit_code(Phase::Timeout, Some(0)), 124);
        assert_eq!(exit_code(Phase::Cancelled, None), 130);
        for phase in Phase::ALL {
            if !phase.is_terminal() {
                assert_eq!(exit_code(phase, None), 1, "{phase:?}");
            }
        }
    }

    #[test]
    fn a_plain_non_zero_exit_prints_nothing() {
        let s = status(Some(3), Some("NonZeroExitCode"), Some("exited with 3"));
        assert_eq!(reason_line("r", Phase::Failed, Some(&s)), None);
        assert_eq!(
            reason_line("r", Phase::Succeeded, Some(&status(Some(0), None, None))),
            None
        );
    }

    #[test]
    fn other_endings_print_one_line() {
        let s = status(Some(0), Some("OutputsInvalid"), Some("line 2:\nbad"));
        assert_eq!(
            reason_line("python-abc12", Phase::Failed, Some(&s)).as_deref(),
            Some("krt: run python-abc12 Failed: OutputsInvalid: line 2: bad")
        );
        let s = status(None, Some("Signaled"), None);
        assert_eq!(
            reason_line("r", Phase::Failed, Some(&s)).as_deref(),
            Some("krt: run r Failed: Signaled")
        );
        assert_eq!(
            reason_line("r", Phase::Timeout, None).as_deref(),
            Some("krt: run r Timeout")
        );
        let s = status(None, Some("Timeout"), Some("ran longer than 1s"));
        assert_eq!(
            reason_line("r", Phase::Timeout, Some(&s)).as_deref(),
            Some("krt: run r Timeout: ran longer than 1s")
        );
        let s = status(None, Some("Cancelled"), Some("cancelled by request"));
        assert_eq!(
            reason_line("r", Phase::Cancelled, Some(&s)).as_deref(),
            Some("krt: run r Cancelled: cancelled by request")
        );
    }
}
