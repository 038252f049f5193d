//! A session's file calls, every one resolved beneath its workspace by the kernel.
//!
//! Owns reading, listing, writing, creating directories, deleting and renaming through a
//! cap-std [`Dir`] opened on the workspace: cap-std resolves each path with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` (or, on kernels without it, an
//! equivalent component-by-component walk), so an absolute symlink, a symlink whose `..`
//! climbs out, or a chain of them fails however it is spelled. Paths reach this module
//! already checked by [`super::paths`]; it never checks a path and then opens it. A final
//! symlink is not followed by delete (the link goes) or rename (the link moves); read,
//! list and write follow it only while it stays beneath the workspace. It knows nothing
//! of sessions, gRPC or processes, and it never reads more than [`MAX_FILE_BYTES`] + 1 of a
//! file or holds more than one page (+1) of names of a directory.
#![forbid(unsafe_code)]

use std::collections::BinaryHeap;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use cap_std::fs::{Dir, OpenOptions, OpenOptionsExt, Permissions, PermissionsExt};
use nix::libc;

use super::paths;
use crate::ids;

/// The largest file a read returns or a write stores.
pub const MAX_FILE_BYTES: usize = 1024 * 1024;
/// Recursive deletes descend at most this deep (each level holds one directory open).
pub const MAX_DELETE_DEPTH: usize = 1024;
/// Recursive deletes read at most this many names of a directory at a time.
const DELETE_BATCH: usize = 1024;

/// Why a file call failed, in the stable words of `OperationCompleted.reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsReason {
    /// A symlink on the way leads out of the workspace.
    PathEscapes,
    NotFound,
    AlreadyExists,
    NotADirectory,
    IsADirectory,
    DirectoryNotEmpty,
    FileTooLarge,
    /// A symlink loop, a final symlink where none may be, a name the filesystem refuses,
    /// a rename into itself, or a read of something that is neither a regular file nor a
    /// directory.
    InvalidPath,
    /// Stopped on request (timeout, close, client gone) before it finished.
    Stopped,
    IoError,
}

impl FsReason {
    /// The reason as `OperationCompleted.reason` spells it (`Stopped` is never reported:
    /// the cause that stopped it is).
    pub fn as_str(self) -> &'static str {
        match self {
            FsReason::PathEscapes => "PathEscapes",
            FsReason::NotFound => "NotFound",
            FsReason::AlreadyExists => "AlreadyExists",
            FsReason::NotADirectory => "NotADirectory",
            FsReason::IsADirectory => "IsADirectory",
            FsReason::DirectoryNotEmpty => "DirectoryNotEmpty",
            FsReason::FileTooLarge => "FileTooLarge",
            FsReason::InvalidPath => "InvalidPath",
            FsReason::Stopped => "Cancelled",
            FsReason::IoError => "IoError",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            FsReason::PathEscapes => "resolves outside the workspace",
            FsReason::NotFound => "does not exist",
            FsReason::AlreadyExists => "already exists",
            FsReason::NotADirectory => "is not a directory (or a component of it is not)",
            FsReason::IsADirectory => "is a directory",
            FsReason::DirectoryNotEmpty => "is a directory that is not empty",
            FsReason::FileTooLarge => "is larger than the 1 MiB limit",
            FsReason::InvalidPath => "cannot be used (a symlink loop or an invalid target)",
            FsReason::Stopped => "was stopped before it finished",
            FsReason::IoError => "failed",
        }
    }
}

/// A failed file call: what it concerned and why.
#[derive(Debug, thiserror::Error)]
#[error("{path:?} {}{}", reason.describe(), detail.as_deref().map(|d| format!(": {d}")).unwrap_or_default())]
pub struct FsError {
    pub reason: FsReason,
    /// The request's path, bounded.
    pub path: String,
    /// The system's words, only for `IoError` (bounded: an errno description).
    pub detail: Option<String>,
}

impl FsError {
    fn new(reason: FsReason, path: &str) -> Self {
        Self {
            reason,
            path: ids::bounded(path),
            detail: None,
        }
    }

    fn io(path: &str, e: &std::io::Error) -> Self {
        let reason = classify(e);
        Self {
            reason,
            path: ids::bounded(path),
            detail: (reason == FsReason::IoError).then(|| ids::bounded(&e.to_string())),
        }
    }
}

