//! The gateway's flags on `kruntimes up` (issue 15 item 8): `--max-concurrent-requests`
//! bounds the requests served at once (429 beyond), and `--authorization-cache-ttl 0`
//! turns the authorization cache off, so a revoked grant is refused at the next request.

mod common;

use anyhow::{Context, Result, ensure};
use common::{DEADLINE, Endpoint, create, function_workspace, python, wait_ready};
use k8s_openapi::api::rbac::v1::RoleBinding;
use kruntimes_testkit::{Options, Server, setup, within};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams};
use serde_json::json;

/// Waits, when asked, until a file exists, after saying so with another.
const HANDLER: &str = r#"
import os, time

def handle(event):
    if event.get("wait_for"):
        open(event["started"], "w").close()
        while not os.path.exists(event["wait_for"]):
            time.sleep(0.01)
    return "ok"
"#;

#[tokio::test]
async fn gateway_flags_bound_requests_and_disable_the_authorization_cache() -> Result<()> {
    let options = Options {
        extra_args: [
            "--max-concurrent-requests",
            "1",
            "--authorization-cache-ttl",
            "0",
        ]
        .iter()
        .map(|a| a.to_string())
        .collect(),
        ..Options::full()
    };
    let (server, client) = Server::start_async(options).await?;
    let held = create(&client, "held", python(HANDLER)).await?;
    create(&client, "other", python(HANDLER)).await?;
    let held_run = wait_ready(&client, "held").await?;
    let other_run = wait_ready(&client, "other").await?;
    let admin = common::endpoint(&server, &held_run)?;
    let other = common::endpoint(&server, &other_run)?;

    // One request in flight (an invocation its handler holds) takes the only slot: a
    // request for another Run is refused by the gateway's own limit at once.
    let gate = function_workspace(&server, &held.uid().context("uid")?).await?;
    let release = gate.join("release");
    let started = gate.join("started");
    let holder = {
        let admin = admin.clone();
        let event = json!({"wait_for": release.display().to_string(), "started": started.display().to_string()});
        tokio::spawn(async move { admin.invoke_json("held", event).await })
    };
    within(DEADLINE, "the held invocation starts", async {
        while !started.exists() {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        Ok(())
    })
    .await?;
    let refused = other.invoke_json("second", json!({})).await?;
    ensure!(refused.status == 429, "{refused:?}");
    let message = refused.body["message"].as_str().unwrap_or_default();
    ensure!(
        message.contains("limit of 1 concurrent requests"),
        "{message}"
    );
    std::fs::write(&release, "go")?;
    let answer = holder.await??;
    ensure!(answer.status == 200, "{answer:?}");
    let answer = other.invoke_json("after", json!({})).await?;
    ensure!(answer.status == 200, "the slot is free again: {answer:?}");

    // Without the cache, a caller whose RoleBinding is deleted is refused at the next
    // request (with the default 30 s cache it would still be served from it).
    let rule = setup::kruntimes_rule(&["get"], &["runs"]);
    let token = setup::service_account_token(&client, "default", "caller", vec![rule], 600).await?;
    let endpoint = other_run
        .status
        .as_ref()
        .and_then(|s| s.endpoint.clone())
        .context("an endpoint")?;
    let caller = Endpoint::of(&endpoint, &token)?;
    let answer = caller.invoke_json("granted", json!({})).await?;
    ensure!(answer.status == 200, "{answer:?}");
    Api::<RoleBinding>::namespaced(client.clone(), "default")
        .delete("caller-role", &DeleteParams::default())
        .await
        .context("delete the caller's RoleBinding")?;
    let answer = caller.invoke_json("revoked", json!({})).await?;
    ensure!(
        answer.status == 403,
        "a revoked caller is served: {answer:?}"
    );
    drop(server);
    Ok(())
}
