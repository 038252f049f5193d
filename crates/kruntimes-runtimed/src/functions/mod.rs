//! The function-mode lifecycle of the Runs assigned to this worker (design document 000,
//! "Lifecycle State Machine" and "Cleanup and Finalization").
//!
//! `Scheduled → Running (registering) → Ready`, then one of the terminal phases:
//!
//! - **Claim**: add the `kruntimes.io/registration-cleanup` finalizer, then write Running
//!   with `startTime`, `attempt` and `Ready=False/Registering`.
//! - **Register**: `RegisterFunction` on the runtime server with the Run UID and attempt.
//!   The call is idempotent for the same attempt, so a reconcile after a restart or an
//!   uncertain answer repeats it safely and gets the same registration ID back.
//! - **Ready**: `phase: Ready`, `status.endpoint` (HTTPS URL of the gateway and the CA
//!   bundle) and `Ready=True/FunctionRegistered`. The registration ID stays in
//!   [`Registrations`], never in status.
//! - **While Ready**: each reconcile asks `FunctionStatus`. A fatal error or a registration
//!   the runtime server no longer knows is an infrastructure failure (retry per
//!   `retryPolicy`, else Failed). `spec.timeout` counts from `startTime` and ends the Run
//!   Timeout; `idleTimeoutSeconds` counts from the runtime server's last-activity time of
//!   this generation (never written to status) and ends it Timeout/IdleTimeout.
//! - **Stop** (cancel, timeouts): stop accepting invokes, `UnregisterFunction` (which kills
//!   an in-flight invocation and removes the workspace), then write the terminal phase with
//!   `Ready=False`; the capacity is free once the phase is terminal.
//! - **Registration failure**: a malformed request ends Failed (InvalidSpec); anything else
//!   is `RegistrationFailed`, retried per `retryPolicy` on a fresh attempt.
//! - **Deletion**: stop accepting, unregister (idempotent), forget, remove the finalizer.
//!   Every step repeats safely after a restart of runtimed.

pub mod invoke;

use std::collections::HashMap;
use std::sync::RwLock;
use std::time::{Duration, SystemTime};

use k8s_openapi::jiff::Timestamp;
use kruntimes_api::lifecycle::{
    self, REGISTRATION_FINALIZER, bounded_message, now_rfc3339, set_ready,
};
use kruntimes_api::run::{ByteString, EndpointProtocol, RunEndpoint};
use kruntimes_api::{Phase, Run, RunStatus};
use kruntimes_proto::runtime::v1 as rs;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use tonic::Code;
use tracing::{debug, info};

use crate::reconcile::{Context, Error, source_and_env, wants_immediate_stop, write_status};
use crate::tasks::executions::Key;

/// A Ready function is looked at least this often (fatal errors, timers).
const HEALTH_EVERY: Duration = Duration::from_secs(10);
/// How long loading a handler may take.
const LOAD_TIMEOUT: Duration = Duration::from_secs(30);

/// The Ready condition's reason while registered.
pub const REGISTERED_REASON: &str = "FunctionRegistered";

/// Where a Ready function is reached: the gateway's URL and the CA bundle that verifies it.
#[derive(Debug, Clone)]
pub struct EndpointConfig {
    /// `https://HOST:PORT` of the gateway.
    pub gateway_url: String,
    /// PEM, at most 16 KiB; `None` when the gateway's certificate chains to a root the
    /// clients already trust.
    pub ca_bundle: Option<String>,
}

/// One local registration: the runtime server's opaque ID for one attempt of one Run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    pub attempt: u32,
    pub id: String,
    /// False once cancellation, a timeout or deletion began: invokes are refused.
    pub accepting: bool,
}

/// The registrations of this worker, by Run UID. Bounded by the Runs assigned here.
#[derive(Debug, Default)]
pub struct Registrations {
    map: RwLock<HashMap<String, Registration>>,
}

impl Registrations {
    pub fn get(&self, uid: &str) -> Option<Registration> {
        self.map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(uid)
            .cloned()
    }

