//! Resource handlers: get, list, watch, create, update, patch, delete and deletecollection,
//! with Kubernetes semantics (see the API contract notes).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use bytes::Bytes;
use rand::Rng;
use serde_json::{Value, json};

use super::routes::ResourcePath;
use super::table::{self, IncludeObject};
use super::{AppState, watch};
use crate::error::{ApiError, Cause};
use crate::kinds::{self, FieldValidation};
use crate::patch::{self, PatchError, PatchKind};
use crate::resources::ResourceDef;
use crate::selectors::{FieldSelector, LabelSelector};
use crate::store::{Key, Snapshot, StoreError, Stored, Write};

/// Query parameters, last value wins.
pub type Query = HashMap<String, String>;

pub fn parse_query(raw: Option<&str>) -> Query {
    raw.map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default()
}

/// Everything a resource handler needs of the request.
pub struct Ctx<'a> {
    pub state: &'a AppState,
    pub path: ResourcePath,
    pub query: Query,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// Who is asking (already authenticated and authorized for this request).
    pub identity: crate::auth::Identity,
}

impl Ctx<'_> {
    pub(super) fn header(&self, name: header::HeaderName) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }
    pub fn def(&self) -> &'static ResourceDef {
        self.path.def
    }
    fn key(&self, name: &str) -> Key {
        Key {
            resource: Arc::from(self.def().store_key),
            namespace: self.path.namespace.clone().unwrap_or_default(),
            name: name.to_string(),
        }
    }
    fn dry_run(&self) -> bool {
        self.query.get("dryRun").is_some_and(|v| v == "All")
    }
}

pub fn json_response(code: StatusCode, value: &Value) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        value.to_string(),
    )
        .into_response()
}

fn object_response(code: StatusCode, ctx: &Ctx<'_>, object: &Value, rv: u64) -> Response {
    if table::wants_table(ctx.header(header::ACCEPT)) {
        let include = IncludeObject::parse(ctx.query.get("includeObject").map(String::as_str));
        let t = table::table(
            ctx.def(),
            std::iter::once(object),
            &rv.to_string(),
            None,
            include,
        );
        return json_response(code, &t);
    }
    json_response(code, object)
}

fn store_error(def: &ResourceDef, name: &str, e: StoreError) -> ApiError {
    match e {
        StoreError::AlreadyExists => ApiError::already_exists(def, name),
        StoreError::NotFound => ApiError::not_found(def, name),
        StoreError::Conflict { .. } => ApiError::conflict(def, name),
        StoreError::Expired { requested, oldest } => {
            ApiError::expired(format!("too old resource version: {requested} ({oldest})"))
        }
        StoreError::Backend(msg) => ApiError::internal("storage failed", &msg),
        StoreError::Closed => ApiError::unavailable("the server is shutting down"),
        StoreError::GuardMissing(namespace) => ApiError::namespace_not_found(&namespace),
    }
}

pub async fn handle(ctx: Ctx<'_>, method: &Method) -> Result<Response, ApiError> {
    let def = ctx.def();
    let sub = ctx.path.subresource.clone();
    if def.virtual_kind {
        return match (method, &ctx.path.name) {
            (&Method::POST, None) => super::reviews::create_review(&ctx).await,
            _ => Err(ApiError::method_not_allowed()),
        };
    }
    match sub.as_deref() {
        None => {}
        Some("status") if def.status_subresource => {}
        Some("scale") if def.scale_subresource() => {
            let Some(name) = ctx.path.name.clone() else {
                return Err(ApiError::path_not_found());
            };
            return super::scale::handle(&ctx, method, &name).await;
        }
        Some("token") if def.token_subresource => {
            return match (method, ctx.path.name.clone()) {
                (&Method::POST, Some(name)) => super::reviews::token_request(&ctx, &name).await,
                _ => Err(ApiError::method_not_allowed()),
            };
        }
        Some(_) => return Err(ApiError::path_not_found()),
    }
    match (method, ctx.path.name.clone()) {
        (&Method::GET, Some(name)) => get(&ctx, &name),
        (&Method::GET, None) => {
            if ctx
                .query
                .get("watch")
                .is_some_and(|w| w == "true" || w == "1")
            {
                watch::watch(&ctx).await
            } else {
                list(&ctx)
            }
        }
        (&Method::POST, None) if def.store_key == crate::auth::ACCESS_TOKENS => {
            super::reviews::create_access_token(&ctx).await
        }
        (&Method::POST, None) => create(&ctx).await,
        (&Method::PUT, Some(name)) => update(&ctx, &name).await,
        (&Method::PATCH, Some(name)) => patch(&ctx, &name).await,
        (&Method::DELETE, Some(name)) => delete(&ctx, &name).await,
        (&Method::DELETE, None) => delete_collection(&ctx).await,
        _ => Err(ApiError::method_not_allowed()),
    }
}

/// Sets the server-owned metadata of a new object: uid, creationTimestamp, generation.
pub fn stamp_new(object: &mut Value) {
    let meta = meta_mut(object);
    for field in SYSTEM_META {
        meta.remove(field);
    }
    meta.remove("managedFields");
    meta.remove("selfLink");
    drop_empty_metadata(meta);
    meta.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
    meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
    meta.insert("generation".into(), json!(1));
}

fn get(ctx: &Ctx<'_>, name: &str) -> Result<Response, ApiError> {
    let snap = ctx.state.store.snapshot();
    let stored = snap
        .objects
        .get(&ctx.key(name))
        .ok_or_else(|| ApiError::not_found(ctx.def(), name))?;
    let stored = presented(ctx, stored);
    Ok(object_response(
        StatusCode::OK,
        ctx,
        &stored.object,
        stored.rv,
    ))
}

/// Metadata fields Kubernetes' `ObjectMeta` omits when empty (`omitempty`).
const OMITTED_WHEN_EMPTY: [&str; 5] = [
    "finalizers",
    "ownerReferences",
    "managedFields",
    "labels",
    "annotations",
];

