//! The test server shared by the runtime server's integration tests: the real binary on a
//! real Unix socket in a temporary directory, killed (SIGTERM, so it cleans up) on drop.
// Each test binary uses part of this module.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kruntimes_proto::runtime::v1 as pb;
use pb::function_runtime_client::FunctionRuntimeClient;
use pb::runtime_info_client::RuntimeInfoClient;
use pb::session_runtime_client::SessionRuntimeClient;
use pb::task_runtime_client::TaskRuntimeClient;
use tonic::transport::Channel;

pub const DEADLINE: Duration = Duration::from_secs(30);

/// A running server; killed and its directories removed on drop.
pub struct TestServer {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub tasks: TaskRuntimeClient<Channel>,
    pub info: RuntimeInfoClient<Channel>,
    pub functions: FunctionRuntimeClient<Channel>,
    pub sessions: SessionRuntimeClient<Channel>,
    /// The extra arguments it was started with (a restart uses them again).
    pub extra: Vec<String>,
}

impl TestServer {
    pub async fn start(adapter: &str) -> Self {
        Self::start_in(tempfile::tempdir().unwrap(), adapter).await
    }

    /// Starts a server with the `process` backend, for tests that follow processes by
    /// the pids they print or meet them through host paths (FIFOs in a temporary
    /// directory): inside a `namespaces` sandbox neither is visible.
    pub async fn start_process(adapter: &str) -> Self {
        Self::start_with(
            tempfile::tempdir().unwrap(),
            adapter,
            &["--sandbox", "process"],
        )
        .await
    }

    /// Starts a server whose socket and root are in `dir` (reused after a restart).
    pub async fn start_in(dir: tempfile::TempDir, adapter: &str) -> Self {
        Self::start_with(dir, adapter, &[]).await
    }

    /// Starts a server in `dir` with extra command-line arguments.
    pub async fn start_with(dir: tempfile::TempDir, adapter: &str, extra: &[&str]) -> Self {
        let socket = dir.path().join("rs.sock");
        let root = dir.path().join("root");
        let mut child = Command::new(env!("CARGO_BIN_EXE_kruntimes-runtime-server"))
            .arg("--socket")
            .arg(&socket)
            .arg("--root")
            .arg(&root)
            .arg("--adapter")
            .arg(adapter)
            .arg("--grace")
            .arg("300ms")
            .args(extra)
            .env(
                "RUST_LOG",
                std::env::var("TEST_RS_LOG").unwrap_or("warn".into()),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        // The server prints one line once its socket accepts connections.
        let stdout = child.stdout.take().unwrap();
        let line = tokio::time::timeout(
            DEADLINE,
            tokio::task::spawn_blocking(move || {
                let mut line = String::new();
                BufReader::new(stdout).read_line(&mut line).unwrap();
                line
            }),
        )
        .await
        .unwrap()
        .unwrap();
        assert!(line.starts_with("listening on "), "server said {line:?}");
        let channel = kruntimes_proto::unix::connect(&socket).await.unwrap();
        Self {
            extra: extra.iter().map(|a| (*a).to_owned()).collect(),
            child,
            dir,
            tasks: TaskRuntimeClient::new(channel.clone()),
            functions: FunctionRuntimeClient::new(channel.clone()),
            sessions: SessionRuntimeClient::new(channel.clone()),
            info: RuntimeInfoClient::new(channel),
        }
    }

    /// Kills the server without letting it clean up (its executions and interpreters keep
    /// running) and starts a new one on the same socket and root.
    pub async fn crash_and_restart(mut self, adapter: &str) -> Self {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap());
        let extra = std::mem::take(&mut self.extra);
        drop(self);
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        Self::start_with(dir, adapter, &extra).await
    }

    /// The capabilities when executions get cgroups; `None`, saying that the test is
    /// skipped, where this machine gives none.
    pub async fn capabilities_with_cgroups(&self) -> Option<pb::CapabilitiesResponse> {
        let caps = self.capabilities().await;
        if !matches!(
            caps.isolation(),
            pb::Isolation::ProcessGroupAndCgroup | pb::Isolation::Namespaces
        ) {
            eprintln!("skipped: no cgroups here ({})", caps.isolation_detail);
            return None;
        }
        Some(caps)
    }

    pub fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    pub fn exec_dir(&self, id: &pb::ExecutionId) -> PathBuf {
        self.root().join(&id.run_uid).join(id.attempt.to_string())
    }

    pub async fn capabilities(&self) -> pb::CapabilitiesResponse {
        self.info
            .clone()
            .capabilities(pb::CapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner()
    }

    pub async fn execute(
        &self,
        request: pb::ExecuteRequest,
    ) -> Result<pb::ExecutionStatus, tonic::Status> {
        self.tasks
            .clone()
            .execute(request)
            .await
            .map(|r| r.into_inner())
    }

    pub async fn wait(&self, id: &pb::ExecutionId) -> pb::ExecutionStatus {
        let status = self
            .tasks
            .clone()
            .wait(pb::WaitRequest {
                id: Some(id.clone()),
                timeout: Some(DEADLINE.try_into().unwrap()),
                include_log_tails: true,
            })
            .await
            .unwrap()
            .into_inner();
        assert_ne!(
            status.state(),
            pb::ExecutionState::Running,
            "execution did not finish within {DEADLINE:?}"
        );
        status
    }

    pub async fn run(&self, request: pb::ExecuteRequest) -> pb::ExecutionStatus {
        let id = request.id.clone().unwrap();
        self.execute(request).await.unwrap();
        self.wait(&id).await
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        // Close this process's connections first, so the server's graceful shutdown
        // does not wait for them.
        self.tasks =
            TaskRuntimeClient::new(Channel::from_static("http://closed.invalid").connect_lazy());
        self.info =
            RuntimeInfoClient::new(Channel::from_static("http://closed.invalid").connect_lazy());
        self.functions = FunctionRuntimeClient::new(
            Channel::from_static("http://closed.invalid").connect_lazy(),
        );
        self.sessions =
            SessionRuntimeClient::new(Channel::from_static("http://closed.invalid").connect_lazy());
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
    }
}

/// A fresh Run identity, attempt 1.
pub fn new_id() -> pb::ExecutionId {
    pb::ExecutionId {
        run_uid: uuid::Uuid::new_v4().to_string(),
        attempt: 1,
    }
}
