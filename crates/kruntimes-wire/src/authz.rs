//! Per-Run authorization of a caller of the gateway or of a worker's runtimed, through the
//! Kubernetes API. The gateway and runtimed use this same authorizer (ARCHITECTURE.md,
//! "Security stance": every component that serves a caller's request authorizes it itself).
//!
//! [`Authorizer::authorize`] answers one question: may the holder of this bearer token `get`
//! this Run? It asks the API server, as a real cluster's components do, with an
//! `authentication.k8s.io/v1` TokenReview followed by an `authorization.k8s.io/v1`
//! SubjectAccessReview for verb `get` on `runs.kruntimes.io` with the Run's namespace and name.
//! The same code runs against the embedded API server and against a real cluster.
//!
//! Successes are cached ([`AuthCache`]) for a short TTL (30 s by default), never past the
//! token's own expiry when the token says when that is, in at most `capacity` entries (1024 by
//! default, least recently used evicted first). Keys are SHA-256(token) plus the Run's
//! namespace, name and UID, so a recreated Run with the same name is reviewed again. Denials
//! and errors are never cached: the next request asks again. TTL 0 or capacity 0 disables the
//! cache.
//!
//! [`Authorizer::invalidate`] drops every cached success at once; the watches of
//! [`crate::revocation`] call it whenever an object a decision rests on changes (a token, a
//! ServiceAccount, an RBAC role or binding), so a revocation takes effect within the watch's
//! latency and the TTL is only the backstop. Each invalidation bumps a generation: a review
//! that was under way while the cache was flushed is answered to its caller but never cached
//! (its answer may predate the revocation). [`Authorizer::invalidations`] lets a long-lived
//! connection re-check its caller on every flush.
//!
//! A flush makes every open connection re-check at the same instant, so reviews are
//! coalesced and bounded: concurrent requests for the same key (token digest, namespace,
//! name, UID) share one review in flight (single flight), provided it began in the current
//! generation (a request that arrives after a flush never joins a review begun before it),
//! and at most [`AuthorizerConfig::max_reviews_in_flight`] reviews (64 by default) ask the
//! API server at once; the others wait for a slot, within the request timeout. A review
//! whose caller goes away (the request is dropped) hands the question to one of the
//! requests that joined it.
//!
//! This module never stores or logs a raw token. It keeps only the digest, logs at most an
//! eight-hex-digit prefix of it, and scrubs the token out of any message it builds from an
//! API server answer. It never decides anything itself: the API server is the authority, and
//! the token's `exp` claim, read without verifying the signature, can only shorten caching.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec, SubjectAccessReviewStatus,
};
use kube::api::{Api, PostParams};
use sha2::{Digest, Sha256};
use tokio::sync::{Semaphore, SemaphorePermit, watch};

/// How long a success is served from the cache by default (ARCHITECTURE.md, "Limits").
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);
/// How many successes the cache holds by default (ARCHITECTURE.md, "Limits").
pub const DEFAULT_CAPACITY: usize = 1024;
/// How long one review request may take by default before the answer is "unavailable".
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How many reviews ask the API server at once, at most, by default.
pub const DEFAULT_MAX_REVIEWS_IN_FLIGHT: usize = 64;
/// The longest message an [`AuthzError`] carries, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 512;

/// The API group of the Run kind.
pub const RUN_GROUP: &str = "kruntimes.io";
/// The resource (plural) of the Run kind.
pub const RUN_RESOURCE: &str = "runs";
/// The verb a caller needs on a Run to use it through the gateway.
pub const RUN_VERB: &str = "get";

/// A configured TTL longer than this is clamped, so that `Instant` arithmetic cannot overflow.
const MAX_CACHE_LIFETIME: Duration = Duration::from_secs(365 * 24 * 60 * 60);
/// A JWT payload longer than this is not decoded; such a token gets the TTL only.
const MAX_JWT_PAYLOAD_BYTES: usize = 16 * 1024;
/// How many hex digits of the token digest appear in log lines.
const DIGEST_PREFIX_BYTES: usize = 4;

/// base64url, with or without padding (JWTs are unpadded, but be lenient).
const BASE64URL: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::URL_SAFE,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

// ---------------------------------------------------------------------------------------
// Configuration, answers and errors
// ---------------------------------------------------------------------------------------

/// How the [`Authorizer`] caches and how long it waits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthorizerConfig {
    /// How long a success is served from the cache. Zero disables the cache.
    pub ttl: Duration,
    /// The most successes the cache holds. Zero disables the cache.
    pub capacity: usize,
    /// How long each review request may take; zero means no limit of our own. Waiting
    /// for a slot among [`AuthorizerConfig::max_reviews_in_flight`] counts towards it.
    pub request_timeout: Duration,
    /// The most reviews (a TokenReview, then a SubjectAccessReview) asking the API server
    /// at once; zero means no limit.
    pub max_reviews_in_flight: usize,
}

impl Default for AuthorizerConfig {
    fn default() -> Self {
        AuthorizerConfig {
            ttl: DEFAULT_TTL,
            capacity: DEFAULT_CAPACITY,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            max_reviews_in_flight: DEFAULT_MAX_REVIEWS_IN_FLIGHT,
        }
    }
}

impl AuthorizerConfig {
    /// Whether successes are cached at all.
    pub fn cache_enabled(&self) -> bool {
        !self.ttl.is_zero() && self.capacity > 0
    }
}

/// Who the token belongs to, as the API server's TokenReview reported it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Principal {
    /// For example `system:serviceaccount:team-a:agent` or `alice`.
    pub username: String,
    pub uid: Option<String>,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

/// Why a request may not use a Run.
#[derive(Clone, Debug, thiserror::Error)]
pub enum AuthzError {
    /// The token is missing, unknown, expired or revoked (HTTP 401).
    #[error("the bearer token is missing, unknown, expired or revoked")]
    Unauthenticated,
    /// The token is valid, but its holder may not `get` this Run (HTTP 403).
    #[error("forbidden: {reason}")]
    Forbidden {
        /// What was refused, in the words of a Kubernetes 403; at most [`MAX_MESSAGE_BYTES`].
        reason: String,
    },
    /// The API server could not be asked, or gave no usable answer (HTTP 503).
    #[error("authorization is unavailable")]
    Unavailable(#[source] ReviewError),
}

impl AuthzError {
    /// The HTTP status a server answers with for this error.
    pub fn http_status(&self) -> u16 {
        match self {
            AuthzError::Unauthenticated => 401,
            AuthzError::Forbidden { .. } => 403,
            AuthzError::Unavailable(_) => 503,
        }
    }
}

/// Which review request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReviewKind {
    TokenReview,
    SubjectAccessReview,
}

impl fmt::Display for ReviewKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReviewKind::TokenReview => "TokenReview",
            ReviewKind::SubjectAccessReview => "SubjectAccessReview",
        })
    }
}

/// A review request that failed or was answered unusably.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{review} request failed: {detail}")]
pub struct ReviewError {
    pub review: ReviewKind,
    /// What went wrong, at most [`MAX_MESSAGE_BYTES`], with the raw token scrubbed out.
    pub detail: String,
}

/// Counters of the authorizer's cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AuthzStats {
    /// Requests answered from the cache.
    pub hits: u64,
    /// Requests not answered from the cache (every request when the cache is disabled):
    /// each was reviewed by the API server, or joined a review already in flight.
    pub misses: u64,
    /// Times a miss joined a review already in flight instead of asking again.
    pub coalesced: u64,
    /// Entries the cache holds now, expired ones not yet removed included.
    pub entries: usize,
}

// ---------------------------------------------------------------------------------------
// The authorizer
// ---------------------------------------------------------------------------------------

/// Decides whether a bearer token may use a Run; see the module documentation.
///
/// Cheap to share behind an `Arc`: every method takes `&self`.
pub struct Authorizer {
    token_reviews: Api<TokenReview>,
    access_reviews: Api<SubjectAccessReview>,
    config: AuthorizerConfig,
    cache: Mutex<Generational>,
    /// The generation of the last invalidation, for connections that re-check on it.
    invalidated: watch::Sender<u64>,
    /// Slots of reviews asking the API server at once; `None` without a limit.
    review_slots: Option<Semaphore>,
    hits: AtomicU64,
    misses: AtomicU64,
    coalesced: AtomicU64,
}

