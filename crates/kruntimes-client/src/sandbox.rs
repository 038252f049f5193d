//! Sandboxes: session Runs (design document 001, "SDK Sandbox and Session Model";
//! docs/session-mode.md).
//!
//! - [`Runtime::acquire_sandbox`] creates exactly one session Run and waits until it is
//!   Ready: that reserves a worker of the Runtime for it.
//! - [`Sandbox::open_session`] opens a connection to it ([`Session`]: send, receive,
//!   cancel); [`Session::close`] closes only that connection.
//! - [`Sandbox::list_files`], [`Sandbox::read_file`], [`Sandbox::status`] and
//!   [`Sandbox::renew`] are single HTTP calls.
//! - [`Sandbox::release`] ends the Run (Drain by default, or Immediate), waits for its end,
//!   deletes it and waits until it is gone.
//!
//! Every data-plane call derives its endpoint from the Run as it is now: it reads the Run
//! first and refuses a Run that is not a session, that is not Ready (reads also take a
//! Finalizing one), that is not the Run this sandbox was made from (same name, other UID),
//! or whose endpoint names another Run. Calls go to the endpoint with the connection's
//! credentials, verified with the Run's CA bundle ([`crate::endpoint`]), and are never
//! retried. HTTP failures keep the status and the server's bounded message; a transport
//! failure after a mutation was sent is reported as an unknown outcome, never as "did not
//! run".

mod transfer;

pub use transfer::{TRANSFER_IDLE_TIMEOUT, Uploaded};

use std::collections::BTreeMap;
use std::time::Duration;

use http_body_util::{BodyExt, Limited};
use hyper_util::rt::TokioIo;
use kruntimes_api::run::{EnvVar, RunMode, RunSource, SessionClass, SessionMode};
use kruntimes_api::snapshot::{
    ObjectReference, Snapshot, SnapshotPhase, SnapshotReason, SnapshotSource, SnapshotSpec,
};
use kruntimes_api::{Phase, Run, RunSpec};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use serde::Deserialize;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;

use crate::connect::Connection;
use crate::endpoint::{
    self, EndpointClients, EndpointError, Target, bounded, detail, error_answer,
    failed_before_sending,
};
use crate::function::format_duration;
use crate::session::{
    MAX_FILE_BYTES, Operation, OperationState, Session, heartbeat_interval, socket_config,
};
use crate::wait::{self, WaitError};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;

/// How long acquiring and releasing wait by default.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(300);
/// How long one HTTP call of a sandbox may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// The largest listing page: 1000 entries (docs/session-mode.md, "Files").
pub const MAX_LIST_LIMIT: u32 = 1000;
/// The largest listing answer read.
const MAX_LISTING_BYTES: usize = 16 * 1024 * 1024;
/// The gateway's reason of a 409 for a call to a Suspended session.
pub const SESSION_SUSPENDED: &str = "SessionSuspended";
/// The gateway's reason of a 409 for new work sent to a session being suspended.
pub const SESSION_SUSPENDING: &str = "SessionSuspending";
/// The largest status answer read.
const MAX_STATUS_BYTES: usize = 64 * 1024;
/// The gateway's reason of a 503 for a call to a session its owner suspended on its own
/// (`autoSuspendAfter`): the gateway asked a worker to wake it; try again after
/// `Retry-After`.
pub const SESSION_WAKING: &str = "SessionWaking";
/// The longest a call waits between two tries while its session is woken, whatever the
/// gateway's `Retry-After` says.
const WAKE_RETRY_CAP: Duration = Duration::from_secs(2);
/// How long a call keeps trying a session being woken before it gives up with the last
/// answer (a resume takes a placement, a registration and a restore).
pub const WAKE_DEADLINE: Duration = Duration::from_secs(60);

