//! `krt sandbox …`: agent sandboxes (session Runs, docs/session-mode.md) on the SDK's
//! [`kruntimes_client::sandbox`]: create, exec and sh (output streamed as it arrives),
//! ls, cat, put, release.
//!
//! Every command but `create` and `release` opens what it needs for one call and closes
//! it: a sandbox with a lease needs calls (or a session) more often than its lease.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::Subcommand;
use kruntimes_api::Run;
use kruntimes_client::sandbox::{
    AcquireOptions, ListFilesOptions, ReleaseOptions, Sandbox, SandboxError,
};
use kruntimes_client::session::{
    Command, Completed, MAX_FILE_BYTES, MAX_STREAM_BYTES, Operation, OperationKind, OperationState,
    OutputStream, Session,
};
use kube::api::{Api, ListParams};

use crate::commands::check_runtime;
use crate::conn::{Conn, explain};
use crate::outcome;
use crate::spec;
use crate::spinner::Spinner;
use crate::table;

/// How long `create` and `release` wait by default.
const DEFAULT_WAIT: &str = "5m";
/// Entries per listing page `ls` asks for.
const LS_PAGE: u32 = 1000;

const EXEC_EXIT_CODES: &str = "Exit codes:\n  \
    N    the command's own exit code (0 when it succeeded)\n  \
    124  the command timed out\n  \
    130  the command was cancelled (Ctrl-C cancels it)\n  \
    4    the outcome is unknown (the connection was lost after sending): it may or may not have run\n  \
    1    refused before it ran (no such sandbox, not ready, queue full, …), killed by a signal, or another krt error";

