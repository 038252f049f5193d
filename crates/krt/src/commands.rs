//! The Run commands: run, get, logs, wait, cancel, delete, runtime list.

use std::fmt::Debug;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::ValueEnum;
use kruntimes_api::lifecycle::{RUNTIME_NOT_FOUND_REASON, unscheduled_reason};
use kruntimes_api::{Phase, Run, Runtime};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::io::AsyncWrite;
use tokio::sync::watch;

use crate::conn::{Conn, explain, is_not_found};
use crate::follow::{report_waiting, stream_logs, watch_until_terminal};
use crate::gateway::{CopyEnd, Gateway, GatewayError, Stream};
use crate::outcome;
use crate::spec;
use crate::spinner::Spinner;
use crate::table;

/// How long krt keeps reading logs after the Run ended.
const LOG_DRAIN: Duration = Duration::from_secs(10);

/// `-o` formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Yaml,
    Json,
}

/// What `krt get` lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Runs,
    Runtimes,
}

/// Parses `run`, `runs`, `rn`, `runtime`, `runtimes`, `rt`.
pub fn parse_kind(text: &str) -> Result<Kind, String> {
    match text.to_ascii_lowercase().as_str() {
        "run" | "runs" | "rn" => Ok(Kind::Runs),
        "runtime" | "runtimes" | "rt" => Ok(Kind::Runtimes),
        other => Err(format!(
            "unknown kind {other:?}; krt gets runs (run, rn) and runtimes (runtime, rt)"
        )),
    }
}

/// Arguments of `krt run`.
pub struct RunArgs {
    pub runtime: String,
    pub file: Option<PathBuf>,
    pub env: Vec<String>,
    pub timeout: Option<String>,
    pub wait: bool,
    pub name: Option<String>,
    pub argv: Vec<String>,
}

fn runs(conn: &Conn) -> Api<Run> {
    Api::namespaced(conn.client.clone(), &conn.namespace)
}

fn not_found(name: &str, namespace: &str) -> anyhow::Error {
    anyhow!("run {name} not found in namespace {namespace} (see `krt get runs -n {namespace}`)")
}

/// Every object of a list, page by page.
async fn list_all<K>(api: &Api<K>) -> Result<Vec<K>>
where
    K: Clone + DeserializeOwned + Debug,
{
    kruntimes_api::paging::list_all(api, &ListParams::default())
        .await
        .map_err(explain)
}

/// Fails with the Runtimes that exist when `runtime` does not. A caller who may not read
/// Runtimes gets no check; the server decides.
pub async fn check_runtime(conn: &Conn, runtime: &str) -> Result<()> {
    let api: Api<Runtime> = Api::namespaced(conn.client.clone(), &conn.namespace);
    match api.get_opt(runtime).await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => {
            let ns = &conn.namespace;
            let names: Option<Vec<String>> = list_all(&api)
                .await
                .ok()
                .map(|list| list.into_iter().filter_map(|r| r.metadata.name).collect());
            match names {
                Some(names) if names.is_empty() => bail!(
                    "runtime {runtime:?} not found: namespace {ns} has no Runtimes; create one \
                     or pick another namespace with -n (`krt runtime list -A` shows them all)"
                ),
                Some(names) => bail!(
                    "runtime {runtime:?} not found in namespace {ns}; Runtimes there: {}",
                    names.join(", ")
                ),
                None => bail!("runtime {runtime:?} not found in namespace {ns}"),
            }
        }
        Err(kube::Error::Api(s)) if s.code == 403 => Ok(()),
        Err(e) => Err(explain(e)),
    }
}

/// Whether krt's standard input is something a caller piped or redirected in (a pipe, a
/// socket, a regular file) rather than a terminal or `/dev/null`.
fn stdin_is_piped() -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata("/dev/stdin").is_ok_and(|m| {
        let t = m.file_type();
        t.is_fifo() || t.is_socket() || (t.is_file() && m.len() > 0)
    })
}

