//! Authentication: bearer tokens, kept only as SHA-256 digests.
//!
//! Two sources: the bootstrap admin token, whose digest lives in the data directory and whose
//! raw form only in the admin kubeconfig; and `AccessToken` objects
//! (`auth.kruntimes.io/v1alpha1`), issued for users and, through TokenRequest, for
//! ServiceAccounts. An AccessToken's name derives from the token's digest, so lookup is one
//! read of the current snapshot; deleting the object revokes the token at once, and an
//! expired token is refused from the second it expires. Raw tokens are never logged or
//! stored.

use std::collections::HashMap;
use std::path::Path;

use base64::Engine;
use rand::RngCore;
use sha2::{Digest, Sha256};

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use crate::fsutil::write_private;
use crate::store::{Key, Snapshot};

/// Longer bearer tokens are refused without hashing.
const MAX_TOKEN_BYTES: usize = 8 * 1024;
/// The store resource of AccessToken objects.
pub const ACCESS_TOKENS: &str = "accesstokens.auth.kruntimes.io";

/// The AccessToken object name for a token digest.
pub fn token_name(d: &TokenDigest) -> String {
    format!("t{}", &hex::encode(d)[..40])
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Finds the identity of an AccessToken by digest, refusing expired tokens and tokens of
/// ServiceAccounts that no longer exist (or were recreated).
pub fn lookup(snap: &Snapshot, d: &TokenDigest, now: DateTime<Utc>) -> Option<Identity> {
    let key = Key {
        resource: ACCESS_TOKENS.into(),
        namespace: String::new(),
        name: token_name(d),
    };
    let object = &snap.objects.get(&key)?.object;
    let spec = object.get("spec")?;
    let stored = spec.get("digest")?.as_str()?.strip_prefix("sha256:")?;
    if !constant_time_eq(stored.as_bytes(), hex::encode(d).as_bytes()) {
        return None;
    }
    if object.pointer("/metadata/deletionTimestamp").is_some() {
        return None;
    }
    if let Some(expiry) = spec.get("expirationTimestamp").and_then(Value::as_str) {
        let expiry = DateTime::parse_from_rfc3339(expiry).ok()?;
        if now >= expiry {
            return None;
        }
    }
    if let Some(sa) = spec.get("serviceAccount") {
        let key = Key {
            resource: "serviceaccounts".into(),
            namespace: sa.get("namespace")?.as_str()?.to_string(),
            name: sa.get("name")?.as_str()?.to_string(),
        };
        let current = snap.objects.get(&key)?;
        if current.object.pointer("/metadata/uid") != sa.get("uid") {
            return None;
        }
    }
    let user = spec.get("user")?;
    Some(Identity {
        username: user.get("username")?.as_str()?.to_string(),
        uid: user
            .get("uid")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
        groups: user
            .get("groups")
            .and_then(Value::as_array)
            .map(|g| {
                g.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default(),
    })
}

/// Whether an AccessToken can never authenticate again: it expired before `expired_before`,
/// or its ServiceAccount is gone or was recreated.
pub fn is_dead(snap: &Snapshot, token: &Value, expired_before: DateTime<Utc>) -> bool {
    let spec = token.get("spec").unwrap_or(&Value::Null);
    let expired = spec
        .get("expirationTimestamp")
        .and_then(Value::as_str)
        .and_then(|e| DateTime::parse_from_rfc3339(e).ok())
        .is_some_and(|e| e < expired_before);
    let orphaned = spec.get("serviceAccount").is_some_and(|sa| {
        let key = Key {
            resource: "serviceaccounts".into(),
            namespace: sa
                .get("namespace")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            name: sa
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
        };
        snap.objects
            .get(&key)
            .is_none_or(|current| current.object.pointer("/metadata/uid") != sa.get("uid"))
    });
    expired || orphaned
}

/// A freshly issued token: the raw token (returned once, never stored) and the AccessToken
/// object to store.
pub struct IssuedToken {
    pub token: String,
    pub name: String,
    pub object: Value,
    pub expires: Option<DateTime<Utc>>,
}

/// The ServiceAccount a token is bound to.
pub struct BoundServiceAccount {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// The identity of a ServiceAccount, as Kubernetes names it.
pub fn service_account_identity(namespace: &str, name: &str, uid: &str) -> Identity {
    Identity {
        username: format!("system:serviceaccount:{namespace}:{name}"),
        uid: uid.to_string(),
        groups: vec![
            "system:serviceaccounts".into(),
            format!("system:serviceaccounts:{namespace}"),
            "system:authenticated".into(),
        ],
    }
}

/// Issues a JWT-shaped bearer token: a readable header and payload (`sub`, `iat`, `exp`,
/// `jti`) and 256 random bits. Only its SHA-256 digest is kept; the payload only informs
/// clients (a cache may read `exp`), the server trusts the stored object alone.
pub fn issue(
    identity: &Identity,
    bound: Option<BoundServiceAccount>,
    lifetime: Option<chrono::Duration>,
) -> IssuedToken {
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let now = Utc::now();
    let expires = lifetime.map(|l| now + l);
    let mut random = [0u8; 32];
    rand::rng().fill_bytes(&mut random);
    let jti = uuid::Uuid::new_v4().to_string();
    let mut payload =
        json!({"iss": "kruntimes", "sub": identity.username, "iat": now.timestamp(), "jti": jti});
    if let Some(exp) = expires {
        payload["exp"] = json!(exp.timestamp());
    }
    let header = json!({"alg": "none", "typ": "JWT", "kid": "kruntimes-opaque"});
    let token = format!(
        "{}.{}.{}",
        b64.encode(header.to_string()),
        b64.encode(payload.to_string()),
        b64.encode(random)
    );
    let d = digest(&token);
    let name = token_name(&d);
    let mut spec = json!({
        "user": {"username": identity.username, "uid": identity.uid, "groups": identity.groups},
        "digest": format!("sha256:{}", hex::encode(d)),
    });
    if let Some(exp) = expires {
        spec["expirationTimestamp"] = json!(exp.to_rfc3339_opts(chrono::SecondsFormat::Secs, true));
    }
    if let Some(sa) = bound {
        spec["serviceAccount"] = json!({"namespace": sa.namespace, "name": sa.name, "uid": sa.uid});
    }
    let object = json!({
        "apiVersion": "auth.kruntimes.io/v1alpha1",
        "kind": "AccessToken",
        "metadata": {"name": name, "labels": {"auth.kruntimes.io/user": label_value(&identity.username)}},
        "spec": spec,
    });
    IssuedToken {
        token,
        name,
        object,
        expires,
    }
}

/// A label-safe form of a user name (`system:serviceaccount:a:b` → `system.serviceaccount.a.b`).
fn label_value(text: &str) -> String {
    let mut out: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '.'
            }
        })
        .take(63)
        .collect();
    while out.ends_with(|c: char| !c.is_ascii_alphanumeric()) {
        out.pop();
    }
    out
}

/// Who made a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub username: String,
    pub uid: String,
    pub groups: Vec<String>,
}

