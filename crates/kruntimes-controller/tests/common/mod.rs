//! Shared setup for the controller's integration tests: a real `kruntimes up`, an admin
//! client that plays the user and the worker provisioner, and a client with the
//! controller-manager's own least-privilege identity.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use kruntimes_api::run::{Termination, TerminationMode};
use kruntimes_api::{Phase, Run, RunSpec, Runtime, RuntimeSpec};
use kruntimes_controller::{Config, ControllerManager, LeaseConfig};
use kruntimes_testkit::Server;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};
use serde_json::json;

pub const NS: &str = "default";
pub const WAIT: Duration = Duration::from_secs(30);

/// A running API server and the two identities the tests use.
pub struct Env {
    pub server: Server,
    pub admin: Client,
    /// The controller-manager's component identity.
    pub controller: Client,
}

pub async fn start() -> Result<Env> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
    let server = Server::start()?;
    let admin = server.client().await?;
    let kubeconfig =
        kube::config::Kubeconfig::read_from(server.component_kubeconfig("controller-manager"))
            .context("read the controller-manager kubeconfig")?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    let controller = Client::try_from(config)?;
    Ok(Env {
        server,
        admin,
        controller,
    })
}

impl Env {
    pub fn runs(&self) -> Api<Run> {
        Api::namespaced(self.admin.clone(), NS)
    }

    /// A controller-manager with the controller identity and short Lease timings.
    pub fn manager(&self, lease: &str) -> ControllerManager {
        self.manager_with(lease, Duration::from_secs(2), Duration::from_millis(1500))
    }

    /// A controller-manager with the controller identity and the given Lease timings.
    pub fn manager_with(
        &self,
        lease: &str,
        lease_duration: Duration,
        renew_deadline: Duration,
    ) -> ControllerManager {
        let mut config = Config::new(NS);
        config.lease = LeaseConfig {
            lease_duration,
            renew_deadline,
            retry_period: Duration::from_millis(200),
            ..LeaseConfig::new(NS, lease)
        };
        ControllerManager::new(self.controller.clone(), config)
    }

    /// Starts a controller-manager in the background; abort the handle to "crash" it.
    pub fn spawn_manager(&self, lease: &str) -> (String, tokio::task::JoinHandle<()>) {
        let manager = self.manager(lease);
        let identity = manager.identity().to_string();
        let handle = tokio::spawn(async move {
            if let Err(error) = manager.run(futures::future::pending()).await {
                tracing::error!(error = %error, "controller-manager stopped");
            }
        });
        (identity, handle)
    }

    pub async fn runtime(&self, name: &str, runs_per_worker: i32) -> Result<()> {
        let runtime = Runtime::new(
            name,
            RuntimeSpec {
                replicas: 0,
                scaling: None,
                runs: Some(runs_per_worker),
                template: Default::default(),
                port: None,
                artifact_store: None,
            },
        );
        Api::<Runtime>::namespaced(self.admin.clone(), NS)
            .create(&PostParams::default(), &runtime)
            .await
            .with_context(|| format!("create Runtime {name}"))?;
        Ok(())
    }

