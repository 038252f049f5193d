//! What a client or server of runtimed's gRPC port needs besides the generated code: the
//! TLS of the port ([`WorkerTls`]), the channel to a worker ([`worker_channel`]), the
//! connections the port accepts ([`tls_incoming`]) and the constants both sides of an
//! invocation agree on.
//!
//! With TLS material, the port speaks mutual TLS only: runtimed presents its workload
//! certificate (issued for its worker identity, [`worker_identity`]) and requires a client
//! certificate issued by the same CA; its clients (the gateway, peer runtimeds forwarding
//! an invocation) present theirs and verify the worker as the identity of the Pod they
//! mean to reach.
//!
//! Material read from files (mounted Secrets, which cert-manager rotates) is read again
//! every interval ([`WorkerTls::watch`]). Each handshake, on either side, uses what was
//! loaded last, the CA included: a rotation serves the connections made after it, and the
//! connections already open keep theirs, so none is dropped. tonic's own TLS settings are
//! fixed once a server or an endpoint is built, so the handshakes are made here with
//! tokio-rustls, and tonic sees a connected TLS stream (with the peer's certificates, which
//! runtimed reads to tell the gateway from a peer worker).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use hyper_util::rt::TokioIo;
use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::ServerName;
use rustls::server::WebPkiClientVerifier;
use rustls::sign::SingleCertAndKey;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::server::TlsStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tonic::transport::{Channel, Endpoint, Uri};

use crate::tls_files::{self, Reload};

pub use crate::tls_files::TlsFileError as TlsError;

/// The workload name of the gateway's client certificate (`kruntimes up` issues it).
pub const GATEWAY_IDENTITY: &str = "kruntimes-gateway";
/// The last label of every worker identity ([`worker_identity`]).
pub const WORKER_IDENTITY_SUFFIX: &str = "kruntimes-worker";

/// The name a worker Pod's certificate is issued for, and what its TLS clients verify it
/// as: `POD.NAMESPACE.kruntimes-worker`. The namespace is part of it, so a worker of one
/// namespace cannot act as a worker of another that has a Pod of the same name, and no
/// worker identity is the gateway's (which has no dot). A namespace has no dot, so two
/// (namespace, Pod) pairs never make the same name.
pub fn worker_identity(namespace: &str, pod: &str) -> String {
    format!("{pod}.{namespace}.{WORKER_IDENTITY_SUFFIX}")
}

/// What a Secret of worker TLS material holds (the keys of a `kubernetes.io/tls` Secret,
/// and the CA).
pub const CERT_FILE: &str = "tls.crt";
pub const KEY_FILE: &str = "tls.key";
pub const CA_FILE: &str = "ca.crt";

