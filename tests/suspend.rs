//! Suspend and resume against a real `kruntimes up`, end to end: runtimed captures a Ready
//! session asked to suspend (`spec.suspend: true`) into a `Snapshot` (a local copy on its
//! worker, then the store: the Runtime's ArtifactStore, else the filesystem store under the
//! data directory's `snapshots/`), writes the Run Suspended (no slot held), and on resume
//! restores it into the new incarnation's session: from the local copy on the same worker,
//! from the store elsewhere. A store failure keeps the session serving and is retried; a
//! tampered snapshot fails the resume `SnapshotInvalid`. Every wait is a watch with a
//! deadline; nothing is faked.

mod common;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use common::{DEADLINE, Seen, create, create_runtime, exec, wait_for, wait_ready};
use kruntimes_api::lifecycle::SUSPENDED_CONDITION;
use kruntimes_api::run::{RunMode, RunResources, SessionMode, WorkerLossPolicy};
use kruntimes_api::snapshot::SnapshotPhase;
use kruntimes_api::{Phase, Run, RunSpec, Snapshot};
use kruntimes_client::Connection;
use kruntimes_client::sandbox::Sandbox;
use kruntimes_client::session::{Command, EventKind, Operation, OperationState};
use kruntimes_testkit::s3::S3Server;
use kruntimes_testkit::{Options, Server, within};
use kube::api::{Api, DeleteParams, PostParams};
use kube::{Client, ResourceExt};
use sha2::Digest;

/// An exclusive session Run of `runtime`.
fn exclusive_session(runtime: &str) -> RunSpec {
    let mut spec = RunSpec::task(runtime, "unused");
    spec.mode = RunMode {
        session: Some(SessionMode::default()),
        ..RunMode::default()
    };
    spec.resources = Some(RunResources {
        exclusive: Some(true),
        ..RunResources::default()
    });
    spec
}

/// Files of every kind the snapshot must keep: an executable script (0755), a private
/// file (0600), symlinks (one through `..` inside the workspace), 100 kB of random bytes.
const SETUP: &str = "mkdir -p d/sub && printf '#!/bin/sh\\necho ran-script\\n' > d/run.sh \
    && chmod 0755 d/run.sh && printf secret > d/key && chmod 0600 d/key \
    && ln -s run.sh d/link && ln -s ../key d/sub/up \
    && head -c 100000 /dev/urandom > d/blob && sha256sum d/blob > blob.sum";

/// What the files look like: modes, kinds, link targets, contents.
const CHECK: &str = "stat -c '%n %a %F' d d/run.sh d/key d/link d/sub/up d/blob \
    && readlink d/link d/sub/up && ./d/link && cat d/sub/up && echo \
    && sha256sum -c blob.sum";

/// Runs `line` and expects it to succeed.
async fn exec_ok(sandbox: &Sandbox, line: &str) -> Result<Seen> {
    let mut session = sandbox.open_session().await?;
    let seen = exec(&mut session, line).await?;
    ensure!(
        seen.done.state == OperationState::Succeeded,
        "{line}: {:?} {}",
        seen.done,
        seen.stdout
    );
    Ok(seen)
}

fn assigned_pod(run: &Run) -> Option<String> {
    run.status.as_ref()?.assigned_pod.clone()
}

/// The Snapshot of `run`'s suspend, read now.
async fn snapshot_of(admin: &Client, run: &Run) -> Result<Snapshot> {
    let name = run
        .status
        .as_ref()
        .and_then(|s| s.snapshot.as_ref())
        .map(|s| s.name.clone())
        .context("status.snapshot")?;
    Ok(Api::<Snapshot>::namespaced(admin.clone(), "default")
        .get(&name)
        .await?)
}

/// Suspends the sandbox and waits for Suspended.
async fn suspend(sandbox: &Sandbox) -> Result<Run> {
    sandbox.suspend().await?;
    let run = sandbox.wait_suspended(DEADLINE).await?;
    ensure!(run.phase() == Phase::Suspended, "{:?}", run.status);
    Ok(run)
}

async fn delete_and_wait(admin: &Client, name: &str) -> Result<()> {
    let runs = Api::<Run>::namespaced(admin.clone(), "default");
    runs.delete(name, &DeleteParams::default()).await?;
    within(DEADLINE, &format!("{name} is gone"), async {
        kube::runtime::wait::await_condition(runs.clone(), name, |r: Option<&Run>| r.is_none())
            .await?;
        Ok(())
    })
    .await
}

/// The path of a `file://` URI.
fn file_path(uri: &str) -> Result<PathBuf> {
    Ok(PathBuf::from(
        uri.strip_prefix("file://").context("a file:// URI")?,
    ))
}

/// The local copy of `snapshot` of `run` on `pod`.
fn local_copy(server: &Server, pod: &str, run: &Run, snapshot: &str) -> PathBuf {
    server
        .data_dir()
        .join("snapshots/local")
        .join(pod)
        .join(run.uid().unwrap_or_default())
        .join(format!("{snapshot}.tar.zst"))
}

