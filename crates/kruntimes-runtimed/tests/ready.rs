//! Ready follows the phase (issue 15, item 3): every runtimed writer that takes a function
//! or session Run out of Ready sets `Ready=False` with the transition's specific reason.
//! One test per transition, against runtimed's reconciler in this process (see `common`).
//!
//! Each transition also leaves a Kubernetes Event on the Run with that reason, reported by
//! runtimed (issue 15, item 6), read back as `kubectl get events --field-selector
//! involvedObject.name=NAME` does ([`assert_event`]).

mod common;

use anyhow::{Context as _, Result};
use common::{Rig, function, rig, session};
use k8s_openapi::api::core::v1::Event;
use kruntimes_api::run::{RetryPolicy, SessionMode};
use kruntimes_api::{Phase, Run, RunSpec, Runtime, RuntimeSpec};
use kruntimes_proto::runtime::v1 as rs;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

/// The Run's `Ready` condition: (status, reason).
fn ready_of(run: &Run) -> Option<(String, String)> {
    run.status.as_ref()?.conditions.iter().find_map(|c| {
        (c.type_ == "Ready").then(|| (c.status.clone(), c.reason.clone().unwrap_or_default()))
    })
}

fn assert_not_ready(run: &Run, reason: &str) {
    assert_eq!(
        ready_of(run),
        Some(("False".to_string(), reason.to_string())),
        "{} in {}: {:?}",
        run.name_any(),
        run.phase(),
        run.status
    );
}

/// Waits for the Event `reason` of type `type_` that runtimed leaves on `run`.
async fn assert_event(rig: &Rig, run: &Run, type_: &str, reason: &str) -> Result<Event> {
    let event = kruntimes_testkit::events::wait_for(
        &rig.admin,
        "default",
        &run.name_any(),
        reason,
        common::DEADLINE,
    )
    .await?;
    assert_eq!(event.type_.as_deref(), Some(type_), "{event:?}");
    assert_eq!(
        event.reporting_component.as_deref(),
        Some("kruntimes.io/runtimed"),
        "{event:?}"
    );
    assert_eq!(
        event.reporting_instance,
        Some(rig.pod.name_any()),
        "{event:?}"
    );
    assert_eq!(event.involved_object.uid, run.uid(), "{event:?}");
    assert_eq!(
        event.involved_object.kind.as_deref(),
        Some("Run"),
        "{event:?}"
    );
    Ok(event)
}

/// Assigns `spec` and waits until it is Ready (`Ready=True`).
async fn ready(rig: &Rig, spec: RunSpec) -> Result<Run> {
    let run = rig.assign(spec).await?;
    let run = rig
        .until(&run.name_any(), "is Ready", |r| {
            r.phase() == Phase::Ready || r.phase().is_terminal()
        })
        .await?;
    assert_eq!(run.phase(), Phase::Ready, "{:?}", run.status);
    assert_eq!(ready_of(&run).map(|r| r.0).as_deref(), Some("True"));
    Ok(run)
}

