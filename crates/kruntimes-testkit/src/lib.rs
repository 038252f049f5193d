//! Test support: starts the real `kruntimes up` binary on an ephemeral port in a temporary
//! directory, hands back a kube client and a `kubectl` command, and tears everything down,
//! processes included, on drop.
//!
//! The binary is found through `KRUNTIMES_BIN`, or next to the test executable's
//! `target/<profile>/` folder. Build it first (`cargo build -p kruntimes`); the project's
//! test script does.

pub mod s3;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

/// The line `kruntimes up` prints once the API server answers.
pub const READY_PREFIX: &str = "apiserver ready at ";
/// The line `kruntimes up` prints once the gateway serves.
pub const GATEWAY_PREFIX: &str = "gateway ready at ";
/// The line `kruntimes up` prints once the controller-manager's metrics are served.
pub const CONTROLLER_METRICS_PREFIX: &str = "controller-manager metrics at ";
/// The line `kruntimes up` prints once every component runs and the default Runtimes'
/// workers are ready.
pub const SYSTEM_READY: &str = "kruntimes ready";

/// How long a start may take before the test fails.
const START_DEADLINE: Duration = Duration::from_secs(60);

/// Options for [`Server::start_with`].
#[derive(Debug, Default, Clone)]
pub struct Options {
    /// Reuse this data directory (for restart tests) instead of a fresh temporary one.
    pub data_dir: Option<PathBuf>,
    /// Extra arguments for `kruntimes up`, e.g. `["--watch-history", "16"]`.
    pub extra_args: Vec<String>,
    /// The whole system (controller-manager, workers, gateway, default Runtimes) instead of
    /// the API server alone (`--apiserver-only`).
    pub full: bool,
    /// `RUST_LOG` of the server and its workers; default `$RUST_LOG`, else `warn`.
    pub log_filter: Option<String>,
    /// Extra environment variables of `kruntimes up` (on top of the test's own).
    pub env: Vec<(String, String)>,
}

impl Options {
    /// The whole system in a fresh temporary data directory.
    pub fn full() -> Options {
        Options {
            full: true,
            ..Options::default()
        }
    }
}

/// A running `kruntimes up`.
pub struct Server {
    child: Option<Child>,
    data_dir: PathBuf,
    url: String,
    gateway_url: Option<String>,
    controller_metrics_url: Option<String>,
    _tmp: Option<tempfile::TempDir>,
    home: tempfile::TempDir,
    stdout_rest: Option<std::thread::JoinHandle<()>>,
}

/// The path of the `kruntimes` binary under test.
pub fn kruntimes_bin() -> Result<PathBuf> {
    find_bin("kruntimes", "KRUNTIMES_BIN")
}

/// The path of the `krt` binary under test.
pub fn krt_bin() -> Result<PathBuf> {
    find_bin("krt", "KRT_BIN")
}

