//! The gateway's serving certificate from files (a mounted Secret, which cert-manager
//! rotates): read at start, read again every interval, and swapped in for the handshakes
//! that follow when either file changed. Connections already open keep the certificate
//! they were made with, so a rotation drops none.
//!
//! A change that does not parse (a certificate written before its key, a half-written
//! file) is reported and the previous certificate stays until the files agree again.
//! Kubernetes updates a Secret volume by swapping a symlink, so both files change at once;
//! cert-manager writes a certificate and its key into one Secret.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tracing::{info, warn};

/// The largest certificate chain or key file read (a chain is a few KiB).
const MAX_FILE_BYTES: u64 = 64 * 1024;

/// Why the certificate files cannot serve.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is over {MAX_FILE_BYTES} bytes")]
    TooLarge { path: PathBuf },
    #[error("{path} holds no PEM {expected}")]
    Malformed {
        path: PathBuf,
        expected: &'static str,
    },
    #[error("the key {key} cannot sign for the certificate {cert}: {reason}")]
    Mismatch {
        cert: PathBuf,
        key: PathBuf,
        reason: String,
    },
}

/// The certificate and key files, and what was last loaded from them.
#[derive(Debug)]
pub struct ServingCert {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    current: RwLock<Loaded>,
}

#[derive(Debug, Clone)]
struct Loaded {
    /// The files' bytes, to tell a change.
    bytes: (Vec<u8>, Vec<u8>),
    certified: Arc<CertifiedKey>,
}

impl ServingCert {
    /// Loads `cert` (PEM, the leaf first) and `key` (PEM: PKCS#8, PKCS#1 or SEC1). Errors
    /// name the file.
    pub fn load(cert: &Path, key: &Path) -> Result<Arc<ServingCert>, CertError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let loaded = load(cert, key, &provider)?;
        Ok(Arc::new(ServingCert {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            provider,
            current: RwLock::new(loaded),
        }))
    }

    /// A server configuration that presents the current certificate at each handshake:
    /// no client certificates, HTTP/2 and HTTP/1.1 by ALPN.
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<rustls::ServerConfig>, rustls::Error> {
        let mut config = rustls::ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// Reads the files again; swaps in what they hold if it changed and serves. Whether the
    /// certificate changed.
    pub fn reload(&self) -> Result<bool, CertError> {
        let bytes = (read_bounded(&self.cert)?, read_bounded(&self.key)?);
        if self.read_current().bytes == bytes {
            return Ok(false);
        }
        let loaded = parse(&self.cert, &self.key, bytes, &self.provider)?;
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = loaded;
        Ok(true)
    }

    fn read_current(&self) -> Loaded {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Reloads every `interval` for as long as a server configuration holds the
    /// certificate (the task ends once the gateway that used it is gone).
    pub fn watch(self: &Arc<Self>, interval: Duration) -> tokio::task::JoinHandle<()> {
        let weak: Weak<ServingCert> = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(this) = weak.upgrade() else {
                    return;
                };
                let (cert, key) = (this.cert.clone(), this.key.clone());
                // The reads and the parse are small but blocking.
                match tokio::task::spawn_blocking(move || this.reload()).await {
                    Ok(Ok(true)) => {
                        info!(cert = %cert.display(), key = %key.display(), "loaded the rotated serving certificate")
                    }
                    Ok(Ok(false)) => {}
                    Ok(Err(error)) => {
                        warn!(error = %error, "the serving certificate files changed but cannot serve; the previous certificate stays")
                    }
                    Err(error) => warn!(error = %error, "reloading the serving certificate failed"),
                }
            }
        })
    }
}

impl ResolvesServerCert for ServingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.read_current().certified)
    }
}

fn read_bounded(path: &Path) -> Result<Vec<u8>, CertError> {
    let error = |source| CertError::Read {
        path: path.to_path_buf(),
        source,
    };
    if std::fs::metadata(path).map_err(error)?.len() > MAX_FILE_BYTES {
        return Err(CertError::TooLarge {
            path: path.to_path_buf(),
        });
    }
    let bytes = std::fs::read(path).map_err(error)?;
    // It may have grown between the two calls.
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(CertError::TooLarge {
            path: path.to_path_buf(),
        });
    }
    Ok(bytes)
}

