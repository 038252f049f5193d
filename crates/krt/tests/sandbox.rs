//! `krt sandbox` against the whole system of `kruntimes up`: a real session Run on the
//! default `bash` Runtime, its commands and files through the real gateway (WebSocket and
//! HTTP), verified with the CA bundle the Run publishes, then released.
//!
//! The tests wait on conditions under deadlines (a command's own output says it started);
//! they never sleep to synchronise. Needs `cargo build -p kruntimes
//! -p kruntimes-runtime-server -p krt` first.

use std::process::Stdio;

use anyhow::{Context, Result};
use kruntimes_api::Phase;
use kruntimes_testkit::{Options, Server, within};
use tokio::io::{AsyncBufReadExt, BufReader};

mod common;
use common::{DEADLINE, code, describe, krt, krt_cmd, krt_exits, krt_fails, krt_ok, runs, text};

/// `krt sandbox create ARGS…`: the new sandbox's name, its last line.
async fn create(server: &Server, args: &[&str]) -> Result<String> {
    let mut all = vec!["sandbox", "create"];
    all.extend_from_slice(args);
    let out = krt_ok(server, &all).await?;
    text(&out.stdout)
        .lines()
        .last()
        .map(str::to_string)
        .with_context(|| format!("create printed no name: {}", describe(&out)))
}