fn at(path: &str) -> impl Fn(std::io::Error) -> FsError + '_ {
    move |e| FsError::io(path, &e)
}

/// Maps a system error to its reason. cap-std reports an escape as `PermissionDenied`
/// without an errno (its `EXDEV` from `openat2` included); a real `EACCES` has one.
pub fn classify(e: &std::io::Error) -> FsReason {
    match e.raw_os_error() {
        Some(libc::EXDEV) => FsReason::PathEscapes,
        Some(libc::ENOENT) => FsReason::NotFound,
        Some(libc::EEXIST) => FsReason::AlreadyExists,
        Some(libc::ENOTDIR) => FsReason::NotADirectory,
        Some(libc::EISDIR) => FsReason::IsADirectory,
        Some(libc::ENOTEMPTY) => FsReason::DirectoryNotEmpty,
        Some(libc::EFBIG) => FsReason::FileTooLarge,
        Some(libc::ELOOP | libc::ENAMETOOLONG | libc::EINVAL) => FsReason::InvalidPath,
        Some(_) => FsReason::IoError,
        None => match e.kind() {
            std::io::ErrorKind::PermissionDenied => FsReason::PathEscapes,
            std::io::ErrorKind::NotFound => FsReason::NotFound,
            _ => FsReason::IoError,
        },
    }
}

/// Opens the workspace directory (a server-made path) as the root of every resolution.
pub fn open_workspace(workspace: &Path) -> std::io::Result<Dir> {
    Dir::open_ambient_dir(workspace, cap_std::ambient_authority())
}

/// Opens a directory of the workspace ("" is the workspace itself).
pub fn open_dir(ws: &Dir, dir: &str) -> Result<Dir, FsError> {
    ws.open_dir(if dir.is_empty() { "." } else { dir })
        .map_err(at(dir))
}

/// What a read found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileContent {
    pub content: Vec<u8>,
    pub executable: bool,
    pub directory: bool,
}

/// Reads one regular file, at most [`MAX_FILE_BYTES`] (`FileTooLarge` beyond); a directory
/// reads as `directory` with no content; anything else is `InvalidPath`. Opened without
/// blocking, so a FIFO cannot stall the call.
pub fn read(ws: &Dir, path: &str) -> Result<FileContent, FsError> {
    let mut options = OpenOptions::new();
    options
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
    let file = ws.open_with(path, &options).map_err(at(path))?;
    let meta = file.metadata().map_err(at(path))?;
    if meta.is_dir() {
        return Ok(FileContent {
            content: Vec::new(),
            executable: false,
            directory: true,
        });
    }
    if !meta.is_file() {
        return Err(FsError::new(FsReason::InvalidPath, path));
    }
    if meta.len() > MAX_FILE_BYTES as u64 {
        return Err(FsError::new(FsReason::FileTooLarge, path));
    }
    // The size may change meanwhile: read one byte more than allowed to notice.
    let mut content = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_FILE_BYTES as u64 + 1)
        .read_to_end(&mut content)
        .map_err(at(path))?;
    if content.len() > MAX_FILE_BYTES {
        return Err(FsError::new(FsReason::FileTooLarge, path));
    }
    Ok(FileContent {
        content,
        executable: meta.permissions().mode() & 0o111 != 0,
        directory: false,
    })
}

/// One entry of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its name (one component).
    pub name: String,
    /// Relative to the workspace.
    pub path: String,
    pub directory: bool,
    pub symlink: bool,
    /// Regular files: their size; otherwise 0.
    pub size_bytes: u64,
}

/// One page of a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listing {
    pub entries: Vec<Entry>,
    /// Whether a name after the last entry was seen.
    pub more: bool,
}

