//! API machinery: the Kubernetes semantics kruntimes depends on (ARCHITECTURE.md, "One
//! control-plane contract"), checked end to end against a real `kruntimes up` with kube-rs over
//! HTTPS.
//!
//! Each test starts its own server through the testkit, so no test sees another's objects.
//! Nothing waits on a clock: every wait is for a watch event or an answer, bounded by a
//! deadline so that a missing event fails the test instead of hanging it.

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail, ensure};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Namespace;
use kruntimes_api::run::{FunctionMode, RunMode, Termination, TerminationMode};
use kruntimes_api::{Phase, Run, RunSpec, RunStatus};
use kruntimes_testkit::status::{ensure_status, expect_status};
use kruntimes_testkit::{Options, Server};
use kube::api::{
    Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions,
    VersionMatch, WatchEvent, WatchParams,
};
use kube::core::Status;
use kube::runtime::controller::Action;
use kube::runtime::{finalizer, reflector, watcher};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

const NS: &str = "default";
/// The longest one test may take, server start excluded.
const TEST_DEADLINE: Duration = Duration::from_secs(240);
/// The longest the tests wait for one watch event that must come.
const EVENT_DEADLINE: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------
// Support
// ---------------------------------------------------------------------------------------

/// Starts `kruntimes up` (blocking, so off the async workers) and returns it with a client.
async fn start_server(extra_args: &[&str]) -> Result<(Server, Client)> {
    Server::start_async(Options {
        extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
        ..Options::default()
    })
    .await
}

/// Runs a test body under [`TEST_DEADLINE`].
async fn within<T>(what: &str, body: impl Future<Output = Result<T>>) -> Result<T> {
    kruntimes_testkit::within(TEST_DEADLINE, what, body).await
}

fn task_spec(runtime: &str) -> RunSpec {
    RunSpec::task(runtime, "main.sh")
}

fn task_run(name: &str, runtime: &str) -> Run {
    Run::new(name, task_spec(runtime))
}

fn labelled_run(name: &str, runtime: &str, labels: &[(&str, &str)]) -> Run {
    let mut run = task_run(name, runtime);
    run.metadata.labels = Some(
        labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    );
    run
}

fn rv_of(obj: &Run) -> Result<String> {
    obj.resource_version()
        .with_context(|| format!("{} has no metadata.resourceVersion", obj.name_any()))
}

/// Builds a JSON patch from its JSON form. The element type is inferred from
/// `Patch::Json`, so the test does not name kube's json-patch version.
fn json_patch(ops: Value) -> Result<Patch<Value>> {
    Ok(Patch::Json(
        serde_json::from_value(ops).context("a valid JSON patch")?,
    ))
}

type RunWatch = BoxStream<'static, kube::Result<WatchEvent<Run>>>;

async fn open_watch(api: &Api<Run>, params: &WatchParams, rv: &str) -> Result<RunWatch> {
    Ok(api
        .watch(params, rv)
        .await
        .with_context(|| format!("start a watch from resourceVersion {rv}"))?
        .boxed())
}

/// One change as a watch reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Change {
    kind: &'static str,
    name: String,
    rv: String,
}

/// The next ADDED, MODIFIED or DELETED event, skipping bookmarks. An ERROR event fails.
async fn next_change(watch: &mut RunWatch) -> Result<(Change, Run)> {
    loop {
        let event = tokio::time::timeout(EVENT_DEADLINE, watch.next())
            .await
            .map_err(|_| anyhow!("no watch event within {EVENT_DEADLINE:?}"))?
            .context("the watch stream ended while an event was expected")?
            .context("the watch stream failed")?;
        let (kind, obj) = match event {
            WatchEvent::Added(obj) => ("ADDED", obj),
            WatchEvent::Modified(obj) => ("MODIFIED", obj),
            WatchEvent::Deleted(obj) => ("DELETED", obj),
            WatchEvent::Bookmark(_) => continue,
            WatchEvent::Error(status) => bail!("the watch delivered an ERROR event: {status:?}"),
        };
        let change = Change {
            kind,
            name: obj.name_any(),
            rv: obj.resource_version().unwrap_or_default(),
        };
        return Ok((change, obj));
    }
}

/// Every change up to and including the ADDED event of `sentinel`.
async fn changes_until_added(watch: &mut RunWatch, sentinel: &str) -> Result<Vec<Change>> {
    let mut seen = Vec::new();
    loop {
        let (change, _) = next_change(watch)
            .await
            .with_context(|| format!("waiting for ADDED {sentinel}; saw so far: {seen:?}"))?;
        let done = change.kind == "ADDED" && change.name == sentinel;
        seen.push(change);
        if done {
            return Ok(seen);
        }
        ensure!(
            seen.len() <= 1000,
            "runaway watch: more than 1000 events before {sentinel}"
        );
    }
}

fn kinds_and_names(changes: &[Change]) -> Vec<(&'static str, String)> {
    changes.iter().map(|c| (c.kind, c.name.clone())).collect()
}

fn names_of(runs: &[Run]) -> BTreeSet<String> {
    runs.iter().map(ResourceExt::name_any).collect()
}

/// Creates `count` runs named by `name(i)`, 16 at a time.
async fn create_many(api: &Api<Run>, names: Vec<String>) -> Result<Vec<Run>> {
    futures::stream::iter(names)
        .map(|name| {
            let api = api.clone();
            async move {
                api.create(&PostParams::default(), &task_run(&name, "rt"))
                    .await
                    .with_context(|| format!("create {name}"))
            }
        })
        .buffer_unordered(16)
        .try_collect()
        .await
}

// ---------------------------------------------------------------------------------------
// Optimistic concurrency
// ---------------------------------------------------------------------------------------

/// A write that carries an old resourceVersion is refused with 409 Conflict and changes
/// nothing, whatever the verb: PUT, PUT /status, merge PATCH, DELETE with a precondition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_resource_version_is_a_conflict() -> Result<()> {
    let (_server, client) = start_server(&[]).await?;
    within("stale update", async {
        let api: Api<Run> = Api::namespaced(client, NS);
        let pp = PostParams::default();
        let v1 = api.create(&pp, &task_run("stale", "rt")).await?;
        let v1_rv = rv_of(&v1)?;

        let mut next = v1.clone();
        next.labels_mut().insert("step".into(), "2".into());
        let v2 = api.replace("stale", &pp, &next).await?;
        let v2_rv = rv_of(&v2)?;
        ensure!(v2_rv != v1_rv, "an update must change resourceVersion");

        let mut stale = v1.clone();
        stale.labels_mut().insert("step".into(), "stale".into());
        let status = expect_status(
            "PUT with the old resourceVersion",
            api.replace("stale", &pp, &stale).await,
        )?;
        ensure_status("PUT with the old resourceVersion", &status, 409, "Conflict")?;
        ensure!(
            status.message.contains("the object has been modified"),
            "409 message should say the object has been modified, got {:?}",
            status.message
        );

        let mut stale_status = v1.clone();
        stale_status.status = Some(RunStatus {
            phase: Some(Phase::Running),
            ..RunStatus::default()
        });
        let status = expect_status(
            "PUT /status with the old resourceVersion",
            api.replace_status("stale", &pp, &stale_status).await,
        )?;
        ensure_status(
            "PUT /status with the old resourceVersion",
            &status,
            409,
            "Conflict",
        )?;

        let status = expect_status(
            "merge PATCH carrying the old resourceVersion",
            api.patch(
                "stale",
                &PatchParams::default(),
                &Patch::Merge(json!({
                    "metadata": {"resourceVersion": v1_rv, "labels": {"step": "patched"}}
                })),
            )
            .await,
        )?;
        ensure_status(
            "merge PATCH carrying the old resourceVersion",
            &status,
            409,
            "Conflict",
        )?;

        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                resource_version: Some(v1_rv.clone()),
                uid: None,
            }),
            ..DeleteParams::default()
        };
        let status = expect_status(
            "DELETE with a stale resourceVersion precondition",
            api.delete("stale", &dp).await.map(|_| ()),
        )?;
        ensure_status(
            "DELETE with a stale resourceVersion precondition",
            &status,
            409,
            "Conflict",
        )?;

        let now = api.get("stale").await?;
        ensure!(
            rv_of(&now)? == v2_rv,
            "refused writes must not change the object: resourceVersion {} != {v2_rv}",
            rv_of(&now)?
        );
        ensure!(
            now.labels().get("step").map(String::as_str) == Some("2"),
            "refused writes must not change labels: {:?}",
            now.labels()
        );
        ensure!(
            now.status.as_ref().and_then(|s| s.phase).is_none(),
            "the refused status write must not land: {:?}",
            now.status
        );

        // With the current resourceVersion the same write succeeds.
        let mut current = now.clone();
        current.labels_mut().insert("step".into(), "3".into());
        let v3 = api.replace("stale", &pp, &current).await?;
        ensure!(v3.labels().get("step").map(String::as_str) == Some("3"));
        Ok(())
    })
    .await
}

