//! `bench-idle-sockets`: what idle session WebSockets cost the gateway in memory (issue 14
//! item 9), on a real `kruntimes up` (the gateway runs in its process).
//!
//! Acquires one sandbox of the default `bash` Runtime, then reads the server process's
//! resident set (`VmRSS` of `/proc/<pid>/status`) three times: before any socket is open,
//! with `--sockets` (default 1024, the gateway's default limit) idle sockets of that
//! sandbox open through the SDK, and after they are closed and the gateway's
//! `kruntimes_gateway_session_connections` gauge is back to 0, and once more five seconds
//! later.
//!
//! Prints one JSON object on stdout. Build first, in one profile:
//! `cargo build --release -p kruntimes -p kruntimes-runtime-server -p kruntimes-bench &&
//! ./target/release/bench-idle-sockets`.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use kruntimes_client::Connection;
use kruntimes_client::sandbox::{AcquireOptions, ReleaseOptions};
use kruntimes_testkit::{Options, Server};
use serde_json::json;

#[derive(Parser, Debug)]
#[command(
    name = "bench-idle-sockets",
    about = "The gateway's memory with N idle session WebSockets open, and after they close"
)]
struct Args {
    /// Idle sockets to open (at most the gateway's --max-session-connections).
    #[arg(long, default_value_t = 1024)]
    sockets: usize,
    /// Extra arguments for `kruntimes up`.
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    server_args: Vec<String>,
}

/// How long after the sockets closed the resident set is read again.
const SETTLE: Duration = Duration::from_secs(5);
/// How long the sockets may take to be gone from the gateway's gauge.
const CLOSE_DEADLINE: Duration = Duration::from_secs(60);

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

/// The resident set of process `pid`, in KiB.
fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("read /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS line")
}

/// The gateway's open session sockets, from its metrics.
async fn open_sockets(gateway: &kube::Client) -> Result<f64> {
    let text = gateway
        .request_text(http::Request::get("/metrics").body(Vec::new())?)
        .await?;
    text.lines()
        .find_map(|line| line.strip_prefix("kruntimes_gateway_session_connections "))
        .and_then(|value| value.trim().parse().ok())
        .context("no kruntimes_gateway_session_connections sample")
}

/// Waits until the gateway holds no session socket.
async fn wait_closed(gateway: &kube::Client) -> Result<()> {
    let deadline = Instant::now() + CLOSE_DEADLINE;
    while open_sockets(gateway).await? != 0.0 {
        if Instant::now() > deadline {
            bail!("the gateway still holds sockets {CLOSE_DEADLINE:?} after they closed");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

async fn run(server: &Server, args: &Args) -> Result<serde_json::Value> {
    let pid = server.pid().context("the server's pid")?;
    let gateway = {
        let url = server.gateway_url().context("the gateway's URL")?;
        let mut config = kube::Config::new(url.parse().context("the gateway's URL")?);
        let ca = std::fs::read(server.data_dir().join("components/gateway-ca.crt"))
            .context("read the gateway's CA")?;
        config.root_cert = Some(
            kruntimes_client::pem_certificates(&ca)
                .map_err(|e| anyhow::anyhow!("the gateway's CA: {e}"))?,
        );
        kube::Client::try_from(config)?
    };
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection
        .runtime("bash")
        .acquire_sandbox(&AcquireOptions::default())
        .await?;
    // One socket opened and closed first, so that what every socket shares (the Runtime's
    // cache, the worker's channel, the authorization) is in place before the baseline.
    sandbox.open_session().await?.close().await;
    wait_closed(&gateway).await?;
    let before = rss_kib(pid)?;
    let started = Instant::now();
    let mut sessions = Vec::with_capacity(args.sockets);
    for _ in 0..args.sockets {
        sessions.push(sandbox.open_session().await?);
    }
    let opened = started.elapsed();
    let open = open_sockets(&gateway).await?;
    if open as usize != args.sockets {
        bail!("the gateway holds {open} sockets, not {}", args.sockets);
    }
    let during = rss_kib(pid)?;
    for session in sessions {
        session.close().await;
    }
    wait_closed(&gateway).await?;
    let after = rss_kib(pid)?;
    // The allocator hands freed pages back to the kernel a little later, not at the free.
    tokio::time::sleep(SETTLE).await;
    let settled = rss_kib(pid)?;
    sandbox
        .release(ReleaseOptions {
            immediate: true,
            ..ReleaseOptions::default()
        })
        .await?;
    let per_socket = (during.saturating_sub(before)) as f64 / args.sockets.max(1) as f64;
    Ok(json!({
        "sockets": args.sockets,
        "open_ms": opened.as_millis(),
        "rss_before_mib": before as f64 / 1024.0,
        "rss_during_mib": during as f64 / 1024.0,
        "rss_after_mib": after as f64 / 1024.0,
        "rss_settled_mib": settled as f64 / 1024.0,
        "settle_ms": SETTLE.as_millis(),
        "per_socket_kib": per_socket,
    }))
}
