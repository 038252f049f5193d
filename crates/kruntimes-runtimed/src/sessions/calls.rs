//! The session calls of runtimed's API (design document 001, "Services and Request
//! Flow"): routed like `Invoke` ([`Invoker::locate`]), then served by the owner from its
//! [`Sessions`](crate::sessions::Sessions): status and lease from its own state, mutations
//! through the session's FIFO queue, reads and listings straight from its runtime server
//! (they bypass the queue).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use kruntimes_api::run::ModeKind;
use kruntimes_api::{Phase, lifecycle};
use kruntimes_proto::runtime::v1 as rs;
use kruntimes_proto::runtimed::v1 as pb;
use kube::ResourceExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};
use tracing::info;

use crate::functions::invoke::{Invoker, Located, Target, forwarded};
use crate::sessions::Session;

/// The event stream of one operation.
pub type EventStream =
    Pin<Box<dyn Stream<Item = Result<rs::SessionOperationEvent, Status>> + Send>>;

/// The chunks of one download.
pub type DownloadStream =
    Pin<Box<dyn Stream<Item = Result<rs::DownloadSessionFileResponse, Status>> + Send>>;

/// How many times a wake's conditional write is tried against a Run that keeps changing.
const WAKE_WRITES: usize = 3;

/// The reads of a forwarded call wait at most this long for the owner.
const FORWARD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

fn target(route: &pb::SessionRoute) -> Target<'_> {
    Target {
        namespace: &route.namespace,
        runtime: &route.runtime,
        run_uid: &route.run_uid,
        hops: route.hops,
        expected_attempt: route.expected_attempt,
        expected_pod_uid: &route.expected_pod_uid,
        mode: ModeKind::Session,
    }
}

/// The route a forwarder sends on: one hop, and what it expects of the owner.
fn onward(route: &pb::SessionRoute, located: &Located) -> pb::SessionRoute {
    pb::SessionRoute {
        hops: 1,
        expected_attempt: located.entry.attempt,
        expected_pod_uid: located.entry.assigned_pod_uid.clone().unwrap_or_default(),
        ..route.clone()
    }
}

impl Invoker {
    async fn locate_session(
        &self,
        peer_certs: Option<Arc<Vec<rustls::pki_types::CertificateDer<'static>>>>,
        metadata: &MetadataMap,
        route: Option<&pb::SessionRoute>,
    ) -> Result<(pb::SessionRoute, Located), Status> {
        let route = route
            .cloned()
            .ok_or_else(|| Status::invalid_argument("the call names no session (route)"))?;
        let located = self.locate(peer_certs, metadata, &target(&route)).await?;
        Ok((route, located))
    }

    /// The owner's local session for a Run located here.
    fn owned(&self, located: &Located) -> Result<Arc<Session>, Status> {
        self.context
            .sessions
            .get(&located.entry.uid)
            .filter(|s| s.attempt == located.entry.attempt)
            .ok_or_else(|| {
                Status::unavailable("the session is registering or recovering on its worker")
            })
    }

    fn info(&self, located: &Located, session: &Session) -> pb::SessionInfo {
        let (queued, running, last_sequence) = session.snapshot();
        let state = match located.entry.phase {
            Phase::Ready => rs::SessionState::Ready,
            Phase::Finalizing => rs::SessionState::Closing,
            _ => rs::SessionState::Unspecified,
        };
        pb::SessionInfo {
            run_name: located.entry.name.clone(),
            phase: located.entry.phase.to_string(),
            state: state as i32,
            served_by: self.context.pod_name.clone(),
            hops: 0,
            attempt: located.entry.attempt,
            queued,
            running_operation_id: running,
            last_sequence,
            lease_timeout_seconds: session
                .lease
                .map_or(0, |l| u32::try_from(l.as_secs()).unwrap_or(u32::MAX)),
            lease_expires_at: session.lease_expires_at().map(prost_types::Timestamp::from),
            queue_size: u32::try_from(session.queue_size).unwrap_or(u32::MAX),
            operation_timeout: prost_types::Duration::try_from(session.operation_timeout).ok(),
        }
    }

    /// `GetSession` and `RenewSessionLease`.
    pub async fn session_info(
        &self,
        request: Request<pb::SessionRoute>,
        renew: bool,
    ) -> Result<pb::SessionInfo, Status> {
        let peer_certs = request.peer_certs();
        let (metadata, _, route) = request.into_parts();
        let (route, located) = self
            .locate_session(peer_certs, &metadata, Some(&route))
            .await?;
        if located.local {
            let session = self.owned(&located)?;
            if renew {
                session.renew();
            }
            let mut info = self.info(&located, &session);
            info.hops = route.hops;
            return Ok(info);
        }
        let onward = onward(&route, &located);
        if renew {
            self.to_owner(
                &located,
                &metadata,
                onward,
                FORWARD_TIMEOUT,
                |mut owner, call| async move { owner.renew_session_lease(call).await },
            )
            .await
        } else {
            self.to_owner(
                &located,
                &metadata,
                onward,
                FORWARD_TIMEOUT,
                |mut owner, call| async move { owner.get_session(call).await },
            )
            .await
        }
    }

