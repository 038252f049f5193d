//! `Runtimed.Invoke`: one function invocation, routed from the ownership cache (design
//! document 000, "Runtime Gateway" and "Invoke Contract").
//!
//! 1. Validate the request; the caller's bearer token (`authorization` metadata) must be
//!    there (else UNAUTHENTICATED).
//! 2. Look the Run UID up in the [`Ownership`] cache: unknown → NOT_FOUND. Then authorize
//!    the token to `get` that exact Run (namespace, name, UID) with the same cached
//!    authorizer the gateway uses ([`kruntimes_wire::Authorizer`]: TokenReview plus
//!    SubjectAccessReview, successes cached 30 s, flushed by revocations): unknown token →
//!    UNAUTHENTICATED, refused → PERMISSION_DENIED, API unreachable → UNAVAILABLE. Not
//!    serving (registering, recovering, terminating, ended) → UNAVAILABLE.
//! 3. Owned here (assigned Pod name and UID are this worker's) → the local registration →
//!    `FunctionRuntime.InvokeFunction`. A forwarded call must match the attempt and Pod UID
//!    it expects, else ABORTED: the two caches disagree and the caller must not guess.
//! 4. Owned elsewhere → forward once to the owner's runtimed with `hops = 1` and the same
//!    credential metadata. A call that already hopped is never forwarded again. An owner
//!    that is not ready, deleting, replaced or unreachable → UNAVAILABLE.
//!
//! Every runtimed that handles a call authorizes it itself, the forwarder and the owner
//! alike (design document 000: "the owner repeats or reuses the same bounded authorization
//! decision"): no header or certificate stands in for the caller's token, so a worker (or
//! user code that read a worker's key) cannot forge a decision. With TLS material the gRPC
//! port also accepts only callers with a certificate from the cluster CA, `Invoke` and the
//! session calls only from the gateway (hops 0) or a worker of this Runtime (hops 1), and a
//! forward verifies the owner as its worker identity ([`Peers`], `worker_identity`).
//!
//! Nothing here retries after dispatch: a broken connection has an unknown outcome.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kruntimes_api::run::ModeKind;
use kruntimes_proto::runtime::v1 as rs;
use kruntimes_proto::runtimed::v1 as pb;
use kruntimes_wire::{Authorizer, AuthzError};
use tonic::metadata::MetadataMap;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};
use tracing::{debug, info, warn};

use crate::grpc::{WorkerTls, worker_channel, worker_identity};
use crate::reconcile::Context;
use kruntimes_wire::ownership::{Ownership, RunEntry};

/// The metadata key of the caller's credential (`Bearer <token>`), forwarded as it came.
pub const AUTHORIZATION: &str = "authorization";
/// The longest bearer token taken from a call (the embedded API server refuses longer).
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;
/// The largest request payload (ARCHITECTURE.md, "Limits").
pub const MAX_PAYLOAD_BYTES: usize = 1024 * 1024;
/// The longest invocation ID.
pub const MAX_INVOCATION_ID_BYTES: usize = 128;
pub use kruntimes_wire::worker::{
    CACHE_GRACE, DEFAULT_INVOKE_TIMEOUT as DEFAULT_TIMEOUT, GATEWAY_IDENTITY,
    MAX_INVOKE_TIMEOUT as MAX_TIMEOUT,
};
/// Connecting to a peer runtimed may take this long.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Peer channels kept open at most.
const MAX_PEERS: usize = 64;

/// A peer: the owner Pod's name (in this worker's namespace, which makes its worker
/// identity) and its runtimed's address.
pub(crate) type PeerKey = (String, SocketAddr);

/// Channels to peer runtimeds (of this worker's namespace), one per Pod name and address,
/// the oldest dropped first. With TLS, each presents this worker's certificate and
/// verifies the peer as its worker identity (its Pod name in this namespace), so a new
/// incarnation at a reused port is never mistaken for the old one.
pub struct Peers {
    tls: Option<WorkerTls>,
    namespace: String,
    channels: Mutex<VecDeque<(PeerKey, Channel)>>,
}

