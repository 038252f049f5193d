//! Owner-reference garbage collection, as a cluster's garbage collector does it with
//! background propagation: an object whose owners (`metadata.ownerReferences`) are all gone
//! is deleted, or marked for deletion when it has finalizers. An owner is gone when no
//! object of its kind and name, with its UID, is stored: one made again under the same
//! name is another object and does not keep the dependents of the first.
//!
//! The collector follows the store's changes. It keeps, for each owner UID, the keys of the
//! objects that name it; a deleted object makes its dependents candidates, and so does an
//! object stored with owner references that changed (it may name an owner that is gone
//! already). Each candidate is decided on the store's current state, never on the event
//! that raised it: the object is read again, its owners are looked up by kind, name and
//! UID, and the delete is conditional on the resourceVersion read. A change in between
//! makes the write conflict, and the decision is made again on the new state.
//!
//! A candidate whose delete conflicts [`TRIES`] times in a row, or that the store fails to
//! write, is decided again [`RETRY_AFTER`] later, whatever else changes meanwhile. A
//! Namespace it collects is marked, as a delete request marks it: the namespace sweeper
//! deletes its content, then it.
//!
//! What a cluster's collector does differently, and what is not done here:
//! - `propagationPolicy: Orphan` is honoured by the delete itself (it removes the owner's
//!   references from its dependents first, see the handlers), not with an `orphan`
//!   finalizer: a dependent created in between, naming the owner, is collected.
//! - `propagationPolicy: Foreground` deletes the owner first, as `Background` does.
//! - An owner reference of a kind this server does not store, or one a cluster rejects (a
//!   cluster-scoped object owned by a namespaced kind), never makes its object collectable.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use serde_json::Value;
use tokio::sync::broadcast::error::RecvError;

use crate::resources::RESOURCES;
use crate::store::{EventType, Key, Snapshot, Store, StoreError, Stored, Write};

/// How many times in a row a candidate is decided again when its delete conflicts, before
/// it waits for [`RETRY_AFTER`].
const TRIES: usize = 4;

/// How long a candidate that could not be decided (its delete conflicted [`TRIES`] times,
/// or the store failed) waits before it is decided again, whatever else changes.
const RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// One owner reference, as the collector needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Owner {
    api_version: String,
    kind: String,
    name: String,
    uid: String,
}

/// The owner references of a stored object (those without a UID or a name are ignored).
fn owners(object: &Value) -> Vec<Owner> {
    let Some(references) = object
        .pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
    else {
        return Vec::new();
    };
    references
        .iter()
        .filter_map(|r| {
            let field = |name: &str| r.get(name).and_then(Value::as_str).map(str::to_owned);
            Some(Owner {
                api_version: field("apiVersion").unwrap_or_default(),
                kind: field("kind")?,
                name: field("name").filter(|n| !n.is_empty())?,
                uid: field("uid").filter(|u| !u.is_empty())?,
            })
        })
        .collect()
}

/// Whether `owner` of the object at `dependent` is stored. `None` when that cannot be told:
/// a kind this server does not store, or a reference a cluster rejects (a cluster-scoped
/// object owned by a namespaced kind).
fn owner_present(snap: &Snapshot, dependent: &Key, owner: &Owner) -> Option<bool> {
    let group = owner
        .api_version
        .rsplit_once('/')
        .map_or("", |(group, _)| group);
    let def = RESOURCES
        .iter()
        .find(|r| !r.virtual_kind && r.kind == owner.kind && r.group == group)?;
    let namespace = if def.namespaced {
        if dependent.namespace.is_empty() {
            return None;
        }
        dependent.namespace.clone()
    } else {
        String::new()
    };
    let key = Key {
        resource: Arc::from(def.store_key),
        namespace,
        name: owner.name.clone(),
    };
    Some(snap.objects.get(&key).is_some_and(|stored| {
        stored
            .object
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            == Some(owner.uid.as_str())
    }))
}

