//! krt against the real `kruntimes up` API server, with a stand-in for the parts of task
//! mode that krt only observes: a fake controller that moves Runs of the Runtime `fake`
//! through their phases, and a fake gateway (HTTPS with a certificate from the data
//! directory's CA, checking the bearer token) that serves their output.
//!
//! A fake Run's command says what it does: `-- fake out:TEXT err:TEXT exit:N` and the like
//! (see [`Script`]). A Run with `--file` prints its inline source on stdout and
//! `entrypoint=E args=A` on stderr. Needs `cargo build -p kruntimes` first.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::process::Output;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use kruntimes_api::{Phase, Run, Runtime, RuntimeSpec};
use kruntimes_testkit::Server;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::sync::watch;

const FAKE: &str = "fake";
const IDLE: &str = "idle";
/// Gap between chunks of a stream, so following is real.
const CHUNK_GAP: Duration = Duration::from_millis(40);

/// What a fake Run does.
#[derive(Clone, Debug, Default)]
struct Script {
    stdout: Vec<String>,
    stderr: Vec<String>,
    /// The terminal status to write.
    end: Option<End>,
    /// Stay Running until cancelled.
    hang: bool,
    /// The first stdout connection breaks after its first chunk.
    break_once: bool,
}

/// A terminal status: phase, exit code, reason, message.
#[derive(Clone, Debug)]
struct End(Phase, Option<i32>, Option<String>, Option<String>);

fn script_of(run: &Run) -> Script {
    let task = run.spec.mode.task.clone().unwrap_or_default();
    if let Some(inline) = run.spec.source.as_ref().and_then(|s| s.inline.clone()) {
        return Script {
            stdout: vec![inline],
            stderr: vec![format!(
                "entrypoint={} args={}",
                task.entrypoint,
                task.args.join(" ")
            )],
            end: Some(End(
                Phase::Succeeded,
                Some(0),
                Some("Completed".into()),
                None,
            )),
            ..Script::default()
        };
    }
    let mut script = Script {
        end: Some(End(
            Phase::Succeeded,
            Some(0),
            Some("Completed".into()),
            None,
        )),
        ..Script::default()
    };
    for arg in &task.args {
        let (verb, rest) = arg.split_once(':').unwrap_or((arg.as_str(), ""));
        match verb {
            "out" => script.stdout.push(rest.to_string()),
            "err" => script.stderr.push(rest.to_string()),
            "exit" => {
                let code: i32 = rest.parse().unwrap_or(1);
                script.end = Some(if code == 0 {
                    End(Phase::Succeeded, Some(0), Some("Completed".into()), None)
                } else {
                    End(
                        Phase::Failed,
                        Some(code),
                        Some("NonZeroExitCode".into()),
                        Some(format!("exited with {code}")),
                    )
                });
            }
            "timeout" => {
                script.end = Some(End(
                    Phase::Timeout,
                    None,
                    Some("Timeout".into()),
                    Some("ran longer than 1s".into()),
                ))
            }
            "signal" => {
                script.end = Some(End(
                    Phase::Failed,
                    None,
                    Some("Signaled".into()),
                    Some("killed by signal 9".into()),
                ))
            }
            "invalid" => {
                script.end = Some(End(
                    Phase::Failed,
                    Some(0),
                    Some("OutputsInvalid".into()),
                    Some("line 1 is not KEY=VALUE".into()),
                ))
            }
            "hang" => script.hang = true,
            "break" => script.break_once = true,
            _ => {}
        }
    }
    script
}

#[derive(Default)]
struct Shared {
    scripts: HashMap<String, Script>,
    /// Stdout connections per Run.
    connections: HashMap<String, usize>,
}

struct GatewayState {
    token: String,
    shared: Arc<Mutex<Shared>>,
}

fn json_error(code: u16, reason: &str, message: &str) -> Response {
    (
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        [("content-type", "application/json")],
        json!({"code": code, "reason": reason, "message": message}).to_string(),
    )
        .into_response()
}