/// Checks TLS material (PEM) for `identity` as it will stand at `at`: the key is the
/// certificate's; the certificate chains to a certificate of `ca_pem`; at `at` it is
/// valid, for server and for client authentication; it is valid for `identity` (a DNS
/// name; a certificate for `*.REST` is valid for `ANY.REST`). The error says what fails.
/// The controller-manager checks the material it issued with it, at a time ahead, to
/// renew it before it expires.
pub fn check_material(
    cert_pem: &str,
    key_pem: &str,
    ca_pem: &str,
    identity: &str,
    at: std::time::SystemTime,
) -> Result<(), String> {
    let provider = rustls::crypto::ring::default_provider();
    let certified = tls_files::certified_key(
        (cert_pem.as_bytes(), CERT_FILE),
        (key_pem.as_bytes(), KEY_FILE),
        &provider,
    )
    .map_err(|e| e.to_string())?;
    let leaf = certified
        .cert
        .first()
        .ok_or_else(|| format!("{CERT_FILE} holds no certificate"))?;
    let leaf = webpki::EndEntityCert::try_from(leaf)
        .map_err(|e| format!("{CERT_FILE} is not a usable certificate: {e}"))?;
    let name =
        ServerName::try_from(identity).map_err(|_| format!("{identity:?} is not a DNS name"))?;
    leaf.verify_is_valid_for_subject_name(&name)
        .map_err(|_| format!("{CERT_FILE} is not issued for {identity}"))?;
    let cas =
        tls_files::certificates("TLS CA", CA_FILE, ca_pem.as_bytes()).map_err(|e| e.to_string())?;
    let anchors = cas
        .iter()
        .map(webpki::anchor_from_trusted_cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{CA_FILE} is not a usable CA: {e}"))?;
    let seconds = at
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let time = rustls::pki_types::UnixTime::since_unix_epoch(Duration::from_secs(seconds));
    let intermediates = certified.cert.get(1..).unwrap_or_default();
    for (usage, what) in [
        (webpki::KeyUsage::server_auth(), "server"),
        (webpki::KeyUsage::client_auth(), "client"),
    ] {
        leaf.verify_for_usage(
            provider.signature_verification_algorithms.all,
            &anchors,
            intermediates,
            time,
            usage,
            None,
            None,
        )
        .map_err(|e| format!("{CERT_FILE} does not verify for {what} authentication: {e}"))?;
    }
    Ok(())
}

/// The default and the longest invocation timeout.
pub const DEFAULT_INVOKE_TIMEOUT: Duration = Duration::from_secs(60);
pub const MAX_INVOKE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a call waits for the ownership cache to show a Run it does not show serving
/// yet (a client may have seen the Run Ready a moment before this cache did).
pub const CACHE_GRACE: Duration = Duration::from_millis(500);

/// A TLS handshake on the gRPC port, either side, may take this long.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The most handshakes the port runs at once; the next connection waits in the listen
/// backlog until one ends.
const MAX_HANDSHAKES: usize = 256;
/// Handshaken connections waiting for the gRPC server to take them.
const ACCEPTED_QUEUE: usize = 64;
/// The pause after a failed `accept` (out of file descriptors), so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// Failed `accept`s are logged at most this often.
const ACCEPT_WARN_INTERVAL: Duration = Duration::from_secs(1);

/// The TLS material of a workload that speaks to runtimed's gRPC port: its certificate,
/// its key and the CA that verifies its peers. A runtimed serves with it and presents it
/// as a client when it forwards; the gateway presents it as a client.
///
/// Cloning shares the material: a reload is seen by every clone. `Debug` never shows the
/// key.
#[derive(Clone)]
pub struct WorkerTls(Arc<Material>);

struct Material {
    /// Where the material is read again from; `None` for material held in memory.
    files: Option<Files>,
    /// The name the certificate must be valid for ([`WorkerTls::read_as`]): material
    /// issued for another identity is refused at start and at every reload.
    identity: Option<String>,
    provider: Arc<CryptoProvider>,
    current: RwLock<Arc<Loaded>>,
}

struct Files {
    cert: PathBuf,
    key: PathBuf,
    ca: PathBuf,
}

/// What one reading of the material made.
struct Loaded {
    /// The bytes of the certificate, the key and the CA, to tell a change.
    bytes: [Vec<u8>; 3],
    /// Where the certificate and the key came from, for messages.
    cert_origin: String,
    key_origin: String,
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for WorkerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let current = self.current();
        f.debug_struct("WorkerTls")
            .field("cert", &current.cert_origin)
            .field("key", &current.key_origin)
            .field("reloads", &self.0.files.is_some())
            .finish_non_exhaustive()
    }
}

impl WorkerTls {
    /// Reads the certificate (PEM, the leaf first), the key (PEM, PKCS#8, PKCS#1 or SEC1)
    /// and the CA bundle (PEM) from files, which [`WorkerTls::watch`] reads again. Errors
    /// name the file.
    pub fn read(cert: &Path, key: &Path, ca: &Path) -> Result<WorkerTls, TlsError> {
        Self::read_checked(cert, key, ca, None)
    }

    /// [`WorkerTls::read`], and the certificate must be valid for the DNS name `identity`
    /// (a worker's [`worker_identity`], the gateway's [`GATEWAY_IDENTITY`]): a mounted
    /// certificate issued for another workload fails at start, with a message that says
    /// so, rather than at the first handshake of each peer. A reload that brings one is
    /// refused and the material in use is kept.
    pub fn read_as(
        cert: &Path,
        key: &Path,
        ca: &Path,
        identity: &str,
    ) -> Result<WorkerTls, TlsError> {
        Self::read_checked(cert, key, ca, Some(identity.to_owned()))
    }

