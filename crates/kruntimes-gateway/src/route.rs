//! Which runtimed a call for one Run goes to, and what the call carries: the path shared by
//! every route that addresses a Run of a Runtime by its UID (function invocations,
//! docs/function-mode.md; session calls, docs/session-mode.md).
//!
//! 1. The namespace, the Runtime and the Run UID of the path are checked ([`RunPath::new`]).
//! 2. The Run is looked up by UID in the watch-backed ownership cache of its Runtime
//!    ([`RuntimeCaches`], the same [`Ownership`] cache runtimed keeps): never the API.
//!    The cache may lag a moment behind a Ready the client has already seen, so a Run that
//!    is unknown or not yet routable is waited for briefly.
//! 3. The caller must be allowed to `get` that Run ([`crate::Authorizer`], cached 30 s and
//!    flushed by revocations). Every call authorizes again, and an open WebSocket re-checks
//!    its caller whenever the cache is flushed.
//! 4. A worker of the Runtime is chosen ([`InvokeRouting`]): the owner when the cache knows
//!    it, else any ready worker, which forwards once to the owner.
//! 5. The call carries the caller's token ([`Upstream::request`]): every runtimed on the
//!    way authorizes the call again with it (the same cached authorizer, `kruntimes-wire`),
//!    so that no header a worker could forge stands in for a decision.
//! 6. A gRPC error becomes one HTTP error ([`grpc_error`]); nothing here retries.
//!
//! This module never reads the API synchronously and never decides readiness itself
//! beyond what the cache shows: runtimed does.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use kruntimes_api::Phase;
use kruntimes_api::admission::is_dns1123_label;
use kruntimes_api::run::ModeKind;
use kruntimes_proto::runtimed::v1::runtimed_client::RuntimedClient;
use kruntimes_wire::ownership::{Ownership, RunEntry};
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use crate::authz::{AuthzError, RUN_GROUP, RUN_RESOURCE, RUN_VERB};
use crate::error::HttpError;
use crate::server::AppState;

/// How long the first request of a Runtime waits for its cache to be listed.
const SYNC_WAIT: Duration = Duration::from_secs(5);
/// The most Runtimes whose caches the gateway keeps.
const MAX_CACHES: usize = 256;
/// The longest Run UID taken from a path.
const MAX_UID_BYTES: usize = 64;

/// How the gateway picks the runtimed it calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum InvokeRouting {
    /// The owner's runtimed when the cache knows it; any ready worker otherwise (standalone).
    #[default]
    Owner,
    /// Any ready worker of the Runtime, in turn, as a Kubernetes Service would; the worker
    /// forwards to the owner.
    Service,
}

/// One Runtime's ownership cache and the task that keeps it.
struct Cached {
    ownership: Arc<Ownership>,
    task: JoinHandle<()>,
    used: Instant,
}

/// The ownership caches of the Runtimes addressed so far, started on first use, at most
/// [`MAX_CACHES`] (the least recently used is stopped first).
#[derive(Default)]
pub(crate) struct RuntimeCaches {
    caches: Mutex<HashMap<(String, String), Cached>>,
    turn: AtomicUsize,
}

impl Drop for RuntimeCaches {
    fn drop(&mut self) {
        for cached in self
            .caches
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
        {
            cached.task.abort();
        }
    }
}

impl RuntimeCaches {
    /// The synced cache of Runtime `namespace`/`runtime`; 503 when it is not listed within
    /// a few seconds.
    async fn get(
        &self,
        client: &kube::Client,
        namespace: &str,
        runtime: &str,
    ) -> Result<Arc<Ownership>, HttpError> {
        let ownership = {
            let mut caches = self.caches.lock().unwrap_or_else(PoisonError::into_inner);
            let key = (namespace.to_string(), runtime.to_string());
            if let Some(cached) = caches.get_mut(&key) {
                cached.used = Instant::now();
                cached.ownership.clone()
            } else {
                if caches.len() >= MAX_CACHES
                    && let Some(oldest) = caches
                        .iter()
                        .min_by_key(|(_, c)| c.used)
                        .map(|(k, _)| k.clone())
                    && let Some(evicted) = caches.remove(&oldest)
                {
                    evicted.task.abort();
                }
                let ownership = Arc::new(Ownership::default());
                let task = tokio::spawn(ownership.clone().run_watches(
                    client.clone(),
                    namespace.to_string(),
                    runtime.to_string(),
                ));
                caches.insert(
                    key,
                    Cached {
                        ownership: ownership.clone(),
                        task,
                        used: Instant::now(),
                    },
                );
                ownership
            }
        };
        if !ownership.synced() && !ownership.wait_synced(SYNC_WAIT).await {
            return Err(HttpError::unavailable(format!(
                "the gateway's cache of Runtime {namespace}/{runtime} is not synced yet"
            )));
        }
        Ok(ownership)
    }
}

