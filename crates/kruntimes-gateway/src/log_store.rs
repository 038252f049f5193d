//! The logs of a Run whose worker cannot serve them, read from the log store
//! ([`kruntimes_api::logstore`], [`crate::GatewayConfig::log_store`]).
//!
//! In standalone mode every worker writes the stdout and stderr of its task executions into
//! the data directory's log store, outside its disposable root, so they outlive the worker
//! and restarts of `kruntimes up`. [`crate::logs`] asks the Run's worker first; when that
//! worker is gone (its Pod no longer exists, or has another UID), or it no longer holds the
//! attempt asked for (an earlier attempt, forgotten when the Run was retried), the gateway
//! reads the attempt's file from the store itself. The caller has been authenticated and
//! authorized to `get` the Run before this module is reached, exactly as for a worker's
//! logs, and only the file of that Run's UID is ever opened.
//!
//! - The body is the file as it is when opened, at most its length then, in chunks of
//!   [`CHUNK_BYTES`]; `follow` ends there too (no worker writes to it any more).
//! - A finished Run whose file is not in the store is 410 `LogsGone`: its logs were removed
//!   by the store's retention (its worker, alive or not, no longer has them either), or,
//!   without a store (a cluster), went with the worker.
//! - Anything else keeps the worker's answer (409 `WorkerGone` for a Run that has not
//!   ended, 404 for an attempt that no one holds).

use std::path::Path;

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::response::Response;
use futures::StreamExt;
use kruntimes_api::{Run, lifecycle, logstore};
use kruntimes_proto::runtime::v1::LogStream;
use kube::ResourceExt;
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::error::HttpError;
use crate::logs::octet_stream;
use crate::server::AppState;

/// One chunk of a stored log is at most 64 KiB.
pub const CHUNK_BYTES: usize = 64 * 1024;

/// The reason of a 410: the logs existed and are gone.
pub const LOGS_GONE: &str = "LogsGone";

/// Serves `stream` of `attempt` (0: the current one) of `run` from the log store, or
/// answers why it cannot. `worker` is the answer of the worker path: 409 `WorkerGone`,
/// or 404 when the worker does not hold the attempt.
pub(crate) async fn serve(
    state: &AppState,
    run: &Run,
    stream: LogStream,
    attempt: u32,
    worker: HttpError,
) -> Result<Response, HttpError> {
    let namespace = run.namespace().unwrap_or_default();
    let name = run.name_any();
    let uid = run.uid().unwrap_or_default();
    let current = u32::try_from(lifecycle::attempt(run.status.as_ref())).unwrap_or(1);
    let attempt = if attempt == 0 { current } else { attempt };
    // Only a finished Run's logs are known to be final: a Run that has not ended may yet
    // run again elsewhere, and a missing file then says nothing; nor does one of an
    // attempt that never was.
    let ended = run.phase().is_terminal() && attempt <= current;
    let Some(store) = &state.log_store else {
        if ended && worker.reason() == "WorkerGone" {
            return Err(gone(format!(
                "the logs of Run {namespace}/{name} are gone: {}; this gateway keeps no log \
                 store (in a cluster, logs live on the worker and go with its Pod)",
                worker.message()
            )));
        }
        return Err(worker);
    };
    let file = match stream {
        LogStream::Stderr => logstore::STDERR_FILE,
        LogStream::Stdout | LogStream::Unspecified => logstore::STDOUT_FILE,
    };
    let Some(path) = logstore::attempt_dir(store, &uid, attempt).map(|dir| dir.join(file)) else {
        return Err(worker);
    };
    match open(&path).await {
        Ok(Some((reader, len))) => {
            tracing::debug!(
                namespace,
                run = name,
                attempt,
                bytes = len,
                "serving Run logs from the log store"
            );
            Ok(octet_stream(body(state, reader)))
        }
        Ok(None) if ended => Err(gone(format!(
            "the logs of attempt {attempt} of Run {namespace}/{name} are gone: the log store \
             no longer holds them (removed when the store outgrew its cap, oldest finished \
             Runs first)"
        ))),
        Ok(None) => Err(worker),
        Err(error) => {
            tracing::warn!(path = %path.display(), error = %error, "cannot read the log store");
            Err(HttpError::internal(format!(
                "the gateway cannot read the stored logs of Run {namespace}/{name}"
            )))
        }
    }
}

fn gone(message: String) -> HttpError {
    HttpError::new(StatusCode::GONE, LOGS_GONE, message)
}

/// The file at `path`, limited to its length now, and that length; `None` when it does
/// not exist.
async fn open(path: &Path) -> std::io::Result<Option<(tokio::io::Take<tokio::fs::File>, u64)>> {
    let file = match tokio::fs::File::open(path).await {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let metadata = file.metadata().await?;
    if !metadata.is_file() {
        return Ok(None);
    }
    let len = metadata.len();
    Ok(Some((file.take(len), len)))
}

/// The chunks of `reader`; the body ends abnormally when the read fails or the gateway
/// shuts down, as a worker's stream does.
fn body<R: AsyncRead + Unpin + Send + 'static>(state: &AppState, reader: R) -> Body {
    let shutdown = state.shutdown.clone();
    let metrics = state.metrics.clone();
    let chunks = futures::stream::unfold((reader, false), move |(mut reader, ended)| {
        let shutdown = shutdown.clone();
        let metrics = metrics.clone();
        async move {
            if ended {
                return None;
            }
            if *shutdown.borrow() {
                let error = std::io::Error::other("the gateway is shutting down");
                return Some((Err(error), (reader, true)));
            }
            let mut chunk = vec![0u8; CHUNK_BYTES];
            match reader.read(&mut chunk).await {
                Ok(0) => None,
                Ok(n) => {
                    chunk.truncate(n);
                    metrics.log_bytes.inc_by(n as u64);
                    Some((Ok(Bytes::from(chunk)), (reader, false)))
                }
                Err(error) => {
                    metrics.log_streams_failed.inc();
                    Some((Err(error), (reader, true)))
                }
            }
        }
    });
    Body::from_stream(chunks.boxed())
}
