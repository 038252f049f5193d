//! Idle expiry of sessions (issue 19 item 5), end to end against the real `kruntimes up`
//! with a short idle TTL: an idle session ends Timeout/IdleTimeout and the controller-
//! manager's `kruntimes_session_expired_total` moves; one that keeps receiving operations
//! stays Ready, its `status.session.lastActivityTime` written at a bounded rate; one that
//! only receives reads expires all the same; a Run's longer `idleTimeout` is clamped to the
//! TTL; and a negative TTL is refused at start.

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use futures::StreamExt;
use kruntimes_api::{Phase, Run};
use kruntimes_client::Connection;
use kruntimes_client::sandbox::{AcquireOptions, ListFilesOptions, ReleaseOptions};
use kruntimes_client::session::{Command, OperationState};
use kruntimes_testkit::{Options, Server, within};
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};

use common::{ready_condition, wait_terminal};

/// The idle TTL of these tests; `kruntimes up` makes the workers' activity interval a
/// tenth of it (300 ms).
const TTL: Duration = Duration::from_secs(3);
const ACTIVITY_INTERVAL: Duration = Duration::from_millis(300);
const DEADLINE: Duration = Duration::from_secs(60);

async fn expired_total(server: &Server) -> Result<u64> {
    let url = server
        .controller_metrics_url()
        .context("kruntimes up printed its controller-manager metrics address")?;
    let base = url.trim_end_matches("/metrics");
    let metrics = Client::try_from(kube::Config::new(base.parse()?))?;
    let text = metrics
        .request_text(http::Request::get("/metrics").body(Vec::new())?)
        .await?;
    text.lines()
        .find_map(|l| l.strip_prefix("kruntimes_session_expired_total "))
        .context(format!("no kruntimes_session_expired_total in:\n{text}"))?
        .trim()
        .parse::<u64>()
        .context("parse the counter")
}

fn ended_idle(run: &Run) -> Result<String> {
    let status = run.status.clone().unwrap_or_default();
    ensure!(
        run.phase() == Phase::Timeout && status.reason.as_deref() == Some("IdleTimeout"),
        "{} ended {:?}/{:?}: {:?}",
        run.name_any(),
        status.phase,
        status.reason,
        status.message
    );
    assert_eq!(
        ready_condition(run),
        Some(("False".to_string(), "IdleTimeout".to_string()))
    );
    Ok(status.message.unwrap_or_default())
}

