//! The ArtifactStore's S3 driver (`Runtime.spec.artifactStore.s3`), on `object_store`'s S3
//! client.
//!
//! **Keys.** Every object lives under the store's `prefix` in its `bucket`; its URI is
//! `s3://<bucket>/<prefix>/<key>`. A URI of another bucket, outside the prefix, of another
//! scheme, or with an empty, `.` or `..` segment is refused before any request.
//!
//! **Export** (all or nothing; S3 has no rename): the artifacts of Run
//! `<namespace>/<name>` (UID `<uid>`) are uploaded under their final keys
//! `<prefix>/<namespace>/<name>-<uid>/<artifact>`, and a small completion marker,
//! `<prefix>/<namespace>/<name>-<uid>.export.json` (the refs as JSON), is written **last**.
//! An export directory without its marker is incomplete, whatever objects it holds. An
//! export first deletes the marker, then uploads every artifact (overwriting what an
//! earlier attempt left), deletes objects of the directory that are not in the new set,
//! and writes the marker; so a retry after any failure, or after a lost status write, ends
//! with exactly the new set and its marker. The refs reach the Run's status only after the
//! marker is written.
//!
//! **Blobs** (snapshots): `put_blob` streams through a multipart upload of
//! [`PART_BYTES`] parts (one part in memory at a time), completed only once the stream
//! ends cleanly; S3 shows a multipart object only when it is completed, so a failure
//! part-way aborts the upload and leaves no object. A blob smaller than one part is one
//! `PUT`, equally atomic.
//!
//! **Errors.** A request that fails to reach the store, times out, or gets a server error
//! is [`StoreError::Transport`] (retry later). Refused credentials and a missing bucket are
//! Transport too (an operator can fix them without losing the Run's work), with a message
//! naming the bucket and the S3 error code (`AccessDenied`, `NoSuchBucket`, …); credentials
//! never appear in a message. A missing object, a URI outside the store or a blob over its
//! cap is [`StoreError::Invalid`].
//!
//! **Credentials** come from runtimed's environment only: `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY` and, optionally, `AWS_SESSION_TOKEN`. Without them the store
//! refuses every call (it never falls back to an instance-metadata endpoint).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::BytesMut;
use futures::{StreamExt, TryStreamExt};
use kruntimes_api::run::{ArtifactInput, ArtifactRef};
use kruntimes_api::runtime::S3ArtifactStore;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, ObjectStore, PutPayload, RetryConfig};
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;

use super::{
    ArtifactStore, BlobRef, BlobStream, ByteStream, Listed, Listing, MAX_ARTIFACT_BYTES,
    MAX_INPUT_BYTES, RunKey, SNAPSHOTS_SEGMENT, StoreError, bounded, check_key, collect,
    open_artifact,
};

/// The size of each part of a multipart upload (S3 takes 5 MiB to 5 GiB; 8 MiB keeps one
/// part in memory and a 1 GiB snapshot within 128 parts).
pub const PART_BYTES: usize = 8 * 1024 * 1024;
/// The name the completion marker of an export directory ends with.
pub const EXPORT_MARKER_SUFFIX: &str = ".export.json";
/// How long one request may take (a part of [`PART_BYTES`] included).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a connection may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a request is retried inside the client before the failure is returned to the
/// caller (who retries on its own schedule: the Run stays Finalizing).
const RETRY_TIMEOUT: Duration = Duration::from_secs(10);
/// S3 error codes that mean misconfiguration rather than a passing failure.
const MISCONFIGURED: [&str; 8] = [
    "AccessDenied",
    "AllAccessDisabled",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "NoSuchBucket",
    "ExpiredToken",
    "InvalidToken",
    "InvalidBucketName",
];

/// A store in an S3-protocol bucket.
#[derive(Debug, Clone)]
pub struct S3Store {
    client: Option<Arc<dyn ObjectStore>>,
    bucket: String,
    /// Without a trailing `/`; empty for none.
    prefix: String,
}

impl S3Store {
    /// The store `spec` names, with credentials from runtimed's environment. Missing
    /// credentials are not an error here: every call then fails with a message that says
    /// which variables to set (so the Run waits instead of failing).
    pub fn from_spec(spec: &S3ArtifactStore) -> Result<S3Store, StoreError> {
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let credentials = env("AWS_ACCESS_KEY_ID").zip(env("AWS_SECRET_ACCESS_KEY"));
        S3Store::new(
            spec,
            credentials.map(|(id, secret)| (id, secret, env("AWS_SESSION_TOKEN"))),
        )
    }

