//! A burst of task Runs on two workers with many slots each (issue 14, item 1: under a
//! burst of 2,000 to 3,000 `true` tasks, Runs ended `Cancelled` that nobody cancelled,
//! killed by runtimed's garbage collector). Every Run must end Succeeded.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, bail};
use common::{create_runtime_with, wait_runtime};
use futures::{StreamExt, TryStreamExt};
use kruntimes_api::run::RunSource;
use kruntimes_api::{Phase, Run, RunSpec};
use kruntimes_testkit::{Options, Server, within};
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};

const RUNS: usize = 2_000;
/// Creations in flight at once.
const CREATE_CONCURRENCY: usize = 64;
/// The whole burst, creation included (a debug build on two shared cores).
const BURST_DEADLINE: Duration = Duration::from_secs(240);

/// Regression (issue 14.1): no Run of a burst ends Cancelled (or anything but Succeeded).
#[tokio::test]
async fn a_burst_of_two_thousand_tasks_all_succeed() -> Result<()> {
    let (_server, client) = Server::start_async(Options::full()).await?;
    create_runtime_with(&client, "burst", "bash", 2, 32, &["--sandbox", "process"]).await?;
    let runs = Api::<Run>::namespaced(client.clone(), "default");

    // Every phase change of every burst Run, from before the first is created.
    let config = watcher::Config::default().labels("burst=yes");
    let mut events = watcher(runs.clone(), config).applied_objects().boxed();

    let mut spec = RunSpec::task("burst", "main.sh");
    spec.source = Some(RunSource {
        inline: Some("true\n".to_string()),
        snapshot: None,
    });
    let spec = Arc::new(spec);
    let creating = {
        let runs = runs.clone();
        tokio::spawn(async move {
            futures::stream::iter(0..RUNS)
                .map(|i| {
                    let runs = runs.clone();
                    let spec = spec.clone();
                    async move {
                        let mut run = Run::new(&format!("burst-{i:04}"), (*spec).clone());
                        run.metadata.labels =
                            Some(BTreeMap::from([("burst".to_string(), "yes".to_string())]));
                        runs.create(&PostParams::default(), &run).await
                    }
                })
                .buffer_unordered(CREATE_CONCURRENCY)
                .try_for_each(|_| async { Ok(()) })
                .await
        })
    };

    let ended = within(BURST_DEADLINE, "every burst Run ends", async {
        let mut ended: BTreeMap<String, Run> = BTreeMap::new();
        while let Some(run) = events.next().await {
            let run = run?;
            if run.phase().is_terminal() {
                ended.insert(run.name_any(), run);
                if ended.len() == RUNS {
                    return Ok(ended);
                }
            }
        }
        bail!("the watch ended")
    })
    .await?;
    creating.await??;

    let unsuccessful: Vec<_> = ended
        .values()
        .filter(|run| run.phase() != Phase::Succeeded)
        .map(|run| {
            let status = run.status.clone().unwrap_or_default();
            (run.name_any(), run.phase(), status.reason, status.message)
        })
        .collect();
    assert!(
        unsuccessful.is_empty(),
        "{} of {RUNS} Runs did not succeed: {:?}",
        unsuccessful.len(),
        &unsuccessful[..unsuccessful.len().min(20)]
    );
    let attempts: Vec<_> = ended
        .values()
        .filter(|run| run.status.as_ref().and_then(|s| s.attempt) != Some(1))
        .map(ResourceExt::name_any)
        .collect();
    assert!(attempts.is_empty(), "Runs retried: {attempts:?}");
    wait_runtime(&client, "burst", "releases every slot", |rt| {
        rt.status.as_ref().and_then(|s| s.used_runs) == Some(0)
    })
    .await?;
    Ok(())
}
