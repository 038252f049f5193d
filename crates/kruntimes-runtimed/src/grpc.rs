//! runtimed's gRPC API (`kruntimes.runtimed.v1.Runtimed`), served on TCP to the gateway
//! and peer runtimeds, and the TLS of that port ([`WorkerTls`]).
//!
//! With TLS material, the port speaks mutual TLS only: runtimed presents its workload
//! certificate (issued for its Pod name) and requires a client certificate issued by the
//! same CA; its clients (the gateway, peer runtimeds forwarding an invocation) present
//! theirs and verify the worker as the Pod they mean to reach ([`worker_endpoint`]). Every
//! call also carries the caller's bearer token, which runtimed authorizes itself for the
//! Run it names ([`crate::invoke`]); `RunLogs` too.
//! Without TLS material everything is plaintext HTTP/2 (tests, and deployments that put
//! the hop inside a mesh); runtimed warns about it once at start.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use kruntimes_api::lifecycle;
use kruntimes_proto::runtime::v1 as rs;
use kruntimes_proto::runtimed::v1 as pb;
use kube::ResourceExt;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status};

use crate::executions::Key;
use crate::invoke::Invoker;
use crate::reconcile::Context;

/// How long a logs request waits for an execution that is being started.
const START_WAIT: Duration = Duration::from_secs(5);
/// The longest namespace or name accepted (DNS-1123 subdomain).
const MAX_NAME_BYTES: usize = 253;
/// A TLS handshake on the gRPC port, either side, may take this long.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest TLS file read (a certificate chain or a CA bundle is a few KiB).
const MAX_TLS_FILE_BYTES: u64 = 64 * 1024;

/// Why the TLS material of the gRPC port is unusable.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("failed to read the {what} {path}")]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the {what} {origin} is over {MAX_TLS_FILE_BYTES} bytes")]
    TooLarge { what: &'static str, origin: String },
    #[error("the {what} {origin} holds no PEM {expected}")]
    Malformed {
        what: &'static str,
        origin: String,
        expected: &'static str,
    },
    #[error("the certificate {cert} and key {key} cannot serve TLS")]
    Server {
        cert: String,
        key: String,
        #[source]
        source: tonic::transport::Error,
    },
}

/// The TLS material of a workload that speaks to runtimed's gRPC port: its certificate,
/// its key and the CA that verifies its peers. A runtimed serves with it and presents it
/// as a client when it forwards; the gateway presents it as a client.
///
/// `Debug` never shows the key.
#[derive(Clone)]
pub struct WorkerTls {
    cert_pem: String,
    key_pem: String,
    ca_pem: String,
    /// Where the certificate and key came from, for error messages.
    cert_origin: String,
    key_origin: String,
}

impl std::fmt::Debug for WorkerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerTls")
            .field("cert", &self.cert_origin)
            .field("key", &self.key_origin)
            .finish_non_exhaustive()
    }
}

impl WorkerTls {
    /// Reads the certificate (PEM, the leaf first), the key (PEM, PKCS#8, PKCS#1 or SEC1)
    /// and the CA bundle (PEM) from files. Errors name the file.
    pub fn read(cert: &Path, key: &Path, ca: &Path) -> Result<WorkerTls, TlsError> {
        let read = |what: &'static str, path: &Path| -> Result<String, TlsError> {
            let error = |source| TlsError::Read {
                what,
                path: path.to_path_buf(),
                source,
            };
            let len = std::fs::metadata(path).map_err(error)?.len();
            if len > MAX_TLS_FILE_BYTES {
                return Err(TlsError::TooLarge {
                    what,
                    origin: path.display().to_string(),
                });
            }
            std::fs::read_to_string(path).map_err(error)
        };
        WorkerTls::checked(
            (read("TLS certificate", cert)?, cert.display().to_string()),
            (read("TLS key", key)?, key.display().to_string()),
            (read("TLS CA", ca)?, ca.display().to_string()),
        )
    }

    /// The same from PEM text in memory (`origin` names it in errors, for example "the
    /// gateway's issued certificate").
    pub fn from_pem(
        cert_pem: String,
        key_pem: String,
        ca_pem: String,
        origin: &str,
    ) -> Result<WorkerTls, TlsError> {
        WorkerTls::checked(
            (cert_pem, origin.to_string()),
            (key_pem, origin.to_string()),
            (ca_pem, origin.to_string()),
        )
    }

    fn checked(
        (cert_pem, cert_origin): (String, String),
        (key_pem, key_origin): (String, String),
        (ca_pem, ca_origin): (String, String),
    ) -> Result<WorkerTls, TlsError> {
        let certificates = |what, pem: &str, origin: &str| {
            let found = CertificateDer::pem_slice_iter(pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .is_ok_and(|certs| !certs.is_empty());
            if found {
                Ok(())
            } else {
                Err(TlsError::Malformed {
                    what,
                    origin: origin.to_string(),
                    expected: "certificate",
                })
            }
        };
        certificates("TLS certificate", &cert_pem, &cert_origin)?;
        certificates("TLS CA", &ca_pem, &ca_origin)?;
        if PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).is_err() {
            return Err(TlsError::Malformed {
                what: "TLS key",
                origin: key_origin,
                expected: "private key",
            });
        }
        Ok(WorkerTls {
            cert_pem,
            key_pem,
            ca_pem,
            cert_origin,
            key_origin,
        })
    }

    fn identity(&self) -> Identity {
        Identity::from_pem(&self.cert_pem, &self.key_pem)
    }

    fn ca(&self) -> Certificate {
        Certificate::from_pem(&self.ca_pem)
    }

    /// The server side: this identity, and client certificates required and verified
    /// against the CA.
    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity())
            .client_ca_root(self.ca())
            .client_auth_optional(false)
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// The client side towards the worker Pod `pod`: this identity as the client
    /// certificate, and the server verified against the CA as `pod` (its workload name).
    pub fn client_config(&self, pod: &str) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(self.ca())
            .identity(self.identity())
            .domain_name(pod)
            .timeout(HANDSHAKE_TIMEOUT)
    }
}

