//! Admission rules for Runs, as pure functions.
//!
//! The embedded API server calls [`validate_create`] on create and [`validate_update`] on
//! every update and patch of the main resource, and [`validate_status`] on status writes.
//! A non-empty result is answered with 422 Invalid and one cause per [`FieldError`].
//! The CRD carries the same rules as CEL (see [`crate::run`]).

use crate::duration;
use crate::phase::Phase;
use crate::run::{
    MAX_CA_BUNDLE_BYTES, MAX_ENDPOINT_URL_BYTES, MAX_ENTRYPOINT_BYTES, MAX_ENV_VARS,
    MAX_FUNCTION_CONCURRENCY, MAX_INLINE_SOURCE_BYTES, MAX_OUTPUT_KEY_BYTES, MAX_OUTPUT_KEYS,
    MAX_OUTPUT_VALUE_BYTES, MAX_OUTPUTS_TOTAL_BYTES, MAX_RETRY_ATTEMPTS,
    MAX_SESSION_OPERATION_TIMEOUT_SECS, MAX_SESSION_QUEUE_SIZE, MAX_TASK_ARGS,
    MIN_AUTO_SUSPEND_AFTER_SECS, ModeKind, RunSpec, RunStatus, SessionClass, TerminationMode,
};
use crate::snapshot::{
    MAX_SNAPSHOT_MESSAGE_BYTES, MAX_SNAPSHOT_URI_BYTES, SnapshotReason, SnapshotSpec,
    SnapshotStatus,
};

/// The Kubernetes cause reasons admission uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CauseReason {
    Required,
    Invalid,
    Forbidden,
    TooLong,
    TooMany,
}

impl CauseReason {
    /// The `details.causes[].reason` string Kubernetes writes.
    pub fn as_str(self) -> &'static str {
        match self {
            CauseReason::Required => "FieldValueRequired",
            CauseReason::Invalid => "FieldValueInvalid",
            CauseReason::Forbidden => "FieldValueForbidden",
            CauseReason::TooLong => "FieldValueTooLong",
            CauseReason::TooMany => "FieldValueTooMany",
        }
    }
}

/// One refused field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// The field path, as `spec.mode.task.entrypoint`.
    pub field: String,
    pub reason: CauseReason,
    pub message: String,
}

