//! The object store: every object the API server holds, one monotonic `resourceVersion`
//! sequence, and the change history that watches resume from.
//!
//! State lives in memory as a persistent ordered map ([`im::OrdMap`]), so a snapshot is an
//! O(1) clone: a list and its continue pages read one consistent snapshot. Every change is
//! made durable by a [`Backend`] before it is acknowledged or seen: one writer thread takes
//! batches of conditional writes, checks their preconditions, commits the batch in one
//! transaction, then publishes the new snapshot and the watch events.
//!
//! The store knows nothing of HTTP, admission or kinds beyond the resource key; handlers
//! compute new objects and submit them with the resourceVersion they were based on.

pub mod sqlite;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, RwLock};

use serde_json::Value;
use tokio::sync::{broadcast, oneshot};

/// Where one object lives: its resource (`runs.kruntimes.io`, `pods`), namespace (empty for
/// cluster-scoped kinds) and name. Ordered byte-wise, which gives list order.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    pub resource: Arc<str>,
    pub namespace: String,
    pub name: String,
}

/// A stored object with its resourceVersion.
#[derive(Clone, Debug)]
pub struct Stored {
    pub rv: u64,
    pub object: Arc<Value>,
}

/// One consistent view of every object.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub rv: u64,
    pub objects: im::OrdMap<Key, Stored>,
}

impl Snapshot {
    /// The objects of one resource, in one namespace (or in all, with `None`), in key order.
    pub fn scan<'a>(
        &'a self,
        resource: &'a str,
        namespace: Option<&'a str>,
    ) -> impl Iterator<Item = (&'a Key, &'a Stored)> + 'a {
        let lower = Key {
            resource: Arc::from(resource),
            namespace: namespace.unwrap_or("").to_string(),
            name: String::new(),
        };
        self.objects.range(lower..).take_while(move |(k, _)| {
            &*k.resource == resource && namespace.is_none_or(|ns| k.namespace == ns)
        })
    }
}

/// The kind of a change, as a watch reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One committed change. `object` carries the new resourceVersion (for a delete, the last
/// state stamped with the delete's resourceVersion).
#[derive(Clone, Debug)]
pub struct Event {
    pub rv: u64,
    pub kind: EventType,
    pub key: Key,
    pub object: Arc<Value>,
    /// The state before this change, when known (always, except for history reloaded at
    /// start-up). Watches with selectors use it to report objects that stop matching.
    pub prev: Option<Arc<Value>>,
    /// The object's JSON, encoded once for every watcher.
    pub encoded: std::sync::OnceLock<bytes::Bytes>,
}

impl Event {
    /// The object as JSON bytes, encoded on first use.
    pub fn object_json(&self) -> &bytes::Bytes {
        self.encoded.get_or_init(|| {
            bytes::Bytes::from(serde_json::to_vec(&*self.object).unwrap_or_else(|_| b"{}".to_vec()))
        })
    }
}

/// A conditional write. The object's `metadata.resourceVersion` is set by the store.
#[derive(Debug)]
pub enum Write {
    /// Create; fails with [`StoreError::AlreadyExists`] if the key exists.
    Create { key: Key, object: Value },
    /// Create, only while `guard` exists and is not being deleted (a namespace for the
    /// objects in it); checked atomically with the write.
    CreateGuarded { key: Key, object: Value, guard: Key },
    /// Replace; fails with [`StoreError::Conflict`] unless the stored rv equals `expected_rv`,
    /// or [`StoreError::NotFound`] if the key does not exist.
    Update {
        key: Key,
        expected_rv: u64,
        object: Value,
    },
    /// Delete; same preconditions as update.
    Delete {
        key: Key,
        expected_rv: u64,
        /// The last state to report in the DELETED event.
        object: Value,
    },
}

impl Write {
    fn key(&self) -> &Key {
        match self {
            Write::Create { key, .. }
            | Write::CreateGuarded { key, .. }
            | Write::Update { key, .. }
            | Write::Delete { key, .. } => key,
        }
    }
}

/// Why a write or a read was refused.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("object already exists")]
    AlreadyExists,
    #[error("object not found")]
    NotFound,
    #[error("object was modified (stored resourceVersion {current})")]
    Conflict { current: u64 },
    #[error("too old resource version: {requested} ({oldest})")]
    Expired { requested: u64, oldest: u64 },
    #[error("storage failed: {0}")]
    Backend(String),
    #[error("the store is shutting down")]
    Closed,
    #[error("{0} does not exist or is being deleted")]
    GuardMissing(String),
}

