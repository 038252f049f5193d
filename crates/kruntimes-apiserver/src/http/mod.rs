//! The HTTPS front of the API server: TLS, authentication, routing to discovery, OpenAPI
//! and the resource handlers. The one place errors become HTTP responses is
//! [`crate::error::ApiError`]'s `IntoResponse`.

pub mod discovery;
pub mod handlers;
pub mod metrics;
pub mod openapi;
pub mod reviews;
pub mod routes;
pub mod scale;
pub mod table;
pub mod watch;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::auth::{self, Authenticator};
use crate::error::ApiError;
use crate::rbac;
use crate::store::Store;
use handlers::{Ctx, SnapshotCache, json_response};
use routes::Route;

/// Request bodies are at most 3 MiB, as on a real API server.
pub const MAX_BODY: usize = 3 * 1024 * 1024;
/// A TLS handshake that takes longer than this is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Open connections get this long to finish after shutdown begins.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// What every request shares.
pub struct AppState {
    pub store: Store,
    pub auth: Authenticator,
    pub snapshots: SnapshotCache,
    pub shutdown: tokio::sync::watch::Receiver<bool>,
    /// Woken when a namespace starts terminating.
    pub namespaces_changed: tokio::sync::Notify,
    /// Permits for decoding large bodies on the blocking pool ([`DECODE_PERMITS`]).
    pub decodes: tokio::sync::Semaphore,
    /// How long a request body may take to arrive whole.
    pub body_read_timeout: Duration,
    /// The most objects a list without `limit` examines ([`crate::Config::unpaged_list_examined`]).
    pub unpaged_list_examined: usize,
    /// What `GET /metrics` serves.
    pub metrics: metrics::Metrics,
}

/// Large bodies decoded at once. On a small machine one core stays free for everything
/// else however many large (or hostile) bodies arrive; the rest wait their turn without
/// holding a thread.
pub const DECODE_PERMITS: usize = 1;

pub fn router(state: Arc<AppState>) -> Router {
    Router::new().fallback(dispatch).with_state(state)
}

async fn dispatch(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let started = std::time::Instant::now();
    let (parts, body) = request.into_parts();
    let route = routes::parse(parts.uri.path());
    let query = handlers::parse_query(parts.uri.query());
    let verb = verb(route.as_ref(), &parts.method, &query);
    let kind = metrics::RequestKind::of(route.as_ref(), verb);
    let attrs = attributes(route.as_ref(), verb, parts.uri.path());
    let response = match self::route(&state, parts, body, route, query, attrs).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    };
    state
        .metrics
        .record(&kind, response.status().as_u16(), started.elapsed());
    response
}

