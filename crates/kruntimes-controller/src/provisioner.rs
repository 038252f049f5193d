//! The worker provisioner seam: how a Runtime's workers come to exist.
//!
//! Two implementations will stand behind this trait (ARCHITECTURE.md, "One control-plane
//! contract"): the **local provisioner**, which starts a runtimed and a runtime-server
//! process per worker and publishes one v1 Pod object per worker (label
//! `kruntimes.io/runtime`, `status.podIP`, the `Ready` condition, a fresh UID for every
//! incarnation), and the **Kubernetes provisioner**, which keeps a Deployment and a Service
//! per Runtime and lets the cluster create the Pods. The local one is [`crate::local`]; the
//! Kubernetes one is [`crate::kubernetes`].
//!
//! The scheduler never calls a provisioner: it only reads the Pods that a provisioner
//! publishes. That is what keeps scheduling the same code in both modes.

use std::future::Future;

use kruntimes_api::Runtime;
use kube::runtime::reflector::ObjectRef;

/// What a provisioner observed of a Runtime's workers after a reconcile, for
/// `Runtime.status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerCounts {
    /// Workers that exist (started, or with a Pod object).
    pub current: i32,
    /// Workers whose Pod is Ready.
    pub ready: i32,
}

/// Keeps the workers of each Runtime in line with its spec.
///
/// Implementations are level-based and idempotent, like every reconciler here: `reconcile`
/// may be called any number of times for the same Runtime and must converge on `replicas`
/// workers built from the Runtime's worker template (none while the Runtime is being
/// deleted), replacing crashed workers and deleting the Pod objects of dead ones. `cleanup`
/// runs when the Runtime is deleted and must leave no worker and no Pod object behind; it
/// gets a reference rather than the object because the Runtime may already be gone (its
/// `extra.uid`, when set, names the incarnation of the Runtime to clean up, so a Runtime
/// re-created under the same name keeps its workers). Neither writes Run status; recovery of
/// Runs on a lost worker belongs to the Run lifecycle controller, fenced by the worker's Pod
/// UID.
///
/// The trait uses `impl Future` and so is not dyn-compatible: the controller-manager is
/// generic over its provisioner.
pub trait WorkerProvisioner: Send + Sync + 'static {
    /// The error this provisioner reports; it names the Runtime and the step that failed.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Brings the Runtime's workers to its spec and reports what exists now.
    fn reconcile(
        &self,
        runtime: &Runtime,
    ) -> impl Future<Output = Result<WorkerCounts, Self::Error>> + Send;

    /// Stops every worker of a deleted Runtime and deletes their Pod objects.
    fn cleanup(
        &self,
        runtime: &ObjectRef<Runtime>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Fences every worker Pod of this provisioner's kind that this provisioner does not
    /// run: once it returns `Ok`, no such Pod is a ready worker any more (gone, or
    /// deleting and out of rotation). The controller-manager calls it each time it starts
    /// leading, before the scheduler places anything, so that a Run is never placed on a
    /// worker of an earlier incarnation whose Pod still says Ready (the local
    /// provisioner's workers die with the process that was SIGKILLed, their Pods do not).
    ///
    /// The default fences nothing: a provisioner whose Pods' readiness is kept by someone
    /// who watches the workers (the kubelet on a cluster) needs no fence.
    fn fence_unknown_workers(&self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        std::future::ready(Ok(()))
    }

    /// The fields of the Runtime's worker template this provisioner cannot honour, each
    /// as `template.FIELD` with its value where short (`template.image (python:3.12)`),
    /// and the sentence that says why. The Runtime controller reports them in the
    /// `ImageIgnored` condition and an Event on the Runtime ([`crate::ignored`]). The
    /// default honours everything.
    fn ignored_fields(&self, runtime: &Runtime) -> Option<(Vec<String>, &'static str)> {
        let _ = runtime;
        None
    }

    /// What a failed [`reconcile`](Self::reconcile) means for the Runtime: the reason of
    /// its `Provisioned` condition and when to try again ([`crate::provisioned`]). The
    /// default treats every failure as passing ([`Failure::TRANSIENT`]).
    fn failure(error: &Self::Error) -> Failure {
        let _ = error;
        Failure::TRANSIENT
    }
}

/// How the Runtime controller treats a failed reconcile: the reason it shows in the
/// Runtime's `Provisioned` condition, and when it tries again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    /// The condition's reason (and the Warning Event's), in CamelCase.
    pub reason: &'static str,
    pub retry: Retry,
}

/// When a failed reconcile runs again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Soon, with the controller's error requeue: the API failed, or a worker did not
    /// start.
    Soon,
    /// Only when the Runtime (or one of its workers) changes: the Runtime asks for what
    /// cannot be built, and asking again would only fail again.
    OnChange,
    /// After this long: something the controller does not watch is in the way (an object
    /// of another owner under a name the workers need).
    After(std::time::Duration),
}

impl Failure {
    /// A failure that passes: the API or a worker failed.
    pub const TRANSIENT: Failure = Failure {
        reason: "ProvisioningFailed",
        retry: Retry::Soon,
    };
}

/// The provisioner of a controller-manager that provisions nothing (its workers come from
/// elsewhere, as in the scheduler tests). It has no values: a manager built with
/// [`crate::ControllerManager::new`] never runs the Runtime controller.
#[derive(Debug, Clone, Copy)]
pub enum NoProvisioner {}

impl WorkerProvisioner for NoProvisioner {
    type Error = std::convert::Infallible;

    async fn reconcile(&self, _: &Runtime) -> Result<WorkerCounts, Self::Error> {
        match *self {}
    }

    async fn cleanup(&self, _: &ObjectRef<Runtime>) -> Result<(), Self::Error> {
        match *self {}
    }
}