/// The namespace, Runtime and Run UID a request addresses, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RunPath {
    pub namespace: String,
    pub runtime: String,
    pub uid: String,
}

impl RunPath {
    /// 400 unless the namespace and the Runtime are DNS-1123 labels and `uid` looks like a
    /// Run UID (1 to 64 bytes of letters, digits and hyphens).
    pub fn new(namespace: String, runtime: String, uid: &str) -> Result<RunPath, HttpError> {
        if !is_dns1123_label(&namespace) || !is_dns1123_label(&runtime) {
            return Err(HttpError::bad_request(
                "the namespace and the Runtime must be DNS-1123 labels",
            ));
        }
        if uid.is_empty()
            || uid.len() > MAX_UID_BYTES
            || !uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        {
            return Err(HttpError::bad_request("the Run is addressed by its UID"));
        }
        Ok(RunPath {
            namespace,
            runtime,
            uid: uid.to_string(),
        })
    }
}

/// Which Runs a route serves, as the cache shows them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Serving {
    /// Function invocations: a Ready, registered Run that is not being deleted; a function
    /// Run in another state is not ready (503); anything else is "no such function" (404).
    Function,
    /// Session calls: a session Run with an assignment in phase Ready or Finalizing
    /// (runtimed decides what each call may do in that phase). Before Ready, 503; ended or
    /// being deleted, 409; Suspended, 409 `SessionSuspended`; not a session, 404.
    Session,
    /// Session calls that add work (a new operation, a file upload): as [`Serving::Session`],
    /// and a Ready session asked to suspend (`spec.suspend: true`, its worker capturing it)
    /// answers 409 `SessionSuspending`. Accepted operations go on; runtimed's queue is the
    /// authority, this is the first line.
    SessionMutation,
}

impl Serving {
    fn mode(self) -> ModeKind {
        match self {
            Serving::Function => ModeKind::Function,
            Serving::Session | Serving::SessionMutation => ModeKind::Session,
        }
    }

    /// Whether a call for `entry` goes to a worker now: a Run of this route's mode that
    /// serves ([`RunEntry::serving`]).
    fn routable(self, entry: &RunEntry) -> bool {
        entry.mode == self.mode() && entry.serving()
    }

    /// The answer for a Run that is unknown or not routable after the wait.
    fn refusal(self, path: &RunPath, entry: Option<&RunEntry>) -> HttpError {
        match (self, entry) {
            // A function that exists but does not serve (registering, recovering,
            // terminating, ended): 503, as the contract says of a Run not ready.
            (Serving::Function, Some(entry)) if entry.mode == ModeKind::Function => HttpError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "NotReady",
                format!(
                    "function Run {} is not ready (phase {}{})",
                    entry.name,
                    entry.phase.as_str(),
                    if entry.deleting { ", deleting" } else { "" }
                ),
            ),
            (Serving::Function, _) => HttpError::not_found(format!(
                "no function Run with UID {} in Runtime {}/{}",
                path.uid, path.namespace, path.runtime
            )),
            (Serving::Session | Serving::SessionMutation, None) => HttpError::not_found(format!(
                "no session Run with UID {} in Runtime {}/{}",
                path.uid, path.namespace, path.runtime
            )),
            (Serving::Session | Serving::SessionMutation, Some(entry))
                if entry.mode != ModeKind::Session =>
            {
                Serving::Session.refusal(path, None)
            }
            (Serving::Session | Serving::SessionMutation, Some(entry)) => {
                session_refusal(&entry.name, entry.phase, entry.deleting)
            }
        }
    }
}

/// The reason of the 409 for a call to a Suspended session.
pub const SESSION_SUSPENDED_REASON: &str = "SessionSuspended";
/// The reason of the 409 for new work sent to a session that is being suspended.
pub const SESSION_SUSPENDING_REASON: &str = "SessionSuspending";

