//! One command per component (issue 17 item 1): `kruntimes apiserver`, `kruntimes gateway`
//! and `kruntimes controller-manager` as separate processes, each finding its API server
//! through `KUBECONFIG` (`kube::Config::infer()`), together running what `kruntimes up`
//! runs. Each test starts the real binaries on ephemeral ports in a temporary directory.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kruntimes_api::run::RunSource;
use kruntimes_api::{Phase, RunSpec};
use kruntimes_testkit::{kruntimes_bin, secret_text, within};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use common::{DEADLINE, create, create_runtime, wait_terminal};

/// How long each command may take from SIGTERM to exit 0: the controller-manager stops
/// its workers (the local provisioner's grace is 10 s) and its controllers; a Pod's
/// default termination grace is 30 s.
const GRACE: Duration = Duration::from_secs(30);

/// A component command this test started, killed on drop whatever happens.
struct Component {
    name: &'static str,
    child: Option<Child>,
    pid: Pid,
    stdout: mpsc::Receiver<String>,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Component {
    /// Starts `kruntimes ARGS` with `KUBECONFIG` (when given) as its only way to the API
    /// server, and waits for its line `kruntimes NAME ready`, returning the stdout lines
    /// before it.
    fn start(
        name: &'static str,
        args: &[&str],
        kubeconfig: Option<&Path>,
        home: &Path,
    ) -> Result<(Component, Vec<String>)> {
        Component::start_until(
            name,
            &format!("kruntimes {name} ready"),
            args,
            kubeconfig,
            home,
        )
    }

    /// [`Component::start`], waiting for a line that starts with `ready`.
    fn start_until(
        name: &'static str,
        ready: &str,
        args: &[&str],
        kubeconfig: Option<&Path>,
        home: &Path,
    ) -> Result<(Component, Vec<String>)> {
        let mut command = Command::new(kruntimes_bin()?);
        command.args(args);
        if let Some(kubeconfig) = kubeconfig {
            command.env("KUBECONFIG", kubeconfig);
        }
        Component::spawn(name, ready, command, home)
    }

    /// Runs `command` (`kruntimes …`, or a wrapper that execs it in place, so that its PID
    /// is the component's) with nothing of the test's own way to an API server, and waits
    /// for a stdout line that starts with `ready`.
    fn spawn(
        name: &'static str,
        ready: &str,
        command: Command,
        home: &Path,
    ) -> Result<(Component, Vec<String>)> {
        let component = Component::launch(name, command, home)?;
        let mut before = Vec::new();
        loop {
            match component.stdout.recv_timeout(DEADLINE) {
                Ok(line) if line.starts_with(ready) => return Ok((component, before)),
                Ok(line) => before.push(line),
                Err(_) => bail!(
                    "{name} did not print {ready:?}; stdout {before:?}, stderr:\n{}",
                    component.logs().join("\n")
                ),
            }
        }
    }

    /// [`Component::spawn`] without waiting for anything.
    fn launch(name: &'static str, mut command: Command, home: &Path) -> Result<Component> {
        command
            .env_remove("KRUNTIMES_DATA_DIR")
            // No ~/.kube/config of the machine's user is found by accident.
            .env("HOME", home)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if !command.get_envs().any(|(key, _)| key == "KUBECONFIG") {
            command.env_remove("KUBECONFIG");
        }
        let mut child = command.spawn().with_context(|| format!("spawn {name}"))?;
        let pid = Pid::from_raw(i32::try_from(child.id())?);
        let stdout = child.stdout.take().context("stdout is piped")?;
        let stderr = child.stderr.take().context("stderr is piped")?;
        let (lines, seen) = mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if lines.send(line).is_err() {
                    break;
                }
            }
        });
        let logs = Arc::new(Mutex::new(Vec::new()));
        let sink = logs.clone();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if let Ok(mut logs) = sink.lock() {
                    logs.push(line);
                }
            }
        });
        Ok(Component {
            name,
            child: Some(child),
            pid,
            stdout: seen,
            stderr: logs,
        })
    }

    fn logs(&self) -> Vec<String> {
        self.stderr.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Waits until a stderr line satisfies `wanted` (the reader thread may lag behind the
    /// stdout line that said the component is ready), returning the lines so far.
    fn wait_log(&self, what: &str, wanted: impl Fn(&str) -> bool) -> Result<Vec<String>> {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let logs = self.logs();
            if logs.iter().any(|l| wanted(l)) {
                return Ok(logs);
            }
            ensure!(
                Instant::now() < deadline,
                "{} never logged {what}: {logs:?}",
                self.name
            );
            // The condition is the log line; look again shortly.
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then the exit within [`GRACE`]; an exit other than 0 is an error.
    fn terminate(mut self) -> Result<Duration> {
        let mut child = self.child.take().context("not yet stopped")?;
        let asked = Instant::now();
        kill(self.pid, Signal::SIGTERM)?;
        let (done, exited) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = done.send(child.wait());
        });
        let status = exited
            .recv_timeout(GRACE)
            .with_context(|| format!("{} did not exit within {GRACE:?} of SIGTERM", self.name))??;
        ensure!(
            status.success(),
            "{} exited {status} after SIGTERM; stderr:\n{}",
            self.name,
            self.logs().join("\n")
        );
        Ok(asked.elapsed())
    }
}

impl Drop for Component {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = kill(self.pid, Signal::SIGKILL);
            let _ = child.wait();
        }
    }
}

/// The value after `prefix` in one of `lines`.
fn after(lines: &[String], prefix: &str) -> Result<String> {
    lines
        .iter()
        .find_map(|l| l.strip_prefix(prefix))
        .map(str::to_string)
        .with_context(|| format!("no line {prefix:?} in {lines:?}"))
}

/// A client of a plain HTTP (`http://ADDR`) or HTTPS (`https://ADDR`, verified with the PEM
/// CA at `ca` only) server, for probes and scrapes.
fn http_client(base: &str, ca: Option<&Path>) -> Result<kube::Client> {
    let mut config = kube::Config::new(base.parse()?);
    if let Some(ca) = ca {
        config.root_cert = Some(common::pem_certificates(&std::fs::read(ca)?)?);
    }
    Ok(kube::Client::try_from(config)?)
}

/// `GET path` answered 200, with its body.
async fn get(client: &kube::Client, path: &str) -> Result<String> {
    Ok(client
        .request_text(http::Request::get(path).body(Vec::new())?)
        .await?)
}

