//! What the in-process tests of runtimed share: a worker's reconciler running in the test's
//! process (so a test reaches its seams and its local state) against the real API server
//! and a real runtime server; the test plays the scheduler.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kruntimes_api::run::{FunctionMode, RunMode, RunSource, SessionMode};
use kruntimes_api::{Phase, Run, RunSpec, RunStatus};
use kruntimes_proto::runtime::v1 as rs;
use kruntimes_runtimed::reconcile::{self, Context};
use kruntimes_runtimed::sessions::{self, audit};
use kruntimes_runtimed::tasks::executions::Key;
use kruntimes_testkit::{Options, Server, within};
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::sync::watch;

pub const DEADLINE: Duration = Duration::from_secs(60);

/// A child process killed when dropped.
pub struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The runtime server, the in-process reconciler of one worker, and the API server.
pub struct Rig {
    pub admin: Client,
    pub context: Arc<Context>,
    pub pod: Pod,
    pub dir: tempfile::TempDir,
    socket: PathBuf,
    snapshots: bool,
    stop: watch::Sender<bool>,
    controller: Option<tokio::task::JoinHandle<()>>,
    _runtime_server: Proc,
    _server: Server,
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(controller) = self.controller.take() {
            controller.abort();
        }
    }
}

/// The worker's context on the runtime server at `socket`, with nothing in memory, as
/// runtimed builds it when it starts.
async fn new_context(
    admin: &Client,
    pod: &Pod,
    socket: &Path,
    dir: &Path,
    snapshots: bool,
) -> Result<Arc<Context>> {
    let limits = sessions::SessionLimits {
        snapshot_dir: snapshots.then(|| dir.join("snapshots")),
        ..sessions::SessionLimits::default()
    };
    let channel = kruntimes_proto::unix::connect(socket).await?;
    let capabilities = rs::runtime_info_client::RuntimeInfoClient::new(channel.clone())
        .capabilities(rs::CapabilitiesRequest {})
        .await?
        .into_inner();
    let (_, uid) = watch::channel(pod.uid());
    Ok(Arc::new(Context::new(
        admin.clone(),
        "default".to_string(),
        pod.name_any(),
        uid,
        reconcile::RuntimeServer::new(&channel, &capabilities),
        None,
        reconcile::SessionSetup {
            runtime: "bash".to_string(),
            limits,
            audit: Arc::new(audit::Audit::open(Some(&dir.join("audit.log")))?),
        },
    )))
}

/// Runs `context`'s reconciler until the returned sender says stop.
fn start_reconciler(context: Arc<Context>) -> (watch::Sender<bool>, tokio::task::JoinHandle<()>) {
    let (stop, stopped) = watch::channel(false);
    let controller = tokio::spawn(reconcile::run(context, async move {
        let mut stopped = stopped;
        let _ = stopped.wait_for(|s| *s).await;
    }));
    (stop, controller)
}

fn sibling_bin(name: &str) -> Result<PathBuf> {
    let kruntimes = kruntimes_testkit::kruntimes_bin()?;
    let path = kruntimes.parent().context("binary directory")?.join(name);
    if !path.is_file() {
        bail!(
            "{} not found; run `cargo build --workspace --bins`",
            path.display()
        );
    }
    Ok(path)
}

/// Starts the runtime server and waits until it says it listens.
fn start_runtime_server(dir: &Path) -> Result<(Proc, PathBuf)> {
    let socket = dir.join("rs.sock");
    let mut cmd = Command::new(sibling_bin("kruntimes-runtime-server")?);
    cmd.arg("--socket")
        .arg(&socket)
        .arg("--root")
        .arg(dir.join("root"))
        .args(["--adapter", "bash"])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = cmd.spawn().context("spawn the runtime server")?;
    let stdout = child.stdout.take().context("stdout")?;
    let proc = Proc(child);
    let mut lines = BufReader::new(stdout).lines();
    for line in lines.by_ref() {
        if line?.starts_with("listening on ") {
            std::thread::spawn(move || for _ in lines {});
            return Ok((proc, socket));
        }
    }
    bail!("the runtime server ended before it listened")
}

