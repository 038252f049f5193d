//! The controller-manager's Prometheus metrics. The binary serves them at `GET /metrics`
//! beside its probes (`kruntimes controller-manager --health-addr`, `kruntimes up
//! --controller-metrics-addr`); no token or payload appears in them.
//!
//! | metric | type | what |
//! | --- | --- | --- |
//! | `kruntimes_session_expired_total` | counter | sessions the idle sweep ended `Timeout/IdleTimeout` ([`crate::idle`]) |

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;

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