/// Waits for `/readyz` to answer 200 (it answers 503 until then), by asking again.
async fn wait_readyz(client: &kube::Client, what: &str) -> Result<String> {
    within(DEADLINE, &format!("{what}'s /readyz"), async {
        loop {
            match get(client, "/readyz").await {
                Ok(body) => return Ok(body),
                // Not ready yet: the probe is the condition; ask again shortly.
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    })
    .await
}

/// A started `kruntimes apiserver`.
struct Apiserver {
    component: Component,
    /// The admin's client, once `/readyz` answers.
    admin: kube::Client,
    /// Its data directory (`DIR/data`).
    data: std::path::PathBuf,
    /// What it printed up to its ready line.
    said: Vec<String>,
}

/// Starts `kruntimes apiserver` on an ephemeral port with the data directory `dir/data`,
/// and waits until its `/readyz` answers.
async fn start_apiserver(dir: &Path) -> Result<Apiserver> {
    let data = dir.join("data");
    let data_arg = data.display().to_string();
    let (component, said) = Component::start(
        "apiserver",
        &[
            "apiserver",
            "--addr",
            "127.0.0.1:0",
            "--data-dir",
            &data_arg,
        ],
        None,
        dir,
    )?;
    let text = std::fs::read_to_string(data.join("kubeconfig"))?;
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&text)?;
    let admin = kube::Client::try_from(
        kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?,
    )?;
    wait_readyz(&admin, "the API server").await?;
    Ok(Apiserver {
        component,
        admin,
        data,
        said,
    })
}

/// Starts `kruntimes controller-manager --provisioner local` on the data directory `data`
/// of the API server, publishing `gateway_url`; it and what it printed up to its ready
/// line.
fn start_local_controller(
    dir: &Path,
    data: &Path,
    gateway_url: &str,
) -> Result<(Component, Vec<String>)> {
    let data_arg = data.display().to_string();
    Component::start(
        "controller-manager",
        &[
            "controller-manager",
            "--provisioner",
            "local",
            "--data-dir",
            &data_arg,
            "--gateway-url",
            gateway_url,
            "--health-addr",
            "127.0.0.1:0",
        ],
        Some(
            &data
                .join("components")
                .join("controller-manager.kubeconfig"),
        ),
        dir,
    )
}

/// Issue 17 item 1: the API server, the gateway and the controller-manager (local
/// provisioner) run as three processes, the latter two finding the API server through
/// `KUBECONFIG` alone (their own identities' kubeconfigs). A task Run on a Runtime of
/// theirs succeeds; each serves `/readyz` and `/metrics` (the gateway on its HTTPS
/// address, the controller-manager on its health address); the gateway logs JSON lines with
/// `--log-format json`; each exits 0 within its grace on SIGTERM, and no worker process is
/// left behind.
#[tokio::test]
async fn the_component_commands_run_the_system_as_separate_processes() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let Apiserver {
        component: apiserver,
        admin,
        data,
        ..
    } = start_apiserver(dir.path()).await?;
    let data_arg = data.display().to_string();
    let components = data.join("components");
    let (gateway, said) = Component::start(
        "gateway",
        &[
            "--log-format",
            "json",
            "gateway",
            "--addr",
            "127.0.0.1:0",
            "--data-dir",
            &data_arg,
        ],
        Some(&components.join("gateway.kubeconfig")),
        dir.path(),
    )?;
    let gateway_url = after(&said, "gateway ready at ")?;
    let gateway_ca = components.join("gateway-ca.crt");
    let (controller, said) = start_local_controller(dir.path(), &data, &gateway_url)?;
    let health = after(&said, "controller-manager health at ")?;

    let gateway_http = http_client(&gateway_url, Some(&gateway_ca))?;
    let controller_http = http_client(&health, None)?;
    wait_readyz(&gateway_http, "the gateway").await?;
    let state = wait_readyz(&controller_http, "the controller-manager").await?;
    ensure!(state.starts_with("ok: "), "controller /readyz: {state:?}");
    ensure!(get(&controller_http, "/healthz").await?.trim() == "ok");

    create_runtime(&admin, "py", "python", 1, 2).await?;
    let mut spec = RunSpec::task("py", "main.py");
    spec.source = Some(RunSource {
        inline: Some("print(6 * 7)\n".to_string()),
        snapshot: None,
    });
    create(&admin, "answer", spec).await?;
    let run = wait_terminal(&admin, "answer").await?;
    let phase = run.status.as_ref().and_then(|s| s.phase);
    ensure!(
        phase == Some(Phase::Succeeded),
        "the task Run ended {run:?}"
    );
    // The controller-manager leads by now: it placed the Run.
    let state = get(&controller_http, "/readyz").await?;
    ensure!(
        state.trim() == "ok: leading",
        "controller /readyz: {state:?}"
    );

    // One local provisioner per data directory: a second controller-manager is refused
    // at once, naming the reason, and the first one's workers keep running.
    let second = Command::new(kruntimes_bin()?)
        .args([
            "controller-manager",
            "--data-dir",
            &data_arg,
            "--gateway-url",
            &gateway_url,
            "--health-addr",
            "127.0.0.1:0",
        ])
        .env(
            "KUBECONFIG",
            components.join("controller-manager.kubeconfig"),
        )
        .env("HOME", dir.path())
        .stdin(Stdio::null())
        .output()?;
    let refused = String::from_utf8_lossy(&second.stderr);
    ensure!(
        !second.status.success() && refused.contains("runs the local workers"),
        "a second controller-manager on the same data directory: {refused}"
    );

    // The worker's runtimed serves its probes beside its metrics (`--health-addr`).
    let pods = kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(admin.clone(), "default")
        .list(&kube::api::ListParams::default().labels("kruntimes.io/runtime=py"))
        .await?;
    let port = pods
        .items
        .iter()
        .flat_map(|pod| pod.spec.iter())
        .flat_map(|spec| spec.containers.iter())
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some("metrics"))
        .map(|p| p.container_port)
        .context("the worker Pod has a metrics port")?;
    let runtimed_http = http_client(&format!("http://127.0.0.1:{port}"), None)?;
    ensure!(get(&runtimed_http, "/healthz").await?.trim() == "ok");
    ensure!(get(&runtimed_http, "/readyz").await?.trim() == "ok");

    let metrics = get(&controller_http, "/metrics").await?;
    ensure!(
        metrics.contains("kruntimes_session_expired_total"),
        "controller metrics: {metrics}"
    );
    let metrics = get(&gateway_http, "/metrics").await?;
    ensure!(
        metrics.contains("kruntimes_gateway_"),
        "gateway metrics: {metrics}"
    );

    // --log-format json: every log line is one JSON object, the event flattened in.
    let logs = gateway.wait_log("gateway listening", |line| {
        line.contains("\"message\":\"gateway listening\"")
    })?;
    for line in &logs {
        let object: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("a gateway log line is not JSON: {line:?}"))?;
        ensure!(
            object.get("level").is_some() && object.get("timestamp").is_some(),
            "{line}"
        );
    }

    let workers = data.join("workers");
    ensure!(
        !common::processes_with(&workers.display().to_string()).is_empty(),
        "the controller-manager's workers run"
    );
    for component in [controller, gateway, apiserver] {
        let name = component.name;
        let took = component.terminate()?;
        eprintln!("{name} stopped {took:?} after SIGTERM");
    }
    let left = common::processes_with(&workers.display().to_string());
    ensure!(left.is_empty(), "worker processes left behind: {left:?}");
    Ok(())
}

