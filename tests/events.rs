//! Events that runtimed writes on Runs (issue 15, item 6), end to end: `kruntimes up` with
//! its real workers (runtimed with its own identity, so under its RBAC), read back with the
//! real kubectl as a user would: `kubectl get events --field-selector
//! involvedObject.name=NAME` and `kubectl describe run NAME`.

mod common;

use anyhow::Result;
use common::{DEADLINE, create, python, wait_terminal};
use kruntimes_api::Phase;
use kruntimes_api::run::RetryPolicy;
use kruntimes_testkit::{Options, Server};

/// `kubectl get events` for Run `name`: the lines, reason and reporter of each.
fn events_of(server: &Server, name: &str) -> Result<String> {
    server.kubectl_ok(&[
        "get",
        "events",
        "--field-selector",
        &format!("involvedObject.name={name}"),
        "-o",
        "custom-columns=TYPE:.type,REASON:.reason,FROM:.reportingComponent,MESSAGE:.message",
    ])
}

/// Waits for runtimed's Event `reason` on Run `name`, then checks what kubectl shows.
async fn shown(server: &Server, name: &str, reason: &str) -> Result<()> {
    let client = server.client().await?;
    kruntimes_testkit::events::wait_for(&client, "default", name, reason, DEADLINE).await?;
    let listed = events_of(server, name)?;
    assert!(
        listed
            .lines()
            .any(|l| l.contains(reason) && l.contains("kruntimes.io/runtimed")),
        "kubectl get events for {name} lacks {reason} from runtimed:\n{listed}"
    );
    let described = server.kubectl_ok(&["describe", "run", name])?;
    let events = described
        .split_once("Events:")
        .map(|(_, events)| events)
        .unwrap_or_default();
    assert!(
        events.contains(reason),
        "kubectl describe run {name} shows no {reason} Event:\n{described}"
    );
    Ok(())
}

/// A function whose import fails: each failed registration is an Event, and the retry too.
/// A task whose entrypoint cannot start, and one past its `spec.timeout`: an Event each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_shows_the_events_runtimed_writes_on_runs() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;

    let mut broken = python("raise RuntimeError('cannot load')\n");
    broken.retry_policy = Some(RetryPolicy {
        max_attempts: 2,
        backoff_seconds: None,
    });
    create(&client, "broken", broken).await?;
    let missing = kruntimes_api::RunSpec::task("python", "missing.py");
    create(&client, "missing", missing).await?;
    let mut slow = kruntimes_api::RunSpec::task("python", "main.py");
    slow.source = Some(kruntimes_api::run::RunSource {
        inline: Some("import time\ntime.sleep(600)\n".to_string()),
        snapshot: None,
    });
    slow.timeout = Some("1s".into());
    create(&client, "slow", slow).await?;

    let failed = wait_terminal(&client, "broken").await?;
    assert_eq!(failed.phase(), Phase::Failed, "{:?}", failed.status);
    shown(&server, "broken", "RegistrationFailed").await?;
    shown(&server, "broken", "Retrying").await?;
    let listed = events_of(&server, "broken")?;
    assert!(listed.contains("cannot load"), "{listed}");

    let missing = wait_terminal(&client, "missing").await?;
    let status = missing.status.clone().unwrap_or_default();
    assert_eq!(missing.phase(), Phase::Failed, "{status:?}");
    assert_eq!(status.reason.as_deref(), Some("StartFailed"), "{status:?}");
    shown(&server, "missing", "StartFailed").await?;

    let slow = wait_terminal(&client, "slow").await?;
    let status = slow.status.clone().unwrap_or_default();
    assert_eq!(slow.phase(), Phase::Timeout, "{status:?}");
    shown(
        &server,
        "slow",
        status.reason.as_deref().unwrap_or("Timeout"),
    )
    .await?;
    Ok(())
}
