//! Idle expiry of sessions (design document 003, "Idle expiration"; issue 19 item 5).
//!
//! A session Run that has had no mutation (an accepted operation, an operation's end, a
//! file write) for its idle TTL ends `Timeout/IdleTimeout`. The TTL is the
//! controller-manager's [`Config::session_idle_ttl`](crate::Config) (`kruntimes up
//! --session-idle-ttl`, 168h by default); a Run's `spec.mode.session.idleTimeout` may only
//! lower it: a longer one is clamped to the TTL, which keeps a TTL lowered later binding on
//! Runs created before. A TTL of zero disables the sweep, per-Run timeouts included.
//!
//! Guarantees and assumptions:
//! - **Leader-only, bounded.** The sweep runs inside the leader's term (dropped with it),
//!   once per [`Config::idle_sweep_interval`](crate::Config) (a minute by default), and
//!   lists session Runs in pages of [`PAGE`] (`limit`/`continue`), Ready ones only (a
//!   field selector), so a sweep holds at most one page in memory.
//! - **Idle time** counts from the later of `metadata.creationTimestamp` and
//!   `status.session.lastActivityTime`, which the owner runtimed writes at most once per its
//!   activity interval (runtimed's `--session-activity-interval`, a minute by default; a
//!   busy session's running operation counts as activity). So the clock's granularity is
//!   that interval: keep it well under the TTL (`kruntimes up` sets it to a tenth of the TTL
//!   when the TTL is under ten minutes).
//! - **Rechecked under a conditional write.** The end is a status write carrying the
//!   `resourceVersion` the decision was made on; a 409 (the owner recorded activity, or
//!   anything else changed) re-reads the Run and decides again, at most
//!   [`ATTEMPTS`] times per sweep. An operation the owner accepted but has not recorded yet
//!   when the write lands is closed with the session (the owner records the first mutation
//!   after a quiet interval at once, so this window is one API round trip).
//! - **Ordinary cleanup.** Only the phase is written here (`Timeout`, reason
//!   `IdleTimeout`, `Ready=False`, `completionTime`); the owner runtimed sees the terminal
//!   phase and closes the session, as for any other end. Each expiry counts in
//!   `kruntimes_session_expired_total`, is logged at debug level with the idle time, and is
//!   told in a Warning Event on the Run.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kruntimes_api::{Phase, Run};
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::events::EventType;
use kube::{Client, Resource, ResourceExt};
use tracing::{debug, info, warn};

use crate::error::{Error, is_conflict, is_not_found};
use crate::events::Events;
use crate::metrics::Metrics;
use crate::status::{leave_ready, now_rfc3339};

pub use kruntimes_api::lifecycle::IDLE_TIMEOUT_REASON;
/// The default idle TTL: seven days.
pub const DEFAULT_IDLE_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// How often the sweep runs by default.
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(60);
/// Runs listed per page.
pub const PAGE: u32 = 200;
/// Decisions per Run and sweep (the first, and one after each conflict).
pub const ATTEMPTS: usize = 3;
/// The `action` of the expiry Events.
const EXPIRE: &str = "Expire";

/// The idle limit that applies to `run` under the platform `ttl`: its own
/// `spec.mode.session.idleTimeout`, clamped to `ttl`. `None` for a Run that is not a
/// session or when `ttl` is zero (expiry disabled).
pub fn idle_limit(run: &Run, ttl: Duration) -> Option<Duration> {
    if ttl.is_zero() {
        return None;
    }
    let mode = run.spec.mode.session.as_ref()?;
    let own = mode
        .idle_timeout
        .as_deref()
        .and_then(|t| kruntimes_api::duration::parse(t).ok())
        .filter(|t| !t.is_zero());
    Some(own.map_or(ttl, |own| own.min(ttl)))
}

/// When `run`'s idle clock started: the later of its creation and its last recorded
/// mutation.
pub fn idle_since(run: &Run) -> Option<Timestamp> {
    let created = run.meta().creation_timestamp.as_ref().map(|t| t.0);
    let active = run
        .status
        .as_ref()
        .and_then(|s| s.session.as_ref())
        .and_then(|s| s.last_activity_time.as_deref())
        .and_then(|t| t.parse::<Timestamp>().ok());
    match (created, active) {
        (Some(c), Some(a)) => Some(c.max(a)),
        (c, a) => c.or(a),
    }
}

