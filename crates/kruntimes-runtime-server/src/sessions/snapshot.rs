//! Snapshots of a session's files (`CaptureSession`, `RestoreSession` of `runtime.proto`):
//! what a durable session keeps while it is suspended.
//!
//! Owns the blocking half of both: a capture walks the workspace and the artifacts
//! directory (never following a symlink) into one zstd-compressed tar, sent in chunks of at
//! most [`transfer::CHUNK_BYTES`] and followed by a [`Summary`]; a restore decompresses an
//! uploaded snapshot through the same confined extractor as archive uploads
//! ([`transfer::extract`], with each entry's mode and mtime kept and hard links refused)
//! into a staging directory of the session, then moves it into place.
//!
//! - The archive's entries are `workspace/...` and `artifacts/...` in byte-wise order of
//!   their names, with permission bits (0777) and mtimes (seconds) and owner 0: the same
//!   files give the same bytes. Regular files, directories and symlinks only; sockets,
//!   FIFOs, devices, names that are not UTF-8, upload temporaries (`.krt-upload-*`) and
//!   symlinks a restore would refuse (an absolute target, or one that climbs out of its
//!   tree) are left out and counted as skipped.
//! - The session's TMPDIR is beside the workspace, not in it: it is never captured.
//! - A restore writes nothing into the workspace or the artifacts directory until the whole
//!   stream arrived, matched its digest, and was extracted (not synced: the durable copy is
//!   the Snapshot in the store, and a live workspace is never synced either). The two directories
//!   themselves are kept (a `namespaces` sandbox binds them by inode, at registration):
//!   their children are replaced, by renames within the session's directory.
#![forbid(unsafe_code)]

use std::io::{Read, Write};
use std::path::Path;
use std::sync::atomic::AtomicBool;

use cap_std::fs::{Dir, PermissionsExt as _};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use super::files;
use super::paths;
use super::transfer::{
    self, CHUNK_BYTES, Exact, ExtractRules, Incoming, TEMP_PREFIX, Temp, TransferError,
    TransferReason, UploadPart,
};

pub use kruntimes_proto::snapshot_caps::{DEFAULT_MAX_BYTES, DEFAULT_MAX_FILES};
/// The zstd level of a capture: fast (a 1 MiB workspace captures in a few milliseconds).
pub const ZSTD_LEVEL: i32 = 1;
/// A restore's decoder allocates at most a window of 2^this bytes (the encoder's level 1
/// uses far less); a stream that asks for more is refused.
const WINDOW_LOG_MAX: u32 = 24;
/// The roots of a snapshot, in the order they are archived.
pub const ROOTS: [&str; 2] = ["artifacts", "workspace"];
/// The prefix of a restore's staging directory, in the session's directory.
pub const STAGE_PREFIX: &str = ".krt-restore-";

/// What a capture or a restore may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of regular files, uncompressed.
    pub max_bytes: u64,
    /// Entries, the roots included.
    pub max_files: u64,
}

impl Limits {
    /// The caps of a request, 0 meaning the default.
    pub fn new(max_bytes: u64, max_files: u64) -> Self {
        let (max_bytes, max_files) =
            kruntimes_proto::snapshot_caps::effective(max_bytes, max_files);
        Self {
            max_bytes,
            max_files,
        }
    }

    /// The most bytes the compressed stream, and the decompressed tar, may hold
    /// ([`kruntimes_proto::snapshot_caps::stream_bytes`], which runtimed applies too).
    fn stream_bytes(&self) -> u64 {
        kruntimes_proto::snapshot_caps::stream_bytes(self.max_bytes, self.max_files)
    }
}

/// The kind of a manifest entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    File,
    Directory,
    Symlink,
}

/// One entry of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestEntry {
    /// As in the archive, without a trailing slash.
    pub path: String,
    pub kind: EntryKind,
    pub size_bytes: u64,
    pub mode: u32,
    pub mtime_seconds: i64,
    /// `sha256:<hex>` of a regular file's content; empty otherwise.
    pub digest: String,
    /// A symlink's target; empty otherwise.
    pub link_target: String,
}

/// The end of a capture.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Summary {
    pub size_bytes: u64,
    pub compressed_bytes: u64,
    pub files: u64,
    pub skipped: u64,
    /// `sha256:<hex>` of the compressed stream as sent.
    pub digest: String,
    pub manifest: Vec<ManifestEntry>,
}

