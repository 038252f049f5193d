//! The Kubernetes worker provisioner: per Runtime a Deployment of worker Pods and a Service
//! for runtimed's port, owned by the Runtime; the cluster (its Deployment controller, the
//! scheduler and the kubelets) makes the Pods and keeps their status.
//!
//! Each worker Pod has two containers and one shared `emptyDir` (`/var/run/kruntimes`: the
//! runtime server's socket and the workspaces):
//!
//! - `runtime`, a native sidecar (an init container that keeps running, so it starts
//!   before runtimed and stops after runtimed's drain, and after the template's own init
//!   containers): the template's `runtime` container as written (image, command, args,
//!   env, resources, security context, mounts…); without a command,
//!   `kruntimes-runtime-server --socket … --root …` followed by its args. It never sees a
//!   Kubernetes token: the Pod does not automount one.
//! - `runtimed`: `kruntimes runtimed` from the control-plane image, with the downward API
//!   (`POD_NAME`, `POD_NAMESPACE`, `POD_UID`, `POD_IP`), a projected token of the worker
//!   ServiceAccount mounted where kube-rs finds it in a Pod, its readiness probe
//!   (`/readyz`), and the gateway's CA from the ConfigMap [`GATEWAY_CA_CONFIGMAP`], which
//!   this provisioner keeps in every namespace that has a Runtime. runtimed drains on
//!   SIGTERM; the termination grace covers the drain.
//!
//! Objects are named [`object_name`] (`kruntimes-RUNTIME`, shortened with a hash when that
//! exceeds a DNS label). A reconcile applies (server-side) what is missing or changed since
//! its last apply ([`DESIRED_HASH`]); `cleanup`
//! deletes the Deployment and the Service of the Runtime's incarnation only (a Runtime
//! re-created under the same name keeps its new objects). On a cluster the owner
//! references would also let the garbage collector remove them.
//!
//! Each namespace with a Runtime also gets the worker identity, shared by its Runtimes: the
//! ServiceAccount the Pods run as (no token automounted), a RoleBinding there named after
//! and bound to [`WORKER_ROLE`] (what runtimed uses in its namespace, nothing elsewhere;
//! a binding's role cannot change, so its name says which it is), and a ClusterRoleBinding
//! `kruntimes:authorizer:NAMESPACE` to [`AUTHORIZER_ROLE`] (the reviews and the
//! cluster-wide reads of the per-Run authorizer), owned by the Namespace: it goes with the
//! namespace, and a namespace created later under the same name does not inherit it. The
//! install holds both ClusterRoles. These objects stay when the namespace's last Runtime
//! goes.
//!
//! The rest of the Pod is the Runtime's template (`spec.template`, a `PodTemplateSpec`):
//! its labels and annotations, more containers and init containers, volumes, the security
//! context, `runtimeClassName` (gVisor through a RuntimeClass), `serviceAccountName`
//! (runtimed's token is that account's then: bind it to [`WORKER_ROLE`] as this
//! provisioner binds its own), node selector, tolerations and affinity. A template that
//! takes a name the provisioner adds, or asks for an automounted token, fails the
//! reconcile ([`KubernetesError::Template`]), as standalone admission refuses it: the
//! Runtime shows `Provisioned` `False` with reason `InvalidTemplate` and the problems, and
//! is tried again only when it changes (or at the Runtime controller's resync).
//!
//! With a worker CA ([`KubernetesConfig::worker_ca_secret`]), runtimed's port speaks mutual
//! TLS: the provisioner issues the namespace's worker certificate into the Secret
//! [`WORKER_TLS_SECRET`] before the Deployment, and runtimed reads it from a volume of its
//! own (see [`crate::worker_certs`]). Without one, the port is plaintext.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, ConfigMapProjection, Container, ContainerPort, DownwardAPIProjection,
    DownwardAPIVolumeFile, EmptyDirVolumeSource, EnvVar, EnvVarSource, HTTPGetAction, KeyToPath,
    ObjectFieldSelector, PodSpec, PodTemplateSpec, Probe, ProjectedVolumeSource, SecurityContext,
    Service, ServiceAccountTokenProjection, ServicePort, ServiceSpec, Volume, VolumeMount,
    VolumeProjection,
};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kruntimes_api::Runtime;
use kruntimes_api::runtime::RUNTIME_CONTAINER;
use kruntimes_apiserver::bootstrap::{AUTHORIZER_ROLE, WORKER_ROLE};
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::local::PROVISIONER_LABEL;
use crate::provisioner::{Failure, Retry, WorkerCounts, WorkerProvisioner};
use crate::scheduler::RUNTIME_LABEL;
use crate::worker_certs::{WORKER_TLS_SECRET, WorkerCerts};

/// The value of [`PROVISIONER_LABEL`] on this provisioner's Pods.
pub const KUBERNETES_PROVISIONER: &str = "kubernetes";
/// The port runtimed serves on when the Runtime sets no `spec.port`.
pub const DEFAULT_RUNTIMED_PORT: i32 = 9443;
/// The user runtimed runs as (the control-plane image's).
const RUNTIMED_UID: i64 = 65532;
/// runtimed's probes and metrics port.
pub const HEALTH_PORT: i32 = 9090;
/// The ConfigMap holding the gateway's CA (`ca.crt`) in each namespace with a Runtime.
pub const GATEWAY_CA_CONFIGMAP: &str = "kruntimes-gateway-ca";
/// Where the shared volume is mounted in both containers.
const SHARED_DIR: &str = kruntimes_api::runtime::RUNTIME_SHARED_DIR;
/// Where kube-rs (`Config::infer`) finds a Pod's token, CA and namespace.
const TOKEN_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
const GATEWAY_CA_DIR: &str = "/etc/kruntimes/gateway-ca";
/// Where runtimed reads its worker TLS material (the Secret [`WORKER_TLS_SECRET`]).
const WORKER_TLS_DIR: &str = "/etc/kruntimes/worker-tls";
/// The longest a DNS label (a Service name) may be.
const MAX_LABEL: usize = 63;

