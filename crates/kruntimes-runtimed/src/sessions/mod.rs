//! Session mode on the owner runtimed (design document 001): the per-session FIFO queue,
//! operation state, sequence numbers, the lease, and the session Run lifecycle.
//!
//! `Scheduled → Running (registering) → Ready → Finalizing → Succeeded`, or Cancelled,
//! Failed, Timeout:
//!
//! - **Claim** (through the local gate, [`Gate`]): add the registration-cleanup finalizer,
//!   write Running with `Ready=False/Registering`.
//! - **Register**: the claim starts `RegisterSession` in the background while it writes
//!   Running; a reconcile then asks the runtime server `GetSessionStatus`. READY → Ready
//!   with the endpoint; NOT_FOUND → start `RegisterSession` in the background unless one is
//!   in flight (the background task never touches the Run: it records its result here and
//!   requeues the Run); REGISTERING → requeue; FAILED, CLOSED, CLOSING → the retry path.
//! - **Ready**: operations are admitted into the session's queue ([`Session::admit`]) and
//!   run one at a time by the session's worker task against the runtime server. Every
//!   event gets the session's next sequence number. `spec.timeout` and the lease
//!   (`leaseTimeoutSeconds`, renewed by heartbeats) end it Timeout; a session the runtime
//!   server lost ends Failed (a Ready session never moves).
//! - **Drain** → Finalizing: new operations are refused, accepted ones finish, the session
//!   is closed without purge, `$KRUNTIME_ARTIFACTS_DIR` is exported to the Runtime's
//!   ArtifactStore ([`crate::artifacts`]), then the session is purged and the Run Succeeded
//!   with `status.artifactRefs`. A store failure keeps it Finalizing and retries; an invalid
//!   artifact ends it Failed (`ArtifactInvalid`). **Immediate** wins at any point:
//!   Cancelled.
//! - **Suspend** (Ready with `spec.suspend: true`, [`suspend`]): admission stops,
//!   accepted operations finish, the files are captured (`CaptureSession`) into the
//!   Snapshot `<run>-s<incarnation>`: a local copy on this worker, then the store
//!   ([`crate::sessions::snapshots`]), the Snapshot Ready; then the Run Suspended (re-read first:
//!   the same incarnation, still asked, no termination), and only then the session is
//!   purged here. A store failure reopens admission (`Suspended=False/SnapshotRetrying`)
//!   and captures again later; no store at all: `Suspended=False/NoSnapshotStore`.
//! - **Resume** (a Run with `status.snapshot`, incarnation 2 or more): the background
//!   registration restores the Snapshot (`RestoreSession`, from the local copy when its
//!   digest matches, else the store) before the marker clears, so Ready is written only
//!   after the restore; a bad snapshot ends it Failed `SnapshotInvalid`, an unreadable
//!   store registers again later. Sequence numbers continue after `lastSequence`.
//! - **Incarnations** are fenced: the [`Key`] of a session carries the incarnation
//!   ([`crate::tasks::executions::fenced_attempt`]), so each has its own local session and
//!   runtime-server ID, and the collector purges an earlier incarnation's, never a later.
//! - **Close** (every ending and deletion): refuse new work, cancel queued work, cancel the
//!   running operation, `CloseSession` (SIGTERM, grace, SIGKILL on the runtime server).
//!
//! Every Run status write happens in a reconcile; the session state here is Pod-local and
//! is never written to status.

pub mod audit;
pub mod calls;
pub mod checkpoints;
pub mod snapshots;
pub mod workspaces;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::jiff::{self, Timestamp};
use kruntimes_api::lifecycle::{self, bounded_message, now_rfc3339};
use kruntimes_api::run::{ArtifactRef, TerminationMode};
use kruntimes_api::snapshot::{
    Snapshot, SnapshotLocalCopy, SnapshotLocation, SnapshotPhase, SnapshotReason, SnapshotSpec,
    SnapshotStatus,
};
use kruntimes_api::{Phase, Run, RunStatus};
use kruntimes_proto::runtime::v1 as rs;
use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::{Api, Resource};
use tokio::sync::{Notify, mpsc, oneshot};
use tonic::transport::Channel;
use tonic::{Code, Request, Status};
use tracing::{debug, info, warn};

use crate::artifacts::{ExportError, RunKey};
use crate::functions::{
    add_finalizer, deadline, patch_finalizers, write_claim, write_end, write_ready, write_retry,
};
use crate::reconcile::{Context, Error, write_status};
use crate::sessions::audit::AuditRecord;
use crate::tasks::executions::Key;

pub type SessionClient = rs::session_runtime_client::SessionRuntimeClient<Channel>;

/// A Ready session is looked at least this often (the runtime server's view, timers).
const HEALTH_EVERY: Duration = Duration::from_secs(10);
/// How long a reconcile waits for a registration it just started before it requeues.
const REGISTRATION_WAIT: Duration = Duration::from_millis(200);
/// The longest one `RegisterSession` may take; beyond it the registration failed.
const REGISTRATION_TIMEOUT: Duration = Duration::from_secs(60);
/// How long one event may wait for its caller to make room before the caller's later
/// events are dropped (a stalled connection never stalls the session).
const DELIVERY_STALL: Duration = Duration::from_secs(5);
/// How soon a Run refused by the local gate is looked at again.
const GATE_RETRY: Duration = Duration::from_millis(200);
/// How soon a failed suspend (its store) is tried again.
const SUSPEND_RETRY: Duration = Duration::from_secs(2);
/// The longest a failed suspend waits before its next try.
const SUSPEND_RETRY_MAX: Duration = Duration::from_secs(60);

/// What a backoff of [`Sessions`] is for. A session's failed suspends and its failed
/// commit wait apart: a suspend that failed a while ago never delays the commit of its
/// release, nor makes that commit's first retry wait as long as its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Retry {
    Suspend,
    Commit,
}

/// The next try of a session's failed suspend or commit.
#[derive(Debug, Clone, Copy)]
struct RetryAt {
    at: Instant,
    /// Failed tries in a row.
    failures: u32,
}

/// The wait after `failures` failed suspends in a row: [`SUSPEND_RETRY`], doubled after
/// each further failure up to [`SUSPEND_RETRY_MAX`]. A store that is down for long, or a
/// workspace over the cap, costs a capture a minute, not one every two seconds.
fn suspend_retry_delay(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    SUSPEND_RETRY
        .saturating_mul(1 << doublings)
        .min(SUSPEND_RETRY_MAX)
}

/// How soon an ended session the drain owns is looked at again (the worker is going).
const DRAINING_LOOK: Duration = Duration::from_secs(1);
/// How soon a resume whose snapshot could not be read registers again.
const RESTORE_RETRY: Duration = Duration::from_secs(2);
/// How soon a failed artifact export is retried.
const EXPORT_RETRY: Duration = Duration::from_secs(2);
/// Events buffered per operation for its caller before the worker waits.
const EVENT_BUFFER: usize = 64;
/// Operation IDs a session remembers (to refuse a repeated one), at most.
const REMEMBERED_IDS: usize = 4096;
pub use kruntimes_api::lifecycle::MAX_OPERATION_ID_BYTES;

/// The Ready condition's reason while the session accepts operations.
pub const REGISTERED_REASON: &str = "SessionRegistered";

/// Platform-wide session limits (runtimed flags); a Run may only lower them.
#[derive(Debug, Clone)]
pub struct SessionLimits {
    pub max_queue: u32,
    pub max_operation_timeout: Duration,
    /// The longest runtimed waits for the runtime server to close a session.
    pub close_timeout: Duration,
    /// The largest whole-file upload (or archive) into a session, in bytes.
    pub max_file_bytes: u64,
    /// How often at most the owner writes a session's `status.session.lastActivityTime`
    /// (the idle clock's granularity); keep it well under the idle TTL.
    pub activity_interval: Duration,
    /// Where suspend snapshots are kept (`--snapshot-dir`): this worker's local copies
    /// under `local/`, and the filesystem store (`store/`) used when the Runtime names no
    /// ArtifactStore. `None`: local copies in the system temporary directory, and no store
    /// unless the Runtime names one.
    pub snapshot_dir: Option<std::path::PathBuf>,
    /// How often this worker removes its local snapshot copies that no resume can use any
    /// more (`crate::sessions::snapshots::sweep_local`); the first sweep runs once the worker's view
    /// is synced.
    pub snapshot_sweep_interval: Duration,
}

/// The default of [`SessionLimits::snapshot_sweep_interval`]: five minutes.
pub const DEFAULT_SNAPSHOT_SWEEP_INTERVAL: Duration = Duration::from_secs(300);

/// The default of [`SessionLimits::activity_interval`]: one status write a minute at most.
pub const DEFAULT_ACTIVITY_INTERVAL: Duration = Duration::from_secs(60);

/// The default of [`SessionLimits::max_file_bytes`]: 1 GiB.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 1 << 30;

impl Default for SessionLimits {
    fn default() -> SessionLimits {
        SessionLimits {
            max_queue: 32,
            max_operation_timeout: Duration::from_secs(300),
            close_timeout: Duration::from_secs(30),
            max_file_bytes: DEFAULT_MAX_FILE_BYTES,
            activity_interval: DEFAULT_ACTIVITY_INTERVAL,
            snapshot_dir: None,
            snapshot_sweep_interval: DEFAULT_SNAPSHOT_SWEEP_INTERVAL,
        }
    }
}

type EventSender = mpsc::Sender<Result<rs::SessionOperationEvent, Status>>;
pub type EventReceiver = mpsc::Receiver<Result<rs::SessionOperationEvent, Status>>;

/// A mutation waiting in the queue.
struct Pending {
    request: rs::SessionOperationRequest,
    events: EventSender,
    queued_at: SystemTime,
    /// A checkpoint's barrier in place of an operation ([`Session::enqueue_barrier`]).
    barrier: Option<crate::sessions::checkpoints::Barrier>,
}

/// The mutation running now.
struct RunningOp {
    id: String,
    cancel: Option<oneshot::Sender<()>>,
}

#[derive(Default)]
struct Inner {
    accepting: bool,
    closed: bool,
    queue: VecDeque<Pending>,
    running: Option<RunningOp>,
    sequence: u64,
    next_id: u64,
    ids: HashSet<String>,
    id_order: VecDeque<String>,
    /// Whole-file uploads in flight (they bypass the queue; [`Session::begin_upload`]).
    uploads: u32,
    /// The last mutation (or the end of the last operation: idle time runs from when the
    /// queue became empty); the auto-suspend clock. Reads, listings and heartbeats never
    /// set it.
    last_mutation: Option<Instant>,
    /// Admission stopped for an auto-suspend ([`Session::stop_for_auto_suspend`]): a call
    /// refused now is told to try again (UNAVAILABLE), as the next one wakes the session.
    auto_suspending: bool,
}

/// The session's last mutation, and what this owner wrote of it.
#[derive(Default)]
struct Activity {
    /// When the last mutation was seen here (microseconds, as status carries it).
    last: Option<Timestamp>,
    /// When this owner last wrote `status.session.lastActivityTime`.
    written_at: Option<Instant>,
    /// A reconcile was asked for since the last write: later mutations ask for none.
    signalled: bool,
}

/// Whether the owner writes `status.session.lastActivityTime` now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ActivityWrite {
    /// Status holds the last mutation (or there was none).
    UpToDate,
    /// Write this time now.
    Now(Timestamp),
    /// An unrecorded mutation waits for the interval: look again after this long.
    After(Duration),
}

/// An upload in flight ([`Session::begin_upload`]).
pub struct UploadGuard(Arc<Session>);

impl Drop for UploadGuard {
    fn drop(&mut self) {
        let mut inner = self.0.lock();
        inner.uploads = inner.uploads.saturating_sub(1);
        drop(inner);
        if let Some((requeue, reference)) = &self.0.wake {
            let _ = requeue.try_send(reference.clone());
        }
    }
}

/// One session owned by this worker.
pub struct Session {
    pub uid: String,
    pub name: String,
    /// The Run's attempt (`status.attempt`).
    pub attempt: u32,
    /// The fenced attempt (attempt and incarnation, [`crate::tasks::executions::fenced_attempt`]):
    /// the session's identity on the runtime server.
    pub fenced: u32,
    pub queue_size: usize,
    pub operation_timeout: Duration,
    pub lease: Option<Duration>,
    /// `spec.mode.session.autoSuspendAfter`: suspended by its owner after this long quiet.
    pub auto_suspend_after: Option<Duration>,
    last_heartbeat: Mutex<Instant>,
    inner: Mutex<Inner>,
    changed: Notify,
    activity: Mutex<Activity>,
    /// The least time between two writes of the activity time.
    activity_interval: Duration,
    /// When this owner took the session on.
    created: Instant,
    /// One admission-time activity write at a time ([`record_before_mutation`]).
    admission_write: tokio::sync::Mutex<()>,
    /// The commit to its Workspace at its end. Held through a commit, so the drain's and a
    /// reconcile's look never make two.
    commit: tokio::sync::Mutex<CommitState>,
    /// Requeues the session's Run (a mutation to record); `None` in unit tests.
    wake: Option<(
        mpsc::Sender<kube::runtime::reflector::ObjectRef<Run>>,
        kube::runtime::reflector::ObjectRef<Run>,
    )>,
}

/// Where the commit of a session's files to its Workspace stands ([`Session::commit_state`]).
#[derive(Debug, Default)]
pub(crate) struct CommitState {
    /// Made, or given up: the session was shut before, so nothing is left to commit, and
    /// it is not made again (the end that followed may not have landed).
    pub(crate) settled: bool,
    /// A failure was written on the Run (`WorkspaceCommitted=False`), so the commit that
    /// goes through must say so too.
    pub(crate) failure_shown: bool,
    /// What the Run's `WorkspaceCommitted` condition must say once settled (status, reason,
    /// message); `None`: nothing (made at once).
    pub(crate) shown: Option<(&'static str, &'static str, String)>,
}

impl Session {
    /// Records a mutation (an accepted operation, an operation's end, a file write): the
    /// idle clock restarts. Reads, listings and heartbeats never call it. The first
    /// mutation after a status write asks for a reconcile, which writes it (at most once
    /// per activity interval).
    pub fn touch(&self) {
        self.lock().last_mutation = Some(Instant::now());
        let now = Timestamp::now()
            .round(jiff::Unit::Microsecond)
            .unwrap_or_else(|_| Timestamp::now());
        let mut activity = self.activity.lock().unwrap_or_else(PoisonError::into_inner);
        activity.last = Some(now);
        if activity.signalled {
            return;
        }
        activity.signalled = true;
        drop(activity);
        if let Some((requeue, reference)) = &self.wake {
            let _ = requeue.try_send(reference.clone());
        }
    }

    /// What to write of the activity, given what status records (`recorded`).
    fn activity_write(&self, recorded: Option<Timestamp>) -> ActivityWrite {
        let mut activity = self.activity.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(last) = activity.last else {
            activity.signalled = false;
            return ActivityWrite::UpToDate;
        };
        if recorded.is_some_and(|r| r >= last) {
            activity.signalled = false;
            return ActivityWrite::UpToDate;
        }
        match activity.written_at.map(|at| at.elapsed()) {
            Some(since) if since < self.activity_interval => {
                ActivityWrite::After(self.activity_interval - since)
            }
            _ => {
                // From here a new mutation asks for another reconcile. The write counts from
                // now, so an admission does not write the same activity beside it.
                activity.signalled = false;
                activity.written_at = Some(Instant::now());
                ActivityWrite::Now(last)
            }
        }
    }

    /// When no activity time was written (or is being written) for an activity interval,
    /// nor since this owner took the session on, the status may look idle to the sweep:
    /// takes the write on (the owner's own activity writes wait an interval from now) and
    /// says so.
    /// `Some` of the write time it replaced when it took the write on.
    fn claim_quiet_write(&self) -> Option<Option<Instant>> {
        let mut activity = self.activity.lock().unwrap_or_else(PoisonError::into_inner);
        if activity.written_at.unwrap_or(self.created).elapsed() < self.activity_interval {
            return None;
        }
        Some(activity.written_at.replace(Instant::now()))
    }

    /// A claimed write did not land: the next mutation tries again.
    fn unclaim_write(&self, previous: Option<Instant>) {
        self.activity
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .written_at = previous;
    }

