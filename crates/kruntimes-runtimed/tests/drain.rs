//! The drain of runtimed at shutdown against its reconciler, interleaved deterministically
//! (issue 15, item 5: design document 001, "Deletion Cleanup").
//!
//! runtimed's reconciler runs in this process (so the test reaches the seams of the claim
//! gate, [`claims::ClaimHook`], and of the drain, [`drain::DrainHook`]) against the real API
//! server and a real runtime server; the test plays the scheduler.

mod common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use common::{DEADLINE, Rig, function, key_of, rig, rig_with_snapshots, session, task};
use futures::future::BoxFuture;
use kruntimes_api::lifecycle::REGISTRATION_FINALIZER;
use kruntimes_api::{Phase, Run};
use kruntimes_proto::runtime::v1 as rs;
use kruntimes_runtimed::claims::ClaimHook;
use kruntimes_runtimed::drain::{self, DrainHook, DrainPoint, DrainReport};
use kruntimes_runtimed::reconcile::Context;
use kruntimes_testkit::within;
use kube::ResourceExt;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use tokio::sync::{Semaphore, mpsc};
use tokio::time::Instant;

/// The first reconcile of each Run named `held-*` is held right after it got its pass
/// (past the shutdown check), until released.
struct Holds {
    reached: mpsc::UnboundedReceiver<String>,
    release: Arc<Semaphore>,
}

fn hold_claims(context: &Context) -> Holds {
    let (tx, reached) = mpsc::unbounded_channel();
    let release = Arc::new(Semaphore::new(0));
    let gate = release.clone();
    let seen = Arc::new(Mutex::new(HashSet::new()));
    let hook: ClaimHook = Arc::new(move |name: &str| -> BoxFuture<'static, ()> {
        let hold = name.starts_with("held-")
            && seen
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(name.to_string());
        let (tx, gate, name) = (tx.clone(), gate.clone(), name.to_string());
        Box::pin(async move {
            if hold {
                let _ = tx.send(name);
                if let Ok(permit) = gate.acquire().await {
                    permit.forget();
                }
            }
        })
    });
    context.claims.set_hook(hook);
    Holds { reached, release }
}

impl Holds {
    /// Waits until a reconcile of each of `names` is held.
    async fn reached(&mut self, names: &[&str]) -> Result<()> {
        let mut missing: HashSet<String> = names.iter().map(|n| n.to_string()).collect();
        within(DEADLINE, "the claims are held past the gate", async {
            while !missing.is_empty() {
                let name = self.reached.recv().await.context("the hook is gone")?;
                missing.remove(&name);
            }
            Ok(())
        })
        .await
    }

    fn release(&self) {
        self.release.add_permits(Semaphore::MAX_PERMITS / 2);
    }
}

/// Runs the drain in the background until `deadline` from now.
/// The drain's deadline where every step is expected to succeed: it returns as soon as it
/// is done, so a generous bound costs nothing and keeps a slow gVisor teardown on a loaded
/// machine from failing the test.
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

fn start_drain(
    rig: &Rig,
    within_: Duration,
    hook: Option<DrainHook>,
) -> tokio::task::JoinHandle<DrainReport> {
    let context = rig.context.clone();
    tokio::spawn(async move {
        drain::drain_until(&context, Instant::now() + within_, hook.as_ref()).await
    })
}

async fn report_of(drain: tokio::task::JoinHandle<DrainReport>) -> Result<DrainReport> {
    within(DEADLINE, "the drain ends", async { Ok(drain.await?) }).await
}

fn ready_of(run: &Run) -> Option<(String, String)> {
    run.status.as_ref()?.conditions.iter().find_map(|c| {
        (c.type_ == "Ready").then(|| (c.status.clone(), c.reason.clone().unwrap_or_default()))
    })
}

fn sorted(names: &[String]) -> Vec<String> {
    let mut names = names.to_vec();
    names.sort();
    names
}

