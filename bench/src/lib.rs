//! What the benchmark binaries share: starting `kruntimes up` and the async runtime, a
//! Runtime to measure on, one watch that hands settled Runs to their waiters, and reading
//! percentiles from samples.

pub mod functions_framework;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kruntimes_api::{Run, Runtime, RuntimeSpec};
use kruntimes_testkit::{Options, Server};
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::sync::oneshot;

/// Starts `kruntimes up` with `options` and a multi-threaded async runtime to drive it.
pub fn start(options: Options) -> Result<(Server, tokio::runtime::Runtime)> {
    let server = Server::start_with(options).context(
        "start kruntimes up (build it first: cargo build --release -p kruntimes -p kruntimes-runtime-server)",
    )?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    Ok((server, runtime))
}

/// Prints the report as one JSON line on stdout.
pub fn print(report: &serde_json::Value) -> Result<()> {
    println!("{}", serde_json::to_string(report)?);
    Ok(())
}

/// Sorts `samples` and returns a function giving the sample at percentile `p` (0..=100),
/// nearest rank; zero for no samples.
pub fn percentile_of(samples: &mut [Duration]) -> impl Fn(f64) -> Duration + '_ {
    samples.sort_unstable();
    move |p: f64| {
        if samples.is_empty() {
            return Duration::ZERO;
        }
        let index = ((p / 100.0) * (samples.len() - 1) as f64).round() as usize;
        samples[index.min(samples.len() - 1)]
    }
}

/// Sample percentiles in milliseconds: p50, p95, p99 and the maximum.
pub fn percentiles(values: &mut [Duration]) -> serde_json::Value {
    let at = percentile_of(values);
    let ms = |p: f64| at(p).as_secs_f64() * 1e3;
    json!({"p50": ms(50.0), "p95": ms(95.0), "p99": ms(99.0), "max": ms(100.0)})
}

/// Creates the Runtime `name` in namespace default (`--adapter ADAPTER` plus
/// `worker_args`) and waits until every worker is ready.
pub async fn create_runtime(
    client: &Client,
    name: &str,
    adapter: &str,
    workers: i32,
    runs: i32,
    worker_args: &[String],
) -> Result<()> {
    let api = Api::<Runtime>::namespaced(client.clone(), "default");
    let runtime = Runtime::new(
        name,
        RuntimeSpec {
            replicas: workers,
            scaling: None,
            runs: Some(runs),
            template: kruntimes_api::runtime::template_with_args(
                ["--adapter".to_string(), adapter.to_string()]
                    .into_iter()
                    .chain(worker_args.iter().cloned())
                    .collect(),
            ),
            port: None,
            artifact_store: None,
        },
    );
    api.create(&PostParams::default(), &runtime).await?;
    let ready = kube::runtime::wait::await_condition(api, name, move |rt: Option<&Runtime>| {
        rt.and_then(|rt| rt.status.as_ref())
            .and_then(|s| s.ready_replicas)
            .is_some_and(|ready| ready >= workers)
    });
    tokio::time::timeout(Duration::from_secs(60), ready)
        .await
        .with_context(|| format!("Runtime {name}: workers not ready after 60 s"))?
        .context("watch the Runtime")?;
    Ok(())
}

/// A settled Run and when the watch saw it.
pub type Seen = (Run, Instant);

/// One watch over the Runs labelled `bench` in namespace default; hands each Run that
/// settles (by the given predicate) to whoever waits for it by name.
#[derive(Clone)]
pub struct Settled {
    waiting: Arc<Mutex<HashMap<String, oneshot::Sender<Seen>>>>,
    early: Arc<Mutex<HashMap<String, Seen>>>,
}

