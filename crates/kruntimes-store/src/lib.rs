//! The ArtifactStore of a Runtime (`Runtime.spec.artifactStore`): where drained sessions
//! export their artifacts, where artifact inputs are read from, and where workspace
//! snapshots (one large blob and a small manifest each) are kept.
//!
//! [`ArtifactStore`] is the one interface runtimed calls; two drivers implement it:
//! [`filesystem::FilesystemStore`] (a directory every worker reaches) and [`s3::S3Store`]
//! (an S3-protocol bucket, for workers on many nodes). [`open`] picks the driver a
//! Runtime names. This module owns the shared rules: what is exported (the regular files
//! under a session's artifacts directory, bounded in count, size and name), how blob keys
//! are spelled, and the split of every failure into [`StoreError::Transport`] (the store
//! could not be reached or written: retry later) and [`StoreError::Invalid`] (the request
//! can never succeed: the Run fails).
//!
//! It never decides a Run's phase and never writes status: callers do, from the result.

pub mod filesystem;
pub mod s3;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use kruntimes_api::run::{ArtifactInput, ArtifactRef};
use kruntimes_api::runtime::ArtifactStoreSpec;

/// Artifacts of one Run at most (ARCHITECTURE.md, "Limits").
pub const MAX_ARTIFACTS: usize = 32;
/// The largest artifact.
pub const MAX_ARTIFACT_BYTES: u64 = 256 * 1024 * 1024;
/// The longest artifact name (its path under the artifacts directory).
pub const MAX_NAME_BYTES: usize = 253;
/// Artifact inputs of one Run together at most (they travel in one registration).
pub const MAX_INPUT_BYTES: u64 = 1024 * 1024;
/// The longest blob key.
pub const MAX_KEY_BYTES: usize = 1024;

/// Why a store operation did not complete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached, read or written: retry later. Misconfiguration
    /// (refused credentials, a missing bucket) is reported here too, with the bucket and
    /// the S3 error code, so the Run waits for an operator instead of losing its work.
    #[error("{0}")]
    Transport(String),
    /// The request can never succeed (an artifact that cannot be exported, a URI outside
    /// the store, a blob over its cap): the Run fails.
    #[error("{0}")]
    Invalid(String),
}

/// The name today's export callers know the error by.
pub type ExportError = StoreError;

/// The Run whose artifacts are exported: they go under `<namespace>/<name>-<uid>/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunKey {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl RunKey {
    /// The key of the Run's export directory, relative to the store's root or prefix.
    pub fn export_dir(&self) -> String {
        format!("{}/{}-{}", self.namespace, self.name, self.uid)
    }
}

/// A blob written by [`ArtifactStore::put_blob`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlobRef {
    /// Where it is: `file:///…` or `s3://bucket/key`; what [`ArtifactStore::get_blob`] and
    /// [`ArtifactStore::delete`] take.
    pub uri: String,
    pub size: u64,
    /// `sha256:<hex>` of its bytes.
    pub digest: String,
}

/// A stream of a blob's bytes, as written or read.
pub type ByteStream = BoxStream<'static, Result<Bytes, std::io::Error>>;
/// A blob being read: each chunk, or why the read stopped.
pub type BlobStream = BoxStream<'static, Result<Bytes, StoreError>>;

/// A Runtime's ArtifactStore.
///
/// Every operation is confined to the store: a URI or key outside its root (filesystem)
/// or its bucket and prefix (S3) is [`StoreError::Invalid`] and touches nothing.
#[async_trait]
pub trait ArtifactStore: Send + Sync {
    /// Exports the regular files under `artifacts` (a drained session's artifacts
    /// directory) for `run`; their refs, sorted by name, with sizes and SHA-256 digests.
    ///
    /// All or nothing: refs are returned only once every artifact is durable and the set
    /// is complete (each driver documents how); a failure part-way leaves no complete
    /// export behind, and a retry (after a failure, or after a lost status write) starts
    /// afresh and replaces the earlier attempt. A missing directory exports nothing.
    async fn export(&self, run: &RunKey, artifacts: &Path) -> Result<Vec<ArtifactRef>, StoreError>;