pub async fn rig(pod_name: &str) -> Result<Rig> {
    rig_with(pod_name, false).await
}

/// [`rig`] whose worker keeps snapshots under its temporary directory's `snapshots/` (the
/// filesystem store `--snapshot-dir` gives), so its sessions can be suspended.
pub async fn rig_with_snapshots(pod_name: &str) -> Result<Rig> {
    rig_with(pod_name, true).await
}

async fn rig_with(pod_name: &str, snapshots: bool) -> Result<Rig> {
    let (server, admin) = Server::start_async(Options::default()).await?;
    let dir = tempfile::Builder::new().prefix("collector").tempdir()?;
    let (runtime_server, socket) = start_runtime_server(dir.path())?;
    let pods = Api::<Pod>::namespaced(admin.clone(), "default");
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod_name, "labels": {"kruntimes.io/runtime": "bash"}},
        "spec": {"containers": [{"name": "runtimed", "image": "local"}]},
    }))?;
    let pod = pods.create(&PostParams::default(), &pod).await?;
    let context = new_context(&admin, &pod, &socket, dir.path(), snapshots).await?;
    let (stop, controller) = start_reconciler(context.clone());
    Ok(Rig {
        admin,
        context,
        pod,
        dir,
        socket,
        snapshots,
        stop,
        controller: Some(controller),
        _runtime_server: runtime_server,
        _server: server,
    })
}

impl Rig {
    /// runtimed dies (its reconciler stops at once, as on SIGKILL); the runtime server,
    /// which outlives it, keeps what it holds.
    pub async fn stop_runtimed(&mut self) {
        let _ = self.stop.send(true);
        if let Some(controller) = self.controller.take() {
            controller.abort();
            let _ = controller.await;
        }
    }

    /// runtimed starts again on the same runtime server, with nothing in memory.
    pub async fn start_runtimed(&mut self) -> Result<()> {
        self.context = new_context(
            &self.admin,
            &self.pod,
            &self.socket,
            self.dir.path(),
            self.snapshots,
        )
        .await?;
        let (stop, controller) = start_reconciler(self.context.clone());
        self.stop = stop;
        self.controller = Some(controller);
        Ok(())
    }

    /// The sessions the runtime server holds now.
    pub async fn held_sessions(&self) -> Result<Vec<rs::SessionStatus>> {
        let channel = kruntimes_proto::unix::connect(&self.socket).await?;
        Ok(
            rs::session_runtime_client::SessionRuntimeClient::new(channel)
                .list_sessions(rs::ListSessionsRequest {})
                .await?
                .into_inner()
                .sessions,
        )
    }

    pub fn runs(&self) -> Api<Run> {
        Api::namespaced(self.admin.clone(), "default")
    }

    /// Creates the Runtime `bash` the worker belongs to (no artifactStore), which a suspend
    /// reads to find its snapshot store.
    pub async fn create_runtime(&self) -> Result<()> {
        let runtime: kruntimes_api::Runtime = serde_json::from_value(json!({
            "apiVersion": "kruntimes.io/v1alpha1", "kind": "Runtime",
            "metadata": {"name": "bash"},
            "spec": {"replicas": 0, "template": {}},
        }))?;
        Api::<kruntimes_api::Runtime>::namespaced(self.admin.clone(), "default")
            .create(&PostParams::default(), &runtime)
            .await?;
        Ok(())
    }

    /// Creates a Run and assigns it to this worker as the scheduler would.
    pub async fn assign(&self, spec: RunSpec) -> Result<Run> {
        let mut run = Run::new("", spec);
        run.metadata.generate_name = Some("c-".into());
        let mut run = self.runs().create(&PostParams::default(), &run).await?;
        run.status = Some(RunStatus {
            phase: Some(Phase::Scheduled),
            assigned_pod: Some(self.pod.name_any()),
            assigned_pod_uid: self.pod.uid(),
            ..RunStatus::default()
        });
        Ok(self
            .runs()
            .replace_status(&run.name_any(), &PostParams::default(), &run)
            .await?)
    }

