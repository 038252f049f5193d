//! What the API server's test binaries share: the server in-process on 127.0.0.1:0 in a
//! temporary directory, and an admin client of it.

// Each test binary compiles this module and uses some of it.
#![allow(dead_code)]

/// A started server, its directory and an admin client.
pub async fn server()
-> anyhow::Result<(tempfile::TempDir, kruntimes_apiserver::Server, kube::Client)> {
    server_with(|_| {}).await
}

/// [`server`] with its configuration changed by `change` first.
pub async fn server_with(
    change: impl FnOnce(&mut kruntimes_apiserver::Config),
) -> anyhow::Result<(tempfile::TempDir, kruntimes_apiserver::Server, kube::Client)> {
    let dir = tempfile::tempdir()?;
    let (server, client) = start_in(dir.path(), change).await?;
    Ok((dir, server, client))
}

/// A server in `dir` (a new one, or one an earlier server used), its configuration
/// changed by `change`, and an admin client of it.
pub async fn start_in(
    dir: &std::path::Path,
    change: impl FnOnce(&mut kruntimes_apiserver::Config),
) -> anyhow::Result<(kruntimes_apiserver::Server, kube::Client)> {
    let mut config = kruntimes_apiserver::Config::new(dir.to_path_buf(), "127.0.0.1:0".parse()?);
    change(&mut config);
    let server = kruntimes_apiserver::start(config).await?;
    let text = std::fs::read_to_string(server.kubeconfig_path())?;
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&text)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    Ok((server, kube::Client::try_from(config)?))
}
