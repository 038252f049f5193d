//! Session snapshots on the owner runtimed: the files of a suspend capture (a local copy
//! on this worker, then the store) and the restore of a resumed session.
//!
//! - **Store**: the Runtime's ArtifactStore when it names one; else a filesystem store
//!   rooted at `<--snapshot-dir>/store`; else none (a suspend is then refused:
//!   `Suspended=False/NoSnapshotStore`). Blobs are keyed
//!   `<namespace>/snapshots/<snapshot>/<snapshot UID>/archive.tar.zst` (an older release
//!   wrote it without the UID), the manifest (every entry with its digest, from the capture's
//!   summary) beside it as `manifest.json`. The controller-manager deletes the data no
//!   Snapshot and no Run refers to any more.
//! - **Local copy**: `<--snapshot-dir>/local/<pod>/<run-uid>/<snapshot>.tar.zst` (the
//!   system temporary directory stands in without the flag), written to a staging file,
//!   synced, then renamed; at most the latest per Run is kept, and the Run's directory is
//!   removed when the Run ends or is deleted. A resume on this worker restores from it when
//!   its digest matches the Snapshot's, else from the store.

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use kruntimes_proto::runtime::v1 as rs;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

use crate::artifacts::filesystem::FilesystemStore;
use crate::artifacts::{ArtifactStore, ByteStream, StoreError};
use crate::reconcile::Context;
use crate::tasks::executions::Key;

/// The largest message runtimed accepts from CaptureSession: the summary carries the
/// manifest (about 100 bytes plus the path per entry).
pub const MAX_CAPTURE_MESSAGE: usize = 64 << 20;
/// Bytes read from a local copy per restore message (the server takes at most 1 MiB).
const CHUNK: usize = 256 * 1024;

/// The store snapshots go to: the Runtime's ArtifactStore, else the filesystem store under
/// `--snapshot-dir`, else none.
pub(crate) async fn store(context: &Context) -> Result<Option<Arc<dyn ArtifactStore>>, StoreError> {
    StoreSource::of(context).open().await
}

/// How to find the snapshot store ([`store`]) later, away from the [`Context`]: a resume
/// opens it only when the local copy does not do.
#[derive(Clone)]
pub(crate) struct StoreSource {
    runtimes: kube::Api<kruntimes_api::Runtime>,
    runtime: String,
    snapshot_dir: Option<PathBuf>,
}

impl StoreSource {
    pub(crate) fn of(context: &Context) -> StoreSource {
        StoreSource {
            runtimes: kube::Api::namespaced(context.client.clone(), &context.namespace),
            runtime: context.runtime.clone(),
            snapshot_dir: context.session_limits.snapshot_dir.clone(),
        }
    }

    /// Reads the Runtime and opens its ArtifactStore, else the filesystem store.
    pub(crate) async fn open(&self) -> Result<Option<Arc<dyn ArtifactStore>>, StoreError> {
        if let Some(store) =
            crate::sessions::artifact_store_of(&self.runtimes, &self.runtime).await?
        {
            return Ok(Some(store));
        }
        Ok(self
            .snapshot_dir
            .as_ref()
            .map(|dir| Arc::new(FilesystemStore::new(dir.join("store"))) as Arc<dyn ArtifactStore>))
    }
}

/// This worker's directory of local copies for the Run `uid`.
///
/// The UID is one path segment of this worker's own directory: one that is empty, `.`,
/// `..` or holds a `/` (an API server would never assign it, but it is read from the API)
/// is hashed like a long Snapshot name, so no UID names a directory outside it.
pub(crate) fn local_dir(context: &Context, uid: &str) -> PathBuf {
    worker_dir(context, "local", uid)
}

/// The staging directory of the checkpoint with Snapshot UID `uid` on this worker, apart
/// from the Runs' directories of local copies ([`sweep_local`] owns those).
pub(crate) fn checkpoint_dir(context: &Context, uid: &str) -> PathBuf {
    worker_dir(context, "checkpoints", uid)
}

/// `<snapshot dir>/<kind>/<pod>/<uid>`, the UID made one safe path segment.
fn worker_dir(context: &Context, kind: &str, uid: &str) -> PathBuf {
    let root = context
        .session_limits
        .snapshot_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("kruntimes-snapshots"));
    let segment = if is_plain_segment(uid) {
        uid.to_string()
    } else {
        hashed(uid)
    };
    root.join(kind).join(&context.pod_name).join(segment)
}

