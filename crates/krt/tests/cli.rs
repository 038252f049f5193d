//! krt against the whole system of `kruntimes up` (API server, controller-manager, local
//! workers, gateway, the default `bash` and `python` Runtimes): real programs, real exit
//! codes, real output through the real gateway. krt finds the gateway through the
//! kubeconfig's `kruntimes.io/gateway` extension unless a test says otherwise.
//!
//! A task that must wait for the test waits for a file the test creates (`$GO`); the test
//! never sleeps to synchronise, it waits on conditions under deadlines.
//!
//! The one stand-in is [`Relay`], a TCP relay in front of the real gateway that can cut the
//! connections it carries: see there why. Needs `cargo build --workspace --bins` first.

use std::process::{Output, Stdio};

use anyhow::{Context, Result, bail};
use kruntimes_api::{Phase, Runtime, RuntimeSpec};
use kruntimes_testkit::{Options, Server, within};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

mod common;
use common::{
    DEADLINE, code, describe, krt, krt_cmd, krt_exits, krt_fails, krt_ok, output, runs, text,
    wait_run, workspace_of,
};

/// A bash program that waits until the file `$GO` exists.
const WAIT_FOR_GO: &str = "while [ ! -e \"$GO\" ]; do sleep 0.02; done";

// ---------------------------------------------------------------------------------------
// Running krt
// ---------------------------------------------------------------------------------------

/// A krt process whose output the test reads while it runs.
struct Spawned {
    child: tokio::process::Child,
    stdout: Pipe,
    stderr: Pipe,
}

/// Everything read so far from one of krt's pipes, growing until it ends.
struct Pipe {
    seen: watch::Receiver<Vec<u8>>,
    reader: tokio::task::JoinHandle<()>,
}

impl Pipe {
    fn read(mut from: impl AsyncRead + Unpin + Send + 'static) -> Pipe {
        let (tx, seen) = watch::channel(Vec::new());
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = from.read(&mut buf).await {
                tx.send_modify(|seen| seen.extend_from_slice(&buf[..n]));
            }
        });
        Pipe { seen, reader }
    }

    /// Waits until the output contains `text`.
    async fn wait_for(&mut self, text: &str) -> Result<()> {
        let seen = &mut self.seen;
        within(DEADLINE, &format!("krt to print {text:?}"), async {
            let found = seen
                .wait_for(|bytes| String::from_utf8_lossy(bytes).contains(text))
                .await;
            if found.is_ok() {
                return Ok(());
            }
            drop(found);
            bail!(
                "the output ended without {text:?}: {:?}",
                String::from_utf8_lossy(&seen.borrow())
            )
        })
        .await
    }

    async fn finish(self) -> Vec<u8> {
        let _ = self.reader.await;
        self.seen.borrow().clone()
    }
}

impl Spawned {
    fn start(mut cmd: tokio::process::Command) -> Result<Spawned> {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().context("spawn krt")?;
        let stdout = Pipe::read(child.stdout.take().context("piped stdout")?);
        let stderr = Pipe::read(child.stderr.take().context("piped stderr")?);
        Ok(Spawned {
            child,
            stdout,
            stderr,
        })
    }

    fn pid(&self) -> Result<nix::unistd::Pid> {
        let pid = self.child.id().context("krt has exited")?;
        Ok(nix::unistd::Pid::from_raw(i32::try_from(pid)?))
    }

    /// Waits for krt to end and returns all it printed.
    async fn finish(mut self) -> Result<Output> {
        let status = within(DEADLINE, "krt to end", async {
            Ok(self.child.wait().await?)
        })
        .await?;
        Ok(Output {
            status,
            stdout: self.stdout.finish().await,
            stderr: self.stderr.finish().await,
        })
    }
}

/// The name `krt run` printed: its whole stdout, one line.
fn created_name(out: &Output) -> Result<String> {
    let stdout = text(&out.stdout);
    let name = stdout.strip_suffix('\n').unwrap_or_default();
    if name.is_empty() || name.contains(char::is_whitespace) {
        bail!("krt run printed no bare name: {}", describe(out));
    }
    Ok(name.to_string())
}

// ---------------------------------------------------------------------------------------
// The system
// ---------------------------------------------------------------------------------------

fn runtimes(client: &kube::Client) -> Api<Runtime> {
    Api::default_namespaced(client.clone())
}

