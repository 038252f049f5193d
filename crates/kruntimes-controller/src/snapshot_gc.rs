//! The collector of snapshot data (a leader-only mark and sweep): the objects under
//! `<namespace>/snapshots/` of every ArtifactStore that no Snapshot and no Run refers to any
//! more are deleted.
//!
//! One round, every [`Config::snapshot_gc_interval`](crate::Config):
//!
//! 1. **Discovery.** The stores are the default one (`--snapshot-dir`'s `store/`, where the
//!    workers of `kruntimes up` keep snapshots when a Runtime names no ArtifactStore) and
//!    every Runtime's `spec.artifactStore`. Each store's snapshot data is listed first;
//!    then every Snapshot and every Run is listed. Listing the references last means that
//!    they are at least as new as the data: a worker writes a Snapshot object (its name
//!    and UID) before it stores a byte for it, so data of a live Snapshot is always marked.
//! 2. **Marking.** Data is kept when its key is `<namespace>/snapshots/<name>/<uid>/…` and a
//!    Snapshot `<namespace>/<name>` of that UID exists, or a Run that has not ended pins it
//!    (`spec.source.snapshot`: a fork restoring from it; with no UID in the pin, all data
//!    of the name), or a Run that has not ended is suspended to it (`status.snapshot`: its
//!    name and its URI), or any Snapshot's location names one of its objects (a checkpoint
//!    of a Suspended session refers to the suspend's data).
//! 3. **Collection.** A data set (`<uid>/`, the UID a Kubernetes UID) whose objects are all
//!    unmarked and were last written longer than [`Config::snapshot_gc_grace`](crate::Config)
//!    before the listing is deleted whole (one `delete` of its prefix); at most
//!    [`MAX_DELETES`] a round. Nothing else is ever deleted: not data of the layout before
//!    UIDs (files right under `<name>/`, which an older runtimed could write again under
//!    the same key), not a key of any other shape.
//!
//! A Runtime's ArtifactStore is collected only under the namespaces of the Runtimes that
//! name it (its creator chose the path or bucket; the controller-manager's own identity
//! does the deleting), the default store under every namespace. A store that cannot be
//! listed is skipped for the round; the others are still collected.
//!
//! Every UID is new: once no Snapshot and no live Run names a UID, nothing will again, so
//! an unmarked `<uid>/` is garbage for good and its deletion cannot race a new capture. A
//! store must belong to one installation: the data of another cluster's Snapshots in it
//! would be collected.
//!
//! Metrics (document 003's GC metrics): `kruntimes_snapshot_gc_pending`, the data sets
//! (and older-layout files) eligible at the last successful discovery (absent before the first one and on a standby
//! replica: zero means an empty discovery), and `kruntimes_snapshot_gc_duration_seconds
//! {stage="discovery"|"collection", error_type}` for each discovery and each deletion,
//! `error_type` only on failure (`api`, `transport`, `invalid`).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use kruntimes_api::{Run, Runtime, Snapshot};
use kruntimes_store::filesystem::FilesystemStore;
use kruntimes_store::{ArtifactStore, Listed, SNAPSHOTS_SEGMENT, StoreError};
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use tracing::{debug, info, warn};

use crate::metrics::{GcStage, Metrics};

/// How often a round runs, by default.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(300);
/// How old unmarked data must be to go, by default: a capture's data is written after its
/// Snapshot object, so this only covers clocks and stores that disagree.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(600);
/// The most objects one store's listing holds.
const MAX_LISTED: usize = 100_000;
/// The most data sets one round deletes; the rest wait for the next.
pub const MAX_DELETES: usize = 1_000;
/// Objects per page of the Snapshot and Run lists.
const PAGE: u32 = 500;

/// What a round needs.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The default store's root (`<--snapshot-dir>/store`), when the workers have one.
    pub default_store: Option<PathBuf>,
    pub interval: Duration,
    pub grace: Duration,
    pub metrics: Arc<Metrics>,
}

