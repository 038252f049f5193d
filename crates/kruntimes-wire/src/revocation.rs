//! Revocation: watches of the objects an authorization decision rests on, which invalidate
//! an [`Authorizer`]'s cache when any of them changes.
//!
//! A cached success says "this token's holder may `get` this Run". It stops being true when
//! the token is revoked (its `AccessToken` deleted, in standalone mode), when the
//! ServiceAccount it belongs to is deleted or recreated, or when an RBAC Role, ClusterRole,
//! RoleBinding or ClusterRoleBinding changes. [`watch_revocations`] watches all six kinds and
//! calls [`Authorizer::invalidate`] on every change, so that the next request is reviewed
//! again within the watch's latency (well under a second) rather than when the 30 s TTL ends.
//!
//! Deliberately coarse: any change of any of these objects flushes the whole cache. They
//! change rarely compared with requests, and working out which decisions a binding change
//! affects would mean re-implementing RBAC here. Each watch also flushes when its list
//! completes (first start or a re-list after an error): a change between a decision and
//! the list would otherwise never be seen as an event.
//!
//! A kind the API server does not serve (404: a real cluster has no `AccessToken`s, whose
//! tokens are revoked by deleting their Secret or Pod) is not watched; the TTL bounds those.
//! Other watch errors flush the cache too (an event may have been missed) and the watch
//! resumes with kube-runtime's default backoff.
//!
//! This module never decides anything: it only forgets.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt, watcher as watch_stream};
use tokio::task::JoinSet;

use crate::authz::Authorizer;

/// The API group, version and plural of standalone mode's AccessTokens.
pub const ACCESS_TOKEN_GROUP: &str = "auth.kruntimes.io";
pub const ACCESS_TOKEN_VERSION: &str = "v1alpha1";
pub const ACCESS_TOKEN_PLURAL: &str = "accesstokens";

/// Watches every kind a decision rests on and invalidates `authorizer` on each change,
/// until the returned future is dropped (abort its task to stop). Needs `list` and `watch`
/// on serviceaccounts, roles, clusterroles, rolebindings, clusterrolebindings and (in
/// standalone mode) accesstokens.auth.kruntimes.io.
pub async fn watch_revocations(client: kube::Client, authorizer: Arc<Authorizer>) {
    let access_tokens = ApiResource {
        group: ACCESS_TOKEN_GROUP.to_string(),
        version: ACCESS_TOKEN_VERSION.to_string(),
        api_version: format!("{ACCESS_TOKEN_GROUP}/{ACCESS_TOKEN_VERSION}"),
        kind: "AccessToken".to_string(),
        plural: ACCESS_TOKEN_PLURAL.to_string(),
    };
    let mut watches = JoinSet::new();
    watches.spawn(watch_kind(
        "AccessToken",
        Api::<DynamicObject>::all_with(client.clone(), &access_tokens),
        authorizer.clone(),
    ));
    watches.spawn(watch_kind(
        "ServiceAccount",
        Api::<ServiceAccount>::all(client.clone()),
        authorizer.clone(),
    ));
    watches.spawn(watch_kind(
        "Role",
        Api::<Role>::all(client.clone()),
        authorizer.clone(),
    ));
    watches.spawn(watch_kind(
        "ClusterRole",
        Api::<ClusterRole>::all(client.clone()),
        authorizer.clone(),
    ));
    watches.spawn(watch_kind(
        "RoleBinding",
        Api::<RoleBinding>::all(client.clone()),
        authorizer.clone(),
    ));
    watches.spawn(watch_kind(
        "ClusterRoleBinding",
        Api::<ClusterRoleBinding>::all(client),
        authorizer,
    ));
    // Dropping the set (when this future is dropped or aborted) aborts the watches.
    while watches.join_next().await.is_some() {}
}

/// One kind's watch: invalidates on every change after its list, at the end of every list,
/// and on every error. Returns only when the API server does not serve the kind.
async fn watch_kind<K>(kind: &'static str, api: Api<K>, authorizer: Arc<Authorizer>)
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
{
    let mut stream = watch_stream(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut listed_once = false;
    while let Some(event) = stream.next().await {
        match event {
            Ok(Event::Apply(_) | Event::Delete(_)) => authorizer.invalidate(kind),
            // A (re-)list: what it shows may differ from what the cached decisions saw.
            Ok(Event::InitDone) => {
                if !listed_once {
                    tracing::debug!(kind, "revocation watch listed");
                }
                listed_once = true;
                authorizer.invalidate(kind);
            }
            Ok(Event::Init | Event::InitApply(_)) => {}
            Err(watcher::Error::InitialListFailed(kube::Error::Api(status)))
                if status.code == 404 =>
            {
                tracing::info!(
                    kind,
                    "the API server does not serve this kind; its revocations wait for the cache TTL"
                );
                return;
            }
            Err(error) => {
                tracing::warn!(kind, error = %error, "revocation watch failed; retrying");
                authorizer.invalidate(kind);
            }
        }
    }
}