/// Why a sandbox operation failed.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The options break an admission rule; nothing was sent.
    #[error("the sandbox is invalid: {}", problems.join("; "))]
    Invalid {
        /// One line per broken rule.
        problems: Vec<String>,
    },
    /// The API server refused a request or could not be reached.
    #[error("cannot {action} in namespace {namespace}")]
    Api {
        /// What was attempted.
        action: String,
        /// The namespace.
        namespace: String,
        /// kube-rs's error.
        #[source]
        source: kube::Error,
    },
    /// No Run of that name exists.
    #[error("sandbox {name} not found in namespace {namespace}")]
    NotFound {
        /// The Run's name.
        name: String,
        /// The namespace searched.
        namespace: String,
    },
    /// The Run exists but is not a session.
    #[error("run {name} in namespace {namespace} is a {mode} Run, not a sandbox")]
    NotASession {
        /// The Run's name.
        name: String,
        /// Its namespace.
        namespace: String,
        /// `task`, `function` or `invalid`.
        mode: &'static str,
    },
    /// The Run of that name is another one than this sandbox's (deleted and recreated).
    #[error("sandbox {name} was replaced: its Run now has UID {uid}, not {expected}")]
    Replaced {
        /// The Run's name.
        name: String,
        /// The UID this sandbox was made from.
        expected: String,
        /// The UID the Run has now.
        uid: String,
    },
    /// The sandbox cannot take the call in its phase (not yet Ready, or ended).
    #[error("sandbox {name} is not ready (phase {}{})", phase.as_str(), detail(reason, message))]
    NotReady {
        /// The Run's name.
        name: String,
        /// Its phase.
        phase: Phase,
        /// `status.reason`.
        reason: Option<String>,
        /// `status.message`.
        message: Option<String>,
    },
    /// A sandbox was already created for this request ID with another spec (design
    /// document 003: the same ID with another spec is a conflict, 409).
    #[error("request ID {request_id:?} already created sandbox {name} with another spec")]
    RequestConflict {
        /// The request ID.
        request_id: String,
        /// The Run it created.
        name: String,
    },
    /// The sandbox this request ID created has ended (or is being deleted): the ID stays
    /// reserved by that Run (its tombstone), so it never creates a second sandbox.
    #[error("request ID {request_id:?} already created sandbox {name}, which ended {}", phase.as_str())]
    RequestIdReserved {
        /// The request ID.
        request_id: String,
        /// The Run it created.
        name: String,
        /// Its phase now.
        phase: Phase,
    },
    /// The sandbox is Suspended: its files are kept in a Snapshot and no worker holds it
    /// (the gateway's 409 `SessionSuspended`). [`Sandbox::resume`] it first.
    #[error("sandbox {name} is suspended; resume it first")]
    Suspended {
        /// The Run's name.
        name: String,
    },
    /// The sandbox's owner suspended it on its own (`autoSuspendAfter`) and the gateway is
    /// waking it (503 `SessionWaking`): nothing was sent; the calls of this SDK try again
    /// after `retry_after` until it is Ready ([`WAKE_DEADLINE`]), so a caller sees this only
    /// when the wake did not finish in time.
    #[error("sandbox {name} is being woken from an auto-suspend; try again")]
    Waking {
        /// The Run's name.
        name: String,
        /// The gateway's `Retry-After`.
        retry_after: Duration,
    },
    /// The sandbox is being suspended (`spec.suspend: true`, its worker capturing it): it
    /// takes no new operations or uploads (the gateway's 409 `SessionSuspending`).
    #[error("sandbox {name} is being suspended; it takes no new work until it is resumed")]
    Suspending {
        /// The Run's name.
        name: String,
    },
    /// A suspend or resume this handle asked for was overtaken by a newer, opposite one
    /// before it took effect: the Run's `metadata.generation` moved past the one the
    /// request produced, with `spec.suspend` the other way. Waiting on would never end.
    #[error(
        "the {what} of sandbox {name} (generation {generation}) was overtaken by generation {current_generation}"
    )]
    Superseded {
        /// The Run's name.
        name: String,
        /// `suspend` or `resume`.
        what: &'static str,
        /// The generation the request produced.
        generation: i64,
        /// The Run's generation that overtook it.
        current_generation: i64,
    },
    /// The Run ended while waiting for it to become Ready.
    #[error("sandbox {name} ended {} before it was ready{}", phase.as_str(), detail(reason, message))]
    Ended {
        /// The Run's name.
        name: String,
        /// The terminal phase.
        phase: Phase,
        /// `status.reason`.
        reason: Option<String>,
        /// `status.message`.
        message: Option<String>,
    },
    /// The Run was deleted while waiting for it.
    #[error("sandbox {name} was deleted while waiting for it")]
    Deleted {
        /// The Run's name.
        name: String,
    },
    /// A checkpoint did not become Ready: it failed (`reason`, `message`), was deleted,
    /// or `limit` passed (`reason` `Timeout`; the capture may still complete).
    #[error("checkpoint {name} of sandbox {sandbox} is not Ready: {reason}{}", detail(&None, message))]
    Checkpoint {
        /// The Snapshot's name.
        name: String,
        /// The sandbox's Run name.
        sandbox: String,
        /// `status.reason` of the Failed Snapshot, `Deleted` or `Timeout`.
        reason: String,
        /// `status.message`, bounded.
        message: Option<String>,
    },
    /// A wait passed its limit; the Run goes on.
    #[error(
        "sandbox {name} was not {what} after {} (phase {}{}); it goes on",
        format_duration(*limit),
        phase.as_str(),
        crate::wait::why_text(why)
    )]
    WaitTimedOut {
        /// The Run's name.
        name: String,
        /// `ready`, `ended` or `gone`.
        what: &'static str,
        /// How long was waited.
        limit: Duration,
        /// The phase last seen.
        phase: Phase,
        /// Why the scheduler had not placed it (`REASON: MESSAGE` of `Scheduled=False`),
        /// or empty.
        why: String,
    },
    /// The watch on the Run failed.
    #[error("the watch on sandbox {name} failed")]
    Watch {
        /// The Run's name.
        name: String,
        /// kube-runtime's error.
        #[source]
        source: kube::runtime::wait::Error,
    },
    /// The Run's endpoint is not usable.
    #[error("the endpoint {url:?} of sandbox {name} is not usable: {problem}")]
    BadEndpoint {
        /// The Run's name.
        name: String,
        /// `status.endpoint.url`.
        url: String,
        /// What is wrong.
        problem: String,
    },
    /// No client could be built for the endpoint.
    #[error("cannot build a client for the endpoint {url}")]
    Client {
        /// The endpoint's origin.
        url: String,
        /// kube-rs's reason.
        #[source]
        source: kube::Error,
    },
    /// The connection failed before the request was sent: nothing happened.
    #[error("cannot reach {url}; nothing was sent")]
    NotSent {
        /// The URL.
        url: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
    /// The gateway answered with an error status.
    #[error("the gateway answered {status} {reason}: {message}")]
    Http {
        /// The HTTP status.
        status: u16,
        /// Machine-readable (`NotFound`, `Conflict`, …).
        reason: String,
        /// At most 1 KiB, one line.
        message: String,
    },
    /// The connection broke after the request was sent. For a mutation the outcome is
    /// unknown.
    #[error("the connection to {url} broke after the request was sent{}", if *mutation { "; it may or may not have taken effect" } else { "" })]
    Transport {
        /// The URL.
        url: String,
        /// Whether the request changes anything.
        mutation: bool,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// No answer came within the call's limit.
    #[error("no answer from {url} within {}", format_duration(*limit))]
    NoAnswer {
        /// The URL.
        url: String,
        /// The limit that passed.
        limit: Duration,
    },
    /// An answer that is not what the API says.
    #[error("the answer of {url} is not understood: {problem}")]
    InvalidAnswer {
        /// The URL.
        url: String,
        /// What is wrong.
        problem: String,
    },
    /// The request is malformed; nothing was sent.
    #[error("the request is malformed: {problem}")]
    BadRequest {
        /// What is wrong.
        problem: String,
    },
    /// Something is larger than its limit; nothing was sent.
    #[error("{what} is larger than the limit of {limit} bytes")]
    TooLarge {
        /// What.
        what: String,
        /// The limit.
        limit: usize,
    },
    /// The path names a directory: list it instead.
    #[error("{path} is a directory")]
    IsADirectory {
        /// The path.
        path: String,
    },
    /// The session refused a frame (the operation did not run, the cancel did nothing).
    #[error("the session refused it: {status} {reason}: {message}")]
    Rejected {
        /// The operation the frame named.
        operation_id: Option<String>,
        /// An HTTP-like status (429 queue full, 409 draining or repeated ID, 400 …).
        status: u16,
        /// Machine-readable.
        reason: String,
        /// Bounded.
        message: String,
    },
    /// A frame was sent but its outcome is not known: the connection broke or no answer
    /// came. The operation may or may not run.
    #[error("outcome unknown: {what}")]
    OutcomeUnknown {
        /// The operation, when known.
        operation_id: Option<String>,
        /// What happened.
        what: String,
    },
    /// The session's connection is closed; nothing was sent.
    #[error("the session's connection is closed")]
    Closed,
    /// The gateway ended the connection (authorization lapsed, shutting down).
    #[error("the gateway ended the connection: {status} {reason}: {message}")]
    ConnectionEnded {
        /// An HTTP-like status.
        status: u16,
        /// Machine-readable.
        reason: String,
        /// Bounded.
        message: String,
    },
    /// A private heartbeat was refused: the lease was not renewed (the session may have
    /// ended).
    #[error("a heartbeat was refused")]
    Heartbeat(#[source] Box<SandboxError>),
    /// The gateway broke the session protocol; the connection was closed.
    #[error("the gateway broke the session protocol: {problem}")]
    Protocol {
        /// What it did.
        problem: String,
    },
}

impl SandboxError {
    /// Whether something may have happened although no answer says so. Retry such a call
    /// only if doing it twice is safe.
    pub fn outcome_unknown(&self) -> bool {
        match self {
            SandboxError::OutcomeUnknown { .. } => true,
            SandboxError::Transport { mutation, .. } => *mutation,
            SandboxError::Http { status, reason, .. } => {
                matches!(status, 502 | 504) || reason == "OutcomeUnknown"
            }
            SandboxError::Invalid { .. }
            | SandboxError::Api { .. }
            | SandboxError::NotFound { .. }
            | SandboxError::NotASession { .. }
            | SandboxError::Replaced { .. }
            | SandboxError::NotReady { .. }
            | SandboxError::Suspended { .. }
            | SandboxError::Waking { .. }
            | SandboxError::Suspending { .. }
            | SandboxError::Superseded { .. }
            | SandboxError::Ended { .. }
            | SandboxError::RequestConflict { .. }
            | SandboxError::RequestIdReserved { .. }
            | SandboxError::Deleted { .. }
            | SandboxError::Checkpoint { .. }
            | SandboxError::WaitTimedOut { .. }
            | SandboxError::Watch { .. }
            | SandboxError::BadEndpoint { .. }
            | SandboxError::Client { .. }
            | SandboxError::NotSent { .. }
            | SandboxError::NoAnswer { .. }
            | SandboxError::InvalidAnswer { .. }
            | SandboxError::BadRequest { .. }
            | SandboxError::TooLarge { .. }
            | SandboxError::IsADirectory { .. }
            | SandboxError::Rejected { .. }
            | SandboxError::Closed
            | SandboxError::ConnectionEnded { .. }
            | SandboxError::Heartbeat(_)
            | SandboxError::Protocol { .. } => false,
        }
    }

    /// The HTTP (or HTTP-like) status, when the gateway gave one.
    pub fn status(&self) -> Option<u16> {
        match self {
            SandboxError::Http { status, .. }
            | SandboxError::Rejected { status, .. }
            | SandboxError::ConnectionEnded { status, .. } => Some(*status),
            SandboxError::Heartbeat(inner) => inner.status(),
            // The API's answer to a create it cannot serve: 409 Conflict.
            SandboxError::RequestConflict { .. } | SandboxError::RequestIdReserved { .. } => {
                Some(409)
            }
            // The gateway's 409 SessionSuspended / SessionSuspending.
            SandboxError::Suspended { .. } | SandboxError::Suspending { .. } => Some(409),
            SandboxError::Waking { .. } => Some(503),
            // As the Python SDK's Superseded: a conflict of intents.
            SandboxError::Superseded { .. } => Some(409),
            _ => None,
        }
    }

    fn from_endpoint(error: EndpointError) -> SandboxError {
        match error {
            EndpointError::NotReady {
                name,
                phase,
                reason,
                message,
            } => SandboxError::NotReady {
                name,
                phase,
                reason,
                message,
            },
            EndpointError::Bad { name, url, problem } => {
                SandboxError::BadEndpoint { name, url, problem }
            }
            EndpointError::Client { url, source } => SandboxError::Client { url, source },
        }
    }
}

// ---------------------------------------------------------------------------------------
// Acquiring
// ---------------------------------------------------------------------------------------

/// How to acquire a sandbox.
#[derive(Clone, Debug, PartialEq)]
pub struct AcquireOptions {
    /// The Run's name prefix (`metadata.generateName`); default `<runtime>-sandbox-`.
    /// Ignored when `name` is set.
    pub generate_name: Option<String>,
    /// The Run's exact name.
    pub name: Option<String>,
    /// End the sandbox (Timeout, LeaseExpired) when no heartbeat arrives for this long;
    /// whole seconds, rounded up. `None`: no lease, no heartbeats needed.
    pub lease_timeout: Option<Duration>,
    /// Queued operations at most (1..32; the platform's limit otherwise).
    pub queue_size: Option<i32>,
    /// The longest one operation may run (at most 5 minutes).
    pub operation_timeout: Option<Duration>,
    /// End the sandbox (Timeout, IdleTimeout) after this long without an operation or file
    /// write (`spec.mode.session.idleTimeout`); it may only lower the platform's idle TTL
    /// (a longer one is clamped to it). `None`: the platform's TTL (168h by default).
    pub idle_timeout: Option<Duration>,
    /// Suspend the sandbox after this long without an operation or file write
    /// (`spec.mode.session.autoSuspendAfter`, at least a second; each suspend costs a
    /// capture). The next call wakes it: the SDK's calls retry through the wake.
    /// `None`: never on idle.
    pub auto_suspend_after: Option<Duration>,
    /// Environment variables of every command.
    pub env: Vec<EnvVar>,
    /// Labels of the Run (`metadata.labels`), to find sandboxes by.
    pub labels: BTreeMap<String, String>,
    /// A program text written into the workspace before it is Ready (`spec.source`).
    pub source: Option<String>,
    /// The longest the whole reservation may last (`spec.timeout`).
    pub timeout: Option<Duration>,
    /// How long to wait until it is Ready.
    pub wait: Duration,
    /// A creation request ID (1 to 128 bytes of `[A-Za-z0-9._-]`): a retry with the same
    /// ID and the same options returns the same sandbox, one with other options fails
    /// [`SandboxError::RequestConflict`], and after the sandbox ended the ID stays reserved
    /// ([`SandboxError::RequestIdReserved`]). The Run's name is derived from it
    /// ([`request_run_name`]), so concurrent creates race in the API server, which keeps
    /// one; `name` and `generate_name` must then be unset.
    pub request_id: Option<String>,
    /// The machine's lifetime class (`spec.mode.session.class`, from the design document
    /// `fn/machines/machines.go`); `None`: `Exec`, as a sandbox is.
    pub class: Option<SessionClass>,
    /// Start from this Snapshot's files, a fork (`spec.source.snapshot`; set its `uid` to
    /// pin the exact capture). `source` must then be unset.
    pub from_snapshot: Option<ObjectReference>,
    /// Create the sandbox Suspended (`spec.suspend: true`): with `from_snapshot` it takes
    /// no slot until it is resumed, and the acquire returns once it is Suspended.
    pub suspended: bool,
    /// The project Workspace to restore before Ready and commit to at the end
    /// (`spec.workspace`). The sandbox is then named after it (the Run's name is the
    /// Workspace's lock): `name`, `generate_name` and `request_id` must be unset or the
    /// same name, and a second sandbox of the Workspace gets 409 while the first exists.
    pub workspace: Option<String>,
}

/// The annotation that carries a sandbox's creation request ID.
pub const REQUEST_ID_ANNOTATION: &str = "kruntimes.io/request-id";
/// The annotation that carries the SHA-256 digest of the spec and labels a request ID
/// created its sandbox with.
pub const REQUEST_DIGEST_ANNOTATION: &str = "kruntimes.io/request-digest";

/// The Run name of the sandbox created for `request_id`: `req-` and the first 20 bytes of
/// the ID's SHA-256 digest in hex (a DNS label whatever the ID spells).
pub fn request_run_name(request_id: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(request_id.as_bytes());
    format!("req-{}", hex::encode(&digest[..20]))
}

/// The digest of what a request ID creates: the spec and the labels.
fn request_digest(run: &Run) -> String {
    use sha2::Digest;
    let text = serde_json::to_vec(&(&run.spec, &run.metadata.labels)).unwrap_or_default();
    hex::encode(sha2::Sha256::digest(&text))
}

impl Default for AcquireOptions {
    fn default() -> AcquireOptions {
        AcquireOptions {
            generate_name: None,
            name: None,
            lease_timeout: None,
            queue_size: None,
            operation_timeout: None,
            idle_timeout: None,
            auto_suspend_after: None,
            env: Vec::new(),
            labels: BTreeMap::new(),
            source: None,
            timeout: None,
            wait: DEFAULT_WAIT,
            request_id: None,
            class: None,
            from_snapshot: None,
            suspended: false,
            workspace: None,
        }
    }
}

impl AcquireOptions {
    /// The session Run on `runtime` these options describe, checked against the admission
    /// rules the API server applies.
    pub fn to_run(&self, runtime: &str) -> Result<Run, SandboxError> {
        let invalid = |problem: String| SandboxError::Invalid {
            problems: vec![problem],
        };
        let lease_timeout_seconds =
            match self.lease_timeout {
                None => None,
                Some(d) => {
                    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
                    if secs == 0 {
                        return Err(invalid(
                            "the lease timeout must be at least one second".to_string(),
                        ));
                    }
                    Some(i32::try_from(secs).map_err(|_| {
                        invalid(format!("the lease timeout of {secs}s is too long"))
                    })?)
                }
            };
        let mut spec = RunSpec::task(runtime.to_string(), String::new());
        spec.mode = RunMode {
            session: Some(SessionMode {
                lease_timeout_seconds,
                queue_size: self.queue_size,
                operation_timeout: self.operation_timeout.map(format_duration),
                idle_timeout: self.idle_timeout.map(format_duration),
                auto_suspend_after: self.auto_suspend_after.map(format_duration),
                on_worker_loss: None,
                class: self.class,
            }),
            ..RunMode::default()
        };
        spec.source = (self.source.is_some() || self.from_snapshot.is_some()).then(|| RunSource {
            inline: self.source.clone(),
            snapshot: self.from_snapshot.clone(),
        });
        spec.suspend = self.suspended.then_some(true);
        spec.env = (!self.env.is_empty()).then(|| self.env.clone());
        spec.timeout = self.timeout.map(format_duration);
        spec.workspace = self
            .workspace
            .clone()
            .map(|name| kruntimes_api::run::WorkspaceRef { name });
        let mut problems: Vec<String> = kruntimes_api::admission::validate_create(&spec)
            .iter()
            .map(ToString::to_string)
            .collect();
        if let Some(workspace) = &self.workspace
            && (self.request_id.is_some()
                || self.generate_name.is_some()
                || self.name.as_ref().is_some_and(|name| name != workspace))
        {
            problems.push(format!(
                "a sandbox with a Workspace is named after it: leave name, generate_name and \
                 request_id unset (the name is {workspace:?})"
            ));
        }
        if !problems.is_empty() {
            return Err(SandboxError::Invalid { problems });
        }
        // The registration-cleanup finalizer goes on at create: runtimed would add it before
        // it registers the session, and finds it there, which saves the claim one API write.
        // A Run deleted before any worker took it is released by the controller-manager.
        let finalizers = Some(vec![
            kruntimes_api::lifecycle::REGISTRATION_FINALIZER.to_string(),
        ]);
        let labels = (!self.labels.is_empty()).then(|| self.labels.clone());
        if let Some(request_id) = &self.request_id {
            if !kruntimes_api::lifecycle::is_operation_id(request_id) {
                return Err(invalid(
                    "a request ID is 1 to 128 bytes of [A-Za-z0-9._-]".to_string(),
                ));
            }
            if self.name.is_some() || self.generate_name.is_some() {
                return Err(invalid(
                    "a request ID names the sandbox itself: leave name and generate_name unset"
                        .to_string(),
                ));
            }
            let mut run = Run {
                metadata: ObjectMeta {
                    name: Some(request_run_name(request_id)),
                    finalizers,
                    labels,
                    ..ObjectMeta::default()
                },
                spec,
                status: None,
            };
            let digest = request_digest(&run);
            run.metadata.annotations = Some(
                [
                    (REQUEST_ID_ANNOTATION.to_string(), request_id.clone()),
                    (REQUEST_DIGEST_ANNOTATION.to_string(), digest),
                ]
                .into(),
            );
            return Ok(run);
        }
        let metadata = match self.name.as_ref().or(self.workspace.as_ref()) {
            Some(name) => ObjectMeta {
                name: Some(name.clone()),
                finalizers,
                labels,
                ..ObjectMeta::default()
            },
            None => ObjectMeta {
                generate_name: Some(
                    self.generate_name
                        .clone()
                        .unwrap_or_else(|| format!("{runtime}-sandbox-")),
                ),
                finalizers,
                labels,
                ..ObjectMeta::default()
            },
        };
        Ok(Run {
            metadata,
            spec,
            status: None,
        })
    }
}

/// A Runtime: the pool sandboxes are acquired from.
#[derive(Clone)]
pub struct Runtime {
    connection: Connection,
    name: String,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("namespace", &self.connection.namespace())
            .field("name", &self.name)
            .finish()
    }
}

impl Connection {
    /// The Runtime `name` in this connection's namespace.
    pub fn runtime(&self, name: impl Into<String>) -> Runtime {
        Runtime {
            connection: self.clone(),
            name: name.into(),
        }
    }

    /// The existing sandbox `name` (a session Run, in any phase).
    pub async fn sandbox(&self, name: &str) -> Result<Sandbox, SandboxError> {
        let api: Api<Run> = Api::namespaced(self.client().clone(), self.namespace());
        let run = read_run(&api, self.namespace(), name).await?;
        Sandbox::from_run(self, api, &run)
    }
}

impl Runtime {
    /// The Runtime's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Creates one session Run on this Runtime and waits until it is Ready; see
    /// [`Runtime::acquire_sandbox_with`].
    pub async fn acquire_sandbox(&self, options: &AcquireOptions) -> Result<Sandbox, SandboxError> {
        self.acquire_sandbox_with(options, |_| {}).await
    }

    /// [`Runtime::acquire_sandbox`], calling `on_update` with the Run when it is created
    /// and with every state seen while waiting (for progress displays; the first call
    /// names the Run).
    ///
    /// Errors: [`SandboxError::Invalid`] before any request; [`SandboxError::Api`] when the
    /// API server refuses the Run; [`SandboxError::Ended`] when it ends before Ready (with
    /// its reason); [`SandboxError::WaitTimedOut`] after `options.wait` (the Run goes on:
    /// release it); [`SandboxError::Deleted`], [`SandboxError::Watch`]; and the checks of
    /// a Ready sandbox (its endpoint must name it).
    pub async fn acquire_sandbox_with(
        &self,
        options: &AcquireOptions,
        on_update: impl Fn(&Run) + Send + Sync,
    ) -> Result<Sandbox, SandboxError> {
        let run = options.to_run(&self.name)?;
        let namespace = self.connection.namespace().to_string();
        let api: Api<Run> = Api::namespaced(self.connection.client().clone(), &namespace);
        let created = match api.create(&PostParams::default(), &run).await {
            Ok(created) => created,
            // A request ID's Run exists: an earlier try (or a racing one) created it.
            Err(kube::Error::Api(status))
                if status.code == 409
                    && status.reason == "AlreadyExists"
                    && options.request_id.is_some() =>
            {
                self.resolve_request(&api, &run, &namespace).await?
            }
            Err(source) => {
                return Err(SandboxError::Api {
                    action: format!("create a session Run on Runtime {}", self.name),
                    namespace: namespace.clone(),
                    source,
                });
            }
        };
        on_update(&created);
        let name = created.name_any();
        let uid = created.uid().unwrap_or_default();
        let suspended = options.suspended;
        let run = wait::until_phase(
            &api,
            &name,
            Some(&uid),
            created.phase(),
            options.wait,
            on_update,
            |phase| wait::ready_or_ended(phase) || (suspended && phase == Phase::Suspended),
        )
        .await
        .map_err(|e| wait_error(&name, "ready", options.wait, e))?;
        let phase = run.phase();
        if suspended && phase == Phase::Suspended {
            return Sandbox::from_run(&self.connection, api, &run);
        }
        if phase != Phase::Ready {
            let status = run.status.as_ref();
            return Err(SandboxError::Ended {
                name,
                phase,
                reason: status.and_then(|s| s.reason.clone()),
                message: status.and_then(|s| s.message.clone()),
            });
        }
        let sandbox = Sandbox::from_run(&self.connection, api, &run)?;
        // A Ready sandbox must be callable: its endpoint names it.
        session_target(&run, &sandbox.uid, Use::Session)?;
        Ok(sandbox)
    }
}

impl Runtime {
    /// The Run a request ID already created, when it was created with the same spec and
    /// has not ended; otherwise why the request cannot be served.
    async fn resolve_request(
        &self,
        api: &Api<Run>,
        wanted: &Run,
        namespace: &str,
    ) -> Result<Run, SandboxError> {
        let name = wanted.name_any();
        let annotation = |run: &Run, key: &str| {
            run.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(key).cloned())
        };
        let request_id = annotation(wanted, REQUEST_ID_ANNOTATION).unwrap_or_default();
        let existing = api.get(&name).await.map_err(|source| SandboxError::Api {
            action: format!("read the sandbox {name} of request ID {request_id:?}"),
            namespace: namespace.to_string(),
            source,
        })?;
        let same_request =
            annotation(&existing, REQUEST_ID_ANNOTATION).as_deref() == Some(request_id.as_str());
        let same_spec = annotation(&existing, REQUEST_DIGEST_ANNOTATION)
            == annotation(wanted, REQUEST_DIGEST_ANNOTATION);
        if !same_request || !same_spec {
            return Err(SandboxError::RequestConflict { request_id, name });
        }
        if existing.phase().is_terminal() || existing.metadata.deletion_timestamp.is_some() {
            return Err(SandboxError::RequestIdReserved {
                request_id,
                name,
                phase: existing.phase(),
            });
        }
        Ok(existing)
    }
}