/// The durable side of the store. SQLite today; PostgreSQL can follow behind the same trait.
pub trait Backend: Send + 'static {
    /// Loads every object, the retained history (oldest first) and the current rv.
    fn load(&mut self) -> Result<Loaded, StoreError>;
    /// Commits a batch of committed changes atomically: each event's object replaces (or,
    /// for a delete, removes) the stored one, and the event joins the history.
    fn commit(&mut self, events: &[Event]) -> Result<(), StoreError>;
    /// Forgets history at or below `rv`.
    fn compact(&mut self, rv: u64) -> Result<(), StoreError>;
}

/// What a backend holds at start-up.
#[derive(Debug, Default)]
pub struct Loaded {
    pub rv: u64,
    pub objects: Vec<(Key, u64, Value)>,
    pub history: Vec<Event>,
}

struct Request {
    write: Write,
    reply: oneshot::Sender<Result<Stored, StoreError>>,
}

/// The watch hub: retained history and the live channel. Publishing and subscribing take
/// the same lock, so a new watch sees every event exactly once.
struct Hub {
    history: VecDeque<Arc<Event>>,
    /// Every rv at or below this one has been forgotten.
    compacted: u64,
    capacity: usize,
    /// The backend's history has been compacted up to here.
    backend_compacted: u64,
    live: broadcast::Sender<Arc<Event>>,
}

/// The store handle; cheap to clone.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

struct Inner {
    snapshot: RwLock<Arc<Snapshot>>,
    hub: Mutex<Hub>,
    writes: tokio::sync::mpsc::Sender<Request>,
}

/// Watches that fall this far behind the live channel are ended; the client resumes from
/// its last resourceVersion.
const LIVE_CHANNEL_CAPACITY: usize = 8192;
/// Writes waiting for the writer at most; a full queue makes callers wait (bounded).
const WRITE_QUEUE: usize = 4096;
/// Most writes committed in one transaction.
const MAX_BATCH: usize = 512;

/// A subscription from a given resourceVersion: first the retained history after it, then
/// live events.
pub struct Subscription {
    pub backlog: Vec<Arc<Event>>,
    pub live: broadcast::Receiver<Arc<Event>>,
}

impl Store {
    /// Opens the store over `backend`, keeping at most `history` past events for watches.
    pub fn open(mut backend: impl Backend, history: usize) -> Result<Store, StoreError> {
        let mut loaded = backend.load()?;
        let mut objects = im::OrdMap::new();
        for (key, rv, object) in std::mem::take(&mut loaded.objects) {
            objects.insert(
                key,
                Stored {
                    rv,
                    object: Arc::new(object),
                },
            );
        }
        let keep = history.max(1);
        if loaded.history.len() > keep {
            let excess = loaded.history.len() - keep;
            loaded.history.drain(..excess);
        }
        let history_len = loaded.history.len();
        let compacted = loaded
            .history
            .first()
            .map(|e| e.rv.saturating_sub(1))
            .unwrap_or(loaded.rv);
        // History reloaded from disk has no earlier states; rebuild them from the previous
        // retained event of the same object, so selector watches and older snapshots keep
        // working across a restart (only each object's first retained change stays unknown).
        let mut last: std::collections::HashMap<Key, Arc<Value>> = std::collections::HashMap::new();
        for event in loaded.history.iter_mut() {
            if event.kind != EventType::Added && event.prev.is_none() {
                event.prev = last.get(&event.key).cloned();
            }
            last.insert(event.key.clone(), Arc::clone(&event.object));
        }
        drop(last);
        let (live, _) = broadcast::channel(LIVE_CHANNEL_CAPACITY);
        let hub = Hub {
            history: loaded.history.into_iter().map(Arc::new).collect(),
            compacted,
            capacity: history.max(1),
            backend_compacted: compacted,
            live,
        };
        tracing::debug!(rv = loaded.rv, history = history_len, "store loaded");
        let (tx, rx) = tokio::sync::mpsc::channel(WRITE_QUEUE);
        let inner = Arc::new(Inner {
            snapshot: RwLock::new(Arc::new(Snapshot {
                rv: loaded.rv,
                objects,
            })),
            hub: Mutex::new(hub),
            writes: tx,
        });
        let writer_inner = Arc::clone(&inner);
        std::thread::Builder::new()
            .name("store-writer".into())
            .spawn(move || writer_loop(writer_inner, backend, rx))
            .map_err(|e| StoreError::Backend(format!("failed to start the writer thread: {e}")))?;
        Ok(Store { inner })
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        Arc::clone(
            &self
                .inner
                .snapshot
                .read()
                .unwrap_or_else(|e| e.into_inner()),
        )
    }

