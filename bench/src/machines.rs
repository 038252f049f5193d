//! `bench-machines`: the machines view's exec-class cycle (issue 20), through the Rust SDK
//! (`kruntimes_client::machines`), against a `kruntimes up` it starts (release build, the
//! default sandbox unless `--server-args` says otherwise).
//!
//! On a Runtime of `--workers` workers (default 4) of `--runs` slots each (default 8):
//! - **cycle**: `--cycles` (default 30, after 5 unmeasured) one at a time: `claim` (the
//!   session Run created and Ready), `write` (a 1 KiB file in the workspace: one operation;
//!   a nested path costs one more, which makes its directories), `exec`
//!   (`true`, argv), `release` (termination Immediate and the delete, not waited for);
//!   each verb's time and the whole cycle's.
//! - **throughput**: `--concurrent-cycles` (default 64) cycles, `--concurrency` (default 16)
//!   at a time: cycles per second.
//! - **checkpoint and fork**: a sandbox with a 1 MiB file in its workspace; `--checkpoints`
//!   (default 20, after 2 unmeasured) times: a checkpoint (the Snapshot created → Ready,
//!   through `Sandbox::checkpoint`), then a fork of it (the session Run created → Ready with
//!   the checkpoint's files restored, `AcquireOptions::from_snapshot`), released after.
//!
//! Prints one JSON object: milliseconds at p50, p95, p99 and max of each verb and of the
//! cycle, and cycles/s.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use clap::Parser;
use futures::StreamExt;
use kruntimes_bench::{create_runtime, percentiles};
use kruntimes_client::Connection;
use kruntimes_client::machines::{Class, ExecRequest, Machines, Spec};
use kruntimes_testkit::{Options, Server};
use serde_json::json;

/// The Runtime the machines come from.
const RUNTIME: &str = "bench-machines";
/// Unmeasured cycles first (connections, caches).
const WARMUP: usize = 5;

#[derive(Parser, Debug)]
#[command(
    name = "bench-machines",
    about = "The machines view: claim → write → exec(true) → release"
)]
struct Args {
    /// Cycles one at a time.
    #[arg(long, default_value_t = 30)]
    cycles: usize,
    /// Cycles measured for throughput.
    #[arg(long, default_value_t = 64)]
    concurrent_cycles: usize,
    /// Cycles in flight at once for throughput.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Checkpoints of a 1 MiB workspace, each forked once.
    #[arg(long, default_value_t = 20)]
    checkpoints: usize,
    /// Workers of the Runtime.
    #[arg(long, default_value_t = 4)]
    workers: i32,
    /// Run slots per worker.
    #[arg(long, default_value_t = 8)]
    runs: i32,
    /// The data directory of `kruntimes up` (kept; default a temporary one).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Extra arguments of `kruntimes up`.
    #[arg(long, allow_hyphen_values = true, num_args = 0..)]
    server_args: Vec<String>,
}

/// The times of one cycle's verbs and of the whole.
struct Cycle {
    claim: Duration,
    write: Duration,
    exec: Duration,
    release: Duration,
    total: Duration,
}