/// What the workers run, beside each Runtime's template.
#[derive(Debug, Clone)]
pub struct KubernetesConfig {
    /// The image of the `runtimed` container (the control-plane image).
    pub runtimed_image: String,
    /// The image of the `runtime` container when the template names none.
    pub runtime_image: String,
    /// The ServiceAccount the worker Pods run as, in their own namespace.
    pub service_account: String,
    /// The gateway's CA (PEM), published to runtimed for Ready Runs' endpoints.
    pub gateway_ca: Option<String>,
    /// Extra runtimed arguments (the gateway URL, the session bounds).
    pub runtimed_args: Vec<String>,
    /// The Pods' termination grace, covering runtimed's drain.
    pub termination_grace_seconds: i64,
    /// The Secret (namespace, name) of the CA that issues the workers' mutual-TLS
    /// material ([`crate::worker_certs`]); `None`: runtimed's port is plaintext.
    pub worker_ca_secret: Option<(String, String)>,
}

impl KubernetesConfig {
    pub fn new(runtimed_image: impl Into<String>, runtime_image: impl Into<String>) -> Self {
        KubernetesConfig {
            runtimed_image: runtimed_image.into(),
            runtime_image: runtime_image.into(),
            service_account: "kruntimes-runtimed".to_string(),
            gateway_ca: None,
            runtimed_args: Vec::new(),
            termination_grace_seconds: 60,
            worker_ca_secret: None,
        }
    }
}

/// A failed step of the Kubernetes provisioner, naming the object.
#[derive(Debug, thiserror::Error)]
pub enum KubernetesError {
    #[error("{action} {kind} {}", qualified(namespace, name))]
    Api {
        action: &'static str,
        kind: String,
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "{kind} {namespace}/{name} exists and is not this Runtime's; rename or delete it \
         (the Runtime's workers need that name)"
    )]
    NotOurs {
        kind: String,
        namespace: String,
        name: String,
    },
    #[error(
        "{kind} {} exists and is not kruntimes'; the Runtimes of the namespace share it. \
         Delete it, or label it app.kubernetes.io/name=kruntimes to let kruntimes manage it",
        qualified(namespace, name)
    )]
    SharedNotOurs {
        kind: String,
        namespace: String,
        name: String,
    },
    #[error("Runtime {0} has no namespace or UID")]
    Incomplete(String),
    #[error("the worker CA in Secret {namespace}/{name} cannot issue: {reason}")]
    WorkerCa {
        namespace: String,
        name: String,
        reason: String,
    },
    #[error(
        "Secret {namespace}/{name} is of type {found:?}, not kubernetes.io/tls; delete it to \
         let kruntimes issue the workers' TLS material there"
    )]
    WorkerSecretType {
        namespace: String,
        name: String,
        found: String,
    },
    #[error("cannot issue the worker TLS material of Secret {namespace}/{name}")]
    Issue {
        namespace: String,
        name: String,
        #[source]
        source: kruntimes_apiserver::tls::TlsError,
    },
    #[error("the template of Runtime {runtime} cannot make a worker Pod: {problems}")]
    Template { runtime: String, problems: String },
}

/// `namespace/name`, or `name` alone for a cluster-scoped object.
fn qualified(namespace: &str, name: &str) -> String {
    match namespace {
        "" => name.to_string(),
        namespace => format!("{namespace}/{name}"),
    }
}

/// See the module documentation.
#[derive(Clone)]
pub struct KubernetesProvisioner {
    client: Client,
    config: std::sync::Arc<KubernetesConfig>,
    /// The namespaces (name and UID) whose worker identity was ensured, and when: it is
    /// looked at again after [`IDENTITY_RECHECK`], not at every reconcile of every
    /// Runtime there.
    identities: std::sync::Arc<std::sync::Mutex<HashMap<(String, String), Instant>>>,
    /// The issuer of the workers' TLS material, with a worker CA.
    certs: Option<WorkerCerts>,
}

/// How long an ensured worker identity of a namespace is trusted before it is read again
/// (someone may have deleted the ServiceAccount or a binding meanwhile).
pub const IDENTITY_RECHECK: Duration = Duration::from_secs(300);

impl KubernetesProvisioner {
    pub fn new(client: Client, config: KubernetesConfig) -> Self {
        let certs = config
            .worker_ca_secret
            .as_ref()
            .map(|(namespace, name)| WorkerCerts::new(client.clone(), namespace, name));
        KubernetesProvisioner {
            client,
            config: std::sync::Arc::new(config),
            identities: Default::default(),
            certs,
        }
    }

    /// The issuer of the workers' TLS material, when there is a worker CA.
    pub fn worker_certs(&self) -> Option<&WorkerCerts> {
        self.certs.as_ref()
    }