/// The directories of the files the runtime server of `pod` parked for `run` at its
/// suspends (`<root>/sessions/.parked/<run-uid>.<n>`; a resume there moves them back,
/// without reading the snapshot).
fn parked_sets(server: &Server, pod: &str, run: &Run) -> Result<Vec<PathBuf>> {
    let dir = server
        .data_dir()
        .join("workers")
        .join(pod)
        .join("root/sessions/.parked");
    let prefix = format!("{}.", run.uid().unwrap_or_default());
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(Vec::new());
    };
    let mut sets = Vec::new();
    for entry in entries {
        let entry = entry?;
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            sets.push(entry.path());
        }
    }
    Ok(sets)
}

/// Waits until the runtime server of `pod` parked `run`'s files: the suspend's close
/// parks them just after the Suspended write, which the test sees first (in `gvisor` the
/// sandbox's end takes a while). Returns their directory.
async fn parked(server: &Server, pod: &str, run: &Run) -> Result<PathBuf> {
    within(DEADLINE, "the suspend parks the session's files", async {
        let mut ticks = tokio::time::interval(std::time::Duration::from_millis(50));
        loop {
            if let [one] = parked_sets(server, pod, run)?.as_slice() {
                return Ok(one.clone());
            }
            ticks.tick().await;
        }
    })
    .await
}

/// Removes the files the runtime server of `pod` parked for `run` (once it parked them): a
/// resume on `pod` then reads the local copy, or the store. The server still believes it
/// holds them; it finds them gone and restores from data.
async fn drop_parked(server: &Server, pod: &str, run: &Run) -> Result<()> {
    let set = parked(server, pod, run).await?;
    std::fs::remove_dir_all(&set).with_context(|| format!("remove {}", set.display()))
}

/// Flips bytes in the middle of `path`.
fn tamper(path: &Path) -> Result<()> {
    let mut bytes = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    ensure!(bytes.len() > 64, "{} is too small", path.display());
    let middle = bytes.len() / 2;
    for byte in &mut bytes[middle..middle + 16] {
        *byte ^= 0xff;
    }
    std::fs::write(path, bytes)?;
    Ok(())
}