    /// Reads artifact inputs: (workspace path, content) pairs, at most
    /// [`MAX_INPUT_BYTES`] together. A URI of another scheme, or outside the store, is
    /// [`StoreError::Invalid`].
    async fn read_inputs(
        &self,
        inputs: &[ArtifactInput],
    ) -> Result<Vec<(String, Vec<u8>)>, StoreError>;

    /// Writes the blob `key` (see [`check_key`]) from `chunks`, never holding more than a
    /// part of it in memory. The blob becomes visible whole, or not at all: a failed
    /// stream or store leaves no object under `key` (an earlier blob there stays until
    /// the new one replaces it).
    async fn put_blob(&self, key: &str, chunks: ByteStream) -> Result<BlobRef, StoreError>;

    /// Reads the blob at `uri` (a [`BlobRef::uri`]) as a stream of chunks. A blob larger
    /// than `max_bytes` is refused before any byte is read ([`StoreError::Invalid`]); one
    /// that grows past it while read ends its stream with that error.
    async fn get_blob(&self, uri: &str, max_bytes: u64) -> Result<BlobStream, StoreError>;

    /// Deletes the object at `uri`, or, for a `uri` ending in `/`, every object under that
    /// prefix. Deleting what is not there succeeds.
    async fn delete(&self, uri: &str) -> Result<(), StoreError>;

    /// The snapshot data of the store: every object under `<namespace>/snapshots/` of any
    /// namespace, at most `max` of them ([`Listing::truncated`] says when more were left).
    /// A driver never lists anything else (exported artifacts, inputs), so a collector of
    /// snapshot data cannot even see them.
    async fn list_snapshot_data(&self, max: usize) -> Result<Listing, StoreError>;
}

/// The segment after the namespace of every snapshot blob key.
pub const SNAPSHOTS_SEGMENT: &str = "snapshots";

/// An object of the store, as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// Its key, relative to the store's root or prefix (`<namespace>/snapshots/…`).
    pub key: String,
    /// What [`ArtifactStore::delete`] takes.
    pub uri: String,
    pub size: u64,
    /// When it was last written.
    pub modified: std::time::SystemTime,
}

/// What [`ArtifactStore::list_snapshot_data`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing {
    pub objects: Vec<Listed>,
    /// More objects were there than the listing's bound.
    pub truncated: bool,
}

/// Opens the driver `spec` names. S3 credentials come from runtimed's environment
/// ([`s3::S3Store::from_spec`]).
pub fn open(spec: &ArtifactStoreSpec) -> Result<Arc<dyn ArtifactStore>, StoreError> {
    match (&spec.filesystem, &spec.s3) {
        (Some(fs), None) => Ok(Arc::new(filesystem::FilesystemStore::new(&fs.path))),
        (None, Some(s3)) => Ok(Arc::new(s3::S3Store::from_spec(s3)?)),
        _ => Err(StoreError::Invalid(
            "the Runtime's artifactStore must name exactly one driver: filesystem or s3"
                .to_string(),
        )),
    }
}

/// Checks a blob key: at most [`MAX_KEY_BYTES`] bytes of `/`-separated segments, none
/// empty, `.` or `..`, no leading `/`, no control characters or `\`; by convention its
/// first segment is the namespace (`<namespace>/snapshots/<name>/…`).
pub fn check_key(key: &str) -> Result<(), StoreError> {
    let valid = !key.is_empty()
        && key.len() <= MAX_KEY_BYTES
        && !key.chars().any(|c| c.is_control() || c == '\\')
        && key
            .split('/')
            .all(|segment| !segment.is_empty() && segment != "." && segment != "..");
    if valid {
        Ok(())
    } else {
        Err(StoreError::Invalid(format!(
            "blob key {:?} must be 1 to {MAX_KEY_BYTES} bytes of '/'-separated segments, none \
             empty, '.' or '..'",
            bounded(key)
        )))
    }
}