    fn identities(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Instant>> {
        // Only plain inserts and reads happen under the lock; a poisoned one is still whole.
        self.identities
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The name of a Runtime's Deployment and Service: `kruntimes-NAME`, or, beyond a DNS label,
/// its first characters and a hash of the whole name.
pub fn object_name(runtime: &str) -> String {
    let name = format!("kruntimes-{runtime}");
    if name.len() <= MAX_LABEL {
        return name;
    }
    let hash = fnv1a(runtime.as_bytes());
    let keep = MAX_LABEL - 9;
    let mut prefix = name[..keep].to_string();
    while prefix.ends_with('-') {
        prefix.pop();
    }
    format!("{prefix}-{:08x}", hash as u32)
}

fn labels(runtime: &str) -> BTreeMap<String, String> {
    let mut labels = selector(runtime);
    labels.extend([
        (
            "app.kubernetes.io/name".to_string(),
            "kruntimes".to_string(),
        ),
        (
            "app.kubernetes.io/component".to_string(),
            "runtimed".to_string(),
        ),
    ]);
    labels
}

/// The labels that select `runtime`'s worker Pods (a subset of [`labels`]).
fn selector(runtime: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (RUNTIME_LABEL.to_string(), runtime.to_string()),
        (
            PROVISIONER_LABEL.to_string(),
            KUBERNETES_PROVISIONER.to_string(),
        ),
    ])
}

fn owner(runtime: &Runtime) -> Option<OwnerReference> {
    let mut reference = runtime.controller_owner_ref(&())?;
    reference.block_owner_deletion = Some(true);
    Some(reference)
}

fn meta(runtime: &Runtime, name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        namespace: runtime.namespace(),
        labels: Some(labels(&runtime.name_any())),
        owner_references: owner(runtime).map(|o| vec![o]),
        ..ObjectMeta::default()
    }
}

fn field_env(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.to_string(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.to_string(),
        mount_path: path.to_string(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    }
}

/// The Deployment of `runtime`'s workers: the Runtime's Pod template with what the
/// provisioner adds (see the module documentation). What the template sets for the Pod
/// (security context, runtime class, scheduling, volumes, more containers, labels and
/// annotations) is kept; the provisioner's labels, the `runtime` container's socket, root
/// and shared mount, and the Pod's `automountServiceAccountToken: false` win.
pub fn deployment(config: &KubernetesConfig, runtime: &Runtime) -> Deployment {
    let name = runtime.name_any();
    let spec = &runtime.spec;
    let mut pod = spec.template.spec.clone().unwrap_or_default();
    let mut template = pod
        .containers
        .iter()
        .position(|c| c.name == RUNTIME_CONTAINER)
        .map(|i| pod.containers.remove(i))
        .unwrap_or_default();
    let port = spec.port.unwrap_or(DEFAULT_RUNTIMED_PORT);
    let socket = format!("{SHARED_DIR}/runtime.sock");
    let root = format!("{SHARED_DIR}/root");

    let user_args = template.args.take().unwrap_or_default();
    let (command, args) = match template.command.take().filter(|c| !c.is_empty()) {
        None => {
            let mut args = vec![
                "--socket".to_string(),
                socket.clone(),
                "--root".to_string(),
                root.clone(),
            ];
            args.extend(user_args);
            (vec!["kruntimes-runtime-server".to_string()], args)
        }
        Some(command) => (command, user_args),
    };
    let mut runtime_env: Vec<EnvVar> = template.env.take().unwrap_or_default();
    runtime_env.push(EnvVar {
        name: "KRUNTIMES_RUNTIME_SOCKET".to_string(),
        value: Some(socket.clone()),
        ..EnvVar::default()
    });
    runtime_env.push(EnvVar {
        name: "KRUNTIMES_RUNTIME_ROOT".to_string(),
        value: Some(root),
        ..EnvVar::default()
    });
    let mut runtime_mounts = template.volume_mounts.take().unwrap_or_default();
    runtime_mounts.push(mount("kruntimes", SHARED_DIR, false));
    let runtime_container = Container {
        name: RUNTIME_CONTAINER.to_string(),
        image: Some(
            template
                .image
                .take()
                .filter(|i| !i.is_empty())
                .unwrap_or_else(|| config.runtime_image.clone()),
        ),
        command: Some(command),
        args: Some(args),
        env: Some(runtime_env),
        volume_mounts: Some(runtime_mounts),
        // A native sidecar (Kubernetes 1.29 and later): it starts before runtimed and stops
        // after it, so runtimed's drain at SIGTERM still has a runtime server to finish on.
        restart_policy: Some("Always".to_string()),
        ..template
    };

    let mut runtimed_args = vec![
        "runtimed".to_string(),
        "--log-format=json".to_string(),
        format!("--runtime={name}"),
        format!("--runtime-socket={socket}"),
        format!("--listen=0.0.0.0:{port}"),
        format!("--metrics-listen=0.0.0.0:{HEALTH_PORT}"),
        format!("--snapshot-dir={SHARED_DIR}/snapshots"),
    ];
    let mut runtimed_mounts = vec![
        mount("kruntimes", SHARED_DIR, false),
        mount("runtimed-token", TOKEN_DIR, true),
    ];
    let mut volumes = pod.volumes.take().unwrap_or_default();
    volumes.extend([
        Volume {
            name: "kruntimes".to_string(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        },
        token_volume(),
    ]);
    if config.gateway_ca.is_some() {
        runtimed_args.push(format!("--gateway-ca={GATEWAY_CA_DIR}/ca.crt"));
        runtimed_mounts.push(mount("gateway-ca", GATEWAY_CA_DIR, true));
        volumes.push(Volume {
            name: "gateway-ca".to_string(),
            config_map: Some(k8s_openapi::api::core::v1::ConfigMapVolumeSource {
                name: GATEWAY_CA_CONFIGMAP.to_string(),
                ..Default::default()
            }),
            ..Volume::default()
        });
    }
    if config.worker_ca_secret.is_some() {
        use kruntimes_wire::worker::{CA_FILE, CERT_FILE, KEY_FILE};
        runtimed_args.extend([
            format!("--tls-cert={WORKER_TLS_DIR}/{CERT_FILE}"),
            format!("--tls-key={WORKER_TLS_DIR}/{KEY_FILE}"),
            format!("--tls-ca={WORKER_TLS_DIR}/{CA_FILE}"),
        ]);
        runtimed_mounts.push(mount("worker-tls", WORKER_TLS_DIR, true));
        volumes.push(Volume {
            name: "worker-tls".to_string(),
            secret: Some(k8s_openapi::api::core::v1::SecretVolumeSource {
                secret_name: Some(WORKER_TLS_SECRET.to_string()),
                ..Default::default()
            }),
            ..Volume::default()
        });
    }
    runtimed_args.extend(config.runtimed_args.iter().cloned());
    let runtimed_container = Container {
        name: "runtimed".to_string(),
        image: Some(config.runtimed_image.clone()),
        args: Some(runtimed_args),
        env: Some(vec![
            field_env("POD_NAME", "metadata.name"),
            field_env("POD_NAMESPACE", "metadata.namespace"),
            field_env("POD_UID", "metadata.uid"),
            field_env("POD_IP", "status.podIP"),
        ]),
        ports: Some(vec![
            ContainerPort {
                name: Some(kruntimes_wire::ownership::RUNTIMED_PORT_NAME.to_string()),
                container_port: port,
                protocol: Some("TCP".to_string()),
                ..ContainerPort::default()
            },
            ContainerPort {
                name: Some("health".to_string()),
                container_port: HEALTH_PORT,
                protocol: Some("TCP".to_string()),
                ..ContainerPort::default()
            },
        ]),
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/readyz".to_string()),
                port: IntOrString::String("health".to_string()),
                ..HTTPGetAction::default()
            }),
            period_seconds: Some(2),
            ..Probe::default()
        }),
        volume_mounts: Some(runtimed_mounts),
        // Its own, so that no Pod-level setting of the template applies to it.
        security_context: Some(SecurityContext {
            run_as_user: Some(RUNTIMED_UID),
            run_as_group: Some(RUNTIMED_UID),
            run_as_non_root: Some(true),
            allow_privilege_escalation: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_string()]),
                ..Capabilities::default()
            }),
            ..SecurityContext::default()
        }),
        ..Container::default()
    };

    let mut metadata = spec.template.metadata.clone().unwrap_or_default();
    metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .extend(labels(&name));
    // The runtime sidecar starts after the template's own init containers.
    let mut init_containers = pod.init_containers.take().unwrap_or_default();
    init_containers.push(runtime_container);
    let mut containers = std::mem::take(&mut pod.containers);
    containers.push(runtimed_container);
    Deployment {
        metadata: meta(runtime, &object_name(&name)),
        spec: Some(DeploymentSpec {
            replicas: Some(if runtime.meta().deletion_timestamp.is_some() {
                0
            } else {
                spec.replicas
            }),
            selector: LabelSelector {
                match_labels: Some(selector(&name)),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(metadata),
                spec: Some(PodSpec {
                    service_account_name: Some(
                        pod.service_account_name
                            .take()
                            .filter(|a| !a.is_empty())
                            .unwrap_or_else(|| config.service_account.clone()),
                    ),
                    // The runtime container runs user code: no token there. runtimed gets
                    // its own through the projected volume, which no other container can
                    // reach through /proc either.
                    automount_service_account_token: Some(false),
                    share_process_namespace: Some(false),
                    host_pid: Some(false),
                    host_ipc: Some(false),
                    termination_grace_period_seconds: Some(
                        pod.termination_grace_period_seconds
                            .take()
                            .unwrap_or(config.termination_grace_seconds),
                    ),
                    init_containers: Some(init_containers),
                    containers,
                    // One Service per Runtime: their variables would fill every worker's
                    // environment.
                    enable_service_links: Some(pod.enable_service_links.take().unwrap_or(false)),
                    volumes: Some(volumes),
                    ..pod
                }),
            },
            ..DeploymentSpec::default()
        }),
        ..Deployment::default()
    }
}

