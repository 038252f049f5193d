//! Project Workspaces in the controller-manager (issue 20 item 3): the leader deletes a
//! Workspace unused for its `spec.ttlSecondsAfterUnused` and the commit Snapshots whose
//! Workspace is gone, and commits the suspend Snapshot of a Suspended session that ends.
//!
//! One round every [`Config::idle_sweep_interval`](crate::Config) (a minute by default):
//!
//! - **Expiry.** A Workspace with `spec.ttlSecondsAfterUnused` whose last use (the later of
//!   its creation and `status.lastUsedTime`, which every commit writes) is older than that
//!   is deleted, unless a Run named after it exists in any phase: that Run is the
//!   Workspace's lock and may still restore from it or commit to it. The delete carries the
//!   UID and resourceVersion the decision was made on, so a commit that landed meanwhile
//!   (a Workspace used again) makes it fail, and the next round decides afresh.
//! - **Orphaned commits.** A Snapshot with `spec.reason: Commit` whose owner Workspace (by
//!   UID) no longer exists, read again just before, is deleted, with its UID as
//!   precondition. On a cluster the
//!   garbage collector does this through the owner reference; the embedded API server has no
//!   collector, so this does it in standalone mode too. The data goes with the snapshot
//!   collector's next round (nothing refers to it any more).
//!
//! A Workspace deleted while a session holds it is made again by the session's commit
//! (which takes it, having no holder); the commits of the deleted one are collected here.
//!
//! A session with a Workspace that ends while no worker holds it (Suspended, or resumed and
//! not placed yet) has no worker to commit it: [`promote_suspend`] makes its suspend
//! Snapshot the Workspace's commit first.

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kruntimes_api::lifecycle::now_rfc3339;
use kruntimes_api::snapshot::{ObjectReference, SnapshotPhase, SnapshotReason, SnapshotStatus};
use kruntimes_api::workspace::{
    Advance, WORKSPACE_LABEL, WorkspaceHolder, commit_snapshot, commit_snapshot_name,
};
use kruntimes_api::{Phase, Run, Snapshot, Workspace};
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::{Client, ResourceExt};
use tracing::{debug, info, warn};

use crate::error::Error;

/// Objects per page of the lists.
const PAGE: u32 = 500;

/// Runs a round every `interval` while the term lasts (cancel it by dropping the future).
pub(crate) async fn run(client: Client, interval: Duration) -> Result<(), Error> {
    if interval.is_zero() {
        return std::future::pending().await;
    }
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match round(&client).await {
            Ok((0, 0)) => {}
            Ok((expired, orphans)) => debug!(expired, orphans, "workspace round done"),
            Err(error) => warn!(error = %error, "workspace round failed; the next one retries"),
        }
    }
}

/// Every object of `api`, page by page.
async fn list_all<K>(api: &Api<K>, params: ListParams, what: &'static str) -> Result<Vec<K>, Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut params = params.limit(PAGE);
    let mut items = Vec::new();
    loop {
        let page = api.list(&params).await.map_err(|source| Error::List {
            what,
            namespace: String::new(),
            source,
        })?;
        items.extend(page.items);
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(items),
        }
    }
}

/// One round: (Workspaces expired, orphaned commits deleted).
async fn round(client: &Client) -> Result<(usize, usize), Error> {
    let workspaces = list_all(
        &Api::<Workspace>::all(client.clone()),
        ListParams::default(),
        "workspaces",
    )
    .await?;
    let now = Timestamp::now();
    let mut expired = 0;
    let mut live: HashMap<(String, String), String> = HashMap::new();
    for workspace in workspaces {
        let namespace = workspace.namespace().unwrap_or_default();
        let uid = workspace.uid().unwrap_or_default();
        if unused_for(&workspace, now).is_some() {
            match expire(client, &workspace).await {
                Ok(true) => {
                    expired += 1;
                    continue;
                }
                Ok(false) => {}
                Err(error) => {
                    warn!(workspace = %workspace.name_any(), namespace = %namespace, error = %error, "expiring a Workspace failed; the next round retries");
                }
            }
        }
        live.insert((namespace, workspace.name_any()), uid);
    }
    // A commit whose Workspace is not in that listing may be of one made since (a new
    // project's first session): its Workspace is read again before the commit goes.
    let commits = list_all(
        &Api::<Snapshot>::all(client.clone()),
        ListParams::default().labels(WORKSPACE_LABEL),
        "snapshots",
    )
    .await?;
    let mut orphans = 0;
    for commit in commits.iter().filter(|s| orphaned(s, &live)) {
        let namespace = commit.namespace().unwrap_or_default();
        match still_orphaned(client, commit).await {
            Ok(true) => {}
            Ok(false) => continue,
            Err(error) => {
                warn!(snapshot = %commit.name_any(), namespace = %namespace, error = %error, "reading a commit's Workspace failed; the next round decides");
                continue;
            }
        }
        let api = Api::<Snapshot>::namespaced(client.clone(), &namespace);
        match api
            .delete(&commit.name_any(), &precondition(commit.uid(), None))
            .await
        {
            Ok(_) => {
                orphans += 1;
                info!(snapshot = %commit.name_any(), namespace = %namespace, "deleted a commit whose Workspace is gone");
            }
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {}
            Err(error) => {
                warn!(snapshot = %commit.name_any(), namespace = %namespace, error = %error, "deleting an orphaned commit failed");
            }
        }
    }
    Ok((expired, orphans))
}

