//! runtimed against the real API server and a real runtime server, without the
//! controller-manager: the test plays the scheduler (it publishes the worker's Pod and
//! writes Scheduled with the assignment), so what runtimed does is seen alone.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kruntimes_api::run::{RetryPolicy, RunSource, Termination, TerminationMode};
use kruntimes_api::{Phase, Run, RunSpec, RunStatus};
use kruntimes_testkit::{Options, Server, within};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;

const DEADLINE: Duration = Duration::from_secs(60);

/// A child process killed (with its process group) when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
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

/// Spawns `cmd` and waits for a stdout line starting with `prefix`; returns the rest.
fn spawn_until(mut cmd: Command, prefix: &str) -> Result<(Proc, String)> {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = cmd.spawn().context("spawn")?;
    let stdout = child.stdout.take().context("stdout")?;
    let proc = Proc(child);
    let mut lines = BufReader::new(stdout).lines();
    for line in lines.by_ref() {
        let line = line?;
        if let Some(rest) = line.strip_prefix(prefix) {
            // Keep draining stdout so the child never blocks on a full pipe.
            std::thread::spawn(move || for _ in lines {});
            return Ok((proc, rest.trim().to_string()));
        }
    }
    bail!("the process ended before printing {prefix:?}")
}

struct Worker {
    _runtime_server: Proc,
    runtimed: Proc,
    pod: Pod,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

/// Starts `kruntimes runtimed` for the Pod `name` on the runtime server at `socket`.
fn start_runtimed(server: &Server, name: &str, socket: &std::path::Path) -> Result<(Proc, String)> {
    let mut rtd = Command::new(kruntimes_testkit::kruntimes_bin()?);
    rtd.arg("runtimed")
        .arg("--kubeconfig")
        .arg(server.component_kubeconfig("runtimed"))
        .args([
            "--namespace",
            "default",
            "--pod-name",
            name,
            "--runtime",
            "bash",
        ])
        .arg("--runtime-socket")
        .arg(socket)
        .arg("--exit-with-stdin")
        .env("RUST_LOG", "warn");
    spawn_until(rtd, "runtimed listening on ")
}

async fn start_worker(server: &Server, admin: &Client, name: &str) -> Result<Worker> {
    let dir = tempfile::Builder::new().prefix("rtd").tempdir()?;
    let socket = dir.path().join("rs.sock");
    let mut rs = Command::new(sibling_bin("kruntimes-runtime-server")?);
    rs.arg("--socket")
        .arg(&socket)
        .arg("--root")
        .arg(dir.path().join("root"))
        .arg("--adapter")
        .arg("bash")
        .env("RUST_LOG", "warn");
    let (runtime_server, _) = spawn_until(rs, "listening on ")?;
    let (runtimed, addr) = start_runtimed(server, name, &socket)?;
    let port: i32 = addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .context("port")?;
    let pods = Api::<Pod>::namespaced(admin.clone(), "default");
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"kruntimes.io/runtime": "bash"}},
        "spec": {"containers": [{"name": "runtimed", "image": "local",
                  "ports": [{"name": "runtimed", "containerPort": port}]}]},
    }))?;
    let pod = pods.create(&PostParams::default(), &pod).await?;
    let status = json!({"status": {"phase": "Running", "podIP": "127.0.0.1",
        "conditions": [{"type": "Ready", "status": "True"}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    Ok(Worker {
        _runtime_server: runtime_server,
        runtimed,
        pod,
        socket,
        _dir: dir,
    })
}

/// Creates a task Run and assigns it to `worker` as the scheduler would.
async fn create_assigned(admin: &Client, worker: &Worker, spec: RunSpec) -> Result<Run> {
    let runs = Api::<Run>::namespaced(admin.clone(), "default");
    let mut run = Run::new("", spec);
    run.metadata.generate_name = Some("t-".into());
    let mut run = runs.create(&PostParams::default(), &run).await?;
    run.status = Some(RunStatus {
        phase: Some(Phase::Scheduled),
        assigned_pod: Some(worker.pod.name_any()),
        assigned_pod_uid: worker.pod.uid(),
        ..RunStatus::default()
    });
    Ok(runs
        .replace_status(&run.name_any(), &PostParams::default(), &run)
        .await?)
}

/// Watches the Run until `done` holds, returning every phase seen on the way.
async fn watch_until(
    admin: &Client,
    name: &str,
    done: impl Fn(&Run) -> bool,
) -> Result<(Run, Vec<Phase>)> {
    let runs = Api::<Run>::namespaced(admin.clone(), "default");
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut stream = watcher(runs, config).applied_objects().boxed();
    let mut phases = Vec::new();
    within(DEADLINE, name, async {
        while let Some(run) = stream.next().await {
            let run = run?;
            if phases.last() != Some(&run.phase()) {
                phases.push(run.phase());
            }
            if done(&run) {
                return Ok(run);
            }
        }
        bail!("watch ended")
    })
    .await
    .map(|run| (run, phases))
}

fn inline(script: &str) -> RunSpec {
    let mut spec = RunSpec::task("bash", "main.sh");
    spec.source = Some(RunSource {
        inline: Some(script.to_string()),
        snapshot: None,
    });
    spec
}

fn terminal(run: &Run) -> bool {
    run.phase().is_terminal()
}

#[tokio::test]
async fn runtimed_claims_executes_and_reports() -> Result<()> {
    let (server, admin) = Server::start_async(Options::default()).await?;
    let worker = start_worker(&server, &admin, "bash-w1").await?;

    // Success with outputs; the claim sets startTime and attempt.
    let run = create_assigned(
        &admin,
        &worker,
        inline("echo hello\necho 'answer=42' >> \"$KRUNTIME_OUTPUTS\"\n"),
    )
    .await?;
    let (done, phases) = watch_until(&admin, &run.name_any(), terminal).await?;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), Phase::Succeeded, "{status:?}");
    assert_eq!(status.exit_code, Some(0));
    assert_eq!(status.outputs.get("answer").map(String::as_str), Some("42"));
    assert_eq!(status.attempt, Some(1));
    assert!(status.start_time.is_some() && status.completion_time.is_some());
    assert!(phases.contains(&Phase::Running), "{phases:?}");

    // A failing program: Failed with its exit code, not retried even with a retry policy.
    let mut spec = inline("exit 3\n");
    spec.retry_policy = Some(RetryPolicy {
        max_attempts: 3,
        backoff_seconds: None,
    });
    let run = create_assigned(&admin, &worker, spec).await?;
    let (done, _) = watch_until(&admin, &run.name_any(), terminal).await?;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), Phase::Failed, "{status:?}");
    assert_eq!(status.exit_code, Some(3));
    assert_eq!(status.reason.as_deref(), Some("NonZeroExitCode"));
    assert_eq!(status.attempt, Some(1));

    // Timeout.
    let mut spec = inline("sleep 30\n");
    spec.timeout = Some("300ms".into());
    let run = create_assigned(&admin, &worker, spec).await?;
    let (done, _) = watch_until(&admin, &run.name_any(), terminal).await?;
    assert_eq!(done.phase(), Phase::Timeout);

    // Immediate termination of a running program.
    let run = create_assigned(&admin, &worker, inline("echo started\nsleep 30\n")).await?;
    watch_until(&admin, &run.name_any(), |r| r.phase() == Phase::Running).await?;
    let runs = Api::<Run>::namespaced(admin.clone(), "default");
    let cancel = json!({"spec": {"termination": Termination { mode: TerminationMode::Immediate }}});
    runs.patch(
        &run.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&cancel),
    )
    .await?;
    let (done, _) = watch_until(&admin, &run.name_any(), terminal).await?;
    assert_eq!(done.phase(), Phase::Cancelled);
    Ok(())
}