/// The reason of the 503 for a call to a session its owner suspended on its own: a worker
/// was asked to wake it, and the call may be sent again after `Retry-After`.
pub const SESSION_WAKING_REASON: &str = "SessionWaking";
/// How long the gateway waits for a worker to answer a wake.
const WAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// The answer for a call to the auto-suspended session `name`: 503 with `Retry-After`
/// ([`crate::error::RETRY_AFTER_SECONDS`]),
/// never buffered (the call was not sent anywhere; sending it again is safe).
fn session_waking(name: &str) -> HttpError {
    HttpError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        SESSION_WAKING_REASON,
        format!(
            "session {name} was suspended after its autoSuspendAfter and is being woken; \
             send the call again after the Retry-After delay"
        ),
    )
}

/// Whether a call on `serving` to `entry` wakes the session instead of being routed or
/// refused: a session call to a session whose suspend is its owner's and still valid
/// (`kruntimes.io/auto-suspended`), Suspended or Ready and being suspended, not being
/// deleted. A session the user suspended has no valid marker: 409 as before.
fn wakes(serving: Serving, entry: &RunEntry) -> bool {
    let session_call = match serving {
        Serving::Function => false,
        Serving::Session | Serving::SessionMutation => true,
    };
    let suspending = match entry.phase {
        Phase::Suspended | Phase::Ready => true,
        Phase::Pending
        | Phase::Scheduled
        | Phase::Running
        | Phase::Finalizing
        | Phase::Succeeded
        | Phase::Failed
        | Phase::Timeout
        | Phase::Cancelled => false,
    };
    session_call
        && entry.mode == ModeKind::Session
        && entry.auto_suspended
        && suspending
        && !entry.deleting
}

/// For a heartbeat (`POST {base}:renew`, a WebSocket `heartbeat` frame) to the Run of
/// `path`: its entry, once the caller is authorized, when the session sleeps (its owner
/// suspended it on its own and a call would wake it). A heartbeat only keeps a lease, and a
/// suspended session's lease does not run: it is answered without waking the session, so a
/// client that holds a session open does not undo its auto-suspend every few seconds.
/// `None` for any other Run: the heartbeat goes on its way as before.
pub(crate) async fn asleep(
    state: &AppState,
    path: &RunPath,
    token: &str,
) -> Result<Option<RunEntry>, HttpError> {
    let ownership = state
        .runtimes
        .get(&state.client, &path.namespace, &path.runtime)
        .await?;
    match ownership.run(&path.uid) {
        Some(entry) if wakes(Serving::Session, &entry) => {
            authorize(state, token, path, &entry.name).await?;
            Ok(Some(entry))
        }
        _ => Ok(None),
    }
}

/// Asks a ready worker of the Runtime to wake the auto-suspended session of `entry`, with
/// the caller's token (the worker authorizes it again). Bounded; a failure is logged and
/// counted, and the caller's retry asks again.
async fn wake(
    state: &AppState,
    ownership: &Ownership,
    path: &RunPath,
    token: &str,
    entry: &RunEntry,
) {
    let result = match pick_worker(state, ownership, entry) {
        Err(e) => Err(e.to_string()),
        Ok((pod, addr)) => match state.workers.get(&path.namespace, &pod, addr) {
            Err(e) => Err(e.to_string()),
            Ok(channel) => {
                let mut client = RuntimedClient::new(channel);
                let call = with_token(
                    kruntimes_proto::runtimed::v1::SessionRoute {
                        namespace: path.namespace.clone(),
                        runtime: path.runtime.clone(),
                        run_uid: path.uid.clone(),
                        ..Default::default()
                    },
                    token,
                );
                match tokio::time::timeout(WAKE_TIMEOUT, client.wake_session(call)).await {
                    Ok(Ok(answer)) => Ok(answer.into_inner().woken),
                    Ok(Err(status)) => {
                        if status.code() == tonic::Code::Unavailable
                            && status.message().contains("transport")
                        {
                            state.workers.forget(&path.namespace, &pod, addr);
                        }
                        Err(status.message().to_string())
                    }
                    Err(_) => Err("the worker did not answer in time".to_string()),
                }
            }
        },
    };
    let counted = match &result {
        Ok(true) => "woken",
        Ok(false) => "not_wakeable",
        Err(error) => {
            tracing::warn!(run = %entry.name, error = %error, "could not wake an auto-suspended session");
            "failed"
        }
    };
    state.metrics.count_wake(counted);
}

