//! Everything `kruntimes up` runs beside the API server: the controller-manager with the
//! local provisioner (which starts the workers: runtimed plus a runtime server each), the
//! gateway, and the default Runtimes. Each component talks to the API server with its own
//! identity (`DATA_DIR/components/<name>.kubeconfig`), exactly as it would on a cluster.
//! `kruntimes gateway` and `kruntimes controller-manager` start the same parts
//! ([`start_gateway`], [`start_controllers`]) one per process.
//!
//! The gateway and the workers' runtimeds authenticate each other with mutual TLS: the
//! data directory's CA issues the gateway's client certificate here (kept in memory) and
//! each worker incarnation's certificate in the local provisioner.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kruntimes_api::runtime::{RuntimeScaling, template_with_args};
use kruntimes_api::{Runtime, RuntimeSpec};
use kruntimes_controller::local::{LocalConfig, LocalProvisioner};
use kruntimes_controller::{Config as ControllerConfig, ControllerManager};
use kruntimes_gateway::{Gateway, GatewayConfig};
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::{ControllerFlags, FileFlags, GatewayFlags, UpArgs};

/// The namespace of the controller-manager's Lease.
const SYSTEM_NAMESPACE: &str = "kruntimes-system";
/// How long the default Runtimes' workers may take to become ready.
const READY_DEADLINE: Duration = Duration::from_secs(60);
/// The prefix of the controller-manager's Lease identity under `kruntimes up`.
const UP_IDENTITY_PREFIX: &str = "kruntimes-up-";
/// The lock file (in the data directory) of the one local provisioner of its workers.
const WORKERS_LOCK: &str = "workers.lock";
/// The workload name in the gateway's client certificate for workers.
const GATEWAY_WORKLOAD: &str = kruntimes_runtimed::functions::invoke::GATEWAY_IDENTITY;

/// The running components.
pub struct System {
    gateway: RunningGateway,
    controllers: Controllers,
}

impl System {
    pub fn gateway_url(&self) -> &str {
        &self.gateway.url
    }

    /// Stops the gateway, the controllers and every worker process.
    pub async fn stop(self) {
        self.gateway.gateway.shutdown().await;
        self.controllers.stop().await;
    }
}

/// A client with the identity of the kubeconfig at `path`.
pub async fn client_from(path: &Path) -> anyhow::Result<Client> {
    let kubeconfig = Kubeconfig::read_from(path)
        .with_context(|| format!("read the kubeconfig {}", path.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .with_context(|| format!("load the kubeconfig {}", path.display()))?;
    Client::try_from(config).context("build an API client")
}

/// The client of a component command: the kubeconfig at `path` when given, else what
/// `kube::Config::infer()` finds (`KUBECONFIG` or `~/.kube/config`, else the in-cluster
/// service account), so the same binary runs on a laptop and in a Pod.
pub async fn client(path: Option<&Path>) -> anyhow::Result<Client> {
    if let Some(path) = path {
        return client_from(path).await;
    }
    let config = kube::Config::infer().await.context(
        "find the API server: no --kubeconfig, no usable KUBECONFIG or ~/.kube/config, and \
         not in a Pod with a service account",
    )?;
    info!(apiserver = %config.cluster_url, "API server found by kube::Config::infer()");
    Client::try_from(config).context("build an API client")
}

/// A binary installed next to this one.
pub fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("find the kruntimes binary")?;
    let path = exe
        .parent()
        .map(|dir| dir.join(name))
        .context("the kruntimes binary has no directory")?;
    anyhow::ensure!(
        path.is_file(),
        "{} not found next to {} (build it: cargo build --workspace --bins)",
        path.display(),
        exe.display()
    );
    Ok(path)
}

/// A started gateway, its URL, and the file its CA was written to.
pub struct RunningGateway {
    pub gateway: Gateway,
    pub url: String,
    /// `DATA_DIR/components/gateway-ca.crt`, when a CA of the serving certificate is known.
    pub ca: Option<PathBuf>,
}

/// What `kruntimes gateway` reads from files (mounted Secrets) instead of what the data
/// directory's CA issues at every start.
#[derive(Default)]
pub struct GatewayFiles {
    /// `--tls-cert`: the serving certificate.
    pub serving: Option<ServingFiles>,
    /// `--worker-tls-cert`: the client identity towards workers' runtimeds, already being
    /// reloaded ([`kruntimes_runtimed::grpc::WorkerTls::watch`]).
    pub worker: Option<kruntimes_runtimed::grpc::WorkerTls>,
}

/// The serving certificate of `kruntimes gateway --tls-cert`: files, reloaded.
pub struct ServingFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA that issued it, published for the controller-manager.
    pub ca: Option<PathBuf>,
    pub reload_interval: Duration,
}

