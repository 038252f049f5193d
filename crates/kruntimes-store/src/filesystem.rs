//! The ArtifactStore's filesystem driver (`Runtime.spec.artifactStore.filesystem`).
//!
//! **Export** (a drained session): every regular file under the session's artifacts
//! directory is validated, then copied into `<root>/<namespace>/<run name>-<run uid>/`
//! with its SHA-256 digest. The copy goes to a hidden staging directory first and is
//! renamed into place only when complete, so a failure part-way leaves nothing behind (the
//! staging directory is removed) and a retry starts afresh. A store that cannot be
//! written is a transport failure (the Run stays Finalizing and retries); an artifact that
//! can never be exported (a symlink, a device, too many, too large, a name that is not
//! UTF-8) is invalid (the Run fails).
//!
//! **Import** (artifact inputs): a `file://` URI beneath the store's root, resolved with
//! symlinks and checked to stay beneath it, read whole (at most [`MAX_INPUT_BYTES`] in all).
//!
//! **Blobs**: `put_blob` streams into a hidden staging file beside `<root>/<key>`, synced
//! and renamed into place when complete; `get_blob` and `delete` take `file://` URIs
//! beneath the root only.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use kruntimes_api::run::{ArtifactInput, ArtifactRef};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{
    ArtifactStore, BlobRef, BlobStream, ByteStream, Listed, Listing, MAX_ARTIFACT_BYTES,
    MAX_INPUT_BYTES, RunKey, SNAPSHOTS_SEGMENT, StoreError, bounded, check_key, collect,
    open_artifact,
};

/// How much of a blob one read returns.
const READ_CHUNK: usize = 256 * 1024;

/// A store under a directory every worker reaches.
#[derive(Debug, Clone)]
pub struct FilesystemStore {
    root: PathBuf,
}

impl FilesystemStore {
    /// The store rooted at `root` (created on first write).
    pub fn new(root: impl Into<PathBuf>) -> FilesystemStore {
        FilesystemStore { root: root.into() }
    }

    /// The store's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The path a `file://` URI names, resolved with symlinks and checked to lie beneath
    /// the root (`must_exist`: else its parent is resolved and the name appended).
    fn resolve(&self, uri: &str) -> Result<PathBuf, StoreError> {
        let path = uri.strip_prefix("file://").ok_or_else(|| {
            StoreError::Invalid(format!(
                "{:?} is not a file:// URI of the ArtifactStore",
                bounded(uri)
            ))
        })?;
        let root = self.root.canonicalize().map_err(|e| {
            StoreError::Transport(format!(
                "the ArtifactStore {} cannot be read: {e}",
                self.root.display()
            ))
        })?;
        let path = Path::new(path.strip_suffix('/').unwrap_or(path));
        let resolved = match path.canonicalize() {
            Ok(resolved) => resolved,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // Not there (yet, or any more): its parent must still be beneath the root.
                let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
                    return Err(outside(uri));
                };
                match parent.canonicalize() {
                    Ok(parent) => parent.join(name),
                    Err(_) => return Err(outside(uri)),
                }
            }
            Err(e) => {
                return Err(StoreError::Transport(format!(
                    "{:?} cannot be read: {e}",
                    bounded(uri)
                )));
            }
        };
        if resolved == root || !resolved.starts_with(&root) {
            return Err(outside(uri));
        }
        Ok(resolved)
    }
}

fn outside(uri: &str) -> StoreError {
    StoreError::Invalid(format!(
        "{:?} is not beneath the Runtime's ArtifactStore",
        bounded(uri)
    ))
}

fn write_error(e: std::io::Error) -> StoreError {
    StoreError::Transport(format!("cannot write to the store: {e}"))
}