/// What a review answers: who the caller is, or why not.
type Outcome = Result<Principal, AuthzError>;

/// A review in flight that other requests for the same key may join.
struct Flight {
    /// Tells the flight apart from a later one for the same key.
    id: u64,
    /// The generation it began in: a request of a later one must not join it.
    generation: u64,
    /// `Some` once the review answered; closed without a value if its leader went away.
    outcome: watch::Receiver<Option<Outcome>>,
}

/// Held by the request that leads a flight: removes the flight when the review ends or the
/// request is dropped, before its sender closes (so that joiners woken by the close find
/// the flight gone and one of them leads a new one).
struct Leading<'a> {
    authorizer: &'a Authorizer,
    key: &'a CacheKey,
    id: u64,
    generation: u64,
    outcome: watch::Sender<Option<Outcome>>,
}

impl Leading<'_> {
    /// Hands the outcome to every request that joined.
    fn publish(&mut self, outcome: &Outcome) {
        self.outcome.send_replace(Some(outcome.clone()));
    }
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        let mut cache = self.authorizer.lock_cache();
        if cache.flights.get(self.key).is_some_and(|f| f.id == self.id) {
            cache.flights.remove(self.key);
        }
    }
}

/// How a request was answered.
enum Resolved<'a> {
    /// From the cache.
    Hit(Principal),
    /// By a review another request led.
    Joined(Outcome),
    /// This request leads the review: it must ask, publish the outcome and drop the guard.
    Lead(Leading<'a>),
}

/// The cache and the count of invalidations so far, under one lock: an insert checks the
/// generation it started under against the current one without a gap a flush could use.
struct Generational {
    entries: AuthCache<CacheKey, Principal>,
    /// Tokens the API server authenticated lately, by SHA-256 (see [`Authorizer::authenticate`]).
    authenticated: AuthCache<[u8; 32], Principal>,
    generation: u64,
    /// Reviews in flight by key. Authentications use keys with an empty namespace and
    /// name, which no authorization has, so the two never share a flight.
    flights: HashMap<CacheKey, Flight>,
    next_flight: u64,
}

