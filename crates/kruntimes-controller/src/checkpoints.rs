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
//! refused.
//!
//! A checkpoint of a Suspended session refers to the data it was suspended to, without a
//! copy: once the Snapshot its Run names (`status.snapshot`) is Ready, the checkpoint is
//! written Ready with that Snapshot's location, digest and sizes (nothing ran since the
//! suspend, so it holds every operation accepted before it). The collector keeps data that
//! any Snapshot's location names, so it outlives the suspend Snapshot. Runs are watched:
//! a Run's change requeues the checkpoints that name it, and its suspend Snapshots.
//!
//! It also keeps only the latest suspend Snapshot of a session: a final suspend Snapshot
//! (`<run>-s<n>`) of an incarnation before the one its Run was last suspended to is
//! deleted, unless a fork that has not ended starts from it; and a suspend Snapshot whose
//! Run is gone is deleted (the embedded API server does not collect by owner reference,
//! and a Suspended session has no worker to do it). The data goes with the next round of
//! the collector ([`crate::snapshot_gc`]), unless a checkpoint refers to it.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kruntimes_api::lifecycle::{bounded_message, now_rfc3339};
use kruntimes_api::snapshot::{SnapshotPhase, SnapshotReason, SnapshotStatus};
use kruntimes_api::{Run, Snapshot};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
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

/// The incarnation a suspend Snapshot's name ends with (`<run>-s<n>`).
fn suspend_incarnation(name: &str) -> Option<u64> {
    name.rsplit_once("-s")?.1.parse().ok()
}

/// Whether `snapshot` is a suspend Snapshot not being deleted.
fn live_suspend(snapshot: &Snapshot) -> bool {
    snapshot.spec.reason == Some(SnapshotReason::Suspend)
        && snapshot.meta().deletion_timestamp.is_none()
}

/// Whether `snapshot` is a suspend Snapshot that may be no longer needed, before its owner
/// is read: final and not being deleted.
fn final_suspend(snapshot: &Snapshot) -> bool {
    live_suspend(snapshot) && snapshot.phase().is_terminal()
}

/// The Run that owns `snapshot`: (name, UID) of its owner reference of kind Run.
fn owner_run(snapshot: &Snapshot) -> Option<(&str, &str)> {
    snapshot
        .owner_references()
        .iter()
        .find(|o| o.kind == "Run")
        .map(|o| (o.name.as_str(), o.uid.as_str()))
}

