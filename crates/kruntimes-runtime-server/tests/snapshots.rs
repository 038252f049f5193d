//! End-to-end tests of session snapshots (`CaptureSession`, `RestoreSession`) in the
//! `kruntimes-runtime-server` binary: real sessions in the server's default sandbox, a real
//! Unix socket, temporary directories. The files a snapshot holds are made on the host, in
//! the session's directory (the test runs as the server's user), so that their modes and
//! mtimes are exactly known. Synchronisation uses the server's answers, with a deadline.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, UNIX_EPOCH};

use common::{DEADLINE, TestServer, new_id};
use kruntimes_proto::runtime::v1 as pb;
use pb::capture_session_response::Part as CapturePart;
use pb::restore_session_request::Part as RestorePart;
use pb::session_operation_request::Operation;
use sha2::{Digest, Sha256};
use tokio_stream::StreamExt;

const MIB: usize = 1024 * 1024;

async fn start() -> TestServer {
    TestServer::start_with(
        tempfile::tempdir().unwrap(),
        "bash",
        &["--session-termination-grace", "400ms"],
    )
    .await
}

/// Registers a session with `files`; returns its ID and its directory on the host.
async fn open(server: &TestServer, files: &[(&str, &[u8])]) -> (pb::ExecutionId, PathBuf) {
    open_as(server, new_id(), files).await
}

/// Registers the session `id` with `files`; returns its ID and its directory on the host.
async fn open_as(
    server: &TestServer,
    id: pb::ExecutionId,
    files: &[(&str, &[u8])],
) -> (pb::ExecutionId, PathBuf) {
    let status = server
        .sessions
        .clone()
        .register_session(pb::RegisterSessionRequest {
            id: Some(id.clone()),
            files: files
                .iter()
                .map(|(path, content)| pb::SourceFile {
                    path: (*path).to_owned(),
                    content: content.to_vec(),
                    executable: false,
                })
                .collect(),
            env: Vec::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.state(), pb::SessionState::Ready, "{status:?}");
    let dir = PathBuf::from(&status.workspace_dir)
        .parent()
        .unwrap()
        .to_owned();
    (id, dir)
}

fn reason(status: &tonic::Status) -> &str {
    status
        .metadata()
        .get("x-kruntimes-reason")
        .map_or("", |v| v.to_str().unwrap())
}

/// Asserts the code and the `x-kruntimes-reason` of a failure.
#[track_caller]
fn refused<T: std::fmt::Debug>(result: Result<T, tonic::Status>, code: tonic::Code, why: &str) {
    match result {
        Ok(value) => panic!("expected {code:?} {why}, got {value:?}"),
        Err(status) => {
            assert_eq!(status.code(), code, "{status:?}");
            assert_eq!(reason(&status), why, "{status:?}");
        }
    }
}

static OPERATIONS: AtomicU64 = AtomicU64::new(1);

/// Starts a shell operation; its events, or why it was refused.
async fn begin_sh(
    server: &TestServer,
    id: &pb::ExecutionId,
    line: &str,
) -> Result<tonic::Streaming<pb::SessionOperationEvent>, tonic::Status> {
    server
        .sessions
        .clone()
        .stream_session_operation(pb::SessionOperationRequest {
            id: Some(id.clone()),
            operation_id: format!("op-{}", OPERATIONS.fetch_add(1, Ordering::SeqCst)),
            operation: Some(Operation::Command(pb::Command {
                shell: line.to_owned(),
                ..Default::default()
            })),
            timeout: None,
        })
        .await
        .map(|r| r.into_inner())
}

/// Runs a shell operation to its end; its completion and stdout.
async fn sh(
    server: &TestServer,
    id: &pb::ExecutionId,
    line: &str,
) -> Result<(pb::OperationCompleted, String), tonic::Status> {
    use pb::session_operation_event::Event;
    let mut stream = begin_sh(server, id, line).await?;
    let mut stdout = Vec::new();
    let mut completed = None;
    while let Some(event) = tokio::time::timeout(DEADLINE, stream.next()).await.unwrap() {
        match event?.event.unwrap() {
            Event::Output(o) if o.stream() == pb::LogStream::Stdout => stdout.extend(o.data),
            Event::Completed(c) => completed = Some(c),
            _ => {}
        }
    }
    Ok((completed.unwrap(), String::from_utf8(stdout).unwrap()))
}

/// A captured snapshot: its bytes, as received, and its summary.
struct Captured {
    data: Vec<u8>,
    summary: pb::SnapshotSummary,
}

impl std::fmt::Debug for Captured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes, {:?}", self.data.len(), self.summary.digest)
    }
}

async fn start_capture(
    server: &TestServer,
    id: &pb::ExecutionId,
    max_bytes: u64,
    max_files: u64,
) -> Result<tonic::Streaming<pb::CaptureSessionResponse>, tonic::Status> {
    server
        .sessions
        .clone()
        .capture_session(pb::CaptureSessionRequest {
            id: Some(id.clone()),
            max_bytes,
            max_files,
        })
        .await
        .map(|r| r.into_inner())
}

