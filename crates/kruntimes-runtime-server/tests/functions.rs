//! End-to-end tests of function mode (`FunctionRuntime`) in the `kruntimes-runtime-server`
//! binary: real interpreters, a real Unix socket, temporary directories. Synchronisation
//! uses the server's answers and FIFOs the handlers open (a blocking open returns exactly
//! when the other side arrives), always with a deadline; never sleeps in the test.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use common::{DEADLINE, TestServer, new_id};
use kruntimes_proto::runtime::v1 as pb;
use serde_json::{Value, json};

fn files(entries: &[(&str, &str)]) -> Vec<pb::SourceFile> {
    entries
        .iter()
        .map(|(path, content)| pb::SourceFile {
            path: (*path).to_owned(),
            content: content.as_bytes().to_vec(),
            executable: false,
        })
        .collect()
}

fn registration(
    id: &pb::ExecutionId,
    handler: &str,
    sources: &[(&str, &str)],
) -> pb::RegisterFunctionRequest {
    pb::RegisterFunctionRequest {
        id: Some(id.clone()),
        files: files(sources),
        handler: handler.to_owned(),
        env: Vec::new(),
        load_timeout: None,
        concurrency: 0,
    }
}

async fn register(
    server: &TestServer,
    request: pb::RegisterFunctionRequest,
) -> Result<pb::FunctionStatusResponse, tonic::Status> {
    server
        .functions
        .clone()
        .register_function(request)
        .await
        .map(|r| r.into_inner())
}

/// Registers `sources` for `id` with `handler`; the registration must succeed.
async fn register_ok(
    server: &TestServer,
    id: &pb::ExecutionId,
    handler: &str,
    sources: &[(&str, &str)],
) -> pb::FunctionStatusResponse {
    register(server, registration(id, handler, sources))
        .await
        .unwrap()
}

/// Registers the module `main.py` holding `source` with the handler `main:handler`; the
/// registration must succeed.
async fn register_main(
    server: &TestServer,
    id: &pb::ExecutionId,
    source: &str,
) -> pb::FunctionStatusResponse {
    register_ok(server, id, "main:handler", &[("main.py", source)]).await
}

fn invocation(
    registration_id: &str,
    invocation_id: &str,
    payload: &[u8],
    timeout: Option<Duration>,
) -> pb::InvokeFunctionRequest {
    pb::InvokeFunctionRequest {
        registration_id: registration_id.to_owned(),
        invocation_id: invocation_id.to_owned(),
        payload: payload.to_vec(),
        timeout: timeout.map(|t| t.try_into().unwrap()),
    }
}

async fn invoke_with(
    server: &TestServer,
    registration_id: &str,
    payload: &[u8],
    timeout: Option<Duration>,
) -> Result<pb::InvokeFunctionResponse, tonic::Status> {
    server
        .functions
        .clone()
        .invoke_function(invocation(registration_id, "inv-1", payload, timeout))
        .await
        .map(|r| r.into_inner())
}

/// Starts an invocation in the background, for a test that acts while it is in flight.
fn spawn_invoke(
    server: &TestServer,
    registration_id: &str,
    invocation_id: &str,
    payload: &[u8],
) -> tokio::task::JoinHandle<Result<pb::InvokeFunctionResponse, tonic::Status>> {
    let mut client = server.functions.clone();
    let request = invocation(registration_id, invocation_id, payload, None);
    tokio::spawn(async move {
        client
            .invoke_function(request)
            .await
            .map(|r| r.into_inner())
    })
}

async fn invoke(
    server: &TestServer,
    registration_id: &str,
    payload: Value,
) -> pb::InvokeFunctionResponse {
    invoke_with(
        server,
        registration_id,
        payload.to_string().as_bytes(),
        None,
    )
    .await
    .unwrap()
}

async fn status(
    server: &TestServer,
    registration_id: &str,
) -> Result<pb::FunctionStatusResponse, tonic::Status> {
    server
        .functions
        .clone()
        .function_status(pb::FunctionStatusRequest {
            registration_id: registration_id.to_owned(),
        })
        .await
        .map(|r| r.into_inner())
}

/// Asserts that the server knows no registration `registration_id`.
async fn assert_not_found(server: &TestServer, registration_id: &str) {
    let err = status(server, registration_id).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
}

async fn unregister(server: &TestServer, request: pb::UnregisterFunctionRequest) -> bool {
    server
        .functions
        .clone()
        .unregister_function(request)
        .await
        .unwrap()
        .into_inner()
        .existed
}

fn by_id(registration_id: &str) -> pb::UnregisterFunctionRequest {
    pb::UnregisterFunctionRequest {
        registration_id: registration_id.to_owned(),
        id: None,
    }
}

/// Unregisters what the Run `id` registered, up to its attempt.
fn by_identity(id: &pb::ExecutionId) -> pb::UnregisterFunctionRequest {
    pb::UnregisterFunctionRequest {
        registration_id: String::new(),
        id: Some(id.clone()),
    }
}

async fn list(server: &TestServer) -> Vec<pb::FunctionStatusResponse> {
    server
        .functions
        .clone()
        .list_functions(pb::ListFunctionsRequest {})
        .await
        .unwrap()
        .into_inner()
        .functions
}

fn result(response: &pb::InvokeFunctionResponse) -> Value {
    assert_eq!(
        response.outcome(),
        pb::InvocationOutcome::Succeeded,
        "{response:?}"
    );
    serde_json::from_slice(&response.result).unwrap()
}

fn error(response: &pb::InvokeFunctionResponse) -> &pb::InvocationError {
    response.error.as_ref().expect("an invocation error")
}

fn stdout(response: &pb::InvokeFunctionResponse) -> String {
    String::from_utf8(response.stdout.clone().unwrap().data).unwrap()
}

fn stderr(response: &pb::InvokeFunctionResponse) -> String {
    String::from_utf8(response.stderr.clone().unwrap().data).unwrap()
}

fn function_dir(server: &TestServer, id: &pb::ExecutionId) -> PathBuf {
    server
        .root()
        .join("functions")
        .join(&id.run_uid)
        .join(id.attempt.to_string())
}

fn cgroup_of(caps: &pb::CapabilitiesResponse, id: &pb::ExecutionId) -> Option<PathBuf> {
    (caps.isolation() == pb::Isolation::ProcessGroupAndCgroup)
        .then(|| Path::new(&caps.cgroup_parent).join(format!("fn-{}-{}", id.run_uid, id.attempt)))
}

