//! Creation request IDs of sandboxes (issue 19 item 7; design document 003), end to end
//! against the real `kruntimes up`: a retry with the same ID and spec returns the same
//! sandbox, another spec gets a conflict, 20 racing creates give one sandbox, the ID stays
//! reserved after release (the ended Run is its tombstone), and `krt sandbox create
//! --request-id` retries to the same sandbox.

use anyhow::{Context, Result, ensure};
use kruntimes_api::Run;
use kruntimes_api::run::EnvVar;
use kruntimes_client::Connection;
use kruntimes_client::sandbox::{
    AcquireOptions, REQUEST_ID_ANNOTATION, ReleaseOptions, SandboxError, request_run_name,
};
use kruntimes_testkit::{Options, Server};
use kube::Client;
use kube::api::{Api, ListParams};

/// The Runs of the namespace that carry `request_id`.
async fn runs_of(client: &Client, request_id: &str) -> Result<Vec<Run>> {
    let runs = Api::<Run>::namespaced(client.clone(), "default")
        .list(&ListParams::default())
        .await?;
    Ok(runs
        .items
        .into_iter()
        .filter(|r| {
            r.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(REQUEST_ID_ANNOTATION))
                .map(String::as_str)
                == Some(request_id)
        })
        .collect())
}

#[tokio::test]
async fn request_ids_make_sandbox_creation_retry_safe() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let bash = connection.runtime("bash");
    let options = |id: &str| AcquireOptions {
        request_id: Some(id.to_string()),
        ..AcquireOptions::default()
    };

    // A retry (the first answer was lost, say) returns the same sandbox.
    let first = bash.acquire_sandbox(&options("agent-1.turn-7")).await?;
    assert_eq!(first.name(), request_run_name("agent-1.turn-7"));
    let again = bash.acquire_sandbox(&options("agent-1.turn-7")).await?;
    assert_eq!((again.name(), again.uid()), (first.name(), first.uid()));

    // The same ID with another spec is a conflict, and creates nothing.
    let other = AcquireOptions {
        env: vec![EnvVar {
            name: "A".into(),
            value: "1".into(),
        }],
        ..options("agent-1.turn-7")
    };
    match bash.acquire_sandbox(&other).await {
        Err(e @ SandboxError::RequestConflict { .. }) => assert_eq!(e.status(), Some(409)),
        other => panic!("another spec under the same request ID: {other:?}"),
    }
    assert_eq!(runs_of(&client, "agent-1.turn-7").await?.len(), 1);

    // After release the ID stays reserved: the ended Run is kept as its tombstone.
    first.release(ReleaseOptions::default()).await?;
    let kept = runs_of(&client, "agent-1.turn-7").await?;
    ensure!(
        kept.len() == 1 && kept[0].phase().is_terminal(),
        "the tombstone: {kept:?}"
    );
    match bash.acquire_sandbox(&options("agent-1.turn-7")).await {
        Err(SandboxError::RequestIdReserved { name, .. }) => assert_eq!(name, first.name()),
        other => panic!("a retry after release: {other:?}"),
    }
    assert_eq!(runs_of(&client, "agent-1.turn-7").await?.len(), 1);

    // Twenty racing creates of one request ID give one sandbox.
    let racers = (0..20).map(|_| {
        let bash = bash.clone();
        tokio::spawn(async move { bash.acquire_sandbox(&options("race")).await })
    });
    let mut uids = std::collections::BTreeSet::new();
    for racer in racers {
        let sandbox = racer.await.context("join a racer")??;
        uids.insert(sandbox.uid().to_string());
    }
    assert_eq!(uids.len(), 1, "20 racing creates made {uids:?}");
    assert_eq!(runs_of(&client, "race").await?.len(), 1);

    // A bad request ID is refused before any request.
    match bash.acquire_sandbox(&options("no spaces")).await {
        Err(SandboxError::Invalid { problems }) => {
            assert!(
                problems.iter().any(|p| p.contains("request ID")),
                "{problems:?}"
            );
        }
        other => panic!("a malformed request ID: {other:?}"),
    }

    // krt: a retried create prints the same sandbox.
    let create = |server: &Server| -> Result<String> {
        let output = server
            .krt()?
            .args(["sandbox", "create", "--request-id", "krt-1"])
            .output()?;
        ensure!(
            output.status.success(),
            "krt sandbox create: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(String::from_utf8_lossy(&output.stdout)
            .lines()
            .last()
            .unwrap_or_default()
            .trim()
            .to_string())
    };
    let (server, a, b) = tokio::task::spawn_blocking(move || {
        let a = create(&server)?;
        let b = create(&server)?;
        anyhow::Ok((server, a, b))
    })
    .await??;
    assert_eq!(a, request_run_name("krt-1"));
    assert_eq!(a, b);
    assert_eq!(runs_of(&client, "krt-1").await?.len(), 1);
    drop(server);
    Ok(())
}
