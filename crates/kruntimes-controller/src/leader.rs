//! Leader election through a `coordination.k8s.io/v1` Lease, after client-go's
//! `leaderelection` package (kube-rs has no helper).
//!
//! Guarantees and assumptions:
//! - **One holder at a time, by optimistic concurrency.** Every acquire and renew is a
//!   create, or a replace carrying the `resourceVersion` just read; a 409 means someone
//!   else wrote first, and this candidate is not the leader this round.
//! - **Expiry is measured on the local clock**, from the moment this candidate last saw the
//!   Lease record change, never from the `renewTime` written by another machine. So clock
//!   skew between candidates cannot shorten a lease. A candidate that has just started waits
//!   a whole lease duration before it takes over a held Lease.
//! - **A leader steps down before others may take over.** [`LeaseElector::hold`] returns as
//!   soon as a renew is refused, or when no renew has succeeded for `renew_deadline`, which
//!   must be shorter than `lease_duration`; the caller then stops its work. The margin
//!   between the two is what keeps an old leader's last writes from overlapping the next
//!   leader's, since the Kubernetes API offers no fencing token.
//! - [`LeaseElector::release`] hands the Lease back on a clean shutdown, so that a successor
//!   need not wait for expiry. A crashed leader's Lease simply expires, unless its holder
//!   is known to be gone ([`LeaseConfig::predecessors_gone`]): then it is taken over at
//!   once.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::error::{Error, is_conflict};

/// Where the Lease lives, who this candidate is, and the timing of the election.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// This candidate's `holderIdentity`; unique per process (see [`LeaseConfig::new`]).
    pub identity: String,
    /// How long a Lease stays held after its last renew (written as `leaseDurationSeconds`,
    /// rounded up to whole seconds).
    pub lease_duration: Duration,
    /// How long a leader keeps leading without a successful renew. Shorter than
    /// `lease_duration`.
    pub renew_deadline: Duration,
    /// How often a candidate tries to acquire, and a leader renews.
    pub retry_period: Duration,
    /// Holders whose identity starts with this prefix, other than this candidate, are known
    /// to be gone: their Lease is taken over at once rather than after it expires. Set by
    /// [`LeaseConfig::predecessors_gone`]; `None` (the default) trusts only expiry.
    pub gone_prefix: Option<String>,
}

impl LeaseConfig {
    /// The client-go defaults (15 s lease, 10 s renew deadline, 2 s retry period) and a
    /// fresh identity: `<prefix>-<process id>-<random UUID>`.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> LeaseConfig {
        LeaseConfig {
            namespace: namespace.into(),
            name: name.into(),
            identity: format!(
                "controller-manager-{}-{}",
                std::process::id(),
                uuid::Uuid::new_v4()
            ),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            gone_prefix: None,
        }
    }

    /// The same election for a candidate that knows every earlier candidate of its kind is
    /// gone: its identity becomes `<prefix><process id>-<random UUID>`, and a Lease held by
    /// another identity with that prefix is taken over at once instead of after a whole
    /// lease duration.
    ///
    /// Assumption, which the caller must guarantee: while this candidate lives, no other
    /// process uses identities with `prefix` against this API server. `kruntimes up` does:
    /// it holds its data directory's exclusive lock for its whole life, and only it writes
    /// identities with its prefix to that directory's embedded API server, so a holder with
    /// the prefix is a `kruntimes up` that ended (a SIGKILL leaves its Lease behind).
    pub fn predecessors_gone(mut self, prefix: impl Into<String>) -> LeaseConfig {
        let prefix = prefix.into();
        self.identity = format!("{prefix}{}-{}", std::process::id(), uuid::Uuid::new_v4());
        self.gone_prefix = Some(prefix);
        self
    }

    /// Whether `holder` (not this candidate) is known to be gone.
    fn holder_is_gone(&self, holder: &str) -> bool {
        holder != self.identity
            && self
                .gone_prefix
                .as_deref()
                .is_some_and(|prefix| holder.starts_with(prefix))
    }

    fn lease_duration_seconds(&self) -> i32 {
        let secs =
            self.lease_duration.as_secs() + u64::from(self.lease_duration.subsec_nanos() > 0);
        i32::try_from(secs.max(1)).unwrap_or(i32::MAX)
    }
}

/// The last Lease record this candidate saw, and when it first saw it.
#[derive(Debug)]
struct Observed {
    spec: LeaseSpec,
    at: Instant,
}

/// One candidate in a Lease election.
pub struct LeaseElector {
    api: Api<Lease>,
    config: LeaseConfig,
    observed: Option<Observed>,
}

impl LeaseElector {
    pub fn new(client: Client, config: LeaseConfig) -> LeaseElector {
        LeaseElector {
            api: Api::namespaced(client, &config.namespace),
            config,
            observed: None,
        }
    }

    pub fn identity(&self) -> &str {
        &self.config.identity
    }

    fn lease_error(&self, action: &'static str, source: kube::Error) -> Error {
        Error::Lease {
            action,
            namespace: self.config.namespace.clone(),
            name: self.config.name.clone(),
            source,
        }
    }

