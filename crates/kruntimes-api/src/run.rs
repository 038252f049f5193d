//! The `Run` kind: one unit of work in task, function or session mode.
//!
//! The CEL rules attached here with `x-kubernetes-validations` express, for a real cluster,
//! the same rules that [`crate::admission`] applies in the embedded API server. Keep the two
//! in step; the admission table tests name each rule.

use std::collections::BTreeMap;

pub use k8s_openapi::ByteString;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::phase::Phase;

/// Inline source is at most 256 KiB.
pub const MAX_INLINE_SOURCE_BYTES: usize = 256 * 1024;
/// `status.endpoint.url` is at most 2048 bytes.
pub const MAX_ENDPOINT_URL_BYTES: usize = 2048;
/// `status.endpoint.caBundle` is at most 16 KiB of PEM (decoded bytes).
pub const MAX_CA_BUNDLE_BYTES: usize = 16 * 1024;
/// The longest base64 text of a CA bundle of [`MAX_CA_BUNDLE_BYTES`]: the CRD's `maxLength`.
pub const MAX_CA_BUNDLE_BASE64_CHARS: usize = MAX_CA_BUNDLE_BYTES.div_ceil(3) * 4;
/// `status.outputs` holds at most 64 keys.
pub const MAX_OUTPUT_KEYS: usize = 64;
/// An output key is at most 128 bytes.
pub const MAX_OUTPUT_KEY_BYTES: usize = 128;
/// An output value is at most 8 KiB.
pub const MAX_OUTPUT_VALUE_BYTES: usize = 8 * 1024;
/// All output keys and values together are at most 64 KiB.
pub const MAX_OUTPUTS_TOTAL_BYTES: usize = 64 * 1024;
/// The default and largest session queue (ARCHITECTURE.md, "Limits").
pub const MAX_SESSION_QUEUE_SIZE: i32 = 32;
/// The most invocations of one function Run that may run at once
/// (`spec.mode.function.concurrency`).
pub const MAX_FUNCTION_CONCURRENCY: i32 = 64;
/// The default and longest session operation timeout: five minutes.
pub const MAX_SESSION_OPERATION_TIMEOUT_SECS: u64 = 300;
/// At most this many environment variables.
pub const MAX_ENV_VARS: usize = 256;
/// At most this many task arguments.
pub const MAX_TASK_ARGS: usize = 1024;
/// The most attempts a retry policy may ask for.
pub const MAX_RETRY_ATTEMPTS: i32 = 100;
/// A task's entrypoint is at most 1024 bytes.
pub const MAX_ENTRYPOINT_BYTES: usize = 1024;
/// The file a task's inline source is written to when the task names no entrypoint; the
/// Runtime's interpreter runs it (the reference implementation's name).
pub const INLINE_SCRIPT_FILE: &str = "script";