#[derive(Subcommand, Debug)]
pub enum SandboxCommand {
    /// Acquire a sandbox: a session Run on a Runtime, with its own workspace on one
    /// worker. Waits until it is Ready; prints its name as the last line.
    #[command(after_help = "Examples:\n  \
        krt sandbox create\n  \
        krt sandbox create --runtime python --lease-timeout 10m\n  \
        SB=$(krt sandbox create | tail -1); krt sandbox sh $SB 'uname -a'; krt sandbox release $SB")]
    Create {
        /// The Runtime (worker pool) to reserve a worker of.
        #[arg(long, short = 'r', default_value = "bash")]
        runtime: String,
        /// End the sandbox when nothing renews its lease for this long: seconds, or a
        /// duration such as 30s or 10m. Every krt sandbox call renews it. Default: no lease.
        #[arg(long, value_name = "S")]
        lease_timeout: Option<String>,
        /// The Run's name; default `<runtime>-sandbox-` plus a random suffix.
        #[arg(long)]
        name: Option<String>,
        /// An environment variable of every command, K=V (repeatable).
        #[arg(long = "env", short = 'e', value_name = "K=V")]
        env: Vec<String>,
        /// A label of the sandbox's Run, K=V (repeatable); `krt sandbox list` shows them.
        #[arg(long = "label", short = 'l', value_name = "K=V")]
        labels: Vec<String>,
        /// The longest the sandbox may live, e.g. 1h.
        #[arg(long, value_name = "DURATION")]
        timeout: Option<String>,
        /// Give up waiting for Ready after this long (the sandbox goes on).
        #[arg(long, value_name = "DURATION", default_value = DEFAULT_WAIT)]
        wait_timeout: String,
        /// End the sandbox after this long without an operation or file write, e.g. 30m;
        /// it may only lower the platform's idle TTL (168h by default).
        #[arg(long, value_name = "DURATION")]
        idle_timeout: Option<String>,
        /// Suspend the sandbox after this long without an operation or file write, e.g.
        /// 15m (at least 1m): its files are kept in a Snapshot and its worker slot freed;
        /// `krt sandbox resume` brings it back.
        #[arg(long, value_name = "DURATION")]
        auto_suspend_after: Option<String>,
        /// A creation request ID (1 to 128 bytes of [A-Za-z0-9._-]): a retry with the same
        /// ID and options prints the same sandbox, other options fail (conflict), and once
        /// the sandbox ended the ID stays reserved. The sandbox's name comes from it.
        #[arg(long, value_name = "ID", conflicts_with = "name")]
        request_id: Option<String>,
        /// Start from this Snapshot's files (a fork of a checkpoint); it must be Ready.
        #[arg(long, value_name = "SNAPSHOT")]
        from_snapshot: Option<String>,
        /// Create it Suspended (with --from-snapshot: no worker slot until `krt sandbox
        /// resume`).
        #[arg(long, requires = "from_snapshot")]
        suspended: bool,
    },
    /// Checkpoint a sandbox: its files after every operation accepted so far go into the
    /// Snapshot SNAPSHOT while it keeps serving. The checkpoint outlives the sandbox; fork
    /// it with `krt sandbox fork`. Waits until it is Ready.
    #[command(after_help = "Examples:\n  \
        krt sandbox checkpoint $SB before-upgrade\n  \
        krt sandbox fork before-upgrade --count 3")]
    Checkpoint {
        /// The sandbox.
        name: String,
        /// The Snapshot's name.
        snapshot: String,
        /// Give up waiting after this long (the capture goes on).
        #[arg(long, value_name = "DURATION", default_value = DEFAULT_WAIT)]
        wait_timeout: String,
    },
    /// Create COUNT sandboxes from a checkpoint at once (each its own copy of its files);
    /// prints their names, one a line.
    Fork {
        /// The Snapshot (a Ready checkpoint).
        snapshot: String,
        /// How many (1 to 100).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=100))]
        count: u16,
        /// Create them Suspended: they take no worker slot until each is resumed.
        #[arg(long)]
        suspended: bool,
        /// The Runtime (worker pool); default the one the checkpointed sandbox ran on.
        #[arg(long, short = 'r')]
        runtime: Option<String>,
        /// Give up waiting after this long (the forks go on).
        #[arg(long, value_name = "DURATION", default_value = DEFAULT_WAIT)]
        wait_timeout: String,
    },
    /// List the sandboxes (session Runs) of the namespace: name, runtime, phase, age,
    /// labels.
    List {
        /// List across all namespaces.
        #[arg(short = 'A', long)]
        all_namespaces: bool,
        /// Only sandboxes with these labels, K=V (repeatable).
        #[arg(long = "selector", short = 'l', value_name = "K=V")]
        selector: Vec<String>,
    },
    /// Run a program in a sandbox; stream its output; exit with its exit code.
    #[command(after_help = EXEC_EXIT_CODES)]
    Exec {
        /// The sandbox (its Run's name).
        name: String,
        #[command(flatten)]
        options: ExecOptions,
        /// The program and its arguments.
        #[arg(last = true, required = true, value_name = "ARGV")]
        argv: Vec<String>,
    },
    /// Run one shell line in a sandbox; stream its output; exit with its exit code.
    #[command(after_help = EXEC_EXIT_CODES)]
    Sh {
        /// The sandbox (its Run's name).
        name: String,
        /// The shell line.
        line: String,
        #[command(flatten)]
        options: ExecOptions,
    },
    /// List a directory of a sandbox's workspace (default: the workspace itself).
    Ls {
        /// The sandbox.
        name: String,
        /// A directory, relative to the workspace.
        path: Option<String>,
    },
    /// Print a file of a sandbox's workspace (streamed, of any size).
    Cat {
        /// The sandbox.
        name: String,
        /// The file, relative to the workspace.
        path: String,
    },
    /// Copy a local file into a sandbox's workspace; it keeps its executable bit. Missing
    /// parent directories are created. A file over 1 MiB is streamed (up to the gateway's
    /// --session-max-file-bytes, 1 GiB by default) beside the sandbox's queue; a smaller
    /// one is a write operation in the queue, ordered with the others.
    Put {
        /// The sandbox.
        name: String,
        /// The local file (with -r, a directory).
        local: PathBuf,
        /// Where it goes, relative to the workspace (with -r, a new or empty directory).
        path: String,
        /// Copy a directory and everything beneath it, as a tar stream.
        #[arg(short = 'r', long)]
        recursive: bool,
    },
    /// Copy a file (or with -r a directory) of a sandbox's workspace to a local path,
    /// streamed; a file lands whole or not at all.
    Get {
        /// The sandbox.
        name: String,
        /// The file (with -r, a directory; "." for the workspace), relative to the workspace.
        path: String,
        /// Where it goes (with -r, a new or empty local directory).
        local: PathBuf,
        /// Copy a directory and everything beneath it, as a tar stream.
        #[arg(short = 'r', long)]
        recursive: bool,
    },
    /// Suspend a sandbox: its worker captures its files into a Snapshot and frees its
    /// slot. Waits until it is Suspended.
    Suspend {
        /// The sandbox.
        name: String,
        /// Give up waiting after this long (the suspension goes on).
        #[arg(long, value_name = "DURATION", default_value = DEFAULT_WAIT)]
        wait_timeout: String,
    },
    /// Resume a suspended sandbox: it is placed again (on the same worker when it can)
    /// and restored from its Snapshot. Waits until it is Ready.
    Resume {
        /// The sandbox.
        name: String,
        /// Give up waiting after this long (the resume goes on).
        #[arg(long, value_name = "DURATION", default_value = DEFAULT_WAIT)]
        wait_timeout: String,
    },
    /// Release a sandbox: drain it (finish accepted work, export its artifacts) or, with
    /// --immediate, cancel its work; then delete it and wait until it is gone.
    Release {
        /// The sandbox.
        name: String,
        /// Cancel running and queued work instead of draining it.
        #[arg(long)]
        immediate: bool,
        /// Give up waiting after this long (the release goes on).
        #[arg(long, value_name = "DURATION", default_value = DEFAULT_WAIT)]
        wait_timeout: String,
    },
}

/// What `exec` and `sh` take besides the program.
#[derive(clap::Args, Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecOptions {
    /// The working directory, relative to the workspace.
    #[arg(long, value_name = "DIR")]
    pub cwd: Option<String>,
    /// An environment variable for this command only, K=V (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V")]
    pub env: Vec<String>,
    /// The command's own limit (at most the sandbox's operation timeout), e.g. 30s.
    #[arg(long, value_name = "DURATION")]
    pub timeout: Option<String>,
    /// Give the command krt's standard input (at most 1 MiB).
    #[arg(long, short = 'i')]
    pub stdin: bool,
}

/// A `krt sandbox` command checked before connecting.
pub enum Prepared {
    Create {
        runtime: String,
        options: AcquireOptions,
    },
    List {
        all_namespaces: bool,
        selector: String,
    },
    Exec {
        name: String,
        operation: Operation,
    },
    Ls {
        name: String,
        path: String,
    },
    Cat {
        name: String,
        path: String,
    },
    Put {
        name: String,
        /// The missing parents of the file, created first.
        parents: Option<Operation>,
        operation: Operation,
    },
    /// A file over 1 MiB, or a directory (`put -r`): streamed.
    Upload {
        name: String,
        parents: Option<Operation>,
        local: PathBuf,
        path: String,
        directory: bool,
    },
    Get {
        name: String,
        path: String,
        local: PathBuf,
        directory: bool,
    },
    Release {
        name: String,
        options: ReleaseOptions,
    },
    /// `suspend` (true) or `resume` (false).
    Suspend {
        name: String,
        suspend: bool,
        wait: Duration,
    },
    Checkpoint {
        name: String,
        snapshot: String,
        wait: Duration,
    },
    /// `create --from-snapshot` (count 1) and `fork`.
    Fork {
        /// `None`: the checkpoint's Runtime.
        runtime: Option<String>,
        snapshot: String,
        count: u16,
        options: AcquireOptions,
    },
}