/// How long `run` has been idle at `now`, when it is a Ready session that has been idle
/// for at least its limit under `ttl`: (idle time, limit).
pub fn expired(run: &Run, ttl: Duration, now: Timestamp) -> Option<(Duration, Duration)> {
    if run.metadata.deletion_timestamp.is_some() {
        return None;
    }
    match run.phase() {
        Phase::Ready => {}
        // Only a Ready session idles: one that registers, drains, is suspended (its idle
        // clock restarts when it is resumed) or ended does not.
        Phase::Pending
        | Phase::Scheduled
        | Phase::Running
        | Phase::Finalizing
        | Phase::Suspended
        | Phase::Succeeded
        | Phase::Failed
        | Phase::Timeout
        | Phase::Cancelled => return None,
    }
    let limit = idle_limit(run, ttl)?;
    let since = idle_since(run)?;
    let idle = since.duration_until(now);
    if idle < SignedDuration::ZERO {
        return None;
    }
    let idle = Duration::try_from(idle).ok()?;
    (idle >= limit).then_some((idle, limit))
}

/// What the sweep needs.
pub(crate) struct Settings {
    pub ttl: Duration,
    pub interval: Duration,
    pub metrics: Arc<Metrics>,
}

/// Sweeps every `settings.interval` while the term lasts (cancel it by dropping the
/// future). Never returns when the TTL is zero: the sweep is disabled.
pub(crate) async fn run(client: Client, settings: Settings, events: Events) -> Result<(), Error> {
    if settings.ttl.is_zero() || settings.interval.is_zero() {
        info!("session idle expiry is disabled (--session-idle-ttl 0)");
        return std::future::pending().await;
    }
    let api = Api::<Run>::all(client.clone());
    let mut tick = tokio::time::interval(settings.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match sweep(&api, &client, &settings, &events).await {
            Ok(0) => {}
            Ok(expired) => debug!(expired, "idle sweep done"),
            Err(error) => warn!(error = %error, "idle sweep failed; the next one retries"),
        }
    }
}

/// One sweep over every Ready Run, page by page; the number of sessions it ended.
async fn sweep(
    api: &Api<Run>,
    client: &Client,
    settings: &Settings,
    events: &Events,
) -> Result<usize, Error> {
    let mut params = ListParams::default()
        .fields("status.phase=Ready")
        .limit(PAGE);
    let mut ended = 0;
    loop {
        let page = api.list(&params).await.map_err(|source| Error::List {
            what: "runs",
            namespace: String::new(),
            source,
        })?;
        let now = Timestamp::now();
        for run in &page.items {
            if expired(run, settings.ttl, now).is_none() {
                continue;
            }
            // One Run that cannot be written does not keep the rest from expiring.
            match expire(client, run.clone(), settings, events).await {
                Ok(true) => ended += 1,
                Ok(false) => {}
                Err(error) => {
                    warn!(run = %run.name_any(), error = %error, "expiring an idle session failed; the next sweep retries");
                }
            }
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(ended),
        }
    }
}