fn wait_error(name: &str, what: &'static str, limit: Duration, error: WaitError) -> SandboxError {
    match error {
        WaitError::TimedOut { phase, why } => SandboxError::WaitTimedOut {
            name: name.to_string(),
            what,
            limit,
            phase,
            why,
        },
        WaitError::Deleted => SandboxError::Deleted {
            name: name.to_string(),
        },
        WaitError::Watch(source) => SandboxError::Watch {
            name: name.to_string(),
            source,
        },
    }
}

/// Where a wait for a suspend or resume stands (see [`settle`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settle {
    Waiting,
    /// At the target, or ended.
    Done,
    Superseded {
        generation: i64,
        current_generation: i64,
    },
}

/// Whether a wait for a suspend (`suspend`) or a resume has settled in `run`: ended, at
/// the target (Suspended; or Ready in an incarnation above `incarnation`, or Ready and not
/// asked to suspend), or overtaken: the request produced generation `asked` and the Run
/// is at a later generation with `spec.suspend` the other way.
fn settle(run: &Run, suspend: bool, asked: Option<i64>, incarnation: i64) -> Settle {
    let phase = run.phase();
    if phase.is_terminal() {
        return Settle::Done;
    }
    let current = run.metadata.generation.unwrap_or(1);
    let wants_suspend = run.spec.suspend_requested();
    if let Some(generation) = asked
        && wants_suspend != suspend
        && current > generation
    {
        return Settle::Superseded {
            generation,
            current_generation: current,
        };
    }
    let at_target = if suspend {
        phase == Phase::Suspended
    } else {
        phase == Phase::Ready && (run.incarnation() > incarnation || !wants_suspend)
    };
    if at_target {
        Settle::Done
    } else {
        Settle::Waiting
    }
}

