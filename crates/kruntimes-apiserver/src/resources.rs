//! The kinds the embedded API server serves, and what it knows of each: names for
//! discovery, scope, the status subresource, table columns and extra field selectors.

use std::sync::Arc;

use serde_json::Value;

/// One served resource.
#[derive(Debug)]
pub struct ResourceDef {
    /// Empty for the core group.
    pub group: &'static str,
    pub version: &'static str,
    pub kind: &'static str,
    pub plural: &'static str,
    pub singular: &'static str,
    pub short_names: &'static [&'static str],
    pub categories: &'static [&'static str],
    pub namespaced: bool,
    /// Spec and status are written separately through `/status`.
    pub status_subresource: bool,
    /// Field selectors beyond `metadata.name` and `metadata.namespace`.
    pub field_selectors: &'static [&'static str],
    pub table: TableKind,
    /// The store key prefix: `plural.group`, or `plural` for the core group.
    pub store_key: &'static str,
    /// Create-only kinds that are answered, never stored (the review APIs).
    pub virtual_kind: bool,
    /// Serves the `token` subresource (TokenRequest).
    pub token_subresource: bool,
}

/// Which columns `kubectl get` shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableKind {
    Run,
    Runtime,
    Snapshot,
    Workspace,
    Namespace,
    Pod,
    AccessToken,
    Event,
    Plain,
}

impl ResourceDef {
    /// Serves the `scale` subresource (`autoscaling/v1` Scale over `spec.replicas`):
    /// Runtimes, so `kubectl scale runtime NAME --replicas N` works.
    pub fn scale_subresource(&self) -> bool {
        self.group == kruntimes_api::GROUP && self.kind == "Runtime"
    }

    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `runs.kruntimes.io`, or `pods` for the core group, as Status messages write it.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }

    pub fn store_key_arc(&self) -> Arc<str> {
        Arc::from(self.store_key)
    }

    /// The verbs discovery advertises.
    pub fn verbs(&self) -> &'static [&'static str] {
        if self.virtual_kind {
            return &["create"];
        }
        &[
            "create",
            "delete",
            "deletecollection",
            "get",
            "list",
            "patch",
            "update",
            "watch",
        ]
    }

    /// The value of a selectable field of `object`, for field selectors.
    pub fn field_value<'a>(&self, object: &'a Value, field: &str) -> Option<&'a str> {
        if self.store_key == crate::events::STORE_KEY && !field.starts_with("metadata.") {
            let mut cur = object;
            for part in crate::events::field_path(self, field)? {
                cur = cur.get(part)?;
            }
            return cur.as_str();
        }
        let path: &[&str] = match field {
            "metadata.name" => &["metadata", "name"],
            "metadata.namespace" => &["metadata", "namespace"],
            "status.phase" => &["status", "phase"],
            "spec.runtime" => &["spec", "runtime"],
            "spec.source.run.name" => &["spec", "source", "run", "name"],
            "status.assignedPod" => &["status", "assignedPod"],
            "spec.nodeName" => &["spec", "nodeName"],
            _ => return None,
        };
        let mut cur = object;
        for part in path {
            cur = cur.get(part)?;
        }
        cur.as_str()
    }

    pub fn supports_field(&self, field: &str) -> bool {
        matches!(field, "metadata.name" | "metadata.namespace")
            || self.field_selectors.contains(&field)
    }
}

macro_rules! def {
    ($group:expr, $version:expr, $kind:expr, $plural:expr, $singular:expr, $store:expr,
     namespaced = $ns:expr, status = $st:expr, short = $short:expr, categories = $cat:expr,
     fields = $fields:expr, table = $table:expr) => {
        ResourceDef {
            group: $group,
            version: $version,
            kind: $kind,
            plural: $plural,
            singular: $singular,
            short_names: $short,
            categories: $cat,
            namespaced: $ns,
            status_subresource: $st,
            field_selectors: $fields,
            table: $table,
            store_key: $store,
            virtual_kind: false,
            token_subresource: false,
        }
    };
}

macro_rules! review {
    ($group:expr, $kind:expr, $plural:expr, $singular:expr, namespaced = $ns:expr) => {
        ResourceDef {
            group: $group,
            version: "v1",
            kind: $kind,
            plural: $plural,
            singular: $singular,
            short_names: &[],
            categories: &[],
            namespaced: $ns,
            status_subresource: false,
            field_selectors: &[],
            table: TableKind::Plain,
            store_key: $plural,
            virtual_kind: true,
            token_subresource: false,
        }
    };
}

