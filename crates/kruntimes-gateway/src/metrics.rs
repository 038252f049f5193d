//! The gateway's metrics, served at `GET /metrics` in the Prometheus text format (the
//! OpenMetrics flavour that `prometheus-client` writes and Prometheus scrapes).
//!
//! | metric | type | what |
//! | --- | --- | --- |
//! | `kruntimes_gateway_http_requests_total{route,code}` | counter | answered requests, by route template and HTTP status |
//! | `kruntimes_gateway_http_requests_in_flight` | gauge | `/v1/` requests holding an admission permit (until their body ends) |
//! | `kruntimes_gateway_http_requests_rejected_total` | counter | `/v1/` requests refused with 429 by the concurrency limit |
//! | `kruntimes_gateway_http_concurrency_limit` | gauge | the configured concurrency limit |
//! | `kruntimes_gateway_authz_cache_hits_total` | counter | authorizations answered from the cache |
//! | `kruntimes_gateway_authz_cache_misses_total` | counter | authorizations not answered from the cache: reviewed by the API server, or joined a review in flight |
//! | `kruntimes_gateway_authz_coalesced_total` | counter | of those, authorizations that joined a review in flight for the same token and Run instead of asking again |
//! | `kruntimes_gateway_authz_invalidations_total` | counter | flushes of the authorization cache by revocation watches |
//! | `kruntimes_gateway_authz_cache_entries` | gauge | successes the cache holds |
//! | `kruntimes_gateway_logs_bytes_total` | counter | bytes of Run logs proxied to clients |
//! | `kruntimes_gateway_logs_streams_failed_total` | counter | logs responses cut short by a failing worker stream |
//! | `kruntimes_gateway_logs_streams_revoked_total` | counter | following logs responses ended because their caller's authorization was revoked |
//! | `kruntimes_gateway_logs_waiting_for_start` | gauge | `follow=true` logs requests waiting for their Run to start |
//! | `kruntimes_gateway_invocations_total{result}` | counter | answered invocations: `succeeded`, `failed`, `timed_out` (the handler's outcome), `rejected` (429), `error` (any other error status) |
//! | `kruntimes_gateway_invocation_duration_seconds{result}` | histogram | time from request to answer, by the same result |
//! | `kruntimes_gateway_invocations_in_flight` | gauge | invocations being answered |
//! | `kruntimes_gateway_session_calls_total{call,code}` | counter | answered session calls by kind (`status`, `renew`, `send`, `cancel`, `files`, `open`, and on a WebSocket `heartbeat` and malformed `frame`s) and HTTP status (on a WebSocket: 200 or the `rejected` frame's status) |
//! | `kruntimes_gateway_session_events_total` | counter | operation events forwarded to clients |
//! | `kruntimes_gateway_session_connections` | gauge | open session WebSockets |
//! | `kruntimes_gateway_session_wakes_total{result}` | counter | calls to an auto-suspended session that asked a worker to wake it (answered 503 `SessionWaking`): `woken`, `not_wakeable` (the marker was gone), `failed` (the worker could not be asked) |
//! | `kruntimes_gateway_session_connections_rejected_total` | counter | WebSocket opens refused with 429 by the connection limit |
//! | `kruntimes_gateway_session_connection_limit` | gauge | the configured WebSocket connection limit |

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::authz::Authorizer;

/// The content type of [`Metrics::encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The route label of a request that matched no route.
pub const UNMATCHED_ROUTE: &str = "unmatched";

/// The labels of `http_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The route template, e.g. `/v1/namespaces/{ns}/runs/{name}/logs`, or
    /// [`UNMATCHED_ROUTE`]; never a concrete path, so that the label set stays bounded.
    pub route: String,
    pub code: u16,
}

/// The labels of the invocation metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InvocationLabels {
    pub result: &'static str,
}

