//! Parked files: the workspace and artifacts a suspended session left on this server, for a
//! resume here that moves them back instead of extracting its snapshot (CloseSession
//! `park_digest`, RestoreSession `parked` in `runtime.proto`).
//!
//! - Files are parked only when they are exactly what the session's last capture archived:
//!   the capture's digest is the one the close names, it left nothing out (`skipped` 0:
//!   no socket, FIFO, device, name that is not UTF-8, upload temporary or refused
//!   symlink), and no operation or upload came after it ([`Captured`]). As they are parked
//!   they are made what a restore of that snapshot makes them: every entry belongs to the
//!   sandbox's user, and permission bits above 0777 are cleared (no process of the session
//!   is left, and no sandbox sees the parked directory). A resume from them then gives the
//!   files a restore would give (sub-second mtimes and hard links between them are kept
//!   too, which an archive does not carry).
//! - They live in `<root>/sessions/.parked/<run-uid>.<n>/` (a Run UID is a validated UUID,
//!   no session directory starts with a dot, and `n` is unique to each park, so a removal
//!   never meets a later park of the same Run), on the sessions' filesystem, so parking
//!   and adopting are renames. The whole directory goes with the sessions at the server's
//!   start: parked files never outlive the server that parked them, whose table is their
//!   only record.
//! - At most [`MAX_PARKED`] Runs' files and [`MAX_PARKED_BYTES`] of file data are kept (the
//!   oldest go first), one set per Run: a newer park replaces the Run's older one, an
//!   adoption consumes it, and a close of the Run with purge and no park removes it
//!   (runtimed sends one when a Run ends, is deleted or moves elsewhere).
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::lock;

/// The most Runs whose files a server keeps parked.
pub const MAX_PARKED: usize = 32;
/// The most bytes of regular files a server keeps parked (a larger workspace is never
/// parked: it resumes from its snapshot).
pub const MAX_PARKED_BYTES: u64 = 4 << 30;
/// The directory of parked files, in the sessions' directory.
pub const PARKED_DIR: &str = ".parked";

/// What a session's last capture archived, recorded when its summary was sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Captured {
    /// `sha256:<hex>` of the compressed stream, as the summary says.
    pub digest: String,
    /// Nothing was left out of the archive.
    pub complete: bool,
    /// The session's operations and uploads when it was taken.
    pub operations: u64,
    pub uploads: u64,
    /// Entries and bytes of regular files, as a restore reports them.
    pub files: u64,
    pub size_bytes: u64,
}

/// One Run's parked files.
#[derive(Debug, Clone)]
pub(super) struct Parked {
    pub digest: String,
    /// The sandbox user the files belong to (a session of another user does not take them).
    pub owner: Option<(u32, u32)>,
    pub files: u64,
    pub size_bytes: u64,
    /// When it was parked, in park order (the smallest goes first); it names its directory.
    order: u64,
}

/// Makes every entry beneath `dir` (not `dir` itself) what a restore makes it: owned by
/// `owner` (when the session had a sandbox user), and without permission bits above 0777.
/// Symlinks are never followed; each directory is read once.
fn normalize(dir: &Path, owner: Option<(u32, u32)>) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next)? {
            let path = entry?.path();
            let meta = std::fs::symlink_metadata(&path)?;
            if let Some((uid, gid)) = owner {
                std::os::unix::fs::lchown(&path, Some(uid), Some(gid))?;
            }
            if meta.is_symlink() {
                continue;
            }
            let mode = meta.permissions().mode();
            if mode & 0o7000 != 0 {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode & 0o777))?;
            }
            if meta.is_dir() {
                pending.push(path);
            }
        }
    }
    Ok(())
}

/// The parked files of this server.
pub(super) struct ParkedFiles {
    dir: PathBuf,
    table: Mutex<(u64, HashMap<String, Parked>)>,
}

