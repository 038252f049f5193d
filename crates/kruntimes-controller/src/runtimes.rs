//! The Runtime controller: keeps each Runtime's workers in line with its spec through the
//! [`WorkerProvisioner`], and keeps `Runtime.status` fresh.
//!
//! It is a kube-runtime [`Controller`] over Runtimes that also watches the worker Pods
//! (label [`RUNTIME_LABEL`]), so a worker that becomes ready or goes away requeues its
//! Runtime, and the Kubernetes provisioner's Deployments, whose status changes do too. It does not watch Runs: `status.usedRuns` is the scheduler's to write, from its
//! own Run cache, in every pass it makes. Each pass:
//!
//! 1. calls [`WorkerProvisioner::reconcile`] (none while the Runtime is being deleted);
//! 2. says on the Runtime which worker template fields the provisioner ignores
//!    ([`crate::ignored`]: the `ImageIgnored` condition and an Event), and whether the
//!    provisioner could provision it ([`crate::provisioned`]: the `Provisioned` condition,
//!    and an Event when it turns `False`), in one write; a failure the provisioner calls
//!    permanent ends the pass here and waits for a change of the Runtime (or the resync,
//!    or its own retry) rather than the 1 s error requeue;
//! 3. lists the Runtime's Pods and writes `status.readyReplicas` (Pods that
//!    [`placement::is_ready_worker`] accepts), `status.totalRuns` (ready × `spec.runs`), and
//!    for the scale subresource `status.replicas` (workers that exist) and
//!    `status.selector`, only when they changed.
//!
//! `spec.replicas` of a Runtime with `spec.scaling` is written by the scheduler's
//! autoscaler (`autoscale.rs`); this controller keeps that many workers like any other.
//!
//! Deletion: the controller adds the finalizer [`WORKERS_FINALIZER`] to every Runtime, and
//! on deletion calls [`WorkerProvisioner::cleanup`] before it removes the finalizer, so the
//! workers are stopped before the Runtime goes away. When its identity may not patch
//! Runtimes (403), it runs without the finalizer and cleans up on the watch's delete event
//! instead; Pods of Runtimes that are gone (also after a restart or a missed delete) are
//! found through the Pod watch and the Runtime watch's relists and cleaned up too.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kruntimes_api::Runtime;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::finalizer::{self, Event as Finalizer, finalizer};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher::{self, Event};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::error::Error;
use crate::events::Events;
use crate::placement;
use crate::provisioned::{Change, Written};
use crate::provisioner::{Failure, Retry, WorkerProvisioner};
use crate::scheduler::{RUNTIME_LABEL, list_all};

/// The finalizer that holds a Runtime until its workers are stopped.
pub const WORKERS_FINALIZER: &str = "kruntimes.io/workers";
/// How soon a failed pass runs again.
const ERROR_REQUEUE: Duration = Duration::from_secs(1);
/// A pass runs at least this often, as a safety net; every change triggers one anyway.
const RESYNC: Duration = Duration::from_secs(300);

