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
pub mod error;
mod fsutil;
pub mod http;
pub mod kinds;
pub mod patch;
pub mod protobuf;
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
}

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

/// Namespaces that always exist.
const SYSTEM_NAMESPACES: [&str; 4] = ["default", "kube-system", "kube-public", "kruntimes-system"];

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
    bootstrap_namespaces(&store).await?;

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
    auth::write_kubeconfig(&kubeconfig, &url, &pki.ca_pem, &token)
        .context("failed to write the kubeconfig")?;
    let mut authenticator = auth::Authenticator::default();
    authenticator.insert(digest, auth::admin());

    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let state = Arc::new(http::AppState {
        store: store.clone(),
        auth: authenticator,
        snapshots: Default::default(),
        shutdown: shutdown_rx.clone(),
        namespaces_changed: tokio::sync::Notify::new(),
    });
    let sweeper = tokio::spawn(sweep_namespaces(Arc::clone(&state)));
    let app = http::router(state);
    let serve = tokio::spawn(http::serve(listener, pki.server_config, app, shutdown_rx));
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

async fn bootstrap_namespaces(store: &Store) -> anyhow::Result<()> {
    for name in SYSTEM_NAMESPACES {
        if store.snapshot().objects.contains_key(&namespace_key(name)) {
            continue;
        }
        let object = json!({
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": name,
                "uid": uuid::Uuid::new_v4().to_string(),
                "creationTimestamp": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                "generation": 1,
                "labels": {"kubernetes.io/metadata.name": name},
            },
            "spec": {"finalizers": ["kubernetes"]},
            "status": {"phase": "Active"},
        });
        match store
            .write(Write::Create {
                key: namespace_key(name),
                object,
            })
            .await
        {
            Ok(_) | Err(store::StoreError::AlreadyExists) => {}
            Err(e) => return Err(e).context("failed to create the system namespaces"),
        }
    }
    Ok(())
}

/// Finishes namespace deletion: deletes everything in a terminating namespace (objects with
/// finalizers are marked and wait for them), then the namespace itself once it is empty.
async fn sweep_namespaces(state: Arc<http::AppState>) {
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
            .objects
            .iter()
            .filter(|(k, s)| {
                &*k.resource == "namespaces"
                    && s.object.pointer("/metadata/deletionTimestamp").is_some()
            })
            .map(|(k, _)| k.name.clone())
            .collect();
        for ns in &terminating {
            let contents: Vec<(Key, store::Stored)> = snap
                .objects
                .iter()
                .filter(|(k, _)| k.namespace == *ns)
                .map(|(k, s)| (k.clone(), s.clone()))
                .collect();
            if contents.is_empty() {
                if let Some(stored) = snap.objects.get(&namespace_key(ns)) {
                    let _ = state
                        .store
                        .write(Write::Delete {
                            key: namespace_key(ns),
                            expected_rv: stored.rv,
                            object: (*stored.object).clone(),
                        })
                        .await;
                }
                continue;
            }
            for (key, stored) in contents {
                if stored
                    .object
                    .pointer("/metadata/deletionTimestamp")
                    .is_some()
                {
                    continue;
                }
                let has_finalizers = stored
                    .object
                    .pointer("/metadata/finalizers")
                    .and_then(|f| f.as_array())
                    .is_some_and(|f| !f.is_empty());
                let write = if has_finalizers {
                    let mut next = (*stored.object).clone();
                    if let Some(meta) = next.get_mut("metadata").and_then(|m| m.as_object_mut()) {
                        meta.insert(
                            "deletionTimestamp".into(),
                            json!(
                                chrono::Utc::now()
                                    .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                            ),
                        );
                        meta.insert("deletionGracePeriodSeconds".into(), json!(0));
                    }
                    Write::Update {
                        key,
                        expected_rv: stored.rv,
                        object: next,
                    }
                } else {
                    Write::Delete {
                        key,
                        expected_rv: stored.rv,
                        object: (*stored.object).clone(),
                    }
                };
                // A conflict means someone else changed it; the next pass looks again.
                let _ = state.store.write(write).await;
            }
        }
        tokio::select! {
            _ = state.namespaces_changed.notified() => {}
            received = live.recv() => {
                if let Err(tokio::sync::broadcast::error::RecvError::Closed) = received {
                    return;
                }
                if terminating.is_empty() {
                    // Nothing to finish: wait for the next change without rescanning per event.
                    continue;
                }
            }
        }
    }
}
