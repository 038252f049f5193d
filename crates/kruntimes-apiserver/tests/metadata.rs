//! Empty metadata lists are not stored, as on Kubernetes (whose `ObjectMeta` omits empty
//! `finalizers`, `ownerReferences`, `managedFields`, `labels` and `annotations`). Clients
//! rely on it: kube-runtime's finalizer helper adds the first finalizer with a JSON patch
//! that tests `/metadata/finalizers` against null, which fails on a stored `[]`.
//!
//! The server runs in-process on 127.0.0.1:0 in a temporary directory.

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

mod common;
use common::server;

/// The JSON patch kube-runtime's `finalizer` helper sends to add the first finalizer to an
/// object whose `finalizers()` is empty (kube-runtime 5, `finalizer.rs`).
fn add_first_finalizer(name: &str) -> Value {
    json!([
        {"op": "test", "path": "/metadata/finalizers", "value": null},
        {"op": "add", "path": "/metadata/finalizers", "value": [name]},
    ])
}

/// The JSON patch the helper sends to remove finalizer `index` named `name`.
fn remove_finalizer(index: usize, name: &str) -> Value {
    json!([
        {"op": "test", "path": format!("/metadata/finalizers/{index}"), "value": name},
        {"op": "remove", "path": format!("/metadata/finalizers/{index}")},
    ])
}

/// Sends JSON patch `patch` to Lease `name` in default (as raw bytes: kube's `Patch::Json`
/// takes another json-patch version than this crate's).
async fn json_patch(client: &kube::Client, name: &str, patch: &Value) -> anyhow::Result<Lease> {
    let request = hyper::Request::patch(lease_path(name))
        .header("content-type", "application/json-patch+json")
        .body(serde_json::to_vec(patch)?)?;
    Ok(client.request(request).await?)
}

fn lease_path(name: &str) -> String {
    format!("/apis/coordination.k8s.io/v1/namespaces/default/leases/{name}")
}

/// Regression: once the last finalizer was removed the server stored `finalizers: []`, and
/// the helper's next "add the first finalizer" patch failed with 422 ("value did not
/// match"), which the controller logged on every reconcile of a Runtime.
#[tokio::test]
async fn the_finalizer_helper_can_add_a_finalizer_again_after_removing_the_last()
-> anyhow::Result<()> {
    let (_dir, server, client) = server().await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "default");
    leases
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "a"}}))?,
        )
        .await?;
    json_patch(&client, "a", &add_first_finalizer("x")).await?;
    let lease = json_patch(&client, "a", &remove_finalizer(0, "x")).await?;
    // The helper sees no finalizers and sends the same patch again: it must apply.
    assert!(lease.metadata.finalizers.unwrap_or_default().is_empty());
    let lease = json_patch(&client, "a", &add_first_finalizer("x")).await?;
    assert_eq!(lease.metadata.finalizers, Some(vec!["x".to_string()]));
    json_patch(&client, "a", &remove_finalizer(0, "x")).await?;
    let raw = raw_metadata(&client, "a").await?;
    assert!(raw.get("finalizers").is_none(), "{raw}");
    server.shutdown().await
}

/// Empty lists and maps in metadata, sent on create, update or patch, are not stored.
#[tokio::test]
async fn empty_metadata_lists_and_maps_are_not_stored() -> anyhow::Result<()> {
    let (_dir, server, client) = server().await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "default");
    let empty = json!({
        "finalizers": [], "ownerReferences": [], "labels": {}, "annotations": {},
    });
    let mut body = json!({"metadata": {"name": "a"}});
    body["metadata"]
        .as_object_mut()
        .expect("metadata")
        .extend(empty.as_object().expect("object").clone());
    leases
        .create(&PostParams::default(), &serde_json::from_value(body)?)
        .await?;
    let raw = raw_metadata(&client, "a").await?;
    for field in ["finalizers", "ownerReferences", "labels", "annotations"] {
        assert!(
            raw.get(field).is_none(),
            "{field} stored after create: {raw}"
        );
    }
    // A merge patch that empties them: gone too, not `[]` or `{}`.
    leases
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["x"], "labels": {"k": "v"}}})),
        )
        .await?;
    leases
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": [], "labels": {"k": null}}})),
        )
        .await?;
    let raw = raw_metadata(&client, "a").await?;
    for field in ["finalizers", "labels"] {
        assert!(
            raw.get(field).is_none(),
            "{field} stored after patch: {raw}"
        );
    }
    // A replace that sends them empty.
    let mut lease = leases.get("a").await?;
    lease.metadata.finalizers = Some(vec![]);
    lease.metadata.owner_references = Some(vec![]);
    leases.replace("a", &PostParams::default(), &lease).await?;
    let raw = raw_metadata(&client, "a").await?;
    for field in ["finalizers", "ownerReferences"] {
        assert!(
            raw.get(field).is_none(),
            "{field} stored after update: {raw}"
        );
    }
    server.shutdown().await
}

