//! runtimed's Prometheus metrics, served at `GET /metrics` on the metrics address (HTTP,
//! loopback or the Pod network; no token or payload appears in them).
//!
//! | metric | type | what |
//! | --- | --- | --- |
//! | `kruntimes_runtimed_invocations_total{result}` | counter | `Invoke` calls answered by this runtimed: `succeeded`, `failed`, `timed_out` (the handler's outcome), `rejected` (its concurrency reached: 429), `not_ready`, `not_found`, `denied`, `invalid`, `error` |
//! | `kruntimes_runtimed_invocation_duration_seconds{result}` | histogram | time to answer an `Invoke` call, by the same result |
//! | `kruntimes_runtimed_invocations_in_flight` | gauge | `Invoke` calls being answered |
//! | `kruntimes_runtimed_invocations_forwarded_total` | counter | calls forwarded to the owner's runtimed |
//! | `kruntimes_runtimed_registrations_total{result}` | counter | `RegisterFunction` calls: `registered`, `failed` |
//! | `kruntimes_runtimed_registration_duration_seconds` | histogram | how long a successful `RegisterFunction` or `RegisterSession` took (the cold start: the interpreter starts and imports the handler) |
//! | `kruntimes_runtimed_session_operations_total{result}` | counter | session mutations this owner ran to their end: `Succeeded`, `Failed`, `Cancelled`, `TimedOut` |
//! | `kruntimes_runtimed_session_auto_suspends_total{cause}` | counter | sessions this owner asked to suspend on its own: `idle` (`autoSuspendAfter`), `lease` (an expired lease with auto-suspend set) |
//! | `kruntimes_runtimed_session_wakes_total{result}` | counter | `WakeSession` calls answered: `woken`, `not_wakeable` (no valid marker), `error` |

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

/// The content type of the text format.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

/// Every metric of one runtimed.
pub struct Metrics {
    registry: Registry,
    invocations: Family<ResultLabels, Counter>,
    invocation_seconds: Family<ResultLabels, Histogram>,
    pub in_flight: Gauge,
    pub forwarded: Counter,
    registrations: Family<ResultLabels, Counter>,
    registration_seconds: Histogram,
    session_operations: Family<StateLabels, Counter>,
    snapshot_restores: Family<SourceLabels, Counter>,
    auto_suspends: Family<CauseLabels, Counter>,
    wakes: Family<ResultLabels, Counter>,
}

/// Why an owner suspended a session on its own: `idle` or `lease`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabels {
    pub cause: &'static str,
}

/// Where a resumed session's snapshot was restored from: `local` or `store`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    pub source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub result: String,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        let mut registry = Registry::with_prefix("kruntimes_runtimed");
        let invocations = Family::<ResultLabels, Counter>::default();
        registry.register(
            "invocations",
            "Invoke calls answered, by result",
            invocations.clone(),
        );
        let invocation_seconds = Family::<ResultLabels, Histogram>::new_with_constructor(|| {
            // 50 µs to about 100 s.
            Histogram::new(exponential_buckets(0.00005, 2.5, 17))
        });
        registry.register(
            "invocation_duration_seconds",
            "Time to answer an Invoke call, by result",
            invocation_seconds.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "invocations_in_flight",
            "Invoke calls being answered",
            in_flight.clone(),
        );
        let forwarded = Counter::default();
        registry.register(
            "invocations_forwarded",
            "Invoke calls forwarded to the owner's runtimed",
            forwarded.clone(),
        );
        let registrations = Family::<ResultLabels, Counter>::default();
        registry.register(
            "registrations",
            "RegisterFunction calls, by result",
            registrations.clone(),
        );
        let registration_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register(
            "registration_duration_seconds",
            "How long a successful RegisterFunction took (the cold start)",
            registration_seconds.clone(),
        );
        let session_operations = Family::<StateLabels, Counter>::default();
        registry.register(
            "session_operations",
            "Session mutations run to their end by this owner, by result",
            session_operations.clone(),
        );
        let auto_suspends = Family::<CauseLabels, Counter>::default();
        registry.register(
            "session_auto_suspends",
            "Sessions this owner asked to suspend on its own, by cause (idle or lease)",
            auto_suspends.clone(),
        );
        let wakes = Family::<ResultLabels, Counter>::default();
        registry.register(
            "session_wakes",
            "WakeSession calls answered, by result (woken, not_wakeable, error)",
            wakes.clone(),
        );
        let snapshot_restores = Family::<SourceLabels, Counter>::default();
        registry.register(
            "snapshot_restores",
            "Session snapshots restored into a resumed session, by source (parked, local or store)",
            snapshot_restores.clone(),
        );
        Metrics {
            snapshot_restores,
            session_operations,
            registry,
            invocations,
            invocation_seconds,
            in_flight,
            forwarded,
            registrations,
            registration_seconds,
            auto_suspends,
            wakes,
        }
    }
}