    /// `WakeSession`: withdraws a suspend its owner made for idleness (docs/session-mode.md,
    /// "Auto-suspend and wake"), on any worker of the Runtime (a Suspended session has no
    /// owner) and never forwarded. The caller is authorized as for every session call;
    /// then the Run is read afresh and, only while [`lifecycle::auto_suspended`] holds,
    /// `spec.suspend` is cleared and the marker removed in one write conditional on that
    /// read's resourceVersion. A suspend of the user (no valid marker) is left alone.
    pub async fn wake_session(
        &self,
        request: Request<pb::SessionRoute>,
    ) -> Result<pb::WakeSessionResponse, Status> {
        let answer = self.wake(request).await;
        self.context.metrics.wake(match &answer {
            Ok(pb::WakeSessionResponse { woken: true }) => "woken",
            Ok(pb::WakeSessionResponse { woken: false }) => "not_wakeable",
            Err(_) => "error",
        });
        answer
    }

    async fn wake(
        &self,
        request: Request<pb::SessionRoute>,
    ) -> Result<pb::WakeSessionResponse, Status> {
        let peer_certs = request.peer_certs();
        let (metadata, _, route) = request.into_parts();
        if route.hops != 0 {
            return Err(Status::invalid_argument("a wake is never forwarded"));
        }
        let token = self.caller(peer_certs, &metadata, &target(&route)).await?;
        let entry = self
            .ownership
            .run(&route.run_uid)
            .filter(|e| e.mode == ModeKind::Session)
            .ok_or_else(|| Status::not_found("no session Run with that UID in this Runtime"))?;
        self.authorize(token, &route.namespace, &entry.name, &entry.uid)
            .await?;
        let api = self.context.api();
        let unavailable = |e: kube::Error| {
            Status::unavailable(lifecycle::bounded_message(&format!(
                "cannot wake the session now: {e}"
            )))
        };
        for _ in 0..WAKE_WRITES {
            let Some(fresh) = api.get_opt(&entry.name).await.map_err(unavailable)? else {
                return Err(Status::not_found("the session Run no longer exists"));
            };
            if fresh.uid().as_deref() != Some(entry.uid.as_str())
                || !lifecycle::auto_suspended(&fresh)
                || fresh.metadata.deletion_timestamp.is_some()
            {
                return Ok(pb::WakeSessionResponse { woken: false });
            }
            let mut woken = fresh.clone();
            woken.spec.suspend = Some(false);
            if let Some(annotations) = woken.metadata.annotations.as_mut() {
                annotations.remove(lifecycle::AUTO_SUSPENDED_ANNOTATION);
            }
            // Conditional: `woken` carries the resourceVersion of `fresh`.
            match api.replace(&entry.name, &Default::default(), &woken).await {
                Ok(_) => {
                    info!(run = %entry.name, phase = %fresh.phase(), "woke an auto-suspended session");
                    return Ok(pb::WakeSessionResponse { woken: true });
                }
                Err(kube::Error::Api(status)) if status.code == 409 => continue,
                Err(e) => return Err(unavailable(e)),
            }
        }
        Err(Status::unavailable(
            "the session's Run kept changing while it was woken; try again",
        ))
    }

    /// `SendOperation`: admission into the owner's queue, then the operation's events.
    pub async fn send_operation(
        &self,
        request: Request<pb::SendOperationRequest>,
    ) -> Result<EventStream, Status> {
        let peer_certs = request.peer_certs();
        let (metadata, _, request) = request.into_parts();
        let (route, located) = self
            .locate_session(peer_certs, &metadata, request.route.as_ref())
            .await?;
        let operation = request
            .operation
            .ok_or_else(|| Status::invalid_argument("the call carries no operation"))?;
        if located.local {
            let session = self.owned(&located)?;
            if located.entry.phase == Phase::Finalizing {
                return Err(Status::failed_precondition(
                    "the session is finalizing: it accepts no new operations",
                ));
            }
            // Refused here, never accepted and then cancelled, when the idle sweep ended it.
            crate::sessions::record_before_mutation(&self.context, &session).await?;
            let events = session.admit(operation)?;
            return Ok(Box::pin(ReceiverStream::new(events)));
        }
        let (mut client, peer) = self.owner(&located)?;
        let call = forwarded(
            &metadata,
            pb::SendOperationRequest {
                route: Some(onward(&route, &located)),
                operation: Some(operation),
            },
        );
        match client.send_operation(call).await {
            Ok(stream) => Ok(Box::pin(stream.into_inner())),
            Err(status) => {
                self.forwarded_failed(&peer, &status);
                Err(status)
            }
        }
    }

