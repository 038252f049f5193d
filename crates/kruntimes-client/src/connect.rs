//! Connecting to kruntimes: which kubeconfig to read, the API server client built from it,
//! and the namespace to work in. Everything else in this crate starts from a
//! [`Connection`].
//!
//! This module only reads kubeconfig files and builds clients; it makes no request.

use std::ffi::OsString;
use std::path::PathBuf;

use kube::config::{KubeConfigOptions, Kubeconfig, KubeconfigError};

use crate::function::Functions;

/// Why a [`Connection`] could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The one kubeconfig to read does not exist.
    #[error(
        "cannot read the kubeconfig {}: is `kruntimes up` running? set KUBECONFIG to its \
         kubeconfig, or run `kruntimes up` in this directory",
        path.display()
    )]
    Missing {
        /// The path that was tried.
        path: PathBuf,
    },
    /// None of the kubeconfigs of a `KUBECONFIG` list exist.
    #[error(
        "none of the kubeconfigs in KUBECONFIG exist ({paths}); is `kruntimes up` running? \
         set KUBECONFIG to its kubeconfig or run it"
    )]
    NoneExist {
        /// The paths that were tried, `:`-separated.
        paths: String,
    },
    /// A kubeconfig file exists but does not parse.
    #[error("{} is not a valid kubeconfig", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        #[source]
        source: KubeconfigError,
    },
    /// Two kubeconfigs of a `KUBECONFIG` list cannot be merged.
    #[error("cannot merge the kubeconfig {}", path.display())]
    Merge {
        /// The file that was being merged in.
        path: PathBuf,
        /// Why merging failed.
        #[source]
        source: KubeconfigError,
    },
    /// The kubeconfig parses but does not describe a usable cluster, user and context.
    #[error("cannot use the kubeconfig {kubeconfig}")]
    Config {
        /// Where the kubeconfig came from (its paths, `:`-separated).
        kubeconfig: String,
        /// What kube-rs found wrong.
        #[source]
        source: KubeconfigError,
    },
    /// No client could be built from the configuration (TLS material, proxy, auth).
    #[error("cannot build a client from the kubeconfig {kubeconfig}")]
    Client {
        /// Where the configuration came from.
        kubeconfig: String,
        /// kube-rs's reason.
        #[source]
        source: kube::Error,
    },
}

/// The kubeconfig paths to read, in order: `flag` (an explicit path), else
/// `kubeconfig_env` (`$KUBECONFIG`, a `:`-separated list), else
/// `data_dir_env/kubeconfig` (`$KRUNTIMES_DATA_DIR`), else `.kruntimes/kubeconfig`, where
/// `kruntimes up` writes it by default. Empty values count as unset.
pub fn kubeconfig_paths(
    flag: Option<PathBuf>,
    kubeconfig_env: Option<OsString>,
    data_dir_env: Option<OsString>,
) -> Vec<PathBuf> {
    if let Some(path) = flag {
        return vec![path];
    }
    if let Some(value) = kubeconfig_env.filter(|v| !v.is_empty()) {
        let paths: Vec<PathBuf> = std::env::split_paths(&value)
            .filter(|p| !p.as_os_str().is_empty())
            .collect();
        if !paths.is_empty() {
            return paths;
        }
    }
    let data_dir = data_dir_env
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(".kruntimes"));
    vec![data_dir.join("kubeconfig")]
}

/// Reads and merges `paths` the way kubectl does: a missing entry of a list is skipped, a
/// single missing file is an error.
pub fn load_kubeconfig(paths: &[PathBuf]) -> Result<Kubeconfig, ConnectError> {
    let mut merged: Option<Kubeconfig> = None;
    for path in paths {
        if !path.exists() && paths.len() > 1 {
            continue;
        }
        let one = Kubeconfig::read_from(path).map_err(|source| {
            if path.exists() {
                ConnectError::Invalid {
                    path: path.clone(),
                    source,
                }
            } else {
                ConnectError::Missing { path: path.clone() }
            }
        })?;
        merged = Some(match merged {
            None => one,
            Some(m) => m.merge(one).map_err(|source| ConnectError::Merge {
                path: path.clone(),
                source,
            })?,
        });
    }
    merged.ok_or_else(|| ConnectError::NoneExist {
        paths: join_paths(paths),
    })
}

fn join_paths(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(":")
}