/// The first `limit` direct children of `dir` whose names sort strictly after `after`, in
/// byte order of their UTF-8 names. Holds at most `limit + 1` names however large the
/// directory is. Names that are not UTF-8 cannot be named by any path of the API and are
/// skipped. A symlink is described as itself (`symlink`, never `directory`, size 0). An
/// entry removed while the page is built is left out.
pub fn list(ws: &Dir, dir: &str, after: Option<&str>, limit: usize) -> Result<Listing, FsError> {
    let directory = open_dir(ws, dir)?;
    // A max-heap of the smallest names seen: the largest is dropped whenever it overflows.
    let mut smallest: BinaryHeap<String> = BinaryHeap::with_capacity(limit + 2);
    for entry in directory.entries().map_err(at(dir))? {
        let entry = entry.map_err(at(dir))?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if after.is_some_and(|after| name.as_str() <= after) {
            continue;
        }
        if smallest.len() > limit && smallest.peek().is_some_and(|top| *top <= name) {
            continue;
        }
        smallest.push(name);
        if smallest.len() > limit + 1 {
            smallest.pop();
        }
    }
    let mut names = smallest.into_sorted_vec();
    let more = names.len() > limit;
    names.truncate(limit);
    let mut entries = Vec::with_capacity(names.len());
    for name in names {
        let meta = match directory.symlink_metadata(&name) {
            Ok(meta) => meta,
            Err(e) if classify(&e) == FsReason::NotFound => continue,
            Err(e) => return Err(FsError::io(dir, &e)),
        };
        let file_type = meta.file_type();
        entries.push(Entry {
            path: paths::join(dir, &name),
            name,
            directory: file_type.is_dir(),
            symlink: file_type.is_symlink(),
            size_bytes: if file_type.is_file() { meta.len() } else { 0 },
        });
    }
    Ok(Listing { entries, more })
}

/// Creates or replaces the regular file `path` (its parent must exist) with `content`,
/// mode 0755 when `executable`, else 0644 (also when it existed). A final symlink is
/// followed only beneath the workspace. With `owner` (a sandboxed session), the file is
/// handed to the sandbox user.
pub fn write(
    ws: &Dir,
    path: &str,
    content: &[u8],
    executable: bool,
    owner: Option<(u32, u32)>,
) -> Result<(), FsError> {
    if content.len() > MAX_FILE_BYTES {
        return Err(FsError::new(FsReason::FileTooLarge, path));
    }
    let mode = if executable { 0o755 } else { 0o644 };
    let mut options = OpenOptions::new();
    options
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
    let file = ws.open_with(path, &options).map_err(at(path))?;
    let meta = file.metadata().map_err(at(path))?;
    if !meta.is_file() {
        return Err(FsError::new(FsReason::InvalidPath, path));
    }
    file.set_permissions(Permissions::from_std(std::fs::Permissions::from_mode(mode)))
        .map_err(at(path))?;
    let mut file = file.into_std();
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::fchown(&file, Some(uid), Some(gid)).map_err(at(path))?;
    }
    file.write_all(content).map_err(at(path))?;
    Ok(())
}

/// Creates directory `path`; with `parents`, missing parents too, and an existing
/// directory is success. With `owner` (a sandboxed session), the directory and the
/// directories on the way are handed to the sandbox user.
pub fn make_directory(
    ws: &Dir,
    path: &str,
    parents: bool,
    owner: Option<(u32, u32)>,
) -> Result<(), FsError> {
    if parents {
        ws.create_dir_all(path).map_err(at(path))?;
    } else {
        ws.create_dir(path).map_err(at(path))?;
    }
    if let Some((uid, gid)) = owner {
        let mut prefix = PathBuf::new();
        for part in Path::new(path).components() {
            prefix.push(part);
            // A descriptor that can change ownership (not O_PATH), never following a
            // symlink out of the workspace.
            let mut options = OpenOptions::new();
            options
                .read(true)
                .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW);
            let dir = ws
                .open_with(&prefix, &options)
                .map_err(at(path))?
                .into_std();
            std::os::unix::fs::fchown(&dir, Some(uid), Some(gid)).map_err(at(path))?;
        }
    }
    Ok(())
}

/// Removes a file, a symlink (never its target) or an empty directory; with `recursive`,
/// a directory and everything beneath it, checking `stop` before each entry.
pub fn delete(ws: &Dir, path: &str, recursive: bool, stop: &AtomicBool) -> Result<(), FsError> {
    let meta = ws.symlink_metadata(path).map_err(at(path))?;
    if !meta.is_dir() {
        return ws.remove_file(path).map_err(at(path));
    }
    if recursive {
        remove_tree(ws, Path::new(path), stop, 0).map_err(|e| match e {
            TreeError::Stopped => FsError::new(FsReason::Stopped, path),
            TreeError::TooDeep => FsError {
                reason: FsReason::IoError,
                path: ids::bounded(path),
                detail: Some(format!("deeper than {MAX_DELETE_DEPTH} levels")),
            },
            TreeError::Io(e) => FsError::io(path, &e),
        })
    } else {
        ws.remove_dir(path).map_err(at(path))
    }
}