impl Peers {
    /// Peers in `namespace` reached with mutual TLS when `tls` is given, in plaintext
    /// otherwise.
    pub fn new(tls: Option<WorkerTls>, namespace: String) -> Peers {
        Peers {
            tls,
            namespace,
            channels: Mutex::default(),
        }
    }

    fn get(&self, pod: &str, addr: SocketAddr) -> Result<Channel, Status> {
        let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, channel)) = channels.iter().find(|((p, a), _)| p == pod && *a == addr) {
            return Ok(channel.clone());
        }
        let channel = worker_channel(
            addr,
            &worker_identity(&self.namespace, pod),
            self.tls.as_ref(),
            CONNECT_TIMEOUT,
        )
        .map_err(|e| {
            warn!(pod, %addr, error = %e, "cannot configure a channel to a peer runtimed");
            Status::internal(format!("cannot reach the owner Pod {pod} at {addr}: {e}"))
        })?;
        if channels.len() >= MAX_PEERS {
            channels.pop_front();
        }
        channels.push_back(((pod.to_string(), addr), channel.clone()));
        Ok(channel)
    }

    fn forget(&self, pod: &str, addr: SocketAddr) {
        self.channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|((p, a), _)| !(p == pod && *a == addr));
    }
}

/// What the invoke path needs besides the reconciler's context.
pub struct Invoker {
    pub context: Arc<Context>,
    pub ownership: Arc<Ownership>,
    /// This worker's Runtime.
    pub runtime: String,
    pub peers: Peers,
    /// Callers are known by their client certificates (mutual TLS): only the gateway may
    /// send an `Invoke`, and only a worker of this Runtime may forward one, as far as the
    /// certificates tell workers apart: standalone, each is its incarnation's; on a
    /// cluster, one certificate (`*.NAMESPACE.kruntimes-worker`) serves every worker of the
    /// namespace, of any Runtime there. False in plaintext mode, where nobody is known
    /// (runtimed warns at start).
    pub identities: bool,
    /// The ownership cache's watches, started by the first `Invoke`: a worker that serves
    /// tasks only never watches its Runtime's Runs and Pods for them.
    pub watches: std::sync::OnceLock<tokio::task::JoinHandle<()>>,
    /// Authorizes every call with the caller's token (the gateway's authorizer, cached).
    pub authorizer: Arc<Authorizer>,
    /// The authorizer's revocation watches, started by the first call that authorizes.
    pub revocations: std::sync::OnceLock<tokio::task::JoinHandle<()>>,
}

/// How long the first `Invoke` of a worker waits for its ownership cache to be listed.
const SYNC_WAIT: Duration = Duration::from_secs(5);