/// `krt run`.
pub async fn run(conn: Conn, args: RunArgs) -> Result<u8> {
    // A task has no standard input (a Run carries none): say so rather than drop it.
    if stdin_is_piped() {
        eprintln!(
            "krt: standard input is ignored: a task gets none (send data with --file, --env or \
             arguments, or use a sandbox: `krt sandbox exec -i`)"
        );
    }
    let program = match &args.file {
        Some(path) => {
            let contents =
                std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
            spec::program_from_file(path, contents, args.argv)?
        }
        None => spec::program_from_argv(args.argv)?,
    };
    let env = spec::parse_env(&args.env, |k| std::env::var(k).ok())?;
    if let Some(t) = &args.timeout {
        spec::parse_timeout("--timeout", t)?;
    }
    let object = spec::build_run(
        &args.runtime,
        args.name.as_deref(),
        program,
        env,
        args.timeout.as_deref(),
    );
    // Find the gateway before creating anything, so a missing one fails early.
    let gateway = if args.wait {
        Some(conn.gateway().await?)
    } else {
        None
    };
    check_runtime(&conn, &args.runtime).await?;
    let created = match runs(&conn).create(&PostParams::default(), &object).await {
        Ok(run) => run,
        Err(kube::Error::Api(s)) if s.code == 409 => bail!(
            "run {} already exists in namespace {}; pick another --name or `krt delete {}`",
            args.name.as_deref().unwrap_or(""),
            conn.namespace,
            args.name.as_deref().unwrap_or("NAME")
        ),
        Err(e) => return Err(explain(e)),
    };
    let name = created.metadata.name.clone().unwrap_or_default();
    match gateway {
        // The bare name, so that `NAME=$(krt run …)` feeds `krt logs "$NAME"`.
        None => {
            println!("{name}");
            Ok(0)
        }
        Some(gateway) => follow_to_end(&conn, gateway, &name).await,
    }
}

