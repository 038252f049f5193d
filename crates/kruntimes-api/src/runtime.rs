//! The `Runtime` kind: a warm pool of workers that execute Runs.
//!
//! The worker template is a Pod template (a Deployment's `spec.template`): its container
//! named [`RUNTIME_CONTAINER`] runs the runtime server. The same object drives local worker
//! processes in standalone mode (which honour that container's command, args, env and
//! resource limits, and say what they ignore) and a Deployment on a real cluster (which
//! honours all of it).

use k8s_openapi::api::core::v1::{Container, PodSpec, PodTemplateSpec};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::run::RunCondition;

/// The name of the template's container that runs the runtime server.
pub const RUNTIME_CONTAINER: &str = "runtime";
/// The names the provisioners give to what they add to a worker Pod: a template may not
/// use them for its own containers or volumes.
pub const RESERVED_CONTAINERS: &[&str] = &["runtimed"];
pub const RESERVED_VOLUMES: &[&str] = &["kruntimes", "runtimed-token", "gateway-ca", "worker-tls"];
/// The Secret of the workers' mutual-TLS key in each namespace with a Runtime on a cluster
/// (the Kubernetes provisioner issues it): runtimed's alone, so no volume of a template may
/// name it.
pub const WORKER_TLS_SECRET: &str = "kruntimes-worker-tls";
/// Where the Kubernetes provisioner mounts the shared volume (the runtime server's socket
/// and workspaces) in the `runtime` container.
pub const RUNTIME_SHARED_DIR: &str = "/var/run/kruntimes";

/// A pool of identical workers.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "kruntimes.io",
    version = "v1alpha1",
    kind = "Runtime",
    plural = "runtimes",
    shortname = "rt",
    category = "kruntimes",
    namespaced,
    status = "RuntimeStatus",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".spec.replicas"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    validation = kube::core::Rule::new(
        "size(self.metadata.name) <= 63 && self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')"
    )
    // No fieldPath: a cluster checks that it names a field of the schema, and the CRD's
    // `metadata` lists none.
    .message(kube::core::Message::Message(
        crate::admission::RUNTIME_NAME_RULE.to_string()
    ))
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.scaling) || (self.scaling.minReplicas >= 1 && self.scaling.minReplicas <= self.scaling.maxReplicas)", "message": "spec.scaling needs 0 < minReplicas <= maxReplicas", "fieldPath": ".scaling"}
]))]
pub struct RuntimeSpec {
    /// How many workers to run (default 1). With `scaling` set this is the controller's
    /// output, as a HorizontalPodAutoscaler writes a Deployment's: it keeps it between
    /// `scaling.minReplicas` and `scaling.maxReplicas` as demand moves, and a
    /// `kubectl scale` holds only until demand says otherwise.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0, max = 1000))]
    pub replicas: i32,
    /// A warm pool that follows demand: workers are added while fewer than
    /// `warmRuns` slots are free and removed (drained, idle only) after a cool-down.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaling: Option<RuntimeScaling>,
    /// Run slots of each worker (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub runs: Option<i32>,
    /// The Pod of each worker, as a Deployment's `spec.template`. Its container named
    /// `runtime` (required when `spec` is given) runs the runtime server: without a
    /// `command`, the provisioner's `kruntimes-runtime-server` with the container's `args`
    /// after its own flags. The provisioner adds the `runtimed` container, the shared
    /// volume and runtimed's token; the Pod automounts no token (user code never sees
    /// runtimed's). Without `spec`, the defaults.
    #[serde(default)]
    #[schemars(schema_with = "crate::runtime::template_schema")]
    pub template: PodTemplateSpec,
    /// The port the worker's runtimed serves on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
    /// Where the Runs of this Runtime export artifacts (session Drain) and read their
    /// artifact inputs from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_store: Option<ArtifactStoreSpec>,
}

fn default_replicas() -> i32 {
    1
}

/// The bounds and the headroom of a scaling Runtime (`spec.scaling`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeScaling {
    /// The fewest workers, at least 1.
    #[schemars(range(min = 1, max = 1000))]
    pub min_replicas: i32,
    /// The most workers, at least `minReplicas`.
    #[schemars(range(min = 1, max = 1000))]
    pub max_replicas: i32,
    /// Run slots kept free beyond what Pending Runs ask for (default 0): a burst of new
    /// Runs finds them ready instead of waiting for a worker to start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 100000))]
    pub warm_runs: Option<i32>,
    /// How long a worker stays idle before it is removed (default 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 86400))]
    pub scale_down_delay_seconds: Option<i32>,
}

/// The default of `spec.scaling.scaleDownDelaySeconds`.
pub const DEFAULT_SCALE_DOWN_DELAY_SECONDS: i32 = 60;

