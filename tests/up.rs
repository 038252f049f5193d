//! `kruntimes up` as a program: what it does with its data directory and its defaults.
//! Each test starts the real binary on ephemeral ports in a temporary directory.

use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use kruntimes_client::Connection;
use kruntimes_client::sandbox::{AcquireOptions, ReleaseOptions};
use kruntimes_client::session::{Command as SessionCommand, Operation, OperationState};
use kruntimes_testkit::{Options, Server, kruntimes_bin};

/// How long a refused second start may take to exit.
const REFUSE_DEADLINE: Duration = Duration::from_secs(30);

/// Issue 15 item 7: a second `kruntimes up` on the same data directory with other ports
/// started, overwrote the kubeconfig and left the first unreachable. Now it fails at once,
/// naming the holder's PID, and the first keeps serving with its kubeconfig untouched.
#[tokio::test]
async fn a_second_up_on_the_same_data_directory_fails_naming_the_holder() -> Result<()> {
    let first = tokio::task::spawn_blocking(|| Server::start_with(Options::default())).await??;
    let first_pid = first.pid().context("the first server runs")?;
    let kubeconfig_before = std::fs::read(first.kubeconfig_path())?;

    let mut second = Command::new(kruntimes_bin()?)
        .arg("up")
        .arg("--data-dir")
        .arg(first.data_dir())
        .args(["--apiserver-addr", "127.0.0.1:0", "--apiserver-only"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("spawn the second kruntimes up")?;
    let second_pid = second.id();
    let stdout = second.stdout.take().context("stdout is piped")?;
    let stderr = second.stderr.take().context("stderr is piped")?;
    let (done, exited) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let read = |mut pipe: Box<dyn std::io::Read + Send>| {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        };
        let out = std::thread::spawn(move || read(Box::new(stdout)));
        let err = read(Box::new(stderr));
        let out = out.join().unwrap_or_default();
        let status = second.wait();
        let _ = done.send((status, out, err));
    });
    let (status, out, err) = match exited.recv_timeout(REFUSE_DEADLINE) {
        Ok(result) => result,
        Err(_) => {
            // It started instead of refusing: end it (this test started it) and fail.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(second_pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            let _ = waiter.join();
            bail!("the second kruntimes up did not exit within {REFUSE_DEADLINE:?}");
        }
    };
    let _ = waiter.join();
    let status = status?;
    ensure!(
        !status.success(),
        "the second kruntimes up succeeded: {out}{err}"
    );
    ensure!(
        err.contains(&format!("PID {first_pid}")) && err.contains("in use"),
        "the refusal does not name the holder's PID {first_pid}: {err}"
    );
    ensure!(
        !out.contains(kruntimes_testkit::READY_PREFIX),
        "the second kruntimes up served: {out}"
    );
    ensure!(
        std::fs::read(first.kubeconfig_path())? == kubeconfig_before,
        "the second kruntimes up changed the kubeconfig"
    );
    // The first still answers through its kubeconfig.
    let client = first.client().await?;
    client
        .apiserver_version()
        .await
        .context("the first server answers after the refused start")?;
    Ok(())
}