/// The answer for new work sent to the session `name` while its worker suspends it.
fn session_suspending(name: &str) -> HttpError {
    HttpError::new(
        StatusCode::CONFLICT,
        SESSION_SUSPENDING_REASON,
        format!(
            "session {name} is being suspended (spec.suspend is true); it takes no new \
             operations or uploads until it is resumed (set spec.suspend to false)"
        ),
    )
}

/// The answer for the session `name` that takes no calls: ended or being deleted (409),
/// suspended (409 `SessionSuspended`), not ready yet (503).
fn session_refusal(name: &str, phase: Phase, deleting: bool) -> HttpError {
    let ended = |how: String| {
        HttpError::new(
            StatusCode::CONFLICT,
            "SessionEnded",
            format!("session {name} {how}; its workspace is gone"),
        )
    };
    match phase {
        Phase::Succeeded | Phase::Failed | Phase::Timeout | Phase::Cancelled => {
            ended(format!("ended {}", phase.as_str()))
        }
        Phase::Pending
        | Phase::Scheduled
        | Phase::Running
        | Phase::Ready
        | Phase::Finalizing
        | Phase::Suspended
            if deleting =>
        {
            ended("is being deleted".to_string())
        }
        Phase::Suspended => HttpError::new(
            StatusCode::CONFLICT,
            SESSION_SUSPENDED_REASON,
            format!(
                "session {name} is suspended: its files are kept in a Snapshot and no worker \
                 holds it; resume it (set spec.suspend to false) and wait until it is Ready"
            ),
        ),
        Phase::Pending | Phase::Scheduled | Phase::Running | Phase::Ready | Phase::Finalizing => {
            HttpError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "NotReady",
                format!("session {name} is {} and not ready yet", phase.as_str()),
            )
        }
    }
}

/// A call's way to the runtimed it goes to, for an authorized caller.
pub(crate) struct Upstream {
    /// The worker Pod called, its namespace (what TLS verifies it as: its worker identity)
    /// and its address.
    pub namespace: String,
    pub pod: String,
    pub addr: SocketAddr,
    pub client: RuntimedClient<Channel>,
}

impl Upstream {
    /// `message` as a call that carries the caller's token, which runtimed authorizes.
    pub fn request<T>(&self, message: T, token: &str) -> tonic::Request<T> {
        with_token(message, token)
    }

    /// Forgets the worker's channel when `status` says the transport failed, so that the
    /// next call connects afresh.
    pub fn failed(&self, state: &AppState, status: &tonic::Status) {
        if status.code() == tonic::Code::Unavailable && status.message().contains("transport") {
            state.workers.forget(&self.namespace, &self.pod, self.addr);
        }
    }
}

/// Finds the Run of `path` in its Runtime's cache, authorizes the caller to `get` it and
/// picks the worker to call.
///
/// Errors: 503 when the cache is not synced or no worker is ready; [`Serving::refusal`] for
/// a Run that is unknown or not routable; the authorizer's 401, 403 or 503.
pub(crate) async fn upstream(
    state: &AppState,
    path: &RunPath,
    token: &str,
    serving: Serving,
) -> Result<Upstream, HttpError> {
    let ownership = state
        .runtimes
        .get(&state.client, &path.namespace, &path.runtime)
        .await?;
    let entry = match ownership.run(&path.uid) {
        Some(entry) if serving.routable(&entry) => Some(entry),
        // Ended or suspended: waiting would not change it (a resume takes a placement).
        Some(entry) if entry.phase.is_terminal() || entry.phase == Phase::Suspended => Some(entry),
        // The cache may lag a moment behind the Ready the client has already seen.
        _ => {
            ownership
                .wait_serving(&path.uid, kruntimes_wire::worker::CACHE_GRACE)
                .await
        }
    };
    let entry = match entry {
        Some(entry) if wakes(serving, &entry) => {
            authorize(state, token, path, &entry.name).await?;
            wake(state, &ownership, path, token, &entry).await;
            return Err(session_waking(&entry.name));
        }
        Some(entry)
            if serving.routable(&entry) && serving == Serving::SessionMutation && entry.suspend =>
        {
            authorize(state, token, path, &entry.name).await?;
            return Err(session_suspending(&entry.name));
        }
        Some(entry) if serving.routable(&entry) => entry,
        other => {
            // Only a caller who may get the Run learns what state it is in.
            if let Some(entry) = &other {
                authorize(state, token, path, &entry.name).await?;
            }
            return Err(serving.refusal(path, other.as_ref()));
        }
    };
    authorize(state, token, path, &entry.name).await?;
    let (pod, addr) = pick_worker(state, &ownership, &entry)?;
    let client = RuntimedClient::new(state.workers.get(&path.namespace, &pod, addr)?);
    Ok(Upstream {
        namespace: path.namespace.clone(),
        pod,
        addr,
        client,
    })
}

