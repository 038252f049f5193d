//! The local provisioner: the workers of each Runtime are processes on this machine
//! (docs/task-mode.md, "Workers in standalone mode").
//!
//! One worker is one `kruntimes-runtime-server` process plus one `kruntimes runtimed`
//! process, each in its own process group, each with a pipe as standard input whose write
//! end the provisioner holds (both run with `--exit-with-stdin`, so a killed parent leaves
//! no worker behind). Each incarnation of a worker gets a fresh Pod object
//! (`<runtime>-<5 random [a-z0-9]>`, a fresh UID) and a directory
//! `DATA_DIR/workers/<pod-name>/` with `runtime.sock`, `root/`, `runtime-server.log` and
//! `runtimed.log`, and, with [`LocalConfig::worker_pki`], `tls/` holding the incarnation's
//! workload certificate (`tls.crt`, issued by the CA for the worker identity
//! `POD.NAMESPACE.kruntimes-worker` and 127.0.0.1),
//! its key (`tls.key`, mode 0600) and the CA (`ca.crt`); runtimed gets them as
//! `--tls-cert`, `--tls-key` and `--tls-ca` and serves mutual TLS. `root/`, the socket and
//! `tls/` go with the incarnation; the logs stay. With [`LocalConfig::log_dir`] (`kruntimes
//! up` sets `DATA_DIR/logs`), every runtime server writes the stdout and stderr of task
//! executions into that log store (`KRUNTIMES_RUNTIME_LOG_DIR`), outside `root/`, so they
//! outlive every incarnation.
//!
//! Each worker *slot* of a Runtime is one supervising task. An incarnation:
//!
//! 1. starts the runtime server and waits for its `listening on PATH` line;
//! 2. starts runtimed and waits for its `runtimed listening on 127.0.0.1:PORT` line
//!    (both within [`LocalConfig::startup_timeout`]);
//! 3. creates the Pod (labels, owner reference, the `runtimed` port) and writes its status:
//!    phase Running, `podIP` 127.0.0.1, `Ready=True`;
//! 4. waits until either process exits, the slot is stopped, or the Runtime's worker
//!    template changes.
//!
//! A crash (either process exits) stops the other process (SIGTERM to its process group,
//! SIGKILL after [`LocalConfig::grace`]), deletes the Pod and starts a new incarnation after
//! a crash-loop backoff. A planned stop (scale-down, Runtime deletion, shutdown, a new
//! template) first writes `Ready=False`, then stops runtimed and the runtime server, then
//! deletes the Pod.
//!
//! A slot registers its Pod name before it creates the Pod and forgets it only after it
//! deleted the Pod, so [`LocalProvisioner::reconcile`] can delete every other Pod labelled
//! for the Runtime (left by an earlier `kruntimes up`, or by a delete that failed) without
//! ever deleting a live worker's Pod.
//!
//! Of the Runtime's Pod template, the local provisioner honours the `runtime` container's
//! command, args, literal env and the resource limits `memory`, `cpu` and `pids`
//! ([`WorkerTemplate`]); everything else it names in the Runtime's `ImageIgnored` condition
//! ([`ignored_template_fields`]). The runtime server's command line is
//! `kruntimes-runtime-server --socket DIR/runtime.sock
//! --root DIR/root --exit-with-stdin <args...>` with the container's env added to its
//! environment. Variable references expand as on a cluster ([`expand_references`]):
//! `$(NAME)` in an env value names a variable defined before it in the container's env,
//! in `command` and `args` any variable of the runtime server's environment
//! (`KRUNTIMES_RUNTIME_SOCKET` and `KRUNTIMES_RUNTIME_ROOT` too); `$$` is a literal `$`,
//! and a reference to an unknown variable, or to one with `valueFrom` (which the local
//! provisioner ignores and names), stays as written. A non-empty `command` replaces the
//! binary and those leading flags (`command... args...`); the replacement finds its socket and root in
//! `KRUNTIMES_RUNTIME_SOCKET` and `KRUNTIMES_RUNTIME_ROOT` and must print the same ready
//! line. `spec.port` is not used locally: every runtimed listens on `127.0.0.1:0` and the Pod
//! publishes the port it got.
//!
//! Workers outlive a leadership term of the controller-manager: they are stopped only by a
//! reconcile, [`WorkerProvisioner::cleanup`], [`LocalProvisioner::shutdown`] or dropping the
//! last handle (which stops them in the background while the Tokio runtime lives, and kills
//! them when it goes).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, ContainerPort, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kruntimes_api::runtime::RUNTIME_CONTAINER;
use kruntimes_api::{Runtime, RuntimeSpec, run::EnvVar};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, Resource, ResourceExt};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::error::is_not_found;
use crate::provisioner::{WorkerCounts, WorkerProvisioner};
use crate::scheduler::{RUNTIME_LABEL, list_all};
use crate::status::now_rfc3339;

/// The label that says which provisioner made a worker Pod.
pub const PROVISIONER_LABEL: &str = "kruntimes.io/provisioner";
/// The value of [`PROVISIONER_LABEL`] on the local provisioner's Pods.
pub const LOCAL_PROVISIONER: &str = "local";
/// The name of the worker container and of its port.
pub const RUNTIMED_CONTAINER: &str = "runtimed";
/// The line prefix the runtime server prints once its socket accepts connections.
pub const RUNTIME_SERVER_READY: &str = "listening on ";
/// The line prefix runtimed prints once it serves.
pub const RUNTIMED_READY: &str = "runtimed listening on ";
/// The name of the worker Pod's container port where runtimed serves its metrics.
pub const METRICS_PORT: &str = "metrics";
/// The longest path a Unix socket address holds (`sun_path` is 108 bytes with its NUL).
pub const MAX_SOCKET_PATH: usize = 107;
/// The address workers listen on and publish as `status.podIP`.
const WORKER_IP: &str = "127.0.0.1";
/// Backoff between retries of one API call inside an incarnation.
const API_RETRY_MIN: Duration = Duration::from_millis(200);
const API_RETRY_MAX: Duration = Duration::from_secs(5);
/// How long a stopping worker tries to delete its Pod before it leaves it to the sweep.
const DELETE_DEADLINE: Duration = Duration::from_secs(10);
/// How long writing `Ready=False` before a planned stop may take.
const UNREADY_DEADLINE: Duration = Duration::from_secs(2);
/// Lines of a process's stdout kept for the error when it never prints its ready line.
const KEPT_LINES: usize = 20;
/// How long a worker's certificate is valid. It is issued anew for every incarnation and
/// its key is removed with the incarnation; nothing rotates it within one.
pub const WORKER_CERT_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// The subdirectory of an incarnation's directory that holds its TLS material.
pub const WORKER_TLS_DIR: &str = "tls";

/// The local provisioner's settings.
#[derive(Debug, Clone)]
pub struct LocalConfig {
    /// The data directory; workers live under `DATA_DIR/workers/`.
    pub data_dir: PathBuf,
    /// The `kruntimes` binary, run as `kruntimes runtimed ...`.
    pub kruntimes_bin: PathBuf,
    /// The `kruntimes-runtime-server` binary (unless a Runtime's `template.command` replaces
    /// it).
    pub runtime_server_bin: PathBuf,
    /// The kubeconfig runtimed talks to the API with (its own identity).
    pub runtimed_kubeconfig: PathBuf,
    /// Between SIGTERM and SIGKILL when a worker process is stopped.
    pub grace: Duration,
    /// How long both processes of an incarnation may take to print their ready lines.
    pub startup_timeout: Duration,
    /// The first delay before a crashed worker is started again; it doubles per crash.
    pub min_backoff: Duration,
    /// The longest delay before a crashed worker is started again.
    pub max_backoff: Duration,
    /// A worker that lived this long resets the backoff to `min_backoff`.
    pub backoff_reset: Duration,
    /// Arguments added to every `kruntimes runtimed` command line (for example
    /// `--gateway-url URL --gateway-ca FILE`).
    pub runtimed_args: Vec<String>,
    /// Environment of every runtime server (for example `KRUNTIMES_SANDBOX=namespaces`);
    /// a Runtime's `template.env` and `template.args` override it.
    pub runtime_server_env: Vec<(String, String)>,
    /// The directory of the CA (`ca.crt`, `ca.key`; `DATA_DIR/pki` in standalone mode)
    /// that issues every incarnation's workload certificate, so that runtimed serves and
    /// forwards with mutual TLS. `None`: runtimed runs without TLS.
    pub worker_pki: Option<PathBuf>,
    /// The log store every runtime server writes task stdout and stderr to
    /// (`KRUNTIMES_RUNTIME_LOG_DIR`, [`kruntimes_api::logstore`]); whoever sets it keeps
    /// the store. `None`: each execution's workspace, which goes with its incarnation.
    pub log_dir: Option<PathBuf>,
}

