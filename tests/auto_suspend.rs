//! Auto-suspend and wake on demand (issue 19 item 4), and the gateway's answers to a
//! session being suspended or suspended, end to end against a real `kruntimes up`: a
//! session with `autoSuspendAfter` is suspended by its owner once its queue has been empty
//! that long (heartbeats do not count), with the `kruntimes.io/auto-suspended` marker; the
//! next `exec` through the Rust SDK wakes it (503 `SessionWaking`, retried by the SDK) and
//! succeeds once, at the same endpoint, with its files and its sequence numbers going on.
//! An explicitly suspended session answers 409 `SessionSuspended` and is not woken; new
//! work sent while a suspend waits for an accepted operation answers 409
//! `SessionSuspending`; an expired lease with auto-suspend set suspends instead of ending
//! the session. Every wait is a watch or a condition with a deadline.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use anyhow::{Context, Result, ensure};
use common::{DEADLINE, Endpoint, Seen, create, create_runtime, wait_for, wait_ready};
use http_body_util::BodyExt;
use kruntimes_api::lifecycle::AUTO_SUSPENDED_ANNOTATION;
use kruntimes_api::run::{RunEndpoint, RunMode, RunResources, SessionMode};
use kruntimes_api::{Phase, Run, RunSpec};
use kruntimes_client::Connection;
use kruntimes_client::sandbox::{Sandbox, SandboxError};
use kruntimes_client::session::{Command, EventKind, Operation, OperationState};
use kruntimes_testkit::{Options, Server, within};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};

/// An exclusive session Run of `runtime` with `mode`.
fn session(runtime: &str, mode: SessionMode) -> RunSpec {
    let mut spec = RunSpec::task(runtime, "unused");
    spec.mode = RunMode {
        session: Some(mode),
        ..RunMode::default()
    };
    spec.resources = Some(RunResources {
        exclusive: Some(true),
        ..RunResources::default()
    });
    spec
}

fn auto_suspending(after: &str) -> SessionMode {
    SessionMode {
        auto_suspend_after: Some(after.to_string()),
        ..SessionMode::default()
    }
}

/// Runs `line` through the SDK: one session opened, one operation sent, its events read.
async fn exec(sandbox: &Sandbox, line: &str) -> Result<Seen> {
    let mut session = sandbox.open_session().await?;
    common::exec(&mut session, line).await
}

fn endpoint_of(run: &Run) -> Option<RunEndpoint> {
    run.status.as_ref()?.endpoint.clone()
}

/// A raw client of the session's endpoint (the admin's token), to see the gateway's
/// answers as they are.
fn raw(server: &Server, endpoint: &RunEndpoint) -> Result<Endpoint> {
    let token = kruntimes_testkit::admin_token(&server.kubeconfig_path())?;
    Endpoint::of(endpoint, &token)
}

/// One request to `{base}{suffix}`: its status, its `reason` and its `Retry-After`.
async fn answer(
    endpoint: &Endpoint,
    method: http::Method,
    suffix: &str,
    body: &str,
) -> Result<(u16, String, Option<String>)> {
    let request = http::Request::builder()
        .method(method)
        .uri(format!("{}{suffix}", endpoint.path))
        .header("content-type", "application/json")
        .body(kube::client::Body::from(body.as_bytes().to_vec()))?;
    let response = endpoint.client.send(request).await?;
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    // A refusal is one short JSON object; a success streams on, and is not read here.
    if status == 200 {
        return Ok((status, String::new(), retry_after));
    }
    let bytes = response.into_body().collect().await?.to_bytes();
    let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    let reason = body["reason"].as_str().unwrap_or_default().to_string();
    Ok((status, reason, retry_after))
}

const OPERATION: &str = r#"{"command": {"shell": "echo more > more"}}"#;

fn marker(run: &Run) -> Option<String> {
    run.annotations().get(AUTO_SUSPENDED_ANNOTATION).cloned()
}

