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
    printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".spec.replicas"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeSpec {
    /// How many workers to keep warm.
    #[schemars(range(min = 0, max = 1000))]
    pub replicas: i32,
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

/// An ArtifactStore: exactly one driver (only `filesystem` exists yet).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ArtifactStoreSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filesystem: Option<FilesystemArtifactStore>,
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