async fn logs(
    State(state): State<Arc<GatewayState>>,
    Path((_ns, name)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let expected = format!("Bearer {}", state.token);
    if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some(expected.as_str()) {
        return json_error(401, "Unauthorized", "no or bad token");
    }
    let stream = query.get("stream").map(String::as_str).unwrap_or("stdout");
    let (chunks, break_now) = {
        let Ok(mut shared) = state.shared.lock() else {
            return json_error(500, "InternalError", "poisoned");
        };
        let Some(script) = shared.scripts.get(&name).cloned() else {
            return json_error(409, "NotStarted", "the Run is not running on a worker yet");
        };
        let chunks = if stream == "stderr" {
            script.stderr
        } else {
            script.stdout
        };
        let mut break_now = false;
        if stream == "stdout" {
            let n = shared.connections.entry(name.clone()).or_default();
            *n += 1;
            break_now = script.break_once && *n == 1;
        }
        (chunks, break_now)
    };
    let body = futures::stream::unfold(0usize, move |i| {
        let chunks = chunks.clone();
        async move {
            tokio::time::sleep(CHUNK_GAP).await;
            if break_now && i == 1 {
                return Some((Err(std::io::Error::other("worker went away")), usize::MAX));
            }
            let chunk = chunks.get(i)?;
            Some((Ok(Bytes::from(chunk.clone())), i + 1))
        }
    });
    Response::new(Body::from_stream(body))
}

/// The fake controller: starts every new Run of `fake` and ends it as its script says.
async fn controller(client: kube::Client, shared: Arc<Mutex<Shared>>) {
    let api: Api<Run> = Api::default_namespaced(client);
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let Ok(list) = api.list(&ListParams::default()).await else {
            continue;
        };
        for run in list {
            if run.spec.runtime != FAKE {
                continue;
            }
            let name = run.metadata.name.clone().unwrap_or_default();
            let cancelled = run.spec.termination.is_some();
            match run.status.as_ref().and_then(|s| s.phase) {
                None | Some(Phase::Pending) if cancelled => {
                    end(&api, &name, Phase::Cancelled, None, Some("Cancelled"), None).await;
                }
                None | Some(Phase::Pending) => {
                    let script = script_of(&run);
                    if let Ok(mut s) = shared.lock() {
                        s.scripts.insert(name.clone(), script.clone());
                    }
                    let status = json!({"status": {
                        "phase": "Running", "attempt": 1,
                        "startTime": "2025-01-01T00:00:00Z",
                    }});
                    let _ = api
                        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                        .await;
                    if !script.hang {
                        let api = api.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_millis(300)).await;
                            if let Some(End(phase, code, reason, message)) = script.end {
                                end(
                                    &api,
                                    &name,
                                    phase,
                                    code,
                                    reason.as_deref(),
                                    message.as_deref(),
                                )
                                .await;
                            }
                        });
                    }
                }
                Some(Phase::Running) if cancelled => {
                    end(
                        &api,
                        &name,
                        Phase::Cancelled,
                        None,
                        Some("Cancelled"),
                        Some("cancelled by request"),
                    )
                    .await;
                }
                _ => {}
            }
        }
    }
}

async fn end(
    api: &Api<Run>,
    name: &str,
    phase: Phase,
    code: Option<i32>,
    reason: Option<&str>,
    message: Option<&str>,
) {
    let status = json!({"status": {
        "phase": phase.as_str(), "exitCode": code, "reason": reason, "message": message,
        "completionTime": "2025-01-01T00:00:01Z",
    }});
    let _ = api
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await;
}