/// Issue 17: on a cluster runtimed may start before its runtime server sidecar answers; a
/// Pod deleted meanwhile must not wait out the whole wait for the socket
/// (`RUNTIME_SERVER_WAIT`, 60 s, longer than [`GRACE`]): SIGTERM during the wait ends
/// runtimed at once, with exit 0.
#[tokio::test]
async fn runtimed_waiting_for_its_runtime_server_stops_on_sigterm() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let apiserver = start_apiserver(dir.path()).await?;
    let socket = dir.path().join("never-served.sock");
    let mut command = Command::new(kruntimes_bin()?);
    command
        .args(["runtimed", "--namespace", "default", "--pod-name", "w-0"])
        .args([
            "--runtime",
            "py",
            "--listen",
            "127.0.0.1:0",
            "--runtime-socket",
        ])
        .arg(&socket)
        .env("KUBECONFIG", apiserver.data.join("kubeconfig"));
    let runtimed = Component::launch("runtimed", command, dir.path())?;
    runtimed.wait_log("the wait for its runtime server", |line| {
        line.contains("waiting for the runtime server")
    })?;
    let took = runtimed.terminate()?;
    eprintln!("runtimed stopped {took:?} after SIGTERM, still waiting for its runtime server");
    Ok(())
}

/// Issue 17 item 1: `kruntimes runtime-server` is the runtime server binary the local
/// provisioner starts (exec'd, with the same flags): it serves its socket, logs JSON with
/// `--log-format json`, and exits 0 on SIGTERM.
#[test]
fn the_runtime_server_command_is_the_runtime_server() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("runtime.sock");
    let root = dir.path().join("root");
    let socket_arg = socket.display().to_string();
    let root_arg = root.display().to_string();
    let (server, _) = Component::start_until(
        "runtime-server",
        "listening on ",
        &[
            "--log-format",
            "json",
            "runtime-server",
            "--socket",
            &socket_arg,
            "--root",
            &root_arg,
            "--sandbox",
            "process",
            "--cgroups",
            "off",
        ],
        None,
        dir.path(),
    )?;
    ensure!(socket.exists(), "no socket at {}", socket.display());
    server.wait_log("a JSON line saying it started", |line| {
        serde_json::from_str::<serde_json::Value>(line)
            .is_ok_and(|l| l["message"] == "runtime server starting")
    })?;
    server.terminate()?;
    Ok(())
}

/// Waits, through a watch with a deadline, until `cond` holds for object `name`.
async fn wait_object<K>(
    api: &kube::Api<K>,
    name: &str,
    what: &str,
    cond: impl kube::runtime::wait::Condition<K>,
) -> Result<K>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
{
    let found = within(DEADLINE, &format!("{name}: {what}"), async {
        Ok(kube::runtime::wait::await_condition(api.clone(), name, cond).await?)
    })
    .await?;
    found.with_context(|| format!("{name} is gone while waiting for {what}"))
}

/// Issue 17 item 2: `kruntimes controller-manager --provisioner kubernetes` against
/// `kruntimes apiserver` keeps a Deployment and a Service per Runtime (owned by it) and the
/// gateway's CA as a ConfigMap in the Runtime's namespace; the Deployment follows
/// `spec.replicas`; the Runtime's `status.replicas` follows the Deployment's status; a
/// deleted Runtime's Deployment and Service go. Nothing makes Pods of the Deployment here
/// (no kubelet or Deployment controller runs); the test writes the Deployment's status as
/// the Deployment controller would, a stand-in for what cannot run here.
#[tokio::test]
async fn the_kubernetes_provisioner_keeps_a_deployment_and_a_service_per_runtime() -> Result<()> {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::{ConfigMap, Service};
    use kruntimes_api::Runtime;
    use kube::api::{DeleteParams, Patch, PatchParams};

    let dir = tempfile::tempdir()?;
    let Apiserver {
        component: apiserver,
        admin,
        data,
        ..
    } = start_apiserver(dir.path()).await?;
    let gateway_ca = dir.path().join("gateway-ca.crt");
    let ca_text = std::fs::read_to_string(data.join("pki").join("ca.crt"))
        .context("the API server's CA stands in for the gateway's")?;
    std::fs::write(&gateway_ca, &ca_text)?;
    let (controller, _) = Component::start(
        "controller-manager",
        &[
            "controller-manager",
            "--provisioner",
            "kubernetes",
            "--worker-image",
            "registry.example/kruntimes/control-plane:9",
            "--gateway-url",
            "https://kruntimes-gateway.kruntimes-system.svc",
            "--gateway-ca",
            &gateway_ca.display().to_string(),
            "--worker-ca-secret",
            "kruntimes-system/kruntimes-worker-ca",
            "--health-addr",
            "127.0.0.1:0",
        ],
        Some(
            &data
                .join("components")
                .join("controller-manager.kubeconfig"),
        ),
        dir.path(),
    )?;

    let runtimes: kube::Api<Runtime> = kube::Api::namespaced(admin.clone(), "default");
    let spec = kruntimes_api::RuntimeSpec {
        replicas: 2,
        scaling: None,
        runs: Some(4),
        template: kruntimes_api::runtime::template_with_args(vec![
            "--adapter".into(),
            "python".into(),
        ]),
        port: None,
        artifact_store: None,
    };
    runtimes
        .create(&Default::default(), &Runtime::new("py", spec))
        .await?;
    let runtime_uid = runtimes.get("py").await?.metadata.uid.context("a UID")?;
    let deployments: kube::Api<Deployment> = kube::Api::namespaced(admin.clone(), "default");
    let deployment = wait_object(
        &deployments,
        "kruntimes-py",
        "created with 2 replicas",
        |d: Option<&Deployment>| {
            d.and_then(|d| d.spec.as_ref()).and_then(|s| s.replicas) == Some(2)
        },
    )
    .await?;
    let owner = &deployment
        .metadata
        .owner_references
        .clone()
        .unwrap_or_default();
    ensure!(
        owner.len() == 1 && owner[0].uid == runtime_uid && owner[0].controller == Some(true),
        "{owner:?}"
    );
    let pod = deployment
        .spec
        .and_then(|s| s.template.spec)
        .context("a Pod template")?;
    let images: Vec<_> = pod
        .init_containers
        .iter()
        .flatten()
        .chain(&pod.containers)
        .map(|c| (c.name.as_str(), c.image.clone().unwrap_or_default()))
        .collect();
    ensure!(
        images
            == [
                ("runtime", "kruntimes/runtime:0.1.0".to_string()),
                (
                    "runtimed",
                    "registry.example/kruntimes/control-plane:9".to_string()
                )
            ],
        "{images:?}"
    );
    ensure!(pod.automount_service_account_token == Some(false));
    let services: kube::Api<Service> = kube::Api::namespaced(admin.clone(), "default");
    let service = services.get("kruntimes-py").await?;
    let port = &service.spec.and_then(|s| s.ports).unwrap_or_default()[0];
    ensure!(port.port == 9443, "{port:?}");
    let config_maps: kube::Api<ConfigMap> = kube::Api::namespaced(admin.clone(), "default");
    let ca = config_maps.get("kruntimes-gateway-ca").await?;
    ensure!(ca.data.unwrap_or_default().get("ca.crt") == Some(&ca_text));
    worker_identity_is_bound_in_its_namespace_only(&admin, &pod).await?;
    worker_tls_is_issued_from_the_cluster_ca(&admin, &pod, dir.path()).await?;

    // Scaling the Runtime scales the Deployment.
    runtimes
        .patch(
            "py",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"replicas": 3}})),
        )
        .await?;
    wait_object(
        &deployments,
        "kruntimes-py",
        "scaled to 3",
        |d: Option<&Deployment>| {
            d.and_then(|d| d.spec.as_ref()).and_then(|s| s.replicas) == Some(3)
        },
    )
    .await?;
    // The Deployment controller's part: its status says 3 Pods exist.
    deployments
        .patch_status(
            "kruntimes-py",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"replicas": 3, "readyReplicas": 0}})),
        )
        .await?;
    wait_object(
        &runtimes,
        "py",
        "status.replicas 3 from the Deployment",
        |r: Option<&Runtime>| r.and_then(|r| r.status.as_ref()).and_then(|s| s.replicas) == Some(3),
    )
    .await?;

    runtimes.delete("py", &DeleteParams::default()).await?;
    within(DEADLINE, "the Runtime's objects go", async {
        let gone = |r: Option<&Deployment>| r.is_none();
        kube::runtime::wait::await_condition(deployments.clone(), "kruntimes-py", gone).await?;
        let gone = |r: Option<&Service>| r.is_none();
        kube::runtime::wait::await_condition(services.clone(), "kruntimes-py", gone).await?;
        let gone = |r: Option<&Runtime>| r.is_none();
        kube::runtime::wait::await_condition(runtimes.clone(), "py", gone).await?;
        Ok(())
    })
    .await?;
    for component in [controller, apiserver] {
        component.terminate()?;
    }
    Ok(())
}

