//! krt against the whole system of `kruntimes up` (controller-manager, workers, gateway,
//! the default `bash` and `python` Runtimes): real programs, real exit codes and output.
//! krt finds the gateway through the kubeconfig's `kruntimes.io/gateway` extension.
//! Needs `cargo build -p kruntimes` first.

use std::process::Output;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kruntimes_api::{Phase, Run};
use kruntimes_testkit::{Options, Server};
use kube::api::Api;

async fn krt(server: &Server, args: &[&str]) -> Result<Output> {
    let mut cmd = server.krt()?;
    cmd.env_remove("KRT_GATEWAY").args(args);
    let mut cmd = tokio::process::Command::from(cmd);
    cmd.kill_on_drop(true);
    tokio::time::timeout(Duration::from_secs(90), cmd.output())
        .await
        .with_context(|| format!("krt {args:?} did not finish within 90 s"))?
        .context("run krt")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn code(out: &Output) -> i32 {
    out.status.code().unwrap_or(-1)
}

fn describe(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status.code(),
        text(&out.stdout),
        text(&out.stderr)
    )
}

fn created_name(out: &Output) -> Result<String> {
    let stdout = text(&out.stdout);
    match stdout
        .trim()
        .strip_prefix("run/")
        .and_then(|s| s.strip_suffix(" created"))
    {
        Some(name) => Ok(name.to_string()),
        None => bail!("krt run printed no name: {}", describe(out)),
    }
}

async fn eventually<F, Fut>(deadline: Duration, what: &str, check: F) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let give_up = tokio::time::Instant::now() + deadline;
    loop {
        if check().await? {
            return Ok(());
        }
        if tokio::time::Instant::now() > give_up {
            bail!("{what}: not within {deadline:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_wait_exit_codes_and_output() -> Result<()> {
    let (server, _client) = Server::start_async(Options::full()).await?;
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("script.py");
    std::fs::write(
        &script,
        "import sys\nprint('args', sys.argv[1:])\nprint('to stderr', file=sys.stderr)\nsys.exit(3)\n",
    )?;
    let script = script.to_string_lossy().into_owned();
    let out = krt(
        &server,
        &[
            "run",
            "--runtime",
            "python",
            "--file",
            &script,
            "--wait",
            "--",
            "a",
            "b",
        ],
    )
    .await?;
    assert_eq!(code(&out), 3, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "args ['a', 'b']\n", "{}", describe(&out));
    assert_eq!(text(&out.stderr), "to stderr\n", "{}", describe(&out));

    let out = krt(
        &server,
        &[
            "run",
            "--runtime",
            "bash",
            "--wait",
            "-e",
            "GREETING=hello",
            "--",
            "bash",
            "-c",
            "echo $GREETING; echo oops >&2",
        ],
    )
    .await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "hello\n", "{}", describe(&out));
    assert_eq!(text(&out.stderr), "oops\n", "{}", describe(&out));

    let out = krt(
        &server,
        &[
            "run",
            "--runtime",
            "bash",
            "--wait",
            "--timeout",
            "1s",
            "--",
            "bash",
            "-c",
            "echo started; sleep 30",
        ],
    )
    .await?;
    assert_eq!(code(&out), 124, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "started\n", "{}", describe(&out));
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with("krt: run bash-") && stderr.contains(" Timeout"),
        "{}",
        describe(&out)
    );

    // A program that exits 0 but writes invalid outputs fails, and krt says why.
    let out = krt(
        &server,
        &[
            "run",
            "--runtime",
            "bash",
            "--wait",
            "--",
            "bash",
            "-c",
            "echo 'no equals sign' >> \"$KRUNTIME_OUTPUTS\"",
        ],
    )
    .await?;
    assert_eq!(code(&out), 1, "{}", describe(&out));
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with("krt: run bash-") && stderr.contains(" Failed: OutputsInvalid"),
        "{}",
        describe(&out)
    );
    assert_eq!(stderr.lines().count(), 1, "{}", describe(&out));

    // Killed by a signal: no exit code, so 1 and a reason.
    let out = krt(
        &server,
        &[
            "run",
            "--runtime",
            "bash",
            "--wait",
            "--",
            "bash",
            "-c",
            "kill -9 $$",
        ],
    )
    .await?;
    assert_eq!(code(&out), 1, "{}", describe(&out));
    assert!(
        text(&out.stderr).contains(" Failed: "),
        "{}",
        describe(&out)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_follow_get_and_cancel() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let runs: Api<Run> = Api::default_namespaced(client);

    let out = krt(
        &server,
        &[
            "run",
            "--runtime",
            "bash",
            "--",
            "bash",
            "-c",
            "for i in 1 2 3; do echo line $i; sleep 0.2; done",
        ],
    )
    .await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    let name = created_name(&out)?;
    let out = krt(&server, &["logs", "-f", &name]).await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    assert_eq!(
        text(&out.stdout),
        "line 1\nline 2\nline 3\n",
        "{}",
        describe(&out)
    );
    let out = krt(&server, &["wait", &name, "--timeout", "60s"]).await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    assert_eq!(text(&out.stdout), format!("run/{name} Succeeded\n"));
    let out = krt(&server, &["logs", &name]).await?;
    assert_eq!(
        text(&out.stdout),
        "line 1\nline 2\nline 3\n",
        "{}",
        describe(&out)
    );

    let out = krt(&server, &["get", "runs"]).await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    let table = text(&out.stdout);
    let row = table
        .lines()
        .find(|l| l.starts_with(&format!("{name} ")))
        .with_context(|| format!("no row for {name} in\n{table}"))?;
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(&cells[1..4], ["bash", "Succeeded", "0"], "{table}");

    let out = krt(&server, &["runtime", "list"]).await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    let table = text(&out.stdout);
    assert!(
        table.lines().any(|l| l.starts_with("bash "))
            && table.lines().any(|l| l.starts_with("python ")),
        "{table}"
    );

    let out = krt(
        &server,
        &[
            "run",
            "--runtime",
            "bash",
            "--name",
            "sleeper",
            "--",
            "bash",
            "-c",
            "echo up; sleep 60",
        ],
    )
    .await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    eventually(Duration::from_secs(60), "sleeper runs", || async {
        Ok(runs.get("sleeper").await?.phase() == Phase::Running)
    })
    .await?;
    let out = krt(&server, &["cancel", "sleeper"]).await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "run/sleeper cancel requested\n");
    let out = krt(&server, &["wait", "sleeper", "--timeout", "60s"]).await?;
    assert_eq!(code(&out), 130, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "run/sleeper Cancelled\n");
    let out = krt(&server, &["delete", "sleeper"]).await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    Ok(())
}
