//! The S3 ArtifactStore end to end: `kruntimes up` with the S3 credentials in its
//! environment (its runtimed processes inherit them), a Runtime whose
//! `spec.artifactStore.s3` names a real S3-protocol server in this process
//! ([`kruntimes_testkit::s3::S3Server`]), sessions that export on Drain and read artifact
//! inputs from `s3://`, and a store that goes down during an export.

mod common;

use anyhow::{Context, Result};
use common::{create, ready_condition, wait_for, wait_ready, wait_terminal};
use kruntimes_api::run::{ArtifactInput, RunMode, SessionMode, Termination, TerminationMode};
use kruntimes_api::{Phase, Run, RunSpec, Runtime};
use kruntimes_client::Connection;
use kruntimes_client::sandbox::AcquireOptions;
use kruntimes_client::session::{Command, OperationState};
use kruntimes_testkit::s3::S3Server;
use kruntimes_testkit::{Options, Server};
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use sha2::{Digest, Sha256};

const PREFIX: &str = "kr/artifacts";

async fn start(s3: &S3Server) -> Result<(Server, Client)> {
    Server::start_async(Options {
        env: s3.env(),
        ..Options::full()
    })
    .await
}

async fn s3_runtime(client: &Client, name: &str, s3: &S3Server) -> Result<()> {
    common::create_s3_runtime(client, name, 2, s3, PREFIX).await
}

async fn terminate(client: &Client, name: &str, mode: TerminationMode) -> Result<()> {
    Api::<Run>::namespaced(client.clone(), "default")
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"termination": Termination { mode }}})),
        )
        .await
        .with_context(|| format!("request termination of {name}"))?;
    Ok(())
}

/// Creates a sandbox on `runtime` and runs `script` in it; its Run name and UID.
async fn sandbox_with(server: &Server, runtime: &str, script: &str) -> Result<(String, String)> {
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection
        .runtime(runtime)
        .acquire_sandbox(&AcquireOptions::default())
        .await?;
    let mut session = sandbox.open_session().await?;
    let done = session.exec(Command::shell(script), |_, _| {}).await?;
    assert_eq!(done.state, OperationState::Succeeded, "{done:?}");
    session.close().await;
    Ok((sandbox.name().to_string(), sandbox.uid().to_string()))
}

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

#[tokio::test]
async fn a_session_exports_to_s3_on_drain_and_another_reads_it_as_an_input() -> Result<()> {
    let s3 = S3Server::start()?;
    let (server, client) = start(&s3).await?;
    s3_runtime(&client, "s3rt", &s3).await?;

    let (name, uid) = sandbox_with(
        &server,
        "s3rt",
        "mkdir -p $KRUNTIME_ARTIFACTS_DIR/out && printf hello > $KRUNTIME_ARTIFACTS_DIR/out/result.txt && head -c 100000 /dev/zero | tr '\\0' x > $KRUNTIME_ARTIFACTS_DIR/big.txt",
    )
    .await?;
    terminate(&client, &name, TerminationMode::Drain).await?;
    let drained = wait_terminal(&client, &name).await?;
    let status = drained.status.clone().unwrap_or_default();
    assert_eq!(drained.phase(), Phase::Succeeded, "{status:?}");
    let refs = &status.artifact_refs;
    assert_eq!(
        refs.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
        ["big.txt", "out/result.txt"],
        "{status:?}"
    );
    let dir = format!("{PREFIX}/default/{name}-{uid}");
    let want: [(&str, Vec<u8>); 2] = [
        ("big.txt", vec![b'x'; 100_000]),
        ("out/result.txt", b"hello".to_vec()),
    ];
    for (r, (artifact, bytes)) in refs.iter().zip(&want) {
        assert_eq!(r.uri, format!("s3://{}/{dir}/{artifact}", s3.bucket()));
        assert_eq!(r.size_bytes, i64::try_from(bytes.len()).ok());
        assert_eq!(r.digest.as_deref(), Some(sha256(bytes).as_str()));
        // The object holds the artifact's bytes.
        let object = std::fs::read(s3.bucket_dir().join(&dir).join(artifact))?;
        assert_eq!(&object, bytes, "{artifact}");
    }
    // The completion marker was written.
    assert!(s3.bucket_dir().join(format!("{dir}.export.json")).is_file());

    // A second session reads the exported artifact as an input, from s3://.
    let mut spec = RunSpec::task("s3rt", "unused");
    spec.mode = RunMode {
        session: Some(SessionMode::default()),
        ..RunMode::default()
    };
    spec.artifact_inputs = vec![ArtifactInput {
        uri: refs[1].uri.clone(),
        path: "inputs/result.txt".into(),
    }];
    create(&client, "reader", spec.clone()).await?;
    wait_ready(&client, "reader").await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let reader = connection.sandbox("reader").await?;
    assert_eq!(reader.read_file("inputs/result.txt").await?, b"hello");

    // An input outside the store's prefix fails the Run, saying why.
    spec.artifact_inputs = vec![ArtifactInput {
        uri: format!("s3://{}/elsewhere/x", s3.bucket()),
        path: "x".into(),
    }];
    create(&client, "outsider", spec).await?;
    let failed = wait_terminal(&client, "outsider").await?;
    let status = failed.status.clone().unwrap_or_default();
    assert_eq!(failed.phase(), Phase::Failed, "{status:?}");
    assert!(
        status
            .message
            .as_deref()
            .is_some_and(|m| m.contains("prefix")),
        "{status:?}"
    );
    Ok(())
}