/// The table rows of `krt sandbox ls`, split into cells.
fn rows(table: &str) -> Vec<Vec<String>> {
    table
        .lines()
        .map(|line| line.split_whitespace().map(str::to_string).collect())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_runs_commands_keeps_files_and_is_released() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let name = create(&server, &["--runtime", "bash", "--lease-timeout", "5m"]).await?;
    let run = runs(&client).get(&name).await?;
    assert_eq!(run.phase(), Phase::Ready, "{:?}", run.status);
    let session = run.spec.mode.session.as_ref().context("session mode")?;
    assert_eq!(session.lease_timeout_seconds, Some(300));

    // sh: output on both streams, and the command's exit code.
    let out = krt_exits(
        &server,
        &[
            "sandbox",
            "sh",
            &name,
            "echo out; echo err >&2; echo state > kept.txt; exit 3",
        ],
        3,
    )
    .await?;
    assert_eq!(text(&out.stdout), "out\n", "{}", describe(&out));
    assert_eq!(text(&out.stderr), "err\n", "{}", describe(&out));

    // exec: argv runs directly, in the same workspace, with its environment and cwd.
    let out = krt_ok(
        &server,
        &[
            "sandbox",
            "exec",
            &name,
            "-e",
            "GREETING=hi",
            "--",
            "bash",
            "-c",
            "cat kept.txt; echo $GREETING",
        ],
    )
    .await?;
    assert_eq!(text(&out.stdout), "state\nhi\n", "{}", describe(&out));

    // A command that runs out of time exits 124; one that cannot start exits 1 and says why.
    let out = krt_exits(
        &server,
        &["sandbox", "sh", &name, "--timeout", "1s", "sleep 60"],
        124,
    )
    .await?;
    assert!(text(&out.stderr).contains("TimedOut"), "{}", describe(&out));
    krt_fails(
        &server,
        &["sandbox", "exec", &name, "--", "/no/such/program"],
        "StartFailed",
    )
    .await?;

    // put and cat: bytes both ways, the executable bit kept.
    let dir = tempfile::tempdir()?;
    let local = dir.path().join("tool.sh");
    std::fs::write(&local, "#!/bin/sh\necho from the tool\n")?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&local, std::fs::Permissions::from_mode(0o755))?;
    }
    let local = local.to_str().context("a UTF-8 path")?;
    krt_ok(&server, &["sandbox", "put", &name, local, "tool.sh"]).await?;
    let out = krt_ok(&server, &["sandbox", "cat", &name, "tool.sh"]).await?;
    assert_eq!(text(&out.stdout), "#!/bin/sh\necho from the tool\n");
    let out = krt_ok(&server, &["sandbox", "exec", &name, "--", "./tool.sh"]).await?;
    assert_eq!(text(&out.stdout), "from the tool\n", "{}", describe(&out));
    krt_fails(&server, &["sandbox", "cat", &name, "missing.txt"], "404").await?;
    krt_fails(&server, &["sandbox", "cat", &name, "../outside"], "400").await?;

    // ls pages through a directory larger than one page, in byte-wise name order.
    krt_ok(
        &server,
        &[
            "sandbox",
            "sh",
            &name,
            "mkdir many && cd many && for i in $(seq 1000 2200); do : > f$i; done && mkdir sub",
        ],
    )
    .await?;
    let out = krt_ok(&server, &["sandbox", "ls", &name, "many"]).await?;
    let table = rows(&text(&out.stdout));
    assert_eq!(
        table.first().map(Vec::as_slice),
        Some(&["TYPE", "SIZE", "NAME"].map(String::from)[..])
    );
    assert_eq!(table.len(), 1 + 1201 + 1, "{}", describe(&out));
    assert_eq!(table[1], ["file", "0", "f1000"]);
    assert_eq!(table[1201], ["file", "0", "f2200"]);
    assert_eq!(table[1202], ["dir", "0", "sub/"]);
    let out = krt_ok(&server, &["sandbox", "ls", &name]).await?;
    let names: Vec<String> = rows(&text(&out.stdout))
        .into_iter()
        .skip(1)
        .filter_map(|row| row.last().cloned())
        .collect();
    assert_eq!(
        names,
        ["kept.txt", "many/", "tool.sh"],
        "{}",
        describe(&out)
    );

    // release drains: the Run ends Succeeded, then is deleted.
    let out = krt_ok(&server, &["sandbox", "release", &name]).await?;
    assert!(
        text(&out.stdout).contains("released (Succeeded)"),
        "{}",
        describe(&out)
    );
    assert!(runs(&client).get_opt(&name).await?.is_none());
    // A released sandbox is no more.
    krt_fails(
        &server,
        &["sandbox", "exec", &name, "--", "true"],
        "not found",
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_immediate_release_cancels_the_running_command() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let name = create(&server, &[]).await?;

    // A long command; its first line of output says it runs.
    let mut cmd = krt_cmd(
        &server,
        &["sandbox", "sh", &name, "echo started; sleep 600"],
    )?;
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn()?;
    let stdout = child.stdout.take().context("piped stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let first = within(DEADLINE, "the command's first line", async {
        Ok(lines.next_line().await?)
    })
    .await?;
    assert_eq!(first.as_deref(), Some("started"));

    let out = krt_ok(&server, &["sandbox", "release", &name, "--immediate"]).await?;
    assert!(
        text(&out.stdout).contains("released (Cancelled)"),
        "{}",
        describe(&out)
    );
    assert!(runs(&client).get_opt(&name).await?.is_none());

    // The command was killed: krt reports it cancelled (130) or, when the connection
    // closed before the cancellation reached it, an unknown outcome (4). Never success.
    let status = within(DEADLINE, "krt sandbox sh to end", async {
        Ok(child.wait().await?)
    })
    .await?;
    let exit = status.code().unwrap_or(-1);
    assert!(exit == 130 || exit == 4, "krt sandbox sh exited {exit}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_commands_refuse_what_is_not_a_sandbox() -> Result<()> {
    let (server, _client) = Server::start_async(Options::full()).await?;
    krt_ok(
        &server,
        &["run", "--runtime", "bash", "--name", "a-task", "--", "true"],
    )
    .await?;
    krt_fails(
        &server,
        &["sandbox", "exec", "a-task", "--", "true"],
        "is a task Run, not a sandbox",
    )
    .await?;
    krt_fails(&server, &["sandbox", "ls", "nothing-here"], "not found").await?;
    krt_fails(
        &server,
        &["sandbox", "create", "--runtime", "no-such-runtime"],
        "not found",
    )
    .await?;
    // Checked before connecting: a put of a missing file, a bad lease.
    let out = krt(&server, &["sandbox", "put", "x", "/no/such/file", "a"]).await?;
    assert_eq!(code(&out), 1, "{}", describe(&out));
    let out = krt(&server, &["sandbox", "create", "--lease-timeout", "soon"]).await?;
    assert_eq!(code(&out), 1, "{}", describe(&out));
    Ok(())
}

