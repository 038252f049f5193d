//! The Run lifecycle controller's writers against the real embedded API server: every
//! transition it makes that takes a function or session Run out of Ready sets
//! `Ready=False` with a specific reason.
//!
//! Worker Pods are API objects created by the admin; the admin also plays runtimed where a
//! Run must be Ready first. Every wait is a watch with a deadline.

mod common;

use std::sync::Arc;

use anyhow::{Context, Result};
use common::{RunWatch, WAIT, start};
use kruntimes_api::{Phase, Run};
use kube::ResourceExt;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;

/// A function (`mode = "function"`) or session Run of `runtime`, `attempts` in all.
fn run_of(name: &str, mode: &str, attempts: i32) -> Result<Run> {
    let spec_mode = match mode {
        "function" => json!({"function": {"handler": "main.handler"}}),
        _ => json!({"session": {}}),
    };
    serde_json::from_value(json!({
        "apiVersion": "kruntimes.io/v1alpha1",
        "kind": "Run",
        "metadata": {"name": name},
        "spec": {
            "runtime": "rt",
            "mode": spec_mode,
            "retryPolicy": {"maxAttempts": attempts},
        }
    }))
    .context("build a Run")
}

/// The Run's `Ready` condition as (status, reason).
fn ready(run: &Run) -> Option<(String, String)> {
    let condition = run
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")?;
    Some((
        condition.status.clone(),
        condition.reason.clone().unwrap_or_default(),
    ))
}

fn find<'a>(runs: &'a [Arc<Run>], name: &str) -> Option<&'a Run> {
    runs.iter().find(|r| r.name_any() == name).map(|r| &**r)
}

/// Regression (issue 15.3): a function Run whose worker was lost went back to Pending, or
/// ended Failed/WorkerLost, still carrying `Ready=True/FunctionRegistered`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_worker_leaves_no_run_ready() -> Result<()> {
    let env = start().await?;
    env.runtime("rt", 4).await?;
    let worker = env.worker("w1", "rt", true).await?;
    let (_identity, manager) = env.spawn_manager("ready-lost");
    let runs = [
        ("fn-retried", "function", 2),
        ("fn-failed", "function", 1),
        ("session-failed", "session", 1),
    ];
    for (name, mode, attempts) in runs {
        env.runs()
            .create(&PostParams::default(), &run_of(name, mode, attempts)?)
            .await
            .with_context(|| format!("create Run {name}"))?;
    }
    let mut watch = RunWatch::new(env.runs());
    watch
        .until("every Run Scheduled on w1", WAIT, |all| {
            Ok(runs
                .iter()
                .all(|(name, _, _)| find(all, name).is_some_and(|r| r.phase() == Phase::Scheduled))
                .then_some(()))
        })
        .await?;
    // runtimed's part, played here: each Run becomes Ready on w1.
    let uid = worker.uid().context("the Pod has a UID")?;
    for (name, _, _) in runs {
        let status = json!({"status": {
            "phase": "Ready",
            "assignedPod": "w1",
            "assignedPodUID": uid,
            "conditions": [{"type": "Ready", "status": "True", "reason": "FunctionRegistered",
                            "lastTransitionTime": k8s_openapi::jiff::Timestamp::now().to_string()}],
        }});
        env.runs()
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .with_context(|| format!("make Run {name} Ready"))?;
    }
    // The worker goes: deleting and out of rotation.
    env.delete_pod("w1").await?;
    env.set_ready("w1", false).await?;
    let not_ready = Some(("False".to_string(), "WorkerLost".to_string()));
    watch
        .until(
            "every Run out of Ready with Ready=False/WorkerLost",
            WAIT,
            |all| {
                let retried = find(all, "fn-retried").is_some_and(|r| {
                    r.phase() == Phase::Pending
                        && r.status.as_ref().and_then(|s| s.attempt) == Some(2)
                        && ready(r) == not_ready
                });
                let failed = ["fn-failed", "session-failed"].iter().all(|name| {
                    find(all, name).is_some_and(|r| {
                        r.phase() == Phase::Failed
                            && r.status.as_ref().and_then(|s| s.reason.as_deref())
                                == Some("WorkerLost")
                            && ready(r) == not_ready
                    })
                });
                Ok((retried && failed).then_some(()))
            },
        )
        .await?;
    manager.abort();
    Ok(())
}

/// Regression (issue 15.3): a function or session Run cancelled before it was placed ended
/// Cancelled without `Ready=False`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_cancelled_before_assignment_is_not_ready() -> Result<()> {
    let env = start().await?;
    env.runtime("rt", 1).await?;
    let (_identity, manager) = env.spawn_manager("ready-cancel");
    for (name, mode) in [("fn", "function"), ("session", "session")] {
        env.runs()
            .create(&PostParams::default(), &run_of(name, mode, 1)?)
            .await
            .with_context(|| format!("create Run {name}"))?;
        env.terminate(name).await?;
    }
    let mut watch = RunWatch::new(env.runs());
    let cancelled = Some(("False".to_string(), "Cancelled".to_string()));
    watch
        .until(
            "both Runs Cancelled with Ready=False/Cancelled",
            WAIT,
            |all| {
                Ok(["fn", "session"]
                    .iter()
                    .all(|name| {
                        find(all, name)
                            .is_some_and(|r| r.phase() == Phase::Cancelled && ready(r) == cancelled)
                    })
                    .then_some(()))
            },
        )
        .await?;
    manager.abort();
    Ok(())
}
