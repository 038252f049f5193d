//! A data directory written by an earlier version keeps its meaning: a Runtime stored with
//! the earlier template shape (`spec.template.args` and friends, the runtime container's
//! fields) is rewritten at start-up into a Pod template whose `runtime` container has
//! them, as a new generation, rather than read back without them.
//!
//! The server runs in-process on 127.0.0.1:0 in a temporary directory, is stopped, its
//! database is given the earlier shape (as an earlier version wrote it), and it starts
//! again on the same directory.

use std::path::Path;

use kruntimes_api::{Runtime, RuntimeSpec};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

mod common;

async fn start(dir: &Path) -> anyhow::Result<(kruntimes_apiserver::Server, kube::Client)> {
    common::start_in(dir, |_| {}).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_stored_with_the_earlier_template_shape_keeps_its_fields() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (server, client) = start(dir.path()).await?;
    let runtimes = Api::<Runtime>::namespaced(client, "default");
    let spec: RuntimeSpec = serde_json::from_value(json!({"replicas": 0}))?;
    let created = runtimes
        .create(&PostParams::default(), &Runtime::new("python", spec))
        .await?;
    let generation = created.metadata.generation.unwrap_or_default();
    server.shutdown().await?;

    // What an earlier version stored: the runtime container's fields on the template.
    {
        let db = rusqlite::Connection::open(dir.path().join("state.db"))?;
        let body: Vec<u8> = db.query_row(
            "SELECT body FROM objects WHERE resource = 'runtimes.kruntimes.io' AND name = 'python'",
            [],
            |row| row.get(0),
        )?;
        let mut object: Value = serde_json::from_slice(&body)?;
        object["spec"]["template"] = json!({
            "args": ["--adapter", "python"],
            "env": [{"name": "MODE", "value": "fast"}],
        });
        db.execute(
            "UPDATE objects SET body = ?1 WHERE resource = 'runtimes.kruntimes.io' AND name = 'python'",
            [serde_json::to_vec(&object)?],
        )?;
    }

    let (server, client) = start(dir.path()).await?;
    let runtimes = Api::<Runtime>::namespaced(client, "default");
    let upgraded = runtimes.get("python").await?;
    let container = upgraded
        .spec
        .runtime_container()
        .ok_or_else(|| anyhow::anyhow!("no runtime container: {:?}", upgraded.spec.template))?;
    assert_eq!(
        container.args.clone().unwrap_or_default(),
        ["--adapter", "python"]
    );
    let env = container.env.clone().unwrap_or_default();
    assert_eq!(
        (env[0].name.as_str(), env[0].value.as_deref()),
        ("MODE", Some("fast"))
    );
    assert_eq!(upgraded.metadata.generation, Some(generation + 1));
    server.shutdown().await?;

    // Once: a third start changes nothing.
    let (server, client) = start(dir.path()).await?;
    let again = Api::<Runtime>::namespaced(client, "default")
        .get("python")
        .await?;
    assert_eq!(
        again.metadata.resource_version,
        upgraded.metadata.resource_version
    );
    server.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_writing_the_earlier_template_shape_gets_it_upgraded_not_dropped()
-> anyhow::Result<()> {
    use kube::api::{ApiResource, DynamicObject, Patch, PatchParams};
    let dir = tempfile::tempdir()?;
    let (server, client) = start(dir.path()).await?;
    let resource = ApiResource::erase::<Runtime>(&());
    let dynamic = Api::<DynamicObject>::namespaced_with(client.clone(), "default", &resource);
    let mut object = DynamicObject::new("bash", &resource);
    object.data = json!({"spec": {"replicas": 0, "template": {"args": ["--adapter", "bash"]}}});
    dynamic.create(&PostParams::default(), &object).await?;
    let runtimes = Api::<Runtime>::namespaced(client, "default");
    let args = |runtime: &Runtime| {
        runtime
            .spec
            .runtime_container()
            .and_then(|c| c.args.clone())
            .unwrap_or_default()
    };
    assert_eq!(args(&runtimes.get("bash").await?), ["--adapter", "bash"]);
    // A merge patch in the earlier shape, too.
    let patch = json!({"spec": {"template": {"args": ["--adapter", "python"]}}});
    runtimes
        .patch("bash", &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    assert_eq!(args(&runtimes.get("bash").await?), ["--adapter", "python"]);
    server.shutdown().await?;
    Ok(())
}