    /// The activity time was written now.
    fn activity_written(&self) {
        self.activity
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .written_at = Some(Instant::now());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The session's identity on the runtime server.
    pub fn id(&self) -> rs::ExecutionId {
        rs::ExecutionId {
            run_uid: self.uid.clone(),
            attempt: self.fenced,
        }
    }

    /// Records a heartbeat: the lease runs from now.
    pub fn renew(&self) {
        let mut last = self
            .last_heartbeat
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // An expired lease stays expired: the session is ending.
        if self.lease.is_none_or(|lease| last.elapsed() < lease) {
            *last = Instant::now();
        }
    }

    /// Restarts the lease whatever it says (the session became Ready).
    fn restart_lease(&self) {
        *self
            .last_heartbeat
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
    }

    /// What the lease leaves, if the session has one.
    pub fn lease_left(&self) -> Option<Duration> {
        let lease = self.lease?;
        let last = *self
            .last_heartbeat
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Some(lease.saturating_sub(last.elapsed()))
    }

    /// When the lease expires without another heartbeat.
    pub fn lease_expires_at(&self) -> Option<SystemTime> {
        self.lease_left().map(|left| SystemTime::now() + left)
    }

    /// Waiting mutations, the running one, and the last sequence number.
    pub fn snapshot(&self) -> (u32, String, u64) {
        let inner = self.lock();
        (
            u32::try_from(inner.queue.len()).unwrap_or(u32::MAX),
            inner
                .running
                .as_ref()
                .map(|r| r.id.clone())
                .unwrap_or_default(),
            inner.sequence,
        )
    }

    fn stamp(
        inner: &mut Inner,
        id: &str,
        event: rs::session_operation_event::Event,
    ) -> rs::SessionOperationEvent {
        inner.sequence += 1;
        rs::SessionOperationEvent {
            operation_id: id.to_string(),
            sequence: inner.sequence,
            event: Some(event),
        }
    }

    /// Admits one mutation: refuses it when the session is not accepting, the queue is
    /// full or the ID was seen; otherwise queues it, sends its `queued` event and returns
    /// the receiver of its events.
    pub fn admit(
        &self,
        mut operation: rs::SessionOperationRequest,
    ) -> Result<EventReceiver, Status> {
        if operation.operation.is_none() {
            return Err(Status::invalid_argument(
                "an operation needs exactly one of command, writeFile, makeDirectory, delete or rename",
            ));
        }
        let timeout = match operation.timeout {
            None => self.operation_timeout,
            Some(t) => Duration::try_from(t)
                .map_err(|_| Status::invalid_argument("the timeout must not be negative"))?,
        };
        let timeout = if timeout.is_zero() {
            self.operation_timeout
        } else if timeout > self.operation_timeout {
            // Refused at once, naming the cap: clamping it would let the command die at the
            // cap long before the caller expects (issue 15 item 8).
            return Err(Status::invalid_argument(format!(
                "the operation's timeout of {} exceeds this session's cap of {} (the Run's \
                 spec.mode.session.operationTimeout, at most the worker's \
                 --session-max-operation-timeout); ask for {} or less",
                seconds(timeout),
                seconds(self.operation_timeout),
                seconds(self.operation_timeout),
            )));
        } else {
            timeout
        };
        let mut inner = self.lock();
        if inner.closed {
            return Err(Status::unavailable(
                "the session is closing: it accepts no new operations",
            ));
        }
        if !inner.accepting {
            if inner.auto_suspending {
                return Err(auto_suspending_refusal());
            }
            return Err(Status::failed_precondition(
                "the session is finalizing or closed: it accepts no new operations",
            ));
        }
        if inner.queue.len() >= self.queue_size {
            return Err(Status::resource_exhausted(format!(
                "{} operations wait, the most it holds",
                self.queue_size
            )));
        }
        let id = if operation.operation_id.is_empty() {
            loop {
                inner.next_id += 1;
                let id = format!("op-{}", inner.next_id);
                if !inner.ids.contains(&id) {
                    break id;
                }
            }
        } else {
            let id = operation.operation_id.clone();
            if !lifecycle::is_operation_id(&id) {
                return Err(Status::invalid_argument(format!(
                    "an operation ID is 1 to {MAX_OPERATION_ID_BYTES} bytes of [A-Za-z0-9._-]"
                )));
            }
            if inner.ids.contains(&id) {
                return Err(Status::already_exists(format!(
                    "the session already has an operation {id:?}"
                )));
            }
            id
        };
        inner.ids.insert(id.clone());
        inner.id_order.push_back(id.clone());
        if inner.id_order.len() > REMEMBERED_IDS
            && let Some(old) = inner.id_order.pop_front()
        {
            inner.ids.remove(&old);
        }
        operation.operation_id = id.clone();
        operation.timeout = prost_types::Duration::try_from(timeout).ok();
        let position = inner.queue.len() + usize::from(inner.running.is_some());
        let (events, receiver) = mpsc::channel(EVENT_BUFFER);
        let queued = Self::stamp(
            &mut inner,
            &id,
            rs::session_operation_event::Event::Queued(rs::OperationQueued {
                position: u32::try_from(position).unwrap_or(u32::MAX),
            }),
        );
        // The channel is new: there is room for the first event.
        let _ = events.try_send(Ok(queued));
        inner.queue.push_back(Pending {
            request: operation,
            events,
            queued_at: SystemTime::now(),
            barrier: None,
        });
        drop(inner);
        self.changed.notify_one();
        self.touch();
        Ok(receiver)
    }

    /// Queues a checkpoint's barrier behind every operation accepted so far: the worker
    /// hands it the quiescent session when they are done, and starts nothing after it until
    /// the barrier lets go. Refused (given back) while the session takes no operations
    /// (suspending, draining, closed): the checkpoint waits for the next look. Not bounded
    /// by the queue size (one barrier per Snapshot in flight, [`crate::sessions::checkpoints`]).
    pub(crate) fn enqueue_barrier(
        &self,
        barrier: crate::sessions::checkpoints::Barrier,
    ) -> Result<(), crate::sessions::checkpoints::Barrier> {
        let mut inner = self.lock();
        if inner.closed || !inner.accepting {
            return Err(barrier);
        }
        let (events, _) = mpsc::channel(1);
        inner.queue.push_back(Pending {
            request: rs::SessionOperationRequest {
                // Not an operation ID a caller can use (no ':' in them), so no cancel meets it.
                operation_id: format!("checkpoint:{}", barrier.snapshot),
                ..Default::default()
            },
            events,
            queued_at: SystemTime::now(),
            barrier: Some(barrier),
        });
        drop(inner);
        self.changed.notify_one();
        Ok(())
    }

    /// Cancels a queued or running operation: `None` when the session has no such
    /// operation waiting or running.
    pub fn cancel(&self, id: &str) -> Option<rs::OperationState> {
        let mut inner = self.lock();
        if let Some(index) = inner
            .queue
            .iter()
            .position(|p| p.request.operation_id == id)
        {
            let pending = inner.queue.remove(index)?;
            let event = Self::stamp(
                &mut inner,
                id,
                completed(
                    rs::OperationState::Cancelled,
                    "Cancelled",
                    "cancelled before it started",
                ),
            );
            drop(inner);
            let _ = pending.events.try_send(Ok(event));
            self.changed.notify_one();
            return Some(rs::OperationState::Cancelled);
        }
        match inner.running.as_mut() {
            Some(running) if running.id == id => {
                if let Some(cancel) = running.cancel.take() {
                    let _ = cancel.send(());
                }
                Some(rs::OperationState::Cancelled)
            }
            _ => None,
        }
    }

    /// Refuses new operations from now on (Drain, Suspend).
    pub fn stop_accepting(&self) {
        self.lock().accepting = false;
    }

    /// Accepts operations again (a suspend that could not complete), unless closed. A
    /// withdrawn auto-suspend (a wake) counts as activity, and the lease runs afresh: the
    /// session is not suspended again at once for the quiet time or the lease that
    /// suspended it.
    fn start_accepting(&self) {
        let mut inner = self.lock();
        if !inner.closed {
            inner.accepting = true;
            if std::mem::take(&mut inner.auto_suspending) {
                inner.last_mutation = Some(Instant::now());
                drop(inner);
                self.restart_lease();
            }
        }
    }

    /// How long the session has yet to stay quiet before its owner suspends it (zero when
    /// it is due); `None` without `autoSuspendAfter`.
    ///
    /// `None` while work waits, runs or uploads: the quiet time has not begun, and the end
    /// of that work requeues the Run (an operation longer than `autoSuspendAfter` made the
    /// reconcile spin every 10 ms until it ended).
    pub fn auto_suspend_left(&self) -> Option<Duration> {
        let after = self.auto_suspend_after?;
        let inner = self.lock();
        if !inner.queue.is_empty() || inner.running.is_some() || inner.uploads > 0 {
            return None;
        }
        let quiet = inner
            .last_mutation
            .map_or(Duration::ZERO, |at| at.elapsed());
        Some(after.saturating_sub(quiet))
    }

    /// Whether the session takes new work now (not being suspended, drained or closed).
    pub fn accepting(&self) -> bool {
        self.lock().accepting
    }

    /// The recheck and the admission stop of an auto-suspend, in one step under the
    /// session's lock: for idleness (`lease` false) only while nothing waits, runs or
    /// uploads and the session really was quiet for `autoSuspendAfter`; for an expired
    /// lease whatever runs (accepted work finishes before the capture, as for any
    /// suspend). Whether admission stopped; a `false` changes nothing.
    fn stop_for_auto_suspend(&self, lease: bool) -> bool {
        let Some(after) = self.auto_suspend_after else {
            return false;
        };
        let mut inner = self.lock();
        if inner.closed || !inner.accepting {
            return false;
        }
        let quiet = inner.last_mutation.is_none_or(|at| at.elapsed() >= after);
        let idle = inner.queue.is_empty() && inner.running.is_none() && inner.uploads == 0;
        if !(lease || (idle && quiet)) {
            return false;
        }
        inner.accepting = false;
        inner.auto_suspending = true;
        true
    }

    /// No operation waits or runs, and no upload is in flight.
    pub fn idle(&self) -> bool {
        let inner = self.lock();
        inner.queue.is_empty() && inner.running.is_none() && inner.uploads == 0
    }

    /// Starts a whole-file upload, which bypasses the queue: refused once admission
    /// stopped (a suspend capturing the files, a drain, a close), so no upload lands after
    /// the files were captured; counted by [`Session::idle`] until the guard drops, so a
    /// capture waits for the uploads already streaming. The guard's drop requeues the Run
    /// (a suspend or drain may be waiting for it).
    pub fn begin_upload(self: &Arc<Self>) -> Result<UploadGuard, Status> {
        let mut inner = self.lock();
        if !inner.accepting {
            if inner.auto_suspending {
                return Err(auto_suspending_refusal());
            }
            return Err(Status::failed_precondition(
                "the session accepts no uploads now: it is being suspended, drained or closed",
            ));
        }
        inner.uploads = inner.uploads.saturating_add(1);
        Ok(UploadGuard(self.clone()))
    }

    /// The commit at its end, held until the guard drops.
    pub(crate) async fn commit_state(&self) -> tokio::sync::MutexGuard<'_, CommitState> {
        self.commit.lock().await
    }

    /// Close: refuse new work, cancel queued work, cancel the running operation, stop the
    /// worker.
    pub fn shut(&self, why: &str) {
        let mut inner = self.lock();
        inner.accepting = false;
        inner.closed = true;
        let drained: Vec<Pending> = inner.queue.drain(..).collect();
        let mut cancelled = Vec::with_capacity(drained.len());
        for pending in drained {
            let event = Self::stamp(
                &mut inner,
                &pending.request.operation_id,
                completed(rs::OperationState::Cancelled, "SessionClosed", why),
            );
            cancelled.push((pending.events, event));
        }
        if let Some(cancel) = inner.running.as_mut().and_then(|r| r.cancel.take()) {
            let _ = cancel.send(());
        }
        drop(inner);
        for (events, event) in cancelled {
            let _ = events.try_send(Ok(event));
        }
        self.changed.notify_one();
    }
}

/// The refusal of new work while the owner suspends the session on its own: not accepted,
/// so a retry is safe, and the next call through the gateway wakes it.
fn auto_suspending_refusal() -> Status {
    Status::unavailable(
        "the session is being suspended after its autoSuspendAfter; the next call wakes it: \
         try again in a moment",
    )
}

fn completed(
    state: rs::OperationState,
    reason: &str,
    message: &str,
) -> rs::session_operation_event::Event {
    rs::session_operation_event::Event::Completed(rs::OperationCompleted {
        state: state as i32,
        reason: reason.to_string(),
        message: bounded_message(message),
        ..Default::default()
    })
}

/// The result of a background registration, consumed by the next reconcile.
#[derive(Debug, Clone)]
enum Registration {
    InFlight(u32),
    Failed {
        attempt: u32,
        kind: Failure,
        message: String,
    },
}

/// How a background registration failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// The runtime server could not register it: the retry policy decides.
    Register,
    /// The Run's request is invalid: Failed `InvalidSpec`.
    Invalid,
    /// The resumed session's snapshot is invalid: Failed `SnapshotInvalid`.
    SnapshotInvalid,
    /// The snapshot could not be read now (its store): registered again later.
    RestoreLater,
}

impl Registration {
    fn attempt(&self) -> u32 {
        match self {
            Registration::InFlight(attempt) | Registration::Failed { attempt, .. } => *attempt,
        }
    }
}

/// The sessions of this worker, the registrations in flight, and the local gate.
#[derive(Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, Arc<Session>>>,
    registrations: Mutex<HashMap<String, Registration>>,
    registered: Notify,
    pub(crate) gate: tokio::sync::Mutex<Gate>,
    /// Resumed sessions (Run UID, fenced attempt) whose snapshot was restored here.
    restored: Mutex<HashSet<(String, u32)>>,
    /// Sessions whose suspend or commit failed, and when it may be tried again.
    retries: Mutex<HashMap<(String, Retry), RetryAt>>,
    /// Run UIDs whose suspend writes Suspended and then closes the session itself (parking
    /// its files on the runtime server): the collector, which sees such a Run leave this
    /// worker as soon as Suspended is written, leaves the close to the suspend.
    suspending: Mutex<HashSet<String>>,
}

/// Marks a suspend's close as under way ([`Sessions::suspending`]) until dropped.
struct Suspending<'a> {
    sessions: &'a Sessions,
    uid: String,
}

impl Drop for Suspending<'_> {
    fn drop(&mut self) {
        self.sessions
            .suspending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.uid);
    }
}

impl Sessions {
    fn begin_suspending(&self, uid: &str) -> Suspending<'_> {
        self.suspending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(uid.to_string());
        Suspending {
            sessions: self,
            uid: uid.to_string(),
        }
    }

    fn is_suspending(&self, uid: &str) -> bool {
        self.suspending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(uid)
    }

    pub fn get(&self, uid: &str) -> Option<Arc<Session>> {
        self.map
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(uid)
            .cloned()
    }

    /// The local session of `uid` when it belongs to fenced attempt `fenced` or an
    /// earlier one: what a close of `fenced` may touch. A later incarnation's session (a
    /// resume on this worker) is never closed by a key of an earlier one.
    fn get_up_to(&self, uid: &str, fenced: u32) -> Option<Arc<Session>> {
        self.get(uid).filter(|s| s.fenced <= fenced)
    }

    /// Forgets the local session and the registration marker of `uid`, each only when it
    /// belongs to fenced attempt `fenced` or an earlier one (checked under its lock).
    fn forget_up_to(&self, uid: &str, fenced: u32) {
        {
            let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
            if map.get(uid).is_some_and(|s| s.fenced <= fenced) {
                map.remove(uid);
            }
        }
        let mut registrations = self
            .registrations
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if registrations
            .get(uid)
            .is_some_and(|r| r.attempt() <= fenced)
        {
            registrations.remove(uid);
        }
        drop(registrations);
        self.registered.notify_waiters();
    }

    fn registration(&self, uid: &str) -> Option<Registration> {
        self.registrations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(uid)
            .cloned()
    }

    fn set_registration(&self, uid: &str, registration: Option<Registration>) {
        let mut map = self
            .registrations
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match registration {
            Some(r) => map.insert(uid.to_string(), r),
            None => map.remove(uid),
        };
        drop(map);
        self.registered.notify_waiters();
    }

    fn was_restored(&self, uid: &str, fenced: u32) -> bool {
        self.restored
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&(uid.to_string(), fenced))
    }

    fn mark_restored(&self, uid: &str, fenced: u32) {
        let mut restored = self.restored.lock().unwrap_or_else(PoisonError::into_inner);
        restored.retain(|(u, _)| u != uid);
        restored.insert((uid.to_string(), fenced));
    }

    fn forget_run(&self, uid: &str) {
        self.restored
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|(u, _)| u != uid);
        self.retries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|(u, _), _| u != uid);
    }

    /// Forgets a failed `what` of `uid` (it succeeded, or it is no longer asked for).
    fn clear_retry(&self, uid: &str, what: Retry) {
        self.retries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&(uid.to_owned(), what));
    }

    /// How long a failed `what` of `uid` still waits before it is tried again.
    fn backoff(&self, uid: &str, what: Retry) -> Option<Duration> {
        let map = self.retries.lock().unwrap_or_else(PoisonError::into_inner);
        let left = map
            .get(&(uid.to_owned(), what))?
            .at
            .saturating_duration_since(Instant::now());
        (!left.is_zero()).then_some(left)
    }

    /// Records a failed `what` of `uid`; returns how long it waits before the next try.
    fn failed(&self, uid: &str, what: Retry) -> Duration {
        let mut map = self.retries.lock().unwrap_or_else(PoisonError::into_inner);
        let key = (uid.to_owned(), what);
        let failures = map.get(&key).map_or(0, |r| r.failures).saturating_add(1);
        let delay = suspend_retry_delay(failures);
        map.insert(
            key,
            RetryAt {
                at: Instant::now() + delay,
                failures,
            },
        );
        delay
    }

    /// Every Run UID with local session state.
    pub fn uids(&self) -> Vec<String> {
        self.map
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect()
    }
}

