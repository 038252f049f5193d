//! How krt finds and talks to the control plane: the kubeconfig, the API server client and
//! the default namespace come from the SDK's [`Connection`]; the gateway (its URL, CA and
//! token come from the same kubeconfig) is krt's own.

use std::path::PathBuf;

use anyhow::{Context, Result, anyhow, bail};
use kruntimes_client::{Connection, Functions};
use kube::config::Kubeconfig;

/// The kubeconfig extension on a cluster entry that names the gateway.
pub const GATEWAY_EXTENSION: &str = "kruntimes.io/gateway";

/// Connection settings from the command line and the environment.
#[derive(Debug, Default, Clone)]
pub struct Settings {
    pub kubeconfig: Option<PathBuf>,
    pub namespace: Option<String>,
    pub gateway: Option<String>,
}

/// A connected krt: the API server client, the kubeconfig it came from, the namespace.
pub struct Conn {
    pub client: kube::Client,
    /// The SDK's connection, in the namespace below.
    pub sdk: Connection,
    /// Where the kubeconfig came from, for messages.
    pub source: String,
    /// `-n`, else the kubeconfig context's namespace, else `default`.
    pub namespace: String,
    gateway_flag: Option<String>,
}

impl Conn {
    /// Reads the kubeconfig (`--kubeconfig`, else `$KUBECONFIG`, else
    /// `$KRUNTIMES_DATA_DIR/kubeconfig`, else `.kruntimes/kubeconfig`) and builds a client
    /// (no request is made yet).
    pub async fn connect(settings: Settings) -> Result<Conn> {
        let mut sdk = Connection::from_kubeconfig(settings.kubeconfig).await?;
        if let Some(namespace) = settings.namespace {
            sdk = sdk.with_namespace(namespace);
        }
        Ok(Conn {
            client: sdk.client().clone(),
            source: sdk.source().to_string(),
            namespace: sdk.namespace().to_string(),
            sdk,
            gateway_flag: settings.gateway,
        })
    }

    /// Function operations in the namespace.
    pub fn functions(&self) -> Functions {
        self.sdk.functions()
    }

    /// The gateway: `--gateway`/`KRT_GATEWAY`, else the current cluster's
    /// `kruntimes.io/gateway` extension. TLS trusts the kubeconfig cluster's CA and requests
    /// carry the kubeconfig user's token.
    pub async fn gateway(&self) -> Result<crate::gateway::Gateway> {
        let from_kubeconfig = match self.sdk.kubeconfig() {
            Some(kubeconfig) => gateway_from_kubeconfig(kubeconfig)?,
            None => None,
        };
        let url = match (&self.gateway_flag, from_kubeconfig) {
            (Some(url), _) => url.clone(),
            (None, Some(url)) => url,
            (None, None) => bail!(
                "no gateway configured: the kubeconfig {} has no `{GATEWAY_EXTENSION}` \
                 extension on its current cluster; pass --gateway https://HOST:PORT or set \
                 KRT_GATEWAY (`kruntimes up` writes the extension when it starts the gateway)",
                self.source
            ),
        };
        let uri: http::Uri = url
            .parse()
            .with_context(|| format!("the gateway URL {url:?} is not a URL"))?;
        if !matches!(uri.scheme_str(), Some("https" | "http")) || uri.host().is_none() {
            bail!("the gateway URL {url:?} must look like https://HOST:PORT");
        }
        let mut config = self.sdk.config().clone();
        config.cluster_url = uri;
        // Following logs may be quiet for a long time.
        config.read_timeout = None;
        let client = kube::Client::try_from(config)
            .with_context(|| format!("cannot build a client for the gateway {url}"))?;
        Ok(crate::gateway::Gateway::new(client, url))
    }
}

