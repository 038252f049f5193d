//! `kruntimes-runtime-server`: serves the runtime server's gRPC API on a Unix socket for
//! the worker's runtimed. `kruntimes runtime-server ARGS` execs this binary (a binary of
//! its own because its sandbox holder must run before any thread starts).
#![forbid(unsafe_code)]

/// mimalloc: the invoke path allocates and frees many small buffers on several threads,
/// where glibc's malloc showed as a tenth of the CPU in profiles.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use kruntimes_runtime_server::sandbox::limits::{Limits, parse_bytes, parse_cpu_millis};
use kruntimes_runtime_server::{
    Adapter, CgroupMode, SandboxChoice, SandboxKind, Server, ServerConfig, sandbox::runsc::Runsc,
};
use tokio::signal::unix::{SignalKind, signal};

/// Executes task programs, function invocations and session operations for the local
/// runtimed.
#[derive(Debug, Parser)]
#[command(name = "kruntimes-runtime-server", version)]
struct Args {
    /// The Unix socket to serve gRPC on (created 0600; a stale socket is replaced).
    #[arg(long, env = "KRUNTIMES_RUNTIME_SOCKET")]
    socket: PathBuf,
    /// The directory that holds every execution's workspace (and, under `functions/`, every
    /// function registration's).
    #[arg(long, env = "KRUNTIMES_RUNTIME_ROOT")]
    root: PathBuf,
    /// A log store for the stdout and stderr of task executions, kept outside the
    /// disposable root (`DIR/<run-uid>/<attempt>/{stdout,stderr}.log`): they outlive the
    /// server and its worker, and whoever keeps the store removes them (`kruntimes up`
    /// does). Without it, they live in each execution's workspace and go with it.
    #[arg(long, env = "KRUNTIMES_RUNTIME_LOG_DIR")]
    log_dir: Option<PathBuf>,
    /// The adapter: bash or python.
    #[arg(long, default_value = "bash")]
    adapter: Adapter,
    /// The Python interpreter (default: /usr/bin/python3 if present, else PATH without
    /// pyenv shims, else PATH).
    #[arg(long)]
    python: Option<PathBuf>,
    /// The bash interpreter, also of session `shell` commands (default: /bin/bash or
    /// /usr/bin/bash, else PATH).
    #[arg(long)]
    bash: Option<PathBuf>,
    /// The grace period between SIGTERM and SIGKILL when a request gives none.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    grace: Duration,
    /// The grace period between SIGTERM and SIGKILL of a session's processes when
    /// CloseSession gives none, and after a session operation's timeout.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    session_termination_grace: Duration,
    /// `auto` (a cgroup per execution when possible), `off`, or the path of a cgroup v2
    /// directory to create execution cgroups under.
    #[arg(long, default_value = "auto")]
    cgroups: String,
    /// Shut down (as on SIGTERM: running executions are terminated, function registrations
    /// removed) when standard input reaches end-of-file. The local provisioner holds the
    /// write end of a pipe, so a killed parent leaves no runtime server behind.
    #[arg(long)]
    exit_with_stdin: bool,
    /// The sandbox backend of tasks, function registrations and sessions: `namespaces`
    /// (hardened: namespaces, seccomp, Landlock, cgroup limits), `process` (trusted
    /// workloads only), or `auto`: `namespaces` where the machine supports it, else
    /// `process` with a warning.
    #[arg(long, env = "KRUNTIMES_SANDBOX", value_enum, default_value_t = SandboxArg::Auto)]
    sandbox: SandboxArg,
    /// The host user (and group) that sandboxed programs run as (`namespaces`).
    #[arg(long, default_value_t = 65534)]
    sandbox_uid: u32,
    #[arg(long, default_value_t = 65534)]
    sandbox_gid: u32,
    /// Each sandbox's memory limit (`256Mi`, `1Gi`; `namespaces`).
    #[arg(long, env = "KRUNTIMES_SANDBOX_MEMORY", default_value = "1Gi", value_parser = parse_bytes)]
    sandbox_memory: u64,
    /// Each sandbox's process limit (`namespaces`).
    #[arg(long, env = "KRUNTIMES_SANDBOX_PIDS", default_value_t = 1024)]
    sandbox_pids: u64,
    /// Each sandbox's CPU limit (`500m`, `2`; unlimited when absent; `namespaces`).
    #[arg(long, env = "KRUNTIMES_SANDBOX_CPU", value_parser = parse_cpu_millis)]
    sandbox_cpu: Option<u64>,
    /// The size of each sandbox's private /tmp (`namespaces`; it counts against memory).
    #[arg(long, default_value = "256Mi", value_parser = parse_bytes)]
    sandbox_tmp_size: u64,
    /// The `runsc` binary of the `gvisor` backend (default: `runsc` on PATH, else
    /// /usr/bin/runsc or /usr/sbin/runsc).
    #[arg(long, env = "KRUNTIMES_RUNSC")]
    runsc: Option<PathBuf>,
    /// The gVisor platform: `systrap` or `ptrace` (`kvm` hangs on nested hosts).
    #[arg(long, env = "KRUNTIMES_RUNSC_PLATFORM", default_value = "systrap")]
    runsc_platform: String,
    /// How many never-used `namespaces` sandboxes to keep built ahead of time (each
    /// taken by one task execution, registration or session, destroyed after it, and
    /// replaced in the background); 0 builds every sandbox when it is needed.
    #[arg(long, env = "KRUNTIMES_WARM_SANDBOXES", default_value_t = 2, value_parser = clap::value_parser!(u64).range(0..=kruntimes_runtime_server::sandbox::MAX_WARM as u64))]
    warm_sandboxes: u64,
    /// Whether a `namespaces` sandbox's PID 1 starts its programs (the default; faster:
    /// no fork of the server, no cgroup or namespace joining per program). `false` starts
    /// each program from a fork of the server that enters the sandbox.
    #[arg(long, env = "KRUNTIMES_SANDBOX_LAUNCHER", default_value_t = true, action = clap::ArgAction::Set)]
    sandbox_launcher: bool,
    /// How log lines (on stderr) are written: `text` for people, `json` (one object a
    /// line) for collectors; `kruntimes runtime-server` passes its own `--log-format`.
    #[arg(long, env = "KRUNTIMES_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// `runsc` on PATH, else its usual places.
fn find_runsc(given: Option<PathBuf>) -> PathBuf {
    if let Some(path) = given {
        return path;
    }
    let on_path = std::env::var_os("PATH")
        .map(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join("runsc"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain(["/usr/bin/runsc".into(), "/usr/sbin/runsc".into()])
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("runsc"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SandboxArg {
    Auto,
    Process,
    Namespaces,
    Gvisor,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    kruntimes_api::duration::parse(s).map_err(|e| e.to_string())
}

fn main() -> anyhow::Result<()> {
    // A sandbox's holder is this binary too; it runs before anything starts a thread.
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if kruntimes_runtime_server::sandbox::isolation::holder::is_holder(
        args.get(1).map(|a| a.as_os_str()),
    ) {
        kruntimes_runtime_server::sandbox::isolation::holder::main(&args[2..]);
    }
    if let Some(mode) = kruntimes_runtime_server::sandbox::isolation::gvisor::mode(
        args.get(1).map(|a| a.as_os_str()),
    ) {
        mode(&args[2..]);
    }
    if args.get(1).is_some_and(|a| a == "--probe-sandbox") {
        return probe_sandbox();
    }
    serve()
}

/// `--probe-sandbox`: prints `namespaces<TAB>what is enforced` when this machine runs the
/// namespaces sandbox, else `process<TAB>why not`, and exits 0.
fn probe_sandbox() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let scratch =
        std::env::temp_dir().join(format!("kruntimes-sandbox-probe-{}", std::process::id()));
    // `--probe-sandbox gvisor` asks about gVisor instead.
    let gvisor = std::env::args_os().nth(2).is_some_and(|a| a == "gvisor");
    let runsc = gvisor.then(|| Runsc {
        binary: find_runsc(None),
        platform: std::env::var("KRUNTIMES_RUNSC_PLATFORM").unwrap_or_else(|_| "systrap".into()),
    });
    match runtime.block_on(kruntimes_runtime_server::sandbox::probe(&scratch, runsc)) {
        Ok(enforced) if gvisor => println!("gvisor\t{enforced}"),
        Ok(enforced) => println!("namespaces\t{enforced}"),
        Err(reason) => println!("process\t{reason}"),
    }
    Ok(())
}

#[tokio::main]
async fn serve() -> anyhow::Result<()> {
    let args = Args::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr);
    match args.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().flatten_event(true).init(),
    }
    let interpreter = match args.adapter {
        Adapter::Bash => args.bash.clone(),
        Adapter::Python => args.python,
    };
    let cgroups = match args.cgroups.as_str() {
        "auto" => CgroupMode::Auto,
        "off" => CgroupMode::Off,
        path => CgroupMode::Parent(PathBuf::from(path)),
    };
    let socket = args.socket.clone();
    let server = Server::bind(ServerConfig {
        socket: args.socket,
        root: args.root,
        log_dir: args.log_dir,
        adapter: args.adapter,
        interpreter,
        default_grace: args.grace,
        cgroups,
        session_termination_grace: args.session_termination_grace,
        shell: args.bash,
        sandbox: SandboxChoice {
            kind: match args.sandbox {
                SandboxArg::Auto => None,
                SandboxArg::Process => Some(SandboxKind::Process),
                SandboxArg::Namespaces => Some(SandboxKind::Namespaces),
                SandboxArg::Gvisor => Some(SandboxKind::Gvisor),
            },
            runsc: Runsc {
                binary: find_runsc(args.runsc),
                platform: args.runsc_platform,
            },
            uid: args.sandbox_uid,
            gid: args.sandbox_gid,
            warm: args.warm_sandboxes as usize,
            launcher: args.sandbox_launcher,
            limits: Limits {
                memory_bytes: Some(args.sandbox_memory),
                pids: Some(args.sandbox_pids),
                cpu_millis: args.sandbox_cpu,
            },
            tmp_bytes: args.sandbox_tmp_size,
        },
    })
    .await
    .context("runtime server failed to start")?;
    // Before the line below: a SIGTERM sent as soon as it is read must find the handler
    // (it killed the server outright when the handler came after the line).
    let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    // One line on stdout once the socket accepts connections, for whoever started us.
    println!("listening on {}", socket.display());
    let stdin_closed = if args.exit_with_stdin {
        Some(stdin_eof()?)
    } else {
        None
    };
    let shutdown = async move {
        let stdin_closed = async move {
            match stdin_closed {
                // A dropped sender (the reader thread ended) counts as end-of-file too.
                Some(closed) => {
                    let _ = closed.await;
                    tracing::info!("standard input closed; shutting down");
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
            () = stdin_closed => {}
        }
    };
    server
        .serve(shutdown)
        .await
        .context("runtime server failed")?;
    Ok(())
}

/// Reads (and discards) standard input on a plain thread until end-of-file or an error, then
/// completes the returned receiver. A plain thread rather than `tokio::io::stdin`: a blocking
/// read cannot be cancelled, and the runtime would wait for it on exit after a SIGTERM.
fn stdin_eof() -> anyhow::Result<tokio::sync::oneshot::Receiver<()>> {
    let (closed_tx, closed_rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("stdin-eof".to_owned())
        .spawn(move || {
            let mut stdin = std::io::stdin().lock();
            let mut buf = [0u8; 4096];
            loop {
                match std::io::Read::read(&mut stdin, &mut buf) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            let _ = closed_tx.send(());
        })
        .context("cannot start the stdin reader")?;
    Ok(closed_rx)
}
