//! The embedded, Kubernetes-compatible API server of kruntimes.
//!
//! It owns durable objects, watches and authentication decisions for standalone mode
//! (ARCHITECTURE.md, "One control-plane contract"). It serves only the kinds kruntimes
//! needs (runs and runtimes with their status subresource, v1 pods, namespaces and events,
//! events.k8s.io events and coordination.k8s.io leases) over HTTPS, stored in SQLite. It
//! never runs code or routes invocations.
//!
//! Layers, top to bottom: [`http`] (TLS, auth, routing, handlers), [`kinds`] (admission
//! from `kruntimes-api`), [`store`] (snapshots, resourceVersions, watch history) and
//! [`store::sqlite`] (durability).

pub mod auth;
pub mod bootstrap;
pub mod builtin;
pub mod decode;
pub mod error;
pub mod events;
mod fsutil;
mod gc;
pub mod http;
pub mod kinds;
pub mod patch;
pub mod protobuf;
pub mod rbac;
pub mod resources;
pub mod selectors;
pub mod store;
pub mod tls;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use serde_json::json;

use crate::store::{Key, Store, Write};

/// How hard a commit is pushed to disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// A commit survives a crash of the process, not necessarily a power loss.
    Process,
    /// Every commit is synced to disk.
    Full,
}

/// How to start the server.
#[derive(Debug, Clone)]
pub struct Config {
    pub data_dir: PathBuf,
    /// A port of 0 picks a free one.
    pub addr: SocketAddr,
    /// Past changes kept for watches to resume from.
    pub watch_history: usize,
    pub durability: Durability,
    /// How long an HTTP/1.1 connection may take to send a request's headers (slowloris).
    pub header_read_timeout: std::time::Duration,
    /// How long a request body may take to arrive whole; beyond it, 408.
    pub body_read_timeout: std::time::Duration,
    /// The most stored objects a list without `limit` examines before it is refused
    /// (413: page it with `limit` and `continue`) rather than scanning without end.
    pub unpaged_list_examined: usize,
}

impl Config {
    /// A server in `data_dir` on `addr` with every other setting at its default
    /// (process durability, 1,000 changes of watch history).
    pub fn new(data_dir: PathBuf, addr: SocketAddr) -> Config {
        Config {
            data_dir,
            addr,
            watch_history: 1000,
            durability: Durability::Process,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            body_read_timeout: DEFAULT_BODY_READ_TIMEOUT,
            unpaged_list_examined: DEFAULT_UNPAGED_LIST_EXAMINED,
        }
    }
}

/// The default of [`Config::header_read_timeout`].
pub const DEFAULT_HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// The default of [`Config::body_read_timeout`].
pub const DEFAULT_BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// The default of [`Config::unpaged_list_examined`]: ten pages' budget.
pub const DEFAULT_UNPAGED_LIST_EXAMINED: usize = 10 * http::handlers::LIST_EXAMINED_PER_PAGE;

/// A running server.
pub struct Server {
    local_addr: SocketAddr,
    kubeconfig: PathBuf,
    shutdown: tokio::sync::watch::Sender<bool>,
    serve: tokio::task::JoinHandle<()>,
    sweeper: tokio::task::JoinHandle<()>,
}

impl Server {
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// Stops accepting, ends watches, and drains open connections. Every acknowledged
    /// write is already durable.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        let _ = self.shutdown.send(true);
        self.sweeper.abort();
        self.serve.await.context("the server task failed")?;
        Ok(())
    }
}