#[tokio::test]
async fn an_idle_session_suspends_on_its_own_and_the_next_exec_wakes_it() -> Result<()> {
    let (server, admin) = Server::start_async(Options::full()).await?;
    create_runtime(&admin, "solo", "bash", 1, 1).await?;
    create(&admin, "idle", session("solo", auto_suspending("3s"))).await?;
    let ready = wait_ready(&admin, "idle").await?;
    let endpoint = endpoint_of(&ready);
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection.sandbox("idle").await?;
    let wrote = exec(&sandbox, "echo kept > f && echo written").await?;
    ensure!(
        wrote.done.state == OperationState::Succeeded,
        "{}",
        wrote.stdout
    );
    let last_before = wrote.sequences.iter().copied().max().context("events")?;

    // Quiet for 3 s: the owner suspends it, marked as its own for this incarnation.
    let suspended = wait_for(&admin, "idle", "is Suspended", |run| {
        run.phase() == Phase::Suspended || run.phase().is_terminal()
    })
    .await?;
    ensure!(
        suspended.phase() == Phase::Suspended,
        "{:?}",
        suspended.status
    );
    assert!(suspended.spec.suspend_requested());
    assert_eq!(marker(&suspended).as_deref(), Some("1"));
    assert_eq!(
        endpoint_of(&suspended),
        endpoint,
        "an auto-suspended session keeps its endpoint, where a call wakes it"
    );

    // One exec: the SDK is answered 503 SessionWaking, tries again until the session is
    // Ready, and sees one successful result.
    let woken = exec(&sandbox, "cat f").await?;
    assert_eq!(woken.done.state, OperationState::Succeeded);
    assert_eq!(woken.stdout, "kept\n", "the file survived the suspend");
    let first_after = woken.sequences.iter().copied().min().context("events")?;
    assert!(
        first_after > last_before,
        "sequence numbers continue: {first_after} after {last_before}"
    );
    let run = Api::<Run>::namespaced(admin.clone(), "default")
        .get("idle")
        .await?;
    assert_eq!(run.incarnation(), 2, "{:?}", run.status);
    assert_eq!(endpoint_of(&run), endpoint, "the same endpoint");
    assert_eq!(marker(&run), None, "the wake removed the marker");
    Ok(())
}

#[tokio::test]
async fn an_explicitly_suspended_session_answers_409_and_is_not_woken() -> Result<()> {
    let (server, admin) = Server::start_async(Options::full()).await?;
    create_runtime(&admin, "solo", "bash", 1, 1).await?;
    // Auto-suspend is set, but far off: the user's own suspend is what is tested.
    create(&admin, "held", session("solo", auto_suspending("1h"))).await?;
    let ready = wait_ready(&admin, "held").await?;
    let endpoint = raw(&server, &endpoint_of(&ready).context("endpoint")?)?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection.sandbox("held").await?;
    sandbox.suspend().await?;
    let suspended = sandbox.wait_suspended(DEADLINE).await?;
    assert_eq!(marker(&suspended), None);

    // The gateway: 409 SessionSuspended, for an operation and for a read.
    let (status, reason, _) =
        answer(&endpoint, http::Method::POST, "/operations", OPERATION).await?;
    assert_eq!((status, reason.as_str()), (409, "SessionSuspended"));
    let (status, reason, _) = answer(&endpoint, http::Method::GET, "", "").await?;
    assert_eq!((status, reason.as_str()), (409, "SessionSuspended"));
    // The SDK: Suspended, without retrying.
    let refused = exec(&sandbox, "true").await.expect_err("suspended");
    assert!(
        matches!(
            refused.downcast_ref::<SandboxError>(),
            Some(SandboxError::Suspended { .. })
        ),
        "{refused:?}"
    );
    // A wake would have been written before the gateway answered: nothing was.
    let run = Api::<Run>::namespaced(admin.clone(), "default")
        .get("held")
        .await?;
    assert_eq!(run.phase(), Phase::Suspended);
    assert!(run.spec.suspend_requested(), "spec.suspend is still true");
    assert_eq!(run.incarnation(), 1);
    Ok(())
}