/// Issue 15 item 8: `kruntimes up` did not pass runtimed's session limits to its workers,
/// and a session command whose timeout exceeded the cap was accepted and then died at the
/// cap. With `--session-max-operation-timeout 2` the workers' cap is 2 s: a command that
/// asks for 10 s is refused at once (400) with a message that names the cap; one within it
/// runs.
#[tokio::test]
async fn session_limits_reach_the_workers_and_a_timeout_above_the_cap_is_refused() -> Result<()> {
    let mut options = Options::full();
    options.extra_args = vec![
        "--session-max-operation-timeout".into(),
        "2".into(),
        "--session-max-queue".into(),
        "4".into(),
        "--session-close-timeout".into(),
        "20".into(),
    ];
    let (server, _client) = Server::start_async(options).await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection
        .runtime("bash")
        .acquire_sandbox(&AcquireOptions::default())
        .await?;
    let mut session = sandbox.open_session().await?;
    let refused = session
        .send(
            &Operation::command(SessionCommand::argv(["true"]))
                .with_timeout(Duration::from_secs(10)),
        )
        .await;
    let error = match refused {
        Ok(id) => bail!("an operation of 10 s was accepted ({id}) under a cap of 2 s"),
        Err(error) => error,
    };
    ensure!(error.status() == Some(400), "{error:?}");
    let message = error.to_string();
    ensure!(
        message.contains("10s") && message.contains("cap of 2s"),
        "the refusal does not name the cap: {message}"
    );
    let within_cap = session
        .run(
            &Operation::command(SessionCommand::argv(["true"]))
                .with_timeout(Duration::from_secs(2)),
            |_, _| {},
        )
        .await?;
    ensure!(
        within_cap.state == OperationState::Succeeded,
        "{within_cap:?}"
    );
    // The other limits reached the worker's runtimed too: its command line carries them.
    let runtimeds = kruntimes_testkit::procs::matching(|p| {
        p.cmdline.contains(" runtimed ")
            && p.cmdline.contains(&server.data_dir().display().to_string())
    });
    ensure!(!runtimeds.is_empty(), "no runtimed of this server found");
    for runtimed in &runtimeds {
        for flag in [
            "--session-max-operation-timeout 2",
            "--session-max-queue 4",
            "--session-close-timeout 20",
        ] {
            ensure!(
                runtimed.cmdline.contains(flag),
                "runtimed {} lacks {flag}: {}",
                runtimed.pid,
                runtimed.cmdline
            );
        }
    }
    drop(session);
    sandbox.release(ReleaseOptions::default()).await?;
    Ok(())
}

