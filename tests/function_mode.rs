//! Function mode end to end: `kruntimes up` with its controller-manager, local workers,
//! gateway and default Runtimes; functions registered through the API and invoked over
//! HTTPS through the gateway, with the CA bundle the Run publishes.

mod common;

use anyhow::{Context, Result};
use common::{
    DEADLINE, Endpoint, create, create_runtime, endpoint, function, function_workspace,
    pem_certificates, processes_with, python, ready_condition, runtimed_of, wait_for, wait_ready,
    wait_terminal, workload_processes,
};
use kruntimes_api::lifecycle::REGISTRATION_FINALIZER;
use kruntimes_api::run::{EnvVar, RetryPolicy, RunEndpoint, Termination, TerminationMode};
use kruntimes_api::{Phase, Run};
use kruntimes_testkit::{Options, Server, within};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::wait::await_condition;
use kube::{Client, ResourceExt};
use serde_json::json;

fn assigned(run: &Run) -> (String, String) {
    let status = run.status.clone().unwrap_or_default();
    (
        status.assigned_pod.unwrap_or_default(),
        status.assigned_pod_uid.unwrap_or_default(),
    )
}

const HANDLER: &str = r#"
import os, time

calls = 0

def handle(event):
    global calls
    calls += 1
    if event.get("fail"):
        raise ValueError("asked to fail: " + str(event["fail"]))
    if event.get("wait_for"):
        if event.get("started"):
            open(event["started"], "w").close()
        while not os.path.exists(event["wait_for"]):
            time.sleep(0.01)
    print("handled", calls)
    return {"echo": event, "calls": calls}
"#;