async fn run_names(client: &kube::Client) -> Result<Vec<String>> {
    Ok(runs(client)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|r| r.metadata.name)
        .collect())
}

/// Creates a bash Runtime with `replicas` workers of one run slot each. With 0 its Runs
/// stay Pending until it is scaled up.
async fn create_runtime(client: &kube::Client, name: &str, replicas: i32) -> Result<()> {
    let runtime = Runtime::new(
        name,
        RuntimeSpec {
            replicas,
            scaling: None,
            runs: Some(1),
            template: kruntimes_api::runtime::template_with_args(vec![
                "--adapter".into(),
                "bash".into(),
            ]),
            port: None,
            artifact_store: None,
        },
    );
    runtimes(client)
        .create(&PostParams::default(), &runtime)
        .await
        .with_context(|| format!("create Runtime {name}"))?;
    Ok(())
}

/// A TCP relay in front of the real gateway that cuts every connection it carries on
/// request, with a reset. This is the one stand-in of these tests, for the one fault the
/// real parts cannot cause: a log stream that breaks off while its Run goes on (the
/// gateway and runtimed end a stream only when the Run or the worker ends; stopping the
/// gateway means stopping `kruntimes up`). It fakes no answer: the bytes are the real
/// gateway's TLS stream, whose certificate is for 127.0.0.1 and so holds on any port.
struct Relay {
    url: String,
    cut: watch::Sender<()>,
    accepted: watch::Receiver<usize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Relay {
    async fn start(gateway_url: &str) -> Result<Relay> {
        let upstream = gateway_url
            .strip_prefix("https://")
            .context("the gateway URL is https")?
            .to_string();
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("https://{}", listener.local_addr()?);
        let (cut, _) = watch::channel(());
        let (accepted_tx, accepted) = watch::channel(0);
        let cuts = cut.clone();
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                accepted_tx.send_modify(|n| *n += 1);
                let mut cut = cuts.subscribe();
                let upstream = upstream.clone();
                connections.spawn(async move {
                    let Ok(mut server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let mut client = client;
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut.changed() => {
                            // A reset, not an orderly close: the stream broke.
                            let _ = client.set_zero_linger();
                        }
                    }
                });
            }
        });
        Ok(Relay {
            url,
            cut,
            accepted,
            task,
        })
    }

    /// Cuts every open connection; returns how many had been accepted.
    fn cut_all(&self) -> usize {
        let before = *self.accepted.borrow();
        self.cut.send_replace(());
        before
    }

    /// Waits until more than `count` connections were accepted.
    async fn wait_accepted_over(&self, count: usize) -> Result<()> {
        let mut rx = self.accepted.clone();
        within(DEADLINE, "krt to connect again", async {
            rx.wait_for(|n| *n > count).await?;
            Ok(())
        })
        .await
    }
}

