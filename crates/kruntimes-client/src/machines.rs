//! The machines view (design document `fn/machines/machines.go`): claim a machine, put
//! a file on it, run something, give it back.
//!
//! A client only. There is no pool here, no scheduler and no queue: a machine is a session
//! Run on a Runtime's warm pool, acquired as any sandbox is ([`crate::sandbox`]), and every
//! call goes through the gateway to the session's own queue. What distinguishes a machine
//! from a sandbox is its lifetime class (`spec.mode.session.class`) and the four verbs:
//!
//! - [`Machines::claim`] creates the session Run in the namespace of the `org`, labelled
//!   with its project and class, and waits until it is Ready;
//! - [`Machines::write`] puts a file, through the session's queue (after the operations
//!   before it);
//! - [`Machines::exec`] runs an argv (never a shell line) and returns its exit code,
//!   output and duration: a non-zero exit is an `Ok` result, a broken machine an error;
//! - [`Machines::release`] asks the Run to end at once and deletes it, without waiting.
//!
//! Classes: `Exec` machines of one project run side by side. A `Dev` machine holds its
//! project's Workspace (the project names it): its files are restored at the claim and
//! committed at the release, and the Run is named after the project, so a second claim of
//! the project gets 409 from the API server while the first machine exists. `Desktop` needs
//! a display, which this version does not have: the API server refuses it (422).
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use kruntimes_client::Connection;
//! use kruntimes_client::machines::{Class, ExecRequest, Machines, Spec};
//!
//! let machines = Machines::new(Connection::from_kubeconfig(None).await?, "python");
//! let lease = machines.claim(&Spec::new("default", Class::Exec, "my-function")).await?;
//! machines.write(&lease, "main.py", b"print('hi')\n").await?;
//! let result = machines.exec(&lease, &ExecRequest::argv(["python3", "main.py"])).await?;
//! assert_eq!((result.exit_code, result.stdout.as_slice()), (0, &b"hi\n"[..]));
//! machines.release(&lease).await?;
//! # Ok(())
//! # }
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

pub use kruntimes_api::run::SessionClass as Class;

use kube::ResourceExt;

use crate::connect::Connection;
use crate::sandbox::{AcquireOptions, Sandbox, SandboxError};
use crate::session::{Command, Operation, OperationKind, OperationState};

/// The label that names a machine's project.
pub const PROJECT_LABEL: &str = "kruntimes.io/project";
/// The label that names a machine's class (`exec`, `dev`, `desktop`).
pub const CLASS_LABEL: &str = "kruntimes.io/machine-class";

/// What a caller asks the machines layer for. Deliberately small: no image, node, size or
/// placement; those are the Runtime's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    /// The tenant: the namespace the machine lives in.
    pub org: String,
    /// Its lifetime class.
    pub class: Class,
    /// Its project (a label value: at most 63 bytes of `[A-Za-z0-9._-]`, alphanumeric at
    /// both ends); for a function, its name.
    pub project: String,
    /// A floor under leaks: the machine ends (Timeout) this long after it is claimed.
    /// `None`: the platform's idle TTL only.
    pub ttl: Option<Duration>,
}

impl Spec {
    /// A machine of `class` for `project` in `org`, without a TTL.
    pub fn new(org: impl Into<String>, class: Class, project: impl Into<String>) -> Spec {
        Spec {
            org: org.into(),
            class,
            project: project.into(),
            ttl: None,
        }
    }
}

/// A claimed machine: what the other verbs need.
#[derive(Clone, Debug)]
pub struct Lease {
    /// The session Run's name.
    pub id: String,
    /// The namespace it lives in.
    pub org: String,
    /// Its phase when it was claimed (`Ready`).
    pub status: String,
    sandbox: Sandbox,
}

/// One command: argv only, never a shell line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecRequest {
    /// The program and its arguments, passed as they are.
    pub argv: Vec<String>,
    /// The working directory, relative to the workspace.
    pub cwd: Option<String>,
    /// Environment variables of this command.
    pub env: BTreeMap<String, String>,
    /// Given on standard input (at most 1 MiB).
    pub stdin: Vec<u8>,
    /// Its own limit (at most the session's operation timeout, 5 minutes at most).
    pub timeout: Option<Duration>,
}

