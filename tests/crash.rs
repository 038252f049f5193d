//! Crash consistency of the embedded API server: every create the server acknowledged
//! survives a SIGKILL in the middle of a burst, with the resourceVersion it was acknowledged
//! with, and the resourceVersion sequence keeps increasing after the restart. And of the
//! whole system: after a SIGKILL and a restart, no new Run goes to a worker of the killed
//! process.
//!
//! The server is killed after a fixed number of acknowledged creates, counted as they
//! arrive, never after a sleep.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kruntimes_api::run::RunSource;
use kruntimes_api::{Phase, Run, RunSpec};
use kruntimes_testkit::{Options, Server, within};
use kube::api::{ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use tokio::sync::mpsc;

/// Concurrent creators.
const WRITERS: usize = 16;
/// Acknowledged creates after which the server is killed.
const KILL_AFTER: usize = 1000;
/// How long the burst may take to reach [`KILL_AFTER`].
const BURST_DEADLINE: Duration = Duration::from_secs(120);
/// How long the writers may take to notice the server is gone.
const DRAIN_DEADLINE: Duration = Duration::from_secs(60);

const NAMESPACE: &str = "default";

/// What a writer reports.
enum Event {
    /// The server answered the create with this object.
    Acked {
        name: String,
        uid: String,
        resource_version: String,
    },
    /// A create failed.
    Failed { name: String, error: String },
}

/// An acknowledged create, as the server answered it.
#[derive(Debug)]
struct Acked {
    uid: String,
    resource_version: String,
}

fn task_run(name: &str) -> Result<Run> {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "kruntimes.io/v1alpha1",
        "kind": "Run",
        "metadata": {"name": name, "labels": {"test": "crash"}},
        "spec": {
            "runtime": "rt",
            "mode": {"task": {"entrypoint": "main.py", "args": [name]}}
        }
    }))
    .context("build a Run")
}

/// Creates Runs named `crash-<writer>-<n>` as fast as it can, until a create fails (after
/// the kill, every one does) or nobody listens any more.
async fn writer(api: Api<Run>, id: usize, events: mpsc::UnboundedSender<Event>) {
    for n in 0.. {
        let name = format!("crash-{id:02}-{n:06}");
        let event = match task_run(&name) {
            Err(error) => Event::Failed {
                name,
                error: format!("{error:#}"),
            },
            Ok(run) => match api.create(&PostParams::default(), &run).await {
                Ok(created) => Event::Acked {
                    name,
                    uid: created.metadata.uid.unwrap_or_default(),
                    resource_version: created.metadata.resource_version.unwrap_or_default(),
                },
                Err(error) => Event::Failed {
                    name,
                    error: error.to_string(),
                },
            },
        };
        let failed = matches!(event, Event::Failed { .. });
        if events.send(event).is_err() || failed {
            return;
        }
    }
}

/// Lists every Run, page by page.
async fn list_all(api: &Api<Run>) -> Result<BTreeMap<String, Run>> {
    let mut all = BTreeMap::new();
    let mut params = ListParams::default().limit(500);
    loop {
        let page = api.list(&params).await.context("list runs")?;
        let next = page.metadata.continue_.clone().filter(|c| !c.is_empty());
        for run in page.items {
            let name = run
                .metadata
                .name
                .clone()
                .context("a listed Run has no name")?;
            ensure!(
                all.insert(name.clone(), run).is_none(),
                "run {name} was listed twice"
            );
        }
        match next {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(all),
        }
    }
}