#[async_trait]
impl ArtifactStore for FilesystemStore {
    async fn export(&self, run: &RunKey, artifacts: &Path) -> Result<Vec<ArtifactRef>, StoreError> {
        let (root, run, artifacts) = (self.root.clone(), run.clone(), artifacts.to_path_buf());
        tokio::task::spawn_blocking(move || export(&root, &run, &artifacts))
            .await
            .map_err(|e| StoreError::Transport(format!("the export task failed: {e}")))?
    }

    async fn read_inputs(
        &self,
        inputs: &[ArtifactInput],
    ) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let (root, inputs) = (self.root.clone(), inputs.to_vec());
        tokio::task::spawn_blocking(move || read_inputs(&root, &inputs))
            .await
            .map_err(|e| StoreError::Transport(format!("reading artifact inputs: {e}")))?
    }

    async fn put_blob(&self, key: &str, mut chunks: ByteStream) -> Result<BlobRef, StoreError> {
        check_key(key)?;
        let target = self.root.join(key);
        let Some((parent, name)) = target.parent().zip(target.file_name()) else {
            return Err(StoreError::Invalid(format!(
                "blob key {key:?} names no file"
            )));
        };
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(write_error)?;
        // A key whose directories were replaced by symlinks out of the root is refused.
        let resolved_parent = tokio::fs::canonicalize(parent).await.map_err(write_error)?;
        let root = tokio::fs::canonicalize(&self.root)
            .await
            .map_err(write_error)?;
        if !resolved_parent.starts_with(&root) {
            return Err(StoreError::Invalid(format!(
                "blob key {:?} leads out of the ArtifactStore",
                bounded(key)
            )));
        }
        let staging = resolved_parent.join(format!(
            ".{}.partial-{:016x}",
            name.to_string_lossy(),
            rand_suffix()
        ));
        let written = async {
            let mut file = tokio::fs::File::create(&staging)
                .await
                .map_err(write_error)?;
            let mut hasher = Sha256::new();
            let mut size: u64 = 0;
            while let Some(chunk) = chunks.next().await {
                let chunk = chunk
                    .map_err(|e| StoreError::Transport(format!("the blob's stream failed: {e}")))?;
                hasher.update(&chunk);
                size += chunk.len() as u64;
                file.write_all(&chunk).await.map_err(write_error)?;
            }
            file.sync_all().await.map_err(write_error)?;
            tokio::fs::rename(&staging, resolved_parent.join(name))
                .await
                .map_err(write_error)?;
            // The rename is durable too: a blob a Snapshot names survives a crash of the
            // machine.
            tokio::fs::File::open(&resolved_parent)
                .await
                .map_err(write_error)?
                .sync_all()
                .await
                .map_err(write_error)?;
            Ok::<_, StoreError>((size, format!("sha256:{}", hex::encode(hasher.finalize()))))
        }
        .await;
        match written {
            Ok((size, digest)) => Ok(BlobRef {
                uri: format!("file://{}", resolved_parent.join(name).display()),
                size,
                digest,
            }),
            Err(e) => {
                let _ = tokio::fs::remove_file(&staging).await;
                Err(e)
            }
        }
    }

    async fn get_blob(&self, uri: &str, max_bytes: u64) -> Result<BlobStream, StoreError> {
        let path = self.resolve(uri)?;
        let file = tokio::fs::File::open(&path).await.map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                StoreError::Invalid(format!("blob {:?} does not exist", bounded(uri)))
            } else {
                StoreError::Transport(format!("cannot read blob {:?}: {e}", bounded(uri)))
            }
        })?;
        let meta = file
            .metadata()
            .await
            .map_err(|e| StoreError::Transport(format!("cannot stat blob: {e}")))?;
        if !meta.is_file() {
            return Err(StoreError::Invalid(format!(
                "{:?} is not a blob",
                bounded(uri)
            )));
        }
        if meta.len() > max_bytes {
            return Err(StoreError::Invalid(format!(
                "blob is {} bytes; the limit is {max_bytes}",
                meta.len()
            )));
        }
        let state = (file, 0u64, vec![0u8; READ_CHUNK]);
        let stream =
            futures::stream::try_unfold(state, move |(mut file, read, mut buf)| async move {
                let n = file
                    .read(&mut buf)
                    .await
                    .map_err(|e| StoreError::Transport(format!("cannot read blob: {e}")))?;
                if n == 0 {
                    return Ok(None);
                }
                let read = read + n as u64;
                if read > max_bytes {
                    return Err(StoreError::Invalid(format!(
                        "blob grew past the limit of {max_bytes} bytes"
                    )));
                }
                let chunk = Bytes::copy_from_slice(&buf[..n]);
                Ok(Some((chunk, (file, read, buf))))
            });
        Ok(stream.boxed())
    }

    async fn delete(&self, uri: &str) -> Result<(), StoreError> {
        let path = self.resolve(uri)?;
        // The store's own URIs are canonical: one whose path leads through a symlink would
        // delete what the link points to, not what it names.
        let named = uri.strip_prefix("file://").unwrap_or(uri);
        if Path::new(named.strip_suffix('/').unwrap_or(named)) != path {
            return Err(StoreError::Invalid(format!(
                "{:?} leads through a symlink; only the store's own paths are deleted",
                bounded(uri)
            )));
        }
        let removed = match tokio::fs::symlink_metadata(&path).await {
            Ok(meta) if meta.is_dir() => tokio::fs::remove_dir_all(&path).await,
            Ok(_) => tokio::fs::remove_file(&path).await,
            Err(e) => Err(e),
        };
        match removed {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::Transport(format!(
                "cannot delete {:?}: {e}",
                bounded(uri)
            ))),
        }
    }

    async fn list_snapshot_data(&self, max: usize) -> Result<Listing, StoreError> {
        let root = self.root.clone();
        tokio::task::spawn_blocking(move || list_snapshot_data(&root, max))
            .await
            .map_err(|e| StoreError::Transport(format!("the listing task failed: {e}")))?
    }
}