// ---------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_wait_streams_output_and_exits_like_the_task() -> Result<()> {
    let (server, _client) = Server::start_async(Options::full()).await?;
    let server = &server;
    let plain = async {
        let out = krt_exits(
            server,
            &[
                "run",
                "--runtime",
                "bash",
                "--wait",
                "--",
                "bash",
                "-c",
                "printf 'hello '; echo world; echo oops >&2; exit 3",
            ],
            3,
        )
        .await?;
        assert_eq!(text(&out.stdout), "hello world\n", "{}", describe(&out));
        // A plain non-zero exit adds nothing of krt's own.
        assert_eq!(text(&out.stderr), "oops\n", "{}", describe(&out));

        let out = krt_ok(
            server,
            &[
                "run",
                "-r",
                "bash",
                "-w",
                "-e",
                "GREETING=fine",
                "--",
                "bash",
                "-c",
                "echo $GREETING",
            ],
        )
        .await?;
        assert_eq!(text(&out.stdout), "fine\n", "{}", describe(&out));
        assert_eq!(text(&out.stderr), "", "{}", describe(&out));
        anyhow::Ok(())
    };
    // Endings other than the program's own verdict: krt adds one line saying why.
    let endings = [
        (
            &[
                // The timeout counts from the claim, so it covers the sandbox's start
                // (slow under gVisor with four Runs at once).
                "--timeout",
                "10s",
                "--",
                "bash",
                "-c",
                "echo started; sleep 60",
            ][..],
            "started\n",
            124,
            " Timeout: ",
        ),
        (
            &["--", "bash", "-c", "kill -9 $$"],
            "",
            1,
            " Failed: Signaled: killed by signal 9",
        ),
        (
            &[
                "--",
                "bash",
                "-c",
                "echo 'no equals sign' >> \"$KRUNTIME_OUTPUTS\"",
            ],
            "",
            1,
            " Failed: OutputsInvalid: ",
        ),
    ]
    .map(|(args, stdout, expected, line)| async move {
        let mut all = vec!["run", "--runtime", "bash", "--wait"];
        all.extend_from_slice(args);
        let out = krt(server, &all).await?;
        assert_eq!(code(&out), expected, "{args:?}: {}", describe(&out));
        assert_eq!(text(&out.stdout), stdout, "{args:?}: {}", describe(&out));
        let stderr = text(&out.stderr);
        assert!(
            stderr.starts_with("krt: run bash-") && stderr.contains(line),
            "{args:?}: {}",
            describe(&out)
        );
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {}", describe(&out));
        anyhow::Ok(())
    });
    let (plain, endings) = tokio::join!(plain, futures::future::try_join_all(endings));
    plain?;
    endings?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_file_sends_the_source_inline_named_after_the_file() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("script.py");
    std::fs::write(
        &script,
        "import os, sys\nprint(os.path.basename(sys.argv[0]), sys.argv[1:], os.environ['GREETING'])\nprint('to stderr', file=sys.stderr)\nsys.exit(3)\n",
    )?;
    let script = script.to_str().context("a UTF-8 path")?;
    let out = krt_exits(
        &server,
        &[
            "run",
            "--runtime",
            "python",
            "--name",
            "from-file",
            "--wait",
            "--file",
            script,
            "-e",
            "GREETING=hi",
            "--timeout",
            "1m",
            "--",
            "a",
            "b",
        ],
        3,
    )
    .await?;
    assert_eq!(
        text(&out.stdout),
        "script.py ['a', 'b'] hi\n",
        "{}",
        describe(&out)
    );
    assert_eq!(text(&out.stderr), "to stderr\n", "{}", describe(&out));

    let run = runs(&client).get("from-file").await?;
    let task = run.spec.mode.task.as_ref().context("a task")?;
    assert_eq!(task.entrypoint.as_deref(), Some("script.py"));
    assert_eq!(task.args, vec!["a", "b"]);
    assert_eq!(
        run.spec.source.as_ref().and_then(|s| s.inline.as_deref()),
        Some(std::fs::read_to_string(script)?.as_str())
    );
    assert_eq!(run.spec.timeout.as_deref(), Some("1m"));
    let env = run.spec.env.clone().unwrap_or_default();
    assert_eq!(env.len(), 1);
    assert_eq!(
        (env[0].name.as_str(), env[0].value.as_str()),
        ("GREETING", "hi")
    );

    // The same name again is refused with a hint.
    let out = krt_exits(
        &server,
        &[
            "run",
            "--runtime",
            "python",
            "--name",
            "from-file",
            "--file",
            script,
        ],
        1,
    )
    .await?;
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("already exists") && stderr.contains("krt delete from-file"),
        "{}",
        describe(&out)
    );

    // Over 256 KiB is refused before anything is created.
    let big = dir.path().join("big.py");
    std::fs::write(&big, vec![b'#'; 256 * 1024 + 1])?;
    let big = big.to_str().context("a UTF-8 path")?;
    let out = krt_exits(&server, &["run", "--runtime", "python", "--file", big], 1).await?;
    assert!(text(&out.stderr).contains("256 KiB"), "{}", describe(&out));
    assert_eq!(run_names(&client).await?, ["from-file"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_get_and_a_broken_stream_that_resumes() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    // The task waits for a file in its workspace, the one host directory it sees.
    let go_env = "GO_IN_WORKSPACE=go".to_owned();

    // Both streams break off while the task waits; krt resumes them without repeating
    // what it already printed, with the gateway given by KRT_GATEWAY.
    let relay = Relay::start(server.gateway_url().context("the gateway runs")?).await?;
    let program = format!(
        "echo one; echo e1 >&2; GO=\"$KRUNTIME_WORKSPACE/$GO_IN_WORKSPACE\"; {WAIT_FOR_GO}; echo two; echo e2 >&2; echo three"
    );
    let mut cmd = krt_cmd(
        &server,
        &[
            "run",
            "--runtime",
            "bash",
            "--name",
            "broken",
            "--wait",
            "-e",
            &go_env,
            "--",
            "bash",
            "-c",
            &program,
        ],
    )?;
    cmd.env("KRT_GATEWAY", &relay.url);
    let mut spawned = Spawned::start(cmd)?;
    spawned.stdout.wait_for("one\n").await?;
    spawned.stderr.wait_for("e1\n").await?;
    let before = relay.cut_all();
    relay.wait_accepted_over(before).await?;
    let uid = kube::ResourceExt::uid(
        &Api::<kruntimes_api::Run>::namespaced(client.clone(), "default")
            .get("broken")
            .await?,
    )
    .context("uid")?;
    std::fs::write(workspace_of(&server, &uid).await?.join("go"), b"")?;
    let out = spawned.finish().await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "one\ntwo\nthree\n", "{}", describe(&out));
    assert_eq!(text(&out.stderr), "e1\ne2\n", "{}", describe(&out));

    let out = krt_ok(&server, &["logs", "broken"]).await?;
    assert_eq!(text(&out.stdout), "one\ntwo\nthree\n", "{}", describe(&out));
    let out = krt(&server, &["logs", "broken", "--stderr"]).await?;
    assert_eq!(text(&out.stdout), "e1\ne2\n", "{}", describe(&out));
    let out = krt_ok(&server, &["logs", "-f", "broken", "--stderr"]).await?;
    assert_eq!(text(&out.stdout), "e1\ne2\n", "{}", describe(&out));

    // logs -f of a Run that cannot start yet (its Runtime has no workers) waits for it.
    create_runtime(&client, "idle", 0).await?;
    let out = krt_ok(
        &server,
        &[
            "run",
            "--runtime",
            "idle",
            "--",
            "bash",
            "-c",
            "echo later; echo more",
        ],
    )
    .await?;
    let later = created_name(&out)?;
    assert!(later.starts_with("idle-"), "{later}");
    let follower = Spawned::start(krt_cmd(&server, &["logs", "-f", &later])?)?;
    runtimes(&client)
        .patch(
            "idle",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 1}})),
        )
        .await?;
    let out = follower.finish().await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "later\nmore\n", "{}", describe(&out));

    // get runs, get run -o json / yaml, across namespaces.
    let out = krt_ok(&server, &["get", "runs"]).await?;
    let table = text(&out.stdout);
    let header = table.lines().next().unwrap_or_default();
    assert_eq!(
        header.split_whitespace().collect::<Vec<_>>(),
        ["NAME", "RUNTIME", "PHASE", "EXIT", "AGE"]
    );
    for (name, runtime) in [("broken", "bash"), (later.as_str(), "idle")] {
        let row = table
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .with_context(|| format!("no row for {name} in\n{table}"))?;
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(&cells[..4], [name, runtime, "Succeeded", "0"], "{table}");
    }

    let out = krt(&server, &["get", "run", "broken", "-o", "json"]).await?;
    let value: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(value["kind"], "Run", "{}", describe(&out));
    assert_eq!(value["status"]["phase"], "Succeeded");
    assert_eq!(value["status"]["exitCode"], 0);
    let out = krt(&server, &["get", "rn", &later, "-o", "yaml"]).await?;
    let value: serde_yaml::Value = serde_yaml::from_slice(&out.stdout)?;
    assert_eq!(value["spec"]["runtime"].as_str(), Some("idle"));
    let out = krt(&server, &["get", "runs", "-A", "-o", "json"]).await?;
    let value: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(value["kind"], "List");
    assert_eq!(value["items"].as_array().map_or(0, Vec::len), 2);
    let out = krt(&server, &["get", "runs", "-A"]).await?;
    assert!(
        text(&out.stdout).starts_with("NAMESPACE"),
        "{}",
        describe(&out)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_wait_delete_and_runtime_list() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    create_runtime(&client, "idle", 0).await?;
    let dir = tempfile::tempdir()?;
    // Nothing creates the file: the task runs until it is cancelled.
    let go_env = format!("GO={}", dir.path().join("never").display());
    let out = krt(
        &server,
        &[
            "run",
            "--runtime",
            "bash",
            "--name",
            "long",
            "-e",
            &go_env,
            "--",
            "bash",
            "-c",
            WAIT_FOR_GO,
        ],
    )
    .await?;
    assert_eq!(text(&out.stdout), "long\n", "{}", describe(&out));
    wait_run(&client, "long", "runs", |r| {
        r.is_some_and(|r| r.phase() == Phase::Running)
    })
    .await?;
    krt_fails(
        &server,
        &["wait", "long", "--timeout", "300ms"],
        "timed out after 300ms waiting for run long (phase Running)",
    )
    .await?;

    let out = krt_ok(&server, &["cancel", "long"]).await?;
    assert_eq!(text(&out.stdout), "run/long cancel requested\n");
    let run = runs(&client).get("long").await?;
    assert_eq!(
        serde_json::to_value(&run.spec.termination)?,
        json!({"mode": "Immediate"})
    );
    let out = krt_exits(&server, &["wait", "long", "--timeout", "60s"], 130).await?;
    assert_eq!(
        text(&out.stdout),
        "run/long Cancelled\n",
        "{}",
        describe(&out)
    );
    assert_eq!(
        text(&out.stderr),
        "krt: run long Cancelled: cancelled\n",
        "{}",
        describe(&out)
    );
    let out = krt_ok(&server, &["cancel", "long"]).await?;
    assert_eq!(text(&out.stdout), "run/long already Cancelled\n");

    // The scheduler publishes `usedRuns` at most every 250 ms: the cancelled Run's slot
    // is back once the Runtime says so (the table read right away could lag behind).
    let runtimes = Api::<Runtime>::namespaced(client.clone(), "default");
    within(DEADLINE, "bash's usedRuns is back to 0", async {
        kube::runtime::wait::await_condition(runtimes, "bash", |r: Option<&Runtime>| {
            r.and_then(|r| r.status.as_ref())
                .is_some_and(|s| s.used_runs.unwrap_or(0) == 0)
        })
        .await?;
        Ok(())
    })
    .await?;
    let out = krt_ok(&server, &["runtime", "list"]).await?;
    let table = text(&out.stdout);
    let rows: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows.first().map(Vec::as_slice),
        Some(&["NAME", "REPLICAS", "READY", "RUNS", "USED", "AGE"][..]),
        "{table}"
    );
    // The default Runtimes: one worker of 8 slots each; and the one without workers.
    let cells = |name: &str| {
        rows.iter()
            .find(|r| r.first() == Some(&name))
            .map(|r| r[1..5].join(" "))
    };
    assert_eq!(cells("bash").as_deref(), Some("1 1 8 0"), "{table}");
    assert_eq!(cells("python").as_deref(), Some("1 1 8 0"), "{table}");
    assert_eq!(cells("idle").as_deref(), Some("0 0 0 0"), "{table}");

    let out = krt_ok(&server, &["delete", "long"]).await?;
    assert_eq!(text(&out.stdout), "run/long deleted\n");
    wait_run(&client, "long", "is gone", |r| r.is_none()).await?;
    for args in [
        &["get", "run", "long"][..],
        &["wait", "long"],
        &["cancel", "long"],
        &["delete", "long"],
    ] {
        krt_fails(&server, args, "run long not found in namespace default").await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_under_wait_cancels_the_run() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let dir = tempfile::tempdir()?;
    let go_env = format!("GO={}", dir.path().join("never").display());
    let program = format!("echo started; {WAIT_FOR_GO}");
    let mut spawned = Spawned::start(krt_cmd(
        &server,
        &[
            "run",
            "--runtime",
            "bash",
            "--name",
            "stopme",
            "--wait",
            "-e",
            &go_env,
            "--",
            "bash",
            "-c",
            &program,
        ],
    )?)?;
    // Once the output streams, krt waits for the Run's end and handles Ctrl-C.
    spawned.stdout.wait_for("started\n").await?;
    nix::sys::signal::kill(spawned.pid()?, nix::sys::signal::Signal::SIGINT)?;
    let out = spawned.finish().await?;
    assert_eq!(code(&out), 130, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "started\n", "{}", describe(&out));
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with("krt: cancelling run stopme; Ctrl-C again to stop waiting\n")
            && stderr.ends_with("krt: run stopme Cancelled: cancelled\n"),
        "{}",
        describe(&out)
    );
    let run = runs(&client).get("stopme").await?;
    assert_eq!(run.phase(), Phase::Cancelled);
    Ok(())
}

