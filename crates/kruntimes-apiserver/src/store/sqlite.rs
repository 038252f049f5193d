//! The SQLite backend: one database file in WAL mode holding the objects, the retained
//! change history and the current resourceVersion.
//!
//! A batch is one transaction. With `full_sync` off the WAL is synced at checkpoints only,
//! so a committed batch survives a crash of the process (SIGKILL) but the newest batches
//! may be lost on power loss; with it on every commit is synced.

use std::path::Path;
use std::sync::Arc;

use rusqlite::{Connection, OptionalExtension, params};
use serde_json::Value;

use super::{Backend, Event, EventType, Key, Loaded, StoreError};

pub struct SqliteBackend {
    conn: Connection,
}

fn err(context: &str) -> impl Fn(rusqlite::Error) -> StoreError + '_ {
    move |e| StoreError::Backend(format!("{context}: {e}"))
}

impl SqliteBackend {
    /// Opens (creating if needed) the database at `path`.
    pub fn open(path: &Path, full_sync: bool) -> Result<SqliteBackend, StoreError> {
        let conn = Connection::open(path).map_err(err("failed to open the database"))?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(err("failed to enable WAL"))?;
        conn.pragma_update(
            None,
            "synchronous",
            if full_sync { "FULL" } else { "NORMAL" },
        )
        .map_err(err("failed to set synchronous"))?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS objects (
                resource TEXT NOT NULL,
                namespace TEXT NOT NULL,
                name TEXT NOT NULL,
                rv INTEGER NOT NULL,
                body BLOB NOT NULL,
                PRIMARY KEY (resource, namespace, name)
             ) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS history (
                rv INTEGER PRIMARY KEY,
                type TEXT NOT NULL,
                resource TEXT NOT NULL,
                namespace TEXT NOT NULL,
                name TEXT NOT NULL,
                body BLOB NOT NULL
             );
             CREATE TABLE IF NOT EXISTS meta (
                key TEXT PRIMARY KEY,
                value INTEGER NOT NULL
             );",
        )
        .map_err(err("failed to create the schema"))?;
        Ok(SqliteBackend { conn })
    }
}

fn decode(body: &[u8]) -> Result<Value, StoreError> {
    serde_json::from_slice(body)
        .map_err(|e| StoreError::Backend(format!("a stored object is not valid JSON: {e}")))
}

impl Backend for SqliteBackend {
    fn load(&mut self) -> Result<Loaded, StoreError> {
        let mut loaded = Loaded::default();
        let mut stmt = self
            .conn
            .prepare("SELECT resource, namespace, name, rv, body FROM objects")
            .map_err(err("failed to read objects"))?;
        let rows = stmt
            .query_map([], |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, String>(2)?,
                    row.get::<_, i64>(3)?,
                    row.get::<_, Vec<u8>>(4)?,
                ))
            })
            .map_err(err("failed to read objects"))?;
        for row in rows {
            let (resource, namespace, name, rv, body) =
                row.map_err(err("failed to read an object"))?;
            loaded.rv = loaded.rv.max(rv as u64);
            loaded.objects.push((
                Key {
                    resource: Arc::from(resource),
                    namespace,
                    name,
                },
                rv as u64,
                decode(&body)?,
            ));
        }
        drop(stmt);
        let mut stmt = self
            .conn
            .prepare("SELECT rv, type, resource, namespace, name, body FROM history ORDER BY rv")
            .map_err(err("failed to read history"))?;
        let rows = stmt
            .query_map([], |row| {
                Ok((
                    row.get::<_, i64>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, String>(2)?,
                    row.get::<_, String>(3)?,
                    row.get::<_, String>(4)?,
                    row.get::<_, Vec<u8>>(5)?,
                ))
            })
            .map_err(err("failed to read history"))?;
        for row in rows {
            let (rv, kind, resource, namespace, name, body) =
                row.map_err(err("failed to read a history row"))?;
            let kind = match kind.as_str() {
                "ADDED" => EventType::Added,
                "MODIFIED" => EventType::Modified,
                "DELETED" => EventType::Deleted,
                other => {
                    return Err(StoreError::Backend(format!(
                        "unknown event type {other:?} in history"
                    )));
                }
            };
            loaded.rv = loaded.rv.max(rv as u64);
            loaded.history.push(Event {
                rv: rv as u64,
                kind,
                key: Key {
                    resource: Arc::from(resource),
                    namespace,
                    name,
                },
                object: Arc::new(decode(&body)?),
                prev: None,
                encoded: std::sync::OnceLock::new(),
            });
        }
        drop(stmt);
        let stored_rv: Option<i64> = self
            .conn
            .query_row("SELECT value FROM meta WHERE key = 'rv'", [], |r| r.get(0))
            .optional()
            .map_err(err("failed to read the resourceVersion"))?;
        loaded.rv = loaded.rv.max(stored_rv.unwrap_or(0) as u64);
        Ok(loaded)
    }

    fn commit(&mut self, events: &[Event]) -> Result<(), StoreError> {
        let tx = self
            .conn
            .transaction()
            .map_err(err("failed to begin a transaction"))?;
        {
            let mut upsert = tx
                .prepare_cached(
                    "INSERT INTO objects (resource, namespace, name, rv, body) VALUES (?1, ?2, ?3, ?4, ?5)
                     ON CONFLICT (resource, namespace, name) DO UPDATE SET rv = excluded.rv, body = excluded.body",
                )
                .map_err(err("failed to prepare an upsert"))?;
            let mut delete = tx
                .prepare_cached(
                    "DELETE FROM objects WHERE resource = ?1 AND namespace = ?2 AND name = ?3",
                )
                .map_err(err("failed to prepare a delete"))?;
            let mut history = tx
                .prepare_cached(
                    "INSERT INTO history (rv, type, resource, namespace, name, body) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                )
                .map_err(err("failed to prepare a history insert"))?;
            for event in events {
                // The same bytes later go to every watcher.
                let body: &[u8] = event.object_json();
                let rv = event.rv as i64;
                let key = &event.key;
                match event.kind {
                    EventType::Added | EventType::Modified => {
                        upsert
                            .execute(params![&*key.resource, key.namespace, key.name, rv, body])
                            .map_err(err("failed to write an object"))?;
                    }
                    EventType::Deleted => {
                        delete
                            .execute(params![&*key.resource, key.namespace, key.name])
                            .map_err(err("failed to delete an object"))?;
                    }
                }
                history
                    .execute(params![
                        rv,
                        event.kind.as_str(),
                        &*key.resource,
                        key.namespace,
                        key.name,
                        body
                    ])
                    .map_err(err("failed to record history"))?;
            }
            if let Some(last) = events.last() {
                tx.execute(
                    "INSERT INTO meta (key, value) VALUES ('rv', ?1)
                     ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    params![last.rv as i64],
                )
                .map_err(err("failed to record the resourceVersion"))?;
            }
        }
        tx.commit().map_err(err("failed to commit"))
    }

    fn compact(&mut self, rv: u64) -> Result<(), StoreError> {
        self.conn
            .execute("DELETE FROM history WHERE rv <= ?1", params![rv as i64])
            .map_err(err("failed to compact history"))?;
        Ok(())
    }
}