/// The object at `key` as stored now, when it is to be collected: it has owners, every one
/// of them is gone, and it is not being deleted already.
fn collectable(snap: &Snapshot, key: &Key) -> Option<Stored> {
    let stored = snap.objects.get(key)?;
    if stored
        .object
        .pointer("/metadata/deletionTimestamp")
        .is_some()
    {
        return None;
    }
    let owners = owners(&stored.object);
    if owners.is_empty() {
        return None;
    }
    for owner in &owners {
        match owner_present(snap, key, owner) {
            Some(false) => {}
            Some(true) | None => return None,
        }
    }
    Some(stored.clone())
}

/// Which objects name which owners, from the changes seen so far.
#[derive(Default)]
struct Graph {
    /// Owner UID → the keys of the objects that name it.
    dependents: HashMap<String, BTreeSet<Key>>,
    /// Key → the owner UIDs its object names.
    owners_of: HashMap<Key, Vec<String>>,
}

impl Graph {
    fn from_snapshot(snap: &Snapshot) -> Graph {
        let mut graph = Graph::default();
        for (key, stored) in snap.objects.iter() {
            graph.set(key, &stored.object);
        }
        graph
    }

    /// Records what the object at `key` names now; whether that changed.
    fn set(&mut self, key: &Key, object: &Value) -> bool {
        let now: Vec<String> = owners(object).into_iter().map(|o| o.uid).collect();
        let before = self.owners_of.get(key).cloned().unwrap_or_default();
        if now == before {
            return false;
        }
        self.forget(key);
        if !now.is_empty() {
            for uid in &now {
                self.dependents
                    .entry(uid.clone())
                    .or_default()
                    .insert(key.clone());
            }
            self.owners_of.insert(key.clone(), now);
        }
        true
    }

    /// Drops what the object at `key` named.
    fn forget(&mut self, key: &Key) {
        for uid in self.owners_of.remove(key).unwrap_or_default() {
            if let Some(keys) = self.dependents.get_mut(&uid) {
                keys.remove(key);
                if keys.is_empty() {
                    self.dependents.remove(&uid);
                }
            }
        }
    }

    /// The objects that name `uid`.
    fn dependents_of(&self, uid: &str) -> Vec<Key> {
        self.dependents
            .get(uid)
            .map(|keys| keys.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Every object that names an owner.
    fn all_dependents(&self) -> Vec<Key> {
        self.owners_of.keys().cloned().collect()
    }
}

/// The write that deletes `stored` at `key` as a delete request would: removed at once, or
/// marked (`deletionTimestamp`) when finalizers hold it. A Namespace is always marked: the
/// namespace sweeper deletes its content, then it. Conditional on its resourceVersion.
pub(crate) fn deletion(key: Key, stored: &Stored) -> Write {
    let has_finalizers = stored
        .object
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .is_some_and(|f| !f.is_empty());
    if !has_finalizers && &*key.resource != "namespaces" {
        return Write::Delete {
            key,
            expected_rv: stored.rv,
            object: (*stored.object).clone(),
        };
    }
    let mut next = (*stored.object).clone();
    if let Some(meta) = next.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert(
            "deletionTimestamp".into(),
            serde_json::json!(
                chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            ),
        );
        meta.insert("deletionGracePeriodSeconds".into(), serde_json::json!(0));
    }
    if &*key.resource == "namespaces" {
        next["status"] = serde_json::json!({"phase": "Terminating"});
    }
    Write::Update {
        key,
        expected_rv: stored.rv,
        object: next,
    }
}

/// Whether a candidate was decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decided {
    /// Collected, or not collectable on the current state.
    Yes,
    /// Its delete kept conflicting, or the store failed: decide it again later.
    Later,
}

