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
//! - **acquire beside live sandboxes** (issue 16): on a second Runtime whose workers share
//!   their slots (`--held-workers` × `--held-slots`, default 4 × 16), `--held` sessions
//!   (default 1, 8 and 32) are kept Ready while `--held-acquires` (default 30) more are
//!   acquired one at a time, each released before the next: create → Ready.
//! - **transfer** (issue 16): a `--transfer-mib` file (default 256) streamed up
//!   (`Sandbox::upload`, `PUT …/files/content`) and down (`Sandbox::download`) through the
//!   gateway with the Rust SDK, `--transfers` times (default 3); MiB/s of each, the download
//!   checked byte for byte against what was sent. The bytes are made and checked on the
//!   fly, so the figures hold no local disk.
//!
//! - **suspend and resume** (issue 19): on a Runtime of two one-slot workers, a sandbox
//!   holding a 1 MiB workspace of 100 files (and, with `--suspend-large-mib`, one of a
//!   100 MiB file of random bytes) is suspended and resumed `--suspends` times (default
//!   10): suspend = `spec.suspend: true` → Suspended as the SDK's watch sees it (accepted
//!   work finishes, the capture, the store, the slot released); resume = `spec.suspend:
//!   false` → Ready again, restored. Same-worker resumes restore from the worker's local
//!   copy; for other-worker resumes a filler sandbox first takes the worker that holds it,
//!   so the restore comes from the store. MiB/s = the workspace's bytes (the Snapshot's
//!   `sizeBytes`) / the suspend or resume time.
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
    /// Numbers of live sandboxes held open while acquires are measured (empty skips it).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 8, 32])]
    held: Vec<usize>,
    /// Acquires measured at each number of live sandboxes.
    #[arg(long, default_value_t = 30)]
    held_acquires: usize,
    /// Workers of the Runtime the live sandboxes share.
    #[arg(long, default_value_t = 4)]
    held_workers: i32,
    /// Slots of each of those workers (`runs`).
    #[arg(long, default_value_t = 16)]
    held_slots: i32,
    /// Size of the file streamed up and down, in MiB (0 skips it).
    #[arg(long, default_value_t = 256)]
    transfer_mib: u64,
    /// Uploads and downloads of that file measured.
    #[arg(long, default_value_t = 3)]
    transfers: usize,
    /// Suspend + resume cycles measured per workspace and kind of resume (0 skips them).
    #[arg(long, default_value_t = 10)]
    suspends: usize,
    /// Size of the large workspace suspended and resumed, in MiB (0 skips it).
    #[arg(long, default_value_t = 100)]
    suspend_large_mib: u64,
    /// Extra arguments for `kruntimes up`.
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    server_args: Vec<String>,
    /// Extra arguments for the benchmark Runtimes' runtime servers, e.g.
    /// `--sandbox-launcher=false`.
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    worker_args: Vec<String>,
    /// Keep the system's data directory here (its workers' logs, for a profile) instead of
    /// a temporary one; it must be empty or absent.
    #[arg(long)]
    data_dir: Option<std::path::PathBuf>,
}

const RUNTIME: &str = "sbbench";
/// The Runtime whose workers the live sandboxes share.
const HELD_RUNTIME: &str = "sbheld";
const MIB: u64 = 1024 * 1024;
/// The Runtime of the suspend and resume measurement: two one-slot workers.
const SUSPEND_RUNTIME: &str = "sbsusp";
/// The longest one suspend or resume may take in the benchmark.
const SUSPEND_LIMIT: Duration = Duration::from_secs(300);

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
    // Something of the SDK's connections kept a thread of the runtime busy once the
    // server was gone (seen once: the process spun at 100% CPU after printing); the
    // report is out, so the runtime gets a bounded time to stop.
    runtime.shutdown_timeout(Duration::from_secs(5));
    Ok(())
}

async fn run(server: &Server, args: &Args) -> Result<serde_json::Value> {
    let client = server.client().await?;
    create_runtime(&client, RUNTIME, "bash", args.workers, 1, &args.worker_args).await?;
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
    let beside_live = if args.held.is_empty() {
        None
    } else {
        Some(beside_live(&client, &settled, args).await?)
    };
    let transfer = if args.transfer_mib > 0 && args.transfers > 0 {
        Some(transfer(server, args).await?)
    } else {
        None
    };
    let suspend = if args.suspends > 0 {
        Some(suspend_resume(server, &client, args).await?)
    } else {
        None
    };
    Ok(json!({
        "benchmark": "sessions",
        "suspend_resume": suspend,
        "workers": args.workers,
        "server_args": args.server_args,
        "worker_args": args.worker_args,
        "acquire": acquire,
        "acquires_per_second": rate,
        "data_plane": data_plane,
        "acquire_beside_live": beside_live,
        "transfer": transfer,
    }))
}