// ---------------------------------------------------------------------------------------
// Watch resume
// ---------------------------------------------------------------------------------------

/// A watch from resourceVersion N delivers every change after N exactly once, in commit
/// order, whether it replays history (opened after the changes) or follows live (opened
/// before them); a watch from a later RV M gets exactly the changes after M.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_from_resource_version_delivers_exactly_the_later_changes() -> Result<()> {
    let (_server, client) = start_server(&[]).await?;
    within("watch resume", async {
        let api: Api<Run> = Api::namespaced(client, NS);
        let pp = PostParams::default();
        let wp = WatchParams::default();
        for name in ["a0", "a1", "a2"] {
            api.create(&pp, &task_run(name, "rt")).await?;
        }
        let n = api
            .list(&ListParams::default())
            .await?
            .metadata
            .resource_version
            .context("a list carries metadata.resourceVersion")?;

        // Opened before the changes: it follows them live.
        let mut live = open_watch(&api, &wp, &n).await?;

        // A known sequence; record the resourceVersion each write answered with.
        let mut expected: Vec<(&'static str, String, Option<String>)> = Vec::new();
        let b0 = api.create(&pp, &task_run("b0", "rt")).await?;
        expected.push(("ADDED", "b0".into(), Some(rv_of(&b0)?)));
        let a0 = api
            .patch(
                "a0",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
            )
            .await?;
        expected.push(("MODIFIED", "a0".into(), Some(rv_of(&a0)?)));
        api.delete("a1", &DeleteParams::default()).await?;
        expected.push(("DELETED", "a1".into(), None));
        let b0 = api
            .patch_status(
                "b0",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Running"}})),
            )
            .await?;
        let m = rv_of(&b0)?;
        expected.push(("MODIFIED", "b0".into(), Some(m.clone())));
        let b1 = api.create(&pp, &task_run("b1", "rt")).await?;
        expected.push(("ADDED", "b1".into(), Some(rv_of(&b1)?)));
        let mut a2 = api.get("a2").await?;
        a2.spec.ttl_seconds_after_finished = Some(60);
        let a2 = api.replace("a2", &pp, &a2).await?;
        expected.push(("MODIFIED", "a2".into(), Some(rv_of(&a2)?)));
        api.delete("b0", &DeleteParams::default()).await?;
        expected.push(("DELETED", "b0".into(), None));
        let a1 = api.create(&pp, &task_run("a1", "rt")).await?;
        expected.push(("ADDED", "a1".into(), Some(rv_of(&a1)?)));
        // The sentinel ends each collection; nothing after it is read.
        let end = api.create(&pp, &task_run("zz-end", "rt")).await?;
        expected.push(("ADDED", "zz-end".into(), Some(rv_of(&end)?)));

        let want: Vec<(&'static str, String)> = expected
            .iter()
            .map(|(kind, name, _)| (*kind, name.clone()))
            .collect();

        let check = |label: &str, got: &[Change], want: &[(&'static str, String)]| -> Result<()> {
            ensure!(
                kinds_and_names(got) == want,
                "{label}: the watch from {n} delivered\n  {:?}\nwanted exactly\n  {want:?}",
                kinds_and_names(got)
            );
            let rvs: BTreeSet<&str> = got.iter().map(|c| c.rv.as_str()).collect();
            ensure!(
                rvs.len() == got.len() && !rvs.contains(""),
                "{label}: every event needs its own resourceVersion: {got:?}"
            );
            ensure!(
                !rvs.contains(n.as_str()),
                "{label}: an event at the starting resourceVersion {n} was replayed: {got:?}"
            );
            Ok(())
        };

        let live_seen = changes_until_added(&mut live, "zz-end").await?;
        check("live watch", &live_seen, &want)?;
        for (change, (_, _, rv)) in live_seen.iter().zip(&expected) {
            if let Some(rv) = rv {
                ensure!(
                    &change.rv == rv,
                    "live watch: {} {} carries resourceVersion {}, but the write answered {rv}",
                    change.kind,
                    change.name,
                    change.rv
                );
            }
        }

        // Opened after the changes: it replays them from history, identically.
        let mut replay = open_watch(&api, &wp, &n).await?;
        let replay_seen = changes_until_added(&mut replay, "zz-end").await?;
        check("replayed watch", &replay_seen, &want)?;
        ensure!(
            replay_seen == live_seen,
            "replay and live watches disagree:\n  replay {replay_seen:?}\n  live   {live_seen:?}"
        );

        // From M (the status write of b0): only what came after it.
        let mut from_m = open_watch(&api, &wp, &m).await?;
        let from_m_seen = changes_until_added(&mut from_m, "zz-end").await?;
        ensure!(
            kinds_and_names(&from_m_seen) == want[4..],
            "the watch from {m} delivered {:?}, wanted {:?}",
            kinds_and_names(&from_m_seen),
            &want[4..]
        );
        ensure!(
            from_m_seen[..] == live_seen[4..],
            "the watch from {m} disagrees with the live watch"
        );
        Ok(())
    })
    .await
}

// ---------------------------------------------------------------------------------------
// Compaction: 410 Gone and relist recovery
// ---------------------------------------------------------------------------------------

/// With `--watch-history 16` and 45 changes, a raw watch from the first resourceVersion
/// gets 200 and an in-stream ERROR with code 410, then the stream ends. kube-runtime's
/// watcher, listed but paused before it opened its watch, resumes from its compacted list
/// RV, gets that 410, relists, and its reflector store then equals a fresh list exactly
/// (same names, same resourceVersions); it goes on delivering later changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compacted_resource_version_is_gone_and_the_watcher_relists() -> Result<()> {
    let (_server, client) = start_server(&["--watch-history", "16"]).await?;
    within("compaction", async {
        let api: Api<Run> = Api::namespaced(client, NS);
        let pp = PostParams::default();
        let first = api.create(&pp, &task_run("i0", "rt")).await?;
        let first_rv = rv_of(&first)?;
        for i in 1..5 {
            api.create(&pp, &task_run(&format!("i{i}"), "rt")).await?;
        }

        // The informer lists (InitDone), then the test stops polling it. Its next poll
        // would open the watch at the list's resourceVersion.
        let (store, writer) = reflector::store::<Run>();
        let mut informer = reflector(writer, watcher(api.clone(), watcher::Config::default())).boxed();
        loop {
            let event = tokio::time::timeout(EVENT_DEADLINE, informer.next())
                .await
                .map_err(|_| anyhow!("the watcher did not finish its initial list"))?
                .context("the watcher stream ended")?;
            match event {
                Ok(watcher::Event::InitDone) => break,
                Ok(_) => {}
                Err(err) => bail!("the watcher failed during its initial list: {err}"),
            }
        }
        let listed = names_of(&store.state().iter().map(|r| (**r).clone()).collect::<Vec<_>>());
        ensure!(
            listed == (0..5).map(|i| format!("i{i}")).collect::<BTreeSet<_>>(),
            "the initial list held {listed:?}"
        );

        // 45 changes while the informer is paused: 20 creates, 20 updates, 5 deletes.
        for i in 0..20 {
            api.create(&pp, &task_run(&format!("n{i:02}"), "rt")).await?;
        }
        for i in 0..20 {
            let name = if i < 5 { format!("i{i}") } else { format!("n{i:02}") };
            api.patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"round": "2"}}})),
            )
            .await?;
        }
        for name in ["i0", "i1", "n00", "n01", "n02"] {
            api.delete(name, &DeleteParams::default()).await?;
        }

        // A raw watch from the first resourceVersion: 200, then ERROR 410, then the end.
        let mut raw = match api.watch(&WatchParams::default(), &first_rv).await {
            Ok(stream) => stream.boxed(),
            Err(kube::Error::Api(status)) => bail!(
                "watch from compacted RV {first_rv}: the server answered HTTP {} {} ({}); \
                 the contract is 200 with an in-stream ERROR event of code 410",
                status.code,
                status.reason,
                status.message
            ),
            Err(err) => bail!("watch from compacted RV {first_rv}: {err:#}"),
        };
        let event = tokio::time::timeout(EVENT_DEADLINE, raw.next())
            .await
            .map_err(|_| anyhow!("no event on the watch from compacted RV {first_rv}"))?
            .context("the watch from a compacted RV ended without an ERROR event")??;
        match event {
            WatchEvent::Error(status) => {
                ensure!(
                    status.code == 410 && (status.reason == "Expired" || status.reason == "Gone"),
                    "watch from compacted RV {first_rv}: expected ERROR 410 Expired/Gone, got {status:?}"
                );
            }
            other => bail!(
                "watch from compacted RV {first_rv}: expected ERROR 410 first, got {other:?} \
                 (the server replayed changes it should have compacted)"
            ),
        }
        let after = tokio::time::timeout(EVENT_DEADLINE, raw.next())
            .await
            .map_err(|_| anyhow!("the stream stayed open after ERROR 410"))?;
        ensure!(
            after.is_none(),
            "the watch must end after ERROR 410, but it went on with {after:?}"
        );

        // Resume the informer: ERROR 410 on its watch, then a relist (Init … InitDone).
        let mut saw_gone = false;
        let mut other_errors = Vec::new();
        loop {
            let event = tokio::time::timeout(EVENT_DEADLINE, informer.next())
                .await
                .map_err(|_| anyhow!("the watcher did not recover (410 seen: {saw_gone}; errors: {other_errors:?})"))?
                .context("the watcher stream ended")?;
            match event {
                Err(watcher::Error::WatchError(status)) if status.code == 410 => saw_gone = true,
                Err(watcher::Error::WatchStartFailed(kube::Error::Api(status)))
                    if status.code == 410 =>
                {
                    bail!(
                        "the watcher's watch from its compacted list RV was refused with HTTP 410; \
                         kube-runtime then retries the same RV forever. Send 200 + ERROR 410."
                    )
                }
                Err(err) => {
                    other_errors.push(err.to_string());
                    ensure!(
                        other_errors.len() < 5,
                        "the watcher keeps failing: {other_errors:?}"
                    );
                }
                Ok(watcher::Event::Apply(obj) | watcher::Event::Delete(obj)) if !saw_gone => bail!(
                    "the watcher got change {} {:?} from a watch at a compacted RV; \
                     the server must answer 410 instead of replaying",
                    obj.name_any(),
                    obj.resource_version()
                ),
                Ok(watcher::Event::InitDone) if saw_gone => break,
                Ok(_) => {}
            }
        }
        ensure!(other_errors.is_empty(), "unexpected watcher errors: {other_errors:?}");

        let fresh = api.list(&ListParams::default()).await?;
        let want: BTreeMap<String, String> = fresh
            .items
            .iter()
            .map(|r| Ok((r.name_any(), rv_of(r)?)))
            .collect::<Result<_>>()?;
        let have: BTreeMap<String, String> = store
            .state()
            .iter()
            .map(|r| Ok((r.name_any(), rv_of(r)?)))
            .collect::<Result<_>>()?;
        ensure!(
            have == want,
            "after the relist the reflector store differs from a fresh list:\n  store {have:?}\n  list  {want:?}"
        );
        let mut expected_names: BTreeSet<String> = (2..5).map(|i| format!("i{i}")).collect();
        expected_names.extend((3..20).map(|i| format!("n{i:02}")));
        ensure!(
            want.keys().cloned().collect::<BTreeSet<_>>() == expected_names,
            "the list itself is wrong: {:?}",
            want.keys()
        );

        // It keeps delivering after recovery.
        api.create(&pp, &task_run("after-relist", "rt")).await?;
        loop {
            let event = tokio::time::timeout(EVENT_DEADLINE, informer.next())
                .await
                .map_err(|_| anyhow!("the recovered watcher did not deliver a new object"))?
                .context("the watcher stream ended")?;
            match event {
                Ok(watcher::Event::Apply(obj)) if obj.name_any() == "after-relist" => break,
                Ok(_) => {}
                Err(err) => bail!("the recovered watcher failed: {err}"),
            }
        }
        ensure!(
            store.state().iter().any(|r| r.name_any() == "after-relist"),
            "the store misses the object created after recovery"
        );
        Ok(())
    })
    .await
}

