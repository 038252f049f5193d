//! Suspend and resume, the API side, against a real `kruntimes up`: `spec.suspend` on a
//! session Run, the `Snapshot` kind served natively (CRUD, watch, `/status`, immutable spec,
//! `kubectl get snapshots`), the `Suspended` phase holding no capacity, the gateway's 409s,
//! and the controller's resume (Pending, then placed and Ready again in incarnation 2).
//!
//! What is faked, and why: runtimed does not capture sessions yet (a later step wires its
//! suspend flow). So while the session is Ready with `spec.suspend: true` it stays Ready,
//! and this test plays the owning worker: with runtimed's own identity it creates the
//! Snapshot, writes its status (Capturing, then Ready with made-up sizes and a `file://`
//! location: nothing is written there), then writes the Run's status to Suspended through
//! the status subresource. Everything else (admission, RBAC, the controller, the scheduler,
//! the gateway, kubectl) is real. Every wait is a watch with a deadline.

mod common;

use anyhow::{Context, Result, ensure};
use common::{DEADLINE, Endpoint, create, create_runtime, wait_for, wait_ready};
use futures::{StreamExt, TryStreamExt};
use kruntimes_api::lifecycle::{SUSPENDED_CONDITION, record_suspend};
use kruntimes_api::run::{RunMode, RunResources, RunSnapshotRef, SessionMode};
use kruntimes_api::snapshot::{
    SnapshotLocalCopy, SnapshotLocation, SnapshotPhase, SnapshotSpec, SnapshotStatus,
};
use kruntimes_api::{Phase, Run, RunSpec, Snapshot};
use kruntimes_client::Connection;
use kruntimes_client::session::{Command, Operation};
use kruntimes_testkit::{Options, Server, within};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource};
use serde_json::{Value, json};

/// An exclusive session Run of `runtime`.
fn exclusive_session(runtime: &str) -> RunSpec {
    let mut spec = RunSpec::task(runtime, "unused");
    spec.mode = RunMode {
        session: Some(SessionMode::default()),
        ..RunMode::default()
    };
    spec.resources = Some(RunResources {
        exclusive: Some(true),
        ..RunResources::default()
    });
    spec
}

/// A client with runtimed's own least-privilege identity: the worker's credentials.
async fn worker_client(server: &Server) -> Result<Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(server.component_kubeconfig("runtimed"))
        .context("read the runtimed kubeconfig")?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    Ok(Client::try_from(config)?)
}

/// POSTs one operation to the session at `endpoint` through the gateway until the answer
/// is `status`/`reason` (the gateway's Run cache follows the API server through a watch:
/// each attempt is a real call, none waits on a timer), at most [`DEADLINE`]. Returns the
/// error body.
async fn operation_answers(endpoint: &Endpoint, status: u16, reason: &str) -> Result<Value> {
    let body = serde_json::to_vec(&Operation::command(Command::shell("true")).to_json()?)?;
    let path = format!("{}/operations", endpoint.path);
    within(
        DEADLINE,
        &format!("the gateway answers {status} {reason}"),
        async {
            loop {
                let request = http::Request::post(&path)
                    .header("content-type", "application/json")
                    .body(kube::client::Body::from(body.clone()))?;
                let response = endpoint.client.send(request).await?;
                let code = response.status().as_u16();
                let bytes = http_body_util::BodyExt::collect(response.into_body())
                    .await?
                    .to_bytes();
                if code == status {
                    let answer: Value = serde_json::from_slice(&bytes)?;
                    if answer["reason"] == reason {
                        return Ok(answer);
                    }
                }
            }
        },
    )
    .await
}

