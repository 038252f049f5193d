//! The gateway's HTTPS server: TLS (rustls), HTTP/1.1 and HTTP/2 (hyper), routing (axum),
//! admission limits, metrics and graceful shutdown (docs/task-mode.md, "The gateway's HTTP
//! API").
//!
//! Requests pass, from the outside in:
//!
//! 1. the request counter (every route, every answer, 401, 429 and 413 included);
//! 2. the body limit: a `Content-Length` over [`GatewayConfig::max_body_bytes`] is answered
//!    413 without running the handler (for an authenticated caller, a body of at most 8 MiB
//!    that keeps arriving is read and dropped first, so that the client sees the 413 rather
//!    than a broken pipe), and any other body is cut off at the limit when it is read;
//! 3. for `/v1/` routes and the session WebSocket, authentication: the bearer token is
//!    reviewed ([`Authorizer::authenticate`], successes cached like authorizations) before
//!    anything else is spent on the request, so a caller without a valid token gets 401
//!    without a permit, without its body being read and without any Run being looked up;
//! 4. for `/v1/` routes only, admission: a permit from a semaphore of
//!    [`GatewayConfig::max_concurrent`], taken with `try_acquire` (never queued: no permit
//!    means 429 now) and held until the response body has ended, so a following logs
//!    stream holds its permit for as long as it streams. `/healthz`, `/readyz` and
//!    `/metrics` are exempt, so an overloaded gateway still answers probes and scrapes
//!    (`/readyz` is 503 while the API server does not answer, as every request needs it
//!    to authorize its caller);
//! 5. the body is read whole, within [`GatewayConfig::body_read_timeout`] (408 beyond), so
//!    a client that sends its body slowly holds its permit that long at most;
//! 6. the handler.
//!
//! A connection's request headers must arrive within
//! [`GatewayConfig::header_read_timeout`] (HTTP/1.1; hyper closes the connection beyond),
//! and its TLS handshake within ten seconds.
//!
//! The session WebSocket route (`GET …/sessions/{uid}/operations:ws`) is outside step 4:
//! it takes a permit of its own limit, [`GatewayConfig::max_session_connections`], with
//! the same non-blocking 429, and holds it for as long as the socket is open
//! ([`crate::session::ws`]).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use kruntimes_wire::worker::WorkerTls;
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::TlsAcceptor;

use crate::authz::{Authorizer, AuthorizerConfig};
use crate::error::{GatewayError, HttpError};
use crate::invoke;
use crate::logs::{self, WorkerChannels, bearer_token};
use crate::metrics::{self, GaugeGuard, Metrics};
use crate::route::{InvokeRouting, RuntimeCaches};
use crate::session;

/// At most this many `/v1/` requests are in flight per gateway by default
/// (ARCHITECTURE.md, "Limits").
pub const DEFAULT_MAX_CONCURRENT: usize = 128;
/// At most this many session WebSockets are open per gateway by default
/// (docs/session-mode.md, "Limits").
pub const DEFAULT_MAX_SESSION_CONNECTIONS: usize = 1024;
/// Request bodies are at most 1 MiB by default (ARCHITECTURE.md, "Limits").
pub const DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;
/// The default of [`GatewayConfig::max_file_bytes`]: 1 GiB.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 1 << 30;
/// How long a following logs request waits for its Run to start, by default.
pub const DEFAULT_START_WAIT: Duration = Duration::from_secs(60);

/// How long a client may take to send a request's headers, by default.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may take to send a request's body (at most 1 MiB), by default.
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The route of a Run's logs.
pub const LOGS_ROUTE: &str = "/v1/namespaces/{ns}/runs/{name}/logs";

/// A TLS handshake that takes longer than this is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Open connections get this long to finish after shutdown begins; then they are cut.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// A body declared over the limit but at most this long is read and dropped before the 413.
const MAX_DRAIN_BYTES: u64 = 8 * 1024 * 1024;
/// How long reading such a body may take in all, and between two of its frames.
const DRAIN_TIMEOUT_413: Duration = Duration::from_secs(5);
const DRAIN_IDLE_413: Duration = Duration::from_millis(250);
/// After a failed `accept` (for example out of file descriptors), wait this long.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// How long `/readyz` waits for the API server's `/version`.
const READY_API_WAIT: Duration = Duration::from_secs(2);