/// The metadata of Lease `name` in default as the server sends it, not as a typed client
/// reads it (which cannot tell a missing list from an empty one).
async fn raw_metadata(client: &kube::Client, name: &str) -> anyhow::Result<Value> {
    let request = hyper::Request::get(lease_path(name)).body(Vec::new())?;
    let object: Value = client.request(request).await?;
    Ok(object["metadata"].clone())
}

/// A write that carries the UID of an object deleted and made again under its name is
/// refused with 409, as a cluster refuses it (the UID is a precondition), and changes
/// nothing: a server-side apply, a merge patch and a replace alike. The same writes with the
/// current UID, or with none, go through.
#[tokio::test]
async fn a_write_carrying_another_objects_uid_is_refused() -> anyhow::Result<()> {
    let (_dir, server, client) = server().await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "default");
    let made = |holder: &str| -> anyhow::Result<Lease> {
        Ok(serde_json::from_value(json!({
            "metadata": {"name": "a"},
            "spec": {"holderIdentity": holder},
        }))?)
    };
    let first = leases
        .create(&PostParams::default(), &made("first")?)
        .await?;
    leases.delete("a", &Default::default()).await?;
    let second = leases
        .create(&PostParams::default(), &made("second")?)
        .await?;
    let stale = first.metadata.uid.clone().expect("a UID");
    assert_ne!(second.metadata.uid.as_deref(), Some(stale.as_str()));

    let conflict = |e: kube::Error| matches!(e, kube::Error::Api(s) if s.code == 409 && s.message.contains(&stale));
    let mut apply = made("taken")?;
    apply.metadata.uid = Some(stale.clone());
    apply.metadata.resource_version = None;
    let mut body = serde_json::to_value(&apply)?;
    body["apiVersion"] = json!("coordination.k8s.io/v1");
    body["kind"] = json!("Lease");
    let refused = leases
        .patch(
            "a",
            &PatchParams::apply("test").force(),
            &Patch::Apply(&body),
        )
        .await
        .expect_err("an apply with a stale UID");
    assert!(conflict(refused));
    let merge = json!({"metadata": {"uid": stale}, "spec": {"holderIdentity": "taken"}});
    let refused = leases
        .patch("a", &PatchParams::default(), &Patch::Merge(&merge))
        .await
        .expect_err("a merge patch with a stale UID");
    assert!(conflict(refused));
    let mut replace = second.clone();
    replace.metadata.uid = Some(stale.clone());
    replace.spec.as_mut().expect("a spec").holder_identity = Some("taken".into());
    let refused = leases
        .replace("a", &PostParams::default(), &replace)
        .await
        .expect_err("a replace with a stale UID");
    assert!(conflict(refused));
    let now = leases.get("a").await?;
    assert_eq!(now.metadata.uid, second.metadata.uid);
    assert_eq!(
        now.metadata.resource_version,
        second.metadata.resource_version
    );

    // With the current UID, or none, the writes go through.
    body["metadata"]["uid"] = json!(second.metadata.uid);
    let applied = leases
        .patch(
            "a",
            &PatchParams::apply("test").force(),
            &Patch::Apply(&body),
        )
        .await?;
    assert_eq!(
        applied.spec.and_then(|s| s.holder_identity).as_deref(),
        Some("taken")
    );
    let merge = json!({"spec": {"holderIdentity": "merged"}});
    let merged = leases
        .patch("a", &PatchParams::default(), &Patch::Merge(&merge))
        .await?;
    assert_eq!(
        merged.spec.and_then(|s| s.holder_identity).as_deref(),
        Some("merged")
    );
    drop(server);
    Ok(())
}