    /// The store `spec` names with explicit credentials (access key ID, secret, session
    /// token), `None` for none.
    pub fn new(
        spec: &S3ArtifactStore,
        credentials: Option<(String, String, Option<String>)>,
    ) -> Result<S3Store, StoreError> {
        kruntimes_api::admission::check_s3_endpoint(&spec.endpoint)
            .map_err(|e| StoreError::Invalid(format!("spec.artifactStore.s3.endpoint {e}")))?;
        let prefix = spec.prefix().to_string();
        if !kruntimes_api::admission::is_s3_prefix(&prefix) {
            return Err(StoreError::Invalid(format!(
                "spec.artifactStore.s3.prefix {:?} is not a valid key prefix",
                bounded(&prefix)
            )));
        }
        let client = match credentials {
            None => None,
            Some((id, secret, token)) => {
                let mut builder = AmazonS3Builder::new()
                    .with_endpoint(spec.endpoint.trim_end_matches('/'))
                    .with_bucket_name(&spec.bucket)
                    .with_region(spec.region())
                    .with_access_key_id(id)
                    .with_secret_access_key(secret)
                    .with_virtual_hosted_style_request(!spec.force_path_style())
                    .with_retry(RetryConfig {
                        max_retries: 3,
                        retry_timeout: RETRY_TIMEOUT,
                        ..RetryConfig::default()
                    })
                    .with_client_options(
                        // Plain HTTP only for a loopback endpoint (admission and
                        // `check_s3_endpoint` above refuse it elsewhere).
                        ClientOptions::new()
                            .with_allow_http(spec.endpoint.starts_with("http://"))
                            .with_timeout(REQUEST_TIMEOUT)
                            .with_connect_timeout(CONNECT_TIMEOUT),
                    );
                if let Some(token) = token {
                    builder = builder.with_token(token);
                }
                let built = builder.build().map_err(|e| {
                    StoreError::Invalid(format!(
                        "the S3 ArtifactStore (bucket {:?}) cannot be configured: {}",
                        spec.bucket,
                        bounded_error(&e)
                    ))
                })?;
                Some(Arc::new(built) as Arc<dyn ObjectStore>)
            }
        };
        Ok(S3Store {
            client,
            bucket: spec.bucket.clone(),
            prefix,
        })
    }

    fn client(&self) -> Result<&Arc<dyn ObjectStore>, StoreError> {
        self.client.as_ref().ok_or_else(|| {
            StoreError::Transport(format!(
                "runtimed has no credentials for the S3 ArtifactStore (bucket {:?}): set \
                 AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN, if \
                 any) in its environment",
                self.bucket
            ))
        })
    }