/// How long `workspace` has gone unused at `now`, when it has a TTL and has outlived it.
fn unused_for(workspace: &Workspace, now: Timestamp) -> Option<Duration> {
    let ttl = u64::try_from(workspace.spec.ttl_seconds_after_unused?).ok()?;
    if workspace.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let created = workspace.metadata.creation_timestamp.as_ref().map(|t| t.0);
    let used = workspace
        .status
        .as_ref()
        .and_then(|s| s.last_used_time.as_deref())
        .and_then(|t| t.parse::<Timestamp>().ok());
    let since = match (created, used) {
        (Some(c), Some(u)) => c.max(u),
        (c, u) => c.or(u)?,
    };
    let unused = since.duration_until(now);
    if unused < SignedDuration::ZERO {
        return None;
    }
    let unused = Duration::try_from(unused).ok()?;
    (unused >= Duration::from_secs(ttl)).then_some(unused)
}

/// Whether `snapshot` is a commit whose owner Workspace (by UID) is not in `live`.
fn orphaned(snapshot: &Snapshot, live: &HashMap<(String, String), String>) -> bool {
    if snapshot.spec.reason != Some(SnapshotReason::Commit)
        || snapshot.metadata.deletion_timestamp.is_some()
    {
        return false;
    }
    let namespace = snapshot.namespace().unwrap_or_default();
    let Some(owner) = snapshot
        .owner_references()
        .iter()
        .find(|o| o.kind == "Workspace")
    else {
        return false;
    };
    live.get(&(namespace, owner.name.clone())) != Some(&owner.uid)
}

/// Whether `commit`'s Workspace, read now, is still gone (or another object of its name).
async fn still_orphaned(client: &Client, commit: &Snapshot) -> Result<bool, kube::Error> {
    let namespace = commit.namespace().unwrap_or_default();
    let Some(owner) = commit
        .owner_references()
        .iter()
        .find(|o| o.kind == "Workspace")
    else {
        return Ok(false);
    };
    let api = Api::<Workspace>::namespaced(client.clone(), &namespace);
    Ok(match api.get_opt(&owner.name).await? {
        Some(workspace) => workspace.uid().as_deref() != Some(owner.uid.as_str()),
        None => true,
    })
}

