//! `krt`, the kruntimes user CLI. It talks to the API server named by `KUBECONFIG` (or
//! `--kubeconfig`, or the default data directory's kubeconfig) with kube-rs, like any other
//! client, to the gateway named in that kubeconfig for a Run's output, and to a function's
//! published endpoint to invoke it. Connecting and the function operations are the SDK's
//! (`kruntimes-client`); krt adds the command line, tables and messages.
//!
//! Exit codes: 0 when all went well, 1 for an error in krt (bad arguments, the API server
//! or the gateway refused, nothing reachable), 2 for a usage error (clap's).
//! `krt run --wait` and `krt wait` exit like the task (its own code, 124 for Timeout, 130
//! for Cancelled, 1 for a failure without a code). `krt invoke` exits 0 when the handler
//! succeeded, 3 when it failed (raised, or exited non-zero), 124 when it timed out, 4 when
//! the outcome is unknown (the gateway answered 502 or 504, or the connection broke after
//! the request was sent: the handler may or may not have run), and 1 when the invocation
//! was refused before it ran (not found, not ready, 4xx, 503). `krt function create` exits
//! 1 when the function ends before it is Ready or the wait times out, 130 on Ctrl-C (the
//! function goes on registering). docs/function-mode.md, "krt", has the table.
//! `krt sandbox exec` and `krt sandbox sh` exit with the command's own code, 124 when it
//! timed out, 130 when it was cancelled, 4 when the outcome is unknown (the connection was
//! lost after sending) and 1 when it was refused before it ran or died without a code
//! (docs/session-mode.md, "SDK and CLI").

mod commands;
mod conn;
mod follow;
mod function;
mod gateway;
mod machine;
mod outcome;
mod sandbox;
mod spec;
mod spinner;
mod table;
mod token;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::commands::{Kind, Output, RunArgs};
use crate::conn::{Conn, Settings};
use crate::function::{FunctionCommand, InvokeArgs};
use crate::machine::MachineCommand;
use crate::sandbox::SandboxCommand;
use crate::token::TokenCommand;

