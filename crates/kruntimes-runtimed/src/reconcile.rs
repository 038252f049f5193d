//! The Run reconciler of one worker: claim, execute, finish.
//!
//! A kube-runtime [`Controller`] over the Runs whose `status.assignedPod` is this worker's
//! Pod. Each reconcile decides from the cached Run and the local [`Executions`] table alone,
//! with an exhaustive match on the phase, and writes at most one status update, conditional
//! on the `resourceVersion` it read. A 409 means the Run changed meanwhile; the watch
//! delivers the new version and the reconcile runs again.
//!
//! Fencing: a Run is handled only when both `assignedPod` and `assignedPodUID` name this
//! worker's Pod, so a Run left on an earlier incarnation of a Pod of the same name is never
//! touched.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::StreamExt;
use kruntimes_api::run::{ModeKind, TerminationMode};
use kruntimes_api::{Phase, Run};
use kruntimes_proto::runtime::v1 as rs;
use kube::api::{Api, PostParams};
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use tokio::sync::{Mutex, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tracing::{debug, warn};

use crate::functions::{self, EndpointConfig, Registrations};
use crate::tasks::executions::{Executions, Key};

/// The runtime server's clients and what it said of itself.
pub struct RuntimeServer {
    pub task: TaskClient,
    pub functions: FunctionClient,
    pub sessions: crate::sessions::SessionClient,
    /// The server implements SessionRuntime.
    pub sessions_supported: bool,
    pub adapter: String,
}

impl RuntimeServer {
    /// The clients on `channel` of the runtime server that answered `capabilities`.
    pub fn new(channel: &Channel, capabilities: &rs::CapabilitiesResponse) -> Self {
        Self {
            task: rs::task_runtime_client::TaskRuntimeClient::new(channel.clone()),
            functions: rs::function_runtime_client::FunctionRuntimeClient::new(channel.clone()),
            sessions: rs::session_runtime_client::SessionRuntimeClient::new(channel.clone()),
            sessions_supported: capabilities
                .services
                .iter()
                .any(|s| s == rs::SESSION_RUNTIME_SERVICE),
            adapter: capabilities.adapter.clone(),
        }
    }
}

/// What session mode needs besides the runtime server.
pub struct SessionSetup {
    /// This worker's Runtime (its ArtifactStore is read from it).
    pub runtime: String,
    pub limits: crate::sessions::SessionLimits,
    pub audit: Arc<crate::sessions::audit::Audit>,
}

/// How often executions of Runs that left this worker are forgotten.
const COLLECT_EVERY: Duration = Duration::from_secs(10);
/// Requeue triggers buffered before waiters wait for room.
const REQUEUE_QUEUE: usize = 1024;
/// How soon a Run refused by the local gate is looked at again.
const GATE_RETRY: Duration = Duration::from_millis(200);
/// How soon a failed reconcile runs again.
const ERROR_REQUEUE: Duration = Duration::from_secs(1);

pub type TaskClient = rs::task_runtime_client::TaskRuntimeClient<Channel>;
pub type FunctionClient = rs::function_runtime_client::FunctionRuntimeClient<Channel>;

/// Why a reconcile failed; it is retried after [`ERROR_REQUEUE`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("writing the status of Run {namespace}/{name} failed")]
    WriteStatus {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("the runtime server failed a {call} call: {status}")]
    RuntimeServer {
        call: &'static str,
        status: tonic::Status,
    },
    #[error("Run {0} has no {1}")]
    Missing(String, &'static str),
}

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub namespace: String,
    pub pod_name: String,
    pod_uid: watch::Receiver<Option<String>>,
    pub task: TaskClient,
    pub functions: FunctionClient,
    pub session_client: crate::sessions::SessionClient,
    pub sessions_supported: bool,
    pub sessions: Arc<crate::sessions::Sessions>,
    pub session_limits: crate::sessions::SessionLimits,
    pub audit: Arc<crate::sessions::audit::Audit>,
    /// This worker's Runtime.
    pub runtime: String,
    /// The runtime server's adapter ("bash" or "python").
    pub adapter: String,
    pub executions: Arc<Executions>,
    pub registrations: Arc<Registrations>,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Where Ready functions are reached; `None` publishes no endpoint.
    pub endpoint: Option<EndpointConfig>,
    pub(crate) requeue: mpsc::Sender<ObjectRef<Run>>,
    requeue_rx: Mutex<Option<mpsc::Receiver<ObjectRef<Run>>>>,
    store: OnceLock<Store<Run>>,
    /// Claims and the drain exclude each other ([`crate::claims`]).
    pub claims: crate::claims::Claims,
    /// Events on Runs, reported as runtimed of this Pod ([`crate::events`]).
    pub events: crate::events::Events,
    /// This worker's slots (its Runtime's `spec.runs`) as last watched; 0 until known.
    runs_per_worker: std::sync::atomic::AtomicI32,
    /// Checkpoints of the sessions served here ([`crate::sessions::checkpoints`]).
    pub checkpoints: crate::sessions::checkpoints::Checkpoints,
}

