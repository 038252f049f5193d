//! Kubernetes Events of task Runs at the worker (issue 15, item 6): a program that cannot
//! start, a task past its `spec.timeout`, a cancellation carried out here. Each is read back
//! as `kubectl get events --field-selector involvedObject.name=NAME` reads it, against
//! runtimed's reconciler in this process (see `common`). Functions and sessions are in
//! `ready.rs`, the drain in `runtimed.rs`.

mod common;

use anyhow::Result;
use common::{DEADLINE, Rig, rig, task};
use k8s_openapi::api::core::v1::Event;
use kruntimes_api::{Phase, Run, RunSpec};
use kube::ResourceExt;
use kube::api::{Patch, PatchParams};
use serde_json::json;

/// Waits for the Event `reason` that runtimed leaves on `run`, of type `type_`.
async fn event(rig: &Rig, run: &Run, type_: &str, reason: &str) -> Result<Event> {
    let event = kruntimes_testkit::events::wait_for(
        &rig.admin,
        "default",
        &run.name_any(),
        reason,
        DEADLINE,
    )
    .await?;
    assert_eq!(event.type_.as_deref(), Some(type_), "{event:?}");
    assert_eq!(
        event.reporting_component.as_deref(),
        Some("kruntimes.io/runtimed"),
        "{event:?}"
    );
    assert_eq!(event.involved_object.uid, run.uid(), "{event:?}");
    Ok(event)
}

async fn ended(rig: &Rig, run: &Run) -> Result<Run> {
    rig.until(&run.name_any(), "ends", |r| r.phase().is_terminal())
        .await
}

#[tokio::test]
async fn a_task_that_cannot_start_leaves_an_event() -> Result<()> {
    let rig = rig("events-w1").await?;
    // No source: the entrypoint does not exist in the workspace.
    let run = rig.assign(RunSpec::task("bash", "missing.sh")).await?;
    let done = ended(&rig, &run).await?;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), Phase::Failed, "{status:?}");
    let reason = status.reason.clone().unwrap_or_default();
    assert_eq!(reason, "StartFailed", "{status:?}");
    let event = event(&rig, &run, "Warning", &reason).await?;
    assert_eq!(event.action.as_deref(), Some("Execute"));
    assert_eq!(
        event.message, status.message,
        "the Event says what the status says"
    );
    Ok(())
}

#[tokio::test]
async fn a_task_past_its_timeout_leaves_an_event() -> Result<()> {
    let rig = rig("events-w2").await?;
    let mut spec = task("sleep 600\n");
    spec.timeout = Some("1s".into());
    let run = rig.assign(spec).await?;
    let done = ended(&rig, &run).await?;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), Phase::Timeout, "{status:?}");
    let reason = status.reason.clone().unwrap_or_default();
    let event = event(&rig, &run, "Warning", &reason).await?;
    assert_eq!(event.action.as_deref(), Some("Stop"));
    assert!(
        event
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("spec.timeout of 1s"),
        "{event:?}"
    );
    Ok(())
}

#[tokio::test]
async fn a_task_cancelled_at_the_worker_leaves_an_event() -> Result<()> {
    let rig = rig("events-w3").await?;
    let run = rig.assign(task("sleep 600\n")).await?;
    rig.until(&run.name_any(), "runs", |r| r.phase() == Phase::Running)
        .await?;
    let patch = json!({"spec": {"termination": {"mode": "Immediate"}}});
    rig.runs()
        .patch(
            &run.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    let done = ended(&rig, &run).await?;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), Phase::Cancelled, "{status:?}");
    let event = event(&rig, &run, "Normal", "Cancelled").await?;
    assert_eq!(event.action.as_deref(), Some("Cancel"));
    Ok(())
}