impl fmt::Debug for Authorizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Authorizer")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Authorizer {
    /// An authorizer that reviews through `client`, whose identity needs `create` on
    /// `tokenreviews.authentication.k8s.io` and `subjectaccessreviews.authorization.k8s.io`.
    pub fn new(client: kube::Client, config: AuthorizerConfig) -> Authorizer {
        let capacity = if config.cache_enabled() {
            config.capacity
        } else {
            0
        };
        Authorizer {
            token_reviews: Api::all(client.clone()),
            access_reviews: Api::all(client),
            cache: Mutex::new(Generational {
                entries: AuthCache::new(capacity),
                authenticated: AuthCache::new(capacity),
                generation: 0,
                flights: HashMap::new(),
                next_flight: 0,
            }),
            invalidated: watch::Sender::new(0),
            review_slots: (config.max_reviews_in_flight > 0)
                .then(|| Semaphore::new(config.max_reviews_in_flight.min(Semaphore::MAX_PERMITS))),
            config,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            coalesced: AtomicU64::new(0),
        }
    }

    pub fn config(&self) -> &AuthorizerConfig {
        &self.config
    }

    /// The cache counters so far.
    pub fn stats(&self) -> AuthzStats {
        AuthzStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            coalesced: self.coalesced.load(Ordering::Relaxed),
            entries: self.lock_cache().entries.len(),
        }
    }

    /// Drops every cached success and bumps the generation, so that a review under way now
    /// is not cached when it completes. `why` is logged (never a token).
    pub fn invalidate(&self, why: &str) {
        let generation = {
            let mut cache = self.lock_cache();
            cache.entries.clear();
            cache.authenticated.clear();
            cache.generation += 1;
            cache.generation
        };
        tracing::debug!(generation, why, "authorization cache invalidated");
        self.invalidated.send_replace(generation);
    }

    /// How many invalidations there have been.
    pub fn generation(&self) -> u64 {
        self.lock_cache().generation
    }

    /// Changes whenever the cache is invalidated: a long-lived connection waits on it
    /// (`changed()`) and authorizes its caller again.
    pub fn invalidations(&self) -> watch::Receiver<u64> {
        self.invalidated.subscribe()
    }

    /// Whether the holder of `token` may `get` the Run `namespace`/`run_name` whose
    /// `metadata.uid` is `run_uid`, and who they are.
    ///
    /// A cached success for the same token digest, namespace, name and UID is returned
    /// without asking the API server. Otherwise the API server reviews the token
    /// (TokenReview) and then the access (SubjectAccessReview with the reviewed user,
    /// groups, UID and extra), and a success is cached until the earlier of now + TTL and
    /// the token's `exp` claim.
    ///
    /// Errors: [`AuthzError::Unauthenticated`] when the token is empty or the API server
    /// does not authenticate it; [`AuthzError::Forbidden`] when the review denies access
    /// (or the namespace or name is empty, which would widen the question beyond one Run);
    /// [`AuthzError::Unavailable`] when a review request fails, times out or is answered
    /// without a usable status. None of these is cached.
    pub async fn authorize(
        &self,
        token: &str,
        namespace: &str,
        run_name: &str,
        run_uid: &str,
    ) -> Result<Principal, AuthzError> {
        if token.is_empty() {
            return Err(AuthzError::Unauthenticated);
        }
        if namespace.is_empty() || run_name.is_empty() {
            return Err(AuthzError::Forbidden {
                reason: "a Run is addressed by a namespace and a name".to_string(),
            });
        }
        let key = CacheKey::new(token, namespace, run_name, run_uid);
        let caching = self.config.cache_enabled();
        let lookup = |cache: &mut Generational, now| {
            if caching {
                cache.entries.get(&key, now)
            } else {
                None
            }
        };
        let mut leading = match self.resolve(&key, lookup).await {
            Resolved::Hit(principal) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(token_sha256 = %key.digest_prefix(), namespace, run = run_name, "authorization cache hit");
                return Ok(principal);
            }
            Resolved::Joined(outcome) => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(token_sha256 = %key.digest_prefix(), namespace, run = run_name, "joined an authorization in flight");
                return outcome;
            }
            Resolved::Lead(leading) => leading,
        };
        self.misses.fetch_add(1, Ordering::Relaxed);
        let generation = leading.generation;
        let started = Instant::now();
        // The answers are valid as of when we asked, so the cache lifetime counts from here.
        let wall_started = SystemTime::now();
        let outcome = async {
            let _slot = self.review_slot(token).await?;
            let principal = self.review_token(token, &key).await?;
            self.review_access(token, &key, &principal).await?;
            Ok(principal)
        }
        .await;

        if caching
            && let Ok(principal) = &outcome
            && let Some(deadline) =
                cache_deadline(started, wall_started, self.config.ttl, token_expiry(token))
        {
            let mut cache = self.lock_cache();
            // Invalidated while we asked: the answer may predate a revocation.
            if cache.generation == generation {
                cache
                    .entries
                    .insert(key.clone(), principal.clone(), deadline);
            } else {
                tracing::debug!(token_sha256 = %key.digest_prefix(), namespace, run = run_name, "authorization cache invalidated during the review; not cached");
            }
        }
        leading.publish(&outcome);
        outcome
    }

    /// Whether the API server authenticates `token` at all, and who holds it: the check a
    /// server makes before it spends anything on a request (an admission permit, reading a
    /// body, looking a Run up).
    ///
    /// A TokenReview, whose success is cached like [`Authorizer::authorize`]'s (same TTL,
    /// capacity and token expiry bound, keyed by the token's SHA-256 alone, in a cache of
    /// its own that the hit and miss counters do not count). It decides nothing about any
    /// Run: callers still [`Authorizer::authorize`] the Run they serve.
    ///
    /// Errors: [`AuthzError::Unauthenticated`] for an empty or refused token;
    /// [`AuthzError::Unavailable`] when the review fails. Neither is cached.
    pub async fn authenticate(&self, token: &str) -> Result<Principal, AuthzError> {
        if token.is_empty() {
            return Err(AuthzError::Unauthenticated);
        }
        let key = CacheKey::new(token, "", "", "");
        let caching = self.config.cache_enabled();
        let lookup = |cache: &mut Generational, now| {
            if caching {
                cache.authenticated.get(&key.token_digest, now)
            } else {
                None
            }
        };
        let mut leading = match self.resolve(&key, lookup).await {
            Resolved::Hit(principal) => return Ok(principal),
            Resolved::Joined(outcome) => return outcome,
            Resolved::Lead(leading) => leading,
        };
        let generation = leading.generation;
        let started = Instant::now();
        let wall_started = SystemTime::now();
        let outcome = async {
            let _slot = self.review_slot(token).await?;
            self.review_token(token, &key).await
        }
        .await;
        if caching
            && let Ok(principal) = &outcome
            && let Some(deadline) =
                cache_deadline(started, wall_started, self.config.ttl, token_expiry(token))
        {
            let mut cache = self.lock_cache();
            // Invalidated while we asked: the answer may predate a revocation.
            if cache.generation == generation {
                cache
                    .authenticated
                    .insert(key.token_digest, principal.clone(), deadline);
            }
        }
        leading.publish(&outcome);
        outcome
    }

    /// Answers a request for `key` from the cache (`lookup`), from a review of the current
    /// generation already in flight, or makes it the leader of a new review.
    async fn resolve<'a>(
        &'a self,
        key: &'a CacheKey,
        lookup: impl Fn(&mut Generational, Instant) -> Option<Principal>,
    ) -> Resolved<'a> {
        loop {
            let mut joined = {
                let mut cache = self.lock_cache();
                if let Some(principal) = lookup(&mut cache, Instant::now()) {
                    return Resolved::Hit(principal);
                }
                let generation = cache.generation;
                match cache.flights.get(key) {
                    Some(flight) if flight.generation == generation => {
                        self.coalesced.fetch_add(1, Ordering::Relaxed);
                        flight.outcome.clone()
                    }
                    // None, or one begun before a flush: its answer may predate it.
                    _ => {
                        cache.next_flight += 1;
                        let id = cache.next_flight;
                        let (outcome, receiver) = watch::channel(None);
                        cache.flights.insert(
                            key.clone(),
                            Flight {
                                id,
                                generation,
                                outcome: receiver,
                            },
                        );
                        return Resolved::Lead(Leading {
                            authorizer: self,
                            key,
                            id,
                            generation,
                            outcome,
                        });
                    }
                }
            };
            if let Ok(outcome) = joined.wait_for(Option::is_some).await
                && let Some(outcome) = outcome.as_ref()
            {
                return Resolved::Joined(outcome.clone());
            }
            // Its leader went away without an answer (its request was dropped): the flight
            // is gone, ask again.
        }
    }

    /// A slot among the reviews asking the API server at once, waited for within the
    /// request timeout.
    async fn review_slot(&self, token: &str) -> Result<Option<SemaphorePermit<'_>>, AuthzError> {
        let Some(slots) = &self.review_slots else {
            return Ok(None);
        };
        let full = || {
            let detail = format!(
                "{} reviews are in flight already and none ended within {:?}",
                self.config.max_reviews_in_flight, self.config.request_timeout
            );
            unavailable(ReviewKind::TokenReview, &detail, token)
        };
        let acquire = slots.acquire();
        let permit = if self.config.request_timeout.is_zero() {
            acquire.await
        } else {
            tokio::time::timeout(self.config.request_timeout, acquire)
                .await
                .map_err(|_| full())?
        };
        // The semaphore is never closed.
        permit.map(Some).map_err(|_| full())
    }

    /// TokenReview: who holds `token`?
    async fn review_token(&self, token: &str, key: &CacheKey) -> Result<Principal, AuthzError> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: None,
            },
            ..TokenReview::default()
        };
        let answer = self
            .call(
                ReviewKind::TokenReview,
                token,
                self.token_reviews.create(&PostParams::default(), &review),
            )
            .await?;
        drop(review);
        let status = answer.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            let why = bounded(status.error.as_deref().unwrap_or(""), token);
            tracing::debug!(token_sha256 = %key.digest_prefix(), reason = %why, "token not authenticated");
            return Err(AuthzError::Unauthenticated);
        }
        let user = status.user.unwrap_or_default();
        let username = user.username.unwrap_or_default();
        if username.is_empty() {
            return Err(unavailable(
                ReviewKind::TokenReview,
                "the token was authenticated without a username",
                token,
            ));
        }
        Ok(Principal {
            username,
            uid: user.uid.filter(|uid| !uid.is_empty()),
            groups: user.groups.unwrap_or_default(),
            extra: user.extra.unwrap_or_default(),
        })
    }

    /// SubjectAccessReview: may `principal` get this Run?
    async fn review_access(
        &self,
        token: &str,
        key: &CacheKey,
        principal: &Principal,
    ) -> Result<(), AuthzError> {
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(principal.username.clone()),
                uid: principal.uid.clone(),
                groups: Some(principal.groups.clone()),
                extra: (!principal.extra.is_empty()).then(|| principal.extra.clone()),
                resource_attributes: Some(ResourceAttributes {
                    verb: Some(RUN_VERB.to_string()),
                    group: Some(RUN_GROUP.to_string()),
                    resource: Some(RUN_RESOURCE.to_string()),
                    namespace: Some(key.namespace.clone()),
                    name: Some(key.name.clone()),
                    ..ResourceAttributes::default()
                }),
                non_resource_attributes: None,
            },
            ..SubjectAccessReview::default()
        };
        let answer = self
            .call(
                ReviewKind::SubjectAccessReview,
                token,
                self.access_reviews.create(&PostParams::default(), &review),
            )
            .await?;
        let Some(status) = answer.status else {
            return Err(unavailable(
                ReviewKind::SubjectAccessReview,
                "the answer has no status",
                token,
            ));
        };
        if status.allowed && status.denied != Some(true) {
            return Ok(());
        }
        let reason = forbidden_reason(principal, key, &status, token);
        tracing::debug!(token_sha256 = %key.digest_prefix(), reason = %reason, "access denied");
        Err(AuthzError::Forbidden { reason })
    }

    /// Runs one review request under the configured timeout.
    async fn call<T>(
        &self,
        review: ReviewKind,
        token: &str,
        request: impl Future<Output = kube::Result<T>>,
    ) -> Result<T, AuthzError> {
        let outcome = if self.config.request_timeout.is_zero() {
            request.await
        } else {
            match tokio::time::timeout(self.config.request_timeout, request).await {
                Ok(outcome) => outcome,
                Err(_) => {
                    let detail = format!("no answer within {:?}", self.config.request_timeout);
                    return Err(unavailable(review, &detail, token));
                }
            }
        };
        outcome.map_err(|error| {
            let error = unavailable(review, &describe(&error), token);
            tracing::debug!(error = %crate::error_chain(&error), "review request failed");
            error
        })
    }

    fn lock_cache(&self) -> MutexGuard<'_, Generational> {
        // The cache holds no invariant a panicking holder could break half-way that a later
        // reader would trip over (every method leaves the maps consistent before returning).
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn unavailable(review: ReviewKind, detail: &str, token: &str) -> AuthzError {
    AuthzError::Unavailable(ReviewError {
        review,
        detail: bounded(detail, token),
    })
}

/// A one-line description of a client error, without the `Debug` dump kube adds to API errors.
fn describe(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(status) => {
            format!("{} {}: {}", status.code, status.reason, status.message)
        }
        other => crate::error_chain(other),
    }
}

