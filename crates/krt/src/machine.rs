//! `krt machine`: the machines view (design document `fn/machines/machines.go`) from
//! the shell: claim a machine, write a file to it, run an argv on it, release it. A
//! machine is a session Run of the `Exec` class in the current namespace (the org); its
//! lease ID is the Run's name.

use std::io::{Read, Write};

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use kruntimes_client::machines::{
    CLASS_LABEL, Class, ExecRequest, MachineError, Machines, PROJECT_LABEL, Spec,
};
use kruntimes_client::sandbox::SandboxError;

use crate::conn::Conn;

/// The most bytes `krt machine write` reads from standard input (held in memory; larger
/// files go with `krt sandbox put`, which streams).
const MAX_WRITE_BYTES: u64 = 64 << 20;

#[derive(Subcommand, Debug)]
pub enum MachineCommand {
    /// Claim a machine of a project: waits until it is Ready; prints its lease ID last.
    #[command(after_help = "Examples:\n  \
        L=$(krt machine claim --project demo | tail -1)\n  \
        echo 'print(1)' | krt machine write $L main.py\n  \
        krt machine exec $L -- python3 main.py\n  \
        krt machine release $L")]
    Claim {
        /// The lifetime class: exec (seconds, no volume, concurrent) or dev (the project's
        /// Workspace, exclusive per project: the lease is the project's name). desktop is
        /// refused until displays exist.
        #[arg(long, default_value = "exec", value_name = "CLASS")]
        class: String,
        /// The project the machine belongs to (a label value).
        #[arg(long)]
        project: String,
        /// End the machine this long after the claim, e.g. 10m (a floor under leaks).
        #[arg(long, value_name = "DURATION")]
        ttl: Option<String>,
        /// The Runtime (worker pool) the machine comes from.
        #[arg(long, short = 'r', default_value = "bash")]
        runtime: String,
    },
    /// Write standard input to PATH on the machine (directories made as needed).
    Write {
        /// The lease ID `krt machine claim` printed.
        lease: String,
        /// The file, relative to the machine's workspace.
        path: String,
    },
    /// Run ARGV on the machine (never through a shell); print its output; exit with its
    /// exit code (128 + a signal, 124 on timeout, 127 for a missing program). krt's own
    /// failures exit 1 (refused, not run), or 4 when the outcome is unknown (the worker or
    /// the connection was lost after sending).
    Exec {
        /// The lease ID.
        lease: String,
        /// The working directory, relative to the workspace.
        #[arg(long)]
        cwd: Option<String>,
        /// An environment variable of the command, K=V (repeatable).
        #[arg(long = "env", short = 'e', value_name = "K=V")]
        env: Vec<String>,
        /// The command's own time limit, e.g. 30s (at most the session's).
        #[arg(long, value_name = "DURATION")]
        timeout: Option<String>,
        /// The program and its arguments.
        #[arg(last = true, required = true, value_name = "ARGV")]
        argv: Vec<String>,
    },
    /// Give the machine back: asked to end at once and deleted (not waited for).
    Release {
        /// The lease ID.
        lease: String,
    },
    /// List the machines of the namespace (optionally of one project).
    #[command(alias = "ls")]
    List {
        /// Only this project's machines.
        #[arg(long)]
        project: Option<String>,
    },
}

/// Runs a `krt machine` command; its exit code.
pub async fn run(conn: Conn, command: MachineCommand) -> Result<u8> {
    let machines = |runtime: &str| Machines::new(conn.sdk.clone(), runtime);
    match command {
        MachineCommand::Claim {
            class,
            project,
            ttl,
            runtime,
        } => {
            let class = match class.as_str() {
                "exec" => Class::Exec,
                "dev" => Class::Dev,
                "desktop" => Class::Desktop,
                other => bail!("--class is one of exec, dev, desktop, not {other:?}"),
            };
            let ttl = ttl
                .map(|t| crate::spec::parse_timeout("--ttl", &t))
                .transpose()?;
            let spec = Spec {
                ttl,
                ..Spec::new(conn.namespace.clone(), class, project)
            };
            let lease = machines(&runtime).claim(&spec).await?;
            println!("{}", lease.id);
            Ok(0)
        }
        MachineCommand::Write { lease, path } => {
            let mut content = Vec::new();
            std::io::stdin()
                .take(MAX_WRITE_BYTES + 1)
                .read_to_end(&mut content)
                .context("read standard input")?;
            if content.len() as u64 > MAX_WRITE_BYTES {
                bail!(
                    "standard input is over {MAX_WRITE_BYTES} bytes; `krt sandbox put LEASE FILE PATH` streams a larger file"
                );
            }
            // Any Runtime: a lease names its Run, which knows its own.
            let machines = machines("");
            let lease = machines.lease(&conn.namespace, &lease).await?;
            machines.write(&lease, &path, &content).await?;
            Ok(0)
        }
        MachineCommand::Exec {
            lease,
            cwd,
            env,
            timeout,
            argv,
        } => {
            let env = crate::spec::parse_env(&env, |k| std::env::var(k).ok())?
                .into_iter()
                .map(|e| (e.name, e.value))
                .collect();
            let timeout = timeout
                .map(|t| crate::spec::parse_timeout("--timeout", &t))
                .transpose()?;
            let request = ExecRequest {
                argv,
                cwd,
                env,
                stdin: Vec::new(),
                timeout,
            };
            let machines = machines("");
            let lease = machines.lease(&conn.namespace, &lease).await?;
            let result = match machines.exec(&lease, &request).await {
                Ok(result) => result,
                Err(MachineError::Sandbox(error)) if error.outcome_unknown() => {
                    // Not the program's code: it may or may not have run.
                    eprintln!("krt: {error}");
                    return Ok(crate::outcome::EXIT_OUTCOME_UNKNOWN);
                }
                Err(error) => return Err(error.into()),
            };
            // A closed pipe is the reader's business.
            let _ = std::io::stdout().write_all(&result.stdout);
            let _ = std::io::stderr().write_all(&result.stderr);
            if result.timed_out {
                eprintln!("krt: the command ran out of its time and was killed");
            }
            Ok(u8::try_from(result.exit_code.clamp(0, 255)).unwrap_or(255))
        }
        MachineCommand::Release { lease } => {
            let machines = machines("");
            match machines.lease(&conn.namespace, &lease).await {
                Ok(lease) => machines.release(&lease).await?,
                // Released already.
                Err(MachineError::Sandbox(SandboxError::NotFound { .. })) => {}
                Err(error) => return Err(error.into()),
            }
            Ok(0)
        }
        MachineCommand::List { project } => {
            let mut selector = CLASS_LABEL.to_string();
            if let Some(project) = project {
                selector.push_str(&format!(",{PROJECT_LABEL}={project}"));
            }
            crate::sandbox::list_selected(conn, selector, "machines").await
        }
    }
}
