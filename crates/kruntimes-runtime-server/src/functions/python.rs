//! The python adapter of function registrations: one persistent interpreter per
//! registration, running the embedded launcher (`launcher.py`), and the frames
//! the server and the launcher exchange over two pipes (fd 3: requests, fd 4: responses).
//!
//! Owns starting an interpreter (or binding the warm spare of `spare.rs` to the
//! registration: into its cgroup first, then the bind frame) and waiting until it has
//! loaded the handler, one request/response exchange per invocation with its timeout,
//! measuring each invocation's share of the interpreter's log files, and killing an
//! interpreter that timed out, died or misbehaved (the next invocation starts a new one).
//! It never decides whether a registration accepts an invocation: the table in the parent
//! module does.
#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::os::fd::OwnedFd;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::watch;
use tokio::time::Instant;

use super::{
    DRAIN_LIMIT, FunctionError, INVOCATION_LOG_LIMIT_BYTES, Invocation, InvocationError,
    InvokeSpec, MAX_ERROR_MESSAGE_BYTES, MAX_RESULT_BYTES, MAX_TRACEBACK_BYTES, Outcome,
    Registration, clip_end, clip_start, empty_tail, stopped,
};
use crate::logs::{self, Tail};
use crate::sandbox::cgroup::CgroupError;
use crate::sandbox::isolation::{self, Child, SpawnError, SpawnSpec, Stdio};

use super::spare::Spare;

/// The longest frame read from a python interpreter: a 1 MiB result, escaped inside a JSON
/// string, stays far below it.
pub(super) const MAX_FRAME_BYTES: u32 = 16 * 1024 * 1024;
/// A python registration's log file is emptied after an invocation once it is this long
/// (the interpreter appends, so emptying it between invocations is safe).
const LOG_ROTATE_BYTES: u64 = 4 * 1024 * 1024;
/// How long an interpreter that closed its response pipe may take to exit by itself before
/// it is killed (so its own exit status is reported).
const EXIT_GRACE: Duration = Duration::from_secs(1);
/// The python adapter's launcher, run with `python3 -c`.
pub(super) const LAUNCHER: &str = include_str!("launcher.py");

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("the stream ended")]
    Closed,
    #[error("a frame of {len} bytes exceeds the limit of {limit}")]
    TooLarge { len: u64, limit: u32 },
    #[error("frame I/O failed")]
    Io(#[source] std::io::Error),
}

/// One frame: a 4-byte big-endian length, then `body`.
pub fn encode_frame(body: &[u8]) -> Result<Vec<u8>, FrameError> {
    let len = u32::try_from(body.len()).map_err(|_| FrameError::TooLarge {
        len: body.len() as u64,
        limit: u32::MAX,
    })?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(body);
    Ok(frame)
}

/// Reads one frame's body, refusing one longer than `limit` before reading it.
pub async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    limit: u32,
) -> Result<Vec<u8>, FrameError> {
    let io = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            FrameError::Closed
        } else {
            FrameError::Io(e)
        }
    };
    let mut header = [0u8; 4];
    reader.read_exact(&mut header).await.map_err(io)?;
    let len = u32::from_be_bytes(header);
    if len > limit {
        return Err(FrameError::TooLarge {
            len: u64::from(len),
            limit,
        });
    }
    let mut body = vec![0u8; len as usize];
    reader.read_exact(&mut body).await.map_err(io)?;
    Ok(body)
}

/// What a spare needs to become the registration's interpreter (see `launcher.py`).
#[derive(Serialize)]
struct BindFrame<'a> {
    handler: &'a str,
    run_uid: &'a str,
    attempt: u32,
    cwd: &'a str,
    env: &'a [(String, String)],
    stdout: &'a str,
    stderr: &'a str,
}

#[derive(Serialize)]
struct RequestFrame<'a> {
    id: &'a str,
    payload: &'a str,
}

/// Every frame the launcher sends: ready, a result, or a failure.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ResponseFrame {
    ready: bool,
    /// A spare took the registration's place.
    bound: bool,
    /// A spare could not take the registration's place.
    unbound: bool,
    ok: bool,
    result: Option<String>,
    #[serde(rename = "type")]
    kind: String,
    message: String,
    traceback: String,
}

