//! The gateway's errors: [`HttpError`], the JSON body every failed request answers with, and
//! [`GatewayError`], why [`crate::start`] failed.
//!
//! Every error body is `{"code": N, "reason": "...", "message": "..."}` with the HTTP status
//! in `code` (docs/task-mode.md, "The gateway's HTTP API"). Messages are at most
//! [`MAX_ERROR_MESSAGE_BYTES`] and never carry the caller's token: the handlers build them
//! from fixed text, names they validated and answers that never saw the token, and scrub the
//! token out once more before answering ([`HttpError::scrubbed`]).

use std::borrow::Cow;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::authz::AuthzError;

/// The `Retry-After` of every 429 answer, and of a 503 `NotReady` or `SessionWaking`, in
/// seconds.
pub const RETRY_AFTER_SECONDS: &str = "1";

/// The longest `message` an error body carries, in bytes.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 1024;

/// An error answer: an HTTP status, a machine-readable reason and a bounded message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpError {
    status: StatusCode,
    reason: Cow<'static, str>,
    message: String,
}

impl HttpError {
    /// An error with `status` and `reason`; `message` is cut to [`MAX_ERROR_MESSAGE_BYTES`].
    pub fn new(
        status: StatusCode,
        reason: impl Into<Cow<'static, str>>,
        message: impl Into<String>,
    ) -> HttpError {
        HttpError {
            status,
            reason: reason.into(),
            message: bound(message.into()),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> HttpError {
        HttpError::new(StatusCode::BAD_REQUEST, "BadRequest", message)
    }

    pub fn unauthorized(message: impl Into<String>) -> HttpError {
        HttpError::new(StatusCode::UNAUTHORIZED, "Unauthorized", message)
    }

    pub fn forbidden(message: impl Into<String>) -> HttpError {
        HttpError::new(StatusCode::FORBIDDEN, "Forbidden", message)
    }

    pub fn not_found(message: impl Into<String>) -> HttpError {
        HttpError::new(StatusCode::NOT_FOUND, "NotFound", message)
    }

    /// 409 `NotStarted`: the Run is not (yet) running on a worker.
    pub fn not_started(message: impl Into<String>) -> HttpError {
        HttpError::new(StatusCode::CONFLICT, "NotStarted", message)
    }

    /// 409 `WorkerGone`: the worker the Run was assigned to no longer exists.
    pub fn worker_gone(message: impl Into<String>) -> HttpError {
        HttpError::new(StatusCode::CONFLICT, "WorkerGone", message)
    }

    /// 409 `Conflict`: the request conflicts with the Run's state.
    pub fn conflict(message: impl Into<String>) -> HttpError {
        HttpError::new(StatusCode::CONFLICT, "Conflict", message)
    }

    pub fn payload_too_large(limit: usize) -> HttpError {
        HttpError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "RequestEntityTooLarge",
            format!("the request body is larger than the limit of {limit} bytes"),
        )
    }

    /// 408: the client did not send its request's body within `timeout`.
    pub fn request_timeout(timeout: std::time::Duration) -> HttpError {
        HttpError::new(
            StatusCode::REQUEST_TIMEOUT,
            "RequestTimeout",
            format!(
                "the request body did not arrive within {} ms",
                timeout.as_millis()
            ),
        )
    }

    pub fn too_many_requests(limit: usize) -> HttpError {
        HttpError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "TooManyRequests",
            format!("the gateway is serving its limit of {limit} concurrent requests; retry later"),
        )
    }

    pub fn bad_gateway(message: impl Into<String>) -> HttpError {
        HttpError::new(StatusCode::BAD_GATEWAY, "BadGateway", message)
    }

    pub fn unavailable(message: impl Into<String>) -> HttpError {
        HttpError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            message,
        )
    }

    pub fn internal(message: impl Into<String>) -> HttpError {
        HttpError::new(StatusCode::INTERNAL_SERVER_ERROR, "InternalError", message)
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub fn reason(&self) -> &str {
        &self.reason
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same error with every occurrence of `token` in the message replaced by
    /// `[token]`. A no-op for an empty token.
    pub fn scrubbed(mut self, token: &str) -> HttpError {
        if !token.is_empty() && self.message.contains(token) {
            self.message = bound(self.message.replace(token, "[token]"));
        }
        self
    }

    /// The JSON body.
    pub fn body(&self) -> String {
        serde_json::json!({
            "code": self.status.as_u16(),
            "reason": self.reason,
            "message": self.message,
        })
        .to_string()
    }
}

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.reason,
            self.message
        )
    }
}

