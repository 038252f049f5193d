//! The gRPC `SessionRuntime` service over the session table.
//!
//! Owns the translation between protobuf messages and [`crate::sessions`] types, and the
//! one place where session errors become gRPC status codes: a caller's mistake is echoed
//! with a precise message, an internal failure is logged with its whole chain and answered
//! with a generic INTERNAL. It holds no session state of its own, and it never logs a
//! page token, command text, stdin or file contents.
#![forbid(unsafe_code)]

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use kruntimes_proto::runtime::v1 as pb;
use pb::session_runtime_server::SessionRuntime;
use prost::Message;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::ids::ExecutionKey;
use crate::sessions::files::FsReason;
use crate::sessions::snapshot::{self, CapturePart, EntryKind, ManifestEntry};
use crate::sessions::transfer::{self, TransferError, TransferReason};
use crate::sessions::{
    CommandSpec, Completion, OperationEvent, OperationKind, OperationSpec, OperationState,
    OutputStream, RegisterSpec, SessionError, SessionSnapshot, SessionState, Sessions,
};
use crate::tasks::executor;
use crate::tasks::service::{duration, env_pairs, execution_id, internal, key, source_files};

/// A longer grace period asked of CloseSession is cut to this.
pub const MAX_CLOSE_GRACE: Duration = Duration::from_secs(300);

/// Implements `SessionRuntime` over one session table.
#[derive(Clone)]
pub struct SessionService {
    sessions: Arc<Sessions>,
}

impl SessionService {
    pub fn new(sessions: Arc<Sessions>) -> Self {
        Self { sessions }
    }
}

impl From<SessionError> for Status {
    fn from(e: SessionError) -> Self {
        match &e {
            SessionError::Request(_)
            | SessionError::Path(_)
            | SessionError::Token(_)
            | SessionError::Invalid { .. } => Status::invalid_argument(e.to_string()),
            SessionError::Conflict { .. } => Status::already_exists(e.to_string()),
            SessionError::StaleAttempt { .. }
            | SessionError::NotReady { .. }
            | SessionError::WorkspaceFailed { .. } => Status::failed_precondition(e.to_string()),
            SessionError::NotFound { .. } => Status::not_found(e.to_string()),
            SessionError::Busy { .. } => Status::resource_exhausted(e.to_string()),
            SessionError::Refused { reason, .. } => {
                let mut status = Status::failed_precondition(e.to_string());
                status.metadata_mut().insert(
                    REASON_METADATA,
                    tonic::metadata::MetadataValue::from_static(reason),
                );
                status
            }
            SessionError::ShuttingDown => Status::unavailable(e.to_string()),
            SessionError::File(file) => match file.reason {
                // A symlink that escapes is refused like a lexically bad path.
                FsReason::PathEscapes
                | FsReason::InvalidPath
                | FsReason::NotADirectory
                | FsReason::IsADirectory => Status::invalid_argument(e.to_string()),
                FsReason::NotFound => Status::not_found(e.to_string()),
                FsReason::FileTooLarge => Status::out_of_range(e.to_string()),
                FsReason::AlreadyExists
                | FsReason::DirectoryNotEmpty
                | FsReason::Stopped
                | FsReason::IoError => internal(&e, "file call"),
            },
            SessionError::Transfer(t) => transfer_status(t),
            SessionError::Workspace { .. }
            | SessionError::Remove { .. }
            | SessionError::Task(_) => internal(&e, "internal error"),
        }
    }
}

/// The metadata key that says why a transfer failed, in the words of [`TransferReason`].
pub const REASON_METADATA: &str = "x-kruntimes-reason";