#[tokio::test]
async fn new_work_for_a_session_being_suspended_answers_409_session_suspending() -> Result<()> {
    let (server, admin) = Server::start_async(Options::full()).await?;
    create_runtime(&admin, "solo", "bash", 1, 1).await?;
    create(&admin, "busy", session("solo", SessionMode::default())).await?;
    let ready = wait_ready(&admin, "busy").await?;
    let endpoint = raw(&server, &endpoint_of(&ready).context("endpoint")?)?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection.sandbox("busy").await?;
    // An accepted operation holds the suspend at Ready until it ends (it never does here).
    let mut open = sandbox.open_session().await?;
    let long = open
        .send(&Operation::command(Command::shell("sleep 600")))
        .await?;
    within(DEADLINE, "the long operation starts", async {
        loop {
            let event = open.receive().await?;
            if event.operation_id == long && matches!(event.kind, EventKind::Started) {
                return Ok(());
            }
        }
    })
    .await?;
    sandbox.suspend().await?;
    let suspending = wait_for(&admin, "busy", "is asked to suspend", |run| {
        run.spec.suspend_requested()
    })
    .await?;
    assert_eq!(suspending.phase(), Phase::Ready);

    // Until the gateway's cache has the request, the owner refuses new work itself (409
    // too); then the gateway answers SessionSuspending. Each answer is a refusal.
    let refusal = |method: http::Method, suffix: &'static str, body: &'static str| {
        let endpoint = endpoint.clone();
        async move {
            within(DEADLINE, "the gateway answers SessionSuspending", async {
                loop {
                    let (status, reason, _) =
                        answer(&endpoint, method.clone(), suffix, body).await?;
                    ensure!(status == 409, "{suffix}: {status} {reason}");
                    if reason == "SessionSuspending" {
                        return Ok(());
                    }
                    tokio::task::yield_now().await;
                }
            })
            .await
        }
    };
    refusal(http::Method::POST, "/operations", OPERATION).await?;
    refusal(http::Method::PUT, "/files?path=upload.txt", "bytes").await?;
    // Reads still go through while it is Ready.
    let (status, _, _) = answer(&endpoint, http::Method::GET, "", "").await?;
    assert_eq!(status, 200);
    let run = Api::<Run>::namespaced(admin.clone(), "default")
        .get("busy")
        .await?;
    assert_eq!(run.phase(), Phase::Ready, "still Ready, being suspended");
    Ok(())
}

