//! Small helpers for writing Run status: timestamps and conditions in the Kubernetes style.

use k8s_openapi::jiff::Timestamp;
use kruntimes_api::run::RunCondition;

/// Now, as RFC 3339 with microseconds (as `MicroTime` writes it), so that latencies derived
/// from status timestamps stay meaningful below one second.
pub(crate) fn now_rfc3339() -> String {
    Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Microsecond)
        .map_or_else(|_| Timestamp::now().to_string(), |t| t.to_string())
}

/// Sets `condition` in `conditions`, replacing one of the same type. `lastTransitionTime`
/// keeps its old value when the condition's status does not change.
pub(crate) fn set_condition(conditions: &mut Vec<RunCondition>, mut condition: RunCondition) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
