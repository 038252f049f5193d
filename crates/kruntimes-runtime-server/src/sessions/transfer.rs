//! Whole-file uploads and downloads of a session (`UploadSessionFile`,
//! `DownloadSessionFile` of `runtime.proto`): files of any size up to a cap, and
//! directories as tar streams, beside the 1 MiB operations of the queue.
//!
//! Owns the blocking half of a transfer: bytes arrive (or leave) through a bounded channel
//! of chunks of at most [`CHUNK_BYTES`], so a transfer holds a few MiB however large the
//! file is. Everything is resolved through the workspace's cap-std [`Dir`] (as
//! [`super::files`] does): the target's parent is opened beneath the workspace and every
//! write happens relative to it.
//!
//! - An upload goes to a temporary name (`.krt-upload-<random>`) in the target's own
//!   directory, is synced (the file, or the filesystem for an archive) and renamed into
//!   place only once the stream's `end` arrived with the right total; any failure, a
//!   stream that breaks or ends early, a close of the session, removes the temporary and
//!   leaves the target as it was.
//! - An archive is extracted into a temporary directory that then replaces an absent or
//!   empty target directory. Each entry is checked before anything is written for it: its
//!   name must be a workspace path (no absolute name, no `..`), it must not go through a
//!   symlink the archive made, a symlink's target must be relative with its `..` only at
//!   the start and never climbing above the extraction root, a hard link must name an
//!   earlier entry, and devices, FIFOs and sparse files are refused. One bad entry fails
//!   the whole upload.
//! - Free space: an announced size larger than the filesystem's free space fails at once,
//!   and `ENOSPC` while writing fails the upload (`InsufficientStorage`). Workspaces have no
//!   quota of their own (docs/security.md).
#![forbid(unsafe_code)]

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt as _;
use std::sync::atomic::{AtomicBool, Ordering};

use cap_std::fs::{Dir, OpenOptions, OpenOptionsExt, Permissions, PermissionsExt};
use nix::libc;
use tokio::sync::mpsc;

use super::files::{self, FsReason};
use super::paths;
use crate::ids;

/// The largest upload when the request names no cap.
pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;
/// The largest data message of a transfer, either way.
pub const CHUNK_BYTES: usize = 1 << 20;
/// An archive holds at most this many entries.
pub const MAX_ARCHIVE_ENTRIES: u64 = 100_000;
/// A downloaded archive descends at most this deep.
pub const MAX_ARCHIVE_DEPTH: usize = 256;
/// The prefix of an upload's temporary name, in the target's directory.
pub const TEMP_PREFIX: &str = ".krt-upload-";
/// Chunks buffered between the network and the disk, either way.
pub const CHANNEL_CHUNKS: usize = 4;

/// Why a transfer failed, in the stable words of the `x-kruntimes-reason` metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferReason {
    /// More bytes than the cap.
    FileTooLarge,
    /// The filesystem is (or would be) full.
    InsufficientStorage,
    /// An entry of the archive is refused, or the tar stream is malformed.
    InvalidArchive,
    /// A symlink on the way leads out of the workspace.
    PathEscapes,
    IsADirectory,
    NotADirectory,
    /// An archive's target directory is not empty.
    DirectoryNotEmpty,
    NotFound,
    /// Neither a regular file nor a directory.
    InvalidPath,
    /// The stream ended or broke before its `end`, or its total does not match.
    Incomplete,
    /// The session closed, or the server shuts down, meanwhile.
    Stopped,
    IoError,
    /// A snapshot being captured holds more entries or bytes than its caps.
    SnapshotTooLarge,
    /// A snapshot being restored is refused: a bad entry, a cap, its digest, its end.
    SnapshotInvalid,
}

impl TransferReason {
    pub fn as_str(self) -> &'static str {
        match self {
            TransferReason::FileTooLarge => "FileTooLarge",
            TransferReason::InsufficientStorage => "InsufficientStorage",
            TransferReason::InvalidArchive => "InvalidArchive",
            TransferReason::PathEscapes => "PathEscapes",
            TransferReason::IsADirectory => "IsADirectory",
            TransferReason::NotADirectory => "NotADirectory",
            TransferReason::DirectoryNotEmpty => "DirectoryNotEmpty",
            TransferReason::NotFound => "NotFound",
            TransferReason::InvalidPath => "InvalidPath",
            TransferReason::Incomplete => "Incomplete",
            TransferReason::Stopped => "Stopped",
            TransferReason::IoError => "IoError",
            TransferReason::SnapshotTooLarge => "SnapshotTooLarge",
            TransferReason::SnapshotInvalid => "SnapshotInvalid",
        }
    }
}

/// A failed transfer: why, and a bounded message naming the path.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct TransferError {
    pub reason: TransferReason,
    pub message: String,
}

impl TransferError {
    pub fn new(reason: TransferReason, message: impl AsRef<str>) -> Self {
        Self {
            reason,
            message: ids::bounded(message.as_ref()),
        }
    }

    pub(super) fn io(path: &str, e: &std::io::Error) -> Self {
        if e.raw_os_error() == Some(libc::ENOSPC) || e.raw_os_error() == Some(libc::EDQUOT) {
            return Self::new(
                TransferReason::InsufficientStorage,
                format!("{path:?}: the workspace's filesystem is full"),
            );
        }
        let reason = match files::classify(e) {
            FsReason::PathEscapes => TransferReason::PathEscapes,
            FsReason::NotFound => TransferReason::NotFound,
            FsReason::NotADirectory => TransferReason::NotADirectory,
            FsReason::IsADirectory => TransferReason::IsADirectory,
            FsReason::DirectoryNotEmpty => TransferReason::DirectoryNotEmpty,
            FsReason::FileTooLarge => TransferReason::FileTooLarge,
            FsReason::InvalidPath => TransferReason::InvalidPath,
            _ => TransferReason::IoError,
        };
        let what = match reason {
            TransferReason::PathEscapes => "resolves outside the workspace".to_owned(),
            TransferReason::NotFound => "does not exist (or its directory does not)".to_owned(),
            TransferReason::NotADirectory => {
                "is not a directory (or a component of it is not)".to_owned()
            }
            TransferReason::IsADirectory => "is a directory".to_owned(),
            _ => format!("failed: {e}"),
        };
        Self::new(reason, format!("{path:?} {what}"))
    }

    fn archive(message: impl AsRef<str>) -> Self {
        Self::new(TransferReason::InvalidArchive, message)
    }
}

