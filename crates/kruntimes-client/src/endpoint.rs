//! A Run's published endpoint (`status.endpoint`): where its data-plane calls go, the
//! clients that make them, and how their answers and failures read. Shared by function
//! invocations ([`crate::invoke`]) and sandboxes ([`crate::sandbox`]).
//!
//! A call goes through a kube-rs client whose base URL is the endpoint's origin, built from
//! the connection's own configuration: it carries the same credentials as every API call
//! (this crate implements no authentication), and it trusts only the Run's
//! `status.endpoint.caBundle` (the connection's CA when the Run publishes none), verified
//! under the endpoint's own host name. kube-rs's automatic retry of 429/503/504 is off: no
//! call is ever sent twice by this crate.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use kruntimes_api::run::{EndpointProtocol, MAX_CA_BUNDLE_BYTES};
use kruntimes_api::{Phase, Run};
use serde::Deserialize;

/// The most endpoint clients kept (one per gateway origin and CA bundle, in practice one).
const MAX_ENDPOINT_CLIENTS: usize = 16;
/// The longest server message an error keeps, in bytes.
pub const MAX_SERVER_MESSAGE_BYTES: usize = 1024;

/// Where a Run's calls go: its endpoint's origin and path, and how it is verified.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Target {
    pub url: String,
    pub origin: String,
    pub path: String,
    /// The PEM bytes of `status.endpoint.caBundle` (base64 in the Run's JSON).
    pub ca_bundle: Option<Vec<u8>>,
}

/// Why a Run's endpoint cannot be called.
#[derive(Debug)]
pub(crate) enum EndpointError {
    /// No endpoint, or the Run has ended.
    NotReady {
        name: String,
        phase: Phase,
        reason: Option<String>,
        message: Option<String>,
    },
    /// A malformed or unusable endpoint.
    Bad {
        name: String,
        url: String,
        problem: String,
    },
    /// No client could be built for it.
    Client { url: String, source: kube::Error },
}

/// `: REASON: MESSAGE`, or whichever is there, on one line; nothing without either.
pub(crate) fn detail(reason: &Option<String>, message: &Option<String>) -> String {
    let mut text = String::new();
    for part in [reason, message].into_iter().flatten() {
        if !part.is_empty() {
            text.push_str(": ");
            text.push_str(part);
        }
    }
    text.replace(['\n', '\r'], " ")
}

/// The endpoint of `run`, which must not have ended.
pub(crate) fn target(run: &Run) -> Result<Target, EndpointError> {
    let name = run.metadata.name.clone().unwrap_or_default();
    let phase = run.phase();
    let status = run.status.as_ref();
    let not_ready = || EndpointError::NotReady {
        name: name.clone(),
        phase,
        reason: status.and_then(|s| s.reason.clone()),
        message: status.and_then(|s| s.message.clone()),
    };
    if phase.is_terminal() {
        return Err(not_ready());
    }
    let endpoint = status
        .and_then(|s| s.endpoint.as_ref())
        .ok_or_else(not_ready)?;
    let bad = |problem: &str| EndpointError::Bad {
        name: name.clone(),
        url: endpoint.url.clone(),
        problem: problem.to_string(),
    };
    let uri: http::Uri = endpoint.url.parse().map_err(|_| bad("it is not a URL"))?;
    if endpoint.protocol != EndpointProtocol::Https || uri.scheme_str() != Some("https") {
        return Err(bad(
            "it is not HTTPS, and a bearer token is never sent in the clear",
        ));
    }
    let authority = uri.authority().ok_or_else(|| bad("it has no host"))?;
    let path = uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .ok_or_else(|| bad("it has no path"))?;
    Ok(Target {
        url: endpoint.url.clone(),
        origin: format!("https://{authority}"),
        path,
        ca_bundle: endpoint
            .ca_bundle
            .as_ref()
            .map(|b| b.0.clone())
            .filter(|b| !b.trim_ascii().is_empty()),
    })
}