/// Issue 15.9: `krt sandbox put` creates missing parent directories (the README's
/// `krt sandbox put "$NAME" ./local.py app/main.py` failed with `"app/main.py" does not
/// exist`); a command's stream cut at its 1 MiB cap is reported on stderr (before, 10 MiB
/// became 1 MiB with exit 0 and no word).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_creates_parents_and_a_truncated_stream_is_reported() -> Result<()> {
    let (server, _client) = Server::start_async(Options::full()).await?;
    let name = create(&server, &[]).await?;
    let dir = tempfile::tempdir()?;
    let local = dir.path().join("local.py");
    std::fs::write(&local, "print('nested')\n")?;
    let local = local.to_str().context("a UTF-8 path")?;
    let out = krt_ok(
        &server,
        &["sandbox", "put", &name, local, "app/deep/main.py"],
    )
    .await?;
    assert_eq!(text(&out.stderr), "", "{}", describe(&out));
    let out = krt_ok(&server, &["sandbox", "cat", &name, "app/deep/main.py"]).await?;
    assert_eq!(text(&out.stdout), "print('nested')\n");
    // Into a directory that exists, and at the top: as before.
    krt_ok(&server, &["sandbox", "put", &name, local, "app/other.py"]).await?;
    krt_ok(&server, &["sandbox", "put", &name, local, "top.py"]).await?;
    // A parent that is a file is refused, and says why.
    let out = krt(&server, &["sandbox", "put", &name, local, "top.py/x"]).await?;
    assert_eq!(code(&out), 1, "{}", describe(&out));

    // 3 MiB on stdout: 1 MiB arrives, and krt says the rest was cut.
    let out = krt_ok(
        &server,
        &[
            "sandbox",
            "sh",
            &name,
            "head -c 3145728 /dev/zero | tr '\\0' x",
        ],
    )
    .await?;
    assert_eq!(out.stdout.len(), 1024 * 1024, "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("krt: the command's stdout was truncated at 1048576 bytes")
            && text(&out.stderr).contains("it wrote 3145728 bytes"),
        "{}",
        text(&out.stderr)
    );
    // Nothing is said when nothing was cut.
    let out = krt_ok(&server, &["sandbox", "sh", &name, "echo small"]).await?;
    assert_eq!(text(&out.stderr), "", "{}", describe(&out));
    Ok(())
}

/// Issue 15.9: `krt sandbox list` lists sandboxes (name, runtime, phase, age, labels),
/// `krt sandbox create --label k=v` sets labels, and `krt logs` on a sandbox says what to
/// use instead (it said `has not started on a worker yet`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_list_shows_labels_and_logs_points_to_the_sandbox_commands() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let labelled = create(
        &server,
        &[
            "--name",
            "labelled",
            "--label",
            "team=a",
            "--label",
            "purpose=ci",
        ],
    )
    .await?;
    assert_eq!(labelled, "labelled");
    let run = runs(&client).get("labelled").await?;
    let labels = run.metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels.get("team").map(String::as_str), Some("a"));
    assert_eq!(labels.get("purpose").map(String::as_str), Some("ci"));
    // On the other default Runtime: a worker that holds a session takes no other Run.
    create(&server, &["--name", "plain", "--runtime", "python"]).await?;
    // A task is not a sandbox: it is not listed (it waits for the bash worker).
    krt_ok(
        &server,
        &["run", "--runtime", "bash", "--name", "a-task", "--", "true"],
    )
    .await?;

    let out = krt_ok(&server, &["sandbox", "list"]).await?;
    let table = rows(&text(&out.stdout));
    assert_eq!(
        table.first().map(Vec::as_slice),
        Some(&["NAME", "RUNTIME", "PHASE", "AGE", "LABELS"].map(String::from)[..]),
        "{}",
        describe(&out)
    );
    let row = |name: &str| {
        table
            .iter()
            .find(|r| r.first().map(String::as_str) == Some(name))
    };
    let labelled_row = row("labelled").context("labelled listed")?;
    assert_eq!(labelled_row[1..3], ["bash", "Ready"].map(String::from));
    assert_eq!(labelled_row[4], "purpose=ci,team=a");
    let plain_row = row("plain").context("plain listed")?;
    assert_eq!(plain_row[1..3], ["python", "Ready"].map(String::from));
    assert_eq!(plain_row[4], "<none>");
    assert!(row("a-task").is_none(), "{}", describe(&out));
    let out = krt_ok(&server, &["sandbox", "list", "-l", "team=a"]).await?;
    assert_eq!(rows(&text(&out.stdout)).len(), 2, "{}", describe(&out));

    krt_fails(
        &server,
        &["logs", "labelled"],
        "run labelled is a sandbox (a session Run), which has no logs",
    )
    .await?;
    krt_fails(
        &server,
        &["logs", "-f", "labelled"],
        "krt sandbox exec labelled",
    )
    .await?;
    Ok(())
}

