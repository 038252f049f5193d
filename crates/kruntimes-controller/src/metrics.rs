//! The controller-manager's Prometheus metrics, served at `GET /metrics` over HTTP on the
//! metrics address (`kruntimes up --controller-metrics-addr`); no token or payload appears
//! in them.
//!
//! | metric | type | what |
//! | --- | --- | --- |
//! | `kruntimes_session_expired_total` | counter | sessions the idle sweep ended `Timeout/IdleTimeout` ([`crate::idle`]) |

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

/// The content type of the text format.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Every metric of one controller-manager; it outlives leadership terms.
pub struct Metrics {
    registry: Registry,
    session_expired: Counter,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        let mut registry = Registry::with_prefix("kruntimes");
        let session_expired = Counter::default();
        registry.register(
            "session_expired",
            "Sessions the idle sweep ended Timeout/IdleTimeout",
            session_expired.clone(),
        );
        Metrics {
            registry,
            session_expired,
        }
    }
}

impl Metrics {
    /// Counts one session ended for idleness.
    pub fn session_expired(&self) {
        self.session_expired.inc();
    }

    /// The text format, ending with `# EOF`.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

/// Serves `GET /metrics` on `listener` until `stop` completes.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(scrape))
        .with_state(metrics);
    axum::serve(listener, app)
        .with_graceful_shutdown(stop)
        .await
}

async fn scrape(State(metrics): State<Arc<Metrics>>) -> Response {
    match metrics.encode() {
        Ok(text) => (StatusCode::OK, [(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "failed to encode the metrics",
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiries_are_counted() {
        let metrics = Metrics::default();
        metrics.session_expired();
        metrics.session_expired();
        let text = metrics.encode().unwrap_or_default();
        assert!(text.contains("kruntimes_session_expired_total 2"), "{text}");
    }
}