impl LocalConfig {
    /// Settings with the default timings: grace 10 s (runtimed drains and exits within 9 s), startup 30 s, backoff 0.5 s doubling
    /// to 30 s, reset after a worker lived 60 s.
    pub fn new(
        data_dir: impl Into<PathBuf>,
        kruntimes_bin: impl Into<PathBuf>,
        runtime_server_bin: impl Into<PathBuf>,
        runtimed_kubeconfig: impl Into<PathBuf>,
    ) -> LocalConfig {
        LocalConfig {
            data_dir: data_dir.into(),
            kruntimes_bin: kruntimes_bin.into(),
            runtime_server_bin: runtime_server_bin.into(),
            runtimed_kubeconfig: runtimed_kubeconfig.into(),
            grace: Duration::from_secs(10),
            startup_timeout: Duration::from_secs(30),
            min_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
            backoff_reset: Duration::from_secs(60),
            runtimed_args: Vec::new(),
            runtime_server_env: Vec::new(),
            worker_pki: None,
            log_dir: None,
        }
    }

    /// `DATA_DIR/workers`.
    pub fn workers_dir(&self) -> PathBuf {
        self.data_dir.join("workers")
    }
}

/// What went wrong in the local provisioner.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    /// The provisioner was shut down; it starts no more workers.
    #[error("the local provisioner is shut down")]
    ShutDown,
    /// An object came without a field the API always sets.
    #[error("{kind} {name} has no {field}")]
    MissingField {
        kind: &'static str,
        name: String,
        field: &'static str,
    },
    /// A file system step failed.
    #[error("failed to {action} {path}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A worker's socket path does not fit in a Unix socket address.
    #[error(
        "the socket path {path} is {len} bytes, more than the {MAX_SOCKET_PATH} a Unix socket \
         allows; use a shorter data directory or Runtime name"
    )]
    SocketPathTooLong { path: PathBuf, len: usize },
    /// A worker's certificate could not be issued or written.
    #[error("failed to issue the TLS certificate of worker {pod}")]
    Certificate {
        pod: String,
        #[source]
        source: kruntimes_apiserver::tls::TlsError,
    },
    /// A worker process could not be started.
    #[error("failed to start the {what} ({program})")]
    Spawn {
        what: &'static str,
        program: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A worker process ended or failed before it printed its ready line.
    #[error("the {what} did not become ready: {reason}; see {log}")]
    NotReady {
        what: &'static str,
        reason: String,
        log: PathBuf,
    },
    /// An API request failed.
    #[error("failed to {action} Pod {namespace}/{name}")]
    Pod {
        action: &'static str,
        namespace: String,
        name: String,
        #[source]
        source: Box<kube::Error>,
    },
    /// Listing a Runtime's Pods failed.
    #[error(transparent)]
    List(Box<crate::Error>),
    /// A Runtime's worker template cannot be run locally.
    #[error("Runtime {namespace}/{name}: {reason}")]
    Template {
        namespace: String,
        name: String,
        reason: String,
    },
}

/// One live worker, for diagnostics and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerInfo {
    pub namespace: String,
    pub runtime: String,
    /// The Pod name of the current incarnation.
    pub pod: String,
    /// `DATA_DIR/workers/<pod>`.
    pub dir: PathBuf,
    /// The runtime server's process ID, once started.
    pub runtime_server_pid: Option<u32>,
    /// runtimed's process ID, once started.
    pub runtimed_pid: Option<u32>,
    /// Whether the Pod was written Ready.
    pub ready: bool,
}

/// Starts and supervises worker processes and publishes a Pod object for each.
///
/// Cheap to clone: clones share the workers. Dropping the last clone stops every worker.
#[derive(Clone)]
pub struct LocalProvisioner {
    inner: Arc<Inner>,
}

struct Inner {
    shared: Arc<Shared>,
    state: Mutex<State>,
}

/// What the slot tasks need: never a reference back to [`Inner`], so that dropping the
/// last [`LocalProvisioner`] drops the stop senders and the slots stop.
struct Shared {
    client: Client,
    config: LocalConfig,
    workers_dir: PathBuf,
}

type RuntimeKey = (String, String);

#[derive(Default)]
struct State {
    closed: bool,
    /// By (namespace, Runtime name).
    runtimes: HashMap<RuntimeKey, RuntimeWorkers>,
    /// Slots being stopped: their Pods stay registered until the slots deleted them, so a
    /// concurrent sweep never deletes the Pod of a worker that is still stopping.
    stopping: Vec<(RuntimeKey, Arc<Mutex<SlotState>>)>,
}

struct RuntimeWorkers {
    uid: String,
    spec: watch::Sender<Arc<WorkerSpec>>,
    slots: Vec<Slot>,
}

struct Slot {
    stop: watch::Sender<bool>,
    handle: JoinHandle<()>,
    state: Arc<Mutex<SlotState>>,
}

/// What a slot is doing now.
#[derive(Debug, Default)]
struct SlotState {
    /// The Pod name of the current incarnation, registered before the Pod is created and
    /// cleared after it is deleted.
    pod: Option<String>,
    dir: Option<PathBuf>,
    runtime_server_pid: Option<u32>,
    runtimed_pid: Option<u32>,
    ready: bool,
}

