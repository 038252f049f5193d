//! gRPC definitions of kruntimes' internal services (ARCHITECTURE.md, "Crates and folders").
//!
//! This crate owns the wire contract between runtimed and its local runtime server:
//! `proto/kruntimes/runtime/v1/runtime.proto`, compiled at build time with protox (no
//! system `protoc`) into prost messages and tonic clients and servers. It holds no logic:
//! behaviour lives with the servers that implement the services.

/// Package `kruntimes.runtime.v1`: the runtime server's API.
pub mod runtime {
    pub mod v1 {
        #![allow(clippy::all, clippy::pedantic, missing_docs)]
        tonic::include_proto!("kruntimes.runtime.v1");

        /// Fully qualified name of the `RuntimeInfo` service.
        pub const RUNTIME_INFO_SERVICE: &str = "kruntimes.runtime.v1.RuntimeInfo";
        /// Fully qualified name of the `TaskRuntime` service.
        pub const TASK_RUNTIME_SERVICE: &str = "kruntimes.runtime.v1.TaskRuntime";
        /// Fully qualified name of the `FunctionRuntime` service.
        pub const FUNCTION_RUNTIME_SERVICE: &str = "kruntimes.runtime.v1.FunctionRuntime";
        /// Session mode (design document 001).
        pub const SESSION_RUNTIME_SERVICE: &str = "kruntimes.runtime.v1.SessionRuntime";
    }
}

/// Package `kruntimes.runtimed.v1`: runtimed's API, for the gateway and peer runtimeds.
pub mod runtimed {
    pub mod v1 {
        #![allow(clippy::all, clippy::pedantic, missing_docs)]
        tonic::include_proto!("kruntimes.runtimed.v1");
    }
}

pub mod unix;

pub use prost_types;
