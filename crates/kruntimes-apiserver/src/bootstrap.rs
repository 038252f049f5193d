//! Objects every server starts with: the system namespaces, the default RBAC policy (as on a
//! real cluster: `cluster-admin`, `system:discovery`, `system:basic-user`), and one
//! ServiceAccount with a least-privilege ClusterRole for each kruntimes component.
//!
//! The component policy is also written to `deploy/rbac/` for the Helm chart; a test keeps
//! the two in step.

use serde_json::{Value, json};

use crate::rbac::rule;

/// The namespace kruntimes' own components live in.
pub const SYSTEM_NAMESPACE: &str = "kruntimes-system";

/// Namespaces that always exist.
pub const NAMESPACES: [&str; 4] = ["default", "kube-system", "kube-public", SYSTEM_NAMESPACE];

/// The components that get an identity of their own.
pub const COMPONENTS: [&str; 3] = ["controller-manager", "runtimed", "gateway"];

const RBAC: &str = "rbac.authorization.k8s.io";

/// The ClusterRole of runtimed in one worker namespace: the Kubernetes provisioner binds it
/// there (a RoleBinding, so it grants nothing elsewhere) to the namespace's worker
/// ServiceAccount.
pub const WORKER_ROLE: &str = "kruntimes:runtimed-worker";
/// The ClusterRole of the per-Run authorizer's cluster-wide needs (the reviews, and reading
/// what its decisions rest on), bound to each worker namespace's ServiceAccount.
pub const AUTHORIZER_ROLE: &str = "kruntimes:authorizer";
/// The Secrets of the workers' mutual TLS that the controller-manager may read and write
/// (and no other): the install's CA (`--worker-ca-secret`), each namespace's workers'
/// material, the gateway's.
pub const WORKER_CA_SECRET: &str = "kruntimes-worker-ca";
pub use kruntimes_api::runtime::WORKER_TLS_SECRET;
pub const GATEWAY_WORKER_TLS_SECRET: &str = "kruntimes-gateway-worker-tls";

fn cluster_role(name: &str, rules: Vec<Value>) -> Value {
    json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"}},
        "rules": rules,
    })
}

fn cluster_role_binding(name: &str, role: &str, subjects: Vec<Value>) -> Value {
    json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name, "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"}},
        "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": role},
        "subjects": subjects,
    })
}

fn group(name: &str) -> Value {
    json!({"kind": "Group", "apiGroup": RBAC, "name": name})
}