async fn route(
    state: &AppState,
    parts: axum::http::request::Parts,
    body: Body,
    route: Option<Route>,
    query: handlers::Query,
    attrs: rbac::Attributes,
) -> Result<Response, ApiError> {
    let identity = if matches!(route, Some(Route::Health)) {
        None
    } else {
        let snap = state.store.snapshot();
        let authorization = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        let identity = state
            .auth
            .authenticate(&snap, authorization)
            .ok_or_else(ApiError::unauthorized)?;
        let identity = impersonate(&snap, identity, &parts.headers)?;
        let decision = rbac::authorize(&snap, &identity, &attrs);
        if !decision.allowed {
            tracing::debug!(user = %identity.username, ?attrs, "forbidden");
            return Err(forbidden(&identity, &attrs));
        }
        Some(identity)
    };
    let accept = parts
        .headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let Some(route) = route else {
        return Err(ApiError::path_not_found());
    };
    let get_only = |r: Result<Response, ApiError>| {
        if parts.method == axum::http::Method::GET {
            r
        } else {
            Err(ApiError::method_not_allowed())
        }
    };
    match route {
        Route::Health => get_only(Ok((
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            "ok",
        )
            .into_response())),
        Route::Version => get_only(Ok(json_response(StatusCode::OK, &discovery::version()))),
        Route::Metrics => get_only(
            state
                .metrics
                .encode()
                .map(|text| {
                    (
                        StatusCode::OK,
                        [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
                        text,
                    )
                        .into_response()
                })
                .map_err(|e| ApiError::internal("encode the metrics", &e)),
        ),
        Route::CoreVersions => get_only(Ok(discovery_response(
            discovery::core_versions(discovery::wants_aggregated(accept)),
            accept,
        ))),
        Route::Groups => get_only(Ok(discovery_response(
            discovery::groups(discovery::wants_aggregated(accept)),
            accept,
        ))),
        Route::Group(g) => get_only(
            discovery::group(&g)
                .map(|d| json_response(StatusCode::OK, &d))
                .ok_or_else(ApiError::path_not_found),
        ),
        Route::ResourceList { group, version } => get_only(Ok(json_response(
            StatusCode::OK,
            &discovery::resource_list(&group, &version),
        ))),
        Route::OpenApiV3Index => get_only(Ok(json_response(StatusCode::OK, &openapi::index()))),
        Route::OpenApiV3 { group, version } => get_only(
            openapi::document(&group, &version)
                .map(|(body, _)| {
                    (
                        StatusCode::OK,
                        [(header::CONTENT_TYPE, "application/json")],
                        body.clone(),
                    )
                        .into_response()
                })
                .ok_or_else(ApiError::path_not_found),
        ),
        Route::OpenApiV2 => Err(ApiError::path_not_found()),
        Route::Resource(path) => {
            check_dry_run(&parts.method, parts.uri.query())?;
            let body = read_body(state, &parts.headers, body).await?;
            let ctx = Ctx {
                state,
                path,
                query,
                headers: parts.headers,
                body,
                identity: identity.unwrap_or_else(auth::anonymous),
            };
            handlers::handle(ctx, &parts.method).await
        }
    }
}

/// Refuses a write whose `dryRun` parameters name anything but `All` (every value counts,
/// not only the last), as Kubernetes does; before, `dryRun=Maybe` created the object.
fn check_dry_run(method: &axum::http::Method, query: Option<&str>) -> Result<(), ApiError> {
    use axum::http::Method;
    if !matches!(
        *method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    ) {
        return Ok(());
    }
    let Some(query) = query else {
        return Ok(());
    };
    for (key, value) in form_urlencoded::parse(query.as_bytes()) {
        if key == "dryRun" && value != "All" {
            return Err(ApiError::invalid_dry_run(&value));
        }
    }
    Ok(())
}

/// Reads a request body whole: refused at once when its declared length is over
/// [`MAX_BODY`] (413), and when more than that arrives or it does not arrive whole within
/// [`AppState::body_read_timeout`] (408). Either refusal closes the connection, whose
/// unread rest of a body could not be told from the next request.
async fn read_body(
    state: &AppState,
    headers: &axum::http::HeaderMap,
    body: Body,
) -> Result<bytes::Bytes, ApiError> {
    let closing = |mut e: ApiError| {
        e.close_connection = true;
        e
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .map(|v| v.to_str().ok().and_then(|v| v.trim().parse::<u64>().ok()));
    match declared {
        Some(None) => {
            return Err(closing(ApiError::bad_request(
                "the Content-Length header is not a number",
            )));
        }
        Some(Some(length)) if length > MAX_BODY as u64 => {
            return Err(closing(ApiError::too_large(MAX_BODY)));
        }
        Some(Some(_)) | None => {}
    }
    match tokio::time::timeout(
        state.body_read_timeout,
        axum::body::to_bytes(body, MAX_BODY),
    )
    .await
    {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) if too_large(&e) => Err(closing(ApiError::too_large(MAX_BODY))),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "reading a request body failed");
            Err(closing(ApiError::bad_request(
                "the request body could not be read",
            )))
        }
        Err(_) => Err(closing(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "Timeout",
            format!(
                "the request body did not arrive within {:?}",
                state.body_read_timeout
            ),
        ))),
    }
}

/// Whether reading a body failed because it is over the limit.
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

