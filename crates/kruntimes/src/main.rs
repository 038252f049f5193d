//! The kruntimes server binary. `kruntimes up` runs the whole system on one machine: the
//! embedded API server, the gateway and the controller-manager, whose local provisioner
//! starts the workers (`kruntimes runtimed` plus a runtime server each). Each component is
//! also a command of its own (`apiserver`, `gateway`, `controller-manager`, `runtimed`,
//! `runtime-server`) that starts the same parts (system.rs) with the same flags (shared
//! clap `Args` structs), for running them as separate processes (docs/operations.md).

/// mimalloc: the invoke path allocates and frees many small buffers on several threads,
/// where glibc's malloc showed as a tenth of the CPU in profiles.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kruntimes_apiserver::{Config, Durability};

mod datadir;
mod health;
mod logstore;
mod system;
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(
    name = "kruntimes",
    version,
    about = "Run code for programs and AI agents on warm pools of workers"
)]
struct Cli {
    /// How log lines (on stderr) are written: `text` for people, `json` (one object a line,
    /// with every field such as `run_uid` and `invocation_id`) for collectors. Workers
    /// started by `kruntimes up` inherit it through the environment.
    #[arg(long, global = true, env = "KRUNTIMES_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Start everything on this machine, on the embedded API server.
    Up(Box<UpArgs>),
    /// Run the embedded API server alone (what `up` runs first): writes
    /// `DATA_DIR/kubeconfig`, serves until SIGTERM or Ctrl-C, then stops gracefully.
    Apiserver(Box<ApiserverArgs>),
    /// Run the controller-manager alone (what `up` runs beside the API server): the
    /// scheduler, the lifecycle, autoscale and idle controllers under a Lease, and the
    /// worker provisioner. Serves /healthz, /readyz and /metrics on --health-addr; stops
    /// gracefully on SIGTERM or Ctrl-C.
    ControllerManager(Box<ControllerManagerArgs>),
    /// Run the gateway alone (what `up` runs beside the API server): HTTPS with a
    /// certificate from the data directory's CA, /healthz, /readyz and /metrics on the same
    /// address; stops gracefully on SIGTERM or Ctrl-C.
    Gateway(Box<GatewayArgs>),
    /// Run the worker daemon of one worker (started by the provisioner).
    Runtimed(Box<RuntimedArgs>),
    /// Run a worker's runtime server: execs `kruntimes-runtime-server` (installed next to
    /// this binary) with the arguments that follow, and this command's --log-format
    /// (`kruntimes runtime-server --help` shows its flags).
    #[command(disable_help_flag = true)]
    RuntimeServer(RuntimeServerArgs),
}

#[derive(clap::Args)]
struct RuntimeServerArgs {
    /// The runtime server's own arguments, passed on unchanged.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<std::ffi::OsString>,
}

/// How a component command finds its API server, the same for `controller-manager`,
/// `gateway` and `runtimed`.
#[derive(clap::Args)]
pub(crate) struct KubeFlags {
    /// The kubeconfig of this component's identity. Without it the API server is found the
    /// kube-rs way (`kube::Config::infer()`): the kubeconfig named by `KUBECONFIG` (else
    /// `~/.kube/config`), else, in a Pod, the service account's token and CA.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
}

