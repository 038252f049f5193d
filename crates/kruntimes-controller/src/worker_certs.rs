//! Worker mutual TLS on a cluster: the Kubernetes provisioner issues the certificates of
//! runtimed's gRPC port, and the gateway's towards it, from a CA kept in a Secret.
//!
//! - **The CA**: the Secret `--worker-ca-secret` (the install's is
//!   `kruntimes-system/kruntimes-worker-ca`), keys `ca.crt` and `ca.key`. When it does not
//!   exist, a new CA (`kruntimes-ca`) is made and the Secret created; when two replicas
//!   race, the create of the second fails and it reads the first's. A Secret that exists is
//!   used as it is, whoever made it, and never written: bring a CA of your own PKI this
//!   way, or one cert-manager keeps (a CA Certificate's Secret: `tls.crt` and `tls.key`).
//!   One that does not parse fails every reconcile, naming it. It is read once per
//!   process: after replacing it, restart the controller-manager.
//! - **Per namespace with a Runtime**, the Secret [`WORKER_TLS_SECRET`] (`tls.crt`,
//!   `tls.key`, `ca.crt`), issued for `*.NAMESPACE.kruntimes-worker`
//!   ([`namespace_identity`]): valid as the worker identity of every Pod of that
//!   namespace, and of none of any other namespace or the gateway. runtimed mounts it.
//! - **Beside the CA**, the Secret [`GATEWAY_WORKER_TLS_SECRET`], issued for
//!   `kruntimes-gateway`: the gateway's client certificate towards workers.
//!
//! The identity is the namespace's, not the Pod's: a Deployment's Pods are named only when
//! the cluster makes them, and a per-Pod certificate needs proof that the requester is that
//! Pod (a token bound to it), which the workers' ServiceAccount of a namespace does not
//! give. That is the boundary RBAC draws already: the workers of a namespace share one
//! ServiceAccount and its grants.
//!
//! Material is issued for [`CERT_VALIDITY`], and issued again when a check finds it
//! missing, or finds that it would not verify [`RENEW_BEFORE`] from now (it expires by
//! then, it is not the CA's, its key is not its certificate's, it is for another
//! identity). A check that passed is trusted for [`CERT_RECHECK`]. runtimed and the gateway
//! read their files again every 10 s, and the kubelet updates a mounted Secret within about
//! a minute, so new material is in use long before the old expires. A Secret of these
//! names that lacks the label `app.kubernetes.io/name=kruntimes` is never taken over.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kruntimes_apiserver::tls::Ca;
use kruntimes_wire::worker::{
    CA_FILE, CERT_FILE, GATEWAY_IDENTITY, KEY_FILE, WORKER_IDENTITY_SUFFIX, check_material,
};
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use tracing::{info, warn};

use crate::kubernetes::{FIELD_MANAGER, KubernetesError, shared, shared_meta};

/// The Secret of each namespace's worker material, and of the gateway's (beside the
/// CA's); the install's RBAC lets the controller-manager read and write these names only.
pub use kruntimes_apiserver::bootstrap::{GATEWAY_WORKER_TLS_SECRET, WORKER_TLS_SECRET};
/// The CA Secret's key.
pub const CA_KEY_FILE: &str = "ca.key";
/// How long issued material is valid.
pub const CERT_VALIDITY: Duration = Duration::from_secs(90 * 24 * 3600);
/// Material that would not verify this far ahead is issued again.
pub const RENEW_BEFORE: Duration = Duration::from_secs(30 * 24 * 3600);
/// How long a passed check is trusted before the Secret is read again.
pub const CERT_RECHECK: Duration = Duration::from_secs(300);
/// The type of the issued Secrets.
const TLS_TYPE: &str = "kubernetes.io/tls";
/// How soon the gateway's material is tried again after a failure.
const GATEWAY_RETRY: Duration = Duration::from_secs(10);

/// The identity of the workers of `namespace`: `*.NAMESPACE.kruntimes-worker`, which
/// verifies as `POD.NAMESPACE.kruntimes-worker` for every Pod name.
pub fn namespace_identity(namespace: &str) -> String {
    format!("*.{namespace}.{WORKER_IDENTITY_SUFFIX}")
}

/// A Secret whose check passed: in which namespace (and its incarnation), of what name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Checked {
    namespace: String,
    namespace_uid: String,
    name: String,
}

/// See the module documentation. Cloning shares the CA and the checks.
#[derive(Clone)]
pub struct WorkerCerts(Arc<Inner>);