/// The local gate (design document 001, "Registration Reconciliation"), with the capacity
/// rule of [`kruntimes_api::capacity`] that the scheduler places by: every Run (task,
/// function or session) holds its slots of this worker and shares it; an exclusive session
/// is claimed only while nothing else is active here and then holds every slot. Claims pass
/// through it one at a time; it remembers the Runs it let through until the watch shows
/// them claimed, so two claims racing each other are counted against each other.
#[derive(Default)]
pub struct Gate {
    /// Run UID → the slots it holds, for Runs claimed here that the cache may still show
    /// Scheduled.
    claimed: HashMap<String, i64>,
}

impl Gate {
    /// Whether `run` may be claimed now, given the Runs assigned to this worker and its
    /// slots (`runs_per_worker`; `None` while this worker's Runtime is not known, when no
    /// bound is counted but exclusive sessions still stay alone); lets it through
    /// (remembering it) when it may.
    pub(crate) fn admit(
        &mut self,
        run: &Run,
        assigned: &[Arc<Run>],
        runs_per_worker: Option<i32>,
    ) -> bool {
        let runs_per_worker = runs_per_worker.unwrap_or(i32::MAX);
        let uid = run.uid().unwrap_or_default();
        let mut used: i64 = 0;
        let mut seen = HashSet::new();
        for other in assigned {
            let Some(other_uid) = other.uid() else {
                continue;
            };
            seen.insert(other_uid.clone());
            if other_uid == uid {
                continue;
            }
            let active = match other.phase() {
                Phase::Running | Phase::Ready | Phase::Finalizing => true,
                // Counted below, from what this gate let through; a Suspended session
                // holds nothing.
                Phase::Scheduled
                | Phase::Pending
                | Phase::Suspended
                | Phase::Succeeded
                | Phase::Failed
                | Phase::Timeout
                | Phase::Cancelled => false,
            };
            if active {
                used = used
                    .saturating_add(kruntimes_api::capacity::slots(&other.spec, runs_per_worker));
            }
        }
        // Forget what the cache shows claimed (or gone): the phases above cover it now.
        self.claimed.retain(|claimed_uid, _| {
            seen.contains(claimed_uid)
                && assigned.iter().any(|r| {
                    r.uid().as_deref() == Some(claimed_uid) && r.phase() == Phase::Scheduled
                })
        });
        for (claimed_uid, slots) in &self.claimed {
            if *claimed_uid != uid {
                used = used.saturating_add(*slots);
            }
        }
        let admitted = kruntimes_api::capacity::fits(&run.spec, runs_per_worker, used);
        if admitted {
            self.claimed.insert(
                uid,
                kruntimes_api::capacity::slots(&run.spec, runs_per_worker),
            );
        }
        admitted
    }
}

// ---------------------------------------------------------------------------------------
// The lifecycle

/// One reconcile of a session Run assigned to (and fenced for) this worker.
pub(crate) async fn reconcile(run: &Run, key: Key, context: &Context) -> Result<Action, Error> {
    if run.metadata.deletion_timestamp.is_some() {
        return finalize(run, &key, context).await;
    }
    match run.phase() {
        Phase::Scheduled => claim(run, key, context).await,
        Phase::Running => registering(run, key, context).await,
        Phase::Ready => serve(run, key, context).await,
        Phase::Finalizing => finalizing(run, key, context).await,
        Phase::Pending => Ok(Action::await_change()),
        // Written by this worker once its Snapshot is Ready ([`suspend`]), with the
        // assignment cleared: no longer this worker's to reconcile.
        Phase::Suspended => Ok(Action::await_change()),
        Phase::Succeeded | Phase::Failed | Phase::Timeout | Phase::Cancelled => {
            // Ended (possibly by another writer): nothing of it may stay here. A session
            // with a Workspace that is still open here (idle expiry ended it) commits first,
            // also when this process restarted since (the runtime server still holds it).
            if context.sessions.get(&key.uid).is_some()
                || context.sessions.registration(&key.uid).is_some()
                || awaits_idle_commit(run)
            {
                // The worker shuts down: the drain commits and closes such a session (a
                // commit here could be cut by the drain's close).
                if context.draining() && awaits_idle_commit(run) {
                    return Ok(Action::requeue(DRAINING_LOOK));
                }
                if let Some(wait) =
                    crate::sessions::workspaces::before_end(run, &key, context, "the Run ended")
                        .await?
                {
                    return Ok(wait);
                }
                close(context, &key, "the Run ended", true).await?;
            }
            context.sessions.forget_run(&key.uid);
            crate::sessions::snapshots::forget_local(context, &key.uid).await;
            Ok(Action::await_change())
        }
    }
}

/// Whether `run` is a session with a Workspace that idle expiry ended: the controller-manager
/// writes `Timeout/IdleTimeout` while the session is open here, and its files are still to
/// be committed while the runtime server holds it. Idle expiry ends only Ready Runs, so
/// that session was restored: it may be committed even when this process did not see it
/// through to Ready (it restarted since). Any other end was written after the commit, or
/// before the session was Ready.
pub(crate) fn awaits_idle_commit(run: &Run) -> bool {
    run.spec.workspace.is_some()
        && run.phase() == Phase::Timeout
        && run.status.as_ref().and_then(|s| s.reason.as_deref())
            == Some(lifecycle::IDLE_TIMEOUT_REASON)
}

/// Whether the session of attempt `attempt` of Run `uid` is one whose Run, assigned here
/// at that attempt in the store now, [`awaits_idle_commit`]: the Run's reconcile commits
/// it and then closes it, so the collector leaves it.
fn awaits_idle_commit_now(context: &Context, uid: &str, attempt: u32) -> bool {
    context.assigned_runs().iter().any(|run| {
        run.uid().as_deref() == Some(uid)
            && crate::tasks::executions::fenced_attempt(run.status.as_ref()) == attempt
            && awaits_idle_commit(run)
    })
}

fn wants(run: &Run, mode: TerminationMode) -> bool {
    run.spec.termination.as_ref().map(|t| t.mode) == Some(mode)
}

/// Scheduled: through the gate, add the finalizer, write Running, then register.
async fn claim(run: &Run, key: Key, context: &Context) -> Result<Action, Error> {
    if wants(run, TerminationMode::Immediate) || wants(run, TerminationMode::Drain) {
        // A registration an earlier claim started may exist: close it too.
        return stop(
            run,
            &key,
            context,
            Phase::Cancelled,
            "Cancelled",
            "termination was requested before the session was registered",
        )
        .await;
    }
    // The gate records what it lets through, so it is held for the decision only, not
    // across the claim's API writes: a claim of another Run checks against this one.
    let admitted = context.sessions.gate.lock().await.admit(
        run,
        &context.assigned_runs(),
        context.runs_per_worker(),
    );
    if !admitted {
        debug!(run = %run.name_any(), "session waits: this worker has no room for it now");
        return Ok(Action::requeue(GATE_RETRY));
    }
    let Some(run) = add_finalizer(run, context).await? else {
        return Ok(Action::await_change());
    };
    // Prepare the session while the claim is written: the background registration never
    // touches the Run, and the reconcile after the claim consumes its result.
    if context.sessions_supported
        && !matches!(
            context.sessions.registration(&key.uid),
            Some(Registration::InFlight(attempt)) if attempt == key.attempt
        )
    {
        start_registration(&run, &key, context).await;
    }
    let Some(claimed) = write_claim(&run, &key, context).await? else {
        return Ok(Action::await_change());
    };
    debug!(run = %claimed.name_any(), attempt = key.attempt, "session Run claimed");
    registering(&claimed, key, context).await
}

/// A duration in seconds for a message: `300s`, `1.5s`.
fn seconds(duration: Duration) -> String {
    format!("{}s", duration.as_secs_f64())
}

/// The end a termination request or `spec.timeout` imposes now, if any: (phase, reason,
/// message). `before_ready`: a Drain before Ready has nothing to drain and cancels too.
fn imposed_end(run: &Run, before_ready: bool) -> Option<(Phase, &'static str, String)> {
    if wants(run, TerminationMode::Immediate)
        || (before_ready && wants(run, TerminationMode::Drain))
    {
        let message = if before_ready {
            "termination was requested before the session was Ready"
        } else {
            "termination Immediate was requested"
        };
        return Some((Phase::Cancelled, "Cancelled", message.to_string()));
    }
    if deadline(run).is_some_and(|left| left.is_zero()) {
        let message = format!(
            "held its worker longer than its spec.timeout of {}",
            run.spec.timeout.as_deref().unwrap_or_default()
        );
        return Some((Phase::Timeout, "Timeout", message));
    }
    None
}

/// Running: drive the registration through the runtime server's view of it.
async fn registering(run: &Run, key: Key, context: &Context) -> Result<Action, Error> {
    if let Some((phase, reason, message)) = imposed_end(run, true) {
        return stop(run, &key, context, phase, reason, &message).await;
    }
    if !context.sessions_supported {
        return stop(
            run,
            &key,
            context,
            Phase::Failed,
            "CapabilityMismatch",
            "this Runtime's runtime server does not implement SessionRuntime",
        )
        .await;
    }
    // At most: wait for a registration in flight, find it READY; or find nothing, start
    // one, wait for it, find it READY.
    for _ in 0..3 {
        match context.sessions.registration(&key.uid) {
            Some(Registration::InFlight(attempt)) if attempt == key.attempt => {
                // Started by an earlier reconcile: wait a moment for it, then look again.
                let notified = context.sessions.registered.notified();
                if matches!(
                    context.sessions.registration(&key.uid),
                    Some(Registration::InFlight(_))
                ) {
                    let _ = tokio::time::timeout(REGISTRATION_WAIT, notified).await;
                }
                if matches!(
                    context.sessions.registration(&key.uid),
                    Some(Registration::InFlight(_))
                ) {
                    return Ok(Action::requeue(REGISTRATION_WAIT));
                }
                continue;
            }
            Some(Registration::Failed {
                attempt,
                kind,
                message,
            }) if attempt == key.attempt => {
                context.sessions.set_registration(&key.uid, None);
                return match kind {
                    Failure::Invalid => {
                        stop(run, &key, context, Phase::Failed, "InvalidSpec", &message).await
                    }
                    Failure::SnapshotInvalid => {
                        let message =
                            format!("the session's snapshot cannot be restored: {message}");
                        stop(
                            run,
                            &key,
                            context,
                            Phase::Failed,
                            "SnapshotInvalid",
                            &message,
                        )
                        .await
                    }
                    Failure::RestoreLater => {
                        // The store could not be read: a fresh registration later, the
                        // same attempt (not a failure of the Run).
                        warn!(run = %run.name_any(), error = %message, "snapshot restore failed; registering again later");
                        close(context, &key, &message, true).await?;
                        Ok(Action::requeue(RESTORE_RETRY))
                    }
                    Failure::Register => {
                        retry(run, &key, context, "RegistrationFailed", &message).await
                    }
                };
            }
            _ => {}
        }
        let status = session_status(context, &key).await?;
        match status.state() {
            rs::SessionState::Ready => {
                // A session with a Workspace restores its head (or is marked restored with
                // nothing to restore): one registered but never seen through that here
                // must not be served, nor committed over the head.
                if (restore_source(run).is_some() || run.spec.workspace.is_some())
                    && !context.sessions.was_restored(&key.uid, key.attempt)
                {
                    // Registered but not restored here (runtimed restarted mid-way):
                    // register afresh, and restore.
                    close(context, &key, "the resumed session was not restored", true).await?;
                    start_registration(run, &key, context).await;
                    continue;
                }
                adopt(run, &key, context, true);
                return publish_ready(run, context).await;
            }
            rs::SessionState::NotFound => {
                start_registration(run, &key, context).await;
                continue;
            }
            rs::SessionState::Registering => return Ok(Action::requeue(REGISTRATION_WAIT)),
            rs::SessionState::Failed
            | rs::SessionState::Closed
            | rs::SessionState::Closing
            | rs::SessionState::Unspecified => {
                let message = format!(
                    "the runtime server reports the session {:?} ({}: {})",
                    status.state(),
                    status.reason,
                    status.message
                );
                return retry(run, &key, context, "RegistrationFailed", &message).await;
            }
        }
    }
    Ok(Action::requeue(REGISTRATION_WAIT))
}

async fn session_status(context: &Context, key: &Key) -> Result<rs::SessionStatus, Error> {
    context
        .session_client
        .clone()
        .get_session_status(rs::GetSessionStatusRequest { id: Some(key.id()) })
        .await
        .map(tonic::Response::into_inner)
        .map_err(|status| Error::RuntimeServer {
            call: "GetSessionStatus",
            status,
        })
}

/// The files that initialise the workspace: the inline source and the artifact inputs.
async fn initial_files(run: &Run, context: &Context) -> Result<Vec<rs::SourceFile>, String> {
    let mut files = Vec::new();
    if let Some(inline) = run.spec.source.as_ref().and_then(|s| s.inline.as_ref()) {
        let name = if context.adapter == "python" {
            "main.py"
        } else {
            "main.sh"
        };
        files.push(rs::SourceFile {
            path: name.to_string(),
            content: inline.clone().into_bytes(),
            executable: false,
        });
    }
    if run.spec.artifact_inputs.is_empty() {
        return Ok(files);
    }
    let store = context
        .artifact_store()
        .await
        .map_err(|e| format!("reading the Runtime's ArtifactStore: {e}"))?
        .ok_or_else(|| "spec.artifactInputs needs a Runtime with an artifactStore".to_string())?;
    let read = store
        .read_inputs(&run.spec.artifact_inputs)
        .await
        .map_err(|e| e.to_string())?;
    files.extend(read.into_iter().map(|(path, content)| rs::SourceFile {
        path,
        content,
        executable: false,
    }));
    Ok(files)
}

