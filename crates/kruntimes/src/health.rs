//! The probe and metrics server of a component command (`kruntimes controller-manager`,
//! and the controller-manager inside `kruntimes up`): plain HTTP on the health address,
//! for a kubelet's probes and a Prometheus scrape, never for callers' requests.
//!
//! - `GET /healthz`: 200 while the process serves at all (a liveness probe: restart it
//!   when this fails);
//! - `GET /readyz`: 200 when the component's dependencies are ready (what that means is
//!   the component's [`Readiness`]), else 503 with the reason;
//! - `GET /metrics`: the component's existing Prometheus registry, in the text format.
//!
//! It serves no token and no payload, and holds no state of its own.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::net::TcpListener;

/// The content type of the Prometheus text format (OpenMetrics, as the registries encode).
const METRICS_CONTENT_TYPE: &str = kruntimes_controller::metrics::CONTENT_TYPE;

/// What `/readyz` answers: `Ok(state)` (200, `ok: state`) or `Err(reason)` (503).
pub type Readiness =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<String, String>> + Send>> + Send + Sync>;

/// Encodes the component's registry for `/metrics`.
pub type Encode = Arc<dyn Fn() -> Result<String, std::fmt::Error> + Send + Sync>;

/// A component's probes.
#[derive(Clone)]
pub struct Probes {
    pub ready: Readiness,
    pub metrics: Encode,
}

/// Binds the health address (a port of 0 picks a free one) and says which it bound.
pub async fn bind(addr: SocketAddr, component: &str) -> anyhow::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("bind the {component}'s health address {addr}"))?;
    let bound = listener
        .local_addr()
        .with_context(|| format!("read the {component}'s health address"))?;
    Ok((listener, bound))
}

/// Serves the probes on `listener` until `stop` completes.
pub async fn serve(
    listener: TcpListener,
    probes: Probes,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(probes))
        .with_graceful_shutdown(stop)
        .await
}

fn router(probes: Probes) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(probes)
}

async fn readyz(State(probes): State<Probes>) -> Response {
    match (probes.ready)().await {
        Ok(state) => (StatusCode::OK, format!("ok: {state}\n")).into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}\n"),
        )
            .into_response(),
    }
}

async fn metrics(State(probes): State<Probes>) -> Response {
    match (probes.metrics)() {
        Ok(text) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
            text,
        )
            .into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "failed to encode the metrics",
        )
            .into_response(),
    }
}

/// `/readyz` of a component that needs the API server: ready when `GET /version` answers
/// within two seconds; `state` says more (for example whether it leads).
pub fn api_reachable(
    client: kube::Client,
    state: impl Fn() -> String + Send + Sync + 'static,
) -> Readiness {
    let state = Arc::new(state);
    Arc::new(move || {
        let client = client.clone();
        let state = state.clone();
        Box::pin(async move {
            match tokio::time::timeout(
                std::time::Duration::from_secs(2),
                client.apiserver_version(),
            )
            .await
            {
                Ok(Ok(_)) => Ok(state()),
                Ok(Err(error)) => Err(format!("the API server did not answer: {error}")),
                Err(_) => Err("the API server did not answer within 2 s".to_string()),
            }
        })
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::*;

    fn probes(ready: Result<&'static str, &'static str>) -> Probes {
        Probes {
            ready: Arc::new(move || {
                Box::pin(async move { ready.map(str::to_string).map_err(str::to_string) })
            }),
            metrics: Arc::new(|| Ok("kruntimes_x_total 1\n# EOF\n".to_string())),
        }
    }

    async fn get(probes: Probes, path: &str) -> (StatusCode, String) {
        let answer = router(probes)
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = answer.status();
        let body = answer.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn readyz_says_why_it_is_not_ready_and_healthz_stays_ok() {
        let (status, body) = get(probes(Err("no API server")), "/readyz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("no API server"), "{body}");
        let (status, _) = get(probes(Err("no API server")), "/healthz").await;
        assert_eq!(status, StatusCode::OK);
        let (status, body) = get(probes(Ok("leading")), "/readyz").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok: leading\n"));
    }

    #[tokio::test]
    async fn metrics_are_the_components_registry() {
        let (status, body) = get(probes(Ok("")), "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.contains("kruntimes_x_total 1"), "{body}");
    }
}
