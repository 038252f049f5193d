//! The `Runtime` kind: a warm pool of workers that execute Runs.
//!
//! The worker template carries the runtime container's command, args, env and resources, so
//! the same object drives local worker processes in standalone mode and a Deployment on a
//! real cluster.

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::run::{EnvVar, RunCondition};

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
    /// The runtime container of each worker.
    #[serde(default)]
    pub template: WorkerTemplate,
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

/// The runtime container of a worker.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkerTemplate {
    /// Container image, used on a real cluster only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ContainerResources>,
}

/// Quantities as Kubernetes writes them (`cpu: "500m"`, `memory: "256Mi"`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContainerResources {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub requests: BTreeMap<String, String>,
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
}