/// A failed transfer as a status: the code by its reason, and the reason itself in
/// [`REASON_METADATA`] (the gateway turns FileTooLarge into 413 and InsufficientStorage
/// into 507 with it).
fn transfer_status(e: &TransferError) -> Status {
    use tonic::Code;
    let code = match e.reason {
        TransferReason::FileTooLarge => Code::OutOfRange,
        TransferReason::InsufficientStorage => Code::ResourceExhausted,
        TransferReason::InvalidArchive
        | TransferReason::PathEscapes
        | TransferReason::InvalidPath
        | TransferReason::SnapshotInvalid => Code::InvalidArgument,
        TransferReason::SnapshotTooLarge => Code::ResourceExhausted,
        TransferReason::IsADirectory
        | TransferReason::NotADirectory
        | TransferReason::DirectoryNotEmpty
        | TransferReason::Stopped => Code::FailedPrecondition,
        TransferReason::NotFound => Code::NotFound,
        TransferReason::Incomplete => Code::Aborted,
        TransferReason::IoError => {
            tracing::warn!(error = %e, "a transfer failed");
            Code::Internal
        }
    };
    let mut status = Status::new(code, e.message.clone());
    status.metadata_mut().insert(
        REASON_METADATA,
        tonic::metadata::MetadataValue::from_static(e.reason.as_str()),
    );
    status
}

fn timestamp(d: Duration) -> Option<prost_types::Duration> {
    prost_types::Duration::try_from(d).ok()
}

fn status(s: SessionSnapshot) -> pb::SessionStatus {
    let mut status = pb::SessionStatus {
        id: Some(execution_id(&s.key)),
        state: 0,
        reason: s.reason.to_owned(),
        message: s.message,
        running_operation_id: s.running_operation_id.unwrap_or_default(),
        registered_at: Some(s.registered_at.into()),
        workspace_dir: s.workspace_dir.display().to_string(),
        artifacts_dir: s.artifacts_dir.display().to_string(),
        operations: s.operations,
    };
    status.set_state(match s.state {
        SessionState::Registering => pb::SessionState::Registering,
        SessionState::Ready => pb::SessionState::Ready,
        SessionState::Closing => pb::SessionState::Closing,
        SessionState::Closed => pb::SessionState::Closed,
        SessionState::Failed => pb::SessionState::Failed,
    });
    status
}

fn not_found(key: &ExecutionKey) -> pb::SessionStatus {
    let mut status = pb::SessionStatus {
        id: Some(execution_id(key)),
        reason: "NotFound".to_owned(),
        message: "the runtime server holds no session of this Run UID and attempt".to_owned(),
        ..Default::default()
    };
    status.set_state(pb::SessionState::NotFound);
    status
}

fn completed(c: Completion) -> pb::OperationCompleted {
    let mut completed = pb::OperationCompleted {
        state: 0,
        reason: c.reason.to_owned(),
        message: c.message,
        exit_code: c.exit_code,
        signal: c.signal,
        duration: timestamp(c.duration),
        stdout_bytes: c.stdout.bytes,
        stderr_bytes: c.stderr.bytes,
        stdout_truncated: c.stdout.truncated,
        stderr_truncated: c.stderr.truncated,
    };
    completed.set_state(match c.state {
        OperationState::Succeeded => pb::OperationState::Succeeded,
        OperationState::Failed => pb::OperationState::Failed,
        OperationState::Cancelled => pb::OperationState::Cancelled,
        OperationState::TimedOut => pb::OperationState::TimedOut,
    });
    completed
}

fn event(operation_id: &str, event: OperationEvent) -> pb::SessionOperationEvent {
    use pb::session_operation_event::Event;
    let event = match event {
        OperationEvent::Started => Event::Started(pb::OperationStarted {}),
        OperationEvent::Output {
            stream,
            data,
            truncated,
        } => {
            let mut output = pb::OperationOutput {
                stream: 0,
                data,
                truncated,
            };
            output.set_stream(match stream {
                OutputStream::Stdout => pb::LogStream::Stdout,
                OutputStream::Stderr => pb::LogStream::Stderr,
            });
            Event::Output(output)
        }
        OperationEvent::Completed(c) => Event::Completed(completed(c)),
    };
    pb::SessionOperationEvent {
        operation_id: operation_id.to_owned(),
        // runtimed numbers the events of a session.
        sequence: 0,
        event: Some(event),
    }
}

