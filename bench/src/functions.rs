//! `bench-functions`: function Runs end to end on a real `kruntimes up` (API server,
//! controller-manager, local workers with runtimed and a python runtime server, the HTTPS
//! gateway).
//!
//! Three measurements:
//! - **registration**: `--registrations` function Runs (default 30), one at a time. For each,
//!   the client notes the time just before its create request and its watch sees the Run
//!   Ready: create → Ready as observed by the client. From the status (microsecond RFC 3339)
//!   also: schedule = Scheduled − create, claim = startTime − Scheduled, register = the Ready
//!   condition's lastTransitionTime − startTime (RegisterFunction: the interpreter starts and
//!   imports the handler, then the Ready write).
//! - **warm invoke**: `--invokes` (default 2000) invocations of one Ready function, one at a
//!   time, through the gateway over HTTPS (one kept-alive connection, TLS verified with the
//!   Run's CA bundle), against the same handler called in-process by `/usr/bin/python3`
//!   with the same JSON decoding of the request and encoding of the result. Overhead =
//!   gateway − in-process, at each percentile.
//! - **throughput**: `--functions` (default 64) Ready functions, each invoked by its own
//!   client task in a loop (`--concurrency` tasks, default 64, spread over the functions) for
//!   `--seconds` (default 5): invocations per second. Every answer must be 200 Succeeded.
//! - **the Functions Framework** (`--functions-framework`): the same handler served by
//!   Google's Functions Framework for Python (plain HTTP, one hop; see
//!   [`kruntimes_bench::functions_framework`]), measured the same two ways in the same run:
//!   warm invokes one at a time, and invokes/s with `--concurrency` clients. The report's
//!   `versus_functions_framework` gives kruntimes' warm overhead p50 over the framework's
//!   p50, and kruntimes' invokes/s over the framework's.
//!
//! Prints one JSON object on stdout. Build first, in one profile:
//! `cargo build --release -p kruntimes -p kruntimes-runtime-server -p kruntimes-bench &&
//! ./target/release/bench-functions`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use futures::future::BoxFuture;
use k8s_openapi::jiff::Timestamp;
use kruntimes_api::run::{FunctionMode, RunMode, RunSource};
use kruntimes_api::{Phase, Run, RunSpec};
use kruntimes_bench::{Settled, create_runtime, create_settled, percentiles, ready_breakdown};
use kruntimes_testkit::{Options, Server};
use kube::Client;
use kube::api::{Api, DeleteParams};
use serde_json::json;

/// The handler every function runs: it echoes the request.
const HANDLER: &str = "def handle(event):\n    return event\n";