// ---------------------------------------------------------------------------------------
// Finalizers
// ---------------------------------------------------------------------------------------

const FINALIZER: &str = "e2e.kruntimes.io/cleanup";

/// One pass of kube-runtime's finalizer helper over `obj`, recording which branch ran.
async fn reconcile(api: &Api<Run>, obj: Run, log: &Mutex<Vec<String>>) -> Result<()> {
    let name = obj.name_any();
    finalizer(api, FINALIZER, Arc::new(obj), |event| async move {
        let entry = match event {
            finalizer::Event::Apply(o) => format!("apply {}", o.name_any()),
            finalizer::Event::Cleanup(o) => format!("cleanup {}", o.name_any()),
        };
        if let Ok(mut log) = log.lock() {
            log.push(entry);
        }
        Ok::<_, Infallible>(Action::await_change())
    })
    .await
    .with_context(|| format!("finalizer helper on {name}"))?;
    Ok(())
}

/// A finalizer holds a deletion: DELETE marks the object (deletionTimestamp, MODIFIED) and
/// it stays readable until kube-runtime's helper removes its finalizer with a test-guarded
/// JSON patch; then the server deletes it (DELETED, 404). A JSON patch whose `test` fails
/// is 422 and removes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finalizer_holds_deletion_until_removed() -> Result<()> {
    let (_server, client) = start_server(&[]).await?;
    within("finalizers", async {
        let api: Api<Run> = Api::namespaced(client, NS);
        let pp = PostParams::default();
        let log = Mutex::new(Vec::new());

        // "solo": no finalizers at first, so the helper adds with test-null + add.
        let solo = api.create(&pp, &task_run("solo", "rt")).await?;
        reconcile(&api, solo, &log).await?;
        let solo = api.get("solo").await?;
        ensure!(
            solo.finalizers() == [FINALIZER.to_string()],
            "the helper's add patch must set the finalizer: {:?}",
            solo.finalizers()
        );
        reconcile(&api, solo.clone(), &log).await?;

        let mut watch = open_watch(&api, &WatchParams::default(), &rv_of(&solo)?).await?;
        let deleted = api.delete("solo", &DeleteParams::default()).await?;
        let marked = deleted.left().context(
            "DELETE of an object with finalizers must answer 200 with the object, not a Status",
        )?;
        ensure!(
            marked.metadata.deletion_timestamp.is_some(),
            "the DELETE answer must carry deletionTimestamp"
        );
        let (change, obj) = next_change(&mut watch).await?;
        ensure!(
            change.kind == "MODIFIED"
                && change.name == "solo"
                && obj.metadata.deletion_timestamp.is_some(),
            "DELETE with a finalizer must emit MODIFIED with deletionTimestamp, got {change:?}"
        );
        let held = api
            .get_opt("solo")
            .await?
            .context("the object must survive DELETE while a finalizer holds it")?;
        ensure!(held.metadata.deletion_timestamp.is_some());
        ensure!(held.finalizers() == [FINALIZER.to_string()]);

        let again = api.delete("solo", &DeleteParams::default()).await?;
        let again = again
            .left()
            .context("a repeated DELETE must answer with the object")?;
        ensure!(
            again.resource_version() == held.resource_version(),
            "a repeated DELETE must leave the object unchanged"
        );

        reconcile(&api, held, &log).await?;
        let (change, _) = next_change(&mut watch).await?;
        ensure!(
            change.kind == "DELETED" && change.name == "solo",
            "removing the last finalizer must delete the object, got {change:?}"
        );
        ensure!(
            api.get_opt("solo").await?.is_none(),
            "the object must be gone after its last finalizer was removed"
        );

        // "shared": someone else's finalizer first; the helper appends with test-list + add.
        let mut shared = task_run("shared", "rt");
        shared.metadata.finalizers = Some(vec!["example.com/other".into()]);
        let shared = api.create(&pp, &shared).await?;
        reconcile(&api, shared, &log).await?;
        let shared = api.get("shared").await?;
        ensure!(
            shared.finalizers() == ["example.com/other".to_string(), FINALIZER.to_string()],
            "the helper must append its finalizer: {:?}",
            shared.finalizers()
        );
        let mut watch = open_watch(&api, &WatchParams::default(), &rv_of(&shared)?).await?;
        api.delete("shared", &DeleteParams::default()).await?;
        let (change, marked) = next_change(&mut watch).await?;
        ensure!(change.kind == "MODIFIED" && marked.metadata.deletion_timestamp.is_some());
        reconcile(&api, marked, &log).await?;
        let (change, obj) = next_change(&mut watch).await?;
        ensure!(
            change.kind == "MODIFIED" && obj.finalizers() == ["example.com/other".to_string()],
            "removing one of two finalizers must keep the object, got {change:?} {:?}",
            obj.finalizers()
        );

        // A failed `test` refuses the whole patch with 422.
        let status = expect_status(
            "JSON patch whose test fails",
            api.patch(
                "shared",
                &PatchParams::default(),
                &json_patch(json!([
                    {"op": "test", "path": "/metadata/finalizers/0", "value": "not-this-one"},
                    {"op": "remove", "path": "/metadata/finalizers/0"}
                ]))?,
            )
            .await,
        )?;
        ensure_status("JSON patch whose test fails", &status, 422, "Invalid")?;
        ensure!(
            api.get("shared").await?.finalizers() == ["example.com/other".to_string()],
            "a refused JSON patch must not remove the finalizer"
        );

        api.patch(
            "shared",
            &PatchParams::default(),
            &json_patch(json!([
                {"op": "test", "path": "/metadata/finalizers/0", "value": "example.com/other"},
                {"op": "remove", "path": "/metadata/finalizers/0"}
            ]))?,
        )
        .await?;
        let (change, _) = next_change(&mut watch).await?;
        ensure!(
            change.kind == "DELETED" && change.name == "shared",
            "removing the last finalizer must emit DELETED, got {change:?}"
        );
        ensure!(api.get_opt("shared").await?.is_none());

        let log = log.lock().map_err(|_| anyhow!("log poisoned"))?.clone();
        ensure!(
            log == ["apply solo", "cleanup solo", "cleanup shared"],
            "the helper ran {log:?}"
        );
        Ok(())
    })
    .await
}

