//! Whole files and directories in and out of a sandbox, streamed (docs/session-mode.md,
//! "Large files"): `PUT {endpoint}/files?path=P` and `GET {endpoint}/files?path=P`, with
//! `archive=tar` for a directory. Nothing is held whole: a file is read and written in
//! chunks, a directory is packed into (or unpacked from) a tar stream on a blocking thread
//! as the bytes flow.
//!
//! A download into a local path is atomic as the sandbox's uploads are: a file is written
//! to a temporary beside the target and renamed into place once every byte announced
//! arrived; a directory is unpacked into a new (or empty) directory, refusing entries with
//! an absolute name, a `..`, a link out of it or a device node.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, TryStreamExt};
use http_body_util::{BodyExt, Limited, StreamBody};
use hyper::body::Frame;
use kube::client::ConfigExt as _;
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tower::{ServiceBuilder, ServiceExt};

use super::{Sandbox, SandboxError, Use, query_value};
use crate::endpoint::bounded;
use crate::endpoint::{endpoint_config, error_answer};

/// A pause longer than this in a download's bytes fails it.
pub const TRANSFER_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Chunks read from a local file or written into a tar stream.
const CHUNK_BYTES: usize = 256 * 1024;
/// Chunks buffered between a blocking tar thread and the network.
const CHANNEL_CHUNKS: usize = 8;
/// The largest answer of an upload (its JSON summary) or error read.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// What an upload wrote.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Uploaded {
    /// The sandbox path written.
    pub path: String,
    /// The bytes sent (a tar stream's length for a directory).
    pub size_bytes: u64,
    /// Regular files written.
    pub files: u64,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn local_error(what: &str, path: &Path, e: impl std::fmt::Display) -> SandboxError {
    SandboxError::BadRequest {
        problem: bounded(&format!("{what} {}: {e}", path.display())),
    }
}

impl Sandbox {
    /// `PUT {endpoint}/files?{query}` with `body`, streamed.
    async fn put<S>(
        &self,
        query: String,
        body: S,
        size: Option<u64>,
    ) -> Result<Uploaded, SandboxError>
    where
        S: Stream<Item = Result<Bytes, BoxError>> + Send + 'static,
    {
        let (target, _) = self.target(Use::Session).await?;
        let url = format!("{}/files?{query}", target.url);
        let config = endpoint_config(&self.config, &self.name, &target)
            .map_err(SandboxError::from_endpoint)?;
        let client_error = |source: kube::Error| SandboxError::Client {
            url: target.origin.clone(),
            source,
        };
        let connector = config.rustls_https_connector().map_err(client_error)?;
        let auth = config.auth_layer().map_err(client_error)?;
        let http =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(connector);
        let service = ServiceBuilder::new()
            .layer(config.base_uri_layer())
            .option_layer(auth)
            .map_err(BoxError::from)
            .service(http);
        let body = StreamBody::new(Box::pin(body.map_ok(Frame::data)));
        let mut request = http::Request::builder()
            .method(http::Method::PUT)
            .uri(format!("{}/files?{query}", target.path))
            .header(http::header::CONTENT_TYPE, "application/octet-stream");
        if let Some(size) = size {
            request = request.header(http::header::CONTENT_LENGTH, size);
        }
        let request = request.body(body).map_err(|e| SandboxError::BadRequest {
            problem: format!("cannot build the request: {e}"),
        })?;
        let response =
            service
                .oneshot(request)
                .await
                .map_err(|source| SandboxError::Transport {
                    url: url.clone(),
                    mutation: true,
                    source,
                })?;
        let status = response.status().as_u16();
        let answer = tokio::time::timeout(
            super::CALL_TIMEOUT,
            Limited::new(response.into_body(), MAX_ANSWER_BYTES).collect(),
        )
        .await
        .map_err(|_| SandboxError::NoAnswer {
            url: url.clone(),
            limit: super::CALL_TIMEOUT,
        })?
        .map_err(|source| SandboxError::Transport {
            url: url.clone(),
            mutation: true,
            source,
        })?
        .to_bytes();
        if status != 200 {
            let (reason, message) = error_answer(status, &answer);
            return Err(SandboxError::Http {
                status,
                reason,
                message,
            });
        }
        self.json("the upload's answer", &answer)
    }