impl ParkedFiles {
    /// Parked files under `sessions_dir` (which the server empties at its start).
    pub fn new(sessions_dir: &Path) -> Self {
        Self {
            dir: sessions_dir.join(PARKED_DIR),
            table: Mutex::new((0, HashMap::new())),
        }
    }

    fn path(&self, run_uid: &str, order: u64) -> PathBuf {
        self.dir.join(format!("{run_uid}.{order}"))
    }

    /// Parks the `workspace` and `artifacts` of the session directory `session_dir` as
    /// the Run's files (blocking: renames and, for what they replace, a removal). On an
    /// error nothing is parked and the caller removes the session directory as usual.
    pub fn park(
        &self,
        run_uid: &str,
        session_dir: &Path,
        captured: &Captured,
        owner: Option<(u32, u32)>,
    ) -> std::io::Result<()> {
        self.forget(run_uid);
        if captured.size_bytes > MAX_PARKED_BYTES {
            return Err(std::io::Error::other(format!(
                "{} bytes of files are more than the {MAX_PARKED_BYTES} a server keeps parked",
                captured.size_bytes
            )));
        }
        let order = {
            let mut table = lock(&self.table);
            table.0 += 1;
            table.0
        };
        let target = self.path(run_uid, order);
        std::fs::create_dir_all(&target)?;
        let moved = super::snapshot::ROOTS
            .iter()
            .try_for_each(|root| std::fs::rename(session_dir.join(root), target.join(root)));
        if let Err(e) = moved.and_then(|()| normalize(&target, owner)) {
            let _ = super::remove_path(&target);
            return Err(e);
        }
        let gone = {
            let mut table = lock(&self.table);
            let entries = &mut table.1;
            let replaced = entries.insert(
                run_uid.to_owned(),
                Parked {
                    digest: captured.digest.clone(),
                    owner,
                    files: captured.files,
                    size_bytes: captured.size_bytes,
                    order,
                },
            );
            let mut gone: Vec<(String, u64)> = replaced
                .map(|p| (run_uid.to_owned(), p.order))
                .into_iter()
                .collect();
            let bytes = |entries: &HashMap<String, Parked>| {
                entries.values().map(|p| p.size_bytes).sum::<u64>()
            };
            while entries.len() > MAX_PARKED || bytes(entries) > MAX_PARKED_BYTES {
                let Some(oldest) = entries
                    .iter()
                    .min_by_key(|(_, p)| p.order)
                    .map(|(uid, _)| uid.clone())
                else {
                    break;
                };
                if let Some(evicted) = entries.remove(&oldest) {
                    gone.push((oldest, evicted.order));
                }
            }
            gone
        };
        for (uid, order) in gone {
            if let Err(e) = super::remove_path(&self.path(&uid, order)) {
                tracing::warn!(run_uid = %uid, error = %e, "parked files not removed");
            }
        }
        Ok(())
    }

    /// Takes the Run's parked files when they were parked with `digest` for `owner`: their
    /// directory (the caller moves what it holds, then removes it) and record. Files of
    /// another digest or owner stay.
    pub fn take(
        &self,
        run_uid: &str,
        digest: &str,
        owner: Option<(u32, u32)>,
    ) -> Option<(PathBuf, Parked)> {
        let mut table = lock(&self.table);
        let found = table
            .1
            .get(run_uid)
            .is_some_and(|p| p.digest == digest && p.owner == owner);
        if !found {
            return None;
        }
        let parked = table.1.remove(run_uid)?;
        Some((self.path(run_uid, parked.order), parked))
    }

    /// Removes the Run's parked files, if any (blocking). Only the files of the park the
    /// table records are removed, never a directory a later park makes.
    pub fn forget(&self, run_uid: &str) {
        let gone = lock(&self.table).1.remove(run_uid);
        if let Some(gone) = gone
            && let Err(e) = super::remove_path(&self.path(run_uid, gone.order))
        {
            tracing::warn!(run_uid, error = %e, "parked files not removed");
        }
    }