/// What a Run executes and how it is governed.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "kruntimes.io",
    version = "v1alpha1",
    kind = "Run",
    plural = "runs",
    shortname = "rn",
    category = "kruntimes",
    namespaced,
    status = "RunStatus",
    printcolumn = r#"{"name":"Runtime","type":"string","jsonPath":".spec.runtime","description":"The Runtime that executes the Run"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase","description":"The lifecycle phase"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.status==\"False\")].reason","description":"Why the Run waits: the reason of its first False condition (Scheduled=False/RuntimeNotFound, say)"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    selectable = ".spec.runtime",
    selectable = ".status.phase",
    selectable = ".status.assignedPod"
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.runtime == oldSelf.runtime", "message": "spec.runtime is immutable", "fieldPath": ".runtime"},
    {"rule": "self.mode == oldSelf.mode", "message": "spec.mode is immutable", "fieldPath": ".mode"},
    {"rule": "has(self.source) == has(oldSelf.source) && (!has(self.source) || self.source == oldSelf.source)", "message": "spec.source is immutable", "fieldPath": ".source"},
    {"rule": "has(self.env) == has(oldSelf.env) && (!has(self.env) || self.env == oldSelf.env)", "message": "spec.env is immutable", "fieldPath": ".env"},
    {"rule": "has(self.timeout) == has(oldSelf.timeout) && (!has(self.timeout) || self.timeout == oldSelf.timeout)", "message": "spec.timeout is immutable", "fieldPath": ".timeout"},
    {"rule": "has(self.retryPolicy) == has(oldSelf.retryPolicy) && (!has(self.retryPolicy) || self.retryPolicy == oldSelf.retryPolicy)", "message": "spec.retryPolicy is immutable", "fieldPath": ".retryPolicy"},
    {"rule": "has(self.resources) == has(oldSelf.resources) && (!has(self.resources) || self.resources == oldSelf.resources)", "message": "spec.resources is immutable", "fieldPath": ".resources"},
    {"rule": "!has(oldSelf.termination) || (has(self.termination) && (self.termination.mode == oldSelf.termination.mode || (oldSelf.termination.mode == 'Drain' && self.termination.mode == 'Immediate')))", "message": "spec.termination may only move from absent to Drain to Immediate", "fieldPath": ".termination"},
    {"rule": "!has(self.termination) || self.termination.mode != 'Drain' || has(self.mode.session)", "message": "termination mode Drain is only valid for session Runs", "fieldPath": ".termination.mode"},
    {"rule": "!has(self.workspace) || has(self.mode.session)", "message": "only a session mounts a Workspace", "fieldPath": ".workspace"},
    {"rule": "!has(self.workspace) || !has(self.source) || !has(self.source.snapshot)", "message": "a session with a Workspace starts from the Workspace's head: leave out spec.source.snapshot", "fieldPath": ".workspace"},
    {"rule": "!has(self.mode.session) || !has(self.mode.session.class) || self.mode.session.class != 'Dev' || has(self.workspace)", "message": "a Dev machine needs its project's Workspace (spec.workspace)", "fieldPath": ".workspace"},
    {"rule": "!has(self.resources) || !has(self.resources.exclusive) || !self.resources.exclusive || has(self.mode.session)", "message": "spec.resources.exclusive is only valid for session Runs", "fieldPath": ".resources.exclusive"},
    {"rule": "!has(self.suspend) || has(self.mode.session)", "message": "spec.suspend is only valid for session Runs", "fieldPath": ".suspend"},
    {"rule": "!has(self.mode.task) || has(self.mode.task.entrypoint) || (has(self.source) && has(self.source.inline))", "message": "a task needs an entrypoint unless spec.source.inline gives its program", "fieldPath": ".mode.task.entrypoint"},
    {"rule": "!has(self.artifactInputs) || size(self.artifactInputs) == 0 || has(self.mode.session)", "message": "artifact inputs initialise a session's workspace; only session Runs take them", "fieldPath": ".artifactInputs"},
    {"rule": "!has(self.source) || !has(self.source.snapshot) || has(self.mode.session)", "message": "only a session starts from a Snapshot", "fieldPath": ".source.snapshot"},
    {"rule": "!has(self.source) || !has(self.source.snapshot) || (!has(self.source.inline) && (!has(self.artifactInputs) || size(self.artifactInputs) == 0))", "message": "a session started from a Snapshot takes its files from it: leave out spec.source.inline and spec.artifactInputs", "fieldPath": ".source.snapshot"}
]))]
pub struct RunSpec {
    /// The Runtime (worker pool) that executes this Run, in the Run's namespace.
    #[schemars(length(min = 1, max = 63), regex(pattern = DNS1123_LABEL))]
    pub runtime: String,
    /// What kind of work this is: exactly one of task, function or session.
    pub mode: RunMode,
    /// The code to run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<RunSource>,
    /// Environment variables for the program.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub env: Option<Vec<EnvVar>>,
    /// The longest the Run may hold its worker, measured from startTime (for example "10m").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DURATION), extend("x-kubernetes-validations" = [
        {"rule": "duration(self) > duration('0s') && duration(self) <= duration('2562047h')", "message": "must be greater than zero and at most 2562047h"}
    ]))]
    pub timeout: Option<String>,
    /// How failed attempts are retried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_policy: Option<RetryPolicy>,
    /// A request to end the Run: Drain (sessions only) or Immediate. Monotonic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub termination: Option<Termination>,
    /// Seconds to keep the Run after it reaches a terminal phase. Mutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub ttl_seconds_after_finished: Option<i32>,
    /// What the Run consumes of its worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<RunResources>,
    /// Files of earlier Runs' artifacts (`status.artifactRefs[].uri`, from this Runtime's
    /// ArtifactStore) copied into a session's workspace before it is Ready.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub artifact_inputs: Vec<ArtifactInput>,
    /// The project Workspace the session restores before it is Ready and commits to when
    /// it ends (sessions only; the Run must be named after the Workspace). Created on
    /// first use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<WorkspaceRef>,
    /// Suspend the session (sessions only; mutable, unlike the execution inputs): `true`
    /// asks its worker to capture the files into a Snapshot and release the slot
    /// (Ready → Suspended); `false` or absent on a Suspended Run resumes it (Suspended →
    /// Pending, placed again with `status.incarnation` + 1). Each change bumps
    /// `metadata.generation`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspend: Option<bool>,
}