/// Creates the session `name` and waits until it is Ready.
async fn acquire(
    client: &Client,
    settled: &Settled,
    name: &str,
) -> Result<(Run, k8s_openapi::jiff::Timestamp, Duration)> {
    acquire_on(client, settled, RUNTIME, name).await
}

/// [`acquire`] on the Runtime `runtime`.
async fn acquire_on(
    client: &Client,
    settled: &Settled,
    runtime: &str,
    name: &str,
) -> Result<(Run, k8s_openapi::jiff::Timestamp, Duration)> {
    // The Run the SDK's acquire_sandbox creates (with the registration finalizer in place).
    let run = AcquireOptions {
        name: Some(name.to_string()),
        ..AcquireOptions::default()
    }
    .to_run(runtime)?;
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
    released_but(client, 0).await
}

/// Waits until only `kept` Runs labelled `bench` are left (the sandboxes held open).
async fn released_but(client: &Client, kept: usize) -> Result<()> {
    let api = Api::<Run>::namespaced(client.clone(), "default");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = api
            .list(&kube::api::ListParams::default().labels("bench"))
            .await?
            .items
            .len();
        if left <= kept {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "{} released sessions are still there after 60 s",
            left - kept
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

/// Acquire latency while `args.held` sandboxes (in increasing numbers) stay Ready on a
/// Runtime whose workers they share: each step tops the live sandboxes up to its number at
/// once, then measures `args.held_acquires` acquires one at a time, each released before
/// the next.
async fn beside_live(client: &Client, settled: &Settled, args: &Args) -> Result<serde_json::Value> {
    let slots = i64::from(args.held_workers) * i64::from(args.held_slots);
    let most = args.held.iter().copied().max().unwrap_or_default();
    ensure!(
        i64::try_from(most)? < slots,
        "{most} live sandboxes and one more do not fit {} workers × {} slots",
        args.held_workers,
        args.held_slots
    );
    create_runtime(
        client,
        HELD_RUNTIME,
        "bash",
        args.held_workers,
        args.held_slots,
        &args.worker_args,
    )
    .await?;
    // Warm-up on the new workers.
    for i in 0..5 {
        let name = format!("held-warm-{i}");
        acquire_on(client, settled, HELD_RUNTIME, &name).await?;
        release(client, &name).await?;
        released_but(client, 0).await?;
    }
    let mut steps = args.held.clone();
    steps.sort_unstable();
    steps.dedup();
    let mut live: Vec<String> = Vec::new();
    let mut results = Vec::with_capacity(steps.len());
    for held in steps {
        let more: Vec<String> = (live.len()..held).map(|i| format!("live-{i:03}")).collect();
        try_join_all(
            more.iter()
                .map(|name| acquire_on(client, settled, HELD_RUNTIME, name)),
        )
        .await?;
        live.extend(more);
        let mut observed = Vec::with_capacity(args.held_acquires);
        for i in 0..args.held_acquires {
            let name = format!("beside-{held}-{i:03}");
            let (_, _, seen) = acquire_on(client, settled, HELD_RUNTIME, &name).await?;
            observed.push(seen);
            release(client, &name).await?;
            released_but(client, live.len()).await?;
        }
        results.push(json!({
            "live_sandboxes": held,
            "acquires": args.held_acquires,
            "create_to_ready_ms": percentiles(&mut observed),
        }));
    }
    for name in &live {
        release(client, name).await?;
    }
    all_released(client).await?;
    Ok(json!({
        "workers": args.held_workers,
        "slots_per_worker": args.held_slots,
        "steps": results,
    }))
}

/// The benchmark's bytes: `(offset % 251)`, so that a shifted or repeated chunk shows.
/// Made and checked by copying from and comparing with [`pattern_table`], so that even a
/// debug build spends its time on the transfer, not on the bytes.
const PERIOD: usize = 251;

/// About 1 MiB of the pattern from offset 0.
fn pattern_table() -> std::sync::Arc<[u8]> {
    (0..PERIOD * 4096).map(|i| (i % PERIOD) as u8).collect()
}

/// The pattern from `offset` on, at most `n` bytes of it (fewer when the table ends).
fn pattern_at(table: &[u8], offset: u64, n: usize) -> &[u8] {
    let start = usize::try_from(offset % PERIOD as u64).unwrap_or_default();
    &table[start..start + n.min(table.len() - PERIOD)]
}

/// An [`AsyncRead`](tokio::io::AsyncRead) of `len` pattern bytes, made as they are read.
struct Pattern {
    table: std::sync::Arc<[u8]>,
    offset: u64,
    len: u64,
}

impl tokio::io::AsyncRead for Pattern {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let left = usize::try_from(self.len - self.offset).unwrap_or(usize::MAX);
        let chunk = pattern_at(&self.table, self.offset, left.min(buf.remaining()));
        buf.put_slice(chunk);
        let n = chunk.len() as u64;
        self.offset += n;
        std::task::Poll::Ready(Ok(()))
    }
}

/// An [`AsyncWrite`](tokio::io::AsyncWrite) that checks what it is given against the
/// pattern.
struct Check {
    table: std::sync::Arc<[u8]>,
    offset: u64,
    first_mismatch: Option<u64>,
}

impl tokio::io::AsyncWrite for Check {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = &mut *self;
        let mut at = 0;
        while at < buf.len() && this.first_mismatch.is_none() {
            let offset = this.offset + at as u64;
            let expected = pattern_at(&this.table, offset, buf.len() - at);
            let got = &buf[at..at + expected.len()];
            if got != expected {
                let first = got.iter().zip(expected).take_while(|(g, e)| g == e).count();
                this.first_mismatch = Some(offset + first as u64);
            }
            at += expected.len();
        }
        this.offset += buf.len() as u64;
        std::task::Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// A large file streamed up and down through the gateway with the SDK: MiB/s of each.
async fn transfer(server: &Server, args: &Args) -> Result<serde_json::Value> {
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection
        .runtime(RUNTIME)
        .acquire_sandbox(&AcquireOptions::default())
        .await?;
    let len = args.transfer_mib * MIB;
    let mib = args.transfer_mib as f64;
    let table = pattern_table();
    let (mut up, mut down) = (Vec::new(), Vec::new());
    for _ in 0..args.transfers {
        let started = Instant::now();
        let uploaded = sandbox
            .upload(
                "big.bin",
                Pattern {
                    table: table.clone(),
                    offset: 0,
                    len,
                },
                Some(len),
                false,
            )
            .await?;
        up.push(mib / started.elapsed().as_secs_f64());
        ensure!(
            uploaded.size_bytes == len,
            "uploaded {} bytes of {len}",
            uploaded.size_bytes
        );
        let mut check = Check {
            table: table.clone(),
            offset: 0,
            first_mismatch: None,
        };
        let started = Instant::now();
        let got = sandbox.download("big.bin", &mut check).await?;
        down.push(mib / started.elapsed().as_secs_f64());
        ensure!(
            got == len && check.offset == len,
            "downloaded {got} bytes of {len}"
        );
        if let Some(at) = check.first_mismatch {
            bail!("the download differs from the upload at byte {at}");
        }
    }
    sandbox
        .release(ReleaseOptions {
            immediate: true,
            ..ReleaseOptions::default()
        })
        .await?;
    let summary = |rates: &mut Vec<f64>| {
        rates.sort_by(f64::total_cmp);
        json!({
            "median": rates.get(rates.len() / 2).copied().unwrap_or_default(),
            "all": rates,
        })
    };
    Ok(json!({
        "file_mib": args.transfer_mib,
        "transfers": args.transfers,
        "upload_mib_per_s": summary(&mut up),
        "download_mib_per_s": summary(&mut down),
    }))
}

/// Suspend and resume figures (see the module documentation).
async fn suspend_resume(
    server: &Server,
    client: &Client,
    args: &Args,
) -> Result<serde_json::Value> {
    create_runtime(client, SUSPEND_RUNTIME, "bash", 2, 1, &args.worker_args).await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let runtime = connection.runtime(SUSPEND_RUNTIME);
    let small = "for i in $(seq 1 100); do head -c 10485 /dev/urandom > f$i; done; ln -s f1 link";
    let mut workspaces = vec![("small_1mib_100_files", small.to_string())];
    if args.suspend_large_mib > 0 {
        workspaces.push((
            "large",
            format!(
                "head -c {} /dev/urandom > big.bin",
                args.suspend_large_mib * MIB
            ),
        ));
    }
    let mut report = serde_json::Map::new();
    for (label, setup) in workspaces {
        let sandbox = runtime.acquire_sandbox(&AcquireOptions::default()).await?;
        let mut session = sandbox.open_session().await?;
        let done = session.exec(Command::shell(setup), |_, _| {}).await?;
        ensure!(
            done.state == OperationState::Succeeded,
            "the workspace was not written: {done:?}"
        );
        session.close().await;
        let mut figures = serde_json::Map::new();
        let mut bytes = 0u64;
        for other_worker in [false, true] {
            let (mut suspends, mut resumes) = (Vec::new(), Vec::new());
            for _ in 0..args.suspends {
                let before = sandbox.run().await?;
                let held_by = before
                    .status
                    .as_ref()
                    .and_then(|s| s.assigned_pod.clone())
                    .unwrap_or_default();
                let started = Instant::now();
                sandbox.suspend().await?;
                let suspended = sandbox.wait_suspended(SUSPEND_LIMIT).await?;
                suspends.push(started.elapsed());
                ensure!(
                    suspended.phase() == Phase::Suspended,
                    "the sandbox did not suspend: {:?}",
                    suspended.status
                );
                bytes = snapshot_bytes(client, &suspended).await.unwrap_or(bytes);
                // For an other-worker resume, a filler takes the worker with the local copy.
                let filler = if other_worker {
                    Some(fill_worker(&runtime, &held_by).await?)
                } else {
                    None
                };
                let started = Instant::now();
                sandbox.resume().await?;
                let resumed = sandbox
                    .wait_resumed(suspended.incarnation(), SUSPEND_LIMIT)
                    .await?;
                resumes.push(started.elapsed());
                ensure!(
                    resumed.phase() == Phase::Ready,
                    "the sandbox did not resume: {:?}",
                    resumed.status
                );
                let now_on = resumed
                    .status
                    .as_ref()
                    .and_then(|s| s.assigned_pod.clone())
                    .unwrap_or_default();
                ensure!(
                    (now_on == held_by) != other_worker,
                    "resumed on {now_on}, suspended from {held_by} (other worker: {other_worker})"
                );
                if let Some(sandbox) = filler {
                    sandbox
                        .release(ReleaseOptions {
                            immediate: true,
                            ..ReleaseOptions::default()
                        })
                        .await?;
                }
            }
            let mib = bytes as f64 / MIB as f64;
            let rate = |times: &[Duration]| {
                let mut rates: Vec<f64> = times
                    .iter()
                    .map(|t| mib / t.as_secs_f64().max(1e-9))
                    .collect();
                rates.sort_by(f64::total_cmp);
                rates.get(rates.len() / 2).copied().unwrap_or_default()
            };
            let where_ = if other_worker {
                "other_worker"
            } else {
                "same_worker"
            };
            if !other_worker {
                figures.insert("suspend_ms".into(), percentiles(&mut suspends.clone()));
                figures.insert("capture_mib_per_s_median".into(), json!(rate(&suspends)));
            }
            figures.insert(
                format!("resume_{where_}_ms"),
                percentiles(&mut resumes.clone()),
            );
            figures.insert(
                format!("restore_{where_}_mib_per_s_median"),
                json!(rate(&resumes)),
            );
        }
        figures.insert("workspace_bytes".into(), json!(bytes));
        sandbox
            .release(ReleaseOptions {
                immediate: true,
                ..ReleaseOptions::default()
            })
            .await?;
        report.insert(label.to_string(), serde_json::Value::Object(figures));
    }
    report.insert("cycles".into(), json!(args.suspends));
    Ok(serde_json::Value::Object(report))
}

/// The `sizeBytes` of the Snapshot a Suspended Run names.
async fn snapshot_bytes(client: &Client, run: &Run) -> Option<u64> {
    let name = run.status.as_ref()?.snapshot.as_ref()?.name.clone();
    let api = Api::<kruntimes_api::Snapshot>::namespaced(client.clone(), "default");
    let snapshot = api.get(&name).await.ok()?;
    snapshot
        .status
        .and_then(|s| s.size_bytes)
        .and_then(|b| u64::try_from(b).ok())
}

/// Acquires sandboxes on the suspend Runtime until one holds the worker `pod`, releases
/// the others (at most one), and returns the one on `pod`.
async fn fill_worker(
    runtime: &kruntimes_client::sandbox::Runtime,
    pod: &str,
) -> Result<kruntimes_client::sandbox::Sandbox> {
    let mut others = Vec::new();
    let mut kept = None;
    for _ in 0..2 {
        let filler = runtime.acquire_sandbox(&AcquireOptions::default()).await?;
        let on = filler
            .run()
            .await?
            .status
            .and_then(|s| s.assigned_pod)
            .unwrap_or_default();
        if on == pod {
            kept = Some(filler);
            break;
        }
        others.push(filler);
    }
    for other in others {
        other
            .release(ReleaseOptions {
                immediate: true,
                ..ReleaseOptions::default()
            })
            .await?;
    }
    kept.with_context(|| format!("no filler sandbox landed on worker {pod}"))
}
