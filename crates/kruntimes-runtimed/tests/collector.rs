//! The garbage collector of runtimed against the reconciler, interleaved deterministically
//! (issue 14, item 1: a task Run killed that nobody cancelled).
//!
//! runtimed's reconciler runs in this process (so the test reaches the collector's seam,
//! [`reconcile::CollectPoint`]) against the real API server and a real runtime server; the
//! test plays the scheduler. Each test pauses one collection pass at a point, makes a claim
//! land there, lets the pass finish, and checks that nothing of the claimed Run was touched.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use futures::StreamExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Pod;
use kruntimes_api::run::{FunctionMode, RunMode, RunSource, SessionMode};
use kruntimes_api::{Phase, Run, RunSpec, RunStatus};
use kruntimes_proto::runtime::v1 as rs;
use kruntimes_runtimed::executions::Key;
use kruntimes_runtimed::reconcile::{self, CollectHook, CollectPoint, Context};
use kruntimes_runtimed::{audit, sessions};
use kruntimes_testkit::{Options, Server, within};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::sync::{Semaphore, mpsc, watch};

const DEADLINE: Duration = Duration::from_secs(60);

/// A child process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The runtime server, the in-process reconciler of one worker, and the API server.
struct Rig {
    admin: Client,
    context: Arc<Context>,
    pod: Pod,
    dir: tempfile::TempDir,
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

async fn rig(pod_name: &str) -> Result<Rig> {
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
    let channel = kruntimes_proto::unix::connect(&socket).await?;
    let capabilities = rs::runtime_info_client::RuntimeInfoClient::new(channel.clone())
        .capabilities(rs::CapabilitiesRequest {})
        .await?
        .into_inner();
    let (_, uid) = watch::channel(pod.uid());
    let context = Arc::new(Context::new(
        admin.clone(),
        "default".to_string(),
        pod_name.to_string(),
        uid,
        reconcile::RuntimeServer {
            task: rs::task_runtime_client::TaskRuntimeClient::new(channel.clone()),
            functions: rs::function_runtime_client::FunctionRuntimeClient::new(channel.clone()),
            sessions: rs::session_runtime_client::SessionRuntimeClient::new(channel.clone()),
            sessions_supported: capabilities
                .services
                .iter()
                .any(|s| s == rs::SESSION_RUNTIME_SERVICE),
            adapter: capabilities.adapter,
        },
        None,
        reconcile::SessionSetup {
            runtime: "bash".to_string(),
            limits: sessions::SessionLimits::default(),
            audit: Arc::new(audit::Audit::open(Some(&dir.path().join("audit.log")))?),
        },
    ));
    let (stop, stopped) = watch::channel(false);
    let controller = tokio::spawn(reconcile::run(context.clone(), async move {
        let mut stopped = stopped;
        let _ = stopped.wait_for(|s| *s).await;
    }));
    Ok(Rig {
        admin,
        context,
        pod,
        dir,
        stop,
        controller: Some(controller),
        _runtime_server: runtime_server,
        _server: server,
    })
}

impl Rig {
    fn runs(&self) -> Api<Run> {
        Api::namespaced(self.admin.clone(), "default")
    }

