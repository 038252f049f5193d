//! The controller-manager: schedules Runs onto worker capacity, cancels Runs that are asked
//! to end before they are placed, deletes finished Runs after their TTL, and keeps exactly
//! one active leader through a `coordination.k8s.io/v1` Lease (ARCHITECTURE.md,
//! "Components").
//!
//! It reads and writes state only through the Kubernetes API, with its own least-privilege
//! identity (the `controller-manager` ClusterRole). It never calls a runtime server, never
//! touches invoke traffic, and never moves a Run on once it is assigned: runtimed owns it
//! from Scheduled on.
//!
//! - [`scheduler`]: FIFO placement of Pending Runs on ready worker Pods with free slots,
//!   and for a Runtime with `spec.scaling`, its `spec.replicas` (`autoscale.rs`);
//! - [`lifecycle`]: cancellation before assignment and TTL cleanup;
//! - [`idle`]: idle expiry of sessions (a leader-only sweep); [`metrics`]: `/metrics`;
//! - [`snapshot_gc`]: the leader-only mark and sweep of snapshot data no Snapshot and no
//!   live Run refers to;
//! - [`leader`]: the Lease elector;
//! - [`events`]: best-effort Kubernetes Events on Runs and Runtimes;
//! - [`unschedulable`]: `Scheduled=False` with the reason a Run is not placed;
//! - [`rebalance`]: Runs a worker did not claim in time are placed again;
//! - [`provisioner`]: the worker provisioner seam; [`local`]: its local implementation
//!   (worker processes on this machine);
//! - [`runtimes`]: the Runtime controller (workers through the provisioner, Runtime
//!   status), run only by a manager built [`with_provisioner`](ControllerManager::with_provisioner).
//!
//! [`ControllerManager::run`] ties them together: it campaigns for the Lease, runs the
//! controllers while it leads, stops them the moment it no longer does, and campaigns again.

#![forbid(unsafe_code)]

mod autoscale;
pub mod checkpoints;
pub mod error;
pub mod events;
pub mod idle;
pub mod ignored;
pub mod kubernetes;
pub mod leader;
pub mod lifecycle;
pub mod local;
pub mod metrics;
pub mod placement;
pub mod provisioned;
pub mod provisioner;
pub mod rebalance;
pub mod runtimes;
pub mod scheduler;
pub mod snapshot_gc;
mod status;
pub mod unschedulable;
pub mod worker_certs;
mod workspaces;

use std::future::Future;
use std::sync::Arc;

use kube::Client;
use tokio::sync::watch;
use tracing::{info, warn};

pub use error::Error;
pub use leader::{LeaseConfig, LeaseElector};
pub use local::{LocalConfig, LocalProvisioner};
pub use provisioner::{NoProvisioner, WorkerCounts, WorkerProvisioner};

/// The Lease the controller-manager replicas compete for, by default.
pub const DEFAULT_LEASE_NAME: &str = "kruntimes-controller-manager";

/// Backoff between attempts to fence the workers of earlier incarnations.
const FENCE_RETRY_MIN: std::time::Duration = std::time::Duration::from_millis(200);
const FENCE_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(5);