/// Starts `RegisterSession` in the background. The task records its result in
/// [`Sessions`] and requeues the Run; it never touches the Run object.
async fn start_registration(run: &Run, key: &Key, context: &Context) {
    // Held until RegisterSession answers, so that a drain closes only what was registered
    // (or finds nothing started): none once shutdown began.
    let Some(pass) = context.claims.join(&run.name_any()) else {
        return;
    };
    let files = match initial_files(run, context).await {
        Ok(files) => files,
        Err(message) => {
            context.sessions.set_registration(
                &key.uid,
                Some(Registration::Failed {
                    attempt: key.attempt,
                    kind: Failure::Invalid,
                    message,
                }),
            );
            return;
        }
    };
    // A resume or a fork reads its Snapshot while the session registers (the restore needs
    // both).
    // A session with a Workspace is made its holder while it registers, and restores the
    // Workspace's head (or, resumed, its own suspend Snapshot).
    let source = restore_source(run);
    let workspace = match &run.spec.workspace {
        Some(_) => Some((
            Api::<kruntimes_api::Workspace>::namespaced(context.client.clone(), &context.namespace),
            crate::sessions::snapshots::StoreSource::of(context),
        )),
        _ => None,
    };
    let resume = (source.is_some() || workspace.is_some()).then(|| {
        (
            run.clone(),
            Api::<Snapshot>::namespaced(context.client.clone(), &context.namespace),
            context.session_limits.max_file_bytes,
        )
    });
    // The local copy of a head is another Run's (never this one's): the restore reads the
    // store.
    let restore_env = source
        .as_ref()
        .map(|snapshot| snapshot.name.as_str())
        .or(run.spec.workspace.as_ref().map(|w| w.name.as_str()))
        .map(|snapshot| crate::sessions::snapshots::RestoreEnv::of(context, &key.uid, snapshot));
    let (_, env) = crate::reconcile::source_and_env(run, "");
    let request = rs::RegisterSessionRequest {
        id: Some(key.id()),
        files,
        env,
    };
    context
        .sessions
        .set_registration(&key.uid, Some(Registration::InFlight(key.attempt)));
    let client = context.session_client.clone();
    let sessions = context.sessions.clone();
    let requeue = context.requeue.clone();
    let reference =
        kube::runtime::reflector::ObjectRef::new(&run.name_any()).within(&context.namespace);
    let metrics = context.metrics.clone();
    let key = key.clone();
    tokio::spawn(async move {
        let started = Instant::now();
        let mut call = Request::new(request);
        call.set_timeout(REGISTRATION_TIMEOUT);
        let planning = async {
            match (&resume, &workspace) {
                (Some((run, snapshots, _)), Some((workspaces, store))) => {
                    crate::sessions::workspaces::plan(run, &key, workspaces, snapshots, store).await
                }
                (Some((run, snapshots, _)), None) => resume_plan(run, snapshots).await,
                (None, _) => Ok(None),
            }
        };
        let mut registering = client.clone();
        let (registered, plan) = tokio::join!(registering.register_session(call), planning);
        let mut result = registered.map(|_| ());
        debug!(run_uid = %key.uid, register_ms = started.elapsed().as_secs_f64() * 1e3, "session registered");
        let mut failure = Failure::Register;
        let plan = match plan {
            Ok(plan) => plan,
            Err((kind, message)) => {
                // Registered for nothing: the reconcile that reads this failure closes it.
                if result.is_ok() {
                    failure = kind;
                    result = Err(Status::failed_precondition(message));
                }
                None
            }
        };
        if result.is_ok() && plan.is_none() && workspace.is_some() {
            // A Workspace with nothing to restore: the session is as it should be.
            sessions.mark_restored(&key.uid, key.attempt);
        }
        if result.is_ok()
            && let Some(((plan, env), (_, _, restore_bytes))) =
                plan.as_ref().zip(restore_env.as_ref()).zip(resume.as_ref())
        {
            // A resume: the snapshot goes into the freshly registered session before
            // anything can see it READY here (the marker stays InFlight until then).
            match crate::sessions::snapshots::restore(env, &key, plan, *restore_bytes).await {
                Ok(_) => sessions.mark_restored(&key.uid, key.attempt),
                Err(crate::sessions::snapshots::RestoreError::Invalid(message)) => {
                    failure = Failure::SnapshotInvalid;
                    result = Err(Status::invalid_argument(message));
                }
                Err(crate::sessions::snapshots::RestoreError::Transport(message)) => {
                    failure = Failure::RestoreLater;
                    result = Err(Status::unavailable(message));
                }
            }
        }
        // Only this attempt's marker is this task's to replace (a newer attempt, or a close
        // that cleared it, wins).
        let current = matches!(
            sessions.registration(&key.uid),
            Some(Registration::InFlight(attempt)) if attempt == key.attempt
        );
        match result {
            Ok(_) => {
                metrics.registration(Some(started.elapsed().as_secs_f64()));
                if current {
                    sessions.set_registration(&key.uid, None);
                }
            }
            Err(_) if !current => metrics.registration(None),
            Err(status) => {
                metrics.registration(None);
                warn!(run_uid = %key.uid, attempt = key.attempt, error = %status, "session registration failed");
                let kind = if failure == Failure::Register && status.code() == Code::InvalidArgument
                {
                    Failure::Invalid
                } else {
                    failure
                };
                sessions.set_registration(
                    &key.uid,
                    Some(Registration::Failed {
                        attempt: key.attempt,
                        kind,
                        message: bounded_message(status.message()),
                    }),
                );
            }
        }
        let _ = requeue.try_send(reference);
        drop(pass);
    });
}

/// Whether the Run is a resumed session: suspended to a Snapshot, now a later incarnation.
fn is_resume(run: &Run) -> bool {
    run.status
        .as_ref()
        .is_some_and(|s| s.snapshot.is_some() && s.incarnation.unwrap_or(1) >= 2)
}

/// The Snapshot the session restores before it is Ready: a resume's `status.snapshot`,
/// else a fork's `spec.source.snapshot` (with the UID it pins), else none.
fn restore_source(run: &Run) -> Option<kruntimes_api::snapshot::ObjectReference> {
    if is_resume(run) {
        let name = run.status.as_ref()?.snapshot.as_ref()?.name.clone();
        // A fork created Suspended resumes from its source: the UID it pins still holds.
        let uid = run
            .spec
            .fork_source()
            .filter(|source| source.name == name)
            .and_then(|source| source.uid.clone());
        return Some(kruntimes_api::snapshot::ObjectReference { name, uid });
    }
    run.spec.source.as_ref()?.snapshot.clone()
}

/// What a resumed session or a fork restores: its Snapshot, read now. It must be Ready
/// (one still being captured is waited for) and, when the reference pins a UID, that
/// very object.
async fn resume_plan(
    run: &Run,
    api: &Api<Snapshot>,
) -> Result<Option<crate::sessions::snapshots::Plan>, (Failure, String)> {
    let Some(reference) = restore_source(run) else {
        return Ok(None);
    };
    plan_for(reference, api).await.map(Some)
}

/// What a restore from the Snapshot `reference` takes, read now: it must be Ready (one
/// still being captured is waited for) and, when the reference pins a UID, that very object.
async fn plan_for(
    reference: kruntimes_api::snapshot::ObjectReference,
    api: &Api<Snapshot>,
) -> Result<crate::sessions::snapshots::Plan, (Failure, String)> {
    let snapshot = match api.get_opt(&reference.name).await {
        Ok(Some(snapshot)) => snapshot,
        Ok(None) => {
            return Err((
                Failure::SnapshotInvalid,
                format!("the Snapshot {:?} does not exist", reference.name),
            ));
        }
        Err(e) => {
            return Err((
                Failure::RestoreLater,
                bounded_message(&format!("reading the Snapshot: {e}")),
            ));
        }
    };
    if !reference.matches(&snapshot.name_any(), snapshot.metadata.uid.as_deref()) {
        return Err((
            Failure::SnapshotInvalid,
            format!(
                "the Snapshot {:?} is not the one the Run pins (its UID changed: it was \
                 deleted and made again)",
                reference.name
            ),
        ));
    }
    let status = snapshot.status.clone().unwrap_or_default();
    match status.phase {
        Some(SnapshotPhase::Ready) | Some(SnapshotPhase::Failed) => {}
        None | Some(SnapshotPhase::Pending) | Some(SnapshotPhase::Capturing) => {
            return Err((
                Failure::RestoreLater,
                format!(
                    "the Snapshot {:?} is still being captured; the session waits for it",
                    reference.name
                ),
            ));
        }
    }
    let (Some(SnapshotPhase::Ready), Some(digest), Some(location)) = (
        status.phase,
        status.digest.clone().filter(|d| !d.is_empty()),
        status.location.clone(),
    ) else {
        return Err((
            Failure::SnapshotInvalid,
            format!(
                "the Snapshot {:?} is not Ready with a digest and a location",
                reference.name
            ),
        ));
    };
    Ok(crate::sessions::snapshots::Plan {
        snapshot: reference.name,
        digest,
        uri: location.uri,
    })
}

/// Makes sure the session has local state (after a registration, or after a restart of
/// runtimed found it READY on the runtime server) and its worker task runs.
fn adopt(run: &Run, key: &Key, context: &Context, accepting: bool) -> Arc<Session> {
    let mut map = context
        .sessions
        .map
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(existing) = map.get(&key.uid)
        && existing.fenced == key.attempt
    {
        return existing.clone();
    }
    let mode = run.spec.mode.session.clone().unwrap_or_default();
    let queue_size = mode
        .queue_size
        .and_then(|q| u32::try_from(q).ok())
        .unwrap_or(context.session_limits.max_queue)
        .min(context.session_limits.max_queue)
        .max(1);
    let operation_timeout = mode
        .operation_timeout
        .as_deref()
        .and_then(|t| kruntimes_api::duration::parse(t).ok())
        .unwrap_or(context.session_limits.max_operation_timeout)
        .min(context.session_limits.max_operation_timeout);
    let lease = mode
        .lease_timeout_seconds
        .and_then(|s| u64::try_from(s).ok())
        .map(|s| Duration::from_secs(s.max(1)));
    let auto_suspend_after = mode
        .auto_suspend_after
        .as_deref()
        .and_then(|t| kruntimes_api::duration::parse(t).ok())
        .filter(|after| !after.is_zero());
    let session = Arc::new(Session {
        uid: key.uid.clone(),
        name: run.name_any(),
        attempt: crate::tasks::executions::attempt_of(key.attempt),
        fenced: key.attempt,
        queue_size: usize::try_from(queue_size).unwrap_or(32),
        operation_timeout,
        lease,
        auto_suspend_after,
        last_heartbeat: Mutex::new(Instant::now()),
        inner: Mutex::new(Inner {
            accepting,
            // Quiet from the moment this owner takes it on.
            last_mutation: Some(Instant::now()),
            // A resumed session's sequence numbers continue after the snapshot's.
            sequence: is_resume(run)
                .then(|| run.status.as_ref()?.snapshot.as_ref()?.last_sequence)
                .flatten()
                .and_then(|n| u64::try_from(n).ok())
                .unwrap_or(0),
            ..Inner::default()
        }),
        changed: Notify::new(),
        activity: Mutex::new(Activity::default()),
        activity_interval: activity_interval(&mode, context.session_limits.activity_interval),
        // Taken on now, perhaps after a restart of runtimed with the status already near
        // its idle limit: quiet from the start, so the first mutation records before it is
        // accepted.
        created: Instant::now()
            .checked_sub(activity_interval(
                &mode,
                context.session_limits.activity_interval,
            ))
            .unwrap_or_else(Instant::now),
        admission_write: tokio::sync::Mutex::new(()),
        commit: Default::default(),
        wake: Some((
            context.requeue.clone(),
            kube::runtime::reflector::ObjectRef::new(&run.name_any()).within(&context.namespace),
        )),
    });
    map.insert(key.uid.clone(), session.clone());
    drop(map);
    tokio::spawn(work(session.clone(), WorkerContext::of(context, run)));
    session
}

/// The least time between two activity writes of a session: the worker's interval, and at
/// most a tenth of the Run's own `idleTimeout` (at least 100 ms), so a short idle timeout
/// is not outrun by its own clock's granularity.
fn activity_interval(mode: &kruntimes_api::run::SessionMode, worker: Duration) -> Duration {
    let own = mode
        .idle_timeout
        .as_deref()
        .and_then(|t| kruntimes_api::duration::parse(t).ok())
        .map(|t| (t / 10).max(Duration::from_millis(100)));
    own.map_or(worker, |own| own.min(worker))
}

/// The activity time `status.session.lastActivityTime` records.
fn recorded_activity(run: &Run) -> Option<Timestamp> {
    run.status
        .as_ref()?
        .session
        .as_ref()?
        .last_activity_time
        .as_deref()?
        .parse()
        .ok()
}

/// Writes the session's last mutation to `status.session.lastActivityTime` when it is
/// due, at most once per activity interval; when one waits for the interval, the time
/// to look again.
async fn record_activity(
    run: &Run,
    context: &Context,
    session: &Session,
) -> Result<Option<Duration>, Error> {
    // A running or queued operation is activity too: a busy session is never idle.
    if !session.idle() {
        session.touch();
    }
    match session.activity_write(recorded_activity(run)) {
        ActivityWrite::UpToDate => Ok(None),
        ActivityWrite::After(left) => Ok(Some(left)),
        ActivityWrite::Now(last) => {
            let mut recorded = run.clone();
            let status = recorded.status.get_or_insert_with(RunStatus::default);
            status
                .session
                .get_or_insert_with(Default::default)
                .last_activity_time = Some(last.to_string());
            let written = write_status(context, &recorded).await;
            if matches!(written, Ok(Some(_))) {
                session.activity_written();
                debug!(run = %run.name_any(), last = %last, "recorded the session's last activity");
            } else {
                // Not recorded (the Run changed meanwhile, perhaps it ended, or the write
                // failed): the next admission records before it accepts, and the next
                // reconcile decides.
                session.unclaim_write(None);
                session.touch();
            }
            written?;
            Ok(None)
        }
    }
}

/// How long the admission-time activity write may take.
const ADMISSION_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// Before a mutation (an operation, an upload) is accepted by a session that has been
/// quiet for an activity interval: writes `status.session.lastActivityTime` now,
/// conditionally on the Run as read afresh, and accepts only once that write landed.
///
/// The idle sweep of the controller-manager ends a Run with a write conditional on the
/// Run it read, so the API server lets exactly one of the two through: either the sweep
/// ended the session first (this write conflicts, the fresh read shows the end, and the
/// mutation is refused: never accepted, then cancelled), or the activity is recorded
/// first (the sweep's write conflicts, and it decides again on the fresh activity). A
/// session that wrote its activity within the interval is far from its idle limit (the
/// interval is a tenth of it, at most), so the common case costs nothing.
pub(crate) async fn record_before_mutation(
    context: &Context,
    session: &Session,
) -> Result<(), Status> {
    // One at a time, and every mutation waits for a write under way: one admitted beside
    // it would not be covered by it.
    let _one = session.admission_write.lock().await;
    let Some(previous) = session.claim_quiet_write() else {
        return Ok(());
    };
    // Released unless the write landed: also when this call is cancelled mid-way (its
    // caller's deadline), so a claim never outlives a write that did not happen.
    let mut claim = Claim {
        session,
        previous,
        landed: false,
    };
    write_activity_now(context, session).await?;
    claim.landed = true;
    Ok(())
}

/// A claimed admission-time write; dropped before it landed, it gives the claim back.
struct Claim<'a> {
    session: &'a Session,
    previous: Option<Instant>,
    landed: bool,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.landed {
            self.session.unclaim_write(self.previous);
        }
    }
}

/// The write of [`record_before_mutation`], once claimed.
async fn write_activity_now(context: &Context, session: &Session) -> Result<(), Status> {
    let api = Api::<Run>::namespaced(context.client.clone(), &context.namespace);
    let unavailable = |e: &dyn std::fmt::Display| {
        Status::unavailable(bounded_message(&format!(
            "cannot record the session's activity before accepting: {e}"
        )))
    };
    for _ in 0..3 {
        let run = match tokio::time::timeout(ADMISSION_WRITE_TIMEOUT, api.get(&session.name)).await
        {
            Ok(Ok(run)) => run,
            Ok(Err(error)) => return Err(unavailable(&error)),
            Err(elapsed) => return Err(unavailable(&elapsed)),
        };
        if run.uid().as_deref() != Some(session.uid.as_str()) || run.phase() != Phase::Ready {
            // Ended (or ending): nothing more is accepted, whoever asks next.
            session.stop_accepting();
            let reason = run
                .status
                .as_ref()
                .and_then(|s| s.reason.clone())
                .unwrap_or_default();
            return Err(Status::failed_precondition(bounded_message(&format!(
                "the session is {} ({reason}): it accepts no new work",
                run.phase()
            ))));
        }
        let now = Timestamp::now()
            .round(jiff::Unit::Microsecond)
            .unwrap_or_else(|_| Timestamp::now());
        let mut recorded = run.clone();
        recorded
            .status
            .get_or_insert_with(RunStatus::default)
            .session
            .get_or_insert_with(Default::default)
            .last_activity_time = Some(now.to_string());
        let params = kube::api::PostParams::default();
        let write = api.replace_status(&session.name, &params, &recorded);
        match tokio::time::timeout(ADMISSION_WRITE_TIMEOUT, write).await {
            Ok(Ok(_)) => {
                session.activity_written();
                debug!(run = %session.name, "recorded the session's activity before accepting");
                return Ok(());
            }
            Ok(Err(kube::Error::Api(status))) if status.code == 409 => continue,
            Ok(Err(error)) => return Err(unavailable(&error)),
            Err(elapsed) => return Err(unavailable(&elapsed)),
        }
    }
    Err(Status::unavailable(
        "the session's Run kept changing while its activity was recorded; try again",
    ))
}

