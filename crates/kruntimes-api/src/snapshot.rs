//! The `Snapshot` kind: the durable capture of a session Run's files (design document 003).
//!
//! Two reasons make one:
//! - **Suspend**: the worker that owns the session creates it when the user sets
//!   `spec.suspend`, once the session's queue is empty, named `<run>-s<n>` and pinned to the
//!   Run's UID. It carries no owner reference: a fork may start from it after its session
//!   is gone, so the controller-manager deletes it once neither its Run nor a fork that
//!   has not ended needs it (a garbage collector would not wait for the fork).
//! - **Checkpoint** (the default): a user creates it, naming the session in
//!   `spec.source.run` (`uid` pins the exact Run). The owning worker takes it as a barrier in
//!   the session's queue: every operation accepted before it is in the capture and none
//!   after, while the session goes on. A checkpoint of a Suspended session refers to the
//!   suspend's data without copying it (the controller-manager writes it). A checkpoint is
//!   not owned by its session and outlives it: a Run with `spec.source.snapshot` forks it.
//!
//! The status says how the capture proceeds (Pending → Capturing → Ready | Failed). The
//! spec is immutable after create: a Snapshot says once what it captures.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The annotation of a checkpoint that names the Runtime its session ran on, so that a
/// fork after the session is gone knows where to start (the SDKs write it).
pub const RUNTIME_ANNOTATION: &str = "kruntimes.io/runtime";

/// `status.message` of a Snapshot is at most this many bytes.
pub const MAX_SNAPSHOT_MESSAGE_BYTES: usize = 1024;
/// A location URI is at most this many bytes.
pub const MAX_SNAPSHOT_URI_BYTES: usize = 4096;

/// What a Snapshot captures.
///
/// A user creates a checkpoint (`spec.reason` absent or `Checkpoint`) by naming a session
/// Run in `spec.source.run`; the worker that owns the session takes it as a barrier in the
/// session's queue. A suspend Snapshot (`Suspend`) is made by the owning worker only, named
/// `<run>-s<n>` and pinned to its Run's UID.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "kruntimes.io",
    version = "v1alpha1",
    kind = "Snapshot",
    plural = "snapshots",
    shortname = "snap",
    category = "kruntimes",
    namespaced,
    status = "SnapshotStatus",
    printcolumn = r#"{"name":"Run","type":"string","jsonPath":".spec.source.run.name","description":"The session Run it captures"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".spec.reason","description":"Checkpoint (when absent) or Suspend"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase","description":"Pending, Capturing, Ready or Failed"}"#,
    printcolumn = r#"{"name":"Size","type":"integer","jsonPath":".status.sizeBytes","description":"Bytes of the captured files, uncompressed"}"#,
    printcolumn = r#"{"name":"Files","type":"integer","jsonPath":".status.files","description":"Files captured"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    selectable = ".spec.source.run.name",
    selectable = ".status.phase"
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self == oldSelf", "message": "a Snapshot's spec is immutable"}
]))]
pub struct SnapshotSpec {
    /// What it captures.
    pub source: SnapshotSource,
    /// Why it was taken: `Checkpoint` (the default) or `Suspend`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<SnapshotReason>,
}

/// `spec.source` of a Snapshot.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotSource {
    /// The session Run it captures, in the Snapshot's namespace.
    pub run: ObjectReference,
}

/// A named object of the same namespace, optionally pinned to one UID: an object of that
/// name with another UID (deleted and created again) is not the one meant.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ObjectReference {
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128), regex(pattern = r"^[A-Za-z0-9-]+$"))]
    pub uid: Option<String>,
}

impl ObjectReference {
    /// A reference to `object` by its name, pinned to its UID.
    pub fn of<K: kube::Resource>(object: &K) -> ObjectReference {
        let meta = object.meta();
        ObjectReference {
            name: meta.name.clone().unwrap_or_default(),
            uid: meta.uid.clone(),
        }
    }

    /// Whether an object of this name with UID `uid` is the one referred to.
    pub fn matches(&self, name: &str, uid: Option<&str>) -> bool {
        self.name == name && self.uid.as_deref().is_none_or(|want| Some(want) == uid)
    }
}

/// The first Run of `runs` that has not ended and starts from the Snapshot `name`: a fork
/// that still needs that Snapshot (it restores from it, again after a lost worker).
pub fn fork_of<'a>(name: &str, runs: &'a [crate::Run]) -> Option<&'a crate::Run> {
    runs.iter().find(|r| {
        !r.phase().is_terminal()
            && r.spec
                .fork_source()
                .is_some_and(|source| source.name == name)
    })
}

impl SnapshotSpec {
    /// The name of the Run it captures.
    pub fn run_name(&self) -> &str {
        &self.source.run.name
    }
}

/// `spec.reason` of a Snapshot.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum SnapshotReason {
    /// Taken to suspend the session: its slot is released once the Snapshot is Ready.
    Suspend,
    /// Taken while the session goes on (or from a Suspended session's data).
    #[default]
    Checkpoint,
    /// Taken by the owning worker when a session with `spec.workspace` ends: the
    /// Workspace's new head. Owned by its Workspace.
    Commit,
}

/// The phase of a Snapshot.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum SnapshotPhase {
    /// Created, the capture not started.
    Pending,
    /// The worker is writing the data.
    Capturing,
    /// The data is durable at `status.location`.
    Ready,
    /// The capture failed (`status.reason`, `status.message`); nothing was released.
    Failed,
}

