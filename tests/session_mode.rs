//! Session mode end to end, the lifecycle side: `kruntimes up` with its controller-manager
//! and local workers; session Runs created through the API, driven through their phases,
//! and checked against the workers' processes and files.

mod common;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::{
    DEADLINE, create, create_runtime, processes_with, ready_condition, runtimed_of, task_workspace,
    wait_for, wait_ready, wait_terminal, workload_processes,
};
use kruntimes_api::lifecycle::REGISTRATION_FINALIZER;
use kruntimes_api::run::{
    EnvVar, RetryPolicy, RunMode, RunResources, RunSource, SessionMode, Termination,
    TerminationMode,
};
use kruntimes_api::{Phase, Run, RunSpec};
use kruntimes_testkit::{Options, Server, within};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;

/// A session Run of `runtime`.
fn session(runtime: &str) -> RunSpec {
    let mut spec = RunSpec::task(runtime, "unused");
    spec.mode = RunMode {
        session: Some(SessionMode::default()),
        ..RunMode::default()
    };
    spec
}

fn assigned(run: &Run) -> (String, String) {
    let status = run.status.clone().unwrap_or_default();
    (
        status.assigned_pod.unwrap_or_default(),
        status.assigned_pod_uid.unwrap_or_default(),
    )
}

async fn terminate(client: &Client, name: &str, mode: TerminationMode) -> Result<()> {
    Api::<Run>::namespaced(client.clone(), "default")
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"termination": Termination { mode }}})),
        )
        .await
        .with_context(|| format!("request termination of {name}"))?;
    Ok(())
}