/// A TLS handshake between `server` and `client` over loopback, the client verifying the
/// server as `name`: what each side saw (the server requires a client certificate).
async fn handshake(
    server: std::sync::Arc<rustls::ServerConfig>,
    client: std::sync::Arc<rustls::ClientConfig>,
    name: &str,
) -> Result<(Result<(), String>, Result<(), String>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let name = rustls::pki_types::ServerName::try_from(name.to_string())?;
    let serve = async {
        let (tcp, _) = listener.accept().await.map_err(|e| e.to_string())?;
        let stream = tokio_rustls::TlsAcceptor::from(server)
            .accept(tcp)
            .await
            .map_err(|e| e.to_string())?;
        match stream.get_ref().1.peer_certificates() {
            Some(chain) if !chain.is_empty() => Ok(()),
            _ => Err("no client certificate".to_string()),
        }
    };
    let connect = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let mut stream = tokio_rustls::TlsConnector::from(client)
            .connect(name, tcp)
            .await
            .map_err(|e| e.to_string())?;
        // In TLS 1.3 the server checks the client's certificate after the client's side
        // ends: a refusal arrives as an alert on the first read.
        use tokio::io::AsyncWriteExt;
        stream.shutdown().await.map_err(|e| e.to_string())
    };
    within(DEADLINE, "a TLS handshake", async {
        Ok(tokio::join!(serve, connect))
    })
    .await
}