/// `K=V` labels (`--label`, `--selector`): a key of 1..317 bytes (an optional DNS prefix
/// and a name), a value of at most 63; the API server checks the rest.
fn parse_labels(flag: &str, pairs: &[String]) -> Result<BTreeMap<String, String>> {
    let mut labels = BTreeMap::new();
    for pair in pairs {
        let Some((key, value)) = pair.split_once('=') else {
            bail!("{flag} {pair:?}: expected K=V");
        };
        if key.is_empty() || key.len() > 317 || value.len() > 63 {
            bail!("{flag} {pair:?}: a label key is 1..317 bytes and a value at most 63");
        }
        if labels.insert(key.to_string(), value.to_string()).is_some() {
            bail!("{flag}: label {key:?} is given twice");
        }
    }
    Ok(labels)
}

/// The parent directory of a workspace path, when it has one (`app/main.py`: `app`).
fn parent_dir(path: &str) -> Option<&str> {
    let trimmed = path.trim_end_matches('/');
    let (parent, _) = trimmed.rsplit_once('/')?;
    let parent = parent.trim_end_matches('/');
    (!parent.is_empty() && parent != ".").then_some(parent)
}

/// `--lease-timeout`: whole seconds, or a duration.
fn parse_lease(text: &str) -> Result<Duration> {
    match text.parse::<u64>() {
        Ok(0) => bail!("--lease-timeout must be greater than zero"),
        Ok(secs) => Ok(Duration::from_secs(secs)),
        Err(_) => spec::parse_timeout("--lease-timeout", text),
    }
}

/// Reads at most one byte more than `limit`, so that more is refused without reading it
/// all.
fn read_limited(from: impl Read, limit: usize, what: &str) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    from.take(limit as u64 + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read {what}"))?;
    if bytes.len() > limit {
        bail!("{what} is larger than {limit} bytes (1 MiB)");
    }
    Ok(bytes)
}

fn command_operation(mut command: Command, options: ExecOptions) -> Result<Operation> {
    command.cwd = options.cwd;
    command.env = spec::parse_env(&options.env, |k| std::env::var(k).ok())?
        .into_iter()
        .map(|v| (v.name, v.value))
        .collect();
    if options.stdin {
        command.stdin = read_limited(std::io::stdin().lock(), MAX_FILE_BYTES, "stdin")?;
    }
    let mut operation = Operation::command(command);
    if let Some(timeout) = &options.timeout {
        operation = operation.with_timeout(spec::parse_timeout("--timeout", timeout)?);
    }
    operation.to_json()?;
    Ok(operation)
}

#[cfg(unix)]
fn is_executable(metadata: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::PermissionsExt;
    metadata.permissions().mode() & 0o111 != 0
}

#[cfg(not(unix))]
fn is_executable(_metadata: &std::fs::Metadata) -> bool {
    false
}

fn put_operation(local: &Path, path: String) -> Result<Operation> {
    let file = std::fs::File::open(local)
        .with_context(|| format!("{}: cannot open it", local.display()))?;
    let metadata = file
        .metadata()
        .with_context(|| format!("{}: cannot read it", local.display()))?;
    if !metadata.is_file() {
        bail!("{} is not a regular file", local.display());
    }
    let content = read_limited(file, MAX_FILE_BYTES, &local.display().to_string())?;
    Ok(Operation::write_file(
        path,
        content,
        is_executable(&metadata),
    ))
}