/// The ClusterRole of one component: exactly what it uses.
pub fn component_rules(component: &str) -> Vec<Value> {
    const K: &str = "kruntimes.io";
    match component {
        // Schedules Runs, runs their lifecycle and TTL cleanup, provisions workers (Pods),
        // keeps Runtime status, elects a leader through a Lease, records Events.
        "controller-manager" => vec![
            rule(
                &["get", "list", "watch", "update", "patch", "delete"],
                &[K],
                &["runs"],
            ),
            rule(&["get", "update", "patch"], &[K], &["runs/status"]),
            // The scheduler places a resumed session near its Snapshot's local copy; a
            // session's superseded suspend Snapshots are deleted (only the latest is kept);
            // a Suspended session with a Workspace that ends is committed (create).
            rule(
                &["get", "list", "watch", "create", "delete"],
                &[K],
                &["snapshots"],
            ),
            // A checkpoint no worker will take is failed (its Run is gone or ended).
            rule(&["get", "update", "patch"], &[K], &["snapshots/status"]),
            // A Workspace unused past its ttlSecondsAfterUnused is deleted; a Suspended
            // session that ends commits its suspend Snapshot (a Commit Snapshot, the head).
            rule(&["get", "list", "watch", "delete"], &[K], &["workspaces"]),
            rule(&["get", "update", "patch"], &[K], &["workspaces/status"]),
            // update and patch: the worker-cleanup finalizer on Runtimes.
            rule(
                &["get", "list", "watch", "update", "patch"],
                &[K],
                &["runtimes"],
            ),
            rule(&["get", "update", "patch"], &[K], &["runtimes/status"]),
            rule(
                &[
                    "get", "list", "watch", "create", "update", "patch", "delete",
                ],
                &[""],
                &["pods"],
            ),
            rule(&["get", "update", "patch"], &[""], &["pods/status"]),
            // The Kubernetes provisioner: a Deployment and a Service per Runtime, and the
            // gateway's CA as a ConfigMap in each namespace with a Runtime.
            rule(
                &[
                    "get", "list", "watch", "create", "update", "patch", "delete",
                ],
                &["apps"],
                &["deployments"],
            ),
            rule(
                &[
                    "get", "list", "watch", "create", "update", "patch", "delete",
                ],
                &[""],
                &["services", "configmaps"],
            ),
            rule(&["get", "list", "watch"], &[""], &["namespaces"]),
            // The workers' mutual TLS: the CA's Secret (made when missing), each
            // namespace's workers' Secret and the gateway's. `create` cannot be limited to
            // names; reading and applying are, so no Secret of another name is readable.
            rule(&["create"], &[""], &["secrets"]),
            json!({
                "verbs": ["get", "patch"],
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": [WORKER_CA_SECRET, WORKER_TLS_SECRET, GATEWAY_WORKER_TLS_SECRET],
            }),
            // The Kubernetes provisioner gives each namespace with a Runtime the worker
            // ServiceAccount, bound to WORKER_ROLE there and to AUTHORIZER_ROLE. `bind` on
            // those two roles: the controller-manager need not hold what they grant (the
            // escalation check still lets it bind any role it fully holds).
            rule(&["get", "create", "patch"], &[""], &["serviceaccounts"]),
            rule(
                &["get", "create", "patch"],
                &[RBAC],
                &["rolebindings", "clusterrolebindings"],
            ),
            json!({
                "verbs": ["bind"],
                "apiGroups": [RBAC],
                "resources": ["clusterroles"],
                "resourceNames": [WORKER_ROLE, AUTHORIZER_ROLE],
            }),
            rule(
                &["get", "create", "update", "patch"],
                &["coordination.k8s.io"],
                &["leases"],
            ),
            rule(&["create", "patch"], &["", "events.k8s.io"], &["events"]),
        ],
        // Claims and executes the Runs assigned to its worker, writes their status and
        // finalizers, reads its own Pod; authorizes every call it serves or forwards with
        // the caller's token, and watches what those decisions rest on.
        "runtimed" => {
            let mut rules = worker_rules();
            rules.extend(authorizer_rules());
            rules
        }
        // Authenticates callers and authorizes them per Run, then routes to workers.
        "gateway" => {
            let mut rules = vec![
                rule(&["get", "list", "watch"], &[K], &["runs", "runtimes"]),
                rule(&["get", "list", "watch"], &[""], &["pods"]),
            ];
            rules.extend(authorizer_rules());
            rules
        }
        _ => Vec::new(),
    }
}

/// What runtimed uses in its own namespace ([`WORKER_ROLE`]).
fn worker_rules() -> Vec<Value> {
    const K: &str = "kruntimes.io";
    vec![
        rule(
            &["get", "list", "watch", "patch", "update"],
            &[K],
            &["runs"],
        ),
        rule(&["get", "update", "patch"], &[K], &["runs/status"]),
        // Captures a suspended session's files into a Snapshot and records it; delete: a
        // new capture replaces a final Snapshot of the same incarnation, and a deleted
        // Run's Snapshots go with it (no owner GC here).
        rule(
            &[
                "get", "list", "watch", "create", "update", "patch", "delete",
            ],
            &[K],
            &["snapshots"],
        ),
        rule(&["get", "update", "patch"], &[K], &["snapshots/status"]),
        // A session with spec.workspace creates its Workspace on first use, restores its
        // head and commits a new one when it ends.
        rule(&["get", "create"], &[K], &["workspaces"]),
        rule(&["get", "update", "patch"], &[K], &["workspaces/status"]),
        rule(&["get", "list", "watch"], &[K], &["runtimes"]),
        rule(&["get", "list", "watch"], &[""], &["pods"]),
        rule(&["create", "patch"], &["", "events.k8s.io"], &["events"]),
    ]
}

