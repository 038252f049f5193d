//! The gateway's HTTP API (docs/task-mode.md, "The gateway's HTTP API"): Run logs.
//!
//! Requests go through a kube-rs client whose base URL is the gateway: it already trusts the
//! kubeconfig cluster's CA and sends the kubeconfig user's bearer token.

use std::fmt;

use http_body_util::BodyExt;
use serde::Deserialize;
use tokio::io::{AsyncWrite, AsyncWriteExt};

/// Which output stream of a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// The gateway's JSON error body.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ErrorBody {
    pub code: u16,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub message: String,
}

/// Why a gateway request failed.
#[derive(Debug)]
pub enum GatewayError {
    /// The gateway answered with an error status.
    Http(ErrorBody),
    /// The gateway could not be reached, or the answer broke off.
    Transport { url: String, error: String },
}

impl GatewayError {
    pub fn code(&self) -> Option<u16> {
        match self {
            GatewayError::Http(body) => Some(body.code),
            GatewayError::Transport { .. } => None,
        }
    }

    /// Worth trying again later: not started yet, over the limit, or the worker or the
    /// connection is briefly unavailable.
    pub fn is_transient(&self) -> bool {
        match self {
            GatewayError::Http(body) => matches!(body.code, 409 | 429 | 502 | 503 | 504),
            GatewayError::Transport { .. } => true,
        }
    }
}

impl fmt::Display for GatewayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GatewayError::Http(body) => {
                let reason = if body.reason.is_empty() {
                    "Error"
                } else {
                    body.reason.as_str()
                };
                let message = if body.message.is_empty() {
                    "(no message)"
                } else {
                    body.message.as_str()
                };
                write!(f, "the gateway answered {} {reason}: {message}", body.code)?;
                match body.code {
                    401 => write!(
                        f,
                        " (the kubeconfig user's token was refused; use a kubeconfig with a valid token)"
                    ),
                    403 => write!(f, " (the kubeconfig user may not get this Run)"),
                    429 => write!(f, " (the gateway is busy; try again)"),
                    _ => Ok(()),
                }
            }
            GatewayError::Transport { url, error } => write!(
                f,
                "cannot reach the gateway at {url}: {error}; is `kruntimes up` running? pass \
                 --gateway or set KRT_GATEWAY to override its address"
            ),
        }
    }
}

impl std::error::Error for GatewayError {}

/// Parses an error answer: the JSON body when there is one, else the status and the text.
pub fn parse_error(status: u16, body: &[u8]) -> ErrorBody {
    if let Ok(mut parsed) = serde_json::from_slice::<ErrorBody>(body) {
        if parsed.code == 0 {
            parsed.code = status;
        }
        return parsed;
    }
    let text = String::from_utf8_lossy(body);
    let text: String = text.trim().chars().take(512).collect();
    ErrorBody {
        code: status,
        reason: http::StatusCode::from_u16(status)
            .ok()
            .and_then(|s| s.canonical_reason())
            .unwrap_or("Error")
            .replace(' ', ""),
        message: text,
    }
}

/// A client of one gateway.
#[derive(Clone)]
pub struct Gateway {
    client: kube::Client,
    url: String,
}

/// An open log stream.
pub struct LogBody {
    body: kube::client::Body,
    url: String,
}

impl Gateway {
    pub fn new(client: kube::Client, url: String) -> Gateway {
        Gateway { client, url }
    }

    fn transport(&self, error: impl fmt::Display) -> GatewayError {
        GatewayError::Transport {
            url: self.url.clone(),
            error: error.to_string(),
        }
    }

    /// Opens `GET /v1/namespaces/{ns}/runs/{name}/logs`.
    pub async fn logs(
        &self,
        namespace: &str,
        name: &str,
        stream: Stream,
        follow: bool,
        attempt: Option<i32>,
    ) -> Result<LogBody, GatewayError> {
        let mut path = format!(
            "/v1/namespaces/{namespace}/runs/{name}/logs?stream={}&follow={follow}",
            stream.as_str()
        );
        if let Some(a) = attempt {
            path.push_str(&format!("&attempt={a}"));
        }
        let request = http::Request::get(path)
            .header(http::header::ACCEPT, "application/octet-stream")
            .body(kube::client::Body::empty())
            .map_err(|e| self.transport(e))?;
        let response = self
            .client
            .send(request)
            .await
            .map_err(|e| self.transport(e))?;
        let status = response.status();
        if !status.is_success() {
            let bytes = response
                .into_body()
                .collect()
                .await
                .map(|c| c.to_bytes())
                .unwrap_or_default();
            return Err(GatewayError::Http(parse_error(status.as_u16(), &bytes)));
        }
        Ok(LogBody {
            body: response.into_body(),
            url: self.url.clone(),
        })
    }
}

/// How copying a log stream ended.
#[derive(Debug)]
pub enum CopyEnd {
    /// The stream ended cleanly.
    Done,
    /// The stream broke off; what was read so far was written.
    Broken(GatewayError),
    /// Writing failed (for example a closed pipe); stop streaming.
    WriteFailed(std::io::Error),
}

impl LogBody {
    /// Copies the stream to `out`, dropping the first `skip` bytes (already written by an
    /// earlier connection). `written` counts every byte of the stream seen, skipped or not.
    /// `before_write` runs before each write (to clear a spinner).
    pub async fn copy_to<W: AsyncWrite + Unpin>(
        mut self,
        out: &mut W,
        skip: u64,
        seen: &mut u64,
        before_write: &(dyn Fn() + Send + Sync),
    ) -> CopyEnd {
        loop {
            let frame = match self.body.frame().await {
                None => return CopyEnd::Done,
                Some(Err(e)) => {
                    return CopyEnd::Broken(GatewayError::Transport {
                        url: self.url.clone(),
                        error: format!("the log stream broke off: {e}"),
                    });
                }
                Some(Ok(frame)) => frame,
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let start = *seen;
            *seen += data.len() as u64;
            let from = skip.saturating_sub(start).min(data.len() as u64) as usize;
            let chunk = &data[from..];
            if chunk.is_empty() {
                continue;
            }
            before_write();
            if let Err(e) = out.write_all(chunk).await {
                return CopyEnd::WriteFailed(e);
            }
            if let Err(e) = out.flush().await {
                return CopyEnd::WriteFailed(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_errors_are_parsed() {
        let e = parse_error(
            404,
            br#"{"code":404,"reason":"NotFound","message":"runs \"x\" not found"}"#,
        );
        assert_eq!(e.code, 404);
        assert_eq!(e.reason, "NotFound");
        let text = GatewayError::Http(e).to_string();
        assert_eq!(
            text,
            "the gateway answered 404 NotFound: runs \"x\" not found"
        );
    }

    #[test]
    fn other_errors_keep_status_and_text() {
        let e = parse_error(502, b"  upstream down \n");
        assert_eq!(e.code, 502);
        assert_eq!(e.reason, "BadGateway");
        assert_eq!(e.message, "upstream down");
        assert!(GatewayError::Http(e).is_transient());
    }

    #[test]
    fn auth_errors_say_what_to_do() {
        let e = GatewayError::Http(parse_error(401, br#"{"code":401,"reason":"Unauthorized"}"#));
        assert!(!e.is_transient());
        assert!(e.to_string().contains("token"), "{e}");
    }
}