#[tokio::test]
async fn a_session_that_only_receives_heartbeats_still_suspends_on_its_own() -> Result<()> {
    let (server, admin) = Server::start_async(Options::full()).await?;
    create_runtime(&admin, "solo", "bash", 1, 1).await?;
    let mode = SessionMode {
        lease_timeout_seconds: Some(60),
        ..auto_suspending("2s")
    };
    create(&admin, "beating", session("solo", mode)).await?;
    let ready = wait_ready(&admin, "beating").await?;
    let endpoint = raw(&server, &endpoint_of(&ready).context("endpoint")?)?;
    // An SDK session held open all the while (as an agent between its turns holds one).
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let held = connection.sandbox("beating").await?.open_session().await?;
    // Heartbeats and reads, back to back, until the owner asks to suspend (a call after
    // that would wake it: every authorized call does).
    let stop = Arc::new(AtomicBool::new(false));
    let beats = Arc::new(AtomicU32::new(0));
    let beating = tokio::spawn({
        let (endpoint, stop, beats) = (endpoint.clone(), stop.clone(), beats.clone());
        async move {
            while !stop.load(Ordering::SeqCst) {
                let (status, reason, _) =
                    answer(&endpoint, http::Method::POST, ":renew", "").await?;
                ensure!(status == 200, "renew: {status} {reason}");
                let (status, reason, _) = answer(&endpoint, http::Method::GET, "", "").await?;
                ensure!(status == 200, "status: {status} {reason}");
                beats.fetch_add(1, Ordering::SeqCst);
            }
            Ok::<_, anyhow::Error>(())
        }
    });
    let asked = wait_for(&admin, "beating", "is asked to suspend", |run| {
        run.spec.suspend_requested() || run.phase().is_terminal()
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    // The last call may have raced the owner's write (then it was answered 503 and woke
    // the session, which suspends again 2 s later): only earlier answers must be 200.
    let _ = beating.await;
    let asked = asked?;
    assert_eq!(marker(&asked).as_deref(), Some("1"), "{:?}", asked.metadata);
    assert!(
        beats.load(Ordering::SeqCst) >= 2,
        "heartbeats flowed all the while"
    );
    let suspended = wait_for(&admin, "beating", "is Suspended", |run| {
        run.phase() == Phase::Suspended || run.phase().is_terminal()
    })
    .await?;
    assert_eq!(
        suspended.phase(),
        Phase::Suspended,
        "{:?}",
        suspended.status
    );

    // Heartbeats to the sleeping session are answered at once and do not wake it (they
    // did: each one asked a worker to resume it, so a client that held a session open
    // undid every auto-suspend): `:renew` answers its status, Suspended with no lease, and
    // a heartbeat frame on the open WebSocket answers no lease.
    let request = http::Request::builder()
        .method(http::Method::POST)
        .uri(format!("{}:renew", endpoint.path))
        .body(kube::client::Body::from(Vec::new()))?;
    let response = endpoint.client.send(request).await?;
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await?.to_bytes();
    let renewed: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    ensure!(
        status == 200,
        "renew of a sleeping session: {status} {renewed}"
    );
    // The phase is the gateway's view of the Run, which may lag a moment behind the
    // Suspended this test saw (still Ready, being suspended by its owner): asleep either way.
    ensure!(
        renewed["state"] == "Suspended"
            && (renewed["phase"] == "Suspended" || renewed["phase"] == "Ready")
            && renewed["runName"] == "beating"
            && renewed.get("leaseExpiresAt").is_none(),
        "{renewed}"
    );
    let lease = held.heartbeat().await?;
    ensure!(lease.is_none(), "a sleeping session's lease: {lease:?}");
    let after = Api::<Run>::namespaced(admin.clone(), "default")
        .get("beating")
        .await?;
    ensure!(
        after.phase() == Phase::Suspended
            && after.spec.suspend_requested()
            && after.incarnation() == suspended.incarnation()
            && marker(&after) == marker(&suspended),
        "the heartbeats woke it: {:?} {:?}",
        after.spec.suspend,
        after.status
    );
    Ok(())
}

#[tokio::test]
async fn an_expired_lease_with_auto_suspend_suspends_instead_of_ending() -> Result<()> {
    let (_server, admin) = Server::start_async(Options::full()).await?;
    create_runtime(&admin, "solo", "bash", 1, 1).await?;
    let mode = SessionMode {
        lease_timeout_seconds: Some(2),
        ..auto_suspending("1h")
    };
    create(&admin, "leased", session("solo", mode)).await?;
    wait_ready(&admin, "leased").await?;
    // No heartbeat: the lease expires after 2 s, long before the hour.
    let run = wait_for(&admin, "leased", "is Suspended or ended", |run| {
        run.phase() == Phase::Suspended || run.phase().is_terminal()
    })
    .await?;
    assert_eq!(
        run.phase(),
        Phase::Suspended,
        "not Timeout: {:?}",
        run.status
    );
    assert_eq!(marker(&run).as_deref(), Some("1"));
    // The user may take it back explicitly: a resume clears the request as any other.
    Api::<Run>::namespaced(admin.clone(), "default")
        .patch(
            "leased",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"suspend": false}})),
        )
        .await?;
    wait_ready(&admin, "leased").await?;
    Ok(())
}