/// Ends `run` Timeout/IdleTimeout if it is still idle, deciding again after each conflict;
/// whether it was ended here.
async fn expire(
    client: &Client,
    mut run: Run,
    settings: &Settings,
    events: &Events,
) -> Result<bool, Error> {
    let name = run.name_any();
    let namespace = run.namespace().unwrap_or_default();
    let api = Api::<Run>::namespaced(client.clone(), &namespace);
    for _ in 0..ATTEMPTS {
        let Some((idle, limit)) = expired(&run, settings.ttl, Timestamp::now()) else {
            return Ok(false);
        };
        let own = limit < settings.ttl;
        let message = format!(
            "no operation or file write for {}s; the idle limit is {}s ({})",
            idle.as_secs(),
            limit.as_secs(),
            if own {
                "the Run's spec.mode.session.idleTimeout"
            } else {
                "the platform's session idle TTL, --session-idle-ttl"
            }
        );
        let mut ended = run.clone();
        let generation = ended.meta().generation;
        let status = ended.status.get_or_insert_with(Default::default);
        status.phase = Some(Phase::Timeout);
        status.reason = Some(IDLE_TIMEOUT_REASON.to_string());
        status.message = Some(message.clone());
        status.completion_time = Some(now_rfc3339());
        leave_ready(&run.spec, status, IDLE_TIMEOUT_REASON, &message, generation);
        match api
            .replace_status(&name, &PostParams::default(), &ended)
            .await
        {
            Ok(_) => {
                settings.metrics.session_expired();
                debug!(run = %name, namespace, idle_secs = idle.as_secs(), "expired idle session");
                events.publish(
                    &run,
                    EventType::Warning,
                    IDLE_TIMEOUT_REASON,
                    EXPIRE,
                    &message,
                );
                return Ok(true);
            }
            Err(error) if is_not_found(&error) => return Ok(false),
            Err(error) if is_conflict(&error) => {
                // Changed since the decision (activity recorded, say): read it and decide again.
                match api.get_opt(&name).await {
                    Ok(Some(fresh)) => run = fresh,
                    Ok(None) => return Ok(false),
                    Err(source) => {
                        return Err(Error::WriteRunStatus {
                            namespace,
                            name,
                            source,
                        });
                    }
                }
            }
            Err(source) => {
                return Err(Error::WriteRunStatus {
                    namespace,
                    name,
                    source,
                });
            }
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kruntimes_api::RunSpec;
    use kruntimes_api::run::{RunStatus, SessionMode, SessionStatus};

    use super::*;

    fn session(
        idle_timeout: Option<&str>,
        phase: Phase,
        created: &str,
        active: Option<&str>,
    ) -> Run {
        let mut spec = RunSpec::task("rt", "main.sh");
        spec.mode.task = None;
        spec.mode.session = Some(SessionMode {
            idle_timeout: idle_timeout.map(str::to_string),
            ..SessionMode::default()
        });
        let mut run = Run::new("s", spec);
        run.metadata.creation_timestamp = Some(Time(created.parse().expect("time")));
        run.status = Some(RunStatus {
            phase: Some(phase),
            session: active.map(|a| SessionStatus {
                last_activity_time: Some(a.to_string()),
            }),
            ..RunStatus::default()
        });
        run
    }

    fn at(text: &str) -> Timestamp {
        text.parse().expect("time")
    }

    const TTL: Duration = Duration::from_secs(3600);

    #[test]
    fn idle_counts_from_the_later_of_creation_and_last_activity() {
        let run = session(
            None,
            Phase::Ready,
            "2026-01-01T00:00:00Z",
            Some("2026-01-01T00:30:00Z"),
        );
        assert_eq!(expired(&run, TTL, at("2026-01-01T01:29:59Z")), None);
        assert_eq!(
            expired(&run, TTL, at("2026-01-01T01:30:00Z")),
            Some((TTL, TTL))
        );
        let never = session(None, Phase::Ready, "2026-01-01T00:00:00Z", None);
        assert!(expired(&never, TTL, at("2026-01-01T01:00:00Z")).is_some());
    }

    #[test]
    fn a_run_may_only_lower_the_ttl() {
        let lower = session(Some("10m"), Phase::Ready, "2026-01-01T00:00:00Z", None);
        assert_eq!(idle_limit(&lower, TTL), Some(Duration::from_secs(600)));
        let higher = session(Some("48h"), Phase::Ready, "2026-01-01T00:00:00Z", None);
        assert_eq!(idle_limit(&higher, TTL), Some(TTL), "clamped to the TTL");
        assert_eq!(
            idle_limit(&lower, Duration::ZERO),
            None,
            "0 disables it all"
        );
    }

    #[test]
    fn only_ready_sessions_expire() {
        for phase in [
            Phase::Pending,
            Phase::Scheduled,
            Phase::Running,
            Phase::Finalizing,
            Phase::Suspended,
            Phase::Succeeded,
            Phase::Failed,
            Phase::Timeout,
            Phase::Cancelled,
        ] {
            let run = session(None, phase, "2026-01-01T00:00:00Z", None);
            assert_eq!(
                expired(&run, TTL, at("2027-01-01T00:00:00Z")),
                None,
                "{phase}"
            );
        }
        let mut task = session(None, Phase::Ready, "2026-01-01T00:00:00Z", None);
        task.spec.mode.session = None;
        assert_eq!(expired(&task, TTL, at("2027-01-01T00:00:00Z")), None);
    }
}