impl ExecRequest {
    /// Runs `argv` with nothing else set.
    pub fn argv<I, S>(argv: I) -> ExecRequest
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        ExecRequest {
            argv: argv.into_iter().map(Into::into).collect(),
            ..ExecRequest::default()
        }
    }
}

/// One finished command. A non-zero `exit_code` is a successful call carrying a failed
/// program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecResult {
    /// The program's code; 128 + the signal that killed it; 124 when its timeout ran out;
    /// 127 when it does not exist (126: it cannot be executed).
    pub exit_code: i32,
    /// Standard output, at most 1 MiB.
    pub stdout: Vec<u8>,
    /// Standard error, at most 1 MiB (the reason, for 126 and 127).
    pub stderr: Vec<u8>,
    /// How long it ran.
    pub duration: Duration,
    /// Its timeout ran out; it and everything it started were killed.
    pub timed_out: bool,
}

/// Why a verb failed: the machine or the request, never the program.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    /// The request is malformed; nothing was sent.
    #[error("invalid machine request: {0}")]
    Invalid(String),
    /// The machine, the gateway or the API server failed (see [`SandboxError`]: for a
    /// mutation whose answer was lost, the outcome is unknown).
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    /// A write ended without writing the file.
    #[error("writing {path} failed: {reason}: {message}")]
    WriteFailed {
        /// The file.
        path: String,
        /// The runtime server's reason (`NotFound`, `IsADirectory`, …).
        reason: String,
        /// Its message.
        message: String,
    },
    /// The gateway answered a command without an exit code.
    #[error("the command's result has no exit code ({reason}: {message})")]
    NoExitCode {
        /// The operation's reason.
        reason: String,
        /// Its message.
        message: String,
    },
    /// A `Dev` machine was asked to end and deleted, but its going was not seen.
    #[error("releasing {id}: {problem}")]
    Release {
        /// The machine.
        id: String,
        /// What was not seen.
        problem: String,
    },
    /// Reading or deleting the ended Run of a `Dev` project's earlier machine failed.
    #[error("{0}")]
    Api(String),
}

impl MachineError {
    /// The HTTP status of the API server's refusal (409 while another `Dev` machine of
    /// the project exists, 422, 403), or of the gateway's answer; `None` otherwise.
    pub fn api_status(&self) -> Option<u16> {
        match self {
            MachineError::Sandbox(SandboxError::Api {
                source: kube::Error::Api(status),
                ..
            }) => Some(status.code),
            MachineError::Sandbox(other) => other.status(),
            _ => None,
        }
    }
}

/// The machines of one Runtime: the whole dependency of a caller.
#[derive(Clone, Debug)]
pub struct Machines {
    connection: Connection,
    runtime: String,
}

impl Machines {
    /// The machines of Runtime `runtime` (in each org's namespace), reached with
    /// `connection`'s credentials.
    pub fn new(connection: Connection, runtime: impl Into<String>) -> Machines {
        Machines {
            connection,
            runtime: runtime.into(),
        }
    }

    /// Claims a machine: a session Run of class `spec.class` in namespace `spec.org`,
    /// labelled with the project and class, Ready when this returns. A `Dev` machine is
    /// the Run named after the project, with the project's Workspace: its files are those
    /// the last `Dev` machine of the project committed. Errors: `Invalid` before any
    /// request (a bad org or project; a `Dev` project must be a DNS-1123 name), and the API
    /// server's refusals (409 while another `Dev` machine of the project exists, 422 for
    /// `Desktop`, 403 for an org the caller may not use).
    ///
    /// A `Dev` project's Run that has ended but was not deleted (a machine that timed out,
    /// a release that never reached the API server) does not block the claim: it is
    /// deleted (only that Run, by its UID) and the claim made again, once.
    pub async fn claim(&self, spec: &Spec) -> Result<Lease, MachineError> {
        check_label_value("project", &spec.project)?;
        if spec.org.is_empty() {
            return Err(MachineError::Invalid("the org is empty".to_string()));
        }
        let dev = spec.class == Class::Dev;
        if dev && !kruntimes_api::admission::is_dns1123_subdomain(&spec.project) {
            return Err(MachineError::Invalid(format!(
                "the project {:?} names a Dev machine's Workspace and Run: it must be \
                 lower-case [a-z0-9.-], starting and ending alphanumeric",
                spec.project
            )));
        }
        match self.claim_once(spec).await {
            Err(busy) if dev && busy.api_status() == Some(409) => {
                let connection = self.connection.clone().with_namespace(spec.org.clone());
                if !remove_ended(&connection, &spec.project).await? {
                    return Err(busy);
                }
                self.claim_once(spec).await
            }
            other => other,
        }
    }