/// Whether the leaf of `certs` is issued to one of `names` (a DNS name of its SAN).
fn issued_to<N: AsRef<str>>(
    certs: &[rustls::pki_types::CertificateDer<'static>],
    names: impl IntoIterator<Item = N>,
) -> bool {
    let Some(leaf) = certs.first() else {
        return false;
    };
    let Ok(cert) = webpki::EndEntityCert::try_from(leaf) else {
        return false;
    };
    names.into_iter().any(|name| {
        rustls::pki_types::ServerName::try_from(name.as_ref())
            .is_ok_and(|server_name| cert.verify_is_valid_for_subject_name(&server_name).is_ok())
    })
}

/// The caller's bearer token from `authorization` metadata (`Bearer <token>`):
/// UNAUTHENTICATED when it is missing, malformed or longer than [`MAX_TOKEN_BYTES`].
pub(crate) fn bearer_token(metadata: &MetadataMap) -> Result<&str, Status> {
    let missing = || Status::unauthenticated("the call carries no bearer token");
    let value = metadata.get(AUTHORIZATION).ok_or_else(missing)?;
    let text = value.to_str().map_err(|_| missing())?;
    let (scheme, token) = text.trim().split_once(' ').ok_or_else(missing)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer")
        || token.is_empty()
        || token.len() > MAX_TOKEN_BYTES
        || token.contains(|c: char| c.is_ascii_whitespace())
    {
        return Err(missing());
    }
    Ok(token)
}

/// The gRPC status of an authorization refusal. Messages never carry the token (the
/// authorizer scrubs it from what it reports), and a refusal never names the Run (the
/// caller sent its UID only; the gateway passes the message on).
pub(crate) fn authz_status(error: &AuthzError) -> Status {
    match error {
        AuthzError::Unauthenticated => Status::unauthenticated(error.to_string()),
        AuthzError::Forbidden { .. } => {
            Status::permission_denied("the caller may not get this Run")
        }
        AuthzError::Unavailable(review) => {
            Status::unavailable(format!("authorization is unavailable: {review}"))
        }
    }
}

fn validate(request: &pb::InvokeRequest) -> Result<Duration, Status> {
    if request.run_uid.is_empty() || request.run_uid.len() > 64 {
        return Err(Status::invalid_argument(
            "run_uid must be a Run's metadata.uid",
        ));
    }
    if request.invocation_id.is_empty() || request.invocation_id.len() > MAX_INVOCATION_ID_BYTES {
        return Err(Status::invalid_argument(format!(
            "the invocation ID must be 1 to {MAX_INVOCATION_ID_BYTES} bytes"
        )));
    }
    if request.payload.len() > MAX_PAYLOAD_BYTES {
        return Err(Status::invalid_argument(format!(
            "the payload exceeds {MAX_PAYLOAD_BYTES} bytes"
        )));
    }
    if request.hops > 1 {
        return Err(Status::invalid_argument("a call is forwarded at most once"));
    }
    let timeout = match request.timeout {
        None => DEFAULT_TIMEOUT,
        Some(t) => Duration::try_from(t)
            .map_err(|_| Status::invalid_argument("the timeout must not be negative"))?,
    };
    let timeout = if timeout.is_zero() {
        DEFAULT_TIMEOUT
    } else {
        timeout
    };
    if timeout > MAX_TIMEOUT {
        return Err(Status::invalid_argument(format!(
            "the timeout is at most {}s",
            MAX_TIMEOUT.as_secs()
        )));
    }
    Ok(timeout)
}

impl Invoker {
    /// Stops the ownership cache's and the authorizer's watches, if they were started.
    pub fn stop_watches(&self) {
        if let Some(watches) = self.watches.get() {
            watches.abort();
        }
        if let Some(revocations) = self.revocations.get() {
            revocations.abort();
        }
    }

    /// Whether the holder of `token` may `get` the Run `namespace`/`name` with UID `uid`:
    /// the cached authorizer, whose revocation watches the first call starts.
    pub(crate) async fn authorize(
        &self,
        token: &str,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Result<(), Status> {
        self.revocations.get_or_init(|| {
            tokio::spawn(kruntimes_wire::revocation::watch_revocations(
                self.context.client.clone(),
                self.authorizer.clone(),
            ))
        });
        match self.authorizer.authorize(token, namespace, name, uid).await {
            Ok(_) => Ok(()),
            Err(error) => {
                debug!(namespace, run = name, run_uid = uid, error = %error, "call refused by authorization");
                Err(authz_status(&error))
            }
        }
    }

    /// Serves one `Invoke` call and counts it in the metrics.
    pub async fn invoke(
        &self,
        request: Request<pb::InvokeRequest>,
    ) -> Result<pb::InvokeResponse, Status> {
        let metrics = &self.context.metrics;
        metrics.in_flight.inc();
        let started = std::time::Instant::now();
        let answer = self.route(request).await;
        metrics.in_flight.dec();
        let result = match &answer {
            Ok(response) => match response.invocation.as_ref().map(|i| i.outcome()) {
                Some(rs::InvocationOutcome::Succeeded) => "succeeded",
                Some(rs::InvocationOutcome::Failed) => "failed",
                Some(rs::InvocationOutcome::TimedOut) => "timed_out",
                Some(rs::InvocationOutcome::Unspecified) | None => "error",
            },
            Err(status) => match status.code() {
                Code::ResourceExhausted => "rejected",
                Code::Unavailable | Code::Aborted => "not_ready",
                Code::NotFound => "not_found",
                Code::PermissionDenied => "denied",
                Code::InvalidArgument => "invalid",
                _ => "error",
            },
        };
        metrics.invocation(result, started.elapsed().as_secs_f64());
        answer
    }

    async fn route(
        &self,
        request: Request<pb::InvokeRequest>,
    ) -> Result<pb::InvokeResponse, Status> {
        let peer_certs = request.peer_certs();
        let (metadata, _, request) = request.into_parts();
        let timeout = validate(&request)?;
        let target = Target {
            namespace: &request.namespace,
            runtime: &request.runtime,
            run_uid: &request.run_uid,
            hops: request.hops,
            expected_attempt: request.expected_attempt,
            expected_pod_uid: &request.expected_pod_uid,
            mode: ModeKind::Function,
        };
        let located = self.locate(peer_certs, &metadata, &target).await?;
        if located.local {
            return self
                .local(
                    &request,
                    &located.entry.name,
                    located.entry.attempt,
                    timeout,
                )
                .await;
        }
        self.forward(metadata, request, &located, timeout).await
    }

    /// Steps 1 and 2 of the module's routing, before the Run is looked up: a well-formed
    /// target, a synced cache, the caller's certificate, this worker's Runtime; the
    /// caller's bearer token.
    pub(crate) async fn caller<'m>(
        &self,
        peer_certs: Option<Arc<Vec<rustls::pki_types::CertificateDer<'static>>>>,
        metadata: &'m MetadataMap,
        target: &Target<'_>,
    ) -> Result<&'m str, Status> {
        if target.run_uid.is_empty() || target.run_uid.len() > 64 {
            return Err(Status::invalid_argument(
                "run_uid must be a Run's metadata.uid",
            ));
        }
        if target.hops > 1 {
            return Err(Status::invalid_argument("a call is forwarded at most once"));
        }
        // A forwarder is checked against the cache's worker Pods: list them first.
        self.watches.get_or_init(|| {
            tokio::spawn(self.ownership.clone().run_watches(
                self.context.client.clone(),
                self.context.namespace.clone(),
                self.runtime.clone(),
            ))
        });
        if !self.ownership.synced() && !self.ownership.wait_synced(SYNC_WAIT).await {
            return Err(Status::unavailable(
                "this worker's ownership cache is not synced yet",
            ));
        }
        if self.identities {
            // The certificate chains to the cluster CA (the TLS handshake checked that);
            // here: is it the one caller that may send this call?
            let known = peer_certs.is_some_and(|certs| {
                if target.hops == 0 {
                    issued_to(&certs, [GATEWAY_IDENTITY])
                } else {
                    let namespace = &self.context.namespace;
                    let workers = self.ownership.worker_names();
                    issued_to(
                        &certs,
                        workers.iter().map(|pod| worker_identity(namespace, pod)),
                    )
                }
            });
            if !known {
                return Err(Status::permission_denied(if target.hops == 0 {
                    "only the gateway may send this call"
                } else {
                    "only a worker of this Runtime may forward a call"
                }));
            }
        }
        if target.namespace != self.context.namespace || target.runtime != self.runtime {
            return Err(Status::not_found(format!(
                "this worker serves Runtime {}/{} only",
                self.context.namespace, self.runtime
            )));
        }
        bearer_token(metadata)
    }

    /// Steps 1 to 4 of the module's routing for any call naming a function or session
    /// Run: who may call, the authorization decision, the cache lookup, the forwarded
    /// call's expectations. Says whether the Run is owned here; a Run owned elsewhere is
    /// returned only to a call that has not hopped yet.
    pub(crate) async fn locate(
        &self,
        peer_certs: Option<Arc<Vec<rustls::pki_types::CertificateDer<'static>>>>,
        metadata: &MetadataMap,
        target: &Target<'_>,
    ) -> Result<Located, Status> {
        let token = self.caller(peer_certs, metadata, target).await?;
        let what = target.mode.as_str();

        let entry = match self.ownership.run(target.run_uid) {
            Some(entry) if entry.serving() => Some(entry),
            // The cache may not have seen the newest state yet: give it a moment.
            _ => {
                self.ownership
                    .wait_serving(target.run_uid, CACHE_GRACE)
                    .await
            }
        };
        let entry = entry.ok_or_else(|| {
            Status::not_found(format!("no {what} Run with that UID in this Runtime"))
        })?;
        self.authorize(token, target.namespace, &entry.name, &entry.uid)
            .await?;
        if entry.mode != target.mode {
            return Err(Status::failed_precondition(format!(
                "Run {} is a {} Run, not a {what} Run",
                entry.name,
                entry.mode.as_str()
            )));
        }
        if !entry.serving() {
            return Err(Status::unavailable(format!(
                "{what} Run {} is not ready (phase {}{})",
                entry.name,
                entry.phase,
                if entry.deleting { ", deleting" } else { "" }
            )));
        }
        let (Some(pod), Some(pod_uid)) = (&entry.assigned_pod, &entry.assigned_pod_uid) else {
            return Err(Status::unavailable(format!("the {what} Run has no owner")));
        };
        let own_uid = self.context.own_uid_now();
        let local = *pod == self.context.pod_name && own_uid.as_deref() == Some(pod_uid.as_str());
        if target.hops == 1
            && (target.expected_attempt != entry.attempt || target.expected_pod_uid != *pod_uid)
        {
            return Err(Status::aborted(format!(
                "the forwarder expected attempt {} on Pod UID {}, this worker sees attempt {} on {}",
                target.expected_attempt, target.expected_pod_uid, entry.attempt, pod_uid
            )));
        }
        if !local && target.hops >= 1 {
            return Err(Status::unavailable(
                "a forwarded call reached a worker that does not own the Run",
            ));
        }
        Ok(Located { entry, local })
    }

    /// A client of the owner's runtimed, for a Run [`locate`](Self::locate)d elsewhere,
    /// and the credential metadata the call carries on.
    pub(crate) fn owner(
        &self,
        located: &Located,
    ) -> Result<(pb::runtimed_client::RuntimedClient<Channel>, PeerKey), Status> {
        let entry = &located.entry;
        let (Some(pod), Some(pod_uid)) = (&entry.assigned_pod, &entry.assigned_pod_uid) else {
            return Err(Status::unavailable("the Run has no owner"));
        };
        let owner = self
            .ownership
            .pod(pod)
            .filter(|p| p.uid == *pod_uid && p.ready && !p.deleting)
            .ok_or_else(|| {
                Status::unavailable(format!(
                    "the owner of the Run (Pod {pod}) is stale or not ready; recovery is under way"
                ))
            })?;
        let addr = owner
            .addr
            .ok_or_else(|| Status::unavailable(format!("the owner Pod {pod} has no address")))?;
        self.context.metrics.forwarded.inc();
        let channel = self.peers.get(pod, addr)?;
        Ok((
            pb::runtimed_client::RuntimedClient::new(channel),
            (pod.clone(), addr),
        ))
    }

    /// After a forwarded call failed: an unreachable owner's channel is dropped.
    pub(crate) fn forwarded_failed(&self, peer: &PeerKey, status: &Status) {
        if status.code() == Code::Unavailable {
            self.peers.forget(&peer.0, peer.1);
        }
    }

    async fn local(
        &self,
        request: &pb::InvokeRequest,
        name: &str,
        attempt: u32,
        timeout: Duration,
    ) -> Result<pb::InvokeResponse, Status> {
        let registration = self
            .context
            .registrations
            .get(&request.run_uid)
            .filter(|r| r.attempt == attempt && r.accepting)
            .ok_or_else(|| {
                Status::unavailable("the function is recovering or terminating on its worker")
            })?;
        let call = rs::InvokeFunctionRequest {
            registration_id: registration.id,
            invocation_id: request.invocation_id.clone(),
            payload: request.payload.clone(),
            timeout: prost_types::Duration::try_from(timeout).ok(),
        };
        let answer = self.context.functions.clone().invoke_function(call).await;
        match answer {
            Ok(response) => {
                let invocation = response.into_inner();
                debug!(
                    runtime = %self.runtime,
                    run = name,
                    run_uid = %request.run_uid,
                    invocation_id = %request.invocation_id,
                    outcome = invocation.outcome,
                    "invocation served"
                );
                Ok(pb::InvokeResponse {
                    invocation: Some(invocation),
                    run_name: name.to_string(),
                    served_by: self.context.pod_name.clone(),
                    hops: request.hops,
                    attempt,
                })
            }
            Err(status) => match status.code() {
                // The registration is gone or broken: not ready; the reconciler recovers.
                Code::NotFound | Code::FailedPrecondition => {
                    info!(
                        runtime = %self.runtime,
                        run = name,
                        run_uid = %request.run_uid,
                        invocation_id = %request.invocation_id,
                        code = ?status.code(),
                        "registration unusable; recovering"
                    );
                    self.context.requeue_run(name);
                    Err(Status::unavailable(format!(
                        "the function's registration is unusable and recovers: {}",
                        status.message()
                    )))
                }
                _ => Err(status),
            },
        }
    }

    async fn forward(
        &self,
        metadata: MetadataMap,
        mut request: pb::InvokeRequest,
        located: &Located,
        timeout: Duration,
    ) -> Result<pb::InvokeResponse, Status> {
        request.hops = 1;
        request.expected_attempt = located.entry.attempt;
        request.expected_pod_uid = located.entry.assigned_pod_uid.clone().unwrap_or_default();
        let limit = timeout + Duration::from_secs(5);
        self.to_owner(
            located,
            &metadata,
            request,
            limit,
            |mut owner, call| async move { owner.invoke(call).await },
        )
        .await
    }
}