struct Inner {
    client: Client,
    ca_namespace: String,
    ca_name: String,
    /// The CA as last read (or made), with the Secret's resourceVersion then.
    ca: tokio::sync::Mutex<Option<(String, Arc<Ca>)>>,
    /// The Secrets whose last check passed, and when.
    checked: Mutex<HashMap<Checked, Instant>>,
}

impl WorkerCerts {
    /// Issues from the CA in the Secret `ca_name` of `ca_namespace`.
    pub fn new(client: Client, ca_namespace: &str, ca_name: &str) -> Self {
        WorkerCerts(Arc::new(Inner {
            client,
            ca_namespace: ca_namespace.to_string(),
            ca_name: ca_name.to_string(),
            ca: tokio::sync::Mutex::new(None),
            checked: Mutex::new(HashMap::new()),
        }))
    }

    fn checked(&self) -> std::sync::MutexGuard<'_, HashMap<Checked, Instant>> {
        // Only plain inserts and reads happen under the lock; a poisoned one is still whole.
        self.0
            .checked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The CA, from its Secret as it is now (made first when it does not exist): every
    /// replica, and every check, issues from the current one. Parsed again only when the
    /// Secret changed.
    async fn ca(&self) -> Result<Arc<Ca>, KubernetesError> {
        let mut held = self.0.ca.lock().await;
        let (namespace, name) = (&self.0.ca_namespace, &self.0.ca_name);
        // The install's RBAC grants its own Secret names only: say so rather than retry.
        let failed = |action| {
            move |error: kube::Error| match error {
                kube::Error::Api(status) if status.code == 403 => KubernetesError::WorkerCa {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    reason: format!(
                        "the controller-manager may not {action} it (the install's RBAC \
                         grants the Secret names of the install only): {}",
                        status.message
                    ),
                },
                error => api_error(action, namespace, name)(error),
            }
        };
        let api: Api<Secret> = Api::namespaced(self.0.client.clone(), namespace);
        let secret = match api.get_opt(name).await.map_err(failed("read"))? {
            Some(secret) => secret,
            None => {
                let (ca, key_pem) = Ca::generate().map_err(|source| KubernetesError::Issue {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    source,
                })?;
                let secret = Secret {
                    metadata: shared_meta(name, Some(namespace)),
                    type_: Some("Opaque".to_string()),
                    data: Some(BTreeMap::from([
                        (
                            CA_FILE.to_string(),
                            ByteString(ca.pem().as_bytes().to_vec()),
                        ),
                        (CA_KEY_FILE.to_string(), ByteString(key_pem.into_bytes())),
                    ])),
                    ..Secret::default()
                };
                match api.create(&PostParams::default(), &secret).await {
                    Ok(created) => {
                        info!(secret = %format!("{namespace}/{name}"), "made the worker CA");
                        created
                    }
                    // Another replica made it first: use that one.
                    Err(kube::Error::Api(status)) if status.code == 409 => {
                        api.get(name).await.map_err(failed("read"))?
                    }
                    Err(error) => return Err(failed("create")(error)),
                }
            }
        };
        let version = secret.metadata.resource_version.clone().unwrap_or_default();
        if let Some((read, ca)) = held.as_ref()
            && *read == version
        {
            return Ok(ca.clone());
        }
        let ca = ca_of(&secret).map_err(|reason| KubernetesError::WorkerCa {
            namespace: namespace.clone(),
            name: name.clone(),
            reason,
        })?;
        let ca = Arc::new(ca);
        *held = Some((version, ca.clone()));
        Ok(ca)
    }

