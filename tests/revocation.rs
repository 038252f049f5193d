//! Revocation reaches the gateway and the workers at once (issue 14 item 10): a revoked
//! token, a deleted RoleBinding or a deleted ServiceAccount is refused by the API server at
//! once, and the gateway and every runtimed drop their cached decisions when such objects
//! change (`kruntimes_wire::revocation`), so the next request is refused well before the
//! 30 s cache TTL would have ended, an open session WebSocket is closed, and an open
//! `follow` logs stream is ended.
//!
//! Each test caches a success first (two successful requests), then revokes, then polls
//! with a deadline of 10 s: without the invalidation the cached success would be served
//! for about 30 s.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use common::{DEADLINE, Endpoint, create, create_runtime, python, wait_for, wait_ready};
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding, RoleRef, Subject};
use kruntimes_api::run::{RunMode, RunSource, SessionMode};
use kruntimes_api::{Phase, Run, RunSpec};
use kruntimes_client::Connection;
use kruntimes_client::sandbox::SandboxError;
use kruntimes_client::session::Command;
use kruntimes_testkit::setup::kruntimes_rule;
use kruntimes_testkit::{Options, Server, within};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ObjectMeta, PostParams,
};
use kube::{Client, ResourceExt};
use serde_json::json;

/// Revocation must show within this; the cache TTL it replaces is 30 s.
const REVOKED_WITHIN: Duration = Duration::from_secs(10);
const USER: &str = "alice";
const BINDING: &str = "alice-uses-runs";

fn access_tokens(client: Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("auth.kruntimes.io", "v1alpha1", "AccessToken");
    Api::all_with(
        client,
        &ApiResource::from_gvk_with_plural(&gvk, "accesstokens"),
    )
}

/// A user token for [`USER`] (its AccessToken's name and the raw token), and a Role that
/// may get, list and watch Runs in namespace default bound to that user as [`BINDING`].
async fn alice(admin: &Client) -> Result<(String, String)> {
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "auth.kruntimes.io/v1alpha1",
        "kind": "AccessToken",
        "metadata": {},
        "spec": {"user": {"username": USER, "groups": []}},
    }))?;
    let created = access_tokens(admin.clone())
        .create(&PostParams::default(), &object)
        .await
        .context("issue a token")?;
    let token = created.data["status"]["token"]
        .as_str()
        .context("the AccessToken has no status.token")?
        .to_string();
    let pp = PostParams::default();
    let named = |name: &str| ObjectMeta {
        name: Some(name.to_string()),
        ..ObjectMeta::default()
    };
    Api::<Role>::namespaced(admin.clone(), "default")
        .create(
            &pp,
            &Role {
                metadata: named("run-user"),
                rules: Some(vec![kruntimes_rule(&["get", "list", "watch"], &["runs"])]),
            },
        )
        .await?;
    Api::<RoleBinding>::namespaced(admin.clone(), "default")
        .create(
            &pp,
            &RoleBinding {
                metadata: named(BINDING),
                role_ref: RoleRef {
                    api_group: "rbac.authorization.k8s.io".into(),
                    kind: "Role".into(),
                    name: "run-user".into(),
                },
                subjects: Some(vec![Subject {
                    kind: "User".into(),
                    name: USER.into(),
                    api_group: Some("rbac.authorization.k8s.io".into()),
                    ..Subject::default()
                }]),
            },
        )
        .await?;
    Ok((created.name_any(), token))
}

/// A Ready function Run and its endpoint for `token`.
async fn function_for(client: &Client, name: &str, token: &str) -> Result<Endpoint> {
    create(
        client,
        name,
        python("def handle(event):\n    return {\"got\": event}\n"),
    )
    .await?;
    let run = wait_ready(client, name).await?;
    let endpoint = run
        .status
        .as_ref()
        .and_then(|s| s.endpoint.clone())
        .context("a Ready function publishes an endpoint")?;
    Endpoint::of(&endpoint, token)
}

/// Invokes twice successfully (the second answer comes from the caches), runs `revoke`,
/// then invokes until the answer is `refused`, within [`REVOKED_WITHIN`]; every answer
/// before that must be a success. Returns how long the refusal took.
async fn refused_after(
    endpoint: &Endpoint,
    refused: u16,
    revoke: impl std::future::Future<Output = Result<()>>,
) -> Result<Duration> {
    for i in 0..2 {
        let answer = endpoint
            .invoke_json(&format!("before-{i}"), json!(i))
            .await?;
        ensure!(answer.status == 200, "before the revocation: {answer:?}");
    }
    revoke.await?;
    let revoked = Instant::now();
    within(REVOKED_WITHIN, "the revoked caller is refused", async {
        for i in 0u64.. {
            let answer = endpoint
                .invoke_json(&format!("after-{i}"), json!(i))
                .await?;
            if answer.status == refused {
                return Ok(());
            }
            ensure!(answer.status == 200, "after the revocation: {answer:?}");
        }
        Ok(())
    })
    .await?;
    Ok(revoked.elapsed())
}

