//! `list_snapshot_data` of both drivers (a filesystem root, and a real S3-protocol server,
//! `s3s-fs`, under a prefix): it lists the snapshot data of every namespace and nothing
//! else, with keys relative to the store and URIs that `delete` takes, within its bound.

use std::time::{Duration, SystemTime};

use anyhow::{Context as _, Result, ensure};
use bytes::Bytes;
use futures::StreamExt;
use kruntimes_api::runtime::S3ArtifactStore;
use kruntimes_store::filesystem::FilesystemStore;
use kruntimes_store::s3::S3Store;
use kruntimes_store::{ArtifactStore, ByteStream};
use kruntimes_testkit::s3::S3Server;

/// Snapshot data: a suspend Snapshot's archive, a checkpoint's (under its UID), and one of
/// another namespace.
const SNAPSHOT_KEYS: [&str; 3] = [
    "ns1/snapshots/a-s1/archive.tar.zst",
    "ns1/snapshots/b/0f3c/archive.tar.zst",
    "ns2/snapshots/c/manifest.json",
];
/// Not snapshot data: never listed.
const OTHER_KEYS: [&str; 3] = [
    "ns1/run-0f3c/out.txt",
    "ns1/snapshotsx/a/archive.tar.zst",
    "snapshots/ns/a",
];

fn bytes(text: &'static str) -> ByteStream {
    futures::stream::iter([Ok(Bytes::from_static(text.as_bytes()))]).boxed()
}

async fn lists_only_snapshot_data(store: &dyn ArtifactStore) -> Result<()> {
    let before = SystemTime::now() - Duration::from_secs(60);
    for key in SNAPSHOT_KEYS.iter().chain(OTHER_KEYS.iter()) {
        store
            .put_blob(key, bytes("data"))
            .await
            .with_context(|| format!("put {key}"))?;
    }
    let listing = store.list_snapshot_data(100).await?;
    ensure!(!listing.truncated, "{listing:?}");
    let mut keys: Vec<&str> = listing.objects.iter().map(|o| o.key.as_str()).collect();
    keys.sort_unstable();
    ensure!(keys == SNAPSHOT_KEYS, "{keys:?}");
    for object in &listing.objects {
        ensure!(object.size == 4 && object.modified > before, "{object:?}");
    }
    // The URIs are the store's own: a listed object is deleted through its URI.
    let gone = &listing.objects[0];
    store.delete(&gone.uri).await?;
    let listing = store.list_snapshot_data(100).await?;
    ensure!(
        listing.objects.len() == 2 && listing.objects.iter().all(|o| o.key != gone.key),
        "{listing:?}"
    );
    // The bound.
    let listing = store.list_snapshot_data(1).await?;
    ensure!(
        listing.objects.len() == 1 && listing.truncated,
        "{listing:?}"
    );
    Ok(())
}

#[tokio::test]
async fn the_filesystem_store_lists_only_snapshot_data() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let store = FilesystemStore::new(tmp.path().join("store"));
    // A store nothing was written to lists nothing.
    ensure!(store.list_snapshot_data(10).await?.objects.is_empty());
    lists_only_snapshot_data(&store).await
}

/// A symlink in the store (put there by hand: the store writes regular files only) is
/// neither entered nor listed, and a URI that leads through one is never deleted: the
/// delete would reach what the link points to.
#[tokio::test]
async fn the_filesystem_store_lists_and_deletes_nothing_through_a_symlink() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path().join("store");
    let store = FilesystemStore::new(&root);
    store
        .put_blob("real/snapshots/a/0f3c/archive.tar.zst", bytes("data"))
        .await?;
    let outside = tmp.path().join("outside");
    std::fs::create_dir_all(outside.join("snapshots/b/0f3c"))?;
    std::fs::write(outside.join("snapshots/b/0f3c/archive.tar.zst"), "mine")?;
    // A namespace that is a link to a directory outside the store, one to another
    // namespace, and a data set that is a link.
    std::os::unix::fs::symlink(&outside, root.join("linked"))?;
    std::os::unix::fs::symlink(root.join("real"), root.join("alias"))?;
    std::os::unix::fs::symlink(&outside, root.join("real/snapshots/a/0f3d"))?;
    let listing = store.list_snapshot_data(100).await?;
    let keys: Vec<&str> = listing.objects.iter().map(|o| o.key.as_str()).collect();
    ensure!(
        keys == ["real/snapshots/a/0f3c/archive.tar.zst"],
        "{keys:?}"
    );
    let canonical = root.canonicalize()?;
    for through in [
        format!("file://{}/alias/snapshots/a/0f3c/", canonical.display()),
        format!("file://{}/real/snapshots/a/0f3d/", canonical.display()),
    ] {
        let refused = store.delete(&through).await;
        ensure!(refused.is_err(), "{through}: {refused:?}");
    }
    ensure!(outside.join("snapshots/b/0f3c/archive.tar.zst").is_file());
    ensure!(root.join("real/snapshots/a/0f3c/archive.tar.zst").is_file());
    Ok(())
}

#[tokio::test]
async fn the_s3_store_lists_only_snapshot_data_under_its_prefix() -> Result<()> {
    let server = S3Server::start()?;
    let (id, secret) = server.credentials();
    let spec = S3ArtifactStore {
        endpoint: server.endpoint(),
        bucket: server.bucket().to_string(),
        prefix: Some("team/a".to_string()),
        region: None,
        force_path_style: None,
    };
    let store = S3Store::new(&spec, Some((id.to_string(), secret.to_string(), None)))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    // Data outside the prefix is not the store's: another store of the bucket.
    let outside = S3Store::new(
        &S3ArtifactStore {
            prefix: Some("team/b".to_string()),
            ..spec.clone()
        },
        Some((id.to_string(), secret.to_string(), None)),
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    outside
        .put_blob("ns1/snapshots/z/archive.tar.zst", bytes("data"))
        .await?;
    lists_only_snapshot_data(&store).await
}