#[tokio::test]
async fn a_function_registers_serves_and_reports_failures() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let created = create(&client, "greeter", python(HANDLER)).await?;
    let uid = created.uid().context("uid")?;
    let run = wait_ready(&client, "greeter").await?;
    let status = run.status.clone().unwrap_or_default();
    assert_eq!(
        ready_condition(&run),
        Some(("True".into(), "FunctionRegistered".into()))
    );
    assert!(run.finalizers().iter().any(|f| f == REGISTRATION_FINALIZER));
    let published = status.endpoint.clone().context("endpoint")?;
    assert!(
        published.url.ends_with(&format!(
            "/v1/namespaces/default/runtimes/python/functions/{uid}:invoke"
        )),
        "{}",
        published.url
    );
    assert!(
        published
            .url
            .starts_with(server.gateway_url().context("gateway")?)
    );
    // Every call below goes through TLS verified with the published CA bundle alone.
    let fe = endpoint(&server, &run)?;

    let ok = fe.invoke_json("call-1", json!({"n": 1})).await?;
    assert_eq!(ok.status, 200, "{ok:?}");
    assert_eq!(ok.invocation_id.as_deref(), Some("call-1"));
    assert_eq!(ok.body["outcome"], "Succeeded");
    assert_eq!(ok.body["result"], json!({"echo": {"n": 1}, "calls": 1}));
    assert_eq!(ok.body["invocationId"], "call-1");
    assert_eq!(ok.body["run"]["name"], "greeter");
    assert!(
        ok.body["stdout"]
            .as_str()
            .unwrap_or_default()
            .contains("handled 1"),
        "{ok:?}"
    );
    // The interpreter stays loaded: module state survives between calls.
    let again = fe.invoke_json("call-2", json!({})).await?;
    assert_eq!(again.body["result"]["calls"], 2, "{again:?}");

    // A handler exception is a failed invocation, answered 200; the Run stays Ready.
    let failed = fe.invoke_json("call-3", json!({"fail": "boom"})).await?;
    assert_eq!(failed.status, 200, "{failed:?}");
    assert_eq!(failed.invocation_id.as_deref(), Some("call-3"));
    assert_eq!(failed.body["outcome"], "Failed");
    assert_eq!(failed.body["error"]["type"], "ValueError");
    assert!(
        failed.body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("asked to fail: boom")
    );
    assert!(
        failed.body["error"]["traceback"]
            .as_str()
            .unwrap_or_default()
            .contains("raise ValueError")
    );
    let still = Api::<Run>::namespaced(client.clone(), "default")
        .get("greeter")
        .await?;
    assert_eq!(still.phase(), Phase::Ready);

    // One invocation in flight per function: the second is refused at once with 429. The
    // held call runs alone until its handler says it started (a marker file), so it is
    // never the one refused.
    // In the workspace: the only host directory a sandboxed handler sees.
    let gate = function_workspace(&server, &uid).await?;
    let release = gate.join("release");
    let started = gate.join("started");
    let holder = {
        let fe = fe.clone();
        let event = json!({"wait_for": release.display().to_string(), "started": started.display().to_string()});
        tokio::spawn(async move { fe.invoke_json("held", event).await })
    };
    within(DEADLINE, "the held invocation starts", async {
        while !started.exists() {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        Ok(())
    })
    .await?;
    let refused = fe.invoke_json("second", json!({})).await?;
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(refused.invocation_id.as_deref(), Some("second"));
    assert_eq!(refused.body["code"], 429);
    std::fs::write(&release, "go")?;
    let held = holder.await??;
    assert_eq!(held.status, 200, "{held:?}");
    assert_eq!(held.body["outcome"], "Succeeded");

    // Bounds: a 2 MiB body is 413, an invocation ID over 128 bytes is 400, a body that is
    // not JSON is 400; each answer carries the invocation ID it could.
    let big = format!("\"{}\"", "x".repeat(2 * 1024 * 1024));
    let too_big = fe.invoke(Some("big"), big.into_bytes()).await?;
    assert_eq!(too_big.status, 413, "{too_big:?}");
    assert_eq!(too_big.invocation_id.as_deref(), Some("big"));
    let long_id = "i".repeat(129);
    let bad_id = fe.invoke(Some(&long_id), b"{}".to_vec()).await?;
    assert_eq!(bad_id.status, 400, "{bad_id:?}");
    let not_json = fe.invoke(Some("nj"), b"{oops".to_vec()).await?;
    assert_eq!(not_json.status, 400, "{not_json:?}");
    let generated = fe.invoke(None, b"{}".to_vec()).await?;
    assert_eq!(generated.status, 200);
    assert_eq!(
        generated.invocation_id.as_deref().map(str::len),
        Some(32),
        "a missing ID is generated and echoed"
    );

    // An unknown UID is 404.
    let unknown = fe
        .for_uid("00000000-0000-0000-0000-000000000000")
        .invoke_json("u", json!({}))
        .await?;
    assert_eq!(unknown.status, 404, "{unknown:?}");
    assert_eq!(unknown.invocation_id.as_deref(), Some("u"));

    // Without a token: 401; with a token of someone who may not get the Run: 403.
    let anonymous = {
        let mut config = kube::Config::new(
            server
                .gateway_url()
                .context("gateway")?
                .parse()
                .context("gateway URL")?,
        );
        config.root_cert = Some(pem_certificates(
            published
                .ca_bundle
                .as_ref()
                .map(|b| b.0.as_slice())
                .unwrap_or_default(),
        )?);
        config.default_retry = false;
        Endpoint {
            client: Client::try_from(config)?,
            path: fe.path.clone(),
        }
    };
    assert_eq!(anonymous.invoke_json("a", json!({})).await?.status, 401);

    // A bash function: the script reads the request on stdin; its stdout is the result.
    create(
        &client,
        "shout",
        function(
            "bash",
            "main.sh",
            "read -r line\necho \"log line\" >&2\nprintf '{\"got\": %s}' \"$line\"\n",
        ),
    )
    .await?;
    let shout = wait_ready(&client, "shout").await?;
    let answer = endpoint(&server, &shout)?
        .invoke_json("b1", json!({"k": "v"}))
        .await?;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.body["result"], json!({"got": {"k": "v"}}));
    assert!(
        answer.body["stderr"]
            .as_str()
            .unwrap_or_default()
            .contains("log line")
    );

    // Metrics: the owner's runtimed (its Pod's `metrics` port) and the gateway count the
    // invocations by result, and runtimed the cold registrations.
    let (owner, _) = assigned(&run);
    let worker = metrics_of(&client, &owner).await?;
    for line in [
        "kruntimes_runtimed_invocations_total{result=\"succeeded\"}",
        "kruntimes_runtimed_invocations_total{result=\"failed\"}",
        "kruntimes_runtimed_invocations_total{result=\"rejected\"}",
        "kruntimes_runtimed_registrations_total{result=\"registered\"}",
        "kruntimes_runtimed_registration_duration_seconds_count",
        "kruntimes_runtimed_invocations_in_flight 0",
    ] {
        assert!(
            worker.contains(line),
            "runtimed metrics lack {line}:\n{worker}"
        );
    }
    let gateway = anonymous
        .client
        .request_text(http::Request::get("/metrics").body(Vec::new())?)
        .await?;
    for line in [
        "kruntimes_gateway_invocations_total{result=\"succeeded\"}",
        "kruntimes_gateway_invocations_total{result=\"failed\"}",
        "kruntimes_gateway_invocations_total{result=\"rejected\"}",
        "kruntimes_gateway_invocation_duration_seconds_bucket",
    ] {
        assert!(gateway.contains(line), "gateway metrics lack {line}");
    }
    Ok(())
}

