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
//! next look (a suspend that completes leaves it to the controller-manager, which refers a
//! checkpoint of a Suspended session to the suspend's data).
//!
//! The checkpoint is not owned by its Run and outlives it: its data stays in the store
//! under `<namespace>/snapshots/<snapshot>/`, and no local copy is kept (a fork restores
//! from the store).

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

use crate::executions::Key;
use crate::reconcile::Context;
use crate::sessions::Session;
use crate::snapshots::StoreSource;

/// The longest a barrier holds its session: a capture that takes longer (a runtime server
/// that stopped answering) lets the queue go on, and the checkpoint fails.
const HOLD_LIMIT: Duration = Duration::from_secs(600);

/// The reason of a checkpoint that failed because the session ended first.
pub const SESSION_ENDED_REASON: &str = "SessionEnded";
/// The reason of a checkpoint that failed because the worker has no snapshot store.
pub const NO_SNAPSHOT_STORE_REASON: &str = "NoSnapshotStore";
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
        let (barrier, holder) = Barrier::new(&snapshot.name_any());
        if session.enqueue_barrier(barrier).is_err() {
            forget(&context.checkpoints.in_flight, &snapshot_uid);
            continue;
        }
        let job = Job {
            api: Api::namespaced(context.client.clone(), &context.namespace),
            client: context.session_client.clone(),
            dir: crate::snapshots::local_dir(context, &key.uid),
            key: key.clone(),
            store: StoreSource::of(context),
            namespace: context.namespace.clone(),
            max_bytes: context.session_limits.max_file_bytes,
            incarnation: crate::executions::incarnation_of(key.attempt),
        };
        let in_flight = context.checkpoints.in_flight.clone();
        tokio::spawn(async move {
            job.run((*snapshot).clone(), holder).await;
            forget(&in_flight, &snapshot_uid);
        });
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
    /// The Run's local directory on this worker (the capture's staging file goes there).
    dir: PathBuf,
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
        match self.take(snapshot.clone(), holder).await {
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
                let failed = SnapshotStatus {
                    phase: Some(SnapshotPhase::Failed),
                    reason: Some(reason.to_string()),
                    message: Some(bounded_message(&message)),
                    completion_time: Some(now_rfc3339()),
                    ..SnapshotStatus::default()
                };
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
        let captured = crate::snapshots::capture_into(
            self.client.clone(),
            self.dir.clone(),
            &self.key,
            &name,
            self.max_bytes,
        )
        .await;
        // The files are in the local file (or the capture failed): the session goes on.
        let _ = holder.release.send(());
        let captured = captured.map_err(|e| Ended::Failed(CAPTURE_FAILED_REASON, e))?;
        let stored =
            crate::snapshots::upload(store.as_ref(), &self.namespace, &name, &captured).await;
        // The store has it (or failed): the local file serves nothing any more.
        let _ = tokio::fs::remove_file(&captured.path).await;
        let stored = stored.map_err(|e| Ended::Failed(CAPTURE_FAILED_REASON, e.to_string()))?;
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

    /// Replaces the status of `snapshot` as read (its resourceVersion): a Snapshot changed
    /// or deleted meanwhile is [`Ended::Gone`].
    async fn write(
        &self,
        mut snapshot: Snapshot,
        status: SnapshotStatus,
    ) -> Result<Snapshot, Ended> {
        let name = snapshot.name_any();
        snapshot.status = Some(status);
        snapshot.meta_mut().managed_fields = None;
        match self
            .api
            .replace_status(&name, &PostParams::default(), &snapshot)
            .await
        {
            Ok(written) => Ok(written),
            Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409) => Err(Ended::Gone),
            Err(e) => Err(Ended::Failed(
                CAPTURE_FAILED_REASON,
                format!("writing the Snapshot's status: {e}"),
            )),
        }
    }
}