#[tokio::test]
async fn runs_of_another_pod_incarnation_are_not_touched() -> Result<()> {
    let (server, admin) = Server::start_async(Options::default()).await?;
    let worker = start_worker(&server, &admin, "bash-w2").await?;
    let runs = Api::<Run>::namespaced(admin.clone(), "default");
    // Assigned to a Pod of the same name but another UID: fenced, runtimed leaves it.
    let mut run = Run::new("fenced", inline("true\n"));
    run = runs.create(&PostParams::default(), &run).await?;
    run.status = Some(RunStatus {
        phase: Some(Phase::Scheduled),
        assigned_pod: Some(worker.pod.name_any()),
        assigned_pod_uid: Some("00000000-0000-0000-0000-000000000000".into()),
        ..RunStatus::default()
    });
    runs.replace_status("fenced", &PostParams::default(), &run)
        .await?;
    // A Run for this incarnation, created after it, completes: runtimed has seen both.
    let ok = create_assigned(&admin, &worker, inline("true\n")).await?;
    watch_until(&admin, &ok.name_any(), terminal).await?;
    let fenced = runs.get("fenced").await?;
    assert_eq!(fenced.phase(), Phase::Scheduled);
    Ok(())
}

#[test]
fn tls_flags_come_together_and_a_missing_file_is_named() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let missing = dir.path().join("worker-missing.crt");
    let run = |tls: &[&str]| -> Result<(bool, String)> {
        let out = Command::new(kruntimes_testkit::kruntimes_bin()?)
            .arg("runtimed")
            .args(["--kubeconfig", "/nonexistent/kubeconfig"])
            .args(["--namespace", "default", "--pod-name", "bash-tls"])
            .args(["--runtime", "bash", "--runtime-socket", "/nonexistent.sock"])
            .args(tls)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .output()?;
        Ok((
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ))
    };
    let path = missing.display().to_string();
    let (ok, stderr) = run(&["--tls-cert", &path, "--tls-key", &path, "--tls-ca", &path])?;
    assert!(!ok);
    assert!(
        stderr.contains(&path) && !stderr.contains("kubeconfig"),
        "the TLS file is checked first and named: {stderr}"
    );
    // A certificate without its key and CA is a usage error, never a silent plaintext port.
    let (ok, stderr) = run(&["--tls-cert", &path])?;
    assert!(!ok);
    assert!(stderr.contains("--tls-key"), "{stderr}");
    Ok(())
}

