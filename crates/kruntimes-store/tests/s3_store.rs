//! The ArtifactStore's S3 driver against a real S3-protocol server (`s3s-fs` through
//! [`kruntimes_testkit::s3::S3Server`], on 127.0.0.1:0 with a temporary root): blobs
//! through multipart uploads, all-or-nothing uploads, caps, confinement to the bucket
//! and prefix, artifact export with its completion marker, and how failures are reported.

use std::path::Path;

use anyhow::{Context as _, Result};
use bytes::Bytes;
use futures::StreamExt;
use kruntimes_api::run::ArtifactInput;
use kruntimes_api::runtime::S3ArtifactStore;
use kruntimes_store::s3::{EXPORT_MARKER_SUFFIX, PART_BYTES, S3Store};
use kruntimes_store::{ArtifactStore, BlobStream, ByteStream, RunKey, StoreError};
use kruntimes_testkit::s3::S3Server;
use sha2::{Digest, Sha256};

const MIB: usize = 1024 * 1024;

fn spec(server: &S3Server, prefix: Option<&str>) -> S3ArtifactStore {
    S3ArtifactStore {
        endpoint: server.endpoint(),
        bucket: server.bucket().to_string(),
        prefix: prefix.map(str::to_string),
        region: None,
        force_path_style: None,
    }
}

fn store(server: &S3Server, prefix: Option<&str>) -> Result<S3Store> {
    let (id, secret) = server.credentials();
    S3Store::new(
        &spec(server, prefix),
        Some((id.to_string(), secret.to_string(), None)),
    )
    .map_err(|e| anyhow::anyhow!("{e}"))
}

/// Byte `i` of the test pattern (not constant, so a misplaced part changes the digest).
fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 20)) as u8
}

/// `mib` MiB of the pattern in 1 MiB chunks, made as they are read; with `fail_after`,
/// the stream fails after that many chunks.
fn blob_stream(mib: usize, fail_after: Option<usize>) -> ByteStream {
    futures::stream::iter(0..mib)
        .map(move |n| {
            if fail_after == Some(n) {
                return Err(std::io::Error::other("the snapshot writer failed"));
            }
            let chunk: Vec<u8> = (n * MIB..(n + 1) * MIB).map(pattern).collect();
            Ok(Bytes::from(chunk))
        })
        .boxed()
}

fn digest_of_pattern(mib: usize) -> String {
    let mut hasher = Sha256::new();
    for n in 0..mib {
        let chunk: Vec<u8> = (n * MIB..(n + 1) * MIB).map(pattern).collect();
        hasher.update(&chunk);
    }
    format!("sha256:{}", hex::encode(hasher.finalize()))
}

/// Reads a blob stream whole: its size and digest, and the largest chunk seen.
async fn drain(mut stream: BlobStream) -> Result<(u64, String), StoreError> {
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        size += chunk.len() as u64;
        hasher.update(&chunk);
    }
    Ok((size, format!("sha256:{}", hex::encode(hasher.finalize()))))
}

#[tokio::test]
async fn a_large_blob_round_trips_through_multipart_with_its_digest() -> Result<()> {
    let server = S3Server::start()?;
    let store = store(&server, Some("team/a"))?;
    let mib = 40;
    assert!(mib * MIB > 4 * PART_BYTES, "the blob spans several parts");
    let blob = store
        .put_blob("ns/snapshots/s1/blob.tar.zst", blob_stream(mib, None))
        .await?;
    let want = digest_of_pattern(mib);
    assert_eq!(blob.size, (mib * MIB) as u64);
    assert_eq!(blob.digest, want);
    assert_eq!(
        blob.uri,
        format!(
            "s3://{}/team/a/ns/snapshots/s1/blob.tar.zst",
            server.bucket()
        )
    );
    // The object is in the bucket, whole.
    let on_disk = server
        .bucket_dir()
        .join("team/a/ns/snapshots/s1/blob.tar.zst");
    assert_eq!(std::fs::metadata(&on_disk)?.len(), (mib * MIB) as u64);

    let read = drain(store.get_blob(&blob.uri, (mib * MIB) as u64).await?).await?;
    assert_eq!(read, ((mib * MIB) as u64, want));

    // Over the cap: refused before a byte is read.
    let refused = store.get_blob(&blob.uri, (mib * MIB) as u64 - 1).await;
    assert!(
        matches!(&refused, Err(StoreError::Invalid(m)) if m.contains("limit")),
        "{:?}",
        refused.err()
    );

    // Delete by prefix, then deleting again succeeds; the blob is gone.
    store
        .delete(&format!("s3://{}/team/a/ns/snapshots/", server.bucket()))
        .await?;
    store
        .delete(&format!("s3://{}/team/a/ns/snapshots/", server.bucket()))
        .await?;
    assert!(!on_disk.exists());
    assert!(matches!(
        store.get_blob(&blob.uri, u64::MAX).await.err(),
        Some(StoreError::Invalid(_))
    ));
    Ok(())
}