/// Issue 17 item 4, without cert-manager: the controller-manager made the worker CA in its
/// Secret (`--worker-ca-secret`), issued from it the `default` namespace's worker material
/// and the gateway's, and gave runtimed the namespace's Secret and the flags that read it.
/// The material does mutual TLS as runtimed and the gateway use it (`WorkerTls`): a worker
/// of `default`, under any Pod name, accepts the gateway and its peers and is accepted by
/// them; it cannot pass as a worker of another namespace, neither at a handshake nor at
/// runtimed's start.
async fn worker_tls_is_issued_from_the_cluster_ca(
    admin: &kube::Client,
    pod: &k8s_openapi::api::core::v1::PodSpec,
    dir: &Path,
) -> Result<()> {
    use k8s_openapi::api::core::v1::Secret;
    use kruntimes_wire::worker::WorkerTls;
    let secrets = |namespace| kube::Api::<Secret>::namespaced(admin.clone(), namespace);
    let ca_secret = secrets("kruntimes-system")
        .get("kruntimes-worker-ca")
        .await?;
    let ca = secret_text(&ca_secret, "ca.crt")?;
    ensure!(secret_text(&ca_secret, "ca.key")?.contains("PRIVATE KEY"));
    // The namespace's is issued before the Deployment; the gateway's by a task of its own
    // from the start, which may be retrying.
    let workers = secrets("default").get("kruntimes-worker-tls").await?;
    let gateway = wait_object(
        &secrets("kruntimes-system"),
        "kruntimes-gateway-worker-tls",
        "issued",
        |s: Option<&Secret>| s.is_some(),
    )
    .await?;
    for secret in [&workers, &gateway] {
        ensure!(
            secret.type_.as_deref() == Some("kubernetes.io/tls")
                && secret_text(secret, "ca.crt")? == ca,
            "{:?} is a TLS Secret of the worker CA",
            secret.metadata.name
        );
    }

    let runtimed = pod
        .containers
        .iter()
        .find(|c| c.name == "runtimed")
        .context("a runtimed container")?;
    let args = runtimed.args.clone().unwrap_or_default();
    for flag in [
        "--tls-cert=/etc/kruntimes/worker-tls/tls.crt",
        "--tls-key=/etc/kruntimes/worker-tls/tls.key",
        "--tls-ca=/etc/kruntimes/worker-tls/ca.crt",
    ] {
        ensure!(args.iter().any(|a| a == flag), "{flag} in {args:?}");
    }
    let mounts_tls = |c: &k8s_openapi::api::core::v1::Container| {
        c.volume_mounts
            .iter()
            .flatten()
            .any(|m| m.name == "worker-tls" && m.mount_path == "/etc/kruntimes/worker-tls")
    };
    ensure!(mounts_tls(runtimed), "runtimed mounts its material");
    ensure!(
        !pod.init_containers.iter().flatten().any(mounts_tls),
        "the runtime container (user code) never sees it"
    );
    ensure!(
        pod.volumes.iter().flatten().any(|v| v.name == "worker-tls"
            && v.secret.as_ref().and_then(|s| s.secret_name.as_deref())
                == Some("kruntimes-worker-tls")),
        "{:?}",
        pod.volumes
    );

    let material = |secret: &Secret, origin: &str| -> Result<WorkerTls> {
        Ok(WorkerTls::from_pem(
            secret_text(secret, "tls.crt")?,
            secret_text(secret, "tls.key")?,
            secret_text(secret, "ca.crt")?,
            origin,
        )?)
    };
    let worker = material(&workers, "default's workers")?;
    let gateway = material(&gateway, "the gateway")?;
    let pod_name = "kruntimes-py-6f7d8c9b4-x2k4p.default.kruntimes-worker";
    let (served, connected) =
        handshake(worker.server_config(), gateway.client_config(), pod_name).await?;
    ensure!(
        served.is_ok() && connected.is_ok(),
        "gateway to worker: {served:?} {connected:?}"
    );
    let (served, connected) = handshake(
        worker.server_config(),
        worker.client_config(),
        "kruntimes-py-6f7d8c9b4-q9zt5.default.kruntimes-worker",
    )
    .await?;
    ensure!(
        served.is_ok() && connected.is_ok(),
        "a peer worker forwarding: {served:?} {connected:?}"
    );
    let (_, connected) = handshake(
        worker.server_config(),
        gateway.client_config(),
        "kruntimes-py-6f7d8c9b4-x2k4p.team-b.kruntimes-worker",
    )
    .await?;
    ensure!(
        connected
            .as_ref()
            .is_err_and(|e| e.contains("not valid for name")),
        "a worker of default passed as one of team-b: {connected:?}"
    );

    // runtimed checks its own material at start: it is any Pod's of default (runtimed
    // goes on, and stops only for want of an API server here), and none of team-b's.
    let files = dir.join("default-worker-tls");
    std::fs::create_dir_all(&files)?;
    for key in ["tls.crt", "tls.key", "ca.crt"] {
        std::fs::write(files.join(key), secret_text(&workers, key)?)?;
    }
    let paths = || {
        [
            files.join("tls.crt"),
            files.join("tls.key"),
            files.join("ca.crt"),
        ]
    };
    let (_, stderr) = runtimed_start(dir, "default", "kruntimes-py-6f7d8c9b4-x2k4p", paths())?;
    ensure!(
        !stderr.contains("not issued for") && stderr.contains("find the API server"),
        "{stderr}"
    );
    let (refused, stderr) = runtimed_start(dir, "team-b", "w-mine", paths())?;
    ensure!(
        refused
            && stderr.contains("w-mine.team-b.kruntimes-worker")
            && stderr.contains("not issued for"),
        "{stderr}"
    );
    Ok(())
}