async fn read_run(api: &Api<Run>, namespace: &str, name: &str) -> Result<Run, SandboxError> {
    api.get_opt(name)
        .await
        .map_err(|source| SandboxError::Api {
            action: format!("get run {name}"),
            namespace: namespace.to_string(),
            source,
        })?
        .ok_or_else(|| SandboxError::NotFound {
            name: name.to_string(),
            namespace: namespace.to_string(),
        })
}

// ---------------------------------------------------------------------------------------
// Checking the Run before each call
// ---------------------------------------------------------------------------------------

/// What a call needs of the sandbox's phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Use {
    /// Opening a session (operations): Ready only.
    Session,
    /// Status, lease, reads and listings: Ready or Finalizing.
    Read,
}

/// The endpoint of `run`, checked: a session Run with UID `uid`, in a phase that takes
/// `usage`, whose endpoint ends with `/sessions/<uid>`.
fn session_target(run: &Run, uid: &str, usage: Use) -> Result<Target, SandboxError> {
    let name = run.name_any();
    let namespace = run.namespace().unwrap_or_default();
    if run.spec.mode.session.is_none() {
        return Err(SandboxError::NotASession {
            name,
            namespace,
            mode: run.spec.mode.kind().map_or("invalid", |k| k.as_str()),
        });
    }
    let current = run.uid().unwrap_or_default();
    if current != uid {
        return Err(SandboxError::Replaced {
            name,
            expected: uid.to_string(),
            uid: current,
        });
    }
    let phase = run.phase();
    // Suspended (or being suspended) by its owner for idleness: the call goes to the
    // gateway, which wakes the session (503 SessionWaking), at the endpoint it kept.
    let wakeable = kruntimes_api::lifecycle::auto_suspended(run);
    if phase == Phase::Suspended && !wakeable {
        return Err(SandboxError::Suspended { name });
    }
    if phase == Phase::Ready
        && usage == Use::Session
        && !wakeable
        && run.spec.suspend_requested()
        && !kruntimes_api::lifecycle::suspend_deferred(run.status.as_ref(), run.metadata.generation)
    {
        return Err(SandboxError::Suspending { name });
    }
    let takes = match phase {
        Phase::Ready => true,
        Phase::Finalizing => usage == Use::Read,
        Phase::Suspended => wakeable,
        Phase::Pending
        | Phase::Scheduled
        | Phase::Running
        | Phase::Succeeded
        | Phase::Failed
        | Phase::Timeout
        | Phase::Cancelled => false,
    };
    if !takes {
        let status = run.status.as_ref();
        return Err(SandboxError::NotReady {
            name,
            phase,
            reason: status.and_then(|s| s.reason.clone()),
            message: status.and_then(|s| s.message.clone()),
        });
    }
    let target = endpoint::target(run).map_err(SandboxError::from_endpoint)?;
    let names_this_run = target
        .path
        .split('?')
        .next()
        .and_then(|path| path.strip_suffix(uid))
        .is_some_and(|rest| rest.ends_with("/sessions/"));
    if !names_this_run {
        return Err(SandboxError::BadEndpoint {
            name,
            url: target.url,
            problem: format!("it does not name this Run (UID {uid})"),
        });
    }
    Ok(target)
}

// ---------------------------------------------------------------------------------------
// The sandbox
// ---------------------------------------------------------------------------------------

/// The status of a sandbox's session (`GET {base}`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxStatus {
    /// The Run's UID.
    #[serde(rename = "runUID", default)]
    pub run_uid: String,
    /// The Run's name.
    #[serde(default)]
    pub run_name: String,
    /// The Run's phase as the owner knows it.
    #[serde(default)]
    pub phase: String,
    /// The session's state (`Ready`, `Closing`, …).
    #[serde(default)]
    pub state: String,
    /// The worker Pod that serves it.
    #[serde(default)]
    pub served_by: String,
    /// Operations waiting, the running one excluded.
    #[serde(default)]
    pub queued: u32,
    /// The operation running now, if any.
    #[serde(default)]
    pub running_operation_id: String,
    /// The last sequence number the session assigned.
    #[serde(default)]
    pub last_sequence: u64,
    /// The effective queue size.
    #[serde(default)]
    pub queue_size: u32,
    /// The effective operation timeout, in seconds.
    #[serde(default)]
    pub operation_timeout_seconds: u64,
    /// The lease, in seconds; 0 without one.
    #[serde(default)]
    pub lease_timeout_seconds: u32,
    /// When the lease expires without a heartbeat (RFC 3339).
    #[serde(default)]
    pub lease_expires_at: Option<String>,
}

/// One entry of a directory.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FileEntry {
    /// Relative to the workspace.
    pub path: String,
    /// A directory.
    #[serde(default)]
    pub directory: bool,
    /// A regular file's size; 0 otherwise.
    #[serde(default)]
    pub size_bytes: u64,
    /// A symbolic link.
    #[serde(default)]
    pub symlink: bool,
}

/// One page of a directory listing.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FilePage {
    /// Direct children, in the byte-wise order of their names.
    #[serde(default)]
    pub entries: Vec<FileEntry>,
    /// Pass it as [`ListFilesOptions::page_token`] for the next page; empty: no later entry
    /// was seen.
    #[serde(default)]
    pub next_page_token: String,
}

/// Which page of which directory to list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListFilesOptions {
    /// The directory, relative to the workspace; empty: the workspace.
    pub directory: String,
    /// Entries per page, 1..1000; 0 leaves it to the server (100).
    pub limit: u32,
    /// The previous page's [`FilePage::next_page_token`]; empty: the first page.
    pub page_token: String,
}

/// How to release a sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReleaseOptions {
    /// Cancel running and queued work at once (ends Cancelled) instead of draining it
    /// (finishes accepted work, exports artifacts, ends Succeeded).
    pub immediate: bool,
    /// How long to wait for the end, and again for the deletion.
    pub wait: Duration,
}

impl Default for ReleaseOptions {
    fn default() -> ReleaseOptions {
        ReleaseOptions {
            immediate: false,
            wait: DEFAULT_WAIT,
        }
    }
}

/// Percent-encodes `text` for a query string (everything but unreserved characters).
fn query_value(text: &str) -> String {
    let mut encoded = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

/// The query of a listing request; the `limit` is checked, and left out when 0.
fn listing_query(options: &ListFilesOptions) -> Result<String, SandboxError> {
    let mut query = format!("path={}&directory=true", query_value(&options.directory));
    if options.limit > MAX_LIST_LIMIT {
        return Err(SandboxError::BadRequest {
            problem: format!("a listing page is 1 to {MAX_LIST_LIMIT} entries"),
        });
    }
    if options.limit > 0 {
        query.push_str(&format!("&limit={}", options.limit));
    }
    if !options.page_token.is_empty() {
        query.push_str(&format!("&pageToken={}", query_value(&options.page_token)));
    }
    Ok(query)
}

/// Sends `request` once: a failure before it went out is [`SandboxError::NotSent`], one
/// after is [`SandboxError::Transport`] (an unknown outcome for a `mutation`).
async fn send(
    client: &kube::Client,
    request: http::Request<kube::client::Body>,
    url: &str,
    mutation: bool,
) -> Result<http::Response<kube::client::Body>, SandboxError> {
    client.send(request).await.map_err(|e| {
        if failed_before_sending(&e) {
            SandboxError::NotSent {
                url: url.to_string(),
                source: e,
            }
        } else {
            SandboxError::Transport {
                url: url.to_string(),
                mutation,
                source: Box::new(e),
            }
        }
    })
}

/// One HTTP call to the session's endpoint.
struct Call<'a> {
    method: http::Method,
    suffix: &'a str,
    /// It changes the sandbox: a transport error after sending leaves the outcome unknown.
    mutation: bool,
    /// The most bytes of the answer read.
    limit: usize,
    /// A JSON body.
    body: Option<Vec<u8>>,
    usage: Use,
    /// How long the answer may take.
    deadline: Duration,
}

/// The longest operation timeout a session allows (docs/session-mode.md, "Limits").
const MAX_OPERATION_TIMEOUT: Duration = Duration::from_secs(300);
/// The largest `operations:execute` answer read: two 1 MiB streams in base64 and the rest.
const MAX_EXECUTE_ANSWER_BYTES: usize = 3 * 1024 * 1024;

/// One operation run to its end ([`Sandbox::execute`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Executed {
    /// The operation's ID (the owner's `op-<n>` when none was given).
    pub operation_id: String,
    /// The sequence number of its completion in the session.
    pub sequence: u64,
    /// How it ended.
    pub state: OperationState,
    /// `Completed`, `NonZeroExitCode`, `Signaled`, `Timeout`, `StartFailed`, a file
    /// operation's reason, …
    pub reason: String,
    /// What the runtime server said of it (never command output).
    pub message: String,
    /// A command's exit code as a shell gives it; `None` for a file operation.
    pub exit_code: Option<i32>,
    /// The signal that killed the command.
    pub signal: Option<i32>,
    /// The command's timeout ran out (`exit_code` 124).
    pub timed_out: bool,
    /// How long it ran.
    pub duration: Duration,
    /// What the command wrote to standard output, at most 1 MiB.
    pub stdout: Vec<u8>,
    /// What it wrote to standard error, at most 1 MiB.
    pub stderr: Vec<u8>,
    /// More was written to standard output than `stdout` holds.
    pub stdout_truncated: bool,
    /// More was written to standard error than `stderr` holds.
    pub stderr_truncated: bool,
}

/// The JSON of an `operations:execute` answer.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ExecutedJson {
    operation_id: String,
    sequence: u64,
    state: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    message: String,
    exit_code: Option<i32>,
    signal: Option<i32>,
    #[serde(default)]
    timed_out: bool,
    #[serde(default)]
    duration_ms: f64,
    #[serde(default)]
    stdout: String,
    #[serde(default)]
    stderr: String,
    #[serde(default)]
    stdout_truncated: bool,
    #[serde(default)]
    stderr_truncated: bool,
}

impl ExecutedJson {
    fn decode(self) -> Result<Executed, String> {
        let state = match self.state.as_str() {
            "Succeeded" => OperationState::Succeeded,
            "Failed" => OperationState::Failed,
            "Cancelled" => OperationState::Cancelled,
            "TimedOut" => OperationState::TimedOut,
            other => return Err(format!("unknown operation state {other:?}")),
        };
        let stream = |name: &str, text: &str| {
            BASE64
                .decode(text)
                .map_err(|e| format!("{name} is not base64: {e}"))
        };
        Ok(Executed {
            operation_id: self.operation_id,
            sequence: self.sequence,
            state,
            reason: self.reason,
            message: self.message,
            exit_code: self.exit_code,
            signal: self.signal,
            timed_out: self.timed_out,
            duration: Duration::try_from_secs_f64(self.duration_ms / 1000.0).unwrap_or_default(),
            stdout: stream("stdout", &self.stdout)?,
            stderr: stream("stderr", &self.stderr)?,
            stdout_truncated: self.stdout_truncated,
            stderr_truncated: self.stderr_truncated,
        })
    }
}