/// A client of one kruntimes control plane, working in one namespace.
///
/// Cheap to clone: the API client is shared. The kube-rs [`kube::Config`] it was built
/// from is kept, so that calls to other endpoints of the system (a function's invoke URL)
/// carry the same credentials, whatever kind they are (token, exec plugin, client
/// certificate), without this crate handling them itself.
#[derive(Clone)]
pub struct Connection {
    client: kube::Client,
    config: kube::Config,
    kubeconfig: Option<Kubeconfig>,
    source: String,
    namespace: String,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The configuration holds credentials: name where it came from only.
        f.debug_struct("Connection")
            .field("source", &self.source)
            .field("cluster_url", &self.config.cluster_url)
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// Connects with the kubeconfig chain of [`kubeconfig_paths`]: `kubeconfig` when given,
    /// else `$KUBECONFIG`, else `$KRUNTIMES_DATA_DIR/kubeconfig`, else
    /// `.kruntimes/kubeconfig`. The namespace is the current context's, else `default`.
    ///
    /// Reads files only; the first request is made by the first operation.
    pub async fn from_kubeconfig(kubeconfig: Option<PathBuf>) -> Result<Connection, ConnectError> {
        let paths = kubeconfig_paths(
            kubeconfig,
            std::env::var_os("KUBECONFIG"),
            std::env::var_os("KRUNTIMES_DATA_DIR"),
        );
        Connection::from_paths(&paths).await
    }

    /// Connects with the kubeconfig made of `paths` (merged like a `KUBECONFIG` list), in
    /// its current context.
    pub async fn from_paths(paths: &[PathBuf]) -> Result<Connection, ConnectError> {
        let source = join_paths(paths);
        let kubeconfig = load_kubeconfig(paths)?;
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig.clone(), &KubeConfigOptions::default())
                .await
                .map_err(|source_error| ConnectError::Config {
                    kubeconfig: source.clone(),
                    source: source_error,
                })?;
        let mut connection = Connection::from_config(config, &source)?;
        connection.kubeconfig = Some(kubeconfig);
        Ok(connection)
    }

    /// Connects with a kube-rs configuration made elsewhere; `source` names it in errors.
    /// The namespace is the configuration's default namespace.
    pub fn from_config(config: kube::Config, source: &str) -> Result<Connection, ConnectError> {
        let client = kube::Client::try_from(config.clone()).map_err(|e| ConnectError::Client {
            kubeconfig: source.to_string(),
            source: e,
        })?;
        Ok(Connection {
            client,
            namespace: config.default_namespace.clone(),
            config,
            kubeconfig: None,
            source: source.to_string(),
        })
    }

    /// The same connection working in `namespace`.
    pub fn with_namespace(mut self, namespace: impl Into<String>) -> Connection {
        self.namespace = namespace.into();
        self
    }

    /// The API server client.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    /// The kube-rs configuration the client was built from (cluster URL, CA, credentials).
    pub fn config(&self) -> &kube::Config {
        &self.config
    }

    /// The kubeconfig that was read, when the connection came from one.
    pub fn kubeconfig(&self) -> Option<&Kubeconfig> {
        self.kubeconfig.as_ref()
    }

    /// Where the configuration came from (kubeconfig paths, `:`-separated), for messages.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The namespace operations work in.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Function operations in this connection's namespace.
    pub fn functions(&self) -> Functions {
        Functions::new(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubeconfig_flag_wins_then_env_list_then_data_dir() {
        assert_eq!(
            kubeconfig_paths(Some("/a".into()), Some("/b".into()), Some("/d".into())),
            vec![PathBuf::from("/a")]
        );
        assert_eq!(
            kubeconfig_paths(None, Some("/b:/c".into()), Some("/d".into())),
            vec![PathBuf::from("/b"), PathBuf::from("/c")]
        );
        assert_eq!(
            kubeconfig_paths(None, Some("".into()), Some("/d".into())),
            vec![PathBuf::from("/d/kubeconfig")]
        );
        assert_eq!(
            kubeconfig_paths(None, None, None),
            vec![PathBuf::from(".kruntimes/kubeconfig")]
        );
    }

    #[test]
    fn a_missing_kubeconfig_says_what_to_do() {
        let e = load_kubeconfig(&[PathBuf::from("/no/such/kubeconfig")]).expect_err("missing");
        assert!(matches!(e, ConnectError::Missing { .. }), "{e:?}");
        assert!(e.to_string().contains("is `kruntimes up` running?"), "{e}");
        let e =
            load_kubeconfig(&[PathBuf::from("/no/a"), PathBuf::from("/no/b")]).expect_err("none");
        assert!(e.to_string().contains("/no/a:/no/b"), "{e}");
    }

    #[test]
    fn an_invalid_kubeconfig_names_the_file() {
        let dir = std::env::temp_dir().join(format!("krc-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("kubeconfig");
        std::fs::write(&path, "clusters: [1, 2").expect("write");
        let e = load_kubeconfig(std::slice::from_ref(&path)).expect_err("invalid");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(matches!(e, ConnectError::Invalid { .. }), "{e:?}");
        assert!(e.to_string().contains("is not a valid kubeconfig"), "{e}");
    }
}
