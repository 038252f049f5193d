//! Session audit log (design document 001, "Security and Observability"): one JSON line
//! per session mutation, keyed by Run UID and assignment identity, with its type,
//! timestamps, result and exit code. Never command text, stdin, file contents or output.
//!
//! Lines go to a file (`--audit-log`, appended) or, without one, to standard output, where
//! a container log collector picks them up. kruntimes keeps no copy.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::SystemTime;

use k8s_openapi::jiff::Timestamp;
use tracing::warn;

/// One mutation's audit record.
#[derive(Debug, Clone)]
pub struct AuditRecord {
    pub namespace: String,
    pub run: String,
    pub run_uid: String,
    pub attempt: u32,
    pub pod: String,
    pub pod_uid: String,
    pub operation_id: String,
    /// command, writeFile, makeDirectory, delete, rename.
    pub kind: &'static str,
    pub queued_at: SystemTime,
    pub started_at: SystemTime,
    pub finished_at: SystemTime,
    /// Succeeded, Failed, Cancelled, TimedOut.
    pub state: String,
    pub reason: String,
    pub exit_code: Option<i32>,
}

fn rfc3339(time: SystemTime) -> String {
    Timestamp::try_from(time).map_or_else(|_| String::new(), |t| t.to_string())
}

impl AuditRecord {
    /// The record as one JSON line (without the newline).
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "audit": "session.mutation",
            "namespace": self.namespace,
            "run": self.run,
            "runUID": self.run_uid,
            "attempt": self.attempt,
            "pod": self.pod,
            "podUID": self.pod_uid,
            "operationId": self.operation_id,
            "type": self.kind,
            "queuedAt": rfc3339(self.queued_at),
            "startedAt": rfc3339(self.started_at),
            "finishedAt": rfc3339(self.finished_at),
            "result": self.state,
            "reason": self.reason,
            "exitCode": self.exit_code,
        })
        .to_string()
    }
}

/// Where audit lines go.
pub struct Audit {
    file: Option<Mutex<File>>,
}

impl Audit {
    /// Appends to `path`, or writes to standard output without one.
    pub fn open(path: Option<&Path>) -> std::io::Result<Audit> {
        let file = match path {
            Some(path) => Some(Mutex::new(
                OpenOptions::new().create(true).append(true).open(path)?,
            )),
            None => None,
        };
        Ok(Audit { file })
    }

    /// Writes one line. A failed write is logged, never fatal.
    pub fn write(&self, record: &AuditRecord) {
        let mut line = record.to_json();
        line.push('\n');
        let written = match &self.file {
            Some(file) => file
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .write_all(line.as_bytes()),
            None => std::io::stdout().lock().write_all(line.as_bytes()),
        };
        if let Err(error) = written {
            warn!(error = %error, "writing an audit line failed");
        }
    }
}