    fn read_checked(
        cert: &Path,
        key: &Path,
        ca: &Path,
        identity: Option<String>,
    ) -> Result<WorkerTls, TlsError> {
        let files = Files {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            ca: ca.to_path_buf(),
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let loaded = files.load(&provider, identity.as_deref())?;
        Ok(WorkerTls(Arc::new(Material {
            files: Some(files),
            identity,
            provider,
            current: RwLock::new(Arc::new(loaded)),
        })))
    }

    /// The same from PEM text in memory, never reloaded (`origin` names it in errors, for
    /// example "the gateway's issued certificate").
    pub fn from_pem(
        cert_pem: String,
        key_pem: String,
        ca_pem: String,
        origin: &str,
    ) -> Result<WorkerTls, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let loaded = Loaded::parse(
            [
                cert_pem.into_bytes(),
                key_pem.into_bytes(),
                ca_pem.into_bytes(),
            ],
            [origin, origin, origin],
            &provider,
            None,
        )?;
        Ok(WorkerTls(Arc::new(Material {
            files: None,
            identity: None,
            provider,
            current: RwLock::new(Arc::new(loaded)),
        })))
    }

    fn current(&self) -> Arc<Loaded> {
        self.0.current()
    }

    /// Reads the files again and swaps in what they hold if it changed and is usable;
    /// whether it changed. Material held in memory never changes.
    pub fn reload(&self) -> Result<bool, TlsError> {
        self.0.reload()
    }

    /// Reloads every `interval` for as long as a clone of this material is held; `None`
    /// for material held in memory.
    pub fn watch(&self, interval: Duration) -> Option<tokio::task::JoinHandle<()>> {
        self.0.files.as_ref()?;
        Some(tls_files::watch(&self.0, interval, "worker TLS material"))
    }

    /// The server side as last loaded: this identity, and a client certificate required
    /// and verified against the CA. HTTP/2 by ALPN.
    pub fn server_config(&self) -> Arc<rustls::ServerConfig> {
        self.current().server.clone()
    }

    /// The client side as last loaded: this identity as the client certificate, and the
    /// server verified against the CA. HTTP/2 by ALPN.
    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        self.current().client.clone()
    }
}

impl Material {
    fn current(&self) -> Arc<Loaded> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

impl Reload for Material {
    fn reload(&self) -> Result<bool, TlsError> {
        let Some(files) = &self.files else {
            return Ok(false);
        };
        let bytes = files.read()?;
        if self.current().bytes == bytes {
            return Ok(false);
        }
        let loaded = Loaded::parse(
            bytes,
            files.origins(),
            &self.provider,
            self.identity.as_deref(),
        )?;
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(loaded);
        Ok(true)
    }
}

impl Files {
    fn read(&self) -> Result<[Vec<u8>; 3], TlsError> {
        Ok([
            tls_files::read_bounded("TLS certificate", &self.cert)?,
            tls_files::read_bounded("TLS key", &self.key)?,
            tls_files::read_bounded("TLS CA", &self.ca)?,
        ])
    }

    fn origins(&self) -> [String; 3] {
        [&self.cert, &self.key, &self.ca].map(|path| path.display().to_string())
    }

    fn load(
        &self,
        provider: &Arc<CryptoProvider>,
        identity: Option<&str>,
    ) -> Result<Loaded, TlsError> {
        Loaded::parse(self.read()?, self.origins(), provider, identity)
    }
}

impl Loaded {
    /// Checks the material (and, given an `identity`, that the certificate is valid for
    /// it) and makes both sides' configurations of it.
    fn parse<S: AsRef<str>>(
        bytes: [Vec<u8>; 3],
        [cert_origin, key_origin, ca_origin]: [S; 3],
        provider: &Arc<CryptoProvider>,
        identity: Option<&str>,
    ) -> Result<Loaded, TlsError> {
        let (cert_origin, key_origin, ca_origin) = (
            cert_origin.as_ref(),
            key_origin.as_ref(),
            ca_origin.as_ref(),
        );
        let [cert_pem, key_pem, ca_pem] = &bytes;
        let certified =
            tls_files::certified_key((cert_pem, cert_origin), (key_pem, key_origin), provider)?;
        if let Some(identity) = identity {
            let wrong = || TlsError::Identity {
                origin: cert_origin.to_owned(),
                identity: identity.to_owned(),
            };
            let name = ServerName::try_from(identity).map_err(|_| wrong())?;
            let leaf = certified.cert.first().ok_or_else(wrong)?;
            webpki::EndEntityCert::try_from(leaf)
                .map_err(|_| wrong())?
                .verify_is_valid_for_subject_name(&name)
                .map_err(|_| wrong())?;
        }
        let roots_error = |reason: String| TlsError::Roots {
            what: "TLS CA",
            origin: ca_origin.to_owned(),
            reason,
        };
        let mut roots = RootCertStore::empty();
        for cert in tls_files::certificates("TLS CA", ca_origin, ca_pem)? {
            roots.add(cert).map_err(|e| roots_error(e.to_string()))?;
        }
        let roots = Arc::new(roots);
        let versions = |e: rustls::Error| roots_error(e.to_string());
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| roots_error(e.to_string()))?;
        let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(versions)?
            .with_client_cert_verifier(verifier)
            .with_cert_resolver(Arc::new(SingleCertAndKey::from(certified.clone())));
        server.alpn_protocols = vec![b"h2".to_vec()];
        let mut client = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(versions)?
            .with_root_certificates(roots)
            .with_client_cert_resolver(Arc::new(SingleCertAndKey::from(certified)));
        client.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Loaded {
            bytes,
            cert_origin: cert_origin.to_owned(),
            key_origin: key_origin.to_owned(),
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }
}

/// Why a channel to a worker cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("the worker identity {identity:?} is not a name a certificate can be verified for")]
    Name { identity: String },
    #[error("the worker endpoint {addr} is not usable")]
    Endpoint {
        addr: SocketAddr,
        #[source]
        source: tonic::transport::Error,
    },
}