/// Exactly one of the three modes is set.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "[has(self.task), has(self.__function__), has(self.session)].filter(x, x).size() == 1", "message": "exactly one of task, function or session must be set"}
]))]
pub struct RunMode {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<TaskMode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<FunctionMode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<SessionMode>,
}

/// A DNS-1123 label, as a CRD pattern.
const DNS1123_LABEL: &str = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
/// A duration as [`crate::duration::parse`] takes it, as a CRD pattern (its bounds are CEL
/// rules using `duration()`, up to [`crate::duration::MAX`]).
const DURATION: &str = r"^(0|([0-9]{1,18}(h|m|s|ms))+)$";
/// A relative path without empty, `.` or `..` components, as a CRD pattern.
const RELATIVE_PATH: &str = r"^([^./\x00][^/\x00]*|\.[^./\x00][^/\x00]*|\.\.[^/\x00]+)(/([^./\x00][^/\x00]*|\.[^./\x00][^/\x00]*|\.\.[^/\x00]+))*$";

/// The kind of a Run, derived from which mode is set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModeKind {
    Task,
    Function,
    Session,
}

impl ModeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ModeKind::Task => "task",
            ModeKind::Function => "function",
            ModeKind::Session => "session",
        }
    }
}

impl RunMode {
    /// The single mode that is set, or `None` when zero or several are.
    pub fn kind(&self) -> Option<ModeKind> {
        match (&self.task, &self.function, &self.session) {
            (Some(_), None, None) => Some(ModeKind::Task),
            (None, Some(_), None) => Some(ModeKind::Function),
            (None, None, Some(_)) => Some(ModeKind::Session),
            _ => None,
        }
    }
}

/// Run a program to completion.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TaskMode {
    /// The file or command the runtime starts, relative to the source. With inline source
    /// it names the file the source is written to; without an entrypoint that file is
    /// `script`. Either way the Runtime's interpreter runs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub entrypoint: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1024))]
    pub args: Vec<String>,
}

impl TaskMode {
    /// What the runtime starts: the entrypoint, else [`INLINE_SCRIPT_FILE`] (the file the
    /// inline source is written to).
    pub fn program(&self) -> &str {
        self.entrypoint.as_deref().unwrap_or(INLINE_SCRIPT_FILE)
    }
}

/// Register a handler once and invoke it many times.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FunctionMode {
    /// The handler to call, for example `main.handle`.
    #[schemars(length(min = 1, max = 1024))]
    pub handler: String,
    /// End the registration after this many seconds without invocations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub idle_timeout_seconds: Option<i32>,
    /// How many invocations may run at once (1..64, default 1), each on an interpreter of
    /// its own; one more is refused with 429. The Run holds this many times its
    /// `resources.requests.runs` slots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub concurrency: Option<i32>,
}

