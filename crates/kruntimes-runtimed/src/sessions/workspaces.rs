//! Project Workspaces on the owner runtimed (docs/session-mode.md, "Project workspaces").
//!
//! A session Run with `spec.workspace` is named after its Workspace (admission makes the
//! Run's name the lock). Here:
//! - **Before Ready** ([`plan`]): the Workspace is created when it does not exist yet, the
//!   session (in this incarnation) is written its holder, and its head Snapshot, if any, is
//!   restored into the freshly registered session (as a fork restores its source). A
//!   resume restores its own suspend Snapshot instead.
//! - **At every ending while the worker is alive** ([`before_end`]): Drain once the queue is
//!   empty; Immediate, `spec.timeout`, lease expiry, an end another writer wrote (the
//!   controller-manager's idle expiry) and deletion once the running operation stopped. The files are captured into a Commit Snapshot
//!   (`<workspace>-c<run uid>-<incarnation>-<tag>`, a new name per capture, owned by the
//!   Workspace), the Workspace's head moves to it (only while this session holds the
//!   Workspace), and only then the Run ends (or its finalizer goes). A commit that fails is
//!   tried again; the Run waits for it. One that can never be made (another session holds
//!   the Workspace now; the snapshot store was taken away) is given up, and the end goes on.
//! - **After a commit** ([`prune`]): the newest `spec.history` commits stay, older ones are
//!   deleted (their data goes with the controller-manager's collection).
//!
//! On worker loss nothing is committed: the head stays at the last commit.

use std::time::Duration;

