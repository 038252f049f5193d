//! The Kubernetes worker provisioner against a real API server, with the
//! controller-manager's own least-privilege identity, driven step by step so that each
//! interleaving is exact: a late cleanup of a deleted Runtime's incarnation, and objects of
//! the names it needs that are not kruntimes'.

mod common;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Service, ServiceAccount};
use kruntimes_api::{Runtime, RuntimeSpec};
use kruntimes_controller::WorkerProvisioner;
use kruntimes_controller::kubernetes::{KubernetesConfig, KubernetesError, KubernetesProvisioner};
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, ResourceExt};

fn provisioner(client: Client) -> KubernetesProvisioner {
    KubernetesProvisioner::new(
        client,
        KubernetesConfig::new(
            "registry.example/control-plane:1",
            "registry.example/runtime:1",
        ),
    )
}

/// Creates the Runtime `name` in `namespace` and returns it as the server stored it (with
/// its UID).
async fn create_runtime(admin: &Client, namespace: &str, name: &str) -> Result<Runtime> {
    let spec: RuntimeSpec = serde_json::from_value(serde_json::json!({}))?;
    let api: Api<Runtime> = Api::namespaced(admin.clone(), namespace);
    Ok(api
        .create(&PostParams::default(), &Runtime::new(name, spec))
        .await?)
}

/// Whether `uid` is the one owner of the object.
fn only_owner(meta: &ObjectMeta, uid: &str) -> bool {
    owner_uids(meta) == [uid]
}

/// Waits (30 s at most) until the API server's garbage collector has removed `object`.
async fn collected<K>(api: &Api<K>, object: &K) -> Result<()>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
{
    use kube::runtime::wait::{await_condition, conditions};
    let uid = object.uid().context("a UID")?;
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        await_condition(
            api.clone(),
            &object.name_any(),
            conditions::is_deleted(&uid),
        ),
    )
    .await
    .context("not collected within 30 s")??;
    Ok(())
}

fn owner_uids(meta: &ObjectMeta) -> Vec<String> {
    meta.owner_references
        .iter()
        .flatten()
        .map(|o| o.uid.clone())
        .collect()
}

/// A Runtime deleted and created again under the same name: the cleanup of the first
/// incarnation, arriving after the second made its objects (the cluster's garbage collector
/// removed the first's), deletes nothing of the second's.
#[tokio::test]
async fn a_late_cleanup_of_an_earlier_incarnation_keeps_the_new_objects() -> Result<()> {
    let env = common::start().await?;
    let provisioner = provisioner(env.controller.clone());
    let runtimes: Api<Runtime> = Api::namespaced(env.admin.clone(), common::NS);
    let deployments: Api<Deployment> = Api::namespaced(env.admin.clone(), common::NS);
    let services: Api<Service> = Api::namespaced(env.admin.clone(), common::NS);

    let first = create_runtime(&env.admin, common::NS, "py").await?;
    let first_uid = first.uid().context("a UID")?;
    provisioner.reconcile(&first).await?;
    let deployment = deployments.get("kruntimes-py").await?;
    ensure!(only_owner(&deployment.metadata, &first_uid));
    let service = services.get("kruntimes-py").await?;
    // The garbage collector removes its objects once the first incarnation is gone.
    runtimes.delete("py", &DeleteParams::default()).await?;
    collected(&deployments, &deployment).await?;
    collected(&services, &service).await?;

    let second = create_runtime(&env.admin, common::NS, "py").await?;
    let second_uid = second.uid().context("a UID")?;
    ensure!(second_uid != first_uid);
    provisioner.reconcile(&second).await?;

    let mut stale = ObjectRef::<Runtime>::new("py").within(common::NS);
    stale.extra.uid = Some(first_uid);
    provisioner.cleanup(&stale).await?;
    let deployment = deployments.get("kruntimes-py").await?;
    ensure!(only_owner(&deployment.metadata, &second_uid));
    let service = services.get("kruntimes-py").await?;
    ensure!(only_owner(&service.metadata, &second_uid));

    // The second's own cleanup removes them.
    let mut current = ObjectRef::<Runtime>::new("py").within(common::NS);
    current.extra.uid = Some(second_uid);
    provisioner.cleanup(&current).await?;
    ensure!(deployments.get_opt("kruntimes-py").await?.is_none());
    ensure!(services.get_opt("kruntimes-py").await?.is_none());
    Ok(())
}