/// The SHA-256 digest of a token.
pub type TokenDigest = [u8; 32];

pub fn digest(token: &str) -> TokenDigest {
    Sha256::digest(token.as_bytes()).into()
}

/// Known token digests and their identities.
#[derive(Debug, Default)]
pub struct Authenticator {
    tokens: HashMap<TokenDigest, Identity>,
}

impl Authenticator {
    /// The identity behind an `Authorization` header value, if the token is known.
    pub fn authenticate(&self, snap: &Snapshot, authorization: Option<&str>) -> Option<Identity> {
        let token = authorization?.strip_prefix("Bearer ")?.trim();
        self.authenticate_token(snap, token)
    }

    /// The identity behind a raw token, if it is known, unexpired and unrevoked.
    pub fn authenticate_token(&self, snap: &Snapshot, token: &str) -> Option<Identity> {
        if token.is_empty() || token.len() > MAX_TOKEN_BYTES {
            return None;
        }
        let d = digest(token);
        if let Some(identity) = self.tokens.get(&d) {
            return Some(identity.clone());
        }
        lookup(snap, &d, chrono::Utc::now())
    }

    pub fn insert(&mut self, digest: TokenDigest, identity: Identity) {
        self.tokens.insert(digest, identity);
    }
}

/// The identity of unauthenticated health checks.
pub fn anonymous() -> Identity {
    Identity {
        username: "system:anonymous".into(),
        uid: String::new(),
        groups: vec!["system:unauthenticated".into()],
    }
}

