//! The kruntimes resource API: the `Run`, `Runtime`, `Snapshot` and `Workspace` kinds in `kruntimes.io/v1alpha1`,
//! their phase helpers, the admission rules and CRD generation.
//!
//! This crate owns the types and the pure rules over them. It does no I/O: no network, no
//! filesystem. Every component depends on it, and it depends on none of them
//! (ARCHITECTURE.md, "Crates and folders"). The embedded API server applies
//! [`admission`] on create, update and patch; on a real cluster the same rules are
//! expressed as CEL `x-kubernetes-validations` in the CRDs that [`crds`] generates.

pub mod admission;
pub mod capacity;
#[cfg(test)]
mod crd_parity;
pub mod crds;
pub mod duration;
pub mod lifecycle;
pub mod logstore;
pub mod paging;
pub mod phase;
pub mod run;
pub mod runtime;
pub mod snapshot;
pub mod workspace;

pub use phase::Phase;
pub use run::{Run, RunSpec, RunStatus};
pub use runtime::{Runtime, RuntimeSpec, RuntimeStatus};
pub use snapshot::{Snapshot, SnapshotSpec, SnapshotStatus};
pub use workspace::{Workspace, WorkspaceSpec, WorkspaceStatus};

/// The API group of every kruntimes kind.
pub const GROUP: &str = "kruntimes.io";
/// The one served version of the group.
pub const VERSION: &str = "v1alpha1";
/// `group/version`, as written in `apiVersion`.
pub const API_VERSION: &str = "kruntimes.io/v1alpha1";