/// Checks `command`'s arguments and reads its local input, before connecting.
pub fn prepare(command: SandboxCommand) -> Result<Prepared> {
    Ok(match command {
        SandboxCommand::Create {
            runtime,
            lease_timeout,
            name,
            env,
            labels,
            timeout,
            wait_timeout,
            idle_timeout,
            auto_suspend_after,
            request_id,
            from_snapshot,
            suspended,
        } => {
            let options = AcquireOptions {
                suspended,
                name,
                request_id,
                idle_timeout: idle_timeout
                    .as_deref()
                    .map(|t| spec::parse_timeout("--idle-timeout", t))
                    .transpose()?,
                auto_suspend_after: auto_suspend_after
                    .as_deref()
                    .map(|t| spec::parse_timeout("--auto-suspend-after", t))
                    .transpose()?,
                lease_timeout: lease_timeout.as_deref().map(parse_lease).transpose()?,
                env: spec::parse_env(&env, |k| std::env::var(k).ok())?,
                labels: parse_labels("--label", &labels)?,
                timeout: timeout
                    .as_deref()
                    .map(|t| spec::parse_timeout("--timeout", t))
                    .transpose()?,
                wait: spec::parse_timeout("--wait-timeout", &wait_timeout)?,
                ..AcquireOptions::default()
            };
            if let Some(snapshot) = from_snapshot {
                if options.request_id.is_some() {
                    bail!("--from-snapshot takes no --request-id");
                }
                return Ok(Prepared::Fork {
                    runtime: Some(runtime),
                    snapshot,
                    count: 1,
                    options,
                });
            }
            options.to_run(&runtime)?;
            Prepared::Create { runtime, options }
        }
        SandboxCommand::Checkpoint {
            name,
            snapshot,
            wait_timeout,
        } => Prepared::Checkpoint {
            name,
            snapshot,
            wait: spec::parse_timeout("--wait-timeout", &wait_timeout)?,
        },
        SandboxCommand::Fork {
            snapshot,
            count,
            suspended,
            runtime,
            wait_timeout,
        } => Prepared::Fork {
            runtime,
            snapshot,
            count,
            options: AcquireOptions {
                suspended,
                wait: spec::parse_timeout("--wait-timeout", &wait_timeout)?,
                ..AcquireOptions::default()
            },
        },
        SandboxCommand::List {
            all_namespaces,
            selector,
        } => Prepared::List {
            all_namespaces,
            selector: parse_labels("--selector", &selector)?
                .into_iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(","),
        },
        SandboxCommand::Exec {
            name,
            options,
            argv,
        } => Prepared::Exec {
            name,
            operation: command_operation(Command::argv(argv), options)?,
        },
        SandboxCommand::Sh {
            name,
            line,
            options,
        } => Prepared::Exec {
            name,
            operation: command_operation(Command::shell(line), options)?,
        },
        SandboxCommand::Ls { name, path } => Prepared::Ls {
            name,
            path: path.unwrap_or_default(),
        },
        SandboxCommand::Cat { name, path } => Prepared::Cat { name, path },
        SandboxCommand::Put {
            name,
            local,
            path,
            recursive,
        } => {
            // Design document 001's directory creation, with parents: `put x app/main.py`
            // makes `app` when it is missing.
            let parents = parent_dir(&path).map(|parent| {
                Operation::new(OperationKind::MakeDirectory {
                    path: parent.to_string(),
                    parents: true,
                })
            });
            let metadata = std::fs::metadata(&local)
                .with_context(|| format!("{}: cannot read it", local.display()))?;
            if recursive || metadata.len() > MAX_FILE_BYTES as u64 {
                if recursive && !metadata.is_dir() {
                    bail!(
                        "{} is not a directory (put -r copies a directory)",
                        local.display()
                    );
                }
                if !recursive && !metadata.is_file() {
                    bail!("{} is not a regular file", local.display());
                }
                Prepared::Upload {
                    name,
                    parents,
                    local,
                    path,
                    directory: recursive,
                }
            } else {
                Prepared::Put {
                    name,
                    parents,
                    operation: put_operation(&local, path)?,
                }
            }
        }
        SandboxCommand::Get {
            name,
            path,
            local,
            recursive,
        } => Prepared::Get {
            name,
            path: if path == "." { String::new() } else { path },
            local,
            directory: recursive,
        },
        SandboxCommand::Release {
            name,
            immediate,
            wait_timeout,
        } => Prepared::Release {
            name,
            options: ReleaseOptions {
                immediate,
                wait: spec::parse_timeout("--wait-timeout", &wait_timeout)?,
            },
        },
        SandboxCommand::Suspend { name, wait_timeout } => Prepared::Suspend {
            name,
            suspend: true,
            wait: spec::parse_timeout("--wait-timeout", &wait_timeout)?,
        },
        SandboxCommand::Resume { name, wait_timeout } => Prepared::Suspend {
            name,
            suspend: false,
            wait: spec::parse_timeout("--wait-timeout", &wait_timeout)?,
        },
    })
}

/// An SDK error as krt's one line, with a hint of what to do next.
fn explain_sandbox(e: SandboxError) -> anyhow::Error {
    let hint = match &e {
        SandboxError::NotFound { namespace, .. } => {
            format!(" (`krt get runs -n {namespace}` lists the Runs)")
        }
        SandboxError::NotReady { name, .. } | SandboxError::Ended { name, .. } => {
            format!(" (`krt get run {name} -o yaml` shows its status)")
        }
        SandboxError::WaitTimedOut { name, .. } => {
            format!("; `krt sandbox release {name}` releases it")
        }
        SandboxError::Suspended { name } => {
            format!(" (`krt sandbox resume {name}` resumes it)")
        }
        SandboxError::Rejected { status: 429, .. } => {
            "; the sandbox's queue is full: wait for queued operations to end".to_string()
        }
        SandboxError::Rejected { status: 409, .. } => {
            " (a draining sandbox takes no new operations)".to_string()
        }
        _ => String::new(),
    };
    match e {
        SandboxError::Api { action, source, .. } => {
            explain(source).context(format!("cannot {action}"))
        }
        e if hint.is_empty() => anyhow::Error::new(e),
        e => anyhow!("{e}{hint}"),
    }
}

/// Prints the error and returns the exit code: 4 when the outcome is unknown, else 1.
fn failed(e: SandboxError) -> u8 {
    let code = if e.outcome_unknown() {
        outcome::EXIT_OUTCOME_UNKNOWN
    } else {
        outcome::EXIT_ERROR
    };
    eprintln!("krt: {:#}", explain_sandbox(e));
    code
}