    /// Applies one write and returns the stored result once it is durable.
    pub async fn write(&self, write: Write) -> Result<Stored, StoreError> {
        let (reply, rx) = oneshot::channel();
        let request = Request { write, reply };
        // The queue is bounded: when it is full, callers wait for room (asynchronously).
        self.inner
            .writes
            .send(request)
            .await
            .map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }

    /// Subscribes to every event after `rv`; [`StoreError::Expired`] when history no longer
    /// reaches back that far.
    pub fn subscribe(&self, rv: u64) -> Result<Subscription, StoreError> {
        let hub = lock(&self.inner.hub);
        if rv < hub.compacted {
            return Err(StoreError::Expired {
                requested: rv,
                oldest: hub.compacted,
            });
        }
        // History is ordered by rv; find the first event after `rv`.
        let start = hub.history.partition_point(|e| e.rv <= rv);
        let backlog = hub.history.range(start..).cloned().collect();
        Ok(Subscription {
            backlog,
            live: hub.live.subscribe(),
        })
    }

    /// The state as it was at `rv`, rebuilt from the current snapshot by undoing the retained
    /// history after `rv`. [`StoreError::Expired`] when history no longer reaches back that
    /// far (or its earlier states were not kept, as for history reloaded at start-up).
    pub fn snapshot_at(&self, rv: u64) -> Result<Arc<Snapshot>, StoreError> {
        // Take the current snapshot and the history after `rv` together, then undo outside
        // the lock so the writer is never held up.
        let (current, undo, compacted) = {
            let hub = lock(&self.inner.hub);
            let current = self.snapshot();
            if rv >= current.rv {
                return Ok(current);
            }
            if rv < hub.compacted {
                return Err(StoreError::Expired {
                    requested: rv,
                    oldest: hub.compacted,
                });
            }
            let start = hub.history.partition_point(|e| e.rv <= rv);
            let undo: Vec<Arc<Event>> = hub.history.range(start..).cloned().collect();
            (current, undo, hub.compacted)
        };
        let expired = || StoreError::Expired {
            requested: rv,
            oldest: compacted,
        };
        let mut objects = current.objects.clone();
        for event in undo.iter().rev() {
            match (event.kind, &event.prev) {
                (EventType::Added, _) => {
                    objects.remove(&event.key);
                }
                (EventType::Modified | EventType::Deleted, Some(prev)) => {
                    let prev_rv = prev
                        .pointer("/metadata/resourceVersion")
                        .and_then(Value::as_str)
                        .and_then(|v| v.parse().ok())
                        .ok_or_else(expired)?;
                    objects.insert(
                        event.key.clone(),
                        Stored {
                            rv: prev_rv,
                            object: Arc::clone(prev),
                        },
                    );
                }
                (EventType::Modified | EventType::Deleted, None) => return Err(expired()),
            }
        }
        Ok(Arc::new(Snapshot { rv, objects }))
    }

    /// The current snapshot and a subscription to every change after it, taken together so
    /// that nothing falls between them and history cannot be compacted past the snapshot.
    pub fn subscribe_with_snapshot(&self) -> (Arc<Snapshot>, Subscription) {
        let hub = lock(&self.inner.hub);
        let snapshot = self.snapshot();
        let start = hub.history.partition_point(|e| e.rv <= snapshot.rv);
        let backlog = hub.history.range(start..).cloned().collect();
        let live = hub.live.subscribe();
        (snapshot, Subscription { backlog, live })
    }