fn load(cert: &Path, key: &Path, provider: &CryptoProvider) -> Result<Loaded, CertError> {
    let bytes = (read_bounded(cert)?, read_bounded(key)?);
    parse(cert, key, bytes, provider)
}

fn parse(
    cert: &Path,
    key: &Path,
    bytes: (Vec<u8>, Vec<u8>),
    provider: &CryptoProvider,
) -> Result<Loaded, CertError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&bytes.0)
        .collect::<Result<_, _>>()
        .ok()
        .filter(|chain: &Vec<_>| !chain.is_empty())
        .ok_or_else(|| CertError::Malformed {
            path: cert.to_path_buf(),
            expected: "certificate",
        })?;
    let private = PrivateKeyDer::from_pem_slice(&bytes.1).map_err(|_| CertError::Malformed {
        path: key.to_path_buf(),
        expected: "private key",
    })?;
    let mismatch = |reason: String| CertError::Mismatch {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        reason,
    };
    let signing = provider
        .key_provider
        .load_private_key(private)
        .map_err(|e| mismatch(e.to_string()))?;
    let certified = CertifiedKey::new(chain, signing);
    // A key that is not the certificate's would fail every handshake: refuse it here.
    certified
        .keys_match()
        .map_err(|e| mismatch(e.to_string()))?;
    Ok(Loaded {
        bytes,
        certified: Arc::new(certified),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;

    /// A certificate and key for `name`, issued by a CA kept in `pki`, written into `dir`.
    fn issue(pki: &Path, name: &str, dir: &Path) -> (PathBuf, PathBuf) {
        let localhost = IpAddr::V4(Ipv4Addr::LOCALHOST);
        kruntimes_apiserver::tls::prepare(pki, localhost).unwrap();
        let issued = kruntimes_apiserver::tls::issue_workload(
            pki,
            name,
            &[localhost],
            Duration::from_secs(3600),
        )
        .unwrap();
        std::fs::create_dir_all(dir).unwrap();
        let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        std::fs::write(&cert, issued.cert_pem).unwrap();
        std::fs::write(&key, issued.key_pem).unwrap();
        (cert, key)
    }

    fn leaf(serving: &ServingCert) -> Vec<u8> {
        serving.read_current().certified.cert[0].to_vec()
    }

    #[test]
    fn a_rotation_is_swapped_in_and_a_broken_one_keeps_the_previous_certificate() {
        let tmp = tempfile::tempdir().unwrap();
        let pki = tmp.path().join("pki");
        let (cert, key) = issue(&pki, "gateway-a", &tmp.path().join("a"));
        let serving = ServingCert::load(&cert, &key).unwrap();
        let first = leaf(&serving);
        assert!(!serving.reload().unwrap(), "nothing changed");

        // A certificate written before its key: refused, the old one stays.
        let (next_cert, next_key) = issue(&pki, "gateway-b", &tmp.path().join("b"));
        std::fs::copy(&next_cert, &cert).unwrap();
        let error = serving.reload().unwrap_err();
        assert!(matches!(error, CertError::Mismatch { .. }), "{error}");
        assert_eq!(leaf(&serving), first);

        // Both written: swapped in.
        std::fs::copy(&next_key, &key).unwrap();
        assert!(serving.reload().unwrap());
        assert_ne!(leaf(&serving), first);

        // Garbage, a missing file, an oversized one: refused, naming the file.
        std::fs::write(&key, "not a key").unwrap();
        let error = serving.reload().unwrap_err().to_string();
        assert!(
            error.contains("tls.key") && error.contains("private key"),
            "{error}"
        );
        std::fs::write(&cert, vec![b'x'; 70 * 1024]).unwrap();
        assert!(matches!(
            serving.reload().unwrap_err(),
            CertError::TooLarge { .. }
        ));
        std::fs::remove_file(&cert).unwrap();
        assert!(matches!(
            serving.reload().unwrap_err(),
            CertError::Read { .. }
        ));
        assert!(ServingCert::load(&cert, &key).is_err());
    }
}