#[tokio::test]
async fn a_blob_that_fails_half_way_leaves_no_visible_object() -> Result<()> {
    let server = S3Server::start()?;
    let store = store(&server, None)?;
    // An earlier blob under the same key stays until a complete one replaces it.
    let earlier = store
        .put_blob("ns/snapshots/s2/blob", blob_stream(1, None))
        .await?;
    // Fails after 20 MiB: two parts were uploaded by then.
    let failed = store
        .put_blob("ns/snapshots/s2/blob", blob_stream(40, Some(20)))
        .await;
    assert!(
        matches!(&failed, Err(StoreError::Transport(m)) if m.contains("stream failed")),
        "{failed:?}"
    );
    let failed_new = store
        .put_blob("ns/snapshots/s2/other", blob_stream(40, Some(20)))
        .await;
    assert!(failed_new.is_err());
    assert!(matches!(
        store
            .get_blob(
                &format!("s3://{}/ns/snapshots/s2/other", server.bucket()),
                u64::MAX
            )
            .await
            .err(),
        Some(StoreError::Invalid(_))
    ));
    let names: Vec<String> = std::fs::read_dir(server.bucket_dir().join("ns/snapshots/s2"))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["blob"]);
    let read = drain(store.get_blob(&earlier.uri, u64::MAX).await?).await?;
    assert_eq!(read, (earlier.size, earlier.digest));
    Ok(())
}

fn input(uri: String) -> ArtifactInput {
    ArtifactInput {
        uri,
        path: "in/x".into(),
    }
}

#[tokio::test]
async fn imports_stay_inside_the_bucket_and_prefix() -> Result<()> {
    let server = S3Server::start()?;
    let store = store(&server, Some("team"))?;
    let bucket = server.bucket();
    std::fs::create_dir_all(server.bucket_dir().join("team/ns"))?;
    std::fs::write(server.bucket_dir().join("team/ns/in.txt"), b"inside")?;
    std::fs::write(server.bucket_dir().join("outside.txt"), b"outside")?;
    std::fs::create_dir_all(server.bucket_dir().join("teammate"))?;
    std::fs::write(server.bucket_dir().join("teammate/x.txt"), b"neighbour")?;

    let read = store
        .read_inputs(&[input(format!("s3://{bucket}/team/ns/in.txt"))])
        .await?;
    assert_eq!(read, vec![("in/x".to_string(), b"inside".to_vec())]);
    for uri in [
        format!("s3://{bucket}/outside.txt"),
        format!("s3://{bucket}/teammate/x.txt"),
        format!("s3://{bucket}/team/../outside.txt"),
        "s3://other-bucket/team/ns/in.txt".to_string(),
        "file:///etc/passwd".to_string(),
        "https://example.com/team/ns/in.txt".to_string(),
    ] {
        let refused = store.read_inputs(&[input(uri.clone())]).await;
        assert!(
            matches!(&refused, Err(StoreError::Invalid(m)) if m.len() < 512),
            "{uri}: {refused:?}"
        );
    }
    // A missing object fails the Run (Invalid), naming the URI.
    let missing = store
        .read_inputs(&[input(format!("s3://{bucket}/team/ns/nope"))])
        .await;
    assert!(
        matches!(&missing, Err(StoreError::Invalid(m)) if m.contains("team/ns/nope")),
        "{missing:?}"
    );
    // Inputs together are capped.
    std::fs::write(
        server.bucket_dir().join("team/ns/big"),
        vec![0u8; 1024 * 1024],
    )?;
    let over = store
        .read_inputs(&[
            input(format!("s3://{bucket}/team/ns/in.txt")),
            input(format!("s3://{bucket}/team/ns/big")),
        ])
        .await;
    assert!(
        matches!(&over, Err(StoreError::Invalid(m)) if m.contains("together")),
        "{over:?}"
    );
    Ok(())
}

fn write(dir: &Path, name: &str, content: &[u8]) -> Result<()> {
    let path = dir.join(name);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(path, content)?;
    Ok(())
}