/// The admin identity: the `system:masters` group, as on a real cluster.
pub fn admin() -> Identity {
    Identity {
        username: "kruntimes-admin".into(),
        uid: String::new(),
        groups: vec!["system:masters".into(), "system:authenticated".into()],
    }
}

/// Finds the admin token: the one in an existing kubeconfig when its digest matches the
/// stored digest, else a new one (whose digest replaces the stored one). Returns the raw
/// token for the kubeconfig and its digest.
pub fn admin_token(auth_dir: &Path, kubeconfig: &Path) -> std::io::Result<(String, TokenDigest)> {
    std::fs::create_dir_all(auth_dir)?;
    let digest_path = auth_dir.join("admin-token.sha256");
    let stored = std::fs::read_to_string(&digest_path).ok().and_then(|hex| {
        let bytes = hex::decode(hex.trim()).ok()?;
        <TokenDigest>::try_from(bytes.as_slice()).ok()
    });
    if let Some(stored) = stored
        && let Some(token) = token_in_kubeconfig(kubeconfig)
        && digest(&token) == stored
    {
        return Ok((token, stored));
    }
    let mut raw = [0u8; 32];
    rand::rng().fill_bytes(&mut raw);
    let token = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw);
    let d = digest(&token);
    write_private(&digest_path, hex::encode(d).as_bytes())?;
    Ok((token, d))
}

/// The bearer token in a kubeconfig we wrote, if any.
pub fn token_in_kubeconfig(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let value: serde_yaml::Value = serde_yaml::from_str(&text).ok()?;
    value["users"][0]["user"]["token"]
        .as_str()
        .map(str::to_string)
}

/// Writes the kubeconfig for `server_url` with the CA and the admin token (mode 0600).
pub fn write_kubeconfig(
    path: &Path,
    server_url: &str,
    ca_pem: &str,
    token: &str,
    user: &str,
    namespace: &str,
) -> std::io::Result<()> {
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem.as_bytes());
    let doc = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kruntimes", "cluster": {"server": server_url, "certificate-authority-data": ca}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "kruntimes", "context": {"cluster": "kruntimes", "user": user, "namespace": namespace}}],
        "current-context": "kruntimes",
        "preferences": {},
    });
    let yaml = serde_yaml::to_string(&doc).map_err(std::io::Error::other)?;
    write_private(path, yaml.as_bytes())
}

/// The kubeconfig cluster extension that tells clients where the gateway is.
pub const GATEWAY_EXTENSION: &str = "kruntimes.io/gateway";

