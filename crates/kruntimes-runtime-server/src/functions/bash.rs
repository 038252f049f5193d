//! The bash adapter of function registrations: one `bash HANDLER` per invocation, in the
//! registration's cgroup and working directory, with the request on stdin, stdout as the
//! result and stderr as a bounded tail.
//!
//! Owns feeding the request while reading both streams (so no size deadlocks), the
//! invocation's timeout, killing whatever the invocation left running, and turning stdout
//! into one JSON value. It never decides whether a registration accepts an invocation.
#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

use serde::de::IgnoredAny;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use tokio::time::Instant;

use super::{
    DRAIN_LIMIT, FunctionError, INVOCATION_LOG_LIMIT_BYTES, Invocation, InvocationError,
    InvokeSpec, MAX_RESULT_BYTES, Outcome, Registration, clip_start, empty_tail, stopped,
};
use crate::logs::TailCollector;
use crate::sandbox::isolation::{self, SpawnSpec, Stdio};

impl Registration {
    pub(super) async fn invoke_bash(
        &self,
        slot: usize,
        spec: &InvokeSpec,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Invocation, FunctionError> {
        let started = Instant::now();
        let mut env = self.env.clone();
        env.push((
            "KRUNTIME_INVOCATION_ID".to_owned(),
            spec.invocation_id.clone(),
        ));
        let cgroup_procs = match &self.cgroup {
            Some(cgroup) => Some(
                cgroup
                    .open_procs()
                    .map_err(|source| FunctionError::Cgroup {
                        key: self.key.clone(),
                        source,
                    })?,
            ),
            None => None,
        };
        if *stop.borrow() {
            // Unregistering: nothing is started after its kill.
            return Err(FunctionError::Unregistering {
                id: self.id.clone(),
            });
        }
        let place = self.place()?;
        let mut child = isolation::spawn_started(SpawnSpec {
            program: self.interpreter.clone().into_os_string(),
            args: vec![OsString::from(&self.handler)],
            env,
            cwd: self.work.clone(),
            stdin: Stdio::piped(),
            stdout: Stdio::piped(),
            stderr: Stdio::piped(),
            cgroup_procs,
            extra_fds: Vec::new(),
            place,
        })
        .await
        .map_err(|source| FunctionError::Spawn {
            key: self.key.clone(),
            source,
        })?;
        self.set_slot_group(slot, child.id().unwrap_or_default());
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let mut result = Vec::new();
        let mut result_total = 0u64;
        let mut errors = TailCollector::new(INVOCATION_LOG_LIMIT_BYTES);
        // Write the request while reading both streams: a script that writes before it
        // reads its whole stdin never deadlocks against us.
        let mut io = Box::pin(async {
            let write = async {
                if let Some(mut stdin) = stdin {
                    // A script that exits without reading its stdin closes the pipe (EPIPE).
                    let _ = stdin.write_all(spec.payload.as_bytes()).await;
                }
            };
            let read_result = async {
                if let Some(stdout) = stdout {
                    result_total = read_bounded(stdout, &mut result, MAX_RESULT_BYTES + 1).await;
                }
            };
            let read_errors = async {
                if let Some(stderr) = stderr {
                    collect(stderr, &mut errors).await;
                }
            };
            tokio::join!(write, read_result, read_errors);
        });
        let deadline = started + spec.timeout;
        enum Ending {
            Exited(std::io::Result<ExitStatus>),
            TimedOut,
            Stopped,
        }
        let mut io_done = false;
        let ending = loop {
            tokio::select! {
                () = &mut io, if !io_done => io_done = true,
                status = child.wait() => break Ending::Exited(status),
                () = tokio::time::sleep_until(deadline) => break Ending::TimedOut,
                () = stopped(stop) => break Ending::Stopped,
            }
        };
        // Unregistering kills the script right after it sets `stop`.
        let ending = match ending {
            Ending::Exited(Ok(status)) if status.success() => Ending::Exited(Ok(status)),
            _ if *stop.borrow() => Ending::Stopped,
            _ => ending,
        };
        // Nothing an invocation started outlives it (with a concurrency above 1: nothing
        // left in its process group); that also closes the pipes that background
        // processes may hold.
        self.kill_slot(slot);
        if !matches!(ending, Ending::Exited(_)) {
            let _ = tokio::time::timeout(DRAIN_LIMIT, child.wait()).await;
        }
        if !io_done {
            let _ = tokio::time::timeout(DRAIN_LIMIT, &mut io).await;
        }
        drop(io);
        self.slot_killed(slot).await;
        let stderr = errors.finish();
        let (outcome, result, error) = match ending {
            Ending::Stopped => {
                return Err(FunctionError::Unregistering {
                    id: self.id.clone(),
                });
            }
            Ending::TimedOut => (
                Outcome::TimedOut,
                Vec::new(),
                Some(InvocationError::new(
                    "Timeout",
                    format!(
                        "exceeded its timeout of {:.3} s",
                        spec.timeout.as_secs_f64()
                    ),
                )),
            ),
            Ending::Exited(Err(source)) => {
                return Err(FunctionError::Io {
                    key: self.key.clone(),
                    source,
                });
            }
            Ending::Exited(Ok(status)) => match (status.code(), status.signal()) {
                (Some(0), _) => bash_result(&result, result_total),
                (Some(code), _) => {
                    let mut message = format!("exited with code {code}");
                    if let Some(line) = last_line(&stderr.data) {
                        message.push_str(": ");
                        message.push_str(&clip_start(line, 1024));
                    }
                    Invocation::failed("NonZeroExitCode", message)
                }
                (None, signal) => Invocation::failed(
                    "InterpreterExited",
                    format!("bash was killed by signal {}", signal.unwrap_or_default()),
                ),
            },
        };
        Ok(Invocation {
            outcome,
            result,
            error,
            stdout: empty_tail(),
            stderr,
            duration: started.elapsed(),
        })
    }
}

/// Reads a stream to its end, keeping its first `limit` bytes; returns its whole length.
async fn read_bounded(mut reader: impl AsyncRead + Unpin, kept: &mut Vec<u8>, limit: usize) -> u64 {
    let mut chunk = vec![0u8; 64 * 1024];
    let mut total = 0u64;
    loop {
        match reader.read(&mut chunk).await {
            Ok(0) | Err(_) => return total,
            Ok(n) => {
                total += n as u64;
                let room = limit.saturating_sub(kept.len());
                kept.extend_from_slice(&chunk[..n.min(room)]);
            }
        }
    }
}

/// Reads a stream to its end into a bounded tail.
async fn collect(mut reader: impl AsyncRead + Unpin, tail: &mut TailCollector) {
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        match reader.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => tail.push(&chunk[..n]),
        }
    }
}