/// A stateful agent sandbox that takes ordered operations until released.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionMode {
    /// End the session when no connection heartbeat arrives for this long.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub lease_timeout_seconds: Option<i32>,
    /// Queued mutations at most (1..32; a Run may only lower the platform limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 32))]
    pub queue_size: Option<i32>,
    /// The longest one operation may run (at most 5m).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DURATION), extend("x-kubernetes-validations" = [
        {"rule": "duration(self) > duration('0s') && duration(self) <= duration('5m')", "message": "must be greater than zero and at most 5m"}
    ]))]
    pub operation_timeout: Option<String>,
    /// End the session (Timeout/IdleTimeout) after this long without a mutation (an
    /// accepted operation or file write), for example "30m". It may only lower the
    /// controller-manager's idle TTL (`--session-idle-ttl`, default 168h): a longer one is
    /// clamped to it, and a disabled TTL (`0`) disables this too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DURATION), extend("x-kubernetes-validations" = [
        {"rule": "duration(self) >= duration('1s') && duration(self) <= duration('2562047h')", "message": "must be at least 1s and at most 2562047h (leave it out for the platform's idle TTL)"}
    ]))]
    pub idle_timeout: Option<String>,
    /// Suspend the session after this long with an empty queue and no mutation (an
    /// accepted operation, an upload, a file write; reads, listings and heartbeats do not
    /// count), for example "15m"; at least [`MIN_AUTO_SUSPEND_AFTER_SECS`] (1s). The owner
    /// sets `spec.suspend: true` with the [`crate::lifecycle::AUTO_SUSPENDED_ANNOTATION`]
    /// marker, and the next authorized call through the gateway wakes the session (503
    /// `SessionWaking` with `Retry-After` until it is Ready again). With it set, an expired
    /// lease suspends the session instead of ending it. Every suspend costs a capture of
    /// the workspace (about 100 ms for a small one, more for a large one): a short value
    /// on a session used in bursts pays it each time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DURATION), extend("x-kubernetes-validations" = [
        {"rule": "duration(self) >= duration('1s') && duration(self) <= duration('2562047h')", "message": "must be at least 1s and at most 2562047h (leave it out to never suspend on idle)"}
    ]))]
    pub auto_suspend_after: Option<String>,
    /// What happens when the session's worker is lost: `Fail` (the default) ends it as
    /// today; `ResumeFromSnapshot` resumes it elsewhere from its last Snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_worker_loss: Option<WorkerLossPolicy>,
    /// The machine's lifetime class in the machines view (design document
    /// `fn/machines/machines.go`): `Exec` (seconds, no project volume, shares workers,
    /// any number per project at once; what a session without the field is), `Dev`
    /// (hours, the project's Workspace in `spec.workspace`, exclusive per project: the
    /// Run is named after the Workspace). `Desktop` (Dev with a display) is refused: this
    /// version has no display. Immutable, as all of `spec.mode`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self != 'Desktop'", "message": "Desktop needs a display, which kruntimes sessions do not have; use Exec or Dev"}
    ]))]
    pub class: Option<SessionClass>,
}

/// `spec.mode.session.class`: the lifetime of a machine, not the workload on it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum SessionClass {
    /// Seconds; no project volume; concurrent, any number per project.
    #[default]
    Exec,
    /// Hours; the project's Workspace; exclusive per project.
    Dev,
    /// Dev with a display. Not available yet.
    Desktop,
}

/// The shortest `spec.mode.session.autoSuspendAfter`: one second (the cost of a short
/// value is a capture per idle period, the user's choice; tests use it).
pub const MIN_AUTO_SUSPEND_AFTER_SECS: u64 = 1;

/// `spec.mode.session.onWorkerLoss`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum WorkerLossPolicy {
    /// The session ends Failed (WorkerLost), as a Run without the field does.
    #[default]
    Fail,
    /// The session resumes on another worker from its last Ready Snapshot; without one it
    /// fails.
    ResumeFromSnapshot,
}

/// Where the Run's code comes from.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunSource {
    /// The program text itself, at most 256 KiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 262144))]
    pub inline: Option<String>,
    /// A session that starts from this Snapshot's files (a fork): it must be Ready, and
    /// `uid`, when set, pins the exact capture. With `spec.suspend: true` the session is
    /// created Suspended to it and takes no slot until it is resumed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<crate::snapshot::ObjectReference>,
}

/// An artifact copied into the workspace.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ArtifactInput {
    /// An `artifactRefs[].uri` of the Runtime's ArtifactStore.
    #[schemars(length(min = 1, max = 4096))]
    pub uri: String,
    /// Where it goes, relative to the workspace.
    #[schemars(length(min = 1, max = 1024), regex(pattern = RELATIVE_PATH))]
    pub path: String,
}

/// One environment variable.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnvVar {
    #[schemars(
        length(min = 1, max = 256),
        regex(pattern = r"^[A-Za-z_][A-Za-z0-9_]*$")
    )]
    pub name: String,
    #[serde(default)]
    pub value: String,
}