/// A `kruntimes up` with the fake controller and gateway running.
struct Fixture {
    server: Server,
    client: kube::Client,
    gateway_url: String,
    shared: Arc<Mutex<Shared>>,
    _shutdown: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Fixture {
    async fn start() -> Result<Fixture> {
        let (server, client) = Server::start_async(Default::default()).await?;
        for (name, replicas) in [(FAKE, 2), (IDLE, 0)] {
            let runtime = Runtime::new(
                name,
                RuntimeSpec {
                    replicas,
                    runs: None,
                    template: Default::default(),
                    port: None,
                },
            );
            Api::<Runtime>::default_namespaced(client.clone())
                .create(&PostParams::default(), &runtime)
                .await?;
        }
        let pki = kruntimes_apiserver::tls::prepare(
            &server.data_dir().join("pki"),
            IpAddr::V4(Ipv4Addr::LOCALHOST),
        )?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let gateway_url = format!("https://{}", listener.local_addr()?);
        let shared = Arc::new(Mutex::new(Shared::default()));
        let state = Arc::new(GatewayState {
            token: kruntimes_testkit::admin_token(&server.kubeconfig_path())?,
            shared: Arc::clone(&shared),
        });
        let app = Router::new()
            .route("/v1/namespaces/{ns}/runs/{name}/logs", get(logs))
            .with_state(state);
        let (shutdown, shutdown_rx) = watch::channel(false);
        let serve = tokio::spawn(kruntimes_apiserver::http::serve(
            listener,
            pki.server_config,
            app,
            shutdown_rx,
        ));
        let control = tokio::spawn(controller(client.clone(), Arc::clone(&shared)));
        Ok(Fixture {
            server,
            client,
            gateway_url,
            shared,
            _shutdown: shutdown,
            tasks: vec![serve, control],
        })
    }

    /// Runs krt with `KRT_GATEWAY` pointing at the fake gateway.
    async fn krt(&self, args: &[&str]) -> Result<Output> {
        let mut cmd = self.server.krt()?;
        cmd.env("KRT_GATEWAY", &self.gateway_url).args(args);
        self.output(cmd).await
    }

    /// Runs krt with neither a gateway flag nor `KRT_GATEWAY`.
    async fn krt_plain(&self, args: &[&str]) -> Result<Output> {
        let mut cmd = self.server.krt()?;
        cmd.env_remove("KRT_GATEWAY").args(args);
        self.output(cmd).await
    }

    async fn output(&self, cmd: std::process::Command) -> Result<Output> {
        let mut cmd = tokio::process::Command::from(cmd);
        cmd.kill_on_drop(true);
        tokio::time::timeout(Duration::from_secs(60), cmd.output())
            .await
            .context("krt did not finish within 60 s")?
            .context("run krt")
    }

    fn runs(&self) -> Api<Run> {
        Api::default_namespaced(self.client.clone())
    }
}

/// Polls `check` until it holds, failing after `deadline`.
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
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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

/// The name in `run/NAME created`.
fn created_name(out: &Output) -> Result<String> {
    let stdout = text(&out.stdout);
    let Some(name) = stdout
        .trim()
        .strip_prefix("run/")
        .and_then(|s| s.strip_suffix(" created"))
    else {
        bail!("krt run printed no name: {}", describe(out));
    };
    Ok(name.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_wait_streams_output_and_exits_like_the_task() -> Result<()> {
    let f = Fixture::start().await?;
    let out = f
        .krt(&[
            "run",
            "--runtime",
            FAKE,
            "--wait",
            "--",
            "fake",
            "out:hello ",
            "out:world\n",
            "err:oops\n",
            "exit:3",
        ])
        .await?;
    assert_eq!(code(&out), 3, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "hello world\n", "{}", describe(&out));
    // A plain non-zero exit adds nothing of krt's own.
    assert_eq!(text(&out.stderr), "oops\n", "{}", describe(&out));

    let out = f
        .krt(&[
            "run",
            "-r",
            FAKE,
            "-w",
            "--",
            "fake",
            "out:fine\n",
            "exit:0",
        ])
        .await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "fine\n");
    assert_eq!(text(&out.stderr), "");

    for (verb, expected_code, expected_line) in [
        ("timeout", 124, "Timeout: ran longer than 1s"),
        ("signal", 1, "Failed: Signaled: killed by signal 9"),
        (
            "invalid",
            1,
            "Failed: OutputsInvalid: line 1 is not KEY=VALUE",
        ),
    ] {
        let out = f
            .krt(&["run", "--runtime", FAKE, "--wait", "--", "fake", verb])
            .await?;
        assert_eq!(code(&out), expected_code, "{verb}: {}", describe(&out));
        let stderr = text(&out.stderr);
        assert!(
            stderr.starts_with("krt: run fake-") && stderr.trim_end().ends_with(expected_line),
            "{verb}: {}",
            describe(&out)
        );
        assert_eq!(stderr.lines().count(), 1, "{verb}: {}", describe(&out));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_file_sends_the_source_inline_named_after_the_file() -> Result<()> {
    let f = Fixture::start().await?;
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("script.py");
    std::fs::write(&script, "print('hi')\n")?;
    // The gateway comes from the kubeconfig's cluster extension this time.
    let kubeconfig = dir.path().join("kubeconfig");
    let mut doc: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(f.server.kubeconfig_path())?)?;
    doc["clusters"][0]["cluster"]["extensions"] = serde_yaml::to_value(json!([
        {"name": "kruntimes.io/gateway", "extension": {"url": f.gateway_url}}
    ]))?;
    std::fs::write(&kubeconfig, serde_yaml::to_string(&doc)?)?;
    let mut cmd = f.server.krt()?;
    cmd.env("KUBECONFIG", &kubeconfig)
        .env_remove("KRT_GATEWAY")
        .args(["run", "--runtime", FAKE, "--name", "from-file", "--wait"])
        .arg("--file")
        .arg(&script)
        .args(["-e", "GREETING=hi", "--timeout", "1m", "--", "a", "b"]);
    let out = f.output(cmd).await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "print('hi')\n");
    assert_eq!(text(&out.stderr), "entrypoint=script.py args=a b");

    let run = f.runs().get("from-file").await?;
    let task = run.spec.mode.task.as_ref().context("a task")?;
    assert_eq!(task.entrypoint, "script.py");
    assert_eq!(task.args, vec!["a", "b"]);
    assert_eq!(run.spec.timeout.as_deref(), Some("1m"));
    let env = run.spec.env.clone().unwrap_or_default();
    assert_eq!(env.len(), 1);
    assert_eq!(
        (env[0].name.as_str(), env[0].value.as_str()),
        ("GREETING", "hi")
    );

    // The same name again is refused with a hint.
    let mut cmd = f.server.krt()?;
    cmd.args(["run", "--runtime", FAKE, "--name", "from-file", "--file"])
        .arg(&script);
    let out = f.output(cmd).await?;
    assert_eq!(code(&out), 1, "{}", describe(&out));
    assert!(
        text(&out.stderr).contains("already exists"),
        "{}",
        describe(&out)
    );

    // Over 256 KiB is refused before anything is created.
    let big = dir.path().join("big.py");
    std::fs::write(&big, vec![b'#'; 256 * 1024 + 1])?;
    let mut cmd = f.server.krt()?;
    cmd.args(["run", "--runtime", FAKE, "--file"]).arg(&big);
    let out = f.output(cmd).await?;
    assert_eq!(code(&out), 1, "{}", describe(&out));
    assert!(text(&out.stderr).contains("256 KiB"), "{}", describe(&out));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_get_and_a_broken_stream_that_resumes() -> Result<()> {
    let f = Fixture::start().await?;
    // The first stdout connection breaks after "one"; krt resumes without repeating it.
    let out = f
        .krt(&[
            "run",
            "--runtime",
            FAKE,
            "--name",
            "broken",
            "--wait",
            "--",
            "fake",
            "break",
            "out:one\n",
            "out:two\n",
            "out:three\n",
            "err:e1\n",
        ])
        .await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "one\ntwo\nthree\n", "{}", describe(&out));
    let connections = f
        .shared
        .lock()
        .map(|s| s.connections.get("broken").copied())
        .ok()
        .flatten();
    assert!(connections >= Some(2), "{connections:?}");

    let out = f.krt(&["logs", "broken"]).await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "one\ntwo\nthree\n");
    let out = f.krt(&["logs", "broken", "--stderr"]).await?;
    assert_eq!(text(&out.stdout), "e1\n", "{}", describe(&out));
    let out = f.krt(&["logs", "-f", "broken", "--stderr"]).await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "e1\n", "{}", describe(&out));