/// Starts `kruntimes runtimed` for Pod `pod` of `namespace` with the TLS files
/// `[cert, key, ca]` and no API server to find: whether it failed, and its stderr.
fn runtimed_start(
    dir: &Path,
    namespace: &str,
    pod: &str,
    [cert, key, ca]: [std::path::PathBuf; 3],
) -> Result<(bool, String)> {
    let out = Command::new(kruntimes_bin()?)
        .args([
            "runtimed",
            "--namespace",
            namespace,
            "--pod-name",
            pod,
            "--runtime",
            "bash",
        ])
        .arg("--runtime-socket")
        .arg(dir.join("runtime.sock"))
        .arg("--tls-cert")
        .arg(cert)
        .arg("--tls-key")
        .arg(key)
        .arg("--tls-ca")
        .arg(ca)
        .env("HOME", dir)
        .env_remove("KUBECONFIG")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdin(Stdio::null())
        .output()?;
    Ok((
        !out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// Issue 17 item 3: the worker Pods run as the `default` namespace's own ServiceAccount,
/// which the controller-manager made (through its own least-privilege identity) and bound:
/// it may do what runtimed does in `default`, nothing in another namespace, and the
/// authorizer's reviews cluster-wide. Checked by the API server's RBAC, through
/// SubjectAccessReviews.
async fn worker_identity_is_bound_in_its_namespace_only(
    admin: &kube::Client,
    pod: &k8s_openapi::api::core::v1::PodSpec,
) -> Result<()> {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
    };
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::ClusterRoleBinding;

    let account = pod
        .service_account_name
        .clone()
        .context("the Pods name their ServiceAccount")?;
    let accounts: kube::Api<ServiceAccount> = kube::Api::namespaced(admin.clone(), "default");
    let made = wait_object(&accounts, &account, "made", |a: Option<&ServiceAccount>| {
        a.is_some()
    })
    .await?;
    ensure!(
        made.automount_service_account_token == Some(false),
        "{made:?}"
    );
    let user = format!("system:serviceaccount:default:{account}");
    let reviews: kube::Api<SubjectAccessReview> = kube::Api::all(admin.clone());
    let may = |verb: &str, group: &str, resource: &str, namespace: &str| {
        let (resource, subresource) = match resource.split_once('/') {
            Some((resource, subresource)) => (resource, Some(subresource.to_string())),
            None => (resource, None),
        };
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(user.clone()),
                groups: Some(vec![
                    "system:serviceaccounts".to_string(),
                    "system:serviceaccounts:default".to_string(),
                    "system:authenticated".to_string(),
                ]),
                resource_attributes: Some(ResourceAttributes {
                    verb: Some(verb.to_string()),
                    group: Some(group.to_string()),
                    resource: Some(resource.to_string()),
                    subresource,
                    namespace: (!namespace.is_empty()).then(|| namespace.to_string()),
                    ..ResourceAttributes::default()
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let reviews = reviews.clone();
        async move {
            let answer = reviews.create(&Default::default(), &review).await?;
            anyhow::Ok(answer.status.is_some_and(|s| s.allowed))
        }
    };
    // The bindings are applied one after another: wait for the last.
    let bindings: kube::Api<ClusterRoleBinding> = kube::Api::all(admin.clone());
    let authorizer = wait_object(
        &bindings,
        "kruntimes:authorizer:default",
        "made",
        |b: Option<&ClusterRoleBinding>| b.is_some(),
    )
    .await?;
    // Owned by the namespace: it goes with it, and a later namespace of that name does
    // not inherit it.
    let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> =
        kube::Api::all(admin.clone());
    let namespace_uid = namespaces.get("default").await?.metadata.uid;
    let owners = authorizer.metadata.owner_references.unwrap_or_default();
    ensure!(
        owners.len() == 1
            && owners[0].kind == "Namespace"
            && Some(&owners[0].uid) == namespace_uid.as_ref(),
        "{owners:?}"
    );
    let cases = [
        ("patch", "kruntimes.io", "runs/status", "default", true),
        ("create", "kruntimes.io", "snapshots", "default", true),
        ("watch", "", "pods", "default", true),
        ("patch", "kruntimes.io", "runs/status", "other", false),
        ("create", "kruntimes.io", "snapshots", "other", false),
        ("delete", "kruntimes.io", "runs", "default", false),
        ("get", "", "secrets", "default", false),
        ("create", "authentication.k8s.io", "tokenreviews", "", true),
        (
            "create",
            "authorization.k8s.io",
            "subjectaccessreviews",
            "",
            true,
        ),
        (
            "watch",
            "rbac.authorization.k8s.io",
            "rolebindings",
            "",
            true,
        ),
    ];
    for (verb, group, resource, namespace, want) in cases {
        let got = may(verb, group, resource, namespace).await?;
        ensure!(
            got == want,
            "{user} {verb} {group}/{resource} in {namespace:?}: {got}, want {want}"
        );
    }
    Ok(())
}

/// A component command that finds no API server says so and how to give one, instead of
/// panicking or retrying forever.
#[test]
fn a_command_without_an_api_server_says_how_to_give_one() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let out = Command::new(kruntimes_bin()?)
        .args(["gateway", "--addr", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .env("HOME", dir.path())
        .env_remove("KUBECONFIG")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdin(Stdio::null())
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "it started: {stderr}");
    ensure!(
        stderr.contains("find the API server") && stderr.contains("--kubeconfig"),
        "{stderr}"
    );
    Ok(())
}

/// The standard path of a Pod's service-account token, CA and namespace.
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// `kruntimes ARGS` as a Pod runs it: no kubeconfig, `KUBERNETES_SERVICE_HOST` and
/// `KUBERNETES_SERVICE_PORT` naming the API server, and the files of `account` (a token,
/// the CA, the namespace) at [`SERVICE_ACCOUNT_DIR`]. That path is the kubelet's, fixed in
/// every client library, so the command runs in a mount namespace of its own (`unshare`,
/// private propagation) with a tmpfs over `/run` (`/var/run` links there) holding the
/// files: nothing of the machine's own `/run` changes. It execs in place, so the PID is
/// the component's.
fn in_cluster(account: &Path, api: &http::Uri, args: &[&str]) -> Result<Command> {
    let run = std::fs::canonicalize("/var/run")?;
    let script = format!(
        "set -e; mount -t tmpfs -o mode=0755 kruntimes-test {run}; \
         mkdir -p {SERVICE_ACCOUNT_DIR}; cp \"$1\"/token \"$1\"/ca.crt \"$1\"/namespace \
         {SERVICE_ACCOUNT_DIR}/; shift; exec \"$@\"",
        run = run.display()
    );
    let mut command = Command::new("unshare");
    command
        .args(["--mount", "--propagation", "private", "/bin/sh", "-c"])
        .arg(script)
        .arg("sh")
        .arg(account)
        .arg(kruntimes_bin()?)
        .args(args)
        .env(
            "KUBERNETES_SERVICE_HOST",
            api.host().context("the API server URL has a host")?,
        )
        .env(
            "KUBERNETES_SERVICE_PORT",
            api.port_u16()
                .context("the API server URL has a port")?
                .to_string(),
        );
    Ok(command)
}

/// Writes what the kubelet would mount for a Pod of ServiceAccount
/// `kruntimes-system/account`: a token from a TokenRequest, the API server's CA and the
/// namespace, into `dir`.
async fn service_account_files(
    admin: &kube::Client,
    account: &str,
    ca_pem: &[u8],
    dir: &Path,
) -> Result<()> {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    use k8s_openapi::api::core::v1::ServiceAccount;
    let request = TokenRequest {
        spec: TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..TokenRequestSpec::default()
        },
        ..TokenRequest::default()
    };
    let token = kube::Api::<ServiceAccount>::namespaced(admin.clone(), "kruntimes-system")
        .create_token_request(account, &kube::api::PostParams::default(), &request)
        .await
        .with_context(|| format!("a token of the ServiceAccount {account}"))?
        .status
        .map(|s| s.token)
        .context("the TokenRequest answer has no token")?;
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("token"), token)?;
    std::fs::write(dir.join("ca.crt"), ca_pem)?;
    std::fs::write(dir.join("namespace"), "kruntimes-system")?;
    Ok(())
}

/// Issue 17 item 1: the gateway and the controller-manager configured the in-cluster way
/// (no kubeconfig; `KUBERNETES_SERVICE_HOST/PORT` and their ServiceAccounts' token and CA
/// at the kubelet's path) find the API server through `kube::Config::infer()` and run the
/// system: the gateway is ready (its `/readyz` asks the API server) and reviews tokens
/// with its own identity, the controller-manager leads, and a task Run succeeds.
///
/// A mount namespace needs CAP_SYS_ADMIN: without it (not root) the test says so and
/// passes; CI runs as root.
#[tokio::test]
async fn the_components_find_the_api_server_the_in_cluster_way() -> Result<()> {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipped: a mount namespace for the service-account files needs root");
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let Apiserver {
        component: apiserver,
        admin,
        data,
        said,
    } = start_apiserver(dir.path()).await?;
    let data_arg = data.display().to_string();
    let origin = after(&said, "apiserver ready at ")?;
    let api: http::Uri = origin.parse()?;
    let text = std::fs::read_to_string(data.join("kubeconfig"))?;
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&text)?;
    let ca_pem = kubeconfig
        .clusters
        .iter()
        .find_map(|c| c.cluster.as_ref()?.certificate_authority_data.clone())
        .context("the admin kubeconfig carries the API server's CA")?;
    let ca_pem = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, ca_pem)?;

    let gateway_account = dir.path().join("sa-gateway");
    service_account_files(&admin, "kruntimes-gateway", &ca_pem, &gateway_account).await?;
    let command = in_cluster(
        &gateway_account,
        &api,
        &["gateway", "--addr", "127.0.0.1:0", "--data-dir", &data_arg],
    )?;
    let (gateway, said) =
        Component::spawn("gateway", "kruntimes gateway ready", command, dir.path())?;
    let gateway_url = after(&said, "gateway ready at ")?;
    gateway.wait_log("where it found the API server", |line| {
        line.contains("API server found by kube::Config::infer()") && line.contains(&origin)
    })?;
    let gateway_http = http_client(
        &gateway_url,
        Some(&data.join("components").join("gateway-ca.crt")),
    )?;
    ensure!(wait_readyz(&gateway_http, "the gateway").await?.trim() == "ok");
    // A token the API server does not know: the gateway asked it (a TokenReview, which its
    // ServiceAccount may create) and answers 401, not an error of its own.
    let refused = gateway_http
        .request_text(
            http::Request::get("/v1/namespaces/default/runs/nothing/logs")
                .header("authorization", "Bearer not-a-token")
                .body(Vec::new())?,
        )
        .await;
    ensure!(
        matches!(&refused, Err(kube::Error::Api(status)) if status.code == 401),
        "an unknown token: {refused:?}"
    );

    let controller_account = dir.path().join("sa-controller-manager");
    service_account_files(
        &admin,
        "kruntimes-controller-manager",
        &ca_pem,
        &controller_account,
    )
    .await?;
    let command = in_cluster(
        &controller_account,
        &api,
        &[
            "controller-manager",
            "--provisioner",
            "local",
            "--data-dir",
            &data_arg,
            "--gateway-url",
            &gateway_url,
            "--health-addr",
            "127.0.0.1:0",
        ],
    )?;
    let (controller, said) = Component::spawn(
        "controller-manager",
        "kruntimes controller-manager ready",
        command,
        dir.path(),
    )?;
    let controller_http = http_client(&after(&said, "controller-manager health at ")?, None)?;
    create_runtime(&admin, "py", "python", 1, 2).await?;
    let mut spec = RunSpec::task("py", "main.py");
    spec.source = Some(RunSource {
        inline: Some("print(6 * 7)\n".to_string()),
        snapshot: None,
    });
    create(&admin, "answer", spec).await?;
    let run = wait_terminal(&admin, "answer").await?;
    let phase = run.status.as_ref().and_then(|s| s.phase);
    ensure!(
        phase == Some(Phase::Succeeded),
        "the task Run ended {run:?}"
    );
    let state = get(&controller_http, "/readyz").await?;
    ensure!(
        state.trim() == "ok: leading",
        "controller /readyz: {state:?}"
    );

    let workers = data.join("workers");
    for component in [controller, gateway, apiserver] {
        component.terminate()?;
    }
    let left = common::processes_with(&workers.display().to_string());
    ensure!(left.is_empty(), "worker processes left behind: {left:?}");
    Ok(())
}