    /// Streams `reader` into the sandbox file `path` (created or replaced, atomically: the
    /// old file stays until every byte arrived). `size`, when known, is announced
    /// (`Content-Length`), so that a file over the gateway's cap is refused before a byte
    /// is sent.
    ///
    /// Errors: [`SandboxError::Http`] 413 `FileTooLarge` over the cap, 507
    /// `InsufficientStorage` when the workspace's disk is full, 409 `IsADirectory`, 404 for
    /// a missing parent directory, 400 for a path that leaves the workspace.
    pub async fn upload<R>(
        &self,
        path: &str,
        reader: R,
        size: Option<u64>,
        executable: bool,
    ) -> Result<Uploaded, SandboxError>
    where
        R: AsyncRead + Send + 'static,
    {
        let query = format!(
            "path={}{}",
            query_value(path),
            if executable { "&executable=true" } else { "" }
        );
        let body = tokio_util::io::ReaderStream::with_capacity(reader, CHUNK_BYTES)
            .map_err(BoxError::from);
        self.put(query, body, size).await
    }

    /// Uploads the local file `local` to `path`, executable when it is.
    pub async fn upload_file(&self, local: &Path, path: &str) -> Result<Uploaded, SandboxError> {
        use std::os::unix::fs::PermissionsExt as _;
        let file = tokio::fs::File::open(local)
            .await
            .map_err(|e| local_error("cannot open", local, e))?;
        let meta = file
            .metadata()
            .await
            .map_err(|e| local_error("cannot read", local, e))?;
        if !meta.is_file() {
            return Err(local_error("cannot upload", local, "not a regular file"));
        }
        let executable = meta.permissions().mode() & 0o111 != 0;
        self.upload(path, file, Some(meta.len()), executable).await
    }

    /// Uploads the local directory `local` as a tar stream, extracted into `path` in the
    /// sandbox (which must not exist, or be an empty directory). Symlinks are sent as
    /// links; what is neither a file, a directory nor a symlink is left out.
    ///
    /// Errors: as [`Sandbox::upload`], plus 409 `DirectoryNotEmpty`, 400 `InvalidArchive`.
    pub async fn upload_dir(&self, local: &Path, path: &str) -> Result<Uploaded, SandboxError> {
        let meta = tokio::fs::metadata(local)
            .await
            .map_err(|e| local_error("cannot read", local, e))?;
        if !meta.is_dir() {
            return Err(local_error("cannot upload", local, "not a directory"));
        }
        let (tx, rx) = mpsc::channel::<Result<Bytes, BoxError>>(CHANNEL_CHUNKS);
        let root = local.to_path_buf();
        tokio::task::spawn_blocking(move || {
            let mut out = ChannelWriter {
                tx: tx.clone(),
                buffer: Vec::with_capacity(CHUNK_BYTES),
            };
            let result = (|| {
                let mut builder = tar::Builder::new(&mut out);
                builder.follow_symlinks(false);
                builder.mode(tar::HeaderMode::Deterministic);
                builder.append_dir_all(".", &root)?;
                builder.finish()?;
                drop(builder);
                std::io::Write::flush(&mut out)
            })();
            if let Err(e) = result {
                // The body fails: the gateway sees no end, the sandbox keeps nothing.
                let _ = tx.blocking_send(Err(Box::new(e)));
            }
        });
        let body = tokio_stream::wrappers::ReceiverStream::new(rx);
        self.put(
            format!("path={}&archive=tar", query_value(path)),
            body,
            None,
        )
        .await
    }

