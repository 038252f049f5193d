//! The Run lifecycle controller's writers against the real embedded API server: every
//! transition it makes that takes a function or session Run out of Ready sets
//! `Ready=False` with a specific reason. And the Events the controller-manager writes on
//! Runs (worker lost, retry, cancellation, a Run that cannot be placed), read through
//! kube-rs (events.k8s.io/v1) and through kubectl (core v1).
//!
//! Worker Pods are API objects created by the admin; the admin also plays runtimed where a
//! Run must be Ready first. Every wait is a watch with a deadline.

mod common;

use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use common::{Env, RunWatch, WAIT, start};
use futures::StreamExt;
use k8s_openapi::api::events::v1::Event;
use kruntimes_api::run::{RunRequests, RunResources};
use kruntimes_api::{Phase, Run};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;

/// Waits (through a watch) for an Event with `reason` on the Run `run`, and returns it.
async fn event_on(client: &Client, run: &str, reason: &str) -> Result<Event> {
    let events = Api::<Event>::namespaced(client.clone(), common::NS);
    let selector = format!("regarding.name={run}");
    let mut stream = watcher(events, watcher::Config::default().fields(&selector))
        .default_backoff()
        .applied_objects()
        .boxed();
    common::within(&format!("Event {reason} on Run {run}"), WAIT, async {
        loop {
            let event = stream.next().await.context("the Event watch ended")??;
            if event.reason.as_deref() == Some(reason)
                && event.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(run)
            {
                return Ok(event);
            }
        }
    })
    .await
}

/// The reasons of the Events on `run` as `kubectl get events --field-selector
/// involvedObject.name=RUN` lists them.
fn kubectl_reasons(env: &Env, run: &str) -> Result<Vec<String>> {
    let selector = format!("involvedObject.name={run}");
    let out = env.server.kubectl_ok(&[
        "get",
        "events",
        "-n",
        common::NS,
        "--field-selector",
        &selector,
        "-o",
        "json",
    ])?;
    let list: serde_json::Value = serde_json::from_str(&out)?;
    Ok(list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["reason"].as_str().map(str::to_string))
        .collect())
}

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
    // Each says so in an Event (issue 15.6): the lost worker, and the retry.
    for (name, reasons) in [
        ("fn-retried", &["WorkerLost", "Retrying"][..]),
        ("fn-failed", &["WorkerLost"][..]),
        ("session-failed", &["WorkerLost"][..]),
    ] {
        for reason in reasons {
            let event = event_on(&env.admin, name, reason).await?;
            ensure!(
                event.reporting_controller.as_deref()
                    == Some(kruntimes_controller::events::REPORTING_CONTROLLER),
                "{event:?}"
            );
        }
    }
    let lost = event_on(&env.admin, "fn-failed", "WorkerLost").await?;
    ensure!(
        lost.note.as_deref().is_some_and(|n| n.contains("w1")),
        "the Event names the worker: {lost:?}"
    );
    let listed = kubectl_reasons(&env, "fn-retried")?;
    ensure!(
        listed.iter().any(|r| r == "WorkerLost") && listed.iter().any(|r| r == "Retrying"),
        "kubectl get events lists {listed:?}"
    );
    let described = env
        .server
        .kubectl_ok(&["describe", "run", "fn-retried", "-n", common::NS])?;
    ensure!(
        described.contains("WorkerLost") && described.contains("Retrying"),
        "kubectl describe run shows the Events: {described}"
    );
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
    for name in ["fn", "session"] {
        event_on(&env.admin, name, "Cancelled").await?;
    }
    manager.abort();
    Ok(())
}

/// The `Scheduled` condition of `run`, as (status, reason, message).
fn scheduled(run: &Run) -> Option<(String, String, String)> {
    let c = run
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Scheduled")?;
    Some((
        c.status.clone(),
        c.reason.clone().unwrap_or_default(),
        c.message.clone().unwrap_or_default(),
    ))
}

/// Waits until the Run `name` shows `Scheduled=False` with `reason`; returns the message.
async fn unscheduled(watch: &mut RunWatch, name: &str, reason: &str) -> Result<String> {
    watch
        .until(&format!("{name} Scheduled=False/{reason}"), WAIT, |all| {
            Ok(find(all, name)
                .and_then(scheduled)
                .filter(|(status, r, _)| status == "False" && r == reason)
                .map(|(_, _, message)| message))
        })
        .await
}

