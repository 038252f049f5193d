//! runtimed's gRPC API (`kruntimes.runtimed.v1.Runtimed`), served on TCP to the gateway
//! and peer runtimeds, and the TLS of that port ([`WorkerTls`], which lives in `kruntimes-wire` for the gateway too).
//!
//! With TLS material, the port speaks mutual TLS only: runtimed presents its workload
//! certificate (issued for its worker identity, [`worker_identity`]) and requires a client
//! certificate issued by the same CA; its clients (the gateway, peer runtimeds forwarding
//! an invocation) present theirs and verify the worker as the identity of the Pod they
//! mean to reach ([`worker_channel`]). Every
//! call also carries the caller's bearer token, which runtimed authorizes itself for the
//! Run it names ([`crate::functions::invoke`]); `RunLogs` too.
//! Without TLS material everything is plaintext HTTP/2 (tests, and deployments that put
//! the hop inside a mesh); runtimed warns about it once at start.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use kruntimes_api::lifecycle;
use kruntimes_proto::runtime::v1 as rs;
use kruntimes_proto::runtimed::v1 as pb;
use kube::ResourceExt;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

pub use kruntimes_wire::worker::{
    GATEWAY_IDENTITY, TlsError, WorkerTls, worker_channel, worker_identity,
};

use crate::functions::invoke::Invoker;
use crate::reconcile::Context;
use crate::tasks::executions::Key;

/// How long a logs request waits for an execution that is being started.
const START_WAIT: Duration = Duration::from_secs(5);
/// The longest namespace or name accepted (DNS-1123 subdomain).
const MAX_NAME_BYTES: usize = 253;
/// The connections accepted on `listener`, with Nagle's algorithm off: a streamed answer
/// writes its events one by one, and with Nagle each would wait for the peer's delayed
/// acknowledgement of the one before (40 ms). tonic's own `tcp_nodelay` applies only to
/// listeners it binds itself.
fn incoming(listener: TcpListener) -> impl Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    TcpListenerStream::new(listener).map(|accepted| {
        if let Ok(stream) = &accepted {
            let _ = stream.set_nodelay(true);
        }
        accepted
    })
}

/// Serves the API on `listener` until `stop` completes: with mutual TLS when `tls` is
/// given (each handshake with the material loaded last, see
/// [`kruntimes_wire::worker::tls_incoming`]), plaintext otherwise.
pub async fn serve(
    listener: TcpListener,
    tls: Option<WorkerTls>,
    invoker: Arc<Invoker>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    // HTTP/2 only (tonic's default; never `accept_http1`): the clients of this port wait
    // for the server's first HTTP/2 bytes before a call (`kruntimes_wire::worker`).
    let router = Server::builder().add_service(pb::runtimed_server::RuntimedServer::new(Service {
        context: invoker.context.clone(),
        invoker,
    }));
    match tls {
        Some(tls) => {
            router
                .serve_with_incoming_shutdown(
                    kruntimes_wire::worker::tls_incoming(listener, tls),
                    stop,
                )
                .await
        }
        None => {
            router
                .serve_with_incoming_shutdown(incoming(listener), stop)
                .await
        }
    }
}

struct Service {
    context: Arc<Context>,
    invoker: Arc<Invoker>,
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<rs::LogChunk, Status>> + Send>>;

type EventStream = crate::sessions::calls::EventStream;

#[tonic::async_trait]
impl pb::runtimed_server::Runtimed for Service {
    type RunLogsStream = ChunkStream;
    type SendOperationStream = EventStream;
    type DownloadFileStream = crate::sessions::calls::DownloadStream;

    async fn upload_file(
        &self,
        request: Request<tonic::Streaming<pb::UploadFileRequest>>,
    ) -> Result<Response<rs::UploadSessionFileResponse>, Status> {
        self.invoker.upload_file(request).await.map(Response::new)
    }

    async fn download_file(
        &self,
        request: Request<pb::DownloadFileRequest>,
    ) -> Result<Response<crate::sessions::calls::DownloadStream>, Status> {
        self.invoker.download_file(request).await.map(Response::new)
    }

