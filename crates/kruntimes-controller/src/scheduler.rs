//! The scheduler: places Pending Runs on the ready workers of their Runtime.
//!
//! It is a kube-runtime [`Controller`] over Runtimes. A change to any Run or to any worker
//! Pod of a Runtime requeues that Runtime; the controller never runs two reconciles of one
//! Runtime at once and folds the triggers that arrive meanwhile into one more pass. So under
//! load one pass places a whole batch.
//!
//! Each pass is level-based: it lists the Runtime's non-terminal Runs and its Pods from the
//! API server (fresh, not from a watch cache, so that its own writes of the previous pass
//! are always counted), computes a [`placement::plan`], and writes each placement to the
//! Run's status subresource with the `resourceVersion` it read. A 409 means the Run changed
//! meanwhile (cancelled, deleted, or scheduled by a previous leader); the pass leaves it and
//! the next pass re-reads it. Capacity is never overcommitted because only the leader
//! schedules and a pass counts every Run that holds capacity before placing any.
//!
//! It never starts, claims or ends Runs: runtimed moves them on from Scheduled.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kruntimes_api::run::RunCondition;
use kruntimes_api::{Phase, Run, Runtime};
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tracing::{debug, warn};

use crate::error::{Error, is_conflict, is_not_found};
use crate::placement::{self, Placement};
use crate::status::{now_rfc3339, set_condition};

/// The label that ties a worker Pod to its Runtime.
pub const RUNTIME_LABEL: &str = "kruntimes.io/runtime";
/// The condition type the scheduler sets.
pub const SCHEDULED_CONDITION: &str = "Scheduled";
/// Status writes in flight at once within one pass.
const WRITE_CONCURRENCY: usize = 16;
/// Page size of the scheduler's lists.
const LIST_PAGE: u32 = 500;
/// How soon a pass that met a conflict runs again (the change that caused it also
/// triggers a pass through the watch; this bounds the wait if that event is late).
const CONFLICT_REQUEUE: Duration = Duration::from_millis(200);
/// How soon a pass that failed runs again.
const ERROR_REQUEUE: Duration = Duration::from_secs(1);

/// What each scheduler pass needs.
pub(crate) struct Context {
    pub client: Client,
    /// The identity of this controller-manager, written into the Scheduled condition.
    pub identity: String,
}

/// Runs the scheduler until its watches end. Cancel it by dropping the future.
pub(crate) async fn run(client: Client, identity: String) -> Result<(), Error> {
    let runtimes = Api::<Runtime>::all(client.clone());
    let runs = Api::<Run>::all(client.clone());
    let pods = Api::<Pod>::all(client.clone());
    let context = Arc::new(Context { client, identity });
    Controller::new(runtimes, watcher::Config::default())
        .watches(runs, watcher::Config::default(), |run: Run| {
            let namespace = run.namespace()?;
            Some(ObjectRef::<Runtime>::new(&run.spec.runtime).within(&namespace))
        })
        .watches(
            pods,
            watcher::Config::default().labels(RUNTIME_LABEL),
            |pod: Pod| {
                let namespace = pod.namespace()?;
                let runtime = pod.labels().get(RUNTIME_LABEL)?;
                Some(ObjectRef::<Runtime>::new(runtime).within(&namespace))
            },
        )
        .run(reconcile, error_policy, context)
        .for_each(|result| async move {
            match result {
                Ok((object, _)) => debug!(runtime = %object, "scheduler pass done"),
                // A Run or Pod names a Runtime that does not exist (yet): nothing to place.
                Err(kube::runtime::controller::Error::ObjectNotFound(object)) => {
                    debug!(runtime = %object, "no such Runtime; its Runs wait")
                }
                Err(error) => warn!(error = %error, "scheduler pass failed"),
            }
        })
        .await;
    Err(Error::ControllerStopped {
        controller: "scheduler",
    })
}

fn error_policy(runtime: Arc<Runtime>, error: &Error, _: Arc<Context>) -> Action {
    warn!(runtime = %runtime.name_any(), error = %error, "scheduler pass failed; retrying");
    Action::requeue(ERROR_REQUEUE)
}

/// Lists every object that matches `params`, following continue tokens.
pub(crate) async fn list_all<K>(
    api: &Api<K>,
    params: ListParams,
    what: &'static str,
    namespace: &str,
) -> Result<Vec<K>, Error>
where
    K: Clone + DeserializeOwned + std::fmt::Debug,
{
    let mut params = params.limit(LIST_PAGE);
    let mut items = Vec::new();
    loop {
        let page = api.list(&params).await.map_err(|source| Error::List {
            what,
            namespace: namespace.to_string(),
            source,
        })?;
        items.extend(page.items);
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(items),
        }
    }
}

/// The field selector of a Runtime's non-terminal Runs.
fn non_terminal_runs_of(runtime: &str) -> String {
    let mut selector = format!("spec.runtime={runtime}");
    for phase in Phase::ALL {
        if phase.is_terminal() {
            selector.push_str(",status.phase!=");
            selector.push_str(phase.as_str());
        }
    }
    selector
}

