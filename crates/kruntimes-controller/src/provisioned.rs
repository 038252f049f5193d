//! Whether a Runtime's workers could be provisioned, said on the Runtime: the condition
//! `Provisioned`.
//!
//! After each pass of the Runtime controller it is `True` (reason `WorkersProvisioned`)
//! when the provisioner brought the workers to the spec, and `False` when it could not,
//! with the provisioner's reason ([`Failure`]: `InvalidTemplate` for a template the
//! provisioner refuses, `NameTaken` for an object of another owner under a name the
//! workers need, `ProvisioningFailed` when the API or a worker failed) and the error as
//! its message. Each turn to `False`, or to another reason or message, also gives a
//! Warning Event with the same reason, so `kubectl describe runtime NAME` shows why a
//! Runtime has no workers instead of a log line in the controller-manager.
//!
//! Like [`crate::ignored`]'s condition, it is written only when its status, reason or
//! message changes, with the Runtime's `resourceVersion` as precondition
//! ([`write_conditions`]), so it never overwrites a status written meanwhile.

use kruntimes_api::Runtime;
use kruntimes_api::lifecycle::bounded_message;
use kruntimes_api::run::RunCondition;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use serde_json::json;
use tracing::debug;

use crate::events::Events;
use crate::provisioner::{Failure, Retry};
use crate::status::{now_rfc3339, set_condition};

/// The condition type.
pub const PROVISIONED_CONDITION: &str = "Provisioned";
/// The reason of `Provisioned` `True`.
pub const PROVISIONED: &str = "WorkersProvisioned";

/// The `Provisioned` condition `runtime` should show after a pass that failed as `failed`
/// says (the provisioner's [`Failure`] and the error's text) or succeeded (`None`), or
/// `None` when it shows that already (for this generation of the Runtime). A passing
/// failure ([`Retry::Soon`]) that the condition already shows with the same reason is not
/// written again for a new message: an API error's text changes from try to try, and
/// each write would start another pass.
pub fn wanted(runtime: &Runtime, failed: Option<(Failure, &str)>) -> Option<RunCondition> {
    let (status, reason, message) = match failed {
        Some((failure, error)) => ("False", failure.reason, bounded_message(error)),
        None => (
            "True",
            PROVISIONED,
            "the provisioner brought the workers to the spec".to_string(),
        ),
    };
    let current = runtime.status.as_ref().and_then(|s| {
        s.conditions
            .iter()
            .find(|c| c.type_ == PROVISIONED_CONDITION)
    });
    let generation = runtime.meta().generation;
    let same = current.is_some_and(|c| {
        c.status == status
            && c.reason.as_deref() == Some(reason)
            && c.observed_generation == generation
            && (c.message.as_deref() == Some(message.as_str())
                || failed.is_some_and(|(failure, _)| failure.retry == Retry::Soon))
    });
    (!same).then(|| RunCondition {
        type_: PROVISIONED_CONDITION.to_string(),
        status: status.to_string(),
        reason: Some(reason.to_string()),
        message: Some(message),
        last_transition_time: Some(now_rfc3339()),
        observed_generation: generation,
    })
}

/// A condition to write, and the Warning Event (reason) to publish once it is written.
pub(crate) struct Change {
    pub condition: RunCondition,
    pub warning: Option<&'static str>,
}

/// What became of [`write_conditions`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Written {
    /// Written, or nothing to write.
    Done,
    /// The Runtime changed since this pass read it; that change starts the next pass.
    Conflict,
    /// The write failed otherwise (the API failed): nothing starts another pass.
    Failed,
}

/// Writes `changes` to the conditions of `runtime` in one patch, with its
/// `resourceVersion` as precondition, then publishes their Warning Events (the condition's
/// message as note). Best effort: a failed write is logged, and the caller sees whether
/// a next pass comes by itself.
pub(crate) async fn write_conditions(
    api: &Api<Runtime>,
    events: &Events,
    runtime: &Runtime,
    changes: Vec<Change>,
) -> Written {
    if changes.is_empty() {
        return Written::Done;
    }
    let name = runtime.name_any();
    let mut conditions = runtime
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    for change in &changes {
        set_condition(&mut conditions, change.condition.clone());
    }
    let patch = json!({
        "metadata": {"resourceVersion": runtime.resource_version()},
        "status": {"conditions": conditions},
    });
    if let Err(error) = api
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        debug!(runtime = %name, error = %error, "cannot write the Runtime's conditions; the next pass tries again");
        return match error {
            kube::Error::Api(status) if status.code == 409 => Written::Conflict,
            _ => Written::Failed,
        };
    }
    for change in changes {
        debug!(runtime = %name, condition = %change.condition.type_, status = %change.condition.status, "Runtime condition written");
        if let Some(reason) = change.warning {
            let note = change.condition.message.unwrap_or_default();
            events.publish(runtime, EventType::Warning, reason, "Provision", &note);
        }
    }
    Written::Done
}

#[cfg(test)]
mod tests {
    use kruntimes_api::runtime::RuntimeStatus;

    use super::*;
    use crate::provisioner::Retry;
    use crate::test_support::bare_runtime;

    #[test]
    fn the_condition_follows_the_last_pass_and_is_written_only_on_change() {
        let mut rt = bare_runtime("rt");
        let refused = Failure {
            reason: "InvalidTemplate",
            retry: Retry::OnChange,
        };
        let failed = wanted(&rt, Some((refused, "no runtime container"))).expect("a condition");
        assert_eq!(failed.status, "False");
        assert_eq!(failed.reason.as_deref(), Some("InvalidTemplate"));
        assert_eq!(failed.message.as_deref(), Some("no runtime container"));
        rt.status = Some(RuntimeStatus {
            conditions: vec![failed],
            ..RuntimeStatus::default()
        });
        assert_eq!(wanted(&rt, Some((refused, "no runtime container"))), None);
        let other = wanted(&rt, Some((refused, "a duplicate volume"))).expect("a new message");
        assert_eq!(other.status, "False");
        // A passing failure already shown with its reason is not rewritten for new text.
        let passing = wanted(&rt, Some((Failure::TRANSIENT, "500: try 1"))).expect("turned");
        let shown = RuntimeStatus {
            conditions: vec![passing],
            ..RuntimeStatus::default()
        };
        let mut failing = rt.clone();
        failing.status = Some(shown);
        assert_eq!(
            wanted(&failing, Some((Failure::TRANSIENT, "500: try 2"))),
            None
        );
        // A new generation is observed again.
        let mut newer = failing.clone();
        newer.metadata.generation = Some(2);
        assert!(wanted(&newer, Some((Failure::TRANSIENT, "500: try 2"))).is_some());
        let fixed = wanted(&rt, None).expect("provisioned");
        assert_eq!(fixed.status, "True");
        assert_eq!(fixed.reason.as_deref(), Some(PROVISIONED));
        let long = "x".repeat(64 * 1024);
        let bounded = wanted(&rt, Some((Failure::TRANSIENT, &long))).expect("a condition");
        assert!(bounded.message.expect("a message").len() < long.len());
    }
}