/// Drops the empty (or null) lists and maps of [`OMITTED_WHEN_EMPTY`] from `meta`, as
/// Kubernetes never stores them. Clients depend on it: kube-runtime's finalizer helper adds
/// the first finalizer with a JSON patch that tests `/metadata/finalizers` against null,
/// which a stored `[]` fails with 422.
pub fn drop_empty_metadata(meta: &mut serde_json::Map<String, Value>) {
    meta.retain(|field, value| {
        !OMITTED_WHEN_EMPTY.contains(&field.as_str())
            || match value {
                Value::Null => false,
                Value::Array(items) => !items.is_empty(),
                Value::Object(map) => !map.is_empty(),
                _ => true,
            }
    });
}

/// A stored object in the form the request's API answers with (see [`crate::events`]).
fn presented(ctx: &Ctx<'_>, stored: &Stored) -> Stored {
    crate::events::present_stored(ctx.def(), stored)
}

/// The form to store of an object written through the request's API.
fn storage_form(ctx: &Ctx<'_>, object: Value) -> Value {
    crate::events::to_storage(ctx.def(), object)
}

/// A versioned, opaque list cursor: the snapshot's resourceVersion and the last key served.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct Cursor {
    v: u8,
    pub rv: u64,
    pub ns: String,
    pub name: String,
}

fn encode_cursor(rv: u64, key: &Key) -> String {
    let cursor = Cursor {
        v: 1,
        rv,
        ns: key.namespace.clone(),
        name: key.name.clone(),
    };
    let json = serde_json::to_vec(&cursor).unwrap_or_default();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json)
}

/// Decodes a `continue` token (pub for the fuzz targets in `fuzz/`).
#[doc(hidden)]
pub fn decode_cursor(token: &str) -> Result<Cursor, ApiError> {
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token.trim_end_matches('='))
        .map_err(|_| ApiError::bad_request("invalid continue token"))?;
    let cursor: Cursor = serde_json::from_slice(&bytes)
        .map_err(|_| ApiError::bad_request("invalid continue token"))?;
    if cursor.v != 1 {
        return Err(ApiError::bad_request("unsupported continue token version"));
    }
    Ok(cursor)
}

/// Parsed selectors of a list or watch.
pub struct Filter {
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
}

impl Filter {
    pub fn from(ctx: &Ctx<'_>) -> Result<Filter, ApiError> {
        let def = ctx.def();
        let labels = LabelSelector::parse(
            ctx.query
                .get("labelSelector")
                .map(String::as_str)
                .unwrap_or(""),
        )
        .map_err(|e| ApiError::bad_request(format!("unable to parse requirement: {e}")))?;
        let fields = FieldSelector::parse(
            ctx.query
                .get("fieldSelector")
                .map(String::as_str)
                .unwrap_or(""),
            |f| def.supports_field(f),
        )
        .map_err(ApiError::bad_request)?;
        Ok(Filter {
            namespace: ctx.path.namespace.clone(),
            labels,
            fields,
        })
    }

    pub fn matches(&self, def: &ResourceDef, object: &Value) -> bool {
        self.labels.matches(object)
            && self
                .fields
                .matches(|f| def.field_value(object, f).map(str::to_string))
    }
}

/// The most stored objects one page of a paged list (`limit` set) examines: a selector that
/// matches few of many objects gets a short page (perhaps empty) with a continue token at
/// the last object examined, rather than a scan of the whole store in one request. The
/// same budget as document 003's inventory pages.
pub const LIST_EXAMINED_PER_PAGE: usize = 10_000;
/// The longest one page of a paged list scans before it returns short, and an unpaged list
/// before it is refused (checked every [`LIST_DEADLINE_EVERY`] objects).
const LIST_PAGE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);
const LIST_DEADLINE_EVERY: usize = 1024;

