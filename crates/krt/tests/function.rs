//! `krt function` and `krt invoke` against the whole system of `kruntimes up`: a real python
//! function registered on the default `python` Runtime and invoked over HTTPS through the
//! real gateway, verified with the CA bundle the Run publishes.
//!
//! The tests wait on conditions under deadlines; they never sleep to synchronise. Needs
//! `cargo build -p kruntimes -p kruntimes-runtime-server -p krt` first.

use std::process::Stdio;

use anyhow::{Context, Result, ensure};
use kruntimes_api::run::ByteString;
use kruntimes_api::{Phase, Run};
use kruntimes_testkit::{Options, Server, within};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

mod common;
use common::{
    DEADLINE, code, describe, krt_cmd, krt_exits, krt_fails, krt_ok, runs, text, wait_run,
    workspace_of,
};

/// A handler that echoes its event, prints on both streams, and raises when asked to.
const HANDLER: &str = r#"
import sys

def handle(event):
    print("got", event)
    print("to stderr", file=sys.stderr)
    if event.get("fail"):
        raise ValueError("asked to fail: " + str(event["fail"]))
    return {"sum": event.get("a", 0) + 1, "event": event}
"#;

/// Writes `source` to a file named `file` in `dir`; returns its path as a string.
fn source_file(dir: &tempfile::TempDir, file: &str, source: &str) -> Result<String> {
    let path = dir.path().join(file);
    std::fs::write(&path, source)?;
    path.to_str()
        .map(str::to_string)
        .context("a UTF-8 temporary path")
}

/// The arguments of `krt function create NAME -r RUNTIME -f FILE --handler HANDLER EXTRA…`
/// (the short options; the first test spells out the long ones).
fn create_args<'a>(
    name: &'a str,
    runtime: &'a str,
    file: &'a str,
    handler: &'a str,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec![
        "function",
        "create",
        name,
        "-r",
        runtime,
        "-f",
        file,
        "--handler",
        handler,
    ];
    args.extend_from_slice(extra);
    args
}