/// Everything an incarnation is built from.
#[derive(Debug, Clone, PartialEq)]
struct WorkerSpec {
    namespace: String,
    runtime: String,
    runtime_uid: String,
    template: WorkerTemplate,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data behind; carry on with it.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl LocalProvisioner {
    /// A provisioner that writes Pods through `client` (the controller-manager's identity)
    /// and keeps its workers under `config.data_dir/workers/`, which it creates (and
    /// resolves to an absolute path). Starts nothing until the first reconcile.
    pub fn new(client: Client, config: LocalConfig) -> Result<LocalProvisioner, LocalError> {
        let workers_dir = config.workers_dir();
        std::fs::create_dir_all(&workers_dir).map_err(|source| LocalError::Io {
            action: "create the workers directory",
            path: workers_dir.clone(),
            source,
        })?;
        // Absolute, so that socket paths mean the same to every process and the length
        // check counts what the kernel will see.
        let workers_dir = workers_dir
            .canonicalize()
            .map_err(|source| LocalError::Io {
                action: "resolve the workers directory",
                path: workers_dir.clone(),
                source,
            })?;
        remove_stale_keys(&workers_dir);
        Ok(LocalProvisioner {
            inner: Arc::new(Inner {
                shared: Arc::new(Shared {
                    client,
                    config,
                    workers_dir,
                }),
                state: Mutex::new(State::default()),
            }),
        })
    }

    /// The provisioner's settings.
    pub fn config(&self) -> &LocalConfig {
        &self.inner.shared.config
    }

    /// The live workers of every Runtime, in (namespace, Runtime, Pod) order. Slots between
    /// incarnations (backing off after a crash) are not listed.
    pub fn workers(&self) -> Vec<WorkerInfo> {
        let state = lock(&self.inner.state);
        let mut out = Vec::new();
        for ((namespace, runtime), workers) in &state.runtimes {
            for slot in &workers.slots {
                let slot = lock(&slot.state);
                if let (Some(pod), Some(dir)) = (&slot.pod, &slot.dir) {
                    out.push(WorkerInfo {
                        namespace: namespace.clone(),
                        runtime: runtime.clone(),
                        pod: pod.clone(),
                        dir: dir.clone(),
                        runtime_server_pid: slot.runtime_server_pid,
                        runtimed_pid: slot.runtimed_pid,
                        ready: slot.ready,
                    });
                }
            }
        }
        out.sort_by(|a, b| {
            (&a.namespace, &a.runtime, &a.pod).cmp(&(&b.namespace, &b.runtime, &b.pod))
        });
        out
    }

    /// Stops every worker of every Runtime (`Ready=False`, then the processes, then the Pod
    /// objects, each Pod delete bounded so that a dead API server cannot hold it up) and
    /// starts no more. `kruntimes up` calls this on its way out, before the API server
    /// stops. Idempotent.
    pub async fn shutdown(&self) {
        let slots: Vec<(RuntimeKey, Slot)> = {
            let mut state = lock(&self.inner.state);
            state.closed = true;
            state
                .runtimes
                .drain()
                .flat_map(|(key, workers)| workers.slots.into_iter().map(move |s| (key.clone(), s)))
                .collect()
        };
        if !slots.is_empty() {
            info!(workers = slots.len(), "stopping every local worker");
        }
        self.stop_slots(slots).await;
    }

    /// Stops slots concurrently and waits for each to finish its teardown; their Pods stay
    /// registered meanwhile.
    async fn stop_slots(&self, slots: Vec<(RuntimeKey, Slot)>) {
        if slots.is_empty() {
            return;
        }
        let states: Vec<Arc<Mutex<SlotState>>> =
            slots.iter().map(|(_, slot)| slot.state.clone()).collect();
        {
            let mut state = lock(&self.inner.state);
            // Entries whose slot task is gone (a stop whose waiter was cancelled, e.g. with a
            // leadership term) hold the only reference left.
            state
                .stopping
                .retain(|(_, slot)| Arc::strong_count(slot) > 1);
            state.stopping.extend(
                slots
                    .iter()
                    .map(|(key, slot)| (key.clone(), slot.state.clone())),
            );
        }
        let waits = slots.into_iter().map(|(_, slot)| {
            slot.stop.send_replace(true);
            async move {
                if let Err(error) = slot.handle.await
                    && error.is_panic()
                {
                    warn!("a worker supervisor panicked");
                }
            }
        });
        futures::future::join_all(waits).await;
        lock(&self.inner.state)
            .stopping
            .retain(|(_, state)| !states.iter().any(|done| Arc::ptr_eq(done, state)));
    }

    /// The Runtime's worker Pods the autoscaler marked
    /// [`RETIRING_ANNOTATION`](crate::placement::RETIRING_ANNOTATION), read from the API.
    async fn retiring_pods(
        &self,
        namespace: &str,
        runtime: &str,
    ) -> Result<BTreeSet<String>, LocalError> {
        let api = Api::<Pod>::namespaced(self.inner.shared.client.clone(), namespace);
        let pods = list_all(
            &api,
            ListParams::default().labels(&format!("{RUNTIME_LABEL}={runtime}")),
            "pods",
            namespace,
        )
        .await
        .map_err(|error| LocalError::List(Box::new(error)))?;
        Ok(pods
            .iter()
            .filter(|pod| crate::placement::is_retiring(pod))
            .map(ResourceExt::name_any)
            .collect())
    }

    /// Pod names registered by the live and the stopping slots of `namespace/runtime`.
    fn registered(&self, namespace: &str, runtime: &str) -> BTreeSet<String> {
        let state = lock(&self.inner.state);
        let key = (namespace.to_string(), runtime.to_string());
        let live = state
            .runtimes
            .get(&key)
            .into_iter()
            .flat_map(|workers| workers.slots.iter().map(|slot| &slot.state));
        let stopping = state
            .stopping
            .iter()
            .filter(|(k, _)| *k == key)
            .map(|(_, slot)| slot);
        live.chain(stopping)
            .filter_map(|slot| lock(slot).pod.clone())
            .collect()
    }

    /// Deletes the Pods labelled for `namespace/runtime` by this provisioner that no live
    /// slot registered.
    async fn sweep(&self, namespace: &str, runtime: &str) -> Result<(), LocalError> {
        let api = Api::<Pod>::namespaced(self.inner.shared.client.clone(), namespace);
        let selector = format!("{RUNTIME_LABEL}={runtime},{PROVISIONER_LABEL}={LOCAL_PROVISIONER}");
        let pods = list_all(
            &api,
            ListParams::default().labels(&selector),
            "pods",
            namespace,
        )
        .await
        .map_err(|error| LocalError::List(Box::new(error)))?;
        if pods.is_empty() {
            return Ok(());
        }
        // Read after the list: a Pod in the list was registered before it was created.
        let registered = self.registered(namespace, runtime);
        for pod in pods {
            let name = pod.name_any();
            if registered.contains(&name) {
                continue;
            }
            info!(pod = %name, namespace, runtime, "deleting a Pod without a local worker");
            delete_pod(&api, &name, pod.metadata.uid.clone()).await?;
        }
        Ok(())
    }
}

/// Why the local provisioner ignores what [`ignored_template_fields`] lists.
pub const IGNORED_BECAUSE: &str = "the local provisioner runs the host's interpreters";

/// The `resources.limits` keys the local provisioner applies to each sandbox.
const HONOURED_LIMITS: [&str; 3] = ["memory", "cpu", "pids"];

/// What the local provisioner takes from a Runtime's Pod template: the `runtime`
/// container's command, args, env with literal values, and resource limits.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerTemplate {
    pub command: Vec<String>,
    pub args: Vec<String>,
    pub env: Vec<EnvVar>,
    pub limits: BTreeMap<String, String>,
}

impl WorkerTemplate {
    pub fn of(spec: &RuntimeSpec) -> WorkerTemplate {
        let Some(container) = spec.runtime_container() else {
            return WorkerTemplate::default();
        };
        // As the kubelet does: each value sees the variables before it. Command and args
        // see the whole env of the process, the provisioner's variables included; they
        // are expanded where it starts (`runtime_server_command`).
        let mut env: Vec<EnvVar> = Vec::new();
        for var in container.env.iter().flatten() {
            if var.value_from.is_some() {
                continue;
            }
            let value =
                expand_references(var.value.as_deref().unwrap_or_default(), variable_of(&env));
            env.push(EnvVar {
                name: var.name.clone(),
                value,
            });
        }
        WorkerTemplate {
            command: container.command.clone().unwrap_or_default(),
            args: container.args.clone().unwrap_or_default(),
            env,
            limits: (container.resources.iter())
                .flat_map(|r| r.limits.iter().flatten())
                .map(|(resource, quantity)| (resource.clone(), quantity.0.clone()))
                .collect(),
        }
    }
}

/// The value of a variable of `env`, the later of two with one name winning (as the
/// environment of the started process has it): the lookup of [`expand_references`].
fn variable_of<'a>(env: &'a [EnvVar]) -> impl Fn(&str) -> Option<&'a str> + 'a {
    move |name| {
        env.iter()
            .rev()
            .find(|v| v.name == name)
            .map(|v| v.value.as_str())
    }
}

/// `text` with each `$(NAME)` that `lookup` knows replaced by its value, as Kubernetes
/// expands a container's command, args and env values: `$$` is a literal `$` (so
/// `$$(NAME)` stays `$(NAME)`), a reference to an unknown variable and an unclosed `$(`
/// stay as written, and an expanded value is not expanded again.
pub fn expand_references<'a>(text: &str, lookup: impl Fn(&str) -> Option<&'a str>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(open) = after.strip_prefix('(')
            && let Some(close) = open.find(')')
        {
            let name = &open[..close];
            match lookup(name) {
                Some(value) => out.push_str(value),
                None => {
                    out.push_str("$(");
                    out.push_str(name);
                    out.push(')');
                }
            }
            rest = &open[close + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The fields of a Runtime's Pod template the local provisioner cannot honour, as
/// `template.…` paths: it starts the host's runtime server and interpreters (no image),
/// makes no Pod of the cluster (no other containers, volumes, security context, service
/// account, scheduling or metadata), applies no requests (nothing to reserve on one
/// machine), and of the limits only memory, cpu and pids.
pub fn ignored_template_fields(spec: &RuntimeSpec) -> Vec<String> {
    fn keys(value: serde_json::Value) -> Vec<String> {
        match value {
            serde_json::Value::Object(map) => map
                .into_iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, _)| k)
                .collect(),
            _ => Vec::new(),
        }
    }
    fn shown(text: &str, max: usize) -> String {
        text.chars().take(max).collect()
    }
    let template = &spec.template;
    let mut ignored = Vec::new();
    if let Some(meta) = &template.metadata {
        for key in keys(serde_json::to_value(meta).unwrap_or_default()) {
            ignored.push(format!("template.metadata.{key}"));
        }
    }
    let Some(pod) = &template.spec else {
        return ignored;
    };
    let mut rest = serde_json::to_value(pod).unwrap_or_default();
    if let Some(map) = rest.as_object_mut() {
        map.remove("containers");
        // Honoured: no local worker ever holds a token.
        if pod.automount_service_account_token == Some(false) {
            map.remove("automountServiceAccountToken");
        }
    }
    for key in keys(rest) {
        ignored.push(format!("template.spec.{key}"));
    }
    for container in &pod.containers {
        let at = format!("template.spec.containers[{}]", shown(&container.name, 63));
        if container.name != RUNTIME_CONTAINER {
            ignored.push(at);
            continue;
        }
        if let Some(image) = container.image.as_deref().filter(|i| !i.is_empty()) {
            ignored.push(format!("{at}.image ({})", shown(image, 128)));
        }
        let mut rest = serde_json::to_value(container).unwrap_or_default();
        if let Some(map) = rest.as_object_mut() {
            for honoured in ["name", "image", "command", "args", "env", "resources"] {
                map.remove(honoured);
            }
        }
        for key in keys(rest) {
            ignored.push(format!("{at}.{key}"));
        }
        for var in container.env.iter().flatten() {
            if var.value_from.is_some() {
                ignored.push(format!("{at}.env[{}].valueFrom", shown(&var.name, 64)));
            }
        }
        if let Some(resources) = &container.resources {
            if resources.requests.as_ref().is_some_and(|r| !r.is_empty()) {
                ignored.push(format!("{at}.resources.requests"));
            }
            if resources.claims.as_ref().is_some_and(|c| !c.is_empty()) {
                ignored.push(format!("{at}.resources.claims"));
            }
            for key in resources.limits.iter().flatten().map(|(k, _)| k) {
                if !HONOURED_LIMITS.contains(&key.as_str()) {
                    ignored.push(format!("{at}.resources.limits.{}", shown(key, 64)));
                }
            }
        }
    }
    ignored
}