fn list(ctx: &Ctx<'_>) -> Result<Response, ApiError> {
    let def = ctx.def();
    let filter = Filter::from(ctx)?;
    let limit = match ctx.query.get("limit").filter(|l| !l.is_empty()) {
        None => None,
        Some(l) => match l.parse::<i64>() {
            Ok(n) if n > 0 => Some(n.min(10_000) as usize),
            Ok(_) => None,
            Err(_) => return Err(ApiError::bad_request(format!("invalid limit {l:?}"))),
        },
    };
    let continue_token = ctx.query.get("continue").filter(|c| !c.is_empty());
    let (snap, start_after) = match continue_token {
        Some(token) => {
            let cursor = decode_cursor(token)?;
            let snap = ctx.state.snapshots.get(cursor.rv).ok_or_else(|| {
                ApiError::expired("The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.")
            })?;
            (snap, Some((cursor.ns, cursor.name)))
        }
        None => (ctx.state.store.snapshot(), None),
    };
    let snap = match (
        continue_token,
        ctx.query
            .get("resourceVersion")
            .filter(|r| !r.is_empty() && *r != "0"),
        ctx.query.get("resourceVersionMatch").map(String::as_str),
    ) {
        (None, Some(rv), Some("Exact")) => {
            let rv: u64 = rv
                .parse()
                .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {rv:?}")))?;
            if rv > snap.rv {
                return Err(ApiError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "Timeout",
                    format!("Too large resource version: {rv}, current: {}", snap.rv),
                ));
            }
            ctx.state
                .store
                .snapshot_at(rv)
                .map_err(|e| store_error(def, "", e))?
        }
        (None, Some(rv), _) if rv.parse::<u64>().is_ok_and(|rv| rv > snap.rv) => {
            // A version the server has not reached (NotOlderThan, or a client that saw a
            // newer history than this server kept): never answer with older data.
            return Err(ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "Timeout",
                format!("Too large resource version: {rv}, current: {}", snap.rv),
            ));
        }
        _ => snap,
    };

    let resource: Arc<str> = Arc::from(def.store_key);
    let ns = filter.namespace.clone().unwrap_or_default();
    let lower = Key {
        resource: Arc::clone(&resource),
        namespace: start_after
            .as_ref()
            .map(|(n, _)| n.clone())
            .unwrap_or_else(|| ns.clone()),
        name: start_after
            .as_ref()
            .map(|(_, n)| n.clone())
            .unwrap_or_default(),
    };
    // A pinned name turns the scan into a lookup.
    let pinned = filter.fields.pinned_name().map(str::to_string);
    let mut items: Vec<Stored> = Vec::new();
    let mut next: Option<Key> = None;
    let in_scope = |key: &Key| {
        *key.resource == *def.store_key && (filter.namespace.is_none() || key.namespace == ns)
    };
    let candidates: Box<dyn Iterator<Item = (&Key, &Stored)>> = match (&pinned, &filter.namespace) {
        (Some(name), Some(_)) => {
            let key = Key {
                resource: Arc::clone(&resource),
                namespace: ns.clone(),
                name: name.clone(),
            };
            Box::new(snap.objects.get_key_value(&key).into_iter())
        }
        _ => Box::new(snap.objects.range(lower.clone()..)),
    };
    let mut last_key: Option<&Key> = None;
    let started = std::time::Instant::now();
    let mut examined: usize = 0;
    for (key, stored) in candidates {
        if !in_scope(key) {
            if *key.resource != *def.store_key || filter.namespace.is_some() {
                break;
            }
            continue;
        }
        if start_after.is_some() && *key == lower {
            continue;
        }
        if limit.is_some_and(|limit| items.len() == limit) {
            next = last_key.cloned();
            break;
        }
        // Every list is bounded by what it examines. A paged list's page returns short at
        // its budget, continuing after the object it examined last. An unpaged list is
        // answered whole or not at all: a client that sends no limit reads no continue
        // token, so a short answer would look complete to it. It is refused instead, with
        // nothing partial, and told to page (as document 003's inventory lists are).
        let budget = match limit {
            Some(_) => LIST_EXAMINED_PER_PAGE,
            None => ctx.state.unpaged_list_examined,
        };
        let late = examined % LIST_DEADLINE_EVERY == LIST_DEADLINE_EVERY - 1
            && started.elapsed() >= LIST_PAGE_DEADLINE;
        if examined == budget || late {
            if limit.is_some() {
                next = last_key.cloned();
                break;
            }
            return Err(unpaged_list_refused(def, examined, late));
        }
        examined += 1;
        last_key = Some(key);
        if !filter.matches(def, &stored.object) {
            continue;
        }
        items.push(crate::events::present_stored(def, stored));
    }
    let token = next.map(|key| {
        ctx.state.snapshots.put(&snap);
        encode_cursor(snap.rv, &key)
    });
    let rv = snap.rv.to_string();
    if table::wants_table(ctx.header(header::ACCEPT)) {
        let include = IncludeObject::parse(ctx.query.get("includeObject").map(String::as_str));
        let t = table::table(
            def,
            items.iter().map(|s| &*s.object),
            &rv,
            token.as_deref(),
            include,
        );
        return Ok(json_response(StatusCode::OK, &t));
    }
    let mut out = Vec::with_capacity(256 + items.len() * 512);
    let mut metadata = json!({"resourceVersion": rv});
    if let Some(token) = &token {
        metadata["continue"] = json!(token);
    }
    out.extend_from_slice(
        format!(
            "{{\"kind\":\"{}\",\"apiVersion\":\"{}\",\"metadata\":{},\"items\":[",
            def.list_kind(),
            def.api_version(),
            metadata
        )
        .as_bytes(),
    );
    for (i, stored) in items.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        serde_json::to_writer(&mut out, &*stored.object)
            .map_err(|e| ApiError::internal("failed to encode a list", &e))?;
    }
    out.extend_from_slice(b"]}");
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        Body::from(out),
    )
        .into_response())
}

/// Why an unpaged list stopped: it examined its budget of objects (413) or ran out of time
/// (504). Both tell the client how to get the whole list.
fn unpaged_list_refused(def: &ResourceDef, examined: usize, late: bool) -> ApiError {
    let page = "send limit (for example 500) and follow metadata.continue to read it in pages";
    if late {
        ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "Timeout",
            format!(
                "the list of {} took longer than {} s after examining {examined} objects; {page}",
                def.plural,
                LIST_PAGE_DEADLINE.as_secs()
            ),
        )
    } else {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "RequestEntityTooLarge",
            format!(
                "a list of {} without limit examines at most {examined} objects and this one has more; {page}",
                def.plural
            ),
        )
    }
}

/// Snapshots kept for continue tokens: a bounded, time-limited cache.
#[derive(Default)]
pub struct SnapshotCache {
    entries: std::sync::Mutex<Vec<(Instant, Arc<Snapshot>)>>,
}

const SNAPSHOT_TTL: Duration = Duration::from_secs(300);
const SNAPSHOT_CAPACITY: usize = 64;

impl SnapshotCache {
    pub fn put(&self, snap: &Arc<Snapshot>) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        entries.retain(|(t, _)| now.duration_since(*t) < SNAPSHOT_TTL);
        if let Some(entry) = entries.iter_mut().find(|(_, s)| s.rv == snap.rv) {
            entry.0 = now;
            return;
        }
        if entries.len() >= SNAPSHOT_CAPACITY {
            entries.remove(0);
        }
        entries.push((now, Arc::clone(snap)));
    }

    pub fn get(&self, rv: u64) -> Option<Arc<Snapshot>> {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries
            .iter()
            .find(|(t, s)| s.rv == rv && t.elapsed() < SNAPSHOT_TTL)
            .map(|(_, s)| Arc::clone(s))
    }
}

fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

const GENERATE_ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";

fn generate_suffix() -> String {
    let mut rng = rand::rng();
    (0..5)
        .map(|_| GENERATE_ALPHABET[rng.random_range(0..GENERATE_ALPHABET.len())] as char)
        .collect()
}