// ---------------------------------------------------------------------------------------
// generateName
// ---------------------------------------------------------------------------------------

/// 100 concurrent creates with `generateName` all succeed with distinct names of the form
/// prefix + 5 characters, and all 100 objects exist afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_generate_name_creates_get_unique_names() -> Result<()> {
    let (_server, client) = start_server(&[]).await?;
    within("generateName", async {
        let api: Api<Run> = Api::namespaced(client, NS);
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..100 {
            let api = api.clone();
            tasks.spawn(async move {
                let run = Run {
                    metadata: ObjectMeta {
                        generate_name: Some("gen-".into()),
                        ..ObjectMeta::default()
                    },
                    spec: task_spec("rt"),
                    status: None,
                };
                api.create(&PostParams::default(), &run).await
            });
        }
        let mut names = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            let created = joined
                .context("join a create task")?
                .context("generateName create")?;
            names.push(created.name_any());
        }
        let unique: BTreeSet<String> = names.iter().cloned().collect();
        ensure!(
            unique.len() == 100,
            "100 creates gave {} distinct names: {names:?}",
            unique.len()
        );
        const ALPHABET: &str = "bcdfghjklmnpqrstvwxz2456789";
        for name in &unique {
            let suffix = name
                .strip_prefix("gen-")
                .with_context(|| format!("{name} does not start with the prefix"))?;
            ensure!(
                suffix.len() == 5 && suffix.chars().all(|c| ALPHABET.contains(c)),
                "{name}: the suffix must be 5 characters of {ALPHABET}"
            );
        }
        let listed = names_of(&api.list(&ListParams::default()).await?.items);
        ensure!(
            listed == unique,
            "the list differs from the created names: missing {:?}, extra {:?}",
            unique.difference(&listed).collect::<Vec<_>>(),
            listed.difference(&unique).collect::<Vec<_>>()
        );
        Ok(())
    })
    .await
}

// ---------------------------------------------------------------------------------------
// Status subresource and generation
// ---------------------------------------------------------------------------------------

fn phase_of(run: &Run) -> Option<Phase> {
    run.status.as_ref().and_then(|s| s.phase)
}