/// Whether the caller may `get` the Run `name` of `path`. A refusal names the Run by the
/// UID the caller sent, never by the name the gateway looked up.
async fn authorize(
    state: &AppState,
    token: &str,
    path: &RunPath,
    name: &str,
) -> Result<(), HttpError> {
    match state
        .authorizer
        .authorize(token, &path.namespace, name, &path.uid)
        .await
    {
        Ok(_) => Ok(()),
        Err(AuthzError::Forbidden { .. }) => Err(forbidden(path)),
        Err(e) => Err(e.into()),
    }
}

/// The 403 for a caller who may not get the Run of `path`.
fn forbidden(path: &RunPath) -> HttpError {
    HttpError::forbidden(format!(
        "{RUN_RESOURCE}.{RUN_GROUP} with UID {:?} is forbidden: the caller cannot {RUN_VERB} it in the namespace {:?}",
        path.uid, path.namespace
    ))
}

/// `message` as a gRPC call to a runtimed that carries the caller's bearer token
/// (`authorization` metadata), for runtimed to authorize the call itself.
pub(crate) fn with_token<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut call = tonic::Request::new(message);
    if let Ok(value) = format!("Bearer {token}").parse() {
        call.metadata_mut().insert("authorization", value);
    }
    call
}

/// The runtimed to call, as its Pod name (which, with the namespace, makes what TLS verifies
/// it as) and address: the owner
/// when routing by owner and the cache knows it, else any ready worker of the Runtime in
/// turn.
fn pick_worker(
    state: &AppState,
    ownership: &Ownership,
    entry: &RunEntry,
) -> Result<(String, SocketAddr), HttpError> {
    if state.invoke_routing == InvokeRouting::Owner
        && let (Some(pod), Some(uid)) = (&entry.assigned_pod, &entry.assigned_pod_uid)
        && let Some(owner) = ownership.pod(pod)
        && owner.uid == *uid
        && owner.ready
        && !owner.deleting
        && let Some(addr) = owner.addr
    {
        return Ok((pod.clone(), addr));
    }
    let mut workers = ownership.ready_workers_named();
    if workers.is_empty() {
        return Err(HttpError::unavailable(
            "the Run's Runtime has no ready worker",
        ));
    }
    let turn = state.runtimes.turn.fetch_add(1, Ordering::Relaxed);
    let index = turn % workers.len();
    Ok(workers.swap_remove(index))
}

/// What a failed call was, for the words of its error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Call {
    /// `the invocation`, `the operation`, `the read`…
    pub what: &'static str,
    /// Whether the call changes anything: then a lost answer leaves the outcome unknown.
    pub mutation: bool,
    /// What RESOURCE_EXHAUSTED means for this call.
    pub busy: &'static str,
}

impl Call {
    pub const INVOKE: Call = Call {
        what: "the invocation",
        mutation: true,
        busy: "the function's concurrency is reached: as many invocations as it allows are in flight",
    };
    pub const OPERATION: Call = Call {
        what: "the operation",
        mutation: true,
        busy: "the session's queue is full",
    };
    pub const CANCEL: Call = Call {
        what: "the cancel",
        mutation: true,
        busy: "the session is busy",
    };
    pub const RENEW: Call = Call {
        what: "the heartbeat",
        mutation: true,
        busy: "the session is busy",
    };
    pub const READ: Call = Call {
        what: "the read",
        mutation: false,
        busy: "the session is busy",
    };
}

