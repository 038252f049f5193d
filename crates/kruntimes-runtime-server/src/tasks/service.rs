//! The gRPC services `RuntimeInfo` and `TaskRuntime` over the executor (`FunctionRuntime`
//! is in [`crate::functions::service`]).
//!
//! Owns the translation between protobuf messages and executor types, and the one place
//! where executor errors become gRPC status codes: a caller's mistake is echoed with a
//! precise message, an internal failure is logged with its whole chain and answered with
//! a generic INTERNAL. It holds no execution state of its own. The translations that
//! `FunctionRuntime` shares with these services (source files, environment, identities, log
//! tails, internal errors) are here as well.
#![forbid(unsafe_code)]

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use kruntimes_proto::runtime::v1 as pb;
use pb::runtime_info_server::RuntimeInfo;
use pb::task_runtime_server::TaskRuntime;
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::ids::{ExecutionKey, IdError};
use crate::logs;
use crate::tasks::executor::{
    ExecuteSpec, Executor, ExecutorError, Snapshot, SourceFileSpec, State,
};

/// Wait never blocks longer than this.
pub const MAX_WAIT: Duration = Duration::from_secs(3600);
/// How long Forget waits for a running execution to die after SIGKILL.
const FORGET_LIMIT: Duration = Duration::from_secs(10);
/// How often a following Logs stream looks for new bytes while the program runs.
const FOLLOW_POLL: Duration = Duration::from_millis(25);

/// What the Capabilities call reports beyond the executor's configuration.
#[derive(Debug, Clone)]
pub struct Isolation {
    /// `None` when cgroups are used; otherwise why not.
    pub cgroup_unavailable: Option<String>,
    /// What the `namespaces` or `gvisor` backend enforces; `None` with the `process`
    /// backend.
    pub sandbox: Option<String>,
    /// Which of the two.
    pub gvisor: bool,
}

/// Implements both services over one executor.
#[derive(Clone)]
pub struct Services {
    executor: Arc<Executor>,
    isolation: Isolation,
}

impl Services {
    pub fn new(executor: Arc<Executor>, isolation: Isolation) -> Self {
        Self {
            executor,
            isolation,
        }
    }
}

impl From<ExecutorError> for Status {
    fn from(e: ExecutorError) -> Self {
        match &e {
            ExecutorError::Request(_) => Status::invalid_argument(e.to_string()),
            ExecutorError::Conflict { .. } => Status::already_exists(e.to_string()),
            ExecutorError::NotFound { .. } | ExecutorError::LogsRemoved { .. } => {
                Status::not_found(e.to_string())
            }
            ExecutorError::ShuttingDown => Status::unavailable(e.to_string()),
            ExecutorError::StillRunning { .. } => Status::unavailable(e.to_string()),
            ExecutorError::Workspace { .. }
            | ExecutorError::Cgroup { .. }
            | ExecutorError::Remove { .. } => internal(&e, "internal error"),
        }
    }
}

/// An internal failure: logged (as `what`) with its whole chain, answered with a generic
/// INTERNAL that names nothing of the server's inside.
pub(crate) fn internal(e: &dyn std::error::Error, what: &str) -> Status {
    tracing::error!(error = %chain(e), "{what}");
    Status::internal("internal error in the runtime server; see its log")
}

pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

pub(crate) fn key(id: Option<pb::ExecutionId>) -> Result<ExecutionKey, Status> {
    let id = id.ok_or_else(|| Status::invalid_argument("id is required"))?;
    ExecutionKey::new(&id.run_uid, id.attempt)
        .map_err(|e: IdError| Status::invalid_argument(e.to_string()))
}

pub(crate) fn duration(
    d: Option<prost_types::Duration>,
    field: &str,
) -> Result<Option<Duration>, Status> {
    d.map(|d| {
        Duration::try_from(d).map_err(|_| {
            Status::invalid_argument(format!("{field} must be a non-negative duration"))
        })
    })
    .transpose()
}

/// The source files of a request, as the executor and the function table take them.
pub(crate) fn source_files(files: Vec<pb::SourceFile>) -> Vec<SourceFileSpec> {
    files
        .into_iter()
        .map(|f| SourceFileSpec {
            path: f.path,
            content: f.content,
            executable: f.executable,
        })
        .collect()
}

/// The environment of a request as name-value pairs.
pub(crate) fn env_pairs(env: Vec<pb::EnvVar>) -> Vec<(String, String)> {
    env.into_iter().map(|e| (e.name, e.value)).collect()
}

