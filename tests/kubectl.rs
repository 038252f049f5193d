//! The real `/usr/bin/kubectl` against a started `kruntimes up`: apply, get (server-side
//! tables and jsonpath), wait, patch, explain, delete with finalizers, admission errors,
//! raw health endpoints and authentication.
//!
//! Each test starts its own server on an ephemeral port. kubectl runs as a child process
//! that is killed if the test ends early; nothing here sleeps to synchronise: tests wait on
//! process exit or on a watch with a deadline.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use kruntimes_api::{Phase, Run};
use kruntimes_testkit::Server;
use kube::Api;
use kube::api::{Patch, PatchParams};
use kube::runtime::wait::{Condition, await_condition};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::ChildStdout;

/// The longest any single kubectl invocation may take before the test fails.
const KUBECTL_DEADLINE: Duration = Duration::from_secs(90);
/// The longest a watch-based wait inside a test may take.
const WATCH_DEADLINE: Duration = Duration::from_secs(30);

const NAMESPACE: &str = "default";

fn runtime_yaml(name: &str, replicas: i32) -> String {
    format!(
        "apiVersion: kruntimes.io/v1alpha1
kind: Runtime
metadata:
  name: {name}
spec:
  replicas: {replicas}
  template:
    spec:
      containers:
      - name: runtime
        command: [\"python3\", \"-m\", \"kruntimes_worker\"]
"
    )
}

fn task_run_yaml(name: &str, runtime: &str) -> String {
    format!(
        "apiVersion: kruntimes.io/v1alpha1
kind: Run
metadata:
  name: {name}
spec:
  runtime: {runtime}
  mode:
    task:
      entrypoint: main.py
      args: [\"--verbose\"]
  source:
    inline: |
      print('hello')
"
    )
}

/// A temporary directory holding manifests for one test.
struct Manifests {
    dir: tempfile::TempDir,
}

impl Manifests {
    fn new() -> Result<Manifests> {
        let dir = tempfile::Builder::new()
            .prefix("kruntimes-manifests")
            .tempdir()
            .context("create a manifest directory")?;
        Ok(Manifests { dir })
    }

    fn write(&self, file: &str, text: &str) -> Result<PathBuf> {
        let path = self.dir.path().join(file);
        std::fs::write(&path, text).with_context(|| format!("write {}", path.display()))?;
        Ok(path)
    }
}

/// Runs kubectl with `args` against `server` and returns its output, whatever the exit code.
/// The child is killed if it outlives [`KUBECTL_DEADLINE`] or the test.
async fn kubectl(server: &Server, args: &[&str]) -> Result<Output> {
    kubectl_with(server, args, None).await
}

/// Like [`kubectl`], with another kubeconfig when `kubeconfig` is set.
async fn kubectl_with(server: &Server, args: &[&str], kubeconfig: Option<&Path>) -> Result<Output> {
    let mut cmd = tokio::process::Command::from(server.kubectl());
    if let Some(path) = kubeconfig {
        cmd.env("KUBECONFIG", path);
    }
    cmd.args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = cmd
        .spawn()
        .with_context(|| format!("spawn kubectl {}", args.join(" ")))?;
    tokio::time::timeout(KUBECTL_DEADLINE, child.wait_with_output())
        .await
        .with_context(|| {
            format!(
                "kubectl {} did not exit within {KUBECTL_DEADLINE:?}",
                args.join(" ")
            )
        })?
        .with_context(|| format!("wait for kubectl {}", args.join(" ")))
}

/// Runs kubectl and returns its stdout, failing with stdout and stderr when it exits
/// non-zero.
async fn kubectl_ok(server: &Server, args: &[&str]) -> Result<String> {
    let out = kubectl(server, args).await?;
    ensure!(
        out.status.success(),
        "kubectl {} failed ({}):\nstdout: {}\nstderr: {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs kubectl, expects a non-zero exit and returns its stderr.
async fn kubectl_err(server: &Server, args: &[&str]) -> Result<String> {
    let out = kubectl(server, args).await?;
    ensure!(
        !out.status.success(),
        "kubectl {} should have failed but succeeded:\nstdout: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Splits a kubectl table into rows of whitespace-separated cells.
fn table(stdout: &str) -> Vec<Vec<String>> {
    stdout
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| line.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// The table row whose first cell is `name`.
fn row<'a>(rows: &'a [Vec<String>], name: &str) -> Result<&'a [String]> {
    rows.iter()
        .find(|row| row.first().is_some_and(|cell| cell == name))
        .map(Vec::as_slice)
        .with_context(|| format!("no row for {name} in {rows:?}"))
}

async fn runs(server: &Server) -> Result<Api<Run>> {
    Ok(Api::namespaced(server.client().await?, NAMESPACE))
}

/// Applies a Runtime `rt` and a task Run `name` on it with `kubectl apply -f`.
async fn apply_task_run(server: &Server, manifests: &Manifests, name: &str) -> Result<()> {
    let runtime = manifests.write("runtime.yaml", &runtime_yaml("rt", 1))?;
    let run = manifests.write(&format!("{name}.yaml"), &task_run_yaml(name, "rt"))?;
    kubectl_ok(server, &["apply", "-f", path_str(&runtime)?]).await?;
    kubectl_ok(server, &["apply", "-f", path_str(&run)?]).await?;
    Ok(())
}

fn path_str(path: &Path) -> Result<&str> {
    path.to_str()
        .with_context(|| format!("{} is not UTF-8", path.display()))
}

/// Waits, through a kube-rs watch with a deadline, until `cond` holds for Run `name`.
async fn wait_for_run(
    api: &Api<Run>,
    name: &str,
    what: &str,
    cond: impl Condition<Run>,
) -> Result<()> {
    tokio::time::timeout(WATCH_DEADLINE, await_condition(api.clone(), name, cond))
        .await
        .with_context(|| format!("run {name}: {what} did not happen within {WATCH_DEADLINE:?}"))?
        .with_context(|| format!("watch run {name} for {what}"))?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_creates_runs_and_runtimes_that_get_prints_as_tables() -> Result<()> {
    let server = Server::start()?;
    let manifests = Manifests::new()?;
    let runtime = manifests.write("runtime.yaml", &runtime_yaml("python", 3))?;
    let run = manifests.write("run.yaml", &task_run_yaml("hello", "python"))?;

    let out = kubectl_ok(&server, &["apply", "-f", path_str(&runtime)?]).await?;
    ensure!(
        out.contains("runtime.kruntimes.io/python created"),
        "apply of the Runtime printed {out:?}"
    );
    let out = kubectl_ok(&server, &["apply", "-f", path_str(&run)?]).await?;
    ensure!(
        out.contains("run.kruntimes.io/hello created"),
        "apply of the Run printed {out:?}"
    );

    let rows = table(&kubectl_ok(&server, &["get", "runs"]).await?);
    let header = rows.first().context("kubectl get runs printed nothing")?;
    ensure!(
        header == &["NAME", "RUNTIME", "MODE", "PHASE", "REASON", "AGE"],
        "kubectl get runs header is {header:?}"
    );
    let hello = row(&rows, "hello")?;
    ensure!(
        hello.get(1..4)
            == Some(
                &[
                    "python".to_string(),
                    "task".to_string(),
                    "Pending".to_string()
                ][..]
            ),
        "kubectl get runs row is {hello:?}, expected hello python task Pending <age>"
    );
    // No controller here: nothing says why it waits, so the REASON cell is blank.
    ensure!(
        hello.len() == 5,
        "kubectl get runs row has {} cells: {hello:?}",
        hello.len()
    );

    let rows = table(&kubectl_ok(&server, &["get", "runtimes"]).await?);
    let header = rows
        .first()
        .context("kubectl get runtimes printed nothing")?;
    ensure!(
        header == &["NAME", "REPLICAS", "READY", "AGE"],
        "kubectl get runtimes header is {header:?}"
    );
    let python = row(&rows, "python")?;
    ensure!(
        python.get(1).map(String::as_str) == Some("3"),
        "kubectl get runtimes row is {python:?}, expected 3 replicas"
    );

    // The object kubectl stored is the one in the manifest.
    let api = runs(&server).await?;
    let stored = api.get("hello").await.context("get run hello")?;
    let task = stored
        .spec
        .mode
        .task
        .as_ref()
        .context("run hello has no task mode")?;
    ensure!(
        task.entrypoint.as_deref() == Some("main.py") && task.args == ["--verbose"],
        "stored task is {task:?}"
    );
    ensure!(
        stored.phase() == Phase::Pending,
        "a new Run is {:?}",
        stored.phase()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_again_reports_unchanged_then_configures_a_mutable_field() -> Result<()> {
    let server = Server::start()?;
    let manifests = Manifests::new()?;
    apply_task_run(&server, &manifests, "again").await?;
    let path = manifests.write("again.yaml", &task_run_yaml("again", "rt"))?;

    let out = kubectl_ok(&server, &["apply", "-f", path_str(&path)?]).await?;
    ensure!(
        out.contains("run.kruntimes.io/again unchanged"),
        "second apply printed {out:?}"
    );

    let changed = format!(
        "{}  ttlSecondsAfterFinished: 60\n",
        task_run_yaml("again", "rt")
    );
    let path = manifests.write("again.yaml", &changed)?;
    let out = kubectl_ok(&server, &["apply", "-f", path_str(&path)?]).await?;
    ensure!(
        out.contains("run.kruntimes.io/again configured"),
        "third apply printed {out:?}"
    );
    let stored = runs(&server)
        .await?
        .get("again")
        .await
        .context("get run again")?;
    ensure!(
        stored.spec.ttl_seconds_after_finished == Some(60),
        "ttlSecondsAfterFinished is {:?} after apply",
        stored.spec.ttl_seconds_after_finished
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_with_jsonpath_prints_the_field() -> Result<()> {
    let server = Server::start()?;
    let manifests = Manifests::new()?;
    apply_task_run(&server, &manifests, "jp").await?;

    let out = kubectl_ok(
        &server,
        &["get", "run", "jp", "-o", "jsonpath={.spec.runtime}"],
    )
    .await?;
    ensure!(out == "rt", "jsonpath {{.spec.runtime}} printed {out:?}");
    let out = kubectl_ok(
        &server,
        &[
            "get",
            "run",
            "jp",
            "-o",
            "jsonpath={.spec.mode.task.entrypoint}",
        ],
    )
    .await?;
    ensure!(
        out == "main.py",
        "jsonpath {{.spec.mode.task.entrypoint}} printed {out:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_jsonpath_returns_when_status_is_patched() -> Result<()> {
    let server = Server::start()?;
    let manifests = Manifests::new()?;
    apply_task_run(&server, &manifests, "waited").await?;
    let api = runs(&server).await?;

    // Start kubectl wait first; it lists then watches, so it sees the patch whichever of
    // its requests the patch lands between.
    let mut cmd = tokio::process::Command::from(server.kubectl());
    cmd.args([
        "wait",
        "--for=jsonpath={.status.phase}=Scheduled",
        "run/waited",
        "--timeout=30s",
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true);
    let child = cmd.spawn().context("spawn kubectl wait")?;

    let patch = serde_json::json!({"status": {"phase": "Scheduled"}});
    let patched = api
        .patch_status("waited", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .context("patch status of run waited")?;
    ensure!(
        patched.phase() == Phase::Scheduled,
        "patch_status returned phase {:?}",
        patched.phase()
    );
    ensure!(
        patched.spec.runtime == "rt",
        "patch_status changed the spec: {:?}",
        patched.spec
    );

    let out = tokio::time::timeout(KUBECTL_DEADLINE, child.wait_with_output())
        .await
        .context("kubectl wait did not exit")?
        .context("wait for kubectl wait")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "kubectl wait exited {}:\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        stdout.contains("run.kruntimes.io/waited condition met"),
        "kubectl wait printed {stdout:?}"
    );
    Ok(())
}

/// Reads lines from `lines` until one satisfies `wanted`, failing after [`WATCH_DEADLINE`]
/// or at the end of the output. Returns every line read.
async fn read_until(
    lines: &mut Lines<BufReader<ChildStdout>>,
    what: &str,
    wanted: impl Fn(&[&str]) -> bool,
) -> Result<Vec<String>> {
    let mut seen = Vec::new();
    let found = tokio::time::timeout(WATCH_DEADLINE, async {
        while let Some(line) = lines.next_line().await? {
            let cells: Vec<&str> = line.split_whitespace().collect();
            let hit = wanted(&cells);
            seen.push(line);
            if hit {
                return Ok::<bool, std::io::Error>(true);
            }
        }
        Ok(false)
    })
    .await;
    match found {
        Ok(Ok(true)) => Ok(seen),
        Ok(Ok(false)) => bail!("kubectl ended before {what}; it printed {seen:?}"),
        Ok(Err(error)) => Err(error).context("read kubectl output"),
        Err(_) => bail!("no {what} within {WATCH_DEADLINE:?}; kubectl printed {seen:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_watch_prints_added_and_modified_runs() -> Result<()> {
    let server = Server::start()?;
    let manifests = Manifests::new()?;
    let api = runs(&server).await?;

    let mut cmd = tokio::process::Command::from(server.kubectl());
    cmd.args(["get", "runs", "--watch", "--output-watch-events"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    let mut child = cmd.spawn().context("spawn kubectl get runs --watch")?;
    let stdout = child.stdout.take().context("kubectl stdout is piped")?;
    let mut lines = BufReader::new(stdout).lines();

    // Whether the create lands before kubectl's list or after its watch began, the Run
    // appears as ADDED.
    apply_task_run(&server, &manifests, "watched").await?;
    read_until(&mut lines, "ADDED row for run watched", |cells| {
        cells.first() == Some(&"ADDED") && cells.get(1) == Some(&"watched")
    })
    .await?;

    let patch = serde_json::json!({"status": {"phase": "Running"}});
    api.patch_status("watched", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .context("patch status of run watched")?;
    let seen = read_until(&mut lines, "MODIFIED row for run watched", |cells| {
        cells.first() == Some(&"MODIFIED") && cells.get(1) == Some(&"watched")
    })
    .await?;
    let last = seen.last().map(String::as_str).unwrap_or_default();
    let cells: Vec<&str> = last.split_whitespace().collect();
    ensure!(
        cells.get(2..5) == Some(&["rt", "task", "Running"][..]),
        "the MODIFIED row is {last:?}, expected rt task Running"
    );

    child.kill().await.context("stop kubectl get --watch")?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patch_merge_changes_a_mutable_field() -> Result<()> {
    let server = Server::start()?;
    let manifests = Manifests::new()?;
    apply_task_run(&server, &manifests, "patched").await?;
    let api = runs(&server).await?;
    let before = api.get("patched").await.context("get run patched")?;

    let out = kubectl_ok(
        &server,
        &[
            "patch",
            "run",
            "patched",
            "--type=merge",
            "-p",
            r#"{"spec":{"ttlSecondsAfterFinished":30}}"#,
        ],
    )
    .await?;
    ensure!(
        out.contains("run.kruntimes.io/patched patched"),
        "kubectl patch printed {out:?}"
    );

    let out = kubectl_ok(
        &server,
        &[
            "get",
            "run",
            "patched",
            "-o",
            "jsonpath={.spec.ttlSecondsAfterFinished}",
        ],
    )
    .await?;
    ensure!(
        out == "30",
        "ttlSecondsAfterFinished is {out:?} after the patch"
    );

    let after = api.get("patched").await.context("get run patched")?;
    ensure!(
        after.spec.ttl_seconds_after_finished == Some(30),
        "kube-rs sees ttlSecondsAfterFinished {:?}",
        after.spec.ttl_seconds_after_finished
    );
    ensure!(
        after.metadata.resource_version != before.metadata.resource_version,
        "the patch left resourceVersion at {:?}",
        after.metadata.resource_version
    );
    ensure!(
        after.metadata.generation == before.metadata.generation.map(|g| g + 1),
        "a spec change moved generation from {:?} to {:?}",
        before.metadata.generation,
        after.metadata.generation
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_run_spec_describes_its_fields() -> Result<()> {
    let server = Server::start()?;
    let out = kubectl_ok(&server, &["explain", "run.spec"]).await?;
    ensure!(
        out.contains("runtime"),
        "kubectl explain run.spec does not mention runtime:\n{out}"
    );
    ensure!(
        out.contains("mode"),
        "kubectl explain run.spec does not mention mode:\n{out}"
    );
    ensure!(
        out.contains("kruntimes.io"),
        "kubectl explain run.spec names no group:\n{out}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_waits_for_finalizers_before_removing_the_object() -> Result<()> {
    let server = Server::start()?;
    let manifests = Manifests::new()?;
    apply_task_run(&server, &manifests, "held").await?;
    let api = runs(&server).await?;

    kubectl_ok(
        &server,
        &[
            "patch",
            "run",
            "held",
            "--type=merge",
            "-p",
            r#"{"metadata":{"finalizers":["kruntimes.io/test"]}}"#,
        ],
    )
    .await?;

    let out = kubectl_ok(&server, &["delete", "run", "held", "--wait=false"]).await?;
    ensure!(
        out.contains(r#"run.kruntimes.io "held" deleted"#),
        "kubectl delete printed {out:?}"
    );

    let held = api
        .get_opt("held")
        .await
        .context("get run held")?
        .context("run held was removed although it has a finalizer")?;
    ensure!(
        held.metadata.deletion_timestamp.is_some(),
        "run held has no deletionTimestamp after delete: {:?}",
        held.metadata
    );
    ensure!(
        held.metadata.finalizers.as_deref() == Some(&["kruntimes.io/test".to_string()][..]),
        "run held has finalizers {:?}",
        held.metadata.finalizers
    );
    let out = kubectl_ok(
        &server,
        &[
            "get",
            "run",
            "held",
            "-o",
            "jsonpath={.metadata.deletionTimestamp}",
        ],
    )
    .await?;
    ensure!(
        !out.is_empty(),
        "kubectl sees no deletionTimestamp on run held"
    );

    kubectl_ok(
        &server,
        &[
            "patch",
            "run",
            "held",
            "--type=json",
            "-p",
            r#"[{"op":"remove","path":"/metadata/finalizers/0"}]"#,
        ],
    )
    .await?;

    let gone = api.get_opt("held").await.context("get run held")?;
    ensure!(
        gone.is_none(),
        "run held still exists after its last finalizer was removed: {:?}",
        gone.map(|r| r.metadata)
    );
    let stderr = kubectl_err(&server, &["get", "run", "held"]).await?;
    ensure!(
        stderr.contains("NotFound"),
        "kubectl get of a removed run said {stderr:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_without_finalizers_blocks_until_gone() -> Result<()> {
    let server = Server::start()?;
    let manifests = Manifests::new()?;
    apply_task_run(&server, &manifests, "plain").await?;

    let out = kubectl_ok(&server, &["delete", "run", "plain"]).await?;
    ensure!(
        out.contains(r#"run.kruntimes.io "plain" deleted"#),
        "kubectl delete printed {out:?}"
    );
    let gone = runs(&server)
        .await?
        .get_opt("plain")
        .await
        .context("get run plain")?;
    ensure!(
        gone.is_none(),
        "run plain still exists after kubectl delete"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_delete_returns_once_the_finalizer_is_removed() -> Result<()> {
    let server = Server::start()?;
    let manifests = Manifests::new()?;
    apply_task_run(&server, &manifests, "slow").await?;
    let api = runs(&server).await?;
    let finalizer = serde_json::json!({"metadata": {"finalizers": ["kruntimes.io/test"]}});
    api.patch("slow", &PatchParams::default(), &Patch::Merge(&finalizer))
        .await
        .context("add a finalizer to run slow")?;

    let mut cmd = tokio::process::Command::from(server.kubectl());
    cmd.args(["delete", "run", "slow", "--timeout=60s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = cmd.spawn().context("spawn kubectl delete")?;

    // kubectl has sent its DELETE once the deletionTimestamp is set; from then on it waits.
    wait_for_run(
        &api,
        "slow",
        "deletionTimestamp set",
        |run: Option<&Run>| run.is_some_and(|r| r.metadata.deletion_timestamp.is_some()),
    )
    .await?;
    // Remove it the careful way: test the value at the index, then remove it.
    kubectl_ok(
        &server,
        &[
            "patch",
            "run",
            "slow",
            "--type=json",
            "-p",
            r#"[{"op":"test","path":"/metadata/finalizers/0","value":"kruntimes.io/test"},{"op":"remove","path":"/metadata/finalizers/0"}]"#,
        ],
    )
    .await?;

    let out = tokio::time::timeout(KUBECTL_DEADLINE, child.wait_with_output())
        .await
        .context("kubectl delete did not return after the finalizer was removed")?
        .context("wait for kubectl delete")?;
    ensure!(
        out.status.success(),
        "kubectl delete exited {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        api.get_opt("slow").await?.is_none(),
        "run slow still exists"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changing_the_mode_of_a_run_is_rejected() -> Result<()> {
    let server = Server::start()?;
    let manifests = Manifests::new()?;
    apply_task_run(&server, &manifests, "fixed").await?;

    let stderr = kubectl_err(
        &server,
        &[
            "patch",
            "run",
            "fixed",
            "--type=merge",
            "-p",
            r#"{"spec":{"mode":{"task":null,"function":{"handler":"main.handle"}}}}"#,
        ],
    )
    .await?;
    ensure!(
        stderr.contains("spec.mode"),
        "the rejection does not name spec.mode: {stderr:?}"
    );
    // kubectl prints a 422 Invalid as `The Run "fixed" is invalid: <field>: <message>`.
    ensure!(
        stderr.contains(r#"The Run "fixed" is invalid"#),
        "the rejection is not Invalid (422): {stderr:?}"
    );

    let stored = runs(&server)
        .await?
        .get("fixed")
        .await
        .context("get run fixed")?;
    ensure!(
        stored.spec.mode.task.is_some() && stored.spec.mode.function.is_none(),
        "a rejected patch changed the mode to {:?}",
        stored.spec.mode
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_raw_readyz_prints_ok() -> Result<()> {
    let server = Server::start()?;
    let out = kubectl_ok(&server, &["get", "--raw", "/readyz"]).await?;
    ensure!(out.trim() == "ok", "/readyz printed {out:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_unauthorized() -> Result<()> {
    let server = Server::start()?;
    let text = std::fs::read_to_string(server.kubeconfig_path()).context("read the kubeconfig")?;
    let mut config: serde_yaml::Value =
        serde_yaml::from_str(&text).context("parse the kubeconfig")?;
    let users = config["users"]
        .as_sequence_mut()
        .context("the kubeconfig has no users")?;
    if users.is_empty() {
        bail!("the kubeconfig has an empty users list");
    }
    for user in users.iter_mut() {
        let token = user["user"]
            .get_mut("token")
            .context("a kubeconfig user has no token")?;
        *token = serde_yaml::Value::String("not-a-kruntimes-token".into());
    }
    let dir = tempfile::tempdir().context("create a temporary directory")?;
    let wrong = dir.path().join("kubeconfig");
    std::fs::write(&wrong, serde_yaml::to_string(&config)?).context("write the kubeconfig copy")?;

    // A plain request shows the server's 401 Status.
    let raw = "/apis/kruntimes.io/v1alpha1/namespaces/default/runs";
    let out = kubectl_with(&server, &["get", "--raw", raw], Some(&wrong)).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success(),
        "kubectl get --raw with a wrong token succeeded"
    );
    ensure!(
        stderr.contains("Unauthorized") || stderr.contains("401"),
        "kubectl get --raw with a wrong token said {stderr:?}"
    );
    // `get runs` fails in discovery first; client-go words that 401 as "the server has
    // asked for the client to provide credentials", as it does against a real cluster.
    let out = kubectl_with(&server, &["get", "runs"], Some(&wrong)).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success(),
        "kubectl get runs with a wrong token succeeded"
    );
    ensure!(
        stderr.contains("You must be logged in to the server"),
        "kubectl get runs with a wrong token said {stderr:?}"
    );
    // The real token still works, so the rejection was about the token.
    kubectl_ok(&server, &["get", "runs"]).await?;
    Ok(())
}

/// A kube client that authenticates as a component with the kubeconfig `kruntimes up` wrote
/// for it.
async fn component_client(server: &Server, component: &str) -> Result<kube::Client> {
    let path = server.component_kubeconfig(component);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&text)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    Ok(kube::Client::try_from(config)?)
}

/// Issue 15 item 6: Events recorded with kube-runtime's `Recorder` (which writes
/// `events.k8s.io/v1`, a create and then a merge patch for a repeat) by the
/// controller-manager's own identity are what `kubectl get events --field-selector
/// involvedObject.name=...` (core v1) and `kubectl describe run` show. Before, the two Event
/// APIs were stored apart, core v1 had no `involvedObject.kind`/`namespace` selectors, so
/// describe (which selects on all four) listed no events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_recorded_by_a_component_show_in_get_events_and_describe() -> Result<()> {
    use k8s_openapi::api::core::v1::Event as CoreEvent;
    use k8s_openapi::api::events::v1::Event as V1Event;
    use kube::Resource;
    use kube::api::ListParams;
    use kube::runtime::events::{Event, EventType, Recorder, Reporter};

    let server = Server::start()?;
    let manifests = Manifests::new()?;
    apply_task_run(&server, &manifests, "evented").await?;
    apply_task_run(&server, &manifests, "quiet").await?;
    let run = runs(&server).await?.get("evented").await?;

    let recorder = Recorder::new(
        component_client(&server, "controller-manager").await?,
        Reporter {
            controller: "kruntimes-controller".into(),
            instance: Some("test".into()),
        },
    );
    let reference = run.object_ref(&());
    for _ in 0..2 {
        recorder
            .publish(
                &Event {
                    type_: EventType::Warning,
                    reason: "NoWorker".into(),
                    note: Some("no worker of Runtime rt is ready".into()),
                    action: "Schedule".into(),
                    secondary: None,
                },
                &reference,
            )
            .await
            .context("publish an event as the controller-manager")?;
    }
    let other = runs(&server).await?.get("quiet").await?;
    recorder
        .publish(
            &Event {
                type_: EventType::Normal,
                reason: "Elsewhere".into(),
                note: Some("about another Run".into()),
                action: "Schedule".into(),
                secondary: None,
            },
            &other.object_ref(&()),
        )
        .await?;

    // kube-rs through core v1, selecting as kubectl describe does.
    let admin = server.client().await?;
    let core: Api<CoreEvent> = Api::namespaced(admin.clone(), NAMESPACE);
    let uid = run.metadata.uid.clone().context("the Run has no uid")?;
    let selected = core
        .list(&ListParams::default().fields(&format!(
            "involvedObject.kind=Run,involvedObject.name=evented,involvedObject.namespace={NAMESPACE},involvedObject.uid={uid}"
        )))
        .await
        .context("list core v1 events by involvedObject")?;
    ensure!(
        selected.items.len() == 1,
        "core v1 events of the Run: {:?}",
        selected.items
    );
    let event = &selected.items[0];
    ensure!(
        event.message.as_deref() == Some("no worker of Runtime rt is ready")
            && event.reason.as_deref() == Some("NoWorker")
            && event.type_.as_deref() == Some("Warning")
            && event.reporting_component.as_deref() == Some("kruntimes-controller")
            && event.series.as_ref().and_then(|s| s.count) == Some(2),
        "core v1 view of the recorded event: {event:?}"
    );
    // And through events.k8s.io/v1, with its own selectors.
    let v1: Api<V1Event> = Api::namespaced(admin.clone(), NAMESPACE);
    let selected = v1
        .list(&ListParams::default().fields("regarding.name=quiet,type=Normal"))
        .await
        .context("list events.k8s.io events by regarding")?;
    ensure!(
        selected.items.len() == 1 && selected.items[0].note.as_deref() == Some("about another Run"),
        "events.k8s.io events of the other Run: {:?}",
        selected.items
    );
    let by_reason = core
        .list(&ListParams::default().fields("reason=NoWorker"))
        .await?;
    ensure!(
        by_reason.items.len() == 1,
        "by reason: {:?}",
        by_reason.items
    );

    // The real kubectl.
    let out = kubectl_ok(
        &server,
        &[
            "get",
            "events",
            "--field-selector",
            "involvedObject.name=evented",
        ],
    )
    .await?;
    ensure!(
        out.contains("NoWorker") && out.contains("run/evented") && !out.contains("Elsewhere"),
        "kubectl get events --field-selector involvedObject.name=evented printed:\n{out}"
    );
    let out = kubectl_ok(&server, &["describe", "run", "evented"]).await?;
    let events = out
        .split_once("Events:")
        .map(|(_, rest)| rest)
        .with_context(|| format!("kubectl describe run printed no Events section:\n{out}"))?;
    ensure!(
        events.contains("NoWorker")
            && events.contains("no worker of Runtime rt is ready")
            && events.contains("kruntimes-controller")
            && !events.contains("Elsewhere"),
        "kubectl describe run evented printed events:\n{events}"
    );
    Ok(())
}

/// Issue 16.3: a misspelled Runtime in `kubectl apply` is visible at once: `kubectl get
/// runs` shows the Run Pending with the reason RuntimeNotFound within about a second, and
/// `kubectl describe run` shows the condition and the Event. Before 16.3 the Run was just
/// Pending, with no REASON column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misspelled_runtime_in_apply_is_visible_at_once() -> Result<()> {
    let server = Server::start_with(kruntimes_testkit::Options::full())?;
    let manifests = Manifests::new()?;
    let run = manifests.write("typo.yaml", &task_run_yaml("typo", "pyhton"))?;
    kubectl_ok(&server, &["apply", "-f", path_str(&run)?]).await?;
    let applied = std::time::Instant::now();
    let api = runs(&server).await?;
    let condition = |run: Option<&Run>| {
        run.and_then(|r| r.status.as_ref()).is_some_and(|s| {
            s.conditions.iter().any(|c| {
                c.type_ == "Scheduled"
                    && c.status == "False"
                    && c.reason.as_deref() == Some("RuntimeNotFound")
            })
        })
    };
    kruntimes_testkit::within(
        Duration::from_secs(30),
        "Scheduled=False/RuntimeNotFound",
        async {
            await_condition(api, "typo", condition).await?;
            Ok(())
        },
    )
    .await?;
    let took = applied.elapsed();
    ensure!(took < Duration::from_secs(2), "the reason took {took:?}");
    let rows = table(&kubectl_ok(&server, &["get", "runs"]).await?);
    let typo = row(&rows, "typo")?;
    ensure!(
        typo.get(1..5)
            == Some(
                &[
                    "pyhton".to_string(),
                    "task".to_string(),
                    "Pending".to_string(),
                    "RuntimeNotFound".to_string()
                ][..]
            ),
        "kubectl get runs row is {typo:?}"
    );
    let described = kubectl_ok(&server, &["describe", "run", "typo"]).await?;
    ensure!(
        described.contains("Runtime pyhton does not exist")
            && described.matches("RuntimeNotFound").count() >= 2,
        "kubectl describe run shows the condition and the Event: {described}"
    );
    Ok(())
}

/// `kubectl get snapshots` prints the Snapshot's columns; its spec is immutable and a Ready
/// status is final: kubectl gets a 422 naming the rule, and nothing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshots_spec_is_immutable_and_ready_is_final() -> Result<()> {
    use kruntimes_api::snapshot::{ObjectReference, SnapshotSource};
    use kruntimes_api::snapshot::{SnapshotPhase, SnapshotStatus};
    use kruntimes_api::{Snapshot, SnapshotSpec};

    let server = Server::start()?;
    let manifests = Manifests::new()?;
    let file = manifests.write(
        "snapshot.yaml",
        "apiVersion: kruntimes.io/v1alpha1
kind: Snapshot
metadata:
  name: kept-cp1
spec:
  source:
    run:
      name: kept
",
    )?;
    kubectl_ok(&server, &["apply", "-f", path_str(&file)?]).await?;
    let api = Api::<Snapshot>::namespaced(server.client().await?, NAMESPACE);
    let mut snapshot = api.get("kept-cp1").await?;
    snapshot.status = Some(SnapshotStatus {
        phase: Some(SnapshotPhase::Ready),
        size_bytes: Some(42),
        files: Some(3),
        ..SnapshotStatus::default()
    });
    api.replace_status("kept-cp1", &Default::default(), &snapshot)
        .await
        .context("write the Snapshot Ready")?;
    let rows = table(&kubectl_ok(&server, &["get", "snapshots"]).await?);
    ensure!(
        rows.first()
            .is_some_and(|h| h[..6] == ["NAME", "RUN", "REASON", "PHASE", "SIZE", "FILES"]),
        "{rows:?}"
    );
    let kept = row(&rows, "kept-cp1")?;
    ensure!(
        kept[1..6] == ["kept", "Checkpoint", "Ready", "42", "3"],
        "{kept:?}"
    );

    let before = api.get("kept-cp1").await?;
    let stderr = kubectl_err(
        &server,
        &[
            "patch",
            "snapshot",
            "kept-cp1",
            "--type=merge",
            "-p",
            r#"{"spec":{"source":{"run":{"name":"other"}}}}"#,
        ],
    )
    .await?;
    ensure!(
        stderr.contains("is invalid") && stderr.contains("spec.source: field is immutable"),
        "kubectl patch of the spec said {stderr:?}"
    );
    let stderr = kubectl_err(
        &server,
        &[
            "patch",
            "snapshot",
            "kept-cp1",
            "--subresource=status",
            "--type=merge",
            "-p",
            r#"{"status":{"phase":"Capturing"}}"#,
        ],
    )
    .await?;
    ensure!(
        stderr.contains("is invalid")
            && stderr.contains("status.phase: the Snapshot is Ready; that phase is final"),
        "kubectl patch of the status said {stderr:?}"
    );
    let after = api.get("kept-cp1").await?;
    ensure!(
        after.metadata.resource_version == before.metadata.resource_version
            && after.spec
                == SnapshotSpec {
                    source: SnapshotSource {
                        run: ObjectReference {
                            name: "kept".into(),
                            uid: None,
                        },
                    },
                    reason: None,
                },
        "a refused patch changed the Snapshot: {after:?}"
    );
    Ok(())
}

/// The Kustomize install's directory in this repository.
fn deploy_dir(part: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(part)
}

/// Issue 17: `kubectl apply -k deploy/` against the embedded API server succeeds or fails as
/// against a cluster: every object of the install is created (CRDs stored as objects while
/// Runs stay served), a second apply changes nothing, an unknown field or a wrong type in
/// a Deployment is refused by name and creates nothing, and the cert-manager part fails
/// where cert-manager is not installed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_k_installs_the_kustomize_install_as_a_cluster_would() -> Result<()> {
    let server = Server::start()?;
    let install = deploy_dir("");
    let install = path_str(&install)?;
    let out = kubectl_ok(&server, &["apply", "-k", install]).await?;
    for created in [
        "customresourcedefinition.apiextensions.k8s.io/runs.kruntimes.io created",
        "service/kruntimes-gateway created",
        "deployment.apps/kruntimes-controller-manager created",
        "deployment.apps/kruntimes-gateway created",
        "poddisruptionbudget.policy/kruntimes-gateway created",
        "networkpolicy.networking.k8s.io/default-deny created",
    ] {
        ensure!(
            out.contains(created),
            "the install did not say {created:?}:\n{out}"
        );
    }
    let names = kubectl_ok(
        &server,
        &[
            "get",
            "deployments,services,poddisruptionbudgets,networkpolicies",
            "-n",
            "kruntimes-system",
            "-o",
            "jsonpath={range .items[*]}{.kind}/{.metadata.name} {end}",
        ],
    )
    .await?;
    let mut names: Vec<&str> = names.split_whitespace().collect();
    names.sort_unstable();
    ensure!(
        names
            == [
                "Deployment/kruntimes-controller-manager",
                "Deployment/kruntimes-gateway",
                "NetworkPolicy/default-deny",
                "NetworkPolicy/dns-and-api-server-egress",
                "NetworkPolicy/kruntimes-controller-manager",
                "NetworkPolicy/kruntimes-gateway",
                "PodDisruptionBudget/kruntimes-controller-manager",
                "PodDisruptionBudget/kruntimes-gateway",
                "Service/kruntimes-gateway",
            ],
        "kruntimes-system holds {names:?}"
    );
    // The stored CRD does not replace the served kind.
    kubectl_ok(&server, &["get", "runs", "-A"]).await?;
    let again = kubectl_ok(&server, &["apply", "-k", install]).await?;
    for unchanged in [
        "deployment.apps/kruntimes-gateway unchanged",
        "service/kruntimes-gateway unchanged",
        "customresourcedefinition.apiextensions.k8s.io/runs.kruntimes.io unchanged",
    ] {
        ensure!(
            again.contains(unchanged),
            "a second apply did not say {unchanged:?}:\n{again}"
        );
    }

    // The rendered gateway Deployment under another name, broken two ways.
    let rendered = kubectl_ok(&server, &["kustomize", install]).await?;
    let start = rendered
        .find("kind: Deployment")
        .and_then(|at| rendered[..at].rfind("---\n").map(|dash| dash + 4))
        .context("no Deployment in the render")?;
    let end = rendered[start..]
        .find("\n---\n")
        .map_or(rendered.len(), |at| start + at + 1);
    let deployment = rendered[start..end].replace(
        "name: kruntimes-controller-manager\n  namespace",
        "name: broken\n  namespace",
    );
    ensure!(deployment.contains("name: broken\n"), "{deployment}");
    let manifests = Manifests::new()?;
    let unknown = manifests.write(
        "unknown.yaml",
        &deployment.replacen(
            "readOnlyRootFilesystem: true\n",
            "readOnlyRootFilesystem: true\n          bogusField: 1\n",
            1,
        ),
    )?;
    let err = kubectl_err(&server, &["apply", "-f", path_str(&unknown)?]).await?;
    ensure!(
        err.contains(
            "strict decoding error: unknown field \
             \"spec.template.spec.containers[0].securityContext.bogusField\""
        ),
        "{err}"
    );
    let wrong_type = manifests.write(
        "wrong-type.yaml",
        &deployment.replacen("replicas: 2\n", "replicas: two\n", 1),
    )?;
    let err = kubectl_err(&server, &["apply", "-f", path_str(&wrong_type)?]).await?;
    ensure!(
        err.contains("The Deployment \"broken\" is invalid")
            && err.contains("does not decode as a Deployment: invalid type: string \"two\""),
        "{err}"
    );
    let missing = kubectl_err(
        &server,
        &["get", "deployment", "broken", "-n", "kruntimes-system"],
    )
    .await?;
    ensure!(missing.contains("not found"), "{missing}");

    let cert_manager = deploy_dir("cert-manager");
    let err = kubectl_err(&server, &["apply", "-k", path_str(&cert_manager)?]).await?;
    ensure!(
        err.contains("could not find the requested resource")
            || err.contains("no matches for kind"),
        "{err}"
    );
    Ok(())
}

/// `kubectl get workspaces` prints the Workspace's columns; a bad `spec.history` is refused
/// with 422; a session Run that mounts a Workspace must be named after it, and a second
/// Run of that name is refused (the lock) by the API server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workspaces_are_listed_bounded_and_locked_by_name() -> Result<()> {
    let server = Server::start()?;
    let manifests = Manifests::new()?;
    let file = manifests.write(
        "workspace.yaml",
        "apiVersion: kruntimes.io/v1alpha1
kind: Workspace
metadata:
  name: proj
spec:
  history: 3
",
    )?;
    kubectl_ok(&server, &["apply", "-f", path_str(&file)?]).await?;
    let rows = table(&kubectl_ok(&server, &["get", "ws"]).await?);
    ensure!(
        rows.first()
            .is_some_and(|h| h[..4] == ["NAME", "HEAD", "COMMITS", "LAST-USED"]),
        "{rows:?}"
    );
    ensure!(
        row(&rows, "proj")?[1..4] == ["<none>", "0", "<none>"],
        "{rows:?}"
    );
    let stderr = kubectl_err(
        &server,
        &[
            "patch",
            "workspace",
            "proj",
            "--type=merge",
            "-p",
            r#"{"spec":{"history":0}}"#,
        ],
    )
    .await?;
    ensure!(
        stderr.contains("is invalid") && stderr.contains("spec.history"),
        "kubectl patch of the history said {stderr:?}"
    );

    let session = |name: &str| {
        format!(
            "apiVersion: kruntimes.io/v1alpha1
kind: Run
metadata:
  name: {name}
spec:
  runtime: none
  mode:
    session:
      class: Dev
  workspace:
    name: proj
"
        )
    };
    let other = manifests.write("other.yaml", &session("other"))?;
    let stderr = kubectl_err(&server, &["create", "-f", path_str(&other)?]).await?;
    ensure!(
        stderr.contains("spec.workspace.name") && stderr.contains("named after it"),
        "a Run named otherwise: {stderr:?}"
    );
    let held = manifests.write("held.yaml", &session("proj"))?;
    kubectl_ok(&server, &["create", "-f", path_str(&held)?]).await?;
    let stderr = kubectl_err(&server, &["create", "-f", path_str(&held)?]).await?;
    ensure!(
        stderr.contains("AlreadyExists") || stderr.contains("already exists"),
        "a second Run of the Workspace: {stderr:?}"
    );
    Ok(())
}

/// A ConfigMap `name`, owned by the objects `owners` names (kind, name, UID).
fn owned_config_map(
    name: &str,
    owners: &[(&str, &str, &str)],
) -> k8s_openapi::api::core::v1::ConfigMap {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
    k8s_openapi::api::core::v1::ConfigMap {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_string()),
            owner_references: Some(
                owners
                    .iter()
                    .map(|(kind, name, uid)| OwnerReference {
                        api_version: "v1".to_string(),
                        kind: kind.to_string(),
                        name: name.to_string(),
                        uid: uid.to_string(),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Owner references are collected as on a cluster (background propagation): deleting an
/// owner deletes its dependents (a dependent with a finalizer is marked and waits for it),
/// one whose owner never existed is collected, one with an owner left keeps living, and
/// `kubectl delete --cascade=orphan` leaves the dependents without the reference.
#[tokio::test]
async fn owner_references_are_garbage_collected_and_orphan_deletes_keep_dependents() -> Result<()> {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::ResourceExt;
    let (server, client) = Server::start_async(kruntimes_testkit::Options::default()).await?;
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let post = kube::api::PostParams::default();
    let made = |name: &str| owned_config_map(name, &[]);
    let owner = maps.create(&post, &made("owner")).await?;
    let other = maps.create(&post, &made("other")).await?;
    let (owner_uid, other_uid) = (owner.uid().context("uid")?, other.uid().context("uid")?);
    let dependent = maps
        .create(
            &post,
            &owned_config_map("dependent", &[("ConfigMap", "owner", &owner_uid)]),
        )
        .await?;
    let mut held = owned_config_map("held", &[("ConfigMap", "owner", &owner_uid)]);
    held.metadata.finalizers = Some(vec!["example.com/hold".to_string()]);
    let held = maps.create(&post, &held).await?;
    let shared = maps
        .create(
            &post,
            &owned_config_map(
                "shared",
                &[
                    ("ConfigMap", "owner", &owner_uid),
                    ("ConfigMap", "other", &other_uid),
                ],
            ),
        )
        .await?;

    // The owner goes: its only dependent goes, the held one is marked, the shared one
    // keeps its other owner.
    kubectl_ok(&server, &["delete", "configmap", "owner"]).await?;
    kruntimes_testkit::deleted(
        &maps,
        "dependent",
        &dependent.uid().context("uid")?,
        KUBECTL_DEADLINE,
    )
    .await?;
    kruntimes_testkit::within(KUBECTL_DEADLINE, "the held dependent is marked", async {
        await_condition(maps.clone(), "held", |m: Option<&ConfigMap>| {
            m.is_some_and(|m| m.metadata.deletion_timestamp.is_some())
        })
        .await?;
        Ok(())
    })
    .await?;
    let patch = serde_json::json!({"metadata": {"finalizers": null}});
    maps.patch("held", &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    kruntimes_testkit::deleted(&maps, "held", &held.uid().context("uid")?, KUBECTL_DEADLINE)
        .await?;

    // One created naming an owner that does not exist is collected.
    let ghost = maps
        .create(
            &post,
            &owned_config_map("ghost", &[("ConfigMap", "never", "no-such-uid")]),
        )
        .await?;
    kruntimes_testkit::deleted(
        &maps,
        "ghost",
        &ghost.uid().context("uid")?,
        KUBECTL_DEADLINE,
    )
    .await?;
    ensure!(
        maps.get_opt("shared").await?.is_some(),
        "the dependent with an owner left was collected"
    );

    // An orphaning delete leaves the dependents, without the reference.
    let kept = maps
        .create(
            &post,
            &owned_config_map("kept", &[("ConfigMap", "other", &other_uid)]),
        )
        .await?;
    kubectl_ok(
        &server,
        &["delete", "configmap", "other", "--cascade=orphan"],
    )
    .await?;
    kruntimes_testkit::deleted(&maps, "other", &other_uid, KUBECTL_DEADLINE).await?;
    // The collector sees changes in order: once a later owner's dependent is collected,
    // it has seen the orphaning delete.
    let last = maps.create(&post, &made("last")).await?;
    let last_uid = last.uid().context("uid")?;
    let marker = maps
        .create(
            &post,
            &owned_config_map("marker", &[("ConfigMap", "last", &last_uid)]),
        )
        .await?;
    maps.delete("last", &Default::default()).await?;
    kruntimes_testkit::deleted(
        &maps,
        "marker",
        &marker.uid().context("uid")?,
        KUBECTL_DEADLINE,
    )
    .await?;
    let now = maps.get("kept").await?;
    ensure!(
        now.uid() == kept.uid()
            && now.metadata.deletion_timestamp.is_none()
            && now.owner_references().is_empty(),
        "the orphaned dependent: {now:?}"
    );
    // The shared one lost its reference to the orphaning owner; the owner it still names
    // is gone, so it is collected now, as on a cluster.
    kruntimes_testkit::deleted(
        &maps,
        "shared",
        &shared.uid().context("uid")?,
        KUBECTL_DEADLINE,
    )
    .await?;

    // A policy that is none of the three is refused, and nothing is deleted.
    let request = http::Request::delete("/api/v1/namespaces/default/configmaps/kept")
        .header("content-type", "application/json")
        .body(br#"{"propagationPolicy":"Sideways"}"#.to_vec())?;
    let refused = client
        .request_text(request)
        .await
        .expect_err("an unknown propagation policy");
    ensure!(
        matches!(&refused, kube::Error::Api(s) if s.code == 400 && s.message.contains("Sideways")),
        "{refused:?}"
    );
    ensure!(maps.get_opt("kept").await?.is_some(), "deleted anyway");
    Ok(())
}