/// Issue 15.6 and 16.3: a Run that cannot be placed says why, in the condition
/// `Scheduled=False` with a reason and in an Event with the same reason, both shown by
/// `kubectl describe run`: its Runtime does not exist (`RuntimeNotFound`, at once), it asks
/// for more slots than a worker has (`ExceedsWorkerCapacity`), its Runtime has no ready
/// worker (`WaitingForWorkers`), or every slot is taken (`NoCapacity`, with the numbers).
/// The condition turns True when the Run is placed, also for a Run whose Runtime is
/// created after it. Before 16.3 there were Events only, and `ExceedsWorker`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_cannot_be_placed_says_why_in_its_condition_and_an_event() -> Result<()> {
    let env = start().await?;
    env.runtime("rt", 1).await?;
    env.runtime("empty", 1).await?;
    env.worker("w1", "rt", true).await?;
    let (_identity, manager) = env.spawn_manager("events-placement");
    let mut watch = RunWatch::new(env.runs());
    let created = std::time::Instant::now();
    env.run("orphan", "missing", |_| {}).await?;
    let message = unscheduled(&mut watch, "orphan", "RuntimeNotFound").await?;
    let took = created.elapsed();
    ensure!(message.contains("missing"), "{message}");
    // "At once": well within the 2 s that a waiting Run waits before it is told.
    ensure!(
        took < std::time::Duration::from_secs(2),
        "RuntimeNotFound took {took:?}"
    );
    env.run("huge", "rt", |spec| {
        spec.resources = Some(RunResources {
            requests: Some(RunRequests { runs: Some(2) }),
            ..RunResources::default()
        })
    })
    .await?;
    env.run("first", "rt", |_| {}).await?;
    env.run("starved", "empty", |_| {}).await?;
    watch
        .until("first Scheduled", WAIT, |all| {
            Ok(find(all, "first")
                .is_some_and(|r| r.phase() == Phase::Scheduled)
                .then_some(()))
        })
        .await?;
    env.run("second", "rt", |_| {}).await?;
    let message = unscheduled(&mut watch, "huge", "ExceedsWorkerCapacity").await?;
    ensure!(
        message.contains("asks for 2 run slots") && message.contains("has 1"),
        "{message}"
    );
    let message = unscheduled(&mut watch, "starved", "WaitingForWorkers").await?;
    ensure!(message.contains("no ready worker"), "{message}");
    let message = unscheduled(&mut watch, "second", "NoCapacity").await?;
    ensure!(
        message.contains("requested 1 run slots; free 0 of 1 on 1 ready workers"),
        "NoCapacity has the numbers: {message}"
    );
    let missing = event_on(&env.admin, "orphan", "RuntimeNotFound").await?;
    ensure!(
        missing
            .note
            .as_deref()
            .is_some_and(|n| n.contains("missing")),
        "{missing:?}"
    );
    event_on(&env.admin, "huge", "ExceedsWorkerCapacity").await?;
    event_on(&env.admin, "starved", "WaitingForWorkers").await?;
    let waiting = event_on(&env.admin, "second", "NoCapacity").await?;
    ensure!(waiting.type_.as_deref() == Some("Warning"), "{waiting:?}");
    for (name, reason) in [
        ("orphan", "RuntimeNotFound"),
        ("huge", "ExceedsWorkerCapacity"),
        ("starved", "WaitingForWorkers"),
        ("second", "NoCapacity"),
    ] {
        let listed = kubectl_reasons(&env, name)?;
        // Once per change of reason, not once per pass (passes run every 2 s at least,
        // and many have run since the first condition was written).
        ensure!(
            listed == vec![reason.to_string()],
            "kubectl get events for {name} lists {listed:?}"
        );
        let described = env
            .server
            .kubectl_ok(&["describe", "run", name, "-n", common::NS])?;
        ensure!(
            described.matches(reason).count() >= 2,
            "kubectl describe run {name} shows the condition and the Event {reason}: {described}"
        );
    }
    // The Run placed at once has no placement Event.
    let first = kubectl_reasons(&env, "first")?;
    ensure!(first.is_empty(), "first: {first:?}");
    // Placed, the condition turns True: a slot frees up, and a Runtime created after its
    // Run picks the Run up.
    env.finish("first", Phase::Succeeded).await?;
    env.runtime("missing", 1).await?;
    env.worker("w-missing", "missing", true).await?;
    watch
        .until("second and orphan placed, Scheduled=True", WAIT, |all| {
            Ok(["second", "orphan"]
                .iter()
                .all(|name| {
                    find(all, name).is_some_and(|r| {
                        r.phase() == Phase::Scheduled
                            && scheduled(r).is_some_and(|(status, _, _)| status == "True")
                    })
                })
                .then_some(()))
        })
        .await?;
    manager.abort();
    Ok(())
}