/// A Kubernetes-style 403 message, with the review's reason when it gave one.
fn forbidden_reason(
    principal: &Principal,
    key: &CacheKey,
    status: &SubjectAccessReviewStatus,
    token: &str,
) -> String {
    let mut reason = format!(
        "{RUN_RESOURCE}.{RUN_GROUP} {:?} is forbidden: User {:?} cannot {RUN_VERB} resource {RUN_RESOURCE:?} in API group {RUN_GROUP:?} in the namespace {:?}",
        key.name, principal.username, key.namespace
    );
    let why = status
        .reason
        .as_deref()
        .filter(|r| !r.is_empty())
        .or(status.evaluation_error.as_deref().filter(|e| !e.is_empty()));
    if let Some(why) = why {
        reason.push_str(": ");
        reason.push_str(why);
    }
    bounded(&reason, token)
}

/// `message` with `token` scrubbed out, cut to at most [`MAX_MESSAGE_BYTES`] on a character
/// boundary.
fn bounded(message: &str, token: &str) -> String {
    const ELLIPSIS: &str = "…";
    let scrubbed = if token.is_empty() {
        message.to_string()
    } else {
        message.replace(token, "[token]")
    };
    if scrubbed.len() <= MAX_MESSAGE_BYTES {
        return scrubbed;
    }
    let mut end = MAX_MESSAGE_BYTES - ELLIPSIS.len();
    while !scrubbed.is_char_boundary(end) {
        end -= 1;
    }
    let mut cut = scrubbed[..end].to_string();
    cut.push_str(ELLIPSIS);
    cut
}

// ---------------------------------------------------------------------------------------
// Cache keys, token expiry and cache deadlines
// ---------------------------------------------------------------------------------------

/// Identifies one cached success: SHA-256 of the token, and the Run's namespace, name and UID.
///
/// It never holds the token itself; its `Debug` form shows only a digest prefix.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct CacheKey {
    token_digest: [u8; 32],
    namespace: String,
    name: String,
    uid: String,
}

impl CacheKey {
    pub fn new(token: &str, namespace: &str, name: &str, uid: &str) -> CacheKey {
        CacheKey {
            token_digest: Sha256::digest(token.as_bytes()).into(),
            namespace: namespace.to_string(),
            name: name.to_string(),
            uid: uid.to_string(),
        }
    }

    /// The first hex digits of the token's SHA-256, enough to correlate log lines.
    pub fn digest_prefix(&self) -> String {
        hex::encode(&self.token_digest[..DIGEST_PREFIX_BYTES])
    }
}

impl fmt::Debug for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CacheKey")
            .field("token_sha256", &format_args!("{}…", self.digest_prefix()))
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .field("uid", &self.uid)
            .finish()
    }
}

/// The `exp` claim of a JWT-shaped token (`header.payload.signature`, base64url), unverified.
///
/// `None` when the token is not shaped like a JWT or its payload has no numeric `exp`; such
/// a token is cached for the TTL only. The signature is not checked: the value can only
/// make caching shorter, and the API server remains the authority on the token.
pub fn token_expiry(token: &str) -> Option<SystemTime> {
    let mut parts = token.split('.');
    let (_header, payload, _signature) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || payload.is_empty() || payload.len() > MAX_JWT_PAYLOAD_BYTES {
        return None;
    }
    let bytes = BASE64URL.decode(payload).ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let exp = claims.get("exp")?.as_f64()?;
    if !exp.is_finite() {
        return None;
    }
    if exp <= 0.0 {
        return Some(UNIX_EPOCH);
    }
    // An expiry too far away to represent is no expiry at all.
    UNIX_EPOCH.checked_add(Duration::try_from_secs_f64(exp).ok()?)
}

/// Until when a success reviewed at `now` (wall clock `wall_now`) may be served from the
/// cache: the earlier of `now + ttl` and the token's expiry. `None` means "do not cache":
/// the TTL is zero, or the token has already expired by our clock.
pub fn cache_deadline(
    now: Instant,
    wall_now: SystemTime,
    ttl: Duration,
    token_expiry: Option<SystemTime>,
) -> Option<Instant> {
    if ttl.is_zero() {
        return None;
    }
    let mut lifetime = ttl.min(MAX_CACHE_LIFETIME);
    if let Some(expiry) = token_expiry {
        let left = expiry.duration_since(wall_now).ok()?;
        if left.is_zero() {
            return None;
        }
        lifetime = lifetime.min(left);
    }
    now.checked_add(lifetime)
}

// ---------------------------------------------------------------------------------------
// The cache
// ---------------------------------------------------------------------------------------

/// A bounded map whose entries expire at a given instant, least recently used evicted first.
///
/// A pure data structure: it never reads a clock. Callers pass `now` to [`AuthCache::get`]
/// and the expiry instant to [`AuthCache::insert`]. An entry is returned only while
/// `now < expires_at`; an expired entry is removed when it is looked up, or evicted as the
/// least recently used. Capacity 0 holds nothing.
#[derive(Debug)]
pub struct AuthCache<K, V> {
    capacity: usize,
    entries: HashMap<K, Slot<V>>,
    /// Use order: the smallest tick is the least recently used key.
    recency: BTreeMap<u64, K>,
    tick: u64,
}

#[derive(Debug)]
struct Slot<V> {
    value: V,
    expires_at: Instant,
    tick: u64,
}

impl<K: Clone + Eq + Hash, V: Clone> AuthCache<K, V> {
    pub fn new(capacity: usize) -> AuthCache<K, V> {
        AuthCache {
            capacity,
            entries: HashMap::new(),
            recency: BTreeMap::new(),
            tick: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Entries held, expired ones not yet removed included. Never more than the capacity.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The value for `key` if it has not expired at `now`; marks it most recently used.
    pub fn get(&mut self, key: &K, now: Instant) -> Option<V> {
        let slot = self.entries.get_mut(key)?;
        self.recency.remove(&slot.tick);
        if now >= slot.expires_at {
            self.entries.remove(key);
            return None;
        }
        self.tick += 1;
        slot.tick = self.tick;
        self.recency.insert(self.tick, key.clone());
        Some(slot.value.clone())
    }

    /// Stores `value` under `key` until `expires_at`, replacing any previous entry, and
    /// evicts the least recently used entries beyond the capacity.
    pub fn insert(&mut self, key: K, value: V, expires_at: Instant) {
        if self.capacity == 0 {
            return;
        }
        self.tick += 1;
        let slot = Slot {
            value,
            expires_at,
            tick: self.tick,
        };
        if let Some(old) = self.entries.insert(key.clone(), slot) {
            self.recency.remove(&old.tick);
        }
        self.recency.insert(self.tick, key);
        while self.entries.len() > self.capacity {
            let Some((_, oldest)) = self.recency.pop_first() else {
                break;
            };
            self.entries.remove(&oldest);
        }
    }

    /// Removes every entry.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.recency.clear();
    }

    /// Removes `key`, returning its value whether or not it had expired.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let slot = self.entries.remove(key)?;
        self.recency.remove(&slot.tick);
        Some(slot.value)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::HashSet;
    use std::io::Write;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize};

    use http_body_util::BodyExt;
    use serde_json::{Value, json};
    use tokio::sync::oneshot;

    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    fn key(i: usize) -> CacheKey {
        CacheKey::new(&format!("token-{i}"), "team-a", "run-1", "uid-1")
    }