enum TreeError {
    Stopped,
    TooDeep,
    Io(std::io::Error),
}

impl From<std::io::Error> for TreeError {
    fn from(e: std::io::Error) -> Self {
        TreeError::Io(e)
    }
}

/// Removes directory `name` of `parent` and everything beneath it without following any
/// symlink: each directory is opened with `O_NOFOLLOW` relative to its parent, and at
/// most [`DELETE_BATCH`] names are held at a time.
fn remove_tree(
    parent: &Dir,
    name: &Path,
    stop: &AtomicBool,
    depth: usize,
) -> Result<(), TreeError> {
    if depth >= MAX_DELETE_DEPTH {
        return Err(TreeError::TooDeep);
    }
    let mut options = OpenOptions::new();
    options
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW);
    let dir = Dir::from_std_file(parent.open_with(name, &options)?.into_std());
    loop {
        let mut batch: Vec<(std::ffi::OsString, bool)> = Vec::new();
        for entry in dir.entries()? {
            let entry = entry?;
            batch.push((entry.file_name(), entry.file_type()?.is_dir()));
            if batch.len() >= DELETE_BATCH {
                break;
            }
        }
        if batch.is_empty() {
            break;
        }
        for (child, is_dir) in batch {
            if stop.load(Ordering::SeqCst) {
                return Err(TreeError::Stopped);
            }
            if is_dir {
                remove_tree(&dir, Path::new(&child), stop, depth + 1)?;
            } else {
                match dir.remove_file(&child) {
                    Ok(()) => {}
                    // Removed by someone else meanwhile.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
    drop(dir);
    parent.remove_dir(name)?;
    Ok(())
}

/// Renames `from` to `to`, replacing `to` as rename(2) does. Neither final component is
/// followed: a symlink moves or is replaced as a link.
pub fn rename(ws: &Dir, from: &str, to: &str) -> Result<(), FsError> {
    ws.rename(from, ws, to).map_err(|e| {
        // Say which side failed when only one can have: a missing source.
        let reason = classify(&e);
        let path = if reason == FsReason::NotFound && ws.symlink_metadata(from).is_ok() {
            to
        } else {
            from
        };
        FsError::io(path, &e)
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn workspace() -> (tempfile::TempDir, Dir) {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("ws")).unwrap();
        std::fs::write(tmp.path().join("secret"), b"outside").unwrap();
        let ws = open_workspace(&tmp.path().join("ws")).unwrap();
        (tmp, ws)
    }

    #[test]
    fn symlinks_out_of_the_workspace_are_escapes() {
        let (tmp, ws) = workspace();
        let root = tmp.path().join("ws");
        std::os::unix::fs::symlink("..", root.join("up")).unwrap();
        std::os::unix::fs::symlink(tmp.path(), root.join("abs")).unwrap();
        std::os::unix::fs::symlink("../secret", root.join("file")).unwrap();
        for path in ["up/secret", "abs/secret", "file"] {
            let err = read(&ws, path).unwrap_err();
            assert_eq!(err.reason, FsReason::PathEscapes, "{path}: {err}");
        }
        assert_eq!(
            write(&ws, "up/secret", b"x", false, None)
                .unwrap_err()
                .reason,
            FsReason::PathEscapes
        );
        assert_eq!(
            write(&ws, "file", b"x", false, None).unwrap_err().reason,
            FsReason::PathEscapes
        );
        assert_eq!(
            list(&ws, "up", None, 10).unwrap_err().reason,
            FsReason::PathEscapes
        );
        assert_eq!(
            std::fs::read(tmp.path().join("secret")).unwrap(),
            b"outside"
        );
        // The final link itself is deleted, never its target.
        let stop = AtomicBool::new(false);
        delete(&ws, "file", false, &stop).unwrap();
        delete(&ws, "abs", true, &stop).unwrap();
        assert_eq!(
            std::fs::read(tmp.path().join("secret")).unwrap(),
            b"outside"
        );
        assert!(!root.join("abs").exists() && !root.join("file").exists());
    }

    #[test]
    fn reads_and_writes_are_bounded() {
        let (_tmp, ws) = workspace();
        write(&ws, "a", &vec![7u8; MAX_FILE_BYTES], true, None).unwrap();
        let read_back = read(&ws, "a").unwrap();
        assert_eq!(read_back.content.len(), MAX_FILE_BYTES);
        assert!(read_back.executable);
        write(&ws, "a", b"short", false, None).unwrap();
        let read_back = read(&ws, "a").unwrap();
        assert_eq!(read_back.content, b"short");
        assert!(!read_back.executable);
        assert_eq!(
            write(&ws, "b", &vec![0u8; MAX_FILE_BYTES + 1], false, None)
                .unwrap_err()
                .reason,
            FsReason::FileTooLarge
        );
        ws.write("big", vec![0u8; MAX_FILE_BYTES + 1]).unwrap();
        assert_eq!(read(&ws, "big").unwrap_err().reason, FsReason::FileTooLarge);
        ws.create_dir("d").unwrap();
        assert!(read(&ws, "d").unwrap().directory);
        assert_eq!(
            write(&ws, "d", b"x", false, None).unwrap_err().reason,
            FsReason::IsADirectory
        );
        assert_eq!(read(&ws, "nope").unwrap_err().reason, FsReason::NotFound);
        assert_eq!(
            write(&ws, "nope/x", b"x", false, None).unwrap_err().reason,
            FsReason::NotFound
        );
    }

    #[test]
    fn lists_pages_in_byte_order() {
        let (_tmp, ws) = workspace();
        let names = ["b", "a", "B", "\u{e9}", "e\u{301}", "a0", "_", "~"];
        for name in names {
            ws.write(name, b"12").unwrap();
        }
        ws.create_dir("dir").unwrap();
        let mut expected: Vec<&str> = names.to_vec();
        expected.push("dir");
        expected.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        let mut seen = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let page = list(&ws, "", after.as_deref(), 3).unwrap();
            assert!(page.entries.len() <= 3);
            seen.extend(page.entries.iter().map(|e| e.name.clone()));
            if !page.more {
                break;
            }
            after = page.entries.last().map(|e| e.name.clone());
        }
        assert_eq!(seen, expected);
        let page = list(&ws, "", Some("c"), 100).unwrap();
        let dir = page.entries.iter().find(|e| e.name == "dir").unwrap();
        assert!(dir.directory && dir.size_bytes == 0);
        assert_eq!(page.entries[0].path, "dir");
        let file = list(&ws, "", None, 1).unwrap().entries.remove(0);
        assert_eq!((file.name.as_str(), file.size_bytes), ("B", 2));
        assert_eq!(
            list(&ws, "b", None, 1).unwrap_err().reason,
            FsReason::NotADirectory
        );
    }

    #[test]
    fn deletes_trees_without_following_links() {
        let (tmp, ws) = workspace();
        ws.create_dir_all("t/a/b").unwrap();
        ws.write("t/a/b/f", b"x").unwrap();
        ws.write("t/f", b"x").unwrap();
        std::os::unix::fs::symlink(tmp.path(), tmp.path().join("ws/t/a/out")).unwrap();
        let stop = AtomicBool::new(false);
        assert_eq!(
            delete(&ws, "t", false, &stop).unwrap_err().reason,
            FsReason::DirectoryNotEmpty
        );
        let stopped = AtomicBool::new(true);
        assert_eq!(
            delete(&ws, "t", true, &stopped).unwrap_err().reason,
            FsReason::Stopped
        );
        delete(&ws, "t", true, &stop).unwrap();
        assert!(!tmp.path().join("ws/t").exists());
        assert_eq!(
            std::fs::read(tmp.path().join("secret")).unwrap(),
            b"outside"
        );
    }

    #[test]
    fn renames_move_links_not_targets() {
        let (tmp, ws) = workspace();
        std::os::unix::fs::symlink("../secret", tmp.path().join("ws/link")).unwrap();
        rename(&ws, "link", "moved").unwrap();
        assert!(tmp.path().join("ws/moved").is_symlink());
        ws.write("f", b"in").unwrap();
        rename(&ws, "f", "moved").unwrap();
        assert_eq!(std::fs::read(tmp.path().join("ws/moved")).unwrap(), b"in");
        assert_eq!(
            std::fs::read(tmp.path().join("secret")).unwrap(),
            b"outside"
        );
        assert_eq!(rename(&ws, "nope", "x").unwrap_err().path, "nope");
        let err = rename(&ws, "moved", "no/such").unwrap_err();
        assert_eq!(
            (err.reason, err.path.as_str()),
            (FsReason::NotFound, "no/such")
        );
    }
}