/// A token of the Pod's ServiceAccount, the cluster's CA and the namespace, as the
/// automounted volume holds them, for runtimed only.
fn token_volume() -> Volume {
    Volume {
        name: "runtimed-token".to_string(),
        projected: Some(ProjectedVolumeSource {
            sources: Some(vec![
                VolumeProjection {
                    service_account_token: Some(ServiceAccountTokenProjection {
                        path: "token".to_string(),
                        expiration_seconds: Some(3607),
                        ..ServiceAccountTokenProjection::default()
                    }),
                    ..VolumeProjection::default()
                },
                VolumeProjection {
                    config_map: Some(ConfigMapProjection {
                        name: "kube-root-ca.crt".to_string(),
                        items: Some(vec![KeyToPath {
                            key: "ca.crt".to_string(),
                            path: "ca.crt".to_string(),
                            ..KeyToPath::default()
                        }]),
                        ..ConfigMapProjection::default()
                    }),
                    ..VolumeProjection::default()
                },
                VolumeProjection {
                    downward_api: Some(DownwardAPIProjection {
                        items: Some(vec![DownwardAPIVolumeFile {
                            path: "namespace".to_string(),
                            field_ref: Some(ObjectFieldSelector {
                                field_path: "metadata.namespace".to_string(),
                                ..ObjectFieldSelector::default()
                            }),
                            ..DownwardAPIVolumeFile::default()
                        }]),
                    }),
                    ..VolumeProjection::default()
                },
            ]),
            ..ProjectedVolumeSource::default()
        }),
        ..Volume::default()
    }
}