async fn capture_with(
    server: &TestServer,
    id: &pb::ExecutionId,
    max_bytes: u64,
    max_files: u64,
) -> Result<Captured, tonic::Status> {
    let mut stream = start_capture(server, id, max_bytes, max_files).await?;
    let mut data = Vec::new();
    let mut summary = None;
    while let Some(part) = tokio::time::timeout(DEADLINE, stream.next()).await.unwrap() {
        assert!(summary.is_none(), "a part after the summary");
        match part?.part.unwrap() {
            CapturePart::Data(chunk) => {
                assert!(chunk.len() <= MIB, "{}", chunk.len());
                data.extend(chunk);
            }
            CapturePart::Summary(s) => summary = Some(s),
        }
    }
    Ok(Captured {
        data,
        summary: summary.expect("a summary"),
    })
}

async fn capture(server: &TestServer, id: &pb::ExecutionId) -> Captured {
    capture_with(server, id, 0, 0).await.unwrap()
}

fn header(id: &pb::ExecutionId, max_bytes: u64, max_files: u64, digest: &str) -> RestorePart {
    RestorePart::Header(pb::RestoreHeader {
        id: Some(id.clone()),
        max_bytes,
        max_files,
        digest: digest.to_owned(),
        parked: false,
    })
}

/// The parts of a whole snapshot after its header: data in chunks of 1 MiB, then `end`.
fn body(data: &[u8]) -> Vec<RestorePart> {
    let mut parts: Vec<RestorePart> = data
        .chunks(MIB)
        .map(|c| RestorePart::Data(c.to_vec()))
        .collect();
    parts.push(RestorePart::End(pb::RestoreEnd {
        total_bytes: data.len() as u64,
    }));
    parts
}

async fn restore_parts(
    server: &TestServer,
    parts: Vec<RestorePart>,
) -> Result<pb::RestoreSessionResponse, tonic::Status> {
    let messages: Vec<pb::RestoreSessionRequest> = parts
        .into_iter()
        .map(|part| pb::RestoreSessionRequest { part: Some(part) })
        .collect();
    server
        .sessions
        .clone()
        .restore_session(tokio_stream::iter(messages))
        .await
        .map(|r| r.into_inner())
}

async fn restore(
    server: &TestServer,
    id: &pb::ExecutionId,
    data: &[u8],
    digest: &str,
) -> Result<pb::RestoreSessionResponse, tonic::Status> {
    let mut parts = vec![header(id, 0, 0, digest)];
    parts.extend(body(data));
    restore_parts(server, parts).await
}