/// The regular files under `<root>/<namespace>/snapshots/`, walked without following
/// symlinks (a symlink is neither entered nor listed); at most `max`.
fn list_snapshot_data(root: &Path, max: usize) -> Result<Listing, StoreError> {
    let mut listing = Listing::default();
    let root = match root.canonicalize() {
        Ok(root) => root,
        // Nothing was ever written.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(listing),
        Err(e) => {
            return Err(StoreError::Transport(format!(
                "cannot read the ArtifactStore {}: {e}",
                root.display()
            )));
        }
    };
    let read = |dir: &Path| {
        fs::read_dir(dir)
            .map_err(|e| StoreError::Transport(format!("cannot list {}: {e}", dir.display())))
    };
    let mut dirs = Vec::new();
    for namespace in read(&root)? {
        let namespace = namespace.map_err(|e| StoreError::Transport(e.to_string()))?;
        // A symlinked namespace is not entered: its data would be listed under a name that
        // is not its own, and a delete would reach through it.
        if !namespace.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let snapshots = namespace.path().join(SNAPSHOTS_SEGMENT);
        if fs::symlink_metadata(&snapshots).is_ok_and(|m| m.is_dir()) {
            dirs.push(snapshots);
        }
    }
    while let Some(dir) = dirs.pop() {
        let entries = match read(&dir) {
            Ok(entries) => entries,
            // Removed since it was seen (a concurrent delete).
            Err(_) if !dir.exists() => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let Ok(entry) = entry else { continue };
            let path = entry.path();
            let Ok(meta) = fs::symlink_metadata(&path) else {
                continue;
            };
            if meta.is_dir() {
                dirs.push(path);
                continue;
            }
            // The store writes regular files only; anything else (a symlink) is not listed.
            if !meta.is_file() {
                continue;
            }
            if listing.objects.len() >= max {
                listing.truncated = true;
                return Ok(listing);
            }
            let Ok(relative) = path.strip_prefix(&root) else {
                continue;
            };
            let key = relative
                .components()
                .map(|c| c.as_os_str().to_string_lossy())
                .collect::<Vec<_>>()
                .join("/");
            listing.objects.push(Listed {
                key,
                uri: format!("file://{}", path.display()),
                size: meta.len(),
                modified: meta.modified().unwrap_or(std::time::SystemTime::UNIX_EPOCH),
            });
        }
    }
    Ok(listing)
}

