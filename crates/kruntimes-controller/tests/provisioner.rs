//! The local provisioner and the Runtime controller against the real embedded API server,
//! with real worker processes: `kruntimes-runtime-server` and `kruntimes runtimed`, found
//! next to the test executable (`cargo build --workspace --bins` first, as
//! scripts/test.sh does).
//!
//! The controller-manager runs with its own least-privilege identity. Every wait polls the
//! API (or the process table) under a deadline; nothing sleeps to synchronise. Every test
//! that starts workers ends by checking that no process whose command line names its
//! workers directory is left.

use std::collections::BTreeSet;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Container, EnvVar, Pod};
use kruntimes_api::{Runtime, RuntimeSpec};
use kruntimes_controller::local::{LOCAL_PROVISIONER, PROVISIONER_LABEL, WorkerInfo};
use kruntimes_controller::placement::is_ready_worker;
use kruntimes_controller::runtimes::WORKERS_FINALIZER;
use kruntimes_controller::{
    Config, ControllerManager, LeaseConfig, LocalConfig, LocalProvisioner, WorkerProvisioner,
};
use kruntimes_testkit::{Options, Server, within};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use tokio::io::AsyncBufReadExt;
use tokio::sync::oneshot;

const NS: &str = "default";
/// Generous: two cores shared with other builds, and every incarnation starts two
/// processes.
const WAIT: Duration = Duration::from_secs(60);
const POLL: Duration = Duration::from_millis(100);

/// A binary next to the test executable (`target/<profile>/`).
fn sibling_bin(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("current_exe")?;
    let mut dir = exe.parent().map(Path::to_path_buf);
    while let Some(d) = dir {
        let candidate = d.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
        if d.file_name().is_some_and(|n| n == "target") {
            break;
        }
        dir = d.parent().map(Path::to_path_buf);
    }
    bail!(
        "{name} not found next to {}; run `cargo build --workspace --bins`",
        exe.display()
    )
}

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// A server, a provisioner and a controller-manager using it.
struct Env {
    _server: Server,
    admin: Client,
    provisioner: LocalProvisioner,
    /// Short, so that socket paths stay far below the Unix limit.
    workers: tempfile::TempDir,
    stop: Option<oneshot::Sender<()>>,
    manager: Option<tokio::task::JoinHandle<Result<(), kruntimes_controller::Error>>>,
}

impl Env {
    /// Starts everything; the provisioner writes with `identity`'s client (the
    /// controller-manager's unless a test wants the admin's).
    async fn start(admin_provisions: bool) -> Result<Env> {
        Env::start_with(admin_provisions, None).await
    }

    /// [`Env::start`] with the manager's claim bound set.
    async fn start_with(admin_provisions: bool, claim_timeout: Option<Duration>) -> Result<Env> {
        init_tracing();
        let (server, admin) = Server::start_async(Options::default()).await?;
        let controller = if admin_provisions {
            admin.clone()
        } else {
            let kubeconfig = kube::config::Kubeconfig::read_from(
                server.component_kubeconfig("controller-manager"),
            )
            .context("read the controller-manager kubeconfig")?;
            let config =
                kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
            Client::try_from(config)?
        };
        let workers = tempfile::Builder::new().prefix("krtw").tempdir_in("/tmp")?;
        let mut config = LocalConfig::new(
            workers.path(),
            kruntimes_testkit::kruntimes_bin()?,
            sibling_bin("kruntimes-runtime-server")?,
            server.component_kubeconfig("runtimed"),
        );
        config.grace = Duration::from_secs(5);
        config.min_backoff = Duration::from_millis(100);
        config.max_backoff = Duration::from_secs(1);
        let provisioner = LocalProvisioner::new(controller.clone(), config)?;
        let mut env = Env {
            _server: server,
            admin,
            provisioner,
            workers,
            stop: None,
            manager: None,
        };
        env.start_manager(controller, claim_timeout);
        Ok(env)
    }

    fn start_manager(&mut self, client: Client, claim_timeout: Option<Duration>) {
        let mut config = Config::new(NS);
        if let Some(bound) = claim_timeout {
            config.claim_timeout = bound;
        }
        config.lease = LeaseConfig {
            lease_duration: Duration::from_secs(2),
            renew_deadline: Duration::from_millis(1500),
            retry_period: Duration::from_millis(200),
            ..LeaseConfig::new(NS, "provisioner-test")
        };
        let manager = ControllerManager::with_provisioner(client, config, self.provisioner.clone());
        let (stop, stopped) = oneshot::channel::<()>();
        self.stop = Some(stop);
        self.manager = Some(tokio::spawn(manager.run(async {
            let _ = stopped.await;
        })));
    }