/// Streams the Run's stdout and stderr to ours until it ends; exits like its program.
/// Ctrl-C once cancels the Run and keeps waiting for it to end; twice stops waiting.
async fn follow_to_end(conn: &Conn, gateway: Gateway, name: &str) -> Result<u8> {
    let ns = conn.namespace.clone();
    let (tx, mut state) = watch::channel(None);
    let mut watcher = tokio::spawn(watch_until_terminal(
        runs(conn),
        name.to_string(),
        ns.clone(),
        tx,
    ));
    let spinner = Spinner::start(format!("run/{name} Pending"));
    let streams = [Stream::Stdout, Stream::Stderr].map(|stream| {
        let (gateway, ns, name, state, spinner) = (
            gateway.clone(),
            ns.clone(),
            name.to_string(),
            state.clone(),
            spinner.clone(),
        );
        tokio::spawn(async move {
            let out: Box<dyn AsyncWrite + Unpin + Send> = match stream {
                Stream::Stdout => Box::new(tokio::io::stdout()),
                Stream::Stderr => Box::new(tokio::io::stderr()),
            };
            let result = stream_logs(
                gateway,
                ns,
                name.clone(),
                stream,
                state,
                out,
                spinner.clone(),
            )
            .await;
            if let Err(e) = result {
                spinner.stop();
                eprintln!(
                    "krt: cannot stream the {} of run {name}: {e}",
                    stream.as_str()
                );
            }
        })
    });
    let mut interrupts = 0;
    // One listener for the whole wait: a fresh `ctrl_c()` per loop turn would miss a
    // Ctrl-C that arrives between two turns. SIGTERM (a supervisor, `timeout`, `kill`)
    // counts as a Ctrl-C.
    let mut interrupt = Box::pin(tokio::signal::ctrl_c());
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot listen for SIGTERM")?;
    let finished = loop {
        tokio::select! {
            joined = &mut watcher => {
                break joined.map_err(|e| anyhow!("the watch on run {name} failed: {e}"))?;
            }
            changed = state.changed() => {
                if changed.is_ok() {
                    let current = state.borrow_and_update().clone();
                    let phase = current.as_ref().map(Run::phase);
                    if let Some(why) = current.as_ref().and_then(never_placed) {
                        // Decisive: nothing places this Run until someone creates its
                        // Runtime; the Run was made for this wait, so it is cancelled.
                        spinner.stop();
                        for s in &streams {
                            s.abort();
                        }
                        watcher.abort();
                        let cancelled = match request_cancel(&runs(conn), name).await {
                            Ok(_) => "; the Run is cancelled".to_string(),
                            Err(e) => format!("; cancelling it failed: {e:#}"),
                        };
                        bail!("run {name} cannot be placed: {why}{cancelled}");
                    }
                    match phase {
                        Some(Phase::Pending | Phase::Scheduled) | None => {
                            spinner.set_message(spinner_text(name, current.as_ref()));
                        }
                        Some(_) => spinner.stop(),
                    }
                }
            }
            ctrl_c = async {
                tokio::select! {
                    _ = &mut interrupt => true,
                    _ = terminate.recv() => false,
                }
            } => {
                if ctrl_c {
                    interrupt.set(tokio::signal::ctrl_c());
                }
                interrupts += 1;
                spinner.stop();
                if interrupts > 1 {
                    eprintln!("krt: stopped waiting; run {name} goes on ending (see `krt get run {name}`)");
                    return Ok(outcome::EXIT_CANCELLED);
                }
                eprintln!("krt: cancelling run {name}; Ctrl-C again to stop waiting");
                let api = runs(conn);
                let name = name.to_string();
                tokio::spawn(async move {
                    if let Err(e) = request_cancel(&api, &name).await {
                        eprintln!("krt: cannot cancel run {name}: {e:#}");
                    }
                });
            }
        }
    };
    let finished = match finished {
        Ok(run) => run,
        Err(e) => {
            spinner.stop();
            for s in &streams {
                s.abort();
            }
            return Err(e);
        }
    };
    spinner.stop();
    let drain = async {
        for s in streams {
            let _ = s.await;
        }
    };
    if tokio::time::timeout(LOG_DRAIN, drain).await.is_err() {
        eprintln!("krt: the output of run {name} did not finish; see `krt logs {name}`");
    }
    Ok(report_end(name, &finished))
}

/// `REASON: MESSAGE` when the Run says it cannot be placed for a reason that waiting does
/// not cure: its Runtime does not exist.
pub fn never_placed(run: &Run) -> Option<String> {
    let (reason, message) = unscheduled_reason(run.status.as_ref())?;
    (reason == RUNTIME_NOT_FOUND_REASON).then(|| format!("{reason}: {message}"))
}

/// The spinner's text while a Run waits: its phase and, once the scheduler says why it
/// is not placed, the reason and message.
pub fn spinner_text(name: &str, run: Option<&Run>) -> String {
    let phase = run.map_or(Phase::Pending, Run::phase);
    match run.and_then(|r| unscheduled_reason(r.status.as_ref())) {
        Some((reason, message)) if !reason.is_empty() => {
            format!("run/{name} {} ({reason}: {message})", phase.as_str())
        }
        Some(_) | None => format!("run/{name} {}", phase.as_str()),
    }
}

/// ` (REASON: MESSAGE)` for a Run that says why it is not placed, else nothing.
pub fn why_suffix(run: Option<&Run>) -> String {
    match run.and_then(|r| unscheduled_reason(r.status.as_ref())) {
        Some((reason, message)) if !reason.is_empty() => format!(" ({reason}: {message})"),
        Some(_) | None => String::new(),
    }
}