/// Runs `decode` on `body`: in place for a small body, on the blocking pool under one of
/// [`super::DECODE_PERMITS`] for a large one, so a CPU-heavy decode never holds an async
/// worker (see [`crate::decode`]).
pub async fn off_runtime<T: Send + 'static>(
    state: &AppState,
    body: &Bytes,
    decode: impl FnOnce(&[u8]) -> T + Send + 'static,
) -> Result<T, ApiError> {
    if body.len() <= crate::decode::INLINE_DECODE {
        return Ok(decode(body));
    }
    let _permit = state
        .decodes
        .acquire()
        .await
        .map_err(|_| ApiError::unavailable("the server is shutting down"))?;
    let body = body.clone();
    tokio::task::spawn_blocking(move || decode(&body))
        .await
        .map_err(|e| ApiError::internal("a body decode failed", &e))
}

/// Decodes the request body as its Content-Type says, into an object ([`decode_body`],
/// off the async workers when the body is large).
pub async fn parse_body(ctx: &Ctx<'_>) -> Result<Value, ApiError> {
    let content_type = ctx.header(header::CONTENT_TYPE).to_string();
    off_runtime(ctx.state, &ctx.body, move |body| {
        decode_body(&content_type, body)
    })
    .await?
}

/// Decodes a request body of `content_type` (protobuf, YAML or JSON) into the JSON object
/// it stands for; what [`parse_body`] does with a request's header and body.
pub fn decode_body(content_type: &str, body: &[u8]) -> Result<Value, ApiError> {
    let media = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let value: Value = if media == "application/vnd.kubernetes.protobuf" {
        crate::protobuf::decode(body).map_err(|e| match e {
            crate::protobuf::ProtobufError::Unsupported(_) => ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "UnsupportedMediaType",
                e.to_string(),
            ),
            other => ApiError::bad_request(other.to_string()),
        })?
    } else if media == "application/yaml" {
        crate::decode::yaml_or_json(body).map_err(|e| ApiError::bad_request(e.to_string()))?
    } else if media == "application/json" || media.is_empty() {
        // No Content-Type is JSON, the first type the server accepts, as in Kubernetes.
        crate::decode::json(body).map_err(|e| ApiError::bad_request(e.to_string()))?
    } else {
        return Err(ApiError::unsupported_body_type(content_type));
    };
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    Ok(value)
}

fn check_type(def: &ResourceDef, object: &Value) -> Result<(), ApiError> {
    if let Some(api_version) = object.get("apiVersion").and_then(Value::as_str)
        && api_version != def.api_version()
    {
        return Err(ApiError::bad_request(format!(
            "the API version in the data ({api_version}) does not match the expected API version ({})",
            def.api_version()
        )));
    }
    if let Some(kind) = object.get("kind").and_then(Value::as_str)
        && kind != def.kind
    {
        return Err(ApiError::bad_request(format!(
            "the kind in the data ({kind}) does not match the expected kind ({})",
            def.kind
        )));
    }
    Ok(())
}

fn meta_mut(object: &mut Value) -> &mut serde_json::Map<String, Value> {
    if !object.get("metadata").is_some_and(Value::is_object) {
        object["metadata"] = json!({});
    }
    match object.get_mut("metadata") {
        Some(Value::Object(map)) => map,
        // Unreachable: set to an object just above.
        _ => unreachable!("metadata was just made an object"),
    }
}

fn check_namespace(ctx: &Ctx<'_>, snap: &Snapshot, creating: bool) -> Result<(), ApiError> {
    let Some(ns) = &ctx.path.namespace else {
        return Ok(());
    };
    let key = Key {
        resource: Arc::from("namespaces"),
        namespace: String::new(),
        name: ns.clone(),
    };
    match snap.objects.get(&key) {
        None => Err(ApiError::namespace_not_found(ns)),
        Some(stored)
            if creating
                && stored
                    .object
                    .pointer("/metadata/deletionTimestamp")
                    .is_some() =>
        {
            Err(ApiError::forbidden(format!(
                "{} is forbidden: unable to create new content in namespace {ns} because it is being terminated",
                ctx.def().qualified()
            )))
        }
        Some(_) => Ok(()),
    }
}

/// RBAC objects may grant only what their author holds (see [`crate::rbac::check_escalation`]).
fn check_escalation(ctx: &Ctx<'_>, snap: &Snapshot, object: &Value) -> Result<(), ApiError> {
    let def = ctx.def();
    if def.group != "rbac.authorization.k8s.io" {
        return Ok(());
    }
    let namespace = ctx.path.namespace.as_deref().unwrap_or("");
    crate::rbac::check_escalation(snap, &ctx.identity, def.kind, namespace, object).map_err(
        |reason| {
            let name = object
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or("");
            ApiError::forbidden(format!(
                "{} \"{name}\" is forbidden: {reason}",
                def.qualified()
            ))
        },
    )
}

/// Object names, validated per kind as Kubernetes does: RBAC names are path segments (so
/// `system:discovery` is valid), namespace names DNS labels, all others DNS subdomains.
fn validate_name(def: &ResourceDef, name: &str) -> Result<(), ApiError> {
    use kruntimes_api::admission::{is_dns1123_label, is_dns1123_subdomain};
    let problem = if def.group == "rbac.authorization.k8s.io" {
        (name.is_empty()
            || name == "."
            || name == ".."
            || name.contains('/')
            || name.contains('%')
            || name.len() > 253)
            .then_some("may not be empty, '.' or '..', nor contain '/' or '%'")
    } else if def.group.is_empty() && def.kind == "Namespace" {
        (!is_dns1123_label(name)).then_some(
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character",
        )
    } else {
        (!is_dns1123_subdomain(name)).then_some(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
        )
    };
    match problem {
        None => Ok(()),
        Some(message) => Err(ApiError::invalid(
            def,
            name,
            vec![Cause {
                reason: "FieldValueInvalid".into(),
                message: message.into(),
                field: "metadata.name".into(),
            }],
        )),
    }
}

/// Fields the server owns in metadata.
const SYSTEM_META: [&str; 6] = [
    "uid",
    "creationTimestamp",
    "generation",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "resourceVersion",
];