pub(crate) fn execution_id(key: &ExecutionKey) -> pb::ExecutionId {
    pb::ExecutionId {
        run_uid: key.run_uid().to_owned(),
        attempt: key.attempt(),
    }
}

pub(crate) fn log_tail(tail: logs::Tail) -> pb::LogTail {
    pb::LogTail {
        data: tail.data,
        truncated: tail.truncated,
        total_bytes: tail.total_bytes,
    }
}

fn state(state: State) -> pb::ExecutionState {
    match state {
        State::Running => pb::ExecutionState::Running,
        State::Succeeded => pb::ExecutionState::Succeeded,
        State::Failed => pb::ExecutionState::Failed,
        State::TimedOut => pb::ExecutionState::TimedOut,
        State::Cancelled => pb::ExecutionState::Cancelled,
    }
}

fn tail(path: &std::path::Path) -> Result<pb::LogTail, Status> {
    let tail = logs::read_tail(path).map_err(|e| internal(&e, "log tail"))?;
    Ok(log_tail(tail))
}

impl Services {
    fn to_proto(&self, s: Snapshot, tails: bool) -> Result<pb::ExecutionStatus, Status> {
        let (stdout_tail, stderr_tail) = if tails {
            let (out, err) = self.executor.log_paths(&s.key)?;
            (Some(tail(&out)?), Some(tail(&err)?))
        } else {
            (None, None)
        };
        let mut status = pb::ExecutionStatus {
            id: Some(execution_id(&s.key)),
            state: 0,
            reason: if s.state == State::Running && s.termination_requested {
                "Terminating".to_owned()
            } else {
                s.reason.to_owned()
            },
            message: s.message,
            retryable: s.retryable,
            exit_code: s.exit_code,
            signal: s.signal,
            outputs: s.outputs.into_iter().collect(),
            start_time: Some(s.start_time.into()),
            finish_time: s.finish_time.map(Into::into),
            termination_requested: s.termination_requested,
            stdout_tail,
            stderr_tail,
        };
        status.set_state(state(s.state));
        Ok(status)
    }
}