/// What the per-Run authorizer of `kruntimes-wire` needs: the two reviews, and reading (never
/// writing) the objects whose changes revoke its cached decisions. AccessTokens hold only
/// digests; reading them reveals no token.
fn authorizer_rules() -> Vec<Value> {
    const READ: &[&str] = &["list", "watch"];
    vec![
        rule(&["create"], &["authentication.k8s.io"], &["tokenreviews"]),
        rule(
            &["create"],
            &["authorization.k8s.io"],
            &["subjectaccessreviews"],
        ),
        rule(READ, &[""], &["serviceaccounts"]),
        rule(
            READ,
            &[RBAC],
            &[
                "roles",
                "clusterroles",
                "rolebindings",
                "clusterrolebindings",
            ],
        ),
        rule(READ, &["auth.kruntimes.io"], &["accesstokens"]),
    ]
}

/// The ServiceAccount name of a component.
pub fn component_account(component: &str) -> String {
    format!("kruntimes-{component}")
}

/// The component policy: for each component a ServiceAccount, a ClusterRole and a
/// ClusterRoleBinding, and the two ClusterRoles of workers on a cluster ([`WORKER_ROLE`],
/// [`AUTHORIZER_ROLE`]). These are what `deploy/rbac/` holds.
pub fn component_policy() -> Vec<Value> {
    let mut out = Vec::new();
    for component in COMPONENTS {
        let account = component_account(component);
        let role = format!("kruntimes:{component}");
        out.push(json!({
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": account, "namespace": SYSTEM_NAMESPACE},
        }));
        out.push(cluster_role(&role, component_rules(component)));
        out.push(cluster_role_binding(
            &role,
            &role,
            vec![json!({"kind": "ServiceAccount", "name": account, "namespace": SYSTEM_NAMESPACE})],
        ));
    }
    out.push(cluster_role(WORKER_ROLE, worker_rules()));
    out.push(cluster_role(AUTHORIZER_ROLE, authorizer_rules()));
    out
}

