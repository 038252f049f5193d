//! `bench-sandbox`: the sandbox backends of the runtime server, side by side in one run.
//!
//! Starts one `kruntimes-runtime-server` per backend (`--sandbox process`, `namespaces`
//! with its default pool of warm sandboxes, `namespaces-cold` (`--warm-sandboxes 0`: each
//! sandbox built when its session registers), `namespaces-fork` (`--sandbox-launcher
//! false`: each program started from a fork of the server that enters the sandbox, not by
//! the sandbox's PID 1) and `gvisor`, bash adapter, temporary roots) and talks to each over its Unix socket, as
//! runtimed does. Samples alternate between the backends, so that all see the same machine
//! noise (`gvisor` takes fewer samples: its sandboxes take far longer to make and end).
//!
//! Measurements, per backend:
//! - **create**: `--creates` (default 200) sessions, one at a time: RegisterSession until
//!   the answer (the session is Ready: workspace made, and for `namespaces` the sandbox
//!   built: holder, mounts, limits cgroups, Landlock ruleset; for `gvisor` the container
//!   started with `runsc run` and its init ready). Each is closed and purged before the
//!   next (not timed).
//! - **exec**: `--execs` (default 500) commands `true` (argv) in one session, one at a
//!   time: StreamSessionOperation until the completed event.
//! - **snapshot**: a workspace of 1 MiB in 100 files and one of 100 MiB in 100 files
//!   (incompressible bytes, written on the host), captured (CaptureSession, every chunk
//!   received, until the summary) and restored into a fresh session (RestoreSession with
//!   the digest, until the answer) `--snapshot-rounds` times (default 5): milliseconds
//!   and MiB/s of the files' bytes at the p50. `--snapshot-rounds 0` skips it.
//!
//! Prints one JSON object on stdout. Build first, in one profile:
//! `cargo build --release -p kruntimes-runtime-server -p kruntimes-bench &&
//! ./target/release/bench-sandbox`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use kruntimes_bench::percentiles;
use kruntimes_proto::runtime::v1 as pb;
use pb::session_operation_event::Event;
use pb::session_runtime_client::SessionRuntimeClient;
use serde_json::json;
use tonic::transport::Channel;

#[derive(Parser, Debug)]
#[command(
    name = "bench-sandbox",
    about = "Sandbox backends side by side: session creation and exec of true"
)]
struct Args {
    /// Sessions created (and purged) one at a time, per backend.
    #[arg(long, default_value_t = 200)]
    creates: usize,
    /// Commands `true` run one at a time in one session, per backend.
    #[arg(long, default_value_t = 500)]
    execs: usize,
    /// Sessions created for `gvisor` (each takes about a second to make and end).
    #[arg(long, default_value_t = 40)]
    gvisor_creates: usize,
    /// Commands `true` for `gvisor`.
    #[arg(long, default_value_t = 200)]
    gvisor_execs: usize,
    /// Captures and restores of each snapshot workspace, per backend.
    #[arg(long, default_value_t = 5)]
    snapshot_rounds: usize,
    /// The backends, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "process,namespaces,namespaces-cold,gvisor"
    )]
    backends: Vec<String>,
}

/// One runtime server, killed (SIGTERM) and its directory removed on drop.
struct Backend {
    name: &'static str,
    child: Child,
    dir: PathBuf,
    sessions: SessionRuntimeClient<Channel>,
    isolation: String,
}