/// Waits until no process mentions `needle` (a Run UID: its workspace path).
async fn no_process_with(needle: &str) -> Result<()> {
    within(DEADLINE, &format!("processes of {needle} exit"), async {
        loop {
            if processes_with(needle).is_empty() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
}

/// That the Run does not leave `phase` within `window` (a bounded negative check on a
/// watch: it fails at once if the Run moves).
async fn stays(client: &Client, name: &str, phase: Phase, window: Duration) -> Result<()> {
    let moved = tokio::time::timeout(
        window,
        wait_for(client, name, "moves on", move |run| run.phase() != phase),
    )
    .await;
    match moved {
        Err(_) => Ok(()),
        Ok(run) => anyhow::bail!("Run {name} left {phase}: {:?}", run.map(|r| r.status)),
    }
}

#[tokio::test]
async fn a_session_registers_and_shares_its_worker_and_an_exclusive_one_does_not() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    create_runtime(&client, "solo", "bash", 1, 2).await?;
    let mut spec = session("solo");
    spec.env = Some(vec![EnvVar {
        name: "GREETING".into(),
        value: "hello".into(),
    }]);
    spec.source = Some(RunSource {
        inline: Some("echo from source\n".into()),
        snapshot: None,
    });
    let created = create(&client, "sandbox", spec).await?;
    let uid = created.uid().context("uid")?;
    let run = wait_ready(&client, "sandbox").await?;
    assert_eq!(
        ready_condition(&run),
        Some(("True".into(), "SessionRegistered".into()))
    );
    assert!(run.finalizers().iter().any(|f| f == REGISTRATION_FINALIZER));
    let endpoint = run
        .status
        .as_ref()
        .and_then(|s| s.endpoint.clone())
        .context("endpoint")?;
    assert_eq!(
        endpoint.url,
        format!(
            "{}/v1/namespaces/default/runtimes/solo/sessions/{uid}",
            server.gateway_url().context("gateway")?
        )
    );
    assert!(endpoint.ca_bundle.is_some());

    // A session shares its worker (issue 16 item 1): a task runs on the other slot beside it.
    let mut task = RunSpec::task("solo", "main.sh");
    task.source = Some(RunSource {
        inline: Some("echo task ran\n".into()),
        snapshot: None,
    });
    create(&client, "beside-task", task).await?;
    let task = wait_terminal(&client, "beside-task").await?;
    assert_eq!(task.phase(), Phase::Succeeded, "{:?}", task.status);
    let sandbox = Api::<Run>::namespaced(client.clone(), "default")
        .get("sandbox")
        .await?;
    assert_eq!(sandbox.phase(), Phase::Ready, "{:?}", sandbox.status);
    terminate(&client, "sandbox", TerminationMode::Immediate).await?;
    let ended = wait_terminal(&client, "sandbox").await?;
    assert_eq!(ended.phase(), Phase::Cancelled, "{:?}", ended.status);

    // An exclusive session waits, unplaced, while a task runs on the worker.
    // The task waits for a flag in its workspace, the one host directory a sandboxed task sees.
    let mut long = RunSpec::task("solo", "main.sh");
    long.source = Some(RunSource {
        inline: Some("while [ ! -e \"$KRUNTIME_WORKSPACE/flag\" ]; do sleep 0.02; done\n".into()),
        snapshot: None,
    });
    let long_uid = create(&client, "long-task", long)
        .await?
        .uid()
        .context("uid")?;
    wait_for(&client, "long-task", "runs", |r| {
        r.phase() == Phase::Running
    })
    .await?;
    let mut exclusive = session("solo");
    exclusive.resources = Some(RunResources {
        exclusive: Some(true),
        ..RunResources::default()
    });
    create(&client, "late-sandbox", exclusive).await?;
    stays(
        &client,
        "late-sandbox",
        Phase::Pending,
        Duration::from_secs(2),
    )
    .await?;
    std::fs::write(
        task_workspace(&server, &long_uid).await?.join("flag"),
        b"go",
    )?;
    wait_terminal(&client, "long-task").await?;
    wait_ready(&client, "late-sandbox").await?;
    // While it holds the worker, a task is not placed beside it though a slot is free.
    let mut task = RunSpec::task("solo", "main.sh");
    task.source = Some(RunSource {
        inline: Some("echo after the exclusive session\n".into()),
        snapshot: None,
    });
    create(&client, "after-task", task).await?;
    stays(
        &client,
        "after-task",
        Phase::Pending,
        Duration::from_secs(2),
    )
    .await?;

    // Deleting a Ready session closes it, purges it and releases the finalizer.
    let late = Api::<Run>::namespaced(client.clone(), "default")
        .get("late-sandbox")
        .await?;
    let late_uid = late.uid().context("uid")?;
    Api::<Run>::namespaced(client.clone(), "default")
        .delete("late-sandbox", &DeleteParams::default())
        .await?;
    within(DEADLINE, "the deleted session is gone", async {
        let runs = Api::<Run>::namespaced(client.clone(), "default");
        kube::runtime::wait::await_condition(runs, "late-sandbox", |r: Option<&Run>| r.is_none())
            .await?;
        Ok(())
    })
    .await?;
    no_process_with(&late_uid).await?;
    let task = wait_terminal(&client, "after-task").await?;
    assert_eq!(task.phase(), Phase::Succeeded, "{:?}", task.status);
    ensure!(
        workspace_dirs(&server, &late_uid)?.is_empty(),
        "the deleted session's directory is left"
    );
    ensure!(
        workspace_dirs(&server, &uid)?.is_empty(),
        "the cancelled session's directory is left"
    );
    Ok(())
}

/// An exclusive session's worker holds nothing else, sessions included: the exclusive
/// session waits (`Scheduled=False`, `NoCapacity`) while a shared session holds one of the
/// worker's two slots, and a shared session waits the same way while the exclusive one
/// holds the worker, though a slot count alone would fit it. Each is placed once the other
/// goes. The task side is in
/// `a_session_registers_and_shares_its_worker_and_an_exclusive_one_does_not`.
#[tokio::test]
async fn an_exclusive_session_never_shares_its_worker_with_another_session() -> Result<()> {
    let (_server, client) = Server::start_async(Options::full()).await?;
    create_runtime(&client, "single", "bash", 1, 2).await?;
    let runs = Api::<Run>::namespaced(client.clone(), "default");
    let waits_for_capacity = |run: &Run| {
        run.phase() == Phase::Pending
            && kruntimes_api::lifecycle::unscheduled_reason(run.status.as_ref())
                .is_some_and(|(reason, _)| reason == "NoCapacity")
    };
    let not_placed = |run: &Run| {
        run.status
            .as_ref()
            .and_then(|s| s.assigned_pod.clone())
            .is_none()
    };

    create(&client, "shared", session("single")).await?;
    let shared = wait_ready(&client, "shared").await?;
    let mut exclusive = session("single");
    exclusive.resources = Some(RunResources {
        exclusive: Some(true),
        ..RunResources::default()
    });
    create(&client, "alone", exclusive).await?;
    let waiting = wait_for(
        &client,
        "alone",
        "says it waits for capacity",
        waits_for_capacity,
    )
    .await?;
    ensure!(not_placed(&waiting), "{:?}", waiting.status);
    ensure!(
        runs.get("shared").await?.phase() == Phase::Ready,
        "the shared session goes on"
    );

    Api::<Run>::namespaced(client.clone(), "default")
        .delete("shared", &DeleteParams::default())
        .await?;
    let alone = wait_ready(&client, "alone").await?;
    ensure!(
        assigned(&alone).0 == assigned(&shared).0,
        "the only worker: {:?} and {:?}",
        alone.status,
        shared.status
    );

    create(&client, "latecomer", session("single")).await?;
    let late = wait_for(
        &client,
        "latecomer",
        "says it waits for capacity",
        waits_for_capacity,
    )
    .await?;
    ensure!(not_placed(&late), "{:?}", late.status);
    let (_, message) =
        kruntimes_api::lifecycle::unscheduled_reason(late.status.as_ref()).context("reason")?;
    ensure!(
        message.starts_with("requested 1 run slots; free 0 of 2"),
        "the exclusive session holds both slots: {message}"
    );
    ensure!(runs.get("alone").await?.phase() == Phase::Ready);

    Api::<Run>::namespaced(client.clone(), "default")
        .delete("alone", &DeleteParams::default())
        .await?;
    let late = wait_ready(&client, "latecomer").await?;
    ensure!(assigned(&late).0 == assigned(&alone).0, "{:?}", late.status);
    Ok(())
}

/// Directories under the server's state directory named after `uid`.
fn workspace_dirs(server: &Server, uid: &str) -> Result<Vec<std::path::PathBuf>> {
    let mut found = Vec::new();
    let mut pending = vec![server.data_dir().to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if entry
                .file_type()
                .is_ok_and(|t| t.is_dir() && !t.is_symlink())
            {
                if entry.file_name().to_string_lossy().contains(uid) {
                    found.push(path.clone());
                }
                pending.push(path);
            }
        }
    }
    Ok(found)
}

#[tokio::test]
async fn lease_expiry_drain_and_worker_loss_end_sessions() -> Result<()> {
    let (_server, client) = Server::start_async(Options::full()).await?;
    create_runtime(&client, "pool", "bash", 2, 1).await?;

    // Nobody renews the lease: it expires.
    let mut leased = session("pool");
    if let Some(mode) = leased.mode.session.as_mut() {
        mode.lease_timeout_seconds = Some(1);
    }
    create(&client, "leased", leased).await?;
    wait_ready(&client, "leased").await?;
    let expired = wait_terminal(&client, "leased").await?;
    let status = expired.status.clone().unwrap_or_default();
    assert_eq!(expired.phase(), Phase::Timeout, "{status:?}");
    assert_eq!(status.reason.as_deref(), Some("LeaseExpired"));

    // Drain with nothing queued: Finalizing, then Succeeded (no artifacts, no store).
    create(&client, "drained", session("pool")).await?;
    wait_ready(&client, "drained").await?;
    terminate(&client, "drained", TerminationMode::Drain).await?;
    let drained = wait_terminal(&client, "drained").await?;
    let status = drained.status.clone().unwrap_or_default();
    assert_eq!(drained.phase(), Phase::Succeeded, "{status:?}");
    assert_eq!(status.reason.as_deref(), Some("Drained"));
    assert!(status.artifact_refs.is_empty());

    // Losing the worker of a Ready session is terminal, whatever the retry policy says.
    let mut kept = session("pool");
    kept.retry_policy = Some(RetryPolicy {
        max_attempts: 3,
        backoff_seconds: None,
    });
    create(&client, "stranded", kept).await?;
    let run = wait_ready(&client, "stranded").await?;
    let (pod, pod_uid) = assigned(&run);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(runtimed_of(&pod)?),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let lost = wait_terminal(&client, "stranded").await?;
    let status = lost.status.clone().unwrap_or_default();
    assert_eq!(lost.phase(), Phase::Failed, "{status:?}");
    assert_eq!(status.reason.as_deref(), Some("WorkerLost"));
    assert_eq!(status.attempt, Some(1), "never retried: {status:?}");
    assert_eq!(assigned(&lost).1, pod_uid, "never reassigned");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Through the gateway, with the SDK: operations, files, leases, drain and artifacts.

use kruntimes_client::Connection;
use kruntimes_client::machines::MachineError;
use kruntimes_client::sandbox::{
    AcquireOptions, ListFilesOptions, ReleaseOptions, Sandbox, SandboxError,
};
use kruntimes_client::session::{
    Command, EventKind, Operation, OperationKind, OperationState, OutputStream,
};

async fn connection(server: &Server) -> Result<Connection> {
    Ok(Connection::from_paths(&[server.kubeconfig_path()]).await?)
}

/// Runs `command` and returns (how it ended, stdout).
async fn exec(
    session: &mut kruntimes_client::session::Session,
    command: Command,
) -> Result<(kruntimes_client::session::Completed, String)> {
    let mut stdout = Vec::new();
    let done = session
        .exec(command, |stream, data| {
            if stream == OutputStream::Stdout {
                stdout.extend_from_slice(data);
            }
        })
        .await?;
    Ok((done, String::from_utf8_lossy(&stdout).into_owned()))
}

/// Issue 15.1: `status.endpoint.caBundle` is bytes (`CABundle []byte` in the design), which
/// the Run's JSON carries as base64; it held PEM text, which a client built from the
/// design's Go type cannot decode. kubectl reads the raw JSON as any outside client would.
#[tokio::test]
async fn ca_bundle_is_base64_of_the_gateway_pem_and_the_sdk_connects_with_it() -> Result<()> {
    use base64::Engine;

    let (server, _client) = Server::start_async(Options::full()).await?;
    let connection = connection(&server).await?;
    let sandbox = connection
        .runtime("bash")
        .acquire_sandbox(&AcquireOptions::default())
        .await?;
    let text = server.kubectl_ok(&[
        "get",
        "run",
        sandbox.name(),
        "-o",
        "jsonpath={.status.endpoint.caBundle}",
    ])?;
    let pem = base64::engine::general_purpose::STANDARD
        .decode(text.trim())
        .with_context(|| format!("caBundle is not base64: {text:?}"))?;
    let ca = std::fs::read(server.data_dir().join("components/gateway-ca.crt"))?;
    assert_eq!(pem, ca, "caBundle decodes to the gateway CA's PEM");
    assert!(pem.starts_with(b"-----BEGIN CERTIFICATE-----"));

    // The SDK decodes it and trusts it: a command runs through the gateway.
    let mut session = sandbox.open_session().await?;
    let (done, out) = exec(&mut session, Command::shell("echo trusted")).await?;
    assert_eq!(done.state, OperationState::Succeeded, "{done:?}");
    assert_eq!(out, "trusted\n");
    session.close().await;
    sandbox.release(ReleaseOptions::default()).await?;
    Ok(())
}

#[tokio::test]
async fn operations_run_in_order_through_the_gateway() -> Result<()> {
    let (server, _client) = Server::start_async(Options::full()).await?;
    let connection = connection(&server).await?;
    let runtime = connection.runtime("bash");
    let sandbox = runtime
        .acquire_sandbox(&AcquireOptions {
            env: vec![EnvVar {
                name: "GREETING".into(),
                value: "hello".into(),
            }],
            source: Some("echo from source\n".into()),
            ..AcquireOptions::default()
        })
        .await?;
    let mut session = sandbox.open_session().await?;

    // Registered env, a per-command override, the source in the workspace, exit codes.
    let (done, out) = exec(&mut session, Command::shell("echo $GREETING; cat main.sh")).await?;
    assert_eq!(done.state, OperationState::Succeeded, "{done:?}");
    assert_eq!(out, "hello\necho from source\n");
    let mut override_env = Command::shell("echo $GREETING");
    override_env.env.insert("GREETING".into(), "bye".into());
    assert_eq!(exec(&mut session, override_env).await?.1, "bye\n");
    assert_eq!(
        exec(&mut session, Command::shell("echo $GREETING"))
            .await?
            .1,
        "hello\n"
    );
    let (failed, _) = exec(&mut session, Command::argv(["bash", "-c", "exit 3"])).await?;
    assert_eq!(failed.state, OperationState::Failed);
    assert_eq!(
        (failed.reason.as_str(), failed.exit_code),
        ("NonZeroExitCode", Some(3))
    );
    let mut stdin = Command::argv(["cat"]);
    stdin.stdin = b"piped".to_vec();
    assert_eq!(exec(&mut session, stdin).await?.1, "piped");

    // State persists between operations; files round-trip; cwd is relative.
    let made = session
        .run(
            &Operation::new(OperationKind::MakeDirectory {
                path: "notes".into(),
                parents: true,
            }),
            |_, _| {},
        )
        .await?;
    assert_eq!(made.state, OperationState::Succeeded, "{made:?}");
    let wrote = session
        .write_file("notes/a.txt", b"four".to_vec(), false)
        .await?;
    assert_eq!(wrote.state, OperationState::Succeeded, "{wrote:?}");
    assert_eq!(sandbox.read_file("notes/a.txt").await?, b"four");
    let mut in_dir = Command::shell("cat a.txt; pwd");
    in_dir.cwd = Some("notes".into());
    let (_, out) = exec(&mut session, in_dir).await?;
    assert!(
        out.starts_with("four") && out.trim_end().ends_with("/notes"),
        "{out}"
    );
    let renamed = session
        .run(
            &Operation::new(OperationKind::Rename {
                from: "notes/a.txt".into(),
                to: "notes/b.txt".into(),
            }),
            |_, _| {},
        )
        .await?;
    assert_eq!(renamed.state, OperationState::Succeeded);
    let page = sandbox
        .list_files(&ListFilesOptions {
            directory: "notes".into(),
            ..ListFilesOptions::default()
        })
        .await?;
    let names: Vec<&str> = page.entries.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(names, ["notes/b.txt"]);
    // An escape is refused at the boundary, and changes nothing.
    let escape = sandbox.read_file("../../../../etc/passwd").await;
    assert_eq!(
        escape.as_ref().err().and_then(|e| e.status()),
        Some(400),
        "{escape:?}"
    );
    let escaped = session
        .run(
            &Operation::write_file("../outside.txt", b"no".to_vec(), false),
            |_, _| {},
        )
        .await;
    // Refused by the SDK before sending, or run and refused by the runtime server.
    assert!(
        escaped.is_err()
            || escaped
                .as_ref()
                .is_ok_and(|d| d.state == OperationState::Failed),
        "{escaped:?}"
    );

    // 50 operations back to back: completed in order, sequence numbers contiguous.
    // At most 16 wait at once: the session's queue holds 32, and on a loaded machine
    // the worker may not have started any of them before the last is sent.
    const OPERATIONS: usize = 50;
    const IN_FLIGHT: usize = 16;
    let mut ids = Vec::new();
    // Events of different operations may reach the connection out of order; their
    // sequence numbers give the order the owner produced them in.
    let mut completed = Vec::new();
    let mut sequences = Vec::new();
    while completed.len() < OPERATIONS {
        if ids.len() < OPERATIONS && ids.len() - completed.len() < IN_FLIGHT {
            let i = ids.len();
            let id = session
                .send(&Operation::write_file(
                    format!("seq-{i:02}"),
                    vec![b'x'; 64],
                    false,
                ))
                .await?;
            ids.push(id);
            continue;
        }
        let event = session.receive().await?;
        if ids.contains(&event.operation_id) {
            sequences.push(event.sequence);
            if let EventKind::Completed(done) = &event.kind {
                assert_eq!(done.state, OperationState::Succeeded, "{done:?}");
                completed.push((event.sequence, event.operation_id.clone()));
            }
        }
    }
    completed.sort_unstable();
    let completed: Vec<String> = completed.into_iter().map(|(_, id)| id).collect();
    assert_eq!(completed, ids, "completion order is send order");
    sequences.sort_unstable();
    let first = sequences[0];
    let expected: Vec<u64> = (first..first + sequences.len() as u64).collect();
    assert_eq!(sequences, expected, "contiguous sequence numbers");
    assert_eq!(sequences.len(), 150, "queued, started, completed for each");

    // The audit log has one line per mutation of this Run, without command text.
    let audit = audit_lines(&server, sandbox.uid())?;
    assert!(audit.len() >= 50, "{} audit lines", audit.len());
    assert!(
        audit
            .iter()
            .all(|l| !l.contains("GREETING") && !l.contains("piped"))
    );
    session.close().await;
    assert_eq!(
        sandbox.release(ReleaseOptions::default()).await?,
        Some(Phase::Succeeded)
    );
    Ok(())
}

/// The audit lines of the workers that mention `uid`.
fn audit_lines(server: &Server, uid: &str) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let mut pending = vec![server.data_dir().to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                pending.push(path);
            } else if entry.file_name() == "audit.jsonl" {
                let text = std::fs::read_to_string(&path)?;
                lines.extend(text.lines().filter(|l| l.contains(uid)).map(str::to_string));
            }
        }
    }
    Ok(lines)
}

