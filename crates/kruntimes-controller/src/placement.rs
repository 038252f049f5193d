//! Placement: which Pending Runs of one Runtime go to which worker Pods, computed from a
//! consistent view of the Runs and Pods. Pure: no I/O, no clock.
//!
//! The rules:
//! - A worker is a Pod of the Runtime with a `status.podIP`, a `Ready=True` condition, a UID
//!   and no `deletionTimestamp`. Anything else gets nothing.
//! - A worker has `runs` slots (the Runtime's `spec.runs`, default 1). Every Run whose phase
//!   [`holds_capacity`](kruntimes_api::Phase::holds_capacity) and whose `status.assignedPod`
//!   names the worker uses `spec.resources.requests.runs` of them (default 1).
//! - Pending Runs are taken strictly first-in first-out, by `creationTimestamp` then name.
//!   Each goes to the worker with the most free slots (ties by Pod name), which spreads load
//!   over warm workers. When the head of the queue fits nowhere, placement stops, so a later,
//!   smaller Run never overtakes it. A Run that asks for more slots than a worker has can
//!   never fit; it is skipped rather than left to block the queue for ever.
//! - Runs with a termination request or a `deletionTimestamp` are not placed: they are being
//!   cancelled or deleted.

use std::cmp::Reverse;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kruntimes_api::Run;

/// One Run placed on one worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Index of the Run in the slice given to [`plan`].
    pub run: usize,
    pub pod_name: String,
    pub pod_uid: String,
}

/// What [`plan`] decided.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Runs to schedule, in FIFO order.
    pub placements: Vec<Placement>,
    /// Runs that ask for more slots than any worker has (indices into the Run slice).
    pub never_fits: Vec<usize>,
    /// Pending Runs left waiting for capacity.
    pub waiting: usize,
    /// Those Runs (indices into the Run slice), in FIFO order.
    pub waiting_runs: Vec<usize>,
}

/// A Pod that may receive Runs: addressable, Ready, not deleting.
pub fn is_ready_worker(pod: &Pod) -> bool {
    if pod.metadata.deletion_timestamp.is_some() || pod.metadata.uid.is_none() {
        return false;
    }
    let Some(status) = pod.status.as_ref() else {
        return false;
    };
    let has_ip = status.pod_ip.as_deref().is_some_and(|ip| !ip.is_empty());
    let ready = status
        .conditions
        .as_deref()
        .unwrap_or_default()
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    has_ip && ready
}

/// A Pending Run the scheduler may place now.
pub fn is_queued(run: &Run) -> bool {
    run.phase().is_schedulable()
        && run.spec.termination.is_none()
        && run.metadata.deletion_timestamp.is_none()
        && run.metadata.name.is_some()
}

/// Slots held on each worker (by Pod name) by the Runs that hold capacity.
pub fn used_slots(runs: &[Run]) -> BTreeMap<&str, i64> {
    let mut used: BTreeMap<&str, i64> = BTreeMap::new();
    for run in runs {
        if !run.phase().holds_capacity() {
            continue;
        }
        if let Some(pod) = run.status.as_ref().and_then(|s| s.assigned_pod.as_deref()) {
            *used.entry(pod).or_default() += i64::from(run.spec.requested_runs());
        }
    }
    used
}