    /// `CancelOperation`.
    pub async fn cancel_operation(
        &self,
        request: Request<pb::CancelOperationRequest>,
    ) -> Result<pb::CancelOperationResponse, Status> {
        let peer_certs = request.peer_certs();
        let (metadata, _, request) = request.into_parts();
        let (route, located) = self
            .locate_session(peer_certs, &metadata, request.route.as_ref())
            .await?;
        if located.local {
            let session = self.owned(&located)?;
            let state = session.cancel(&request.operation_id);
            return Ok(pb::CancelOperationResponse {
                found: state.is_some(),
                state: state.unwrap_or(rs::OperationState::Unspecified) as i32,
            });
        }
        let onward = pb::CancelOperationRequest {
            route: Some(onward(&route, &located)),
            operation_id: request.operation_id,
        };
        self.to_owner(
            &located,
            &metadata,
            onward,
            FORWARD_TIMEOUT,
            |mut owner, call| async move { owner.cancel_operation(call).await },
        )
        .await
    }

    /// `ReadFile`: straight from the owner's runtime server, bypassing the queue.
    pub async fn read_file(
        &self,
        request: Request<pb::ReadFileRequest>,
    ) -> Result<rs::ReadSessionFileResponse, Status> {
        let peer_certs = request.peer_certs();
        let (metadata, _, request) = request.into_parts();
        let (route, located) = self
            .locate_session(peer_certs, &metadata, request.route.as_ref())
            .await?;
        if located.local {
            let session = self.owned(&located)?;
            return self
                .context
                .session_client
                .clone()
                .read_session_file(rs::ReadSessionFileRequest {
                    id: Some(session.id()),
                    path: request.path,
                })
                .await
                .map(Response::into_inner);
        }
        let onward = pb::ReadFileRequest {
            route: Some(onward(&route, &located)),
            path: request.path,
        };
        self.to_owner(
            &located,
            &metadata,
            onward,
            FORWARD_TIMEOUT,
            |mut owner, call| async move { owner.read_file(call).await },
        )
        .await
    }

    /// `ListFiles`: straight from the owner's runtime server, bypassing the queue.
    pub async fn list_files(
        &self,
        request: Request<pb::ListFilesRequest>,
    ) -> Result<rs::ListSessionFilesResponse, Status> {
        let peer_certs = request.peer_certs();
        let (metadata, _, request) = request.into_parts();
        let (route, located) = self
            .locate_session(peer_certs, &metadata, request.route.as_ref())
            .await?;
        if located.local {
            let session = self.owned(&located)?;
            return self
                .context
                .session_client
                .clone()
                .list_session_files(rs::ListSessionFilesRequest {
                    id: Some(session.id()),
                    path: request.path,
                    limit: request.limit,
                    page_token: request.page_token,
                })
                .await
                .map(Response::into_inner);
        }
        let onward = pb::ListFilesRequest {
            route: Some(onward(&route, &located)),
            ..request
        };
        self.to_owner(
            &located,
            &metadata,
            onward,
            FORWARD_TIMEOUT,
            |mut owner, call| async move { owner.list_files(call).await },
        )
        .await
    }