async fn terminate(rig: &Rig, run: &Run, mode: &str) -> Result<()> {
    let patch = json!({"spec": {"termination": {"mode": mode}}});
    rig.runs()
        .patch(
            &run.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    Ok(())
}

async fn ended(rig: &Rig, run: &Run) -> Result<Run> {
    rig.until(&run.name_any(), "ends", |r| r.phase().is_terminal())
        .await
}

#[tokio::test]
async fn a_cancelled_function_is_not_ready() -> Result<()> {
    let rig = rig("ready-w1").await?;
    let run = ready(&rig, function()).await?;
    terminate(&rig, &run, "Immediate").await?;
    let done = ended(&rig, &run).await?;
    assert_eq!(done.phase(), Phase::Cancelled);
    assert_not_ready(&done, "Cancelled");
    let event = assert_event(&rig, &run, "Normal", "Cancelled").await?;
    assert_eq!(event.action.as_deref(), Some("Cancel"));
    Ok(())
}

#[tokio::test]
async fn a_function_past_its_timeout_is_not_ready() -> Result<()> {
    let rig = rig("ready-w2").await?;
    let mut spec = function();
    spec.timeout = Some("2s".into());
    let run = ready(&rig, spec).await?;
    let done = ended(&rig, &run).await?;
    assert_eq!(done.phase(), Phase::Timeout);
    assert_not_ready(&done, "Timeout");
    let event = assert_event(&rig, &run, "Warning", "Timeout").await?;
    assert!(
        event
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("spec.timeout of 2s"),
        "{event:?}"
    );
    Ok(())
}

#[tokio::test]
async fn an_idle_function_is_not_ready() -> Result<()> {
    let rig = rig("ready-w3").await?;
    let mut spec = function();
    if let Some(f) = spec.mode.function.as_mut() {
        f.idle_timeout_seconds = Some(1);
    }
    let run = ready(&rig, spec).await?;
    let done = ended(&rig, &run).await?;
    assert_eq!(done.phase(), Phase::Timeout);
    assert_not_ready(&done, "IdleTimeout");
    assert_event(&rig, &run, "Warning", "IdleTimeout").await?;
    Ok(())
}

/// The runtime server drops the registration behind runtimed's back (as after its restart).
async fn lose_registration(rig: &Rig, run: &Run) -> Result<()> {
    let uid = run.uid().context("uid")?;
    rig.context
        .functions
        .clone()
        .unregister_function(rs::UnregisterFunctionRequest {
            registration_id: String::new(),
            id: Some(rs::ExecutionId {
                run_uid: uid,
                attempt: 1,
            }),
        })
        .await?;
    rig.context.requeue_run(&run.name_any());
    Ok(())
}

/// Regression (issue 15.3): a function retried after its registration was lost said
/// `Ready=False/Retrying`, not why; failed, it must say so too.
#[tokio::test]
async fn a_function_whose_registration_is_lost_is_not_ready_retried_or_failed() -> Result<()> {
    let rig = rig("ready-w4").await?;
    let mut spec = function();
    spec.retry_policy = Some(RetryPolicy {
        max_attempts: 2,
        backoff_seconds: None,
    });
    let run = ready(&rig, spec).await?;
    lose_registration(&rig, &run).await?;
    let retried = rig
        .until(&run.name_any(), "is retried", |r| {
            r.phase() == Phase::Pending
        })
        .await?;
    assert_eq!(retried.status.as_ref().and_then(|s| s.attempt), Some(2));
    assert_not_ready(&retried, "RegistrationLost");
    let lost = assert_event(&rig, &run, "Warning", "RegistrationLost").await?;
    assert!(
        lost.message
            .as_deref()
            .unwrap_or_default()
            .starts_with("attempt 1 ended"),
        "{lost:?}"
    );
    let retrying = assert_event(&rig, &run, "Normal", "Retrying").await?;
    assert_eq!(
        retrying.message.as_deref(),
        Some("attempt 2 waits for a worker")
    );

    let run = ready(&rig, function()).await?;
    lose_registration(&rig, &run).await?;
    let done = ended(&rig, &run).await?;
    assert_eq!(done.phase(), Phase::Failed);
    assert_not_ready(&done, "RegistrationLost");
    assert_event(&rig, &run, "Warning", "RegistrationLost").await?;
    Ok(())
}

#[tokio::test]
async fn a_cancelled_session_is_not_ready() -> Result<()> {
    let rig = rig("ready-w5").await?;
    let run = ready(&rig, session()).await?;
    terminate(&rig, &run, "Immediate").await?;
    let done = ended(&rig, &run).await?;
    assert_eq!(done.phase(), Phase::Cancelled);
    assert_not_ready(&done, "Cancelled");
    assert_event(&rig, &run, "Normal", "Cancelled").await?;
    Ok(())
}

#[tokio::test]
async fn a_session_whose_lease_expired_is_not_ready() -> Result<()> {
    let rig = rig("ready-w6").await?;
    let mut spec = session();
    spec.mode.session = Some(SessionMode {
        lease_timeout_seconds: Some(1),
        ..SessionMode::default()
    });
    let run = ready(&rig, spec).await?;
    let done = ended(&rig, &run).await?;
    assert_eq!(done.phase(), Phase::Timeout);
    assert_not_ready(&done, "LeaseExpired");
    let event = assert_event(&rig, &run, "Warning", "LeaseExpired").await?;
    assert_eq!(event.action.as_deref(), Some("Stop"));
    Ok(())
}

#[tokio::test]
async fn a_drained_session_is_not_ready_while_finalizing_or_after() -> Result<()> {
    let rig = rig("ready-w7").await?;
    // The drain reads the Runtime's ArtifactStore: a Runtime without one exports nothing.
    Api::<Runtime>::namespaced(rig.admin.clone(), "default")
        .create(
            &PostParams::default(),
            &Runtime::new(
                "bash",
                RuntimeSpec {
                    replicas: 0,
                    scaling: None,
                    runs: None,
                    template: Default::default(),
                    port: None,
                    artifact_store: None,
                },
            ),
        )
        .await?;
    let run = ready(&rig, session()).await?;
    terminate(&rig, &run, "Drain").await?;
    let finalizing = rig
        .until(&run.name_any(), "finalizes", |r| {
            r.phase() == Phase::Finalizing || r.phase().is_terminal()
        })
        .await?;
    if finalizing.phase() == Phase::Finalizing {
        assert_not_ready(&finalizing, "Draining");
    }
    let done = ended(&rig, &run).await?;
    assert_eq!(done.phase(), Phase::Succeeded, "{:?}", done.status);
    assert_not_ready(&done, "Drained");
    Ok(())
}

#[tokio::test]
async fn a_session_the_runtime_server_lost_is_not_ready() -> Result<()> {
    let rig = rig("ready-w8").await?;
    let run = ready(&rig, session()).await?;
    let uid = run.uid().context("uid")?;
    // Behind runtimed's back, as a restarted runtime server would have lost it.
    rig.context
        .session_client
        .clone()
        .close_session(rs::CloseSessionRequest {
            id: Some(rs::ExecutionId {
                run_uid: uid,
                attempt: 1,
            }),
            grace_period: None,
            purge: true,
            park_digest: String::new(),
        })
        .await?;
    rig.context.requeue_run(&run.name_any());
    let done = ended(&rig, &run).await?;
    assert_eq!(done.phase(), Phase::Failed);
    assert_not_ready(&done, "SessionLost");
    assert_event(&rig, &run, "Warning", "SessionLost").await?;
    Ok(())
}