/// Why a round stopped before its collection.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    #[error("listing {what} failed: {source}")]
    List {
        what: &'static str,
        #[source]
        source: kube::Error,
    },
    #[error("listing the snapshot data of {store} failed: {source}")]
    Store {
        store: String,
        #[source]
        source: StoreError,
    },
}

impl GcError {
    /// The metric's `error_type`.
    fn kind(&self) -> &'static str {
        match self {
            GcError::List { .. } => "api",
            GcError::Store { source, .. } => store_error_kind(source),
        }
    }
}

fn store_error_kind(error: &StoreError) -> &'static str {
    match error {
        StoreError::Transport(_) => "transport",
        StoreError::Invalid(_) => "invalid",
    }
}

/// Runs a round every `settings.interval` while the term lasts (cancel it by dropping the
/// future; the pending gauge goes absent then). Never returns; a zero interval disables it.
pub(crate) async fn run(client: Client, settings: Settings) -> Result<(), crate::Error> {
    if settings.interval.is_zero() {
        info!("snapshot data collection is disabled (--snapshot-gc-interval 0)");
        return std::future::pending().await;
    }
    /// Clears the pending gauge when the term ends: a standby reports none.
    struct Standby(Arc<Metrics>);
    impl Drop for Standby {
        fn drop(&mut self) {
            self.0.snapshot_gc_pending(None);
        }
    }
    let _standby = Standby(settings.metrics.clone());
    let mut tick = tokio::time::interval(settings.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match round(&client, &settings).await {
            Ok(Round { deleted: 0, .. }) => {}
            Ok(round) => info!(
                deleted = round.deleted,
                failed = round.failed,
                bytes = round.bytes,
                "collected unreferenced snapshot data"
            ),
            Err(error) => {
                warn!(error = %error, "snapshot data collection failed; the next round retries")
            }
        }
    }
}

/// What one round did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Round {
    /// Data sets (and files of the layout before UIDs) unmarked and old enough to go, at
    /// discovery.
    pub pending: usize,
    /// Of them, deleted (at most [`MAX_DELETES`]); `failed` the others tried.
    pub deleted: usize,
    pub failed: usize,
    pub bytes: u64,
}

/// One round: discovery, then collection. Public for the tests, which run rounds
/// themselves instead of waiting for the interval.
pub async fn round(client: &Client, settings: &Settings) -> Result<Round, GcError> {
    let started = Instant::now();
    let discovered = discover(client, settings).await;
    let elapsed = started.elapsed();
    let eligible = match discovered {
        Ok(eligible) => {
            settings
                .metrics
                .snapshot_gc_observe(GcStage::Discovery, None, elapsed);
            eligible
        }
        Err(error) => {
            // The last count stays: a failed discovery says nothing new.
            settings
                .metrics
                .snapshot_gc_observe(GcStage::Discovery, Some(error.kind()), elapsed);
            return Err(error);
        }
    };
    let pending = eligible.len();
    settings
        .metrics
        .snapshot_gc_pending(Some(i64::try_from(pending).unwrap_or(i64::MAX)));
    let mut done = Round {
        pending,
        ..Round::default()
    };
    for (store, garbage) in eligible.into_iter().take(MAX_DELETES) {
        let started = Instant::now();
        match store.delete(&garbage.uri).await {
            Ok(()) => {
                settings
                    .metrics
                    .snapshot_gc_observe(GcStage::Collection, None, started.elapsed());
                debug!(key = %garbage.key, objects = garbage.objects, bytes = garbage.bytes, "deleted unreferenced snapshot data");
                done.deleted += 1;
                done.bytes += garbage.bytes;
            }
            Err(error) => {
                settings.metrics.snapshot_gc_observe(
                    GcStage::Collection,
                    Some(store_error_kind(&error)),
                    started.elapsed(),
                );
                warn!(key = %garbage.key, error = %error, "deleting unreferenced snapshot data failed; the next round retries");
                done.failed += 1;
            }
        }
    }
    Ok(done)
}

