//! Kubernetes Events on Runs and Runtimes, through kube-runtime's event [`Recorder`]: why a
//! Run cannot be placed (no such Runtime, no capacity, larger than any worker, no ready
//! worker), a Run its worker did not claim, a lost worker, a retry, a cancellation before
//! assignment; a Runtime template field the provisioner ignores. `kubectl describe run NAME` and `kubectl get events
//! --field-selector involvedObject.name=NAME` show them.
//!
//! Events are best-effort and never hold up or fail a reconcile: [`Events::publish`] hands
//! the write to a background task and returns at once. At most [`IN_FLIGHT`] writes are
//! pending at a time; beyond that an Event is dropped (logged at debug level), so a burst
//! cannot queue writes without bound. Each write is bounded by [`PUBLISH_TIMEOUT`], and a
//! failed one is logged, never retried. The background writes may outlive the leadership
//! term that started them by that bound; they only ever create or patch Events.

use std::sync::Arc;
use std::time::Duration;

use kruntimes_api::lifecycle::bounded_message;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource, ResourceExt};
use tokio::sync::Semaphore;
use tracing::{debug, warn};

/// The `reportingController` of the controller-manager's Events.
pub const REPORTING_CONTROLLER: &str = "kruntimes.io/controller-manager";
/// Event writes pending at once, at most.
pub const IN_FLIGHT: usize = 32;
/// The longest one Event write may take.
pub const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);

/// The reason of the Event on a Run whose Runtime does not exist.
pub const RUNTIME_NOT_FOUND: &str = kruntimes_api::lifecycle::RUNTIME_NOT_FOUND_REASON;
/// The reason of the Event on a Run that waits for a free slot.
pub const NO_CAPACITY: &str = kruntimes_api::lifecycle::NO_CAPACITY_REASON;
/// The reason of the Event on a Run that asks for more slots than a worker has.
pub const EXCEEDS_WORKER_CAPACITY: &str = kruntimes_api::lifecycle::EXCEEDS_WORKER_CAPACITY_REASON;
/// The reason of the Event on a Run whose Runtime has no ready worker yet.
pub const WAITING_FOR_WORKERS: &str = kruntimes_api::lifecycle::WAITING_FOR_WORKERS_REASON;
/// The reason of the Event on a Run taken back from a worker that did not start it.
pub const NOT_CLAIMED: &str = kruntimes_api::lifecycle::NOT_CLAIMED_REASON;
/// The reason of the Event on a Runtime whose template asks for what the local provisioner
/// cannot do (an image, say).
pub const IMAGE_IGNORED: &str = "ImageIgnored";
/// The reason of the Event on a Run sent back to Pending for another attempt.
pub const RETRYING: &str = "Retrying";

/// The controller-manager's Event writer; cheap to clone.
#[derive(Clone)]
pub(crate) struct Events {
    inner: Arc<Inner>,
}

struct Inner {
    recorder: Recorder,
    permits: Arc<Semaphore>,
}

impl Events {
    /// A writer reporting as [`REPORTING_CONTROLLER`], instance `instance` (the Lease
    /// identity).
    pub(crate) fn new(client: Client, instance: &str) -> Events {
        let reporter = Reporter {
            controller: REPORTING_CONTROLLER.to_string(),
            instance: Some(instance.to_string()),
        };
        Events {
            inner: Arc::new(Inner {
                recorder: Recorder::new(client, reporter),
                permits: Arc::new(Semaphore::new(IN_FLIGHT)),
            }),
        }
    }

    /// Writes an Event on `object` (a Run or a Runtime) in the background. Returns whether
    /// it was accepted (it is dropped when [`IN_FLIGHT`] writes are pending). `note` is cut
    /// to 1 KiB.
    pub(crate) fn publish<K: Resource<DynamicType = ()>>(
        &self,
        object: &K,
        type_: EventType,
        reason: &'static str,
        action: &'static str,
        note: &str,
    ) -> bool {
        let Ok(permit) = self.inner.permits.clone().try_acquire_owned() else {
            debug!(object = %object.name_any(), reason, "too many Event writes pending; Event dropped");
            return false;
        };
        let reference = object.object_ref(&());
        let event = Event {
            type_,
            reason: reason.to_string(),
            note: Some(bounded_message(note)),
            action: action.to_string(),
            secondary: None,
        };
        let recorder = self.inner.recorder.clone();
        let name = object.name_any();
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(PUBLISH_TIMEOUT, recorder.publish(&event, &reference)).await
            {
                Ok(Ok(())) => debug!(run = %name, reason, "Event written"),
                Ok(Err(error)) => {
                    warn!(run = %name, reason, error = %error, "could not write an Event")
                }
                Err(_) => warn!(run = %name, reason, "writing an Event timed out"),
            }
        });
        true
    }
}