/// Collects `key` if it is collectable on the store's current state; a conflict decides
/// again on the next state.
async fn collect_one(store: &Store, key: &Key) -> Decided {
    for _ in 0..TRIES {
        let Some(stored) = collectable(&store.snapshot(), key) else {
            return Decided::Yes;
        };
        match store.write(deletion(key.clone(), &stored)).await {
            Ok(_) => {
                tracing::debug!(resource = %key.resource, namespace = %key.namespace, name = %key.name, "collected: every owner is gone");
                return Decided::Yes;
            }
            Err(StoreError::Conflict { .. }) => continue,
            Err(StoreError::NotFound) => return Decided::Yes,
            Err(e) => {
                tracing::warn!(resource = %key.resource, name = %key.name, error = %e, "garbage collection failed; tried again shortly");
                return Decided::Later;
            }
        }
    }
    Decided::Later
}

/// The candidates left for later, and when they are due: [`RETRY_AFTER`] after the first
/// of them was left, however many changes arrive meanwhile.
#[derive(Default)]
struct Later {
    keys: BTreeSet<Key>,
    due: Option<tokio::time::Instant>,
}

impl Later {
    fn add(&mut self, key: Key) {
        self.keys.insert(key);
        self.due
            .get_or_insert_with(|| tokio::time::Instant::now() + RETRY_AFTER);
    }

    /// The keys, once due (the timer starts again with the next key left).
    fn take(&mut self) -> BTreeSet<Key> {
        self.due = None;
        std::mem::take(&mut self.keys)
    }
}

/// Decides each of `keys`; those it cannot decide now go into `later`.
async fn collect_all(store: &Store, keys: impl IntoIterator<Item = Key>, later: &mut Later) {
    for key in keys {
        if collect_one(store, &key).await == Decided::Later {
            later.add(key);
        }
    }
}

/// Removes the references to the owner `uid` from every object that names it, so the
/// collector leaves them when the owner goes (a delete with `propagationPolicy: Orphan`).
/// Each write is conditional; a conflict is tried again on the new state, and one that
/// conflicts [`TRIES`] times is the caller's conflict (the owner is not deleted then).
/// A failure halfway leaves the references removed so far removed: unlike a cluster's
/// `orphan` finalizer, the orphaning is not one step.
pub(crate) async fn orphan(store: &Store, uid: &str) -> Result<(), StoreError> {
    let names = |object: &Value| owners(object).iter().any(|o| o.uid == uid);
    let keys: Vec<Key> = store
        .snapshot()
        .objects
        .iter()
        .filter(|(_, stored)| names(&stored.object))
        .map(|(key, _)| key.clone())
        .collect();
    for key in keys {
        // Still naming the owner after every try: the owner must not go (its dependent
        // would be collected); the caller is told, as a conflict.
        rewrite(store, &key, |object| {
            names(object).then(|| {
                let mut next = object.clone();
                drop_owner_references(&mut next, |r| {
                    r.get("uid").and_then(Value::as_str) == Some(uid)
                });
                next
            })
        })
        .await?;
    }
    Ok(())
}

/// Removes from `object` the owner references `drop` picks (the field with them all).
fn drop_owner_references(object: &mut Value, drop: impl Fn(&Value) -> bool) {
    let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) else {
        return;
    };
    let left: Vec<Value> = meta
        .get("ownerReferences")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|r| !drop(r))
        .cloned()
        .collect();
    if left.is_empty() {
        meta.remove("ownerReferences");
    } else {
        meta.insert("ownerReferences".into(), Value::Array(left));
    }
}

/// Writes `change(object)` over the object at `key`, conditional on the resourceVersion
/// read, until it is written, or `change` has nothing to do (`None`), or the object is
/// gone. A conflict reads it again; the last of [`TRIES`] conflicts is returned.
async fn rewrite(
    store: &Store,
    key: &Key,
    change: impl Fn(&Value) -> Option<Value>,
) -> Result<(), StoreError> {
    let mut conflict = None;
    for _ in 0..TRIES {
        let Some(stored) = store.snapshot().objects.get(key).cloned() else {
            return Ok(());
        };
        let Some(next) = change(&stored.object) else {
            return Ok(());
        };
        let write = Write::Update {
            key: key.clone(),
            expected_rv: stored.rv,
            object: next,
        };
        match store.write(write).await {
            Ok(_) | Err(StoreError::NotFound) => return Ok(()),
            Err(e @ StoreError::Conflict { .. }) => conflict = Some(e),
            Err(e) => return Err(e),
        }
    }
    conflict.map_or(Ok(()), Err)
}