    /// Streams a tar stream from `reader` (ustar, GNU or pax), extracted into `path` in
    /// the sandbox (a new or empty directory); `size` is announced when known. Every entry
    /// is checked before it is written; one that would leave `path` (an absolute name,
    /// `..`, a link out) or a device fails the whole upload, which leaves nothing.
    pub async fn upload_tar<R>(
        &self,
        path: &str,
        reader: R,
        size: Option<u64>,
    ) -> Result<Uploaded, SandboxError>
    where
        R: AsyncRead + Send + 'static,
    {
        let body = tokio_util::io::ReaderStream::with_capacity(reader, CHUNK_BYTES)
            .map_err(BoxError::from);
        self.put(
            format!("path={}&archive=tar", query_value(path)),
            body,
            size,
        )
        .await
    }

    /// `GET {endpoint}/files?{query}`: the response, checked to be 200.
    async fn get_stream(
        &self,
        query: String,
    ) -> Result<(http::response::Parts, kube::client::Body, String), SandboxError> {
        let (target, client) = self.target(Use::Read).await?;
        let url = format!("{}/files?{query}", target.url);
        let request = http::Request::builder()
            .method(http::Method::GET)
            .uri(format!("{}/files?{query}", target.path))
            .body(kube::client::Body::empty())
            .map_err(|e| SandboxError::BadRequest {
                problem: format!("cannot build the request: {e}"),
            })?;
        let response = tokio::time::timeout(
            super::CALL_TIMEOUT,
            super::send(&client, request, &url, false),
        )
        .await
        .map_err(|_| SandboxError::NoAnswer {
            url: url.clone(),
            limit: super::CALL_TIMEOUT,
        })??;
        let (parts, body) = response.into_parts();
        if parts.status != http::StatusCode::OK {
            let status = parts.status.as_u16();
            let bytes = tokio::time::timeout(
                super::CALL_TIMEOUT,
                Limited::new(body, MAX_ANSWER_BYTES).collect(),
            )
            .await
            .ok()
            .and_then(Result::ok)
            .map(|c| c.to_bytes())
            .unwrap_or_default();
            let (reason, message) = error_answer(status, &bytes);
            return Err(SandboxError::Http {
                status,
                reason,
                message,
            });
        }
        Ok((parts, body, url))
    }

    /// Streams the sandbox file `path` into `writer`; the bytes written. Fails (with
    /// whatever was written left to the caller) when the download breaks off or pauses for
    /// more than [`TRANSFER_IDLE_TIMEOUT`].
    ///
    /// Errors: [`SandboxError::IsADirectory`] for a directory; [`SandboxError::Http`] 404
    /// for no such file, 400 for a path that leaves the workspace.
    pub async fn download<W>(&self, path: &str, writer: &mut W) -> Result<u64, SandboxError>
    where
        W: AsyncWrite + Unpin,
    {
        if path.is_empty() {
            return Err(SandboxError::IsADirectory {
                path: "the workspace".to_string(),
            });
        }
        let (parts, body, url) = self
            .get_stream(format!("path={}", query_value(path)))
            .await?;
        let is_json = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/json"));
        if is_json {
            return Err(SandboxError::IsADirectory {
                path: path.to_string(),
            });
        }
        let announced = parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let written = copy_body(body, writer, &url).await?;
        if announced.is_some_and(|n| n != written) {
            return Err(SandboxError::Transport {
                url,
                mutation: false,
                source: format!(
                    "the download broke off after {written} of {} bytes",
                    announced.unwrap_or_default()
                )
                .into(),
            });
        }
        Ok(written)
    }

