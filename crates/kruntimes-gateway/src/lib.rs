//! The kruntimes gateway: HTTPS in front of runtimed (ARCHITECTURE.md, "Components").
//!
//! The gateway owns bearer-token authentication and per-Run authorization, admission
//! limits and the translation from HTTP/WebSocket to gRPC. It never owns sessions, queues
//! operations or calls a runtime server directly.
//!
//! - [`server`]: the HTTPS server ([`start`] with a [`GatewayConfig`] gives a [`Gateway`]):
//!   health, metrics, admission limits, body limits; the routes of docs/task-mode.md.
//! - [`logs`]: `GET /v1/namespaces/{ns}/runs/{name}/logs`, proxied to the owning runtimed.
//! - [`invoke`]: `POST /v1/namespaces/{ns}/runtimes/{runtime}/functions/{uid}:invoke`,
//!   routed through the Runtime's watch-backed function cache to a runtimed.
//! - [`session`]: session mode under
//!   `/v1/namespaces/{ns}/runtimes/{runtime}/sessions/{uid}`: status, lease, operations
//!   over a WebSocket ([`session::ws`]) or NDJSON, cancel, files.
//! - [`route`]: what invocations and session calls share: finding a Run in its Runtime's
//!   ownership cache, authorizing the caller, picking the worker, mapping gRPC errors.
//! - [`authz`]: the per-Run authorizer, TokenReview plus SubjectAccessReview through the
//!   Kubernetes API, with a bounded cache of successes.
//! - [`metrics`]: the Prometheus metrics at `GET /metrics`.
//! - [`error`]: the JSON error answers and the start errors.

pub mod authz;
pub mod error;
pub mod invoke;
pub mod logs;
pub mod metrics;
pub mod route;
pub mod server;
pub mod session;

pub use authz::{AuthCache, Authorizer, AuthorizerConfig, AuthzError, AuthzStats, Principal};
pub use error::{GatewayError, HttpError};
pub use route::InvokeRouting;
pub use server::{Gateway, GatewayConfig, start};