    /// Creates a worker Pod object of `runtime`, as a provisioner would publish it.
    pub async fn worker(&self, name: &str, runtime: &str, ready: bool) -> Result<Pod> {
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                labels: Some(BTreeMap::from([(
                    "kruntimes.io/runtime".to_string(),
                    runtime.to_string(),
                )])),
                finalizers: Some(vec!["kruntimes.io/test-hold".to_string()]),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "runtimed".to_string(),
                    image: Some("kruntimes/runtimed".to_string()),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            status: None,
        };
        let pods = Api::<Pod>::namespaced(self.admin.clone(), NS);
        pods.create(&PostParams::default(), &pod)
            .await
            .with_context(|| format!("create Pod {name}"))?;
        self.set_ready(name, ready).await
    }

    /// Writes the Pod's status: an IP and `Ready=<ready>`.
    pub async fn set_ready(&self, name: &str, ready: bool) -> Result<Pod> {
        let status = json!({"status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
        }});
        Api::<Pod>::namespaced(self.admin.clone(), NS)
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .with_context(|| format!("write the status of Pod {name}"))
    }

    /// Deletes a Pod that holds a finalizer: it stays, with a deletionTimestamp.
    pub async fn delete_pod(&self, name: &str) -> Result<()> {
        Api::<Pod>::namespaced(self.admin.clone(), NS)
            .delete(name, &DeleteParams::default())
            .await
            .with_context(|| format!("delete Pod {name}"))?;
        Ok(())
    }

    pub async fn run(
        &self,
        name: &str,
        runtime: &str,
        edit: impl FnOnce(&mut RunSpec),
    ) -> Result<Run> {
        let mut spec = RunSpec::task(runtime, "main.sh");
        edit(&mut spec);
        self.runs()
            .create(&PostParams::default(), &Run::new(name, spec))
            .await
            .with_context(|| format!("create Run {name}"))
    }

    /// Ends a Run as its runtimed would: a terminal phase and a completion time.
    pub async fn finish(&self, name: &str, phase: Phase) -> Result<()> {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let status = json!({"status": {"phase": phase.as_str(), "completionTime": now}});
        self.runs()
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .with_context(|| format!("finish Run {name}"))?;
        Ok(())
    }

    pub async fn terminate(&self, name: &str) -> Result<()> {
        let patch =
            json!({"spec": {"termination": Termination { mode: TerminationMode::Immediate }}});
        self.runs()
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .with_context(|| format!("request termination of Run {name}"))?;
        Ok(())
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<Event<Run>, watcher::Error>> + Send>>;

/// A watch over the Runs of the test namespace, with a local cache to check conditions
/// against after every event.
pub struct RunWatch {
    reader: Store<Run>,
    events: EventStream,
    synced: bool,
}

impl RunWatch {
    pub fn new(api: Api<Run>) -> RunWatch {
        let (reader, writer) = reflector::store();
        let events =
            reflector::reflector(writer, watcher::watcher(api, watcher::Config::default()))
                .default_backoff()
                .boxed();
        RunWatch {
            reader,
            events,
            synced: false,
        }
    }

    /// Waits, up to `timeout`, until `check` returns `Some` on the cached Runs. `check` runs
    /// after every event; an `Err` from it fails at once (an invariant was broken).
    pub async fn until<T>(
        &mut self,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut(&[Arc<Run>]) -> Result<Option<T>>,
    ) -> Result<T> {
        let wait = async {
            loop {
                if self.synced
                    && let Some(found) = check(&self.reader.state())?
                {
                    return Ok(found);
                }
                match self.events.next().await {
                    Some(Ok(Event::InitDone)) => self.synced = true,
                    Some(Ok(_)) => {}
                    Some(Err(error)) => tracing::warn!(error = %error, "watch error"),
                    None => bail!("the Run watch ended"),
                }
            }
        };
        match tokio::time::timeout(timeout, wait).await {
            Ok(result) => result,
            Err(_) => bail!(
                "timed out after {timeout:?} waiting for {what}; Runs: {}",
                describe(&self.reader.state())
            ),
        }
    }
}

pub fn describe(runs: &[Arc<Run>]) -> String {
    let mut lines: Vec<String> = runs
        .iter()
        .map(|r| {
            format!(
                "{}={}@{}",
                r.name_any(),
                r.phase(),
                assigned(r).unwrap_or("-")
            )
        })
        .collect();
    lines.sort();
    lines.join(" ")
}

pub fn assigned(run: &Run) -> Option<&str> {
    run.status.as_ref().and_then(|s| s.assigned_pod.as_deref())
}

/// The Runs in `phase`, by name.
pub fn in_phase(runs: &[Arc<Run>], phase: Phase) -> Vec<String> {
    let mut names: Vec<String> = runs
        .iter()
        .filter(|r| r.phase() == phase)
        .map(|r| r.name_any())
        .collect();
    names.sort();
    names
}

/// The message of a Run's Scheduled condition.
pub fn scheduled_message(run: &Run) -> Option<String> {
    run.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Scheduled")?
        .message
        .clone()
}

/// Runs a future with a deadline, failing with `what`.
pub async fn within<T>(
    what: &str,
    timeout: Duration,
    future: impl Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(timeout, future).await {
        Ok(result) => result,
        Err(_) => bail!("timed out after {timeout:?}: {what}"),
    }
}
