//! Why a Run is not placed, on the Run itself: the condition `Scheduled=False` with a
//! reason, and a Warning Event with the same reason each time the reason changes.
//!
//! The reasons ([`kruntimes_api::lifecycle`]):
//! - `RuntimeNotFound`: the Runtime the Run names does not exist in its namespace (confirmed
//!   by a fresh read of the Runtime before it is written). The Run stays Pending; a Runtime
//!   created later picks it up.
//! - `ExceedsWorkerCapacity`: the Run asks for more slots than a worker of its Runtime has.
//! - `WaitingForWorkers`: the Runtime exists but has no ready worker yet.
//! - `NoCapacity`: no ready worker has the slots the Run asks for; the message has the
//!   numbers (requested, free on the freest worker, free and total over all ready workers,
//!   workers).
//!
//! The two waiting reasons are written only once a Run has waited [`WAIT_BEFORE_TELLING`]
//! (most Runs of a burst are placed within it and get no write at all); the other two at
//! once. A condition is rewritten only when its reason changes, not when the numbers of a
//! `NoCapacity` message do, so a Run waiting in a long queue costs one write, not one per
//! pass. Writes are bounded per Runtime ([`WRITES_PER_WINDOW`] per [`WRITE_WINDOW`], the
//! longest-waiting Runs first); a Run left out is told on a later pass. The scheduler
//! replaces the condition with `Scheduled=True` when it places the Run.
//!
//! Every write is a status replace with the `resourceVersion` read, so it never overwrites
//! a placement or a cancellation made meanwhile; a conflict is left to the next pass. The
//! Event goes out only after its condition was written, which is what makes it once per
//! change of reason.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kruntimes_api::Run;
use kruntimes_api::lifecycle::{SCHEDULED_CONDITION, bounded_message};
use kruntimes_api::run::RunCondition;
use kube::api::{Api, PostParams};
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use tracing::debug;

use crate::error::{is_conflict, is_not_found};
use crate::events::Events;
use crate::status::{now_rfc3339, set_condition};

/// How long a Run waits for a slot or a worker before its condition says so.
pub const WAIT_BEFORE_TELLING: Duration = Duration::from_secs(2);
/// Condition writes per Runtime per [`WRITE_WINDOW`], at most. Each also costs an Event
/// write; in a burst queued behind busy workers (2,000 Runs on 64 slots, say) this keeps
/// the extra writes at a fraction of the placements' own.
pub const WRITES_PER_WINDOW: u32 = 16;
/// The window of [`WRITES_PER_WINDOW`].
pub const WRITE_WINDOW: Duration = Duration::from_secs(1);
/// Condition writes in flight at once.
const CONCURRENCY: usize = 16;
/// The longest one condition write may take.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// The `action` of the Events.
const ACTION: &str = "Schedule";
/// How long a written condition is remembered while the cache does not show it yet.
const REMEMBER_FOR: Duration = Duration::from_secs(30);

/// Why one Run is not placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Why {
    /// One of the reasons of [`kruntimes_api::lifecycle`].
    pub reason: &'static str,
    pub message: String,
}

/// Whether `run` already says `Scheduled=False` with `reason`.
pub fn shows(run: &Run, reason: &str) -> bool {
    kruntimes_api::lifecycle::unscheduled_reason(run.status.as_ref())
        .is_some_and(|(r, _)| r == reason)
}

/// A condition written over one version of a Run.
struct Written {
    over: String,
    reason: &'static str,
    at: Instant,
}

/// What the scheduler remembers of its condition writes.
#[derive(Default)]
pub(crate) struct Teller {
    /// By Run UID: the condition written and the version it was written over.
    written: Mutex<HashMap<String, Written>>,
    /// By (namespace, Runtime): the start of the current window and the writes in it.
    windows: Mutex<HashMap<(String, String), (Instant, u32)>>,
}

impl Teller {
    /// Whether `run` needs `why` written: it does not show the reason yet, and this
    /// scheduler did not write it over the version the cache still shows.
    pub(crate) fn needs(&self, run: &Run, why: &Why) -> bool {
        if shows(run, why.reason) {
            return false;
        }
        let (Some(uid), Some(version)) = (run.uid(), run.resource_version()) else {
            return false;
        };
        let Ok(written) = self.written.lock() else {
            return false;
        };
        !written
            .get(&uid)
            .is_some_and(|w| w.over == version && w.reason == why.reason)
    }

    /// Takes up to `wanted` writes from the budget of one Runtime; returns how many it got
    /// and, when it got fewer, how soon the window opens again.
    fn take(&self, key: (String, String), wanted: usize) -> (usize, Option<Duration>) {
        let Ok(mut windows) = self.windows.lock() else {
            return (0, Some(WRITE_WINDOW));
        };
        let now = Instant::now();
        let entry = windows.entry(key).or_insert((now, 0));
        if now.duration_since(entry.0) >= WRITE_WINDOW {
            *entry = (now, 0);
        }
        let left = WRITES_PER_WINDOW.saturating_sub(entry.1) as usize;
        let granted = wanted.min(left);
        entry.1 += u32::try_from(granted).unwrap_or(u32::MAX);
        let again =
            (granted < wanted).then(|| WRITE_WINDOW.saturating_sub(now.duration_since(entry.0)));
        (granted, again)
    }