/// Prints the one-line reason when the Run ended other than by its program's verdict;
/// returns the exit code.
fn report_end(name: &str, run: &Run) -> u8 {
    let phase = run.phase();
    let status = run.status.as_ref();
    if let Some(line) = outcome::reason_line(name, phase, status) {
        eprintln!("{line}");
    }
    outcome::exit_code(phase, status.and_then(|s| s.exit_code))
}

/// `krt wait`: waits for a terminal phase, prints it, exits like the program.
pub async fn wait(conn: Conn, name: String, timeout: Option<String>) -> Result<u8> {
    let limit = timeout
        .as_deref()
        .map(|t| spec::parse_timeout("--timeout", t))
        .transpose()?;
    let (tx, mut state) = watch::channel(None);
    let mut watcher = tokio::spawn(watch_until_terminal(
        runs(&conn),
        name.clone(),
        conn.namespace.clone(),
        tx,
    ));
    let spinner = Spinner::start(format!("waiting for run/{name}"));
    let deadline = async {
        match limit {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    let mut deadline = std::pin::pin!(deadline);
    let finished = loop {
        tokio::select! {
            joined = &mut watcher => {
                break joined.map_err(|e| anyhow!("the watch on run {name} failed: {e}"));
            }
            changed = state.changed() => {
                if changed.is_ok() {
                    let current = state.borrow_and_update().clone();
                    if let Some(run) = current.as_ref() {
                        spinner.set_message(format!(
                            "waiting for {}",
                            spinner_text(&name, Some(run))
                        ));
                    }
                }
            }
            _ = &mut deadline => {
                watcher.abort();
                let last = state.borrow().clone();
                let phase = last.as_ref().map(Run::phase).unwrap_or(Phase::Pending);
                spinner.stop();
                bail!(
                    "timed out after {} waiting for run {name} (phase {}){}",
                    timeout.as_deref().unwrap_or(""),
                    phase.as_str(),
                    why_suffix(last.as_ref())
                );
            }
        }
    };
    spinner.stop();
    let run = finished??;
    println!("run/{name} {}", run.phase().as_str());
    Ok(report_end(&name, &run))
}

async fn request_cancel(api: &Api<Run>, name: &str) -> Result<Run> {
    let patch = json!({"spec": {"termination": {"mode": "Immediate"}}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| {
            if is_not_found(&e) {
                anyhow!("run {name} not found")
            } else {
                explain(e)
            }
        })
}

/// `krt cancel`: asks each Run to stop at once.
pub async fn cancel(conn: Conn, names: Vec<String>) -> Result<u8> {
    let api = runs(&conn);
    let mut failed = false;
    for name in names {
        match api.get_opt(&name).await.map_err(explain)? {
            None => {
                eprintln!("krt: {}", not_found(&name, &conn.namespace));
                failed = true;
            }
            Some(run) if run.phase().is_terminal() => {
                println!("run/{name} already {}", run.phase().as_str());
            }
            Some(_) => match request_cancel(&api, &name).await {
                Ok(_) => println!("run/{name} cancel requested"),
                Err(e) => {
                    eprintln!("krt: {e:#}");
                    failed = true;
                }
            },
        }
    }
    Ok(if failed { outcome::EXIT_ERROR } else { 0 })
}

/// `krt delete`.
pub async fn delete(conn: Conn, names: Vec<String>) -> Result<u8> {
    let api = runs(&conn);
    let mut failed = false;
    for name in names {
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => println!("run/{name} deleted"),
            Err(e) if is_not_found(&e) => {
                eprintln!("krt: {}", not_found(&name, &conn.namespace));
                failed = true;
            }
            Err(e) => return Err(explain(e)),
        }
    }
    Ok(if failed { outcome::EXIT_ERROR } else { 0 })
}

fn print_objects<T: Serialize>(items: &[T], single: bool, output: Output) -> Result<()> {
    let value = if single {
        serde_json::to_value(items.first().context("nothing to print")?)?
    } else {
        json!({"apiVersion": "v1", "kind": "List", "items": items})
    };
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&value)?),
        Output::Yaml => print!("{}", serde_yaml::to_string(&value)?),
    }
    Ok(())
}