/// The labels of the session call counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SessionCallLabels {
    /// One of a fixed set of names, never client input.
    pub call: &'static str,
    pub code: u16,
}

/// The buckets of the invocation duration histogram: 100 µs to about 100 s.
fn invocation_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.0001, 2.5, 16)
}

/// The gateway's counters and gauges, and the registry that encodes them.
pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub in_flight: Gauge,
    pub rejected: Counter,
    pub log_bytes: Counter,
    pub log_streams_failed: Counter,
    pub log_streams_revoked: Counter,
    pub waiting_for_start: Gauge,
    pub invocations: Family<InvocationLabels, Counter>,
    pub invocation_seconds: Family<InvocationLabels, Histogram>,
    pub invocations_in_flight: Gauge,
    pub session_calls: Family<SessionCallLabels, Counter>,
    pub session_events: Counter,
    pub session_connections: Gauge,
    pub session_connections_rejected: Counter,
    pub session_wakes: Family<InvocationLabels, Counter>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// Registers every metric; the authorizer's cache counters are read at each scrape.
    pub fn new(
        authorizer: Arc<Authorizer>,
        concurrency_limit: usize,
        session_connection_limit: usize,
    ) -> Metrics {
        let mut registry = Registry::with_prefix("kruntimes_gateway");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "http_requests",
            "Answered HTTP requests, by route template and status code",
            requests.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "http_requests_in_flight",
            "/v1/ requests holding an admission permit, streaming responses included",
            in_flight.clone(),
        );
        let rejected = Counter::default();
        registry.register(
            "http_requests_rejected",
            "/v1/ requests refused with 429 because the concurrency limit was reached",
            rejected.clone(),
        );
        let limit = Gauge::<i64>::default();
        limit.set(i64::try_from(concurrency_limit).unwrap_or(i64::MAX));
        registry.register(
            "http_concurrency_limit",
            "How many /v1/ requests may be in flight at once",
            limit,
        );
        let log_bytes = Counter::default();
        registry.register(
            "logs_bytes",
            "Bytes of Run logs proxied from workers to clients",
            log_bytes.clone(),
        );
        let log_streams_failed = Counter::default();
        registry.register(
            "logs_streams_failed",
            "Logs responses cut short because the worker's stream failed midway",
            log_streams_failed.clone(),
        );
        let log_streams_revoked = Counter::default();
        registry.register(
            "logs_streams_revoked",
            "Following logs responses ended because the caller's authorization was revoked",
            log_streams_revoked.clone(),
        );
        let waiting_for_start = Gauge::default();
        registry.register(
            "logs_waiting_for_start",
            "Following logs requests waiting for their Run to start running on a worker",
            waiting_for_start.clone(),
        );
        let invocations = Family::<InvocationLabels, Counter>::default();
        registry.register(
            "invocations",
            "Answered function invocations, by result",
            invocations.clone(),
        );
        let invocation_seconds =
            Family::<InvocationLabels, Histogram>::new_with_constructor(|| {
                Histogram::new(invocation_buckets())
            });
        registry.register(
            "invocation_duration_seconds",
            "Time from an invocation request to its answer, by result",
            invocation_seconds.clone(),
        );
        let invocations_in_flight = Gauge::default();
        registry.register(
            "invocations_in_flight",
            "Function invocations being answered",
            invocations_in_flight.clone(),
        );
        let session_calls = Family::<SessionCallLabels, Counter>::default();
        registry.register(
            "session_calls",
            "Answered session calls, by kind and HTTP status (a WebSocket frame's reply included)",
            session_calls.clone(),
        );
        let session_events = Counter::default();
        registry.register(
            "session_events",
            "Session operation events forwarded to clients",
            session_events.clone(),
        );
        let session_connections = Gauge::default();
        registry.register(
            "session_connections",
            "Open session WebSockets",
            session_connections.clone(),
        );
        let session_connections_rejected = Counter::default();
        registry.register(
            "session_connections_rejected",
            "Session WebSocket opens refused with 429 because the connection limit was reached",
            session_connections_rejected.clone(),
        );
        let session_wakes = Family::<InvocationLabels, Counter>::default();
        registry.register(
            "session_wakes",
            "Calls to an auto-suspended session that asked a worker to wake it, by result",
            session_wakes.clone(),
        );
        let connection_limit = Gauge::<i64>::default();
        connection_limit.set(i64::try_from(session_connection_limit).unwrap_or(i64::MAX));
        registry.register(
            "session_connection_limit",
            "How many session WebSockets may be open at once",
            connection_limit,
        );
        registry.register_collector(Box::new(AuthzCollector(authorizer)));
        Metrics {
            registry,
            requests,
            in_flight,
            rejected,
            log_bytes,
            log_streams_failed,
            log_streams_revoked,
            waiting_for_start,
            invocations,
            invocation_seconds,
            invocations_in_flight,
            session_calls,
            session_events,
            session_connections,
            session_connections_rejected,
            session_wakes,
        }
    }

    /// Counts one wake asked of a worker (`woken`, `not_wakeable`, `failed`).
    pub fn count_wake(&self, result: &'static str) {
        self.session_wakes
            .get_or_create(&InvocationLabels { result })
            .inc();
    }

    /// Counts one answered session call.
    pub fn count_session_call(&self, call: &'static str, code: u16) {
        self.session_calls
            .get_or_create(&SessionCallLabels { call, code })
            .inc();
    }

    /// Counts one answered invocation and its duration.
    pub fn count_invocation(&self, result: &'static str, seconds: f64) {
        let labels = InvocationLabels { result };
        self.invocations.get_or_create(&labels).inc();
        self.invocation_seconds
            .get_or_create(&labels)
            .observe(seconds);
    }

    /// Counts one answered request.
    pub fn count_request(&self, route: &str, code: u16) {
        self.requests
            .get_or_create(&RequestLabels {
                route: route.to_string(),
                code,
            })
            .inc();
    }

    /// The current values in the text format, ending with `# EOF`.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

