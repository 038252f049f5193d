//! Discovery documents: `/version`, `/api`, `/apis`, `/apis/{g}`, `/apis/{g}/{v}`, in the
//! aggregated (apidiscovery.k8s.io/v2) and the legacy forms.

use serde_json::{Value, json};

use crate::resources::{self, RESOURCES, ResourceDef};

/// The media type of aggregated discovery responses.
pub const AGGREGATED: &str = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList";

/// kubectl's dispatcher picks its built-in 1.32 for minor 32 (see the API contract notes).
pub fn version() -> Value {
    json!({
        "major": "1",
        "minor": "32",
        "gitVersion": "v1.32.0-kruntimes",
        "gitCommit": "",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "rust",
        "compiler": "rustc",
        "platform": "linux/amd64",
        "emulationMajor": "1",
        "emulationMinor": "32",
    })
}

pub fn wants_aggregated(accept: &str) -> bool {
    accept.contains("as=APIGroupDiscoveryList")
}

fn response_kind(def: &ResourceDef) -> Value {
    json!({"group": def.group, "version": def.version, "kind": def.kind})
}

fn aggregated_resource(def: &ResourceDef) -> Value {
    let mut subresources = Vec::new();
    if def.status_subresource {
        subresources.push(json!({
            "subresource": "status",
            "verbs": ["get", "patch", "update"],
            "responseKind": response_kind(def),
        }));
    }
    if def.scale_subresource() {
        subresources.push(json!({
            "subresource": "scale",
            "verbs": ["get", "patch", "update"],
            "responseKind": {"group": "autoscaling", "version": "v1", "kind": "Scale"},
        }));
    }
    if def.token_subresource {
        subresources.push(json!({
            "subresource": "token",
            "verbs": ["create"],
            "responseKind": {"group": "authentication.k8s.io", "version": "v1", "kind": "TokenRequest"},
        }));
    }
    json!({
        "resource": def.plural,
        "singularResource": def.singular,
        "scope": if def.namespaced { "Namespaced" } else { "Cluster" },
        "responseKind": response_kind(def),
        "verbs": def.verbs(),
        "shortNames": def.short_names,
        "categories": def.categories,
        "subresources": subresources,
    })
}

fn aggregated_group(name: &str, version: &str) -> Value {
    let resources: Vec<Value> = resources::in_group(name, version)
        .map(aggregated_resource)
        .collect();
    json!({
        "metadata": {"name": name, "creationTimestamp": null},
        "versions": [{"version": version, "resources": resources, "freshness": "Current"}],
    })
}

/// `GET /api`.
pub fn core_versions(aggregated: bool) -> Value {
    if aggregated {
        json!({
            "kind": "APIGroupDiscoveryList",
            "apiVersion": "apidiscovery.k8s.io/v2",
            "metadata": {},
            "items": [aggregated_group("", "v1")],
        })
    } else {
        json!({
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": ""}],
        })
    }
}

fn legacy_group(name: &str, version: &str) -> Value {
    let gv = json!({"groupVersion": format!("{name}/{version}"), "version": version});
    json!({"name": name, "versions": [gv.clone()], "preferredVersion": gv})
}

/// `GET /apis`.
pub fn groups(aggregated: bool) -> Value {
    let groups = resources::groups();
    if aggregated {
        json!({
            "kind": "APIGroupDiscoveryList",
            "apiVersion": "apidiscovery.k8s.io/v2",
            "metadata": {},
            "items": groups.iter().map(|(g, v)| aggregated_group(g, v)).collect::<Vec<_>>(),
        })
    } else {
        json!({
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": groups.iter().map(|(g, v)| legacy_group(g, v)).collect::<Vec<_>>(),
        })
    }
}

/// `GET /apis/{group}`.
pub fn group(name: &str) -> Option<Value> {
    let (g, v) = resources::groups().into_iter().find(|(g, _)| *g == name)?;
    let mut doc = legacy_group(g, v);
    doc["kind"] = json!("APIGroup");
    doc["apiVersion"] = json!("v1");
    Some(doc)
}

/// `GET /api/v1` or `GET /apis/{group}/{version}`.
pub fn resource_list(group: &str, version: &str) -> Value {
    let mut list = Vec::new();
    for def in RESOURCES
        .iter()
        .filter(|r| r.group == group && r.version == version)
    {
        list.push(json!({
            "name": def.plural,
            "singularName": def.singular,
            "namespaced": def.namespaced,
            "kind": def.kind,
            "verbs": def.verbs(),
            "shortNames": def.short_names,
            "categories": def.categories,
        }));
        if def.status_subresource {
            list.push(json!({
                "name": format!("{}/status", def.plural),
                "singularName": "",
                "namespaced": def.namespaced,
                "kind": def.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
        if def.scale_subresource() {
            list.push(json!({
                "name": format!("{}/scale", def.plural),
                "singularName": "",
                "namespaced": def.namespaced,
                "group": "autoscaling",
                "version": "v1",
                "kind": "Scale",
                "verbs": ["get", "patch", "update"],
            }));
        }
        if def.token_subresource {
            list.push(json!({
                "name": format!("{}/token", def.plural),
                "singularName": "",
                "namespaced": def.namespaced,
                "group": "authentication.k8s.io",
                "version": "v1",
                "kind": "TokenRequest",
                "verbs": ["create"],
            }));
        }
    }
    let group_version = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": list,
    })
}
