//! The `Workspace` kind: a project's files that outlive the machines that work on them
//! (design documents 002 and 003).
//!
//! A Workspace is a named volume made of Snapshots. A session Run with `spec.workspace`
//! (a `Dev` machine) restores the Workspace's head before it is Ready and commits its files
//! as a new Snapshot (`spec.reason: Commit`) when it ends while its worker is alive; the
//! commit becomes `status.head`. The Run must be named after the Workspace: the Run's name
//! is the per-project lock, so a second session of the same Workspace is refused by the API
//! server itself (409 AlreadyExists) while the first exists, without a race.
//!
//! A session that starts with a Workspace that does not exist creates it (with the
//! defaults below); the owning worker does, and records the session as the Workspace's
//! holder (`status.holder`) before it restores: only the holder's commits move the head. Commits carry the label
//! [`WORKSPACE_LABEL`] and an owner reference to their Workspace; the worker that commits
//! keeps the newest `spec.history` of them and deletes the older ones.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::snapshot::ObjectReference;

/// The label of a commit Snapshot that names its Workspace.
pub const WORKSPACE_LABEL: &str = "kruntimes.io/workspace";
/// How many commits a Workspace keeps when `spec.history` is absent.
pub const DEFAULT_HISTORY: i32 = 5;
/// The most commits a Workspace keeps.
pub const MAX_HISTORY: i32 = 100;

/// The condition type, on a session Run with a Workspace, of the commit made as it ends.
/// Written only when the commit does not go through at once: `False` with
/// [`COMMIT_RETRYING_REASON`] while it fails and is tried again (the Run waits), `False`
/// with [`COMMIT_SKIPPED_REASON`] when it is given up, and `True` with
/// [`COMMITTED_REASON`] (the message names the commit) once a retried commit is made.
pub const COMMITTED_CONDITION: &str = "WorkspaceCommitted";
/// The reason of `WorkspaceCommitted=False` while the commit fails (the snapshot store or
/// the API server) and is tried again with a backoff; the message says why.
pub const COMMIT_RETRYING_REASON: &str = "CommitRetrying";
/// The reason of `WorkspaceCommitted=False` when the commit is given up: another session,
/// or a later incarnation of this one, holds the Workspace, or it was deleted.
pub const COMMIT_SKIPPED_REASON: &str = "CommitSkipped";
/// The reason of `WorkspaceCommitted=True` after a retried commit went through.
pub const COMMITTED_REASON: &str = "Committed";

/// A project's persistent files: the head Snapshot and the commits kept behind it.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "kruntimes.io",
    version = "v1alpha1",
    kind = "Workspace",
    plural = "workspaces",
    shortname = "ws",
    category = "kruntimes",
    namespaced,
    status = "WorkspaceStatus",
    printcolumn = r#"{"name":"Head","type":"string","jsonPath":".status.head.name","description":"The latest committed Snapshot"}"#,
    printcolumn = r#"{"name":"Commits","type":"integer","jsonPath":".status.commits","description":"Commits made so far"}"#,
    printcolumn = r#"{"name":"Last-Used","type":"date","jsonPath":".status.lastUsedTime","description":"When a session last restored or committed it"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceSpec {
    /// How many commits are kept, the head included (default 5, at most 100). Older ones
    /// are deleted after each commit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub history: Option<i32>,
    /// Delete the Workspace (and its commits) once no session used it for this long.
    /// Absent: kept until deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub ttl_seconds_after_unused: Option<i64>,
}

impl WorkspaceSpec {
    /// `spec.history`, or its default.
    pub fn history(&self) -> usize {
        usize::try_from(
            self.history
                .unwrap_or(DEFAULT_HISTORY)
                .clamp(1, MAX_HISTORY),
        )
        .unwrap_or(1)
    }
}

/// What the Workspace holds now.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(oldSelf.commits) || (has(self.commits) && self.commits >= oldSelf.commits)", "message": "status.commits never decreases"}
]))]
pub struct WorkspaceStatus {
    /// The latest committed Snapshot (name and UID): what the next session restores.
    /// Absent until the first commit: the next session starts empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head: Option<ObjectReference>,
    /// The Run (name and UID) that made the head.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_run: Option<ObjectReference>,
    /// The session that holds the Workspace now: the last to restore it, written before
    /// its restore. Only the holder's commit moves the head, so a worker of an earlier
    /// session (or incarnation) that commits late cannot take the head back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<WorkspaceHolder>,
    /// Commits made so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub commits: Option<i64>,
    /// When a session last restored or committed it (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_used_time: Option<String>,
}

/// What [`WorkspaceStatus::advance`] did.
#[derive(Clone, Debug, PartialEq)]
pub enum Advance {
    /// The head moved: write the status.
    Moved,
    /// The head is that commit already (a retry after the write landed): nothing to write.
    Already,
    /// Another session (or incarnation) holds the Workspace: its head is not this one's.
    NotHolder(Option<WorkspaceHolder>),
}