/// A session Run the drain ended: Failed (no attempt left) with
/// `Ready=False/WorkerShutdown`, its finalizer removed.
async fn assert_drained(rig: &Rig, name: &str) -> Result<()> {
    let done = rig.runs().get(name).await?;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), Phase::Failed, "{name}: {status:?}");
    assert_eq!(status.reason.as_deref(), Some("WorkerShutdown"), "{name}");
    assert_eq!(
        ready_of(&done),
        Some(("False".to_string(), "WorkerShutdown".to_string())),
        "{name}: {status:?}"
    );
    assert!(
        !done
            .finalizers()
            .iter()
            .any(|f| f == REGISTRATION_FINALIZER),
        "{name}: the drain removes the finalizer: {:?}",
        done.finalizers()
    );
    Ok(())
}

/// A function Run the drain sent back to register on the next ready worker: Pending, no
/// assignment, `WorkerRestarted` (Ready=False too), the attempt advanced to 2 (the fence) and
/// counted in `status.workerRestarts` instead of the retries, its finalizer removed.
async fn assert_restarted(rig: &Rig, name: &str) -> Result<()> {
    let done = rig.runs().get(name).await?;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), Phase::Pending, "{name}: {status:?}");
    assert_eq!(status.reason.as_deref(), Some("WorkerRestarted"), "{name}");
    assert_eq!(status.assigned_pod, None, "{name}");
    assert_eq!(status.attempt, Some(2), "{name}: the fence advances");
    assert_eq!(status.worker_restarts, Some(1), "{name}: no retry consumed");
    assert_eq!(
        ready_of(&done),
        Some(("False".to_string(), "WorkerRestarted".to_string())),
        "{name}: {status:?}"
    );
    assert!(
        !done
            .finalizers()
            .iter()
            .any(|f| f == REGISTRATION_FINALIZER),
        "{name}: the drain removes the finalizer: {:?}",
        done.finalizers()
    );
    Ok(())
}

async fn registered_functions(rig: &Rig) -> Result<Vec<String>> {
    let listed = rig
        .context
        .functions
        .clone()
        .list_functions(rs::ListFunctionsRequest {})
        .await?
        .into_inner();
    Ok(listed
        .functions
        .into_iter()
        .filter_map(|f| f.id.map(|id| id.run_uid))
        .collect())
}