/// One scheduler pass over one Runtime.
async fn reconcile(runtime: Arc<Runtime>, context: Arc<Context>) -> Result<Action, Error> {
    let name = runtime.name_any();
    let namespace = runtime.namespace().ok_or_else(|| Error::MissingField {
        kind: "Runtime",
        name: name.clone(),
        field: "metadata.namespace",
    })?;
    let runs_api = Api::<Run>::namespaced(context.client.clone(), &namespace);
    let pods_api = Api::<Pod>::namespaced(context.client.clone(), &namespace);
    // Fresh reads, not a watch cache: every placement written by an earlier pass is counted.
    let pods = list_all(
        &pods_api,
        ListParams::default().labels(&format!("{RUNTIME_LABEL}={name}")),
        "pods",
        &namespace,
    )
    .await?;
    let runs = list_all(
        &runs_api,
        ListParams::default().fields(&non_terminal_runs_of(&name)),
        "runs",
        &namespace,
    )
    .await?;
    // A retried Run waits out its backoff before it is placed again.
    let mut wake: Option<Duration> = None;
    let runs: Vec<Run> = runs
        .into_iter()
        .filter(|run| {
            let pending = matches!(run.phase(), Phase::Pending);
            match kruntimes_api::lifecycle::backoff_until(&run.spec, run.status.as_ref()) {
                Some(until) if pending => {
                    let left = kruntimes_api::lifecycle::until(until);
                    wake = Some(wake.map_or(left, |w| w.min(left)));
                    false
                }
                Some(_) | None => true,
            }
        })
        .collect();
    let plan = placement::plan(runtime.spec.runs_per_worker(), &pods, &runs);
    for &index in &plan.never_fits {
        warn!(
            run = %runs[index].name_any(),
            runtime = %name,
            requested = runs[index].spec.requested_runs(),
            runs_per_worker = runtime.spec.runs_per_worker(),
            "Run asks for more run slots than a worker of its Runtime has; it stays Pending"
        );
    }
    let idle = || wake.map_or_else(Action::await_change, Action::requeue);
    if plan.placements.is_empty() {
        return Ok(idle());
    }
    let results: Vec<Result<(), (String, kube::Error)>> = futures::stream::iter(plan.placements)
        .map(|placement| {
            bind(
                &runs_api,
                &runs[placement.run],
                placement,
                &context.identity,
            )
        })
        .buffer_unordered(WRITE_CONCURRENCY)
        .collect()
        .await;
    let mut conflicts = 0usize;
    let mut bound = 0usize;
    let mut first_error = None;
    for result in results {
        match result {
            Ok(()) => bound += 1,
            Err((_, error)) if is_conflict(&error) || is_not_found(&error) => conflicts += 1,
            Err(failure) => {
                first_error.get_or_insert(failure);
            }
        }
    }
    debug!(
        runtime = %name,
        namespace = %namespace,
        placed = bound,
        conflicts,
        waiting = plan.waiting,
        "scheduler pass"
    );
    if let Some((run, source)) = first_error {
        return Err(Error::WriteRunStatus {
            namespace,
            name: run,
            source,
        });
    }
    Ok(if conflicts > 0 {
        Action::requeue(wake.map_or(CONFLICT_REQUEUE, |w| w.min(CONFLICT_REQUEUE)))
    } else {
        idle()
    })
}

/// Writes one placement: phase Scheduled, the assigned Pod and its UID, and the Scheduled
/// condition, through the status subresource with the Run's `resourceVersion` as read.
async fn bind(
    api: &Api<Run>,
    run: &Run,
    placement: Placement,
    identity: &str,
) -> Result<(), (String, kube::Error)> {
    let name = run.name_any();
    let mut updated = run.clone();
    let generation = updated.meta().generation;
    let status = updated.status.get_or_insert_with(Default::default);
    status.phase = Some(Phase::Scheduled);
    status.assigned_pod = Some(placement.pod_name.clone());
    status.assigned_pod_uid = Some(placement.pod_uid.clone());
    set_condition(
        &mut status.conditions,
        RunCondition {
            type_: SCHEDULED_CONDITION.to_string(),
            status: "True".to_string(),
            reason: Some("Scheduled".to_string()),
            message: Some(format!(
                "assigned to Pod {} by {identity}",
                placement.pod_name
            )),
            last_transition_time: Some(now_rfc3339()),
            observed_generation: generation,
        },
    );
    match api
        .replace_status(&name, &PostParams::default(), &updated)
        .await
    {
        Ok(_) => {
            debug!(run = %name, pod = %placement.pod_name, "Run scheduled");
            Ok(())
        }
        Err(error) => {
            if is_conflict(&error) {
                debug!(run = %name, "Run changed since it was read; the next pass re-reads it");
            }
            Err((name, error))
        }
    }
}
