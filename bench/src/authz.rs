//! `bench-authz`: the gateway authorizer's cost per call, on a cache hit and on a miss,
//! against a real `kruntimes up` (started through the testkit in a temporary data directory,
//! on an ephemeral port).
//!
//! Setup, as admin with kube-rs: a namespace, a ServiceAccount, a Role allowing `get` on
//! `runs.kruntimes.io` bound to it, one Run and a ten-minute ServiceAccount token.
//!
//! - `hit`: an authorizer with the default cache (30 s, 1024 entries), warmed with one call;
//!   each sample is one `authorize` call answered from the cache.
//! - `miss`: an authorizer with the cache disabled (capacity 0); each sample is one
//!   `authorize` call, that is a TokenReview and a SubjectAccessReview over HTTPS.
//!
//! Calls are sequential. Percentiles are in microseconds (fractional for hits). It prints one
//! JSON object on stdout. Build the server binary first, in the same profile:
//! `cargo build --release -p kruntimes -p kruntimes-bench && ./target/release/bench-authz`.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Parser;
use kruntimes_api::{Run, RunSpec};
use kruntimes_gateway::{Authorizer, AuthorizerConfig};
use kruntimes_testkit::{Options, Server, setup};
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const NS: &str = "bench-authz";
const SA: &str = "agent";
const RUN: &str = "bench-run";

#[derive(Parser, Debug)]
#[command(
    name = "bench-authz",
    about = "Cost per call of the gateway authorizer on a cache hit and on a miss"
)]
struct Args {
    /// Calls measured on a cache hit.
    #[arg(long, default_value_t = 100_000)]
    hits: usize,
    /// Calls measured with the cache disabled.
    #[arg(long, default_value_t = 2000)]
    misses: usize,
    /// Unmeasured calls before each measurement.
    #[arg(long, default_value_t = 100)]
    warmup: usize,
    /// Extra arguments for `kruntimes up`, e.g. `--durability=full`.
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    server_args: Vec<String>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        args.hits >= 1 && args.misses >= 1,
        "--hits and --misses must be at least 1"
    );
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
    let admin = server.client().await?;
    let (token, uid) = setup(&admin).await?;

    let cached = Authorizer::new(admin.clone(), AuthorizerConfig::default());
    let hit = measure(&cached, &token, &uid, args.warmup.max(1), args.hits).await?;
    let stats = cached.stats();
    ensure!(
        stats.misses == 1 && stats.hits as usize == args.warmup.max(1) - 1 + args.hits,
        "every measured call must be a cache hit: {stats:?}"
    );

    let uncached = Authorizer::new(
        admin.clone(),
        AuthorizerConfig {
            capacity: 0,
            ..AuthorizerConfig::default()
        },
    );
    let miss = measure(&uncached, &token, &uid, args.warmup, args.misses).await?;
    ensure!(uncached.stats().hits == 0, "the disabled cache hit");

    Ok(json!({
        "benchmark": "authz",
        "unit": "us",
        "cache": {
            "ttl_s": AuthorizerConfig::default().ttl.as_secs(),
            "capacity": AuthorizerConfig::default().capacity,
        },
        "hit": summary(hit),
        "miss": summary(miss),
    }))
}

/// Times `count` sequential calls after `warmup` unmeasured ones; every call must succeed.
async fn measure(
    authz: &Authorizer,
    token: &str,
    uid: &str,
    warmup: usize,
    count: usize,
) -> Result<Vec<Duration>> {
    for _ in 0..warmup {
        authz
            .authorize(token, NS, RUN, uid)
            .await
            .context("warm-up authorize")?;
    }
    let mut samples = Vec::with_capacity(count);
    for _ in 0..count {
        let started = Instant::now();
        let outcome = authz.authorize(token, NS, RUN, uid).await;
        samples.push(started.elapsed());
        outcome.context("authorize")?;
    }
    Ok(samples)
}

/// count, mean, p50, p90, p99 and max in microseconds, to 0.01 µs.
fn summary(mut samples: Vec<Duration>) -> serde_json::Value {
    let us = |d: Duration| (d.as_nanos() as f64 / 10.0).round() / 100.0;
    let total: Duration = samples.iter().sum();
    let count = samples.len();
    let percentile = kruntimes_bench::percentile_of(&mut samples);
    let at = |p: f64| us(percentile(p));
    json!({
        "count": count,
        "mean_us": us(total / count.max(1) as u32),
        "p50_us": at(50.0),
        "p90_us": at(90.0),
        "p99_us": at(99.0),
        "max_us": at(100.0),
    })
}

/// The namespace, ServiceAccount, Role, RoleBinding and Run; returns a token and the Run's UID.
async fn setup(admin: &Client) -> Result<(String, String)> {
    setup::namespace(admin, NS).await?;
    let rule = setup::kruntimes_rule(&["get"], &["runs"]);
    let token = setup::service_account_token(admin, NS, SA, vec![rule], 600).await?;
    let run = Api::<Run>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &Run::new(RUN, run_spec()))
        .await
        .context("create the Run")?;
    let uid = run.uid().context("a created Run has a UID")?;
    Ok((token, uid))
}

fn run_spec() -> RunSpec {
    RunSpec::task("python", "main.py")
}
