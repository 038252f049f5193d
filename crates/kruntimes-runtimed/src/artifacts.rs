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

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use kruntimes_api::run::{ArtifactInput, ArtifactRef};
use sha2::{Digest, Sha256};

/// Artifacts of one Run at most (ARCHITECTURE.md, "Limits").
pub const MAX_ARTIFACTS: usize = 32;
/// The largest artifact.
pub const MAX_ARTIFACT_BYTES: u64 = 256 * 1024 * 1024;
/// The longest artifact name (its path under the artifacts directory).
pub const MAX_NAME_BYTES: usize = 253;
/// Artifact inputs of one Run together at most (they travel in one registration).
pub const MAX_INPUT_BYTES: u64 = 1024 * 1024;

/// Why an export did not complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExportError {
    /// The store could not be written: retry later.
    Transport(String),
    /// An artifact can never be exported: the Run fails.
    Invalid(String),
}

/// The regular files under `dir`, as (name relative to `dir`, path), sorted by name. A
/// missing directory has none (a command removed it); a directory replaced by a symlink or
/// a file is invalid (runtimed never follows it out of the session).
fn collect(dir: &Path) -> Result<Vec<(String, PathBuf)>, ExportError> {
    match fs::symlink_metadata(dir) {
        Ok(meta) if meta.file_type().is_dir() => {}
        Ok(_) => {
            return Err(ExportError::Invalid(
                "$KRUNTIME_ARTIFACTS_DIR was replaced by something that is not a directory"
                    .to_string(),
            ));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(ExportError::Transport(format!(
                "cannot read the artifacts directory: {e}"
            )));
        }
    }
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(current) = pending.pop() {
        let entries = fs::read_dir(&current).map_err(|e| {
            ExportError::Transport(format!("cannot list the artifacts directory: {e}"))
        })?;
        for entry in entries {
            let entry = entry.map_err(|e| {
                ExportError::Transport(format!("cannot list the artifacts directory: {e}"))
            })?;
            let path = entry.path();
            let relative = path
                .strip_prefix(dir)
                .ok()
                .and_then(Path::to_str)
                .ok_or_else(|| {
                    ExportError::Invalid("an artifact's name is not valid UTF-8".to_string())
                })?
                .to_string();
            let kind = entry
                .file_type()
                .map_err(|e| ExportError::Transport(format!("cannot stat {relative}: {e}")))?;
            if kind.is_dir() {
                pending.push(path);
            } else if kind.is_file() {
                if relative.len() > MAX_NAME_BYTES {
                    return Err(ExportError::Invalid(format!(
                        "artifact name {:?}… is longer than {MAX_NAME_BYTES} bytes",
                        relative.chars().take(64).collect::<String>()
                    )));
                }
                found.push((relative, path));
                if found.len() > MAX_ARTIFACTS {
                    return Err(ExportError::Invalid(format!(
                        "more than {MAX_ARTIFACTS} artifacts"
                    )));
                }
            } else {
                return Err(ExportError::Invalid(format!(
                    "artifact {relative:?} is not a regular file (symlinks and devices are not exported)"
                )));
            }
        }
    }
    found.sort();
    Ok(found)
}

/// Copies `from` to `to`, hashing it; the size and `sha256:<hex>` digest.
fn copy_hashed(from: &Path, to: &Path, name: &str) -> Result<(u64, String), ExportError> {
    let mut input = fs::File::open(from)
        .map_err(|e| ExportError::Transport(format!("cannot open artifact {name}: {e}")))?;
    let size = input
        .metadata()
        .map_err(|e| ExportError::Transport(format!("cannot stat artifact {name}: {e}")))?
        .len();
    if size > MAX_ARTIFACT_BYTES {
        return Err(ExportError::Invalid(format!(
            "artifact {name} is {size} bytes; the limit is {MAX_ARTIFACT_BYTES}"
        )));
    }
    if let Some(parent) = to.parent() {
        fs::create_dir_all(parent)
            .map_err(|e| ExportError::Transport(format!("cannot write to the store: {e}")))?;
    }
    let mut output = fs::File::create(to)
        .map_err(|e| ExportError::Transport(format!("cannot write to the store: {e}")))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 64 * 1024];
    let mut copied: u64 = 0;
    loop {
        let n = input
            .read(&mut buffer)
            .map_err(|e| ExportError::Transport(format!("cannot read artifact {name}: {e}")))?;
        if n == 0 {
            break;
        }
        copied += n as u64;
        if copied > MAX_ARTIFACT_BYTES {
            return Err(ExportError::Invalid(format!(
                "artifact {name} grew past {MAX_ARTIFACT_BYTES} bytes"
            )));
        }
        hasher.update(&buffer[..n]);
        output
            .write_all(&buffer[..n])
            .map_err(|e| ExportError::Transport(format!("cannot write to the store: {e}")))?;
    }
    output
        .sync_all()
        .map_err(|e| ExportError::Transport(format!("cannot write to the store: {e}")))?;
    Ok((copied, format!("sha256:{}", hex::encode(hasher.finalize()))))
}