pub(super) fn at(path: &str) -> impl Fn(std::io::Error) -> TransferError + '_ {
    move |e| TransferError::io(path, &e)
}

/// One part of an upload after its header.
#[derive(Debug)]
pub enum UploadPart {
    Data(Vec<u8>),
    /// The stream is complete: this many data bytes were sent.
    End(u64),
}

/// What an upload asks for (its header), validated by the caller.
#[derive(Debug, Clone)]
pub struct UploadSpec {
    pub path: String,
    pub executable: bool,
    pub archive: bool,
    pub size: Option<u64>,
    pub max_bytes: u64,
}

/// What an upload wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Uploaded {
    pub size_bytes: u64,
    pub files: u64,
}

/// The first answer of a download.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DownloadHeader {
    pub directory: bool,
    pub size_bytes: u64,
    pub executable: bool,
}

/// One part of a download.
#[derive(Debug)]
pub enum DownloadPart {
    Header(DownloadHeader),
    Data(Vec<u8>),
}

/// The parent directory and the final name of a validated, non-empty path.
fn split(path: &str) -> (&str, &str) {
    match path.rsplit_once('/') {
        Some((parent, name)) => (parent, name),
        None => ("", path),
    }
}

fn random_name() -> String {
    format!("{TEMP_PREFIX}{:016x}", rand::random::<u64>())
}

/// The chunks of an upload as a reader, counting them against the cap and watching for
/// `end` (and for `stop`). What went wrong is kept in `failure`: errors that pass through
/// the tar reader lose their type.
pub(super) struct Incoming<'a> {
    rx: &'a mut mpsc::Receiver<UploadPart>,
    stop: &'a AtomicBool,
    path: &'a str,
    max_bytes: u64,
    pub(super) received: u64,
    current: Vec<u8>,
    offset: usize,
    ended: bool,
    pub(super) failure: Option<TransferError>,
    /// SHA-256 of the data received, when asked for (a snapshot's digest).
    pub(super) digest: Option<sha2::Sha256>,
}

impl<'a> Incoming<'a> {
    pub(super) fn new(
        rx: &'a mut mpsc::Receiver<UploadPart>,
        stop: &'a AtomicBool,
        path: &'a str,
        max_bytes: u64,
    ) -> Self {
        Self {
            rx,
            stop,
            path,
            max_bytes,
            received: 0,
            current: Vec::new(),
            offset: 0,
            ended: false,
            failure: None,
            digest: None,
        }
    }

    fn fail(&mut self, e: TransferError) -> std::io::Error {
        let message = e.message.clone();
        self.failure.get_or_insert(e);
        std::io::Error::other(message)
    }

    /// The next chunk, `None` at `end`.
    pub(super) fn next_chunk(&mut self) -> Result<Option<Vec<u8>>, TransferError> {
        if self.ended {
            return Ok(None);
        }
        if self.stop.load(Ordering::SeqCst) {
            return Err(TransferError::new(
                TransferReason::Stopped,
                "the session closed during the upload",
            ));
        }
        match self.rx.blocking_recv() {
            Some(UploadPart::Data(data)) => {
                self.received += data.len() as u64;
                if let Some(digest) = &mut self.digest {
                    sha2::Digest::update(digest, &data);
                }
                if self.received > self.max_bytes {
                    return Err(TransferError::new(
                        TransferReason::FileTooLarge,
                        format!(
                            "{:?}: the upload is larger than the limit of {} bytes",
                            self.path, self.max_bytes
                        ),
                    ));
                }
                Ok(Some(data))
            }
            Some(UploadPart::End(total)) => {
                if total != self.received {
                    return Err(TransferError::new(
                        TransferReason::Incomplete,
                        format!(
                            "{:?}: the upload ended after {} bytes but says it sent {total}",
                            self.path, self.received
                        ),
                    ));
                }
                self.ended = true;
                Ok(None)
            }
            None => Err(TransferError::new(
                TransferReason::Incomplete,
                format!(
                    "{:?}: the upload broke off after {} bytes",
                    self.path, self.received
                ),
            )),
        }
    }

    /// Reads what is left up to `end` (an archive's padding after its last entry).
    pub(super) fn finish(&mut self) -> Result<(), TransferError> {
        while self.next_chunk()?.is_some() {}
        Ok(())
    }
}

impl Read for Incoming<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.offset >= self.current.len() {
            match self.next_chunk() {
                Ok(Some(chunk)) => {
                    self.current = chunk;
                    self.offset = 0;
                }
                Ok(None) => return Ok(0),
                Err(e) => return Err(self.fail(e)),
            }
        }
        let n = buf.len().min(self.current.len() - self.offset);
        buf[..n].copy_from_slice(&self.current[self.offset..self.offset + n]);
        self.offset += n;
        Ok(n)
    }
}

/// Fails when `wanted` bytes would not fit in the free space of `dir`'s filesystem.
fn check_space(dir: &Dir, path: &str, wanted: Option<u64>) -> Result<(), TransferError> {
    let Some(wanted) = wanted else {
        return Ok(());
    };
    let Ok(stat) = nix::sys::statvfs::fstatvfs(dir) else {
        return Ok(());
    };
    let free = stat.blocks_available().saturating_mul(stat.fragment_size());
    if wanted > free {
        return Err(TransferError::new(
            TransferReason::InsufficientStorage,
            format!(
                "{path:?}: {wanted} bytes do not fit in the {free} bytes free in the workspace"
            ),
        ));
    }
    Ok(())
}

/// Removes a temporary name unless the upload was committed.
pub(super) struct Temp<'a> {
    pub(super) dir: &'a Dir,
    pub(super) name: String,
    pub(super) is_dir: bool,
    pub(super) committed: bool,
}

impl Drop for Temp<'_> {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        let result = if self.is_dir {
            self.dir.remove_dir_all(&self.name)
        } else {
            self.dir.remove_file(&self.name)
        };
        if let Err(e) = result
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(name = %self.name, error = %e, "an aborted upload's temporary was not removed");
        }
    }
}

