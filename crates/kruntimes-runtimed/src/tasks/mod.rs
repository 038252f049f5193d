//! Task mode on this worker: claim a Scheduled task Run and start its execution on the
//! runtime server, wait for it in the background ([`executions`] records the result),
//! carry out cancellation, and write the ending (`Succeeded`, `Failed`, `Timeout`,
//! `Cancelled`) with its exit code, outputs and reason.

pub mod executions;

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kruntimes_api::lifecycle::{self, AfterFailure, bounded_message, now_rfc3339};
use kruntimes_api::run::ModeKind;
use kruntimes_api::{Phase, Run, RunStatus};
use kruntimes_proto::runtime::v1 as rs;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use tonic::Code;
use tracing::{debug, info, warn};

use executions::{Key, Outcome};

use crate::reconcile::{Context, Error, source_and_env, wants_immediate_stop, write_status};

/// The longest one Wait call asks the runtime server to hold.
const WAIT_LIMIT: Duration = Duration::from_secs(3600);
/// Consecutive failed Wait calls before an execution counts as lost.
const WAIT_FAILURES: u32 = 5;

/// A task Run assigned to this worker (the shared checks and the local gate are done).
pub(crate) async fn reconcile(run: &Run, key: Key, context: &Context) -> Result<Action, Error> {
    if run.metadata.deletion_timestamp.is_some() {
        // Deleted while assigned here: stop the program; the collector forgets it once the
        // Run is gone.
        if context.executions.started(&key) && context.executions.mark_cancelled(&key) {
            cancel(context, &key).await;
        }
        return Ok(Action::await_change());
    }
    match run.phase() {
        Phase::Scheduled => scheduled(run, key, context).await,
        Phase::Running => running(run, key, context).await,
        // Not assigned yet, or a phase task Runs never reach (function and session mode
        // come with their own issues), or already ended.
        Phase::Pending
        | Phase::Ready
        | Phase::Finalizing
        | Phase::Suspended
        | Phase::Succeeded
        | Phase::Failed
        | Phase::Timeout
        | Phase::Cancelled => Ok(Action::await_change()),
    }
}

/// Scheduled: claim the Run and start its execution.
async fn scheduled(run: &Run, key: Key, context: &Context) -> Result<Action, Error> {
    if wants_immediate_stop(run) {
        return finish(run, context, &key, Ending::cancelled_before_start()).await;
    }
    // The dispatcher hands function and session Runs to their modes: what comes here is a
    // task, or a Run without a single mode (which admission refuses).
    if run.spec.mode.kind() != Some(ModeKind::Task) {
        return finish(
            run,
            context,
            &key,
            Ending::Final {
                phase: Phase::Failed,
                reason: "UnsupportedMode".to_string(),
                message: "the Run sets no single mode".to_string(),
                exit_code: None,
                outputs: Default::default(),
            },
        )
        .await;
    }
    let mut claimed = run.clone();
    let status = claimed.status.get_or_insert_with(RunStatus::default);
    status.phase = Some(Phase::Running);
    status.start_time = Some(now_rfc3339());
    status.attempt =
        Some(i32::try_from(crate::tasks::executions::attempt_of(key.attempt)).unwrap_or(1));
    let claimed = match write_status(context, &claimed).await? {
        Some(claimed) => claimed,
        None => return Ok(Action::await_change()),
    };
    debug!(run = %claimed.name_any(), attempt = key.attempt, "Run claimed");
    execute(&claimed, &key, context).await;
    // The result, if it is already known, is written at once; otherwise the waiter
    // requeues the Run when the execution ends.
    running(&claimed, key, context).await
}

/// Running: make sure the execution runs and is watched; write its end once recorded.
async fn running(run: &Run, key: Key, context: &Context) -> Result<Action, Error> {
    if let Some(outcome) = context.executions.outcome(&key) {
        return finish(run, context, &key, Ending::from_outcome(outcome)).await;
    }
    if !context.executions.started(&key) {
        if wants_immediate_stop(run) {
            // Nothing runs here for it (never started, or lost with a restart): end it.
            return finish(run, context, &key, Ending::cancelled_before_start()).await;
        }
        // After a restart of runtimed: find the execution on the runtime server.
        match context
            .task
            .clone()
            .status(rs::StatusRequest {
                id: Some(key.id()),
                include_log_tails: false,
            })
            .await
        {
            Ok(found) => {
                info!(run = %run.name_any(), attempt = key.attempt, "recovered a running execution");
                adopt(context, &key, run, found.into_inner());
                if let Some(outcome) = context.executions.outcome(&key) {
                    return finish(run, context, &key, Ending::from_outcome(outcome)).await;
                }
            }
            // Claimed but never started (runtimed stopped between the two): start it now.
            // Execute is idempotent for the same identity and inputs.
            Err(status) if status.code() == Code::NotFound => {
                execute(run, &key, context).await;
                if let Some(outcome) = context.executions.outcome(&key) {
                    return finish(run, context, &key, Ending::from_outcome(outcome)).await;
                }
            }
            Err(status) => {
                return Err(Error::RuntimeServer {
                    call: "Status",
                    status,
                });
            }
        }
    }
    if wants_immediate_stop(run) && context.executions.mark_cancelled(&key) {
        cancel(context, &key).await;
    }
    Ok(Action::await_change())
}