#[tokio::test]
async fn queue_limits_timeouts_cancel_and_leases() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let connection = connection(&server).await?;
    let runtime = connection.runtime("bash");
    let sandbox = runtime
        .acquire_sandbox(&AcquireOptions {
            queue_size: Some(2),
            lease_timeout: Some(Duration::from_secs(3)),
            ..AcquireOptions::default()
        })
        .await?;
    let mut session = sandbox.open_session().await?;

    // A full queue answers 429: one operation runs, two wait, the next is refused.
    let blocker = session
        .send(&Operation::command(Command::argv(["sleep", "1000"])))
        .await?;
    // It runs (it left the queue) before the others are sent.
    loop {
        let event = session.receive().await?;
        if event.operation_id == blocker && event.kind == EventKind::Started {
            break;
        }
    }
    let second = session
        .send(&Operation::command(Command::argv(["true"])))
        .await?;
    let third = session
        .send(&Operation::command(Command::argv(["true"])))
        .await?;
    let refused = session
        .send(&Operation::command(Command::argv(["true"])))
        .await;
    assert_eq!(
        refused.as_ref().err().and_then(|e| e.status()),
        Some(429),
        "{refused:?}"
    );
    // Reads bypass the queue while it is full.
    assert!(
        sandbox
            .list_files(&ListFilesOptions::default())
            .await
            .is_ok()
    );
    let status = sandbox.status().await?;
    assert_eq!(
        (status.queued, status.running_operation_id.as_str()),
        (2, blocker.as_str())
    );
    // Cancel a queued one (it never runs), then the running one (its process is killed):
    // the one left runs.
    assert!(session.cancel(&third).await?.found);
    assert!(session.cancel(&blocker).await?.found);
    let mut ends = std::collections::HashMap::new();
    while ends.len() < 3 {
        let event = session.receive().await?;
        if let EventKind::Completed(done) = event.kind {
            ends.insert(event.operation_id, done);
        }
    }
    assert_eq!(ends[&blocker].state, OperationState::Cancelled, "{ends:?}");
    assert_eq!(ends[&second].state, OperationState::Succeeded, "{ends:?}");
    assert_eq!(ends[&third].state, OperationState::Cancelled, "{ends:?}");

    // An operation's timeout kills its whole tree, a setsid grandchild included.
    let timed = session
        .run(
            &Operation::command(Command::shell(
                "setsid sleep 1000 & echo $! > grandchild; sleep 1000",
            ))
            .with_timeout(Duration::from_secs(1)),
            |_, _| {},
        )
        .await?;
    assert_eq!(timed.state, OperationState::TimedOut, "{timed:?}");
    // The pid it wrote is in the sandbox's own PID namespace when sessions are sandboxed:
    // follow its processes on the host by their environment (the Run UID) instead.
    ensure!(
        !sandbox.read_file("grandchild").await?.is_empty(),
        "the grandchild started"
    );
    ensure!(
        workload_processes(sandbox.uid()).is_empty(),
        "a process of the timed-out operation outlived it: {:?}",
        workload_processes(sandbox.uid())
    );

    // Cancel mid-command: started, then cancelled; the session takes the next one.
    let long = session
        .send(&Operation::command(Command::shell(
            "echo started; sleep 1000",
        )))
        .await?;
    loop {
        let event = session.receive().await?;
        if event.operation_id == long && matches!(event.kind, EventKind::Output { .. }) {
            break;
        }
    }
    assert!(session.cancel(&long).await?.found);
    loop {
        let event = session.receive().await?;
        if let (true, EventKind::Completed(done)) = (event.operation_id == long, &event.kind) {
            assert_eq!(done.state, OperationState::Cancelled, "{done:?}");
            break;
        }
    }
    assert_eq!(
        exec(&mut session, Command::argv(["echo", "next"])).await?.1,
        "next\n"
    );

    // Closing the connection keeps the sandbox; a reconnect before the lease ends works.
    session.close().await;
    let mut again = sandbox.open_session().await?;
    assert_eq!(
        exec(&mut again, Command::argv(["echo", "back"])).await?.1,
        "back\n"
    );
    again.close().await;
    // Nobody renews the lease now: it expires and the workspace goes.
    let ended = wait_terminal(&client, sandbox.name()).await?;
    let status = ended.status.clone().unwrap_or_default();
    assert_eq!(ended.phase(), Phase::Timeout, "{status:?}");
    assert_eq!(status.reason.as_deref(), Some("LeaseExpired"));
    no_process_with(sandbox.uid()).await?;
    Ok(())
}