/// How failed attempts are retried.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RetryPolicy {
    /// Attempts in all, the first one included (1..100).
    #[schemars(range(min = 1, max = 100))]
    pub max_attempts: i32,
    /// Seconds to wait before the next attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub backoff_seconds: Option<i32>,
}

/// How a Run is asked to end.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum TerminationMode {
    /// Finish accepted work, export artifacts, then succeed (sessions only).
    Drain,
    /// Stop at once and end as Cancelled.
    Immediate,
}

/// A monotonic request to end the Run.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Termination {
    pub mode: TerminationMode,
}

/// What a Run consumes of its worker.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunResources {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests: Option<RunRequests>,
    /// The Run needs a worker to itself (sessions only): it is placed only on a worker
    /// that holds no other Run, and then holds every slot of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exclusive: Option<bool>,
}

/// Requested run slots.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunRequests {
    /// Run slots of one worker (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub runs: Option<i32>,
}

/// A reference to a project Workspace of the Run's namespace. At most 63 characters: the
/// name labels the Workspace's commits (`kruntimes.io/workspace`), and a label value has
/// at most 63.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceRef {
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
}

impl RunSpec {
    /// The Snapshot a fork starts from (`spec.source.snapshot`), if it is one.
    pub fn fork_source(&self) -> Option<&crate::snapshot::ObjectReference> {
        self.source.as_ref()?.snapshot.as_ref()
    }

    /// Whether the Run is a fork: a session that starts from a Snapshot.
    pub fn is_fork(&self) -> bool {
        self.fork_source().is_some()
    }

    /// A task Run on `runtime` that starts `entrypoint`, every other field unset.
    pub fn task(runtime: impl Into<String>, entrypoint: impl Into<String>) -> RunSpec {
        RunSpec {
            runtime: runtime.into(),
            mode: RunMode {
                task: Some(TaskMode {
                    entrypoint: Some(entrypoint.into()),
                    args: Vec::new(),
                }),
                ..RunMode::default()
            },
            source: None,
            env: None,
            timeout: None,
            retry_policy: None,
            termination: None,
            ttl_seconds_after_finished: None,
            artifact_inputs: Vec::new(),
            resources: None,
            workspace: None,
            suspend: None,
        }
    }

    /// Whether the user asks the Run to be suspended (`spec.suspend: true`).
    pub fn suspend_requested(&self) -> bool {
        self.suspend == Some(true)
    }

    /// Run slots this Run takes on its worker: `resources.requests.runs`, default 1.
    pub fn requested_runs(&self) -> i32 {
        self.resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .and_then(|r| r.runs)
            .unwrap_or(1)
    }

    /// Invocations a function Run may run at once: `mode.function.concurrency`, default 1;
    /// 1 for the other modes.
    pub fn function_concurrency(&self) -> i32 {
        self.mode
            .function
            .as_ref()
            .and_then(|f| f.concurrency)
            .unwrap_or(1)
            .max(1)
    }

    /// Whether the Run asks for a worker to itself (`resources.exclusive`).
    pub fn is_exclusive(&self) -> bool {
        self.resources
            .as_ref()
            .and_then(|r| r.exclusive)
            .unwrap_or(false)
    }
}

