//! The function commands: `krt function create|list` and `krt invoke`, on the SDK's
//! [`kruntimes_client::Functions`].

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use clap::Subcommand;
use kruntimes_api::Run;
use kruntimes_client::invoke::{MAX_REQUEST_BODY_BYTES, check_invocation_id, check_payload};
use kruntimes_client::{FunctionSpec, Invocation, InvokeError, Outcome};

use crate::commands::{Output, check_runtime};
use crate::conn::{Conn, explain};
use crate::outcome;
use crate::spec;
use crate::spinner::Spinner;
use crate::table;

/// How long `krt function create` waits for Ready by default.
const DEFAULT_WAIT: &str = "5m";
/// The payload sent without `--data`.
const DEFAULT_PAYLOAD: &str = "{}";

#[derive(Subcommand, Debug)]
pub enum FunctionCommand {
    /// Register a function: a handler in a local file, on a Runtime. Waits until it is
    /// Ready and prints its endpoint URL (exit 1 if it ends instead, with the reason).
    #[command(
        after_help = "The handler names the entry point: for python `module:function` (the file is \
                      written as module.py), for bash the script's file name (it reads the request \
                      on stdin and prints the result).\n\n\
                      Examples:\n  krt function create greeter --runtime python --file handler.py --handler main:handle\n  \
                      krt function create echo --runtime bash --file echo.sh --handler echo.sh --idle-timeout 10m\n  \
                      krt invoke greeter --data '{\"name\": \"world\"}'"
    )]
    Create {
        /// The function's (the Run's) name.
        name: String,
        /// The Runtime (worker pool) to register on.
        #[arg(long, short = 'r')]
        runtime: String,
        /// The local file holding the handler's source (at most 256 KiB), sent inline.
        #[arg(long, short = 'f', value_name = "FILE")]
        file: PathBuf,
        /// The handler: `module:function` for python, the script file name for bash.
        #[arg(long)]
        handler: String,
        /// End the function after this long without invocations, e.g. 30s, 10m.
        #[arg(long, value_name = "DURATION")]
        idle_timeout: Option<String>,
        /// The longest the function may live once registered, e.g. 10m, 1h.
        #[arg(long, value_name = "DURATION")]
        timeout: Option<String>,
        /// An environment variable, K=V (repeatable); a bare K copies K from here.
        #[arg(long = "env", short = 'e', value_name = "K=V")]
        env: Vec<String>,
        /// Registration attempts in all, the first included (1 to 100; default 1): a failed
        /// registration or a lost worker is retried on a fresh attempt until they run out.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(1..=100))]
        max_attempts: Option<u8>,
        /// How many invocations may run at once (1 to 64; default 1), each in an
        /// interpreter of its own; one more is refused with 429.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(1..=64))]
        concurrency: Option<u8>,
        /// Print `run/NAME created` and return without waiting for Ready.
        #[arg(long, conflicts_with = "wait_timeout")]
        no_wait: bool,
        /// Give up waiting for Ready after this long (the function goes on).
        #[arg(long, value_name = "DURATION", default_value = DEFAULT_WAIT)]
        wait_timeout: String,
    },
    /// List the function Runs of the namespace.
    #[command(alias = "ls")]
    List,
}

/// Arguments of `krt invoke`.
pub struct InvokeArgs {
    pub name: String,
    pub id: Option<String>,
    pub output: Option<Output>,
    /// The checked payload.
    pub body: Vec<u8>,
}

/// Where `--data` comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Data {
    /// The argument is the JSON text.
    Inline(String),
    /// `@PATH`: a file's contents.
    File(PathBuf),
    /// `-`: krt's stdin.
    Stdin,
}

impl Data {
    /// Reads `--data`: `-` is stdin, `@PATH` a file, anything else the JSON itself.
    pub fn parse(text: &str) -> Data {
        if text == "-" {
            Data::Stdin
        } else if let Some(path) = text.strip_prefix('@') {
            Data::File(PathBuf::from(path))
        } else {
            Data::Inline(text.to_string())
        }
    }
}

/// Reads at most one byte more than the limit, so that a larger payload is refused
/// without reading it all.
fn read_bounded(mut from: impl Read, what: &str) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    from.by_ref()
        .take(MAX_REQUEST_BODY_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read {what}"))?;
    Ok(bytes)
}