impl std::error::Error for HttpError {}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            self.body(),
        )
            .into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"kruntimes\""),
            );
        }
        if self.status == StatusCode::SERVICE_UNAVAILABLE
            && matches!(self.reason.as_ref(), "NotReady" | "SessionWaking")
        {
            // A Run that is not ready yet (registering, resuming) or a session being woken:
            // the call was not sent to any worker, and may be sent again after a second.
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECONDS),
            );
        }
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            // Every 429 here is momentary (the concurrency limit, a function busy with one
            // invocation, a full session queue): a client may try again after a second.
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECONDS),
            );
        }
        response
    }
}

impl From<AuthzError> for HttpError {
    fn from(error: AuthzError) -> HttpError {
        match error {
            AuthzError::Unauthenticated => HttpError::unauthorized(error.to_string()),
            AuthzError::Forbidden { reason } => HttpError::forbidden(reason),
            // The review error says which review failed and why; it never carries the token.
            AuthzError::Unavailable(review) => {
                HttpError::unavailable(format!("authorization is unavailable: {review}"))
            }
        }
    }
}

/// Cuts `text` to at most [`MAX_ERROR_MESSAGE_BYTES`] on a character boundary, marking the cut.
fn bound(mut text: String) -> String {
    if text.len() <= MAX_ERROR_MESSAGE_BYTES {
        return text;
    }
    const MARK: &str = "…";
    let mut end = MAX_ERROR_MESSAGE_BYTES - MARK.len();
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text.push_str(MARK);
    text
}

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The listening socket could not be bound.
    #[error("failed to listen on {addr}")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// The configuration cannot work (for example a concurrency limit of zero).
    #[error("invalid gateway configuration: {0}")]
    Config(String),
    /// The metrics registry could not be set up.
    #[error("failed to set up metrics")]
    Metrics(#[source] std::fmt::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_429_says_when_to_try_again_and_other_answers_do_not() {
        let busy = HttpError::too_many_requests(128).into_response();
        assert_eq!(busy.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            busy.headers().get(header::RETRY_AFTER),
            Some(&HeaderValue::from_static("1"))
        );
        let other = HttpError::new(StatusCode::CONFLICT, "Conflict", "x").into_response();
        assert!(other.headers().get(header::RETRY_AFTER).is_none());
    }

    #[test]
    fn messages_are_bounded_on_character_boundaries() {
        let long = "é".repeat(MAX_ERROR_MESSAGE_BYTES);
        let error = HttpError::bad_request(long);
        assert!(error.message().len() <= MAX_ERROR_MESSAGE_BYTES);
        assert!(error.message().ends_with('…'));
        let short = HttpError::not_found("no such Run");
        assert_eq!(short.message(), "no such Run");
    }

    #[test]
    fn bodies_are_json_with_the_status_code() {
        let body: serde_json::Value =
            serde_json::from_str(&HttpError::not_started("not yet").body()).unwrap_or_default();
        assert_eq!(
            body,
            serde_json::json!({"code": 409, "reason": "NotStarted", "message": "not yet"})
        );
    }

    #[test]
    fn scrubbing_removes_the_token() {
        let error =
            HttpError::bad_gateway("worker said: bad token s3cr3t-token").scrubbed("s3cr3t-token");
        assert_eq!(error.message(), "worker said: bad token [token]");
        let unchanged = HttpError::bad_gateway("nothing here").scrubbed("");
        assert_eq!(unchanged.message(), "nothing here");
    }

    #[test]
    fn authorization_errors_map_to_their_statuses() {
        assert_eq!(
            HttpError::from(AuthzError::Unauthenticated).status(),
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            HttpError::from(AuthzError::Forbidden {
                reason: "no".into()
            })
            .status(),
            StatusCode::FORBIDDEN
        );
        let unavailable = AuthzError::Unavailable(crate::authz::ReviewError {
            review: crate::authz::ReviewKind::TokenReview,
            detail: "connection refused".into(),
        });
        let error = HttpError::from(unavailable);
        assert_eq!(error.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(error.message().contains("connection refused"), "{error}");
    }
}