/// The Service of `runtime`'s runtimed port.
pub fn service(runtime: &Runtime) -> Service {
    let name = runtime.name_any();
    let port = runtime.spec.port.unwrap_or(DEFAULT_RUNTIMED_PORT);
    Service {
        metadata: meta(runtime, &object_name(&name)),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".to_string()),
            selector: Some(selector(&name)),
            ports: Some(vec![ServicePort {
                name: Some(kruntimes_wire::ownership::RUNTIMED_PORT_NAME.to_string()),
                port,
                target_port: Some(IntOrString::String(
                    kruntimes_wire::ownership::RUNTIMED_PORT_NAME.to_string(),
                )),
                protocol: Some("TCP".to_string()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// The annotation holding a hash of what this provisioner last applied to an object.
pub const DESIRED_HASH: &str = "kruntimes.io/desired-hash";
/// The field manager of this provisioner's server-side applies.
pub(crate) const FIELD_MANAGER: &str = "kruntimes-controller-manager";

/// Brings the object to `desired` with a server-side apply (creating it when absent), unless
/// it already carries the hash of `desired` ([`DESIRED_HASH`]). The hash, not a comparison
/// with the live object, says whether anything changed: a cluster fills in defaults (a
/// Deployment's strategy, a Pod's dnsPolicy, a Service's clusterIP) that `desired` lacks, so
/// a comparison would apply on every reconcile. Fields others own (status, the Deployment
/// controller's annotations, the clusterIP) are left to them by the apply.
///
/// An object of that name that `mine` does not accept (another Runtime's, the control
/// plane's, the user's) is never taken over: the reconcile fails naming it, and is retried.
/// The apply carries the UID read, so an object replaced between the read and the apply is
/// not taken over either. One made by someone else between a read that found none and the
/// apply still is: a create would refuse it, but its fields would belong to an `Update`
/// manager that later applies could not remove.
async fn ensure<K>(
    api: &Api<K>,
    mut desired: K,
    mine: Owner<impl Fn(&K) -> bool>,
) -> Result<K, KubernetesError>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    let name = desired.name_any();
    let namespace = desired.namespace().unwrap_or_default();
    let failed = |action, source| KubernetesError::Api {
        action,
        kind: K::kind(&()).into_owned(),
        namespace: namespace.clone(),
        name: name.clone(),
        source,
    };
    let encoded = serde_json::to_vec(&desired).unwrap_or_default();
    let hash = format!("{:016x}", fnv1a(&encoded));
    desired
        .meta_mut()
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(DESIRED_HASH.to_string(), hash.clone());
    if let Some(current) = api.get_opt(&name).await.map_err(|e| failed("read", e))? {
        let kind = K::kind(&()).into_owned();
        match &mine {
            Owner::Runtime(mine) if !mine(&current) => {
                return Err(KubernetesError::NotOurs {
                    kind,
                    namespace,
                    name,
                });
            }
            Owner::Shared if !shared(current.meta()) => {
                return Err(KubernetesError::SharedNotOurs {
                    kind,
                    namespace,
                    name,
                });
            }
            _ => {}
        }
        if current.annotations().get(DESIRED_HASH) == Some(&hash) {
            return Ok(current);
        }
        // The apply is for the object read: one deleted and made again meanwhile (maybe
        // another owner's) has another UID, and the server refuses the apply (409) instead
        // of letting the forced apply take it over; the next reconcile reads it again.
        desired.meta_mut().uid = current.uid();
    }
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&desired),
    )
    .await
    .map_err(|e| failed("apply", e))
}

/// Whose an object of [`ensure`] is: one Runtime's (the test), or shared by kruntimes (the
/// label of [`shared_meta`]).
enum Owner<F> {
    Runtime(F),
    Shared,
}

/// [`Owner::Shared`], typed for [`ensure`].
fn shared_owner<K>() -> Owner<fn(&K) -> bool> {
    Owner::Shared
}

/// FNV-1a: stable across builds and platforms, unlike std's hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The metadata of an object that the namespace's Runtimes (or all of them) share, labelled
/// as kruntimes'.
pub(crate) fn shared_meta(name: &str, namespace: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        namespace: namespace.map(str::to_string),
        labels: Some(BTreeMap::from([(
            "app.kubernetes.io/name".to_string(),
            "kruntimes".to_string(),
        )])),
        ..ObjectMeta::default()
    }
}

/// Whether a shared object is ours: it carries our label (a user's object of that name is
/// never taken over).
pub(crate) fn shared(meta: &ObjectMeta) -> bool {
    meta.labels
        .as_ref()
        .and_then(|l| l.get("app.kubernetes.io/name"))
        .map(String::as_str)
        == Some("kruntimes")
}

/// The name of `namespace`'s ClusterRoleBinding to [`AUTHORIZER_ROLE`].
pub fn authorizer_binding_name(namespace: &str) -> String {
    format!("{AUTHORIZER_ROLE}:{namespace}")
}

/// The worker identity of `namespace` (see the module documentation): its ServiceAccount,
/// the RoleBinding to [`WORKER_ROLE`] and the ClusterRoleBinding to [`AUTHORIZER_ROLE`],
/// owned by the Namespace `namespace_uid`.
pub fn worker_identity(
    account: &str,
    namespace: &str,
    namespace_uid: &str,
) -> (ServiceAccount, RoleBinding, ClusterRoleBinding) {
    const RBAC: &str = "rbac.authorization.k8s.io";
    let subjects = Some(vec![Subject {
        kind: "ServiceAccount".to_string(),
        name: account.to_string(),
        namespace: Some(namespace.to_string()),
        ..Subject::default()
    }]);
    let role = |name: &str| RoleRef {
        api_group: RBAC.to_string(),
        kind: "ClusterRole".to_string(),
        name: name.to_string(),
    };
    (
        ServiceAccount {
            metadata: shared_meta(account, Some(namespace)),
            // Only runtimed's projected volume holds a token.
            automount_service_account_token: Some(false),
            ..ServiceAccount::default()
        },
        RoleBinding {
            metadata: shared_meta(WORKER_ROLE, Some(namespace)),
            role_ref: role(WORKER_ROLE),
            subjects: subjects.clone(),
        },
        ClusterRoleBinding {
            metadata: ObjectMeta {
                // Not blockOwnerDeletion: that would take more than reading Namespaces.
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".to_string(),
                    kind: "Namespace".to_string(),
                    name: namespace.to_string(),
                    uid: namespace_uid.to_string(),
                    ..OwnerReference::default()
                }]),
                ..shared_meta(&authorizer_binding_name(namespace), None)
            },
            role_ref: role(AUTHORIZER_ROLE),
            subjects,
        },
    )
}