/// Regression (issue 15.5): a reconcile already past the shutdown check claimed, or
/// registered a function, after the drain had read the Runs it drains. The claimed Run was
/// neither drained nor refused; the registration lived on with its finalizer removed and
/// nobody owning it. Now the drain waits for every claim in flight before it reads: both
/// functions are unregistered and end WorkerShutdown, the task is ended, and a Run assigned
/// after the gate closed is handed back untouched.
///
/// Checked to fail before the fix: with the gate not waiting for the passes out (and
/// background registrations not refused), the function registered after the drain's read
/// stays registered on the runtime server.
#[tokio::test]
async fn claims_in_flight_when_the_drain_begins_are_drained() -> Result<()> {
    let rig = rig("drain-w1").await?;
    let mut holds = hold_claims(&rig.context);
    let claimed = rig.assign_named("held-fn-claim", function()).await?;
    let registering = rig.place_running("held-fn-register", function()).await?;
    let held_task = rig.assign_named("held-task", task("sleep 600\n")).await?;
    holds
        .reached(&["held-fn-claim", "held-fn-register", "held-task"])
        .await?;

    // Shutdown begins while the three reconciles are past the gate.
    rig.context.begin_drain();
    let late = rig.assign_named("late-task", task("echo never\n")).await?;
    let drain = start_drain(&rig, DRAIN_LIMIT, None);
    holds.release();
    let report = report_of(drain).await?;

    assert!(report.claims_in_flight.is_empty(), "{report:?}");
    assert!(report.left.is_empty(), "{report:?}");
    assert_eq!(
        sorted(&report.drained),
        vec!["held-fn-claim".to_string(), "held-fn-register".to_string()],
        "{report:?}"
    );
    assert_eq!(
        report.tasks_ended,
        vec!["held-task".to_string()],
        "{report:?}"
    );
    assert_eq!(
        report.handed_back,
        vec!["late-task".to_string()],
        "{report:?}"
    );

    let registered = registered_functions(&rig).await?;
    for run in [&claimed, &registering] {
        let uid = run.uid().context("uid")?;
        assert!(
            !registered.contains(&uid),
            "{} is still registered on the runtime server after the drain",
            run.name_any()
        );
        assert!(rig.context.registrations.get(&uid).is_none());
        assert_restarted(&rig, &run.name_any()).await?;
    }

    let done = rig.runs().get(&held_task.name_any()).await?;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), Phase::Failed, "{status:?}");
    assert_eq!(status.reason.as_deref(), Some("WorkerShutdown"));

    // Never claimed here: back to Pending for another worker, the same attempt.
    let back = rig.runs().get(&late.name_any()).await?;
    let status = back.status.clone().unwrap_or_default();
    assert_eq!(back.phase(), Phase::Pending, "{status:?}");
    assert_eq!(status.assigned_pod, None);
    assert_eq!(status.assigned_pod_uid, None);
    assert_eq!(
        status.attempt, None,
        "nothing of the attempt ran: {status:?}"
    );
    let scheduled = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Scheduled")
        .context("a Scheduled condition")?;
    assert_eq!(
        (scheduled.status.as_str(), scheduled.reason.as_deref()),
        ("False", Some("WorkerShutdown"))
    );
    let executions = rig.executions().await?;
    let late_uid = late.uid().context("uid")?;
    assert!(
        !executions
            .iter()
            .any(|e| e.id.as_ref().is_some_and(|id| id.run_uid == late_uid)),
        "a Run handed back was started: {executions:?}"
    );
    Ok(())
}

/// Regression (issue 15.5): a session's reconcile past the shutdown check started its
/// registration after the drain had closed (nothing) and ended the Run: the session lived on
/// the runtime server with nobody owning it. Now its background registration is refused once
/// the gate is closed, and the drain ends the Run after that reconcile returned.
///
/// Checked to fail before the fix: with the gate not waiting and background registrations
/// not refused, the session is READY on the runtime server after the drain.
#[tokio::test]
async fn a_session_registering_when_the_drain_begins_is_closed() -> Result<()> {
    let rig = rig("drain-w2").await?;
    if !rig.context.sessions_supported {
        bail!("the runtime server does not implement SessionRuntime");
    }
    let mut holds = hold_claims(&rig.context);
    let run = rig.place_running("held-session", session()).await?;
    holds.reached(&["held-session"]).await?;
    rig.context.begin_drain();
    let drain = start_drain(&rig, DRAIN_LIMIT, None);
    holds.release();
    let report = report_of(drain).await?;

    assert_eq!(
        report.drained,
        vec!["held-session".to_string()],
        "{report:?}"
    );
    assert!(report.left.is_empty(), "{report:?}");
    assert_drained(&rig, "held-session").await?;
    let key = key_of(&run)?;
    let on_server = rig
        .context
        .session_client
        .clone()
        .get_session_status(rs::GetSessionStatusRequest { id: Some(key.id()) })
        .await?
        .into_inner();
    assert_eq!(
        on_server.state(),
        rs::SessionState::NotFound,
        "a session lives on after the drain: {on_server:?}"
    );
    assert!(rig.context.sessions.get(&key.uid).is_none());
    Ok(())
}

