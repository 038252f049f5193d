//! Following a Run: a watch on the Run until it reaches a terminal phase, and log streams
//! from the gateway that start once an attempt runs and resume after a broken connection.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use futures::StreamExt;
use kruntimes_api::{Phase, Run};
use kube::api::{Api, WatchEvent, WatchParams};
use tokio::io::AsyncWrite;
use tokio::sync::watch;

use crate::conn::{explain, is_not_found};
use crate::gateway::{CopyEnd, Gateway, GatewayError, Stream};
use crate::spinner::Spinner;

/// How long the API server may stay unreachable while krt waits.
const API_OUTAGE_LIMIT: Duration = Duration::from_secs(60);

/// The latest observed state of a Run, shared with the log streams.
pub type RunState = watch::Receiver<Option<Run>>;

/// Whether an API error is worth retrying (the server restarting or overloaded).
fn is_transient(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => matches!(s.code, 429 | 500 | 502 | 503 | 504),
        _ => true,
    }
}

fn not_found(name: &str, namespace: &str) -> anyhow::Error {
    anyhow!("run {name} not found in namespace {namespace} (see `krt get runs -n {namespace}`)")
}

/// Watches the Run `name`, publishing every state to `tx`, until it is terminal; returns the
/// terminal Run.
pub async fn watch_until_terminal(
    api: Api<Run>,
    name: String,
    namespace: String,
    tx: watch::Sender<Option<Run>>,
) -> Result<Run> {
    let mut outage_since: Option<Instant> = None;
    let mut failures: u32 = 0;
    loop {
        if failures > 0 {
            let backoff = Duration::from_millis(200 * u64::from(failures.min(10)));
            tokio::time::sleep(backoff).await;
        }
        let run = match api.get(&name).await {
            Ok(run) => run,
            Err(e) if is_not_found(&e) => return Err(not_found(&name, &namespace)),
            Err(e) if is_transient(&e) => {
                let since = *outage_since.get_or_insert_with(Instant::now);
                if since.elapsed() > API_OUTAGE_LIMIT {
                    return Err(explain(e));
                }
                failures += 1;
                continue;
            }
            Err(e) => return Err(explain(e)),
        };
        outage_since = None;
        let version = run.metadata.resource_version.clone().unwrap_or_default();
        let terminal = run.phase().is_terminal();
        tx.send_replace(Some(run.clone()));
        if terminal {
            return Ok(run);
        }
        let params = WatchParams::default()
            .fields(&format!("metadata.name={name}"))
            .timeout(290);
        let started = Instant::now();
        let stream = match api.watch(&params, &version).await {
            Ok(stream) => stream,
            Err(e) if is_transient(&e) => {
                failures += 1;
                continue;
            }
            Err(e) => return Err(explain(e)),
        };
        let mut stream = std::pin::pin!(stream);
        let mut events = 0u32;
        while let Some(event) = stream.next().await {
            match event {
                Ok(WatchEvent::Added(run) | WatchEvent::Modified(run)) => {
                    events += 1;
                    let terminal = run.phase().is_terminal();
                    tx.send_replace(Some(run.clone()));
                    if terminal {
                        return Ok(run);
                    }
                }
                Ok(WatchEvent::Deleted(_)) => {
                    bail!("run {name} was deleted before it finished")
                }
                Ok(WatchEvent::Bookmark(_)) => {}
                // 410 Gone (history compacted) or another error: read the Run again.
                Ok(WatchEvent::Error(_)) | Err(_) => break,
            }
        }
        // A watch that ended at once without news is a failure (back off); one that ran
        // its course is normal.
        if events == 0 && started.elapsed() < Duration::from_secs(1) {
            failures += 1;
        } else {
            failures = 0;
        }
    }
}

/// The attempt whose output can be streamed: the Run has started it.
fn started_attempt(run: &Run) -> Option<i32> {
    let attempt = run.status.as_ref().and_then(|s| s.attempt)?;
    match run.phase() {
        Phase::Pending | Phase::Scheduled => None,
        Phase::Running
        | Phase::Ready
        | Phase::Finalizing
        | Phase::Suspended
        | Phase::Succeeded
        | Phase::Failed
        | Phase::Timeout
        | Phase::Cancelled => Some(attempt),
    }
}

/// Why a Run that has not started waits, on one line: its phase, then each condition that
/// is not `True` (the scheduler's `Scheduled=False` with its reason, say) and the status's
/// reason and message. `None` once an attempt started or the Run ended.
pub fn waiting_line(run: &Run) -> Option<String> {
    let name = run.metadata.name.as_deref().unwrap_or("");
    let phase = run.phase();
    match phase {
        Phase::Pending | Phase::Scheduled => {}
        Phase::Running
        | Phase::Ready
        | Phase::Finalizing
        | Phase::Suspended
        | Phase::Succeeded
        | Phase::Failed
        | Phase::Timeout
        | Phase::Cancelled => return None,
    }
    let what = match phase {
        Phase::Scheduled => "placed on a worker that has not started it yet",
        _ => "not placed on a worker yet",
    };
    let mut line = format!("krt: run {name} is {} ({what})", phase.as_str());
    let status = run.status.as_ref();
    for condition in status.map(|s| s.conditions.as_slice()).unwrap_or_default() {
        if condition.status == "True" {
            continue;
        }
        line.push_str(&format!("; {}={}", condition.type_, condition.status));
        for part in [&condition.reason, &condition.message]
            .into_iter()
            .flatten()
        {
            if !part.is_empty() {
                line.push_str(": ");
                line.push_str(part);
            }
        }
    }
    if let Some(status) = status {
        for part in [&status.reason, &status.message].into_iter().flatten() {
            if !part.is_empty() {
                line.push_str("; ");
                line.push_str(part);
            }
        }
    }
    line.push_str("; waiting");
    Some(line.replace(['\n', '\r'], " "))
}