/// Delete parameters that delete the Run with UID `uid` only (a UID precondition): never
/// a later Run of the same name.
fn this_run_only(uid: &str) -> DeleteParams {
    DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(uid.to_string()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    }
}

/// Asks Run `name` (UID `uid`) to end at once and deletes it, without waiting:
/// [`Sandbox::end_and_delete`], and the machines view's cleanup of a failed claim. A Run
/// gone (404), ended already (422 on the termination) or replaced (409 on the delete) is
/// fine.
pub(crate) async fn end_and_delete(
    api: &Api<Run>,
    namespace: &str,
    name: &str,
    uid: &str,
) -> Result<(), SandboxError> {
    let api_error = |action: String, source| SandboxError::Api {
        action,
        namespace: namespace.to_string(),
        source,
    };
    // Only this Run: a Run of the same name made since (the next Dev machine of a
    // project) is never asked to end. Its resourceVersion makes the patch conditional on
    // the Run just read.
    let current = match api.get_opt(name).await {
        Ok(Some(current)) if current.metadata.uid.as_deref() == Some(uid) => current,
        Ok(_) => return Ok(()),
        Err(e) => return Err(api_error(format!("read run {name}"), e)),
    };
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": current.metadata.resource_version},
        "spec": {"termination": {"mode": "Immediate"}},
    });
    match api
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 404 => return Ok(()),
        // Ended already (a termination is refused on a terminal Run), or changed since it
        // was read (the delete below is conditional on its UID all the same): delete it.
        Err(kube::Error::Api(status)) if status.code == 422 || status.code == 409 => {}
        Err(e) => {
            return Err(api_error(
                format!("set termination Immediate on run {name}"),
                e,
            ));
        }
    }
    match api.delete(name, &this_run_only(uid)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409) => Ok(()),
        Err(e) => Err(api_error(format!("delete run {name}"), e)),
    }
}

/// A session Run: see the module documentation. Cheap to clone.
#[derive(Clone)]
pub struct Sandbox {
    api: Api<Run>,
    namespace: String,
    name: String,
    uid: String,
    /// The Runtime it runs on.
    runtime: String,
    lease: Option<Duration>,
    config: kube::Config,
    endpoints: EndpointClients,
    /// The creation request ID: release keeps the ended Run as its tombstone.
    request_id: Option<String>,
    /// The last suspend (`true`) or resume (`false`) this handle asked for, with the
    /// generation it produced (shared by clones): what [`Sandbox::wait_suspended`] and
    /// [`Sandbox::wait_resumed`] tell [`SandboxError::Superseded`] by.
    intent: std::sync::Arc<std::sync::Mutex<Option<(bool, i64)>>>,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox")
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .field("uid", &self.uid)
            .finish_non_exhaustive()
    }
}

/// An answer read to its end (bounded).
struct Answer {
    status: u16,
    content_type: String,
    body: Vec<u8>,
    retry_after: Option<Duration>,
}