/// Starts the gateway of `kruntimes up` and `kruntimes gateway`: its serving certificate
/// and its client certificate for workers come from `tls_files`, else from the CA in
/// `DATA_DIR/pki` (issued at every start, the client one never written to disk); the CA of
/// the serving certificate goes to
/// `DATA_DIR/components/gateway-ca.crt` for the controller-manager to publish, and the
/// URL into `admin_kubeconfig` (krt finds the gateway there) when given.
pub async fn start_gateway(
    client: Client,
    data_dir: &Path,
    addr: SocketAddr,
    flags: &GatewayFlags,
    files: &FileFlags,
    admin_kubeconfig: Option<&Path>,
    tls_files: GatewayFiles,
) -> anyhow::Result<RunningGateway> {
    let serving = tls_files.serving.as_ref();
    let components = data_dir.join("components");
    let pki_dir = data_dir.join("pki");
    let pki = kruntimes_apiserver::tls::prepare(&pki_dir, addr.ip())
        .context("prepare the gateway's certificate")?;
    let server_config = match serving {
        Some(files) => {
            let cert = kruntimes_gateway::serving_cert::ServingCert::load(&files.cert, &files.key)
                .context("load the gateway's serving certificate")?;
            // Ends by itself once the gateway (the last holder of the certificate) is gone.
            cert.watch(files.reload_interval);
            cert.server_config()
                .context("configure TLS with the gateway's serving certificate")?
        }
        None => pki.server_config,
    };
    let mut gateway_config = GatewayConfig::new(addr, server_config);
    gateway_config.invoke_routing = match flags.invoke_routing {
        crate::RoutingArg::Owner => kruntimes_gateway::InvokeRouting::Owner,
        crate::RoutingArg::Service => kruntimes_gateway::InvokeRouting::Service,
    };
    gateway_config.max_session_connections = flags.max_session_connections;
    gateway_config.max_concurrent = flags.max_concurrent_requests;
    gateway_config.max_file_bytes = files.session_max_file_bytes;
    gateway_config.authorizer.ttl = flags.authorization_cache_ttl;
    gateway_config.authorizer.capacity = flags.authorization_cache_capacity;
    // The workers write task logs here, outside their roots; the gateway serves them from
    // here once their worker is gone.
    gateway_config.log_store = Some(data_dir.join(crate::logstore::LOG_DIR));
    // The gateway's identity towards workers (mutual TLS on their gRPC ports). Without
    // files, issued at every start, like its serving certificate, and never written to disk.
    let worker_tls = match tls_files.worker {
        Some(tls) => tls,
        None => {
            let client_cert = kruntimes_apiserver::tls::issue_workload(
                &pki_dir,
                GATEWAY_WORKLOAD,
                &[],
                kruntimes_controller::local::WORKER_CERT_VALIDITY,
            )
            .context("issue the gateway's client certificate for workers")?;
            kruntimes_runtimed::grpc::WorkerTls::from_pem(
                client_cert.cert_pem,
                client_cert.key_pem,
                client_cert.ca_pem,
                "the gateway's issued client certificate",
            )
            .context("load the gateway's client certificate for workers")?
        }
    };
    gateway_config.worker_tls = Some(worker_tls);
    let gateway = kruntimes_gateway::start(client, gateway_config)
        .await
        .context("start the gateway")?;
    let url = gateway.url();
    if let Some(admin_kubeconfig) = admin_kubeconfig {
        kruntimes_apiserver::auth::set_gateway_in_kubeconfig(admin_kubeconfig, &url)
            .context("record the gateway in the kubeconfig")?;
    }
    // The gateway's CA verifies its certificate; Ready functions publish both.
    let ca = components.join("gateway-ca.crt");
    std::fs::create_dir_all(&components)
        .with_context(|| format!("create {}", components.display()))?;
    let ca_pem = match serving {
        None => Some(pki.ca_pem.into_bytes()),
        Some(ServingFiles { ca: Some(path), .. }) => Some(
            std::fs::read(path)
                .with_context(|| format!("read the serving certificate's CA {}", path.display()))?,
        ),
        Some(ServingFiles { ca: None, .. }) => None,
    };
    let Some(ca_pem) = ca_pem else {
        // A CA of an earlier start is not this certificate's.
        match std::fs::remove_file(&ca) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("remove {}", ca.display())),
        }
        return Ok(RunningGateway {
            gateway,
            url,
            ca: None,
        });
    };
    std::fs::write(&ca, ca_pem).with_context(|| format!("write {}", ca.display()))?;
    Ok(RunningGateway {
        gateway,
        url,
        ca: Some(ca),
    })
}