/// A Service of the Runtime's object name that a user made, and a ServiceAccount of the
/// workers' name without kruntimes' label: the reconcile fails naming each, and neither is
/// changed.
#[tokio::test]
async fn objects_that_are_not_kruntimes_are_never_taken_over() -> Result<()> {
    let env = common::start().await?;
    let provisioner = provisioner(env.controller.clone());

    // A user's Service where the Runtime's would go.
    let services: Api<Service> = Api::namespaced(env.admin.clone(), common::NS);
    let theirs: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "kruntimes-py"},
        "spec": {"ports": [{"port": 80}]},
    }))?;
    services.create(&PostParams::default(), &theirs).await?;
    let runtime = create_runtime(&env.admin, common::NS, "py").await?;
    match provisioner.reconcile(&runtime).await {
        Err(error @ KubernetesError::NotOurs { .. }) => {
            let text = error.to_string();
            ensure!(text.contains("Service default/kruntimes-py"), "{text}");
        }
        other => bail!("{other:?}"),
    }
    let service = services.get("kruntimes-py").await?;
    ensure!(owner_uids(&service.metadata).is_empty(), "{service:?}");

    // A user's ServiceAccount of the workers' name, in a namespace of its own.
    let namespaces: Api<Namespace> = Api::all(env.admin.clone());
    let team: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "team"}}))?;
    namespaces.create(&PostParams::default(), &team).await?;
    let accounts: Api<ServiceAccount> = Api::namespaced(env.admin.clone(), "team");
    let account: ServiceAccount =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "kruntimes-runtimed"}}))?;
    accounts.create(&PostParams::default(), &account).await?;
    let runtime = create_runtime(&env.admin, "team", "py").await?;
    match provisioner.reconcile(&runtime).await {
        Err(error @ KubernetesError::SharedNotOurs { .. }) => {
            let text = error.to_string();
            ensure!(
                text.contains("ServiceAccount team/kruntimes-runtimed")
                    && text.contains("app.kubernetes.io/name=kruntimes"),
                "{text}"
            );
        }
        other => bail!("{other:?}"),
    }
    let account = accounts.get("kruntimes-runtimed").await?;
    ensure!(account.labels().is_empty(), "{account:?}");
    let deployments: Api<Deployment> = Api::namespaced(env.admin.clone(), "team");
    ensure!(
        deployments.get_opt("kruntimes-py").await?.is_none(),
        "no workers without their identity"
    );
    Ok(())
}