async fn artifact_runtime(client: &Client, name: &str, store: &std::path::Path) -> Result<()> {
    use kruntimes_api::runtime::{ArtifactStoreSpec, FilesystemArtifactStore};
    use kruntimes_api::{Runtime, RuntimeSpec};
    let api = Api::<Runtime>::namespaced(client.clone(), "default");
    let runtime = Runtime::new(
        name,
        RuntimeSpec {
            replicas: 2,
            scaling: None,
            runs: Some(1),
            template: kruntimes_api::runtime::template_with_args(vec![
                "--adapter".into(),
                "bash".into(),
            ]),
            port: None,
            artifact_store: Some(ArtifactStoreSpec {
                filesystem: Some(FilesystemArtifactStore {
                    path: store.display().to_string(),
                }),
                s3: None,
            }),
        },
    );
    api.create(&kube::api::PostParams::default(), &runtime)
        .await?;
    common::wait_runtime(client, name, "ready", |rt| {
        rt.status.as_ref().and_then(|s| s.ready_replicas) == Some(2)
    })
    .await
}

async fn acquire(
    connection: &Connection,
    runtime: &str,
) -> Result<(Sandbox, kruntimes_client::session::Session)> {
    let sandbox = connection
        .runtime(runtime)
        .acquire_sandbox(&AcquireOptions::default())
        .await?;
    let session = sandbox.open_session().await?;
    Ok((sandbox, session))
}

#[tokio::test]
async fn drain_exports_artifacts_and_immediate_wins() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("store");
    artifact_runtime(&client, "art", &store).await?;
    let connection = connection(&server).await?;

    // Drain: accepted work finishes, the artifact is exported, Succeeded with its ref.
    let (sandbox, mut session) = acquire(&connection, "art").await?;
    let (done, _) = exec(
        &mut session,
        Command::shell("mkdir -p $KRUNTIME_ARTIFACTS_DIR/out && printf hello > $KRUNTIME_ARTIFACTS_DIR/out/result.txt"),
    )
    .await?;
    assert_eq!(done.state, OperationState::Succeeded, "{done:?}");
    session.close().await;
    assert_eq!(
        sandbox.release(ReleaseOptions::default()).await?,
        Some(Phase::Succeeded)
    );
    let exported = std::fs::read_dir(store.join("default"))?
        .flatten()
        .find(|e| e.file_name().to_string_lossy().ends_with(sandbox.uid()))
        .context("the Run's artifact directory")?;
    assert_eq!(
        std::fs::read(exported.path().join("out/result.txt"))?,
        b"hello"
    );

    // The refs are in the status (seen before the release deleted the Run): check them on
    // a second sandbox that is drained without being deleted.
    let (kept, mut session) = acquire(&connection, "art").await?;
    exec(
        &mut session,
        Command::shell("printf abc > $KRUNTIME_ARTIFACTS_DIR/a.txt"),
    )
    .await?;
    session.close().await;
    terminate(&client, kept.name(), TerminationMode::Drain).await?;
    let drained = wait_terminal(&client, kept.name()).await?;
    let status = drained.status.clone().unwrap_or_default();
    assert_eq!(drained.phase(), Phase::Succeeded, "{status:?}");
    assert_eq!(status.artifact_refs.len(), 1, "{status:?}");
    let r = &status.artifact_refs[0];
    assert_eq!((r.name.as_str(), r.size_bytes), ("a.txt", Some(3)));
    assert_eq!(
        r.digest.as_deref(),
        Some("sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    );
    assert!(
        r.uri.starts_with("file://") && r.uri.ends_with("/a.txt"),
        "{}",
        r.uri
    );

    // Immediate during a Drain: the drain stops, Cancelled, nothing exported.
    let (busy, mut session) = acquire(&connection, "art").await?;
    let running = session
        .send(&Operation::command(Command::shell(
            "printf x > $KRUNTIME_ARTIFACTS_DIR/x; sleep 1000",
        )))
        .await?;
    terminate(&client, busy.name(), TerminationMode::Drain).await?;
    wait_for(&client, busy.name(), "finalizes", |r| {
        r.phase() == Phase::Finalizing
    })
    .await?;
    // New work is refused while it drains.
    let refused = session
        .send(&Operation::command(Command::argv(["true"])))
        .await;
    assert_eq!(
        refused.as_ref().err().and_then(|e| e.status()),
        Some(409),
        "{refused:?}"
    );
    terminate(&client, busy.name(), TerminationMode::Immediate).await?;
    let cancelled = wait_terminal(&client, busy.name()).await?;
    assert_eq!(
        cancelled.phase(),
        Phase::Cancelled,
        "{:?}",
        cancelled.status
    );
    assert!(
        cancelled
            .status
            .unwrap_or_default()
            .artifact_refs
            .is_empty()
    );
    loop {
        let event = session.receive().await?;
        if let (true, EventKind::Completed(done)) = (event.operation_id == running, &event.kind) {
            assert_eq!(done.state, OperationState::Cancelled, "{done:?}");
            break;
        }
    }
    session.close().await;
    no_process_with(busy.uid()).await?;
    Ok(())
}

#[tokio::test]
async fn a_store_failure_keeps_the_session_finalizing_until_it_clears() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let tmp = tempfile::tempdir()?;
    // The store's directory is blocked by a file: every export fails as a transport failure.
    let store = tmp.path().join("store");
    std::fs::write(&store, b"not a directory")?;
    artifact_runtime(&client, "flaky", &store).await?;
    let connection = connection(&server).await?;
    let (sandbox, mut session) = acquire(&connection, "flaky").await?;
    exec(
        &mut session,
        Command::shell("printf kept > $KRUNTIME_ARTIFACTS_DIR/k.txt"),
    )
    .await?;
    session.close().await;
    terminate(&client, sandbox.name(), TerminationMode::Drain).await?;
    wait_for(&client, sandbox.name(), "retries its export", |r| {
        ready_condition(r).is_some_and(|(_, reason)| reason == "ArtifactExportRetrying")
    })
    .await?;
    let waiting = Api::<Run>::namespaced(client.clone(), "default")
        .get(sandbox.name())
        .await?;
    assert_eq!(waiting.phase(), Phase::Finalizing);
    // The store comes back: the retry exports and the Run succeeds.
    // The retry may create the directory itself the moment the file is gone, so
    // the test's own create tolerates finding it there.
    std::fs::remove_file(&store)?;
    std::fs::create_dir_all(&store)?;
    let done = wait_terminal(&client, sandbox.name()).await?;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), Phase::Succeeded, "{status:?}");
    assert_eq!(status.artifact_refs.len(), 1);
    Ok(())
}

