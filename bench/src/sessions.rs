//! `bench-sessions`: session Runs (sandboxes) end to end on a real `kruntimes up` (API
//! server, controller-manager, local workers with runtimed and a bash runtime server, the
//! HTTPS gateway).
//!
//! Measurements:
//! - **acquire**: `--acquires` session Runs (default 50), the Run the SDK's
//!   `acquire_sandbox` creates (registration finalizer in place), one at a time, each released
//!   (Immediate, then deleted) before the next: create → Ready as the client's watch sees
//!   it, and from the status where the time went (schedule, claim, register: the Ready
//!   condition's lastTransitionTime − startTime, which holds the runtime server's
//!   RegisterSession and the Ready write).
//! - **acquires/s**: `--rounds` rounds (default 5); each creates one session per warm
//!   worker at once and waits until all are Ready; sessions / elapsed. Released between
//!   rounds.
//! - **exec**: `--execs` (default 500) commands `true` (argv) over one WebSocket, one at a
//!   time: send → completed event, as the SDK's `exec` sees it.
//! - **file**: `--files` (default 500) round trips of a 4 KiB file: write (an operation on
//!   the WebSocket) then read (`GET …/files`), checked byte for byte.
//!
//! Prints one JSON object on stdout. Build first, in one profile:
//! `cargo build --release -p kruntimes -p kruntimes-runtime-server -p kruntimes-bench &&
//! ./target/release/bench-sessions`.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use futures::future::try_join_all;
use kruntimes_api::{Phase, Run};
use kruntimes_bench::{Settled, create_runtime, create_settled, percentiles, ready_breakdown};
use kruntimes_client::Connection;
use kruntimes_client::sandbox::{AcquireOptions, ReleaseOptions};
use kruntimes_client::session::{Command, OperationState};
use kruntimes_testkit::{Options, Server};
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;

#[derive(Parser, Debug)]
#[command(
    name = "bench-sessions",
    about = "Session Runs end to end: acquire latency, acquires/s, exec and file round trips"
)]
struct Args {
    /// Acquires measured one at a time.
    #[arg(long, default_value_t = 50)]
    acquires: usize,
    /// Rounds of the acquires/s measurement (0 skips it).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Commands measured over the WebSocket (0 skips it).
    #[arg(long, default_value_t = 500)]
    execs: usize,
    /// 4 KiB write+read round trips measured (0 skips it).
    #[arg(long, default_value_t = 500)]
    files: usize,
    /// Warm workers of the benchmark's Runtime (one session each).
    #[arg(long, default_value_t = 8)]
    workers: i32,
    /// Extra arguments for `kruntimes up`.
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    server_args: Vec<String>,
}

const RUNTIME: &str = "sbbench";

fn main() -> Result<()> {
    let args = Args::parse();
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
    create_runtime(&client, RUNTIME, "bash", args.workers, 1, &[]).await?;
    let settled = Settled::start(client.clone(), |run| {
        run.phase() == Phase::Ready || run.phase().is_terminal()
    });

    // Warm-up: connections, caches.
    acquires(&client, &settled, "warm", 5).await?;
    let acquire = acquires(&client, &settled, "acq", args.acquires).await?;
    let rate = if args.rounds > 0 {
        Some(acquire_rate(&client, &settled, args).await?)
    } else {
        None
    };
    let data_plane = if args.execs > 0 || args.files > 0 {
        Some(data_plane(server, args).await?)
    } else {
        None
    };
    Ok(json!({
        "benchmark": "sessions",
        "workers": args.workers,
        "server_args": args.server_args,
        "acquire": acquire,
        "acquires_per_second": rate,
        "data_plane": data_plane,
    }))
}

/// Creates the session `name` and waits until it is Ready.
async fn acquire(
    client: &Client,
    settled: &Settled,
    name: &str,
) -> Result<(Run, k8s_openapi::jiff::Timestamp, Duration)> {
    // The Run the SDK's acquire_sandbox creates (with the registration finalizer in place).
    let run = AcquireOptions {
        name: Some(name.to_string()),
        ..AcquireOptions::default()
    }
    .to_run(RUNTIME)?;
    let (run, created, seen) = create_settled(client, settled, run).await?;
    if run.phase() != Phase::Ready {
        let status = run.status.unwrap_or_default();
        bail!(
            "session {name} ended {:?}: {:?} {:?}",
            status.phase,
            status.reason,
            status.message
        );
    }
    Ok((run, created, seen))
}

