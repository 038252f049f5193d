//! End-to-end tests of the `kruntimes-runtime-server` binary: real processes, a real Unix
//! socket, temporary directories. Synchronisation waits on the server's answers (Wait,
//! the Logs stream) or on process output, always with a deadline; never on sleeps.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use common::{DEADLINE, TestServer, new_id};
use kruntimes_proto::runtime::v1 as pb;
use tokio_stream::StreamExt;

/// Follows an execution's stdout and returns the stream with its first chunk, which the
/// program writes once it has reached the point a test waits for.
async fn follow_stdout(
    server: &TestServer,
    id: &pb::ExecutionId,
) -> (tonic::Streaming<pb::LogChunk>, pb::LogChunk) {
    let mut logs = server
        .tasks
        .clone()
        .logs(pb::LogsRequest {
            id: Some(id.clone()),
            stream: pb::LogStream::Stdout as i32,
            follow: true,
            offset: 0,
        })
        .await
        .expect("open the log stream")
        .into_inner();
    let first = tokio::time::timeout(DEADLINE, logs.next())
        .await
        .expect("the first chunk within the deadline")
        .expect("the stream has a first chunk")
        .expect("the first chunk is not an error");
    (logs, first)
}

fn script(id: &pb::ExecutionId, name: &str, body: &str) -> pb::ExecuteRequest {
    pb::ExecuteRequest {
        id: Some(id.clone()),
        files: vec![pb::SourceFile {
            path: name.to_owned(),
            content: body.as_bytes().to_vec(),
            executable: false,
        }],
        entrypoint: name.to_owned(),
        ..Default::default()
    }
}