/// The controller-manager's settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// The Lease election; its identity is also written into the Scheduled conditions.
    pub lease: LeaseConfig,
    /// How long a worker has to claim a Run placed on it before the Run is placed again
    /// ([`rebalance`]); default [`rebalance::CLAIM_TIMEOUT`].
    pub claim_timeout: std::time::Duration,
    /// A seam for the interleaving tests ([`rebalance::UnassignHook`]); production: none.
    pub unassign_hook: Option<rebalance::UnassignHook>,
    /// How long a session may go without a mutation before it ends Timeout/IdleTimeout
    /// ([`idle`]); a Run's `idleTimeout` may only lower it. Zero disables idle expiry.
    /// Default [`idle::DEFAULT_IDLE_TTL`] (168h).
    pub session_idle_ttl: std::time::Duration,
    /// How often the idle sweep runs; default [`idle::DEFAULT_SWEEP_INTERVAL`] (a minute).
    pub idle_sweep_interval: std::time::Duration,
    /// The root of the workers' default snapshot store (`<--snapshot-dir>/store`), which
    /// [`snapshot_gc`] collects beside every Runtime's ArtifactStore; none by default.
    pub snapshot_store: Option<std::path::PathBuf>,
    /// How often [`snapshot_gc`] runs (zero disables it); default five minutes.
    pub snapshot_gc_interval: std::time::Duration,
    /// How old unreferenced snapshot data must be to be deleted; default ten minutes.
    pub snapshot_gc_grace: std::time::Duration,
    /// The metrics this replica counts ([`metrics::Metrics::encode`] gives the text format).
    pub metrics: Arc<metrics::Metrics>,
}

impl Config {
    /// The default Lease (`kruntimes-controller-manager`) in `namespace`, default timings
    /// and a fresh identity.
    pub fn new(namespace: impl Into<String>) -> Config {
        Config {
            lease: LeaseConfig::new(namespace, DEFAULT_LEASE_NAME),
            claim_timeout: rebalance::CLAIM_TIMEOUT,
            unassign_hook: None,
            session_idle_ttl: idle::DEFAULT_IDLE_TTL,
            idle_sweep_interval: idle::DEFAULT_SWEEP_INTERVAL,
            snapshot_store: None,
            snapshot_gc_interval: snapshot_gc::DEFAULT_INTERVAL,
            snapshot_gc_grace: snapshot_gc::DEFAULT_GRACE,
            metrics: Arc::new(metrics::Metrics::default()),
        }
    }
}

/// One controller-manager replica, provisioning workers through `P` if it has one.
pub struct ControllerManager<P = NoProvisioner> {
    client: Client,
    config: Config,
    leading: watch::Sender<bool>,
    provisioner: Option<Arc<P>>,
}

impl ControllerManager {
    /// A replica that talks to the API through `client` (its own identity's client) and
    /// provisions no workers (no Runtime controller).
    pub fn new(client: Client, config: Config) -> ControllerManager {
        ControllerManager {
            client,
            config,
            leading: watch::Sender::new(false),
            provisioner: None,
        }
    }
}

impl<P: WorkerProvisioner> ControllerManager<P> {
    /// A replica that also runs the Runtime controller while it leads, provisioning each
    /// Runtime's workers through `provisioner`. The provisioner outlives leadership terms;
    /// stopping its workers for good is up to its owner (e.g.
    /// [`LocalProvisioner::shutdown`]).
    pub fn with_provisioner(
        client: Client,
        config: Config,
        provisioner: P,
    ) -> ControllerManager<P> {
        ControllerManager {
            client,
            config,
            leading: watch::Sender::new(false),
            provisioner: Some(Arc::new(provisioner)),
        }
    }

    /// This replica's Lease holder identity.
    pub fn identity(&self) -> &str {
        &self.config.lease.identity
    }

    /// Whether this replica leads: `true` once it holds the Lease and has started its
    /// controllers, `false` again only after they have stopped. For health reports and
    /// tests.
    pub fn leading(&self) -> watch::Receiver<bool> {
        self.leading.subscribe()
    }

