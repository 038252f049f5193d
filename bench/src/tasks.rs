//! `bench-tasks`: task Runs end to end on a real `kruntimes up` (API server,
//! controller-manager, local workers with runtimed and a bash runtime server), after the
//! reference harness's hot path: create a Run, wait for it to end, no sleep between.
//!
//! Two measurements:
//! - **latency**: `--runs` Runs (default 50) at `--concurrency` (default 25). For each Run
//!   the client notes the wall-clock time just before its create request; the Run's status
//!   carries the rest (microsecond RFC 3339): the Scheduled condition's
//!   `lastTransitionTime` (the scheduler placed it), `startTime` (runtimed claimed it) and
//!   `completionTime` (runtimed wrote its end). From these:
//!   - schedule = Scheduled − create;
//!   - dispatch = startTime − Scheduled;
//!   - execution = completionTime − startTime (Execute, the program, Wait, and the result);
//!   - complete = completionTime − create;
//!   - observed = the client's watch sees the terminal phase − create.
//! - **throughput**: `--throughput-runs` Runs (default 2000) at `--throughput-concurrency`
//!   in flight; Runs per second from the first create to the last terminal event.
//!
//! Every Run must succeed. Prints one JSON object on stdout. Build first, in one profile:
//! `cargo build --release -p kruntimes -p kruntimes-runtime-server -p kruntimes-bench &&
//! ./target/release/bench-tasks`. Binaries are found through `KRUNTIMES_BIN` or next to
//! this executable.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Parser;
use k8s_openapi::jiff::Timestamp;
use kruntimes_api::run::RunSource;
use kruntimes_api::{Phase, Run, RunSpec};
use kruntimes_bench::{Settled, create_runtime, percentiles};
use kruntimes_testkit::{Options, Server};
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

/// The longest one Run may take before the benchmark gives up.
const RUN_DEADLINE: Duration = Duration::from_secs(60);

#[derive(Parser, Debug)]
#[command(
    name = "bench-tasks",
    about = "Task Runs end to end: latency breakdown and Runs/s"
)]
struct Args {
    /// Runs in the latency measurement.
    #[arg(long, default_value_t = 50)]
    runs: usize,
    /// Runs in flight in the latency measurement.
    #[arg(long, default_value_t = 25)]
    concurrency: usize,
    /// Runs in the throughput measurement (0 skips it).
    #[arg(long, default_value_t = 2000)]
    throughput_runs: usize,
    /// Runs in flight in the throughput measurement.
    #[arg(long, default_value_t = 64)]
    throughput_concurrency: usize,
    /// Workers of the benchmark's Runtime.
    #[arg(long, default_value_t = 2)]
    workers: i32,
    /// Run slots per worker.
    #[arg(long, default_value_t = 32)]
    runs_per_worker: i32,
    /// Extra arguments for the benchmark Runtime's runtime servers, e.g. `--cgroups=off`.
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    worker_args: Vec<String>,
    /// Extra arguments for `kruntimes up`.
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    server_args: Vec<String>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        args.concurrency >= 1 && args.throughput_concurrency >= 1,
        "concurrency ≥ 1"
    );
    let (server, runtime) = kruntimes_bench::start(Options {
        data_dir: None,
        extra_args: args.server_args.clone(),
        full: true,
        ..Options::default()
    })?;
    let report = runtime.block_on(run(&server, &args))?;
    kruntimes_bench::print(&report)?;
    drop(server);
    Ok(())
}

async fn run(server: &Server, args: &Args) -> Result<serde_json::Value> {
    let client = server.client().await?;
    let runtime_name = "bench";
    create_runtime(
        &client,
        runtime_name,
        "bash",
        args.workers,
        args.runs_per_worker,
        &args.worker_args,
    )
    .await?;
    let watcher = Settled::start(client.clone(), |run| run.phase().is_terminal());

    // Warm-up: connections, workers, caches.
    batch(&client, &watcher, runtime_name, "warm", 20, 10).await?;

    let latency = batch(
        &client,
        &watcher,
        runtime_name,
        "lat",
        args.runs,
        args.concurrency,
    )
    .await?;
    let throughput = if args.throughput_runs > 0 {
        Some(
            batch(
                &client,
                &watcher,
                runtime_name,
                "thr",
                args.throughput_runs,
                args.throughput_concurrency,
            )
            .await?,
        )
    } else {
        None
    };
    Ok(json!({
        "benchmark": "tasks",
        "program": "bash main.sh (echo ok)",
        "workers": args.workers,
        "runs_per_worker": args.runs_per_worker,
        "server_args": args.server_args,
        "worker_args": args.worker_args,
        "latency": latency,
        "throughput": throughput,
    }))
}

