//! What the krt test binaries share: running krt against a [`Server`] under a deadline,
//! reading what it printed, and waiting on Runs through the API.
//!
//! Each test binary uses a part of it.
#![allow(dead_code)]

use std::process::Output;
use std::time::Duration;

use anyhow::{Context, Result};
use kruntimes_api::Run;
use kruntimes_testkit::{Server, within};
use kube::api::Api;
use kube::runtime::wait::await_condition;

/// How long any one step of a test may take.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// krt pointed at `server`, without any `KRT_GATEWAY` of the environment the tests run in.
pub fn krt_cmd(server: &Server, args: &[&str]) -> Result<tokio::process::Command> {
    let mut cmd = server.krt()?;
    cmd.env_remove("KRT_GATEWAY").args(args);
    let mut cmd = tokio::process::Command::from(cmd);
    cmd.kill_on_drop(true);
    Ok(cmd)
}

/// Runs a krt command to its end.
pub async fn output(mut cmd: tokio::process::Command) -> Result<Output> {
    within(DEADLINE, "krt", async { Ok(cmd.output().await?) }).await
}

/// Runs `krt ARGS…` against `server` to its end.
pub async fn krt(server: &Server, args: &[&str]) -> Result<Output> {
    output(krt_cmd(server, args)?)
        .await
        .with_context(|| format!("krt {args:?}"))
}

/// Runs `krt ARGS…` against `server` to its end; it must exit with `expected`.
pub async fn krt_exits(server: &Server, args: &[&str], expected: i32) -> Result<Output> {
    let out = krt(server, args).await?;
    assert_eq!(code(&out), expected, "krt {args:?}: {}", describe(&out));
    Ok(out)
}

/// Runs `krt ARGS…` against `server` to its end; it must succeed (exit 0).
pub async fn krt_ok(server: &Server, args: &[&str]) -> Result<Output> {
    krt_exits(server, args, 0).await
}

/// Runs `krt ARGS…` against `server` to its end; it must fail (exit 1) and say `expected`
/// on stderr.
pub async fn krt_fails(server: &Server, args: &[&str], expected: &str) -> Result<Output> {
    let out = krt_exits(server, args, 1).await?;
    assert!(
        text(&out.stderr).contains(expected),
        "krt {args:?} should say {expected:?}: {}",
        describe(&out)
    );
    Ok(out)
}

/// Bytes as text, lossily.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// krt's exit code, -1 when a signal ended it.
pub fn code(out: &Output) -> i32 {
    out.status.code().unwrap_or(-1)
}

/// Everything krt printed, for assertion messages.
pub fn describe(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status.code(),
        text(&out.stdout),
        text(&out.stderr)
    )
}

/// The Runs of the default namespace.
pub fn runs(client: &kube::Client) -> Api<Run> {
    Api::default_namespaced(client.clone())
}

/// Waits until the Run `name` satisfies `condition`.
pub async fn wait_run(
    client: &kube::Client,
    name: &str,
    what: &str,
    condition: impl Fn(Option<&Run>) -> bool,
) -> Result<()> {
    let api = runs(client);
    within(DEADLINE, &format!("run {name} {what}"), async {
        await_condition(api, name, condition).await?;
        Ok(())
    })
    .await
}

/// The host directory of a Run's workspace (see `kruntimes_testkit::run_workspace`).
pub async fn workspace_of(server: &Server, under: &str) -> Result<std::path::PathBuf> {
    kruntimes_testkit::run_workspace(server, under, Duration::from_secs(60)).await
}
