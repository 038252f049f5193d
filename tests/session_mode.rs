//! Session mode end to end, the lifecycle side: `kruntimes up` with its controller-manager
//! and local workers; session Runs created through the API, driven through their phases,
//! and checked against the workers' processes and files.

mod common;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::{
    DEADLINE, create, create_runtime, processes_with, ready_condition, runtimed_of, wait_for,
    wait_ready, wait_terminal,
};
use kruntimes_api::lifecycle::REGISTRATION_FINALIZER;
use kruntimes_api::run::{
    EnvVar, RetryPolicy, RunMode, RunSource, SessionMode, Termination, TerminationMode,
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
async fn a_session_registers_and_the_local_gate_never_mixes_runs() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    create_runtime(&client, "solo", "bash", 1, 2).await?;
    let mut spec = session("solo");
    spec.env = Some(vec![EnvVar {
        name: "GREETING".into(),
        value: "hello".into(),
    }]);
    spec.source = Some(RunSource {
        inline: Some("echo from source\n".into()),
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

    // The worker has a free slot, but a session holds it: a task waits, Scheduled.
    let mut task = RunSpec::task("solo", "main.sh");
    task.source = Some(RunSource {
        inline: Some("echo task ran\n".into()),
    });
    create(&client, "waiting-task", task).await?;
    wait_for(&client, "waiting-task", "is assigned", |r| {
        r.phase() != Phase::Pending
    })
    .await?;
    stays(
        &client,
        "waiting-task",
        Phase::Scheduled,
        Duration::from_secs(2),
    )
    .await?;
    // Releasing the session frees the worker: the task runs.
    terminate(&client, "sandbox", TerminationMode::Immediate).await?;
    let ended = wait_terminal(&client, "sandbox").await?;
    assert_eq!(ended.phase(), Phase::Cancelled, "{:?}", ended.status);
    let task = wait_terminal(&client, "waiting-task").await?;
    assert_eq!(task.phase(), Phase::Succeeded, "{:?}", task.status);

    // The other way round: a session waits while a task runs.
    let flag = tempfile::NamedTempFile::new()?.into_temp_path();
    let flag_path = flag.to_path_buf();
    std::fs::remove_file(&flag_path)?;
    let mut long = RunSpec::task("solo", "main.sh");
    long.source = Some(RunSource {
        inline: Some(format!(
            "while [ ! -e {} ]; do sleep 0.02; done\n",
            flag_path.display()
        )),
    });
    create(&client, "long-task", long).await?;
    wait_for(&client, "long-task", "runs", |r| {
        r.phase() == Phase::Running
    })
    .await?;
    create(&client, "late-sandbox", session("solo")).await?;
    wait_for(&client, "late-sandbox", "is assigned", |r| {
        r.phase() != Phase::Pending
    })
    .await?;
    stays(
        &client,
        "late-sandbox",
        Phase::Scheduled,
        Duration::from_secs(2),
    )
    .await?;
    std::fs::write(&flag_path, b"go")?;
    wait_terminal(&client, "long-task").await?;
    wait_ready(&client, "late-sandbox").await?;

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
