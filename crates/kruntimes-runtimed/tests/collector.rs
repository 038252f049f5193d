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
use common::{DEADLINE, function, key_of, rig, rig_with_snapshots, session, task};
use futures::future::BoxFuture;
use kruntimes_api::Phase;
use kruntimes_api::workspace::Workspace;
use kruntimes_proto::runtime::v1 as rs;
use kruntimes_runtimed::reconcile::{self, CollectHook, CollectPoint, Context};
use kruntimes_testkit::within;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
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

/// A session Run that mounts Workspace `name` (the Run is named after it).
fn workspace_session(name: &str) -> kruntimes_api::RunSpec {
    let mut spec = session();
    spec.workspace = Some(kruntimes_api::run::WorkspaceRef {
        name: name.to_string(),
    });
    spec
}

/// Ends Run `name` as the controller-manager's idle sweep does: `Timeout/IdleTimeout`,
/// written while the session is open on its worker.
async fn expire_idle(rig: &common::Rig, name: &str) -> Result<()> {
    let mut run = rig.runs().get(name).await?;
    let status = run.status.get_or_insert_with(Default::default);
    status.phase = Some(Phase::Timeout);
    status.reason = Some(kruntimes_api::lifecycle::IDLE_TIMEOUT_REASON.to_string());
    status.message = Some("no operation or file write for 4s (the test's expiry)".to_string());
    status.completion_time = Some(kruntimes_api::lifecycle::now_rfc3339());
    rig.runs()
        .replace_status(name, &PostParams::default(), &run)
        .await?;
    Ok(())
}

/// Whether Run `run` has the condition WorkspaceCommitted with reason `reason`.
fn commit_condition_is(run: &kruntimes_api::Run, reason: &str) -> bool {
    run.status.as_ref().is_some_and(|s| {
        s.conditions.iter().any(|c| {
            c.type_ == kruntimes_api::workspace::COMMITTED_CONDITION
                && c.reason.as_deref() == Some(reason)
        })
    })
}

/// Waits until Workspace `name` has a commit, and returns it.
async fn committed(rig: &common::Rig, name: &str) -> Result<Workspace> {
    let api = Api::<Workspace>::namespaced(rig.admin.clone(), "default");
    let found = within(DEADLINE, "the Workspace's commit", async {
        Ok(
            kube::runtime::wait::await_condition(api, name, |w: Option<&Workspace>| {
                w.and_then(|w| w.status.as_ref())
                    .and_then(|s| s.commits)
                    .is_some_and(|c| c >= 1)
            })
            .await?,
        )
    })
    .await?;
    found.context("the Workspace is gone")
}

