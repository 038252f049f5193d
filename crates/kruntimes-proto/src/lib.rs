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

/// The caps of `CaptureSession` and `RestoreSession`, part of their contract: runtimed
/// bounds what it reads from a capture, and what it fetches from a store to restore, by the
/// same figure the runtime server bounds its stream by, so that every snapshot one end
/// accepts the other accepts too (a restore capped tighter than its capture would fail a
/// good snapshot `SnapshotInvalid`, losing the session).
pub mod snapshot_caps {
    /// The most bytes of regular files, uncompressed, when a request names no cap (0).
    pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;
    /// The most entries when a request names no cap (0).
    pub const DEFAULT_MAX_FILES: u64 = 100_000;

    /// The caps a request's `max_bytes` and `max_files` stand for: 0 is the default.
    pub fn effective(max_bytes: u64, max_files: u64) -> (u64, u64) {
        (
            if max_bytes == 0 {
                DEFAULT_MAX_BYTES
            } else {
                max_bytes
            },
            if max_files == 0 {
                DEFAULT_MAX_FILES
            } else {
                max_files
            },
        )
    }

    /// The most bytes the compressed stream, and the decompressed tar, of a snapshot may
    /// hold under those caps: the files, 1/64 more for incompressible data's framing, 4 KiB
    /// per entry (its header, a long name, padding), and 1 MiB besides. The files' own
    /// bytes are checked against `max_bytes` entry by entry.
    pub fn stream_bytes(max_bytes: u64, max_files: u64) -> u64 {
        let (max_bytes, max_files) = effective(max_bytes, max_files);
        max_bytes
            .saturating_add(max_bytes / 64)
            .saturating_add(max_files.saturating_mul(4096))
            .saturating_add(1 << 20)
    }
}

pub use prost_types;