/// A channel to the runtimed at `addr` of the worker whose identity is `identity` (see
/// [`worker_identity`]): mutual TLS with the server verified as `identity` when `tls` is
/// given (each connection with the material loaded last), plaintext HTTP/2 otherwise.
/// Connects lazily, with TCP_NODELAY, and reconnects by itself.
pub fn worker_channel(
    addr: SocketAddr,
    identity: &str,
    tls: Option<&WorkerTls>,
    connect_timeout: Duration,
) -> Result<Channel, ChannelError> {
    // The scheme is `http` in both cases: with TLS, the connector below makes the
    // handshake, and tonic's own TLS (fixed at build) stays out of it.
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|source| ChannelError::Endpoint { addr, source })?
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true);
    let Some(tls) = tls else {
        return Ok(endpoint.connect_lazy());
    };
    let name = ServerName::try_from(identity.to_owned()).map_err(|_| ChannelError::Name {
        identity: identity.to_owned(),
    })?;
    let tls = tls.clone();
    // tonic bounds the whole of a connection's making, the handshake and the wait for the
    // server's first bytes included, by `connect_timeout`.
    let connector = tower::service_fn(move |_: Uri| {
        let (tls, name) = (tls.clone(), name.clone());
        async move {
            let tcp = TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            let connect = async {
                let mut stream = TlsConnector::from(tls.client_config())
                    .connect(name, tcp)
                    .await?;
                // In TLS 1.3 the client's handshake ends before the server has checked the
                // client's certificate: a refusal would come only as the answer to the first
                // call, which could then not tell whether it was served. The server speaks
                // first in HTTP/2 (its SETTINGS), so wait for that here: a refused
                // certificate fails the connection, never a call on it. This needs a server
                // that speaks HTTP/2 only, as runtimed's does (`grpc::serve`): one that also
                // accepts HTTP/1.1 reads before it writes, and every connection would wait
                // out the connect timeout.
                let mut ahead = vec![0u8; READ_AHEAD_BYTES];
                let n = stream.read(&mut ahead).await?;
                if n == 0 {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        "the worker closed the connection after the TLS handshake",
                    ));
                }
                ahead.truncate(n);
                Ok(ReadAhead {
                    ahead,
                    at: 0,
                    inner: stream,
                })
            };
            let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, connect)
                .await
                .map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake timed out")
                })??;
            Ok::<_, std::io::Error>(TokioIo::new(stream))
        }
    });
    Ok(endpoint.connect_with_connector_lazy(connector))
}

/// How much of the server's first bytes the client reads before handing the connection to
/// HTTP/2 (its SETTINGS frame is a few dozen bytes).
const READ_AHEAD_BYTES: usize = 4096;

/// A stream whose first bytes were read ahead: `ahead[at..]` is read first, then `inner`.
struct ReadAhead<T> {
    ahead: Vec<u8>,
    at: usize,
    inner: T,
}

