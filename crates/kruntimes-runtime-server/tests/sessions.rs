//! End-to-end tests of session mode (`SessionRuntime`) in the `kruntimes-runtime-server`
//! binary: real commands, a real Unix socket, temporary directories. Synchronisation uses
//! the server's answers and events, and FIFOs the commands open (a blocking open returns
//! exactly when the other side arrives), always with a deadline; never sleeps in the test.
//! Tests that start a `setsid` escapee run only where the server has cgroups, so that no
//! test leaves a process behind.
#![allow(clippy::unwrap_used)]

mod common;
#[path = "escape/gvisor.rs"]
mod escape_gvisor;
#[path = "escape/namespaces.rs"]
mod escape_namespaces;

/// The sandbox backends the escape suite runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Namespaces,
    Gvisor,
}

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{DEADLINE, TestServer, new_id};
use kruntimes_proto::runtime::v1 as pb;
use pb::session_operation_event::Event;
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

/// A server with the `process` backend, for tests that follow a command's processes by the
/// pids it prints (inside a `namespaces` sandbox those are pids of its own PID namespace;
/// `tests/escape.rs` covers that backend).
async fn start_process() -> TestServer {
    TestServer::start_with(
        tempfile::tempdir().unwrap(),
        "bash",
        &[
            "--session-termination-grace",
            "400ms",
            "--sandbox",
            "process",
        ],
    )
    .await
}

fn env(pairs: &[(&str, &str)]) -> Vec<pb::EnvVar> {
    pairs
        .iter()
        .map(|(name, value)| pb::EnvVar {
            name: (*name).to_owned(),
            value: (*value).to_owned(),
        })
        .collect()
}

async fn register_with(
    server: &TestServer,
    id: &pb::ExecutionId,
    files: Vec<pb::SourceFile>,
    env: Vec<pb::EnvVar>,
) -> Result<pb::SessionStatus, tonic::Status> {
    server
        .sessions
        .clone()
        .register_session(pb::RegisterSessionRequest {
            id: Some(id.clone()),
            files,
            env,
        })
        .await
        .map(|r| r.into_inner())
}

/// Registers a fresh session without files or env; it must be READY.
async fn open(server: &TestServer) -> pb::ExecutionId {
    let id = new_id();
    let status = register_with(server, &id, Vec::new(), Vec::new())
        .await
        .unwrap();
    assert_eq!(status.state(), pb::SessionState::Ready, "{status:?}");
    id
}

async fn status(
    server: &TestServer,
    id: &pb::ExecutionId,
) -> Result<pb::SessionStatus, tonic::Status> {
    server
        .sessions
        .clone()
        .get_session_status(pb::GetSessionStatusRequest {
            id: Some(id.clone()),
        })
        .await
        .map(|r| r.into_inner())
}

async fn close(
    server: &TestServer,
    id: &pb::ExecutionId,
    grace: Option<Duration>,
    purge: bool,
) -> Result<pb::CloseSessionResponse, tonic::Status> {
    close_in_background(server, id, grace, purge).await.unwrap()
}

/// [`close`] on a task of its own, so the test can watch the command meanwhile.
fn close_in_background(
    server: &TestServer,
    id: &pb::ExecutionId,
    grace: Option<Duration>,
    purge: bool,
) -> tokio::task::JoinHandle<Result<pb::CloseSessionResponse, tonic::Status>> {
    let mut sessions = server.sessions.clone();
    let request = pb::CloseSessionRequest {
        id: Some(id.clone()),
        grace_period: grace.map(|g| g.try_into().unwrap()),
        purge,
        park_digest: String::new(),
    };
    tokio::spawn(async move {
        sessions
            .close_session(request)
            .await
            .map(|r| r.into_inner())
    })
}

async fn list_sessions(server: &TestServer) -> Vec<pb::SessionStatus> {
    server
        .sessions
        .clone()
        .list_sessions(pb::ListSessionsRequest {})
        .await
        .unwrap()
        .into_inner()
        .sessions
}

fn workspace(status: &pb::SessionStatus) -> PathBuf {
    PathBuf::from(&status.workspace_dir)
}

static OPERATIONS: AtomicU64 = AtomicU64::new(1);

fn request(
    id: &pb::ExecutionId,
    operation: Operation,
    timeout: Option<Duration>,
) -> pb::SessionOperationRequest {
    pb::SessionOperationRequest {
        id: Some(id.clone()),
        operation_id: format!("op-{}", OPERATIONS.fetch_add(1, Ordering::SeqCst)),
        operation: Some(operation),
        timeout: timeout.map(|t| t.try_into().unwrap()),
    }
}

fn command(argv: &[&str], shell: &str) -> pb::Command {
    pb::Command {
        argv: argv.iter().map(|a| (*a).to_owned()).collect(),
        shell: shell.to_owned(),
        ..Default::default()
    }
}

fn shell(line: &str) -> Operation {
    Operation::Command(command(&[], line))
}

fn write(path: &str, content: &[u8]) -> Operation {
    Operation::WriteFile(pb::WriteFile {
        path: path.to_owned(),
        content: content.to_vec(),
        executable: false,
    })
}

fn mkdir(path: &str, parents: bool) -> Operation {
    Operation::MakeDirectory(pb::MakeDirectory {
        path: path.to_owned(),
        parents,
    })
}

fn delete(path: &str, recursive: bool) -> Operation {
    Operation::Delete(pb::DeletePath {
        path: path.to_owned(),
        recursive,
    })
}

fn rename(from: &str, to: &str) -> Operation {
    Operation::Rename(pb::RenamePath {
        from: from.to_owned(),
        to: to.to_owned(),
    })
}

/// Everything one operation streamed.
#[derive(Debug)]
struct Done {
    outputs: Vec<pb::OperationOutput>,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    completed: pb::OperationCompleted,
}

impl Done {
    fn state(&self) -> pb::OperationState {
        self.completed.state()
    }

    fn stdout(&self) -> String {
        String::from_utf8(self.stdout.clone()).unwrap()
    }

    /// Asserts SUCCEEDED and returns stdout.
    fn ok(&self) -> String {
        assert_eq!(
            self.state(),
            pb::OperationState::Succeeded,
            "{:?}, stderr {:?}",
            self.completed,
            String::from_utf8_lossy(&self.stderr)
        );
        assert_eq!(self.completed.reason, "Completed");
        self.stdout()
    }

    fn failed(&self, reason: &str) {
        assert_eq!(
            self.state(),
            pb::OperationState::Failed,
            "{:?}",
            self.completed
        );
        assert_eq!(self.completed.reason, reason, "{:?}", self.completed);
    }
}

async fn begin(
    server: &TestServer,
    request: pb::SessionOperationRequest,
) -> Result<tonic::Streaming<pb::SessionOperationEvent>, tonic::Status> {
    server
        .sessions
        .clone()
        .stream_session_operation(request)
        .await
        .map(|r| r.into_inner())
}

async fn next_event(
    stream: &mut tonic::Streaming<pb::SessionOperationEvent>,
) -> Option<pb::SessionOperationEvent> {
    tokio::time::timeout(DEADLINE, stream.next())
        .await
        .expect("an event within the deadline")
        .map(|e| e.unwrap())
}

/// Reads the stream to its end, checking its shape: STARTED first, then outputs, then
/// exactly one COMPLETED, then the end; every event carries the operation's ID and
/// sequence 0.
async fn finish(
    mut stream: tonic::Streaming<pb::SessionOperationEvent>,
    operation_id: &str,
    mut started: bool,
) -> Done {
    let mut outputs = Vec::new();
    let mut completed = None;
    while let Some(event) = next_event(&mut stream).await {
        assert_eq!(event.operation_id, operation_id);
        assert_eq!(event.sequence, 0);
        assert!(completed.is_none(), "an event after completed: {event:?}");
        match event.event.unwrap() {
            Event::Started(_) => {
                assert!(!started, "started twice");
                started = true;
            }
            Event::Output(output) => {
                assert!(started, "output before started");
                assert!(output.data.len() <= 64 * 1024, "{}", output.data.len());
                outputs.push(output);
            }
            Event::Completed(c) => {
                assert!(started, "completed before started");
                completed = Some(c);
            }
            Event::Queued(q) => panic!("a runtime server never queues: {q:?}"),
        }
    }
    let completed = completed.expect("a completed event");
    let collect = |stream: pb::LogStream| -> Vec<u8> {
        outputs
            .iter()
            .filter(|o| o.stream() == stream)
            .flat_map(|o| o.data.iter().copied())
            .collect()
    };
    Done {
        stdout: collect(pb::LogStream::Stdout),
        stderr: collect(pb::LogStream::Stderr),
        outputs,
        completed,
    }
}

async fn run(
    server: &TestServer,
    request: pb::SessionOperationRequest,
) -> Result<Done, tonic::Status> {
    let operation_id = request.operation_id.clone();
    let stream = begin(server, request).await?;
    Ok(finish(stream, &operation_id, false).await)
}

async fn op(
    server: &TestServer,
    id: &pb::ExecutionId,
    operation: Operation,
) -> Result<Done, tonic::Status> {
    run(server, request(id, operation, None)).await
}

async fn sh(server: &TestServer, id: &pb::ExecutionId, line: &str) -> Done {
    op(server, id, shell(line)).await.unwrap()
}

async fn read(
    server: &TestServer,
    id: &pb::ExecutionId,
    path: &str,
) -> Result<pb::ReadSessionFileResponse, tonic::Status> {
    server
        .sessions
        .clone()
        .read_session_file(pb::ReadSessionFileRequest {
            id: Some(id.clone()),
            path: path.to_owned(),
        })
        .await
        .map(|r| r.into_inner())
}