/// Opens the store in `config.data_dir`, prepares TLS and the kubeconfig, and starts serving.
pub async fn start(config: Config) -> anyhow::Result<Server> {
    let data_dir = &config.data_dir;
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("failed to create {}", data_dir.display()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("failed to restrict {}", data_dir.display()))?;
    }
    let backend = store::sqlite::SqliteBackend::open(
        &data_dir.join("state.db"),
        config.durability == Durability::Full,
    )
    .context("failed to open the database")?;
    let store = Store::open(backend, config.watch_history).context("failed to load the store")?;
    bootstrap(&store).await?;
    upgrade_runtime_templates(&store).await?;
    upgrade_suspend_snapshots(&store).await?;

    let pki =
        tls::prepare(&data_dir.join("pki"), config.addr.ip()).context("failed to prepare TLS")?;
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .with_context(|| format!("failed to listen on {}", config.addr))?;
    let local_addr = listener.local_addr()?;
    let client_ip = if local_addr.ip().is_unspecified() {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else {
        local_addr.ip()
    };
    let url = format!("https://{}", SocketAddr::new(client_ip, local_addr.port()));
    let kubeconfig = data_dir.join("kubeconfig");
    let (token, digest) = auth::admin_token(&data_dir.join("auth"), &kubeconfig)
        .context("failed to prepare the admin token")?;
    auth::write_kubeconfig(
        &kubeconfig,
        &url,
        &pki.ca_pem,
        &token,
        "kruntimes-admin",
        "default",
    )
    .context("failed to write the kubeconfig")?;
    let mut authenticator = auth::Authenticator::default();
    authenticator.insert(digest, auth::admin());
    component_kubeconfigs(
        &store,
        &authenticator,
        &data_dir.join("components"),
        &url,
        &pki.ca_pem,
    )
    .await?;

    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let state = Arc::new(http::AppState {
        store: store.clone(),
        auth: authenticator,
        snapshots: Default::default(),
        shutdown: shutdown_rx.clone(),
        namespaces_changed: tokio::sync::Notify::new(),
        decodes: tokio::sync::Semaphore::new(http::DECODE_PERMITS),
        body_read_timeout: config.body_read_timeout,
        unpaged_list_examined: config.unpaged_list_examined,
        metrics: http::metrics::Metrics::new(store.clone()),
    });
    let sweeper = tokio::spawn(sweep_namespaces(Arc::clone(&state)));
    tokio::spawn(collect_tokens(store.clone(), shutdown_rx.clone()));
    tokio::spawn(events::expire_events(store.clone(), shutdown_rx.clone()));
    tokio::spawn(gc::run(store.clone(), shutdown_rx.clone()));
    let app = http::router(state);
    let serve = tokio::spawn(http::serve(
        listener,
        pki.server_config,
        app,
        config.header_read_timeout,
        shutdown_rx,
    ));
    tracing::info!(%url, data_dir = %data_dir.display(), "apiserver listening");
    Ok(Server {
        local_addr,
        kubeconfig,
        shutdown: shutdown_tx,
        serve,
        sweeper,
    })
}

fn namespace_key(name: &str) -> Key {
    Key {
        resource: Arc::from("namespaces"),
        namespace: String::new(),
        name: name.to_string(),
    }
}

/// The store key of a bootstrap object, from its apiVersion and kind.
fn key_of(object: &serde_json::Value) -> anyhow::Result<Key> {
    let api_version = object["apiVersion"].as_str().unwrap_or("");
    let kind = object["kind"].as_str().unwrap_or("");
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let def = resources::RESOURCES
        .iter()
        .find(|r| r.group == group && r.version == version && r.kind == kind)
        .with_context(|| format!("no resource serves {api_version} {kind}"))?;
    Ok(Key {
        resource: Arc::from(def.store_key),
        namespace: object["metadata"]["namespace"]
            .as_str()
            .unwrap_or("")
            .to_string(),
        name: object["metadata"]["name"]
            .as_str()
            .unwrap_or("")
            .to_string(),
    })
}

/// Creates `object` unless it exists. A bootstrap ClusterRole whose rules drifted from the
/// built-in ones is put back, as Kubernetes reconciles its default roles.
async fn ensure(store: &Store, mut object: serde_json::Value) -> anyhow::Result<()> {
    let key = key_of(&object)?;
    if let Some(current) = store.snapshot().objects.get(&key) {
        let reconcile =
            object["kind"] == "ClusterRole" && current.object.get("rules") != object.get("rules");
        if reconcile {
            let mut next = (*current.object).clone();
            next["rules"] = object["rules"].clone();
            match store
                .write(Write::Update {
                    key,
                    expected_rv: current.rv,
                    object: next,
                })
                .await
            {
                Ok(_) | Err(store::StoreError::Conflict { .. }) => {}
                Err(e) => return Err(e).context("failed to reconcile a bootstrap role"),
            }
        }
        return Ok(());
    }
    http::handlers::stamp_new(&mut object);
    match store.write(Write::Create { key, object }).await {
        Ok(_) | Err(store::StoreError::AlreadyExists) => Ok(()),
        Err(e) => Err(e).context("failed to create a bootstrap object"),
    }
}