/// Data that goes: a data set `<namespace>/snapshots/<name>/<uid>/`, every object of it
/// unmarked and old enough.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Garbage {
    /// The key of the set, ending in `/`.
    pub key: String,
    /// What `delete` takes: it ends in `/`, so all of the set goes.
    pub uri: String,
    pub objects: usize,
    pub bytes: u64,
}

type Eligible = Vec<(Arc<dyn ArtifactStore>, Garbage)>;

/// The unmarked data old enough to go, each with its store.
async fn discover(client: &Client, settings: &Settings) -> Result<Eligible, GcError> {
    let mut listed = Vec::new();
    for store in stores(client, settings).await? {
        let at = SystemTime::now();
        let started = Instant::now();
        let mut listing = match store.store.list_snapshot_data(MAX_LISTED).await {
            Ok(listing) => listing,
            Err(source) => {
                // This store waits for a later round; the others are collected.
                let error = GcError::Store {
                    store: store.label.clone(),
                    source,
                };
                settings.metrics.snapshot_gc_observe(
                    GcStage::Discovery,
                    Some(error.kind()),
                    started.elapsed(),
                );
                warn!(error = %error, "its snapshot data is not collected this round");
                continue;
            }
        };
        if listing.truncated {
            warn!(store = %store.label, objects = MAX_LISTED, "more snapshot data than one listing holds; the rest waits for later rounds");
        }
        if let Some(namespaces) = &store.namespaces {
            listing.objects.retain(|object| {
                object
                    .key
                    .split('/')
                    .next()
                    .is_some_and(|namespace| namespaces.contains(namespace))
            });
        }
        listed.push((store.store, at, listing.objects));
    }
    // After the data: the references are at least as new as what they protect.
    let marks = Marks::list(client).await?;
    let mut eligible = Vec::new();
    for (store, at, objects) in listed {
        let cutoff = at
            .checked_sub(settings.grace)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        for garbage in marks.garbage(&objects, cutoff) {
            eligible.push((store.clone(), garbage));
        }
    }
    Ok(eligible)
}

/// Where `key` belongs when it is in a data set: the key of the set
/// (`<namespace>/snapshots/<name>/<uid>/`, the UID a Kubernetes UID) and the rest of the key.
fn data_set(key: &str) -> Option<(&str, &str)> {
    // The ends of the namespace, `snapshots`, the name and the UID.
    let mut ends = key.match_indices('/').map(|(i, _)| i);
    let (namespace, snapshots, name, uid) =
        (ends.next()?, ends.next()?, ends.next()?, ends.next()?);
    (&key[namespace + 1..snapshots] == SNAPSHOTS_SEGMENT && is_uid(&key[name + 1..uid]))
        .then(|| (&key[..=uid], &key[uid + 1..]))
}

/// Whether `text` is spelled as a Kubernetes UID (a UUID: 8-4-4-4-12 hexadecimal digits).
fn is_uid(text: &str) -> bool {
    text.len() == 36
        && text.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// A store to collect.
struct Store {
    /// For logs (never a credential: S3 credentials come from the environment).
    label: String,
    store: Arc<dyn ArtifactStore>,
    /// The namespaces whose data may be collected there; `None`: every one (the default
    /// store, which is the installation's own).
    namespaces: Option<HashSet<String>>,
}

/// The stores to collect: the default one and every Runtime's, each once.
async fn stores(client: &Client, settings: &Settings) -> Result<Vec<Store>, GcError> {
    let mut stores = Vec::new();
    if let Some(root) = &settings.default_store {
        stores.push(Store {
            label: format!("the default store {}", root.display()),
            store: Arc::new(FilesystemStore::new(root.clone())),
            namespaces: None,
        });
    }
    let runtimes = list_all(Api::<Runtime>::all(client.clone()), "runtimes").await?;
    // By the store's spec: the first Runtime naming it, and every namespace that does.
    let mut named: HashMap<String, (&Runtime, HashSet<String>)> = HashMap::new();
    for runtime in &runtimes {
        let Some(spec) = runtime.spec.artifact_store.as_ref() else {
            continue;
        };
        let identity = serde_json::to_string(spec).unwrap_or_default();
        named
            .entry(identity)
            .or_insert_with(|| (runtime, HashSet::new()))
            .1
            .insert(runtime.namespace().unwrap_or_default());
    }
    for (runtime, namespaces) in named.into_values() {
        let label = format!(
            "the ArtifactStore of Runtime {}/{}",
            runtime.namespace().unwrap_or_default(),
            runtime.name_any()
        );
        let Some(spec) = runtime.spec.artifact_store.as_ref() else {
            continue;
        };
        match kruntimes_store::open(spec) {
            Ok(store) => stores.push(Store {
                label,
                store,
                namespaces: Some(namespaces),
            }),
            // A Runtime whose store cannot be opened keeps its data until it can.
            Err(error) => {
                warn!(store = %label, error = %error, "cannot open the store; its snapshot data is not collected")
            }
        }
    }
    Ok(stores)
}

/// Every object of `api`, page by page.
async fn list_all<K>(api: Api<K>, what: &'static str) -> Result<Vec<K>, GcError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut params = ListParams::default().limit(PAGE);
    let mut all = Vec::new();
    loop {
        let page = api
            .list(&params)
            .await
            .map_err(|source| GcError::List { what, source })?;
        all.extend(page.items);
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(all),
        }
    }
}