/// The table rows of `krt function list`, split into cells.
fn rows(table: &str) -> Vec<Vec<String>> {
    table
        .lines()
        .map(|line| line.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// `krt invoke NAME --data -` with `stdin` on its stdin.
async fn invoke_with_stdin(
    server: &Server,
    name: &str,
    stdin: &[u8],
) -> Result<std::process::Output> {
    let mut cmd = krt_cmd(server, &["invoke", name, "--data", "-"])?;
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn()?;
    let mut pipe = child.stdin.take().context("piped stdin")?;
    pipe.write_all(stdin).await?;
    drop(pipe);
    within(DEADLINE, "krt invoke --data -", async {
        Ok(child.wait_with_output().await?)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_list_invoke_and_delete_a_python_function() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let dir = tempfile::tempdir()?;
    // The file's own name does not matter: the handler's module names the source.
    let file = source_file(&dir, "handler.py", HANDLER)?;

    // create waits for Ready and prints the endpoint URL.
    let out = krt_ok(
        &server,
        &[
            "function",
            "create",
            "greeter",
            "--runtime",
            "python",
            "--file",
            &file,
            "--handler",
            "main:handle",
            "--idle-timeout",
            "10m",
            "--env",
            "GREETING=hi",
        ],
    )
    .await?;
    let url = text(&out.stdout).trim().to_string();
    let run = runs(&client).get("greeter").await?;
    assert_eq!(run.phase(), Phase::Ready, "{:?}", run.status);
    let endpoint = run
        .status
        .as_ref()
        .and_then(|s| s.endpoint.as_ref())
        .context("a Ready function has an endpoint")?;
    assert_eq!(url, endpoint.url, "{}", describe(&out));
    assert!(
        url.starts_with("https://") && url.ends_with(":invoke"),
        "{url}"
    );
    let function = run.spec.mode.function.as_ref().context("function mode")?;
    assert_eq!(function.handler, "main:handle");
    assert_eq!(function.idle_timeout_seconds, Some(600));
    assert_eq!(
        run.spec.source.as_ref().and_then(|s| s.inline.as_deref()),
        Some(HANDLER)
    );

    // list shows functions only, with phase, readiness and endpoint.
    krt_ok(
        &server,
        &["run", "--runtime", "bash", "--name", "a-task", "--", "true"],
    )
    .await?;
    let out = krt_ok(&server, &["function", "list"]).await?;
    let table = rows(&text(&out.stdout));
    assert_eq!(
        table.first().map(Vec::as_slice),
        Some(&["NAME", "RUNTIME", "PHASE", "READY", "ENDPOINT", "AGE"].map(String::from)[..]),
        "{}",
        describe(&out)
    );
    assert_eq!(table.len(), 2, "the task is not listed: {}", describe(&out));
    assert_eq!(
        &table[1][..5],
        ["greeter", "python", "Ready", "True", url.as_str()],
        "{}",
        describe(&out)
    );

    // invoke prints the result as JSON on stdout; the handler's prints go to stderr.
    let out = krt_ok(&server, &["invoke", "greeter", "--data", r#"{"a":1}"#]).await?;
    let result: Value = serde_json::from_slice(&out.stdout).context(describe(&out))?;
    assert_eq!(result, json!({"sum": 2, "event": {"a": 1}}));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("got {'a': 1}") && stderr.contains("to stderr"),
        "{}",
        describe(&out)
    );

    // -o json prints the whole answer, with the caller's invocation ID.
    let out = krt_ok(
        &server,
        &[
            "invoke",
            "greeter",
            "-d",
            r#"{"a":41}"#,
            "--id",
            "call-7",
            "-o",
            "json",
        ],
    )
    .await?;
    let answer: Value = serde_json::from_slice(&out.stdout).context(describe(&out))?;
    assert_eq!(answer["invocationId"], "call-7", "{answer}");
    assert_eq!(answer["outcome"], "Succeeded", "{answer}");
    assert_eq!(answer["result"]["sum"], 42, "{answer}");
    assert_eq!(answer["run"]["name"], "greeter", "{answer}");
    assert!(
        answer["stdout"].as_str().is_some_and(|s| s.contains("got")),
        "{answer}"
    );

    // The payload from stdin and from a file; no --data sends {}.
    let out = invoke_with_stdin(&server, "greeter", br#"{"a": 2}"#).await?;
    assert_eq!(code(&out), 0, "{}", describe(&out));
    assert_eq!(
        serde_json::from_slice::<Value>(&out.stdout)?["sum"],
        3,
        "{}",
        describe(&out)
    );
    let event = source_file(&dir, "event.json", r#"{"a": 9}"#)?;
    let out = krt_ok(
        &server,
        &["invoke", "greeter", "--data", &format!("@{event}")],
    )
    .await?;
    assert_eq!(
        serde_json::from_slice::<Value>(&out.stdout)?["sum"],
        10,
        "{}",
        describe(&out)
    );
    let out = krt_ok(&server, &["invoke", "greeter"]).await?;
    assert_eq!(
        serde_json::from_slice::<Value>(&out.stdout)?,
        json!({"sum": 1, "event": {}}),
        "{}",
        describe(&out)
    );

    // A handler that raises: exit 3, the exception's type, message and traceback on
    // stderr, nothing on stdout; the function stays Ready.
    let out = krt_exits(
        &server,
        &[
            "invoke",
            "greeter",
            "--data",
            r#"{"fail":"boom"}"#,
            "--id",
            "call-8",
        ],
        3,
    )
    .await?;
    assert!(out.stdout.is_empty(), "{}", describe(&out));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("Traceback")
            && stderr.contains(
                "krt: function greeter failed (invocation call-8): ValueError: asked to fail: boom"
            ),
        "{}",
        describe(&out)
    );
    // With -o json the failure is in the answer, with the same exit code.
    let out = krt_exits(
        &server,
        &["invoke", "greeter", "-d", r#"{"fail":1}"#, "-o", "json"],
        3,
    )
    .await?;
    let answer: Value = serde_json::from_slice(&out.stdout).context(describe(&out))?;
    assert_eq!(answer["outcome"], "Failed", "{answer}");
    assert_eq!(answer["error"]["type"], "ValueError", "{answer}");
    assert_eq!(runs(&client).get("greeter").await?.phase(), Phase::Ready);

    // What cannot be invoked fails clearly, with exit 1.
    for (args, expected) in [
        (
            &["invoke", "nosuch"][..],
            "run nosuch not found in namespace default",
        ),
        (
            &["invoke", "a-task"],
            "run a-task in namespace default is a task Run, not a function",
        ),
        (
            &["invoke", "greeter", "--data", "{nope"],
            "--data: the invocation is malformed: the payload is not one JSON value",
        ),
        (&["invoke", "greeter", "--id", "has space"], "--id: "),
    ] {
        krt_fails(&server, args, expected).await?;
    }

    // krt delete removes a function like any Run; then it is not found.
    krt_ok(&server, &["delete", "greeter"]).await?;
    wait_run(&client, "greeter", "is gone", |run: Option<&Run>| {
        run.is_none()
    })
    .await?;
    krt_fails(
        &server,
        &["invoke", "greeter"],
        "run greeter not found in namespace default",
    )
    .await?;
    let out = krt_ok(&server, &["function", "list"]).await?;
    assert!(out.stdout.is_empty(), "{}", describe(&out));
    assert!(
        text(&out.stderr).contains("No functions found in namespace default."),
        "{}",
        describe(&out)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_fails_clearly_when_the_function_cannot_be_registered() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let dir = tempfile::tempdir()?;
    let broken = source_file(&dir, "broken.py", "raise RuntimeError('cannot load')\n")?;
    let good = source_file(&dir, "good.py", "def handle(event):\n    return 1\n")?;

    // An import error: the Run ends Failed/RegistrationFailed, and create says so.
    let out = krt_exits(
        &server,
        &create_args("broken", "python", &broken, "main:handle", &[]),
        1,
    )
    .await?;
    assert!(out.stdout.is_empty(), "{}", describe(&out));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("function broken ended Failed before it was ready: RegistrationFailed")
            && stderr.contains("cannot load")
            && stderr.contains("krt get run broken -o yaml"),
        "{}",
        describe(&out)
    );
    let run = runs(&client).get("broken").await?;
    assert_eq!(run.phase(), Phase::Failed);
    // Invoking it says it has ended.
    krt_fails(
        &server,
        &["invoke", "broken"],
        "function broken is not ready (phase Failed: RegistrationFailed",
    )
    .await?;

    // --no-wait returns at once; the same name again is refused.
    let out = krt_ok(
        &server,
        &create_args("later", "python", &good, "main:handle", &["--no-wait"]),
    )
    .await?;
    assert_eq!(
        text(&out.stdout).trim(),
        "run/later created",
        "{}",
        describe(&out)
    );
    let exists = "run later already exists in namespace default; pick another name or `krt delete later` first";
    krt_fails(
        &server,
        &create_args("later", "python", &good, "main:handle", &[]),
        exists,
    )
    .await?;

    // A wait that gives up says where the function is; it goes on.
    let out = krt_exits(
        &server,
        &create_args(
            "slow",
            "python",
            &good,
            "main:handle",
            &["--wait-timeout", "1ms"],
        ),
        1,
    )
    .await?;
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("function slow was not ready after 1ms (phase ")
            && stderr.contains("it goes on: `krt function list` shows it"),
        "{}",
        describe(&out)
    );
    wait_run(&client, "slow", "is Ready", |run: Option<&Run>| {
        run.is_some_and(|r| r.phase() == Phase::Ready)
    })
    .await?;

    // Mistakes found before any request, and a missing Runtime.
    let missing = dir.path().join("missing.py");
    let missing = missing.to_str().context("utf-8")?;
    for (args, expected) in [
        (
            create_args("x", "python", missing, "m:f", &[]),
            "no such file",
        ),
        (
            create_args("x", "python", &good, "m:f", &["--idle-timeout", "5"]),
            "--idle-timeout",
        ),
        (
            create_args("x", "nope", &good, "m:f", &[]),
            "runtime \"nope\" not found in namespace default; Runtimes there: bash, python",
        ),
    ] {
        krt_fails(&server, &args, expected).await?;
    }
    let names: Vec<String> = runs(&client)
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter_map(|r| r.metadata.name)
        .collect();
    ensure!(
        !names.contains(&"x".to_string()),
        "nothing was created: {names:?}"
    );
    Ok(())
}

/// A self-signed CA that signed nothing of the system under test.
const UNRELATED_CA: &str = "-----BEGIN CERTIFICATE-----
MIIBjzCCATWgAwIBAgIUCUzXAm7hoqfJ5pKMuqGdX+70ykEwCgYIKoZIzj0EAwIw
HDEaMBgGA1UEAwwRdW5yZWxhdGVkIHRlc3QgQ0EwIBcNMjYxMTMwMDgxOTEyWhgP
MjEyNjExMDYwODE5MTJaMBwxGjAYBgNVBAMMEXVucmVsYXRlZCB0ZXN0IENBMFkw
EwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEO2HTG7WQnws1ljPZh8fqfXWGhVXXTG8n
3N8KnA6xM4CTdjKXbW5SiQlN+BRI0h4GB8XGRExo47k04DxYTMuY8qNTMFEwHQYD
VR0OBBYEFPaPIU2vINC0uJNDuFGN4YfRGVbZMB8GA1UdIwQYMBaAFPaPIU2vINC0
uJNDuFGN4YfRGVbZMA8GA1UdEwEB/wQFMAMBAf8wCgYIKoZIzj0EAwIDSAAwRQIh
AIl2x9sN7XboTWU1ecrzc1EaLibKjaY6EZkiKJlb4G6+AiB+bGzVseDfylNNH43f
c6lgXq5hn8sk9XYNx9T+E4EDqw==
-----END CERTIFICATE-----
";

/// A handler that, when asked, holds the call until the test lets it go: it writes the
/// file `started`, then waits (inside the sandbox) until the file `go` exists. Marker
/// files rather than FIFOs: a gVisor sandbox cannot open a FIFO made on the host.
const HOLDING_HANDLER: &str = r#"
import os, time
def handle(event):
    if "started" in event:
        with open(event["started"] + ".tmp", "w") as f:
            f.write("in flight")
        os.rename(event["started"] + ".tmp", event["started"])
        while not os.path.exists(event["go"]):
            time.sleep(0.005)
    return "done"
"#;

/// `run` with its endpoint changed by `change`.
fn with_endpoint(run: &Run, change: impl Fn(&mut kruntimes_api::run::RunEndpoint)) -> Result<Run> {
    let mut run = run.clone();
    let endpoint = run
        .status
        .as_mut()
        .and_then(|s| s.endpoint.as_mut())
        .context("an endpoint")?;
    change(endpoint);
    Ok(run)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_says_whether_an_invocation_was_sent() -> Result<()> {
    use kruntimes_client::{Connection, FunctionSpec, InvokeError, Outcome};

    let (server, _client) = Server::start_async(Options::full()).await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let functions = connection.functions();
    functions
        .create(&FunctionSpec::new(
            "holder",
            "python",
            "main:handle",
            HOLDING_HANDLER,
        ))
        .await?;
    let run = functions.wait_ready("holder", DEADLINE).await?;
    let answer = functions.invoke(&run, &json!({}), Some("first")).await?;
    assert_eq!(answer.outcome, Outcome::Succeeded);
    assert_eq!(answer.result, json!("done"));
    assert_eq!(answer.invocation_id, "first");

    // One call at a time: a second call while one is in flight is refused with 429 at
    // once (not retried by the client), and did not run.
    // The marker files live in the function's workspace, the one host directory a
    // sandboxed handler sees.
    let uid = kube::ResourceExt::uid(&run).context("uid")?;
    let dir = workspace_of(&server, &format!("functions/{uid}")).await?;
    let (started, go) = (dir.join("started"), dir.join("go"));
    let event = json!({"started": started, "go": go});
    let held = {
        let (functions, run) = (functions.clone(), run.clone());
        tokio::spawn(async move { functions.invoke(&run, &event, Some("held")).await })
    };
    within(DEADLINE, "the held call to reach the handler", async {
        while !started.exists() {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        Ok(())
    })
    .await?;
    let refused = functions
        .invoke(&run, &json!({}), Some("second"))
        .await
        .err()
        .context("a second call in flight is refused")?;
    assert_eq!(refused.status(), Some(429), "{refused}");
    assert!(!refused.outcome_unknown(), "{refused}");
    assert_eq!(refused.invocation_id(), Some("second"));
    within(DEADLINE, "the held call to be let go", async {
        Ok(tokio::task::spawn_blocking(move || std::fs::write(go, "go")).await??)
    })
    .await?;
    let held = within(DEADLINE, "the held call", async { Ok(held.await??) }).await?;
    assert_eq!(held.outcome, Outcome::Succeeded);

    // A UID the gateway does not know: 404, with the invocation ID echoed.
    let unknown = with_endpoint(&run, |e| {
        e.url = e.url.replace(":invoke", "0:invoke");
    })?;
    let e = functions
        .invoke(&unknown, &json!({}), Some("lost"))
        .await
        .err()
        .context("unknown UID")?;
    assert!(
        matches!(&e, InvokeError::Http { status: 404, invocation_id: Some(id), .. } if id == "lost"),
        "{e:?}"
    );

    // A certificate the Run's CA bundle does not vouch for, and a port nobody listens on:
    // the invocation was not sent.
    let untrusted = with_endpoint(&run, |e| {
        e.ca_bundle = Some(ByteString(UNRELATED_CA.as_bytes().to_vec()))
    })?;
    let e = functions
        .invoke(&untrusted, &json!({}), None)
        .await
        .err()
        .context("untrusted certificate")?;
    assert!(matches!(e, InvokeError::NotSent { .. }), "{e:?}");
    assert!(!e.outcome_unknown());
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await?
        .local_addr()?;
    let gateway = server.gateway_url().context("a gateway")?.to_string();
    let nobody = with_endpoint(&run, |e| {
        e.url = e.url.replace(&gateway, &format!("https://{closed}"));
    })?;
    let e = functions
        .invoke(&nobody, &json!({}), None)
        .await
        .err()
        .context("closed port")?;
    assert!(matches!(e, InvokeError::NotSent { .. }), "{e:?}");
    assert!(e.to_string().contains("the invocation was not sent"), "{e}");
    Ok(())
}