impl<T: AsyncRead + Unpin> AsyncRead for ReadAhead<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if this.at < this.ahead.len() {
            let n = buf.remaining().min(this.ahead.len() - this.at);
            buf.put_slice(&this.ahead[this.at..this.at + n]);
            this.at += n;
            if this.at == this.ahead.len() {
                this.ahead = Vec::new();
                this.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ReadAhead<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The TLS connections `listener` accepts, with Nagle's algorithm off (a streamed answer
/// writes its events one by one, and with Nagle each would wait for the peer's delayed
/// acknowledgement of the one before, 40 ms), each handshaken with the server side of the
/// material loaded last, a client certificate required. Handshakes run concurrently, at
/// most 256 at once, each for at most 10 s; a failed one is logged at debug level and
/// never reaches the server. The listener is closed once the stream is dropped.
pub fn tls_incoming(listener: TcpListener, tls: WorkerTls) -> TlsIncoming {
    let (tx, rx) = mpsc::channel(ACCEPTED_QUEUE);
    let accept = tokio::spawn(accept_loop(listener, tls, tx));
    TlsIncoming { rx, accept }
}

/// The stream of [`tls_incoming`]. It never yields an error: a failed `accept` or
/// handshake is logged, and the loop goes on.
pub struct TlsIncoming {
    rx: mpsc::Receiver<TlsStream<TcpStream>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for TlsIncoming {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl Stream for TlsIncoming {
    type Item = std::io::Result<TlsStream<TcpStream>>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx).map(|accepted| accepted.map(Ok))
    }
}

async fn accept_loop(
    listener: TcpListener,
    tls: WorkerTls,
    tx: mpsc::Sender<TlsStream<TcpStream>>,
) {
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    let mut last_warned: Option<std::time::Instant> = None;
    loop {
        // A permit first, so a flood of connections that never finish their handshake
        // waits in the backlog rather than in memory.
        let Ok(permit) = handshakes.clone().acquire_owned().await else {
            return;
        };
        let (tcp, peer) = match listener.accept().await {
            Ok(pair) => pair,
            Err(error) => {
                // Out of file descriptors lasts: say so once a second at most.
                if last_warned.is_none_or(|at| at.elapsed() >= ACCEPT_WARN_INTERVAL) {
                    tracing::warn!(%error, "accept failed on the gRPC port");
                    last_warned = Some(std::time::Instant::now());
                }
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = TlsAcceptor::from(tls.server_config());
        let tx = tx.clone();
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                // A send fails only once the server has stopped taking connections.
                Ok(Ok(stream)) => drop(tx.send(stream).await),
                Ok(Err(error)) => {
                    tracing::debug!(%peer, %error, "TLS handshake failed on the gRPC port")
                }
                Err(_) => tracing::debug!(%peer, "TLS handshake timed out on the gRPC port"),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use futures::StreamExt;
    use kruntimes_apiserver::tls::{WorkloadFiles, issue_workload, prepare};
    use rustls::pki_types::CertificateDer;
    use tonic::codegen::http;
    use tower::{Service, ServiceExt};

    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);
    const DEADLINE: Duration = Duration::from_secs(10);

    fn issued(pki: &Path, name: &str, dir: &Path) -> WorkloadFiles {
        let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
        issue_workload(pki, name, &[ip], HOUR)
            .and_then(|cert| cert.write(dir))
            .expect("a workload certificate")
    }

    /// A CA in `dir`.
    fn ca(dir: &Path) -> PathBuf {
        prepare(dir, IpAddr::V4(Ipv4Addr::LOCALHOST)).expect("a CA");
        dir.to_path_buf()
    }

    /// Puts `from`'s files in place of `to`'s, each renamed over the old one, as the
    /// kubelet swaps a Secret volume's contents.
    fn rotate(from: &WorkloadFiles, to: &WorkloadFiles) {
        for (new, old) in [
            (&from.cert, &to.cert),
            (&from.key, &to.key),
            (&from.ca, &to.ca),
        ] {
            std::fs::rename(new, old).expect("renamed into place");
        }
    }

    #[test]
    fn a_certificate_for_another_identity_is_refused_at_start_and_at_reload() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let pki = ca(&tmp.path().join("pki"));
        let me = worker_identity("default", "w-abcde");
        let mine = issued(&pki, &me, &tmp.path().join("mine"));
        let tls = WorkerTls::read_as(&mine.cert, &mine.key, &mine.ca, &me).expect("its own");

        // Another Pod's, another namespace's and the gateway's are not this worker's.
        for (other, dir) in [
            (worker_identity("default", "w-other"), "pod"),
            (worker_identity("other", "w-abcde"), "namespace"),
            (GATEWAY_IDENTITY.to_string(), "gateway"),
        ] {
            let theirs = issued(&pki, &other, &tmp.path().join(dir));
            let error = WorkerTls::read_as(&theirs.cert, &theirs.key, &theirs.ca, &me)
                .expect_err("another identity's certificate");
            assert!(
                matches!(&error, TlsError::Identity { identity, .. } if *identity == me),
                "{error:?}"
            );
            let message = error.to_string();
            assert!(
                message.contains(&theirs.cert.display().to_string()) && message.contains(&me),
                "{message}"
            );
        }

        // A rotation to another identity's certificate is refused; the material in use
        // stays (and a later rotation to its own is taken).
        let before = tls.server_config();
        let theirs = issued(
            &pki,
            &worker_identity("default", "w-other"),
            &tmp.path().join("r"),
        );
        rotate(&theirs, &mine);
        let error = tls.reload().expect_err("another identity's rotation");
        assert!(matches!(error, TlsError::Identity { .. }), "{error:?}");
        assert!(
            Arc::ptr_eq(&before, &tls.server_config()),
            "the material in use stays"
        );
        let again = issued(&pki, &me, &tmp.path().join("again"));
        rotate(&again, &mine);
        assert!(tls.reload().expect("its own again"), "taken");
    }

    #[test]
    fn tls_files_are_checked_and_errors_name_them() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let pki = ca(&tmp.path().join("pki"));
        let w = issued(&pki, "w-abcde", &tmp.path().join("w"));
        let tls = WorkerTls::read(&w.cert, &w.key, &w.ca).expect("usable material");
        let shown = format!("{tls:?}");
        let key = std::fs::read_to_string(&w.key).expect("the key");
        let body = key.lines().nth(1).expect("a key line");
        assert!(!shown.contains(body), "Debug shows the key: {shown}");
        assert!(!tls.reload().expect("the same files"), "nothing changed");

        // Material held in memory is never read again.
        let pem = |path: &Path| std::fs::read_to_string(path).expect("PEM");
        let held = WorkerTls::from_pem(pem(&w.cert), pem(&w.key), pem(&w.ca), "issued")
            .expect("usable material");
        assert!(!held.reload().expect("nothing to read"));

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
        let error = WorkerTls::read(&w.cert, &other.key, &w.ca).expect_err("another's key");
        assert!(matches!(error, TlsError::Mismatch { .. }), "{error:?}");
        assert!(
            error.to_string().contains(&other.key.display().to_string()),
            "{error}"
        );

        // A directory (or a FIFO, a device) is refused, not read.
        let error = WorkerTls::read(tmp.path(), &w.key, &w.ca).expect_err("not a file");
        assert!(
            matches!(&error, TlsError::Read { source, .. } if source.kind() == std::io::ErrorKind::InvalidInput),
            "{error:?}"
        );

        // A file too large to be a certificate is not read.
        std::fs::write(&garbage, vec![b'x'; 70 * 1024]).expect("written");
        let error = WorkerTls::read(&w.cert, &w.key, &garbage).expect_err("too large");
        assert!(matches!(error, TlsError::TooLarge { .. }), "{error:?}");

        // The longest worker identity of Kubernetes names (a Pod and a namespace of 63
        // characters each) is issued, read and verified as a DNS name.
        let longest = worker_identity(&"n".repeat(63), &"p".repeat(63));
        let long = issued(&pki, &longest, &tmp.path().join("long"));
        let long_tls = WorkerTls::read(&long.cert, &long.key, &long.ca).expect("usable material");
        assert!(format!("{long_tls:?}").contains("long"));
        assert!(ServerName::try_from(longest.clone()).is_ok(), "{longest}");

        // A worker identity that is no DNS name cannot be verified.
        let addr = SocketAddr::from(([127, 0, 0, 1], 1));
        let error = worker_channel(addr, "not a name", Some(&tls), HOUR).expect_err("no name");
        assert!(matches!(error, ChannelError::Name { .. }), "{error:?}");
    }

    /// The smallest gRPC service: every call answers OK with no message.
    #[derive(Clone)]
    struct Ping;

    impl tonic::server::NamedService for Ping {
        const NAME: &'static str = "test.Ping";
    }

    impl Service<http::Request<tonic::body::Body>> for Ping {
        type Response = http::Response<tonic::body::Body>;
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), Self::Error>> {
            std::task::Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<tonic::body::Body>) -> Self::Future {
            let mut answer = http::Response::new(tonic::body::Body::empty());
            answer.headers_mut().insert(
                "content-type",
                http::HeaderValue::from_static("application/grpc"),
            );
            answer
                .headers_mut()
                .insert("grpc-status", http::HeaderValue::from_static("0"));
            std::future::ready(Ok(answer))
        }
    }

    /// One call on `channel`; the HTTP status of its answer.
    async fn ping(channel: &Channel) -> Result<http::StatusCode, String> {
        let mut channel = channel.clone();
        let request = http::Request::builder()
            .method("POST")
            .uri("http://worker/test.Ping/Call")
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(tonic::body::Body::empty())
            .map_err(|e| e.to_string())?;
        let call = async {
            channel
                .ready()
                .await
                .map_err(|e| crate::error_chain(&e))?
                .call(request)
                .await
                .map(|answer| answer.status())
                .map_err(|e| crate::error_chain(&e))
        };
        tokio::time::timeout(DEADLINE, call)
            .await
            .map_err(|_| "the call did not end".to_owned())?
    }

    /// The DER of the leaf the server at `addr` presents to a new connection made with
    /// `tls`'s client side, verified as `pod`.
    async fn presented(addr: SocketAddr, pod: &str, tls: &WorkerTls) -> Result<Vec<u8>, String> {
        let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let name = ServerName::try_from(pod.to_owned()).map_err(|e| e.to_string())?;
        let stream = TlsConnector::from(tls.client_config())
            .connect(name, tcp)
            .await
            .map_err(|e| e.to_string())?;
        stream
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|chain| chain.first())
            .map(|leaf| leaf.to_vec())
            .ok_or_else(|| "no certificate presented".to_owned())
    }