/// One part of a capture.
#[derive(Debug)]
pub enum CapturePart {
    Data(Vec<u8>),
    Summary(Summary),
}

/// What a restore wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Restored {
    /// Entries, the roots included.
    pub files: u64,
    pub size_bytes: u64,
}

fn sha256_text(digest: Sha256) -> String {
    format!("sha256:{}", hex::encode(digest.finalize()))
}

/// Parses `sha256:<64 hex digits>`.
pub fn parse_digest(text: &str) -> Option<[u8; 32]> {
    let hex_digits = text.strip_prefix("sha256:")?;
    let mut out = [0u8; 32];
    hex::decode_to_slice(hex_digits, &mut out).ok()?;
    Some(out)
}

// ---------------------------------------------------------------------------------------
// Capture

/// The compressed stream on its way out: chunks of at most [`CHUNK_BYTES`], hashed and
/// counted as sent.
struct Outgoing<'a> {
    send: &'a mut dyn FnMut(CapturePart) -> Result<(), TransferError>,
    buffer: Vec<u8>,
    digest: Sha256,
    sent: u64,
    /// Why sending failed (the caller left, the session closed): io errors lose it.
    failure: Option<TransferError>,
}

impl Outgoing<'_> {
    fn send(&mut self, data: Vec<u8>) -> std::io::Result<()> {
        self.digest.update(&data);
        self.sent += data.len() as u64;
        (self.send)(CapturePart::Data(data)).map_err(|e| {
            let message = e.message.clone();
            self.failure.get_or_insert(e);
            std::io::Error::other(message)
        })
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

/// A reader that hashes what passes through it.
struct Hashing<R> {
    inner: R,
    digest: Sha256,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.digest.update(&buf[..n]);
        Ok(n)
    }
}

/// The walk of a capture: the caps, the counts and the manifest.
struct Walk<'a, W: Write> {
    builder: tar::Builder<W>,
    limits: Limits,
    stop: &'a AtomicBool,
    summary: Summary,
}

fn mtime_of(meta: &cap_std::fs::Metadata) -> i64 {
    use cap_std::fs::MetadataExt as _;
    meta.mtime()
}