#[tokio::test]
async fn listings_page_in_byte_order_through_the_gateway() -> Result<()> {
    let (server, _client) = Server::start_async(Options::full()).await?;
    let connection = connection(&server).await?;
    let (sandbox, mut session) = acquire(&connection, "bash").await?;
    let (done, _) = exec(
        &mut session,
        Command::shell("mkdir many other && cd many && for i in $(seq 1 2500); do : > f$i; done"),
    )
    .await?;
    assert_eq!(done.state, OperationState::Succeeded, "{done:?}");
    let mut names = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let page = sandbox
            .list_files(&ListFilesOptions {
                directory: "many".into(),
                limit: 1000,
                page_token: token.clone(),
            })
            .await?;
        pages += 1;
        names.extend(page.entries.into_iter().map(|e| e.path));
        if page.next_page_token.is_empty() {
            break;
        }
        if pages == 1 {
            // A token made for another directory is refused.
            let crossed = sandbox
                .list_files(&ListFilesOptions {
                    directory: "other".into(),
                    limit: 10,
                    page_token: page.next_page_token.clone(),
                })
                .await;
            assert_eq!(crossed.err().and_then(|e| e.status()), Some(400));
        }
        token = page.next_page_token;
    }
    assert_eq!(pages, 3);
    assert_eq!(names.len(), 2500);
    let mut sorted = names.clone();
    sorted.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    sorted.dedup();
    assert_eq!(names, sorted, "byte order, no duplicates");
    let malformed = sandbox
        .list_files(&ListFilesOptions {
            directory: "many".into(),
            limit: 10,
            page_token: "not-a-token!".into(),
        })
        .await;
    assert_eq!(malformed.err().and_then(|e| e.status()), Some(400));
    session.close().await;
    sandbox
        .release(ReleaseOptions {
            immediate: true,
            ..ReleaseOptions::default()
        })
        .await?;
    Ok(())
}

/// The resident set of process `pid`, in KiB (`VmRSS` of `/proc/PID/status`).
fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("read /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS line")
}

/// The session sockets the gateway of `server` holds open, from its metrics.
async fn open_sockets(gateway: &Client) -> Result<usize> {
    let text = gateway
        .request_text(http::Request::get("/metrics").body(Vec::new())?)
        .await?;
    let value: f64 = text
        .lines()
        .find_map(|line| line.strip_prefix("kruntimes_gateway_session_connections "))
        .and_then(|value| value.trim().parse().ok())
        .context("no kruntimes_gateway_session_connections sample")?;
    Ok(value as usize)
}

/// Regression (issue 14 item 9): each idle session WebSocket cost the gateway about
/// 150 KiB (tungstenite's default 128 KiB read buffer and 128 KiB write buffer per
/// socket); 1,024 of them took the server from 216 to 469 MB. The buffers are bounded now
/// (`kruntimes_gateway::session::ws::READ_BUFFER_BYTES`, no write buffer), about 24 KiB
/// a socket with TLS and the connection's tasks. Memory is behaviour here, not timing:
/// the growth of the server's resident set (the gateway runs in the `kruntimes up`
/// process) over 256 idle sockets must stay under 64 KiB a socket, a bound the old
/// buffers exceed by far and that leaves room for the rest of the process's churn.
#[tokio::test]
async fn idle_session_sockets_cost_the_gateway_little_memory() -> Result<()> {
    const SOCKETS: usize = 256;
    const MAX_KIB_PER_SOCKET: u64 = 64;
    let (server, _client) = Server::start_async(Options::full()).await?;
    let pid = server.pid().context("the server's pid")?;
    let gateway = {
        let url = server.gateway_url().context("the gateway's URL")?;
        let mut config = kube::Config::new(url.parse().context("the gateway's URL")?);
        let ca = std::fs::read(server.data_dir().join("components/gateway-ca.crt"))?;
        config.root_cert = Some(common::pem_certificates(&ca)?);
        Client::try_from(config)?
    };
    let connection = connection(&server).await?;
    let sandbox = connection
        .runtime("bash")
        .acquire_sandbox(&AcquireOptions::default())
        .await?;
    // What every socket shares (the Runtime's cache, the worker's channel, the cached
    // authorization) is in place before the baseline.
    sandbox.open_session().await?.close().await;
    let before = rss_kib(pid)?;
    let mut sessions = Vec::with_capacity(SOCKETS);
    within(Duration::from_secs(120), "open the sockets", async {
        for _ in 0..SOCKETS {
            sessions.push(sandbox.open_session().await?);
        }
        // The gateway counts a socket once it serves it, a moment after the upgrade.
        while open_sockets(&gateway).await? < SOCKETS {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    })
    .await?;
    let during = rss_kib(pid)?;
    let per_socket = during.saturating_sub(before) / SOCKETS as u64;
    eprintln!(
        "{SOCKETS} idle sockets: RSS {before} KiB -> {during} KiB, {per_socket} KiB a socket"
    );
    ensure!(
        per_socket < MAX_KIB_PER_SOCKET,
        "{SOCKETS} idle sockets took the server from {before} to {during} KiB: \
         {per_socket} KiB a socket, over {MAX_KIB_PER_SOCKET} KiB"
    );
    for session in sessions {
        session.close().await;
    }
    sandbox
        .release(ReleaseOptions {
            immediate: true,
            ..ReleaseOptions::default()
        })
        .await?;
    Ok(())
}

/// The SHA-256 of a local file, read in chunks.
fn digest_of(path: &std::path::Path) -> Result<String> {
    use sha2::Digest;
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// Writes `mib` MiB of varied bytes (not zeros: a lost or reordered chunk shows).
fn write_pattern(path: &std::path::Path, mib: usize) -> Result<()> {
    use std::io::Write;
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut block = vec![0u8; 1 << 20];
    for i in 0..mib {
        for (j, byte) in block.iter_mut().enumerate() {
            *byte = ((i * 31 + j * 7) % 251) as u8;
        }
        file.write_all(&block)?;
    }
    file.flush()?;
    Ok(())
}

/// The workspace of `sandbox` on its worker, and its session directory (the parent).
/// Under `gvisor` the sandbox's bundle (`root/.gvisor/bundles/…/rootfs`) holds an empty
/// mount point of that path too; the workspace is the host directory, outside it.
fn session_workspace(server: &Server, uid: &str) -> Result<std::path::PathBuf> {
    workspace_dirs(server, uid)?
        .into_iter()
        .filter(|dir| !dir.components().any(|c| c.as_os_str() == ".gvisor"))
        .map(|dir| dir.join("workspace"))
        .find(|ws| ws.is_dir())
        .context("the session's workspace on its worker")
}

/// Issue 16 item 5: a 200 MiB file goes in and out through the gateway byte for byte,
/// streamed (no 1 MiB limit), and lands atomically with its executable bit.
#[tokio::test]
async fn large_files_round_trip_through_the_gateway() -> Result<()> {
    let (server, _client) = Server::start_async(Options::full()).await?;
    let connection = connection(&server).await?;
    let (sandbox, mut session) = acquire(&connection, "bash").await?;
    let tmp = tempfile::tempdir()?;
    let local = tmp.path().join("big.bin");
    write_pattern(&local, 200)?;
    let sent = digest_of(&local)?;

    let uploaded = sandbox.upload_file(&local, "data/big.bin").await;
    assert_eq!(
        uploaded.as_ref().err().and_then(|e| e.status()),
        Some(404),
        "a missing parent directory: {uploaded:?}"
    );
    let (done, _) = exec(&mut session, Command::shell("mkdir data")).await?;
    assert_eq!(done.state, OperationState::Succeeded, "{done:?}");
    let uploaded = sandbox.upload_file(&local, "data/big.bin").await?;
    assert_eq!(uploaded.size_bytes, 200 << 20);
    // The sandbox sees the whole file.
    let (done, out) = exec(
        &mut session,
        Command::shell("sha256sum data/big.bin | cut -d' ' -f1"),
    )
    .await?;
    assert_eq!(done.state, OperationState::Succeeded, "{done:?}");
    assert_eq!(out.trim(), sent, "the file in the sandbox");

    let back = tmp.path().join("back.bin");
    let got = sandbox.download_file("data/big.bin", &back).await?;
    assert_eq!(got, 200 << 20);
    assert_eq!(digest_of(&back)?, sent, "the file downloaded");

    // Streamed to any writer too, and a directory is refused as a file.
    let mut small = Vec::new();
    let (done, _) = exec(&mut session, Command::shell("printf hi > data/hi")).await?;
    assert_eq!(done.state, OperationState::Succeeded, "{done:?}");
    sandbox.download("data/hi", &mut small).await?;
    assert_eq!(small, b"hi");
    let dir = sandbox.download("data", &mut Vec::new()).await;
    assert!(
        matches!(
            dir,
            Err(kruntimes_client::sandbox::SandboxError::IsADirectory { .. })
        ),
        "{dir:?}"
    );
    // Nothing temporary is left beside the file.
    let ws = session_workspace(&server, sandbox.uid())?;
    let names: Vec<String> = std::fs::read_dir(ws.join("data"))?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_>>()?;
    assert_eq!(names.len(), 2, "{names:?}");

    session.close().await;
    sandbox
        .release(ReleaseOptions {
            immediate: true,
            ..ReleaseOptions::default()
        })
        .await?;
    Ok(())
}

/// A reader that yields `good` bytes and then fails: an upload cut off halfway.
struct FailsAfter {
    left: usize,
}

impl tokio::io::AsyncRead for FailsAfter {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.left == 0 {
            return std::task::Poll::Ready(Err(std::io::Error::other("cut off")));
        }
        let n = self.left.min(buf.remaining()).min(64 * 1024);
        buf.put_slice(&vec![b'x'; n]);
        self.left -= n;
        std::task::Poll::Ready(Ok(()))
    }
}

/// A raw tar entry: the tar crate's own setters refuse the hostile names this needs.
fn raw_entry(
    builder: &mut tar::Builder<Vec<u8>>,
    kind: tar::EntryType,
    name: &[u8],
    link: &[u8],
    data: &[u8],
) -> Result<()> {
    let mut header = tar::Header::new_old();
    header.set_entry_type(kind);
    header.set_size(data.len() as u64);
    header.set_mode(0o644);
    let raw = header.as_old_mut();
    raw.name[..name.len()].copy_from_slice(name);
    raw.linkname[..link.len()].copy_from_slice(link);
    header.set_cksum();
    builder.append(&header, data)?;
    Ok(())
}

/// A tar entry: its type, name, link target and data.
type TarEntry<'a> = (tar::EntryType, &'a [u8], &'a [u8], &'a [u8]);