/// What keeps the data of one Snapshot name.
#[derive(Debug, Default)]
struct Keep {
    /// Everything under the name (a pin without a UID, a suspended Run's snapshot).
    all: bool,
    /// The UIDs whose data stays.
    uids: HashSet<String>,
}

/// The references of every Snapshot and every live Run.
#[derive(Debug, Default)]
pub(crate) struct Marks {
    /// By (namespace, Snapshot name).
    names: HashMap<(String, String), Keep>,
    /// Data URIs named by Snapshots' status and suspended Runs.
    uris: HashSet<String>,
}

impl Marks {
    async fn list(client: &Client) -> Result<Marks, GcError> {
        let snapshots = list_all(Api::<Snapshot>::all(client.clone()), "snapshots").await?;
        let runs = list_all(Api::<Run>::all(client.clone()), "runs").await?;
        Ok(Marks::of(&snapshots, &runs))
    }

    pub(crate) fn of(snapshots: &[Snapshot], runs: &[Run]) -> Marks {
        let mut marks = Marks::default();
        for snapshot in snapshots {
            let keep = marks.keep(snapshot.namespace(), snapshot.name_any());
            if let Some(uid) = snapshot.uid() {
                keep.uids.insert(uid);
            }
            if let Some(location) = snapshot.status.as_ref().and_then(|s| s.location.as_ref()) {
                marks.uris.insert(location.uri.clone());
                marks.uris.extend(location.manifest_uri.clone());
            }
        }
        for run in runs {
            if run.phase().is_terminal() {
                continue;
            }
            if let Some(pin) = run.spec.fork_source() {
                let keep = marks.keep(run.namespace(), pin.name.clone());
                match &pin.uid {
                    Some(uid) => {
                        keep.uids.insert(uid.clone());
                    }
                    None => keep.all = true,
                }
            }
            if let Some(suspended) = run.status.as_ref().and_then(|s| s.snapshot.as_ref()) {
                marks.keep(run.namespace(), suspended.name.clone()).all = true;
                marks.uris.extend(suspended.uri.clone());
            }
        }
        marks
    }

    fn keep(&mut self, namespace: Option<String>, name: String) -> &mut Keep {
        self.names
            .entry((namespace.unwrap_or_default(), name))
            .or_default()
    }