/// A resume is written only over the version it was decided from: a user who sets
/// `spec.suspend` again after the controller read the Run is never overridden. The
/// interleaving is played step by step (no controller-manager runs): the controller's
/// `resume` is called with a copy read before the user's second patch, and must conflict
/// and write nothing; decided again from a fresh read it writes nothing either (no resume
/// is due); once the user clears `spec.suspend` again the resume goes through, as
/// incarnation 2. Without the `resourceVersion` precondition the first call would write.
#[tokio::test]
async fn a_resume_never_overwrites_a_suspend_that_came_after_its_read() -> Result<()> {
    use kruntimes_controller::lifecycle::{Written, resume};

    let env = start().await?;
    let runs = env.runs();
    runs.create(&PostParams::default(), &run_of("sleeper", "session", 1)?)
        .await?;
    // Ready in incarnation 1, then Suspended to a Snapshot, as its worker would write it.
    runs.patch_status(
        "sleeper",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Ready", "incarnation": 1}})),
    )
    .await?;
    runs.patch(
        "sleeper",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"suspend": true}})),
    )
    .await?;
    runs.patch_status(
        "sleeper",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {
            "phase": "Suspended",
            "snapshot": {"name": "sleeper-1", "lastSequence": 3}
        }})),
    )
    .await?;
    let resumed_spec = json!({"spec": {"suspend": false}});
    runs.patch(
        "sleeper",
        &PatchParams::default(),
        &Patch::Merge(&resumed_spec),
    )
    .await?;
    // The controller reads the Run: a resume is due.
    let controller_runs = Api::<Run>::namespaced(env.controller.clone(), common::NS);
    let stale = controller_runs.get("sleeper").await?;
    // The user suspends again before the controller writes.
    runs.patch(
        "sleeper",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"suspend": true}})),
    )
    .await?;
    assert_eq!(resume(&controller_runs, &stale).await?, Written::Conflict);
    let now = runs.get("sleeper").await?;
    assert_eq!(now.phase(), Phase::Suspended, "{:?}", now.status);
    assert_eq!(now.incarnation(), 1);
    // Decided again from the current Run: nothing is due, nothing is written.
    let fresh = controller_runs.get("sleeper").await?;
    assert_eq!(resume(&controller_runs, &fresh).await?, Written::Conflict);
    assert_eq!(
        runs.get("sleeper").await?.metadata.resource_version,
        fresh.metadata.resource_version
    );
    // Cleared again: the resume goes through.
    runs.patch(
        "sleeper",
        &PatchParams::default(),
        &Patch::Merge(&resumed_spec),
    )
    .await?;
    let current = controller_runs.get("sleeper").await?;
    assert_eq!(resume(&controller_runs, &current).await?, Written::Yes);
    let resumed = runs.get("sleeper").await?;
    assert_eq!(resumed.phase(), Phase::Pending);
    assert_eq!(resumed.incarnation(), 2);
    let status = resumed.status.unwrap_or_default();
    assert_eq!(
        status.snapshot.map(|s| (s.name, s.last_sequence)),
        Some(("sleeper-1".to_string(), Some(3)))
    );
    assert_eq!(status.assigned_pod, None);
    Ok(())
}

/// A Suspended session asked to terminate ends Cancelled, as a Run with no worker does
/// (nothing runs; nothing is drained), `Ready=False/Cancelled`, and the message says it
/// was suspended.
#[tokio::test]
async fn a_suspended_session_asked_to_end_is_cancelled() -> Result<()> {
    let env = start().await?;
    env.runtime("rt", 1).await?;
    let runs = env.runs();
    runs.create(&PostParams::default(), &run_of("ending", "session", 1)?)
        .await?;
    runs.patch_status(
        "ending",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Ready", "incarnation": 1}})),
    )
    .await?;
    runs.patch(
        "ending",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"suspend": true}})),
    )
    .await?;
    runs.patch_status(
        "ending",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {
            "phase": "Suspended",
            "snapshot": {"name": "ending-1"}
        }})),
    )
    .await?;
    env.terminate("ending").await?;
    let (_identity, manager) = env.spawn_manager("suspended-cancel");
    let mut watch = RunWatch::new(env.runs());
    let ended = watch
        .until("the suspended session is Cancelled", WAIT, |all| {
            Ok(find(all, "ending")
                .filter(|r| r.phase() == Phase::Cancelled)
                .cloned())
        })
        .await?;
    assert_eq!(ready(&ended), Some(("False".into(), "Cancelled".into())));
    let message = ended.status.and_then(|s| s.message).unwrap_or_default();
    assert!(message.contains("suspended"), "{message}");
    manager.abort();
    Ok(())
}

