//! OpenAPI v3 documents, enough for `kubectl apply` (server-side field validation is
//! advertised through the PATCH operation's `fieldValidation` parameter) and for
//! `kubectl explain` (schemas carry `x-kubernetes-group-version-kind`).
//!
//! The kruntimes kinds use the same schemas as the generated CRDs; built-in kinds get an
//! open schema.

use std::sync::OnceLock;

use kube::CustomResourceExt;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::resources::{self, ResourceDef};

/// The schema of a kind's object as the CRD declares it, for kruntimes kinds. Computed
/// once per kind.
pub fn crd_schema(def: &ResourceDef) -> Option<&'static Value> {
    static RUN: OnceLock<Option<Value>> = OnceLock::new();
    static RUNTIME: OnceLock<Option<Value>> = OnceLock::new();
    static SNAPSHOT: OnceLock<Option<Value>> = OnceLock::new();
    static WORKSPACE: OnceLock<Option<Value>> = OnceLock::new();
    let extract = |crd| {
        serde_json::to_value(crd)
            .ok()?
            .pointer("/spec/versions/0/schema/openAPIV3Schema")
            .cloned()
    };
    if def.group != kruntimes_api::GROUP {
        return None;
    }
    match def.kind {
        "Run" => RUN
            .get_or_init(|| extract(kruntimes_api::crds::run_crd()))
            .as_ref(),
        "Runtime" => RUNTIME
            .get_or_init(|| extract(kruntimes_api::Runtime::crd()))
            .as_ref(),
        "Snapshot" => SNAPSHOT
            .get_or_init(|| extract(kruntimes_api::Snapshot::crd()))
            .as_ref(),
        "Workspace" => WORKSPACE
            .get_or_init(|| extract(kruntimes_api::Workspace::crd()))
            .as_ref(),
        _ => None,
    }
}

fn schema_name(def: &ResourceDef) -> String {
    let group = if def.group.is_empty() {
        "io.k8s.api.core".to_string()
    } else {
        def.group.split('.').rev().collect::<Vec<_>>().join(".")
    };
    format!("{group}.{}.{}", def.version, def.kind)
}

fn gvk(def: &ResourceDef) -> Value {
    json!({"group": def.group, "version": def.version, "kind": def.kind})
}

fn object_meta_schema() -> Value {
    json!({
        "description": "Standard object metadata.",
        "type": "object",
        "properties": {
            "name": {"type": "string", "description": "Name must be unique within a namespace."},
            "generateName": {"type": "string", "description": "A prefix the server uses to generate a unique name."},
            "namespace": {"type": "string", "description": "The namespace the object belongs to."},
            "uid": {"type": "string", "description": "Unique in time and space; set by the server."},
            "resourceVersion": {"type": "string", "description": "Opaque version for optimistic concurrency and watches."},
            "generation": {"type": "integer", "format": "int64", "description": "Bumped on every spec change."},
            "creationTimestamp": {"type": "string", "format": "date-time"},
            "deletionTimestamp": {"type": "string", "format": "date-time"},
            "deletionGracePeriodSeconds": {"type": "integer", "format": "int64"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            "finalizers": {"type": "array", "items": {"type": "string"}},
            "ownerReferences": {"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}},
            "managedFields": {"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}
        }
    })
}

const META_REF: &str = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta";

fn object_schema(def: &ResourceDef) -> Value {
    let mut schema = crd_schema(def).cloned().unwrap_or_else(|| {
        json!({
            "type": "object",
            "description": format!("{} ({}).", def.kind, def.api_version()),
            "x-kubernetes-preserve-unknown-fields": true,
            "properties": {}
        })
    });
    if let Some(props) = schema.get_mut("properties").and_then(Value::as_object_mut) {
        props.insert("apiVersion".into(), json!({"type": "string", "description": "The versioned schema of this representation of an object."}));
        props.insert(
            "kind".into(),
            json!({"type": "string", "description": "The REST resource this object represents."}),
        );
        props.insert(
            "metadata".into(),
            json!({"allOf": [{"$ref": format!("#/components/schemas/{META_REF}")}], "default": {}, "description": "Standard object metadata."}),
        );
    }
    schema["x-kubernetes-group-version-kind"] = json!([gvk(def)]);
    schema
}

fn params() -> Vec<Value> {
    ["dryRun", "fieldManager", "fieldValidation", "force", "pretty"]
        .iter()
        .map(|name| json!({"name": name, "in": "query", "schema": {"type": "string", "uniqueItems": true}}))
        .collect()
}

fn paths(def: &ResourceDef) -> Vec<(String, Value)> {
    let prefix = if def.group.is_empty() {
        "/api/v1".to_string()
    } else {
        format!("/apis/{}/{}", def.group, def.version)
    };
    let collection = if def.namespaced {
        format!("{prefix}/namespaces/{{namespace}}/{}", def.plural)
    } else {
        format!("{prefix}/{}", def.plural)
    };
    let reference = json!({"$ref": format!("#/components/schemas/{}", schema_name(def))});
    let op = |action: &str, verb: &str| {
        json!({
            "operationId": format!("{verb}{}", def.kind),
            "x-kubernetes-action": action,
            "x-kubernetes-group-version-kind": gvk(def),
            "parameters": params(),
            "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": reference.clone()}}}}
        })
    };
    let mut patch = op("patch", "patch");
    patch["requestBody"] = json!({"content": {
        "application/json-patch+json": {"schema": {"type": "object"}},
        "application/merge-patch+json": {"schema": {"type": "object"}},
        "application/apply-patch+yaml": {"schema": {"type": "object"}}
    }});
    let item = json!({
        "get": op("get", "read"),
        "put": op("put", "replace"),
        "patch": patch,
        "delete": op("delete", "delete"),
        "parameters": [{"name": "name", "in": "path", "required": true, "schema": {"type": "string"}}]
    });
    let coll = json!({
        "get": op("list", "list"),
        "post": op("post", "create"),
    });
    let mut out = vec![
        (collection.clone(), coll),
        (format!("{collection}/{{name}}"), item.clone()),
    ];
    if def.status_subresource {
        out.push((format!("{collection}/{{name}}/status"), item));
    }
    out
}