impl KubernetesProvisioner {
    /// Returns the namespace's UID.
    async fn ensure_worker_identity(&self, namespace: &str) -> Result<String, KubernetesError> {
        let client = &self.client;
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let read_failed = |source| KubernetesError::Api {
            action: "read",
            kind: "Namespace".to_string(),
            namespace: String::new(),
            name: namespace.to_string(),
            source,
        };
        let uid = namespaces
            .get(namespace)
            .await
            .map_err(read_failed)?
            .metadata
            .uid
            .ok_or_else(|| KubernetesError::Incomplete(format!("namespace {namespace}")))?;
        // The Namespace is read every time: a namespace deleted and made again under its
        // name has a new UID, and none of the identity that the old one had.
        let key = (namespace.to_string(), uid.clone());
        let now = Instant::now();
        if self
            .identities()
            .get(&key)
            .is_some_and(|at| now.duration_since(*at) < IDENTITY_RECHECK)
        {
            return Ok(uid);
        }
        let (account, binding, authorizer) =
            worker_identity(&self.config.service_account, namespace, &uid);
        ensure(
            &Api::namespaced(client.clone(), namespace),
            account,
            shared_owner(),
        )
        .await?;
        ensure(
            &Api::namespaced(client.clone(), namespace),
            binding,
            shared_owner(),
        )
        .await?;
        ensure(&Api::all(client.clone()), authorizer, shared_owner()).await?;
        let mut identities = self.identities();
        identities.retain(|_, at| now.duration_since(*at) < IDENTITY_RECHECK);
        identities.insert(key, now);
        Ok(uid)
    }
}

/// How long a Runtime whose workers' names another owner's object holds waits before it
/// looks again (that object is not watched).
pub const NAME_TAKEN_RETRY: Duration = Duration::from_secs(30);

impl WorkerProvisioner for KubernetesProvisioner {
    type Error = KubernetesError;

    fn failure(error: &KubernetesError) -> Failure {
        match error {
            KubernetesError::Template { .. } => Failure {
                reason: "InvalidTemplate",
                retry: Retry::OnChange,
            },
            KubernetesError::NotOurs { .. }
            | KubernetesError::SharedNotOurs { .. }
            | KubernetesError::WorkerSecretType { .. } => Failure {
                reason: "NameTaken",
                retry: Retry::After(NAME_TAKEN_RETRY),
            },
            KubernetesError::WorkerCa { .. } => Failure {
                reason: "WorkerCaInvalid",
                retry: Retry::After(NAME_TAKEN_RETRY),
            },
            KubernetesError::Api { .. }
            | KubernetesError::Incomplete(_)
            | KubernetesError::Issue { .. } => Failure::TRANSIENT,
        }
    }

    async fn reconcile(&self, runtime: &Runtime) -> Result<WorkerCounts, KubernetesError> {
        let namespace = runtime
            .namespace()
            .filter(|_| runtime.uid().is_some())
            .ok_or_else(|| KubernetesError::Incomplete(runtime.name_any()))?;
        // What admission refuses in standalone mode; a CRD cannot say all of it.
        let mut problems = Vec::new();
        kruntimes_api::admission::validate_template(&runtime.spec.template, &mut problems);
        if !problems.is_empty() {
            return Err(KubernetesError::Template {
                runtime: runtime.name_any(),
                problems: problems
                    .iter()
                    .map(|p| format!("{}: {}", p.field, p.message))
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        }
        if let Some(ca) = &self.config.gateway_ca {
            let config_map = ConfigMap {
                metadata: shared_meta(GATEWAY_CA_CONFIGMAP, Some(&namespace)),
                data: Some(BTreeMap::from([("ca.crt".to_string(), ca.clone())])),
                ..ConfigMap::default()
            };
            ensure(
                &Api::namespaced(self.client.clone(), &namespace),
                config_map,
                shared_owner(),
            )
            .await?;
        }
        let namespace_uid = self.ensure_worker_identity(&namespace).await?;
        // runtimed's Pods mount the namespace's material: it exists before they do.
        // (The gateway's is kept by its own task: a problem there is no Runtime's.)
        if let Some(certs) = &self.certs {
            certs.ensure_namespace(&namespace, &namespace_uid).await?;
        }
        let uid = runtime.uid();
        let owned = |meta: &ObjectMeta| {
            meta.owner_references
                .iter()
                .flatten()
                .any(|o| o.controller == Some(true) && Some(&o.uid) == uid.as_ref())
        };
        ensure(
            &Api::namespaced(self.client.clone(), &namespace),
            service(runtime),
            Owner::Runtime(|s: &Service| owned(&s.metadata)),
        )
        .await?;
        let current = ensure(
            &Api::namespaced(self.client.clone(), &namespace),
            deployment(&self.config, runtime),
            Owner::Runtime(|d: &Deployment| owned(&d.metadata)),
        )
        .await?;
        let status = current.status.unwrap_or_default();
        Ok(WorkerCounts {
            current: status.replicas.unwrap_or(0),
            ready: status.ready_replicas.unwrap_or(0),
        })
    }

    async fn cleanup(&self, runtime: &ObjectRef<Runtime>) -> Result<(), KubernetesError> {
        let Some(namespace) = runtime.namespace.clone() else {
            return Ok(());
        };
        let name = object_name(&runtime.name);
        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), &namespace);
        let services: Api<Service> = Api::namespaced(self.client.clone(), &namespace);
        let uid = runtime.extra.uid.clone();
        let owner = Some(runtime.name.as_str());
        delete_owned(&deployments, &name, uid.as_deref(), owner, &namespace).await?;
        delete_owned(&services, &name, uid.as_deref(), owner, &namespace).await
    }
}