use kruntimes_api::lifecycle::{bounded_message, now_rfc3339};
use kruntimes_api::snapshot::{ObjectReference, Snapshot, SnapshotReason};
use kruntimes_api::workspace::{
    Advance, COMMIT_RETRYING_REASON, COMMIT_SKIPPED_REASON, COMMITTED_CONDITION, COMMITTED_REASON,
    WORKSPACE_LABEL, Workspace, WorkspaceHolder, WorkspaceSpec, WorkspaceStatus,
    commit_snapshot_name,
};
use kruntimes_api::{Phase, Run};
use kruntimes_proto::runtime::v1 as rs;
use kube::api::{ListParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use tracing::{info, warn};

use super::snapshots::{Plan, StoreSource};
use super::{
    Failure, Making, Retry, Session, adopt, awaits_idle_commit, capture_and_store, plan_for,
    session_status,
};
use crate::reconcile::{Context, Error};
use crate::tasks::executions::Key;

/// How often the end of a session whose running operation is being stopped looks again.
const STOPPING_LOOK: Duration = Duration::from_millis(20);
/// How many times the head's write is tried against concurrent writers.
const HEAD_WRITE_TRIES: usize = 5;

/// Reads Workspace `name`, creating it with the defaults when it does not exist.
pub(super) async fn ensure(api: &Api<Workspace>, name: &str) -> Result<Workspace, kube::Error> {
    if let Some(workspace) = api.get_opt(name).await? {
        return Ok(workspace);
    }
    let object = Workspace::new(name, WorkspaceSpec::default());
    match api.create(&PostParams::default(), &object).await {
        Ok(created) => Ok(created),
        // Made meanwhile (a user, or an earlier try of this registration).
        Err(kube::Error::Api(status)) if status.code == 409 => api.get(name).await,
        Err(e) => Err(e),
    }
}

/// What a session with `spec.workspace` restores before it is Ready: its own suspend
/// Snapshot when it resumes, else the Workspace's head, or nothing (a new Workspace, or one
/// never committed to). The Workspace is created when it does not exist, and this session
/// (`key`'s incarnation) is written its holder first. Without a snapshot store nothing could
/// ever be committed: refused.
pub(super) async fn plan(
    run: &Run,
    key: &Key,
    workspaces: &Api<Workspace>,
    snapshots: &Api<Snapshot>,
    store: &StoreSource,
) -> Result<Option<Plan>, (Failure, String)> {
    let Some(reference) = &run.spec.workspace else {
        return Ok(None);
    };
    match store.open().await {
        Ok(Some(_)) => {}
        Ok(None) => {
            return Err((
                Failure::Invalid,
                "a session with a Workspace needs a snapshot store to commit to: the Runtime \
                 names no artifactStore and this worker has no --snapshot-dir"
                    .to_string(),
            ));
        }
        Err(e) => {
            return Err((
                Failure::RestoreLater,
                bounded_message(&format!("opening the snapshot store: {e}")),
            ));
        }
    }
    let workspace = hold(workspaces, &reference.name, &holder_of(run, key))
        .await
        .map_err(|e| match e {
            kube::Error::Api(status) if status.code == 403 => (
                Failure::Invalid,
                bounded_message(&format!(
                    "this worker may not create or write the Workspace {:?} (its role lacks \
                     workspaces or workspaces/status): {}",
                    reference.name, status.message
                )),
            ),
            e => (
                Failure::RestoreLater,
                bounded_message(&format!("reading the Workspace {:?}: {e}", reference.name)),
            ),
        })?;
    if super::is_resume(run) {
        return super::resume_plan(run, snapshots).await;
    }
    let Some(head) = workspace.status.and_then(|s| s.head) else {
        return Ok(None);
    };
    let name = head.name.clone();
    plan_for(head, snapshots).await.map(Some).map_err(|(kind, message)| {
        (
            kind,
            format!(
                "{message} (it is the head of Workspace {:?}: delete the Workspace, or set \
                 its status.head to another commit, to start anew)",
                reference.name
            ),
        )
    })
    .inspect(|_| tracing::debug!(workspace = %reference.name, head = %name, "restoring the Workspace's head"))
}

/// This session in `key`'s incarnation, as the Workspace's holder.
fn holder_of(run: &Run, key: &Key) -> WorkspaceHolder {
    WorkspaceHolder {
        run: ObjectReference::of(run),
        incarnation: i64::from(crate::tasks::executions::incarnation_of(key.attempt)),
    }
}

/// Reads Workspace `name` (creating it when it does not exist) and makes `holder` its
/// holder, with `lastUsedTime` now; the write is conditional on what was read (a
/// concurrent writer's 409 reads again). Returns the Workspace as written.
async fn hold(
    api: &Api<Workspace>,
    name: &str,
    holder: &WorkspaceHolder,
) -> Result<Workspace, kube::Error> {
    let mut tries = 0;
    loop {
        tries += 1;
        let mut workspace = ensure(api, name).await?;
        let status = workspace
            .status
            .get_or_insert_with(WorkspaceStatus::default);
        if status.holder.as_ref() == Some(holder) {
            return Ok(workspace);
        }
        status.holder = Some(holder.clone());
        status.last_used_time = Some(now_rfc3339());
        match api
            .replace_status(name, &PostParams::default(), &workspace)
            .await
        {
            Ok(written) => return Ok(written),
            Err(kube::Error::Api(status)) if status.code == 409 && tries < HEAD_WRITE_TRIES => {
                continue;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Before the session of `run` ends (`why`) while its worker is alive: when it has a
/// Workspace, stop its work and commit its files as the Workspace's new head.
///
/// `Ok(None)`: go on and end it (committed now, or nothing to commit: no Workspace, or the
/// runtime server no longer holds the session). `Ok(Some(action))`: not yet (the running
/// operation is still stopping, or the commit failed and is tried again after a backoff).
pub(super) async fn before_end(
    run: &Run,
    key: &Key,
    context: &Context,
    why: &str,
) -> Result<Option<Action>, Error> {
    Ok(match step(run, key, context, why, false).await? {
        Before::End(_) => None,
        Before::Wait(delay) => Some(Action::requeue(delay)),
    })
}

/// Commits the session of `run` before the worker shuts down (the drain closes it next),
/// trying until `until`: how it may be closed, with its files committed or with nothing to
/// commit. `None`: the commit was not made in time, or failed; the head stays. A retry
/// backoff left by earlier failures is not waited out (the files go with the worker), and
/// a failure here is tried again after at most [`SHUTDOWN_RETRY`].
pub(crate) async fn commit_for_shutdown(
    context: &Context,
    run: &Run,
    key: &Key,
    until: tokio::time::Instant,
) -> Option<Ended> {
    let mut current = run.clone();
    loop {
        match step(&current, key, context, "the worker shuts down", true).await {
            Ok(Before::End(ended)) => return Some(ended),
            Ok(Before::Wait(delay)) => {
                let wake = tokio::time::Instant::now() + delay;
                if wake >= until {
                    return None;
                }
                tokio::time::sleep_until(wake).await;
                // The Run as it is now: a condition written by the last look changed it.
                match context.api().get_opt(&run.name_any()).await {
                    Ok(Some(fresh)) if fresh.metadata.uid == run.metadata.uid => current = fresh,
                    // Deleted (its finalizer's look commits) or made again: not this
                    // look's to commit any more.
                    Ok(_) => return Some(Ended::Nothing),
                    Err(e) => {
                        warn!(run = %run.name_any(), error = %e, "reading the Run before its commit failed; trying with the last one read");
                    }
                }
            }
            Err(e) => {
                warn!(run = %run.name_any(), error = %e, "the Workspace commit before shutdown failed");
                return None;
            }
        }
    }
}

/// What [`step`] found.
enum Before {
    /// End the session now.
    End(Ended),
    /// Look again after this long.
    Wait(Duration),
}

/// How a session may end, as far as its Workspace goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// Its files are committed (by this look or an earlier one).
    Committed,
    /// Nothing of it is to be committed: no Workspace, never Ready here, lost by the
    /// runtime server, not this Run's to commit (another holds the Workspace).
    Nothing,
}

/// How soon a commit that failed at shutdown is tried again (before the drain's deadline).
const SHUTDOWN_RETRY: Duration = Duration::from_millis(500);

/// One look of [`before_end`]: stop the session's work, then commit once it is quiet.
/// `at_shutdown`: the worker goes, and the session's files with it: no backoff is waited
/// out.
async fn step(
    run: &Run,
    key: &Key,
    context: &Context,
    why: &str,
    at_shutdown: bool,
) -> Result<Before, Error> {
    if run.spec.workspace.is_none() || !context.sessions_supported {
        return Ok(Before::End(Ended::Nothing));
    }
    // Only a session that was Ready here has files to commit: one that never got there
    // leaves the head as it was. A Run another writer ended (idle expiry writes Timeout)
    // while its session is still open here commits too.
    if !(matches!(run.phase(), Phase::Ready | Phase::Finalizing) || run.phase().is_terminal()) {
        return Ok(Before::End(Ended::Nothing));
    }
    // The runtime server's view, when it was read to adopt the session: this process
    // started nothing on it since, so it still holds for the checks below.
    let mut adopted = None;
    let session = match context.sessions.get(&key.uid) {
        Some(session) if session.fenced == key.attempt => session,
        Some(_) => return Ok(Before::End(Ended::Nothing)),
        // An ended Run may never have been Ready: a session the runtime server holds may be
        // one whose restore had not run, and its commit would empty the head. Only a session
        // this process saw through to Ready (restored) is committed then, or one that idle
        // expiry ended (it ends only Ready Runs).
        None if run.phase().is_terminal() && !awaits_idle_commit(run) => {
            return Ok(Before::End(Ended::Nothing));
        }
        None => {
            // runtimed restarted: the runtime server may still hold it (Ready or Finalizing,
            // or ended by idle expiry: its restore was done before Ready was written).
            let status = session_status(context, key).await?;
            if status.state() != rs::SessionState::Ready {
                return Ok(Before::End(Ended::Nothing));
            }
            adopted = Some(status);
            adopt(run, key, context, false)
        }
    };
    // Nothing new is accepted, queued work is cancelled and the running operation stopped:
    // the commit holds what ran before the end.
    session.shut(why);
    if !session.idle() {
        return Ok(Before::Wait(STOPPING_LOOK));
    }
    // A session the runtime server lost (it restarted) has nothing left to commit: the
    // head stays where it was, and waiting would hold the end forever.
    let on_server = match adopted {
        Some(status) => status,
        None => session_status(context, key).await?,
    };
    if on_server.state() != rs::SessionState::Ready {
        return Ok(Before::End(Ended::Nothing));
    }
    // The runtime server may still be stopping the cancelled operation (or one a previous
    // runtimed started): a capture would be refused meanwhile.
    if !on_server.running_operation_id.is_empty() {
        return Ok(Before::Wait(STOPPING_LOOK));
    }
    // One look at a time commits (the drain's and a reconcile's may both get here).
    let mut state = session.commit_state().await;
    // Committed already: the end that followed did not land (its write conflicted), and
    // nothing ran since (the session was shut before the commit). The Run says how, in
    // case that write conflicted too.
    if state.settled {
        if let Some((status, reason, message)) = &state.shown {
            commit_condition(run, context, status, reason, message).await?;
        }
        let skipped = state
            .shown
            .as_ref()
            .is_some_and(|(_, reason, _)| *reason == COMMIT_SKIPPED_REASON);
        return Ok(Before::End(if skipped {
            Ended::Nothing
        } else {
            Ended::Committed
        }));
    }
    // A failed commit is tried again after its backoff, whatever woke this look (the
    // condition's own write does).
    if !at_shutdown && let Some(left) = context.sessions.backoff(&key.uid, Retry::Commit) {
        return Ok(Before::Wait(left));
    }
    match commit(run, key, context, &session).await {
        Ok(head) => {
            context.sessions.clear_retry(&key.uid, Retry::Commit);
            info!(run = %run.name_any(), snapshot = %head.name, "session committed to its Workspace");
            state.settled = true;
            // Only after a failure said otherwise: a commit that goes through at once
            // costs no write.
            if state.failure_shown {
                let message = format!("the session's files are commit {}", head.name);
                state.shown = Some(("True", COMMITTED_REASON, message.clone()));
                commit_condition(run, context, "True", COMMITTED_REASON, &message).await?;
            }
            Ok(Before::End(Ended::Committed))
        }
        Err(CommitError::NotHolder(message)) => {
            warn!(run = %run.name_any(), error = %message, "the Workspace was not committed");
            state.settled = true;
            state.shown = Some(("False", COMMIT_SKIPPED_REASON, message.clone()));
            commit_condition(run, context, "False", COMMIT_SKIPPED_REASON, &message).await?;
            Ok(Before::End(Ended::Nothing))
        }
        Err(CommitError::Retry(message)) => {
            let delay = context.sessions.failed(&key.uid, Retry::Commit);
            warn!(run = %run.name_any(), error = %message, retry_in = ?delay, "the Workspace commit failed; the session ends once it is made");
            state.failure_shown = true;
            commit_condition(run, context, "False", COMMIT_RETRYING_REASON, &message).await?;
            Ok(Before::Wait(if at_shutdown {
                delay.min(SHUTDOWN_RETRY)
            } else {
                delay
            }))
        }
    }
}

/// Writes `WorkspaceCommitted=<status>/<reason>` unless the Run says so already.
async fn commit_condition(
    run: &Run,
    context: &Context,
    status: &str,
    reason: &str,
    message: &str,
) -> Result<(), Error> {
    super::write_condition(run, context, COMMITTED_CONDITION, status, reason, message).await
}

/// Why a commit was not made.
enum CommitError {
    /// Another session (or a later incarnation) holds the Workspace now: this one's files
    /// must not become the head. The end goes on without a commit.
    NotHolder(String),
    /// It may work when tried again (the store, the API server).
    Retry(String),
}

impl From<String> for CommitError {
    fn from(message: String) -> CommitError {
        CommitError::Retry(message)
    }
}

/// A new tag for a commit's name: six lower-case letters and digits.
fn commit_tag() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    (0..6)
        .map(|_| char::from(ALPHABET[rand::random_range(0..ALPHABET.len())]))
        .collect()
}

/// Captures the session's files (its queue empty, admission stopped) into this
/// incarnation's Commit Snapshot, moves the Workspace's head to it and prunes the history.
async fn commit(
    run: &Run,
    key: &Key,
    context: &Context,
    session: &Session,
) -> Result<ObjectReference, CommitError> {
    let Some(reference) = &run.spec.workspace else {
        return Err(CommitError::NotHolder(
            "the Run has no Workspace".to_string(),
        ));
    };
    let store = match super::snapshots::store(context).await {
        Ok(Some(store)) => store,
        // The Runtime's store was taken away since the restore: nothing can ever be
        // committed here, and waiting would hold the end forever.
        Ok(None) => {
            return Err(CommitError::NotHolder(
                "no snapshot store: the Runtime names no artifactStore and this worker has no \
                 --snapshot-dir"
                    .to_string(),
            ));
        }
        Err(e) => {
            return Err(CommitError::Retry(bounded_message(&format!(
                "opening the snapshot store: {e}"
            ))));
        }
    };
    let workspaces = Api::<Workspace>::namespaced(context.client.clone(), &context.namespace);
    let holder = holder_of(run, key);
    let mut workspace = ensure(&workspaces, &reference.name)
        .await
        .map_err(|e| bounded_message(&format!("reading the Workspace: {e}")))?;
    let held_by = workspace.status.as_ref().and_then(|s| s.holder.clone());
    match held_by {
        Some(held) if held == holder => {}
        // No one holds it: made again since this session restored it (deleted by hand),
        // or restored by a runtimed that wrote no holder. This session takes it.
        None => {
            workspace = hold(&workspaces, &reference.name, &holder)
                .await
                .map_err(|e| bounded_message(&format!("holding the Workspace: {e}")))?;
            if workspace.status.as_ref().and_then(|s| s.holder.as_ref()) != Some(&holder) {
                return Err(CommitError::Retry(format!(
                    "Workspace {:?} was taken while this session took it",
                    reference.name
                )));
            }
        }
        Some(held) => {
            return Err(CommitError::NotHolder(format!(
                "Workspace {:?} is held by {:?} now, not by this session's incarnation {}",
                reference.name,
                (held.run.name, held.incarnation),
                holder.incarnation
            )));
        }
    }
    let incarnation = crate::tasks::executions::incarnation_of(key.attempt);
    let run_uid = run.uid().unwrap_or_default();
    let name = commit_snapshot_name(
        &reference.name,
        &run_uid,
        u64::from(incarnation),
        &commit_tag(),
    );
    let (_, _, last_sequence) = session.snapshot();
    let snapshots = Api::<Snapshot>::namespaced(context.client.clone(), &context.namespace);
    let captured = capture_and_store(
        run,
        key,
        context,
        &Making::commit(&workspace, run, &name),
        store.as_ref(),
        last_sequence,
        incarnation,
    )
    .await;
    let stored = match captured {
        Ok(stored) => stored,
        Err(message) => {
            // This capture's object is never used again (the next try takes a new name): it
            // goes now rather than waiting for the history to prune it.
            if let Err(e) = snapshots.delete(&name, &Default::default()).await
                && !matches!(&e, kube::Error::Api(status) if status.code == 404)
            {
                warn!(snapshot = %name, error = %e, "deleting a failed commit failed; the history prunes it");
            }
            return Err(CommitError::Retry(message));
        }
    };
    let head = ObjectReference {
        name,
        uid: stored.uid,
    };
    let history = advance_head(&workspaces, &reference.name, &head, &holder).await?;
    prune(&snapshots, &reference.name, &head, history).await;
    Ok(head)
}

/// Moves the head of Workspace `name` to `head`, made by `holder`, counting the commit once:
/// a retry after the write landed changes nothing. Only while `holder` holds the Workspace
/// (and the Workspace is the one the commit is owned by): a later session, or a later
/// incarnation of this one, took it over otherwise. Returns the Workspace's history.
async fn advance_head(
    api: &Api<Workspace>,
    name: &str,
    head: &ObjectReference,
    holder: &WorkspaceHolder,
) -> Result<usize, CommitError> {
    let api_error = |e: kube::Error| bounded_message(&format!("writing the Workspace's head: {e}"));
    for _ in 0..HEAD_WRITE_TRIES {
        let Some(mut workspace) = api.get_opt(name).await.map_err(api_error)? else {
            return Err(CommitError::NotHolder(format!(
                "Workspace {name:?} was deleted while its commit was made"
            )));
        };
        let history = workspace.spec.history();
        let status = workspace
            .status
            .get_or_insert_with(WorkspaceStatus::default);
        match status.advance(head, holder, now_rfc3339()) {
            Advance::Moved => {}
            Advance::Already => return Ok(history),
            Advance::NotHolder(now) => {
                return Err(CommitError::NotHolder(format!(
                    "Workspace {name:?} was taken over by {:?} while this commit was made",
                    now.map(|h| (h.run.name, h.incarnation))
                )));
            }
        }
        // Conditional on the resourceVersion just read: a concurrent writer makes it 409,
        // and the head is read again.
        match api
            .replace_status(name, &PostParams::default(), &workspace)
            .await
        {
            Ok(_) => return Ok(history),
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(e) => return Err(api_error(e).into()),
        }
    }
    Err(CommitError::Retry(format!(
        "the Workspace {name:?} kept changing while its head was written; trying again"
    )))
}

/// Deletes the commits of Workspace `name` beyond the newest `history` (never `head`).
/// Best effort: what is left is pruned after the next commit.
async fn prune(api: &Api<Snapshot>, name: &str, head: &ObjectReference, history: usize) {
    let listed = match api
        .list(&ListParams::default().labels(&format!("{WORKSPACE_LABEL}={name}")))
        .await
    {
        Ok(list) => list.items,
        Err(e) => {
            warn!(workspace = %name, error = %e, "listing the Workspace's commits failed; they are pruned after the next commit");
            return;
        }
    };
    for snapshot in stale_commits(listed, head, history) {
        let snapshot_name = snapshot.name_any();
        match api.delete(&snapshot_name, &Default::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => {
                warn!(workspace = %name, snapshot = %snapshot_name, error = %e, "deleting an old commit failed");
            }
        }
    }
}

/// The commits beyond the newest `history` of `listed`, oldest last; the head is always
/// kept (and counted first), whatever its age says.
fn stale_commits(listed: Vec<Snapshot>, head: &ObjectReference, history: usize) -> Vec<Snapshot> {
    let mut commits: Vec<Snapshot> = listed
        .into_iter()
        .filter(|s| {
            s.spec.reason == Some(SnapshotReason::Commit)
                && s.metadata.deletion_timestamp.is_none()
                && !head.matches(&s.name_any(), s.metadata.uid.as_deref())
        })
        .collect();
    // Newest first: creation time, then name (whole seconds tie).
    commits.sort_by(|a, b| {
        let created = |s: &Snapshot| s.metadata.creation_timestamp.clone().map(|t| t.0);
        created(b)
            .cmp(&created(a))
            .then_with(|| b.name_any().cmp(&a.name_any()))
    });
    commits
        .into_iter()
        .skip(history.saturating_sub(1))
        .collect()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kruntimes_api::snapshot::{SnapshotSource, SnapshotSpec};

    use super::*;

    fn commit(name: &str, uid: &str, second: i64, reason: SnapshotReason) -> Snapshot {
        let mut snapshot = Snapshot::new(
            name,
            SnapshotSpec {
                source: SnapshotSource::default(),
                reason: Some(reason),
            },
        );
        snapshot.metadata.uid = Some(uid.to_string());
        snapshot.metadata.creation_timestamp = Some(Time(
            k8s_openapi::jiff::Timestamp::from_second(1_800_000_000 + second).expect("time"),
        ));
        snapshot
    }

    #[test]
    fn pruning_keeps_the_head_and_the_newest_commits() {
        let listed = vec![
            commit("p-c1", "u1", 1, SnapshotReason::Commit),
            commit("p-c2", "u2", 2, SnapshotReason::Commit),
            commit("p-c3", "u3", 3, SnapshotReason::Commit),
            commit("p-c4", "u4", 4, SnapshotReason::Commit),
            // Not a commit: never pruned here, whatever its label says.
            commit("p-cp", "u5", 0, SnapshotReason::Checkpoint),
        ];
        let head = ObjectReference {
            name: "p-c4".into(),
            uid: Some("u4".into()),
        };
        let names = |kept: Vec<Snapshot>| kept.iter().map(|s| s.name_any()).collect::<Vec<_>>();
        assert_eq!(
            names(stale_commits(listed.clone(), &head, 2)),
            ["p-c2", "p-c1"]
        );
        assert_eq!(
            names(stale_commits(listed.clone(), &head, 1)),
            ["p-c3", "p-c2", "p-c1"]
        );
        assert!(stale_commits(listed.clone(), &head, 5).is_empty());
        // A head older than the others (a clock step) is still never pruned.
        let old_head = ObjectReference {
            name: "p-c1".into(),
            uid: Some("u1".into()),
        };
        assert_eq!(names(stale_commits(listed, &old_head, 2)), ["p-c3", "p-c2"]);
    }
}
