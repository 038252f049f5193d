//! Checkpoints of live sessions, taken by the worker that owns the session.
//!
//! A user creates a `Snapshot` with `spec.reason: Checkpoint` (the default) naming a
//! session Run in `spec.source.run` (see `kruntimes_api::snapshot`). This worker watches
//! Snapshots ([`watch`]); one of a session it serves wakes that Run's reconcile, which
//! queues a [`Barrier`] behind every operation accepted so far ([`take`]). When the
//! session's worker task reaches the barrier (the operations before it have ended and none
//! after it has started), the capture streams the session's files to a local file, then
//! lets the queue go on; the upload to the snapshot store and the Ready write follow while
//! the session serves again. So the checkpoint holds exactly the operations accepted before
//! it, and the session pauses only for the capture itself.
//!
//! Failures are the Snapshot's, never the session's: no store, a capture or store error, or
//! a session that ended before the barrier's turn make it `Failed` with a reason. A
//! session that is suspending or draining takes no barrier; the checkpoint waits for the
//! next look (a Suspended session's checkpoint waits until it resumes; the
//! controller-manager fails one whose session ended).
//!
//! The checkpoint is not owned by its Run and outlives it: its data stays in the store
//! under `<namespace>/snapshots/<snapshot>/<snapshot UID>/` (the UID keeps a Snapshot made
//! again under the same name, or a suspend Snapshot of that name, apart), and no local copy
//! is kept (a fork restores from the store). The capture is staged in a directory of its
//! own, never in a Run's directory of local copies.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kruntimes_api::Run;
use kruntimes_api::lifecycle::{bounded_message, now_rfc3339};
use kruntimes_api::snapshot::{
    Snapshot, SnapshotLocation, SnapshotPhase, SnapshotReason, SnapshotStatus,
};
use kube::api::{Api, PostParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use crate::reconcile::Context;
use crate::sessions::Session;
use crate::sessions::snapshots::StoreSource;
use crate::tasks::executions::Key;

/// The longest a barrier holds its session: a capture that takes longer (a runtime server
/// that stopped answering) lets the queue go on, and the checkpoint fails.
const HOLD_LIMIT: Duration = Duration::from_secs(600);

/// How long a capture refused for an upload or download in flight is tried again.
const TRANSFER_WAIT: Duration = Duration::from_secs(30);
/// The pause between those tries.
const TRANSFER_RETRY: Duration = Duration::from_millis(20);
/// What the runtime server's refusal of a capture during a transfer says.
const TRANSFERRING: &str = "upload or a download is in flight";
/// Status writes per step: the first, and one after each conflict that left the
/// Snapshot as it was.
const WRITE_ATTEMPTS: usize = 3;

/// The reason of a checkpoint that failed because the session ended first.
pub const SESSION_ENDED_REASON: &str = "SessionEnded";
/// The reason of a checkpoint that failed because the worker has no snapshot store.
pub const NO_SNAPSHOT_STORE_REASON: &str = "NoSnapshotStore";
/// The reason of a checkpoint whose worker restarted while it captured it.
pub const WORKER_RESTARTED_REASON: &str = "WorkerRestarted";
/// The reason of a checkpoint whose capture or store failed.
pub const CAPTURE_FAILED_REASON: &str = "CaptureFailed";

/// A checkpoint's place in a session's queue. The session's worker task [`Barrier::hold`]s
/// it when its turn comes.
pub(crate) struct Barrier {
    /// The Snapshot's name.
    pub snapshot: String,
    reached: oneshot::Sender<u64>,
    release: oneshot::Receiver<()>,
}

/// The capture's side of a [`Barrier`].
struct Holder {
    reached: oneshot::Receiver<u64>,
    release: oneshot::Sender<()>,
}

impl Barrier {
    fn new(snapshot: &str) -> (Barrier, Holder) {
        let (reached_tx, reached_rx) = oneshot::channel();
        let (release_tx, release_rx) = oneshot::channel();
        (
            Barrier {
                snapshot: snapshot.to_string(),
                reached: reached_tx,
                release: release_rx,
            },
            Holder {
                reached: reached_rx,
                release: release_tx,
            },
        )
    }

    /// The barrier's turn: tells the capture (with the session's sequence number now) and
    /// waits until it lets go, gives up, or [`HOLD_LIMIT`] passes.
    pub(crate) async fn hold(self, sequence: u64) {
        if self.reached.send(sequence).is_err() {
            return;
        }
        let _ = tokio::time::timeout(HOLD_LIMIT, self.release).await;
    }
}

/// What this worker knows of checkpoints: the watched Snapshots, and those it captures now
/// (by UID), so that each is queued once.
#[derive(Default)]
pub struct Checkpoints {
    store: OnceLock<Store<Snapshot>>,
    in_flight: Arc<Mutex<HashSet<String>>>,
}

/// Whether `snapshot` is a checkpoint still to take.
fn wanted(snapshot: &Snapshot) -> bool {
    snapshot.spec.reason.unwrap_or_default() == SnapshotReason::Checkpoint
        && !snapshot.phase().is_terminal()
        && snapshot.metadata.deletion_timestamp.is_none()
}

/// Watches the namespace's Snapshots: a checkpoint to take of a Run this worker serves
/// wakes its reconcile. Runs until aborted.
pub async fn watch(context: Arc<Context>) {
    let api = Api::<Snapshot>::namespaced(context.client.clone(), &context.namespace);
    let (reader, writer) = reflector::store();
    if context.checkpoints.store.set(reader).is_err() {
        warn!("the checkpoint watch was started twice");
        return;
    }
    let mut events = reflector::reflector(writer, watcher(api, watcher::Config::default()))
        .default_backoff()
        .applied_objects()
        .boxed();
    while let Some(event) = events.next().await {
        match event {
            Ok(snapshot) if wanted(&snapshot) => {
                let run = snapshot.spec.run_name();
                if context.run_named(run).is_some() {
                    context.requeue_run(run);
                }
            }
            Ok(_) => {}
            Err(error) => debug!(error = %error, "watching Snapshots"),
        }
    }
}

/// Queues a barrier for every checkpoint of `run` (this incarnation, served here) that is
/// still to take and not queued yet, and starts its capture. Called by the reconcile of a
/// Ready session; a session that takes no operations now takes no barrier either.
pub(crate) fn take(run: &Run, key: &Key, context: &Context, session: &Arc<Session>) {
    let Some(store) = context.checkpoints.store.get() else {
        return;
    };
    let name = run.name_any();
    let uid = run.uid();
    for snapshot in store.state() {
        if !wanted(&snapshot)
            || snapshot.namespace().as_deref() != Some(context.namespace.as_str())
            || !snapshot.spec.source.run.matches(&name, uid.as_deref())
        {
            continue;
        }
        let Some(snapshot_uid) = snapshot.uid() else {
            continue;
        };
        if !context
            .checkpoints
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(snapshot_uid.clone())
        {
            continue;
        }
        if snapshot.phase() == SnapshotPhase::Capturing {
            // Capturing, and no job of this process takes it: an earlier runtimed began it
            // and died. Taken now, its cut would fall later in the queue than the one it
            // was queued at: it fails instead (a write on the version read, so a job that
            // just wrote it Ready, which the watch does not show yet, wins).
            let api = Api::namespaced(context.client.clone(), &context.namespace);
            let in_flight = context.checkpoints.in_flight.clone();
            tokio::spawn(async move {
                let failed = failed_status(
                    WORKER_RESTARTED_REASON,
                    "the worker restarted while it captured the checkpoint; take it again",
                );
                let mut object = (*snapshot).clone();
                object.status = Some(failed);
                object.meta_mut().managed_fields = None;
                if let Err(e) = api
                    .replace_status(&object.name_any(), &PostParams::default(), &object)
                    .await
                {
                    debug!(snapshot = %object.name_any(), error = %e, "an orphaned checkpoint was not failed");
                }
                forget(&in_flight, &snapshot_uid);
            });
            continue;
        }
        let (barrier, holder) = Barrier::new(&snapshot.name_any());
        if session.enqueue_barrier(barrier).is_err() {
            forget(&context.checkpoints.in_flight, &snapshot_uid);
            continue;
        }
        let job = Job {
            api: Api::namespaced(context.client.clone(), &context.namespace),
            client: context.session_client.clone(),
            dir: crate::sessions::snapshots::checkpoint_dir(context, &snapshot_uid),
            uid: snapshot_uid.clone(),
            key: key.clone(),
            store: StoreSource::of(context),
            namespace: context.namespace.clone(),
            max_bytes: context.session_limits.max_file_bytes,
            incarnation: crate::tasks::executions::incarnation_of(key.attempt),
        };
        let in_flight = context.checkpoints.in_flight.clone();
        tokio::spawn(async move {
            job.run((*snapshot).clone(), holder).await;
            forget(&in_flight, &snapshot_uid);
        });
    }
}

/// The status of a checkpoint that failed for `reason`.
fn failed_status(reason: &str, message: &str) -> SnapshotStatus {
    SnapshotStatus {
        phase: Some(SnapshotPhase::Failed),
        reason: Some(reason.to_string()),
        message: Some(bounded_message(message)),
        completion_time: Some(now_rfc3339()),
        ..SnapshotStatus::default()
    }
}

fn forget(in_flight: &Mutex<HashSet<String>>, uid: &str) {
    in_flight
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(uid);
}

/// One checkpoint's capture, with what it needs of the worker.
struct Job {
    api: Api<Snapshot>,
    client: crate::sessions::SessionClient,
    /// This checkpoint's own staging directory on this worker (never a Run's directory of
    /// local copies, which the local sweep owns), removed when the job ends.
    dir: PathBuf,
    /// The Snapshot's UID: its data's key in the store, so that a Snapshot of the same
    /// name made again (or a suspend Snapshot of that name) never shares it.
    uid: String,
    key: Key,
    store: StoreSource,
    namespace: String,
    max_bytes: u64,
    incarnation: u32,
}

/// How a checkpoint ended, when not Ready.
enum Ended {
    /// Failed with this reason and message.
    Failed(&'static str, String),
    /// The Snapshot changed or went away meanwhile: nothing to write.
    Gone,
}

impl Job {
    async fn run(self, snapshot: Snapshot, holder: Holder) {
        let name = snapshot.name_any();
        let started = Instant::now();
        let taken = self.take(snapshot.clone(), holder).await;
        let _ = tokio::fs::remove_dir_all(&self.dir).await;
        match taken {
            Ok(ready) => info!(
                snapshot = %name,
                run_uid = %self.key.uid,
                files = ready.status.as_ref().and_then(|s| s.files),
                took_ms = started.elapsed().as_secs_f64() * 1e3,
                "checkpoint Ready"
            ),
            Err(Ended::Gone) => {
                debug!(snapshot = %name, "the checkpoint changed while it was taken")
            }
            Err(Ended::Failed(reason, message)) => {
                warn!(snapshot = %name, reason, error = %message, "checkpoint failed");
                let failed = failed_status(reason, &message);
                // On the latest version: the Capturing write may or may not have landed.
                match self.api.get_opt(&name).await {
                    Ok(Some(current))
                        if current.uid() == snapshot.uid() && !current.phase().is_terminal() =>
                    {
                        let _ = self.write(current, failed).await;
                    }
                    Ok(_) => {}
                    Err(e) => warn!(snapshot = %name, error = %e, "cannot read the Snapshot"),
                }
            }
        }
    }

    /// Pending → Capturing → (the barrier's turn, the capture, the release) → store → Ready.
    async fn take(&self, snapshot: Snapshot, holder: Holder) -> Result<Snapshot, Ended> {
        let name = snapshot.name_any();
        let store = match self.store.open().await {
            Ok(Some(store)) => store,
            Ok(None) => {
                return Err(Ended::Failed(
                    NO_SNAPSHOT_STORE_REASON,
                    "the Runtime names no artifactStore and the worker has no --snapshot-dir"
                        .to_string(),
                ));
            }
            Err(e) => return Err(Ended::Failed(CAPTURE_FAILED_REASON, e.to_string())),
        };
        let capturing = self
            .write(
                snapshot,
                SnapshotStatus {
                    phase: Some(SnapshotPhase::Capturing),
                    incarnation: Some(i64::from(self.incarnation)),
                    ..SnapshotStatus::default()
                },
            )
            .await?;
        let Ok(sequence) = holder.reached.await else {
            return Err(Ended::Failed(
                SESSION_ENDED_REASON,
                "the session ended before the checkpoint's turn in its queue".to_string(),
            ));
        };
        let captured = self.capture(&name).await;
        // The files are in the staging file (or the capture failed): the session goes on.
        // A barrier that gave up holding ([`HOLD_LIMIT`]) let operations run during the
        // capture: what it read may be torn.
        let held = holder.release.send(()).is_ok();
        let captured = captured.map_err(|e| Ended::Failed(CAPTURE_FAILED_REASON, e))?;
        if !held {
            return Err(Ended::Failed(
                CAPTURE_FAILED_REASON,
                format!(
                    "the capture outlasted the {}s the queue is held for it",
                    HOLD_LIMIT.as_secs()
                ),
            ));
        }
        let key = format!("{name}/{}", self.uid);
        let stored =
            crate::sessions::snapshots::upload(store.as_ref(), &self.namespace, &key, &captured)
                .await
                .map_err(|e| Ended::Failed(CAPTURE_FAILED_REASON, e.to_string()))?;
        let summary = &captured.summary;
        self.write(
            capturing,
            SnapshotStatus {
                phase: Some(SnapshotPhase::Ready),
                size_bytes: i64::try_from(summary.size_bytes).ok(),
                compressed_bytes: i64::try_from(summary.compressed_bytes).ok(),
                files: i64::try_from(summary.files).ok(),
                digest: Some(summary.digest.clone()),
                last_sequence: i64::try_from(sequence).ok(),
                incarnation: Some(i64::from(self.incarnation)),
                location: Some(SnapshotLocation {
                    uri: stored.uri,
                    manifest_uri: Some(stored.manifest_uri),
                }),
                completion_time: Some(now_rfc3339()),
                ..SnapshotStatus::default()
            },
        )
        .await
    }

    /// CaptureSession into the staging directory. An upload or download in flight when
    /// the barrier's turn came makes the runtime server refuse it: it is tried again while
    /// the queue stays held, for at most [`TRANSFER_WAIT`].
    async fn capture(&self, name: &str) -> Result<crate::sessions::snapshots::Captured, String> {
        let deadline = Instant::now() + TRANSFER_WAIT;
        loop {
            let captured = crate::sessions::snapshots::capture_into(
                self.client.clone(),
                self.dir.clone(),
                &self.key,
                name,
                self.max_bytes,
            )
            .await;
            match captured {
                Err(e) if e.contains(TRANSFERRING) && Instant::now() < deadline => {
                    tokio::time::sleep(TRANSFER_RETRY).await;
                }
                other => return other,
            }
        }
    }

    /// Replaces the status of `snapshot` as read (its resourceVersion). A conflict is read
    /// again: the same Snapshot (its UID), still in the phase it was read in (a label or an
    /// annotation changed meanwhile), is written on its new version; one deleted, made
    /// again or moved on by another writer is [`Ended::Gone`].
    async fn write(
        &self,
        mut snapshot: Snapshot,
        status: SnapshotStatus,
    ) -> Result<Snapshot, Ended> {
        let name = snapshot.name_any();
        let (uid, phase) = (snapshot.uid(), snapshot.phase());
        for _ in 0..WRITE_ATTEMPTS {
            snapshot.status = Some(status.clone());
            snapshot.meta_mut().managed_fields = None;
            match self
                .api
                .replace_status(&name, &PostParams::default(), &snapshot)
                .await
            {
                Ok(written) => return Ok(written),
                Err(kube::Error::Api(e)) if e.code == 409 => match self.api.get_opt(&name).await {
                    Ok(Some(current)) if current.uid() == uid && current.phase() == phase => {
                        snapshot = current;
                    }
                    Ok(_) => return Err(Ended::Gone),
                    Err(e) => {
                        return Err(Ended::Failed(
                            CAPTURE_FAILED_REASON,
                            format!("reading the Snapshot: {e}"),
                        ));
                    }
                },
                Err(kube::Error::Api(e)) if e.code == 404 => return Err(Ended::Gone),
                Err(e) => {
                    return Err(Ended::Failed(
                        CAPTURE_FAILED_REASON,
                        format!("writing the Snapshot's status: {e}"),
                    ));
                }
            }
        }
        Err(Ended::Gone)
    }
}