async fn cancel(context: &Context, key: &Key) {
    if let Err(status) = context
        .task
        .clone()
        .cancel(rs::CancelRequest { id: Some(key.id()) })
        .await
    {
        warn!(run_uid = %key.uid, error = %status, "Cancel failed; the waiter reports the end");
    }
}

/// Starts the execution of a claimed Run and its waiter. Failures are recorded as
/// outcomes, never returned: the next step writes them.
async fn execute(run: &Run, key: &Key, context: &Context) {
    let request = match execute_request(run, key) {
        Ok(request) => request,
        Err(message) => {
            context.executions.record(
                key,
                Outcome::Broken {
                    infrastructure: false,
                    reason: "InvalidSpec",
                    message,
                },
            );
            return;
        }
    };
    match context.task.clone().execute(request).await {
        Ok(status) => adopt(context, key, run, status.into_inner()),
        Err(status) => {
            let (infrastructure, reason) = match status.code() {
                Code::InvalidArgument => (false, "InvalidSpec"),
                Code::AlreadyExists => (false, "ExecutionConflict"),
                _ => (true, "RuntimeServerError"),
            };
            context.executions.record(
                key,
                Outcome::Broken {
                    infrastructure,
                    reason,
                    message: bounded_message(status.message()),
                },
            );
        }
    }
}

/// Takes over an execution the runtime server reported (just started, or found after a
/// restart): records its end if it has already ended, otherwise starts its one waiter.
fn adopt(context: &Context, key: &Key, run: &Run, status: rs::ExecutionStatus) {
    if context.executions.start(key) {
        if is_terminal(status.state()) {
            context
                .executions
                .record(key, Outcome::Finished(Box::new(status)));
        } else {
            spawn_waiter(context, key, run);
        }
    }
}

/// What the runtime server is asked to run for `run`.
fn execute_request(run: &Run, key: &Key) -> Result<rs::ExecuteRequest, String> {
    let task = run
        .spec
        .mode
        .task
        .as_ref()
        .ok_or_else(|| "the Run has no task mode".to_string())?;
    // Inline source is written to the entrypoint's file, or to `script` when the task names
    // none; the runtime server runs a file it was given with the Runtime's interpreter.
    let program = task.program();
    let (files, env) = source_and_env(run, program);
    let timeout = match run.spec.timeout.as_deref() {
        None => None,
        Some(text) => {
            let limit =
                kruntimes_api::duration::parse(text).map_err(|e| format!("spec.timeout: {e}"))?;
            // The limit counts from startTime, so a recovered execution keeps its deadline.
            let elapsed = run
                .status
                .as_ref()
                .and_then(|s| s.start_time.as_deref())
                .and_then(|t| t.parse::<Timestamp>().ok())
                .and_then(|t| Duration::try_from(t.duration_until(Timestamp::now())).ok())
                .unwrap_or(Duration::ZERO);
            let left = limit.saturating_sub(elapsed).max(Duration::from_millis(1));
            Some(prost_types::Duration {
                seconds: i64::try_from(left.as_secs()).unwrap_or(i64::MAX),
                nanos: i32::try_from(left.subsec_nanos()).unwrap_or(0),
            })
        }
    };
    Ok(rs::ExecuteRequest {
        id: Some(key.id()),
        files,
        entrypoint: program.to_string(),
        args: task.args.clone(),
        env,
        timeout,
        grace_period: None,
    })
}

fn is_terminal(state: rs::ExecutionState) -> bool {
    match state {
        rs::ExecutionState::Succeeded
        | rs::ExecutionState::Failed
        | rs::ExecutionState::TimedOut
        | rs::ExecutionState::Cancelled => true,
        rs::ExecutionState::Running | rs::ExecutionState::Unspecified => false,
    }
}