/// The metrics text of the runtimed of worker Pod `pod`, from its `metrics` port.
async fn metrics_of(client: &Client, pod: &str) -> Result<String> {
    let pod = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), "default")
        .get(pod)
        .await?;
    let port = pod
        .spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some("metrics"))
        .map(|p| p.container_port)
        .context("the worker Pod has a metrics port")?;
    let metrics = Client::try_from(kube::Config::new(
        format!("http://127.0.0.1:{port}").parse()?,
    ))?;
    Ok(metrics
        .request_text(http::Request::get("/metrics").body(Vec::new())?)
        .await?)
}

#[tokio::test]
async fn not_ready_is_503_and_cancel_releases_the_slot() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    create_runtime(&client, "solo", "python", 1, 1).await?;
    // The import waits for a file in its workspace, so the function stays Running
    // (registering) until the test lets it go.
    let slow = "import os, time\nrelease = os.path.join(os.environ['KRUNTIME_WORKSPACE'], 'release')\nwhile not os.path.exists(release):\n    time.sleep(0.01)\n\ndef handle(event):\n    return 'ok'\n";
    let mut spec = function("solo", "main:handle", slow);
    spec.runtime = "solo".into();
    let created = create(&client, "slow", spec).await?;
    let uid = created.uid().context("uid")?;
    let registering = wait_for(&client, "slow", "registers", |run| {
        run.phase() == Phase::Running
    })
    .await?;
    assert_eq!(
        ready_condition(&registering),
        Some(("False".into(), "Registering".into()))
    );
    // Build the endpoint by hand: a Run that is not Ready has none yet.
    let token = kruntimes_testkit::admin_token(&server.kubeconfig_path())?;
    let ca = std::fs::read(server.data_dir().join("components/gateway-ca.crt"))?;
    let fe = Endpoint::of(
        &RunEndpoint {
            protocol: kruntimes_api::run::EndpointProtocol::Https,
            url: kruntimes_api::lifecycle::function_invoke_url(
                server.gateway_url().context("gateway")?,
                "default",
                "solo",
                &uid,
            ),
            ca_bundle: Some(kruntimes_api::run::ByteString(ca)),
        },
        &token,
    )?;
    let not_ready = fe.invoke_json("early", json!({})).await?;
    assert_eq!(not_ready.status, 503, "{not_ready:?}");
    assert_eq!(not_ready.invocation_id.as_deref(), Some("early"));

    std::fs::write(
        function_workspace(&server, &uid).await?.join("release"),
        "go",
    )?;
    wait_ready(&client, "slow").await?;
    assert_eq!(fe.invoke_json("now", json!({})).await?.body["result"], "ok");

    // The only slot is taken: a second function waits.
    let mut second = python("def handle(event):\n    return 2\n");
    second.runtime = "solo".into();
    create(&client, "second", second).await?;

    // Cancel: Cancelled, Ready=False, the invoke refused, the slot free for the second.
    Api::<Run>::namespaced(client.clone(), "default")
        .patch(
            "slow",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"termination": Termination { mode: TerminationMode::Immediate }}}),
            ),
        )
        .await?;
    let cancelled = wait_terminal(&client, "slow").await?;
    assert_eq!(
        cancelled.phase(),
        Phase::Cancelled,
        "{:?}",
        cancelled.status
    );
    assert_eq!(
        ready_condition(&cancelled),
        Some(("False".into(), "Cancelled".into()))
    );
    let after = fe.invoke_json("late", json!({})).await?;
    assert_eq!(after.status, 503, "{after:?}");
    let second = wait_ready(&client, "second").await?;
    assert_eq!(
        endpoint(&server, &second)?
            .invoke_json("s", json!({}))
            .await?
            .body["result"],
        2
    );
    Ok(())
}