    /// The oldest resourceVersion a watch may still start from.
    pub fn compacted_rv(&self) -> u64 {
        lock(&self.inner.hub).compacted
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn writer_loop(
    inner: Arc<Inner>,
    mut backend: impl Backend,
    mut rx: tokio::sync::mpsc::Receiver<Request>,
) {
    let weak = Arc::downgrade(&inner);
    drop(inner);
    let mut batch: Vec<Request> = Vec::with_capacity(MAX_BATCH);
    while let Some(first) = rx.blocking_recv() {
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        let Some(inner) = weak.upgrade() else {
            for request in batch.drain(..) {
                let _ = request.reply.send(Err(StoreError::Closed));
            }
            break;
        };
        apply_batch(&inner, &mut backend, &mut batch);
    }
}

fn apply_batch(inner: &Inner, backend: &mut impl Backend, batch: &mut Vec<Request>) {
    let base = Arc::clone(&inner.snapshot.read().unwrap_or_else(|e| e.into_inner()));
    let mut objects = base.objects.clone();
    let mut rv = base.rv;
    let mut events: Vec<Event> = Vec::with_capacity(batch.len());
    // For each request: Ok(index into events) or the refusal.
    let mut outcomes: Vec<Result<usize, StoreError>> = Vec::with_capacity(batch.len());
    for request in batch.iter_mut() {
        let outcome = (|| {
            let key = request.write.key().clone();
            let current = objects.get(&key);
            let prev = current.map(|c| Arc::clone(&c.object));
            let (kind, mut object) = match std::mem::replace(
                &mut request.write,
                Write::Create {
                    key: key.clone(),
                    object: Value::Null,
                },
            ) {
                Write::Create { object, .. } => {
                    if current.is_some() {
                        return Err(StoreError::AlreadyExists);
                    }
                    (EventType::Added, object)
                }
                Write::CreateGuarded { object, guard, .. } => {
                    let alive = objects
                        .get(&guard)
                        .is_some_and(|g| g.object.pointer("/metadata/deletionTimestamp").is_none());
                    if !alive {
                        return Err(StoreError::GuardMissing(guard.name.clone()));
                    }
                    if current.is_some() {
                        return Err(StoreError::AlreadyExists);
                    }
                    (EventType::Added, object)
                }
                Write::Update {
                    expected_rv,
                    object,
                    ..
                } => {
                    check_rv(current, expected_rv)?;
                    (EventType::Modified, object)
                }
                Write::Delete {
                    expected_rv,
                    object,
                    ..
                } => {
                    check_rv(current, expected_rv)?;
                    (EventType::Deleted, object)
                }
            };
            rv += 1;
            set_resource_version(&mut object, rv);
            let object = Arc::new(object);
            match kind {
                EventType::Deleted => {
                    objects.remove(&key);
                }
                EventType::Added | EventType::Modified => {
                    objects.insert(
                        key.clone(),
                        Stored {
                            rv,
                            object: Arc::clone(&object),
                        },
                    );
                }
            }
            events.push(Event {
                rv,
                kind,
                key,
                object,
                prev,
                encoded: std::sync::OnceLock::new(),
            });
            Ok(events.len() - 1)
        })();
        outcomes.push(outcome);
    }

    if !events.is_empty()
        && let Err(e) = backend.commit(&events)
    {
        // Nothing of the batch is visible: the snapshot and the rv stay as they were. Writes
        // refused by their own precondition keep their answer; the others get the failure.
        tracing::error!(error = %e, "commit failed; the batch is refused");
        for (request, outcome) in batch.drain(..).zip(outcomes) {
            let answer = match outcome {
                Ok(_) => Err(e.clone()),
                Err(refused) => Err(refused),
            };
            let _ = request.reply.send(answer);
        }
        return;
    }

    let events: Vec<Arc<Event>> = events.into_iter().map(Arc::new).collect();
    {
        let mut hub = lock(&inner.hub);
        *inner.snapshot.write().unwrap_or_else(|e| e.into_inner()) =
            Arc::new(Snapshot { rv, objects });
        for event in &events {
            hub.history.push_back(Arc::clone(event));
            let _ = hub.live.send(Arc::clone(event));
        }
        let mut dropped = None;
        while hub.history.len() > hub.capacity {
            dropped = hub.history.pop_front().map(|e| e.rv);
        }
        if let Some(dropped) = dropped {
            hub.compacted = dropped;
        }
        let due = dropped.filter(|d| *d >= hub.backend_compacted + 64);
        if let Some(d) = due {
            hub.backend_compacted = d;
        }
        drop(hub);
        // History in the backend only serves restarts; a failure to compact it is logged and
        // the next compaction covers it.
        if let Some(d) = due
            && let Err(e) = backend.compact(d)
        {
            tracing::warn!(error = %e, "failed to compact history");
        }
    }

    for (request, outcome) in batch.drain(..).zip(outcomes) {
        let reply = outcome.map(|index| {
            let event = &events[index];
            Stored {
                rv: event.rv,
                object: Arc::clone(&event.object),
            }
        });
        let _ = request.reply.send(reply);
    }
}

/// The precondition of updates and deletes: the object exists at `expected_rv`.
fn check_rv(current: Option<&Stored>, expected_rv: u64) -> Result<(), StoreError> {
    let current = current.ok_or(StoreError::NotFound)?;
    if current.rv != expected_rv {
        return Err(StoreError::Conflict {
            current: current.rv,
        });
    }
    Ok(())
}

/// Writes `metadata.resourceVersion` as the decimal string clients treat as opaque.
pub fn set_resource_version(object: &mut Value, rv: u64) {
    if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("resourceVersion".into(), Value::String(rv.to_string()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key(name: &str) -> Key {
        Key {
            resource: Arc::from("runs.kruntimes.io"),
            namespace: "default".into(),
            name: name.into(),
        }
    }

    fn obj(name: &str) -> Value {
        json!({"metadata": {"name": name}})
    }

    fn open(dir: &std::path::Path, history: usize) -> Store {
        let backend = sqlite::SqliteBackend::open(&dir.join("db.sqlite"), false).expect("open");
        Store::open(backend, history).expect("store")
    }

    #[tokio::test]
    async fn create_update_delete_with_preconditions() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path(), 100);
        let a = store
            .write(Write::Create {
                key: key("a"),
                object: obj("a"),
            })
            .await
            .expect("create");
        assert_eq!(a.rv, 1);
        assert_eq!(a.object["metadata"]["resourceVersion"], "1");
        let dup = store
            .write(Write::Create {
                key: key("a"),
                object: obj("a"),
            })
            .await;
        assert!(matches!(dup, Err(StoreError::AlreadyExists)));
        let stale = store
            .write(Write::Update {
                key: key("a"),
                expected_rv: 0,
                object: obj("a"),
            })
            .await;
        assert!(matches!(stale, Err(StoreError::Conflict { current: 1 })));
        let b = store
            .write(Write::Update {
                key: key("a"),
                expected_rv: 1,
                object: obj("a"),
            })
            .await
            .expect("update");
        assert_eq!(b.rv, 2);
        store
            .write(Write::Delete {
                key: key("a"),
                expected_rv: 2,
                object: obj("a"),
            })
            .await
            .expect("delete");
        let snap = store.snapshot();
        assert_eq!(snap.rv, 3);
        assert!(snap.objects.is_empty());
    }

    #[tokio::test]
    async fn earlier_states_are_rebuilt_from_history_after_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let store = open(dir.path(), 100);
            let mut rv = store
                .write(Write::Create {
                    key: key("x"),
                    object: obj("x"),
                })
                .await
                .expect("create")
                .rv;
            for _ in 0..2 {
                rv = store
                    .write(Write::Update {
                        key: key("x"),
                        expected_rv: rv,
                        object: obj("x"),
                    })
                    .await
                    .expect("update")
                    .rv;
            }
        }
        let store = open(dir.path(), 100);
        let past = store.snapshot_at(2).expect("the state at 2 is rebuilt");
        assert_eq!(past.objects.get(&key("x")).map(|s| s.rv), Some(2));
        let sub = store.subscribe(1).expect("history");
        assert!(
            sub.backlog
                .iter()
                .all(|e| e.kind == EventType::Added || e.prev.is_some())
        );
    }