/// How to run the gateway.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Where to listen; a port of 0 picks a free one ([`Gateway::local_addr`] tells which).
    pub addr: SocketAddr,
    /// The serving certificate and key. Set `alpn_protocols` to `h2` and `http/1.1` to
    /// offer HTTP/2 (`kruntimes_apiserver::tls::prepare` does); without ALPN, clients speak
    /// HTTP/1.1, or HTTP/2 with prior knowledge.
    pub tls: Arc<rustls::ServerConfig>,
    /// The most `/v1/` requests in flight at once; beyond it, 429 at once.
    pub max_concurrent: usize,
    /// The most session WebSockets open at once; beyond it, 429 at once. Open sockets do
    /// not count against `max_concurrent`.
    pub max_session_connections: usize,
    /// The largest request body, in bytes; beyond it, 413.
    pub max_body_bytes: usize,
    /// How long a client may take to send a request's headers (HTTP/1.1), counted from the
    /// first byte of the request; beyond it, the connection is closed.
    pub header_read_timeout: Duration,
    /// How long a client may take to send a request's body once it is admitted; beyond it,
    /// 408 (and its admission permit is free again).
    pub body_read_timeout: Duration,
    /// How the per-Run authorizer caches and waits.
    pub authorizer: AuthorizerConfig,
    /// How long `follow=true` waits for a Run to start running on a worker.
    pub start_wait: Duration,
    /// Which worker an invocation is sent to.
    pub invoke_routing: InvokeRouting,
    /// The gateway's client certificate and key for workers' runtimeds, and the cluster CA
    /// that verifies each worker as its worker identity (mutual TLS). `None` calls workers in
    /// plaintext (with a warning at start); runtimeds that require TLS then refuse it.
    pub worker_tls: Option<WorkerTls>,
    /// The log store the workers write task stdout and stderr to
    /// ([`kruntimes_api::logstore`]; `kruntimes up`: `DATA_DIR/logs`), from which the
    /// gateway serves the logs of a Run whose worker is gone. `None` (a cluster): such logs
    /// are gone with their worker (410).
    pub log_store: Option<std::path::PathBuf>,
    /// The largest whole-file upload (or directory archive) into a session
    /// (`PUT …/files`), in bytes; beyond it, 413 `FileTooLarge`. Such a body is streamed,
    /// outside `max_body_bytes` and `body_read_timeout` (it may pause 30 s at most).
    pub max_file_bytes: u64,
}

impl GatewayConfig {
    /// A configuration with the default limits.
    pub fn new(addr: SocketAddr, tls: Arc<rustls::ServerConfig>) -> GatewayConfig {
        GatewayConfig {
            addr,
            tls,
            max_concurrent: DEFAULT_MAX_CONCURRENT,
            max_session_connections: DEFAULT_MAX_SESSION_CONNECTIONS,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_file_bytes: DEFAULT_MAX_FILE_BYTES,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            body_read_timeout: DEFAULT_BODY_READ_TIMEOUT,
            authorizer: AuthorizerConfig::default(),
            start_wait: DEFAULT_START_WAIT,
            invoke_routing: InvokeRouting::default(),
            worker_tls: None,
            log_store: None,
        }
    }
}