impl RuntimeScaling {
    /// `warmRuns`, default 0.
    pub fn warm_runs(&self) -> i32 {
        self.warm_runs.unwrap_or(0).max(0)
    }

    /// `scaleDownDelaySeconds`, default [`DEFAULT_SCALE_DOWN_DELAY_SECONDS`].
    pub fn scale_down_delay(&self) -> std::time::Duration {
        let seconds = self
            .scale_down_delay_seconds
            .unwrap_or(DEFAULT_SCALE_DOWN_DELAY_SECONDS)
            .max(0);
        std::time::Duration::from_secs(u64::try_from(seconds).unwrap_or(0))
    }
}

/// An ArtifactStore: exactly one driver, `filesystem` or `s3`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "(has(self.filesystem) ? 1 : 0) + (has(self.s3) ? 1 : 0) == 1", "message": "spec.artifactStore needs exactly one driver: filesystem or s3"}
]))]
pub struct ArtifactStoreSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filesystem: Option<FilesystemArtifactStore>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s3: Option<S3ArtifactStore>,
}

/// The default of `spec.artifactStore.s3.region`.
pub const DEFAULT_S3_REGION: &str = "us-east-1";

/// Artifacts kept as objects of an S3-protocol bucket, reached by every worker.
///
/// Credentials are never part of the Runtime: runtimed reads them from its own
/// environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, optional
/// `AWS_SESSION_TOKEN`). Artifacts of a Run go to
/// `<prefix>/<namespace>/<run name>-<run uid>/`, completed by a marker object.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct S3ArtifactStore {
    /// The service's URL: `https://…`, or `http://…` for a loopback address only.
    #[schemars(length(min = 1, max = 2048))]
    pub endpoint: String,
    /// The bucket (an S3 bucket name: 3 to 63 lower-case letters, digits, `.` and `-`).
    #[schemars(length(min = 3, max = 63))]
    pub bucket: String,
    /// A key prefix every object of this store lives under (no leading `/`, no empty, `.`
    /// or `..` segments).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 512))]
    pub prefix: Option<String>,
    /// The signing region (default `us-east-1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub region: Option<String>,
    /// Path-style requests (`<endpoint>/<bucket>/<key>`) instead of virtual-hosted ones
    /// (default true: custom endpoints rarely have a DNS name per bucket).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub force_path_style: Option<bool>,
}

impl S3ArtifactStore {
    /// `region`, default [`DEFAULT_S3_REGION`].
    pub fn region(&self) -> &str {
        self.region.as_deref().unwrap_or(DEFAULT_S3_REGION)
    }

    /// `forcePathStyle`, default true.
    pub fn force_path_style(&self) -> bool {
        self.force_path_style.unwrap_or(true)
    }

    /// `prefix` without a trailing `/`, empty for none.
    pub fn prefix(&self) -> &str {
        self.prefix.as_deref().unwrap_or("").trim_end_matches('/')
    }
}

/// Artifacts kept as files under a directory every worker can reach.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FilesystemArtifactStore {
    /// An absolute directory. Artifacts of a Run go to
    /// `<path>/<namespace>/<run name>-<run uid>/`.
    #[schemars(length(min = 1, max = 4096))]
    pub path: String,
}