fn tar_of(entries: &[TarEntry<'_>]) -> Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    for (kind, name, link, data) in entries {
        raw_entry(&mut builder, *kind, name, link, data)?;
    }
    Ok(builder.into_inner()?)
}

/// Issue 16 item 5: hostile paths and archive entries are refused with nothing written
/// outside the workspace; an aborted upload leaves no file; the cap is a clear 413; a
/// directory goes in and out as a tar stream.
#[tokio::test]
async fn uploads_are_confined_atomic_and_capped() -> Result<()> {
    use kruntimes_client::sandbox::SandboxError;
    use tar::EntryType::{Char, Directory, Fifo, Link, Regular, Symlink};
    let cap: u64 = 4 << 20;
    let options = Options {
        extra_args: vec!["--session-max-file-bytes".into(), cap.to_string()],
        ..Options::full()
    };
    let (server, _client) = Server::start_async(options).await?;
    let connection = connection(&server).await?;
    let (sandbox, mut session) = acquire(&connection, "bash").await?;
    let ws = session_workspace(&server, sandbox.uid())?;
    let session_dir = ws.parent().context("the session directory")?.to_path_buf();
    let outside_before: Vec<_> = std::fs::read_dir(&session_dir)?
        .map(|e| Ok(e?.file_name()))
        .collect::<Result<_>>()?;
    let reason = |e: &SandboxError| match e {
        SandboxError::Http { status, reason, .. } => (*status, reason.clone()),
        other => (0, other.to_string()),
    };

    // Hostile paths never reach the filesystem.
    for path in ["../x", "/etc/x", "a/../../x", ""] {
        let e = sandbox
            .upload(path, &b"x"[..], Some(1), false)
            .await
            .expect_err(path);
        assert_eq!(reason(&e).0, 400, "{path}: {e}");
    }
    // Nor through a symlink the sandbox made.
    let (done, _) = exec(&mut session, Command::shell("ln -s / root && ln -s .. up")).await?;
    assert_eq!(done.state, OperationState::Succeeded, "{done:?}");
    for path in ["root/tmp/escaped", "up/escaped"] {
        let e = sandbox
            .upload(path, &b"x"[..], Some(1), false)
            .await
            .expect_err(path);
        assert_eq!(reason(&e), (400, "PathEscapes".into()), "{path}: {e}");
    }
    assert!(!std::path::Path::new("/tmp/escaped").exists());

    // Hostile archives: one bad entry fails the whole upload, which leaves nothing.
    let hostile: Vec<(&str, Vec<u8>)> = vec![
        ("../x", tar_of(&[(Regular, b"../x", b"", b"x")])?),
        (
            "/etc/x",
            tar_of(&[(Regular, b"/etc/kruntimes-escape", b"", b"x")])?,
        ),
        (
            "a symlink to / then a file through it",
            tar_of(&[
                (Symlink, b"root", b"/", b""),
                (Regular, b"root/tmp/kruntimes-escape", b"", b"x"),
            ])?,
        ),
        (
            "a symlink up then a file through it",
            tar_of(&[
                (Directory, b"d/", b"", b""),
                (Symlink, b"d/up", b"..", b""),
                (Regular, b"d/up/escape", b"", b"x"),
            ])?,
        ),
        (
            "a hard link out",
            tar_of(&[(Link, b"h", b"../artifacts", b"")])?,
        ),
        (
            "a hard link to /etc/passwd",
            tar_of(&[(Link, b"h", b"/etc/passwd", b"")])?,
        ),
        ("a device", tar_of(&[(Char, b"null", b"", b"")])?),
        ("a FIFO", tar_of(&[(Fifo, b"pipe", b"", b"")])?),
    ];
    for (what, bytes) in hostile {
        let size = bytes.len() as u64;
        let e = sandbox
            .upload_tar("unpacked", std::io::Cursor::new(bytes), Some(size))
            .await
            .expect_err(what);
        assert_eq!(reason(&e), (400, "InvalidArchive".into()), "{what}: {e}");
        assert!(!ws.join("unpacked").exists(), "{what}");
    }
    assert!(!std::path::Path::new("/etc/kruntimes-escape").exists());
    assert!(!std::path::Path::new("/tmp/kruntimes-escape").exists());
    // Oversized: an archive announced over the cap is refused before a byte is read.
    let e = sandbox
        .upload_tar("unpacked", tokio::io::repeat(0), Some(cap + 1))
        .await
        .expect_err("over the cap");
    assert_eq!(reason(&e), (413, "FileTooLarge".into()), "{e}");
    // A file over the cap, announced or not.
    let e = sandbox
        .upload("big", tokio::io::repeat(7), Some(cap + 1), false)
        .await
        .expect_err("announced over the cap");
    assert_eq!(reason(&e), (413, "FileTooLarge".into()), "{e}");
    assert!(
        e.to_string().contains(&cap.to_string()),
        "names the cap: {e}"
    );
    let e = sandbox
        .upload(
            "big",
            tokio::io::AsyncReadExt::take(tokio::io::repeat(7), cap + 1),
            None,
            false,
        )
        .await
        .expect_err("streamed over the cap");
    assert_eq!(reason(&e), (413, "FileTooLarge".into()), "{e}");

    // An upload cut off halfway leaves neither the file nor a temporary, and an older
    // file of that name stays as it was.
    let (done, _) = exec(&mut session, Command::shell("printf old > kept")).await?;
    assert_eq!(done.state, OperationState::Succeeded, "{done:?}");
    for path in ["cut", "kept"] {
        let e = sandbox
            .upload(path, FailsAfter { left: 3 << 20 }, None, false)
            .await;
        assert!(e.is_err(), "{path}: {e:?}");
    }
    wait_for_no_temporaries(&ws).await?;
    assert!(!ws.join("cut").exists());
    assert_eq!(std::fs::read(ws.join("kept"))?, b"old");

    // A directory in and out: files, an executable bit, an inner symlink, a hard link.
    let tmp = tempfile::tempdir()?;
    let tree = tmp.path().join("tree");
    std::fs::create_dir_all(tree.join("src/nested"))?;
    std::fs::write(tree.join("src/main.sh"), "echo main\n")?;
    std::fs::set_permissions(
        tree.join("src/main.sh"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )?;
    std::fs::write(tree.join("src/nested/data"), vec![5u8; 3 << 20])?;
    std::os::unix::fs::symlink("main.sh", tree.join("src/link"))?;
    let up = sandbox
        .upload_dir(&tree, "repo")
        .await
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    assert_eq!(up.files, 2, "{up:?}");
    let (done, out) = exec(
        &mut session,
        Command::shell("./repo/src/link && wc -c < repo/src/nested/data"),
    )
    .await?;
    assert_eq!(done.state, OperationState::Succeeded, "{done:?}");
    assert_eq!(out, format!("main\n{}\n", 3 << 20));
    let e = sandbox
        .upload_dir(&tree, "repo")
        .await
        .expect_err("not empty");
    assert_eq!(reason(&e), (409, "DirectoryNotEmpty".into()), "{e}");
    let back = tmp.path().join("back");
    sandbox.download_dir("repo", &back).await?;
    assert_eq!(
        std::fs::read(back.join("src/nested/data"))?,
        vec![5u8; 3 << 20]
    );
    assert_eq!(
        std::fs::read_link(back.join("src/link"))?,
        std::path::Path::new("main.sh")
    );
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(back.join("src/main.sh"))?.permissions(),
    );
    assert_eq!(mode & 0o111, 0o111, "the executable bit");

    // Nothing appeared beside the workspace.
    let outside_after: Vec<_> = std::fs::read_dir(&session_dir)?
        .map(|e| Ok(e?.file_name()))
        .collect::<Result<_>>()?;
    assert_eq!(outside_before, outside_after);
    assert!(
        std::fs::read_dir(session_dir.join("artifacts"))?
            .next()
            .is_none()
    );

    session.close().await;
    sandbox
        .release(ReleaseOptions {
            immediate: true,
            ..ReleaseOptions::default()
        })
        .await?;
    Ok(())
}