/// Waits until the runtime server no longer holds a session of Run `uid` (the end after the
/// commit closes it; there is no change notification to watch, so it is polled).
async fn session_closed(rig: &common::Rig, uid: &str) -> Result<()> {
    within(DEADLINE, "the session is closed", async {
        loop {
            let held = rig.held_sessions().await?;
            if !held
                .iter()
                .any(|s| s.id.as_ref().is_some_and(|id| id.run_uid == uid))
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

/// Regression: a session with a Workspace that idle expiry ended while runtimed was down
/// lost its files. The restarted runtimed, with nothing in memory, ended the Run without
/// committing (only a session it had seen through to Ready was committed), and its
/// collector then purged the session on the runtime server.
///
/// Checked to fail before the fix: the Workspace gets no commit.
#[tokio::test]
async fn a_restarted_worker_commits_a_session_that_idle_expiry_ended() -> Result<()> {
    let mut rig = rig_with_snapshots("coll-w7").await?;
    rig.create_runtime().await?;
    let run = rig.assign_named("proj", workspace_session("proj")).await?;
    let uid = run.uid().context("uid")?;
    rig.until("proj", "is Ready", |r| r.phase() == Phase::Ready)
        .await?;

    rig.stop_runtimed().await;
    expire_idle(&rig, "proj").await?;
    rig.start_runtimed().await?;

    let workspace = committed(&rig, "proj").await?;
    let status = workspace.status.unwrap_or_default();
    assert_eq!(status.commits, Some(1), "{status:?}");
    assert_eq!(
        status.head_run.map(|r| r.name),
        Some("proj".to_string()),
        "the head is this session's commit"
    );
    session_closed(&rig, &uid).await?;
    let ended = rig.runs().get("proj").await?;
    assert_eq!(ended.phase(), Phase::Timeout, "{:?}", ended.status);
    Ok(())
}

/// A Ready session Run `proj` with Workspace `proj`, ended by idle expiry while its store
/// is down (a file where the filesystem store's directory goes), so that its commit failed
/// and waits for its retry: its UID, and the file to remove to bring the store back.
async fn idle_expired_with_a_failed_commit(
    rig: &common::Rig,
) -> Result<(String, std::path::PathBuf)> {
    rig.create_runtime().await?;
    let run = rig.assign_named("proj", workspace_session("proj")).await?;
    let uid = run.uid().context("uid")?;
    rig.until("proj", "is Ready", |r| r.phase() == Phase::Ready)
        .await?;
    let store = rig.dir.path().join("snapshots/store");
    if store.exists() {
        std::fs::remove_dir_all(&store)?;
    }
    std::fs::create_dir_all(store.parent().context("parent")?)?;
    std::fs::write(&store, b"not a directory")?;
    expire_idle(rig, "proj").await?;
    rig.until("proj", "says its commit is retried", |r| {
        commit_condition_is(r, kruntimes_api::workspace::COMMIT_RETRYING_REASON)
    })
    .await?;
    Ok((uid, store))
}

/// Regression: a session with a Workspace that idle expiry ended, whose commit failed and
/// waited on its backoff, lost its files when the collector passed meanwhile: it purged the
/// session of the ended Run, and the retry found nothing to commit.
///
/// Checked to fail before the fix: the collector purges the session.
#[tokio::test]
async fn the_collector_leaves_a_session_whose_idle_commit_is_retried() -> Result<()> {
    let rig = rig_with_snapshots("coll-w6").await?;
    let (uid, store) = idle_expired_with_a_failed_commit(&rig).await?;
    // The reflector's store offers no change notification: polled, with a deadline.
    within(DEADLINE, "the store shows the Run ended", async {
        while rig
            .context
            .run_named("proj")
            .is_none_or(|r| r.phase() != Phase::Timeout)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    })
    .await?;
    reconcile::collect_once(&rig.context, None).await;
    assert!(
        rig.held_sessions()
            .await?
            .iter()
            .any(|s| s.id.as_ref().is_some_and(|id| id.run_uid == uid)),
        "the collector purged a session whose commit is still to be made"
    );
    // Its local state stays too, and with it what the Run was told (the retry's outcome
    // replaces the CommitRetrying condition).
    assert!(rig.context.sessions.get(&uid).is_some());

    std::fs::remove_file(&store)?;
    let workspace = committed(&rig, "proj").await?;
    assert_eq!(
        workspace.status.and_then(|s| s.commits),
        Some(1),
        "the retried commit was made"
    );
    rig.until("proj", "says its commit was made", |r| {
        commit_condition_is(r, kruntimes_api::workspace::COMMITTED_REASON)
    })
    .await?;
    session_closed(&rig, &uid).await?;
    Ok(())
}

/// Regression: a session with a Workspace that idle expiry ended, whose commit failed and
/// waited on its backoff, lost its files when the worker shut down meanwhile: the drain
/// skipped ended Runs, and the worker's files went with it. The drain now commits it (here:
/// the store is back before the retry is due; the drain does not wait for it), then closes
/// it.
///
/// Checked to fail before the fix: the drain returns at once, with no commit made.
#[tokio::test]
async fn a_shutdown_commits_a_session_whose_idle_commit_waits_for_its_retry() -> Result<()> {
    let rig = rig_with_snapshots("coll-w8").await?;
    let (uid, store) = idle_expired_with_a_failed_commit(&rig).await?;

    // The worker begins to shut down, then the store is back: from here on only the drain
    // commits (the Run's reconcile leaves the session to it).
    rig.context.begin_drain();
    std::fs::remove_file(&store)?;
    let report = kruntimes_runtimed::drain::drain_until(
        &rig.context,
        tokio::time::Instant::now() + DEADLINE,
        None,
    )
    .await;
    let workspaces = Api::<Workspace>::namespaced(rig.admin.clone(), "default");
    let commits = workspaces.get("proj").await?.status.and_then(|s| s.commits);
    assert_eq!(
        commits,
        Some(1),
        "the drain ended without the commit: {report:?}"
    );
    assert!(report.drained.contains(&"proj".to_string()), "{report:?}");
    assert!(
        !rig.held_sessions()
            .await?
            .iter()
            .any(|s| s.id.as_ref().is_some_and(|id| id.run_uid == uid)),
        "the drain closed the session"
    );
    Ok(())
}