async fn create(ctx: &Ctx<'_>) -> Result<Response, ApiError> {
    let def = ctx.def();
    if def.store_key == crate::auth::ACCESS_TOKENS {
        // Tokens are issued only by POST, which checks who may be impersonated and chooses
        // the digest itself; never through apply or any other generic create.
        return Err(ApiError::method_not_allowed());
    }
    let mut object = parse_body(ctx).await?;
    check_type(def, &object)?;
    let validation = FieldValidation::parse(ctx.query.get("fieldValidation").map(String::as_str));
    kinds::check_fields(def, &mut object, validation)?;
    object["apiVersion"] = json!(def.api_version());
    object["kind"] = json!(def.kind);
    if def.status_subresource
        && let Some(map) = object.as_object_mut()
    {
        map.remove("status");
    }
    if def.kind == "Namespace" && def.group.is_empty() {
        object["status"] = json!({"phase": "Active"});
    }
    let path_ns = ctx.path.namespace.clone();
    let meta = meta_mut(&mut object);
    if def.namespaced {
        let Some(ns) = path_ns.clone() else {
            return Err(ApiError::method_not_allowed());
        };
        match meta.get("namespace").and_then(Value::as_str) {
            Some(body_ns) if !body_ns.is_empty() && body_ns != ns => {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            _ => {}
        }
        meta.insert("namespace".into(), json!(ns));
    } else {
        meta.remove("namespace");
    }
    stamp_new(&mut object);
    let meta = meta_mut(&mut object);
    let explicit = meta
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .map(str::to_string);
    let prefix = meta
        .get("generateName")
        .and_then(Value::as_str)
        .map(str::to_string);
    let name_for_errors = explicit
        .clone()
        .or_else(|| prefix.clone())
        .unwrap_or_default();
    if explicit.is_none() && prefix.as_deref().is_none_or(str::is_empty) {
        return Err(ApiError::invalid(
            def,
            "",
            vec![Cause {
                reason: "FieldValueRequired".into(),
                message: "name or generateName is required".into(),
                field: "metadata.name".into(),
            }],
        ));
    }

    kinds::admit_create(def, &name_for_errors, &object)?;
    {
        let snap = ctx.state.store.snapshot();
        check_namespace(ctx, &snap, true)?;
        check_escalation(ctx, &snap, &object)?;
    }

    let attempts = if explicit.is_some() { 1 } else { 8 };
    for _ in 0..attempts {
        let name = match (&explicit, &prefix) {
            (Some(name), _) => name.clone(),
            (None, Some(prefix)) => format!("{prefix}{}", generate_suffix()),
            (None, None) => unreachable!("checked above"),
        };
        validate_name(def, &name)?;
        meta_mut(&mut object).insert("name".into(), json!(name));
        if ctx.dry_run() {
            // A dry run answers as the real create would, conflicts included.
            if ctx
                .state
                .store
                .snapshot()
                .objects
                .contains_key(&ctx.key(&name))
            {
                if explicit.is_none() {
                    continue;
                }
                return Err(ApiError::already_exists(def, &name));
            }
            return Ok(object_response(StatusCode::CREATED, ctx, &object, 0));
        }
        let write = match &ctx.path.namespace {
            Some(ns) => Write::CreateGuarded {
                key: ctx.key(&name),
                object: storage_form(ctx, object.clone()),
                guard: Key {
                    resource: Arc::from("namespaces"),
                    namespace: String::new(),
                    name: ns.clone(),
                },
            },
            None => Write::Create {
                key: ctx.key(&name),
                object: storage_form(ctx, object.clone()),
            },
        };
        match ctx.state.store.write(write).await {
            Ok(stored) => {
                let stored = presented(ctx, &stored);
                return Ok(object_response(
                    StatusCode::CREATED,
                    ctx,
                    &stored.object,
                    stored.rv,
                ));
            }
            Err(StoreError::AlreadyExists) if explicit.is_none() => continue,
            Err(e) => return Err(store_error(def, &name, e)),
        }
    }
    Err(ApiError::new(
        StatusCode::CONFLICT,
        "AlreadyExists",
        "failed to generate a unique name; try again",
    ))
}

fn without(object: &Value, keys: &[&str]) -> Value {
    let mut copy = object.clone();
    if let Some(map) = copy.as_object_mut() {
        for k in keys {
            map.remove(*k);
        }
    }
    copy
}

/// Builds the object to store from the current one and the client's desired one, keeping
/// server-owned fields and the side of spec/status the request may not write.
fn merge_desired(
    def: &ResourceDef,
    current: &Value,
    mut desired: Value,
    status_write: bool,
) -> Value {
    if status_write {
        let mut next = current.clone();
        match desired.get_mut("status").map(Value::take) {
            Some(status) if !status.is_null() => next["status"] = status,
            _ => {
                if let Some(map) = next.as_object_mut() {
                    map.remove("status");
                }
            }
        }
        drop_empty_metadata(meta_mut(&mut next));
        return next;
    }
    desired["apiVersion"] = json!(def.api_version());
    desired["kind"] = json!(def.kind);
    if def.status_subresource {
        match current.get("status") {
            Some(status) => desired["status"] = status.clone(),
            None => {
                if let Some(map) = desired.as_object_mut() {
                    map.remove("status");
                }
            }
        }
    }
    let current_meta = current
        .get("metadata")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let meta = meta_mut(&mut desired);
    for field in SYSTEM_META.iter().chain(["name", "namespace"].iter()) {
        match current_meta.get(*field) {
            Some(v) => {
                meta.insert((*field).to_string(), v.clone());
            }
            None => {
                meta.remove(*field);
            }
        }
    }
    meta.remove("managedFields");
    meta.remove("selfLink");
    drop_empty_metadata(meta);
    // Generation counts changes of everything but metadata and status.
    if without(current, &["metadata", "status"]) != without(&desired, &["metadata", "status"]) {
        let generation = current_meta
            .get("generation")
            .and_then(Value::as_i64)
            .unwrap_or(1);
        meta_mut(&mut desired).insert("generation".into(), json!(generation + 1));
    }
    desired
}

/// The strings of a JSON array (non-strings skipped); empty when it is absent.
pub fn string_list(value: Option<&Value>) -> Vec<String> {
    value
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn finalizers(object: &Value) -> Vec<String> {
    string_list(object.pointer("/metadata/finalizers"))
}

fn is_terminating(object: &Value) -> bool {
    object
        .pointer("/metadata/deletionTimestamp")
        .is_some_and(|v| !v.is_null())
}

/// Validates and writes a replacement of `current` by `next`. A terminating object whose
/// last finalizer is gone is deleted instead.
pub(super) async fn commit_update(
    ctx: &Ctx<'_>,
    name: &str,
    current: &Stored,
    next: Value,
    status_write: bool,
) -> Result<Response, ApiError> {
    let def = ctx.def();
    if let Some(mut errors) = finalizer_errors(&current.object, &next) {
        return Err(ApiError::invalid(def, name, std::mem::take(&mut errors)));
    }
    kinds::admit_update(def, name, &current.object, &next, status_write)?;
    check_escalation(ctx, &ctx.state.store.snapshot(), &next)?;
    if ctx.dry_run() {
        return Ok(object_response(StatusCode::OK, ctx, &next, current.rv));
    }
    if next == *current.object {
        // Nothing changed: Kubernetes answers with the stored object and no new version.
        return Ok(object_response(
            StatusCode::OK,
            ctx,
            &current.object,
            current.rv,
        ));
    }
    let write = if is_terminating(&next) && finalizers(&next).is_empty() {
        Write::Delete {
            key: ctx.key(name),
            expected_rv: current.rv,
            object: storage_form(ctx, next),
        }
    } else {
        Write::Update {
            key: ctx.key(name),
            expected_rv: current.rv,
            object: storage_form(ctx, next),
        }
    };
    let stored = ctx
        .state
        .store
        .write(write)
        .await
        .map_err(|e| store_error(def, name, e))?;
    let stored = presented(ctx, &stored);
    Ok(object_response(
        StatusCode::OK,
        ctx,
        &stored.object,
        stored.rv,
    ))
}

fn finalizer_errors(current: &Value, next: &Value) -> Option<Vec<Cause>> {
    if !is_terminating(current) {
        return None;
    }
    let old = finalizers(current);
    let added: Vec<String> = finalizers(next)
        .into_iter()
        .filter(|f| !old.contains(f))
        .collect();
    if added.is_empty() {
        return None;
    }
    Some(vec![Cause {
        reason: "FieldValueForbidden".into(),
        message: format!(
            "no new finalizers can be added if the object is being deleted, found new finalizers {added:?}"
        ),
        field: "metadata.finalizers".into(),
    }])
}

/// The current object `name`, in the form the request's API answers with.
pub(super) fn load(ctx: &Ctx<'_>, name: &str) -> Result<Stored, ApiError> {
    let snap = ctx.state.store.snapshot();
    snap.objects
        .get(&ctx.key(name))
        .map(|stored| presented(ctx, stored))
        .ok_or_else(|| ApiError::not_found(ctx.def(), name))
}

async fn update(ctx: &Ctx<'_>, name: &str) -> Result<Response, ApiError> {
    let def = ctx.def();
    let mut desired = parse_body(ctx).await?;
    check_type(def, &desired)?;
    let body_name = desired
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    if body_name != name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({body_name}) does not match the name on the URL ({name})"
        )));
    }
    let validation = FieldValidation::parse(ctx.query.get("fieldValidation").map(String::as_str));
    kinds::check_fields(def, &mut desired, validation)?;
    let current = load(ctx, name)?;
    check_uid(def, name, &desired, &current.object)?;
    match desired
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
    {
        Some(rv) if !rv.is_empty() && rv.parse::<u64>().ok() != Some(current.rv) => {
            return Err(ApiError::conflict(def, name));
        }
        Some(rv) if !rv.is_empty() => {}
        _ if !def.group.is_empty() => {
            return Err(ApiError::invalid(
                def,
                name,
                vec![Cause {
                    reason: "FieldValueInvalid".into(),
                    message: "must be specified for an update".into(),
                    field: "metadata.resourceVersion".into(),
                }],
            ));
        }
        _ => {}
    }
    let status_write = ctx.path.subresource.is_some();
    let next = merge_desired(def, &current.object, desired, status_write);
    commit_update(ctx, name, &current, next, status_write).await
}