    /// Fences the workers of earlier incarnations through the provisioner, retrying until
    /// it succeeds: nothing is scheduled before. Cancelled with the leadership term.
    async fn fence_unknown_workers(&self) {
        let Some(provisioner) = &self.provisioner else {
            return;
        };
        let mut delay = FENCE_RETRY_MIN;
        loop {
            match provisioner.fence_unknown_workers().await {
                Ok(()) => return,
                Err(error) => {
                    warn!(error = %error, "cannot fence the workers of earlier processes; nothing is scheduled until it works");
                }
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(FENCE_RETRY_MAX);
        }
    }

    /// Campaigns for the Lease and runs the scheduler, the lifecycle controller and (with a
    /// provisioner) the Runtime controller while this replica leads, until `shutdown`
    /// completes.
    ///
    /// Guarantees: each term first fences, through the provisioner, every worker Pod it
    /// does not run ([`WorkerProvisioner::fence_unknown_workers`]), so no Run is placed on a
    /// worker of an earlier incarnation; [`leading`](Self::leading) turns `true` after that.
    /// The controllers run only between a successful acquire and the moment
    /// [`LeaseElector::hold`] reports the lead lost; they are dropped (in-flight requests
    /// cancelled) at that moment, and the replica campaigns again. On `shutdown` the
    /// controllers stop and the Lease is released, so a standby takes over without waiting
    /// for expiry.
    ///
    /// Errors: a controller that stops for good ([`Error::ControllerStopped`]). API errors
    /// inside the election or a reconcile are logged and retried, never returned.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        let identity = self.config.lease.identity.clone();
        let mut elector = LeaseElector::new(self.client.clone(), self.config.lease.clone());
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return Ok(()),
                () = elector.acquire() => {}
            }
            let events = events::events(self.client.clone(), &identity);
            let controllers = async {
                self.fence_unknown_workers().await;
                self.leading.send_replace(true);
                tokio::try_join!(
                    scheduler::run(
                        self.client.clone(),
                        scheduler::Settings {
                            identity: identity.clone(),
                            claim_timeout: self.config.claim_timeout,
                            unassign_hook: self.config.unassign_hook.clone(),
                        },
                        events.clone(),
                    ),
                    lifecycle::run(self.client.clone(), events.clone()),
                    checkpoints::run(self.client.clone()),
                    snapshot_gc::run(
                        self.client.clone(),
                        snapshot_gc::Settings {
                            default_store: self.config.snapshot_store.clone(),
                            interval: self.config.snapshot_gc_interval,
                            grace: self.config.snapshot_gc_grace,
                            metrics: self.config.metrics.clone(),
                        },
                    ),
                    workspaces::run(self.client.clone(), self.config.idle_sweep_interval),
                    idle::run(
                        self.client.clone(),
                        idle::Settings {
                            ttl: self.config.session_idle_ttl,
                            interval: self.config.idle_sweep_interval,
                            metrics: self.config.metrics.clone(),
                        },
                        events.clone(),
                    ),
                    async {
                        match &self.provisioner {
                            Some(provisioner) => {
                                runtimes::run(
                                    self.client.clone(),
                                    provisioner.clone(),
                                    events.clone(),
                                )
                                .await
                            }
                            None => std::future::pending().await,
                        }
                    },
                )
                .map(|_| ())
            };
            let outcome = tokio::select! {
                () = &mut shutdown => Some(Ok(())),
                () = elector.hold() => None,
                result = controllers => Some(result),
            };
            // The controllers' future is dropped by now: no reconcile of this term runs on.
            self.leading.send_replace(false);
            match outcome {
                None => {
                    warn!(identity = %identity, "lost leadership; controllers stopped");
                }
                Some(result) => {
                    if let Err(error) = elector.release().await {
                        warn!(error = %error, "could not release the Lease; it will expire");
                    }
                    info!(identity = %identity, "controller-manager stopped");
                    return result;
                }
            }
        }
    }
}

/// What the unit tests of several modules share.
#[cfg(test)]
pub(crate) mod test_support {
    use kruntimes_api::{Runtime, RuntimeSpec};

    /// A Runtime with no workers and the default template, not yet stored.
    pub(crate) fn bare_runtime(name: &str) -> Runtime {
        Runtime::new(
            name,
            RuntimeSpec {
                replicas: 0,
                scaling: None,
                runs: None,
                template: Default::default(),
                port: None,
                artifact_store: None,
            },
        )
    }
}