/// The HTTP answer for a gRPC error of runtimed (docs/function-mode.md and
/// docs/session-mode.md): NOT_FOUND 404, INVALID_ARGUMENT 400, RESOURCE_EXHAUSTED 429,
/// UNAUTHENTICATED 401, PERMISSION_DENIED 403, FAILED_PRECONDITION and ALREADY_EXISTS 409, OUT_OF_RANGE 413,
/// UNAVAILABLE and ABORTED 503, UNIMPLEMENTED 501, deadlines 504, anything else 502. For a
/// mutation, 502 and 504 say that the outcome is unknown.
pub(crate) fn grpc_error(status: &tonic::Status, call: Call) -> HttpError {
    use tonic::Code;
    let detail = status.message();
    let Call {
        what,
        mutation,
        busy,
    } = call;
    match status.code() {
        Code::NotFound => HttpError::not_found(detail.to_string()),
        Code::InvalidArgument => HttpError::bad_request(detail.to_string()),
        Code::ResourceExhausted => HttpError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "TooManyRequests",
            format!("{busy}: {detail}"),
        ),
        Code::Unauthenticated => HttpError::unauthorized(detail.to_string()),
        Code::PermissionDenied => HttpError::forbidden(detail.to_string()),
        Code::FailedPrecondition => HttpError::conflict(detail.to_string()),
        Code::AlreadyExists => {
            HttpError::new(StatusCode::CONFLICT, "AlreadyExists", detail.to_string())
        }
        Code::OutOfRange => HttpError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "RequestEntityTooLarge",
            detail.to_string(),
        ),
        Code::Unavailable | Code::Aborted => HttpError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "NotReady",
            detail.to_string(),
        ),
        Code::Unimplemented => HttpError::new(
            StatusCode::NOT_IMPLEMENTED,
            "NotImplemented",
            format!("the worker does not serve this call: {detail}"),
        ),
        Code::DeadlineExceeded | Code::Cancelled if mutation => HttpError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "OutcomeUnknown",
            format!("the worker did not answer in time; {what} may or may not have run: {detail}"),
        ),
        Code::DeadlineExceeded | Code::Cancelled => HttpError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "GatewayTimeout",
            format!("the worker did not answer {what} in time: {detail}"),
        ),
        other if mutation => HttpError::bad_gateway(format!(
            "the worker failed ({other:?}); {what} may or may not have run: {detail}"
        )),
        other => HttpError::bad_gateway(format!("the worker failed {what} ({other:?}): {detail}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_errors_map_to_the_documented_statuses() {
        use tonic::Code;
        for (code, status) in [
            (Code::NotFound, StatusCode::NOT_FOUND),
            (Code::InvalidArgument, StatusCode::BAD_REQUEST),
            (Code::ResourceExhausted, StatusCode::TOO_MANY_REQUESTS),
            (Code::Unauthenticated, StatusCode::UNAUTHORIZED),
            (Code::PermissionDenied, StatusCode::FORBIDDEN),
            (Code::FailedPrecondition, StatusCode::CONFLICT),
            (Code::AlreadyExists, StatusCode::CONFLICT),
            (Code::OutOfRange, StatusCode::PAYLOAD_TOO_LARGE),
            (Code::Unavailable, StatusCode::SERVICE_UNAVAILABLE),
            (Code::Aborted, StatusCode::SERVICE_UNAVAILABLE),
            (Code::Unimplemented, StatusCode::NOT_IMPLEMENTED),
            (Code::DeadlineExceeded, StatusCode::GATEWAY_TIMEOUT),
            (Code::Internal, StatusCode::BAD_GATEWAY),
        ] {
            for call in [Call::INVOKE, Call::OPERATION, Call::READ] {
                assert_eq!(
                    grpc_error(&tonic::Status::new(code, "x"), call).status(),
                    status,
                    "{code:?} {call:?}"
                );
            }
        }
    }

    #[test]
    fn only_a_lost_mutation_is_an_unknown_outcome() {
        let lost = tonic::Status::deadline_exceeded("late");
        let e = grpc_error(&lost, Call::OPERATION);
        assert_eq!(e.reason(), "OutcomeUnknown");
        assert!(
            e.message()
                .contains("the operation may or may not have run"),
            "{e}"
        );
        let e = grpc_error(&lost, Call::READ);
        assert_eq!(e.reason(), "GatewayTimeout");
        assert!(!e.message().contains("may or may not"), "{e}");
        let e = grpc_error(
            &tonic::Status::resource_exhausted("32 queued"),
            Call::OPERATION,
        );
        assert_eq!(e.message(), "the session's queue is full: 32 queued");
    }

    #[test]
    fn a_refusal_names_only_what_the_caller_sent() {
        let path = RunPath::new("default".into(), "bash".into(), "0c4e-77ab").expect("path");
        let e = forbidden(&path);
        assert_eq!(e.status(), StatusCode::FORBIDDEN);
        assert!(
            e.message().contains("0c4e-77ab") && e.message().contains("default"),
            "{e}"
        );
    }

    #[test]
    fn paths_are_checked() {
        let ok = RunPath::new("default".into(), "bash".into(), "0c4e-77ab").expect("valid");
        assert_eq!(ok.uid, "0c4e-77ab");
        for (ns, rt, uid) in [
            ("Default", "bash", "u"),
            ("default", "bash_x", "u"),
            ("default", "bash", ""),
            ("default", "bash", "u/../x"),
            ("default", "bash", &"u".repeat(65)),
        ] {
            assert!(
                RunPath::new(ns.into(), rt.into(), uid).is_err(),
                "{ns} {rt} {uid}"
            );
        }
    }

    fn entry(phase: Phase, suspend: bool, auto_suspended: bool) -> RunEntry {
        RunEntry {
            mode: ModeKind::Session,
            name: "s".into(),
            uid: "u".into(),
            phase,
            ready: phase == Phase::Ready,
            attempt: 1,
            assigned_pod: None,
            assigned_pod_uid: (phase == Phase::Ready).then(|| "p".to_string()),
            deleting: false,
            suspend,
            auto_suspended,
            snapshot_sequence: 0,
        }
    }

    /// Issue 19 item 4: only a session its owner suspended (a valid marker) is woken by a
    /// call, Suspended or still being suspended; an explicit suspend is refused 409 as
    /// before, and functions are never woken.
    #[test]
    fn only_an_auto_suspended_session_is_woken() {
        for serving in [Serving::Session, Serving::SessionMutation] {
            assert!(wakes(serving, &entry(Phase::Suspended, true, true)));
            assert!(wakes(serving, &entry(Phase::Ready, true, true)));
            assert!(!wakes(serving, &entry(Phase::Suspended, true, false)));
            assert!(!wakes(serving, &entry(Phase::Ready, true, false)));
            assert!(!wakes(serving, &entry(Phase::Timeout, false, true)));
            let mut deleting = entry(Phase::Suspended, true, true);
            deleting.deleting = true;
            assert!(!wakes(serving, &deleting));
        }
        let mut function = entry(Phase::Ready, true, true);
        function.mode = ModeKind::Function;
        assert!(!wakes(Serving::Function, &function));
        let waking = session_waking("s");
        assert_eq!(waking.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(waking.reason(), SESSION_WAKING_REASON);
        let response = axum::response::IntoResponse::into_response(waking);
        assert_eq!(
            response
                .headers()
                .get(axum::http::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok()),
            Some("1")
        );
    }

    #[test]
    fn sessions_take_calls_while_ready_or_finalizing() {
        for phase in Phase::ALL {
            let refusal = session_refusal("s", phase, false);
            if phase.is_terminal() {
                assert_eq!(refusal.status(), StatusCode::CONFLICT, "{phase:?}");
                assert_eq!(refusal.reason(), "SessionEnded");
            } else if phase == Phase::Suspended {
                assert_eq!(refusal.status(), StatusCode::CONFLICT);
                assert_eq!(refusal.reason(), SESSION_SUSPENDED_REASON);
                assert!(refusal.message().contains("spec.suspend"), "{refusal}");
            } else {
                assert_eq!(
                    refusal.status(),
                    StatusCode::SERVICE_UNAVAILABLE,
                    "{phase:?}"
                );
            }
        }
        for phase in [Phase::Ready, Phase::Suspended] {
            let deleting = session_refusal("s", phase, true);
            assert_eq!(deleting.status(), StatusCode::CONFLICT);
            assert!(deleting.message().contains("being deleted"), "{deleting}");
        }
        let suspending = session_suspending("s");
        assert_eq!(suspending.status(), StatusCode::CONFLICT);
        assert_eq!(suspending.reason(), SESSION_SUSPENDING_REASON);
        let path = RunPath::new("default".into(), "bash".into(), "u").expect("path");
        assert_eq!(
            Serving::Session.refusal(&path, None).status(),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            Serving::Function.refusal(&path, None).status(),
            StatusCode::NOT_FOUND
        );
    }
}