/// Issue 15.9: programs get a fixed, documented environment plus the Run's `env`; the
/// environment of `kruntimes up` (its PATH, any other variable) does not reach a session
/// command or a task under the default sandbox. Before, the host's PATH leaked in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_environment_of_kruntimes_up_does_not_reach_programs() -> Result<()> {
    let host_path = format!(
        "/opt/leaked-host-dir:{}",
        std::env::var("PATH").unwrap_or_default()
    );
    let options = Options {
        env: vec![
            ("KRUNTIMES_TEST_LEAK_PROBE".into(), "host-secret".into()),
            ("PATH".into(), host_path),
        ],
        ..Options::full()
    };
    let (server, _client) = Server::start_async(options).await?;
    let name = create(&server, &["-e", "FROM_RUN=run-value"]).await?;
    let out = krt_ok(&server, &["sandbox", "exec", &name, "--", "env"]).await?;
    let session_env = text(&out.stdout);
    // The worker takes the task once the session is gone.
    krt_ok(&server, &["sandbox", "release", &name]).await?;
    let task = krt_ok(
        &server,
        &[
            "run",
            "--runtime",
            "bash",
            "--wait",
            "-e",
            "FROM_RUN=run-value",
            "--",
            "env",
        ],
    )
    .await?;
    let task_env = text(&task.stdout);
    for (what, env) in [("session command", &session_env), ("task", &task_env)] {
        let vars: std::collections::BTreeMap<&str, &str> =
            env.lines().filter_map(|l| l.split_once('=')).collect();
        assert_eq!(
            vars.get("PATH").copied(),
            Some("/usr/local/bin:/usr/bin:/bin"),
            "{what}: {env}"
        );
        assert_eq!(
            vars.get("FROM_RUN").copied(),
            Some("run-value"),
            "{what}: {env}"
        );
        assert_eq!(vars.get("LANG").copied(), Some("C.UTF-8"), "{what}: {env}");
        assert!(!env.contains("host-secret"), "{what}: {env}");
        assert!(!env.contains("leaked-host-dir"), "{what}: {env}");
        // Only the documented variables: the fixed ones, the Run's, KRUNTIME_*, and what
        // the shell itself sets.
        for key in vars.keys() {
            assert!(
                [
                    "PATH", "HOME", "TMPDIR", "LANG", "FROM_RUN", "PWD", "SHLVL", "_"
                ]
                .contains(key)
                    || key.starts_with("KRUNTIME_"),
                "{what}: unexpected variable {key}: {env}"
            );
        }
    }
    Ok(())
}

