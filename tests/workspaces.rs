//! Project Workspaces and `Dev` machines against a real `kruntimes up`, end to end
//! (issue 20 item 3): a `Dev` machine is the Run named after its project, so a second claim
//! of the project gets 409 from the API server itself while the first exists (20 racing
//! claims: one winner), another project is not held up, a project's files go from one
//! machine to the next through the Workspace's commits, every ending with a live worker
//! commits (Drain, Immediate while a command runs, deletion), and an ended Run that was
//! never deleted does not block the next claim. Every wait is a watch with a deadline.

mod common;

use anyhow::{Context, Result, ensure};
use common::{DEADLINE, create_runtime};
use kruntimes_api::run::{Termination, TerminationMode};
use kruntimes_api::snapshot::SnapshotReason;
use kruntimes_api::workspace::WORKSPACE_LABEL;
use kruntimes_api::{Phase, Run, Snapshot, Workspace};
use kruntimes_client::Connection;
use kruntimes_client::machines::{Class, ExecRequest, Lease, Machines, Spec};
use kruntimes_testkit::{Options, Server, within};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};

async fn connection(server: &Server) -> Result<Connection> {
    Ok(Connection::from_kubeconfig(Some(server.kubeconfig_path())).await?)
}

/// What `cat path` prints on the machine (it must exit 0).
async fn cat(machines: &Machines, lease: &Lease, path: &str) -> Result<String> {
    let seen = machines
        .exec(lease, &ExecRequest::argv(["cat", path]))
        .await?;
    ensure!(seen.exit_code == 0, "cat {path}: {seen:?}");
    Ok(String::from_utf8_lossy(&seen.stdout).into_owned())
}

/// Waits until Workspace `name` has made `commits` commits; returns it.
async fn committed(client: &Client, name: &str, commits: i64) -> Result<Workspace> {
    let api = Api::<Workspace>::namespaced(client.clone(), "default");
    let mut seen = None;
    within(DEADLINE, "the Workspace's commit", async {
        let found =
            kube::runtime::wait::await_condition(api.clone(), name, |w: Option<&Workspace>| {
                w.and_then(|w| w.status.as_ref())
                    .and_then(|s| s.commits)
                    .is_some_and(|c| c >= commits)
            })
            .await?;
        seen = found;
        Ok(())
    })
    .await?;
    let workspace = seen.context("the Workspace")?;
    let made = workspace.status.as_ref().and_then(|s| s.commits);
    ensure!(
        made == Some(commits),
        "{name}: {made:?} commits, not {commits}"
    );
    Ok(workspace)
}

/// Waits until Run `name` is as `done` says (`what`, for the timeout's error).
async fn wait_run(
    runs: &Api<Run>,
    name: &str,
    what: &str,
    done: impl Fn(&Run) -> bool + Send + 'static,
) -> Result<()> {
    within(DEADLINE, what, async {
        kube::runtime::wait::await_condition(runs.clone(), name, move |r: Option<&Run>| {
            r.is_some_and(&done)
        })
        .await?;
        Ok(())
    })
    .await
}

/// Waits until Run `name` is gone.
async fn gone(runs: &Api<Run>, name: &str, uid: &str) -> Result<()> {
    kruntimes_testkit::deleted(runs, name, uid, DEADLINE).await
}