/// What one pass of the Runtime controller can fail with.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError<E: std::error::Error + 'static> {
    /// The provisioner failed.
    #[error("the worker provisioner failed for Runtime {namespace}/{name}")]
    Provisioner {
        namespace: String,
        name: String,
        #[source]
        source: E,
    },
    /// Listing Pods or Runs failed, or the Runtime lacks a field.
    #[error(transparent)]
    Api(#[from] Error),
    /// Writing `Runtime.status` failed.
    #[error("failed to write the status of Runtime {namespace}/{name}")]
    WriteStatus {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// Adding or removing the finalizer failed.
    #[error("finalizer of Runtime {namespace}/{name}: {message}")]
    Finalizer {
        namespace: String,
        name: String,
        message: String,
    },
}

struct Context<P> {
    client: Client,
    provisioner: Arc<P>,
    /// Set once a finalizer patch was refused with 403: clean up on delete events instead.
    no_finalizer: AtomicBool,
    events: Events,
}

/// What the cleanup side of the controller is told.
enum Gone {
    /// This Runtime was deleted (or a Pod names a Runtime that does not exist).
    Deleted(ObjectRef<Runtime>),
    /// The Runtime watch listed everything afresh: deletes may have been missed.
    Relisted,
}

/// Runs the Runtime controller until its watches end. Cancel it by dropping the future.
pub(crate) async fn run<P: WorkerProvisioner>(
    client: Client,
    provisioner: Arc<P>,
    events: Events,
) -> Result<(), Error> {
    let runtimes = Api::<Runtime>::all(client.clone());
    let pods = Api::<Pod>::all(client.clone());
    let deployments = Api::<Deployment>::all(client.clone());
    let context = Arc::new(Context {
        client,
        provisioner,
        no_finalizer: AtomicBool::new(false),
        events,
    });
    let (reader, writer) = reflector::store();
    let (gone_tx, gone_rx) = futures::channel::mpsc::unbounded::<Gone>();
    let deletes = gone_tx.clone();
    let runtime_events = reflector::reflector(
        writer,
        watcher::watcher(runtimes, watcher::Config::default()),
    )
    .default_backoff()
    .inspect_ok(move |event| match event {
        Event::Delete(runtime) => {
            let _ = deletes.unbounded_send(Gone::Deleted(ObjectRef::from_obj(runtime)));
        }
        Event::InitDone => {
            let _ = deletes.unbounded_send(Gone::Relisted);
        }
        Event::Apply(_) | Event::Init | Event::InitApply(_) => {}
    })
    .applied_objects();
    let controller = Controller::for_stream(runtime_events, reader.clone())
        .watches(
            pods,
            watcher::Config::default().labels(RUNTIME_LABEL),
            |pod: Pod| {
                let namespace = pod.namespace()?;
                let runtime = pod.labels().get(RUNTIME_LABEL)?;
                Some(ObjectRef::<Runtime>::new(runtime).within(&namespace))
            },
        )
        // The Kubernetes provisioner's Deployments: their status is the Runtime's.
        .watches(
            deployments,
            watcher::Config::default().labels(&format!(
                "{RUNTIME_LABEL},{}={}",
                crate::local::PROVISIONER_LABEL,
                crate::kubernetes::KUBERNETES_PROVISIONER
            )),
            |deployment: Deployment| {
                let namespace = deployment.namespace()?;
                let runtime = deployment.labels().get(RUNTIME_LABEL)?;
                Some(ObjectRef::<Runtime>::new(runtime).within(&namespace))
            },
        )
        .run(reconcile, error_policy, context.clone())
        .for_each(move |result| {
            let gone_tx = gone_tx.clone();
            async move {
                match result {
                    Ok((object, _)) => debug!(runtime = %object, "Runtime reconciled"),
                    // A Pod of a Runtime that is not there: clean up after the Runtime.
                    Err(controller::Error::ObjectNotFound(object)) => {
                        let mut runtime = ObjectRef::<Runtime>::new(&object.name);
                        runtime.namespace = object.namespace.clone();
                        let _ = gone_tx.unbounded_send(Gone::Deleted(runtime));
                    }
                    Err(error) => warn!(error = %error, "Runtime reconcile failed"),
                }
            }
        });
    let cleanups = gone_rx.for_each_concurrent(None, |gone| {
        let context = context.clone();
        let reader = reader.clone();
        async move {
            match gone {
                Gone::Deleted(runtime) => clean_up(&context, &reader, runtime).await,
                Gone::Relisted => sweep_orphans(&context, &reader).await,
            }
        }
    });
    // The cleanups end only when every sender is gone, i.e. after the controller ended.
    futures::future::join(controller, cleanups).await;
    Err(Error::ControllerStopped {
        controller: "runtime",
    })
}

fn error_policy<P: WorkerProvisioner>(
    runtime: Arc<Runtime>,
    error: &RuntimeError<P::Error>,
    _: Arc<Context<P>>,
) -> Action {
    warn!(runtime = %runtime.name_any(), error = %error, "Runtime reconcile failed; retrying");
    Action::requeue(ERROR_REQUEUE)
}

/// Cleans up after a Runtime that is gone, unless the store has it again (re-created under
/// the same name: the provisioner's reconcile replaces the old workers then).
async fn clean_up<P: WorkerProvisioner>(
    context: &Context<P>,
    reader: &Store<Runtime>,
    runtime: ObjectRef<Runtime>,
) {
    if runtime.extra.uid.is_none() && reader.get(&runtime).is_some() {
        return;
    }
    if let Err(error) = context.provisioner.cleanup(&runtime).await {
        warn!(runtime = %runtime, error = %error, "cleaning up after a deleted Runtime failed");
    }
}

/// After a relist: cleans up after every Runtime that worker Pods name but that no longer
/// exists.
async fn sweep_orphans<P: WorkerProvisioner>(context: &Context<P>, reader: &Store<Runtime>) {
    let api = Api::<Pod>::all(context.client.clone());
    let pods = match list_all(
        &api,
        ListParams::default().labels(RUNTIME_LABEL),
        "pods",
        "",
    )
    .await
    {
        Ok(pods) => pods,
        Err(error) => {
            warn!(error = %error, "cannot list worker Pods to find orphans");
            return;
        }
    };
    let mut orphans: Vec<ObjectRef<Runtime>> = pods
        .iter()
        .filter_map(|pod| {
            let namespace = pod.namespace()?;
            let runtime = pod.labels().get(RUNTIME_LABEL)?;
            Some(ObjectRef::<Runtime>::new(runtime).within(&namespace))
        })
        .filter(|runtime| reader.get(runtime).is_none())
        .collect();
    orphans.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    orphans.dedup();
    for runtime in orphans {
        clean_up(context, reader, runtime).await;
    }
}

async fn reconcile<P: WorkerProvisioner>(
    runtime: Arc<Runtime>,
    context: Arc<Context<P>>,
) -> Result<Action, RuntimeError<P::Error>> {
    let name = runtime.name_any();
    let namespace = runtime.namespace().ok_or_else(|| Error::MissingField {
        kind: "Runtime",
        name: name.clone(),
        field: "metadata.namespace",
    })?;
    if context.no_finalizer.load(Ordering::Relaxed) {
        return without_finalizer(&runtime, &context).await;
    }
    let api = Api::<Runtime>::namespaced(context.client.clone(), &namespace);
    let mut result = with_finalizer(&api, runtime.clone(), &context).await;
    // 422 on adding the finalizer: its JSON patch tests the finalizers this pass saw, and
    // they changed since. The cache lags the API (a status change observed while the
    // previous pass added the finalizer triggers this one with the object from before);
    // on Kubernetes too. Re-read the Runtime and go on with the current one, once.
    if let Err(finalizer::Error::AddFinalizer(kube::Error::Api(status))) = &result
        && status.code == 422
    {
        debug!(runtime = %name, namespace, "finalizers changed since the cached Runtime; re-reading it");
        match api.get_opt(&name).await {
            Ok(Some(current)) => {
                result = with_finalizer(&api, Arc::new(current), &context).await;
            }
            Ok(None) => return Ok(Action::await_change()),
            Err(error) => {
                return Err(RuntimeError::Finalizer {
                    namespace,
                    name,
                    message: format!("re-reading the Runtime failed: {error}"),
                });
            }
        }
    }
    match result {
        Ok(action) => Ok(action),
        Err(finalizer::Error::ApplyFailed(error) | finalizer::Error::CleanupFailed(error)) => {
            Err(error)
        }
        Err(finalizer::Error::AddFinalizer(kube::Error::Api(status))) if status.is_forbidden() => {
            if !context.no_finalizer.swap(true, Ordering::Relaxed) {
                warn!(
                    finalizer = WORKERS_FINALIZER,
                    "may not patch Runtimes; cleaning up workers on delete events instead of \
                     holding Runtimes with a finalizer"
                );
            }
            without_finalizer(&runtime, &context).await
        }
        Err(error) => Err(RuntimeError::Finalizer {
            namespace,
            name,
            message: error.to_string(),
        }),
    }
}

/// A pass through kube-runtime's finalizer helper: adds [`WORKERS_FINALIZER`] (and ends the
/// pass; the change triggers the next), applies, or cleans up and removes it.
async fn with_finalizer<P: WorkerProvisioner>(
    api: &Api<Runtime>,
    runtime: Arc<Runtime>,
    context: &Context<P>,
) -> Result<Action, finalizer::Error<RuntimeError<P::Error>>> {
    finalizer(api, WORKERS_FINALIZER, runtime, |event| async {
        match event {
            Finalizer::Apply(runtime) => apply(&runtime, context).await,
            Finalizer::Cleanup(runtime) => {
                cleanup(&runtime, context).await?;
                Ok(Action::await_change())
            }
        }
    })
    .await
}

/// A pass without the finalizer: a deleting Runtime (someone else's finalizer holds it) is
/// cleaned up, any other is applied.
async fn without_finalizer<P: WorkerProvisioner>(
    runtime: &Runtime,
    context: &Context<P>,
) -> Result<Action, RuntimeError<P::Error>> {
    if runtime.meta().deletion_timestamp.is_some() {
        cleanup(runtime, context).await?;
        return Ok(Action::await_change());
    }
    apply(runtime, context).await
}

async fn cleanup<P: WorkerProvisioner>(
    runtime: &Runtime,
    context: &Context<P>,
) -> Result<(), RuntimeError<P::Error>> {
    info!(runtime = %runtime.name_any(), "Runtime deleting; stopping its workers");
    context
        .provisioner
        .cleanup(&ObjectRef::from_obj(runtime))
        .await
        .map_err(|source| RuntimeError::Provisioner {
            namespace: runtime.namespace().unwrap_or_default(),
            name: runtime.name_any(),
            source,
        })
}

/// Provisions the Runtime's workers, then writes its conditions and its status if they
/// changed. A failed reconcile is said on the Runtime ([`crate::provisioned`]) and retried
/// as the provisioner's [`Failure`] says.
async fn apply<P: WorkerProvisioner>(
    runtime: &Runtime,
    context: &Context<P>,
) -> Result<Action, RuntimeError<P::Error>> {
    let name = runtime.name_any();
    let namespace = runtime.namespace().unwrap_or_default();
    let outcome = context.provisioner.reconcile(runtime).await;
    let failed = outcome.as_ref().err().map(|error| {
        (
            P::failure(error),
            kruntimes_wire::error_chain(error as &dyn std::error::Error),
        )
    });
    let mut changes = Vec::new();
    // Template fields the provisioner cannot honour are said, not dropped.
    let ignored = context.provisioner.ignored_fields(runtime);
    if let Some(condition) = crate::ignored::wanted(runtime, ignored.as_ref()) {
        let ignoring = condition.status == "True";
        changes.push(Change {
            condition,
            warning: ignoring.then_some(crate::events::IMAGE_IGNORED),
        });
    }
    let provisioned = failed
        .as_ref()
        .map(|(failure, text)| (*failure, text.as_str()));
    let turned = crate::provisioned::wanted(runtime, provisioned);
    let said_once = turned.is_some();
    if let Some(condition) = turned {
        changes.push(Change {
            warning: provisioned.map(|(failure, _)| failure.reason),
            condition,
        });
    }
    let api = Api::<Runtime>::namespaced(context.client.clone(), &namespace);
    let written =
        crate::provisioned::write_conditions(&api, &context.events, runtime, changes).await;
    let counts = match outcome {
        Ok(counts) => counts,
        Err(source) => {
            let (failure, text) = failed.unwrap_or((Failure::TRANSIENT, String::new()));
            if failure.retry == Retry::Soon {
                return Err(RuntimeError::Provisioner {
                    namespace,
                    name,
                    source,
                });
            }
            // Said on the Runtime (condition and Event) when the condition turns, and
            // logged then, not at every pass.
            if said_once {
                warn!(runtime = %name, namespace = %namespace, reason = failure.reason, error = %text, "the Runtime cannot be provisioned as it is");
            } else {
                debug!(runtime = %name, namespace = %namespace, error = %text, "the Runtime still cannot be provisioned as it is");
            }
            return Ok(match (written, failure.retry) {
                // Nothing else would start the pass that says it.
                (Written::Failed, _) => Action::requeue(ERROR_REQUEUE),
                (_, Retry::After(wait)) => Action::requeue(wait),
                // A change of the Runtime starts the next pass; the resync is the safety
                // net (the provisioner refuses before any API call, so it costs nothing).
                _ => Action::requeue(RESYNC),
            });
        }
    };
    debug!(runtime = %name, namespace = %namespace, current = counts.current, ready = counts.ready, "workers provisioned");
    write_status(runtime, context, &namespace, counts.current).await?;
    Ok(Action::requeue(RESYNC))
}

/// `readyReplicas` and `totalRuns` as the API shows them now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Observed {
    replicas: i32,
    ready_replicas: i32,
    total_runs: i32,
}