/// Regression (issue 15.5): the drain closed one Run after another, each close unbounded
/// (a session close may take 30 s), so one hung close held every later one and the whole
/// drain past the SIGKILL. Now the Runs are drained concurrently, every step bounded by
/// the drain's one deadline, and what was left undrained is named.
///
/// Checked to fail before the fix: drained one at a time (concurrency 1), the two Runs
/// after the hung one are left undrained.
#[tokio::test]
async fn a_hung_close_holds_no_other_and_not_the_deadline() -> Result<()> {
    let rig = rig("drain-w3").await?;
    for name in ["a-hung", "b-fn", "c-fn"] {
        rig.assign_named(name, function()).await?;
        rig.until(name, "is Ready", |r| r.phase() == Phase::Ready)
            .await?;
    }
    // The seam: the close of a-hung never answers.
    let hook: DrainHook = Arc::new(|at: DrainPoint| -> BoxFuture<'static, ()> {
        Box::pin(async move {
            if at == DrainPoint::Closing("a-hung".to_string()) {
                futures::future::pending::<()>().await;
            }
        })
    });
    // Long enough for b-fn and c-fn to be torn down (slow under gVisor); a-hung holds the
    // drain until the deadline.
    let limit = Duration::from_secs(8);
    let started = Instant::now();
    rig.context.begin_drain();
    let report = report_of(start_drain(&rig, limit, Some(hook))).await?;
    let took = started.elapsed();

    assert!(
        took < limit + Duration::from_secs(3),
        "the drain took {took:?}, past its deadline of {limit:?}"
    );
    assert_eq!(
        sorted(&report.drained),
        vec!["b-fn".to_string(), "c-fn".to_string()],
        "{report:?}"
    );
    assert_eq!(report.left.len(), 1, "{report:?}");
    assert_eq!(report.left[0].0, "a-hung");
    assert!(report.left[0].1.contains("deadline"), "{report:?}");
    for name in ["b-fn", "c-fn"] {
        assert_restarted(&rig, name).await?;
    }
    // Left to the controller's recovery: still Ready, the finalizer kept.
    let hung = rig.runs().get("a-hung").await?;
    assert_eq!(hung.phase(), Phase::Ready);
    assert!(
        hung.finalizers()
            .iter()
            .any(|f| f == REGISTRATION_FINALIZER)
    );
    Ok(())
}

/// Regression (issue 15.5): a task still running at the end of the grace was cancelled even
/// when its WorkerShutdown end could not be written, so it ended Cancelled (what a user
/// asked for) instead of WorkerShutdown (retried per retryPolicy). Now it is cancelled only
/// once that end is written; otherwise it is left to the recovery, still running.
///
/// Checked to fail before the fix (cancelled whatever the write did): the drain sent Cancel.
#[tokio::test]
async fn a_task_whose_end_was_not_written_is_not_cancelled() -> Result<()> {
    let rig = rig("drain-w4").await?;
    let run = rig.assign_named("t-stuck", task("sleep 600\n")).await?;
    let key = key_of(&run)?;
    rig.until("t-stuck", "runs", |r| r.phase() == Phase::Running)
        .await?;
    assert!(rig.context.executions.wait_started(&key, DEADLINE).await);

    // The seam: right before each of the drain's writes of t-stuck, the Run changes (an
    // annotation), so every conditional write conflicts and the drain gives up on it.
    let runs = rig.runs();
    let bumps = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = bumps.clone();
    let hook: DrainHook = Arc::new(move |at: DrainPoint| -> BoxFuture<'static, ()> {
        let runs = runs.clone();
        let counted = counted.clone();
        Box::pin(async move {
            if at == DrainPoint::Writing("t-stuck".to_string()) {
                let n = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let patch = json!({"metadata": {"annotations": {"test/bump": n.to_string()}}});
                let _ = runs
                    .patch("t-stuck", &PatchParams::default(), &Patch::Merge(&patch))
                    .await;
            }
        })
    });
    rig.context.begin_drain();
    let report = report_of(start_drain(&rig, Duration::from_secs(2), Some(hook))).await?;

    assert!(
        bumps.load(std::sync::atomic::Ordering::SeqCst) > 0,
        "the seam ran"
    );
    assert!(report.tasks_ended.is_empty(), "{report:?}");
    assert_eq!(report.left.len(), 1, "{report:?}");
    assert_eq!(report.left[0].0, "t-stuck");
    assert!(
        rig.context.executions.mark_cancelled(&key),
        "the drain cancelled a task whose WorkerShutdown end was not written"
    );
    let now = rig.runs().get("t-stuck").await?;
    assert_eq!(now.phase(), Phase::Running, "{:?}", now.status);

    // Leave no process behind: stop the program and wait for its end.
    rig.context
        .task
        .clone()
        .cancel(rs::CancelRequest { id: Some(key.id()) })
        .await?;
    within(DEADLINE, "the program ends", async {
        loop {
            let status = rig
                .context
                .task
                .clone()
                .wait(rs::WaitRequest {
                    id: Some(key.id()),
                    timeout: Some(prost_types::Duration {
                        seconds: 30,
                        nanos: 0,
                    }),
                    include_log_tails: false,
                })
                .await?
                .into_inner();
            if status.state() != rs::ExecutionState::Running {
                return Ok(());
            }
        }
    })
    .await
}