impl Context {
    pub fn new(
        client: Client,
        namespace: String,
        pod_name: String,
        pod_uid: watch::Receiver<Option<String>>,
        server: RuntimeServer,
        endpoint: Option<EndpointConfig>,
        session: SessionSetup,
    ) -> Context {
        let (requeue, requeue_rx) = mpsc::channel(REQUEUE_QUEUE);
        let events = crate::events::Events::new(
            client.clone(),
            crate::events::REPORTING_CONTROLLER,
            &pod_name,
        );
        Context {
            events,
            client,
            namespace,
            pod_name,
            pod_uid,
            task: server.task,
            functions: server.functions,
            session_client: server.sessions,
            sessions_supported: server.sessions_supported,
            sessions: Arc::new(crate::sessions::Sessions::default()),
            session_limits: session.limits,
            audit: session.audit,
            runtime: session.runtime,
            adapter: server.adapter,
            executions: Arc::new(Executions::default()),
            registrations: Arc::new(Registrations::default()),
            metrics: Arc::new(crate::metrics::Metrics::default()),
            endpoint,
            requeue,
            requeue_rx: Mutex::new(Some(requeue_rx)),
            store: OnceLock::new(),
            claims: crate::claims::Claims::default(),
            runs_per_worker: std::sync::atomic::AtomicI32::new(0),
            checkpoints: crate::sessions::checkpoints::Checkpoints::default(),
        }
    }

    /// This worker's slots for the local gate, once its Runtime was read.
    pub(crate) fn runs_per_worker(&self) -> Option<i32> {
        let runs = self
            .runs_per_worker
            .load(std::sync::atomic::Ordering::SeqCst);
        (runs > 0).then_some(runs)
    }

    /// Shutdown begins ([`crate::drain`]): from now on nothing is claimed, and function and
    /// session Runs are left to the drain; task Runs keep their reconcile.
    pub fn begin_drain(&self) {
        self.claims.close();
    }

    /// Whether shutdown began.
    pub fn draining(&self) -> bool {
        self.claims.closed()
    }

    /// This worker's Pod UID, if known yet.
    pub fn own_uid_now(&self) -> Option<String> {
        self.pod_uid.borrow().clone()
    }

    /// Asks the reconciler to look at the Run again soon (it dropped its registration, for
    /// example). Never blocks: a full queue drops the request, and the periodic health
    /// check catches up.
    pub fn requeue_run(&self, name: &str) {
        let _ = self
            .requeue
            .try_send(ObjectRef::new(name).within(&self.namespace));
    }

    /// This worker's Pod UID, once known.
    async fn own_uid(&self) -> Option<String> {
        let mut uid = self.pod_uid.clone();
        uid.wait_for(Option::is_some).await.ok()?.clone()
    }