/// The request body of `krt invoke`: `--data`, or `{}` without it; checked to be one JSON
/// value of at most 1 MiB.
pub fn payload(data: Option<&str>, stdin: impl Read) -> Result<Vec<u8>> {
    let (bytes, what) = match data.map(Data::parse) {
        None => (
            DEFAULT_PAYLOAD.as_bytes().to_vec(),
            "the default payload".to_string(),
        ),
        Some(Data::Inline(text)) => (text.into_bytes(), "--data".to_string()),
        Some(Data::File(path)) => {
            let file = std::fs::File::open(&path)
                .with_context(|| format!("--data @{}: cannot open it", path.display()))?;
            (
                read_bounded(file, &path.display().to_string())?,
                format!("--data @{}", path.display()),
            )
        }
        Some(Data::Stdin) => (
            read_bounded(stdin, "stdin")?,
            "--data - (stdin)".to_string(),
        ),
    };
    check_payload(&bytes).map_err(|e| anyhow!("{what}: {e}"))?;
    Ok(bytes)
}

/// The arguments of `krt function create` as a spec, checked before any request: the
/// file (size, text), the durations, the environment, the admission rules.
fn create_spec(
    name: &str,
    runtime: &str,
    file: &Path,
    handler: &str,
    idle_timeout: Option<&str>,
    timeout: Option<&str>,
    env: &[String],
) -> Result<FunctionSpec> {
    let contents = std::fs::read(file).with_context(|| {
        if file.is_file() {
            format!("cannot read {}", file.display())
        } else {
            format!("--file {}: no such file", file.display())
        }
    })?;
    let source = spec::source_from_file(file, contents)?;
    let mut function = FunctionSpec::new(name, runtime, handler, source);
    function.idle_timeout = idle_timeout
        .map(|t| spec::parse_timeout("--idle-timeout", t))
        .transpose()?;
    function.timeout = timeout
        .map(|t| spec::parse_timeout("--timeout", t))
        .transpose()?;
    function.env = spec::parse_env(env, |k| std::env::var(k).ok())?;
    function.to_run()?;
    Ok(function)
}

/// The one line of a function operation's error, with API errors explained as everywhere
/// in krt and a hint of what to do next.
fn explain_sdk(e: kruntimes_client::Error) -> anyhow::Error {
    use kruntimes_client::Error;
    let hint = match &e {
        Error::Api { .. } => String::new(),
        Error::NotFound { namespace, .. } => {
            format!(" (see `krt function list -n {namespace}`)")
        }
        Error::AlreadyExists { name, .. } => {
            format!("; pick another name or `krt delete {name}` first")
        }
        Error::Ended { name, .. } => format!(" (`krt get run {name} -o yaml` shows its status)"),
        Error::WaitTimedOut { name, .. } => {
            format!("; it goes on: `krt function list` shows it, `krt delete {name}` removes it")
        }
        Error::Invalid { .. }
        | Error::NotAFunction { .. }
        | Error::Deleted { .. }
        | Error::Watch { .. } => String::new(),
    };
    match e {
        Error::Api { action, source, .. } => explain(source).context(format!("cannot {action}")),
        // Keeps the causes, printed by main.
        e if hint.is_empty() => anyhow::Error::new(e),
        e => anyhow!("{e}{hint}"),
    }
}

/// A `krt function` command with its arguments checked and its file read: everything
/// that needs no server, so that mistakes fail before connecting.
pub enum Prepared {
    Create {
        spec: FunctionSpec,
        /// How long to wait for Ready; `None` with --no-wait.
        wait: Option<Duration>,
    },
    List,
}

/// Checks `command`'s arguments and reads its file.
pub fn prepare(command: FunctionCommand) -> Result<Prepared> {
    match command {
        FunctionCommand::Create {
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
        } => {
            let mut spec = create_spec(
                &name,
                &runtime,
                &file,
                &handler,
                idle_timeout.as_deref(),
                timeout.as_deref(),
                &env,
            )?;
            // clap bounds it to 1..=100, which the admission rules accept.
            spec.max_attempts = max_attempts.map(i32::from);
            // clap bounds it to 1..=64, which the admission rules accept.
            spec.concurrency = concurrency.map(i32::from);
            let limit = spec::parse_timeout("--wait-timeout", &wait_timeout)?;
            Ok(Prepared::Create {
                spec,
                wait: (!no_wait).then_some(limit),
            })
        }
        FunctionCommand::List => Ok(Prepared::List),
    }
}

/// `krt function …`.
pub async fn run(conn: Conn, command: Prepared) -> Result<u8> {
    match command {
        Prepared::Create { spec, wait } => create(conn, spec, wait).await,
        Prepared::List => list(conn).await,
    }
}