    /// The object path of `key` (relative to the prefix), checked.
    fn path_of(&self, key: &str) -> Result<ObjectPath, StoreError> {
        check_key(key)?;
        let full = if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}/{key}", self.prefix)
        };
        ObjectPath::parse(&full)
            .map_err(|e| StoreError::Invalid(format!("{:?} is not a valid key: {e}", bounded(key))))
    }

    /// The object path of an export directory's artifact (`name` empty: the directory),
    /// each segment encoded as object keys are.
    fn artifact_path(&self, run: &RunKey, name: &str) -> ObjectPath {
        ObjectPath::from_iter(
            self.prefix_parts()
                .chain([run.namespace.clone(), format!("{}-{}", run.name, run.uid)])
                .chain(
                    name.split('/')
                        .filter(|s| !s.is_empty())
                        .map(str::to_string),
                ),
        )
    }

    /// The completion marker of `run`'s export directory.
    fn export_marker(&self, run: &RunKey) -> ObjectPath {
        ObjectPath::from_iter(self.prefix_parts().chain([
            run.namespace.clone(),
            format!("{}-{}{EXPORT_MARKER_SUFFIX}", run.name, run.uid),
        ]))
    }

    fn prefix_parts(&self) -> impl Iterator<Item = String> + '_ {
        self.prefix
            .split('/')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
    }

    fn uri_of(&self, path: &ObjectPath) -> String {
        format!("s3://{}/{path}", self.bucket)
    }

    /// The object path an `s3://` URI names: of this bucket, beneath the prefix, every
    /// segment plain. `dir`: a trailing `/` is allowed (a prefix).
    fn parse_uri(&self, uri: &str, dir: bool) -> Result<ObjectPath, StoreError> {
        let refused = |why: &str| {
            StoreError::Invalid(format!(
                "{:?} is not an object of the Runtime's S3 ArtifactStore (bucket {:?}{}): {why}",
                bounded(uri),
                self.bucket,
                if self.prefix.is_empty() {
                    String::new()
                } else {
                    format!(", prefix {:?}", self.prefix)
                }
            ))
        };
        let rest = uri
            .strip_prefix("s3://")
            .ok_or_else(|| refused("not an s3:// URI"))?;
        let (bucket, key) = rest.split_once('/').ok_or_else(|| refused("no key"))?;
        if bucket != self.bucket {
            return Err(refused("another bucket"));
        }
        let key = if dir {
            key.strip_suffix('/').unwrap_or(key)
        } else {
            key
        };
        let relative = if self.prefix.is_empty() {
            key
        } else {
            key.strip_prefix(&self.prefix)
                .and_then(|k| k.strip_prefix('/'))
                .ok_or_else(|| refused("outside the store's prefix"))?
        };
        check_key(relative).map_err(|_| refused("not a plain key"))?;
        ObjectPath::parse(key).map_err(|_| refused("not a plain key"))
    }

    /// Maps a client error of `what` on the object `path`.
    fn error(&self, what: &str, path: &ObjectPath, e: object_store::Error) -> StoreError {
        let text = bounded_error(&e);
        if let Some(code) = s3_code(&e).filter(|c| MISCONFIGURED.contains(&c.as_str())) {
            return StoreError::Transport(format!(
                "the S3 ArtifactStore refused to {what} (bucket {:?}): {code}; check the \
                 bucket and runtimed's AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
                self.bucket
            ));
        }
        match e {
            object_store::Error::NotFound { .. } => StoreError::Invalid(format!(
                "{} does not exist in the S3 ArtifactStore",
                bounded(&self.uri_of(path))
            )),
            object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. } => StoreError::Transport(format!(
                "the S3 ArtifactStore refused to {what} (bucket {:?}): {text}",
                self.bucket
            )),
            _ => StoreError::Transport(format!(
                "cannot {what} in the S3 ArtifactStore (bucket {:?}): {text}",
                self.bucket
            )),
        }
    }

    /// Uploads `chunks` to `path` (multipart once it passes one part); its size and
    /// digest. `limit`: a stream past it is refused (and nothing is left).
    async fn upload(
        &self,
        path: &ObjectPath,
        mut chunks: ByteStream,
        limit: Option<(u64, &str)>,
    ) -> Result<(u64, String), StoreError> {
        let client = self.client()?;
        let mut hasher = Sha256::new();
        let mut size: u64 = 0;
        let mut buffer = BytesMut::new();
        let mut upload: Option<Box<dyn object_store::MultipartUpload>> = None;
        let streamed = async {
            while let Some(chunk) = chunks.next().await {
                let chunk = chunk
                    .map_err(|e| StoreError::Transport(format!("the blob's stream failed: {e}")))?;
                size += chunk.len() as u64;
                if let Some((limit, name)) = limit
                    && size > limit
                {
                    return Err(StoreError::Invalid(format!(
                        "artifact {name} grew past {limit} bytes"
                    )));
                }
                hasher.update(&chunk);
                buffer.extend_from_slice(&chunk);
                while buffer.len() >= PART_BYTES {
                    let part = buffer.split_to(PART_BYTES).freeze();
                    if upload.is_none() {
                        upload = Some(
                            client
                                .put_multipart(path)
                                .await
                                .map_err(|e| self.error("start an upload", path, e))?,
                        );
                    }
                    if let Some(upload) = upload.as_mut() {
                        upload
                            .put_part(PutPayload::from_bytes(part))
                            .await
                            .map_err(|e| self.error("upload a part", path, e))?;
                    }
                }
            }
            Ok(())
        }
        .await;
        let finished = match (streamed, upload.as_mut()) {
            (Err(e), _) => Err(e),
            (Ok(()), None) => client
                .put(path, PutPayload::from_bytes(buffer.freeze()))
                .await
                .map(drop)
                .map_err(|e| self.error("write an object", path, e)),
            (Ok(()), Some(upload)) => {
                let rest = buffer.freeze();
                let last = if rest.is_empty() {
                    Ok(())
                } else {
                    upload
                        .put_part(PutPayload::from_bytes(rest))
                        .await
                        .map_err(|e| self.error("upload a part", path, e))
                };
                match last {
                    Ok(()) => upload
                        .complete()
                        .await
                        .map(drop)
                        .map_err(|e| self.error("complete an upload", path, e)),
                    Err(e) => Err(e),
                }
            }
        };
        if finished.is_err()
            && let Some(upload) = upload.as_mut()
        {
            // The parts are discarded; an upload the store never hears abort of is
            // removed by the bucket's lifecycle rule for incomplete uploads.
            let _ = upload.abort().await;
        }
        finished.map(|()| (size, format!("sha256:{}", hex::encode(hasher.finalize()))))
    }

    /// Deletes every object whose key begins with `prefix/` (a directory), except `keep`.
    async fn delete_under(
        &self,
        prefix: &ObjectPath,
        keep: &[ObjectPath],
    ) -> Result<(), StoreError> {
        let client = self.client()?;
        let listed: Vec<_> = client
            .list(Some(prefix))
            .try_collect()
            .await
            .map_err(|e| self.error("list objects", prefix, e))?;
        for meta in listed {
            if keep.contains(&meta.location) {
                continue;
            }
            match client.delete(&meta.location).await {
                Ok(()) => {}
                Err(e) if absent(&e) => {}
                Err(e) => return Err(self.error("delete an object", &meta.location, e)),
            }
        }
        Ok(())
    }

    async fn export_files(
        &self,
        run: &RunKey,
        files: &[(String, std::path::PathBuf)],
        marker: &ObjectPath,
    ) -> Result<Vec<ArtifactRef>, StoreError> {
        let client = self.client()?;
        match client.delete(marker).await {
            Ok(()) => {}
            Err(e) if absent(&e) => {}
            Err(e) => return Err(self.error("delete an export marker", marker, e)),
        }
        let mut refs = Vec::with_capacity(files.len());
        let mut written = Vec::with_capacity(files.len());
        for (name, file) in files {
            let path = self.artifact_path(run, name);
            let (input, _) = open_artifact(file, name)?;
            let (size, digest) = self
                .upload(&path, file_stream(input), Some((MAX_ARTIFACT_BYTES, name)))
                .await?;
            refs.push(ArtifactRef {
                name: name.clone(),
                uri: self.uri_of(&path),
                size_bytes: i64::try_from(size).ok(),
                digest: Some(digest),
            });
            written.push(path);
        }
        // Objects of an earlier attempt that this one did not write.
        let dir = self.artifact_path(run, "");
        self.delete_under(&dir, &written).await?;
        let listing: Vec<_> = refs
            .iter()
            .map(|r| {
                serde_json::json!({
                    "name": r.name, "uri": r.uri, "sizeBytes": r.size_bytes, "digest": r.digest
                })
            })
            .collect();
        let body = serde_json::to_vec(&serde_json::json!({ "artifacts": listing }))
            .map_err(|e| StoreError::Transport(format!("cannot encode the export marker: {e}")))?;
        client
            .put(marker, PutPayload::from(body))
            .await
            .map_err(|e| self.error("write the export marker", marker, e))?;
        Ok(refs)
    }

    /// Reads the object at `path` whole, refusing one larger than `max_bytes`.
    async fn read_object(&self, path: &ObjectPath, max_bytes: u64) -> Result<Vec<u8>, StoreError> {
        let mut stream = self.get_path(path, max_bytes).await?;
        let mut all = Vec::new();
        while let Some(chunk) = stream.next().await {
            all.extend_from_slice(&chunk?);
        }
        Ok(all)
    }

    async fn get_path(&self, path: &ObjectPath, max_bytes: u64) -> Result<BlobStream, StoreError> {
        let client = self.client()?;
        let got = client
            .get(path)
            .await
            .map_err(|e| self.error("read an object", path, e))?;
        if got.meta.size > max_bytes {
            return Err(StoreError::Invalid(format!(
                "{} is {} bytes; the limit is {max_bytes}",
                bounded(&self.uri_of(path)),
                got.meta.size
            )));
        }
        let this = self.clone();
        let path = path.clone();
        let mut read: u64 = 0;
        let stream = got.into_stream().map(move |chunk| {
            let chunk = chunk.map_err(|e| this.error("read an object", &path, e))?;
            read += chunk.len() as u64;
            if read > max_bytes {
                return Err(StoreError::Invalid(format!(
                    "{} grew past the limit of {max_bytes} bytes",
                    bounded(&this.uri_of(&path))
                )));
            }
            Ok(chunk)
        });
        Ok(stream.boxed())
    }
}