    /// The cached Runs assigned to this worker (empty before the controller starts).
    pub fn run_named(&self, name: &str) -> Option<Arc<Run>> {
        let store = self.store.get()?;
        store.get(&ObjectRef::new(name).within(&self.namespace))
    }

    /// Every cached Run assigned to this worker's Pod name (any incarnation).
    pub(crate) fn assigned_runs(&self) -> Vec<Arc<Run>> {
        self.store.get().map(Store::state).unwrap_or_default()
    }

    /// This worker's Runtime's ArtifactStore, read from the API and opened (never on an
    /// operation's path: registration with inputs and export only).
    pub(crate) async fn artifact_store(
        &self,
    ) -> Result<
        Option<std::sync::Arc<dyn crate::artifacts::ArtifactStore>>,
        crate::artifacts::StoreError,
    > {
        let api = Api::<kruntimes_api::Runtime>::namespaced(self.client.clone(), &self.namespace);
        crate::sessions::artifact_store_of(&api, &self.runtime).await
    }

    pub(crate) fn api(&self) -> Api<Run> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }
}

/// Keeps [`Context::runs_per_worker`] in step with this worker's Runtime (`spec.runs`),
/// through a watch of that one object. Runs until aborted.
pub async fn watch_runtime(context: Arc<Context>) {
    use futures::StreamExt;
    use kube::runtime::WatchStreamExt;
    let api = Api::<kruntimes_api::Runtime>::namespaced(context.client.clone(), &context.namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={}", context.runtime));
    let mut events = watcher::watcher(api, config)
        .default_backoff()
        .applied_objects()
        .boxed();
    while let Some(event) = events.next().await {
        match event {
            Ok(runtime) => {
                let runs = runtime.spec.runs_per_worker().max(1);
                let before = context
                    .runs_per_worker
                    .swap(runs, std::sync::atomic::Ordering::SeqCst);
                if before != runs {
                    debug!(runtime = %context.runtime, runs, "worker slots");
                }
            }
            Err(error) => debug!(error = %error, "watching this worker's Runtime"),
        }
    }
}

/// Runs the reconciler until `stop` completes.
pub async fn run(context: Arc<Context>, stop: impl Future<Output = ()> + Send + Sync + 'static) {
    let Some(requeue) = context.requeue_rx.lock().await.take() else {
        warn!("the Run reconciler was started twice");
        return;
    };
    let config =
        watcher::Config::default().fields(&format!("status.assignedPod={}", context.pod_name));
    let controller = Controller::new(context.api(), config)
        .with_config(ControllerConfig::default().concurrency(64));
    let _ = context.store.set(controller.store());
    controller
        .reconcile_on(ReceiverStream::new(requeue))
        .graceful_shutdown_on(stop)
        .run(reconcile, error_policy, context)
        .for_each(|result| async move {
            if let Err(error) = result {
                debug!(error = %error, "Run reconcile failed");
            }
        })
        .await;
}

fn error_policy(run: Arc<Run>, error: &Error, _: Arc<Context>) -> Action {
    warn!(run = %run.name_any(), error = %error, "Run reconcile failed; retrying");
    Action::requeue(ERROR_REQUEUE)
}

/// One reconcile of one Run assigned to this worker.
async fn reconcile(run: Arc<Run>, context: Arc<Context>) -> Result<Action, Error> {
    let Some(own_uid) = context.own_uid().await else {
        return Ok(Action::await_change());
    };
    let status = run.status.clone().unwrap_or_default();
    if status.assigned_pod.as_deref() != Some(context.pod_name.as_str())
        || status.assigned_pod_uid.as_deref() != Some(own_uid.as_str())
    {
        // Assigned to another incarnation of a Pod of this name: fenced, not ours.
        return Ok(Action::await_change());
    }
    let uid = run
        .uid()
        .ok_or_else(|| Error::Missing(run.name_any(), "metadata.uid"))?;
    let key = Key {
        uid,
        attempt: crate::tasks::executions::fenced_attempt(Some(&status)),
    };
    // A reconcile that may claim or register holds a pass to its end; once shutdown began
    // none is granted: claim nothing, functions and sessions are the drain's (a deletion
    // still cleans up as usual, a running task keeps its reconcile).
    let _pass = if run.metadata.deletion_timestamp.is_none()
        && (run.phase() == Phase::Scheduled || run.spec.mode.kind() != Some(ModeKind::Task))
    {
        match context.claims.enter(&run.name_any()).await {
            Some(pass) => Some(pass),
            None => return Ok(Action::await_change()),
        }
    } else {
        None
    };
    if run.spec.mode.session.is_some() {
        return crate::sessions::reconcile(&run, key, &context).await;
    }
    if run.phase() == Phase::Scheduled
        && run.metadata.deletion_timestamp.is_none()
        && !wants_immediate_stop(&run)
    {
        // The local gate: the Run fits beside what this worker holds.
        let admitted = context.sessions.gate.lock().await.admit(
            &run,
            &context.assigned_runs(),
            context.runs_per_worker(),
        );
        if !admitted {
            debug!(run = %run.name_any(), "Run waits: this worker has no room for it now");
            return Ok(Action::requeue(GATE_RETRY));
        }
    }
    if run.spec.mode.function.is_some() {
        return functions::reconcile(&run, key, &context).await;
    }
    crate::tasks::reconcile(&run, key, &context).await
}

pub(crate) fn wants_immediate_stop(run: &Run) -> bool {
    match run.spec.termination.as_ref().map(|t| t.mode) {
        Some(TerminationMode::Immediate) => true,
        Some(TerminationMode::Drain) | None => false,
    }
}

/// The Run's inline source as the one file `path` (none without inline source), and its
/// environment, as the runtime server takes them.
pub(crate) fn source_and_env(run: &Run, path: &str) -> (Vec<rs::SourceFile>, Vec<rs::EnvVar>) {
    let files = match run.spec.source.as_ref().and_then(|s| s.inline.as_ref()) {
        Some(inline) => vec![rs::SourceFile {
            path: path.to_string(),
            content: inline.clone().into_bytes(),
            executable: false,
        }],
        None => Vec::new(),
    };
    let env = run
        .spec
        .env
        .iter()
        .flatten()
        .map(|e| rs::EnvVar {
            name: e.name.clone(),
            value: e.value.clone(),
        })
        .collect();
    (files, env)
}

/// Replaces the Run's status with `run`'s, conditional on its resourceVersion. `None` on a
/// conflict or when the Run is gone: the watch brings the new state.
pub(crate) async fn write_status(context: &Context, run: &Run) -> Result<Option<Run>, Error> {
    let name = run.name_any();
    match context
        .api()
        .replace_status(&name, &PostParams::default(), run)
        .await
    {
        Ok(written) => {
            crate::events::status_written(&context.events, &written);
            Ok(Some(written))
        }
        Err(kube::Error::Api(status)) if status.code == 409 || status.code == 404 => {
            debug!(run = %name, code = status.code, "Run changed meanwhile; waiting for the new version");
            Ok(None)
        }
        Err(source) => Err(Error::WriteStatus {
            namespace: context.namespace.clone(),
            name,
            source,
        }),
    }
}

/// A point of one collection pass where a test may pause it. A seam for the interleaving
/// tests (a claim must be able to land exactly between two steps of a pass); production
/// passes no hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CollectPoint {
    /// The runtime server's executions, functions and sessions are listed; the store's view
    /// is not read yet.
    Listed,
    /// The store's view is read; nothing is collected yet.
    Viewed,
    /// The pass is over.
    Done,
}