#[tonic::async_trait]
impl RuntimeInfo for Services {
    async fn capabilities(
        &self,
        _request: Request<pb::CapabilitiesRequest>,
    ) -> Result<Response<pb::CapabilitiesResponse>, Status> {
        let config = self.executor.config();
        let mut response = pb::CapabilitiesResponse {
            services: vec![
                pb::RUNTIME_INFO_SERVICE.to_owned(),
                pb::TASK_RUNTIME_SERVICE.to_owned(),
                pb::FUNCTION_RUNTIME_SERVICE.to_owned(),
                pb::SESSION_RUNTIME_SERVICE.to_owned(),
            ],
            adapter: config.adapter.name().to_owned(),
            interpreter: config.interpreter.display().to_string(),
            isolation: 0,
            isolation_detail: self
                .isolation
                .sandbox
                .clone()
                .or_else(|| self.isolation.cgroup_unavailable.clone())
                .unwrap_or_default(),
            cgroup_parent: config
                .cgroups
                .as_ref()
                .map(|c| c.path().display().to_string())
                .unwrap_or_default(),
            default_grace_period: prost_types::Duration::try_from(config.default_grace).ok(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            ready: self.executor.accepting(),
            log_tail_limit_bytes: logs::TAIL_LIMIT_BYTES,
        };
        response.set_isolation(if self.isolation.gvisor {
            pb::Isolation::Gvisor
        } else if self.isolation.sandbox.is_some() {
            pb::Isolation::Namespaces
        } else if config.cgroups.is_some() {
            pb::Isolation::ProcessGroupAndCgroup
        } else {
            pb::Isolation::ProcessGroup
        });
        Ok(Response::new(response))
    }
}

type LogStream = Pin<Box<dyn Stream<Item = Result<pb::LogChunk, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl TaskRuntime for Services {
    async fn execute(
        &self,
        request: Request<pb::ExecuteRequest>,
    ) -> Result<Response<pb::ExecutionStatus>, Status> {
        let request = request.into_inner();
        let digest = crate::tasks::executor::digest(&request.encode_to_vec());
        let key = key(request.id)?;
        let spec = ExecuteSpec::new(
            key,
            source_files(request.files),
            request.entrypoint,
            request.args,
            env_pairs(request.env),
            duration(request.timeout, "timeout")?,
            duration(request.grace_period, "grace_period")?,
            digest,
        )
        .map_err(ExecutorError::from)?;
        let snapshot = self.executor.execute(spec)?;
        Ok(Response::new(self.to_proto(snapshot, false)?))
    }

    async fn status(
        &self,
        request: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::ExecutionStatus>, Status> {
        let request = request.into_inner();
        let snapshot = self.executor.status(&key(request.id)?)?;
        Ok(Response::new(
            self.to_proto(snapshot, request.include_log_tails)?,
        ))
    }

    async fn wait(
        &self,
        request: Request<pb::WaitRequest>,
    ) -> Result<Response<pb::ExecutionStatus>, Status> {
        let request = request.into_inner();
        let limit = duration(request.timeout, "timeout")?
            .unwrap_or_default()
            .min(MAX_WAIT);
        let snapshot = self.executor.wait(&key(request.id)?, limit).await?;
        Ok(Response::new(
            self.to_proto(snapshot, request.include_log_tails)?,
        ))
    }

    async fn list(
        &self,
        _request: Request<pb::ListRequest>,
    ) -> Result<Response<pb::ListResponse>, Status> {
        let executions = self
            .executor
            .list()
            .into_iter()
            .map(|s| self.to_proto(s, false))
            .collect::<Result<_, _>>()?;
        Ok(Response::new(pb::ListResponse { executions }))
    }

    async fn cancel(
        &self,
        request: Request<pb::CancelRequest>,
    ) -> Result<Response<pb::ExecutionStatus>, Status> {
        let key = key(request.into_inner().id)?;
        match self.executor.cancel(&key) {
            Some(snapshot) => Ok(Response::new(self.to_proto(snapshot, false)?)),
            None => {
                // Unknown: nothing to cancel. Say so without inventing a state.
                let mut status = pb::ExecutionStatus {
                    id: Some(execution_id(&key)),
                    reason: "NotFound".to_owned(),
                    message: "the runtime server does not know this execution".to_owned(),
                    ..Default::default()
                };
                status.set_state(pb::ExecutionState::Unspecified);
                Ok(Response::new(status))
            }
        }
    }

    async fn forget(
        &self,
        request: Request<pb::ForgetRequest>,
    ) -> Result<Response<pb::ForgetResponse>, Status> {
        let key = key(request.into_inner().id)?;
        let existed = self.executor.forget(&key, FORGET_LIMIT).await?;
        Ok(Response::new(pb::ForgetResponse { existed }))
    }

    type LogsStream = LogStream;

    async fn logs(
        &self,
        request: Request<pb::LogsRequest>,
    ) -> Result<Response<Self::LogsStream>, Status> {
        let request = request.into_inner();
        let key = key(request.id)?;
        let stream = match pb::LogStream::try_from(request.stream) {
            Ok(pb::LogStream::Stderr) => pb::LogStream::Stderr,
            Ok(pb::LogStream::Stdout | pb::LogStream::Unspecified) => pb::LogStream::Stdout,
            Err(_) => return Err(Status::invalid_argument("unknown log stream")),
        };
        let (stdout, stderr) = self.executor.log_paths(&key)?;
        let path = match stream {
            pb::LogStream::Stderr => stderr,
            pb::LogStream::Stdout | pb::LogStream::Unspecified => stdout,
        };
        let mut snapshots = self.executor.subscribe(&key)?;
        let follow = request.follow;
        let mut offset = request.offset;
        // Bounded: at most 4 chunks of 64 KiB wait for a slow reader.
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            loop {
                // Read the state before the file: bytes written before the program ended
                // are then certainly seen by the read that follows a terminal state.
                let terminal = snapshots.borrow_and_update().state.is_terminal();
                let chunk = match logs::read_chunk(&path, offset) {
                    Ok(chunk) => chunk,
                    Err(e) => {
                        tracing::error!(error = %chain(&e), "log stream");
                        let _ = tx
                            .send(Err(Status::internal("failed to read the log")))
                            .await;
                        return;
                    }
                };
                if !chunk.is_empty() {
                    let len = chunk.len() as u64;
                    let message = pb::LogChunk {
                        stream: stream as i32,
                        offset,
                        data: chunk,
                    };
                    if tx.send(Ok(message)).await.is_err() {
                        return; // the client went away
                    }
                    offset += len;
                    continue;
                }
                if !follow || terminal {
                    return;
                }
                tokio::select! {
                    _ = tx.closed() => return,
                    changed = snapshots.changed() => {
                        if changed.is_err() {
                            return; // forgotten meanwhile
                        }
                    }
                    _ = tokio::time::sleep(FOLLOW_POLL) => {}
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