impl<W: Write> Walk<'_, W> {
    fn count(&mut self, path: &str) -> Result<(), TransferError> {
        if self.stop.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(TransferError::new(
                TransferReason::Stopped,
                "the session closed during the capture",
            ));
        }
        if self.summary.files >= self.limits.max_files {
            return Err(TransferError::new(
                TransferReason::SnapshotTooLarge,
                format!(
                    "{path:?}: the session holds more than {} entries",
                    self.limits.max_files
                ),
            ));
        }
        self.summary.files += 1;
        Ok(())
    }

    fn header(kind: tar::EntryType, mode: u32, mtime: i64, size: u64) -> tar::Header {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_mtime(u64::try_from(mtime).unwrap_or(0));
        header.set_uid(0);
        header.set_gid(0);
        header.set_size(size);
        header
    }

    fn directory(&mut self, path: &str, meta: &cap_std::fs::Metadata) -> std::io::Result<()> {
        let mode = meta.permissions().mode() & 0o777;
        let mtime = mtime_of(meta);
        let mut header = Self::header(tar::EntryType::Directory, mode, mtime, 0);
        self.builder
            .append_data(&mut header, format!("{path}/"), std::io::empty())?;
        self.summary.manifest.push(ManifestEntry {
            path: path.to_owned(),
            kind: EntryKind::Directory,
            size_bytes: 0,
            mode,
            mtime_seconds: mtime.max(0),
            digest: String::new(),
            link_target: String::new(),
        });
        Ok(())
    }

    /// Appends the entries beneath `dir` (named `prefix` in the archive; `depth` below its
    /// root) in byte-wise order of their names.
    fn tree(&mut self, dir: &Dir, prefix: &str, depth: usize) -> Result<(), TransferError> {
        let failed = |e: std::io::Error| TransferError::io(prefix, &e);
        if depth >= transfer::MAX_ARCHIVE_DEPTH {
            return Err(TransferError::new(
                TransferReason::SnapshotTooLarge,
                format!(
                    "{prefix:?}: the directory is deeper than {} levels",
                    transfer::MAX_ARCHIVE_DEPTH
                ),
            ));
        }
        let mut names: Vec<String> = Vec::new();
        for entry in dir.entries().map_err(failed)? {
            let entry = entry.map_err(failed)?;
            match entry.file_name().into_string() {
                Ok(name) if !name.starts_with(TEMP_PREFIX) => names.push(name),
                _ => self.summary.skipped += 1,
            }
        }
        names.sort_unstable();
        for name in names {
            let path = paths::join(prefix, &name);
            let failed = |e: std::io::Error| TransferError::io(&path, &e);
            let meta = match dir.symlink_metadata(&name) {
                Ok(meta) => meta,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(failed(e)),
            };
            let file_type = meta.file_type();
            if file_type.is_dir() {
                self.count(&path)?;
                self.directory(&path, &meta).map_err(failed)?;
                let child = transfer::open_dir_handle(dir, &name).map_err(failed)?;
                self.tree(&child, &path, depth + 1)?;
            } else if file_type.is_symlink() {
                let target = dir.read_link_contents(&name).map_err(failed)?;
                let Some(text) = target.to_str() else {
                    self.summary.skipped += 1;
                    continue;
                };
                // Relative to its root, as a restore checks it.
                let inside = path.split_once('/').map_or("", |(_, rest)| rest);
                if transfer::check_link_target(inside, text.as_bytes()).is_err() {
                    self.summary.skipped += 1;
                    continue;
                }
                self.count(&path)?;
                let mtime = mtime_of(&meta);
                let mut header = Self::header(tar::EntryType::Symlink, 0o777, mtime, 0);
                self.builder
                    .append_link(&mut header, &path, text)
                    .map_err(failed)?;
                self.summary.manifest.push(ManifestEntry {
                    path,
                    kind: EntryKind::Symlink,
                    size_bytes: 0,
                    mode: 0o777,
                    mtime_seconds: mtime.max(0),
                    digest: String::new(),
                    link_target: text.to_owned(),
                });
            } else if file_type.is_file() {
                let file = match transfer::open_read(dir, &name, false) {
                    Ok(file) => file,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(failed(e)),
                };
                let meta = file.metadata().map_err(failed)?;
                if !meta.is_file() {
                    self.summary.skipped += 1;
                    continue;
                }
                self.count(&path)?;
                let size = meta.len();
                if self.summary.size_bytes.saturating_add(size) > self.limits.max_bytes {
                    return Err(TransferError::new(
                        TransferReason::SnapshotTooLarge,
                        format!(
                            "{path:?}: the session's files are larger than the limit of {} bytes",
                            self.limits.max_bytes
                        ),
                    ));
                }
                let mode = meta.permissions().mode() & 0o777;
                let mtime = mtime_of(&meta);
                let mut header = Self::header(tar::EntryType::Regular, mode, mtime, size);
                let mut reader = Hashing {
                    inner: Exact {
                        inner: file.into_std(),
                        remaining: size,
                    },
                    digest: Sha256::new(),
                };
                self.builder
                    .append_data(&mut header, &path, &mut reader)
                    .map_err(failed)?;
                self.summary.size_bytes += size;
                self.summary.manifest.push(ManifestEntry {
                    path,
                    kind: EntryKind::File,
                    size_bytes: size,
                    mode,
                    mtime_seconds: mtime.max(0),
                    digest: sha256_text(reader.digest),
                    link_target: String::new(),
                });
            } else {
                self.summary.skipped += 1;
            }
        }
        Ok(())
    }
}