/// A random suffix for staging names, so two writers of one key never share a file.
fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

/// Copies `from` to `to`, hashing it; the size and `sha256:<hex>` digest.
fn copy_hashed(from: &Path, to: &Path, name: &str) -> Result<(u64, String), StoreError> {
    let (mut input, _) = open_artifact(from, name)?;
    if let Some(parent) = to.parent() {
        fs::create_dir_all(parent).map_err(write_error)?;
    }
    let mut output = fs::File::create(to).map_err(write_error)?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 64 * 1024];
    let mut copied: u64 = 0;
    loop {
        let n = input
            .read(&mut buffer)
            .map_err(|e| StoreError::Transport(format!("cannot read artifact {name}: {e}")))?;
        if n == 0 {
            break;
        }
        copied += n as u64;
        if copied > MAX_ARTIFACT_BYTES {
            return Err(StoreError::Invalid(format!(
                "artifact {name} grew past {MAX_ARTIFACT_BYTES} bytes"
            )));
        }
        hasher.update(&buffer[..n]);
        output.write_all(&buffer[..n]).map_err(write_error)?;
    }
    output.sync_all().map_err(write_error)?;
    Ok((copied, format!("sha256:{}", hex::encode(hasher.finalize()))))
}

/// Exports the files under `artifacts` for `run` into the store at `root`; their refs,
/// sorted by name.
pub fn export(root: &Path, run: &RunKey, artifacts: &Path) -> Result<Vec<ArtifactRef>, StoreError> {
    let files = collect(artifacts)?;
    if files.is_empty() {
        return Ok(Vec::new());
    }
    let parent = root.join(&run.namespace);
    fs::create_dir_all(&parent).map_err(write_error)?;
    let target = parent.join(format!("{}-{}", run.name, run.uid));
    let staging = parent.join(format!(".{}-{}.partial", run.name, run.uid));
    let _ = fs::remove_dir_all(&staging);
    let copied = (|| {
        let mut refs = Vec::with_capacity(files.len());
        for (relative, path) in &files {
            let (size, digest) = copy_hashed(path, &staging.join(relative), relative)?;
            refs.push(ArtifactRef {
                name: relative.clone(),
                uri: format!("file://{}", target.join(relative).display()),
                size_bytes: i64::try_from(size).ok(),
                digest: Some(digest),
            });
        }
        // A retry after an export whose status write was lost replaces the earlier copy.
        let _ = fs::remove_dir_all(&target);
        fs::rename(&staging, &target)
            .map_err(|e| StoreError::Transport(format!("cannot publish the artifacts: {e}")))?;
        Ok(refs)
    })();
    if copied.is_err() {
        // Roll back the partial upload.
        let _ = fs::remove_dir_all(&staging);
    }
    copied
}