/// Create drops status and sets generation 1. Writes to /status change only status (spec
/// and labels in the body are ignored) and never bump generation. Writes to the main
/// resource ignore status; a spec change bumps generation, a metadata-only change or a spec
/// write that changes nothing does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_spec_are_written_separately() -> Result<()> {
    let (_server, client) = start_server(&[]).await?;
    within("status subresource", async {
        let api: Api<Run> = Api::namespaced(client, NS);
        let pp = PostParams::default();
        let patch = PatchParams::default();

        let mut body = task_run("gen", "rt");
        body.status = Some(RunStatus {
            phase: Some(Phase::Succeeded),
            exit_code: Some(3),
            ..RunStatus::default()
        });
        let created = api.create(&pp, &body).await?;
        ensure!(
            created.metadata.generation == Some(1),
            "a new object has generation 1, got {:?}",
            created.metadata.generation
        );
        ensure!(
            created.status.clone().unwrap_or_default() == RunStatus::default(),
            "create must drop status, got {:?}",
            created.status
        );
        let stored = api.get("gen").await?;
        ensure!(
            stored.status.clone().unwrap_or_default() == RunStatus::default(),
            "create must not store status, got {:?}",
            stored.status
        );
        let spec0 = created.spec.clone();

        // PATCH /status: status lands; spec and labels in the body are ignored.
        let s1 = api
            .patch_status(
                "gen",
                &patch,
                &Patch::Merge(json!({
                    "metadata": {"labels": {"via": "status"}},
                    "spec": {"ttlSecondsAfterFinished": 99},
                    "status": {"phase": "Running", "assignedPod": "pod-1"}
                })),
            )
            .await?;
        ensure!(
            phase_of(&s1) == Some(Phase::Running),
            "status.phase: {:?}",
            s1.status
        );
        ensure!(
            s1.status.as_ref().and_then(|s| s.assigned_pod.as_deref()) == Some("pod-1"),
            "status.assignedPod: {:?}",
            s1.status
        );
        ensure!(
            s1.spec == spec0,
            "a status patch must not change spec: {:?}",
            s1.spec
        );
        ensure!(
            !s1.labels().contains_key("via"),
            "a status patch must not change labels: {:?}",
            s1.labels()
        );
        ensure!(
            s1.metadata.generation == Some(1),
            "a status write must not bump generation: {:?}",
            s1.metadata.generation
        );
        ensure!(s1.resource_version() != created.resource_version());

        // PUT /status: the whole status is replaced; spec in the body is ignored.
        let mut put_body = s1.clone();
        put_body.spec.ttl_seconds_after_finished = Some(77);
        put_body.status = Some(RunStatus {
            phase: Some(Phase::Running),
            attempt: Some(2),
            ..RunStatus::default()
        });
        let s2 = api.replace_status("gen", &pp, &put_body).await?;
        ensure!(
            s2.spec == spec0,
            "PUT /status must not change spec: {:?}",
            s2.spec
        );
        ensure!(
            s2.status == put_body.status,
            "PUT /status replaces status: got {:?}, sent {:?}",
            s2.status,
            put_body.status
        );
        ensure!(s2.metadata.generation == Some(1));
        ensure!(api.get_status("gen").await?.status == put_body.status);

        // PATCH on the main resource: spec lands and bumps generation; status is ignored.
        let g2 = api
            .patch(
                "gen",
                &patch,
                &Patch::Merge(json!({
                    "spec": {"ttlSecondsAfterFinished": 30},
                    "status": {"phase": "Failed"}
                })),
            )
            .await?;
        ensure!(
            g2.spec.ttl_seconds_after_finished == Some(30),
            "spec: {:?}",
            g2.spec
        );
        ensure!(
            g2.metadata.generation == Some(2),
            "a spec change bumps generation to 2, got {:?}",
            g2.metadata.generation
        );
        ensure!(
            g2.status == put_body.status,
            "a main-resource patch must ignore status: {:?}",
            g2.status
        );

        // PUT on the main resource: the same.
        let mut put_main = g2.clone();
        put_main.spec.termination = Some(Termination {
            mode: TerminationMode::Immediate,
        });
        put_main.status = Some(RunStatus {
            phase: Some(Phase::Cancelled),
            ..RunStatus::default()
        });
        let g3 = api.replace("gen", &pp, &put_main).await?;
        ensure!(
            g3.spec.termination == put_main.spec.termination,
            "spec.termination: {:?}",
            g3.spec.termination
        );
        ensure!(
            g3.metadata.generation == Some(3),
            "a spec change by PUT bumps generation to 3, got {:?}",
            g3.metadata.generation
        );
        ensure!(
            g3.status == put_body.status,
            "a main-resource PUT must ignore status: {:?}",
            g3.status
        );

        // Metadata-only changes keep generation.
        let l = api
            .patch(
                "gen",
                &patch,
                &Patch::Merge(json!({
                    "metadata": {"labels": {"team": "a"}, "annotations": {"note": "x"}}
                })),
            )
            .await?;
        ensure!(l.labels().get("team").map(String::as_str) == Some("a"));
        ensure!(l.resource_version() != g3.resource_version());
        ensure!(
            l.metadata.generation == Some(3),
            "a label/annotation change must not bump generation, got {:?}",
            l.metadata.generation
        );

        // A spec write that changes nothing keeps generation.
        let same = api
            .patch(
                "gen",
                &patch,
                &Patch::Merge(json!({"spec": {"ttlSecondsAfterFinished": 30}})),
            )
            .await?;
        ensure!(
            same.metadata.generation == Some(3),
            "a spec write that changes nothing must not bump generation, got {:?}",
            same.metadata.generation
        );

        let last = api.get("gen").await?;
        ensure!(last.metadata.generation == Some(3));
        ensure!(last.status == put_body.status);
        Ok(())
    })
    .await
}

// ---------------------------------------------------------------------------------------
// Selectors
// ---------------------------------------------------------------------------------------