impl SnapshotPhase {
    /// Ready and Failed are final.
    pub fn is_terminal(self) -> bool {
        match self {
            SnapshotPhase::Ready | SnapshotPhase::Failed => true,
            SnapshotPhase::Pending | SnapshotPhase::Capturing => false,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SnapshotPhase::Pending => "Pending",
            SnapshotPhase::Capturing => "Capturing",
            SnapshotPhase::Ready => "Ready",
            SnapshotPhase::Failed => "Failed",
        }
    }
}

/// What the owning worker records of a capture.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(oldSelf.phase) || !(oldSelf.phase in ['Ready', 'Failed']) || (has(self.phase) && self.phase == oldSelf.phase)", "message": "Ready and Failed are final", "fieldPath": ".phase"}
]))]
pub struct SnapshotStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<SnapshotPhase>,
    /// Bytes of the captured files, uncompressed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub size_bytes: Option<i64>,
    /// Bytes of the stored archive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub compressed_bytes: Option<i64>,
    /// Files captured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub files: Option<i64>,
    /// `sha256:<hex>` of the archive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 71))]
    pub digest: Option<String>,
    /// The session's last operation sequence number at capture.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub last_sequence: Option<i64>,
    /// The Run's `status.incarnation` at capture.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub incarnation: Option<i64>,
    /// Where the data lives in the Runtime's ArtifactStore.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<SnapshotLocation>,
    /// The worker that keeps a local copy, for a fast resume on the same worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_copy: Option<SnapshotLocalCopy>,
    /// Why it failed (CamelCase), when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 128))]
    pub reason: Option<String>,
    /// At most 1024 bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub message: Option<String>,
    /// RFC 3339 time the Snapshot became Ready or Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<String>,
    /// Conditions in the Kubernetes style, as a Run's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<crate::run::RunCondition>,
}

/// `status.location` of a Snapshot.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotLocation {
    /// The archive: `file:///...` or `s3://bucket/key`.
    #[schemars(length(min = 1, max = 4096))]
    pub uri: String,
    /// The manifest of digests beside it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub manifest_uri: Option<String>,
}

/// `status.localCopy` of a Snapshot: the worker Pod that keeps a copy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotLocalCopy {
    #[schemars(length(min = 1, max = 253))]
    pub pod: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
}

impl Snapshot {
    /// The Snapshot's phase; one without status is Pending.
    pub fn phase(&self) -> SnapshotPhase {
        self.status
            .as_ref()
            .and_then(|s| s.phase)
            .unwrap_or(SnapshotPhase::Pending)
    }
}

/// A Snapshot object name is at most this many bytes (a DNS subdomain).
pub const MAX_SNAPSHOT_NAME_BYTES: usize = 253;

/// The deterministic name of the Snapshot that suspends incarnation `incarnation` of Run
/// `run_name`: `<run>-s<incarnation>`, so that every reconcile (and a restarted worker)
/// creates or finds the same object. A Run name too long for the suffix is cut and a
/// 64-bit FNV-1a hash of the whole name is added, so that two long names with a common
/// prefix do not meet; the result is always a valid object name of at most
/// [`MAX_SNAPSHOT_NAME_BYTES`].
pub fn suspend_snapshot_name(run_name: &str, incarnation: u64) -> String {
    bounded_snapshot_name(run_name, &format!("-s{incarnation}"))
}

/// `<base><suffix>`, or for a base too long for the suffix the base cut, a 64-bit FNV-1a
/// hash of the whole base and the suffix: a valid object name of at most
/// [`MAX_SNAPSHOT_NAME_BYTES`], distinct for two long bases with a common prefix.
pub(crate) fn bounded_snapshot_name(base: &str, suffix: &str) -> String {
    if base.len() + suffix.len() <= MAX_SNAPSHOT_NAME_BYTES {
        return format!("{base}{suffix}");
    }
    let hash = base.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let tail = format!("-{hash:016x}{suffix}");
    // Object names are ASCII, so any byte index is a char boundary; stay safe anyway.
    let mut cut = MAX_SNAPSHOT_NAME_BYTES.saturating_sub(tail.len());
    while !base.is_char_boundary(cut) {
        cut -= 1;
    }
    let head = base[..cut].trim_end_matches(['-', '.']);
    format!("{head}{tail}")
}

#[cfg(test)]
mod name_tests {
    use super::*;

    #[test]
    fn short_names_get_the_incarnation_suffix() {
        assert_eq!(suspend_snapshot_name("s1", 0), "s1-s0");
        assert_eq!(suspend_snapshot_name("s1", 7), "s1-s7");
    }

    #[test]
    fn long_names_are_bounded_and_distinct() {
        let a = format!("{}a", "x".repeat(252));
        let b = format!("{}b", "x".repeat(252));
        let na = suspend_snapshot_name(&a, u64::MAX);
        let nb = suspend_snapshot_name(&b, u64::MAX);
        assert!(na.len() <= MAX_SNAPSHOT_NAME_BYTES, "{}", na.len());
        assert_ne!(na, nb);
        assert_eq!(na, suspend_snapshot_name(&a, u64::MAX));
        let dashed = format!("{}-{}", "y".repeat(220), "z".repeat(32));
        let n = suspend_snapshot_name(&dashed, 1);
        assert!(!n.contains("--"), "{n}");
    }
}
