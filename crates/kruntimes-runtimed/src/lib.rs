//! runtimed, the worker daemon (ARCHITECTURE.md, "Components").
//!
//! One runtimed runs per worker, next to the worker's runtime server. It
//!
//! - watches the Runs assigned to its Pod (`status.assignedPod`) and claims each one whose
//!   `assignedPodUID` is its own Pod UID: Scheduled → Running, with `startTime` and
//!   `attempt`;
//! - executes the Run through its runtime server (`TaskRuntime.Execute`) and writes the
//!   result: Succeeded or Failed with `exitCode`, `outputs` and `reason`; Timeout on
//!   `spec.timeout`; Cancelled on `termination: Immediate`;
//! - after a restart, recovers executions still running on the runtime server (it finds
//!   them by Run UID and attempt when it reconciles its Running Runs);
//! - serves the logs of its Runs and the invocations of its functions over gRPC
//!   (`kruntimes.runtimed.v1.Runtimed`), with mutual TLS when it has a workload
//!   certificate ([`grpc::WorkerTls`]), and forwards invocations of functions it does not
//!   own to their owner ([`functions::invoke`]).
//!
//! - on a normal shutdown (SIGTERM, or its stdin closing), claims nothing more and drains
//!   its registrations and tasks before it exits ([`drain`]).
//!
//! Every status write is a reconcile of the cached Run ([`reconcile`]), except the drain's
//! at shutdown. What ends or retries a Run here also leaves a Kubernetes Event on it
//! ([`events`]). Background work (waiting for an execution to end) only records a result in
//! [`tasks::executions`] and requeues the Run.
//!
//! One module per mode, and the parts they share:
//!
//! - [`tasks`]: claim, execute, wait, cancel and finish a task Run;
//! - [`functions`]: registration and unregistering, the endpoint, and [`functions::invoke`]
//!   (routing an invocation from the ownership cache);
//! - [`sessions`]: the per-session FIFO queue, the lease and the session lifecycle, with
//!   [`sessions::calls`] (the session calls of the gRPC API), [`sessions::checkpoints`],
//!   [`sessions::snapshots`] (suspend and resume) and [`sessions::audit`];
//! - shared: [`reconcile`] (the Run controller, which hands each Run to its mode, and the
//!   collector), [`claims`] (the claim gate), [`drain`], [`events`], [`grpc`] and
//!   [`metrics`].

#![forbid(unsafe_code)]

pub mod claims;
pub mod drain;
pub mod events;
pub mod functions;
pub mod grpc;
pub mod metrics;
pub mod reconcile;
pub mod sessions;
pub mod tasks;

/// The ArtifactStore lives in `kruntimes-store`, shared with the controller-manager's
/// snapshot collector.
pub use kruntimes_store as artifacts;
/// The ownership cache lives in `kruntimes-wire`, shared with the gateway.
pub use kruntimes_wire::ownership;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kruntimes_proto::runtime::v1 as rs;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tracing::{info, warn};

/// How runtimed starts.
#[derive(Debug, Clone)]
pub struct Config {
    /// The namespace of the worker's Pod and of the Runs it executes.
    pub namespace: String,
    /// The worker's Pod.
    pub pod_name: String,
    /// The Pod's UID when known at start (the downward API on a real cluster); otherwise
    /// runtimed reads it from the Pod once the Pod exists.
    pub pod_uid: Option<String>,
    /// The runtime server's Unix socket.
    pub runtime_socket: PathBuf,
    /// Where runtimed serves its gRPC API (a port of 0 picks a free one).
    pub listen: SocketAddr,
    /// The Runtime the worker belongs to (its Pod's `kruntimes.io/runtime` label).
    pub runtime: String,
    /// Where Ready functions are reached (the gateway); `None` publishes no endpoint.
    pub endpoint: Option<functions::EndpointConfig>,
    /// The worker's certificate (issued for `pod_name`), key and cluster CA: the gRPC port
    /// then requires mutual TLS, and forwarded calls use it as the client identity.
    /// `None` serves and forwards in plaintext (with a warning at start).
    pub tls: Option<grpc::WorkerTls>,
    /// Where to serve Prometheus metrics over HTTP (`GET /metrics`); `None` serves none.
    pub metrics_listen: Option<SocketAddr>,
    /// Platform-wide session limits.
    pub session_limits: sessions::SessionLimits,
    /// Where session audit lines are appended; `None` writes them to standard output.
    pub audit_log: Option<PathBuf>,
}