/// A write whose `metadata.uid` names another object than the one stored under its name
/// (deleted and made again) is refused with 409, as a cluster refuses it: the UID is a
/// precondition there, as the resourceVersion is. No UID in the body sets none.
fn check_uid(
    def: &ResourceDef,
    name: &str,
    desired: &Value,
    current: &Value,
) -> Result<(), ApiError> {
    let uid = |object: &Value| {
        object
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
    };
    match (uid(desired), uid(current)) {
        (Some(want), stored) if Some(&want) != stored.as_ref() => Err(ApiError::precondition(
            def,
            name,
            &format!(
                "Precondition failed: UID in precondition: {}, UID in object meta: {}",
                kruntimes_api::lifecycle::bounded_message(&want),
                stored.unwrap_or_default()
            ),
        )),
        _ => Ok(()),
    }
}

/// An apply body is a whole object of the resource: it names its apiVersion and kind, as
/// server-side apply requires. Anything else (before: any map, even garbage, was merged
/// and answered 200) is refused with 400.
fn check_apply_body(def: &ResourceDef, object: &Value) -> Result<(), ApiError> {
    let field = |name: &str| object.get(name).and_then(Value::as_str).unwrap_or("");
    if field("apiVersion").is_empty() || field("kind").is_empty() {
        return Err(ApiError::bad_request(format!(
            "invalid apply patch: apiVersion and kind must be set (expected {} {})",
            def.api_version(),
            def.kind
        )));
    }
    check_type(def, object)
}

pub(super) fn patch_error(def: &ResourceDef, name: &str, e: PatchError) -> ApiError {
    match e {
        PatchError::Malformed(m) => ApiError::bad_request(m),
        PatchError::TooLarge(m) => {
            ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "RequestEntityTooLarge", m)
        }
        PatchError::Failed(m) => ApiError::invalid(
            def,
            name,
            vec![Cause {
                reason: "FieldValueInvalid".into(),
                message: m,
                field: "patch".into(),
            }],
        ),
    }
}