impl KubeFlags {
    async fn client(&self) -> anyhow::Result<kube::Client> {
        system::client(self.kubeconfig.as_deref()).await
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
enum ProvisionerArg {
    /// Worker processes on this machine, as `kruntimes up` runs them.
    Local,
    /// A Deployment and a Service per Runtime on a Kubernetes cluster.
    Kubernetes,
}

#[derive(clap::Args)]
struct ControllerManagerArgs {
    #[command(flatten)]
    kube: KubeFlags,
    /// How workers are provisioned: `local` (processes on this machine, started and
    /// supervised by this process) or `kubernetes` (a Deployment of worker Pods and a
    /// Service per Runtime, in the Runtime's namespace; the cluster runs the Pods).
    #[arg(long, value_enum, default_value_t = ProvisionerArg::Local)]
    provisioner: ProvisionerArg,
    /// With `--provisioner kubernetes`: the image of each worker Pod's `runtimed` container
    /// (the control-plane image).
    #[arg(long, default_value = "kruntimes/control-plane:0.1.0")]
    worker_image: String,
    /// With `--provisioner kubernetes`: the image of the `runtime` container when a
    /// Runtime's template names none.
    #[arg(long, default_value = "kruntimes/runtime:0.1.0")]
    runtime_image: String,
    /// With `--provisioner kubernetes`: the ServiceAccount the worker Pods run as, in each
    /// Runtime's namespace.
    #[arg(long, default_value = "kruntimes-runtimed")]
    worker_service_account: String,
    /// The data directory of the API server this controller-manager works with (the
    /// `--data-dir` of `kruntimes apiserver`): the local provisioner keeps its workers in
    /// `DATA_DIR/workers`, issues their certificates with the CA in `DATA_DIR/pki` and
    /// keeps task logs in `DATA_DIR/logs`.
    #[arg(long, env = "KRUNTIMES_DATA_DIR", default_value = ".kruntimes")]
    data_dir: PathBuf,
    /// The gateway's URL, published in Ready functions' endpoints (what `kruntimes gateway`
    /// prints as `gateway ready at URL`).
    #[arg(long, default_value = "https://127.0.0.1:7443", value_parser = gateway_url)]
    gateway_url: String,
    /// A PEM file of the CA that verifies the gateway, published in Ready functions'
    /// endpoints; `DATA_DIR/components/gateway-ca.crt` (written by `kruntimes gateway`)
    /// when absent.
    #[arg(long)]
    gateway_ca: Option<PathBuf>,
    /// With `--provisioner kubernetes`: the Secret, as NAMESPACE/NAME, of the CA that
    /// issues the workers' mutual-TLS material (made when it does not exist). Each
    /// namespace with a Runtime gets its workers' certificate in the Secret
    /// `kruntimes-worker-tls`, and the CA's namespace the gateway's in
    /// `kruntimes-gateway-worker-tls`. Without it, runtimed's port is plaintext.
    #[arg(long, value_parser = secret_ref)]
    worker_ca_secret: Option<(String, String)>,
    /// The kubeconfig of the workers' runtimeds;
    /// `DATA_DIR/components/runtimed.kubeconfig` when absent.
    #[arg(long)]
    runtimed_kubeconfig: Option<PathBuf>,
    /// The runtime server binary the workers run; `kruntimes-runtime-server` next to this
    /// binary when absent.
    #[arg(long)]
    runtime_server_bin: Option<PathBuf>,
    /// Where to serve `/healthz`, `/readyz` and `/metrics` over plain HTTP; a port of 0
    /// picks a free one, printed as `controller-manager health at http://ADDR`.
    #[arg(long, default_value = "127.0.0.1:0")]
    health_addr: SocketAddr,
    #[command(flatten)]
    files: FileFlags,
    #[command(flatten)]
    controller: ControllerFlags,
}

#[derive(clap::Args)]
struct GatewayArgs {
    #[command(flatten)]
    kube: KubeFlags,
    /// The data directory of the API server this gateway works with (the `--data-dir` of
    /// `kruntimes apiserver`): its CA in `DATA_DIR/pki` issues the gateway's serving and
    /// client certificates, the gateway writes that CA to
    /// `DATA_DIR/components/gateway-ca.crt` and its URL into `DATA_DIR/kubeconfig` (when
    /// it exists), and serves the logs of gone workers from `DATA_DIR/logs`.
    #[arg(long, env = "KRUNTIMES_DATA_DIR", default_value = ".kruntimes")]
    data_dir: PathBuf,
    /// The address to serve HTTPS on (probes and metrics included); a port of 0 picks a
    /// free one, printed as `gateway ready at URL`.
    #[arg(long, default_value = "127.0.0.1:7443")]
    addr: SocketAddr,
    /// The serving certificate to present (PEM, the leaf first), for example a mounted
    /// Secret's `tls.crt`, instead of one issued by the data directory's CA. Read again
    /// every `--tls-reload-interval`: a rotation (cert-manager's) serves the connections
    /// made after it, and open ones keep theirs. Needs `--tls-key`.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The key of `--tls-cert` (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// The CA that issued `--tls-cert` (PEM), copied to
    /// `DATA_DIR/components/gateway-ca.crt` for the controller-manager to publish; without
    /// it no CA is written there (a publicly trusted certificate needs none).
    #[arg(long, requires = "tls_cert")]
    tls_ca: Option<PathBuf>,
    /// The gateway's client certificate towards workers' runtimeds (PEM, the leaf first,
    /// issued for the workload name `kruntimes-gateway`), for example a mounted Secret's
    /// `tls.crt`, instead of one issued by the data directory's CA at every start. Read
    /// again every `--tls-reload-interval`, with its key and CA: connections to workers made
    /// after a rotation present the new certificate. Needs `--worker-tls-key` and
    /// `--worker-tls-ca`.
    #[arg(long, requires_all = ["worker_tls_key", "worker_tls_ca"])]
    worker_tls_cert: Option<PathBuf>,
    /// The key of `--worker-tls-cert` (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, requires_all = ["worker_tls_cert", "worker_tls_ca"])]
    worker_tls_key: Option<PathBuf>,
    /// The CA (PEM) that verifies the workers' certificates.
    #[arg(long, requires_all = ["worker_tls_cert", "worker_tls_key"])]
    worker_tls_ca: Option<PathBuf>,
    /// How often `--tls-cert`, `--tls-key` and the `--worker-tls-*` files are read again,
    /// as `10s`.
    #[arg(long, default_value = "10s", value_parser = positive_duration)]
    tls_reload_interval: Duration,
    #[command(flatten)]
    gateway: GatewayFlags,
    #[command(flatten)]
    files: FileFlags,
}

#[derive(clap::Args)]
struct RuntimedArgs {
    #[command(flatten)]
    kube: KubeFlags,
    /// The namespace of the worker's Pod.
    #[arg(long, env = "POD_NAMESPACE")]
    namespace: String,
    /// The worker's Pod.
    #[arg(long, env = "POD_NAME")]
    pod_name: String,
    /// The Pod's UID; when absent, read from the Pod once it exists.
    #[arg(long, env = "POD_UID")]
    pod_uid: Option<String>,
    /// The runtime server's Unix socket.
    #[arg(long)]
    runtime_socket: PathBuf,
    /// Where to serve runtimed's gRPC API.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Where to serve `/healthz`, `/readyz` and Prometheus metrics (`/metrics`) over
    /// plain HTTP; none when absent.
    #[arg(long, visible_alias = "health-addr")]
    metrics_listen: Option<SocketAddr>,
    /// Queued mutations per session at most (a Run may only lower it).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1024))]
    session_max_queue: u32,
    /// The longest one session operation may run (a Run may only lower it), in seconds; at
    /// most 300 (the runtime server's own bound).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=300))]
    session_max_operation_timeout: u64,
    /// The longest runtimed waits for the runtime server to close a session, in seconds.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    session_close_timeout: u64,
    /// The largest whole-file upload (or directory archive) into a session, in bytes.
    #[arg(long, default_value_t = kruntimes_runtimed::sessions::DEFAULT_MAX_FILE_BYTES, value_parser = clap::value_parser!(u64).range(1..))]
    session_max_file_bytes: u64,
    /// How often at most a session's `status.session.lastActivityTime` is written (the
    /// granularity of idle expiry), as `60s` or `500ms`; keep it well under the
    /// controller-manager's session idle TTL.
    #[arg(long, default_value = "60s", value_parser = positive_duration)]
    session_activity_interval: Duration,
    /// Append session audit lines (JSONL) to this file; standard output when absent.
    #[arg(long)]
    audit_log: Option<PathBuf>,
    /// Where suspend snapshots are kept: this worker's local copies (`local/`) and the
    /// filesystem store (`store/`) used when the Runtime names no artifactStore.
    #[arg(long)]
    snapshot_dir: Option<PathBuf>,
    /// How often the worker removes its local snapshot copies that no resume can use any
    /// more (of Runs resumed on another worker, ended or deleted), as `5m` or `30s`.
    #[arg(long, env = "KRUNTIMES_SNAPSHOT_SWEEP_INTERVAL", default_value = "5m", value_parser = positive_duration)]
    snapshot_sweep_interval: Duration,
    /// Exit when standard input closes (the parent holds the other end of a pipe).
    #[arg(long)]
    exit_with_stdin: bool,
    /// The Runtime the worker belongs to.
    #[arg(long, env = "KRUNTIMES_RUNTIME")]
    runtime: String,
    /// The gateway's URL (`https://HOST:PORT`), published in Ready functions' endpoints.
    #[arg(long)]
    gateway_url: Option<String>,
    /// A PEM file of the CA that verifies the gateway, published as the endpoints' CA
    /// bundle.
    #[arg(long, requires = "gateway_url")]
    gateway_ca: Option<PathBuf>,
    /// runtimed's certificate (PEM, issued by the cluster CA for the worker identity
    /// `POD.NAMESPACE.kruntimes-worker` as a DNS name). With --tls-key and --tls-ca, the gRPC
    /// port requires mutual TLS and forwarded calls present this certificate; without them
    /// it is plaintext.
    #[arg(long, requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, requires_all = ["tls_cert", "tls_ca"])]
    tls_key: Option<PathBuf>,
    /// The cluster CA (PEM) that verifies the callers' and the peers' certificates.
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<PathBuf>,
    /// How often --tls-cert, --tls-key and --tls-ca are read again, as `10s`. A rotation
    /// (cert-manager's) serves the connections made after it, in both directions; open
    /// connections keep theirs. A change that cannot be used is logged, and the material
    /// loaded before stays.
    #[arg(long, default_value = "10s", value_parser = positive_duration)]
    tls_reload_interval: Duration,
}

/// The embedded API server's settings, the same for `up` and `apiserver`.
#[derive(clap::Args)]
pub(crate) struct ApiserverFlags {
    /// How many past changes the API server keeps for watches to resume from; older
    /// resourceVersions get 410 Gone.
    #[arg(long, default_value_t = 100_000)]
    watch_history: usize,
    /// What an acknowledged write survives. `full` (the default) syncs every commit to disk
    /// before it is acknowledged, so acknowledged writes survive a crash of the process and
    /// a power loss of the machine, as etcd promises. `process` acknowledges before the
    /// sync: acknowledged writes survive a crash of the process, but a power loss may lose
    /// the last ones.
    #[arg(long, value_enum, default_value_t = DurabilityArg::Full)]
    durability: DurabilityArg,
    /// How long the API server waits for the headers of an HTTP/1.1 request once a
    /// connection is open (or the last request on it ended), as `10s` or `500ms`; beyond it
    /// the connection is closed.
    #[arg(long, default_value = "10s", value_parser = kruntimes_api::duration::parse)]
    apiserver_header_timeout: Duration,
    /// How long the API server waits for a whole request body, as `30s` or `500ms`; beyond
    /// it the request is answered 408.
    #[arg(long, default_value = "30s", value_parser = kruntimes_api::duration::parse)]
    apiserver_body_timeout: Duration,
}

#[derive(clap::Args)]
struct ApiserverArgs {
    /// Where the API server's state, certificates and kubeconfigs live
    /// (`DATA_DIR/kubeconfig` for the admin, `DATA_DIR/components/` for each component).
    /// One process at a time uses it: it holds an exclusive lock on `DATA_DIR/lock`.
    #[arg(long, env = "KRUNTIMES_DATA_DIR", default_value = ".kruntimes")]
    data_dir: PathBuf,
    /// The address to serve on; a port of 0 picks a free one (the kubeconfig records it).
    #[arg(long, default_value = "127.0.0.1:6443")]
    addr: SocketAddr,
    #[command(flatten)]
    flags: ApiserverFlags,
}

#[derive(clap::Args)]
pub(crate) struct UpArgs {
    /// Where state, certificates and the kubeconfig live. One `kruntimes up` at a time
    /// uses it: it holds an exclusive lock on `DATA_DIR/lock` (which names its PID) while
    /// it runs, and a second start on the same directory fails at once.
    #[arg(long, env = "KRUNTIMES_DATA_DIR", default_value = ".kruntimes")]
    data_dir: PathBuf,
    /// The API server's address; a port of 0 picks a free one (the kubeconfig records it).
    #[arg(long, default_value = "127.0.0.1:6443")]
    apiserver_addr: SocketAddr,
    #[command(flatten)]
    apiserver: ApiserverFlags,
    /// The gateway's address; a port of 0 picks a free one (the kubeconfig records it).
    #[arg(long, default_value = "127.0.0.1:7443")]
    gateway_addr: SocketAddr,
    /// Start the API server only: no controller-manager, workers or gateway.
    #[arg(long)]
    apiserver_only: bool,
    /// The fewest workers of each default Runtime (`bash` and `python` in namespace
    /// default, created when they do not exist yet; later changes by the user are kept).
    /// The default Runtimes scale between this and `--default-max-replicas`, keeping
    /// `--default-warm-runs` slots free.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i32).range(1..=1000))]
    default_min_replicas: i32,
    /// The most workers of each default Runtime.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(i32).range(1..=1000))]
    default_max_replicas: i32,
    /// Run slots each default Runtime keeps free beyond what waiting Runs ask for, so a new
    /// sandbox or task finds a warm slot.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(i32).range(0..=100000))]
    default_warm_runs: i32,
    /// How long a default Runtime's worker stays idle before it is drained and removed, as
    /// `60s` or `2m`.
    #[arg(long, default_value = "60s", value_parser = kruntimes_api::duration::parse)]
    default_scale_down_delay: Duration,
    /// Run slots of each default worker.
    #[arg(long, default_value_t = 8)]
    default_runs: i32,
    #[command(flatten)]
    pub(crate) gateway: GatewayFlags,
    #[command(flatten)]
    pub(crate) files: FileFlags,
    #[command(flatten)]
    pub(crate) controller: ControllerFlags,
    /// Where the controller-manager serves its probes and Prometheus metrics over HTTP
    /// (`GET /healthz`, `/readyz`, `/metrics`: `kruntimes_session_expired_total`); a port
    /// of 0 picks a free one, which `kruntimes up` prints.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub(crate) controller_metrics_addr: SocketAddr,
}

/// The gateway's settings, the same for `up` and `gateway`.
#[derive(clap::Args)]
pub(crate) struct GatewayFlags {
    /// Which worker the gateway sends an invocation to: `owner` (the owning worker, as the
    /// gateway's cache knows it) or `service` (any ready worker in turn, as a Kubernetes
    /// Service would; the worker forwards to the owner).
    #[arg(long, value_enum, default_value_t = RoutingArg::Owner)]
    pub(crate) invoke_routing: RoutingArg,
    /// The most session WebSockets the gateway keeps open at once; beyond it, opening one
    /// is answered 429 at once. Open sockets do not count against the request limit.
    #[arg(long, default_value_t = kruntimes_gateway::server::DEFAULT_MAX_SESSION_CONNECTIONS)]
    pub(crate) max_session_connections: usize,
    /// The most requests the gateway serves at once (invocations, session calls, logs);
    /// beyond it, 429 at once, never queued. Probes, metrics and open session sockets do
    /// not count.
    #[arg(long, default_value_t = kruntimes_gateway::server::DEFAULT_MAX_CONCURRENT)]
    pub(crate) max_concurrent_requests: usize,
    /// How long the gateway serves a successful authorization (TokenReview and
    /// SubjectAccessReview) from its cache, as `30s`, `500ms` or `1m`; `0` disables the
    /// cache, so every request is reviewed and a revocation takes effect at once.
    #[arg(long, default_value = "30s", value_parser = kruntimes_api::duration::parse)]
    pub(crate) authorization_cache_ttl: Duration,
    /// The most successful authorizations the gateway's cache holds; `0` disables it.
    #[arg(long, default_value_t = kruntimes_gateway::authz::DEFAULT_CAPACITY)]
    pub(crate) authorization_cache_capacity: usize,
}

/// The file size limit that the gateway and every worker enforce, the same for `up`,
/// `gateway` and `controller-manager` (which passes it to each worker's runtimed).
#[derive(clap::Args)]
pub(crate) struct FileFlags {
    /// The largest whole-file upload (or directory archive) into a session, in bytes, at
    /// the gateway and on every worker; beyond it, 413.
    #[arg(long, default_value_t = kruntimes_runtimed::sessions::DEFAULT_MAX_FILE_BYTES, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) session_max_file_bytes: u64,
}

/// The controller-manager's and its workers' settings, the same for `up` and
/// `controller-manager`: the local provisioner passes the session ones to each worker's
/// runtimed.
#[derive(clap::Args)]
pub(crate) struct ControllerFlags {
    /// Queued mutations per session at most, on every worker (a Run may only lower it with
    /// `spec.mode.session.queueSize`); passed to each worker's runtimed.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub(crate) session_max_queue: u32,
    /// The longest one session operation may run, in seconds (at most 300), on every worker;
    /// a Run may only lower it (`spec.mode.session.operationTimeout`). An operation that
    /// asks for more is refused at once with a message that names the cap.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=300))]
    pub(crate) session_max_operation_timeout: u64,
    /// The longest a worker's runtimed waits for its runtime server to close a session, in
    /// seconds.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub(crate) session_close_timeout: u64,
    /// How long a session may go without an operation or file write before it ends
    /// Timeout/IdleTimeout, as `168h`, `30m` or `90s` (reads, listings and heartbeats do
    /// not count); a Run's `spec.mode.session.idleTimeout` may only lower it (a longer one
    /// is clamped). `0` disables idle expiry; a negative value is refused.
    #[arg(long, default_value = "168h", allow_hyphen_values = true, value_parser = idle_ttl)]
    pub(crate) session_idle_ttl: Duration,
    /// How often the controller-manager's leader sweeps for idle sessions, as `60s`.
    #[arg(long, default_value = "60s", value_parser = positive_duration)]
    pub(crate) session_idle_sweep_interval: Duration,
    /// How often the controller-manager's leader deletes snapshot data that no Snapshot
    /// and no live Run refers to (in the data directory's snapshot store and every
    /// Runtime's ArtifactStore), as `5m`; `0` disables it.
    #[arg(long, default_value = "5m", value_parser = non_negative_duration)]
    pub(crate) snapshot_gc_interval: Duration,
    /// How long unreferenced snapshot data stays before it may be deleted, as `10m`.
    #[arg(long, default_value = "10m", value_parser = non_negative_duration)]
    pub(crate) snapshot_gc_grace: Duration,
    /// The sandbox backend of the workers: `namespaces` (hardened: namespaces, seccomp,
    /// Landlock, cgroup limits), `gvisor` (gVisor's runsc: a kernel of its own in user
    /// space; needs runsc 2024 or later), `process` (trusted workloads only), or `auto`:
    /// `namespaces` where this machine supports it, else `process` with a warning. A
    /// Runtime's `template.args` (`--sandbox ...`) overrides it for its workers.
    #[arg(long, env = "KRUNTIMES_SANDBOX", value_enum, default_value_t = SandboxArg::Auto)]
    pub(crate) sandbox: SandboxArg,
    /// The most bytes the log store (`DATA_DIR/logs`: the stdout and stderr of task Runs,
    /// kept across worker restarts and restarts of `kruntimes up`) holds, as `1Gi`, `500M`
    /// or bytes. Beyond it, the logs of finished Runs go, least recently written first; a
    /// deleted Run's logs always go with it.
    #[arg(long, default_value = "1Gi", value_parser = kruntimes_runtime_server::sandbox::limits::parse_bytes)]
    pub(crate) log_store_max_size: u64,
    /// How often the log store's size is checked against --log-store-max-size, as `60s`.
    #[arg(long, default_value = "60s", value_parser = kruntimes_api::duration::parse)]
    pub(crate) log_store_check_interval: Duration,
}

/// `--session-idle-ttl`: a duration, `0` to disable; a negative one is refused, naming the
/// flag.
fn idle_ttl(text: &str) -> Result<Duration, String> {
    if text.trim_start().starts_with('-') {
        return Err(format!(
            "the session idle TTL {text:?} is negative; give a duration such as 168h or 30m, \
             or 0 to disable idle expiry"
        ));
    }
    kruntimes_api::duration::parse(text).map_err(|e| e.to_string())
}

/// A duration of 0 or more; a negative one is refused, naming what to give instead.
fn non_negative_duration(text: &str) -> Result<Duration, String> {
    if text.trim_start().starts_with('-') {
        return Err(format!(
            "{text:?} is negative; give a duration such as 5m or 90s, or 0"
        ));
    }
    kruntimes_api::duration::parse(text).map_err(|e| e.to_string())
}

/// `--gateway-url`: `https://HOST[:PORT]`, short enough that the endpoints built on it fit
/// `status.endpoint.url` (checked here rather than in every worker's first registration).
/// `NAMESPACE/NAME` of a Secret: two DNS labels (a Secret name may be a DNS subdomain).
fn secret_ref(text: &str) -> Result<(String, String), String> {
    let refused = || format!("{text:?} is not NAMESPACE/NAME of a Secret");
    let (namespace, name) = text.split_once('/').ok_or_else(refused)?;
    use kruntimes_api::admission::{is_dns1123_label, is_dns1123_subdomain};
    if !is_dns1123_label(namespace) || !is_dns1123_subdomain(name) {
        return Err(refused());
    }
    Ok((namespace.to_string(), name.to_string()))
}

fn gateway_url(text: &str) -> Result<String, String> {
    let Some(rest) = text.strip_prefix("https://") else {
        return Err(format!(
            "{text:?} is not an https:// URL; give the gateway's URL, as \
             `kruntimes gateway` prints it (gateway ready at https://HOST:PORT)"
        ));
    };
    // What the endpoints append: /v1/namespaces/NS/runtimes/NAME/functions/UID:invoke.
    const ROOM: usize = 512;
    if rest.is_empty() || rest.contains(['/', '?', '#', ' ']) {
        return Err(format!(
            "{text:?} is not https://HOST[:PORT] (no path, query or spaces)"
        ));
    }
    if text.len() + ROOM > kruntimes_api::run::MAX_ENDPOINT_URL_BYTES {
        return Err(format!(
            "{} bytes is too long for the endpoints built on it (at most {})",
            text.len(),
            kruntimes_api::run::MAX_ENDPOINT_URL_BYTES - ROOM
        ));
    }
    Ok(text.to_string())
}

/// A duration that is not zero.
fn positive_duration(text: &str) -> Result<Duration, String> {
    match kruntimes_api::duration::parse(text) {
        Ok(d) if d.is_zero() => Err("must be more than 0".to_string()),
        Ok(d) => Ok(d),
        Err(e) => Err(e.to_string()),
    }
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum SandboxArg {
    Auto,
    Process,
    Namespaces,
    Gvisor,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum RoutingArg {
    Owner,
    Service,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum DurabilityArg {
    /// Acknowledged writes survive a crash of the process; a power loss may lose the last.
    Process,
    /// Every commit is synced to disk before it is acknowledged; survives a power loss.
    Full,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let format = cli.log_format;
    match cli.command {
        // Before any thread or logger starts: the process is replaced.
        Command::RuntimeServer(args) => exec_runtime_server(&args.args, format),
        Command::Up(args) => serve(format, up(*args, format)),
        Command::Apiserver(args) => serve(format, apiserver(*args)),
        Command::ControllerManager(args) => serve(format, controller_manager(*args, format)),
        Command::Gateway(args) => serve(format, gateway(*args)),
        Command::Runtimed(args) => serve(format, runtimed(*args)),
    }
}

/// Runs a long-running command: logs on stderr in `format`, on a multi-threaded runtime.
fn serve(
    format: LogFormat,
    command: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().flatten_event(true).init(),
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    runtime.block_on(command)
}

/// `kruntimes runtime-server`: replaces this process with the runtime server binary, so the
/// command is the same program the local provisioner starts (its sandbox holder must run
/// before any thread starts, which this binary's main cannot promise). Returns only when
/// the exec fails.
fn exec_runtime_server(args: &[std::ffi::OsString], log_format: LogFormat) -> anyhow::Result<()> {
    use std::os::unix::process::CommandExt;
    let binary = system::sibling("kruntimes-runtime-server")?;
    let format = match log_format {
        LogFormat::Text => "text",
        LogFormat::Json => "json",
    };
    let error = std::process::Command::new(&binary)
        .args(args)
        .env("KRUNTIMES_LOG_FORMAT", format)
        .exec();
    Err(anyhow::Error::new(error).context(format!("exec {}", binary.display())))
}

/// The worker TLS material of the three flags (certificate, key, CA) when all are given,
/// issued for `identity`, read again every `interval` by a task that ends once the material
/// is no longer held.
fn watched_worker_tls(
    (cert, key, ca): (&Option<PathBuf>, &Option<PathBuf>, &Option<PathBuf>),
    identity: &str,
    interval: Duration,
) -> Result<Option<kruntimes_runtimed::grpc::WorkerTls>, kruntimes_runtimed::grpc::TlsError> {
    let (Some(cert), Some(key), Some(ca)) = (cert, key, ca) else {
        return Ok(None);
    };
    let tls = kruntimes_runtimed::grpc::WorkerTls::read_as(cert, key, ca, identity)?;
    tls.watch(interval);
    Ok(Some(tls))
}

async fn runtimed(args: RuntimedArgs) -> anyhow::Result<()> {
    // Local files first: a bad one fails before anything reaches the network.
    let tls = watched_worker_tls(
        (&args.tls_cert, &args.tls_key, &args.tls_ca),
        &kruntimes_runtimed::grpc::worker_identity(&args.namespace, &args.pod_name),
        args.tls_reload_interval,
    )
    .context("load runtimed's TLS material")?;
    let client = args.kube.client().await?;
    let ca_bundle = match &args.gateway_ca {
        Some(path) => {
            let pem = std::fs::read_to_string(path)
                .with_context(|| format!("read the gateway CA {}", path.display()))?;
            anyhow::ensure!(
                pem.len() <= kruntimes_api::run::MAX_CA_BUNDLE_BYTES,
                "the gateway CA {} exceeds {} bytes",
                path.display(),
                kruntimes_api::run::MAX_CA_BUNDLE_BYTES
            );
            Some(pem)
        }
        None => None,
    };
    let config = kruntimes_runtimed::Config {
        namespace: args.namespace,
        pod_name: args.pod_name,
        pod_uid: args.pod_uid,
        runtime_socket: args.runtime_socket,
        listen: args.listen,
        runtime: args.runtime,
        endpoint: args.gateway_url.map(|gateway_url| {
            kruntimes_runtimed::functions::EndpointConfig {
                gateway_url,
                ca_bundle,
            }
        }),
        tls,
        metrics_listen: args.metrics_listen,
        session_limits: kruntimes_runtimed::sessions::SessionLimits {
            max_queue: args.session_max_queue,
            max_operation_timeout: Duration::from_secs(args.session_max_operation_timeout),
            close_timeout: Duration::from_secs(args.session_close_timeout),
            max_file_bytes: args.session_max_file_bytes,
            activity_interval: args.session_activity_interval,
            snapshot_dir: args.snapshot_dir,
            snapshot_sweep_interval: args.snapshot_sweep_interval,
        },
        audit_log: args.audit_log,
    };
    let exit_with_stdin = args.exit_with_stdin;
    kruntimes_runtimed::run(
        client,
        config,
        |addr, metrics| {
            // One line on stdout once ready, for whoever started us:
            // `runtimed listening on ADDR[ metrics ADDR]`.
            match metrics {
                Some(metrics) => println!("runtimed listening on {addr} metrics {metrics}"),
                None => println!("runtimed listening on {addr}"),
            }
        },
        shutdown_signal(exit_with_stdin),
    )
    .await
}

/// Completes on SIGTERM, SIGINT, or (with `stdin`) when standard input reaches EOF.
async fn shutdown_signal(stdin: bool) {
    use tokio::io::AsyncReadExt;
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(error) => {
            tracing::error!(error = %error, "cannot handle SIGTERM");
            return;
        }
    };
    let eof = async {
        if !stdin {
            return std::future::pending::<()>().await;
        }
        let mut input = tokio::io::stdin();
        let mut buf = [0u8; 256];
        loop {
            match input.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        () = eof => tracing::info!("standard input closed"),
    }
}

/// Says what a dead incarnation left and this start removed (issue 14 item 7).
fn report_leftovers(found: &datadir::Leftovers) {
    let list = |paths: &mut dyn Iterator<Item = &std::path::PathBuf>| {
        paths
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !found.removed.is_empty() || !found.cgroups.is_empty() {
        tracing::info!(
            removed = %list(&mut found.removed.iter()),
            cgroups = %list(&mut found.cgroups.iter()),
            "removed what a dead incarnation left (its workers' workspaces, sockets and TLS material; the logs stay) and the empty cgroups of its runtime servers"
        );
    }
    if !found.killed.is_empty() {
        let killed = found
            .killed
            .iter()
            .map(|(pid, name)| format!("{name} ({pid})"))
            .collect::<Vec<_>>()
            .join(", ");
        tracing::warn!(%killed, "killed the sandbox processes a dead incarnation left running");
    }
    for (path, reason) in &found.kept {
        tracing::warn!(path = %path.display(), reason = %reason, "could not remove what a dead incarnation left");
    }
}

impl ApiserverFlags {
    fn config(&self, data_dir: &std::path::Path, addr: SocketAddr) -> Config {
        Config {
            data_dir: data_dir.to_path_buf(),
            addr,
            watch_history: self.watch_history,
            durability: match self.durability {
                DurabilityArg::Process => Durability::Process,
                DurabilityArg::Full => Durability::Full,
            },
            header_read_timeout: self.apiserver_header_timeout,
            body_read_timeout: self.apiserver_body_timeout,
            unpaged_list_examined: kruntimes_apiserver::DEFAULT_UNPAGED_LIST_EXAMINED,
        }
    }
}

/// Resolves at SIGTERM or Ctrl-C (SIGINT). The handlers are installed when this is called,
/// not when the future is first polled: call it before printing the ready line, so a
/// SIGTERM sent as soon as that line is read stops the process gracefully rather than
/// killing it.
fn stop_requested() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("handle SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("handle SIGINT")?;
    Ok(async move {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
    })
}

/// `kruntimes apiserver`: the embedded API server alone, on its locked data directory.
async fn apiserver(args: ApiserverArgs) -> anyhow::Result<()> {
    let _lock = datadir::lock(&args.data_dir)?;
    let server = kruntimes_apiserver::start(args.flags.config(&args.data_dir, args.addr)).await?;
    println!("apiserver ready at https://{}", server.local_addr());
    println!("  export KUBECONFIG={}", server.kubeconfig_path().display());
    let stop = stop_requested()?;
    println!("kruntimes apiserver ready");
    stop.await;
    tracing::info!("shutting down");
    server.shutdown().await?;
    Ok(())
}

/// `kruntimes controller-manager`: the controllers and the worker provisioner alone, with
/// the same parts `up` starts ([`system::start_controllers`]).
async fn controller_manager(
    args: ControllerManagerArgs,
    log_format: LogFormat,
) -> anyhow::Result<()> {
    if args.provisioner == ProvisionerArg::Kubernetes {
        return kubernetes_controller_manager(args).await;
    }
    anyhow::ensure!(
        args.worker_ca_secret.is_none(),
        "--worker-ca-secret is for --provisioner kubernetes; the local provisioner issues \
         its workers' certificates with the CA of the data directory"
    );
    let components = args.data_dir.join("components");
    let gateway_ca = args
        .gateway_ca
        .unwrap_or_else(|| components.join("gateway-ca.crt"));
    anyhow::ensure!(
        gateway_ca.is_file(),
        "the gateway CA {} does not exist (start `kruntimes gateway --data-dir {}` first, \
         or give --gateway-ca)",
        gateway_ca.display(),
        args.data_dir.display()
    );
    let runtimed_kubeconfig = args
        .runtimed_kubeconfig
        .unwrap_or_else(|| components.join("runtimed.kubeconfig"));
    anyhow::ensure!(
        runtimed_kubeconfig.is_file(),
        "the runtimeds' kubeconfig {} does not exist (give --runtimed-kubeconfig, or the \
         --data-dir of `kruntimes apiserver`)",
        runtimed_kubeconfig.display()
    );
    let runtime_server_bin = match args.runtime_server_bin {
        Some(path) => {
            anyhow::ensure!(
                path.is_file(),
                "--runtime-server-bin {} is not a file",
                path.display()
            );
            path
        }
        None => system::sibling("kruntimes-runtime-server")?,
    };
    let client = args.kube.client().await?;
    let (health, health_addr) = health::bind(args.health_addr, "controller-manager").await?;
    let controllers = system::start_controllers(
        client,
        system::ControllerSettings {
            data_dir: &args.data_dir,
            flags: &args.controller,
            files: &args.files,
            gateway_url: &args.gateway_url,
            gateway_ca: &gateway_ca,
            runtimed_kubeconfig,
            runtime_server_bin,
            health,
            // The data directory's lock is the API server's: another controller-manager may
            // lead, and its Lease is waited out, as on a cluster.
            holds_data_dir_lock: false,
            json_logs: log_format == LogFormat::Json,
        },
    )
    .await?;
    serve_controllers(controllers, health_addr).await
}

/// Says where the controller-manager's health is and that it is ready, then runs until
/// SIGTERM or Ctrl-C and stops it.
async fn serve_controllers(
    controllers: system::Controllers,
    health_addr: SocketAddr,
) -> anyhow::Result<()> {
    println!("controller-manager health at http://{health_addr}");
    let stop = stop_requested()?;
    println!("kruntimes controller-manager ready");
    stop.await;
    tracing::info!("shutting down");
    controllers.stop().await;
    Ok(())
}

/// `kruntimes controller-manager --provisioner kubernetes`: no data directory of workers
/// and no local processes; the workers are Deployments' Pods.
async fn kubernetes_controller_manager(args: ControllerManagerArgs) -> anyhow::Result<()> {
    let gateway_ca = match &args.gateway_ca {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("read the gateway CA {}", path.display()))?,
        ),
        None => None,
    };
    let mut config = kruntimes_controller::kubernetes::KubernetesConfig::new(
        args.worker_image.clone(),
        args.runtime_image.clone(),
    );
    config.service_account = args.worker_service_account.clone();
    config.gateway_ca = gateway_ca;
    config.worker_ca_secret = args.worker_ca_secret.clone();
    config.runtimed_args = vec![
        format!("--gateway-url={}", args.gateway_url),
        format!("--session-max-queue={}", args.controller.session_max_queue),
        format!(
            "--session-max-operation-timeout={}",
            args.controller.session_max_operation_timeout
        ),
        format!(
            "--session-close-timeout={}",
            args.controller.session_close_timeout
        ),
        format!(
            "--session-max-file-bytes={}",
            args.files.session_max_file_bytes
        ),
        format!(
            "--session-activity-interval={}ms",
            system::activity_interval(args.controller.session_idle_ttl).as_millis()
        ),
    ];
    let client = args.kube.client().await?;
    let (health, health_addr) = health::bind(args.health_addr, "controller-manager").await?;
    let controllers =
        system::start_kubernetes_controllers(client, &args.controller, config, health);
    serve_controllers(controllers, health_addr).await
}

/// `kruntimes gateway`: the gateway alone, with the same part `up` starts
/// ([`system::start_gateway`]). Its probes and metrics are on its HTTPS address.
async fn gateway(args: GatewayArgs) -> anyhow::Result<()> {
    let client = args.kube.client().await?;
    let admin = args.data_dir.join("kubeconfig");
    let serving = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(system::ServingFiles {
            cert: cert.clone(),
            key: key.clone(),
            ca: args.tls_ca.clone(),
            reload_interval: args.tls_reload_interval,
        }),
        _ => None,
    };
    let serving_cert = serving.as_ref().map(|s| s.cert.display().to_string());
    let worker = watched_worker_tls(
        (
            &args.worker_tls_cert,
            &args.worker_tls_key,
            &args.worker_tls_ca,
        ),
        kruntimes_runtimed::grpc::GATEWAY_IDENTITY,
        args.tls_reload_interval,
    )
    .context("load the gateway's client certificate for workers")?;
    let gateway = system::start_gateway(
        client,
        &args.data_dir,
        args.addr,
        &args.gateway,
        &args.files,
        admin.is_file().then_some(admin.as_path()),
        system::GatewayFiles { serving, worker },
    )
    .await?;
    println!("gateway ready at {}", gateway.url);
    match &gateway.ca {
        Some(ca) => println!("  its CA: {}", ca.display()),
        None => println!(
            "  its CA: the issuer of {}",
            serving_cert.unwrap_or_default()
        ),
    }
    let stop = stop_requested()?;
    println!("kruntimes gateway ready");
    stop.await;
    tracing::info!("shutting down");
    gateway.gateway.shutdown().await;
    Ok(())
}

async fn up(args: UpArgs, log_format: LogFormat) -> anyhow::Result<()> {
    // Before anything reads or writes the data directory: a second `kruntimes up` on it
    // would overwrite the kubeconfig and certificates of the one that runs.
    let _lock = datadir::lock(&args.data_dir)?;
    report_leftovers(&datadir::clean_leftovers(&args.data_dir));
    let server =
        kruntimes_apiserver::start(args.apiserver.config(&args.data_dir, args.apiserver_addr))
            .await?;
    let kubeconfig = server.kubeconfig_path().to_path_buf();
    println!("apiserver ready at https://{}", server.local_addr());
    let system = if args.apiserver_only {
        None
    } else {
        Some(system::start(&args, &kubeconfig, log_format == LogFormat::Json).await?)
    };
    println!("kruntimes is up. Point kubectl and krt at it with:");
    println!("  export KUBECONFIG={}", kubeconfig.display());
    println!("  krt run --runtime python --wait -- python3 -c 'print(42)'");
    if let Some(system) = &system {
        println!("gateway ready at {}", system.gateway_url());
    }
    let stop = stop_requested()?;
    println!("kruntimes ready");

    stop.await;
    tracing::info!("shutting down");
    if let Some(system) = system {
        system.stop().await;
    }
    server.shutdown().await?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod install_tests;

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::{Cli, Command, DurabilityArg};

    #[test]
    fn a_worker_ca_secret_is_namespace_slash_name() {
        assert_eq!(
            super::secret_ref("kruntimes-system/kruntimes-worker-ca").unwrap(),
            (
                "kruntimes-system".to_string(),
                "kruntimes-worker-ca".to_string()
            )
        );
        assert!(
            super::secret_ref("team-a/ca.v2").is_ok(),
            "a name may have dots"
        );
        for bad in [
            "kruntimes-worker-ca",
            "a.b/ca",
            "ns/",
            "/ca",
            "ns/Ca",
            "ns/ca/x",
        ] {
            assert!(super::secret_ref(bad).is_err(), "{bad}");
        }
    }

    fn up(args: &[&str]) -> super::UpArgs {
        let argv = ["kruntimes", "up"].iter().chain(args);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Up(args) => *args,
            _ => panic!("not parsed as up"),
        }
    }

    /// Issue 15 item 5: runtimed's drain at shutdown, and what follows it, end before the
    /// local provisioner's SIGKILL (runtimed waited 5 + 5 s more after an 8 s drain).
    #[test]
    fn runtimed_exits_within_the_provisioners_grace() {
        let local = kruntimes_controller::local::LocalConfig::new("d", "k", "r", "c");
        assert!(
            kruntimes_runtimed::drain::EXIT_GRACE < local.grace,
            "runtimed may take {:?} from SIGTERM to exit; SIGKILL comes after {:?}",
            kruntimes_runtimed::drain::EXIT_GRACE,
            local.grace
        );
    }

    /// Issue 15 item 10: `kruntimes up` was `--durability process` by default, which may
    /// lose the last acknowledged writes on a power loss.
    #[test]
    fn durability_defaults_to_full_and_process_is_an_opt_in() {
        assert_eq!(up(&[]).apiserver.durability, DurabilityArg::Full);
        assert_eq!(
            up(&["--durability", "process"]).apiserver.durability,
            DurabilityArg::Process
        );
    }

    /// Issue 19 item 5: the idle TTL defaults to 168h, `0` disables it, and a negative one
    /// is refused at start with a message that says what to give instead.
    #[test]
    fn the_session_idle_ttl_defaults_to_a_week_and_refuses_a_negative_one() {
        assert_eq!(
            up(&[]).controller.session_idle_ttl,
            std::time::Duration::from_secs(168 * 3600)
        );
        assert!(
            up(&["--session-idle-ttl", "0"])
                .controller
                .session_idle_ttl
                .is_zero()
        );
        for form in [
            ["--session-idle-ttl", "-5m"].as_slice(),
            ["--session-idle-ttl=-1s"].as_slice(),
        ] {
            let argv = ["kruntimes", "up"].iter().chain(form);
            let Err(refused) = Cli::try_parse_from(argv) else {
                panic!("a negative idle TTL was accepted: {form:?}");
            };
            let text = refused.to_string();
            assert!(
                text.contains("--session-idle-ttl") && text.contains("negative"),
                "{text}"
            );
        }
    }

    /// Issue 17 item 1: a gateway URL that no endpoint could be built on is refused at
    /// start, naming the flag, rather than at every worker's first registration.
    #[test]
    fn a_gateway_url_that_is_not_https_host_port_is_refused() {
        let parse = |url: &str| {
            Cli::try_parse_from(["kruntimes", "controller-manager", "--gateway-url", url])
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        assert!(parse("https://127.0.0.1:7443").is_ok());
        assert!(parse("https://gateway.kruntimes-system.svc").is_ok());
        for bad in [
            "http://127.0.0.1:7443",
            "127.0.0.1:7443",
            "https://",
            "https://h/path",
            &format!("https://{}", "h".repeat(2000)),
        ] {
            let refused = parse(bad).expect_err(bad);
            assert!(refused.contains("--gateway-url"), "{bad}: {refused}");
        }
    }

    /// Issue 17 item 1: the commands share up's flags and defaults (one clap struct each).
    #[test]
    fn the_component_commands_take_ups_flags_with_its_defaults() {
        let parsed = Cli::try_parse_from([
            "kruntimes",
            "controller-manager",
            "--session-idle-ttl",
            "30m",
            "--sandbox",
            "process",
        ])
        .unwrap();
        let Command::ControllerManager(args) = parsed.command else {
            panic!("not parsed as controller-manager");
        };
        let up = up(&["--session-idle-ttl", "30m", "--sandbox", "process"]);
        assert_eq!(
            args.controller.session_idle_ttl,
            up.controller.session_idle_ttl
        );
        assert!(args.controller.sandbox == up.controller.sandbox);
        assert_eq!(
            args.controller.session_max_queue,
            up.controller.session_max_queue
        );
        assert_eq!(
            args.files.session_max_file_bytes,
            up.files.session_max_file_bytes
        );
        assert_eq!(args.provisioner, super::ProvisionerArg::Local);
        let parsed =
            Cli::try_parse_from(["kruntimes", "gateway", "--max-concurrent-requests", "7"])
                .unwrap();
        let Command::Gateway(gateway) = parsed.command else {
            panic!("not parsed as gateway");
        };
        assert_eq!(gateway.gateway.max_concurrent_requests, 7);
        assert_eq!(
            gateway.gateway.authorization_cache_ttl,
            up.gateway.authorization_cache_ttl
        );
        assert_eq!(gateway.addr, up.gateway_addr);
    }

    #[test]
    fn the_help_says_what_each_durability_promises() {
        let mut cli = Cli::command();
        let help = cli
            .find_subcommand_mut("up")
            .unwrap()
            .render_long_help()
            .to_string();
        assert!(help.contains("[default: full]"), "{help}");
        assert!(help.contains("power loss"), "{help}");
        assert!(help.contains("crash of the process"), "{help}");
    }
}
