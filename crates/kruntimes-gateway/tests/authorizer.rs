//! The authorizer against a real `kruntimes up`, started through the testkit: a
//! ServiceAccount token bound by a Role to `get` Runs in one namespace, reviewed with the
//! real TokenReview and SubjectAccessReview APIs.
//!
//! It checks that a success is cached and served again, that denials, unknown tokens and
//! errors are never cached, that an evicted success is reviewed again, and that no log line
//! the test captures (every crate, every level) carries the raw token.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, anyhow, bail, ensure};
use kruntimes_api::{Run, RunSpec};
use kruntimes_gateway::authz::{ReviewKind, token_expiry};
use kruntimes_gateway::{Authorizer, AuthorizerConfig, AuthzError, AuthzStats, Principal};
use kruntimes_testkit::{Server, setup};
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};

/// The longest the test may take, server start excluded.
const TEST_DEADLINE: Duration = Duration::from_secs(240);
const NS: &str = "team-a";
const OTHER_NS: &str = "team-b";
const SA: &str = "agent";

// ---------------------------------------------------------------------------------------
// Log capture
// ---------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------
// Setup, as admin, with kube-rs
// ---------------------------------------------------------------------------------------

fn run_object(name: &str) -> Run {
    Run::new(name, RunSpec::task("python", "main.py"))
}

/// Creates `run` in `namespace` and returns its UID.
async fn create_run(admin: &Client, namespace: &str, name: &str) -> Result<String> {
    let run = Api::<Run>::namespaced(admin.clone(), namespace)
        .create(&PostParams::default(), &run_object(name))
        .await
        .with_context(|| format!("create Run {namespace}/{name}"))?;
    run.uid().context("a created Run has a UID")
}

/// Namespaces, the ServiceAccount, a Role that may `get` Runs in [`NS`] and its binding;
/// returns a fresh ten-minute token of the ServiceAccount.
async fn setup_identity(admin: &Client) -> Result<String> {
    for ns in [NS, OTHER_NS] {
        setup::namespace(admin, ns).await?;
    }
    let rule = setup::kruntimes_rule(&["get"], &["runs"]);
    setup::service_account_token(admin, NS, SA, vec![rule], 600).await
}

// ---------------------------------------------------------------------------------------
// The test
// ---------------------------------------------------------------------------------------