    fn remember(&self, uid: String, over: String, reason: &'static str) {
        if let Ok(mut written) = self.written.lock() {
            let now = Instant::now();
            if written.len() > 10_000 {
                written.retain(|_, w| now.duration_since(w.at) < REMEMBER_FOR);
            }
            written.insert(
                uid,
                Written {
                    over,
                    reason,
                    at: now,
                },
            );
        }
    }

    /// Writes each `(Run, why)` of one Runtime that needs it, in the order given (put the
    /// longest-waiting first), within the Runtime's budget; each written condition is then
    /// told in an Event. Returns how soon to look again when the budget left some out.
    pub(crate) async fn tell(
        &self,
        api: &Api<Run>,
        events: &Events,
        key: (String, String),
        tells: Vec<(&Run, Why)>,
    ) -> Option<Duration> {
        let tells: Vec<(&Run, Why)> = tells
            .into_iter()
            .filter(|(run, why)| self.needs(run, why))
            .collect();
        if tells.is_empty() {
            return None;
        }
        let (granted, again) = self.take(key, tells.len());
        futures::stream::iter(tells.into_iter().take(granted))
            .for_each_concurrent(CONCURRENCY, |(run, why)| async move {
                self.write(api, events, run, why).await;
            })
            .await;
        again
    }

    async fn write(&self, api: &Api<Run>, events: &Events, run: &Run, why: Why) {
        let name = run.name_any();
        let mut updated = run.clone();
        let generation = updated.meta().generation;
        let status = updated.status.get_or_insert_with(Default::default);
        let message = bounded_message(&why.message);
        set_condition(
            &mut status.conditions,
            RunCondition {
                type_: SCHEDULED_CONDITION.to_string(),
                status: "False".to_string(),
                reason: Some(why.reason.to_string()),
                message: Some(message.clone()),
                last_transition_time: Some(now_rfc3339()),
                observed_generation: generation,
            },
        );
        let params = PostParams::default();
        let write = api.replace_status(&name, &params, &updated);
        match tokio::time::timeout(WRITE_TIMEOUT, write).await {
            Ok(Ok(_)) => {
                debug!(run = %name, reason = why.reason, "Run says why it is not placed");
                if let (Some(uid), Some(over)) = (run.uid(), run.resource_version()) {
                    self.remember(uid, over, why.reason);
                }
                events.publish(run, EventType::Warning, why.reason, ACTION, &message);
            }
            Ok(Err(error)) if is_conflict(&error) || is_not_found(&error) => {
                debug!(run = %name, "Run changed before its condition was written; the next pass looks again");
            }
            Ok(Err(error)) => {
                debug!(run = %name, error = %error, "cannot write why the Run is not placed");
            }
            Err(_) => debug!(run = %name, "writing why the Run is not placed timed out"),
        }
    }
}

#[cfg(test)]
mod tests {
    use kruntimes_api::RunSpec;

    use super::*;

    #[test]
    fn a_condition_is_needed_until_the_run_shows_its_reason() {
        let teller = Teller::default();
        let mut run = Run::new("r", RunSpec::task("bash", "main.sh"));
        run.metadata.uid = Some("u".into());
        run.metadata.resource_version = Some("1".into());
        let why = Why {
            reason: "NoCapacity",
            message: "m".into(),
        };
        assert!(teller.needs(&run, &why));
        teller.remember("u".into(), "1".into(), "NoCapacity");
        assert!(
            !teller.needs(&run, &why),
            "written over the version the cache shows"
        );
        run.metadata.resource_version = Some("2".into());
        assert!(
            teller.needs(&run, &why),
            "a newer version without the condition"
        );
        let status = run.status.get_or_insert_with(Default::default);
        status.conditions.push(RunCondition {
            type_: SCHEDULED_CONDITION.into(),
            status: "False".into(),
            reason: Some("NoCapacity".into()),
            message: Some("other numbers".into()),
            ..RunCondition::default()
        });
        assert!(
            !teller.needs(&run, &why),
            "new numbers alone are not rewritten"
        );
        let other = Why {
            reason: "WaitingForWorkers",
            message: "m".into(),
        };
        assert!(teller.needs(&run, &other), "a new reason is");
    }

    #[test]
    fn the_budget_is_per_runtime_and_window() {
        let teller = Teller::default();
        let key = |n: &str| ("ns".to_string(), n.to_string());
        let (granted, again) = teller.take(key("a"), 10);
        assert_eq!((granted, again), (10, None));
        let (granted, again) = teller.take(key("a"), 10);
        assert_eq!(granted, 6);
        assert!(again.is_some_and(|d| d <= WRITE_WINDOW));
        assert_eq!(teller.take(key("b"), 10), (10, None));
    }
}