impl ResponseFrame {
    fn error(self) -> InvocationError {
        InvocationError {
            kind: clip_start(&self.kind, 256),
            message: clip_start(&self.message, MAX_ERROR_MESSAGE_BYTES),
            traceback: clip_end(&self.traceback, MAX_TRACEBACK_BYTES),
        }
    }
}

/// The log files a python interpreter appends to, and the server's handles to measure and
/// read them.
pub(super) struct LogFiles {
    /// The slot whose interpreter writes these.
    slot: usize,
    stdout_path: PathBuf,
    stderr_path: PathBuf,
    stdout: File,
    stderr: File,
}

impl LogFiles {
    /// The files of slot `slot`: `stdout.log` and `stderr.log` for the first,
    /// `stdout.N.log` and `stderr.N.log` for the others.
    pub(super) fn create(dir: &Path, slot: usize) -> std::io::Result<Self> {
        let open = |path: &Path| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(path)
        };
        let name = |stream: &str| match slot {
            0 => format!("{stream}.log"),
            n => format!("{stream}.{n}.log"),
        };
        let stdout_path = dir.join(name("stdout"));
        let stderr_path = dir.join(name("stderr"));
        Ok(Self {
            slot,
            stdout: open(&stdout_path)?,
            stderr: open(&stderr_path)?,
            stdout_path,
            stderr_path,
        })
    }

    /// Handles for an interpreter: appending, so that emptying a file is safe.
    fn for_child(&self) -> std::io::Result<(File, File)> {
        let open = |path: &Path| OpenOptions::new().append(true).open(path);
        Ok((open(&self.stdout_path)?, open(&self.stderr_path)?))
    }

    fn lengths(&self) -> (u64, u64) {
        let len = |f: &File| f.metadata().map(|m| m.len()).unwrap_or(0);
        (len(&self.stdout), len(&self.stderr))
    }

    /// What was appended since `start`, bounded; then empties a file that grew past
    /// [`LOG_ROTATE_BYTES`] (only between invocations), with the lengths just read.
    fn take_since(&self, start: (u64, u64)) -> (Tail, Tail) {
        let (out_end, err_end) = self.lengths();
        let span = |file: &File, start: u64, end: u64| {
            let tail = logs::read_span_tail(file, start, end, INVOCATION_LOG_LIMIT_BYTES)
                .unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "invocation log not read");
                    empty_tail()
                });
            if end > LOG_ROTATE_BYTES {
                let _ = file.set_len(0);
            }
            tail
        };
        (
            span(&self.stdout, start.0, out_end),
            span(&self.stderr, start.1, err_end),
        )
    }
}

/// One running python interpreter that has loaded the handler.
pub(super) struct PythonWorker {
    /// The registration's slot it serves (0 for a spare until it is bound).
    pub(super) slot: usize,
    pub(super) child: Child,
    pub(super) requests: pipe::Sender,
    pub(super) responses: pipe::Receiver,
}

pub(super) struct PythonState {
    /// `None` after the interpreter was killed or died: started again before the next
    /// invocation.
    pub(super) worker: Option<PythonWorker>,
    pub(super) logs: LogFiles,
}

/// Why loading a handler failed.
#[derive(Debug)]
pub(super) enum LoadError {
    /// The import or the lookup raised.
    Raised(InvocationError),
    Exited(Option<ExitStatus>),
    TimedOut(Duration),
    Protocol(String),
    Stopped,
    Spawn(SpawnError),
    Io(std::io::Error),
    Cgroup(CgroupError),
    Sandbox(String),
}

/// Why a spare was not bound.
#[derive(Debug)]
pub(super) enum BindError {
    /// Before any of the handler's code ran: the spare is killed, the cold path follows.
    Fallback(String),
    /// Loading the handler failed, as it would have in an interpreter of its own.
    Load(LoadError),
}