/// Writes Ready: the endpoint and `Ready=True`.
async fn publish_ready(run: &Run, context: &Context) -> Result<Action, Error> {
    let uid = run.uid().unwrap_or_default();
    if let Some(session) = context.sessions.get(&uid) {
        // The lease counts from Ready.
        session.restart_lease();
    }
    if write_ready(run, context, lifecycle::session_url, REGISTERED_REASON).await? {
        info!(runtime = %run.spec.runtime, run = %run.name_any(), run_uid = %uid, "session Ready");
    }
    Ok(Action::requeue(next_look(run, context)))
}

/// When a Ready session must be looked at again: its lease, its timeout, its health.
fn next_look(run: &Run, context: &Context) -> Duration {
    let mut next = HEALTH_EVERY;
    if let Some(left) = deadline(run) {
        next = next.min(left);
    }
    if let Some(session) = run.uid().and_then(|uid| context.sessions.get(&uid)) {
        // The auto-suspend timer: the Run is requeued for the moment the session's quiet
        // time would reach `autoSuspendAfter` (a mutation meanwhile only moves it later).
        // A session whose admission stopped is being suspended: the end of its work
        // requeues the Run, and an expired lease would only spin the reconcile.
        let timers = [session.lease_left(), session.auto_suspend_left()];
        for left in timers.into_iter().flatten() {
            if session.accepting() {
                next = next.min(left);
            }
        }
    }
    next.max(Duration::from_millis(10))
}

/// Ready: enforce termination, timeout, lease and the runtime server's view.
async fn serve(run: &Run, key: Key, context: &Context) -> Result<Action, Error> {
    if let Some((phase, reason, message)) = imposed_end(run, false) {
        if let Some(wait) =
            crate::sessions::workspaces::before_end(run, &key, context, &message).await?
        {
            return Ok(wait);
        }
        return stop(run, &key, context, phase, reason, &message).await;
    }
    let session = match context.sessions.get(&key.uid) {
        Some(session) if session.fenced == key.attempt => session,
        _ => {
            // runtimed restarted: recover the registration if the runtime server holds it.
            let status = session_status(context, &key).await?;
            if status.state() != rs::SessionState::Ready {
                return stop(
                    run,
                    &key,
                    context,
                    Phase::Failed,
                    "SessionLost",
                    "the runtime server no longer holds the session; a Ready session is never moved",
                )
                .await;
            }
            info!(run = %run.name_any(), "recovered a Ready session after a restart");
            adopt(run, &key, context, true)
        }
    };
    let lease_expired = session.lease_left().is_some_and(|left| left.is_zero());
    if lease_expired && session.auto_suspend_after.is_none() {
        let message = format!(
            "no heartbeat for {}s (leaseTimeoutSeconds)",
            session.lease.map_or(0, |l| l.as_secs())
        );
        if let Some(wait) =
            crate::sessions::workspaces::before_end(run, &key, context, &message).await?
        {
            return Ok(wait);
        }
        return stop(run, &key, context, Phase::Timeout, "LeaseExpired", &message).await;
    }
    // The runtime server may have lost it (it restarted): a Ready session never moves.
    let on_server = session_status(context, &key).await?;
    if on_server.state() != rs::SessionState::Ready {
        let message = format!(
            "the runtime server no longer holds the session ({:?}); a Ready session is never moved",
            on_server.state()
        );
        return stop(run, &key, context, Phase::Failed, "SessionLost", &message).await;
    }
    if context.draining() {
        // The worker shuts down: the drain owns its Ready sessions now (it suspends or
        // closes them). A suspend started here would race the drain's capture of the same
        // Snapshot, and a withdrawn suspend would let admission resume under the capture.
        return Ok(Action::requeue(next_look(run, context)));
    }
    // Checkpoints asked for since the last look queue behind the operations accepted so far.
    crate::sessions::checkpoints::take(run, &key, context, &session);
    if !run.spec.suspend_requested()
        && run.spec.termination.is_none()
        && (lease_expired || session.auto_suspend_left() == Some(Duration::ZERO))
        && let Some(action) = auto_suspend(run, context, &session, lease_expired).await?
    {
        return Ok(action);
    }
    if run.spec.suspend_requested() && !wants(run, TerminationMode::Drain) {
        return suspend(run, key, context, &session).await;
    }
    if !run.spec.suspend_requested() {
        context.sessions.clear_retry(&key.uid, Retry::Suspend);
        if run.spec.termination.is_none() {
            // A suspend that was asked for and withdrawn (while accepted operations
            // finished, or before its Suspended write landed) stopped admission: the
            // session serves again.
            session.start_accepting();
        }
    }
    if wants(run, TerminationMode::Drain) {
        session.stop_accepting();
        let mut finalizing = run.clone();
        let generation = finalizing.meta().generation;
        let status = finalizing.status.get_or_insert_with(RunStatus::default);
        status.phase = Some(Phase::Finalizing);
        lifecycle::leave_ready(
            &run.spec,
            status,
            "Draining",
            "termination Drain: accepted operations finish, then artifacts are exported",
            generation,
        );
        return match write_status(context, &finalizing).await? {
            Some(written) => finalizing_step(&written, key, context, &session).await,
            None => Ok(Action::await_change()),
        };
    }
    let next = next_look(run, context);
    Ok(match record_activity(run, context, &session).await? {
        Some(left) => Action::requeue(next.min(left.max(Duration::from_millis(10)))),
        None => Action::requeue(next),
    })
}

/// Ready with `spec.suspend: true` (and no termination): admission stops, accepted
/// operations finish (the worker requeues the Run when the queue is empty), then the
/// session's files are captured at this operation boundary into the Snapshot
/// `suspend_snapshot_name(run, incarnation)`: a local copy on this worker, then the store
/// ([`crate::sessions::snapshots`]), the Snapshot Ready; only then the Run is written Suspended (on a
/// fresh read, still this incarnation, still Ready, still asked to suspend, no
/// termination), and only once that write landed the session is purged here. A store
/// failure keeps the session serving (`Suspended=False/SnapshotRetrying`) and captures again
/// after a backoff ([`suspend_retry_delay`]); without any store it serves on (`Suspended=False/NoSnapshotStore`).
async fn suspend(
    run: &Run,
    key: Key,
    context: &Context,
    session: &Arc<Session>,
) -> Result<Action, Error> {
    if let Some(left) = context.sessions.backoff(&key.uid, Retry::Suspend) {
        // The last try failed: the session serves until the next.
        session.start_accepting();
        return Ok(Action::requeue(left.min(next_look(run, context))));
    }
    let store = match crate::sessions::snapshots::store(context).await {
        Ok(Some(store)) => store,
        Ok(None) => {
            session.start_accepting();
            suspend_condition(
                run,
                context,
                lifecycle::NO_SNAPSHOT_STORE_REASON,
                "cannot suspend: the Runtime names no artifactStore and this worker has no \
                 --snapshot-dir; the session keeps serving",
            )
            .await?;
            return Ok(Action::requeue(next_look(run, context)));
        }
        Err(e) => return suspend_retrying(run, &key, context, session, &e.to_string()).await,
    };
    session.stop_accepting();
    if !session.idle() {
        // The worker requeues the Run when the queue is empty.
        return Ok(Action::requeue(next_look(run, context)));
    }
    let started = Instant::now();
    let incarnation = crate::tasks::executions::incarnation_of(key.attempt);
    let name =
        kruntimes_api::snapshot::suspend_snapshot_name(&run.name_any(), u64::from(incarnation));
    let (_, _, last_sequence) = session.snapshot();
    let Stored {
        uri: stored,
        digest,
        ..
    } = match capture_and_store(
        run,
        &key,
        context,
        &Making::suspend(run, &name),
        store.as_ref(),
        last_sequence,
        incarnation,
    )
    .await
    {
        Ok(uri) => uri,
        Err(message) => return suspend_retrying(run, &key, context, session, &message).await,
    };
    // The write is conditional on the resourceVersion of the Run this reconcile started
    // from, which was Ready, of this incarnation, asked to suspend and without termination:
    // it lands only if none of that changed meanwhile (a termination, a resume, a later
    // incarnation). Otherwise the next reconcile decides on the Run as it is then, and
    // reuses the Ready Snapshot when nothing ran since. Reading the Run again here would
    // cost a round trip to the API server on every suspend and decide nothing more.
    if run.spec.termination.is_some()
        || crate::tasks::executions::fenced_attempt(run.status.as_ref()) != key.attempt
    {
        return Ok(Action::requeue(Duration::from_millis(10)));
    }
    let mut suspended = suspended_to(run, &name, stored, last_sequence);
    let endpoint = run.status.as_ref().and_then(|s| s.endpoint.clone());
    let status = suspended.status.get_or_insert_with(RunStatus::default);
    if lifecycle::auto_suspended(run) {
        // The gateway's address of the session, where the next call wakes it: a client
        // that only reads the Run knows where to call (the resume clears it until Ready).
        status.endpoint = endpoint;
    }
    // From the Suspended write to the close, the close is this suspend's (it parks).
    let _suspending = context.sessions.begin_suspending(&key.uid);
    if write_status(context, &suspended).await?.is_none() {
        // It changed meanwhile: the next reconcile decides again (the Ready Snapshot is
        // reused when nothing ran since).
        return Ok(Action::requeue(Duration::from_millis(10)));
    }
    let written_ms = started.elapsed().as_secs_f64() * 1e3;
    // Its files stay on the runtime server (parked, when they are exactly the capture's),
    // so a resume here moves them back instead of extracting the snapshot.
    close_parking(context, &key, "the session was suspended", &digest).await?;
    info!(
        run = %run.name_any(),
        snapshot = %name,
        last_sequence,
        written_ms,
        closed_ms = started.elapsed().as_secs_f64() * 1e3,
        "session suspended"
    );
    context.sessions.clear_retry(&key.uid, Retry::Suspend);
    Ok(Action::await_change())
}

/// `fresh` as [`suspend`] and [`suspend_for_shutdown`] write it: Suspended to Snapshot
/// `name`, stored at `uri`, after operation `last_sequence`.
fn suspended_to(fresh: &Run, name: &str, uri: String, last_sequence: u64) -> Run {
    let mut suspended = fresh.clone();
    let generation = suspended.meta().generation;
    let spec = suspended.spec.clone();
    lifecycle::record_suspend(
        &spec,
        suspended.status.get_or_insert_with(RunStatus::default),
        kruntimes_api::run::RunSnapshotRef {
            name: name.to_string(),
            uri: Some(uri),
            last_sequence: i64::try_from(last_sequence).ok(),
        },
        generation,
    );
    suspended
}

/// How many times a shutdown's suspend reads the Run again after a conflicting write.
const SHUTDOWN_WRITE_TRIES: usize = 3;
/// How often a shutdown's suspend looks whether the session's accepted work finished.
const SHUTDOWN_IDLE_POLL: Duration = Duration::from_millis(20);

/// Suspends the Ready session `run` because its worker shuts down (the drain): admission
/// stops, accepted operations and uploads finish, the files are captured and stored as a
/// user's suspend does, and the Run is written Suspended (conditional on a fresh read of the
/// same incarnation, still Ready, with no termination) with `Suspended=True/WorkerShutdown`
/// and `spec.suspend` left as the user set it: unless the user asked for the suspend, the
/// controller resumes the session on the next ready worker (another one now, or the next
/// start's), so a restart costs it only time. Then the session is purged here.
///
/// `Ok(false)`: nothing to do here (not this incarnation's session, no snapshot store);
/// `Err`: it could not be suspended, and the drain closes it as before. The caller bounds
/// the time.
pub(crate) async fn suspend_for_shutdown(
    context: &Context,
    run: &Run,
    key: &Key,
) -> Result<bool, String> {
    let Some(session) = context
        .sessions
        .get(&key.uid)
        .filter(|s| s.fenced == key.attempt)
    else {
        return Ok(false);
    };
    let store = match crate::sessions::snapshots::store(context).await {
        Ok(Some(store)) => store,
        Ok(None) => return Ok(false),
        Err(e) => return Err(e.to_string()),
    };
    session.stop_accepting();
    while !session.idle() {
        tokio::time::sleep(SHUTDOWN_IDLE_POLL).await;
    }
    let incarnation = crate::tasks::executions::incarnation_of(key.attempt);
    let name =
        kruntimes_api::snapshot::suspend_snapshot_name(&run.name_any(), u64::from(incarnation));
    let (_, _, last_sequence) = session.snapshot();
    let Stored { uri: stored, .. } = capture_and_store(
        run,
        key,
        context,
        &Making::suspend(run, &name),
        store.as_ref(),
        last_sequence,
        incarnation,
    )
    .await?;
    let mut tries = 0;
    loop {
        tries += 1;
        if tries > SHUTDOWN_WRITE_TRIES {
            return Err("the Run kept changing before it was written Suspended".to_string());
        }
        let fresh = context
            .api()
            .get_opt(&run.name_any())
            .await
            .map_err(|e| bounded_message(&format!("reading the Run: {e}")))?
            .ok_or("the Run is gone")?;
        if fresh.uid() != run.uid()
            || fresh.phase() != Phase::Ready
            || crate::tasks::executions::fenced_attempt(fresh.status.as_ref()) != key.attempt
            || fresh.spec.termination.is_some()
            || fresh.metadata.deletion_timestamp.is_some()
        {
            return Err("the Run changed during the capture".to_string());
        }
        let mut suspended = suspended_to(&fresh, &name, stored.clone(), last_sequence);
        let generation = suspended.meta().generation;
        let status = suspended.status.get_or_insert_with(RunStatus::default);
        let message = if fresh.spec.suspend_requested() {
            format!("suspended to Snapshot {name} as asked, as its worker shut down")
        } else {
            format!(
                "its worker shut down: suspended to Snapshot {name}, resumed on the next ready worker"
            )
        };
        status.message = Some(bounded_message(&message));
        lifecycle::set_condition(
            &mut status.conditions,
            kruntimes_api::run::RunCondition {
                type_: lifecycle::SUSPENDED_CONDITION.to_string(),
                status: "True".to_string(),
                reason: Some(crate::drain::SHUTDOWN_REASON.to_string()),
                message: Some(bounded_message(&message)),
                last_transition_time: Some(now_rfc3339()),
                observed_generation: generation,
            },
        );
        match write_status(context, &suspended).await {
            Ok(Some(_)) => break,
            // Another write landed (a wake, an annotation): read again and decide again.
            Ok(None) => continue,
            Err(e) => return Err(bounded_message(&e.to_string())),
        }
    }
    info!(run = %run.name_any(), snapshot = %name, last_sequence, "session suspended: its worker shuts down");
    context.sessions.clear_retry(&key.uid, Retry::Suspend);
    // Suspended is written: a failed purge leaves only files the worker's next start
    // removes, never a second owner.
    if let Err(e) = close(
        context,
        key,
        "the worker shut down; the session was suspended",
        true,
    )
    .await
    {
        warn!(run = %run.name_any(), error = %e, "drain: purging a suspended session failed");
    }
    Ok(true)
}

/// How many times an auto-suspend's conditional write is tried against a Run that keeps
/// changing (status writes of its own owner, mostly) before the next reconcile decides.
const AUTO_SUSPEND_WRITES: usize = 3;