/// Live processes started for this Run's registrations: by their environment, or, for an
/// interpreter bound from the warm spare (whose `/proc/<pid>/environ` is still the one it
/// started with), by its working directory.
fn processes_of(id: &pb::ExecutionId) -> Vec<i32> {
    let marker = format!("KRUNTIME_RUN_UID={}", id.run_uid);
    kruntimes_testkit::procs::matching(|p| {
        p.environ.contains(&marker)
            || p.cwd
                .as_ref()
                .is_some_and(|cwd| cwd.to_string_lossy().contains(&id.run_uid))
    })
    .into_iter()
    .map(|p| p.pid)
    .collect()
}

/// Live processes of this server's warm spare (not yet bound).
fn spares_of(server: &TestServer) -> Vec<kruntimes_testkit::procs::Proc> {
    let dir = server.root().join("functions/spare");
    kruntimes_testkit::procs::matching(|p| p.cwd.as_deref() == Some(dir.as_path()))
}

/// Waits until the server's warm spare has imported its modules and blocks reading its
/// request pipe. Polls the process table: there is nothing to wait on for a process the
/// test did not start.
async fn await_spare(server: &TestServer) {
    let deadline = std::time::Instant::now() + DEADLINE;
    loop {
        let waiting = spares_of(server).iter().any(|p| {
            std::fs::read_to_string(format!("/proc/{}/wchan", p.pid))
                .is_ok_and(|wchan| wchan.contains("pipe"))
        });
        if waiting {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no spare within the deadline"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Whether the interpreter `pid` was started as the warm spare.
fn was_spare(pid: i64) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap()
        .split(|b| *b == 0)
        .any(|arg| arg == b"--spare")
}

fn alive(pid: i64) -> bool {
    let pid = i32::try_from(pid).unwrap();
    !kruntimes_testkit::procs::matching(|p| p.pid == pid).is_empty()
}

fn mkfifo(path: &Path) {
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success());
}

/// Blocks (off the runtime, within the deadline) until a writer opens the FIFO and closes
/// it again.
async fn await_fifo(path: &Path) {
    fifo_end(path, false, "reach").await;
}

/// Opens the FIFO for writing (blocking until the handler opens it for reading) and closes
/// it, which lets the handler go on.
async fn release_fifo(path: &Path) {
    fifo_end(path, true, "open").await;
}

/// Opens the FIFO's read end (reading it to its end) or its write end (writing "go"), off
/// the runtime. At the deadline it opens the other end itself, so that the blocked thread
/// ends and the test fails rather than hangs in the runtime's shutdown.
async fn fifo_end(path: &Path, write: bool, what: &str) {
    let owned = path.to_owned();
    let blocked = tokio::task::spawn_blocking(move || match write {
        true => std::fs::write(owned, b"go").unwrap(),
        false => drop(std::fs::read(owned).unwrap()),
    });
    if let Ok(done) = tokio::time::timeout(DEADLINE, blocked).await {
        done.unwrap();
        return;
    }
    let _ = std::fs::OpenOptions::new()
        .read(write)
        .write(!write)
        .custom_flags(libc::O_NONBLOCK)
        .open(path);
    panic!(
        "the handler did not {what} {} within the deadline",
        path.display()
    );
}

const ECHO_PY: &str = r#"
import sys

calls = 0

def handler(event):
    global calls
    calls += 1
    print("hello from the handler")
    print("a warning", file=sys.stderr)
    return {"echo": event, "calls": calls}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capabilities_list_the_function_runtime() {
    let server = TestServer::start_process("python").await;
    let caps = server.capabilities().await;
    assert!(
        caps.services
            .contains(&pb::FUNCTION_RUNTIME_SERVICE.to_owned()),
        "{caps:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_handler_returns_json_and_its_prints_go_to_the_log_tails() {
    let server = TestServer::start_process("python").await;
    let id = new_id();
    let registered = register_ok(
        &server,
        &id,
        "app.main:handler",
        &[("app/main.py", ECHO_PY)],
    )
    .await;
    assert_eq!(registered.state(), pb::FunctionState::Ready);
    assert_eq!(registered.reason, "Registered");
    assert_eq!(registered.id.as_ref(), Some(&id));
    assert!(!registered.registration_id.is_empty());
    assert!(
        function_dir(&server, &id)
            .join("work/app/main.py")
            .is_file()
    );

    let response = invoke(
        &server,
        &registered.registration_id,
        json!({"x": [1, 2, "é"]}),
    )
    .await;
    assert_eq!(
        result(&response),
        json!({"echo": {"x": [1, 2, "é"]}, "calls": 1})
    );
    assert_eq!(stdout(&response), "hello from the handler\n");
    assert_eq!(stderr(&response), "a warning\n");
    assert!(!String::from_utf8_lossy(&response.result).contains("hello"));
    assert!(response.duration.is_some());

    // The interpreter persists: module state carries over, each tail holds only its call.
    let again = invoke(&server, &registered.registration_id, json!(null)).await;
    assert_eq!(result(&again), json!({"echo": null, "calls": 2}));
    assert_eq!(stdout(&again), "hello from the handler\n");
    assert_eq!(again.stdout.unwrap().total_bytes, 23);

    // "module.function" works as well as "module:function".
    let other = new_id();
    let dotted = register_ok(&server, &other, "main.handler", &[("main.py", ECHO_PY)]).await;
    assert_eq!(
        result(&invoke(&server, &dotted.registration_id, json!(7)).await),
        json!({"echo": 7, "calls": 1})
    );
    let listed = list(&server).await;
    assert_eq!(listed.len(), 2, "{listed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_exceptions_fail_the_invocation_with_type_message_and_traceback() {
    let server = TestServer::start_process("python").await;
    let id = new_id();
    let source = r#"
def check(value):
    if value < 0:
        raise ValueError(f"negative: {value}")
    return value

def handler(event):
    print("before the error")
    return check(event)
"#;
    let registered = register_main(&server, &id, source).await;
    let failed = invoke(&server, &registered.registration_id, json!(-3)).await;
    assert_eq!(failed.outcome(), pb::InvocationOutcome::Failed);
    let e = error(&failed);
    assert_eq!(e.r#type, "ValueError");
    assert_eq!(e.message, "negative: -3");
    assert!(e.traceback.contains("main.py"), "{}", e.traceback);
    assert!(e.traceback.contains("in check"), "{}", e.traceback);
    assert!(
        e.traceback.trim_end().ends_with("ValueError: negative: -3"),
        "{}",
        e.traceback
    );
    assert!(
        !e.traceback.contains("<string>"),
        "launcher frames are hidden: {}",
        e.traceback
    );
    assert!(failed.result.is_empty());
    assert_eq!(stdout(&failed), "before the error\n");
    // The interpreter survives a handler's exception.
    assert_eq!(
        result(&invoke(&server, &registered.registration_id, json!(4)).await),
        json!(4)
    );

    // A result that is not JSON, and one that is too large.
    let other = new_id();
    let source =
        "def handler(event):\n    return {1, 2} if event == 'set' else 'x' * (1024 * 1024 + 1)\n";
    let registered = register_main(&server, &other, source).await;
    let not_json = invoke(&server, &registered.registration_id, json!("set")).await;
    assert_eq!(not_json.outcome(), pb::InvocationOutcome::Failed);
    assert_eq!(error(&not_json).r#type, "ResultNotJson");
    let too_large = invoke(&server, &registered.registration_id, json!("big")).await;
    assert_eq!(too_large.outcome(), pb::InvocationOutcome::Failed);
    assert_eq!(error(&too_large).r#type, "ResultTooLarge");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_parameter_handler_receives_the_context() {
    let server = TestServer::start_process("python").await;
    let mut id = new_id();
    id.attempt = 4;
    let source = "import os\n\ndef handler(event, context):\n    return {'event': event, 'context': context, 'cwd': os.getcwd(), 'env': os.environ.get('GREETING')}\n";
    let mut request = registration(&id, "main:handler", &[("main.py", source)]);
    request.env = vec![pb::EnvVar {
        name: "GREETING".to_owned(),
        value: "hi".to_owned(),
    }];
    let registered = register(&server, request).await.unwrap();
    let response = invoke(&server, &registered.registration_id, json!("e")).await;
    let work = function_dir(&server, &id).join("work");
    assert_eq!(
        result(&response),
        json!({
            "event": "e",
            "context": {"invocation_id": "inv-1", "run_uid": id.run_uid, "attempt": 4},
            "cwd": work.display().to_string(),
            "env": "hi",
        })
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_generations_follow_the_attempt() {
    let server = TestServer::start_process("python").await;
    let id = new_id();
    let request = registration(&id, "main:handler", &[("main.py", ECHO_PY)]);
    let first = register(&server, request.clone()).await.unwrap();
    // The same configuration (another load timeout does not count) returns the same ID.
    let mut repeat = request.clone();
    repeat.load_timeout = Some(Duration::from_secs(5).try_into().unwrap());
    let second = register(&server, repeat).await.unwrap();
    assert_eq!(first.registration_id, second.registration_id);
    assert_eq!(first.registered_at, second.registered_at);
    assert_eq!(processes_of(&id).len(), 1, "one interpreter");

    let mut conflicting = request.clone();
    conflicting.handler = "main:other".to_owned();
    let err = register(&server, conflicting).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::AlreadyExists, "{err:?}");

    let mut next = request.clone();
    next.id.as_mut().unwrap().attempt = 2;
    let newer = register(&server, next.clone()).await.unwrap();
    assert_ne!(newer.registration_id, first.registration_id);
    assert_eq!(newer.id.as_ref().unwrap().attempt, 2);
    assert_not_found(&server, &first.registration_id).await;
    assert_eq!(
        invoke_with(&server, &first.registration_id, b"1", None)
            .await
            .unwrap_err()
            .code(),
        tonic::Code::NotFound
    );
    assert!(
        !function_dir(&server, &id).exists(),
        "the old generation's workspace is removed"
    );
    assert_eq!(processes_of(&id).len(), 1, "the old interpreter is gone");
    assert_eq!(
        result(&invoke(&server, &newer.registration_id, json!(1)).await)["calls"],
        1
    );

    let err = register(&server, request).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert_eq!(list(&server).await.len(), 1);

    // By identity, only attempts up to the given one are removed.
    let older = pb::ExecutionId {
        attempt: 1,
        ..id.clone()
    };
    let removed = unregister(&server, by_identity(&older)).await;
    assert!(!removed);
    assert!(status(&server, &newer.registration_id).await.is_ok());
    let current = pb::ExecutionId {
        attempt: 2,
        ..id.clone()
    };
    let removed = unregister(&server, by_identity(&current)).await;
    assert!(removed);
    assert!(list(&server).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_registrations_of_one_attempt_start_one_interpreter() {
    let server = TestServer::start_process("python").await;
    let id = new_id();
    let request = registration(&id, "main:handler", &[("main.py", ECHO_PY)]);
    let calls: Vec<_> = (0..4)
        .map(|_| {
            let mut client = server.functions.clone();
            let request = request.clone();
            tokio::spawn(async move {
                client
                    .register_function(request)
                    .await
                    .map(|r| r.into_inner())
            })
        })
        .collect();
    let mut ids = Vec::new();
    for call in calls {
        ids.push(call.await.unwrap().unwrap().registration_id);
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(processes_of(&id).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_does_not_load_fails_and_leaves_nothing_behind() {
    let server = TestServer::start_process("python").await;
    let caps = server.capabilities().await;
    let cases = [
        (
            "main:handler",
            "import no_such_module_anywhere\n",
            "ModuleNotFoundError",
        ),
        (
            "main:handler",
            "raise RuntimeError('broken at import')\n",
            "broken at import",
        ),
        (
            "main:missing",
            "def handler(event):\n    return 1\n",
            "AttributeError",
        ),
        ("main:value", "value = 3\n", "not callable"),
        (
            "main:handler",
            "def handler():\n    return 1\n",
            "no positional parameter",
        ),
        ("absent:handler", "", "No module named 'absent'"),
        (
            "main:handler",
            "import os\nos._exit(5)\n",
            "exited with code 5",
        ),
    ];
    for (handler, source, expected) in cases {
        let id = new_id();
        let err = register(&server, registration(&id, handler, &[("main.py", source)]))
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            tonic::Code::FailedPrecondition,
            "{handler} {source:?}: {err:?}"
        );
        assert!(err.message().starts_with("LoadFailed: "), "{err:?}");
        assert!(err.message().contains(expected), "{expected:?} in {err:?}");
        assert!(!server.root().join("functions").join(&id.run_uid).exists());
        if let Some(cgroup) = cgroup_of(&caps, &id) {
            assert!(!cgroup.exists(), "{}", cgroup.display());
        }
        assert!(processes_of(&id).is_empty());
    }
    assert!(list(&server).await.is_empty());

    // A load that outlasts its timeout fails the same way.
    let id = new_id();
    let mut slow = registration(
        &id,
        "main:handler",
        &[("main.py", "import time\ntime.sleep(1000)\n")],
    );
    slow.load_timeout = Some(Duration::from_millis(300).try_into().unwrap());
    let err = register(&server, slow).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(err.message().contains("longer than"), "{err:?}");
    assert!(processes_of(&id).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlapping_invocation_is_refused_at_once() {
    let server = TestServer::start_process("python").await;
    let fifos = tempfile::tempdir().unwrap();
    let started = fifos.path().join("started");
    let gate = fifos.path().join("gate");
    mkfifo(&started);
    mkfifo(&gate);
    let source = r#"
def handler(event):
    with open(event["started"], "w") as f:
        f.write("in")
    with open(event["gate"]) as f:
        f.read()
    return "done"
"#;
    let id = new_id();
    let registered = register_main(&server, &id, source).await;
    let payload = json!({"started": started, "gate": gate}).to_string();
    let first = spawn_invoke(
        &server,
        &registered.registration_id,
        "first",
        payload.as_bytes(),
    );
    await_fifo(&started).await;

    let busy = invoke_with(
        &server,
        &registered.registration_id,
        payload.as_bytes(),
        None,
    )
    .await
    .unwrap_err();
    assert_eq!(busy.code(), tonic::Code::ResourceExhausted, "{busy:?}");
    let during = status(&server, &registered.registration_id).await.unwrap();
    assert_eq!(during.in_flight, 1);

    release_fifo(&gate).await;
    let first = joined(first).await;
    assert_eq!(result(&first), json!("done"));
    let after = status(&server, &registered.registration_id).await.unwrap();
    assert_eq!(after.in_flight, 0);
    assert_eq!(after.invocations, 1, "the refused call never started");
}

/// Registers `main.py` holding `source` with the handler `main:handler` and the given
/// concurrency; the registration must succeed.
async fn register_concurrent(
    server: &TestServer,
    id: &pb::ExecutionId,
    handler: &str,
    sources: &[(&str, &str)],
    concurrency: u32,
) -> pb::FunctionStatusResponse {
    register(
        server,
        pb::RegisterFunctionRequest {
            concurrency,
            ..registration(id, handler, sources)
        },
    )
    .await
    .unwrap()
}

/// Registers `file` holding `source` with `handler` and a concurrency of 2; its
/// registration ID and `gates` FIFO pairs.
async fn concurrent_pair(
    server: &TestServer,
    id: &pb::ExecutionId,
    handler: &str,
    file: &str,
    source: &str,
    gates: usize,
) -> (String, Gates) {
    let registered = register_concurrent(server, id, handler, &[(file, source)], 2).await;
    (registered.registration_id, Gates::new(gates))
}

/// The answer of an invocation started with [`spawn_invoke`], within the deadline.
async fn joined(
    invocation: tokio::task::JoinHandle<Result<pb::InvokeFunctionResponse, tonic::Status>>,
) -> pb::InvokeFunctionResponse {
    tokio::time::timeout(DEADLINE, invocation)
        .await
        .unwrap()
        .unwrap()
        .unwrap()
}

/// Per invocation name: a FIFO the handler writes when it has started and one it waits on.
struct Gates {
    _dir: tempfile::TempDir,
    started: Vec<PathBuf>,
    gates: Vec<PathBuf>,
}

impl Gates {
    fn new(count: usize) -> Gates {
        let dir = tempfile::tempdir().unwrap();
        let make = |kind: &str, i: usize| {
            let path = dir.path().join(format!("{kind}-{i}"));
            mkfifo(&path);
            path
        };
        Gates {
            started: (0..count).map(|i| make("started", i)).collect(),
            gates: (0..count).map(|i| make("gate", i)).collect(),
            _dir: dir,
        }
    }

    fn payload(&self, i: usize, extra: Value) -> Vec<u8> {
        json!({"name": i, "started": self.started[i], "gate": self.gates[i], "extra": extra})
            .to_string()
            .into_bytes()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_invocations_run_in_interpreters_of_their_own_up_to_the_concurrency() {
    let server = TestServer::start_process("python").await;
    let source = r#"
import os, time

def handler(event):
    print("out-%d" % event["name"])
    with open(event["started"], "w") as f:
        f.write("in")
    if event["extra"] == "hang":
        time.sleep(1000)
    with open(event["gate"]) as f:
        f.read()
    return {"name": event["name"], "pid": os.getpid()}
"#;
    let id = new_id();
    let (reg, gates) = concurrent_pair(&server, &id, "main:handler", "main.py", source, 4).await;

    // Two at once, each held in its handler; a third is refused at once.
    let first = spawn_invoke(&server, &reg, "first", &gates.payload(0, json!(null)));
    let second = spawn_invoke(&server, &reg, "second", &gates.payload(1, json!(null)));
    await_fifo(&gates.started[0]).await;
    await_fifo(&gates.started[1]).await;
    let busy = invoke_with(&server, &reg, b"0", None).await.unwrap_err();
    assert_eq!(busy.code(), tonic::Code::ResourceExhausted, "{busy:?}");
    assert_eq!(status(&server, &reg).await.unwrap().in_flight, 2);

    // Each answers with its own interpreter, and its log tail is its own.
    release_fifo(&gates.gates[1]).await;
    let second = joined(second).await;
    assert_eq!(status(&server, &reg).await.unwrap().in_flight, 1);
    release_fifo(&gates.gates[0]).await;
    let first = joined(first).await;
    assert_eq!(result(&first)["name"], 0);
    assert_eq!(result(&second)["name"], 1);
    assert_ne!(result(&first)["pid"], result(&second)["pid"]);
    assert_eq!(stdout(&first), "out-0\n");
    assert_eq!(stdout(&second), "out-1\n");

    // A timed-out invocation kills its own interpreter only: the other one goes on.
    let held = spawn_invoke(&server, &reg, "held", &gates.payload(2, json!(null)));
    await_fifo(&gates.started[2]).await;
    let hang = gates.payload(3, json!("hang"));
    let timed_out = invoke_with(&server, &reg, &hang, Some(Duration::from_secs(1)));
    let opened = await_fifo(&gates.started[3]);
    let (timed_out, ()) = tokio::join!(timed_out, opened);
    assert_eq!(
        timed_out.unwrap().outcome(),
        pb::InvocationOutcome::TimedOut
    );
    release_fifo(&gates.gates[2]).await;
    let held = joined(held).await;
    assert_eq!(held.outcome(), pb::InvocationOutcome::Succeeded, "{held:?}");
    assert_eq!(result(&held)["name"], 2);

    let after = status(&server, &reg).await.unwrap();
    assert_eq!(after.in_flight, 0);
    assert_eq!(after.invocations, 4, "the refused call never started");
    assert!(unregister(&server, by_id(&reg)).await);
    assert!(processes_of(&id).is_empty(), "{:?}", processes_of(&id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bash_invocation_that_ends_leaves_a_concurrent_one_running() {
    let server = TestServer::start_process("bash").await;
    let script = r#"
payload=$(cat)
started=$(printf '%s' "$payload" | sed -n 's/.*"started": *"\([^"]*\)".*/\1/p')
gate=$(printf '%s' "$payload" | sed -n 's/.*"gate": *"\([^"]*\)".*/\1/p')
echo in > "$started"
case "$payload" in
  *'"extra":"quick"'*) echo '"quick"' ;;
  *) cat "$gate" > /dev/null; echo '"held"' ;;
esac
"#;
    let id = new_id();
    let (reg, gates) = concurrent_pair(&server, &id, "handler.sh", "handler.sh", script, 2).await;
    let held = spawn_invoke(&server, &reg, "held", &gates.payload(0, json!(null)));
    await_fifo(&gates.started[0]).await;
    // The quick one ends, and what it started is killed: not the held one beside it.
    let payload = gates.payload(1, json!("quick"));
    let quick = invoke_with(&server, &reg, &payload, None);
    let opened = await_fifo(&gates.started[1]);
    let (quick, ()) = tokio::join!(quick, opened);
    assert_eq!(result(&quick.unwrap()), json!("quick"));
    release_fifo(&gates.gates[0]).await;
    let held = joined(held).await;
    assert_eq!(held.outcome(), pb::InvocationOutcome::Succeeded, "{held:?}");
    assert_eq!(result(&held), json!("held"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_invocation_kills_the_interpreter_and_the_next_one_gets_a_fresh_one() {
    let server = TestServer::start_process("python").await;
    let source = r#"
import os, time

calls = 0

def handler(event):
    global calls
    calls += 1
    if event == "hang":
        print("hanging")
        time.sleep(1000)
    return {"calls": calls, "pid": os.getpid()}
"#;
    let id = new_id();
    let registered = register_main(&server, &id, source).await;
    let first = result(&invoke(&server, &registered.registration_id, json!(1)).await);
    assert_eq!(first["calls"], 1);
    assert_eq!(
        result(&invoke(&server, &registered.registration_id, json!(1)).await)["calls"],
        2
    );

    let timed_out = invoke_with(
        &server,
        &registered.registration_id,
        b"\"hang\"",
        // Long enough for the handler to print before it is killed on a loaded machine.
        Some(Duration::from_secs(3)),
    )
    .await
    .unwrap();
    assert_eq!(
        timed_out.outcome(),
        pb::InvocationOutcome::TimedOut,
        "{timed_out:?}"
    );
    assert_eq!(error(&timed_out).r#type, "Timeout");
    assert_eq!(stdout(&timed_out), "hanging\n");
    assert!(
        !alive(first["pid"].as_i64().unwrap()),
        "the old interpreter is dead"
    );

    let fresh = result(&invoke(&server, &registered.registration_id, json!(1)).await);
    assert_eq!(fresh["calls"], 1, "module state starts over");
    assert_ne!(fresh["pid"], first["pid"]);
    let after = status(&server, &registered.registration_id).await.unwrap();
    assert_eq!(after.state(), pb::FunctionState::Ready);
    assert_eq!(after.invocations, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interpreter_that_exits_fails_the_invocation_and_is_restarted() {
    let server = TestServer::start_process("python").await;
    let source = "import os\n\ndef handler(event):\n    if event == 'exit':\n        os._exit(3)\n    return os.getpid()\n";
    let id = new_id();
    let registered = register_main(&server, &id, source).await;
    let before = result(&invoke(&server, &registered.registration_id, json!(0)).await);
    let exited = invoke(&server, &registered.registration_id, json!("exit")).await;
    assert_eq!(exited.outcome(), pb::InvocationOutcome::Failed);
    assert_eq!(error(&exited).r#type, "InterpreterExited");
    assert!(error(&exited).message.contains("code 3"), "{exited:?}");
    let after = result(&invoke(&server, &registered.registration_id, json!(0)).await);
    assert_ne!(before, after, "a new interpreter answers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interpreter_that_cannot_be_restarted_fails_the_registration() {
    let server = TestServer::start_process("python").await;
    // The module imports once, then refuses: the restart after the exit cannot load it.
    let source = "import os\nmarker = os.path.join(os.environ['HOME'], 'loaded')\nif os.path.exists(marker):\n    raise RuntimeError('second import')\nopen(marker, 'w').close()\n\ndef handler(event):\n    os._exit(1)\n";
    let id = new_id();
    let registered = register_main(&server, &id, source).await;
    let exited = invoke(&server, &registered.registration_id, json!(0)).await;
    assert_eq!(error(&exited).r#type, "InterpreterExited");
    let err = invoke_with(&server, &registered.registration_id, b"0", None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    let failed = status(&server, &registered.registration_id).await.unwrap();
    assert_eq!(failed.state(), pb::FunctionState::Failed);
    assert_eq!(failed.reason, "InterpreterLost");
    assert!(failed.message.contains("second import"), "{failed:?}");
    let err = invoke_with(&server, &registered.registration_id, b"0", None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(unregister(&server, by_id(&registered.registration_id)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregister_kills_a_setsid_child_and_removes_the_workspace() {
    let server = TestServer::start_process("python").await;
    let Some(caps) = server.capabilities_with_cgroups().await else {
        return;
    };
    let source = "import subprocess\n\ndef handler(event):\n    return subprocess.Popen(['sleep', '1000'], start_new_session=True).pid\n";
    let id = new_id();
    let registered = register_main(&server, &id, source).await;
    let pid = result(&invoke(&server, &registered.registration_id, json!(0)).await)
        .as_i64()
        .unwrap();
    assert!(alive(pid), "the escapee runs after the invocation");
    assert!(function_dir(&server, &id).exists());

    assert!(unregister(&server, by_id(&registered.registration_id)).await);
    // Unregister returns once the cgroup is empty: nothing to wait for.
    assert!(!alive(pid), "the setsid child was killed");
    assert!(processes_of(&id).is_empty());
    assert!(!server.root().join("functions").join(&id.run_uid).exists());
    assert!(!cgroup_of(&caps, &id).unwrap().exists());
    assert_not_found(&server, &registered.registration_id).await;
    // Idempotent, by ID and by identity.
    assert!(!unregister(&server, by_id(&registered.registration_id)).await);
    assert!(!unregister(&server, by_identity(&id)).await);
    assert!(!unregister(&server, by_id("fn-no-such-registration")).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregister_ends_an_invocation_in_flight() {
    let server = TestServer::start_process("python").await;
    let fifos = tempfile::tempdir().unwrap();
    let started = fifos.path().join("started");
    mkfifo(&started);
    let source =
        "import time\n\ndef handler(event):\n    open(event, 'w').close()\n    time.sleep(1000)\n";
    let id = new_id();
    let registered = register_main(&server, &id, source).await;
    let call = spawn_invoke(
        &server,
        &registered.registration_id,
        "long",
        json!(started).to_string().as_bytes(),
    );
    await_fifo(&started).await;
    assert!(unregister(&server, by_id(&registered.registration_id)).await);
    let ended = tokio::time::timeout(DEADLINE, call).await.unwrap().unwrap();
    assert_eq!(ended.unwrap_err().code(), tonic::Code::FailedPrecondition);
    assert!(processes_of(&id).is_empty());
    assert!(!function_dir(&server, &id).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_activity_and_invocations() {
    let server = TestServer::start_process("python").await;
    let id = new_id();
    let registered = register_main(&server, &id, ECHO_PY).await;
    let before = status(&server, &registered.registration_id).await.unwrap();
    assert_eq!(before.last_activity, before.registered_at);
    assert_eq!(before.invocations, 0);
    assert_eq!(before.in_flight, 0);
    invoke(&server, &registered.registration_id, json!(1)).await;
    let after = status(&server, &registered.registration_id).await.unwrap();
    let time = |t: Option<prost_types::Timestamp>| SystemTime::try_from(t.unwrap()).unwrap();
    assert!(
        time(after.last_activity) > time(after.registered_at),
        "{after:?}"
    );
    assert_eq!(after.registered_at, before.registered_at);
    assert_eq!(after.invocations, 1);
    assert_eq!(after.state(), pb::FunctionState::Ready);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_invocations_are_invalid_arguments() {
    let server = TestServer::start_process("python").await;
    let id = new_id();
    let registered = register_main(&server, &id, ECHO_PY).await;
    let big = format!("\"{}\"", "x".repeat(1024 * 1024));
    for payload in [big.as_bytes(), b"not json", b"{\"a\":", b"", b"1 2"] {
        let err = invoke_with(&server, &registered.registration_id, payload, None)
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    }
    // Exactly 1 MiB is accepted; echoing it back (with more around it) exceeds the bound of
    // results.
    let fits = format!("\"{}\"", "x".repeat(1024 * 1024 - 2));
    let response = invoke_with(&server, &registered.registration_id, fits.as_bytes(), None)
        .await
        .unwrap();
    assert_eq!(response.outcome(), pb::InvocationOutcome::Failed);
    assert_eq!(error(&response).r#type, "ResultTooLarge");
    let long_id = server
        .functions
        .clone()
        .invoke_function(invocation(
            &registered.registration_id,
            &"x".repeat(129),
            b"1",
            None,
        ))
        .await
        .unwrap_err();
    assert_eq!(long_id.code(), tonic::Code::InvalidArgument);
    let too_long = invoke_with(
        &server,
        &registered.registration_id,
        b"1",
        Some(Duration::from_secs(301)),
    )
    .await
    .unwrap_err();
    assert_eq!(too_long.code(), tonic::Code::InvalidArgument);

    // Malformed registrations write nothing.
    let bad = [
        registration(&id, "main", &[("main.py", ECHO_PY)]),
        registration(&id, "main:handler", &[("../main.py", ECHO_PY)]),
        pb::RegisterFunctionRequest {
            env: vec![pb::EnvVar {
                name: "KRUNTIME_RUN_UID".to_owned(),
                value: "x".to_owned(),
            }],
            ..registration(&new_id(), "main:handler", &[("main.py", ECHO_PY)])
        },
        pb::RegisterFunctionRequest {
            concurrency: 65,
            ..registration(&new_id(), "main:handler", &[("main.py", ECHO_PY)])
        },
        registration(
            &pb::ExecutionId {
                run_uid: "../x".to_owned(),
                attempt: 1,
            },
            "main:handler",
            &[],
        ),
    ];
    for request in bad {
        let err = register(&server, request).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    }
    assert_eq!(list(&server).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bash_handlers_read_the_request_on_stdin_and_answer_on_stdout() {
    let server = TestServer::start_process("bash").await;
    let id = new_id();
    let script = r#"
payload=$(cat)
case "$payload" in
  '"text"') echo "hello world" ;;
  '"fail"') echo "about to fail" >&2; echo "the last words" >&2; exit 3 ;;
  '"hang"') sleep 1000 ;;
  '"id"') echo "\"$KRUNTIME_INVOCATION_ID\"" ;;
  *) echo "{\"got\": $payload, \"cwd\": \"$PWD\"}" ;;
esac
"#;
    let registered = register_ok(
        &server,
        &id,
        "bin/handler.sh",
        &[("bin/handler.sh", script)],
    )
    .await;
    assert_eq!(registered.state(), pb::FunctionState::Ready);

    let work = function_dir(&server, &id).join("work");
    let response = invoke(&server, &registered.registration_id, json!({"n": [1, 2]})).await;
    assert_eq!(
        result(&response),
        json!({"got": {"n": [1, 2]}, "cwd": work.display().to_string()})
    );
    assert!(
        response.stdout.unwrap().data.is_empty(),
        "stdout is the result"
    );

    let text = invoke(&server, &registered.registration_id, json!("text")).await;
    assert_eq!(result(&text), json!("hello world"));
    assert_eq!(
        result(&invoke(&server, &registered.registration_id, json!("id")).await),
        json!("inv-1")
    );

    let failed = invoke(&server, &registered.registration_id, json!("fail")).await;
    assert_eq!(failed.outcome(), pb::InvocationOutcome::Failed);
    assert_eq!(error(&failed).r#type, "NonZeroExitCode");
    assert_eq!(error(&failed).message, "exited with code 3: the last words");
    assert_eq!(stderr(&failed), "about to fail\nthe last words\n");

    let timed_out = invoke_with(
        &server,
        &registered.registration_id,
        b"\"hang\"",
        Some(Duration::from_millis(300)),
    )
    .await
    .unwrap();
    assert_eq!(timed_out.outcome(), pb::InvocationOutcome::TimedOut);
    assert_eq!(error(&timed_out).r#type, "Timeout");
    assert!(
        processes_of(&id).is_empty(),
        "the timed-out script is killed"
    );

    // A large request does not deadlock a script that writes much before it reads.
    let other = new_id();
    let counting = "head -c 200000 /dev/zero | tr '\\0' e >&2\nwc -c\n";
    let counter = register_ok(&server, &other, "wc.sh", &[("wc.sh", counting)]).await;
    let big = format!("\"{}\"", "y".repeat(1024 * 1024 - 2));
    let counted = invoke_with(&server, &counter.registration_id, big.as_bytes(), None)
        .await
        .unwrap();
    assert_eq!(result(&counted), json!(1024 * 1024));
    let errors = counted.stderr.unwrap();
    assert_eq!(errors.total_bytes, 200_000);
    assert!(errors.truncated);
    assert!(errors.data.len() <= 64 * 1024);

    let err = register(
        &server,
        registration(&new_id(), "missing.sh", &[("wc.sh", counting)]),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(unregister(&server, by_id(&registered.registration_id)).await);
    assert!(!function_dir(&server, &id).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_kills_and_removes_registrations_of_its_predecessor() {
    let server = TestServer::start_process("python").await;
    let caps = server.capabilities().await;
    let id = new_id();
    let registered = register_main(&server, &id, ECHO_PY).await;
    assert_eq!(processes_of(&id).len(), 1);

    // The server dies without cleaning up; its interpreter keeps running.
    let server = server.crash_and_restart("python").await;

    assert!(list(&server).await.is_empty());
    assert!(!server.root().join("functions").exists());
    assert_not_found(&server, &registered.registration_id).await;
    if let Some(cgroup) = cgroup_of(&caps, &id) {
        assert!(
            processes_of(&id).is_empty(),
            "the old interpreter was killed"
        );
        assert!(!cgroup.exists());
    }
    // The Run can register again on the new server.
    let again = register_main(&server, &id, ECHO_PY).await;
    assert_eq!(
        result(&invoke(&server, &again.registration_id, json!(1)).await)["calls"],
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_unregisters_everything() {
    let mut server = TestServer::start_process("python").await;
    let id = new_id();
    register_main(&server, &id, ECHO_PY).await;
    let dir = std::mem::replace(&mut server.dir, tempfile::tempdir().unwrap());
    // Drop sends SIGTERM and waits for the server to exit.
    drop(server);
    assert!(processes_of(&id).is_empty());
    assert!(!dir.path().join("root/functions").join(&id.run_uid).exists());
}

const ENV_PY: &str = r#"
import os

def handler(event):
    print("printed by", os.getpid())
    return {
        "pid": os.getpid(),
        "cwd": os.getcwd(),
        "home": os.environ.get("HOME"),
        "tmpdir": os.environ.get("TMPDIR"),
        "run_uid": os.environ.get("KRUNTIME_RUN_UID"),
        "greeting": os.environ.get("GREETING"),
        "python_var": os.environ.get("PYTHONWHATEVER"),
        "path_entry": __import__("sys").path[1],
    }
"#;

/// Registers ENV_PY with `env`, checks what the handler sees, unregisters; returns whether
/// the interpreter was the warm spare.
async fn check_environment(server: &TestServer, env: &[(&str, &str)]) -> bool {
    let id = new_id();
    let mut request = registration(&id, "main:handler", &[("main.py", ENV_PY)]);
    request.env = env
        .iter()
        .map(|(name, value)| pb::EnvVar {
            name: (*name).to_owned(),
            value: (*value).to_owned(),
        })
        .collect();
    let registered = register(server, request).await.unwrap();
    let response = invoke(server, &registered.registration_id, json!(null)).await;
    let seen = result(&response);
    let dir = function_dir(server, &id);
    let pid = seen["pid"].as_i64().unwrap();
    assert_eq!(seen["cwd"], json!(dir.join("work")));
    assert_eq!(seen["home"], json!(dir.join("work")));
    assert_eq!(seen["tmpdir"], json!(dir.join("tmp")));
    assert_eq!(seen["run_uid"], json!(id.run_uid));
    assert_eq!(seen["greeting"], json!("hello"));
    assert_eq!(seen["path_entry"], json!("/extra/lib"));
    assert_eq!(stdout(&response), format!("printed by {pid}\n"));
    let python_var = env.iter().find(|(name, _)| *name == "PYTHONWHATEVER");
    assert_eq!(
        seen["python_var"],
        json!(python_var.map(|(_, value)| value))
    );
    assert_eq!(processes_of(&id), vec![i32::try_from(pid).unwrap()]);
    let spare = was_spare(pid);
    assert!(unregister(server, by_id(&registered.registration_id)).await);
    assert!(processes_of(&id).is_empty());
    assert!(!alive(pid));
    spare
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_through_the_warm_spare_see_their_own_environment() {
    let server = TestServer::start_process("python").await;
    let env = [("GREETING", "hello"), ("PYTHONPATH", "/extra/lib")];
    // The first starts an interpreter of its own (and the first spare); the second finds
    // the spare.
    assert!(!check_environment(&server, &env).await, "no spare yet");
    await_spare(&server).await;
    assert!(
        check_environment(&server, &env).await,
        "the second registration used the spare"
    );
    // A variable that only an interpreter's start reads: an interpreter of its own.
    await_spare(&server).await;
    let env = [
        ("GREETING", "hello"),
        ("PYTHONPATH", "/extra/lib"),
        ("PYTHONWHATEVER", "1"),
    ];
    assert!(
        !check_environment(&server, &env).await,
        "a PYTHON* variable takes the cold path"
    );
    // The spare stays unused and is not a registration.
    assert_eq!(spares_of(&server).len(), 1);
    assert!(list(&server).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregister_kills_a_setsid_child_of_an_interpreter_bound_from_the_spare() {
    let server = TestServer::start_process("python").await;
    let Some(caps) = server.capabilities_with_cgroups().await else {
        return;
    };
    let source = "import os, subprocess\n\ndef handler(event):\n    return [os.getpid(), subprocess.Popen(['sleep', '1000'], start_new_session=True).pid]\n";
    // The first registration starts the first spare.
    let first = register_main(&server, &new_id(), ECHO_PY).await;
    assert!(unregister(&server, by_id(&first.registration_id)).await);
    await_spare(&server).await;
    let id = new_id();
    let registered = register_main(&server, &id, source).await;
    let pids = result(&invoke(&server, &registered.registration_id, json!(0)).await);
    let (interpreter, child) = (pids[0].as_i64().unwrap(), pids[1].as_i64().unwrap());
    assert!(was_spare(interpreter), "the registration used the spare");
    let procs =
        std::fs::read_to_string(cgroup_of(&caps, &id).unwrap().join("cgroup.procs")).unwrap();
    let members: Vec<i64> = procs.lines().map(|l| l.parse().unwrap()).collect();
    assert!(members.contains(&interpreter), "{members:?}");
    assert!(members.contains(&child), "{members:?}");

    assert!(unregister(&server, by_id(&registered.registration_id)).await);
    assert!(!alive(child), "the setsid child was killed");
    assert!(!alive(interpreter));
    assert!(processes_of(&id).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spare_that_died_while_it_waited_is_replaced_and_the_registration_starts_its_own() {
    let server = TestServer::start_process("python").await;
    let first = register_main(&server, &new_id(), ECHO_PY).await;
    assert!(unregister(&server, by_id(&first.registration_id)).await);
    await_spare(&server).await;
    let spare = spares_of(&server)[0].pid;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(spare),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let id = new_id();
    let registered = register_main(&server, &id, ECHO_PY).await;
    let interpreter = processes_of(&id);
    assert_eq!(interpreter.len(), 1);
    assert!(
        !was_spare(interpreter[0].into()),
        "the dead spare was not used"
    );
    assert_eq!(
        result(&invoke(&server, &registered.registration_id, json!(1)).await)["calls"],
        1
    );
    // The registration started a new spare, which the next one takes.
    await_spare(&server).await;
    assert!(!spares_of(&server).iter().any(|p| p.pid == spare));
    let next = new_id();
    register_main(&server, &next, ECHO_PY).await;
    assert!(was_spare(processes_of(&next)[0].into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_leaves_no_spare_behind() {
    let mut server = TestServer::start_process("python").await;
    let id = new_id();
    register_main(&server, &id, ECHO_PY).await;
    await_spare(&server).await;
    let root = server.root();
    let dir = std::mem::replace(&mut server.dir, tempfile::tempdir().unwrap());
    drop(server);
    assert!(processes_of(&id).is_empty());
    let needle = root.to_string_lossy().into_owned();
    let left = kruntimes_testkit::procs::mentioning(&needle);
    assert!(left.is_empty(), "{left:?}");
    assert!(!dir.path().join("root/functions/spare").exists());
}

/// Not a test of behaviour: the wall time of sequential python invocations through the
/// gRPC client. `cargo test -p kruntimes-runtime-server --test functions -- --ignored
/// --nocapture invoke_latency`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn invoke_latency() {
    let server = TestServer::start_process("python").await;
    let id = new_id();
    let source = "def handler(event):\n    return event\n";
    let registered = register_main(&server, &id, source).await;
    let mut client = server.functions.clone();
    let request = invocation(
        &registered.registration_id,
        "bench",
        br#"{"hello":"world","n":42}"#,
        None,
    );
    for _ in 0..100 {
        client.invoke_function(request.clone()).await.unwrap();
    }
    let mut samples = Vec::with_capacity(1000);
    let all = std::time::Instant::now();
    for _ in 0..1000 {
        let one = std::time::Instant::now();
        let response = client
            .invoke_function(request.clone())
            .await
            .unwrap()
            .into_inner();
        samples.push(one.elapsed());
        assert_eq!(response.outcome(), pb::InvocationOutcome::Succeeded);
    }
    let total = all.elapsed();
    samples.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    // The same client's plain round trip, for comparison: FunctionStatus does no I/O.
    let mut plain = Vec::with_capacity(1000);
    for _ in 0..1000 {
        let one = std::time::Instant::now();
        client
            .function_status(pb::FunctionStatusRequest {
                registration_id: registered.registration_id.clone(),
            })
            .await
            .unwrap();
        plain.push(one.elapsed());
    }
    plain.sort();
    println!(
        "1000 sequential FunctionStatus calls: p50 {:.0} µs, p99 {:.0} µs",
        us(plain[499]),
        us(plain[989]),
    );
    println!(
        "1000 sequential python invokes: total {:.1} ms, mean {:.0} µs, p50 {:.0} µs, p90 {:.0} µs, p99 {:.0} µs, max {:.0} µs",
        total.as_secs_f64() * 1e3,
        us(total) / 1000.0,
        us(samples[499]),
        us(samples[899]),
        us(samples[989]),
        us(samples[999]),
    );
}

/// Not a test of behaviour: the wall time of sequential python registrations (each
/// unregistered before the next) through the gRPC client, back to back (the spare started
/// by one registration is often not ready for the next) and with the spare ready before
/// each. `cargo test --release -p kruntimes-runtime-server --test functions -- --ignored
/// --nocapture register_latency`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn register_latency() {
    let server = TestServer::start_process("python").await;
    let source = "def handler(event):\n    return event\n";
    for await_ready in [false, true] {
        let mut samples = Vec::with_capacity(30);
        let mut spares = 0;
        for round in 0..35 {
            if await_ready && round > 0 {
                await_spare(&server).await;
            }
            let id = new_id();
            let one = std::time::Instant::now();
            let registered = register_main(&server, &id, source).await;
            let took = one.elapsed();
            let interpreter = processes_of(&id);
            assert_eq!(interpreter.len(), 1);
            let spare = was_spare(interpreter[0].into());
            assert!(unregister(&server, by_id(&registered.registration_id)).await);
            // The first five warm the page cache and the server.
            if round >= 5 {
                samples.push(took);
                spares += usize::from(spare);
            }
        }
        samples.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let n = samples.len();
        println!(
            "{n} sequential python registrations ({}; {spares} used the spare): mean {:.1} ms, p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            if await_ready {
                "each once the spare is ready"
            } else {
                "back to back"
            },
            ms(samples.iter().sum::<Duration>()) / n as f64,
            ms(samples[n / 2]),
            ms(samples[n * 9 / 10]),
            ms(samples[(n * 99).div_ceil(100) - 1]),
            ms(samples[n - 1]),
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_run_in_a_namespaces_sandbox_and_an_oom_fails_one_invocation() {
    let server = TestServer::start_with(
        tempfile::tempdir().unwrap(),
        "python",
        &["--sandbox", "namespaces", "--sandbox-memory", "256Mi"],
    )
    .await;
    let outside = tempfile::tempdir().unwrap();
    let sentinel = outside.path().join("sentinel");
    std::fs::write(&sentinel, "secret").unwrap();
    let source = r#"
import os, socket

def handler(event):
    if event.get("allocate"):
        b"x" * (1 << 30)
    with open("written", "w") as f:
        f.write("ok")
    try:
        socket.create_connection(("127.0.0.1", event["port"]), timeout=1)
        reached = True
    except OSError:
        reached = False
    return {
        "uid": os.getuid(),
        "hostname": os.uname().nodename,
        "sees_sentinel": os.path.exists(event["sentinel"]),
        "reached_host": reached,
        "pid": os.getpid(),
    }
"#;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let id = new_id();
    let registered = register_main(&server, &id, source).await;
    let event = json!({"sentinel": sentinel, "port": port});
    let first = result(&invoke(&server, &registered.registration_id, event.clone()).await);
    assert_eq!(first["uid"], 65534, "{first}");
    assert_eq!(first["hostname"], "sandbox", "{first}");
    assert_eq!(first["sees_sentinel"], false, "{first}");
    assert_eq!(first["reached_host"], false, "{first}");
    // The sandbox's own PID namespace: the interpreter is one of its first processes.
    assert!(first["pid"].as_i64().unwrap() < 10, "{first}");

    let mut oom = event.clone();
    oom["allocate"] = json!(true);
    let killed = invoke(&server, &registered.registration_id, oom).await;
    assert_ne!(
        killed.outcome(),
        pb::InvocationOutcome::Succeeded,
        "{killed:?}"
    );
    assert_eq!(error(&killed).r#type, "OOMKilled", "{killed:?}");
    // The registration goes on, with a fresh interpreter.
    let after = result(&invoke(&server, &registered.registration_id, event).await);
    assert_eq!(after["uid"], 65534, "{after}");
    assert_eq!(std::fs::read_to_string(&sentinel).unwrap(), "secret");
}