    async fn claim_once(&self, spec: &Spec) -> Result<Lease, MachineError> {
        let class = class_label(spec.class);
        let dev = spec.class == Class::Dev;
        let options = AcquireOptions {
            generate_name: (!dev).then(|| format!("{}-", generate_prefix(&spec.project))),
            workspace: dev.then(|| spec.project.clone()),
            class: Some(spec.class),
            timeout: spec.ttl,
            labels: BTreeMap::from([
                (PROJECT_LABEL.to_string(), spec.project.clone()),
                (CLASS_LABEL.to_string(), class.to_string()),
            ]),
            ..AcquireOptions::default()
        };
        let connection = self.connection.clone().with_namespace(spec.org.clone());
        // The Run as it was created, so that a claim that fails after the create (it ended
        // before Ready, the wait ran out) does not leave it holding a slot.
        let created = std::sync::Mutex::new(None::<(String, String)>);
        let acquired = connection
            .runtime(self.runtime.clone())
            .acquire_sandbox_with(&options, |run| {
                let mut created = created.lock().unwrap_or_else(|e| e.into_inner());
                if created.is_none()
                    && let Some(uid) = run.metadata.uid.clone()
                {
                    *created = Some((run.name_any(), uid));
                }
            })
            .await;
        let sandbox = match acquired {
            Ok(sandbox) => sandbox,
            Err(error) => {
                let created = created.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some((name, uid)) = created {
                    give_back(&connection, &name, &uid).await;
                }
                return Err(error.into());
            }
        };
        Ok(Lease {
            id: sandbox.name().to_string(),
            org: spec.org.clone(),
            status: "Ready".to_string(),
            sandbox,
        })
    }

    /// The lease of machine `id` in `org`, claimed earlier (by this process or another):
    /// the session Run of that name, which must carry the machine labels. Errors: the API
    /// server's (404 for no such Run), and `Invalid` for a Run that is not a machine.
    pub async fn lease(&self, org: &str, id: &str) -> Result<Lease, MachineError> {
        let connection = self.connection.clone().with_namespace(org.to_string());
        let sandbox = connection.sandbox(id).await?;
        let run = sandbox.run().await?;
        let machine = run
            .metadata
            .labels
            .as_ref()
            .is_some_and(|labels| labels.contains_key(CLASS_LABEL));
        if !machine {
            return Err(MachineError::Invalid(format!(
                "{org}/{id} is a sandbox, not a machine (no {CLASS_LABEL} label)"
            )));
        }
        Ok(Lease {
            id: id.to_string(),
            org: org.to_string(),
            status: run.phase().to_string(),
            sandbox,
        })
    }

    /// Writes `content` to `path` (relative to the workspace; missing directories are
    /// made) after every operation sent to the machine before it; a file over 1 MiB is
    /// streamed with the file API instead, which is not queued.
    pub async fn write(
        &self,
        lease: &Lease,
        path: &str,
        content: &[u8],
    ) -> Result<(), MachineError> {
        if let Some((parent, _)) = path.rsplit_once('/')
            && !parent.is_empty()
        {
            let made = lease
                .sandbox
                .execute(&Operation::new(OperationKind::MakeDirectory {
                    path: parent.to_string(),
                    parents: true,
                }))
                .await?;
            written(parent, made)?;
        }
        if content.len() > crate::session::MAX_FILE_BYTES {
            // Larger files stream through the file API (no operation carries them).
            lease
                .sandbox
                .upload(path, std::io::Cursor::new(content.to_vec()), None, false)
                .await?;
            return Ok(());
        }
        let done = lease
            .sandbox
            .execute(&Operation::write_file(path, content.to_vec(), false))
            .await?;
        written(path, done)
    }