/// Label selectors (`=`, `==`, `!=`, `in`, `notin`, exists, not-exists, combined) and the
/// field selectors Runs support (`metadata.name`, `metadata.namespace`, `spec.runtime`,
/// `status.phase`, `status.assignedPod`), alone and combined; an unknown field is 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn label_and_field_selectors_filter_lists() -> Result<()> {
    let (_server, client) = start_server(&[]).await?;
    within("selectors", async {
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let other = Namespace {
            metadata: ObjectMeta {
                name: Some("other".into()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        namespaces
            .create(&PostParams::default(), &other)
            .await
            .context("create namespace other")?;

        let api: Api<Run> = Api::namespaced(client.clone(), NS);
        let in_other: Api<Run> = Api::namespaced(client.clone(), "other");
        let all: Api<Run> = Api::all(client);
        let pp = PostParams::default();
        api.create(&pp, &labelled_run("s-a", "rt-1", &[("app", "a"), ("tier", "web")])).await?;
        api.create(&pp, &labelled_run("s-b", "rt-2", &[("app", "b"), ("tier", "db")])).await?;
        api.create(&pp, &labelled_run("s-c", "rt-1", &[("app", "c")])).await?;
        api.create(&pp, &labelled_run("s-d", "rt-2", &[])).await?;
        in_other.create(&pp, &labelled_run("o-a", "rt-1", &[("app", "a")])).await?;
        for (name, phase, pod) in [
            ("s-a", "Running", "pod-1"),
            ("s-b", "Succeeded", "pod-2"),
            ("s-d", "Running", "pod-2"),
        ] {
            api.patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": phase, "assignedPod": pod}})),
            )
            .await?;
        }

        let set = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<BTreeSet<_>>();
        let cases: Vec<(&str, &str, BTreeSet<String>)> = vec![
            ("app=a", "", set(&["s-a"])),
            ("app==a", "", set(&["s-a"])),
            ("app!=a", "", set(&["s-b", "s-c", "s-d"])),
            ("app in (a,b)", "", set(&["s-a", "s-b"])),
            ("app notin (a,b)", "", set(&["s-c", "s-d"])),
            ("tier", "", set(&["s-a", "s-b"])),
            ("!tier", "", set(&["s-c", "s-d"])),
            ("app,tier!=web", "", set(&["s-b", "s-c"])),
            ("app in (a,b),!tier", "", set(&[])),
            ("", "metadata.name=s-b", set(&["s-b"])),
            ("", "metadata.name!=s-b", set(&["s-a", "s-c", "s-d"])),
            ("", "metadata.namespace=default", set(&["s-a", "s-b", "s-c", "s-d"])),
            ("", "spec.runtime=rt-1", set(&["s-a", "s-c"])),
            ("", "status.phase=Running", set(&["s-a", "s-d"])),
            ("", "status.phase=Succeeded", set(&["s-b"])),
            ("", "status.assignedPod=pod-2", set(&["s-b", "s-d"])),
            ("", "spec.runtime=rt-2,status.phase=Running", set(&["s-d"])),
            ("app", "spec.runtime=rt-1", set(&["s-a", "s-c"])),
            ("tier in (web,db)", "status.assignedPod=pod-1", set(&["s-a"])),
        ];
        let mut failures = Vec::new();
        for (labels, fields, want) in &cases {
            let mut lp = ListParams::default();
            if !labels.is_empty() {
                lp = lp.labels(labels);
            }
            if !fields.is_empty() {
                lp = lp.fields(fields);
            }
            match api.list(&lp).await {
                Ok(list) => {
                    let got = names_of(&list.items);
                    if &got != want {
                        failures.push(format!(
                            "labelSelector={labels:?} fieldSelector={fields:?}: got {got:?}, want {want:?}"
                        ));
                    }
                }
                Err(err) => failures.push(format!(
                    "labelSelector={labels:?} fieldSelector={fields:?}: {err}"
                )),
            }
        }

        // Across namespaces.
        let pairs = |runs: &[Run]| -> BTreeSet<(String, String)> {
            runs.iter()
                .map(|r| (r.namespace().unwrap_or_default(), r.name_any()))
                .collect()
        };
        let pair = |ns: &str, name: &str| (ns.to_string(), name.to_string());
        type Case<'a> = (&'a str, &'a str, BTreeSet<(String, String)>);
        let all_cases: Vec<Case> = vec![
            ("", "metadata.namespace=other", [pair("other", "o-a")].into()),
            ("app=a", "", [pair("default", "s-a"), pair("other", "o-a")].into()),
            (
                "",
                "metadata.namespace!=other,spec.runtime=rt-1",
                [pair("default", "s-a"), pair("default", "s-c")].into(),
            ),
        ];
        for (labels, fields, want) in &all_cases {
            let mut lp = ListParams::default();
            if !labels.is_empty() {
                lp = lp.labels(labels);
            }
            if !fields.is_empty() {
                lp = lp.fields(fields);
            }
            match all.list(&lp).await {
                Ok(list) => {
                    let got = pairs(&list.items);
                    if &got != want {
                        failures.push(format!(
                            "all namespaces, labelSelector={labels:?} fieldSelector={fields:?}: got {got:?}, want {want:?}"
                        ));
                    }
                }
                Err(err) => failures.push(format!(
                    "all namespaces, labelSelector={labels:?} fieldSelector={fields:?}: {err}"
                )),
            }
        }

        match api.list(&ListParams::default().fields("spec.timeout=1m")).await {
            Err(kube::Error::Api(status)) if status.code == 400 => {}
            other => failures.push(format!(
                "fieldSelector on a field that is not selectable must be 400 BadRequest, got {other:?}"
            )),
        }

        ensure!(failures.is_empty(), "selector failures:\n  {}", failures.join("\n  "));
        Ok(())
    })
    .await
}

// ---------------------------------------------------------------------------------------
// Pagination
// ---------------------------------------------------------------------------------------

/// Paging with limit 50 through 250 Runs while other writers insert, update and delete
/// between and during the page requests returns a consistent snapshot at the first page's
/// resourceVersion: every original exactly once, in name order, each in its state at that
/// resourceVersion, and nothing created later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paginated_list_is_a_snapshot_across_concurrent_writes() -> Result<()> {
    let (_server, client) = start_server(&[]).await?;
    within("pagination", async {
        let api: Api<Run> = Api::namespaced(client, NS);
        let originals: Vec<String> = (0..250).map(|i| format!("p-{i:03}")).collect();
        create_many(&api, originals.clone()).await?;

        // Nothing writes between this full list and the first page, so both see one state.
        let before = api.list(&ListParams::default()).await?;
        let snapshot: BTreeMap<String, String> = before
            .items
            .iter()
            .map(|r| Ok((r.name_any(), rv_of(r)?)))
            .collect::<Result<_>>()?;
        ensure!(
            snapshot.keys().cloned().collect::<Vec<_>>() == originals,
            "the full list before paging is wrong"
        );

        let first = api.list(&ListParams::default().limit(50)).await?;
        let snapshot_rv = first
            .metadata
            .resource_version
            .clone()
            .context("the first page has no resourceVersion")?;
        ensure!(
            Some(&snapshot_rv) == before.metadata.resource_version.as_ref(),
            "with no writes in between, the first page's resourceVersion {snapshot_rv} must equal the full list's {:?}",
            before.metadata.resource_version
        );

        // A writer that runs during the whole paging.
        let stop = Arc::new(AtomicBool::new(false));
        let background_writes = Arc::new(AtomicUsize::new(0));
        let (first_write_tx, first_write_rx) = tokio::sync::oneshot::channel::<()>();
        let background = {
            let api = api.clone();
            let stop = stop.clone();
            let count = background_writes.clone();
            tokio::spawn(async move {
                let mut first_write_tx = Some(first_write_tx);
                let mut n = 0usize;
                while !stop.load(Ordering::SeqCst) {
                    let name = format!("p-{:03}-bg{n}", (n * 37) % 250);
                    api.create(&PostParams::default(), &task_run(&name, "rt"))
                        .await
                        .with_context(|| format!("background create {name}"))?;
                    n += 1;
                    count.store(n, Ordering::SeqCst);
                    if let Some(tx) = first_write_tx.take() {
                        let _ = tx.send(());
                    }
                }
                anyhow::Ok(())
            })
        };
        first_write_rx
            .await
            .context("the background writer stopped before its first write")?;

        let mut pages = vec![first];
        let mut inserted = Vec::new();
        let mut gap = 0usize;
        while let Some(token) = pages
            .last()
            .and_then(|p| p.metadata.continue_.clone())
            .filter(|t| !t.is_empty())
        {
            gap += 1;
            ensure!(gap < 20, "paging does not end");
            // Between pages: insert into pages read and pages to come, update and delete
            // originals in pages to come.
            let ahead = 50 * gap;
            let behind = 50 * (gap - 1);
            let writer = {
                let api = api.clone();
                tokio::spawn(async move {
                    let pp = PostParams::default();
                    let mut names = Vec::new();
                    for i in [ahead + 10, ahead + 11, behind + 10, behind + 49] {
                        if i < 250 {
                            let name = format!("p-{i:03}-ins{gap}");
                            api.create(&pp, &task_run(&name, "rt")).await?;
                            names.push(name);
                        }
                    }
                    if ahead + 30 < 250 {
                        api.patch(
                            &format!("p-{:03}", ahead + 20),
                            &PatchParams::default(),
                            &Patch::Merge(json!({"metadata": {"labels": {"changed": "yes"}}})),
                        )
                        .await?;
                        api.delete(&format!("p-{:03}", ahead + 30), &DeleteParams::default())
                            .await?;
                    }
                    anyhow::Ok(names)
                })
            };
            inserted.extend(writer.await.context("join the between-pages writer")??);
            let page = api
                .list(&ListParams::default().limit(50).continue_token(&token))
                .await
                .with_context(|| format!("page {}", gap + 1))?;
            pages.push(page);
        }
        stop.store(true, Ordering::SeqCst);
        background.await.context("join the background writer")??;
        ensure!(background_writes.load(Ordering::SeqCst) > 0);

        let sizes: Vec<usize> = pages.iter().map(|p| p.items.len()).collect();
        let page_rvs: Vec<Option<String>> =
            pages.iter().map(|p| p.metadata.resource_version.clone()).collect();
        let paged: Vec<(String, String)> = pages
            .iter()
            .flat_map(|p| p.items.iter())
            .map(|r| Ok((r.name_any(), rv_of(r)?)))
            .collect::<Result<_>>()?;
        let paged_names: Vec<&str> = paged.iter().map(|(n, _)| n.as_str()).collect();

        let mut seen = BTreeSet::new();
        let duplicates: Vec<&str> = paged_names.iter().copied().filter(|n| !seen.insert(*n)).collect();
        ensure!(duplicates.is_empty(), "names paged more than once: {duplicates:?}");
        let missing: Vec<&String> = originals.iter().filter(|n| !seen.contains(n.as_str())).collect();
        ensure!(missing.is_empty(), "originals missing from the pages: {missing:?}");
        let extra: Vec<&str> = paged_names
            .iter()
            .copied()
            .filter(|n| !snapshot.contains_key(*n))
            .collect();
        ensure!(
            extra.is_empty(),
            "objects created after the first page appeared in later pages: {extra:?}"
        );
        ensure!(
            paged_names.windows(2).all(|w| w[0] < w[1]),
            "pages must come in byte-wise name order"
        );
        ensure!(sizes == [50; 5], "page sizes {sizes:?}, want five pages of 50");
        let differing: Vec<String> = paged
            .iter()
            .filter(|(n, rv)| snapshot.get(n) != Some(rv))
            .map(|(n, rv)| format!("{n} at {rv}, snapshot {:?}", snapshot.get(n)))
            .collect();
        ensure!(
            differing.is_empty(),
            "objects changed after the first page are not shown as of its resourceVersion: {differing:?}"
        );
        ensure!(
            page_rvs.iter().all(|rv| rv.as_deref() == Some(snapshot_rv.as_str())),
            "every page of one list must report the snapshot's resourceVersion {snapshot_rv}: {page_rvs:?}"
        );

        // The writes did happen: a fresh list shows them.
        let now = names_of(&api.list(&ListParams::default()).await?.items);
        for name in &inserted {
            ensure!(now.contains(name), "inserted {name} is missing from a fresh list");
        }
        ensure!(!now.contains("p-080"), "p-080 was deleted during paging");

        Ok(())
    })
    .await
}