#[tokio::test]
async fn runtimed_exits_when_stdin_closes() -> Result<()> {
    let (server, admin) = Server::start_async(Options::default()).await?;
    let mut worker = start_worker(&server, &admin, "bash-w3").await?;
    // Closing the pipe is what a dead parent does.
    drop(worker.runtimed.0.stdin.take());
    let mut child = std::mem::replace(&mut worker.runtimed.0, Command::new("true").spawn()?);
    let status = within(DEADLINE, "runtimed exit", async move {
        Ok(tokio::task::spawn_blocking(move || child.wait()).await??)
    })
    .await?;
    assert!(status.success(), "{status:?}");
    Ok(())
}

#[tokio::test]
async fn a_restarted_runtimed_recovers_the_running_execution() -> Result<()> {
    let (server, admin) = Server::start_async(Options::default()).await?;
    let mut worker = start_worker(&server, &admin, "bash-w4").await?;
    // The program waits for a file in its workspace, the one host directory a sandboxed
    // program sees: `<root>/<run uid>/<attempt>/work`.
    let spec = inline(
        "while [ ! -e \"$KRUNTIME_WORKSPACE/go\" ]; do sleep 0.02; done\necho 'done=yes' >> \"$KRUNTIME_OUTPUTS\"\n",
    );
    let run = create_assigned(&admin, &worker, spec).await?;
    let go = worker
        ._dir
        .path()
        .join("root")
        .join(run.uid().context("uid")?)
        .join("1/work/go");
    watch_until(&admin, &run.name_any(), |r| r.phase() == Phase::Running).await?;
    // runtimed dies (its Pod, and the runtime server with the program, stay), and a new
    // runtimed for the same Pod takes over, as after a container restart on a cluster.
    worker.runtimed.0.kill()?;
    worker.runtimed.0.wait()?;
    let (restarted, _) = start_runtimed(&server, "bash-w4", &worker.socket)?;
    worker.runtimed = restarted;
    // The runtime server makes the workspace once runtimed (the first or the restarted
    // one) has started the execution.
    let work = go.parent().context("parent")?.to_owned();
    kruntimes_testkit::within(Duration::from_secs(30), "the workspace exists", async {
        while !work.is_dir() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    })
    .await?;
    std::fs::write(&go, b"").with_context(|| format!("write {}", go.display()))?;
    let (done, _) = watch_until(&admin, &run.name_any(), terminal).await?;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), Phase::Succeeded, "{status:?}");
    assert_eq!(status.attempt, Some(1), "recovered, not retried");
    assert_eq!(status.outputs.get("done").map(String::as_str), Some("yes"));
    Ok(())
}

fn ready_of(run: &Run) -> Option<(String, String)> {
    run.status.as_ref()?.conditions.iter().find_map(|c| {
        (c.type_ == "Ready").then(|| (c.status.clone(), c.reason.clone().unwrap_or_default()))
    })
}