/// The idle, the busy and the read-only session share one `kruntimes up`.
#[tokio::test]
async fn idle_sessions_expire_and_busy_ones_do_not() -> Result<()> {
    let mut options = Options::full();
    options.extra_args = [
        "--session-idle-ttl",
        "3s",
        "--session-idle-sweep-interval",
        "200ms",
    ]
    .map(String::from)
    .to_vec();
    let (server, client) = Server::start_async(options).await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let bash = connection.runtime("bash");
    assert_eq!(expired_total(&server).await?, 0);

    // A Run may not ask for an idle timeout under a second: refused, nothing created.
    let mut spec = kruntimes_api::RunSpec::task("bash", "x");
    spec.mode.task = None;
    spec.mode.session = Some(kruntimes_api::run::SessionMode {
        idle_timeout: Some("0s".into()),
        ..Default::default()
    });
    let runs = Api::<Run>::namespaced(client.clone(), "default");
    match runs
        .create(&PostParams::default(), &Run::new("zero-idle", spec))
        .await
    {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 422, "{status:?}");
            assert!(status.message.contains("idleTimeout"), "{status:?}");
        }
        other => panic!("an idle timeout of 0s was accepted: {other:?}"),
    }
    assert!(runs.get_opt("zero-idle").await?.is_none());

    // Idle, asking for a longer idle timeout than the TTL: clamped to the TTL.
    let idle = bash
        .acquire_sandbox(&AcquireOptions {
            idle_timeout: Some(Duration::from_secs(3600)),
            ..AcquireOptions::default()
        })
        .await?;
    let busy = bash.acquire_sandbox(&AcquireOptions::default()).await?;
    let reader = bash.acquire_sandbox(&AcquireOptions::default()).await?;

    // The busy one: every activity time its status shows, from a watch.
    let watched = Api::<Run>::namespaced(client.clone(), "default");
    let busy_name = busy.name().to_string();
    let seen = Arc::new(Mutex::new(BTreeSet::new()));
    let recorded = seen.clone();
    let recorder = tokio::spawn(async move {
        let mut stream = watcher(
            watched,
            watcher::Config::default().fields(&format!("metadata.name={busy_name}")),
        )
        .applied_objects()
        .boxed();
        while let Some(Ok(run)) = stream.next().await {
            if let Some(t) = run
                .status
                .and_then(|s| s.session)
                .and_then(|s| s.last_activity_time)
            {
                recorded
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(t);
            }
        }
    });

    // Reads and listings of the reader, operations of the busy one, until the idle one
    // has ended; then three TTLs more of the same.
    let mut session = busy.open_session().await?;
    let started = Instant::now();
    let idle_name = idle.name().to_string();
    let idle_ended = tokio::spawn({
        let client = client.clone();
        async move { wait_terminal(&client, &idle_name).await }
    });
    let mut operations = 0u32;
    let mut reads = 0u32;
    let mut reader_alive = true;
    let work = async {
        while started.elapsed() < TTL * 3 || !idle_ended.is_finished() {
            let done = session.exec(Command::shell("true"), |_, _| {}).await?;
            assert_eq!(done.state, OperationState::Succeeded, "{done:?}");
            operations += 1;
            // The reader only reads (a listing and a missing file) until it has ended.
            if reader_alive {
                if reader
                    .list_files(&ListFilesOptions::default())
                    .await
                    .is_ok()
                {
                    let _ = reader.read_file("nothing-here").await;
                    reads += 1;
                } else {
                    reader_alive = false;
                }
            }
        }
        anyhow::Ok(())
    };
    within(DEADLINE, "the busy session's operations", work).await?;
    let busy_for = started.elapsed();

    let idle_run = idle_ended.await??;
    let message = ended_idle(&idle_run)?;
    assert!(
        message.contains("--session-idle-ttl") && message.contains("the idle limit is 3s"),
        "the clamped timeout names the TTL: {message}"
    );
    // The counter moved, by the time the expiry's Event is out.
    kruntimes_testkit::events::wait_for(&client, "default", idle.name(), "IdleTimeout", DEADLINE)
        .await?;
    let reader_run = wait_terminal(&client, reader.name()).await?;
    ended_idle(&reader_run)?;
    assert!(reads > 0, "the reader was read from");

    // The busy session kept going through three TTLs.
    let busy_run = busy.run().await?;
    assert_eq!(
        busy_run.phase(),
        Phase::Ready,
        "a session that keeps receiving operations is not expired: {:?}",
        busy_run.status
    );
    kruntimes_testkit::events::wait_for(&client, "default", reader.name(), "IdleTimeout", DEADLINE)
        .await?;
    assert_eq!(expired_total(&server).await?, 2, "the idle and the reader");
    ensure!(operations > 10, "only {operations} operations ran");

    // Its activity time was written, but at most once per activity interval (plus the
    // first write), not once per operation.
    busy.release(ReleaseOptions::default()).await?;
    recorder.abort();
    let seen = seen.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let bound = (busy_for.as_millis() / ACTIVITY_INTERVAL.as_millis()) as usize + 2;
    assert!(
        seen.len() >= 3 && seen.len() <= bound,
        "{} activity writes for {operations} operations in {busy_for:?} (at most {bound}): {seen:?}",
        seen.len()
    );
    session.close().await;

    // The expired session's owner closed it: it takes no more operations.
    let mut closed = idle.open_session().await;
    if let Ok(session) = closed.as_mut() {
        let refused = session.exec(Command::shell("true"), |_, _| {}).await;
        assert!(
            refused.is_err(),
            "an expired session ran an operation: {refused:?}"
        );
    }
    Ok(())
}