    fn observe(&mut self, spec: &LeaseSpec) {
        let changed = self.observed.as_ref().is_none_or(|o| &o.spec != spec);
        if changed {
            self.observed = Some(Observed {
                spec: spec.clone(),
                at: Instant::now(),
            });
        }
    }

    /// One election round: creates the Lease, renews it if this candidate holds it, or
    /// takes it over if its holder let it expire. `Ok(true)` means this candidate leads
    /// until at least `renew_deadline` from now.
    ///
    /// Errors are API failures other than a lost race; a lost race is `Ok(false)`.
    pub async fn try_acquire_or_renew(&mut self) -> Result<bool, Error> {
        let now = MicroTime(Timestamp::now());
        let current = self
            .api
            .get_opt(&self.config.name)
            .await
            .map_err(|e| self.lease_error("read", e))?;
        let Some(mut lease) = current else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.config.name.clone()),
                    namespace: Some(self.config.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.config.identity.clone()),
                    lease_duration_seconds: Some(self.config.lease_duration_seconds()),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(created) => {
                    self.observe(&created.spec.unwrap_or_default());
                    Ok(true)
                }
                Err(error) if is_conflict(&error) || is_already_exists(&error) => Ok(false),
                Err(error) => Err(self.lease_error("create", error)),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        self.observe(&spec);
        let holder = spec.holder_identity.as_deref().filter(|h| !h.is_empty());
        let held_by_me = holder == Some(self.config.identity.as_str());
        if let (Some(holder), false) = (holder, held_by_me) {
            let duration = spec
                .lease_duration_seconds
                .and_then(|s| u64::try_from(s).ok())
                .map_or(self.config.lease_duration, Duration::from_secs);
            let seen = self.observed.as_ref().map_or_else(Instant::now, |o| o.at);
            if self.config.holder_is_gone(holder) {
                info!(
                    previous = holder,
                    "the Lease's holder is an earlier process that is gone; taking it over now"
                );
            } else if seen.elapsed() < duration {
                debug!(holder, "Lease is held by another candidate");
                return Ok(false);
            } else {
                info!(previous = holder, "Lease expired; taking it over");
            }
        }
        let mut next = spec.clone();
        next.holder_identity = Some(self.config.identity.clone());
        next.lease_duration_seconds = Some(self.config.lease_duration_seconds());
        next.renew_time = Some(now.clone());
        if !held_by_me {
            next.acquire_time = Some(now);
            next.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
        }
        lease.spec = Some(next);
        match self
            .api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
        {
            Ok(updated) => {
                self.observe(&updated.spec.unwrap_or_default());
                Ok(true)
            }
            Err(error) if is_conflict(&error) => Ok(false),
            Err(error) => Err(self.lease_error("update", error)),
        }
    }

    /// Waits until this candidate leads, trying every `retry_period`. API errors are logged
    /// and retried; they never end the wait.
    pub async fn acquire(&mut self) {
        loop {
            match self.try_acquire_or_renew().await {
                Ok(true) => {
                    info!(identity = %self.config.identity, lease = %self.config.name, "became leader");
                    return;
                }
                Ok(false) => {}
                Err(error) => warn!(error = %error, "leader election round failed"),
            }
            tokio::time::sleep(self.config.retry_period).await;
        }
    }

    /// Renews the Lease every `retry_period` while this candidate leads, and returns once it
    /// no longer does: another holder won a round, or no renew succeeded within
    /// `renew_deadline`. Each renew is itself bounded by the time left to the deadline.
    pub async fn hold(&mut self) {
        let mut last_renew = Instant::now();
        loop {
            tokio::time::sleep(self.config.retry_period).await;
            let deadline = last_renew + self.config.renew_deadline;
            let attempt = tokio::time::timeout_at(deadline, self.try_acquire_or_renew()).await;
            match attempt {
                Ok(Ok(true)) => last_renew = Instant::now(),
                Ok(Ok(false)) => {
                    warn!(identity = %self.config.identity, "lost the Lease to another candidate");
                    return;
                }
                Ok(Err(error)) => warn!(error = %error, "renewing the Lease failed"),
                Err(_) => {}
            }
            if Instant::now() >= deadline {
                warn!(
                    identity = %self.config.identity,
                    "no renew within the renew deadline; stepping down"
                );
                return;
            }
        }
    }

    /// Hands the Lease back if this candidate holds it, so that another may take over at
    /// once. A lost race is not an error: the Lease is then someone else's already.
    pub async fn release(&mut self) -> Result<(), Error> {
        let current = self
            .api
            .get_opt(&self.config.name)
            .await
            .map_err(|e| self.lease_error("read", e))?;
        let Some(mut lease) = current else {
            return Ok(());
        };
        let mut spec = lease.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        lease.spec = Some(spec);
        match self
            .api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => {
                info!(identity = %self.config.identity, "released the Lease");
                Ok(())
            }
            Err(error) if is_conflict(&error) => Ok(()),
            Err(error) => Err(self.lease_error("release", error)),
        }
    }
}

fn is_already_exists(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.reason == "AlreadyExists")
}
