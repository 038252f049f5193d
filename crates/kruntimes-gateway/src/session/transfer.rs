//! Whole-file uploads and downloads of a session (docs/session-mode.md, "Large files"):
//! `PUT {base}/files?path=P` streams the request body into the workspace and
//! `GET {base}/files?path=P` (and `archive=tar` for a directory) streams a file out,
//! beside the 1 MiB operations of the queue.
//!
//! Nothing is held whole: the request body is cut into messages of at most
//! [`CHUNK_BYTES`] as it arrives and sent on runtimed's `UploadFile` stream, and a
//! download's messages are written out as they come. The caller is authenticated (by the
//! server's middleware) and authorized for the session (by [`super::session_upstream`])
//! before the first byte of the body is read; a declared `Content-Length` over the cap is
//! answered 413 then, without reading. The body must keep arriving: a pause longer than
//! [`IDLE_TIMEOUT`] ends the upload with 408, and a body that breaks or is cut off makes
//! the stream end without its `end` message, so the worker keeps nothing of it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use http_body_util::BodyExt as _;
use kruntimes_proto::runtime::v1 as rs;
use kruntimes_proto::runtimed::v1 as pb;

use super::{CALL_TIMEOUT, session_route};
use crate::error::HttpError;
use crate::route::{Call, RunPath, Upstream, grpc_error};
use crate::server::AppState;

/// The largest data message sent on (the worker's own bound).
pub const CHUNK_BYTES: usize = 1 << 20;
/// An upload's body, or a download's next chunk, may pause this long at most.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// The metadata key in which the worker says why a transfer failed.
const REASON_METADATA: &str = "x-kruntimes-reason";
/// Tells whether a downloaded file is executable (`true` or `false`).
pub const EXECUTABLE_HEADER: &str = "x-kruntimes-executable";

const UPLOAD: Call = Call {
    what: "the upload",
    mutation: true,
    busy: "the worker is busy",
};
const DOWNLOAD: Call = Call {
    what: "the download",
    mutation: false,
    busy: "the worker is busy",
};

/// The HTTP answer for a failed transfer: the worker's reason when it gave one (413
/// FileTooLarge, 507 InsufficientStorage, 400 InvalidArchive or PathEscapes, 409
/// IsADirectory, NotADirectory or DirectoryNotEmpty, 404 NotFound), else as any session
/// call ([`grpc_error`]).
pub(crate) fn transfer_error(status: &tonic::Status, call: Call) -> HttpError {
    let reason = status
        .metadata()
        .get(REASON_METADATA)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let detail = status.message().to_string();
    let (code, reason) = match reason {
        "FileTooLarge" => (StatusCode::PAYLOAD_TOO_LARGE, "FileTooLarge"),
        "InsufficientStorage" => (StatusCode::INSUFFICIENT_STORAGE, "InsufficientStorage"),
        "InvalidArchive" => (StatusCode::BAD_REQUEST, "InvalidArchive"),
        "PathEscapes" => (StatusCode::BAD_REQUEST, "PathEscapes"),
        "InvalidPath" => (StatusCode::BAD_REQUEST, "InvalidPath"),
        "IsADirectory" => (StatusCode::CONFLICT, "IsADirectory"),
        "NotADirectory" => (StatusCode::CONFLICT, "NotADirectory"),
        "DirectoryNotEmpty" => (StatusCode::CONFLICT, "DirectoryNotEmpty"),
        "NotFound" => (StatusCode::NOT_FOUND, "NotFound"),
        _ => return grpc_error(status, call),
    };
    HttpError::new(code, reason, detail)
}

/// What `PUT {base}/files` was asked.
pub(crate) struct UploadQuery {
    pub path: String,
    pub executable: bool,
    pub archive: bool,
}