    async fn get_session(
        &self,
        request: Request<pb::SessionRoute>,
    ) -> Result<Response<pb::SessionInfo>, Status> {
        self.invoker
            .session_info(request, false)
            .await
            .map(Response::new)
    }

    async fn renew_session_lease(
        &self,
        request: Request<pb::SessionRoute>,
    ) -> Result<Response<pb::SessionInfo>, Status> {
        self.invoker
            .session_info(request, true)
            .await
            .map(Response::new)
    }

    async fn send_operation(
        &self,
        request: Request<pb::SendOperationRequest>,
    ) -> Result<Response<EventStream>, Status> {
        self.invoker
            .send_operation(request)
            .await
            .map(Response::new)
    }

    async fn wake_session(
        &self,
        request: Request<pb::SessionRoute>,
    ) -> Result<Response<pb::WakeSessionResponse>, Status> {
        self.invoker.wake_session(request).await.map(Response::new)
    }

    async fn cancel_operation(
        &self,
        request: Request<pb::CancelOperationRequest>,
    ) -> Result<Response<pb::CancelOperationResponse>, Status> {
        self.invoker
            .cancel_operation(request)
            .await
            .map(Response::new)
    }

    async fn read_file(
        &self,
        request: Request<pb::ReadFileRequest>,
    ) -> Result<Response<rs::ReadSessionFileResponse>, Status> {
        self.invoker.read_file(request).await.map(Response::new)
    }

    async fn list_files(
        &self,
        request: Request<pb::ListFilesRequest>,
    ) -> Result<Response<rs::ListSessionFilesResponse>, Status> {
        self.invoker.list_files(request).await.map(Response::new)
    }

    async fn invoke(
        &self,
        request: Request<pb::InvokeRequest>,
    ) -> Result<Response<pb::InvokeResponse>, Status> {
        self.invoker.invoke(request).await.map(Response::new)
    }

    async fn run_logs(
        &self,
        request: Request<pb::RunLogsRequest>,
    ) -> Result<Response<ChunkStream>, Status> {
        let (metadata, _, request) = request.into_parts();
        // Authenticate before any work: the token first, authorized once the Run is known.
        let token = crate::functions::invoke::bearer_token(&metadata)?;
        if request.namespace != self.context.namespace {
            return Err(Status::not_found(format!(
                "this worker executes Runs of namespace {:?} only",
                self.context.namespace
            )));
        }
        if request.name.is_empty() || request.name.len() > MAX_NAME_BYTES {
            return Err(Status::invalid_argument("a Run name is 1 to 253 bytes"));
        }
        let Some(run) = self.context.run_named(&request.name) else {
            // Only a caller who may get this name learns that it is not here.
            self.invoker
                .authorize(token, &request.namespace, &request.name, "")
                .await?;
            return Err(Status::not_found(
                "no Run of that name is assigned to this worker",
            ));
        };
        let uid = run
            .uid()
            .ok_or_else(|| Status::internal("the cached Run has no UID"))?;
        self.invoker
            .authorize(token, &request.namespace, &request.name, &uid)
            .await?;
        if !request.run_uid.is_empty() && uid != request.run_uid {
            return Err(Status::not_found(
                "the Run of that name on this worker has another UID",
            ));
        }
        let current = u32::try_from(lifecycle::attempt(run.status.as_ref())).unwrap_or(1);
        let attempt = if request.attempt == 0 {
            current
        } else {
            request.attempt
        };
        let key = Key { uid, attempt };
        // A Run claimed a moment ago may not have reached the runtime server yet.
        if attempt == current && !self.context.executions.started(&key) {
            self.context.executions.wait_started(&key, START_WAIT).await;
        }
        let stream = self
            .context
            .task
            .clone()
            .logs(rs::LogsRequest {
                id: Some(key.id()),
                stream: request.stream,
                follow: request.follow,
                offset: request.offset,
            })
            .await?
            .into_inner();
        Ok(Response::new(stream.boxed()))
    }
}