/// The schema of `spec.template`: a Pod template, as a Deployment's, without the field
/// descriptions of the Pod's API. With them the CRD is over 300 KB of JSON, beyond the
/// 256 KiB that `kubectl apply` (client side) may keep in its last-applied annotation;
/// without, about 50 KB (controller-gen's `maxDescLen=0` does the same).
fn template_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    fn strip(value: &mut serde_json::Value) {
        match value {
            serde_json::Value::Object(map) => {
                map.remove("description");
                map.values_mut().for_each(strip);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let mut schema = <PodTemplateSpec as JsonSchema>::json_schema(generator);
    if let Some(map) = schema.as_object_mut() {
        map.values_mut().for_each(strip);
    }
    schema
}

/// The fields of the template before it was a Pod template: the runtime container's.
const LEGACY_TEMPLATE_FIELDS: [&str; 5] = ["image", "command", "args", "env", "resources"];

/// Rewrites a Runtime `spec` whose `template` has fields of the earlier shape (`image`,
/// `command`, `args`, `env`, `resources` of the runtime container, at the top of the
/// template: stored by an earlier version, or sent by a client written for it, alone or
/// merged into a Pod template by a patch) into the Pod template's `runtime` container
/// (made when missing; the fields replace its own); whether it changed anything. Without
/// it, those fields would be dropped in silence (a Pod template has no such fields).
pub fn upgrade_legacy_template(spec: &mut serde_json::Value) -> bool {
    let Some(template) = spec.get_mut("template").and_then(|t| t.as_object_mut()) else {
        return false;
    };
    let legacy: Vec<(&str, serde_json::Value)> = LEGACY_TEMPLATE_FIELDS
        .iter()
        .filter_map(|f| template.remove(*f).map(|v| (*f, v)))
        .collect();
    if legacy.is_empty() {
        return false;
    }
    let pod = template
        .entry("spec")
        .or_insert_with(|| serde_json::json!({}));
    if !pod.is_object() {
        *pod = serde_json::json!({});
    }
    let containers = pod.as_object_mut().map(|p| {
        p.entry("containers")
            .or_insert_with(|| serde_json::json!([]))
    });
    let Some(containers) = containers else {
        return true;
    };
    if !containers.is_array() {
        *containers = serde_json::json!([]);
    }
    let Some(list) = containers.as_array_mut() else {
        return true;
    };
    let at = match list.iter().position(|c| c["name"] == RUNTIME_CONTAINER) {
        Some(at) => at,
        None => {
            list.push(serde_json::json!({"name": RUNTIME_CONTAINER}));
            list.len() - 1
        }
    };
    if let Some(container) = list[at].as_object_mut() {
        for (field, value) in legacy {
            container.insert(field.into(), value);
        }
    }
    true
}

/// A template whose only container is the runtime container `container` (its name set
/// to [`RUNTIME_CONTAINER`]).
pub fn template(container: Container) -> PodTemplateSpec {
    PodTemplateSpec {
        metadata: None,
        spec: Some(PodSpec {
            containers: vec![Container {
                name: RUNTIME_CONTAINER.to_string(),
                ..container
            }],
            ..PodSpec::default()
        }),
    }
}

/// A template whose runtime container has these `args` (after the runtime server's own
/// flags), for example `["--sandbox", "process"]`.
pub fn template_with_args(args: Vec<String>) -> PodTemplateSpec {
    template(Container {
        args: Some(args),
        ..Container::default()
    })
}

/// What the controllers observed of a Runtime.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeStatus {
    /// Workers that exist (started or starting), for the scale subresource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// The label selector of the worker Pods, for the scale subresource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_replicas: Option<i32>,
    /// Run slots over all ready workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_runs: Option<i32>,
    /// Run slots held by active Runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_runs: Option<i32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<RunCondition>,
}

impl RuntimeSpec {
    /// Run slots of each worker: `runs`, default 1.
    pub fn runs_per_worker(&self) -> i32 {
        self.runs.unwrap_or(1)
    }

    /// The template's runtime container, if it has one.
    pub fn runtime_container(&self) -> Option<&Container> {
        self.template
            .spec
            .as_ref()?
            .containers
            .iter()
            .find(|c| c.name == RUNTIME_CONTAINER)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_template_of_the_earlier_shape_becomes_a_pod_template_with_the_same_fields() {
        let mut spec = serde_json::json!({"replicas": 2, "template": {
            "image": "python:3.12",
            "args": ["--adapter", "python"],
            "env": [{"name": "A", "value": "1"}],
            "resources": {"limits": {"memory": "1Gi"}},
        }});
        assert!(upgrade_legacy_template(&mut spec));
        let upgraded: RuntimeSpec = serde_json::from_value(spec.clone()).expect("a Runtime spec");
        let container = upgraded.runtime_container().expect("a runtime container");
        assert_eq!(container.image.as_deref(), Some("python:3.12"));
        assert_eq!(
            container.args.clone().unwrap_or_default(),
            ["--adapter", "python"]
        );
        assert_eq!(container.env.as_ref().map(Vec::len), Some(1));
        let limits = container.resources.as_ref().and_then(|r| r.limits.as_ref());
        assert_eq!(limits.map(|l| l["memory"].0.as_str()), Some("1Gi"));
        assert_eq!(upgraded.replicas, 2);
        // Once, and never to a Pod template or an empty one.
        assert!(!upgrade_legacy_template(&mut spec));
        // Merged into a Pod template (a patch in the earlier shape): into its container.
        let mut merged = serde_json::json!({"template": {"args": ["--adapter", "bash"], "spec": {
            "containers": [{"name": "sidecar"}, {"name": "runtime", "args": ["x"], "image": "i"}],
        }}});
        assert!(upgrade_legacy_template(&mut merged));
        assert_eq!(
            merged["template"],
            serde_json::json!({"spec": {"containers": [
                {"name": "sidecar"},
                {"name": "runtime", "args": ["--adapter", "bash"], "image": "i"},
            ]}})
        );
        for mut other in [
            serde_json::json!({}),
            serde_json::json!({"template": {}}),
            serde_json::json!({"template": {"spec": {"containers": [{"name": "runtime"}]}}}),
        ] {
            let before = other.clone();
            assert!(!upgrade_legacy_template(&mut other));
            assert_eq!(other, before);
        }
    }
}
