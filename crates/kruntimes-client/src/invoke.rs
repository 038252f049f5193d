//! Invoking a Ready function: `POST` to its `status.endpoint.url` (docs/function-mode.md,
//! "Invoking").
//!
//! The call goes to the endpoint as every data-plane call does ([`crate::endpoint`]): with
//! the connection's credentials, verified with the Run's CA bundle, never retried. A 502,
//! a 504 or a connection that broke after the request went out leave the outcome unknown,
//! which the error says.

use std::time::Duration;

use http_body_util::{BodyExt, Limited};
use kruntimes_api::{Phase, Run};
use serde::{Deserialize, Deserializer};

use crate::endpoint::{self, EndpointError, Target, detail, error_answer, failed_before_sending};
use crate::function::Functions;

/// The largest request body the gateway accepts: 1 MiB (ARCHITECTURE.md, "Limits").
pub const MAX_REQUEST_BODY_BYTES: usize = 1024 * 1024;
/// The longest invocation ID (ARCHITECTURE.md, "Limits").
pub const MAX_INVOCATION_ID_BYTES: usize = 128;
/// The header that carries the invocation ID, both ways.
pub const INVOCATION_ID_HEADER: &str = "x-kruntime-invocation-id";
/// How long [`Functions::invoke`] waits for an answer by default. The gateway gives up on
/// a worker well before (its own limit answers 504).
pub const DEFAULT_INVOKE_TIMEOUT: Duration = Duration::from_secs(300);
/// The largest answer read: the result plus the two 64 KiB output tails, with room.
const MAX_ANSWER_BYTES: usize = 8 * 1024 * 1024;

/// What the handler did with one invocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Outcome {
    /// The handler returned; `result` is what it returned.
    Succeeded,
    /// The handler raised or exited non-zero; `error` says how.
    Failed,
    /// The handler ran out of time.
    TimedOut,
}

impl Outcome {
    /// The outcome as the answer writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Succeeded => "Succeeded",
            Outcome::Failed => "Failed",
            Outcome::TimedOut => "TimedOut",
        }
    }
}

/// The Run that served an invocation.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct InvocationRun {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID.
    pub uid: String,
    /// The registration attempt that served the call.
    pub attempt: u32,
}

/// How a handler failed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct HandlerError {
    /// The error's type, e.g. `ValueError`.
    #[serde(rename = "type", default)]
    pub type_: String,
    /// Its message.
    #[serde(default)]
    pub message: String,
    /// The traceback, when the runtime has one.
    #[serde(default)]
    pub traceback: String,
}

/// An answered invocation: the 200 body of the invoke API. A handler that failed is an
/// answered invocation too ([`Outcome::Failed`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Invocation {
    /// The invocation ID, the caller's or the one the gateway generated.
    pub invocation_id: String,
    /// The Run that served it.
    pub run: InvocationRun,
    /// What the handler did.
    pub outcome: Outcome,
    /// What the handler returned ([`Outcome::Succeeded`] only; `null` otherwise).
    #[serde(default)]
    pub result: serde_json::Value,
    /// How the handler failed (not for [`Outcome::Succeeded`]).
    #[serde(default)]
    pub error: Option<HandlerError>,
    /// What the handler wrote on stdout during this call (the last 64 KiB).
    #[serde(default)]
    pub stdout: String,
    /// What the handler wrote on stderr during this call (the last 64 KiB).
    #[serde(default)]
    pub stderr: String,
    /// How long the handler ran.
    #[serde(rename = "durationSeconds", deserialize_with = "seconds", default)]
    pub duration: Duration,
    /// The worker Pod that ran it.
    #[serde(default)]
    pub served_by: String,
    /// 1 when the call was forwarded to the owning worker, else 0.
    #[serde(default)]
    pub hops: u32,
    /// The answer's body, exactly as received.
    #[serde(skip)]
    body: Vec<u8>,
}

impl Invocation {
    /// The answer's JSON body exactly as the gateway sent it (fields this crate does not
    /// know included).
    pub fn body(&self) -> &[u8] {
        &self.body
    }
}