/// `krt machine` (issue 20, the machines view): claim prints the lease ID last; write takes
/// standard input and makes the directories; exec passes argv as it is and exits with the
/// program's code (3, 127 with the reason, 124 on timeout); list shows the project's
/// machines; a dev machine holds its project; desktop is refused; release deletes the machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machines_are_claimed_written_run_and_released_from_the_shell() -> Result<()> {
    use tokio::io::AsyncWriteExt;
    let (server, _client) = Server::start_async(Options::full()).await?;
    let out = krt_ok(
        &server,
        &["machine", "claim", "--project", "demo", "--ttl", "10m"],
    )
    .await?;
    let lease = text(&out.stdout)
        .lines()
        .last()
        .map(str::to_string)
        .with_context(|| format!("claim printed no lease: {}", describe(&out)))?;

    let mut write = krt_cmd(&server, &["machine", "write", &lease, "src/deep/f.txt"])?;
    write
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = write.spawn()?;
    let mut stdin = child.stdin.take().context("stdin")?;
    stdin.write_all(b"from stdin\n").await?;
    drop(stdin);
    let written = within(DEADLINE, "krt machine write", async {
        Ok(child.wait_with_output().await?)
    })
    .await?;
    assert_eq!(code(&written), 0, "{}", describe(&written));

    let out = krt_ok(
        &server,
        &["machine", "exec", &lease, "--", "cat", "src/deep/f.txt"],
    )
    .await?;
    assert_eq!(text(&out.stdout), "from stdin\n");
    let out = krt_ok(
        &server,
        &["machine", "exec", &lease, "--", "echo", "; rm -rf /"],
    )
    .await?;
    assert_eq!(text(&out.stdout), "; rm -rf /\n");
    let out = krt_exits(
        &server,
        &[
            "machine",
            "exec",
            &lease,
            "-e",
            "G=hi",
            "--",
            "sh",
            "-c",
            "echo $G; exit 3",
        ],
        3,
    )
    .await?;
    assert_eq!(text(&out.stdout), "hi\n");
    let out = krt_exits(
        &server,
        &["machine", "exec", &lease, "--", "no-such-program"],
        127,
    )
    .await?;
    assert!(
        text(&out.stderr).contains("no-such-program"),
        "{}",
        describe(&out)
    );
    krt_exits(
        &server,
        &[
            "machine",
            "exec",
            &lease,
            "--timeout",
            "1s",
            "--",
            "sleep",
            "60",
        ],
        124,
    )
    .await?;

    let out = krt_ok(&server, &["machine", "list", "--project", "demo"]).await?;
    assert!(text(&out.stdout).contains(&lease), "{}", describe(&out));
    // A dev machine is named after its project, which it holds: a second claim is refused.
    let dev = krt_ok(
        &server,
        &["machine", "claim", "--class", "dev", "--project", "demo"],
    )
    .await?;
    assert_eq!(
        text(&dev.stdout).lines().last(),
        Some("demo"),
        "{}",
        describe(&dev)
    );
    krt_fails(
        &server,
        &["machine", "claim", "--class", "dev", "--project", "demo"],
        "already exists",
    )
    .await?;
    krt_ok(&server, &["machine", "release", "demo"]).await?;
    krt_fails(
        &server,
        &[
            "machine",
            "claim",
            "--class",
            "desktop",
            "--project",
            "demo",
        ],
        "display",
    )
    .await?;
    // A sandbox is not a machine.
    let sandbox = create(&server, &[]).await?;
    krt_fails(
        &server,
        &["machine", "exec", &sandbox, "--", "true"],
        "not a machine",
    )
    .await?;

    krt_ok(&server, &["machine", "release", &lease]).await?;
    // Released: asked to end and deleted, not waited for; the Run goes after its cleanup.
    let run = format!("run/{lease}");
    server.kubectl_ok(&["wait", "--for=delete", &run, "--timeout=60s"])?;
    let out = krt_ok(&server, &["machine", "list", "--project", "demo"]).await?;
    assert!(!text(&out.stdout).contains(&lease), "{}", describe(&out));
    assert!(
        text(&out.stderr).contains("No machines found"),
        "{}",
        describe(&out)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_is_forked_from_the_shell_ready_or_suspended() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let name = create(&server, &[]).await?;
    krt_ok(&server, &["sandbox", "sh", &name, "echo v1 > state.txt"]).await?;
    let out = krt_ok(&server, &["sandbox", "checkpoint", &name, "cp1"]).await?;
    assert_eq!(text(&out.stdout), "cp1\n", "{}", describe(&out));
    krt_ok(&server, &["sandbox", "sh", &name, "echo v2 > state.txt"]).await?;

    // A Ready fork (its Runtime read from the checkpoint) holds the checkpoint's file.
    let forked = create(&server, &["--from-snapshot", "cp1"]).await?;
    let out = krt_ok(&server, &["sandbox", "sh", &forked, "cat state.txt"]).await?;
    assert_eq!(text(&out.stdout), "v1\n", "{}", describe(&out));

    // Two Suspended forks: no worker, then each resumes with the file.
    let out = krt_ok(
        &server,
        &["sandbox", "fork", "cp1", "--count", "2", "--suspended"],
    )
    .await?;
    let names: Vec<String> = text(&out.stdout).lines().map(str::to_string).collect();
    assert_eq!(names.len(), 2, "{}", describe(&out));
    for fork in &names {
        let run = runs(&client).get(fork).await?;
        assert_eq!(run.phase(), Phase::Suspended, "{:?}", run.status);
        krt_ok(&server, &["sandbox", "resume", fork]).await?;
        let out = krt_ok(&server, &["sandbox", "sh", fork, "cat state.txt"]).await?;
        assert_eq!(text(&out.stdout), "v1\n", "{}", describe(&out));
    }
    // A count out of range and an unknown snapshot are refused.
    krt_exits(&server, &["sandbox", "fork", "cp1", "--count", "101"], 2).await?;
    krt_fails(
        &server,
        &["sandbox", "fork", "nope"],
        "snapshot/nope not found",
    )
    .await?;
    Ok(())
}