/// Regression (issue 14 item 10): a deleted AccessToken was served from the gateway's
/// cache for up to 30 s.
#[tokio::test]
async fn a_revoked_token_is_refused_at_once() -> Result<()> {
    let (_server, client) = Server::start_async(Options::full()).await?;
    let (token_name, token) = alice(&client).await?;
    let endpoint = function_for(&client, "revocable", &token).await?;
    let took = refused_after(&endpoint, 401, async {
        access_tokens(client.clone())
            .delete(&token_name, &DeleteParams::default())
            .await?;
        Ok(())
    })
    .await?;
    eprintln!("a revoked token was refused after {took:?}");
    Ok(())
}

/// Regression (issue 14 item 10): a deleted RoleBinding was served from the gateway's
/// cache for up to 30 s.
#[tokio::test]
async fn a_deleted_role_binding_is_refused_at_once() -> Result<()> {
    let (_server, client) = Server::start_async(Options::full()).await?;
    let (_, token) = alice(&client).await?;
    let endpoint = function_for(&client, "unbound", &token).await?;
    let took = refused_after(&endpoint, 403, async {
        Api::<RoleBinding>::namespaced(client.clone(), "default")
            .delete(BINDING, &DeleteParams::default())
            .await?;
        Ok(())
    })
    .await?;
    eprintln!("a deleted RoleBinding was refused after {took:?}");
    Ok(())
}

/// Regression (issue 14 item 10): the token of a deleted ServiceAccount was served from
/// the gateway's cache for up to 30 s.
#[tokio::test]
async fn a_deleted_service_account_is_refused_at_once() -> Result<()> {
    let (_server, client) = Server::start_async(Options::full()).await?;
    let token = kruntimes_testkit::setup::service_account_token(
        &client,
        "default",
        "agent",
        vec![kruntimes_rule(&["get", "list", "watch"], &["runs"])],
        3600,
    )
    .await?;
    let endpoint = function_for(&client, "orphaned", &token).await?;
    let took = refused_after(&endpoint, 401, async {
        Api::<ServiceAccount>::namespaced(client.clone(), "default")
            .delete("agent", &DeleteParams::default())
            .await?;
        Ok(())
    })
    .await?;
    eprintln!("a deleted ServiceAccount's token was refused after {took:?}");
    Ok(())
}

/// A kubeconfig like the admin's with `token` instead of the admin's credential.
fn kubeconfig_with(server: &Server, token: &str, dir: &std::path::Path) -> Result<PathBuf> {
    let admin = std::fs::read_to_string(server.kubeconfig_path())?;
    let mut config: serde_yaml::Value = serde_yaml::from_str(&admin)?;
    let user = config
        .get_mut("users")
        .and_then(|u| u.get_mut(0))
        .and_then(|u| u.get_mut("user"))
        .and_then(serde_yaml::Value::as_mapping_mut)
        .context("the admin kubeconfig has no users[0].user")?;
    user.clear();
    user.insert("token".into(), token.into());
    let path = dir.join("kubeconfig");
    std::fs::write(&path, serde_yaml::to_string(&config)?)?;
    Ok(path)
}

/// Regression (issue 14 item 10): an open session WebSocket re-checked its caller only
/// when a frame came, from the 30 s cache; an idle one was never closed. Now it is closed
/// (an `error` frame with the refusal, then close code 1008) as soon as the binding its
/// decision rests on is deleted.
#[tokio::test]
async fn an_open_websocket_is_closed_when_its_caller_is_revoked() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    create_runtime(&client, "solo", "bash", 1, 2).await?;
    let mut spec = RunSpec::task("solo", "unused");
    spec.mode = RunMode {
        session: Some(SessionMode::default()),
        ..RunMode::default()
    };
    Api::<Run>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &Run::new("watched", spec))
        .await?;
    wait_ready(&client, "watched").await?;
    let (_, token) = alice(&client).await?;
    let dir = tempfile::tempdir()?;
    let connection = Connection::from_paths(&[kubeconfig_with(&server, &token, dir.path())?])
        .await?
        .with_namespace("default");
    let sandbox = connection.sandbox("watched").await?;
    let mut session = within(DEADLINE, "open the session", async {
        Ok(sandbox.open_session().await?)
    })
    .await?;
    let done = within(DEADLINE, "a command before the revocation", async {
        Ok(session.exec(Command::shell("echo ok"), |_, _| {}).await?)
    })
    .await?;
    ensure!(done.exit_code == Some(0), "{done:?}");

    Api::<RoleBinding>::namespaced(client.clone(), "default")
        .delete(BINDING, &DeleteParams::default())
        .await?;
    let revoked = Instant::now();
    // The socket is idle: nothing but the revocation can end it within the deadline.
    within(REVOKED_WITHIN, "the open socket is closed", async {
        loop {
            match session.receive().await {
                Err(SandboxError::ConnectionEnded {
                    status, message, ..
                }) => {
                    ensure!(status == 403, "ended with {status}: {message}");
                    ensure!(message.contains("revoked"), "{message}");
                    return Ok(());
                }
                // A heartbeat of the SDK may meet the refusal first.
                Err(SandboxError::Heartbeat(inner)) if inner.status() == Some(403) => {}
                Err(SandboxError::Closed) => bail!("closed without an error frame"),
                other => bail!("while waiting for the close: {other:?}"),
            }
        }
    })
    .await?;
    eprintln!(
        "an open socket was closed {:?} after its binding was deleted",
        revoked.elapsed()
    );
    Ok(())
}