impl Metrics {
    /// Counts one answered `Invoke` call.
    pub fn invocation(&self, result: &'static str, seconds: f64) {
        let labels = ResultLabels { result };
        self.invocations.get_or_create(&labels).inc();
        self.invocation_seconds
            .get_or_create(&labels)
            .observe(seconds);
    }

    /// Counts one `RegisterFunction` call; `seconds` for a success.
    pub fn registration(&self, seconds: Option<f64>) {
        let result = if seconds.is_some() {
            "registered"
        } else {
            "failed"
        };
        self.registrations
            .get_or_create(&ResultLabels { result })
            .inc();
        if let Some(seconds) = seconds {
            self.registration_seconds.observe(seconds);
        }
    }

    /// Counts one snapshot restored from `source` (`local` or `store`).
    pub fn snapshot_restore(&self, source: &'static str) {
        self.snapshot_restores
            .get_or_create(&SourceLabels { source })
            .inc();
    }

    /// Counts one session this owner asked to suspend on its own (`idle` or `lease`).
    pub fn auto_suspend(&self, cause: &'static str) {
        self.auto_suspends
            .get_or_create(&CauseLabels { cause })
            .inc();
    }

    /// Counts one answered `WakeSession` call (`woken`, `not_wakeable`, `error`).
    pub fn wake(&self, result: &'static str) {
        self.wakes.get_or_create(&ResultLabels { result }).inc();
    }

    /// Counts one session mutation that ended in `state`.
    pub fn session_operation(&self, state: &str) {
        self.session_operations
            .get_or_create(&StateLabels {
                result: state.to_string(),
            })
            .inc();
    }

    /// The text format, ending with `# EOF`.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

/// Serves `GET /metrics` (and the probes `/healthz`, `/readyz`) on `listener` until `stop`
/// completes.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // The probes of `kruntimes runtimed --health-addr`: this server starts once the runtime
    // server has answered and the gRPC listener is bound, so serving is being ready.
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(|| async { "ok" }))
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
    fn results_and_registrations_are_counted() {
        let metrics = Metrics::default();
        metrics.invocation("succeeded", 0.0004);
        metrics.invocation("rejected", 0.0001);
        metrics.registration(Some(0.02));
        metrics.registration(None);
        let text = metrics.encode().unwrap_or_default();
        assert!(
            text.contains("kruntimes_runtimed_invocations_total{result=\"succeeded\"} 1"),
            "{text}"
        );
        assert!(text.contains("kruntimes_runtimed_invocations_total{result=\"rejected\"} 1"));
        assert!(text.contains("kruntimes_runtimed_registrations_total{result=\"failed\"} 1"));
        assert!(text.contains("kruntimes_runtimed_registration_duration_seconds_count 1"));
        metrics.auto_suspend("idle");
        metrics.wake("woken");
        let text = metrics.encode().unwrap_or_default();
        assert!(
            text.contains("kruntimes_runtimed_session_auto_suspends_total{cause=\"idle\"} 1"),
            "{text}"
        );
        assert!(text.contains("kruntimes_runtimed_session_wakes_total{result=\"woken\"} 1"));
    }
}