    /// Runs `request.argv` on the machine, after every operation sent to it before.
    pub async fn exec(
        &self,
        lease: &Lease,
        request: &ExecRequest,
    ) -> Result<ExecResult, MachineError> {
        if request.argv.is_empty() {
            return Err(MachineError::Invalid("argv is empty".to_string()));
        }
        let command = Command {
            argv: request.argv.clone(),
            shell: None,
            stdin: request.stdin.clone(),
            cwd: request.cwd.clone(),
            env: request.env.clone(),
        };
        let mut operation = Operation::command(command);
        if let Some(timeout) = request.timeout {
            operation = operation.with_timeout(timeout);
        }
        let done = lease.sandbox.execute(&operation).await?;
        let exit_code = done.exit_code.ok_or_else(|| MachineError::NoExitCode {
            reason: done.reason.clone(),
            message: done.message.clone(),
        })?;
        Ok(ExecResult {
            exit_code,
            stdout: done.stdout,
            stderr: done.stderr,
            duration: done.duration,
            timed_out: done.timed_out,
        })
    }

    /// Gives the machine back: the Run is asked to end at once (anything still running
    /// is cancelled) and deleted. An `Exec` machine's release does not wait: its worker
    /// closes the session and frees the slot, and the Run goes once that is done. A `Dev`
    /// machine's release returns once the Run is gone, that is once its files are
    /// committed to the project's Workspace (the worker commits before it lets the Run
    /// go), so the next claim of the project finds them.
    pub async fn release(&self, lease: &Lease) -> Result<(), MachineError> {
        lease.sandbox.end_and_delete().await?;
        let run = match lease.sandbox.run().await {
            Ok(run) => run,
            Err(SandboxError::NotFound { .. }) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        // Another Run of the name (the project claimed again since): this one is gone.
        if run.spec.workspace.is_none() || run.uid().as_deref() != Some(lease.sandbox.uid()) {
            return Ok(());
        }
        let api = kube::Api::<kruntimes_api::Run>::namespaced(
            self.connection.client().clone(),
            &lease.org,
        );
        let uid = run.uid().unwrap_or_default();
        let gone = kube::runtime::wait::await_condition(
            api,
            &lease.id,
            kube::runtime::wait::conditions::is_deleted(&uid),
        );
        match tokio::time::timeout(RELEASE_WAIT, gone).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(MachineError::Release {
                id: lease.id.clone(),
                problem: format!("watching its deletion failed: {e}"),
            }),
            Err(_) => Err(MachineError::Release {
                id: lease.id.clone(),
                problem: format!(
                    "it was not gone after {}s: its Workspace commit is still being made \
                     (or retried); the next claim of the project gets 409 until it is",
                    RELEASE_WAIT.as_secs()
                ),
            }),
        }
    }
}

/// How long a `Dev` machine's release waits for its commit.
const RELEASE_WAIT: Duration = Duration::from_secs(120);

