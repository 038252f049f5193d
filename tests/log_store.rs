//! The log store of `kruntimes up` (`DATA_DIR/logs`): the logs of finished task Runs stay
//! readable, with `krt logs` and through the gateway's API, after their worker is gone and
//! after a restart of `kruntimes up`; a deleted Run's logs go with it; the cap removes the
//! oldest finished Runs' logs, and then the logs say that they are gone. Each test starts
//! the real binaries on ephemeral ports in a temporary data directory.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::{create, wait_terminal};
use http_body_util::BodyExt;
use kruntimes_api::{Phase, Run, RunSpec};
use kruntimes_testkit::{Options, Server, within};
use kube::api::{Api, DeleteParams};
use kube::{Client, ResourceExt};

/// How long a task, a restart or a removal may take.
const DEADLINE: Duration = Duration::from_secs(90);

/// A bash task whose stdout is `lines` numbered lines (more than one 64 KiB chunk for a few
/// thousand) and whose stderr is one line.
fn chatty(lines: u32) -> RunSpec {
    let mut spec = RunSpec::task("bash", "main.sh");
    spec.source = Some(kruntimes_api::run::RunSource {
        inline: Some(format!(
            "for i in $(seq 1 {lines}); do echo \"line $i of the task's stdout\"; done\necho to-stderr >&2\n"
        )),
        snapshot: None,
    });
    spec
}

/// What [`chatty`] prints on stdout.
fn chatty_stdout(lines: u32) -> String {
    (1..=lines)
        .map(|i| format!("line {i} of the task's stdout\n"))
        .collect()
}

/// `krt logs ARGS...`: its exit status, stdout and stderr.
fn krt_logs(server: &Server, args: &[&str]) -> Result<(bool, String, String)> {
    let output = server.krt()?.arg("logs").args(args).output()?;
    Ok((
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    ))
}

/// `GET /v1/namespaces/default/runs/NAME/logs?QUERY` on the gateway, as the admin: the
/// status and the body.
async fn gateway_logs(server: &Server, name: &str, query: &str) -> Result<(u16, Vec<u8>)> {
    let url = server.gateway_url().context("the gateway's URL")?;
    let mut config = kube::Config::new(url.parse()?);
    let ca = std::fs::read(server.data_dir().join("components/gateway-ca.crt"))?;
    config.root_cert = Some(common::pem_certificates(&ca)?);
    let token = kruntimes_testkit::admin_token(&server.kubeconfig_path())?;
    config.auth_info.token = Some(token.into());
    config.default_retry = false;
    let client = Client::try_from(config)?;
    let path = format!("/v1/namespaces/default/runs/{name}/logs{query}");
    let request = http::Request::get(&path).body(kube::client::Body::empty())?;
    let response = client
        .send(request)
        .await
        .map_err(|e| anyhow::anyhow!("GET {path}: {e:?}"))?;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await?.to_bytes().to_vec();
    Ok((status, body))
}

/// Runs `spec` as `name` to its end; the Run.
async fn run_to_end(client: &Client, name: &str, spec: RunSpec) -> Result<Run> {
    create(client, name, spec).await?;
    let run = within(DEADLINE, "the task ends", wait_terminal(client, name)).await?;
    ensure!(
        run.phase() == Phase::Succeeded,
        "the task ended {:?}: {:?}",
        run.phase(),
        run.status
    );
    Ok(run)
}

/// Waits until `path` no longer exists.
async fn gone(path: &Path, what: &str) -> Result<()> {
    within(DEADLINE, what, async {
        // The store's keeper removes it on its own schedule; nothing here to wait on but
        // the file system, checked often under the deadline.
        while path.exists() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    })
    .await
}

fn store_dir(data_dir: &Path, uid: &str) -> PathBuf {
    data_dir.join("logs").join(uid)
}

/// How `kruntimes up` is stopped before the restart.
#[derive(Clone, Copy, Debug)]
enum Stop {
    Term,
    Kill,
}

/// Issue 15 item 9: after a restart of `kruntimes up`, `krt logs` of a Run that finished
/// before said that the worker was gone (its logs lived in the worker's root, and the
/// gateway only asked the worker). Now the full stdout and stderr are read from the log
/// store, with `krt logs` and through the gateway.
async fn logs_survive_a_restart(stop: Stop) -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let data_dir = tmp.path().join("data");
    let options = Options {
        data_dir: Some(data_dir.clone()),
        ..Options::full()
    };
    let (mut server, client) = Server::start_async(options.clone()).await?;
    const LINES: u32 = 5_000;
    let run = run_to_end(&client, "before-restart", chatty(LINES)).await?;
    ensure!(run.uid().is_some(), "a UID");
    match stop {
        Stop::Term => {
            server.stop()?;
        }
        Stop::Kill => server.kill()?,
    }
    drop(server);

    let (server, _client) = Server::start_async(options).await?;
    let expected = chatty_stdout(LINES);
    let (ok, out, err) = krt_logs(&server, &["before-restart"])?;
    ensure!(ok, "krt logs failed after a restart ({stop:?}): {err}");
    ensure!(
        out == expected,
        "krt logs printed {} bytes, not the {} of the task's stdout ({stop:?}); stderr: {err}",
        out.len(),
        expected.len()
    );
    let (ok, out, err) = krt_logs(&server, &["before-restart", "--stderr"])?;
    ensure!(
        ok && out == "to-stderr\n",
        "krt logs --stderr: {out:?} {err}"
    );

    let (status, body) = gateway_logs(&server, "before-restart", "").await?;
    ensure!(
        status == 200,
        "the gateway answered {status}: {}",
        String::from_utf8_lossy(&body)
    );
    ensure!(body == expected.as_bytes(), "the gateway's body differs");
    let (status, body) = gateway_logs(
        &server,
        "before-restart",
        "?stream=stderr&attempt=1&follow=true",
    )
    .await?;
    ensure!(
        status == 200 && body == b"to-stderr\n",
        "stderr through the gateway: {status} {}",
        String::from_utf8_lossy(&body)
    );
    // Authorization is as for a live worker's logs: no token, no logs.
    let url = server.gateway_url().context("the gateway's URL")?;
    let mut config = kube::Config::new(url.parse()?);
    let ca = std::fs::read(server.data_dir().join("components/gateway-ca.crt"))?;
    config.root_cert = Some(common::pem_certificates(&ca)?);
    let anonymous = Client::try_from(config)?;
    let request = http::Request::get("/v1/namespaces/default/runs/before-restart/logs")
        .body(kube::client::Body::empty())?;
    let response = anonymous
        .send(request)
        .await
        .map_err(|e| anyhow::anyhow!("GET without a token: {e:?}"))?;
    ensure!(
        response.status().as_u16() == 401,
        "without a token: {}",
        response.status()
    );
    Ok(())
}