/// Receives an upload into `ws` (blocking; run off the async threads).
pub fn upload(
    ws: &Dir,
    spec: &UploadSpec,
    rx: &mut mpsc::Receiver<UploadPart>,
    stop: &AtomicBool,
    owner: Option<(u32, u32)>,
) -> Result<Uploaded, TransferError> {
    let path = spec.path.as_str();
    if spec.size.is_some_and(|size| size > spec.max_bytes) {
        return Err(TransferError::new(
            TransferReason::FileTooLarge,
            format!(
                "{path:?}: {} bytes are more than the limit of {} bytes",
                spec.size.unwrap_or_default(),
                spec.max_bytes
            ),
        ));
    }
    let (parent, name) = split(path);
    let parent_dir = ws
        .open_dir(if parent.is_empty() { "." } else { parent })
        .map_err(at(if parent.is_empty() { "." } else { parent }))?;
    match parent_dir.symlink_metadata(name) {
        Ok(meta) if meta.is_dir() && !spec.archive => {
            return Err(TransferError::new(
                TransferReason::IsADirectory,
                format!("{path:?} is a directory; upload a file to another path, or an archive"),
            ));
        }
        Ok(meta) if spec.archive && !meta.is_dir() => {
            return Err(TransferError::new(
                TransferReason::NotADirectory,
                format!(
                    "{path:?} exists and is not a directory; an archive is extracted into a new or empty directory"
                ),
            ));
        }
        Ok(_) if spec.archive => {
            let target = parent_dir.open_dir(name).map_err(at(path))?;
            if target.entries().map_err(at(path))?.next().is_some() {
                return Err(TransferError::new(
                    TransferReason::DirectoryNotEmpty,
                    format!(
                        "{path:?} is a directory that is not empty; an archive is extracted into a new or empty directory"
                    ),
                ));
            }
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(TransferError::io(path, &e)),
    }
    check_space(&parent_dir, path, spec.size)?;
    let mut incoming = Incoming::new(rx, stop, path, spec.max_bytes);
    let temp_name = random_name();
    if spec.archive {
        parent_dir.create_dir(&temp_name).map_err(at(path))?;
        let mut temp = Temp {
            dir: &parent_dir,
            name: temp_name.clone(),
            is_dir: true,
            committed: false,
        };
        let stage = open_dir_handle(&parent_dir, &temp_name).map_err(at(path))?;
        chown_dir(&stage, owner).map_err(at(path))?;
        let rules = ExtractRules {
            roots: &[("", &stage)],
            owner,
            exact: false,
            max_entries: MAX_ARCHIVE_ENTRIES,
            max_bytes: u64::MAX,
        };
        let files = match extract(&mut incoming, &rules) {
            Ok(done) => done.files,
            Err(e) => return Err(incoming.failure.take().unwrap_or(e)),
        };
        incoming.finish()?;
        nix::unistd::syncfs(&stage)
            .map_err(|e| TransferError::io(path, &std::io::Error::from(e)))?;
        parent_dir
            .rename(&temp_name, &parent_dir, name)
            .map_err(at(path))?;
        temp.committed = true;
        sync_dir(&parent_dir);
        return Ok(Uploaded {
            size_bytes: incoming.received,
            files,
        });
    }
    let mode = if spec.executable { 0o755 } else { 0o644 };
    let mut options = OpenOptions::new();
    options
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NOCTTY);
    let file = parent_dir
        .open_with(&temp_name, &options)
        .map_err(at(path))?;
    let mut temp = Temp {
        dir: &parent_dir,
        name: temp_name.clone(),
        is_dir: false,
        committed: false,
    };
    file.set_permissions(Permissions::from_std(std::fs::Permissions::from_mode(mode)))
        .map_err(at(path))?;
    let mut file = file.into_std();
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::fchown(&file, Some(uid), Some(gid)).map_err(at(path))?;
    }
    while let Some(chunk) = incoming.next_chunk()? {
        file.write_all(&chunk).map_err(at(path))?;
    }
    if let Some(size) = spec.size
        && size != incoming.received
    {
        return Err(TransferError::new(
            TransferReason::Incomplete,
            format!(
                "{path:?}: {} bytes arrived of the {size} announced",
                incoming.received
            ),
        ));
    }
    file.sync_all().map_err(at(path))?;
    drop(file);
    parent_dir
        .rename(&temp_name, &parent_dir, name)
        .map_err(at(path))?;
    temp.committed = true;
    sync_dir(&parent_dir);
    Ok(Uploaded {
        size_bytes: incoming.received,
        files: 1,
    })
}

/// Opens directory `name` of `dir` for reading (not `O_PATH`: it can be synced, changed
/// owner of and listed), never following a final symlink.
pub(super) fn open_dir_handle(dir: &Dir, name: &str) -> std::io::Result<Dir> {
    let mut options = OpenOptions::new();
    options
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW);
    Ok(Dir::from_std_file(
        dir.open_with(name, &options)?.into_std(),
    ))
}

/// Makes a rename durable; a failure only weakens durability, so it is logged.
pub(super) fn sync_dir(dir: &Dir) {
    if let Ok(handle) = open_dir_handle(dir, ".")
        && let Err(e) = handle.into_std_file().sync_all()
    {
        tracing::warn!(error = %e, "syncing a directory after an upload failed");
    }
}

pub(super) fn chown_dir(dir: &Dir, owner: Option<(u32, u32)>) -> std::io::Result<()> {
    if let Some((uid, gid)) = owner {
        let handle = open_dir_handle(dir, ".")?.into_std_file();
        std::os::unix::fs::fchown(&handle, Some(uid), Some(gid))?;
    }
    Ok(())
}

/// An archive entry's name as a workspace path relative to the extraction root; `None`
/// for the root itself (`.` or `./`). Leading `./` and doubled or trailing slashes are
/// dropped; an absolute name, a `..` or a name that is not UTF-8 is refused.
pub fn entry_path(raw: &[u8]) -> Result<Option<String>, TransferError> {
    let shown = String::from_utf8_lossy(raw);
    let text = std::str::from_utf8(raw)
        .map_err(|_| TransferError::archive(format!("entry {shown:?}: the name is not UTF-8")))?;
    if text.starts_with('/') {
        return Err(TransferError::archive(format!(
            "entry {shown:?}: absolute names are refused"
        )));
    }
    let parts: Vec<&str> = text
        .split('/')
        .filter(|part| !part.is_empty() && *part != ".")
        .collect();
    if parts.contains(&"..") {
        return Err(TransferError::archive(format!(
            "entry {shown:?}: '..' is refused"
        )));
    }
    if parts.is_empty() {
        return Ok(None);
    }
    let path = parts.join("/");
    paths::validate_path("entry", &path, false)
        .map_err(|e| TransferError::archive(format!("entry {shown:?}: {e}")))?;
    Ok(Some(path))
}

