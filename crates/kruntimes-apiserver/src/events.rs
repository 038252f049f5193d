//! Events: core `v1` Events and `events.k8s.io/v1` Events are two views of one stored kind,
//! as on Kubernetes. An Event written through either API is read through both
//! (`kube::runtime::events::Recorder` writes `events.k8s.io/v1`; `kubectl describe` and
//! `kubectl get events` read core `v1`).
//!
//! This module owns the conversion between the two forms (the store holds the core form),
//! the field selectors of both, and the retention of Events: they are deleted once they have
//! not been seen for [`EVENT_TTL`] (Kubernetes' default `--event-ttl`), and the oldest are
//! deleted beyond [`MAX_EVENTS`], so Events never grow the store without bound. It never
//! decides what an Event says; the components that record them do.

use std::borrow::Cow;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};

use crate::resources::ResourceDef;
use crate::store::{Key, Snapshot, Store, Stored, Write};

/// The store key both Event APIs share.
pub const STORE_KEY: &str = "events";
/// The API group of the newer Event API.
pub const GROUP: &str = "events.k8s.io";

/// An Event not seen for this long is deleted (Kubernetes' default `--event-ttl`).
pub const EVENT_TTL: chrono::Duration = chrono::Duration::hours(1);
/// At most this many Events are kept; beyond it the least recently seen are deleted.
pub const MAX_EVENTS: usize = 10_000;
/// How often expired Events are looked for.
pub const SWEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

/// Core v1 field names and their `events.k8s.io/v1` names.
const RENAMES: [(&str, &str); 7] = [
    ("involvedObject", "regarding"),
    ("message", "note"),
    ("reportingComponent", "reportingController"),
    ("source", "deprecatedSource"),
    ("firstTimestamp", "deprecatedFirstTimestamp"),
    ("lastTimestamp", "deprecatedLastTimestamp"),
    ("count", "deprecatedCount"),
];

/// The `ObjectReference` fields a field selector may name, under `involvedObject.` (core) or
/// `regarding.` (events.k8s.io).
const REFERENCE_FIELDS: [&str; 7] = [
    "kind",
    "namespace",
    "name",
    "uid",
    "apiVersion",
    "resourceVersion",
    "fieldPath",
];

/// Field selectors of core v1 Events, as Kubernetes serves them.
pub const CORE_FIELDS: &[&str] = &[
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
];

/// Field selectors of `events.k8s.io/v1` Events.
pub const V1_FIELDS: &[&str] = &[
    "regarding.kind",
    "regarding.namespace",
    "regarding.name",
    "regarding.uid",
    "regarding.apiVersion",
    "regarding.resourceVersion",
    "regarding.fieldPath",
    "reason",
    "reportingController",
    "type",
];

/// Whether `def` is the `events.k8s.io/v1` view, whose objects are converted.
pub fn converts(def: &ResourceDef) -> bool {
    def.group == GROUP && def.store_key == STORE_KEY
}

fn rename(object: &mut Value, from_to: impl Iterator<Item = (&'static str, &'static str)>) {
    let Some(map) = object.as_object_mut() else {
        return;
    };
    for (from, to) in from_to {
        if let Some(value) = map.remove(from) {
            map.insert(to.to_string(), value);
        }
    }
}

/// The form `def` answers with of a stored (core v1) object.
pub fn present<'a>(def: &ResourceDef, stored: &'a Value) -> Cow<'a, Value> {
    if !converts(def) {
        return Cow::Borrowed(stored);
    }
    let mut object = stored.clone();
    rename(&mut object, RENAMES.into_iter());
    if let Some(map) = object.as_object_mut() {
        map.insert("apiVersion".into(), Value::String(def.api_version()));
        map.insert("kind".into(), Value::String(def.kind.to_string()));
    }
    Cow::Owned(object)
}

/// [`present`] of a stored object, keeping its resourceVersion.
pub fn present_stored(def: &ResourceDef, stored: &Stored) -> Stored {
    match present(def, &stored.object) {
        Cow::Borrowed(_) => stored.clone(),
        Cow::Owned(object) => Stored {
            rv: stored.rv,
            object: Arc::new(object),
        },
    }
}

/// The stored (core v1) form of an object written through `def`.
pub fn to_storage(def: &ResourceDef, mut object: Value) -> Value {
    if !converts(def) {
        return object;
    }
    rename(
        &mut object,
        RENAMES.into_iter().map(|(core, v1)| (v1, core)),
    );
    if let Some(map) = object.as_object_mut() {
        map.insert("apiVersion".into(), Value::String("v1".into()));
        map.insert("kind".into(), Value::String("Event".into()));
    }
    object
}