fn find_bin(name: &str, env: &str) -> Result<PathBuf> {
    if let Some(path) = std::env::var_os(env) {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe().context("current_exe")?;
    // target/<profile>/deps/<test> or target/<profile>/<bin>
    let mut dir = exe.parent().map(Path::to_path_buf);
    while let Some(d) = dir {
        let candidate = d.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
        dir = d.parent().map(Path::to_path_buf);
        if d.file_name().is_some_and(|n| n == "target") {
            break;
        }
    }
    bail!(
        "{name} binary not found next to {}; run `cargo build --workspace --bins` or set {env}",
        exe.display()
    )
}

impl Server {
    /// Starts `kruntimes up` in a fresh temporary data directory on `127.0.0.1:0`.
    pub fn start() -> Result<Server> {
        Server::start_with(Options::default())
    }

    /// Starts `kruntimes up` with options. Blocks until the server prints that it is ready,
    /// or fails after a deadline with what the server printed.
    pub fn start_with(options: Options) -> Result<Server> {
        let (tmp, data_dir) = match options.data_dir {
            Some(dir) => (None, dir),
            None => {
                let tmp = tempfile::Builder::new()
                    .prefix("kruntimes-test")
                    .tempdir()?;
                let dir = tmp.path().join("data");
                (Some(tmp), dir)
            }
        };
        let home = tempfile::Builder::new()
            .prefix("kruntimes-home")
            .tempdir()?;
        let mut cmd = Command::new(kruntimes_bin()?);
        cmd.arg("up")
            .arg("--data-dir")
            .arg(&data_dir)
            .arg("--apiserver-addr")
            .arg("127.0.0.1:0")
            .args(if options.full {
                ["--gateway-addr", "127.0.0.1:0"].as_slice()
            } else {
                ["--apiserver-only"].as_slice()
            })
            .args(&options.extra_args)
            .envs(options.env.iter().map(|(k, v)| (k, v)))
            .env(
                "RUST_LOG",
                options
                    .log_filter
                    .clone()
                    .or_else(|| std::env::var("RUST_LOG").ok())
                    .unwrap_or_else(|| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0);
        let mut child = cmd.spawn().context("spawn kruntimes up")?;
        let stdout = child.stdout.take().context("stdout is piped")?;
        let (tx, rx) = mpsc::channel::<String>();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    // Keep draining so the server never blocks on a full pipe.
                    continue;
                }
            }
        });
        let mut server = Server {
            child: Some(child),
            data_dir,
            url: String::new(),
            gateway_url: None,
            controller_metrics_url: None,
            _tmp: tmp,
            home,
            stdout_rest: Some(reader),
        };
        let deadline = std::time::Instant::now() + START_DEADLINE;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(url) = line.strip_prefix(READY_PREFIX) {
                        server.url = url.trim().to_string();
                        if !options.full {
                            return Ok(server);
                        }
                    } else if let Some(url) = line.strip_prefix(GATEWAY_PREFIX) {
                        server.gateway_url = Some(url.trim().to_string());
                    } else if let Some(url) = line.strip_prefix(CONTROLLER_METRICS_PREFIX) {
                        server.controller_metrics_url = Some(url.trim().to_string());
                    } else if line.trim() == SYSTEM_READY {
                        return Ok(server);
                    }
                    seen.push(line);
                }
                Err(_) => {
                    let status = server
                        .child
                        .as_mut()
                        .and_then(|c| c.try_wait().ok().flatten());
                    bail!(
                        "kruntimes up did not become ready (exit: {status:?}); it printed:\n{}",
                        seen.join("\n")
                    );
                }
            }
        }
    }

    /// [`Server::start_with`] off the async worker threads, plus an admin client: the start
    /// of most async tests.
    pub async fn start_async(options: Options) -> Result<(Server, kube::Client)> {
        let server = tokio::task::spawn_blocking(move || Server::start_with(options))
            .await
            .context("join the server start")??;
        let client = server.client().await?;
        Ok((server, client))
    }

    /// `https://127.0.0.1:PORT`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The gateway's `https://127.0.0.1:PORT`, when the whole system runs.
    pub fn gateway_url(&self) -> Option<&str> {
        self.gateway_url.as_deref()
    }

    /// The controller-manager's `http://127.0.0.1:PORT/metrics`, when the whole system runs.
    pub fn controller_metrics_url(&self) -> Option<&str> {
        self.controller_metrics_url.as_deref()
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    pub fn kubeconfig_path(&self) -> PathBuf {
        self.data_dir.join("kubeconfig")
    }

    /// The OS process ID of the server.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// A kube client from the server's kubeconfig (admin token, the server's CA).
    pub async fn client(&self) -> Result<kube::Client> {
        let text = std::fs::read_to_string(self.kubeconfig_path())?;
        let kubeconfig = kube::config::Kubeconfig::from_yaml(&text)?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
        Ok(kube::Client::try_from(config)?)
    }

    /// The real `/usr/bin/kubectl` (or `KUBECTL`), pointed at this server, with its own
    /// HOME so discovery caches never cross between tests.
    pub fn kubectl(&self) -> Command {
        let bin = std::env::var("KUBECTL").unwrap_or_else(|_| "/usr/bin/kubectl".into());
        let mut cmd = Command::new(bin);
        cmd.env("KUBECONFIG", self.kubeconfig_path())
            .env("HOME", self.home.path())
            .stdin(Stdio::null());
        cmd
    }

    /// The `krt` CLI, pointed at this server as the admin.
    pub fn krt(&self) -> Result<Command> {
        let mut cmd = Command::new(krt_bin()?);
        cmd.env("KUBECONFIG", self.kubeconfig_path())
            .env("HOME", self.home.path())
            .stdin(Stdio::null());
        Ok(cmd)
    }

    /// The kubeconfig `kruntimes up` wrote for a component (`controller-manager`,
    /// `runtimed`, `gateway`).
    pub fn component_kubeconfig(&self, component: &str) -> PathBuf {
        self.data_dir
            .join("components")
            .join(format!("{component}.kubeconfig"))
    }

    /// Runs kubectl with `args` and returns its stdout, failing with its stderr when it
    /// exits non-zero.
    pub fn kubectl_ok(&self, args: &[&str]) -> Result<String> {
        let out = self.kubectl().args(args).output()?;
        if !out.status.success() {
            return Err(anyhow!(
                "kubectl {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Kills the server with SIGKILL, as a crash would, and waits for it.
    pub fn kill(&mut self) -> Result<()> {
        self.signal_and_wait(Signal::SIGKILL)
    }

    /// Asks the server to stop with SIGTERM and waits for a clean exit.
    pub fn stop(&mut self) -> Result<std::process::ExitStatus> {
        let Some(mut child) = self.child.take() else {
            bail!("server already stopped");
        };
        killpg(Pid::from_raw(child.id() as i32), Signal::SIGTERM)?;
        let status = child.wait()?;
        self.join_reader();
        Ok(status)
    }

    fn signal_and_wait(&mut self, signal: Signal) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            // The server runs in its own process group; signal all of it.
            let _ = killpg(Pid::from_raw(child.id() as i32), signal);
            child.wait()?;
        }
        self.join_reader();
        Ok(())
    }

    fn join_reader(&mut self) {
        if let Some(handle) = self.stdout_rest.take() {
            let _ = handle.join();
        }
    }
}

/// SIGKILLs every process whose command line names `dir`; says on stderr which.
///
/// gVisor sandboxes run in sessions of their own, so a signal to the server's process
/// group misses them. One whose init already runs ends when its runtime server's lifeline
/// closes; one whose `runsc run` was killed with the group before it started the init waits
/// for ever (the next `kruntimes up` of the same data directory would kill it). A test
/// leaves no process behind, so these go here.
fn kill_escaped(dir: &Path) {
    let needle = dir.as_os_str().as_encoded_bytes();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let named = std::fs::read(entry.path().join("cmdline"))
            .is_ok_and(|cmdline| cmdline.windows(needle.len()).any(|w| w == needle));
        if named && pid != std::process::id() as i32 {
            let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            eprintln!(
                "killing {} ({pid}), left running by the server of {}",
                comm.trim(),
                dir.display()
            );
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.signal_and_wait(Signal::SIGKILL);
        kill_escaped(&self.data_dir);
        // For debugging a failure: KRUNTIMES_KEEP_TEST_DATA=1 keeps the data directory
        // (worker logs are under workers/).
        if std::env::var_os("KRUNTIMES_KEEP_TEST_DATA").is_some()
            && let Some(tmp) = self._tmp.take()
        {
            eprintln!("kept test data in {}", tmp.keep().display());
        }
    }
}

/// Reads the kubeconfig's bearer token (for tests that speak raw HTTP).
pub fn admin_token(kubeconfig: &Path) -> Result<String> {
    let text = std::fs::read_to_string(kubeconfig)?;
    let value: serde_yaml::Value = serde_yaml::from_str(&text)?;
    value["users"][0]["user"]["token"]
        .as_str()
        .map(str::to_string)
        .context("kubeconfig has no token")
}

/// Setup helpers that act as the admin through kube-rs.
pub mod setup {
    use anyhow::{Context, Result};
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
    use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
    use kube::api::{Api, ObjectMeta, PostParams};

    fn named(name: &str) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.to_string()),
            ..ObjectMeta::default()
        }
    }

    /// Creates a namespace.
    pub async fn namespace(admin: &kube::Client, name: &str) -> Result<()> {
        let ns = Namespace {
            metadata: named(name),
            ..Namespace::default()
        };
        Api::<Namespace>::all(admin.clone())
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("create namespace {name}"))?;
        Ok(())
    }

    /// A rule that allows `verbs` on `resources` of the kruntimes.io group.
    pub fn kruntimes_rule(verbs: &[&str], resources: &[&str]) -> PolicyRule {
        PolicyRule {
            api_groups: Some(vec!["kruntimes.io".to_string()]),
            resources: Some(resources.iter().map(|r| r.to_string()).collect()),
            verbs: verbs.iter().map(|v| v.to_string()).collect(),
            ..PolicyRule::default()
        }
    }

    /// Creates ServiceAccount `account` in `namespace` (which must exist), a Role named
    /// `<account>-role` with `rules` bound to it, and returns a token of the account valid
    /// for `seconds`.
    pub async fn service_account_token(
        admin: &kube::Client,
        namespace: &str,
        account: &str,
        rules: Vec<PolicyRule>,
        seconds: i64,
    ) -> Result<String> {
        let pp = PostParams::default();
        let role = format!("{account}-role");
        let accounts = Api::<ServiceAccount>::namespaced(admin.clone(), namespace);
        let sa = ServiceAccount {
            metadata: named(account),
            ..ServiceAccount::default()
        };
        accounts
            .create(&pp, &sa)
            .await
            .context("create the ServiceAccount")?;
        let role_object = Role {
            metadata: named(&role),
            rules: Some(rules),
        };
        Api::<Role>::namespaced(admin.clone(), namespace)
            .create(&pp, &role_object)
            .await
            .context("create the Role")?;
        let binding = RoleBinding {
            metadata: named(&role),
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".to_string(),
                kind: "Role".to_string(),
                name: role.clone(),
            },
            subjects: Some(vec![Subject {
                kind: "ServiceAccount".to_string(),
                name: account.to_string(),
                namespace: Some(namespace.to_string()),
                ..Subject::default()
            }]),
        };
        Api::<RoleBinding>::namespaced(admin.clone(), namespace)
            .create(&pp, &binding)
            .await
            .context("create the RoleBinding")?;
        let request = TokenRequest {
            spec: TokenRequestSpec {
                expiration_seconds: Some(seconds),
                ..TokenRequestSpec::default()
            },
            ..TokenRequest::default()
        };
        accounts
            .create_token_request(account, &pp, &request)
            .await
            .context("create a ServiceAccount token (TokenRequest)")?
            .status
            .map(|s| s.token)
            .filter(|t| !t.is_empty())
            .context("the TokenRequest answer has no token")
    }
}