fn seconds<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    let secs = f64::deserialize(deserializer)?;
    Ok(Duration::try_from_secs_f64(secs).unwrap_or_default())
}

/// Why an invocation has no answer from the handler.
///
/// [`InvokeError::outcome_unknown`] tells the cases where the handler may have run
/// anyway; nothing in this crate retries.
#[derive(Debug, thiserror::Error)]
pub enum InvokeError {
    /// The Run cannot take invocations: it has no endpoint, or it has ended.
    #[error("function {name} is not ready (phase {}{})", phase.as_str(), detail(reason, message))]
    NotReady {
        /// The Run's name.
        name: String,
        /// Its phase.
        phase: Phase,
        /// `status.reason`, for an ended Run.
        reason: Option<String>,
        /// `status.message`, for an ended Run.
        message: Option<String>,
    },
    /// The Run's endpoint is not usable (a malformed URL, plain HTTP, no certificate in
    /// the CA bundle).
    #[error("the endpoint {url:?} of function {name} is not usable: {problem}")]
    BadEndpoint {
        /// The Run's name.
        name: String,
        /// `status.endpoint.url`.
        url: String,
        /// What is wrong.
        problem: String,
    },
    /// The request is malformed (the payload is not one JSON value or is too large, the
    /// invocation ID is not 1 to 128 printable ASCII bytes); nothing was sent.
    #[error("the invocation is malformed: {problem}")]
    BadRequest {
        /// What is wrong.
        problem: String,
    },
    /// No client could be built for the endpoint (TLS material, proxy settings).
    #[error("cannot build a client for the endpoint {url}")]
    Client {
        /// The endpoint's origin.
        url: String,
        /// kube-rs's reason.
        #[source]
        source: kube::Error,
    },
    /// The connection to the endpoint failed before the request was sent (refused, TLS
    /// verification, credentials): the invocation did not run.
    #[error("cannot reach {url}; the invocation was not sent")]
    NotSent {
        /// The endpoint URL.
        url: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
    /// The gateway answered with an error status and its error body. 502 and 504 leave
    /// the outcome unknown; every other status means the handler did not run.
    #[error("{}", http_message(*status, reason, message))]
    Http {
        /// The HTTP status.
        status: u16,
        /// The error body's machine-readable reason (`NotFound`, `NotReady`…).
        reason: String,
        /// The error body's message.
        message: String,
        /// The invocation ID the answer echoed.
        invocation_id: Option<String>,
    },
    /// The connection broke after the request was sent: the outcome is unknown.
    #[error(
        "the connection to {url} broke after the invocation was sent; it may or may not have run"
    )]
    Transport {
        /// The endpoint URL.
        url: String,
        /// The caller's invocation ID, if it gave one.
        invocation_id: Option<String>,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// No answer came within the client's limit: the outcome is unknown.
    #[error(
        "no answer from {url} within {}; the invocation may or may not have run",
        crate::function::format_duration(*limit)
    )]
    NoAnswer {
        /// The endpoint URL.
        url: String,
        /// The caller's invocation ID, if it gave one.
        invocation_id: Option<String>,
        /// The limit that passed.
        limit: Duration,
    },
    /// A 200 answer that is not the invoke API's body: the outcome is unknown.
    #[error(
        "the answer of {url} is not an invocation result ({problem}); the invocation may or may not have run"
    )]
    InvalidAnswer {
        /// The endpoint URL.
        url: String,
        /// The invocation ID the answer echoed.
        invocation_id: Option<String>,
        /// What is wrong with it.
        problem: String,
    },
}

fn http_message(status: u16, reason: &str, message: &str) -> String {
    let reason = if reason.is_empty() { "Error" } else { reason };
    let message = if message.is_empty() {
        "(no message)"
    } else {
        message
    };
    let mut text = format!("the gateway answered {status} {reason}: {message}");
    let hint = match status {
        401 => " (the credentials were refused)",
        403 => " (the caller may not get this Run)",
        429 => " (not run; try again once the call in flight has ended)",
        502 | 504 => " (the outcome is unknown: the invocation may or may not have run)",
        _ => "",
    };
    text.push_str(hint);
    text
}