impl Settled {
    pub fn start(client: Client, settled: fn(&Run) -> bool) -> Settled {
        let this = Settled {
            waiting: Arc::default(),
            early: Arc::default(),
        };
        let shared = this.clone();
        tokio::spawn(async move {
            let api = Api::<Run>::namespaced(client, "default");
            // With the backoff, a watch whose server has gone waits between attempts; without
            // it, the failing reconnects never yield, starve the runtime's only worker
            // thread, and the settle deadline never fires (a benchmark spun for 10 minutes).
            let mut stream = watcher(api, watcher::Config::default().labels("bench"))
                .default_backoff()
                .applied_objects()
                .boxed();
            while let Some(event) = stream.next().await {
                let Ok(run) = event else { continue };
                if !settled(&run) {
                    continue;
                }
                let seen = Instant::now();
                let name = run.name_any();
                let sender = shared.waiting.lock().ok().and_then(|mut w| w.remove(&name));
                match sender {
                    Some(tx) => {
                        let _ = tx.send((run, seen));
                    }
                    None => {
                        if let Ok(mut early) = shared.early.lock() {
                            early.entry(name).or_insert((run, seen));
                        }
                    }
                }
            }
        });
        this
    }

    /// A receiver of the Run `name` once it settles (at once if it already has).
    pub fn expect(&self, name: &str) -> Result<oneshot::Receiver<Seen>> {
        let (tx, rx) = oneshot::channel();
        let early = self
            .early
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .remove(name);
        match early {
            Some(seen) => {
                let _ = tx.send(seen);
            }
            None => {
                self.waiting
                    .lock()
                    .map_err(|_| anyhow::anyhow!("poisoned"))?
                    .insert(name.to_string(), tx);
            }
        }
        Ok(rx)
    }
}

/// How long a Run may take to settle before a benchmark gives up.
pub const SETTLE_DEADLINE: Duration = Duration::from_secs(60);

/// Creates `run` (labelled `bench`) and waits for `settled` to see it settle: the Run as
/// seen, the wall time just before the create request, and create → seen on the client.
pub async fn create_settled(
    client: &Client,
    settled: &Settled,
    mut run: Run,
) -> Result<(Run, Timestamp, Duration)> {
    let name = run.name_any();
    let api = Api::<Run>::namespaced(client.clone(), "default");
    run.labels_mut().insert("bench".into(), "true".into());
    let seen = settled.expect(&name)?;
    let created_wall = Timestamp::now();
    let created = Instant::now();
    api.create(&PostParams::default(), &run)
        .await
        .with_context(|| format!("create {name}"))?;
    let (run, at) = tokio::time::timeout(SETTLE_DEADLINE, seen)
        .await
        .with_context(|| format!("Run {name} did not settle within {SETTLE_DEADLINE:?}"))?
        .context("the watch stopped")?;
    Ok((run, created_wall, at.duration_since(created)))
}

fn timestamp(text: Option<&str>, what: &str, name: &str) -> Result<Timestamp> {
    text.with_context(|| format!("Run {name} has no {what}"))?
        .parse()
        .with_context(|| format!("Run {name}: {what} is not a timestamp"))
}

fn between(from: Timestamp, to: Timestamp) -> Duration {
    Duration::try_from(from.duration_until(to)).unwrap_or(Duration::ZERO)
}

/// Where the time from create to Ready went, from the Run's status (microsecond RFC 3339):
/// schedule (create → Scheduled), claim (Scheduled → startTime), register (startTime → the
/// Ready condition's lastTransitionTime).
pub fn ready_breakdown(run: &Run, created: Timestamp) -> Result<[Duration; 3]> {
    let name = run.name_any();
    let status = run.status.clone().unwrap_or_default();
    let condition = |kind: &str| {
        status
            .conditions
            .iter()
            .find(|c| c.type_ == kind)
            .and_then(|c| c.last_transition_time.clone())
    };
    let scheduled = timestamp(condition("Scheduled").as_deref(), "Scheduled", &name)?;
    let started = timestamp(status.start_time.as_deref(), "startTime", &name)?;
    let ready = timestamp(condition("Ready").as_deref(), "Ready", &name)?;
    Ok([
        between(created, scheduled),
        between(scheduled, started),
        between(started, ready),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let mut samples: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        let at = percentile_of(&mut samples);
        assert_eq!(at(0.0), Duration::from_millis(1));
        assert_eq!(at(50.0), Duration::from_millis(51));
        assert_eq!(at(100.0), Duration::from_millis(100));
        let mut none: Vec<Duration> = Vec::new();
        assert_eq!(percentile_of(&mut none)(50.0), Duration::ZERO);
    }
}