/// The path in the stored (core v1) form of a selectable Event field of `def`.
pub fn field_path(def: &ResourceDef, field: &str) -> Option<Vec<&'static str>> {
    let core_field = if converts(def) {
        match field {
            "reportingController" => "reportingComponent",
            "reportingComponent" | "source" => return None,
            f if f.starts_with("involvedObject.") => return None,
            f => match f.strip_prefix("regarding.") {
                Some(rest) => return reference_path(rest),
                None => f,
            },
        }
    } else {
        field
    };
    match core_field {
        "reason" => Some(vec!["reason"]),
        "type" => Some(vec!["type"]),
        "reportingComponent" => Some(vec!["reportingComponent"]),
        "source" => Some(vec!["source", "component"]),
        f => reference_path(f.strip_prefix("involvedObject.")?),
    }
}

fn reference_path(field: &str) -> Option<Vec<&'static str>> {
    let field = REFERENCE_FIELDS.into_iter().find(|f| *f == field)?;
    Some(vec!["involvedObject", field])
}

fn time_at(object: &Value, path: &[&str]) -> Option<DateTime<Utc>> {
    let mut cur = object;
    for part in path {
        cur = cur.get(part)?;
    }
    DateTime::parse_from_rfc3339(cur.as_str()?)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// When a stored Event was last seen: the latest of its creation and the times its reporter
/// wrote. A reporter's time in the future counts as `now`, so a wrong clock cannot keep an
/// Event forever.
pub fn last_seen(object: &Value, now: DateTime<Utc>) -> DateTime<Utc> {
    let created = time_at(object, &["metadata", "creationTimestamp"]);
    let reported = [
        &["series", "lastObservedTime"][..],
        &["lastTimestamp"][..],
        &["eventTime"][..],
        &["firstTimestamp"][..],
    ]
    .into_iter()
    .filter_map(|p| time_at(object, p))
    .map(|t| t.min(now));
    created
        .into_iter()
        .chain(reported)
        .max()
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

/// The Events of `snap` to delete at `now`: those not seen for `ttl`, and beyond `max` the
/// least recently seen of the rest.
pub fn expired(
    snap: &Snapshot,
    now: DateTime<Utc>,
    ttl: chrono::Duration,
    max: usize,
) -> Vec<(Key, Stored)> {
    let mut all: Vec<(DateTime<Utc>, &Key, &Stored)> = snap
        .scan(STORE_KEY, None)
        .map(|(k, s)| (last_seen(&s.object, now), k, s))
        .collect();
    all.sort_by_key(|(seen, _, _)| *seen);
    let over = all.len().saturating_sub(max);
    all.into_iter()
        .enumerate()
        .filter(|(i, (seen, _, _))| *i < over || *seen + ttl < now)
        .map(|(_, (_, k, s))| (k.clone(), s.clone()))
        .collect()
}

/// Deletes the Events [`expired`] names. Each delete is conditional on the version that was
/// judged, so an Event that was updated meanwhile is left for the next sweep to judge again.
/// Returns how many were deleted.
pub async fn sweep(store: &Store, now: DateTime<Utc>, ttl: chrono::Duration, max: usize) -> usize {
    let mut deleted = 0;
    for (key, stored) in expired(&store.snapshot(), now, ttl, max) {
        let write = Write::Delete {
            key,
            expected_rv: stored.rv,
            object: (*stored.object).clone(),
        };
        if store.write(write).await.is_ok() {
            deleted += 1;
        }
    }
    deleted
}

/// Sweeps expired Events every [`SWEEP_INTERVAL`] until `shutdown` changes.
pub async fn expire_events(store: Store, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    let mut ticker = tokio::time::interval(SWEEP_INTERVAL);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.changed() => return,
        }
        let deleted = sweep(&store, Utc::now(), EVENT_TTL, MAX_EVENTS).await;
        if deleted > 0 {
            tracing::debug!(deleted, "expired events deleted");
        }
    }
}

