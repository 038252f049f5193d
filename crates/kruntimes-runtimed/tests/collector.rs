//! The garbage collector of runtimed against the reconciler, interleaved deterministically
//! (issue 14, item 1: a task Run killed that nobody cancelled).
//!
//! runtimed's reconciler runs in this process (so the test reaches the collector's seam,
//! [`reconcile::CollectPoint`]) against the real API server and a real runtime server; the
//! test plays the scheduler. Each test pauses one collection pass at a point, makes a claim
//! land there, lets the pass finish, and checks that nothing of the claimed Run was touched.

mod common;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use common::{DEADLINE, function, key_of, rig, session, task};
use futures::future::BoxFuture;
use kruntimes_api::Phase;
use kruntimes_proto::runtime::v1 as rs;
use kruntimes_runtimed::reconcile::{self, CollectHook, CollectPoint, Context};
use kruntimes_testkit::within;
use kube::ResourceExt;
use kube::api::DeleteParams;
use tokio::sync::{Semaphore, mpsc};

/// A collection pass paused at `point`: the pass runs in the background, `reached` reports
/// that it got there, and `release` lets it go on.
struct Paused {
    reached: mpsc::Receiver<CollectPoint>,
    release: Arc<Semaphore>,
    pass: tokio::task::JoinHandle<()>,
}

fn pause_pass_at(context: &Arc<Context>, point: CollectPoint) -> Paused {
    let (tx, reached) = mpsc::channel(8);
    let release = Arc::new(Semaphore::new(0));
    let gate = release.clone();
    let hook: CollectHook = Arc::new(move |at: CollectPoint| -> BoxFuture<'static, ()> {
        let tx = tx.clone();
        let gate = gate.clone();
        Box::pin(async move {
            if at == point {
                let _ = tx.send(at).await;
                if let Ok(permit) = gate.acquire().await {
                    permit.forget();
                }
            }
        })
    });
    let context = context.clone();
    let pass = tokio::spawn(async move { reconcile::collect_once(&context, Some(&hook)).await });
    Paused {
        reached,
        release,
        pass,
    }
}

impl Paused {
    async fn reached(&mut self) -> Result<()> {
        within(DEADLINE, "the pass reaches its pause", async {
            self.reached.recv().await.context("the pass ended")?;
            Ok(())
        })
        .await
    }

    async fn finish(self) -> Result<()> {
        self.release.add_permits(1);
        within(DEADLINE, "the pass ends", async { Ok(self.pass.await?) }).await
    }
}

/// A task Run claimed while the pass is paused at `point`: its program keeps running, its
/// local entry stays, and it ends Succeeded (not Cancelled) once its gate opens.
async fn claim_during_a_pass_at(point: CollectPoint, pod: &str) -> Result<()> {
    let rig = rig(pod).await?;
    let script = "while [ ! -e \"$KRUNTIME_WORKSPACE/go\" ]; do sleep 0.02; done\necho done\n";
    let mut paused = pause_pass_at(&rig.context, point);
    paused.reached().await?;
    let run = rig.assign(task(script)).await?;
    let key = key_of(&run)?;
    let gate = rig.in_workspace(&key.uid, "go");
    rig.until(&run.name_any(), "runs", |r| r.phase() == Phase::Running)
        .await?;
    assert!(
        rig.context.executions.wait_started(&key, DEADLINE).await,
        "the claim started the execution"
    );
    paused.finish().await?;

    assert!(
        rig.context.executions.started(&key),
        "the pass dropped the local entry of a Run claimed during it"
    );
    let held = rig.executions().await?;
    let found = held
        .iter()
        .find(|e| e.id.as_ref().is_some_and(|id| id.run_uid == key.uid))
        .context("the pass forgot the execution of a Run claimed during it")?;
    assert_eq!(found.state(), rs::ExecutionState::Running, "{found:?}");

    std::fs::write(&gate, b"")?;
    let done = rig
        .until(&run.name_any(), "ends", |r| r.phase().is_terminal())
        .await?;
    let status = done.status.clone().unwrap_or_default();
    assert_eq!(done.phase(), Phase::Succeeded, "{status:?}");
    assert_eq!(status.exit_code, Some(0));

    // The collector still collects: once the Run is deleted, its execution goes.
    rig.runs()
        .delete(&run.name_any(), &DeleteParams::default())
        .await?;
    // The reflector's store offers no change notification: its condition is polled, with
    // a deadline.
    within(DEADLINE, "the deleted Run leaves the store", async {
        while rig.context.run_named(&run.name_any()).is_some() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    })
    .await?;
    reconcile::collect_once(&rig.context, None).await;
    let held = rig.executions().await?;
    assert!(
        !held
            .iter()
            .any(|e| e.id.as_ref().is_some_and(|id| id.run_uid == key.uid)),
        "the execution of a deleted Run was not forgotten: {held:?}"
    );
    assert!(!rig.context.executions.started(&key));
    Ok(())
}

