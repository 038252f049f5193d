//! The controller-manager against the real embedded API server: scheduling order, capacity,
//! worker readiness, cancellation before assignment, TTL cleanup and leader election.
//!
//! Worker Pods are real API objects created by the admin, standing in for workers as the
//! local provisioner will publish them. The controller runs with its own least-privilege
//! identity. Every wait is a watch with a deadline.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use common::{RunWatch, WAIT, assigned, in_phase, scheduled_message, start};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kruntimes_api::run::{Termination, TerminationMode};
use kruntimes_api::{Phase, Run, Runtime};
use kruntimes_controller::{
    Config, ControllerManager, LeaseConfig, LeaseElector, WorkerCounts, WorkerProvisioner,
};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;

/// Fails when any worker holds more than `per_pod` slots, or any Run is assigned to a Pod
/// outside `allowed`.
fn check_capacity(runs: &[Arc<Run>], per_pod: usize, allowed: &[&str]) -> Result<()> {
    let mut held: BTreeMap<&str, usize> = BTreeMap::new();
    for run in runs {
        if let Some(pod) = assigned(run) {
            ensure!(
                allowed.contains(&pod),
                "Run {} was assigned to Pod {pod}, which must get nothing",
                run.name_any()
            );
            if run.phase().holds_capacity() {
                *held.entry(pod).or_default() += 1;
            }
        }
    }
    for (pod, count) in held {
        ensure!(
            count <= per_pod,
            "Pod {pod} holds {count} Runs, more than {per_pod}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_runs_are_scheduled_fifo() -> Result<()> {
    let env = start().await?;
    let (_identity, manager) = env.spawn_manager("fifo");
    env.runtime("rt", 1).await?;
    // The only worker is not ready yet, so every Run is queued before any is placed.
    env.worker("w1", "rt", false).await?;
    let mut created = Vec::new();
    for name in ["r4", "r3", "r2", "r1", "r0"] {
        let run = env.run(name, "rt", |_| {}).await?;
        created.push((
            run.metadata.creation_timestamp.map(|t| t.0),
            name.to_string(),
        ));
    }
    created.sort();
    let expected: Vec<String> = created.into_iter().map(|(_, name)| name).collect();
    env.set_ready("w1", true).await?;

    let mut watch = RunWatch::new(env.runs());
    let mut order = Vec::new();
    for _ in 0..expected.len() {
        let done = order.len();
        let next = watch
            .until("the next Run to be Scheduled", WAIT, |runs| {
                check_capacity(runs, 1, &["w1"])?;
                let scheduled = in_phase(runs, Phase::Scheduled);
                let finished = in_phase(runs, Phase::Succeeded).len();
                Ok(match scheduled.as_slice() {
                    [one] if finished == done => Some(one.clone()),
                    _ => None,
                })
            })
            .await?;
        env.finish(&next, Phase::Succeeded).await?;
        order.push(next);
    }
    assert_eq!(
        order, expected,
        "Runs are placed by creationTimestamp, then name"
    );
    manager.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_is_respected_and_freed_slots_are_refilled() -> Result<()> {
    let env = start().await?;
    env.runtime("rt", 2).await?;
    env.worker("w1", "rt", true).await?;
    env.worker("w2", "rt", true).await?;
    for i in 0..10 {
        env.run(&format!("r{i}"), "rt", |_| {}).await?;
    }
    let (identity, manager) = env.spawn_manager("capacity");
    let mut watch = RunWatch::new(env.runs());
    let first = watch
        .until("4 Runs Scheduled", WAIT, |runs| {
            check_capacity(runs, 2, &["w1", "w2"])?;
            let scheduled = in_phase(runs, Phase::Scheduled);
            Ok((scheduled.len() == 4).then_some(scheduled))
        })
        .await?;
    // The scheduled Runs carry the assignment in full.
    for run in env.runs().list(&Default::default()).await?.items {
        let status = run.status.clone().unwrap_or_default();
        if run.phase() == Phase::Scheduled {
            let pod = status.assigned_pod.as_deref().unwrap_or_default();
            ensure!(pod == "w1" || pod == "w2", "assignedPod {pod:?}");
            ensure!(status.assigned_pod_uid.is_some(), "assignedPodUID is set");
            let condition = status
                .conditions
                .iter()
                .find(|c| c.type_ == "Scheduled")
                .cloned()
                .unwrap_or_default();
            ensure!(
                condition.status == "True",
                "Scheduled condition {condition:?}"
            );
            ensure!(condition.last_transition_time.is_some(), "{condition:?}");
            ensure!(
                scheduled_message(&run).is_some_and(|m| m.contains(&identity)),
                "the condition names the scheduler"
            );
        } else {
            ensure!(
                run.phase() == Phase::Pending,
                "{} is {}",
                run.name_any(),
                run.phase()
            );
        }
    }

    // Ending Runs frees their slots, which are refilled; never more than 2 per worker.
    let mut done = 0usize;
    let mut to_finish = first;
    while done < 10 {
        let name = to_finish.remove(0);
        env.finish(&name, Phase::Succeeded).await?;
        done += 1;
        let expect_held = (10 - done).min(4);
        to_finish = watch
            .until("the freed slot to be refilled", WAIT, |runs| {
                check_capacity(runs, 2, &["w1", "w2"])?;
                let scheduled = in_phase(runs, Phase::Scheduled);
                let finished = in_phase(runs, Phase::Succeeded).len();
                Ok((finished == done && scheduled.len() == expect_held).then_some(scheduled))
            })
            .await?;
    }
    manager.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unready_and_deleting_pods_get_nothing() -> Result<()> {
    let env = start().await?;
    let (_identity, manager) = env.spawn_manager("readiness");
    env.runtime("rt", 1).await?;
    env.worker("unready", "rt", false).await?;
    env.worker("deleting", "rt", true).await?;
    env.delete_pod("deleting").await?;
    let deleting = Api::<Pod>::namespaced(env.admin.clone(), common::NS)
        .get("deleting")
        .await?;
    ensure!(
        deleting.metadata.deletion_timestamp.is_some(),
        "the Pod held by a finalizer is deleting, not gone"
    );
    env.run("a", "rt", |_| {}).await?;
    env.run("b", "rt", |_| {}).await?;
    let mut watch = RunWatch::new(env.runs());
    watch
        .until("both Runs seen Pending", WAIT, |runs| {
            check_capacity(runs, 1, &["good"])?;
            Ok((in_phase(runs, Phase::Pending).len() == 2).then_some(()))
        })
        .await?;
    // A ready worker appears: exactly one Run goes there, the other keeps waiting.
    env.worker("good", "rt", true).await?;
    let scheduled = watch
        .until("one Run Scheduled on the ready worker", WAIT, |runs| {
            check_capacity(runs, 1, &["good"])?;
            let scheduled = in_phase(runs, Phase::Scheduled);
            Ok((scheduled.len() == 1).then_some(scheduled))
        })
        .await?;
    assert_eq!(scheduled, vec!["a".to_string()]);
    // The unready worker becomes ready: the other Run goes there.
    env.set_ready("unready", true).await?;
    watch
        .until(
            "the second Run Scheduled on the now ready worker",
            WAIT,
            |runs| {
                check_capacity(runs, 1, &["good", "unready"])?;
                let b = runs.iter().find(|r| r.name_any() == "b");
                Ok(b.filter(|b| b.phase() == Phase::Scheduled)
                    .map(|b| assigned(b) == Some("unready")))
            },
        )
        .await?
        .then_some(())
        .ok_or_else(|| anyhow::anyhow!("b went to the wrong Pod"))?;
    manager.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn termination_before_assignment_cancels() -> Result<()> {
    let env = start().await?;
    let (_identity, manager) = env.spawn_manager("cancel");
    env.runtime("rt", 1).await?;
    // A Run asked to end from the start is never placed, even on a free worker.
    env.worker("w1", "rt", true).await?;
    env.run("doomed", "rt", |spec| {
        spec.termination = Some(Termination {
            mode: TerminationMode::Immediate,
        });
    })
    .await?;
    // A Run that waits behind a busy worker, then is cancelled.
    env.run("busy", "rt", |_| {}).await?;
    env.run("waiting", "rt", |_| {}).await?;
    let mut watch = RunWatch::new(env.runs());
    watch
        .until(
            "doomed Cancelled, busy Scheduled, waiting Pending",
            WAIT,
            |runs| {
                check_capacity(runs, 1, &["w1"])?;
                for run in runs {
                    if run.name_any() == "doomed" && assigned(run).is_some() {
                        bail!("a Run with a termination request was scheduled");
                    }
                }
                Ok((in_phase(runs, Phase::Cancelled) == ["doomed"]
                    && in_phase(runs, Phase::Scheduled) == ["busy"]
                    && in_phase(runs, Phase::Pending) == ["waiting"])
                .then_some(()))
            },
        )
        .await?;
    env.terminate("waiting").await?;
    // A Run of a Runtime that does not exist can still be cancelled.
    env.run("orphan", "no-such-runtime", |_| {}).await?;
    env.terminate("orphan").await?;
    watch
        .until("waiting and orphan Cancelled", WAIT, |runs| {
            check_capacity(runs, 1, &["w1"])?;
            Ok((in_phase(runs, Phase::Cancelled) == ["doomed", "orphan", "waiting"]).then_some(()))
        })
        .await?;
    for name in ["doomed", "waiting", "orphan"] {
        let run = env.runs().get(name).await?;
        let status = run.status.unwrap_or_default();
        assert_eq!(status.reason.as_deref(), Some("Cancelled"), "{name}");
        assert!(
            status.completion_time.is_some(),
            "{name} has a completionTime"
        );
        assert!(status.assigned_pod.is_none(), "{name} was never assigned");
    }
    manager.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_runs_are_deleted_after_their_ttl() -> Result<()> {
    let env = start().await?;
    let (_identity, manager) = env.spawn_manager("ttl");
    env.runtime("rt", 1).await?;
    env.run("short", "rt", |spec| {
        spec.ttl_seconds_after_finished = Some(2)
    })
    .await?;
    env.run("kept", "rt", |_| {}).await?;
    let mut watch = RunWatch::new(env.runs());
    watch
        .until("both Runs seen", WAIT, |runs| {
            Ok((runs.len() == 2).then_some(()))
        })
        .await?;
    let finished_at = Instant::now();
    env.finish("short", Phase::Failed).await?;
    env.finish("kept", Phase::Succeeded).await?;
    watch
        .until("short deleted", WAIT, |runs| {
            let names: Vec<String> = runs.iter().map(|r| r.name_any()).collect();
            ensure!(names.contains(&"kept".to_string()), "kept has no TTL");
            Ok((names == ["kept"]).then_some(()))
        })
        .await?;
    let waited = finished_at.elapsed();
    assert!(
        waited >= Duration::from_millis(1900),
        "deleted {waited:?} after completion, before its 2 s TTL"
    );
    // The TTL is mutable: set on a Run that finished long enough ago, it deletes at once.
    let patch = serde_json::json!({"spec": {"ttlSecondsAfterFinished": 0}});
    env.runs()
        .patch(
            "kept",
            &Default::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await?;
    watch
        .until("kept deleted once it has a TTL", WAIT, |runs| {
            Ok(runs.is_empty().then_some(()))
        })
        .await?;
    manager.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_schedules_and_a_standby_takes_over() -> Result<()> {
    let env = start().await?;
    env.runtime("rt", 10).await?;
    env.worker("w1", "rt", true).await?;
    let (first, first_task) = env.spawn_manager("shared");
    let (second, second_task) = env.spawn_manager("shared");
    for i in 0..3 {
        env.run(&format!("a{i}"), "rt", |_| {}).await?;
    }
    let mut watch = RunWatch::new(env.runs());
    let schedulers = watch
        .until("the first batch Scheduled", WAIT, |runs| {
            let messages: Vec<String> = runs.iter().filter_map(|r| scheduled_message(r)).collect();
            Ok((messages.len() == 3).then_some(messages))
        })
        .await?;
    let leases = Api::<Lease>::namespaced(env.admin.clone(), common::NS);
    let holder = leases
        .get("shared")
        .await?
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    ensure!(holder == first || holder == second, "holder {holder:?}");
    for message in &schedulers {
        ensure!(
            message.contains(&holder),
            "scheduled by a non-leader: {message}"
        );
    }
    let (leader_task, standby) = if holder == first {
        (first_task, second_task)
    } else {
        (second_task, first_task)
    };
    let standby_identity = if holder == first { &second } else { &first };

    // The leader crashes: it stops renewing and does not release the Lease.
    leader_task.abort();
    let crashed_at = Instant::now();
    for i in 0..3 {
        env.run(&format!("b{i}"), "rt", |_| {}).await?;
    }
    watch
        .until("the second batch Scheduled by the standby", WAIT, |runs| {
            let mut by_standby = 0;
            for run in runs {
                let Some(message) = scheduled_message(run) else {
                    continue;
                };
                if run.name_any().starts_with('a') {
                    ensure!(
                        message.contains(&holder),
                        "a Run was rescheduled: {message}"
                    );
                } else if message.contains(standby_identity.as_str()) {
                    by_standby += 1;
                } else {
                    bail!("{} was scheduled by {message}", run.name_any());
                }
            }
            Ok((by_standby == 3).then_some(()))
        })
        .await?;
    // The standby waited for the Lease to expire (2 s) before it scheduled anything.
    let took_over_after = crashed_at.elapsed();
    ensure!(
        took_over_after >= Duration::from_millis(1500),
        "the standby scheduled {took_over_after:?} after the crash, before the Lease expired"
    );
    let lease = leases.get("shared").await?.spec.unwrap_or_default();
    assert_eq!(
        lease.holder_identity.as_deref(),
        Some(standby_identity.as_str())
    );
    assert!(lease.lease_transitions.unwrap_or(0) >= 1);
    standby.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_shutdown_releases_the_lease_at_once() -> Result<()> {
    let env = start().await?;
    env.runtime("rt", 10).await?;
    env.worker("w1", "rt", true).await?;
    // A Lease so long that a standby could only take over through the release in time.
    let long = Duration::from_secs(600);
    let first = env.manager_with("release", long, Duration::from_secs(500));
    let first_identity = first.identity().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let first_task = tokio::spawn(first.run(async {
        let _ = stopped.await;
    }));
    env.run("a", "rt", |_| {}).await?;
    let mut watch = RunWatch::new(env.runs());
    watch
        .until("a Scheduled by the first replica", WAIT, |runs| {
            Ok(runs
                .iter()
                .find_map(|r| scheduled_message(r))
                .filter(|m| m.contains(&first_identity))
                .map(|_| ()))
        })
        .await?;
    let second = env.manager_with("release", long, Duration::from_secs(500));
    let second_identity = second.identity().to_string();
    let second_task = tokio::spawn(second.run(futures::future::pending()));

    let _ = stop.send(());
    common::within("the first replica to stop", WAIT, async {
        Ok(first_task.await??)
    })
    .await?;
    env.run("b", "rt", |_| {}).await?;
    watch
        .until("b Scheduled by the second replica", WAIT, |runs| {
            let b = runs.iter().find(|r| r.name_any() == "b");
            Ok(b.and_then(|b| scheduled_message(b))
                .filter(|m| m.contains(&second_identity))
                .map(|_| ()))
        })
        .await?;
    second_task.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_cause_conflicts_but_never_overcommit() -> Result<()> {
    let env = start().await?;
    env.runtime("rt", 3).await?;
    env.worker("w1", "rt", true).await?;
    let names: Vec<String> = (0..8).map(|i| format!("r{i}")).collect();
    for name in &names {
        env.run(name, "rt", |_| {}).await?;
    }
    // Other writers keep changing every Run, so some of the scheduler's status writes carry
    // a stale resourceVersion and get 409 (how many depends on timing; the checks below hold
    // for any number, including none).
    let mut touchers = Vec::new();
    for writer in 0..4 {
        let runs = env.runs();
        let touched = names.clone();
        touchers.push(tokio::spawn(async move {
            for round in 0u64.. {
                for name in &touched {
                    let patch = serde_json::json!({"metadata": {"annotations": {
                        format!("test/touch-{writer}"): round.to_string(),
                    }}});
                    // A failed touch only means fewer conflicts; the checks stand either way.
                    let _ = runs
                        .patch(name, &Default::default(), &kube::api::Patch::Merge(&patch))
                        .await;
                }
            }
        }));
    }
    let (_identity, manager) = env.spawn_manager("conflicts");
    let mut watch = RunWatch::new(env.runs());
    watch
        .until("3 Runs Scheduled despite conflicts", WAIT, |runs| {
            check_capacity(runs, 3, &["w1"])?;
            Ok((in_phase(runs, Phase::Scheduled).len() == 3).then_some(()))
        })
        .await?;
    env.finish("r0", Phase::Succeeded).await?;
    watch
        .until("the freed slot refilled despite conflicts", WAIT, |runs| {
            check_capacity(runs, 3, &["w1"])?;
            let held = runs.iter().filter(|r| r.phase().holds_capacity()).count();
            let done = in_phase(runs, Phase::Succeeded).len();
            Ok((held == 3 && done == 1).then_some(()))
        })
        .await?;
    for toucher in touchers {
        toucher.abort();
    }
    manager.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_loses_its_lease_stops_scheduling() -> Result<()> {
    let env = start().await?;
    env.runtime("rt", 10).await?;
    env.worker("w1", "rt", true).await?;
    let manager = env.manager("stolen");
    let mut leading = manager.leading();
    let task = tokio::spawn(manager.run(futures::future::pending()));
    common::within("the replica to lead", WAIT, async {
        Ok(leading.wait_for(|l| *l).await.map(|_| ())?)
    })
    .await?;

    // Someone else takes the Lease (as a replica with a wrong clock might).
    let leases = Api::<Lease>::namespaced(env.admin.clone(), common::NS);
    let set_holder = |holder: Option<&str>| {
        let leases = leases.clone();
        let holder = holder.map(str::to_string);
        async move {
            // A read-modify-write that may race the replica's renew: re-read on 409.
            loop {
                let mut lease = leases.get("stolen").await?;
                if let Some(spec) = lease.spec.as_mut() {
                    spec.holder_identity = holder.clone();
                    spec.lease_duration_seconds = Some(600);
                    spec.renew_time = Some(MicroTime(Timestamp::now()));
                }
                match leases.replace("stolen", &Default::default(), &lease).await {
                    Ok(_) => return anyhow::Ok(()),
                    Err(kube::Error::Api(status)) if status.is_conflict() => continue,
                    Err(error) => return Err(error.into()),
                }
            }
        }
    };
    set_holder(Some("intruder")).await?;
    common::within("the replica to step down", WAIT, async {
        Ok(leading.wait_for(|l| !*l).await.map(|_| ())?)
    })
    .await?;
    env.run("while-stolen", "rt", |_| {}).await?;

    // The Lease is handed back: the replica leads again and only then schedules the Run.
    let released_at = Timestamp::now();
    set_holder(None).await?;
    let mut watch = RunWatch::new(env.runs());
    let scheduled_at = watch
        .until(
            "the Run Scheduled after the Lease came back",
            WAIT,
            |runs| {
                Ok(runs.iter().find_map(|r| {
                    let condition = r
                        .status
                        .as_ref()?
                        .conditions
                        .iter()
                        .find(|c| c.type_ == "Scheduled")?;
                    condition.last_transition_time.clone()
                }))
            },
        )
        .await?;
    let scheduled_at: Timestamp = scheduled_at.parse()?;
    ensure!(
        scheduled_at >= released_at,
        "scheduled at {scheduled_at} while another held the Lease (released at {released_at})"
    );
    task.abort();
    Ok(())
}

/// Regression (issue 14.4): a `kruntimes up` restarted after a SIGKILL waited a whole lease
/// duration for the Lease its dead predecessor held. A Lease held by an identity with the
/// candidate's "predecessors gone" prefix is taken over at once; one held by any other
/// identity still waits for expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_of_a_gone_predecessor_is_taken_over_at_once() -> Result<()> {
    let env = start().await?;
    let leases = Api::<Lease>::namespaced(env.admin.clone(), common::NS);
    // Held for an hour from now, as a dead leader's Lease would be.
    let hold = |holder: &str| {
        serde_json::json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": "takeover"},
            "spec": {
                "holderIdentity": holder,
                "leaseDurationSeconds": 3600,
                "renewTime": MicroTime(Timestamp::now()),
            }
        })
    };
    let lease: Lease = serde_json::from_value(hold("kruntimes-up-1-dead"))?;
    leases.create(&Default::default(), &lease).await?;
    let config = |prefix: Option<&str>| {
        let config = LeaseConfig::new(common::NS, "takeover");
        match prefix {
            Some(prefix) => config.predecessors_gone(prefix),
            None => config,
        }
    };
    let mut unrelated = LeaseElector::new(env.controller.clone(), config(None));
    ensure!(
        !unrelated.try_acquire_or_renew().await?,
        "a candidate without the prefix waits for expiry"
    );
    let mut successor = LeaseElector::new(env.controller.clone(), config(Some("kruntimes-up-")));
    ensure!(
        successor.identity().starts_with("kruntimes-up-"),
        "the successor's identity has the prefix: {}",
        successor.identity()
    );
    ensure!(
        successor.try_acquire_or_renew().await?,
        "the successor takes over the gone predecessor's Lease at once"
    );
    let holder = leases
        .get("takeover")
        .await?
        .spec
        .and_then(|s| s.holder_identity);
    ensure!(
        holder.as_deref() == Some(successor.identity()),
        "{holder:?}"
    );
    // A holder without the prefix (another kind of candidate) is not presumed gone.
    let mut other = leases.get("takeover").await?;
    if let Some(spec) = other.spec.as_mut() {
        spec.holder_identity = Some("controller-manager-7-alive".to_string());
        spec.renew_time = Some(MicroTime(Timestamp::now()));
    }
    leases
        .replace("takeover", &Default::default(), &other)
        .await?;
    let mut second = LeaseElector::new(env.controller.clone(), config(Some("kruntimes-up-")));
    ensure!(
        !second.try_acquire_or_renew().await?,
        "a Lease held by an identity without the prefix waits for expiry"
    );
    Ok(())
}

/// Provisions nothing: the test's Pod objects stand in for workers, as everywhere in this
/// file; with it the manager also runs the Runtime controller over them.
struct NoWorkers;

impl WorkerProvisioner for NoWorkers {
    type Error = std::convert::Infallible;

    async fn reconcile(&self, _: &Runtime) -> Result<WorkerCounts, Self::Error> {
        Ok(WorkerCounts::default())
    }

    async fn cleanup(&self, _: &ObjectRef<Runtime>) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// Waits until the Runtime's `status.usedRuns` is `used`.
async fn used_runs_reach(env: &common::Env, runtime: &str, used: i32) -> Result<()> {
    let runtimes = Api::<Runtime>::namespaced(env.admin.clone(), common::NS);
    let reached =
        kube::runtime::wait::await_condition(runtimes, runtime, move |rt: Option<&Runtime>| {
            rt.and_then(|rt| rt.status.as_ref())
                .and_then(|s| s.used_runs)
                == Some(used)
        });
    common::within(
        &format!("usedRuns of {runtime} to be {used}"),
        Duration::from_secs(10),
        async {
            reached.await?;
            Ok(())
        },
    )
    .await
}

/// Regression (issue 14.6): `Runtime.status.usedRuns` stayed 0 while slots were in use: the
/// Runtime controller recounted it only every 300 s once it read 0. It now follows the
/// scheduler's view: up as Runs are placed (a Ready function counts), down as they end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn used_runs_follows_the_slots_in_use() -> Result<()> {
    let env = start().await?;
    env.runtime("rt", 4).await?;
    env.worker("w1", "rt", true).await?;
    let mut config = Config::new(common::NS);
    config.lease = LeaseConfig {
        lease_duration: Duration::from_secs(2),
        renew_deadline: Duration::from_millis(1500),
        retry_period: Duration::from_millis(200),
        ..LeaseConfig::new(common::NS, "usage")
    };
    let manager = ControllerManager::with_provisioner(env.controller.clone(), config, NoWorkers);
    let mut leading = manager.leading();
    let manager = tokio::spawn(manager.run(futures::future::pending()));
    common::within("the manager to lead", WAIT, async {
        leading.wait_for(|l| *l).await?;
        Ok(())
    })
    .await?;
    // The Runtime controller has looked at the Runtime with no slot in use.
    used_runs_reach(&env, "rt", 0).await?;
    for name in ["t1", "t2", "t3"] {
        env.run(name, "rt", |_| {}).await?;
    }
    let function: Run = serde_json::from_value(serde_json::json!({
        "apiVersion": "kruntimes.io/v1alpha1",
        "kind": "Run",
        "metadata": {"name": "fn"},
        "spec": {"runtime": "rt", "mode": {"function": {"handler": "main.handler"}}},
    }))?;
    env.runs().create(&Default::default(), &function).await?;
    let mut watch = RunWatch::new(env.runs());
    watch
        .until("every Run Scheduled", WAIT, |runs| {
            Ok((in_phase(runs, Phase::Scheduled).len() == 4).then_some(()))
        })
        .await?;
    // runtimed's part: the function becomes Ready, a task Running.
    for (name, phase) in [("fn", "Ready"), ("t1", "Running")] {
        let status = serde_json::json!({"status": {"phase": phase}});
        env.runs()
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await?;
    }
    used_runs_reach(&env, "rt", 4).await?;
    env.finish("t1", Phase::Succeeded).await?;
    env.finish("t2", Phase::Failed).await?;
    used_runs_reach(&env, "rt", 2).await?;
    env.finish("t3", Phase::Succeeded).await?;
    env.finish("fn", Phase::Succeeded).await?;
    used_runs_reach(&env, "rt", 0).await?;
    manager.abort();
    Ok(())
}

/// Issue 16.4, the interleaving: a claim that lands between the scheduler's fresh read of
/// an unclaimed Run and its un-assign wins. The seam pauses the un-assign right there while
/// the test claims the Run as runtimed would (Scheduled → Running, same precondition);
/// the un-assign then fails on the resourceVersion and the Run stays Running on its worker.
/// A Run that nobody claims is taken back (the seam is reached at all only for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_lands_during_the_un_assign_wins() -> Result<()> {
    let env = start().await?;
    env.runtime("rt", 1).await?;
    env.worker("w1", "rt", true).await?;
    let mut config = Config::new(common::NS);
    config.lease = LeaseConfig {
        lease_duration: Duration::from_secs(2),
        renew_deadline: Duration::from_millis(1500),
        retry_period: Duration::from_millis(200),
        ..LeaseConfig::new(common::NS, "unassign-race")
    };
    config.claim_timeout = Duration::from_secs(1);
    let runs = env.runs();
    let (reached, mut reached_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let claimer = runs.clone();
    config.unassign_hook = Some(kruntimes_controller::rebalance::UnassignHook(Arc::new(
        move |name: String| {
            let (runs, reached) = (claimer.clone(), reached.clone());
            Box::pin(async move {
                // runtimed's claim, written now, between the read and the un-assign.
                let now = Timestamp::now().to_string();
                let claim = serde_json::json!({"status": {"phase": "Running", "startTime": now, "attempt": 1}});
                let claimed = runs
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(&claim))
                    .await;
                let _ = reached.send(format!("{name}: {:?}", claimed.map(|r| r.phase())));
            })
        },
    )));
    let manager = ControllerManager::new(env.controller.clone(), config);
    let manager = tokio::spawn(manager.run(futures::future::pending()));
    env.run("raced", "rt", |_| {}).await?;
    let seen = common::within("the un-assign to reach the seam", WAIT, async {
        reached_rx
            .recv()
            .await
            .ok_or_else(|| anyhow::anyhow!("seam closed"))
    })
    .await?;
    ensure!(seen == "raced: Ok(Running)", "{seen}");
    // For three more bounds the Run stays Running on w1: it is never taken back. (A wait
    // for something not to happen is bounded by time; the watch sees every change.)
    let mut watch = RunWatch::new(env.runs());
    let moved = watch
        .until(
            "the raced Run to leave Running",
            Duration::from_secs(3),
            |all| {
                let run = all.iter().find(|r| r.name_any() == "raced");
                Ok(run
                    .filter(|r| r.phase() != Phase::Running || assigned(r) != Some("w1"))
                    .map(|r| (r.phase(), assigned(r).map(str::to_string))))
            },
        )
        .await;
    if let Ok(moved) = moved {
        bail!("the claimed Run was taken back: {moved:?}");
    }
    manager.abort();
    Ok(())
}