#[tokio::test]
async fn export_writes_final_keys_then_the_marker_and_a_retry_replaces_the_set() -> Result<()> {
    let server = S3Server::start()?;
    let store = store(&server, Some("p"))?;
    let tmp = tempfile::tempdir()?;
    let artifacts = tmp.path().join("artifacts");
    write(&artifacts, "a.txt", b"abc")?;
    write(&artifacts, "out/old.bin", b"old")?;
    let run = RunKey {
        namespace: "default".into(),
        name: "s".into(),
        uid: "u1".into(),
    };
    let refs = store.export(&run, &artifacts).await?;
    let dir = server.bucket_dir().join("p/default/s-u1");
    assert_eq!(
        refs.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
        ["a.txt", "out/old.bin"]
    );
    assert_eq!(
        refs[0].uri,
        format!("s3://{}/p/default/s-u1/a.txt", server.bucket())
    );
    assert_eq!(
        refs[0].digest.as_deref(),
        Some("sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    );
    assert_eq!(std::fs::read(dir.join("a.txt"))?, b"abc");
    let marker = server
        .bucket_dir()
        .join(format!("p/default/s-u1{EXPORT_MARKER_SUFFIX}"));
    let listed: serde_json::Value = serde_json::from_slice(&std::fs::read(&marker)?)?;
    assert_eq!(listed["artifacts"][1]["name"], "out/old.bin");

    // What was exported is an artifact input of the store.
    let read = store.read_inputs(&[input(refs[0].uri.clone())]).await?;
    assert_eq!(read[0].1, b"abc");

    // A retry with another set: the stale object goes, the marker lists the new set.
    std::fs::remove_dir_all(artifacts.join("out"))?;
    write(&artifacts, "b.txt", b"bee")?;
    let again = store.export(&run, &artifacts).await?;
    assert_eq!(
        again.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
        ["a.txt", "b.txt"]
    );
    assert!(!dir.join("out/old.bin").exists());
    let listed: serde_json::Value = serde_json::from_slice(&std::fs::read(&marker)?)?;
    assert_eq!(listed["artifacts"].as_array().map(Vec::len), Some(2));

    // An artifact that can never be exported: Invalid, and no marker, no objects.
    let bad = RunKey {
        uid: "u2".into(),
        ..run.clone()
    };
    std::os::unix::fs::symlink("/etc/passwd", artifacts.join("zz-link"))?;
    let refused = store.export(&bad, &artifacts).await;
    assert!(
        matches!(refused, Err(StoreError::Invalid(_))),
        "{refused:?}"
    );
    assert!(!server.bucket_dir().join("p/default/s-u2").exists());
    assert!(
        !server
            .bucket_dir()
            .join(format!("p/default/s-u2{EXPORT_MARKER_SUFFIX}"))
            .exists()
    );
    Ok(())
}

#[tokio::test]
async fn misconfiguration_and_a_store_that_is_down_are_transport_failures_that_say_why()
-> Result<()> {
    let mut server = S3Server::start()?;
    let tmp = tempfile::tempdir()?;
    let artifacts = tmp.path().join("artifacts");
    write(&artifacts, "a.txt", b"abc")?;
    let run = RunKey {
        namespace: "default".into(),
        name: "s".into(),
        uid: "u".into(),
    };

    // Wrong secret: the bucket and the S3 code, never the secret.
    let wrong = S3Store::new(
        &spec(&server, None),
        Some((
            server.credentials().0.to_string(),
            "not-the-secret-value".to_string(),
            None,
        )),
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let refused = wrong.export(&run, &artifacts).await;
    let Err(StoreError::Transport(message)) = &refused else {
        anyhow::bail!("wrong credentials: {refused:?}");
    };
    assert!(message.contains(server.bucket()), "{message}");
    assert!(message.contains("SignatureDoesNotMatch"), "{message}");
    assert!(!message.contains("not-the-secret-value"), "{message}");

    // A bucket that does not exist.
    let (id, secret) = server.credentials();
    let missing = S3Store::new(
        &S3ArtifactStore {
            bucket: "no-such-bucket".into(),
            ..spec(&server, None)
        },
        Some((id.to_string(), secret.to_string(), None)),
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    // (s3s-fs creates a missing bucket's directory on a PUT; a DELETE, export's first
    // request, reports NoSuchBucket as S3 does.)
    let refused = missing.export(&run, &artifacts).await;
    let Err(StoreError::Transport(message)) = &refused else {
        anyhow::bail!("missing bucket: {refused:?}");
    };
    assert!(
        message.contains("no-such-bucket") && message.contains("NoSuchBucket"),
        "{message}"
    );

    // Down, then back: a transport failure, then the same export succeeds.
    let store = store(&server, None)?;
    server.stop();
    let down = store.export(&run, &artifacts).await;
    assert!(matches!(down, Err(StoreError::Transport(_))), "{down:?}");
    server.restart().context("restart the S3 server")?;
    let refs = store.export(&run, &artifacts).await?;
    assert_eq!(refs.len(), 1);
    Ok(())
}
