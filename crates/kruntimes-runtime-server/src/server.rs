//! Serving the gRPC services on a Unix socket.
//!
//! Owns startup (resolving the interpreter, choosing the isolation, taking over the root),
//! the socket (a stale socket file is replaced; the socket is 0600, for the local runtimed
//! only) and shutdown (stop accepting, unregister function registrations, terminate
//! running executions, remove the socket).
#![forbid(unsafe_code)]

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kruntimes_proto::runtime::v1::function_runtime_server::FunctionRuntimeServer;
use kruntimes_proto::runtime::v1::runtime_info_server::RuntimeInfoServer;
use kruntimes_proto::runtime::v1::session_runtime_server::SessionRuntimeServer;
use kruntimes_proto::runtime::v1::task_runtime_server::TaskRuntimeServer;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

use crate::functions::service::FunctionService;
use crate::functions::{FunctionError, Functions, FunctionsConfig};
use crate::interpreter::{self, Adapter, InterpreterError};
use crate::sandbox::cgroup::CgroupParent;
use crate::sandbox::limits::Limits;
use crate::sandbox::runsc::Runsc;
use crate::sandbox::{self, NamespacesConfig, SandboxKind};
use crate::sessions::service::SessionService;
use crate::sessions::{SessionError, Sessions, SessionsConfig};
use crate::tasks::executor::{self, Executor, ExecutorConfig, ExecutorError};
use crate::tasks::service::{Isolation, Services};

/// How long open connections may finish their calls after shutdown begins.
const CONNECTION_DRAIN: Duration = Duration::from_secs(1);

/// How the server's executions are contained.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupMode {
    /// Use a cgroup per execution when the machine allows, else process groups only.
    Auto,
    /// Process groups only.
    Off,
    /// Use this parent cgroup; fail to start if it cannot be used.
    Parent(PathBuf),
}

/// Everything the server is started with.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub socket: PathBuf,
    pub root: PathBuf,
    pub adapter: Adapter,
    /// The interpreter; `None` resolves one (see [`interpreter::resolve`]).
    pub interpreter: Option<PathBuf>,
    pub default_grace: Duration,
    pub cgroups: CgroupMode,
    /// SIGTERM → SIGKILL when CloseSession gives no grace period, and after a session
    /// operation's timeout (`--session-termination-grace`).
    pub session_termination_grace: Duration,
    /// The bash of session `shell` commands; `None` resolves one (the bash adapter's
    /// interpreter, else the usual places, else `bash` on PATH when a command runs).
    pub shell: Option<PathBuf>,
    pub sandbox: SandboxChoice,
    /// The log store that task executions write stdout and stderr to (`--log-dir`);
    /// `None`: each execution's workspace.
    pub log_dir: Option<PathBuf>,
}