/// Says on stderr why the Run waits, each time that changes, until an attempt starts or
/// the Run ends: on a terminal in the spinner, otherwise as lines (a pipe or a log file
/// would otherwise see nothing at all).
pub async fn report_waiting(mut state: RunState, spinner: Spinner) {
    let terminal = std::io::stderr().is_terminal();
    let mut last: Option<String> = None;
    loop {
        let line = {
            let snapshot = state.borrow_and_update();
            match snapshot.as_ref() {
                Some(run) => match waiting_line(run) {
                    Some(line) => Some(line),
                    None => return,
                },
                None => None,
            }
        };
        if let Some(line) = line
            && last.as_ref() != Some(&line)
        {
            if terminal {
                spinner.set_message(line.trim_start_matches("krt: ").to_string());
            } else {
                eprintln!("{line}");
            }
            last = Some(line);
        }
        if state.changed().await.is_err() {
            return;
        }
    }
}

/// Streams one output stream of the Run to `out` until the Run is terminal and the stream
/// of its last attempt ended. Starts once an attempt runs, follows later attempts, and
/// resumes a broken stream where it stopped. Returns an error only when streaming gave up.
pub async fn stream_logs<W: AsyncWrite + Unpin>(
    gateway: Gateway,
    namespace: String,
    name: String,
    stream: Stream,
    mut state: RunState,
    mut out: W,
    spinner: Spinner,
) -> Result<(), GatewayError> {
    let stop_spinner = move || spinner.stop();
    let mut attempt: Option<i32> = None;
    let mut written: u64 = 0;
    let mut complete = false;
    let mut failures: u32 = 0;
    let mut watcher_gone = false;
    loop {
        let (terminal, latest) = {
            let snapshot = state.borrow_and_update();
            match snapshot.as_ref() {
                Some(run) => (run.phase().is_terminal(), started_attempt(run)),
                None => (false, None),
            }
        };
        if latest.is_some() && latest != attempt {
            attempt = latest;
            written = 0;
            complete = false;
            failures = 0;
        }
        if attempt.is_none() || complete {
            if terminal || watcher_gone {
                return Ok(());
            }
            if complete {
                // The stream ended but the Run has not: look again in a while, in case
                // the connection ended early.
                match tokio::time::timeout(Duration::from_secs(5), state.changed()).await {
                    Err(_) => complete = false,
                    Ok(Err(_)) => watcher_gone = true,
                    Ok(Ok(())) => {}
                }
            } else if state.changed().await.is_err() {
                watcher_gone = true;
            }
            continue;
        }
        let last_error = match gateway.logs(&namespace, &name, stream, true, attempt).await {
            Ok(body) => {
                let mut seen = 0;
                let end = body
                    .copy_to(&mut out, written, &mut seen, &stop_spinner)
                    .await;
                written = written.max(seen);
                match end {
                    CopyEnd::Done => {
                        complete = true;
                        failures = 0;
                        continue;
                    }
                    CopyEnd::Broken(e) => e,
                    // Nobody reads any more (a closed pipe): stop quietly.
                    CopyEnd::WriteFailed(_) => return Ok(()),
                }
            }
            Err(e) if e.is_transient() => e,
            Err(e) => return Err(e),
        };
        failures += 1;
        if (terminal && failures >= 3) || failures >= 40 {
            return Err(last_error);
        }
        let backoff = Duration::from_millis(250 * u64::from(failures.min(8)));
        tokio::time::sleep(backoff).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruntimes_api::{RunSpec, RunStatus};

    fn run(phase: Option<Phase>, attempt: Option<i32>) -> Run {
        let mut run = Run::new("r", RunSpec::task("python", "main.py"));
        run.status = Some(RunStatus {
            phase,
            attempt,
            ..RunStatus::default()
        });
        run
    }

    #[test]
    fn a_waiting_run_says_why() {
        let mut pending = run(Some(Phase::Pending), None);
        pending.metadata.name = Some("r".into());
        if let Some(status) = pending.status.as_mut() {
            status.conditions.push(kruntimes_api::run::RunCondition {
                type_: "Scheduled".into(),
                status: "False".into(),
                reason: Some("Unschedulable".into()),
                message: Some("no worker of runtime python has a free slot".into()),
                ..Default::default()
            });
        }
        assert_eq!(
            waiting_line(&pending).as_deref(),
            Some(
                "krt: run r is Pending (not placed on a worker yet); Scheduled=False: \
                 Unschedulable: no worker of runtime python has a free slot; waiting"
            )
        );
        assert!(
            waiting_line(&run(None, None))
                .is_some_and(|l| l.contains("is Pending (not placed on a worker yet)"))
        );
        assert_eq!(waiting_line(&run(Some(Phase::Running), Some(1))), None);
        assert_eq!(waiting_line(&run(Some(Phase::Cancelled), None)), None);
    }

    #[test]
    fn streams_start_once_an_attempt_runs() {
        assert_eq!(started_attempt(&run(None, None)), None);
        assert_eq!(started_attempt(&run(Some(Phase::Scheduled), Some(1))), None);
        assert_eq!(started_attempt(&run(Some(Phase::Running), None)), None);
        assert_eq!(
            started_attempt(&run(Some(Phase::Running), Some(1))),
            Some(1)
        );
        assert_eq!(started_attempt(&run(Some(Phase::Failed), Some(2))), Some(2));
        assert_eq!(started_attempt(&run(Some(Phase::Cancelled), None)), None);
    }
}