    fn jwt(claims: &Value) -> String {
        let engine = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        format!(
            "{}.{}.{}",
            engine.encode(br#"{"alg":"RS256","kid":"k"}"#),
            engine.encode(serde_json::to_vec(claims).unwrap()),
            engine.encode(b"not-a-real-signature")
        )
    }

    fn unix(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    // -- AuthCache -------------------------------------------------------------------

    #[test]
    fn cache_hits_within_the_ttl_and_never_from_its_end_on() {
        let t0 = Instant::now();
        let mut cache = AuthCache::new(8);
        let deadline = cache_deadline(t0, unix(1_000), DEFAULT_TTL, None).unwrap();
        assert_eq!(deadline, t0 + DEFAULT_TTL);
        cache.insert(key(1), "alice", deadline);
        assert_eq!(cache.get(&key(1), t0), Some("alice"));
        assert_eq!(cache.get(&key(1), t0 + 29 * SECOND), Some("alice"));
        assert_eq!(
            cache.get(&key(1), t0 + DEFAULT_TTL - Duration::from_nanos(1)),
            Some("alice")
        );
        assert_eq!(cache.get(&key(1), t0 + DEFAULT_TTL), None);
        assert!(cache.is_empty(), "an expired entry is removed on lookup");
        // Once expired it stays gone, even when asked with an earlier instant.
        assert_eq!(cache.get(&key(1), t0), None);
        // Other keys (another token, namespace, name or UID) never hit.
        cache.insert(key(1), "alice", deadline);
        assert_eq!(cache.get(&key(2), t0), None);
        for other in [
            CacheKey::new("token-1", "team-b", "run-1", "uid-1"),
            CacheKey::new("token-1", "team-a", "run-2", "uid-1"),
            CacheKey::new("token-1", "team-a", "run-1", "uid-2"),
        ] {
            assert_eq!(cache.get(&other, t0), None, "{other:?}");
        }
    }

    #[test]
    fn a_cached_success_never_outlives_the_token_expiry() {
        let t0 = Instant::now();
        let wall = unix(1_700_000_000);
        // The token expires in 10 s, before the 30 s TTL.
        let deadline = cache_deadline(t0, wall, DEFAULT_TTL, Some(wall + 10 * SECOND)).unwrap();
        assert_eq!(deadline, t0 + 10 * SECOND);
        let mut cache = AuthCache::new(8);
        cache.insert(key(1), 1, deadline);
        assert_eq!(cache.get(&key(1), t0 + 9 * SECOND), Some(1));
        assert_eq!(cache.get(&key(1), t0 + 10 * SECOND), None);
        // A token expiring after the TTL leaves the TTL in charge.
        let later = cache_deadline(t0, wall, DEFAULT_TTL, Some(wall + 3600 * SECOND)).unwrap();
        assert_eq!(later, t0 + DEFAULT_TTL);
        // Expired (by our clock) or expiring right now: not cached at all.
        assert_eq!(cache_deadline(t0, wall, DEFAULT_TTL, Some(wall)), None);
        assert_eq!(
            cache_deadline(t0, wall, DEFAULT_TTL, Some(wall - SECOND)),
            None
        );
        assert_eq!(
            cache_deadline(t0, wall, DEFAULT_TTL, Some(UNIX_EPOCH)),
            None
        );
    }

    #[test]
    fn ttl_zero_and_capacity_zero_disable_the_cache() {
        let t0 = Instant::now();
        assert_eq!(cache_deadline(t0, unix(5), Duration::ZERO, None), None);
        assert_eq!(
            cache_deadline(t0, unix(5), Duration::ZERO, Some(unix(500))),
            None
        );
        let mut cache = AuthCache::new(0);
        cache.insert(key(1), 1, t0 + DEFAULT_TTL);
        assert!(cache.is_empty());
        assert_eq!(cache.get(&key(1), t0), None);

        let base = AuthorizerConfig::default();
        assert!(base.cache_enabled());
        let no_ttl = AuthorizerConfig {
            ttl: Duration::ZERO,
            ..base.clone()
        };
        let no_room = AuthorizerConfig {
            capacity: 0,
            ..base
        };
        assert!(!no_ttl.cache_enabled());
        assert!(!no_room.cache_enabled());
    }

    #[test]
    fn the_capacity_bound_holds_under_10000_distinct_tokens() {
        let t0 = Instant::now();
        let mut cache = AuthCache::new(DEFAULT_CAPACITY);
        for i in 0..10_000 {
            cache.insert(key(i), i, t0 + DEFAULT_TTL);
            assert!(
                cache.len() <= DEFAULT_CAPACITY,
                "{} entries after {i}",
                cache.len()
            );
            assert_eq!(cache.recency.len(), cache.len());
        }
        assert_eq!(cache.len(), DEFAULT_CAPACITY);
        // The most recent `capacity` survive; everything older was evicted.
        for i in 0..10_000 - DEFAULT_CAPACITY {
            assert_eq!(cache.get(&key(i), t0), None, "{i} should be evicted");
        }
        for i in 10_000 - DEFAULT_CAPACITY..10_000 {
            assert_eq!(cache.get(&key(i), t0), Some(i));
        }
    }

    #[test]
    fn eviction_takes_the_least_recently_used_entry() {
        let t0 = Instant::now();
        let mut cache = AuthCache::new(2);
        cache.insert(key(1), 1, t0 + DEFAULT_TTL);
        cache.insert(key(2), 2, t0 + DEFAULT_TTL);
        assert_eq!(cache.get(&key(1), t0), Some(1)); // 2 is now the least recently used
        cache.insert(key(3), 3, t0 + DEFAULT_TTL);
        assert_eq!(cache.get(&key(2), t0), None);
        assert_eq!(cache.get(&key(1), t0), Some(1));
        assert_eq!(cache.get(&key(3), t0), Some(3));
        // Replacing a key neither grows the cache nor evicts another entry.
        cache.insert(key(3), 33, t0 + 5 * SECOND);
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.get(&key(1), t0), Some(1));
        assert_eq!(
            cache.get(&key(3), t0 + 5 * SECOND),
            None,
            "the new deadline applies"
        );
        assert_eq!(cache.remove(&key(1)), Some(1));
        assert!(cache.is_empty());
        assert!(cache.recency.is_empty());
    }

    // -- token expiry ------------------------------------------------------------------

    #[test]
    fn token_expiry_reads_a_numeric_exp_claim_only() {
        assert_eq!(
            token_expiry(&jwt(&json!({"sub": "x", "exp": 1_700_000_000}))),
            Some(unix(1_700_000_000))
        );
        assert_eq!(
            token_expiry(&jwt(&json!({"exp": 1_700_000_000.5}))),
            Some(UNIX_EPOCH + Duration::from_millis(1_700_000_000_500))
        );
        assert_eq!(token_expiry(&jwt(&json!({"exp": -5}))), Some(UNIX_EPOCH));
        // Padded base64url payloads are accepted too.
        let padded = format!(
            "h.{}.s",
            base64::engine::general_purpose::URL_SAFE.encode(br#"{"exp":12}"#)
        );
        assert!(padded.contains('='));
        assert_eq!(token_expiry(&padded), Some(unix(12)));
        for no_expiry in [
            jwt(&json!({"sub": "x"})),
            jwt(&json!({"exp": "1700000000"})),
            jwt(&json!({"exp": null})),
            jwt(&json!([1, 2])),
            jwt(&json!({"exp": 1e300})),
            "opaque-random-token".to_string(),
            "a.b".to_string(),
            "a.b.c.d".to_string(),
            "h..s".to_string(),
            "h.!!!.s".to_string(),
            format!("h.{}.s", "A".repeat(MAX_JWT_PAYLOAD_BYTES + 4)),
            String::new(),
        ] {
            assert_eq!(token_expiry(&no_expiry), None, "{no_expiry:.40}");
        }
    }

    // -- messages and keys -----------------------------------------------------------

    #[test]
    fn messages_are_bounded_and_never_carry_the_token() {
        let token = "secret-token-value";
        assert_eq!(
            bounded("bad token secret-token-value", token),
            "bad token [token]"
        );
        let long = format!("{token} {}", "é".repeat(2 * MAX_MESSAGE_BYTES));
        let cut = bounded(&long, token);
        assert!(cut.len() <= MAX_MESSAGE_BYTES, "{}", cut.len());
        assert!(cut.ends_with('…'));
        assert!(!cut.contains(token));
        assert_eq!(bounded("short", ""), "short");
    }

    #[test]
    fn cache_keys_hold_and_show_only_a_digest() {
        let token = "secret-token-value";
        let key = CacheKey::new(token, "ns", "run", "uid");
        let shown = format!("{key:?}");
        assert!(!shown.contains(token), "{shown}");
        assert!(shown.contains(&key.digest_prefix()));
        assert_eq!(key.digest_prefix().len(), 2 * DIGEST_PREFIX_BYTES);
        assert_eq!(
            key.token_digest,
            <[u8; 32]>::from(Sha256::digest(token.as_bytes()))
        );
    }

    // -- the authorizer against a fake API server ---------------------------------------
    //
    // A fake is used here only for what the real server cannot be made to do on demand:
    // answer 500, fail at the transport between two calls, and show exactly what the
    // authorizer sent. Allowed, denied, unknown-token and caching behaviour against the
    // real server are in tests/authorizer.rs.

    /// A scripted API server that answers TokenReview and SubjectAccessReview.
    #[derive(Default)]
    struct FakeApi {
        /// token -> username
        users: HashMap<String, String>,
        /// (username, namespace, name) allowed to get
        allowed: HashSet<(String, String, String)>,
        /// Fail every request at the transport.
        broken: AtomicBool,
        /// Answer every request with a 500 Status.
        failing: AtomicBool,
        token_reviews: AtomicUsize,
        access_reviews: AtomicUsize,
        last_access_review: Mutex<Option<Value>>,
        /// When set, the next TokenReview reports its arrival on the first channel and is
        /// answered only once the second one fires: a seam that holds a review in flight.
        held: Mutex<Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>>,
        /// When set, every TokenReview waits for a permit of this semaphore (which the
        /// test adds one at a time): a seam that holds reviews in flight, counted below.
        gate: Mutex<Option<Arc<tokio::sync::Semaphore>>>,
        /// TokenReviews that reached the gate, are waiting at it now, and at most at once.
        arrived: AtomicUsize,
        at_gate: AtomicUsize,
        peak: AtomicUsize,
    }

    /// Counts a TokenReview waiting at the fake's gate for as long as it waits.
    struct AtGate<'a>(&'a FakeApi);

    impl<'a> AtGate<'a> {
        fn enter(fake: &'a FakeApi) -> AtGate<'a> {
            fake.arrived.fetch_add(1, Ordering::SeqCst);
            let now = fake.at_gate.fetch_add(1, Ordering::SeqCst) + 1;
            fake.peak.fetch_max(now, Ordering::SeqCst);
            AtGate(fake)
        }
    }

    impl Drop for AtGate<'_> {
        fn drop(&mut self) {
            self.0.at_gate.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl FakeApi {
        fn answer(&self, path: &str, body: &Value) -> (u16, Value) {
            if self.failing.load(Ordering::SeqCst) {
                return (
                    500,
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 500,
                        "reason": "InternalError", "message": "storage is on fire"}),
                );
            }
            let mut answer = body.clone();
            match path {
                "/apis/authentication.k8s.io/v1/tokenreviews" => {
                    self.token_reviews.fetch_add(1, Ordering::SeqCst);
                    let token = body["spec"]["token"].as_str().unwrap_or_default();
                    answer["status"] = match self.users.get(token) {
                        Some(user) => json!({"authenticated": true, "user": {
                            "username": user, "uid": format!("uid-of-{user}"),
                            "groups": ["system:authenticated", "team"],
                            "extra": {"k": ["v"]}}}),
                        None => {
                            json!({"authenticated": false, "error": format!("unknown token {token}")})
                        }
                    };
                }
                "/apis/authorization.k8s.io/v1/subjectaccessreviews" => {
                    self.access_reviews.fetch_add(1, Ordering::SeqCst);
                    *self.last_access_review.lock().unwrap() = Some(body.clone());
                    let spec = &body["spec"];
                    let attrs = &spec["resourceAttributes"];
                    let asked = (
                        spec["user"].as_str().unwrap_or_default().to_string(),
                        attrs["namespace"].as_str().unwrap_or_default().to_string(),
                        attrs["name"].as_str().unwrap_or_default().to_string(),
                    );
                    let allowed = attrs["verb"] == "get"
                        && attrs["group"] == RUN_GROUP
                        && attrs["resource"] == RUN_RESOURCE
                        && self.allowed.contains(&asked);
                    answer["status"] = if allowed {
                        json!({"allowed": true, "reason": "allowed by the fake"})
                    } else {
                        json!({"allowed": false})
                    };
                }
                other => panic!("unexpected request to {other}"),
            }
            (201, answer)
        }
    }

    fn fake_client(fake: Arc<FakeApi>) -> kube::Client {
        let service = tower::service_fn(move |request: hyper::Request<kube::client::Body>| {
            let fake = fake.clone();
            async move {
                if fake.broken.load(Ordering::SeqCst) {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::ConnectionRefused,
                        "connection refused",
                    ));
                }
                let path = request.uri().path().to_string();
                let hold = if path.ends_with("/tokenreviews") {
                    fake.held.lock().unwrap().take()
                } else {
                    None
                };
                if let Some((arrived, release)) = hold {
                    let _ = arrived.send(());
                    let _ = release.await;
                }
                let gate = if path.ends_with("/tokenreviews") {
                    fake.gate.lock().unwrap().clone()
                } else {
                    None
                };
                if let Some(gate) = gate {
                    let _waiting = AtGate::enter(&fake);
                    gate.acquire().await.unwrap().forget();
                }
                let bytes = request.into_body().collect().await.unwrap().to_bytes();
                let body: Value = serde_json::from_slice(&bytes).unwrap();
                let (code, answer) = fake.answer(&path, &body);
                let response = hyper::Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(kube::client::Body::from(
                        serde_json::to_vec(&answer).unwrap(),
                    ))
                    .unwrap();
                Ok::<_, std::io::Error>(response)
            }
        });
        kube::Client::new(service, "default")
    }

    fn fake_with(tokens: &[(&str, &str)], allowed: &[(&str, &str, &str)]) -> Arc<FakeApi> {
        Arc::new(FakeApi {
            users: tokens
                .iter()
                .map(|(t, u)| (t.to_string(), u.to_string()))
                .collect(),
            allowed: allowed
                .iter()
                .map(|(u, n, r)| (u.to_string(), n.to_string(), r.to_string()))
                .collect(),
            ..FakeApi::default()
        })
    }

    /// Collects every log line of the current thread (tests run on a current-thread runtime).
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn install(&self) -> tracing::subscriber::DefaultGuard {
            let sink = self.clone();
            let subscriber = tracing_subscriber::fmt()
                .with_max_level(tracing::Level::TRACE)
                .with_writer(move || sink.clone())
                .finish();
            tracing::subscriber::set_default(subscriber)
        }

        fn text(&self) -> String {
            String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
        }
    }

    #[tokio::test]
    async fn successes_are_cached_and_reviewed_with_the_token_user() {
        let logs = Captured::default();
        let _guard = logs.install();
        let token = jwt(&json!({"sub": "agent", "exp": 4_000_000_000u64}));
        let fake = fake_with(&[(&token, "agent")], &[("agent", "team-a", "run-1")]);
        let authz = Authorizer::new(fake_client(fake.clone()), AuthorizerConfig::default());

        let principal = authz
            .authorize(&token, "team-a", "run-1", "uid-1")
            .await
            .unwrap();
        assert_eq!(principal.username, "agent");
        assert_eq!(principal.uid.as_deref(), Some("uid-of-agent"));
        assert_eq!(principal.groups, ["system:authenticated", "team"]);
        let review = fake.last_access_review.lock().unwrap().clone().unwrap();
        assert_eq!(
            review["spec"],
            json!({
                "user": "agent", "uid": "uid-of-agent",
                "groups": ["system:authenticated", "team"], "extra": {"k": ["v"]},
                "resourceAttributes": {"verb": "get", "group": "kruntimes.io", "resource": "runs",
                    "namespace": "team-a", "name": "run-1"}
            })
        );
        assert_eq!(
            authz.stats(),
            AuthzStats {
                hits: 0,
                misses: 1,
                coalesced: 0,
                entries: 1
            }
        );

        let again = authz
            .authorize(&token, "team-a", "run-1", "uid-1")
            .await
            .unwrap();
        assert_eq!(again, principal);
        assert_eq!(authz.stats().hits, 1);
        assert_eq!(fake.token_reviews.load(Ordering::SeqCst), 1);

        // A recreated Run (same name, new UID) is reviewed again.
        authz
            .authorize(&token, "team-a", "run-1", "uid-2")
            .await
            .unwrap();
        assert_eq!(authz.stats().misses, 2);
        assert!(
            !logs.text().contains(&token),
            "a log line carries the token"
        );
    }

    #[tokio::test]
    async fn denials_unknown_tokens_and_errors_are_never_cached() {
        let logs = Captured::default();
        let _guard = logs.install();
        let token = "opaque-agent-token-0123456789";
        let unknown = "opaque-unknown-token-9876543210";
        let fake = fake_with(&[(token, "agent")], &[("agent", "team-a", "run-1")]);
        let authz = Authorizer::new(fake_client(fake.clone()), AuthorizerConfig::default());

        for round in 1..=2 {
            match authz.authorize(token, "team-b", "run-1", "uid-1").await {
                Err(AuthzError::Forbidden { reason }) => {
                    assert!(reason.contains("\"team-b\""), "{reason}");
                    assert!(reason.contains("User \"agent\" cannot get"), "{reason}");
                }
                other => panic!("expected Forbidden, got {other:?}"),
            }
            assert_eq!(authz.stats().misses, 2 * round - 1);
            let err = authz
                .authorize(unknown, "team-a", "run-1", "uid-1")
                .await
                .unwrap_err();
            assert!(matches!(err, AuthzError::Unauthenticated), "{err:?}");
            assert_eq!(err.http_status(), 401);
            assert_eq!(authz.stats().misses, 2 * round);
        }
        assert_eq!(authz.stats().entries, 0);
        assert_eq!(fake.access_reviews.load(Ordering::SeqCst), 2);
        assert_eq!(fake.token_reviews.load(Ordering::SeqCst), 4);

        // Transport failures and API errors are Unavailable, and are not cached either.
        fake.broken.store(true, Ordering::SeqCst);
        let err = authz
            .authorize(token, "team-a", "run-1", "uid-1")
            .await
            .unwrap_err();
        assert!(matches!(err, AuthzError::Unavailable(_)), "{err:?}");
        assert_eq!(err.http_status(), 503);
        fake.broken.store(false, Ordering::SeqCst);
        fake.failing.store(true, Ordering::SeqCst);
        match authz.authorize(token, "team-a", "run-1", "uid-1").await {
            Err(AuthzError::Unavailable(review)) => {
                assert_eq!(review.review, ReviewKind::TokenReview);
                assert_eq!(review.detail, "500 InternalError: storage is on fire");
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
        fake.failing.store(false, Ordering::SeqCst);
        assert_eq!(authz.stats().entries, 0);
        authz
            .authorize(token, "team-a", "run-1", "uid-1")
            .await
            .unwrap();
        assert_eq!(
            authz.stats(),
            AuthzStats {
                hits: 0,
                misses: 7,
                coalesced: 0,
                entries: 1
            }
        );
        let logs = logs.text();
        assert!(
            !logs.contains(token),
            "a log line carries the token:\n{logs}"
        );
        assert!(
            !logs.contains(unknown),
            "a log line carries the token:\n{logs}"
        );
    }

    #[tokio::test]
    async fn expired_tokens_empty_tokens_and_disabled_caches_are_not_cached() {
        let expired = jwt(&json!({"exp": 1_000}));
        let fake = fake_with(&[(&expired, "agent")], &[("agent", "team-a", "run-1")]);
        // The API server still accepts it (a skewed clock), but we never cache it.
        let authz = Authorizer::new(fake_client(fake.clone()), AuthorizerConfig::default());
        for _ in 0..2 {
            authz
                .authorize(&expired, "team-a", "run-1", "uid-1")
                .await
                .unwrap();
        }
        assert_eq!(authz.stats().misses, 2);
        assert_eq!(authz.stats().entries, 0);

        let err = authz
            .authorize("", "team-a", "run-1", "u")
            .await
            .unwrap_err();
        assert!(matches!(err, AuthzError::Unauthenticated));
        let err = authz
            .authorize(&expired, "", "run-1", "u")
            .await
            .unwrap_err();
        assert!(matches!(err, AuthzError::Forbidden { .. }));
        assert_eq!(fake.token_reviews.load(Ordering::SeqCst), 2);

        let token = "opaque-agent-token";
        let fake = fake_with(&[(token, "agent")], &[("agent", "team-a", "run-1")]);
        for config in [
            AuthorizerConfig {
                ttl: Duration::ZERO,
                ..AuthorizerConfig::default()
            },
            AuthorizerConfig {
                capacity: 0,
                ..AuthorizerConfig::default()
            },
        ] {
            let authz = Authorizer::new(fake_client(fake.clone()), config);
            for _ in 0..3 {
                authz
                    .authorize(token, "team-a", "run-1", "uid-1")
                    .await
                    .unwrap();
            }
            assert_eq!(
                authz.stats(),
                AuthzStats {
                    hits: 0,
                    misses: 3,
                    coalesced: 0,
                    entries: 0
                }
            );
        }
    }

    #[tokio::test]
    async fn invalidation_flushes_successes_and_wakes_subscribers() {
        let token = "opaque-agent-token";
        let fake = fake_with(&[(token, "agent")], &[("agent", "team-a", "run-1")]);
        let authz = Authorizer::new(fake_client(fake.clone()), AuthorizerConfig::default());
        let mut invalidations = authz.invalidations();
        authz
            .authorize(token, "team-a", "run-1", "uid-1")
            .await
            .unwrap();
        assert_eq!(authz.stats().entries, 1);
        authz.invalidate("test");
        assert_eq!(authz.stats().entries, 0);
        assert_eq!(authz.generation(), 1);
        assert!(invalidations.has_changed().unwrap());
        assert_eq!(*invalidations.borrow_and_update(), 1);
        authz
            .authorize(token, "team-a", "run-1", "uid-1")
            .await
            .unwrap();
        assert_eq!(authz.stats().misses, 2, "reviewed again after the flush");

        // The authentication cache (admission's) is flushed too.
        authz.authenticate(token).await.unwrap();
        let reviews = fake.token_reviews.load(Ordering::SeqCst);
        authz.authenticate(token).await.unwrap();
        assert_eq!(fake.token_reviews.load(Ordering::SeqCst), reviews, "cached");
        authz.invalidate("test");
        authz.authenticate(token).await.unwrap();
        assert_eq!(
            fake.token_reviews.load(Ordering::SeqCst),
            reviews + 1,
            "authenticated again after the flush"
        );
    }

    /// Regression (issue 14 item 10): a review that started before a revocation and was
    /// answered after the cache was flushed must not be cached, or the revoked caller is
    /// served from the cache for another TTL. The fake holds the TokenReview in flight
    /// (a seam, since the interleaving cannot be caused against a real server on demand)
    /// while the cache is invalidated.
    #[tokio::test]
    async fn a_review_under_way_during_an_invalidation_is_not_cached() {
        let token = "opaque-agent-token";
        let fake = fake_with(&[(token, "agent")], &[("agent", "team-a", "run-1")]);
        let (arrived_tx, arrived) = oneshot::channel();
        let (release, release_rx) = oneshot::channel();
        *fake.held.lock().unwrap() = Some((arrived_tx, release_rx));
        let authz = Arc::new(Authorizer::new(
            fake_client(fake.clone()),
            AuthorizerConfig::default(),
        ));
        let reviewing = tokio::spawn({
            let authz = authz.clone();
            async move { authz.authorize(token, "team-a", "run-1", "uid-1").await }
        });
        arrived.await.unwrap();
        authz.invalidate("a binding changed");
        release.send(()).unwrap();
        let principal = reviewing.await.unwrap().unwrap();
        assert_eq!(principal.username, "agent");
        assert_eq!(authz.stats().entries, 0, "a stale answer was cached");

        // The next review, begun after the flush, is cached as usual.
        authz
            .authorize(token, "team-a", "run-1", "uid-1")
            .await
            .unwrap();
        assert_eq!(authz.stats().entries, 1);
        assert_eq!(fake.token_reviews.load(Ordering::SeqCst), 2);
    }

    /// Yields until `condition` holds (tests run on a current-thread runtime, so the tasks
    /// they spawn run exactly when the test yields), for at most 10 s.
    async fn until(what: &str, condition: impl Fn() -> bool) {
        let waited = tokio::time::timeout(10 * SECOND, async {
            while !condition() {
                tokio::task::yield_now().await;
            }
        })
        .await;
        assert!(waited.is_ok(), "timed out waiting for {what}");
    }

    /// A fake whose TokenReviews wait at a closed gate, and its gate.
    fn gated(
        tokens: &[(&str, &str)],
        allowed: &[(&str, &str, &str)],
    ) -> (Arc<FakeApi>, Arc<tokio::sync::Semaphore>) {
        let fake = fake_with(tokens, allowed);
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        *fake.gate.lock().unwrap() = Some(gate.clone());
        (fake, gate)
    }

    /// Regression (issue 14 item 10): a flush made every open connection re-check at once,
    /// each with its own TokenReview and SubjectAccessReview (1,024 sockets: 2,048 reviews
    /// at the same instant). Concurrent requests for the same key now share one review in
    /// flight. The fake's gate (a seam) holds the review until every request has joined.
    #[tokio::test]
    async fn concurrent_requests_for_one_key_share_one_review() {
        const REQUESTS: usize = 16;
        let token = "opaque-agent-token";
        let (fake, gate) = gated(&[(token, "agent")], &[("agent", "team-a", "run-1")]);
        let authz = Arc::new(Authorizer::new(
            fake_client(fake.clone()),
            AuthorizerConfig::default(),
        ));
        let mut requests = tokio::task::JoinSet::new();
        for _ in 0..REQUESTS {
            let authz = authz.clone();
            requests.spawn(async move { authz.authorize(token, "team-a", "run-1", "uid-1").await });
        }
        until("one review and every other request joined it", || {
            fake.arrived.load(Ordering::SeqCst) == 1
                && authz.stats().coalesced == REQUESTS as u64 - 1
        })
        .await;
        gate.add_permits(1);
        while let Some(answer) = requests.join_next().await {
            assert_eq!(answer.unwrap().unwrap().username, "agent");
        }
        assert_eq!(fake.token_reviews.load(Ordering::SeqCst), 1);
        assert_eq!(fake.access_reviews.load(Ordering::SeqCst), 1);
        let stats = authz.stats();
        assert_eq!(
            (stats.hits, stats.misses, stats.coalesced, stats.entries),
            (0, REQUESTS as u64, REQUESTS as u64 - 1, 1)
        );

        // A denial is shared the same way, and still not cached.
        let mut requests = tokio::task::JoinSet::new();
        for _ in 0..REQUESTS {
            let authz = authz.clone();
            requests.spawn(async move { authz.authorize(token, "team-b", "run-1", "uid-1").await });
        }
        until("the second review and its joiners", || {
            fake.arrived.load(Ordering::SeqCst) == 2
                && authz.stats().coalesced == 2 * (REQUESTS as u64 - 1)
        })
        .await;
        gate.add_permits(1);
        while let Some(answer) = requests.join_next().await {
            assert!(matches!(answer.unwrap(), Err(AuthzError::Forbidden { .. })));
        }
        assert_eq!(fake.token_reviews.load(Ordering::SeqCst), 2);
        assert_eq!(authz.stats().entries, 1);
    }

    /// A request that arrives after a flush must not join a review begun before it: that
    /// answer may predate the revocation. It asks again; only its answer is cached.
    #[tokio::test]
    async fn a_request_after_a_flush_never_joins_a_review_begun_before_it() {
        let token = "opaque-agent-token";
        let (fake, gate) = gated(&[(token, "agent")], &[("agent", "team-a", "run-1")]);
        let authz = Arc::new(Authorizer::new(
            fake_client(fake.clone()),
            AuthorizerConfig::default(),
        ));
        let ask = |authz: Arc<Authorizer>| {
            tokio::spawn(async move { authz.authorize(token, "team-a", "run-1", "uid-1").await })
        };
        let before = ask(authz.clone());
        until("the first review", || {
            fake.arrived.load(Ordering::SeqCst) == 1
        })
        .await;
        authz.invalidate("a binding changed");
        let after = ask(authz.clone());
        until("a second review", || {
            fake.arrived.load(Ordering::SeqCst) == 2
        })
        .await;
        assert_eq!(authz.stats().coalesced, 0);
        gate.add_permits(2);
        before.await.unwrap().unwrap();
        after.await.unwrap().unwrap();
        assert_eq!(fake.token_reviews.load(Ordering::SeqCst), 2);
        assert_eq!(
            authz.stats().entries,
            1,
            "the answer begun after the flush is cached"
        );
    }

    /// A leader that goes away (its request dropped, say the client disconnected) hands
    /// the question to a request that joined it, which asks again and gets an answer.
    #[tokio::test]
    async fn a_joiner_asks_again_when_the_leader_goes_away() {
        let token = "opaque-agent-token";
        let (fake, gate) = gated(&[(token, "agent")], &[("agent", "team-a", "run-1")]);
        let authz = Arc::new(Authorizer::new(
            fake_client(fake.clone()),
            AuthorizerConfig::default(),
        ));
        let ask = |authz: Arc<Authorizer>| {
            tokio::spawn(async move { authz.authorize(token, "team-a", "run-1", "uid-1").await })
        };
        let leader = ask(authz.clone());
        until("the leader's review", || {
            fake.arrived.load(Ordering::SeqCst) == 1
        })
        .await;
        let joiner = ask(authz.clone());
        until("the joiner", || authz.stats().coalesced == 1).await;
        leader.abort();
        assert!(leader.await.unwrap_err().is_cancelled());
        until("the joiner's own review", || {
            fake.arrived.load(Ordering::SeqCst) == 2
        })
        .await;
        gate.add_permits(1);
        assert_eq!(joiner.await.unwrap().unwrap().username, "agent");
        assert_eq!(authz.stats().entries, 1);
        assert!(
            authz.lock_cache().flights.is_empty(),
            "a flight was left behind"
        );
    }

    /// Regression (issue 14 item 10): distinct keys are never coalesced, but at most
    /// `max_reviews_in_flight` of their reviews ask the API server at once; the others
    /// wait for a slot.
    #[tokio::test]
    async fn reviews_in_flight_are_bounded() {
        const REQUESTS: usize = 6;
        let token = "opaque-agent-token";
        let names: Vec<String> = (0..REQUESTS).map(|i| format!("run-{i}")).collect();
        let allowed: Vec<(&str, &str, &str)> = names
            .iter()
            .map(|name| ("agent", "team-a", name.as_str()))
            .collect();
        let (fake, gate) = gated(&[(token, "agent")], &allowed);
        let authz = Arc::new(Authorizer::new(
            fake_client(fake.clone()),
            AuthorizerConfig {
                max_reviews_in_flight: 2,
                ..AuthorizerConfig::default()
            },
        ));
        let mut requests = tokio::task::JoinSet::new();
        for name in &names {
            let (authz, name) = (authz.clone(), name.clone());
            requests.spawn(async move { authz.authorize(token, "team-a", &name, "uid").await });
        }
        until("two reviews", || fake.arrived.load(Ordering::SeqCst) == 2).await;
        // Let every other request run as far as it can: none gets past the bound.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(fake.arrived.load(Ordering::SeqCst), 2);
        for released in 1..=REQUESTS {
            gate.add_permits(1);
            let answer = requests.join_next().await.unwrap();
            answer.unwrap().unwrap();
            until("the next review in", || {
                fake.arrived.load(Ordering::SeqCst) == (released + 2).min(REQUESTS)
            })
            .await;
        }
        assert_eq!(fake.peak.load(Ordering::SeqCst), 2);
        assert_eq!(fake.token_reviews.load(Ordering::SeqCst), REQUESTS);
        assert_eq!(authz.stats().coalesced, 0);
    }
}