/// `krt sandbox …`.
pub async fn run(conn: Conn, command: Prepared) -> Result<u8> {
    match command {
        Prepared::Create { runtime, options } => create(conn, runtime, options).await,
        Prepared::List {
            all_namespaces,
            selector,
        } => list(conn, all_namespaces, selector, "sandboxes").await,
        Prepared::Exec { name, operation } => exec(conn, name, operation).await,
        Prepared::Ls { name, path } => ls(conn, name, path).await,
        Prepared::Cat { name, path } => cat(conn, name, path).await,
        Prepared::Put {
            name,
            parents,
            operation,
        } => put(conn, name, parents, operation).await,
        Prepared::Upload {
            name,
            parents,
            local,
            path,
            directory,
        } => upload(conn, name, parents, local, path, directory).await,
        Prepared::Get {
            name,
            path,
            local,
            directory,
        } => get(conn, name, path, local, directory).await,
        Prepared::Release { name, options } => release(conn, name, options).await,
        Prepared::Suspend {
            name,
            suspend,
            wait,
        } => suspend_or_resume(conn, name, suspend, wait).await,
        Prepared::Checkpoint {
            name,
            snapshot,
            wait,
        } => checkpoint(conn, name, snapshot, wait).await,
        Prepared::Fork {
            runtime,
            snapshot,
            count,
            options,
        } => fork(conn, runtime, snapshot, count, options).await,
    }
}

async fn checkpoint(conn: Conn, name: String, snapshot: String, wait: Duration) -> Result<u8> {
    let sandbox = match conn.sdk.sandbox(&name).await {
        Ok(sandbox) => sandbox,
        Err(e) => return Ok(failed(e)),
    };
    let spinner = Spinner::start(format!("snapshot/{snapshot} of sandbox/{name} capturing"));
    let taken = sandbox.checkpoint(&snapshot, wait).await;
    spinner.stop();
    match taken {
        Ok(taken) => {
            let status = taken.status.unwrap_or_default();
            eprintln!(
                "snapshot/{snapshot} Ready: {} files, {} bytes",
                status.files.unwrap_or(0),
                status.size_bytes.unwrap_or(0)
            );
            println!("{snapshot}");
            Ok(0)
        }
        Err(e) => Ok(failed(e)),
    }
}

/// Creates `count` sandboxes from Snapshot `snapshot` (read now: it must be Ready; its UID
/// is pinned), all at once; prints each name as it is Ready (or Suspended).
async fn fork(
    conn: Conn,
    runtime: Option<String>,
    snapshot: String,
    count: u16,
    mut options: AcquireOptions,
) -> Result<u8> {
    let snapshots: kube::Api<kruntimes_api::Snapshot> =
        kube::Api::namespaced(conn.sdk.client().clone(), conn.sdk.namespace());
    let source = match snapshots.get_opt(&snapshot).await {
        Ok(Some(source)) => source,
        Ok(None) => {
            eprintln!("krt: snapshot/{snapshot} not found");
            return Ok(outcome::EXIT_ERROR);
        }
        Err(e) => return Err(e).with_context(|| format!("reading snapshot/{snapshot}")),
    };
    if source.phase() != kruntimes_api::snapshot::SnapshotPhase::Ready {
        eprintln!(
            "krt: snapshot/{snapshot} is {}, not Ready: only a Ready Snapshot is forked",
            source.phase().as_str()
        );
        return Ok(outcome::EXIT_ERROR);
    }
    let recorded = source
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(kruntimes_api::snapshot::RUNTIME_ANNOTATION).cloned());
    let Some(runtime) = runtime.or(recorded) else {
        eprintln!("krt: snapshot/{snapshot} does not say its Runtime: give --runtime");
        return Ok(outcome::EXIT_ERROR);
    };
    check_runtime(&conn, &runtime).await?;
    options.from_snapshot = Some(kruntimes_api::snapshot::ObjectReference {
        name: snapshot.clone(),
        uid: kube::ResourceExt::uid(&source),
    });
    options.to_run(&runtime)?;
    let pool = conn.sdk.runtime(&runtime);
    let spinner = Spinner::start(format!("{count} fork(s) of snapshot/{snapshot}"));
    let results =
        futures::future::join_all((0..count).map(|_| pool.acquire_sandbox(&options))).await;
    spinner.stop();
    let mut code = 0;
    for result in results {
        match result {
            Ok(sandbox) => println!("{}", sandbox.name()),
            Err(e) => code = failed(e),
        }
    }
    Ok(code)
}

async fn create(conn: Conn, runtime: String, options: AcquireOptions) -> Result<u8> {
    check_runtime(&conn, &runtime).await?;
    let spinner = Spinner::start(format!("sandbox on {runtime} Pending"));
    let progress = spinner.clone();
    let pool = conn.sdk.runtime(&runtime);
    let acquiring = pool.acquire_sandbox_with(&options, move |run: &Run| {
        let name = run.metadata.name.as_deref().unwrap_or("sandbox");
        let phase = match run.phase() {
            kruntimes_api::Phase::Running => "Running (registering)".to_string(),
            phase => phase.as_str().to_string(),
        };
        let why = crate::commands::why_suffix(Some(run));
        progress.set_message(format!("sandbox/{name} {phase}{why}"));
    });
    let result = tokio::select! {
        result = acquiring => result,
        _ = tokio::signal::ctrl_c() => {
            spinner.stop();
            eprintln!("krt: stopped waiting; the sandbox goes on (see `krt get runs`; release it with `krt sandbox release NAME`)");
            return Ok(outcome::EXIT_CANCELLED);
        }
    };
    spinner.stop();
    match result {
        Ok(sandbox) => {
            println!("{}", sandbox.name());
            Ok(0)
        }
        Err(e) => Ok(failed(e)),
    }
}

