//! The standalone PKI: a CA created once in the data directory, a serving certificate
//! issued by it at every start for the loopback names and the bind address, and workload
//! certificates ([`issue_workload`]) for the components that authenticate each other with
//! mutual TLS (the gateway and the workers' runtimeds; docs/task-mode.md, "Worker TLS").
//!
//! The CA key never leaves `DIR/ca.key` (mode 0600) and the process that reads it; workload
//! keys are generated per certificate and handed to the caller, who writes them where the
//! workload reads them.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::ServerConfig;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::fsutil::write_private;

/// Why the PKI could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("failed to read or write {path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to create a certificate")]
    Certificate(#[from] rcgen::Error),
    #[error(
        "the CA in {dir} does not exist (no ca.crt and ca.key); the API server creates it at start"
    )]
    NoCa { dir: String },
    #[error("cannot issue a workload certificate for {name:?}: {reason}")]
    Workload { name: String, reason: &'static str },
    #[error("failed to configure TLS")]
    Rustls(#[from] rustls::Error),
}

/// The CA and the serving configuration.
pub struct Pki {
    pub ca_pem: String,
    pub server_config: Arc<ServerConfig>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TlsError + '_ {
    move |source| TlsError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A CA: its certificate (PEM) and what signs with its key. The data directory's
/// ([`issue_workload`]), or one held elsewhere, such as in a Secret on a cluster
/// ([`Ca::generate`], [`Ca::from_pem`]).
pub struct Ca {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca")
            .field("pem", &self.pem)
            .finish_non_exhaustive()
    }
}

impl Ca {
    /// A new CA, named as the data directory's (`kruntimes-ca`), with the PEM of its key.
    pub fn generate() -> Result<(Ca, String), TlsError> {
        let key = KeyPair::generate()?;
        let pem = ca_params()?.self_signed(&key)?.pem();
        let key_pem = key.serialize_pem();
        Ok((
            Ca {
                pem,
                issuer: Issuer::new(ca_params()?, key),
            },
            key_pem,
        ))
    }

    /// A CA from the PEM of its certificate and of its key (any CA: its name, usages and
    /// key identifier are read from the certificate, so what it issues chains to it). Of a
    /// chain, only the first certificate is the CA: the ones after it (its issuers) are
    /// not what its peers are to trust.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Ca, TlsError> {
        let key = KeyPair::from_pem(key_pem)?;
        let first = pem_to_der(cert_pem)?;
        let issuer = Issuer::from_ca_cert_der(&first, key)?;
        Ok(Ca {
            pem: der_to_pem(&first),
            issuer,
        })
    }

    /// The CA's certificate, PEM.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// Loads the CA from `dir`, or `None` when it has not been created.
    fn load(dir: &Path) -> Result<Option<Ca>, TlsError> {
        let cert_path = dir.join("ca.crt");
        let key_path = dir.join("ca.key");
        if !(cert_path.exists() && key_path.exists()) {
            return Ok(None);
        }
        let pem = std::fs::read_to_string(&cert_path).map_err(io(&cert_path))?;
        let key_pem = std::fs::read_to_string(&key_path).map_err(io(&key_path))?;
        let key = KeyPair::from_pem(&key_pem)?;
        // The issuer needs the CA's name, key-identifier method and usages, which ca_params
        // reproduces exactly; the authority key identifier comes from the key itself.
        Ok(Some(Ca {
            pem,
            issuer: Issuer::new(ca_params()?, key),
        }))
    }

    /// Loads the CA from `dir`, creating it there first if it does not exist.
    fn load_or_create(dir: &Path) -> Result<Ca, TlsError> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        if let Some(ca) = Ca::load(dir)? {
            return Ok(ca);
        }
        let cert_path = dir.join("ca.crt");
        let key_path = dir.join("ca.key");
        let key = KeyPair::generate()?;
        let pem = ca_params()?.self_signed(&key)?.pem();
        write_private(&key_path, key.serialize_pem().as_bytes()).map_err(io(&key_path))?;
        write_private(&cert_path, pem.as_bytes()).map_err(io(&cert_path))?;
        Ok(Ca {
            pem,
            issuer: Issuer::new(ca_params()?, key),
        })
    }
}