/// The cells of an Event's table row (LAST SEEN, TYPE, REASON, OBJECT, MESSAGE) from
/// either form.
pub fn table_fields(object: &Value) -> (Option<String>, String, String, String, String) {
    let s = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or("").to_string();
    let get = |core: &str, v1: &str| object.get(core).or_else(|| object.get(v1));
    let reference = get("involvedObject", "regarding")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_else(Map::new);
    let kind = s(reference.get("kind")).to_lowercase();
    let name = s(reference.get("name"));
    let seen = [
        "/series/lastObservedTime",
        "/lastTimestamp",
        "/deprecatedLastTimestamp",
        "/eventTime",
        "/metadata/creationTimestamp",
    ]
    .into_iter()
    .find_map(|p| object.pointer(p).and_then(Value::as_str))
    .map(str::to_string);
    (
        seen,
        s(object.get("type")),
        s(object.get("reason")),
        format!("{kind}/{name}"),
        s(get("message", "note")),
    )
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::resources;

    fn v1() -> &'static ResourceDef {
        resources::find(GROUP, "v1", "events").expect("events.k8s.io")
    }

    fn core() -> &'static ResourceDef {
        resources::find("", "v1", "events").expect("core events")
    }

    #[test]
    fn the_two_forms_convert_both_ways() {
        let written = json!({
            "apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"name": "e", "namespace": "default"},
            "regarding": {"kind": "Run", "name": "r", "namespace": "default", "uid": "u"},
            "note": "hello", "reason": "Scheduled", "type": "Normal",
            "reportingController": "kruntimes.io/controller", "reportingInstance": "i",
            "eventTime": "2026-01-01T00:00:00.000000Z", "action": "Schedule",
        });
        let stored = to_storage(v1(), written.clone());
        assert_eq!(stored["apiVersion"], "v1");
        assert_eq!(stored["involvedObject"]["name"], "r");
        assert_eq!(stored["message"], "hello");
        assert_eq!(stored["reportingComponent"], "kruntimes.io/controller");
        assert!(stored.get("note").is_none() && stored.get("regarding").is_none());
        assert_eq!(present(v1(), &stored).into_owned(), written);
        assert_eq!(present(core(), &stored).into_owned(), stored);
    }

    #[test]
    fn field_selectors_of_both_apis_name_stored_paths() {
        assert_eq!(
            field_path(core(), "involvedObject.name"),
            Some(vec!["involvedObject", "name"])
        );
        assert_eq!(
            field_path(v1(), "regarding.kind"),
            Some(vec!["involvedObject", "kind"])
        );
        assert_eq!(
            field_path(v1(), "reportingController"),
            Some(vec!["reportingComponent"])
        );
        assert_eq!(
            field_path(core(), "source"),
            Some(vec!["source", "component"])
        );
        assert_eq!(field_path(core(), "involvedObject.nope"), None);
        assert_eq!(field_path(v1(), "involvedObject.name"), None);
    }

    #[test]
    fn last_seen_ignores_a_reporter_clock_in_the_future() {
        let now = DateTime::parse_from_rfc3339("2026-01-01T12:00:00Z")
            .expect("time")
            .with_timezone(&Utc);
        let event = json!({
            "metadata": {"creationTimestamp": "2026-01-01T10:00:00Z"},
            "lastTimestamp": "2030-01-01T00:00:00Z",
        });
        assert_eq!(last_seen(&event, now), now);
        let event = json!({
            "metadata": {"creationTimestamp": "2026-01-01T10:00:00Z"},
            "series": {"count": 2, "lastObservedTime": "2026-01-01T11:30:00.000000Z"},
        });
        assert_eq!(
            last_seen(&event, now),
            DateTime::parse_from_rfc3339("2026-01-01T11:30:00Z").expect("time")
        );
    }

    fn event(name: &str, created: &str) -> (Key, Value) {
        let key = Key {
            resource: Arc::from(STORE_KEY),
            namespace: "default".into(),
            name: name.into(),
        };
        let object = json!({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": "default", "creationTimestamp": created},
        });
        (key, object)
    }

    /// Events would otherwise grow the store without bound: the sweep deletes those not
    /// seen for the TTL and, beyond the cap, the least recently seen; nothing else.
    #[tokio::test]
    async fn the_sweep_deletes_expired_events_and_keeps_the_newest_under_the_cap() {
        let dir = tempfile::tempdir().expect("tempdir");
        let backend =
            crate::store::sqlite::SqliteBackend::open(&dir.path().join("db"), false).expect("open");
        let store = Store::open(backend, 100).expect("store");
        let now = DateTime::parse_from_rfc3339("2026-01-01T12:00:00Z")
            .expect("time")
            .with_timezone(&Utc);
        for (name, created) in [
            ("old", "2026-01-01T10:00:00Z"),
            ("a", "2026-01-01T11:10:00Z"),
            ("b", "2026-01-01T11:20:00Z"),
            ("c", "2026-01-01T11:30:00Z"),
        ] {
            let (key, object) = event(name, created);
            store
                .write(Write::Create { key, object })
                .await
                .expect("create");
        }
        // Not an Event: never swept.
        store
            .write(Write::Create {
                key: Key {
                    resource: Arc::from("pods"),
                    namespace: "default".into(),
                    name: "old".into(),
                },
                object: json!({"metadata": {"name": "old", "creationTimestamp": "2020-01-01T00:00:00Z"}}),
            })
            .await
            .expect("create pod");
        assert_eq!(sweep(&store, now, EVENT_TTL, 2).await, 2);
        let snap = store.snapshot();
        let left: Vec<&str> = snap
            .scan(STORE_KEY, None)
            .map(|(k, _)| k.name.as_str())
            .collect();
        assert_eq!(left, ["b", "c"]);
        assert_eq!(snap.scan("pods", None).count(), 1);
        assert_eq!(sweep(&store, now, EVENT_TTL, 2).await, 0);
    }
}