#[tokio::test]
async fn idle_and_total_timeouts_end_functions() -> Result<()> {
    let mut options = Options::full();
    options.extra_args = vec!["--log-format".into(), "json".into()];
    options.log_filter = Some("warn,kruntimes_runtimed=info".into());
    let (server, client) = Server::start_async(options).await?;
    let mut idle = python("def handle(event):\n    return 1\n");
    if let Some(f) = idle.mode.function.as_mut() {
        f.idle_timeout_seconds = Some(1);
    }
    create(&client, "idle", idle).await?;
    let mut total = python("def handle(event):\n    return 1\n");
    total.timeout = Some("2s".into());
    create(&client, "total", total).await?;

    let idle = wait_terminal(&client, "idle").await?;
    let status = idle.status.clone().unwrap_or_default();
    assert_eq!(idle.phase(), Phase::Timeout, "{status:?}");
    assert_eq!(status.reason.as_deref(), Some("IdleTimeout"));
    assert_eq!(
        ready_condition(&idle),
        Some(("False".into(), "IdleTimeout".into()))
    );
    let total = wait_terminal(&client, "total").await?;
    let status = total.status.clone().unwrap_or_default();
    assert_eq!(total.phase(), Phase::Timeout, "{status:?}");
    assert_eq!(status.reason.as_deref(), Some("Timeout"));

    // With --log-format json the workers' runtimeds log one JSON object a line, with the
    // Runtime and the Run UID as fields.
    let uid = idle.uid().context("uid")?;
    let logs: Vec<serde_json::Value> = std::fs::read_dir(server.data_dir().join("workers"))?
        .flatten()
        .filter_map(|w| std::fs::read_to_string(w.path().join("runtimed.log")).ok())
        .flat_map(|text| text.lines().map(str::to_string).collect::<Vec<_>>())
        .filter_map(|line| serde_json::from_str(&line).ok())
        .collect();
    assert!(
        logs.iter().any(|l| l["message"] == "function registered"
            && l["run_uid"] == uid.as_str()
            && l["runtime"] == "python"),
        "no JSON line of the registration among {} lines",
        logs.len()
    );
    Ok(())
}