/// Regression (issue 15.5): a SIGTERMed runtimed just stopped; its sessions and functions
/// later ended WorkerLost, their finalizers left to the controller. Now it drains: each
/// registration is closed, its end written with Ready=False/WorkerShutdown, its finalizer
/// removed; a task still running after the grace is cancelled and ends WorkerShutdown too.
#[tokio::test]
async fn a_sigtermed_runtimed_drains_its_registrations_and_tasks() -> Result<()> {
    use kruntimes_api::run::{FunctionMode, RunMode, SessionMode};

    let (server, admin) = Server::start_async(Options::default()).await?;
    // The local gate never mixes a session with other Runs: the session has its own worker.
    let mut worker = start_worker(&server, &admin, "bash-w5").await?;
    let mut session_worker = start_worker(&server, &admin, "bash-w6").await?;
    let mut function = RunSpec::task("bash", "unused");
    function.mode = RunMode {
        function: Some(FunctionMode {
            handler: "handler.sh".to_string(),
            idle_timeout_seconds: None,
            concurrency: None,
        }),
        ..RunMode::default()
    };
    function.source = Some(RunSource {
        inline: Some("cat\n".to_string()),
        snapshot: None,
    });
    let mut session = RunSpec::task("bash", "unused");
    session.mode = RunMode {
        session: Some(SessionMode::default()),
        ..RunMode::default()
    };
    let function = create_assigned(&admin, &worker, function).await?;
    let session = create_assigned(&admin, &session_worker, session).await?;
    for run in [&function, &session] {
        let (ready, _) = watch_until(&admin, &run.name_any(), |r| {
            r.phase() == Phase::Ready || terminal(r)
        })
        .await?;
        assert_eq!(ready.phase(), Phase::Ready, "{:?}", ready.status);
        assert!(
            ready
                .finalizers()
                .iter()
                .any(|f| f == kruntimes_api::lifecycle::REGISTRATION_FINALIZER)
        );
    }

    // A task that never ends by itself: it outlives the grace.
    let task = create_assigned(&admin, &worker, inline("sleep 600\n")).await?;
    watch_until(&admin, &task.name_any(), |r| r.phase() == Phase::Running).await?;

    for worker in [&mut worker, &mut session_worker] {
        let pid = worker.runtimed.0.id().to_string();
        let status = Command::new("kill").args(["-TERM", &pid]).status()?;
        assert!(status.success());
    }
    for worker in [&mut worker, &mut session_worker] {
        let mut child = std::mem::replace(&mut worker.runtimed.0, Command::new("true").spawn()?);
        let exit = within(DEADLINE, "runtimed exits after its drain", async move {
            Ok(tokio::task::spawn_blocking(move || child.wait()).await??)
        })
        .await?;
        assert!(exit.success(), "{exit:?}");
    }

    let runs = Api::<Run>::namespaced(admin.clone(), "default");
    // The function registers again on the next ready worker, its retries untouched (issue
    // 19.6): Pending, attempt 2 (the fence), one worker restart counted instead.
    let restarted = runs.get(&function.name_any()).await?;
    let status = restarted.status.clone().unwrap_or_default();
    assert_eq!(restarted.phase(), Phase::Pending, "{status:?}");
    assert_eq!(status.reason.as_deref(), Some("WorkerRestarted"));
    assert_eq!((status.attempt, status.worker_restarts), (Some(2), Some(1)));
    assert_eq!(
        ready_of(&restarted),
        Some(("False".to_string(), "WorkerRestarted".to_string()))
    );
    assert!(restarted.finalizers().is_empty());
    // No snapshot store on this worker: the Ready session is closed and fails as before.
    for run in [&session] {
        let done = runs.get(&run.name_any()).await?;
        let status = done.status.clone().unwrap_or_default();
        assert_eq!(done.phase(), Phase::Failed, "{status:?}");
        assert_eq!(
            status.reason.as_deref(),
            Some("WorkerShutdown"),
            "{status:?}"
        );
        assert_eq!(
            ready_of(&done),
            Some(("False".to_string(), "WorkerShutdown".to_string())),
            "{status:?}"
        );
        assert!(
            done.finalizers().is_empty(),
            "the drain removes the finalizer: {:?}",
            done.finalizers()
        );
    }
    let done = runs.get(&task.name_any()).await?;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), Phase::Failed, "{status:?}");
    assert_eq!(
        status.reason.as_deref(),
        Some("WorkerShutdown"),
        "{status:?}"
    );
    assert_eq!(ready_of(&done), None, "a task Run has no Ready condition");
    // Each drained Run has an Event that says so, written by the exited runtimed (with its
    // own identity) before it exited.
    for (run, pod, reason, type_) in [
        (&function, "bash-w5", "WorkerRestarted", "Normal"),
        (&session, "bash-w6", "WorkerShutdown", "Warning"),
        (&task, "bash-w5", "WorkerShutdown", "Warning"),
    ] {
        let event = kruntimes_testkit::events::wait_for(
            &admin,
            "default",
            &run.name_any(),
            reason,
            DEADLINE,
        )
        .await?;
        assert_eq!(event.type_.as_deref(), Some(type_), "{event:?}");
        assert_eq!(event.action.as_deref(), Some("Drain"), "{event:?}");
        assert_eq!(
            event.reporting_component.as_deref(),
            Some("kruntimes.io/runtimed"),
            "{event:?}"
        );
        assert_eq!(event.reporting_instance.as_deref(), Some(pod), "{event:?}");
    }
    Ok(())
}