/// Assertions on Kubernetes `Status` errors, shared by the end-to-end tests.
pub mod status {
    use anyhow::{Result, bail, ensure};
    use kube::core::Status;

    /// Expects a request to fail with a Kubernetes `Status`, and returns that status.
    pub fn expect_status<T: std::fmt::Debug>(
        what: &str,
        result: kube::Result<T>,
    ) -> Result<Status> {
        match result {
            Err(kube::Error::Api(status)) => Ok(*status),
            Err(other) => {
                bail!("{what}: expected an API error Status, got a client error: {other:#}")
            }
            Ok(value) => bail!("{what}: expected an API error Status, got success: {value:?}"),
        }
    }

    /// Checks a Status' code and reason.
    pub fn ensure_status(what: &str, status: &Status, code: u16, reason: &str) -> Result<()> {
        ensure!(
            status.code == code && status.reason == reason,
            "{what}: expected {code} {reason}, got {} {} ({:?})",
            status.code,
            status.reason,
            status.message
        );
        Ok(())
    }
}

/// Kubernetes Events as a test reads them back.
pub mod events {
    use std::time::Duration;

    use anyhow::{Result, bail};
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::Event;
    use kube::api::Api;
    use kube::runtime::{WatchStreamExt, watcher};

    /// Waits up to `deadline` for a core v1 Event with `reason` on the object `name` in
    /// `namespace`, found as `kubectl get events --field-selector involvedObject.name=NAME`
    /// finds it, and returns it. Events are written in the background, so a test watches
    /// for them rather than reading once.
    pub async fn wait_for(
        client: &kube::Client,
        namespace: &str,
        name: &str,
        reason: &str,
        deadline: Duration,
    ) -> Result<Event> {
        let api = Api::<Event>::namespaced(client.clone(), namespace);
        let config = watcher::Config::default().fields(&format!("involvedObject.name={name}"));
        let mut stream = watcher(api, config).applied_objects().boxed();
        let what = format!("an Event {reason} on {namespace}/{name}");
        super::within(deadline, &what, async {
            while let Some(event) = stream.next().await {
                let event = event?;
                if event.reason.as_deref() == Some(reason) {
                    return Ok(event);
                }
            }
            bail!("the Event watch ended")
        })
        .await
    }
}

