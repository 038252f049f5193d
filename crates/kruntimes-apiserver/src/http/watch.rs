//! Watch streams: newline-delimited JSON events from a resourceVersion, without gaps or
//! duplicates, with bookmarks, `timeoutSeconds`, and an in-stream 410 once the requested
//! version has been compacted away.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;

use super::handlers::{Ctx, Filter};
use super::table::{self, IncludeObject};
use crate::error::ApiError;
use crate::resources::ResourceDef;
use crate::store::{Event, EventType, StoreError, Subscription};

/// Watches without `timeoutSeconds` end after this long (the real server uses 30–60 min).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);
/// The longest timeout a client may ask for.
const MAX_TIMEOUT: Duration = Duration::from_secs(3600);
/// How often an idle watch that allows bookmarks gets one.
const BOOKMARK_INTERVAL: Duration = Duration::from_secs(10);
/// Encoded events waiting for a slow client at most.
const STREAM_BUFFER: usize = 256;
/// How long a watch waits for a client that has stopped reading before it ends the stream.
const SEND_STALL: Duration = Duration::from_secs(30);

struct Watcher {
    def: &'static ResourceDef,
    filter: Filter,
    table: Option<IncludeObject>,
    bookmarks: bool,
    tx: mpsc::Sender<Result<Bytes, Infallible>>,
    /// Every event up to here has been considered (sent or filtered out).
    last_rv: u64,
}

impl Watcher {
    fn in_scope(&self, event: &Event) -> bool {
        *event.key.resource == *self.def.store_key
            && self
                .filter
                .namespace
                .as_ref()
                .is_none_or(|ns| *ns == event.key.namespace)
    }

    fn line(&self, kind: &str, object: &Value, encoded: Option<&Bytes>) -> Bytes {
        let mut out = Vec::with_capacity(64 + encoded.map_or(512, Bytes::len));
        out.extend_from_slice(b"{\"type\":\"");
        out.extend_from_slice(kind.as_bytes());
        out.extend_from_slice(b"\",\"object\":");
        match (self.table, encoded) {
            (Some(include), _) => {
                let rv = object
                    .pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                let t = table::table(self.def, std::iter::once(object), &rv, None, include);
                out.extend_from_slice(t.to_string().as_bytes());
            }
            (None, Some(bytes)) => out.extend_from_slice(bytes),
            (None, None) => out.extend_from_slice(object.to_string().as_bytes()),
        }
        out.extend_from_slice(b"}\n");
        Bytes::from(out)
    }

    /// Sends one event if it concerns this watch. Returns false when the client is gone.
    async fn deliver(&mut self, event: &Event) -> bool {
        if event.rv <= self.last_rv {
            return true;
        }
        self.last_rv = event.rv;
        if !self.in_scope(event) {
            return true;
        }
        let now = self.filter.matches(self.def, &event.object);
        let before = event
            .prev
            .as_ref()
            .map(|p| self.filter.matches(self.def, p))
            .unwrap_or(now);
        let kind = match (event.kind, before, now) {
            (EventType::Added, _, true) => EventType::Added,
            // A deletion concerns the watch if the object matched before or after the last
            // change (the final write may also have changed the selected fields).
            (EventType::Deleted, true, _) | (EventType::Deleted, _, true) => EventType::Deleted,
            (EventType::Modified, true, true) => EventType::Modified,
            (EventType::Modified, false, true) => EventType::Added,
            (EventType::Modified, true, false) => EventType::Deleted,
            (EventType::Deleted, false, false)
            | (EventType::Added | EventType::Modified, _, false) => return true,
        };
        let line = if crate::events::converts(self.def) {
            let object = crate::events::present(self.def, &event.object);
            self.line(kind.as_str(), &object, None)
        } else {
            self.line(kind.as_str(), &event.object, Some(event.object_json()))
        };
        self.send(line).await
    }

    /// Queues one line for the client. A client that stops reading for [`SEND_STALL`] with
    /// a full buffer loses the watch (it resumes from its last resourceVersion), so a stuck
    /// client never pins the task past its deadline.
    async fn send(&self, line: Bytes) -> bool {
        match self.tx.try_send(Ok(line)) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Closed(_)) => false,
            Err(mpsc::error::TrySendError::Full(line)) => {
                matches!(
                    tokio::time::timeout(SEND_STALL, self.tx.send(line)).await,
                    Ok(Ok(()))
                )
            }
        }
    }

    async fn bookmark(&self, annotations: Option<Value>) -> bool {
        let mut metadata = json!({"resourceVersion": self.last_rv.to_string()});
        if let Some(a) = annotations {
            metadata["annotations"] = a;
        }
        let object = json!({"kind": self.def.kind, "apiVersion": self.def.api_version(), "metadata": metadata});
        let line = format!("{{\"type\":\"BOOKMARK\",\"object\":{object}}}\n");
        self.send(Bytes::from(line)).await
    }
}