    /// Stops the manager and every worker; then no worker process may be left.
    async fn finish(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(manager) = self.manager.take() {
            manager.await.context("join the manager")??;
        }
        self.provisioner.shutdown().await;
        ensure!(
            self.provisioner.workers().is_empty(),
            "workers after shutdown"
        );
        ensure_no_worker_processes(self.workers.path())?;
        Ok(())
    }

    fn runtimes(&self) -> Api<Runtime> {
        Api::namespaced(self.admin.clone(), NS)
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.admin.clone(), NS)
    }

    async fn create_runtime(&self, name: &str, replicas: i32) -> Result<Runtime> {
        let runtime = Runtime::new(
            name,
            RuntimeSpec {
                replicas,
                scaling: None,
                runs: Some(3),
                template: kruntimes_api::runtime::template(Container {
                    args: Some(vec!["--cgroups".into(), "off".into()]),
                    env: Some(vec![EnvVar {
                        name: "KRUNTIMES_TEST_MARK".into(),
                        value: Some(name.into()),
                        ..EnvVar::default()
                    }]),
                    ..Container::default()
                }),
                port: None,
                artifact_store: None,
            },
        );
        self.runtimes()
            .create(&PostParams::default(), &runtime)
            .await
            .with_context(|| format!("create Runtime {name}"))
    }

    async fn scale(&self, name: &str, replicas: i32) -> Result<()> {
        let patch = json!({"spec": {"replicas": replicas}});
        self.runtimes()
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .with_context(|| format!("scale Runtime {name}"))?;
        Ok(())
    }

    async fn runtime_pods(&self, runtime: &str) -> Result<Vec<Pod>> {
        let params = ListParams::default().labels(&format!("kruntimes.io/runtime={runtime}"));
        Ok(self.pods().list(&params).await?.items)
    }

    /// Polls until exactly `count` Pods of `runtime` exist, all ready, and the Runtime's
    /// status says so; returns the Pods.
    async fn until_ready(&self, runtime: &str, count: usize) -> Result<Vec<Pod>> {
        let what = format!("{count} ready Pods of Runtime {runtime} and readyReplicas {count}");
        poll(&what, || async {
            let pods = self.runtime_pods(runtime).await?;
            let ready = pods.iter().filter(|p| is_ready_worker(p)).count();
            let status = self.runtimes().get_status(runtime).await?.status;
            let reported = status.as_ref().and_then(|s| s.ready_replicas);
            let workers = self.provisioner.workers().len();
            Ok((pods.len() == count
                && ready == count
                && reported == Some(count as i32)
                && workers == count)
                .then_some(pods))
        })
        .await
    }

    fn workers_of(&self, runtime: &str) -> Vec<WorkerInfo> {
        self.provisioner
            .workers()
            .into_iter()
            .filter(|w| w.runtime == runtime)
            .collect()
    }
}

/// Calls `check` every [`POLL`] until it returns `Some`, for at most [`WAIT`].
async fn poll<T, F, Fut>(what: &str, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    within(WAIT, what, async {
        let mut interval = tokio::time::interval(POLL);
        loop {
            interval.tick().await;
            if let Some(found) = check().await? {
                return Ok(found);
            }
        }
    })
    .await
}

/// The PIDs of live processes whose command line mentions `dir`.
fn processes_naming(dir: &Path) -> Result<Vec<(i32, String)>> {
    let needle = dir.to_string_lossy().into_owned();
    Ok(
        kruntimes_testkit::procs::matching(|p| p.cmdline.contains(&needle))
            .into_iter()
            .map(|p| (p.pid, p.cmdline))
            .collect(),
    )
}

fn ensure_no_worker_processes(dir: &Path) -> Result<()> {
    let left = processes_naming(dir)?;
    ensure!(left.is_empty(), "worker processes left behind: {left:?}");
    Ok(())
}

fn environ_of(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/environ"))
        .map(|bytes| String::from_utf8_lossy(&bytes).replace('\0', "\n"))
        .unwrap_or_default()
}