/// Checks a symlink's target for the entry `path`: relative, its `..` only at the start
/// and never climbing above the extraction root.
pub fn check_link_target(path: &str, target: &[u8]) -> Result<(), TransferError> {
    let text = std::str::from_utf8(target).map_err(|_| {
        TransferError::archive(format!("symlink {path:?}: the target is not UTF-8"))
    })?;
    if text.is_empty() || text.starts_with('/') || text.contains('\0') {
        return Err(TransferError::archive(format!(
            "symlink {path:?} -> {text:?}: only relative targets inside the archive are accepted"
        )));
    }
    let depth = path.matches('/').count();
    let mut ups = 0usize;
    let mut seen_name = false;
    for part in text.split('/') {
        match part {
            "" | "." => {}
            ".." if seen_name => {
                return Err(TransferError::archive(format!(
                    "symlink {path:?} -> {text:?}: '..' is accepted only at the start of a target"
                )));
            }
            ".." => ups += 1,
            _ => seen_name = true,
        }
    }
    if ups > depth {
        return Err(TransferError::archive(format!(
            "symlink {path:?} -> {text:?} points out of the extracted directory"
        )));
    }
    Ok(())
}

/// Fails when a directory on the way to `path` (inside `stage`) is not a real directory:
/// entries never go through a symlink, whatever the archive made before them.
fn check_parents(stage: &Dir, path: &str) -> Result<(), TransferError> {
    let mut prefix = String::new();
    let parts: Vec<&str> = path.split('/').collect();
    for part in &parts[..parts.len() - 1] {
        prefix = paths::join(&prefix, part);
        match stage.symlink_metadata(&prefix) {
            Ok(meta) if meta.is_dir() => {}
            Ok(meta) if meta.is_symlink() => {
                return Err(TransferError::archive(format!(
                    "entry {path:?} goes through the symlink {prefix:?}"
                )));
            }
            Ok(_) => {
                return Err(TransferError::archive(format!(
                    "entry {path:?}: {prefix:?} is not a directory"
                )));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                stage.create_dir(&prefix).map_err(at(path))?;
            }
            Err(e) => return Err(TransferError::io(path, &e)),
        }
    }
    Ok(())
}

/// Removes whatever non-directory an earlier entry left at `path` (a later entry wins).
fn clear(stage: &Dir, path: &str) -> Result<(), TransferError> {
    match stage.symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => Err(TransferError::archive(format!(
            "entry {path:?} replaces a directory of the archive"
        ))),
        Ok(_) => stage.remove_file(path).map_err(at(path)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(TransferError::io(path, &e)),
    }
}

/// How an archive is extracted: where its entries go and how much of them is kept.
pub(super) struct ExtractRules<'a> {
    /// Where entries go. One root named `""` takes every entry (an upload); otherwise an
    /// entry's first component names its root (a snapshot's `workspace` or `artifacts`)
    /// and the rest is its path inside it, checked against that root alone.
    pub(super) roots: &'a [(&'a str, &'a Dir)],
    pub(super) owner: Option<(u32, u32)>,
    /// Keep each entry's permission bits (0777) and mtime, and refuse hard links (a
    /// snapshot); otherwise files are 0644 or 0755, directories 0755, and mtimes the time
    /// of extraction (an upload).
    pub(super) exact: bool,
    /// The most entries (the roots' own entries included).
    pub(super) max_entries: u64,
    /// The most bytes of regular files, checked against each entry's header before any
    /// of its data is written.
    pub(super) max_bytes: u64,
}

/// What an extraction wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Extracted {
    /// Regular files written.
    pub(super) files: u64,
    /// Entries of the archive.
    pub(super) entries: u64,
    /// Bytes of regular files written.
    pub(super) bytes: u64,
}

/// Sets the mtime of `path` in `dir` (the entry itself, never a symlink's target).
fn set_mtime(dir: &Dir, path: &str, mtime: u64) -> Result<(), TransferError> {
    use nix::sys::stat::{UtimensatFlags, utimensat};
    use nix::sys::time::TimeSpec;
    let seconds = libc::time_t::try_from(mtime).unwrap_or(libc::time_t::MAX);
    utimensat(
        dir,
        path,
        &TimeSpec::UTIME_OMIT,
        &TimeSpec::new(seconds, 0),
        UtimensatFlags::NoFollowSymlink,
    )
    .map_err(|e| TransferError::io(path, &std::io::Error::from(e)))
}

