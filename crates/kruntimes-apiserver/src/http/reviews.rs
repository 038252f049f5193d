//! The review APIs (TokenReview, SubjectAccessReview, LocalSubjectAccessReview,
//! SelfSubjectAccessReview, SelfSubjectRulesReview), the ServiceAccount TokenRequest
//! subresource, and issuing AccessTokens. Reviews are answered, never stored.

use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{Value, json};

use super::handlers::{Ctx, json_response, parse_body, string_list};
use crate::auth::{self, BoundServiceAccount, Identity};
use crate::error::{ApiError, Cause};
use crate::rbac::{self, Attributes, MASTERS};
use crate::store::{Key, StoreError, Write};

/// TokenRequest lifetimes: at least 10 minutes (as on a real cluster), one hour by default,
/// at most one year.
const TOKEN_REQUEST_MIN: i64 = 600;
const TOKEN_REQUEST_DEFAULT: i64 = 3600;
const TOKEN_LIFETIME_MAX: i64 = 365 * 24 * 3600;

fn str_field(value: &Value, pointer: &str) -> String {
    value
        .pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string()
}

fn invalid(ctx: &Ctx<'_>, field: &str, message: &str) -> ApiError {
    ApiError::invalid(
        ctx.def(),
        "",
        vec![Cause {
            reason: "FieldValueInvalid".into(),
            message: message.into(),
            field: field.into(),
        }],
    )
}

fn attributes_from_spec(ctx: &Ctx<'_>, spec: &Value) -> Result<Attributes, ApiError> {
    if let Some(r) = spec.get("resourceAttributes").filter(|v| v.is_object()) {
        return Ok(Attributes::Resource {
            verb: str_field(r, "/verb"),
            group: str_field(r, "/group"),
            resource: str_field(r, "/resource"),
            subresource: str_field(r, "/subresource"),
            namespace: str_field(r, "/namespace"),
            name: str_field(r, "/name"),
        });
    }
    if let Some(n) = spec.get("nonResourceAttributes").filter(|v| v.is_object()) {
        return Ok(Attributes::NonResource {
            verb: str_field(n, "/verb"),
            path: str_field(n, "/path"),
        });
    }
    Err(invalid(
        ctx,
        "spec.resourceAttributes",
        "exactly one of nonResourceAttributes or resourceAttributes must be specified",
    ))
}

fn answer(mut body: Value, status: Value) -> Response {
    body["status"] = status;
    if body.get("metadata").is_none() {
        body["metadata"] = json!({});
    }
    json_response(StatusCode::CREATED, &body)
}

fn access_status(decision: rbac::Decision) -> Value {
    if decision.allowed {
        json!({"allowed": true, "reason": decision.reason})
    } else {
        json!({"allowed": false})
    }
}