/// What a test injects at each [`CollectPoint`] (see [`collect_once`]).
pub type CollectHook =
    Arc<dyn Fn(CollectPoint) -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

/// Whether what the runtime server holds for `held` (an attempt of a Run) is left over,
/// given the Run's `current` attempt on this worker (`None`: the Run is not assigned here
/// any more). An attempt newer than the view is never touched: the view lags behind the
/// reconciler that started it.
pub(crate) fn left_over(held: u32, current: Option<u32>) -> bool {
    match current {
        None => true,
        Some(current) => held < current,
    }
}

/// The attempt of every Run assigned to this worker in the store now, by UID. With
/// `live_only`, terminal Runs are left out (a session of an ended Run is left over).
fn attempts_now(context: &Context, live_only: bool) -> HashMap<String, u32> {
    context
        .assigned_runs()
        .iter()
        .filter(|run| !live_only || !run.phase().is_terminal())
        .filter_map(|run| {
            Some((
                run.uid()?,
                crate::tasks::executions::fenced_attempt(run.status.as_ref()),
            ))
        })
        .collect()
}

/// The Run's attempt in the store now (`None`: not assigned here, or, with `live_only`,
/// ended). Read again right before each destructive call, so that nothing is decided on a
/// view older than the last await.
fn attempt_now(context: &Context, uid: &str, live_only: bool) -> Option<u32> {
    context
        .assigned_runs()
        .iter()
        .filter(|run| !live_only || !run.phase().is_terminal())
        .find(|run| run.uid().as_deref() == Some(uid))
        .map(|run| crate::tasks::executions::fenced_attempt(run.status.as_ref()))
}

