//! The keeper of the data directory's log store, `DATA_DIR/logs`
//! ([`kruntimes_api::logstore`]): the workers write the stdout and stderr of task
//! executions there, outside their disposable roots, and the gateway serves them from there
//! once the worker is gone, so the logs of finished Runs outlive workers and restarts of
//! `kruntimes up` (docs/task-mode.md, "Logs").
//!
//! Retention, which only this keeper applies:
//!
//! - **Deleted with the Run.** A watch of every Run removes `DATA_DIR/logs/<uid>` as soon as
//!   the Run is deleted. A sweep at start and every [`ORPHAN_SWEEPS`] sweeps catches what a
//!   watch missed (a Run deleted while `kruntimes up` was down): it reads the store's
//!   directories first and lists the Runs after, so a directory whose UID is in no Run of
//!   that list belongs to a Run deleted before the list (UIDs are never reused, and a
//!   Run's directory is only ever created after the Run).
//! - **A cap.** When the store holds more than [`KeeperConfig::max_bytes`], the logs of
//!   finished Runs go, least recently written first, until it fits. The logs of Runs that
//!   have not ended are never removed; they count against the cap.
//!
//! A removal that fails is logged and tried again by the next sweep.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use kruntimes_api::{Run, logstore};
use kube::api::{Api, ListParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The log store's directory inside the data directory.
pub const LOG_DIR: &str = "logs";
/// Every this many sweeps, one also removes the directories of Runs that no longer exist.
pub const ORPHAN_SWEEPS: u32 = 10;
/// Runs listed per page by a sweep.
const LIST_PAGE: u32 = 500;

/// How the keeper keeps the store.
#[derive(Clone, Debug)]
pub struct KeeperConfig {
    /// `DATA_DIR/logs`.
    pub dir: PathBuf,
    /// The most bytes the store holds before the logs of finished Runs go.
    pub max_bytes: u64,
    /// How often the store's size is checked.
    pub interval: Duration,
}

/// What the store holds of one Run.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stored {
    uid: String,
    bytes: u64,
    /// The last write to any of its files.
    written: SystemTime,
}

/// What the API says of a Run the store holds logs of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Known {
    Ended,
    NotEnded,
}

/// Starts the keeper: the watch that removes a deleted Run's logs and the periodic sweep.
/// Both end when `shutdown` turns true.
pub fn spawn(
    client: Client,
    config: KeeperConfig,
    shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        if let Err(error) = std::fs::create_dir_all(&config.dir) {
            tracing::warn!(dir = %config.dir.display(), error = %error, "cannot create the log store");
        }
        let deletions = remove_deleted(client.clone(), config.dir.clone(), shutdown.clone());
        let sweeps = sweep_periodically(client, config, shutdown);
        tokio::join!(deletions, sweeps);
    })
}

async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stopping| *stopping).await;
}