/// A list with `resourceVersionMatch=Exact` at an older resourceVersion that the server
/// still holds (well inside `--watch-history`) returns the collection as it was then, the
/// way the upstream API server serves it from its store's history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_list_at_an_older_resource_version_within_history() -> Result<()> {
    let (_server, client) = start_server(&[]).await?;
    within("exact list", async {
        let api: Api<Run> = Api::namespaced(client, NS);
        create_many(&api, vec!["e-0".into(), "e-1".into(), "e-2".into()]).await?;
        let then = api.list(&ListParams::default()).await?;
        let then_rv = then
            .metadata
            .resource_version
            .clone()
            .context("a list carries metadata.resourceVersion")?;
        let then: BTreeMap<String, String> = then
            .items
            .iter()
            .map(|r| Ok((r.name_any(), rv_of(r)?)))
            .collect::<Result<_>>()?;

        api.patch(
            "e-0",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"changed": "yes"}}})),
        )
        .await?;
        api.delete("e-1", &DeleteParams::default()).await?;
        api.create(&PostParams::default(), &task_run("e-3", "rt"))
            .await?;

        let exact = api
            .list(&ListParams::default().at(&then_rv).matching(VersionMatch::Exact))
            .await
            .with_context(|| {
                format!("list with resourceVersion={then_rv}&resourceVersionMatch=Exact")
            })?;
        ensure!(
            exact.metadata.resource_version.as_deref() == Some(then_rv.as_str()),
            "an Exact list reports the requested resourceVersion {then_rv}, got {:?}",
            exact.metadata.resource_version
        );
        let exact: BTreeMap<String, String> = exact
            .items
            .iter()
            .map(|r| Ok((r.name_any(), rv_of(r)?)))
            .collect::<Result<_>>()?;
        ensure!(
            exact == then,
            "the Exact list at {then_rv} differs from the list taken then:\n  exact {exact:?}\n  then  {then:?}"
        );
        Ok(())
    })
    .await
}

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