#[tokio::test]
async fn a_session_suspends_holds_nothing_and_resumes_from_its_local_copy_with_every_file()
-> Result<()> {
    let (server, admin) = Server::start_async(Options::full()).await?;
    // One worker of one slot: two sessions fit only if the suspended one holds nothing.
    create_runtime(&admin, "solo", "bash", 1, 1).await?;
    create(&admin, "first", exclusive_session("solo")).await?;
    let ready = wait_ready(&admin, "first").await?;
    let pod = assigned_pod(&ready).context("assigned")?;
    let endpoint = ready.status.as_ref().and_then(|s| s.endpoint.clone());
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection.sandbox("first").await?;
    let setup = exec_ok(&sandbox, SETUP).await?;
    let before = exec_ok(&sandbox, CHECK).await?;
    let last_before = setup
        .sequences
        .iter()
        .chain(&before.sequences)
        .copied()
        .max()
        .context("events")?;

    let suspended = suspend(&sandbox).await?;
    let status = suspended.status.clone().unwrap_or_default();
    let reference = status.snapshot.clone().context("status.snapshot")?;
    assert_eq!(reference.name, "first-s1");
    assert_eq!(reference.last_sequence, i64::try_from(last_before).ok());
    assert_eq!(
        status.assigned_pod, None,
        "a Suspended session holds no worker"
    );
    let snapshot = snapshot_of(&admin, &suspended).await?;
    assert_eq!(snapshot.phase(), SnapshotPhase::Ready);
    let snap = snapshot.status.clone().unwrap_or_default();
    assert_eq!(snap.incarnation, Some(1));
    assert_eq!(snap.last_sequence, reference.last_sequence);
    assert_eq!(
        snap.local_copy.as_ref().map(|l| l.pod.as_str()),
        Some(pod.as_str())
    );
    assert!(snap.files.unwrap_or(0) >= 7, "{snap:?}");
    assert!(snap.size_bytes.unwrap_or(0) >= 100_000, "{snap:?}");
    // Pinned to its Run, with no owner reference: no garbage collector takes it from a
    // fork (the controller-manager deletes it).
    assert_eq!(
        snapshot.spec.source.run.uid.as_deref(),
        ready.metadata.uid.as_deref()
    );
    assert!(snapshot.owner_references().is_empty());
    // No artifactStore on this Runtime: the filesystem store under the data directory.
    let location = snap.location.clone().context("location")?;
    let blob = file_path(&location.uri)?;
    assert!(
        blob.starts_with(server.data_dir().join("snapshots/store")),
        "{}",
        blob.display()
    );
    assert!(blob.is_file());
    let manifest = std::fs::read(file_path(
        location.manifest_uri.as_deref().context("manifest")?,
    )?)?;
    let manifest: serde_json::Value = serde_json::from_slice(&manifest)?;
    assert!(
        manifest["entries"]
            .as_array()
            .is_some_and(|e| e.iter().any(|e| e["path"] == "workspace/d/run.sh"
                && e["mode"] == "755"
                && e["digest"]
                    .as_str()
                    .is_some_and(|d| d.starts_with("sha256:")))),
        "{manifest}"
    );
    let local = local_copy(&server, &pod, &suspended, "first-s1");
    assert!(local.is_file(), "{}", local.display());
    // Its files are parked on its worker's runtime server, for a resume there.
    parked(&server, &pod, &suspended).await?;
    // The SDK and the gateway say Suspended.
    let err = sandbox.status().await.expect_err("suspended");
    assert!(
        matches!(
            err,
            kruntimes_client::sandbox::SandboxError::Suspended { .. }
        ),
        "{err:?}"
    );

    // Suspended holds no capacity: a second exclusive session gets the one slot.
    create(&admin, "second", exclusive_session("solo")).await?;
    let second = wait_ready(&admin, "second").await?;
    assert_eq!(assigned_pod(&second).as_deref(), Some(pod.as_str()));
    delete_and_wait(&admin, "second").await?;

    // The store's copy goes: a resume on the same worker needs only what it kept (the
    // parked files, else its local copy).
    std::fs::remove_file(&blob)?;
    assert_eq!(sandbox.resume().await?, 3);
    let resumed = sandbox.wait_resumed(1, DEADLINE).await?;
    ensure!(resumed.phase() == Phase::Ready, "{:?}", resumed.status);
    assert_eq!(resumed.incarnation(), 2);
    assert_eq!(assigned_pod(&resumed).as_deref(), Some(pod.as_str()));
    assert_eq!(
        resumed.status.as_ref().and_then(|s| s.endpoint.clone()),
        endpoint,
        "the endpoint stays the same"
    );
    assert!(
        parked_sets(&server, &pod, &suspended)?.is_empty(),
        "the resume took the parked files back"
    );
    let after = exec_ok(&sandbox, CHECK).await?;
    assert_eq!(after.stdout, before.stdout, "every file, mode and symlink");
    assert!(
        after.stdout.contains("d/run.sh 755 regular file"),
        "{}",
        after.stdout
    );
    assert!(
        after.stdout.contains("d/key 600 regular file"),
        "{}",
        after.stdout
    );
    assert!(
        after.stdout.contains("d/link 777 symbolic link"),
        "{}",
        after.stdout
    );
    assert!(after.stdout.contains("ran-script"), "{}", after.stdout);
    let first_after = after.sequences.iter().min().copied().context("events")?;
    assert!(
        first_after > last_before,
        "sequence numbers continue: {first_after} after {last_before}"
    );

    // Deleted, the Run takes its local copy with it, and the controller-manager deletes
    // its Snapshot (no fork starts from it).
    delete_and_wait(&admin, "first").await?;
    assert!(!local.exists(), "{}", local.display());
    let snapshots = Api::<Snapshot>::namespaced(admin.clone(), "default");
    within(DEADLINE, "first-s1 is deleted", async {
        kube::runtime::wait::await_condition(snapshots, "first-s1", |s: Option<&Snapshot>| {
            s.is_none()
        })
        .await?;
        Ok(())
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_resume_elsewhere_restores_from_the_store_and_a_tampered_snapshot_fails() -> Result<()> {
    // The workers sweep their local copies at every collection pass (10 s) here.
    let (server, admin) = Server::start_async(Options {
        env: vec![("KRUNTIMES_SNAPSHOT_SWEEP_INTERVAL".into(), "1s".into())],
        ..Options::full()
    })
    .await?;
    create_runtime(&admin, "pair", "bash", 2, 1).await?;
    create(&admin, "first", exclusive_session("pair")).await?;
    let ready = wait_ready(&admin, "first").await?;
    let home = assigned_pod(&ready).context("assigned")?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection.sandbox("first").await?;
    exec_ok(&sandbox, SETUP).await?;
    let before = exec_ok(&sandbox, CHECK).await?;
    suspend(&sandbox).await?;

    // Occupy the worker with the local copy, so the resume goes to the other one.
    create(&admin, "blocker-1", exclusive_session("pair")).await?;
    let blocker = wait_ready(&admin, "blocker-1").await?;
    let mut blocking = "blocker-1";
    if assigned_pod(&blocker).as_deref() != Some(home.as_str()) {
        // It took the other worker: a second one can only go to the home worker.
        create(&admin, "blocker-2", exclusive_session("pair")).await?;
        let second = wait_ready(&admin, "blocker-2").await?;
        assert_eq!(assigned_pod(&second).as_deref(), Some(home.as_str()));
        delete_and_wait(&admin, "blocker-1").await?;
        blocking = "blocker-2";
    }
    sandbox.resume().await?;
    let resumed = sandbox.wait_resumed(1, DEADLINE).await?;
    ensure!(resumed.phase() == Phase::Ready, "{:?}", resumed.status);
    let elsewhere = assigned_pod(&resumed).context("assigned")?;
    assert_ne!(elsewhere, home, "resumed on the other worker");
    assert!(
        !local_copy(&server, &elsewhere, &resumed, "first-s1").exists(),
        "the other worker never held a copy"
    );
    let after = exec_ok(&sandbox, CHECK).await?;
    assert_eq!(after.stdout, before.stdout, "restored from the store");
    // The home worker's copy can serve no resume now (the next suspend copies to where
    // the session is): its sweep removes it. So it does for a Run deleted while Suspended.
    let home_copies = local_copy(&server, &home, &resumed, "first-s1")
        .parent()
        .context("the Run's directory")?
        .to_path_buf();
    ensure!(home_copies.exists(), "{}", home_copies.display());
    delete_and_wait(&admin, blocking).await?;
    create(&admin, "dropped", exclusive_session("pair")).await?;
    wait_ready(&admin, "dropped").await?;
    let dropped = connection.sandbox("dropped").await?;
    exec_ok(&dropped, "echo x > x").await?;
    let dropped_run = suspend(&dropped).await?;
    let holder = snapshot_of(&admin, &dropped_run)
        .await?
        .status
        .and_then(|s| s.local_copy)
        .context("a local copy")?
        .pod;
    let dropped_copies = local_copy(&server, &holder, &dropped_run, "dropped-s1")
        .parent()
        .context("the Run's directory")?
        .to_path_buf();
    ensure!(dropped_copies.exists(), "{}", dropped_copies.display());
    delete_and_wait(&admin, "dropped").await?;
    within(
        DEADLINE,
        "the workers sweep the copies no resume can use",
        async {
            let mut ticks = tokio::time::interval(std::time::Duration::from_millis(200));
            while home_copies.exists() || dropped_copies.exists() {
                ticks.tick().await;
            }
            Ok(())
        },
    )
    .await?;

    // Hostile: the stored snapshot and the local copy are altered after the capture.
    let suspended = suspend(&sandbox).await?;
    let snapshot = snapshot_of(&admin, &suspended).await?;
    assert_eq!(snapshot.name_any(), "first-s2");
    let snap = snapshot.status.clone().unwrap_or_default();
    let blob = file_path(&snap.location.context("location")?.uri)?;
    tamper(&blob)?;
    let holder = snap.local_copy.context("a local copy")?.pod;
    tamper(&local_copy(&server, &holder, &suspended, "first-s2"))?;
    drop_parked(&server, &holder, &suspended).await?;
    let outside = server.data_dir().join("escaped");
    sandbox.resume().await?;
    let failed = wait_for(&admin, "first", "ends", |r| r.phase().is_terminal()).await?;
    let status = failed.status.clone().unwrap_or_default();
    assert_eq!(failed.phase(), Phase::Failed, "{status:?}");
    assert_eq!(
        status.reason.as_deref(),
        Some("SnapshotInvalid"),
        "{status:?}"
    );
    assert!(
        status
            .message
            .as_deref()
            .is_some_and(|m| m.contains("snapshot")),
        "{status:?}"
    );
    assert!(!outside.exists());

    // Hostile: a well-formed snapshot whose digest is recorded, but whose archive names a
    // path out of the workspace. The restore refuses it and writes nothing anywhere.
    create(&admin, "hostile", exclusive_session("pair")).await?;
    wait_ready(&admin, "hostile").await?;
    let hostile = connection.sandbox("hostile").await?;
    exec_ok(&hostile, "echo kept > kept").await?;
    let suspended = suspend(&hostile).await?;
    let mut snapshot = snapshot_of(&admin, &suspended).await?;
    let snap = snapshot.status.clone().unwrap_or_default();
    let marker = "kr-escaped-marker";
    let archive = hostile_archive(&format!("workspace/../../../../{marker}"))?;
    let digest = format!("sha256:{}", hex::encode(sha2::Sha256::digest(&archive)));
    std::fs::write(
        file_path(&snap.location.context("location")?.uri)?,
        &archive,
    )?;
    let holder = snap.local_copy.context("a local copy")?.pod;
    std::fs::write(
        local_copy(&server, &holder, &suspended, &snapshot.name_any()),
        &archive,
    )?;
    drop_parked(&server, &holder, &suspended).await?;
    if let Some(status) = snapshot.status.as_mut() {
        status.digest = Some(digest);
    }
    Api::<Snapshot>::namespaced(admin.clone(), "default")
        .replace_status(&snapshot.name_any(), &PostParams::default(), &snapshot)
        .await?;
    hostile.resume().await?;
    let failed = wait_for(&admin, "hostile", "ends", |r| r.phase().is_terminal()).await?;
    let status = failed.status.clone().unwrap_or_default();
    assert_eq!(failed.phase(), Phase::Failed, "{status:?}");
    assert_eq!(
        status.reason.as_deref(),
        Some("SnapshotInvalid"),
        "{status:?}"
    );
    assert_eq!(find_named(server.data_dir(), marker), None);
    assert!(!std::env::temp_dir().join(marker).exists());
    Ok(())
}

/// A zstd-compressed tar of the two roots and one file named `name` (the tar crate's
/// setters refuse such names: the header is written raw).
fn hostile_archive(name: &str) -> Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    for (kind, entry, data) in [
        (tar::EntryType::Directory, "workspace", &b""[..]),
        (tar::EntryType::Directory, "artifacts", &b""[..]),
        (tar::EntryType::Regular, name, &b"escaped"[..]),
    ] {
        let mut header = tar::Header::new_old();
        header.set_entry_type(kind);
        header.set_size(data.len() as u64);
        header.set_mode(0o755);
        header.as_old_mut().name[..entry.len()].copy_from_slice(entry.as_bytes());
        header.set_cksum();
        builder.append(&header, data)?;
    }
    Ok(zstd::encode_all(&builder.into_inner()?[..], 1)?)
}

/// The first path beneath `dir` whose file name is `name`.
fn find_named(dir: &Path, name: &str) -> Option<PathBuf> {
    let entries = std::fs::read_dir(dir).ok()?;
    for entry in entries.flatten() {
        let path = entry.path();
        if entry.file_name() == name {
            return Some(path);
        }
        if entry.file_type().is_ok_and(|t| t.is_dir())
            && let Some(found) = find_named(&path, name)
        {
            return Some(found);
        }
    }
    None
}

#[tokio::test]
async fn a_store_failure_during_suspend_keeps_the_session_serving_until_it_is_back() -> Result<()> {
    let mut s3 = S3Server::start()?;
    let (server, admin) = Server::start_async(Options {
        env: s3.env(),
        ..Options::full()
    })
    .await?;
    common::create_s3_runtime(&admin, "s3", 1, &s3, "kr").await?;
    create(&admin, "first", exclusive_session("s3")).await?;
    wait_ready(&admin, "first").await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection.sandbox("first").await?;
    exec_ok(&sandbox, SETUP).await?;
    let before = exec_ok(&sandbox, CHECK).await?;

    s3.stop();
    sandbox.suspend().await?;
    let retrying = wait_for(&admin, "first", "retries its snapshot", |r| {
        r.status.as_ref().is_some_and(|s| {
            s.conditions.iter().any(|c| {
                c.type_ == SUSPENDED_CONDITION
                    && c.status == "False"
                    && c.reason.as_deref() == Some("SnapshotRetrying")
            })
        })
    })
    .await?;
    assert_eq!(retrying.phase(), Phase::Ready, "{:?}", retrying.status);
    // It keeps serving: an operation succeeds (between two tries of the capture; one
    // refused while a try runs is sent again).
    let served = within(DEADLINE, "an operation succeeds meanwhile", async {
        loop {
            if let Ok(seen) = exec_ok(&sandbox, "echo still-here > d/late && cat d/late").await {
                return Ok(seen);
            }
        }
    })
    .await?;
    assert_eq!(served.stdout, "still-here\n");

    s3.restart()?;
    let suspended = sandbox.wait_suspended(DEADLINE).await?;
    ensure!(
        suspended.phase() == Phase::Suspended,
        "{:?}",
        suspended.status
    );
    let snapshot = snapshot_of(&admin, &suspended).await?;
    let uri = snapshot
        .status
        .as_ref()
        .and_then(|s| s.location.as_ref())
        .map(|l| l.uri.clone())
        .context("location")?;
    assert!(uri.starts_with("s3://"), "{uri}");
    sandbox.resume().await?;
    let resumed = sandbox.wait_resumed(1, DEADLINE).await?;
    ensure!(resumed.phase() == Phase::Ready, "{:?}", resumed.status);
    let after = exec_ok(&sandbox, &format!("{CHECK} && cat d/late")).await?;
    assert_eq!(after.stdout, format!("{}still-here\n", before.stdout));
    Ok(())
}

/// Item 8: a suspend overtaken by a resume from another caller before it took effect is
/// told `Superseded` instead of waiting on; a resume already at its target (a Ready
/// sandbox not asked to suspend) returns at once; and the overtaken session serves on.
#[tokio::test]
async fn an_overtaken_suspend_is_superseded_and_a_resume_at_its_target_returns_at_once()
-> Result<()> {
    let (server, admin) = Server::start_async(Options::full()).await?;
    create_runtime(&admin, "solo", "bash", 1, 1).await?;
    create(&admin, "held", exclusive_session("solo")).await?;
    wait_ready(&admin, "held").await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection.sandbox("held").await?;
    let other = connection.sandbox("held").await?;

    // At its target: Ready and not asked to suspend. Returns at once, same incarnation.
    other.resume().await?;
    let run = other.wait_resumed(1, DEADLINE).await?;
    assert_eq!((run.phase(), run.incarnation()), (Phase::Ready, 1));

    // An operation blocked on a FIFO holds the suspend at its queue barrier.
    exec_ok(&sandbox, "mkfifo gate").await?;
    let mut session = sandbox.open_session().await?;
    let blocked = session
        .send(&Operation::command(Command::shell("cat gate")))
        .await?;
    within(DEADLINE, "the blocking operation starts", async {
        loop {
            let event = session.receive().await?;
            if event.operation_id == blocked && matches!(event.kind, EventKind::Started) {
                return Ok(());
            }
        }
    })
    .await?;
    let asked = sandbox.suspend().await?;
    let overtaking = other.resume().await?;
    assert!(overtaking > asked, "{overtaking} > {asked}");
    match sandbox.wait_suspended(DEADLINE).await {
        Err(kruntimes_client::sandbox::SandboxError::Superseded {
            generation,
            current_generation,
            ..
        }) => assert_eq!((generation, current_generation), (asked, overtaking)),
        other => anyhow::bail!("expected Superseded, got {other:?}"),
    }
    // The session was never suspended: cancel the blocked operation, and it serves on.
    session.cancel(&blocked).await?;
    session.close().await;
    let run = other.wait_resumed(1, DEADLINE).await?;
    assert_eq!((run.phase(), run.incarnation()), (Phase::Ready, 1));
    within(DEADLINE, "the session takes operations again", async {
        loop {
            match exec_ok(&sandbox, "echo again").await {
                Ok(seen) if seen.stdout.trim() == "again" => return Ok(()),
                _ => tokio::task::yield_now().await,
            }
        }
    })
    .await?;
    drop(server);
    Ok(())
}

/// Two snapshots that were lost before: a session whose Run name has the 253 bytes an
/// object name may have (its local copy's staging file name had more than the 255 bytes a
/// file name may: the capture failed `ENAMETOOLONG` and the suspend retried forever), and a
/// workspace of incompressible bytes just under the cap, resumed from the store (the store
/// read was capped at the files' bytes, less than their compressed archive, so the good
/// snapshot failed the resume `SnapshotInvalid`).
#[tokio::test]
async fn a_long_named_session_at_its_size_cap_suspends_and_resumes_from_the_store() -> Result<()> {
    const CAP: u64 = 1 << 20;
    let (server, admin) = Server::start_async(Options {
        extra_args: vec!["--session-max-file-bytes".into(), CAP.to_string()],
        ..Options::full()
    })
    .await?;
    create_runtime(&admin, "solo", "bash", 1, 1).await?;
    // Labels of a DNS subdomain have at most 63 bytes each.
    let name = ["a", "b", "c"].map(|c| c.repeat(63)).join(".") + "." + &"d".repeat(61);
    assert_eq!(name.len(), 253);
    create(&admin, &name, exclusive_session("solo")).await?;
    wait_ready(&admin, &name).await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection.sandbox(&name).await?;
    // 1,048,000 random bytes: the files are under the cap, their archive is over it.
    exec_ok(
        &sandbox,
        "head -c 1048000 /dev/urandom > big && sha256sum big > big.sum",
    )
    .await?;
    let suspended = suspend(&sandbox).await?;
    let snapshot = snapshot_of(&admin, &suspended).await?;
    let snap = snapshot.status.clone().unwrap_or_default();
    let stored = std::fs::metadata(file_path(&snap.location.context("location")?.uri)?)?.len();
    ensure!(stored > CAP, "the archive ({stored} bytes) is over the cap");

    // Without its parked files and its local copy, the resume reads the store.
    let holder = snap.local_copy.context("a local copy")?.pod;
    drop_parked(&server, &holder, &suspended).await?;
    let local = server
        .data_dir()
        .join("snapshots/local")
        .join(&holder)
        .join(suspended.uid().unwrap_or_default());
    std::fs::remove_dir_all(&local).with_context(|| format!("remove {}", local.display()))?;
    sandbox.resume().await?;
    let resumed = sandbox.wait_resumed(1, DEADLINE).await?;
    ensure!(resumed.phase() == Phase::Ready, "{:?}", resumed.status);
    exec_ok(&sandbox, "sha256sum -c big.sum").await?;
    Ok(())
}

/// The pid of the runtimed of worker Pod `pod` (a child of this test's `kruntimes up`).
fn runtimed_pid(pod: &str) -> Result<i32> {
    let needle = format!(" --pod-name {pod} ");
    let found = kruntimes_testkit::procs::matching(|p| {
        p.cmdline.contains(" runtimed ") && format!("{} ", p.cmdline).contains(&needle)
    });
    match found.as_slice() {
        [one] => Ok(one.pid),
        other => anyhow::bail!("not one runtimed for Pod {pod}: {other:?}"),
    }
}

/// A SIGKILL of the owner's runtimed while it captures: the session is lost with its
/// worker (`onWorkerLoss` defaults to Fail) and is never seen Suspended, its Snapshot never
/// becomes Ready, and nothing stands at the store's name of the archive: never both Ready
/// and Suspended, never half captured.
#[tokio::test]
async fn a_sigkill_of_the_owner_during_a_capture_never_leaves_a_half_captured_suspend() -> Result<()>
{
    let (server, admin) = Server::start_async(Options::full()).await?;
    create_runtime(&admin, "solo", "bash", 1, 1).await?;
    create(&admin, "killed", exclusive_session("solo")).await?;
    let ready = wait_ready(&admin, "killed").await?;
    let pod = assigned_pod(&ready).context("assigned")?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection.sandbox("killed").await?;
    // Enough incompressible bytes that the capture takes a while.
    exec_ok(&sandbox, "head -c 64000000 /dev/urandom > big").await?;

    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let watch = {
        let (admin, seen) = (admin.clone(), seen.clone());
        tokio::spawn(async move {
            wait_for(&admin, "killed", "ends", |run| {
                seen.lock().expect("phases").push(run.phase());
                run.phase().is_terminal()
            })
            .await
        })
    };
    sandbox.suspend().await?;
    let snapshots = Api::<Snapshot>::namespaced(admin.clone(), "default");
    within(DEADLINE, "the capture starts", async {
        kube::runtime::wait::await_condition(
            snapshots.clone(),
            "killed-s1",
            |s: Option<&Snapshot>| s.is_some_and(|s| s.phase() == SnapshotPhase::Capturing),
        )
        .await?;
        Ok(())
    })
    .await?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(runtimed_pid(&pod)?),
        nix::sys::signal::Signal::SIGKILL,
    )?;

    let ended = watch.await??;
    let status = ended.status.clone().unwrap_or_default();
    assert_eq!(ended.phase(), Phase::Failed, "{status:?}");
    assert_eq!(status.reason.as_deref(), Some("WorkerLost"), "{status:?}");
    let phases = seen.lock().expect("phases").clone();
    assert!(!phases.contains(&Phase::Suspended), "{phases:?}");
    let snapshot = snapshots.get("killed-s1").await?;
    assert_ne!(
        snapshot.phase(),
        SnapshotPhase::Ready,
        "{:?}",
        snapshot.status
    );
    let uid = snapshot.metadata.uid.clone().unwrap_or_default();
    let archive = server.data_dir().join(format!(
        "snapshots/store/default/snapshots/killed-s1/{uid}/archive.tar.zst"
    ));
    assert!(!archive.exists(), "{} exists", archive.display());
    Ok(())
}

/// A graceful stop of `kruntimes up` suspends its Ready sessions (their workers drain) and
/// the next start on the same data directory resumes them: each comes back Ready, a later
/// incarnation, with its files; a session its user suspended stays Suspended.
#[tokio::test]
async fn a_graceful_restart_suspends_ready_sessions_and_the_next_start_resumes_them() -> Result<()>
{
    let root = tempfile::tempdir()?;
    let data_dir = root.path().join("data");
    let options = Options {
        data_dir: Some(data_dir.clone()),
        ..Options::full()
    };
    let (mut server, admin) = Server::start_async(options.clone()).await?;
    create_runtime(&admin, "trio", "bash", 1, 4).await?;
    let names = ["kept-1", "kept-2", "kept-3"];
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let mut last = std::collections::HashMap::new();
    for name in names.iter().chain(["asked"].iter()) {
        let mut spec = exclusive_session("trio");
        spec.resources = None;
        create(&admin, name, spec).await?;
        wait_ready(&admin, name).await?;
        let seen = exec_ok(
            &connection.sandbox(name).await?,
            &format!("echo {name} > mine"),
        )
        .await?;
        last.insert(
            *name,
            seen.sequences.iter().copied().max().context("events")?,
        );
    }
    suspend(&connection.sandbox("asked").await?).await?;

    let exit = server.stop()?;
    ensure!(exit.success(), "kruntimes up exited {exit}");
    drop(server);
    let (server, admin) = Server::start_async(options).await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    for name in names {
        let back = wait_for(&admin, name, "is back Ready", |r| {
            r.phase() == Phase::Ready && r.incarnation() >= 2
        })
        .await?;
        // Suspended by its draining worker, not by its user.
        let snapshot = back.status.as_ref().and_then(|s| s.snapshot.as_ref());
        ensure!(
            snapshot.is_some_and(|s| s.name == format!("{name}-s1")),
            "{name}: {snapshot:?}"
        );
        ensure!(!back.spec.suspend_requested(), "{name}: {:?}", back.spec);
        let seen = exec_ok(&connection.sandbox(name).await?, "cat mine").await?;
        assert_eq!(seen.stdout.trim(), name, "{name} kept its files");
        let first = seen.sequences.iter().copied().min().context("events")?;
        assert!(
            first > last[name],
            "{name}: sequence numbers continue: {first} after {}",
            last[name]
        );
    }
    let asked = Api::<Run>::namespaced(admin.clone(), "default")
        .get("asked")
        .await?;
    assert_eq!(asked.phase(), Phase::Suspended, "{:?}", asked.status);
    assert!(asked.spec.suspend_requested());
    Ok(())
}

/// Issue 19.6: `mode.session.onWorkerLoss` was accepted and ignored: a Ready session whose
/// worker was lost (its runtimed SIGKILLed) always ended Failed/WorkerLost. Now a Run with
/// `ResumeFromSnapshot` whose `status.snapshot` is a Ready Snapshot (it was suspended and
/// resumed once) is resumed from it on the next worker, incarnation 3, with the Snapshot's
/// files: what it wrote after the Snapshot is lost. One with the default policy fails.
#[tokio::test]
async fn a_lost_worker_resumes_a_session_from_its_snapshot_when_the_run_says_so() -> Result<()> {
    let (server, admin) = Server::start_async(Options::full()).await?;
    create_runtime(&admin, "lossy", "bash", 1, 4).await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let pod = lossy_sessions(&admin, &connection).await?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(runtimed_pid(&pod)?),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    lossy_outcome(&admin, &connection, &pod).await
}

/// Issue 19.6 after a SIGKILL of the whole `kruntimes up` (API server, controller and
/// workers' parent at once): the next start on the same data directory finds the two
/// sessions on workers of a dead incarnation. The one whose Run says `ResumeFromSnapshot`
/// comes back from its last Snapshot, which the store kept; the other ends
/// Failed/WorkerLost, as after a lost worker.
#[tokio::test]
async fn a_sigkilled_kruntimes_up_resumes_a_session_from_its_snapshot_when_the_run_says_so()
-> Result<()> {
    let root = tempfile::tempdir()?;
    let options = Options {
        data_dir: Some(root.path().join("data")),
        ..Options::full()
    };
    let (mut server, admin) = Server::start_async(options.clone()).await?;
    create_runtime(&admin, "lossy", "bash", 1, 4).await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let pod = lossy_sessions(&admin, &connection).await?;
    server.kill()?;
    drop(server);
    let (server, admin) = Server::start_async(options).await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    lossy_outcome(&admin, &connection, &pod).await
}

/// Two Ready sessions on one worker of Runtime `lossy`, `resumer` (`onWorkerLoss:
/// ResumeFromSnapshot`) and `failer` (the default), each suspended and resumed once (so
/// each has a Ready Snapshot, `<name>-s1`, holding `mine`) and then given a file `later`
/// that no Snapshot holds. Returns the worker's Pod.
async fn lossy_sessions(admin: &Client, connection: &Connection) -> Result<String> {
    let mut pod = None;
    for (name, policy) in [
        ("resumer", Some(WorkerLossPolicy::ResumeFromSnapshot)),
        ("failer", None),
    ] {
        let mut spec = exclusive_session("lossy");
        spec.resources = None;
        if let Some(session) = spec.mode.session.as_mut() {
            session.on_worker_loss = policy;
        }
        create(admin, name, spec).await?;
        wait_ready(admin, name).await?;
        let sandbox = connection.sandbox(name).await?;
        exec_ok(&sandbox, &format!("echo {name} > mine")).await?;
        suspend(&sandbox).await?;
        sandbox.resume().await?;
        let resumed = sandbox.wait_resumed(1, DEADLINE).await?;
        ensure!(resumed.phase() == Phase::Ready, "{:?}", resumed.status);
        exec_ok(&sandbox, "echo later > later").await?;
        pod = assigned_pod(&resumed);
    }
    pod.context("assigned")
}

/// After the worker `pod` of [`lossy_sessions`] is lost: `resumer` is Ready again,
/// incarnation 3, on another worker, with its Snapshot's files and nothing written after
/// it; `failer` ends Failed/WorkerLost.
async fn lossy_outcome(admin: &Client, connection: &Connection, pod: &str) -> Result<()> {
    let back = wait_for(admin, "resumer", "is resumed or ends", |r| {
        (r.phase() == Phase::Ready && r.incarnation() == 3) || r.phase().is_terminal()
    })
    .await?;
    ensure!(back.phase() == Phase::Ready, "{:?}", back.status);
    assert_ne!(assigned_pod(&back).as_deref(), Some(pod));
    let snapshot = back.status.as_ref().and_then(|s| s.snapshot.clone());
    assert_eq!(snapshot.map(|s| s.name), Some("resumer-s1".to_string()));
    let seen = exec_ok(
        &connection.sandbox("resumer").await?,
        "cat mine && if test -e later; then echo kept; else echo lost; fi",
    )
    .await?;
    assert_eq!(
        seen.stdout, "resumer\nlost\n",
        "the Snapshot's files, nothing after it"
    );

    let failed = wait_for(admin, "failer", "ends", |r| r.phase().is_terminal()).await?;
    let status = failed.status.clone().unwrap_or_default();
    assert_eq!(failed.phase(), Phase::Failed, "{status:?}");
    assert_eq!(status.reason.as_deref(), Some("WorkerLost"), "{status:?}");
    Ok(())
}

/// Issue 20: only the latest suspend Snapshot of a session is kept. Suspended twice, the
/// session's first Snapshot (`-s1`) is deleted by the controller-manager once the second
/// (`-s2`) is the one its Run names, and the collector (every 200 ms here, no grace) then
/// removes its data; the session resumes from `-s2` with its files.
#[tokio::test]
async fn only_the_latest_suspend_snapshot_is_kept_and_the_older_ones_data_is_collected()
-> Result<()> {
    let (server, admin) = Server::start_async(common::eager_collector()).await?;
    create_runtime(&admin, "solo", "bash", 1, 1).await?;
    create(&admin, "twice", exclusive_session("solo")).await?;
    wait_ready(&admin, "twice").await?;
    let connection = Connection::from_paths(&[server.kubeconfig_path()]).await?;
    let sandbox = connection.sandbox("twice").await?;
    exec_ok(&sandbox, "echo one > one.txt").await?;
    let first = snapshot_of(&admin, &suspend(&sandbox).await?).await?;
    ensure!(first.name_any() == "twice-s1");
    let first_data = file_path(
        &first
            .status
            .as_ref()
            .and_then(|s| s.location.as_ref())
            .context("the first Snapshot's location")?
            .uri,
    )?;
    ensure!(first_data.is_file(), "{}", first_data.display());
    sandbox.resume().await?;
    sandbox.wait_resumed(1, DEADLINE).await?;
    exec_ok(&sandbox, "echo two > two.txt").await?;
    let second = snapshot_of(&admin, &suspend(&sandbox).await?).await?;
    ensure!(second.name_any() == "twice-s2");

    let snapshots = Api::<Snapshot>::namespaced(admin.clone(), "default");
    within(DEADLINE, "twice-s1 is deleted", async {
        kube::runtime::wait::await_condition(
            snapshots.clone(),
            "twice-s1",
            kube::runtime::wait::conditions::is_deleted(&first.uid().unwrap_or_default()),
        )
        .await?;
        Ok(())
    })
    .await?;
    common::collected(&first_data, "twice-s1's data").await?;
    ensure!(snapshots.get_opt("twice-s2").await?.is_some());
    sandbox.resume().await?;
    let resumed = sandbox.wait_resumed(1, DEADLINE).await?;
    ensure!(resumed.phase() == Phase::Ready, "{:?}", resumed.status);
    let seen = exec_ok(&sandbox, "cat one.txt two.txt").await?;
    ensure!(seen.stdout == "one\ntwo\n", "{:?}", seen.stdout);
    Ok(())
}
