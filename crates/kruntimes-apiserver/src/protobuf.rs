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

/// Decodes a protobuf body into the JSON object it stands for.
pub fn decode(body: &[u8]) -> Result<Value, ProtobufError> {
    let raw = body.strip_prefix(MAGIC).ok_or(ProtobufError::NoEnvelope)?;
    let unknown = Unknown::decode(raw)?;
    let type_meta = unknown.type_meta.unwrap_or_default();
    let api_version = type_meta.api_version.unwrap_or_default();
    let kind = type_meta.kind.unwrap_or_default();
    let raw = unknown.raw.unwrap_or_default();
    match (api_version.as_str(), kind.as_str()) {
        ("v1", "Namespace") => {
            let ns = k8s_pb::api::core::v1::Namespace::decode(raw.as_slice())?;
            let finalizers = ns.spec.map(|s| s.finalizers).unwrap_or_default();
            Ok(json!({
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": meta_json(&ns.metadata.unwrap_or_default()),
                "spec": if finalizers.is_empty() { json!({}) } else { json!({"finalizers": finalizers}) },
            }))
        }
        _ => Err(ProtobufError::Unsupported(format!("{api_version}/{kind}"))),
    }
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