/// The exit code of a completed command: its own code, 124 timed out, 130 cancelled, 1
/// for a failure without a code (a signal, a start failure).
pub fn exit_code(completed: &Completed) -> u8 {
    match completed.state {
        OperationState::Succeeded => 0,
        OperationState::Failed => match completed.exit_code {
            Some(code) if (1..=255).contains(&code) => code as u8,
            Some(_) | None => outcome::EXIT_ERROR,
        },
        OperationState::TimedOut => outcome::EXIT_TIMEOUT,
        OperationState::Cancelled => outcome::EXIT_CANCELLED,
        OperationState::Unknown => outcome::EXIT_ERROR,
    }
}

/// `krt: WHAT STATE: REASON[: MESSAGE]`, on one line.
fn ending(what: &str, completed: &Completed) -> String {
    let mut line = format!(
        "krt: {what} {}: {}",
        completed.state.as_str(),
        completed.reason
    );
    if !completed.message.is_empty() {
        line.push_str(": ");
        line.push_str(&completed.message);
    }
    line.replace(['\n', '\r'], " ")
}

/// krt's last words on a completed operation: nothing for a success or a plain non-zero
/// exit (the command said it all), one line otherwise.
fn completion_line(operation_id: &str, completed: &Completed) -> Option<String> {
    let plain = match completed.state {
        OperationState::Succeeded => true,
        OperationState::Failed => completed.exit_code.is_some_and(|c| c != 0),
        OperationState::TimedOut | OperationState::Cancelled | OperationState::Unknown => false,
    };
    (!plain).then(|| ending(&format!("operation {operation_id}"), completed))
}

/// One line per output stream the runtime server cut at its cap (1 MiB): what was shown is
/// not all the command wrote.
fn truncation_lines(completed: &Completed) -> Vec<String> {
    [
        ("stdout", completed.stdout_truncated, completed.stdout_bytes),
        ("stderr", completed.stderr_truncated, completed.stderr_bytes),
    ]
    .into_iter()
    .filter(|(_, truncated, _)| *truncated)
    .map(|(stream, _, total)| {
        format!(
            "krt: the command's {stream} was truncated at {} bytes (1 MiB); it wrote {total} \
             bytes (write large output to a file and read it with `krt sandbox cat`, or export \
             it as an artifact)",
            MAX_STREAM_BYTES
        )
    })
    .collect()
}

/// `krt sandbox list`: the session Runs, oldest first.
/// `krt machine list`: the session Runs of the namespace that match `selector`, as the
/// sandbox table; `what` names them when there are none.
pub async fn list_selected(conn: Conn, selector: String, what: &str) -> Result<u8> {
    list(conn, false, selector, what).await
}

async fn list(conn: Conn, all_namespaces: bool, selector: String, what: &str) -> Result<u8> {
    let api: Api<Run> = if all_namespaces {
        Api::all(conn.client.clone())
    } else {
        Api::namespaced(conn.client.clone(), &conn.namespace)
    };
    let mut sandboxes = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut params = ListParams::default().limit(500);
        if !selector.is_empty() {
            params = params.labels(&selector);
        }
        if let Some(t) = token.take() {
            params = params.continue_token(&t);
        }
        let page = api.list(&params).await.map_err(explain)?;
        sandboxes.extend(
            page.items
                .into_iter()
                .filter(|run| run.spec.mode.session.is_some()),
        );
        match page.metadata.continue_ {
            Some(t) if !t.is_empty() => token = Some(t),
            _ => break,
        }
    }
    if sandboxes.is_empty() {
        if all_namespaces {
            eprintln!("No {what} found.");
        } else {
            eprintln!("No {what} found in namespace {}.", conn.namespace);
        }
    } else {
        print!(
            "{}",
            table::sandboxes(&sandboxes, all_namespaces, table::now_unix())
        );
    }
    Ok(0)
}

async fn open(conn: &Conn, name: &str) -> Result<(Sandbox, Session), SandboxError> {
    let sandbox = conn.sdk.sandbox(name).await?;
    let session = sandbox.open_session().await?;
    Ok((sandbox, session))
}

/// Writes output chunks where they belong, as they arrive.
fn print_output(stream: OutputStream, data: &[u8]) {
    // A closed pipe is the reader's business: the command goes on regardless.
    let _ = match stream {
        OutputStream::Stdout => {
            let mut out = std::io::stdout().lock();
            out.write_all(data).and_then(|()| out.flush())
        }
        OutputStream::Stderr => {
            let mut err = std::io::stderr().lock();
            err.write_all(data).and_then(|()| err.flush())
        }
    };
}

async fn exec(conn: Conn, name: String, operation: Operation) -> Result<u8> {
    let (_sandbox, mut session) = match open(&conn, &name).await {
        Ok(opened) => opened,
        Err(e) => return Ok(failed(e)),
    };
    let id = match session.send(&operation).await {
        Ok(id) => id,
        Err(e) => return Ok(failed(e)),
    };
    let mut output = print_output;
    let followed = tokio::select! {
        followed = session.follow(&id, &mut output) => Some(followed),
        _ = tokio::signal::ctrl_c() => None,
    };
    let followed = match followed {
        Some(followed) => followed,
        // Ctrl-C: cancel the operation, then report how it ended.
        None => {
            eprintln!("krt: cancelling operation {id}");
            match session.cancel(&id).await {
                Ok(_) => session.follow(&id, &mut output).await,
                Err(e) => Err(e),
            }
        }
    };
    session.close().await;
    match followed {
        Ok(completed) => {
            for line in truncation_lines(&completed) {
                eprintln!("{line}");
            }
            if let Some(line) = completion_line(&id, &completed) {
                eprintln!("{line}");
            }
            Ok(exit_code(&completed))
        }
        Err(e) => Ok(failed(e)),
    }
}

