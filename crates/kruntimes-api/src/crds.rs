//! CRD generation for a real cluster.
//!
//! `deploy/crds/` holds the generated YAML; a test fails when it drifts from the types.
//! Regenerate with `KRUNTIMES_UPDATE_CRDS=1 cargo test -p kruntimes-api crds`.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::ValidationRule;

use crate::{Run, Runtime, Snapshot, Workspace};

/// The rule of the Run object's root that `kube`'s derive cannot express on a
/// `JsonSchema` type: a session that mounts a Workspace is named after it (the Run's name
/// is the Workspace's lock, design document 002). Admission's
/// [`crate::admission::validate_workspace_lock`] says the same.
pub const WORKSPACE_LOCK_RULE: &str =
    "!has(self.spec.workspace) || self.spec.workspace.name == self.metadata.name";

/// The Run CRD: [`Run::crd`] with [`WORKSPACE_LOCK_RULE`] at the root of its schema.
pub fn run_crd() -> CustomResourceDefinition {
    let mut crd = Run::crd();
    for version in &mut crd.spec.versions {
        if let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        {
            schema
                .x_kubernetes_validations
                .get_or_insert_with(Vec::new)
                .push(ValidationRule {
                    rule: WORKSPACE_LOCK_RULE.to_string(),
                    message: Some(
                        "a session that mounts a Workspace must be named after it: the Run's \
                         name is the Workspace's lock"
                            .to_string(),
                    ),
                    field_path: Some(".spec.workspace.name".to_string()),
                    ..ValidationRule::default()
                });
        }
    }
    crd
}

/// Every CRD kruntimes installs, with the file name it is kept under in `deploy/crds/`.
pub fn all() -> Vec<(&'static str, CustomResourceDefinition)> {
    vec![
        ("runs.kruntimes.io.yaml", run_crd()),
        ("runtimes.kruntimes.io.yaml", Runtime::crd()),
        ("snapshots.kruntimes.io.yaml", Snapshot::crd()),
        ("workspaces.kruntimes.io.yaml", Workspace::crd()),
    ]
}

/// The YAML document for one CRD, as checked in.
pub fn to_yaml(crd: &CustomResourceDefinition) -> Result<String, serde_yaml::Error> {
    Ok(format!(
        "# Generated from crates/kruntimes-api. Do not edit; see crates/kruntimes-api/src/crds.rs.\n{}",
        serde_yaml::to_string(crd)?
    ))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    #[test]
    fn crds_match_the_checked_in_yaml() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/crds");
        let update = std::env::var_os("KRUNTIMES_UPDATE_CRDS").is_some();
        for (file, crd) in all() {
            let yaml = to_yaml(&crd).expect("CRD serializes");
            let path = dir.join(file);
            if update {
                std::fs::write(&path, &yaml).expect("write CRD");
                continue;
            }
            let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                on_disk == yaml,
                "{} drifted from the types; run KRUNTIMES_UPDATE_CRDS=1 cargo test -p kruntimes-api crds",
                path.display()
            );
        }
    }

    /// A cluster refuses a CRD whose CEL rules do not compile. cel-go reserves words that
    /// kube-cel's parser takes as names (`self.function` fails there only when it is
    /// evaluated): a field so named must be written `self.__function__`.
    #[test]
    fn every_cel_rule_compiles() {
        let reserved = regex::Regex::new(
            r"\.(as|break|const|continue|else|for|function|if|import|let|loop|package|namespace|return|var|void|while)\b",
        )
        .expect("the pattern compiles");
        for (file, crd) in all() {
            let json = serde_json::to_value(&crd).expect("CRD serializes");
            for version in json["spec"]["versions"].as_array().expect("versions") {
                let schema = &version["schema"]["openAPIV3Schema"];
                let compiled = kube::core::cel::compile_schema(schema);
                assert!(
                    !compiled.has_errors(),
                    "{file}: {:?}",
                    compiled.compilation_errors()
                );
                let mut rules = Vec::new();
                collect_rules(schema, &mut rules);
                assert!(!rules.is_empty(), "{file} has CEL rules");
                for rule in rules {
                    assert!(
                        !reserved.is_match(&rule),
                        "{file}: {rule:?} names a CEL reserved word"
                    );
                }
            }
        }
    }

    fn collect_rules(schema: &serde_json::Value, rules: &mut Vec<String>) {
        match schema {
            serde_json::Value::Object(map) => {
                for (key, value) in map {
                    if key == "x-kubernetes-validations" {
                        let found = value.as_array().into_iter().flatten();
                        rules.extend(found.filter_map(|r| r["rule"].as_str().map(str::to_owned)));
                    } else {
                        collect_rules(value, rules);
                    }
                }
            }
            serde_json::Value::Array(items) => {
                items.iter().for_each(|item| collect_rules(item, rules))
            }
            _ => {}
        }
    }

    #[test]
    fn run_crd_carries_the_admission_rules_as_cel() {
        let crd = Run::crd();
        let json = serde_json::to_value(&crd).expect("CRD serializes");
        let schema = &json["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
        let spec = &schema["properties"]["spec"];
        let rules: Vec<&str> = spec["x-kubernetes-validations"]
            .as_array()
            .expect("spec has CEL rules")
            .iter()
            .filter_map(|r| r["rule"].as_str())
            .collect();
        for needle in [
            "self.runtime == oldSelf.runtime",
            "self.mode == oldSelf.mode",
            "oldSelf.termination.mode == 'Drain'",
            "self.termination.mode != 'Drain' || has(self.mode.session)",
            "!has(self.workspace) || has(self.mode.session)",
            "has(self.mode.task.entrypoint) || (has(self.source) && has(self.source.inline))",
        ] {
            assert!(
                rules.iter().any(|r| r.contains(needle)),
                "missing rule {needle}"
            );
        }
        assert!(
            spec["properties"]["mode"]["x-kubernetes-validations"][0]["rule"]
                .as_str()
                .is_some_and(|r| r.contains("size() == 1"))
        );
        assert_eq!(
            spec["properties"]["source"]["properties"]["inline"]["maxLength"],
            262144
        );
        let names = &json["spec"]["names"];
        assert_eq!(names["shortNames"][0], "rn");
    }

    #[test]
    fn suspension_rules_are_cel_too() {
        let rules = |crd: CustomResourceDefinition, at: &str| -> Vec<String> {
            let json = serde_json::to_value(&crd).expect("CRD serializes");
            json["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][at]
                ["x-kubernetes-validations"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|r| r["rule"].as_str().map(str::to_string))
                .collect()
        };
        let run_spec = rules(Run::crd(), "spec");
        assert!(run_spec.iter().any(|r| r.contains("has(self.suspend)")));
        let run_status = rules(Run::crd(), "status");
        assert!(run_status.iter().any(|r| r.contains("has(self.snapshot)")));
        assert!(
            run_status
                .iter()
                .any(|r| r.contains("oldSelf.phase != 'Suspended'"))
        );
        assert_eq!(rules(Snapshot::crd(), "spec"), ["self == oldSelf"]);
        assert!(rules(Snapshot::crd(), "status")[0].contains("'Ready', 'Failed'"));
    }
}