/// The request body as runtimed's `UploadFile` messages after the header: data of at most
/// [`CHUNK_BYTES`], then `end`. A problem of the body (too large, too slow, broken) is kept
/// in `failure` and ends the messages without `end`.
struct Outgoing {
    body: Body,
    buffer: Vec<u8>,
    total: u64,
    max_bytes: u64,
    body_ended: bool,
    finished: bool,
    failure: Arc<Mutex<Option<HttpError>>>,
}

impl Outgoing {
    /// Records why the upload stops and ends the messages without `end`. The rest of a
    /// body that is still arriving is read and dropped first (bounded), so that the client
    /// can read the answer.
    async fn fail(&mut self, e: HttpError, drain: bool) -> Option<pb::UploadFileRequest> {
        self.finished = true;
        *self.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        if drain {
            crate::server::drain(std::mem::take(&mut self.body)).await;
        }
        None
    }

    fn data(&mut self, len: usize) -> Option<pb::UploadFileRequest> {
        let rest = self.buffer.split_off(len);
        let data = std::mem::replace(&mut self.buffer, rest);
        Some(pb::UploadFileRequest {
            part: Some(pb::upload_file_request::Part::Data(data)),
        })
    }

    async fn next(&mut self) -> Option<pb::UploadFileRequest> {
        loop {
            if self.finished {
                return None;
            }
            if self.buffer.len() >= CHUNK_BYTES {
                return self.data(CHUNK_BYTES);
            }
            if self.body_ended {
                if !self.buffer.is_empty() {
                    return self.data(self.buffer.len());
                }
                self.finished = true;
                return Some(pb::UploadFileRequest {
                    part: Some(pb::upload_file_request::Part::End(rs::UploadEnd {
                        total_bytes: self.total,
                    })),
                });
            }
            match tokio::time::timeout(IDLE_TIMEOUT, self.body.frame()).await {
                Err(_) => {
                    return self
                        .fail(
                            HttpError::new(
                        StatusCode::REQUEST_TIMEOUT,
                        "RequestTimeout",
                        format!(
                            "the upload's body paused for more than {} s; nothing was written",
                            IDLE_TIMEOUT.as_secs()
                        ),
                    ),
                            false,
                        )
                        .await;
                }
                Ok(None) => self.body_ended = true,
                Ok(Some(Err(e))) => {
                    tracing::debug!(error = %e, "an upload's body broke off");
                    return self
                        .fail(
                            HttpError::bad_request(
                                "the upload's body could not be read to its end; nothing was written",
                            ),
                            false,
                        )
                        .await;
                }
                Ok(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    self.total += data.len() as u64;
                    if self.total > self.max_bytes {
                        return self.fail(too_large(self.max_bytes), true).await;
                    }
                    self.buffer.extend_from_slice(&data);
                }
            }
        }
    }
}

fn too_large(max_bytes: u64) -> HttpError {
    HttpError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "FileTooLarge",
        format!(
            "the upload is larger than the limit of {max_bytes} bytes (--session-max-file-bytes); nothing was written"
        ),
    )
}

/// The declared `Content-Length`, if any.
fn content_length(headers: &HeaderMap) -> Result<Option<u64>, HttpError> {
    match headers.get(header::CONTENT_LENGTH) {
        None => Ok(None),
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Some)
            .ok_or_else(|| HttpError::bad_request("malformed Content-Length")),
    }
}