impl Drop for Backend {
    fn drop(&mut self) {
        // SIGTERM: the server closes its sessions and removes its cgroups.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The runtime server binary next to this one.
fn runtime_server() -> Result<PathBuf> {
    let me = std::env::current_exe().context("find this binary")?;
    let bin = me
        .parent()
        .context("this binary has no directory")?
        .join("kruntimes-runtime-server");
    ensure!(
        bin.exists(),
        "{} is missing (cargo build --release -p kruntimes-runtime-server)",
        bin.display()
    );
    Ok(bin)
}

/// A backend's `--sandbox` and further flags: `namespaces` keeps the runtime server's
/// default pool of warm sandboxes, `namespaces-cold` has none (`--warm-sandboxes 0`,
/// every sandbox built when its session registers), `namespaces-fork` starts each program
/// from a fork of the server rather than through the sandbox's PID 1.
fn flags(name: &str) -> (&str, &'static [&'static str]) {
    match name {
        "namespaces-cold" => ("namespaces", &["--warm-sandboxes", "0"]),
        "namespaces-fork" => ("namespaces", &["--sandbox-launcher", "false"]),
        other => (other, &[]),
    }
}

async fn start(name: &'static str, bin: &Path) -> Result<Backend> {
    let (sandbox, extra) = flags(name);
    let dir = std::env::temp_dir().join(format!("bench-sandbox-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let socket = dir.join("rs.sock");
    let mut child = Command::new(bin)
        .arg("--socket")
        .arg(&socket)
        .arg("--root")
        .arg(dir.join("root"))
        .arg("--sandbox")
        .arg(sandbox)
        .args(extra)
        .env(
            "RUST_LOG",
            std::env::var("BENCH_RS_LOG").unwrap_or_else(|_| "warn".to_owned()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("start {}", bin.display()))?;
    let stdout = child.stdout.take().context("stdout")?;
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).map(|_| line)
    })
    .await??;
    ensure!(
        line.starts_with("listening on "),
        "{name}: the server said {line:?}"
    );
    let channel = kruntimes_proto::unix::connect(&socket)
        .await
        .with_context(|| format!("connect to {}", socket.display()))?;
    let caps = pb::runtime_info_client::RuntimeInfoClient::new(channel.clone())
        .capabilities(pb::CapabilitiesRequest {})
        .await?
        .into_inner();
    Ok(Backend {
        name,
        child,
        dir,
        sessions: SessionRuntimeClient::new(channel),
        isolation: format!("{:?}: {}", caps.isolation(), caps.isolation_detail),
    })
}

fn new_id() -> pb::ExecutionId {
    pb::ExecutionId {
        run_uid: uuid::Uuid::new_v4().to_string(),
        attempt: 1,
    }
}

/// RegisterSession until Ready; the time it took.
async fn create(backend: &mut Backend, id: &pb::ExecutionId) -> Result<Duration> {
    let started = Instant::now();
    let status = backend
        .sessions
        .register_session(pb::RegisterSessionRequest {
            id: Some(id.clone()),
            files: Vec::new(),
            env: Vec::new(),
        })
        .await?
        .into_inner();
    let took = started.elapsed();
    ensure!(
        status.state() == pb::SessionState::Ready,
        "{}: {status:?}",
        backend.name
    );
    Ok(took)
}

async fn purge(backend: &mut Backend, id: &pb::ExecutionId) -> Result<()> {
    backend
        .sessions
        .close_session(pb::CloseSessionRequest {
            id: Some(id.clone()),
            grace_period: None,
            purge: true,
            park_digest: String::new(),
        })
        .await?;
    Ok(())
}

/// Runs `true` once; the time until the completed event.
async fn exec(backend: &mut Backend, id: &pb::ExecutionId, n: usize) -> Result<Duration> {
    let started = Instant::now();
    let mut stream = backend
        .sessions
        .stream_session_operation(pb::SessionOperationRequest {
            id: Some(id.clone()),
            operation_id: format!("op-{n}"),
            operation: Some(pb::session_operation_request::Operation::Command(
                pb::Command {
                    argv: vec!["true".to_owned()],
                    ..Default::default()
                },
            )),
            timeout: None,
        })
        .await?
        .into_inner();
    while let Some(event) = stream.message().await? {
        if let Some(Event::Completed(done)) = event.event {
            let took = started.elapsed();
            ensure!(
                done.state() == pb::OperationState::Succeeded,
                "{}: {done:?}",
                backend.name
            );
            return Ok(took);
        }
    }
    bail!(
        "{}: the operation ended without a completed event",
        backend.name
    )
}

/// Deterministic bytes that do not compress (xorshift).
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// CaptureSession to its summary: the data received, its digest, and the time it took.
async fn capture(
    backend: &mut Backend,
    id: &pb::ExecutionId,
) -> Result<(Vec<u8>, String, Duration)> {
    use pb::capture_session_response::Part;
    let started = Instant::now();
    let mut stream = backend
        .sessions
        .capture_session(pb::CaptureSessionRequest {
            id: Some(id.clone()),
            max_bytes: 0,
            max_files: 0,
        })
        .await?
        .into_inner();
    let mut data = Vec::new();
    while let Some(part) = stream.message().await? {
        match part.part {
            Some(Part::Data(chunk)) => data.extend(chunk),
            Some(Part::Summary(summary)) => return Ok((data, summary.digest, started.elapsed())),
            None => {}
        }
    }
    bail!("{}: the capture ended without a summary", backend.name)
}

/// RestoreSession of `data` into a fresh session; the time it took.
async fn restore(
    backend: &mut Backend,
    id: &pb::ExecutionId,
    data: &[u8],
    digest: &str,
) -> Result<Duration> {
    use pb::restore_session_request::Part;
    let mut parts = vec![Part::Header(pb::RestoreHeader {
        id: Some(id.clone()),
        max_bytes: 0,
        max_files: 0,
        digest: digest.to_owned(),
        parked: false,
    })];
    parts.extend(data.chunks(1 << 20).map(|c| Part::Data(c.to_vec())));
    parts.push(Part::End(pb::RestoreEnd {
        total_bytes: data.len() as u64,
    }));
    let messages: Vec<pb::RestoreSessionRequest> = parts
        .into_iter()
        .map(|part| pb::RestoreSessionRequest { part: Some(part) })
        .collect();
    let started = Instant::now();
    backend
        .sessions
        .restore_session(futures::stream::iter(messages))
        .await?;
    Ok(started.elapsed())
}

/// Captures and restores a workspace of `bytes` in `files` files `rounds` times.
async fn snapshot(
    backend: &mut Backend,
    bytes: usize,
    files: usize,
    rounds: usize,
) -> Result<serde_json::Value> {
    let id = new_id();
    create(backend, &id).await?;
    let status = backend
        .sessions
        .get_session_status(pb::GetSessionStatusRequest {
            id: Some(id.clone()),
        })
        .await?
        .into_inner();
    let workspace = PathBuf::from(&status.workspace_dir);
    for i in 0..files {
        let dir = workspace.join(format!("d{}", i % 10));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join(format!("f{i}")),
            noise(bytes / files, i as u64 + 1),
        )?;
    }
    let mut captures = Vec::new();
    let mut restores = Vec::new();
    let mut compressed = 0;
    for _ in 0..rounds {
        let (data, digest, took) = capture(backend, &id).await?;
        captures.push(took);
        compressed = data.len();
        let target = new_id();
        create(backend, &target).await?;
        restores.push(restore(backend, &target, &data, &digest).await?);
        purge(backend, &target).await?;
    }
    purge(backend, &id).await?;
    let capture_ms = percentiles(&mut captures);
    let restore_ms = percentiles(&mut restores);
    let mib_s = |ms: &serde_json::Value| match ms["p50"].as_f64() {
        Some(ms) if ms > 0.0 => json!(bytes as f64 / f64::from(1 << 20) / (ms / 1000.0)),
        _ => json!(null),
    };
    Ok(json!({
        "bytes": bytes,
        "files": files,
        "compressed_bytes": compressed,
        "capture_ms": capture_ms,
        "restore_ms": restore_ms,
        "capture_mib_per_s_p50": mib_s(&capture_ms),
        "restore_mib_per_s_p50": mib_s(&restore_ms),
    }))
}

