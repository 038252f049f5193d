//! What runtimed knows locally of the executions it started: whether a waiter watches
//! each one, whether Cancel was sent, and the result the waiter recorded. The reconciler
//! turns a recorded result into Run status; nothing here writes to the API.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use kruntimes_proto::runtime::v1 as rs;
use tokio::sync::watch;

/// One attempt of one Run (for sessions, the fenced attempt: [`fenced_attempt`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub uid: String,
    pub attempt: u32,
}

impl Key {
    pub fn id(&self) -> rs::ExecutionId {
        rs::ExecutionId {
            run_uid: self.uid.clone(),
            attempt: self.attempt,
        }
    }
}

/// The bits of a fenced attempt that hold the attempt; the incarnation is above them.
const INCARNATION_SHIFT: u32 = 16;

/// The fenced attempt of a Run: its attempt, with its incarnation (a session resumed after
/// a suspend, `status.incarnation`, default 1) above it, so that every incarnation has its
/// own local session and runtime-server session ID, and a later incarnation is always
/// newer than an earlier one ([`crate::reconcile::left_over`]). Incarnation 1 is the plain
/// attempt.
pub fn fenced_attempt(status: Option<&kruntimes_api::RunStatus>) -> u32 {
    let attempt = u32::try_from(kruntimes_api::lifecycle::attempt(status)).unwrap_or(1);
    let incarnation = status
        .and_then(|s| s.incarnation)
        .and_then(|i| u32::try_from(i).ok())
        .unwrap_or(1)
        .max(1);
    ((incarnation - 1).min(0xFFFF) << INCARNATION_SHIFT) | attempt.min(0xFFFF)
}

/// The attempt (`status.attempt`) of a fenced attempt.
pub fn attempt_of(fenced: u32) -> u32 {
    fenced & 0xFFFF
}

/// The incarnation of a fenced attempt.
pub fn incarnation_of(fenced: u32) -> u32 {
    (fenced >> INCARNATION_SHIFT) + 1
}

/// How an execution ended, as far as runtimed is concerned.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The runtime server reports the execution terminal.
    Finished(Box<rs::ExecutionStatus>),
    /// The execution could not be started or was lost. `infrastructure` failures follow
    /// the Run's retry policy; the others (a request the server refused as invalid) end the
    /// Run Failed.
    Broken {
        infrastructure: bool,
        reason: &'static str,
        message: String,
    },
}

#[derive(Debug, Default, Clone)]
struct Entry {
    /// The execution exists on the runtime server (Execute answered, or Status found it).
    started: bool,
    /// A waiter task watches it.
    waited: bool,
    cancel_sent: bool,
    outcome: Option<Outcome>,
}

/// The table of local executions. Bounded by the Runs assigned to this worker: entries are
/// removed when their Run leaves the worker (see the garbage collector in `reconcile`).
#[derive(Debug)]
pub struct Executions {
    entries: Mutex<HashMap<Key, Entry>>,
    changed: watch::Sender<u64>,
}

impl Default for Executions {
    fn default() -> Executions {
        Executions {
            entries: Mutex::new(HashMap::new()),
            changed: watch::Sender::new(0),
        }
    }
}

impl Executions {
    fn with<T>(&self, f: impl FnOnce(&mut HashMap<Key, Entry>) -> T) -> T {
        let mut entries = match self.entries.lock() {
            Ok(guard) => guard,
            // A panic elsewhere while holding the lock leaves plain data behind; keep going.
            Err(poisoned) => poisoned.into_inner(),
        };
        f(&mut entries)
    }