/// The local copy of Snapshot `name` of Run `uid`.
pub(crate) fn local_copy(context: &Context, uid: &str, name: &str) -> PathBuf {
    local_dir(context, uid).join(format!("{}.tar.zst", file_stem(name)))
}

/// The longest Snapshot name used as it is in a local copy's file name: with the staging
/// file's `.` and `.partial` (or `.tar.zst`) it stays under the 255 bytes a file name may
/// have. Snapshot names are `<run>-s<incarnation>`, and a Run name may have 253 bytes.
const MAX_PLAIN_STEM: usize = 200;

/// The file name stem of Snapshot `name`'s local copy: the name, or for a longer one a
/// digest of it (a long Run name made the copy's creation fail `ENAMETOOLONG`, so the
/// session could never be suspended).
fn file_stem(name: &str) -> String {
    if name.len() <= MAX_PLAIN_STEM && is_plain_segment(name) {
        name.to_string()
    } else {
        hashed(name)
    }
}

/// Whether `segment` can be one path segment as it is.
fn is_plain_segment(segment: &str) -> bool {
    !segment.is_empty() && segment != "." && segment != ".." && !segment.contains(['/', '\\', '\0'])
}

/// `sha256-<hex>` of `text`: a fixed-length path segment that stands for it.
fn hashed(text: &str) -> String {
    format!("sha256-{}", hex::encode(Sha256::digest(text.as_bytes())))
}

/// Removes every local copy of the Run `uid` (it ended or was deleted); best effort.
pub(crate) async fn forget_local(context: &Context, uid: &str) {
    let dir = local_dir(context, uid);
    match tokio::fs::remove_dir_all(&dir).await {
        Ok(()) => tracing::debug!(run_uid = %uid, "removed the Run's local snapshot copies"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(run_uid = %uid, error = %e, "cannot remove local snapshot copies"),
    }
}

/// Asks the runtime server to remove the files it parked for the Run `uid` (a close with
/// purge and no park: a session of the Run it still holds, from an incarnation that is not
/// this worker's any more, goes too); best effort, bounded.
async fn forget_parked(context: &Context, uid: &str) {
    // The runtime server takes only a lowercase UUID; a directory named otherwise is a
    // hashed name (see `local_dir`), whose Run it never held.
    let is_uuid = uid.len() == 36
        && uid.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_digit() || (b'a'..=b'f').contains(&b),
        });
    if !context.sessions_supported || !is_uuid {
        return;
    }
    let mut call = tonic::Request::new(rs::CloseSessionRequest {
        id: Some(rs::ExecutionId {
            run_uid: uid.to_string(),
            // Above any attempt of any incarnation.
            attempt: u32::MAX,
        }),
        grace_period: None,
        purge: true,
        park_digest: String::new(),
    });
    call.set_timeout(context.session_limits.close_timeout);
    if let Err(status) = context.session_client.clone().close_session(call).await {
        tracing::warn!(run_uid = %uid, error = %status.message(), "cannot remove parked files");
    }
}

/// What a sweep of this worker's local copies removed and kept.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Swept {
    /// Run UIDs whose local copies were removed.
    pub removed: Vec<String>,
    /// Run UIDs whose local copies were kept.
    pub kept: usize,
}

