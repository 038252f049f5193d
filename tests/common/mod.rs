//! What the end-to-end test binaries share: Runs and Runtimes and waits for them, worker
//! processes, function Runs, and a client of a function's endpoint that verifies TLS with
//! the published CA bundle only.

// Each test binary that declares `mod common;` uses a part of it.
#![allow(dead_code)]

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use http_body_util::BodyExt;
use kruntimes_api::run::{FunctionMode, RunEndpoint, RunMode, RunSource};
use kruntimes_api::{Phase, Run, RunSpec, Runtime, RuntimeSpec};
use kruntimes_client::session::{Command, Completed, EventKind, Operation, OutputStream, Session};
use kruntimes_testkit::{Server, within};
use kube::Client;
use kube::api::{Api, PostParams};
use kube::runtime::wait::await_condition;
use serde_json::Value;

/// How long a Run or a Runtime may take to get where a test waits for it.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// A function Run of `runtime` whose inline source is `source`.
pub fn function(runtime: &str, handler: &str, source: &str) -> RunSpec {
    let mut spec = RunSpec::task(runtime, "unused");
    spec.mode = RunMode {
        function: Some(FunctionMode {
            handler: handler.to_string(),
            idle_timeout_seconds: None,
            concurrency: None,
        }),
        ..RunMode::default()
    };
    spec.source = Some(RunSource {
        inline: Some(source.to_string()),
        snapshot: None,
    });
    spec
}

pub fn python(source: &str) -> RunSpec {
    function("python", "main:handle", source)
}

pub async fn create(client: &Client, name: &str, spec: RunSpec) -> Result<Run> {
    Api::<Run>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &Run::new(name, spec))
        .await
        .with_context(|| format!("create Run {name}"))
}

pub async fn wait_for(
    client: &Client,
    name: &str,
    what: &str,
    condition: impl Fn(&Run) -> bool,
) -> Result<Run> {
    let runs = Api::<Run>::namespaced(client.clone(), "default");
    let waited = within(DEADLINE, &format!("Run {name} {what}"), async {
        Ok(await_condition(runs.clone(), name, |run: Option<&Run>| {
            run.is_some_and(&condition)
        })
        .await?)
    })
    .await;
    match waited {
        Ok(found) => found.with_context(|| format!("Run {name} was deleted")),
        Err(error) => {
            let last = runs.get_opt(name).await.ok().flatten();
            Err(error.context(format!(
                "last seen: {:?}",
                last.map(|r| (r.metadata.resource_version.clone(), r.status))
            )))
        }
    }
}

pub async fn wait_ready(client: &Client, name: &str) -> Result<Run> {
    let run = wait_for(client, name, "is Ready", |run| {
        run.phase() == Phase::Ready || run.phase().is_terminal()
    })
    .await?;
    ensure!(
        run.phase() == Phase::Ready,
        "Run {name} ended instead: {:?}",
        run.status
    );
    Ok(run)
}

pub async fn wait_terminal(client: &Client, name: &str) -> Result<Run> {
    wait_for(client, name, "ends", |run| run.phase().is_terminal()).await
}

pub fn ready_condition(run: &Run) -> Option<(String, String)> {
    run.status.as_ref()?.conditions.iter().find_map(|c| {
        (c.type_ == "Ready").then(|| (c.status.clone(), c.reason.clone().unwrap_or_default()))
    })
}

/// Creates a Runtime of `replicas` workers with `runs` slots each and waits for it.
pub async fn create_runtime(
    client: &Client,
    name: &str,
    adapter: &str,
    replicas: i32,
    runs: i32,
) -> Result<()> {
    create_runtime_with(client, name, adapter, replicas, runs, &[]).await
}

/// [`create_runtime`] whose workers' runtime servers get `extra` arguments too (for
/// example `--sandbox process`).
pub async fn create_runtime_with(
    client: &Client,
    name: &str,
    adapter: &str,
    replicas: i32,
    runs: i32,
    extra: &[&str],
) -> Result<()> {
    let mut args = vec!["--adapter".to_string(), adapter.to_string()];
    args.extend(extra.iter().map(|a| (*a).to_string()));
    let api = Api::<Runtime>::namespaced(client.clone(), "default");
    let runtime = Runtime::new(
        name,
        RuntimeSpec {
            replicas,
            scaling: None,
            runs: Some(runs),
            template: kruntimes_api::runtime::template_with_args(args),
            port: None,
            artifact_store: None,
        },
    );
    api.create(&PostParams::default(), &runtime).await?;
    wait_runtime(client, name, "ready", move |rt| {
        rt.status.as_ref().and_then(|s| s.ready_replicas) == Some(replicas)
    })
    .await
}