impl InvokeError {
    /// Whether the handler may have run although no answer says so: a 502 or 504, a
    /// connection that broke after sending, no answer in time, or an unreadable answer.
    /// Retry such a call only if running it twice is safe.
    pub fn outcome_unknown(&self) -> bool {
        match self {
            InvokeError::Http { status, .. } => matches!(status, 502 | 504),
            InvokeError::Transport { .. }
            | InvokeError::NoAnswer { .. }
            | InvokeError::InvalidAnswer { .. } => true,
            InvokeError::NotReady { .. }
            | InvokeError::BadEndpoint { .. }
            | InvokeError::BadRequest { .. }
            | InvokeError::Client { .. }
            | InvokeError::NotSent { .. } => false,
        }
    }

    /// The HTTP status, for [`InvokeError::Http`].
    pub fn status(&self) -> Option<u16> {
        match self {
            InvokeError::Http { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The invocation ID, when one is known.
    pub fn invocation_id(&self) -> Option<&str> {
        match self {
            InvokeError::Http { invocation_id, .. }
            | InvokeError::Transport { invocation_id, .. }
            | InvokeError::NoAnswer { invocation_id, .. }
            | InvokeError::InvalidAnswer { invocation_id, .. } => invocation_id.as_deref(),
            _ => None,
        }
    }
}

/// Checks a caller's invocation ID: 1 to 128 printable ASCII bytes.
pub fn check_invocation_id(id: &str) -> Result<(), InvokeError> {
    if id.is_empty()
        || id.len() > MAX_INVOCATION_ID_BYTES
        || !id.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(InvokeError::BadRequest {
            problem: format!(
                "an invocation ID is 1 to {MAX_INVOCATION_ID_BYTES} printable ASCII bytes without spaces"
            ),
        });
    }
    Ok(())
}

/// Checks a request body: one JSON value of at most 1 MiB.
pub fn check_payload(body: &[u8]) -> Result<(), InvokeError> {
    if body.len() > MAX_REQUEST_BODY_BYTES {
        return Err(InvokeError::BadRequest {
            problem: format!(
                "the payload is {} bytes; the limit is {MAX_REQUEST_BODY_BYTES} bytes (1 MiB)",
                body.len()
            ),
        });
    }
    if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(body) {
        return Err(InvokeError::BadRequest {
            problem: format!("the payload is not one JSON value: {e}"),
        });
    }
    Ok(())
}

impl From<EndpointError> for InvokeError {
    fn from(error: EndpointError) -> InvokeError {
        match error {
            EndpointError::NotReady {
                name,
                phase,
                reason,
                message,
            } => InvokeError::NotReady {
                name,
                phase,
                reason,
                message,
            },
            EndpointError::Bad { name, url, problem } => {
                InvokeError::BadEndpoint { name, url, problem }
            }
            EndpointError::Client { url, source } => InvokeError::Client { url, source },
        }
    }
}

impl Functions {
    /// The same operations with another limit on how long [`Functions::invoke`] waits for
    /// an answer (default [`DEFAULT_INVOKE_TIMEOUT`]).
    pub fn with_invoke_timeout(mut self, limit: Duration) -> Functions {
        self.invoke_timeout = limit;
        self
    }

    /// Invokes the function `run` (as returned by [`Functions::get`] or
    /// [`Functions::wait_ready`]) with `payload`, under `invocation_id` when given (1 to
    /// 128 printable ASCII bytes; the gateway generates one otherwise).
    ///
    /// Returns the answered [`Invocation`], whatever the handler did: check
    /// [`Invocation::outcome`]. Sends the request once; never retries. Errors:
    /// [`InvokeError::NotReady`] for a Run without endpoint or that has ended (nothing
    /// sent), [`InvokeError::Http`] for the gateway's error answers, and the transport
    /// errors, for which [`InvokeError::outcome_unknown`] tells whether the handler may
    /// have run.
    pub async fn invoke(
        &self,
        run: &Run,
        payload: &serde_json::Value,
        invocation_id: Option<&str>,
    ) -> Result<Invocation, InvokeError> {
        let body = serde_json::to_vec(payload).map_err(|e| InvokeError::BadRequest {
            problem: format!("the payload cannot be encoded: {e}"),
        })?;
        self.invoke_json(run, body, invocation_id).await
    }

    /// [`Functions::invoke`] with a payload that is already JSON text, sent byte for byte
    /// after checking that it is one JSON value of at most 1 MiB.
    pub async fn invoke_json(
        &self,
        run: &Run,
        body: Vec<u8>,
        invocation_id: Option<&str>,
    ) -> Result<Invocation, InvokeError> {
        check_payload(&body)?;
        if let Some(id) = invocation_id {
            check_invocation_id(id)?;
        }
        let target: Target = endpoint::target(run)?;
        let name = run.metadata.name.clone().unwrap_or_default();
        let client = self.endpoints.get(&self.config, &name, &target)?;
        let mut request = http::Request::post(target.path.as_str())
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::ACCEPT, "application/json");
        if let Some(id) = invocation_id {
            request = request.header(INVOCATION_ID_HEADER, id);
        }
        let request =
            request
                .body(kube::client::Body::from(body))
                .map_err(|e| InvokeError::BadRequest {
                    problem: format!("cannot build the request: {e}"),
                })?;
        let caller_id = invocation_id.map(str::to_string);
        let url = target.url.clone();
        let exchange = async {
            let response = client.send(request).await.map_err(|e| {
                if failed_before_sending(&e) {
                    InvokeError::NotSent {
                        url: url.clone(),
                        source: e,
                    }
                } else {
                    InvokeError::Transport {
                        url: url.clone(),
                        invocation_id: caller_id.clone(),
                        source: Box::new(e),
                    }
                }
            })?;
            let (parts, body) = response.into_parts();
            let echoed = parts
                .headers
                .get(INVOCATION_ID_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
                .or_else(|| caller_id.clone());
            let bytes = Limited::new(body, MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|source| InvokeError::Transport {
                    url: url.clone(),
                    invocation_id: echoed.clone(),
                    source,
                })?
                .to_bytes();
            Ok::<_, InvokeError>((parts.status, echoed, bytes))
        };
        let (status, echoed, bytes) = tokio::time::timeout(self.invoke_timeout, exchange)
            .await
            .map_err(|_| InvokeError::NoAnswer {
            url: target.url.clone(),
            invocation_id: invocation_id.map(str::to_string),
            limit: self.invoke_timeout,
        })??;
        parse_answer(&target.url, status.as_u16(), echoed, &bytes)
    }
}

/// The invocation of a 200 answer, or the error of any other.
fn parse_answer(
    url: &str,
    status: u16,
    invocation_id: Option<String>,
    bytes: &[u8],
) -> Result<Invocation, InvokeError> {
    if status == 200 {
        let mut invocation: Invocation =
            serde_json::from_slice(bytes).map_err(|e| InvokeError::InvalidAnswer {
                url: url.to_string(),
                invocation_id: invocation_id.clone(),
                problem: e.to_string(),
            })?;
        invocation.body = bytes.to_vec();
        return Ok(invocation);
    }
    let (reason, message) = error_answer(status, bytes);
    Err(InvokeError::Http {
        status,
        reason,
        message,
        invocation_id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANSWER: &str = r#"{"invocationId":"call-1",
        "run":{"namespace":"default","name":"greeter","uid":"u-1","attempt":1},
        "outcome":"Succeeded","result":{"hello":"world"},
        "stdout":"printed\n","stderr":"","durationSeconds":0.25,
        "servedBy":"python-x7k2p","hops":1,"later":"a field added later"}"#;

    #[test]
    fn a_200_answer_is_an_invocation() {
        let invocation =
            parse_answer("u", 200, Some("call-1".into()), ANSWER.as_bytes()).expect("parses");
        assert_eq!(invocation.invocation_id, "call-1");
        assert_eq!(invocation.outcome, Outcome::Succeeded);
        assert_eq!(invocation.result, serde_json::json!({"hello": "world"}));
        assert_eq!(invocation.error, None);
        assert_eq!(invocation.stdout, "printed\n");
        assert_eq!(invocation.duration, Duration::from_millis(250));
        assert_eq!(invocation.served_by, "python-x7k2p");
        assert_eq!(invocation.hops, 1);
        assert_eq!(invocation.run.name, "greeter");
        assert_eq!(invocation.run.attempt, 1);
        assert_eq!(invocation.body(), ANSWER.as_bytes());
    }

    #[test]
    fn a_failed_handler_is_an_answer_too() {
        let body = br#"{"invocationId":"x","run":{"namespace":"d","name":"n","uid":"u","attempt":2},
            "outcome":"Failed","error":{"type":"ValueError","message":"bad","traceback":"Traceback..."},
            "stdout":"","stderr":"","durationSeconds":0.1,"servedBy":"p","hops":0}"#;
        let invocation = parse_answer("u", 200, None, body).expect("parses");
        assert_eq!(invocation.outcome, Outcome::Failed);
        assert_eq!(invocation.result, serde_json::Value::Null);
        let error = invocation.error.expect("error");
        assert_eq!(error.type_, "ValueError");
        assert_eq!(error.message, "bad");
    }

    #[test]
    fn an_unreadable_200_leaves_the_outcome_unknown() {
        let e = parse_answer("u", 200, Some("i".into()), b"<html>").expect_err("invalid");
        assert!(matches!(e, InvokeError::InvalidAnswer { .. }), "{e:?}");
        assert!(e.outcome_unknown());
        assert_eq!(e.invocation_id(), Some("i"));
        let e = parse_answer("u", 200, None, br#"{"outcome":"Exploded"}"#).expect_err("x");
        assert!(e.outcome_unknown());
    }

    #[test]
    fn error_answers_carry_the_gateway_body() {
        let e = parse_answer(
            "u",
            404,
            Some("id-9".into()),
            br#"{"code":404,"reason":"NotFound","message":"no function Run with UID x"}"#,
        )
        .expect_err("404");
        match &e {
            InvokeError::Http {
                status,
                reason,
                message,
                invocation_id,
            } => {
                assert_eq!(*status, 404);
                assert_eq!(reason, "NotFound");
                assert_eq!(message, "no function Run with UID x");
                assert_eq!(invocation_id.as_deref(), Some("id-9"));
            }
            other => panic!("{other:?}"),
        }
        assert!(!e.outcome_unknown());
        assert_eq!(
            e.to_string(),
            "the gateway answered 404 NotFound: no function Run with UID x"
        );
        let e = parse_answer("u", 504, None, b"upstream timeout").expect_err("504");
        assert!(e.outcome_unknown());
        assert!(
            e.to_string()
                .contains("504 GatewayTimeout: upstream timeout"),
            "{e}"
        );
        assert!(e.to_string().contains("may or may not have run"), "{e}");
        for status in [400, 401, 403, 413, 429, 503] {
            assert!(
                !parse_answer("u", status, None, b"")
                    .expect_err("err")
                    .outcome_unknown()
            );
        }
    }

    #[test]
    fn payloads_and_ids_are_checked_before_sending() {
        assert!(check_payload(br#"{"a":1}"#).is_ok());
        assert!(check_payload(b"null").is_ok());
        assert!(check_payload(b"{").is_err());
        assert!(check_payload(b"1 2").is_err());
        assert!(check_payload(b"").is_err());
        let mut big = b"\"".to_vec();
        big.extend(std::iter::repeat_n(b'x', MAX_REQUEST_BODY_BYTES));
        big.push(b'"');
        assert!(check_payload(&big).is_err());
        assert!(check_invocation_id("call-1").is_ok());
        assert!(check_invocation_id(&"x".repeat(128)).is_ok());
        for bad in ["", "a b", "é", &"x".repeat(129)] {
            assert!(check_invocation_id(bad).is_err(), "{bad:?}");
        }
    }
}