/// Which Run a call names and how it was routed.
pub(crate) struct Target<'a> {
    pub namespace: &'a str,
    pub runtime: &'a str,
    pub run_uid: &'a str,
    pub hops: u32,
    pub expected_attempt: u32,
    pub expected_pod_uid: &'a str,
    pub mode: ModeKind,
}

/// A Run found in the cache, serving.
pub(crate) struct Located {
    pub entry: RunEntry,
    /// Owned by this worker.
    pub local: bool,
}

/// `message` as a call to the owner, with the caller's credential metadata.
pub(crate) fn forwarded<T>(metadata: &MetadataMap, message: T) -> Request<T> {
    let mut call = Request::new(message);
    if let Some(value) = metadata.get(AUTHORIZATION) {
        call.metadata_mut().insert(AUTHORIZATION, value.clone());
    }
    call
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::metadata::MetadataValue;

    fn with_authorization(value: &str) -> MetadataMap {
        let mut metadata = MetadataMap::new();
        if let Ok(value) = MetadataValue::try_from(value) {
            metadata.insert(AUTHORIZATION, value);
        }
        metadata
    }

    #[test]
    fn calls_must_carry_a_bounded_bearer_token() {
        assert_eq!(
            bearer_token(&with_authorization("Bearer abc.def")).ok(),
            Some("abc.def")
        );
        assert_eq!(
            bearer_token(&with_authorization("bearer  abc")).ok(),
            Some("abc")
        );
        let long = format!("Bearer {}", "x".repeat(MAX_TOKEN_BYTES + 1));
        for bad in [
            "",
            "Bearer",
            "Bearer ",
            "Basic abc",
            "Bearer a b",
            long.as_str(),
        ] {
            assert_eq!(
                bearer_token(&with_authorization(bad)).map_err(|s| s.code()),
                Err(Code::Unauthenticated),
                "{bad:.20}"
            );
        }
        assert_eq!(
            bearer_token(&MetadataMap::new()).map_err(|s| s.code()),
            Err(Code::Unauthenticated)
        );
    }

    #[test]
    fn requests_are_bounded() {
        let ok = pb::InvokeRequest {
            namespace: "default".into(),
            runtime: "python".into(),
            run_uid: "u".into(),
            invocation_id: "i".into(),
            payload: b"{}".to_vec(),
            ..Default::default()
        };
        assert_eq!(validate(&ok).ok(), Some(DEFAULT_TIMEOUT));
        let long_id = pb::InvokeRequest {
            invocation_id: "x".repeat(129),
            ..ok.clone()
        };
        assert!(validate(&long_id).is_err());
        let big = pb::InvokeRequest {
            payload: vec![b' '; MAX_PAYLOAD_BYTES + 1],
            ..ok.clone()
        };
        assert!(validate(&big).is_err());
        let looped = pb::InvokeRequest {
            hops: 2,
            ..ok.clone()
        };
        assert!(validate(&looped).is_err());
        let slow = pb::InvokeRequest {
            timeout: Some(prost_types::Duration {
                seconds: 301,
                nanos: 0,
            }),
            ..ok
        };
        assert!(validate(&slow).is_err());
    }
}
