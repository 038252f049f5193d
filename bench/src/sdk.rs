//! `bench-sdk`: the Rust SDK's (`kruntimes-client`) side of the SDK comparison, against a
//! `kruntimes up` that is already running (`--kubeconfig`). `bench/python/bench_sdk.py`
//! starts the server, runs this binary and the same measurements with the Python SDK in
//! the same run, and prints both side by side.
//!
//! Measurements (after 20 unmeasured warm-up calls each, except acquire):
//! - **acquire**: `--acquires` (default 20) sandboxes on Runtime `bash`, one at a time:
//!   `acquire_sandbox` until it returns (created and Ready); each released (Immediate,
//!   not timed) before the next.
//! - **exec**: `--execs` (default 500) commands `true` (argv) on one session, one at a
//!   time: `Session::exec` until its completed event.
//! - **invoke**: `--invokes` (default 1000) warm invocations of one python function
//!   (`def handle(event): return event`), one at a time: `Functions::invoke` until the
//!   answer.
//!
//! Prints one JSON object: milliseconds at p50, p95, p99 and max (and with `--samples`
//! every sample in microseconds).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use clap::Parser;
use kruntimes_api::Run;
use kruntimes_bench::percentiles;
use kruntimes_client::sandbox::{AcquireOptions, ReleaseOptions};
use kruntimes_client::session::{Command, OperationState};
use kruntimes_client::{Connection, FunctionSpec, Outcome};
use kube::api::{Api, DeleteParams};
use serde_json::json;

const WARMUP: usize = 20;

#[derive(Parser, Debug)]
#[command(
    name = "bench-sdk",
    about = "The Rust SDK: acquire, exec of true, warm invoke"
)]
struct Args {
    /// The kubeconfig of the running `kruntimes up`.
    #[arg(long)]
    kubeconfig: PathBuf,
    /// Sandboxes acquired one at a time.
    #[arg(long, default_value_t = 20)]
    acquires: usize,
    /// Commands `true` on one session.
    #[arg(long, default_value_t = 500)]
    execs: usize,
    /// Warm invocations of one function.
    #[arg(long, default_value_t = 1000)]
    invokes: usize,
    /// The function's name.
    #[arg(long, default_value = "bench-sdk-rust")]
    function: String,
    /// Also print every sample, in microseconds (`samples_us`), for pooling across runs.
    #[arg(long)]
    samples: bool,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let connection = Connection::from_paths(std::slice::from_ref(&args.kubeconfig)).await?;
    let runtime = connection.runtime("bash");
    let immediate = ReleaseOptions {
        immediate: true,
        ..ReleaseOptions::default()
    };

    let mut acquire = Vec::with_capacity(args.acquires);
    for _ in 0..args.acquires {
        let started = Instant::now();
        let sandbox = runtime.acquire_sandbox(&AcquireOptions::default()).await?;
        acquire.push(started.elapsed());
        sandbox.release(immediate).await?;
    }

    let sandbox = runtime.acquire_sandbox(&AcquireOptions::default()).await?;
    let mut session = sandbox.open_session().await?;
    let mut exec = Vec::with_capacity(args.execs);
    for i in 0..args.execs + WARMUP {
        let started = Instant::now();
        let done = session.exec(Command::argv(["true"]), |_, _| {}).await?;
        let elapsed = started.elapsed();
        ensure!(
            done.state == OperationState::Succeeded,
            "`true` did not succeed: {done:?}"
        );
        if i >= WARMUP {
            exec.push(elapsed);
        }
    }
    session.close().await;
    sandbox.release(immediate).await?;

    let functions = connection.functions();
    let spec = FunctionSpec::new(
        &args.function,
        "python",
        "main:handle",
        "def handle(event):\n    return event\n",
    );
    functions.create(&spec).await?;
    let run = functions
        .wait_ready(&args.function, Duration::from_secs(120))
        .await?;
    let mut invoke = Vec::with_capacity(args.invokes);
    for i in 0..args.invokes + WARMUP {
        let payload = json!({"n": i});
        let started = Instant::now();
        let answer = functions.invoke(&run, &payload, None).await?;
        let elapsed = started.elapsed();
        ensure!(
            answer.outcome == Outcome::Succeeded && answer.result == payload,
            "the invocation did not echo its payload: {:?}",
            answer.outcome
        );
        if i >= WARMUP {
            invoke.push(elapsed);
        }
    }
    Api::<Run>::namespaced(connection.client().clone(), connection.namespace())
        .delete(&args.function, &DeleteParams::default())
        .await?;

    let micros = |v: &[Duration]| v.iter().map(|d| d.as_micros() as u64).collect::<Vec<_>>();
    let samples = args.samples.then(
        || json!({"acquire": micros(&acquire), "exec": micros(&exec), "invoke": micros(&invoke)}),
    );
    let mut report = json!({
        "sdk": "rust",
        "acquire_ms": percentiles(&mut acquire),
        "exec_true_ms": percentiles(&mut exec),
        "invoke_ms": percentiles(&mut invoke),
        "acquires": args.acquires,
        "execs": args.execs,
        "invokes": args.invokes,
    });
    if let Some(samples) = samples {
        report["samples_us"] = samples;
    }
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