impl WorkspaceStatus {
    /// Moves the head to `head`, a commit made by `holder`, at `now` (RFC 3339): only
    /// while `holder` holds the Workspace, counting the commit once. Pure: the caller
    /// writes the status, conditional on the resourceVersion it read.
    pub fn advance(
        &mut self,
        head: &ObjectReference,
        holder: &WorkspaceHolder,
        now: String,
    ) -> Advance {
        if self.head.as_ref() == Some(head) {
            return Advance::Already;
        }
        if self.holder.as_ref() != Some(holder) {
            return Advance::NotHolder(self.holder.clone());
        }
        self.head = Some(head.clone());
        self.head_run = Some(holder.run.clone());
        self.commits = Some(self.commits.unwrap_or(0).saturating_add(1));
        self.last_used_time = Some(now);
        Advance::Moved
    }
}

/// `status.holder` of a Workspace: a session Run in one incarnation.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceHolder {
    /// The session Run (name and UID).
    pub run: ObjectReference,
    /// Its incarnation (`status.incarnation`: 1, then one more at each resume).
    #[schemars(range(min = 1))]
    pub incarnation: i64,
}

/// The name of a commit Snapshot that the session Run `run_uid`, in its `incarnation`,
/// makes of Workspace `workspace`: `<workspace>-c<first 8 of the UID>-<incarnation>-<tag>`,
/// `tag` new for each capture (a retry after a failure, or after a restart, captures
/// anew: a commit is never reused nor replaced, so the head never names an object being
/// rewritten). A long name is cut as suspend Snapshot names are.
pub fn commit_snapshot_name(workspace: &str, run_uid: &str, incarnation: u64, tag: &str) -> String {
    let run: String = run_uid
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(8)
        .collect::<String>()
        .to_ascii_lowercase();
    crate::snapshot::bounded_snapshot_name(workspace, &format!("-c{run}-{incarnation}-{tag}"))
}

/// The commit Snapshot `name` of `workspace` (the object as read) made from the session
/// `run`: reason `Commit`, owned by the Workspace (admission requires it) and labelled
/// with its name, so the commits of a project list and go with it.
pub fn commit_snapshot(workspace: &Workspace, name: &str, run: ObjectReference) -> crate::Snapshot {
    use kube::ResourceExt;
    let mut object = crate::Snapshot::new(
        name,
        crate::SnapshotSpec {
            source: crate::snapshot::SnapshotSource { run },
            reason: Some(crate::snapshot::SnapshotReason::Commit),
        },
    );
    object.metadata.owner_references = workspace.metadata.uid.clone().map(|uid| {
        vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                api_version: crate::API_VERSION.to_string(),
                kind: "Workspace".to_string(),
                name: workspace.name_any(),
                uid,
                ..Default::default()
            },
        ]
    });
    object.metadata.labels = Some([(WORKSPACE_LABEL.to_string(), workspace.name_any())].into());
    object
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_names_are_per_run_and_incarnation_and_bounded() {
        let a = commit_snapshot_name("proj", "0c4e77ab-1234", 1, "x1y2z3");
        assert_eq!(a, "proj-c0c4e77ab-1-x1y2z3");
        assert_ne!(
            a,
            commit_snapshot_name("proj", "0c4e77ab-1234", 2, "x1y2z3")
        );
        assert_ne!(
            a,
            commit_snapshot_name("proj", "11111111-1234", 1, "x1y2z3")
        );
        assert_ne!(
            a,
            commit_snapshot_name("proj", "0c4e77ab-1234", 1, "aaaaaa")
        );
        let long = commit_snapshot_name(&"x".repeat(253), "0c4e77ab", 3, "t");
        assert!(
            long.len() <= crate::snapshot::MAX_SNAPSHOT_NAME_BYTES,
            "{long}"
        );
        assert!(long.ends_with("-c0c4e77ab-3-t"), "{long}");
    }

    #[test]
    fn only_the_holder_moves_the_head_once() {
        let holder = |uid: &str, incarnation| WorkspaceHolder {
            run: ObjectReference {
                name: "p".into(),
                uid: Some(uid.into()),
            },
            incarnation,
        };
        let head = ObjectReference {
            name: "p-c1".into(),
            uid: Some("s1".into()),
        };
        let mut status = WorkspaceStatus {
            holder: Some(holder("r1", 2)),
            ..WorkspaceStatus::default()
        };
        for stale in [holder("r0", 2), holder("r1", 1)] {
            assert_eq!(
                status.advance(&head, &stale, "t".into()),
                Advance::NotHolder(Some(holder("r1", 2)))
            );
        }
        assert_eq!(status.head, None);
        assert_eq!(
            status.advance(&head, &holder("r1", 2), "t".into()),
            Advance::Moved
        );
        assert_eq!(
            status.advance(&head, &holder("r1", 2), "t".into()),
            Advance::Already
        );
        assert_eq!(
            (status.commits, status.head.as_ref()),
            (Some(1), Some(&head))
        );
    }

    #[test]
    fn history_defaults_and_is_clamped() {
        assert_eq!(WorkspaceSpec::default().history(), 5);
        let spec = WorkspaceSpec {
            history: Some(1000),
            ..WorkspaceSpec::default()
        };
        assert_eq!(spec.history(), 100);
    }
}