/// The `Retry-After` of an answer, in whole seconds (an HTTP date is not used here).
fn retry_after(headers: &http::HeaderMap) -> Option<Duration> {
    headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

/// What a call does after `error`, while its session may be woken: the delay before it
/// tries again, or `None` to give up with the error. A wake (`Waking`) is retried after
/// its `Retry-After` (at most [`WAKE_RETRY_CAP`]); once one was seen (`woken`), the steps
/// of the resume are too (the Run not Ready yet, Suspended without the marker until the
/// controller resumes it, the gateway's 503 `NotReady` with `Retry-After`). Each of these
/// answers means the call was not sent to any worker, so trying again never runs
/// anything twice.
fn wake_retry(error: &SandboxError, woken: bool) -> Option<Duration> {
    let delay = match error {
        SandboxError::Waking { retry_after, .. } => *retry_after,
        SandboxError::NotReady { .. } | SandboxError::Suspended { .. } if woken => {
            Duration::from_millis(250)
        }
        SandboxError::Http {
            status: 503,
            reason,
            ..
        } if woken && reason == "NotReady" => Duration::from_secs(1),
        _ => return None,
    };
    Some(delay.min(WAKE_RETRY_CAP))
}

impl Sandbox {
    fn from_run(
        connection: &Connection,
        api: Api<Run>,
        run: &Run,
    ) -> Result<Sandbox, SandboxError> {
        let name = run.name_any();
        let namespace = run
            .namespace()
            .unwrap_or_else(|| connection.namespace().to_string());
        let Some(session) = run.spec.mode.session.as_ref() else {
            return Err(SandboxError::NotASession {
                name,
                namespace,
                mode: run.spec.mode.kind().map_or("invalid", |k| k.as_str()),
            });
        };
        Ok(Sandbox {
            api,
            uid: run.uid().unwrap_or_default(),
            runtime: run.spec.runtime.clone(),
            lease: session
                .lease_timeout_seconds
                .and_then(|s| u64::try_from(s).ok())
                .filter(|s| *s > 0)
                .map(Duration::from_secs),
            name,
            namespace,
            config: connection.config().clone(),
            endpoints: EndpointClients::default(),
            request_id: run
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(REQUEST_ID_ANNOTATION).cloned()),
            intent: std::sync::Arc::default(),
        })
    }

    /// The Run's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The Run's UID.
    pub fn uid(&self) -> &str {
        &self.uid
    }

    /// The Run's namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The lease, when the Run has one.
    pub fn lease(&self) -> Option<Duration> {
        self.lease
    }

    /// The Run as it is now.
    pub async fn run(&self) -> Result<Run, SandboxError> {
        read_run(&self.api, &self.namespace, &self.name).await
    }

    /// Takes a checkpoint named `name` (a `Snapshot` pinned to this Run's UID) and waits
    /// through a watch, at most `limit`, until it is Ready. The capture is a barrier in the
    /// sandbox's queue: every operation accepted before this call is in it, none after;
    /// the sandbox keeps serving. A checkpoint outlives the sandbox; fork it with
    /// [`AcquireOptions::from_snapshot`].
    ///
    /// Errors: [`SandboxError::Api`] when the API server refuses the Snapshot (409 when
    /// the name is taken); [`SandboxError::Checkpoint`] when it fails, is deleted or
    /// `limit` passes; [`SandboxError::Watch`].
    pub async fn checkpoint(&self, name: &str, limit: Duration) -> Result<Snapshot, SandboxError> {
        let api: Api<Snapshot> = Api::namespaced(self.api.clone().into_client(), &self.namespace);
        let mut snapshot = Snapshot::new(
            name,
            SnapshotSpec {
                source: SnapshotSource {
                    run: ObjectReference {
                        name: self.name.clone(),
                        uid: Some(self.uid.clone()),
                    },
                },
                reason: Some(SnapshotReason::Checkpoint),
            },
        );
        snapshot.metadata.annotations = Some(
            [(
                kruntimes_api::snapshot::RUNTIME_ANNOTATION.to_string(),
                self.runtime.clone(),
            )]
            .into(),
        );
        let created = api
            .create(&PostParams::default(), &snapshot)
            .await
            .map_err(|source| SandboxError::Api {
                action: format!("create the checkpoint {name} of sandbox {}", self.name),
                namespace: self.namespace.clone(),
                source,
            })?;
        let uid = created.uid();
        let failed = |reason: &str, message: Option<String>| SandboxError::Checkpoint {
            name: name.to_string(),
            sandbox: self.name.clone(),
            reason: reason.to_string(),
            message,
        };
        let condition = |seen: Option<&Snapshot>| match seen {
            None => true,
            Some(s) => s.uid() != uid || s.phase().is_terminal(),
        };
        let settled = tokio::time::timeout(
            limit,
            kube::runtime::wait::await_condition(api, name, condition),
        )
        .await
        .map_err(|_| {
            failed(
                "Timeout",
                Some(format!("not Ready after {}", format_duration(limit))),
            )
        })?
        .map_err(|source| SandboxError::Watch {
            name: self.name.clone(),
            source,
        })?;
        match settled {
            Some(s) if s.uid() == uid && s.phase() == SnapshotPhase::Ready => Ok(s),
            Some(s) if s.uid() == uid => {
                let status = s.status.unwrap_or_default();
                Err(failed(
                    status.reason.as_deref().unwrap_or("Failed"),
                    status.message,
                ))
            }
            _ => Err(failed(
                "Deleted",
                Some("the Snapshot was deleted".to_string()),
            )),
        }
    }

    /// Asks the sandbox to suspend: merge-patches `spec.suspend: true`. Its worker then
    /// captures its files into a Snapshot and releases its slot (Ready → Suspended; wait
    /// with [`Sandbox::wait_suspended`]). Returns the Run's `metadata.generation` after
    /// the patch: the generation the request produced (unchanged when it was asked
    /// already), which the `Suspended` condition's `observedGeneration` answers.
    ///
    /// Errors: [`SandboxError::Api`] (a 422 when the Run ended or is not a session),
    /// [`SandboxError::NotFound`], [`SandboxError::Replaced`] when the name now belongs to
    /// another Run (the patch reached that Run: it is told, not hidden).
    pub async fn suspend(&self) -> Result<i64, SandboxError> {
        self.set_suspend(true).await
    }

    /// Asks a suspended sandbox to resume: merge-patches `spec.suspend: false`. The
    /// controller sends it back to Pending with `status.incarnation` one higher; it is
    /// placed again and restored from its Snapshot (wait with [`Sandbox::wait_resumed`]).
    /// Returns the generation the request produced. Errors as [`Sandbox::suspend`].
    pub async fn resume(&self) -> Result<i64, SandboxError> {
        self.set_suspend(false).await
    }

    async fn set_suspend(&self, suspend: bool) -> Result<i64, SandboxError> {
        let patch = serde_json::json!({"spec": {"suspend": suspend}});
        let patched = match self
            .api
            .patch(&self.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(run) => run,
            Err(kube::Error::Api(status)) if status.code == 404 => {
                return Err(SandboxError::NotFound {
                    name: self.name.clone(),
                    namespace: self.namespace.clone(),
                });
            }
            Err(source) => {
                return Err(SandboxError::Api {
                    action: format!("set spec.suspend to {suspend} on run {}", self.name),
                    namespace: self.namespace.clone(),
                    source,
                });
            }
        };
        let uid = patched.uid().unwrap_or_default();
        if uid != self.uid {
            return Err(SandboxError::Replaced {
                name: self.name.clone(),
                expected: self.uid.clone(),
                uid,
            });
        }
        let generation = patched.metadata.generation.unwrap_or(1);
        *self
            .intent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((suspend, generation));
        Ok(generation)
    }

    /// The generation of this handle's last request for `suspend`, when its last request
    /// was that one.
    fn intended(&self, suspend: bool) -> Option<i64> {
        match *self
            .intent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            Some((asked, generation)) if asked == suspend => Some(generation),
            _ => None,
        }
    }

    /// Watches until `settle` says the Run settled, at most `limit`; a
    /// [`Settle::Superseded`] becomes [`SandboxError::Superseded`].
    async fn wait_settled(
        &self,
        what: &'static str,
        limit: Duration,
        settle: impl Fn(&Run) -> Settle + Send + Sync,
    ) -> Result<Run, SandboxError> {
        let finish = |run: Run| match settle(&run) {
            Settle::Superseded {
                generation,
                current_generation,
            } => Err(SandboxError::Superseded {
                name: self.name.clone(),
                what,
                generation,
                current_generation,
            }),
            Settle::Waiting | Settle::Done => Ok(run),
        };
        let run = self.run().await?;
        if settle(&run) != Settle::Waiting {
            return finish(run);
        }
        let settled = std::sync::Mutex::new(None::<Run>);
        let waited = wait::until_phase(
            &self.api,
            &self.name,
            Some(&self.uid),
            run.phase(),
            limit,
            |seen| {
                if settle(seen) != Settle::Waiting {
                    *settled
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(seen.clone());
                }
            },
            |_| {
                settled
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .is_some()
            },
        )
        .await
        .map_err(|e| {
            wait_error(
                &self.name,
                if what == "suspend" {
                    "suspended"
                } else {
                    "ready"
                },
                limit,
                e,
            )
        })?;
        finish(waited)
    }

    /// Waits through a watch until the sandbox is Suspended, or ended, at most `limit`.
    /// Returns the Run as it settled: check its phase, an ended one did not suspend.
    ///
    /// Errors: [`SandboxError::Superseded`] when this handle's [`Sandbox::suspend`] was
    /// overtaken by a newer resume (from anywhere), [`SandboxError::WaitTimedOut`] (it
    /// goes on), [`SandboxError::Deleted`], [`SandboxError::Watch`].
    pub async fn wait_suspended(&self, limit: Duration) -> Result<Run, SandboxError> {
        let asked = self.intended(true);
        self.wait_settled("suspend", limit, |run| settle(run, true, asked, 0))
            .await
    }

    /// Waits through a watch until the sandbox is Ready again, or ended, at most `limit`:
    /// Ready in an incarnation above `incarnation` (the one it was suspended in:
    /// [`Run::incarnation`] before the resume), or Ready and not asked to suspend (a
    /// resume of a sandbox that was not suspended is at its target at once). Returns the
    /// Run as it settled.
    ///
    /// Errors as [`Sandbox::wait_suspended`] ([`SandboxError::Superseded`] when this
    /// handle's [`Sandbox::resume`] was overtaken by a newer suspend).
    pub async fn wait_resumed(
        &self,
        incarnation: i64,
        limit: Duration,
    ) -> Result<Run, SandboxError> {
        let asked = self.intended(false);
        self.wait_settled("resume", limit, |run| {
            settle(run, false, asked, incarnation)
        })
        .await
    }

    /// The checked endpoint and its client, from the Run as it is now.
    async fn target(&self, usage: Use) -> Result<(Target, kube::Client), SandboxError> {
        let run = self.run().await?;
        let target = session_target(&run, &self.uid, usage)?;
        let client = self
            .endpoints
            .get(&self.config, &self.name, &target)
            .map_err(SandboxError::from_endpoint)?;
        Ok((target, client))
    }

    /// Runs `attempt` until it succeeds, fails for another reason than a wake, or
    /// [`WAKE_DEADLINE`] passes ([`wake_retry`] says which failures are tried again).
    async fn through_wake<T, F, Fut>(&self, mut attempt: F) -> Result<T, SandboxError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, SandboxError>>,
    {
        let deadline = tokio::time::Instant::now() + WAKE_DEADLINE;
        let mut woken = false;
        loop {
            let error = match attempt().await {
                Ok(value) => return Ok(value),
                Err(error) => error,
            };
            woken |= matches!(error, SandboxError::Waking { .. });
            match wake_retry(&error, woken) {
                Some(delay) if tokio::time::Instant::now() + delay < deadline => {
                    tokio::time::sleep(delay).await;
                }
                _ => return Err(error),
            }
        }
    }

    /// One HTTP call to `{base}{suffix}`, read to its end (at most `limit` bytes), tried
    /// again while the session is woken from an auto-suspend.
    async fn call(
        &self,
        method: http::Method,
        suffix: &str,
        mutation: bool,
        limit: usize,
    ) -> Result<Answer, SandboxError> {
        let call = Call {
            method,
            suffix,
            mutation,
            limit,
            body: None,
            usage: Use::Read,
            deadline: CALL_TIMEOUT,
        };
        self.through_wake(|| self.call_once(&call)).await
    }

    async fn call_once(&self, call: &Call<'_>) -> Result<Answer, SandboxError> {
        let Call {
            method,
            suffix,
            mutation,
            limit,
            ..
        } = call;
        let (suffix, mutation, limit) = (*suffix, *mutation, *limit);
        let (target, client) = self.target(call.usage).await?;
        let url = format!("{}{suffix}", target.url);
        let mut request = http::Request::builder()
            .method(method.clone())
            .uri(format!("{}{suffix}", target.path));
        let body = match &call.body {
            Some(json) => {
                request = request.header(http::header::CONTENT_TYPE, "application/json");
                kube::client::Body::from(json.clone())
            }
            None => kube::client::Body::empty(),
        };
        let request = request.body(body).map_err(|e| SandboxError::BadRequest {
            problem: format!("cannot build the request: {e}"),
        })?;
        let exchange = async {
            let response = send(&client, request, &url, mutation).await?;
            let (parts, body) = response.into_parts();
            let body = Limited::new(body, limit)
                .collect()
                .await
                .map_err(|source| SandboxError::Transport {
                    url: url.clone(),
                    mutation,
                    source,
                })?
                .to_bytes()
                .to_vec();
            let content_type = parts
                .headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            Ok::<_, SandboxError>(Answer {
                status: parts.status.as_u16(),
                content_type,
                body,
                retry_after: retry_after(&parts.headers),
            })
        };
        let answer = tokio::time::timeout(call.deadline, exchange)
            .await
            .map_err(|_| SandboxError::NoAnswer {
                url: url.clone(),
                limit: call.deadline,
            })??;
        if answer.status != 200 {
            let (reason, message) = error_answer(answer.status, &answer.body);
            match (answer.status, reason.as_str()) {
                (503, SESSION_WAKING) => {
                    return Err(SandboxError::Waking {
                        name: self.name.clone(),
                        retry_after: answer.retry_after.unwrap_or(Duration::from_secs(1)),
                    });
                }
                (409, SESSION_SUSPENDED) => {
                    return Err(SandboxError::Suspended {
                        name: self.name.clone(),
                    });
                }
                (409, SESSION_SUSPENDING) => {
                    return Err(SandboxError::Suspending {
                        name: self.name.clone(),
                    });
                }
                _ => {}
            }
            return Err(SandboxError::Http {
                status: answer.status,
                reason,
                message,
            });
        }
        Ok(answer)
    }

    fn json<T: serde::de::DeserializeOwned>(
        &self,
        what: &str,
        body: &[u8],
    ) -> Result<T, SandboxError> {
        serde_json::from_slice(body).map_err(|e| SandboxError::InvalidAnswer {
            url: format!("sandbox {}", self.name),
            problem: bounded(&format!("{what}: {e}")),
        })
    }

    /// The session's status (phase, queue, lease). Does not renew the lease.
    pub async fn status(&self) -> Result<SandboxStatus, SandboxError> {
        let answer = self
            .call(http::Method::GET, "", false, MAX_STATUS_BYTES)
            .await?;
        self.json("the status", &answer.body)
    }

    /// Runs one operation to its end through `POST {base}/operations:execute` (the same
    /// queue and order as a session's operations, without a WebSocket) and returns its
    /// outcome with up to 1 MiB of each output stream. A command's `exit_code` follows the
    /// shell's rules: its own code, 128 + a killing signal, 124 when its timeout ran out,
    /// 127 when the program does not exist (126: not executable).
    ///
    /// A non-zero exit is `Ok`. What did not run to an end is an error, never an exit
    /// code: [`SandboxError::Http`] 409 `SessionClosed` or `OperationCancelled`, 404 or
    /// 400 for a wrong working directory, 503 `SandboxLost`, 502 `OutcomeUnknown` (it may
    /// or may not have run) or 502 with the reason the machine could not start it, and
    /// [`SandboxError::Transport`] (with `mutation`: the outcome is unknown) or
    /// [`SandboxError::NoAnswer`] when the answer did not come. An auto-suspended sandbox
    /// is woken first, as by [`Sandbox::open_session`].
    pub async fn execute(&self, operation: &Operation) -> Result<Executed, SandboxError> {
        let body =
            serde_json::to_vec(&operation.to_json()?).map_err(|e| SandboxError::BadRequest {
                problem: format!("cannot encode the operation: {e}"),
            })?;
        // The operation's own limit (at most the session's, at most MAX_OPERATION_TIMEOUT)
        // and the queue ahead of it: the answer comes when the operation has ended.
        let deadline = operation.timeout.unwrap_or(MAX_OPERATION_TIMEOUT)
            + MAX_OPERATION_TIMEOUT
            + CALL_TIMEOUT;
        let call = Call {
            method: http::Method::POST,
            suffix: "/operations:execute",
            mutation: true,
            limit: MAX_EXECUTE_ANSWER_BYTES,
            body: Some(body),
            usage: Use::Session,
            deadline,
        };
        let answer = self.through_wake(|| self.call_once(&call)).await?;
        let raw: ExecutedJson = self.json("the operation's result", &answer.body)?;
        raw.decode().map_err(|problem| SandboxError::InvalidAnswer {
            url: format!("sandbox {}", self.name),
            problem: bounded(&problem),
        })
    }

    /// A heartbeat: renews the lease; returns the status.
    pub async fn renew(&self) -> Result<SandboxStatus, SandboxError> {
        let answer = self
            .call(http::Method::POST, ":renew", true, MAX_STATUS_BYTES)
            .await?;
        self.json("the status", &answer.body)
    }

    /// One page of a workspace directory. Pages are explicit: pass the page's
    /// `next_page_token` for the next one. A listing is not a snapshot: entries changed
    /// between pages may be missed or repeated.
    pub async fn list_files(&self, options: &ListFilesOptions) -> Result<FilePage, SandboxError> {
        let query = listing_query(options)?;
        let answer = self
            .call(
                http::Method::GET,
                &format!("/files?{query}"),
                false,
                MAX_LISTING_BYTES,
            )
            .await?;
        self.json("the listing", &answer.body)
    }

    /// A workspace file's bytes (at most 1 MiB).
    ///
    /// Errors: [`SandboxError::IsADirectory`] for a directory; [`SandboxError::Http`] 404
    /// for no such file, 400 for a path that leaves the workspace, 413 for a file over
    /// 1 MiB.
    pub async fn read_file(&self, path: &str) -> Result<Vec<u8>, SandboxError> {
        if path.is_empty() {
            return Err(SandboxError::IsADirectory {
                path: "the workspace".to_string(),
            });
        }
        let answer = self
            .call(
                http::Method::GET,
                &format!("/files?path={}", query_value(path)),
                false,
                MAX_FILE_BYTES + 1,
            )
            .await?;
        if answer.content_type.starts_with("application/json") {
            return Err(SandboxError::IsADirectory {
                path: path.to_string(),
            });
        }
        Ok(answer.body)
    }

    /// Opens a session: a connection to the sandbox over which operations are sent and
    /// their events received. Opening renews the lease; while the session is open it sends
    /// heartbeats (every third of the lease).
    ///
    /// Errors: the Run's checks (Ready, session, this Run), [`SandboxError::Http`] when the
    /// gateway refuses the connection (401, 403, 404, 409 ended, 429 too many connections,
    /// 503), [`SandboxError::NotSent`], [`SandboxError::Transport`].
    ///
    /// A sandbox its owner suspended on its own (`autoSuspendAfter`) is woken by the
    /// opening: it is tried again (nothing was sent) until the session is Ready, at most
    /// [`WAKE_DEADLINE`].
    pub async fn open_session(&self) -> Result<Session, SandboxError> {
        self.through_wake(|| self.open_session_once()).await
    }

    async fn open_session_once(&self) -> Result<Session, SandboxError> {
        let (target, client) = self.target(Use::Session).await?;
        let url = format!("{}/operations:ws", target.url);
        let key = tokio_tungstenite::tungstenite::handshake::client::generate_key();
        let request = http::Request::get(format!("{}/operations:ws", target.path))
            .header(http::header::CONNECTION, "Upgrade")
            .header(http::header::UPGRADE, "websocket")
            .header(http::header::SEC_WEBSOCKET_VERSION, "13")
            .header(http::header::SEC_WEBSOCKET_KEY, &key)
            .body(kube::client::Body::empty())
            .map_err(|e| SandboxError::BadRequest {
                problem: format!("cannot build the request: {e}"),
            })?;
        let opening = async {
            let response = send(&client, request, &url, false).await?;
            if response.status() != http::StatusCode::SWITCHING_PROTOCOLS {
                let status = response.status().as_u16();
                let wait = retry_after(response.headers());
                let body = Limited::new(response.into_body(), MAX_STATUS_BYTES)
                    .collect()
                    .await
                    .map(|b| b.to_bytes().to_vec())
                    .unwrap_or_default();
                let (reason, message) = error_answer(status, &body);
                if status == 503 && reason == SESSION_WAKING {
                    return Err(SandboxError::Waking {
                        name: self.name.clone(),
                        retry_after: wait.unwrap_or(Duration::from_secs(1)),
                    });
                }
                return Err(SandboxError::Http {
                    status,
                    reason,
                    message,
                });
            }
            let accepted = response
                .headers()
                .get(http::header::SEC_WEBSOCKET_ACCEPT)
                .is_some_and(|v| v.as_bytes() == derive_accept_key(key.as_bytes()).as_bytes());
            if !accepted {
                return Err(SandboxError::Protocol {
                    problem: "the WebSocket handshake's accept key does not match".into(),
                });
            }
            let upgraded =
                hyper::upgrade::on(response)
                    .await
                    .map_err(|e| SandboxError::Transport {
                        url: url.clone(),
                        mutation: false,
                        source: Box::new(e),
                    })?;
            Ok(WebSocketStream::from_raw_socket(
                TokioIo::new(upgraded),
                Role::Client,
                Some(socket_config()),
            )
            .await)
        };
        let socket = tokio::time::timeout(CALL_TIMEOUT, opening)
            .await
            .map_err(|_| SandboxError::NoAnswer {
                url: url.clone(),
                limit: CALL_TIMEOUT,
            })??;
        Ok(Session::start(socket, self.lease.map(heartbeat_interval)))
    }

    /// Asks the sandbox to end at once (termination Immediate: running and queued work
    /// is cancelled) and deletes its Run (UID precondition), without waiting for either:
    /// its worker closes the session and frees the slot, and the Run goes once that
    /// cleanup is done. What the machines view's `release` does. A Run already gone is
    /// fine.
    pub async fn end_and_delete(&self) -> Result<(), SandboxError> {
        end_and_delete(&self.api, &self.namespace, &self.name, &self.uid).await
    }

    /// Releases the sandbox: asks the Run to end (`spec.termination.mode` Drain, or
    /// Immediate), waits until it has ended, deletes it and waits until it is gone.
    /// Returns the phase it ended in (`None` when it was gone already).
    ///
    /// Idempotent: a Run already ending is not asked again (an Immediate request is never
    /// downgraded to Drain), an ended one is only deleted, a missing one is released.
    /// Errors: [`SandboxError::Api`], [`SandboxError::WaitTimedOut`] (it goes on ending),
    /// [`SandboxError::Watch`], [`SandboxError::Replaced`].
    pub async fn release(&self, options: ReleaseOptions) -> Result<Option<Phase>, SandboxError> {
        let api_error = |action: String, source| SandboxError::Api {
            action,
            namespace: self.namespace.clone(),
            source,
        };
        let run = match self.run().await {
            Ok(run) => run,
            Err(SandboxError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        if run.uid().as_deref() != Some(self.uid.as_str()) {
            return Ok(None);
        }
        let mode = if options.immediate {
            "Immediate"
        } else {
            "Drain"
        };
        let asked = run.spec.termination.as_ref().map(|t| t.mode);
        let ask = !run.phase().is_terminal()
            && match asked {
                None => true,
                Some(kruntimes_api::run::TerminationMode::Drain) => options.immediate,
                Some(kruntimes_api::run::TerminationMode::Immediate) => false,
            };
        if ask {
            let patch = serde_json::json!({"spec": {"termination": {"mode": mode}}});
            match self
                .api
                .patch(&self.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => return Ok(None),
                Err(e) => {
                    return Err(api_error(
                        format!("set termination {mode} on run {}", self.name),
                        e,
                    ));
                }
            }
        }
        let ended = wait::until_phase(
            &self.api,
            &self.name,
            Some(&self.uid),
            run.phase(),
            options.wait,
            |_| {},
            Phase::is_terminal,
        )
        .await;
        let phase = match ended {
            Ok(run) => run.phase(),
            Err(WaitError::Deleted) => return Ok(None),
            Err(e) => return Err(wait_error(&self.name, "ended", options.wait, e)),
        };
        if self.request_id.is_some() {
            // The ended Run is the request ID's tombstone: kept, so that a retry of the
            // creation finds it instead of creating a second sandbox. Delete it to purge.
            return Ok(Some(phase));
        }
        let params = this_run_only(&self.uid);
        match self.api.delete(&self.name, &params).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(Some(phase)),
            Err(e) => return Err(api_error(format!("delete run {}", self.name), e)),
        }
        wait::until_gone(&self.api, &self.name, &self.uid, options.wait)
            .await
            .map_err(|e| wait_error(&self.name, "gone", options.wait, e))?;
        Ok(Some(phase))
    }
}

