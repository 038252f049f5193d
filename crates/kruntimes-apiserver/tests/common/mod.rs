//! What the API server's test binaries share: the server in-process on 127.0.0.1:0 in a
//! temporary directory, and an admin client of it.

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
    let mut config = kruntimes_apiserver::Config {
        data_dir: dir.path().to_path_buf(),
        addr: "127.0.0.1:0".parse()?,
        watch_history: 1000,
        durability: kruntimes_apiserver::Durability::Process,
        header_read_timeout: kruntimes_apiserver::DEFAULT_HEADER_READ_TIMEOUT,
        body_read_timeout: kruntimes_apiserver::DEFAULT_BODY_READ_TIMEOUT,
        unpaged_list_examined: kruntimes_apiserver::DEFAULT_UNPAGED_LIST_EXAMINED,
    };
    change(&mut config);
    let server = kruntimes_apiserver::start(config).await?;
    let text = std::fs::read_to_string(server.kubeconfig_path())?;
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&text)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    let client = kube::Client::try_from(config)?;
    Ok((dir, server, client))
}