/// The text of a Secret's key (`data`, decoded).
pub fn secret_text(secret: &k8s_openapi::api::core::v1::Secret, key: &str) -> Result<String> {
    let bytes = secret
        .data
        .as_ref()
        .and_then(|data| data.get(key))
        .with_context(|| format!("Secret {:?} has no {key}", secret.metadata.name))?;
    Ok(String::from_utf8(bytes.0.clone())?)
}

/// Runs a test body under a deadline, failing with `what` when it is exceeded.
pub async fn within<T>(
    deadline: Duration,
    what: &str,
    body: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(deadline, body)
        .await
        .map_err(|_| anyhow!("{what}: did not finish within {deadline:?}"))?
}

/// Waits up to `deadline` until the object `name` of `api` with UID `uid` is deleted (gone,
/// or replaced by another object of that name).
pub async fn deleted<K>(api: &kube::Api<K>, name: &str, uid: &str, deadline: Duration) -> Result<()>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
{
    within(deadline, &format!("{name} is deleted"), async {
        kube::runtime::wait::await_condition(
            api.clone(),
            name,
            kube::runtime::wait::conditions::is_deleted(uid),
        )
        .await?;
        Ok(())
    })
    .await
}

/// The host directory of a Run's workspace on a local worker of `server`,
/// `workers/<pod>/root/<under>/<attempt>/work` (`under` is the Run UID for a task,
/// `functions/<uid>` for a function), waiting up to `deadline` until its worker made it. A
/// sandboxed program sees no other host directory, so files a test hands to it (gates,
/// FIFOs) go here.
pub async fn run_workspace(server: &Server, under: &str, deadline: Duration) -> Result<PathBuf> {
    let workers = server.data_dir().join("workers");
    within(deadline, "the Run's workspace exists", async {
        loop {
            let found = std::fs::read_dir(&workers)
                .into_iter()
                .flatten()
                .flatten()
                .flat_map(|w| std::fs::read_dir(w.path().join("root").join(under)))
                .flatten()
                .flatten()
                .map(|attempt| attempt.path().join("work"))
                .find(|work| work.is_dir());
            if let Some(work) = found {
                return Ok(work);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
}

/// The process table, for tests that check that nothing of theirs is left running.
pub mod procs {
    use std::path::PathBuf;

    /// One live (not zombie) process as `/proc` shows it.
    #[derive(Debug, Clone)]
    pub struct Proc {
        pub pid: i32,
        /// The command line, arguments joined by single spaces.
        pub cmdline: String,
        /// The working directory, when readable.
        pub cwd: Option<PathBuf>,
        /// The environment, `NAME=VALUE` entries.
        pub environ: Vec<String>,
    }

    /// Every live process that `keep` accepts. Processes come and go while the table is
    /// read; one that vanishes meanwhile is simply not listed. Zombies (exited, not yet
    /// reaped) are not live.
    pub fn matching(keep: impl Fn(&Proc) -> bool) -> Vec<Proc> {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        let mut found = Vec::new();
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<i32>().ok())
            else {
                continue;
            };
            let dir = entry.path();
            let Ok(cmdline) = std::fs::read(dir.join("cmdline")) else {
                continue;
            };
            let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
            let zombie = stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
            if zombie {
                continue;
            }
            let environ = std::fs::read(dir.join("environ")).unwrap_or_default();
            let proc = Proc {
                pid,
                cmdline: String::from_utf8_lossy(&cmdline)
                    .trim_end_matches('\0')
                    .replace('\0', " "),
                cwd: std::fs::read_link(dir.join("cwd")).ok(),
                environ: environ
                    .split(|b| *b == 0)
                    .filter(|v| !v.is_empty())
                    .map(|v| String::from_utf8_lossy(v).into_owned())
                    .collect(),
            };
            if keep(&proc) {
                found.push(proc);
            }
        }
        found
    }

    /// Live processes whose command line or working directory contains `needle`.
    pub fn mentioning(needle: &str) -> Vec<Proc> {
        matching(|p| {
            p.cmdline.contains(needle)
                || p.cwd
                    .as_ref()
                    .is_some_and(|cwd| cwd.to_string_lossy().contains(needle))
        })
    }
}