impl WorkerProvisioner for LocalProvisioner {
    type Error = LocalError;

    fn ignored_fields(&self, runtime: &Runtime) -> Option<(Vec<String>, &'static str)> {
        let ignored = ignored_template_fields(&runtime.spec);
        (!ignored.is_empty()).then_some((ignored, IGNORED_BECAUSE))
    }

    async fn reconcile(&self, runtime: &Runtime) -> Result<WorkerCounts, LocalError> {
        let name = runtime.name_any();
        let missing = |field| LocalError::MissingField {
            kind: "Runtime",
            name: name.clone(),
            field,
        };
        let namespace = runtime
            .namespace()
            .ok_or_else(|| missing("metadata.namespace"))?;
        let uid = runtime.uid().ok_or_else(|| missing("metadata.uid"))?;
        let spec = Arc::new(WorkerSpec {
            namespace: namespace.clone(),
            runtime: name.clone(),
            runtime_uid: uid.clone(),
            template: WorkerTemplate::of(&runtime.spec),
        });
        let desired = if runtime.meta().deletion_timestamp.is_some() {
            0
        } else {
            usize::try_from(runtime.spec.replicas).unwrap_or(0)
        };
        // A scale-down stops the workers the autoscaler marked first: it chose idle ones.
        let surplus = {
            let state = lock(&self.inner.state);
            state
                .runtimes
                .get(&(namespace.clone(), name.clone()))
                .is_some_and(|w| w.slots.len() > desired)
        };
        let retiring = if surplus {
            self.retiring_pods(&namespace, &name).await?
        } else {
            BTreeSet::new()
        };
        let mut to_stop = Vec::new();
        let counts = {
            let mut state = lock(&self.inner.state);
            if state.closed {
                return Err(LocalError::ShutDown);
            }
            let key = (namespace.clone(), name.clone());
            if state.runtimes.get(&key).is_some_and(|w| w.uid != uid) {
                // The Runtime was deleted and created again under the same name.
                if let Some(old) = state.runtimes.remove(&key) {
                    to_stop.extend(old.slots.into_iter().map(|s| (key.clone(), s)));
                }
            }
            let workers = state
                .runtimes
                .entry(key.clone())
                .or_insert_with(|| RuntimeWorkers {
                    uid: uid.clone(),
                    spec: watch::Sender::new(spec.clone()),
                    slots: Vec::new(),
                });
            workers.spec.send_if_modified(|current| {
                if **current == *spec {
                    false
                } else {
                    *current = spec.clone();
                    true
                }
            });
            // A slot task ends only when stopped, or when it panicked.
            workers.slots.retain(|slot| !slot.handle.is_finished());
            while workers.slots.len() < desired {
                workers
                    .slots
                    .push(spawn_slot(&self.inner.shared, workers.spec.subscribe()));
            }
            if workers.slots.len() > desired {
                // Stop the workers the autoscaler retires first, then those that serve
                // nothing (starting or backing off), then the youngest.
                let mut order: Vec<(bool, bool, usize)> = workers
                    .slots
                    .iter()
                    .enumerate()
                    .map(|(i, slot)| {
                        let slot = lock(&slot.state);
                        let kept = slot.pod.as_ref().is_none_or(|p| !retiring.contains(p));
                        (kept, slot.ready, i)
                    })
                    .collect();
                order.sort_by_key(|&(kept, ready, i)| (kept, ready, std::cmp::Reverse(i)));
                let mut surplus: Vec<usize> = order[..workers.slots.len() - desired]
                    .iter()
                    .map(|&(_, _, i)| i)
                    .collect();
                surplus.sort_unstable_by(|a, b| b.cmp(a));
                for i in surplus {
                    to_stop.push((key.clone(), workers.slots.remove(i)));
                }
            }
            let ready = workers
                .slots
                .iter()
                .filter(|slot| lock(&slot.state).ready)
                .count();
            WorkerCounts {
                current: i32::try_from(workers.slots.len()).unwrap_or(i32::MAX),
                ready: i32::try_from(ready).unwrap_or(i32::MAX),
            }
        };
        if !to_stop.is_empty() {
            info!(runtime = %name, namespace = %namespace, stopping = to_stop.len(), "scaling down");
            self.stop_slots(to_stop).await;
        }
        self.sweep(&namespace, &name).await?;
        Ok(counts)
    }

    /// Deletes, in every namespace, each Pod labelled as this provisioner's that no slot of
    /// this provisioner registered: the Pods of workers of an earlier process (a killed
    /// `kruntimes up`), whose processes ended with it while their Pods still say Ready.
    async fn fence_unknown_workers(&self) -> Result<(), LocalError> {
        let client = &self.inner.shared.client;
        let selector = format!("{RUNTIME_LABEL},{PROVISIONER_LABEL}={LOCAL_PROVISIONER}");
        let pods = list_all(
            &Api::<Pod>::all(client.clone()),
            ListParams::default().labels(&selector),
            "pods",
            "",
        )
        .await
        .map_err(|error| LocalError::List(Box::new(error)))?;
        for pod in pods {
            let (Some(namespace), Some(runtime)) =
                (pod.namespace(), pod.labels().get(RUNTIME_LABEL).cloned())
            else {
                continue;
            };
            let name = pod.name_any();
            // Read after the list: a Pod in the list was registered before it was created.
            if self.registered(&namespace, &runtime).contains(&name) {
                continue;
            }
            info!(pod = %name, namespace, runtime, "fencing the Pod of a worker this process does not run");
            let api = Api::<Pod>::namespaced(client.clone(), &namespace);
            delete_pod(&api, &name, pod.metadata.uid.clone()).await?;
        }
        Ok(())
    }

    async fn cleanup(&self, runtime: &ObjectRef<Runtime>) -> Result<(), LocalError> {
        let name = runtime.name.clone();
        let Some(namespace) = runtime.namespace.clone() else {
            return Err(LocalError::MissingField {
                kind: "Runtime",
                name,
                field: "metadata.namespace",
            });
        };
        let slots = {
            let mut state = lock(&self.inner.state);
            let key = (namespace.clone(), name.clone());
            let matches = state.runtimes.get(&key).is_some_and(|workers| {
                runtime
                    .extra
                    .uid
                    .as_deref()
                    .is_none_or(|uid| uid == workers.uid)
            });
            if matches {
                state
                    .runtimes
                    .remove(&key)
                    .map(|w| w.slots.into_iter().map(|s| (key.clone(), s)).collect())
                    .unwrap_or_default()
            } else {
                Vec::new()
            }
        };
        if !slots.is_empty() {
            info!(runtime = %name, namespace = %namespace, workers = slots.len(), "Runtime deleted; stopping its workers");
        }
        self.stop_slots(slots).await;
        self.sweep(&namespace, &name).await
    }
}

fn spawn_slot(shared: &Arc<Shared>, spec: watch::Receiver<Arc<WorkerSpec>>) -> Slot {
    let (stop, stop_rx) = watch::channel(false);
    let state = Arc::new(Mutex::new(SlotState::default()));
    let handle = tokio::spawn(run_slot(shared.clone(), spec, stop_rx, state.clone()));
    Slot {
        stop,
        handle,
        state,
    }
}

/// Resolves once the slot is told to stop, or its provisioner is gone.
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|&stop| stop).await;
}

fn is_stopped(stop: &watch::Receiver<bool>) -> bool {
    // A dropped sender (the provisioner is gone) also means stop.
    *stop.borrow() || stop.has_changed().is_err()
}

