//! The kruntimes gateway: HTTPS in front of runtimed (ARCHITECTURE.md, "Components").
//!
//! The gateway owns bearer-token authentication and per-Run authorization, admission
//! limits and the translation from HTTP/WebSocket to gRPC. It never owns sessions, queues
//! operations or calls a runtime server directly.
//!
//! For now this crate holds only the gateway-side authorizer ([`authz`]): TokenReview plus
//! SubjectAccessReview through the Kubernetes API, with a bounded cache of successes. The
//! gateway binary that uses it comes in a later issue.

pub mod authz;

pub use authz::{AuthCache, Authorizer, AuthorizerConfig, AuthzError, AuthzStats, Principal};
