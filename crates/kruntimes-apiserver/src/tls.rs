//! The standalone PKI: a CA created once in the data directory, and a serving certificate
//! issued by it at every start for the loopback names and the bind address.

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
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

/// Loads the CA from `dir` (creating it on first start) and issues a serving certificate
/// for `localhost`, `127.0.0.1`, `::1` and `bind_ip` (when it is a specific address).
pub fn prepare(dir: &Path, bind_ip: IpAddr) -> Result<Pki, TlsError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let ca_cert_path = dir.join("ca.crt");
    let ca_key_path = dir.join("ca.key");
    let (ca_pem, ca_key) = if ca_cert_path.exists() && ca_key_path.exists() {
        let pem = std::fs::read_to_string(&ca_cert_path).map_err(io(&ca_cert_path))?;
        let key_pem = std::fs::read_to_string(&ca_key_path).map_err(io(&ca_key_path))?;
        (pem, KeyPair::from_pem(&key_pem)?)
    } else {
        let key = KeyPair::generate()?;
        let cert = ca_params()?.self_signed(&key)?;
        let pem = cert.pem();
        write_private(&ca_key_path, key.serialize_pem().as_bytes()).map_err(io(&ca_key_path))?;
        write_private(&ca_cert_path, pem.as_bytes()).map_err(io(&ca_cert_path))?;
        (pem, key)
    };
    // The issuer needs the CA's name, key-identifier method and usages, which ca_params
    // reproduces exactly; the authority key identifier comes from the key itself.
    let issuer = Issuer::new(ca_params()?, ca_key);

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