/// Waits for the Runtime to satisfy `condition`.
pub async fn wait_runtime(
    client: &Client,
    name: &str,
    what: &str,
    condition: impl Fn(&Runtime) -> bool,
) -> Result<()> {
    let api = Api::<Runtime>::namespaced(client.clone(), "default");
    within(DEADLINE, &format!("Runtime {name} {what}"), async {
        await_condition(api.clone(), name, |rt: Option<&Runtime>| {
            rt.is_some_and(&condition)
        })
        .await?;
        Ok(())
    })
    .await
}

/// The processes a Run's code started (they mention `needle`, the Run UID, in their
/// command line or working directory), leaving out the sandbox itself: a `namespaces`
/// holder, whose command line names the workspace it binds, or a `gvisor` sandbox's
/// kernel and file proxy (`runsc-sandbox`, `runsc-gofer`), which name its container.
/// Under `gvisor` the programs themselves are the sandbox kernel's processes, not the
/// host's: what remains here is the host side of each program (the helper and `runsc
/// exec`), which must end with it.
pub fn workload_processes(needle: &str) -> Vec<i32> {
    kruntimes_testkit::procs::mentioning(needle)
        .into_iter()
        .filter(|p| !p.cmdline.contains("__sandbox-holder") && !p.cmdline.starts_with("runsc-"))
        .map(|p| p.pid)
        .collect()
}

pub fn processes_with(needle: &str) -> Vec<i32> {
    kruntimes_testkit::procs::mentioning(needle)
        .into_iter()
        .map(|p| p.pid)
        .collect()
}

/// The runtimed process of the worker Pod `pod`.
pub fn runtimed_of(pod: &str) -> Result<i32> {
    let needle = format!("--pod-name {pod} ");
    let pids: Vec<i32> = kruntimes_testkit::procs::matching(|p| {
        p.cmdline.contains(&needle) && p.cmdline.contains("runtimed")
    })
    .into_iter()
    .map(|p| p.pid)
    .collect();
    match pids.as_slice() {
        [pid] => Ok(*pid),
        other => anyhow::bail!("expected one runtimed for Pod {pod}, found {other:?}"),
    }
}

/// One answer of the gateway.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub invocation_id: Option<String>,
    pub hops: Option<String>,
    pub served_by: Option<String>,
    pub body: Value,
}

/// A client of one function's endpoint: TLS verified with the Run's CA bundle only.
#[derive(Clone)]
pub struct Endpoint {
    pub client: Client,
    pub path: String,
}

impl Endpoint {
    pub fn of(endpoint: &RunEndpoint, token: &str) -> Result<Endpoint> {
        let uri: http::Uri = endpoint.url.parse().context("the endpoint URL")?;
        ensure!(uri.scheme_str() == Some("https"), "{}", endpoint.url);
        let authority = uri.authority().context("no authority")?;
        let mut config = kube::Config::new(format!("https://{authority}").parse()?);
        let pem = endpoint.ca_bundle.as_ref().context("no CA bundle")?;
        config.root_cert = Some(pem_certificates(&pem.0)?);
        config.auth_info.token = Some(token.to_string().into());
        config.read_timeout = Some(Duration::from_secs(120));
        // An invocation is never sent twice: no automatic retry of 429, 503 or 504.
        config.default_retry = false;
        Ok(Endpoint {
            client: Client::try_from(config)?,
            path: uri.path().to_string(),
        })
    }

    /// The same endpoint for another Run UID.
    pub fn for_uid(&self, uid: &str) -> Endpoint {
        let prefix = self.path.rsplit_once('/').map_or("", |(p, _)| p);
        Endpoint {
            client: self.client.clone(),
            path: format!("{prefix}/{uid}:invoke"),
        }
    }

