//! The controller-manager's error type: one enum for the whole crate, each variant naming
//! the object it was working on and carrying the API error as its source.

/// What went wrong while reconciling or electing a leader.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A list request failed.
    #[error("failed to list {what} in namespace {namespace}")]
    List {
        what: &'static str,
        namespace: String,
        #[source]
        source: kube::Error,
    },
    /// A status write to a Run failed with something other than a conflict.
    #[error("failed to write the status of Run {namespace}/{name}")]
    WriteRunStatus {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// Reading the Snapshot a Run names failed (its worker-loss recovery needs it).
    #[error("failed to read Snapshot {namespace}/{name}")]
    ReadSnapshot {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// Deleting a Run whose TTL has passed failed.
    #[error("failed to delete Run {namespace}/{name} after its TTL")]
    DeleteRun {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// An object came from the API without a field the API always sets.
    #[error("{kind} {name} has no {field}")]
    MissingField {
        kind: &'static str,
        name: String,
        field: &'static str,
    },
    /// A Lease request failed with something other than a conflict.
    #[error("failed to {action} Lease {namespace}/{name}")]
    Lease {
        action: &'static str,
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// A controller's watch stream failed for good.
    #[error("the {controller} controller stopped")]
    ControllerStopped { controller: &'static str },
}

impl Error {
    /// The API answered 409 Conflict: the object changed since it was read.
    pub fn is_conflict(&self) -> bool {
        match self {
            Error::WriteRunStatus { source, .. }
            | Error::DeleteRun { source, .. }
            | Error::ReadSnapshot { source, .. }
            | Error::Lease { source, .. }
            | Error::List { source, .. } => is_conflict(source),
            Error::MissingField { .. } | Error::ControllerStopped { .. } => false,
        }
    }
}

/// `true` when the API answered 409 Conflict (a stale `resourceVersion` or precondition).
pub(crate) fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.is_conflict())
}

/// `true` when the API answered 404 Not Found.
pub(crate) fn is_not_found(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.is_not_found())
}
