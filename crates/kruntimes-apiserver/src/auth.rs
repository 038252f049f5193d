//! Authentication: bearer tokens, kept only as SHA-256 digests.
//!
//! Today there is one identity, the admin, whose token `kruntimes up` writes into the
//! kubeconfig. Finer identities and RBAC come with the identity issue; this module is the
//! seam they plug into. Raw tokens are never logged or stored outside the kubeconfig.

use std::collections::HashMap;
use std::path::Path;

use base64::Engine;
use rand::RngCore;
use sha2::{Digest, Sha256};

use crate::fsutil::write_private;

/// Who made a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub username: String,
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
    pub fn authenticate(&self, authorization: Option<&str>) -> Option<&Identity> {
        let token = authorization?.strip_prefix("Bearer ")?.trim();
        if token.is_empty() {
            return None;
        }
        self.tokens.get(&digest(token))
    }

    pub fn insert(&mut self, digest: TokenDigest, identity: Identity) {
        self.tokens.insert(digest, identity);
    }
}

/// The admin identity: the `system:masters` group, as on a real cluster.
pub fn admin() -> Identity {
    Identity {
        username: "kruntimes-admin".into(),
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

fn token_in_kubeconfig(path: &Path) -> Option<String> {
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
) -> std::io::Result<()> {
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem.as_bytes());
    let doc = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kruntimes", "cluster": {"server": server_url, "certificate-authority-data": ca}}],
        "users": [{"name": "kruntimes-admin", "user": {"token": token}}],
        "contexts": [{"name": "kruntimes", "context": {"cluster": "kruntimes", "user": "kruntimes-admin", "namespace": "default"}}],
        "current-context": "kruntimes",
        "preferences": {},
    });
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
        write_kubeconfig(&kubeconfig, "https://127.0.0.1:1", "PEM", &t1).expect("write");
        let (t2, d2) = admin_token(&dir.path().join("auth"), &kubeconfig).expect("token");
        assert_eq!((t1.clone(), d1), (t2, d2));
        // A kubeconfig edited to carry another token does not become the admin token.
        write_kubeconfig(&kubeconfig, "https://127.0.0.1:1", "PEM", "forged").expect("write");
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
        assert!(auth.authenticate(Some("Bearer secret")).is_some());
        assert!(auth.authenticate(Some("Bearer other")).is_none());
        assert!(auth.authenticate(Some("Basic secret")).is_none());
        assert!(auth.authenticate(Some("Bearer ")).is_none());
        assert!(auth.authenticate(None).is_none());
    }
}