struct Sample {
    schedule: Duration,
    dispatch: Duration,
    execution: Duration,
    complete: Duration,
    observed: Duration,
}

fn between(from: Timestamp, to: Timestamp) -> Duration {
    Duration::try_from(from.duration_until(to)).unwrap_or(Duration::ZERO)
}

fn parse(text: Option<&str>, what: &str, name: &str) -> Result<Timestamp> {
    text.with_context(|| format!("Run {name} has no {what}"))?
        .parse()
        .with_context(|| format!("Run {name}: {what} is not a timestamp"))
}

async fn batch(
    client: &Client,
    completions: &Settled,
    runtime: &str,
    prefix: &str,
    count: usize,
    concurrency: usize,
) -> Result<serde_json::Value> {
    let api = Api::<Run>::namespaced(client.clone(), "default");
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let api = api.clone();
        let next = next.clone();
        let completions = completions.clone();
        let prefix = prefix.to_string();
        let runtime = runtime.to_string();
        workers.spawn(async move {
            let mut samples = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                let name = format!("{prefix}-{i:06}");
                let mut spec = RunSpec::task(runtime.as_str(), "main.sh");
                spec.source = Some(RunSource {
                    inline: Some("echo ok\n".into()),
                    snapshot: None,
                });
                let mut run = Run::new(&name, spec);
                run.labels_mut().insert("bench".into(), prefix.clone());
                let done = completions.expect(&name)?;
                let created_wall = Timestamp::now();
                let created = Instant::now();
                api.create(&PostParams::default(), &run)
                    .await
                    .with_context(|| format!("create {name}"))?;
                let (run, seen) = tokio::time::timeout(RUN_DEADLINE, done)
                    .await
                    .with_context(|| format!("Run {name} did not end within {RUN_DEADLINE:?}"))?
                    .context("the completion watch stopped")?;
                let status = run.status.clone().unwrap_or_default();
                ensure!(
                    run.phase() == Phase::Succeeded,
                    "Run {name} ended {}: {:?} {:?}",
                    run.phase(),
                    status.reason,
                    status.message
                );
                let scheduled = status
                    .conditions
                    .iter()
                    .find(|c| c.type_ == "Scheduled")
                    .and_then(|c| c.last_transition_time.as_deref());
                let scheduled = parse(scheduled, "Scheduled condition", &name)?;
                let start = parse(status.start_time.as_deref(), "startTime", &name)?;
                let end = parse(status.completion_time.as_deref(), "completionTime", &name)?;
                samples.push(Sample {
                    schedule: between(created_wall, scheduled),
                    dispatch: between(scheduled, start),
                    execution: between(start, end),
                    complete: between(created_wall, end),
                    observed: seen.duration_since(created),
                });
            }
            anyhow::Ok(samples)
        });
    }
    let mut samples = Vec::with_capacity(count);
    while let Some(joined) = workers.join_next().await {
        samples.extend(joined.context("join a benchmark worker")??);
    }
    let elapsed = started.elapsed();
    ensure!(
        samples.len() == count,
        "{} of {count} Runs finished",
        samples.len()
    );
    let pick = |f: fn(&Sample) -> Duration| {
        let mut v: Vec<Duration> = samples.iter().map(f).collect();
        percentiles(&mut v)
    };
    Ok(json!({
        "runs": count,
        "concurrency": concurrency,
        "elapsed_ms": elapsed.as_secs_f64() * 1e3,
        "runs_per_second": count as f64 / elapsed.as_secs_f64(),
        "schedule_ms": pick(|s| s.schedule),
        "dispatch_ms": pick(|s| s.dispatch),
        "execution_ms": pick(|s| s.execution),
        "complete_ms": pick(|s| s.complete),
        "observed_ms": pick(|s| s.observed),
    }))
}