/// Captures the session's directory `session_dir` (its `workspace` and `artifacts`, either
/// left out when it does not exist): every chunk, then the summary, go to `send`
/// (blocking; run off the async threads).
/// `send` fails when the caller left or the session closes, which ends the capture.
pub fn capture(
    session_dir: &Path,
    limits: Limits,
    stop: &AtomicBool,
    send: &mut dyn FnMut(CapturePart) -> Result<(), TransferError>,
) -> Result<(), TransferError> {
    let session = files::open_workspace(session_dir).map_err(|e| TransferError::io(".", &e))?;
    let mut out = Outgoing {
        send,
        buffer: Vec::with_capacity(CHUNK_BYTES),
        digest: Sha256::new(),
        sent: 0,
        failure: None,
    };
    let result = (|| {
        let encoder = zstd::stream::write::Encoder::new(&mut out, ZSTD_LEVEL)
            .map_err(|e| TransferError::io(".", &e))?;
        let mut builder = tar::Builder::new(encoder);
        builder.mode(tar::HeaderMode::Complete);
        let mut walk = Walk {
            builder,
            limits,
            stop,
            summary: Summary::default(),
        };
        for root in ROOTS {
            let failed = |e: std::io::Error| TransferError::io(root, &e);
            // A command may remove the artifacts directory: nothing to keep of it.
            let dir = match transfer::open_dir_handle(&session, root) {
                Ok(dir) => dir,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(failed(e)),
            };
            let meta = dir.dir_metadata().map_err(failed)?;
            walk.count(root)?;
            walk.directory(root, &meta).map_err(failed)?;
            walk.tree(&dir, root, 0)?;
        }
        let failed = |e: std::io::Error| TransferError::io(".", &e);
        let encoder = walk.builder.into_inner().map_err(failed)?;
        encoder.finish().map_err(failed)?;
        Ok(walk.summary)
    })();
    let mut summary = match result {
        Ok(summary) => summary,
        Err(e) => return Err(out.failure.take().unwrap_or(e)),
    };
    if let Err(e) = out.flush() {
        return Err(out
            .failure
            .take()
            .unwrap_or_else(|| TransferError::io(".", &e)));
    }
    summary.compressed_bytes = out.sent;
    summary.digest = sha256_text(std::mem::take(&mut out.digest));
    (out.send)(CapturePart::Summary(summary))
}

// ---------------------------------------------------------------------------------------
// Restore

/// The decompressed stream, cut at `remaining` bytes (a zip bomb stops there); what went
/// wrong reading it is kept in `failure` (errors that pass through the tar reader lose
/// their type).
struct Bounded<R> {
    inner: R,
    remaining: u64,
    failure: Option<TransferError>,
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = match self.inner.read(buf) {
            Ok(n) => n,
            Err(e) => {
                // Reading fails for the stream's sake (not zstd, cut short), never the
                // disk's: said so here, before the extractor takes it for a write error.
                self.failure.get_or_insert_with(|| {
                    TransferError::new(
                        TransferReason::SnapshotInvalid,
                        format!("the snapshot cannot be decompressed: {e}"),
                    )
                });
                return Err(e);
            }
        };
        if n as u64 > self.remaining {
            let e = TransferError::new(
                TransferReason::SnapshotInvalid,
                "the snapshot decompresses to more than its caps allow",
            );
            let message = e.message.clone();
            self.failure.get_or_insert(e);
            return Err(std::io::Error::other(message));
        }
        self.remaining -= n as u64;
        Ok(n)
    }
}

/// A refused snapshot is `SnapshotInvalid`, whatever part of it was refused; a full disk,
/// a close and an internal failure keep their reasons.
fn invalid(e: TransferError) -> TransferError {
    match e.reason {
        TransferReason::InsufficientStorage | TransferReason::Stopped | TransferReason::IoError => {
            e
        }
        _ => TransferError::new(TransferReason::SnapshotInvalid, e.message),
    }
}

/// Renames `name` from one directory to another, recorded so that it can be undone.
struct Moves<'a> {
    done: Vec<(&'a Dir, &'a Dir, std::ffi::OsString)>,
}

impl<'a> Moves<'a> {
    fn all(&mut self, from: &'a Dir, to: &'a Dir, what: &str) -> Result<(), TransferError> {
        let failed = |e: std::io::Error| TransferError::io(what, &e);
        let mut names = Vec::new();
        for entry in from.entries().map_err(failed)? {
            names.push(entry.map_err(failed)?.file_name());
        }
        for name in names {
            from.rename(&name, to, &name).map_err(failed)?;
            self.done.push((from, to, name));
        }
        Ok(())
    }

    fn undo(self) {
        for (from, to, name) in self.done.into_iter().rev() {
            if let Err(e) = to.rename(&name, from, &name) {
                tracing::warn!(name = ?name, error = %e, "a failed restore could not put an entry back");
            }
        }
    }
}