/// `krt get KIND [NAME]`.
pub async fn get(
    conn: Conn,
    kind: Kind,
    name: Option<String>,
    all_namespaces: bool,
    output: Option<Output>,
) -> Result<u8> {
    let now = table::now_unix();
    let ns = conn.namespace.clone();
    match kind {
        Kind::Runs => {
            let items: Vec<Run> = match &name {
                Some(name) => {
                    let api = runs(&conn);
                    vec![
                        api.get_opt(name)
                            .await
                            .map_err(explain)?
                            .ok_or_else(|| not_found(name, &ns))?,
                    ]
                }
                None if all_namespaces => list_all(&Api::<Run>::all(conn.client.clone())).await?,
                None => list_all(&runs(&conn)).await?,
            };
            match output {
                Some(o) => print_objects(&items, name.is_some(), o)?,
                None if items.is_empty() => eprintln!("{}", nothing("runs", all_namespaces, &ns)),
                None => print!("{}", table::runs(&items, all_namespaces, now)),
            }
        }
        Kind::Runtimes => {
            let items: Vec<Runtime> = match &name {
                Some(name) => {
                    let api: Api<Runtime> = Api::namespaced(conn.client.clone(), &ns);
                    vec![api.get_opt(name).await.map_err(explain)?.ok_or_else(|| {
                        anyhow!(
                            "runtime {name} not found in namespace {ns} (see `krt runtime list -A`)"
                        )
                    })?]
                }
                None => list_runtimes(&conn, all_namespaces).await?,
            };
            match output {
                Some(o) => print_objects(&items, name.is_some(), o)?,
                None if items.is_empty() => {
                    eprintln!("{}", nothing("runtimes", all_namespaces, &ns))
                }
                None => print!("{}", table::runtimes(&items, all_namespaces, now)),
            }
        }
    }
    Ok(0)
}

fn nothing(what: &str, all_namespaces: bool, ns: &str) -> String {
    if all_namespaces {
        format!("No {what} found.")
    } else {
        format!("No {what} found in namespace {ns}.")
    }
}

async fn list_runtimes(conn: &Conn, all_namespaces: bool) -> Result<Vec<Runtime>> {
    if all_namespaces {
        list_all(&Api::<Runtime>::all(conn.client.clone())).await
    } else {
        list_all(&Api::<Runtime>::namespaced(
            conn.client.clone(),
            &conn.namespace,
        ))
        .await
    }
}

/// `krt runtime list`.
pub async fn runtime_list(conn: Conn, all_namespaces: bool) -> Result<u8> {
    get(conn, Kind::Runtimes, None, all_namespaces, None).await
}