/// Extracts a tar stream into `rules.roots`.
pub(super) fn extract(
    reader: impl Read,
    rules: &ExtractRules<'_>,
) -> Result<Extracted, TransferError> {
    use tar::EntryType;
    let mut archive = tar::Archive::new(reader);
    let mut done = Extracted::default();
    // A snapshot's directories get their own mode and mtime last: their entries are
    // written into them first, and writing would change the mtime.
    let mut directories: Vec<(&Dir, String, u32, u64)> = Vec::new();
    let broken =
        |e: std::io::Error| TransferError::archive(format!("the tar stream is malformed: {e}"));
    for entry in archive.entries().map_err(broken)? {
        let mut entry = entry.map_err(broken)?;
        done.entries += 1;
        if done.entries > rules.max_entries {
            return Err(TransferError::archive(format!(
                "the archive has more than {} entries",
                rules.max_entries
            )));
        }
        let kind = entry.header().entry_type();
        if matches!(
            kind,
            EntryType::XGlobalHeader
                | EntryType::XHeader
                | EntryType::GNULongName
                | EntryType::GNULongLink
        ) {
            continue;
        }
        let raw = entry.path_bytes().into_owned();
        let full = entry_path(&raw)?;
        let (stage, path) = match (rules.roots, full) {
            ([("", stage)], full) => (*stage, full),
            (_, None) => (rules.roots[0].1, None),
            (roots, Some(full)) => {
                let (first, rest) = match full.split_once('/') {
                    Some((first, rest)) => (first, Some(rest.to_owned())),
                    None => (full.as_str(), None),
                };
                let Some((_, stage)) = roots.iter().find(|(name, _)| *name == first) else {
                    let names: Vec<&str> = roots.iter().map(|(name, _)| *name).collect();
                    return Err(TransferError::archive(format!(
                        "entry {full:?} is outside {}/",
                        names.join("/ and ")
                    )));
                };
                (*stage, rest)
            }
        };
        let Some(path) = path else {
            if kind == EntryType::Directory {
                continue;
            }
            return Err(TransferError::archive(
                "an entry that is not a directory names the extraction root",
            ));
        };
        check_parents(stage, &path)?;
        let mode = entry.header().mode().unwrap_or(0o644);
        let mtime = entry.header().mtime().unwrap_or(0);
        match kind {
            EntryType::Directory => {
                match stage.symlink_metadata(&path) {
                    Ok(meta) if meta.is_dir() => {}
                    Ok(_) => {
                        return Err(TransferError::archive(format!(
                            "directory {path:?} replaces another entry of the archive"
                        )));
                    }
                    Err(_) => stage.create_dir(&path).map_err(at(&path))?,
                }
                let dir = stage.open_dir(&path).map_err(at(&path))?;
                dir.set_permissions(
                    ".",
                    Permissions::from_std(std::fs::Permissions::from_mode(0o755)),
                )
                .map_err(at(&path))?;
                chown_dir(&dir, rules.owner).map_err(at(&path))?;
                if rules.exact {
                    directories.push((stage, path, mode & 0o777, mtime));
                }
            }
            EntryType::Regular | EntryType::Continuous => {
                let size = entry.size();
                if done.bytes.saturating_add(size) > rules.max_bytes {
                    return Err(TransferError::new(
                        TransferReason::FileTooLarge,
                        format!(
                            "entry {path:?}: {size} bytes bring the files past the limit of {} bytes",
                            rules.max_bytes
                        ),
                    ));
                }
                clear(stage, &path)?;
                let mode = match (rules.exact, mode & 0o111 != 0) {
                    (true, _) => mode & 0o777,
                    (false, true) => 0o755,
                    (false, false) => 0o644,
                };
                let mut options = OpenOptions::new();
                options
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW | libc::O_NOCTTY);
                let file = stage.open_with(&path, &options).map_err(at(&path))?;
                let mut file = file.into_std();
                if let Some((uid, gid)) = rules.owner {
                    std::os::unix::fs::fchown(&file, Some(uid), Some(gid)).map_err(at(&path))?;
                }
                let written = std::io::copy(&mut entry, &mut file).map_err(at(&path))?;
                // After the data (a mode without write for the owner would not matter to
                // this handle, but set last all the same).
                file.set_permissions(std::fs::Permissions::from_mode(mode))
                    .map_err(at(&path))?;
                if rules.exact {
                    file.set_modified(
                        std::time::UNIX_EPOCH + std::time::Duration::from_secs(mtime),
                    )
                    .map_err(at(&path))?;
                }
                done.files += 1;
                done.bytes += written;
            }
            EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                check_link_target(&path, &target)?;
                clear(stage, &path)?;
                let target = String::from_utf8_lossy(&target).into_owned();
                stage.symlink(&target, &path).map_err(at(&path))?;
                if let Some((uid, gid)) = rules.owner {
                    nix::unistd::fchownat(
                        stage,
                        path.as_str(),
                        Some(uid.into()),
                        Some(gid.into()),
                        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                    )
                    .map_err(|e| TransferError::io(&path, &std::io::Error::from(e)))?;
                }
                if rules.exact {
                    set_mtime(stage, &path, mtime)?;
                }
            }
            EntryType::Link if !rules.exact => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                let Some(target) = entry_path(&target)? else {
                    return Err(TransferError::archive(format!(
                        "hard link {path:?} names the extraction root"
                    )));
                };
                check_parents(stage, &target)?;
                match stage.symlink_metadata(&target) {
                    Ok(meta) if meta.is_file() => {}
                    _ => {
                        return Err(TransferError::archive(format!(
                            "hard link {path:?} -> {target:?}: only earlier regular files of the archive can be linked"
                        )));
                    }
                }
                clear(stage, &path)?;
                stage.hard_link(&target, stage, &path).map_err(at(&path))?;
            }
            other => {
                return Err(TransferError::archive(format!(
                    "entry {path:?} is a {}; only regular files, directories and symlinks{} are accepted",
                    entry_kind(other),
                    if rules.exact { "" } else { " and hard links" }
                )));
            }
        }
    }
    for (stage, path, mode, mtime) in directories.into_iter().rev() {
        stage
            .set_permissions(
                &path,
                Permissions::from_std(std::fs::Permissions::from_mode(mode)),
            )
            .map_err(at(&path))?;
        set_mtime(stage, &path, mtime)?;
    }
    Ok(done)
}

fn entry_kind(kind: tar::EntryType) -> &'static str {
    use tar::EntryType;
    match kind {
        EntryType::Char => "character device",
        EntryType::Block => "block device",
        EntryType::Fifo => "FIFO",
        EntryType::GNUSparse => "sparse file",
        EntryType::Link => "hard link",
        _ => "special entry",
    }
}

// ---------------------------------------------------------------------------------------
// Downloads

/// Sends a download's chunks; a receiver that went away (the caller left) is a BrokenPipe.
struct Outgoing<'a> {
    tx: &'a mpsc::Sender<Result<DownloadPart, TransferError>>,
    stop: &'a AtomicBool,
    buffer: Vec<u8>,
}

impl Outgoing<'_> {
    fn send(&mut self, data: Vec<u8>) -> std::io::Result<()> {
        if self.stop.load(Ordering::SeqCst) {
            return Err(std::io::Error::other(
                "the session closed during the download",
            ));
        }
        self.tx
            .blocking_send(Ok(DownloadPart::Data(data)))
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::BrokenPipe))
    }
}

impl Write for Outgoing<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let room = CHUNK_BYTES - self.buffer.len();
        let n = buf.len().min(room);
        self.buffer.extend_from_slice(&buf[..n]);
        if self.buffer.len() >= CHUNK_BYTES {
            let full = std::mem::replace(&mut self.buffer, Vec::with_capacity(CHUNK_BYTES));
            self.send(full)?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if !self.buffer.is_empty() {
            let rest = std::mem::take(&mut self.buffer);
            self.send(rest)?;
        }
        Ok(())
    }
}

/// Exactly `remaining` bytes of a file that may change while it is read: cut when it grew,
/// padded with zeros when it shrank, so an archive's entry always matches its header.
pub(super) struct Exact<R> {
    pub(super) inner: R,
    pub(super) remaining: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.remaining == 0 {
            return Ok(0);
        }
        let want = buf
            .len()
            .min(usize::try_from(self.remaining).unwrap_or(usize::MAX));
        let mut n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            buf[..want].fill(0);
            n = want;
        }
        self.remaining -= n as u64;
        Ok(n)
    }
}