/// The result of a bash invocation that exited 0: its stdout when that is one JSON value
/// (one trailing newline ignored), else the JSON string of the text.
fn bash_result(stdout: &[u8], total: u64) -> (Outcome, Vec<u8>, Option<InvocationError>) {
    if total > MAX_RESULT_BYTES as u64 {
        return Invocation::failed(
            "ResultTooLarge",
            format!("stdout is {total} bytes, more than {MAX_RESULT_BYTES}"),
        );
    }
    let text = stdout.strip_suffix(b"\n").unwrap_or(stdout);
    let Ok(text) = std::str::from_utf8(text) else {
        return Invocation::failed(
            "ResultNotJson",
            "stdout is neither JSON nor UTF-8 text".to_owned(),
        );
    };
    if serde_json::from_str::<IgnoredAny>(text).is_ok() {
        return (Outcome::Succeeded, text.as_bytes().to_vec(), None);
    }
    match serde_json::to_vec(text) {
        Ok(json) if json.len() <= MAX_RESULT_BYTES => (Outcome::Succeeded, json, None),
        Ok(json) => Invocation::failed(
            "ResultTooLarge",
            format!(
                "stdout as a JSON string is {} bytes, more than {MAX_RESULT_BYTES}",
                json.len()
            ),
        ),
        Err(e) => Invocation::failed("ResultNotJson", format!("stdout cannot be encoded: {e}")),
    }
}

/// The last non-empty line of `data`, when it is UTF-8 text.
fn last_line(data: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(data).ok()?;
    text.lines()
        .rev()
        .map(str::trim_end)
        .find(|l| !l.is_empty())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn bash_results() {
        let (outcome, result, _) = bash_result(b"{\"a\": 1}\n", 9);
        assert_eq!(outcome, Outcome::Succeeded);
        assert_eq!(result, b"{\"a\": 1}");
        let (_, result, _) = bash_result(b"hello world\n", 12);
        assert_eq!(result, b"\"hello world\"");
        let (_, result, _) = bash_result(b"two\nlines\n\n", 11);
        assert_eq!(result, b"\"two\\nlines\\n\"");
        let (_, result, _) = bash_result(b"", 0);
        assert_eq!(result, b"\"\"");
        let (outcome, _, error) = bash_result(b"x", MAX_RESULT_BYTES as u64 + 1);
        assert_eq!(outcome, Outcome::Failed);
        assert_eq!(error.unwrap().kind, "ResultTooLarge");
        let (_, _, error) = bash_result(b"\xff\xfe", 2);
        assert_eq!(error.unwrap().kind, "ResultNotJson");
        assert_eq!(last_line(b"a\nlast one\n\n"), Some("last one"));
        assert_eq!(last_line(b""), None);
    }
}