/// Resolves once the Runtime's worker template differs from `template`; never if the
/// Runtime's entry is gone (the slot is being stopped then).
async fn template_changed(spec: &mut watch::Receiver<Arc<WorkerSpec>>, template: &WorkerTemplate) {
    if spec.wait_for(|s| s.template != *template).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// How an incarnation ended.
enum Ended {
    /// The slot was stopped; the slot ends.
    Stopped,
    /// The template changed; start a new incarnation now.
    Replaced,
    /// A process exited, or the start failed; start again after the backoff. `lived` is
    /// how long the worker was ready (zero if it never was).
    Failed { lived: Duration },
}

/// One worker slot: incarnations, one after the other, until stopped.
async fn run_slot(
    shared: Arc<Shared>,
    mut spec: watch::Receiver<Arc<WorkerSpec>>,
    mut stop: watch::Receiver<bool>,
    state: Arc<Mutex<SlotState>>,
) {
    let config = &shared.config;
    let mut backoff = config.min_backoff;
    loop {
        if is_stopped(&stop) {
            return;
        }
        let current = spec.borrow_and_update().clone();
        match incarnation(&shared, &current, &mut spec, &mut stop, &state).await {
            Ended::Stopped => return,
            Ended::Replaced => backoff = config.min_backoff,
            Ended::Failed { lived } => {
                if lived >= config.backoff_reset {
                    backoff = config.min_backoff;
                }
                let delay = backoff;
                backoff = (backoff * 2).min(config.max_backoff);
                debug!(runtime = %current.runtime, ?delay, "restarting a worker after a backoff");
                tokio::select! {
                    () = stopped(&mut stop) => return,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// The name of a new incarnation: `<runtime>-<5 random [a-z0-9]>`, the Runtime's name cut so
/// that the whole stays a valid label value and DNS label (63 characters).
fn pod_name(runtime: &str) -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut base: String = runtime.chars().take(57).collect();
    while base.ends_with(['-', '.']) {
        base.pop();
    }
    let random = uuid::Uuid::new_v4();
    let suffix: String = random.as_bytes()[..5]
        .iter()
        .map(|b| char::from(ALPHABET[usize::from(*b) % ALPHABET.len()]))
        .collect();
    format!("{base}-{suffix}")
}

/// The worker directory of a new incarnation and its socket path, checked against the Unix
/// socket limit.
fn worker_paths(workers_dir: &Path, pod: &str) -> Result<(PathBuf, PathBuf), LocalError> {
    let dir = workers_dir.join(pod);
    let socket = dir.join("runtime.sock");
    let len = socket.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(LocalError::SocketPathTooLong { path: socket, len });
    }
    Ok((dir, socket))
}

/// A started worker process.
struct Proc {
    what: &'static str,
    child: Child,
    pid: Option<u32>,
    /// The write end of the process's stdin; dropping it tells the process to exit.
    stdin: Option<ChildStdin>,
    stdout: Option<Lines<BufReader<ChildStdout>>>,
    log: PathBuf,
    exited: Option<ExitStatus>,
}

impl Proc {
    /// Starts `program args` in its own process group, stdin a pipe, stdout piped, stderr
    /// appended to `log`.
    fn spawn(
        what: &'static str,
        program: &Path,
        args: &[String],
        env: &[EnvVar],
        log: PathBuf,
    ) -> Result<Proc, LocalError> {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|source| LocalError::Io {
                action: "open the log",
                path: log.clone(),
                source,
            })?;
        let mut command = Command::new(program);
        command
            .args(args)
            .envs(env.iter().map(|e| (&e.name, &e.value)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .process_group(0)
            .kill_on_drop(true);
        let mut child = command.spawn().map_err(|source| LocalError::Spawn {
            what,
            program: program.to_path_buf(),
            source,
        })?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().map(|out| BufReader::new(out).lines());
        Ok(Proc {
            what,
            pid: child.id(),
            child,
            stdin,
            stdout,
            log,
            exited: None,
        })
    }

    fn not_ready(&self, reason: String) -> LocalError {
        LocalError::NotReady {
            what: self.what,
            reason,
            log: self.log.clone(),
        }
    }

    /// Reads stdout until a line starts with `prefix` and returns the rest of it; then
    /// keeps draining stdout in the background.
    async fn ready_line(&mut self, prefix: &str) -> Result<String, LocalError> {
        let Some(mut lines) = self.stdout.take() else {
            return Err(self.not_ready("its stdout is gone".to_string()));
        };
        let mut seen: Vec<String> = Vec::new();
        loop {
            match lines.next_line().await {
                Ok(Some(line)) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        let rest = rest.trim().to_string();
                        let what = self.what;
                        tokio::spawn(async move {
                            while let Ok(Some(line)) = lines.next_line().await {
                                debug!(process = what, line = %line, "worker stdout");
                            }
                        });
                        return Ok(rest);
                    }
                    if seen.len() < KEPT_LINES {
                        seen.push(line);
                    }
                }
                Ok(None) | Err(_) => {
                    let status = self.wait().await;
                    let printed = if seen.is_empty() {
                        String::new()
                    } else {
                        format!("; it printed: {}", seen.join(" | "))
                    };
                    return Err(self.not_ready(format!("it exited ({status}){printed}")));
                }
            }
        }
    }

    /// Waits for the process to exit (cancel-safe) and describes how it ended.
    async fn wait(&mut self) -> String {
        if self.exited.is_none() {
            match self.child.wait().await {
                Ok(status) => self.exited = Some(status),
                Err(error) => return format!("wait failed: {error}"),
            }
        }
        self.exited
            .map_or_else(|| "unknown".to_string(), |status| status.to_string())
    }

    /// Stops the process: closes its stdin, SIGTERM to its process group, SIGKILL to the
    /// group after `grace`. A process that already exited (and was reaped) is not
    /// signalled: its process group ID may belong to someone else by now.
    async fn stop(&mut self, grace: Duration) {
        self.stdin.take();
        if self.exited.is_some() {
            return;
        }
        match self.child.try_wait() {
            Ok(Some(status)) => {
                self.exited = Some(status);
                return;
            }
            Ok(None) => {}
            Err(error) => {
                warn!(process = self.what, error = %error, "cannot poll a worker process")
            }
        }
        // Not reaped yet, so the group ID is still ours.
        let group = self
            .pid
            .and_then(|pid| i32::try_from(pid).ok())
            .map(Pid::from_raw);
        if let Some(group) = group {
            let _ = killpg(group, Signal::SIGTERM);
        }
        if tokio::time::timeout(grace, self.wait()).await.is_ok() {
            return;
        }
        warn!(process = self.what, pid = ?self.pid, ?grace, "worker process ignored SIGTERM; killing it");
        if let Some(group) = group {
            let _ = killpg(group, Signal::SIGKILL);
        } else {
            let _ = self.child.start_kill();
        }
        self.wait().await;
    }
}

/// The runtime server's sandbox settings for `template`: the provisioner's backend
/// (`KRUNTIMES_SANDBOX`), then the template's `resources.limits` (`memory`, `cpu`, and
/// `pids`) as each sandbox's limits. The template's own env and args come later and win.
fn sandbox_env(config: &LocalConfig, template: &WorkerTemplate) -> Vec<EnvVar> {
    let mut env: Vec<EnvVar> = config
        .runtime_server_env
        .iter()
        .map(|(name, value)| EnvVar {
            name: name.clone(),
            value: value.clone(),
        })
        .collect();
    for (resource, variable) in [
        ("memory", "KRUNTIMES_SANDBOX_MEMORY"),
        ("cpu", "KRUNTIMES_SANDBOX_CPU"),
        ("pids", "KRUNTIMES_SANDBOX_PIDS"),
    ] {
        if let Some(value) = template.limits.get(resource) {
            env.push(EnvVar {
                name: variable.to_string(),
                value: value.clone(),
            });
        }
    }
    env
}

/// The runtime server's command line for `template`, its `$(NAME)` references expanded
/// from `env`, the process's whole environment (the later of two variables with one name
/// wins), as the kubelet expands them from the container's.
fn runtime_server_command(
    config: &LocalConfig,
    template: &WorkerTemplate,
    socket: &Path,
    root: &Path,
    env: &[EnvVar],
) -> (PathBuf, Vec<String>) {
    let expanded = |list: &[String]| -> Vec<String> {
        list.iter()
            .map(|text| expand_references(text, variable_of(env)))
            .collect()
    };
    let command = expanded(&template.command);
    let template_args = expanded(&template.args);
    match command.split_first() {
        // A replacement command finds its socket and root in the environment
        // (KRUNTIMES_RUNTIME_SOCKET, KRUNTIMES_RUNTIME_ROOT), as the runtime server does.
        Some((program, rest)) => {
            let mut args = rest.to_vec();
            args.extend(template_args);
            (PathBuf::from(program), args)
        }
        None => {
            let mut args = vec![
                "--socket".to_string(),
                socket.display().to_string(),
                "--root".to_string(),
                root.display().to_string(),
                "--exit-with-stdin".to_string(),
            ];
            args.extend(template_args);
            (config.runtime_server_bin.clone(), args)
        }
    }
}

/// A started incarnation: both processes, and the Pod once created.
struct Worker {
    runtime_server: Proc,
    runtimed: Option<Proc>,
}

impl Worker {
    /// Stops runtimed first (it drains through the runtime server), then the runtime
    /// server.
    async fn stop(&mut self, grace: Duration) {
        if let Some(runtimed) = self.runtimed.as_mut() {
            runtimed.stop(grace).await;
        }
        self.runtime_server.stop(grace).await;
    }

    /// Resolves when either process exits, naming it and its status.
    async fn exited(&mut self) -> (&'static str, String) {
        match self.runtimed.as_mut() {
            Some(runtimed) => tokio::select! {
                status = self.runtime_server.wait() => (self.runtime_server.what, status),
                status = runtimed.wait() => (runtimed.what, status),
            },
            None => (self.runtime_server.what, self.runtime_server.wait().await),
        }
    }
}

/// What interrupted a step of an incarnation.
enum Interrupt {
    Stop,
    Replace,
    Exit(&'static str, String),
}

/// One incarnation of a worker, from start to the deletion of its Pod.
async fn incarnation(
    shared: &Shared,
    spec: &WorkerSpec,
    spec_rx: &mut watch::Receiver<Arc<WorkerSpec>>,
    stop: &mut watch::Receiver<bool>,
    state: &Mutex<SlotState>,
) -> Ended {
    let config = &shared.config;
    let pod = pod_name(&spec.runtime);
    let log_fields = (spec.namespace.as_str(), spec.runtime.as_str(), pod.as_str());
    let (dir, socket) = match worker_paths(&shared.workers_dir, &pod) {
        Ok(paths) => paths,
        Err(error) => {
            warn!(namespace = log_fields.0, runtime = log_fields.1, error = %error, "cannot start a worker");
            return Ended::Failed {
                lived: Duration::ZERO,
            };
        }
    };
    {
        let mut slot = lock(state);
        slot.pod = Some(pod.clone());
        slot.dir = Some(dir.clone());
    }
    let api = Api::<Pod>::namespaced(shared.client.clone(), &spec.namespace);

    let (mut worker, port) = tokio::select! {
        () = stopped(stop) => {
            forget(state, &dir);
            return Ended::Stopped;
        }
        started = start(shared, spec, &pod, &dir, &socket, state) => match started {
            Ok(started) => started,
            Err((worker, error)) => {
                warn!(namespace = log_fields.0, runtime = log_fields.1, pod = log_fields.2, error = %error, "worker failed to start");
                if let Some(mut worker) = worker {
                    worker.stop(config.grace).await;
                }
                forget(state, &dir);
                return Ended::Failed { lived: Duration::ZERO };
            }
        },
    };

    // Publish the Pod, then its readiness; either step gives way to a process exit or a
    // stop.
    let object = pod_object(spec, &pod, port);
    let (post, patch) = (PostParams::default(), PatchParams::default());
    let published = async {
        let created = retry("create", &api, &pod, || api.create(&post, &object)).await?;
        let uid = created.metadata.uid.clone();
        let ready = Patch::Merge(ready_status(true, "WorkerReady"));
        retry("write the status of", &api, &pod, || {
            api.patch_status(&pod, &patch, &ready)
        })
        .await?;
        Ok::<_, LocalError>(uid)
    };
    let mut uid = None;
    let interrupt = tokio::select! {
        () = stopped(stop) => Some(Interrupt::Stop),
        () = template_changed(spec_rx, &spec.template) => Some(Interrupt::Replace),
        (what, status) = worker.exited() => Some(Interrupt::Exit(what, status)),
        result = published => match result {
            Ok(created) => {
                uid = created;
                None
            }
            Err(error) => {
                warn!(namespace = log_fields.0, runtime = log_fields.1, pod = log_fields.2, error = %error, "cannot publish the worker's Pod");
                Some(Interrupt::Exit("Pod", error.to_string()))
            }
        },
    };
    let ready_at = Instant::now();
    let interrupt = match interrupt {
        Some(interrupt) => interrupt,
        None => {
            lock(state).ready = true;
            info!(
                namespace = log_fields.0,
                runtime = log_fields.1,
                pod = log_fields.2,
                port = port.grpc,
                metrics_port = ?port.metrics,
                "worker ready"
            );
            tokio::select! {
                () = stopped(stop) => Interrupt::Stop,
                () = template_changed(spec_rx, &spec.template) => Interrupt::Replace,
                (what, status) = worker.exited() => Interrupt::Exit(what, status),
            }
        }
    };
    let was_ready = std::mem::take(&mut lock(state).ready);
    let lived = if was_ready {
        ready_at.elapsed()
    } else {
        Duration::ZERO
    };

    let ended = match interrupt {
        Interrupt::Exit(what, status) => {
            warn!(namespace = log_fields.0, runtime = log_fields.1, pod = log_fields.2, process = what, status = %status, "worker process exited; replacing the worker");
            worker.stop(config.grace).await;
            Ended::Failed { lived }
        }
        Interrupt::Stop | Interrupt::Replace => {
            // Out of rotation first, so nothing new is placed on a stopping worker.
            if was_ready {
                let status = Patch::Merge(ready_status(false, "WorkerStopping"));
                let unready = api.patch_status(&pod, &patch, &status);
                match tokio::time::timeout(UNREADY_DEADLINE, unready).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(error)) => {
                        debug!(pod = %pod, error = %error, "could not mark a stopping worker unready");
                    }
                    Err(_) => debug!(pod = %pod, "marking a stopping worker unready timed out"),
                }
            }
            worker.stop(config.grace).await;
            if matches!(interrupt, Interrupt::Stop) {
                info!(
                    namespace = log_fields.0,
                    runtime = log_fields.1,
                    pod = log_fields.2,
                    "worker stopped"
                );
                Ended::Stopped
            } else {
                info!(
                    namespace = log_fields.0,
                    runtime = log_fields.1,
                    pod = log_fields.2,
                    "worker template changed; replacing the worker"
                );
                Ended::Replaced
            }
        }
    };
    // The Pod may exist even if the create call's answer was lost; delete by name then.
    match tokio::time::timeout(DELETE_DEADLINE, delete_until_gone(&api, &pod, uid)).await {
        Ok(()) => {}
        Err(_) => {
            warn!(pod = %pod, "could not delete a stopped worker's Pod in time; the next reconcile will");
        }
    }
    forget(state, &dir);
    ended
}

/// Starts both processes of an incarnation and waits for their ready lines. On failure the
/// processes started so far come back with the error, to be stopped.
async fn start(
    shared: &Shared,
    spec: &WorkerSpec,
    pod: &str,
    dir: &Path,
    socket: &Path,
    state: &Mutex<SlotState>,
) -> Result<(Worker, Ports), (Option<Worker>, LocalError)> {
    let config = &shared.config;
    let deadline = tokio::time::Instant::now() + config.startup_timeout;
    std::fs::create_dir_all(dir).map_err(|source| {
        (
            None,
            LocalError::Io {
                action: "create the worker directory",
                path: dir.to_path_buf(),
                source,
            },
        )
    })?;
    let root = dir.join("root");
    let mut env = sandbox_env(config, &spec.template);
    env.extend(spec.template.env.iter().cloned());
    env.push(EnvVar {
        name: "KRUNTIMES_RUNTIME_SOCKET".to_string(),
        value: socket.display().to_string(),
    });
    env.push(EnvVar {
        name: "KRUNTIMES_RUNTIME_ROOT".to_string(),
        value: root.display().to_string(),
    });
    if let Some(log_dir) = &config.log_dir {
        env.push(EnvVar {
            name: "KRUNTIMES_RUNTIME_LOG_DIR".to_string(),
            value: log_dir.display().to_string(),
        });
    }
    let (program, args) = runtime_server_command(config, &spec.template, socket, &root, &env);
    let runtime_server = Proc::spawn(
        "runtime server",
        &program,
        &args,
        &env,
        dir.join("runtime-server.log"),
    )
    .map_err(|error| (None, error))?;
    lock(state).runtime_server_pid = runtime_server.pid;
    let mut worker = Worker {
        runtime_server,
        runtimed: None,
    };
    let timeout = |what| format!("no ready line within {:?} ({what})", config.startup_timeout);
    match tokio::time::timeout_at(
        deadline,
        worker.runtime_server.ready_line(RUNTIME_SERVER_READY),
    )
    .await
    {
        Ok(Ok(_)) => {}
        Ok(Err(error)) => return Err((Some(worker), error)),
        Err(_) => {
            let error = worker.runtime_server.not_ready(timeout("startup deadline"));
            return Err((Some(worker), error));
        }
    }
    let mut runtimed_args: Vec<String> = [
        "runtimed",
        "--kubeconfig",
        &config.runtimed_kubeconfig.display().to_string(),
        "--namespace",
        &spec.namespace,
        "--pod-name",
        pod,
        "--runtime",
        &spec.runtime,
        "--runtime-socket",
        &socket.display().to_string(),
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--audit-log",
        &dir.join("audit.jsonl").display().to_string(),
        "--exit-with-stdin",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Some(pki) = &config.worker_pki {
        let files = match issue_worker_tls(pki, &spec.namespace, pod, dir) {
            Ok(files) => files,
            Err(error) => return Err((Some(worker), error)),
        };
        for (flag, path) in [
            ("--tls-cert", &files.cert),
            ("--tls-key", &files.key),
            ("--tls-ca", &files.ca),
        ] {
            runtimed_args.push(flag.to_string());
            runtimed_args.push(path.display().to_string());
        }
    }
    runtimed_args.extend(config.runtimed_args.iter().cloned());
    let runtimed = match Proc::spawn(
        "runtimed",
        &config.kruntimes_bin,
        &runtimed_args,
        &[],
        dir.join("runtimed.log"),
    ) {
        Ok(runtimed) => runtimed,
        Err(error) => return Err((Some(worker), error)),
    };
    lock(state).runtimed_pid = runtimed.pid;
    let runtimed = worker.runtimed.insert(runtimed);
    // runtimed needs its runtime server; if that dies meanwhile, give up at once.
    let line = tokio::select! {
        line = tokio::time::timeout_at(deadline, runtimed.ready_line(RUNTIMED_READY)) => line,
        status = worker.runtime_server.wait() => {
            let error = worker.runtime_server.not_ready(format!("it exited ({status}) while runtimed started"));
            return Err((Some(worker), error));
        }
    };
    let address = match line {
        Ok(Ok(address)) => address,
        Ok(Err(error)) => return Err((Some(worker), error)),
        Err(_) => {
            let error = runtimed.not_ready(timeout("startup deadline"));
            return Err((Some(worker), error));
        }
    };
    // `ADDR` or `ADDR metrics ADDR`.
    let mut words = address.split_whitespace();
    let grpc = words.next().and_then(|a| a.parse::<SocketAddr>().ok());
    let metrics = match (words.next(), words.next()) {
        (Some("metrics"), Some(a)) => a.parse::<SocketAddr>().ok().map(|a| i32::from(a.port())),
        _ => None,
    };
    let Some(grpc) = grpc else {
        let error = runtimed.not_ready(format!("its ready line names {address:?}, not an address"));
        return Err((Some(worker), error));
    };
    Ok((
        worker,
        Ports {
            grpc: i32::from(grpc.port()),
            metrics,
        },
    ))
}

/// The ports a started runtimed serves on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ports {
    grpc: i32,
    metrics: Option<i32>,
}

/// Issues the workload certificate of incarnation `pod` in `namespace` (named for its
/// worker identity, `kruntimes_wire::worker::worker_identity`, IP SAN 127.0.0.1) with the
/// CA in `pki` and writes it to `DIR/tls/`.
fn issue_worker_tls(
    pki: &Path,
    namespace: &str,
    pod: &str,
    dir: &Path,
) -> Result<kruntimes_apiserver::tls::WorkloadFiles, LocalError> {
    let ip = std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
    let error = |source| LocalError::Certificate {
        pod: pod.to_string(),
        source,
    };
    let identity = kruntimes_wire::worker::worker_identity(namespace, pod);
    kruntimes_apiserver::tls::issue_workload(pki, &identity, &[ip], WORKER_CERT_VALIDITY)
        .map_err(error)?
        .write(&dir.join(WORKER_TLS_DIR))
        .map_err(error)
}

/// Removes the TLS material of incarnations an earlier, killed provisioner left behind
/// (their processes exited with its pipes; no new one has started yet).
fn remove_stale_keys(workers_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(workers_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let tls = entry.path().join(WORKER_TLS_DIR);
        if tls.is_dir() {
            match std::fs::remove_dir_all(&tls) {
                Ok(()) => debug!(dir = %tls.display(), "removed a stale worker's TLS material"),
                Err(error) => {
                    warn!(dir = %tls.display(), error = %error, "cannot remove a stale worker's TLS material")
                }
            }
        }
    }
}

/// Clears the slot's registration and removes the incarnation's workspace root, socket and
/// TLS material (the logs stay, for post-mortems).
fn forget(state: &Mutex<SlotState>, dir: &Path) {
    *lock(state) = SlotState::default();
    let _ = std::fs::remove_dir_all(dir.join("root"));
    let _ = std::fs::remove_file(dir.join("runtime.sock"));
    let _ = std::fs::remove_dir_all(dir.join(WORKER_TLS_DIR));
}

/// The Pod object of an incarnation (docs/task-mode.md, "Workers in standalone mode").
fn pod_object(spec: &WorkerSpec, name: &str, ports: Ports) -> Pod {
    let mut container_ports = vec![ContainerPort {
        name: Some(RUNTIMED_CONTAINER.to_string()),
        container_port: ports.grpc,
        protocol: Some("TCP".to_string()),
        ..ContainerPort::default()
    }];
    if let Some(metrics) = ports.metrics {
        container_ports.push(ContainerPort {
            name: Some(METRICS_PORT.to_string()),
            container_port: metrics,
            protocol: Some("TCP".to_string()),
            ..ContainerPort::default()
        });
    }
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(spec.namespace.clone()),
            labels: Some(BTreeMap::from([
                (RUNTIME_LABEL.to_string(), spec.runtime.clone()),
                (PROVISIONER_LABEL.to_string(), LOCAL_PROVISIONER.to_string()),
            ])),
            owner_references: Some(vec![OwnerReference {
                api_version: Runtime::api_version(&()).into_owned(),
                kind: Runtime::kind(&()).into_owned(),
                name: spec.runtime.clone(),
                uid: spec.runtime_uid.clone(),
                controller: Some(true),
                block_owner_deletion: None,
            }]),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: RUNTIMED_CONTAINER.to_string(),
                image: Some("local".to_string()),
                ports: Some(container_ports),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: None,
    }
}

/// The status patch of a worker Pod: Running at 127.0.0.1, `Ready=<ready>`.
fn ready_status(ready: bool, reason: &str) -> serde_json::Value {
    json!({"status": {
        "phase": "Running",
        "podIP": WORKER_IP,
        "podIPs": [{"ip": WORKER_IP}],
        "hostIP": WORKER_IP,
        "conditions": [{
            "type": "Ready",
            "status": if ready { "True" } else { "False" },
            "reason": reason,
            "lastTransitionTime": now_rfc3339(),
        }],
    }})
}

/// Retries one Pod request with a backoff until it succeeds or fails for good (the caller
/// bounds it with a process exit or a stop). 404 and 409 are for good: the Pod name is
/// taken, or the Pod (or its namespace) is gone.
async fn retry<T, F, Fut>(
    action: &'static str,
    api: &Api<Pod>,
    name: &str,
    mut call: F,
) -> Result<T, LocalError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, kube::Error>>,
{
    let mut delay = API_RETRY_MIN;
    loop {
        match call().await {
            Ok(value) => return Ok(value),
            Err(source) => {
                let permanent = matches!(&source, kube::Error::Api(status)
                    if status.is_not_found() || status.is_conflict() || status.is_forbidden()
                        || status.code == 422 || status.code == 400);
                if permanent {
                    return Err(LocalError::Pod {
                        action,
                        namespace: api_namespace(api),
                        name: name.to_string(),
                        source: Box::new(source),
                    });
                }
                debug!(pod = %name, action, error = %source, ?delay, "Pod request failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(API_RETRY_MAX);
            }
        }
    }
}

fn api_namespace(api: &Api<Pod>) -> String {
    api.namespace().unwrap_or_default().to_string()
}

/// Deletes a Pod, retrying until it is gone (the caller bounds it).
async fn delete_until_gone(api: &Api<Pod>, name: &str, uid: Option<String>) {
    let mut delay = API_RETRY_MIN;
    loop {
        match delete_pod(api, name, uid.clone()).await {
            Ok(()) => return,
            Err(error) => {
                debug!(pod = %name, error = %error, ?delay, "Pod delete failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(API_RETRY_MAX);
            }
        }
    }
}

/// Deletes a Pod now (grace period 0: its processes are already gone, or about to be),
/// only if it still has `uid`. A Pod that is already gone, or another Pod by now, is fine.
async fn delete_pod(api: &Api<Pod>, name: &str, uid: Option<String>) -> Result<(), LocalError> {
    let params = DeleteParams {
        preconditions: uid.map(|uid| kube::api::Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..DeleteParams::background().grace_period(0)
    };
    match api.delete(name, &params).await {
        Ok(_) => Ok(()),
        Err(error) if is_not_found(&error) || crate::error::is_conflict(&error) => Ok(()),
        Err(source) => Err(LocalError::Pod {
            action: "delete",
            namespace: api_namespace(api),
            name: name.to_string(),
            source: Box::new(source),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_names_are_fresh_valid_and_bounded() {
        let a = pod_name("python");
        let b = pod_name("python");
        assert_ne!(a, b);
        let suffix = a.strip_prefix("python-").unwrap_or_default();
        assert_eq!(suffix.len(), 5, "{a}");
        assert!(
            suffix
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()),
            "{a}"
        );
        let long = pod_name(&format!("{}-.x", "a".repeat(56)));
        assert!(long.len() <= 63, "{long}");
        assert!(!long.contains("-.") && !long.contains("--"), "{long}");
    }

    #[test]
    fn worker_tls_is_written_private_and_removed_with_the_incarnation() {
        use std::os::unix::fs::PermissionsExt;
        let data = tempfile::tempdir().expect("tempdir");
        let pki = data.path().join("pki");
        let workers = data.path().join("workers");
        let dir = workers.join("rt-abcde");
        let missing = issue_worker_tls(&pki, "default", "rt-abcde", &dir);
        match missing {
            Err(error @ LocalError::Certificate { .. }) => {
                assert!(error.to_string().contains("rt-abcde"), "{error}");
            }
            other => panic!("expected a certificate error without a CA, got {other:?}"),
        }
        kruntimes_apiserver::tls::prepare(&pki, std::net::Ipv4Addr::LOCALHOST.into())
            .expect("the CA");
        let files = issue_worker_tls(&pki, "default", "rt-abcde", &dir).expect("issued");
        assert_eq!(files.key, dir.join("tls/tls.key"));
        let mode = std::fs::metadata(&files.key)
            .expect("the key")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(files.cert.is_file() && files.ca.is_file());

        let state = Mutex::new(SlotState::default());
        forget(&state, &dir);
        assert!(
            !dir.join(WORKER_TLS_DIR).exists(),
            "gone with the incarnation"
        );

        // What a killed provisioner left behind goes when the next one starts.
        let stale = workers.join("rt-zzzzz");
        issue_worker_tls(&pki, "default", "rt-zzzzz", &stale).expect("issued");
        remove_stale_keys(&workers);
        assert!(!stale.join(WORKER_TLS_DIR).exists());
    }

    #[test]
    fn socket_paths_over_the_unix_limit_fail_clearly() {
        let short = worker_paths(Path::new("/tmp/d/workers"), "rt-abcde");
        assert!(short.is_ok());
        let deep = PathBuf::from(format!("/tmp/{}/workers", "d".repeat(100)));
        match worker_paths(&deep, "rt-abcde") {
            Err(error @ LocalError::SocketPathTooLong { .. }) => {
                assert!(
                    error.to_string().contains("shorter data directory"),
                    "{error}"
                );
            }
            other => panic!("expected SocketPathTooLong, got {other:?}"),
        }
    }

    #[test]
    fn references_expand_as_the_kubelet_expands_them() {
        let known = |name: &str| match name {
            "A" => Some("one"),
            "B" => Some("$(A)"),
            _ => None,
        };
        for (text, want) in [
            ("$(A)", "one"),
            ("x-$(A)-$(A)", "x-one-one"),
            ("$$(A)", "$(A)"),
            ("$$$(A)", "$one"),
            ("$(B)", "$(A)"),
            ("$(UNKNOWN)", "$(UNKNOWN)"),
            ("$(A", "$(A"),
            ("$A $ end$", "$A $ end$"),
            ("", ""),
            ("ünïcode $(A) ✓", "ünïcode one ✓"),
        ] {
            assert_eq!(expand_references(text, known), want, "{text:?}");
        }
    }

    #[test]
    fn template_env_sees_earlier_variables_and_command_and_args_see_all() {
        use k8s_openapi::api::core::v1::EnvVar as KubeEnvVar;
        let var = |name: &str, value: &str| KubeEnvVar {
            name: name.into(),
            value: Some(value.into()),
            value_from: None,
        };
        let mut spec = RuntimeSpec {
            replicas: 1,
            scaling: None,
            runs: None,
            template: kruntimes_api::runtime::template_with_args(Vec::new()),
            port: None,
            artifact_store: None,
        };
        let pod = spec.template.spec.as_mut().expect("a Pod spec");
        let container = &mut pod.containers[0];
        container.env = Some(vec![
            var("LATER_USE", "$(DIR)/x"),
            var("DIR", "/srv"),
            var("FILE", "$(DIR)/data"),
        ]);
        container.command = Some(vec!["/opt/$(LATER_USE)".into()]);
        container.args = Some(vec![
            "--file=$(FILE)".into(),
            "$$(FILE)".into(),
            "--socket=$(KRUNTIMES_RUNTIME_SOCKET)".into(),
        ]);
        let template = WorkerTemplate::of(&spec);
        let env: Vec<(&str, &str)> = (template.env.iter())
            .map(|v| (v.name.as_str(), v.value.as_str()))
            .collect();
        assert_eq!(
            env,
            [
                ("LATER_USE", "$(DIR)/x"),
                ("DIR", "/srv"),
                ("FILE", "/srv/data")
            ]
        );
        // Command and args see the whole env of the process, the provisioner's too.
        let config = LocalConfig::new("/d", "/bin/kruntimes", "/bin/rs", "/d/k");
        let mut env = template.env.clone();
        env.push(EnvVar {
            name: "KRUNTIMES_RUNTIME_SOCKET".into(),
            value: "/w/runtime.sock".into(),
        });
        let (program, args) =
            runtime_server_command(&config, &template, Path::new("/s"), Path::new("/r"), &env);
        assert_eq!(program, PathBuf::from("/opt/$(DIR)/x"));
        assert_eq!(
            args,
            ["--file=/srv/data", "$(FILE)", "--socket=/w/runtime.sock"]
        );
    }

    #[test]
    fn template_command_replaces_the_runtime_server() {
        let config = LocalConfig::new("/d", "/bin/kruntimes", "/bin/rs", "/d/k");
        let mut template = WorkerTemplate {
            args: vec!["--adapter".into(), "python".into()],
            ..WorkerTemplate::default()
        };
        let (program, args) =
            runtime_server_command(&config, &template, Path::new("/s"), Path::new("/r"), &[]);
        assert_eq!(program, PathBuf::from("/bin/rs"));
        assert_eq!(
            args,
            [
                "--socket",
                "/s",
                "--root",
                "/r",
                "--exit-with-stdin",
                "--adapter",
                "python"
            ]
        );
        template.command = vec!["/opt/server".into(), "serve".into()];
        let (program, args) =
            runtime_server_command(&config, &template, Path::new("/s"), Path::new("/r"), &[]);
        assert_eq!(program, PathBuf::from("/opt/server"));
        assert_eq!(args, ["serve", "--adapter", "python"]);
    }

    #[test]
    fn the_local_provisioner_takes_the_runtime_container_and_names_the_rest() {
        let spec: RuntimeSpec = serde_json::from_value(serde_json::json!({"template": {
            "metadata": {"annotations": {"a": "b"}},
            "spec": {
                "automountServiceAccountToken": false,
                "securityContext": {"runAsUser": 1000},
                "containers": [
                    {"name": "sidecar"},
                    {
                        "name": "runtime",
                        "image": "python:3.12",
                        "command": ["/opt/server"],
                        "args": ["--adapter", "python"],
                        "env": [
                            {"name": "A", "value": "1"},
                            {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        ],
                        "resources": {
                            "limits": {"memory": "1Gi", "nvidia.com/gpu": "1"},
                            "requests": {"cpu": "1"},
                        },
                        "workingDir": "/srv",
                    },
                ],
            },
        }}))
        .expect("a Runtime spec");
        let template = WorkerTemplate::of(&spec);
        assert_eq!(template.command, ["/opt/server"]);
        assert_eq!(template.args, ["--adapter", "python"]);
        assert_eq!(
            template.env,
            [EnvVar {
                name: "A".into(),
                value: "1".into()
            }]
        );
        assert_eq!(
            template.limits,
            BTreeMap::from([
                ("memory".to_string(), "1Gi".to_string()),
                ("nvidia.com/gpu".to_string(), "1".to_string())
            ])
        );
        let at = "template.spec.containers[runtime]";
        let mut ignored = ignored_template_fields(&spec);
        ignored.sort();
        let mut want = vec![
            "template.metadata.annotations".to_string(),
            "template.spec.securityContext".to_string(),
            "template.spec.containers[sidecar]".to_string(),
            format!("{at}.image (python:3.12)"),
            format!("{at}.workingDir"),
            format!("{at}.env[B].valueFrom"),
            format!("{at}.resources.requests"),
            format!("{at}.resources.limits.nvidia.com/gpu"),
        ];
        want.sort();
        assert_eq!(ignored, want);
        // The defaults ask for nothing it ignores.
        let defaults: RuntimeSpec = serde_json::from_value(serde_json::json!({})).expect("{}");
        assert!(ignored_template_fields(&defaults).is_empty());
        assert_eq!(WorkerTemplate::of(&defaults), WorkerTemplate::default());
    }

    #[test]
    fn pod_object_follows_the_contract() {
        let spec = WorkerSpec {
            namespace: "ns".into(),
            runtime: "rt".into(),
            runtime_uid: "uid-1".into(),
            template: WorkerTemplate::default(),
        };
        let pod = pod_object(
            &spec,
            "rt-abcde",
            Ports {
                grpc: 4242,
                metrics: Some(4243),
            },
        );
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels.get(RUNTIME_LABEL).map(String::as_str), Some("rt"));
        assert_eq!(
            labels.get(PROVISIONER_LABEL).map(String::as_str),
            Some("local")
        );
        let owner = &pod.metadata.owner_references.clone().unwrap_or_default()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("Runtime", "uid-1")
        );
        let container = &pod.spec.clone().unwrap_or_default().containers[0];
        assert_eq!(container.name, "runtimed");
        let port = &container.ports.clone().unwrap_or_default()[0];
        assert_eq!(
            (port.name.as_deref(), port.container_port),
            (Some("runtimed"), 4242)
        );
    }
}