/// Deletes the Run `name` of an earlier `Dev` machine when it has ended (only that Run, by
/// its UID). `Ok(true)`: it is gone (or was already), try the claim again; `Ok(false)`: it
/// is live, or still committing (being deleted): the project is busy.
async fn remove_ended(connection: &Connection, name: &str) -> Result<bool, MachineError> {
    let api = kube::Api::<kruntimes_api::Run>::namespaced(
        connection.client().clone(),
        connection.namespace(),
    );
    let run = match api.get_opt(name).await {
        Ok(Some(run)) => run,
        Ok(None) => return Ok(true),
        Err(e) => return Err(MachineError::Api(format!("reading {name}: {e}"))),
    };
    // Only a Dev machine of this project: a Run of another kind that happens to carry the
    // name (a task kept for its logs) is never deleted here.
    let dev_machine = run.spec.workspace.as_ref().is_some_and(|w| w.name == name)
        && run.labels().get(CLASS_LABEL).map(String::as_str) == Some("dev");
    if !dev_machine || !run.phase().is_terminal() || run.metadata.deletion_timestamp.is_some() {
        return Ok(false);
    }
    let Some(uid) = run.metadata.uid.clone() else {
        return Ok(false);
    };
    let params = kube::api::DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: Some(uid.clone()),
            resource_version: None,
        }),
        ..kube::api::DeleteParams::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {}
        Err(e) => return Err(MachineError::Api(format!("deleting {name}: {e}"))),
    }
    // Its worker may commit first (a session idle expiry ended is committed before its
    // close): wait for it to go, bounded.
    let gone = kube::runtime::wait::await_condition(
        api,
        name,
        kube::runtime::wait::conditions::is_deleted(&uid),
    );
    Ok(matches!(
        tokio::time::timeout(RELEASE_WAIT, gone).await,
        Ok(Ok(_))
    ))
}

/// Asks the Run `name` (only while its UID is `uid`) of a failed claim to end at once and
/// deletes it; best effort: the claim's own error is what the caller hears, and the idle
/// TTL ends a Run this could not reach.
async fn give_back(connection: &Connection, name: &str, uid: &str) {
    let api = kube::Api::namespaced(connection.client().clone(), connection.namespace());
    let _ = crate::sandbox::end_and_delete(&api, connection.namespace(), name, uid).await;
}

/// A write's operation ended: `Ok` when it wrote.
fn written(path: &str, done: crate::sandbox::Executed) -> Result<(), MachineError> {
    if done.state == OperationState::Succeeded {
        return Ok(());
    }
    Err(MachineError::WriteFailed {
        path: path.to_string(),
        reason: done.reason,
        message: done.message,
    })
}

/// The class as its label spells it.
fn class_label(class: Class) -> &'static str {
    match class {
        Class::Exec => "exec",
        Class::Dev => "dev",
        Class::Desktop => "desktop",
    }
}

/// A Kubernetes label value: at most 63 bytes of `[A-Za-z0-9._-]`, alphanumeric at both
/// ends, not empty (a project must be named).
fn check_label_value(what: &str, value: &str) -> Result<(), MachineError> {
    let valid = !value.is_empty()
        && value.len() <= 63
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && value
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
        && value
            .bytes()
            .last()
            .is_some_and(|b| b.is_ascii_alphanumeric());
    if valid {
        Ok(())
    } else {
        Err(MachineError::Invalid(format!(
            "the {what} {value:?} is not 1 to 63 bytes of [A-Za-z0-9._-] starting and ending alphanumeric"
        )))
    }
}

/// The Run name prefix for a project: lower-case, `[a-z0-9-]`, at most 40 bytes, so the
/// generated name is a DNS label whatever the project spells.
fn generate_prefix(project: &str) -> String {
    let mut prefix: String = project
        .chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_alphanumeric() { c } else { '-' }
        })
        .take(40)
        .collect();
    while prefix.ends_with('-') {
        prefix.pop();
    }
    if prefix.is_empty() || !prefix.starts_with(|c: char| c.is_ascii_alphabetic()) {
        prefix.insert_str(0, "m-");
    }
    prefix
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn projects_are_label_values_and_name_prefixes_are_dns_labels() {
        for good in ["fn", "my.project_1", "A-b"] {
            assert!(check_label_value("project", good).is_ok(), "{good}");
        }
        for bad in ["", "-a", "a-", "a/b", "a b", &"x".repeat(64)] {
            assert!(check_label_value("project", bad).is_err(), "{bad:?}");
        }
        assert_eq!(generate_prefix("My.Project_1"), "my-project-1");
        assert_eq!(generate_prefix("9lives"), "m-9lives");
        assert_eq!(generate_prefix(&"a".repeat(63)).len(), 40);
    }
}