/// What the control plane observed of a Run.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(oldSelf.phase) || !(oldSelf.phase in ['Succeeded', 'Failed', 'Timeout', 'Cancelled']) || (has(self.phase) && self.phase == oldSelf.phase)", "message": "a terminal phase is final", "fieldPath": ".phase"},
    {"rule": "!has(self.phase) || self.phase != 'Suspended' || has(self.snapshot)", "message": "a Suspended Run names the snapshot it resumes from", "fieldPath": ".snapshot"},
    {"rule": "!has(self.phase) || self.phase != 'Suspended' || (has(oldSelf.phase) && (oldSelf.phase in ['Ready', 'Suspended'] || (oldSelf.phase in ['Pending', 'Scheduled'] && has(oldSelf.snapshot))))", "message": "Suspended is entered from Ready, or from Pending or Scheduled with a snapshot", "fieldPath": ".phase"},
    {"rule": "!has(oldSelf.phase) || oldSelf.phase != 'Suspended' || (has(self.phase) && self.phase in ['Suspended', 'Pending', 'Succeeded', 'Failed', 'Timeout', 'Cancelled'])", "message": "a Suspended Run is resumed to Pending or ends", "fieldPath": ".phase"}
]))]
pub struct RunStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<RunCondition>,
    /// The current attempt, from 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<i32>,
    /// How many of the attempts so far ended because their worker shut down gracefully
    /// (reason `WorkerRestarted`): each advanced `attempt`, so a late write of the old
    /// registration is fenced off, but none counts against `retryPolicy.maxAttempts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub worker_restarts: Option<i32>,
    /// RFC 3339 time the current attempt started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<String>,
    /// RFC 3339 time the Run reached a terminal phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assigned_pod: Option<String>,
    #[serde(
        rename = "assignedPodUID",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub assigned_pod_uid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<RunEndpoint>,
    /// Bounded results: at most 64 keys of at most 128 bytes, values of at most 8 KiB, 64 KiB in all.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 64, "x-kubernetes-validations" = [
        {"rule": "self.all(k, size(k) <= 128 && size(self[k]) <= 8192)", "message": "output keys are at most 128 bytes and values at most 8 KiB"}
    ]))]
    pub outputs: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub artifact_refs: Vec<ArtifactRef>,
    /// What the owner records of a session Run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<SessionStatus>,
    /// The session's incarnation: 1 when it is first placed, one more on each resume. A
    /// registration is fenced by it beside `attempt` and the assigned Pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub incarnation: Option<i64>,
    /// The Snapshot the session was suspended to, kept while it is resumed so that a
    /// placement can prefer the worker that holds a local copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<RunSnapshotRef>,
}

/// `status.snapshot` of a session Run: the Snapshot it was suspended to.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunSnapshotRef {
    /// The Snapshot object, in the Run's namespace.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Where its data lives (the Snapshot's `status.location.uri`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub uri: Option<String>,
    /// The session's last operation sequence number at capture.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub last_sequence: Option<i64>,
}

/// What the owner runtimed records of a session Run.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionStatus {
    /// RFC 3339 time of the session's last mutation (an accepted operation, an operation's
    /// end, a file write), written by the owner at most once per its activity interval
    /// (runtimed's `--session-activity-interval`, 1m by default); reads, listings and
    /// heartbeats do not count. Idle expiry counts from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_activity_time: Option<String>,
}

/// A condition in the Kubernetes style (`Ready`, `Scheduled`, …).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunCondition {
    #[serde(rename = "type")]
    pub type_: String,
    /// "True", "False" or "Unknown".
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// How clients reach a Ready function or session.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunEndpoint {
    pub protocol: EndpointProtocol,
    #[schemars(length(max = 2048))]
    pub url: String,
    /// PEM CA bundle that verifies the endpoint, at most 16 KiB: bytes, which JSON carries as
    /// base64 (the design's `CABundle []byte`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "ca_bundle_schema")]
    pub ca_bundle: Option<ByteString>,
}

/// `status.endpoint.caBundle`: a base64 string (`format: byte`, which CEL sees as bytes) of at
/// most 16 KiB decoded. `maxLength` bounds the text; the rule bounds the bytes.
fn ca_bundle_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "format": "byte",
        "nullable": true,
        "maxLength": MAX_CA_BUNDLE_BASE64_CHARS,
        "x-kubernetes-validations": [
            {"rule": "size(self) <= 16384", "message": "the CA bundle is at most 16 KiB"}
        ]
    })
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum EndpointProtocol {
    #[serde(rename = "HTTP")]
    Http,
    #[serde(rename = "HTTPS")]
    Https,
}

/// A compact reference to an exported artifact.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ArtifactRef {
    pub name: String,
    pub uri: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

impl Run {
    /// The Run's incarnation: `status.incarnation`, 1 before it is first placed.
    pub fn incarnation(&self) -> i64 {
        self.status
            .as_ref()
            .and_then(|s| s.incarnation)
            .unwrap_or(1)
            .max(1)
    }

    /// The Run's phase; a Run without status is Pending.
    pub fn phase(&self) -> Phase {
        self.status
            .as_ref()
            .and_then(|s| s.phase)
            .unwrap_or(Phase::Pending)
    }
}