/// Reads artifact inputs from the store at `root`: (workspace path, content) pairs.
pub fn read_inputs(
    root: &Path,
    inputs: &[ArtifactInput],
) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
    let root = root.canonicalize().map_err(|e| {
        StoreError::Transport(format!(
            "the ArtifactStore {} cannot be read: {e}",
            root.display()
        ))
    })?;
    let mut total: u64 = 0;
    let mut read = Vec::with_capacity(inputs.len());
    for input in inputs {
        let path = input.uri.strip_prefix("file://").ok_or_else(|| {
            StoreError::Invalid(format!(
                "artifact input {:?} is not a file:// URI of the ArtifactStore",
                bounded(&input.uri)
            ))
        })?;
        let resolved = Path::new(path).canonicalize().map_err(|e| {
            StoreError::Invalid(format!(
                "artifact input {:?} cannot be read: {e}",
                bounded(&input.uri)
            ))
        })?;
        if !resolved.starts_with(&root) || !resolved.is_file() {
            return Err(StoreError::Invalid(format!(
                "artifact input {:?} is not a file of the Runtime's ArtifactStore",
                bounded(&input.uri)
            )));
        }
        let size = resolved
            .metadata()
            .map_err(|e| StoreError::Transport(e.to_string()))?
            .len();
        total += size;
        if total > MAX_INPUT_BYTES {
            return Err(StoreError::Invalid(format!(
                "artifact inputs exceed {MAX_INPUT_BYTES} bytes together"
            )));
        }
        let content = fs::read(&resolved).map_err(|e| {
            StoreError::Transport(format!("artifact input {:?}: {e}", bounded(&input.uri)))
        })?;
        read.push((input.path.clone(), content));
    }
    Ok(read)
}

#[cfg(test)]
mod tests {
    use super::super::MAX_ARTIFACTS;
    use super::*;

    fn run(name: &str, uid: &str) -> RunKey {
        RunKey {
            namespace: "ns".into(),
            name: name.into(),
            uid: uid.into(),
        }
    }

    #[test]
    fn exports_files_with_digests_and_rolls_back_failures() -> Result<(), Box<dyn std::error::Error>>
    {
        let tmp = tempfile::tempdir()?;
        let artifacts = tmp.path().join("artifacts");
        fs::create_dir_all(artifacts.join("sub"))?;
        fs::write(artifacts.join("a.txt"), b"hello")?;
        fs::write(artifacts.join("sub/b.bin"), [0u8, 1, 2])?;
        let store = tmp.path().join("store");
        let refs = export(&store, &run("run", "uid"), &artifacts).map_err(|e| format!("{e:?}"))?;
        let names: Vec<&str> = refs.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["a.txt", "sub/b.bin"]);
        assert_eq!(refs[0].size_bytes, Some(5));
        assert_eq!(
            refs[0].digest.as_deref(),
            Some("sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824")
        );
        assert_eq!(fs::read(store.join("ns/run-uid/a.txt"))?, b"hello");
        // Importing what was exported.
        let inputs = [ArtifactInput {
            uri: refs[0].uri.clone(),
            path: "in/a.txt".into(),
        }];
        assert_eq!(
            read_inputs(&store, &inputs)?,
            vec![("in/a.txt".to_string(), b"hello".to_vec())]
        );
        let outside = [ArtifactInput {
            uri: format!("file://{}", artifacts.join("a.txt").display()),
            path: "x".into(),
        }];
        assert!(matches!(
            read_inputs(&store, &outside),
            Err(StoreError::Invalid(_))
        ));
        let s3 = [ArtifactInput {
            uri: "s3://bucket/ns/run-uid/a.txt".into(),
            path: "x".into(),
        }];
        assert!(matches!(
            read_inputs(&store, &s3),
            Err(StoreError::Invalid(_))
        ));

