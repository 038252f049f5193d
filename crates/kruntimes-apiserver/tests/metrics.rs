//! `GET /metrics`: requests counted by verb, resource and status; open watches; stored
//! objects by resource; and only for callers allowed `get` on `/metrics`.
//!
//! The server runs in-process on 127.0.0.1:0 in a temporary directory.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ObjectMeta, PostParams, WatchParams};

mod common;
use common::server;

async fn metrics(client: &kube::Client) -> Result<String> {
    let request = axum::http::Request::get("/metrics").body(Vec::new())?;
    Ok(client.request_text(request).await?)
}

/// The value of the sample named exactly `sample` (name and labels), if present.
fn sample(text: &str, sample: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok())
}

/// Waits (a scrape at a time, at most 20 s) until `sample` reads `value`.
async fn wait_for(client: &kube::Client, name: &str, value: f64) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let text = metrics(client).await?;
        if sample(&text, name) == Some(value) {
            return Ok(());
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "{name} never read {value}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_watches_and_objects_are_counted_for_those_allowed_to_read_them() -> Result<()> {
    let (_dir, server, client) = server().await?;
    let namespaces = Api::<Namespace>::all(client.clone());
    for name in ["m-1", "m-2"] {
        let namespace = Namespace {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        namespaces
            .create(&PostParams::default(), &namespace)
            .await?;
    }
    // A conflict is counted with its own status.
    let again = Namespace {
        metadata: ObjectMeta {
            name: Some("m-1".into()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    ensure!(
        namespaces
            .create(&PostParams::default(), &again)
            .await
            .is_err()
    );
    let _ = namespaces.get("no-such-namespace").await;

    let text = metrics(&client).await?;
    for (name, value) in [
        (
            r#"apiserver_request_total{verb="create",resource="namespaces",code="201"}"#,
            2.0,
        ),
        (
            r#"apiserver_request_total{verb="create",resource="namespaces",code="409"}"#,
            1.0,
        ),
        (
            r#"apiserver_request_total{verb="get",resource="namespaces",code="404"}"#,
            1.0,
        ),
        (
            r#"apiserver_request_duration_seconds_count{verb="create",resource="namespaces"}"#,
            3.0,
        ),
    ] {
        ensure!(
            sample(&text, name) == Some(value),
            "{name} is not {value}:\n{text}"
        );
    }
    let stored = sample(&text, r#"apiserver_storage_objects{resource="namespaces"}"#)
        .context("no storage_objects for namespaces")?;
    ensure!(stored >= 2.0, "{stored} namespaces stored");
    ensure!(sample(&text, "apiserver_current_resource_version").is_some_and(|rv| rv > 0.0));

    // A watch is open while its stream is, and not after.
    let watch = namespaces.watch(&WatchParams::default(), "0").await?;
    let mut watch = Box::pin(watch);
    let first = tokio::time::timeout(Duration::from_secs(20), watch.next()).await?;
    ensure!(first.is_some(), "the watch ended at once");
    wait_for(
        &client,
        r#"apiserver_longrunning_requests{verb="watch"}"#,
        1.0,
    )
    .await?;
    drop(watch);
    wait_for(
        &client,
        r#"apiserver_longrunning_requests{verb="watch"}"#,
        0.0,
    )
    .await?;

    // Someone without `get` on /metrics is refused, as on Kubernetes.
    let text = std::fs::read_to_string(server.kubeconfig_path())?;
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&text)?;
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    config.auth_info.impersonate = Some("alice".into());
    let alice = kube::Client::try_from(config)?;
    match metrics(&alice).await {
        Err(error) => ensure!(
            error.to_string().contains("403") || error.to_string().contains("orbidden"),
            "{error}"
        ),
        Ok(text) => anyhow::bail!("alice read the metrics: {text}"),
    }
    Ok(())
}