/// A workload's certificate and key, issued by the data directory's CA.
///
/// `Debug` never shows the key.
#[derive(Clone)]
pub struct WorkloadCert {
    /// The leaf certificate, PEM (the CA is not appended: every peer has it).
    pub cert_pem: String,
    /// The leaf's private key, PKCS#8 PEM.
    pub key_pem: String,
    /// The issuing CA's certificate, PEM: what verifies the peers.
    pub ca_pem: String,
}

impl std::fmt::Debug for WorkloadCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkloadCert")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .field("ca_pem", &self.ca_pem)
            .finish()
    }
}

/// Where [`WorkloadCert::write`] put the files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadFiles {
    /// `DIR/tls.crt`.
    pub cert: PathBuf,
    /// `DIR/tls.key`, mode 0600.
    pub key: PathBuf,
    /// `DIR/ca.crt`.
    pub ca: PathBuf,
}

impl WorkloadCert {
    /// Writes `tls.crt`, `tls.key` (mode 0600) and `ca.crt` into `dir`, the layout of a
    /// Kubernetes TLS Secret mounted as a volume. Creates `dir` (mode 0700) if needed.
    pub fn write(&self, dir: &Path) -> Result<WorkloadFiles, TlsError> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io(dir))?;
        let files = WorkloadFiles {
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
            ca: dir.join("ca.crt"),
        };
        write_private(&files.key, self.key_pem.as_bytes()).map_err(io(&files.key))?;
        std::fs::write(&files.cert, &self.cert_pem).map_err(io(&files.cert))?;
        std::fs::write(&files.ca, &self.ca_pem).map_err(io(&files.ca))?;
        Ok(files)
    }
}

/// The longest common name X.509 allows (`ub-common-name`).
const MAX_COMMON_NAME_BYTES: usize = 64;

/// Issues a certificate signed by the CA in `dir` (which must exist: the API server
/// creates it) for the workload `name`; see [`Ca::issue`].
///
/// Errors: no CA in `dir`, an unreadable CA (naming the file), and those of [`Ca::issue`].
pub fn issue_workload(
    dir: &Path,
    name: &str,
    ips: &[IpAddr],
    validity: Duration,
) -> Result<WorkloadCert, TlsError> {
    let ca = Ca::load(dir)?.ok_or_else(|| TlsError::NoCa {
        dir: dir.display().to_string(),
    })?;
    ca.issue(name, ips, validity)
}

impl Ca {
    /// Issues a certificate for the workload `name`: `name` is its one DNS name and, when
    /// it is at most [`MAX_COMMON_NAME_BYTES`] long, its common name, `ips` its IP
    /// addresses. Its first label may be `*` (a wildcard, followed by at least two
    /// labels), which verifies as any one label there. It is valid from an hour ago (clock
    /// skew) for `validity`, for both server and client authentication, so that one
    /// identity serves mutual TLS in both directions.
    ///
    /// Errors: a `name` that is not a DNS name, a `validity` beyond the year 9999.
    pub fn issue(
        &self,
        name: &str,
        ips: &[IpAddr],
        validity: Duration,
    ) -> Result<WorkloadCert, TlsError> {
        let ca = self;
        let bad_name = |reason| TlsError::Workload {
            name: name.to_string(),
            reason,
        };
        if name.is_empty() || name.len() > 253 {
            return Err(bad_name("a DNS name is 1 to 253 bytes"));
        }
        if name.parse::<IpAddr>().is_ok() {
            return Err(bad_name("it is an IP address; pass addresses in ips"));
        }
        // What a TLS client verifies the name as: labels of 1 to 63 letters, digits and
        // hyphens, neither first nor last a hyphen. Anything else would be issued and then
        // refused at every handshake.
        let label_ok = |label: &str| {
            (1..=63).contains(&label.len())
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        };
        // A wildcard is the whole first label, and leaves at least two labels to match.
        let rest = match name.strip_prefix("*.") {
            Some(rest) if rest.split('.').count() >= 2 => rest,
            Some(_) => return Err(bad_name("a wildcard needs at least two labels after it")),
            None => name,
        };
        if !rest.split('.').all(label_ok) {
            return Err(bad_name(
                "a DNS name is labels of 1 to 63 letters, digits and hyphens, neither first \
             nor last a hyphen",
            ));
        }
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        // X.509 bounds a common name to 64 characters; a longer name (a worker identity may
        // be) is the DNS name alone, which is all that TLS verifies.
        if name.len() <= MAX_COMMON_NAME_BYTES {
            params.distinguished_name.push(DnType::CommonName, name);
        }
        params.subject_alt_names = std::iter::once(
            name.to_string()
                .try_into()
                .map(SanType::DnsName)
                .map_err(|_| bad_name("it is not ASCII"))?,
        )
        .chain(ips.iter().map(|ip| SanType::IpAddress(*ip)))
        .collect();
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        // rcgen counts from the epoch; the year 9999 is as far as X.509 time goes.
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let epoch = rcgen::date_time_ymd(1970, 1, 1);
        let not_after = now.saturating_add(validity);
        if not_after > Duration::from_secs(253_402_300_799) {
            return Err(bad_name("its validity reaches past the year 9999"));
        }
        params.not_before = epoch + now.saturating_sub(Duration::from_secs(3600));
        params.not_after = epoch + not_after;
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &ca.issuer)?;
        Ok(WorkloadCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            ca_pem: ca.pem.clone(),
        })
    }
}