/// Exports the files under `artifacts` for Run `namespace/name` (UID `uid`) into the store
/// at `root`; their refs, sorted by name.
pub fn export(
    root: &Path,
    namespace: &str,
    name: &str,
    uid: &str,
    artifacts: &Path,
) -> Result<Vec<ArtifactRef>, ExportError> {
    let files = collect(artifacts)?;
    if files.is_empty() {
        return Ok(Vec::new());
    }
    let parent = root.join(namespace);
    fs::create_dir_all(&parent)
        .map_err(|e| ExportError::Transport(format!("cannot write to the store: {e}")))?;
    let target = parent.join(format!("{name}-{uid}"));
    let staging = parent.join(format!(".{name}-{uid}.partial"));
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
            .map_err(|e| ExportError::Transport(format!("cannot publish the artifacts: {e}")))?;
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
) -> Result<Vec<(String, Vec<u8>)>, String> {
    let root = root
        .canonicalize()
        .map_err(|e| format!("the ArtifactStore {} cannot be read: {e}", root.display()))?;
    let mut total: u64 = 0;
    let mut read = Vec::with_capacity(inputs.len());
    for input in inputs {
        let path = input.uri.strip_prefix("file://").ok_or_else(|| {
            format!(
                "artifact input {:?} is not a file:// URI of the ArtifactStore",
                input.uri
            )
        })?;
        let resolved = Path::new(path)
            .canonicalize()
            .map_err(|e| format!("artifact input {:?} cannot be read: {e}", input.uri))?;
        if !resolved.starts_with(&root) || !resolved.is_file() {
            return Err(format!(
                "artifact input {:?} is not a file of the Runtime's ArtifactStore",
                input.uri
            ));
        }
        let size = resolved.metadata().map_err(|e| e.to_string())?.len();
        total += size;
        if total > MAX_INPUT_BYTES {
            return Err(format!(
                "artifact inputs exceed {MAX_INPUT_BYTES} bytes together"
            ));
        }
        let content =
            fs::read(&resolved).map_err(|e| format!("artifact input {:?}: {e}", input.uri))?;
        read.push((input.path.clone(), content));
    }
    Ok(read)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_files_with_digests_and_rolls_back_failures() -> Result<(), Box<dyn std::error::Error>>
    {
        let tmp = tempfile::tempdir()?;
        let artifacts = tmp.path().join("artifacts");
        fs::create_dir_all(artifacts.join("sub"))?;
        fs::write(artifacts.join("a.txt"), b"hello")?;
        fs::write(artifacts.join("sub/b.bin"), [0u8, 1, 2])?;
        let store = tmp.path().join("store");
        let refs = export(&store, "ns", "run", "uid", &artifacts).map_err(|e| format!("{e:?}"))?;
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
        assert!(read_inputs(&store, &outside).is_err());

        // A symlink is invalid; nothing is left in the store for that Run.
        std::os::unix::fs::symlink("/etc/passwd", artifacts.join("link"))?;
        assert!(matches!(
            export(&store, "ns", "run2", "uid2", &artifacts),
            Err(ExportError::Invalid(_))
        ));
        fs::remove_file(artifacts.join("link"))?;
        // A removed artifacts directory exports nothing; one replaced by a symlink is invalid.
        assert_eq!(
            export(&store, "ns", "gone", "u", &tmp.path().join("missing")),
            Ok(Vec::new())
        );
        let linked = tmp.path().join("linked");
        std::os::unix::fs::symlink(&artifacts, &linked)?;
        assert!(matches!(
            export(&store, "ns", "linked", "u", &linked),
            Err(ExportError::Invalid(_))
        ));
        // A store that cannot be written is a transport failure, and nothing half-written
        // stays behind.
        let blocked = tmp.path().join("blocked");
        fs::write(&blocked, b"a file where the store's directory should be")?;
        assert!(matches!(
            export(&blocked, "ns", "run3", "uid3", &artifacts),
            Err(ExportError::Transport(_))
        ));
        for n in 0..=MAX_ARTIFACTS {
            fs::write(artifacts.join(format!("f{n}")), b"x")?;
        }
        assert!(matches!(
            export(&store, "ns", "run4", "uid4", &artifacts),
            Err(ExportError::Invalid(_))
        ));
        assert!(
            !store.join("ns/run4-uid4").exists() && !store.join("ns/.run4-uid4.partial").exists()
        );
        Ok(())
    }
}
