//! What a client or server of runtimed's gRPC port needs besides the generated code: the
//! TLS of the port ([`WorkerTls`]), the endpoint of a worker ([`worker_endpoint`]) and
//! the constants both sides of an invocation agree on.
//!
//! With TLS material, the port speaks mutual TLS only: runtimed presents its workload
//! certificate (issued for its Pod name) and requires a client certificate issued by the
//! same CA; its clients (the gateway, peer runtimeds forwarding an invocation) present
//! theirs and verify the worker as the Pod they mean to reach.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};

/// The workload name of the gateway's client certificate (`kruntimes up` issues it).
pub const GATEWAY_IDENTITY: &str = "kruntimes-gateway";
/// The default and the longest invocation timeout.
pub const DEFAULT_INVOKE_TIMEOUT: Duration = Duration::from_secs(60);
pub const MAX_INVOKE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a call waits for the ownership cache to show a Run it does not show serving
/// yet (a client may have seen the Run Ready a moment before this cache did).
pub const CACHE_GRACE: Duration = Duration::from_millis(500);

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