/// The operation of a request, validated.
fn operation(
    operation: Option<pb::session_operation_request::Operation>,
) -> Result<OperationKind, SessionError> {
    use pb::session_operation_request::Operation;
    Ok(match operation {
        None => {
            return Err(SessionError::Invalid {
                what: "operation",
                detail: "exactly one of command, write_file, make_directory, delete or rename is required"
                    .to_owned(),
            });
        }
        Some(Operation::Command(c)) => OperationKind::Command(CommandSpec::new(
            c.argv,
            c.shell,
            c.stdin,
            c.cwd,
            env_pairs(c.env),
        )?),
        Some(Operation::WriteFile(w)) => OperationKind::WriteFile {
            path: w.path,
            content: w.content,
            executable: w.executable,
        },
        Some(Operation::MakeDirectory(m)) => OperationKind::MakeDirectory {
            path: m.path,
            parents: m.parents,
        },
        Some(Operation::Delete(d)) => OperationKind::Delete {
            path: d.path,
            recursive: d.recursive,
        },
        Some(Operation::Rename(r)) => OperationKind::Rename {
            from: r.from,
            to: r.to,
        },
    })
}

fn manifest_entry(e: ManifestEntry) -> pb::SnapshotManifestEntry {
    use pb::snapshot_manifest_entry::Kind;
    let mut entry = pb::SnapshotManifestEntry {
        path: e.path,
        kind: 0,
        size_bytes: e.size_bytes,
        mode: e.mode,
        mtime_seconds: e.mtime_seconds,
        digest: e.digest,
        link_target: e.link_target,
    };
    entry.set_kind(match e.kind {
        EntryKind::File => Kind::File,
        EntryKind::Directory => Kind::Directory,
        EntryKind::Symlink => Kind::Symlink,
    });
    entry
}

fn capture_part(part: CapturePart) -> pb::CaptureSessionResponse {
    use pb::capture_session_response::Part;
    pb::CaptureSessionResponse {
        part: Some(match part {
            CapturePart::Data(data) => Part::Data(data),
            CapturePart::Summary(s) => Part::Summary(pb::SnapshotSummary {
                size_bytes: s.size_bytes,
                compressed_bytes: s.compressed_bytes,
                files: s.files,
                skipped: s.skipped,
                digest: s.digest,
                manifest: s.manifest.into_iter().map(manifest_entry).collect(),
            }),
        }),
    }
}