/// A file read as a stream of chunks (of at most 1 MiB).
fn file_stream(file: std::fs::File) -> ByteStream {
    let file = tokio::fs::File::from_std(file);
    futures::stream::try_unfold(file, |mut file| async move {
        let mut buf = BytesMut::zeroed(1024 * 1024);
        let n = file.read(&mut buf).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.truncate(n);
        Ok(Some((buf.freeze(), file)))
    })
    .boxed()
}

/// Whether `e` says the object is not there (and not that the bucket is missing).
fn absent(e: &object_store::Error) -> bool {
    matches!(e, object_store::Error::NotFound { .. })
        && s3_code(e).is_none_or(|code| code != "NoSuchBucket")
}

/// An error's text with its causes, at most 512 characters.
fn bounded_error(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text.chars().take(512).collect()
}

/// The S3 error code (`<Code>…</Code>` of the error body) somewhere in `e`'s chain.
fn s3_code(e: &dyn std::error::Error) -> Option<String> {
    let mut current: Option<&dyn std::error::Error> = Some(e);
    while let Some(err) = current {
        let text = err.to_string();
        if let Some(start) = text.find("<Code>") {
            let rest = &text[start + "<Code>".len()..];
            if let Some(end) = rest.find("</Code>") {
                let code = &rest[..end];
                if !code.is_empty()
                    && code.len() <= 64
                    && code.bytes().all(|b| b.is_ascii_alphanumeric())
                {
                    return Some(code.to_string());
                }
            }
        }
        current = err.source();
    }
    None
}