pub(super) fn open_read(dir: &Dir, name: &str, follow: bool) -> std::io::Result<cap_std::fs::File> {
    let mut options = OpenOptions::new();
    let nofollow = if follow { 0 } else { libc::O_NOFOLLOW };
    options
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | nofollow);
    dir.open_with(name, &options)
}

/// Streams `path` of `ws` (blocking; run off the async threads): a header, then the data.
/// A file follows a final symlink beneath the workspace, as reads do.
pub fn download(
    ws: &Dir,
    path: &str,
    archive: bool,
    tx: &mpsc::Sender<Result<DownloadPart, TransferError>>,
    stop: &AtomicBool,
) -> Result<(), TransferError> {
    let shown = if path.is_empty() { "." } else { path };
    let file = open_read(ws, shown, true).map_err(at(shown))?;
    let meta = file.metadata().map_err(at(shown))?;
    let header = |h: DownloadHeader| {
        tx.blocking_send(Ok(DownloadPart::Header(h)))
            .map_err(|_| TransferError::new(TransferReason::Stopped, "the caller went away"))
    };
    if meta.is_dir() {
        if !archive {
            return header(DownloadHeader {
                directory: true,
                size_bytes: 0,
                executable: false,
            });
        }
        drop(file);
        header(DownloadHeader {
            directory: true,
            size_bytes: 0,
            executable: false,
        })?;
        let dir = ws.open_dir(shown).map_err(at(shown))?;
        let dir = open_dir_handle(&dir, ".").map_err(at(shown))?;
        let mut out = Outgoing {
            tx,
            stop,
            buffer: Vec::with_capacity(CHUNK_BYTES),
        };
        let mut builder = tar::Builder::new(&mut out);
        builder.mode(tar::HeaderMode::Deterministic);
        let failed = |e: std::io::Error| TransferError::io(shown, &e);
        append_tree(&mut builder, &dir, "", 0).map_err(failed)?;
        builder.finish().map_err(failed)?;
        drop(builder);
        out.flush().map_err(failed)?;
        return Ok(());
    }
    if archive {
        return Err(TransferError::new(
            TransferReason::NotADirectory,
            format!("{shown:?} is not a directory; download it as a file"),
        ));
    }
    if !meta.is_file() {
        return Err(TransferError::new(
            TransferReason::InvalidPath,
            format!("{shown:?} is neither a regular file nor a directory"),
        ));
    }
    header(DownloadHeader {
        directory: false,
        size_bytes: meta.len(),
        executable: meta.permissions().mode() & 0o111 != 0,
    })?;
    let mut out = Outgoing {
        tx,
        stop,
        buffer: Vec::new(),
    };
    let mut reader = Exact {
        inner: file.into_std(),
        remaining: meta.len(),
    };
    loop {
        let mut chunk = vec![0u8; CHUNK_BYTES];
        let mut filled = 0;
        while filled < CHUNK_BYTES {
            let n = reader.read(&mut chunk[filled..]).map_err(at(shown))?;
            if n == 0 {
                break;
            }
            filled += n;
        }
        if filled == 0 {
            return Ok(());
        }
        chunk.truncate(filled);
        out.send(chunk).map_err(at(shown))?;
    }
}