/// Writes the Runtime's worker counts if they changed.
async fn write_status<P: WorkerProvisioner>(
    runtime: &Runtime,
    context: &Context<P>,
    namespace: &str,
    current_workers: i32,
) -> Result<(), RuntimeError<P::Error>> {
    let name = runtime.name_any();
    let pods = list_all(
        &Api::<Pod>::namespaced(context.client.clone(), namespace),
        ListParams::default().labels(&format!("{RUNTIME_LABEL}={name}")),
        "pods",
        namespace,
    )
    .await?;
    let ready = pods
        .iter()
        .filter(|pod| placement::is_ready_worker(pod))
        .count();
    let ready = i32::try_from(ready).unwrap_or(i32::MAX);
    let observed = Observed {
        replicas: current_workers,
        ready_replicas: ready,
        total_runs: ready.saturating_mul(runtime.spec.runs_per_worker()),
    };
    let status = runtime.status.clone().unwrap_or_default();
    let selector = format!("{RUNTIME_LABEL}={name}");
    let current = Observed {
        replicas: if status.selector.as_deref() == Some(selector.as_str()) {
            status.replicas.unwrap_or(-1)
        } else {
            -1
        },
        ready_replicas: status.ready_replicas.unwrap_or(-1),
        total_runs: status.total_runs.unwrap_or(-1),
    };
    if current == observed {
        return Ok(());
    }
    let patch = json!({"status": {
        "replicas": observed.replicas,
        "selector": selector,
        "readyReplicas": observed.ready_replicas,
        "totalRuns": observed.total_runs,
    }});
    Api::<Runtime>::namespaced(context.client.clone(), namespace)
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|source| RuntimeError::WriteStatus {
            namespace: namespace.to_string(),
            name: name.clone(),
            source,
        })?;
    debug!(runtime = %name, namespace, ?observed, "Runtime status written");
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use kube::api::PostParams;

    use super::*;
    use crate::provisioner::WorkerCounts;
    use crate::test_support::bare_runtime;

    /// Stands in for the workers, which this test of the finalizer path does not need: it
    /// only counts the passes that reached the provisioner.
    #[derive(Default)]
    struct Counting {
        reconciles: AtomicUsize,
    }

    impl WorkerProvisioner for Counting {
        type Error = std::convert::Infallible;

        async fn reconcile(&self, _: &Runtime) -> Result<WorkerCounts, Self::Error> {
            self.reconciles.fetch_add(1, Ordering::SeqCst);
            Ok(WorkerCounts {
                current: 0,
                ready: 0,
            })
        }

        async fn cleanup(&self, _: &ObjectRef<Runtime>) -> Result<(), Self::Error> {
            Ok(())
        }
    }

    /// Stands in for a provisioner that refuses the Runtime's template until it is told
    /// the template was fixed: the Kubernetes provisioner refuses what a CRD cannot say,
    /// which the embedded API server's admission never lets through, so a real template
    /// cannot reach this path here.
    #[derive(Default)]
    struct Refusing {
        fixed: AtomicBool,
        reconciles: AtomicUsize,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("the template has no container named runtime")]
    struct Refused;

    impl WorkerProvisioner for Refusing {
        type Error = Refused;

        async fn reconcile(&self, _: &Runtime) -> Result<WorkerCounts, Refused> {
            self.reconciles.fetch_add(1, Ordering::SeqCst);
            if self.fixed.load(Ordering::SeqCst) {
                Ok(WorkerCounts::default())
            } else {
                Err(Refused)
            }
        }

        async fn cleanup(&self, _: &ObjectRef<Runtime>) -> Result<(), Refused> {
            Ok(())
        }

        fn failure(_: &Refused) -> crate::provisioner::Failure {
            crate::provisioner::Failure {
                reason: "InvalidTemplate",
                retry: Retry::OnChange,
            }
        }
    }

    /// The embedded API server in a temporary directory, and a client of it.
    async fn api_server() -> anyhow::Result<(tempfile::TempDir, kruntimes_apiserver::Server, Client)>
    {
        let dir = tempfile::tempdir()?;
        let server = kruntimes_apiserver::start(kruntimes_apiserver::Config::new(
            dir.path().to_path_buf(),
            "127.0.0.1:0".parse()?,
        ))
        .await?;
        let text = std::fs::read_to_string(server.kubeconfig_path())?;
        let kubeconfig = kube::config::Kubeconfig::from_yaml(&text)?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
        Ok((dir, server, Client::try_from(config)?))
    }

    fn context<P>(client: &Client, provisioner: P) -> Arc<Context<P>> {
        Arc::new(Context {
            events: crate::events::events(client.clone(), "test"),
            client: client.clone(),
            provisioner: Arc::new(provisioner),
            no_finalizer: AtomicBool::new(false),
        })
    }

    fn provisioned(runtime: &Runtime) -> Option<kruntimes_api::run::RunCondition> {
        runtime.status.as_ref().and_then(|s| {
            s.conditions
                .iter()
                .find(|c| c.type_ == crate::provisioned::PROVISIONED_CONDITION)
                .cloned()
        })
    }

    /// A Runtime the provisioner refuses says so (`Provisioned` `False`, reason
    /// `InvalidTemplate`, and a Warning Event) instead of only a log line, waits for a
    /// change rather than failing every second, writes nothing more while it stays
    /// refused, and turns `True` once the provisioner accepts it.
    #[tokio::test]
    async fn a_refused_runtime_says_why_on_its_status_and_waits_for_a_change() -> anyhow::Result<()>
    {
        let (_dir, server, client) = api_server().await?;
        let api = Api::<Runtime>::namespaced(client.clone(), "default");
        api.create(&PostParams::default(), &bare_runtime("rt"))
            .await?;
        let context = context(&client, Refusing::default());
        // The first pass adds the finalizer; the second reaches the provisioner.
        reconcile(Arc::new(api.get("rt").await?), context.clone()).await?;
        let action = reconcile(Arc::new(api.get("rt").await?), context.clone()).await?;
        assert_eq!(
            action,
            Action::requeue(RESYNC),
            "a refused template waits for a change (or the resync), not the error requeue"
        );
        let refused = api.get("rt").await?;
        let condition = provisioned(&refused).expect("the Provisioned condition");
        assert_eq!(condition.status, "False");
        assert_eq!(condition.reason.as_deref(), Some("InvalidTemplate"));
        assert_eq!(
            condition.message.as_deref(),
            Some("the template has no container named runtime")
        );
        let event = kruntimes_testkit::events::wait_for(
            &client,
            "default",
            "rt",
            "InvalidTemplate",
            std::time::Duration::from_secs(10),
        )
        .await?;
        assert_eq!(event.type_.as_deref(), Some("Warning"));
        // Still refused: nothing is written again.
        let action = reconcile(Arc::new(refused.clone()), context.clone()).await?;
        assert_eq!(action, Action::requeue(RESYNC));
        assert_eq!(
            api.get("rt").await?.resource_version(),
            refused.resource_version()
        );
        // Fixed: the condition turns.
        context.provisioner.fixed.store(true, Ordering::SeqCst);
        let action = reconcile(Arc::new(refused), context.clone()).await?;
        assert_eq!(action, Action::requeue(RESYNC));
        let condition = provisioned(&api.get("rt").await?).expect("the Provisioned condition");
        assert_eq!(condition.status, "True");
        assert_eq!(
            condition.reason.as_deref(),
            Some(crate::provisioned::PROVISIONED)
        );
        assert_eq!(context.provisioner.reconciles.load(Ordering::SeqCst), 3);
        server.shutdown().await
    }

    /// Regression: a pass triggered with the cached Runtime from before the previous pass
    /// added the finalizer sent the "add the first finalizer" patch again, which the API
    /// answers 422 (its test of `/metadata/finalizers` against null fails); the pass failed
    /// and the controller logged "failed to add finalizer … value did not match" for
    /// every Runtime it created. Now the pass re-reads the Runtime and applies it.
    #[tokio::test]
    async fn a_pass_with_a_runtime_cached_before_its_finalizer_applies_the_current_one()
    -> anyhow::Result<()> {
        let (_dir, server, client) = api_server().await?;
        let api = Api::<Runtime>::namespaced(client.clone(), "default");
        let stale = api
            .create(&PostParams::default(), &bare_runtime("rt"))
            .await?;
        let context = context(&client, Counting::default());
        // The first pass adds the finalizer and ends there.
        reconcile(Arc::new(stale.clone()), context.clone()).await?;
        assert_eq!(api.get("rt").await?.finalizers(), [WORKERS_FINALIZER]);
        assert_eq!(context.provisioner.reconciles.load(Ordering::SeqCst), 0);
        // The next pass sees the object from before it.
        let action = reconcile(Arc::new(stale), context.clone()).await?;
        assert_eq!(action, Action::requeue(RESYNC));
        assert_eq!(context.provisioner.reconciles.load(Ordering::SeqCst), 1);
        assert_eq!(api.get("rt").await?.finalizers(), [WORKERS_FINALIZER]);
        server.shutdown().await
    }
}