/// What the controller-manager of `kruntimes up` and `kruntimes controller-manager` is
/// started with.
pub struct ControllerSettings<'a> {
    pub data_dir: &'a Path,
    pub flags: &'a ControllerFlags,
    pub files: &'a FileFlags,
    /// Published in Ready functions' endpoints.
    pub gateway_url: &'a str,
    pub gateway_ca: &'a Path,
    pub runtimed_kubeconfig: PathBuf,
    pub runtime_server_bin: PathBuf,
    /// The bound health address ([`crate::health`]).
    pub health: tokio::net::TcpListener,
    /// Whether this process holds the data directory's lock, so that a Lease held by an
    /// earlier holder of the lock is a dead process's, taken over at once.
    pub holds_data_dir_lock: bool,
    /// The workers (runtimed and runtime server) log JSON too.
    pub json_logs: bool,
}

/// The running controller-manager: its controllers, local provisioner, health server and
/// log store keeper.
pub struct Controllers {
    /// The local provisioner and the lock of its workers' directory, held until every
    /// worker has stopped; none with the Kubernetes provisioner (the cluster runs the
    /// workers).
    local: Option<(LocalProvisioner, crate::datadir::DataDirLock)>,
    stop_controllers: watch::Sender<bool>,
    controllers: tokio::task::JoinHandle<()>,
    health: tokio::task::JoinHandle<std::io::Result<()>>,
    /// The log store's keeper (local workers only: on a cluster the kubelet keeps logs).
    log_keeper: Option<tokio::task::JoinHandle<()>>,
    leading: watch::Receiver<bool>,
}

impl Controllers {
    /// Whether this replica leads.
    pub fn leading(&self) -> watch::Receiver<bool> {
        self.leading.clone()
    }

    /// Stops the controllers (releasing the Lease), the health server, the log store's
    /// keeper and every worker process, each within a bound.
    pub async fn stop(self) {
        let _ = self.stop_controllers.send(true);
        if tokio::time::timeout(Duration::from_secs(10), self.controllers)
            .await
            .is_err()
        {
            warn!("the controller-manager did not stop within 10 s");
        }
        if tokio::time::timeout(Duration::from_secs(5), self.health)
            .await
            .is_err()
        {
            warn!("the controller-manager's metrics server did not stop within 5 s");
        }
        // The keeper stops with the controllers (it watches the same signal).
        if let Some(keeper) = self.log_keeper
            && tokio::time::timeout(Duration::from_secs(5), keeper)
                .await
                .is_err()
        {
            warn!("the log store's keeper did not stop within 5 s");
        }
        if let Some((provisioner, workers_lock)) = self.local {
            provisioner.shutdown().await;
            drop(workers_lock);
        }
    }
}

