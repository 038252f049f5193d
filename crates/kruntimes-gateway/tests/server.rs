//! The gateway's HTTPS server against a real `kruntimes up` (started through the testkit),
//! with the gateway's own component identity, ServiceAccount tokens reviewed by the real
//! TokenReview and SubjectAccessReview APIs, and a test client that speaks HTTP/1.1 and
//! HTTP/2 over rustls.
//!
//! The worker side is an in-test tonic `Runtimed` server on 127.0.0.1:0 that serves scripted
//! chunks, published through a Pod object that points at it. It stands in for runtimed,
//! whose end-to-end path (a real worker executing a real task) is covered by the e2e tests
//! under tests/.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, ensure};
use futures::{SinkExt, Stream, StreamExt};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use k8s_openapi::api::core::v1::{Container, ContainerPort, Pod, PodSpec};
use kruntimes_api::run::{FunctionMode, RunMode, SessionMode};
use kruntimes_api::{Run, RunSpec};
use kruntimes_gateway::{Gateway, GatewayConfig};
use kruntimes_proto::runtime::v1::session_operation_event::Event;
use kruntimes_proto::runtime::v1::{
    DownloadHeader, DownloadSessionFileResponse, FileEntry, ListSessionFilesResponse, LogChunk,
    LogStream, OperationCompleted, OperationOutput, OperationQueued, OperationStarted,
    OperationState, ReadSessionFileResponse, SessionOperationEvent, SessionState,
    UploadSessionFileResponse,
};
use kruntimes_proto::runtimed::v1::runtimed_server::{Runtimed, RuntimedServer};
use kruntimes_proto::runtimed::v1::{
    CancelOperationRequest, CancelOperationResponse, DownloadFileRequest, ListFilesRequest,
    ReadFileRequest, RunLogsRequest, SendOperationRequest, SessionInfo, SessionRoute,
    UploadFileRequest,
};
use kruntimes_testkit::{Options, Server, setup, within};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

/// The longest one test may take, server start included.
const TEST_DEADLINE: Duration = Duration::from_secs(240);
/// The longest one wait for a condition may take.
const WAIT: Duration = Duration::from_secs(30);
const NS: &str = "team-a";
const OTHER_NS: &str = "team-b";
const SA: &str = "agent";
const ONE_MIB: usize = 1024 * 1024;
/// The Runtime of the session tests' Runs and of every fake worker Pod.
const SESSION_RUNTIME: &str = "bash";

// ---------------------------------------------------------------------------------------
// Log capture: no line this process logs may carry a token
// ---------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------
// An HTTPS client over hyper and rustls
// ---------------------------------------------------------------------------------------

type Raw = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// Reads from `raw` until the end of a response head; returns its status code, or `None`
/// when the connection ends first.
async fn read_head(raw: &mut Raw) -> Result<Option<u16>> {
    use tokio::io::AsyncReadExt;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match raw.read(&mut byte).await {
            Ok(0) | Err(_) => return Ok(None),
            Ok(_) => head.push(byte[0]),
        }
        ensure!(head.len() < 64 * 1024, "a response head over 64 KiB");
    }
    let text = String::from_utf8_lossy(&head);
    let code = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("not a response head: {text:?}"))?;
    Ok(Some(code))
}

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Version {
    H1,
    H2,
}

#[derive(Clone)]
struct Https {
    addr: SocketAddr,
    roots: Arc<rustls::RootCertStore>,
}

/// A response read to its end.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Checks a JSON error answer and returns its message.
    fn expect_error(&self, code: u16, reason: &str) -> Result<String> {
        ensure!(
            self.status.as_u16() == code,
            "expected {code} {reason}, got {}: {}",
            self.status,
            self.text()
        );
        ensure!(
            self.headers.get(header::CONTENT_TYPE)
                == Some(&HeaderValue::from_static("application/json")),
            "an error answer is not JSON: {:?}",
            self.headers
        );
        let body: Value = serde_json::from_slice(&self.body).context("parse the error body")?;
        ensure!(
            body["code"] == code && body["reason"] == reason,
            "expected code {code} reason {reason}, got {body}"
        );
        let message = body["message"]
            .as_str()
            .context("the error has no message")?;
        ensure!(
            !message.is_empty() && message.len() <= 1024,
            "bad message {message:?}"
        );
        Ok(message.to_string())
    }
}

impl Https {
    fn new(addr: SocketAddr, ca_pem: &str) -> Result<Https> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots.add(cert.context("parse the CA")?)?;
        }
        Ok(Https {
            addr,
            roots: Arc::new(roots),
        })
    }

    /// Sends one request on a new connection and returns the response head and its body.
    async fn send<B>(&self, version: Version, request: Request<B>) -> Result<Response<Incoming>>
    where
        B: hyper::body::Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(self.roots.clone())
            .with_no_client_auth();
        tls.alpn_protocols = vec![match version {
            Version::H1 => b"http/1.1".to_vec(),
            Version::H2 => b"h2".to_vec(),
        }];
        let tcp = tokio::net::TcpStream::connect(self.addr).await?;
        let stream = tokio_rustls::TlsConnector::from(Arc::new(tls))
            .connect(ServerName::try_from("localhost")?, tcp)
            .await
            .context("TLS handshake with the gateway")?;
        let negotiated = stream.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
        let what = format!("{version:?} {} {}", request.method(), request.uri());
        let io = TokioIo::new(stream);
        let response = match version {
            Version::H1 => {
                ensure!(
                    negotiated.as_deref() == Some(b"http/1.1"),
                    "ALPN: {negotiated:?}"
                );
                let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
                tokio::spawn(conn);
                sender.send_request(request).await.context(what)?
            }
            Version::H2 => {
                ensure!(negotiated.as_deref() == Some(b"h2"), "ALPN: {negotiated:?}");
                let (mut sender, conn) =
                    hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
                tokio::spawn(conn);
                sender.send_request(request).await.context(what)?
            }
        };
        Ok(response)
    }

    /// HTTP/1.1 sends the path (and a Host header); HTTP/2 needs the authority.
    fn uri(&self, version: Version, path: &str) -> String {
        match version {
            Version::H1 => path.to_string(),
            Version::H2 => format!("https://localhost:{}{path}", self.addr.port()),
        }
    }

    fn request(
        &self,
        version: Version,
        method: Method,
        path: &str,
        token: Option<&str>,
        body: Bytes,
    ) -> Result<Request<Full<Bytes>>> {
        let mut builder = Request::builder()
            .method(method)
            .uri(self.uri(version, path));
        if version == Version::H1 {
            builder = builder.header(header::HOST, format!("localhost:{}", self.addr.port()));
        }
        if let Some(token) = token {
            builder = builder.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        Ok(builder.body(Full::new(body))?)
    }

    /// Opens a WebSocket on `path` (HTTP/1.1 upgrade); `Err(status)` when the gateway
    /// answers without upgrading.
    async fn websocket(
        &self,
        path: &str,
        token: Option<&str>,
    ) -> Result<std::result::Result<Socket, u16>> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(self.roots.clone())
            .with_no_client_auth();
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tcp = tokio::net::TcpStream::connect(self.addr).await?;
        let stream = tokio_rustls::TlsConnector::from(Arc::new(tls))
            .connect(ServerName::try_from("localhost")?, tcp)
            .await?;
        let mut request =
            format!("wss://localhost:{}{path}", self.addr.port()).into_client_request()?;
        if let Some(token) = token {
            request
                .headers_mut()
                .insert(header::AUTHORIZATION, format!("Bearer {token}").parse()?);
        }
        match tokio_tungstenite::client_async(request, stream).await {
            Ok((socket, _)) => Ok(Ok(socket)),
            Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
                Ok(Err(response.status().as_u16()))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// A TLS connection that speaks HTTP/1.1, for requests written by hand.
    async fn raw(&self) -> Result<Raw> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(self.roots.clone())
            .with_no_client_auth();
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tcp = tokio::net::TcpStream::connect(self.addr).await?;
        Ok(tokio_rustls::TlsConnector::from(Arc::new(tls))
            .connect(ServerName::try_from("localhost")?, tcp)
            .await?)
    }

    /// GET `path` and read the whole answer.
    async fn get(&self, version: Version, path: &str, token: Option<&str>) -> Result<Answer> {
        let request = self.request(version, Method::GET, path, token, Bytes::new())?;
        read(self.send(version, request).await?).await
    }
}

