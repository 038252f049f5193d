//! A user's suspend against runtimed's reconciler in this process, the real API server and
//! a real runtime server (issue 19).

mod common;

use anyhow::{Context as _, Result, bail};
use common::{rig_with_snapshots, session};
use kruntimes_api::Phase;
use kruntimes_api::snapshot::{
    ObjectReference, Snapshot, SnapshotLocation, SnapshotPhase, SnapshotReason, SnapshotSource,
    SnapshotSpec, SnapshotStatus,
};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

const FOREIGN: &str = "file:///nowhere/another-runs-archive.tar.zst";

/// A review finding: a suspend reused any Ready Snapshot of its name at the same operation
/// sequence, so a leftover of a deleted Run of the same name and incarnation (its cleanup
/// is best effort) became the new Run's snapshot, and its resume would restore the other
/// Run's files. Now only a Snapshot this Run owns is reused; another's is replaced.
///
/// Checked to fail before the fix: the Run is Suspended to the leftover's location.
#[tokio::test]
async fn a_leftover_snapshot_of_a_deleted_run_of_the_same_name_is_never_reused() -> Result<()> {
    let rig = rig_with_snapshots("suspend-w1").await?;
    if !rig.context.sessions_supported {
        bail!("the runtime server does not implement SessionRuntime");
    }
    rig.create_runtime().await?;
    let run = rig.assign_named("reborn", session()).await?;
    rig.until("reborn", "is Ready", |r| r.phase() == Phase::Ready)
        .await?;

    // What a deleted Run "reborn" left: its first suspend's Snapshot, Ready at sequence 0
    // (where this Run is too, having run nothing).
    let snapshots = Api::<Snapshot>::namespaced(rig.admin.clone(), "default");
    let leftover = Snapshot::new(
        "reborn-s1",
        SnapshotSpec {
            source: SnapshotSource {
                run: ObjectReference {
                    name: "reborn".to_string(),
                    uid: Some("the-deleted-runs-uid".to_string()),
                },
            },
            reason: Some(SnapshotReason::Suspend),
        },
    );
    let mut leftover = snapshots.create(&PostParams::default(), &leftover).await?;
    leftover.status = Some(SnapshotStatus {
        phase: Some(SnapshotPhase::Ready),
        last_sequence: Some(0),
        incarnation: Some(1),
        digest: Some(format!("sha256:{}", "0".repeat(64))),
        location: Some(SnapshotLocation {
            uri: FOREIGN.to_string(),
            manifest_uri: None,
        }),
        ..SnapshotStatus::default()
    });
    snapshots
        .replace_status("reborn-s1", &PostParams::default(), &leftover)
        .await?;

    rig.runs()
        .patch(
            "reborn",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"suspend": true}})),
        )
        .await?;
    let suspended = rig
        .until("reborn", "is Suspended", |r| {
            r.phase() == Phase::Suspended || r.phase().is_terminal()
        })
        .await?;
    assert_eq!(
        suspended.phase(),
        Phase::Suspended,
        "{:?}",
        suspended.status
    );
    let reference = suspended
        .status
        .and_then(|s| s.snapshot)
        .context("status.snapshot")?;
    assert_eq!(reference.name, "reborn-s1");
    assert_ne!(
        reference.uri.as_deref(),
        Some(FOREIGN),
        "the other Run's archive was taken for this one's"
    );
    let object = snapshots.get("reborn-s1").await?;
    // This Run's own Snapshot now, pinned to its UID, not the leftover.
    assert_eq!(
        object.spec.source.run.uid.as_deref(),
        Some(run.uid().context("uid")?.as_str())
    );
    assert_eq!(object.phase(), SnapshotPhase::Ready);
    Ok(())
}