/// A client of the gateway of `server` (its CA only) that sends `token`.
fn gateway_client(server: &Server, token: &str) -> Result<Client> {
    let url = server.gateway_url().context("the gateway's URL")?;
    let mut config = kube::Config::new(url.parse().context("the gateway's URL")?);
    let ca = std::fs::read(server.data_dir().join("components/gateway-ca.crt"))
        .context("read the gateway's CA")?;
    config.root_cert = Some(common::pem_certificates(&ca)?);
    config.auth_info.token = Some(token.to_string().into());
    config.default_retry = false;
    Ok(Client::try_from(config)?)
}

/// `GET .../runs/{name}/logs?follow=true` through `gateway`: the status and the body.
async fn follow_logs(gateway: &Client, name: &str) -> Result<http::Response<kube::client::Body>> {
    let request = http::Request::get(format!(
        "/v1/namespaces/default/runs/{name}/logs?stream=stdout&follow=true"
    ))
    .body(kube::client::Body::empty())?;
    Ok(gateway.send(request).await?)
}

/// Regression (issue 14 item 10): an open `follow` logs stream was never re-checked, so a
/// caller whose RoleBinding was deleted kept receiving the Run's output for as long as it
/// ran. Now the stream re-authorizes on every flush of the gateway's cache and ends (a
/// truncated body) within a second of the revocation; asking again is a 403.
#[tokio::test]
async fn an_open_logs_stream_ends_when_its_caller_is_revoked() -> Result<()> {
    /// The refusal target of the issue, from revocation to the stream's end.
    const ENDED_WITHIN: Duration = Duration::from_secs(1);
    let (server, client) = Server::start_async(Options::full()).await?;
    let (_, token) = alice(&client).await?;
    let mut spec = RunSpec::task("bash", "main.sh");
    spec.source = Some(RunSource {
        inline: Some("while true; do echo tick; sleep 0.05; done\n".to_string()),
        snapshot: None,
    });
    create(&client, "ticking", spec).await?;
    wait_for(&client, "ticking", "runs", |r| r.phase() == Phase::Running).await?;
    let gateway = gateway_client(&server, &token)?;
    let response = follow_logs(&gateway, "ticking").await?;
    ensure!(response.status() == 200, "{:?}", response.status());
    let mut body = response.into_body();
    // Output flows while the caller may get the Run.
    within(DEADLINE, "the first output", async {
        loop {
            match body.frame().await {
                Some(Ok(frame)) if frame.data_ref().is_some_and(|d| !d.is_empty()) => {
                    return Ok(());
                }
                Some(Ok(_)) => continue,
                other => bail!("the stream ended before any output: {other:?}"),
            }
        }
    })
    .await?;

    Api::<RoleBinding>::namespaced(client.clone(), "default")
        .delete(BINDING, &DeleteParams::default())
        .await?;
    let revoked = Instant::now();
    // The task prints every 50 ms for ever: nothing but the revocation ends the stream.
    let end = within(ENDED_WITHIN, "the open logs stream to end", async {
        loop {
            match body.frame().await {
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Ok(Some(e)),
                None => return Ok(None),
            }
        }
    })
    .await?;
    let took = revoked.elapsed();
    ensure!(
        end.is_some(),
        "the stream ended cleanly, as if the Run's output were complete"
    );
    let again = follow_logs(&gateway, "ticking").await?;
    let status = again.status();
    let bytes = again.into_body().collect().await?.to_bytes();
    ensure!(
        status == 403,
        "asking again: {status} {}",
        String::from_utf8_lossy(&bytes)
    );
    eprintln!("an open logs stream ended {took:?} after its binding was deleted");
    Ok(())
}