/// Starts the controller-manager with the local provisioner (which starts the workers:
/// runtimed plus a runtime server each, in `DATA_DIR/workers`), its health server on
/// `settings.health`, and the log store's keeper. Returns once they run; leading comes
/// later ([`Controllers::leading`]).
pub async fn start_controllers(
    client: Client,
    settings: ControllerSettings<'_>,
) -> anyhow::Result<Controllers> {
    let ControllerSettings {
        data_dir,
        flags,
        files,
        gateway_url,
        gateway_ca,
        runtimed_kubeconfig,
        runtime_server_bin,
        health,
        holds_data_dir_lock,
        json_logs,
    } = settings;
    // One local provisioner per workers directory: a second one would take the running
    // workers for a dead incarnation's (it removes their TLS material at start). Under
    // `up` the data directory's lock already says so; a `controller-manager` beside the
    // API server holds only this one.
    let workers_lock = crate::datadir::lock_named(data_dir, WORKERS_LOCK).with_context(|| {
        format!(
            "another controller-manager (or kruntimes up) runs the local workers of {}",
            data_dir.display()
        )
    })?;
    if !holds_data_dir_lock {
        // Holding the workers' lock means no earlier provisioner of them still runs.
        crate::report_leftovers(&crate::datadir::clean_leftovers(data_dir));
    }
    let log_dir = data_dir.join(crate::logstore::LOG_DIR);
    let mut local = LocalConfig::new(
        data_dir,
        std::env::current_exe().context("find the kruntimes binary")?,
        runtime_server_bin,
        runtimed_kubeconfig,
    );
    local.worker_pki = Some(data_dir.join("pki"));
    local.log_dir = Some(log_dir.clone());
    let sandbox = choose_sandbox(flags.sandbox, &local.runtime_server_bin).await?;
    local.runtime_server_env = vec![("KRUNTIMES_SANDBOX".to_string(), sandbox.to_string())];
    if json_logs {
        local
            .runtime_server_env
            .push(("KRUNTIMES_LOG_FORMAT".to_string(), "json".to_string()));
    }
    local.runtimed_args = vec![
        "--gateway-url".to_string(),
        gateway_url.to_string(),
        "--gateway-ca".to_string(),
        gateway_ca.display().to_string(),
        "--session-max-queue".to_string(),
        flags.session_max_queue.to_string(),
        "--session-max-operation-timeout".to_string(),
        flags.session_max_operation_timeout.to_string(),
        "--session-close-timeout".to_string(),
        flags.session_close_timeout.to_string(),
        "--session-max-file-bytes".to_string(),
        files.session_max_file_bytes.to_string(),
        "--session-activity-interval".to_string(),
        format!(
            "{}ms",
            activity_interval(flags.session_idle_ttl).as_millis()
        ),
        // Suspend snapshots: the workers' local copies, and the store when a Runtime names
        // no artifactStore (shared by the workers of this machine).
        "--snapshot-dir".to_string(),
        data_dir.join("snapshots").display().to_string(),
    ];
    if json_logs {
        local
            .runtimed_args
            .extend(["--log-format".to_string(), "json".to_string()]);
    }
    let provisioner =
        LocalProvisioner::new(client.clone(), local).context("start the local provisioner")?;
    let mut controller_config = ControllerConfig::new(SYSTEM_NAMESPACE);
    if holds_data_dir_lock {
        // This process holds the data directory's lock (datadir.rs), so a Lease held by an
        // earlier `kruntimes up` of this directory is a dead process's: take it over at once.
        controller_config.lease = controller_config
            .lease
            .predecessors_gone(UP_IDENTITY_PREFIX);
    }
    controller_config.session_idle_ttl = flags.session_idle_ttl;
    controller_config.idle_sweep_interval = flags.session_idle_sweep_interval;
    // The workers' default snapshot store (`--snapshot-dir` below + `store`, as runtimed
    // derives it), collected beside every Runtime's ArtifactStore.
    controller_config.snapshot_store = Some(data_dir.join("snapshots").join("store"));
    controller_config.snapshot_gc_interval = flags.snapshot_gc_interval;
    controller_config.snapshot_gc_grace = flags.snapshot_gc_grace;
    let keeper_client = client.clone();
    let mut controllers = run_manager(client, controller_config, provisioner.clone(), health);
    controllers.log_keeper = Some(crate::logstore::spawn(
        keeper_client,
        crate::logstore::KeeperConfig {
            dir: log_dir,
            max_bytes: flags.log_store_max_size,
            interval: flags.log_store_check_interval,
        },
        controllers.stop_controllers.subscribe(),
    ));
    controllers.local = Some((provisioner, workers_lock));
    Ok(controllers)
}