fn outputs(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Every process whose environment carries this execution's marker.
fn processes_of(id: &pb::ExecutionId) -> Vec<u32> {
    let marker = format!("KRUNTIME_EXECUTION={}/{}", id.run_uid, id.attempt);
    kruntimes_testkit::procs::matching(|p| p.environ.contains(&marker))
        .into_iter()
        .filter_map(|p| u32::try_from(p.pid).ok())
        .collect()
}

fn assert_no_process_left(
    server: &TestServer,
    caps: &pb::CapabilitiesResponse,
    id: &pb::ExecutionId,
) {
    assert_eq!(
        processes_of(id),
        Vec::<u32>::new(),
        "processes of {id:?} survived"
    );
    if matches!(
        caps.isolation(),
        pb::Isolation::ProcessGroupAndCgroup | pb::Isolation::Namespaces
    ) {
        let cgroup = Path::new(&caps.cgroup_parent).join(format!("{}-{}", id.run_uid, id.attempt));
        assert!(
            !cgroup.exists(),
            "cgroup {} was not removed",
            cgroup.display()
        );
    }
    let _ = server;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capabilities_name_the_services_and_the_isolation() {
    let server = TestServer::start("bash").await;
    let caps = server.capabilities().await;
    assert!(
        caps.services
            .contains(&"kruntimes.runtime.v1.TaskRuntime".to_owned())
    );
    assert!(
        caps.services
            .contains(&"kruntimes.runtime.v1.RuntimeInfo".to_owned())
    );
    assert!(
        caps.services
            .contains(&"kruntimes.runtime.v1.SessionRuntime".to_owned())
    );
    assert_eq!(caps.adapter, "bash");
    assert!(Path::new(&caps.interpreter).is_absolute());
    assert!(caps.ready);
    assert_eq!(caps.log_tail_limit_bytes, 1024 * 1024);
    match caps.isolation() {
        pb::Isolation::ProcessGroupAndCgroup => assert!(!caps.cgroup_parent.is_empty()),
        pb::Isolation::ProcessGroup => assert!(!caps.isolation_detail.is_empty()),
        pb::Isolation::Namespaces | pb::Isolation::Gvisor => {
            assert!(!caps.cgroup_parent.is_empty());
            assert!(
                caps.isolation_detail.contains("seccomp"),
                "{}",
                caps.isolation_detail
            );
        }
        pb::Isolation::Unspecified => panic!("isolation unspecified"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bash_task_succeeds_with_outputs_and_logs() {
    let server = TestServer::start("bash").await;
    let id = new_id();
    let mut request = script(
        &id,
        "main.sh",
        "echo hello \"$1\"\necho oops >&2\n{ echo '# a comment'; echo answer=42; echo 'greeting=hi there'; } > \"$KRUNTIME_OUTPUTS\"\n",
    );
    request.args = vec!["world".to_owned()];
    let status = server.run(request).await;
    assert_eq!(status.state(), pb::ExecutionState::Succeeded, "{status:?}");
    assert_eq!(status.reason, "Completed");
    assert_eq!(status.exit_code, Some(0));
    assert_eq!(
        status.outputs,
        outputs(&[("answer", "42"), ("greeting", "hi there")])
    );
    assert_eq!(status.stdout_tail.unwrap().data, b"hello world\n");
    assert_eq!(status.stderr_tail.unwrap().data, b"oops\n");
    assert!(status.start_time.is_some() && status.finish_time.is_some());
    // The source is in the workspace, which holds everything the execution wrote.
    assert!(server.exec_dir(&id).join("work/main.sh").is_file());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_task_succeeds_with_outputs_in_both_entrypoint_forms() {
    let server = TestServer::start("python").await;
    let caps = server.capabilities().await;
    assert!(!caps.interpreter.contains("shims"), "{}", caps.interpreter);

    let id = new_id();
    let status = server
        .run(script(
            &id,
            "main.py",
            "import os, sys\nprint(sys.version_info[0])\nopen(os.environ['KRUNTIME_OUTPUTS'], 'w').write('result=%d\\n' % (6 * 7))\n",
        ))
        .await;
    assert_eq!(status.state(), pb::ExecutionState::Succeeded, "{status:?}");
    assert_eq!(status.outputs, outputs(&[("result", "42")]));
    assert_eq!(status.stdout_tail.unwrap().data, b"3\n");

    // `python3 -c ...`: the command form runs the resolved interpreter, not PATH's shim.
    let id = new_id();
    let status = server
        .run(pb::ExecuteRequest {
            id: Some(id.clone()),
            entrypoint: "python3".to_owned(),
            args: vec![
                "-c".to_owned(),
                "import sys; print(sys.executable)".to_owned(),
            ],
            ..Default::default()
        })
        .await;
    assert_eq!(status.state(), pb::ExecutionState::Succeeded, "{status:?}");
    let printed = String::from_utf8(status.stdout_tail.unwrap().data).unwrap();
    assert_eq!(printed.trim(), caps.interpreter);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_program_is_failed_with_its_exit_code() {
    let server = TestServer::start("bash").await;
    let id = new_id();
    let status = server
        .run(script(
            &id,
            "fail.sh",
            "echo out=partial > \"$KRUNTIME_OUTPUTS\"\nexit 3\n",
        ))
        .await;
    assert_eq!(status.state(), pb::ExecutionState::Failed);
    assert_eq!(status.reason, "NonZeroExitCode");
    assert_eq!(status.exit_code, Some(3));
    assert!(!status.retryable);
    assert_eq!(status.outputs, outputs(&[("out", "partial")]));

    // A command that does not exist never starts: FAILED, not an RPC error.
    let id = new_id();
    let status = server
        .run(pb::ExecuteRequest {
            id: Some(id.clone()),
            entrypoint: "no-such-command-kruntimes".to_owned(),
            ..Default::default()
        })
        .await;
    assert_eq!(status.state(), pb::ExecutionState::Failed);
    assert_eq!(status.reason, "StartFailed");
    assert!(!status.retryable);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_kills_the_whole_tree() {
    let server = TestServer::start("bash").await;
    let caps = server.capabilities().await;
    let id = new_id();
    // Ignores SIGTERM (and so do its children, which inherit SIG_IGN), so only the
    // SIGKILL after the grace period ends it; one grandchild leaves the session.
    let mut request = script(
        &id,
        "stubborn.sh",
        "trap '' TERM\nsleep 1000 &\nsetsid sleep 1000 &\necho started\nwait\n",
    );
    // Long enough for the script to set its trap and print before the timeout, even in a
    // gVisor sandbox on a loaded machine.
    request.timeout = Some(Duration::from_secs(4).try_into().unwrap());
    let status = server.run(request).await;
    assert_eq!(status.state(), pb::ExecutionState::TimedOut, "{status:?}");
    assert_eq!(status.reason, "Timeout");
    assert!(status.termination_requested);
    assert_eq!(status.signal, Some(9));
    assert_eq!(status.stdout_tail.unwrap().data, b"started\n");
    if matches!(
        caps.isolation(),
        pb::Isolation::ProcessGroupAndCgroup | pb::Isolation::Namespaces
    ) {
        assert_no_process_left(&server, &caps, &id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_kills_a_setsid_grandchild() {
    let server = TestServer::start("bash").await;
    let Some(caps) = server.capabilities_with_cgroups().await else {
        return;
    };
    let id = new_id();
    server
        .execute(pb::ExecuteRequest {
            id: Some(id.clone()),
            entrypoint: "bash".to_owned(),
            args: vec![
                "-c".to_owned(),
                "setsid sleep 1000 & echo spawned; wait".to_owned(),
            ],
            ..Default::default()
        })
        .await
        .unwrap();
    // Wait until the grandchild exists: the program says so on stdout.
    let (mut logs, first) = follow_stdout(&server, &id).await;
    assert_eq!(first.data, b"spawned\n");
    // Both bash and the setsid'd sleep are in the execution's cgroup (membership is
    // stable, unlike /proc/PID/environ, which is briefly unreadable during an exec).
    let cgroup = Path::new(&caps.cgroup_parent).join(format!("{}-{}", id.run_uid, id.attempt));
    let members = std::fs::read_to_string(cgroup.join("cgroup.procs")).unwrap();
    assert!(
        members.lines().count() >= 2,
        "expected bash and the setsid sleep: {members:?}"
    );

    let cancelled = server
        .tasks
        .clone()
        .cancel(pb::CancelRequest {
            id: Some(id.clone()),
        })
        .await
        .unwrap()
        .into_inner();
    // Regression (a flake seen under load): the supervisor may end the execution before
    // Cancel reads it back, so the answer is either still terminating or already cancelled.
    assert!(cancelled.termination_requested, "{cancelled:?}");
    assert!(
        matches!(cancelled.reason.as_str(), "Terminating" | "Cancelled"),
        "{cancelled:?}"
    );
    let status = server.wait(&id).await;
    assert_eq!(status.state(), pb::ExecutionState::Cancelled, "{status:?}");
    assert_eq!(status.reason, "Cancelled");
    assert_no_process_left(&server, &caps, &id);
    // The follow stream ends once the execution is terminal.
    let rest = tokio::time::timeout(DEADLINE, logs.next()).await.unwrap();
    assert!(rest.is_none(), "{rest:?}");
    // Cancelling again changes nothing.
    let again = server
        .tasks
        .clone()
        .cancel(pb::CancelRequest {
            id: Some(id.clone()),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.state(), pb::ExecutionState::Cancelled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_and_oversized_outputs_fail_with_their_reasons() {
    let server = TestServer::start("bash").await;
    let cases = [
        (
            "echo 'not a pair' > \"$KRUNTIME_OUTPUTS\"",
            "OutputsInvalid",
        ),
        ("echo '1bad=x' > \"$KRUNTIME_OUTPUTS\"", "OutputsInvalid"),
        (
            "for i in $(seq 65); do echo k$i=v; done > \"$KRUNTIME_OUTPUTS\"",
            "OutputsTooLarge",
        ),
        (
            "printf 'big=%09000d\\n' 0 > \"$KRUNTIME_OUTPUTS\"",
            "OutputsTooLarge",
        ),
        (
            "printf '%0129d=v\\n' 0 | tr 0 k > \"$KRUNTIME_OUTPUTS\"",
            "OutputsTooLarge",
        ),
    ];
    for (body, reason) in cases {
        let id = new_id();
        let status = server.run(script(&id, "out.sh", body)).await;
        assert_eq!(
            status.state(),
            pb::ExecutionState::Failed,
            "{body}: {status:?}"
        );
        assert_eq!(status.reason, reason, "{body}: {}", status.message);
        assert!(!status.retryable, "{body}");
        assert!(status.outputs.is_empty());
        assert_eq!(status.exit_code, Some(0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_stream_while_the_program_runs() {
    let server = TestServer::start("bash").await;
    let id = new_id();
    // Prints, then waits for the test to create `release` in its workspace.
    server
        .execute(script(
            &id,
            "chatty.sh",
            "echo first\nwhile [ ! -e release ]; do sleep 0.01; done\necho second\n",
        ))
        .await
        .unwrap();
    let (mut logs, first) = follow_stdout(&server, &id).await;
    assert_eq!(first.data, b"first\n");
    assert_eq!(first.offset, 0);
    let status = server
        .tasks
        .clone()
        .status(pb::StatusRequest {
            id: Some(id.clone()),
            include_log_tails: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        status.state(),
        pb::ExecutionState::Running,
        "streamed while running"
    );

    std::fs::write(server.exec_dir(&id).join("work/release"), b"").unwrap();
    let mut rest = Vec::new();
    while let Some(chunk) = tokio::time::timeout(DEADLINE, logs.next()).await.unwrap() {
        let chunk = chunk.unwrap();
        assert_eq!(chunk.offset, 6 + rest.len() as u64);
        rest.extend_from_slice(&chunk.data);
    }
    assert_eq!(rest, b"second\n");
    assert_eq!(
        server.wait(&id).await.state(),
        pb::ExecutionState::Succeeded
    );

    // Without follow, the whole stream from an offset, then the end.
    let chunks: Vec<_> = server
        .tasks
        .clone()
        .logs(pb::LogsRequest {
            id: Some(id.clone()),
            stream: pb::LogStream::Stdout as i32,
            follow: false,
            offset: 2,
        })
        .await
        .unwrap()
        .into_inner()
        .collect()
        .await;
    let data: Vec<u8> = chunks.into_iter().flat_map(|c| c.unwrap().data).collect();
    assert_eq!(data, b"rst\nsecond\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_removes_the_workspace_and_kills_a_running_execution() {
    let server = TestServer::start("bash").await;
    let caps = server.capabilities().await;
    let done = new_id();
    server.run(script(&done, "a.sh", "echo hi\n")).await;
    assert!(server.exec_dir(&done).is_dir());

    let running = new_id();
    server
        .execute(script(&running, "b.sh", "echo up\nexec sleep 1000\n"))
        .await
        .unwrap();

    let listed = server
        .tasks
        .clone()
        .list(pb::ListRequest {})
        .await
        .unwrap()
        .into_inner()
        .executions;
    let ids: Vec<_> = listed.iter().map(|s| s.id.clone().unwrap()).collect();
    assert!(ids.contains(&done) && ids.contains(&running), "{ids:?}");
    assert!(listed.iter().all(|s| s.stdout_tail.is_none()));

    for id in [&done, &running] {
        let forgotten = server
            .tasks
            .clone()
            .forget(pb::ForgetRequest {
                id: Some(id.clone()),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(forgotten.existed);
        assert!(!server.exec_dir(id).exists());
        assert!(!server.root().join(&id.run_uid).exists());
        let err = server
            .tasks
            .clone()
            .status(pb::StatusRequest {
                id: Some(id.clone()),
                include_log_tails: false,
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::NotFound);
    }
    if matches!(
        caps.isolation(),
        pb::Isolation::ProcessGroupAndCgroup | pb::Isolation::Namespaces
    ) {
        assert_no_process_left(&server, &caps, &running);
    }
    // Forgetting again is fine.
    let again = server
        .tasks
        .clone()
        .forget(pb::ForgetRequest {
            id: Some(done.clone()),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!again.existed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_identities_and_paths_are_refused_and_nothing_is_written() {
    let server = TestServer::start("bash").await;
    let bad_uids = [
        "../../etc",
        "",
        "2C24C1F0-9F8F-4F80-82D5-3DD16A12D1E6",
        "2c24c1f0-9f8f-4f80-82d5-3dd16a12d1e6/..",
        "/tmp/x",
    ];
    for uid in bad_uids {
        let id = pb::ExecutionId {
            run_uid: uid.to_owned(),
            attempt: 1,
        };
        let err = server
            .execute(script(&id, "a.sh", "echo\n"))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{uid:?}");
    }
    let id = new_id();
    for path in ["../escape.sh", "/tmp/abs.sh", "a/../../b.sh", "a//b.sh"] {
        let err = server
            .execute(script(&id, path, "echo\n"))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{path:?}");
    }
    let mut reserved = script(&id, "a.sh", "echo\n");
    reserved.env = vec![pb::EnvVar {
        name: "KRUNTIME_OUTPUTS".to_owned(),
        value: "/etc/passwd".to_owned(),
    }];
    let err = server.execute(reserved).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    let mut slash = script(&id, "a.sh", "echo\n");
    slash.entrypoint = "/bin/sh".to_owned();
    assert_eq!(
        server.execute(slash).await.unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
    // Nothing but the sandbox backend's own (hidden) staging directory.
    let entries = std::fs::read_dir(server.root())
        .unwrap()
        .filter(|e| {
            !e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with('.')
        })
        .count();
    assert_eq!(entries, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execute_is_idempotent_for_the_same_identity() {
    let server = TestServer::start("bash").await;
    let id = new_id();
    let mut request = script(&id, "a.sh", "echo once >> \"$HOME/count\"\n");
    request.env = vec![pb::EnvVar {
        name: "GREETING".to_owned(),
        value: "hi".to_owned(),
    }];
    let first = server.execute(request.clone()).await.unwrap();
    let second = server.execute(request.clone()).await.unwrap();
    assert_eq!(first.start_time, second.start_time);
    server.wait(&id).await;
    let third = server.execute(request.clone()).await.unwrap();
    assert_eq!(third.state(), pb::ExecutionState::Succeeded);
    let count = std::fs::read_to_string(server.exec_dir(&id).join("work/count")).unwrap();
    assert_eq!(count, "once\n", "the program ran exactly once");

    let mut different = request;
    different.args = vec!["x".to_owned()];
    let err = server.execute(different).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::AlreadyExists);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_output_has_a_bounded_tail_with_a_marker_and_a_full_log() {
    let server = TestServer::start("bash").await;
    let id = new_id();
    // 2 MiB of stdout.
    let status = server
        .run(script(
            &id,
            "big.sh",
            "head -c 2097152 /dev/zero | tr '\\0' 'x'\n",
        ))
        .await;
    assert_eq!(status.state(), pb::ExecutionState::Succeeded);
    let tail = status.stdout_tail.unwrap();
    assert!(tail.truncated);
    assert_eq!(tail.total_bytes, 2 * 1024 * 1024);
    assert!(tail.data.len() <= 1024 * 1024);
    assert!(tail.data.starts_with(b"[kruntimes: "), "marker first");
    let log = std::fs::metadata(server.exec_dir(&id).join("stdout.log")).unwrap();
    assert_eq!(log.len(), 2 * 1024 * 1024);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_reports_lost_executions_and_kills_their_processes() {
    let server = TestServer::start("bash").await;
    let caps = server.capabilities().await;
    let id = new_id();
    server
        .execute(script(&id, "long.sh", "echo up\nsleep 1000\n"))
        .await
        .unwrap();
    let (logs, first) = follow_stdout(&server, &id).await;
    assert_eq!(first.data, b"up\n");
    drop(logs);

    // The server dies without cleaning up; its executions keep running.
    let server = server.crash_and_restart("bash").await;

    let listed = server
        .tasks
        .clone()
        .list(pb::ListRequest {})
        .await
        .unwrap()
        .into_inner()
        .executions;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].id.as_ref(), Some(&id));
    assert_eq!(listed[0].state(), pb::ExecutionState::Failed);
    assert_eq!(listed[0].reason, "ServerRestarted");
    assert!(listed[0].retryable);
    if matches!(
        caps.isolation(),
        pb::Isolation::ProcessGroupAndCgroup | pb::Isolation::Namespaces
    ) {
        assert_no_process_left(&server, &caps, &id);
    }
    let forgotten = server
        .tasks
        .clone()
        .forget(pb::ForgetRequest {
            id: Some(id.clone()),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(forgotten.existed);
    assert!(!server.exec_dir(&id).exists());
}