/// Suspends the Ready session on its owner's own decision: it has been quiet for
/// `autoSuspendAfter` (`lease` false), or its lease expired with auto-suspend set
/// (`lease` true, instead of ending it Timeout).
///
/// In one step under the session's lock the idleness is checked again and admission stops
/// ([`Session::stop_for_auto_suspend`]); then `spec.suspend: true` and the
/// [`lifecycle::AUTO_SUSPENDED_ANNOTATION`] marker (the Run's incarnation) are written in
/// one update conditional on the resourceVersion of a fresh read, only while that read
/// still shows this incarnation Ready, unsuspended and not terminating. The suspend
/// ([`suspend`]) then captures as for an explicit one. When the recheck fails nothing
/// changed (`None`: the caller goes on serving); when the write does not land, admission
/// reopens.
async fn auto_suspend(
    run: &Run,
    context: &Context,
    session: &Session,
    lease: bool,
) -> Result<Option<Action>, Error> {
    if !session.stop_for_auto_suspend(lease) {
        return Ok(None);
    }
    let api = context.api();
    let name = run.name_any();
    for _ in 0..AUTO_SUSPEND_WRITES {
        let fresh = match api.get_opt(&name).await {
            Ok(Some(fresh)) => fresh,
            Ok(None) => return Ok(Some(Action::await_change())),
            Err(source) => {
                session.start_accepting();
                return Err(Error::WriteStatus {
                    namespace: context.namespace.clone(),
                    name,
                    source,
                });
            }
        };
        if fresh.uid() != run.uid()
            || fresh.phase() != Phase::Ready
            || crate::tasks::executions::fenced_attempt(fresh.status.as_ref()) != session.fenced
            || fresh.spec.suspend_requested()
            || fresh.spec.termination.is_some()
        {
            // Asked to suspend, or to end, meanwhile: that decides, on the next reconcile
            // (a suspend of the user's refuses new work as its own, 409).
            if fresh.spec.suspend_requested() {
                session.lock().auto_suspending = false;
            } else {
                session.start_accepting();
            }
            return Ok(Some(Action::requeue(Duration::from_millis(10))));
        }
        let mut marked = fresh.clone();
        marked.spec.suspend = Some(true);
        marked.annotations_mut().insert(
            lifecycle::AUTO_SUSPENDED_ANNOTATION.to_string(),
            fresh.incarnation().to_string(),
        );
        // Conditional: `marked` carries the resourceVersion of `fresh`.
        match api.replace(&name, &Default::default(), &marked).await {
            Ok(_) => {
                let cause = if lease { "lease" } else { "idle" };
                context.metrics.auto_suspend(cause);
                info!(run = %name, cause, "session suspended by its owner (autoSuspendAfter)");
                return Ok(Some(Action::requeue(Duration::from_millis(10))));
            }
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(source) => {
                session.start_accepting();
                return Err(Error::WriteStatus {
                    namespace: context.namespace.clone(),
                    name,
                    source,
                });
            }
        }
    }
    session.start_accepting();
    Ok(Some(Action::requeue(Duration::from_millis(10))))
}

/// The Snapshot object of a suspend, its capture, its store; returns the blob's URI and
/// the archive's digest.
/// The Snapshot [`capture_and_store`] makes: its object as created (name, reason, owner,
/// labels).
pub(crate) struct Making(Snapshot);

impl Making {
    /// A suspend Snapshot, pinned to its Run's UID. It has no owner reference: the
    /// controller-manager deletes it once neither the Run nor a fork needs it.
    fn suspend(run: &Run, name: &str) -> Making {
        Making(Snapshot::new(
            name,
            SnapshotSpec {
                source: kruntimes_api::snapshot::SnapshotSource {
                    run: kruntimes_api::snapshot::ObjectReference::of(run),
                },
                reason: Some(SnapshotReason::Suspend),
            },
        ))
    }

    /// The commit `name` of Workspace `workspace` (the object as read) from session `run`.
    pub(crate) fn commit(workspace: &kruntimes_api::Workspace, run: &Run, name: &str) -> Making {
        Making(kruntimes_api::workspace::commit_snapshot(
            workspace,
            name,
            kruntimes_api::snapshot::ObjectReference::of(run),
        ))
    }

    fn name(&self) -> &str {
        self.0.metadata.name.as_deref().unwrap_or_default()
    }

    fn reason(&self) -> SnapshotReason {
        self.0.spec.reason.unwrap_or_default()
    }
}

/// The name of a Run of the namespace that has not ended and starts from the Snapshot
/// `name` (read now).
async fn fork_of_snapshot(context: &Context, name: &str) -> Result<Option<String>, kube::Error> {
    let runs = kruntimes_api::paging::list_all(&context.api(), &Default::default()).await?;
    Ok(kruntimes_api::snapshot::fork_of(name, &runs).map(ResourceExt::name_any))
}

/// A Snapshot [`capture_and_store`] wrote Ready.
pub(crate) struct Stored {
    /// Where its archive is.
    pub(crate) uri: String,
    /// The archive's digest.
    pub(crate) digest: String,
    /// The Snapshot object's UID.
    pub(crate) uid: Option<String>,
}

/// Captures the session's files (its queue empty, admission stopped) into the Snapshot
/// that `making` says, stores them and writes the Snapshot Ready. An earlier try's Ready
/// Snapshot of this Run with the same last operation is reused.
pub(crate) async fn capture_and_store(
    run: &Run,
    key: &Key,
    context: &Context,
    making: &Making,
    store: &dyn crate::artifacts::ArtifactStore,
    last_sequence: u64,
    incarnation: u32,
) -> Result<Stored, String> {
    let started = Instant::now();
    let name = making.name();
    let api = Api::<Snapshot>::namespaced(context.client.clone(), &context.namespace);
    let api_error = |e: kube::Error| bounded_message(&format!("writing the Snapshot: {e}"));
    // At most: create; or find an earlier try's object, and create again once it is
    // deleted (final, or another Run's) or gone.
    let mut object = None;
    for _ in 0..3 {
        if let Some(created) = create_snapshot(&api, making).await.map_err(api_error)? {
            object = Some(created);
            break;
        }
        let Some(existing) = api.get_opt(name).await.map_err(api_error)? else {
            // Deleted since the create found it: create again.
            continue;
        };
        // A Snapshot of this name made for another Run is a deleted Run's of the same name
        // and incarnation, which the controller-manager has not deleted yet (or keeps for
        // a fork): never this Run's files.
        let ours = existing.spec.reason == Some(making.reason())
            && existing.spec.source.run.uid.is_some()
            && existing.spec.source.run.uid == run.metadata.uid;
        let status = existing.status.clone().unwrap_or_default();
        if ours
            && existing.phase() == SnapshotPhase::Ready
            && status.last_sequence == i64::try_from(last_sequence).ok()
            && let Some(location) = status.location
        {
            // An earlier try of this suspend got this far, and nothing ran since.
            return Ok(Stored {
                uri: location.uri,
                digest: status.digest.unwrap_or_default(),
                uid: existing.metadata.uid.clone(),
            });
        }
        if ours && !existing.phase().is_terminal() {
            object = Some(existing);
            break;
        }
        // A user's checkpoint that took this name is never deleted for a suspend or a
        // commit.
        if existing.spec.reason.unwrap_or_default() != making.reason() {
            return Err(format!(
                "the checkpoint {name} holds the name of this {}'s Snapshot; delete or \
                 rename it",
                if making.reason() == SnapshotReason::Commit {
                    "commit"
                } else {
                    "suspend"
                }
            ));
        }
        // Ready and Failed are final, and another Run's is not ours: a new capture is a
        // new object, unless a fork still starts from this one (a deleted Run's of the
        // same name outlives it for its forks): then this capture waits for the fork.
        if let Some(fork) = fork_of_snapshot(context, name).await.map_err(api_error)? {
            let what = if making.reason() == SnapshotReason::Commit {
                "commit"
            } else {
                "suspend"
            };
            return Err(format!(
                "the Snapshot {name}, which this {what} would replace, is the source of the \
                 fork {fork}, which has not ended: this {what} waits until it ends or is \
                 deleted"
            ));
        }
        // Only the object decided on: one changed or made again meanwhile is looked at
        // again.
        let exactly = kube::api::DeleteParams {
            preconditions: Some(kube::api::Preconditions {
                uid: existing.metadata.uid.clone(),
                resource_version: existing.metadata.resource_version.clone(),
            }),
            ..Default::default()
        };
        match api.delete(name, &exactly).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {}
            Err(e) => return Err(api_error(e)),
        }
    }
    let Some(object) = object else {
        return Err(format!(
            "the Snapshot {name} kept being replaced while it was made; trying again"
        ));
    };
    let mut capturing = object;
    capturing.status = Some(SnapshotStatus {
        phase: Some(SnapshotPhase::Capturing),
        incarnation: Some(i64::from(incarnation)),
        ..SnapshotStatus::default()
    });
    // The Capturing write and the capture go on together: the files are quiescent (the
    // queue is empty and admission stopped), and nothing is stored before both are done.
    let capturing_at = started.elapsed();
    let post = kube::api::PostParams::default();
    // The Capturing write goes on beside the capture and the store (an API write waits for
    // the server's commit to reach the disk, as the store's copy does): the Ready write
    // needs it landed, and nothing is Ready before both are done.
    let namespace = run.namespace().unwrap_or_default();
    // Keyed by the object's UID, as a checkpoint is: the data of an earlier Snapshot of
    // this name (a deleted Run's of the same name) is never overwritten, so the
    // controller-manager's collector can never delete this capture for being that one's.
    let Some(uid) = capturing.metadata.uid.clone() else {
        return Err(format!("the Snapshot {name} has no UID"));
    };
    let stored_name = format!("{name}/{uid}");
    let (capturing, captured) = tokio::join!(api.replace_status(name, &post, &capturing), async {
        let captured = crate::sessions::snapshots::capture(
            context,
            key,
            name,
            context.session_limits.max_file_bytes,
        )
        .await?;
        let captured_at = started.elapsed();
        let stored = crate::sessions::snapshots::upload(store, &namespace, &stored_name, &captured)
            .await
            .map_err(|e| bounded_message(&e.to_string()))?;
        Ok::<_, String>((captured, captured_at, stored))
    });
    let capturing = capturing.map_err(api_error)?;
    let (captured, captured_at, stored) = captured?;
    let stored_at = started.elapsed();
    let summary = &captured.summary;
    let mut ready = capturing;
    ready.status = Some(SnapshotStatus {
        phase: Some(SnapshotPhase::Ready),
        size_bytes: i64::try_from(summary.size_bytes).ok(),
        compressed_bytes: i64::try_from(summary.compressed_bytes).ok(),
        files: i64::try_from(summary.files).ok(),
        digest: Some(summary.digest.clone()),
        last_sequence: i64::try_from(last_sequence).ok(),
        incarnation: Some(i64::from(incarnation)),
        location: Some(SnapshotLocation {
            uri: stored.uri.clone(),
            manifest_uri: Some(stored.manifest_uri),
        }),
        local_copy: Some(SnapshotLocalCopy {
            pod: context.pod_name.clone(),
            pod_uid: context.own_uid_now(),
        }),
        completion_time: Some(now_rfc3339()),
        ..SnapshotStatus::default()
    });
    api.replace_status(name, &Default::default(), &ready)
        .await
        .map_err(api_error)?;
    // Where a suspend's time goes (bench-sessions reads these at debug level).
    debug!(
        snapshot = %name,
        to_capturing_ms = capturing_at.as_secs_f64() * 1e3,
        capture_ms = (captured_at - capturing_at).as_secs_f64() * 1e3,
        store_ms = (stored_at - captured_at).as_secs_f64() * 1e3,
        to_ready_ms = (started.elapsed() - stored_at).as_secs_f64() * 1e3,
        "snapshot Ready"
    );
    Ok(Stored {
        uri: stored.uri,
        digest: summary.digest.clone(),
        uid: Some(uid),
    })
}