/// At most 64 characters of `text`, for error messages.
pub fn bounded(text: &str) -> String {
    text.chars().take(64).collect()
}

/// The regular files under `dir`, as (name relative to `dir`, path), sorted by name. A
/// missing directory has none (a command removed it); a directory replaced by a symlink or
/// a file is invalid (runtimed never follows it out of the session).
pub(crate) fn collect(dir: &Path) -> Result<Vec<(String, PathBuf)>, StoreError> {
    match fs::symlink_metadata(dir) {
        Ok(meta) if meta.file_type().is_dir() => {}
        Ok(_) => {
            return Err(StoreError::Invalid(
                "$KRUNTIME_ARTIFACTS_DIR was replaced by something that is not a directory"
                    .to_string(),
            ));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(StoreError::Transport(format!(
                "cannot read the artifacts directory: {e}"
            )));
        }
    }
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(current) = pending.pop() {
        let entries = fs::read_dir(&current).map_err(|e| {
            StoreError::Transport(format!("cannot list the artifacts directory: {e}"))
        })?;
        for entry in entries {
            let entry = entry.map_err(|e| {
                StoreError::Transport(format!("cannot list the artifacts directory: {e}"))
            })?;
            let path = entry.path();
            let relative = path
                .strip_prefix(dir)
                .ok()
                .and_then(Path::to_str)
                .ok_or_else(|| {
                    StoreError::Invalid("an artifact's name is not valid UTF-8".to_string())
                })?
                .to_string();
            let kind = entry
                .file_type()
                .map_err(|e| StoreError::Transport(format!("cannot stat {relative}: {e}")))?;
            if kind.is_dir() {
                pending.push(path);
            } else if kind.is_file() {
                if relative.len() > MAX_NAME_BYTES {
                    return Err(StoreError::Invalid(format!(
                        "artifact name {:?}… is longer than {MAX_NAME_BYTES} bytes",
                        bounded(&relative)
                    )));
                }
                found.push((relative, path));
                if found.len() > MAX_ARTIFACTS {
                    return Err(StoreError::Invalid(format!(
                        "more than {MAX_ARTIFACTS} artifacts"
                    )));
                }
            } else {
                return Err(StoreError::Invalid(format!(
                    "artifact {relative:?} is not a regular file (symlinks and devices are not exported)"
                )));
            }
        }
    }
    found.sort();
    Ok(found)
}

/// Opens an artifact for export, refusing one over [`MAX_ARTIFACT_BYTES`]: the file and
/// its size when opened.
pub(crate) fn open_artifact(path: &Path, name: &str) -> Result<(fs::File, u64), StoreError> {
    let input = fs::File::open(path)
        .map_err(|e| StoreError::Transport(format!("cannot open artifact {name}: {e}")))?;
    let size = input
        .metadata()
        .map_err(|e| StoreError::Transport(format!("cannot stat artifact {name}: {e}")))?
        .len();
    if size > MAX_ARTIFACT_BYTES {
        return Err(StoreError::Invalid(format!(
            "artifact {name} is {size} bytes; the limit is {MAX_ARTIFACT_BYTES}"
        )));
    }
    Ok((input, size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_plain_relative_paths() {
        for good in ["ns/snapshots/s/blob.tar.zst", "a", "ns/x y/z"] {
            assert_eq!(check_key(good), Ok(()), "{good}");
        }
        let long = "a/".repeat(600);
        for bad in [
            "", "/abs", "a//b", "a/../b", "./a", "a/", "a\\b", "a\nb", &long,
        ] {
            let refused = check_key(bad);
            assert!(
                matches!(&refused, Err(StoreError::Invalid(m)) if m.len() < 256),
                "{bad:?}: {refused:?}"
            );
        }
    }
}