/// Issue 15.9: SIGTERM to `krt run --wait` (a supervisor, `timeout`, `kill`) cancels the
/// Run as Ctrl-C does; before, krt died at once and the Run went on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_wait_cancels_the_run() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let dir = tempfile::tempdir()?;
    let go_env = format!("GO={}", dir.path().join("never").display());
    let program = format!("echo started; {WAIT_FOR_GO}");
    let mut spawned = Spawned::start(krt_cmd(
        &server,
        &[
            "run",
            "--runtime",
            "bash",
            "--name",
            "termme",
            "--wait",
            "-e",
            &go_env,
            "--",
            "bash",
            "-c",
            &program,
        ],
    )?)?;
    spawned.stdout.wait_for("started\n").await?;
    nix::sys::signal::kill(spawned.pid()?, nix::sys::signal::Signal::SIGTERM)?;
    let out = spawned.finish().await?;
    assert_eq!(code(&out), 130, "{}", describe(&out));
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with("krt: cancelling run termme")
            && stderr.ends_with("krt: run termme Cancelled: cancelled\n"),
        "{}",
        describe(&out)
    );
    assert_eq!(runs(&client).get("termme").await?.phase(), Phase::Cancelled);
    Ok(())
}

/// Issue 15.9: `krt run` without `--wait` prints the bare Run name (it printed
/// `run/NAME created`, so `krt logs $NAME` failed); piped stdin, which a task never gets,
/// is said to be ignored; `krt logs -f` on a Run that is not placed says why it waits (it
/// was silent without a terminal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_prints_the_bare_name_says_stdin_is_ignored_and_logs_f_says_why_it_waits() -> Result<()>
{
    let (server, client) = Server::start_async(Options::full()).await?;
    let mut cmd = krt_cmd(
        &server,
        &["run", "--runtime", "bash", "--", "bash", "-c", "echo hi"],
    )?;
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn()?;
    {
        use tokio::io::AsyncWriteExt;
        let mut stdin = child.stdin.take().context("piped stdin")?;
        stdin.write_all(b"data for the task\n").await?;
    }
    let out = within(DEADLINE, "krt run", async {
        Ok(child.wait_with_output().await?)
    })
    .await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    let name = created_name(&out)?;
    assert!(name.starts_with("bash-"), "{}", describe(&out));
    assert!(
        text(&out.stderr).contains("krt: standard input is ignored"),
        "{}",
        describe(&out)
    );
    // The printed name is what the other commands take.
    let out = krt_ok(&server, &["logs", "-f", &name]).await?;
    assert_eq!(text(&out.stdout), "hi\n", "{}", describe(&out));
    // Without piped stdin, nothing is said about it.
    let out = krt_ok(&server, &["run", "--runtime", "bash", "--", "true"]).await?;
    assert_eq!(text(&out.stderr), "", "{}", describe(&out));

    // A Run that cannot be placed: logs -f says so on stderr, with the phase and what
    // the Run's conditions say, and keeps waiting.
    create_runtime(&client, "nowhere", 0).await?;
    let out = krt_ok(&server, &["run", "--runtime", "nowhere", "--", "true"]).await?;
    let stuck = created_name(&out)?;
    let mut follower = Spawned::start(krt_cmd(&server, &["logs", "-f", &stuck])?)?;
    follower
        .stderr
        .wait_for(&format!(
            "krt: run {stuck} is Pending (not placed on a worker yet)"
        ))
        .await?;
    let run = runs(&client).get(&stuck).await?;
    for condition in run.status.iter().flat_map(|s| s.conditions.iter()) {
        if condition.status != "True"
            && let Some(reason) = &condition.reason
        {
            follower.stderr.wait_for(reason).await?;
        }
    }
    krt_ok(&server, &["cancel", &stuck]).await?;
    let out = follower.finish().await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_say_what_to_do_next() -> Result<()> {
    let (mut server, client) = Server::start_async(Options::full()).await?;
    // A missing Runtime lists those that exist, and nothing is created.
    krt_fails(
        &server,
        &["run", "--runtime", "nope", "--", "echo", "hi"],
        "runtime \"nope\" not found in namespace default; Runtimes there: bash, python",
    )
    .await?;
    assert!(run_names(&client).await?.is_empty());

    // No gateway in the kubeconfig: --wait and logs say how to configure one, and --wait
    // creates nothing.
    let dir = tempfile::tempdir()?;
    let bare = dir.path().join("kubeconfig");
    let mut doc: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(server.kubeconfig_path())?)?;
    let cluster = doc["clusters"][0]["cluster"]
        .as_mapping_mut()
        .context("a cluster")?;
    assert!(cluster.remove("extensions").is_some(), "{doc:?}");
    std::fs::write(&bare, serde_yaml::to_string(&doc)?)?;
    for args in [
        &["run", "--runtime", "bash", "--wait", "--", "true"][..],
        &["logs", "anything"],
    ] {
        let mut cmd = krt_cmd(&server, args)?;
        cmd.env("KUBECONFIG", &bare);
        let out = output(cmd).await?;
        assert_eq!(code(&out), 1, "{args:?}: {}", describe(&out));
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains("no gateway configured")
                && stderr.contains("--gateway")
                && stderr.contains("KRT_GATEWAY"),
            "{args:?}: {}",
            describe(&out)
        );
    }
    assert!(run_names(&client).await?.is_empty());

    // Bad arguments fail before any request.
    for (args, expected) in [
        (
            &["run", "--runtime", "bash", "--", "./x.sh"][..],
            "--file ./x.sh",
        ),
        (
            &["run", "--runtime", "bash", "-e", "1X=2", "--", "true"],
            "variable name",
        ),
        (
            &["run", "--runtime", "bash", "--timeout", "5", "--", "true"],
            "--timeout",
        ),
        (&["run", "--runtime", "bash"], "nothing to run"),
        (
            &["run", "--runtime", "bash", "--file", "/no/such/file.py"],
            "no such file",
        ),
    ] {
        krt_fails(&server, args, expected).await?;
    }

    // The gateway's errors come through with what to do: logs of a Run that has not
    // started (its Runtime has no workers) and of one that does not exist.
    create_runtime(&client, "idle", 0).await?;
    krt_ok(
        &server,
        &["run", "--runtime", "idle", "--name", "queued", "--", "true"],
    )
    .await?;
    let out = krt_exits(&server, &["logs", "queued"], 1).await?;
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("has not started on a worker yet; `krt logs -f queued` waits for it")
            && stderr.contains("409 NotStarted"),
        "{}",
        describe(&out)
    );
    let out = krt_exits(&server, &["logs", "nosuch"], 1).await?;
    assert!(
        text(&out.stderr).contains("run nosuch not found in namespace default")
            && text(&out.stderr).contains("404 NotFound"),
        "{}",
        describe(&out)
    );

    // A gateway that does not answer: nothing listens on the port any more.
    let closed = {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        format!("https://{}", listener.local_addr()?)
    };
    let mut cmd = krt_cmd(&server, &["logs", "queued"])?;
    cmd.arg("--gateway").arg(&closed);
    let out = output(cmd).await?;
    assert_eq!(code(&out), 1, "{}", describe(&out));
    assert!(
        text(&out.stderr).contains(&format!("cannot reach the gateway at {closed}"))
            && text(&out.stderr).contains("is `kruntimes up` running?"),
        "{}",
        describe(&out)
    );

    // An API server that is gone.
    server.kill()?;
    let out = krt_exits(&server, &["get", "runs"], 1).await?;
    assert!(
        text(&out.stderr).contains("cannot reach the API server")
            && text(&out.stderr).contains("is `kruntimes up` running?"),
        "{}",
        describe(&out)
    );
    // No kubeconfig at all.
    let mut cmd = krt_cmd(&server, &["get", "runs"])?;
    cmd.env_remove("KUBECONFIG")
        .env("KRUNTIMES_DATA_DIR", dir.path().join("nothing"));
    let out = output(cmd).await?;
    assert_eq!(code(&out), 1, "{}", describe(&out));
    assert!(
        text(&out.stderr).contains("is `kruntimes up` running?"),
        "{}",
        describe(&out)
    );
    Ok(())
}

