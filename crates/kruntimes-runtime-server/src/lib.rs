//! The runtime server: the execution backend of one worker (ARCHITECTURE.md,
//! "Components").
//!
//! It serves the `kruntimes.runtime.v1` gRPC API (`RuntimeInfo`, `TaskRuntime`,
//! `FunctionRuntime`, `SessionRuntime`) on a Unix socket to its local runtimed only. It owns
//! workspace confinement, process groups and cgroups, running task programs, invoking
//! registered function handlers with the `bash` or `python` adapter, and running session
//! commands and file operations. It never routes requests, authorizes users, reorders or
//! queues work, retries an invocation or operation or writes Run status: runtimed does.
//!
//! Modules: [`ids`] (validating identities and paths), [`outputs`] (the outputs file),
//! [`logs`] (tails and chunks), [`interpreter`] (adapters), [`cgroup`] (cgroup v2),
//! [`isolation`] (the only `unsafe`: starting a process in its own session and cgroup,
//! with extra pipes as fds 3 and 4, a sandbox's holder, entering a sandbox, the `gvisor`
//! helper's modes), [`sandbox`] (the `process`, `namespaces` and `gvisor` backends),
//! [`runsc`] (`gvisor` containers), [`limits`] (sandbox cgroup limits), [`executor`] (task executions), [`functions`]
//! (function registrations: the table keyed by Run UID, the persistent python interpreter
//! and its embedded launcher, bash per-invocation runs, timeouts and unregistering),
//! [`sessions`] (session mode: the table keyed by Run UID, workspaces, one operation at a
//! time, commands with streamed output, file calls resolved beneath the workspace, paged
//! listings), [`service`] (gRPC for tasks), [`function_service`] (gRPC for functions),
//! [`session_service`] (gRPC for sessions), [`server`] (the socket).

pub mod cgroup;
pub mod executor;
pub mod function_service;
pub mod functions;
pub mod ids;
pub mod interpreter;
pub mod isolation;
pub mod limits;
pub mod logs;
pub mod outputs;
pub mod runsc;
pub mod sandbox;
pub mod server;
pub mod service;
pub mod session_service;
pub mod sessions;

pub use interpreter::Adapter;
pub use sandbox::SandboxKind;
pub use server::{CgroupMode, SandboxChoice, Server, ServerConfig, ServerError};