#[tokio::test]
async fn dev_machines_hold_their_project_and_keep_its_files() -> Result<()> {
    let (server, admin) = Server::start_async(Options::full()).await?;
    create_runtime(&admin, "dev", "bash", 2, 4).await?;
    let connection = connection(&server).await?;
    let machines = Machines::new(connection.clone(), "dev");
    let runs: Api<Run> = Api::namespaced(admin.clone(), "default");
    let snapshots: Api<Snapshot> = Api::namespaced(admin.clone(), "default");

    // The first claim creates the Workspace, empty; the Run is named after the project.
    let alpha = Spec::new("default", Class::Dev, "alpha");
    let first = machines.claim(&alpha).await?;
    ensure!(first.id == "alpha", "the Dev machine's Run is {}", first.id);
    machines.write(&first, "notes/a.txt", b"one").await?;
    let missing = machines
        .exec(&first, &ExecRequest::argv(["cat", "from-before.txt"]))
        .await?;
    ensure!(
        missing.exit_code == 1,
        "a new Workspace is empty: {missing:?}"
    );

    // While it exists the project is held: 409 from the API server, nothing created. Another
    // project is not held up.
    let busy = machines
        .claim(&alpha)
        .await
        .expect_err("the project is held");
    ensure!(busy.api_status() == Some(409), "{busy}");
    let beta = machines
        .claim(&Spec::new("default", Class::Dev, "beta"))
        .await?;
    machines.write(&beta, "b.txt", b"beta's").await?;

    // The release returns once the commit is made: the next claim finds the files.
    machines.release(&first).await?;
    let workspace = committed(&admin, "alpha", 1).await?;
    let head = workspace
        .status
        .as_ref()
        .and_then(|s| s.head.clone())
        .context("a head")?;
    let commit = snapshots.get(&head.name).await?;
    ensure!(
        commit.spec.reason == Some(SnapshotReason::Commit)
            && commit.uid() == head.uid
            && commit.labels().get(WORKSPACE_LABEL).map(String::as_str) == Some("alpha"),
        "{commit:?}"
    );
    let second = machines.claim(&alpha).await?;
    ensure!(cat(&machines, &second, "notes/a.txt").await? == "one");
    ensure!(
        machines
            .exec(&second, &ExecRequest::argv(["cat", "b.txt"]))
            .await?
            .exit_code
            == 1,
        "another project's files are not in this one"
    );

    // Immediate while a command runs: the command is stopped, then what ran before it is
    // committed.
    machines.write(&second, "notes/b.txt", b"two").await?;
    let running = {
        let machines = machines.clone();
        let lease = second.clone();
        tokio::spawn(async move {
            machines
                .exec(&lease, &ExecRequest::argv(["sleep", "60"]))
                .await
        })
    };
    let uid = runs.get("alpha").await?.uid().context("uid")?;
    let sandbox = connection.sandbox("alpha").await?;
    within(DEADLINE, "the command runs", async {
        loop {
            if !sandbox.status().await?.running_operation_id.is_empty() {
                return Ok(());
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await?;
    let termination = serde_json::json!({"spec": {"termination": Termination {
        mode: TerminationMode::Immediate,
    }}});
    runs.patch(
        "alpha",
        &PatchParams::default(),
        &Patch::Merge(&termination),
    )
    .await?;
    let ended = within(DEADLINE, "the stopped command answers", async {
        Ok(running.await?)
    })
    .await?;
    ensure!(
        ended.as_ref().map_or(true, |r| r.exit_code != 0),
        "the sleep was stopped: {ended:?}"
    );
    committed(&admin, "alpha", 2).await?;
    // The commit comes first, the end after it.
    wait_run(&runs, "alpha", "the Run ends Cancelled", |r| {
        r.phase().is_terminal()
    })
    .await?;
    let run = runs.get("alpha").await?;
    ensure!(run.phase() == Phase::Cancelled, "{:?}", run.status);

    // That Run ended but was never deleted: it does not block the next claim, which
    // deletes it (that Run only) and finds both files.
    let third = machines.claim(&alpha).await?;
    let third_uid = runs.get("alpha").await?.uid().context("uid")?;
    ensure!(third_uid != uid, "a new Run");
    ensure!(cat(&machines, &third, "notes/a.txt").await? == "one");
    ensure!(cat(&machines, &third, "notes/b.txt").await? == "two");

    // Deleting a live Dev machine commits too, before its finalizer goes.
    machines.write(&third, "c.txt", b"three").await?;
    runs.delete("alpha", &Default::default()).await?;
    gone(&runs, "alpha", &third_uid).await?;
    committed(&admin, "alpha", 3).await?;
    let fourth = machines.claim(&alpha).await?;
    ensure!(cat(&machines, &fourth, "c.txt").await? == "three");

    // Twenty racing claims of a new project: exactly one machine.
    let gamma = Spec::new("default", Class::Dev, "gamma");
    let claims = futures::future::join_all((0..20).map(|_| machines.claim(&gamma))).await;
    let winners: Vec<&Lease> = claims.iter().filter_map(|c| c.as_ref().ok()).collect();
    ensure!(winners.len() == 1, "{} claims won", winners.len());
    for lost in claims.iter().filter_map(|c| c.as_ref().err()) {
        ensure!(lost.api_status() == Some(409), "a losing claim: {lost}");
    }
    let listed = runs
        .list(&ListParams::default().labels("kruntimes.io/project=gamma"))
        .await?;
    ensure!(
        listed.items.len() == 1,
        "{} Runs of gamma",
        listed.items.len()
    );

    for lease in [winners[0], &beta, &fourth] {
        machines.release(lease).await?;
    }
    // Commits beyond the default history of 5 are pruned; 4 were made of alpha.
    let alpha_commits = snapshots
        .list(&ListParams::default().labels(&format!("{WORKSPACE_LABEL}=alpha")))
        .await?;
    ensure!(
        alpha_commits.items.len() == 4,
        "{:?}",
        alpha_commits
            .items
            .iter()
            .map(|s| s.name_any())
            .collect::<Vec<_>>()
    );
    Ok(())
}

/// A Workspace keeps `spec.history` commits: older ones are deleted after each commit,
/// the head never.
#[tokio::test]
async fn a_workspace_keeps_its_history_of_commits() -> Result<()> {
    let (server, admin) = Server::start_async(Options::full()).await?;
    create_runtime(&admin, "dev", "bash", 1, 2).await?;
    let workspaces = Api::<Workspace>::namespaced(admin.clone(), "default");
    let mut workspace = Workspace::new("kept", kruntimes_api::WorkspaceSpec::default());
    workspace.spec.history = Some(2);
    workspaces.create(&Default::default(), &workspace).await?;
    let machines = Machines::new(connection(&server).await?, "dev");
    let spec = Spec::new("default", Class::Dev, "kept");
    for round in 1..=4_i64 {
        let lease = machines.claim(&spec).await?;
        if round > 1 {
            ensure!(cat(&machines, &lease, "round").await? == (round - 1).to_string());
        }
        machines
            .write(&lease, "round", round.to_string().as_bytes())
            .await?;
        machines.release(&lease).await?;
        committed(&admin, "kept", round).await?;
    }
    let snapshots: Api<Snapshot> = Api::namespaced(admin.clone(), "default");
    let kept = snapshots
        .list(&ListParams::default().labels(&format!("{WORKSPACE_LABEL}=kept")))
        .await?;
    let head = workspaces
        .get("kept")
        .await?
        .status
        .and_then(|s| s.head)
        .context("a head")?;
    ensure!(
        kept.items.len() == 2 && kept.items.iter().any(|s| s.name_any() == head.name),
        "{:?}, head {}",
        kept.items.iter().map(|s| s.name_any()).collect::<Vec<_>>(),
        head.name
    );
    Ok(())
}

/// Idle expiry (the controller-manager writes `Timeout/IdleTimeout`, not the worker) of a
/// session with a Workspace: the worker commits its files before it closes the session.
#[tokio::test]
async fn an_idle_expired_session_commits_to_its_workspace() -> Result<()> {
    let mut options = Options::full();
    options.extra_args = [
        "--session-idle-ttl",
        "4s",
        "--session-idle-sweep-interval",
        "200ms",
    ]
    .map(String::from)
    .to_vec();
    let (server, admin) = Server::start_async(options).await?;
    create_runtime(&admin, "dev", "bash", 1, 2).await?;
    let connection = connection(&server).await?;
    let sandbox = connection
        .runtime("dev")
        .acquire_sandbox(&kruntimes_client::sandbox::AcquireOptions {
            workspace: Some("idle".into()),
            // Written before Ready (no operation needed before the session may expire).
            source: Some("before the expiry".into()),
            ..Default::default()
        })
        .await?;
    ensure!(sandbox.name() == "idle", "named after its Workspace");
    let runs: Api<Run> = Api::namespaced(admin.clone(), "default");
    wait_run(&runs, "idle", "the session expires", |r| {
        r.phase() == Phase::Timeout
    })
    .await?;
    committed(&admin, "idle", 1).await?;
    // The next session of the Workspace (once the ended Run is deleted) has the file.
    let uid = runs.get("idle").await?.uid().context("uid")?;
    runs.delete("idle", &Default::default()).await?;
    gone(&runs, "idle", &uid).await?;
    let next = connection
        .runtime("dev")
        .acquire_sandbox(&kruntimes_client::sandbox::AcquireOptions {
            workspace: Some("idle".into()),
            ..Default::default()
        })
        .await?;
    ensure!(next.read_file("main.sh").await? == b"before the expiry");
    // Its deletion while nothing ran since the restore commits the same files once more.
    next.end_and_delete().await?;
    Ok(())
}

/// The controller-manager deletes a Workspace unused for its `ttlSecondsAfterUnused`, with
/// its commits, but never one whose lock (a Run named after it) is held; the commits of a
/// Workspace deleted by hand are collected too.
#[tokio::test]
async fn unused_workspaces_expire_and_orphaned_commits_are_collected() -> Result<()> {
    let mut options = Options::full();
    options.extra_args = ["--session-idle-sweep-interval", "200ms"]
        .map(String::from)
        .to_vec();
    let (server, admin) = Server::start_async(options).await?;
    create_runtime(&admin, "dev", "bash", 1, 4).await?;
    let machines = Machines::new(connection(&server).await?, "dev");
    let workspaces = Api::<Workspace>::namespaced(admin.clone(), "default");
    let snapshots: Api<Snapshot> = Api::namespaced(admin.clone(), "default");
    let commits_of =
        |name: &str| ListParams::default().labels(&format!("{WORKSPACE_LABEL}={name}"));

    // "held" is claimed first (its worker makes the Workspace) and then given a TTL of a
    // second: its Run holds it past the TTL. "lapsed" expires after a second unused;
    // "manual" has no TTL.
    let held = machines
        .claim(&Spec::new("default", Class::Dev, "held"))
        .await?;
    machines.write(&held, "f", b"held").await?;
    let ttl = serde_json::json!({"spec": {"ttlSecondsAfterUnused": 1}});
    let held_uid = workspaces
        .patch("held", &PatchParams::default(), &Patch::Merge(&ttl))
        .await?
        .uid()
        .context("uid")?;
    // Both are committed to first, with no TTL (a loaded machine may take longer than a
    // second over a claim); then "lapsed" gets its TTL, and no Run holds it.
    for name in ["lapsed", "manual"] {
        let lease = machines
            .claim(&Spec::new("default", Class::Dev, name))
            .await?;
        machines.write(&lease, "f", name.as_bytes()).await?;
        machines.release(&lease).await?;
        committed(&admin, name, 1).await?;
    }
    let lapsed_uid = workspaces
        .patch("lapsed", &PatchParams::default(), &Patch::Merge(&ttl))
        .await?
        .uid()
        .context("uid")?;
    within(DEADLINE, "the lapsed Workspace is deleted", async {
        kube::runtime::wait::await_condition(
            workspaces.clone(),
            "lapsed",
            kube::runtime::wait::conditions::is_deleted(&lapsed_uid),
        )
        .await?;
        Ok(())
    })
    .await?;
    // Its commits go in the same round; a Workspace deleted by hand loses its commits too.
    workspaces.delete("manual", &Default::default()).await?;
    within(DEADLINE, "the orphaned commits are collected", async {
        loop {
            let lapsed = snapshots.list(&commits_of("lapsed")).await?.items.len();
            let manual = snapshots.list(&commits_of("manual")).await?.items.len();
            if lapsed == 0 && manual == 0 {
                return Ok(());
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    })
    .await?;
    // The held Workspace outlived rounds that deleted the others, and commits at the end.
    let still = workspaces.get_opt("held").await?;
    ensure!(
        still.as_ref().and_then(|w| w.uid()) == Some(held_uid),
        "the held Workspace was deleted under its session"
    );
    // (Its TTL taken away first, so that it cannot lapse before it is looked at.)
    let no_ttl = serde_json::json!({"spec": {"ttlSecondsAfterUnused": null}});
    workspaces
        .patch("held", &PatchParams::default(), &Patch::Merge(&no_ttl))
        .await?;
    machines.release(&held).await?;
    ensure!(snapshots.list(&commits_of("held")).await?.items.len() == 1);
    Ok(())
}

/// A `Dev` machine whose worker is SIGKILLed commits nothing: the Run fails `WorkerLost`
/// and its message says the Workspace keeps its head; the next claim has the last commit's
/// files, not what was written after it.
#[tokio::test]
async fn a_lost_worker_leaves_the_head_at_the_last_commit() -> Result<()> {
    let (server, admin) = Server::start_async(Options::full()).await?;
    create_runtime(&admin, "dev", "bash", 2, 2).await?;
    let machines = Machines::new(connection(&server).await?, "dev");
    let spec = Spec::new("default", Class::Dev, "fragile");
    let first = machines.claim(&spec).await?;
    machines.write(&first, "f", b"committed").await?;
    machines.release(&first).await?;
    let workspace = committed(&admin, "fragile", 1).await?;
    let head = workspace.status.and_then(|s| s.head).context("a head")?;

    let second = machines.claim(&spec).await?;
    machines.write(&second, "f", b"lost").await?;
    let runs: Api<Run> = Api::namespaced(admin.clone(), "default");
    let run = runs.get("fragile").await?;
    let pod = run
        .status
        .as_ref()
        .and_then(|s| s.assigned_pod.clone())
        .context("assigned")?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(common::runtimed_of(&pod)?),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let lost = common::wait_terminal(&admin, "fragile").await?;
    let status = lost.status.clone().unwrap_or_default();
    ensure!(
        lost.phase() == Phase::Failed && status.reason.as_deref() == Some("WorkerLost"),
        "{status:?}"
    );
    let message = status.message.unwrap_or_default();
    ensure!(
        message.contains(&format!(
            "Workspace fragile keeps its head, commit {}",
            head.name
        )),
        "{message}"
    );
    let kept = Api::<Workspace>::namespaced(admin.clone(), "default")
        .get("fragile")
        .await?;
    ensure!(
        kept.status.and_then(|s| s.head) == Some(head),
        "the head moved"
    );
    // The failed Run is deleted by the next claim, which has the committed files.
    let third = machines.claim(&spec).await?;
    ensure!(cat(&machines, &third, "f").await? == "committed");
    machines.release(&third).await?;
    Ok(())
}

/// Only the Workspace's holder moves its head: a session whose Workspace was taken over
/// (here: its holder rewritten, as a later session's registration does) ends without
/// committing, and the head stays.
#[tokio::test]
async fn a_session_that_no_longer_holds_its_workspace_does_not_move_the_head() -> Result<()> {
    let (server, admin) = Server::start_async(Options::full()).await?;
    create_runtime(&admin, "dev", "bash", 1, 2).await?;
    let machines = Machines::new(connection(&server).await?, "dev");
    let spec = Spec::new("default", Class::Dev, "taken");
    let first = machines.claim(&spec).await?;
    machines.write(&first, "f", b"first").await?;
    machines.release(&first).await?;
    let head = committed(&admin, "taken", 1)
        .await?
        .status
        .and_then(|s| s.head)
        .context("a head")?;

    let second = machines.claim(&spec).await?;
    machines.write(&second, "f", b"second").await?;
    let workspaces = Api::<Workspace>::namespaced(admin.clone(), "default");
    let mut workspace = workspaces.get("taken").await?;
    let status = workspace.status.as_mut().context("a status")?;
    let holder = status.holder.as_mut().context("a holder")?;
    ensure!(
        holder.run.name == "taken" && holder.incarnation == 1,
        "{holder:?}"
    );
    holder.run.uid = Some("someone-else".into());
    workspaces
        .replace_status("taken", &Default::default(), &workspace)
        .await?;
    machines.release(&second).await?;
    let after = workspaces.get("taken").await?.status.unwrap_or_default();
    ensure!(
        after.head == Some(head) && after.commits == Some(1),
        "the head moved: {after:?}"
    );
    Ok(())
}

/// A `Dev` machine that is Suspended when it is released has no worker to commit it: the
/// controller-manager makes its suspend Snapshot the Workspace's commit, and the next
/// claim has its files.
#[tokio::test]
async fn a_suspended_dev_machine_that_is_released_commits_its_suspend() -> Result<()> {
    let (server, admin) = Server::start_async(Options::full()).await?;
    create_runtime(&admin, "dev", "bash", 1, 2).await?;
    let machines = Machines::new(connection(&server).await?, "dev");
    let spec = Spec::new("default", Class::Dev, "sleepy");
    let lease = machines.claim(&spec).await?;
    machines.write(&lease, "f", b"suspended").await?;
    let runs: Api<Run> = Api::namespaced(admin.clone(), "default");
    let suspend = serde_json::json!({"spec": {"suspend": true}});
    runs.patch("sleepy", &PatchParams::default(), &Patch::Merge(&suspend))
        .await?;
    wait_run(&runs, "sleepy", "the machine is Suspended", |r| {
        r.phase() == Phase::Suspended
    })
    .await?;
    machines.release(&lease).await?;
    let workspace = committed(&admin, "sleepy", 1).await?;
    let head = workspace.status.and_then(|s| s.head).context("a head")?;
    ensure!(
        head.name.ends_with("-s"),
        "the head is the promoted suspend: {head:?}"
    );
    let next = machines.claim(&spec).await?;
    ensure!(cat(&machines, &next, "f").await? == "suspended");
    machines.release(&next).await?;
    Ok(())
}

/// A Suspended `Dev` machine resumed while no worker is ready (Pending, not placed) and
/// released then: its suspend Snapshot is still committed.
#[tokio::test]
async fn a_resumed_dev_machine_released_before_it_is_placed_commits_its_suspend() -> Result<()> {
    let (server, admin) = Server::start_async(Options::full()).await?;
    create_runtime(&admin, "dev", "bash", 1, 2).await?;
    let machines = Machines::new(connection(&server).await?, "dev");
    let spec = Spec::new("default", Class::Dev, "waking");
    let lease = machines.claim(&spec).await?;
    machines.write(&lease, "f", b"before the wake").await?;
    let runs: Api<Run> = Api::namespaced(admin.clone(), "default");
    let patch = |value: serde_json::Value| Patch::Merge(value);
    runs.patch(
        "waking",
        &PatchParams::default(),
        &patch(serde_json::json!({"spec": {"suspend": true}})),
    )
    .await?;
    wait_run(&runs, "waking", "the machine is Suspended", |r| {
        r.phase() == Phase::Suspended
    })
    .await?;
    // No worker: the resume leaves it Pending, not placed.
    let runtimes = Api::<kruntimes_api::Runtime>::namespaced(admin.clone(), "default");
    runtimes
        .patch(
            "dev",
            &PatchParams::default(),
            &patch(serde_json::json!({"spec": {"replicas": 0}})),
        )
        .await?;
    common::wait_runtime(&admin, "dev", "no worker", |rt| {
        rt.status
            .as_ref()
            .and_then(|s| s.ready_replicas)
            .unwrap_or(0)
            == 0
    })
    .await?;
    runs.patch(
        "waking",
        &PatchParams::default(),
        &patch(serde_json::json!({"spec": {"suspend": false}})),
    )
    .await?;
    wait_run(&runs, "waking", "the machine is Pending", |r| {
        r.phase() == Phase::Pending
    })
    .await?;
    machines.release(&lease).await?;
    let workspace = committed(&admin, "waking", 1).await?;
    let head = workspace.status.and_then(|s| s.head).context("a head")?;
    ensure!(head.name.ends_with("-s"), "the promoted suspend: {head:?}");
    runtimes
        .patch(
            "dev",
            &PatchParams::default(),
            &patch(serde_json::json!({"spec": {"replicas": 1}})),
        )
        .await?;
    common::wait_runtime(&admin, "dev", "a worker", |rt| {
        rt.status.as_ref().and_then(|s| s.ready_replicas) == Some(1)
    })
    .await?;
    let next = machines.claim(&spec).await?;
    ensure!(cat(&machines, &next, "f").await? == "before the wake");
    machines.release(&next).await?;
    Ok(())
}

#[tokio::test]
async fn a_commit_that_fails_says_so_on_the_run_and_goes_through_once_the_store_is_back()
-> Result<()> {
    use kruntimes_api::workspace::{COMMIT_RETRYING_REASON, COMMITTED_CONDITION, COMMITTED_REASON};
    let mut s3 = kruntimes_testkit::s3::S3Server::start()?;
    let (server, admin) = Server::start_async(Options {
        env: s3.env(),
        ..Options::full()
    })
    .await?;
    common::create_s3_runtime(&admin, "s3", 2, &s3, "kr").await?;
    let machines = Machines::new(connection(&server).await?, "s3");
    let runs: Api<Run> = Api::namespaced(admin.clone(), "default");
    let project = Spec::new("default", Class::Dev, "gamma");
    let lease = machines.claim(&project).await?;
    machines
        .write(&lease, "kept.txt", b"through the outage")
        .await?;

    // The store is down when the machine ends: the Run waits, and says why.
    s3.stop();
    let termination = serde_json::json!({"spec": {"termination": Termination {
        mode: TerminationMode::Immediate,
    }}});
    runs.patch(
        "gamma",
        &PatchParams::default(),
        &Patch::Merge(&termination),
    )
    .await?;
    let retrying = |r: &Run| {
        r.status.as_ref().is_some_and(|s| {
            s.conditions.iter().any(|c| {
                c.type_ == COMMITTED_CONDITION
                    && c.status == "False"
                    && c.reason.as_deref() == Some(COMMIT_RETRYING_REASON)
                    && c.message.as_deref().is_some_and(|m| !m.is_empty())
            })
        })
    };
    wait_run(&runs, "gamma", "the commit says it retries", retrying).await?;
    let waiting = runs.get("gamma").await?;
    ensure!(
        !waiting.phase().is_terminal(),
        "the Run waits for its commit: {:?}",
        waiting.status
    );
    let workspaces: Api<Workspace> = Api::namespaced(admin.clone(), "default");
    let before = workspaces.get("gamma").await?;
    ensure!(
        before
            .status
            .as_ref()
            .and_then(|s| s.head.as_ref())
            .is_none(),
        "no head while the commit fails: {:?}",
        before.status
    );

    // Back: the commit is made, the condition says which, and the Run ends.
    s3.restart()?;
    wait_run(&runs, "gamma", "the Run ends committed", |r| {
        r.phase().is_terminal()
    })
    .await?;
    let ended = runs.get("gamma").await?;
    let workspace = committed(&admin, "gamma", 1).await?;
    let head = workspace
        .status
        .as_ref()
        .and_then(|s| s.head.clone())
        .context("a head")?;
    let condition = ended
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == COMMITTED_CONDITION))
        .context("the WorkspaceCommitted condition")?;
    ensure!(
        condition.status == "True"
            && condition.reason.as_deref() == Some(COMMITTED_REASON)
            && condition
                .message
                .as_deref()
                .is_some_and(|m| m.contains(&head.name)),
        "{condition:?} (head {})",
        head.name
    );

    // The next machine of the project has the file.
    runs.delete("gamma", &Default::default()).await?;
    gone(&runs, "gamma", &ended.uid().unwrap_or_default()).await?;
    let next = machines.claim(&project).await?;
    ensure!(cat(&machines, &next, "kept.txt").await? == "through the outage");
    machines.release(&next).await?;
    Ok(())
}