#[derive(Parser, Debug)]
#[command(
    name = "bench-functions",
    about = "Function Runs end to end: registration, warm invoke overhead, invokes/s"
)]
struct Args {
    /// Registrations measured, one at a time.
    #[arg(long, default_value_t = 30)]
    registrations: usize,
    /// Warm invocations measured, one at a time.
    #[arg(long, default_value_t = 2000)]
    invokes: usize,
    /// Functions in the throughput measurement (0 skips it).
    #[arg(long, default_value_t = 64)]
    functions: usize,
    /// `mode.function.concurrency` of each function in the throughput measurement: that
    /// many client tasks may share one function (each takes that many run slots).
    #[arg(long, default_value_t = 1)]
    function_concurrency: i32,
    /// Client tasks in the throughput measurement.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// How long the throughput measurement runs.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Workers of the benchmark's Runtime.
    #[arg(long, default_value_t = 2)]
    workers: i32,
    /// Run slots per worker.
    #[arg(long, default_value_t = 48)]
    runs_per_worker: i32,
    /// Extra arguments for the benchmark Runtime's runtime servers.
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    worker_args: Vec<String>,
    /// Extra arguments for `kruntimes up`.
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    server_args: Vec<String>,
    /// Also measure Google's Functions Framework for Python in the same run.
    #[arg(long)]
    functions_framework: bool,
    /// The virtualenv holding the Functions Framework (made with pip on first use).
    #[arg(long, default_value = "target/functions-framework-venv")]
    functions_framework_venv: std::path::PathBuf,
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(args.concurrency >= 1, "concurrency ≥ 1");
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

const RUNTIME: &str = "fnbench";

async fn run(server: &Server, args: &Args) -> Result<serde_json::Value> {
    let client = server.client().await?;
    create_runtime(
        &client,
        RUNTIME,
        "python",
        args.workers,
        args.runs_per_worker,
        &args.worker_args,
    )
    .await?;
    let settled = Settled::start(client.clone(), |run| {
        run.phase() == Phase::Ready || run.phase().is_terminal()
    });
    let token = kruntimes_testkit::admin_token(&server.kubeconfig_path())?;

    // Warm-up: connections, workers, caches, the interpreter's files in the page cache.
    registrations(&client, &settled, "warm", 3).await?;
    let registration = registrations(&client, &settled, "reg", args.registrations).await?;

    let hot = register(&client, &settled, "hot", None).await?;
    let hot = Invoker::new(&hot, &token)?;
    for i in 0..50 {
        hot.invoke(&json!({"n": i})).await?;
    }
    let mut through_gateway = Vec::with_capacity(args.invokes);
    for i in 0..args.invokes {
        let started = Instant::now();
        hot.invoke(&json!({"n": i})).await?;
        through_gateway.push(started.elapsed());
    }
    let mut in_process = in_process(args.invokes)?;
    let gateway = percentiles(&mut through_gateway);
    let local = percentiles(&mut in_process);
    let overhead =
        |p: &str| gateway[p].as_f64().unwrap_or_default() - local[p].as_f64().unwrap_or_default();
    let warm = json!({
        "invokes": args.invokes,
        "gateway_ms": gateway,
        "in_process_ms": local,
        "overhead_ms": {"p50": overhead("p50"), "p95": overhead("p95"), "p99": overhead("p99")},
    });

    let throughput = if args.functions > 0 {
        Some(throughput(&client, &settled, &token, args).await?)
    } else {
        None
    };
    let reference = if args.functions_framework {
        Some(functions_framework(args).await?)
    } else {
        None
    };
    let versus = reference.as_ref().map(|reference| {
        let ratio = |ours: Option<f64>, theirs: Option<f64>| match (ours, theirs) {
            (Some(ours), Some(theirs)) if theirs > 0.0 => json!(ours / theirs),
            _ => serde_json::Value::Null,
        };
        json!({
            "warm_overhead_p50_over_its_p50": ratio(
                warm["overhead_ms"]["p50"].as_f64(),
                reference["warm_invoke_ms"]["p50"].as_f64(),
            ),
            "warm_gateway_p50_over_its_p50": ratio(
                warm["gateway_ms"]["p50"].as_f64(),
                reference["warm_invoke_ms"]["p50"].as_f64(),
            ),
            "invokes_per_second_over_its": ratio(
                throughput.as_ref().and_then(|t| t["invokes_per_second"].as_f64()),
                reference["invokes_per_second"].as_f64(),
            ),
        })
    });
    Ok(json!({
        "benchmark": "functions",
        "handler": "python: def handle(event): return event",
        "workers": args.workers,
        "runs_per_worker": args.runs_per_worker,
        "server_args": args.server_args,
        "worker_args": args.worker_args,
        "registration": registration,
        "warm_invoke": warm,
        "throughput": throughput,
        "functions_framework": reference,
        "versus_functions_framework": versus,
    }))
}

/// The Functions Framework's figures: `args.invokes` warm invokes one at a time, then
/// `args.concurrency` clients (a connection each) for `args.seconds`.
async fn functions_framework(args: &Args) -> Result<serde_json::Value> {
    use kruntimes_bench::functions_framework as ff;
    let framework = ff::start(&args.functions_framework_venv).await?;
    let client = ff::Client::new(&framework.url)?;
    for i in 0..50 {
        client.invoke(&json!({"n": i})).await?;
    }
    let mut warm = Vec::with_capacity(args.invokes);
    for i in 0..args.invokes {
        let started = Instant::now();
        client.invoke(&json!({"n": i})).await?;
        warm.push(started.elapsed());
    }
    let clients = (0..args.concurrency)
        .map(|_| ff::Client::new(&framework.url))
        .collect::<Result<Vec<_>>>()?;
    let (total, elapsed) = drive(clients, args.seconds).await?;
    drop(framework);
    Ok(json!({
        "version": ff::VERSION,
        "server": "functions-framework (gunicorn), plain HTTP on loopback",
        "warm_invoke_ms": percentiles(&mut warm),
        "concurrency": args.concurrency,
        "invokes_per_second": total as f64 / elapsed.as_secs_f64(),
    }))
}

fn spec(concurrency: Option<i32>) -> RunSpec {
    let mut spec = RunSpec::task(RUNTIME, "unused");
    spec.mode = RunMode {
        function: Some(FunctionMode {
            handler: "main:handle".into(),
            idle_timeout_seconds: None,
            concurrency,
        }),
        ..RunMode::default()
    };
    spec.source = Some(RunSource {
        inline: Some(HANDLER.into()),
        snapshot: None,
    });
    spec
}

/// Creates the function `name` and waits until it is Ready; the Run, when the client sent
/// its create, and create → Ready as the client saw it.
async fn create_ready(
    client: &Client,
    settled: &Settled,
    name: &str,
    concurrency: Option<i32>,
) -> Result<(Run, Timestamp, Duration)> {
    let (run, created, seen) =
        create_settled(client, settled, Run::new(name, spec(concurrency))).await?;
    if run.phase() != Phase::Ready {
        let status = run.status.unwrap_or_default();
        bail!(
            "function {name} ended {:?}: {:?} {:?}",
            status.phase,
            status.reason,
            status.message
        );
    }
    Ok((run, created, seen))
}

async fn register(
    client: &Client,
    settled: &Settled,
    name: &str,
    concurrency: Option<i32>,
) -> Result<Run> {
    Ok(create_ready(client, settled, name, concurrency).await?.0)
}

/// Registers `count` functions one at a time; deletes them afterwards.
async fn registrations(
    client: &Client,
    settled: &Settled,
    prefix: &str,
    count: usize,
) -> Result<serde_json::Value> {
    let (mut observed, mut schedule, mut claim, mut register) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let api = Api::<Run>::namespaced(client.clone(), "default");
    for i in 0..count {
        let name = format!("{prefix}-{i:04}");
        let (run, created, seen) = create_ready(client, settled, &name, None).await?;
        let [scheduling, claiming, registering] = ready_breakdown(&run, created)?;
        observed.push(seen);
        schedule.push(scheduling);
        claim.push(claiming);
        register.push(registering);
        api.delete(&name, &DeleteParams::default())
            .await
            .with_context(|| format!("delete {name}"))?;
    }
    Ok(json!({
        "functions": count,
        "create_to_ready_ms": percentiles(&mut observed),
        "schedule_ms": percentiles(&mut schedule),
        "claim_ms": percentiles(&mut claim),
        "register_ms": percentiles(&mut register),
    }))
}

/// A client of one function's endpoint: one kept-alive HTTPS connection, TLS verified with
/// the Run's CA bundle, never retrying.
#[derive(Clone)]
struct Invoker {
    client: Client,
    path: String,
}

impl Invoker {
    fn new(run: &Run, token: &str) -> Result<Invoker> {
        let endpoint = run
            .status
            .as_ref()
            .and_then(|s| s.endpoint.clone())
            .context("a Ready function has an endpoint")?;
        let uri: http::Uri = endpoint.url.parse()?;
        let authority = uri.authority().context("endpoint authority")?;
        let mut config = kube::Config::new(format!("https://{authority}").parse()?);
        let pem = endpoint.ca_bundle.context("no CA bundle")?;
        config.root_cert = Some(
            kruntimes_client::pem_certificates(&pem.0)
                .map_err(|e| anyhow::anyhow!("the CA bundle: {e}"))?,
        );
        config.auth_info.token = Some(token.to_string().into());
        config.default_retry = false;
        Ok(Invoker {
            client: Client::try_from(config)?,
            path: uri.path().to_string(),
        })
    }

