//! Placement: which Pending Runs of one Runtime go to which worker Pods, computed from a
//! consistent view of the Runs and Pods. Pure: no I/O, no clock.
//!
//! The rules:
//! - A worker is a Pod of the Runtime with a `status.podIP`, a `Ready=True` condition, a UID
//!   and no `deletionTimestamp`. Anything else gets nothing.
//! - A worker has `runs` slots (the Runtime's `spec.runs`, default 1). Every Run whose phase
//!   [`holds_capacity`](kruntimes_api::Phase::holds_capacity) and whose `status.assignedPod`
//!   names the worker holds [`capacity::slots`] of them: `spec.resources.requests.runs`
//!   (default 1), or every slot for an exclusive session. Tasks, functions and sessions
//!   share a worker; whether a Run fits is [`capacity::fits`], the rule runtimed's local
//!   gate applies too, so nothing is placed where the gate would refuse it. An exclusive
//!   session therefore goes only to a worker that holds nothing.
//! - A worker marked [`RETIRING_ANNOTATION`] (the autoscaler is removing it) gets nothing.
//! - Pending Runs are taken strictly first-in first-out, by `creationTimestamp` then name.
//!   Each goes to the worker with the most free slots (ties by Pod name), which spreads load
//!   over warm workers. When the head of the queue fits nowhere, placement stops, so a later,
//!   smaller Run never overtakes it. A Run that asks for more slots than a worker has can
//!   never fit; it is skipped rather than left to block the queue for ever.
//! - Runs with a termination request or a `deletionTimestamp` are not placed: they are being
//!   cancelled or deleted. Nor is a resumed session suspended again before it was placed
//!   (`spec.suspend: true` with a `status.snapshot`): the lifecycle controller sends it
//!   back to Suspended.
//! - A resumed session may name a preferred worker ([`plan_preferring`]: the worker that
//!   keeps its Snapshot's local copy, by Pod name and UID). It goes there when that worker
//!   is a ready worker here (same UID: a replaced Pod of the same name has no copy) and it
//!   fits; otherwise it is placed as any other Run. The preference never reorders the queue.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kruntimes_api::Run;
use kruntimes_api::capacity;

/// The annotation on a worker Pod that the autoscaler is removing: the scheduler places
/// nothing more there, and the provisioner stops it first when `spec.replicas` drops.
pub const RETIRING_ANNOTATION: &str = "kruntimes.io/retiring";

/// The `spec.replicas` that no longer counts a retiring `pod` (the number its mark carries).
pub fn retired_at(pod: &Pod) -> Option<i32> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(RETIRING_ANNOTATION))
        .and_then(|value| value.parse().ok())
}

/// Whether the autoscaler marked `pod` for removal.
pub fn is_retiring(pod: &Pod) -> bool {
    pod.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(RETIRING_ANNOTATION))
}

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
    let resuspended = run.spec.suspend_requested()
        && (run.status.as_ref().is_some_and(|s| s.snapshot.is_some()) || run.spec.is_fork());
    run.phase().is_schedulable()
        && !resuspended
        && run.spec.termination.is_none()
        && run.metadata.deletion_timestamp.is_none()
        && run.metadata.name.is_some()
}

