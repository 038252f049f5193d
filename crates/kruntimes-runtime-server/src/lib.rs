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
//! One module per mode, one for isolation, and the parts they share:
//!
//! - [`tasks`]: task executions (the executor, the outputs file, gRPC `TaskRuntime` and
//!   `RuntimeInfo`);
//! - [`functions`]: function registrations (the table keyed by Run UID, the persistent
//!   python interpreter and its embedded launcher, bash per-invocation runs, timeouts and
//!   unregistering, gRPC `FunctionRuntime`);
//! - [`sessions`]: session mode (the table keyed by Run UID, workspaces, one operation at a
//!   time, commands with streamed output, file calls resolved beneath the workspace, paged
//!   listings, snapshots, gRPC `SessionRuntime`);
//! - [`sandbox`]: the `process`, `namespaces` and `gvisor` backends, with
//!   [`sandbox::isolation`] (the only `unsafe`: starting a process in its own session and
//!   cgroup, with extra pipes as fds 3 and 4, a sandbox's holder, entering a sandbox, the
//!   `gvisor` helper's modes), [`sandbox::cgroup`] (execution cgroups),
//!   [`sandbox::limits`] (sandbox cgroup limits) and [`sandbox::runsc`] (`gvisor`
//!   containers);
//! - shared: [`ids`] (validating identities and paths), [`logs`] (tails and chunks),
//!   [`interpreter`] (adapters) and [`server`] (the socket).

pub mod functions;
pub mod ids;
pub mod interpreter;
pub mod logs;
pub mod sandbox;
pub mod server;
pub mod sessions;
pub mod tasks;

pub use interpreter::Adapter;
pub use sandbox::SandboxKind;
pub use server::{CgroupMode, SandboxChoice, Server, ServerConfig, ServerError};
