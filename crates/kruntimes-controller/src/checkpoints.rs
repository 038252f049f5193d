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
//! Run is gone is deleted, with the same exception. Only this controller deletes suspend
//! Snapshots: they carry no owner reference, so that no garbage collector takes one a fork
//! still starts from. The data goes with the next round of the collector
//! ([`crate::snapshot_gc`]), unless a checkpoint refers to it.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kruntimes_api::lifecycle::{bounded_message, now_rfc3339};
use kruntimes_api::snapshot::{SnapshotPhase, SnapshotReason, SnapshotStatus};
use kruntimes_api::{Run, Snapshot};
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
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

/// How often a suspend Snapshot that is kept is looked at again, whatever the watches say:
/// a Run deleted while the Run watch was relisting raises no event of its own.
const SUSPEND_RECHECK: Duration = Duration::from_secs(300);

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

/// The Run a suspend Snapshot belongs to: (name, UID) of `spec.source.run`, which its worker
/// pins. One written before suspend Snapshots lost their owner reference may pin none: its
/// owner reference of kind Run says then.
fn owner_run(snapshot: &Snapshot) -> Option<(&str, &str)> {
    let source = &snapshot.spec.source.run;
    match source.uid.as_deref() {
        Some(uid) => Some((source.name.as_str(), uid)),
        None => snapshot
            .owner_references()
            .iter()
            .find(|o| o.kind == "Run")
            .map(|o| (o.name.as_str(), o.uid.as_str())),
    }
}

/// The incarnation of the Run's own suspend Snapshot that `run` was last suspended to;
/// `None` when it names none, or another Run's (a fork created Suspended names its source).
fn own_suspend_incarnation(run: &Run) -> Option<u64> {
    let named = &run.status.as_ref()?.snapshot.as_ref()?.name;
    let incarnation = suspend_incarnation(named)?;
    (*named == kruntimes_api::snapshot::suspend_snapshot_name(&run.name_any(), incarnation))
        .then_some(incarnation)
}

/// Whether a Run of `runs` that has not ended starts from the Snapshot `name` (a fork).
fn forked_from(name: &str, runs: &[Run]) -> bool {
    kruntimes_api::snapshot::fork_of(name, runs).is_some()
}

/// Whether the final suspend Snapshot `snapshot` is superseded: its owner `run` (read now)
/// was last suspended to a later incarnation's Snapshot of its own, and no Run of `runs`
/// (the namespace's, read now) that has not ended starts from it. Pure.
pub fn superseded(snapshot: &Snapshot, run: Option<&Run>, runs: &[Run]) -> bool {
    let name = snapshot.name_any();
    let (Some((_, owner_uid)), Some(run), Some(ours)) =
        (owner_run(snapshot), run, suspend_incarnation(&name))
    else {
        return false;
    };
    final_suspend(snapshot)
        && run.uid().as_deref() == Some(owner_uid)
        && own_suspend_incarnation(run).is_some_and(|latest| latest > ours)
        && !forked_from(&name, runs)
}