/// Parses a resourceVersion. Only this test treats it as a number: the store promises a
/// single increasing sequence, and this is how the test checks it.
fn rv_number(name: &str, rv: &str) -> Result<u64> {
    rv.parse()
        .with_context(|| format!("resourceVersion {rv:?} of {name} is not a number"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_creates_survive_sigkill_mid_burst() -> Result<()> {
    // The test owns the data directory, so it outlives the first server.
    let root = tempfile::Builder::new()
        .prefix("kruntimes-crash")
        .tempdir()
        .context("create a data directory")?;
    let data_dir = root.path().join("data");
    let options = Options {
        data_dir: Some(data_dir.clone()),
        ..Options::default()
    };

    let mut server = Server::start_with(options.clone())?;
    let api: Api<Run> = Api::namespaced(server.client().await?, NAMESPACE);

    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut writers = tokio::task::JoinSet::new();
    for id in 0..WRITERS {
        writers.spawn(writer(api.clone(), id, tx.clone()));
    }
    drop(tx);

    let mut acked: BTreeMap<String, Acked> = BTreeMap::new();
    let record = |acked: &mut BTreeMap<String, Acked>,
                  name: String,
                  uid: String,
                  rv: String|
     -> Result<()> {
        ensure!(
            !uid.is_empty() && !rv.is_empty(),
            "create of {name} returned no uid or resourceVersion"
        );
        ensure!(
            acked
                .insert(
                    name.clone(),
                    Acked {
                        uid,
                        resource_version: rv
                    }
                )
                .is_none(),
            "{name} was acknowledged twice"
        );
        Ok(())
    };

    // The burst, until KILL_AFTER creates are acknowledged. A failure before the kill is a
    // server bug.
    let burst = async {
        while acked.len() < KILL_AFTER {
            match rx.recv().await {
                Some(Event::Acked {
                    name,
                    uid,
                    resource_version,
                }) => {
                    record(&mut acked, name, uid, resource_version)?;
                }
                Some(Event::Failed { name, error }) => {
                    bail!("create of {name} failed before the server was killed: {error}")
                }
                None => bail!("every writer stopped before {KILL_AFTER} creates were acknowledged"),
            }
        }
        Ok(())
    };
    tokio::time::timeout(BURST_DEADLINE, burst)
        .await
        .with_context(|| {
            format!("{KILL_AFTER} creates were not acknowledged within {BURST_DEADLINE:?}")
        })??;

    server.kill().context("SIGKILL the server")?;
    let killed_at = acked.len();

    // Writers notice the dead server through failed requests. A create whose answer
    // arrived before the kill is acknowledged too.
    let drain = async {
        let mut failures = 0;
        while let Some(event) = rx.recv().await {
            match event {
                Event::Acked {
                    name,
                    uid,
                    resource_version,
                } => {
                    record(&mut acked, name, uid, resource_version)?;
                }
                Event::Failed { .. } => failures += 1,
            }
        }
        while let Some(joined) = writers.join_next().await {
            joined.context("a writer panicked")?;
        }
        Ok::<usize, anyhow::Error>(failures)
    };
    let failures = tokio::time::timeout(DRAIN_DEADLINE, drain)
        .await
        .with_context(|| format!("writers did not stop within {DRAIN_DEADLINE:?} of the kill"))??;
    ensure!(
        failures == WRITERS,
        "{failures} of {WRITERS} writers were stopped by the kill; the others stopped before it"
    );
    eprintln!(
        "crash: {killed_at} creates acknowledged at the kill, {} in all, {failures} writers stopped by it",
        acked.len()
    );
    drop(server);

    // Restart on the same data directory.
    let server = Server::start_with(options)?;
    let api: Api<Run> = Api::namespaced(server.client().await?, NAMESPACE);
    let listed = list_all(&api).await?;

    let mut missing = Vec::new();
    let mut changed = Vec::new();
    for (name, ack) in &acked {
        match listed.get(name) {
            None => missing.push(name.clone()),
            Some(run) => {
                let rv = run.metadata.resource_version.as_deref().unwrap_or_default();
                let uid = run.metadata.uid.as_deref().unwrap_or_default();
                if rv != ack.resource_version || uid != ack.uid {
                    changed.push(format!(
                        "{name}: acknowledged rv {} uid {}, listed rv {rv} uid {uid}",
                        ack.resource_version, ack.uid
                    ));
                }
            }
        }
    }
    ensure!(
        missing.is_empty(),
        "{} of {} acknowledged creates are gone after the restart: {:?}",
        missing.len(),
        acked.len(),
        &missing[..missing.len().min(20)]
    );
    ensure!(
        changed.is_empty(),
        "{} acknowledged creates came back different: {:?}",
        changed.len(),
        &changed[..changed.len().min(20)]
    );

    // Every resourceVersion seen so far, acknowledged or only listed.
    let mut highest = 0;
    for (name, ack) in &acked {
        highest = highest.max(rv_number(name, &ack.resource_version)?);
    }
    for (name, run) in &listed {
        let rv = run.metadata.resource_version.as_deref().unwrap_or_default();
        highest = highest.max(rv_number(name, rv)?);
    }

    let fresh = api
        .create(&PostParams::default(), &task_run("after-restart")?)
        .await
        .context("create a Run after the restart")?;
    let fresh_rv = fresh
        .metadata
        .resource_version
        .as_deref()
        .context("the create after the restart returned no resourceVersion")?;
    let fresh_rv = rv_number("after-restart", fresh_rv)?;
    ensure!(
        fresh_rv > highest,
        "the first create after the restart got resourceVersion {fresh_rv}, not above {highest} seen before the crash"
    );
    Ok(())
}

/// A bash task Run of the default Runtime.
fn bash_task(name: &str, script: &str) -> Run {
    let mut spec = RunSpec::task("bash", "main.sh");
    spec.source = Some(RunSource {
        inline: Some(script.to_string()),
        snapshot: None,
    });
    let mut run = Run::new(name, spec);
    run.metadata.labels = Some(BTreeMap::from([(
        "test".to_string(),
        "restart".to_string(),
    )]));
    run
}

/// How long the Runs of one phase of the restart test may take.
const RESTART_DEADLINE: Duration = Duration::from_secs(90);

/// Regression (issue 14.4): after `kruntimes up` was SIGKILLed while it ran Runs and was
/// started again on the same data directory, the Runs created at once were placed on the
/// Pods of the killed process's workers (which still said Ready) and ended
/// Failed/WorkerLost; the new controller-manager also waited out the dead one's Lease.
/// Every placement of every new Run is recorded from a watch: none may name a Pod of the
/// killed process, and each Run succeeds on its first attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_created_after_a_sigkill_restart_never_go_to_dead_workers() -> Result<()> {
    let root = tempfile::Builder::new()
        .prefix("kruntimes-restart")
        .tempdir()
        .context("create a data directory")?;
    let options = Options {
        data_dir: Some(root.path().join("data")),
        ..Options::full()
    };
    let start = |options: Options| async move {
        tokio::task::spawn_blocking(move || Server::start_with(options))
            .await
            .context("join the server start")?
    };

    // The killed incarnation: its worker holds Runs (and has free slots) when it dies.
    let mut server = start(options.clone()).await?;
    let runs: Api<Run> = Api::namespaced(server.client().await?, NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(server.client().await?, NAMESPACE);
    let busy: Vec<String> = (0..4).map(|i| format!("before-{i}")).collect();
    for name in &busy {
        runs.create(&PostParams::default(), &bash_task(name, "sleep 300\n"))
            .await
            .with_context(|| format!("create Run {name}"))?;
    }
    within(RESTART_DEADLINE, "the Runs before the kill to run", async {
        let mut events = watcher(runs.clone(), watcher::Config::default())
            .default_backoff()
            .applied_objects()
            .boxed();
        let mut running = BTreeSet::new();
        while running.len() < busy.len() {
            let run = events.next().await.context("the watch ended")??;
            if run.phase() == Phase::Running {
                running.insert(run.name_any());
            }
        }
        Ok(())
    })
    .await?;
    let dead: BTreeSet<String> = pods
        .list(&ListParams::default().labels("kruntimes.io/runtime"))
        .await?
        .items
        .iter()
        .filter_map(|pod| pod.uid())
        .collect();
    ensure!(!dead.is_empty(), "the killed process had worker Pods");
    server.kill().context("SIGKILL kruntimes up")?;
    drop(server);

    // The restart, and new Runs at once.
    let server = start(options).await?;
    let runs: Api<Run> = Api::namespaced(server.client().await?, NAMESPACE);
    let mut events = watcher(
        runs.clone(),
        watcher::Config::default().labels("test=restart"),
    )
    .default_backoff()
    .applied_objects()
    .boxed();
    let fresh: Vec<String> = (0..10).map(|i| format!("after-{i}")).collect();
    for name in &fresh {
        runs.create(&PostParams::default(), &bash_task(name, "exit 0\n"))
            .await
            .with_context(|| format!("create Run {name}"))?;
    }
    let mut placements: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut ended: BTreeMap<String, Run> = BTreeMap::new();
    within(RESTART_DEADLINE, "every new Run to end", async {
        while ended.len() < fresh.len() {
            let run = events.next().await.context("the watch ended")??;
            let name = run.name_any();
            if !fresh.contains(&name) {
                continue;
            }
            if let Some(uid) = run.status.as_ref().and_then(|s| s.assigned_pod_uid.clone()) {
                placements.entry(name.clone()).or_default().insert(uid);
            }
            if run.phase().is_terminal() {
                ended.insert(name, run);
            }
        }
        Ok(())
    })
    .await
    .with_context(|| format!("placements so far: {placements:?}"))?;
    let on_dead: Vec<&String> = placements
        .iter()
        .filter(|(_, uids)| !uids.is_disjoint(&dead))
        .map(|(name, _)| name)
        .collect();
    ensure!(
        on_dead.is_empty(),
        "Runs created after the restart were placed on workers of the killed process: {on_dead:?} (dead Pod UIDs {dead:?}, placements {placements:?})"
    );
    for (name, run) in &ended {
        let status = run.status.clone().unwrap_or_default();
        ensure!(
            run.phase() == Phase::Succeeded && status.attempt.unwrap_or(1) == 1,
            "{name} ended {} on attempt {:?} ({:?}: {:?})",
            run.phase(),
            status.attempt,
            status.reason,
            status.message
        );
    }
    Ok(())
}