async fn create(conn: Conn, spec: FunctionSpec, wait: Option<Duration>) -> Result<u8> {
    check_runtime(&conn, &spec.runtime).await?;
    let functions = conn.functions();
    functions.create(&spec).await.map_err(explain_sdk)?;
    let name = spec.name;
    let Some(limit) = wait else {
        println!("run/{name} created");
        return Ok(0);
    };
    let spinner = Spinner::start(format!("function/{name} Pending"));
    let progress = spinner.clone();
    let label = name.clone();
    let waited = functions.wait_ready_with(&name, limit, move |run: &Run| {
        let why = crate::commands::why_suffix(Some(run));
        progress.set_message(format!("function/{label} {}{why}", phase_text(run)));
    });
    let result = tokio::select! {
        result = waited => result,
        _ = tokio::signal::ctrl_c() => {
            spinner.stop();
            eprintln!(
                "krt: stopped waiting; function {name} goes on registering (see `krt function list`)"
            );
            return Ok(outcome::EXIT_CANCELLED);
        }
    };
    spinner.stop();
    let run = result.map_err(explain_sdk)?;
    match run.status.as_ref().and_then(|s| s.endpoint.as_ref()) {
        Some(endpoint) => println!("{}", endpoint.url),
        None => println!("run/{name} Ready"),
    }
    Ok(0)
}

/// `Running` reads better as `Running (registering)` for a function.
fn phase_text(run: &Run) -> String {
    match run.phase() {
        kruntimes_api::Phase::Running => "Running (registering)".to_string(),
        phase => phase.as_str().to_string(),
    }
}

async fn list(conn: Conn) -> Result<u8> {
    let functions = conn.functions().list().await.map_err(explain_sdk)?;
    if functions.is_empty() {
        eprintln!("No functions found in namespace {}.", conn.namespace);
    } else {
        print!("{}", table::functions(&functions, table::now_unix()));
    }
    Ok(0)
}

/// Checks `krt invoke`'s arguments and reads its payload, before connecting.
pub fn invoke_payload(data: Option<&str>, id: Option<&str>) -> Result<Vec<u8>> {
    if let Some(id) = id {
        check_invocation_id(id).map_err(|e| anyhow!("--id: {e}"))?;
    }
    payload(data, std::io::stdin().lock())
}

/// `krt invoke`.
pub async fn invoke(conn: Conn, args: InvokeArgs) -> Result<u8> {
    let functions = conn.functions();
    let run = functions.get(&args.name).await.map_err(explain_sdk)?;
    let name = args.name;
    match functions
        .invoke_json(&run, args.body, args.id.as_deref())
        .await
    {
        Ok(invocation) => report(&name, &invocation, args.output),
        Err(e) => {
            let unknown = e.outcome_unknown();
            eprintln!("krt: {}", explain_invoke(&name, &conn.namespace, &e));
            if let Some(id) = e.invocation_id() {
                eprintln!("krt: invocation ID {id}");
            }
            Ok(if unknown {
                outcome::EXIT_OUTCOME_UNKNOWN
            } else {
                outcome::EXIT_ERROR
            })
        }
    }
}

fn explain_invoke(name: &str, namespace: &str, e: &InvokeError) -> String {
    match e {
        InvokeError::NotReady { .. } => {
            format!("{e} (see `krt function list -n {namespace}`)")
        }
        InvokeError::Http { status: 404, .. } => {
            format!("cannot invoke function {name}: {e} (was it deleted?)")
        }
        e => format!("cannot invoke function {name}: {e:#}", e = Chain(e)),
    }
}

/// An error and its causes on one line, `a: b: c`.
struct Chain<'a>(&'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(e) = source {
            write!(f, ": {e}")?;
            source = e.source();
        }
        Ok(())
    }
}