/// The workers' identity of a namespace is remembered between reconciles (it is not read
/// again for every Runtime at every pass), but per namespace UID: a namespace deleted and
/// made again under its name gets its ServiceAccount, bindings and TLS material again at
/// once.
#[tokio::test]
async fn a_namespace_made_again_gets_the_workers_identity_again() -> Result<()> {
    use k8s_openapi::api::core::v1::Secret;
    use kube::runtime::wait::{await_condition, conditions};

    let env = common::start().await?;
    let mut config = KubernetesConfig::new(
        "registry.example/control-plane:1",
        "registry.example/runtime:1",
    );
    config.worker_ca_secret = Some((
        "kruntimes-system".to_string(),
        "kruntimes-worker-ca".to_string(),
    ));
    let provisioner = KubernetesProvisioner::new(env.controller.clone(), config);
    let namespaces: Api<Namespace> = Api::all(env.admin.clone());
    namespace_exists(&namespaces, "kruntimes-system").await?;
    let secrets: Api<Secret> = Api::namespaced(env.admin.clone(), "again");
    let accounts: Api<ServiceAccount> = Api::namespaced(env.admin.clone(), "again");
    let fresh: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "again"}}))?;

    let first = namespaces.create(&PostParams::default(), &fresh).await?;
    let runtime = create_runtime(&env.admin, "again", "py").await?;
    provisioner.reconcile(&runtime).await?;
    ensure!(accounts.get_opt("kruntimes-runtimed").await?.is_some());
    // Trusted between passes: a ServiceAccount deleted by hand is not looked for again
    // until IDENTITY_RECHECK has passed (the documented cost of not reading it each time).
    accounts
        .delete("kruntimes-runtimed", &DeleteParams::default())
        .await?;
    provisioner.reconcile(&runtime).await?;
    ensure!(
        accounts.get_opt("kruntimes-runtimed").await?.is_none(),
        "the identity is remembered, not read again at every pass"
    );

    namespaces.delete("again", &DeleteParams::default()).await?;
    let uid = first.uid().context("a UID")?;
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        await_condition(namespaces.clone(), "again", conditions::is_deleted(&uid)),
    )
    .await
    .context("the namespace was not deleted within 30 s")??;

    namespaces.create(&PostParams::default(), &fresh).await?;
    ensure!(
        accounts.get_opt("kruntimes-runtimed").await?.is_none(),
        "the new namespace starts empty"
    );
    let runtime = create_runtime(&env.admin, "again", "py").await?;
    provisioner.reconcile(&runtime).await?;
    ensure!(
        accounts.get_opt("kruntimes-runtimed").await?.is_some(),
        "the workers' ServiceAccount is made in the new namespace"
    );
    ensure!(
        secrets.get_opt("kruntimes-worker-tls").await?.is_some(),
        "the workers' TLS material is issued in the new namespace"
    );
    Ok(())
}

/// Creates namespace `name` unless it exists (the server may have made it at start).
async fn namespace_exists(namespaces: &Api<Namespace>, name: &str) -> Result<()> {
    let namespace: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
    match namespaces.create(&PostParams::default(), &namespace).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
        Err(error) => Err(error.into()),
    }
}