    // logs -f of a Run that starts later waits for it.
    let out = f
        .krt(&["run", "--runtime", FAKE, "--", "fake", "out:later\n"])
        .await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    let name = created_name(&out)?;
    assert!(name.starts_with("fake-"), "{name}");
    let out = f.krt(&["logs", "-f", &name]).await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "later\n");

    // get runs, get run -o json / yaml.
    let out = f.krt(&["get", "runs"]).await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    let table = text(&out.stdout);
    let header = table.lines().next().unwrap_or_default();
    assert_eq!(
        header.split_whitespace().collect::<Vec<_>>(),
        ["NAME", "RUNTIME", "PHASE", "EXIT", "AGE"]
    );
    let row = table
        .lines()
        .find(|l| l.starts_with("broken "))
        .context("no row for broken")?;
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(&cells[..4], ["broken", FAKE, "Succeeded", "0"], "{table}");

    let out = f.krt(&["get", "run", "broken", "-o", "json"]).await?;
    let value: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(value["kind"], "Run");
    assert_eq!(value["status"]["phase"], "Succeeded");
    let out = f.krt(&["get", "rn", &name, "-o", "yaml"]).await?;
    let value: serde_yaml::Value = serde_yaml::from_slice(&out.stdout)?;
    assert_eq!(value["spec"]["runtime"].as_str(), Some(FAKE));
    let out = f.krt(&["get", "runs", "-A", "-o", "json"]).await?;
    let value: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(value["kind"], "List");
    assert!(value["items"].as_array().map_or(0, Vec::len) >= 2);
    let out = f.krt(&["get", "runs", "-A"]).await?;
    assert!(
        text(&out.stdout).starts_with("NAMESPACE"),
        "{}",
        describe(&out)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_wait_delete_and_runtime_list() -> Result<()> {
    let f = Fixture::start().await?;
    let out = f
        .krt(&[
            "run",
            "--runtime",
            FAKE,
            "--name",
            "long",
            "--",
            "fake",
            "hang",
        ])
        .await?;
    assert_eq!(
        text(&out.stdout),
        "run/long created\n",
        "{}",
        describe(&out)
    );
    // Wait until it runs, then a short wait times out.
    eventually(Duration::from_secs(20), "long runs", || async {
        Ok(f.runs().get("long").await?.phase() == Phase::Running)
    })
    .await?;
    let out = f.krt(&["wait", "long", "--timeout", "300ms"]).await?;
    assert_eq!(code(&out), 1, "{}", describe(&out));
    assert!(
        text(&out.stderr).contains("timed out after 300ms waiting for run long (phase Running)"),
        "{}",
        describe(&out)
    );

    let out = f.krt(&["cancel", "long"]).await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "run/long cancel requested\n");
    let run = f.runs().get("long").await?;
    assert_eq!(
        serde_json::to_value(&run.spec.termination)?,
        json!({"mode": "Immediate"})
    );
    let out = f.krt(&["wait", "long", "--timeout", "20s"]).await?;
    assert_eq!(code(&out), 130, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "run/long Cancelled\n");
    assert_eq!(
        text(&out.stderr),
        "krt: run long Cancelled: cancelled by request\n"
    );
    let out = f.krt(&["cancel", "long"]).await?;
    assert_eq!(text(&out.stdout), "run/long already Cancelled\n");

    let out = f.krt(&["runtime", "list"]).await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    let table = text(&out.stdout);
    assert_eq!(
        table
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .collect::<Vec<_>>(),
        ["NAME", "REPLICAS", "READY", "RUNS", "USED", "AGE"]
    );
    let row = table
        .lines()
        .find(|l| l.starts_with("fake "))
        .context("no fake row")?;
    assert_eq!(row.split_whitespace().nth(1), Some("2"), "{table}");
    assert!(table.lines().any(|l| l.starts_with("idle ")), "{table}");

    let out = f.krt(&["delete", "long"]).await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "run/long deleted\n");
    eventually(Duration::from_secs(20), "long is gone", || async {
        Ok(f.runs().get_opt("long").await?.is_none())
    })
    .await?;
    for args in [
        &["get", "run", "long"][..],
        &["wait", "long"],
        &["cancel", "long"],
        &["delete", "long"],
    ] {
        let out = f.krt(args).await?;
        assert_eq!(code(&out), 1, "{args:?}: {}", describe(&out));
        assert!(
            text(&out.stderr).contains("run long not found in namespace default"),
            "{args:?}: {}",
            describe(&out)
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_under_wait_cancels_the_run() -> Result<()> {
    let f = Fixture::start().await?;
    let mut cmd = f.server.krt()?;
    cmd.env("KRT_GATEWAY", &f.gateway_url)
        .args(["run", "--runtime", FAKE, "--name", "stopme", "--wait", "--"])
        .args(["fake", "out:started\n", "hang"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = tokio::process::Command::from(cmd)
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id().context("pid")?;
    eventually(Duration::from_secs(20), "stopme runs", || async {
        Ok(f.runs()
            .get_opt("stopme")
            .await?
            .is_some_and(|r| r.phase() == Phase::Running))
    })
    .await?;
    // Let krt see it run before interrupting.
    tokio::time::sleep(Duration::from_millis(500)).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid)?),
        nix::sys::signal::Signal::SIGINT,
    )?;
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .context("krt did not end after Ctrl-C")??;
    assert_eq!(code(&out), 130, "{}", describe(&out));
    assert_eq!(text(&out.stdout), "started\n");
    assert!(
        text(&out.stderr).contains("krt: cancelling run stopme"),
        "{}",
        describe(&out)
    );
    assert_eq!(f.runs().get("stopme").await?.phase(), Phase::Cancelled);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_say_what_to_do_next() -> Result<()> {
    let mut f = Fixture::start().await?;
    // A missing Runtime lists those that exist, and nothing is created.
    let out = f
        .krt(&["run", "--runtime", "nope", "--", "echo", "hi"])
        .await?;
    assert_eq!(code(&out), 1, "{}", describe(&out));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(
            "runtime \"nope\" not found in namespace default; Runtimes there: fake, idle"
        ),
        "{}",
        describe(&out)
    );
    assert!(
        f.runs()
            .list(&ListParams::default())
            .await?
            .items
            .is_empty()
    );

    // No gateway: --wait and logs say how to configure one.
    for args in [
        &["run", "--runtime", FAKE, "--wait", "--", "fake"][..],
        &["logs", "anything"],
    ] {
        let out = f.krt_plain(args).await?;
        assert_eq!(code(&out), 1, "{args:?}: {}", describe(&out));
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains("no gateway configured") && stderr.contains("KRT_GATEWAY"),
            "{args:?}: {}",
            describe(&out)
        );
    }
    assert!(
        f.runs()
            .list(&ListParams::default())
            .await?
            .items
            .is_empty()
    );

    // Bad arguments fail before any request.
    for (args, expected) in [
        (
            &["run", "--runtime", FAKE, "--", "./x.sh"][..],
            "--file ./x.sh",
        ),
        (
            &["run", "--runtime", FAKE, "-e", "1X=2", "--", "fake"],
            "variable name",
        ),
        (
            &["run", "--runtime", FAKE, "--timeout", "5", "--", "fake"],
            "--timeout",
        ),
        (&["run", "--runtime", FAKE], "nothing to run"),
        (
            &["run", "--runtime", FAKE, "--file", "/no/such/file.py"],
            "no such file",
        ),
    ] {
        let out = f.krt(args).await?;
        assert_eq!(code(&out), 1, "{args:?}: {}", describe(&out));
        assert!(
            text(&out.stderr).contains(expected),
            "{args:?}: {}",
            describe(&out)
        );
    }

    // The gateway's JSON errors come through: logs of a Run that never started.
    let out = f
        .krt(&["run", "--runtime", IDLE, "--name", "queued", "--", "echo"])
        .await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    let out = f.krt(&["logs", "queued"]).await?;
    assert_eq!(code(&out), 1, "{}", describe(&out));
    assert!(
        text(&out.stderr).contains("has not started on a worker yet")
            && text(&out.stderr).contains("409 NotStarted"),
        "{}",
        describe(&out)
    );

    // An API server that is gone.
    f.server.kill()?;
    let out = f.krt(&["get", "runs"]).await?;
    assert_eq!(code(&out), 1, "{}", describe(&out));
    assert!(
        text(&out.stderr).contains("is `kruntimes up` running?"),
        "{}",
        describe(&out)
    );
    // No kubeconfig at all.
    let empty = tempfile::tempdir()?;
    let mut cmd = f.server.krt()?;
    cmd.env_remove("KUBECONFIG")
        .env("KRUNTIMES_DATA_DIR", empty.path().join("nothing"))
        .args(["get", "runs"]);
    let out = f.output(cmd).await?;
    assert_eq!(code(&out), 1, "{}", describe(&out));
    assert!(
        text(&out.stderr).contains("is `kruntimes up` running?"),
        "{}",
        describe(&out)
    );
    Ok(())
}
