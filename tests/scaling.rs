//! Capacity that grows and shares (issue 16 items 1 and 2), against the real `kruntimes up`:
//! sessions share workers, exclusive sessions do not, a scaling Runtime adds workers with
//! demand (never beyond `maxReplicas`) and drains idle ones after its cool-down without
//! losing a Run, and `kubectl scale` works through the scale subresource.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::{DEADLINE, create, wait_ready, wait_runtime, wait_terminal};
use k8s_openapi::api::core::v1::Pod;
use kruntimes_api::run::{RunMode, RunResources, RunSource, SessionMode};
use kruntimes_api::runtime::RuntimeScaling;
use kruntimes_api::{Phase, Run, RunSpec, Runtime, RuntimeSpec};
use kruntimes_testkit::{Options, Server, within};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::wait::await_condition;
use kube::{Client, ResourceExt};

/// How long a scaling test may take for all its sandboxes to become Ready on this 2-core
/// machine.
const BURST_DEADLINE: Duration = Duration::from_secs(180);

fn session(runtime: &str, exclusive: bool) -> RunSpec {
    let mut spec = RunSpec::task(runtime, "unused");
    spec.mode = RunMode {
        session: Some(SessionMode::default()),
        ..RunMode::default()
    };
    if exclusive {
        spec.resources = Some(RunResources {
            exclusive: Some(true),
            ..RunResources::default()
        });
    }
    spec
}

fn task(runtime: &str, line: &str) -> RunSpec {
    let mut spec = RunSpec::task(runtime, "main.sh");
    spec.source = Some(RunSource {
        inline: Some(format!("{line}\n")),
        snapshot: None,
    });
    spec
}

/// The worker Pods of `runtime` that exist now (deleting ones included).
async fn pods_of(client: &Client, runtime: &str) -> Result<Vec<Pod>> {
    Ok(Api::<Pod>::namespaced(client.clone(), "default")
        .list(&ListParams::default().labels(&format!("kruntimes.io/runtime={runtime}")))
        .await?
        .items)
}

fn assigned_pod(run: &Run) -> String {
    run.status
        .as_ref()
        .and_then(|s| s.assigned_pod.clone())
        .unwrap_or_default()
}

async fn scaling_runtime(
    client: &Client,
    name: &str,
    runs: i32,
    scaling: RuntimeScaling,
) -> Result<()> {
    let runtime = Runtime::new(
        name,
        RuntimeSpec {
            replicas: scaling.min_replicas,
            scaling: Some(scaling),
            runs: Some(runs),
            template: kruntimes_api::runtime::template_with_args(vec![
                "--adapter".into(),
                "bash".into(),
            ]),
            port: None,
            artifact_store: None,
        },
    );
    Api::<Runtime>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &runtime)
        .await?;
    wait_runtime(client, name, "has its first worker", |rt| {
        rt.status.as_ref().and_then(|s| s.ready_replicas) >= Some(1)
    })
    .await
}

async fn delete_run(client: &Client, name: &str) -> Result<()> {
    let runs = Api::<Run>::namespaced(client.clone(), "default");
    runs.delete(name, &DeleteParams::default()).await?;
    within(DEADLINE, &format!("Run {name} is gone"), async {
        await_condition(runs.clone(), name, |r: Option<&Run>| r.is_none()).await?;
        Ok(())
    })
    .await
}

/// With the defaults of `kruntimes up` (bash: min 1, max 8 workers of 8 slots, 2 warm),
/// 20 sandboxes created at once all become Ready, and tasks run beside them.
#[tokio::test]
async fn with_the_defaults_twenty_sandboxes_at_once_become_ready_and_tasks_run_beside_them()
-> Result<()> {
    let (_server, client) = Server::start_async(Options::full()).await?;
    let names: Vec<String> = (0..20).map(|i| format!("sandbox-{i:02}")).collect();
    let creates = names
        .iter()
        .map(|name| create(&client, name, session("bash", false)));
    futures::future::try_join_all(creates).await?;
    create(&client, "beside", task("bash", "echo beside")).await?;
    let runs = Api::<Run>::namespaced(client.clone(), "default");
    within(BURST_DEADLINE, "20 sandboxes Ready", async {
        for name in &names {
            await_condition(runs.clone(), name, |r: Option<&Run>| {
                r.is_some_and(|r| r.phase() == Phase::Ready)
            })
            .await?;
        }
        Ok(())
    })
    .await?;
    let done = wait_terminal(&client, "beside").await?;
    ensure!(done.phase() == Phase::Succeeded, "{:?}", done.status);
    // Sessions share workers: 20 sessions and a task took at least 3 workers of 8 slots,
    // never more than the maximum of 8.
    let runtime = Api::<Runtime>::namespaced(client.clone(), "default")
        .get("bash")
        .await?;
    ensure!(
        (3..=8).contains(&runtime.spec.replicas),
        "bash scaled to {} workers",
        runtime.spec.replicas
    );
    let mut per_pod = std::collections::BTreeMap::<String, usize>::new();
    for name in &names {
        *per_pod
            .entry(assigned_pod(&runs.get(name).await?))
            .or_default() += 1;
    }
    ensure!(
        per_pod.values().all(|n| *n <= 8) && per_pod.values().any(|n| *n > 1),
        "sessions per worker: {per_pod:?}"
    );
    Ok(())
}