async fn cycle(machines: &Machines, spec: &Spec) -> Result<Cycle> {
    let started = Instant::now();
    let lease = machines.claim(spec).await?;
    let claimed = Instant::now();
    machines.write(&lease, "data.bin", &[b'x'; 1024]).await?;
    let written = Instant::now();
    let result = machines.exec(&lease, &ExecRequest::argv(["true"])).await?;
    let ran = Instant::now();
    ensure!(result.exit_code == 0, "`true` exited {}", result.exit_code);
    machines.release(&lease).await?;
    let released = Instant::now();
    Ok(Cycle {
        claim: claimed - started,
        write: written - claimed,
        exec: ran - written,
        release: released - ran,
        total: released - started,
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (server, runtime) = kruntimes_bench::start(Options {
        data_dir: args.data_dir.clone(),
        extra_args: args.server_args.clone(),
        full: true,
        ..Options::default()
    })?;
    let report = runtime.block_on(run(&server, &args))?;
    kruntimes_bench::print(&report)?;
    drop(server);
    runtime.shutdown_timeout(Duration::from_secs(5));
    Ok(())
}

async fn run(server: &Server, args: &Args) -> Result<serde_json::Value> {
    let client = server.client().await?;
    create_runtime(&client, RUNTIME, "bash", args.workers, args.runs, &[]).await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let machines = Arc::new(Machines::new(connection.clone(), RUNTIME));
    let spec = Arc::new(Spec::new("default", Class::Exec, "bench"));

    let (mut claim, mut write, mut exec, mut release, mut total) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..WARMUP + args.cycles {
        let c = cycle(&machines, &spec).await?;
        if i >= WARMUP {
            claim.push(c.claim);
            write.push(c.write);
            exec.push(c.exec);
            release.push(c.release);
            total.push(c.total);
        }
    }

    let started = Instant::now();
    let mut concurrent: Vec<Duration> = futures::stream::iter(0..args.concurrent_cycles)
        .map(|_| {
            let (machines, spec) = (machines.clone(), spec.clone());
            async move { cycle(&machines, &spec).await.map(|c| c.total) }
        })
        .buffer_unordered(args.concurrency.max(1))
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_>>()?;
    let elapsed = started.elapsed();

    let (mut checkpoint, mut fork) = checkpoints_and_forks(&connection, args.checkpoints).await?;

    Ok(json!({
        "benchmark": "machines",
        "server_args": args.server_args,
        "workers": args.workers,
        "runs_per_worker": args.runs,
        "cycles": args.cycles,
        "claim_ms": percentiles(&mut claim),
        "write_ms": percentiles(&mut write),
        "exec_true_ms": percentiles(&mut exec),
        "release_ms": percentiles(&mut release),
        "cycle_ms": percentiles(&mut total),
        "checkpoint_1mib_ms": percentiles(&mut checkpoint),
        "fork_1mib_ready_ms": percentiles(&mut fork),
        "concurrent": {
            "cycles": args.concurrent_cycles,
            "concurrency": args.concurrency,
            "cycle_ms": percentiles(&mut concurrent),
            "cycles_per_second": args.concurrent_cycles as f64 / elapsed.as_secs_f64(),
        },
    }))
}

/// Checkpoint and fork times of a sandbox with a 1 MiB workspace (see the module docs).
async fn checkpoints_and_forks(
    connection: &Connection,
    count: usize,
) -> Result<(Vec<Duration>, Vec<Duration>)> {
    use kruntimes_api::snapshot::ObjectReference;
    use kruntimes_client::sandbox::AcquireOptions;
    use kruntimes_client::session::{Command, Operation, OperationState};
    let pool = connection.runtime(RUNTIME);
    let source = pool.acquire_sandbox(&AcquireOptions::default()).await?;
    let made = source
        .execute(&Operation::command(Command::shell(
            "head -c 1048576 /dev/urandom > blob.bin",
        )))
        .await?;
    ensure!(made.state == OperationState::Succeeded, "{made:?}");
    let (mut checkpoints, mut forks) = (Vec::new(), Vec::new());
    for i in 0..2 + count {
        let name = format!("bench-cp-{i}");
        let started = Instant::now();
        let snapshot = source.checkpoint(&name, Duration::from_secs(60)).await?;
        let taken = started.elapsed();
        let started = Instant::now();
        let forked = pool
            .acquire_sandbox(&AcquireOptions {
                from_snapshot: Some(ObjectReference {
                    name: name.clone(),
                    uid: kube::ResourceExt::uid(&snapshot),
                }),
                ..AcquireOptions::default()
            })
            .await?;
        let ready = started.elapsed();
        forked.end_and_delete().await?;
        if i >= 2 {
            checkpoints.push(taken);
            forks.push(ready);
        }
    }
    source.end_and_delete().await?;
    Ok((checkpoints, forks))
}