/// Starts the controller-manager with the Kubernetes provisioner (a Deployment and a
/// Service per Runtime; the cluster runs the workers) and its health server on `health`.
pub fn start_kubernetes_controllers(
    client: Client,
    flags: &ControllerFlags,
    config: kruntimes_controller::kubernetes::KubernetesConfig,
    health: tokio::net::TcpListener,
) -> Controllers {
    let provisioner =
        kruntimes_controller::kubernetes::KubernetesProvisioner::new(client.clone(), config);
    // The gateway's Pods wait for its worker material, whether or not a Runtime exists:
    // issued from the start, by every replica (what one issues is as good as another's),
    // for the life of the process.
    if let Some(certs) = provisioner.worker_certs() {
        tokio::spawn(certs.clone().keep_gateway());
    }
    let mut controller_config = ControllerConfig::new(SYSTEM_NAMESPACE);
    controller_config.session_idle_ttl = flags.session_idle_ttl;
    controller_config.idle_sweep_interval = flags.session_idle_sweep_interval;
    // No store of this machine's: on a cluster snapshot data lives in each Runtime's
    // ArtifactStore, which the collector lists.
    controller_config.snapshot_store = None;
    controller_config.snapshot_gc_interval = flags.snapshot_gc_interval;
    controller_config.snapshot_gc_grace = flags.snapshot_gc_grace;
    run_manager(client, controller_config, provisioner, health)
}

/// The controller-manager under its Lease with `provisioner`, and its health server.
fn run_manager<P: kruntimes_controller::provisioner::WorkerProvisioner + Clone>(
    client: Client,
    controller_config: ControllerConfig,
    provisioner: P,
    health: tokio::net::TcpListener,
) -> Controllers {
    let metrics = controller_config.metrics.clone();
    let manager =
        ControllerManager::with_provisioner(client.clone(), controller_config, provisioner);
    let leading = manager.leading();
    let (stop_controllers, mut stopped) = watch::channel(false);
    let health_stop = stopped.clone();
    let lead = leading.clone();
    let probes = crate::health::Probes {
        // Ready when the API server answers; a standby is ready too (it takes over when
        // the leader goes), so a rolling update of several replicas is not held up.
        ready: crate::health::api_reachable(client, move || {
            if *lead.borrow() {
                "leading".to_string()
            } else {
                "standing by (another replica leads, or the Lease is being taken)".to_string()
            }
        }),
        metrics: std::sync::Arc::new(move || metrics.encode()),
    };
    let health = tokio::spawn(crate::health::serve(health, probes, async move {
        let mut stop = health_stop;
        let _ = stop.wait_for(|s| *s).await;
    }));
    let controllers = tokio::spawn(async move {
        let shutdown = async move {
            let _ = stopped.wait_for(|s| *s).await;
        };
        if let Err(error) = manager.run(shutdown).await {
            tracing::error!(error = %error, "the controller-manager stopped");
        }
    });
    Controllers {
        local: None,
        stop_controllers,
        controllers,
        health,
        log_keeper: None,
        leading,
    }
}

