//! runtimed's gRPC API (`kruntimes.runtimed.v1.Runtimed`), served on TCP to the gateway
//! and peer runtimeds.

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
use tonic::{Request, Response, Status};

use crate::executions::Key;
use crate::invoke::Invoker;
use crate::reconcile::Context;

/// How long a logs request waits for an execution that is being started.
const START_WAIT: Duration = Duration::from_secs(5);
/// The longest namespace or name accepted (DNS-1123 subdomain).
const MAX_NAME_BYTES: usize = 253;

/// Serves the API on `listener` until `stop` completes.
pub async fn serve(
    listener: TcpListener,
    invoker: Arc<Invoker>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .add_service(pb::runtimed_server::RuntimedServer::new(Service {
            context: invoker.context.clone(),
            invoker,
        }))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), stop)
        .await
}

struct Service {
    context: Arc<Context>,
    invoker: Arc<Invoker>,
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<rs::LogChunk, Status>> + Send>>;

#[tonic::async_trait]
impl pb::runtimed_server::Runtimed for Service {
    type RunLogsStream = ChunkStream;

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
        let request = request.into_inner();
        if request.namespace != self.context.namespace {
            return Err(Status::not_found(format!(
                "this worker executes Runs of namespace {:?} only",
                self.context.namespace
            )));
        }
        if request.name.is_empty() || request.name.len() > MAX_NAME_BYTES {
            return Err(Status::invalid_argument("a Run name is 1 to 253 bytes"));
        }
        let run = self
            .context
            .run_named(&request.name)
            .ok_or_else(|| Status::not_found("no Run of that name is assigned to this worker"))?;
        if !request.run_uid.is_empty() && run.uid().as_deref() != Some(request.run_uid.as_str()) {
            return Err(Status::not_found(
                "the Run of that name on this worker has another UID",
            ));
        }
        let uid = run
            .uid()
            .ok_or_else(|| Status::internal("the cached Run has no UID"))?;
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