/// `krt logs`.
pub async fn logs(
    conn: Conn,
    name: String,
    follow: bool,
    stderr: bool,
    attempt: Option<i32>,
) -> Result<u8> {
    let gateway = conn.gateway().await?;
    let stream = if stderr {
        Stream::Stderr
    } else {
        Stream::Stdout
    };
    let ns = conn.namespace.clone();
    // A sandbox has no log streams: each command's output comes back to its caller.
    if let Some(run) = runs(&conn).get_opt(&name).await.map_err(explain)?
        && run.spec.mode.session.is_some()
    {
        bail!(
            "run {name} is a sandbox (a session Run), which has no logs: each command's output \
             goes to whoever sent it; use `krt sandbox exec {name} -- …` or `krt sandbox sh \
             {name} '…'`, and `krt sandbox cat {name} FILE` for files it wrote"
        );
    }
    if follow && attempt.is_none() {
        let (tx, state) = watch::channel(None);
        let watcher = tokio::spawn(watch_until_terminal(
            runs(&conn),
            name.clone(),
            ns.clone(),
            tx,
        ));
        let spinner = Spinner::start(format!("waiting for run/{name} to start"));
        let waiting = tokio::spawn(report_waiting(state.clone(), spinner.clone()));
        let result = stream_logs(
            gateway,
            ns.clone(),
            name.clone(),
            stream,
            state,
            tokio::io::stdout(),
            spinner.clone(),
        )
        .await;
        waiting.abort();
        spinner.stop();
        // The watcher ends with the Run (or with the reason it could not watch it).
        match tokio::time::timeout(Duration::from_secs(1), watcher).await {
            Ok(Ok(Err(e))) => return Err(e),
            Ok(_) => {}
            Err(_) => {}
        }
        result.map_err(|e| explain_logs(e, &name, &ns))?;
        return Ok(0);
    }
    let body = gateway
        .logs(&ns, &name, stream, follow, attempt)
        .await
        .map_err(|e| explain_logs(e, &name, &ns))?;
    let mut seen = 0;
    let mut out = tokio::io::stdout();
    match body.copy_to(&mut out, 0, &mut seen, &|| {}).await {
        CopyEnd::Done => Ok(0),
        // A reader that went away (`krt logs r | head`) is not an error.
        CopyEnd::WriteFailed(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
        CopyEnd::WriteFailed(e) => Err(anyhow!("cannot write the logs: {e}")),
        CopyEnd::Broken(e) => Err(explain_logs(e, &name, &ns)),
    }
}

fn explain_logs(e: GatewayError, name: &str, ns: &str) -> anyhow::Error {
    let worker_gone = matches!(&e, GatewayError::Http(body) if body.reason == "WorkerGone");
    match e.code() {
        Some(404) => anyhow!("run {name} not found in namespace {ns} ({e})"),
        // The logs existed and are gone (retention, or a cluster worker's Pod that went):
        // the gateway's message says which.
        Some(410) => match &e {
            GatewayError::Http(body) if !body.message.is_empty() => anyhow!("{}", body.message),
            _ => anyhow!("the logs of run {name} are gone ({e})"),
        },
        Some(409) if worker_gone => anyhow!(
            "the worker that ran run {name} is gone, and its logs are no longer served \
             (`krt get run {name}` shows how it ended) ({e})"
        ),
        Some(409) => anyhow!(
            "run {name} has not started on a worker yet; `krt logs -f {name}` waits for it ({e})"
        ),
        _ => anyhow!("{e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse() {
        for k in ["run", "runs", "rn", "Runs"] {
            assert_eq!(parse_kind(k), Ok(Kind::Runs));
        }
        for k in ["runtime", "runtimes", "rt"] {
            assert_eq!(parse_kind(k), Ok(Kind::Runtimes));
        }
        assert!(parse_kind("pods").is_err());
    }

    #[test]
    fn log_errors_say_what_to_do() {
        let e = GatewayError::Http(crate::gateway::parse_error(
            409,
            br#"{"code":409,"reason":"NotStarted","message":"not running yet"}"#,
        ));
        let text = explain_logs(e, "r", "default").to_string();
        assert!(text.contains("krt logs -f r"), "{text}");
        let gone = GatewayError::Http(crate::gateway::parse_error(
            409,
            br#"{"code":409,"reason":"WorkerGone","message":"gone"}"#,
        ));
        let text = explain_logs(gone, "r", "default").to_string();
        assert!(
            text.contains("the worker that ran run r is gone") && !text.contains("not started"),
            "{text}"
        );
        let expired = GatewayError::Http(crate::gateway::parse_error(
            410,
            br#"{"code":410,"reason":"LogsGone","message":"the logs of attempt 1 of Run default/r are gone"}"#,
        ));
        let text = explain_logs(expired, "r", "default").to_string();
        assert_eq!(text, "the logs of attempt 1 of Run default/r are gone");
    }
}