fn sha256(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

fn set_mtime(path: &Path, seconds: i64) {
    nix::sys::stat::utimensat(
        nix::fcntl::AT_FDCWD,
        path,
        &nix::sys::time::TimeSpec::new(seconds, 0),
        &nix::sys::time::TimeSpec::new(seconds, 0),
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .unwrap();
}

/// Deterministic bytes that do not compress.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// What a tree holds: per relative path, its kind, mode, mtime and content (a symlink's
/// target).
fn tree(root: &Path) -> BTreeMap<String, (char, u32, i64, Vec<u8>)> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, (char, u32, i64, Vec<u8>)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let name = path
                .strip_prefix(root)
                .unwrap()
                .to_str()
                .unwrap()
                .to_owned();
            let mode = meta.permissions().mode() & 0o777;
            let kind = meta.file_type();
            if kind.is_dir() {
                walk(root, &path, out);
                out.insert(name, ('d', mode, meta.mtime(), Vec::new()));
            } else if kind.is_symlink() {
                let target = std::fs::read_link(&path).unwrap();
                let target = target.to_str().unwrap().as_bytes().to_vec();
                out.insert(name, ('l', 0, 0, target));
            } else if kind.is_file() {
                out.insert(
                    name,
                    ('f', mode, meta.mtime(), std::fs::read(&path).unwrap()),
                );
            } else {
                out.insert(name, ('?', mode, 0, Vec::new()));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// Fills a session's directory with every kind of entry a snapshot keeps or leaves out.
fn populate(dir: &Path) {
    let ws = dir.join("workspace");
    let artifacts = dir.join("artifacts");
    std::fs::create_dir_all(ws.join("bin")).unwrap();
    std::fs::write(ws.join("bin/run.sh"), b"#!/bin/bash\necho ran\n").unwrap();
    std::fs::set_permissions(ws.join("bin/run.sh"), PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::write(ws.join("secret"), b"only me").unwrap();
    std::fs::set_permissions(ws.join("secret"), PermissionsExt::from_mode(0o600)).unwrap();
    std::fs::write(ws.join("data"), noise(MIB, 7)).unwrap();
    for i in 0..100 {
        std::fs::create_dir_all(ws.join(format!("many/{}", i % 10))).unwrap();
        std::fs::write(ws.join(format!("many/{}/f{i}", i % 10)), format!("{i}")).unwrap();
    }
    std::fs::create_dir(ws.join("empty")).unwrap();
    std::fs::set_permissions(ws.join("empty"), PermissionsExt::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink("bin/run.sh", ws.join("rel")).unwrap();
    std::os::unix::fs::symlink("../nowhere", ws.join("bin/dangling")).unwrap();
    // Left out: upload temporaries, a FIFO, and the session's TMPDIR (beside the
    // workspace).
    std::fs::write(ws.join(".krt-upload-0123456789abcdef"), b"half").unwrap();
    std::fs::write(ws.join("bin/.krt-upload-feed"), b"half").unwrap();
    nix::unistd::mkfifo(
        &ws.join("pipe"),
        nix::sys::stat::Mode::from_bits_truncate(0o644),
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("tmp")).unwrap();
    std::fs::write(dir.join("tmp/scratch"), b"not kept").unwrap();
    std::fs::write(artifacts.join("report.txt"), b"the report").unwrap();
    // mtimes last, directories after what they hold.
    let mut stamp = 1_600_000_000;
    for path in [
        "workspace/bin/run.sh",
        "workspace/secret",
        "workspace/data",
        "artifacts/report.txt",
        "workspace/bin",
        "workspace/empty",
    ] {
        stamp += 1000;
        set_mtime(&dir.join(path), stamp);
    }
}

/// What of a populated session a restore must reproduce.
fn kept(dir: &Path) -> BTreeMap<String, (char, u32, i64, Vec<u8>)> {
    let mut all = tree(&dir.join("workspace"));
    all.retain(|name, _| !name.contains(".krt-upload-") && name != "pipe");
    for (name, entry) in tree(&dir.join("artifacts")) {
        all.insert(format!("artifacts:{name}"), entry);
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_restores_every_file_mode_mtime_and_link() {
    let server = start().await;
    let (a, a_dir) = open(&server, &[]).await;
    populate(&a_dir);
    let started = Instant::now();
    let first = capture(&server, &a).await;
    let took = started.elapsed();
    let s = &first.summary;
    assert_eq!(s.digest, sha256(&first.data));
    assert_eq!(s.compressed_bytes, first.data.len() as u64);
    // Two temporaries and the FIFO.
    assert_eq!(s.skipped, 3, "{s:?}");
    assert_eq!(s.files, s.manifest.len() as u64);
    let names: Vec<&str> = s.manifest.iter().map(|e| e.path.as_str()).collect();
    let mut sorted = names.clone();
    sorted.sort_by(|x, y| {
        // The order of the archive: each directory's children by name, after it.
        x.split('/').cmp(y.split('/'))
    });
    assert_eq!(names, sorted);
    assert_eq!(names[0], "artifacts");
    assert!(names.contains(&"workspace/empty"));
    assert!(
        !names
            .iter()
            .any(|n| n.contains("krt-upload") || n.ends_with("pipe"))
    );
    assert!(!names.iter().any(|n| n.contains("scratch")));
    let data = s
        .manifest
        .iter()
        .find(|e| e.path == "workspace/data")
        .unwrap();
    assert_eq!(data.kind(), pb::snapshot_manifest_entry::Kind::File);
    assert_eq!(data.size_bytes, MIB as u64);
    assert_eq!(data.digest, sha256(&noise(MIB, 7)));
    let secret = s
        .manifest
        .iter()
        .find(|e| e.path == "workspace/secret")
        .unwrap();
    assert_eq!(secret.mode, 0o600);
    assert_eq!(secret.mtime_seconds, 1_600_002_000);
    let rel = s
        .manifest
        .iter()
        .find(|e| e.path == "workspace/rel")
        .unwrap();
    assert_eq!(rel.kind(), pb::snapshot_manifest_entry::Kind::Symlink);
    assert_eq!(rel.link_target, "bin/run.sh");
    assert_eq!(
        s.size_bytes,
        s.manifest.iter().map(|e| e.size_bytes).sum::<u64>()
    );
    eprintln!(
        "captured {} entries, {} bytes ({} compressed) in {took:?}",
        s.files, s.size_bytes, s.compressed_bytes
    );
    // The same files, the same bytes.
    let second = capture(&server, &a).await;
    assert_eq!(second.summary.digest, first.summary.digest);
    assert_eq!(second.data, first.data);

    // Into another session, replacing what its registration wrote.
    let (b, b_dir) = open(&server, &[("registered.txt", b"replaced")]).await;
    let done = restore(&server, &b, &first.data, &first.summary.digest)
        .await
        .unwrap();
    assert_eq!(done.files, s.files);
    assert_eq!(done.size_bytes, s.size_bytes);
    assert_eq!(kept(&b_dir), kept(&a_dir));
    assert!(!b_dir.join("workspace/registered.txt").exists());
    assert!(!b_dir.join("tmp/scratch").exists());
    let leftovers: Vec<_> = std::fs::read_dir(&b_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with(".krt-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    assert!(
        std::fs::symlink_metadata(b_dir.join("workspace/bin/dangling"))
            .unwrap()
            .is_symlink()
    );
    // The restored session works, as the sandbox's user: the 0600 file is readable and
    // the script executable.
    let (completed, stdout) = sh(
        &server,
        &b,
        "cat secret; ./rel; cat ~/empty/../data | wc -c",
    )
    .await
    .unwrap();
    assert_eq!(
        completed.state(),
        pb::OperationState::Succeeded,
        "{completed:?}"
    );
    assert_eq!(stdout, format!("only meran\n{MIB}\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capture_and_operations_exclude_each_other() {
    let server = start().await;
    let (id, dir) = open(&server, &[]).await;
    // Incompressible, far more than the channel and the connection's windows hold: a
    // capture nobody reads stays blocked with the session marked.
    std::fs::write(dir.join("workspace/big"), noise(48 * MIB, 3)).unwrap();

    // Refused while an operation runs.
    let running = begin_sh(&server, &id, "sleep 60").await.unwrap();
    refused(
        start_capture(&server, &id, 0, 0).await,
        tonic::Code::FailedPrecondition,
        "OperationRunning",
    );
    drop(running);

    // Wait until the cancelled operation freed the session (polling its status).
    let deadline = Instant::now() + DEADLINE;
    let stream = loop {
        match start_capture(&server, &id, 0, 0).await {
            Ok(stream) => break stream,
            Err(status) if reason(&status) == "OperationRunning" => {
                assert!(Instant::now() < deadline, "the operation did not end");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(status) => panic!("{status:?}"),
        }
    };
    // Not read: the server is blocked on its bounded channel, the capture open.
    refused(
        begin_sh(&server, &id, "true").await,
        tonic::Code::FailedPrecondition,
        "Capturing",
    );
    refused(
        start_capture(&server, &id, 0, 0).await,
        tonic::Code::FailedPrecondition,
        "Capturing",
    );
    refused(
        server
            .sessions
            .clone()
            .download_session_file(pb::DownloadSessionFileRequest {
                id: Some(id.clone()),
                path: "big".into(),
                archive: false,
            })
            .await,
        tonic::Code::FailedPrecondition,
        "Capturing",
    );
    let upload = vec![
        pb::UploadSessionFileRequest {
            part: Some(pb::upload_session_file_request::Part::Header(
                pb::UploadHeader {
                    id: Some(id.clone()),
                    path: "new".into(),
                    ..Default::default()
                },
            )),
        },
        pb::UploadSessionFileRequest {
            part: Some(pb::upload_session_file_request::Part::End(pb::UploadEnd {
                total_bytes: 0,
            })),
        },
    ];
    refused(
        server
            .sessions
            .clone()
            .upload_session_file(tokio_stream::iter(upload))
            .await,
        tonic::Code::FailedPrecondition,
        "Capturing",
    );
    assert!(!dir.join("workspace/new").exists());
    // Dropping the stream ends the capture: the session takes operations again.
    drop(stream);
    let deadline = Instant::now() + DEADLINE;
    loop {
        match sh(&server, &id, "echo back").await {
            Ok((completed, stdout)) => {
                assert_eq!(completed.state(), pb::OperationState::Succeeded);
                assert_eq!(stdout, "back\n");
                break;
            }
            Err(status) if reason(&status) == "Capturing" => {
                assert!(Instant::now() < deadline, "the capture did not end");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(status) => panic!("{status:?}"),
        }
    }
    // Caps: the stream fails, and the session is READY again.
    std::fs::remove_file(dir.join("workspace/big")).unwrap();
    std::fs::write(dir.join("workspace/eleven"), b"01234567890").unwrap();
    refused(
        capture_with(&server, &id, 10, 0).await,
        tonic::Code::ResourceExhausted,
        "SnapshotTooLarge",
    );
    refused(
        capture_with(&server, &id, 0, 2).await,
        tonic::Code::ResourceExhausted,
        "SnapshotTooLarge",
    );
    let whole = capture_with(&server, &id, 11, 3).await.unwrap();
    assert_eq!(whole.summary.files, 3);
    let (completed, _) = sh(&server, &id, "true").await.unwrap();
    assert_eq!(completed.state(), pb::OperationState::Succeeded);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_needs_a_fresh_session() {
    let server = start().await;
    let (source, _) = open(&server, &[("a", b"a")]).await;
    let snapshot = capture(&server, &source).await;
    // One that ran an operation.
    let (used, used_dir) = open(&server, &[("mine", b"mine")]).await;
    sh(&server, &used, "true").await.unwrap();
    refused(
        restore(&server, &used, &snapshot.data, "").await,
        tonic::Code::FailedPrecondition,
        "NotFresh",
    );
    assert_eq!(
        std::fs::read(used_dir.join("workspace/mine")).unwrap(),
        b"mine"
    );
    // One that took an upload.
    let (uploaded, _) = open(&server, &[]).await;
    let upload = vec![
        pb::UploadSessionFileRequest {
            part: Some(pb::upload_session_file_request::Part::Header(
                pb::UploadHeader {
                    id: Some(uploaded.clone()),
                    path: "up".into(),
                    ..Default::default()
                },
            )),
        },
        pb::UploadSessionFileRequest {
            part: Some(pb::upload_session_file_request::Part::End(pb::UploadEnd {
                total_bytes: 0,
            })),
        },
    ];
    server
        .sessions
        .clone()
        .upload_session_file(tokio_stream::iter(upload))
        .await
        .unwrap();
    refused(
        restore(&server, &uploaded, &snapshot.data, "").await,
        tonic::Code::FailedPrecondition,
        "NotFresh",
    );
    // An unknown one.
    let err = restore(&server, &new_id(), &snapshot.data, "")
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    // A fresh one, then never again.
    let (fresh, fresh_dir) = open(&server, &[]).await;
    restore(&server, &fresh, &snapshot.data, &snapshot.summary.digest)
        .await
        .unwrap();
    assert_eq!(std::fs::read(fresh_dir.join("workspace/a")).unwrap(), b"a");
    refused(
        restore(&server, &fresh, &snapshot.data, "").await,
        tonic::Code::FailedPrecondition,
        "NotFresh",
    );
    sh(&server, &fresh, "true").await.unwrap();
    refused(
        restore(&server, &fresh, &snapshot.data, "").await,
        tonic::Code::FailedPrecondition,
        "NotFresh",
    );
}

/// A raw tar entry: the tar crate's setters refuse the hostile names these tests need.
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
    let bytes = header.as_old_mut();
    bytes.name[..name.len()].copy_from_slice(name);
    bytes.linkname[..link.len()].copy_from_slice(link);
    header.set_cksum();
    builder.append(&header, data).unwrap();
}

fn zst_tar(build: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    build(&mut builder);
    zstd::encode_all(builder.into_inner().unwrap().as_slice(), 1).unwrap()
}

/// A zstd stream of a tar holding one file of `size` zeros, made without holding it.
fn zero_bomb(size: u64) -> Vec<u8> {
    use std::io::Write;
    let mut encoder = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
    let mut header = tar::Header::new_gnu();
    header.set_path("workspace/zeros").unwrap();
    header.set_size(size);
    header.set_mode(0o644);
    header.set_entry_type(tar::EntryType::Regular);
    header.set_cksum();
    encoder.write_all(header.as_bytes()).unwrap();
    let zeros = vec![0u8; MIB];
    let mut left = size;
    while left > 0 {
        let n = left.min(MIB as u64) as usize;
        encoder.write_all(&zeros[..n]).unwrap();
        left -= n as u64;
    }
    encoder.write_all(&[0u8; 1024]).unwrap();
    encoder.finish().unwrap()
}

/// Bytes used beneath `dir`.
fn disk_use(dir: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        total += meta.blocks() * 512;
        if meta.is_dir() {
            total += disk_use(&path);
        }
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_snapshots_change_nothing() {
    use tar::EntryType::*;
    let server = start().await;
    let (id, dir) = open(&server, &[("keep.txt", b"registered")]).await;
    let outside = server.dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("secret"), b"outside").unwrap();
    let before = (tree(&dir.join("workspace")), tree(&dir.join("artifacts")));
    let session_entries = || {
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    };
    let entries_before = session_entries();
    let good = zst_tar(|b| {
        entry(b, Directory, b"workspace/", b"", b"");
        entry(b, Regular, b"workspace/ok", b"", b"ok");
    });
    let cases: Vec<(&str, Vec<RestorePart>)> = vec![
        ("dotdot", {
            let data = zst_tar(|b| entry(b, Regular, b"workspace/../escape", b"", b"x"));
            [vec![header(&id, 0, 0, "")], body(&data)].concat()
        }),
        ("absolute", {
            let data = zst_tar(|b| entry(b, Regular, b"/tmp/krt-escape", b"", b"x"));
            [vec![header(&id, 0, 0, "")], body(&data)].concat()
        }),
        ("another root", {
            let data = zst_tar(|b| entry(b, Regular, b"tmp/x", b"", b"x"));
            [vec![header(&id, 0, 0, "")], body(&data)].concat()
        }),
        ("symlink to / then through it", {
            let data = zst_tar(|b| {
                entry(b, Symlink, b"workspace/l", b"/", b"");
                entry(b, Regular, b"workspace/l/x", b"", b"x");
            });
            [vec![header(&id, 0, 0, "")], body(&data)].concat()
        }),
        ("symlink up", {
            let data = zst_tar(|b| entry(b, Symlink, b"workspace/l", b"..", b""));
            [vec![header(&id, 0, 0, "")], body(&data)].concat()
        }),
        ("symlink into artifacts", {
            let data = zst_tar(|b| {
                entry(b, Directory, b"workspace/d/", b"", b"");
                entry(b, Symlink, b"workspace/d/l", b"../../artifacts", b"");
            });
            [vec![header(&id, 0, 0, "")], body(&data)].concat()
        }),
        ("through a symlink of the archive", {
            let data = zst_tar(|b| {
                entry(b, Directory, b"workspace/s/", b"", b"");
                entry(b, Symlink, b"workspace/l", b"s", b"");
                entry(b, Regular, b"workspace/l/x", b"", b"x");
            });
            [vec![header(&id, 0, 0, "")], body(&data)].concat()
        }),
        ("hard link", {
            let data = zst_tar(|b| {
                entry(b, Regular, b"workspace/a", b"", b"a");
                entry(b, Link, b"workspace/h", b"workspace/a", b"");
            });
            [vec![header(&id, 0, 0, "")], body(&data)].concat()
        }),
        ("device", {
            let data = zst_tar(|b| entry(b, Char, b"workspace/null", b"", b""));
            [vec![header(&id, 0, 0, "")], body(&data)].concat()
        }),
        ("fifo", {
            let data = zst_tar(|b| entry(b, Fifo, b"workspace/pipe", b"", b""));
            [vec![header(&id, 0, 0, "")], body(&data)].concat()
        }),
        ("too many entries", {
            let data = zst_tar(|b| {
                for i in 0..10 {
                    entry(b, Regular, format!("workspace/f{i}").as_bytes(), b"", b"x");
                }
            });
            [vec![header(&id, 0, 5, "")], body(&data)].concat()
        }),
        ("more bytes than the cap", {
            let data = zero_bomb(64 * MIB as u64);
            assert!(data.len() < 64 * 1024, "{}", data.len());
            [vec![header(&id, MIB as u64, 0, "")], body(&data)].concat()
        }),
        ("a huge pax header", {
            // The tar reader holds an extension header in memory: the decompressed
            // stream's own bound stops it.
            use std::io::Write;
            let mut encoder = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
            let mut pax = tar::Header::new_ustar();
            pax.set_path("workspace/pax").unwrap();
            pax.set_size(64 * MIB as u64);
            pax.set_entry_type(tar::EntryType::XHeader);
            pax.set_cksum();
            encoder.write_all(pax.as_bytes()).unwrap();
            let zeros = vec![0u8; MIB];
            for _ in 0..64 {
                encoder.write_all(&zeros).unwrap();
            }
            let data = encoder.finish().unwrap();
            [vec![header(&id, MIB as u64, 10, "")], body(&data)].concat()
        }),
        ("a wrong digest", {
            let wrong = format!("sha256:{}", "0".repeat(64));
            [vec![header(&id, 0, 0, &wrong)], body(&good)].concat()
        }),
        ("no end", {
            let mut parts = [vec![header(&id, 0, 0, "")], body(&good)].concat();
            parts.pop();
            parts
        }),
        ("a wrong total", {
            let mut parts = [vec![header(&id, 0, 0, "")], body(&good)].concat();
            parts.pop();
            parts.push(RestorePart::End(pb::RestoreEnd { total_bytes: 1 }));
            parts
        }),
        ("truncated", {
            let data = zero_bomb(4 * MIB as u64);
            [vec![header(&id, 0, 0, "")], body(&data[..data.len() / 2])].concat()
        }),
        ("not zstd", {
            let data = b"plainly not a snapshot".to_vec();
            [vec![header(&id, 0, 0, "")], body(&data)].concat()
        }),
    ];
    for (what, parts) in cases {
        let result = restore_parts(&server, parts).await;
        match result {
            Ok(done) => panic!("{what}: restored {done:?}"),
            Err(status) => {
                eprintln!("{what}: {}", status.message());
                assert_eq!(
                    status.code(),
                    tonic::Code::InvalidArgument,
                    "{what}: {status:?}"
                );
                assert_eq!(reason(&status), "SnapshotInvalid", "{what}: {status:?}");
                assert!(status.message().len() <= 4096, "{what}");
            }
        }
        assert_eq!(
            (tree(&dir.join("workspace")), tree(&dir.join("artifacts"))),
            before,
            "{what}"
        );
        assert_eq!(session_entries(), entries_before, "{what}");
        assert!(
            disk_use(&dir) < 2 * MIB as u64,
            "{what}: {}",
            disk_use(&dir)
        );
        assert_eq!(tree(&outside).len(), 1, "{what}");
        assert!(!dir.join("escape").exists(), "{what}");
        assert!(!Path::new("/tmp/krt-escape").exists(), "{what}");
    }
    // Still fresh: the good one restores.
    restore(&server, &id, &good, &sha256(&good)).await.unwrap();
    assert_eq!(std::fs::read(dir.join("workspace/ok")).unwrap(), b"ok");
    assert!(!dir.join("workspace/keep.txt").exists());
    let ok_mtime = std::fs::metadata(dir.join("workspace/ok"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(ok_mtime, UNIX_EPOCH);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_stops_a_capture_nobody_reads() {
    let server = start().await;
    let (id, dir) = open(&server, &[]).await;
    std::fs::write(dir.join("workspace/big"), noise(48 * MIB, 5)).unwrap();
    let mut stream = start_capture(&server, &id, 0, 0).await.unwrap();
    // Without the capture stopping, closing waits for the slot for the grace period plus
    // 10 s, then goes on regardless; anything shorter is the capture stopping (a loaded
    // machine, gVisor's teardown included, needs some of those seconds).
    let started = Instant::now();
    close_purged(&server, &id, "").await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "closing waited {:?} for the capture",
        started.elapsed()
    );
    assert!(!dir.exists());
    // The stream ends without a summary.
    let mut summary = false;
    while let Some(Ok(part)) = tokio::time::timeout(DEADLINE, stream.next()).await.unwrap() {
        summary |= matches!(part.part, Some(CapturePart::Summary(_)));
    }
    assert!(!summary);
}

/// Waits (polling the directory, within the deadline) until `dir` holds a name starting
/// with `prefix`.
async fn await_name(dir: &Path, prefix: &str) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let found = std::fs::read_dir(dir)
            .unwrap()
            .any(|e| e.unwrap().file_name().to_string_lossy().starts_with(prefix));
        if found {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no {prefix}* in {}",
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_and_restores_exclude_captures_and_operations() {
    let server = start().await;
    // An upload in flight (its temporary made, its end not sent) holds captures off.
    let (id, dir) = open(&server, &[]).await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(pb::UploadSessionFileRequest {
        part: Some(pb::upload_session_file_request::Part::Header(
            pb::UploadHeader {
                id: Some(id.clone()),
                path: "slow".into(),
                ..Default::default()
            },
        )),
    })
    .await
    .unwrap();
    let upload = {
        let mut sessions = server.sessions.clone();
        tokio::spawn(async move {
            sessions
                .upload_session_file(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
        })
    };
    await_name(&dir.join("workspace"), ".krt-upload-").await;
    refused(
        start_capture(&server, &id, 0, 0).await,
        tonic::Code::FailedPrecondition,
        "Transferring",
    );
    tx.send(pb::UploadSessionFileRequest {
        part: Some(pb::upload_session_file_request::Part::End(pb::UploadEnd {
            total_bytes: 0,
        })),
    })
    .await
    .unwrap();
    upload.await.unwrap().unwrap();
    capture(&server, &id).await;

    // A restore in flight (its staging made, its end not sent) holds everything off.
    let (fresh, fresh_dir) = open(&server, &[]).await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(pb::RestoreSessionRequest {
        part: Some(header(&fresh, 0, 0, "")),
    })
    .await
    .unwrap();
    let restoring = {
        let mut sessions = server.sessions.clone();
        tokio::spawn(async move {
            sessions
                .restore_session(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
        })
    };
    await_name(&fresh_dir, ".krt-restore-").await;
    refused(
        begin_sh(&server, &fresh, "true").await,
        tonic::Code::FailedPrecondition,
        "Restoring",
    );
    refused(
        start_capture(&server, &fresh, 0, 0).await,
        tonic::Code::FailedPrecondition,
        "Restoring",
    );
    refused(
        restore(&server, &fresh, b"", "").await,
        tonic::Code::FailedPrecondition,
        "Restoring",
    );
    // The caller goes away: nothing is restored, the staging is gone, the session is
    // still fresh.
    drop(tx);
    let err = restoring.await.unwrap().unwrap_err();
    assert_eq!(reason(&err), "SnapshotInvalid", "{err:?}");
    assert!(!std::fs::read_dir(&fresh_dir).unwrap().any(|e| {
        e.unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with(".krt-")
    }));
    let snapshot = capture(&server, &id).await;
    restore(&server, &fresh, &snapshot.data, &snapshot.summary.digest)
        .await
        .unwrap();
    assert!(fresh_dir.join("workspace/slow").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_artifacts_directory_is_left_out_and_made_again() {
    let server = start().await;
    let (id, dir) = open(&server, &[("f", b"f")]).await;
    std::fs::remove_dir(dir.join("artifacts")).unwrap();
    let snapshot = capture(&server, &id).await;
    let names: Vec<&str> = snapshot
        .summary
        .manifest
        .iter()
        .map(|e| e.path.as_str())
        .collect();
    assert_eq!(names, ["workspace", "workspace/f"]);
    let (fresh, fresh_dir) = open(&server, &[]).await;
    std::fs::remove_dir(fresh_dir.join("artifacts")).unwrap();
    restore(&server, &fresh, &snapshot.data, &snapshot.summary.digest)
        .await
        .unwrap();
    assert_eq!(std::fs::read(fresh_dir.join("workspace/f")).unwrap(), b"f");
    assert!(fresh_dir.join("artifacts").is_dir());
}

/// Closes and purges the session `id`, parking its files with `park_digest` (empty: none).
async fn close_purged(server: &TestServer, id: &pb::ExecutionId, park_digest: &str) {
    let closed = server
        .sessions
        .clone()
        .close_session(pb::CloseSessionRequest {
            id: Some(id.clone()),
            grace_period: None,
            purge: true,
            park_digest: park_digest.to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(closed.existed);
}

/// A restore of `id` from the server's parked files of its Run with `digest`.
async fn restore_parked(
    server: &TestServer,
    id: &pb::ExecutionId,
    digest: &str,
) -> Result<pb::RestoreSessionResponse, tonic::Status> {
    let header = RestorePart::Header(pb::RestoreHeader {
        id: Some(id.clone()),
        max_bytes: 0,
        max_files: 0,
        digest: digest.to_owned(),
        parked: true,
    });
    restore_parts(
        server,
        vec![header, RestorePart::End(pb::RestoreEnd { total_bytes: 0 })],
    )
    .await
}

/// The next attempt of the same Run (a resumed incarnation).
fn next_attempt(id: &pb::ExecutionId) -> pb::ExecutionId {
    pb::ExecutionId {
        run_uid: id.run_uid.clone(),
        attempt: id.attempt + 1,
    }
}

/// A suspended session's files are parked at its close only when they are exactly what
/// its last capture archived, and a fresh session of the same Run takes them back with
/// no data: every file, mode, mtime and link, as a restore of that snapshot gives them,
/// once, and only for that digest. Files an operation changed after the capture, and a
/// capture that left entries out, are never parked; the session then restores from data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_files_come_back_only_when_they_are_exactly_the_last_capture() {
    let server = start().await;
    let (a, a_dir) = open(&server, &[]).await;
    populate(&a_dir);
    // Nothing a capture leaves out: the temporaries and the FIFO go.
    for left_out in [
        "workspace/.krt-upload-0123456789abcdef",
        "workspace/bin/.krt-upload-feed",
        "workspace/pipe",
    ] {
        std::fs::remove_file(a_dir.join(left_out)).unwrap();
    }
    let want = kept(&a_dir);
    let first = capture(&server, &a).await;
    assert_eq!(first.summary.skipped, 0, "{:?}", first.summary);
    close_purged(&server, &a, &first.summary.digest).await;
    assert!(!a_dir.exists(), "the session's directory is gone");
    let parked_dir = a_dir.parent().unwrap().join(".parked");

    let b = next_attempt(&a);
    let (b, b_dir) = open_as(&server, b, &[("registered.txt", b"replaced")]).await;
    refused(
        restore_parked(&server, &b, &sha256(b"another snapshot")).await,
        tonic::Code::FailedPrecondition,
        "NoParkedFiles",
    );
    let done = restore_parked(&server, &b, &first.summary.digest)
        .await
        .unwrap();
    assert_eq!(done.files, first.summary.files);
    assert_eq!(done.size_bytes, first.summary.size_bytes);
    assert_eq!(kept(&b_dir), want);
    assert!(!b_dir.join("workspace/registered.txt").exists());
    assert_eq!(
        std::fs::read_dir(&parked_dir).unwrap().count(),
        0,
        "taken, nothing left parked"
    );
    let (completed, stdout) = sh(&server, &b, "cat secret; ./rel").await.unwrap();
    assert_eq!(
        completed.state(),
        pb::OperationState::Succeeded,
        "{completed:?}"
    );
    assert_eq!(stdout, "only meran\n");

    // Changed after its capture: not parked; the next session restores from data.
    let second = capture(&server, &b).await;
    let (completed, _) = sh(&server, &b, "echo later > later").await.unwrap();
    assert_eq!(completed.state(), pb::OperationState::Succeeded);
    close_purged(&server, &b, &second.summary.digest).await;
    let (c, c_dir) = open_as(&server, next_attempt(&b), &[]).await;
    refused(
        restore_parked(&server, &c, &second.summary.digest).await,
        tonic::Code::FailedPrecondition,
        "NoParkedFiles",
    );
    restore(&server, &c, &second.data, &second.summary.digest)
        .await
        .unwrap();
    assert!(
        !c_dir.join("workspace/later").exists(),
        "the snapshot's files"
    );
    assert_eq!(kept(&c_dir), want);

    // A capture that left an entry out: not parked either.
    nix::unistd::mkfifo(
        &c_dir.join("workspace/pipe"),
        nix::sys::stat::Mode::from_bits_truncate(0o644),
    )
    .unwrap();
    let third = capture(&server, &c).await;
    assert_eq!(third.summary.skipped, 1);
    close_purged(&server, &c, &third.summary.digest).await;
    let (d, _) = open_as(&server, next_attempt(&c), &[]).await;
    refused(
        restore_parked(&server, &d, &third.summary.digest).await,
        tonic::Code::FailedPrecondition,
        "NoParkedFiles",
    );

    // Parked, then the Run's session closed without parking: they are removed.
    let (e, e_dir) = open(&server, &[("f", b"x")]).await;
    let _ = e_dir;
    let fourth = capture(&server, &e).await;
    close_purged(&server, &e, &fourth.summary.digest).await;
    assert_eq!(std::fs::read_dir(&parked_dir).unwrap().count(), 1);
    let (f, _) = open_as(&server, next_attempt(&e), &[]).await;
    close_purged(&server, &f, "").await;
    assert_eq!(std::fs::read_dir(&parked_dir).unwrap().count(), 0);
}