    pub async fn invoke(&self, id: Option<&str>, body: Vec<u8>) -> Result<Answer> {
        let mut request =
            http::Request::post(&self.path).header("content-type", "application/json");
        if let Some(id) = id {
            request = request.header("x-kruntime-invocation-id", id);
        }
        let response = self
            .client
            .send(request.body(kube::client::Body::from(body))?)
            .await
            .map_err(|e| anyhow::anyhow!("invoke {}: {e:?}", self.path))?;
        let (parts, body) = response.into_parts();
        let header = |name: &str| {
            parts
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let (status, invocation_id, hops, served_by) = (
            parts.status.as_u16(),
            header("x-kruntime-invocation-id"),
            header("x-kruntime-hops"),
            header("x-kruntime-served-by"),
        );
        let bytes = body.collect().await?.to_bytes();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Ok(Answer {
            status,
            invocation_id,
            hops,
            served_by,
            body,
        })
    }

    pub async fn invoke_json(&self, id: &str, event: Value) -> Result<Answer> {
        self.invoke(Some(id), serde_json::to_vec(&event)?).await
    }
}

pub fn pem_certificates(pem: &[u8]) -> Result<Vec<Vec<u8>>> {
    kruntimes_client::pem_certificates(pem).map_err(|e| anyhow::anyhow!("the CA bundle: {e}"))
}

/// The Run's endpoint client, for the admin's token.
pub fn endpoint(server: &Server, run: &Run) -> Result<Endpoint> {
    let endpoint = run
        .status
        .as_ref()
        .and_then(|s| s.endpoint.clone())
        .context("a Ready function publishes an endpoint")?;
    let token = kruntimes_testkit::admin_token(&server.kubeconfig_path())?;
    Endpoint::of(&endpoint, &token)
}

/// The host directory of function Run `uid`'s workspace (`KRUNTIME_WORKSPACE` inside),
/// once its worker made it. A sandboxed handler sees no other host path, so tests that
/// hand files to a handler put them here.
pub async fn function_workspace(server: &Server, uid: &str) -> Result<std::path::PathBuf> {
    workspace_under(server, &format!("functions/{uid}")).await
}

/// The host directory of task Run `uid`'s workspace, once its worker made it.
pub async fn task_workspace(server: &Server, uid: &str) -> Result<std::path::PathBuf> {
    workspace_under(server, uid).await
}

/// `workers/<pod>/root/<under>/<attempt>/work`, waiting until it exists.
async fn workspace_under(server: &Server, under: &str) -> Result<std::path::PathBuf> {
    kruntimes_testkit::run_workspace(server, under, DEADLINE).await
}

/// What one operation produced.
#[derive(Debug)]
pub struct Seen {
    pub done: Completed,
    pub stdout: String,
    pub sequences: Vec<u64>,
}

/// Runs `line` in `session`, collecting its stdout and every event's sequence number.
pub async fn exec(session: &mut Session, line: &str) -> Result<Seen> {
    let id = session
        .send(&Operation::command(Command::shell(line)))
        .await?;
    let mut stdout = Vec::new();
    let mut sequences = Vec::new();
    within(DEADLINE, "the operation completes", async {
        loop {
            let event = session.receive().await?;
            if event.operation_id != id {
                continue;
            }
            sequences.push(event.sequence);
            match event.kind {
                EventKind::Output {
                    stream: OutputStream::Stdout,
                    data,
                    ..
                } => {
                    stdout.extend_from_slice(&data);
                }
                EventKind::Completed(done) => {
                    return Ok(Seen {
                        done,
                        stdout: String::from_utf8_lossy(&stdout).into_owned(),
                        sequences: sequences.clone(),
                    });
                }
                EventKind::Failed { status, reason, .. } => {
                    anyhow::bail!("the operation failed: {status} {reason}")
                }
                _ => {}
            }
        }
    })
    .await
}

/// `kruntimes up` with the controller-manager's snapshot data collector running every
/// 200 ms and deleting unreferenced data at once (no grace).
pub fn eager_collector() -> kruntimes_testkit::Options {
    kruntimes_testkit::Options {
        extra_args: [
            "--snapshot-gc-interval",
            "200ms",
            "--snapshot-gc-grace",
            "0s",
        ]
        .map(str::to_string)
        .to_vec(),
        ..kruntimes_testkit::Options::full()
    }
}

/// Waits until the collector has deleted `path` (a data set's directory or file in the
/// store). The condition is the store itself: it is looked at every 50 ms.
pub async fn collected(path: &std::path::Path, what: &str) -> Result<()> {
    within(DEADLINE, &format!("{what} is collected"), async {
        while path.exists() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    })
    .await
}

/// Creates the Runtime `name` (one bash worker with `runs` slots) whose artifacts and
/// snapshots go to the S3 server `s3` under `prefix`, and waits until its worker is ready.
pub async fn create_s3_runtime(
    client: &Client,
    name: &str,
    runs: i32,
    s3: &kruntimes_testkit::s3::S3Server,
    prefix: &str,
) -> Result<()> {
    use kruntimes_api::runtime::{ArtifactStoreSpec, S3ArtifactStore};
    let runtime = Runtime::new(
        name,
        RuntimeSpec {
            replicas: 1,
            scaling: None,
            runs: Some(runs),
            template: kruntimes_api::runtime::template_with_args(vec![
                "--adapter".into(),
                "bash".into(),
            ]),
            port: None,
            artifact_store: Some(ArtifactStoreSpec {
                filesystem: None,
                s3: Some(S3ArtifactStore {
                    endpoint: s3.endpoint(),
                    bucket: s3.bucket().to_string(),
                    prefix: Some(prefix.to_string()),
                    region: None,
                    force_path_style: None,
                }),
            }),
        },
    );
    Api::<Runtime>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &runtime)
        .await?;
    wait_runtime(client, name, "ready", |rt| {
        rt.status.as_ref().and_then(|s| s.ready_replicas) == Some(1)
    })
    .await
}