        // A symlink is invalid; nothing is left in the store for that Run.
        std::os::unix::fs::symlink("/etc/passwd", artifacts.join("link"))?;
        assert!(matches!(
            export(&store, &run("run2", "uid2"), &artifacts),
            Err(StoreError::Invalid(_))
        ));
        fs::remove_file(artifacts.join("link"))?;
        // A removed artifacts directory exports nothing; one replaced by a symlink is invalid.
        assert_eq!(
            export(&store, &run("gone", "u"), &tmp.path().join("missing")),
            Ok(Vec::new())
        );
        let linked = tmp.path().join("linked");
        std::os::unix::fs::symlink(&artifacts, &linked)?;
        assert!(matches!(
            export(&store, &run("linked", "u"), &linked),
            Err(StoreError::Invalid(_))
        ));
        // A store that cannot be written is a transport failure, and nothing half-written
        // stays behind.
        let blocked = tmp.path().join("blocked");
        fs::write(&blocked, b"a file where the store's directory should be")?;
        assert!(matches!(
            export(&blocked, &run("run3", "uid3"), &artifacts),
            Err(StoreError::Transport(_))
        ));
        for n in 0..=MAX_ARTIFACTS {
            fs::write(artifacts.join(format!("f{n}")), b"x")?;
        }
        assert!(matches!(
            export(&store, &run("run4", "uid4"), &artifacts),
            Err(StoreError::Invalid(_))
        ));
        assert!(
            !store.join("ns/run4-uid4").exists() && !store.join("ns/.run4-uid4.partial").exists()
        );
        Ok(())
    }

    fn chunks(parts: Vec<Result<Bytes, std::io::Error>>) -> ByteStream {
        futures::stream::iter(parts).boxed()
    }

    async fn read_all(mut stream: BlobStream) -> Result<Vec<u8>, StoreError> {
        let mut all = Vec::new();
        while let Some(chunk) = stream.next().await {
            all.extend_from_slice(&chunk?);
        }
        Ok(all)
    }

    #[tokio::test]
    async fn blobs_are_staged_renamed_capped_and_confined() -> Result<(), Box<dyn std::error::Error>>
    {
        let tmp = tempfile::tempdir()?;
        let store = FilesystemStore::new(tmp.path().join("store"));
        let blob = store
            .put_blob(
                "ns/snapshots/s1/blob",
                chunks(vec![
                    Ok(Bytes::from_static(b"hel")),
                    Ok(Bytes::from_static(b"lo")),
                ]),
            )
            .await?;
        assert_eq!(blob.size, 5);
        assert_eq!(
            blob.digest,
            "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        );
        assert_eq!(
            read_all(store.get_blob(&blob.uri, 5).await?).await?,
            b"hello"
        );
        assert!(matches!(
            store.get_blob(&blob.uri, 4).await.err(),
            Some(StoreError::Invalid(_))
        ));

        // A stream that fails part-way leaves the earlier blob and no staging file.
        let failed = store
            .put_blob(
                "ns/snapshots/s1/blob",
                chunks(vec![
                    Ok(Bytes::from_static(b"partial")),
                    Err(std::io::Error::other("the tar writer failed")),
                ]),
            )
            .await;
        assert!(
            matches!(failed, Err(StoreError::Transport(_))),
            "{failed:?}"
        );
        let names: Vec<String> = fs::read_dir(tmp.path().join("store/ns/snapshots/s1"))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["blob"]);
        assert_eq!(
            read_all(store.get_blob(&blob.uri, 5).await?).await?,
            b"hello"
        );

        // Outside the root, another scheme, hostile keys: refused, nothing touched.
        for uri in [
            format!("file://{}", tmp.path().display()),
            format!("file://{}/store/../x", tmp.path().display()),
            "s3://bucket/ns/x".to_string(),
            "file:///etc/passwd".to_string(),
        ] {
            assert!(
                matches!(
                    store.get_blob(&uri, 1 << 20).await.err(),
                    Some(StoreError::Invalid(_))
                ),
                "{uri}"
            );
            assert!(
                matches!(store.delete(&uri).await, Err(StoreError::Invalid(_))),
                "{uri}"
            );
        }
        assert!(matches!(
            store.put_blob("../x", chunks(vec![])).await,
            Err(StoreError::Invalid(_))
        ));

        // Delete an object, then a prefix; deleting again succeeds.
        store.delete(&blob.uri).await?;
        assert!(!tmp.path().join("store/ns/snapshots/s1/blob").exists());
        let prefix = format!("file://{}/store/ns/snapshots/", tmp.path().display());
        store.delete(&prefix).await?;
        assert!(!tmp.path().join("store/ns/snapshots").exists());
        store.delete(&prefix).await?;
        Ok(())
    }
}