/// Issue 14 item 7: each SIGKILLed incarnation's worker `root/` (workspaces, outputs)
/// survived every later restart, and the empty `kruntimes/rs-*` cgroup parents of its
/// runtime servers stayed forever. A start removes them, keeps the logs of finished Runs,
/// and says what it removed.
#[tokio::test]
async fn a_start_removes_what_a_sigkilled_incarnation_left_and_says_so() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let data_dir = tmp.path().join("data");
    let options = Options {
        data_dir: Some(data_dir.clone()),
        ..Options::full()
    };
    let (mut server, client) = Server::start_async(options).await?;
    // A finished task leaves a workspace, outputs and logs in its worker's root.
    let runs = kube::Api::<kruntimes_api::Run>::namespaced(client, "default");
    let run: kruntimes_api::Run = serde_json::from_value(serde_json::json!({
        "apiVersion": "kruntimes.io/v1alpha1", "kind": "Run", "metadata": {"name": "left"},
        "spec": {"runtime": "bash", "mode": {"task": {}}, "source": {"inline": "echo kept-log\necho a=b >> \"$KRUNTIME_OUTPUTS\"\n"}}
    }))?;
    runs.create(&kube::api::PostParams::default(), &run).await?;
    kruntimes_testkit::within(Duration::from_secs(60), "the task ends", async {
        let cond = kube::runtime::wait::await_condition(
            runs.clone(),
            "left",
            |r: Option<&kruntimes_api::Run>| r.is_some_and(|r| r.phase().is_terminal()),
        );
        cond.await.context("watch the Run")?;
        Ok(())
    })
    .await?;
    let workers: Vec<std::path::PathBuf> = std::fs::read_dir(data_dir.join("workers"))?
        .flatten()
        .map(|e| e.path())
        .collect();
    ensure!(!workers.is_empty(), "no worker directories");
    let mut cgroups = Vec::new();
    for worker in &workers {
        let root = worker.join("root").canonicalize()?;
        // Where cgroup v2 is usable, each runtime server made its parent there.
        if let Ok(parent) = kruntimes_runtime_server::sandbox::cgroup::default_parent_path(&root) {
            ensure!(
                parent.is_dir(),
                "no cgroup parent {} of {}",
                parent.display(),
                root.display()
            );
            cgroups.push(parent);
        }
    }
    let workspaces = files_named(&data_dir.join("workers"), "work");
    ensure!(!workspaces.is_empty(), "the task left no workspace");
    // Task logs go to the log store, outside every root (tests/log_store.rs).
    let logs = files_named(&data_dir.join("logs"), "stdout.log");
    ensure!(!logs.is_empty(), "the task left no log in the log store");

    // A SIGKILL of everything, workers included: a runtime server that ends cleanly removes
    // its own cgroup parent, a SIGKILLed one cannot. `kruntimes up` is stopped first, so its
    // provisioner cannot replace a killed worker (cleaning its root, starting another
    // runtime server on it) before it is killed too; under load it did.
    let up = nix::unistd::Pid::from_raw(i32::try_from(server.pid().context("the server runs")?)?);
    nix::sys::signal::kill(up, nix::sys::signal::Signal::SIGSTOP)?;
    for worker in &workers {
        for proc in kruntimes_testkit::procs::mentioning(&worker.display().to_string()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(proc.pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    server.kill()?;
    ensure!(
        cgroups.iter().all(|c| c.exists()),
        "the SIGKILLed runtime servers' cgroups are gone before the restart: {cgroups:?}"
    );
    // Wait until none of the workers runs (a SIGKILLed process may not be reaped yet).
    kruntimes_testkit::within(Duration::from_secs(30), "the killed workers end", async {
        loop {
            let alive = workers.iter().any(|w| {
                !kruntimes_testkit::procs::mentioning(&w.display().to_string()).is_empty()
            });
            if !alive {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await?;

    // The restart, with its log lines piped (this test starts and ends it).
    let data = data_dir.clone();
    let (out, err) = tokio::task::spawn_blocking(move || restart_and_stop(&data)).await??;
    let line = err
        .lines()
        .find(|l| l.contains("removed what a dead incarnation left"))
        .with_context(|| format!("the restart did not say what it removed:\n{err}\n{out}"))?;
    // The roots that held the task's workspace are listed; a worker that ran nothing may
    // have had an empty root (under gvisor an idle runtime server writes none), so what is
    // asserted of every root is that nothing but logs is left in it.
    for worker in &workers {
        let root = worker.join("root");
        if workspaces.iter().any(|w| w.starts_with(&root)) {
            ensure!(
                line.contains(&root.display().to_string()),
                "the line does not list {}: {line}",
                root.display()
            );
        }
        let left = not_logs(&root);
        ensure!(left.is_empty(), "{} still holds {left:?}", root.display());
    }
    for cgroup in &cgroups {
        ensure!(
            !cgroup.exists(),
            "the cgroup {} is still there",
            cgroup.display()
        );
        ensure!(
            line.contains(&cgroup.display().to_string()),
            "the line does not list the cgroup {}: {line}",
            cgroup.display()
        );
    }
    for workspace in &workspaces {
        ensure!(
            !workspace.exists(),
            "the workspace {} is still there",
            workspace.display()
        );
    }
    for log in &logs {
        ensure!(
            log.exists(),
            "the log {} of a finished Run went",
            log.display()
        );
    }
    ensure!(
        files_named(&data_dir.join("workers"), "outputs").is_empty(),
        "an outputs file is still there"
    );
    Ok(())
}

/// Every file beneath `dir` that is not a `*.log` file (directories are not counted).
fn not_logs(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            found.extend(not_logs(&path));
        } else if path.extension().is_none_or(|e| e != "log") {
            found.push(path);
        }
    }
    found
}

/// Every path beneath `dir` whose file name is `name`.
fn files_named(dir: &std::path::Path, name: &str) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.file_name().is_some_and(|n| n == name) {
            found.push(path.clone());
        }
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            found.extend(files_named(&path, name));
        }
    }
    found
}

/// Starts `kruntimes up --apiserver-only` on `data_dir` with info logs, waits until it
/// serves, stops it with SIGTERM and returns what it printed (stdout, stderr).
fn restart_and_stop(data_dir: &std::path::Path) -> Result<(String, String)> {
    use std::io::{BufRead, BufReader, Read};
    let mut child = Command::new(kruntimes_bin()?)
        .arg("up")
        .arg("--data-dir")
        .arg(data_dir)
        .args(["--apiserver-addr", "127.0.0.1:0", "--apiserver-only"])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("spawn the restart")?;
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let stdout = child.stdout.take().context("stdout is piped")?;
    let mut stderr = child.stderr.take().context("stderr is piped")?;
    let err_reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let (ready, seen) = mpsc::channel();
    let out_reader = std::thread::spawn(move || {
        let mut text = String::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.starts_with(kruntimes_testkit::READY_PREFIX) {
                let _ = ready.send(());
            }
            text.push_str(&line);
            text.push('\n');
        }
        text
    });
    let served = seen.recv_timeout(Duration::from_secs(60)).is_ok();
    let signal = if served {
        nix::sys::signal::Signal::SIGTERM
    } else {
        nix::sys::signal::Signal::SIGKILL
    };
    let _ = nix::sys::signal::kill(pid, signal);
    let _ = child.wait();
    let out = out_reader.join().unwrap_or_default();
    let err = err_reader.join().unwrap_or_default();
    ensure!(served, "the restart did not serve:\n{out}\n{err}");
    Ok((out, err))
}

