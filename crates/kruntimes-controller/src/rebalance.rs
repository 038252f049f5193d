//! Placement that rebalances: a Run Scheduled to a worker that has not claimed it (moved it
//! to Running) within the claim bound goes back to Pending and is placed elsewhere.
//!
//! A worker that does not claim what it was given has stopped, is draining, is not Ready, or
//! holds the Run back at its local gate; in every case another worker may be idle. The
//! scheduler, in its pass over the Runtime:
//! 1. finds the Scheduled Runs whose `Scheduled=True` condition is older than the bound;
//! 2. re-reads each from the API server (the cache may be behind a claim that just landed)
//!    and goes on only if the fresh Run is still Scheduled to the same Pod UID by the same
//!    placement (the same `lastTransitionTime`);
//! 3. writes it back to Pending (no assignment, `Scheduled=False/NotClaimed`, the attempt
//!    unchanged: it never started) with the fresh `resourceVersion` as precondition. A
//!    claim is a write with the same precondition, so exactly one of the two lands: a claim
//!    that wins makes the un-assign fail with a conflict, and an un-assign that wins makes
//!    the worker's claim fail and its runtimed sees a Run no longer assigned to it (the
//!    fence of stale recovery: `assignedPodUID` plus the version);
//! 4. takes the worker out of placement for one bound ([`Suspects`]), so the Run goes to
//!    another worker if there is one, and comes back to this one after that otherwise.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use kruntimes_api::lifecycle::{NOT_CLAIMED_REASON, SCHEDULED_CONDITION};
use kruntimes_api::run::RunCondition;
use kruntimes_api::{Phase, Run};
use kube::api::{Api, PostParams};
use kube::{Resource, ResourceExt};

use crate::status::{now_rfc3339, set_condition};

/// How long a worker has to claim a Run placed on it, by default.
pub const CLAIM_TIMEOUT: Duration = Duration::from_secs(30);

/// A seam for the interleaving tests: awaited after the fresh read of a Run and before its
/// un-assign is written, with the Run's name, so a test can land a claim exactly there.
/// Production passes none.
/// The future an [`UnassignHook`] returns.
pub type HookFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

#[derive(Clone)]
pub struct UnassignHook(pub Arc<dyn Fn(String) -> HookFuture + Send + Sync>);

impl std::fmt::Debug for UnassignHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UnassignHook")
    }
}

/// When the placement of a Scheduled Run was written, from its `Scheduled=True` condition.
fn placed_at(run: &Run) -> Option<Timestamp> {
    let condition = run
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == SCHEDULED_CONDITION && c.status == "True")?;
    condition.last_transition_time.as_deref()?.parse().ok()
}

/// For a Scheduled Run: `Ok(())` when its worker had `bound` to claim it and did not,
/// `Err(left)` while it still may. `None` for any other Run (and for a placement without a
/// readable time, which is never taken back).
pub fn overdue(run: &Run, now: Timestamp, bound: Duration) -> Option<Result<(), Duration>> {
    if run.phase() != Phase::Scheduled || run.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = run.status.as_ref()?;
    status.assigned_pod_uid.as_ref()?;
    let since = Duration::try_from(now.duration_since(placed_at(run)?)).unwrap_or_default();
    Some(if since >= bound {
        Ok(())
    } else {
        Err(bound - since)
    })
}

/// What an un-assign did.
#[derive(Debug)]
pub enum Unassigned {
    /// Written: the Run as it is now (Pending).
    Done(Box<Run>),
    /// The fresh Run no longer is this placement (claimed, cancelled, re-placed, gone).
    Changed,
}