impl FieldError {
    fn new(field: impl Into<String>, reason: CauseReason, message: impl Into<String>) -> Self {
        FieldError {
            field: field.into(),
            reason,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// The rules for a new Run: exactly one mode, Drain only for sessions, no workspace for
/// sessions, and every bound.
pub fn validate_create(spec: &RunSpec) -> Vec<FieldError> {
    let mut errors = Vec::new();
    validate_spec(spec, &mut errors);
    errors
}

/// The rule of a new Run that needs its name: a session that mounts a Workspace is named
/// after it, so that the Run's name is the Workspace's lock (design document 002): a second
/// session of the Workspace is refused by the API server itself while the first exists.
/// The CRD says the same at its root ([`crate::crds::WORKSPACE_LOCK_RULE`]).
pub fn validate_workspace_lock(run_name: &str, spec: &RunSpec) -> Vec<FieldError> {
    match &spec.workspace {
        Some(workspace) if workspace.name != run_name => vec![FieldError::new(
            "spec.workspace.name",
            CauseReason::Invalid,
            format!(
                "a session that mounts a Workspace must be named after it: the Run's name is \
                 the Workspace's lock (name the Run {:?})",
                workspace.name
            ),
        )],
        _ => Vec::new(),
    }
}

/// The rules for a Workspace's spec: `history` between 1 and 100, a positive
/// `ttlSecondsAfterUnused`.
pub fn validate_workspace(spec: &crate::workspace::WorkspaceSpec) -> Vec<FieldError> {
    let mut errors = Vec::new();
    if spec
        .history
        .is_some_and(|h| !(1..=crate::workspace::MAX_HISTORY).contains(&h))
    {
        errors.push(FieldError::new(
            "spec.history",
            CauseReason::Invalid,
            format!("must be between 1 and {}", crate::workspace::MAX_HISTORY),
        ));
    }
    if spec.ttl_seconds_after_unused.is_some_and(|t| t < 1) {
        errors.push(positive("spec.ttlSecondsAfterUnused"));
    }
    errors
}

/// The rules for a write of a Workspace's status: `commits` never decreases (a write from
/// an older view cannot take the head back).
pub fn validate_workspace_status(
    old: Option<&crate::workspace::WorkspaceStatus>,
    new: Option<&crate::workspace::WorkspaceStatus>,
) -> Vec<FieldError> {
    let before = old.and_then(|s| s.commits);
    let after = new.and_then(|s| s.commits);
    match (before, after) {
        (Some(before), after) if after.is_none_or(|after| after < before) => {
            vec![FieldError::new(
                "status.commits",
                CauseReason::Invalid,
                "status.commits never decreases",
            )]
        }
        _ => Vec::new(),
    }
}

/// The rules for a changed Run: everything [`validate_create`] checks on the new spec, plus
/// immutable execution inputs and monotonic termination. `ttlSecondsAfterFinished` and
/// `suspend` (sessions only, checked by [`validate_create`]'s rules) stay mutable.
pub fn validate_update(old: &RunSpec, new: &RunSpec) -> Vec<FieldError> {
    let mut errors = Vec::new();
    let immutable = "field is immutable";
    if old.runtime != new.runtime {
        errors.push(FieldError::new(
            "spec.runtime",
            CauseReason::Invalid,
            immutable,
        ));
    }
    if old.mode != new.mode {
        errors.push(FieldError::new(
            "spec.mode",
            CauseReason::Invalid,
            immutable,
        ));
    }
    if old.source != new.source {
        errors.push(FieldError::new(
            "spec.source",
            CauseReason::Invalid,
            immutable,
        ));
    }
    if old.env != new.env {
        errors.push(FieldError::new("spec.env", CauseReason::Invalid, immutable));
    }
    if old.artifact_inputs != new.artifact_inputs {
        errors.push(FieldError::new(
            "spec.artifactInputs",
            CauseReason::Invalid,
            immutable,
        ));
    }
    if old.timeout != new.timeout {
        errors.push(FieldError::new(
            "spec.timeout",
            CauseReason::Invalid,
            immutable,
        ));
    }
    if old.retry_policy != new.retry_policy {
        errors.push(FieldError::new(
            "spec.retryPolicy",
            CauseReason::Invalid,
            immutable,
        ));
    }
    if old.resources != new.resources {
        // The scheduler and the local gate count what a Run holds from its spec.
        errors.push(FieldError::new(
            "spec.resources",
            CauseReason::Invalid,
            immutable,
        ));
    }
    let old_mode = old.termination.as_ref().map(|t| t.mode);
    let new_mode = new.termination.as_ref().map(|t| t.mode);
    let allowed = match (old_mode, new_mode) {
        (None, _) => true,
        (
            Some(TerminationMode::Drain),
            Some(TerminationMode::Drain | TerminationMode::Immediate),
        ) => true,
        (Some(TerminationMode::Immediate), Some(TerminationMode::Immediate)) => true,
        (Some(TerminationMode::Immediate), Some(TerminationMode::Drain)) => false,
        (Some(_), None) => false,
    };
    if !allowed {
        errors.push(FieldError::new(
            "spec.termination",
            CauseReason::Forbidden,
            "termination may only move from absent to Drain to Immediate; it is never removed or downgraded",
        ));
    }
    validate_spec(new, &mut errors);
    errors
}

/// The rules of a status write against the status it replaces: a terminal phase is final
/// (only the first writer of an end decides it; a later writer, a retry or a stale worker,
/// is refused instead of reviving or relabelling the Run), and a Run enters and leaves
/// Suspended only as [`crate::lifecycle::suspend_transition_allowed`] says (entering it
/// needs `status.snapshot`).
pub fn validate_status_update(old: Option<&RunStatus>, new: Option<&RunStatus>) -> Vec<FieldError> {
    let old_phase = old.and_then(|s| s.phase).unwrap_or(Phase::Pending);
    let new_phase = new.and_then(|s| s.phase).unwrap_or(Phase::Pending);
    let had_snapshot = old.is_some_and(|s| s.snapshot.is_some());
    let has_snapshot = new.is_some_and(|s| s.snapshot.is_some());
    if new_phase == Phase::Suspended && old_phase != Phase::Suspended && !has_snapshot {
        return vec![FieldError::new(
            "status.snapshot",
            CauseReason::Required,
            "Required value: a Run is Suspended only with status.snapshot, the Snapshot it \
             resumes from",
        )];
    }
    if !old_phase.is_terminal()
        && !crate::lifecycle::suspend_transition_allowed(old_phase, new_phase, had_snapshot)
    {
        return vec![FieldError::new(
            "status.phase",
            CauseReason::Forbidden,
            format!(
                "a Run may not move from {} to {}: Suspended is entered from Ready (or from \
                 Pending or Scheduled with a snapshot) and left to Pending or a terminal phase",
                old_phase.as_str(),
                new_phase.as_str()
            ),
        )];
    }
    if old_phase.is_terminal() && new_phase != old_phase {
        return vec![FieldError::new(
            "status.phase",
            CauseReason::Forbidden,
            format!(
                "the Run ended {}; a terminal phase is final (refused: {})",
                old_phase.as_str(),
                new_phase.as_str()
            ),
        )];
    }
    Vec::new()
}

/// Bounds on a status write: endpoint URL and CA bundle sizes, the output limits, and the
/// suspension fields (`incarnation` at least 1, a named `snapshot`).
pub fn validate_status(status: &RunStatus) -> Vec<FieldError> {
    let mut errors = Vec::new();
    if status.incarnation.is_some_and(|i| i < 1) {
        errors.push(positive("status.incarnation"));
    }
    if let Some(snapshot) = &status.snapshot {
        if snapshot.name.is_empty() {
            errors.push(FieldError::new(
                "status.snapshot.name",
                CauseReason::Required,
                "Required value",
            ));
        } else if !is_dns1123_subdomain(&snapshot.name) {
            errors.push(FieldError::new(
                "status.snapshot.name",
                CauseReason::Invalid,
                "must be a DNS-1123 subdomain",
            ));
        }
        if snapshot
            .uri
            .as_ref()
            .is_some_and(|u| u.len() > MAX_SNAPSHOT_URI_BYTES)
        {
            errors.push(too_long("status.snapshot.uri", MAX_SNAPSHOT_URI_BYTES));
        }
        if snapshot.last_sequence.is_some_and(|s| s < 0) {
            errors.push(non_negative("status.snapshot.lastSequence"));
        }
    }
    if let Some(endpoint) = &status.endpoint {
        if endpoint.url.len() > MAX_ENDPOINT_URL_BYTES {
            errors.push(too_long("status.endpoint.url", MAX_ENDPOINT_URL_BYTES));
        }
        if let Some(ca) = &endpoint.ca_bundle
            && ca.0.len() > MAX_CA_BUNDLE_BYTES
        {
            errors.push(too_long("status.endpoint.caBundle", MAX_CA_BUNDLE_BYTES));
        }
    }
    if status.outputs.len() > MAX_OUTPUT_KEYS {
        errors.push(FieldError::new(
            "status.outputs",
            CauseReason::TooMany,
            format!("must have at most {MAX_OUTPUT_KEYS} keys"),
        ));
    }
    let mut total = 0usize;
    for (key, value) in &status.outputs {
        total += key.len() + value.len();
        if key.is_empty() || key.len() > MAX_OUTPUT_KEY_BYTES {
            errors.push(FieldError::new(
                format!("status.outputs[{}]", bounded(key)),
                CauseReason::Invalid,
                format!("keys must be 1 to {MAX_OUTPUT_KEY_BYTES} bytes"),
            ));
        }
        if value.len() > MAX_OUTPUT_VALUE_BYTES {
            errors.push(too_long(
                format!("status.outputs[{}]", bounded(key)),
                MAX_OUTPUT_VALUE_BYTES,
            ));
        }
    }
    if total > MAX_OUTPUTS_TOTAL_BYTES {
        errors.push(too_long("status.outputs", MAX_OUTPUTS_TOTAL_BYTES));
    }
    errors
}

/// The rules for a Runtime (create and update): `spec.scaling` needs
/// `0 < minReplicas <= maxReplicas` and `warmRuns >= 0`.
pub fn validate_runtime(spec: &crate::RuntimeSpec) -> Vec<FieldError> {
    let mut errors = Vec::new();
    if spec.replicas < 0 {
        errors.push(non_negative("spec.replicas"));
    }
    if let Some(scaling) = &spec.scaling {
        if scaling.min_replicas < 1 {
            errors.push(positive("spec.scaling.minReplicas"));
        }
        if scaling.max_replicas < scaling.min_replicas {
            errors.push(FieldError::new(
                "spec.scaling.maxReplicas",
                CauseReason::Invalid,
                format!(
                    "must be at least spec.scaling.minReplicas ({})",
                    scaling.min_replicas
                ),
            ));
        }
        if scaling.warm_runs.is_some_and(|w| w < 0) {
            errors.push(non_negative("spec.scaling.warmRuns"));
        }
        if scaling.scale_down_delay_seconds.is_some_and(|s| s < 0) {
            errors.push(non_negative("spec.scaling.scaleDownDelaySeconds"));
        }
    }
    if let Some(store) = &spec.artifact_store {
        validate_artifact_store(store, &mut errors);
    }
    validate_template(&spec.template, &mut errors);
    errors
}

/// The rules for a Runtime's Pod template that the provisioners rely on: a `spec` has a
/// container named `runtime` (it runs the runtime server), container names are unique
/// and none is one the provisioners add (`runtimed`, or `runtime` among the init
/// containers, where the provisioner puts it), no volume takes a name they add, and the
/// runtime container's variables are C identifiers. No token of the Pod's account
/// reaches the template's containers: the Pod never automounts one, no container mounts
/// runtimed's (`runtimed-token`), and no volume projects one of its own.
pub fn validate_template(
    template: &k8s_openapi::api::core::v1::PodTemplateSpec,
    errors: &mut Vec<FieldError>,
) {
    use crate::runtime::{
        RESERVED_CONTAINERS, RESERVED_VOLUMES, RUNTIME_CONTAINER, RUNTIME_SHARED_DIR,
        WORKER_TLS_SECRET,
    };
    // The provisioners' own labels and annotations (the selector, `kruntimes.io/retiring`).
    if let Some(meta) = &template.metadata {
        for (field, keys) in [("labels", &meta.labels), ("annotations", &meta.annotations)] {
            for key in keys.iter().flatten().map(|(k, _)| k) {
                if key.starts_with("kruntimes.io/") {
                    errors.push(FieldError::new(
                        format!("spec.template.metadata.{field}"),
                        CauseReason::Invalid,
                        format!(
                            "{:?}: the kruntimes.io/ prefix is the provisioner's",
                            bounded(key)
                        ),
                    ));
                }
            }
        }
    }
    let Some(pod) = &template.spec else {
        return;
    };
    let at = "spec.template.spec";
    // A shared PID or IPC namespace would let user code reach runtimed's files (its
    // token) through /proc.
    for (field, set) in [
        ("shareProcessNamespace", pod.share_process_namespace),
        ("hostPID", pod.host_pid),
        ("hostIPC", pod.host_ipc),
    ] {
        if set == Some(true) {
            errors.push(FieldError::new(
                format!("{at}.{field}"),
                CauseReason::Forbidden,
                "a worker Pod's containers never share a process or IPC namespace with \
                 runtimed or the host",
            ));
        }
    }
    let mut names = std::collections::BTreeSet::new();
    let init = pod.init_containers.iter().flatten();
    for (field, i, container) in pod
        .containers
        .iter()
        .enumerate()
        .map(|(i, c)| ("containers", i, c))
        .chain(init.enumerate().map(|(i, c)| ("initContainers", i, c)))
    {
        for (j, port) in container.ports.iter().flatten().enumerate() {
            let name = port.name.as_deref().unwrap_or_default();
            if matches!(name, "runtimed" | "health") {
                errors.push(FieldError::new(
                    format!("{at}.{field}[{i}].ports[{j}].name"),
                    CauseReason::Invalid,
                    format!("{name:?} is the name of a port of runtimed"),
                ));
            }
        }
        for (j, mount) in container.volume_mounts.iter().flatten().enumerate() {
            if container.name == RUNTIME_CONTAINER && mount.mount_path == RUNTIME_SHARED_DIR {
                errors.push(FieldError::new(
                    format!("{at}.{field}[{i}].volumeMounts[{j}].mountPath"),
                    CauseReason::Invalid,
                    format!(
                        "{RUNTIME_SHARED_DIR} is where the provisioner mounts the shared volume"
                    ),
                ));
            }
            // The shared volume may be mounted again; runtimed's token and CA may not.
            if RESERVED_VOLUMES.contains(&mount.name.as_str()) && mount.name != "kruntimes" {
                errors.push(FieldError::new(
                    format!("{at}.{field}[{i}].volumeMounts[{j}].name"),
                    CauseReason::Forbidden,
                    format!("{:?} is runtimed's own volume", bounded(&mount.name)),
                ));
            }
        }
        let name = &container.name;
        let reserved = RESERVED_CONTAINERS.contains(&name.as_str())
            || (field == "initContainers" && name == RUNTIME_CONTAINER);
        if reserved {
            errors.push(FieldError::new(
                format!("{at}.{field}[{i}].name"),
                CauseReason::Invalid,
                format!(
                    "{:?} is the name of a container the provisioner adds",
                    bounded(name)
                ),
            ));
        } else if !names.insert(name.as_str()) {
            errors.push(FieldError::new(
                format!("{at}.{field}[{i}].name"),
                CauseReason::Invalid,
                format!("{:?} names two containers", bounded(name)),
            ));
        }
    }
    match pod
        .containers
        .iter()
        .position(|c| c.name == RUNTIME_CONTAINER)
    {
        Some(i) => {
            let env = pod.containers[i].env.iter().flatten();
            for (j, var) in env.enumerate() {
                if !is_env_name(&var.name) {
                    errors.push(env_name(&format!("{at}.containers[{i}]"), j));
                } else if var.name.starts_with("KRUNTIMES_RUNTIME_") {
                    errors.push(FieldError::new(
                        format!("{at}.containers[{i}].env[{j}].name"),
                        CauseReason::Invalid,
                        "KRUNTIMES_RUNTIME_* variables are set by the provisioner",
                    ));
                }
            }
        }
        None => errors.push(FieldError::new(
            format!("{at}.containers"),
            CauseReason::Required,
            "must include a container named \"runtime\": it runs the runtime server",
        )),
    }
    let mut volumes = std::collections::BTreeSet::new();
    for (i, volume) in pod.volumes.iter().flatten().enumerate() {
        if !volumes.insert(volume.name.as_str()) {
            errors.push(FieldError::new(
                format!("{at}.volumes[{i}].name"),
                CauseReason::Invalid,
                format!("{:?} names two volumes", bounded(&volume.name)),
            ));
        }
        let sources = volume
            .projected
            .iter()
            .flat_map(|p| p.sources.iter().flatten());
        let worker_key = "the workers' TLS key is runtimed's: no volume of the template may \
                          hold it";
        for (j, source) in sources.enumerate() {
            if source.service_account_token.is_some() {
                errors.push(FieldError::new(
                    format!("{at}.volumes[{i}].projected.sources[{j}].serviceAccountToken"),
                    CauseReason::Forbidden,
                    "a worker Pod's account is runtimed's: no volume of the template may \
                     hold a token of it",
                ));
            }
            if source.secret.as_ref().map(|s| s.name.as_str()) == Some(WORKER_TLS_SECRET) {
                errors.push(FieldError::new(
                    format!("{at}.volumes[{i}].projected.sources[{j}].secret.name"),
                    CauseReason::Forbidden,
                    worker_key,
                ));
            }
        }
        if volume
            .secret
            .as_ref()
            .and_then(|s| s.secret_name.as_deref())
            == Some(WORKER_TLS_SECRET)
        {
            errors.push(FieldError::new(
                format!("{at}.volumes[{i}].secret.secretName"),
                CauseReason::Forbidden,
                worker_key,
            ));
        }
        if RESERVED_VOLUMES.contains(&volume.name.as_str()) {
            errors.push(FieldError::new(
                format!("{at}.volumes[{i}].name"),
                CauseReason::Invalid,
                format!(
                    "{:?} is the name of a volume the provisioner adds",
                    bounded(&volume.name)
                ),
            ));
        }
    }
    if pod.automount_service_account_token == Some(true) {
        errors.push(FieldError::new(
            format!("{at}.automountServiceAccountToken"),
            CauseReason::Forbidden,
            "a worker Pod never automounts a token: the runtime container runs user code, \
             and only runtimed gets one (through its own projected volume)",
        ));
    }
}

/// Why a Runtime's name is refused.
pub const RUNTIME_NAME_RULE: &str = "a Runtime's name must be a DNS-1123 label (lower-case \
     letters, digits and '-', at most 63 characters): Runs name it in spec.runtime, and its \
     workers carry it as a label value";

/// The rule for a new Runtime's name (`name`, or a name that `generateName` may give):
/// a DNS-1123 label.
pub fn validate_runtime_name(name: &str) -> Vec<FieldError> {
    if is_dns1123_label(name) {
        return Vec::new();
    }
    vec![FieldError::new(
        "metadata.name",
        CauseReason::Invalid,
        RUNTIME_NAME_RULE,
    )]
}

/// The longest `spec.artifactStore.s3.prefix`.
pub const MAX_S3_PREFIX_BYTES: usize = 512;
/// The longest `spec.artifactStore.s3.endpoint` (ARCHITECTURE.md, "Limits").
pub const MAX_ENDPOINT_BYTES: usize = 2048;

/// `spec.artifactStore`: exactly one driver, each well-formed.
fn validate_artifact_store(
    store: &crate::runtime::ArtifactStoreSpec,
    errors: &mut Vec<FieldError>,
) {
    match (&store.filesystem, &store.s3) {
        (Some(_), Some(_)) | (None, None) => errors.push(FieldError::new(
            "spec.artifactStore",
            CauseReason::Invalid,
            "exactly one driver must be set: filesystem or s3",
        )),
        _ => {}
    }
    if let Some(fs) = &store.filesystem
        && (!fs.path.starts_with('/') || fs.path.len() > 4096)
    {
        errors.push(FieldError::new(
            "spec.artifactStore.filesystem.path",
            CauseReason::Invalid,
            "must be an absolute directory of at most 4096 bytes",
        ));
    }
    if let Some(s3) = &store.s3 {
        if let Err(message) = check_s3_endpoint(&s3.endpoint) {
            errors.push(FieldError::new(
                "spec.artifactStore.s3.endpoint",
                CauseReason::Invalid,
                message,
            ));
        }
        if !is_s3_bucket_name(&s3.bucket) {
            errors.push(FieldError::new(
                "spec.artifactStore.s3.bucket",
                CauseReason::Invalid,
                "must be an S3 bucket name: 3 to 63 lower-case letters, digits, '.' and '-', \
                 starting and ending with a letter or digit, not like an IP address",
            ));
        }
        if let Some(prefix) = &s3.prefix
            && !is_s3_prefix(prefix)
        {
            errors.push(FieldError::new(
                "spec.artifactStore.s3.prefix",
                CauseReason::Invalid,
                format!(
                    "must be at most {MAX_S3_PREFIX_BYTES} bytes of letters, digits and \
                     !-_.*'() in segments separated by '/', without a leading '/' or empty, '.' or \
                         '..' segments"
                ),
            ));
        }
        if let Some(region) = &s3.region {
            let ok = !region.is_empty()
                && region.len() <= 64
                && region
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
            if !ok {
                errors.push(FieldError::new(
                    "spec.artifactStore.s3.region",
                    CauseReason::Invalid,
                    "must be 1 to 64 lower-case letters, digits and '-' (as us-east-1)",
                ));
            }
        }
    }
}

/// Checks an S3 endpoint: an `https://` URL, or `http://` to a loopback address only
/// (credentials never cross a network in the clear); no user info, query or fragment.
pub fn check_s3_endpoint(endpoint: &str) -> Result<(), String> {
    if endpoint.len() > MAX_ENDPOINT_BYTES {
        return Err(format!("must be at most {MAX_ENDPOINT_BYTES} bytes"));
    }
    let (tls, rest) = if let Some(rest) = endpoint.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = endpoint.strip_prefix("http://") {
        (false, rest)
    } else {
        return Err("must be an https:// URL (or http:// to a loopback address)".to_string());
    };
    if rest
        .bytes()
        .any(|b| !b.is_ascii_graphic() || matches!(b, b'@' | b'?' | b'#' | b'\\'))
    {
        return Err(
            "must be a plain URL: no user info, query, fragment, spaces or control characters"
                .to_string(),
        );
    }
    let authority = rest.split('/').next().unwrap_or("");
    let host = if let Some(bracketed) = authority.strip_prefix('[') {
        match bracketed.split_once(']') {
            Some((host, port)) if port.is_empty() || is_port(port) => host,
            _ => return Err("has a malformed IPv6 host or port".to_string()),
        }
    } else {
        match authority.split_once(':') {
            Some((host, port)) if is_port(port) => host,
            Some(_) => return Err("has a malformed port".to_string()),
            None => authority,
        }
    };
    if host.is_empty() {
        return Err("has no host".to_string());
    }
    let loopback = host == "localhost"
        || host == "::1"
        || host
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback());
    if !tls && !loopback {
        return Err(
            "http:// is allowed only to a loopback address (localhost, 127.0.0.0/8, [::1]); use https://"
                .to_string(),
        );
    }
    Ok(())
}

fn is_port(port: &str) -> bool {
    let digits = port.strip_prefix(':').unwrap_or(port);
    !digits.is_empty() && digits.len() <= 5 && digits.parse::<u16>().is_ok_and(|p| p > 0)
}

/// An S3 bucket name (the general-purpose bucket rules): 3 to 63 characters of lower-case
/// letters, digits, `.` and `-`, beginning and ending with a letter or digit, no `..`,
/// not formatted as an IPv4 address.
pub fn is_s3_bucket_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    (3..=63).contains(&bytes.len())
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'.' || *b == b'-')
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
        && !name.contains("..")
        && !name.contains(".-")
        && !name.contains("-.")
        && name.parse::<std::net::Ipv4Addr>().is_err()
}