/// Issue 17 item 1: `kruntimes apiserver` runs the embedded API server alone on its locked
/// data directory, writes `DATA_DIR/kubeconfig` (the real kubectl reaches it with that,
/// CRDs served), refuses a second process on the same directory, and stops with exit code 0
/// on SIGTERM.
#[tokio::test]
async fn the_apiserver_command_serves_alone_and_stops_on_sigterm() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let data_dir = dir.path().join("data");
    let mut child = Command::new(kruntimes_bin()?)
        .args(["apiserver", "--addr", "127.0.0.1:0", "--data-dir"])
        .arg(&data_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("spawn kruntimes apiserver")?;
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id())?);
    // Ends what this test started, whatever happens below.
    struct Reap(nix::unistd::Pid);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGKILL);
        }
    }
    let reap = Reap(pid);
    let stdout = child.stdout.take().context("stdout is piped")?;
    let (lines, seen) = mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    loop {
        let line = seen
            .recv_timeout(REFUSE_DEADLINE)
            .context("kruntimes apiserver did not say it is ready")?;
        if line == "kruntimes apiserver ready" {
            break;
        }
    }
    let kubeconfig = data_dir.join("kubeconfig");
    let out = Command::new("/usr/bin/kubectl")
        .env("KUBECONFIG", &kubeconfig)
        .env("HOME", dir.path())
        .args(["get", "runs,snapshots,runtimes", "-A"])
        .stdin(Stdio::null())
        .output()?;
    ensure!(
        out.status.success(),
        "kubectl get runs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The data directory is locked: a second one fails at once.
    let second = Command::new(kruntimes_bin()?)
        .args(["apiserver", "--addr", "127.0.0.1:0", "--data-dir"])
        .arg(&data_dir)
        .stdin(Stdio::null())
        .output()?;
    ensure!(
        !second.status.success() && String::from_utf8_lossy(&second.stderr).contains("in use"),
        "a second apiserver on the same data directory: {second:?}"
    );
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
    let (done, exited) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait());
    });
    let status = exited
        .recv_timeout(REFUSE_DEADLINE)
        .context("kruntimes apiserver did not stop within 30 s of SIGTERM")??;
    std::mem::forget(reap);
    ensure!(status.success(), "kruntimes apiserver exited {status}");
    Ok(())
}