/// Starts everything but the API server. `json_logs`: the workers' runtimeds log JSON too.
pub async fn start(
    args: &UpArgs,
    admin_kubeconfig: &Path,
    json_logs: bool,
) -> anyhow::Result<System> {
    let data_dir = &args.data_dir;
    let components = data_dir.join("components");

    let gateway = start_gateway(
        client_from(&components.join("gateway.kubeconfig")).await?,
        data_dir,
        args.gateway_addr,
        &args.gateway,
        &args.files,
        Some(admin_kubeconfig),
        GatewayFiles::default(),
    )
    .await?;
    let gateway_ca = gateway
        .ca
        .clone()
        .context("the gateway of `kruntimes up` has the data directory's CA")?;

    let (health, metrics_addr) =
        crate::health::bind(args.controller_metrics_addr, "controller-manager").await?;
    let controllers = start_controllers(
        client_from(&components.join("controller-manager.kubeconfig")).await?,
        ControllerSettings {
            data_dir,
            flags: &args.controller,
            files: &args.files,
            gateway_url: &gateway.url,
            gateway_ca: &gateway_ca,
            runtimed_kubeconfig: components.join("runtimed.kubeconfig"),
            runtime_server_bin: sibling("kruntimes-runtime-server")?,
            health,
            holds_data_dir_lock: true,
            json_logs,
        },
    )
    .await?;
    println!("controller-manager metrics at http://{metrics_addr}/metrics");
    let mut leading = controllers.leading();
    let system = System {
        gateway,
        controllers,
    };

    // The default Runtimes, created once: later changes by the user are kept.
    let admin = client_from(admin_kubeconfig).await?;
    let defaults = [
        default_runtime("bash", "bash", args)?,
        default_runtime("python", "python", args)?,
    ];
    let runtimes = Api::<Runtime>::namespaced(admin, "default");
    for runtime in &defaults {
        match runtimes.create(&PostParams::default(), runtime).await {
            Ok(_) => info!(runtime = %runtime.name_any(), "default Runtime created"),
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(error) => {
                return Err(error)
                    .context(format!("create the default Runtime {}", runtime.name_any()));
            }
        }
    }
    // Ready means ready to schedule: the controller-manager leads (it has fenced the
    // workers of an earlier process), and each default Runtime has its ready workers.
    tokio::time::timeout(READY_DEADLINE, leading.wait_for(|leading| *leading))
        .await
        .with_context(|| {
            format!("the controller-manager did not take the lead within {READY_DEADLINE:?}")
        })?
        .context("the controller-manager stopped before it took the lead")?;
    let pods = Api::<Pod>::namespaced(runtimes.clone().into_client(), "default");
    for runtime in &defaults {
        wait_ready(&pods, &runtime.name_any(), runtime.spec.replicas).await?;
    }
    Ok(system)
}

/// The workers' `--session-activity-interval` for an idle TTL: a minute, or a tenth of a
/// TTL under ten minutes (at least 100 ms), so the idle clock's granularity stays well
/// under the TTL.
pub(crate) fn activity_interval(ttl: Duration) -> Duration {
    let minute = kruntimes_runtimed::sessions::DEFAULT_ACTIVITY_INTERVAL;
    if ttl.is_zero() {
        return minute;
    }
    (ttl / 10).clamp(Duration::from_millis(100), minute)
}

/// A default Runtime of `kruntimes up`: a warm pool that scales with demand.
fn default_runtime(name: &str, adapter: &str, args: &UpArgs) -> anyhow::Result<Runtime> {
    if args.default_max_replicas < args.default_min_replicas {
        anyhow::bail!(
            "--default-max-replicas ({}) must be at least --default-min-replicas ({})",
            args.default_max_replicas,
            args.default_min_replicas
        );
    }
    let delay = i32::try_from(args.default_scale_down_delay.as_secs())
        .ok()
        .filter(|s| *s <= 86_400)
        .context("--default-scale-down-delay must be at most 24h")?;
    Ok(Runtime::new(
        name,
        RuntimeSpec {
            replicas: args.default_min_replicas,
            scaling: Some(RuntimeScaling {
                min_replicas: args.default_min_replicas,
                max_replicas: args.default_max_replicas,
                warm_runs: Some(args.default_warm_runs),
                scale_down_delay_seconds: Some(delay),
            }),
            runs: Some(args.default_runs),
            template: template_with_args(vec!["--adapter".to_string(), adapter.to_string()]),
            port: None,
            artifact_store: None,
        },
    ))
}