/// A client of the gateway's port that trusts only `ca_pem`, speaking HTTP/1.1 by hand so
/// that one connection can be kept open across a rotation.
fn tls_client(ca_pem: &str) -> Result<tokio_rustls::TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut ca_pem.as_bytes()) {
        roots.add(cert.context("parse the CA")?)?;
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(std::sync::Arc::new(
        config,
    )))
}

type TlsConnection = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

async fn tls_connect(connector: &tokio_rustls::TlsConnector, addr: &str) -> Result<TlsConnection> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?.to_owned();
    Ok(connector.connect(name, tcp).await?)
}

/// The DER of the leaf certificate the server presented on `connection`.
fn presented(connection: &TlsConnection) -> Result<Vec<u8>> {
    Ok(connection
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.first())
        .context("no certificate presented")?
        .to_vec())
}

/// The DER of the first certificate of a PEM file.
fn der_of(pem: &str) -> Result<Vec<u8>> {
    Ok(rustls_pemfile::certs(&mut pem.as_bytes())
        .next()
        .context("no certificate")??
        .to_vec())
}

/// `GET /healthz` on an open keep-alive connection; its status line.
async fn healthz_on(connection: &mut TlsConnection) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    connection
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
        .await?;
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    // The answer is small: its head and the two-byte body `ok`.
    while !String::from_utf8_lossy(&answer).ends_with("ok") {
        let n = connection.read(&mut buf).await?;
        ensure!(
            n > 0,
            "the connection closed: {}",
            String::from_utf8_lossy(&answer)
        );
        answer.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&answer).into_owned();
    Ok(text.lines().next().unwrap_or_default().to_string())
}