    /// The DER of the first certificate of a PEM file.
    fn der_of(path: &Path) -> Vec<u8> {
        let pem = std::fs::read(path).expect("a PEM file");
        tls_files::certificates("TLS certificate", "test", &pem).expect("a certificate")[0].to_vec()
    }

    /// Waits until the server has taken `n` connections in all; fails if it takes more.
    async fn taken(connections: &mut tokio::sync::watch::Receiver<usize>, n: usize) {
        let seen = tokio::time::timeout(DEADLINE, connections.wait_for(|&taken| taken >= n))
            .await
            .expect("the connections within the deadline")
            .map(|taken| *taken)
            .expect("the server counts");
        assert_eq!(seen, n, "connections the server took");
    }

    /// Issue 17 item 4: runtimed's port and its clients read their mutual TLS material
    /// again when it is rotated: a new connection, either side, uses what was loaded last
    /// (the CA included), an open connection goes on serving, a rotation that cannot be
    /// used leaves the previous material in place, and a caller without a certificate of
    /// the CA, or expecting the Pod of that name in another namespace, never gets through.
    #[tokio::test]
    async fn worker_tls_is_reloaded_for_new_connections_and_open_ones_go_on() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let me = worker_identity("default", "w-abcde");
        let first_ca = ca(&tmp.path().join("pki-a"));
        let server_files = issued(&first_ca, &me, &tmp.path().join("server"));
        let client_files = issued(&first_ca, GATEWAY_IDENTITY, &tmp.path().join("client"));
        let read = |f: &WorkloadFiles| WorkerTls::read(&f.cert, &f.key, &f.ca).expect("material");
        let (server_tls, client_tls) = (read(&server_files), read(&client_files));

        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bound");
        let addr = listener.local_addr().expect("an address");
        // Counts the connections the server takes (after their handshake): a connection
        // made again, rather than one kept open, shows here.
        let (counted, mut connections) = tokio::sync::watch::channel(0usize);
        let incoming = tls_incoming(listener, server_tls.clone()).inspect(move |_| {
            counted.send_modify(|taken| *taken += 1);
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(Ping)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                }),
        );

        let open = worker_channel(addr, &me, Some(&client_tls), DEADLINE).expect("a channel");
        assert_eq!(ping(&open).await, Ok(http::StatusCode::OK));
        taken(&mut connections, 1).await;
        assert_eq!(
            presented(addr, &me, &client_tls).await,
            Ok(der_of(&server_files.cert))
        );
        taken(&mut connections, 2).await;

        // Expecting a Pod of the same name in another namespace: the server's certificate
        // is not that Pod's.
        let elsewhere = worker_identity("other", "w-abcde");
        let wrong =
            worker_channel(addr, &elsewhere, Some(&client_tls), DEADLINE).expect("a channel");
        let error = ping(&wrong).await.expect_err("another Pod's name");
        assert!(error.contains("certificate"), "{error}");
        // A client of the right CA without a certificate of its own is refused.
        let anonymous = {
            let mut roots = RootCertStore::empty();
            roots
                .add(CertificateDer::from(der_of(&server_files.ca)))
                .expect("a root");
            let config = rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
            TlsConnector::from(Arc::new(config))
        };
        let tcp = TcpStream::connect(addr).await.expect("connected");
        let name = ServerName::try_from(me.clone()).expect("a name");
        let refused = async {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            // TLS 1.3: the client finishes first; the server's refusal comes at the read.
            let mut stream = anonymous.connect(name, tcp).await?;
            stream
                .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                .await?;
            let mut buf = [0u8; 64];
            stream.read(&mut buf).await
        };
        let outcome = tokio::time::timeout(DEADLINE, refused)
            .await
            .expect("an answer");
        assert!(
            matches!(outcome, Err(_) | Ok(0)),
            "a client without a certificate was served: {outcome:?}"
        );

        // A rotation of the server's certificate (same CA), swapped in like a Secret volume.
        let rotated = issued(&first_ca, &me, &tmp.path().join("server-2"));
        let rotated_leaf = der_of(&rotated.cert);
        rotate(&rotated, &server_files);
        assert!(server_tls.reload().expect("usable material"));
        assert_eq!(
            presented(addr, &me, &client_tls).await,
            Ok(rotated_leaf.clone())
        );
        taken(&mut connections, 3).await;
        // The connection opened before the rotation goes on serving: no new one is made.
        assert_eq!(ping(&open).await, Ok(http::StatusCode::OK));
        assert_eq!(*connections.borrow(), 3);

        // A rotation that cannot serve (a key written before its certificate) is refused;
        // the previous material stays.
        std::fs::write(&server_files.key, "not a key").expect("written");
        let error = server_tls.reload().expect_err("garbage");
        assert!(matches!(error, TlsError::Malformed { .. }), "{error:?}");
        assert_eq!(presented(addr, &me, &client_tls).await, Ok(rotated_leaf));
        taken(&mut connections, 4).await;

        // A new CA on both sides: until the client has it too, a new connection fails; once
        // it has, a new connection works.
        let second_ca = ca(&tmp.path().join("pki-b"));
        rotate(
            &issued(&second_ca, &me, &tmp.path().join("server-3")),
            &server_files,
        );
        assert!(server_tls.reload().expect("usable material"));
        let before = worker_channel(addr, &me, Some(&client_tls), DEADLINE).expect("a channel");
        let error = ping(&before)
            .await
            .expect_err("the old CA verified the new server");
        assert!(error.contains("certificate"), "{error}");
        rotate(
            &issued(&second_ca, GATEWAY_IDENTITY, &tmp.path().join("client-2")),
            &client_files,
        );
        assert!(client_tls.reload().expect("usable material"));
        // The channel that failed connects again with the new material, as the gateway's
        // and runtimed's cached channels do.
        assert_eq!(ping(&before).await, Ok(http::StatusCode::OK));
        taken(&mut connections, 5).await;
        // The connection opened with the first CA goes on serving too.
        assert_eq!(ping(&open).await, Ok(http::StatusCode::OK));
        assert_eq!(*connections.borrow(), 5);

        let _ = stop.send(());
        tokio::time::timeout(DEADLINE, server)
            .await
            .expect("the server stopped")
            .expect("the server task")
            .expect("served");
    }

    /// The task of [`WorkerTls::watch`] reads the files again every interval, swaps in a
    /// rotation by itself, and ends once no clone of the material is held.
    #[tokio::test]
    async fn the_watch_picks_up_a_rotation_and_ends_with_the_material() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let pki = ca(&tmp.path().join("pki"));
        let me = worker_identity("default", "w-abcde");
        let files = issued(&pki, &me, &tmp.path().join("w"));
        let tls = WorkerTls::read(&files.cert, &files.key, &files.ca).expect("material");
        let first = tls.server_config();
        let watch = tls
            .watch(Duration::from_millis(10))
            .expect("files are watched");
        rotate(&issued(&pki, &me, &tmp.path().join("w-2")), &files);
        // The condition is the swap; the watch reads every 10 ms.
        tokio::time::timeout(DEADLINE, async {
            while Arc::ptr_eq(&tls.server_config(), &first) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the rotation within the deadline");
        drop(tls);
        tokio::time::timeout(DEADLINE, watch)
            .await
            .expect("the watch ends once the material is gone")
            .expect("the watch task");
    }
}