/// The gateway URL recorded in the kubeconfig's current cluster, if any.
pub fn gateway_from_kubeconfig(kubeconfig: &Kubeconfig) -> Result<Option<String>> {
    let Some(current) = kubeconfig.current_context.as_deref() else {
        return Ok(None);
    };
    let Some(cluster_name) = kubeconfig
        .contexts
        .iter()
        .find(|c| c.name == current)
        .and_then(|c| c.context.as_ref())
        .map(|c| c.cluster.as_str())
    else {
        return Ok(None);
    };
    let Some(cluster) = kubeconfig
        .clusters
        .iter()
        .find(|c| c.name == cluster_name)
        .and_then(|c| c.cluster.as_ref())
    else {
        return Ok(None);
    };
    let Some(extension) = cluster
        .extensions
        .iter()
        .flatten()
        .find(|e| e.name == GATEWAY_EXTENSION)
    else {
        return Ok(None);
    };
    match extension.extension.get("url").and_then(|u| u.as_str()) {
        Some(url) if !url.is_empty() => Ok(Some(url.to_string())),
        _ => bail!(
            "the kubeconfig's `{GATEWAY_EXTENSION}` extension has no \"url\"; expected \
             {{\"url\": \"https://127.0.0.1:PORT\"}}; pass --gateway or set KRT_GATEWAY"
        ),
    }
}

/// Turns API errors into one line that says what went wrong and what to do.
pub fn explain(e: kube::Error) -> anyhow::Error {
    match e {
        kube::Error::Api(status) => {
            if status.code == 401 {
                anyhow!(
                    "the API server refused the kubeconfig's credentials ({}): {}",
                    status.code,
                    status.message
                )
            } else {
                anyhow!("the server refused: {} ({})", status.message, status.code)
            }
        }
        other => anyhow!(
            "cannot reach the API server: {other}; is `kruntimes up` running? set KUBECONFIG or run it"
        ),
    }
}

/// Whether `e` is the API server's 404.
pub fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KUBECONFIG: &str = r#"
apiVersion: v1
kind: Config
clusters:
- name: other
  cluster:
    server: https://127.0.0.1:1
    extensions:
    - name: kruntimes.io/gateway
      extension: {url: "https://127.0.0.1:1111"}
- name: kruntimes
  cluster:
    server: https://127.0.0.1:2
    extensions:
    - name: something/else
      extension: {url: "https://127.0.0.1:9"}
    - name: kruntimes.io/gateway
      extension:
        url: https://127.0.0.1:4443
users:
- name: admin
  user: {token: abc}
contexts:
- name: kruntimes
  context: {cluster: kruntimes, user: admin, namespace: team}
current-context: kruntimes
"#;

    #[test]
    fn gateway_comes_from_the_current_cluster_extension() {
        let kubeconfig = Kubeconfig::from_yaml(KUBECONFIG).expect("parse");
        assert_eq!(
            gateway_from_kubeconfig(&kubeconfig).expect("ok"),
            Some("https://127.0.0.1:4443".to_string())
        );
    }

    #[test]
    fn no_extension_means_no_gateway() {
        let text = KUBECONFIG.replace("kruntimes.io/gateway", "x/y");
        let kubeconfig = Kubeconfig::from_yaml(&text).expect("parse");
        assert_eq!(gateway_from_kubeconfig(&kubeconfig).expect("ok"), None);
        let mut kubeconfig = Kubeconfig::from_yaml(KUBECONFIG).expect("parse");
        kubeconfig.current_context = None;
        assert_eq!(gateway_from_kubeconfig(&kubeconfig).expect("ok"), None);
    }

    #[test]
    fn an_extension_without_url_is_an_error() {
        let text = KUBECONFIG.replace("url: https://127.0.0.1:4443", "port: 4443");
        let kubeconfig = Kubeconfig::from_yaml(&text).expect("parse");
        let e = gateway_from_kubeconfig(&kubeconfig).expect_err("no url");
        assert!(e.to_string().contains("--gateway"), "{e}");
    }
}