    /// `UploadFile`: a whole file (or an archive) streamed to the owner's runtime server,
    /// bypassing the queue. The header is read first (bounded in time) and the call is
    /// authorized for the session it names before any data is taken; the lease is renewed
    /// with every chunk. A caller's stream that breaks ends the onward stream without its
    /// `end`, so the runtime server keeps nothing of it.
    pub async fn upload_file(
        &self,
        request: Request<tonic::Streaming<pb::UploadFileRequest>>,
    ) -> Result<rs::UploadSessionFileResponse, Status> {
        use pb::upload_file_request::Part;
        use tokio_stream::StreamExt as _;
        let peer_certs = request.peer_certs();
        let (metadata, _, mut stream) = request.into_parts();
        let first = tokio::time::timeout(FORWARD_TIMEOUT, stream.message())
            .await
            .map_err(|_| Status::deadline_exceeded("the upload sent no header"))??;
        let Some(pb::UploadFileRequest {
            part: Some(Part::Header(header)),
        }) = first
        else {
            return Err(Status::invalid_argument("an upload starts with its header"));
        };
        let (route, located) = self
            .locate_session(peer_certs, &metadata, header.route.as_ref())
            .await?;
        let cap = self.context.session_limits.max_file_bytes;
        let max_bytes = match header.max_bytes {
            0 => cap,
            asked => asked.min(cap),
        };
        if located.local {
            let session = self.owned(&located)?;
            if located.entry.phase == Phase::Finalizing {
                return Err(Status::failed_precondition(
                    "the session is finalizing: it accepts no uploads",
                ));
            }
            // Held until the upload's answer: a suspend's capture waits for it, and once
            // admission stopped (the files are being captured) no upload starts.
            let _upload = session.begin_upload()?;
            session.renew();
            crate::sessions::record_before_mutation(&self.context, &session).await?;
            // A file write is a mutation: the idle clock restarts now and when it lands.
            session.touch();
            let written = session.clone();
            let first = rs::UploadSessionFileRequest {
                part: Some(rs::upload_session_file_request::Part::Header(
                    rs::UploadHeader {
                        id: Some(session.id()),
                        path: header.path,
                        executable: header.executable,
                        archive: header.archive,
                        size: header.size,
                        max_bytes,
                    },
                )),
            };
            let rest = stream.map_while(move |message| {
                use rs::upload_session_file_request::Part as Onward;
                let part = match message.ok()?.part? {
                    Part::Data(data) => Onward::Data(data),
                    Part::End(end) => Onward::End(end),
                    Part::Header(_) => return None,
                };
                session.renew();
                // Every chunk is activity: a long upload is never idle-expired mid-way.
                session.touch();
                Some(rs::UploadSessionFileRequest { part: Some(part) })
            });
            let answer = self
                .context
                .session_client
                .clone()
                .upload_session_file(tokio_stream::iter([first]).chain(rest))
                .await
                .map(Response::into_inner);
            if answer.is_ok() {
                written.touch();
            }
            return answer;
        }
        let (mut client, peer) = self.owner(&located)?;
        let first = pb::UploadFileRequest {
            part: Some(Part::Header(pb::UploadFileHeader {
                route: Some(onward(&route, &located)),
                max_bytes,
                ..header
            })),
        };
        let rest = stream.map_while(|message| match message.ok()?.part? {
            Part::Header(_) => None,
            part => Some(pb::UploadFileRequest { part: Some(part) }),
        });
        let call = forwarded(&metadata, tokio_stream::iter([first]).chain(rest));
        client
            .upload_file(call)
            .await
            .map(Response::into_inner)
            .inspect_err(|status| self.forwarded_failed(&peer, status))
    }

    /// `DownloadFile`: a whole file (or a directory as a tar stream) from the owner's
    /// runtime server, bypassing the queue; the lease is renewed with every chunk.
    pub async fn download_file(
        &self,
        request: Request<pb::DownloadFileRequest>,
    ) -> Result<DownloadStream, Status> {
        use futures::StreamExt as _;
        let peer_certs = request.peer_certs();
        let (metadata, _, request) = request.into_parts();
        let (route, located) = self
            .locate_session(peer_certs, &metadata, request.route.as_ref())
            .await?;
        if located.local {
            let session = self.owned(&located)?;
            session.renew();
            let stream = self
                .context
                .session_client
                .clone()
                .download_session_file(rs::DownloadSessionFileRequest {
                    id: Some(session.id()),
                    path: request.path,
                    archive: request.archive,
                })
                .await?
                .into_inner();
            return Ok(Box::pin(stream.inspect(move |_| session.renew())));
        }
        let (mut client, peer) = self.owner(&located)?;
        let call = forwarded(
            &metadata,
            pb::DownloadFileRequest {
                route: Some(onward(&route, &located)),
                ..request
            },
        );
        match client.download_file(call).await {
            Ok(stream) => Ok(Box::pin(stream.into_inner())),
            Err(status) => {
                self.forwarded_failed(&peer, &status);
                Err(status)
            }
        }
    }

    /// Sends `message` with `call` to the owner of a Run located on another worker, with
    /// the caller's credential metadata and `timeout`; an unreachable owner's channel is
    /// dropped.
    pub(crate) async fn to_owner<M, T, F, Fut>(
        &self,
        located: &Located,
        metadata: &MetadataMap,
        message: M,
        timeout: std::time::Duration,
        call: F,
    ) -> Result<T, Status>
    where
        F: FnOnce(
            pb::runtimed_client::RuntimedClient<tonic::transport::Channel>,
            Request<M>,
        ) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let (owner, peer) = self.owner(located)?;
        let mut request = forwarded(metadata, message);
        request.set_timeout(timeout);
        call(owner, request)
            .await
            .map(Response::into_inner)
            .inspect_err(|status| self.forwarded_failed(&peer, status))
    }
}