/// 404 NotFound and 409 AlreadyExists in the Kubernetes shape; 422 Invalid naming
/// `spec.mode` for a Run with two modes and for a change of an existing Run's mode (by PUT
/// and by merge patch), which leaves the Run unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_carry_kubernetes_status() -> Result<()> {
    let (_server, client) = start_server(&[]).await?;
    within("errors", async {
        let api: Api<Run> = Api::namespaced(client, NS);
        let pp = PostParams::default();

        let status = expect_status("GET a missing Run", api.get("missing").await)?;
        ensure_status("GET a missing Run", &status, 404, "NotFound")?;
        ensure!(
            status
                .message
                .contains(r#"runs.kruntimes.io "missing" not found"#),
            "404 message: {:?}",
            status.message
        );
        ensure!(api.get_opt("missing").await?.is_none());
        let status = expect_status(
            "DELETE a missing Run",
            api.delete("missing", &DeleteParams::default())
                .await
                .map(|_| ()),
        )?;
        ensure_status("DELETE a missing Run", &status, 404, "NotFound")?;

        let original = api.create(&pp, &task_run("one", "rt")).await?;
        let status = expect_status(
            "create a duplicate name",
            api.create(&pp, &task_run("one", "rt")).await,
        )?;
        ensure_status("create a duplicate name", &status, 409, "AlreadyExists")?;

        let causes_name_mode = |status: &Status| {
            status
                .details
                .as_ref()
                .is_some_and(|d| d.causes.iter().any(|c| c.field == "spec.mode"))
        };

        let mut two_modes = task_run("two-modes", "rt");
        two_modes.spec.mode.function = Some(FunctionMode {
            handler: "main.handle".into(),
            idle_timeout_seconds: None,
            concurrency: None,
        });
        let status = expect_status(
            "create a Run with two modes",
            api.create(&pp, &two_modes).await,
        )?;
        ensure_status("create a Run with two modes", &status, 422, "Invalid")?;
        ensure!(
            causes_name_mode(&status),
            "422 must name spec.mode in details.causes: {:?}",
            status.details
        );
        ensure!(
            status
                .message
                .contains(r#"Run.kruntimes.io "two-modes" is invalid"#),
            "422 message: {:?}",
            status.message
        );
        ensure!(
            api.get_opt("two-modes").await?.is_none(),
            "a refused create must store nothing"
        );

        let mut switched = original.clone();
        switched.spec.mode = RunMode {
            function: Some(FunctionMode {
                handler: "main.handle".into(),
                idle_timeout_seconds: None,
                concurrency: None,
            }),
            ..RunMode::default()
        };
        let status = expect_status(
            "PUT that changes spec.mode",
            api.replace("one", &pp, &switched).await,
        )?;
        ensure_status("PUT that changes spec.mode", &status, 422, "Invalid")?;
        ensure!(
            causes_name_mode(&status),
            "422 must name spec.mode in details.causes: {:?}",
            status.details
        );

        let status = expect_status(
            "merge PATCH that changes spec.mode",
            api.patch(
                "one",
                &PatchParams::default(),
                &Patch::Merge(json!({
                    "spec": {"mode": {"task": null, "function": {"handler": "main.handle"}}}
                })),
            )
            .await,
        )?;
        ensure_status(
            "merge PATCH that changes spec.mode",
            &status,
            422,
            "Invalid",
        )?;
        ensure!(
            causes_name_mode(&status),
            "422 must name spec.mode in details.causes: {:?}",
            status.details
        );

        let now = api.get("one").await?;
        ensure!(
            now.spec == original.spec && now.resource_version() == original.resource_version(),
            "refused updates must leave the Run unchanged"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn a_terminal_phase_is_final() -> Result<()> {
    let (_server, client) = start_server(&[]).await?;
    within("terminal phase", async {
        let api: Api<Run> = Api::namespaced(client, NS);
        api.create(&PostParams::default(), &task_run("ended", "rt"))
            .await?;
        let ended = api
            .patch_status(
                "ended",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Failed", "reason": "WorkerLost"}})),
            )
            .await?;
        // Reviving an ended Run is refused, and nothing changes.
        let status = expect_status(
            "status back to Running",
            api.patch_status(
                "ended",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Running"}})),
            )
            .await,
        )?;
        ensure_status("status back to Running", &status, 422, "Invalid")?;
        ensure!(
            status.message.contains("terminal phase is final"),
            "{:?}",
            status.message
        );
        let now = api.get("ended").await?;
        ensure!(
            rv_of(&now)? == rv_of(&ended)?,
            "the refused write changed the Run"
        );
        ensure!(now.phase() == Phase::Failed);
        // Other status fields of an ended Run may still be written.
        api.patch_status(
            "ended",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"message": "the worker was lost"}})),
        )
        .await?;
        Ok(())
    })
    .await
}

/// Issue 15 item 6: core v1 Events and `events.k8s.io/v1` Events are one kind seen through
/// two APIs, as on Kubernetes: an Event created through core v1 is watched, patched and
/// deleted through events.k8s.io with its field names (`regarding`, `note`), and both APIs
/// are in discovery. Before, the two were stored apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn core_and_events_k8s_io_events_are_one_kind() -> Result<()> {
    use k8s_openapi::api::core::v1::Event as CoreEvent;
    use k8s_openapi::api::events::v1::Event as V1Event;

    let (_server, client) = start_server(&[]).await?;
    within("events through both APIs", async {
        let discovery = kube::discovery::Discovery::new(client.clone())
            .run()
            .await?;
        for group in ["", "events.k8s.io"] {
            ensure!(
                discovery.get(group).is_some_and(|g| g
                    .resources_by_stability()
                    .iter()
                    .any(|(r, _)| r.plural == "events")),
                "discovery lists no events in group {group:?}"
            );
        }
        let core: Api<CoreEvent> = Api::namespaced(client.clone(), NS);
        let v1: Api<V1Event> = Api::namespaced(client.clone(), NS);
        let watch_params =
            WatchParams::default().fields("regarding.name=target,regarding.kind=Run");
        let mut watch = v1.watch(&watch_params, "0").await?.boxed();
        let event: CoreEvent = serde_json::from_value(json!({
            "metadata": {"name": "target.1"},
            "involvedObject": {"kind": "Run", "name": "target", "namespace": NS},
            "reason": "Started", "message": "it started", "type": "Normal",
            "source": {"component": "test"},
        }))?;
        core.create(&PostParams::default(), &event).await?;
        let other: CoreEvent = serde_json::from_value(json!({
            "metadata": {"name": "other.1"},
            "involvedObject": {"kind": "Run", "name": "other", "namespace": NS},
            "reason": "Started", "message": "not this one", "type": "Normal",
        }))?;
        core.create(&PostParams::default(), &other).await?;

        let added = tokio::time::timeout(EVENT_DEADLINE, watch.try_next())
            .await
            .context("no watch event for the created Event")??;
        match added {
            Some(WatchEvent::Added(e)) => ensure!(
                e.metadata.name.as_deref() == Some("target.1")
                    && e.note.as_deref() == Some("it started")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("target")
                    && e.deprecated_source
                        .as_ref()
                        .and_then(|s| s.component.as_deref())
                        == Some("test"),
                "watched through events.k8s.io: {e:?}"
            ),
            other => bail!("expected ADDED target.1, got {other:?}"),
        }

        let patched = v1
            .patch(
                "target.1",
                &PatchParams::default(),
                &Patch::Merge(json!({"note": "it started again"})),
            )
            .await?;
        ensure!(
            patched.note.as_deref() == Some("it started again"),
            "{patched:?}"
        );
        let seen = core.get("target.1").await?;
        ensure!(
            seen.message.as_deref() == Some("it started again"),
            "core v1 view after the patch: {seen:?}"
        );
        v1.delete("target.1", &DeleteParams::default()).await?;
        ensure!(
            core.get_opt("target.1").await?.is_none(),
            "deleted through events.k8s.io, still in core v1"
        );
        let bad = v1
            .list(&ListParams::default().fields("involvedObject.name=target"))
            .await;
        ensure!(
            matches!(&bad, Err(kube::Error::Api(s)) if s.code == 400),
            "events.k8s.io selects on regarding, not involvedObject: {bad:?}"
        );
        Ok(())
    })
    .await
}

/// Regression (fuzzing, json_patch target): each `copy` of a Run into itself doubled it,
/// so a patch of a few dozen copies took all of the server's memory. Now 413, and the
/// Run is unchanged; a deep `add` answers 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_patch_copies_and_nesting_are_bounded() -> Result<()> {
    let (_server, client) = start_server(&[]).await?;
    within("bounded JSON patches", async {
        let api: Api<Run> = Api::namespaced(client, NS);
        let created = api
            .create(&PostParams::default(), &task_run("copied", "rt"))
            .await?;
        // An empty annotations map, then 40 copies of the whole Run into new members of it.
        let doubling: Vec<Value> = std::iter::once(
            json!({"op": "add", "path": "/metadata/annotations", "value": {}}),
        )
        .chain((0..40).map(
            |i| json!({"op": "copy", "from": "", "path": format!("/metadata/annotations/x{i}")}),
        ))
        .collect();
        let status = expect_status(
            "40 copies of the Run into itself",
            api.patch(
                "copied",
                &PatchParams::default(),
                &json_patch(Value::Array(doubling))?,
            )
            .await,
        )?;
        ensure_status(
            "40 copies of the Run into itself",
            &status,
            413,
            "RequestEntityTooLarge",
        )?;

        // Depth 102 applies on its own; a second one inside it would nest 202 levels.
        let deep = (0..100).fold(json!(1), |inner, _| json!({ "a": inner }));
        let inner = format!("/metadata/annotations{}", "/a".repeat(99));
        let ops = json!([
            {"op": "add", "path": "/metadata/annotations", "value": deep},
            {"op": "add", "path": inner, "value": deep},
        ]);
        let status = expect_status(
            "an add nested deeper than the store reads",
            api.patch("copied", &PatchParams::default(), &json_patch(ops)?)
                .await,
        )?;
        ensure_status(
            "an add nested deeper than the store reads",
            &status,
            422,
            "Invalid",
        )?;

        let after = api.get("copied").await?;
        ensure!(
            rv_of(&after)? == rv_of(&created)?,
            "a refused patch changed the Run"
        );
        Ok(())
    })
    .await
}