fn expect_forbidden(outcome: Result<Principal, AuthzError>, what: &str) -> Result<String> {
    match outcome {
        Err(AuthzError::Forbidden { reason }) => Ok(reason),
        Err(other) => bail!("{what}: expected Forbidden, got {other:?}"),
        Ok(principal) => bail!("{what}: expected Forbidden, got allowed for {principal:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authorizer_against_the_real_api_server() -> Result<()> {
    common::captured_logs();
    let mut server = tokio::task::spawn_blocking(Server::start)
        .await
        .context("join the server start")??;
    let admin = server.client().await?;
    let token = tokio::time::timeout(TEST_DEADLINE, scenario(&mut server, &admin))
        .await
        .map_err(|_| anyhow!("the test did not finish within {TEST_DEADLINE:?}"))??;
    common::assert_token_never_logged(&token)
}

/// Runs every check and returns the token it used, for the log check.
async fn scenario(server: &mut Server, admin: &Client) -> Result<String> {
    let token = setup_identity(admin).await?;
    let run_1 = create_run(admin, NS, "run-1").await?;
    let run_2 = create_run(admin, NS, "run-2").await?;
    let foreign = create_run(admin, OTHER_NS, "other-run").await?;

    // A JWT-shaped token's exp only shortens caching; if the server says it, it must agree
    // with the ten minutes we asked for.
    if let Some(expiry) = token_expiry(&token) {
        let left = expiry
            .duration_since(SystemTime::now())
            .unwrap_or_default()
            .as_secs();
        ensure!(
            (540..=660).contains(&left),
            "token exp is {left}s away, not ~600s"
        );
    }

    let authz = Authorizer::new(admin.clone(), AuthorizerConfig::default());

    // Allowed, reviewed once, then served from the cache.
    let principal = authz
        .authorize(&token, NS, "run-1", &run_1)
        .await
        .context("the bound ServiceAccount may get its Run")?;
    ensure!(
        principal.username == format!("system:serviceaccount:{NS}:{SA}"),
        "unexpected user {principal:?}"
    );
    let groups: BTreeSet<&str> = principal.groups.iter().map(String::as_str).collect();
    for group in [
        "system:serviceaccounts",
        "system:serviceaccounts:team-a",
        "system:authenticated",
    ] {
        ensure!(groups.contains(group), "{group} missing from {groups:?}");
    }
    let expected = AuthzStats {
        hits: 0,
        misses: 1,
        coalesced: 0,
        entries: 1,
    };
    ensure!(
        authz.stats() == expected,
        "after the first call: {:?}",
        authz.stats()
    );
    let again = authz.authorize(&token, NS, "run-1", &run_1).await?;
    ensure!(again == principal, "the cached answer differs: {again:?}");
    let expected = AuthzStats {
        hits: 1,
        misses: 1,
        coalesced: 0,
        entries: 1,
    };
    ensure!(
        authz.stats() == expected,
        "the second call must hit: {:?}",
        authz.stats()
    );

    // Another namespace's Run: Forbidden, and not cached.
    for round in 1..=2 {
        let reason = expect_forbidden(
            authz
                .authorize(&token, OTHER_NS, "other-run", &foreign)
                .await,
            "a Run in another namespace",
        )?;
        ensure!(
            reason.contains("other-run") && reason.contains(OTHER_NS),
            "the refusal does not say what was refused: {reason}"
        );
        ensure!(!reason.contains(&token), "the refusal carries the token");
        let stats = authz.stats();
        ensure!(
            stats.misses == 1 + round && stats.hits == 1 && stats.entries == 1,
            "a denial must not be cached (round {round}): {stats:?}"
        );
    }

    // An unknown token: Unauthenticated, and not cached.
    let unknown = "kruntimes-test-unknown-token-0123456789abcdef";
    for round in 1..=2 {
        match authz.authorize(unknown, NS, "run-1", &run_1).await {
            Err(AuthzError::Unauthenticated) => {}
            other => bail!("an unknown token must be Unauthenticated, got {other:?}"),
        }
        let stats = authz.stats();
        ensure!(
            stats.misses == 3 + round && stats.entries == 1,
            "an unknown token must not be cached (round {round}): {stats:?}"
        );
    }

    // A success evicted by capacity is reviewed again.
    let small = Authorizer::new(
        admin.clone(),
        AuthorizerConfig {
            capacity: 1,
            ..AuthorizerConfig::default()
        },
    );
    small.authorize(&token, NS, "run-1", &run_1).await?;
    small.authorize(&token, NS, "run-2", &run_2).await?;
    ensure!(
        small.stats()
            == AuthzStats {
                hits: 0,
                misses: 2,
                coalesced: 0,
                entries: 1
            },
        "{:?}",
        small.stats()
    );
    small.authorize(&token, NS, "run-1", &run_1).await?;
    ensure!(
        small.stats().hits == 0 && small.stats().misses == 3,
        "an evicted success was served from the cache: {:?}",
        small.stats()
    );
    small.authorize(&token, NS, "run-1", &run_1).await?;
    ensure!(small.stats().hits == 1, "{:?}", small.stats());

    // A different UID under the same name (a recreated Run) is reviewed again.
    authz.authorize(&token, NS, "run-1", "another-uid").await?;
    ensure!(authz.stats().misses == 6, "{:?}", authz.stats());

    // With the API server gone: cached successes still hold for their TTL, anything
    // else is Unavailable, and that is not cached either.
    tokio::task::block_in_place(|| server.stop()).context("stop the server")?;
    authz
        .authorize(&token, NS, "run-1", &run_1)
        .await
        .context("a cached success is served while the API server is down")?;
    for round in 1..=2 {
        match authz.authorize(&token, NS, "run-2", &run_2).await {
            Err(AuthzError::Unavailable(failure)) => {
                ensure!(
                    failure.review == ReviewKind::TokenReview,
                    "the first review fails first: {failure}"
                );
                ensure!(
                    !failure.detail.contains(&token),
                    "the error carries the token"
                );
            }
            other => bail!("with the server stopped, expected Unavailable, got {other:?}"),
        }
        ensure!(
            authz.stats().misses == 6 + round,
            "errors must not be cached (round {round}): {:?}",
            authz.stats()
        );
    }
    Ok(token)
}