/// A negative idle TTL is refused at start, naming the flag; nothing starts.
#[tokio::test]
async fn a_negative_idle_ttl_is_refused_at_start() -> Result<()> {
    let data = tempfile::tempdir()?;
    let output = std::process::Command::new(kruntimes_testkit::kruntimes_bin()?)
        .args(["up", "--data-dir"])
        .arg(data.path().join("data"))
        .args([
            "--apiserver-addr",
            "127.0.0.1:0",
            "--session-idle-ttl",
            "-5m",
        ])
        .stdin(std::process::Stdio::null())
        .output()?;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--session-idle-ttl") && stderr.contains("negative"),
        "{stderr}"
    );
    assert!(
        !data.path().join("data").exists(),
        "a refused start wrote its data directory"
    );
    Ok(())
}

/// Found in review: the sweep's write was conditional on the Run it read, but the owner
/// accepted operations in memory only, so an operation accepted between the sweep's read
/// and its write was accepted and then cancelled with the session. Now a session that has
/// been quiet for an activity interval records its activity before it accepts, and the
/// API server lets exactly one of the two writes through. This test plays the sweep's part
/// itself (the real sweep runs once an hour here), so the order is forced both ways.
#[tokio::test]
async fn an_operation_after_the_sweeps_write_is_refused_not_accepted_then_cancelled() -> Result<()>
{
    let mut options = Options::full();
    options.extra_args = [
        "--session-idle-ttl",
        "3s",
        "--session-idle-sweep-interval",
        "1h",
    ]
    .map(String::from)
    .to_vec();
    let (server, client) = Server::start_async(options).await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let bash = connection.runtime("bash");
    let sandbox = bash.acquire_sandbox(&AcquireOptions::default()).await?;
    let session = sandbox.open_session().await?;
    let runs = Api::<Run>::namespaced(client.clone(), "default");
    let operation =
        |line: &str| kruntimes_client::session::Operation::command(Command::shell(line));

    // The operation first: recorded before it is accepted, so a sweep that read the Run
    // before the operation cannot end it (its write conflicts). Quiet for an activity
    // interval first: no event marks an idle clock running out, so this waits it out.
    tokio::time::sleep(ACTIVITY_INTERVAL * 2).await;
    let read_before = runs.get(sandbox.name()).await?;
    let id = session.send(&operation("true")).await?;
    ensure!(!id.is_empty());
    let mut stale = read_before.clone();
    let status = stale.status.get_or_insert_with(Default::default);
    status.phase = Some(Phase::Timeout);
    status.reason = Some("IdleTimeout".into());
    match runs
        .replace_status(sandbox.name(), &PostParams::default(), &stale)
        .await
    {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 409, "{status:?}"),
        other => {
            panic!("a sweep's write on a Run read before an accepted operation landed: {other:?}")
        }
    }

    // The sweep first: quiet again (past the owner's last activity write, which comes at
    // most an interval after the operation's end), then the Run is ended as the sweep ends
    // it: read, then replaced with that resourceVersion, read again after a conflict.
    tokio::time::sleep(ACTIVITY_INTERVAL * 5).await;
    let mut attempts = 0;
    loop {
        let mut ended = runs.get(sandbox.name()).await?;
        ensure!(ended.phase() == Phase::Ready, "{:?}", ended.status);
        let status = ended.status.get_or_insert_with(Default::default);
        status.phase = Some(Phase::Timeout);
        status.reason = Some("IdleTimeout".into());
        status.message = Some("ended by the test, as the idle sweep ends it".into());
        match runs
            .replace_status(sandbox.name(), &PostParams::default(), &ended)
            .await
        {
            Ok(_) => break,
            Err(kube::Error::Api(status)) if status.code == 409 && attempts < 3 => attempts += 1,
            Err(error) => return Err(error.into()),
        }
    }
    let refused = session.send(&operation("echo accepted")).await;
    assert!(
        matches!(
            refused,
            Err(kruntimes_client::sandbox::SandboxError::Rejected { .. })
        ),
        "an operation sent after the session ended was not refused: {refused:?}"
    );
    wait_terminal(&client, sandbox.name()).await?;
    session.close().await;
    Ok(())
}