/// Appends the entries of `dir` (named `prefix` in the archive) and everything beneath it,
/// never following a symlink: links are archived as links, and what is neither a file, a
/// directory nor a symlink (or not UTF-8) is left out.
fn append_tree<W: Write>(
    builder: &mut tar::Builder<W>,
    dir: &Dir,
    prefix: &str,
    depth: usize,
) -> std::io::Result<()> {
    if depth >= MAX_ARCHIVE_DEPTH {
        return Err(std::io::Error::other(format!(
            "the directory is deeper than {MAX_ARCHIVE_DEPTH} levels"
        )));
    }
    let mut names: Vec<String> = Vec::new();
    for entry in dir.entries()? {
        let entry = entry?;
        if let Ok(name) = entry.file_name().into_string() {
            names.push(name);
        }
    }
    names.sort();
    for name in names {
        let path = paths::join(prefix, &name);
        let meta = match dir.symlink_metadata(&name) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        let file_type = meta.file_type();
        let mut header = tar::Header::new_gnu();
        if file_type.is_dir() {
            header.set_entry_type(tar::EntryType::Directory);
            header.set_mode(0o755);
            header.set_size(0);
            builder.append_data(&mut header, format!("{path}/"), std::io::empty())?;
            let child = open_dir_handle(dir, &name)?;
            append_tree(builder, &child, &path, depth + 1)?;
        } else if file_type.is_symlink() {
            let target = dir.read_link_contents(&name)?;
            header.set_entry_type(tar::EntryType::Symlink);
            header.set_mode(0o777);
            header.set_size(0);
            builder.append_link(&mut header, &path, &target)?;
        } else if file_type.is_file() {
            let file = match open_read(dir, &name, false) {
                Ok(file) => file,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            let meta = file.metadata()?;
            if !meta.is_file() {
                continue;
            }
            header.set_entry_type(tar::EntryType::Regular);
            header.set_mode(if meta.permissions().mode() & 0o111 != 0 {
                0o755
            } else {
                0o644
            });
            header.set_size(meta.len());
            let reader = Exact {
                inner: file.into_std(),
                remaining: meta.len(),
            };
            builder.append_data(&mut header, &path, reader)?;
        }
    }
    Ok(())
}

/// Whether `name` is an upload's temporary (left out of nothing: listings show it).
pub fn is_temporary(name: &str) -> bool {
    name.starts_with(TEMP_PREFIX)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::path::Path;

    use super::*;

    fn workspace() -> (tempfile::TempDir, Dir) {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("ws")).unwrap();
        let ws = files::open_workspace(&tmp.path().join("ws")).unwrap();
        (tmp, ws)
    }

    fn send_all(parts: Vec<UploadPart>) -> mpsc::Receiver<UploadPart> {
        let (tx, rx) = mpsc::channel(parts.len().max(1));
        for part in parts {
            tx.try_send(part).unwrap();
        }
        rx
    }

    fn spec(path: &str, archive: bool) -> UploadSpec {
        UploadSpec {
            path: path.to_owned(),
            executable: false,
            archive,
            size: None,
            max_bytes: DEFAULT_MAX_BYTES,
        }
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| is_temporary(n))
            .collect()
    }

    #[test]
    fn uploads_land_whole_or_not_at_all() {
        let (tmp, ws) = workspace();
        let stop = AtomicBool::new(false);
        let root = tmp.path().join("ws");
        std::fs::write(root.join("f"), b"old").unwrap();
        // Broken off: the old file stays and no temporary is left.
        let mut rx = send_all(vec![UploadPart::Data(b"new".to_vec())]);
        let err = upload(&ws, &spec("f", false), &mut rx, &stop, None).unwrap_err();
        assert_eq!(err.reason, TransferReason::Incomplete, "{err}");
        assert_eq!(std::fs::read(root.join("f")).unwrap(), b"old");
        assert!(leftovers(&root).is_empty());
        // A wrong total is refused too.
        let mut rx = send_all(vec![UploadPart::Data(b"new".to_vec()), UploadPart::End(4)]);
        let err = upload(&ws, &spec("f", false), &mut rx, &stop, None).unwrap_err();
        assert_eq!(err.reason, TransferReason::Incomplete);
        // Over the cap.
        let mut capped = spec("f", false);
        capped.max_bytes = 4;
        let mut rx = send_all(vec![
            UploadPart::Data(b"abc".to_vec()),
            UploadPart::Data(b"de".to_vec()),
            UploadPart::End(5),
        ]);
        let err = upload(&ws, &capped, &mut rx, &stop, None).unwrap_err();
        assert_eq!(err.reason, TransferReason::FileTooLarge);
        capped.size = Some(5);
        let mut rx = send_all(vec![]);
        let err = upload(&ws, &capped, &mut rx, &stop, None).unwrap_err();
        assert_eq!(err.reason, TransferReason::FileTooLarge);
        // More than the disk holds, announced.
        let mut huge = spec("f", false);
        huge.max_bytes = u64::MAX;
        huge.size = Some(u64::MAX / 2);
        let mut rx = send_all(vec![]);
        let err = upload(&ws, &huge, &mut rx, &stop, None).unwrap_err();
        assert_eq!(err.reason, TransferReason::InsufficientStorage, "{err}");
        assert_eq!(std::fs::read(root.join("f")).unwrap(), b"old");
        assert!(leftovers(&root).is_empty());
        // Complete.
        let mut rx = send_all(vec![
            UploadPart::Data(b"ne".to_vec()),
            UploadPart::Data(b"w".to_vec()),
            UploadPart::End(3),
        ]);
        let mut exec = spec("f", false);
        exec.executable = true;
        let done = upload(&ws, &exec, &mut rx, &stop, None).unwrap();
        assert_eq!(
            done,
            Uploaded {
                size_bytes: 3,
                files: 1
            }
        );
        assert_eq!(std::fs::read(root.join("f")).unwrap(), b"new");
        let mode = std::fs::metadata(root.join("f"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
        // A directory is not replaced by a file.
        std::fs::create_dir(root.join("d")).unwrap();
        let mut rx = send_all(vec![UploadPart::End(0)]);
        let err = upload(&ws, &spec("d", false), &mut rx, &stop, None).unwrap_err();
        assert_eq!(err.reason, TransferReason::IsADirectory);
    }

    #[test]
    fn uploads_never_leave_the_workspace() {
        let (tmp, ws) = workspace();
        let stop = AtomicBool::new(false);
        let root = tmp.path().join("ws");
        std::os::unix::fs::symlink(tmp.path(), root.join("out")).unwrap();
        let mut rx = send_all(vec![UploadPart::Data(b"x".to_vec()), UploadPart::End(1)]);
        let err = upload(&ws, &spec("out/x", false), &mut rx, &stop, None).unwrap_err();
        assert_eq!(err.reason, TransferReason::PathEscapes, "{err}");
        assert!(!tmp.path().join("x").exists());
        // A final symlink is replaced by the file, never written through.
        std::fs::write(tmp.path().join("secret"), b"outside").unwrap();
        std::os::unix::fs::symlink(tmp.path().join("secret"), root.join("link")).unwrap();
        let mut rx = send_all(vec![UploadPart::Data(b"x".to_vec()), UploadPart::End(1)]);
        upload(&ws, &spec("link", false), &mut rx, &stop, None).unwrap();
        assert_eq!(
            std::fs::read(tmp.path().join("secret")).unwrap(),
            b"outside"
        );
        assert!(!root.join("link").is_symlink());
    }

    fn tar_of(build: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        build(&mut builder);
        builder.into_inner().unwrap()
    }

    fn entry(
        builder: &mut tar::Builder<Vec<u8>>,
        kind: tar::EntryType,
        name: &[u8],
        link: &[u8],
        data: &[u8],
    ) {
        let mut header = tar::Header::new_old();
        header.set_entry_type(kind);
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        // Written raw: the tar crate's setters refuse the hostile names this test needs.
        let bytes = header.as_old_mut();
        bytes.name[..name.len()].copy_from_slice(name);
        bytes.linkname[..link.len()].copy_from_slice(link);
        header.set_cksum();
        builder.append(&header, data).unwrap();
    }

    fn upload_tar(ws: &Dir, path: &str, bytes: Vec<u8>) -> Result<Uploaded, TransferError> {
        let stop = AtomicBool::new(false);
        let len = bytes.len() as u64;
        let mut rx = send_all(vec![UploadPart::Data(bytes), UploadPart::End(len)]);
        upload(ws, &spec(path, true), &mut rx, &stop, None)
    }

    #[test]
    fn archives_extract_confined() {
        use tar::EntryType::*;
        let (tmp, ws) = workspace();
        let root = tmp.path().join("ws");
        let good = tar_of(|b| {
            entry(b, Directory, b"./", b"", b"");
            entry(b, Directory, b"./src/", b"", b"");
            entry(b, Regular, b"./src/main.rs", b"", b"fn main() {}");
            entry(b, Regular, b"deep/er/file", b"", b"x");
            entry(b, Symlink, b"src/link", b"main.rs", b"");
            entry(b, Symlink, b"src/up", b"../deep", b"");
            entry(b, Link, b"src/hard", b"src/main.rs", b"");
        });
        let done = upload_tar(&ws, "repo", good).unwrap();
        assert_eq!(done.files, 2);
        assert_eq!(
            std::fs::read(root.join("repo/src/main.rs")).unwrap(),
            b"fn main() {}"
        );
        assert_eq!(
            std::fs::read(root.join("repo/src/link")).unwrap(),
            b"fn main() {}"
        );
        assert_eq!(
            std::fs::read(root.join("repo/src/hard")).unwrap(),
            b"fn main() {}"
        );
        assert_eq!(
            std::fs::read(root.join("repo/src/up/er/file")).unwrap(),
            b"x"
        );
        // Not into a directory that holds something.
        let again = tar_of(|b| entry(b, Regular, b"a", b"", b"a"));
        let err = upload_tar(&ws, "repo", again).unwrap_err();
        assert_eq!(err.reason, TransferReason::DirectoryNotEmpty);

        let hostile: Vec<(&str, Vec<u8>)> = vec![
            ("dotdot", tar_of(|b| entry(b, Regular, b"../x", b"", b"x"))),
            (
                "inner dotdot",
                tar_of(|b| entry(b, Regular, b"a/../../x", b"", b"x")),
            ),
            (
                "absolute",
                tar_of(|b| entry(b, Regular, b"/etc/x", b"", b"x")),
            ),
            (
                "symlink to /",
                tar_of(|b| {
                    entry(b, Symlink, b"root", b"/", b"");
                    entry(b, Regular, b"root/tmp/x", b"", b"x");
                }),
            ),
            (
                "symlink up",
                tar_of(|b| entry(b, Symlink, b"up", b"..", b"")),
            ),
            (
                "symlink up later",
                tar_of(|b| {
                    entry(b, Directory, b"s/", b"", b"");
                    entry(b, Symlink, b"s/up", b"..", b"");
                    entry(b, Symlink, b"x", b"s/up/..", b"");
                }),
            ),
            (
                "through a symlink",
                tar_of(|b| {
                    entry(b, Directory, b"s/", b"", b"");
                    entry(b, Symlink, b"s/up", b"..", b"");
                    entry(b, Symlink, b"s/up/l", b"../..", b"");
                }),
            ),
            (
                "hardlink out",
                tar_of(|b| entry(b, Link, b"h", b"../secret", b"")),
            ),
            (
                "hardlink absolute",
                tar_of(|b| entry(b, Link, b"h", b"/etc/passwd", b"")),
            ),
            ("device", tar_of(|b| entry(b, Char, b"null", b"", b""))),
            ("fifo", tar_of(|b| entry(b, Fifo, b"pipe", b"", b""))),
            ("garbage", vec![0x55u8; 1024]),
        ];
        std::fs::write(tmp.path().join("secret"), b"outside").unwrap();
        for (what, bytes) in hostile {
            let err = upload_tar(&ws, "bad", bytes).unwrap_err();
            assert!(
                matches!(
                    err.reason,
                    TransferReason::InvalidArchive | TransferReason::PathEscapes
                ),
                "{what}: {err:?}"
            );
            assert!(!root.join("bad").exists(), "{what}");
            assert!(leftovers(&root).is_empty(), "{what}");
        }
        let outside: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(outside.len(), 2, "{outside:?}");
        assert!(!Path::new("/etc/x").exists());
        assert_eq!(
            std::fs::read(tmp.path().join("secret")).unwrap(),
            b"outside"
        );
    }

    /// What `tar::Builder::append_dir_all(".", dir)` makes (the SDK's directory uploads).
    #[test]
    fn archives_of_append_dir_all_extract() {
        let (tmp, ws) = workspace();
        let src = tmp.path().join("src");
        std::fs::create_dir_all(src.join("a/b")).unwrap();
        std::fs::write(src.join("a/b/f"), vec![5u8; 3 << 20]).unwrap();
        std::fs::write(src.join("x.sh"), b"echo").unwrap();
        std::os::unix::fs::symlink("x.sh", src.join("link")).unwrap();
        let mut builder = tar::Builder::new(Vec::new());
        builder.follow_symlinks(false);
        builder.mode(tar::HeaderMode::Deterministic);
        builder.append_dir_all(".", &src).unwrap();
        let bytes = builder.into_inner().unwrap();
        let done = upload_tar(&ws, "repo", bytes).unwrap();
        assert_eq!(done.files, 2);
        let root = tmp.path().join("ws");
        assert_eq!(std::fs::read(root.join("repo/link")).unwrap(), b"echo");
    }

    #[test]
    fn downloads_stream_files_and_trees() {
        let (tmp, ws) = workspace();
        let root = tmp.path().join("ws");
        std::fs::create_dir_all(root.join("d/e")).unwrap();
        let big: Vec<u8> = (0..(CHUNK_BYTES * 2 + 5))
            .map(|i| (i % 251) as u8)
            .collect();
        std::fs::write(root.join("d/big"), &big).unwrap();
        std::fs::write(root.join("d/e/small"), b"s").unwrap();
        std::os::unix::fs::symlink("/etc", root.join("d/out")).unwrap();
        let stop = AtomicBool::new(false);
        let collect = |path: &str, archive: bool| {
            let (tx, mut rx) = mpsc::channel(1024);
            let result = download(&ws, path, archive, &tx, &stop);
            drop(tx);
            let mut header = None;
            let mut data = Vec::new();
            while let Some(part) = rx.blocking_recv() {
                match part.unwrap() {
                    DownloadPart::Header(h) => header = Some(h),
                    DownloadPart::Data(d) => {
                        assert!(d.len() <= CHUNK_BYTES);
                        data.extend(d);
                    }
                }
            }
            result.map(|()| (header.unwrap(), data))
        };
        let (header, data) = collect("d/big", false).unwrap();
        assert_eq!(header.size_bytes, big.len() as u64);
        assert_eq!(data, big);
        assert!(collect("d", false).unwrap().0.directory);
        let (_, tarball) = collect("d", true).unwrap();
        let mut archive = tar::Archive::new(tarball.as_slice());
        let mut names = Vec::new();
        for entry in archive.entries().unwrap() {
            let entry = entry.unwrap();
            names.push(String::from_utf8(entry.path_bytes().into_owned()).unwrap());
        }
        assert_eq!(names, ["big", "e/", "e/small", "out"]);
        // Round trip through an upload.
        let err = collect("d/big", true).unwrap_err();
        assert_eq!(err.reason, TransferReason::NotADirectory);
        std::fs::remove_file(root.join("d/out")).unwrap();
        let (_, tarball) = collect("d", true).unwrap();
        upload_tar(&ws, "copy", tarball).unwrap();
        assert_eq!(std::fs::read(root.join("copy/big")).unwrap(), big);
        assert_eq!(std::fs::read(root.join("copy/e/small")).unwrap(), b"s");
    }
}
