//! Checkpoints and forks against a real `kruntimes up`, end to end: a checkpoint is a
//! barrier in the session's queue (it holds exactly the operations accepted before it);
//! a fork starts from it, holds its files and diverges independently; a checkpoint
//! outlives its deleted session and can still be forked; forks created Suspended hold no
//! slot and each resumes with the checkpoint's files. Every wait is a watch with a
//! deadline; nothing is faked.

mod common;

use anyhow::{Context, Result, ensure};
use common::{DEADLINE, create_runtime};
use kruntimes_api::snapshot::{ObjectReference, SnapshotPhase, SnapshotSource, SnapshotSpec};
use kruntimes_api::{Phase, Run, Snapshot};
use kruntimes_client::Connection;
use kruntimes_client::sandbox::{AcquireOptions, ReleaseOptions, Sandbox};
use kruntimes_client::session::{Command, EventKind, Operation, OperationState};
use kruntimes_testkit::{Options, Server, within};
use kube::api::Api;
use kube::{Client, ResourceExt};

/// Runs `line` through the unary route and returns its stdout; it must exit 0.
async fn sh(sandbox: &Sandbox, line: &str) -> Result<String> {
    let done = sandbox
        .execute(&Operation::command(Command::shell(line)))
        .await?;
    ensure!(
        done.state == OperationState::Succeeded,
        "{line}: {done:?} {}",
        String::from_utf8_lossy(&done.stderr)
    );
    Ok(String::from_utf8_lossy(&done.stdout).into_owned())
}

/// What `ls` of the workspace's `*.txt` files says, one line.
async fn files(sandbox: &Sandbox) -> Result<String> {
    Ok(sh(sandbox, "ls *.txt 2>/dev/null | tr '\\n' ' '; true")
        .await?
        .trim()
        .to_string())
}

fn pinned(snapshot: &Snapshot) -> ObjectReference {
    ObjectReference {
        name: snapshot.name_any(),
        uid: snapshot.uid(),
    }
}

async fn fork(connection: &Connection, snapshot: &Snapshot, suspended: bool) -> Result<Sandbox> {
    Ok(connection
        .runtime("pool")
        .acquire_sandbox(&AcquireOptions {
            from_snapshot: Some(pinned(snapshot)),
            suspended,
            ..AcquireOptions::default()
        })
        .await?)
}

/// Waits until Snapshot `name` is in `phase` (or final).
async fn snapshot_phase(admin: &Client, name: &str, phase: SnapshotPhase) -> Result<Snapshot> {
    let api = Api::<Snapshot>::namespaced(admin.clone(), "default");
    within(DEADLINE, &format!("Snapshot {name} is {phase:?}"), async {
        let seen = kube::runtime::wait::await_condition(api, name, |s: Option<&Snapshot>| {
            s.is_some_and(|s| s.phase() == phase || s.phase().is_terminal())
        })
        .await?;
        seen.context("the Snapshot is gone")
    })
    .await
}

/// A `kruntimes up` started with `options`, its one-worker Runtime "pool" of `slots` slots,
/// a connection, and a first sandbox on it.
async fn pool_with_sandbox(
    options: Options,
    slots: i32,
) -> Result<(Server, Client, Connection, Sandbox)> {
    let (server, admin) = Server::start_async(options).await?;
    create_runtime(&admin, "pool", "bash", 1, slots).await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection
        .runtime("pool")
        .acquire_sandbox(&AcquireOptions::default())
        .await?;
    Ok((server, admin, connection, sandbox))
}