/// Waits until `replicas` worker Pods of the Runtime are ready workers. Counted from the
/// Pods rather than `Runtime.status`, which may still show an earlier process's workers.
async fn wait_ready(pods: &Api<Pod>, name: &str, replicas: i32) -> anyhow::Result<()> {
    let selector = format!("{}={name}", kruntimes_controller::scheduler::RUNTIME_LABEL);
    let (store, writer) = reflector::store();
    let mut events = reflector::reflector(
        writer,
        watcher::watcher(pods.clone(), watcher::Config::default().labels(&selector)),
    )
    .default_backoff()
    .boxed();
    let wanted = usize::try_from(replicas).unwrap_or(0);
    let ready = async {
        let mut synced = false;
        loop {
            let count = store
                .state()
                .iter()
                .filter(|pod| kruntimes_controller::placement::is_ready_worker(pod))
                .count();
            if synced && count >= wanted {
                return Ok(());
            }
            match events.next().await {
                Some(Ok(watcher::Event::InitDone)) => synced = true,
                Some(Ok(_)) => {}
                Some(Err(error)) => warn!(error = %error, runtime = name, "watching worker Pods"),
                None => anyhow::bail!("the watch of Runtime {name}'s Pods ended"),
            }
        }
    };
    tokio::time::timeout(READY_DEADLINE, ready)
        .await
        .with_context(|| {
            format!(
                "the workers of Runtime {name} were not ready within {READY_DEADLINE:?}; see DATA_DIR/workers/*/ for their logs"
            )
        })?
}

/// The workers' sandbox backend: `process` when asked; `gvisor` when asked and a probe
/// sandbox works; otherwise whatever a probe of the runtime server finds (`namespaces`
/// where this machine supports it). Falling back is logged as a warning; asking for
/// `namespaces` or `gvisor` where it cannot work is an error.
async fn choose_sandbox(
    asked: crate::SandboxArg,
    runtime_server: &std::path::Path,
) -> anyhow::Result<&'static str> {
    if asked == crate::SandboxArg::Process {
        tracing::warn!(
            "sandbox backend: process (trusted workloads only: no isolation of untrusted code)"
        );
        return Ok("process");
    }
    let gvisor = asked == crate::SandboxArg::Gvisor;
    let output = tokio::process::Command::new(runtime_server)
        .arg("--probe-sandbox")
        .args(gvisor.then_some("gvisor"))
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .with_context(|| format!("probe the sandbox with {}", runtime_server.display()))?;
    let text = String::from_utf8_lossy(&output.stdout);
    let (backend, detail) = text
        .trim()
        .split_once('\t')
        .unwrap_or(("process", text.trim()));
    match backend {
        "gvisor" if gvisor => {
            tracing::info!(enforced = %detail, "sandbox backend: gvisor");
            Ok("gvisor")
        }
        _ if gvisor => {
            anyhow::bail!("the gvisor sandbox cannot be used on this machine: {detail}")
        }
        "namespaces" => {
            tracing::info!(enforced = %detail, "sandbox backend: namespaces");
            Ok("namespaces")
        }
        _ if asked == crate::SandboxArg::Namespaces => {
            anyhow::bail!("the namespaces sandbox cannot be used on this machine: {detail}")
        }
        _ => {
            tracing::warn!(reason = %detail, "the namespaces sandbox is not supported on this machine; workers fall back to the process backend, which does not isolate untrusted code");
            Ok("process")
        }
    }
}