/// An S3 key prefix of this store: at most [`MAX_S3_PREFIX_BYTES`] bytes of the characters
/// S3 calls safe in keys (letters, digits and `!-_.*'()`), segments separated by `/` (one trailing `/` allowed), none empty,
/// `.` or `..`. Empty means none.
pub fn is_s3_prefix(prefix: &str) -> bool {
    if prefix.is_empty() {
        return true;
    }
    let trimmed = prefix.strip_suffix('/').unwrap_or(prefix);
    prefix.len() <= MAX_S3_PREFIX_BYTES
        && prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!-_.*'()/".contains(&b))
        && trimmed
            .split('/')
            .all(|segment| !segment.is_empty() && segment != "." && segment != "..")
}

fn validate_spec(spec: &RunSpec, errors: &mut Vec<FieldError>) {
    if spec.runtime.is_empty() {
        errors.push(FieldError::new(
            "spec.runtime",
            CauseReason::Required,
            "Required value",
        ));
    } else if !is_dns1123_label(&spec.runtime) {
        errors.push(FieldError::new(
            "spec.runtime",
            CauseReason::Invalid,
            "must be a DNS-1123 label: lower-case letters, digits and '-', at most 63 characters",
        ));
    }

    let kind = spec.mode.kind();
    match kind {
        None => errors.push(FieldError::new(
            "spec.mode",
            CauseReason::Invalid,
            "exactly one of task, function or session must be set",
        )),
        Some(ModeKind::Task) => {
            if let Some(task) = &spec.mode.task {
                let inline = spec.source.as_ref().is_some_and(|s| s.inline.is_some());
                match task.entrypoint.as_deref() {
                    None if !inline => errors.push(FieldError::new(
                        "spec.mode.task.entrypoint",
                        CauseReason::Required,
                        "Required value: a task needs an entrypoint unless spec.source.inline \
                         gives its program",
                    )),
                    None => {}
                    Some("") => errors.push(FieldError::new(
                        "spec.mode.task.entrypoint",
                        CauseReason::Required,
                        "Required value: must not be empty (leave it out to run \
                         spec.source.inline)",
                    )),
                    Some(entrypoint) if entrypoint.len() > MAX_ENTRYPOINT_BYTES => {
                        errors.push(too_long("spec.mode.task.entrypoint", MAX_ENTRYPOINT_BYTES))
                    }
                    Some(_) => {}
                }
                if task.args.len() > MAX_TASK_ARGS {
                    errors.push(FieldError::new(
                        "spec.mode.task.args",
                        CauseReason::TooMany,
                        format!("must have at most {MAX_TASK_ARGS} items"),
                    ));
                }
            }
        }
        Some(ModeKind::Function) => {
            if let Some(function) = &spec.mode.function {
                if function.handler.is_empty() {
                    errors.push(FieldError::new(
                        "spec.mode.function.handler",
                        CauseReason::Required,
                        "Required value",
                    ));
                }
                if function.idle_timeout_seconds.is_some_and(|s| s < 1) {
                    errors.push(positive("spec.mode.function.idleTimeoutSeconds"));
                }
                if function
                    .concurrency
                    .is_some_and(|c| !(1..=MAX_FUNCTION_CONCURRENCY).contains(&c))
                {
                    errors.push(FieldError::new(
                        "spec.mode.function.concurrency",
                        CauseReason::Invalid,
                        format!("must be between 1 and {MAX_FUNCTION_CONCURRENCY}"),
                    ));
                }
            }
        }
        Some(ModeKind::Session) => {
            if let Some(session) = &spec.mode.session {
                if session.lease_timeout_seconds.is_some_and(|s| s < 1) {
                    errors.push(positive("spec.mode.session.leaseTimeoutSeconds"));
                }
                if session
                    .queue_size
                    .is_some_and(|q| !(1..=MAX_SESSION_QUEUE_SIZE).contains(&q))
                {
                    errors.push(FieldError::new(
                        "spec.mode.session.queueSize",
                        CauseReason::Invalid,
                        format!("must be between 1 and {MAX_SESSION_QUEUE_SIZE}"),
                    ));
                }
                if let Some(text) = &session.operation_timeout {
                    match duration::parse(text) {
                        Ok(d) if d.is_zero() => {
                            errors.push(positive("spec.mode.session.operationTimeout"))
                        }
                        Ok(d) if d.as_secs_f64() > MAX_SESSION_OPERATION_TIMEOUT_SECS as f64 => {
                            errors.push(FieldError::new(
                                "spec.mode.session.operationTimeout",
                                CauseReason::Invalid,
                                "must be at most 5m",
                            ))
                        }
                        Ok(_) => {}
                        Err(e) => errors.push(FieldError::new(
                            "spec.mode.session.operationTimeout",
                            CauseReason::Invalid,
                            e.to_string(),
                        )),
                    }
                }
                match session.class {
                    None | Some(SessionClass::Exec) => {}
                    Some(SessionClass::Dev) if spec.workspace.is_none() => {
                        errors.push(FieldError::new(
                            "spec.workspace",
                            CauseReason::Required,
                            "Required value: a Dev machine needs its project's Workspace \
                             (spec.workspace)",
                        ))
                    }
                    Some(SessionClass::Dev) => {}
                    Some(SessionClass::Desktop) => errors.push(FieldError::new(
                        "spec.mode.session.class",
                        CauseReason::Forbidden,
                        "Desktop needs a display, which kruntimes sessions do not have; use \
                         Exec or Dev",
                    )),
                }
                if let Some(text) = &session.auto_suspend_after {
                    match duration::parse(text) {
                        Ok(d)
                            if d < std::time::Duration::from_secs(MIN_AUTO_SUSPEND_AFTER_SECS) =>
                        {
                            errors.push(FieldError::new(
                                "spec.mode.session.autoSuspendAfter",
                                CauseReason::Invalid,
                                "must be at least 1s (leave it out to never suspend on idle)",
                            ))
                        }
                        Ok(_) => {}
                        Err(e) => errors.push(FieldError::new(
                            "spec.mode.session.autoSuspendAfter",
                            CauseReason::Invalid,
                            e.to_string(),
                        )),
                    }
                }
                if let Some(text) = &session.idle_timeout {
                    match duration::parse(text) {
                        Ok(d) if d < std::time::Duration::from_secs(1) => {
                            errors.push(FieldError::new(
                                "spec.mode.session.idleTimeout",
                                CauseReason::Invalid,
                                "must be at least 1s (leave it out for the platform's idle TTL)",
                            ))
                        }
                        Ok(_) => {}
                        Err(e) => errors.push(FieldError::new(
                            "spec.mode.session.idleTimeout",
                            CauseReason::Invalid,
                            e.to_string(),
                        )),
                    }
                }
            }
        }
    }

    if let Some(termination) = &spec.termination
        && termination.mode == TerminationMode::Drain
        && kind != Some(ModeKind::Session)
    {
        errors.push(FieldError::new(
            "spec.termination.mode",
            CauseReason::Forbidden,
            "Drain is only valid for session Runs; use Immediate",
        ));
    }
    if spec.suspend.is_some() && kind != Some(ModeKind::Session) {
        errors.push(FieldError::new(
            "spec.suspend",
            CauseReason::Forbidden,
            "spec.suspend is only valid for session Runs: a task or function has no state to \
             capture; end it with spec.termination instead",
        ));
    }
    if let Some(workspace) = &spec.workspace {
        if kind != Some(ModeKind::Session) {
            errors.push(FieldError::new(
                "spec.workspace",
                CauseReason::Forbidden,
                "only a session mounts a Workspace",
            ));
        }
        if spec.is_fork() {
            errors.push(FieldError::new(
                "spec.workspace",
                CauseReason::Forbidden,
                "a session with a Workspace starts from the Workspace's head: leave out \
                 spec.source.snapshot",
            ));
        }
        if workspace.name.is_empty() {
            errors.push(FieldError::new(
                "spec.workspace.name",
                CauseReason::Required,
                "Required value",
            ));
        } else if workspace.name.len() > 63 {
            errors.push(too_long("spec.workspace.name", 63));
        } else if !is_dns1123_subdomain(&workspace.name) {
            errors.push(FieldError::new(
                "spec.workspace.name",
                CauseReason::Invalid,
                "must be a DNS-1123 subdomain (the name of a Workspace)",
            ));
        }
    }

    if !spec.artifact_inputs.is_empty() && kind != Some(ModeKind::Session) {
        errors.push(FieldError::new(
            "spec.artifactInputs",
            CauseReason::Forbidden,
            "artifact inputs initialise a session's workspace; only session Runs take them",
        ));
    }
    if spec.artifact_inputs.len() > MAX_ARTIFACT_INPUTS {
        errors.push(FieldError::new(
            "spec.artifactInputs",
            CauseReason::TooMany,
            format!("must have at most {MAX_ARTIFACT_INPUTS} items"),
        ));
    }
    for (i, input) in spec.artifact_inputs.iter().enumerate() {
        if input.uri.is_empty() || input.uri.len() > 4096 {
            errors.push(too_long(format!("spec.artifactInputs[{i}].uri"), 4096));
        }
        let path_ok = !input.path.is_empty()
            && input.path.len() <= 1024
            && !input.path.starts_with('/')
            && input
                .path
                .split('/')
                .all(|c| !c.is_empty() && c != "." && c != ".." && !c.contains('\0'));
        if !path_ok {
            errors.push(FieldError::new(
                format!("spec.artifactInputs[{i}].path"),
                CauseReason::Invalid,
                "must be a relative path of at most 1024 bytes without empty, \".\" or \"..\" components",
            ));
        }
    }

    if let Some(inline) = spec.source.as_ref().and_then(|s| s.inline.as_ref())
        && inline.len() > MAX_INLINE_SOURCE_BYTES
    {
        errors.push(too_long("spec.source.inline", MAX_INLINE_SOURCE_BYTES));
    }

    if let Some(snapshot) = spec.source.as_ref().and_then(|s| s.snapshot.as_ref()) {
        if kind != Some(ModeKind::Session) {
            errors.push(FieldError::new(
                "spec.source.snapshot",
                CauseReason::Forbidden,
                "only a session starts from a Snapshot",
            ));
        }
        if spec.source.as_ref().is_some_and(|s| s.inline.is_some())
            || !spec.artifact_inputs.is_empty()
        {
            errors.push(FieldError::new(
                "spec.source.snapshot",
                CauseReason::Forbidden,
                "a session started from a Snapshot takes its files from it: leave out \
                 spec.source.inline and spec.artifactInputs",
            ));
        }
        if snapshot.name.is_empty() || !is_dns1123_subdomain(&snapshot.name) {
            errors.push(FieldError::new(
                "spec.source.snapshot.name",
                CauseReason::Invalid,
                "must be a DNS-1123 subdomain (the name of a Snapshot)",
            ));
        }
        if let Some(problem) = snapshot.uid.as_deref().and_then(uid_problem) {
            errors.push(FieldError::new(
                "spec.source.snapshot.uid",
                CauseReason::Invalid,
                problem,
            ));
        }
    }

    if let Some(env) = &spec.env {
        if env.len() > MAX_ENV_VARS {
            errors.push(FieldError::new(
                "spec.env",
                CauseReason::TooMany,
                format!("must have at most {MAX_ENV_VARS} items"),
            ));
        }
        for (i, var) in env.iter().enumerate() {
            if !is_env_name(&var.name) {
                errors.push(env_name("spec", i));
            }
        }
    }

    if let Some(text) = &spec.timeout {
        match duration::parse(text) {
            Ok(d) if d.is_zero() => errors.push(positive("spec.timeout")),
            Ok(_) => {}
            Err(e) => errors.push(FieldError::new(
                "spec.timeout",
                CauseReason::Invalid,
                e.to_string(),
            )),
        }
    }

    if let Some(retry) = &spec.retry_policy {
        if !(1..=MAX_RETRY_ATTEMPTS).contains(&retry.max_attempts) {
            errors.push(FieldError::new(
                "spec.retryPolicy.maxAttempts",
                CauseReason::Invalid,
                format!("must be between 1 and {MAX_RETRY_ATTEMPTS}"),
            ));
        }
        if retry.backoff_seconds.is_some_and(|s| s < 0) {
            errors.push(non_negative("spec.retryPolicy.backoffSeconds"));
        }
    }

    if spec.ttl_seconds_after_finished.is_some_and(|s| s < 0) {
        errors.push(non_negative("spec.ttlSecondsAfterFinished"));
    }
    if spec.requested_runs() < 1 {
        errors.push(positive("spec.resources.requests.runs"));
    }
    if spec.is_exclusive() && kind != Some(ModeKind::Session) {
        errors.push(FieldError::new(
            "spec.resources.exclusive",
            CauseReason::Forbidden,
            "spec.resources.exclusive is only valid for session Runs: tasks and functions \
             share their worker",
        ));
    }
}