/// Regression (issue 14.1): the collector read the store's view, then listed the runtime
/// server; a Run claimed in between was unknown to the view and its program was killed
/// through Forget (the Run ended Cancelled).
#[tokio::test]
async fn a_task_claimed_between_the_collectors_reads_is_not_cancelled() -> Result<()> {
    claim_during_a_pass_at(CollectPoint::Listed, "coll-w1").await
}

/// Regression (issue 14.1): the collector swept local entries against the view it read
/// before its awaits; a Run claimed after that view lost its entry (a second waiter, a
/// "recovered" execution, by the code even a second run of the program).
#[tokio::test]
async fn a_task_claimed_after_the_collectors_view_keeps_its_local_entry() -> Result<()> {
    claim_during_a_pass_at(CollectPoint::Viewed, "coll-w2").await
}

/// A function Run registered while the pass is paused at `point` stays registered.
async fn register_during_a_pass_at(point: CollectPoint, pod: &str) -> Result<()> {
    let rig = rig(pod).await?;
    let mut paused = pause_pass_at(&rig.context, point);
    paused.reached().await?;
    let run = rig.assign(function()).await?;
    let uid = run.uid().context("uid")?;
    rig.until(&run.name_any(), "is Ready", |r| r.phase() == Phase::Ready)
        .await?;
    paused.finish().await?;

    let registration =
        rig.context.registrations.get(&uid).context(
            "the pass dropped the local registration of a function registered during it",
        )?;
    let status = rig
        .context
        .functions
        .clone()
        .function_status(rs::FunctionStatusRequest {
            registration_id: registration.id.clone(),
        })
        .await;
    let status = status
        .context("the pass unregistered a function registered during it")?
        .into_inner();
    assert_eq!(status.state(), rs::FunctionState::Ready, "{status:?}");
    Ok(())
}

/// Regression (issue 14.1): a function registered between the collector's view and its
/// ListFunctions was unregistered.
#[tokio::test]
async fn a_function_registered_between_the_collectors_reads_stays_registered() -> Result<()> {
    register_during_a_pass_at(CollectPoint::Listed, "coll-w3").await
}

/// Regression (issue 14.1): the local registrations were swept against a view older than
/// the pass's awaits.
#[tokio::test]
async fn a_function_registered_after_the_collectors_view_keeps_its_registration() -> Result<()> {
    register_during_a_pass_at(CollectPoint::Viewed, "coll-w4").await
}

/// Regression (issue 14.1): a session that became Ready after the session collector's view
/// was read lost its local state in the same pass (the sweep used that older view).
#[tokio::test]
async fn a_session_registered_after_the_collectors_view_keeps_its_state() -> Result<()> {
    let rig = rig("coll-w5").await?;
    if !rig.context.sessions_supported {
        bail!("the runtime server does not implement SessionRuntime");
    }
    let spec = session();
    let mut paused = pause_pass_at(&rig.context, CollectPoint::Viewed);
    paused.reached().await?;
    let run = rig.assign(spec).await?;
    let key = key_of(&run)?;
    rig.until(&run.name_any(), "is Ready", |r| r.phase() == Phase::Ready)
        .await?;
    paused.finish().await?;

    assert!(
        rig.context.sessions.get(&key.uid).is_some(),
        "the pass dropped the local state of a session registered during it"
    );
    let status = rig
        .context
        .session_client
        .clone()
        .get_session_status(rs::GetSessionStatusRequest { id: Some(key.id()) })
        .await?
        .into_inner();
    assert_eq!(status.state(), rs::SessionState::Ready, "{status:?}");
    Ok(())
}