/// Slots held on each worker (by Pod name) by the Runs that hold capacity, on workers of
/// `runs_per_worker` slots.
pub fn used_slots(runs: &[Run], runs_per_worker: i32) -> BTreeMap<&str, i64> {
    let mut used: BTreeMap<&str, i64> = BTreeMap::new();
    for run in runs {
        if !run.phase().holds_capacity() {
            continue;
        }
        if let Some(pod) = run.status.as_ref().and_then(|s| s.assigned_pod.as_deref()) {
            *used.entry(pod).or_default() += capacity::slots(&run.spec, runs_per_worker);
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
    plan_preferring(runs_per_worker, pods, runs, |_| None)
}

/// A preferred worker of a Run: its Pod name and, when known, UID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preferred {
    pub pod_name: String,
    pub pod_uid: Option<String>,
}

/// [`plan`], where `preferred` names the worker a Run should go to when it can (see the
/// module's rules).
pub fn plan_preferring(
    runs_per_worker: i32,
    pods: &[Pod],
    runs: &[Run],
    preferred: impl Fn(&Run) -> Option<Preferred>,
) -> Plan {
    let used = used_slots(runs, runs_per_worker);
    // (used slots, name, uid), in Pod name order.
    let mut workers: Vec<(i64, &str, &str)> = pods
        .iter()
        .filter(|pod| is_ready_worker(pod) && !is_retiring(pod))
        .filter_map(|pod| {
            let name = pod.metadata.name.as_deref()?;
            let uid = pod.metadata.uid.as_deref()?;
            Some((used.get(name).copied().unwrap_or(0), name, uid))
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
        .partition(|&i| capacity::fits_any_worker(&runs[i].spec, runs_per_worker));
    plan.never_fits = never_fits;
    for (position, &index) in queue.iter().enumerate() {
        let spec = &runs[index].spec;
        let wanted = capacity::slots(spec, runs_per_worker);
        // The preferred worker when it is here and has room; else the worker with the most
        // free slots (the fewest used), the first in name order among equals.
        let wish = preferred(&runs[index]);
        let preferred_index = wish.and_then(|wish| {
            workers.iter().position(|w| {
                w.1 == wish.pod_name
                    && wish.pod_uid.as_deref().is_none_or(|uid| uid == w.2)
                    && capacity::fits(spec, runs_per_worker, w.0)
            })
        });
        let best = match preferred_index {
            Some(i) => workers.get_mut(i),
            None => workers
                .iter_mut()
                .filter(|w| capacity::fits(spec, runs_per_worker, w.0))
                .min_by_key(|w| (w.0, w.1)),
        };
        let Some(worker) = best else {
            plan.waiting = queue.len() - position;
            plan.waiting_runs = queue[position..].to_vec();
            break;
        };
        worker.0 += wanted;
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
    fn a_resumed_session_prefers_its_local_copy_when_that_worker_has_room() {
        let runs = vec![run("a", 0), run("resumed", 1), run("b", 2)];
        let prefer = |name: &'static str, uid: Option<&'static str>| {
            move |r: &Run| {
                (r.metadata.name.as_deref() == Some("resumed")).then(|| Preferred {
                    pod_name: name.into(),
                    pod_uid: uid.map(str::to_string),
                })
            }
        };
        let pods = [pod("p1", true), pod("p2", true), pod("p3", false)];
        // Without a preference: the freest worker, by name among equals.
        assert_eq!(
            names(&runs, &plan(2, &pods, &runs)),
            vec![
                ("a".into(), "p1".into()),
                ("resumed".into(), "p2".into()),
                ("b".into(), "p1".into())
            ]
        );
        // With one: p1 although p2 is freer; the queue order is unchanged.
        let placed = plan_preferring(2, &pods, &runs, prefer("p1", Some("uid-p1")));
        assert_eq!(
            names(&runs, &placed),
            vec![
                ("a".into(), "p1".into()),
                ("resumed".into(), "p1".into()),
                ("b".into(), "p2".into())
            ]
        );
        // A preferred worker that is full, not ready, replaced (another UID) or unknown is
        // passed over for the usual choice.
        for (name, uid) in [("p3", None), ("p1", Some("uid-other")), ("gone", None)] {
            let placed = plan_preferring(2, &pods, &runs, prefer(name, uid));
            assert_eq!(placed.placements[1].pod_name, "p2", "{name} {uid:?}");
        }
        let full = plan_preferring(1, &pods, &runs, prefer("p1", None));
        assert_eq!(full.placements[1].pod_name, "p2");
    }

    #[test]
    fn a_resumed_session_suspended_again_is_not_placed() {
        let mut r = run("resumed", 0);
        r.spec.suspend = Some(true);
        r.status = Some(RunStatus {
            phase: Some(Phase::Pending),
            snapshot: Some(kruntimes_api::run::RunSnapshotRef {
                name: "s-1".into(),
                uri: None,
                last_sequence: None,
            }),
            ..RunStatus::default()
        });
        assert!(!is_queued(&r));
        // Without a snapshot it is placed: it is captured once Ready.
        if let Some(status) = r.status.as_mut() {
            status.snapshot = None;
        }
        assert!(is_queued(&r));
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
            ..RunResources::default()
        });
        let mut huge = run("huge", 0);
        huge.spec.resources = Some(RunResources {
            requests: Some(RunRequests { runs: Some(9) }),
            ..RunResources::default()
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

    fn session(name: &str, created_secs: i64, exclusive: bool) -> Run {
        let mut run = run(name, created_secs);
        run.spec = serde_json::from_value(serde_json::json!({
            "runtime": "bash",
            "mode": {"session": {}},
            "resources": {"exclusive": exclusive},
        }))
        .expect("a session spec");
        run
    }

    #[test]
    fn sessions_share_workers_with_other_runs() {
        let runs = vec![
            with_phase(run("task", 0), Phase::Running, "p1"),
            with_phase(session("held", 0, false), Phase::Ready, "p1"),
            session("s1", 1, false),
            session("s2", 2, false),
            run("t2", 3),
        ];
        let plan = plan(4, &[pod("p1", true)], &runs);
        assert_eq!(
            names(&runs, &plan),
            vec![("s1".into(), "p1".into()), ("s2".into(), "p1".into())]
        );
        assert_eq!(plan.waiting_runs, vec![4]);
    }

    #[test]
    fn an_exclusive_session_goes_only_to_an_empty_worker_and_fills_it() {
        // p1 holds a task; p2 is empty: the exclusive session goes to p2, and then nothing
        // else joins it there while p1 has room.
        let runs = vec![
            with_phase(run("task", 0), Phase::Running, "p1"),
            session("alone", 1, true),
            run("t2", 2),
            run("t3", 3),
        ];
        let placed = super::plan(4, &[pod("p1", true), pod("p2", true)], &runs);
        assert_eq!(
            names(&runs, &placed),
            vec![
                ("alone".into(), "p2".into()),
                ("t2".into(), "p1".into()),
                ("t3".into(), "p1".into()),
            ]
        );
        // With no empty worker it waits at the head of the queue.
        let runs = vec![
            with_phase(run("task", 0), Phase::Running, "p1"),
            session("alone", 1, true),
            run("t2", 2),
        ];
        let placed = super::plan(4, &[pod("p1", true)], &runs);
        assert!(placed.placements.is_empty(), "{placed:?}");
        assert_eq!(placed.waiting_runs, vec![1, 2]);
        // Held, it fills its worker.
        let runs = vec![
            with_phase(session("alone", 0, true), Phase::Ready, "p1"),
            run("t2", 1),
            session("s", 2, false),
        ];
        let placed = super::plan(4, &[pod("p1", true)], &runs);
        assert!(placed.placements.is_empty(), "{placed:?}");
    }

    #[test]
    fn retiring_workers_get_nothing() {
        let mut retiring = pod("p1", true);
        retiring.metadata.annotations = Some(
            [(RETIRING_ANNOTATION.to_string(), "true".to_string())]
                .into_iter()
                .collect(),
        );
        let runs = vec![run("a", 0)];
        let plan = plan(4, &[retiring, pod("p2", true)], &runs);
        assert_eq!(names(&runs, &plan), vec![("a".into(), "p2".into())]);
    }
}