/// Places the Pending Runs of one Runtime onto its ready workers.
///
/// `runs` are the Runtime's non-terminal Runs (Pending and active), `pods` its Pods and
/// `runs_per_worker` the Runtime's `spec.runs`. The result never overcommits a worker,
/// given that `runs` includes every Run holding capacity on these Pods.
pub fn plan(runs_per_worker: i32, pods: &[Pod], runs: &[Run]) -> Plan {
    let capacity = i64::from(runs_per_worker);
    let used = used_slots(runs);
    // (free slots, name, uid), in Pod name order.
    let mut workers: Vec<(i64, &str, &str)> = pods
        .iter()
        .filter(|pod| is_ready_worker(pod))
        .filter_map(|pod| {
            let name = pod.metadata.name.as_deref()?;
            let uid = pod.metadata.uid.as_deref()?;
            let free = capacity - used.get(name).copied().unwrap_or(0);
            Some((free, name, uid))
        })
        .collect();
    workers.sort_by(|a, b| a.1.cmp(b.1));

    let mut queue: Vec<usize> = (0..runs.len()).filter(|&i| is_queued(&runs[i])).collect();
    queue.sort_by(|&a, &b| {
        let key = |run: &Run| {
            (
                run.metadata.creation_timestamp.as_ref().map(|t| t.0),
                run.metadata.name.clone(),
            )
        };
        key(&runs[a]).cmp(&key(&runs[b]))
    });

    let mut plan = Plan::default();
    let (queue, never_fits): (Vec<usize>, Vec<usize>) = queue
        .into_iter()
        .partition(|&i| i64::from(runs[i].spec.requested_runs()) <= capacity);
    plan.never_fits = never_fits;
    for (position, &index) in queue.iter().enumerate() {
        let wanted = i64::from(runs[index].spec.requested_runs());
        // The worker with the most free slots; the first in name order among equals.
        let best = workers
            .iter_mut()
            .filter(|w| w.0 >= wanted)
            .min_by_key(|w| (Reverse(w.0), w.1));
        let Some(worker) = best else {
            plan.waiting = queue.len() - position;
            plan.waiting_runs = queue[position..].to_vec();
            break;
        };
        worker.0 -= wanted;
        plan.placements.push(Placement {
            run: index,
            pod_name: worker.1.to_string(),
            pod_uid: worker.2.to_string(),
        });
    }
    plan
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;
    use kruntimes_api::run::{RunRequests, RunResources, Termination, TerminationMode};
    use kruntimes_api::{Phase, RunSpec, RunStatus};
    use kube::api::ObjectMeta;

    use super::*;

    fn pod(name: &str, ready: bool) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                uid: Some(format!("uid-{name}")),
                ..ObjectMeta::default()
            },
            spec: None,
            status: Some(PodStatus {
                pod_ip: Some("10.0.0.1".into()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    ..PodCondition::default()
                }]),
                ..PodStatus::default()
            }),
        }
    }

    fn run(name: &str, created_secs: i64) -> Run {
        let mut run = Run::new(name, RunSpec::task("bash", "main.sh"));
        run.metadata.creation_timestamp = Some(Time(
            Timestamp::from_second(1_700_000_000 + created_secs).expect("valid timestamp"),
        ));
        run
    }

    fn with_phase(mut run: Run, phase: Phase, pod: &str) -> Run {
        run.status = Some(RunStatus {
            phase: Some(phase),
            assigned_pod: Some(pod.into()),
            ..RunStatus::default()
        });
        run
    }

    fn names(runs: &[Run], plan: &Plan) -> Vec<(String, String)> {
        plan.placements
            .iter()
            .map(|p| {
                (
                    runs[p.run].metadata.name.clone().unwrap_or_default(),
                    p.pod_name.clone(),
                )
            })
            .collect()
    }

    #[test]
    fn fifo_by_creation_time_then_name() {
        let runs = vec![run("c", 2), run("b", 1), run("a", 2), run("z", 0)];
        let plan = plan(2, &[pod("p1", true)], &runs);
        assert_eq!(
            names(&runs, &plan),
            vec![("z".into(), "p1".into()), ("b".into(), "p1".into())]
        );
        assert_eq!(plan.waiting, 2);
    }

    #[test]
    fn capacity_counts_every_phase_that_holds_it() {
        for phase in Phase::ALL {
            let runs = vec![with_phase(run("held", 0), phase, "p1"), run("new", 1)];
            let plan = plan(1, &[pod("p1", true)], &runs);
            let placed = !plan.placements.is_empty();
            assert_eq!(placed, !phase.holds_capacity(), "{phase}");
        }
    }

    #[test]
    fn spreads_over_the_freest_worker_and_never_overcommits() {
        let runs: Vec<Run> = (0..10).map(|i| run(&format!("r{i:02}"), i)).collect();
        let plan = plan(2, &[pod("p2", true), pod("p1", true)], &runs);
        assert_eq!(
            names(&runs, &plan),
            vec![
                ("r00".into(), "p1".into()),
                ("r01".into(), "p2".into()),
                ("r02".into(), "p1".into()),
                ("r03".into(), "p2".into()),
            ]
        );
        assert_eq!(plan.waiting, 6);
    }

    #[test]
    fn unready_deleting_and_addressless_pods_get_nothing() {
        let mut deleting = pod("deleting", true);
        deleting.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        let mut no_ip = pod("no-ip", true);
        if let Some(status) = no_ip.status.as_mut() {
            status.pod_ip = None;
        }
        let runs = vec![run("a", 0)];
        let plan = plan(4, &[pod("unready", false), deleting, no_ip], &runs);
        assert!(plan.placements.is_empty());
        assert_eq!(plan.waiting, 1);
    }

    #[test]
    fn head_of_line_blocks_and_oversized_runs_are_skipped() {
        let mut big = run("big", 0);
        big.spec.resources = Some(RunResources {
            requests: Some(RunRequests { runs: Some(2) }),
        });
        let mut huge = run("huge", 0);
        huge.spec.resources = Some(RunResources {
            requests: Some(RunRequests { runs: Some(9) }),
        });
        let runs = vec![
            with_phase(run("held", 0), Phase::Running, "p1"),
            huge,
            big,
            run("small", 1),
        ];
        let plan = plan(2, &[pod("p1", true)], &runs);
        assert!(plan.placements.is_empty(), "big blocks small: {plan:?}");
        assert_eq!(plan.never_fits, vec![1]);
        assert_eq!(plan.waiting, 2);
    }

    #[test]
    fn cancelled_or_deleting_pending_runs_are_not_placed() {
        let mut cancelled = run("cancelled", 0);
        cancelled.spec.termination = Some(Termination {
            mode: TerminationMode::Immediate,
        });
        let mut deleting = run("deleting", 0);
        deleting.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        let runs = vec![cancelled, deleting, run("ok", 1)];
        let plan = plan(4, &[pod("p1", true)], &runs);
        assert_eq!(names(&runs, &plan), vec![("ok".into(), "p1".into())]);
    }
}
