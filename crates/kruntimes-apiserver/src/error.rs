//! API errors and their `metav1.Status` form. Every handler returns [`ApiError`]; this is
//! the one place that maps errors to HTTP status codes and reasons.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::resources::ResourceDef;

/// Messages echoed to clients are cut to this many bytes.
const MAX_MESSAGE: usize = 1024;

/// One field a 422 names.
#[derive(Debug, Clone)]
pub struct Cause {
    pub reason: String,
    pub message: String,
    pub field: String,
}

/// An error answered as a `metav1.Status`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: StatusCode,
    pub reason: &'static str,
    pub message: String,
    pub details: Option<Value>,
    /// Answer with `Connection: close` (the request's body was not read to its end).
    pub close_connection: bool,
}

impl ApiError {
    pub fn new(code: StatusCode, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: bounded(message.into()),
            details: None,
            close_connection: false,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "BadRequest", message)
    }

    pub fn unauthorized() -> Self {
        ApiError::new(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized")
    }

    pub fn not_found(def: &ResourceDef, name: &str) -> Self {
        let mut e = ApiError::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("{} \"{}\" not found", def.qualified(), name),
        );
        e.details = Some(json!({"name": name, "group": def.group, "kind": def.plural}));
        e
    }

    pub fn path_not_found() -> Self {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the server could not find the requested resource",
        )
    }

    pub fn namespace_not_found(namespace: &str) -> Self {
        let mut e = ApiError::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("namespaces \"{namespace}\" not found"),
        );
        e.details = Some(json!({"name": namespace, "kind": "namespaces"}));
        e
    }

    pub fn already_exists(def: &ResourceDef, name: &str) -> Self {
        let mut e = ApiError::new(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("{} \"{}\" already exists", def.qualified(), name),
        );
        e.details = Some(json!({"name": name, "group": def.group, "kind": def.plural}));
        e
    }

    pub fn conflict(def: &ResourceDef, name: &str) -> Self {
        let mut e = ApiError::new(
            StatusCode::CONFLICT,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{}\": the object has been modified; please apply your changes to the latest version and try again",
                def.qualified(),
                name
            ),
        );
        e.details = Some(json!({"name": name, "group": def.group, "kind": def.plural}));
        e
    }

    pub fn precondition(def: &ResourceDef, name: &str, what: &str) -> Self {
        let mut e = ApiError::new(
            StatusCode::CONFLICT,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{}\": {}",
                def.qualified(),
                name,
                what
            ),
        );
        e.details = Some(json!({"name": name, "group": def.group, "kind": def.plural}));
        e
    }

    pub fn invalid(def: &ResourceDef, name: &str, causes: Vec<Cause>) -> Self {
        let summary: Vec<String> = causes
            .iter()
            .map(|c| format!("{}: {}", c.field, c.message))
            .collect();
        let summary = if summary.len() == 1 {
            summary.join("")
        } else {
            format!("[{}]", summary.join(", "))
        };
        let group_kind = if def.group.is_empty() {
            def.kind.to_string()
        } else {
            format!("{}.{}", def.kind, def.group)
        };
        let mut e = ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            format!("{group_kind} \"{name}\" is invalid: {summary}"),
        );
        let causes: Vec<Value> = causes
            .into_iter()
            .map(|c| json!({"reason": c.reason, "message": bounded(c.message), "field": c.field}))
            .collect();
        e.details =
            Some(json!({"name": name, "group": def.group, "kind": def.kind, "causes": causes}));
        e
    }

    pub fn expired(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::GONE, "Expired", message)
    }

    pub fn forbidden(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::FORBIDDEN, "Forbidden", message)
    }

    pub fn method_not_allowed() -> Self {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )
    }

    pub fn unsupported_media_type(content_type: &str) -> Self {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json, application/merge-patch+json, application/json-patch+json, application/strategic-merge-patch+json, application/apply-patch+yaml (got {content_type:?})"
            ),
        )
    }

    /// A create or update body in a media type the server does not decode.
    pub fn unsupported_body_type(content_type: &str) -> Self {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json, application/yaml, application/vnd.kubernetes.protobuf (got {content_type:?})"
            ),
        )
    }

    /// A `dryRun` value other than `All`.
    pub fn invalid_dry_run(value: &str) -> Self {
        ApiError::bad_request(format!(
            "Invalid dryRun value: {value:?}: supported values: \"All\""
        ))
    }

    pub fn too_large(limit: usize) -> Self {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "RequestEntityTooLarge",
            format!("the request body is larger than {limit} bytes"),
        )
    }

    /// An internal failure: logged with its chain, answered as a generic 500.
    pub fn internal(context: &str, error: &dyn std::fmt::Display) -> Self {
        tracing::error!(error = %error, "{context}");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "an internal error occurred; see the server log",
        )
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            message,
        )
    }

    /// The `metav1.Status` body.
    pub fn status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code.as_u16(),
        });
        if let Some(details) = &self.details {
            status["details"] = details.clone();
        }
        status
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.status().to_string();
        let mut response = (
            self.code,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response();
        if self.close_connection {
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        response
    }
}

fn bounded(mut message: String) -> String {
    if message.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
        message.push('…');
    }
    message
}