/// Commit: what the session's `workspace` and `artifacts` hold (what RegisterSession
/// wrote) moves into `stage` (`old-workspace`, `old-artifacts`), then the entries of
/// `incoming` (one directory per root, in [`ROOTS`] order) move into them; a failed rename
/// puts everything back. The two directories themselves are kept (a sandbox binds them).
fn commit(
    session: &Dir,
    stage: &Dir,
    incoming: &[Dir],
    owner: Option<(u32, u32)>,
) -> Result<(), TransferError> {
    let mut targets = Vec::new();
    let mut replaced = Vec::new();
    for root in ROOTS {
        // Made again when a command removed it (as registration makes it).
        match session.create_dir(root) {
            Ok(()) => {
                let made = transfer::open_dir_handle(session, root).map_err(transfer::at(root))?;
                transfer::chown_dir(&made, owner).map_err(transfer::at(root))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(TransferError::io(root, &e)),
        }
        targets.push(transfer::open_dir_handle(session, root).map_err(transfer::at(root))?);
        let old = format!("old-{root}");
        stage.create_dir(&old).map_err(transfer::at(root))?;
        replaced.push(transfer::open_dir_handle(stage, &old).map_err(transfer::at(root))?);
    }
    let mut moves = Moves { done: Vec::new() };
    let mut run = || -> Result<(), TransferError> {
        for (i, root) in ROOTS.iter().enumerate() {
            moves.all(&targets[i], &replaced[i], root)?;
        }
        for (i, root) in ROOTS.iter().enumerate() {
            moves.all(&incoming[i], &targets[i], root)?;
        }
        Ok(())
    };
    if let Err(e) = run() {
        moves.undo();
        return Err(e);
    }
    Ok(())
}

/// Moves parked files (`parked`, holding `workspace` and `artifacts` as a session's
/// directory does: see [`super::parked`]) into the freshly registered session's directory
/// `session_dir`, as a restore's commit moves extracted ones (blocking). On failure the
/// session's files are as they were, and what was moved is put back.
pub fn adopt(
    session_dir: &Path,
    parked: &Path,
    owner: Option<(u32, u32)>,
) -> Result<(), TransferError> {
    let session = files::open_workspace(session_dir).map_err(|e| TransferError::io(".", &e))?;
    let from = files::open_workspace(parked).map_err(|e| TransferError::io("parked", &e))?;
    let mut incoming = Vec::new();
    for root in ROOTS {
        incoming.push(transfer::open_dir_handle(&from, root).map_err(transfer::at(root))?);
    }
    // Removed whatever happens: afterwards it holds what the parked files replaced.
    let (_stage_guard, stage) = staging(&session)?;
    commit(&session, &stage, &incoming, owner)
}

/// A new staging directory in the session's directory `session` (`.krt-restore-*`), and
/// the guard that removes it whatever happens.
fn staging(session: &Dir) -> Result<(Temp<'_>, Dir), TransferError> {
    let name = format!("{STAGE_PREFIX}{:016x}", rand::random::<u64>());
    session.create_dir(&name).map_err(transfer::at("staging"))?;
    let guard = Temp {
        dir: session,
        name: name.clone(),
        is_dir: true,
        committed: false,
    };
    let stage = transfer::open_dir_handle(session, &name).map_err(transfer::at("staging"))?;
    Ok((guard, stage))
}

/// Receives a snapshot into the session's directory `session_dir` (blocking; run off the
/// async threads): `rx` carries its data and `end`. `digest`, when given, must be the
/// SHA-256 of the compressed stream. On any failure the workspace and artifacts are as
/// they were and the staging directory is removed.
pub fn restore(
    session_dir: &Path,
    limits: Limits,
    digest: Option<[u8; 32]>,
    rx: &mut mpsc::Receiver<UploadPart>,
    stop: &AtomicBool,
    owner: Option<(u32, u32)>,
) -> Result<Restored, TransferError> {
    restore_inner(session_dir, limits, digest, rx, stop, owner).map_err(invalid)
}

fn restore_inner(
    session_dir: &Path,
    limits: Limits,
    digest: Option<[u8; 32]>,
    rx: &mut mpsc::Receiver<UploadPart>,
    stop: &AtomicBool,
    owner: Option<(u32, u32)>,
) -> Result<Restored, TransferError> {
    let started = std::time::Instant::now();
    let session = files::open_workspace(session_dir).map_err(|e| TransferError::io(".", &e))?;
    // Removed whatever happens: after a restore it holds what the snapshot replaced.
    let (_stage_guard, stage) = staging(&session)?;
    let mut staged = Vec::new();
    for root in ROOTS {
        stage.create_dir(root).map_err(transfer::at(root))?;
        let dir = transfer::open_dir_handle(&stage, root).map_err(transfer::at(root))?;
        transfer::chown_dir(&dir, owner).map_err(transfer::at(root))?;
        staged.push(dir);
    }
    let mut incoming = Incoming::new(rx, stop, "snapshot", limits.stream_bytes());
    incoming.digest = digest.map(|_| Sha256::new());
    let extracted = {
        let broken = |e: std::io::Error| {
            TransferError::new(
                TransferReason::SnapshotInvalid,
                format!("the snapshot is not a zstd stream: {e}"),
            )
        };
        let mut decoder = zstd::stream::read::Decoder::new(&mut incoming).map_err(broken)?;
        decoder.window_log_max(WINDOW_LOG_MAX).map_err(broken)?;
        let mut bounded = Bounded {
            inner: decoder,
            remaining: limits.stream_bytes(),
            failure: None,
        };
        let rules = ExtractRules {
            roots: &[(ROOTS[0], &staged[0]), (ROOTS[1], &staged[1])],
            owner,
            exact: true,
            max_entries: limits.max_files,
            max_bytes: limits.max_bytes,
        };
        let result = transfer::extract(&mut bounded, &rules).and_then(|done| {
            // The rest of the zstd stream after the archive's end (its padding).
            std::io::copy(&mut bounded, &mut std::io::sink())
                .map(|_| done)
                .map_err(broken)
        });
        match result {
            Ok(done) => done,
            Err(e) => {
                let first = bounded.failure.take();
                drop(bounded);
                return Err(incoming.failure.take().or(first).unwrap_or(e));
            }
        }
    };
    incoming.finish()?;
    let extracted_at = started.elapsed();
    if let (Some(expected), Some(got)) = (digest, incoming.digest.take()) {
        let got: [u8; 32] = got.finalize().into();
        if got != expected {
            return Err(TransferError::new(
                TransferReason::SnapshotInvalid,
                format!(
                    "the snapshot's digest is sha256:{}, not the sha256:{} expected",
                    hex::encode(got),
                    hex::encode(expected)
                ),
            ));
        }
    }
    // Not synced: a restored workspace is a live session's files, which nothing syncs while
    // the session runs either. What must survive a crash of this machine is the Snapshot,
    // durable in the store; a session whose worker went down is resumed from there or ends.
    // A syncfs here flushed every dirty page of the filesystem, other sessions' too, on the
    // resume's path.
    commit(&session, &stage, &staged, owner)?;
    // Where a resume's time goes (bench-sessions reads these at debug level).
    tracing::debug!(
        extract_ms = extracted_at.as_secs_f64() * 1e3,
        commit_ms = (started.elapsed() - extracted_at).as_secs_f64() * 1e3,
        "snapshot extracted"
    );
    Ok(Restored {
        files: extracted.entries,
        size_bytes: extracted.bytes,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn digests_and_limits_parse() {
        let hex_digits = "ab".repeat(32);
        assert_eq!(
            parse_digest(&format!("sha256:{hex_digits}")),
            Some([0xab; 32])
        );
        for bad in [
            "",
            "sha256:",
            "sha256:abc",
            "md5:00",
            &format!("sha256:{hex_digits}00"),
            &format!("SHA256:{hex_digits}"),
            &format!("sha256:{}", "zz".repeat(32)),
        ] {
            assert_eq!(parse_digest(bad), None, "{bad:?}");
        }
        let limits = Limits::new(0, 0);
        assert_eq!(
            (limits.max_bytes, limits.max_files),
            (DEFAULT_MAX_BYTES, DEFAULT_MAX_FILES)
        );
        let limits = Limits::new(u64::MAX, u64::MAX);
        assert_eq!(limits.stream_bytes(), u64::MAX);
        assert!(Limits::new(1, 1).stream_bytes() > 4096);
    }
}