async fn list(
    server: &TestServer,
    id: &pb::ExecutionId,
    path: &str,
    limit: u32,
    page_token: &str,
) -> Result<pb::ListSessionFilesResponse, tonic::Status> {
    server
        .sessions
        .clone()
        .list_session_files(pb::ListSessionFilesRequest {
            id: Some(id.clone()),
            path: path.to_owned(),
            limit,
            page_token: page_token.to_owned(),
        })
        .await
        .map(|r| r.into_inner())
}

/// Reads output events until stdout holds `lines` complete lines; returns them.
async fn stdout_lines(
    stream: &mut tonic::Streaming<pb::SessionOperationEvent>,
    lines: usize,
) -> Vec<String> {
    let mut stdout = Vec::new();
    loop {
        let text = String::from_utf8_lossy(&stdout).into_owned();
        if text.matches('\n').count() >= lines {
            return text.lines().map(str::to_owned).collect();
        }
        let event = next_event(stream).await.expect("more output");
        match event.event.unwrap() {
            Event::Started(_) => {}
            Event::Output(o) if o.stream() == pb::LogStream::Stdout => stdout.extend(o.data),
            Event::Output(_) => {}
            other => panic!("the command ended early: {other:?}"),
        }
    }
}

fn alive(pid: i32) -> bool {
    !kruntimes_testkit::procs::matching(|p| p.pid == pid).is_empty()
}

fn mkfifo(path: &Path) {
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success());
}

/// Shell that waits (inside the command, within the test's deadline) until the test opens
/// the gate: the file `gate` in the workspace appears. A file rather than a FIFO: a gVisor
/// sandbox cannot open a FIFO made on the host.
const AWAIT_GATE: &str = "until [ -e gate ]; do sleep 0.01; done";

/// Lets a command waiting in [`AWAIT_GATE`] go on.
fn open_gate(ws: &Path) {
    std::fs::write(ws.join("gate"), b"go").unwrap();
}

/// Waits (polling the server's answer, within the deadline) until the session runs no
/// operation.
async fn await_idle(server: &TestServer, id: &pb::ExecutionId) -> pb::SessionStatus {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let status = status(server, id).await.unwrap();
        if status.running_operation_id.is_empty() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "the operation did not end: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn code(result: Result<impl std::fmt::Debug, tonic::Status>) -> tonic::Code {
    match result {
        Ok(value) => panic!("expected an error, got {value:?}"),
        Err(status) => status.code(),
    }
}