/// POST on a review kind.
pub async fn create_review(ctx: &Ctx<'_>) -> Result<Response, ApiError> {
    let def = ctx.def();
    let mut body = parse_body(ctx).await?;
    body["apiVersion"] = json!(def.api_version());
    body["kind"] = json!(def.kind);
    let spec = body.get("spec").cloned().unwrap_or(json!({}));
    let snap = ctx.state.store.snapshot();
    match def.kind {
        "TokenReview" => {
            let token = str_field(&spec, "/token");
            let status = match ctx.state.auth.authenticate_token(&snap, &token) {
                Some(identity) => json!({
                    "authenticated": true,
                    "user": {"username": identity.username, "uid": identity.uid, "groups": identity.groups},
                    "audiences": spec.get("audiences").cloned().unwrap_or(json!([])),
                }),
                None => json!({"authenticated": false, "error": "invalid bearer token"}),
            };
            // The token itself is never echoed back.
            body["spec"] =
                json!({"audiences": spec.get("audiences").cloned().unwrap_or(json!([]))});
            Ok(answer(body, status))
        }
        "SubjectAccessReview" | "LocalSubjectAccessReview" => {
            let attrs = attributes_from_spec(ctx, &spec)?;
            if def.kind == "LocalSubjectAccessReview"
                && let Attributes::Resource { namespace, .. } = &attrs
                && Some(namespace.as_str()) != ctx.path.namespace.as_deref()
            {
                return Err(invalid(
                    ctx,
                    "spec.resourceAttributes.namespace",
                    "must match the namespace of the request",
                ));
            }
            let identity = Identity {
                username: str_field(&spec, "/user"),
                uid: str_field(&spec, "/uid"),
                groups: string_list(spec.get("groups")),
            };
            if identity.username.is_empty() && identity.groups.is_empty() {
                return Err(invalid(
                    ctx,
                    "spec.user",
                    "at least one of user or group must be specified",
                ));
            }
            Ok(answer(
                body,
                access_status(rbac::authorize(&snap, &identity, &attrs)),
            ))
        }
        "SelfSubjectAccessReview" => {
            let attrs = attributes_from_spec(ctx, &spec)?;
            Ok(answer(
                body,
                access_status(rbac::authorize(&snap, &ctx.identity, &attrs)),
            ))
        }
        "SelfSubjectRulesReview" => {
            let namespace = str_field(&spec, "/namespace");
            let mut resource_rules = Vec::new();
            let mut non_resource_rules = Vec::new();
            if ctx.identity.groups.iter().any(|g| g == MASTERS) {
                resource_rules
                    .push(json!({"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]}));
                non_resource_rules.push(json!({"verbs": ["*"], "nonResourceURLs": ["*"]}));
            }
            for (_, rule) in rbac::rules_for(&snap, &ctx.identity, &namespace) {
                if rule
                    .get("nonResourceURLs")
                    .is_some_and(|u| u.as_array().is_some_and(|a| !a.is_empty()))
                {
                    non_resource_rules.push(
                        json!({"verbs": rule["verbs"], "nonResourceURLs": rule["nonResourceURLs"]}),
                    );
                }
                if rule
                    .get("resources")
                    .is_some_and(|u| u.as_array().is_some_and(|a| !a.is_empty()))
                {
                    let mut r = json!({"verbs": rule["verbs"], "apiGroups": rule["apiGroups"], "resources": rule["resources"]});
                    if let Some(names) = rule.get("resourceNames") {
                        r["resourceNames"] = names.clone();
                    }
                    resource_rules.push(r);
                }
            }
            Ok(answer(
                body,
                json!({"resourceRules": resource_rules, "nonResourceRules": non_resource_rules, "incomplete": false}),
            ))
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

async fn store_token(ctx: &Ctx<'_>, issued: &auth::IssuedToken) -> Result<(), ApiError> {
    if ctx.query.get("dryRun").is_some_and(|v| v == "All") {
        return Ok(());
    }
    let mut object = issued.object.clone();
    super::handlers::stamp_new(&mut object);
    let key = Key {
        resource: Arc::from(auth::ACCESS_TOKENS),
        namespace: String::new(),
        name: issued.name.clone(),
    };
    match ctx.state.store.write(Write::Create { key, object }).await {
        Ok(_) => Ok(()),
        Err(StoreError::Closed) => Err(ApiError::unavailable("the server is shutting down")),
        Err(e) => Err(ApiError::internal("failed to store a token", &e)),
    }
}

/// POST `serviceaccounts/{name}/token`: issues a token bound to the ServiceAccount.
pub async fn token_request(ctx: &Ctx<'_>, name: &str) -> Result<Response, ApiError> {
    let mut body = parse_body(ctx).await?;
    let namespace = ctx.path.namespace.clone().unwrap_or_default();
    let snap = ctx.state.store.snapshot();
    let key = Key {
        resource: Arc::from("serviceaccounts"),
        namespace: namespace.clone(),
        name: name.to_string(),
    };
    let sa = snap
        .objects
        .get(&key)
        .ok_or_else(|| ApiError::not_found(ctx.def(), name))?;
    let uid = str_field(&sa.object, "/metadata/uid");
    let seconds = body
        .pointer("/spec/expirationSeconds")
        .and_then(Value::as_i64)
        .unwrap_or(TOKEN_REQUEST_DEFAULT);
    if !(TOKEN_REQUEST_MIN..=TOKEN_LIFETIME_MAX).contains(&seconds) {
        return Err(ApiError::invalid(
            ctx.def(),
            name,
            vec![Cause {
                reason: "FieldValueInvalid".into(),
                message: format!(
                    "may not specify a duration less than {TOKEN_REQUEST_MIN} seconds or longer than {TOKEN_LIFETIME_MAX} seconds"
                ),
                field: "spec.expirationSeconds".into(),
            }],
        ));
    }
    let identity = auth::service_account_identity(&namespace, name, &uid);
    let issued = auth::issue(
        &identity,
        Some(BoundServiceAccount {
            namespace: namespace.clone(),
            name: name.to_string(),
            uid,
        }),
        Some(chrono::Duration::seconds(seconds)),
    );
    store_token(ctx, &issued).await?;
    let expires = issued
        .expires
        .map(|e| e.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .unwrap_or_default();
    body["apiVersion"] = json!("authentication.k8s.io/v1");
    body["kind"] = json!("TokenRequest");
    body["metadata"] = json!({"name": name, "namespace": namespace, "creationTimestamp": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)});
    body["spec"] = json!({"audiences": ["https://kruntimes.local"], "expirationSeconds": seconds});
    body["status"] = json!({"token": issued.token, "expirationTimestamp": expires});
    Ok(json_response(StatusCode::CREATED, &body))
}

/// POST `accesstokens`: issues a token for a user. The raw token is in `status.token` of
/// this response only.
pub async fn create_access_token(ctx: &Ctx<'_>) -> Result<Response, ApiError> {
    let body = parse_body(ctx).await?;
    let username = str_field(&body, "/spec/user/username");
    if username.is_empty() || username.len() > 256 {
        return Err(invalid(
            ctx,
            "spec.user.username",
            "Required value: 1 to 256 characters",
        ));
    }
    if username.starts_with("system:") {
        return Err(invalid(
            ctx,
            "spec.user.username",
            "names starting with system: are reserved",
        ));
    }
    let mut groups = string_list(body.pointer("/spec/user/groups"));
    // Issuing a token for someone is acting as them: beyond one's own name and groups it
    // takes the `impersonate` verb on that user and each group, as `kubectl --as` does.
    let own =
        username == ctx.identity.username && groups.iter().all(|g| ctx.identity.groups.contains(g));
    if !own {
        let snap = ctx.state.store.snapshot();
        let targets = std::iter::once(("users", username.clone()))
            .chain(groups.iter().map(|g| ("groups", g.clone())));
        for (resource, name) in targets {
            let attrs = Attributes::Resource {
                verb: "impersonate".into(),
                group: String::new(),
                resource: resource.into(),
                subresource: String::new(),
                namespace: String::new(),
                name: name.clone(),
            };
            if !rbac::authorize(&snap, &ctx.identity, &attrs).allowed {
                return Err(ApiError::forbidden(format!(
                    "User \"{}\" may not issue a token as {resource} \"{name}\": that takes the impersonate verb on it",
                    ctx.identity.username
                )));
            }
        }
    }
    if !groups.iter().any(|g| g == "system:authenticated") {
        groups.push("system:authenticated".into());
    }
    let lifetime = match body
        .pointer("/spec/expirationSeconds")
        .and_then(Value::as_i64)
    {
        None => None,
        Some(s) if (1..=TOKEN_LIFETIME_MAX).contains(&s) => Some(chrono::Duration::seconds(s)),
        Some(_) => {
            return Err(invalid(
                ctx,
                "spec.expirationSeconds",
                &format!("must be between 1 and {TOKEN_LIFETIME_MAX}"),
            ));
        }
    };
    let identity = Identity {
        username,
        uid: uuid::Uuid::new_v4().to_string(),
        groups,
    };
    let issued = auth::issue(&identity, None, lifetime);
    store_token(ctx, &issued).await?;
    let stored = ctx
        .state
        .store
        .snapshot()
        .objects
        .get(&Key {
            resource: Arc::from(auth::ACCESS_TOKENS),
            namespace: String::new(),
            name: issued.name.clone(),
        })
        .map(|s| (*s.object).clone())
        .unwrap_or(issued.object.clone());
    let mut response = stored;
    response["status"] = json!({"token": issued.token});
    Ok(json_response(StatusCode::CREATED, &response))
}