/// Streams `body` into the session (the caller is already authorized for it).
pub(crate) async fn upload(
    state: &AppState,
    upstream: &Upstream,
    path: &RunPath,
    query: UploadQuery,
    headers: &HeaderMap,
    body: Body,
    token: &str,
) -> Result<Response, HttpError> {
    let max_bytes = state.max_file_bytes;
    let size = content_length(headers)?;
    if size.is_some_and(|size| size > max_bytes) {
        crate::server::drain(body).await;
        return Err(too_large(max_bytes));
    }
    let failure = Arc::new(Mutex::new(None));
    let header = pb::UploadFileRequest {
        part: Some(pb::upload_file_request::Part::Header(
            pb::UploadFileHeader {
                route: Some(session_route(path)),
                path: query.path.clone(),
                executable: query.executable,
                archive: query.archive,
                size,
                max_bytes,
            },
        )),
    };
    let outgoing = Outgoing {
        body,
        buffer: Vec::with_capacity(CHUNK_BYTES),
        total: 0,
        max_bytes,
        body_ended: false,
        finished: false,
        failure: failure.clone(),
    };
    let rest = futures::stream::unfold(outgoing, |mut outgoing| async move {
        let message = outgoing.next().await?;
        Some((message, outgoing))
    });
    let messages = futures::StreamExt::chain(futures::stream::iter([header]), rest);
    let answer = upstream
        .client
        .clone()
        .upload_file(upstream.request(messages, token))
        .await;
    if let Some(e) = failure.lock().unwrap_or_else(|e| e.into_inner()).take() {
        return Err(e);
    }
    let done = answer
        .map_err(|status| {
            upstream.failed(state, &status);
            transfer_error(&status, UPLOAD)
        })?
        .into_inner();
    super::json(&serde_json::json!({
        "path": query.path,
        "sizeBytes": done.size_bytes,
        "files": done.files,
    }))
}

/// What a download found before its data: a directory to list instead, or the start of
/// the stream.
pub(crate) enum Download {
    Directory,
    Stream(Response),
}

/// Starts streaming `path` (with `archive`, a directory as a tar stream).
pub(crate) async fn download(
    state: &AppState,
    upstream: &Upstream,
    path: &RunPath,
    file: String,
    archive: bool,
    token: &str,
) -> Result<Download, HttpError> {
    let request = upstream.request(
        pb::DownloadFileRequest {
            route: Some(session_route(path)),
            path: file,
            archive,
        },
        token,
    );
    let failed = |status: tonic::Status| {
        upstream.failed(state, &status);
        transfer_error(&status, DOWNLOAD)
    };
    let mut client = upstream.client.clone();
    let start = async {
        let mut stream = client.download_file(request).await?.into_inner();
        let first = stream.message().await?;
        Ok::<_, tonic::Status>((first, stream))
    };
    let (first, stream) = tokio::time::timeout(CALL_TIMEOUT, start)
        .await
        .map_err(|_| {
            HttpError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "GatewayTimeout",
                format!(
                    "the worker did not start the download within {} s",
                    CALL_TIMEOUT.as_secs()
                ),
            )
        })?
        .map_err(failed)?;
    let Some(rs::DownloadSessionFileResponse {
        part: Some(rs::download_session_file_response::Part::Header(head)),
    }) = first
    else {
        return Err(HttpError::bad_gateway(
            "the worker's download did not start with its header",
        ));
    };
    if head.directory && !archive {
        return Ok(Download::Directory);
    }
    let chunks = futures::stream::unfold(Some(stream), |stream| async move {
        let mut stream = stream?;
        let next = match tokio::time::timeout(IDLE_TIMEOUT, stream.message()).await {
            Err(_) => Err(std::io::Error::other("the worker's download stalled")),
            Ok(Err(status)) => Err(std::io::Error::other(format!(
                "the download broke off: {}",
                status.message()
            ))),
            Ok(Ok(None)) => return None,
            Ok(Ok(Some(rs::DownloadSessionFileResponse {
                part: Some(rs::download_session_file_response::Part::Data(data)),
            }))) => Ok(Bytes::from(data)),
            Ok(Ok(Some(_))) => Err(std::io::Error::other("a download sent a second header")),
        };
        // A failure ends the body without its end (the connection is cut), so the client
        // can tell a broken download from a whole one; nothing is read after it.
        let keep = next.is_ok();
        Some((next, keep.then_some(stream)))
    });
    let body = Body::from_stream(chunks);
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    if archive {
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-tar"),
        );
    } else {
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        );
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(head.size_bytes));
        headers.insert(
            EXECUTABLE_HEADER,
            HeaderValue::from_static(if head.executable { "true" } else { "false" }),
        );
    }
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    Ok(Download::Stream(response))
}