impl LoadError {
    /// Bounded text for a status message; never handler output.
    pub(super) fn describe(&self) -> String {
        match self {
            LoadError::Raised(e) => {
                let mut text = format!("{}: {}", e.kind, clip_start(&e.message, 1024));
                if !e.traceback.is_empty() {
                    text.push('\n');
                    text.push_str(&clip_end(&e.traceback, 2048));
                }
                text
            }
            LoadError::Exited(status) => {
                format!(
                    "the interpreter {} before the handler was loaded",
                    describe_exit(*status)
                )
            }
            LoadError::TimedOut(limit) => format!(
                "loading the handler took longer than {:.3} s",
                limit.as_secs_f64()
            ),
            LoadError::Protocol(detail) => format!("the launcher misbehaved: {detail}"),
            LoadError::Stopped => "the registration was stopped".to_owned(),
            LoadError::Spawn(e) => format!("{e}: {}", e.source),
            LoadError::Io(e) => format!("pipe setup failed: {e}"),
            LoadError::Cgroup(e) => e.to_string(),
            LoadError::Sandbox(e) => e.clone(),
        }
    }
}

/// A path for a JSON frame.
fn utf8(path: &Path) -> Result<&str, String> {
    path.to_str()
        .ok_or_else(|| format!("{} is not UTF-8", path.display()))
}

fn describe_exit(status: Option<ExitStatus>) -> String {
    match status {
        Some(s) => match (s.code(), s.signal()) {
            (Some(code), _) => format!("exited with code {code}"),
            (None, Some(signal)) => format!("was killed by signal {signal}"),
            (None, None) => "ended".to_owned(),
        },
        None => "ended (its exit status is unknown)".to_owned(),
    }
}

impl Registration {
    /// Kills an interpreter and what it started ([`Registration::kill_slot`]), and reaps
    /// it. With `grace`, an interpreter that is already ending gets that long to exit by
    /// itself first, so that its own status is reported.
    pub(super) async fn kill_worker(
        &self,
        worker: Option<PythonWorker>,
        grace: Option<Duration>,
    ) -> Option<ExitStatus> {
        let mut worker = worker?;
        // An interpreter that had already ended before this kill (while idle, say) may have
        // ended long ago, so its process group id may name another group by now: forget it
        // rather than signal it. (With a single slot the kill is the cgroup's anyway.)
        if matches!(worker.child.try_wait(), Ok(Some(_))) {
            self.set_slot_group(worker.slot, 0);
        }
        let mut status = None;
        if let Some(grace) = grace {
            status = tokio::time::timeout(grace, worker.child.wait())
                .await
                .ok()
                .and_then(Result::ok);
        }
        self.kill_slot(worker.slot);
        if status.is_none() {
            status = tokio::time::timeout(DRAIN_LIMIT, worker.child.wait())
                .await
                .ok()
                .and_then(Result::ok);
        }
        self.slot_killed(worker.slot).await;
        status
    }

