//! The controller-manager's Prometheus metrics. The binary serves them at `GET /metrics`
//! beside its probes (`kruntimes controller-manager --health-addr`, `kruntimes up
//! --controller-metrics-addr`); no token or payload appears in them.
//!
//! | metric | type | what |
//! | --- | --- | --- |
//! | `kruntimes_session_expired_total` | counter | sessions the idle sweep ended `Timeout/IdleTimeout` ([`crate::idle`]) |
//! | `kruntimes_snapshot_gc_pending` | gauge | unreferenced snapshot data sets of the last successful discovery ([`crate::snapshot_gc`]); absent before the first one and on a standby replica |
//! | `kruntimes_snapshot_gc_duration_seconds{stage,error_type}` | histogram | each discovery (`stage="discovery"`) and each deletion (`"collection"`); `error_type` (`api`, `transport`, `invalid`) only on failure |

use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The stage of a snapshot data collection attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GcStage {
    Discovery,
    Collection,
}

impl GcStage {
    fn label(self) -> &'static str {
        match self {
            GcStage::Discovery => "discovery",
            GcStage::Collection => "collection",
        }
    }
}

/// Labels of the duration histogram: `stage`, and `error_type` only on failure.
type GcLabels = Vec<(&'static str, &'static str)>;

/// `kruntimes_snapshot_gc_pending`: encoded only once a discovery has set it.
#[derive(Debug, Default)]
struct Pending(Mutex<Option<i64>>);

impl prometheus_client::collector::Collector for Pending {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let value = *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(value) = value else {
            return Ok(());
        };
        let metric = encoder.encode_descriptor(
            "snapshot_gc_pending",
            "Unreferenced snapshot data sets found by the last successful discovery",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(value).encode(metric)
    }
}

/// The content type of the text format.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Every metric of one controller-manager; it outlives leadership terms.
pub struct Metrics {
    registry: Registry,
    session_expired: Counter,
    gc_pending: Arc<Pending>,
    gc_seconds: Family<GcLabels, Histogram>,
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
        let gc_pending = Arc::new(Pending::default());
        registry.register_collector(Box::new(gc_pending.clone()));
        let gc_seconds = Family::<GcLabels, Histogram>::new_with_constructor(|| {
            // 1 ms to about 65 s.
            Histogram::new(exponential_buckets(0.001, 4.0, 9))
        });
        registry.register(
            "snapshot_gc_duration_seconds",
            "Each discovery and each deletion of snapshot data collection",
            gc_seconds.clone(),
        );
        Metrics {
            registry,
            session_expired,
            gc_pending,
            gc_seconds,
        }
    }
}

impl Metrics {
    /// Counts one session ended for idleness.
    pub fn session_expired(&self) {
        self.session_expired.inc();
    }

    /// Sets the unreferenced snapshot data of the last successful discovery; `None` when
    /// this replica stops collecting (absent, never zero).
    pub fn snapshot_gc_pending(&self, pending: Option<i64>) {
        *self
            .gc_pending
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = pending;
    }

    /// Observes one discovery or deletion; `error_type` when it failed.
    pub fn snapshot_gc_observe(
        &self,
        stage: GcStage,
        error_type: Option<&'static str>,
        took: Duration,
    ) {
        let mut labels = vec![("stage", stage.label())];
        labels.extend(error_type.map(|e| ("error_type", e)));
        self.gc_seconds
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    /// The text format, ending with `# EOF`.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
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

    #[test]
    fn the_gc_pending_gauge_is_absent_until_set_and_after_it_is_cleared() {
        let metrics = Metrics::default();
        let text = metrics.encode().unwrap_or_default();
        assert!(!text.contains("snapshot_gc_pending"), "{text}");
        metrics.snapshot_gc_pending(Some(0));
        let text = metrics.encode().unwrap_or_default();
        assert!(text.contains("kruntimes_snapshot_gc_pending 0\n"), "{text}");
        metrics.snapshot_gc_pending(Some(3));
        metrics.snapshot_gc_observe(GcStage::Discovery, None, Duration::from_millis(2));
        metrics.snapshot_gc_observe(GcStage::Collection, Some("transport"), Duration::ZERO);
        let text = metrics.encode().unwrap_or_default();
        assert!(text.contains("kruntimes_snapshot_gc_pending 3\n"), "{text}");
        assert!(
            text.contains("kruntimes_snapshot_gc_duration_seconds_count{stage=\"discovery\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "kruntimes_snapshot_gc_duration_seconds_count{stage=\"collection\",error_type=\"transport\"} 1"
            ),
            "{text}"
        );
        metrics.snapshot_gc_pending(None);
        let text = metrics.encode().unwrap_or_default();
        assert!(!text.contains("snapshot_gc_pending"), "{text}");
    }
}