/// Deletes `name` when it exists and, with `owner_uid`, is owned by that incarnation of the
/// Runtime; the delete is preconditioned on the object's UID, so a re-created object of the
/// same name survives.
async fn delete_owned<K>(
    api: &Api<K>,
    name: &str,
    owner_uid: Option<&str>,
    runtime_name: Option<&str>,
    namespace: &str,
) -> Result<(), KubernetesError>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    let failed = |action, source| KubernetesError::Api {
        action,
        kind: K::kind(&()).into_owned(),
        namespace: namespace.to_string(),
        name: name.to_string(),
        source,
    };
    let Some(current) = api.get_opt(name).await.map_err(|e| failed("read", e))? else {
        return Ok(());
    };
    // Only a Runtime's own object: of that incarnation when its UID is known, else of a
    // Runtime of that name (the Runtime is gone and its UID unknown).
    let owned = current.meta().owner_references.iter().flatten().any(|o| {
        o.kind == "Runtime"
            && o.controller == Some(true)
            && match owner_uid {
                Some(uid) => o.uid == uid,
                None => Some(o.name.as_str()) == runtime_name,
            }
    });
    if !owned {
        return Ok(());
    }
    // Preconditioned on what was read: an object replaced or re-owned since is kept.
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: current.meta().uid.clone(),
            resource_version: current.meta().resource_version.clone(),
        }),
        ..DeleteParams::background()
    };
    match api.delete(name, &params).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => Ok(()),
        Err(error) => Err(failed("delete", error)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use kruntimes_api::runtime::RuntimeSpec;

    use super::*;

    fn runtime(name: &str) -> Runtime {
        let spec: RuntimeSpec = serde_json::from_value(serde_json::json!({
            "replicas": 3,
            "template": {"spec": {"containers": [{
                "name": "runtime",
                "args": ["--sandbox", "gvisor"],
                "env": [{"name": "A", "value": "1"}],
                "resources": {"limits": {"memory": "1Gi"}},
            }]}},
        }))
        .unwrap();
        let mut runtime = Runtime::new(name, spec);
        runtime.metadata.namespace = Some("team-a".into());
        runtime.metadata.uid = Some("u-1".into());
        runtime
    }

    #[test]
    fn object_names_are_dns_labels_and_distinct() {
        assert_eq!(object_name("python"), "kruntimes-python");
        let a = object_name(&"a".repeat(63));
        let b = object_name(&format!("{}b", "a".repeat(62)));
        assert!(a.len() <= 63 && b.len() <= 63, "{a} {b}");
        assert_ne!(a, b);
        assert!(!a.contains("--"), "{a}");
    }

    #[test]
    fn the_deployment_runs_the_template_beside_runtimed_and_selects_its_pods() {
        let config = KubernetesConfig {
            gateway_ca: Some("PEM".into()),
            runtimed_args: vec!["--gateway-url=https://gw".into()],
            ..KubernetesConfig::new("cp:1", "rt:1")
        };
        let d = deployment(&config, &runtime("python"));
        assert_eq!(d.metadata.name.as_deref(), Some("kruntimes-python"));
        let owner = &d.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("Runtime", "u-1")
        );
        assert_eq!(owner.controller, Some(true));
        let spec = d.spec.unwrap();
        assert_eq!(spec.replicas, Some(3));
        let labels = spec.template.metadata.unwrap().labels.unwrap();
        for (k, v) in spec.selector.match_labels.unwrap() {
            assert_eq!(labels.get(&k), Some(&v));
        }
        assert_eq!(
            labels.get(RUNTIME_LABEL).map(String::as_str),
            Some("python")
        );
        let pod = spec.template.spec.unwrap();
        assert_eq!(pod.automount_service_account_token, Some(false));
        let (Some([runtime_c]), [runtimed]) =
            (pod.init_containers.as_deref(), pod.containers.as_slice())
        else {
            panic!("the runtime sidecar and runtimed expected");
        };
        assert_eq!(runtime_c.restart_policy.as_deref(), Some("Always"));
        assert_eq!(runtime_c.name, "runtime");
        assert_eq!(runtime_c.image.as_deref(), Some("rt:1"));
        let args = runtime_c.args.clone().unwrap();
        assert_eq!(&args[args.len() - 2..], ["--sandbox", "gvisor"]);
        assert!(
            runtime_c
                .env
                .as_ref()
                .unwrap()
                .iter()
                .any(|e| e.name == "A")
        );
        assert!(
            runtime_c
                .volume_mounts
                .iter()
                .flatten()
                .all(|m| m.mount_path != TOKEN_DIR),
            "the runtime container must not see runtimed's token"
        );
        let limits = runtime_c
            .resources
            .as_ref()
            .unwrap()
            .limits
            .as_ref()
            .unwrap();
        assert_eq!(limits["memory"].0, "1Gi");
        assert_eq!(runtimed.image.as_deref(), Some("cp:1"));
        let runtimed_args = runtimed.args.clone().unwrap();
        assert!(runtimed_args.contains(&"--runtime=python".to_string()));
        assert!(runtimed_args.contains(&"--gateway-url=https://gw".to_string()));
        assert!(runtimed_args.contains(&format!("--gateway-ca={GATEWAY_CA_DIR}/ca.crt")));
        let env: Vec<&str> = runtimed
            .env
            .iter()
            .flatten()
            .map(|e| e.name.as_str())
            .collect();
        assert_eq!(env, ["POD_NAME", "POD_NAMESPACE", "POD_UID", "POD_IP"]);
        let port = runtimed.ports.as_ref().unwrap();
        assert_eq!(
            port[0].name.as_deref(),
            Some(kruntimes_wire::ownership::RUNTIMED_PORT_NAME)
        );
        assert_eq!(port[0].container_port, DEFAULT_RUNTIMED_PORT);
        assert!(runtimed.readiness_probe.is_some());
        assert!(
            runtimed
                .volume_mounts
                .iter()
                .flatten()
                .any(|m| m.mount_path == TOKEN_DIR)
        );
    }

    #[test]
    fn a_deleting_runtime_has_no_workers_and_a_template_command_replaces_the_server() {
        let mut r = runtime("python");
        r.spec.template.spec.as_mut().unwrap().containers[0].command =
            Some(vec!["/bin/my-server".into()]);
        r.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            Default::default(),
        ));
        let d = deployment(&KubernetesConfig::new("cp", "rt"), &r);
        let spec = d.spec.unwrap();
        assert_eq!(spec.replicas, Some(0));
        let c = &spec.template.spec.unwrap().init_containers.unwrap()[0];
        assert_eq!(
            c.command.as_deref(),
            Some(["/bin/my-server".to_string()].as_slice())
        );
        assert_eq!(
            c.args.as_deref(),
            Some(["--sandbox".to_string(), "gvisor".into()].as_slice())
        );
    }

    #[test]
    fn the_pod_keeps_what_the_template_sets_and_what_the_provisioner_adds_wins() {
        let spec: RuntimeSpec = serde_json::from_value(serde_json::json!({
            "template": {
                "metadata": {
                    "labels": {"team": "a", RUNTIME_LABEL: "spoofed"},
                    "annotations": {"note": "kept"},
                },
                "spec": {
                    "runtimeClassName": "gvisor",
                    "serviceAccountName": "custom",
                    "nodeSelector": {"pool": "sandboxes"},
                    "tolerations": [{"key": "sandbox", "operator": "Exists"}],
                    "securityContext": {"fsGroup": 2000},
                    "terminationGracePeriodSeconds": 120,
                    "initContainers": [{"name": "setup", "image": "busybox"}],
                    "containers": [
                        {"name": "metrics", "image": "exporter"},
                        {
                            "name": "runtime",
                            "image": "python:3.12",
                            "securityContext": {"privileged": true},
                            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                        },
                    ],
                    "volumes": [{"name": "data", "emptyDir": {}}],
                },
            },
        }))
        .unwrap();
        let mut r = Runtime::new("python", spec);
        r.metadata.namespace = Some("team-a".into());
        r.metadata.uid = Some("u-1".into());
        let template = deployment(&KubernetesConfig::new("cp", "rt"), &r)
            .spec
            .unwrap()
            .template;
        let meta = template.metadata.unwrap();
        let labels = meta.labels.unwrap();
        assert_eq!(labels["team"], "a");
        assert_eq!(labels[RUNTIME_LABEL], "python", "the selector's labels win");
        assert_eq!(meta.annotations.unwrap()["note"], "kept");
        let pod = template.spec.unwrap();
        assert_eq!(pod.runtime_class_name.as_deref(), Some("gvisor"));
        assert_eq!(pod.service_account_name.as_deref(), Some("custom"));
        assert_eq!(pod.automount_service_account_token, Some(false));
        assert_eq!(pod.share_process_namespace, Some(false));
        assert_eq!(pod.host_pid, Some(false));
        assert_eq!(pod.termination_grace_period_seconds, Some(120));
        // The template's Pod security context does not reach runtimed: it has its own.
        let runtimed = pod
            .containers
            .iter()
            .find(|c| c.name == "runtimed")
            .unwrap();
        let context = runtimed.security_context.as_ref().unwrap();
        assert_eq!(context.run_as_user, Some(RUNTIMED_UID));
        assert_eq!(context.allow_privilege_escalation, Some(false));
        assert_eq!(pod.node_selector.unwrap()["pool"], "sandboxes");
        assert_eq!(pod.tolerations.unwrap().len(), 1);
        assert_eq!(pod.security_context.unwrap().fs_group, Some(2000));
        let init: Vec<&str> = pod
            .init_containers
            .iter()
            .flatten()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(init, ["setup", "runtime"], "the sidecar starts after setup");
        let containers: Vec<&str> = pod.containers.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(containers, ["metrics", "runtimed"]);
        let runtime_c = &pod.init_containers.as_ref().unwrap()[1];
        assert_eq!(runtime_c.image.as_deref(), Some("python:3.12"));
        assert_eq!(
            runtime_c.security_context.as_ref().unwrap().privileged,
            Some(true)
        );
        let mounts: Vec<&str> = runtime_c
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| m.mount_path.as_str())
            .collect();
        assert_eq!(mounts, ["/data", SHARED_DIR]);
        let volumes: Vec<&str> = pod
            .volumes
            .iter()
            .flatten()
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(volumes, ["data", "kruntimes", "runtimed-token"]);
    }

    #[test]
    fn the_service_selects_the_workers_on_runtimeds_port() {
        let mut r = runtime("python");
        r.spec.port = Some(7000);
        let s = service(&r).spec.unwrap();
        assert_eq!(s.ports.as_ref().unwrap()[0].port, 7000);
        let d = deployment(&KubernetesConfig::new("cp", "rt"), &r);
        let labels = d.spec.unwrap().template.metadata.unwrap().labels.unwrap();
        for (k, v) in s.selector.unwrap() {
            assert_eq!(labels.get(&k), Some(&v));
        }
    }
}
