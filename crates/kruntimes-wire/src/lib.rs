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
//! - [`ownership`]: the watched cache of which worker serves which function and session
//!   Run, that the gateway routes with and runtimed forwards with.
//! - [`revocation`]: the watches that drop cached decisions when a token, a ServiceAccount
//!   or an RBAC object changes.
//! - [`tls_files`]: TLS material from PEM files (mounted Secrets), bounded reads and
//!   reloading when the files change.
//! - [`worker`]: the mutual TLS of runtimed's gRPC port and the endpoint of a worker, and
//!   the invocation constants both its sides use.
//!
//! It never serves a port of its own and never stores a raw token.

#![forbid(unsafe_code)]

pub mod authz;
pub mod events;
pub mod ownership;
pub mod revocation;
pub mod tls_files;
pub mod worker;

pub use authz::{AuthCache, Authorizer, AuthorizerConfig, AuthzError, AuthzStats, Principal};

/// `error` and its sources, each once (a source whose text the line already holds is left
/// out), as one line.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