/// Creates the Snapshot `name` of `run` that `making` says; `None` when one of that name
/// exists already (an earlier try of the same incarnation's suspend or commit).
async fn create_snapshot(
    api: &Api<Snapshot>,
    making: &Making,
) -> Result<Option<Snapshot>, kube::Error> {
    match api.create(&Default::default(), &making.0).await {
        Ok(created) => Ok(Some(created)),
        Err(kube::Error::Api(status)) if status.code == 409 && status.reason == "AlreadyExists" => {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// A suspend failed (its store, most likely): the session serves on, the condition says
/// why, and it is tried again after a backoff that grows to a minute ([`suspend_retry_delay`]).
async fn suspend_retrying(
    run: &Run,
    key: &Key,
    context: &Context,
    session: &Session,
    message: &str,
) -> Result<Action, Error> {
    warn!(run = %run.name_any(), error = %message, "suspend failed; the session keeps serving and it is retried");
    let delay = context.sessions.failed(&key.uid, Retry::Suspend);
    session.start_accepting();
    suspend_condition(run, context, lifecycle::SNAPSHOT_RETRYING_REASON, message).await?;
    Ok(Action::requeue(delay))
}

/// Writes `Suspended=False/<reason>` unless status says so already.
async fn suspend_condition(
    run: &Run,
    context: &Context,
    reason: &str,
    message: &str,
) -> Result<(), Error> {
    write_condition(
        run,
        context,
        lifecycle::SUSPENDED_CONDITION,
        "False",
        reason,
        message,
    )
    .await
}

/// Writes the condition `type_`=`status`/`reason` with `message` (bounded) unless the Run
/// says so already, observed at its current generation (a suspend asked again since is
/// answered anew: the gateway counts a deferral only at the generation it was observed
/// at). A write that conflicts is left to the next look, which has the Run as it is then.
pub(crate) async fn write_condition(
    run: &Run,
    context: &Context,
    type_: &str,
    status: &str,
    reason: &str,
    message: &str,
) -> Result<(), Error> {
    let message = bounded_message(message);
    let current = run
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_));
    if current.is_some_and(|c| {
        c.status == status
            && c.reason.as_deref() == Some(reason)
            && c.message.as_deref() == Some(message.as_str())
            && c.observed_generation == run.meta().generation
    }) {
        return Ok(());
    }
    let mut written = run.clone();
    let generation = written.meta().generation;
    let conditions = &mut written
        .status
        .get_or_insert_with(RunStatus::default)
        .conditions;
    lifecycle::set_condition(
        conditions,
        kruntimes_api::run::RunCondition {
            type_: type_.to_string(),
            status: status.to_string(),
            reason: Some(reason.to_string()),
            message: Some(message),
            last_transition_time: Some(now_rfc3339()),
            observed_generation: generation,
        },
    );
    write_status(context, &written).await?;
    Ok(())
}

/// Finalizing: drain, close, export, succeed.
async fn finalizing(run: &Run, key: Key, context: &Context) -> Result<Action, Error> {
    let session = match context.sessions.get(&key.uid) {
        Some(session) => session,
        // After a restart: nothing is queued any more; what the runtime server holds is
        // closed and exported below.
        None => adopt(run, &key, context, false),
    };
    session.stop_accepting();
    finalizing_step(run, key, context, &session).await
}

async fn finalizing_step(
    run: &Run,
    key: Key,
    context: &Context,
    session: &Session,
) -> Result<Action, Error> {
    // Immediate wins over the drain; the Run's timeout still bounds it.
    if let Some((phase, reason, message)) = imposed_end(run, false) {
        if let Some(wait) =
            crate::sessions::workspaces::before_end(run, &key, context, &message).await?
        {
            return Ok(wait);
        }
        return stop(run, &key, context, phase, reason, &message).await;
    }
    if !session.idle() {
        // The worker requeues the Run when the queue is empty.
        return Ok(Action::requeue(next_look(run, context)));
    }
    // A Workspace's commit comes before the close: the capture needs the session open.
    if let Some(wait) =
        crate::sessions::workspaces::before_end(run, &key, context, "the session was drained")
            .await?
    {
        return Ok(wait);
    }
    session.shut("the session was drained");
    // Close without purge: the workspace is frozen and kept until the end is written, so
    // a failed write retries the export instead of losing it.
    let closed = close_on_server(context, &key, false).await?;
    let closed_state = closed.as_ref().map(rs::SessionStatus::state);
    if closed_state != Some(rs::SessionState::Closed) {
        let message = format!(
            "the runtime server no longer holds the session ({closed_state:?}); nothing can be exported"
        );
        return stop(run, &key, context, Phase::Failed, "SessionLost", &message).await;
    }
    let artifacts_dir = closed.map(|s| s.artifacts_dir).unwrap_or_default();
    let refs = if artifacts_dir.is_empty() {
        Vec::new()
    } else {
        match export(run, context, &artifacts_dir).await {
            Ok(refs) => refs,
            Err(ExportError::Invalid(message)) => {
                return stop(
                    run,
                    &key,
                    context,
                    Phase::Failed,
                    "ArtifactInvalid",
                    &message,
                )
                .await;
            }
            Err(ExportError::Transport(message)) => {
                warn!(run = %run.name_any(), error = %message, "artifact export failed; retrying");
                let mut waiting = run.clone();
                let generation = waiting.meta().generation;
                let status = waiting.status.get_or_insert_with(RunStatus::default);
                lifecycle::leave_ready(
                    &run.spec,
                    status,
                    "ArtifactExportRetrying",
                    &message,
                    generation,
                );
                if status != run.status.as_ref().unwrap_or(&RunStatus::default()) {
                    write_status(context, &waiting).await?;
                }
                return Ok(Action::requeue(EXPORT_RETRY));
            }
        }
    };
    let mut done = run.clone();
    let generation = done.meta().generation;
    let status = done.status.get_or_insert_with(RunStatus::default);
    status.phase = Some(Phase::Succeeded);
    status.reason = Some("Drained".to_string());
    status.message = None;
    status.completion_time = Some(now_rfc3339());
    status.artifact_refs = refs;
    lifecycle::leave_ready(&run.spec, status, "Drained", "", generation);
    if write_status(context, &done).await?.is_some() {
        info!(run = %run.name_any(), artifacts = done.status.as_ref().map_or(0, |s| s.artifact_refs.len()), "session drained; Run Succeeded");
        close(context, &key, "the session was drained", true).await?;
    }
    Ok(Action::await_change())
}

async fn export(
    run: &Run,
    context: &Context,
    artifacts_dir: &str,
) -> Result<Vec<ArtifactRef>, ExportError> {
    let store = match context.artifact_store().await {
        Ok(Some(store)) => store,
        // No store: nothing is exported (the directory goes with the session).
        Ok(None) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let key = RunKey {
        namespace: run.namespace().unwrap_or_default(),
        name: run.name_any(),
        uid: run.uid().unwrap_or_default(),
    };
    store
        .export(&key, std::path::Path::new(artifacts_dir))
        .await
}

/// Ends the session here and the Run in `phase`.
async fn stop(
    run: &Run,
    key: &Key,
    context: &Context,
    phase: Phase,
    reason: &str,
    message: &str,
) -> Result<Action, Error> {
    // Close first, purge only once the end is written: a failed write repeats the same
    // decision on the next reconcile instead of finding the session gone.
    close(context, key, message, false).await?;
    if write_end(run, context, phase, reason, message).await? {
        close(context, key, message, true).await?;
    }
    Ok(Action::await_change())
}

/// The registration failed before Ready: purge, then retry per `retryPolicy`.
async fn retry(
    run: &Run,
    key: &Key,
    context: &Context,
    reason: &str,
    message: &str,
) -> Result<Action, Error> {
    close(context, key, message, true).await?;
    write_retry(run, context, reason, message).await
}

/// `CloseSession` on the runtime server, bounded by the close timeout.
async fn close_on_server(
    context: &Context,
    key: &Key,
    purge: bool,
) -> Result<Option<rs::SessionStatus>, Error> {
    close_on_server_within(
        context,
        key,
        purge,
        None,
        context.session_limits.close_timeout,
        None,
    )
    .await
}

/// `CloseSession` with the SIGTERM→SIGKILL `grace` of the session's processes (the
/// runtime server's own when `None`), the call bounded by `timeout`.
async fn close_on_server_within(
    context: &Context,
    key: &Key,
    purge: bool,
    grace: Option<Duration>,
    timeout: Duration,
    park: Option<&str>,
) -> Result<Option<rs::SessionStatus>, Error> {
    let mut call = Request::new(rs::CloseSessionRequest {
        id: Some(key.id()),
        grace_period: grace.and_then(|g| prost_types::Duration::try_from(g).ok()),
        purge,
        park_digest: park.unwrap_or_default().to_string(),
    });
    call.set_timeout(timeout);
    let answer = context
        .session_client
        .clone()
        .close_session(call)
        .await
        .map_err(|status| Error::RuntimeServer {
            call: "CloseSession",
            status,
        })?
        .into_inner();
    Ok(answer.status)
}

/// [`close`] with purge after a suspend captured the session's files with `digest`: the
/// runtime server keeps them parked for a resume here when they are exactly the capture's.
async fn close_parking(context: &Context, key: &Key, why: &str, digest: &str) -> Result<(), Error> {
    close_with(context, key, why, true, Some(digest)).await
}

/// Closes the session locally (refuse, cancel) and on the runtime server; with `purge`,
/// removes its workspace and forgets it.
pub(crate) async fn close(
    context: &Context,
    key: &Key,
    why: &str,
    purge: bool,
) -> Result<(), Error> {
    close_with(context, key, why, purge, None).await
}

async fn close_with(
    context: &Context,
    key: &Key,
    why: &str,
    purge: bool,
    park: Option<&str>,
) -> Result<(), Error> {
    if let Some(session) = context.sessions.get_up_to(&key.uid, key.attempt) {
        session.shut(why);
    }
    if context.sessions_supported {
        let timeout = context.session_limits.close_timeout;
        close_on_server_within(context, key, purge, None, timeout, park).await?;
    }
    if purge {
        context.sessions.forget_up_to(&key.uid, key.attempt);
    }
    Ok(())
}

/// Closes and purges the session within `timeout` (the drain at shutdown): its processes
/// get `grace` between SIGTERM and SIGKILL.
pub(crate) async fn close_within(
    context: &Context,
    key: &Key,
    why: &str,
    grace: Duration,
    timeout: Duration,
) -> Result<(), Error> {
    if let Some(session) = context.sessions.get_up_to(&key.uid, key.attempt) {
        session.shut(why);
    }
    if context.sessions_supported {
        close_on_server_within(context, key, true, Some(grace), timeout, None).await?;
    }
    context.sessions.forget_up_to(&key.uid, key.attempt);
    Ok(())
}

/// Deletion: close and purge, then remove the finalizer.
async fn finalize(run: &Run, key: &Key, context: &Context) -> Result<Action, Error> {
    if !run
        .finalizers()
        .iter()
        .any(|f| f == lifecycle::REGISTRATION_FINALIZER)
    {
        return Ok(Action::await_change());
    }
    // A live session with a Workspace commits before it goes: the finalizer holds the Run
    // until the commit is durable.
    if let Some(wait) =
        crate::sessions::workspaces::before_end(run, key, context, "the Run is being deleted")
            .await?
    {
        return Ok(wait);
    }
    close(context, key, "the Run is being deleted", true).await?;
    context.sessions.forget_run(&key.uid);
    // Its suspend Snapshots stay: the controller-manager deletes them once no fork that
    // has not ended starts from one.
    crate::sessions::snapshots::forget_local(context, &key.uid).await;
    let finalizers = run
        .finalizers()
        .iter()
        .filter(|f| *f != lifecycle::REGISTRATION_FINALIZER)
        .cloned()
        .collect();
    if patch_finalizers(run, context, finalizers).await?.is_some() {
        info!(run = %run.name_any(), "session Run cleaned up; finalizer removed");
    }
    Ok(Action::await_change())
}

// ---------------------------------------------------------------------------------------
// The worker: one task per session runs its queue in order.

/// What a session's worker task needs.
struct WorkerContext {
    client: SessionClient,
    requeue: mpsc::Sender<kube::runtime::reflector::ObjectRef<Run>>,
    reference: kube::runtime::reflector::ObjectRef<Run>,
    audit: Arc<crate::sessions::audit::Audit>,
    namespace: String,
    pod: String,
    pod_uid: String,
    metrics: Arc<crate::metrics::Metrics>,
}

impl WorkerContext {
    fn of(context: &Context, run: &Run) -> WorkerContext {
        WorkerContext {
            client: context.session_client.clone(),
            requeue: context.requeue.clone(),
            reference: kube::runtime::reflector::ObjectRef::new(&run.name_any())
                .within(&context.namespace),
            audit: context.audit.clone(),
            namespace: context.namespace.clone(),
            pod: context.pod_name.clone(),
            pod_uid: context.own_uid_now().unwrap_or_default(),
            metrics: context.metrics.clone(),
        }
    }
}

async fn work(session: Arc<Session>, context: WorkerContext) {
    loop {
        let notified = session.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let next = {
            let mut inner = session.lock();
            match inner.queue.pop_front() {
                Some(pending) => {
                    let (cancel, cancelled) = oneshot::channel();
                    inner.running = Some(RunningOp {
                        id: pending.request.operation_id.clone(),
                        cancel: Some(cancel),
                    });
                    Some((pending, cancelled))
                }
                None if inner.closed => return,
                None => None,
            }
        };
        let Some((mut pending, cancelled)) = next else {
            notified.await;
            continue;
        };
        if let Some(barrier) = pending.barrier.take() {
            // Every operation before it has ended: its checkpoint captures now.
            let sequence = session.lock().sequence;
            barrier.hold(sequence).await;
            let idle = {
                let mut inner = session.lock();
                inner.running = None;
                inner.queue.is_empty()
            };
            if idle {
                let _ = context.requeue.try_send(context.reference.clone());
            }
            continue;
        }
        let record = run_one(&session, &context, pending, cancelled).await;
        let idle = {
            let mut inner = session.lock();
            inner.running = None;
            // Under the same lock: an auto-suspend never sees the queue empty with the
            // quiet time of before this operation.
            inner.last_mutation = Some(Instant::now());
            inner.queue.is_empty()
        };
        // An operation's end is activity too (its files changed until now).
        session.touch();
        context.audit.write(&record);
        context.metrics.session_operation(&record.state);
        if idle {
            // A draining session's reconcile waits for this.
            let _ = context.requeue.try_send(context.reference.clone());
        }
    }
}

fn kind_of(request: &rs::SessionOperationRequest) -> &'static str {
    use rs::session_operation_request::Operation;
    match request.operation {
        Some(Operation::Command(_)) => "command",
        Some(Operation::WriteFile(_)) => "writeFile",
        Some(Operation::MakeDirectory(_)) => "makeDirectory",
        Some(Operation::Delete(_)) => "delete",
        Some(Operation::Rename(_)) => "rename",
        None => "unknown",
    }
}

/// Runs one operation on the runtime server, forwarding its events with sequence
/// numbers; returns its audit record.
async fn run_one(
    session: &Session,
    context: &WorkerContext,
    pending: Pending,
    mut cancelled: oneshot::Receiver<()>,
) -> AuditRecord {
    let id = pending.request.operation_id.clone();
    let kind = kind_of(&pending.request);
    let started_at = SystemTime::now();
    let timeout = pending
        .request
        .timeout
        .and_then(|t| Duration::try_from(t).ok())
        .unwrap_or(session.operation_timeout);
    let mut request = pending.request;
    request.id = Some(session.id());
    let mut call = Request::new(request);
    // The runtime server enforces the timeout; this only bounds a stuck call.
    call.set_timeout(timeout + Duration::from_secs(10));
    let delivery = Delivery {
        events: &pending.events,
        gone: AtomicBool::new(false),
    };
    let forward = async {
        let mut client = context.client.clone();
        let mut stream = match client.stream_session_operation(call).await {
            Ok(stream) => stream.into_inner(),
            Err(status) => return Err(status),
        };
        loop {
            match stream.message().await {
                Ok(Some(event)) => {
                    let Some(payload) = event.event else { continue };
                    let done = match &payload {
                        rs::session_operation_event::Event::Completed(done) => Some(done.clone()),
                        _ => None,
                    };
                    let stamped = {
                        let mut inner = session.lock();
                        if done.is_some()
                            && let Some(running) = inner.running.as_mut()
                        {
                            // Completed: a cancel from now on finds nothing to cancel.
                            running.cancel = None;
                        }
                        Session::stamp(&mut inner, &id, payload)
                    };
                    delivery.send(stamped).await;
                    if done.is_some() {
                        return Ok(done);
                    }
                }
                Ok(None) => return Ok(None),
                Err(status) => return Err(status),
            }
        }
    };
    let bounded = async {
        match tokio::time::timeout(timeout + Duration::from_secs(30), forward).await {
            Ok(outcome) => outcome,
            Err(_) => Err(Status::deadline_exceeded(
                "the runtime server did not end the operation in time",
            )),
        }
    };
    let outcome = tokio::select! {
        outcome = bounded => outcome,
        // A dropped sender (the operation completed) is not a cancel.
        Ok(()) = &mut cancelled => Err(Status::cancelled("cancelled")),
    };
    let (outcome_done, state, reason, message) = match outcome {
        Ok(Some(done)) => (Some(done), None, String::new(), String::new()),
        Ok(None) => (
            None,
            Some(rs::OperationState::Failed),
            "RuntimeServerError".to_string(),
            "the runtime server ended the operation without a result".to_string(),
        ),
        Err(status) if status.code() == Code::Cancelled => (
            None,
            Some(rs::OperationState::Cancelled),
            "Cancelled".to_string(),
            "the operation was cancelled; its process group was killed".to_string(),
        ),
        Err(status) => (
            None,
            Some(rs::OperationState::Failed),
            "RuntimeServerError".to_string(),
            bounded_message(&format!(
                "the runtime server failed the operation: {}",
                status.message()
            )),
        ),
    };
    let done = match (outcome_done, state) {
        (Some(done), _) => done,
        (None, state) => {
            // The call was dropped or broke: the runtime server kills what is left; the
            // next operation may start only once it let go of this one.
            released(session, context, &id).await;
            let payload = completed(
                state.unwrap_or(rs::OperationState::Failed),
                &reason,
                &message,
            );
            let done = match &payload {
                rs::session_operation_event::Event::Completed(done) => done.clone(),
                _ => rs::OperationCompleted::default(),
            };
            let stamped = Session::stamp(&mut session.lock(), &id, payload);
            delivery.send(stamped).await;
            done
        }
    };
    AuditRecord {
        namespace: context.namespace.clone(),
        run: session.name.clone(),
        run_uid: session.uid.clone(),
        attempt: session.attempt,
        pod: context.pod.clone(),
        pod_uid: context.pod_uid.clone(),
        operation_id: id,
        kind,
        queued_at: pending.queued_at,
        started_at,
        finished_at: SystemTime::now(),
        state: operation_state_name(done.state()).to_string(),
        reason: done.reason.clone(),
        exit_code: done.exit_code,
    }
}

/// How long runtimed waits for the runtime server to let go of a cancelled operation.
const RELEASE_WAIT: Duration = Duration::from_secs(10);

/// Waits (bounded) until the runtime server no longer runs operation `id` of `session`.
async fn released(session: &Session, context: &WorkerContext, id: &str) {
    let deadline = Instant::now() + RELEASE_WAIT;
    let request = rs::GetSessionStatusRequest {
        id: Some(session.id()),
    };
    while Instant::now() < deadline {
        match context
            .client
            .clone()
            .get_session_status(request.clone())
            .await
        {
            Ok(status) if status.get_ref().running_operation_id != id => return,
            Ok(_) => tokio::time::sleep(Duration::from_millis(2)).await,
            Err(_) => return,
        }
    }
    warn!(run_uid = %session.uid, operation_id = id, "the runtime server still runs a cancelled operation");
}

/// The events of one operation on their way to its caller. A caller that went away, or
/// that makes no room for [`DELIVERY_STALL`], gets nothing more; the operation goes on.
struct Delivery<'a> {
    events: &'a EventSender,
    gone: AtomicBool,
}

impl Delivery<'_> {
    async fn send(&self, event: rs::SessionOperationEvent) {
        if self.gone.load(AtomicOrdering::Relaxed) {
            return;
        }
        let delivered = match self.events.try_send(Ok(event)) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Closed(_)) => false,
            Err(mpsc::error::TrySendError::Full(event)) => {
                matches!(
                    tokio::time::timeout(DELIVERY_STALL, self.events.send(event)).await,
                    Ok(Ok(()))
                )
            }
        };
        if !delivered {
            self.gone.store(true, AtomicOrdering::Relaxed);
        }
    }
}

/// The JSON name of an operation state (`Succeeded`, `TimedOut`, …).
pub fn operation_state_name(state: rs::OperationState) -> &'static str {
    match state {
        rs::OperationState::Unspecified => "Unspecified",
        rs::OperationState::Queued => "Queued",
        rs::OperationState::Running => "Running",
        rs::OperationState::Succeeded => "Succeeded",
        rs::OperationState::Failed => "Failed",
        rs::OperationState::Cancelled => "Cancelled",
        rs::OperationState::TimedOut => "TimedOut",
    }
}