/// Records the gateway's URL in the kubeconfig at `path` (every cluster entry gets the
/// extension [`GATEWAY_EXTENSION`] with `{"url": URL}`), keeping the rest and mode 0600.
pub fn set_gateway_in_kubeconfig(path: &Path, gateway_url: &str) -> std::io::Result<()> {
    let text = std::fs::read_to_string(path)?;
    let mut doc: serde_json::Value = serde_yaml::from_str(&text).map_err(std::io::Error::other)?;
    let clusters = doc
        .get_mut("clusters")
        .and_then(serde_json::Value::as_array_mut)
        .ok_or_else(|| std::io::Error::other("the kubeconfig has no clusters"))?;
    for entry in clusters {
        if let Some(cluster) = entry.get_mut("cluster").and_then(|c| c.as_object_mut()) {
            cluster.insert(
                "extensions".to_string(),
                serde_json::json!([{"name": GATEWAY_EXTENSION, "extension": {"url": gateway_url}}]),
            );
        }
    }
    let yaml = serde_yaml::to_string(&doc).map_err(std::io::Error::other)?;
    write_private(path, yaml.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_is_reused_only_when_its_digest_matches() {
        let dir = tempfile::tempdir().expect("tempdir");
        let kubeconfig = dir.path().join("kubeconfig");
        let (t1, d1) = admin_token(&dir.path().join("auth"), &kubeconfig).expect("token");
        write_kubeconfig(
            &kubeconfig,
            "https://127.0.0.1:1",
            "PEM",
            &t1,
            "a",
            "default",
        )
        .expect("write");
        let (t2, d2) = admin_token(&dir.path().join("auth"), &kubeconfig).expect("token");
        assert_eq!((t1.clone(), d1), (t2, d2));
        // A kubeconfig edited to carry another token does not become the admin token.
        write_kubeconfig(
            &kubeconfig,
            "https://127.0.0.1:1",
            "PEM",
            "forged",
            "a",
            "default",
        )
        .expect("write");
        let (t3, _) = admin_token(&dir.path().join("auth"), &kubeconfig).expect("token");
        assert_ne!(t3, "forged");
        assert_ne!(t3, t1);
        let stored =
            std::fs::read_to_string(dir.path().join("auth/admin-token.sha256")).expect("digest");
        assert!(!stored.contains(&t3), "the raw token is never stored");
    }

    #[test]
    fn authenticates_bearer_tokens_by_digest() {
        let mut auth = Authenticator::default();
        auth.insert(digest("secret"), admin());
        let snap = Snapshot::default();
        assert!(auth.authenticate(&snap, Some("Bearer secret")).is_some());
        assert!(auth.authenticate(&snap, Some("Bearer other")).is_none());
        assert!(auth.authenticate(&snap, Some("Basic secret")).is_none());
        assert!(auth.authenticate(&snap, Some("Bearer ")).is_none());
        assert!(auth.authenticate(&snap, None).is_none());
    }

    fn store_token(snap: &mut Snapshot, issued: &IssuedToken) {
        snap.objects.insert(
            Key {
                resource: ACCESS_TOKENS.into(),
                namespace: String::new(),
                name: issued.name.clone(),
            },
            crate::store::Stored {
                rv: 1,
                object: std::sync::Arc::new(issued.object.clone()),
            },
        );
    }

    #[test]
    fn issued_tokens_expire_and_follow_their_service_account() {
        let auth = Authenticator::default();
        let mut snap = Snapshot::default();
        let alice = Identity {
            username: "alice".into(),
            uid: String::new(),
            groups: vec!["devs".into()],
        };
        let issued = issue(&alice, None, Some(chrono::Duration::seconds(60)));
        assert_eq!(issued.token.split('.').count(), 3);
        assert!(
            !issued.object.to_string().contains(&issued.token),
            "the raw token is not stored"
        );
        assert!(
            auth.authenticate_token(&snap, &issued.token).is_none(),
            "unknown before it is stored"
        );
        store_token(&mut snap, &issued);
        assert_eq!(
            auth.authenticate_token(&snap, &issued.token)
                .map(|i| i.username),
            Some("alice".into())
        );
        let d = digest(&issued.token);
        let later = Utc::now() + chrono::Duration::seconds(61);
        assert!(lookup(&snap, &d, later).is_none(), "expired");

        let sa = service_account_identity("team", "bot", "uid-1");
        let bound = issue(
            &sa,
            Some(BoundServiceAccount {
                namespace: "team".into(),
                name: "bot".into(),
                uid: "uid-1".into(),
            }),
            None,
        );
        store_token(&mut snap, &bound);
        assert!(
            auth.authenticate_token(&snap, &bound.token).is_none(),
            "the ServiceAccount does not exist"
        );
        let sa_key = Key {
            resource: "serviceaccounts".into(),
            namespace: "team".into(),
            name: "bot".into(),
        };
        snap.objects.insert(
            sa_key.clone(),
            crate::store::Stored {
                rv: 2,
                object: std::sync::Arc::new(json!({"metadata": {"uid": "uid-1"}})),
            },
        );
        assert!(auth.authenticate_token(&snap, &bound.token).is_some());
        snap.objects.insert(
            sa_key,
            crate::store::Stored {
                rv: 3,
                object: std::sync::Arc::new(json!({"metadata": {"uid": "uid-2"}})),
            },
        );
        assert!(
            auth.authenticate_token(&snap, &bound.token).is_none(),
            "a recreated ServiceAccount does not inherit tokens"
        );
        assert!(
            is_dead(&snap, &bound.object, Utc::now()),
            "its token is collected"
        );
        assert!(
            !is_dead(&snap, &issued.object, Utc::now()),
            "not yet expired"
        );
        let later = Utc::now() + chrono::Duration::seconds(120);
        assert!(
            is_dead(&snap, &issued.object, later),
            "expired before `later`"
        );
    }
}
