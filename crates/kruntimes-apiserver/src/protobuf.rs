//! Protobuf request bodies. kubectl 1.32 sends `application/vnd.kubernetes.protobuf` for
//! built-in kinds in its typed commands (`create namespace`, …). Responses stay JSON, which
//! kubectl accepts. Each decoded kind is converted to its JSON form and then handled like a
//! JSON body.

use k8s_pb::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_pb::apimachinery::pkg::runtime::Unknown;
use prost::Message;
use serde_json::{Map, Value, json};

/// The four bytes every Kubernetes protobuf body starts with.
const MAGIC: &[u8] = b"k8s\0";

/// Why a protobuf body was refused.
#[derive(Debug, thiserror::Error)]
pub enum ProtobufError {
    #[error("the protobuf body does not start with the Kubernetes envelope")]
    NoEnvelope,
    #[error("the protobuf body could not be decoded: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("protobuf bodies of kind {0:?} are not supported; send JSON")]
    Unsupported(String),
}

fn set_str(map: &mut Map<String, Value>, key: &str, value: &Option<String>) {
    if let Some(v) = value.as_ref().filter(|v| !v.is_empty()) {
        map.insert(key.into(), json!(v));
    }
}

fn meta_json(meta: &ObjectMeta) -> Value {
    let mut map = Map::new();
    set_str(&mut map, "name", &meta.name);
    set_str(&mut map, "generateName", &meta.generate_name);
    set_str(&mut map, "namespace", &meta.namespace);
    if !meta.labels.is_empty() {
        map.insert("labels".into(), json!(meta.labels));
    }
    if !meta.annotations.is_empty() {
        map.insert("annotations".into(), json!(meta.annotations));
    }
    if !meta.finalizers.is_empty() {
        map.insert("finalizers".into(), json!(meta.finalizers));
    }
    Value::Object(map)
}

fn opt(value: &Option<String>) -> Value {
    match value.as_ref().filter(|v| !v.is_empty()) {
        Some(v) => json!(v),
        None => Value::Null,
    }
}

/// Builds a JSON object, leaving out nulls, empty arrays and empty objects.
fn object(fields: Vec<(&str, Value)>) -> Value {
    let mut map = Map::new();
    for (key, value) in fields {
        let empty = match &value {
            Value::Null => true,
            Value::Array(a) => a.is_empty(),
            Value::Object(o) => o.is_empty(),
            _ => false,
        };
        if !empty {
            map.insert(key.into(), value);
        }
    }
    Value::Object(map)
}

fn rules_json(rules: &[k8s_pb::api::rbac::v1::PolicyRule]) -> Value {
    Value::Array(
        rules
            .iter()
            .map(|r| {
                object(vec![
                    ("verbs", json!(r.verbs)),
                    ("apiGroups", json!(r.api_groups)),
                    ("resources", json!(r.resources)),
                    ("resourceNames", json!(r.resource_names)),
                    ("nonResourceURLs", json!(r.non_resource_ur_ls)),
                ])
            })
            .collect(),
    )
}

fn binding_json(
    subjects: &[k8s_pb::api::rbac::v1::Subject],
    role_ref: &Option<k8s_pb::api::rbac::v1::RoleRef>,
) -> (Value, Value) {
    let subjects = Value::Array(
        subjects
            .iter()
            .map(|s| {
                object(vec![
                    ("kind", opt(&s.kind)),
                    ("apiGroup", opt(&s.api_group)),
                    ("name", opt(&s.name)),
                    ("namespace", opt(&s.namespace)),
                ])
            })
            .collect(),
    );
    let role_ref = role_ref.clone().unwrap_or_default();
    let role_ref = object(vec![
        ("apiGroup", opt(&role_ref.api_group)),
        ("kind", opt(&role_ref.kind)),
        ("name", opt(&role_ref.name)),
    ]);
    (subjects, role_ref)
}

fn resource_attributes(a: &Option<k8s_pb::api::authorization::v1::ResourceAttributes>) -> Value {
    match a {
        None => Value::Null,
        Some(a) => object(vec![
            ("namespace", opt(&a.namespace)),
            ("verb", opt(&a.verb)),
            ("group", opt(&a.group)),
            ("version", opt(&a.version)),
            ("resource", opt(&a.resource)),
            ("subresource", opt(&a.subresource)),
            ("name", opt(&a.name)),
        ]),
    }
}