fn uids(pods: &[Pod]) -> BTreeSet<String> {
    pods.iter().filter_map(|p| p.metadata.uid.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_are_provisioned_replaced_scaled_and_removed() -> Result<()> {
    let env = Env::start(false).await?;
    env.create_runtime("py", 2).await?;
    let pods = env.until_ready("py", 2).await?;
    let first = uids(&pods);
    ensure!(first.len() == 2, "two distinct Pod UIDs: {first:?}");

    // The Pods follow the contract: labels, owner, the runtimed port, a worker directory
    // named after the Pod; the processes carry the template's environment.
    let runtime = env.runtimes().get("py").await?;
    for pod in &pods {
        let name = pod.name_any();
        ensure!(
            name.starts_with("py-") && name.len() == "py-".len() + 5,
            "name {name}"
        );
        let labels = pod.labels();
        ensure!(
            labels.get(PROVISIONER_LABEL).map(String::as_str) == Some(LOCAL_PROVISIONER),
            "provisioner label on {name}: {labels:?}"
        );
        let owners = pod.owner_references();
        ensure!(
            owners.len() == 1
                && owners[0].kind == "Runtime"
                && owners[0].uid == runtime.uid().unwrap_or_default(),
            "owner of {name}: {owners:?}"
        );
        let container = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .context("a container")?;
        let port = container
            .ports
            .as_ref()
            .and_then(|p| p.first())
            .context("a port")?;
        ensure!(
            container.name == "runtimed"
                && port.name.as_deref() == Some("runtimed")
                && port.container_port > 0,
            "container of {name}: {container:?}"
        );
        let status = pod.status.as_ref().context("a status")?;
        ensure!(
            status.phase.as_deref() == Some("Running")
                && status.pod_ip.as_deref() == Some("127.0.0.1"),
            "status of {name}: {status:?}"
        );
    }
    let workers = env.workers_of("py");
    ensure!(workers.len() == 2, "two workers: {workers:?}");
    for worker in &workers {
        ensure!(worker.dir == env.workers.path().join("workers").join(&worker.pod));
        ensure!(
            worker.dir.join("runtime.sock").exists(),
            "socket of {worker:?}"
        );
        let pid = worker.runtime_server_pid.context("runtime server pid")?;
        ensure!(
            environ_of(pid).contains("KRUNTIMES_TEST_MARK=py"),
            "the template's env reaches the runtime server"
        );
    }
    let status = env
        .runtimes()
        .get_status("py")
        .await?
        .status
        .unwrap_or_default();
    ensure!(
        status.total_runs == Some(6) && status.used_runs == Some(0),
        "slots in status: {status:?}"
    );

    // A worker process dies: its Pod goes, a fresh incarnation takes its place.
    let victim = workers[0].clone();
    let pid = victim.runtime_server_pid.context("victim pid")?;
    kill(Pid::from_raw(i32::try_from(pid)?), Signal::SIGKILL)?;
    let old_uid = pods
        .iter()
        .find(|p| p.name_any() == victim.pod)
        .and_then(|p| p.metadata.uid.clone())
        .context("victim uid")?;
    let replaced = poll("the dead worker's Pod to be replaced", || async {
        let pods = env.runtime_pods("py").await?;
        let ready: Vec<Pod> = pods
            .iter()
            .filter(|p| is_ready_worker(p))
            .cloned()
            .collect();
        let gone = !pods
            .iter()
            .any(|p| p.metadata.uid.as_deref() == Some(&old_uid));
        Ok((gone && pods.len() == 2 && ready.len() == 2).then_some(ready))
    })
    .await?;
    let now = uids(&replaced);
    ensure!(!now.contains(&old_uid), "the replacement has a new UID");
    ensure!(
        now.intersection(&first).count() == 1,
        "the other worker lives on: {first:?} -> {now:?}"
    );
    // Both processes of the dead worker are gone (runtimed was stopped with it).
    poll("the dead worker's processes to end", || async {
        Ok(processes_naming(&victim.dir)?.is_empty().then_some(()))
    })
    .await?;

    // Scale down to one.
    env.scale("py", 1).await?;
    let remaining = env.until_ready("py", 1).await?;
    let kept = env.workers_of("py");
    ensure!(kept.len() == 1 && kept[0].pod == remaining[0].name_any());
    for worker in workers.iter().chain(std::iter::once(&victim)) {
        if worker.pod != kept[0].pod {
            ensure_no_worker_processes(&worker.dir)?;
        }
    }

    // Delete the Runtime: no Pods, no workers, no processes.
    env.runtimes()
        .delete("py", &DeleteParams::default())
        .await?;
    poll(
        "the Runtime, its Pods and its workers to be gone",
        || async {
            let pods = env.runtime_pods("py").await?;
            let runtime = env.runtimes().get_opt("py").await?;
            Ok(
                (pods.is_empty() && runtime.is_none() && env.workers_of("py").is_empty())
                    .then_some(()),
            )
        },
    )
    .await?;
    ensure_no_worker_processes(env.workers.path())?;
    env.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_pods_are_swept_and_shutdown_stops_every_worker() -> Result<()> {
    let env = Env::start(false).await?;
    // A Pod left by an earlier `kruntimes up` for a Runtime that still exists, and one for
    // a Runtime that is gone.
    env.create_runtime("keep", 1).await?;
    for (name, runtime) in [("keep-old00", "keep"), ("gone-old00", "gone")] {
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(
                    [
                        ("kruntimes.io/runtime".to_string(), runtime.to_string()),
                        (PROVISIONER_LABEL.to_string(), LOCAL_PROVISIONER.to_string()),
                    ]
                    .into(),
                ),
                ..ObjectMeta::default()
            },
            spec: Some(Default::default()),
            status: None,
        };
        env.pods().create(&PostParams::default(), &pod).await?;
    }
    let pods = env.until_ready("keep", 1).await?;
    ensure!(pods[0].name_any() != "keep-old00");
    poll("the Pod of the deleted Runtime to be swept", || async {
        Ok(env.runtime_pods("gone").await?.is_empty().then_some(()))
    })
    .await?;

    env.scale("keep", 2).await?;
    env.until_ready("keep", 2).await?;
    let workers = env.provisioner.workers();
    ensure!(workers.len() == 2);

    // Shutdown (as `kruntimes up` does on exit) stops both workers and deletes their Pods.
    env.provisioner.shutdown().await;
    ensure!(env.provisioner.workers().is_empty());
    ensure!(
        env.runtime_pods("keep").await?.is_empty(),
        "shutdown deletes the Pods"
    );
    ensure_no_worker_processes(env.workers.path())?;
    // A shut-down provisioner starts nothing more.
    let runtime = env.runtimes().get("keep").await?;
    ensure!(env.provisioner.reconcile(&runtime).await.is_err());
    env.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_patch_rights_a_finalizer_holds_the_runtime_until_its_workers_stop() -> Result<()> {
    // The admin identity may patch Runtimes, so the controller holds them with its
    // finalizer.
    let env = Env::start(true).await?;
    env.create_runtime("fin", 1).await?;
    env.until_ready("fin", 1).await?;
    let runtime = env.runtimes().get("fin").await?;
    ensure!(
        runtime.finalizers().iter().any(|f| f == WORKERS_FINALIZER),
        "finalizers: {:?}",
        runtime.finalizers()
    );
    env.runtimes()
        .delete("fin", &DeleteParams::default())
        .await?;
    poll("the Runtime to be gone", || async {
        Ok(env.runtimes().get_opt("fin").await?.is_none().then_some(()))
    })
    .await?;
    // The finalizer came off only after the workers stopped and their Pods were deleted.
    ensure!(
        env.runtime_pods("fin").await?.is_empty(),
        "Pods outlived the Runtime"
    );
    ensure!(
        env.workers_of("fin").is_empty(),
        "workers outlived the Runtime"
    );
    ensure_no_worker_processes(env.workers.path())?;
    env.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_cannot_start_is_retried_and_never_published() -> Result<()> {
    let env = Env::start(false).await?;
    let runtime = Runtime::new(
        "broken",
        RuntimeSpec {
            replicas: 1,
            scaling: None,
            runs: None,
            // Exits at once, without a ready line.
            template: kruntimes_api::runtime::template(Container {
                command: Some(vec!["/bin/false".into()]),
                ..Container::default()
            }),
            port: None,
            artifact_store: None,
        },
    );
    env.runtimes()
        .create(&PostParams::default(), &runtime)
        .await?;
    // Several attempts, each logged in a fresh worker directory.
    let dirs = poll("three failed attempts", || async {
        let dirs: Vec<PathBuf> = std::fs::read_dir(env.workers.path().join("workers"))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("broken-"))
            })
            .collect();
        Ok((dirs.len() >= 3).then_some(dirs))
    })
    .await?;
    ensure!(
        dirs.iter().all(|d| d.join("runtime-server.log").exists()),
        "each attempt has its log"
    );
    ensure!(
        env.runtime_pods("broken").await?.is_empty(),
        "no Pod for a worker that never started"
    );
    poll("readyReplicas 0 in the status", || async {
        let status = env.runtimes().get_status("broken").await?.status;
        Ok((status.and_then(|s| s.ready_replicas) == Some(0)).then_some(()))
    })
    .await?;
    env.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runtime_server_exits_when_its_stdin_closes() -> Result<()> {
    let dir = tempfile::Builder::new().prefix("krts").tempdir_in("/tmp")?;
    let mut child = tokio::process::Command::new(sibling_bin("kruntimes-runtime-server")?)
        .arg("--socket")
        .arg(dir.path().join("s.sock"))
        .arg("--root")
        .arg(dir.path().join("root"))
        .args(["--cgroups", "off", "--exit-with-stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = within(WAIT, "the listening line", async {
        Ok(lines.next_line().await?)
    })
    .await?;
    ensure!(
        line.as_deref()
            .is_some_and(|l| l.starts_with("listening on ")),
        "{line:?}"
    );
    drop(child.stdin.take());
    let status = within(WAIT, "the runtime server to exit", async {
        Ok(child.wait().await?)
    })
    .await?;
    ensure!(status.success(), "a graceful exit: {status}");
    ensure!(!dir.path().join("s.sock").exists(), "the socket is removed");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_last_provisioner_handle_stops_its_workers() -> Result<()> {
    let mut env = Env::start(false).await?;
    env.create_runtime("dropped", 2).await?;
    env.until_ready("dropped", 2).await?;
    // No shutdown(): the manager is aborted and every handle dropped, as when `kruntimes up`
    // unwinds on an error.
    if let Some(manager) = env.manager.take() {
        manager.abort();
        let _ = manager.await;
    }
    let workers_dir = env.workers.path().to_path_buf();
    let Env {
        provisioner,
        admin,
        _server,
        workers,
        ..
    } = env;
    drop(provisioner);
    poll("the dropped provisioner's workers to stop", || async {
        Ok(processes_naming(&workers_dir)?.is_empty().then_some(()))
    })
    .await?;
    // They also deleted their Pods on the way out.
    let pods: Api<Pod> = Api::namespaced(admin, NS);
    poll("the dropped provisioner's Pods to be deleted", || async {
        let params = ListParams::default().labels("kruntimes.io/runtime=dropped");
        Ok(pods.list(&params).await?.items.is_empty().then_some(()))
    })
    .await?;
    drop(workers);
    Ok(())
}

/// The reasons of the Events on the object `name` (a Run or a Runtime).
async fn event_reasons(admin: &Client, name: &str) -> Result<Vec<String>> {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(admin.clone(), NS);
    let params = ListParams::default().fields(&format!("regarding.name={name}"));
    Ok(events
        .list(&params)
        .await?
        .items
        .into_iter()
        .filter_map(|e| e.reason)
        .collect())
}

/// Sends SIGCONT to a stopped process when dropped, so that a failing test still lets its
/// worker stop.
struct Resume(Pid);

impl Drop for Resume {
    fn drop(&mut self) {
        let _ = kill(self.0, Signal::SIGCONT);
    }
}

/// Issue 16.4: a Run Scheduled to a worker that stops claiming (its runtimed is stopped
/// with SIGSTOP; its Pod still says Ready) goes back to Pending after the claim bound, is
/// placed on the other worker, and succeeds there. Before 16.4 it stayed Scheduled to the
/// stopped worker for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_its_worker_does_not_claim_is_placed_elsewhere_and_succeeds() -> Result<()> {
    let bound = Duration::from_secs(3);
    let env = Env::start_with(false, Some(bound)).await?;
    env.create_runtime("rebalance", 2).await?;
    let pods = env.until_ready("rebalance", 2).await?;
    // Of two equally free workers, placement takes the first by Pod name: stop that one.
    let mut names: Vec<String> = pods.iter().map(|p| p.name_any()).collect();
    names.sort();
    let (stuck, other) = (names[0].clone(), names[1].clone());
    let worker = env
        .workers_of("rebalance")
        .into_iter()
        .find(|w| w.pod == stuck)
        .context("the stuck worker")?;
    let pid = Pid::from_raw(i32::try_from(
        worker.runtimed_pid.context("runtimed's PID")?,
    )?);
    kill(pid, Signal::SIGSTOP)?;
    let resume = Resume(pid);
    let runs: Api<kruntimes_api::Run> = Api::namespaced(env.admin.clone(), NS);
    let mut spec = kruntimes_api::RunSpec::task("rebalance", "main.sh");
    spec.source = Some(kruntimes_api::run::RunSource {
        inline: Some("echo moved\n".into()),
        snapshot: None,
    });
    runs.create(
        &PostParams::default(),
        &kruntimes_api::Run::new("moved", spec),
    )
    .await?;
    let assigned = |run: &kruntimes_api::Run| {
        run.status
            .as_ref()
            .and_then(|s| s.assigned_pod.clone())
            .unwrap_or_default()
    };
    poll("the Run Scheduled to the stopped worker", || async {
        let run = runs.get("moved").await?;
        Ok((assigned(&run) == stuck).then_some(()))
    })
    .await?;
    let run = poll("the Run to succeed elsewhere", || async {
        let run = runs.get("moved").await?;
        Ok(run.phase().is_terminal().then_some(run))
    })
    .await?;
    ensure!(
        run.phase() == kruntimes_api::Phase::Succeeded && assigned(&run) == other,
        "the Run ended {} on {:?}: {:?}",
        run.phase(),
        assigned(&run),
        run.status
    );
    let reasons = event_reasons(&env.admin, "moved").await?;
    ensure!(
        reasons.iter().any(|r| r == "NotClaimed"),
        "a NotClaimed Event: {reasons:?}"
    );
    drop(resume);
    env.finish().await
}

/// Issue 16.6: a Runtime whose worker template asks for what the local provisioner cannot
/// honour (an image, resource requests) says so in the condition `ImageIgnored` and an
/// Event on the Runtime; once the spec asks for nothing ignored, the condition is False.
/// Before 16.6 the fields were dropped in silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_fields_the_local_provisioner_ignores_are_said_on_the_runtime() -> Result<()> {
    let env = Env::start(false).await?;
    let runtime = Runtime::new(
        "imaged",
        RuntimeSpec {
            replicas: 0,
            scaling: None,
            runs: None,
            template: serde_json::from_value(json!({
                "metadata": {"labels": {"team": "a"}},
                "spec": {
                    "runtimeClassName": "gvisor",
                    "containers": [{
                        "name": "runtime",
                        "image": "python:3.12",
                        "resources": {"requests": {"cpu": "500m"}, "limits": {"memory": "256Mi"}},
                    }],
                },
            }))?,
            port: None,
            artifact_store: None,
        },
    );
    env.runtimes()
        .create(&PostParams::default(), &runtime)
        .await?;
    let condition = |rt: &Runtime| {
        rt.status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "ImageIgnored"))
            .cloned()
    };
    let shown = poll("the ImageIgnored condition", || async {
        let rt = env.runtimes().get_status("imaged").await?;
        Ok(condition(&rt).filter(|c| c.status == "True"))
    })
    .await?;
    let message = shown.message.unwrap_or_default();
    ensure!(
        message.starts_with("the local provisioner runs the host's interpreters")
            && message.contains("template.spec.containers[runtime].image (python:3.12)")
            && message.contains("template.spec.containers[runtime].resources.requests")
            && message.contains("template.spec.runtimeClassName")
            && message.contains("template.metadata.labels")
            && !message.contains("limits"),
        "{message}"
    );
    poll("the ImageIgnored Event on the Runtime", || async {
        let reasons = event_reasons(&env.admin, "imaged").await?;
        Ok(reasons.iter().any(|r| r == "ImageIgnored").then_some(()))
    })
    .await?;
    let patch = json!({"spec": {"template": {"metadata": null, "spec": {
        "runtimeClassName": null,
        "containers": [{"name": "runtime", "resources": {"limits": {"memory": "256Mi"}}}],
    }}}});
    env.runtimes()
        .patch("imaged", &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    poll("ImageIgnored False once nothing is ignored", || async {
        let rt = env.runtimes().get_status("imaged").await?;
        Ok(condition(&rt).filter(|c| c.status == "False").map(|_| ()))
    })
    .await?;
    env.finish().await
}