/// Loads the CA from `dir` (creating it on first start) and issues a serving certificate
/// for `localhost`, `127.0.0.1`, `::1` and `bind_ip` (when it is a specific address).
pub fn prepare(dir: &Path, bind_ip: IpAddr) -> Result<Pki, TlsError> {
    let Ca {
        pem: ca_pem,
        issuer,
    } = Ca::load_or_create(dir)?;

    let mut names = vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ];
    if !bind_ip.is_unspecified() && !bind_ip.is_loopback() {
        names.push(bind_ip.to_string());
    }
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(DnType::CommonName, "kruntimes-apiserver");
    params.subject_alt_names = names
        .iter()
        .map(|n| match n.parse::<IpAddr>() {
            Ok(ip) => Ok(SanType::IpAddress(ip)),
            Err(_) => n.clone().try_into().map(SanType::DnsName),
        })
        .collect::<Result<_, _>>()?;
    params.not_before = rcgen::date_time_ymd(2024, 1, 1);
    params.not_after = rcgen::date_time_ymd(2099, 1, 1);
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;

    let chain = vec![cert.der().clone(), pem_to_der(&ca_pem)?];
    let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Pki {
        ca_pem,
        server_config: Arc::new(config),
    })
}

fn ca_params() -> Result<CertificateParams, rcgen::Error> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(DnType::CommonName, "kruntimes-ca");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = rcgen::date_time_ymd(2024, 1, 1);
    params.not_after = rcgen::date_time_ymd(2099, 1, 1);
    Ok(params)
}

/// The PEM of one certificate's DER.
fn der_to_pem(der: &[u8]) -> String {
    use base64::Engine;
    let body = base64::engine::general_purpose::STANDARD.encode(der);
    let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in body.as_bytes().chunks(64) {
        pem.push_str(&String::from_utf8_lossy(line));
        pem.push('\n');
    }
    pem.push_str("-----END CERTIFICATE-----\n");
    pem
}