/// The DER certificates of a PEM bundle such as the bytes of `status.endpoint.caBundle`
/// (which the Run's JSON carries as base64, already decoded by the Run's type); an error
/// (for a caBundle) when it exceeds 16 KiB, is not PEM or holds none.
pub fn pem_certificates(pem: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    if pem.len() > MAX_CA_BUNDLE_BYTES {
        return Err(format!("its caBundle exceeds {MAX_CA_BUNDLE_BYTES} bytes"));
    }
    let mut reader = pem;
    let mut ders = Vec::new();
    for cert in rustls_pemfile::certs(&mut reader) {
        let cert = cert.map_err(|e| format!("its caBundle is not PEM: {e}"))?;
        ders.push(cert.as_ref().to_vec());
    }
    if ders.is_empty() {
        return Err("its caBundle holds no certificate".to_string());
    }
    Ok(ders)
}

/// An endpoint client's key: the origin and the CA bundle.
type ClientKey = (String, Option<Vec<u8>>);

/// The clients of Run endpoints, by origin and CA bundle. Cheap to clone; clones share.
#[derive(Clone, Default)]
pub(crate) struct EndpointClients(Arc<Mutex<HashMap<ClientKey, kube::Client>>>);

impl EndpointClients {
    /// The client for `target` of the Run `name`, from the cache or built from `config`
    /// (the connection's configuration).
    pub fn get(
        &self,
        config: &kube::Config,
        name: &str,
        target: &Target,
    ) -> Result<kube::Client, EndpointError> {
        let key = (target.origin.clone(), target.ca_bundle.clone());
        let mut clients = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(client) = clients.get(&key) {
            return Ok(client.clone());
        }
        let config = endpoint_config(config, name, target)?;
        let client = kube::Client::try_from(config).map_err(|source| EndpointError::Client {
            url: target.origin.clone(),
            source,
        })?;
        if clients.len() >= MAX_ENDPOINT_CLIENTS {
            clients.clear();
        }
        clients.insert(key, client.clone());
        Ok(client)
    }
}

/// The connection's configuration `config` pointed at `target` of the Run `name`: its
/// origin, verified with the Run's CA bundle under its own name, never retried, without a
/// read timeout (each call bounds its own exchange).
pub(crate) fn endpoint_config(
    config: &kube::Config,
    name: &str,
    target: &Target,
) -> Result<kube::Config, EndpointError> {
    let bad = |problem: String| EndpointError::Bad {
        name: name.to_string(),
        url: target.url.clone(),
        problem,
    };
    let mut config = config.clone();
    config.cluster_url = target
        .origin
        .parse()
        .map_err(|_| bad("its origin is not a URL".to_string()))?;
    if let Some(pem) = &target.ca_bundle {
        config.root_cert = Some(pem_certificates(pem).map_err(bad)?);
        config.root_cert_file = None;
    }
    // The endpoint is verified, under its own name, whatever the kubeconfig says about
    // the API server.
    config.accept_invalid_certs = false;
    config.tls_server_name = None;
    // Never send a call twice: no automatic retry of 429, 503 or 504.
    config.default_retry = false;
    // Each call bounds its own exchange; a session's socket may be quiet for long.
    config.read_timeout = None;
    Ok(config)
}

/// Whether a request failed before anything was sent: connecting, TLS, credentials.
pub(crate) fn failed_before_sending(e: &kube::Error) -> bool {
    if matches!(e, kube::Error::Auth(_)) {
        return true;
    }
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(error) = current {
        if let Some(hyper) = error.downcast_ref::<hyper_util::client::legacy::Error>() {
            return hyper.is_connect();
        }
        current = error.source();
    }
    false
}

/// The gateway's error body.
#[derive(Debug, Deserialize)]
struct ErrorBody {
    #[serde(default)]
    reason: String,
    #[serde(default)]
    message: String,
}