/// What every request shares.
pub(crate) struct AppState {
    /// The gateway's own identity: reads Runs and Pods, asks for reviews.
    pub client: kube::Client,
    pub authorizer: Arc<Authorizer>,
    pub metrics: Arc<Metrics>,
    pub admission: Arc<Semaphore>,
    pub max_concurrent: usize,
    pub session_connections: Arc<Semaphore>,
    pub max_session_connections: usize,
    pub max_body_bytes: usize,
    pub body_read_timeout: Duration,
    pub max_file_bytes: u64,
    pub start_wait: Duration,
    pub workers: WorkerChannels,
    /// The ownership caches of the Runtimes whose Runs were addressed by UID.
    pub runtimes: RuntimeCaches,
    pub invoke_routing: InvokeRouting,
    /// Turns true when the gateway shuts down; open logs streams end then.
    pub shutdown: watch::Receiver<bool>,
    /// [`GatewayConfig::log_store`].
    pub log_store: Option<std::path::PathBuf>,
}

/// A running gateway. Dropping it stops accepting connections; [`Gateway::shutdown`] also
/// waits for open connections to finish.
pub struct Gateway {
    local_addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

impl Gateway {
    /// The address the gateway listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// `https://ADDR:PORT`, for the kubeconfig's `kruntimes.io/gateway` extension.
    pub fn url(&self) -> String {
        format!("https://{}", self.local_addr)
    }

    /// Stops accepting connections, ends open logs streams (their clients see a truncated
    /// body), and waits up to a few seconds for open connections to finish before cutting
    /// them.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        if let Some(task) = self.task.take()
            && let Err(e) = task.await
        {
            tracing::warn!(error = %e, "the gateway's server task failed");
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
    }
}

/// Starts the gateway: binds `config.addr` and serves HTTPS until [`Gateway::shutdown`].
///
/// `client` carries the gateway's own identity (ClusterRole `kruntimes:gateway`: `get`,
/// `list`, `watch` on runs, runtimes and pods; `create` on tokenreviews and
/// subjectaccessreviews).
pub async fn start(client: kube::Client, config: GatewayConfig) -> Result<Gateway, GatewayError> {
    if config.max_concurrent == 0 || config.max_concurrent > Semaphore::MAX_PERMITS {
        return Err(GatewayError::Config(format!(
            "max_concurrent must be 1 to {}, not {}",
            Semaphore::MAX_PERMITS,
            config.max_concurrent
        )));
    }
    if config.max_session_connections == 0
        || config.max_session_connections > Semaphore::MAX_PERMITS
    {
        return Err(GatewayError::Config(format!(
            "max_session_connections must be 1 to {}, not {}",
            Semaphore::MAX_PERMITS,
            config.max_session_connections
        )));
    }
    // Worker TLS material was checked as it was loaded (`WorkerTls::read`, `from_pem`).
    if config.worker_tls.is_none() {
        tracing::warn!(
            "the gateway calls workers' runtimeds without TLS: tokens and authorization \
             decisions cross the network in plaintext and workers are not authenticated"
        );
    }
    let listener = TcpListener::bind(config.addr)
        .await
        .map_err(|source| GatewayError::Bind {
            addr: config.addr,
            source,
        })?;
    let local_addr = listener.local_addr().map_err(|source| GatewayError::Bind {
        addr: config.addr,
        source,
    })?;
    let authorizer = Arc::new(Authorizer::new(client.clone(), config.authorizer.clone()));
    let metrics = Arc::new(Metrics::new(
        authorizer.clone(),
        config.max_concurrent,
        config.max_session_connections,
    ));
    // Fail at start, not at the first scrape, should the registry not encode.
    metrics.encode().map_err(GatewayError::Metrics)?;
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    // Revocations drop cached decisions at once (kruntimes_wire::revocation), until shutdown.
    let mut down = shutdown_rx.clone();
    let revocations =
        kruntimes_wire::revocation::watch_revocations(client.clone(), authorizer.clone());
    tokio::spawn(async move {
        tokio::select! {
            () = revocations => {}
            _ = down.wait_for(|down| *down) => {}
        }
    });
    let state = Arc::new(AppState {
        client,
        authorizer,
        metrics,
        admission: Arc::new(Semaphore::new(config.max_concurrent)),
        max_concurrent: config.max_concurrent,
        session_connections: Arc::new(Semaphore::new(config.max_session_connections)),
        max_session_connections: config.max_session_connections,
        max_body_bytes: config.max_body_bytes,
        body_read_timeout: config.body_read_timeout,
        max_file_bytes: config.max_file_bytes,
        start_wait: config.start_wait,
        workers: WorkerChannels::new(config.worker_tls.clone()),
        runtimes: RuntimeCaches::default(),
        invoke_routing: config.invoke_routing,
        shutdown: shutdown_rx.clone(),
        log_store: config.log_store.clone(),
    });
    let app = router(state);
    let task = tokio::spawn(serve(
        listener,
        config.tls,
        app,
        config.header_read_timeout,
        shutdown_rx,
    ));
    tracing::info!(addr = %local_addr, "gateway listening");
    Ok(Gateway {
        local_addr,
        shutdown: shutdown_tx,
        task: Some(task),
    })
}

fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route(LOGS_ROUTE, get(logs::logs))
        .route(invoke::INVOKE_ROUTE, post(invoke::invoke))
        .route(
            session::SESSION_ROUTE,
            get(session::status).post(session::renew),
        )
        .route(session::OPERATIONS_ROUTE, post(session::send))
        .route(session::OPERATIONS_EXECUTE_ROUTE, post(session::execute))
        .route(session::OPERATION_ROUTE, post(session::cancel))
        .route(
            session::FILES_ROUTE,
            get(session::files).put(session::put_files),
        )
        .route_layer(from_fn_with_state(state.clone(), admit));
    // Limited by its own semaphore instead, for as long as the socket is open.
    let sockets = Router::new().route(
        session::OPERATIONS_WS_ROUTE,
        get(session::ws::operations_ws),
    );
    // Authentication runs before (for v1) admission.
    let callers = v1
        .merge(sockets)
        .route_layer(from_fn_with_state(state.clone(), authenticate));
    Router::new()
        .route("/healthz", get(ok))
        .route("/readyz", get(readyz))
        .route("/metrics", get(serve_metrics))
        .merge(callers)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.max_body_bytes))
        .layer(from_fn_with_state(state.clone(), limit_body))
        .layer(from_fn_with_state(state.clone(), count))
        .layer(axum::middleware::from_fn(invoke::invocation_id))
        .with_state(state)
}