/// Whether the suspend Snapshot `snapshot` is orphaned: its owner `run` (read now) is gone
/// or another Run of that name, and no Run of `runs` that has not ended starts from it. Pure.
pub fn orphaned(snapshot: &Snapshot, run: Option<&Run>, runs: &[Run]) -> bool {
    let Some((_, owner_uid)) = owner_run(snapshot) else {
        return false;
    };
    live_suspend(snapshot)
        && run.is_none_or(|run| run.uid().as_deref() != Some(owner_uid))
        && !forked_from(&snapshot.name_any(), runs)
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
                // A fork's source may be deletable once the fork ends.
                let forked = run.spec.fork_source().map(|source| source.name.clone());
                snapshots
                    .state()
                    .into_iter()
                    .filter(|s| {
                        s.namespace() == namespace
                            && ((s.spec.run_name() == name && pending_checkpoint(s))
                                || (live_suspend(s)
                                    && (owner_run(s).map(|(_, u)| u) == uid.as_deref()
                                        || forked.as_deref() == Some(s.name_any().as_str()))))
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

/// The reason of a checkpoint of a Suspended session whose data went before the checkpoint
/// could refer to it.
pub const SOURCE_GONE_REASON: &str = "SourceGone";

/// How long a checkpoint of a Suspended session waits before it looks again whether the
/// Snapshot its Run names is Ready.
const REFER_RECHECK: Duration = Duration::from_secs(2);

/// When `run` last became Suspended (its Suspended condition's transition to True).
fn suspended_since(run: &Run) -> Option<k8s_openapi::jiff::Timestamp> {
    run.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == kruntimes_api::lifecycle::SUSPENDED_CONDITION && c.status == "True")?
        .last_transition_time
        .as_deref()?
        .parse()
        .ok()
}

/// The Snapshot a checkpoint of the Suspended session `run` may refer to, by name: the
/// Run's own suspend Snapshot, when the checkpoint was asked for once the session was
/// Suspended: at the earliest in the second of its suspend (creation times have whole
/// seconds), so a checkpoint asked for in the instant before a suspend began may also hold
/// what the session accepted in that instant. One asked for earlier waits for the resume,
/// where its worker takes it. Pure.
pub fn may_refer(checkpoint: &Snapshot, run: &Run) -> Option<String> {
    if run.phase() != kruntimes_api::Phase::Suspended {
        return None;
    }
    let created = checkpoint.metadata.creation_timestamp.as_ref()?.0;
    let since = suspended_since(run)?;
    own_suspend_incarnation(run)?;
    (created.as_second() >= since.as_second())
        .then(|| {
            run.status
                .as_ref()?
                .snapshot
                .as_ref()
                .map(|s| s.name.clone())
        })
        .flatten()
}

/// The status of a checkpoint of `run` that refers to `source` (the Ready suspend
/// Snapshot the Run names), when the source is of the Run's incarnation: a session that
/// lost its worker is suspended again to an earlier incarnation's data, which lacks what
/// the lost worker accepted, and its checkpoint waits for the resume instead. Capturing,
/// with the source's location, digest and sizes; [`finish_referring`] makes it Ready once
/// the source is known to have outlived the write. Pure.
pub fn referring_status(source: &Snapshot, run: &Run) -> Option<SnapshotStatus> {
    let status = source.status.as_ref()?;
    if status.phase != Some(SnapshotPhase::Ready) || status.incarnation != Some(run.incarnation()) {
        return None;
    }
    Some(SnapshotStatus {
        phase: Some(SnapshotPhase::Capturing),
        size_bytes: status.size_bytes,
        compressed_bytes: status.compressed_bytes,
        files: status.files,
        digest: status.digest.clone(),
        last_sequence: status.last_sequence,
        incarnation: status.incarnation,
        location: Some(status.location.clone()?),
        message: Some(format!(
            "the session was Suspended: refers to the data of Snapshot {}",
            source.name_any()
        )),
        ..SnapshotStatus::default()
    })
}

/// Reads the Snapshot `name` now.
async fn get_snapshot(
    context: &Context,
    namespace: &str,
    name: &str,
) -> Result<Option<Snapshot>, Error> {
    Api::<Snapshot>::namespaced(context.client.clone(), namespace)
        .get_opt(name)
        .await
        .map_err(|source| Error::List {
            what: "snapshots",
            namespace: namespace.to_string(),
            source,
        })
}

/// Writes `status` on `checkpoint` with the resourceVersion it was read at; whether it was
/// written (a conflict or a deletion: decided again on the next event).
async fn write_checkpoint(
    context: &Context,
    checkpoint: &Snapshot,
    status: SnapshotStatus,
) -> Result<Option<Snapshot>, Error> {
    let namespace = checkpoint.namespace().unwrap_or_default();
    let mut written = checkpoint.clone();
    written.metadata.managed_fields = None;
    written.status = Some(status);
    let api = Api::<Snapshot>::namespaced(context.client.clone(), &namespace);
    match api
        .replace_status(&checkpoint.name_any(), &PostParams::default(), &written)
        .await
    {
        Ok(written) => Ok(Some(written)),
        Err(e) if is_conflict(&e) || is_not_found(&e) => Ok(None),
        Err(source) => Err(Error::List {
            what: "snapshots/status",
            namespace,
            source,
        }),
    }
}

/// A referring checkpoint (Capturing, with a location: a worker's has none until Ready)
/// becomes Ready if the Snapshot whose data it names still names it, read after the
/// Capturing write; else Failed `SourceGone`. The collector marks every location a
/// Snapshot names, so once the source is seen after that write, the data is marked in
/// every round since (a UID that is deleted never returns).
async fn finish_referring(context: &Context, checkpoint: &Snapshot) -> Result<Action, Error> {
    let namespace = checkpoint.namespace().unwrap_or_default();
    let status = checkpoint.status.clone().unwrap_or_default();
    let Some(location) = status.location.clone() else {
        return Ok(Action::await_change());
    };
    let source = status
        .message
        .as_deref()
        .and_then(|m| m.rsplit_once("Snapshot "))
        .map(|(_, name)| name.to_string());
    let kept = match &source {
        Some(name) => get_snapshot(context, &namespace, name)
            .await?
            .is_some_and(|s| {
                s.status
                    .as_ref()
                    .and_then(|st| st.location.as_ref())
                    .is_some_and(|l| l.uri == location.uri)
            }),
        None => false,
    };
    let (finished, outcome) = if kept {
        (
            SnapshotStatus {
                phase: Some(SnapshotPhase::Ready),
                completion_time: Some(now_rfc3339()),
                ..status
            },
            "Ready: it refers to the suspended session's data".to_string(),
        )
    } else {
        let message = format!(
            "the data of Snapshot {} went before the checkpoint could refer to it",
            source.as_deref().unwrap_or("?")
        );
        (
            SnapshotStatus {
                phase: Some(SnapshotPhase::Failed),
                reason: Some(SOURCE_GONE_REASON.to_string()),
                message: Some(bounded_message(&message)),
                completion_time: Some(now_rfc3339()),
                ..SnapshotStatus::default()
            },
            format!("failed {SOURCE_GONE_REASON}: {message}"),
        )
    };
    if write_checkpoint(context, checkpoint, finished)
        .await?
        .is_some()
    {
        info!(snapshot = %checkpoint.name_any(), namespace, "checkpoint {outcome}");
    }
    Ok(Action::await_change())
}

async fn reconcile(snapshot: Arc<Snapshot>, context: Arc<Context>) -> Result<Action, Error> {
    if live_suspend(&snapshot) {
        return drop_suspend(&snapshot, &context).await;
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
    match verdict(&snapshot, run.as_ref()) {
        Verdict::Fail(reason, message) => {
            let failed = SnapshotStatus {
                phase: Some(SnapshotPhase::Failed),
                reason: Some(reason.to_string()),
                message: Some(bounded_message(&message)),
                completion_time: Some(now_rfc3339()),
                ..SnapshotStatus::default()
            };
            if write_checkpoint(&context, &snapshot, failed)
                .await?
                .is_some()
            {
                info!(snapshot = %snapshot.name_any(), namespace, reason, "checkpoint failed: {message}");
            }
            Ok(Action::await_change())
        }
        Verdict::Wait => {
            let referring = snapshot
                .status
                .as_ref()
                .is_some_and(|s| s.location.is_some());
            match snapshot.phase() {
                SnapshotPhase::Capturing if referring => {
                    finish_referring(&context, &snapshot).await
                }
                SnapshotPhase::Pending => {
                    let Some(source) = run.as_ref().and_then(|run| may_refer(&snapshot, run))
                    else {
                        return Ok(Action::await_change());
                    };
                    let source = get_snapshot(&context, &namespace, &source).await?;
                    let Some(status) = source
                        .as_ref()
                        .zip(run.as_ref())
                        .and_then(|(source, run)| referring_status(source, run))
                    else {
                        // Not Ready yet, gone, or of an earlier incarnation: look again
                        // shortly (a resume's worker takes it then).
                        return Ok(Action::requeue(REFER_RECHECK));
                    };
                    match write_checkpoint(&context, &snapshot, status).await? {
                        Some(written) => finish_referring(&context, &written).await,
                        None => Ok(Action::await_change()),
                    }
                }
                _ => Ok(Action::await_change()),
            }
        }
    }
}

/// Deletes the suspend Snapshot `snapshot` if it is [`orphaned`] (no garbage collector
/// does: it has no owner reference) or [`superseded`]; deciding on fresh reads of its Run
/// and of the namespace's Runs (a fork created a moment ago must keep its source), and
/// deleting only the very object decided on (UID and resourceVersion preconditions). A
/// kept one is looked at again after [`SUSPEND_RECHECK`].
async fn drop_suspend(snapshot: &Snapshot, context: &Context) -> Result<Action, Error> {
    let Some((owner, _)) = owner_run(snapshot) else {
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
    if !orphaned(snapshot, run.as_ref(), &[]) && !superseded(snapshot, run.as_ref(), &[]) {
        return Ok(Action::requeue(SUSPEND_RECHECK));
    }
    let all = kruntimes_api::paging::list_all(&runs, &ListParams::default())
        .await
        .map_err(list_error)?;
    let why = if orphaned(snapshot, run.as_ref(), &all) {
        "its Run is gone"
    } else if superseded(snapshot, run.as_ref(), &all) {
        "superseded"
    } else {
        return Ok(Action::requeue(SUSPEND_RECHECK));
    };
    let api = Api::<Snapshot>::namespaced(context.client.clone(), &namespace);
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: snapshot.uid(),
            resource_version: snapshot.resource_version(),
        }),
        ..DeleteParams::default()
    };
    match api.delete(&snapshot.name_any(), &params).await {
        Ok(_) => {
            info!(snapshot = %snapshot.name_any(), namespace, run = owner, "deleted a suspend Snapshot: {why}");
            Ok(Action::await_change())
        }
        // Gone, or changed since it was read: decided again on its next event.
        Err(e) if is_not_found(&e) || is_conflict(&e) => Ok(Action::await_change()),
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
        // Orphaned (its Run gone, or another Run of that name): deletable, unless a fork
        // starts from it.
        assert!(orphaned(&older, None, &[]));
        assert!(orphaned(&older, Some(&other), &[]));
        assert!(!orphaned(&older, Some(&run), &[]));
        assert!(!orphaned(&older, None, std::slice::from_ref(&fork)));
        if let Some(status) = fork.status.as_mut() {
            status.phase = Some(Phase::Succeeded);
        }
        assert!(superseded(&older, Some(&run), std::slice::from_ref(&fork)));
        assert!(orphaned(&older, None, &[fork]));
        // A Run created Suspended from another Run's Snapshot (a fork) names that one:
        // none of its own suspend Snapshots is superseded by it.
        let mut forked = run.clone();
        if let Some(status) = forked.status.as_mut() {
            status.snapshot = Some(kruntimes_api::run::RunSnapshotRef {
                name: "source-s7".into(),
                ..Default::default()
            });
        }
        assert!(!superseded(&older, Some(&forked), &[]));
    }

    #[test]
    fn a_checkpoint_refers_to_suspend_data_only_when_asked_for_after_the_suspend() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let at = |text: &str| {
            text.parse::<k8s_openapi::jiff::Timestamp>()
                .expect("a timestamp")
        };
        let mut run = session(Phase::Suspended);
        if let Some(status) = run.status.as_mut() {
            status.snapshot = Some(kruntimes_api::run::RunSnapshotRef {
                name: "s1-s3".into(),
                ..Default::default()
            });
            status.conditions = vec![kruntimes_api::run::RunCondition {
                type_: kruntimes_api::lifecycle::SUSPENDED_CONDITION.into(),
                status: "True".into(),
                last_transition_time: Some("2026-12-05T10:00:05.300000Z".into()),
                ..Default::default()
            }];
        }
        let asked = |time: &str| {
            let mut cp = checkpoint("s1", None);
            cp.metadata.creation_timestamp = Some(Time(at(time)));
            cp
        };
        assert_eq!(
            may_refer(&asked("2026-12-05T10:00:06Z"), &run).as_deref(),
            Some("s1-s3")
        );
        // Within the suspend's second: refers; before it: waits for the resume.
        assert_eq!(
            may_refer(&asked("2026-12-05T10:00:05Z"), &run).as_deref(),
            Some("s1-s3")
        );
        assert_eq!(may_refer(&asked("2026-12-05T10:00:04Z"), &run), None);
        // The data of another incarnation (a lost worker's session suspended again to an
        // earlier one) is not referred to.
        if let Some(status) = run.status.as_mut() {
            status.incarnation = Some(3);
        }
        let mut source = checkpoint("s1", None);
        source.status = Some(SnapshotStatus {
            phase: Some(SnapshotPhase::Ready),
            incarnation: Some(3),
            location: Some(kruntimes_api::snapshot::SnapshotLocation {
                uri: "file:///s/archive.tar.zst".into(),
                manifest_uri: None,
            }),
            ..Default::default()
        });
        assert!(referring_status(&source, &run).is_some());
        if let Some(status) = run.status.as_mut() {
            status.incarnation = Some(4);
        }
        assert!(referring_status(&source, &run).is_none());
        // Not Suspended, or suspended to another Run's Snapshot (a fork): waits.
        let mut ready = run.clone();
        if let Some(status) = ready.status.as_mut() {
            status.phase = Some(Phase::Ready);
        }
        assert_eq!(may_refer(&asked("2026-12-05T10:00:06Z"), &ready), None);
        let mut forked = run.clone();
        if let Some(status) = forked.status.as_mut() {
            status.snapshot = Some(kruntimes_api::run::RunSnapshotRef {
                name: "source-s7".into(),
                ..Default::default()
            });
        }
        assert_eq!(may_refer(&asked("2026-12-05T10:00:06Z"), &forked), None);
    }
}