#[derive(Parser, Debug)]
#[command(name = "krt", version, about = "Run code on kruntimes")]
struct Cli {
    /// The kubeconfig to use; default $KUBECONFIG, then $KRUNTIMES_DATA_DIR/kubeconfig,
    /// then .kruntimes/kubeconfig.
    #[arg(long, global = true, value_name = "PATH")]
    kubeconfig: Option<PathBuf>,
    /// The namespace; default the kubeconfig context's namespace, else `default`.
    #[arg(short = 'n', long, global = true, value_name = "NS")]
    namespace: Option<String>,
    /// The gateway's URL; default the kubeconfig cluster's `kruntimes.io/gateway` extension.
    #[arg(long, global = true, env = "KRT_GATEWAY", value_name = "URL")]
    gateway: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a task: a local file (--file) or a command (after `--`) on a Runtime.
    ///
    /// Prints the new Run's name, or with --wait streams its output and exits with its
    /// exit code (124 on Timeout, 130 when Cancelled, 1 on a failure without a code).
    #[command(
        after_help = "Examples:\n  krt run --runtime python --file script.py --wait\n  krt run --runtime bash --env NAME=world --wait -- bash -c 'echo hello $NAME'"
    )]
    Run {
        /// The Runtime (worker pool) to run on.
        #[arg(long, short = 'r')]
        runtime: String,
        /// A local file to run; its contents are sent inline (at most 256 KiB) and the
        /// Runtime's interpreter runs it. Arguments after `--` are passed to it.
        #[arg(long, short = 'f', value_name = "FILE")]
        file: Option<PathBuf>,
        /// An environment variable, K=V (repeatable); a bare K copies K from here.
        #[arg(long = "env", short = 'e', value_name = "K=V")]
        env: Vec<String>,
        /// The longest the task may run once started, e.g. 30s, 5m, 1h.
        #[arg(long, value_name = "DURATION")]
        timeout: Option<String>,
        /// Stream the output and wait for the end; exit with the task's exit code.
        #[arg(long, short = 'w')]
        wait: bool,
        /// The Run's name; default `<runtime>-` plus a random suffix.
        #[arg(long)]
        name: Option<String>,
        /// The command to run (without --file) or the file's arguments (with --file).
        #[arg(last = true, value_name = "ARGV")]
        argv: Vec<String>,
    },
    /// List Runs (`krt get runs`) or Runtimes, or show one (`krt get run NAME -o yaml`).
    Get {
        /// run (runs, rn) or runtime (runtimes, rt).
        #[arg(value_parser = commands::parse_kind)]
        kind: Kind,
        /// One object to show.
        name: Option<String>,
        /// List across all namespaces.
        #[arg(short = 'A', long, conflicts_with = "name")]
        all_namespaces: bool,
        /// Print the objects as yaml or json instead of a table.
        #[arg(short = 'o', long, value_enum)]
        output: Option<Output>,
    },
    /// Print a Run's stdout (or --stderr) through the gateway.
    Logs {
        name: String,
        /// Follow the output until the Run ends (waits for it to start).
        #[arg(short = 'f', long)]
        follow: bool,
        /// Print the stderr stream instead of stdout.
        #[arg(long)]
        stderr: bool,
        /// The attempt to read (default the current one).
        #[arg(long, value_parser = clap::value_parser!(i32).range(1..))]
        attempt: Option<i32>,
    },
    /// Wait for a Run to end; print its phase and exit with its exit code.
    Wait {
        name: String,
        /// Give up (exit 1) after this long, e.g. 30s, 5m.
        #[arg(long, value_name = "DURATION")]
        timeout: Option<String>,
    },
    /// Ask Runs to stop at once (they end as Cancelled).
    Cancel {
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Delete Runs.
    Delete {
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Functions: register a handler once (`create`), list them (`list`); invoke them
    /// with `krt invoke`, delete them with `krt delete`.
    #[command(subcommand)]
    Function(FunctionCommand),
    /// Invoke a Ready function once with a JSON payload; print its result.
    ///
    /// Prints the result as JSON on stdout; what the handler wrote on stdout and stderr
    /// goes to krt's stderr. A handler that fails prints its error and traceback on stderr.
    /// Never retried.
    #[command(after_help = "Exit codes:\n  \
                0    the handler succeeded\n  \
                3    the handler failed (raised, or exited non-zero)\n  \
                124  the handler timed out\n  \
                4    the outcome is unknown (gateway 502/504, connection lost after sending): it may or may not have run\n  \
                1    refused before it ran (no such function, not ready, 4xx, 503) or another krt error\n\n\
                Examples:\n  \
                krt invoke greeter --data '{\"name\": \"world\"}'\n  \
                krt invoke greeter --data @event.json --id order-42 -o json\n  \
                echo '[1, 2]' | krt invoke summer --data -")]
    Invoke {
        /// The function's (the Run's) name.
        name: String,
        /// The payload, one JSON value (at most 1 MiB): the JSON itself, @FILE, or - for
        /// stdin. Default `{}`.
        #[arg(
            long,
            short = 'd',
            value_name = "JSON|@FILE|-",
            allow_hyphen_values = true
        )]
        data: Option<String>,
        /// The invocation ID (1 to 128 printable ASCII bytes); the gateway makes one
        /// without it.
        #[arg(long, value_name = "ID")]
        id: Option<String>,
        /// Print the whole answer (invocation ID, outcome, result or error, stdout,
        /// stderr, duration, worker) instead of the result.
        #[arg(short = 'o', long, value_enum)]
        output: Option<Output>,
    },
    /// Sandboxes: a workspace on one worker that takes commands and file operations
    /// until released (session Runs).
    #[command(subcommand)]
    Sandbox(SandboxCommand),
    /// Machines: claim a machine of a project, write files to it, run argv on it,
    /// release it (the machines view over session Runs).
    #[command(subcommand)]
    Machine(MachineCommand),
    /// Runtimes: the worker pools Runs run on.
    #[command(subcommand)]
    Runtime(RuntimeCommand),
    /// Issue, list and revoke bearer tokens.
    #[command(subcommand)]
    Token(TokenCommand),
}

#[derive(Subcommand, Debug)]
enum RuntimeCommand {
    /// List Runtimes with their workers and run slots.
    #[command(alias = "ls")]
    List {
        /// List across all namespaces.
        #[arg(short = 'A', long)]
        all_namespaces: bool,
    },
}