async fn ok() -> &'static str {
    "ok"
}

/// 200 `ok` while the API server answers `GET /version` within [`READY_API_WAIT`]: without
/// it no caller can be authorized and no Run found, so a load balancer should send
/// requests to another replica. Otherwise 503 with the reason.
async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    let reason = match tokio::time::timeout(READY_API_WAIT, state.client.apiserver_version()).await
    {
        Ok(Ok(_)) => return (StatusCode::OK, "ok").into_response(),
        Ok(Err(error)) => format!("the API server did not answer: {error}"),
        Err(_) => format!(
            "the API server did not answer within {} s",
            READY_API_WAIT.as_secs()
        ),
    };
    (
        StatusCode::SERVICE_UNAVAILABLE,
        format!("not ready: {reason}\n"),
    )
        .into_response()
}

async fn serve_metrics(State(state): State<Arc<AppState>>) -> Response {
    match state.metrics.encode() {
        Ok(text) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
            text,
        )
            .into_response(),
        Err(e) => HttpError::internal(format!("failed to encode the metrics: {e}")).into_response(),
    }
}

async fn not_found() -> HttpError {
    HttpError::not_found("no such route")
}

async fn method_not_allowed() -> HttpError {
    HttpError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "MethodNotAllowed",
        "this route does not take that method",
    )
}

/// Counts every answered request by route template and status code.
async fn count(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or(metrics::UNMATCHED_ROUTE, MatchedPath::as_str)
        .to_string();
    let method = request.method().clone();
    let response = next.run(request).await;
    let code = response.status().as_u16();
    state.metrics.count_request(&route, code);
    tracing::debug!(%method, route, code, "request answered");
    response
}