    /// Makes sure the Secret `name` of `namespace` (whose UID is `namespace_uid`) holds
    /// material for `identity` that verifies [`RENEW_BEFORE`] from now; issues it (again)
    /// when not. A check that passed is remembered per namespace UID: a namespace made
    /// again under its name is checked at once.
    pub async fn ensure(
        &self,
        namespace: &str,
        namespace_uid: &str,
        name: &str,
        identity: &str,
    ) -> Result<(), KubernetesError> {
        let key = Checked {
            namespace: namespace.to_string(),
            namespace_uid: namespace_uid.to_string(),
            name: name.to_string(),
        };
        let now = Instant::now();
        if self
            .checked()
            .get(&key)
            .is_some_and(|at| now.duration_since(*at) < CERT_RECHECK)
        {
            return Ok(());
        }
        let ca = self.ca().await?;
        let failed = |action| api_error(action, namespace, name);
        let api: Api<Secret> = Api::namespaced(self.0.client.clone(), namespace);
        let mut uid = None;
        if let Some(current) = api.get_opt(name).await.map_err(failed("read"))? {
            if !shared(&current.metadata) {
                return Err(KubernetesError::SharedNotOurs {
                    kind: "Secret".to_string(),
                    namespace: namespace.to_string(),
                    name: name.to_string(),
                });
            }
            // A Secret's type cannot change: the apply below would be refused every time.
            if current.type_.as_deref() != Some(TLS_TYPE) {
                return Err(KubernetesError::WorkerSecretType {
                    namespace: namespace.to_string(),
                    name: name.to_string(),
                    found: current.type_.unwrap_or_default(),
                });
            }
            match usable(
                &current,
                ca.pem(),
                identity,
                SystemTime::now() + RENEW_BEFORE,
            ) {
                Ok(()) => {
                    self.record(key, now);
                    return Ok(());
                }
                Err(reason) => {
                    info!(secret = %format!("{namespace}/{name}"), %reason, "issuing worker TLS material again");
                }
            }
            // The apply is for the Secret read: one replaced meanwhile is refused.
            uid = current.metadata.uid;
        }
        let issued =
            ca.issue(identity, &[], CERT_VALIDITY)
                .map_err(|source| KubernetesError::Issue {
                    namespace: namespace.to_string(),
                    name: name.to_string(),
                    source,
                })?;
        let secret = Secret {
            metadata: ObjectMeta {
                uid,
                ..shared_meta(name, Some(namespace))
            },
            type_: Some(TLS_TYPE.to_string()),
            data: Some(BTreeMap::from([
                (
                    CERT_FILE.to_string(),
                    ByteString(issued.cert_pem.into_bytes()),
                ),
                (
                    KEY_FILE.to_string(),
                    ByteString(issued.key_pem.into_bytes()),
                ),
                (CA_FILE.to_string(), ByteString(issued.ca_pem.into_bytes())),
            ])),
            ..Secret::default()
        };
        // What was issued must pass the check it will meet: a CA whose key is not its
        // certificate's, or that is no CA, issues what verifies nowhere.
        usable(
            &secret,
            ca.pem(),
            identity,
            SystemTime::now() + RENEW_BEFORE,
        )
        .map_err(|reason| KubernetesError::WorkerCa {
            namespace: self.0.ca_namespace.clone(),
            name: self.0.ca_name.clone(),
            reason: format!("what it issues does not verify: {reason}"),
        })?;
        api.patch(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&secret),
        )
        .await
        .map_err(failed("apply"))?;
        info!(secret = %format!("{namespace}/{name}"), %identity, "issued worker TLS material");
        self.record(key, now);
        Ok(())
    }

    fn record(&self, key: Checked, now: Instant) {
        let mut checked = self.checked();
        checked.retain(|_, at| now.duration_since(*at) < CERT_RECHECK);
        checked.insert(key, now);
    }

    /// The workers' material of `namespace` ([`WORKER_TLS_SECRET`]), whose UID is
    /// `namespace_uid`.
    pub async fn ensure_namespace(
        &self,
        namespace: &str,
        namespace_uid: &str,
    ) -> Result<(), KubernetesError> {
        self.ensure(
            namespace,
            namespace_uid,
            WORKER_TLS_SECRET,
            &namespace_identity(namespace),
        )
        .await
    }

    /// The gateway's material ([`GATEWAY_WORKER_TLS_SECRET`], beside the CA).
    pub async fn ensure_gateway(&self) -> Result<(), KubernetesError> {
        // The control plane's namespace is not made again under a running
        // controller-manager: no UID to tell incarnations apart.
        self.ensure(
            &self.0.ca_namespace,
            "",
            GATEWAY_WORKER_TLS_SECRET,
            GATEWAY_IDENTITY,
        )
        .await
    }

    /// Keeps the gateway's material issued and renewed, from the start of the
    /// controller-manager (the gateway's Pods wait for its Secret, with or without a
    /// Runtime): checked every [`CERT_RECHECK`], tried again after a failure. Never
    /// returns: abort its task to stop it.
    pub async fn keep_gateway(self) {
        loop {
            let wait = match self.ensure_gateway().await {
                Ok(()) => CERT_RECHECK,
                Err(error) => {
                    warn!(error = %error, "cannot issue the gateway's worker TLS material");
                    GATEWAY_RETRY
                }
            };
            tokio::time::sleep(wait).await;
        }
    }
}

fn api_error<'a>(
    action: &'static str,
    namespace: &'a str,
    name: &'a str,
) -> impl FnOnce(kube::Error) -> KubernetesError + 'a {
    move |source| KubernetesError::Api {
        action,
        kind: "Secret".to_string(),
        namespace: namespace.to_string(),
        name: name.to_string(),
        source,
    }
}