async fn patch(ctx: &Ctx<'_>, name: &str) -> Result<Response, ApiError> {
    let def = ctx.def();
    let content_type = ctx.header(header::CONTENT_TYPE).to_string();
    let kind = PatchKind::from_content_type(&content_type)
        .ok_or_else(|| ApiError::unsupported_media_type(&content_type))?;
    // Strategic merge is for built-in kinds; custom kinds answer 415, as on a real server.
    if kind == PatchKind::StrategicMerge
        && (def.group == kruntimes_api::GROUP || def.group == "auth.kruntimes.io")
    {
        return Err(ApiError::unsupported_media_type(&content_type));
    }
    let status_write = ctx.path.subresource.is_some();
    let validation = FieldValidation::parse(ctx.query.get("fieldValidation").map(String::as_str));
    let parsed = off_runtime(ctx.state, &ctx.body, move |b| patch::parse(kind, b))
        .await?
        .map_err(|e| patch_error(def, name, e))?;
    if let patch::Parsed::Merge(object) = &parsed
        && kind == PatchKind::Apply
    {
        check_apply_body(def, object)?;
    }
    // A patch carries no precondition unless it sets metadata.resourceVersion; retry on a
    // concurrent change, as the real server does.
    for _ in 0..16 {
        let current = match load(ctx, name) {
            Ok(c) => c,
            Err(_) if kind == PatchKind::Apply && !status_write => {
                return create_from_apply(ctx, name, &parsed).await;
            }
            Err(e) => return Err(e),
        };
        let mut patched = (*current.object).clone();
        // What an older version stored with empty lists is patched as Kubernetes would
        // have stored it, without them.
        drop_empty_metadata(meta_mut(&mut patched));
        patch::apply_parsed(&mut patched, &parsed).map_err(|e| patch_error(def, name, e))?;
        check_type(def, &patched)?;
        kinds::check_fields(def, &mut patched, validation)?;
        if let Some(rv) = patched
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            && rv.parse::<u64>().ok() != Some(current.rv)
        {
            return Err(ApiError::conflict(def, name));
        }
        check_uid(def, name, &patched, &current.object)?;
        if patched.pointer("/metadata/name").and_then(Value::as_str) != Some(name) {
            return Err(ApiError::bad_request(
                "a patch may not change metadata.name",
            ));
        }
        let next = merge_desired(def, &current.object, patched, status_write);
        match commit_update(ctx, name, &current, next, status_write).await {
            Err(e) if e.reason == "Conflict" && e.code == StatusCode::CONFLICT => continue,
            other => return other,
        }
    }
    Err(ApiError::conflict(def, name))
}

async fn create_from_apply(
    ctx: &Ctx<'_>,
    name: &str,
    parsed: &patch::Parsed,
) -> Result<Response, ApiError> {
    let mut object = match parsed {
        patch::Parsed::Merge(object) => object.clone(),
        patch::Parsed::Json(_) => {
            return Err(ApiError::bad_request("an apply patch must be an object"));
        }
    };
    meta_mut(&mut object).insert("name".into(), json!(name));
    let body =
        Bytes::from(serde_json::to_vec(&object).map_err(|e| ApiError::internal("encode", &e))?);
    let mut headers = ctx.headers.clone();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    let inner = Ctx {
        state: ctx.state,
        path: ResourcePath {
            name: None,
            ..ctx.path.clone()
        },
        query: ctx.query.clone(),
        headers,
        body,
        identity: ctx.identity.clone(),
    };
    create(&inner).await
}

#[derive(serde::Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct DeleteOptions {
    #[serde(default)]
    preconditions: Option<Preconditions>,
    #[serde(default)]
    dry_run: Option<Vec<String>>,
    /// `Orphan`, `Background` or `Foreground`.
    #[serde(default)]
    propagation_policy: Option<String>,
    #[serde(default)]
    orphan_dependents: Option<bool>,
}

#[derive(serde::Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Preconditions {
    uid: Option<String>,
    resource_version: Option<String>,
}

fn delete_options(ctx: &Ctx<'_>) -> Result<DeleteOptions, ApiError> {
    let mut options: DeleteOptions = if ctx.body.iter().all(u8::is_ascii_whitespace) {
        DeleteOptions::default()
    } else {
        serde_json::from_slice(&ctx.body)
            .map_err(|e| ApiError::bad_request(format!("invalid DeleteOptions: {e}")))?
    };
    // Clients may give the policy as a query parameter instead.
    if options.propagation_policy.is_none() {
        options.propagation_policy = ctx.query.get("propagationPolicy").cloned();
    }
    if options.orphan_dependents.is_none() {
        options.orphan_dependents = ctx.query.get("orphanDependents").map(|v| v == "true");
    }
    if let Some(bad) = options.dry_run.iter().flatten().find(|v| *v != "All") {
        return Err(ApiError::invalid_dry_run(bad));
    }
    if let Some(policy) = &options.propagation_policy
        && !matches!(policy.as_str(), "Orphan" | "Background" | "Foreground")
    {
        return Err(ApiError::bad_request(format!(
            "invalid DeleteOptions: propagationPolicy {:?} is not one of Orphan, Background, \
             Foreground",
            kruntimes_api::lifecycle::bounded_message(policy)
        )));
    }
    Ok(options)
}

async fn delete(ctx: &Ctx<'_>, name: &str) -> Result<Response, ApiError> {
    let options = delete_options(ctx)?;
    let dry_run = ctx.dry_run()
        || options
            .dry_run
            .as_ref()
            .is_some_and(|d| d.iter().any(|v| v == "All"));
    delete_one(
        ctx,
        name,
        options.preconditions.as_ref(),
        dry_run,
        orphans(&options),
    )
    .await
}

/// Whether the delete leaves the object's dependents (`propagationPolicy: Orphan`, or the
/// older `orphanDependents: true`) rather than letting the garbage collector take them.
/// `Foreground` is served as `Background`: the owner goes first (see `gc`).
fn orphans(options: &DeleteOptions) -> bool {
    match options.propagation_policy.as_deref() {
        Some(policy) => policy == "Orphan",
        None => options.orphan_dependents == Some(true),
    }
}