#[tokio::test]
async fn deletion_cleans_up_and_registration_failures_are_retried() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let runs = Api::<Run>::namespaced(client.clone(), "default");
    // A handler that starts a setsid'd grandchild: deletion must kill it too.
    let spawner = "import subprocess, os\nchild = subprocess.Popen(['sleep', '600'], start_new_session=True)\n\ndef handle(event):\n    return child.pid\n";
    let created = create(&client, "doomed", python(spawner)).await?;
    let uid = created.uid().context("uid")?;
    let run = wait_ready(&client, "doomed").await?;
    let answer = endpoint(&server, &run)?
        .invoke_json("pid", json!({}))
        .await?;
    // The pid the handler reports is in its own PID namespace when it is sandboxed: follow
    // the grandchild on the host by its environment (it carries the Run UID) instead.
    answer.body["result"]
        .as_i64()
        .with_context(|| format!("{answer:?}"))?;
    assert!(
        workload_processes(&uid).len() >= 2,
        "the interpreter and its setsid'd grandchild run: {:?}",
        workload_processes(&uid)
    );
    let workers = server.data_dir().join("workers");
    let workspace_exists = || -> bool {
        std::fs::read_dir(&workers)
            .into_iter()
            .flatten()
            .flatten()
            .any(|w| w.path().join("root/functions").join(&uid).exists())
    };
    assert!(workspace_exists(), "the workspace exists while registered");
    assert!(!processes_with(&uid).is_empty(), "the interpreter runs");

    runs.delete("doomed", &DeleteParams::default()).await?;
    within(DEADLINE, "the deleted function Run is gone", async {
        await_condition(runs.clone(), "doomed", |run: Option<&Run>| run.is_none()).await?;
        Ok(())
    })
    .await?;
    assert!(!workspace_exists(), "the workspace is removed");
    assert!(
        processes_with(&uid).is_empty(),
        "no process of the Run is left"
    );

    // An import that fails is a registration failure: retried, then Failed.
    let mut broken = python("raise RuntimeError('cannot load')\n");
    broken.retry_policy = Some(RetryPolicy {
        max_attempts: 2,
        backoff_seconds: None,
    });
    create(&client, "broken", broken).await?;
    let failed = wait_terminal(&client, "broken").await?;
    let status = failed.status.clone().unwrap_or_default();
    assert_eq!(failed.phase(), Phase::Failed, "{status:?}");
    assert_eq!(status.reason.as_deref(), Some("RegistrationFailed"));
    assert_eq!(status.attempt, Some(2), "{status:?}");
    assert!(
        status
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("cannot load"),
        "{status:?}"
    );
    // A terminal function Run is deleted without delay.
    runs.delete("broken", &DeleteParams::default()).await?;
    within(DEADLINE, "the failed function Run is gone", async {
        await_condition(runs.clone(), "broken", |run: Option<&Run>| run.is_none()).await?;
        Ok(())
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_worker_that_does_not_own_the_function_forwards_once() -> Result<()> {
    let mut options = Options::full();
    options.extra_args = vec!["--invoke-routing".into(), "service".into()];
    let (server, client) = Server::start_async(options).await?;
    create_runtime(&client, "pair", "python", 2, 4).await?;
    let mut spec = python("def handle(event):\n    return event\n");
    spec.runtime = "pair".into();
    create(&client, "routed", spec).await?;
    let run = wait_ready(&client, "routed").await?;
    let (owner, _) = assigned(&run);
    let fe = endpoint(&server, &run)?;
    // The gateway takes the workers in turn; one of two calls lands on the other worker,
    // which forwards it once to the owner.
    let mut hops = Vec::new();
    for i in 0..4 {
        let answer = fe.invoke_json(&format!("r{i}"), json!(i)).await?;
        assert_eq!(answer.status, 200, "{answer:?}");
        assert_eq!(answer.body["result"], json!(i));
        assert_eq!(
            answer.served_by.as_deref(),
            Some(owner.as_str()),
            "{answer:?}"
        );
        hops.push(answer.hops.clone().unwrap_or_default());
    }
    assert!(
        hops.iter().any(|h| h == "1"),
        "some call was forwarded: {hops:?}"
    );
    assert!(
        hops.iter().any(|h| h == "0"),
        "some call reached the owner: {hops:?}"
    );
    Ok(())
}

#[tokio::test]
async fn losing_the_owner_fences_and_reregisters_or_fails() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    create_runtime(&client, "duo", "python", 2, 4).await?;
    let mut spec = python("def handle(event):\n    return 'here'\n");
    spec.runtime = "duo".into();
    spec.retry_policy = Some(RetryPolicy {
        max_attempts: 2,
        backoff_seconds: None,
    });
    spec.env = Some(vec![EnvVar {
        name: "MARK".into(),
        value: "x".into(),
    }]);
    create(&client, "survivor", spec).await?;
    let run = wait_ready(&client, "survivor").await?;
    let (old_pod, old_uid) = assigned(&run);
    let fe = endpoint(&server, &run)?;
    assert_eq!(fe.invoke_json("before", json!({})).await?.status, 200);

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(runtimed_of(&old_pod)?),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    // Fenced, then registered again: a new attempt on a Pod that is not the old one.
    let again = wait_for(&client, "survivor", "is registered again", |run| {
        let (_, pod_uid) = assigned(run);
        (run.phase() == Phase::Ready && pod_uid != old_uid) || run.phase().is_terminal()
    })
    .await?;
    let status = again.status.clone().unwrap_or_default();
    assert_eq!(again.phase(), Phase::Ready, "{status:?}");
    assert_eq!(status.attempt, Some(2), "{status:?}");
    let (new_pod, _) = assigned(&again);
    for i in 0..3 {
        let answer = fe.invoke_json(&format!("after-{i}"), json!({})).await?;
        assert_eq!(answer.status, 200, "{answer:?}");
        assert_eq!(answer.served_by.as_deref(), Some(new_pod.as_str()));
        assert_eq!(answer.body["run"]["attempt"], 2);
    }

    // Without attempts left, losing the owner fails the Run.
    let mut once = python("def handle(event):\n    return 1\n");
    once.runtime = "duo".into();
    create(&client, "once", once).await?;
    let run = wait_ready(&client, "once").await?;
    let (pod, _) = assigned(&run);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(runtimed_of(&pod)?),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let failed = wait_terminal(&client, "once").await?;
    let status = failed.status.clone().unwrap_or_default();
    assert_eq!(failed.phase(), Phase::Failed, "{status:?}");
    assert_eq!(status.reason.as_deref(), Some("WorkerLost"));
    // The lost worker's interpreter does not outlive it.
    let uid = failed.uid().context("uid")?;
    within(DEADLINE, "the lost worker's interpreter exits", async {
        loop {
            if processes_with(&uid).is_empty() {
                return Ok(());
            }
            // Polling the process table: there is nothing to watch for the end of a
            // process we did not start.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await?;
    // Its registration finalizer is released by the controller-manager (the assigned Pod
    // is fenced), so deleting it completes without its runtimed.
    assert!(
        failed
            .finalizers()
            .iter()
            .any(|f| f == REGISTRATION_FINALIZER)
    );
    let runs = Api::<Run>::namespaced(client.clone(), "default");
    runs.delete("once", &DeleteParams::default()).await?;
    within(DEADLINE, "the orphaned function Run is deleted", async {
        await_condition(runs.clone(), "once", |run: Option<&Run>| run.is_none()).await?;
        Ok(())
    })
    .await?;
    Ok(())
}

/// Issue 19.6: a graceful restart of `kruntimes up` drained a function Run through its
/// retryPolicy: a retry was consumed, and a function with `maxAttempts: 1` ended
/// Failed/WorkerShutdown. Now the drain sends it back to register on the next start's
/// workers with reason `WorkerRestarted` (an Event says so): Ready again and invokable,
/// its attempt advanced (the fence) and counted in `status.workerRestarts`, not as a retry.
#[tokio::test]
async fn a_function_survives_a_graceful_restart_without_consuming_a_retry() -> Result<()> {
    let root = tempfile::tempdir()?;
    let options = Options {
        data_dir: Some(root.path().join("data")),
        ..Options::full()
    };
    let (mut server, client) = Server::start_async(options.clone()).await?;
    let mut spec = python(HANDLER);
    spec.retry_policy = Some(RetryPolicy {
        max_attempts: 1,
        backoff_seconds: None,
    });
    create(&client, "steady", spec).await?;
    let run = wait_ready(&client, "steady").await?;
    let ok = endpoint(&server, &run)?
        .invoke_json("before", json!({"n": 1}))
        .await?;
    assert_eq!(ok.status, 200, "{ok:?}");

    let exit =
        tokio::task::spawn_blocking(move || server.stop().map(|exit| (exit, server))).await??;
    anyhow::ensure!(exit.0.success(), "kruntimes up exited {}", exit.0);
    drop(exit.1);
    let (server, client) = Server::start_async(options).await?;
    let back = wait_for(&client, "steady", "is Ready again", |r| {
        r.phase() == Phase::Ready || r.phase().is_terminal()
    })
    .await?;
    let status = back.status.clone().unwrap_or_default();
    assert_eq!(back.phase(), Phase::Ready, "{status:?}");
    assert_eq!(status.attempt, Some(2), "the fence advanced: {status:?}");
    assert_eq!(
        status.worker_restarts,
        Some(1),
        "no retry consumed: {status:?}"
    );
    let ok = endpoint(&server, &back)?
        .invoke_json("after", json!({"n": 2}))
        .await?;
    assert_eq!(ok.status, 200, "{ok:?}");
    assert_eq!(ok.body["outcome"], "Succeeded", "{ok:?}");
    let event = kruntimes_testkit::events::wait_for(
        &client,
        "default",
        "steady",
        "WorkerRestarted",
        DEADLINE,
    )
    .await?;
    assert_eq!(event.type_.as_deref(), Some("Normal"), "{event:?}");
    Ok(())
}