/// Waits for the execution to end, records its outcome and requeues the Run.
fn spawn_waiter(context: &Context, key: &Key, run: &Run) {
    let task = context.task.clone();
    let executions = context.executions.clone();
    let requeue = context.requeue.clone();
    let key = key.clone();
    let object = ObjectRef::from_obj(run);
    tokio::spawn(async move {
        let mut failures = 0u32;
        let outcome = loop {
            let request = rs::WaitRequest {
                id: Some(key.id()),
                timeout: Some(prost_types::Duration {
                    seconds: i64::try_from(WAIT_LIMIT.as_secs()).unwrap_or(3600),
                    nanos: 0,
                }),
                include_log_tails: false,
            };
            match task.clone().wait(request).await {
                Ok(status) => {
                    let status = status.into_inner();
                    failures = 0;
                    if is_terminal(status.state()) {
                        break Outcome::Finished(Box::new(status));
                    }
                }
                Err(status) if status.code() == Code::NotFound => {
                    break Outcome::Broken {
                        infrastructure: true,
                        reason: "ExecutionLost",
                        message: "the runtime server no longer knows the execution".to_string(),
                    };
                }
                Err(status) => {
                    failures += 1;
                    if failures >= WAIT_FAILURES {
                        break Outcome::Broken {
                            infrastructure: true,
                            reason: "RuntimeServerLost",
                            message: bounded_message(&format!(
                                "the runtime server stopped answering: {}",
                                status.message()
                            )),
                        };
                    }
                    // A retry backoff for a broken connection, not synchronisation.
                    tokio::time::sleep(Duration::from_millis(200 * u64::from(failures))).await;
                }
            }
        };
        executions.record(&key, outcome);
        let _ = requeue.send(object).await;
    });
}

/// How a Run ends (or, for an infrastructure failure, leaves this worker).
#[derive(Debug, Clone)]
enum Ending {
    Final {
        phase: Phase,
        reason: String,
        message: String,
        exit_code: Option<i32>,
        outputs: std::collections::BTreeMap<String, String>,
    },
    Infrastructure {
        reason: String,
        message: String,
    },
}

impl Ending {
    fn cancelled_before_start() -> Ending {
        Ending::Final {
            phase: Phase::Cancelled,
            reason: "Cancelled".to_string(),
            message: "termination Immediate was requested before the program started".to_string(),
            exit_code: None,
            outputs: Default::default(),
        }
    }

    fn from_outcome(outcome: Outcome) -> Ending {
        match outcome {
            Outcome::Broken {
                infrastructure: true,
                reason,
                message,
            } => Ending::Infrastructure {
                reason: reason.to_string(),
                message,
            },
            Outcome::Broken {
                infrastructure: false,
                reason,
                message,
            } => Ending::Final {
                phase: Phase::Failed,
                reason: reason.to_string(),
                message,
                exit_code: None,
                outputs: Default::default(),
            },
            Outcome::Finished(status) => {
                let status = *status;
                let phase = match status.state() {
                    rs::ExecutionState::Succeeded => Phase::Succeeded,
                    rs::ExecutionState::Failed if status.retryable => {
                        return Ending::Infrastructure {
                            reason: status.reason,
                            message: status.message,
                        };
                    }
                    rs::ExecutionState::Failed => Phase::Failed,
                    rs::ExecutionState::TimedOut => Phase::Timeout,
                    rs::ExecutionState::Cancelled => Phase::Cancelled,
                    rs::ExecutionState::Running | rs::ExecutionState::Unspecified => {
                        return Ending::Infrastructure {
                            reason: "RuntimeServerError".to_string(),
                            message: "the runtime server reported an unfinished execution as ended"
                                .to_string(),
                        };
                    }
                };
                Ending::Final {
                    phase,
                    reason: status.reason,
                    message: status.message,
                    exit_code: status.exit_code,
                    outputs: status.outputs.into_iter().collect(),
                }
            }
        }
    }
}

/// Writes how the Run ends on this worker.
async fn finish(run: &Run, context: &Context, key: &Key, ending: Ending) -> Result<Action, Error> {
    let mut updated = run.clone();
    let generation = updated.meta().generation;
    let status = updated.status.get_or_insert_with(RunStatus::default);
    let mut retried = false;
    match ending {
        Ending::Final {
            phase,
            reason,
            message,
            exit_code,
            outputs,
        } => {
            // The runtime server knows only the time left when it started; say what the
            // user asked for.
            let message = match (phase, run.spec.timeout.as_deref()) {
                (Phase::Timeout, Some(limit)) => {
                    format!("ran longer than its spec.timeout of {limit}")
                }
                _ => message,
            };
            status.phase = Some(phase);
            status.reason = Some(reason);
            status.message = (!message.is_empty()).then(|| bounded_message(&message));
            status.exit_code = exit_code;
            status.outputs = outputs;
            status.completion_time = Some(now_rfc3339());
        }
        Ending::Infrastructure { reason, message } => {
            let decision = lifecycle::record_infrastructure_failure(
                &run.spec, status, &reason, &message, generation,
            );
            retried = matches!(decision, AfterFailure::Retry { .. });
            info!(run = %run.name_any(), reason = %reason, ?decision, "infrastructure failure");
        }
    }
    if write_status(context, &updated).await?.is_some() && retried {
        // The Run leaves this worker: drop what is left of this attempt here.
        context.executions.remove_run(&key.uid, None);
        forget(context, key).await;
    }
    Ok(Action::await_change())
}

pub(crate) async fn forget(context: &Context, key: &Key) {
    if let Err(status) = context
        .task
        .clone()
        .forget(rs::ForgetRequest { id: Some(key.id()) })
        .await
    {
        warn!(run_uid = %key.uid, error = %status, "Forget failed");
    }
}