/// Regression: a worker lost while it auto-suspended a session (`spec.suspend: true` with
/// the owner's `kruntimes.io/auto-suspended` marker of incarnation 1, the capture not yet
/// done) under `onWorkerLoss: ResumeFromSnapshot`. The controller resumes it from its last
/// Snapshot as incarnation 2, which goes straight back to Suspended (the suspend still
/// stands). The marker must follow the incarnation: left naming incarnation 1, the suspend
/// looked like the user's, and no call could ever wake the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_lost_during_an_auto_suspend_leaves_the_session_wakeable() -> Result<()> {
    use kruntimes_api::Snapshot;
    use kruntimes_api::lifecycle::{AUTO_SUSPENDED_ANNOTATION, auto_suspended};

    let env = start().await?;
    env.runtime("rt", 2).await?;
    let worker = env.worker("w1", "rt", true).await?;
    let (_identity, manager) = env.spawn_manager("lost-auto-suspend");
    let mut run = run_of("napper", "session", 1)?;
    run.spec.mode.session = Some(serde_json::from_value(
        json!({"autoSuspendAfter": "1s", "onWorkerLoss": "ResumeFromSnapshot"}),
    )?);
    let created = env.runs().create(&PostParams::default(), &run).await?;
    let run_uid = created.uid().context("a created Run has a UID")?;
    let mut watch = RunWatch::new(env.runs());
    watch
        .until("napper Scheduled on w1", WAIT, |all| {
            Ok(find(all, "napper")
                .is_some_and(|r| r.phase() == Phase::Scheduled)
                .then_some(()))
        })
        .await?;
    // A Ready Snapshot of an earlier suspend, as runtimed leaves it (pinned to the Run: one
    // whose Run is gone is deleted).
    let snapshots = Api::<Snapshot>::namespaced(env.admin.clone(), common::NS);
    let snapshot: Snapshot = serde_json::from_value(json!({
        "apiVersion": "kruntimes.io/v1alpha1",
        "kind": "Snapshot",
        "metadata": {"name": "napper-s1"},
        "spec": {"source": {"run": {"name": "napper", "uid": run_uid}}, "reason": "Suspend"},
    }))?;
    snapshots.create(&PostParams::default(), &snapshot).await?;
    snapshots
        .patch_status(
            "napper-s1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "phase": "Ready",
                "digest": format!("sha256:{}", "0".repeat(64)),
                "location": {"uri": "file:///nowhere/napper-s1.tar.zst"},
            }})),
        )
        .await?;
    // runtimed's part, played here: Ready on w1 with that Snapshot, then its own
    // auto-suspend begins (spec.suspend and the marker of incarnation 1).
    let uid = worker.uid().context("the Pod has a UID")?;
    env.runs()
        .patch_status(
            "napper",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "phase": "Ready",
                "incarnation": 1,
                "assignedPod": "w1",
                "assignedPodUID": uid,
                "snapshot": {"name": "napper-s1", "lastSequence": 2},
            }})),
        )
        .await?;
    env.runs()
        .patch(
            "napper",
            &PatchParams::default(),
            &Patch::Merge(json!({
                "metadata": {"annotations": {AUTO_SUSPENDED_ANNOTATION: "1"}},
                "spec": {"suspend": true},
            })),
        )
        .await?;
    // The worker goes before the capture ends.
    env.delete_pod("w1").await?;
    env.set_ready("w1", false).await?;
    let suspended = watch
        .until("napper Suspended as incarnation 2", WAIT, |all| {
            Ok(find(all, "napper")
                .filter(|r| r.phase() == Phase::Suspended && r.incarnation() == 2)
                .cloned())
        })
        .await?;
    ensure!(
        auto_suspended(&suspended),
        "the suspend is still the owner's, so a call wakes it: annotations {:?}",
        suspended.metadata.annotations
    );
    ensure!(
        suspended
            .status
            .as_ref()
            .and_then(|s| s.snapshot.as_ref())
            .map(|s| s.name.as_str())
            == Some("napper-s1"),
        "{:?}",
        suspended.status
    );
    manager.abort();
    Ok(())
}