    /// Starts an interpreter and waits, at most `limit`, until it has loaded the handler.
    /// On failure nothing of it is left running.
    pub(super) async fn start_python(
        &self,
        logs: &LogFiles,
        limit: Duration,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<PythonWorker, LoadError> {
        let (request_read, request_write) = std::io::pipe().map_err(LoadError::Io)?;
        let (response_read, response_write) = std::io::pipe().map_err(LoadError::Io)?;
        let requests =
            pipe::Sender::from_owned_fd(OwnedFd::from(request_write)).map_err(LoadError::Io)?;
        let responses =
            pipe::Receiver::from_owned_fd(OwnedFd::from(response_read)).map_err(LoadError::Io)?;
        let (stdout, stderr) = logs.for_child().map_err(LoadError::Io)?;
        let cgroup_procs = match &self.cgroup {
            Some(cgroup) => Some(cgroup.open_procs().map_err(LoadError::Cgroup)?),
            None => None,
        };
        let place = self
            .place()
            .map_err(|e| LoadError::Sandbox(e.to_string()))?;
        let child = isolation::spawn_started(SpawnSpec {
            program: self.interpreter.clone().into_os_string(),
            args: [
                "-u",
                "-B",
                "-I",
                "-c",
                LAUNCHER,
                &self.handler,
                self.key.run_uid(),
                &self.key.attempt().to_string(),
            ]
            .into_iter()
            .map(OsString::from)
            .collect(),
            env: self.env.clone(),
            cwd: self.work.clone(),
            stdin: Stdio::null(),
            stdout: stdout.into(),
            stderr: stderr.into(),
            cgroup_procs,
            extra_fds: vec![request_read.into(), response_write.into()],
            place,
        })
        .await
        .map_err(LoadError::Spawn)?;
        self.set_slot_group(logs.slot, child.id().unwrap_or_default());
        let worker = PythonWorker {
            slot: logs.slot,
            child,
            requests,
            responses,
        };
        self.await_loaded(worker, limit, stop).await
    }

    /// Takes over a spare (see `spare.rs`): moves it into the registration's cgroup, sends
    /// it the bind frame and waits, at most `limit`, until it has loaded the handler. A
    /// failure before the spare confirmed the bind (so before any of the handler's code
    /// ran) is [`BindError::Fallback`], with the spare killed; after it, the outcome is
    /// what [`Self::start_python`] would report. On failure nothing of it is left running.
    pub(super) async fn bind_python(
        &self,
        spare: Spare,
        logs: &LogFiles,
        limit: Duration,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<PythonWorker, BindError> {
        let Spare { mut worker, pid } = spare;
        worker.slot = logs.slot;
        let frame = (|| {
            let body = serde_json::to_vec(&BindFrame {
                handler: &self.handler,
                run_uid: self.key.run_uid(),
                attempt: self.key.attempt(),
                cwd: utf8(&self.work)?,
                env: &self.env,
                stdout: utf8(&logs.stdout_path)?,
                stderr: utf8(&logs.stderr_path)?,
            })
            .map_err(|e| e.to_string())?;
            encode_frame(&body).map_err(|e| e.to_string())
        })();
        let frame = match frame {
            Ok(frame) => frame,
            Err(detail) => {
                Spare { worker, pid }.kill().await;
                return Err(BindError::Fallback(detail));
            }
        };
        // Into the registration's cgroup before it reads the frame, so that everything it
        // starts is the registration's.
        if let Some(cgroup) = &self.cgroup
            && let Err(e) = cgroup.attach(pid)
        {
            Spare { worker, pid }.kill().await;
            return Err(BindError::Fallback(format!("{e}")));
        }
        self.set_slot_group(logs.slot, pid);
        let PythonWorker {
            child,
            requests,
            responses,
            ..
        } = &mut worker;
        let exchange = async {
            requests
                .write_all(&frame)
                .await
                .map_err(|e| format!("the bind frame was not sent: {e}"))?;
            let body = read_frame(responses, MAX_FRAME_BYTES)
                .await
                .map_err(|e| format!("no answer to the bind frame: {e}"))?;
            match serde_json::from_slice::<ResponseFrame>(&body) {
                Ok(frame) if frame.bound => Ok(()),
                Ok(frame) if frame.unbound => Err(clip_start(&frame.message, 1024)),
                _ => Err("an unexpected answer to the bind frame".to_owned()),
            }
        };
        let bound = tokio::select! {
            biased;
            bound = exchange => bound,
            _ = child.wait() => Err("the spare exited".to_owned()),
            () = tokio::time::sleep(limit) => Err("the bind frame was not answered in time".to_owned()),
        };
        if let Err(detail) = bound {
            self.kill_worker(Some(worker), None).await;
            return Err(BindError::Fallback(detail));
        }
        self.await_loaded(worker, limit, stop)
            .await
            .map_err(BindError::Load)
    }

    /// Waits, at most `limit`, for a started launcher's first frame: ready, or why the
    /// handler did not load. On failure nothing of it is left running.
    async fn await_loaded(
        &self,
        mut worker: PythonWorker,
        limit: Duration,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<PythonWorker, LoadError> {
        enum Loaded {
            Frame(Result<Vec<u8>, FrameError>),
            Exited,
            TimedOut,
            Stopped,
        }
        let loaded = tokio::select! {
            biased;
            frame = read_frame(&mut worker.responses, MAX_FRAME_BYTES) => Loaded::Frame(frame),
            _ = worker.child.wait() => Loaded::Exited,
            () = tokio::time::sleep(limit) => Loaded::TimedOut,
            () = stopped(stop) => Loaded::Stopped,
        };
        let error = match loaded {
            Loaded::Frame(Ok(body)) => match serde_json::from_slice::<ResponseFrame>(&body) {
                Ok(frame) if frame.ready => return Ok(worker),
                Ok(frame) if !frame.ok => LoadError::Raised(frame.error()),
                Ok(_) => {
                    LoadError::Protocol("the first frame is neither ready nor an error".into())
                }
                Err(e) => LoadError::Protocol(format!("the first frame is not JSON: {e}")),
            },
            Loaded::Frame(Err(FrameError::TooLarge { len, limit })) => {
                LoadError::Protocol(format!("a frame of {len} bytes exceeds {limit}"))
            }
            Loaded::Frame(Err(_)) | Loaded::Exited => {
                let status = self.kill_worker(Some(worker), Some(EXIT_GRACE)).await;
                return Err(LoadError::Exited(status));
            }
            Loaded::TimedOut => LoadError::TimedOut(limit),
            Loaded::Stopped => LoadError::Stopped,
        };
        self.kill_worker(Some(worker), None).await;
        Err(error)
    }

    pub(super) async fn invoke_python(
        &self,
        state: &mut PythonState,
        spec: &InvokeSpec,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Invocation, FunctionError> {
        let started = Instant::now();
        // An interpreter that died since the last invocation is replaced first.
        if let Some(worker) = &mut state.worker
            && !matches!(worker.child.try_wait(), Ok(None))
        {
            tracing::info!(registration = %self.id, "interpreter died while idle; restarting it");
            let dead = state.worker.take();
            self.kill_worker(dead, None).await;
        }
        let worker = match state.worker.take() {
            Some(worker) => worker,
            // Unregistering killed the interpreter: none is started after it.
            None if *stop.borrow() => {
                return Err(FunctionError::Unregistering {
                    id: self.id.clone(),
                });
            }
            None => match self
                .start_python(&state.logs, self.load_timeout, stop)
                .await
            {
                Ok(worker) => worker,
                Err(LoadError::Stopped) => {
                    return Err(FunctionError::Unregistering {
                        id: self.id.clone(),
                    });
                }
                Err(e) => {
                    let message = clip_start(
                        &format!("the interpreter could not be restarted: {}", e.describe()),
                        MAX_ERROR_MESSAGE_BYTES,
                    );
                    tracing::warn!(registration = %self.id, %message, "registration failed");
                    self.fail("InterpreterLost", message.clone());
                    return Err(FunctionError::Failed {
                        id: self.id.clone(),
                        reason: "InterpreterLost",
                        message,
                    });
                }
            },
        };
        let worker = state.worker.insert(worker);
        let body = serde_json::to_vec(&RequestFrame {
            id: &spec.invocation_id,
            payload: &spec.payload,
        })
        .map_err(|e| FunctionError::Io {
            key: self.key.clone(),
            source: std::io::Error::other(e),
        })?;
        let frame = encode_frame(&body).map_err(|e| FunctionError::Io {
            key: self.key.clone(),
            source: std::io::Error::other(e),
        })?;
        let logs_start = state.logs.lengths();
        let deadline = Instant::now() + spec.timeout;

        enum Ending {
            Response(Result<Vec<u8>, FrameError>),
            Exited,
            TimedOut,
            Stopped,
        }
        let ending = {
            let PythonWorker {
                child,
                requests,
                responses,
                ..
            } = worker;
            let exchange = async {
                requests.write_all(&frame).await.map_err(FrameError::Io)?;
                read_frame(responses, MAX_FRAME_BYTES).await
            };
            tokio::select! {
                biased;
                response = exchange => Ending::Response(response),
                _ = child.wait() => Ending::Exited,
                () = tokio::time::sleep_until(deadline) => Ending::TimedOut,
                () = stopped(stop) => Ending::Stopped,
            }
        };
        // Unregistering kills the interpreter right after it sets `stop`; a death seen
        // first is that kill, not the handler's doing.
        let ending = match ending {
            Ending::Response(Ok(_)) => ending,
            _ if *stop.borrow() => Ending::Stopped,
            _ => ending,
        };
        let (outcome, result, error) = match ending {
            Ending::Response(Ok(body)) => match serde_json::from_slice::<ResponseFrame>(&body) {
                Ok(frame) if frame.ok => match frame.result {
                    Some(text) if text.len() > MAX_RESULT_BYTES => Invocation::failed(
                        "ResultTooLarge",
                        format!(
                            "the result is {} bytes of JSON, more than {MAX_RESULT_BYTES}",
                            text.len()
                        ),
                    ),
                    Some(text) if serde_json::from_str::<IgnoredAny>(&text).is_ok() => {
                        (Outcome::Succeeded, text.into_bytes(), None)
                    }
                    _ => Invocation::failed(
                        "ResultNotJson",
                        "the handler's result is not one JSON value".to_owned(),
                    ),
                },
                Ok(frame) if !frame.ready => (Outcome::Failed, Vec::new(), Some(frame.error())),
                parsed => {
                    let detail = match parsed {
                        Err(e) => format!("a response that is not JSON ({e})"),
                        Ok(_) => "an unexpected frame".to_owned(),
                    };
                    let worker = state.worker.take();
                    self.kill_worker(worker, None).await;
                    Invocation::failed(
                        "InterpreterExited",
                        format!(
                            "the interpreter sent {detail}; it was killed and is restarted before the next invocation"
                        ),
                    )
                }
            },
            Ending::Response(Err(_)) | Ending::Exited => {
                let worker = state.worker.take();
                let status = self.kill_worker(worker, Some(EXIT_GRACE)).await;
                Invocation::failed(
                    "InterpreterExited",
                    format!(
                        "the interpreter {} during the invocation; it is restarted before the next one",
                        describe_exit(status)
                    ),
                )
            }
            Ending::TimedOut => {
                let worker = state.worker.take();
                self.kill_worker(worker, None).await;
                (
                    Outcome::TimedOut,
                    Vec::new(),
                    Some(InvocationError::new(
                        "Timeout",
                        format!(
                            "exceeded its timeout of {:.3} s; the interpreter was killed and is restarted before the next invocation",
                            spec.timeout.as_secs_f64()
                        ),
                    )),
                )
            }
            Ending::Stopped => {
                let worker = state.worker.take();
                self.kill_worker(worker, None).await;
                return Err(FunctionError::Unregistering {
                    id: self.id.clone(),
                });
            }
        };
        let (stdout, stderr) = state.logs.take_since(logs_start);
        Ok(Invocation {
            outcome,
            result,
            error,
            stdout,
            stderr,
            duration: started.elapsed(),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip() {
        let mut stream = Vec::new();
        for body in [&b"{}"[..], b"", br#"{"id":"x","payload":"[1,2]"}"#] {
            stream.extend(encode_frame(body).unwrap());
        }
        assert_eq!(&stream[..4], &[0, 0, 0, 2]);
        let mut reader = &stream[..];
        assert_eq!(read_frame(&mut reader, 1024).await.unwrap(), b"{}");
        assert_eq!(read_frame(&mut reader, 1024).await.unwrap(), b"");
        assert_eq!(
            read_frame(&mut reader, 1024).await.unwrap(),
            br#"{"id":"x","payload":"[1,2]"}"#
        );
        assert!(matches!(
            read_frame(&mut reader, 1024).await,
            Err(FrameError::Closed)
        ));
    }

    #[tokio::test]
    async fn frames_refuse_oversized_and_truncated_input() {
        let frame = encode_frame(&[b'x'; 100]).unwrap();
        assert!(matches!(
            read_frame(&mut &frame[..], 99).await,
            Err(FrameError::TooLarge {
                len: 100,
                limit: 99
            })
        ));
        // A header that promises more than the stream holds, and a torn header.
        assert!(matches!(
            read_frame(&mut &frame[..50], 1024).await,
            Err(FrameError::Closed)
        ));
        assert!(matches!(
            read_frame(&mut &frame[..3], 1024).await,
            Err(FrameError::Closed)
        ));
    }

    #[test]
    fn response_frames_parse() {
        let ok: ResponseFrame = serde_json::from_str(r#"{"ok":true,"result":"[1]"}"#).unwrap();
        assert!(ok.ok && !ok.ready);
        assert_eq!(ok.result.as_deref(), Some("[1]"));
        let ready: ResponseFrame = serde_json::from_str(r#"{"ready":true}"#).unwrap();
        assert!(ready.ready);
        let failed: ResponseFrame = serde_json::from_str(
            r#"{"ok":false,"type":"ValueError","message":"bad","traceback":"tb"}"#,
        )
        .unwrap();
        let error = failed.error();
        assert_eq!(error.kind, "ValueError");
        assert_eq!(error.message, "bad");
        assert_eq!(error.traceback, "tb");
    }
}
