//! Checkpoints no worker will take (design document 003; issue 20 item 1).
//!
//! The worker that owns a session takes its checkpoints (`spec.reason: Checkpoint`) as
//! barriers in its queue. A checkpoint of a session that is not there to take it would
//! stay Pending for ever: this controller fails it, with the reason, when its Run
//!
//! - does not exist, or has another UID than `spec.source.run.uid` pins
//!   (`RunNotFound`);
//! - is not a session (`NotASession`);
//! - has ended or is being deleted (`SessionEnded`).
//!
//! A Capturing checkpoint of such a Run fails too (its worker died with the session, or
//! the session ended under the capture). Every write carries the `resourceVersion` it was
//! decided on, so of a worker's and this controller's the first wins and the other is
//! refused. A checkpoint of a Suspended session waits until the session resumes. Runs are watched:
//! a Run's change requeues the checkpoints that name it.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kruntimes_api::lifecycle::{bounded_message, now_rfc3339};
use kruntimes_api::snapshot::{SnapshotPhase, SnapshotReason, SnapshotStatus};
use kruntimes_api::{Run, Snapshot};
use kube::api::{Api, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use tracing::{info, warn};

use crate::error::{Error, is_conflict, is_not_found};

/// The reason of a checkpoint whose Run does not exist (or is another Run of that name).
pub const RUN_NOT_FOUND_REASON: &str = "RunNotFound";
/// The reason of a checkpoint of a Run that is not a session.
pub const NOT_A_SESSION_REASON: &str = "NotASession";
/// The reason of a checkpoint of a session that ended before it was taken.
pub const SESSION_ENDED_REASON: &str = "SessionEnded";

/// How long a failed reconcile waits before it is tried again.
const ERROR_REQUEUE: Duration = Duration::from_secs(5);

/// What becomes of a checkpoint, given its Run as read now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Its worker takes it (or will, once the session is placed or resumed).
    Wait,
    /// No worker will: Failed with this reason and message.
    Fail(&'static str, String),
}

/// Decides what becomes of `snapshot` (a Pending checkpoint) with its Run `run` (`None`:
/// not found). Pure.
pub fn verdict(snapshot: &Snapshot, run: Option<&Run>) -> Verdict {
    let source = &snapshot.spec.source.run;
    let Some(run) = run.filter(|run| source.matches(&run.name_any(), run.uid().as_deref())) else {
        return Verdict::Fail(
            RUN_NOT_FOUND_REASON,
            match &source.uid {
                Some(uid) => format!("no Run {:?} with UID {uid}", source.name),
                None => format!("no Run {:?}", source.name),
            },
        );
    };
    if run.spec.mode.session.is_none() {
        return Verdict::Fail(
            NOT_A_SESSION_REASON,
            format!(
                "Run {:?} is not a session: only a session is checkpointed",
                source.name
            ),
        );
    }
    if run.phase().is_terminal() || run.meta().deletion_timestamp.is_some() {
        return Verdict::Fail(
            SESSION_ENDED_REASON,
            format!(
                "the session ended ({}) before the checkpoint was taken",
                run.phase().as_str()
            ),
        );
    }
    Verdict::Wait
}

/// Whether `snapshot` is a checkpoint this controller looks at: not final, not deleting.
fn pending_checkpoint(snapshot: &Snapshot) -> bool {
    snapshot.spec.reason.unwrap_or_default() == SnapshotReason::Checkpoint
        && !snapshot.phase().is_terminal()
        && snapshot.meta().deletion_timestamp.is_none()
}

struct Context {
    client: Client,
}

/// Runs the checkpoint controller until its watches end for good.
pub(crate) async fn run(client: Client) -> Result<(), Error> {
    let controller = Controller::new(
        Api::<Snapshot>::all(client.clone()),
        watcher::Config::default(),
    );
    let snapshots = controller.store();
    controller
        .watches(
            Api::<Run>::all(client.clone()),
            watcher::Config::default(),
            move |run: Run| {
                let name = run.name_any();
                let namespace = run.namespace();
                snapshots
                    .state()
                    .into_iter()
                    .filter(|s| {
                        s.namespace() == namespace
                            && s.spec.run_name() == name
                            && pending_checkpoint(s)
                    })
                    .map(|s| ObjectRef::from_obj(&*s))
                    .collect::<Vec<_>>()
            },
        )
        .run(reconcile, error_policy, Arc::new(Context { client }))
        .for_each(|result| async move {
            if let Err(error) = result {
                warn!(error = %error, "checkpoint reconcile failed");
            }
        })
        .await;
    Err(Error::ControllerStopped {
        controller: "checkpoint",
    })
}

fn error_policy(_: Arc<Snapshot>, _: &Error, _: Arc<Context>) -> Action {
    Action::requeue(ERROR_REQUEUE)
}

async fn reconcile(snapshot: Arc<Snapshot>, context: Arc<Context>) -> Result<Action, Error> {
    if !pending_checkpoint(&snapshot) {
        return Ok(Action::await_change());
    }
    let namespace = snapshot.namespace().unwrap_or_default();
    let runs = Api::<Run>::namespaced(context.client.clone(), &namespace);
    // A fresh read, not a cache: a Run created a moment ago must not fail its checkpoint.
    let run = runs
        .get_opt(snapshot.spec.run_name())
        .await
        .map_err(|source| Error::List {
            what: "runs",
            namespace: namespace.clone(),
            source,
        })?;
    let Verdict::Fail(reason, message) = verdict(&snapshot, run.as_ref()) else {
        return Ok(Action::await_change());
    };
    let mut failed = (*snapshot).clone();
    failed.metadata.managed_fields = None;
    failed.status = Some(SnapshotStatus {
        phase: Some(SnapshotPhase::Failed),
        reason: Some(reason.to_string()),
        message: Some(bounded_message(&message)),
        completion_time: Some(now_rfc3339()),
        ..SnapshotStatus::default()
    });
    let api = Api::<Snapshot>::namespaced(context.client.clone(), &namespace);
    match api
        .replace_status(&snapshot.name_any(), &PostParams::default(), &failed)
        .await
    {
        Ok(_) => {
            info!(snapshot = %snapshot.name_any(), namespace, reason, "checkpoint failed: {message}");
            Ok(Action::await_change())
        }
        // It changed (a worker took it) or went: decided again on its next event.
        Err(e) if is_conflict(&e) || is_not_found(&e) => Ok(Action::await_change()),
        Err(source) => Err(Error::List {
            what: "snapshots/status",
            namespace,
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruntimes_api::Phase;
    use kruntimes_api::run::{RunMode, SessionMode};
    use kruntimes_api::snapshot::{ObjectReference, SnapshotSource, SnapshotSpec};

    fn checkpoint(run: &str, uid: Option<&str>) -> Snapshot {
        Snapshot::new(
            "cp",
            SnapshotSpec {
                source: SnapshotSource {
                    run: ObjectReference {
                        name: run.into(),
                        uid: uid.map(str::to_string),
                    },
                },
                reason: None,
            },
        )
    }

    fn session(phase: Phase) -> Run {
        let mut spec = kruntimes_api::RunSpec::task("bash", "");
        spec.mode = RunMode {
            session: Some(SessionMode::default()),
            ..RunMode::default()
        };
        let mut run = Run::new("s1", spec);
        run.metadata.uid = Some("u-1".into());
        run.status = Some(kruntimes_api::RunStatus {
            phase: Some(phase),
            ..Default::default()
        });
        run
    }

    #[test]
    fn only_a_checkpoint_no_worker_will_take_fails() {
        let cp = checkpoint("s1", None);
        assert!(matches!(
            verdict(&cp, None),
            Verdict::Fail(RUN_NOT_FOUND_REASON, _)
        ));
        for phase in [
            Phase::Pending,
            Phase::Scheduled,
            Phase::Running,
            Phase::Ready,
            Phase::Finalizing,
            Phase::Suspended,
        ] {
            assert_eq!(
                verdict(&cp, Some(&session(phase))),
                Verdict::Wait,
                "{phase}"
            );
        }
        for phase in [
            Phase::Succeeded,
            Phase::Failed,
            Phase::Timeout,
            Phase::Cancelled,
        ] {
            assert!(
                matches!(
                    verdict(&cp, Some(&session(phase))),
                    Verdict::Fail(SESSION_ENDED_REASON, _)
                ),
                "{phase}"
            );
        }
        let mut deleting = session(Phase::Ready);
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            ));
        assert!(matches!(
            verdict(&cp, Some(&deleting)),
            Verdict::Fail(SESSION_ENDED_REASON, _)
        ));
        // A pinned UID: another Run of the same name is not the one meant.
        let pinned = checkpoint("s1", Some("u-other"));
        assert!(matches!(
            verdict(&pinned, Some(&session(Phase::Ready))),
            Verdict::Fail(RUN_NOT_FOUND_REASON, _)
        ));
        let mut task = session(Phase::Running);
        task.spec.mode = RunMode::default();
        assert!(matches!(
            verdict(&cp, Some(&task)),
            Verdict::Fail(NOT_A_SESSION_REASON, _)
        ));
    }
}