#[tokio::test]
async fn an_s3_store_that_is_down_keeps_the_session_finalizing_until_it_is_back() -> Result<()> {
    let mut s3 = S3Server::start()?;
    let (server, client) = start(&s3).await?;
    s3_runtime(&client, "s3down", &s3).await?;
    let (name, uid) = sandbox_with(
        &server,
        "s3down",
        "printf kept > $KRUNTIME_ARTIFACTS_DIR/k.txt",
    )
    .await?;
    s3.stop();
    terminate(&client, &name, TerminationMode::Drain).await?;
    let waiting = wait_for(&client, &name, "retries its export", |r| {
        ready_condition(r).is_some_and(|(_, reason)| reason == "ArtifactExportRetrying")
    })
    .await?;
    assert_eq!(waiting.phase(), Phase::Finalizing);
    // The condition names the bucket (and never the credentials).
    let message = waiting
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
        .and_then(|c| c.message.clone())
        .unwrap_or_default();
    assert!(message.contains(s3.bucket()), "{message}");
    assert!(!message.contains(s3.credentials().1), "{message}");

    // Back: the retry exports and the Run succeeds.
    s3.restart()?;
    let done = wait_terminal(&client, &name).await?;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), Phase::Succeeded, "{status:?}");
    assert_eq!(status.artifact_refs.len(), 1, "{status:?}");
    let object = s3
        .bucket_dir()
        .join(format!("{PREFIX}/default/{name}-{uid}/k.txt"));
    assert_eq!(std::fs::read(object)?, b"kept");
    Ok(())
}

#[tokio::test]
async fn admission_refuses_a_store_without_exactly_one_well_formed_driver() -> Result<()> {
    let (_server, client) = Server::start_async(Options::default()).await?;
    let api = Api::<Runtime>::namespaced(client.clone(), "default");
    let s3 = |endpoint: &str, bucket: &str| json!({"endpoint": endpoint, "bucket": bucket});
    let cases = [
        (
            json!({"filesystem": {"path": "/srv/a"}, "s3": s3("https://s3.example.com", "abc")}),
            "exactly one driver",
        ),
        (json!({}), "exactly one driver"),
        (
            json!({"s3": s3("http://s3.example.com", "abc")}),
            "loopback",
        ),
        (
            json!({"s3": s3("https://s3.example.com", "Not_A_Bucket")}),
            "bucket name",
        ),
    ];
    for (n, (store, want)) in cases.into_iter().enumerate() {
        let runtime: Runtime = serde_json::from_value(json!({
            "apiVersion": "kruntimes.io/v1alpha1",
            "kind": "Runtime",
            "metadata": {"name": format!("bad{n}")},
            "spec": {"replicas": 0, "artifactStore": store},
        }))?;
        let refused = api.create(&PostParams::default(), &runtime).await;
        match refused {
            Err(kube::Error::Api(e)) => {
                assert_eq!(e.code, 422, "{store}: {e:?}");
                assert!(e.message.contains(want), "{store}: {}", e.message);
            }
            other => anyhow::bail!("{store}: admitted: {other:?}"),
        }
    }
    // Nothing was created.
    assert!(api.list(&Default::default()).await?.items.is_empty());
    // A well-formed one is admitted.
    let good: Runtime = serde_json::from_value(json!({
        "apiVersion": "kruntimes.io/v1alpha1",
        "kind": "Runtime",
        "metadata": {"name": "good"},
        "spec": {"replicas": 0, "artifactStore": {"s3": s3("http://127.0.0.1:9000", "abc")}},
    }))?;
    api.create(&PostParams::default(), &good).await?;
    Ok(())
}