/// The CA in `secret`: `ca.crt` and `ca.key`, as this issuer makes it; else `tls.crt` and
/// `tls.key`, as cert-manager writes a CA Certificate's Secret (where `ca.crt` is the CA's
/// own issuer).
fn ca_of(secret: &Secret) -> Result<Ca, String> {
    let text = |key: &str| field(secret, key);
    let (cert, key) = match (text(CA_FILE), text(CA_KEY_FILE)) {
        (Ok(cert), Ok(key)) => (cert, key),
        (_, Err(no_key)) => match (text(CERT_FILE), text(KEY_FILE)) {
            (Ok(cert), Ok(key)) => (cert, key),
            _ => return Err(format!("{no_key}, nor {CERT_FILE} and {KEY_FILE}")),
        },
        (Err(no_cert), Ok(_)) => return Err(no_cert),
    };
    Ca::from_pem(cert, key).map_err(|e| format!("it is not a usable CA: {e}"))
}

/// The text of the Secret's key `key`.
fn field<'s>(secret: &'s Secret, key: &str) -> Result<&'s str, String> {
    let bytes = secret
        .data
        .as_ref()
        .and_then(|data| data.get(key))
        .ok_or_else(|| format!("it has no {key}"))?;
    std::str::from_utf8(&bytes.0).map_err(|_| format!("its {key} is not text"))
}

