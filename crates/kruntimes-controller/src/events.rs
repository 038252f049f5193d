//! Kubernetes Events on Runs and Runtimes from the controller-manager: why a Run cannot be
//! placed (no such Runtime, no capacity, larger than any worker, no ready worker), a Run
//! its worker did not claim, a lost worker, a retry, a cancellation before assignment; a
//! Runtime template field the provisioner ignores. `kubectl describe run NAME` and `kubectl
//! get events --field-selector involvedObject.name=NAME` show them.
//!
//! They go through the bounded writer of `kruntimes-wire` ([`Events`]), shared with
//! runtimed: best-effort, never holding up or failing a reconcile (at most
//! [`kruntimes_wire::events::IN_FLIGHT`] writes pending, each bounded by
//! [`kruntimes_wire::events::PUBLISH_TIMEOUT`]). The background writes may outlive the
//! leadership term that started them by that bound; they only ever create or patch Events.

use kube::Client;

pub(crate) use kruntimes_wire::events::Events;

/// The `reportingController` of the controller-manager's Events.
pub const REPORTING_CONTROLLER: &str = "kruntimes.io/controller-manager";

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

/// The controller-manager's writer, instance `instance` (the Lease identity).
pub(crate) fn events(client: Client, instance: &str) -> Events {
    Events::new(client, REPORTING_CONTROLLER, instance)
}