#[tokio::test]
async fn a_session_suspends_to_a_snapshot_holds_nothing_and_resumes() -> Result<()> {
    let (server, admin) = Server::start_async(Options::full()).await?;
    // One worker of one slot: two sessions fit only if the suspended one holds nothing.
    create_runtime(&admin, "solo", "bash", 1, 1).await?;
    let runs = Api::<Run>::namespaced(admin.clone(), "default");
    create(&admin, "first", exclusive_session("solo")).await?;
    let ready = wait_ready(&admin, "first").await?;
    ensure!(ready.phase() == Phase::Ready, "{:?}", ready.status);
    assert_eq!(ready.incarnation(), 1);
    assert_eq!(ready.status.as_ref().and_then(|s| s.incarnation), Some(1));
    assert_eq!(ready.metadata.generation, Some(1));
    let session_endpoint = Endpoint::of(
        ready
            .status
            .as_ref()
            .and_then(|s| s.endpoint.as_ref())
            .context("a Ready session publishes an endpoint")?,
        &kruntimes_testkit::admin_token(&server.kubeconfig_path())?,
    )?;
    let (pod, pod_uid) = {
        let status = ready.status.clone().unwrap_or_default();
        (
            status.assigned_pod.context("assigned")?,
            status.assigned_pod_uid.context("assigned UID")?,
        )
    };

    // spec.suspend: the one spec field a user may change; the SDK's patch bumps the
    // generation and says which one it produced. Nothing captures yet: it stays Ready.
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection.sandbox("first").await?;
    assert_eq!(sandbox.suspend().await?, 2);
    let asked = runs.get("first").await?;
    assert_eq!(asked.spec.suspend, Some(true));
    assert_eq!(asked.metadata.generation, Some(2));
    assert_eq!(asked.phase(), Phase::Ready, "no worker captures yet");
    // Other spec fields stay immutable beside it.
    let err = runs
        .patch(
            "first",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"suspend": false, "timeout": "1m"}})),
        )
        .await
        .expect_err("spec.timeout is immutable");
    let kube::Error::Api(status) = err else {
        anyhow::bail!("expected a 422, got {err:?}");
    };
    assert_eq!(status.code, 422);
    assert!(
        status.message.contains("spec.timeout"),
        "{}",
        status.message
    );
    // Being suspended, the session takes no new operations.
    let answer = operation_answers(&session_endpoint, 409, "SessionSuspending").await?;
    assert!(
        answer["message"]
            .as_str()
            .is_some_and(|m| m.contains("being suspended")),
        "{answer}"
    );

    // The worker's capture, faked: a Snapshot owned by the Run, created, watched and
    // completed with runtimed's credentials.
    let worker = worker_client(&server).await?;
    let snapshots = Api::<Snapshot>::namespaced(worker.clone(), "default");
    let mut snapshot = Snapshot::new(
        "first-1",
        SnapshotSpec {
            run_name: "first".into(),
            reason: None,
        },
    );
    snapshot.metadata.owner_references =
        Some(vec![asked.controller_owner_ref(&()).context("owner")?]);
    let mut events = watcher(
        Api::<Snapshot>::namespaced(admin.clone(), "default"),
        watcher::Config::default(),
    )
    .applied_objects()
    .boxed();
    let created = snapshots.create(&PostParams::default(), &snapshot).await?;
    assert_eq!(created.phase(), SnapshotPhase::Pending);
    let digest = format!("sha256:{}", "ab".repeat(32));
    let mut capturing = created.clone();
    capturing.status = Some(SnapshotStatus {
        phase: Some(SnapshotPhase::Capturing),
        ..SnapshotStatus::default()
    });
    let capturing = snapshots
        .replace_status("first-1", &PostParams::default(), &capturing)
        .await?;
    let mut done = capturing.clone();
    done.status = Some(SnapshotStatus {
        phase: Some(SnapshotPhase::Ready),
        size_bytes: Some(4096),
        compressed_bytes: Some(1024),
        files: Some(3),
        digest: Some(digest.clone()),
        last_sequence: Some(7),
        incarnation: Some(1),
        location: Some(SnapshotLocation {
            uri: "file:///var/lib/kruntimes/snapshots/default/first-1.tar.zst".into(),
            manifest_uri: Some("file:///var/lib/kruntimes/snapshots/default/first-1.json".into()),
        }),
        local_copy: Some(SnapshotLocalCopy {
            pod: pod.clone(),
            pod_uid: Some(pod_uid.clone()),
        }),
        completion_time: Some(kruntimes_api::lifecycle::now_rfc3339()),
        ..SnapshotStatus::default()
    });
    snapshots
        .replace_status("first-1", &PostParams::default(), &done)
        .await?;
    let seen = within(DEADLINE, "the watch shows the Snapshot Ready", async {
        loop {
            let snapshot = events.try_next().await?.context("the watch ended")?;
            if snapshot.phase() == SnapshotPhase::Ready {
                return Ok(snapshot);
            }
        }
    })
    .await?;
    assert_eq!(seen.status.as_ref().and_then(|s| s.files), Some(3));
    // Its spec is immutable (422 naming the field), and Ready is final.
    let err = Api::<Snapshot>::namespaced(admin.clone(), "default")
        .patch(
            "first-1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"runName": "other"}})),
        )
        .await
        .expect_err("spec.runName is immutable");
    let kube::Error::Api(status) = err else {
        anyhow::bail!("expected a 422, got {err:?}");
    };
    assert_eq!(status.code, 422);
    assert!(
        status.message.contains("spec.runName: field is immutable"),
        "{}",
        status.message
    );
    // kubectl lists it with its printer columns.
    let table = server.kubectl_ok(&["get", "snapshots", "-n", "default"])?;
    let mut lines = table.lines();
    let header: Vec<&str> = lines
        .next()
        .context("a header")?
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        ["NAME", "RUN", "PHASE", "SIZE", "FILES", "AGE"],
        "{table}"
    );
    let row: Vec<&str> = lines.next().context("a row")?.split_whitespace().collect();
    assert_eq!(
        &row[..5],
        ["first-1", "first", "Ready", "4096", "3"],
        "{table}"
    );
    // The worker writes the Run Suspended (with the Snapshot) through /status.
    let worker_runs = Api::<Run>::namespaced(worker.clone(), "default");
    let mut suspended = worker_runs.get("first").await?;
    let generation = suspended.metadata.generation;
    let spec = suspended.spec.clone();
    record_suspend(
        &spec,
        suspended.status.get_or_insert_with(Default::default),
        RunSnapshotRef {
            name: "first-1".into(),
            uri: Some("file:///var/lib/kruntimes/snapshots/default/first-1.tar.zst".into()),
            last_sequence: Some(7),
        },
        generation,
    );
    worker_runs
        .replace_status("first", &PostParams::default(), &suspended)
        .await?;
    // Ready cannot be entered straight from Suspended: the server refuses the skip.
    let mut skip = runs.get("first").await?;
    if let Some(status) = skip.status.as_mut() {
        status.phase = Some(Phase::Ready);
    }
    let err = worker_runs
        .replace_status("first", &PostParams::default(), &skip)
        .await
        .expect_err("Suspended -> Ready skips the placement");
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 422 && s.message.contains("status.phase")),
        "{err:?}"
    );

    // Suspended holds no capacity: a second exclusive session gets the one slot.
    create(&admin, "second", exclusive_session("solo")).await?;
    let second = wait_ready(&admin, "second").await?;
    ensure!(second.phase() == Phase::Ready, "{:?}", second.status);
    let first = runs.get("first").await?;
    assert_eq!(first.phase(), Phase::Suspended, "{:?}", first.status);
    // kubectl shows the phase.
    let phase = server.kubectl_ok(&["get", "run", "first", "-n", "default"])?;
    assert!(phase.contains("Suspended"), "{phase}");
    // The gateway: 409 SessionSuspended, for operations and for reads alike.
    let answer = operation_answers(&session_endpoint, 409, "SessionSuspended").await?;
    assert!(
        answer["message"]
            .as_str()
            .is_some_and(|m| m.contains("suspended") && m.contains("spec.suspend")),
        "{answer}"
    );
    // The SDK says so in a typed error, before any call.
    let err = sandbox.status().await.expect_err("suspended");
    assert!(
        matches!(
            err,
            kruntimes_client::sandbox::SandboxError::Suspended { .. }
        ),
        "{err:?}"
    );

    // Resume: the second session goes, spec.suspend is cleared; the controller sends the
    // Run back to Pending as incarnation 2, the scheduler places it, runtimed registers it.
    runs.delete("second", &DeleteParams::default()).await?;
    within(DEADLINE, "the second session is gone", async {
        kube::runtime::wait::await_condition(runs.clone(), "second", |r: Option<&Run>| r.is_none())
            .await?;
        Ok(())
    })
    .await?;
    let mut phases = watcher(
        Api::<Run>::namespaced(admin.clone(), "default"),
        watcher::Config::default().fields("metadata.name=first"),
    )
    .applied_objects()
    .boxed();
    assert_eq!(sandbox.resume().await?, 3);
    let resumed = within(DEADLINE, "first is Ready again", async {
        let mut seen = Vec::new();
        loop {
            let run = phases.try_next().await?.context("the watch ended")?;
            if seen.last() != Some(&run.phase()) {
                seen.push(run.phase());
            }
            if run.phase() == Phase::Ready && run.incarnation() == 2 {
                return Ok((run, seen));
            }
            ensure!(!run.phase().is_terminal(), "it ended: {:?}", run.status);
        }
    })
    .await?;
    let (resumed, seen) = resumed;
    assert!(
        seen.contains(&Phase::Pending),
        "a resume goes through Pending: {seen:?}"
    );
    let status = resumed.status.clone().unwrap_or_default();
    assert_eq!(status.incarnation, Some(2));
    assert_eq!(
        status.snapshot.as_ref().map(|s| s.name.as_str()),
        Some("first-1"),
        "the snapshot is kept for the restore"
    );
    let condition = status
        .conditions
        .iter()
        .find(|c| c.type_ == SUSPENDED_CONDITION)
        .context("a Suspended condition")?;
    assert_eq!(condition.status, "False");
    assert_eq!(condition.observed_generation, Some(3));
    // It went back to the worker that keeps the local copy (the only one here).
    assert_eq!(status.assigned_pod.as_deref(), Some(pod.as_str()));
    let _ = wait_for(&admin, "first", "is Ready", |r| r.phase() == Phase::Ready).await?;
    Ok(())
}