/// The wait for claims in flight is bounded too (half of the drain's time): a claim that
/// outlasts it is left alone (touching it would race with it) and named, and the rest is
/// drained by the deadline.
#[tokio::test]
async fn a_claim_that_outlasts_its_share_of_the_drain_is_named_and_left_alone() -> Result<()> {
    let rig = rig("drain-w5").await?;
    rig.assign_named("b-fn", function()).await?;
    rig.until("b-fn", "is Ready", |r| r.phase() == Phase::Ready)
        .await?;
    // Held and never released: the claim is still in flight when the drain ends.
    let mut holds = hold_claims(&rig.context);
    rig.assign_named("held-forever", function()).await?;
    holds.reached(&["held-forever"]).await?;
    // Half of it waits for the held claim; the other half must cover b-fn's teardown.
    let limit = Duration::from_secs(10);
    let started = Instant::now();
    rig.context.begin_drain();
    let report = report_of(start_drain(&rig, limit, None)).await?;
    let took = started.elapsed();

    assert!(
        took < limit + Duration::from_secs(3),
        "the drain took {took:?}"
    );
    assert_eq!(
        report.claims_in_flight,
        vec!["held-forever".to_string()],
        "{report:?}"
    );
    assert_eq!(report.drained, vec!["b-fn".to_string()], "{report:?}");
    assert_eq!(report.left.len(), 1, "{report:?}");
    assert_eq!(report.left[0].0, "held-forever");
    assert!(report.handed_back.is_empty(), "{report:?}");
    assert_restarted(&rig, "b-fn").await?;
    let held = rig.runs().get("held-forever").await?;
    assert_eq!(
        held.phase(),
        Phase::Scheduled,
        "left alone: {:?}",
        held.status
    );
    Ok(())
}

/// Whether the runtime server still holds the session of `run`.
async fn on_server(rig: &Rig, run: &Run) -> Result<rs::SessionState> {
    let key = key_of(run)?;
    Ok(rig
        .context
        .session_client
        .clone()
        .get_session_status(rs::GetSessionStatusRequest { id: Some(key.id()) })
        .await?
        .into_inner()
        .state())
}