/// Removes this worker's local copies that no resume can use any more, which the Run's end
/// on this worker does not reach: a Run resumed on another worker (its copy here is of an
/// earlier incarnation; its next suspend copies to where it is then), a Run that ended or
/// was deleted while it was on no worker (Suspended) or on another one.
///
/// A copy is kept while its Run exists with its UID and is Suspended, Pending or Scheduled
/// (it may be resumed here), or is assigned to this worker. The directory is read before
/// the Snapshots are listed: a copy is written only after its Snapshot is created, so a
/// copy seen here whose Run's Snapshots are all gone belongs to a deleted Run. Every copy
/// is also in the store, so a copy removed as a resume starts only costs that resume a
/// read of the store. Errors of the API leave everything in place until the next sweep.
pub(crate) async fn sweep_local(context: &Context) -> Swept {
    let own = local_dir(context, "x");
    let Some(root) = own.parent() else {
        return Swept::default();
    };
    let mut uids = Vec::new();
    match tokio::fs::read_dir(root).await {
        Ok(mut entries) => {
            while let Ok(Some(entry)) = entries.next_entry().await {
                if let Some(name) = entry.file_name().to_str() {
                    uids.push(name.to_string());
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Swept::default(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the local snapshot copies to sweep them");
            return Swept::default();
        }
    }
    if uids.is_empty() {
        return Swept::default();
    }
    let snapshots = kube::Api::<kruntimes_api::Snapshot>::namespaced(
        context.client.clone(),
        &context.namespace,
    );
    let listed = match kruntimes_api::paging::list_all(&snapshots, &Default::default()).await {
        Ok(listed) => listed,
        Err(e) => {
            tracing::warn!(error = %e, "cannot list Snapshots to sweep the local copies");
            return Swept::default();
        }
    };
    let mut swept = Swept::default();
    for uid in uids {
        // A session served here is never swept, whatever its Snapshots say.
        if context.sessions.get(&uid).is_some() {
            swept.kept += 1;
            continue;
        }
        // The Run of the copies: the name its Snapshots carry (they pin its UID).
        let run_name = listed
            .iter()
            .find(|s| s.spec.source.run.uid.as_deref() == Some(uid.as_str()))
            .map(|s| s.spec.run_name().to_string());
        let keep = match run_name {
            None => false,
            Some(name) => match context.api().get_opt(&name).await {
                Ok(run) => run.is_some_and(|run| copy_is_useful(&run, &uid, &context.pod_name)),
                Err(e) => {
                    tracing::warn!(run = %name, error = %e, "cannot read a Run to sweep its local copies");
                    true
                }
            },
        };
        if keep {
            swept.kept += 1;
            continue;
        }
        let dir = root.join(&uid);
        // The runtime server's parked files of the Run go with its local copies: they were
        // made by the same suspend, for a resume here.
        forget_parked(context, &uid).await;
        match tokio::fs::remove_dir_all(&dir).await {
            Ok(()) => {
                tracing::info!(run_uid = %uid, "removed local snapshot copies no resume can use");
                swept.removed.push(uid);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(run_uid = %uid, error = %e, "cannot remove local snapshot copies")
            }
        }
    }
    swept
}

/// Whether a local copy on `pod` of the Run with UID `uid` may still serve a resume of `run`
/// (see [`sweep_local`]).
fn copy_is_useful(run: &kruntimes_api::Run, uid: &str, pod: &str) -> bool {
    use kruntimes_api::Phase;
    use kube::ResourceExt;
    if run.uid().as_deref() != Some(uid) || run.phase().is_terminal() {
        return false;
    }
    let assigned = run.status.as_ref().and_then(|s| s.assigned_pod.as_deref());
    assigned == Some(pod)
        || matches!(
            run.phase(),
            Phase::Suspended | Phase::Pending | Phase::Scheduled
        )
}

/// A capture written to its local copy.
pub(crate) struct Captured {
    pub path: PathBuf,
    pub summary: rs::SnapshotSummary,
}

/// CaptureSession into the local copy of Snapshot `name` (staging file, then rename; a cache, not synced),
/// keeping no other copy of the Run. The stream's digest is checked against the summary.
pub(crate) async fn capture(
    context: &Context,
    key: &Key,
    name: &str,
    max_bytes: u64,
) -> Result<Captured, String> {
    capture_into(
        context.session_client.clone(),
        local_dir(context, &key.uid),
        key,
        name,
        max_bytes,
    )
    .await
}

/// [`capture`] with its parts: the runtime server and the Run's local directory.
pub(crate) async fn capture_into(
    client: crate::sessions::SessionClient,
    dir: PathBuf,
    key: &Key,
    name: &str,
    max_bytes: u64,
) -> Result<Captured, String> {
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(|e| format!("cannot create the local snapshot directory: {e}"))?;
    let staging = dir.join(format!(".{}.partial", file_stem(name)));
    let stream_cap = kruntimes_proto::snapshot_caps::stream_bytes(max_bytes, 0);
    let result = async {
        let mut file = tokio::fs::File::create(&staging)
            .await
            .map_err(|e| format!("cannot create the local copy: {e}"))?;
        let mut call = tonic::Request::new(rs::CaptureSessionRequest {
            id: Some(key.id()),
            max_bytes,
            max_files: 0,
        });
        call.set_timeout(std::time::Duration::from_secs(600));
        let mut stream = client
            .max_decoding_message_size(MAX_CAPTURE_MESSAGE)
            .capture_session(call)
            .await
            .map_err(|s| format!("CaptureSession: {}", s.message()))?
            .into_inner();
        let mut hasher = Sha256::new();
        let mut total: u64 = 0;
        let mut summary = None;
        while let Some(message) = stream
            .message()
            .await
            .map_err(|s| format!("CaptureSession: {}", s.message()))?
        {
            match message.part {
                Some(rs::capture_session_response::Part::Data(data)) => {
                    total += data.len() as u64;
                    if total > stream_cap {
                        return Err(format!("the capture exceeds {stream_cap} bytes compressed"));
                    }
                    hasher.update(&data);
                    file.write_all(&data)
                        .await
                        .map_err(|e| format!("cannot write the local copy: {e}"))?;
                }
                Some(rs::capture_session_response::Part::Summary(s)) => {
                    summary = Some(s);
                    break;
                }
                None => {}
            }
        }
        let summary = summary.ok_or("CaptureSession ended without its summary")?;
        let digest = format!("sha256:{}", hex::encode(hasher.finalize()));
        if digest != summary.digest || total != summary.compressed_bytes {
            return Err("the captured stream does not match its summary".to_string());
        }
        // Not synced: the local copy is a cache. A restore reads it only when its digest
        // is the Snapshot's, else the store's copy, which is durable before the Snapshot
        // is Ready; a copy a crash of the machine tore is read from the store instead.
        file.flush()
            .await
            .map_err(|e| format!("cannot write the local copy: {e}"))?;
        Ok(summary)
    }
    .await;
    let summary = match result {
        Ok(summary) => summary,
        Err(e) => {
            let _ = tokio::fs::remove_file(&staging).await;
            return Err(crate::artifacts::bounded(&e));
        }
    };
    let path = dir.join(format!("{}.tar.zst", file_stem(name)));
    tokio::fs::rename(&staging, &path)
        .await
        .map_err(|e| format!("cannot place the local copy: {e}"))?;
    // At most the latest copy per Run.
    if let Ok(mut entries) = tokio::fs::read_dir(&dir).await {
        while let Ok(Some(entry)) = entries.next_entry().await {
            if entry.path() != path {
                let _ = tokio::fs::remove_file(entry.path()).await;
            }
        }
    }
    Ok(Captured { path, summary })
}

/// Streams a file in chunks.
fn file_stream(path: PathBuf) -> ByteStream {
    futures::stream::once(async move { tokio::fs::File::open(path).await })
        .flat_map(|opened| match opened {
            Err(e) => futures::stream::iter(vec![Err(e)]).boxed(),
            Ok(file) => futures::stream::unfold(file, |mut file| async move {
                let mut buffer = vec![0u8; CHUNK];
                match file.read(&mut buffer).await {
                    Ok(0) => None,
                    Ok(n) => {
                        buffer.truncate(n);
                        Some((Ok(Bytes::from(buffer)), file))
                    }
                    Err(e) => Some((Err(e), file)),
                }
            })
            .boxed(),
        })
        .boxed()
}

/// Where a capture was stored.
pub(crate) struct Stored {
    pub uri: String,
    pub manifest_uri: String,
}

/// Puts the local copy and its manifest in the store.
pub(crate) async fn upload(
    store: &dyn ArtifactStore,
    namespace: &str,
    name: &str,
    captured: &Captured,
) -> Result<Stored, StoreError> {
    let prefix = format!("{namespace}/snapshots/{name}");
    let manifest = serde_json::json!({
        "digest": captured.summary.digest,
        "sizeBytes": captured.summary.size_bytes,
        "compressedBytes": captured.summary.compressed_bytes,
        "files": captured.summary.files,
        "skipped": captured.summary.skipped,
        "entries": captured.summary.manifest.iter().map(|e| serde_json::json!({
            "path": e.path,
            "kind": match e.kind() {
                rs::snapshot_manifest_entry::Kind::File => "file",
                rs::snapshot_manifest_entry::Kind::Directory => "directory",
                rs::snapshot_manifest_entry::Kind::Symlink => "symlink",
                rs::snapshot_manifest_entry::Kind::Unspecified => "unknown",
            },
            "sizeBytes": e.size_bytes,
            "mode": format!("{:o}", e.mode),
            "mtimeSeconds": e.mtime_seconds,
            "digest": e.digest,
            "linkTarget": e.link_target,
        })).collect::<Vec<_>>(),
    });
    let bytes = Bytes::from(serde_json::to_vec(&manifest).unwrap_or_default());
    // Side by side, each to its end (neither is dropped when the other fails, which would
    // leave its staging object behind).
    let (archive_key, manifest_key) = (
        format!("{prefix}/archive.tar.zst"),
        format!("{prefix}/manifest.json"),
    );
    let (blob, manifest_ref) = tokio::join!(
        store.put_blob(&archive_key, file_stream(captured.path.clone())),
        store.put_blob(
            &manifest_key,
            futures::stream::iter(vec![Ok(bytes)]).boxed(),
        )
    );
    let (blob, manifest_ref) = (blob?, manifest_ref?);
    if blob.digest != captured.summary.digest {
        return Err(StoreError::Transport(
            "the stored snapshot's digest differs from the capture's".to_string(),
        ));
    }
    Ok(Stored {
        uri: blob.uri,
        manifest_uri: manifest_ref.uri,
    })
}

/// Why a restore failed.
#[derive(Debug)]
pub(crate) enum RestoreError {
    /// The snapshot is bad (digest, archive, caps): the Run fails `SnapshotInvalid`.
    Invalid(String),
    /// The store or the runtime server could not be reached: try again later.
    Transport(String),
}

/// What a resume restores.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub snapshot: String,
    pub digest: String,
    pub uri: String,
}

/// What a restore needs of the worker, taken from the [`Context`] before the background
/// registration. Nothing here reads the API: the store is opened only when the local copy
/// does not do.
pub(crate) struct RestoreEnv {
    client: crate::sessions::SessionClient,
    metrics: Arc<crate::metrics::Metrics>,
    local: PathBuf,
    store: StoreSource,
}

impl RestoreEnv {
    pub(crate) fn of(context: &Context, uid: &str, snapshot: &str) -> RestoreEnv {
        RestoreEnv {
            client: context.session_client.clone(),
            metrics: context.metrics.clone(),
            local: local_copy(context, uid, snapshot),
            store: StoreSource::of(context),
        }
    }
}

/// How one attempt of a restore failed.
enum Attempt {
    /// Reading the source failed (a local copy that cannot be read, a store that broke off).
    Source(String),
    /// The runtime server refused or could not take it.
    Server(RestoreError),
    /// The runtime server could not be reached, or its disk is full: not the source's
    /// fault, and no other source would do better now (register again later).
    Later(String),
}

/// RestoreSession into the freshly registered session `key` from the files the runtime
/// server parked at the suspend (a resume on the same worker: nothing is read or
/// extracted), else from the local copy, else from the store. Returns the source used.
///
/// The local copy is not hashed here first: the runtime server checks the stream's digest
/// against the Snapshot's before it moves anything into the workspace, so a local copy that
/// is missing, unreadable or does not match (a refusal as `SnapshotInvalid`) leaves the
/// session fresh, and the restore goes on from the store. Its digest is checked there the
/// same way; a mismatch then is the snapshot's (`Invalid`).
pub(crate) async fn restore(
    env: &RestoreEnv,
    key: &Key,
    plan: &Plan,
    max_bytes: u64,
) -> Result<&'static str, RestoreError> {
    let started = std::time::Instant::now();
    // Files are parked only where the suspend wrote its local copy: without one here, the
    // runtime server is not asked.
    if tokio::fs::try_exists(&env.local).await.unwrap_or(false) {
        if from_parked(env, key, plan, max_bytes).await? {
            return Ok(restored(env, key, plan, "parked", started));
        }
        let local = file_stream(env.local.clone());
        match attempt(env, key, plan, max_bytes, local).await {
            Ok(()) => return Ok(restored(env, key, plan, "local", started)),
            Err(Attempt::Later(message)) => return Err(RestoreError::Transport(message)),
            // Whatever else the server refused it for (a digest that does not match, an
            // archive it cannot extract), the store's copy may do.
            Err(
                Attempt::Source(message)
                | Attempt::Server(RestoreError::Invalid(message) | RestoreError::Transport(message)),
            ) => {
                tracing::warn!(
                    run_uid = %key.uid,
                    snapshot = %plan.snapshot,
                    error = %message,
                    "the local copy of the snapshot does not do; restoring from the store"
                );
                let _ = tokio::fs::remove_file(&env.local).await;
            }
        }
    }
    let store = env
        .store
        .open()
        .await
        .map_err(|e| RestoreError::Transport(e.to_string()))?
        .ok_or_else(|| {
            RestoreError::Transport(
                "no snapshot store is configured on this worker to restore from".to_string(),
            )
        })?;
    // Capped as the capture was (the compressed stream of incompressible files is a little
    // larger than the files): a tighter cap would refuse a good snapshot.
    let blob = store
        .get_blob(
            &plan.uri,
            kruntimes_proto::snapshot_caps::stream_bytes(max_bytes, 0),
        )
        .await
        .map_err(|e| match e {
            StoreError::Invalid(m) => RestoreError::Invalid(m),
            StoreError::Transport(m) => RestoreError::Transport(m),
        })?;
    let blob = blob
        .map(|chunk| chunk.map_err(|e| std::io::Error::other(e.to_string())))
        .boxed();
    match attempt(env, key, plan, max_bytes, blob).await {
        Ok(()) => Ok(restored(env, key, plan, "store", started)),
        Err(Attempt::Server(e)) => Err(e),
        Err(Attempt::Later(message)) => Err(RestoreError::Transport(message)),
        Err(Attempt::Source(message)) => Err(RestoreError::Transport(format!(
            "reading the snapshot from the store: {message}"
        ))),
    }
}

/// RestoreSession from the files the runtime server parked with the Snapshot's digest:
/// `Ok(false)` when it holds none (or could not move them: the session is as it was), so
/// the restore goes on from data; an unreachable server is an error.
async fn from_parked(
    env: &RestoreEnv,
    key: &Key,
    plan: &Plan,
    max_bytes: u64,
) -> Result<bool, RestoreError> {
    let header = rs::RestoreHeader {
        id: Some(key.id()),
        max_bytes,
        max_files: 0,
        digest: plan.digest.clone(),
        parked: true,
    };
    let parts = [
        rs::restore_session_request::Part::Header(header),
        rs::restore_session_request::Part::End(rs::RestoreEnd { total_bytes: 0 }),
    ]
    .map(|part| rs::RestoreSessionRequest { part: Some(part) });
    match env
        .client
        .clone()
        .restore_session(futures::stream::iter(parts))
        .await
    {
        Ok(_) => Ok(true),
        Err(status) if matches!(status.code(), Code::Unavailable | Code::Unknown) => Err(
            RestoreError::Transport(crate::artifacts::bounded(status.message())),
        ),
        Err(status) => {
            let reason = status
                .metadata()
                .get("x-kruntimes-reason")
                .and_then(|r| r.to_str().ok())
                .unwrap_or_default()
                .to_string();
            if reason != "NoParkedFiles" {
                tracing::warn!(run_uid = %key.uid, reason, error = %status.message(), "the parked files did not do; restoring from data");
            }
            Ok(false)
        }
    }
}

/// Counts and logs a restore from `source`; returns `source`.
fn restored(
    env: &RestoreEnv,
    key: &Key,
    plan: &Plan,
    source: &'static str,
    started: std::time::Instant,
) -> &'static str {
    env.metrics.snapshot_restore(source);
    tracing::info!(
        run_uid = %key.uid,
        snapshot = %plan.snapshot,
        source,
        restore_ms = started.elapsed().as_secs_f64() * 1e3,
        "snapshot restored"
    );
    source
}