/// The suspend Snapshot `object` without its owner references of kind Run, pinned to that
/// Run's UID instead; `None` when it has none. Suspend Snapshots written before they lost
/// their owner reference carry one, which would let the collector take one that a fork
/// still starts from once its Run is gone (the controller-manager deletes them instead).
pub(crate) fn unowned_suspend(object: &Value) -> Option<Value> {
    if object.pointer("/spec/reason").and_then(Value::as_str) != Some("Suspend") {
        return None;
    }
    let owner = owners(object).into_iter().find(|o| o.kind == "Run")?;
    let mut next = object.clone();
    if next.pointer("/spec/source/run/uid").is_none()
        && let Some(run) = next
            .pointer_mut("/spec/source/run")
            .and_then(Value::as_object_mut)
    {
        run.insert("uid".into(), Value::String(owner.uid));
    }
    drop_owner_references(&mut next, |r| {
        r.get("kind").and_then(Value::as_str) == Some("Run")
    });
    Some(next)
}

/// Runs the collector until the store closes or `shutdown` says so.
pub(crate) async fn run(store: Store, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    // Candidates to decide again after RETRY_AFTER; kept across a restart from the state.
    let mut later = Later::default();
    loop {
        // A graph and a subscription taken together: nothing falls between them.
        let (snap, subscription) = store.subscribe_with_snapshot();
        let mut graph = Graph::from_snapshot(&snap);
        collect_all(&store, graph.all_dependents(), &mut later).await;
        let mut live = subscription.live;
        let mut backlog = subscription.backlog.into_iter();
        loop {
            let event = match backlog.next() {
                Some(event) => event,
                None => tokio::select! {
                    received = live.recv() => match received {
                        Ok(event) => event,
                        // Fell behind: start again from the current state.
                        Err(RecvError::Lagged(_)) => break,
                        Err(RecvError::Closed) => return,
                    },
                    () = tokio::time::sleep_until(later.due.unwrap_or_else(tokio::time::Instant::now)),
                        if later.due.is_some() =>
                    {
                        let keys = later.take();
                        collect_all(&store, keys, &mut later).await;
                        continue;
                    }
                    _ = shutdown.changed() => return,
                },
            };
            let candidates = match event.kind {
                EventType::Deleted => {
                    graph.forget(&event.key);
                    event
                        .object
                        .pointer("/metadata/uid")
                        .and_then(Value::as_str)
                        .map(|uid| graph.dependents_of(uid))
                        .unwrap_or_default()
                }
                EventType::Added | EventType::Modified => {
                    if graph.set(&event.key, &event.object) {
                        vec![event.key.clone()]
                    } else {
                        Vec::new()
                    }
                }
            };
            collect_all(&store, candidates, &mut later).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key(resource: &str, namespace: &str, name: &str) -> Key {
        Key {
            resource: Arc::from(resource),
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    fn stored(object: Value) -> Stored {
        Stored {
            rv: 1,
            object: Arc::new(object),
        }
    }

    fn snapshot(objects: Vec<(Key, Value)>) -> Snapshot {
        Snapshot {
            rv: 1,
            objects: objects.into_iter().map(|(k, o)| (k, stored(o))).collect(),
        }
    }

    fn owned_by(kind: &str, api_version: &str, name: &str, uid: &str) -> Value {
        json!({"metadata": {"name": "d", "uid": "d-uid", "ownerReferences": [
            {"apiVersion": api_version, "kind": kind, "name": name, "uid": uid}
        ]}})
    }

    #[test]
    fn an_object_is_collected_only_when_every_owner_is_gone() {
        let run = key("runs.kruntimes.io", "default", "r");
        let dependent = key("snapshots.kruntimes.io", "default", "d");
        let owner = json!({"metadata": {"name": "r", "uid": "r-1"}});
        let by_run = owned_by("Run", "kruntimes.io/v1alpha1", "r", "r-1");

        // Its owner is there: kept.
        let snap = snapshot(vec![
            (run.clone(), owner.clone()),
            (dependent.clone(), by_run.clone()),
        ]);
        assert!(collectable(&snap, &dependent).is_none());
        // Gone: collected.
        let snap = snapshot(vec![(dependent.clone(), by_run.clone())]);
        assert!(collectable(&snap, &dependent).is_some());
        // Made again under its name: another object, which does not keep it.
        let again = json!({"metadata": {"name": "r", "uid": "r-2"}});
        let snap = snapshot(vec![
            (run.clone(), again),
            (dependent.clone(), by_run.clone()),
        ]);
        assert!(collectable(&snap, &dependent).is_some());
        // The same name in another namespace is not its owner either.
        let elsewhere = key("runs.kruntimes.io", "other", "r");
        let snap = snapshot(vec![
            (elsewhere, owner.clone()),
            (dependent.clone(), by_run),
        ]);
        assert!(collectable(&snap, &dependent).is_some());

        // Two owners: kept while one of them is there.
        let two = json!({"metadata": {"name": "d", "ownerReferences": [
            {"apiVersion": "kruntimes.io/v1alpha1", "kind": "Run", "name": "r", "uid": "r-1"},
            {"apiVersion": "v1", "kind": "Namespace", "name": "default", "uid": "ns-1"},
        ]}});
        let namespace = key("namespaces", "", "default");
        let snap = snapshot(vec![
            (
                namespace,
                json!({"metadata": {"name": "default", "uid": "ns-1"}}),
            ),
            (dependent.clone(), two.clone()),
        ]);
        assert!(collectable(&snap, &dependent).is_none());
        let snap = snapshot(vec![(dependent.clone(), two)]);
        assert!(collectable(&snap, &dependent).is_some());
    }

    #[test]
    fn references_that_cannot_be_resolved_keep_their_object() {
        let dependent = key("snapshots.kruntimes.io", "default", "d");
        // A kind this server does not store.
        let unknown = owned_by("Widget", "example.com/v1", "w", "w-1");
        let snap = snapshot(vec![(dependent.clone(), unknown)]);
        assert!(collectable(&snap, &dependent).is_none());
        // A cluster-scoped object owned by a namespaced kind (a cluster rejects it).
        let binding = key("clusterrolebindings.rbac.authorization.k8s.io", "", "b");
        let by_run = owned_by("Run", "kruntimes.io/v1alpha1", "r", "r-1");
        let snap = snapshot(vec![(binding.clone(), by_run)]);
        assert!(collectable(&snap, &binding).is_none());
        // Already being deleted (its finalizers hold it): left to them.
        let mut marked = owned_by("Run", "kruntimes.io/v1alpha1", "r", "r-1");
        marked["metadata"]["deletionTimestamp"] = json!("2026-12-07T00:00:00Z");
        let snap = snapshot(vec![(dependent.clone(), marked)]);
        assert!(collectable(&snap, &dependent).is_none());
        // No owners at all.
        let snap = snapshot(vec![(
            dependent.clone(),
            json!({"metadata": {"name": "d"}}),
        )]);
        assert!(collectable(&snap, &dependent).is_none());
    }

    #[test]
    fn the_graph_follows_what_each_object_names() {
        let mut graph = Graph::default();
        let a = key("snapshots.kruntimes.io", "default", "a");
        let b = key("snapshots.kruntimes.io", "default", "b");
        assert!(graph.set(&a, &owned_by("Run", "kruntimes.io/v1alpha1", "r", "u1")));
        assert!(!graph.set(&a, &owned_by("Run", "kruntimes.io/v1alpha1", "r", "u1")));
        assert!(graph.set(&b, &owned_by("Run", "kruntimes.io/v1alpha1", "r", "u1")));
        assert_eq!(graph.dependents_of("u1"), vec![a.clone(), b.clone()]);
        // b now names another owner; a is deleted.
        assert!(graph.set(&b, &owned_by("Run", "kruntimes.io/v1alpha1", "s", "u2")));
        graph.forget(&a);
        assert!(graph.dependents_of("u1").is_empty());
        assert_eq!(graph.dependents_of("u2"), vec![b.clone()]);
        assert_eq!(graph.all_dependents(), vec![b.clone()]);
        // Its references removed: nothing left.
        assert!(graph.set(&b, &json!({"metadata": {"name": "b"}})));
        assert!(graph.all_dependents().is_empty() && graph.dependents.is_empty());
    }

    #[test]
    fn a_finalized_object_is_marked_not_removed() {
        let k = key("runs.kruntimes.io", "default", "r");
        let plain = stored(json!({"metadata": {"name": "r"}}));
        assert!(matches!(
            deletion(k.clone(), &plain),
            Write::Delete { expected_rv: 1, .. }
        ));
        let held = stored(json!({"metadata": {"name": "r", "finalizers": ["x"]}}));
        match deletion(k, &held) {
            Write::Update {
                object,
                expected_rv: 1,
                ..
            } => {
                assert!(object.pointer("/metadata/deletionTimestamp").is_some());
                assert_eq!(object["metadata"]["finalizers"], json!(["x"]));
            }
            other => panic!("{other:?}"),
        }
        // A Namespace is marked even without finalizers: the sweeper deletes its content
        // first, then it.
        let namespace = key("namespaces", "", "ns");
        let empty = stored(json!({"metadata": {"name": "ns"}}));
        match deletion(namespace, &empty) {
            Write::Update { object, .. } => {
                assert!(object.pointer("/metadata/deletionTimestamp").is_some());
                assert_eq!(object["status"]["phase"], json!("Terminating"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_suspend_snapshot_that_names_its_run_as_owner_is_pinned_instead() {
        let by_run = json!({
            "metadata": {"name": "r-s1", "ownerReferences": [
                {"apiVersion": "kruntimes.io/v1alpha1", "kind": "Run", "name": "r", "uid": "r-1"},
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "c", "uid": "c-1"},
            ]},
            "spec": {"source": {"run": {"name": "r"}}, "reason": "Suspend"},
        });
        let next = unowned_suspend(&by_run).expect("rewritten");
        assert_eq!(next.pointer("/spec/source/run/uid"), Some(&json!("r-1")));
        let kinds: Vec<String> = owners(&next).into_iter().map(|o| o.kind).collect();
        assert_eq!(kinds, vec!["ConfigMap"]);
        assert!(unowned_suspend(&next).is_none());
        // A pinned UID is kept; a checkpoint or a commit is left alone.
        let mut pinned = by_run.clone();
        pinned["spec"]["source"]["run"]["uid"] = json!("r-0");
        let next = unowned_suspend(&pinned).expect("rewritten");
        assert_eq!(next.pointer("/spec/source/run/uid"), Some(&json!("r-0")));
        let mut checkpoint = by_run;
        checkpoint["spec"]["reason"] = json!("Checkpoint");
        assert!(unowned_suspend(&checkpoint).is_none());
    }

    #[test]
    fn candidates_left_for_later_are_due_once_after_the_first_was_left() {
        let mut later = Later::default();
        assert!(later.due.is_none());
        later.add(key("configmaps", "default", "a"));
        let due = later.due.expect("due once a key is left");
        // A second key does not push the first one's time back.
        later.add(key("configmaps", "default", "b"));
        assert_eq!(later.due, Some(due));
        assert_eq!(later.take().len(), 2);
        assert!(later.due.is_none() && later.keys.is_empty());
    }
}