#[tokio::test]
async fn finished_task_logs_survive_a_sigterm_restart_of_kruntimes_up() -> Result<()> {
    logs_survive_a_restart(Stop::Term).await
}

#[tokio::test]
async fn finished_task_logs_survive_a_sigkill_restart_of_kruntimes_up() -> Result<()> {
    logs_survive_a_restart(Stop::Kill).await
}

/// A deleted Run's logs go with it, at once while `kruntimes up` runs, and at the next
/// start for a Run that no longer exists (a directory of an unknown UID).
#[tokio::test]
async fn a_deleted_runs_logs_are_removed_from_the_store() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let data_dir = tmp.path().join("data");
    let options = Options {
        data_dir: Some(data_dir.clone()),
        ..Options::full()
    };
    let (mut server, client) = Server::start_async(options.clone()).await?;
    let run = run_to_end(&client, "deleted", chatty(10)).await?;
    let uid = run.uid().context("a UID")?;
    let dir = store_dir(&data_dir, &uid);
    ensure!(dir.is_dir(), "no logs of the task in the store");
    Api::<Run>::namespaced(client.clone(), "default")
        .delete("deleted", &DeleteParams::default())
        .await?;
    gone(&dir, "the deleted Run's logs go").await?;
    let (ok, _, err) = krt_logs(&server, &["deleted"])?;
    ensure!(
        !ok && err.contains("not found"),
        "krt logs of a deleted Run: {err}"
    );

    // Logs of a Run that no longer exists, as a Run deleted while nothing watched would
    // leave them: the next start removes them; the logs of a Run that exists stay.
    let kept = run_to_end(&client, "kept", chatty(3)).await?;
    let kept_dir = store_dir(&data_dir, &kept.uid().context("a UID")?);
    server.stop()?;
    drop(server);
    let orphan = store_dir(&data_dir, "00000000-dead-4000-8000-000000000000");
    std::fs::create_dir_all(orphan.join("1"))?;
    std::fs::write(orphan.join("1/stdout.log"), b"of no Run")?;
    let (server, _client) = Server::start_async(options).await?;
    gone(&orphan, "the logs of a Run that no longer exists go").await?;
    ensure!(kept_dir.is_dir(), "the logs of an existing Run went");
    let (ok, out, err) = krt_logs(&server, &["kept"])?;
    ensure!(
        ok && out == chatty_stdout(3),
        "krt logs kept: {out:?} {err}"
    );
    Ok(())
}

/// Beyond `--log-store-max-size`, the logs of the oldest finished Runs go; their logs then
/// say so (410 and its message through krt), whether their worker lives or not.
#[tokio::test]
async fn the_cap_removes_the_oldest_finished_logs_and_says_they_are_gone() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let data_dir = tmp.path().join("data");
    let options = Options {
        data_dir: Some(data_dir.clone()),
        extra_args: vec![
            "--log-store-max-size".into(),
            "100Ki".into(),
            "--log-store-check-interval".into(),
            "200ms".into(),
        ],
        ..Options::full()
    };
    let (server, client) = Server::start_async(options).await?;
    // About 150 KiB: over the cap on its own.
    let old = run_to_end(&client, "old", chatty(5_000)).await?;
    let old_dir = store_dir(&data_dir, &old.uid().context("a UID")?);
    gone(&old_dir, "the oldest finished Run's logs go over the cap").await?;
    let new = run_to_end(&client, "new", chatty(3)).await?;
    let new_dir = store_dir(&data_dir, &new.uid().context("a UID")?);
    ensure!(new_dir.is_dir(), "the logs under the cap went too");

    let (status, body) = gateway_logs(&server, "old", "").await?;
    let text = String::from_utf8_lossy(&body);
    ensure!(
        status == 410 && text.contains("LogsGone"),
        "{status} {text}"
    );
    let (ok, out, err) = krt_logs(&server, &["old"])?;
    ensure!(
        !ok && out.is_empty() && err.contains("are gone") && !err.contains("not started"),
        "krt logs of removed logs: {out:?} {err}"
    );
    let (ok, out, err) = krt_logs(&server, &["new"])?;
    ensure!(ok && out == chatty_stdout(3), "krt logs new: {out:?} {err}");
    Ok(())
}