/// Deletes one object. A concurrent change is not the caller's conflict: the delete is
/// retried on the new state (preconditions are checked again each time), as on a real
/// server.
async fn delete_one(
    ctx: &Ctx<'_>,
    name: &str,
    preconditions: Option<&Preconditions>,
    dry_run: bool,
    orphan: bool,
) -> Result<Response, ApiError> {
    for _ in 0..16 {
        if let Some(response) = delete_attempt(ctx, name, preconditions, dry_run, orphan).await? {
            return Ok(response);
        }
    }
    Err(ApiError::conflict(ctx.def(), name))
}

/// One try of [`delete_one`]; `Ok(None)` when another write got there first.
async fn delete_attempt(
    ctx: &Ctx<'_>,
    name: &str,
    preconditions: Option<&Preconditions>,
    dry_run: bool,
    orphan: bool,
) -> Result<Option<Response>, ApiError> {
    let def = ctx.def();
    let current = load(ctx, name)?;
    if let Some(pre) = preconditions {
        if let Some(uid) = &pre.uid
            && current
                .object
                .pointer("/metadata/uid")
                .and_then(Value::as_str)
                != Some(uid)
        {
            return Err(ApiError::precondition(
                def,
                name,
                &format!(
                    "the UID in the precondition ({uid}) does not match the UID in record. The object might have been deleted and then recreated"
                ),
            ));
        }
        if let Some(rv) = &pre.resource_version
            && rv.parse::<u64>().ok() != Some(current.rv)
        {
            return Err(ApiError::precondition(
                def,
                name,
                &format!(
                    "the ResourceVersion in the precondition ({rv}) does not match the ResourceVersion in record ({}). The object might have been modified",
                    current.rv
                ),
            ));
        }
    }
    // Its dependents stop naming it before it goes, so the collector leaves them.
    if orphan
        && !dry_run
        && let Some(uid) = current
            .object
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
    {
        crate::gc::orphan(&ctx.state.store, uid)
            .await
            .map_err(|e| store_error(def, name, e))?;
    }
    let is_namespace = def.group.is_empty() && def.kind == "Namespace";
    let has_content = is_namespace && namespace_has_content(&ctx.state.store.snapshot(), name);
    if finalizers(&current.object).is_empty() && !has_content {
        if dry_run {
            return Ok(Some(success_status(def, name, &current.object)));
        }
        let write = Write::Delete {
            key: ctx.key(name),
            expected_rv: current.rv,
            object: storage_form(ctx, (*current.object).clone()),
        };
        return match ctx.state.store.write(write).await {
            Ok(_) => Ok(Some(success_status(def, name, &current.object))),
            Err(StoreError::Conflict { .. }) => Ok(None),
            Err(e) => Err(store_error(def, name, e)),
        };
    }
    // Graceful deletion: mark it and let the finalizers (or the namespace sweeper) finish.
    if is_terminating(&current.object) {
        return Ok(Some(object_response(
            StatusCode::OK,
            ctx,
            &current.object,
            current.rv,
        )));
    }
    let mut next = (*current.object).clone();
    let meta = meta_mut(&mut next);
    meta.insert("deletionTimestamp".into(), json!(now_rfc3339()));
    meta.insert("deletionGracePeriodSeconds".into(), json!(0));
    if is_namespace {
        next["status"] = json!({"phase": "Terminating"});
    }
    if dry_run {
        return Ok(Some(object_response(
            StatusCode::OK,
            ctx,
            &next,
            current.rv,
        )));
    }
    let write = Write::Update {
        key: ctx.key(name),
        expected_rv: current.rv,
        object: storage_form(ctx, next),
    };
    let stored = match ctx.state.store.write(write).await {
        Ok(stored) => presented(ctx, &stored),
        Err(StoreError::Conflict { .. }) => return Ok(None),
        Err(e) => return Err(store_error(def, name, e)),
    };
    if is_namespace {
        ctx.state.namespaces_changed.notify_one();
    }
    Ok(Some(object_response(
        StatusCode::OK,
        ctx,
        &stored.object,
        stored.rv,
    )))
}

pub fn namespace_has_content(snap: &Snapshot, namespace: &str) -> bool {
    crate::resources::RESOURCES
        .iter()
        .filter(|r| r.namespaced && !r.virtual_kind)
        .any(|r| snap.scan(r.store_key, Some(namespace)).next().is_some())
}

fn success_status(def: &ResourceDef, name: &str, object: &Value) -> Response {
    let mut details = json!({"name": name, "group": def.group, "kind": def.plural});
    if let Some(uid) = object.pointer("/metadata/uid") {
        details["uid"] = uid.clone();
    }
    json_response(
        StatusCode::OK,
        &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details}),
    )
}

async fn delete_collection(ctx: &Ctx<'_>) -> Result<Response, ApiError> {
    let def = ctx.def();
    let filter = Filter::from(ctx)?;
    let options = delete_options(ctx)?;
    let dry_run = ctx.dry_run()
        || options
            .dry_run
            .as_ref()
            .is_some_and(|d| d.iter().any(|v| v == "All"));
    let snap = ctx.state.store.snapshot();
    let names: Vec<String> = snap
        .scan(def.store_key, filter.namespace.as_deref())
        .filter(|(_, s)| filter.matches(def, &s.object))
        .map(|(k, _)| k.name.clone())
        .collect();
    let mut deleted = Vec::new();
    for name in names {
        match delete_one(ctx, &name, None, dry_run, orphans(&options)).await {
            Ok(_) => deleted.push(name),
            Err(e) if e.code == StatusCode::NOT_FOUND => {}
            Err(e) => return Err(e),
        }
    }
    let list = json!({
        "kind": def.list_kind(),
        "apiVersion": def.api_version(),
        "metadata": {"resourceVersion": ctx.state.store.snapshot().rv.to_string()},
        "items": [],
    });
    let _ = deleted;
    Ok(json_response(StatusCode::OK, &list))
}