/// How long runtimed waits for the runtime server's socket to answer. In a worker Pod both
/// containers start together, so the runtime server may not listen yet; the local
/// provisioner starts runtimed only once it does.
pub const RUNTIME_SERVER_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Connects to the runtime server at `socket`, trying again (every 100 ms, bounded by
/// `wait`) while the socket is absent or refuses.
async fn connect_runtime_server(
    socket: &std::path::Path,
    wait: std::time::Duration,
) -> anyhow::Result<tonic::transport::Channel> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match kruntimes_proto::unix::connect(socket).await {
            Ok(channel) => return Ok(channel),
            Err(error) if tokio::time::Instant::now() < deadline => {
                tracing::debug!(error = %error, "the runtime server does not answer yet");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(error) => {
                return Err(anyhow::Error::new(error)
                    .context(format!("connect to the runtime server (waited {wait:?})")));
            }
        }
    }
}

/// Starts runtimed with `client` (runtimed's own identity) and runs it until `shutdown`
/// completes. `ready` is called with the bound gRPC address (and the bound metrics address,
/// when metrics are served) once the runtime server has answered and the listeners are
/// bound. A `shutdown` while it still waits for the runtime server ends it at once, with
/// `Ok`.
///
/// Errors: the runtime server cannot be reached or does not implement the task service,
/// the TLS material cannot serve, the address cannot be bound.
pub async fn run(
    client: Client,
    config: Config,
    ready: impl FnOnce(SocketAddr, Option<SocketAddr>),
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let mut shutdown = Box::pin(shutdown);
    // On a cluster the runtime server is a sidecar that may still be starting; a shutdown
    // meanwhile (the Pod deleted) ends the wait at once: nothing is claimed yet.
    info!(socket = %config.runtime_socket.display(), "waiting for the runtime server");
    let channel = tokio::select! {
        channel = connect_runtime_server(&config.runtime_socket, RUNTIME_SERVER_WAIT) => channel?,
        () = &mut shutdown => {
            info!("shut down before the runtime server answered");
            return Ok(());
        }
    };
    let capabilities = rs::runtime_info_client::RuntimeInfoClient::new(channel.clone())
        .capabilities(rs::CapabilitiesRequest {})
        .await
        .context("ask the runtime server for its capabilities")?
        .into_inner();
    if !capabilities
        .services
        .iter()
        .any(|s| s == rs::TASK_RUNTIME_SERVICE)
    {
        anyhow::bail!(
            "the runtime server does not implement {} (it implements {:?})",
            rs::TASK_RUNTIME_SERVICE,
            capabilities.services
        );
    }
    info!(
        adapter = %capabilities.adapter,
        interpreter = %capabilities.interpreter,
        isolation = capabilities.isolation,
        "runtime server answered"
    );

    if config.tls.is_none() {
        warn!(
            "runtimed serves its gRPC port without TLS: callers are not authenticated and \
             forwarded credentials cross the network in plaintext; pass --tls-cert, --tls-key \
             and --tls-ca"
        );
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("bind {}", config.listen))?;
    let addr = listener.local_addr().context("read the bound address")?;

    let (uid_tx, uid_rx) = watch::channel(config.pod_uid.clone());
    let context = Arc::new(reconcile::Context::new(
        client.clone(),
        config.namespace.clone(),
        config.pod_name.clone(),
        uid_rx,
        reconcile::RuntimeServer::new(&channel, &capabilities),
        config.endpoint.clone(),
        reconcile::SessionSetup {
            runtime: config.runtime.clone(),
            limits: config.session_limits.clone(),
            audit: Arc::new(
                sessions::audit::Audit::open(config.audit_log.as_deref())
                    .context("open the audit log")?,
            ),
        },
    ));
    let invoker = Arc::new(functions::invoke::Invoker {
        context: context.clone(),
        ownership: Arc::new(ownership::Ownership::default()),
        runtime: config.runtime.clone(),
        peers: functions::invoke::Peers::new(config.tls.clone(), config.namespace.clone()),
        identities: config.tls.is_some(),
        watches: std::sync::OnceLock::new(),
        authorizer: Arc::new(kruntimes_wire::Authorizer::new(
            client.clone(),
            kruntimes_wire::AuthorizerConfig::default(),
        )),
        revocations: std::sync::OnceLock::new(),
    });

    let (stop_tx, stop_rx) = watch::channel(false);
    let grpc = tokio::spawn(grpc::serve(
        listener,
        config.tls.clone(),
        invoker.clone(),
        until_stopped(stop_rx.clone()),
    ));
    let metrics_addr = match config.metrics_listen {
        Some(listen) => {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("bind the metrics address {listen}"))?;
            let bound = listener.local_addr().context("read the metrics address")?;
            tokio::spawn(metrics::serve(
                listener,
                context.metrics.clone(),
                until_stopped(stop_rx.clone()),
            ));
            Some(bound)
        }
        None => None,
    };
    ready(addr, metrics_addr);

    let uid_task = if config.pod_uid.is_none() {
        Some(tokio::spawn(resolve_pod_uid(
            client.clone(),
            config.namespace.clone(),
            config.pod_name.clone(),
            uid_tx,
        )))
    } else {
        None
    };

    let controller = tokio::spawn(reconcile::run(
        context.clone(),
        until_stopped(stop_rx.clone()),
    ));
    let collector = tokio::spawn(reconcile::collect_garbage(context.clone()));
    let slots = tokio::spawn(reconcile::watch_runtime(context.clone()));
    let checkpoints = tokio::spawn(sessions::checkpoints::watch(context.clone()));

    shutdown.await;
    // One deadline for everything from here to the exit (drain::EXIT_GRACE), inside the
    // provisioner's grace before SIGKILL.
    let drain_deadline = tokio::time::Instant::now() + drain::DRAIN_GRACE;
    let exit_deadline = drain_deadline + drain::STOP_GRACE;
    info!("runtimed shutting down: draining");
    context.begin_drain();
    collector.abort();
    slots.abort();
    checkpoints.abort();
    // Bounded twice: each step of the drain keeps to the deadline, and so does the whole.
    if tokio::time::timeout_at(
        drain_deadline,
        drain::drain_until(&context, drain_deadline, None),
    )
    .await
    .is_err()
    {
        warn!("the drain did not finish by its deadline");
    }
    // What the drain reported is written before the process ends, within the same exit
    // deadline (an API server that does not answer cannot hold the exit).
    let left = exit_deadline.saturating_duration_since(tokio::time::Instant::now());
    if !context.events.flush(left).await {
        warn!("Event writes still pending at exit were dropped");
    }
    let _ = stop_tx.send(true);
    drop(stop_rx);
    invoker.stop_watches();
    if let Some(task) = uid_task {
        task.abort();
    }
    if tokio::time::timeout_at(exit_deadline, controller)
        .await
        .is_err()
    {
        warn!("the reconciler did not stop in time; exiting");
    }
    match tokio::time::timeout_at(exit_deadline, grpc).await {
        Ok(Ok(Err(error))) => warn!(error = %error, "gRPC server failed"),
        Ok(_) => {}
        Err(_) => warn!("the gRPC server did not stop in time; exiting"),
    }
    Ok(())
}

/// Completes once `stop` turns true (or its sender is gone).
async fn until_stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Waits for the worker's Pod to exist and publishes its UID.
async fn resolve_pod_uid(
    client: Client,
    namespace: String,
    pod_name: String,
    uid: watch::Sender<Option<String>>,
) {
    let pods = Api::<Pod>::namespaced(client, &namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={pod_name}"));
    let mut stream = watcher(pods, config).applied_objects().boxed();
    while let Some(event) = stream.next().await {
        match event {
            Ok(pod) if pod.name_any() == pod_name => {
                if let Some(found) = pod.uid() {
                    info!(pod = %pod_name, uid = %found, "own Pod found");
                    uid.send_replace(Some(found));
                    return;
                }
            }
            Ok(_) => {}
            Err(error) => warn!(error = %error, "watching the own Pod"),
        }
    }
}