/// Removes the logs of every Run the watch sees deleted.
async fn remove_deleted(client: Client, dir: PathBuf, mut shutdown: watch::Receiver<bool>) {
    let runs: Api<Run> = Api::all(client);
    let mut events = watcher(runs, watcher::Config::default()).boxed();
    loop {
        let event = tokio::select! {
            _ = stopped(&mut shutdown) => return,
            event = events.next() => event,
        };
        match event {
            Some(Ok(watcher::Event::Delete(run))) => {
                if let Some(uid) = run.uid() {
                    remove_run(&dir, &uid, "the Run was deleted").await;
                }
            }
            Some(Ok(_)) => {}
            // The watcher retries by itself; the sweeps catch what it misses meanwhile.
            Some(Err(error)) => {
                tracing::debug!(error = %error, "the log store's watch of Runs failed; retrying");
                tokio::select! {
                    _ = stopped(&mut shutdown) => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
            None => return,
        }
    }
}

async fn sweep_periodically(
    client: Client,
    config: KeeperConfig,
    mut shutdown: watch::Receiver<bool>,
) {
    let runs: Api<Run> = Api::all(client);
    let mut sweeps: u32 = 0;
    loop {
        let orphans = sweeps.is_multiple_of(ORPHAN_SWEEPS);
        if let Err(error) = sweep(&runs, &config, orphans).await {
            tracing::warn!(error = %error, "the log store's sweep failed; trying again later");
        }
        sweeps = sweeps.wrapping_add(1);
        tokio::select! {
            _ = stopped(&mut shutdown) => return,
            _ = tokio::time::sleep(config.interval) => {}
        }
    }
}

/// One sweep: the orphans' logs (when `orphans`), then the cap.
async fn sweep(runs: &Api<Run>, config: &KeeperConfig, orphans: bool) -> anyhow::Result<()> {
    // The store first, the Runs after: see the module's documentation.
    let dir = config.dir.clone();
    let stored = tokio::task::spawn_blocking(move || scan(&dir)).await??;
    let total: u64 = stored.iter().map(|s| s.bytes).sum();
    if stored.is_empty() || (!orphans && total <= config.max_bytes) {
        return Ok(());
    }
    let known = list(runs).await?;
    for (uid, why) in plan(&stored, &known, config.max_bytes) {
        remove_run(&config.dir, &uid, why).await;
    }
    Ok(())
}

/// Every Run's UID and whether it ended, from a paginated list.
async fn list(runs: &Api<Run>) -> anyhow::Result<HashMap<String, Known>> {
    let mut known = HashMap::new();
    let mut params = ListParams::default().limit(LIST_PAGE);
    loop {
        let page = runs.list(&params).await?;
        for run in &page.items {
            if let Some(uid) = run.uid() {
                let state = if run.phase().is_terminal() {
                    Known::Ended
                } else {
                    Known::NotEnded
                };
                known.insert(uid, state);
            }
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(known),
        }
    }
}

/// What a sweep removes, and why: the Runs that no longer exist, then the finished Runs
/// least recently written until the store fits in `max_bytes`.
fn plan(
    stored: &[Stored],
    known: &HashMap<String, Known>,
    max_bytes: u64,
) -> Vec<(String, &'static str)> {
    let mut remove = Vec::new();
    let mut total: u64 = 0;
    let mut ended: Vec<&Stored> = Vec::new();
    for entry in stored {
        match known.get(&entry.uid) {
            None => remove.push((entry.uid.clone(), "the Run no longer exists")),
            Some(state) => {
                total = total.saturating_add(entry.bytes);
                if *state == Known::Ended {
                    ended.push(entry);
                }
            }
        }
    }
    ended.sort_by(|a, b| a.written.cmp(&b.written).then_with(|| a.uid.cmp(&b.uid)));
    for entry in ended {
        if total <= max_bytes {
            break;
        }
        total = total.saturating_sub(entry.bytes);
        remove.push((entry.uid.clone(), "the log store is over its cap"));
    }
    remove
}

/// The Runs the store holds logs of. Entries that are not a Run's directory are skipped.
fn scan(dir: &Path) -> std::io::Result<Vec<Stored>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut stored = Vec::new();
    for entry in entries.flatten() {
        let Some(uid) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if !logstore::is_store_uid(&uid) || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let mut run = Stored {
            uid,
            bytes: 0,
            written: SystemTime::UNIX_EPOCH,
        };
        // RUN/<attempt>/<file>: two levels, never followed through symlinks.
        for attempt in std::fs::read_dir(entry.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            if !attempt.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            for file in std::fs::read_dir(attempt.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let Ok(metadata) = file.metadata() else {
                    continue;
                };
                if !metadata.is_file() {
                    continue;
                }
                run.bytes = run.bytes.saturating_add(metadata.len());
                if let Ok(modified) = metadata.modified() {
                    run.written = run.written.max(modified);
                }
            }
        }
        stored.push(run);
    }
    Ok(stored)
}

/// Removes `STORE/<uid>`; a directory already gone is fine.
async fn remove_run(dir: &Path, uid: &str, why: &'static str) {
    let Some(path) = logstore::run_dir(dir, uid) else {
        return;
    };
    let removed = tokio::task::spawn_blocking(move || match std::fs::remove_dir_all(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    })
    .await;
    match removed {
        Ok(Ok(true)) => tracing::info!(
            run_uid = uid,
            why,
            "removed a Run's logs from the log store"
        ),
        Ok(Ok(false)) => {}
        Ok(Err(error)) => {
            tracing::warn!(run_uid = uid, error = %error, "cannot remove a Run's logs from the log store")
        }
        Err(error) => {
            tracing::warn!(run_uid = uid, error = %error, "the removal of a Run's logs failed")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(uid: &str, bytes: u64, at: u64) -> Stored {
        Stored {
            uid: uid.to_string(),
            bytes,
            written: SystemTime::UNIX_EPOCH + Duration::from_secs(at),
        }
    }

    #[test]
    fn the_deleted_go_then_the_oldest_finished_until_the_store_fits() {
        let stored = [
            stored("gone", 500, 1),
            stored("old-ended", 300, 2),
            stored("running", 400, 3),
            stored("new-ended", 300, 4),
            stored("newest-ended", 100, 5),
        ];
        let known: HashMap<String, Known> = [
            ("old-ended", Known::Ended),
            ("running", Known::NotEnded),
            ("new-ended", Known::Ended),
            ("newest-ended", Known::Ended),
        ]
        .into_iter()
        .map(|(uid, state)| (uid.to_string(), state))
        .collect();
        let uids = |plan: Vec<(String, &'static str)>| -> Vec<String> {
            plan.into_iter().map(|(uid, _)| uid).collect()
        };
        // 1100 bytes of existing Runs: under a cap of 2000, only the deleted Run goes.
        assert_eq!(uids(plan(&stored, &known, 2000)), ["gone"]);
        // Under 800: the oldest finished Run goes (1100 - 300 = 800).
        assert_eq!(uids(plan(&stored, &known, 800)), ["gone", "old-ended"]);
        // Under 0: every finished Run goes, the running one never.
        assert_eq!(
            uids(plan(&stored, &known, 0)),
            ["gone", "old-ended", "new-ended", "newest-ended"]
        );
    }

    #[test]
    fn a_scan_sees_runs_attempts_and_nothing_else() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let store = tmp.path();
        for (attempt, bytes) in [(1, 10), (2, 5)] {
            let dir = store.join("0c4e-77ab").join(attempt.to_string());
            std::fs::create_dir_all(&dir).expect("attempt dir");
            std::fs::write(dir.join(logstore::STDOUT_FILE), vec![b'x'; bytes]).expect("stdout");
            std::fs::write(dir.join(logstore::STDERR_FILE), b"e").expect("stderr");
        }
        std::fs::write(store.join("stray-file"), b"not a Run").expect("stray");
        std::fs::create_dir(store.join("not.a.uid")).expect("odd dir");
        let scanned = scan(store).expect("scan");
        assert_eq!(scanned.len(), 1, "{scanned:?}");
        assert_eq!(scanned[0].uid, "0c4e-77ab");
        assert_eq!(scanned[0].bytes, 17);
        assert!(
            scan(&store.join("missing"))
                .expect("a missing store")
                .is_empty()
        );
    }
}