fn pem_to_der(pem: &str) -> Result<CertificateDer<'static>, TlsError> {
    let mut reader = std::io::BufReader::new(pem.as_bytes());
    match rustls_pemfile::certs(&mut reader).next() {
        Some(Ok(der)) => Ok(der),
        Some(Err(source)) => Err(TlsError::Io {
            path: "ca.crt".into(),
            source,
        }),
        None => Err(TlsError::Io {
            path: "ca.crt".into(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, "no certificate in PEM"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use rustls::client::WebPkiServerVerifier;
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{ServerName, UnixTime};
    use rustls::server::WebPkiClientVerifier;
    use rustls::{CertificateError, RootCertStore};

    use super::*;

    const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);

    fn roots(ca_pem: &str) -> Arc<RootCertStore> {
        let mut roots = RootCertStore::empty();
        roots
            .add(pem_to_der(ca_pem).expect("the CA"))
            .expect("a root");
        Arc::new(roots)
    }

    #[test]
    fn workload_certificates_serve_and_authenticate_clients() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = prepare(dir.path(), "127.0.0.1".parse().expect("ip")).expect("the PKI");
        let ip: IpAddr = "127.0.0.1".parse().expect("ip");
        let cert = issue_workload(dir.path(), "python-x7k2p", &[ip], YEAR).expect("issued");
        assert_eq!(cert.ca_pem, pki.ca_pem, "signed by the data directory's CA");
        let leaf = pem_to_der(&cert.cert_pem).expect("the leaf");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let now = UnixTime::now();

        let servers =
            WebPkiServerVerifier::builder_with_provider(roots(&pki.ca_pem), provider.clone())
                .build()
                .expect("a server verifier");
        for name in ["python-x7k2p", "127.0.0.1"] {
            let name = ServerName::try_from(name).expect("a name");
            servers
                .verify_server_cert(&leaf, &[], &name, &[], now)
                .unwrap_or_else(|e| panic!("{name:?} verifies: {e}"));
        }
        let other = ServerName::try_from("python-other").expect("a name");
        assert!(matches!(
            servers.verify_server_cert(&leaf, &[], &other, &[], now),
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. }
            ))
        ));

        let clients =
            WebPkiClientVerifier::builder_with_provider(roots(&pki.ca_pem), provider.clone())
                .build()
                .expect("a client verifier");
        clients
            .verify_client_cert(&leaf, &[], now)
            .expect("a client certificate");

        // Another data directory's CA trusts none of it.
        let stranger = tempfile::tempdir().expect("tempdir");
        let foreign = prepare(stranger.path(), ip).expect("another PKI");
        let foreign_clients =
            WebPkiClientVerifier::builder_with_provider(roots(&foreign.ca_pem), provider)
                .build()
                .expect("a client verifier");
        assert!(foreign_clients.verify_client_cert(&leaf, &[], now).is_err());
    }

    #[test]
    fn workload_files_keep_the_key_private_and_debug_hides_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        prepare(dir.path(), "127.0.0.1".parse().expect("ip")).expect("the PKI");
        let cert = issue_workload(dir.path(), "gateway", &[], YEAR).expect("issued");
        assert!(!format!("{cert:?}").contains(cert.key_pem.trim()));
        let files = cert.write(&dir.path().join("w/tls")).expect("written");
        let mode = |p: &Path| std::fs::metadata(p).expect("metadata").permissions().mode() & 0o777;
        assert_eq!(mode(&files.key), 0o600);
        assert_eq!(mode(&dir.path().join("w/tls")), 0o700);
        assert_eq!(
            std::fs::read_to_string(&files.key).expect("key"),
            cert.key_pem
        );
        assert_eq!(
            std::fs::read_to_string(&files.cert).expect("cert"),
            cert.cert_pem
        );
        assert_eq!(std::fs::read_to_string(&files.ca).expect("ca"), cert.ca_pem);
    }

    #[test]
    fn issuing_needs_the_ca_and_a_dns_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = issue_workload(dir.path(), "w", &[], YEAR).err();
        assert!(
            matches!(missing, Some(TlsError::NoCa { .. })),
            "{missing:?}"
        );
        assert!(
            !dir.path().join("ca.key").exists(),
            "issuing never creates a CA"
        );
        prepare(dir.path(), "127.0.0.1".parse().expect("ip")).expect("the PKI");
        let long_label = format!("{}.default.kruntimes-worker", "p".repeat(64));
        for bad in [
            "",
            "10.0.0.1",
            "näme",
            "under_score",
            "-w",
            "w-",
            "a..b",
            long_label.as_str(),
            // A wildcard is a whole first label with two labels after it.
            "*",
            "*.kruntimes-worker",
            "w*.default.kruntimes-worker",
            "a.*.kruntimes-worker",
        ] {
            let error = issue_workload(dir.path(), bad, &[], YEAR).err();
            assert!(
                matches!(error, Some(TlsError::Workload { .. })),
                "{bad:?}: {error:?}"
            );
        }
        issue_workload(dir.path(), "*.default.kruntimes-worker", &[], YEAR)
            .expect("a wildcard for one namespace's Pods");
        let forever = issue_workload(dir.path(), "w", &[], Duration::from_secs(u64::MAX)).err();
        assert!(
            matches!(forever, Some(TlsError::Workload { .. })),
            "{forever:?}"
        );
    }
}