#[async_trait]
impl ArtifactStore for S3Store {
    async fn export(&self, run: &RunKey, artifacts: &Path) -> Result<Vec<ArtifactRef>, StoreError> {
        let dir = artifacts.to_path_buf();
        let files = tokio::task::spawn_blocking(move || collect(&dir))
            .await
            .map_err(|e| StoreError::Transport(format!("the export task failed: {e}")))??;
        if files.is_empty() {
            return Ok(Vec::new());
        }
        let marker = self.export_marker(run);
        let exported = self.export_files(run, &files, &marker).await;
        if let Err(StoreError::Invalid(_)) = &exported {
            // The Run fails: what this attempt uploaded goes (best effort; no marker was
            // written, so it is incomplete either way).
            let _ = self.delete_under(&self.artifact_path(run, ""), &[]).await;
        }
        exported
    }

    async fn read_inputs(
        &self,
        inputs: &[ArtifactInput],
    ) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let paths = inputs
            .iter()
            .map(|input| self.parse_uri(&input.uri, false))
            .collect::<Result<Vec<_>, _>>()?;
        let mut total: u64 = 0;
        let mut read = Vec::with_capacity(inputs.len());
        for (input, path) in inputs.iter().zip(&paths) {
            let remaining = MAX_INPUT_BYTES.saturating_sub(total);
            let content = self
                .read_object(path, remaining)
                .await
                .map_err(|e| match e {
                    StoreError::Invalid(m)
                        if m.contains("the limit is") || m.contains("grew past") =>
                    {
                        StoreError::Invalid(format!(
                            "artifact inputs exceed {MAX_INPUT_BYTES} bytes together"
                        ))
                    }
                    other => other,
                })?;
            total += content.len() as u64;
            read.push((input.path.clone(), content));
        }
        Ok(read)
    }

    async fn put_blob(&self, key: &str, chunks: ByteStream) -> Result<BlobRef, StoreError> {
        let path = self.path_of(key)?;
        let (size, digest) = self.upload(&path, chunks, None).await?;
        Ok(BlobRef {
            uri: self.uri_of(&path),
            size,
            digest,
        })
    }

    async fn get_blob(&self, uri: &str, max_bytes: u64) -> Result<BlobStream, StoreError> {
        let path = self.parse_uri(uri, false)?;
        self.get_path(&path, max_bytes).await
    }

    async fn delete(&self, uri: &str) -> Result<(), StoreError> {
        if uri.ends_with('/') {
            let prefix = self.parse_uri(uri, true)?;
            return self.delete_under(&prefix, &[]).await;
        }
        let path = self.parse_uri(uri, false)?;
        match self.client()?.delete(&path).await {
            Ok(()) => Ok(()),
            Err(e) if absent(&e) => Ok(()),
            Err(e) => Err(self.error("delete an object", &path, e)),
        }
    }

    async fn list_snapshot_data(&self, max: usize) -> Result<Listing, StoreError> {
        let client = self.client()?;
        // Parsed as the keys of `path_of` are, so the listing names the same objects.
        let root = ObjectPath::parse(&self.prefix).map_err(|e| {
            StoreError::Invalid(format!(
                "the prefix {:?} is not a valid key: {e}",
                bounded(&self.prefix)
            ))
        })?;
        // The namespaces: the "directories" right under the prefix.
        let namespaces = client
            .list_with_delimiter(Some(&root))
            .await
            .map_err(|e| self.error("list the namespaces", &root, e))?
            .common_prefixes;
        let strip = root.parts().count();
        let mut listing = Listing::default();
        for namespace in namespaces {
            let snapshots = namespace.child(SNAPSHOTS_SEGMENT);
            let mut objects = client.list(Some(&snapshots));
            while let Some(meta) = objects.next().await {
                let meta = meta.map_err(|e| self.error("list snapshot data", &snapshots, e))?;
                if listing.objects.len() >= max {
                    listing.truncated = true;
                    return Ok(listing);
                }
                let key = meta
                    .location
                    .parts()
                    .skip(strip)
                    .map(|part| part.as_ref().to_string())
                    .collect::<Vec<_>>()
                    .join("/");
                listing.objects.push(Listed {
                    key,
                    uri: self.uri_of(&meta.location),
                    size: meta.size,
                    modified: meta.last_modified.into(),
                });
            }
        }
        Ok(listing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(prefix: Option<&str>) -> S3Store {
        let spec = S3ArtifactStore {
            endpoint: "http://127.0.0.1:9".into(),
            bucket: "bucket".into(),
            prefix: prefix.map(str::to_string),
            region: None,
            force_path_style: None,
        };
        S3Store::new(&spec, None).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn uris_stay_in_the_bucket_and_prefix() {
        let s = store(Some("team/a/"));
        assert_eq!(
            s.parse_uri("s3://bucket/team/a/ns/r-u/x.txt", false)
                .map(|p| p.to_string()),
            Ok("team/a/ns/r-u/x.txt".to_string())
        );
        for bad in [
            "s3://other/team/a/ns/x",
            "s3://bucket/team/b/ns/x",
            "s3://bucket/team/a",
            "s3://bucket/team/a/",
            "s3://bucket/team/a/../b/x",
            "s3://bucket/team/a//x",
            "s3://bucket/team/ab/x",
            "file:///team/a/x",
            "s3://bucket",
        ] {
            assert!(
                matches!(s.parse_uri(bad, false), Err(StoreError::Invalid(_))),
                "{bad}"
            );
        }
        let run = RunKey {
            namespace: "ns".into(),
            name: "r".into(),
            uid: "u".into(),
        };
        let path = s.artifact_path(&run, "out/50% b.txt");
        assert_eq!(path.to_string(), "team/a/ns/r-u/out/50%25 b.txt");
        // What export writes, import reads.
        assert_eq!(s.parse_uri(&s.uri_of(&path), false), Ok(path));
        assert_eq!(s.artifact_path(&run, "").to_string(), "team/a/ns/r-u");
    }

    #[tokio::test]
    async fn without_credentials_every_call_says_what_to_set() {
        let s = store(None);
        let refused = s.put_blob("ns/b", futures::stream::empty().boxed()).await;
        assert!(
            matches!(&refused, Err(StoreError::Transport(m)) if m.contains("AWS_ACCESS_KEY_ID") && m.contains("\"bucket\"")),
            "{refused:?}"
        );
    }

    #[test]
    fn s3_codes_are_read_from_error_bodies() {
        let e = std::io::Error::other(
            "Server returned non-2xx status code: 404 Not Found: <?xml version=\"1.0\"?><Error><Code>NoSuchBucket</Code></Error>",
        );
        assert_eq!(s3_code(&e).as_deref(), Some("NoSuchBucket"));
        assert_eq!(s3_code(&std::io::Error::other("connection refused")), None);
    }
}
