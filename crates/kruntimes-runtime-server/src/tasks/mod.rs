//! Task mode: running a program to completion.
//!
//! [`executor`] owns the executions (workspaces, supervision, termination, results),
//! [`outputs`] parses the outputs file a program writes, and [`service`] is the gRPC
//! `RuntimeInfo` and `TaskRuntime` over the executor.
#![forbid(unsafe_code)]

pub mod executor;
pub mod outputs;
pub mod service;