    /// Downloads the sandbox file `path` to the local file `local`, atomically (a
    /// temporary beside it, renamed into place when complete), executable when it is in
    /// the sandbox.
    pub async fn download_file(&self, path: &str, local: &Path) -> Result<u64, SandboxError> {
        let temp = temporary_beside(local);
        let mut file = tokio::fs::File::create(&temp)
            .await
            .map_err(|e| local_error("cannot create", &temp, e))?;
        let result = self.download(path, &mut file).await;
        let finished = async {
            let written = result?;
            file.flush()
                .await
                .map_err(|e| local_error("cannot write", &temp, e))?;
            file.sync_all()
                .await
                .map_err(|e| local_error("cannot write", &temp, e))?;
            drop(file);
            tokio::fs::rename(&temp, local)
                .await
                .map_err(|e| local_error("cannot rename into", local, e))?;
            Ok::<_, SandboxError>(written)
        }
        .await;
        if finished.is_err() {
            let _ = tokio::fs::remove_file(&temp).await;
        }
        finished
    }

    /// Downloads the sandbox directory `path` ("" for the workspace) as a tar stream and
    /// unpacks it into the local directory `local` (created; it must not exist or be
    /// empty); the bytes of the stream. Entries that would leave `local` (an absolute name,
    /// `..`, a link pointing out) and devices are refused.
    pub async fn download_dir(&self, path: &str, local: &Path) -> Result<u64, SandboxError> {
        match std::fs::read_dir(local) {
            Ok(mut entries) => {
                if entries.next().is_some() {
                    return Err(local_error("cannot unpack into", local, "not empty"));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir_all(local)
                    .map_err(|e| local_error("cannot create", local, e))?;
            }
            Err(e) => return Err(local_error("cannot read", local, e)),
        }
        let (_, body, url) = self
            .get_stream(format!("path={}&archive=tar", query_value(path)))
            .await?;
        let (tx, rx) = mpsc::channel::<Bytes>(CHANNEL_CHUNKS);
        let dest = local.to_path_buf();
        let unpack = tokio::task::spawn_blocking(move || unpack(&dest, rx));
        let copied = copy_to_channel(body, tx, &url).await;
        let unpacked = unpack
            .await
            .map_err(|e| local_error("cannot unpack into", local, e))?;
        let bytes = copied?;
        unpacked.map_err(|e| local_error("cannot unpack into", local, e))?;
        Ok(bytes)
    }
}

fn temporary_beside(local: &Path) -> PathBuf {
    let name = local
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "download".to_string());
    local.with_file_name(format!(".{name}.krt-part-{:08x}", std::process::id()))
}

/// Copies a response body into `writer`, each frame within [`TRANSFER_IDLE_TIMEOUT`].
async fn copy_body<W: AsyncWrite + Unpin>(
    mut body: kube::client::Body,
    writer: &mut W,
    url: &str,
) -> Result<u64, SandboxError> {
    let broken = |source: BoxError| SandboxError::Transport {
        url: url.to_string(),
        mutation: false,
        source,
    };
    let mut written = 0u64;
    loop {
        let frame = tokio::time::timeout(TRANSFER_IDLE_TIMEOUT, body.frame())
            .await
            .map_err(|_| SandboxError::NoAnswer {
                url: url.to_string(),
                limit: TRANSFER_IDLE_TIMEOUT,
            })?;
        let Some(frame) = frame else {
            break;
        };
        let frame = frame.map_err(|e| broken(Box::new(e)))?;
        if let Ok(data) = frame.into_data() {
            writer
                .write_all(&data)
                .await
                .map_err(|e| broken(Box::new(e)))?;
            written += data.len() as u64;
        }
    }
    writer.flush().await.map_err(|e| broken(Box::new(e)))?;
    Ok(written)
}

/// A `Write` that sends its bytes, in chunks, into the channel of a request body.
struct ChannelWriter {
    tx: mpsc::Sender<Result<Bytes, BoxError>>,
    buffer: Vec<u8>,
}

impl std::io::Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.buffer.extend_from_slice(buf);
        if self.buffer.len() >= CHUNK_BYTES {
            self.flush()?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(
            &mut self.buffer,
            Vec::with_capacity(CHUNK_BYTES),
        ));
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::BrokenPipe))
    }
}