/// Rewrites the Runtimes stored by an earlier version with the earlier template shape
/// ([`kruntimes_api::runtime::upgrade_legacy_template`]), as a new generation, before any
/// client reads them.
async fn upgrade_runtime_templates(store: &Store) -> anyhow::Result<()> {
    upgrade_each(
        store,
        "runtimes.kruntimes.io",
        "upgraded a Runtime's template to a Pod template",
        |stored| {
            let mut object = stored.clone();
            let spec = object.get_mut("spec")?;
            if !kruntimes_api::runtime::upgrade_legacy_template(spec) {
                return None;
            }
            let generation = object["metadata"]["generation"].as_i64().unwrap_or(1);
            object["metadata"]["generation"] = serde_json::json!(generation + 1);
            Some(object)
        },
    )
    .await
}

/// Rewrites the suspend Snapshots stored by an earlier version with an owner reference to
/// their Run ([`gc::unowned_suspend`]: pinned by UID instead), before any client reads
/// them and before the collector's first look, which would take one a fork still starts
/// from once its Run is gone.
async fn upgrade_suspend_snapshots(store: &Store) -> anyhow::Result<()> {
    upgrade_each(
        store,
        "snapshots.kruntimes.io",
        "a suspend Snapshot no longer names its Run as owner",
        gc::unowned_suspend,
    )
    .await
}

/// A start-up upgrade: every stored object of `resource` that `upgrade` rewrites is
/// written back, conditional on the version read.
async fn upgrade_each(
    store: &Store,
    resource: &str,
    done: &str,
    upgrade: impl Fn(&serde_json::Value) -> Option<serde_json::Value>,
) -> anyhow::Result<()> {
    let snap = store.snapshot();
    for (key, stored) in snap.scan(resource, None) {
        let Some(object) = upgrade(&stored.object) else {
            continue;
        };
        store
            .write(Write::Update {
                key: key.clone(),
                expected_rv: stored.rv,
                object,
            })
            .await
            .with_context(|| format!("failed to upgrade {resource} {}", key.name))?;
        tracing::info!(namespace = %key.namespace, name = %key.name, "{done}");
    }
    Ok(())
}

async fn bootstrap(store: &Store) -> anyhow::Result<()> {
    for name in bootstrap::NAMESPACES {
        ensure(
            store,
            json!({
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name}},
                "spec": {"finalizers": ["kubernetes"]},
                "status": {"phase": "Active"},
            }),
        )
        .await?;
    }
    for object in bootstrap::default_policy()
        .into_iter()
        .chain(bootstrap::component_policy())
    {
        ensure(store, object).await?;
    }
    Ok(())
}

/// Gives each component a kubeconfig under `DATA_DIR/components/` with a token of its own
/// ServiceAccount, reusing a still-valid one across restarts.
async fn component_kubeconfigs(
    store: &Store,
    authenticator: &auth::Authenticator,
    dir: &Path,
    url: &str,
    ca_pem: &str,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("failed to create {}", dir.display()))?;
    for component in bootstrap::COMPONENTS {
        let path = dir.join(format!("{component}.kubeconfig"));
        let account = bootstrap::component_account(component);
        let existing = auth::token_in_kubeconfig(&path).filter(|t| {
            authenticator
                .authenticate_token(&store.snapshot(), t)
                .is_some()
        });
        let token = match existing {
            Some(token) => token,
            None => {
                let snap = store.snapshot();
                let sa_key = Key {
                    resource: Arc::from("serviceaccounts"),
                    namespace: bootstrap::SYSTEM_NAMESPACE.into(),
                    name: account.clone(),
                };
                let uid = snap
                    .objects
                    .get(&sa_key)
                    .and_then(|s| {
                        s.object
                            .pointer("/metadata/uid")
                            .and_then(|u| u.as_str())
                            .map(str::to_string)
                    })
                    .with_context(|| format!("the ServiceAccount {account} is missing"))?;
                let identity =
                    auth::service_account_identity(bootstrap::SYSTEM_NAMESPACE, &account, &uid);
                let issued = auth::issue(
                    &identity,
                    Some(auth::BoundServiceAccount {
                        namespace: bootstrap::SYSTEM_NAMESPACE.into(),
                        name: account.clone(),
                        uid,
                    }),
                    None,
                );
                let mut object = issued.object.clone();
                http::handlers::stamp_new(&mut object);
                let key = Key {
                    resource: Arc::from(auth::ACCESS_TOKENS),
                    namespace: String::new(),
                    name: issued.name.clone(),
                };
                store
                    .write(Write::Create { key, object })
                    .await
                    .context("failed to store a component token")?;
                issued.token
            }
        };
        auth::write_kubeconfig(
            &path,
            url,
            ca_pem,
            &token,
            &account,
            bootstrap::SYSTEM_NAMESPACE,
        )
        .with_context(|| format!("failed to write {}", path.display()))?;
    }
    Ok(())
}