    fn with<T>(&self, f: impl FnOnce(&mut HashMap<String, Registration>) -> T) -> T {
        f(&mut self
            .map
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    fn set(&self, uid: &str, registration: Registration) {
        self.with(|m| m.insert(uid.to_string(), registration));
    }

    fn stop_accepting(&self, uid: &str) {
        self.with(|m| {
            if let Some(r) = m.get_mut(uid) {
                r.accepting = false;
            }
        });
    }

    pub fn remove(&self, uid: &str) {
        self.with(|m| m.remove(uid));
    }

    /// Keeps only the registrations for which `keep` holds (one lock).
    pub(crate) fn retain(&self, mut keep: impl FnMut(&str, &Registration) -> bool) {
        self.with(|m| m.retain(|uid, r| keep(uid, r)));
    }

    /// Every Run UID with a registration.
    pub fn uids(&self) -> Vec<String> {
        self.with(|m| m.keys().cloned().collect())
    }
}

/// One reconcile of a function Run assigned to (and fenced for) this worker.
pub(crate) async fn reconcile(run: &Run, key: Key, context: &Context) -> Result<Action, Error> {
    if run.metadata.deletion_timestamp.is_some() {
        return finalize(run, &key, context).await;
    }
    match run.phase() {
        Phase::Scheduled => claim(run, key, context).await,
        Phase::Running | Phase::Ready => serve(run, key, context).await,
        // Not ours yet, or a phase function Runs never reach.
        Phase::Pending | Phase::Finalizing | Phase::Suspended => Ok(Action::await_change()),
        Phase::Succeeded | Phase::Failed | Phase::Timeout | Phase::Cancelled => {
            // Ended (possibly by another writer): nothing may stay registered.
            if context.registrations.get(&key.uid).is_some() {
                unregister(context, &key).await?;
            }
            Ok(Action::await_change())
        }
    }
}

/// Scheduled: add the finalizer, then claim (Running, Ready=False/Registering), register.
async fn claim(run: &Run, key: Key, context: &Context) -> Result<Action, Error> {
    if wants_immediate_stop(run) {
        return end(
            run,
            context,
            Phase::Cancelled,
            "Cancelled",
            "termination Immediate was requested before the function was registered",
        )
        .await;
    }
    let run = match add_finalizer(run, context).await? {
        Some(run) => run,
        None => return Ok(Action::await_change()),
    };
    let Some(claimed) = write_claim(&run, &key, context).await? else {
        return Ok(Action::await_change());
    };
    debug!(run = %claimed.name_any(), attempt = key.attempt, "function Run claimed");
    serve(&claimed, key, context).await
}

/// Claims a function or session Run: Running, `startTime`, `attempt` and
/// `Ready=False/Registering`. The Run as written, or `None` when it changed meanwhile.
pub(crate) async fn write_claim(
    run: &Run,
    key: &Key,
    context: &Context,
) -> Result<Option<Run>, Error> {
    let mut claimed = run.clone();
    let generation = claimed.meta().generation;
    let status = claimed.status.get_or_insert_with(RunStatus::default);
    status.phase = Some(Phase::Running);
    status.start_time = Some(now_rfc3339());
    status.attempt =
        Some(i32::try_from(crate::tasks::executions::attempt_of(key.attempt)).unwrap_or(1));
    set_ready(status, false, "Registering", "", generation);
    write_status(context, &claimed).await
}

/// Running or Ready: make sure the registration stands, then write Ready or enforce the
/// timers and the registration's health.
async fn serve(run: &Run, key: Key, context: &Context) -> Result<Action, Error> {
    if wants_immediate_stop(run) {
        return stop(
            run,
            &key,
            context,
            Phase::Cancelled,
            "Cancelled",
            "termination Immediate was requested",
        )
        .await;
    }
    let deadline = deadline(run);
    if let Some(left) = deadline
        && left.is_zero()
    {
        let message = format!(
            "registered longer than its spec.timeout of {}",
            run.spec.timeout.as_deref().unwrap_or_default()
        );
        return stop(run, &key, context, Phase::Timeout, "Timeout", &message).await;
    }
    let registration = match context.registrations.get(&key.uid) {
        Some(r) if r.attempt == key.attempt => r,
        _ => match register(run, &key, context).await {
            Ok(registration) => registration,
            Err(failure) => return registration_failed(run, &key, context, failure).await,
        },
    };
    if run.phase() == Phase::Running || !lifecycle::is_ready(run.status.as_ref()) {
        return publish_ready(run, context, deadline).await;
    }
    // Ready: ask the runtime server how the registration is.
    let status = context
        .functions
        .clone()
        .function_status(rs::FunctionStatusRequest {
            registration_id: registration.id.clone(),
        })
        .await;
    let status = match status {
        Ok(status) => status.into_inner(),
        Err(status) if status.code() == Code::NotFound => {
            context.registrations.remove(&key.uid);
            return lost(
                run,
                &key,
                context,
                "RegistrationLost",
                "the runtime server no longer holds the registration",
            )
            .await;
        }
        Err(status) => {
            return Err(Error::RuntimeServer {
                call: "FunctionStatus",
                status,
            });
        }
    };
    if status.state() == rs::FunctionState::Failed {
        let message = format!("{}: {}", status.reason, status.message);
        return lost(run, &key, context, "RegistrationFailed", &message).await;
    }
    let mut next = deadline.unwrap_or(HEALTH_EVERY).min(HEALTH_EVERY);
    if let Some(idle) = idle_timeout(run) {
        let idle_for = status
            .last_activity
            .and_then(|t| SystemTime::try_from(t).ok())
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .unwrap_or(Duration::ZERO);
        if status.in_flight == 0 && idle_for >= idle {
            let message = format!(
                "no invocation for {}s (idleTimeoutSeconds)",
                idle_for.as_secs()
            );
            return stop(run, &key, context, Phase::Timeout, "IdleTimeout", &message).await;
        }
        // An in-flight invocation keeps it active; look again one idle period on.
        let left = if status.in_flight > 0 {
            idle
        } else {
            idle - idle_for
        };
        next = next.min(left);
    }
    Ok(Action::requeue(next.max(Duration::from_millis(10))))
}

/// What `spec.timeout` leaves from `startTime` on, if it is set.
pub(crate) fn deadline(run: &Run) -> Option<Duration> {
    let limit = kruntimes_api::duration::parse(run.spec.timeout.as_deref()?).ok()?;
    let started: Timestamp = run.status.as_ref()?.start_time.as_deref()?.parse().ok()?;
    let elapsed = Duration::try_from(started.duration_until(Timestamp::now())).unwrap_or_default();
    Some(limit.saturating_sub(elapsed))
}

fn idle_timeout(run: &Run) -> Option<Duration> {
    let seconds = run.spec.mode.function.as_ref()?.idle_timeout_seconds?;
    Some(Duration::from_secs(u64::try_from(seconds).ok()?.max(1)))
}

/// Why a registration did not stand.
struct Failure {
    /// A malformed request: the Run can never register; no retry.
    invalid: bool,
    message: String,
}

/// `RegisterFunction` for the Run's attempt (idempotent), recorded locally.
async fn register(run: &Run, key: &Key, context: &Context) -> Result<Registration, Failure> {
    let function = run.spec.mode.function.as_ref().ok_or_else(|| Failure {
        invalid: true,
        message: "the Run has no function mode".to_string(),
    })?;
    let (files, env) = source_and_env(run, &source_path(&function.handler, context));
    let request = rs::RegisterFunctionRequest {
        id: Some(key.id()),
        files,
        handler: function.handler.clone(),
        env,
        load_timeout: prost_types::Duration::try_from(LOAD_TIMEOUT).ok(),
        concurrency: u32::try_from(run.spec.function_concurrency()).unwrap_or(1),
    };
    let started = std::time::Instant::now();
    match context.functions.clone().register_function(request).await {
        Ok(status) => {
            let status = status.into_inner();
            context
                .metrics
                .registration(Some(started.elapsed().as_secs_f64()));
            let registration = Registration {
                attempt: key.attempt,
                id: status.registration_id,
                accepting: true,
            };
            context.registrations.set(&key.uid, registration.clone());
            info!(
                runtime = %run.spec.runtime,
                run = %run.name_any(),
                run_uid = %key.uid,
                attempt = key.attempt,
                elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
                "function registered"
            );
            Ok(registration)
        }
        Err(status) => {
            context.metrics.registration(None);
            Err(Failure {
                invalid: status.code() == Code::InvalidArgument,
                message: bounded_message(status.message()),
            })
        }
    }
}

/// The file the inline source is written to: for python the handler's module
/// (`pkg.mod:fn` → `pkg/mod.py`), for bash the handler itself.
fn source_path(handler: &str, context: &Context) -> String {
    match context.adapter.as_str() {
        "python" => {
            let module = match handler.split_once(':') {
                Some((module, _)) => module,
                None => handler.rsplit_once('.').map_or(handler, |(m, _)| m),
            };
            format!("{}.py", module.replace('.', "/"))
        }
        _ => handler.to_string(),
    }
}

/// Writes Ready: the endpoint and `Ready=True`.
async fn publish_ready(
    run: &Run,
    context: &Context,
    deadline: Option<Duration>,
) -> Result<Action, Error> {
    if write_ready(
        run,
        context,
        lifecycle::function_invoke_url,
        REGISTERED_REASON,
    )
    .await?
    {
        debug!(run = %run.name_any(), "function Ready");
    }
    let next = deadline.unwrap_or(HEALTH_EVERY).min(HEALTH_EVERY);
    let next = idle_timeout(run).map_or(next, |idle| next.min(idle));
    Ok(Action::requeue(next.max(Duration::from_millis(10))))
}

/// Writes `phase: Ready`, the endpoint (the gateway's URL made by `url` from the gateway,
/// namespace, Runtime and Run UID, and the CA bundle) and `Ready=True` with `reason`;
/// whether it was written.
pub(crate) async fn write_ready(
    run: &Run,
    context: &Context,
    url: fn(&str, &str, &str, &str) -> String,
    reason: &str,
) -> Result<bool, Error> {
    let mut ready = run.clone();
    let generation = ready.meta().generation;
    let uid = run.uid().unwrap_or_default();
    let status = ready.status.get_or_insert_with(RunStatus::default);
    status.phase = Some(Phase::Ready);
    status.reason = None;
    status.message = None;
    status.endpoint = context.endpoint.as_ref().map(|endpoint| RunEndpoint {
        protocol: EndpointProtocol::Https,
        url: url(
            &endpoint.gateway_url,
            &run.namespace().unwrap_or_default(),
            &run.spec.runtime,
            &uid,
        ),
        ca_bundle: endpoint
            .ca_bundle
            .as_ref()
            .map(|pem| ByteString(pem.clone().into_bytes())),
    });
    set_ready(status, true, reason, "", generation);
    Ok(write_status(context, &ready).await?.is_some())
}

/// Registration failed: Failed for a malformed request, else retried per `retryPolicy`.
async fn registration_failed(
    run: &Run,
    key: &Key,
    context: &Context,
    failure: Failure,
) -> Result<Action, Error> {
    if failure.invalid {
        unregister(context, key).await?;
        return end(run, context, Phase::Failed, "InvalidSpec", &failure.message).await;
    }
    lost(run, key, context, "RegistrationFailed", &failure.message).await
}

/// The registration failed or vanished: unregister what is left, then retry the Run on a
/// fresh attempt, or end it Failed when no attempt is left.
async fn lost(
    run: &Run,
    key: &Key,
    context: &Context,
    reason: &str,
    message: &str,
) -> Result<Action, Error> {
    unregister(context, key).await?;
    write_retry(run, context, reason, message).await
}

/// A registration that failed before it served (or a function's that vanished): records
/// the infrastructure failure, so the Run goes back to Pending for a fresh attempt, or ends
/// Failed when `retryPolicy` allows no more.
pub(crate) async fn write_retry(
    run: &Run,
    context: &Context,
    reason: &str,
    message: &str,
) -> Result<Action, Error> {
    let mut updated = run.clone();
    let generation = updated.meta().generation;
    let status = updated.status.get_or_insert_with(RunStatus::default);
    // Back to Pending or Failed: Ready=False with `reason` either way.
    let decision =
        lifecycle::record_infrastructure_failure(&run.spec, status, reason, message, generation);
    info!(run = %run.name_any(), reason, ?decision, "registration failed");
    write_status(context, &updated).await?;
    Ok(Action::await_change())
}

/// Stops serving and ends the Run in `phase`.
async fn stop(
    run: &Run,
    key: &Key,
    context: &Context,
    phase: Phase,
    reason: &str,
    message: &str,
) -> Result<Action, Error> {
    unregister(context, key).await?;
    end(run, context, phase, reason, message).await
}

/// Writes a terminal phase with `Ready=False`.
pub(crate) async fn end(
    run: &Run,
    context: &Context,
    phase: Phase,
    reason: &str,
    message: &str,
) -> Result<Action, Error> {
    write_end(run, context, phase, reason, message).await?;
    Ok(Action::await_change())
}

/// Writes the terminal `phase` with `Ready=False`; whether it was written (false on a
/// conflict: the watch brings the newer Run).
pub(crate) async fn write_end(
    run: &Run,
    context: &Context,
    phase: Phase,
    reason: &str,
    message: &str,
) -> Result<bool, Error> {
    let mut ended = run.clone();
    let generation = ended.meta().generation;
    let status = ended.status.get_or_insert_with(RunStatus::default);
    status.phase = Some(phase);
    status.reason = Some(reason.to_string());
    status.message = (!message.is_empty()).then(|| bounded_message(message));
    status.completion_time = Some(now_rfc3339());
    lifecycle::leave_ready(&run.spec, status, reason, message, generation);
    let written = write_status(context, &ended).await?.is_some();
    if written {
        info!(run = %run.name_any(), %phase, reason, "Run ended");
    }
    Ok(written)
}

/// Stops accepting invokes and unregisters every attempt of the Run up to `key`'s, on the
/// runtime server (idempotent) and locally.
pub(crate) async fn unregister(context: &Context, key: &Key) -> Result<(), Error> {
    unregister_within(context, key, None).await
}

/// [`unregister`], the call bounded by `timeout` when given.
pub(crate) async fn unregister_within(
    context: &Context,
    key: &Key,
    timeout: Option<Duration>,
) -> Result<(), Error> {
    context.registrations.stop_accepting(&key.uid);
    let mut call = tonic::Request::new(rs::UnregisterFunctionRequest {
        registration_id: String::new(),
        id: Some(key.id()),
    });
    if let Some(timeout) = timeout {
        call.set_timeout(timeout);
    }
    context
        .functions
        .clone()
        .unregister_function(call)
        .await
        .map_err(|status| Error::RuntimeServer {
            call: "UnregisterFunction",
            status,
        })?;
    context.registrations.remove(&key.uid);
    Ok(())
}

/// Adds the registration-cleanup finalizer unless it is there; the Run as written, or
/// `None` when it changed meanwhile (the watch brings the new version).
pub(crate) async fn add_finalizer(run: &Run, context: &Context) -> Result<Option<Run>, Error> {
    if run.finalizers().iter().any(|f| f == REGISTRATION_FINALIZER) {
        return Ok(Some(run.clone()));
    }
    let mut finalizers = run.finalizers().to_vec();
    finalizers.push(REGISTRATION_FINALIZER.to_string());
    patch_finalizers(run, context, finalizers).await
}

/// Deletion: stop accepting, unregister, forget, then remove the finalizer.
async fn finalize(run: &Run, key: &Key, context: &Context) -> Result<Action, Error> {
    if !run.finalizers().iter().any(|f| f == REGISTRATION_FINALIZER) {
        return Ok(Action::await_change());
    }
    unregister(context, key).await?;
    let finalizers = run
        .finalizers()
        .iter()
        .filter(|f| *f != REGISTRATION_FINALIZER)
        .cloned()
        .collect();
    if patch_finalizers(run, context, finalizers).await?.is_some() {
        info!(run = %run.name_any(), "function Run cleaned up; finalizer removed");
    }
    Ok(Action::await_change())
}

/// Replaces `metadata.finalizers`, conditional on the Run's resourceVersion.
pub(crate) async fn patch_finalizers(
    run: &Run,
    context: &Context,
    finalizers: Vec<String>,
) -> Result<Option<Run>, Error> {
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": run.resource_version(),
            "finalizers": finalizers,
        }
    });
    let name = run.name_any();
    match context
        .api()
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(written) => Ok(Some(written)),
        Err(kube::Error::Api(status)) if status.code == 409 || status.code == 404 => Ok(None),
        Err(source) => Err(Error::WriteStatus {
            namespace: context.namespace.clone(),
            name,
            source,
        }),
    }
}
