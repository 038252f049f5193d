//! The runtime server: the execution backend of one worker (ARCHITECTURE.md,
//! "Components").
//!
//! It serves the `kruntimes.runtime.v1` gRPC API (`RuntimeInfo`, `TaskRuntime`) on a Unix
//! socket to its local runtimed only. It owns workspace confinement, process groups and
//! cgroups, and running task programs with the `bash` or `python` adapter. It never routes
//! requests, authorizes users, reorders work or writes Run status: runtimed does.
//!
//! Modules: [`ids`] (validating identities and paths), [`outputs`] (the outputs file),
//! [`logs`] (tails and chunks), [`interpreter`] (adapters), [`cgroup`] (cgroup v2),
//! [`isolation`] (the only `unsafe`: starting a process in its own session and cgroup),
//! [`executor`] (executions), [`service`] (gRPC), [`server`] (the socket).

pub mod cgroup;
pub mod executor;
pub mod ids;
pub mod interpreter;
pub mod isolation;
pub mod logs;
pub mod outputs;
pub mod server;
pub mod service;

pub use interpreter::Adapter;
pub use server::{CgroupMode, Server, ServerConfig, ServerError};