// ---------------------------------------------------------------------------------------
// Lifecycle

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capabilities_list_the_session_runtime() {
    let server = start().await;
    let caps = server.capabilities().await;
    assert!(
        caps.services
            .contains(&pb::SESSION_RUNTIME_SERVICE.to_owned()),
        "{caps:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_status_close_and_purge() {
    let server = start().await;
    let id = new_id();
    let files = vec![pb::SourceFile {
        path: "src/main.sh".to_owned(),
        content: b"echo hi\n".to_vec(),
        executable: true,
    }];
    let registered = register_with(&server, &id, files.clone(), env(&[("A", "1")]))
        .await
        .unwrap();
    assert_eq!(registered.state(), pb::SessionState::Ready);
    assert_eq!(registered.reason, "Registered");
    assert_eq!(registered.id, Some(id.clone()));
    assert_eq!(registered.operations, 0);
    let session_dir = server.root().join("sessions").join(&id.run_uid);
    assert_eq!(workspace(&registered), session_dir.join("workspace"));
    assert_eq!(
        PathBuf::from(&registered.artifacts_dir),
        session_dir.join("artifacts")
    );
    assert!(PathBuf::from(&registered.artifacts_dir).is_dir());
    let source = workspace(&registered).join("src/main.sh");
    assert_eq!(std::fs::read(&source).unwrap(), b"echo hi\n");
    assert_eq!(
        std::fs::metadata(&source).unwrap().permissions().mode() & 0o777,
        0o755
    );

    // Idempotent for the same inputs; other inputs conflict.
    let again = register_with(&server, &id, files.clone(), env(&[("A", "1")]))
        .await
        .unwrap();
    assert_eq!(again.registered_at, registered.registered_at);
    let conflict = register_with(&server, &id, files.clone(), env(&[("A", "2")])).await;
    assert_eq!(code(conflict), tonic::Code::AlreadyExists);
    assert_eq!(status(&server, &id).await.unwrap(), registered);
    assert_eq!(list_sessions(&server).await, vec![registered.clone()]);

    // Unknown identities are a state, not an error.
    let unknown = status(&server, &new_id()).await.unwrap();
    assert_eq!(unknown.state(), pb::SessionState::NotFound);
    assert_eq!(unknown.reason, "NotFound");
    let higher = pb::ExecutionId {
        attempt: 2,
        ..id.clone()
    };
    assert_eq!(
        status(&server, &higher).await.unwrap().state(),
        pb::SessionState::NotFound
    );

    assert_eq!(sh(&server, &id, "echo $A").await.ok(), "1\n");
    assert_eq!(status(&server, &id).await.unwrap().operations, 1);

    // Close without purge keeps the directory and refuses work.
    let closed = close(&server, &id, None, false).await.unwrap();
    assert!(closed.existed);
    let closed = closed.status.unwrap();
    assert_eq!(closed.state(), pb::SessionState::Closed);
    assert_eq!(closed.reason, "Closed");
    assert!(source.exists());
    assert_eq!(
        code(op(&server, &id, shell("true")).await),
        tonic::Code::FailedPrecondition
    );
    assert_eq!(
        code(read(&server, &id, "src/main.sh").await),
        tonic::Code::FailedPrecondition
    );
    assert_eq!(
        code(list(&server, &id, "", 0, "").await),
        tonic::Code::FailedPrecondition
    );
    let reopened = register_with(&server, &id, files.clone(), env(&[("A", "1")])).await;
    assert_eq!(code(reopened), tonic::Code::FailedPrecondition);
    // Idempotent.
    let again = close(&server, &id, None, false).await.unwrap();
    assert!(again.existed);
    assert_eq!(again.status.unwrap().state(), pb::SessionState::Closed);

    // Purge removes everything and forgets the session.
    let purged = close(&server, &id, Some(Duration::ZERO), true)
        .await
        .unwrap();
    assert!(purged.existed);
    assert_eq!(purged.status.unwrap().state(), pb::SessionState::NotFound);
    assert!(!session_dir.exists());
    assert_eq!(
        status(&server, &id).await.unwrap().state(),
        pb::SessionState::NotFound
    );
    assert!(list_sessions(&server).await.is_empty());
    let gone = close(&server, &id, None, true).await.unwrap();
    assert!(!gone.existed);
    assert_eq!(gone.status.unwrap().state(), pb::SessionState::NotFound);
    assert_eq!(
        code(op(&server, &id, shell("true")).await),
        tonic::Code::NotFound
    );
    assert_eq!(code(read(&server, &id, "x").await), tonic::Code::NotFound);
    assert_eq!(
        code(list(&server, &id, "", 0, "").await),
        tonic::Code::NotFound
    );

    // Registering a purged identity again starts afresh.
    let fresh = register_with(&server, &id, files, env(&[("A", "1")]))
        .await
        .unwrap();
    assert_eq!(fresh.state(), pb::SessionState::Ready);
    assert_eq!(fresh.operations, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn higher_attempts_replace_lower_ones_and_lower_ones_are_stale() {
    let server = start().await;
    let first = open(&server).await;
    let ws = workspace(&status(&server, &first).await.unwrap());
    sh(&server, &first, "echo old > left-behind").await.ok();
    // A command of the first attempt is running when the second registers.
    let req = request(&first, shell(&format!("echo ready; {AWAIT_GATE}")), None);
    let running_id = req.operation_id.clone();
    let mut running = begin(&server, req).await.unwrap();
    assert_eq!(stdout_lines(&mut running, 1).await, ["ready"]);

    let second = pb::ExecutionId {
        attempt: 2,
        ..first.clone()
    };
    let replaced = register_with(&server, &second, Vec::new(), Vec::new())
        .await
        .unwrap();
    assert_eq!(replaced.state(), pb::SessionState::Ready);
    assert_eq!(replaced.id, Some(second.clone()));
    // The first attempt's command was ended by its session closing.
    let ended = finish(running, &running_id, true).await;
    assert_eq!(
        ended.state(),
        pb::OperationState::Cancelled,
        "{:?}",
        ended.completed
    );
    assert_eq!(ended.completed.reason, "SessionClosed");
    assert!(
        !ws.join("left-behind").exists(),
        "the workspace starts afresh"
    );
    assert!(ws.is_dir());

    // The first attempt is stale everywhere.
    assert_eq!(
        code(status(&server, &first).await),
        tonic::Code::FailedPrecondition
    );
    let stale = register_with(&server, &first, Vec::new(), Vec::new()).await;
    assert_eq!(code(stale), tonic::Code::FailedPrecondition);
    assert_eq!(
        code(op(&server, &first, shell("true")).await),
        tonic::Code::FailedPrecondition
    );
    assert_eq!(
        code(read(&server, &first, "x").await),
        tonic::Code::FailedPrecondition
    );
    assert_eq!(
        code(close(&server, &first, None, true).await),
        tonic::Code::FailedPrecondition
    );
    // A higher attempt than the one held is unknown.
    let third = pb::ExecutionId {
        attempt: 3,
        ..first.clone()
    };
    assert_eq!(
        code(op(&server, &third, shell("true")).await),
        tonic::Code::NotFound
    );
    assert_eq!(
        status(&server, &second).await.unwrap().state(),
        pb::SessionState::Ready
    );
    // A close for a higher attempt covers the one held.
    let closed = close(&server, &third, None, true).await.unwrap();
    assert!(closed.existed);
    assert_eq!(
        status(&server, &second).await.unwrap().state(),
        pb::SessionState::NotFound
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_that_cannot_prepare_fails_leaves_nothing_and_can_be_retried() {
    let server = start().await;
    // Fault injection: a file where the sessions directory must be made.
    let sessions_dir = server.root().join("sessions");
    std::fs::write(&sessions_dir, b"in the way").unwrap();
    let id = new_id();
    let files = vec![pb::SourceFile {
        path: "a.txt".to_owned(),
        content: b"a".to_vec(),
        executable: false,
    }];
    let register = || register_with(&server, &id, files.clone(), Vec::new());
    let err = register().await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    let failed = status(&server, &id).await.unwrap();
    assert_eq!(failed.state(), pb::SessionState::Failed);
    assert_eq!(failed.reason, "WorkspaceFailed");
    assert!(!failed.message.is_empty() && failed.message.len() <= 4096);
    assert_eq!(std::fs::read(&sessions_dir).unwrap(), b"in the way");
    assert_eq!(
        code(op(&server, &id, shell("true")).await),
        tonic::Code::FailedPrecondition
    );
    // Registering again retries (and fails again while the fault lasts).
    assert_eq!(code(register().await), tonic::Code::FailedPrecondition);
    // A failed session is purged like any other.
    let purged = close(&server, &id, None, true).await.unwrap();
    assert!(purged.existed);
    assert_eq!(
        status(&server, &id).await.unwrap().state(),
        pb::SessionState::NotFound
    );
    assert_eq!(code(register().await), tonic::Code::FailedPrecondition);
    // Once the fault is gone, registering again succeeds.
    std::fs::remove_file(&sessions_dir).unwrap();
    let retried = register().await.unwrap();
    assert_eq!(retried.state(), pb::SessionState::Ready);
    assert_eq!(read(&server, &id, "a.txt").await.unwrap().content, b"a");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_every_session() {
    let server = start_process().await;
    let caps = server.capabilities().await;
    let cgroups = caps.isolation() == pb::Isolation::ProcessGroupAndCgroup;
    let id = open(&server).await;
    // Ignores SIGTERM: only the SIGKILL after the grace period ends it.
    let line = if cgroups {
        "trap '' TERM; echo $$; setsid sleep 1000 & echo $!; wait"
    } else {
        "trap '' TERM; echo $$; sleep 1000 & echo $!; wait"
    };
    let mut stream = begin(&server, request(&id, shell(line), None))
        .await
        .unwrap();
    let pids: Vec<i32> = stdout_lines(&mut stream, 2)
        .await
        .iter()
        .map(|l| l.parse().unwrap())
        .collect();
    let cgroup = Path::new(&caps.cgroup_parent).join(format!("ss-{}-{}", id.run_uid, id.attempt));
    assert_eq!(cgroup.exists(), cgroups);
    // SIGTERM to the server, which waits for it to exit.
    drop(server);
    for pid in &pids {
        assert!(!alive(*pid), "process {pid} outlived the server");
    }
    assert!(!cgroup.exists());
    drop(stream);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_validates_its_inputs() {
    let server = start().await;
    let file = |path: &str| pb::SourceFile {
        path: path.to_owned(),
        content: b"x".to_vec(),
        executable: false,
    };
    let cases = [
        (vec![file("../x")], Vec::new()),
        (vec![file("/etc/x")], Vec::new()),
        (vec![file("a"), file("a")], Vec::new()),
        (Vec::new(), env(&[("KRUNTIME_ARTIFACTS_DIR", "/tmp")])),
        (Vec::new(), env(&[("A=B", "1")])),
    ];
    for (files, env) in cases {
        let result = register_with(&server, &new_id(), files, env).await;
        assert_eq!(code(result), tonic::Code::InvalidArgument);
    }
    let bad_uid = pb::ExecutionId {
        run_uid: "../../etc".to_owned(),
        attempt: 1,
    };
    assert_eq!(
        code(register_with(&server, &bad_uid, Vec::new(), Vec::new()).await),
        tonic::Code::InvalidArgument
    );
    assert_eq!(
        code(status(&server, &bad_uid).await),
        tonic::Code::InvalidArgument
    );
    assert!(list_sessions(&server).await.is_empty());
}

// ---------------------------------------------------------------------------------------
// Commands

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_stream_their_output_as_it_is_produced() {
    let server = start().await;
    let id = open(&server).await;
    let ws = workspace(&status(&server, &id).await.unwrap());
    // The first line arrives while the command still waits at the gate.
    let req = request(
        &id,
        shell(&format!(
            "echo first; {AWAIT_GATE}; echo warning >&2; seq 1 2000"
        )),
        None,
    );
    let operation_id = req.operation_id.clone();
    let mut stream = begin(&server, req).await.unwrap();
    assert!(matches!(
        next_event(&mut stream).await.unwrap().event,
        Some(Event::Started(_))
    ));
    assert_eq!(stdout_lines(&mut stream, 1).await, ["first"]);
    let running = status(&server, &id).await.unwrap();
    assert_eq!(running.running_operation_id, operation_id);
    open_gate(&ws);
    let done = finish(stream, &operation_id, true).await;
    let expected: String = (1..=2000).map(|i| format!("{i}\n")).collect();
    assert_eq!(done.ok(), expected);
    assert_eq!(done.stderr, b"warning\n");
    assert_eq!(done.completed.exit_code, Some(0));
    assert_eq!(
        done.completed.stdout_bytes,
        ("first\n".len() + expected.len()) as u64
    );
    assert_eq!(done.completed.stderr_bytes, 8);
    assert!(!done.completed.stdout_truncated && !done.completed.stderr_truncated);
    assert!(done.completed.duration.is_some());
    let idle = status(&server, &id).await.unwrap();
    assert!(idle.running_operation_id.is_empty());
    assert_eq!(idle.operations, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_cwd_and_environment() {
    let server = start().await;
    let id = new_id();
    let registered = register_with(
        &server,
        &id,
        Vec::new(),
        env(&[("FOO", "registered"), ("BAR", "kept")]),
    )
    .await
    .unwrap();
    let ws = workspace(&registered);

    // stdin, with argv executed directly.
    let mut cat = command(&["cat"], "");
    cat.stdin = b"line one\nline two\n".to_vec();
    let done = op(&server, &id, Operation::Command(cat)).await.unwrap();
    assert_eq!(done.ok(), "line one\nline two\n");
    // No stdin: /dev/null.
    assert_eq!(sh(&server, &id, "wc -c").await.ok().trim(), "0");

    // cwd inside the workspace; HOME is the workspace.
    op(&server, &id, mkdir("sub/dir", true)).await.unwrap().ok();
    let mut pwd = command(&["pwd"], "");
    pwd.cwd = "sub/dir".to_owned();
    let done = op(&server, &id, Operation::Command(pwd)).await.unwrap();
    assert_eq!(PathBuf::from(done.ok().trim()), ws.join("sub/dir"));
    assert_eq!(
        PathBuf::from(sh(&server, &id, "echo $HOME").await.ok().trim()),
        ws
    );
    let mut relative = command(&["./tool.sh"], "");
    op(
        &server,
        &id,
        Operation::WriteFile(pb::WriteFile {
            path: "sub/tool.sh".to_owned(),
            content: b"#!/bin/sh\necho tool in $(pwd)\n".to_vec(),
            executable: true,
        }),
    )
    .await
    .unwrap()
    .ok();
    relative.cwd = "sub".to_owned();
    let done = op(&server, &id, Operation::Command(relative))
        .await
        .unwrap();
    assert_eq!(done.ok(), format!("tool in {}\n", ws.join("sub").display()));

    // A command's env overrides the registered env for that command only.
    let mut overriding = command(&[], "echo $FOO $BAR $EXTRA");
    overriding.env = env(&[("FOO", "command"), ("EXTRA", "x")]);
    let done = op(&server, &id, Operation::Command(overriding))
        .await
        .unwrap();
    assert_eq!(done.ok(), "command kept x\n");
    assert_eq!(
        sh(&server, &id, "echo $FOO $BAR ${EXTRA:-unset}")
            .await
            .ok(),
        "registered kept unset\n"
    );

    // KRUNTIME_ARTIFACTS_DIR: absolute, the session's artifacts directory, writable.
    let done = sh(
        &server,
        &id,
        "echo $KRUNTIME_ARTIFACTS_DIR; echo exported > $KRUNTIME_ARTIFACTS_DIR/out.txt",
    )
    .await;
    assert_eq!(
        PathBuf::from(done.ok().trim()),
        PathBuf::from(&registered.artifacts_dir)
    );
    assert!(Path::new(done.stdout().trim()).is_absolute());
    assert_eq!(
        std::fs::read(Path::new(&registered.artifacts_dir).join("out.txt")).unwrap(),
        b"exported\n"
    );
    // The artifacts directory is not reachable through the file calls.
    assert_eq!(
        code(read(&server, &id, "out.txt").await),
        tonic::Code::NotFound
    );

    // Reserved and malformed overrides are refused before anything runs.
    for bad in [
        ("KRUNTIME_ARTIFACTS_DIR", "/tmp"),
        ("1X", "a"),
        ("A-B", "a"),
    ] {
        let mut c = command(&["true"], "");
        c.env = env(&[bad]);
        assert_eq!(
            code(op(&server, &id, Operation::Command(c)).await),
            tonic::Code::InvalidArgument
        );
    }

    // cwd problems are results of the operation.
    std::os::unix::fs::symlink("../artifacts", ws.join("escape")).unwrap();
    std::fs::write(ws.join("file"), b"x").unwrap();
    for (cwd, reason) in [
        ("escape", "PathEscapes"),
        ("missing", "NotFound"),
        ("file", "NotADirectory"),
    ] {
        let mut c = command(&["pwd"], "");
        c.cwd = cwd.to_owned();
        op(&server, &id, Operation::Command(c))
            .await
            .unwrap()
            .failed(reason);
    }
    let mut c = command(&["pwd"], "");
    c.cwd = "../x".to_owned();
    assert_eq!(
        code(op(&server, &id, Operation::Command(c)).await),
        tonic::Code::InvalidArgument
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_codes_and_signals_are_results() {
    let server = start().await;
    let id = open(&server).await;
    let done = sh(&server, &id, "echo partial; exit 3").await;
    done.failed("NonZeroExitCode");
    assert_eq!(done.completed.exit_code, Some(3));
    assert_eq!(done.stdout(), "partial\n");
    let done = sh(&server, &id, "kill -KILL $$").await;
    done.failed("Signaled");
    assert_eq!(done.completed.signal, Some(9));
    assert_eq!(done.completed.exit_code, None);
    let done = op(
        &server,
        &id,
        Operation::Command(command(&["no-such-program-kruntimes"], "")),
    )
    .await
    .unwrap();
    done.failed("StartFailed");
    assert!(
        done.completed.message.contains("no-such-program-kruntimes"),
        "{:?}",
        done.completed
    );
    // The session is still usable.
    assert_eq!(sh(&server, &id, "echo fine").await.ok(), "fine\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_stream_is_cut_at_one_mib_and_still_drained() {
    let server = start().await;
    let id = open(&server).await;
    // 3 MB on stdout (the command must not block on a full pipe once the bound is hit),
    // a little on stderr, then a line that proves the command ran to its end.
    let done = sh(
        &server,
        &id,
        "head -c 3000000 /dev/zero; echo small >&2; echo end > finished",
    )
    .await;
    done.ok();
    assert_eq!(done.stdout.len(), MIB);
    assert!(done.stdout.iter().all(|b| *b == 0));
    assert!(done.completed.stdout_truncated);
    assert_eq!(done.completed.stdout_bytes, 3_000_000);
    assert_eq!(done.stderr, b"small\n");
    assert!(!done.completed.stderr_truncated);
    let stdout_chunks: Vec<&pb::OperationOutput> = done
        .outputs
        .iter()
        .filter(|o| o.stream() == pb::LogStream::Stdout)
        .collect();
    // Exactly one chunk carries the marker: the last one of stdout.
    let marked: Vec<usize> = stdout_chunks
        .iter()
        .enumerate()
        .filter(|(_, o)| o.truncated)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(marked, vec![stdout_chunks.len() - 1]);
    assert_eq!(
        read(&server, &id, "finished").await.unwrap().content,
        b"end\n"
    );
    // Exactly 1 MiB is not cut.
    let done = sh(&server, &id, "head -c 1048576 /dev/zero >&2").await;
    assert_eq!(done.stderr.len(), MIB);
    assert!(!done.completed.stderr_truncated);
    assert!(done.outputs.iter().all(|o| !o.truncated));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_kills_the_whole_tree() {
    let server = start_process().await;
    let caps = server.capabilities().await;
    let cgroups = caps.isolation() == pb::Isolation::ProcessGroupAndCgroup;
    let id = open(&server).await;
    // Ignores SIGTERM (so only the SIGKILL after the grace period ends it); one background
    // child, and, where a cgroup can find it, one that leaves the session.
    let line = if cgroups {
        "trap '' TERM; echo $$; sleep 1000 & echo $!; setsid sleep 1000 & echo $!; wait"
    } else {
        "trap '' TERM; echo $$; sleep 1000 & echo $!; echo 0; wait"
    };
    // Long enough to read the PIDs and check them before the SIGKILL on a loaded machine.
    let req = request(&id, shell(line), Some(Duration::from_secs(3)));
    let operation_id = req.operation_id.clone();
    let mut stream = begin(&server, req).await.unwrap();
    let pids: Vec<i32> = stdout_lines(&mut stream, 3)
        .await
        .iter()
        .map(|l| l.parse().unwrap())
        .filter(|pid| *pid > 0)
        .collect();
    assert!(pids.iter().all(|pid| alive(*pid)), "{pids:?}");
    let done = finish(stream, &operation_id, true).await;
    assert_eq!(
        done.state(),
        pb::OperationState::TimedOut,
        "{:?}",
        done.completed
    );
    assert_eq!(done.completed.reason, "Timeout");
    assert_eq!(done.completed.signal, Some(9));
    // Completed comes once everything of the operation is gone.
    for pid in &pids {
        assert!(!alive(*pid), "process {pid} survived the timeout");
    }
    assert_eq!(sh(&server, &id, "echo next").await.ok(), "next\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_a_command_starts_outlives_its_operation() {
    let server = start_process().await;
    let Some(_caps) = server.capabilities_with_cgroups().await else {
        return;
    };
    let id = open(&server).await;
    let done = sh(
        &server,
        &id,
        "sleep 1000 & echo $!; setsid sleep 1000 & echo $!",
    )
    .await;
    let out = done.ok();
    for pid in out.lines().map(|l| l.parse::<i32>().unwrap()) {
        assert!(
            !alive(pid),
            "background process {pid} outlived its operation"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_call_kills_the_command() {
    let server = start_process().await;
    let caps = server.capabilities().await;
    let cgroups = caps.isolation() == pb::Isolation::ProcessGroupAndCgroup;
    let id = open(&server).await;
    let line = if cgroups {
        "echo $$; setsid sleep 1000 & echo $!; wait"
    } else {
        "echo $$; sleep 1000 & echo $!; wait"
    };
    let mut stream = begin(&server, request(&id, shell(line), None))
        .await
        .unwrap();
    let pids: Vec<i32> = stdout_lines(&mut stream, 2)
        .await
        .iter()
        .map(|l| l.parse().unwrap())
        .collect();
    assert!(pids.iter().all(|pid| alive(*pid)));
    drop(stream);
    let idle = await_idle(&server, &id).await;
    assert_eq!(idle.operations, 1);
    for pid in &pids {
        assert!(!alive(*pid), "process {pid} survived the dropped call");
    }
    assert_eq!(sh(&server, &id, "echo again").await.ok(), "again\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_operation_at_a_time_while_reads_go_on() {
    let server = start().await;
    let id = open(&server).await;
    let ws = workspace(&status(&server, &id).await.unwrap());
    std::fs::write(ws.join("notes.txt"), b"readable").unwrap();
    let first = request(&id, shell(&format!("echo ready; {AWAIT_GATE}")), None);
    let first_id = first.operation_id.clone();
    let mut stream = begin(&server, first).await.unwrap();
    assert_eq!(stdout_lines(&mut stream, 1).await, ["ready"]);

    let second = op(&server, &id, write("other.txt", b"x")).await;
    let err = second.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains(&first_id), "{err:?}");
    // Reads and listings do not wait for the operation.
    assert_eq!(
        read(&server, &id, "notes.txt").await.unwrap().content,
        b"readable"
    );
    assert!(
        list(&server, &id, "", 0, "")
            .await
            .unwrap()
            .entries
            .iter()
            .any(|e| e.path == "notes.txt")
    );

    open_gate(&ws);
    finish(stream, &first_id, true).await.ok();
    op(&server, &id, write("other.txt", b"x"))
        .await
        .unwrap()
        .ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_sends_sigterm_then_sigkill_after_the_grace_period() {
    let server = start().await;
    let id = open(&server).await;
    let registered = status(&server, &id).await.unwrap();
    let marker = Path::new(&registered.artifacts_dir).join("got-term");
    // Notes SIGTERM and carries on, so only SIGKILL ends it. The first sleep starts before
    // the trap is set: a child forked after it runs the trap too if SIGTERM reaches it
    // before it execs `sleep` (seen under gVisor), and the test would read "term" twice.
    let line = "sleep 1000 & trap 'echo term >> \"$KRUNTIME_ARTIFACTS_DIR/got-term\"' TERM; echo ready; while true; do wait $!; sleep 1000 & done";
    let req = request(&id, shell(line), None);
    let operation_id = req.operation_id.clone();
    let mut stream = begin(&server, req).await.unwrap();
    assert_eq!(stdout_lines(&mut stream, 1).await, ["ready"]);

    let grace = Duration::from_millis(800);
    let started = Instant::now();
    let closing = close_in_background(&server, &id, Some(grace), false);
    let done = finish(stream, &operation_id, true).await;
    let closed = closing.await.unwrap().unwrap();
    let elapsed = started.elapsed();
    assert_eq!(
        done.state(),
        pb::OperationState::Cancelled,
        "{:?}",
        done.completed
    );
    assert_eq!(done.completed.reason, "SessionClosed");
    assert_eq!(done.completed.signal, Some(9), "{:?}", done.completed);
    assert!(
        elapsed >= grace,
        "SIGKILL came after {elapsed:?}, before the grace period"
    );
    assert_eq!(
        std::fs::read(&marker).unwrap(),
        b"term\n",
        "SIGTERM came first, once"
    );
    assert!(closed.existed);
    assert_eq!(closed.status.unwrap().state(), pb::SessionState::Closed);

    // Without a grace period in the request, the server's flag applies: here one longer
    // than the 2 s default, so only lower bounds are asserted (a loaded machine can only
    // make the end later).
    let long_grace = Duration::from_secs(5);
    let patient = TestServer::start_with(
        tempfile::tempdir().unwrap(),
        "bash",
        &["--session-termination-grace", "5s"],
    )
    .await;
    let id = open(&patient).await;
    let line =
        "sleep 1000 & trap 'echo term' TERM; echo ready; while true; do wait $!; sleep 1000 & done";
    let req = request(&id, shell(line), None);
    let operation_id = req.operation_id.clone();
    let mut stream = begin(&patient, req).await.unwrap();
    assert_eq!(stdout_lines(&mut stream, 1).await, ["ready"]);
    let started = Instant::now();
    let closing = close_in_background(&patient, &id, None, true);
    assert_eq!(stdout_lines(&mut stream, 1).await, ["term"]);
    let done = finish(stream, &operation_id, true).await;
    assert_eq!(done.completed.reason, "SessionClosed");
    assert_eq!(done.completed.signal, Some(9), "{:?}", done.completed);
    assert!(
        started.elapsed() >= long_grace,
        "the 2 s default was used: SIGKILL came {:?} after the close",
        started.elapsed()
    );
    assert!(closing.await.unwrap().unwrap().existed);

    // A command that exits on SIGTERM ends without waiting for the grace period.
    let id = open(&server).await;
    let req = request(&id, shell("echo ready; sleep 1000 & wait $!"), None);
    let operation_id = req.operation_id.clone();
    let mut stream = begin(&server, req).await.unwrap();
    assert_eq!(stdout_lines(&mut stream, 1).await, ["ready"]);
    close(&server, &id, Some(Duration::from_secs(60)), true)
        .await
        .unwrap();
    let done = finish(stream, &operation_id, true).await;
    assert_eq!(done.completed.signal, Some(15), "{:?}", done.completed);
}

fn request_stubborn(id: &pb::ExecutionId) -> pb::SessionOperationRequest {
    request(
        id,
        shell("trap '' TERM; echo ready; while true; do sleep 1000 & wait $!; done"),
        None,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_kills_a_setsid_escapee_and_purges() {
    let server = start_process().await;
    let Some(_caps) = server.capabilities_with_cgroups().await else {
        return;
    };
    let id = open(&server).await;
    let registered = status(&server, &id).await.unwrap();
    let ws = workspace(&registered);
    // Outside the session's directories, which the close purges (the `process` backend
    // confines no path).
    let notes = tempfile::tempdir().unwrap();
    let marker = notes.path().join("escapee-term");
    // The escapee leaves the command's process group, so only the sweep of the cgroup
    // sends it SIGTERM (once: it notes each one and carries on until the SIGKILL). Its
    // first sleep starts before the trap, so no child of it runs the trap too.
    let escapee = format!(
        "sleep 1000 & trap 'echo term >> {}' TERM; echo $$; while true; do wait $!; sleep 1000 & done",
        marker.display()
    );
    let mut stream = begin(
        &server,
        request(
            &id,
            // The command ignores SIGTERM once the escapee has started (which must not
            // inherit that), so the close waits out the grace period before its SIGKILL.
            shell(&format!(
                "setsid bash -c {} & trap '' TERM; echo ready; wait",
                shell_quote(&escapee)
            )),
            None,
        ),
    )
    .await
    .unwrap();
    let lines = stdout_lines(&mut stream, 2).await;
    let pid: i32 = lines
        .iter()
        .find_map(|l| l.parse().ok())
        .unwrap_or_else(|| panic!("{lines:?}"));
    assert!(alive(pid));
    let closed = close(&server, &id, None, true).await.unwrap();
    assert!(closed.existed);
    assert!(!alive(pid), "the escapee survived the close");
    assert_eq!(
        std::fs::read(&marker).unwrap(),
        b"term\n",
        "the escapee got SIGTERM once before the SIGKILL"
    );
    assert!(!ws.exists());
    drop(stream);
}

/// `text` as one single-quoted word of a shell line.
fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_operations_are_refused_before_they_run() {
    let server = start().await;
    let id = open(&server).await;
    let mut no_operation = request(&id, shell("true"), None);
    no_operation.operation = None;
    let mut bad_id = request(&id, shell("true"), None);
    bad_id.operation_id = "op 1".to_owned();
    let mut empty_id = request(&id, shell("true"), None);
    empty_id.operation_id = String::new();
    let both = Operation::Command(command(&["true"], "true"));
    let neither = Operation::Command(command(&[], ""));
    let mut big_stdin = command(&["cat"], "");
    big_stdin.stdin = vec![b'x'; MIB + 1];
    let cases = vec![
        no_operation,
        bad_id,
        empty_id,
        request(&id, both, None),
        request(&id, neither, None),
        request(&id, Operation::Command(big_stdin), None),
        request(&id, shell("true"), Some(Duration::from_secs(301))),
        request(&id, write("big", &vec![0u8; MIB + 1]), None),
        request(&id, write("", b"x"), None),
    ];
    for case in cases {
        let err = run(&server, case).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    }
    assert_eq!(status(&server, &id).await.unwrap().operations, 0);
}

// ---------------------------------------------------------------------------------------
// Files

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_operations() {
    let server = start().await;
    let id = open(&server).await;
    let ws = workspace(&status(&server, &id).await.unwrap());

    op(&server, &id, write("a/b.txt", b"x"))
        .await
        .unwrap()
        .failed("NotFound");
    op(&server, &id, mkdir("a/b", false))
        .await
        .unwrap()
        .failed("NotFound");
    op(&server, &id, mkdir("a/b", true)).await.unwrap().ok();
    op(&server, &id, mkdir("a/b", true)).await.unwrap().ok();
    op(&server, &id, mkdir("a/b", false))
        .await
        .unwrap()
        .failed("AlreadyExists");
    op(&server, &id, write("a/b/c.txt", b"hello"))
        .await
        .unwrap()
        .ok();
    op(&server, &id, mkdir("a/b/c.txt", true))
        .await
        .unwrap()
        .failed("AlreadyExists");
    op(&server, &id, write("a/b", b"x"))
        .await
        .unwrap()
        .failed("IsADirectory");
    op(&server, &id, write("a/b/c.txt/d", b"x"))
        .await
        .unwrap()
        .failed("NotADirectory");
    let file = read(&server, &id, "a/b/c.txt").await.unwrap();
    assert_eq!(file.content, b"hello");
    assert!(!file.executable && !file.directory);
    assert_eq!(
        std::fs::metadata(ws.join("a/b/c.txt"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o644
    );
    let dir = read(&server, &id, "a/b").await.unwrap();
    assert!(dir.directory && dir.content.is_empty());

    // Executable, and replacing keeps nothing of the old content.
    op(
        &server,
        &id,
        Operation::WriteFile(pb::WriteFile {
            path: "a/b/c.txt".to_owned(),
            content: b"#!/bin/sh\necho ran\n".to_vec(),
            executable: true,
        }),
    )
    .await
    .unwrap()
    .ok();
    assert!(read(&server, &id, "a/b/c.txt").await.unwrap().executable);
    assert_eq!(sh(&server, &id, "a/b/c.txt").await.ok(), "ran\n");

    // Exactly 1 MiB reads; one byte more is out of range.
    op(&server, &id, write("max", &vec![b'm'; MIB]))
        .await
        .unwrap()
        .ok();
    assert_eq!(read(&server, &id, "max").await.unwrap().content.len(), MIB);
    sh(&server, &id, "head -c 1048577 /dev/zero > toobig")
        .await
        .ok();
    assert_eq!(
        code(read(&server, &id, "toobig").await),
        tonic::Code::OutOfRange
    );
    assert_eq!(
        code(read(&server, &id, "missing").await),
        tonic::Code::NotFound
    );
    // A FIFO does not block a read.
    mkfifo(&ws.join("fifo"));
    assert_eq!(
        code(read(&server, &id, "fifo").await),
        tonic::Code::InvalidArgument
    );

    // Rename, replacing the target as rename(2) does.
    op(&server, &id, rename("max", "a/renamed"))
        .await
        .unwrap()
        .ok();
    assert!(!ws.join("max").exists());
    op(&server, &id, write("other", b"new")).await.unwrap().ok();
    op(&server, &id, rename("other", "a/renamed"))
        .await
        .unwrap()
        .ok();
    assert_eq!(
        read(&server, &id, "a/renamed").await.unwrap().content,
        b"new"
    );
    op(&server, &id, rename("nope", "x"))
        .await
        .unwrap()
        .failed("NotFound");
    op(&server, &id, rename("a", "a/b/inside"))
        .await
        .unwrap()
        .failed("InvalidPath");

    // Delete: files, empty directories, trees only when recursive.
    op(&server, &id, delete("a", false))
        .await
        .unwrap()
        .failed("DirectoryNotEmpty");
    op(&server, &id, delete("a/renamed", false))
        .await
        .unwrap()
        .ok();
    op(&server, &id, delete("a", true)).await.unwrap().ok();
    assert!(!ws.join("a").exists());
    op(&server, &id, mkdir("empty", false)).await.unwrap().ok();
    op(&server, &id, delete("empty", false)).await.unwrap().ok();
    op(&server, &id, delete("empty", false))
        .await
        .unwrap()
        .failed("NotFound");
    // Backslashes and look-alike characters are plain bytes of one name.
    op(&server, &id, write("..\\..\\x", b"plain"))
        .await
        .unwrap()
        .ok();
    op(&server, &id, write("\u{ff0e}\u{ff0e}", b"plain"))
        .await
        .unwrap()
        .ok();
    assert_eq!(std::fs::read(ws.join("..\\..\\x")).unwrap(), b"plain");
    assert_eq!(
        std::fs::read(ws.join("\u{ff0e}\u{ff0e}")).unwrap(),
        b"plain"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn final_symlinks_out_of_the_workspace() {
    let server = start().await;
    let id = open(&server).await;
    let ws = workspace(&status(&server, &id).await.unwrap());
    let outside = server.dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("secret"), b"outside").unwrap();
    std::os::unix::fs::symlink(&outside, ws.join("dirlink")).unwrap();
    std::os::unix::fs::symlink(outside.join("secret"), ws.join("filelink")).unwrap();
    std::os::unix::fs::symlink("../../../../outside/new", ws.join("dangling")).unwrap();
    let before = tree_digest(&outside);

    // Reads, listings and writes refuse to follow them.
    for link in ["dirlink", "filelink", "dangling"] {
        assert_eq!(
            code(read(&server, &id, link).await),
            tonic::Code::InvalidArgument,
            "{link}"
        );
        op(&server, &id, write(link, b"pwned"))
            .await
            .unwrap()
            .failed("PathEscapes");
    }
    assert_eq!(
        code(list(&server, &id, "dirlink", 0, "").await),
        tonic::Code::InvalidArgument
    );
    op(&server, &id, mkdir("dirlink", false))
        .await
        .unwrap()
        .failed("AlreadyExists");
    // Exists, as a link: not followed to see whether it is a directory beneath.
    op(&server, &id, mkdir("dirlink", true))
        .await
        .unwrap()
        .failed("AlreadyExists");
    // The listing shows the links as links.
    let page = list(&server, &id, "", 0, "").await.unwrap();
    let links: Vec<&pb::FileEntry> = page.entries.iter().filter(|e| e.symlink).collect();
    assert_eq!(links.len(), 3);
    assert!(links.iter().all(|e| !e.directory && e.size_bytes == 0));

    // Rename moves a link and replaces one; delete removes the link, never the target.
    op(&server, &id, rename("filelink", "moved"))
        .await
        .unwrap()
        .ok();
    assert_eq!(
        std::fs::read_link(ws.join("moved")).unwrap(),
        outside.join("secret")
    );
    op(&server, &id, write("plain", b"in")).await.unwrap().ok();
    op(&server, &id, rename("plain", "moved"))
        .await
        .unwrap()
        .ok();
    assert_eq!(read(&server, &id, "moved").await.unwrap().content, b"in");
    op(&server, &id, delete("dirlink", true))
        .await
        .unwrap()
        .ok();
    op(&server, &id, delete("dangling", false))
        .await
        .unwrap()
        .ok();
    assert!(
        !ws.join("dirlink").exists() && std::fs::symlink_metadata(ws.join("dangling")).is_err()
    );
    assert_eq!(tree_digest(&outside), before);
}

/// Every file, directory and symlink beneath `root`: type, mode, content hash or target.
fn tree_digest(root: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap())
            .collect();
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            let path = entry.path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let mode = meta.permissions().mode();
            let value = if meta.file_type().is_symlink() {
                format!("link {}", std::fs::read_link(&path).unwrap().display())
            } else if meta.is_dir() {
                walk(root, &path, out);
                format!("dir {mode:o}")
            } else if meta.is_file() {
                let content = std::fs::read(&path).unwrap();
                format!("file {mode:o} {}", hex::encode(Sha256::digest(&content)))
            } else {
                format!("other {mode:o}")
            };
            out.insert(rel, value);
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// What a hostile path should meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hostile {
    /// Refused before the filesystem: INVALID_ARGUMENT everywhere.
    Lexical,
    /// A symlink on the way leaves the workspace: PathEscapes (INVALID_ARGUMENT for reads
    /// and listings).
    Escape,
    /// A symlink loop on the way: InvalidPath.
    Loop,
    /// Look-alike bytes of plain names under a directory that does not exist: NotFound.
    Lookalike,
}

/// The hostile paths of the suite, generated: traversal in many positions and spellings,
/// absolute paths, `.` and empty components, trailing slashes, NUL, overlong names and
/// paths, look-alike Unicode and backslashes, and symlinks (chains, directories, absolute
/// and relative) that lead out of the workspace. `tmp` is the test's directory (holding
/// the root and `outside/`).
fn hostile_paths(tmp: &Path, ws: &Path) -> Vec<(String, Hostile)> {
    let mut paths: Vec<(String, Hostile)> = Vec::new();
    let tmp_rel = tmp.to_str().unwrap().trim_start_matches('/').to_owned();
    // Traversal with `..` at many depths and positions.
    for depth in 1..=8 {
        let up = vec![".."; depth].join("/");
        for path in [
            up.clone(),
            format!("{up}/"),
            format!("{up}/outside/secret.txt"),
            format!("{up}/sentinel/secret.txt"),
            format!("a/{up}/x"),
            format!("victim.txt/{up}"),
            format!("{}/{up}", vec!["d"; depth].join("/")),
            format!("{}/{up}/{up}/etc/passwd", vec!["d"; depth].join("/")),
        ] {
            paths.push((path, Hostile::Lexical));
        }
    }
    for path in [
        "..",
        "../",
        "./..",
        "a/..",
        "a/../b",
        "a/b/../../..",
        "../victim.txt",
        "d/../../x",
        "d/e/f/../../../../x",
        "..//x",
        "../.",
        "./../x",
        ".../../x",
    ] {
        paths.push((path.to_owned(), Hostile::Lexical));
    }
    // Absolute paths.
    for path in [
        "/".to_owned(),
        "//".to_owned(),
        "///x".to_owned(),
        "/etc/passwd".to_owned(),
        "/./etc/passwd".to_owned(),
        "/../../etc/passwd".to_owned(),
        format!("/{tmp_rel}/outside/secret.txt"),
        format!("{}/victim.txt", ws.display()),
        format!("/{tmp_rel}/root/sessions/sentinel-above/secret.txt"),
    ] {
        paths.push((path, Hostile::Lexical));
    }
    // `.` components, empty components, trailing slashes.
    for path in [
        ".",
        "./",
        "./.",
        "./victim.txt",
        "victim.txt/.",
        "d/./e",
        "a//b",
        "d//e",
        "victim.txt/",
        "d/",
        "d//",
        "next/",
        "up/",
        "up//sentinel",
        "next//secret.txt",
        "d/e/f/esc/",
    ] {
        paths.push((path.to_owned(), Hostile::Lexical));
    }
    // NUL bytes anywhere.
    for path in [
        "\0",
        "a\0",
        "\0a",
        "..\0",
        "victim.txt\0",
        "next\0/secret.txt",
        "up/\0sentinel",
        "\0/etc/passwd",
        "x\0/../..",
    ] {
        paths.push((path.to_owned(), Hostile::Lexical));
    }
    // Overlong components and paths.
    paths.push(("a".repeat(256), Hostile::Lexical));
    paths.push(("a".repeat(1000), Hostile::Lexical));
    paths.push(("\u{e9}".repeat(128), Hostile::Lexical));
    paths.push((format!("up/{}", "s".repeat(256)), Hostile::Lexical));
    paths.push((format!("d/{}/x", "\u{ff0e}".repeat(86)), Hostile::Lexical));
    paths.push((vec!["ab"; 1366].join("/"), Hostile::Lexical));
    paths.push((vec!["a"; 5000].join("/"), Hostile::Lexical));
    paths.push((
        format!("{}/secret.txt", vec!["up"; 1400].join("/")),
        Hostile::Lexical,
    ));

    // Look-alikes: plain names, so only a directory of that name could make them resolve;
    // there is none.
    let lookalikes = [
        "%2e%2e",
        "%2e%2e%2f%2e%2e",
        "%252e%252e",
        "..%2f..",
        "..%c0%af..",
        "..\\..",
        "..\\..\\outside",
        "\\..\\..",
        "..\\",
        "\u{ff0e}\u{ff0e}",
        "\u{ff0e}\u{ff0e}\u{ff0f}\u{ff0e}\u{ff0e}",
        "\u{ff0e}\u{ff0e}\u{ff3c}",
        "\u{2024}\u{2024}",
        "\u{2025}",
        "\u{fe52}\u{fe52}",
        "\u{ff61}\u{ff61}",
        ".\u{200b}.",
        "..\u{200d}",
        "\u{202e}..",
        "..\u{202e}",
        "\u{200f}..",
        "\u{2066}..\u{2069}",
        ".\u{0338}.",
        "..\u{0301}",
        "\u{0307}..",
        "...",
        "....",
        "..;",
        ". .",
        "..\t",
        "\u{2215}..",
        "\u{2044}..",
    ];
    for look in lookalikes {
        paths.push((format!("{look}/outside/secret.txt"), Hostile::Lookalike));
        paths.push((format!("{look}/{look}/sentinel"), Hostile::Lookalike));
    }

    // Symlinks that lead out, as directories on the way (see `plant_symlinks`).
    let escapes: &[(&str, &[&str])] = &[
        (
            "up",
            &[
                "sentinel",
                "sentinel/secret.txt",
                "sentinel/dir/inner.txt",
                "sentinel/new.txt",
                "sentinel/newdir/deeper",
                "artifacts/keep.txt",
                "workspace/victim.txt",
            ],
        ),
        (
            "up2",
            &[
                "sentinel-above",
                "sentinel-above/secret.txt",
                "sentinel-above/new.txt",
            ],
        ),
        (
            "up3",
            &["sessions/sentinel-above/secret.txt", "sessions", "new.txt"],
        ),
        (
            "up4",
            &[
                "outside/secret.txt",
                "outside/dir/inner.txt",
                "outside/new.txt",
                "root",
            ],
        ),
        (
            "abs",
            &["secret.txt", "dir", "dir/inner.txt", "new.txt", "newdir/x"],
        ),
        ("absroot", &["etc/passwd", "etc/new-file", "tmp"]),
        ("abs_in", &["victim.txt", "d", "new.txt"]),
        (
            "next",
            &["secret.txt", "dir", "dir/inner.txt", "new.txt", "newdir/x"],
        ),
        ("art", &["keep.txt", "new.txt", "sub/x"]),
        (
            "c0",
            &[
                "sentinel/secret.txt",
                "sentinel",
                "sentinel/new.txt",
                "workspace/victim.txt",
            ],
        ),
        ("c1", &["sentinel/secret.txt", "artifacts"]),
        (
            "d/e/f/esc",
            &["sentinel/secret.txt", "sentinel/dir", "sentinel/new.txt"],
        ),
        (
            "d/link2",
            &[
                "sentinel/secret.txt",
                "sentinel/new.txt",
                "artifacts/keep.txt",
            ],
        ),
        ("d/e/chain", &["sentinel/secret.txt", "sentinel/new.txt"]),
        ("sneak", &["new.txt", "e"]),
        ("dirout", &["secret.txt", "new.txt", "dir/inner.txt"]),
    ];
    for (link, suffixes) in escapes {
        for suffix in *suffixes {
            paths.push((format!("{link}/{suffix}"), Hostile::Escape));
        }
    }
    for path in ["loop1/x", "loop2/x/y", "d/loop/x", "loop1/loop2/secret.txt"] {
        paths.push((path.to_owned(), Hostile::Loop));
    }
    // Some generated spellings coincide (`../` at depth 1 and in the list): keep one.
    let mut seen = BTreeSet::new();
    paths.retain(|(path, _)| seen.insert(path.clone()));
    paths
}

/// The symlinks the suite goes through (relative to the workspace, whose parent is the
/// session directory `root/sessions/<uid>/`, next to `sentinel/` and `artifacts/`).
fn plant_symlinks(tmp: &Path, ws: &Path) {
    let link = |target: &str, at: &str| {
        std::os::unix::fs::symlink(target, ws.join(at)).unwrap();
    };
    std::fs::create_dir_all(ws.join("d/e/f")).unwrap();
    std::fs::write(ws.join("victim.txt"), b"victim").unwrap();
    link("..", "up");
    link("../..", "up2");
    link("../../..", "up3");
    link("../../../..", "up4");
    link(tmp.join("outside").to_str().unwrap(), "abs");
    link("/", "absroot");
    link(ws.to_str().unwrap(), "abs_in");
    link("../sentinel", "next");
    link("../artifacts", "art");
    link("c1", "c0");
    link("c2", "c1");
    link("..", "c2");
    link("../../../..", "d/e/f/esc");
    link("e/f/esc", "d/link2");
    link("f/esc", "d/e/chain");
    link("../workspace/d", "sneak");
    link("../../../../outside", "dirout");
    link("loop2", "loop1");
    link("loop1", "loop2");
    link("loop", "d/loop");
}

/// The sentinel trees outside the workspace: next to it (in the session directory), above
/// it, and far above it; plus the artifacts directory.
fn plant_sentinels(tmp: &Path, session_dir: &Path) -> Vec<PathBuf> {
    let trees = vec![
        session_dir.join("sentinel"),
        session_dir.parent().unwrap().join("sentinel-above"),
        tmp.join("outside"),
        session_dir.join("artifacts"),
    ];
    for tree in &trees {
        std::fs::create_dir_all(tree.join("dir/sub")).unwrap();
        std::fs::write(tree.join("secret.txt"), b"do not touch").unwrap();
        std::fs::write(tree.join("keep.txt"), b"keep").unwrap();
        std::fs::write(tree.join("dir/inner.txt"), b"inner").unwrap();
        std::fs::write(tree.join("dir/sub/deep.txt"), b"deep").unwrap();
        std::os::unix::fs::symlink("../secret.txt", tree.join("dir/link")).unwrap();
    }
    trees
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_safety_suite() {
    let server = start().await;
    let id = open(&server).await;
    let ws = workspace(&status(&server, &id).await.unwrap());
    let session_dir = ws.parent().unwrap().to_owned();
    let tmp = server.dir.path().canonicalize().unwrap();
    let trees = plant_sentinels(&tmp, &session_dir);
    plant_symlinks(&tmp, &ws);
    // Everything outside the workspace that a path could reach: the whole test directory
    // but the workspace itself.
    let outside_digest = || -> Vec<BTreeMap<String, String>> {
        let mut digests: Vec<_> = trees.iter().map(|t| tree_digest(t)).collect();
        let mut top = tree_digest(&tmp);
        let ws_rel = ws
            .strip_prefix(&tmp)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        top.retain(|path, _| !path.starts_with(&ws_rel) && !path.ends_with("rs.sock"));
        digests.push(top);
        digests
    };
    let before = outside_digest();
    let workspace_before = tree_digest(&ws);
    let paths = hostile_paths(&tmp, &ws);
    assert!(paths.len() >= 200, "only {} hostile paths", paths.len());

    let mut checked = 0usize;
    for (path, kind) in &paths {
        let what = format!("{kind:?} {:?}", path.chars().take(80).collect::<String>());
        // Reads and listings: an error, never content.
        let expected_read = match kind {
            Hostile::Lexical | Hostile::Escape | Hostile::Loop => tonic::Code::InvalidArgument,
            Hostile::Lookalike => tonic::Code::NotFound,
        };
        assert_eq!(
            code(read(&server, &id, path).await),
            expected_read,
            "read {what}"
        );
        assert_eq!(
            code(list(&server, &id, path, 0, "").await),
            expected_read,
            "list {what}"
        );

        // Mutations: refused before they run, or FAILED with the reason.
        let mut operations = vec![
            write(path, b"pwned"),
            mkdir(path, false),
            delete(path, false),
            delete(path, true),
            rename(path, "landing"),
            rename("victim.txt", path),
        ];
        if *kind != Hostile::Lookalike {
            // For look-alikes this would create plain directories inside the workspace.
            operations.push(mkdir(path, true));
        }
        for operation in operations {
            let shown = format!("{operation:?}")
                .chars()
                .take(120)
                .collect::<String>();
            match (kind, op(&server, &id, operation).await) {
                (Hostile::Lexical, Err(status)) => {
                    assert_eq!(
                        status.code(),
                        tonic::Code::InvalidArgument,
                        "{shown} {what}"
                    );
                }
                (Hostile::Lexical, Ok(done)) => panic!(
                    "{shown} {what} reached the filesystem: {:?}",
                    done.completed
                ),
                (_, Err(status)) => panic!("{shown} {what} failed as a call: {status:?}"),
                (Hostile::Escape, Ok(done)) => done.failed("PathEscapes"),
                (Hostile::Loop, Ok(done)) => done.failed("InvalidPath"),
                (Hostile::Lookalike, Ok(done)) => done.failed("NotFound"),
            }
            checked += 1;
        }
    }
    assert!(checked >= 1400, "{checked}");
    // Nothing outside changed; nothing inside either (every call failed).
    assert_eq!(outside_digest(), before);
    assert_eq!(tree_digest(&ws), workspace_before);
    // The session still works.
    assert_eq!(
        read(&server, &id, "victim.txt").await.unwrap().content,
        b"victim"
    );
}

// ---------------------------------------------------------------------------------------
// Listings

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_page_in_byte_order() {
    let server = start().await;
    let id = open(&server).await;
    let ws = workspace(&status(&server, &id).await.unwrap());
    // 2,500 entries: files with a pattern that does not sort numerically, some directories,
    // non-ASCII names, a symlink; plus one name that is not UTF-8, which is skipped.
    sh(&server, &id, "mkdir big && cd big && for i in $(seq 1 2490); do : > \"f$i\"; done && mkdir d1 d2 && printf x > \u{e9} && printf y > Z && : > \"e\u{301}\" && : > \"\u{ff0e}\" && ln -s f1 link && : > '~' && : > ' '").await.ok();
    sh(&server, &id, "cd big && : > $'\\xff\\xfe'").await.ok();
    let mut expected: Vec<String> = (1..=2490).map(|i| format!("f{i}")).collect();
    expected.extend(
        [
            "d1", "d2", "\u{e9}", "Z", "e\u{301}", "\u{ff0e}", "link", "~", " ",
        ]
        .map(str::to_owned),
    );
    expected.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    assert_eq!(expected.len(), 2499);
    assert_eq!(std::fs::read_dir(ws.join("big")).unwrap().count(), 2500);

    let mut seen: Vec<pb::FileEntry> = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let page = list(&server, &id, "big", 1000, &token).await.unwrap();
        pages += 1;
        assert!(page.entries.len() <= 1000);
        seen.extend(page.entries);
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
        assert!(pages < 10, "too many pages");
    }
    assert_eq!(pages, 3);
    let names: Vec<String> = seen
        .iter()
        .map(|e| e.path.strip_prefix("big/").unwrap().to_owned())
        .collect();
    assert_eq!(
        names, expected,
        "complete, in byte order, without duplicates"
    );
    assert!(names.windows(2).all(|w| w[0].as_bytes() < w[1].as_bytes()));
    let entry = |name: &str| {
        seen.iter()
            .find(|e| e.path == format!("big/{name}"))
            .unwrap()
    };
    assert!(entry("d1").directory && entry("d1").size_bytes == 0);
    assert_eq!(entry("Z").size_bytes, 1);
    assert!(entry("link").symlink && !entry("link").directory);

    // A page that holds the last entry has no token, also when it is exactly full.
    sh(
        &server,
        &id,
        "mkdir three && : > three/a && : > three/b && : > three/c",
    )
    .await
    .ok();
    let full = list(&server, &id, "three", 3, "").await.unwrap();
    assert_eq!(full.entries.len(), 3);
    assert!(full.next_page_token.is_empty());
    let short = list(&server, &id, "three", 2, "").await.unwrap();
    assert_eq!(short.entries.len(), 2);
    let rest = list(&server, &id, "three", 2, &short.next_page_token)
        .await
        .unwrap();
    assert_eq!(rest.entries.len(), 1);
    assert_eq!(rest.entries[0].path, "three/c");
    assert!(rest.next_page_token.is_empty());

    // Limit 0 is 100; 1001 is refused.
    let page = list(&server, &id, "big", 0, "").await.unwrap();
    assert_eq!(page.entries.len(), 100);
    assert!(!page.next_page_token.is_empty());
    let resumed = list(&server, &id, "big", 5, &page.next_page_token)
        .await
        .unwrap();
    assert_eq!(resumed.entries[0].path, format!("big/{}", expected[100]));
    assert_eq!(
        code(list(&server, &id, "big", 1001, "").await),
        tonic::Code::InvalidArgument
    );
    assert_eq!(
        list(&server, &id, "big", 1000, "")
            .await
            .unwrap()
            .entries
            .len(),
        1000
    );

    // Tokens: malformed, or made for another directory.
    op(&server, &id, mkdir("other", false)).await.unwrap().ok();
    for bad in [
        "not base64!".to_owned(),
        "eyJ2IjoxfQ".to_owned(),
        format!("{}=", page.next_page_token),
        base64_url(r#"{"v":2,"path":"big","after":"f1"}"#),
        base64_url(r#"{"v":1,"path":"big","after":"../x"}"#),
        base64_url(r#"{"v":1,"path":"big"}"#),
    ] {
        let result = list(&server, &id, "big", 10, &bad).await;
        let err = result.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{bad}");
        assert!(
            !err.message().contains(&bad),
            "the token was echoed: {err:?}"
        );
    }
    let result = list(&server, &id, "other", 10, &page.next_page_token).await;
    assert_eq!(code(result), tonic::Code::InvalidArgument);
    let result = list(&server, &id, "", 10, &page.next_page_token).await;
    assert_eq!(code(result), tonic::Code::InvalidArgument);
    // A token is portable: made by hand in the documented format.
    let handmade = base64_url(r#"{"v":1,"path":"big","after":"f998"}"#);
    let page = list(&server, &id, "big", 2, &handmade).await.unwrap();
    assert_eq!(page.entries[0].path, "big/f999");
    // Listing a file or a missing directory.
    assert_eq!(
        code(list(&server, &id, "big/f1", 0, "").await),
        tonic::Code::InvalidArgument
    );
    assert_eq!(
        code(list(&server, &id, "nope", 0, "").await),
        tonic::Code::NotFound
    );
}

fn base64_url(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_cgroups_the_process_group_is_killed() {
    let server = TestServer::start_with(
        tempfile::tempdir().unwrap(),
        "bash",
        &[
            "--session-termination-grace",
            "400ms",
            "--cgroups",
            "off",
            "--sandbox",
            "process",
        ],
    )
    .await;
    assert_eq!(
        server.capabilities().await.isolation(),
        pb::Isolation::ProcessGroup
    );
    let id = open(&server).await;
    // A timeout: SIGTERM is ignored, so SIGKILL to the group ends both.
    let req = request(
        &id,
        shell("trap '' TERM; echo $$; sleep 1000 & echo $!; wait"),
        Some(Duration::from_secs(2)),
    );
    let operation_id = req.operation_id.clone();
    let mut stream = begin(&server, req).await.unwrap();
    let pids: Vec<i32> = stdout_lines(&mut stream, 2)
        .await
        .iter()
        .map(|l| l.parse().unwrap())
        .collect();
    let done = finish(stream, &operation_id, true).await;
    assert_eq!(done.state(), pb::OperationState::TimedOut);
    for pid in &pids {
        assert!(!alive(*pid), "process {pid} survived the timeout");
    }
    // A background child left when the command exits is killed with its group.
    let out = sh(&server, &id, "sleep 1000 & echo $!").await.ok();
    assert!(!alive(out.trim().parse().unwrap()));
    // A dropped call.
    let mut stream = begin(
        &server,
        request(&id, shell("echo $$; sleep 1000 & echo $!; wait"), None),
    )
    .await
    .unwrap();
    let pids: Vec<i32> = stdout_lines(&mut stream, 2)
        .await
        .iter()
        .map(|l| l.parse().unwrap())
        .collect();
    drop(stream);
    await_idle(&server, &id).await;
    for pid in &pids {
        assert!(!alive(*pid), "process {pid} survived the dropped call");
    }
    // Close while a command runs.
    let req = request_stubborn(&id);
    let operation_id = req.operation_id.clone();
    let mut stream = begin(&server, req).await.unwrap();
    assert_eq!(stdout_lines(&mut stream, 1).await, ["ready"]);
    assert!(close(&server, &id, None, true).await.unwrap().existed);
    let done = finish(stream, &operation_id, true).await;
    assert_eq!(done.completed.reason, "SessionClosed");
    assert_eq!(done.completed.signal, Some(9));
}

/// A `namespaces` server whose sandboxes start programs through their PID 1 (the
/// default), or from a fork of the server that enters the sandbox.
async fn start_namespaces(launcher: bool) -> TestServer {
    TestServer::start_with(
        tempfile::tempdir().unwrap(),
        "bash",
        &[
            "--sandbox",
            "namespaces",
            "--sandbox-launcher",
            if launcher { "true" } else { "false" },
        ],
    )
    .await
}

/// What a program started by the sandbox's init finds at its start (bash passes its own
/// start-up signal mask on to `grep`): no blocked or ignored signal (the init blocks
/// SIGCHLD and ignores SIGPIPE for itself), the server's OOM score (the init protects only
/// itself), a session and process group of its own, only its standard descriptors, and
/// the confinement of the escape suite. Through a fork of the server (`--sandbox-launcher
/// false`), the same where that path gives it; the parent differs (the init, or a waiter
/// outside the sandbox's PID namespace).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_starts_as_clean_through_the_init_as_through_a_fork() {
    for launcher in [true, false] {
        let server = start_namespaces(launcher).await;
        let server_oom =
            std::fs::read_to_string(format!("/proc/{}/oom_score_adj", server.child.id())).unwrap();
        let id = open(&server).await;
        let out = sh(
            &server,
            &id,
            "grep -E '^(SigBlk|SigIgn|CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status | tr -s '\\t ' ' '; \
             echo oom=$(cat /proc/$$/oom_score_adj); \
             read -r _ _ _ ppid pgrp sid _ < /proc/$$/stat; echo ppid=$ppid; \
             [ \"$pgrp\" = $$ ] && [ \"$sid\" = $$ ] && echo leader=yes; \
             ls /proc/self/fd > /tmp/fds; echo fds=$(sort -n /tmp/fds | tr '\\n' ' ')",
        )
        .await
        .ok();
        let lines: Vec<&str> = out.lines().collect();
        // The test harness passes descriptors without close-on-exec and signal 32 ignored
        // to the server (which kept both for its programs before).
        let common = [
            "SigBlk: 0000000000000000",
            "SigIgn: 0000000000000000",
            "CapEff: 0000000000000000",
            "CapBnd: 0000000000000000",
            "NoNewPrivs: 1",
            "Seccomp: 2",
            // `ls`'s own: the standard three and the directory it reads.
            "fds=0 1 2 3",
        ];
        // Through a fork of the server, the program is not the leader of its session (its
        // waiter is).
        let init_only = ["leader=yes"];
        for line in common.iter().chain(init_only.iter().filter(|_| launcher)) {
            assert!(
                lines.contains(line),
                "launcher {launcher}: {line:?} in {out}"
            );
        }
        assert!(
            lines.contains(&format!("oom={}", server_oom.trim()).as_str()),
            "launcher {launcher}: {out}"
        );
        let parent = if launcher { "ppid=1" } else { "ppid=0" };
        assert!(lines.contains(&parent), "launcher {launcher}: {out}");
        // Exit codes, signals and output arrive the same way.
        let done = sh(&server, &id, "echo out; echo err >&2; exit 7").await;
        done.failed("NonZeroExitCode");
        assert_eq!(done.completed.exit_code, Some(7));
        assert_eq!(
            (done.stdout(), done.stderr.as_slice()),
            ("out\n".to_owned(), &b"err\n"[..])
        );
        let done = sh(&server, &id, "kill -TERM $$").await;
        done.failed("Signaled");
        assert_eq!(done.completed.signal, Some(15));
    }
}

/// A command too large for one message to the sandbox's init (over 32 KiB of arguments)
/// travels in a sealed memfd and arrives whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_command_reaches_the_sandbox_whole() {
    let server = start_namespaces(true).await;
    let id = open(&server).await;
    let big: String = (0..100 * 1024)
        .map(|i| (b'a' + (i % 26) as u8) as char)
        .collect();
    let done = op(
        &server,
        &id,
        Operation::Command(command(
            &[
                "bash",
                "-c",
                "printf '%s' \"$1\" | sha256sum | cut -d' ' -f1",
                "_",
                &big,
            ],
            "",
        )),
    )
    .await
    .unwrap();
    let expected = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(big.as_bytes()))
    };
    assert_eq!(done.ok().trim(), expected);
}