/// Applies `Impersonate-User`/`Impersonate-Group`/`Impersonate-Uid` (`kubectl --as`), as
/// Kubernetes does: the caller needs the `impersonate` verb on each user, ServiceAccount,
/// group and uid named. Extra fields are not supported and refused.
fn impersonate(
    snap: &crate::store::Snapshot,
    caller: auth::Identity,
    headers: &axum::http::HeaderMap,
) -> Result<auth::Identity, ApiError> {
    let user = headers
        .get("impersonate-user")
        .and_then(|v| v.to_str().ok());
    let groups: Vec<String> = headers
        .get_all("impersonate-group")
        .iter()
        .filter_map(|v| v.to_str().ok().map(str::to_string))
        .collect();
    let uid = headers.get("impersonate-uid").and_then(|v| v.to_str().ok());
    let extra = headers
        .keys()
        .any(|k| k.as_str().starts_with("impersonate-extra-"));
    let Some(user) = user else {
        if !groups.is_empty() || uid.is_some() || extra {
            return Err(ApiError::bad_request(
                "impersonating groups, a uid or extra fields requires impersonating a user",
            ));
        }
        return Ok(caller);
    };
    if extra {
        return Err(ApiError::bad_request(
            "impersonating extra fields is not supported",
        ));
    }
    let check = |group: &str, resource: &str, namespace: &str, name: &str| {
        let attrs = rbac::Attributes::Resource {
            verb: "impersonate".into(),
            group: group.into(),
            resource: resource.into(),
            subresource: String::new(),
            namespace: namespace.into(),
            name: name.into(),
        };
        if rbac::authorize(snap, &caller, &attrs).allowed {
            Ok(())
        } else {
            Err(forbidden(&caller, &attrs))
        }
    };
    let mut identity = match user
        .strip_prefix("system:serviceaccount:")
        .and_then(|r| r.split_once(':'))
    {
        Some((namespace, name)) => {
            check("", "serviceaccounts", namespace, name)?;
            auth::service_account_identity(namespace, name, "")
        }
        None => {
            check("", "users", "", user)?;
            auth::Identity {
                username: user.to_string(),
                uid: String::new(),
                groups: Vec::new(),
            }
        }
    };
    for group in &groups {
        check("", "groups", "", group)?;
        if !identity.groups.contains(group) {
            identity.groups.push(group.clone());
        }
    }
    if let Some(uid) = uid {
        check("authentication.k8s.io", "uids", "", uid)?;
        identity.uid = uid.to_string();
    }
    if !identity.groups.iter().any(|g| g == "system:authenticated") {
        identity.groups.push("system:authenticated".into());
    }
    Ok(identity)
}

/// The verb of a request, in authorization's words: `get`, `list`, `watch`, `create`, ...
/// for resources, the lowercase HTTP method for other paths.
fn verb(
    route: Option<&Route>,
    method: &axum::http::Method,
    query: &handlers::Query,
) -> &'static str {
    use axum::http::Method;
    let Some(Route::Resource(r)) = route else {
        return match *method {
            Method::GET | Method::HEAD => "get",
            Method::POST => "post",
            Method::PUT => "put",
            Method::PATCH => "patch",
            Method::DELETE => "delete",
            _ => "get",
        };
    };
    let watch = query.get("watch").is_some_and(|w| w == "true" || w == "1");
    match (method, r.name.is_some()) {
        (&Method::GET, true) => "get",
        (&Method::GET, false) if watch => "watch",
        (&Method::GET, false) => "list",
        (&Method::POST, _) => "create",
        (&Method::PUT, _) => "update",
        (&Method::PATCH, _) => "patch",
        (&Method::DELETE, true) => "delete",
        (&Method::DELETE, false) => "deletecollection",
        _ => "unknown",
    }
}

/// What a request does, for authorization.
fn attributes(route: Option<&Route>, verb: &'static str, path: &str) -> rbac::Attributes {
    let Some(Route::Resource(r)) = route else {
        return rbac::Attributes::NonResource {
            verb: verb.into(),
            path: path.to_string(),
        };
    };
    rbac::Attributes::Resource {
        verb: verb.into(),
        group: r.def.group.into(),
        resource: r.def.plural.into(),
        subresource: r.subresource.clone().unwrap_or_default(),
        namespace: r.namespace.clone().unwrap_or_default(),
        name: r.name.clone().unwrap_or_default(),
    }
}

fn forbidden(identity: &auth::Identity, attrs: &rbac::Attributes) -> ApiError {
    let mut e = ApiError::forbidden(rbac::forbidden_message(identity, attrs));
    if let rbac::Attributes::Resource {
        group,
        resource,
        name,
        ..
    } = attrs
    {
        e.details = Some(serde_json::json!({"name": name, "group": group, "kind": resource}));
    }
    e
}

fn discovery_response(doc: serde_json::Value, accept: &str) -> Response {
    let content_type = if discovery::wants_aggregated(accept) {
        discovery::AGGREGATED
    } else {
        "application/json"
    };
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, content_type)],
        Body::from(doc.to_string()),
    )
        .into_response()
}

/// Serves HTTPS on `listener` until `shutdown` turns true, then drains open connections.
/// HTTP/1.1 connections that do not send a request's headers within
/// `header_read_timeout` are closed (slowloris).
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: Router,
    header_read_timeout: Duration,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let acceptor = TlsAcceptor::from(tls);
    let graceful = GracefulShutdown::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (tcp, peer) = match accepted {
                    Ok(pair) => pair,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                let acceptor = acceptor.clone();
                let app = app.clone();
                let watcher = graceful.watcher();
                tokio::spawn(async move {
                    let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => stream,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => return,
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
            _ = shutdown.changed() => break,
        }
    }
    drop(listener);
    if tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after the drain timeout; closing them");
    }
}