async fn read(response: Response<Incoming>) -> Result<Answer> {
    let (parts, body) = response.into_parts();
    let body = body.collect().await.context("read the body")?.to_bytes();
    Ok(Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

fn logs_path(namespace: &str, name: &str, query: &str) -> String {
    if query.is_empty() {
        format!("/v1/namespaces/{namespace}/runs/{name}/logs")
    } else {
        format!("/v1/namespaces/{namespace}/runs/{name}/logs?{query}")
    }
}

// ---------------------------------------------------------------------------------------
// A scripted runtimed (stands in for `kruntimes runtimed`; see the module comment)
// ---------------------------------------------------------------------------------------

#[derive(Clone)]
enum Script {
    /// Serve these chunks of stdout and stderr, then end.
    Logs {
        stdout: Vec<Bytes>,
        stderr: Vec<Bytes>,
    },
    /// Serve one chunk, then stay open until [`FakeRuntimed::release`] lets one stream end.
    Hold(Bytes),
    /// Serve one chunk, then fail once [`FakeRuntimed::release`] lets one stream go on.
    FailAfter(Bytes),
    /// Refuse the call with this code.
    Refuse(tonic::Code),
}

#[derive(Clone)]
struct FakeRuntimed {
    /// By Run name.
    scripts: Arc<Mutex<HashMap<String, Script>>>,
    seen: Arc<Mutex<Vec<RunLogsRequest>>>,
    release: Arc<Semaphore>,
    /// Session calls seen, by kind.
    calls: Arc<Mutex<HashMap<&'static str, usize>>>,
}

/// The status the fake answers for any session.
fn session_info(route: &SessionRoute) -> SessionInfo {
    SessionInfo {
        run_name: format!("session-of-{}", route.run_uid),
        phase: "Ready".into(),
        state: SessionState::Ready as i32,
        served_by: "worker-0".into(),
        queue_size: 32,
        lease_timeout_seconds: 30,
        lease_expires_at: Some(kruntimes_proto::prost_types::Timestamp {
            seconds: 1_796_032_800,
            nanos: 0,
        }),
        ..SessionInfo::default()
    }
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<LogChunk, tonic::Status>> + Send>>;

fn chunks(stream: LogStream, data: Vec<Bytes>) -> Vec<Result<LogChunk, tonic::Status>> {
    let mut offset = 0u64;
    data.into_iter()
        .map(|bytes| {
            let chunk = LogChunk {
                stream: stream as i32,
                offset,
                data: bytes.to_vec(),
            };
            offset += bytes.len() as u64;
            Ok(chunk)
        })
        .collect()
}

type EventStream = Pin<Box<dyn Stream<Item = Result<SessionOperationEvent, tonic::Status>> + Send>>;
type DownloadStream =
    Pin<Box<dyn Stream<Item = Result<DownloadSessionFileResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl Runtimed for FakeRuntimed {
    type RunLogsStream = ChunkStream;
    type SendOperationStream = EventStream;
    type DownloadFileStream = DownloadStream;

    /// Counts the data bytes of the stream and answers them, after its `end`.
    async fn upload_file(
        &self,
        request: tonic::Request<tonic::Streaming<UploadFileRequest>>,
    ) -> Result<tonic::Response<UploadSessionFileResponse>, tonic::Status> {
        use kruntimes_proto::runtimed::v1::upload_file_request::Part;
        self.record("upload");
        let mut stream = request.into_inner();
        let mut size = 0u64;
        while let Some(message) = stream.message().await? {
            match message.part {
                Some(Part::Data(data)) => size += data.len() as u64,
                Some(Part::End(_)) => {
                    return Ok(tonic::Response::new(UploadSessionFileResponse {
                        size_bytes: size,
                        files: 1,
                    }));
                }
                _ => {}
            }
        }
        Err(tonic::Status::aborted("the upload ended without its end"))
    }

    /// As `read_file`: a file's name as its bytes, `dir` a directory, `big` refused.
    async fn download_file(
        &self,
        request: tonic::Request<DownloadFileRequest>,
    ) -> Result<tonic::Response<DownloadStream>, tonic::Status> {
        use kruntimes_proto::runtime::v1::download_session_file_response::Part;
        let path = request.into_inner().path;
        self.record("read");
        let header = |directory: bool, size: u64| DownloadSessionFileResponse {
            part: Some(Part::Header(DownloadHeader {
                directory,
                size_bytes: size,
                executable: false,
            })),
        };
        let parts = match path.as_str() {
            "big" => return Err(tonic::Status::out_of_range("the file is over 1 MiB")),
            "dir" => vec![header(true, 0)],
            _ => vec![
                header(false, path.len() as u64),
                DownloadSessionFileResponse {
                    part: Some(Part::Data(path.into_bytes())),
                },
            ],
        };
        Ok(tonic::Response::new(Box::pin(futures::stream::iter(
            parts.into_iter().map(Ok),
        ))))
    }

    async fn get_session(
        &self,
        request: tonic::Request<SessionRoute>,
    ) -> Result<tonic::Response<SessionInfo>, tonic::Status> {
        Ok(tonic::Response::new(session_info(&request.into_inner())))
    }

    async fn renew_session_lease(
        &self,
        request: tonic::Request<SessionRoute>,
    ) -> Result<tonic::Response<SessionInfo>, tonic::Status> {
        self.record("renew");
        Ok(tonic::Response::new(session_info(&request.into_inner())))
    }

    /// Admits every operation but those named `full` (the queue is full), `draining`
    /// (Finalizing) and `again` (a repeated ID); an admitted one prints its ID and ends.
    async fn send_operation(
        &self,
        request: tonic::Request<SendOperationRequest>,
    ) -> Result<tonic::Response<EventStream>, tonic::Status> {
        let operation = request.into_inner().operation.unwrap_or_default();
        let id = match operation.operation_id.as_str() {
            "full" => return Err(tonic::Status::resource_exhausted("the queue holds 32")),
            "draining" => return Err(tonic::Status::failed_precondition("the session drains")),
            "again" => return Err(tonic::Status::already_exists("op again was seen")),
            "" => format!("op-{}", self.record("send")),
            id => {
                self.record("send");
                id.to_string()
            }
        };
        let event = |sequence, event| {
            Ok(SessionOperationEvent {
                operation_id: id.clone(),
                sequence,
                event: Some(event),
            })
        };
        let events = vec![
            event(1, Event::Queued(OperationQueued { position: 0 })),
            event(2, Event::Started(OperationStarted {})),
            event(
                3,
                Event::Output(OperationOutput {
                    stream: LogStream::Stdout as i32,
                    data: id.clone().into_bytes(),
                    truncated: false,
                }),
            ),
            event(
                4,
                Event::Completed(OperationCompleted {
                    state: OperationState::Succeeded as i32,
                    reason: "Completed".into(),
                    exit_code: Some(0),
                    ..OperationCompleted::default()
                }),
            ),
        ];
        Ok(tonic::Response::new(futures::stream::iter(events).boxed()))
    }

    async fn wake_session(
        &self,
        _: tonic::Request<kruntimes_proto::runtimed::v1::SessionRoute>,
    ) -> Result<tonic::Response<kruntimes_proto::runtimed::v1::WakeSessionResponse>, tonic::Status>
    {
        Err(tonic::Status::unimplemented("the fake wakes nothing"))
    }

    async fn cancel_operation(
        &self,
        request: tonic::Request<CancelOperationRequest>,
    ) -> Result<tonic::Response<CancelOperationResponse>, tonic::Status> {
        let found = request.into_inner().operation_id == "op-1";
        Ok(tonic::Response::new(CancelOperationResponse {
            found,
            state: OperationState::Cancelled as i32,
        }))
    }

    /// `dir` is a directory, `big` too large; any other file holds its own path.
    async fn read_file(
        &self,
        request: tonic::Request<ReadFileRequest>,
    ) -> Result<tonic::Response<ReadSessionFileResponse>, tonic::Status> {
        let path = request.into_inner().path;
        self.record("read");
        match path.as_str() {
            "big" => Err(tonic::Status::out_of_range("the file is over 1 MiB")),
            "dir" => Ok(tonic::Response::new(ReadSessionFileResponse {
                directory: true,
                ..ReadSessionFileResponse::default()
            })),
            _ => Ok(tonic::Response::new(ReadSessionFileResponse {
                content: path.into_bytes(),
                ..ReadSessionFileResponse::default()
            })),
        }
    }

    /// One entry naming the directory and the limit asked for.
    async fn list_files(
        &self,
        request: tonic::Request<ListFilesRequest>,
    ) -> Result<tonic::Response<ListSessionFilesResponse>, tonic::Status> {
        let request = request.into_inner();
        self.record("list");
        Ok(tonic::Response::new(ListSessionFilesResponse {
            entries: vec![FileEntry {
                path: format!("{}/limit-{}", request.path, request.limit),
                directory: false,
                size_bytes: 1,
                symlink: false,
            }],
            next_page_token: request.page_token,
        }))
    }

    /// Answers every invocation with its own payload as the result. What runtimed and the
    /// runtime server do with one is tested against real workers (tests/function_mode.rs);
    /// here only the gateway's side of the path matters.
    async fn invoke(
        &self,
        request: tonic::Request<kruntimes_proto::runtimed::v1::InvokeRequest>,
    ) -> Result<tonic::Response<kruntimes_proto::runtimed::v1::InvokeResponse>, tonic::Status> {
        self.record("invoke");
        let request = request.into_inner();
        Ok(tonic::Response::new(
            kruntimes_proto::runtimed::v1::InvokeResponse {
                invocation: Some(kruntimes_proto::runtime::v1::InvokeFunctionResponse {
                    outcome: kruntimes_proto::runtime::v1::InvocationOutcome::Succeeded as i32,
                    result: request.payload,
                    ..Default::default()
                }),
                run_name: format!("function-of-{}", request.run_uid),
                served_by: "worker-0".into(),
                hops: 0,
                attempt: 1,
            },
        ))
    }

    async fn run_logs(
        &self,
        request: tonic::Request<RunLogsRequest>,
    ) -> Result<tonic::Response<ChunkStream>, tonic::Status> {
        let request = request.into_inner();
        self.seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(request.clone());
        let script = self
            .scripts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&request.name)
            .cloned();
        let stream = LogStream::try_from(request.stream).unwrap_or(LogStream::Stdout);
        let stream: ChunkStream = match script {
            None => return Err(tonic::Status::not_found("no such execution here")),
            Some(Script::Refuse(code)) => {
                return Err(tonic::Status::new(code, "refused by the script"));
            }
            Some(Script::Logs { stdout, stderr }) => {
                let data = if stream == LogStream::Stderr {
                    stderr
                } else {
                    stdout
                };
                futures::stream::iter(chunks(stream, data)).boxed()
            }
            Some(Script::Hold(first)) => {
                let release = self.release.clone();
                let end = futures::stream::once(async move {
                    if let Ok(permit) = release.acquire().await {
                        permit.forget();
                    }
                })
                .filter_map(|()| async { None });
                futures::stream::iter(chunks(stream, vec![first]))
                    .chain(end)
                    .boxed()
            }
            Some(Script::FailAfter(first)) => {
                let release = self.release.clone();
                let failure = futures::stream::once(async move {
                    if let Ok(permit) = release.acquire().await {
                        permit.forget();
                    }
                    Err(tonic::Status::internal("the runtime server went away"))
                });
                futures::stream::iter(chunks(stream, vec![first]))
                    .chain(failure)
                    .boxed()
            }
        };
        Ok(tonic::Response::new(stream))
    }
}

impl Default for FakeRuntimed {
    fn default() -> FakeRuntimed {
        FakeRuntimed {
            scripts: Arc::default(),
            seen: Arc::default(),
            release: Arc::new(Semaphore::new(0)),
            calls: Arc::default(),
        }
    }
}

impl FakeRuntimed {
    /// Serves on 127.0.0.1:0 for the rest of the test; returns the port.
    async fn serve(&self) -> Result<u16> {
        let incoming = tonic::transport::server::TcpIncoming::bind("127.0.0.1:0".parse()?)?;
        let port = incoming.local_addr()?.port();
        let service = RuntimedServer::new(self.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming),
        );
        Ok(port)
    }

    fn script(&self, run: &str, script: Script) {
        self.scripts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(run.to_string(), script);
    }

    /// Counts a session call of `kind`; returns how many there were, this one included.
    fn record(&self, kind: &'static str) -> usize {
        let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        let count = calls.entry(kind).or_default();
        *count += 1;
        *count
    }

    fn calls(&self, kind: &'static str) -> usize {
        self.calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(kind)
            .copied()
            .unwrap_or(0)
    }

    fn seen(&self) -> Vec<RunLogsRequest> {
        self.seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

// ---------------------------------------------------------------------------------------
// The environment
// ---------------------------------------------------------------------------------------

struct Env {
    server: Server,
    admin: Client,
    gateway: Option<Gateway>,
    https: Https,
    /// A ServiceAccount token that may `get` Runs in [`NS`] (and nothing in [`OTHER_NS`]).
    token: String,
}

/// `kruntimes up`, namespaces, the token, and a gateway with the gateway's component
/// identity, configured by `configure`.
async fn env(configure: impl FnOnce(&mut GatewayConfig)) -> Result<Env> {
    common::captured_logs();
    let (server, admin) = Server::start_async(Options::default()).await?;
    for ns in [NS, OTHER_NS] {
        setup::namespace(&admin, ns).await?;
    }
    let rule = setup::kruntimes_rule(&["get"], &["runs"]);
    let token = setup::service_account_token(&admin, NS, SA, vec![rule], 600).await?;

    let kubeconfig = kube::config::Kubeconfig::read_from(server.component_kubeconfig("gateway"))
        .context("read the gateway's kubeconfig")?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    let gateway_client = Client::try_from(config)?;

    let pki = kruntimes_apiserver::tls::prepare(
        &server.data_dir().join("gateway-test-pki"),
        "127.0.0.1".parse()?,
    )?;
    let mut config = GatewayConfig::new("127.0.0.1:0".parse()?, pki.server_config);
    configure(&mut config);
    let gateway = kruntimes_gateway::start(gateway_client, config).await?;
    let https = Https::new(gateway.local_addr(), &pki.ca_pem)?;
    Ok(Env {
        server,
        admin,
        gateway: Some(gateway),
        https,
        token,
    })
}

impl Env {
    fn runs(&self, namespace: &str) -> Api<Run> {
        Api::namespaced(self.admin.clone(), namespace)
    }

    /// Creates a Pending Run and returns its UID.
    async fn create_run(&self, namespace: &str, name: &str) -> Result<String> {
        let run = self
            .runs(namespace)
            .create(
                &PostParams::default(),
                &Run::new(name, RunSpec::task("python", "main.py")),
            )
            .await
            .with_context(|| format!("create Run {namespace}/{name}"))?;
        run.uid().context("a created Run has a UID")
    }

    /// Creates a session Run on Runtime [`SESSION_RUNTIME`], Ready on worker `pod`; returns
    /// its UID.
    async fn create_session(&self, name: &str, pod: &str, pod_uid: &str) -> Result<String> {
        let mut spec = RunSpec::task(SESSION_RUNTIME, "");
        spec.mode = RunMode {
            session: Some(SessionMode::default()),
            ..RunMode::default()
        };
        let run = self
            .runs(NS)
            .create(&PostParams::default(), &Run::new(name, spec))
            .await
            .with_context(|| format!("create session Run {name}"))?;
        let status = json!({"status": {"phase": "Ready", "attempt": 1, "assignedPod": pod,
            "assignedPodUID": pod_uid, "startTime": "2025-01-01T00:00:00Z",
            "conditions": [{"type": "Ready", "status": "True"}]}});
        self.runs(NS)
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .with_context(|| format!("set session Run {name} Ready"))?;
        run.uid().context("a created Run has a UID")
    }

    /// Creates a function Run on Runtime [`SESSION_RUNTIME`], Ready (registered) on worker
    /// `pod`; returns its UID.
    async fn create_function(&self, name: &str, pod: &str, pod_uid: &str) -> Result<String> {
        let mut spec = RunSpec::task(SESSION_RUNTIME, "");
        spec.mode = RunMode {
            function: Some(FunctionMode {
                handler: "main.handle".into(),
                ..FunctionMode::default()
            }),
            ..RunMode::default()
        };
        let run = self
            .runs(NS)
            .create(&PostParams::default(), &Run::new(name, spec))
            .await
            .with_context(|| format!("create function Run {name}"))?;
        let status = json!({"status": {"phase": "Ready", "attempt": 1, "assignedPod": pod,
            "assignedPodUID": pod_uid, "startTime": "2025-01-01T00:00:00Z",
            "conditions": [{"type": "Ready", "status": "True", "reason": "FunctionRegistered"}]}});
        self.runs(NS)
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .with_context(|| format!("set function Run {name} Ready"))?;
        run.uid().context("a created Run has a UID")
    }

    /// Publishes a worker Pod whose runtimed listens on 127.0.0.1:`port`; returns its UID.
    async fn create_worker_pod(&self, name: &str, port: u16) -> Result<String> {
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), NS);
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                // A worker of Runtime `bash`, as the gateway's ownership cache selects them.
                labels: Some(
                    [(
                        "kruntimes.io/runtime".to_string(),
                        SESSION_RUNTIME.to_string(),
                    )]
                    .into(),
                ),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "runtimed".to_string(),
                    image: Some("local".to_string()),
                    ports: Some(vec![ContainerPort {
                        name: Some("runtimed".to_string()),
                        container_port: i32::from(port),
                        ..ContainerPort::default()
                    }]),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            ..Pod::default()
        };
        let pod = pods.create(&PostParams::default(), &pod).await?;
        let status = json!({"status": {"phase": "Running", "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}]}});
        pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .context("write the worker Pod's status")?;
        pod.uid().context("a created Pod has a UID")
    }

    /// Writes the Run's status as runtimed would once it claimed it.
    async fn set_running(&self, name: &str, pod: &str, pod_uid: &str) -> Result<()> {
        let status = json!({"status": {"phase": "Running", "attempt": 1, "assignedPod": pod,
            "assignedPodUID": pod_uid, "startTime": "2025-01-01T00:00:00Z"}});
        self.runs(NS)
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .with_context(|| format!("set Run {name} Running"))?;
        Ok(())
    }

    async fn metrics(&self) -> Result<String> {
        let answer = self.https.get(Version::H1, "/metrics", None).await?;
        ensure!(answer.status == StatusCode::OK, "/metrics: {answer:?}");
        Ok(answer.text())
    }

    /// The value of one sample line of /metrics (`name{labels}` as written), or 0.
    async fn metric(&self, sample: &str) -> Result<f64> {
        metric_value(&self.metrics().await?, sample)
    }

    /// Polls /metrics until `sample` has `value`.
    async fn wait_for_metric(&self, sample: &str, value: f64) -> Result<()> {
        within(WAIT, &format!("{sample} to become {value}"), async {
            loop {
                if self.metric(sample).await? == value {
                    return Ok(());
                }
                tokio::task::yield_now().await;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
    }

    async fn shutdown(mut self) -> Result<()> {
        if let Some(gateway) = self.gateway.take() {
            within(WAIT, "gateway shutdown", async {
                gateway.shutdown().await;
                Ok(())
            })
            .await?;
        }
        common::assert_token_never_logged(&self.token)
    }
}

fn metric_value(text: &str, sample: &str) -> Result<f64> {
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix(sample)
            && let Some(value) = rest.strip_prefix(' ')
        {
            return value
                .trim()
                .parse()
                .with_context(|| format!("parse {line:?}"));
        }
    }
    Ok(0.0)
}

/// Bytes that are not text, so that nothing along the way may treat them as such.
fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| ((i * 7 + usize::from(seed)) % 251) as u8)
        .collect::<Vec<u8>>()
        .into()
}

// ---------------------------------------------------------------------------------------
// The tests
// ---------------------------------------------------------------------------------------

/// `/readyz` says whether the API server answers (every request needs it to authorize its
/// caller), so a load balancer stops sending requests to a gateway cut off from it;
/// `/healthz` stays 200, so the gateway is not restarted for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_while_the_api_server_does_not_answer() -> Result<()> {
    within(TEST_DEADLINE, "the test", async {
        let mut env = env(|_| {}).await?;
        let answer = env.https.get(Version::H1, "/readyz", None).await?;
        ensure!(
            answer.status == StatusCode::OK && answer.text() == "ok",
            "{answer:?}"
        );
        env.server.kill()?;
        for version in [Version::H1, Version::H2] {
            let answer = env.https.get(version, "/readyz", None).await?;
            ensure!(
                answer.status == StatusCode::SERVICE_UNAVAILABLE
                    && answer
                        .text()
                        .starts_with("not ready: the API server did not answer"),
                "{answer:?}"
            );
            let answer = env.https.get(version, "/healthz", None).await?;
            ensure!(answer.status == StatusCode::OK, "{answer:?}");
        }
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_authenticated_and_authorized() -> Result<()> {
    within(TEST_DEADLINE, "the test", async {
        let env = env(|config| config.start_wait = Duration::from_secs(1)).await?;
        env.create_run(NS, "pending").await?;
        env.create_run(OTHER_NS, "foreign").await?;
        let https = &env.https;
        let path = logs_path(NS, "pending", "");

        for version in [Version::H1, Version::H2] {
            for probe in ["/healthz", "/readyz"] {
                let answer = https.get(version, probe, None).await?;
                ensure!(
                    answer.status == StatusCode::OK && answer.text() == "ok",
                    "{probe}: {answer:?}"
                );
            }

            // No token, or a malformed one: 401 before anything is looked up.
            let answer = https.get(version, &path, None).await?;
            answer.expect_error(401, "Unauthorized")?;
            ensure!(
                answer.headers.contains_key(header::WWW_AUTHENTICATE),
                "a 401 without WWW-Authenticate"
            );
            let mut request = https.request(version, Method::GET, &path, None, Bytes::new())?;
            request.headers_mut().insert(
                header::AUTHORIZATION,
                HeaderValue::from_static("Basic YTpi"),
            );
            read(https.send(version, request).await?)
                .await?
                .expect_error(401, "Unauthorized")?;

            // A token the API server does not know: 401, and it is never echoed or logged.
            let unknown = "kruntimes-gateway-test-unknown-token-0123456789";
            let answer = https.get(version, &path, Some(unknown)).await?;
            let message = answer.expect_error(401, "Unauthorized")?;
            ensure!(!message.contains(unknown), "the error echoes the token");
            common::assert_token_never_logged(unknown)?;

            // A valid token without access to the Run: 403.
            let foreign = logs_path(OTHER_NS, "foreign", "");
            let message = https
                .get(version, &foreign, Some(&env.token))
                .await?
                .expect_error(403, "Forbidden")?;
            ensure!(message.contains("foreign"), "{message}");
            ensure!(!message.contains(&env.token), "the error echoes the token");

            // An unknown Run: 404 for a caller who may get Runs there...
            let missing = logs_path(NS, "no-such-run", "");
            let message = https
                .get(version, &missing, Some(&env.token))
                .await?
                .expect_error(404, "NotFound")?;
            ensure!(message.contains("no-such-run"), "{message}");
            // ... and 403 for one who may not, who learns nothing about what exists.
            let missing = logs_path(OTHER_NS, "no-such-run", "");
            https
                .get(version, &missing, Some(&env.token))
                .await?
                .expect_error(403, "Forbidden")?;

            // A Pending Run: 409 NotStarted at once without follow...
            let message = https
                .get(version, &path, Some(&env.token))
                .await?
                .expect_error(409, "NotStarted")?;
            ensure!(message.contains("Pending"), "{message}");
            // ... and after the start wait (1 s here) with follow.
            let message = https
                .get(
                    version,
                    &logs_path(NS, "pending", "follow=true"),
                    Some(&env.token),
                )
                .await?
                .expect_error(409, "NotStarted")?;
            ensure!(message.contains("within 1s"), "{message}");

            // Malformed requests: 400.
            for query in ["stream=both", "follow=yes", "attempt=-1", "folow=true"] {
                https
                    .get(version, &logs_path(NS, "pending", query), Some(&env.token))
                    .await?
                    .expect_error(400, "BadRequest")
                    .with_context(|| format!("query {query}"))?;
            }
            https
                .get(
                    version,
                    &logs_path("Not_A_Namespace", "x", ""),
                    Some(&env.token),
                )
                .await?
                .expect_error(400, "BadRequest")?;

            // Unknown routes and methods answer JSON too.
            https
                .get(version, "/v1/nothing-here", Some(&env.token))
                .await?
                .expect_error(404, "NotFound")?;
            let request = https.request(
                version,
                Method::DELETE,
                &path,
                Some(&env.token),
                Bytes::new(),
            )?;
            read(https.send(version, request).await?)
                .await?
                .expect_error(405, "MethodNotAllowed")?;
        }
        env.shutdown().await
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_are_proxied_from_the_owning_worker() -> Result<()> {
    within(TEST_DEADLINE, "the test", async {
        let env = env(|_| {}).await?;
        let fake = FakeRuntimed::default();
        let port = fake.serve().await?;
        let pod_uid = env.create_worker_pod("python-abcde", port).await?;

        // Stdout in several chunks (more than one 64 KiB chunk's worth), stderr in one.
        let stdout: Vec<Bytes> = (0..5u8)
            .map(|i| pattern(40_000 + usize::from(i), i))
            .collect();
        let stderr = vec![Bytes::from_static(b"warning: \xff not utf-8\n")];
        let uid = env.create_run(NS, "done").await?;
        env.set_running("done", "python-abcde", &pod_uid).await?;
        fake.script(
            "done",
            Script::Logs {
                stdout: stdout.clone(),
                stderr: stderr.clone(),
            },
        );
        let expected_stdout: Vec<u8> = stdout.iter().flat_map(|b| b.to_vec()).collect();
        let expected_stderr: Vec<u8> = stderr.iter().flat_map(|b| b.to_vec()).collect();
        let mut proxied = 0usize;
        for version in [Version::H1, Version::H2] {
            for (query, expected) in [
                ("", &expected_stdout),
                ("stream=stdout&follow=true", &expected_stdout),
                ("stream=stderr&attempt=1", &expected_stderr),
            ] {
                let answer = env
                    .https
                    .get(version, &logs_path(NS, "done", query), Some(&env.token))
                    .await?;
                ensure!(answer.status == StatusCode::OK, "{query}: {answer:?}");
                ensure!(
                    answer.headers.get(header::CONTENT_TYPE)
                        == Some(&HeaderValue::from_static("application/octet-stream")),
                    "{:?}",
                    answer.headers
                );
                ensure!(
                    answer.body.as_ref() == expected.as_slice(),
                    "{version:?} {query}: {} bytes differ from the {} expected",
                    answer.body.len(),
                    expected.len()
                );
                proxied += expected.len();
            }
        }
        // runtimed was asked for exactly this Run, by UID, from the start.
        let seen = fake.seen();
        ensure!(seen.len() == 6, "{seen:?}");
        let expected = RunLogsRequest {
            namespace: NS.to_string(),
            name: "done".to_string(),
            run_uid: uid.clone(),
            attempt: 1,
            stream: LogStream::Stderr as i32,
            follow: false,
            offset: 0,
        };
        ensure!(seen[2] == expected, "{:?}", seen[2]);
        ensure!(
            seen[1].follow && seen[1].attempt == 0 && seen[1].stream == LogStream::Stdout as i32,
            "{:?}",
            seen[1]
        );
        ensure!(
            env.metric("kruntimes_gateway_logs_bytes_total").await? == proxied as f64,
            "logs bytes counter"
        );

        // follow=true on a Pending Run waits, then streams once runtimed claims it.
        env.create_run(NS, "later").await?;
        fake.script(
            "later",
            Script::Logs {
                stdout: vec![Bytes::from_static(b"hello\n")],
                stderr: vec![],
            },
        );
        let https = env.https.clone();
        let token = env.token.clone();
        let waiting = tokio::spawn(async move {
            https
                .get(
                    Version::H2,
                    &logs_path(NS, "later", "follow=true"),
                    Some(&token),
                )
                .await
        });
        env.wait_for_metric("kruntimes_gateway_logs_waiting_for_start", 1.0)
            .await?;
        env.set_running("later", "python-abcde", &pod_uid).await?;
        let answer = within(WAIT, "the waiting request", async {
            waiting.await.context("join")?
        })
        .await?;
        ensure!(
            answer.status == StatusCode::OK && answer.body.as_ref() == b"hello\n",
            "{answer:?}"
        );
        env.wait_for_metric("kruntimes_gateway_logs_waiting_for_start", 0.0)
            .await?;

        // runtimed's errors before the first byte become HTTP errors.
        for (name, code, status, reason) in [
            ("gone-here", tonic::Code::NotFound, 404, "NotFound"),
            (
                "elsewhere",
                tonic::Code::FailedPrecondition,
                409,
                "Conflict",
            ),
            (
                "no-runtime",
                tonic::Code::Unavailable,
                503,
                "ServiceUnavailable",
            ),
            ("broken", tonic::Code::Internal, 502, "BadGateway"),
        ] {
            env.create_run(NS, name).await?;
            env.set_running(name, "python-abcde", &pod_uid).await?;
            fake.script(name, Script::Refuse(code));
            for query in ["", "follow=true"] {
                env.https
                    .get(Version::H1, &logs_path(NS, name, query), Some(&env.token))
                    .await?
                    .expect_error(status, reason)
                    .with_context(|| format!("{code:?} {query}"))?;
            }
        }

        // A stream that fails midway: the client gets the first bytes, then a broken body.
        env.create_run(NS, "midway").await?;
        env.set_running("midway", "python-abcde", &pod_uid).await?;
        fake.script(
            "midway",
            Script::FailAfter(Bytes::from_static(b"first line\n")),
        );
        for version in [Version::H1, Version::H2] {
            let request = env.https.request(
                version,
                Method::GET,
                &logs_path(NS, "midway", "follow=true"),
                Some(&env.token),
                Bytes::new(),
            )?;
            let response = env.https.send(version, request).await?;
            ensure!(response.status() == StatusCode::OK, "{response:?}");
            let mut body = response.into_body();
            let first = body
                .frame()
                .await
                .context("the stream ended")??
                .into_data()
                .map_err(|_| anyhow!("not a data frame"))?;
            ensure!(first.as_ref() == b"first line\n", "{first:?}");
            fake.release.add_permits(1);
            let mut received = Vec::new();
            let ending = loop {
                match body.frame().await {
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            received.extend_from_slice(&data);
                        }
                    }
                    Some(Err(e)) => break Ok(e),
                    None => break Err(anyhow!("the body ended cleanly")),
                }
            };
            ending.with_context(|| format!("{version:?}: a failed stream must not end cleanly"))?;
            ensure!(received.is_empty(), "{received:?}");
        }
        ensure!(
            env.metric("kruntimes_gateway_logs_streams_failed_total")
                .await?
                == 2.0,
            "failed streams counter"
        );

        // The worker is gone: its Pod UID differs, or the Pod no longer exists.
        env.create_run(NS, "stale").await?;
        env.set_running("stale", "python-abcde", "another-pod-uid")
            .await?;
        env.create_run(NS, "orphan").await?;
        env.set_running("orphan", "python-vanished", "vanished-uid")
            .await?;
        for name in ["stale", "orphan"] {
            let message = env
                .https
                .get(Version::H1, &logs_path(NS, name, ""), Some(&env.token))
                .await?
                .expect_error(409, "WorkerGone")?;
            ensure!(message.contains("gone"), "{message}");
        }

        // A worker that cannot be reached: 503.
        let closed = {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            listener.local_addr()?.port()
        };
        let dead_uid = env.create_worker_pod("python-deadw", closed).await?;
        env.create_run(NS, "unreachable").await?;
        env.set_running("unreachable", "python-deadw", &dead_uid)
            .await?;
        env.https
            .get(
                Version::H1,
                &logs_path(NS, "unreachable", ""),
                Some(&env.token),
            )
            .await?
            .expect_error(503, "ServiceUnavailable")?;

        env.shutdown().await
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_concurrency_limit_answers_429_at_once() -> Result<()> {
    within(TEST_DEADLINE, "the test", async {
        let env = env(|config| config.max_concurrent = 2).await?;
        let fake = FakeRuntimed::default();
        let port = fake.serve().await?;
        let pod_uid = env.create_worker_pod("python-fghij", port).await?;
        env.create_run(NS, "long").await?;
        env.set_running("long", "python-fghij", &pod_uid).await?;
        fake.script("long", Script::Hold(Bytes::from_static(b"started\n")));
        let path = logs_path(NS, "long", "follow=true");

        // Two following streams, one per HTTP version, each holding a permit.
        let mut held = Vec::new();
        for version in [Version::H1, Version::H2] {
            let request = env.https.request(version, Method::GET, &path, Some(&env.token), Bytes::new())?;
            let response = env.https.send(version, request).await?;
            ensure!(response.status() == StatusCode::OK, "{response:?}");
            let mut body = response.into_body();
            let first = body
                .frame()
                .await
                .context("the stream ended")??
                .into_data()
                .map_err(|_| anyhow!("not a data frame"))?;
            ensure!(first.as_ref() == b"started\n", "{first:?}");
            held.push(body);
        }
        ensure!(
            env.metric("kruntimes_gateway_http_requests_in_flight").await? == 2.0,
            "in flight"
        );

        // The third is refused at once, on either version, and never queued.
        for version in [Version::H1, Version::H2] {
            within(Duration::from_secs(5), "a 429 answer", async {
                env.https
                    .get(version, &path, Some(&env.token))
                    .await?
                    .expect_error(429, "TooManyRequests")
                    .map(drop)
            })
            .await?;
        }
        // Probes and scrapes are exempt.
        for probe in ["/healthz", "/readyz", "/metrics"] {
            let answer = env.https.get(Version::H2, probe, None).await?;
            ensure!(answer.status == StatusCode::OK, "{probe}: {answer:?}");
        }
        let text = env.metrics().await?;
        ensure!(
            metric_value(&text, "kruntimes_gateway_http_requests_rejected_total")? == 2.0,
            "{text}"
        );
        ensure!(
            metric_value(
                &text,
                "kruntimes_gateway_http_requests_total{route=\"/v1/namespaces/{ns}/runs/{name}/logs\",code=\"429\"}"
            )? == 2.0,
            "{text}"
        );
        ensure!(
            metric_value(&text, "kruntimes_gateway_http_concurrency_limit")? == 2.0,
            "{text}"
        );

        // One stream ends: its permit is free by the time its client sees the end, so the
        // next request is admitted.
        env.create_run(NS, "short").await?;
        env.set_running("short", "python-fghij", &pod_uid).await?;
        fake.script(
            "short",
            Script::Logs {
                stdout: vec![Bytes::from_static(b"short\n")],
                stderr: vec![],
            },
        );
        fake.release.add_permits(1);
        let second = held.pop().context("two held streams")?;
        let first = held.pop().context("two held streams")?;
        let (rest, other) = within(
            WAIT,
            "a released stream ends",
            async {
                Ok(futures::future::select(
                    Box::pin(read_to_end(first)),
                    Box::pin(read_to_end(second)),
                )
                .await
                .into_inner())
            },
        )
        .await?;
        ensure!(rest?.is_empty(), "more bytes after the first chunk");
        let answer = env
            .https
            .get(Version::H1, &logs_path(NS, "short", ""), Some(&env.token))
            .await?;
        ensure!(
            answer.status == StatusCode::OK && answer.body.as_ref() == b"short\n",
            "{answer:?}"
        );
        fake.release.add_permits(1);
        within(WAIT, "the other released stream ends", other).await?;
        env.wait_for_metric("kruntimes_gateway_http_requests_in_flight", 0.0)
            .await?;

        // Shutting down ends a stream that is still following: its client sees a broken
        // body, not a clean end, and the shutdown does not wait for the worker.
        let request = env
            .https
            .request(Version::H1, Method::GET, &path, Some(&env.token), Bytes::new())?;
        let response = env.https.send(Version::H1, request).await?;
        ensure!(response.status() == StatusCode::OK, "{response:?}");
        let mut body = response.into_body();
        body.frame().await.context("the stream ended")??;
        let following = tokio::spawn(read_to_end(body));
        env.shutdown().await?;
        let ending = within(WAIT, "the following stream ends", async {
            following.await.context("join")
        })
        .await?;
        ensure!(
            ending.is_err(),
            "a stream cut by shutdown ended cleanly: {ending:?}"
        );
        fake.release.add_permits(1);
        Ok(())
    })
    .await
}

async fn read_to_end(mut body: Incoming) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            bytes.extend_from_slice(&data);
        }
    }
    Ok(bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_one_mib_get_413() -> Result<()> {
    within(TEST_DEADLINE, "the test", async {
        let env = env(|_| {}).await?;
        env.create_run(NS, "pending").await?;
        let too_big = Bytes::from(vec![b'x'; ONE_MIB + 1]);
        for path in [logs_path(NS, "pending", ""), "/healthz".to_string()] {
            for method in [Method::GET, Method::POST] {
                let request = env.https.request(
                    Version::H2,
                    method.clone(),
                    &path,
                    Some(&env.token),
                    too_big.clone(),
                )?;
                let answer = read(env.https.send(Version::H2, request).await?).await?;
                answer
                    .expect_error(413, "RequestEntityTooLarge")
                    .with_context(|| format!("{method} {path}"))?;
            }
        }
        // Exactly 1 MiB passes the limit (and then meets the route's own answer).
        let request = env.https.request(
            Version::H2,
            Method::GET,
            &logs_path(NS, "pending", ""),
            Some(&env.token),
            Bytes::from(vec![b'x'; ONE_MIB]),
        )?;
        read(env.https.send(Version::H2, request).await?)
            .await?
            .expect_error(409, "NotStarted")?;
        // A declared Content-Length over the limit is refused on the headers alone: this
        // body never sends a byte, on either version.
        for version in [Version::H1, Version::H2] {
            let never = http_body_util::StreamBody::new(futures::stream::pending::<
                Result<hyper::body::Frame<Bytes>, std::convert::Infallible>,
            >());
            let mut request = Request::builder()
                .method(Method::POST)
                .uri(env.https.uri(version, "/healthz"))
                .header(header::CONTENT_LENGTH, ONE_MIB + 1);
            if version == Version::H1 {
                request =
                    request.header(header::HOST, format!("localhost:{}", env.https.addr.port()));
            }
            let request = request.body(never)?;
            let answer = within(WAIT, "a 413 on the headers", async {
                read(env.https.send(version, request).await?).await
            })
            .await?;
            answer
                .expect_error(413, "RequestEntityTooLarge")
                .with_context(|| format!("{version:?} declared length"))?;
        }
        env.shutdown().await
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_authorizations_and_log_bytes() -> Result<()> {
    within(TEST_DEADLINE, "the test", async {
        let env = env(|_| {}).await?;
        let fake = FakeRuntimed::default();
        let port = fake.serve().await?;
        let pod_uid = env.create_worker_pod("python-klmno", port).await?;
        env.create_run(NS, "counted").await?;
        env.set_running("counted", "python-klmno", &pod_uid).await?;
        fake.script(
            "counted",
            Script::Logs {
                stdout: vec![pattern(1000, 1), pattern(234, 2)],
                stderr: vec![],
            },
        );
        let path = logs_path(NS, "counted", "");
        for _ in 0..3 {
            let answer = env.https.get(Version::H2, &path, Some(&env.token)).await?;
            ensure!(
                answer.status == StatusCode::OK && answer.body.len() == 1234,
                "{answer:?}"
            );
        }
        env.https
            .get(Version::H1, &path, None)
            .await?
            .expect_error(401, "Unauthorized")?;
        let answer = env.https.get(Version::H1, "/metrics", None).await?;
        ensure!(
            answer
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("application/openmetrics-text")),
            "{:?}",
            answer.headers
        );
        let text = answer.text();
        ensure!(text.trim_end().ends_with("# EOF"), "{text}");
        let route = "/v1/namespaces/{ns}/runs/{name}/logs";
        for (sample, value) in [
            (
                format!("kruntimes_gateway_http_requests_total{{route=\"{route}\",code=\"200\"}}"),
                3.0,
            ),
            (
                format!("kruntimes_gateway_http_requests_total{{route=\"{route}\",code=\"401\"}}"),
                1.0,
            ),
            (
                "kruntimes_gateway_authz_cache_misses_total".to_string(),
                1.0,
            ),
            ("kruntimes_gateway_authz_cache_hits_total".to_string(), 2.0),
            ("kruntimes_gateway_authz_cache_entries".to_string(), 1.0),
            (
                "kruntimes_gateway_logs_bytes_total".to_string(),
                3.0 * 1234.0,
            ),
            ("kruntimes_gateway_http_requests_in_flight".to_string(), 0.0),
            (
                "kruntimes_gateway_http_requests_rejected_total".to_string(),
                0.0,
            ),
            (
                "kruntimes_gateway_http_concurrency_limit".to_string(),
                128.0,
            ),
        ] {
            ensure!(
                metric_value(&text, &sample)? == value,
                "{sample} is not {value}:\n{text}"
            );
        }
        for family in [
            "# TYPE kruntimes_gateway_http_requests counter",
            "# TYPE kruntimes_gateway_http_requests_in_flight gauge",
            "# TYPE kruntimes_gateway_http_requests_rejected counter",
            "# TYPE kruntimes_gateway_authz_cache_hits counter",
            "# TYPE kruntimes_gateway_authz_cache_misses counter",
            "# TYPE kruntimes_gateway_logs_bytes counter",
        ] {
            ensure!(text.contains(family), "{family} missing:\n{text}");
        }
        // Earlier scrapes are counted under their own route.
        let text = env.metrics().await?;
        ensure!(
            metric_value(
                &text,
                "kruntimes_gateway_http_requests_total{route=\"/metrics\",code=\"200\"}"
            )? >= 1.0,
            "{text}"
        );
        env.shutdown().await
    })
    .await
}

/// Reads frames until `count` replies (frames other than events after the first) came;
/// returns the replies, in order, and how many other events came along.
async fn replies(socket: &mut Socket, count: usize) -> Result<(Vec<Value>, usize)> {
    let mut replies = Vec::new();
    let mut events = 0;
    while replies.len() < count {
        let message = socket
            .next()
            .await
            .context("the gateway closed the socket")??;
        let Message::Text(text) = message else {
            continue;
        };
        let frame: Value = serde_json::from_str(text.as_str())?;
        let is_reply = frame["type"] != "event" || frame.get("queued").is_some();
        if is_reply {
            replies.push(frame);
        } else {
            events += 1;
        }
    }
    Ok((replies, events))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_proxied_with_their_own_connection_limit() -> Result<()> {
    within(TEST_DEADLINE, "the test", async {
        let env = env(|config| {
            config.max_session_connections = 1;
            config.max_concurrent = 1;
        })
        .await?;
        let fake = FakeRuntimed::default();
        let port = fake.serve().await?;
        let pod_uid = env.create_worker_pod("worker-0", port).await?;
        let uid = env.create_session("sb", "worker-0", &pod_uid).await?;
        let base = format!("/v1/namespaces/{NS}/runtimes/{SESSION_RUNTIME}/sessions/{uid}");
        let https = &env.https;
        let token = Some(env.token.as_str());
        let post = |path: &str, body: &str| -> Result<Request<Full<Bytes>>> {
            https.request(
                Version::H1,
                Method::POST,
                path,
                token,
                Bytes::from(body.to_string()),
            )
        };

        // Status and lease.
        https
            .get(Version::H1, &base, None)
            .await?
            .expect_error(401, "Unauthorized")?;
        let answer = https.get(Version::H2, &base, token).await?;
        ensure!(answer.status == StatusCode::OK, "{answer:?}");
        let status: Value = serde_json::from_slice(&answer.body)?;
        ensure!(status["runUID"] == uid.as_str(), "{status}");
        ensure!(status["leaseExpiresAt"] == "2026-11-30T10:00:00Z", "{status}");
        let renewed = read(https.send(Version::H1, post(&format!("{base}:renew"), "")?).await?).await?;
        ensure!(renewed.status == StatusCode::OK, "{renewed:?}");
        ensure!(fake.calls("renew") == 1);
        https
            .get(Version::H1, &format!("{base}:nothing"), token)
            .await?
            .expect_error(404, "NotFound")?;

        // Files: bytes, a directory's listing, pages, and the limits.
        let file = https.get(Version::H1, &format!("{base}/files?path=a.txt"), token).await?;
        ensure!(file.status == StatusCode::OK && file.text() == "a.txt", "{file:?}");
        ensure!(
            file.headers.get(header::CONTENT_TYPE)
                == Some(&HeaderValue::from_static("application/octet-stream"))
        );
        let listing: Value = serde_json::from_slice(
            &https.get(Version::H1, &format!("{base}/files?path=dir"), token).await?.body,
        )?;
        ensure!(listing["entries"][0]["path"] == "dir/limit-0", "{listing}");
        let page: Value = serde_json::from_slice(
            &https
                .get(Version::H1, &format!("{base}/files?path=src&limit=1000&pageToken=t1"), token)
                .await?
                .body,
        )?;
        ensure!(page["entries"][0]["path"] == "src/limit-1000", "{page}");
        ensure!(page["nextPageToken"] == "t1", "{page}");
        for query in ["limit=0", "limit=1001", "path=a&path=b", "depth=2"] {
            https
                .get(Version::H1, &format!("{base}/files?{query}"), token)
                .await?
                .expect_error(400, "BadRequest")
                .with_context(|| query.to_string())?;
        }
        https
            .get(Version::H1, &format!("{base}/files?path=big"), token)
            .await?
            .expect_error(413, "RequestEntityTooLarge")?;

        // One operation as NDJSON, and the refusals before admission.
        let operations = format!("{base}/operations");
        let answer = read(
            https
                .send(Version::H1, post(&operations, r#"{"command": {"shell": "make"}}"#)?)
                .await?,
        )
        .await?;
        ensure!(answer.status == StatusCode::OK, "{answer:?}");
        let lines: Vec<Value> = answer
            .text()
            .lines()
            .map(serde_json::from_str)
            .collect::<std::result::Result<_, _>>()?;
        ensure!(lines.len() == 4, "{lines:?}");
        ensure!(lines[0]["queued"]["position"] == 0, "{lines:?}");
        ensure!(lines[2]["output"]["data"] == "b3AtMQ==", "{lines:?}");
        ensure!(lines[3]["completed"]["state"] == "Succeeded", "{lines:?}");
        for (id, code, reason) in [
            ("full", 429, "TooManyRequests"),
            ("draining", 409, "Conflict"),
            ("again", 409, "AlreadyExists"),
        ] {
            let body = format!(r#"{{"operationId": "{id}", "command": {{"argv": ["true"]}}}}"#);
            read(https.send(Version::H1, post(&operations, &body)?).await?)
                .await?
                .expect_error(code, reason)?;
        }
        read(https.send(Version::H1, post(&operations, r#"{"command": {}}"#)?).await?)
            .await?
            .expect_error(400, "BadRequest")?;
        let cancelled = read(
            https
                .send(Version::H1, post(&format!("{operations}/op-1:cancel"), "")?)
                .await?,
        )
        .await?;
        let cancelled: Value = serde_json::from_slice(&cancelled.body)?;
        ensure!(
            cancelled == json!({"operationId": "op-1", "found": true, "state": "Cancelled"}),
            "{cancelled}"
        );

        // The WebSocket: one reply per frame, in order; events along the way.
        let ws_path = format!("{base}/operations:ws");
        ensure!(https.websocket(&ws_path, None).await?.err() == Some(401));
        let mut socket = https
            .websocket(&ws_path, token)
            .await?
            .map_err(|status| anyhow!("the socket was refused with {status}"))?;
        ensure!(fake.calls("renew") == 2, "opening renews the lease");
        for frame in [
            json!({"type": "send", "operation": {"operationId": "a", "command": {"shell": "x"}}}),
            json!({"type": "send", "operation": {"operationId": "full", "command": {"shell": "x"}}}),
            json!({"type": "send", "operation": {"operationId": "b", "command": {"shell": "x"}}}),
            json!({"type": "cancel", "operationId": "op-1"}),
            json!({"type": "heartbeat"}),
            json!({"type": "exec"}),
        ] {
            socket.send(Message::Text(frame.to_string().into())).await?;
        }
        let (got, events) = replies(&mut socket, 6).await?;
        let kinds: Vec<String> = got
            .iter()
            .map(|r| {
                let id = r["operationId"].as_str().unwrap_or("-");
                let status = r["status"].as_u64().map_or(String::new(), |s| format!(" {s}"));
                format!("{} {id}{status}", r["type"].as_str().unwrap_or("?"))
            })
            .collect();
        ensure!(
            kinds
                == [
                    "event a",
                    "rejected full 429",
                    "event b",
                    "cancelled op-1",
                    "heartbeat -",
                    "rejected - 400"
                ],
            "{kinds:?}"
        );
        ensure!(got[4]["leaseExpiresAt"] == "2026-11-30T10:00:00Z", "{got:?}");
        ensure!(fake.calls("renew") == 3, "a heartbeat renews the lease");
        // Each admitted operation's three later events follow.
        let mut events = events;
        while events < 6 {
            match socket.next().await.context("the socket closed")?? {
                Message::Text(text) => {
                    let frame: Value = serde_json::from_str(text.as_str())?;
                    ensure!(frame["type"] == "event", "{frame}");
                    events += 1;
                }
                _ => continue,
            }
        }

        // An open socket holds no request slot (the limit is 1 here), and the socket
        // limit (1) refuses a second one at once.
        let answer = https.get(Version::H1, &base, token).await?;
        ensure!(answer.status == StatusCode::OK, "{answer:?}");
        ensure!(https.websocket(&ws_path, token).await?.err() == Some(429));
        env.wait_for_metric("kruntimes_gateway_session_connections", 1.0).await?;
        socket.close(None).await?;
        env.wait_for_metric("kruntimes_gateway_session_connections", 0.0).await?;
        let again = https.websocket(&ws_path, token).await?;
        ensure!(again.is_ok(), "a socket opens once the other closed");
        ensure!(
            env.metric("kruntimes_gateway_session_connections_rejected_total").await? == 1.0
        );
        ensure!(
            env.metric(r#"kruntimes_gateway_session_calls_total{call="send",code="429"}"#)
                .await?
                == 2.0
        );
        drop(again);
        env.shutdown().await
    })
    .await
}

/// The sum of every sample of a counter family whose labels contain `label`.
fn metric_sum(text: &str, family: &str, label: &str) -> Result<f64> {
    let mut sum = 0.0;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix(family)
            && rest.starts_with('{')
            && rest.contains(label)
            && let Some((_, value)) = rest.rsplit_once(' ')
        {
            sum += value
                .trim()
                .parse::<f64>()
                .with_context(|| format!("parse {line:?}"))?;
        }
    }
    Ok(sum)
}

/// Issue 14 item 2: 130 connections that each send an invoke with `Content-Length: 100` and
/// one byte of body, without a token or with a garbage one, held every admission permit
/// (taken before the token was checked, the body read without a timeout), so every
/// legitimate call got 429. Now such a request is answered 401 before it costs a permit or
/// a body read, and legitimate invocations, session calls and sockets are served while the
/// attack connections stay open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_slow_bodies_cannot_block_the_gateway() -> Result<()> {
    use tokio::io::AsyncWriteExt;
    within(TEST_DEADLINE, "the test", async {
        // The default limit of 128 permits.
        let env = env(|_| {}).await?;
        let fake = FakeRuntimed::default();
        let port = fake.serve().await?;
        let pod_uid = env.create_worker_pod("worker-0", port).await?;
        let function = env.create_function("fn", "worker-0", &pod_uid).await?;
        let session = env.create_session("sb", "worker-0", &pod_uid).await?;
        let invoke = format!("/v1/namespaces/{NS}/runtimes/{SESSION_RUNTIME}/functions/{function}:invoke");
        let base = format!("/v1/namespaces/{NS}/runtimes/{SESSION_RUNTIME}/sessions/{session}");
        let invoke_route = "/v1/namespaces/{ns}/runtimes/{runtime}/functions/{target}";

        let mut attack = Vec::new();
        for i in 0..130 {
            let mut raw = env.https.raw().await?;
            let auth = if i % 2 == 0 {
                String::new()
            } else {
                format!("Authorization: Bearer garbage-{i}-not-a-token\r\n")
            };
            let target = if i % 3 == 0 { invoke.clone() } else {
                format!("/v1/namespaces/{NS}/runtimes/{SESSION_RUNTIME}/functions/x:invoke")
            };
            raw.write_all(
                format!(
                    "POST {target} HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
                )
                .as_bytes(),
            )
            .await?;
            raw.flush().await?;
            attack.push(raw);
        }
        // Every attack request has reached the handlers: answered (counted by code) or in
        // flight, whichever the gateway does with it.
        within(WAIT, "the attack requests to arrive", async {
            loop {
                let text = env.metrics().await?;
                let answered = metric_sum(&text, "kruntimes_gateway_http_requests_total", invoke_route)?;
                let in_flight = metric_value(&text, "kruntimes_gateway_http_requests_in_flight")?;
                if answered + in_flight >= 130.0 {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await?;

        // While the attack connections stay open, legitimate calls are served. (The issue
        // asks for 100 ms; a generous bound keeps this test off a busy machine's timing.)
        let token = Some(env.token.as_str());
        let served = Duration::from_secs(10);
        let mut slowest = Duration::ZERO;
        for version in [Version::H1, Version::H2] {
            let started = std::time::Instant::now();
            let request = env.https.request(version, Method::POST, &invoke, token, Bytes::from_static(b"{\"n\": 1}"))?;
            let answer = within(served, "an invocation during the attack", async {
                read(env.https.send(version, request).await?).await
            })
            .await?;
            ensure!(answer.status == StatusCode::OK, "{answer:?}");
            let body: Value = serde_json::from_slice(&answer.body)?;
            ensure!(body["result"] == json!({"n": 1}), "{body}");
            slowest = slowest.max(started.elapsed());
            let started = std::time::Instant::now();
            let answer = within(served, "a session call during the attack", env.https.get(version, &base, token)).await?;
            ensure!(answer.status == StatusCode::OK, "{answer:?}");
            slowest = slowest.max(started.elapsed());
        }
        let started = std::time::Instant::now();
        let socket = within(served, "a session socket during the attack", env.https.websocket(&format!("{base}/operations:ws"), token)).await?;
        ensure!(socket.is_ok(), "the socket was refused: {:?}", socket.err());
        slowest = slowest.max(started.elapsed());
        // The figure the issue asks for, printed (not asserted: timing belongs in benchmarks).
        eprintln!("slowest legitimate call during the attack: {slowest:?}");
        // And every attack request was refused without a permit.
        let text = env.metrics().await?;
        ensure!(
            metric_value(&text, &format!("kruntimes_gateway_http_requests_total{{route=\"{invoke_route}\",code=\"401\"}}"))? == 130.0,
            "{text}"
        );
        ensure!(metric_value(&text, "kruntimes_gateway_http_requests_rejected_total")? == 0.0, "{text}");
        ensure!(fake.calls("invoke") == 2, "only the legitimate invocations reach the worker");
        drop(attack);
        drop(socket);
        env.shutdown().await
    })
    .await
}

/// Issue 14 item 2: a caller with a valid token that sends its body slowly held its permit
/// for as long as it liked. Now the body must arrive within the body read timeout (408),
/// and the permit is free again for the next caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_body_is_cut_off_and_frees_its_permit() -> Result<()> {
    use tokio::io::AsyncWriteExt;
    within(TEST_DEADLINE, "the test", async {
        let env = env(|config| {
            config.max_concurrent = 1;
            config.body_read_timeout = Duration::from_millis(300);
            config.header_read_timeout = Duration::from_millis(300);
        })
        .await?;
        let fake = FakeRuntimed::default();
        let port = fake.serve().await?;
        let pod_uid = env.create_worker_pod("worker-0", port).await?;
        let function = env.create_function("fn", "worker-0", &pod_uid).await?;
        let invoke = format!("/v1/namespaces/{NS}/runtimes/{SESSION_RUNTIME}/functions/{function}:invoke");

        // A valid token, a body that never completes: 408 once the timeout passes.
        let mut slow = env.https.raw().await?;
        slow.write_all(
            format!(
                "POST {invoke} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{",
                env.token
            )
            .as_bytes(),
        )
        .await?;
        slow.flush().await?;
        let code = within(WAIT, "the slow body's answer", read_head(&mut slow)).await?;
        ensure!(code == Some(408), "the slow body got {code:?}");
        // Its permit (the only one) is free again.
        let answer = env.https.request(Version::H1, Method::POST, &invoke, Some(&env.token), Bytes::from_static(b"1"))?;
        let answer = read(env.https.send(Version::H1, answer).await?).await?;
        ensure!(answer.status == StatusCode::OK, "{answer:?}");

        // Headers that never complete: the connection is closed.
        let mut stalled = env.https.raw().await?;
        stalled
            .write_all(format!("POST {invoke} HTTP/1.1\r\nHost: localhost\r\n").as_bytes())
            .await?;
        stalled.flush().await?;
        let code = within(WAIT, "the stalled head's connection to close", read_head(&mut stalled)).await?;
        ensure!(code.is_none() || code == Some(408), "a stalled head got {code:?}");
        env.shutdown().await
    })
    .await
}

/// A client still sending a body that was refused on its declared length reads the 413
/// and may go on writing meanwhile: the gateway reads and drops what follows for a while
/// (a lingering close) instead of resetting the connection. Before, the writes after the
/// 413 met a reset, and a client that notices a failed write first (Python's asyncio)
/// reported a broken connection instead of the 413.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_body_may_go_on_arriving_after_the_413() -> Result<()> {
    use tokio::io::AsyncWriteExt;
    within(TEST_DEADLINE, "the test", async {
        let env = env(|_| {}).await?;
        let mut raw = env.https.raw().await?;
        raw.write_all(
            format!(
                "POST /healthz HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\n\r\n",
                env.token,
                1u64 << 30
            )
            .as_bytes(),
        )
        .await?;
        raw.flush().await?;
        let code = within(WAIT, "the 413 on the declared length", read_head(&mut raw)).await?;
        ensure!(code == Some(413), "a declared 1 GiB body got {code:?}");
        let chunk = vec![b'x'; 64 * 1024];
        within(WAIT, "8 MiB more of the refused body", async {
            for _ in 0..128 {
                raw.write_all(&chunk).await.context("a write after the 413")?;
            }
            raw.flush().await.context("a flush after the 413")
        })
        .await?;
        env.shutdown().await
    })
    .await
}

/// Issue 14 item 8: with a garbage token an unknown UID got 404 (after the cache's grace
/// wait) while a known one got 401, so an unauthenticated caller learnt which UIDs exist;
/// a 403 named the Run although the caller sent only its UID; a 400 for a bad invocation ID
/// carried no `X-Kruntime-Invocation-ID`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_learn_nothing_they_did_not_send() -> Result<()> {
    within(TEST_DEADLINE, "the test", async {
        let env = env(|_| {}).await?;
        let fake = FakeRuntimed::default();
        let port = fake.serve().await?;
        let pod_uid = env.create_worker_pod("worker-0", port).await?;
        let function = env
            .create_function("secret-function-name", "worker-0", &pod_uid)
            .await?;
        let session = env
            .create_session("secret-session-name", "worker-0", &pod_uid)
            .await?;
        let unknown = "0c4e77ab-0000-4000-8000-000000000000";
        let functions = format!("/v1/namespaces/{NS}/runtimes/{SESSION_RUNTIME}/functions");
        let sessions = format!("/v1/namespaces/{NS}/runtimes/{SESSION_RUNTIME}/sessions");
        let https = &env.https;
        let garbage = "garbage-token-that-no-one-issued";

        // Known or not, a garbage token is 401.
        for uid in [function.as_str(), session.as_str(), unknown] {
            let request = https.request(
                Version::H1,
                Method::POST,
                &format!("{functions}/{uid}:invoke"),
                Some(garbage),
                Bytes::from_static(b"{}"),
            )?;
            read(https.send(Version::H1, request).await?)
                .await?
                .expect_error(401, "Unauthorized")
                .with_context(|| format!("invoke {uid}"))?;
            https
                .get(Version::H1, &format!("{sessions}/{uid}"), Some(garbage))
                .await?
                .expect_error(401, "Unauthorized")
                .with_context(|| format!("session {uid}"))?;
            https
                .get(
                    Version::H1,
                    &format!("{sessions}/{uid}/files?path=a"),
                    Some(garbage),
                )
                .await?
                .expect_error(401, "Unauthorized")
                .with_context(|| format!("files {uid}"))?;
        }

        // A valid token without access: 403 naming the UID, never the Run's name.
        let nobody = setup::service_account_token(&env.admin, NS, "nobody", vec![], 600).await?;
        for path in [
            format!("{sessions}/{session}"),
            format!("{sessions}/{session}/files?path=a"),
        ] {
            let message = https
                .get(Version::H1, &path, Some(&nobody))
                .await?
                .expect_error(403, "Forbidden")?;
            ensure!(
                !message.contains("secret-session-name"),
                "the 403 names the Run: {message}"
            );
            ensure!(message.contains(&session), "{message}");
        }
        let request = https.request(
            Version::H1,
            Method::POST,
            &format!("{functions}/{function}:invoke"),
            Some(&nobody),
            Bytes::from_static(b"{}"),
        )?;
        let message = read(https.send(Version::H1, request).await?)
            .await?
            .expect_error(403, "Forbidden")?;
        ensure!(
            !message.contains("secret-function-name"),
            "the 403 names the Run: {message}"
        );

        // A bad invocation ID: 400, with an ID of its own.
        let mut request = https.request(
            Version::H1,
            Method::POST,
            &format!("{functions}/{function}:invoke"),
            Some(&env.token),
            Bytes::from_static(b"{}"),
        )?;
        request.headers_mut().insert(
            "x-kruntime-invocation-id",
            HeaderValue::from_str(&"i".repeat(129))?,
        );
        let answer = read(https.send(Version::H1, request).await?).await?;
        answer.expect_error(400, "BadRequest")?;
        let id = answer
            .headers
            .get("x-kruntime-invocation-id")
            .context("a 400 for a bad invocation ID carries no X-Kruntime-Invocation-ID")?;
        ensure!(id.len() == 32, "{id:?}");
        ensure!(
            fake.calls("invoke") == 0 && fake.calls("read") == 0,
            "a refused call reached the worker"
        );
        env.shutdown().await
    })
    .await
}

/// Reads a socket until its close frame; its code, or `None` when it ended without one.
async fn close_code_of(socket: &mut Socket) -> Result<Option<u16>> {
    within(WAIT, "the close frame", async {
        loop {
            match socket.next().await {
                Some(Ok(Message::Close(frame))) => return Ok(frame.map(|f| u16::from(f.code))),
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => return Ok(None),
            }
        }
    })
    .await
}

/// Issue 14 item 8: session operations with `..`, absolute, NUL or empty paths reached the
/// runtime server and failed as `RuntimeServerError`; the gateway refuses them with 400.
/// WebSocket protocol violations closed the socket without a status code; RFC 6455 gives
/// them 1009 (too big), 1007 (not UTF-8) and 1002 (any other violation: a reserved bit, an
/// unmasked client frame, a reserved opcode). Each close code was checked to fail with its
/// own arm of `ws::violation` reverted (no close frame, as before the fix).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_paths_and_broken_frames_are_refused_at_the_gateway() -> Result<()> {
    use tokio_tungstenite::tungstenite::protocol::frame::Frame;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
    within(TEST_DEADLINE, "the test", async {
        let env = env(|_| {}).await?;
        let fake = FakeRuntimed::default();
        let port = fake.serve().await?;
        let pod_uid = env.create_worker_pod("worker-0", port).await?;
        let session = env.create_session("sb", "worker-0", &pod_uid).await?;
        let base = format!("/v1/namespaces/{NS}/runtimes/{SESSION_RUNTIME}/sessions/{session}");
        let https = &env.https;
        let token = Some(env.token.as_str());

        let nul = "a\u{0}b";
        let bad_paths = ["..", "../outside", "/etc/passwd", "", "a//b", nul];
        for bad in bad_paths {
            for operation in [
                json!({"writeFile": {"path": bad, "content": "eA=="}}),
                json!({"makeDirectory": {"path": bad}}),
                json!({"delete": {"path": bad}}),
                json!({"rename": {"from": bad, "to": "x"}}),
                json!({"rename": {"from": "x", "to": bad}}),
            ] {
                let request = https.request(Version::H1, Method::POST, &format!("{base}/operations"), token, Bytes::from(operation.to_string()))?;
                read(https.send(Version::H1, request).await?)
                    .await?
                    .expect_error(400, "BadRequest")
                    .with_context(|| format!("{operation}"))?;
            }
        }
        for bad in ["..", "../outside", "/etc/passwd", "a//b", "a%00b"] {
            https
                .get(Version::H1, &format!("{base}/files?path={bad}"), token)
                .await?
                .expect_error(400, "BadRequest")
                .with_context(|| format!("files {bad}"))?;
        }
        let ws = format!("{base}/operations:ws");
        let mut socket = https.websocket(&ws, token).await?.map_err(|s| anyhow!("refused with {s}"))?;
        let frame = json!({"type": "send", "operation": {"operationId": "up", "delete": {"path": "../up"}}});
        socket.send(Message::Text(frame.to_string().into())).await?;
        let (got, _) = replies(&mut socket, 1).await?;
        ensure!(got[0]["type"] == "rejected" && got[0]["status"] == 400 && got[0]["operationId"] == "up", "{got:?}");
        ensure!(
            fake.calls("send") == 0 && fake.calls("read") == 0 && fake.calls("list") == 0,
            "a bad path reached the worker"
        );

        // A frame of exactly the limit is read whole, although each socket's read buffer
        // is far smaller (issue 14 item 9: the buffers shrank, the limits stay).
        let mut largest = json!({"type": "heartbeat"}).to_string();
        largest.push_str(&" ".repeat(kruntimes_gateway::session::ws::MAX_MESSAGE_BYTES - largest.len()));
        ensure!(largest.len() > 100 * kruntimes_gateway::session::ws::READ_BUFFER_BYTES);
        socket.send(Message::Text(largest.into())).await?;
        let (got, _) = replies(&mut socket, 1).await?;
        ensure!(got[0]["type"] == "heartbeat", "{got:?}");

        // Too big: 1009. Two fragments, each within the frame limit, together over the
        // message limit, so that the gateway has read everything sent when it closes (a
        // frame whose header alone is over the limit would leave unread bytes, and the
        // kernel's reset could overtake the close frame).
        let max = kruntimes_gateway::session::ws::MAX_MESSAGE_BYTES;
        let first = Frame::message(vec![b'x'; max - 8], OpCode::Data(Data::Text), false);
        let rest = Frame::message(vec![b'x'; 16], OpCode::Data(Data::Continue), true);
        socket.send(Message::Frame(first)).await?;
        socket.send(Message::Frame(rest)).await?;
        ensure!(close_code_of(&mut socket).await? == Some(1009), "an oversized frame");
        // Not UTF-8: 1007.
        let mut socket = https.websocket(&ws, token).await?.map_err(|s| anyhow!("refused with {s}"))?;
        let frame = Frame::message(vec![0xff, 0xfe, 0x80], OpCode::Data(Data::Text), true);
        socket.send(Message::Frame(frame)).await?;
        ensure!(close_code_of(&mut socket).await? == Some(1007), "a text frame that is not UTF-8");
        // Reserved bits: 1002.
        let mut socket = https.websocket(&ws, token).await?.map_err(|s| anyhow!("refused with {s}"))?;
        let mut frame = Frame::message(b"{}".to_vec(), OpCode::Data(Data::Text), true);
        frame.header_mut().rsv1 = true;
        socket.send(Message::Frame(frame)).await?;
        ensure!(close_code_of(&mut socket).await? == Some(1002), "a frame with a reserved bit");
        // A client frame without a mask (RFC 6455 section 5.1): 1002. The client library
        // masks every frame it writes, so the bytes go to the TLS stream beneath it.
        let raw_frames: [(&str, &[u8]); 2] = [
            // FIN, text, unmasked, two bytes: "{}".
            ("an unmasked client frame", &[0x81, 0x02, b'{', b'}']),
            // FIN, reserved opcode 3, masked (a zero key), empty.
            ("a reserved opcode", &[0x83, 0x80, 0, 0, 0, 0]),
        ];
        for (what, bytes) in raw_frames {
            use tokio::io::AsyncWriteExt;
            let mut socket = https.websocket(&ws, token).await?.map_err(|s| anyhow!("refused with {s}"))?;
            socket.get_mut().write_all(bytes).await?;
            socket.get_mut().flush().await?;
            ensure!(close_code_of(&mut socket).await? == Some(1002), "{what}");
        }
        env.shutdown().await
    })
    .await
}

/// The authorizer's counters from /metrics: lookups (hits and misses), reviews sent to the
/// API server (misses that did not join one in flight) and cache flushes.
fn authz_counters(text: &str) -> Result<(f64, f64, f64)> {
    let hits = metric_value(text, "kruntimes_gateway_authz_cache_hits_total")?;
    let misses = metric_value(text, "kruntimes_gateway_authz_cache_misses_total")?;
    let coalesced = metric_value(text, "kruntimes_gateway_authz_coalesced_total")?;
    let flushes = metric_value(text, "kruntimes_gateway_authz_invalidations_total")?;
    Ok((hits + misses, misses - coalesced, flushes))
}

/// Regression (issue 14 item 10): a flush of the authorizer's cache (any RBAC change) made
/// every open WebSocket re-authorize at the same instant, each with its own TokenReview
/// and SubjectAccessReview: 1,024 sockets were 2,048 reviews at once. Re-checks of the
/// same token and Run now share one review in flight, so a flush costs one review per
/// caller and Run however many sockets it holds. Counted from the gateway's own metrics
/// against the real API server: before the fix, about one review per socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_rechecks_every_open_socket_with_one_review() -> Result<()> {
    use k8s_openapi::api::rbac::v1::{RoleBinding, RoleRef, Subject};
    const SOCKETS: usize = 32;
    within(TEST_DEADLINE, "the test", async {
        let env = env(|_| {}).await?;
        let fake = FakeRuntimed::default();
        let port = fake.serve().await?;
        let pod_uid = env.create_worker_pod("worker-0", port).await?;
        let session = env.create_session("sb", "worker-0", &pod_uid).await?;
        let ws = format!(
            "/v1/namespaces/{NS}/runtimes/{SESSION_RUNTIME}/sessions/{session}/operations:ws"
        );
        let mut sockets = Vec::with_capacity(SOCKETS);
        for _ in 0..SOCKETS {
            let socket = env.https.websocket(&ws, Some(&env.token)).await?;
            sockets.push(socket.map_err(|s| anyhow!("refused with {s}"))?);
        }
        env.wait_for_metric("kruntimes_gateway_session_connections", SOCKETS as f64)
            .await?;
        let (lookups, reviews, flushes) = authz_counters(&env.metrics().await?)?;

        // Any RBAC change flushes the cache; this one changes nobody's access.
        let binding = RoleBinding {
            metadata: ObjectMeta {
                name: Some("unrelated".into()),
                ..ObjectMeta::default()
            },
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".into(),
                kind: "ClusterRole".into(),
                name: "view".into(),
            },
            subjects: Some(vec![Subject {
                kind: "User".into(),
                name: "nobody".into(),
                api_group: Some("rbac.authorization.k8s.io".into()),
                ..Subject::default()
            }]),
        };
        Api::<RoleBinding>::namespaced(env.admin.clone(), OTHER_NS)
            .create(&PostParams::default(), &binding)
            .await?;
        // Every socket re-checks its caller.
        let (now_lookups, now_reviews, now_flushes) = within(WAIT, "every socket to re-check", async {
            loop {
                let now = authz_counters(&env.metrics().await?)?;
                if now.2 > flushes && now.0 - lookups >= SOCKETS as f64 {
                    return Ok(now);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await?;
        let (reviewed, flushed) = (now_reviews - reviews, now_flushes - flushes);
        eprintln!(
            "{SOCKETS} sockets, {flushed} flushes: {} lookups, {reviewed} reviews",
            now_lookups - lookups
        );
        ensure!(
            reviewed <= flushed,
            "{SOCKETS} sockets re-checked one caller with {reviewed} reviews after {flushed} flushes"
        );
        // They still serve.
        let socket = sockets.first_mut().context("a socket")?;
        socket
            .send(Message::Text(json!({"type": "heartbeat"}).to_string().into()))
            .await?;
        let (got, _) = replies(socket, 1).await?;
        ensure!(got[0]["type"] == "heartbeat", "{got:?}");
        env.shutdown().await
    })
    .await
}