/// Whether the material in `secret` is the CA's and verifies for `identity` at `at`. A
/// wildcard identity is checked as two different Pods' names, so a certificate for one
/// Pod alone does not pass.
pub fn usable(secret: &Secret, ca_pem: &str, identity: &str, at: SystemTime) -> Result<(), String> {
    if field(secret, CA_FILE)? != ca_pem {
        return Err("its CA is not the worker CA".to_string());
    }
    let (cert, key) = (field(secret, CERT_FILE)?, field(secret, KEY_FILE)?);
    let names: Vec<String> = match identity.strip_prefix("*.") {
        Some(rest) => vec![format!("a.{rest}"), format!("b.{rest}")],
        None => vec![identity.to_string()],
    };
    names
        .iter()
        .try_for_each(|name| check_material(cert, key, ca_pem, name, at))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(issued: &kruntimes_apiserver::tls::WorkloadCert, ca_pem: &str) -> Secret {
        Secret {
            data: Some(BTreeMap::from([
                (
                    CERT_FILE.to_string(),
                    ByteString(issued.cert_pem.clone().into_bytes()),
                ),
                (
                    KEY_FILE.to_string(),
                    ByteString(issued.key_pem.clone().into_bytes()),
                ),
                (CA_FILE.to_string(), ByteString(ca_pem.as_bytes().to_vec())),
            ])),
            ..Secret::default()
        }
    }

    #[test]
    fn a_namespace_certificate_is_every_worker_of_that_namespace_and_nothing_else() {
        let (ca, _) = Ca::generate().expect("a CA");
        let issued = ca
            .issue(&namespace_identity("team-a"), &[], CERT_VALIDITY)
            .expect("issued");
        let now = SystemTime::now();
        let check = |identity: &str| {
            check_material(&issued.cert_pem, &issued.key_pem, ca.pem(), identity, now)
        };
        for pod in ["python-7d9f-x2k4p", "other-5c6b-qq9zt"] {
            check(&format!("{pod}.team-a.kruntimes-worker"))
                .unwrap_or_else(|e| panic!("{pod} of team-a: {e}"));
        }
        for stranger in [
            "python-7d9f-x2k4p.team-b.kruntimes-worker",
            "kruntimes-gateway",
            "a.b.team-a.kruntimes-worker",
        ] {
            let refused = check(stranger).expect_err(stranger);
            assert!(refused.contains("not issued for"), "{stranger}: {refused}");
        }
        assert!(
            usable(
                &secret(&issued, ca.pem()),
                ca.pem(),
                &namespace_identity("team-a"),
                now
            )
            .is_ok()
        );
        // Another namespace's Secret, or one for a single Pod, is not this namespace's.
        assert!(
            usable(
                &secret(&issued, ca.pem()),
                ca.pem(),
                &namespace_identity("team-b"),
                now
            )
            .is_err()
        );
        let one_pod = ca
            .issue("a.team-a.kruntimes-worker", &[], CERT_VALIDITY)
            .expect("issued");
        let refused = usable(
            &secret(&one_pod, ca.pem()),
            ca.pem(),
            &namespace_identity("team-a"),
            now,
        )
        .expect_err("one Pod's");
        assert!(refused.contains("not issued for b.team-a"), "{refused}");
    }

    #[test]
    fn material_is_renewed_before_it_expires_and_when_the_ca_is_another() {
        let (ca, _) = Ca::generate().expect("a CA");
        let identity = namespace_identity("team-a");
        let short = ca
            .issue(&identity, &[], Duration::from_secs(7 * 24 * 3600))
            .expect("issued");
        let now = SystemTime::now();
        assert!(usable(&secret(&short, ca.pem()), ca.pem(), &identity, now).is_ok());
        let ahead = usable(
            &secret(&short, ca.pem()),
            ca.pem(),
            &identity,
            now + RENEW_BEFORE,
        )
        .expect_err("expires within RENEW_BEFORE");
        assert!(ahead.contains("does not verify"), "{ahead}");
        let fresh = ca.issue(&identity, &[], CERT_VALIDITY).expect("issued");
        assert!(
            usable(
                &secret(&fresh, ca.pem()),
                ca.pem(),
                &identity,
                now + RENEW_BEFORE
            )
            .is_ok()
        );

        // Issued by another CA: neither its bundle nor its chain is the worker CA's.
        let (other, _) = Ca::generate().expect("another CA");
        let foreign = other.issue(&identity, &[], CERT_VALIDITY).expect("issued");
        let refused = usable(&secret(&foreign, other.pem()), ca.pem(), &identity, now)
            .expect_err("another CA's");
        assert!(refused.contains("not the worker CA"), "{refused}");
        let refused = usable(&secret(&foreign, ca.pem()), ca.pem(), &identity, now)
            .expect_err("chains to another CA");
        assert!(refused.contains("does not verify"), "{refused}");

        // A key that is not the certificate's.
        let mut swapped = secret(&fresh, ca.pem());
        swapped.data.as_mut().expect("data").insert(
            KEY_FILE.to_string(),
            ByteString(short.key_pem.clone().into_bytes()),
        );
        assert!(usable(&swapped, ca.pem(), &identity, now).is_err());
        // Missing keys are named.
        let refused = usable(&Secret::default(), ca.pem(), &identity, now).expect_err("empty");
        assert_eq!(refused, "it has no ca.crt");
    }

    #[test]
    fn a_ca_of_another_pki_issues_material_that_chains_to_it() {
        // A CA with a name of its own, as another PKI makes it: what it issues carries
        // its name as the issuer.
        let key = rcgen::KeyPair::generate().expect("a key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "corp-issuing-ca");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).expect("self-signed");
        // cert-manager's layout of a CA Certificate's Secret.
        let data = |pairs: &[(&str, String)]| Secret {
            data: Some(
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), ByteString(v.clone().into_bytes())))
                    .collect(),
            ),
            ..Secret::default()
        };
        // Its `tls.crt` may hold the chain to a root: only its first certificate is the CA
        // (the root would let that PKI's other certificates in).
        let (root, _) = Ca::generate().expect("a root");
        let ca = ca_of(&data(&[
            (CERT_FILE, format!("{}{}", cert.pem(), root.pem())),
            (KEY_FILE, key.serialize_pem()),
            (CA_FILE, root.pem().to_string()),
        ]))
        .expect("loaded");
        assert_eq!(ca.pem(), cert.pem());
        let issued = ca
            .issue(GATEWAY_IDENTITY, &[], CERT_VALIDITY)
            .expect("issued");
        check_material(
            &issued.cert_pem,
            &issued.key_pem,
            &cert.pem(),
            GATEWAY_IDENTITY,
            SystemTime::now(),
        )
        .expect("chains to the PKI's CA");

        // This issuer's layout; a Secret with neither, or a key that is not a key.
        let (own, own_key) = Ca::generate().expect("a CA");
        let loaded = ca_of(&data(&[
            (CA_FILE, own.pem().to_string()),
            (CA_KEY_FILE, own_key),
        ]))
        .expect("loaded");
        assert_eq!(loaded.pem(), own.pem());
        let refused = ca_of(&data(&[(CA_FILE, own.pem().to_string())])).err();
        assert_eq!(
            refused.as_deref(),
            Some("it has no ca.key, nor tls.crt and tls.key")
        );
        let refused = ca_of(&data(&[
            (CA_FILE, own.pem().to_string()),
            (CA_KEY_FILE, "garbage".to_string()),
        ]))
        .err();
        assert!(
            refused
                .as_deref()
                .is_some_and(|r| r.starts_with("it is not a usable CA")),
            "{refused:?}"
        );
    }
}