async fn dispatch(cli: Cli) -> anyhow::Result<u8> {
    let settings = Settings {
        kubeconfig: cli.kubeconfig,
        namespace: cli.namespace,
        gateway: cli.gateway.filter(|g| !g.is_empty()),
    };
    // Check the arguments that need no server before connecting.
    if let Command::Run {
        env, timeout, file, ..
    } = &cli.command
    {
        spec::parse_env(env, |k| std::env::var(k).ok())?;
        if let Some(t) = timeout {
            spec::parse_timeout("--timeout", t)?;
        }
        if let Some(f) = file
            && !f.is_file()
        {
            anyhow::bail!("--file {}: no such file", f.display());
        }
    }
    // The function commands read their file or payload and check it before connecting, too.
    let command = match cli.command {
        Command::Function(command) => {
            let prepared = function::prepare(command)?;
            let conn = Conn::connect(settings).await?;
            return function::run(conn, prepared).await;
        }
        Command::Invoke {
            name,
            data,
            id,
            output,
        } => {
            let body = function::invoke_payload(data.as_deref(), id.as_deref())?;
            let conn = Conn::connect(settings).await?;
            let args = InvokeArgs {
                name,
                id,
                output,
                body,
            };
            return function::invoke(conn, args).await;
        }
        Command::Sandbox(command) => {
            let prepared = sandbox::prepare(command)?;
            let conn = Conn::connect(settings).await?;
            return sandbox::run(conn, prepared).await;
        }
        Command::Machine(command) => {
            let conn = Conn::connect(settings).await?;
            return machine::run(conn, command).await;
        }
        other => other,
    };
    let conn = Conn::connect(settings).await?;
    match command {
        Command::Run {
            runtime,
            file,
            env,
            timeout,
            wait,
            name,
            argv,
        } => {
            commands::run(
                conn,
                RunArgs {
                    runtime,
                    file,
                    env,
                    timeout,
                    wait,
                    name,
                    argv,
                },
            )
            .await
        }
        Command::Get {
            kind,
            name,
            all_namespaces,
            output,
        } => commands::get(conn, kind, name, all_namespaces, output).await,
        Command::Logs {
            name,
            follow,
            stderr,
            attempt,
        } => commands::logs(conn, name, follow, stderr, attempt).await,
        Command::Wait { name, timeout } => commands::wait(conn, name, timeout).await,
        Command::Cancel { names } => commands::cancel(conn, names).await,
        Command::Delete { names } => commands::delete(conn, names).await,
        // Served above, before this match.
        Command::Function(_)
        | Command::Invoke { .. }
        | Command::Sandbox(_)
        | Command::Machine(_) => Ok(outcome::EXIT_ERROR),
        Command::Runtime(RuntimeCommand::List { all_namespaces }) => {
            commands::runtime_list(conn, all_namespaces).await
        }
        Command::Token(command) => token::run(conn, command).await.map(|()| 0),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match dispatch(cli).await {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("krt: {e:#}");
            ExitCode::from(outcome::EXIT_ERROR)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("krt").chain(args.iter().copied()))
    }

    #[test]
    fn the_cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn run_takes_argv_after_double_dash() {
        let cli = parse(&[
            "run",
            "--runtime",
            "python",
            "-e",
            "A=1",
            "--env",
            "B=2",
            "--timeout",
            "30s",
            "--wait",
            "-n",
            "team",
            "--",
            "python3",
            "-c",
            "print(1)",
        ])
        .expect("parses");
        assert_eq!(cli.namespace.as_deref(), Some("team"));
        let Command::Run {
            runtime,
            env,
            timeout,
            wait,
            argv,
            file,
            name,
        } = cli.command
        else {
            panic!("not run");
        };
        assert_eq!(runtime, "python");
        assert_eq!(env, vec!["A=1", "B=2"]);
        assert_eq!(timeout.as_deref(), Some("30s"));
        assert!(wait);
        assert_eq!(argv, vec!["python3", "-c", "print(1)"]);
        assert_eq!(file, None);
        assert_eq!(name, None);
    }

    #[test]
    fn run_with_file_and_name() {
        let cli = parse(&[
            "run",
            "--runtime",
            "python",
            "--file",
            "s.py",
            "--name",
            "mine",
        ])
        .expect("parses");
        let Command::Run {
            file, name, argv, ..
        } = cli.command
        else {
            panic!("not run");
        };
        assert_eq!(file, Some(PathBuf::from("s.py")));
        assert_eq!(name.as_deref(), Some("mine"));
        assert!(argv.is_empty());
    }

    #[test]
    fn run_needs_a_runtime() {
        assert!(parse(&["run", "--", "echo"]).is_err());
    }

    #[test]
    fn get_parses_kinds_and_formats() {
        let cli = parse(&["get", "runs", "-A"]).expect("parses");
        assert!(matches!(
            cli.command,
            Command::Get {
                kind: Kind::Runs,
                name: None,
                all_namespaces: true,
                output: None
            }
        ));
        let cli = parse(&["get", "run", "x", "-o", "yaml"]).expect("parses");
        assert!(matches!(
            cli.command,
            Command::Get {
                kind: Kind::Runs,
                name: Some(_),
                output: Some(Output::Yaml),
                ..
            }
        ));
        assert!(parse(&["get", "run", "x", "-o", "xml"]).is_err());
        assert!(parse(&["get", "pods"]).is_err());
    }

    #[test]
    fn function_commands_parse() {
        let cli = parse(&[
            "function",
            "create",
            "greeter",
            "--runtime",
            "python",
            "--file",
            "h.py",
            "--handler",
            "main:handle",
            "--idle-timeout",
            "30s",
            "-e",
            "A=1",
            "--max-attempts",
            "3",
            "--concurrency",
            "4",
            "--no-wait",
        ])
        .expect("create");
        let Command::Function(FunctionCommand::Create {
            name,
            runtime,
            file,
            handler,
            idle_timeout,
            timeout,
            env,
            max_attempts,
            concurrency,
            no_wait,
            wait_timeout,
        }) = cli.command
        else {
            panic!("not function create");
        };
        assert_eq!(
            (name.as_str(), runtime.as_str(), handler.as_str()),
            ("greeter", "python", "main:handle")
        );
        assert_eq!(file, PathBuf::from("h.py"));
        assert_eq!(idle_timeout.as_deref(), Some("30s"));
        assert_eq!(timeout, None);
        assert_eq!(env, vec!["A=1"]);
        assert_eq!(max_attempts, Some(3));
        assert_eq!(concurrency, Some(4));
        assert!(no_wait);
        assert_eq!(wait_timeout, "5m");
        // The handler and the file are required; --no-wait and --wait-timeout conflict.
        assert!(
            parse(&[
                "function",
                "create",
                "g",
                "--runtime",
                "python",
                "--file",
                "h.py"
            ])
            .is_err()
        );
        assert!(
            parse(&[
                "function",
                "create",
                "g",
                "-r",
                "python",
                "-f",
                "h.py",
                "--handler",
                "m:f",
                "--no-wait",
                "--wait-timeout",
                "1m"
            ])
            .is_err()
        );
        assert!(matches!(
            parse(&["function", "ls"]).expect("list").command,
            Command::Function(FunctionCommand::List)
        ));
        let cli = parse(&[
            "invoke", "greeter", "--data", "-", "--id", "c-1", "-o", "json",
        ])
        .expect("invoke");
        assert!(matches!(
            cli.command,
            Command::Invoke {
                data: Some(ref d),
                id: Some(ref i),
                output: Some(Output::Json),
                ..
            } if d == "-" && i == "c-1"
        ));
        // A payload that starts with a hyphen is a value, not a flag.
        let cli = parse(&["invoke", "f", "-d", "-1"]).expect("negative number");
        assert!(matches!(cli.command, Command::Invoke { data: Some(ref d), .. } if d == "-1"));
        assert!(parse(&["invoke"]).is_err());
    }

    #[test]
    fn sandbox_commands_parse() {
        let cli =
            parse(&["sandbox", "create", "--lease-timeout", "30", "-r", "python"]).expect("create");
        assert!(matches!(
            cli.command,
            Command::Sandbox(SandboxCommand::Create { ref runtime, lease_timeout: Some(ref l), .. })
                if runtime == "python" && l == "30"
        ));
        let cli = parse(&["sandbox", "create"]).expect("defaults");
        assert!(matches!(
            cli.command,
            Command::Sandbox(SandboxCommand::Create { ref runtime, lease_timeout: None, .. })
                if runtime == "bash"
        ));
        let cli = parse(&[
            "sandbox", "exec", "sb", "--cwd", "src", "-e", "A=1", "--", "ls", "-l",
        ])
        .expect("exec");
        let Command::Sandbox(SandboxCommand::Exec {
            name,
            options,
            argv,
        }) = cli.command
        else {
            panic!("not exec");
        };
        assert_eq!(name, "sb");
        assert_eq!(argv, vec!["ls", "-l"]);
        assert_eq!(options.cwd.as_deref(), Some("src"));
        assert_eq!(options.env, vec!["A=1"]);
        assert!(parse(&["sandbox", "exec", "sb"]).is_err());
        assert!(matches!(
            parse(&["sandbox", "sh", "sb", "echo hi | wc -c"]).expect("sh").command,
            Command::Sandbox(SandboxCommand::Sh { ref line, .. }) if line == "echo hi | wc -c"
        ));
        assert!(matches!(
            parse(&["sandbox", "ls", "sb"]).expect("ls").command,
            Command::Sandbox(SandboxCommand::Ls { path: None, .. })
        ));
        assert!(matches!(
            parse(&["sandbox", "ls", "sb", "src"]).expect("ls").command,
            Command::Sandbox(SandboxCommand::Ls { path: Some(_), .. })
        ));
        assert!(matches!(
            parse(&["sandbox", "cat", "sb", "a.txt"])
                .expect("cat")
                .command,
            Command::Sandbox(SandboxCommand::Cat { .. })
        ));
        assert!(matches!(
            parse(&["sandbox", "put", "sb", "local.txt", "a.txt"])
                .expect("put")
                .command,
            Command::Sandbox(SandboxCommand::Put { .. })
        ));
        assert!(matches!(
            parse(&["sandbox", "release", "sb", "--immediate"])
                .expect("release")
                .command,
            Command::Sandbox(SandboxCommand::Release {
                immediate: true,
                ..
            })
        ));
        assert!(matches!(
            parse(&["sandbox", "suspend", "sb", "--wait-timeout", "30s"])
                .expect("suspend")
                .command,
            Command::Sandbox(SandboxCommand::Suspend { ref name, ref wait_timeout })
                if name == "sb" && wait_timeout == "30s"
        ));
        assert!(matches!(
            parse(&["sandbox", "resume", "sb"]).expect("resume").command,
            Command::Sandbox(SandboxCommand::Resume { ref wait_timeout, .. }) if wait_timeout == "5m"
        ));
        let cli = parse(&["sandbox", "create", "--auto-suspend-after", "15m"]).expect("create");
        let Command::Sandbox(command @ SandboxCommand::Create { .. }) = cli.command else {
            panic!("not a create");
        };
        let crate::sandbox::Prepared::Create { options, .. } =
            crate::sandbox::prepare(command).expect("prepare")
        else {
            panic!("not a create");
        };
        assert_eq!(
            options.auto_suspend_after,
            Some(std::time::Duration::from_secs(900))
        );
        // Under a second is refused before anything is sent.
        let cli = parse(&["sandbox", "create", "--auto-suspend-after", "500ms"]).expect("parses");
        let Command::Sandbox(command) = cli.command else {
            panic!("not a sandbox command");
        };
        let refused = crate::sandbox::prepare(command)
            .err()
            .expect("under a second");
        assert!(
            format!("{refused:#}").contains("autoSuspendAfter"),
            "{refused:#}"
        );
    }

    #[test]
    fn logs_wait_cancel_delete_runtime_and_token_parse() {
        assert!(matches!(
            parse(&["logs", "r", "-f", "--stderr"])
                .expect("logs")
                .command,
            Command::Logs {
                follow: true,
                stderr: true,
                attempt: None,
                ..
            }
        ));
        assert!(parse(&["logs", "r", "--attempt", "0"]).is_err());
        assert!(matches!(
            parse(&["wait", "r", "--timeout", "5s"])
                .expect("wait")
                .command,
            Command::Wait { .. }
        ));
        assert!(matches!(
            parse(&["cancel", "a", "b"]).expect("cancel").command,
            Command::Cancel { names } if names.len() == 2
        ));
        assert!(parse(&["delete"]).is_err());
        assert!(matches!(
            parse(&["runtime", "list", "-A"]).expect("runtime").command,
            Command::Runtime(RuntimeCommand::List {
                all_namespaces: true
            })
        ));
        // The token commands keep their shape, -n included.
        let cli = parse(&[
            "token",
            "create",
            "agent",
            "-n",
            "team-a",
            "--duration",
            "10m",
        ])
        .expect("token");
        assert_eq!(cli.namespace.as_deref(), Some("team-a"));
        assert!(matches!(
            cli.command,
            Command::Token(TokenCommand::Create { .. })
        ));
    }
}