/// Takes the Run back from its worker after a fresh read confirms it is still the same
/// unclaimed placement (see the module documentation). `bound` is for the message.
pub async fn unassign(
    api: &Api<Run>,
    run: &Run,
    bound: Duration,
    hook: Option<&UnassignHook>,
) -> Result<Unassigned, kube::Error> {
    let name = run.name_any();
    let Some(fresh) = api.get_opt(&name).await? else {
        return Ok(Unassigned::Changed);
    };
    let same = |r: &Run| {
        let status = r.status.as_ref();
        (
            r.uid(),
            r.phase(),
            status.and_then(|s| s.assigned_pod_uid.clone()),
            placed_at(r),
        )
    };
    if same(&fresh) != same(run)
        || fresh.metadata.deletion_timestamp.is_some()
        || fresh.spec.termination.is_some()
    {
        return Ok(Unassigned::Changed);
    }
    if let Some(hook) = hook {
        (hook.0)(name.clone()).await;
    }
    let mut updated = fresh.clone();
    let generation = updated.meta().generation;
    let status = updated.status.get_or_insert_with(Default::default);
    let pod = status.assigned_pod.take().unwrap_or_default();
    status.assigned_pod_uid = None;
    status.phase = Some(Phase::Pending);
    set_condition(
        &mut status.conditions,
        RunCondition {
            type_: SCHEDULED_CONDITION.to_string(),
            status: "False".to_string(),
            reason: Some(NOT_CLAIMED_REASON.to_string()),
            message: Some(format!(
                "worker Pod {pod} did not start the Run within {}s of its placement; it is placed again",
                bound.as_secs()
            )),
            last_transition_time: Some(now_rfc3339()),
            observed_generation: generation,
        },
    );
    match api
        .replace_status(&name, &PostParams::default(), &updated)
        .await
    {
        Ok(written) => Ok(Unassigned::Done(Box::new(written))),
        Err(kube::Error::Api(status)) if status.code == 409 || status.code == 404 => {
            Ok(Unassigned::Changed)
        }
        Err(error) => Err(error),
    }
}

/// Workers that did not claim a Run within the bound, by Pod UID: left out of placement
/// until their time is up.
#[derive(Default)]
pub(crate) struct Suspects {
    until: Mutex<HashMap<String, Instant>>,
}

impl Suspects {
    pub(crate) fn suspect(&self, pod_uid: &str, for_: Duration) {
        if let Ok(mut until) = self.until.lock() {
            let now = Instant::now();
            until.retain(|_, at| *at > now);
            until.insert(pod_uid.to_string(), now + for_);
        }
    }

    /// Whether the Pod with `uid` is left out now.
    pub(crate) fn is_suspect(&self, uid: Option<&str>) -> bool {
        let Some(uid) = uid else { return false };
        self.until
            .lock()
            .is_ok_and(|until| until.get(uid).is_some_and(|at| *at > Instant::now()))
    }
}

#[cfg(test)]
mod tests {
    use kruntimes_api::{RunSpec, RunStatus};

    use super::*;

    fn scheduled_at(secs: i64) -> Run {
        let mut run = Run::new("r", RunSpec::task("bash", "main.sh"));
        run.status = Some(RunStatus {
            phase: Some(Phase::Scheduled),
            assigned_pod: Some("p".into()),
            assigned_pod_uid: Some("uid-p".into()),
            conditions: vec![RunCondition {
                type_: SCHEDULED_CONDITION.into(),
                status: "True".into(),
                last_transition_time: Some(at(secs).to_string()),
                ..RunCondition::default()
            }],
            ..RunStatus::default()
        });
        run
    }

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + secs).expect("valid timestamp")
    }

    #[test]
    fn only_a_scheduled_run_past_the_bound_is_overdue() {
        let bound = Duration::from_secs(30);
        let run = scheduled_at(0);
        assert_eq!(
            overdue(&run, at(10), bound),
            Some(Err(Duration::from_secs(20)))
        );
        assert_eq!(overdue(&run, at(30), bound), Some(Ok(())));
        for phase in Phase::ALL {
            let mut other = scheduled_at(0);
            if let Some(s) = other.status.as_mut() {
                s.phase = Some(phase);
            }
            let expected = (phase == Phase::Scheduled).then_some(Ok(()));
            assert_eq!(overdue(&other, at(60), bound), expected, "{phase}");
        }
        let mut untimed = scheduled_at(0);
        if let Some(s) = untimed.status.as_mut() {
            s.conditions.clear();
        }
        assert_eq!(overdue(&untimed, at(60), bound), None);
    }

    #[test]
    fn a_suspect_is_left_out_for_its_time_only() {
        let suspects = Suspects::default();
        suspects.suspect("a", Duration::from_secs(60));
        suspects.suspect("b", Duration::ZERO);
        assert!(suspects.is_suspect(Some("a")));
        assert!(!suspects.is_suspect(Some("b")));
        assert!(!suspects.is_suspect(None));
    }
}