/// Issue 17 item 4: `kruntimes gateway --tls-cert --tls-key` serves a certificate from
/// files (a mounted Secret) and picks up a rotation: connections made after it see the new
/// certificate, and a connection opened before it goes on serving. The CA given with
/// `--tls-ca` is what the controller-manager publishes.
#[tokio::test]
async fn the_gateway_serves_a_certificate_from_files_and_picks_up_its_rotation() -> Result<()> {
    use std::net::{IpAddr, Ipv4Addr};
    let dir = tempfile::tempdir()?;
    let Apiserver {
        component: apiserver,
        data,
        ..
    } = start_apiserver(dir.path()).await?;
    let data_arg = data.display().to_string();
    // The certificates of another CA than the data directory's, as cert-manager's would be.
    let issuer = dir.path().join("issuer");
    let localhost = IpAddr::V4(Ipv4Addr::LOCALHOST);
    kruntimes_apiserver::tls::prepare(&issuer, localhost)?;
    let issue = |name: &str| {
        kruntimes_apiserver::tls::issue_workload(&issuer, name, &[localhost], DEADLINE * 60)
    };
    let (first, second) = (issue("gateway-a")?, issue("gateway-b")?);
    let secret = dir.path().join("secret");
    std::fs::create_dir_all(&secret)?;
    let (cert, key, ca) = (
        secret.join("tls.crt"),
        secret.join("tls.key"),
        secret.join("ca.crt"),
    );
    std::fs::write(&cert, &first.cert_pem)?;
    std::fs::write(&key, &first.key_pem)?;
    std::fs::write(&ca, &first.ca_pem)?;
    let (cert_arg, key_arg, ca_arg) = (
        cert.display().to_string(),
        key.display().to_string(),
        ca.display().to_string(),
    );
    let components = data.join("components");
    let (gateway, said) = Component::start(
        "gateway",
        &[
            "gateway",
            "--addr",
            "127.0.0.1:0",
            "--data-dir",
            &data_arg,
            "--tls-cert",
            &cert_arg,
            "--tls-key",
            &key_arg,
            "--tls-ca",
            &ca_arg,
            "--tls-reload-interval",
            "100ms",
        ],
        Some(&components.join("gateway.kubeconfig")),
        dir.path(),
    )?;
    let url = after(&said, "gateway ready at ")?;
    let addr = url.strip_prefix("https://").context("an https URL")?;
    ensure!(std::fs::read_to_string(components.join("gateway-ca.crt"))? == first.ca_pem);
    let connector = tls_client(&first.ca_pem)?;
    let mut open = tls_connect(&connector, addr).await?;
    ensure!(presented(&open)? == der_of(&first.cert_pem)?);
    ensure!(healthz_on(&mut open).await?.contains("200"));

    // The rotation, as the kubelet updates a Secret volume: both files at once (renamed
    // into place).
    for (path, pem) in [(&cert, &second.cert_pem), (&key, &second.key_pem)] {
        let staged = path.with_extension("new");
        std::fs::write(&staged, pem)?;
        std::fs::rename(&staged, path)?;
    }
    let rotated = der_of(&second.cert_pem)?;
    within(
        DEADLINE,
        "a new connection sees the rotated certificate",
        async {
            loop {
                if presented(&tls_connect(&connector, addr).await?)? == rotated {
                    return Ok(());
                }
                // The gateway reads the files every 100 ms; the condition is the handshake.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        },
    )
    .await?;
    // The connection made before the rotation still serves.
    ensure!(healthz_on(&mut open).await?.contains("200"));
    ensure!(presented(&open)? == der_of(&first.cert_pem)?);
    drop(open);
    gateway.terminate()?;
    apiserver.terminate()?;
    Ok(())
}

/// Issue 17 item 4: `kruntimes gateway --worker-tls-cert --worker-tls-key --worker-tls-ca`
/// presents its client certificate towards workers from files (a mounted Secret), not one
/// of the data directory's CA: with a certificate of the workers' CA an invocation crosses
/// mutual TLS to the worker; a gateway given a certificate of another CA (and the workers'
/// CA to verify them with) is refused by the worker at the connection, so its invocations
/// fail with 503 and are known not to have reached the handler.
#[tokio::test]
async fn the_gateway_presents_its_worker_certificate_from_files() -> Result<()> {
    use std::net::{IpAddr, Ipv4Addr};
    let dir = tempfile::tempdir()?;
    let Apiserver {
        component: apiserver,
        admin,
        data,
        ..
    } = start_apiserver(dir.path()).await?;
    let data_arg = data.display().to_string();
    let components = data.join("components");
    // The workers' certificates come from the data directory's CA (the local
    // provisioner's); one gateway gets a certificate of that CA, the other one of a CA the
    // workers do not trust.
    let other_ca = dir.path().join("other-ca");
    kruntimes_apiserver::tls::prepare(&other_ca, IpAddr::V4(Ipv4Addr::LOCALHOST))?;
    let workers_ca = data.join("pki").join("ca.crt");
    ensure!(
        workers_ca.is_file(),
        "the workers' CA is {}",
        workers_ca.display()
    );
    let mut gateways = Vec::new();
    for (name, pki) in [("trusted", data.join("pki")), ("untrusted", other_ca)] {
        let files = kruntimes_apiserver::tls::issue_workload(
            &pki,
            "kruntimes-gateway",
            &[],
            DEADLINE * 60,
        )?
        .write(&dir.path().join(name))?;
        let (cert, key, ca) = (
            files.cert.display().to_string(),
            files.key.display().to_string(),
            workers_ca.display().to_string(),
        );
        let (gateway, said) = Component::start(
            "gateway",
            &[
                "gateway",
                "--addr",
                "127.0.0.1:0",
                "--data-dir",
                &data_arg,
                "--worker-tls-cert",
                &cert,
                "--worker-tls-key",
                &key,
                "--worker-tls-ca",
                &ca,
            ],
            Some(&components.join("gateway.kubeconfig")),
            dir.path(),
        )?;
        gateways.push((gateway, after(&said, "gateway ready at ")?));
    }
    let trusted_url = gateways[0].1.clone();
    let untrusted_authority = gateways[1]
        .1
        .strip_prefix("https://")
        .context("an https URL")?
        .to_string();
    let (controller, _) = start_local_controller(dir.path(), &data, &trusted_url)?;

    create_runtime(&admin, "python", "python", 1, 2).await?;
    let spec = common::python("def handle(event):\n    return {'double': event['n'] * 2}\n");
    create(&admin, "double", spec).await?;
    let run = common::wait_ready(&admin, "double").await?;
    let published = run
        .status
        .as_ref()
        .and_then(|s| s.endpoint.clone())
        .context("a Ready function publishes an endpoint")?;
    let token = kruntimes_testkit::admin_token(&data.join("kubeconfig"))?;
    let trusted = common::Endpoint::of(&published, &token)?;
    let answer = trusted
        .invoke_json("through-trusted", serde_json::json!({"n": 21}))
        .await?;
    ensure!(
        answer.status == 200 && answer.body["result"]["double"] == 42,
        "through the gateway with the workers' CA: {} {}",
        answer.status,
        answer.body
    );

    let mut elsewhere = published.clone();
    let trusted_authority = trusted_url
        .strip_prefix("https://")
        .context("an https URL")?;
    elsewhere.url = elsewhere
        .url
        .replacen(trusted_authority, &untrusted_authority, 1);
    let untrusted = common::Endpoint::of(&elsewhere, &token)?;
    let answer = untrusted
        .invoke_json("through-untrusted", serde_json::json!({"n": 1}))
        .await?;
    // Refused at the connection by the worker's TLS alert, so the gateway knows that
    // nothing was sent: 503, never a 504 that cannot tell whether the handler ran.
    ensure!(
        answer.status == 503
            && answer.body["message"]
                .as_str()
                .is_some_and(|m| m.contains("alert")),
        "a gateway with a certificate of another CA reached the worker: {} {}",
        answer.status,
        answer.body
    );

    for component in [
        controller,
        gateways.remove(1).0,
        gateways.remove(0).0,
        apiserver,
    ] {
        component.terminate()?;
    }
    Ok(())
}

/// Issue 17 item 4: runtimed given a certificate that is not issued for its worker identity
/// (`POD.NAMESPACE.kruntimes-worker`) fails at start and says why, before it reaches the
/// network, instead of serving one that every peer would refuse at the handshake.
#[test]
fn runtimed_refuses_a_certificate_issued_for_another_identity() -> Result<()> {
    use std::net::{IpAddr, Ipv4Addr};
    let dir = tempfile::tempdir()?;
    let pki = dir.path().join("pki");
    kruntimes_apiserver::tls::prepare(&pki, IpAddr::V4(Ipv4Addr::LOCALHOST))?;
    let other = "w-other.default.kruntimes-worker";
    let files = kruntimes_apiserver::tls::issue_workload(&pki, other, &[], DEADLINE * 60)?
        .write(&dir.path().join("theirs"))?;
    let (refused, stderr) = runtimed_start(
        dir.path(),
        "default",
        "w-mine",
        [files.cert.clone(), files.key.clone(), files.ca.clone()],
    )?;
    ensure!(refused, "it started: {stderr}");
    ensure!(
        stderr.contains("w-mine.default.kruntimes-worker")
            && stderr.contains(&files.cert.display().to_string())
            && stderr.contains("not issued for"),
        "{stderr}"
    );
    Ok(())
}
