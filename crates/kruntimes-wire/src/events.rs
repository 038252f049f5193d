//! Kubernetes Events through kube-runtime's event [`Recorder`], bounded so that they never
//! hold up or fail the work they report. The controller-manager reports on Runs it cannot
//! place or recovers, runtimed on what happens to a Run at its worker; each names itself as
//! the reporting controller. `kubectl describe run NAME` and `kubectl get events
//! --field-selector involvedObject.name=NAME` show them.
//!
//! [`Events::publish`] hands the write to a background task and returns at once. At most
//! [`IN_FLIGHT`] writes are pending at a time; beyond that an Event is dropped (logged at
//! debug level), so a burst cannot queue writes without bound. Each write is bounded by
//! [`PUBLISH_TIMEOUT`], and a failed one is logged, never retried. The writes only ever
//! create or patch Events (the reporter needs `create` and `patch` on `events` in both the
//! core and the `events.k8s.io` group).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kruntimes_api::lifecycle::bounded_message;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource, ResourceExt};
use tokio::sync::Semaphore;
use tracing::{debug, warn};

/// Event writes pending at once, at most.
pub const IN_FLIGHT: usize = 32;
/// The longest one Event write may take.
pub const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);
/// How many (object, reason) pairs [`Events::publish_once`] remembers before it starts over.
const REMEMBERED: usize = 10_000;
/// The longest `reason` or `action` an Event carries (Kubernetes validates 128).
pub const MAX_REASON_BYTES: usize = 128;

/// A bounded Event writer for one reporting controller; cheap to clone.
#[derive(Clone)]
pub struct Events {
    inner: Arc<Inner>,
}

struct Inner {
    recorder: Recorder,
    permits: Arc<Semaphore>,
    /// (object UID, reason) pairs already reported by [`Events::publish_once`].
    reported: Mutex<HashSet<(String, &'static str)>>,
}

impl Events {
    /// A writer reporting as `controller` (for example `kruntimes.io/runtimed`), instance
    /// `instance` (a Lease identity, a Pod name).
    pub fn new(client: Client, controller: &str, instance: &str) -> Events {
        let reporter = Reporter {
            controller: controller.to_string(),
            instance: Some(instance.to_string()),
        };
        Events {
            inner: Arc::new(Inner {
                recorder: Recorder::new(client, reporter),
                permits: Arc::new(Semaphore::new(IN_FLIGHT)),
                reported: Mutex::new(HashSet::new()),
            }),
        }
    }

    /// Writes an Event on `object` in the background. Returns whether it was accepted (it
    /// is dropped when [`IN_FLIGHT`] writes are pending). `note` is cut to 1 KiB. Never
    /// blocks, never fails the caller.
    pub fn publish<K>(
        &self,
        object: &K,
        type_: EventType,
        reason: &str,
        action: &str,
        note: &str,
    ) -> bool
    where
        K: Resource<DynamicType = ()>,
    {
        let Ok(permit) = self.inner.permits.clone().try_acquire_owned() else {
            debug!(object = %object.name_any(), reason, "too many Event writes pending; Event dropped");
            return false;
        };
        let reference = object.object_ref(&());
        let event = Event {
            type_,
            reason: cut(reason, MAX_REASON_BYTES),
            note: Some(bounded_message(note)),
            action: cut(action, MAX_REASON_BYTES),
            secondary: None,
        };
        let recorder = self.inner.recorder.clone();
        let name = object.name_any();
        let reason = event.reason.clone();
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(PUBLISH_TIMEOUT, recorder.publish(&event, &reference)).await
            {
                Ok(Ok(())) => debug!(object = %name, reason = %reason, "Event written"),
                Ok(Err(error)) => {
                    warn!(object = %name, reason = %reason, error = %error, "could not write an Event")
                }
                Err(_) => warn!(object = %name, reason = %reason, "writing an Event timed out"),
            }
        });
        true
    }

    /// Waits, at most `bound`, until no Event write is pending: before the process exits,
    /// so that what its last steps reported (a drain's) is not cut off. Returns whether
    /// every write ended.
    pub async fn flush(&self, bound: Duration) -> bool {
        let all = u32::try_from(IN_FLIGHT).unwrap_or(u32::MAX);
        matches!(
            tokio::time::timeout(bound, self.inner.permits.acquire_many(all)).await,
            Ok(Ok(_))
        )
    }

    /// [`publish`](Self::publish), once per object UID and reason: for what every pass
    /// sees again while it lasts (a Run waiting for capacity, or for its Runtime). Returns
    /// whether it was published now; a dropped Event is tried again on the next call.
    pub fn publish_once<K>(
        &self,
        object: &K,
        type_: EventType,
        reason: &'static str,
        action: &'static str,
        note: impl FnOnce() -> String,
    ) -> bool
    where
        K: Resource<DynamicType = ()>,
    {
        let Some(uid) = object.uid() else {
            return false;
        };
        let key = (uid, reason);
        {
            let Ok(reported) = self.inner.reported.lock() else {
                return false;
            };
            if reported.contains(&key) {
                return false;
            }
        }
        if !self.publish(object, type_, reason, action, &note()) {
            return false;
        }
        if let Ok(mut reported) = self.inner.reported.lock() {
            if reported.len() >= REMEMBERED {
                reported.clear();
            }
            reported.insert(key);
        }
        true
    }
}

/// `text` cut to at most `max` bytes on a character boundary.
fn cut(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn reasons_are_cut_on_a_character_boundary() {
        assert_eq!(super::cut("Timeout", 128), "Timeout");
        assert_eq!(super::cut("ab\u{e9}", 3), "ab");
        assert_eq!(super::cut(&"x".repeat(300), 128).len(), 128);
    }
}