/// Issue 16.3: `krt run --wait` on a Runtime that does not exist fails within 2 s with the
/// scheduler's reason (`RuntimeNotFound` is decisive: no waiting it out), and cancels the
/// Run it created. The caller here may create Runs but not read Runtimes, so krt's own
/// check before creating cannot tell (403) and only the Run's condition says it. Before
/// 16.3 krt waited for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_wait_on_a_missing_runtime_fails_fast_with_the_reason() -> Result<()> {
    use kruntimes_testkit::setup::{kruntimes_rule, service_account_token};
    let (server, client) = Server::start_async(Options::full()).await?;
    let rule = kruntimes_rule(&["create", "get", "list", "watch", "patch"], &["runs"]);
    let token = service_account_token(&client, "default", "runner", vec![rule], 600).await?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    let mut doc: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(server.kubeconfig_path())?)?;
    doc["users"][0]["user"] = serde_yaml::from_str(&format!("{{token: {token}}}"))?;
    std::fs::write(&kubeconfig, serde_yaml::to_string(&doc)?)?;
    let mut cmd = krt_cmd(
        &server,
        &[
            "run",
            "--runtime",
            "nope",
            "--name",
            "typo",
            "--wait",
            "--",
            "echo",
            "hi",
        ],
    )?;
    cmd.env("KUBECONFIG", &kubeconfig);
    let started = std::time::Instant::now();
    let out = output(cmd).await?;
    let took = started.elapsed();
    assert_eq!(code(&out), 1, "{}", describe(&out));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("run typo cannot be placed: RuntimeNotFound: Runtime nope does not exist in namespace default")
            && stderr.contains("the Run is cancelled"),
        "{stderr}"
    );
    // The defect was waiting forever; the bound leaves room for a loaded machine.
    assert!(
        took < std::time::Duration::from_secs(15),
        "krt took {took:?}: {stderr}"
    );
    wait_run(&client, "typo", "Cancelled", |r| {
        r.is_some_and(|r| r.phase() == Phase::Cancelled)
    })
    .await?;
    Ok(())
}

