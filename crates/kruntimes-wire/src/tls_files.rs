//! TLS material from PEM files that change under a running process (a mounted Secret,
//! which cert-manager rotates): the bounded reads, the parse that names the bad file, and
//! the task that reads the files again every interval. The gateway's serving certificate
//! (`kruntimes_gateway::serving_cert`) and the mutual TLS of runtimed's port
//! ([`crate::worker::WorkerTls`]) both load and reload through it.
//!
//! A change that does not parse (a certificate written before its key, a half-written
//! file, garbage) is reported and the material loaded before stays until the files agree
//! again. Kubernetes updates a Secret volume by swapping a symlink, so all its files change
//! at once.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

/// The largest certificate chain, key or CA bundle file read (each is a few KiB).
pub const MAX_TLS_FILE_BYTES: u64 = 64 * 1024;

/// Why TLS material cannot be used. Each error names the file (or, for material held in
/// memory, where it came from); none shows a key.
#[derive(Debug, thiserror::Error)]
pub enum TlsFileError {
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
    #[error("the key {key} cannot sign for the certificate {cert}: {reason}")]
    Mismatch {
        cert: String,
        key: String,
        reason: String,
    },
    #[error("the {what} {origin} cannot verify peers: {reason}")]
    Roots {
        what: &'static str,
        origin: String,
        reason: String,
    },
    #[error(
        "the certificate {origin} is not issued for {identity:?}, the identity its peers \
         verify: they would refuse it"
    )]
    Identity { origin: String, identity: String },
}

/// The bytes of the regular file `path` (a symlink to one, as in a Secret volume, is
/// followed), at most [`MAX_TLS_FILE_BYTES`]; `what` names it in errors ("TLS key"). A
/// FIFO or a device is refused rather than read, so a read never blocks or grows without
/// bound.
pub fn read_bounded(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsFileError> {
    use std::io::Read;
    let error = |source| TlsFileError::Read {
        what,
        path: path.to_path_buf(),
        source,
    };
    let too_large = || TlsFileError::TooLarge {
        what,
        origin: path.display().to_string(),
    };
    if !std::fs::metadata(path).map_err(error)?.is_file() {
        return Err(error(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        )));
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|file| file.take(MAX_TLS_FILE_BYTES + 1).read_to_end(&mut bytes))
        .map_err(error)?;
    if bytes.len() as u64 > MAX_TLS_FILE_BYTES {
        return Err(too_large());
    }
    Ok(bytes)
}

/// Every certificate of a PEM text, at least one; `origin` names it in errors.
pub fn certificates(
    what: &'static str,
    origin: &str,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsFileError> {
    CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .ok()
        .filter(|certs| !certs.is_empty())
        .ok_or_else(|| TlsFileError::Malformed {
            what,
            origin: origin.to_owned(),
            expected: "certificate",
        })
}

/// A certificate chain (PEM, the leaf first) and its key (PEM: PKCS#8, PKCS#1 or SEC1),
/// checked to belong together: a key that is not the certificate's would fail every
/// handshake, so it is refused here. `(pem, origin)` each.
pub fn certified_key(
    (cert_pem, cert_origin): (&[u8], &str),
    (key_pem, key_origin): (&[u8], &str),
    provider: &CryptoProvider,
) -> Result<Arc<CertifiedKey>, TlsFileError> {
    let chain = certificates("TLS certificate", cert_origin, cert_pem)?;
    let private = PrivateKeyDer::from_pem_slice(key_pem).map_err(|_| TlsFileError::Malformed {
        what: "TLS key",
        origin: key_origin.to_owned(),
        expected: "private key",
    })?;
    let mismatch = |reason: String| TlsFileError::Mismatch {
        cert: cert_origin.to_owned(),
        key: key_origin.to_owned(),
        reason,
    };
    let signing = provider
        .key_provider
        .load_private_key(private)
        .map_err(|e| mismatch(e.to_string()))?;
    let certified = CertifiedKey::new(chain, signing);
    certified
        .keys_match()
        .map_err(|e| mismatch(e.to_string()))?;
    Ok(Arc::new(certified))
}

/// Material that can read its files again.
pub trait Reload: Send + Sync + 'static {
    /// Reads the files again and swaps in what they hold if it changed and is usable.
    /// Whether it changed.
    fn reload(&self) -> Result<bool, TlsFileError>;
}

/// Reloads `material` every `interval` for as long as something else holds it (the task
/// ends once the last server or client that used it is gone). `what` names it in the log
/// ("serving certificate").
pub fn watch<T: Reload>(
    material: &Arc<T>,
    interval: Duration,
    what: &'static str,
) -> tokio::task::JoinHandle<()> {
    let weak: Weak<T> = Arc::downgrade(material);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        // What was last warned about: files that stay broken are reported once, not at
        // every tick.
        let mut warned: Option<String> = None;
        loop {
            tick.tick().await;
            let Some(material) = weak.upgrade() else {
                return;
            };
            // The reads and the parse are small but blocking.
            let problem = match tokio::task::spawn_blocking(move || material.reload()).await {
                Ok(Ok(changed)) => {
                    if changed {
                        tracing::info!(what, "loaded the rotated TLS material");
                    }
                    None
                }
                Ok(Err(error)) => Some(crate::error_chain(&error)),
                Err(error) => Some(format!("reloading the TLS files failed: {error}")),
            };
            if let Some(problem) = &problem
                && warned.as_ref() != Some(problem)
            {
                tracing::warn!(
                    what,
                    error = %problem,
                    "the TLS files changed but cannot be used; the material loaded before stays"
                );
            }
            warned = problem;
        }
    })
}
