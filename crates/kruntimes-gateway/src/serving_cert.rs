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
use std::sync::{Arc, RwLock};
use std::time::Duration;

use kruntimes_wire::tls_files::{self, Reload};
use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

/// Why the certificate files cannot serve (each error names the file).
pub use kruntimes_wire::tls_files::TlsFileError as CertError;

/// The certificate and key files, and what was last loaded from them. `Debug` never shows
/// the key.
pub struct ServingCert {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    current: RwLock<Loaded>,
}

#[derive(Clone)]
struct Loaded {
    /// The files' bytes, to tell a change.
    bytes: (Vec<u8>, Vec<u8>),
    certified: Arc<CertifiedKey>,
}

impl std::fmt::Debug for ServingCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServingCert")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl ServingCert {
    /// Loads `cert` (PEM, the leaf first) and `key` (PEM: PKCS#8, PKCS#1 or SEC1). Errors
    /// name the file.
    pub fn load(cert: &Path, key: &Path) -> Result<Arc<ServingCert>, CertError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let loaded = parse(cert, key, read(cert, key)?, &provider)?;
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

    fn read_current(&self) -> Loaded {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Reloads every `interval` for as long as a server configuration holds the
    /// certificate (the task ends once the gateway that used it is gone).
    pub fn watch(self: &Arc<Self>, interval: Duration) -> tokio::task::JoinHandle<()> {
        tls_files::watch(self, interval, "serving certificate")
    }
}

impl Reload for ServingCert {
    /// Reads the files again; swaps in what they hold if it changed and serves. Whether the
    /// certificate changed.
    fn reload(&self) -> Result<bool, CertError> {
        let bytes = read(&self.cert, &self.key)?;
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
}

impl ResolvesServerCert for ServingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.read_current().certified)
    }
}

fn read(cert: &Path, key: &Path) -> Result<(Vec<u8>, Vec<u8>), CertError> {
    Ok((
        tls_files::read_bounded("TLS certificate", cert)?,
        tls_files::read_bounded("TLS key", key)?,
    ))
}

fn parse(
    cert: &Path,
    key: &Path,
    bytes: (Vec<u8>, Vec<u8>),
    provider: &CryptoProvider,
) -> Result<Loaded, CertError> {
    let certified = tls_files::certified_key(
        (&bytes.0, &cert.display().to_string()),
        (&bytes.1, &key.display().to_string()),
        provider,
    )?;
    Ok(Loaded { bytes, certified })
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
        let shown = format!("{serving:?}");
        let key_pem = std::fs::read_to_string(&key).unwrap();
        let body = key_pem.lines().nth(1).unwrap();
        assert!(!shown.contains(body), "Debug shows the key: {shown}");
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