/// `text` on one line, at most [`MAX_SERVER_MESSAGE_BYTES`], cut on a character boundary.
pub(crate) fn bounded(text: &str) -> String {
    let mut line = text.trim().replace(['\n', '\r'], " ");
    if line.len() > MAX_SERVER_MESSAGE_BYTES {
        let mut end = MAX_SERVER_MESSAGE_BYTES - '…'.len_utf8();
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
        line.push('…');
    }
    line
}

/// The reason and bounded message of an error answer: the gateway's JSON error body, or
/// the status's canonical reason and the start of whatever else the body is.
pub(crate) fn error_answer(status: u16, bytes: &[u8]) -> (String, String) {
    match serde_json::from_slice::<ErrorBody>(bytes) {
        Ok(body) => (body.reason, bounded(&body.message)),
        Err(_) => (
            http::StatusCode::from_u16(status)
                .ok()
                .and_then(|s| s.canonical_reason())
                .unwrap_or("Error")
                .replace(' ', ""),
            bounded(&String::from_utf8_lossy(bytes)),
        ),
    }
}

#[cfg(test)]
mod tests {
    use kruntimes_api::RunSpec;
    use kruntimes_api::run::{ByteString, RunEndpoint, RunStatus};

    use super::*;

    fn run_with(phase: Phase, endpoint: Option<RunEndpoint>) -> Run {
        let mut run = Run::new("greeter", RunSpec::task("python", "x"));
        run.status = Some(RunStatus {
            phase: Some(phase),
            endpoint,
            reason: Some("RegistrationFailed".into()),
            ..RunStatus::default()
        });
        run
    }

    fn endpoint(url: &str) -> RunEndpoint {
        RunEndpoint {
            protocol: EndpointProtocol::Https,
            url: url.to_string(),
            ca_bundle: Some(ByteString(b"not pem".to_vec())),
        }
    }

    #[test]
    fn the_target_is_the_endpoint_of_a_live_run() {
        let url =
            "https://127.0.0.1:4443/v1/namespaces/default/runtimes/python/functions/u-1:invoke";
        let t = target(&run_with(Phase::Ready, Some(endpoint(url)))).expect("target");
        assert_eq!(t.origin, "https://127.0.0.1:4443");
        assert_eq!(
            t.path,
            "/v1/namespaces/default/runtimes/python/functions/u-1:invoke"
        );
        assert!(matches!(
            target(&run_with(Phase::Running, None)),
            Err(EndpointError::NotReady {
                phase: Phase::Running,
                ..
            })
        ));
        assert!(matches!(
            target(&run_with(Phase::Failed, Some(endpoint(url)))),
            Err(EndpointError::NotReady {
                phase: Phase::Failed,
                ..
            })
        ));
        assert!(matches!(
            target(&run_with(Phase::Ready, Some(endpoint("http://h/p")))),
            Err(EndpointError::Bad { problem, .. }) if problem.contains("never sent in the clear")
        ));
    }

    #[test]
    fn ca_bundles_must_hold_certificates() {
        assert!(pem_certificates(b"not pem").is_err());
        let pem = b"-----BEGIN CERTIFICATE-----\nAAEC\n-----END CERTIFICATE-----\n";
        assert_eq!(pem_certificates(pem).expect("one"), vec![vec![0u8, 1, 2]]);
        let mut huge = pem.to_vec();
        huge.resize(MAX_CA_BUNDLE_BYTES + 1, b'\n');
        assert!(pem_certificates(&huge).is_err());
    }

    #[test]
    fn error_answers_are_read_and_bounded() {
        assert_eq!(
            error_answer(
                404,
                br#"{"code":404,"reason":"NotFound","message":"no\nsuch"}"#
            ),
            ("NotFound".to_string(), "no such".to_string())
        );
        let (reason, message) = error_answer(504, b"upstream timeout");
        assert_eq!(
            (reason.as_str(), message.as_str()),
            ("GatewayTimeout", "upstream timeout")
        );
        let (_, long) = error_answer(500, "é".repeat(2000).as_bytes());
        assert!(long.len() <= MAX_SERVER_MESSAGE_BYTES && long.ends_with('…'));
    }
}