/// Every served resource.
pub static RESOURCES: &[ResourceDef] = &[
    def!(
        "kruntimes.io",
        "v1alpha1",
        "Run",
        "runs",
        "run",
        "runs.kruntimes.io",
        namespaced = true,
        status = true,
        short = &["rn"],
        categories = &["all", "kruntimes"],
        fields = &["status.phase", "spec.runtime", "status.assignedPod"],
        table = TableKind::Run
    ),
    def!(
        "kruntimes.io",
        "v1alpha1",
        "Runtime",
        "runtimes",
        "runtime",
        "runtimes.kruntimes.io",
        namespaced = true,
        status = true,
        short = &["rt"],
        categories = &["all", "kruntimes"],
        fields = &[],
        table = TableKind::Runtime
    ),
    def!(
        "kruntimes.io",
        "v1alpha1",
        "Snapshot",
        "snapshots",
        "snapshot",
        "snapshots.kruntimes.io",
        namespaced = true,
        status = true,
        short = &["snap"],
        categories = &["kruntimes"],
        fields = &["status.phase", "spec.source.run.name"],
        table = TableKind::Snapshot
    ),
    def!(
        "kruntimes.io",
        "v1alpha1",
        "Workspace",
        "workspaces",
        "workspace",
        "workspaces.kruntimes.io",
        namespaced = true,
        status = true,
        short = &["ws"],
        categories = &["kruntimes"],
        fields = &[],
        table = TableKind::Workspace
    ),
    def!(
        "",
        "v1",
        "Pod",
        "pods",
        "pod",
        "pods",
        namespaced = true,
        status = true,
        short = &["po"],
        categories = &["all"],
        fields = &["status.phase", "spec.nodeName"],
        table = TableKind::Pod
    ),
    def!(
        "",
        "v1",
        "Namespace",
        "namespaces",
        "namespace",
        "namespaces",
        namespaced = false,
        status = true,
        short = &["ns"],
        categories = &[],
        fields = &["status.phase"],
        table = TableKind::Namespace
    ),
    def!(
        "",
        "v1",
        "Event",
        "events",
        "event",
        "events",
        namespaced = true,
        status = false,
        short = &["ev"],
        categories = &[],
        fields = crate::events::CORE_FIELDS,
        table = TableKind::Event
    ),
    def!(
        "events.k8s.io",
        "v1",
        "Event",
        "events",
        "event",
        // One store for both Event APIs: see crate::events.
        crate::events::STORE_KEY,
        namespaced = true,
        status = false,
        short = &["ev"],
        categories = &[],
        fields = crate::events::V1_FIELDS,
        table = TableKind::Event
    ),
    def!(
        "coordination.k8s.io",
        "v1",
        "Lease",
        "leases",
        "lease",
        "leases.coordination.k8s.io",
        namespaced = true,
        status = false,
        short = &[],
        categories = &[],
        fields = &[],
        table = TableKind::Plain
    ),
    ResourceDef {
        token_subresource: true,
        ..def!(
            "",
            "v1",
            "ServiceAccount",
            "serviceaccounts",
            "serviceaccount",
            "serviceaccounts",
            namespaced = true,
            status = false,
            short = &["sa"],
            categories = &[],
            fields = &[],
            table = TableKind::Plain
        )
    },
    def!(
        "rbac.authorization.k8s.io",
        "v1",
        "Role",
        "roles",
        "role",
        "roles.rbac.authorization.k8s.io",
        namespaced = true,
        status = false,
        short = &[],
        categories = &[],
        fields = &[],
        table = TableKind::Plain
    ),
    def!(
        "rbac.authorization.k8s.io",
        "v1",
        "RoleBinding",
        "rolebindings",
        "rolebinding",
        "rolebindings.rbac.authorization.k8s.io",
        namespaced = true,
        status = false,
        short = &[],
        categories = &[],
        fields = &[],
        table = TableKind::Plain
    ),
    def!(
        "rbac.authorization.k8s.io",
        "v1",
        "ClusterRole",
        "clusterroles",
        "clusterrole",
        "clusterroles.rbac.authorization.k8s.io",
        namespaced = false,
        status = false,
        short = &[],
        categories = &[],
        fields = &[],
        table = TableKind::Plain
    ),
    def!(
        "rbac.authorization.k8s.io",
        "v1",
        "ClusterRoleBinding",
        "clusterrolebindings",
        "clusterrolebinding",
        "clusterrolebindings.rbac.authorization.k8s.io",
        namespaced = false,
        status = false,
        short = &[],
        categories = &[],
        fields = &[],
        table = TableKind::Plain
    ),
    // Kubernetes kinds the install (`deploy/`) and the Kubernetes provisioner write,
    // stored as objects and checked against their Kubernetes types (crate::builtin):
    // nothing here acts on them. A CustomResourceDefinition is only stored; the kruntimes
    // kinds stay served natively.
    def!(
        "apps",
        "v1",
        "Deployment",
        "deployments",
        "deployment",
        "deployments.apps",
        namespaced = true,
        status = true,
        short = &["deploy"],
        categories = &["all"],
        fields = &[],
        table = TableKind::Plain
    ),
    def!(
        "apps",
        "v1",
        "ReplicaSet",
        "replicasets",
        "replicaset",
        "replicasets.apps",
        namespaced = true,
        status = true,
        short = &["rs"],
        categories = &["all"],
        fields = &[],
        table = TableKind::Plain
    ),
    def!(
        "",
        "v1",
        "Service",
        "services",
        "service",
        "services",
        namespaced = true,
        status = true,
        short = &["svc"],
        categories = &["all"],
        fields = &[],
        table = TableKind::Plain
    ),
    def!(
        "",
        "v1",
        "Secret",
        "secrets",
        "secret",
        "secrets",
        namespaced = true,
        status = false,
        short = &[],
        categories = &[],
        fields = &[],
        table = TableKind::Plain
    ),
    def!(
        "",
        "v1",
        "ConfigMap",
        "configmaps",
        "configmap",
        "configmaps",
        namespaced = true,
        status = false,
        short = &["cm"],
        categories = &[],
        fields = &[],
        table = TableKind::Plain
    ),
    def!(
        "policy",
        "v1",
        "PodDisruptionBudget",
        "poddisruptionbudgets",
        "poddisruptionbudget",
        "poddisruptionbudgets.policy",
        namespaced = true,
        status = true,
        short = &["pdb"],
        categories = &[],
        fields = &[],
        table = TableKind::Plain
    ),
    def!(
        "networking.k8s.io",
        "v1",
        "NetworkPolicy",
        "networkpolicies",
        "networkpolicy",
        "networkpolicies.networking.k8s.io",
        namespaced = true,
        status = false,
        short = &["netpol"],
        categories = &[],
        fields = &[],
        table = TableKind::Plain
    ),
    def!(
        "apiextensions.k8s.io",
        "v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
        "customresourcedefinition",
        "customresourcedefinitions.apiextensions.k8s.io",
        namespaced = false,
        status = true,
        short = &["crd", "crds"],
        categories = &[],
        fields = &[],
        table = TableKind::Plain
    ),
    def!(
        "auth.kruntimes.io",
        "v1alpha1",
        "AccessToken",
        "accesstokens",
        "accesstoken",
        "accesstokens.auth.kruntimes.io",
        namespaced = false,
        status = false,
        short = &[],
        categories = &[],
        fields = &[],
        table = TableKind::AccessToken
    ),
    review!(
        "authentication.k8s.io",
        "TokenReview",
        "tokenreviews",
        "tokenreview",
        namespaced = false
    ),
    review!(
        "authorization.k8s.io",
        "SubjectAccessReview",
        "subjectaccessreviews",
        "subjectaccessreview",
        namespaced = false
    ),
    review!(
        "authorization.k8s.io",
        "SelfSubjectAccessReview",
        "selfsubjectaccessreviews",
        "selfsubjectaccessreview",
        namespaced = false
    ),
    review!(
        "authorization.k8s.io",
        "LocalSubjectAccessReview",
        "localsubjectaccessreviews",
        "localsubjectaccessreview",
        namespaced = true
    ),
    review!(
        "authorization.k8s.io",
        "SelfSubjectRulesReview",
        "selfsubjectrulesreviews",
        "selfsubjectrulesreview",
        namespaced = false
    ),
];

/// The resource served at `group/version/plural`.
pub fn find(group: &str, version: &str, plural: &str) -> Option<&'static ResourceDef> {
    RESOURCES
        .iter()
        .find(|r| r.group == group && r.version == version && r.plural == plural)
}

/// Every group (with its one version), in discovery order; the core group is not included.
pub fn groups() -> Vec<(&'static str, &'static str)> {
    let mut out: Vec<(&str, &str)> = Vec::new();
    for r in RESOURCES {
        if !r.group.is_empty() && !out.iter().any(|(g, _)| *g == r.group) {
            out.push((r.group, r.version));
        }
    }
    out
}

/// Resources of one group/version.
pub fn in_group(group: &str, version: &str) -> impl Iterator<Item = &'static ResourceDef> {
    let group = group.to_string();
    let version = version.to_string();
    RESOURCES
        .iter()
        .filter(move |r| r.group == group && r.version == version)
}