/// Issue 17 item 4, through the controller-manager's own RBAC: two issuers starting at
/// once make one CA and issue from it; a sound Secret is left alone by the next check, a
/// broken one is issued again, and a changed CA is picked up (by an issuer that had read
/// the old one) for what it issues next; Secrets of the workers' name that are not
/// kruntimes' (unlabelled, or of another type) are never taken over.
#[tokio::test]
async fn worker_tls_material_is_issued_renewed_and_never_taken_over() -> Result<()> {
    use k8s_openapi::api::core::v1::Secret;
    use kruntimes_controller::worker_certs::{
        GATEWAY_WORKER_TLS_SECRET, RENEW_BEFORE, WORKER_TLS_SECRET, WorkerCerts,
        namespace_identity, usable,
    };
    use kruntimes_testkit::secret_text;
    use kruntimes_wire::worker::GATEWAY_IDENTITY;
    use kube::api::{Patch, PatchParams};

    const SYSTEM: &str = "kruntimes-system";
    const CA: &str = "kruntimes-worker-ca";
    let env = common::start().await?;
    let issuer = || WorkerCerts::new(env.controller.clone(), SYSTEM, CA);
    let secrets = |namespace| Api::<Secret>::namespaced(env.admin.clone(), namespace);
    let namespaces: Api<Namespace> = Api::all(env.admin.clone());
    for name in [SYSTEM, "team", "team2", "team3"] {
        namespace_exists(&namespaces, name).await?;
    }
    let ahead = || std::time::SystemTime::now() + RENEW_BEFORE;

    let uid_of = |namespace: &'static str| {
        let namespaces = namespaces.clone();
        async move {
            namespaces
                .get(namespace)
                .await?
                .uid()
                .context("a namespace UID")
        }
    };
    let default_uid = uid_of(common::NS).await?;
    let first = issuer();
    let racer = issuer();
    let (workers, gateway) = tokio::join!(
        first.ensure_namespace(common::NS, &default_uid),
        racer.ensure_gateway()
    );
    workers?;
    gateway?;
    let ca = secret_text(&secrets(SYSTEM).get(CA).await?, "ca.crt")?;
    let workers = secrets(common::NS).get(WORKER_TLS_SECRET).await?;
    let gateway = secrets(SYSTEM).get(GATEWAY_WORKER_TLS_SECRET).await?;
    usable(&workers, &ca, &namespace_identity(common::NS), ahead())
        .map_err(anyhow::Error::msg)
        .context("the workers' material, of the one CA")?;
    usable(&gateway, &ca, GATEWAY_IDENTITY, ahead())
        .map_err(anyhow::Error::msg)
        .context("the gateway's material, of the one CA")?;

    // The next check (another issuer, so nothing is remembered) leaves it as it is.
    issuer().ensure_namespace(common::NS, &default_uid).await?;
    let kept = secrets(common::NS).get(WORKER_TLS_SECRET).await?;
    ensure!(kept.resource_version() == workers.resource_version());

    // A broken certificate is issued again.
    secrets(common::NS)
        .patch(
            WORKER_TLS_SECRET,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"stringData": {"tls.crt": "garbage"}})),
        )
        .await?;
    issuer().ensure_namespace(common::NS, &default_uid).await?;
    let again = secrets(common::NS).get(WORKER_TLS_SECRET).await?;
    usable(&again, &ca, &namespace_identity(common::NS), ahead())
        .map_err(anyhow::Error::msg)
        .context("issued again")?;

    // A new CA: the issuer that read the old one issues from the new one.
    secrets(SYSTEM).delete(CA, &DeleteParams::default()).await?;
    let (new_ca, new_key) = kruntimes_apiserver::tls::Ca::generate()?;
    let replacement: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": CA},
        "stringData": {"ca.crt": new_ca.pem(), "ca.key": new_key},
    }))?;
    secrets(SYSTEM)
        .create(&PostParams::default(), &replacement)
        .await?;
    first
        .ensure_namespace("team3", &uid_of("team3").await?)
        .await?;
    let issued = secrets("team3").get(WORKER_TLS_SECRET).await?;
    usable(&issued, new_ca.pem(), &namespace_identity("team3"), ahead())
        .map_err(anyhow::Error::msg)
        .context("issued from the new CA")?;

    // Not kruntimes': unlabelled, or labelled but of another type.
    let theirs: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": WORKER_TLS_SECRET},
        "stringData": {"note": "mine"},
    }))?;
    secrets("team")
        .create(&PostParams::default(), &theirs)
        .await?;
    match issuer()
        .ensure_namespace("team", &uid_of("team").await?)
        .await
    {
        Err(error @ KubernetesError::SharedNotOurs { .. }) => {
            ensure!(
                error
                    .to_string()
                    .contains("Secret team/kruntimes-worker-tls")
            );
        }
        other => bail!("{other:?}"),
    }
    let opaque: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": WORKER_TLS_SECRET,
                     "labels": {"app.kubernetes.io/name": "kruntimes"}},
        "type": "Opaque",
        "stringData": {"note": "mine"},
    }))?;
    secrets("team2")
        .create(&PostParams::default(), &opaque)
        .await?;
    match issuer()
        .ensure_namespace("team2", &uid_of("team2").await?)
        .await
    {
        Err(error @ KubernetesError::WorkerSecretType { .. }) => {
            ensure!(error.to_string().contains("\"Opaque\""), "{error}");
        }
        other => bail!("{other:?}"),
    }
    for namespace in ["team", "team2"] {
        let left = secrets(namespace).get(WORKER_TLS_SECRET).await?;
        ensure!(
            secret_text(&left, "note")? == "mine" && left.data.as_ref().map(|d| d.len()) == Some(1),
            "{namespace}'s Secret was changed: {left:?}"
        );
    }
    Ok(())
}