/// Counts one in a gauge for as long as it lives.
#[derive(Debug)]
pub struct GaugeGuard(Gauge);

impl GaugeGuard {
    pub fn new(gauge: &Gauge) -> GaugeGuard {
        gauge.inc();
        GaugeGuard(gauge.clone())
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Reads [`Authorizer::stats`] at scrape time.
#[derive(Debug)]
struct AuthzCollector(Arc<Authorizer>);

impl Collector for AuthzCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats = self.0.stats();
        let hits = ConstCounter::new(stats.hits);
        hits.encode(encoder.encode_descriptor(
            "authz_cache_hits",
            "Authorizations answered from the cache",
            None,
            hits.metric_type(),
        )?)?;
        let misses = ConstCounter::new(stats.misses);
        misses.encode(encoder.encode_descriptor(
            "authz_cache_misses",
            "Authorizations not answered from the cache (reviewed, or joined a review in flight)",
            None,
            misses.metric_type(),
        )?)?;
        let coalesced = ConstCounter::new(stats.coalesced);
        coalesced.encode(encoder.encode_descriptor(
            "authz_coalesced",
            "Authorizations that joined a review in flight for the same token and Run",
            None,
            coalesced.metric_type(),
        )?)?;
        let invalidations = ConstCounter::new(self.0.generation());
        invalidations.encode(encoder.encode_descriptor(
            "authz_invalidations",
            "Flushes of the authorization cache by revocation watches",
            None,
            invalidations.metric_type(),
        )?)?;
        let entries = ConstGauge::new(i64::try_from(stats.entries).unwrap_or(i64::MAX));
        entries.encode(encoder.encode_descriptor(
            "authz_cache_entries",
            "Authorization successes the cache holds",
            None,
            entries.metric_type(),
        )?)?;
        Ok(())
    }
}