/// Answers 401 unless the request carries a bearer token the API server authenticates,
/// before any other work is done for it (no permit, no body read, no lookup).
async fn authenticate(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let token = match bearer_token(request.headers()) {
        Ok(token) => token.to_string(),
        Err(e) => return e.into_response(),
    };
    match state.authorizer.authenticate(&token).await {
        Ok(_) => next.run(request).await,
        Err(e) => HttpError::from(e).scrubbed(&token).into_response(),
    }
}

/// Whether `request` is a streamed upload (`PUT …/files`): its body is bounded by the
/// handler instead ([`crate::session::transfer`]), after authorization.
fn streamed_upload(request: &Request) -> bool {
    request.method() == axum::http::Method::PUT
        && request
            .extensions()
            .get::<MatchedPath>()
            .is_some_and(|p| p.as_str() == session::FILES_ROUTE)
}

/// Answers 413 for a declared body over the limit, and cuts any other body off there.
async fn limit_body(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    if streamed_upload(&request) {
        return next.run(request).await;
    }
    let limit = state.max_body_bytes;
    let mut declared = request.body().size_hint().lower();
    if let Some(value) = request.headers().get(header::CONTENT_LENGTH) {
        match value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
        {
            Some(length) => declared = declared.max(length),
            None => return HttpError::bad_request("malformed Content-Length").into_response(),
        }
    }
    if declared > u64::try_from(limit).unwrap_or(u64::MAX) {
        // Only an authenticated caller's body is worth reading; anyone else gets the 413
        // on the headers alone.
        let authenticated = match bearer_token(request.headers()) {
            Ok(token) => state.authorizer.authenticate(token).await.is_ok(),
            Err(_) => false,
        };
        if authenticated && declared <= MAX_DRAIN_BYTES {
            // Read and drop the body first, so that a client still sending it sees the 413
            // instead of a broken pipe. Bounded in bytes and time; nothing is kept.
            drain(request.into_body()).await;
        }
        return HttpError::payload_too_large(limit).into_response();
    }
    let request = request.map(|body| Body::new(http_body_util::Limited::new(body, limit)));
    next.run(request).await
}

/// Reads and drops what is left of a refused request's body (at most 8 MiB, 5 s, and
/// 250 ms of silence), so that a client still sending it can read the answer instead of
/// meeting a reset connection.
pub(crate) async fn drain(mut body: Body) {
    let drain = async {
        let mut left = MAX_DRAIN_BYTES;
        // A client that stops sending gets its answer at once.
        while let Ok(Some(Ok(frame))) = tokio::time::timeout(DRAIN_IDLE_413, body.frame()).await {
            let len = frame.data_ref().map_or(0, |d| d.len() as u64);
            left = left.saturating_sub(len);
            if left == 0 {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_TIMEOUT_413, drain).await;
}

/// Admits a `/v1/` request if a permit is free, else answers 429 at once.
async fn admit(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Ok(permit) = state.admission.clone().try_acquire_owned() else {
        state.metrics.rejected.inc();
        tracing::debug!(
            limit = state.max_concurrent,
            "concurrency limit reached; 429"
        );
        return HttpError::too_many_requests(state.max_concurrent).into_response();
    };
    let admitted = Admitted::new(permit, &state.metrics.in_flight);
    if streamed_upload(&request) {
        // The handler streams the body, pausing at most its idle timeout.
        let response = next.run(request).await;
        return response.map(|inner| {
            Body::new(AdmittedBody {
                inner,
                admitted: Some(admitted),
            })
        });
    }
    // Read the body now, bounded in time (and, by limit_body, in bytes), so that a client
    // that sends it slowly cannot keep the permit.
    let (parts, body) = request.into_parts();
    let timeout = state.body_read_timeout;
    let body = match tokio::time::timeout(timeout, body.collect()).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if too_large(&e) => {
            return HttpError::payload_too_large(state.max_body_bytes).into_response();
        }
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "reading a request body failed");
            return HttpError::bad_request("the request body could not be read").into_response();
        }
        Err(_) => {
            tracing::debug!(?timeout, "a request body did not arrive in time; 408");
            return HttpError::request_timeout(timeout).into_response();
        }
    };
    let request = Request::from_parts(parts, Body::from(body));
    // Dropped with the handler if the client goes away first; else moved into the body.
    let response = next.run(request).await;
    response.map(|inner| {
        Body::new(AdmittedBody {
            inner,
            admitted: Some(admitted),
        })
    })
}

