//! The API server's metrics, served at `GET /metrics` (to callers allowed `get` on that
//! non-resource URL, as on Kubernetes: `cluster-admin`, or the `system:monitoring` role)
//! in the Prometheus text format. The names follow kube-apiserver's, so dashboards made
//! for it read these too.
//!
//! | metric | type | what |
//! | --- | --- | --- |
//! | `apiserver_request_total{verb,resource,code}` | counter | answered requests, by verb (`get`, `list`, `watch`, `create`, ...), resource (`runs`, `runs/status`, ...; a fixed name for other paths) and HTTP status |
//! | `apiserver_request_duration_seconds{verb,resource}` | histogram | time to the answer's head, watches excluded |
//! | `apiserver_longrunning_requests{verb}` | gauge | watches open now |
//! | `apiserver_storage_objects{resource}` | gauge | objects stored, by resource, read at each scrape |
//! | `apiserver_current_resource_version` | gauge | the store's resourceVersion, read at each scrape |

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::routes::Route;
use crate::store::Store;

/// The content type of [`Metrics::encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The subresources named in the `resource` label; any other is counted as `other`, so
/// that a client's path cannot grow the label set.
const KNOWN_SUBRESOURCES: &[&str] = &["status", "scale", "log", "token"];

/// The labels of `apiserver_request_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub verb: &'static str,
    pub resource: Cow<'static, str>,
    pub code: u16,
}

/// The labels of `apiserver_request_duration_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DurationLabels {
    pub verb: &'static str,
    pub resource: Cow<'static, str>,
}

/// The labels of `apiserver_longrunning_requests`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerbLabels {
    pub verb: &'static str,
}

/// What one request is, for its labels: never a raw path or client string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestKind {
    pub verb: &'static str,
    /// Borrowed for a resource without subresource and for other paths.
    pub resource: Cow<'static, str>,
}

impl RequestKind {
    /// The labels of a request to `route` (`None`: no such path) with `verb`.
    pub fn of(route: Option<&Route>, verb: &'static str) -> RequestKind {
        let resource: Cow<'static, str> = match route {
            Some(Route::Resource(path)) => match path.subresource.as_deref() {
                None => Cow::Borrowed(path.def.plural),
                Some(sub) if KNOWN_SUBRESOURCES.contains(&sub) => {
                    Cow::Owned(format!("{}/{sub}", path.def.plural))
                }
                Some(_) => Cow::Owned(format!("{}/other", path.def.plural)),
            },
            Some(Route::Health) => Cow::Borrowed("healthz"),
            Some(Route::Version) => Cow::Borrowed("version"),
            Some(Route::Metrics) => Cow::Borrowed("metrics"),
            Some(
                Route::CoreVersions | Route::Groups | Route::Group(_) | Route::ResourceList { .. },
            ) => Cow::Borrowed("discovery"),
            Some(Route::OpenApiV3Index | Route::OpenApiV3 { .. } | Route::OpenApiV2) => {
                Cow::Borrowed("openapi")
            }
            None => Cow::Borrowed("unmatched"),
        };
        RequestKind { verb, resource }
    }
}

/// The buckets of the request duration histogram: 250 µs to about 60 s.
fn duration_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.00025, 2.5, 14)
}

/// The API server's metrics and the registry that encodes them.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    durations: Family<DurationLabels, Histogram>,
    longrunning: Family<VerbLabels, Gauge>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// Registers every metric; the storage gauges read `store` at each scrape.
    pub fn new(store: Store) -> Metrics {
        let mut registry = Registry::with_prefix("apiserver");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "request",
            "Answered requests, by verb, resource and HTTP status",
            requests.clone(),
        );
        let durations = Family::<DurationLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(duration_buckets())
        });
        registry.register(
            "request_duration_seconds",
            "Time to the answer's head, by verb and resource (watches excluded)",
            durations.clone(),
        );
        let longrunning = Family::<VerbLabels, Gauge>::default();
        registry.register(
            "longrunning_requests",
            "Long-running requests (watches) open now",
            longrunning.clone(),
        );
        registry.register_collector(Box::new(StorageCollector(store)));
        Metrics {
            registry,
            requests,
            durations,
            longrunning,
        }
    }

    /// Counts one answered request of `kind` with `code`, taken `elapsed` to its head.
    pub fn record(&self, kind: &RequestKind, code: u16, elapsed: Duration) {
        self.requests
            .get_or_create(&RequestLabels {
                verb: kind.verb,
                resource: kind.resource.clone(),
                code,
            })
            .inc();
        if kind.verb != "watch" {
            self.durations
                .get_or_create(&DurationLabels {
                    verb: kind.verb,
                    resource: kind.resource.clone(),
                })
                .observe(elapsed.as_secs_f64());
        }
    }

    /// Counts one open watch for as long as the guard lives.
    pub fn watching(&self) -> WatchGuard {
        let gauge = self
            .longrunning
            .get_or_create(&VerbLabels { verb: "watch" })
            .clone();
        gauge.inc();
        WatchGuard(gauge)
    }

    /// The metrics in the Prometheus text format.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

/// One open watch, counted until dropped.
#[derive(Debug)]
pub struct WatchGuard(Gauge);

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Reads the object counts and the resourceVersion from the store's current snapshot.
struct StorageCollector(Store);

impl std::fmt::Debug for StorageCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StorageCollector").finish_non_exhaustive()
    }
}

impl Collector for StorageCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let snapshot = self.0.snapshot();
        let mut counts: BTreeMap<&str, i64> = BTreeMap::new();
        for key in snapshot.objects.keys() {
            *counts.entry(&key.resource).or_default() += 1;
        }
        let mut family = encoder.encode_descriptor(
            "storage_objects",
            "Objects stored, by resource",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (resource, count) in counts {
            let gauge = ConstGauge::new(count);
            gauge.encode(family.encode_family(&[("resource", resource)])?)?;
        }
        let rv = ConstGauge::new(i64::try_from(snapshot.rv).unwrap_or(i64::MAX));
        rv.encode(encoder.encode_descriptor(
            "current_resource_version",
            "The store's resourceVersion",
            None,
            rv.metric_type(),
        )?)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unmatched_path_is_counted_under_a_fixed_name() {
        assert_eq!(
            RequestKind::of(None, "get"),
            RequestKind {
                verb: "get",
                resource: Cow::Borrowed("unmatched")
            }
        );
        assert_eq!(
            RequestKind::of(Some(&Route::Health), "get").resource,
            "healthz"
        );
        // A subresource the client made up is counted as `other`, never by its name.
        let kind = |path: &str| RequestKind::of(super::super::routes::parse(path).as_ref(), "get");
        assert_eq!(
            kind("/api/v1/namespaces/a/pods/p/status").resource,
            "pods/status"
        );
        assert_eq!(
            kind("/api/v1/namespaces/a/pods/p/made-up").resource,
            "pods/other"
        );
        assert_eq!(kind("/api/v1/namespaces/a/pods").resource, "pods");
    }
}