/// The endpoint of the runtimed of worker Pod `pod` at `addr`: `https` with mutual TLS and
/// the server verified as `pod` when `tls` is given, plaintext `http` otherwise. Connects
/// lazily, with TCP_NODELAY.
pub fn worker_endpoint(
    addr: SocketAddr,
    pod: &str,
    tls: Option<&WorkerTls>,
    connect_timeout: Duration,
) -> Result<Endpoint, tonic::transport::Error> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))?
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true);
    match tls {
        Some(tls) => endpoint.tls_config(tls.client_config(pod)),
        None => Ok(endpoint),
    }
}

/// The gRPC server of the port: with mutual TLS when `tls` is given. Fails at once on
/// material that cannot serve (a key that does not match its certificate).
pub fn server(tls: Option<&WorkerTls>) -> Result<Server, TlsError> {
    let builder = Server::builder();
    match tls {
        Some(tls) => builder
            .tls_config(tls.server_config())
            .map_err(|source| TlsError::Server {
                cert: tls.cert_origin.clone(),
                key: tls.key_origin.clone(),
                source,
            }),
        None => Ok(builder),
    }
}

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

/// Serves the API with `server` (see [`server`]) on `listener` until `stop` completes.
pub async fn serve(
    mut server: Server,
    listener: TcpListener,
    invoker: Arc<Invoker>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    server
        .add_service(pb::runtimed_server::RuntimedServer::new(Service {
            context: invoker.context.clone(),
            invoker,
        }))
        .serve_with_incoming_shutdown(incoming(listener), stop)
        .await
}

struct Service {
    context: Arc<Context>,
    invoker: Arc<Invoker>,
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<rs::LogChunk, Status>> + Send>>;

type EventStream = crate::session_calls::EventStream;

#[tonic::async_trait]
impl pb::runtimed_server::Runtimed for Service {
    type RunLogsStream = ChunkStream;
    type SendOperationStream = EventStream;
    type DownloadFileStream = crate::session_calls::DownloadStream;

    async fn upload_file(
        &self,
        request: Request<tonic::Streaming<pb::UploadFileRequest>>,
    ) -> Result<Response<rs::UploadSessionFileResponse>, Status> {
        self.invoker.upload_file(request).await.map(Response::new)
    }

    async fn download_file(
        &self,
        request: Request<pb::DownloadFileRequest>,
    ) -> Result<Response<crate::session_calls::DownloadStream>, Status> {
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
        let token = crate::invoke::bearer_token(&metadata)?;
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

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use kruntimes_apiserver::tls::{WorkloadFiles, issue_workload, prepare};

    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);

    fn issued(pki: &Path, name: &str, dir: &Path) -> WorkloadFiles {
        let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
        issue_workload(pki, name, &[ip], HOUR)
            .and_then(|cert| cert.write(dir))
            .expect("a workload certificate")
    }

    #[test]
    fn tls_files_are_checked_and_errors_name_them() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let pki = tmp.path().join("pki");
        prepare(&pki, IpAddr::V4(Ipv4Addr::LOCALHOST)).expect("a CA");
        let w = issued(&pki, "w-abcde", &tmp.path().join("w"));
        let tls = WorkerTls::read(&w.cert, &w.key, &w.ca).expect("usable material");
        let shown = format!("{tls:?}");
        let key = std::fs::read_to_string(&w.key).expect("the key");
        let body = key.lines().nth(1).expect("a key line");
        assert!(!shown.contains(body), "Debug shows the key: {shown}");
        assert!(server(Some(&tls)).is_ok());
        let addr = SocketAddr::from(([127, 0, 0, 1], 1));
        assert!(worker_endpoint(addr, "w-abcde", Some(&tls), HOUR).is_ok());

        let missing = tmp.path().join("missing.crt");
        let error = WorkerTls::read(&missing, &w.key, &w.ca).expect_err("a missing file");
        assert!(error.to_string().contains("missing.crt"), "{error}");

        let garbage = tmp.path().join("garbage.pem");
        std::fs::write(&garbage, "not a certificate").expect("written");
        for (cert, key, ca) in [
            (&garbage, &w.key, &w.ca),
            (&w.cert, &garbage, &w.ca),
            (&w.cert, &w.key, &garbage),
            // A certificate where the key belongs.
            (&w.cert, &w.cert, &w.ca),
        ] {
            let error = WorkerTls::read(cert, key, ca).expect_err("malformed material");
            assert!(matches!(error, TlsError::Malformed { .. }), "{error:?}");
            let named = if key == &w.cert { &w.cert } else { &garbage };
            assert!(
                error.to_string().contains(&named.display().to_string()),
                "{error}"
            );
        }

        // Another certificate's key cannot serve this one.
        let other = issued(&pki, "w-fghij", &tmp.path().join("other"));
        let mismatched = WorkerTls::read(&w.cert, &other.key, &w.ca).expect("well-formed PEM");
        let error = server(Some(&mismatched)).expect_err("a key of another certificate");
        assert!(
            error.to_string().contains(&other.key.display().to_string()),
            "{error}"
        );
    }
}