/// Whether reading a body failed because it is over the limit ([`limit_body`]).
fn too_large(error: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        if e.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = e.source();
    }
    false
}

/// An admission permit and its share of the in-flight gauge, released together on drop.
struct Admitted {
    _permit: OwnedSemaphorePermit,
    _in_flight: GaugeGuard,
}

impl Admitted {
    fn new(permit: OwnedSemaphorePermit, in_flight: &Gauge) -> Admitted {
        Admitted {
            _permit: permit,
            _in_flight: GaugeGuard::new(in_flight),
        }
    }
}

/// A response body that holds its request's admission until it ends, fails or is dropped.
struct AdmittedBody {
    inner: Body,
    admitted: Option<Admitted>,
}

impl HttpBody for AdmittedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
            self.admitted = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Serves HTTPS on `listener` until `shutdown` turns true, then drains open connections
/// for up to [`DRAIN_TIMEOUT`] and cuts the rest.
async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: Router,
    header_read_timeout: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let acceptor = TlsAcceptor::from(tls);
    // A refused request's client may still be sending its body: read on after closing.
    let lingerers = crate::linger::Lingerers::new();
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (tcp, peer) = match accepted {
                    Ok(pair) => pair,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                let tcp = lingerers.wrap(tcp);
                let acceptor = acceptor.clone();
                let app = app.clone();
                let watcher = graceful.watcher();
                connections.spawn(async move {
                    let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => stream,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake timed out");
                            return;
                        }
                    };
                    let service = TowerToHyperService::new(app);
                    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    builder
                        .http1()
                        .timer(TokioTimer::new())
                        .header_read_timeout(header_read_timeout);
                    let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                    if let Err(e) = watcher.watch(conn.into_owned()).await {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            changed = shutdown.changed() => {
                if changed.is_err() || *shutdown.borrow() {
                    break;
                }
            }
        }
    }
    drop(listener);
    if tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("gateway connections still open after the drain timeout; closing them");
    }
    connections.shutdown().await;
    tracing::info!("gateway stopped");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls() -> Arc<rustls::ServerConfig> {
        // Never used to handshake: start() refuses the configuration before binding.
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let resolver = Arc::new(rustls::server::ResolvesServerCertUsingSni::new());
        match rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
        {
            Ok(builder) => Arc::new(builder.with_no_client_auth().with_cert_resolver(resolver)),
            Err(e) => panic!("a TLS configuration: {e}"),
        }
    }

    #[tokio::test]
    async fn a_concurrency_limit_of_zero_is_refused() {
        let client = kube::Client::new(
            tower::service_fn(|_request: axum::http::Request<kube::client::Body>| async {
                Err::<axum::http::Response<kube::client::Body>, _>(std::io::Error::other("unused"))
            }),
            "default",
        );
        let mut config = GatewayConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)), tls());
        config.max_concurrent = 0;
        match start(client, config).await {
            Err(GatewayError::Config(message)) => {
                assert!(message.contains("max_concurrent"), "{message}")
            }
            other => panic!("expected a configuration error, got {other:?}"),
        }
    }

    #[test]
    fn defaults_follow_the_documented_limits() {
        let config = GatewayConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)), tls());
        assert_eq!(config.max_concurrent, 128);
        assert_eq!(config.max_session_connections, 1024);
        assert_eq!(config.max_body_bytes, 1024 * 1024);
        assert_eq!(config.header_read_timeout, Duration::from_secs(10));
        assert_eq!(config.body_read_timeout, Duration::from_secs(10));
        assert_eq!(config.start_wait, Duration::from_secs(60));
        assert_eq!(config.authorizer, AuthorizerConfig::default());
    }
}