/// The watch's streamed answer; `open` counts it as open until the stream is dropped.
fn stream_response(
    rx: mpsc::Receiver<Result<Bytes, Infallible>>,
    open: super::metrics::WatchGuard,
) -> Response {
    use futures::StreamExt as _;
    let events = ReceiverStream::new(rx).map(move |event| {
        let _open = &open;
        event
    });
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-cache, private"),
        ],
        Body::from_stream(events),
    )
        .into_response()
}

pub async fn watch(ctx: &Ctx<'_>) -> Result<Response, ApiError> {
    let def = ctx.def();
    let filter = Filter::from(ctx)?;
    let query = &ctx.query;
    let bookmarks = query
        .get("allowWatchBookmarks")
        .is_some_and(|v| v == "true");
    let send_initial = query.get("sendInitialEvents").is_some_and(|v| v == "true");
    let timeout = match query
        .get("timeoutSeconds")
        .filter(|t| !t.is_empty() && *t != "0")
    {
        Some(t) => Duration::from_secs(
            t.parse::<u64>()
                .map_err(|_| ApiError::bad_request(format!("invalid timeoutSeconds {t:?}")))?,
        )
        .min(MAX_TIMEOUT),
        None => DEFAULT_TIMEOUT,
    };
    let accept = ctx
        .headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let table = table::wants_table(accept)
        .then(|| IncludeObject::parse(query.get("includeObject").map(String::as_str)));
    let rv_param = query
        .get("resourceVersion")
        .map(String::as_str)
        .unwrap_or("");

    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    let store = &ctx.state.store;
    let (initial, subscription, start_rv) =
        if rv_param.is_empty() || rv_param == "0" || send_initial {
            let (snap, sub) = store.subscribe_with_snapshot();
            let initial: Vec<Arc<Value>> = snap
                .scan(def.store_key, filter.namespace.as_deref())
                .filter(|(_, s)| filter.matches(def, &s.object))
                .map(|(_, s)| crate::events::present_stored(def, s).object)
                .collect();
            (initial, sub, snap.rv)
        } else {
            let rv: u64 = rv_param.parse().map_err(|_| {
                ApiError::bad_request(format!("invalid resourceVersion {rv_param:?}"))
            })?;
            let current = store.snapshot().rv;
            let subscribed = if rv > current {
                // Ahead of this server (it lost its newest changes, or the client talks to
                // another server): the client must relist rather than silently skip events.
                Err(StoreError::Expired {
                    requested: rv,
                    oldest: current,
                })
            } else {
                store.subscribe(rv)
            };
            match subscribed {
                Ok(sub) => (Vec::new(), sub, rv),
                Err(StoreError::Expired { requested, oldest }) => {
                    let message = if requested > oldest {
                        format!(
                            "resource version {requested} is ahead of the server ({oldest}); relist"
                        )
                    } else {
                        format!("too old resource version: {requested} ({oldest})")
                    };
                    let status = ApiError::expired(message).status();
                    let line = format!("{{\"type\":\"ERROR\",\"object\":{status}}}\n");
                    let _ = tx.try_send(Ok(Bytes::from(line)));
                    drop(tx);
                    return Ok(stream_response(rx, ctx.state.metrics.watching()));
                }
                Err(e) => return Err(ApiError::internal("subscribe", &e)),
            }
        };

    let mut watcher = Watcher {
        def,
        filter,
        table,
        bookmarks,
        tx,
        last_rv: start_rv,
    };
    let mut shutdown = ctx.state.shutdown.clone();
    tokio::spawn(async move {
        let Subscription { backlog, mut live } = subscription;
        for object in &initial {
            let line = watcher.line("ADDED", object, None);
            if !watcher.send(line).await {
                return;
            }
        }
        if send_initial
            && watcher.bookmarks
            && !watcher
                .bookmark(Some(json!({"k8s.io/initial-events-end": "true"})))
                .await
        {
            return;
        }
        for event in &backlog {
            if !watcher.deliver(event).await {
                return;
            }
        }
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        let mut ticker = tokio::time::interval(BOOKMARK_INTERVAL);
        ticker.tick().await;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.changed() => return,
                _ = &mut deadline => return,
                _ = watcher.tx.closed() => return,
                received = live.recv() => match received {
                    Ok(event) => {
                        if !watcher.deliver(&event).await {
                            return;
                        }
                    }
                    // Too slow: end the stream; the client resumes from its last version.
                    Err(broadcast::error::RecvError::Lagged(_)) => return,
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = ticker.tick() => {
                    if watcher.bookmarks && !watcher.bookmark(None).await {
                        return;
                    }
                }
            }
        }
    });
    Ok(stream_response(rx, ctx.state.metrics.watching()))
}