/// The sandbox backend to use, and its settings.
#[derive(Debug, Clone)]
pub struct SandboxChoice {
    /// `None`: `namespaces` where the machine supports it, else `process` (with a warning).
    pub kind: Option<SandboxKind>,
    pub uid: u32,
    pub gid: u32,
    pub limits: Limits,
    pub tmp_bytes: u64,
    /// How many warm (pre-built, never-used) `namespaces` sandboxes to keep.
    pub warm: usize,
    /// `namespaces`: whether a sandbox's init starts its programs (the default), rather
    /// than a fork of the server that enters the sandbox.
    pub launcher: bool,
    /// The `runsc` of the `gvisor` backend.
    pub runsc: Runsc,
}

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Interpreter(#[from] InterpreterError),
    #[error("the {0} sandbox cannot be used: {1}")]
    Sandbox(SandboxKind, String),
    #[error("cgroup parent {path} cannot be used: {reason}")]
    Cgroup { path: PathBuf, reason: String },
    #[error("failed to prepare root {path}")]
    Root {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Executor(#[from] ExecutorError),
    #[error(transparent)]
    Functions(#[from] FunctionError),
    #[error(transparent)]
    Sessions(#[from] SessionError),
    #[error("failed to bind Unix socket {path}")]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} exists and is not a socket; refusing to replace it")]
    NotASocket { path: PathBuf },
    #[error("the gRPC server failed")]
    Serve(#[source] tonic::transport::Error),
}

/// A started server: the executor, the function table and the session table plus the bound
/// listener, not yet serving.
pub struct Server {
    executor: Arc<Executor>,
    functions: Arc<Functions>,
    sessions: Arc<Sessions>,
    services: Services,
    listener: UnixListener,
    socket: PathBuf,
    sandboxes: Option<Arc<sandbox::Sandboxes>>,
}

impl Server {
    /// Resolves the interpreter, chooses the isolation, takes over the root and binds the
    /// socket. After this returns, clients can connect (calls wait until [`Server::serve`]).
    pub async fn bind(config: ServerConfig) -> Result<Self, ServerError> {
        // The server's own PATH (that of `kruntimes up`, or the Pod's) finds the
        // interpreter and the shell; programs get the fixed one instead.
        let host_path = std::env::var("PATH").unwrap_or_else(|_| executor::PROGRAM_PATH.to_owned());
        let interpreter = interpreter::resolve(
            config.adapter,
            config.interpreter.as_deref(),
            Some(&host_path),
        )?;
        let path_var = executor::program_path(&interpreter);
        std::fs::create_dir_all(&config.root).map_err(|source| ServerError::Root {
            path: config.root.clone(),
            source,
        })?;
        let root = config
            .root
            .canonicalize()
            .map_err(|source| ServerError::Root {
                path: config.root.clone(),
                source,
            })?;
        let (cgroups, cgroup_unavailable) = match &config.cgroups {
            CgroupMode::Off => (None, Some("disabled by configuration".to_owned())),
            CgroupMode::Auto => match CgroupParent::discover(&root, None) {
                Ok(parent) => (Some(parent), None),
                Err(reason) => {
                    tracing::warn!(%reason, "cgroups unavailable; process groups only");
                    (None, Some(reason))
                }
            },
            CgroupMode::Parent(path) => match CgroupParent::discover(&root, Some(path)) {
                Ok(parent) => (Some(parent), None),
                Err(reason) => {
                    return Err(ServerError::Cgroup {
                        path: path.clone(),
                        reason,
                    });
                }
            },
        };
        let choice = &config.sandbox;
        let namespaces = NamespacesConfig {
            root: root.clone(),
            uid: choice.uid,
            gid: choice.gid,
            limits: choice.limits,
            tmp_bytes: choice.tmp_bytes,
            cgroup_parent: cgroups.as_ref().map(|c| c.path().to_owned()),
            gvisor: (choice.kind == Some(SandboxKind::Gvisor)).then(|| choice.runsc.clone()),
            launcher: choice.launcher,
        };
        let sandboxes = match choice.kind {
            Some(SandboxKind::Process) => None,
            Some(kind @ (SandboxKind::Namespaces | SandboxKind::Gvisor)) => Some(
                sandbox::start(namespaces)
                    .await
                    .map_err(|reason| ServerError::Sandbox(kind, reason))?,
            ),
            None => match sandbox::start(namespaces).await {
                Ok(backend) => Some(backend),
                Err(reason) => {
                    tracing::warn!(%reason, "the namespaces sandbox is not supported here; falling back to the process backend, which does not isolate untrusted code");
                    None
                }
            },
        };
        match &sandboxes {
            Some(backend) => {
                backend.start_pool(choice.warm);
                tracing::info!(sandbox = %backend.kind(), enforcement = %backend.enforcement, warm = choice.warm, "sandbox backend")
            }
            None => tracing::info!(
                sandbox = "process",
                "sandbox backend (trusted workloads only)"
            ),
        }
        tracing::info!(
            adapter = %config.adapter,
            interpreter = %interpreter.display(),
            root = %root.display(),
            cgroup = ?cgroups.as_ref().map(|c| c.path().to_owned()),
            "runtime server starting"
        );
        let functions = Functions::new(FunctionsConfig {
            root: root.clone(),
            adapter: config.adapter,
            interpreter: interpreter.clone(),
            path_var: path_var.clone(),
            cgroups: cgroups.clone(),
            sandboxes: sandboxes.clone(),
        })?;
        let shell = config
            .shell
            .clone()
            .or_else(|| (config.adapter == Adapter::Bash).then(|| interpreter.clone()));
        let shell = match interpreter::resolve(Adapter::Bash, shell.as_deref(), Some(&host_path)) {
            Ok(shell) => shell,
            Err(e) => {
                tracing::warn!(error = %e, "no bash for session shell commands; using bash on PATH");
                PathBuf::from("bash")
            }
        };
        let sessions = Sessions::new(SessionsConfig {
            root: root.clone(),
            adapter: config.adapter,
            shell,
            path_var: path_var.clone(),
            cgroups: cgroups.clone(),
            sandboxes: sandboxes.clone(),
            termination_grace: config.session_termination_grace,
        })?;
        let executor = Executor::new(ExecutorConfig {
            root,
            adapter: config.adapter,
            interpreter,
            default_grace: config.default_grace,
            path_var,
            cgroups,
            sandboxes: sandboxes.clone(),
            log_dir: config.log_dir.clone(),
        })?;
        let services = Services::new(
            executor.clone(),
            Isolation {
                cgroup_unavailable,
                sandbox: sandboxes.as_ref().map(|s| s.enforcement.clone()),
                gvisor: sandboxes
                    .as_ref()
                    .is_some_and(|s| s.kind() == SandboxKind::Gvisor),
            },
        );
        let listener = bind_socket(&config.socket)?;
        Ok(Self {
            executor,
            functions,
            sessions,
            services,
            listener,
            socket: config.socket,
            sandboxes,
        })
    }

    /// Serves until `shutdown` completes, then unregisters every function registration
    /// (kills its processes, removes its workspace), closes and purges every session,
    /// terminates running executions (each with its grace period, all within `grace + 5 s`)
    /// and removes the socket.
    pub async fn serve(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<(), ServerError> {
        let Server {
            executor,
            functions,
            sessions,
            services,
            listener,
            socket,
            sandboxes,
        } = self;
        let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
        let signal = async move {
            shutdown.await;
            let _ = stopping_tx.send(());
        };
        let serve = tonic::transport::Server::builder()
            .add_service(RuntimeInfoServer::new(services.clone()))
            .add_service(TaskRuntimeServer::new(services))
            .add_service(FunctionRuntimeServer::new(FunctionService::new(
                functions.clone(),
            )))
            .add_service(SessionRuntimeServer::new(SessionService::new(
                sessions.clone(),
            )))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), signal);
        // Graceful shutdown waits for every connection to close; a client that keeps its
        // channel open (runtimed does) must not keep the server alive, so connections get
        // CONNECTION_DRAIN to finish their calls.
        let drained = async move {
            if stopping_rx.await.is_ok() {
                tokio::time::sleep(CONNECTION_DRAIN).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        let result = tokio::select! {
            result = serve => result,
            () = drained => Ok(()),
        };
        let limit = executor.config().default_grace + Duration::from_secs(5);
        // Registrations and sessions first: the executor removes the shared cgroup parent
        // once empty.
        functions.shutdown(limit).await;
        let session_limit = sessions.config().termination_grace + Duration::from_secs(5);
        sessions.shutdown(session_limit).await;
        executor.shutdown(limit).await;
        if let Some(sandboxes) = &sandboxes {
            sandboxes.close_pool().await;
            sandboxes.remove_limit_parents();
        }
        let _ = std::fs::remove_file(&socket);
        tracing::info!("runtime server stopped");
        result.map_err(ServerError::Serve)
    }
}

fn bind_socket(path: &Path) -> Result<UnixListener, ServerError> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            // Left by a previous server of this worker.
            let _ = std::fs::remove_file(path);
        }
        Ok(_) => {
            return Err(ServerError::NotASocket {
                path: path.to_owned(),
            });
        }
        Err(_) => {}
    }
    if let Some(parent) = path.parent()
        && !parent.as_os_str().is_empty()
    {
        std::fs::create_dir_all(parent).map_err(|source| ServerError::Bind {
            path: path.to_owned(),
            source,
        })?;
    }
    let listener = UnixListener::bind(path).map_err(|source| ServerError::Bind {
        path: path.to_owned(),
        source,
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(|source| {
        ServerError::Bind {
            path: path.to_owned(),
            source,
        }
    })?;
    Ok(listener)
}
