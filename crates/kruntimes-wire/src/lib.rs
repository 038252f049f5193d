//! What more than one component needs to serve a caller of a worker (ARCHITECTURE.md,
//! "Crates and folders": `kruntimes-wire`), so that the gateway and runtimed share it
//! without depending on each other's crates.
//!
//! - [`authz`]: the per-Run authorizer, TokenReview plus SubjectAccessReview through the
//!   Kubernetes API, with its bounded success-only cache. The gateway authorizes every
//!   request with it, and every runtimed authorizes every call it serves or forwards with
//!   the token the call carries.
//! - [`events`]: the bounded Kubernetes Event writer both the controller-manager and
//!   runtimed report through (kube-runtime's recorder, never blocking the work reported).
//! - [`revocation`]: the watches that drop cached decisions when a token, a ServiceAccount
//!   or an RBAC object changes.
//!
//! It never routes, never serves a port and never stores a raw token.

#![forbid(unsafe_code)]

pub mod authz;
pub mod events;
pub mod revocation;

pub use authz::{AuthCache, Authorizer, AuthorizerConfig, AuthzError, AuthzStats, Principal};