/// Issue 17 item 7: on an API server that does not serve AccessTokens (a cluster's), `krt
/// token create --user`, `list` and `revoke` say that user tokens exist only on the
/// embedded API server and what to use instead, never a bare 404. No kube-apiserver can
/// run here: the stand-in answers every request as one answers for an API group it does
/// not serve (404, a NotFound Status).
#[tokio::test]
async fn user_token_commands_say_they_are_standalone_only_on_a_cluster() -> Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (paths_tx, mut paths) = tokio::sync::mpsc::unbounded_channel();
    let server = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let paths_tx = paths_tx.clone();
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 65536 {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let line = String::from_utf8_lossy(&request)
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                let _ = paths_tx.send(line);
                let body = r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"the server could not find the requested resource","reason":"NotFound","details":{},"code":404}"#;
                let answer = format!(
                    "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                use tokio::io::AsyncWriteExt;
                let _ = stream.write_all(answer.as_bytes()).await;
            });
        }
    });
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://{addr}\n\
             users:\n- name: u\n  user:\n    token: not-a-secret\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\n\
             current-context: c\n"
        ),
    )?;
    for args in [
        ["token", "list"].as_slice(),
        ["token", "revoke", "some-token"].as_slice(),
        ["token", "create", "--user", "alice"].as_slice(),
    ] {
        let mut cmd = tokio::process::Command::new(kruntimes_testkit::krt_bin()?);
        cmd.args(args)
            .env("KUBECONFIG", &kubeconfig)
            .env("HOME", dir.path())
            .stdin(Stdio::null());
        let out = output(cmd).await?;
        assert_eq!(code(&out), 1, "krt {args:?}: {}", describe(&out));
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains("exist only on the embedded API server of `kruntimes up`")
                && stderr.contains("krt token create SERVICEACCOUNT"),
            "krt {args:?}: {}",
            describe(&out)
        );
    }
    // Each command asked discovery first, and nothing else: no write was attempted.
    let mut asked = Vec::new();
    while let Ok(line) = paths.try_recv() {
        asked.push(line);
    }
    assert!(
        !asked.is_empty()
            && asked
                .iter()
                .all(|l| l.starts_with("GET /apis/auth.kruntimes.io/v1alpha1 ")),
        "{asked:?}"
    );
    server.abort();
    Ok(())
}