fn non_resource_attributes(
    a: &Option<k8s_pb::api::authorization::v1::NonResourceAttributes>,
) -> Value {
    match a {
        None => Value::Null,
        Some(a) => object(vec![("path", opt(&a.path)), ("verb", opt(&a.verb))]),
    }
}

fn envelope(
    api_version: &str,
    kind: &str,
    meta: Option<&ObjectMeta>,
    rest: Vec<(&str, Value)>,
) -> Value {
    let mut fields = vec![
        ("apiVersion", json!(api_version)),
        ("kind", json!(kind)),
        ("metadata", meta.map(meta_json).unwrap_or_else(|| json!({}))),
    ];
    fields.extend(rest);
    let mut value = object(fields);
    if value.get("metadata").is_none() {
        value["metadata"] = json!({});
    }
    value
}

/// Decodes a protobuf body into the JSON object it stands for.
pub fn decode(body: &[u8]) -> Result<Value, ProtobufError> {
    use k8s_pb::api::{authentication, authorization, core, rbac};
    let raw = body.strip_prefix(MAGIC).ok_or(ProtobufError::NoEnvelope)?;
    let unknown = Unknown::decode(raw)?;
    let type_meta = unknown.type_meta.unwrap_or_default();
    let api_version = type_meta.api_version.unwrap_or_default();
    let kind = type_meta.kind.unwrap_or_default();
    let raw = unknown.raw.unwrap_or_default();
    let raw = raw.as_slice();
    let value = match (api_version.as_str(), kind.as_str()) {
        ("v1", "Namespace") => {
            let ns = core::v1::Namespace::decode(raw)?;
            let finalizers = ns.spec.map(|s| s.finalizers).unwrap_or_default();
            envelope(
                "v1",
                "Namespace",
                ns.metadata.as_ref(),
                vec![("spec", object(vec![("finalizers", json!(finalizers))]))],
            )
        }
        ("v1", "ServiceAccount") => {
            let sa = core::v1::ServiceAccount::decode(raw)?;
            envelope(
                "v1",
                "ServiceAccount",
                sa.metadata.as_ref(),
                vec![(
                    "automountServiceAccountToken",
                    json!(sa.automount_service_account_token),
                )],
            )
        }
        ("rbac.authorization.k8s.io/v1", "Role") => {
            let role = rbac::v1::Role::decode(raw)?;
            envelope(
                &api_version,
                &kind,
                role.metadata.as_ref(),
                vec![("rules", rules_json(&role.rules))],
            )
        }
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
            let role = rbac::v1::ClusterRole::decode(raw)?;
            envelope(
                &api_version,
                &kind,
                role.metadata.as_ref(),
                vec![("rules", rules_json(&role.rules))],
            )
        }
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => {
            let b = rbac::v1::RoleBinding::decode(raw)?;
            let (subjects, role_ref) = binding_json(&b.subjects, &b.role_ref);
            envelope(
                &api_version,
                &kind,
                b.metadata.as_ref(),
                vec![("subjects", subjects), ("roleRef", role_ref)],
            )
        }
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            let b = rbac::v1::ClusterRoleBinding::decode(raw)?;
            let (subjects, role_ref) = binding_json(&b.subjects, &b.role_ref);
            envelope(
                &api_version,
                &kind,
                b.metadata.as_ref(),
                vec![("subjects", subjects), ("roleRef", role_ref)],
            )
        }
        ("authentication.k8s.io/v1", "TokenRequest") => {
            let tr = authentication::v1::TokenRequest::decode(raw)?;
            let spec = tr.spec.unwrap_or_default();
            envelope(
                &api_version,
                &kind,
                tr.metadata.as_ref(),
                vec![(
                    "spec",
                    object(vec![
                        ("audiences", json!(spec.audiences)),
                        ("expirationSeconds", json!(spec.expiration_seconds)),
                    ]),
                )],
            )
        }
        ("authentication.k8s.io/v1", "TokenReview") => {
            let tr = authentication::v1::TokenReview::decode(raw)?;
            let spec = tr.spec.unwrap_or_default();
            envelope(
                &api_version,
                &kind,
                tr.metadata.as_ref(),
                vec![(
                    "spec",
                    object(vec![
                        ("token", opt(&spec.token)),
                        ("audiences", json!(spec.audiences)),
                    ]),
                )],
            )
        }
        ("authorization.k8s.io/v1", "SelfSubjectAccessReview") => {
            let r = authorization::v1::SelfSubjectAccessReview::decode(raw)?;
            let spec = r.spec.unwrap_or_default();
            envelope(
                &api_version,
                &kind,
                r.metadata.as_ref(),
                vec![(
                    "spec",
                    object(vec![
                        (
                            "resourceAttributes",
                            resource_attributes(&spec.resource_attributes),
                        ),
                        (
                            "nonResourceAttributes",
                            non_resource_attributes(&spec.non_resource_attributes),
                        ),
                    ]),
                )],
            )
        }
        ("authorization.k8s.io/v1", "SubjectAccessReview" | "LocalSubjectAccessReview") => {
            let r = authorization::v1::SubjectAccessReview::decode(raw)?;
            let spec = r.spec.unwrap_or_default();
            let extra: Map<String, Value> = spec
                .extra
                .iter()
                .map(|(k, v)| (k.clone(), json!(v.items)))
                .collect();
            envelope(
                &api_version,
                &kind,
                r.metadata.as_ref(),
                vec![(
                    "spec",
                    object(vec![
                        (
                            "resourceAttributes",
                            resource_attributes(&spec.resource_attributes),
                        ),
                        (
                            "nonResourceAttributes",
                            non_resource_attributes(&spec.non_resource_attributes),
                        ),
                        ("user", opt(&spec.user)),
                        ("groups", json!(spec.groups)),
                        ("uid", opt(&spec.uid)),
                        ("extra", Value::Object(extra)),
                    ]),
                )],
            )
        }
        ("authorization.k8s.io/v1", "SelfSubjectRulesReview") => {
            let r = authorization::v1::SelfSubjectRulesReview::decode(raw)?;
            let spec = r.spec.unwrap_or_default();
            envelope(
                &api_version,
                &kind,
                r.metadata.as_ref(),
                vec![("spec", object(vec![("namespace", opt(&spec.namespace))]))],
            )
        }
        _ => return Err(ProtobufError::Unsupported(format!("{api_version}/{kind}"))),
    };
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_pb::apimachinery::pkg::runtime::TypeMeta;

    fn envelope(api_version: &str, kind: &str, raw: Vec<u8>) -> Vec<u8> {
        let unknown = Unknown {
            type_meta: Some(TypeMeta {
                api_version: Some(api_version.into()),
                kind: Some(kind.into()),
            }),
            raw: Some(raw),
            content_encoding: Some(String::new()),
            content_type: Some(String::new()),
        };
        let mut out = MAGIC.to_vec();
        out.extend(unknown.encode_to_vec());
        out
    }

    #[test]
    fn decodes_a_namespace_as_kubectl_sends_it() {
        let ns = k8s_pb::api::core::v1::Namespace {
            metadata: Some(ObjectMeta {
                name: Some("team-a".into()),
                generate_name: Some(String::new()),
                namespace: Some(String::new()),
                ..Default::default()
            }),
            spec: Some(Default::default()),
            status: Some(Default::default()),
        };
        let value = decode(&envelope("v1", "Namespace", ns.encode_to_vec())).expect("decode");
        assert_eq!(value["metadata"], json!({"name": "team-a"}));
        assert_eq!(value["kind"], "Namespace");
    }

    #[test]
    fn refuses_what_it_cannot_read() {
        assert!(matches!(decode(b"{}"), Err(ProtobufError::NoEnvelope)));
        assert!(matches!(
            decode(b"k8s\0\xff\xff"),
            Err(ProtobufError::Decode(_))
        ));
        assert!(matches!(
            decode(&envelope("v1", "Secret", vec![])),
            Err(ProtobufError::Unsupported(_))
        ));
    }
}