/// Releases `name` at once: Immediate, then delete (the finalizer is released by its
/// runtimed once the session is closed).
async fn release(client: &Client, name: &str) -> Result<()> {
    let api = Api::<Run>::namespaced(client.clone(), "default");
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"termination": {"mode": "Immediate"}}})),
    )
    .await
    .with_context(|| format!("terminate {name}"))?;
    api.delete(name, &DeleteParams::default())
        .await
        .with_context(|| format!("delete {name}"))?;
    Ok(())
}

/// Waits until no Run labelled `bench` holds a worker (every released session is gone).
async fn all_released(client: &Client) -> Result<()> {
    let api = Api::<Run>::namespaced(client.clone(), "default");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = api
            .list(&kube::api::ListParams::default().labels("bench"))
            .await?
            .items
            .len();
        if left == 0 {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "{left} released sessions are still there after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Acquires `count` sessions one at a time, releasing each before the next.
async fn acquires(
    client: &Client,
    settled: &Settled,
    prefix: &str,
    count: usize,
) -> Result<serde_json::Value> {
    let (mut observed, mut schedule, mut claim, mut register) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..count {
        let name = format!("{prefix}-{i:04}");
        let (run, created, seen) = acquire(client, settled, &name).await?;
        let [scheduling, claiming, registering] = ready_breakdown(&run, created)?;
        observed.push(seen);
        schedule.push(scheduling);
        claim.push(claiming);
        register.push(registering);
        release(client, &name).await?;
        all_released(client).await?;
    }
    Ok(json!({
        "sessions": count,
        "create_to_ready_ms": percentiles(&mut observed),
        "schedule_ms": percentiles(&mut schedule),
        "claim_ms": percentiles(&mut claim),
        "register_ms": percentiles(&mut register),
    }))
}

/// One session per warm worker at once, `rounds` times: sessions Ready per second.
async fn acquire_rate(
    client: &Client,
    settled: &Settled,
    args: &Args,
) -> Result<serde_json::Value> {
    let per_round = usize::try_from(args.workers).unwrap_or(1);
    let mut rates = Vec::with_capacity(args.rounds);
    for round in 0..args.rounds {
        let names: Vec<String> = (0..per_round)
            .map(|i| format!("burst-{round}-{i:03}"))
            .collect();
        let started = Instant::now();
        try_join_all(names.iter().map(|name| acquire(client, settled, name))).await?;
        let elapsed = started.elapsed();
        rates.push(per_round as f64 / elapsed.as_secs_f64());
        for name in &names {
            release(client, name).await?;
        }
        all_released(client).await?;
    }
    rates.sort_by(f64::total_cmp);
    Ok(json!({
        "sessions_per_round": per_round,
        "rounds": args.rounds,
        "median": rates.get(rates.len() / 2).copied().unwrap_or_default(),
        "all": rates,
    }))
}

/// Exec and file round trips on one sandbox, through the gateway with the SDK (TLS verified
/// with the Run's CA bundle, one WebSocket).
async fn data_plane(server: &Server, args: &Args) -> Result<serde_json::Value> {
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection
        .runtime(RUNTIME)
        .acquire_sandbox(&AcquireOptions::default())
        .await?;
    let mut session = sandbox.open_session().await?;
    let mut exec_rtt = Vec::with_capacity(args.execs);
    for i in 0..args.execs + 20 {
        let started = Instant::now();
        let done = session.exec(Command::argv(["true"]), |_, _| {}).await?;
        let elapsed = started.elapsed();
        ensure!(
            done.state == OperationState::Succeeded,
            "`true` did not succeed: {done:?}"
        );
        if i >= 20 {
            exec_rtt.push(elapsed);
        }
    }
    let content: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    let mut file_rtt = Vec::with_capacity(args.files);
    for i in 0..args.files + 20 {
        let started = Instant::now();
        let wrote = session
            .write_file("bench.bin", content.clone(), false)
            .await?;
        ensure!(
            wrote.state == OperationState::Succeeded,
            "the write failed: {wrote:?}"
        );
        let read = sandbox.read_file("bench.bin").await?;
        let elapsed = started.elapsed();
        ensure!(read == content, "the file read back differs");
        if i >= 20 {
            file_rtt.push(elapsed);
        }
    }
    session.close().await;
    sandbox
        .release(ReleaseOptions {
            immediate: true,
            ..ReleaseOptions::default()
        })
        .await?;
    Ok(json!({
        "exec_true_ms": percentiles(&mut exec_rtt),
        "execs": args.execs,
        "file_4k_write_read_ms": percentiles(&mut file_rtt),
        "files": args.files,
    }))
}