/// One RestoreSession call with the chunks of `chunks`.
async fn attempt(
    env: &RestoreEnv,
    key: &Key,
    plan: &Plan,
    max_bytes: u64,
    chunks: ByteStream,
) -> Result<(), Attempt> {
    // The chunks are read here (so a failure of the source is told apart from the
    // server's verdict) and handed to the call through a bounded channel.
    let (tx, rx) = tokio::sync::mpsc::channel::<rs::RestoreSessionRequest>(4);
    let header = rs::RestoreSessionRequest {
        part: Some(rs::restore_session_request::Part::Header(
            rs::RestoreHeader {
                id: Some(key.id()),
                max_bytes,
                max_files: 0,
                digest: plan.digest.clone(),
                parked: false,
            },
        )),
    };
    let feeder = tokio::spawn(async move {
        let mut chunks = chunks;
        if tx.send(header).await.is_err() {
            return Ok(());
        }
        let mut total: u64 = 0;
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| e.to_string())?;
            for piece in chunk.chunks(CHUNK) {
                total += piece.len() as u64;
                let part = rs::restore_session_request::Part::Data(piece.to_vec());
                if tx
                    .send(rs::RestoreSessionRequest { part: Some(part) })
                    .await
                    .is_err()
                {
                    return Ok(());
                }
            }
        }
        let end = rs::restore_session_request::Part::End(rs::RestoreEnd { total_bytes: total });
        let _ = tx.send(rs::RestoreSessionRequest { part: Some(end) }).await;
        Ok::<(), String>(())
    });
    let answer = env
        .client
        .clone()
        .restore_session(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await;
    let fed = feeder
        .await
        .unwrap_or_else(|e| Err(format!("the restore's reader failed: {e}")));
    if let Err(message) = fed {
        return Err(Attempt::Source(message));
    }
    match answer {
        Ok(_) => Ok(()),
        // The worker's disk is full: not the snapshot's fault; register again later
        // (another worker may have room), never Failed.
        Err(status)
            if status
                .metadata()
                .get("x-kruntimes-reason")
                .is_some_and(|r| r == "InsufficientStorage") =>
        {
            Err(Attempt::Later(crate::artifacts::bounded(status.message())))
        }
        Err(status)
            if matches!(
                status.code(),
                Code::Unavailable | Code::Unknown | Code::DeadlineExceeded | Code::Cancelled
            ) =>
        {
            Err(Attempt::Later(crate::artifacts::bounded(status.message())))
        }
        Err(status)
            if matches!(
                status.code(),
                Code::InvalidArgument | Code::ResourceExhausted
            ) =>
        {
            Err(Attempt::Server(RestoreError::Invalid(
                crate::artifacts::bounded(status.message()),
            )))
        }
        Err(status) => Err(Attempt::Server(RestoreError::Transport(
            crate::artifacts::bounded(status.message()),
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_snapshot_names_and_odd_uids_become_short_plain_segments() {
        let short = "session-1-s2";
        assert_eq!(file_stem(short), short);
        // A 253-byte Run name at incarnation 65535: its staging file name would have 270
        // bytes; the stem is a digest, the same for the same name and unlike another's.
        let long = format!("{}-s65535", "r".repeat(253));
        let stem = file_stem(&long);
        assert_eq!(stem.len(), "sha256-".len() + 64);
        assert!(format!(".{stem}.partial").len() <= 255);
        assert_eq!(stem, file_stem(&long));
        assert_ne!(stem, file_stem(&format!("{}-s65534", "r".repeat(253))));
        let longest_plain = "n".repeat(MAX_PLAIN_STEM);
        assert_eq!(file_stem(&longest_plain), longest_plain);
        assert!(format!(".{longest_plain}.partial").len() <= 255);
        for odd in ["", ".", "..", "../x", "a/b", "a\\b", "a\0b"] {
            assert!(!is_plain_segment(odd), "{odd:?}");
            let segment = hashed(odd);
            assert!(
                is_plain_segment(&segment) && !segment.contains(".."),
                "{odd:?}"
            );
        }
        assert!(is_plain_segment("7f0c1b2a-3d4e-4f50-8a9b-0c1d2e3f4a5b"));
    }

    #[test]
    fn a_copy_is_kept_while_a_resume_here_may_use_it() {
        use kruntimes_api::{Phase, Run, RunSpec, RunStatus};
        let run = |phase: Phase, pod: Option<&str>| {
            let mut run = Run::new("s", RunSpec::task("r", "unused"));
            run.metadata.uid = Some("u1".into());
            run.status = Some(RunStatus {
                phase: Some(phase),
                assigned_pod: pod.map(str::to_string),
                ..RunStatus::default()
            });
            run
        };
        for phase in [Phase::Suspended, Phase::Pending, Phase::Scheduled] {
            assert!(copy_is_useful(&run(phase, None), "u1", "here"), "{phase:?}");
        }
        assert!(copy_is_useful(
            &run(Phase::Ready, Some("here")),
            "u1",
            "here"
        ));
        // Resumed elsewhere, ended, or another Run of the same name.
        assert!(!copy_is_useful(
            &run(Phase::Ready, Some("there")),
            "u1",
            "here"
        ));
        assert!(!copy_is_useful(
            &run(Phase::Running, Some("there")),
            "u1",
            "here"
        ));
        assert!(!copy_is_useful(
            &run(Phase::Succeeded, Some("here")),
            "u1",
            "here"
        ));
        assert!(!copy_is_useful(&run(Phase::Failed, None), "u1", "here"));
        assert!(!copy_is_useful(&run(Phase::Suspended, None), "u2", "here"));
    }
}
