//! Worker template fields the provisioner cannot honour are said on the Runtime, not
//! silently dropped: the condition `ImageIgnored` (`True`, reason `FieldsIgnored`, the
//! message naming each field and why) and a Warning Event `ImageIgnored` each time the set
//! of ignored fields changes. When a later spec asks for nothing the provisioner ignores,
//! the condition turns `False` (reason `NothingIgnored`); a Runtime that never asked for
//! such a field gets no condition at all.
//!
//! The condition is written with the Runtime's `resourceVersion` as precondition
//! ([`crate::provisioned::write_conditions`]), so it never overwrites a status written
//! meanwhile; a conflict waits for the next pass (the write of the other status triggers
//! one).

use kruntimes_api::Runtime;
use kruntimes_api::lifecycle::bounded_message;
use kruntimes_api::run::RunCondition;
use kube::Resource;

use crate::events::IMAGE_IGNORED;
use crate::status::now_rfc3339;

/// The condition type (and the Event reason).
pub const IMAGE_IGNORED_CONDITION: &str = IMAGE_IGNORED;

/// The condition `runtime` should show for `ignored` (the provisioner's
/// [`ignored_fields`](crate::WorkerProvisioner::ignored_fields)), or `None` when it shows it
/// already or needs none.
pub fn wanted(
    runtime: &Runtime,
    ignored: Option<&(Vec<String>, &'static str)>,
) -> Option<RunCondition> {
    let current = runtime.status.as_ref().and_then(|s| {
        s.conditions
            .iter()
            .find(|c| c.type_ == IMAGE_IGNORED_CONDITION)
    });
    let generation = runtime.meta().generation;
    let wanted = match ignored {
        Some((fields, because)) => RunCondition {
            type_: IMAGE_IGNORED_CONDITION.to_string(),
            status: "True".to_string(),
            reason: Some("FieldsIgnored".to_string()),
            message: Some(bounded_message(&format!(
                "{because}; it ignores {}",
                fields.join(", ")
            ))),
            last_transition_time: Some(now_rfc3339()),
            observed_generation: generation,
        },
        // Nothing to say, and nothing said before.
        None if current.is_none() => return None,
        None => RunCondition {
            type_: IMAGE_IGNORED_CONDITION.to_string(),
            status: "False".to_string(),
            reason: Some("NothingIgnored".to_string()),
            message: Some("the provisioner honours every field of the worker template".into()),
            last_transition_time: Some(now_rfc3339()),
            observed_generation: generation,
        },
    };
    let same = current.is_some_and(|c| {
        c.status == wanted.status
            && c.reason == wanted.reason
            && c.message == wanted.message
            && c.observed_generation == wanted.observed_generation
    });
    (!same).then_some(wanted)
}

#[cfg(test)]
mod tests {
    use kruntimes_api::runtime::RuntimeStatus;

    use super::*;
    use crate::test_support::bare_runtime;

    #[test]
    fn the_condition_follows_what_is_ignored_and_is_written_only_on_change() {
        let mut rt = bare_runtime("rt");
        assert_eq!(wanted(&rt, None), None, "nothing ignored, nothing said");
        let ignored = (vec!["template.image (python:3.12)".to_string()], "because");
        let condition = wanted(&rt, Some(&ignored)).expect("a condition");
        assert_eq!(condition.status, "True");
        assert_eq!(
            condition.message.as_deref(),
            Some("because; it ignores template.image (python:3.12)")
        );
        rt.status = Some(RuntimeStatus {
            conditions: vec![condition],
            ..RuntimeStatus::default()
        });
        assert_eq!(wanted(&rt, Some(&ignored)), None, "shown already");
        let cleared = wanted(&rt, None).expect("cleared");
        assert_eq!(cleared.status, "False");
    }
}
