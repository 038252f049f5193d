//! The kruntimes gateway: HTTPS in front of runtimed (ARCHITECTURE.md, "Components").
//!
//! The gateway owns bearer-token authentication and per-Run authorization, admission
//! limits and the translation from HTTP/WebSocket to gRPC. It never owns sessions, queues
//! operations or calls a runtime server directly.
//!
//! - [`server`]: the HTTPS server ([`start`] with a [`GatewayConfig`] gives a [`Gateway`]):
//!   health, metrics, admission limits, body limits; the routes of docs/task-mode.md.
//! - [`logs`]: `GET /v1/namespaces/{ns}/runs/{name}/logs`, proxied to the owning runtimed;
//!   [`log_store`]: the logs of a Run whose worker is gone, read from the log store.
//! - [`invoke`]: `POST /v1/namespaces/{ns}/runtimes/{runtime}/functions/{uid}:invoke`,
//!   routed through the Runtime's watch-backed function cache to a runtimed.
//! - [`session`]: session mode under
//!   `/v1/namespaces/{ns}/runtimes/{runtime}/sessions/{uid}`: status, lease, operations
//!   over a WebSocket ([`session::ws`]) or NDJSON, cancel, files.
//! - [`route`]: what invocations and session calls share: finding a Run in its Runtime's
//!   ownership cache, authorizing the caller, picking the worker, mapping gRPC errors.
//! - [`authz`]: the per-Run authorizer, TokenReview plus SubjectAccessReview through the
//!   Kubernetes API, with a bounded cache of successes that revocations flush (it lives in
//!   `kruntimes-wire`, because every runtimed authorizes its calls with it too).
//! - [`metrics`]: the Prometheus metrics at `GET /metrics`.
//! - [`serving_cert`]: the serving certificate from files, reloaded when they change.
//! - [`error`]: the JSON error answers and the start errors.

pub use kruntimes_wire::authz;
pub mod error;
pub mod invoke;
mod linger;
pub mod log_store;
pub mod logs;
pub mod metrics;
pub mod route;
pub mod server;
pub mod serving_cert;
pub mod session;

/// Narrow entries into the session wire decoding for the fuzz targets in `fuzz/` (not an
/// API: the types behind them stay private to the gateway).
#[doc(hidden)]
pub mod fuzzing {
    use crate::session::wire::{self, ClientFrame, ServerFrame};

    /// Parses one WebSocket text frame as the session WebSocket does, and renders the
    /// answer it would send for a refused one. `Ok` names the accepted frame's type.
    pub fn ws_frame(text: &str) -> Result<&'static str, String> {
        match wire::parse_frame(text) {
            Ok(ClientFrame::Send(_)) => Ok("send"),
            Ok(ClientFrame::Cancel { .. }) => Ok("cancel"),
            Ok(ClientFrame::Heartbeat) => Ok("heartbeat"),
            Err(refused) => {
                Err(ServerFrame::rejected(refused.operation_id, &refused.error).to_json())
            }
        }
    }

    /// Parses one operation body (`POST {base}/operations`) and translates it to
    /// runtimed's request, as the NDJSON route does.
    pub fn operation(body: &[u8]) -> Result<(), String> {
        wire::parse_operation(body)
            .and_then(|operation| operation.into_request())
            .map(|_| ())
            .map_err(|e| e.message().to_string())
    }
}

pub use authz::{AuthCache, Authorizer, AuthorizerConfig, AuthzError, AuthzStats, Principal};
pub use error::{GatewayError, HttpError};
pub use route::InvokeRouting;
pub use server::{Gateway, GatewayConfig, start};