/// The document for one group/version, or `None` when nothing is served there.
pub fn document(group: &str, version: &str) -> Option<&'static (String, String)> {
    /// (group, version, (document, hash))
    type Docs = Vec<(String, String, (String, String))>;
    static DOCS: OnceLock<Docs> = OnceLock::new();
    let docs = DOCS.get_or_init(|| {
        let mut gvs: Vec<(String, String)> = vec![(String::new(), "v1".into())];
        gvs.extend(
            resources::groups()
                .into_iter()
                .map(|(g, v)| (g.to_string(), v.to_string())),
        );
        gvs.into_iter()
            .map(|(g, v)| {
                let mut schemas = serde_json::Map::new();
                schemas.insert(META_REF.into(), object_meta_schema());
                let mut all_paths = serde_json::Map::new();
                for def in resources::in_group(&g, &v) {
                    schemas.insert(schema_name(def), object_schema(def));
                    for (path, item) in paths(def) {
                        all_paths.insert(path, item);
                    }
                }
                let doc = json!({
                    "openapi": "3.0.0",
                    "info": {"title": "kruntimes", "version": "v1alpha1"},
                    "paths": all_paths,
                    "components": {"schemas": schemas},
                });
                let body = doc.to_string();
                let hash = hex::encode(&Sha256::digest(body.as_bytes())[..16]);
                (g, v, (body, hash))
            })
            .collect()
    });
    docs.iter()
        .find(|(g, v, _)| g == group && v == version)
        .map(|(_, _, doc)| doc)
}

/// `GET /openapi/v3`: where each group/version's document lives, with a content hash.
pub fn index() -> Value {
    let mut paths = serde_json::Map::new();
    let mut gvs: Vec<(String, String)> = vec![(String::new(), "v1".into())];
    gvs.extend(
        resources::groups()
            .into_iter()
            .map(|(g, v)| (g.to_string(), v.to_string())),
    );
    for (g, v) in gvs {
        let Some((_, hash)) = document(&g, &v) else {
            continue;
        };
        let key = if g.is_empty() {
            format!("api/{v}")
        } else {
            format!("apis/{g}/{v}")
        };
        paths.insert(
            key.clone(),
            json!({"serverRelativeURL": format!("/openapi/v3/{key}?hash={hash}")}),
        );
    }
    json!({"paths": paths})
}