/// Sends a response body's chunks to a blocking unpacker, each frame within
/// [`TRANSFER_IDLE_TIMEOUT`]; the bytes sent.
async fn copy_to_channel(
    mut body: kube::client::Body,
    tx: mpsc::Sender<Bytes>,
    url: &str,
) -> Result<u64, SandboxError> {
    let mut sent = 0u64;
    loop {
        let frame = tokio::time::timeout(TRANSFER_IDLE_TIMEOUT, body.frame())
            .await
            .map_err(|_| SandboxError::NoAnswer {
                url: url.to_string(),
                limit: TRANSFER_IDLE_TIMEOUT,
            })?;
        let Some(frame) = frame else {
            return Ok(sent);
        };
        let frame = frame.map_err(|e| SandboxError::Transport {
            url: url.to_string(),
            mutation: false,
            source: Box::new(e),
        })?;
        if let Ok(data) = frame.into_data() {
            sent += data.len() as u64;
            if tx.send(data).await.is_err() {
                // The unpacker stopped: its error says why.
                return Ok(sent);
            }
        }
    }
}

/// Reads chunks from a channel as one stream.
struct ChannelReader {
    rx: mpsc::Receiver<Bytes>,
    current: Bytes,
}

impl std::io::Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            match self.rx.blocking_recv() {
                Some(chunk) => self.current = chunk,
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current[..n]);
        self.current = self.current.slice(n..);
        Ok(n)
    }
}

/// Whether a symlink's target, at the entry `path` (relative), stays beneath the root.
fn link_stays_inside(path: &Path, target: &Path) -> bool {
    use std::path::Component;
    if target.is_absolute() {
        return false;
    }
    let mut depth: i64 = path.components().count() as i64 - 1;
    let mut seen_name = false;
    for part in target.components() {
        match part {
            Component::ParentDir if seen_name => return false,
            Component::ParentDir => depth -= 1,
            Component::Normal(_) => seen_name = true,
            Component::CurDir => {}
            _ => return false,
        }
        if depth < 0 {
            return false;
        }
    }
    true
}

/// Unpacks a tar stream into `dest`, refusing entries that would leave it.
fn unpack(dest: &Path, rx: mpsc::Receiver<Bytes>) -> std::io::Result<()> {
    use tar::EntryType;
    let reader = ChannelReader {
        rx,
        current: Bytes::new(),
    };
    let mut archive = tar::Archive::new(reader);
    archive.set_preserve_permissions(false);
    archive.set_overwrite(true);
    let refuse = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.into_owned();
        let kind = entry.header().entry_type();
        match kind {
            EntryType::Regular | EntryType::Continuous | EntryType::Directory => {}
            EntryType::Symlink => {
                let target = entry
                    .link_name()?
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                if !link_stays_inside(&path, &target) {
                    return Err(refuse(format!(
                        "the archive's symlink {} points out of it",
                        path.display()
                    )));
                }
            }
            EntryType::Link => {
                let target = entry
                    .link_name()?
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                if !link_stays_inside(Path::new("x"), &target) {
                    return Err(refuse(format!(
                        "the archive's hard link {} points out of it",
                        path.display()
                    )));
                }
            }
            EntryType::XGlobalHeader | EntryType::XHeader => continue,
            _ => {
                return Err(refuse(format!(
                    "the archive's entry {} is neither a file, a directory nor a link",
                    path.display()
                )));
            }
        }
        // unpack_in refuses absolute names and `..`, and a parent that resolves outside.
        if !entry.unpack_in(dest)? {
            return Err(refuse(format!(
                "the archive's entry {} would leave the directory",
                path.display()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_must_stay_inside() {
        assert!(link_stays_inside(Path::new("a"), Path::new("b")));
        assert!(link_stays_inside(Path::new("d/a"), Path::new("../b")));
        assert!(!link_stays_inside(Path::new("a"), Path::new("../b")));
        assert!(!link_stays_inside(Path::new("a"), Path::new("/etc")));
        assert!(!link_stays_inside(
            Path::new("d/a"),
            Path::new("x/../../..")
        ));
    }
}