type EventStream =
    Pin<Box<dyn Stream<Item = Result<pb::SessionOperationEvent, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl SessionRuntime for SessionService {
    async fn register_session(
        &self,
        request: Request<pb::RegisterSessionRequest>,
    ) -> Result<Response<pb::SessionStatus>, Status> {
        let request = request.into_inner();
        let digest = executor::digest(&request.encode_to_vec());
        let key = key(request.id)?;
        let spec = RegisterSpec::new(
            key,
            source_files(request.files),
            env_pairs(request.env),
            digest,
        )
        .map_err(SessionError::from)?;
        let snapshot = self.sessions.register(spec).await?;
        Ok(Response::new(status(snapshot)))
    }

    async fn get_session_status(
        &self,
        request: Request<pb::GetSessionStatusRequest>,
    ) -> Result<Response<pb::SessionStatus>, Status> {
        let key = key(request.into_inner().id)?;
        Ok(Response::new(match self.sessions.status(&key)? {
            Some(snapshot) => status(snapshot),
            None => not_found(&key),
        }))
    }

    type StreamSessionOperationStream = EventStream;

    async fn stream_session_operation(
        &self,
        request: Request<pb::SessionOperationRequest>,
    ) -> Result<Response<Self::StreamSessionOperationStream>, Status> {
        let request = request.into_inner();
        let key = key(request.id)?;
        let timeout = duration(request.timeout, "timeout")?;
        let kind = operation(request.operation)?;
        let spec = OperationSpec::new(key, request.operation_id, kind, timeout)?;
        let operation_id = spec.operation_id.clone();
        let events = self.sessions.start_operation(spec)?;
        // Dropping this stream (the caller cancels the call) drops the receiver, which
        // the operation notices and answers by killing what it runs.
        let stream = ReceiverStream::new(events).map(move |e| Ok(event(&operation_id, e)));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn read_session_file(
        &self,
        request: Request<pb::ReadSessionFileRequest>,
    ) -> Result<Response<pb::ReadSessionFileResponse>, Status> {
        let request = request.into_inner();
        let key = key(request.id)?;
        let file = self.sessions.read_file(&key, request.path).await?;
        Ok(Response::new(pb::ReadSessionFileResponse {
            content: file.content,
            executable: file.executable,
            directory: file.directory,
        }))
    }

    async fn upload_session_file(
        &self,
        request: Request<tonic::Streaming<pb::UploadSessionFileRequest>>,
    ) -> Result<Response<pb::UploadSessionFileResponse>, Status> {
        use pb::upload_session_file_request::Part;
        let mut stream = request.into_inner();
        let first = tokio::time::timeout(crate::sessions::TRANSFER_IDLE_TIMEOUT, stream.message())
            .await
            .map_err(|_| Status::deadline_exceeded("the upload sent no header"))??;
        let Some(pb::UploadSessionFileRequest {
            part: Some(Part::Header(header)),
        }) = first
        else {
            return Err(Status::invalid_argument("an upload starts with its header"));
        };
        let key = key(header.id)?;
        let spec = transfer::UploadSpec {
            path: header.path,
            executable: header.executable,
            archive: header.archive,
            size: header.size,
            max_bytes: header.max_bytes,
        };
        let parts = stream.map(|message| match message {
            Ok(pb::UploadSessionFileRequest {
                part: Some(Part::Data(data)),
            }) if data.len() <= transfer::CHUNK_BYTES => Ok(transfer::UploadPart::Data(data)),
            Ok(pb::UploadSessionFileRequest {
                part: Some(Part::End(end)),
            }) => Ok(transfer::UploadPart::End(end.total_bytes)),
            Ok(_) => Err(SessionError::Invalid {
                what: "upload",
                detail: format!(
                    "after its header an upload carries data parts of at most {} bytes and one end",
                    transfer::CHUNK_BYTES
                ),
            }),
            Err(status) => Err(SessionError::Transfer(TransferError::new(
                TransferReason::Incomplete,
                format!("the upload broke off: {}", status.message()),
            ))),
        });
        let done = self.sessions.upload(&key, spec, Box::pin(parts)).await?;
        Ok(Response::new(pb::UploadSessionFileResponse {
            size_bytes: done.size_bytes,
            files: done.files,
        }))
    }

    type DownloadSessionFileStream = Pin<
        Box<dyn Stream<Item = Result<pb::DownloadSessionFileResponse, Status>> + Send + 'static>,
    >;

    async fn download_session_file(
        &self,
        request: Request<pb::DownloadSessionFileRequest>,
    ) -> Result<Response<Self::DownloadSessionFileStream>, Status> {
        use pb::download_session_file_response::Part;
        let request = request.into_inner();
        let key = key(request.id)?;
        let mut parts = self
            .sessions
            .download(&key, request.path, request.archive)?;
        // The first part answers the call: an error before any byte is a status.
        let header = match parts.recv().await {
            Some(Ok(transfer::DownloadPart::Header(header))) => header,
            Some(Err(e)) => return Err(transfer_status(&e)),
            Some(Ok(transfer::DownloadPart::Data(_))) | None => {
                return Err(Status::internal("the download ended before its header"));
            }
        };
        let first = pb::DownloadSessionFileResponse {
            part: Some(Part::Header(pb::DownloadHeader {
                directory: header.directory,
                size_bytes: header.size_bytes,
                executable: header.executable,
            })),
        };
        let rest = ReceiverStream::new(parts).map(|part| match part {
            Ok(transfer::DownloadPart::Data(data)) => Ok(pb::DownloadSessionFileResponse {
                part: Some(Part::Data(data)),
            }),
            Ok(transfer::DownloadPart::Header(_)) => {
                Err(Status::internal("a download sent a second header"))
            }
            Err(e) => Err(transfer_status(&e)),
        });
        Ok(Response::new(Box::pin(
            tokio_stream::once(Ok(first)).chain(rest),
        )))
    }

    type CaptureSessionStream =
        Pin<Box<dyn Stream<Item = Result<pb::CaptureSessionResponse, Status>> + Send + 'static>>;

    async fn capture_session(
        &self,
        request: Request<pb::CaptureSessionRequest>,
    ) -> Result<Response<Self::CaptureSessionStream>, Status> {
        let request = request.into_inner();
        let key = key(request.id)?;
        let limits = snapshot::Limits::new(request.max_bytes, request.max_files);
        let parts = self.sessions.capture(&key, limits)?;
        // Dropping this stream (the caller cancels the call) drops the receiver, which
        // ends the capture.
        let stream = ReceiverStream::new(parts).map(|part| match part {
            Ok(part) => Ok(capture_part(part)),
            Err(e) => Err(transfer_status(&e)),
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn restore_session(
        &self,
        request: Request<tonic::Streaming<pb::RestoreSessionRequest>>,
    ) -> Result<Response<pb::RestoreSessionResponse>, Status> {
        use pb::restore_session_request::Part;
        let mut stream = request.into_inner();
        let first = tokio::time::timeout(crate::sessions::TRANSFER_IDLE_TIMEOUT, stream.message())
            .await
            .map_err(|_| Status::deadline_exceeded("the restore sent no header"))??;
        let Some(pb::RestoreSessionRequest {
            part: Some(Part::Header(header)),
        }) = first
        else {
            return Err(Status::invalid_argument("a restore starts with its header"));
        };
        let key = key(header.id)?;
        let digest = match header.digest.as_str() {
            "" => None,
            text => Some(snapshot::parse_digest(text).ok_or_else(|| {
                Status::invalid_argument("digest: expected \"sha256:\" and 64 hex digits")
            })?),
        };
        if header.parked {
            // The header and `end` alone: what follows it is not read.
            let done = self.sessions.restore_parked(&key, &header.digest).await?;
            return Ok(Response::new(pb::RestoreSessionResponse {
                files: done.files,
                size_bytes: done.size_bytes,
            }));
        }
        let limits = snapshot::Limits::new(header.max_bytes, header.max_files);
        let parts = stream.map(|message| match message {
            Ok(pb::RestoreSessionRequest {
                part: Some(Part::Data(data)),
            }) if data.len() <= transfer::CHUNK_BYTES => Ok(transfer::UploadPart::Data(data)),
            Ok(pb::RestoreSessionRequest {
                part: Some(Part::End(end)),
            }) => Ok(transfer::UploadPart::End(end.total_bytes)),
            Ok(_) => Err(SessionError::Invalid {
                what: "restore",
                detail: format!(
                    "after its header a restore carries data parts of at most {} bytes and one end",
                    transfer::CHUNK_BYTES
                ),
            }),
            Err(status) => Err(SessionError::Transfer(TransferError::new(
                TransferReason::SnapshotInvalid,
                format!("the restore broke off: {}", status.message()),
            ))),
        });
        let done = self
            .sessions
            .restore(&key, limits, digest, Box::pin(parts))
            .await?;
        Ok(Response::new(pb::RestoreSessionResponse {
            files: done.files,
            size_bytes: done.size_bytes,
        }))
    }

    async fn list_session_files(
        &self,
        request: Request<pb::ListSessionFilesRequest>,
    ) -> Result<Response<pb::ListSessionFilesResponse>, Status> {
        let request = request.into_inner();
        let key = key(request.id)?;
        let (entries, next_page_token) = self
            .sessions
            .list_files(&key, request.path, request.limit, &request.page_token)
            .await?;
        Ok(Response::new(pb::ListSessionFilesResponse {
            entries: entries
                .into_iter()
                .map(|e| pb::FileEntry {
                    path: e.path,
                    directory: e.directory,
                    size_bytes: e.size_bytes,
                    symlink: e.symlink,
                })
                .collect(),
            next_page_token,
        }))
    }

    async fn close_session(
        &self,
        request: Request<pb::CloseSessionRequest>,
    ) -> Result<Response<pb::CloseSessionResponse>, Status> {
        let request = request.into_inner();
        let key = key(request.id)?;
        let grace = duration(request.grace_period, "grace_period")?.map(|g| g.min(MAX_CLOSE_GRACE));
        let (existed, snapshot) = self
            .sessions
            .close(
                key.clone(),
                grace,
                request.purge,
                Some(request.park_digest).filter(|d| !d.is_empty()),
            )
            .await?;
        Ok(Response::new(pb::CloseSessionResponse {
            existed,
            status: Some(match snapshot {
                Some(snapshot) => status(snapshot),
                None => not_found(&key),
            }),
        }))
    }

    async fn list_sessions(
        &self,
        _request: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        let sessions = self.sessions.list().into_iter().map(status).collect();
        Ok(Response::new(pb::ListSessionsResponse { sessions }))
    }
}