    /// Invokes once; fails unless the answer is 200 and Succeeded.
    async fn invoke(&self, event: &serde_json::Value) -> Result<()> {
        let answer =
            kruntimes_bench::functions_framework::post_json(&self.client, &self.path, event)
                .await?;
        ensure!(
            answer["outcome"] == "Succeeded",
            "invocation did not succeed: {answer}"
        );
        Ok(())
    }
}

/// The same handler called in-process by `/usr/bin/python3`, with the request decoded from
/// JSON and the result encoded to JSON as the runtime server's launcher does.
fn in_process(count: usize) -> Result<Vec<Duration>> {
    let script = format!(
        "import json, time\n{HANDLER}\nout = []\nfor i in range({count} + 50):\n    \
         raw = json.dumps({{'n': i}})\n    t = time.perf_counter_ns()\n    \
         json.dumps(handle(json.loads(raw)))\n    out.append(time.perf_counter_ns() - t)\n\
         print(' '.join(str(x) for x in out[50:]))\n"
    );
    let output = std::process::Command::new("/usr/bin/python3")
        .args(["-I", "-c", &script])
        .output()
        .context("run /usr/bin/python3")?;
    ensure!(
        output.status.success(),
        "python3 failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .map(|ns| Ok(Duration::from_nanos(ns.parse()?)))
        .collect()
}

/// `args.functions` functions, `args.concurrency` client tasks invoking them in a loop.
async fn throughput(
    client: &Client,
    settled: &Settled,
    token: &str,
    args: &Args,
) -> Result<serde_json::Value> {
    let per_function = usize::try_from(args.function_concurrency.max(1))?;
    let concurrency = (per_function > 1).then_some(args.function_concurrency);
    let mut invokers = Vec::with_capacity(args.functions * per_function);
    for i in 0..args.functions {
        let run = register(client, settled, &format!("thr-{i:04}"), concurrency).await?;
        for _ in 0..per_function {
            invokers.push(Invoker::new(&run, token)?);
        }
    }
    // At most as many tasks per function as it runs at once, so that none is refused (429).
    let tasks = args.concurrency.min(invokers.len());
    invokers.truncate(tasks);
    let (total, elapsed) = drive(invokers, args.seconds).await?;
    Ok(json!({
        "functions": args.functions,
        "function_concurrency": per_function,
        "concurrency": tasks,
        "seconds": elapsed.as_secs_f64(),
        "invocations": total,
        "invokes_per_second": total as f64 / elapsed.as_secs_f64(),
    }))
}

/// Something `drive` invokes: a function's endpoint, or the Functions Framework.
trait Invoke: Send + Sync + 'static {
    fn call<'a>(&'a self, event: &'a serde_json::Value) -> BoxFuture<'a, Result<()>>;
}

impl Invoke for Invoker {
    fn call<'a>(&'a self, event: &'a serde_json::Value) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.invoke(event))
    }
}

impl Invoke for kruntimes_bench::functions_framework::Client {
    fn call<'a>(&'a self, event: &'a serde_json::Value) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.invoke(event))
    }
}

/// A client task per invoker, each invoking in a loop for `seconds`: how many invocations
/// succeeded, and in how long. Any failure fails the measurement.
async fn drive<I: Invoke>(invokers: Vec<I>, seconds: u64) -> Result<(u64, Duration)> {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut set = tokio::task::JoinSet::new();
    let started = Instant::now();
    for (i, invoker) in invokers.into_iter().enumerate() {
        let (done, stop) = (done.clone(), stop.clone());
        set.spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                invoker.call(&json!({"task": i, "n": n})).await?;
                n += 1;
                done.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(())
        });
    }
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    while let Some(joined) = set.join_next().await {
        joined.context("join a client task")??;
    }
    Ok((done.load(Ordering::Relaxed), started.elapsed()))
}