/// The rules for a new Snapshot: `spec.source.run` names a Run (an object name, a bounded
/// UID), and a `Suspend` Snapshot is named `<run>-s<n>` for that Run and pins its UID, as
/// only its worker makes one (a user's would never be taken). A suspend Snapshot carries no
/// owner reference: a fork may start from it after its Run is gone, so the checkpoint
/// controller deletes it, not a garbage collector.
pub fn validate_snapshot_create(snapshot: &crate::Snapshot) -> Vec<FieldError> {
    let spec = &snapshot.spec;
    let mut errors = Vec::new();
    let run = &spec.source.run;
    if run.name.is_empty() {
        errors.push(FieldError::new(
            "spec.source.run.name",
            CauseReason::Required,
            "Required value",
        ));
    } else if !is_dns1123_subdomain(&run.name) {
        errors.push(FieldError::new(
            "spec.source.run.name",
            CauseReason::Invalid,
            "must be a DNS-1123 subdomain (the name of a Run)",
        ));
    }
    if let Some(problem) = run.uid.as_deref().and_then(uid_problem) {
        errors.push(FieldError::new(
            "spec.source.run.uid",
            CauseReason::Invalid,
            problem,
        ));
    }
    let name = snapshot.metadata.name.as_deref().unwrap_or_default();
    if spec.reason != Some(SnapshotReason::Suspend) && is_suspend_name(name, &run.name) {
        errors.push(FieldError::new(
            "metadata.name",
            CauseReason::Invalid,
            format!(
                "{name:?} is the name of a suspend Snapshot of Run {:?} (<run>-s<n>): choose \
                 another name for a checkpoint",
                run.name
            ),
        ));
    }
    if spec.reason == Some(SnapshotReason::Commit) {
        let owned = snapshot
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.kind == "Workspace");
        if !owned {
            errors.push(FieldError::new(
                "spec.reason",
                CauseReason::Forbidden,
                "a Commit Snapshot is made by the worker of a session with spec.workspace, \
                 owned by its Workspace; create a Checkpoint instead",
            ));
        }
    }
    if spec.reason == Some(SnapshotReason::Suspend) {
        let owned = snapshot
            .metadata
            .owner_references
            .as_ref()
            .is_some_and(|o| !o.is_empty());
        if owned {
            errors.push(FieldError::new(
                "metadata.ownerReferences",
                CauseReason::Forbidden,
                "a Suspend Snapshot has no owner: a fork may start from it after its Run is \
                 gone, and the controller-manager deletes it once no fork needs it",
            ));
        }
        let made_by_worker = run.uid.is_some() && is_suspend_name(name, &run.name);
        if !made_by_worker {
            errors.push(FieldError::new(
                "spec.reason",
                CauseReason::Forbidden,
                "a Suspend Snapshot is made by the session's worker (set spec.suspend on the \
                 Run); create a Checkpoint instead",
            ));
        }
    }
    errors
}

/// Whether `name` is one of the names [`crate::snapshot::suspend_snapshot_name`] gives
/// Run `run`'s suspend Snapshots (`<run>-s<n>`; a long Run name's hashed form too).
fn is_suspend_name(name: &str, run: &str) -> bool {
    let Some((_, incarnation)) = name.rsplit_once("-s") else {
        return false;
    };
    incarnation
        .parse::<u64>()
        .is_ok_and(|n| crate::snapshot::suspend_snapshot_name(run, n) == name)
}

/// What is wrong with `uid` as an object UID reference, if anything.
fn uid_problem(uid: &str) -> Option<&'static str> {
    if uid.is_empty() || uid.len() > 128 {
        return Some("must be 1 to 128 bytes");
    }
    if !uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        return Some("must hold only letters, digits and '-'");
    }
    None
}

/// The rules for a changed Snapshot: its spec is immutable, each changed field named (an
/// absent `reason` is the default, `Checkpoint`).
pub fn validate_snapshot_update(old: &SnapshotSpec, new: &SnapshotSpec) -> Vec<FieldError> {
    let mut errors = Vec::new();
    if old.source != new.source {
        errors.push(FieldError::new(
            "spec.source",
            CauseReason::Invalid,
            "field is immutable",
        ));
    }
    if old.reason.unwrap_or_default() != new.reason.unwrap_or_default() {
        errors.push(FieldError::new(
            "spec.reason",
            CauseReason::Invalid,
            "field is immutable",
        ));
    }
    errors
}

/// The rules of a Snapshot status write: Ready and Failed are final, and every bound.
pub fn validate_snapshot_status(
    old: Option<&SnapshotStatus>,
    new: Option<&SnapshotStatus>,
) -> Vec<FieldError> {
    let mut errors = Vec::new();
    let old_phase = old.and_then(|s| s.phase);
    let new_phase = new.and_then(|s| s.phase);
    if let Some(old_phase) = old_phase
        && old_phase.is_terminal()
        && new_phase != Some(old_phase)
    {
        errors.push(FieldError::new(
            "status.phase",
            CauseReason::Forbidden,
            format!(
                "the Snapshot is {}; that phase is final",
                old_phase.as_str()
            ),
        ));
    }
    let Some(status) = new else {
        return errors;
    };
    for (field, value) in [
        ("status.sizeBytes", status.size_bytes),
        ("status.compressedBytes", status.compressed_bytes),
        ("status.files", status.files),
        ("status.lastSequence", status.last_sequence),
    ] {
        if value.is_some_and(|v| v < 0) {
            errors.push(non_negative(field));
        }
    }
    if status.incarnation.is_some_and(|i| i < 1) {
        errors.push(positive("status.incarnation"));
    }
    if let Some(digest) = &status.digest {
        let hex = digest.strip_prefix("sha256:").unwrap_or_default();
        if hex.len() != 64
            || !hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            errors.push(FieldError::new(
                "status.digest",
                CauseReason::Invalid,
                "must be sha256: and 64 lower-case hex digits",
            ));
        }
    }
    if let Some(location) = &status.location {
        if location.uri.is_empty() {
            errors.push(FieldError::new(
                "status.location.uri",
                CauseReason::Required,
                "Required value",
            ));
        }
        for (field, uri) in [
            ("status.location.uri", Some(&location.uri)),
            (
                "status.location.manifestUri",
                location.manifest_uri.as_ref(),
            ),
        ] {
            let Some(uri) = uri else { continue };
            if uri.len() > MAX_SNAPSHOT_URI_BYTES {
                errors.push(too_long(field, MAX_SNAPSHOT_URI_BYTES));
            } else if !(uri.is_empty() || uri.starts_with("file:///") || uri.starts_with("s3://")) {
                errors.push(FieldError::new(
                    field,
                    CauseReason::Invalid,
                    "must be a file:/// or s3:// URI",
                ));
            }
        }
    }
    if let Some(copy) = &status.local_copy
        && (copy.pod.is_empty() || copy.pod.len() > 253)
    {
        errors.push(FieldError::new(
            "status.localCopy.pod",
            CauseReason::Invalid,
            "must be a Pod name of 1 to 253 characters",
        ));
    }
    if status.reason.as_ref().is_some_and(|r| r.len() > 128) {
        errors.push(too_long("status.reason", 128));
    }
    if status
        .message
        .as_ref()
        .is_some_and(|m| m.len() > MAX_SNAPSHOT_MESSAGE_BYTES)
    {
        errors.push(too_long("status.message", MAX_SNAPSHOT_MESSAGE_BYTES));
    }
    errors
}

/// Artifact inputs of one session Run at most.
pub const MAX_ARTIFACT_INPUTS: usize = 32;

fn too_long(field: impl Into<String>, limit: usize) -> FieldError {
    FieldError::new(
        field,
        CauseReason::TooLong,
        format!("may not be longer than {limit} bytes"),
    )
}

fn positive(field: &str) -> FieldError {
    FieldError::new(field, CauseReason::Invalid, "must be greater than zero")
}

fn non_negative(field: &str) -> FieldError {
    FieldError::new(field, CauseReason::Invalid, "must be zero or greater")
}

fn bounded(text: &str) -> String {
    text.chars().take(64).collect()
}

/// A DNS-1123 label: `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
pub fn is_dns1123_label(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes.first() != Some(&b'-')
        && bytes.last() != Some(&b'-')
}

/// A DNS-1123 subdomain: dot-separated labels, at most 253 characters. Object names of most
/// kinds must be one.
pub fn is_dns1123_subdomain(name: &str) -> bool {
    name.len() <= 253 && name.split('.').all(is_dns1123_label)
}

/// `{at}.env[i].name` is no environment variable name.
fn env_name(at: &str, i: usize) -> FieldError {
    FieldError::new(
        format!("{at}.env[{i}].name"),
        CauseReason::Invalid,
        "must be a C identifier: letters, digits and '_', not starting with a digit",
    )
}

