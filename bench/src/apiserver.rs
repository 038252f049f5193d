//! `bench-apiserver`: throughput and watch latency of the embedded API server, measured
//! end to end over HTTPS with kube-rs against a real `kruntimes up` (started through the
//! testkit in a temporary data directory, on an ephemeral port).
//!
//! It measures
//! - creates per second at concurrency 1 and at a higher concurrency (a fixed number of
//!   creates each; every create must succeed), with per-request latency percentiles;
//! - watch delivery latency: Runs are created one after another while a watch is open, and
//!   each sample is the time from just before the create request to the moment the watch
//!   task receives that Run's ADDED event.
//!
//! It prints one JSON object on stdout. Build the server binary first, in the same profile:
//! `cargo build --release -p kruntimes -p kruntimes-bench && ./target/release/bench-apiserver`.
//! The binary is found through `KRUNTIMES_BIN` or next to this executable.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use clap::Parser;
use futures::StreamExt;
use kruntimes_api::Run;
use kruntimes_api::RunSpec;
use kruntimes_testkit::{Options, Server};
use kube::api::{Api, ListParams, PostParams, WatchEvent, WatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;

/// How long one watch event may take before the benchmark gives up.
const EVENT_DEADLINE: Duration = Duration::from_secs(30);

#[derive(Parser, Debug)]
#[command(
    name = "bench-apiserver",
    about = "Create throughput and watch latency of the embedded API server"
)]
struct Args {
    /// Creates measured at concurrency 1.
    #[arg(long, default_value_t = 2000)]
    serial_creates: usize,
    /// Creates measured at `--concurrency`.
    #[arg(long, default_value_t = 20000)]
    concurrent_creates: usize,
    /// In-flight creates for the concurrent measurement.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Sequential creates whose ADDED events are timed on an open watch.
    #[arg(long, default_value_t = 2000)]
    watch_events: usize,
    /// Extra arguments for `kruntimes up`, e.g. `--durability=full`.
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    server_args: Vec<String>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(args.concurrency >= 1, "--concurrency must be at least 1");
    let (server, runtime) = kruntimes_bench::start(Options {
        data_dir: None,
        extra_args: args.server_args.clone(),
        ..Options::default()
    })?;
    let report = runtime.block_on(run(&server, &args))?;
    kruntimes_bench::print(&report)?;
    drop(server);
    Ok(())
}

async fn run(server: &Server, args: &Args) -> Result<serde_json::Value> {
    let client = server.client().await?;
    let api: Api<Run> = Api::namespaced(client.clone(), "default");

    // Warm up connections and the store.
    creates(&api, "warm", 50, 4).await?;

    let serial = creates(&api, "c1", args.serial_creates, 1).await?;
    let concurrent = creates(
        &api,
        &format!("c{}", args.concurrency),
        args.concurrent_creates,
        args.concurrency,
    )
    .await?;
    let watch = watch_latency(client, args.watch_events).await?;

    Ok(json!({
        "benchmark": "apiserver",
        "transport": "https, kube-rs 5",
        "server_args": args.server_args,
        "creates": [serial, concurrent],
        "watch_latency": watch,
    }))
}

fn spec() -> RunSpec {
    RunSpec::task("bench", "main.sh")
}

/// `count` creates with `concurrency` in flight; every one must succeed.
async fn creates(
    api: &Api<Run>,
    prefix: &str,
    count: usize,
    concurrency: usize,
) -> Result<serde_json::Value> {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let api = api.clone();
        let next = next.clone();
        let prefix = prefix.to_string();
        workers.spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                let name = format!("{prefix}-{i:06}");
                let t0 = Instant::now();
                api.create(&PostParams::default(), &Run::new(&name, spec()))
                    .await
                    .with_context(|| format!("create {name}"))?;
                latencies.push(t0.elapsed());
            }
            anyhow::Ok(latencies)
        });
    }
    let mut latencies = Vec::with_capacity(count);
    while let Some(joined) = workers.join_next().await {
        latencies.extend(joined.context("join a create worker")??);
    }
    let elapsed = started.elapsed();
    ensure!(
        latencies.len() == count,
        "{} of {count} creates finished",
        latencies.len()
    );
    Ok(json!({
        "concurrency": concurrency,
        "count": count,
        "elapsed_ms": elapsed.as_secs_f64() * 1e3,
        "per_second": count as f64 / elapsed.as_secs_f64(),
        "latency_us": percentiles(&mut latencies),
    }))
}

/// Creates Runs one at a time while a watch is open and times create → ADDED.
async fn watch_latency(client: Client, count: usize) -> Result<serde_json::Value> {
    // Start at the current resourceVersion, with a label only the timed creates carry.
    let api: Api<Run> = Api::namespaced(client, "default");
    let rv = api
        .list(&ListParams::default().limit(1))
        .await?
        .metadata
        .resource_version
        .context("a list carries metadata.resourceVersion")?;
    let mut stream = api
        .watch(&WatchParams::default().labels("bench=watch"), &rv)
        .await?
        .boxed();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(String, Instant)>();
    let reader = tokio::spawn(async move {
        while let Some(event) = stream.next().await {
            match event.context("the watch stream failed")? {
                WatchEvent::Added(obj) => {
                    let seen = Instant::now();
                    if tx.send((obj.name_any(), seen)).is_err() {
                        break;
                    }
                }
                WatchEvent::Error(status) => bail!("watch ERROR event: {status:?}"),
                WatchEvent::Modified(_) | WatchEvent::Deleted(_) | WatchEvent::Bookmark(_) => {}
            }
        }
        anyhow::Ok(())
    });

    let mut latencies = Vec::with_capacity(count);
    let mut early: HashMap<String, Instant> = HashMap::new();
    let started = Instant::now();
    for i in 0..count {
        let name = format!("w-{i:06}");
        let mut run = Run::new(&name, spec());
        run.labels_mut().insert("bench".into(), "watch".into());
        let t0 = Instant::now();
        api.create(&PostParams::default(), &run)
            .await
            .with_context(|| format!("create {name}"))?;
        let seen = match early.remove(&name) {
            Some(seen) => seen,
            None => loop {
                let (got, seen) = tokio::time::timeout(EVENT_DEADLINE, rx.recv())
                    .await
                    .map_err(|_| anyhow!("no ADDED event for {name} within {EVENT_DEADLINE:?}"))?
                    .ok_or_else(|| anyhow!("the watch ended before ADDED {name}"))?;
                if got == name {
                    break seen;
                }
                early.insert(got, seen);
            },
        };
        latencies.push(seen.saturating_duration_since(t0));
    }
    let elapsed = started.elapsed();
    reader.abort();
    Ok(json!({
        "events": count,
        "elapsed_ms": elapsed.as_secs_f64() * 1e3,
        "latency_us": percentiles(&mut latencies),
    }))
}

/// p50, p90, p99 and max in microseconds.
fn percentiles(samples: &mut [Duration]) -> serde_json::Value {
    let at = kruntimes_bench::percentile_of(samples);
    json!({
        "p50": at(50.0).as_micros(),
        "p90": at(90.0).as_micros(),
        "p99": at(99.0).as_micros(),
        "max": at(100.0).as_micros(),
    })
}
