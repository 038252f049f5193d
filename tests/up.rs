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