fn is_env_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 256
        && !bytes[0].is_ascii_digit()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || *b == b'_')
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_terminal_phase_is_final() {
        let status = |phase: Option<Phase>| RunStatus {
            phase,
            ..RunStatus::default()
        };
        for old in Phase::ALL {
            for new in Phase::ALL {
                let errors =
                    validate_status_update(Some(&status(Some(old))), Some(&status(Some(new))));
                let refused = !errors.is_empty();
                let expected = match old {
                    Phase::Succeeded | Phase::Failed | Phase::Timeout | Phase::Cancelled => {
                        new != old
                    }
                    // Left only to Pending (a resume) or an end.
                    Phase::Suspended => {
                        !(new == Phase::Suspended || new == Phase::Pending || new.is_terminal())
                    }
                    // These statuses carry no snapshot: Suspended cannot be entered.
                    Phase::Pending
                    | Phase::Scheduled
                    | Phase::Running
                    | Phase::Ready
                    | Phase::Finalizing => new == Phase::Suspended,
                };
                assert_eq!(refused, expected, "{old} -> {new}");
            }
        }
        // No status yet counts as Pending; removing the status of an ended Run is refused.
        assert!(validate_status_update(None, Some(&status(Some(Phase::Running)))).is_empty());
        assert!(!validate_status_update(Some(&status(Some(Phase::Failed))), None).is_empty());
    }

    use super::*;
    use crate::run::{
        ByteString, EndpointProtocol, EnvVar, FunctionMode, RetryPolicy, RunEndpoint, RunMode,
        RunRequests, RunResources, RunSource, SessionMode, TaskMode, Termination, WorkspaceRef,
    };

    fn task() -> RunSpec {
        RunSpec {
            runtime: "python".into(),
            mode: RunMode {
                task: Some(TaskMode {
                    entrypoint: Some("main.py".into()),
                    args: vec![],
                }),
                ..Default::default()
            },
            source: Some(RunSource {
                inline: Some("print(1)".into()),
                snapshot: None,
            }),
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

    fn function() -> RunSpec {
        let mut spec = task();
        spec.mode = RunMode {
            function: Some(FunctionMode {
                handler: "main.handle".into(),
                idle_timeout_seconds: Some(60),
                concurrency: None,
            }),
            ..Default::default()
        };
        spec
    }

    fn session() -> RunSpec {
        let mut spec = task();
        spec.mode = RunMode {
            session: Some(SessionMode {
                lease_timeout_seconds: Some(30),
                queue_size: Some(8),
                operation_timeout: Some("2m".into()),
                idle_timeout: Some("1h".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        spec
    }

    fn with(mut spec: RunSpec, change: impl FnOnce(&mut RunSpec)) -> RunSpec {
        change(&mut spec);
        spec
    }

    fn fields(errors: &[FieldError]) -> Vec<&str> {
        errors.iter().map(|e| e.field.as_str()).collect()
    }

    /// A Run's spec, the fields admission must refuse (empty: accepted).
    type CreateCase = (&'static str, RunSpec, Vec<&'static str>);
    /// An update's old and new spec, the fields admission must refuse.
    type UpdateCase = (&'static str, RunSpec, RunSpec, Vec<&'static str>);

    #[test]
    fn create_rules() {
        for (name, spec, expected) in create_cases() {
            let errors = validate_create(&spec);
            assert_eq!(fields(&errors), expected, "case {name:?}: {errors:?}");
        }
    }

    #[test]
    fn update_rules() {
        for (name, old, new, expected) in update_cases() {
            let errors = validate_update(&old, &new);
            assert_eq!(fields(&errors), expected, "case {name:?}: {errors:?}");
        }
    }

    fn create_cases() -> Vec<CreateCase> {
        let drain = Some(Termination {
            mode: TerminationMode::Drain,
        });
        let immediate = Some(Termination {
            mode: TerminationMode::Immediate,
        });
        vec![
            ("task is valid", task(), vec![]),
            ("function is valid", function(), vec![]),
            ("session is valid", session(), vec![]),
            (
                "no mode",
                with(task(), |s| s.mode = RunMode::default()),
                vec!["spec.mode"],
            ),
            (
                "two modes",
                with(task(), |s| s.mode.function = function().mode.function),
                vec!["spec.mode"],
            ),
            (
                "three modes",
                with(task(), |s| {
                    s.mode.function = function().mode.function;
                    s.mode.session = session().mode.session;
                }),
                vec!["spec.mode"],
            ),
            (
                "drain on a task",
                with(task(), |s| s.termination = drain.clone()),
                vec!["spec.termination.mode"],
            ),
            (
                "drain on a function",
                with(function(), |s| s.termination = drain.clone()),
                vec!["spec.termination.mode"],
            ),
            (
                "drain on a session",
                with(session(), |s| s.termination = drain.clone()),
                vec![],
            ),
            (
                "immediate on a task",
                with(task(), |s| s.termination = immediate.clone()),
                vec![],
            ),
            // The parity check names its objects "r": a Workspace of that name is the
            // Run's own (validate_workspace_lock is tested on its own).
            (
                "session with a workspace",
                with(session(), |s| {
                    s.workspace = Some(WorkspaceRef { name: "r".into() })
                }),
                vec![],
            ),
            (
                "task with a workspace",
                with(task(), |s| {
                    s.workspace = Some(WorkspaceRef { name: "r".into() })
                }),
                vec!["spec.workspace"],
            ),
            (
                "fork with a workspace",
                with(session(), |s| {
                    s.workspace = Some(WorkspaceRef { name: "r".into() });
                    s.source = Some(RunSource {
                        snapshot: Some(crate::snapshot::ObjectReference {
                            name: "cp".into(),
                            uid: None,
                        }),
                        ..RunSource::default()
                    });
                }),
                vec!["spec.workspace"],
            ),
            (
                "inline source at the limit",
                with(task(), |s| {
                    s.source = Some(RunSource {
                        inline: Some("x".repeat(MAX_INLINE_SOURCE_BYTES)),
                        snapshot: None,
                    })
                }),
                vec![],
            ),
            (
                "inline source over the limit",
                with(task(), |s| {
                    s.source = Some(RunSource {
                        inline: Some("x".repeat(MAX_INLINE_SOURCE_BYTES + 1)),
                        snapshot: None,
                    })
                }),
                vec!["spec.source.inline"],
            ),
            (
                "empty runtime",
                with(task(), |s| s.runtime = String::new()),
                vec!["spec.runtime"],
            ),
            (
                "runtime not a label",
                with(task(), |s| s.runtime = "Python_3".into()),
                vec!["spec.runtime"],
            ),
            (
                "empty entrypoint",
                with(task(), |s| {
                    if let Some(t) = s.mode.task.as_mut() {
                        t.entrypoint = Some(String::new())
                    }
                }),
                vec!["spec.mode.task.entrypoint"],
            ),
            (
                "entrypoint over the limit",
                with(task(), |s| {
                    if let Some(t) = s.mode.task.as_mut() {
                        t.entrypoint = Some("x".repeat(MAX_ENTRYPOINT_BYTES + 1))
                    }
                }),
                vec!["spec.mode.task.entrypoint"],
            ),
            (
                // Issue 15 item 2: inline source needs no entrypoint (it runs as `script`).
                "inline source without an entrypoint",
                with(task(), |s| {
                    if let Some(t) = s.mode.task.as_mut() {
                        t.entrypoint = None
                    }
                }),
                vec![],
            ),
            (
                "no entrypoint and no inline source",
                with(task(), |s| {
                    s.source = None;
                    if let Some(t) = s.mode.task.as_mut() {
                        t.entrypoint = None
                    }
                }),
                vec!["spec.mode.task.entrypoint"],
            ),
            (
                "empty handler",
                with(function(), |s| {
                    if let Some(f) = s.mode.function.as_mut() {
                        f.handler.clear()
                    }
                }),
                vec!["spec.mode.function.handler"],
            ),
            (
                "zero concurrency",
                with(function(), |s| {
                    if let Some(f) = s.mode.function.as_mut() {
                        f.concurrency = Some(0)
                    }
                }),
                vec!["spec.mode.function.concurrency"],
            ),
            (
                "concurrency above the most",
                with(function(), |s| {
                    if let Some(f) = s.mode.function.as_mut() {
                        f.concurrency = Some(MAX_FUNCTION_CONCURRENCY + 1)
                    }
                }),
                vec!["spec.mode.function.concurrency"],
            ),
            (
                "zero idle timeout",
                with(function(), |s| {
                    if let Some(f) = s.mode.function.as_mut() {
                        f.idle_timeout_seconds = Some(0)
                    }
                }),
                vec!["spec.mode.function.idleTimeoutSeconds"],
            ),
            (
                "queue over 32",
                with(session(), |s| {
                    if let Some(m) = s.mode.session.as_mut() {
                        m.queue_size = Some(33)
                    }
                }),
                vec!["spec.mode.session.queueSize"],
            ),
            (
                "queue of zero",
                with(session(), |s| {
                    if let Some(m) = s.mode.session.as_mut() {
                        m.queue_size = Some(0)
                    }
                }),
                vec!["spec.mode.session.queueSize"],
            ),
            (
                "operation timeout over 5m",
                with(session(), |s| {
                    if let Some(m) = s.mode.session.as_mut() {
                        m.operation_timeout = Some("5m1s".into())
                    }
                }),
                vec!["spec.mode.session.operationTimeout"],
            ),
            (
                "idle timeout under a second",
                with(session(), |s| {
                    if let Some(m) = s.mode.session.as_mut() {
                        m.idle_timeout = Some("500ms".into())
                    }
                }),
                vec!["spec.mode.session.idleTimeout"],
            ),
            (
                "idle timeout malformed",
                with(session(), |s| {
                    if let Some(m) = s.mode.session.as_mut() {
                        m.idle_timeout = Some("-5m".into())
                    }
                }),
                vec!["spec.mode.session.idleTimeout"],
            ),
            (
                "operation timeout malformed",
                with(session(), |s| {
                    if let Some(m) = s.mode.session.as_mut() {
                        m.operation_timeout = Some("soon".into())
                    }
                }),
                vec!["spec.mode.session.operationTimeout"],
            ),
            (
                "zero lease",
                with(session(), |s| {
                    if let Some(m) = s.mode.session.as_mut() {
                        m.lease_timeout_seconds = Some(0)
                    }
                }),
                vec!["spec.mode.session.leaseTimeoutSeconds"],
            ),
            (
                "timeout malformed",
                with(task(), |s| s.timeout = Some("ten minutes".into())),
                vec!["spec.timeout"],
            ),
            (
                "timeout zero",
                with(task(), |s| s.timeout = Some("0s".into())),
                vec!["spec.timeout"],
            ),
            (
                "timeout valid",
                with(task(), |s| s.timeout = Some("10m".into())),
                vec![],
            ),
            (
                // Just under the longest duration CEL's duration() holds (int64 ns).
                "timeout at the largest duration",
                with(task(), |s| s.timeout = Some("2562047h".into())),
                vec![],
            ),
            (
                "timeout past the largest duration",
                with(task(), |s| s.timeout = Some("2562047h1ms".into())),
                vec!["spec.timeout"],
            ),
            (
                "idle timeout past the largest duration",
                session_with(|m| m.idle_timeout = Some("2562048h".into())),
                vec!["spec.mode.session.idleTimeout"],
            ),
            (
                "auto-suspend past the largest duration",
                session_with(|m| m.auto_suspend_after = Some("2562048h".into())),
                vec!["spec.mode.session.autoSuspendAfter"],
            ),
            (
                "timeout of 18-digit hours",
                with(task(), |s| s.timeout = Some("100000000000000000h".into())),
                vec!["spec.timeout"],
            ),
            (
                "retry attempts zero",
                with(task(), |s| {
                    s.retry_policy = Some(RetryPolicy {
                        max_attempts: 0,
                        backoff_seconds: None,
                    })
                }),
                vec!["spec.retryPolicy.maxAttempts"],
            ),
            (
                "negative backoff",
                with(task(), |s| {
                    s.retry_policy = Some(RetryPolicy {
                        max_attempts: 3,
                        backoff_seconds: Some(-1),
                    })
                }),
                vec!["spec.retryPolicy.backoffSeconds"],
            ),
            (
                "negative ttl",
                with(task(), |s| s.ttl_seconds_after_finished = Some(-1)),
                vec!["spec.ttlSecondsAfterFinished"],
            ),
            (
                "zero run slots",
                with(task(), |s| {
                    s.resources = Some(RunResources {
                        requests: Some(RunRequests { runs: Some(0) }),
                        ..RunResources::default()
                    })
                }),
                vec!["spec.resources.requests.runs"],
            ),
            (
                "exclusive session is valid",
                with(session(), |s| {
                    s.resources = Some(RunResources {
                        exclusive: Some(true),
                        ..RunResources::default()
                    })
                }),
                vec![],
            ),
            (
                "exclusive task",
                with(task(), |s| {
                    s.resources = Some(RunResources {
                        exclusive: Some(true),
                        ..RunResources::default()
                    })
                }),
                vec!["spec.resources.exclusive"],
            ),
            (
                "exclusive function",
                with(function(), |s| {
                    s.resources = Some(RunResources {
                        exclusive: Some(true),
                        ..RunResources::default()
                    })
                }),
                vec!["spec.resources.exclusive"],
            ),
            (
                "bad env name",
                with(task(), |s| {
                    s.env = Some(vec![EnvVar {
                        name: "1BAD".into(),
                        value: String::new(),
                    }])
                }),
                vec!["spec.env[0].name"],
            ),
            (
                "too many env vars",
                with(task(), |s| {
                    s.env = Some(
                        (0..=MAX_ENV_VARS)
                            .map(|i| EnvVar {
                                name: format!("V{i}"),
                                value: String::new(),
                            })
                            .collect(),
                    )
                }),
                vec!["spec.env"],
            ),
            (
                "one minute",
                session_with(|m| m.auto_suspend_after = Some("1m".into())),
                vec![],
            ),
            (
                "an hour and a half",
                session_with(|m| m.auto_suspend_after = Some("1h30m".into())),
                vec![],
            ),
            (
                "one second",
                session_with(|m| m.auto_suspend_after = Some("1s".into())),
                vec![],
            ),
            (
                "under a second",
                session_with(|m| m.auto_suspend_after = Some("500ms".into())),
                vec!["spec.mode.session.autoSuspendAfter"],
            ),
            (
                "zero",
                session_with(|m| m.auto_suspend_after = Some("0".into())),
                vec!["spec.mode.session.autoSuspendAfter"],
            ),
            (
                "malformed",
                session_with(|m| m.auto_suspend_after = Some("soon".into())),
                vec!["spec.mode.session.autoSuspendAfter"],
            ),
            (
                "resume from snapshot",
                session_with(|m| {
                    m.on_worker_loss = Some(crate::run::WorkerLossPolicy::ResumeFromSnapshot)
                }),
                vec![],
            ),
            (
                "exec class",
                session_with(|m| m.class = Some(SessionClass::Exec)),
                vec![],
            ),
            (
                "dev class without a workspace",
                session_with(|m| m.class = Some(SessionClass::Dev)),
                vec!["spec.workspace"],
            ),
            (
                "dev class with its workspace",
                with(session_with(|m| m.class = Some(SessionClass::Dev)), |s| {
                    s.workspace = Some(WorkspaceRef { name: "r".into() })
                }),
                vec![],
            ),
            (
                "desktop class",
                session_with(|m| m.class = Some(SessionClass::Desktop)),
                vec!["spec.mode.session.class"],
            ),
            (
                "suspend false on a task",
                with(task(), |s| s.suspend = Some(false)),
                vec!["spec.suspend"],
            ),
            (
                "suspended session",
                with(session(), |s| s.suspend = Some(true)),
                vec![],
            ),
            (
                "artifact inputs of a session",
                with(session(), |s| {
                    s.artifact_inputs = vec![input("data/in.csv")]
                }),
                vec![],
            ),
            (
                "artifact inputs of a task",
                with(task(), |s| s.artifact_inputs = vec![input("in.csv")]),
                vec!["spec.artifactInputs"],
            ),
            (
                "artifact input with a dot-dot component",
                with(session(), |s| s.artifact_inputs = vec![input("a/../b")]),
                vec!["spec.artifactInputs[0].path"],
            ),
            (
                "artifact input at an absolute path",
                with(session(), |s| {
                    s.artifact_inputs = vec![input("/etc/passwd")]
                }),
                vec!["spec.artifactInputs[0].path"],
            ),
            (
                "artifact input with an empty component",
                with(session(), |s| s.artifact_inputs = vec![input("a//b")]),
                vec!["spec.artifactInputs[0].path"],
            ),
            (
                "artifact input of dot-files",
                with(session(), |s| {
                    s.artifact_inputs = vec![input(".env/..x/.a")]
                }),
                vec![],
            ),
            ("a fork", fork(None, None), vec![]),
            (
                "a fork pinned to a uid",
                fork(Some("0a1b-2c"), None),
                vec![],
            ),
            (
                "a fork of a task",
                with(fork(None, None), |s| s.mode = task().mode),
                vec!["spec.source.snapshot"],
            ),
            (
                "a fork with inline source",
                with(fork(None, None), |s| {
                    if let Some(source) = s.source.as_mut() {
                        source.inline = Some("print(1)".into())
                    }
                }),
                vec!["spec.source.snapshot"],
            ),
            (
                "a fork with artifact inputs",
                with(fork(None, None), |s| s.artifact_inputs = vec![input("a")]),
                vec!["spec.source.snapshot"],
            ),
            (
                "a fork of a name that is no subdomain",
                fork(None, Some("Snap_1")),
                vec!["spec.source.snapshot.name"],
            ),
            (
                "a fork pinned to a bad uid",
                fork(Some("a/b"), None),
                vec!["spec.source.snapshot.uid"],
            ),
            (
                "timeout of hours and minutes",
                with(task(), |s| s.timeout = Some("1h30m".into())),
                vec![],
            ),
            (
                "timeout of bare zero",
                with(task(), |s| s.timeout = Some("0".into())),
                vec!["spec.timeout"],
            ),
            (
                "operation timeout of exactly 5m",
                session_with(|m| m.operation_timeout = Some("5m".into())),
                vec![],
            ),
        ]
    }

    fn session_with(change: impl FnOnce(&mut SessionMode)) -> RunSpec {
        with(session(), |s| {
            if let Some(m) = s.mode.session.as_mut() {
                change(m)
            }
        })
    }

    fn input(path: &str) -> crate::run::ArtifactInput {
        crate::run::ArtifactInput {
            uri: "s3://bucket/runs/r/out.csv".into(),
            path: path.into(),
        }
    }

    /// A session forked from Snapshot `name` (default `snap-1`), pinned to `uid`.
    fn fork(uid: Option<&str>, name: Option<&str>) -> RunSpec {
        with(session(), |s| {
            s.source = Some(RunSource {
                inline: None,
                snapshot: Some(crate::snapshot::ObjectReference {
                    name: name.unwrap_or("snap-1").into(),
                    uid: uid.map(Into::into),
                }),
            })
        })
    }

    fn update_cases() -> Vec<UpdateCase> {
        let t = |mode| Some(Termination { mode });
        vec![
            ("unchanged", task(), task(), vec![]),
            (
                "runtime changed",
                task(),
                with(task(), |s| s.runtime = "bash".into()),
                vec!["spec.runtime"],
            ),
            (
                "mode changed",
                task(),
                with(task(), |s| {
                    if let Some(m) = s.mode.task.as_mut() {
                        m.entrypoint = Some("other.py".into())
                    }
                }),
                vec!["spec.mode"],
            ),
            ("mode kind changed", task(), function(), vec!["spec.mode"]),
            (
                "source changed",
                task(),
                with(task(), |s| s.source = None),
                vec!["spec.source"],
            ),
            (
                "env added",
                task(),
                with(task(), |s| {
                    s.env = Some(vec![EnvVar {
                        name: "A".into(),
                        value: "1".into(),
                    }])
                }),
                vec!["spec.env"],
            ),
            (
                "timeout added",
                task(),
                with(task(), |s| s.timeout = Some("1m".into())),
                vec!["spec.timeout"],
            ),
            (
                "retry changed",
                task(),
                with(task(), |s| {
                    s.retry_policy = Some(RetryPolicy {
                        max_attempts: 2,
                        backoff_seconds: None,
                    })
                }),
                vec!["spec.retryPolicy"],
            ),
            (
                "ttl changed",
                task(),
                with(task(), |s| s.ttl_seconds_after_finished = Some(30)),
                vec![],
            ),
            (
                "absent to drain",
                session(),
                with(session(), |s| s.termination = t(TerminationMode::Drain)),
                vec![],
            ),
            (
                "absent to immediate",
                session(),
                with(session(), |s| s.termination = t(TerminationMode::Immediate)),
                vec![],
            ),
            (
                "drain to immediate",
                with(session(), |s| s.termination = t(TerminationMode::Drain)),
                with(session(), |s| s.termination = t(TerminationMode::Immediate)),
                vec![],
            ),
            (
                "drain kept",
                with(session(), |s| s.termination = t(TerminationMode::Drain)),
                with(session(), |s| s.termination = t(TerminationMode::Drain)),
                vec![],
            ),
            (
                "immediate to drain",
                with(session(), |s| s.termination = t(TerminationMode::Immediate)),
                with(session(), |s| s.termination = t(TerminationMode::Drain)),
                vec!["spec.termination"],
            ),
            (
                "drain removed",
                with(session(), |s| s.termination = t(TerminationMode::Drain)),
                session(),
                vec!["spec.termination"],
            ),
            (
                "immediate removed",
                with(task(), |s| s.termination = t(TerminationMode::Immediate)),
                task(),
                vec!["spec.termination"],
            ),
            (
                "drain added to a task",
                task(),
                with(task(), |s| s.termination = t(TerminationMode::Drain)),
                vec!["spec.termination.mode"],
            ),
        ]
    }

    /// Issue 17 item 6: a cluster's API server, with only the Run CRD's schema (its
    /// bounds, patterns and CEL rules), accepts and refuses exactly the objects that
    /// standalone admission does.
    #[test]
    fn the_crd_refuses_what_admission_refuses() {
        let schema = crate::crd_parity::run_schema();
        let mut disagreements = Vec::new();
        for (name, spec, expected) in create_cases() {
            let refused = crate::crd_parity::refusals(&schema, &spec, None);
            if refused.is_empty() != expected.is_empty() {
                disagreements.push(format!(
                    "create {name:?}: admission {expected:?}, CRD {refused:?}"
                ));
            }
        }
        for (name, old, new, expected) in update_cases() {
            let refused = crate::crd_parity::refusals(&schema, &new, Some(&old));
            if refused.is_empty() != expected.is_empty() {
                disagreements.push(format!(
                    "update {name:?}: admission {expected:?}, CRD {refused:?}"
                ));
            }
        }
        assert!(disagreements.is_empty(), "{}", disagreements.join("\n"));
    }

    /// The Run's name is its Workspace's lock: admission and the CRD's root rule both
    /// refuse a session named otherwise than its Workspace.
    #[test]
    fn a_session_with_a_workspace_is_named_after_it() {
        let schema = crate::crd_parity::run_schema();
        let spec = with(session(), |s| {
            s.workspace = Some(WorkspaceRef {
                name: "project".into(),
            })
        });
        for (name, refused) in [("project", false), ("other", true)] {
            let object = serde_json::json!({
                "apiVersion": "kruntimes.io/v1alpha1",
                "kind": "Run",
                "metadata": {"name": name, "namespace": "default"},
                "spec": spec,
            });
            let crd = crate::crd_parity::object_refusals(&schema, &object, None);
            let admission = validate_workspace_lock(name, &spec);
            assert_eq!(!crd.is_empty(), refused, "{name}: CRD {crd:?}");
            assert_eq!(!admission.is_empty(), refused, "{name}: {admission:?}");
        }
        assert!(validate_workspace_lock("any", &session()).is_empty());
    }

    #[test]
    fn workspace_commits_never_decrease() {
        use crate::workspace::WorkspaceStatus;
        let at = |commits| {
            Some(WorkspaceStatus {
                commits,
                ..WorkspaceStatus::default()
            })
        };
        assert!(validate_workspace_status(None, at(Some(1)).as_ref()).is_empty());
        assert!(validate_workspace_status(at(Some(1)).as_ref(), at(Some(2)).as_ref()).is_empty());
        assert!(!validate_workspace_status(at(Some(2)).as_ref(), at(Some(1)).as_ref()).is_empty());
        assert!(!validate_workspace_status(at(Some(2)).as_ref(), at(None).as_ref()).is_empty());
    }

    #[test]
    fn workspace_specs_are_bounded() {
        use crate::workspace::WorkspaceSpec;
        assert!(validate_workspace(&WorkspaceSpec::default()).is_empty());
        for (history, ttl) in [(Some(0), None), (Some(101), None), (None, Some(0))] {
            let spec = WorkspaceSpec {
                history,
                ttl_seconds_after_unused: ttl,
            };
            assert_eq!(validate_workspace(&spec).len(), 1, "{spec:?}");
        }
    }

    #[test]
    fn status_rules() {
        let endpoint = |url: usize, ca: usize| {
            Some(RunEndpoint {
                protocol: EndpointProtocol::Https,
                url: "u".repeat(url),
                ca_bundle: Some(ByteString("c".repeat(ca).into_bytes())),
            })
        };
        let outputs = |n: usize, key: usize, value: usize| {
            (0..n)
                .map(|i| (format!("{i:0>width$}", width = key), "v".repeat(value)))
                .collect()
        };
        let cases: Vec<(&str, RunStatus, Vec<&str>)> = vec![
            ("empty", RunStatus::default(), vec![]),
            (
                "endpoint at the limits",
                RunStatus {
                    endpoint: endpoint(MAX_ENDPOINT_URL_BYTES, MAX_CA_BUNDLE_BYTES),
                    ..Default::default()
                },
                vec![],
            ),
            (
                "url too long",
                RunStatus {
                    endpoint: endpoint(MAX_ENDPOINT_URL_BYTES + 1, 10),
                    ..Default::default()
                },
                vec!["status.endpoint.url"],
            ),
            (
                "ca bundle too long",
                RunStatus {
                    endpoint: endpoint(10, MAX_CA_BUNDLE_BYTES + 1),
                    ..Default::default()
                },
                vec!["status.endpoint.caBundle"],
            ),
            (
                "64 keys",
                RunStatus {
                    outputs: outputs(64, 4, 10),
                    ..Default::default()
                },
                vec![],
            ),
            (
                "65 keys",
                RunStatus {
                    outputs: outputs(65, 4, 10),
                    ..Default::default()
                },
                vec!["status.outputs"],
            ),
            (
                "key too long",
                RunStatus {
                    outputs: outputs(1, 129, 1),
                    ..Default::default()
                },
                vec![Box::leak(
                    format!("status.outputs[{}]", "0".repeat(64)).into_boxed_str(),
                )],
            ),
            (
                "value too long",
                RunStatus {
                    outputs: outputs(1, 1, MAX_OUTPUT_VALUE_BYTES + 1),
                    ..Default::default()
                },
                vec!["status.outputs[0]"],
            ),
            (
                "total too large",
                RunStatus {
                    outputs: outputs(9, 1, MAX_OUTPUT_VALUE_BYTES),
                    ..Default::default()
                },
                vec!["status.outputs"],
            ),
        ];
        for (name, status, expected) in cases {
            let errors = validate_status(&status);
            assert_eq!(fields(&errors), expected, "case {name:?}: {errors:?}");
        }
    }

    #[test]
    fn names() {
        for good in ["a", "python-3", "0x"] {
            assert!(is_dns1123_label(good), "{good}");
        }
        for bad in ["", "-a", "a-", "A", "a_b", &"a".repeat(64)] {
            assert!(!is_dns1123_label(bad), "{bad}");
        }
        assert!(is_dns1123_subdomain("runs.kruntimes.io"));
        assert!(!is_dns1123_subdomain("runs..io"));
    }

    fn snapshot_ref(name: &str) -> crate::run::RunSnapshotRef {
        crate::run::RunSnapshotRef {
            name: name.into(),
            uri: Some("file:///data/snapshots/s.tar.zst".into()),
            last_sequence: Some(7),
        }
    }

    #[test]
    fn suspend_is_for_sessions_only_and_stays_mutable() {
        let suspended = |spec: RunSpec, on: Option<bool>| with(spec, |s| s.suspend = on);
        // Create: refused on a task or a function, whichever value, naming the field.
        for (name, spec) in [("task", task()), ("function", function())] {
            for on in [Some(true), Some(false)] {
                let errors = validate_create(&suspended(spec.clone(), on));
                assert_eq!(fields(&errors), vec!["spec.suspend"], "{name} {on:?}");
                assert!(errors[0].message.contains("only valid for session Runs"));
            }
        }
        assert!(validate_create(&suspended(session(), Some(true))).is_empty());
        // Update: a session may suspend and resume as often as it likes.
        let cases = [
            (None, Some(true)),
            (Some(true), Some(false)),
            (Some(false), Some(true)),
            (Some(true), None),
        ];
        for (old, new) in cases {
            let errors = validate_update(&suspended(session(), old), &suspended(session(), new));
            assert!(errors.is_empty(), "{old:?} -> {new:?}: {errors:?}");
        }
        // A task may not start suspending by an update either.
        let errors = validate_update(&task(), &suspended(task(), Some(true)));
        assert_eq!(fields(&errors), vec!["spec.suspend"]);
        // Every other field stays immutable beside a suspend change.
        let errors = validate_update(
            &session(),
            &with(suspended(session(), Some(true)), |s| {
                s.timeout = Some("1m".into());
                if let Some(m) = s.mode.session.as_mut() {
                    m.auto_suspend_after = Some("10m".into());
                }
            }),
        );
        assert_eq!(fields(&errors), vec!["spec.mode", "spec.timeout"]);
    }

    #[test]
    fn suspended_is_entered_with_a_snapshot_and_left_to_pending_or_an_end() {
        let status = |phase: Phase, snapshot: bool| RunStatus {
            phase: Some(phase),
            snapshot: snapshot.then(|| snapshot_ref("s-1")),
            ..RunStatus::default()
        };
        let ok = |old: RunStatus, new: RunStatus| validate_status_update(Some(&old), Some(&new));
        // The worker writes Ready -> Suspended with the Snapshot.
        assert!(ok(status(Phase::Ready, false), status(Phase::Suspended, true)).is_empty());
        // Without it, refused: nothing to resume from.
        let errors = ok(status(Phase::Ready, false), status(Phase::Suspended, false));
        assert_eq!(fields(&errors), vec!["status.snapshot"]);
        // Resume, and an end while suspended.
        assert!(ok(status(Phase::Suspended, true), status(Phase::Pending, true)).is_empty());
        assert!(
            ok(
                status(Phase::Suspended, true),
                status(Phase::Cancelled, true)
            )
            .is_empty()
        );
        // A resumed Run suspended again before it was placed.
        assert!(ok(status(Phase::Pending, true), status(Phase::Suspended, true)).is_empty());
        assert!(
            ok(
                status(Phase::Scheduled, true),
                status(Phase::Suspended, true)
            )
            .is_empty()
        );
        // A new Run has no snapshot to come back to; a Running one is not capturable.
        let errors = ok(
            status(Phase::Pending, false),
            status(Phase::Suspended, true),
        );
        assert_eq!(fields(&errors), vec!["status.phase"]);
        let errors = ok(status(Phase::Running, true), status(Phase::Suspended, true));
        assert_eq!(fields(&errors), vec!["status.phase"]);
        // Suspended skips nothing on the way back.
        for new in [
            Phase::Scheduled,
            Phase::Running,
            Phase::Ready,
            Phase::Finalizing,
        ] {
            let errors = ok(status(Phase::Suspended, true), status(new, true));
            assert_eq!(fields(&errors), vec!["status.phase"], "Suspended -> {new}");
        }
    }

    #[test]
    fn suspension_status_fields_are_bounded() {
        let mut status = RunStatus {
            incarnation: Some(0),
            snapshot: Some(crate::run::RunSnapshotRef {
                name: "Not A Name".into(),
                uri: Some("u".repeat(MAX_SNAPSHOT_URI_BYTES + 1)),
                last_sequence: Some(-1),
            }),
            ..RunStatus::default()
        };
        assert_eq!(
            fields(&validate_status(&status)),
            vec![
                "status.incarnation",
                "status.snapshot.name",
                "status.snapshot.uri",
                "status.snapshot.lastSequence"
            ]
        );
        status.incarnation = Some(2);
        status.snapshot = Some(snapshot_ref("s-1"));
        assert!(validate_status(&status).is_empty());
    }

    #[test]
    fn snapshot_rules() {
        use crate::snapshot::{
            ObjectReference, SnapshotLocalCopy, SnapshotLocation, SnapshotPhase, SnapshotSource,
        };
        let spec = |run: &str, reason| SnapshotSpec {
            source: SnapshotSource {
                run: ObjectReference {
                    name: run.into(),
                    uid: None,
                },
            },
            reason,
        };
        let object = |spec: SnapshotSpec| crate::Snapshot::new("c1", spec);
        assert!(validate_snapshot_create(&object(spec("s1", None))).is_empty());
        assert_eq!(
            fields(&validate_snapshot_create(&object(spec("", None)))),
            vec!["spec.source.run.name"]
        );
        assert_eq!(
            fields(&validate_snapshot_create(&object(spec("No/Name", None)))),
            vec!["spec.source.run.name"]
        );
        let mut bad_uid = spec("s1", None);
        bad_uid.source.run.uid = Some("../x".into());
        assert_eq!(
            fields(&validate_snapshot_create(&object(bad_uid))),
            vec!["spec.source.run.uid"]
        );
        // A checkpoint may not take the name of one of its Run's suspend Snapshots.
        let mut named = object(spec("s1", None));
        named.metadata.name = Some("s1-s2".into());
        assert_eq!(
            fields(&validate_snapshot_create(&named)),
            vec!["metadata.name"]
        );
        named.metadata.name = Some("s1-s2x".into());
        assert!(validate_snapshot_create(&named).is_empty());
        // A user cannot make a Suspend Snapshot by mistake: only the session's worker
        // does, named `<run>-s<n>` and pinned to the Run's UID.
        let suspend = spec("s1", Some(SnapshotReason::Suspend));
        assert_eq!(
            fields(&validate_snapshot_create(&object(suspend.clone()))),
            vec!["spec.reason"]
        );
        let mut pinned = suspend.clone();
        pinned.source.run.uid = Some("u-1".into());
        assert_eq!(
            fields(&validate_snapshot_create(&object(pinned.clone()))),
            vec!["spec.reason"]
        );
        let mut unpinned = object(suspend);
        unpinned.metadata.name = Some("s1-s1".into());
        assert_eq!(
            fields(&validate_snapshot_create(&unpinned)),
            vec!["spec.reason"]
        );
        let mut made = object(pinned);
        made.metadata.name = Some("s1-s1".into());
        assert!(validate_snapshot_create(&made).is_empty());
        // With no owner: a garbage collector would take it from its forks.
        made.metadata.owner_references = Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                api_version: "kruntimes.io/v1alpha1".into(),
                kind: "Run".into(),
                name: "s1".into(),
                uid: "u-1".into(),
                ..Default::default()
            },
        ]);
        assert_eq!(
            fields(&validate_snapshot_create(&made)),
            vec!["metadata.ownerReferences"]
        );
        // Immutable, each field named; absent reason is Checkpoint.
        assert!(
            validate_snapshot_update(
                &spec("s1", None),
                &spec("s1", Some(SnapshotReason::Checkpoint))
            )
            .is_empty()
        );
        let errors = validate_snapshot_update(
            &spec("s1", None),
            &spec("s2", Some(SnapshotReason::Suspend)),
        );
        assert_eq!(fields(&errors), vec!["spec.source", "spec.reason"]);
        assert!(errors.iter().all(|e| e.message == "field is immutable"));

        let status = |phase| SnapshotStatus {
            phase: Some(phase),
            ..SnapshotStatus::default()
        };
        let ready = SnapshotStatus {
            phase: Some(SnapshotPhase::Ready),
            size_bytes: Some(10),
            compressed_bytes: Some(4),
            files: Some(2),
            digest: Some(format!("sha256:{}", "a".repeat(64))),
            last_sequence: Some(3),
            incarnation: Some(1),
            location: Some(SnapshotLocation {
                uri: "s3://bucket/ns/run/s1.tar.zst".into(),
                manifest_uri: Some("file:///data/s1.json".into()),
            }),
            local_copy: Some(SnapshotLocalCopy {
                pod: "python-0".into(),
                pod_uid: Some("uid".into()),
            }),
            ..SnapshotStatus::default()
        };
        assert!(
            validate_snapshot_status(Some(&status(SnapshotPhase::Capturing)), Some(&ready))
                .is_empty()
        );
        // Ready and Failed are final.
        let errors =
            validate_snapshot_status(Some(&ready), Some(&status(SnapshotPhase::Capturing)));
        assert_eq!(fields(&errors), vec!["status.phase"]);
        let errors = validate_snapshot_status(
            Some(&status(SnapshotPhase::Failed)),
            Some(&status(SnapshotPhase::Ready)),
        );
        assert_eq!(fields(&errors), vec!["status.phase"]);
        // Bounds.
        let bad = SnapshotStatus {
            size_bytes: Some(-1),
            incarnation: Some(0),
            digest: Some("md5:abc".into()),
            location: Some(SnapshotLocation {
                uri: "http://elsewhere/x".into(),
                manifest_uri: None,
            }),
            message: Some("m".repeat(MAX_SNAPSHOT_MESSAGE_BYTES + 1)),
            ..SnapshotStatus::default()
        };
        assert_eq!(
            fields(&validate_snapshot_status(None, Some(&bad))),
            vec![
                "status.sizeBytes",
                "status.incarnation",
                "status.digest",
                "status.location.uri",
                "status.message"
            ]
        );
    }
}

#[cfg(test)]
mod runtime_tests {
    use super::*;
    use crate::RuntimeSpec;
    use crate::runtime::RuntimeScaling;

    fn spec(scaling: Option<RuntimeScaling>) -> RuntimeSpec {
        serde_json::from_value::<RuntimeSpec>(serde_json::json!({}))
            .map(|mut s| {
                s.scaling = scaling;
                s
            })
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn scaling(min: i32, max: i32, warm: Option<i32>) -> Option<RuntimeScaling> {
        Some(RuntimeScaling {
            min_replicas: min,
            max_replicas: max,
            warm_runs: warm,
            scale_down_delay_seconds: None,
        })
    }

    #[test]
    fn scaling_rules() {
        assert_eq!(spec(None).replicas, 1, "replicas defaults to 1");
        let cases = [
            ("fixed", None, vec![]),
            ("scaling", scaling(1, 8, Some(2)), vec![]),
            ("min equals max", scaling(3, 3, None), vec![]),
            (
                "zero min",
                scaling(0, 8, None),
                vec!["spec.scaling.minReplicas"],
            ),
            (
                "max below min",
                scaling(4, 2, None),
                vec!["spec.scaling.maxReplicas"],
            ),
            (
                "negative warm",
                scaling(1, 2, Some(-1)),
                vec!["spec.scaling.warmRuns"],
            ),
        ];
        for (name, scaling, want) in cases {
            let errors = validate_runtime(&spec(scaling));
            let got: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
            assert_eq!(got, want, "{name}");
        }
    }

    /// A Runtime's name is a DNS-1123 label, standalone and in the CRD alike: a longer or
    /// dotted name could never be a Run's spec.runtime, nor a label value of its workers.
    #[test]
    fn runtime_names_are_labels_standalone_and_in_the_crd() {
        let schema = crate::crd_parity::schema::<crate::Runtime>();
        let long = "a".repeat(63);
        let too_long = "a".repeat(64);
        let cases = [
            ("python", true),
            ("py-3", true),
            ("0x", true),
            (long.as_str(), true),
            (too_long.as_str(), false),
            ("Python", false),
            ("py.3", false),
            ("-py", false),
            ("py_3", false),
        ];
        for (name, want) in cases {
            let standalone = validate_runtime_name(name);
            assert_eq!(standalone.is_empty(), want, "{name:?}: {standalone:?}");
            let object = serde_json::json!({
                "apiVersion": "kruntimes.io/v1alpha1",
                "kind": "Runtime",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {},
            });
            let crd = crate::crd_parity::object_refusals(&schema, &object, None);
            assert_eq!(crd.is_empty(), want, "{name:?}: {crd:?}");
        }
    }

    #[test]
    fn runtime_env_names_are_checked() {
        let runtime = |name: &str| {
            serde_json::from_value::<RuntimeSpec>(serde_json::json!({ "template": { "spec": {
                "containers": [{"name": "sidecar"}, {"name": "runtime", "env": [{"name": "OK_1", "value": ""}, {"name": name}]}]
            } } }))
            .unwrap_or_else(|e| panic!("{e}"))
        };
        assert!(validate_runtime(&runtime("_ALSO_OK")).is_empty());
        for bad in ["1BAD", "A-B", "A B", ""] {
            let errors = validate_runtime(&runtime(bad));
            let got: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
            assert_eq!(
                got,
                vec!["spec.template.spec.containers[1].env[1].name"],
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_template_keeps_what_the_provisioners_add_to_themselves() {
        let fields = |template: serde_json::Value| -> Vec<String> {
            let spec =
                serde_json::from_value::<RuntimeSpec>(serde_json::json!({ "template": template }))
                    .unwrap_or_else(|e| panic!("{e}"));
            validate_runtime(&spec)
                .into_iter()
                .map(|e| e.field)
                .collect()
        };
        // No spec: the defaults. A runtime container with the Pod's settings: fine.
        assert!(fields(serde_json::json!({})).is_empty());
        assert!(fields(serde_json::json!({"metadata": {"labels": {"team": "a"}}})).is_empty());
        let good = serde_json::json!({"spec": {
            "containers": [{"name": "runtime", "image": "python:3.12", "args": ["--sandbox", "gvisor"]}],
            "runtimeClassName": "gvisor",
            "securityContext": {"runAsNonRoot": false},
            "volumes": [{"name": "data", "emptyDir": {}}],
            "automountServiceAccountToken": false,
        }});
        assert!(fields(good).is_empty());
        let at = "spec.template.spec";
        for (template, want) in [
            (
                serde_json::json!({"spec": {"containers": [{"name": "app"}]}}),
                format!("{at}.containers"),
            ),
            (
                serde_json::json!({"spec": {"containers": []}}),
                format!("{at}.containers"),
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": "runtime"}, {"name": "runtimed"}]}}),
                format!("{at}.containers[1].name"),
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": "runtime"}, {"name": "runtime"}]}}),
                format!("{at}.containers[1].name"),
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": "runtime"}], "initContainers": [{"name": "runtime"}]}}),
                format!("{at}.initContainers[0].name"),
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": "runtime"}], "volumes": [{"name": "runtimed-token", "emptyDir": {}}]}}),
                format!("{at}.volumes[0].name"),
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": "runtime"}], "automountServiceAccountToken": true}}),
                format!("{at}.automountServiceAccountToken"),
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": "runtime"}], "volumes": [
                    {"name": "keys", "secret": {"secretName": "kruntimes-worker-tls"}}]}}),
                format!("{at}.volumes[0].secret.secretName"),
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": "runtime"}], "volumes": [
                    {"name": "keys", "projected": {"sources": [
                        {"configMap": {"name": "settings"}},
                        {"secret": {"name": "kruntimes-worker-tls"}}]}}]}}),
                format!("{at}.volumes[0].projected.sources[1].secret.name"),
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": "runtime", "volumeMounts": [
                    {"name": "kruntimes", "mountPath": "/again"},
                    {"name": "runtimed-token", "mountPath": "/steal"},
                ]}]}}),
                format!("{at}.containers[0].volumeMounts[1].name"),
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": "runtime"}], "initContainers": [
                    {"name": "setup", "volumeMounts": [{"name": "gateway-ca", "mountPath": "/ca"}]},
                ]}}),
                format!("{at}.initContainers[0].volumeMounts[0].name"),
            ),
            (
                serde_json::json!({"metadata": {"annotations": {"kruntimes.io/retiring": "true"}}}),
                "spec.template.metadata.annotations".to_string(),
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": "runtime"}], "shareProcessNamespace": true}}),
                format!("{at}.shareProcessNamespace"),
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": "runtime"}], "hostPID": true}}),
                format!("{at}.hostPID"),
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": "runtime"}, {"name": "s", "ports": [{"name": "runtimed", "containerPort": 1}]}]}}),
                format!("{at}.containers[1].ports[0].name"),
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": "runtime", "volumeMounts": [{"name": "d", "mountPath": "/var/run/kruntimes"}]}]}}),
                format!("{at}.containers[0].volumeMounts[0].mountPath"),
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": "runtime", "env": [{"name": "KRUNTIMES_RUNTIME_ROOT", "value": "/x"}]}]}}),
                format!("{at}.containers[0].env[0].name"),
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": "runtime"}], "volumes": [{"name": "d", "emptyDir": {}}, {"name": "d", "emptyDir": {}}]}}),
                format!("{at}.volumes[1].name"),
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": "runtime"}], "volumes": [{"name": "t", "projected": {"sources": [
                    {"configMap": {"name": "c"}},
                    {"serviceAccountToken": {"path": "token"}},
                ]}}]}}),
                format!("{at}.volumes[0].projected.sources[1].serviceAccountToken"),
            ),
        ] {
            assert_eq!(fields(template.clone()), vec![want], "{template}");
        }
    }

    fn with_store(store: serde_json::Value) -> RuntimeSpec {
        serde_json::from_value::<RuntimeSpec>(serde_json::json!({ "artifactStore": store }))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn artifact_store_rules() {
        let s3 = |endpoint: &str, bucket: &str, prefix: Option<&str>| serde_json::json!({"s3": {"endpoint": endpoint, "bucket": bucket, "prefix": prefix}});
        let cases = [
            (
                "filesystem",
                serde_json::json!({"filesystem": {"path": "/srv/a"}}),
                vec![],
            ),
            (
                "s3 https",
                s3("https://s3.example.com", "my-bucket", Some("a/b/")),
                vec![],
            ),
            (
                "s3 loopback http",
                s3("http://127.0.0.1:9000", "b.c-d", None),
                vec![],
            ),
            (
                "s3 localhost http",
                s3("http://localhost:9000/", "abc", None),
                vec![],
            ),
            (
                "s3 ipv6 loopback",
                s3("http://[::1]:9000", "abc", None),
                vec![],
            ),
            (
                "both",
                serde_json::json!({"filesystem": {"path": "/a"}, "s3": {"endpoint": "https://x", "bucket": "abc"}}),
                vec!["spec.artifactStore"],
            ),
            ("neither", serde_json::json!({}), vec!["spec.artifactStore"]),
            (
                "relative path",
                serde_json::json!({"filesystem": {"path": "a"}}),
                vec!["spec.artifactStore.filesystem.path"],
            ),
            (
                "http off loopback",
                s3("http://10.0.0.1:9000", "abc", None),
                vec!["spec.artifactStore.s3.endpoint"],
            ),
            (
                "user info",
                s3("https://user:pw@example.com", "abc", None),
                vec!["spec.artifactStore.s3.endpoint"],
            ),
            (
                "no scheme",
                s3("s3.example.com", "abc", None),
                vec!["spec.artifactStore.s3.endpoint"],
            ),
            (
                "bad port",
                s3("https://x:99999", "abc", None),
                vec!["spec.artifactStore.s3.endpoint"],
            ),
            (
                "upper-case bucket",
                s3("https://x", "Bucket", None),
                vec!["spec.artifactStore.s3.bucket"],
            ),
            (
                "short bucket",
                s3("https://x", "ab", None),
                vec!["spec.artifactStore.s3.bucket"],
            ),
            (
                "ip bucket",
                s3("https://x", "192.168.1.1", None),
                vec!["spec.artifactStore.s3.bucket"],
            ),
            (
                "dotted bucket",
                s3("https://x", "a..b", None),
                vec!["spec.artifactStore.s3.bucket"],
            ),
            (
                "leading slash",
                s3("https://x", "abc", Some("/a")),
                vec!["spec.artifactStore.s3.prefix"],
            ),
            (
                "dot-dot prefix",
                s3("https://x", "abc", Some("a/../b")),
                vec!["spec.artifactStore.s3.prefix"],
            ),
            (
                "empty segment",
                s3("https://x", "abc", Some("a//b")),
                vec!["spec.artifactStore.s3.prefix"],
            ),
        ];
        for (name, store, want) in cases {
            let errors = validate_runtime(&with_store(store));
            let got: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
            assert_eq!(got, want, "{name}: {errors:?}");
        }
        let long = "a/".repeat(300);
        let errors = validate_runtime(&with_store(s3("https://x", "abc", Some(&long))));
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].message.len() < 400, "{}", errors[0].message);
    }
}