    fn notify(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// The recorded outcome, if any.
    pub fn outcome(&self, key: &Key) -> Option<Outcome> {
        self.with(|e| e.get(key).and_then(|entry| entry.outcome.clone()))
    }

    /// Whether the execution is known to exist on the runtime server.
    pub fn started(&self, key: &Key) -> bool {
        self.with(|e| e.get(key).is_some_and(|entry| entry.started))
    }

    /// Marks the execution started. Returns `true` when nobody waits for it yet: the caller
    /// must then start the one waiter.
    pub fn start(&self, key: &Key) -> bool {
        let first = self.with(|e| {
            let entry = e.entry(key.clone()).or_default();
            entry.started = true;
            !std::mem::replace(&mut entry.waited, true)
        });
        self.notify();
        first
    }

    /// Records how the execution ended (the first outcome wins).
    pub fn record(&self, key: &Key, outcome: Outcome) {
        self.with(|e| {
            let entry = e.entry(key.clone()).or_default();
            if entry.outcome.is_none() {
                entry.outcome = Some(outcome);
            }
        });
        self.notify();
    }

    /// Marks Cancel as sent; `true` the first time.
    pub fn mark_cancelled(&self, key: &Key) -> bool {
        self.with(|e| !std::mem::replace(&mut e.entry(key.clone()).or_default().cancel_sent, true))
    }

    /// Forgets every entry of `uid` whose attempt is not `keep`.
    pub fn remove_run(&self, uid: &str, keep: Option<u32>) {
        self.with(|e| e.retain(|k, _| k.uid != uid || Some(k.attempt) == keep));
    }

    /// Forgets every entry of `uid` whose attempt is older than `attempt`, and `attempt`'s.
    pub fn remove_older(&self, uid: &str, attempt: u32) {
        self.with(|e| e.retain(|k, _| k.uid != uid || k.attempt > attempt));
    }

    /// Keeps only the entries for which `keep` holds (one lock: nothing is added between
    /// the decision and the removal).
    pub fn retain(&self, mut keep: impl FnMut(&Key) -> bool) {
        self.with(|e| e.retain(|k, _| keep(k)));
    }

    /// Every key known.
    pub fn keys(&self) -> Vec<Key> {
        self.with(|e| e.keys().cloned().collect())
    }

    /// Waits until the execution is started, at most `limit`. Returns whether it is.
    pub async fn wait_started(&self, key: &Key, limit: Duration) -> bool {
        let mut changed = self.changed.subscribe();
        let wait = async {
            loop {
                if self.started(key) {
                    return;
                }
                if changed.changed().await.is_err() {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(limit, wait).await;
        self.started(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(attempt: u32) -> Key {
        Key {
            uid: "u".into(),
            attempt,
        }
    }

    #[test]
    fn only_the_first_start_gets_the_waiter() {
        let e = Executions::default();
        assert!(e.start(&key(1)));
        assert!(!e.start(&key(1)));
        assert!(e.start(&key(2)));
    }

    #[test]
    fn the_first_outcome_wins() {
        let e = Executions::default();
        e.record(
            &key(1),
            Outcome::Broken {
                infrastructure: true,
                reason: "A",
                message: String::new(),
            },
        );
        e.record(
            &key(1),
            Outcome::Broken {
                infrastructure: false,
                reason: "B",
                message: String::new(),
            },
        );
        assert!(matches!(
            e.outcome(&key(1)),
            Some(Outcome::Broken { reason: "A", .. })
        ));
    }

    #[test]
    fn cancel_is_sent_once_and_entries_are_removed_by_run() {
        let e = Executions::default();
        assert!(e.mark_cancelled(&key(1)));
        assert!(!e.mark_cancelled(&key(1)));
        e.start(&key(2));
        e.remove_run("u", Some(2));
        assert_eq!(e.keys(), vec![key(2)]);
        e.remove_run("u", None);
        assert!(e.keys().is_empty());
    }

    #[tokio::test]
    async fn wait_started_sees_a_later_start() {
        let e = std::sync::Arc::new(Executions::default());
        let e2 = e.clone();
        let waiter =
            tokio::spawn(async move { e2.wait_started(&key(1), Duration::from_secs(5)).await });
        e.start(&key(1));
        assert!(waiter.await.unwrap_or(false));
        assert!(!e.wait_started(&key(9), Duration::from_millis(10)).await);
    }

    #[test]
    fn a_later_incarnation_is_a_newer_fenced_attempt_and_the_first_is_the_plain_attempt() {
        let status = |attempt: i32, incarnation: Option<i64>| kruntimes_api::RunStatus {
            attempt: Some(attempt),
            incarnation,
            ..Default::default()
        };
        assert_eq!(fenced_attempt(None), 1);
        assert_eq!(fenced_attempt(Some(&status(3, None))), 3);
        assert_eq!(fenced_attempt(Some(&status(3, Some(1)))), 3);
        let resumed = fenced_attempt(Some(&status(1, Some(2))));
        assert!(resumed > fenced_attempt(Some(&status(3, Some(1)))));
        assert_eq!(attempt_of(resumed), 1);
        assert_eq!(incarnation_of(resumed), 2);
        assert_eq!(incarnation_of(3), 1);
        // The collector's rule: the earlier incarnation is left over, the later never.
        assert!(crate::reconcile::left_over(1, Some(resumed)));
        assert!(!crate::reconcile::left_over(resumed, Some(1)));
    }
}