/// The default policy every Kubernetes cluster has, in the part kruntimes relies on.
pub fn default_policy() -> Vec<Value> {
    vec![
        cluster_role(
            "cluster-admin",
            vec![
                rule(&["*"], &["*"], &["*"]),
                json!({"verbs": ["*"], "nonResourceURLs": ["*"]}),
            ],
        ),
        cluster_role_binding(
            "cluster-admin",
            "cluster-admin",
            vec![group("system:masters")],
        ),
        cluster_role(
            "system:discovery",
            vec![json!({
                "verbs": ["get"],
                "nonResourceURLs": ["/api", "/api/*", "/apis", "/apis/*", "/healthz", "/livez", "/readyz", "/openapi", "/openapi/*", "/version", "/version/"],
            })],
        ),
        cluster_role_binding(
            "system:discovery",
            "system:discovery",
            vec![group("system:authenticated")],
        ),
        // As on Kubernetes: reading `/metrics` takes this role (or cluster-admin).
        cluster_role(
            "system:monitoring",
            vec![json!({
                "verbs": ["get"],
                "nonResourceURLs": ["/metrics", "/livez", "/readyz", "/healthz"],
            })],
        ),
        cluster_role_binding(
            "system:monitoring",
            "system:monitoring",
            vec![group("system:monitoring")],
        ),
        cluster_role(
            "system:basic-user",
            vec![rule(
                &["create"],
                &["authorization.k8s.io"],
                &["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
            )],
        ),
        cluster_role_binding(
            "system:basic-user",
            "system:basic-user",
            vec![group("system:authenticated")],
        ),
        cluster_role(
            "view",
            vec![
                rule(
                    &["get", "list", "watch"],
                    &["kruntimes.io"],
                    &[
                        "runs",
                        "runs/status",
                        "runtimes",
                        "runtimes/status",
                        "snapshots",
                        "snapshots/status",
                        "workspaces",
                        "workspaces/status",
                    ],
                ),
                rule(
                    &["get", "list", "watch"],
                    &[""],
                    &["pods", "events", "namespaces", "serviceaccounts"],
                ),
                rule(&["get", "list", "watch"], &["events.k8s.io"], &["events"]),
            ],
        ),
        cluster_role(
            "edit",
            vec![
                rule(
                    &[
                        "get",
                        "list",
                        "watch",
                        "create",
                        "update",
                        "patch",
                        "delete",
                        "deletecollection",
                    ],
                    &["kruntimes.io"],
                    &["runs", "runtimes", "workspaces"],
                ),
                rule(
                    &["get", "list", "watch"],
                    &["kruntimes.io"],
                    &[
                        "runs/status",
                        "runtimes/status",
                        "snapshots/status",
                        "workspaces/status",
                    ],
                ),
                // Users create checkpoints (Snapshots), read and delete them; their status
                // is the workers' to write.
                rule(
                    &[
                        "get",
                        "list",
                        "watch",
                        "create",
                        "delete",
                        "deletecollection",
                    ],
                    &["kruntimes.io"],
                    &["snapshots"],
                ),
                rule(
                    &["get", "list", "watch"],
                    &[""],
                    &["pods", "events", "namespaces"],
                ),
                rule(&["get", "list", "watch"], &["events.k8s.io"], &["events"]),
            ],
        ),
    ]
}

/// The component policy as one multi-document YAML file.
pub fn component_policy_yaml() -> Result<String, serde_yaml::Error> {
    let mut out = String::from(
        "# Generated from crates/kruntimes-apiserver/src/bootstrap.rs. Do not edit.\n# Least-privilege identities of the kruntimes components.\n",
    );
    for object in component_policy() {
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(&object)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    #[test]
    fn deploy_rbac_matches_the_bootstrap_policy() {
        let path =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/rbac/components.yaml");
        let yaml = component_policy_yaml().expect("yaml");
        if std::env::var_os("KRUNTIMES_UPDATE_CRDS").is_some() {
            std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
            std::fs::write(&path, &yaml).expect("write");
            return;
        }
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            on_disk == yaml,
            "{} drifted; run KRUNTIMES_UPDATE_CRDS=1 cargo test -p kruntimes-apiserver bootstrap",
            path.display()
        );
    }

    #[test]
    fn no_component_may_touch_rbac_or_tokens() {
        for component in COMPONENTS {
            for rule in component_rules(component) {
                let groups = rule["apiGroups"].to_string();
                let resources = rule["resources"].to_string();
                assert!(
                    !groups.contains('*') && !resources.contains('*'),
                    "{component}: {rule}"
                );
                // RBAC objects, ServiceAccounts and AccessTokens: read only (the
                // authorizer's revocation watches), never written, never `get` of tokens.
                let sensitive = groups.contains("rbac")
                    || groups.contains("auth.kruntimes.io")
                    || resources.contains("serviceaccounts")
                    || resources.contains("token\"")
                    || resources.contains("tokens\"");
                // The one exception: the controller-manager gives each worker namespace its
                // identity. It makes ServiceAccounts and bindings, and holds `bind` only on
                // the two worker ClusterRoles; it never writes a Role or a ClusterRole (no
                // `escalate`), never mints a token and never touches AccessTokens.
                let verbs = &rule["verbs"];
                let worker_identity = component == "controller-manager"
                    && ((verbs == &json!(["get", "create", "patch"])
                        && (rule["resources"] == json!(["serviceaccounts"])
                            || rule["resources"]
                                == json!(["rolebindings", "clusterrolebindings"])))
                        || (verbs == &json!(["bind"])
                            && rule["resources"] == json!(["clusterroles"])
                            && rule["resourceNames"] == json!([WORKER_ROLE, AUTHORIZER_ROLE])));
                if sensitive && !worker_identity {
                    assert_eq!(
                        rule["verbs"],
                        json!(["list", "watch"]),
                        "{component}: {rule}"
                    );
                }
            }
        }
    }
}