/// Closes and purges the sessions of Runs that are no longer assigned to this worker
/// (deleted while runtimed was down, or of an earlier attempt) or that ended, on the
/// runtime server and here. `listed` was read from the runtime server before `live` (the
/// attempts of the live Runs assigned here) was read from the store, so a session
/// registered meanwhile is never taken for a leftover (see `reconcile::collect_once`).
pub(crate) async fn collect(
    context: &Context,
    listed: Vec<rs::SessionStatus>,
    live: &HashMap<String, u32>,
) {
    for status in listed {
        let Some(id) = status.id else { continue };
        // Re-checked against the store right before the close (earlier closes awaited).
        // A session its suspend closes itself is left to it, and so is one whose Run's
        // reconcile commits it first.
        if !crate::reconcile::left_over(id.attempt, live.get(&id.run_uid).copied())
            || !crate::reconcile::left_over(id.attempt, live_attempt_now(context, &id.run_uid))
            || context.sessions.is_suspending(&id.run_uid)
            || awaits_idle_commit_now(context, &id.run_uid, id.attempt)
        {
            continue;
        }
        let key = Key {
            uid: id.run_uid,
            attempt: id.attempt,
        };
        debug!(run_uid = %key.uid, attempt = key.attempt, "purging a session that left this worker or ended");
        if let Err(error) = close(context, &key, "the Run left this worker or ended", true).await {
            warn!(run_uid = %key.uid, error = %error, "purging a session failed");
        }
    }
    // Local state: against the store as it is now, with no await before each removal.
    let live_now = live_attempts_now(context);
    let shut: Vec<Arc<Session>> = {
        let mut map = context
            .sessions
            .map
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let stale: Vec<String> = map
            .iter()
            // What the snapshot (read before the lock) calls left over is confirmed against
            // the store under the lock: a session registered in between is kept.
            .filter(|(uid, s)| {
                crate::reconcile::left_over(s.fenced, live_now.get(*uid).copied())
                    && crate::reconcile::left_over(s.fenced, live_attempt_now(context, uid))
                    && !awaits_idle_commit_now(context, uid, s.fenced)
            })
            .map(|(uid, _)| uid.clone())
            .collect();
        stale.iter().filter_map(|uid| map.remove(uid)).collect()
    };
    for session in shut {
        session.shut("the Run left this worker or ended");
    }
    let live_now = live_attempts_now(context);
    let mut registrations = context
        .sessions
        .registrations
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let before = registrations.len();
    registrations.retain(|uid, r| {
        !crate::reconcile::left_over(r.attempt(), live_now.get(uid).copied())
            || !crate::reconcile::left_over(r.attempt(), live_attempt_now(context, uid))
    });
    let removed = registrations.len() != before;
    drop(registrations);
    if removed {
        context.sessions.registered.notify_waiters();
    }
}

/// The attempt of every non-terminal Run assigned here, by UID, as the store has it now.
fn live_attempts_now(context: &Context) -> HashMap<String, u32> {
    context
        .assigned_runs()
        .iter()
        .filter(|run| !run.phase().is_terminal())
        .filter_map(|run| {
            Some((
                run.uid()?,
                crate::tasks::executions::fenced_attempt(run.status.as_ref()),
            ))
        })
        .collect()
}

/// The attempt of the Run `uid` if it is assigned here and not terminal, as the store has
/// it now.
fn live_attempt_now(context: &Context, uid: &str) -> Option<u32> {
    live_attempts_now(context).get(uid).copied()
}

/// The sessions the runtime server holds (`None` when it cannot say now).
pub(crate) async fn list(context: &Context) -> Option<Vec<rs::SessionStatus>> {
    match context
        .session_client
        .clone()
        .list_sessions(rs::ListSessionsRequest {})
        .await
    {
        Ok(list) => Some(list.into_inner().sessions),
        Err(status) => {
            debug!(error = %status, "ListSessions failed; collecting later");
            None
        }
    }
}

/// Opens the Runtime's ArtifactStore, if it names one. A Runtime that cannot be read, or
/// whose store cannot be opened, is a transport failure (the caller retries or reports).
pub(crate) async fn artifact_store_of(
    api: &Api<kruntimes_api::Runtime>,
    runtime: &str,
) -> Result<Option<std::sync::Arc<dyn crate::artifacts::ArtifactStore>>, ExportError> {
    let runtime = api
        .get(runtime)
        .await
        .map_err(|e| ExportError::Transport(format!("reading the Runtime: {e}")))?;
    runtime
        .spec
        .artifact_store
        .as_ref()
        .map(crate::artifacts::open)
        .transpose()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_failing_suspend_backs_off_to_a_minute() {
        use super::{SUSPEND_RETRY, SUSPEND_RETRY_MAX, suspend_retry_delay};
        assert_eq!(suspend_retry_delay(1), SUSPEND_RETRY);
        assert_eq!(suspend_retry_delay(2), SUSPEND_RETRY * 2);
        assert_eq!(suspend_retry_delay(3), SUSPEND_RETRY * 4);
        assert_eq!(suspend_retry_delay(6), SUSPEND_RETRY_MAX);
        assert_eq!(suspend_retry_delay(u32::MAX), SUSPEND_RETRY_MAX);
        assert_eq!(suspend_retry_delay(0), SUSPEND_RETRY);
    }

    /// Regression: suspends and commits shared one backoff per session, so a suspend that
    /// had failed twice made the commit of the session's release wait out its backoff
    /// before the first try, and the commit's own retries start from the suspend's count.
    #[test]
    fn a_failed_suspend_does_not_delay_the_commit() {
        let sessions = Sessions::default();
        sessions.failed("u", Retry::Suspend);
        sessions.failed("u", Retry::Suspend);
        assert!(sessions.backoff("u", Retry::Suspend).is_some());
        assert_eq!(sessions.backoff("u", Retry::Commit), None);
        assert_eq!(sessions.failed("u", Retry::Commit), SUSPEND_RETRY);
        sessions.clear_retry("u", Retry::Suspend);
        assert_eq!(sessions.backoff("u", Retry::Suspend), None);
        assert!(sessions.backoff("u", Retry::Commit).is_some());
        assert_eq!(sessions.backoff("other", Retry::Commit), None);
        sessions.forget_run("u");
        assert_eq!(sessions.backoff("u", Retry::Commit), None);
    }

    use super::*;
    use kruntimes_api::RunSpec;
    use kruntimes_api::run::SessionMode;

    fn session(queue_size: usize) -> Session {
        Session {
            uid: "u".into(),
            name: "s".into(),
            attempt: 1,
            fenced: 1,
            queue_size,
            operation_timeout: Duration::from_secs(300),
            lease: None,
            auto_suspend_after: None,
            last_heartbeat: Mutex::new(Instant::now()),
            inner: Mutex::new(Inner {
                accepting: true,
                ..Inner::default()
            }),
            changed: Notify::new(),
            activity: Mutex::new(Activity::default()),
            activity_interval: Duration::from_secs(60),
            created: Instant::now(),
            admission_write: tokio::sync::Mutex::new(()),
            commit: Default::default(),
            wake: None,
        }
    }

    /// Issue 19 item 5: the owner records the last mutation at most once per interval,
    /// never loses the latest one, and a read does not count.
    #[test]
    fn activity_is_written_at_most_once_per_interval_and_never_lost() {
        let s = session(4);
        assert_eq!(
            s.activity_write(None),
            ActivityWrite::UpToDate,
            "no mutation yet"
        );
        assert!(s.admit(command()).is_ok());
        let ActivityWrite::Now(first) = s.activity_write(None) else {
            panic!("the first mutation is written at once")
        };
        s.activity_written();
        assert_eq!(s.activity_write(Some(first)), ActivityWrite::UpToDate);
        s.touch();
        match s.activity_write(Some(first)) {
            ActivityWrite::After(left) => assert!(left <= Duration::from_secs(60), "{left:?}"),
            other => panic!("a second mutation within the interval waits: {other:?}"),
        }
        // A reconcile after the interval writes the latest one.
        s.activity
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .written_at = Some(Instant::now() - Duration::from_secs(61));
        let ActivityWrite::Now(second) = s.activity_write(Some(first)) else {
            panic!("the interval passed: the latest mutation is written")
        };
        assert!(second > first);
    }

    #[test]
    fn a_short_idle_timeout_shortens_the_activity_interval() {
        let mut mode = SessionMode::default();
        let worker = Duration::from_secs(60);
        assert_eq!(activity_interval(&mode, worker), worker);
        mode.idle_timeout = Some("20s".into());
        assert_eq!(activity_interval(&mode, worker), Duration::from_secs(2));
        mode.idle_timeout = Some("1h".into());
        assert_eq!(activity_interval(&mode, worker), worker);
    }

    /// Issue 19 item 4: the auto-suspend rechecks idleness and stops admission in one
    /// step: never with work queued or an upload in flight, never before the quiet time
    /// (the end of an operation restarts it), and a withdrawn one (a wake) serves again
    /// with a fresh clock. A call refused meanwhile is told to try again (UNAVAILABLE).
    #[test]
    fn an_auto_suspend_stops_admission_only_when_really_idle() {
        let mut s = session(4);
        s.auto_suspend_after = Some(Duration::from_secs(60));
        let quiet_for = |s: &Session, secs: u64| {
            s.lock().last_mutation = Some(Instant::now() - Duration::from_secs(secs));
        };
        quiet_for(&s, 61);
        let queued = s.admit(command());
        assert!(queued.is_ok());
        quiet_for(&s, 61);
        assert!(!s.stop_for_auto_suspend(false), "an operation waits");
        s.lock().queue.clear();
        s.lock().uploads = 1;
        quiet_for(&s, 61);
        assert!(!s.stop_for_auto_suspend(false), "an upload is in flight");
        s.lock().uploads = 0;
        quiet_for(&s, 30);
        assert!(!s.stop_for_auto_suspend(false), "quiet for 30 s only");
        assert!(s.lock().accepting, "a failed recheck changes nothing");
        quiet_for(&s, 61);
        assert!(s.stop_for_auto_suspend(false));
        let refused = s.admit(command()).map(|_| ()).map_err(|e| e.code());
        assert_eq!(refused, Err(Code::Unavailable));
        s.start_accepting();
        assert!(s.admit(command()).is_ok(), "a wake reopens admission");
        // No timer while work waits (the reconcile spun every 10 ms under a long
        // operation); the end of the work requeues the Run.
        assert_eq!(s.auto_suspend_left(), None, "an operation waits");
        s.lock().queue.clear();
        assert!(
            s.auto_suspend_left() > Some(Duration::from_secs(50)),
            "and restarts the clock"
        );
        // An expired lease suspends whatever waits (it finishes before the capture).
        assert!(s.stop_for_auto_suspend(true));
        let mut without = session(4);
        without.auto_suspend_after = None;
        assert!(!without.stop_for_auto_suspend(true), "no autoSuspendAfter");
    }

    fn command() -> rs::SessionOperationRequest {
        rs::SessionOperationRequest {
            operation: Some(rs::session_operation_request::Operation::Command(
                rs::Command {
                    argv: vec!["true".into()],
                    ..Default::default()
                },
            )),
            ..Default::default()
        }
    }

    /// Issue 15 item 8: a timeout above the session's cap was clamped to it, so a command
    /// asked to run 10m died at 5m. It is refused at once, naming the cap.
    #[test]
    fn a_timeout_above_the_cap_is_refused_naming_the_cap() {
        let s = session(4);
        let mut over = command();
        over.timeout = Some(prost_types::Duration {
            seconds: 600,
            nanos: 0,
        });
        let Err(refused) = s.admit(over).map(|_| ()) else {
            panic!("a timeout above the cap was admitted")
        };
        assert_eq!(refused.code(), Code::InvalidArgument);
        assert!(
            refused.message().contains("600s") && refused.message().contains("cap of 300s"),
            "{}",
            refused.message()
        );
        // Nothing was queued for it.
        assert_eq!(s.lock().queue.len(), 0);
        let mut at_cap = command();
        at_cap.timeout = Some(prost_types::Duration {
            seconds: 300,
            nanos: 0,
        });
        assert!(s.admit(at_cap).is_ok());
    }

    #[test]
    fn admission_numbers_bounds_and_refuses() {
        let s = session(2);
        let mut first = s
            .admit(command())
            .ok()
            .into_iter()
            .next()
            .map(|mut r| r.try_recv());
        let Some(Ok(Ok(queued))) = first.take() else {
            panic!("the first operation is admitted with a queued event")
        };
        assert_eq!((queued.operation_id.as_str(), queued.sequence), ("op-1", 1));
        assert!(s.admit(command()).is_ok());
        let full = s.admit(command()).map(|_| ()).map_err(|e| e.code());
        assert_eq!(full, Err(Code::ResourceExhausted));
        let mut named = command();
        named.operation_id = "op-1".into();
        assert_eq!(s.cancel("op-2"), Some(rs::OperationState::Cancelled));
        assert_eq!(
            s.admit(named).map(|_| ()).map_err(|e| e.code()),
            Err(Code::AlreadyExists)
        );
        let mut bad = command();
        bad.operation_id = "a b".into();
        assert_eq!(
            s.admit(bad).map(|_| ()).map_err(|e| e.code()),
            Err(Code::InvalidArgument)
        );
        assert_eq!(s.cancel("nope"), None);
        s.stop_accepting();
        assert_eq!(
            s.admit(command()).map(|_| ()).map_err(|e| e.code()),
            Err(Code::FailedPrecondition)
        );
        // op-1 queued (seq 1), op-2 queued (2) and cancelled (3): contiguous.
        assert_eq!(s.snapshot().2, 3);
    }

    fn run(uid: &str, phase: Phase, session: bool) -> Arc<Run> {
        run_with(uid, phase, session, false)
    }

    fn run_with(uid: &str, phase: Phase, session: bool, exclusive: bool) -> Arc<Run> {
        let mut spec = RunSpec::task("rt", "main.sh");
        if session {
            spec.mode.task = None;
            spec.mode.session = Some(SessionMode::default());
        }
        if exclusive {
            spec.resources = Some(kruntimes_api::run::RunResources {
                exclusive: Some(true),
                ..Default::default()
            });
        }
        let mut run = Run::new(uid, spec);
        run.metadata.uid = Some(uid.to_string());
        run.status = Some(RunStatus {
            phase: Some(phase),
            ..Default::default()
        });
        Arc::new(run)
    }

    #[test]
    fn the_gate_lets_sessions_share_a_worker_by_its_slots() {
        let mut gate = Gate::default();
        let task = run("t", Phase::Running, false);
        let s1 = run("s1", Phase::Scheduled, true);
        assert!(
            gate.admit(&s1, &[task.clone(), s1.clone()], Some(3)),
            "a session joins a running task"
        );
        let s2 = run("s2", Phase::Scheduled, true);
        assert!(
            gate.admit(&s2, &[task.clone(), s1.clone(), s2.clone()], Some(3)),
            "and another session"
        );
        let t2 = run("t2", Phase::Scheduled, false);
        assert!(
            !gate.admit(
                &t2,
                &[task.clone(), s1.clone(), s2.clone(), t2.clone()],
                Some(3)
            ),
            "the claimed sessions count before the cache shows them: the worker is full"
        );
        let done = run("t", Phase::Succeeded, false);
        assert!(gate.admit(&t2, &[done, s1, s2, t2.clone()], Some(3)));
    }

    #[test]
    fn the_gate_keeps_an_exclusive_session_alone() {
        for slots in [Some(4), None] {
            let mut gate = Gate::default();
            let task = run("t", Phase::Running, false);
            let alone = run_with("x", Phase::Scheduled, true, true);
            assert!(
                !gate.admit(&alone, &[task.clone(), alone.clone()], slots),
                "an exclusive session waits for a running task ({slots:?})"
            );
            let done = run("t", Phase::Succeeded, false);
            assert!(
                gate.admit(&alone, &[done, alone.clone()], slots),
                "an empty worker takes it ({slots:?})"
            );
            let t2 = run("t2", Phase::Scheduled, false);
            assert!(
                !gate.admit(&t2, &[alone.clone(), t2.clone()], slots),
                "a claimed exclusive session holds every slot ({slots:?})"
            );
            let ready = run_with("x", Phase::Ready, true, true);
            let s = run("s", Phase::Scheduled, true);
            assert!(!gate.admit(&s, &[ready, s.clone()], slots), "{slots:?}");
            let gone = run_with("x", Phase::Cancelled, true, true);
            assert!(gate.admit(&t2, &[gone, t2.clone()], slots), "{slots:?}");
        }
    }
}