    /// Creates the Run `name` and assigns it to this worker as the scheduler would.
    pub async fn assign_named(&self, name: &str, spec: RunSpec) -> Result<Run> {
        let run = Run::new(name, spec);
        let mut run = self.runs().create(&PostParams::default(), &run).await?;
        run.status = Some(RunStatus {
            phase: Some(Phase::Scheduled),
            assigned_pod: Some(self.pod.name_any()),
            assigned_pod_uid: self.pod.uid(),
            ..RunStatus::default()
        });
        Ok(self
            .runs()
            .replace_status(name, &PostParams::default(), &run)
            .await?)
    }

    /// Creates the function or session Run `name` as an earlier runtimed of this worker
    /// left it: claimed (Running, attempt 1, the registration-cleanup finalizer), nothing
    /// registered on the runtime server yet.
    pub async fn place_running(&self, name: &str, spec: RunSpec) -> Result<Run> {
        let mut run = Run::new(name, spec);
        run.metadata.finalizers = Some(vec![
            kruntimes_api::lifecycle::REGISTRATION_FINALIZER.to_string(),
        ]);
        let mut run = self.runs().create(&PostParams::default(), &run).await?;
        run.status = Some(RunStatus {
            phase: Some(Phase::Running),
            assigned_pod: Some(self.pod.name_any()),
            assigned_pod_uid: self.pod.uid(),
            attempt: Some(1),
            start_time: Some(kruntimes_api::lifecycle::now_rfc3339()),
            ..RunStatus::default()
        });
        Ok(self
            .runs()
            .replace_status(name, &PostParams::default(), &run)
            .await?)
    }

    /// Watches the Run until `done` holds.
    pub async fn until(&self, name: &str, what: &str, done: impl Fn(&Run) -> bool) -> Result<Run> {
        let what = format!("{name} {what}");
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut stream = watcher(self.runs(), config).applied_objects().boxed();
        within(DEADLINE, &what, async {
            while let Some(run) = stream.next().await {
                let run = run?;
                if done(&run) {
                    return Ok(run);
                }
            }
            bail!("watch ended")
        })
        .await
    }

    /// The file `name` in the workspace of the first attempt of task Run `uid`: the one
    /// host directory a sandboxed program sees (`<root>/<run uid>/<attempt>/work`).
    pub fn in_workspace(&self, uid: &str, name: &str) -> PathBuf {
        self.dir
            .path()
            .join("root")
            .join(uid)
            .join("1/work")
            .join(name)
    }

    pub async fn executions(&self) -> Result<Vec<rs::ExecutionStatus>> {
        Ok(self
            .context
            .task
            .clone()
            .list(rs::ListRequest {})
            .await?
            .into_inner()
            .executions)
    }
}

pub fn task(script: &str) -> RunSpec {
    let mut spec = RunSpec::task("bash", "main.sh");
    spec.source = Some(RunSource {
        inline: Some(script.to_string()),
        snapshot: None,
    });
    spec
}

pub fn key_of(run: &Run) -> Result<Key> {
    Ok(Key {
        uid: run.uid().context("uid")?,
        attempt: 1,
    })
}

pub fn function() -> RunSpec {
    let mut spec = RunSpec::task("bash", "unused");
    spec.mode = RunMode {
        function: Some(FunctionMode {
            handler: "handler.sh".to_string(),
            idle_timeout_seconds: None,
            concurrency: None,
        }),
        ..RunMode::default()
    };
    spec.source = Some(RunSource {
        inline: Some("cat\n".to_string()),
        snapshot: None,
    });
    spec
}

pub fn session() -> RunSpec {
    let mut spec = RunSpec::task("bash", "unused");
    spec.mode = RunMode {
        session: Some(SessionMode::default()),
        ..RunMode::default()
    };
    spec
}