/// Expired tokens are kept this long (so `krt token list` still shows them), then deleted.
const EXPIRED_TOKEN_RETENTION: chrono::Duration = chrono::Duration::hours(1);
/// How often dead tokens are looked for.
const TOKEN_GC_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

/// Deletes AccessTokens that can never authenticate again: expired for longer than
/// [`EXPIRED_TOKEN_RETENTION`], or bound to a ServiceAccount that is gone or was recreated.
async fn collect_tokens(store: Store, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    let mut ticker = tokio::time::interval(TOKEN_GC_INTERVAL);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.changed() => return,
        }
        let snap = store.snapshot();
        let now = chrono::Utc::now();
        for (key, stored) in snap.scan(auth::ACCESS_TOKENS, None) {
            if auth::is_dead(&snap, &stored.object, now - EXPIRED_TOKEN_RETENTION) {
                let write = Write::Delete {
                    key: key.clone(),
                    expected_rv: stored.rv,
                    object: (*stored.object).clone(),
                };
                // A conflict means it changed meanwhile; the next round looks again.
                let _ = store.write(write).await;
            }
        }
    }
}

/// Finishes namespace deletion: deletes everything in a terminating namespace (objects with
/// finalizers are marked and wait for them), then the namespace itself once it is empty.
/// It looks again only when a namespace changes or something in a terminating one does.
async fn sweep_namespaces(state: Arc<http::AppState>) {
    use tokio::sync::broadcast::error::RecvError;
    let mut live = match state.store.subscribe(state.store.snapshot().rv) {
        Ok(sub) => sub.live,
        Err(e) => {
            tracing::error!(error = %e, "namespace sweeper could not subscribe");
            return;
        }
    };
    loop {
        let snap = state.store.snapshot();
        let terminating: Vec<String> = snap
            .scan("namespaces", None)
            .filter(|(_, s)| s.object.pointer("/metadata/deletionTimestamp").is_some())
            .map(|(k, _)| k.name.clone())
            .collect();
        for ns in &terminating {
            finish_namespace(&state.store, &snap, ns).await;
        }
        loop {
            tokio::select! {
                _ = state.namespaces_changed.notified() => break,
                received = live.recv() => match received {
                    Ok(event) => {
                        if &*event.key.resource == "namespaces" || terminating.contains(&event.key.namespace) {
                            break;
                        }
                    }
                    Err(RecvError::Lagged(_)) => break,
                    Err(RecvError::Closed) => return,
                },
            }
        }
    }
}

async fn finish_namespace(store: &Store, snap: &store::Snapshot, ns: &str) {
    let contents: Vec<(Key, store::Stored)> = resources::RESOURCES
        .iter()
        .filter(|r| r.namespaced && !r.virtual_kind)
        // Both Event APIs share one store key: scan it once.
        .filter(|r| !events::converts(r))
        .flat_map(|r| snap.scan(r.store_key, Some(ns)))
        .map(|(k, s)| (k.clone(), s.clone()))
        .collect();
    if contents.is_empty() {
        if let Some(stored) = snap.objects.get(&namespace_key(ns)) {
            let _ = store
                .write(Write::Delete {
                    key: namespace_key(ns),
                    expected_rv: stored.rv,
                    object: (*stored.object).clone(),
                })
                .await;
        }
        return;
    }
    for (key, stored) in contents {
        if stored
            .object
            .pointer("/metadata/deletionTimestamp")
            .is_some()
        {
            continue;
        }
        let write = gc::deletion(key, &stored);
        // A conflict means someone else changed it; the next pass looks again.
        let _ = store.write(write).await;
    }
}