async fn ls(conn: Conn, name: String, path: String) -> Result<u8> {
    let sandbox = match conn.sdk.sandbox(&name).await {
        Ok(sandbox) => sandbox,
        Err(e) => return Ok(failed(e)),
    };
    let mut rows = Vec::new();
    let mut options = ListFilesOptions {
        directory: path,
        limit: LS_PAGE,
        page_token: String::new(),
    };
    loop {
        let page = match sandbox.list_files(&options).await {
            Ok(page) => page,
            Err(e) => return Ok(failed(e)),
        };
        for entry in page.entries {
            let kind = if entry.symlink {
                "link"
            } else if entry.directory {
                "dir"
            } else {
                "file"
            };
            let base = entry
                .path
                .rsplit('/')
                .next()
                .unwrap_or(&entry.path)
                .to_string();
            let shown = if entry.directory {
                format!("{base}/")
            } else {
                base
            };
            rows.push(vec![kind.to_string(), entry.size_bytes.to_string(), shown]);
        }
        if page.next_page_token.is_empty() {
            break;
        }
        options.page_token = page.next_page_token;
    }
    print!("{}", table::render(&["TYPE", "SIZE", "NAME"], &rows));
    Ok(0)
}

async fn cat(conn: Conn, name: String, path: String) -> Result<u8> {
    let sandbox = match conn.sdk.sandbox(&name).await {
        Ok(sandbox) => sandbox,
        Err(e) => return Ok(failed(e)),
    };
    let mut out = tokio::io::stdout();
    match sandbox.download(&path, &mut out).await {
        Ok(_) => Ok(0),
        Err(e) => Ok(failed(e)),
    }
}

/// Creates the missing parents of a streamed upload's target (an operation in the queue).
async fn make_parents(conn: &Conn, name: &str, parents: Option<Operation>) -> Result<(), u8> {
    let Some(mkdir) = parents else {
        return Ok(());
    };
    let (_sandbox, mut session) = open(conn, name).await.map_err(failed)?;
    let ran = session.run(&mkdir, |_, _| {}).await;
    session.close().await;
    match ran {
        Ok(completed) if completed.state == OperationState::Succeeded => Ok(()),
        Ok(completed) => {
            eprintln!("{}", ending("creating the directory", &completed));
            Err(outcome::EXIT_ERROR)
        }
        Err(e) => Err(failed(e)),
    }
}

async fn upload(
    conn: Conn,
    name: String,
    parents: Option<Operation>,
    local: PathBuf,
    path: String,
    directory: bool,
) -> Result<u8> {
    if let Err(code) = make_parents(&conn, &name, parents).await {
        return Ok(code);
    }
    let sandbox = match conn.sdk.sandbox(&name).await {
        Ok(sandbox) => sandbox,
        Err(e) => return Ok(failed(e)),
    };
    let uploaded = if directory {
        sandbox.upload_dir(&local, &path).await
    } else {
        sandbox.upload_file(&local, &path).await
    };
    match uploaded {
        Ok(_) => Ok(0),
        Err(e) => Ok(failed(e)),
    }
}

async fn get(
    conn: Conn,
    name: String,
    path: String,
    local: PathBuf,
    directory: bool,
) -> Result<u8> {
    let sandbox = match conn.sdk.sandbox(&name).await {
        Ok(sandbox) => sandbox,
        Err(e) => return Ok(failed(e)),
    };
    let got = if directory {
        sandbox.download_dir(&path, &local).await
    } else {
        sandbox.download_file(&path, &local).await
    };
    match got {
        Ok(_) => Ok(0),
        Err(e) => Ok(failed(e)),
    }
}

async fn put(
    conn: Conn,
    name: String,
    parents: Option<Operation>,
    operation: Operation,
) -> Result<u8> {
    let (_sandbox, mut session) = match open(&conn, &name).await {
        Ok(opened) => opened,
        Err(e) => return Ok(failed(e)),
    };
    if let Some(mkdir) = parents {
        match session.run(&mkdir, |_, _| {}).await {
            Ok(completed) if completed.state == OperationState::Succeeded => {}
            Ok(completed) => {
                session.close().await;
                eprintln!("{}", ending("creating the directory", &completed));
                return Ok(outcome::EXIT_ERROR);
            }
            Err(e) => {
                session.close().await;
                return Ok(failed(e));
            }
        }
    }
    let ran = session.run(&operation, |_, _| {}).await;
    session.close().await;
    match ran {
        Ok(completed) if completed.state == OperationState::Succeeded => Ok(0),
        Ok(completed) => {
            eprintln!("{}", ending("the write", &completed));
            Ok(outcome::EXIT_ERROR)
        }
        Err(e) => Ok(failed(e)),
    }
}

async fn release(conn: Conn, name: String, options: ReleaseOptions) -> Result<u8> {
    let sandbox = match conn.sdk.sandbox(&name).await {
        Ok(sandbox) => sandbox,
        Err(e) => return Ok(failed(e)),
    };
    let how = if options.immediate {
        "cancelling"
    } else {
        "draining"
    };
    let spinner = Spinner::start(format!("sandbox/{name} {how}"));
    let released = sandbox.release(options).await;
    spinner.stop();
    match released {
        Ok(Some(phase)) => {
            println!("sandbox/{name} released ({})", phase.as_str());
            Ok(0)
        }
        Ok(None) => {
            println!("sandbox/{name} released");
            Ok(0)
        }
        Err(e) => Ok(failed(e)),
    }
}