    /// The data of `objects` (one store's listing) that goes: each data set whose objects
    /// are all unmarked and last written at `cutoff` or before.
    pub(crate) fn garbage(&self, objects: &[Listed], cutoff: SystemTime) -> Vec<Garbage> {
        // By set key: the garbage so far, or None once one object of it stays.
        let mut sets: HashMap<&str, Option<Garbage>> = HashMap::new();
        for object in objects {
            let Some((set, rest)) = data_set(&object.key) else {
                continue;
            };
            let goes = object.modified <= cutoff && !self.keeps(object);
            let entry = sets.entry(set).or_insert_with(|| {
                let uri = object
                    .uri
                    .strip_suffix(rest)
                    .unwrap_or(&object.uri)
                    .to_string();
                Some(Garbage {
                    key: set.to_string(),
                    uri,
                    objects: 0,
                    bytes: 0,
                })
            });
            match (goes, entry.as_mut()) {
                (true, Some(garbage)) => {
                    garbage.objects += 1;
                    garbage.bytes += object.size;
                }
                _ => *entry = None,
            }
        }
        let mut garbage: Vec<Garbage> = sets.into_values().flatten().collect();
        garbage.sort_by(|a, b| a.key.cmp(&b.key));
        garbage
    }

    /// Whether `object` stays: anything not in a data set does.
    pub(crate) fn keeps(&self, object: &Listed) -> bool {
        if self.uris.contains(&object.uri) {
            return true;
        }
        let Some((set, _)) = data_set(&object.key) else {
            return true;
        };
        let mut segments = set.split('/');
        let (Some(namespace), Some(_), Some(name), Some(uid)) = (
            segments.next(),
            segments.next(),
            segments.next(),
            segments.next(),
        ) else {
            return true;
        };
        self.names
            .get(&(namespace.to_string(), name.to_string()))
            .is_some_and(|keep| keep.all || keep.uids.contains(uid))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use kruntimes_api::RunSpec;
    use kruntimes_api::run::{RunSnapshotRef, RunSource, RunStatus};
    use kruntimes_api::snapshot::{ObjectReference, SnapshotSource, SnapshotSpec};

    use super::*;

    /// UIDs, as Kubernetes spells them.
    fn uid(n: u8) -> String {
        format!("{n:08}-0000-4000-8000-000000000000")
    }

    fn snapshot(namespace: &str, name: &str, uid: &str) -> Snapshot {
        let mut snapshot = Snapshot::new(
            name,
            SnapshotSpec {
                source: SnapshotSource {
                    run: ObjectReference {
                        name: "r".into(),
                        uid: None,
                    },
                },
                reason: None,
            },
        );
        snapshot.metadata.namespace = Some(namespace.into());
        snapshot.metadata.uid = Some(uid.into());
        snapshot
    }

    fn fork(namespace: &str, name: &str, uid: Option<&str>) -> Run {
        let mut spec = RunSpec::task("py", "");
        spec.source = Some(RunSource {
            inline: None,
            snapshot: Some(ObjectReference {
                name: name.into(),
                uid: uid.map(str::to_string),
            }),
        });
        let mut run = Run::new("fork", spec);
        run.metadata.namespace = Some(namespace.into());
        run
    }

    fn object(key: &str) -> Listed {
        Listed {
            key: key.into(),
            uri: format!("file:///store/{key}"),
            size: 1,
            modified: SystemTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn data_is_kept_by_its_snapshots_uid_a_live_pin_or_a_suspended_run() {
        let mut suspended = fork("ns", "other", None);
        suspended.spec.source = None;
        suspended.status = Some(RunStatus {
            snapshot: Some(RunSnapshotRef {
                name: "held".into(),
                uri: Some("s3://b/elsewhere/archive.tar.zst".into()),
                last_sequence: None,
            }),
            ..Default::default()
        });
        let marks = Marks::of(
            &[snapshot("ns", "cp", &uid(1))],
            &[
                fork("ns", "pinned", Some(&uid(2))),
                fork("ns", "any", None),
                suspended,
            ],
        );
        let (u0, u1, u2, u3, u9) = (uid(0), uid(1), uid(2), uid(3), uid(9));
        let cases = [
            // The Snapshot's own UID.
            (format!("ns/snapshots/cp/{u1}/archive.tar.zst"), true),
            // An earlier Snapshot of the same name (another UID): garbage.
            (format!("ns/snapshots/cp/{u0}/archive.tar.zst"), false),
            // The same name in another namespace: not this Snapshot's.
            (format!("other/snapshots/cp/{u1}/archive.tar.zst"), false),
            // A fork's pin keeps its UID only; a pin without a UID keeps the name.
            (format!("ns/snapshots/pinned/{u2}/manifest.json"), true),
            (format!("ns/snapshots/pinned/{u3}/manifest.json"), false),
            (format!("ns/snapshots/any/{u9}/archive.tar.zst"), true),
            // A suspended Run keeps its snapshot by name.
            (format!("ns/snapshots/held/{u3}/archive.tar.zst"), true),
            // Nobody's.
            (format!("ns/snapshots/gone/{u3}/archive.tar.zst"), false),
            // Not in a data set (the layout before UIDs, a directory that is no UID, any
            // other shape): never deleted.
            ("ns/snapshots/gone/archive.tar.zst".to_string(), true),
            (
                "ns/snapshots/gone/not-a-uid/archive.tar.zst".to_string(),
                true,
            ),
            ("ns/snapshots/gone".to_string(), true),
            (format!("ns/runs/gone/{u3}/x"), true),
        ];
        for (key, kept) in cases {
            assert_eq!(marks.keeps(&object(&key)), kept, "{key}");
        }
        // A URI a Snapshot's status or a suspended Run names is kept whatever its key.
        let mut elsewhere = object(&format!("ns/snapshots/gone/{u3}/archive.tar.zst"));
        elsewhere.uri = "s3://b/elsewhere/archive.tar.zst".into();
        assert!(marks.keeps(&elsewhere));
    }

    #[test]
    fn a_data_set_goes_whole_and_only_when_all_of_it_may() {
        let marks = Marks::of(&[snapshot("ns", "cp", &uid(1))], &[]);
        let at = |key: String, secs: u64| Listed {
            modified: SystemTime::UNIX_EPOCH + Duration::from_secs(secs),
            ..object(&key)
        };
        let (u1, u2, u3) = (uid(1), uid(2), uid(3));
        let objects = [
            at(format!("ns/snapshots/cp/{u1}/archive.tar.zst"), 1),
            at(format!("ns/snapshots/old/{u2}/archive.tar.zst"), 1),
            at(format!("ns/snapshots/old/{u2}/manifest.json"), 1),
            // One object written after the cutoff keeps its whole set for now.
            at(format!("ns/snapshots/young/{u3}/archive.tar.zst"), 1),
            at(format!("ns/snapshots/young/{u3}/manifest.json"), 9),
            at("ns/snapshots/legacy/archive.tar.zst".to_string(), 1),
        ];
        let garbage = marks.garbage(&objects, SystemTime::UNIX_EPOCH + Duration::from_secs(5));
        assert_eq!(
            garbage,
            [Garbage {
                key: format!("ns/snapshots/old/{u2}/"),
                uri: format!("file:///store/ns/snapshots/old/{u2}/"),
                objects: 2,
                bytes: 2,
            }]
        );
    }

    #[test]
    fn an_ended_run_keeps_nothing() {
        let u2 = uid(2);
        let mut ended = fork("ns", "pinned", Some(&u2));
        ended.status = Some(RunStatus {
            phase: Some(kruntimes_api::Phase::Succeeded),
            ..Default::default()
        });
        let marks = Marks::of(&[], &[ended]);
        assert!(!marks.keeps(&object(&format!(
            "ns/snapshots/pinned/{u2}/archive.tar.zst"
        ))));
    }

    #[test]
    fn uids_are_spelled_as_kubernetes_spells_them() {
        assert!(is_uid("85716170-5e3d-46f6-887b-b8525b4d9ea6"));
        for not in [
            "",
            "u1",
            "85716170-5e3d-46f6-887b-b8525b4d9ea",
            "85716170_5e3d-46f6-887b-b8525b4d9ea6",
            "85716170-5e3d-46f6-887b-b8525b4d9eaz",
            "85716170-5e3d-46f6-887b-b8525b4d9ea6-",
        ] {
            assert!(!is_uid(not), "{not:?}");
        }
    }
}