    /// How many Runs have parked files.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        lock(&self.table).1.len()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn captured(digest: &str) -> Captured {
        Captured {
            digest: digest.to_string(),
            complete: true,
            operations: 0,
            uploads: 0,
            files: 3,
            size_bytes: 5,
        }
    }

    fn session_dir(root: &Path, name: &str, content: &str) -> PathBuf {
        let dir = root.join(name);
        std::fs::create_dir_all(dir.join("workspace")).unwrap();
        std::fs::create_dir_all(dir.join("artifacts")).unwrap();
        std::fs::write(dir.join("workspace").join("f"), content).unwrap();
        dir
    }

    #[test]
    fn parked_files_are_taken_once_with_their_digest_and_owner_only() {
        let root = tempfile::tempdir().unwrap();
        let parked = ParkedFiles::new(root.path());
        let dir = session_dir(root.path(), "s1", "hello");
        let uid = "2c24c1f0-9f8f-4f80-82d5-3dd16a12d1e6";
        parked
            .park(uid, &dir, &captured("sha256:aa"), Some((1, 1)))
            .unwrap();
        assert!(!dir.join("workspace").exists(), "moved, not copied");
        assert!(parked.take(uid, "sha256:bb", Some((1, 1))).is_none());
        assert!(parked.take(uid, "sha256:aa", Some((2, 2))).is_none());
        let (path, record) = parked.take(uid, "sha256:aa", Some((1, 1))).unwrap();
        assert_eq!(
            std::fs::read_to_string(path.join("workspace").join("f")).unwrap(),
            "hello"
        );
        assert_eq!((record.files, record.size_bytes), (3, 5));
        assert!(
            parked.take(uid, "sha256:aa", Some((1, 1))).is_none(),
            "taken once"
        );
    }

    #[test]
    fn the_oldest_go_first_and_a_forgotten_run_leaves_nothing() {
        let root = tempfile::tempdir().unwrap();
        let parked = ParkedFiles::new(root.path());
        let uid = |i: usize| format!("00000000-0000-0000-0000-{i:012}");
        let names = |prefix: &str| -> usize {
            std::fs::read_dir(root.path().join(PARKED_DIR))
                .unwrap()
                .filter(|e| {
                    e.as_ref()
                        .unwrap()
                        .file_name()
                        .to_string_lossy()
                        .starts_with(prefix)
                })
                .count()
        };
        for i in 0..=MAX_PARKED {
            let dir = session_dir(root.path(), &format!("s{i}"), "x");
            parked
                .park(&uid(i), &dir, &captured("sha256:aa"), None)
                .unwrap();
        }
        assert_eq!(parked.len(), MAX_PARKED);
        assert_eq!(names(""), MAX_PARKED);
        assert_eq!(names(&uid(0)), 0, "evicted");
        assert!(parked.take(&uid(0), "sha256:aa", None).is_none());
        parked.forget(&uid(1));
        assert_eq!(names(&uid(1)), 0);
        assert_eq!(parked.len(), MAX_PARKED - 1);
        // A newer park of a Run replaces its older one.
        let dir = session_dir(root.path(), "again", "newer");
        parked
            .park(&uid(2), &dir, &captured("sha256:cc"), None)
            .unwrap();
        assert_eq!(names(&uid(2)), 1, "the older park of the Run is gone");
        assert!(parked.take(&uid(2), "sha256:aa", None).is_none());
        let (path, _) = parked.take(&uid(2), "sha256:cc", None).unwrap();
        assert_eq!(
            std::fs::read_to_string(path.join("workspace").join("f")).unwrap(),
            "newer"
        );
        // Too large to park: refused, nothing kept.
        let dir = session_dir(root.path(), "huge", "x");
        let mut huge = captured("sha256:dd");
        huge.size_bytes = MAX_PARKED_BYTES + 1;
        assert!(parked.park(&uid(3), &dir, &huge, None).is_err());
        assert!(parked.take(&uid(3), "sha256:dd", None).is_none());
    }
}