/// Issue 19.6: a drain closed every Ready session with purge and failed it
/// (`Failed/WorkerShutdown`), so a restart of the worker lost the session. Now a Ready
/// session of a worker with a snapshot store is suspended: its files go to a Ready
/// Snapshot, the Run is Suspended with that snapshot and `Suspended=True/WorkerShutdown`,
/// `spec.suspend` untouched (so the controller resumes it on the next ready worker), and
/// the runtime server holds nothing of it any more. A session its user asked to suspend
/// while the drain began is suspended by the drain alone (the reconciler leaves Ready
/// sessions to it: two captures of one Snapshot would race), and keeps `spec.suspend`.
///
/// Checked to fail before the fix: both sessions end Failed/WorkerShutdown.
#[tokio::test]
async fn a_ready_session_is_suspended_by_the_drain_when_a_store_exists() -> Result<()> {
    let rig = rig_with_snapshots("drain-w6").await?;
    if !rig.context.sessions_supported {
        bail!("the runtime server does not implement SessionRuntime");
    }
    rig.create_runtime().await?;
    let kept = rig.assign_named("kept", session()).await?;
    let asked = rig.assign_named("asked", session()).await?;
    for name in ["kept", "asked"] {
        rig.until(name, "is Ready", |r| r.phase() == Phase::Ready)
            .await?;
    }
    // The user asks `asked` to suspend while the drain begins: the drain owns it now.
    rig.context.begin_drain();
    rig.runs()
        .patch(
            "asked",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"suspend": true}})),
        )
        .await?;
    let report = report_of(start_drain(&rig, DRAIN_LIMIT, None)).await?;

    assert_eq!(
        sorted(&report.suspended),
        vec!["asked".to_string(), "kept".to_string()],
        "{report:?}"
    );
    assert!(report.not_suspended.is_empty(), "{report:?}");
    assert!(report.left.is_empty(), "{report:?}");
    for run in [&kept, &asked] {
        let name = run.name_any();
        let done = rig.runs().get(&name).await?;
        let status = done.status.clone().unwrap_or_default();
        assert_eq!(done.phase(), Phase::Suspended, "{name}: {status:?}");
        assert_eq!(status.assigned_pod, None, "{name}");
        let suspended = status
            .conditions
            .iter()
            .find(|c| c.type_ == "Suspended")
            .context("a Suspended condition")?;
        assert_eq!(
            (suspended.status.as_str(), suspended.reason.as_deref()),
            ("True", Some("WorkerShutdown")),
            "{name}"
        );
        let snapshot = status.snapshot.clone().context("status.snapshot")?;
        assert_eq!(snapshot.name, format!("{name}-s1"));
        let object = kube::Api::<kruntimes_api::Snapshot>::namespaced(rig.admin.clone(), "default")
            .get(&snapshot.name)
            .await?;
        assert_eq!(
            object.phase(),
            kruntimes_api::snapshot::SnapshotPhase::Ready
        );
        assert_eq!(
            on_server(&rig, run).await?,
            rs::SessionState::NotFound,
            "{name}"
        );
    }
    let kept_now = rig.runs().get("kept").await?;
    assert_eq!(
        kept_now.spec.suspend, None,
        "the drain leaves spec.suspend alone"
    );
    let asked_now = rig.runs().get("asked").await?;
    assert_eq!(asked_now.spec.suspend, Some(true));
    Ok(())
}

/// The fallback of issue 19.6: without a snapshot store a Ready session cannot be
/// suspended; it is closed and fails `WorkerShutdown` as before, and the report says why.
#[tokio::test]
async fn a_ready_session_without_a_store_is_closed_and_named_in_the_report() -> Result<()> {
    let rig = rig("drain-w7").await?;
    if !rig.context.sessions_supported {
        bail!("the runtime server does not implement SessionRuntime");
    }
    rig.create_runtime().await?;
    let run = rig.assign_named("no-store", session()).await?;
    rig.until("no-store", "is Ready", |r| r.phase() == Phase::Ready)
        .await?;
    rig.context.begin_drain();
    let report = report_of(start_drain(&rig, DRAIN_LIMIT, None)).await?;

    assert_eq!(report.drained, vec!["no-store".to_string()], "{report:?}");
    assert!(report.suspended.is_empty(), "{report:?}");
    assert_eq!(report.not_suspended.len(), 1, "{report:?}");
    assert!(
        report.not_suspended[0].1.contains("no snapshot store"),
        "{report:?}"
    );
    assert_drained(&rig, "no-store").await?;
    assert_eq!(on_server(&rig, &run).await?, rs::SessionState::NotFound);
    Ok(())
}