/// Whether the final suspend Snapshot `snapshot` is superseded: its owner `run` (read now)
/// was last suspended to a later incarnation's Snapshot, and no Run of `runs` (the
/// namespace's, read now) that has not ended starts from it. Pure.
pub fn superseded(snapshot: &Snapshot, run: Option<&Run>, runs: &[Run]) -> bool {
    let name = snapshot.name_any();
    let (Some((_, owner_uid)), Some(run), Some(ours)) =
        (owner_run(snapshot), run, suspend_incarnation(&name))
    else {
        return false;
    };
    let latest = run
        .status
        .as_ref()
        .and_then(|s| s.snapshot.as_ref())
        .and_then(|s| suspend_incarnation(&s.name));
    let pinned = runs.iter().any(|r| {
        !r.phase().is_terminal()
            && r.spec
                .fork_source()
                .is_some_and(|source| source.name == name)
    });
    final_suspend(snapshot)
        && run.uid().as_deref() == Some(owner_uid)
        && latest.is_some_and(|latest| latest > ours)
        && !pinned
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
                let uid = run.uid();
                snapshots
                    .state()
                    .into_iter()
                    .filter(|s| {
                        s.namespace() == namespace
                            && ((s.spec.run_name() == name && pending_checkpoint(s))
                                || (live_suspend(s)
                                    && owner_run(s).map(|(_, u)| u) == uid.as_deref()))
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

/// The status of a checkpoint of a Suspended session that refers to `suspended_to` (the
/// Snapshot its Run names), when that one is Ready. Pure.
pub fn referring_status(suspended_to: &Snapshot) -> Option<SnapshotStatus> {
    let status = suspended_to.status.as_ref()?;
    if status.phase != Some(SnapshotPhase::Ready) {
        return None;
    }
    Some(SnapshotStatus {
        phase: Some(SnapshotPhase::Ready),
        size_bytes: status.size_bytes,
        compressed_bytes: status.compressed_bytes,
        files: status.files,
        digest: status.digest.clone(),
        last_sequence: status.last_sequence,
        incarnation: status.incarnation,
        location: Some(status.location.clone()?),
        message: Some(format!(
            "the session was Suspended: refers to the data of Snapshot {}",
            suspended_to.name_any()
        )),
        completion_time: Some(now_rfc3339()),
        ..SnapshotStatus::default()
    })
}

/// For a checkpoint of the Suspended session `run`: the status that refers to the data it
/// was suspended to, once that Snapshot (read now) is Ready and is still the one the Run
/// names; `None` to wait.
async fn refer_to_suspend_data(
    context: &Context,
    namespace: &str,
    run: &Run,
) -> Result<Option<SnapshotStatus>, Error> {
    if run.phase() != kruntimes_api::Phase::Suspended {
        return Ok(None);
    }
    let Some(named) = run.status.as_ref().and_then(|s| s.snapshot.as_ref()) else {
        return Ok(None);
    };
    let api = Api::<Snapshot>::namespaced(context.client.clone(), namespace);
    let suspended_to = api
        .get_opt(&named.name)
        .await
        .map_err(|source| Error::List {
            what: "snapshots",
            namespace: namespace.to_string(),
            source,
        })?;
    Ok(suspended_to
        .as_ref()
        // The very data the Run was suspended to (a URI it recorded must match).
        .filter(|s| {
            named.uri.is_none()
                || s.status
                    .as_ref()
                    .and_then(|st| st.location.as_ref())
                    .map(|l| &l.uri)
                    == named.uri.as_ref()
        })
        .and_then(referring_status))
}

async fn reconcile(snapshot: Arc<Snapshot>, context: Arc<Context>) -> Result<Action, Error> {
    if live_suspend(&snapshot) {
        return drop_superseded(&snapshot, &context).await;
    }
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
    let (status, outcome) = match verdict(&snapshot, run.as_ref()) {
        Verdict::Fail(reason, message) => (
            SnapshotStatus {
                phase: Some(SnapshotPhase::Failed),
                reason: Some(reason.to_string()),
                message: Some(bounded_message(&message)),
                completion_time: Some(now_rfc3339()),
                ..SnapshotStatus::default()
            },
            format!("failed {reason}: {message}"),
        ),
        Verdict::Wait => {
            // Only a Pending one: a Capturing checkpoint is a worker's.
            let pending = snapshot.phase() == SnapshotPhase::Pending;
            let referring = match (pending, run.as_ref()) {
                (true, Some(run)) => refer_to_suspend_data(&context, &namespace, run).await?,
                _ => None,
            };
            let Some(status) = referring else {
                return Ok(Action::await_change());
            };
            (
                status,
                "Ready: it refers to the suspended session's data".to_string(),
            )
        }
    };
    let mut written = (*snapshot).clone();
    written.metadata.managed_fields = None;
    written.status = Some(status);
    let api = Api::<Snapshot>::namespaced(context.client.clone(), &namespace);
    match api
        .replace_status(&snapshot.name_any(), &PostParams::default(), &written)
        .await
    {
        Ok(_) => {
            info!(snapshot = %snapshot.name_any(), namespace, "checkpoint {outcome}");
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

/// Deletes the suspend Snapshot `snapshot` if its Run is gone (the embedded API server
/// does not collect by owner reference, and a Suspended session has no worker to do it),
/// or if it is final and [`superseded`]; deciding on fresh reads of its Run and of the
/// namespace's Runs (a fork created a moment ago must keep its source).
async fn drop_superseded(snapshot: &Snapshot, context: &Context) -> Result<Action, Error> {
    let Some((owner, owner_uid)) = owner_run(snapshot) else {
        return Ok(Action::await_change());
    };
    let namespace = snapshot.namespace().unwrap_or_default();
    let runs = Api::<Run>::namespaced(context.client.clone(), &namespace);
    let list_error = |source| Error::List {
        what: "runs",
        namespace: namespace.clone(),
        source,
    };
    let run = runs.get_opt(owner).await.map_err(list_error)?;
    let orphaned = run
        .as_ref()
        .is_none_or(|run| run.uid().as_deref() != Some(owner_uid));
    if !orphaned && !superseded(snapshot, run.as_ref(), &[]) {
        return Ok(Action::await_change());
    }
    let all = runs
        .list(&ListParams::default())
        .await
        .map_err(list_error)?
        .items;
    if !orphaned && !superseded(snapshot, run.as_ref(), &all) {
        return Ok(Action::await_change());
    }
    let api = Api::<Snapshot>::namespaced(context.client.clone(), &namespace);
    match api
        .delete(&snapshot.name_any(), &DeleteParams::default())
        .await
    {
        Ok(_) => {
            let why = if orphaned {
                "its Run is gone"
            } else {
                "superseded"
            };
            info!(snapshot = %snapshot.name_any(), namespace, run = owner, "deleted a suspend Snapshot: {why}");
            Ok(Action::await_change())
        }
        Err(e) if is_not_found(&e) => Ok(Action::await_change()),
        Err(source) => Err(Error::List {
            what: "snapshots",
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

    #[test]
    fn only_a_final_suspend_snapshot_of_an_earlier_incarnation_nobody_forks_is_superseded() {
        let suspend = |name: &str, phase: SnapshotPhase| {
            let mut snapshot = checkpoint("s1", None);
            snapshot.metadata.name = Some(name.into());
            snapshot.spec.reason = Some(SnapshotReason::Suspend);
            snapshot.metadata.owner_references = Some(vec![
                k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                    kind: "Run".into(),
                    name: "s1".into(),
                    uid: "u-1".into(),
                    ..Default::default()
                },
            ]);
            snapshot.status = Some(SnapshotStatus {
                phase: Some(phase),
                ..Default::default()
            });
            snapshot
        };
        let mut run = session(Phase::Suspended);
        if let Some(status) = run.status.as_mut() {
            status.snapshot = Some(kruntimes_api::run::RunSnapshotRef {
                name: "s1-s3".into(),
                ..Default::default()
            });
        }
        assert!(superseded(
            &suspend("s1-s2", SnapshotPhase::Ready),
            Some(&run),
            &[]
        ));
        assert!(superseded(
            &suspend("s1-s1", SnapshotPhase::Failed),
            Some(&run),
            &[]
        ));
        // The latest, a later one (a suspend under way at the next incarnation), one not
        // final, or one whose owner is gone or another Run of that name: kept.
        assert!(!superseded(
            &suspend("s1-s3", SnapshotPhase::Ready),
            Some(&run),
            &[]
        ));
        assert!(!superseded(
            &suspend("s1-s4", SnapshotPhase::Failed),
            Some(&run),
            &[]
        ));
        assert!(!superseded(
            &suspend("s1-s2", SnapshotPhase::Capturing),
            Some(&run),
            &[]
        ));
        assert!(!superseded(
            &suspend("s1-s2", SnapshotPhase::Ready),
            None,
            &[]
        ));
        let mut other = run.clone();
        other.metadata.uid = Some("u-2".into());
        assert!(!superseded(
            &suspend("s1-s2", SnapshotPhase::Ready),
            Some(&other),
            &[]
        ));
        // A fork that has not ended starts from it: kept; once the fork ended, not.
        let mut fork = session(Phase::Suspended);
        fork.spec.source = Some(kruntimes_api::run::RunSource {
            inline: None,
            snapshot: Some(ObjectReference {
                name: "s1-s2".into(),
                uid: None,
            }),
        });
        let older = suspend("s1-s2", SnapshotPhase::Ready);
        assert!(!superseded(&older, Some(&run), std::slice::from_ref(&fork)));
        if let Some(status) = fork.status.as_mut() {
            status.phase = Some(Phase::Succeeded);
        }
        assert!(superseded(&older, Some(&run), &[fork]));
    }
}