    #[tokio::test]
    async fn history_survives_restart_and_compacts() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let store = open(dir.path(), 4);
            for i in 0..10 {
                let name = format!("o{i}");
                store
                    .write(Write::Create {
                        key: key(&name),
                        object: obj(&name),
                    })
                    .await
                    .expect("create");
            }
            assert!(matches!(
                store.subscribe(2),
                Err(StoreError::Expired { .. })
            ));
            let past = store.snapshot_at(8).expect("within history");
            assert_eq!(past.rv, 8);
            assert_eq!(past.objects.len(), 8);
            assert!(matches!(
                store.snapshot_at(3),
                Err(StoreError::Expired { .. })
            ));
            let sub = store.subscribe(6).expect("within history");
            let rvs: Vec<u64> = sub.backlog.iter().map(|e| e.rv).collect();
            assert_eq!(rvs, vec![7, 8, 9, 10]);
        }
        let store = open(dir.path(), 4);
        let snap = store.snapshot();
        assert_eq!(snap.rv, 10);
        assert_eq!(snap.objects.len(), 10);
        let sub = store.subscribe(8).expect("history reloaded");
        assert!(sub.backlog.iter().all(|e| e.kind == EventType::Added));
        let rvs: Vec<u64> = sub.backlog.iter().map(|e| e.rv).collect();
        assert_eq!(rvs, vec![9, 10]);
        let next = store
            .write(Write::Create {
                key: key("later"),
                object: obj("later"),
            })
            .await
            .expect("create");
        assert_eq!(next.rv, 11);
    }
}