    /// Creates a Run and assigns it to this worker as the scheduler would.
    async fn assign(&self, spec: RunSpec) -> Result<Run> {
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

    /// Watches the Run until `done` holds.
    async fn until(&self, name: &str, what: &str, done: impl Fn(&Run) -> bool) -> Result<Run> {
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
    fn in_workspace(&self, uid: &str, name: &str) -> PathBuf {
        self.dir
            .path()
            .join("root")
            .join(uid)
            .join("1/work")
            .join(name)
    }

    async fn executions(&self) -> Result<Vec<rs::ExecutionStatus>> {
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

/// A collection pass paused at `point`: the pass runs in the background, `reached` reports
/// that it got there, and `release` lets it go on.
struct Paused {
    reached: mpsc::Receiver<CollectPoint>,
    release: Arc<Semaphore>,
    pass: tokio::task::JoinHandle<()>,
}

fn pause_pass_at(context: &Arc<Context>, point: CollectPoint) -> Paused {
    let (tx, reached) = mpsc::channel(8);
    let release = Arc::new(Semaphore::new(0));
    let gate = release.clone();
    let hook: CollectHook = Arc::new(move |at: CollectPoint| -> BoxFuture<'static, ()> {
        let tx = tx.clone();
        let gate = gate.clone();
        Box::pin(async move {
            if at == point {
                let _ = tx.send(at).await;
                if let Ok(permit) = gate.acquire().await {
                    permit.forget();
                }
            }
        })
    });
    let context = context.clone();
    let pass = tokio::spawn(async move { reconcile::collect_once(&context, Some(&hook)).await });
    Paused {
        reached,
        release,
        pass,
    }
}

impl Paused {
    async fn reached(&mut self) -> Result<()> {
        within(DEADLINE, "the pass reaches its pause", async {
            self.reached.recv().await.context("the pass ended")?;
            Ok(())
        })
        .await
    }

    async fn finish(self) -> Result<()> {
        self.release.add_permits(1);
        within(DEADLINE, "the pass ends", async { Ok(self.pass.await?) }).await
    }
}

fn task(script: &str) -> RunSpec {
    let mut spec = RunSpec::task("bash", "main.sh");
    spec.source = Some(RunSource {
        inline: Some(script.to_string()),
    });
    spec
}

fn key_of(run: &Run) -> Result<Key> {
    Ok(Key {
        uid: run.uid().context("uid")?,
        attempt: 1,
    })
}

/// A task Run claimed while the pass is paused at `point`: its program keeps running, its
/// local entry stays, and it ends Succeeded (not Cancelled) once its gate opens.
async fn claim_during_a_pass_at(point: CollectPoint, pod: &str) -> Result<()> {
    let rig = rig(pod).await?;
    let script = "while [ ! -e \"$KRUNTIME_WORKSPACE/go\" ]; do sleep 0.02; done\necho done\n";
    let mut paused = pause_pass_at(&rig.context, point);
    paused.reached().await?;
    let run = rig.assign(task(script)).await?;
    let key = key_of(&run)?;
    let gate = rig.in_workspace(&key.uid, "go");
    rig.until(&run.name_any(), "runs", |r| r.phase() == Phase::Running)
        .await?;
    assert!(
        rig.context.executions.wait_started(&key, DEADLINE).await,
        "the claim started the execution"
    );
    paused.finish().await?;

    assert!(
        rig.context.executions.started(&key),
        "the pass dropped the local entry of a Run claimed during it"
    );
    let held = rig.executions().await?;
    let found = held
        .iter()
        .find(|e| e.id.as_ref().is_some_and(|id| id.run_uid == key.uid))
        .context("the pass forgot the execution of a Run claimed during it")?;
    assert_eq!(found.state(), rs::ExecutionState::Running, "{found:?}");

    std::fs::write(&gate, b"")?;
    let done = rig
        .until(&run.name_any(), "ends", |r| r.phase().is_terminal())
        .await?;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), Phase::Succeeded, "{status:?}");
    assert_eq!(status.exit_code, Some(0));

    // The collector still collects: once the Run is deleted, its execution goes.
    rig.runs()
        .delete(&run.name_any(), &DeleteParams::default())
        .await?;
    // The reflector's store offers no change notification: its condition is polled, with
    // a deadline.
    within(DEADLINE, "the deleted Run leaves the store", async {
        while rig.context.run_named(&run.name_any()).is_some() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    })
    .await?;
    reconcile::collect_once(&rig.context, None).await;
    let held = rig.executions().await?;
    assert!(
        !held
            .iter()
            .any(|e| e.id.as_ref().is_some_and(|id| id.run_uid == key.uid)),
        "the execution of a deleted Run was not forgotten: {held:?}"
    );
    assert!(!rig.context.executions.started(&key));
    Ok(())
}

/// Regression (issue 14.1): the collector read the store's view, then listed the runtime
/// server; a Run claimed in between was unknown to the view and its program was killed
/// through Forget (the Run ended Cancelled).
#[tokio::test]
async fn a_task_claimed_between_the_collectors_reads_is_not_cancelled() -> Result<()> {
    claim_during_a_pass_at(CollectPoint::Listed, "coll-w1").await
}

/// Regression (issue 14.1): the collector swept local entries against the view it read
/// before its awaits; a Run claimed after that view lost its entry (a second waiter, a
/// "recovered" execution, by the code even a second run of the program).
#[tokio::test]
async fn a_task_claimed_after_the_collectors_view_keeps_its_local_entry() -> Result<()> {
    claim_during_a_pass_at(CollectPoint::Viewed, "coll-w2").await
}

fn function() -> RunSpec {
    let mut spec = RunSpec::task("bash", "unused");
    spec.mode = RunMode {
        function: Some(FunctionMode {
            handler: "handler.sh".to_string(),
            idle_timeout_seconds: None,
        }),
        ..RunMode::default()
    };
    spec.source = Some(RunSource {
        inline: Some("cat\n".to_string()),
    });
    spec
}

/// A function Run registered while the pass is paused at `point` stays registered.
async fn register_during_a_pass_at(point: CollectPoint, pod: &str) -> Result<()> {
    let rig = rig(pod).await?;
    let mut paused = pause_pass_at(&rig.context, point);
    paused.reached().await?;
    let run = rig.assign(function()).await?;
    let uid = run.uid().context("uid")?;
    rig.until(&run.name_any(), "is Ready", |r| r.phase() == Phase::Ready)
        .await?;
    paused.finish().await?;

    let registration =
        rig.context.registrations.get(&uid).context(
            "the pass dropped the local registration of a function registered during it",
        )?;
    let status = rig
        .context
        .functions
        .clone()
        .function_status(rs::FunctionStatusRequest {
            registration_id: registration.id.clone(),
        })
        .await;
    let status = status
        .context("the pass unregistered a function registered during it")?
        .into_inner();
    assert_eq!(status.state(), rs::FunctionState::Ready, "{status:?}");
    Ok(())
}

/// Regression (issue 14.1): a function registered between the collector's view and its
/// ListFunctions was unregistered.
#[tokio::test]
async fn a_function_registered_between_the_collectors_reads_stays_registered() -> Result<()> {
    register_during_a_pass_at(CollectPoint::Listed, "coll-w3").await
}

/// Regression (issue 14.1): the local registrations were swept against a view older than
/// the pass's awaits.
#[tokio::test]
async fn a_function_registered_after_the_collectors_view_keeps_its_registration() -> Result<()> {
    register_during_a_pass_at(CollectPoint::Viewed, "coll-w4").await
}

/// Regression (issue 14.1): a session that became Ready after the session collector's view
/// was read lost its local state in the same pass (the sweep used that older view).
#[tokio::test]
async fn a_session_registered_after_the_collectors_view_keeps_its_state() -> Result<()> {
    let rig = rig("coll-w5").await?;
    if !rig.context.sessions_supported {
        bail!("the runtime server does not implement SessionRuntime");
    }
    let mut spec = RunSpec::task("bash", "unused");
    spec.mode = RunMode {
        session: Some(SessionMode::default()),
        ..RunMode::default()
    };
    let mut paused = pause_pass_at(&rig.context, CollectPoint::Viewed);
    paused.reached().await?;
    let run = rig.assign(spec).await?;
    let key = key_of(&run)?;
    rig.until(&run.name_any(), "is Ready", |r| r.phase() == Phase::Ready)
        .await?;
    paused.finish().await?;

    assert!(
        rig.context.sessions.get(&key.uid).is_some(),
        "the pass dropped the local state of a session registered during it"
    );
    let status = rig
        .context
        .session_client
        .clone()
        .get_session_status(rs::GetSessionStatusRequest { id: Some(key.id()) })
        .await?
        .into_inner();
    assert_eq!(status.state(), rs::SessionState::Ready, "{status:?}");
    Ok(())
}