/// Before a session with a Workspace that no worker holds ends (cancelled, or deleted,
/// while Suspended, or resumed and not placed yet), its suspend Snapshot becomes a commit of
/// the Workspace: a Commit Snapshot `<workspace>-c<run>-<incarnation>-s` that refers to the
/// suspend's data (as a checkpoint of a Suspended session does), and the head moves to it.
///
/// The head can only be older than that data: a session commits only at its end, so none
/// of this Run's commits came after its suspend. A suspend of an earlier incarnation (the
/// session lost its worker after a resume, and was suspended again to it) still holds more
/// than the head. The Workspace must be held by this Run (any incarnation), or by none (it
/// was made again, or the holder was never written): it is then taken.
///
/// Steps, each idempotent (a retry finds what was done): the commit is written `Capturing`
/// with the suspend's location; the suspend Snapshot is read again and must still name that
/// location (the snapshot collector keeps data any Snapshot's location names, and lists the
/// Snapshots after the data: once the source is seen after the `Capturing` write, the data is
/// marked in every round since); only then `Ready`, and the head moves. `Ok(false)`: not
/// done yet (a write kept conflicting): the caller tries again before it ends the Run.
pub(crate) async fn promote_suspend(client: &Client, run: &Run) -> Result<bool, kube::Error> {
    let Some(reference) = &run.spec.workspace else {
        return Ok(true);
    };
    let unplaced = run.status.as_ref().is_none_or(|s| s.assigned_pod.is_none());
    if !matches!(run.phase(), Phase::Suspended | Phase::Pending) || !unplaced {
        return Ok(true);
    }
    let Some(suspend) = run.status.as_ref().and_then(|s| s.snapshot.as_ref()) else {
        return Ok(true);
    };
    let namespace = run.namespace().unwrap_or_default();
    let snapshots = Api::<Snapshot>::namespaced(client.clone(), &namespace);
    let Some(source) = snapshots.get_opt(&suspend.name).await? else {
        return Ok(true);
    };
    let Some(data) = source
        .status
        .clone()
        .filter(|s| s.phase == Some(SnapshotPhase::Ready) && s.location.is_some())
    else {
        return Ok(true);
    };
    let workspaces = Api::<Workspace>::namespaced(client.clone(), &namespace);
    let Some(workspace) = workspaces.get_opt(&reference.name).await? else {
        return Ok(true);
    };
    let run_ref = ObjectReference::of(run);
    let holder = match workspace.status.as_ref().and_then(|s| s.holder.clone()) {
        Some(holder) if holder.run.uid == run_ref.uid => holder,
        Some(_) => return Ok(true),
        None => WorkspaceHolder {
            run: run_ref.clone(),
            incarnation: run.incarnation(),
        },
    };
    let run_uid = run.uid().unwrap_or_default();
    let incarnation = data
        .incarnation
        .and_then(|i| u64::try_from(i).ok())
        .unwrap_or(0);
    let name = commit_snapshot_name(&reference.name, &run_uid, incarnation, "s");
    let mut commit = match snapshots.get_opt(&name).await? {
        Some(commit) => commit,
        None => {
            let object = commit_snapshot(&workspace, &name, run_ref.clone());
            match snapshots.create(&PostParams::default(), &object).await {
                Ok(created) => created,
                Err(kube::Error::Api(status)) if status.code == 409 => snapshots.get(&name).await?,
                Err(e) => return Err(e),
            }
        }
    };
    let location = data.location.clone();
    let phase = commit.status.as_ref().and_then(|s| s.phase);
    if phase != Some(SnapshotPhase::Ready) {
        if phase != Some(SnapshotPhase::Capturing) {
            commit.metadata.managed_fields = None;
            commit.status = Some(SnapshotStatus {
                phase: Some(SnapshotPhase::Capturing),
                message: Some(format!(
                    "the session ended while not placed: the commit refers to the data of \
                     Snapshot {}",
                    source.name_any()
                )),
                ..data.clone()
            });
            commit = match write_status(&snapshots, &commit).await? {
                Some(written) => written,
                None => return Ok(false),
            };
        }
        // The source, read after the Capturing write, must still name the data.
        let kept = snapshots
            .get_opt(&suspend.name)
            .await?
            .and_then(|s| s.status)
            .and_then(|s| s.location)
            .zip(location.as_ref())
            .is_some_and(|(now, then)| now.uri == then.uri);
        if !kept {
            warn!(run = %run.name_any(), namespace = %namespace, "the suspend Snapshot went before it could be committed; the Workspace's head stays");
            if let Err(e) = snapshots.delete(&name, &Default::default()).await
                && !matches!(&e, kube::Error::Api(status) if status.code == 404)
            {
                return Err(e);
            }
            return Ok(true);
        }
        commit.metadata.managed_fields = None;
        if let Some(status) = commit.status.as_mut() {
            status.phase = Some(SnapshotPhase::Ready);
            status.completion_time = Some(now_rfc3339());
        }
        commit = match write_status(&snapshots, &commit).await? {
            Some(written) => written,
            None => return Ok(false),
        };
    }
    let head = ObjectReference::of(&commit);
    let Some(mut workspace) = workspaces.get_opt(&reference.name).await? else {
        return Ok(true);
    };
    let status = workspace.status.get_or_insert_with(Default::default);
    // Taken when no one held it (the advance needs the holder it checks against).
    status.holder.get_or_insert_with(|| holder.clone());
    match status.advance(&head, &holder, now_rfc3339()) {
        Advance::Moved => {}
        Advance::Already | Advance::NotHolder(_) => return Ok(true),
    }
    match workspaces
        .replace_status(&reference.name, &PostParams::default(), &workspace)
        .await
    {
        Ok(_) => {
            info!(run = %run.name_any(), namespace = %namespace, snapshot = %name, "a session that ended unplaced committed its suspend Snapshot to its Workspace");
            Ok(true)
        }
        // Changed since it was read: the next reconcile reads it again.
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

fn precondition(uid: Option<String>, resource_version: Option<String>) -> DeleteParams {
    DeleteParams {
        preconditions: Some(Preconditions {
            uid,
            resource_version,
        }),
        ..DeleteParams::default()
    }
}

/// Deletes `workspace` (unused past its TTL) unless a Run named after it exists; `true`
/// when it was deleted. Its commits are collected as orphans.
async fn expire(client: &Client, workspace: &Workspace) -> Result<bool, kube::Error> {
    let namespace = workspace.namespace().unwrap_or_default();
    let name = workspace.name_any();
    let runs = Api::<Run>::namespaced(client.clone(), &namespace);
    if runs.get_opt(&name).await?.is_some() {
        // Its lock is held: a session may restore from it or commit to it.
        return Ok(false);
    }
    let api = Api::<Workspace>::namespaced(client.clone(), &namespace);
    let params = precondition(workspace.uid(), workspace.resource_version());
    match api.delete(&name, &params).await {
        Ok(_) => {
            info!(workspace = %name, namespace = %namespace, "deleted a Workspace unused for its ttlSecondsAfterUnused");
            Ok(true)
        }
        // Gone, or changed since it was read (a commit used it): decided again next round.
        Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Writes a commit Snapshot's status: the object written, or `None` when it changed since
/// it was read (the next reconcile reads it again).
async fn write_status(
    snapshots: &Api<Snapshot>,
    commit: &Snapshot,
) -> Result<Option<Snapshot>, kube::Error> {
    match snapshots
        .replace_status(&commit.name_any(), &PostParams::default(), commit)
        .await
    {
        Ok(written) => Ok(Some(written)),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
    use kruntimes_api::snapshot::{SnapshotSource, SnapshotSpec};
    use kruntimes_api::{WorkspaceSpec, WorkspaceStatus};

    use super::*;

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + second).expect("time")
    }

    #[test]
    fn a_workspace_expires_from_its_last_use() {
        let mut workspace = Workspace::new(
            "w",
            WorkspaceSpec {
                ttl_seconds_after_unused: Some(60),
                ..WorkspaceSpec::default()
            },
        );
        workspace.metadata.creation_timestamp = Some(Time(at(0)));
        assert!(unused_for(&workspace, at(59)).is_none());
        assert!(unused_for(&workspace, at(60)).is_some());
        workspace.status = Some(WorkspaceStatus {
            last_used_time: Some(at(100).to_string()),
            ..WorkspaceStatus::default()
        });
        assert!(unused_for(&workspace, at(120)).is_none());
        assert!(unused_for(&workspace, at(161)).is_some());
        workspace.spec.ttl_seconds_after_unused = None;
        assert!(unused_for(&workspace, at(10_000)).is_none(), "no TTL: kept");
    }

    #[test]
    fn a_commit_is_orphaned_when_its_workspace_uid_is_gone() {
        let mut commit = Snapshot::new(
            "w-cabc-1",
            SnapshotSpec {
                source: SnapshotSource::default(),
                reason: Some(SnapshotReason::Commit),
            },
        );
        commit.metadata.namespace = Some("default".into());
        commit.metadata.owner_references = Some(vec![OwnerReference {
            kind: "Workspace".into(),
            name: "w".into(),
            uid: "u1".into(),
            ..OwnerReference::default()
        }]);
        let live = |uid: &str| {
            HashMap::from([(("default".to_string(), "w".to_string()), uid.to_string())])
        };
        assert!(!orphaned(&commit, &live("u1")));
        assert!(
            orphaned(&commit, &live("u2")),
            "made again: another Workspace"
        );
        assert!(orphaned(&commit, &HashMap::new()));
        commit.spec.reason = Some(SnapshotReason::Checkpoint);
        assert!(!orphaned(&commit, &HashMap::new()), "only commits");
    }
}