#[tokio::test]
async fn a_checkpoint_holds_the_operations_before_it_and_its_forks_diverge_and_outlive_it()
-> Result<()> {
    let (_server, admin, connection, original) = pool_with_sandbox(Options::full(), 8).await?;
    sh(&original, "echo zero > zero.txt").await?;

    // A: a command still running when the checkpoint is asked for; its file appears only
    // at its end.
    let mut session = original.open_session().await?;
    let slow = session
        .send(&Operation::command(Command::shell(
            "sleep 3; echo a > a.txt",
        )))
        .await?;
    let taking = {
        let original = original.clone();
        tokio::spawn(async move { original.checkpoint("cp1", DEADLINE).await })
    };
    // The worker queued the barrier (behind A) once the Snapshot says Capturing.
    let capturing = snapshot_phase(&admin, "cp1", SnapshotPhase::Capturing).await?;
    ensure!(
        capturing.phase() == SnapshotPhase::Capturing,
        "the checkpoint was not waiting behind A (3 s) when first seen: {:?}",
        capturing.status
    );
    // B: accepted after the barrier, so it is not in the checkpoint.
    let after = session
        .send(&Operation::command(Command::shell("echo b > b.txt")))
        .await?;
    let mut ended = Vec::new();
    within(DEADLINE, "A and B complete", async {
        while ended.len() < 2 {
            let event = session.receive().await?;
            if let EventKind::Completed(done) = &event.kind {
                ensure!(done.state == OperationState::Succeeded, "{done:?}");
                ended.push(event.operation_id.clone());
            }
        }
        Ok(())
    })
    .await?;
    ensure!(ended == [slow.clone(), after.clone()], "{ended:?}");
    let checkpoint = taking.await??;
    let status = checkpoint.status.clone().unwrap_or_default();
    ensure!(status.files.unwrap_or(0) >= 2, "{status:?}");
    ensure!(
        checkpoint.owner_references().is_empty(),
        "a checkpoint is not owned by its session"
    );
    ensure!(files(&original).await? == "a.txt b.txt zero.txt");

    // A fork holds exactly the checkpoint's files, and the two diverge.
    let forked = fork(&connection, &checkpoint, false).await?;
    ensure!(
        files(&forked).await? == "a.txt zero.txt",
        "the fork holds {:?}",
        files(&forked).await?
    );
    ensure!(sh(&forked, "cat a.txt").await? == "a\n");
    sh(&forked, "echo fork > fork.txt").await?;
    sh(&original, "echo orig > orig.txt").await?;
    ensure!(files(&forked).await? == "a.txt fork.txt zero.txt");
    ensure!(files(&original).await? == "a.txt b.txt orig.txt zero.txt");

    // The session goes; its checkpoint stays and is forked again.
    drop(session);
    original.end_and_delete().await?;
    let runs = Api::<Run>::namespaced(admin.clone(), "default");
    within(DEADLINE, "the original Run is gone", async {
        kube::runtime::wait::await_condition(runs.clone(), original.name(), |r: Option<&Run>| {
            r.is_none()
        })
        .await?;
        Ok(())
    })
    .await?;
    let kept = Api::<Snapshot>::namespaced(admin.clone(), "default")
        .get("cp1")
        .await?;
    ensure!(kept.phase() == SnapshotPhase::Ready, "{:?}", kept.status);
    let again = fork(&connection, &kept, false).await?;
    ensure!(files(&again).await? == "a.txt zero.txt");
    forked.end_and_delete().await?;
    again.end_and_delete().await?;

    // A checkpoint no worker will take fails, saying why: of a Run that is gone (here the
    // original), of a name no Run has.
    for (name, run) in [("late", original.name()), ("nobody", "no-such-run")] {
        let snapshot = Snapshot::new(
            name,
            SnapshotSpec {
                source: SnapshotSource {
                    run: ObjectReference {
                        name: run.to_string(),
                        uid: None,
                    },
                },
                reason: None,
            },
        );
        Api::<Snapshot>::namespaced(admin.clone(), "default")
            .create(&Default::default(), &snapshot)
            .await?;
        let failed = snapshot_phase(&admin, name, SnapshotPhase::Failed).await?;
        let status = failed.status.unwrap_or_default();
        ensure!(
            failed.metadata.name.as_deref() == Some(name)
                && status.phase == Some(SnapshotPhase::Failed)
                && status.reason.as_deref() == Some("RunNotFound"),
            "{status:?}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn twenty_suspended_forks_hold_no_slot_and_each_resumes_with_the_files() -> Result<()> {
    // One worker of two slots: the source session takes one.
    let (_server, _admin, connection, source) = pool_with_sandbox(Options::full(), 2).await?;
    sh(
        &source,
        "head -c 1048576 /dev/urandom > blob.txt && sha256sum blob.txt > sum.txt",
    )
    .await?;
    let sum = sh(&source, "cat sum.txt").await?;
    let checkpoint = source.checkpoint("base", DEADLINE).await?;

    let forks =
        futures::future::try_join_all((0..20).map(|_| fork(&connection, &checkpoint, true)))
            .await?;
    for sandbox in &forks {
        let run = sandbox.run().await?;
        let status = run.status.clone().unwrap_or_default();
        ensure!(
            run.phase() == Phase::Suspended && status.assigned_pod.is_none(),
            "{} is {:?} on {:?}",
            sandbox.name(),
            run.phase(),
            status.assigned_pod
        );
        ensure!(status.snapshot.as_ref().map(|s| s.name.as_str()) == Some("base"));
    }
    // They hold no slot: the second slot is still free for a new sandbox.
    let other = connection
        .runtime("pool")
        .acquire_sandbox(&AcquireOptions::default())
        .await?;
    other.end_and_delete().await?;
    source.end_and_delete().await?;

    // Each resumes (two at a time: the worker's slots) with the checkpoint's files.
    for pair in forks.chunks(2) {
        for sandbox in pair {
            sandbox.resume().await?;
        }
        for sandbox in pair {
            let run = sandbox.wait_resumed(1, DEADLINE).await?;
            ensure!(run.phase() == Phase::Ready, "{:?}", run.status);
            ensure!(
                sh(sandbox, "sha256sum -c sum.txt >/dev/null && cat sum.txt").await? == sum,
                "{} lost its files",
                sandbox.name()
            );
            sandbox.end_and_delete().await?;
        }
    }
    Ok(())
}

/// Issue 20: the controller-manager's collector (every 200 ms here, no grace) deletes the
/// data of a deleted checkpoint, never the data a Suspended fork is pinned to although that
/// checkpoint's Snapshot was deleted first (so every round that could delete the one saw
/// the other unreferenced but for the pin), and that data goes once the fork is gone.
#[tokio::test]
async fn the_collector_deletes_unreferenced_checkpoint_data_and_never_pinned_data() -> Result<()> {
    let (server, admin, connection, source) =
        pool_with_sandbox(common::eager_collector(), 4).await?;
    sh(&source, "echo kept > kept.txt").await?;
    let pinned = source.checkpoint("pinned", DEADLINE).await?;
    let dropped = source.checkpoint("dropped", DEADLINE).await?;
    let store = server.data_dir().join("snapshots/store/default/snapshots");
    let data = |snapshot: &Snapshot| {
        store
            .join(snapshot.name_any())
            .join(snapshot.uid().unwrap_or_default())
    };
    for snapshot in [&pinned, &dropped] {
        ensure!(
            data(snapshot).join("archive.tar.zst").is_file(),
            "no data at {}",
            data(snapshot).display()
        );
    }
    let forked = fork(&connection, &pinned, true).await?;
    source.end_and_delete().await?;

    let snapshots = Api::<Snapshot>::namespaced(admin.clone(), "default");
    for snapshot in [&pinned, &dropped] {
        snapshots
            .delete(&snapshot.name_any(), &Default::default())
            .await?;
        deleted(&snapshots, snapshot).await?;
    }
    common::collected(&data(&dropped), "the dropped checkpoint's data").await?;
    ensure!(
        data(&pinned).join("archive.tar.zst").is_file(),
        "the pinned checkpoint's data was collected under its fork"
    );
    let run = forked.run().await?;
    ensure!(run.phase() == Phase::Suspended, "{:?}", run.status);

    // Once the fork has ended, nothing refers to the pinned data any more.
    forked.end_and_delete().await?;
    common::collected(&data(&pinned), "the pinned checkpoint's data").await?;
    Ok(())
}

/// Waits until `snapshot` (that very object) is deleted.
async fn deleted(snapshots: &Api<Snapshot>, snapshot: &Snapshot) -> Result<()> {
    let uid = snapshot.uid().unwrap_or_default();
    kruntimes_testkit::deleted(snapshots, &snapshot.name_any(), &uid, DEADLINE).await
}

/// Issue 20: a checkpoint of a Suspended session refers to the data it was suspended to,
/// without a copy (the same location), and keeps it: once the session and its suspend
/// Snapshot are deleted, the collector still keeps that data (it deletes another deleted
/// checkpoint's meanwhile), and a fork of the checkpoint has the session's files.
#[tokio::test]
async fn a_checkpoint_of_a_suspended_session_refers_to_its_data_and_keeps_it() -> Result<()> {
    let (server, admin) = Server::start_async(common::eager_collector()).await?;
    create_runtime(&admin, "pool", "bash", 1, 4).await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let pool = connection.runtime("pool");
    let sleeper = pool.acquire_sandbox(&AcquireOptions::default()).await?;
    sh(&sleeper, "echo asleep > asleep.txt").await?;
    sleeper.suspend().await?;
    let suspended = sleeper.wait_suspended(DEADLINE).await?;
    ensure!(
        suspended.phase() == Phase::Suspended,
        "{:?}",
        suspended.status
    );
    let suspend_name = suspended
        .status
        .as_ref()
        .and_then(|s| s.snapshot.as_ref())
        .map(|s| s.name.clone())
        .context("status.snapshot")?;
    let snapshots = Api::<Snapshot>::namespaced(admin.clone(), "default");
    let suspend_snapshot = snapshots.get(&suspend_name).await?;
    let location = |s: &Snapshot| {
        s.status
            .as_ref()
            .and_then(|st| st.location.as_ref())
            .map(|l| l.uri.clone())
    };

    let frozen = sleeper.checkpoint("frozen", DEADLINE).await?;
    ensure!(
        frozen.phase() == SnapshotPhase::Ready,
        "{:?}",
        frozen.status
    );
    ensure!(
        location(&frozen).is_some() && location(&frozen) == location(&suspend_snapshot),
        "the checkpoint copied: {:?} vs {:?}",
        location(&frozen),
        location(&suspend_snapshot)
    );
    let data = std::path::PathBuf::from(
        location(&frozen)
            .context("a location")?
            .strip_prefix("file://")
            .context("a file:// URI")?,
    );

    // A decoy with data of its own, from another session.
    let other = pool.acquire_sandbox(&AcquireOptions::default()).await?;
    let decoy = other.checkpoint("decoy", DEADLINE).await?;
    let decoy_data = std::path::PathBuf::from(
        location(&decoy)
            .context("a location")?
            .strip_prefix("file://")
            .context("a file:// URI")?,
    );
    // The session goes, and its suspend Snapshot with it; then the decoy.
    sleeper.end_and_delete().await?;
    deleted(&snapshots, &suspend_snapshot).await?;
    snapshots.delete("decoy", &Default::default()).await?;
    deleted(&snapshots, &decoy).await?;
    common::collected(&decoy_data, "the decoy's data").await?;
    ensure!(data.is_file(), "the checkpoint's data was collected");
    let forked = fork(&connection, &frozen, false).await?;
    ensure!(sh(&forked, "cat asleep.txt").await? == "asleep\n");
    forked.end_and_delete().await?;
    other.end_and_delete().await?;
    Ok(())
}

/// A suspend Snapshot outlives its session while a fork starts from it. The session
/// suspends and resumes (its Snapshot `<run>-s1` stays the latest), a fork is created
/// Suspended from that Snapshot, and the session is released (it is deleted from its
/// worker, which used to delete its suspend Snapshots with it). The Snapshot stays, the
/// fork resumes with the session's files, and the Snapshot goes once the fork is gone.
#[tokio::test]
async fn a_suspend_snapshot_a_fork_starts_from_outlives_its_session() -> Result<()> {
    let (_server, admin, connection, source) = pool_with_sandbox(Options::full(), 2).await?;
    sh(&source, "echo before > before.txt").await?;
    source.suspend().await?;
    let suspended = source.wait_suspended(DEADLINE).await?;
    let name = suspended
        .status
        .as_ref()
        .and_then(|s| s.snapshot.as_ref())
        .map(|s| s.name.clone())
        .context("status.snapshot")?;
    let snapshot = snapshot_phase(&admin, &name, SnapshotPhase::Ready).await?;
    ensure!(
        snapshot.phase() == SnapshotPhase::Ready,
        "{:?}",
        snapshot.status
    );
    source.resume().await?;
    source.wait_resumed(1, DEADLINE).await?;
    sh(&source, "echo after > after.txt").await?;

    let forked = fork(&connection, &snapshot, true).await?;
    let gone = source
        .release(ReleaseOptions {
            immediate: true,
            ..ReleaseOptions::default()
        })
        .await?;
    ensure!(gone.is_some(), "the session was gone before its release");
    let snapshots = Api::<Snapshot>::namespaced(admin.clone(), "default");
    let kept = snapshots.get_opt(&name).await?;
    ensure!(
        kept.as_ref().and_then(|s| s.uid()) == snapshot.uid(),
        "the suspend Snapshot a fork starts from went with its session: {kept:?}"
    );

    // A new session of the same name suspends to a Snapshot of the same name: it waits,
    // saying why, rather than replace the one the fork starts from.
    let again = connection
        .runtime("pool")
        .acquire_sandbox(&AcquireOptions {
            name: Some(source.name().to_string()),
            ..AcquireOptions::default()
        })
        .await?;
    sh(&again, "echo again > again.txt").await?;
    again.suspend().await?;
    common::wait_for(
        &admin,
        again.name(),
        "says its suspend waits for the fork",
        |r| {
            r.status.as_ref().is_some_and(|s| {
                s.conditions.iter().any(|c| {
                    c.type_ == kruntimes_api::lifecycle::SUSPENDED_CONDITION
                        && c.status == "False"
                        && c.message
                            .as_deref()
                            .is_some_and(|m| m.contains(forked.name()))
                })
            })
        },
    )
    .await?;
    let kept = snapshots.get_opt(&name).await?;
    ensure!(
        kept.as_ref().and_then(|s| s.uid()) == snapshot.uid(),
        "a new session of the same name replaced the fork's source: {kept:?}"
    );

    forked.resume().await?;
    let run = forked.wait_resumed(1, DEADLINE).await?;
    ensure!(run.phase() == Phase::Ready, "{:?}", run.status);
    ensure!(
        files(&forked).await? == "before.txt",
        "the fork holds {:?}",
        files(&forked).await?
    );
    // The fork gone, the new session's suspend goes through, to a Snapshot of its own.
    forked.end_and_delete().await?;
    deleted(&snapshots, &snapshot).await?;
    let suspended = again.wait_suspended(DEADLINE).await?;
    ensure!(
        suspended.phase() == Phase::Suspended,
        "{:?}",
        suspended.status
    );
    let own = snapshots.get(&name).await?;
    ensure!(own.spec.source.run.uid == suspended.uid(), "{own:?}");
    again.end_and_delete().await?;
    Ok(())
}