/// Prints an answered invocation and returns the exit code: 0 Succeeded, 3 Failed,
/// 124 TimedOut.
fn report(name: &str, invocation: &Invocation, output: Option<Output>) -> Result<u8> {
    let code = match invocation.outcome {
        Outcome::Succeeded => 0,
        Outcome::Failed => outcome::EXIT_HANDLER_FAILED,
        Outcome::TimedOut => outcome::EXIT_TIMEOUT,
    };
    let mut stdout = std::io::stdout().lock();
    if let Some(output) = output {
        match output {
            Output::Json => {
                stdout.write_all(invocation.body())?;
                writeln!(stdout)?;
            }
            Output::Yaml => {
                let value: serde_json::Value = serde_json::from_slice(invocation.body())?;
                write!(stdout, "{}", serde_yaml::to_string(&value)?)?;
            }
        }
        return Ok(code);
    }
    let mut stderr = std::io::stderr().lock();
    for text in [&invocation.stdout, &invocation.stderr] {
        if !text.is_empty() {
            stderr.write_all(text.as_bytes())?;
            if !text.ends_with('\n') {
                writeln!(stderr)?;
            }
        }
    }
    let id = &invocation.invocation_id;
    match invocation.outcome {
        Outcome::Succeeded => {
            writeln!(
                stdout,
                "{}",
                serde_json::to_string_pretty(&invocation.result)?
            )?;
        }
        Outcome::Failed | Outcome::TimedOut => {
            let error = invocation.error.clone().unwrap_or_default();
            if !error.traceback.is_empty() {
                stderr.write_all(error.traceback.as_bytes())?;
                if !error.traceback.ends_with('\n') {
                    writeln!(stderr)?;
                }
            }
            let what = match invocation.outcome {
                Outcome::TimedOut => "timed out",
                Outcome::Succeeded | Outcome::Failed => "failed",
            };
            let mut line = format!("krt: function {name} {what} (invocation {id})");
            match (error.type_.is_empty(), error.message.is_empty()) {
                (false, false) => line.push_str(&format!(": {}: {}", error.type_, error.message)),
                (false, true) => line.push_str(&format!(": {}", error.type_)),
                (true, false) => line.push_str(&format!(": {}", error.message)),
                (true, true) => {}
            }
            writeln!(stderr, "{}", line.replace(['\n', '\r'], " "))?;
        }
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_comes_inline_from_a_file_or_from_stdin() {
        assert_eq!(Data::parse("-"), Data::Stdin);
        assert_eq!(Data::parse("@in.json"), Data::File("in.json".into()));
        assert_eq!(Data::parse(r#"{"a":1}"#), Data::Inline(r#"{"a":1}"#.into()));
        assert_eq!(payload(None, std::io::empty()).expect("default"), b"{}");
        assert_eq!(
            payload(Some(r#"{"a":1}"#), std::io::empty()).expect("inline"),
            br#"{"a":1}"#
        );
        assert_eq!(
            payload(Some("-"), &b"[1, 2]\n"[..]).expect("stdin"),
            b"[1, 2]\n"
        );
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("in.json");
        std::fs::write(&path, "\"text\"").expect("write");
        let arg = format!("@{}", path.display());
        assert_eq!(
            payload(Some(&arg), std::io::empty()).expect("file"),
            b"\"text\""
        );
    }

    #[test]
    fn bad_payloads_are_refused_before_sending() {
        let e = payload(Some("{nope"), std::io::empty()).expect_err("not json");
        assert!(e.to_string().contains("--data: "), "{e}");
        assert!(e.to_string().contains("not one JSON value"), "{e}");
        let e = payload(Some("@/no/such/file"), std::io::empty()).expect_err("missing");
        assert!(e.to_string().contains("cannot open"), "{e}");
        let big = vec![b' '; MAX_REQUEST_BODY_BYTES + 10];
        let e = payload(Some("-"), &big[..]).expect_err("too big");
        assert!(e.to_string().contains("1 MiB"), "{e}");
    }

    #[test]
    fn max_attempts_becomes_the_retry_policy() {
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("handler.py");
        std::fs::write(&file, "def handle(e):\n    return e\n").expect("write");
        let prepared = prepare(FunctionCommand::Create {
            name: "g".into(),
            runtime: "python".into(),
            file,
            handler: "main:handle".into(),
            idle_timeout: None,
            timeout: None,
            env: Vec::new(),
            max_attempts: Some(3),
            concurrency: Some(4),
            no_wait: true,
            wait_timeout: DEFAULT_WAIT.into(),
        })
        .expect("valid");
        let Prepared::Create { spec, .. } = prepared else {
            panic!("not a create");
        };
        let run = spec.to_run().expect("a Run");
        assert_eq!(run.spec.function_concurrency(), 4);
        assert_eq!(run.spec.retry_policy.map(|r| r.max_attempts), Some(3));
    }

    #[test]
    fn create_arguments_are_checked_before_connecting() {
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("handler.py");
        std::fs::write(&file, "def handle(e):\n    return e\n").expect("write");
        let spec = create_spec(
            "greeter",
            "python",
            &file,
            "main:handle",
            Some("30s"),
            Some("10m"),
            &["A=1".into()],
        )
        .expect("valid");
        assert_eq!(spec.idle_timeout, Some(Duration::from_secs(30)));
        assert_eq!(spec.timeout, Some(Duration::from_secs(600)));
        assert_eq!(spec.env.len(), 1);
        let missing = dir.path().join("nope.py");
        let e = create_spec("g", "python", &missing, "m:f", None, None, &[]).expect_err("x");
        assert!(e.to_string().contains("no such file"), "{e}");
        let e = create_spec("g", "python", &file, "m:f", Some("5"), None, &[]).expect_err("x");
        assert!(e.to_string().contains("--idle-timeout"), "{e}");
        let e = create_spec("g", "python", &file, "", None, None, &[]).expect_err("x");
        assert!(e.to_string().contains("handler"), "{e}");
    }
}