/// Forgets, on the runtime server and locally, the executions of Runs that are no longer
/// assigned to this worker (deleted, or retried elsewhere) and of attempts older than the
/// Run's current one; unregisters such functions and purges such sessions. Runs forever;
/// abort it to stop.
pub async fn collect_garbage(context: Arc<Context>) {
    let mut ticks = tokio::time::interval(COLLECT_EVERY);
    let mut last_sweep: Option<tokio::time::Instant> = None;
    loop {
        ticks.tick().await;
        let Some(store) = context.store.get() else {
            continue;
        };
        // Bounded: kube-runtime's readiness wait may miss a wake-up (see the scheduler).
        match tokio::time::timeout(COLLECT_EVERY, store.wait_until_ready()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) | Err(_) => continue,
        }
        collect_once(&context, None).await;
        // Local snapshot copies cost an API read each: swept on the first pass, then every
        // `--snapshot-sweep-interval`.
        let interval = context.session_limits.snapshot_sweep_interval;
        if context.sessions_supported && last_sweep.is_none_or(|at| at.elapsed() >= interval) {
            crate::sessions::snapshots::sweep_local(&context).await;
            last_sweep = Some(tokio::time::Instant::now());
        }
    }
}

/// One collection pass. Its guarantees, against the reconciler running at the same time:
///
/// - **List first, view second.** Everything the runtime server reports was started before
///   the store's view is read, and the reconciler only starts what it found in the store,
///   so a Run claimed during the pass is either absent from the lists or present in the
///   view with its current attempt. Never the other way round (the view first, then the
///   list, found a Run claimed in between unknown and killed its program).
/// - **Nothing newer than the view is touched** ([`left_over`]): an attempt the view does
///   not know yet is kept.
/// - **Re-checked before each action**: the Run is looked up in the store again right
///   before each Forget, Unregister or Close (the previous calls awaited), and local state
///   is swept against the store as it is at the sweep, with no await in between.
///
/// `hook` is the test seam of [`CollectPoint`]; production passes `None`.
pub async fn collect_once(context: &Context, hook: Option<&CollectHook>) {
    let executions = match context.task.clone().list(rs::ListRequest {}).await {
        Ok(list) => Some(list.into_inner().executions),
        Err(status) => {
            warn!(error = %status, "List failed; collecting executions later");
            None
        }
    };
    let functions = match context
        .functions
        .clone()
        .list_functions(rs::ListFunctionsRequest {})
        .await
    {
        Ok(list) => Some(list.into_inner().functions),
        Err(status) => {
            debug!(error = %status, "ListFunctions failed; collecting functions later");
            None
        }
    };
    let sessions = if context.sessions_supported {
        crate::sessions::list(context).await
    } else {
        None
    };
    if let Some(hook) = hook {
        hook(CollectPoint::Listed).await;
    }
    let assigned = attempts_now(context, false);
    let live = attempts_now(context, true);
    if let Some(hook) = hook {
        hook(CollectPoint::Viewed).await;
    }
    for execution in executions.into_iter().flatten() {
        let Some(id) = execution.id else { continue };
        if !left_over(id.attempt, assigned.get(&id.run_uid).copied()) {
            continue;
        }
        let current = attempt_now(context, &id.run_uid, false);
        if !left_over(id.attempt, current) {
            continue;
        }
        let key = Key {
            uid: id.run_uid,
            attempt: id.attempt,
        };
        debug!(run_uid = %key.uid, attempt = key.attempt, "forgetting an execution that left this worker");
        crate::tasks::forget(context, &key).await;
        context.executions.remove_older(&key.uid, key.attempt);
    }
    // Local entries: against the store as it is now, with no await before the removal. The
    // snapshot is read before the table's lock, so on another thread a Run can arrive and be
    // claimed in between: an entry the snapshot calls left over is confirmed against the
    // store under the lock (a claim inserts its entry only after its Run is in the store).
    let assigned_now = attempts_now(context, false);
    context.executions.retain(|key| {
        !left_over(key.attempt, assigned_now.get(&key.uid).copied())
            || !left_over(key.attempt, attempt_now(context, &key.uid, false))
    });
    if let Some(functions) = functions {
        collect_functions(context, functions, &assigned).await;
    }
    if let Some(sessions) = sessions {
        crate::sessions::collect(context, sessions, &live).await;
    }
    if let Some(hook) = hook {
        hook(CollectPoint::Done).await;
    }
}