#[cfg(test)]
mod tests {
    use kruntimes_api::run::{EndpointProtocol, RunEndpoint, RunStatus};

    use super::*;

    /// Issue 19 item 7: a request ID names the Run (so racing creates meet in the API
    /// server) and records the spec's digest; another spec gets another digest.
    #[test]
    fn a_request_id_names_the_run_and_records_the_spec_digest() {
        let options = AcquireOptions {
            request_id: Some("agent-1.turn-7".into()),
            ..AcquireOptions::default()
        };
        let run = options.to_run("bash").expect("valid");
        let name = run.metadata.name.clone().unwrap_or_default();
        assert_eq!(name, request_run_name("agent-1.turn-7"));
        assert!(name.len() <= 63 && name.starts_with("req-"), "{name}");
        assert_eq!(run.metadata.generate_name, None);
        let annotations = run.metadata.annotations.clone().unwrap_or_default();
        assert_eq!(
            annotations.get(REQUEST_ID_ANNOTATION).map(String::as_str),
            Some("agent-1.turn-7")
        );
        let other = AcquireOptions {
            timeout: Some(Duration::from_secs(60)),
            ..options.clone()
        }
        .to_run("bash")
        .expect("valid");
        assert_ne!(
            annotations.get(REQUEST_DIGEST_ANNOTATION),
            other
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(REQUEST_DIGEST_ANNOTATION))
        );
        for bad in [
            AcquireOptions {
                request_id: Some("a b".into()),
                ..AcquireOptions::default()
            },
            AcquireOptions {
                name: Some("mine".into()),
                ..options.clone()
            },
        ] {
            assert!(matches!(
                bad.to_run("bash"),
                Err(SandboxError::Invalid { .. })
            ));
        }
    }

    #[test]
    fn options_become_a_session_run() {
        let options = AcquireOptions {
            lease_timeout: Some(Duration::from_millis(1500)),
            queue_size: Some(4),
            operation_timeout: Some(Duration::from_secs(60)),
            env: vec![EnvVar {
                name: "A".into(),
                value: "1".into(),
            }],
            source: Some("echo hi\n".into()),
            timeout: Some(Duration::from_secs(3600)),
            ..AcquireOptions::default()
        };
        let run = options.to_run("bash").expect("valid");
        assert_eq!(run.metadata.generate_name.as_deref(), Some("bash-sandbox-"));
        assert_eq!(run.metadata.name, None);
        let value = serde_json::to_value(&run).expect("json");
        assert_eq!(
            value["spec"]["mode"],
            serde_json::json!({"session": {"leaseTimeoutSeconds": 2, "queueSize": 4, "operationTimeout": "1m"}})
        );
        assert_eq!(value["spec"]["timeout"], "1h");
        assert_eq!(value["spec"]["source"]["inline"], "echo hi\n");
        assert_eq!(value["spec"]["env"][0]["name"], "A");
        let named = AcquireOptions {
            name: Some("mine".into()),
            generate_name: Some("ignored-".into()),
            ..AcquireOptions::default()
        }
        .to_run("python")
        .expect("named");
        assert_eq!(named.metadata.name.as_deref(), Some("mine"));
        assert_eq!(named.metadata.generate_name, None);
        let bare = AcquireOptions::default().to_run("bash").expect("bare");
        assert_eq!(
            serde_json::to_value(&bare).expect("json")["spec"]["mode"],
            serde_json::json!({"session": {}})
        );
    }

    #[test]
    fn bad_options_are_caught_before_sending() {
        let zero = AcquireOptions {
            lease_timeout: Some(Duration::ZERO),
            ..AcquireOptions::default()
        };
        assert!(matches!(
            zero.to_run("bash"),
            Err(SandboxError::Invalid { .. })
        ));
        let queue = AcquireOptions {
            queue_size: Some(33),
            ..AcquireOptions::default()
        };
        assert!(matches!(
            queue.to_run("bash"),
            Err(SandboxError::Invalid { .. })
        ));
    }

    fn session_run(phase: Phase, url: &str) -> Run {
        let options = AcquireOptions {
            name: Some("sb".into()),
            ..AcquireOptions::default()
        };
        let mut run = options.to_run("bash").expect("run");
        run.metadata.uid = Some("u-1".into());
        run.metadata.namespace = Some("default".into());
        run.status = Some(RunStatus {
            phase: Some(phase),
            endpoint: Some(RunEndpoint {
                protocol: EndpointProtocol::Https,
                url: url.to_string(),
                ca_bundle: None,
            }),
            ..RunStatus::default()
        });
        run
    }

    const URL: &str = "https://127.0.0.1:7443/v1/namespaces/default/runtimes/bash/sessions/u-1";

    fn at(phase: Phase, suspend: bool, generation: i64, incarnation: i64) -> Run {
        let mut run = session_run(phase, URL);
        run.spec.suspend = Some(suspend);
        run.metadata.generation = Some(generation);
        if let Some(status) = run.status.as_mut() {
            status.incarnation = Some(incarnation);
        }
        run
    }

    #[test]
    fn a_suspend_or_resume_settles_at_its_target_or_is_superseded() {
        // Suspend: capturing goes on; Suspended or an end settles it.
        assert_eq!(
            settle(&at(Phase::Ready, true, 2, 1), true, Some(2), 0),
            Settle::Waiting
        );
        assert_eq!(
            settle(&at(Phase::Suspended, true, 2, 1), true, Some(2), 0),
            Settle::Done
        );
        assert_eq!(
            settle(&at(Phase::Cancelled, true, 2, 1), true, Some(2), 0),
            Settle::Done
        );
        // Overtaken by a resume: told, with both generations.
        assert_eq!(
            settle(&at(Phase::Ready, false, 3, 1), true, Some(2), 0),
            Settle::Superseded {
                generation: 2,
                current_generation: 3
            }
        );
        // A later generation asking the same (another field changed) is no overtaking,
        // and without a request of this handle nothing is superseded.
        assert_eq!(
            settle(&at(Phase::Ready, true, 5, 1), true, Some(2), 0),
            Settle::Waiting
        );
        assert_eq!(
            settle(&at(Phase::Ready, false, 3, 1), true, None, 0),
            Settle::Waiting
        );
        // Resume: Suspended and Pending go on; Ready in a later incarnation settles, and so
        // does a Ready one not asked to suspend (a resume of a sandbox never suspended).
        assert_eq!(
            settle(&at(Phase::Suspended, false, 3, 1), false, Some(3), 1),
            Settle::Waiting
        );
        assert_eq!(
            settle(&at(Phase::Pending, false, 3, 2), false, Some(3), 1),
            Settle::Waiting
        );
        assert_eq!(
            settle(&at(Phase::Ready, false, 3, 2), false, Some(3), 1),
            Settle::Done
        );
        assert_eq!(
            settle(&at(Phase::Ready, false, 3, 1), false, Some(3), 1),
            Settle::Done
        );
        assert_eq!(
            settle(&at(Phase::Suspended, true, 4, 1), false, Some(3), 1),
            Settle::Superseded {
                generation: 3,
                current_generation: 4
            }
        );
    }

    #[test]
    fn a_suspended_or_suspending_sandbox_says_so() {
        for usage in [Use::Read, Use::Session] {
            assert!(matches!(
                session_target(&session_run(Phase::Suspended, URL), "u-1", usage),
                Err(SandboxError::Suspended { .. })
            ));
        }
        let mut suspending = session_run(Phase::Ready, URL);
        suspending.spec.suspend = Some(true);
        // New work is refused; reads go on while the worker captures.
        assert!(matches!(
            session_target(&suspending, "u-1", Use::Session),
            Err(SandboxError::Suspending { .. })
        ));
        assert!(session_target(&suspending, "u-1", Use::Read).is_ok());
        assert_eq!(
            SandboxError::Suspended { name: "sb".into() }.status(),
            Some(409)
        );
    }

    /// Issue 19 item 4: a sandbox its owner suspended is called (the gateway wakes it),
    /// an explicitly suspended one is refused before sending; only answers that mean
    /// "not sent" are tried again, and never longer than the cap apart.
    #[test]
    fn an_auto_suspended_sandbox_is_called_and_retried_through_its_wake() {
        let mut auto = session_run(Phase::Suspended, URL);
        auto.spec.suspend = Some(true);
        auto.metadata.annotations = Some(
            [(
                kruntimes_api::lifecycle::AUTO_SUSPENDED_ANNOTATION.to_string(),
                auto.incarnation().to_string(),
            )]
            .into_iter()
            .collect(),
        );
        assert!(session_target(&auto, "u-1", Use::Session).is_ok());
        auto.metadata.annotations = None;
        assert!(matches!(
            session_target(&auto, "u-1", Use::Session),
            Err(SandboxError::Suspended { .. })
        ));
        let waking = SandboxError::Waking {
            name: "sb".into(),
            retry_after: Duration::from_secs(30),
        };
        assert_eq!(wake_retry(&waking, false), Some(WAKE_RETRY_CAP));
        let resuming = SandboxError::Suspended { name: "sb".into() };
        assert_eq!(wake_retry(&resuming, false), None, "not woken: the user's");
        assert!(wake_retry(&resuming, true).is_some());
        let lost = SandboxError::Http {
            status: 502,
            reason: "BadGateway".into(),
            message: String::new(),
        };
        assert_eq!(wake_retry(&lost, true), None);
        assert_eq!(waking.status(), Some(503));
    }

    #[test]
    fn calls_go_only_to_this_ready_session() {
        let target =
            session_target(&session_run(Phase::Ready, URL), "u-1", Use::Session).expect("ready");
        assert_eq!(target.origin, "https://127.0.0.1:7443");
        assert_eq!(
            target.path,
            "/v1/namespaces/default/runtimes/bash/sessions/u-1"
        );
        // A draining sandbox still answers reads, not new sessions.
        assert!(session_target(&session_run(Phase::Finalizing, URL), "u-1", Use::Read).is_ok());
        assert!(matches!(
            session_target(&session_run(Phase::Finalizing, URL), "u-1", Use::Session),
            Err(SandboxError::NotReady {
                phase: Phase::Finalizing,
                ..
            })
        ));
        for phase in [Phase::Running, Phase::Succeeded, Phase::Timeout] {
            assert!(matches!(
                session_target(&session_run(phase, URL), "u-1", Use::Read),
                Err(SandboxError::NotReady { .. })
            ));
        }
        assert!(matches!(
            session_target(&session_run(Phase::Ready, URL), "u-2", Use::Read),
            Err(SandboxError::Replaced { .. })
        ));
        let other = URL.replace("u-1", "u-9");
        assert!(matches!(
            session_target(&session_run(Phase::Ready, &other), "u-1", Use::Read),
            Err(SandboxError::BadEndpoint { .. })
        ));
        let suffix = format!("{URL}x");
        assert!(session_target(&session_run(Phase::Ready, &suffix), "u-1", Use::Read).is_err());
        let mut task = session_run(Phase::Ready, URL);
        task.spec.mode = RunSpec::task("bash", "x").mode;
        assert!(matches!(
            session_target(&task, "u-1", Use::Read),
            Err(SandboxError::NotASession { mode: "task", .. })
        ));
    }

    #[test]
    fn listing_queries_page_explicitly() {
        assert_eq!(
            listing_query(&ListFilesOptions::default()).expect("q"),
            "path=&directory=true"
        );
        assert_eq!(
            listing_query(&ListFilesOptions {
                directory: "a b/ç".into(),
                limit: 1000,
                page_token: "eyJ2Ijox+/=".into(),
            })
            .expect("q"),
            "path=a%20b%2F%C3%A7&directory=true&limit=1000&pageToken=eyJ2Ijox%2B%2F%3D"
        );
        assert!(matches!(
            listing_query(&ListFilesOptions {
                limit: 1001,
                ..ListFilesOptions::default()
            }),
            Err(SandboxError::BadRequest { .. })
        ));
    }

    #[test]
    fn only_lost_mutations_have_unknown_outcomes() {
        let lost = SandboxError::OutcomeUnknown {
            operation_id: Some("op-1".into()),
            what: "x".into(),
        };
        assert!(lost.outcome_unknown());
        let refused = SandboxError::Rejected {
            operation_id: None,
            status: 429,
            reason: "TooManyRequests".into(),
            message: "full".into(),
        };
        assert!(!refused.outcome_unknown());
        assert_eq!(refused.status(), Some(429));
        let gateway = SandboxError::Http {
            status: 504,
            reason: "OutcomeUnknown".into(),
            message: "late".into(),
        };
        assert!(gateway.outcome_unknown());
        assert!(!SandboxError::Closed.outcome_unknown());
    }

    #[test]
    fn statuses_and_pages_parse() {
        let status: SandboxStatus = serde_json::from_str(
            r#"{"runUID": "u", "runName": "sb", "phase": "Ready", "state": "Ready",
                "servedBy": "bash-0", "hops": 0, "attempt": 1, "queued": 0,
                "runningOperationId": "", "lastSequence": 12, "queueSize": 32,
                "operationTimeoutSeconds": 300, "leaseTimeoutSeconds": 30,
                "leaseExpiresAt": "2026-11-30T10:00:00Z"}"#,
        )
        .expect("status");
        assert_eq!(status.run_uid, "u");
        assert_eq!(status.last_sequence, 12);
        assert_eq!(
            status.lease_expires_at.as_deref(),
            Some("2026-11-30T10:00:00Z")
        );
        let page: FilePage = serde_json::from_str(
            r#"{"entries": [{"path": "build.log", "directory": false, "sizeBytes": 1024, "symlink": false}],
                "nextPageToken": "eyJ2IjoxfQ"}"#,
        )
        .expect("page");
        assert_eq!(page.entries[0].size_bytes, 1024);
        assert_eq!(page.next_page_token, "eyJ2IjoxfQ");
    }
}