/// Demand drives a scaling Runtime up, bounded by `maxReplicas`, and down again: idle
/// workers are drained and removed after the cool-down, the busy one stays, and no Run is
/// lost. Exclusive sessions get a worker each, never beside another Run.
#[tokio::test]
async fn demand_scales_a_runtime_up_to_its_maximum_and_idle_workers_go_after_the_cool_down()
-> Result<()> {
    let (_server, client) = Server::start_async(Options::full()).await?;
    scaling_runtime(
        &client,
        "elastic",
        2,
        RuntimeScaling {
            min_replicas: 1,
            max_replicas: 3,
            warm_runs: Some(0),
            scale_down_delay_seconds: Some(2),
        },
    )
    .await?;
    // Three exclusive sessions: one per worker, so three workers.
    for i in 0..3 {
        create(&client, &format!("alone-{i}"), session("elastic", true)).await?;
    }
    let mut alone_pods = BTreeSet::new();
    for i in 0..3 {
        let run = wait_ready(&client, &format!("alone-{i}")).await?;
        alone_pods.insert(assigned_pod(&run));
    }
    ensure!(
        alone_pods.len() == 3,
        "exclusive sessions shared: {alone_pods:?}"
    );
    // At the maximum: more demand adds nothing, and nothing joins an exclusive session.
    create(&client, "queued", session("elastic", false)).await?;
    let runtimes = Api::<Runtime>::namespaced(client.clone(), "default");
    let runs = Api::<Run>::namespaced(client.clone(), "default");
    wait_runtime(&client, "elastic", "is at its maximum", |rt| {
        rt.spec.replicas == 3
    })
    .await?;
    ensure!(runs.get("queued").await?.phase() == Phase::Pending);
    ensure!(pods_of(&client, "elastic").await?.len() <= 3);
    ensure!(runtimes.get("elastic").await?.spec.replicas == 3);
    // One exclusive session goes: the queued session takes that worker.
    delete_run(&client, "alone-0").await?;
    let queued = wait_ready(&client, "queued").await?;
    for other in ["alone-1", "alone-2"] {
        ensure!(
            assigned_pod(&queued) != assigned_pod(&runs.get(other).await?),
            "the queued session joined the exclusive session {other}"
        );
    }
    // A task runs beside the shared session (2 slots).
    create(&client, "beside", task("elastic", "echo beside")).await?;
    let beside = wait_terminal(&client, "beside").await?;
    ensure!(beside.phase() == Phase::Succeeded, "{:?}", beside.status);
    // Demand falls: the idle workers go after the cool-down, the busy one stays.
    delete_run(&client, "alone-1").await?;
    delete_run(&client, "alone-2").await?;
    let keeper = assigned_pod(&queued);
    wait_runtime(&client, "elastic", "scales down to its minimum", |rt| {
        rt.spec.replicas == 1
    })
    .await?;
    let pods_api = Api::<Pod>::namespaced(client.clone(), "default");
    for pod in alone_pods.iter().filter(|p| **p != keeper) {
        within(
            DEADLINE,
            &format!("the idle worker {pod} is removed"),
            async {
                await_condition(pods_api.clone(), pod, |p: Option<&Pod>| p.is_none()).await?;
                Ok(())
            },
        )
        .await?;
    }
    let left: Vec<String> = pods_of(&client, "elastic")
        .await?
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    ensure!(
        left == vec![keeper.clone()],
        "workers left: {left:?}, busy: {keeper}"
    );
    // No Run was lost: the session on the kept worker is still Ready and serves.
    let queued = runs.get("queued").await?;
    ensure!(queued.phase() == Phase::Ready, "{:?}", queued.status);
    create(&client, "after", task("elastic", "echo after")).await?;
    let after = wait_terminal(&client, "after").await?;
    ensure!(after.phase() == Phase::Succeeded, "{:?}", after.status);
    Ok(())
}

/// `kubectl scale runtime NAME --replicas N` works: the scale subresource of Runtimes.
#[tokio::test]
async fn kubectl_scale_sets_a_runtimes_replicas() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    common::create_runtime(&client, "fixed", "bash", 1, 1).await?;
    let out = server.kubectl_ok(&["scale", "runtime", "fixed", "--replicas", "2"])?;
    ensure!(out.contains("scaled"), "{out}");
    wait_runtime(&client, "fixed", "has two ready workers", |rt| {
        rt.spec.replicas == 2 && rt.status.as_ref().and_then(|s| s.ready_replicas) == Some(2)
    })
    .await?;
    let scale = server.kubectl_ok(&[
        "get",
        "--raw",
        "/apis/kruntimes.io/v1alpha1/namespaces/default/runtimes/fixed/scale",
    ])?;
    let scale: serde_json::Value = serde_json::from_str(&scale).context("a Scale")?;
    ensure!(scale["kind"] == "Scale", "{scale}");
    ensure!(scale["spec"]["replicas"] == 2, "{scale}");
    ensure!(scale["status"]["replicas"] == 2, "{scale}");
    ensure!(
        scale["status"]["selector"] == "kruntimes.io/runtime=fixed",
        "{scale}"
    );
    // Bad input changes nothing.
    for bad in ["-1", "5000"] {
        let refused = server
            .kubectl()
            .args(["scale", "runtime", "fixed", "--replicas", bad])
            .output()?;
        ensure!(!refused.status.success(), "--replicas {bad} was accepted");
    }
    ensure!(
        Api::<Runtime>::namespaced(client.clone(), "default")
            .get("fixed")
            .await?
            .spec
            .replicas
            == 2
    );
    server.kubectl_ok(&["scale", "runtime", "fixed", "--replicas", "1"])?;
    wait_runtime(&client, "fixed", "is back to one worker", |rt| {
        rt.status.as_ref().and_then(|s| s.ready_replicas) == Some(1)
    })
    .await?;
    Ok(())
}