/// Waits until no upload's temporary is left in `ws` (the worker removes it once it sees
/// the stream end without its `end`, which may come after the caller's error).
async fn wait_for_no_temporaries(ws: &std::path::Path) -> Result<()> {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let left: Vec<String> = std::fs::read_dir(ws)?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".krt-upload-"))
            .collect();
        if left.is_empty() {
            return Ok(());
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "temporaries left: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `POST {base}/operations:execute` on the session of `sandbox`: the status and the JSON
/// answer (the admin's token, the Run's endpoint and CA).
async fn execute(
    server: &Server,
    sandbox: &Sandbox,
    body: serde_json::Value,
) -> Result<(u16, serde_json::Value)> {
    use http_body_util::BodyExt;
    let run = sandbox.run().await?;
    let endpoint = run
        .status
        .as_ref()
        .and_then(|s| s.endpoint.as_ref())
        .context("no endpoint")?;
    let token = kruntimes_testkit::admin_token(&server.kubeconfig_path())?;
    let client = common::Endpoint::of(endpoint, &token)?;
    let request = http::Request::builder()
        .method(http::Method::POST)
        .uri(format!("{}/operations:execute", client.path))
        .header("content-type", "application/json")
        .body(kube::client::Body::from(serde_json::to_vec(&body)?))?;
    let response = client.client.send(request).await?;
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await?.to_bytes();
    let value = serde_json::from_slice(&bytes)
        .with_context(|| format!("{status}: {}", String::from_utf8_lossy(&bytes)))?;
    Ok((status, value))
}

/// The decoded text of a base64 field of an `operations:execute` answer.
fn decoded(answer: &serde_json::Value, field: &str) -> Result<String> {
    use base64::Engine;
    let text = answer[field].as_str().context("no such field")?;
    let bytes = base64::engine::general_purpose::STANDARD.decode(text)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Issue 20 (the machines view): one operation in, one JSON result out, through the same
/// queue. A non-zero exit is a successful call with its code; death by signal s is 128+s;
/// a missing program 127 with the reason on stderr; a timeout 124 with `timedOut` and no
/// surviving process; argv is passed as is, never to a shell. A malformed body changes
/// nothing, and the operations' sequence numbers go on in order.
#[tokio::test]
async fn execute_answers_one_operation_with_the_machine_exit_codes() -> Result<()> {
    let (server, _client) = Server::start_async(Options::full()).await?;
    let connection = connection(&server).await?;
    let sandbox = connection
        .runtime("bash")
        .acquire_sandbox(&AcquireOptions::default())
        .await?;
    let mut last = 0;
    let cases = [
        (json!({"command": {"argv": ["echo", "; rm -rf /"]}}), 0),
        (
            json!({"command": {"argv": ["sh", "-c", "echo out; echo err >&2; exit 3"]}}),
            3,
        ),
        (
            json!({"command": {"argv": ["sh", "-c", "kill -9 $$"]}}),
            137,
        ),
        (json!({"command": {"argv": ["no-such-program-here"]}}), 127),
        (
            json!({"command": {"argv": ["sh", "-c", "sleep 60 & echo $! > bg; sleep 60"]}, "timeoutSeconds": 1}),
            124,
        ),
    ];
    for (body, code) in cases {
        let (status, answer) = execute(&server, &sandbox, body.clone()).await?;
        ensure!(status == 200, "{body}: {status} {answer}");
        ensure!(answer["exitCode"] == json!(code), "{body}: {answer}");
        ensure!(answer["timedOut"] == json!(code == 124), "{body}: {answer}");
        let sequence = answer["sequence"].as_u64().context("sequence")?;
        ensure!(sequence > last, "{body}: sequence {sequence} after {last}");
        last = sequence;
        match code {
            0 => ensure!(decoded(&answer, "stdout")? == "; rm -rf /\n", "{answer}"),
            3 => {
                ensure!(decoded(&answer, "stdout")? == "out\n", "{answer}");
                ensure!(decoded(&answer, "stderr")? == "err\n", "{answer}");
            }
            137 => ensure!(answer["signal"] == json!(9), "{answer}"),
            127 => ensure!(
                decoded(&answer, "stderr")?.contains("no-such-program-here"),
                "{answer}"
            ),
            _ => {}
        }
    }
    // The timed-out command's background process went with it.
    let (_, answer) = execute(
        &server,
        &sandbox,
        json!({"command": {"argv": ["sh", "-c", "kill -0 $(cat bg) && echo alive || echo gone"]}}),
    )
    .await?;
    ensure!(decoded(&answer, "stdout")?.ends_with("gone\n"), "{answer}");
    // A file operation has an outcome and no exit code.
    let (status, answer) = execute(
        &server,
        &sandbox,
        json!({"writeFile": {"path": "note", "content": "aGk="}}),
    )
    .await?;
    ensure!(status == 200 && answer["state"] == "Succeeded", "{answer}");
    ensure!(answer.get("exitCode").is_none(), "{answer}");
    // A wrong working directory is the caller's error, not the machine's.
    let (status, answer) = execute(
        &server,
        &sandbox,
        json!({"command": {"argv": ["true"], "cwd": "no/such/dir"}}),
    )
    .await?;
    ensure!(
        status == 404 && answer["reason"] == "NotFound",
        "{status} {answer}"
    );
    // Refused at the boundary: nothing runs.
    let (status, answer) = execute(
        &server,
        &sandbox,
        json!({"command": {"shell": "touch refused", "user": "root"}}),
    )
    .await?;
    ensure!(status == 400, "{status} {answer}");
    let (_, answer) = execute(
        &server,
        &sandbox,
        json!({"command": {"argv": ["sh", "-c", "test -e refused && echo ran || echo not; cat note"]}}),
    )
    .await?;
    ensure!(decoded(&answer, "stdout")? == "not\nhi", "{answer}");
    sandbox.release(ReleaseOptions::default()).await?;
    Ok(())
}

/// The API server's status code of a failed claim, when the API server refused it.
fn api_status(error: &MachineError) -> Option<u16> {
    error.api_status()
}

/// Issue 20 (the machines view, Exec class): eight concurrent claims of one project are
/// all Ready at once, each with its own files and output; writes make their directories
/// and go through the queue before the exec after them; the exit codes are the shell's
/// (3, 137, 127 with the reason on stderr, 124 with `timed_out`); argv reaches the program
/// as it is; Dev and Desktop are refused before anything is created; a token of another
/// namespace cannot claim here; release deletes the Run.
#[tokio::test]
async fn machines_claim_write_exec_and_release() -> Result<()> {
    use kruntimes_client::machines::{Class, ExecRequest, Machines, PROJECT_LABEL, Spec};
    let (server, admin) = Server::start_async(Options::full()).await?;
    create_runtime(&admin, "machines", "bash", 2, 4).await?;
    let machines = Machines::new(connection(&server).await?, "machines");
    let spec = Spec::new("default", Class::Exec, "proj");
    let leases = futures::future::try_join_all((0..8).map(|_| machines.claim(&spec))).await?;
    let runs: Api<Run> = Api::namespaced(admin.clone(), "default");
    let listed = runs
        .list(&kube::api::ListParams::default().labels(&format!("{PROJECT_LABEL}=proj")))
        .await?;
    ensure!(
        listed.items.len() == 8 && listed.items.iter().all(|r| r.phase() == Phase::Ready),
        "{:?}",
        listed
            .items
            .iter()
            .map(|r| (r.name_any(), r.phase()))
            .collect::<Vec<_>>()
    );
    futures::future::try_join_all(leases.iter().enumerate().map(|(i, lease)| {
        let machines = machines.clone();
        async move {
            machines
                .write(lease, "in/deep/n.txt", format!("machine {i}").as_bytes())
                .await?;
            let seen = machines
                .exec(lease, &ExecRequest::argv(["cat", "in/deep/n.txt"]))
                .await?;
            ensure!(
                seen.exit_code == 0 && seen.stdout == format!("machine {i}").into_bytes(),
                "{i}: {seen:?}"
            );
            Ok::<_, anyhow::Error>(())
        }
    }))
    .await?;

    let lease = &leases[0];
    let literal = machines
        .exec(lease, &ExecRequest::argv(["echo", "; rm -rf /"]))
        .await?;
    assert_eq!(literal.stdout, b"; rm -rf /\n");
    let mut with_env = ExecRequest::argv(["sh", "-c", "echo $GREETING >&2; exit 3"]);
    with_env.env.insert("GREETING".into(), "hi".into());
    let three = machines.exec(lease, &with_env).await?;
    assert_eq!(
        (three.exit_code, three.stderr.as_slice()),
        (3, &b"hi\n"[..])
    );
    let killed = machines
        .exec(lease, &ExecRequest::argv(["sh", "-c", "kill -9 $$"]))
        .await?;
    assert_eq!(killed.exit_code, 137);
    let missing = machines
        .exec(lease, &ExecRequest::argv(["no-such-program"]))
        .await?;
    assert_eq!(missing.exit_code, 127);
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("no-such-program"),
        "{missing:?}"
    );
    let mut slow = ExecRequest::argv(["sleep", "60"]);
    slow.timeout = Some(Duration::from_secs(1));
    let timed_out = machines.exec(lease, &slow).await?;
    assert!(
        timed_out.timed_out && timed_out.exit_code == 124,
        "{timed_out:?}"
    );

    // Desktop: refused, nothing created (Dev machines: tests/workspaces.rs).
    let refused = machines
        .claim(&Spec::new("default", Class::Desktop, "proj"))
        .await
        .expect_err("refused");
    ensure!(
        matches!(refused, MachineError::Sandbox(SandboxError::Invalid { .. })),
        "{refused}"
    );
    // Another namespace's token claims nothing here.
    kruntimes_testkit::setup::namespace(&admin, "tenant-b").await?;
    let token = kruntimes_testkit::setup::service_account_token(
        &admin,
        "tenant-b",
        "agent",
        vec![kruntimes_testkit::setup::kruntimes_rule(
            &["create", "get", "list", "watch", "delete"],
            &["runs"],
        )],
        3600,
    )
    .await?;
    let mut config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::read_from(server.kubeconfig_path())?,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    config.auth_info = kube::config::AuthInfo {
        token: Some(token.into()),
        ..kube::config::AuthInfo::default()
    };
    let tenant = Machines::new(Connection::from_config(config, "tenant-b")?, "machines");
    let refused = tenant.claim(&spec).await.expect_err("another tenant");
    ensure!(api_status(&refused) == Some(403), "{refused}");
    let count = runs
        .list(&kube::api::ListParams::default().labels(&format!("{PROJECT_LABEL}=proj")))
        .await?
        .items
        .len();
    ensure!(count == 8, "{count} machines of the project");

    // Released: asked to end and deleted at once; each Run goes once its worker cleaned up.
    futures::future::try_join_all(leases.iter().map(|lease| machines.release(lease))).await?;
    for item in &listed.items {
        let uid = item.uid().context("uid")?;
        within(DEADLINE, "a released machine's Run goes", async {
            kube::runtime::wait::await_condition(
                runs.clone(),
                &item.name_any(),
                kube::runtime::wait::conditions::is_deleted(&uid),
            )
            .await?;
            Ok(())
        })
        .await?;
    }
    Ok(())
}

/// Issue 20 (machines): a worker SIGKILLed while `exec` runs gives the caller an error
/// whose outcome is unknown, never an exit code.
#[tokio::test]
async fn a_worker_lost_during_exec_is_an_error_never_a_result() -> Result<()> {
    use kruntimes_client::machines::{Class, ExecRequest, Machines, Spec};
    let (server, admin) = Server::start_async(Options::full()).await?;
    create_runtime(&admin, "lossy-machines", "bash", 1, 2).await?;
    let connection = connection(&server).await?;
    let machines = Machines::new(connection.clone(), "lossy-machines");
    let lease = machines
        .claim(&Spec::new("default", Class::Exec, "lost"))
        .await?;
    let running = {
        let machines = machines.clone();
        let lease = lease.clone();
        tokio::spawn(async move {
            machines
                .exec(&lease, &ExecRequest::argv(["sleep", "60"]))
                .await
        })
    };
    let sandbox = connection.sandbox(&lease.id).await?;
    within(DEADLINE, "the command runs", async {
        loop {
            if !sandbox.status().await?.running_operation_id.is_empty() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await?;
    let run: Run = Api::namespaced(admin.clone(), "default")
        .get(&lease.id)
        .await?;
    let (pod, _) = assigned(&run);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(runtimed_of(&pod)?),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let answer = within(DEADLINE, "the exec answers", async { Ok(running.await?) }).await?;
    match answer {
        Ok(result) => anyhow::bail!("a lost worker gave a result: {result:?}"),
        Err(MachineError::Sandbox(error)) => {
            ensure!(error.outcome_unknown(), "{error}");
        }
        Err(other) => anyhow::bail!("{other}"),
    }
    Ok(())
}