/// `krt sandbox suspend|resume NAME`: patches `spec.suspend`, then waits until the sandbox
/// is Suspended (or Ready again, in a new incarnation).
async fn suspend_or_resume(conn: Conn, name: String, suspend: bool, wait: Duration) -> Result<u8> {
    let sandbox = match conn.sdk.sandbox(&name).await {
        Ok(sandbox) => sandbox,
        Err(e) => return Ok(failed(e)),
    };
    let before = match sandbox.run().await {
        Ok(run) => run.incarnation(),
        Err(e) => return Ok(failed(e)),
    };
    let asked = if suspend {
        sandbox.suspend().await
    } else {
        sandbox.resume().await
    };
    let generation = match asked {
        Ok(generation) => generation,
        Err(e) => return Ok(failed(e)),
    };
    let how = if suspend { "suspending" } else { "resuming" };
    let spinner = Spinner::start(format!("sandbox/{name} {how} (generation {generation})"));
    let settled = if suspend {
        sandbox.wait_suspended(wait).await
    } else {
        sandbox.wait_resumed(before, wait).await
    };
    spinner.stop();
    match settled {
        Ok(run) if run.phase().is_terminal() => {
            eprintln!(
                "krt: sandbox/{name} ended {} instead{}",
                run.phase(),
                crate::commands::why_suffix(Some(&run))
            );
            Ok(outcome::EXIT_ERROR)
        }
        Ok(run) => {
            println!(
                "sandbox/{name} {} (incarnation {})",
                run.phase(),
                run.incarnation()
            );
            Ok(0)
        }
        Err(e) => Ok(failed(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completed(state: OperationState, exit_code: Option<i32>, reason: &str) -> Completed {
        Completed {
            state,
            reason: reason.into(),
            message: String::new(),
            exit_code,
            signal: None,
            duration: Duration::ZERO,
            stdout_bytes: 0,
            stderr_bytes: 0,
            stdout_truncated: false,
            stderr_truncated: false,
        }
    }

    #[test]
    fn exit_codes_follow_the_command() {
        use OperationState::*;
        assert_eq!(exit_code(&completed(Succeeded, Some(0), "Completed")), 0);
        assert_eq!(exit_code(&completed(Failed, Some(3), "NonZeroExitCode")), 3);
        assert_eq!(
            exit_code(&completed(Failed, Some(255), "NonZeroExitCode")),
            255
        );
        assert_eq!(exit_code(&completed(Failed, None, "Signaled")), 1);
        assert_eq!(exit_code(&completed(Failed, Some(-1), "x")), 1);
        assert_eq!(exit_code(&completed(TimedOut, None, "Timeout")), 124);
        assert_eq!(exit_code(&completed(Cancelled, None, "Cancelled")), 130);
        assert_eq!(
            completion_line("op-1", &completed(Failed, Some(3), "NonZeroExitCode")),
            None
        );
        assert_eq!(
            completion_line("op-2", &completed(TimedOut, None, "Timeout")).as_deref(),
            Some("krt: operation op-2 TimedOut: Timeout")
        );
    }

    #[test]
    fn truncated_streams_are_reported() {
        let mut cut = completed(OperationState::Succeeded, Some(0), "Completed");
        assert!(truncation_lines(&cut).is_empty());
        cut.stdout_truncated = true;
        cut.stdout_bytes = 10 << 20;
        let lines = truncation_lines(&cut);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].contains("stdout was truncated at 1048576 bytes")
                && lines[0].contains("10485760"),
            "{lines:?}"
        );
    }

    #[test]
    fn put_makes_the_parents_of_nested_paths() {
        assert_eq!(parent_dir("main.py"), None);
        assert_eq!(parent_dir("app/main.py"), Some("app"));
        assert_eq!(parent_dir("a/b/c.txt"), Some("a/b"));
        assert_eq!(parent_dir("./x"), None);
        assert_eq!(parent_dir("/x"), None);
    }

    #[test]
    fn labels_are_k_equals_v() {
        let labels = parse_labels("--label", &["team=a".into(), "x=".into()]).expect("ok");
        assert_eq!(labels.get("team").map(String::as_str), Some("a"));
        assert_eq!(labels.get("x").map(String::as_str), Some(""));
        assert!(parse_labels("--label", &["novalue".into()]).is_err());
        assert!(parse_labels("--label", &["=v".into()]).is_err());
        assert!(parse_labels("--label", &["a=1".into(), "a=2".into()]).is_err());
    }

    #[test]
    fn leases_take_seconds_or_durations() {
        assert_eq!(parse_lease("30").expect("s"), Duration::from_secs(30));
        assert_eq!(parse_lease("10m").expect("d"), Duration::from_secs(600));
        assert!(parse_lease("0").is_err());
        assert!(parse_lease("soon").is_err());
    }

    #[test]
    fn puts_keep_the_executable_bit_and_the_limit() {
        let dir = tempfile::tempdir().expect("dir");
        let script = dir.path().join("run.sh");
        std::fs::write(&script, "#!/bin/sh\necho hi\n").expect("write");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))
                .expect("chmod");
        }
        let op = put_operation(&script, "bin/run.sh".into()).expect("put");
        assert_eq!(
            op.to_json().expect("json")["writeFile"]["executable"],
            cfg!(unix)
        );
        let big = dir.path().join("big");
        std::fs::write(&big, vec![0u8; MAX_FILE_BYTES + 1]).expect("write");
        let e = put_operation(&big, "big".into()).expect_err("too big");
        assert!(e.to_string().contains("1 MiB"), "{e}");
        assert!(put_operation(dir.path(), "d".into()).is_err());
    }
}