/// Unregisters the listed function registrations of Runs that are no longer assigned to
/// this worker, or of attempts older than the Run's current one (see [`collect_once`]).
async fn collect_functions(
    context: &Context,
    listed: Vec<rs::FunctionStatusResponse>,
    assigned: &HashMap<String, u32>,
) {
    for function in listed {
        let Some(id) = function.id else { continue };
        if !left_over(id.attempt, assigned.get(&id.run_uid).copied())
            || !left_over(id.attempt, attempt_now(context, &id.run_uid, false))
        {
            continue;
        }
        debug!(run_uid = %id.run_uid, attempt = id.attempt, "unregistering a function that left this worker");
        let request = rs::UnregisterFunctionRequest {
            registration_id: function.registration_id,
            id: None,
        };
        if let Err(status) = context.functions.clone().unregister_function(request).await {
            warn!(run_uid = %id.run_uid, error = %status, "UnregisterFunction failed");
        }
    }
    // As for executions: what the snapshot calls left over is confirmed under the lock.
    let assigned_now = attempts_now(context, false);
    context.registrations.retain(|uid, registration| {
        !left_over(registration.attempt, assigned_now.get(uid).copied())
            || !left_over(registration.attempt, attempt_now(context, uid, false))
    });
}

#[cfg(test)]
mod tests {
    use super::left_over;

    #[test]
    fn only_older_attempts_and_runs_gone_from_the_view_are_left_over() {
        assert!(left_over(1, None), "the Run left this worker");
        assert!(left_over(1, Some(2)), "an earlier attempt");
        assert!(!left_over(2, Some(2)), "the current attempt");
        assert!(!left_over(3, Some(2)), "newer than the view: never touched");
    }
}