async fn run(args: &Args) -> Result<serde_json::Value> {
    let bin = runtime_server()?;
    let mut backends = Vec::new();
    for name in &args.backends {
        let name: &'static str = match name.as_str() {
            "process" => "process",
            "namespaces" => "namespaces",
            "namespaces-cold" => "namespaces-cold",
            "namespaces-fork" => "namespaces-fork",
            "gvisor" => "gvisor",
            other => bail!("unknown backend {other:?}"),
        };
        backends.push(start(name, &bin).await?);
    }
    let counts = |backend: &Backend| match backend.name {
        "gvisor" => (args.gvisor_creates, args.gvisor_execs),
        _ => (args.creates, args.execs),
    };
    let mut creates: Vec<Vec<Duration>> = vec![Vec::new(); backends.len()];
    for n in 0..args.creates.max(args.gvisor_creates) {
        for (i, backend) in backends.iter_mut().enumerate() {
            if n < counts(backend).0 {
                let id = new_id();
                creates[i].push(create(backend, &id).await?);
                purge(backend, &id).await?;
            }
        }
    }
    let mut execs: Vec<Vec<Duration>> = vec![Vec::new(); backends.len()];
    let mut ids = Vec::new();
    for backend in backends.iter_mut() {
        let id = new_id();
        create(backend, &id).await?;
        ids.push(id);
    }
    for n in 0..args.execs.max(args.gvisor_execs) {
        for (i, backend) in backends.iter_mut().enumerate() {
            if n < counts(backend).1 {
                execs[i].push(exec(backend, &ids[i], n).await?);
            }
        }
    }
    let mut report = serde_json::Map::new();
    let mut p50 = std::collections::BTreeMap::new();
    for (i, backend) in backends.iter().enumerate() {
        let create = percentiles(&mut creates[i]);
        let exec = percentiles(&mut execs[i]);
        p50.insert(backend.name, (create["p50"].as_f64(), exec["p50"].as_f64()));
        report.insert(
            backend.name.to_owned(),
            json!({
                "isolation": backend.isolation,
                "create_ms": create,
                "exec_true_ms": exec,
                "samples": {"creates": creates[i].len(), "execs": execs[i].len()},
            }),
        );
    }
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => json!(a / b),
        _ => json!(null),
    };
    if let Some(process) = p50.get("process") {
        for name in ["namespaces", "namespaces-cold", "namespaces-fork", "gvisor"] {
            if let Some(other) = p50.get(name) {
                report.insert(
                    format!("{name}_over_process_p50"),
                    json!({
                        "create": ratio(other.0, process.0),
                        "exec_true": ratio(other.1, process.1),
                    }),
                );
            }
        }
    }
    for (backend, id) in backends.iter_mut().zip(&ids) {
        purge(backend, id).await?;
    }
    if args.snapshot_rounds > 0 {
        for backend in backends.iter_mut() {
            let small = snapshot(backend, 1 << 20, 100, args.snapshot_rounds).await?;
            let large = snapshot(backend, 100 << 20, 100, args.snapshot_rounds).await?;
            if let Some(serde_json::Value::Object(entry)) = report.get_mut(backend.name) {
                entry.insert(
                    "snapshot".to_owned(),
                    json!({"1MiB_100_files": small, "100MiB_100_files": large}),
                );
            }
        }
    }
    Ok(serde_json::Value::Object(report))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    let report = runtime.block_on(run(&args))?;
    kruntimes_bench::print(&report)
}
