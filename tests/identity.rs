//! Identity and access (issue 3), end to end against a real `kruntimes up`: RBAC objects and
//! tokens made with the real `kubectl` (protobuf bodies) and `krt`, a `kubectl auth can-i`
//! table for several subjects and the component identities, cross-namespace refusals,
//! expiry and revocation of tokens, and the review APIs through kube-rs.
//!
//! Each test starts its own server. To act as another identity, a test writes a copy of the
//! admin kubeconfig holding that identity's token and passes it with `--kubeconfig` (kubectl)
//! or builds a kube client from it. Children are killed when they outlive their deadline or
//! the test. Nothing sleeps to synchronise; the one timed loop polls a token until it
//! expires, because the time it takes is what that test measures.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::authentication::v1::{
    TokenRequest, TokenRequestSpec, TokenReview, TokenReviewSpec,
};
use k8s_openapi::api::authorization::v1::{
    LocalSubjectAccessReview, ResourceAttributes, SelfSubjectAccessReview,
    SelfSubjectAccessReviewSpec, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kruntimes_api::{Run, RunSpec};
use kruntimes_testkit::Server;
use kruntimes_testkit::status::{ensure_status, expect_status};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
    WatchParams,
};
use kube::core::{GroupVersionKind, Status};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

/// The longest one test may take, server start excluded.
const TEST_DEADLINE: Duration = Duration::from_secs(240);
/// The longest any single kubectl or krt invocation may take.
const CHILD_DEADLINE: Duration = Duration::from_secs(90);
/// How soon an expired or revoked token must be refused (issue 3, "Acceptance").
const REFUSAL_BOUND: Duration = Duration::from_secs(1);
/// The interval of the expiry poll (the only timed loop here).
const EXPIRY_POLL: Duration = Duration::from_millis(50);

const TEAM_A: &str = "team-a";
const TEAM_B: &str = "team-b";
/// The ServiceAccount in `team-a` that may read Runs there and nowhere else.
const AGENT: &str = "agent";
const AGENT_USER: &str = "system:serviceaccount:team-a:agent";
/// The group bound cluster-wide to write `runs/status`, and to `edit` in `team-b`.
const DEVS: &str = "devs";
const RUNS: &str = "runs.kruntimes.io";

// ---------------------------------------------------------------------------------------
// Support
// ---------------------------------------------------------------------------------------

/// Starts `kruntimes up` (blocking, so off the async workers) and returns it with an admin
/// client.
async fn start_server() -> Result<(Server, Client)> {
    Server::start_async(Default::default()).await
}

/// Runs a test body under [`TEST_DEADLINE`].
async fn within<T>(what: &str, body: impl Future<Output = Result<T>>) -> Result<T> {
    kruntimes_testkit::within(TEST_DEADLINE, what, body).await
}

/// Runs a child to completion; it is killed if it outlives [`CHILD_DEADLINE`] or the test.
async fn run_child(cmd: std::process::Command, what: &str) -> Result<Output> {
    let mut cmd = tokio::process::Command::from(cmd);
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = cmd.spawn().with_context(|| format!("spawn {what}"))?;
    tokio::time::timeout(CHILD_DEADLINE, child.wait_with_output())
        .await
        .with_context(|| format!("{what} did not exit within {CHILD_DEADLINE:?}"))?
        .with_context(|| format!("wait for {what}"))
}

/// The real kubectl as the admin, or as the identity of `kubeconfig` when set.
async fn kubectl(server: &Server, kubeconfig: Option<&Path>, args: &[&str]) -> Result<Output> {
    let mut cmd = server.kubectl();
    if let Some(path) = kubeconfig {
        cmd.arg("--kubeconfig").arg(path);
    }
    cmd.args(args);
    run_child(cmd, &format!("kubectl {}", args.join(" "))).await
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs kubectl and returns its stdout, failing with stdout and stderr when it exits
/// non-zero.
async fn kubectl_ok(server: &Server, kubeconfig: Option<&Path>, args: &[&str]) -> Result<String> {
    let out = kubectl(server, kubeconfig, args).await?;
    ensure!(
        out.status.success(),
        "kubectl {} failed ({}):\nstdout: {}\nstderr: {}",
        args.join(" "),
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    Ok(text(&out.stdout))
}

/// Runs kubectl, expects it to fail, and returns its stderr.
async fn kubectl_err(server: &Server, kubeconfig: Option<&Path>, args: &[&str]) -> Result<String> {
    let out = kubectl(server, kubeconfig, args).await?;
    ensure!(
        !out.status.success(),
        "kubectl {} should have failed but succeeded:\nstdout: {}",
        args.join(" "),
        text(&out.stdout)
    );
    Ok(text(&out.stderr))
}

/// Runs `krt` as the admin and returns its stdout, failing when it exits non-zero.
async fn krt_ok(server: &Server, args: &[&str]) -> Result<String> {
    let mut cmd = server.krt()?;
    cmd.args(args);
    let out = run_child(cmd, &format!("krt {}", args.join(" "))).await?;
    ensure!(
        out.status.success(),
        "krt {} failed ({}):\nstdout: {}\nstderr: {}",
        args.join(" "),
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    Ok(text(&out.stdout))
}

/// A kube client from a kubeconfig file.
async fn client_from(kubeconfig: &Path) -> Result<Client> {
    let text = std::fs::read_to_string(kubeconfig)
        .with_context(|| format!("read {}", kubeconfig.display()))?;
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&text)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    Ok(Client::try_from(config)?)
}

/// A bearer token and a kubeconfig that presents it: the admin kubeconfig (same server, same
/// CA) with the token replaced.
struct Bearer {
    token: String,
    kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

impl Bearer {
    fn new(server: &Server, token: &str) -> Result<Bearer> {
        ensure!(!token.trim().is_empty(), "empty token");
        let admin = std::fs::read_to_string(server.kubeconfig_path())?;
        let mut config: serde_yaml::Value = serde_yaml::from_str(&admin)?;
        let user = config
            .get_mut("users")
            .and_then(|u| u.get_mut(0))
            .and_then(|u| u.get_mut("user"))
            .and_then(serde_yaml::Value::as_mapping_mut)
            .context("the admin kubeconfig has no users[0].user")?;
        user.insert("token".into(), token.into());
        let dir = tempfile::Builder::new()
            .prefix("kruntimes-identity")
            .tempdir()?;
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(&kubeconfig, serde_yaml::to_string(&config)?)?;
        Ok(Bearer {
            token: token.to_string(),
            kubeconfig,
            _dir: dir,
        })
    }

    fn path(&self) -> Option<&Path> {
        Some(&self.kubeconfig)
    }

    async fn client(&self) -> Result<Client> {
        client_from(&self.kubeconfig).await
    }
}

fn access_tokens(client: Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("auth.kruntimes.io", "v1alpha1", "AccessToken");
    Api::all_with(
        client,
        &ApiResource::from_gvk_with_plural(&gvk, "accesstokens"),
    )
}

/// An issued user token: the AccessToken's name and the raw token.
struct UserToken {
    name: String,
    token: String,
}

/// Issues a user token through `POST accesstokens`.
async fn issue_user_token(
    client: &Client,
    user: &str,
    groups: &[&str],
    expiration_seconds: Option<i64>,
) -> Result<UserToken> {
    let mut spec = json!({"user": {"username": user, "groups": groups}});
    if let Some(seconds) = expiration_seconds {
        spec["expirationSeconds"] = json!(seconds);
    }
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "auth.kruntimes.io/v1alpha1",
        "kind": "AccessToken",
        "metadata": {},
        "spec": spec,
    }))?;
    let created = access_tokens(client.clone())
        .create(&PostParams::default(), &object)
        .await
        .with_context(|| format!("issue a token for {user}"))?;
    let token = created.data["status"]["token"]
        .as_str()
        .with_context(|| format!("the AccessToken for {user} has no status.token"))?
        .to_string();
    Ok(UserToken {
        name: created.name_any(),
        token,
    })
}

/// The user name each AccessToken stands for, by object name.
async fn access_token_users(client: &Client) -> Result<Vec<(String, String, Value)>> {
    let list = access_tokens(client.clone())
        .list(&ListParams::default())
        .await
        .context("list accesstokens")?;
    Ok(list
        .into_iter()
        .map(|t| {
            let user = t.data["spec"]["user"]["username"]
                .as_str()
                .unwrap_or("")
                .to_string();
            (t.name_any(), user, t.data["spec"].clone())
        })
        .collect())
}

fn parse_time(text: &str) -> Result<SystemTime> {
    let ts: k8s_openapi::jiff::Timestamp = text
        .parse()
        .with_context(|| format!("not an RFC 3339 time: {text:?}"))?;
    Ok(SystemTime::from(ts))
}

fn task_run(name: &str) -> Run {
    Run::new(name, RunSpec::task("python", "main.py"))
}

async fn create_run(client: &Client, namespace: &str, name: &str) -> Result<()> {
    Api::<Run>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &task_run(name))
        .await
        .with_context(|| format!("create Run {namespace}/{name}"))?;
    Ok(())
}

/// Checks a 403 and that its message says who was refused what, where.
fn ensure_forbidden(
    what: &str,
    status: &Status,
    user: &str,
    verb: &str,
    scope: &str,
) -> Result<()> {
    ensure_status(what, status, 403, "Forbidden")?;
    for part in [
        format!("User \"{user}\""),
        format!("cannot {verb}"),
        "resource \"runs\"".to_string(),
        "API group \"kruntimes.io\"".to_string(),
        scope.to_string(),
    ] {
        ensure!(
            status.message.contains(&part),
            "{what}: the 403 message does not say {part:?}: {:?}",
            status.message
        );
    }
    Ok(())
}

/// The policy most tests share, made with kubectl (protobuf bodies):
/// - `agent` in `team-a` may get and list Runs in `team-a` (Role + RoleBinding), and update
///   or delete only the Run named `r1` there (a Role with resourceNames);
/// - group `devs` may get and patch `runs/status` everywhere (ClusterRole +
///   ClusterRoleBinding) and has `edit` in `team-b` (RoleBinding to a ClusterRole);
/// - user `viewer-of-default` has `view` in `default`.
async fn make_policy(server: &Server) -> Result<()> {
    let steps: &[(&[&str], &str)] = &[
        (&["create", "namespace", TEAM_A], "namespace/team-a created"),
        (&["create", "namespace", TEAM_B], "namespace/team-b created"),
        (
            &["create", "serviceaccount", AGENT, "-n", TEAM_A],
            "serviceaccount/agent created",
        ),
        (
            &[
                "create",
                "role",
                "run-reader",
                "--verb=get,list",
                "--resource=runs.kruntimes.io",
                "-n",
                TEAM_A,
            ],
            "role.rbac.authorization.k8s.io/run-reader created",
        ),
        (
            &[
                "create",
                "rolebinding",
                "agent-reads-runs",
                "--role=run-reader",
                "--serviceaccount=team-a:agent",
                "-n",
                TEAM_A,
            ],
            "rolebinding.rbac.authorization.k8s.io/agent-reads-runs created",
        ),
        (
            &[
                "create",
                "role",
                "r1-editor",
                "--verb=update,delete",
                "--resource=runs.kruntimes.io",
                "--resource-name=r1",
                "-n",
                TEAM_A,
            ],
            "role.rbac.authorization.k8s.io/r1-editor created",
        ),
        (
            &[
                "create",
                "rolebinding",
                "agent-edits-r1",
                "--role=r1-editor",
                "--serviceaccount=team-a:agent",
                "-n",
                TEAM_A,
            ],
            "rolebinding.rbac.authorization.k8s.io/agent-edits-r1 created",
        ),
        (
            &[
                "create",
                "clusterrole",
                "run-status-writer",
                "--verb=get,patch",
                "--resource=runs.kruntimes.io/status",
            ],
            "clusterrole.rbac.authorization.k8s.io/run-status-writer created",
        ),
        (
            &[
                "create",
                "clusterrolebinding",
                "devs-write-run-status",
                "--clusterrole=run-status-writer",
                "--group=devs",
            ],
            "clusterrolebinding.rbac.authorization.k8s.io/devs-write-run-status created",
        ),
        (
            &[
                "create",
                "rolebinding",
                "devs-edit",
                "--clusterrole=edit",
                "--group=devs",
                "-n",
                TEAM_B,
            ],
            "rolebinding.rbac.authorization.k8s.io/devs-edit created",
        ),
        (
            &[
                "create",
                "rolebinding",
                "viewer-of-default",
                "--clusterrole=view",
                "--user=viewer-of-default",
                "-n",
                "default",
            ],
            "rolebinding.rbac.authorization.k8s.io/viewer-of-default created",
        ),
    ];
    for (args, want) in steps {
        let out = kubectl_ok(server, None, args).await?;
        ensure!(
            out.trim() == *want,
            "kubectl {}: expected {want:?}, got {out:?}",
            args.join(" ")
        );
    }
    Ok(())
}

/// `kubectl create token` for `agent`, with a kubeconfig that presents it.
async fn agent_token(server: &Server) -> Result<Bearer> {
    let token = kubectl_ok(
        server,
        None,
        &["create", "token", AGENT, "-n", TEAM_A, "--duration", "10m"],
    )
    .await?;
    Bearer::new(server, token.trim())
}

async fn token_review(client: &Client, token: &str) -> Result<TokenReview> {
    let review = TokenReview {
        spec: TokenReviewSpec {
            token: Some(token.to_string()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<TokenReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .context("create a TokenReview")
}

/// The authenticated user of a TokenReview, or `None` when the token was refused.
async fn reviewed_user(
    client: &Client,
    token: &str,
) -> Result<Option<(String, String, Vec<String>)>> {
    let review = token_review(client, token).await?;
    let status = review.status.context("the TokenReview has no status")?;
    if status.authenticated != Some(true) {
        return Ok(None);
    }
    let user = status
        .user
        .context("an authenticated TokenReview has no user")?;
    Ok(Some((
        user.username.unwrap_or_default(),
        user.uid.unwrap_or_default(),
        user.groups.unwrap_or_default(),
    )))
}

fn run_attributes(
    verb: &str,
    namespace: &str,
    subresource: &str,
    name: &str,
) -> ResourceAttributes {
    ResourceAttributes {
        verb: Some(verb.to_string()),
        group: Some("kruntimes.io".to_string()),
        resource: Some("runs".to_string()),
        subresource: (!subresource.is_empty()).then(|| subresource.to_string()),
        namespace: (!namespace.is_empty()).then(|| namespace.to_string()),
        name: (!name.is_empty()).then(|| name.to_string()),
        ..Default::default()
    }
}

async fn subject_access_review(
    client: &Client,
    user: &str,
    groups: &[String],
    attributes: ResourceAttributes,
) -> Result<bool> {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.to_string()),
            groups: Some(groups.to_vec()),
            resource_attributes: Some(attributes),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .context("create a SubjectAccessReview")?;
    Ok(answer
        .status
        .context("the SubjectAccessReview has no status")?
        .allowed)
}

// ---------------------------------------------------------------------------------------
// kubectl create ... and krt token create
// ---------------------------------------------------------------------------------------

/// `kubectl create namespace|serviceaccount|role|rolebinding|clusterrole|clusterrolebinding`
/// and `create token` work as on a real cluster, and so does `krt token create` for a
/// ServiceAccount and for a user.
#[tokio::test(flavor = "multi_thread")]
async fn kubectl_and_krt_create_identities_roles_and_tokens() -> Result<()> {
    let (server, admin) = start_server().await?;
    within("create identities", async {
        make_policy(&server).await?;

        // What kubectl sent as protobuf arrived intact.
        let role = Api::<Role>::namespaced(admin.clone(), TEAM_A)
            .get("run-reader")
            .await?;
        let rules = role.rules.context("run-reader has no rules")?;
        ensure!(rules.len() == 1, "run-reader rules: {rules:?}");
        ensure!(
            rules[0].verbs == ["get", "list"]
                && rules[0].api_groups.as_deref() == Some(&["kruntimes.io".to_string()][..])
                && rules[0].resources.as_deref() == Some(&["runs".to_string()][..]),
            "run-reader rule: {:?}",
            rules[0]
        );
        let r1 = Api::<Role>::namespaced(admin.clone(), TEAM_A)
            .get("r1-editor")
            .await?;
        let r1_rules = r1.rules.context("r1-editor has no rules")?;
        ensure!(
            r1_rules[0].resource_names.as_deref() == Some(&["r1".to_string()][..]),
            "r1-editor rule: {r1_rules:?}"
        );
        let binding = Api::<RoleBinding>::namespaced(admin.clone(), TEAM_A)
            .get("agent-reads-runs")
            .await?;
        ensure!(
            binding.role_ref.kind == "Role"
                && binding.role_ref.name == "run-reader"
                && binding.role_ref.api_group == "rbac.authorization.k8s.io",
            "roleRef: {:?}",
            binding.role_ref
        );
        let subjects = binding.subjects.unwrap_or_default();
        ensure!(
            subjects.len() == 1
                && subjects[0].kind == "ServiceAccount"
                && subjects[0].name == AGENT
                && subjects[0].namespace.as_deref() == Some(TEAM_A),
            "subjects: {subjects:?}"
        );
        let cluster_role = Api::<ClusterRole>::all(admin.clone())
            .get("run-status-writer")
            .await?;
        let rules = cluster_role.rules.unwrap_or_default();
        ensure!(
            rules.len() == 1
                && rules[0].resources.as_deref() == Some(&["runs/status".to_string()][..]),
            "run-status-writer rules: {rules:?}"
        );
        let crb = Api::<ClusterRoleBinding>::all(admin.clone())
            .get("devs-write-run-status")
            .await?;
        let subjects = crb.subjects.unwrap_or_default();
        ensure!(
            subjects.len() == 1 && subjects[0].kind == "Group" && subjects[0].name == DEVS,
            "devs-write-run-status subjects: {subjects:?}"
        );
        let sa = Api::<ServiceAccount>::namespaced(admin.clone(), TEAM_A)
            .get(AGENT)
            .await?;
        let sa_uid = sa.uid().context("the ServiceAccount has no uid")?;

        // kubectl create token: prints the token alone, no trailing newline.
        let issued_from = SystemTime::now();
        let printed = kubectl_ok(
            &server,
            None,
            &["create", "token", AGENT, "-n", TEAM_A, "--duration", "10m"],
        )
        .await?;
        let issued_to = SystemTime::now();
        ensure!(
            !printed.is_empty() && printed.trim() == printed,
            "kubectl create token printed {printed:?}"
        );
        let (user, uid, groups) = reviewed_user(&admin, &printed)
            .await?
            .context("the token from kubectl create token does not authenticate")?;
        ensure!(user == AGENT_USER, "TokenReview user {user:?}");
        ensure!(
            uid == sa_uid,
            "TokenReview uid {uid:?}, ServiceAccount uid {sa_uid:?}"
        );
        for g in [
            "system:serviceaccounts",
            "system:serviceaccounts:team-a",
            "system:authenticated",
        ] {
            ensure!(groups.iter().any(|x| x == g), "groups {groups:?} lack {g}");
        }
        // The token works with kubectl: the RoleBinding lets it list Runs in team-a.
        let bearer = Bearer::new(&server, &printed)?;
        let out = kubectl_ok(&server, bearer.path(), &["get", "runs", "-n", TEAM_A]).await?;
        ensure!(
            out.is_empty(),
            "kubectl get runs as the agent printed {out:?}"
        );

        // Its AccessToken is listed with the ServiceAccount as its user and expires in 10m.
        let tokens = access_token_users(&admin).await?;
        let agent_tokens: Vec<_> = tokens.iter().filter(|(_, u, _)| u == AGENT_USER).collect();
        ensure!(agent_tokens.len() == 1, "agent tokens: {agent_tokens:?}");
        let (agent_token_name, _, spec) = agent_tokens[0];
        let expiry = parse_time(
            spec["expirationTimestamp"]
                .as_str()
                .context("the agent's AccessToken has no spec.expirationTimestamp")?,
        )?;
        let earliest = issued_from + Duration::from_secs(599);
        let latest = issued_to + Duration::from_secs(601);
        ensure!(
            expiry >= earliest && expiry <= latest,
            "a 10m token expires at {expiry:?}, not 600 s after {issued_from:?}..{issued_to:?}"
        );
        let table = kubectl_ok(&server, None, &["get", "accesstokens"]).await?;
        let header = table.lines().next().unwrap_or("");
        ensure!(header.contains("USER"), "no USER column: {table}");
        ensure!(
            table
                .lines()
                .any(|l| l.contains(agent_token_name.as_str()) && l.contains(AGENT_USER)),
            "kubectl get accesstokens does not list {agent_token_name} for {AGENT_USER}:\n{table}"
        );

        // TokenRequest under ten minutes is invalid, as on a real cluster.
        let stderr = kubectl_err(
            &server,
            None,
            &["create", "token", AGENT, "-n", TEAM_A, "--duration", "5m"],
        )
        .await?;
        ensure!(
            stderr.contains("expirationSeconds"),
            "a 5m TokenRequest was refused without naming expirationSeconds: {stderr}"
        );
        // So is one under ten minutes through kube-rs, and a user token of zero seconds.
        let short = Api::<ServiceAccount>::namespaced(admin.clone(), TEAM_A)
            .create_token_request(
                AGENT,
                &PostParams::default(),
                &TokenRequest {
                    spec: TokenRequestSpec {
                        expiration_seconds: Some(599),
                        ..Default::default()
                    },
                    ..Default::default()
                },
            )
            .await;
        ensure_status(
            "TokenRequest of 599 s",
            &expect_status("TokenRequest of 599 s", short)?,
            422,
            "Invalid",
        )?;
        let zero = issue_user_token(&admin, "alice", &[DEVS], Some(0)).await;
        let zero = zero.err().context("a zero-second AccessToken was issued")?;
        let zero = zero
            .downcast_ref::<kube::Error>()
            .context("issuing a zero-second AccessToken failed off the API")?;
        match zero {
            kube::Error::Api(status) => {
                ensure_status("AccessToken of 0 s", status, 422, "Invalid")?
            }
            other => bail!("AccessToken of 0 s: {other:#}"),
        }
        // A TokenRequest for a ServiceAccount that does not exist is a 404.
        let missing = Api::<ServiceAccount>::namespaced(admin.clone(), TEAM_A)
            .create_token_request(
                "nobody",
                &PostParams::default(),
                &TokenRequest {
                    spec: TokenRequestSpec {
                        expiration_seconds: Some(600),
                        ..Default::default()
                    },
                    ..Default::default()
                },
            )
            .await;
        ensure_status(
            "TokenRequest for a missing ServiceAccount",
            &expect_status("TokenRequest for a missing ServiceAccount", missing)?,
            404,
            "NotFound",
        )?;

        // krt token create, for the ServiceAccount and for a user.
        let sa_token = krt_ok(
            &server,
            &["token", "create", AGENT, "-n", TEAM_A, "--duration", "10m"],
        )
        .await?;
        let (user, _, _) = reviewed_user(&admin, sa_token.trim())
            .await?
            .context("the token from krt token create SA does not authenticate")?;
        ensure!(user == AGENT_USER, "krt SA token authenticates as {user:?}");
        let user_token = krt_ok(
            &server,
            &[
                "token",
                "create",
                "--user",
                "alice",
                "--group",
                DEVS,
                "--duration",
                "1h",
            ],
        )
        .await?;
        let (user, _, groups) = reviewed_user(&admin, user_token.trim())
            .await?
            .context("the token from krt token create --user does not authenticate")?;
        ensure!(user == "alice", "krt user token authenticates as {user:?}");
        for g in [DEVS, "system:authenticated"] {
            ensure!(
                groups.iter().any(|x| x == g),
                "alice's groups {groups:?} lack {g}"
            );
        }
        // alice, through devs, may create Runs in team-b with kubectl.
        let alice = Bearer::new(&server, user_token.trim())?;
        let out = kubectl_ok(&server, alice.path(), &["get", "runs", "-n", TEAM_B]).await?;
        ensure!(out.is_empty(), "kubectl get runs as alice printed {out:?}");

        let listed = krt_ok(&server, &["token", "list"]).await?;
        let alice_rows = listed.lines().filter(|l| l.contains(" alice ")).count();
        let agent_rows = listed.lines().filter(|l| l.contains(AGENT_USER)).count();
        ensure!(
            alice_rows == 1 && agent_rows == 2,
            "krt token list should show one token of alice and two of the agent:\n{listed}"
        );
        ensure!(
            !listed.contains(printed.as_str())
                && !listed.contains(sa_token.trim())
                && !listed.contains(user_token.trim()),
            "krt token list shows a raw token"
        );
        Ok(())
    })
    .await
}

// ---------------------------------------------------------------------------------------
// kubectl auth can-i
// ---------------------------------------------------------------------------------------

/// One `kubectl auth can-i` question and its expected answer.
struct Ask {
    verb: &'static str,
    /// `TYPE` or `TYPE/NAME`, as kubectl takes it.
    resource: &'static str,
    /// `--subresource`, or empty.
    subresource: &'static str,
    /// `-n`, or empty for the kubeconfig's namespace (cluster-scoped resources).
    namespace: &'static str,
    want: bool,
}

const fn ask(
    verb: &'static str,
    resource: &'static str,
    namespace: &'static str,
    want: bool,
) -> Ask {
    Ask {
        verb,
        resource,
        subresource: "",
        namespace,
        want,
    }
}

/// May the subject mint tokens for ServiceAccounts (`create serviceaccounts
/// --subresource=token`; `serviceaccounts/token` would name an account called `token`).
const fn ask_token(namespace: &'static str, want: bool) -> Ask {
    Ask {
        verb: "create",
        resource: "serviceaccounts",
        subresource: "token",
        namespace,
        want,
    }
}

const fn ask_status(verb: &'static str, namespace: &'static str, want: bool) -> Ask {
    Ask {
        verb,
        resource: RUNS,
        subresource: "status",
        namespace,
        want,
    }
}

/// Runs the real `kubectl auth can-i`: rc 0 and `yes`, or rc 1 and `no`. Anything else
/// (an error) fails.
async fn can_i(server: &Server, kubeconfig: Option<&Path>, q: &Ask) -> Result<bool> {
    let mut args = vec!["auth", "can-i", q.verb, q.resource];
    let sub;
    if !q.subresource.is_empty() {
        sub = format!("--subresource={}", q.subresource);
        args.push(&sub);
    }
    if !q.namespace.is_empty() {
        args.extend(["-n", q.namespace]);
    }
    let out = kubectl(server, kubeconfig, &args).await?;
    let answer = text(&out.stdout);
    match (out.status.code(), answer.trim()) {
        (Some(0), "yes") => Ok(true),
        (Some(1), "no") => Ok(false),
        _ => bail!(
            "kubectl {} answered neither yes nor no ({}):\nstdout: {answer}\nstderr: {}",
            args.join(" "),
            out.status,
            text(&out.stderr)
        ),
    }
}

/// The real `kubectl auth can-i` gives the expected answer for every subject and question:
/// the admin, a ServiceAccount bound in its namespace (including resourceNames), a user
/// bound through a group (cluster-wide and in one namespace), an unbound user, and the three
/// component identities through their own kubeconfigs.
#[tokio::test(flavor = "multi_thread")]
async fn kubectl_auth_can_i_answers_per_subject() -> Result<()> {
    let (server, admin) = start_server().await?;
    within("auth can-i table", async {
        make_policy(&server).await?;
        let agent = agent_token(&server).await?;
        let alice = Bearer::new(
            &server,
            &issue_user_token(&admin, "alice", &[DEVS], None)
                .await?
                .token,
        )?;
        let mallory = Bearer::new(
            &server,
            &issue_user_token(&admin, "mallory", &[], None).await?.token,
        )?;

        let subjects: Vec<(&str, Option<PathBuf>, Vec<Ask>)> = vec![
            (
                "admin",
                None,
                vec![
                    ask("create", RUNS, TEAM_A, true),
                    ask("delete", RUNS, TEAM_B, true),
                    ask_status("patch", TEAM_A, true),
                    ask("create", "clusterroles", "", true),
                    ask("delete", "namespaces", "", true),
                    ask_token(TEAM_A, true),
                ],
            ),
            (
                "ServiceAccount team-a/agent",
                Some(agent.kubeconfig.clone()),
                vec![
                    ask("get", RUNS, TEAM_A, true),
                    ask("list", RUNS, TEAM_A, true),
                    ask("watch", RUNS, TEAM_A, false),
                    ask("create", RUNS, TEAM_A, false),
                    ask("delete", RUNS, TEAM_A, false),
                    ask("delete", "runs.kruntimes.io/r1", TEAM_A, true),
                    ask("update", "runs.kruntimes.io/r1", TEAM_A, true),
                    ask("delete", "runs.kruntimes.io/r2", TEAM_A, false),
                    ask_status("get", TEAM_A, false),
                    ask_status("patch", TEAM_A, false),
                    // Cross-namespace: the RoleBinding grants nothing in team-b.
                    ask("get", RUNS, TEAM_B, false),
                    ask("list", RUNS, TEAM_B, false),
                    ask("delete", "runs.kruntimes.io/r1", TEAM_B, false),
                    ask("list", "pods", TEAM_A, false),
                    ask_token(TEAM_A, false),
                    ask("create", "rolebindings", TEAM_A, false),
                    ask("list", "namespaces", "", false),
                ],
            ),
            (
                "user alice in group devs",
                Some(alice.kubeconfig.clone()),
                vec![
                    // ClusterRoleBinding to group devs: runs/status everywhere.
                    ask_status("patch", TEAM_A, true),
                    ask_status("get", TEAM_A, true),
                    ask_status("patch", "default", true),
                    ask_status("update", TEAM_A, false),
                    ask("get", RUNS, TEAM_A, false),
                    ask("patch", RUNS, TEAM_A, false),
                    // RoleBinding of `edit` to group devs in team-b only.
                    ask("create", RUNS, TEAM_B, true),
                    ask("delete", RUNS, TEAM_B, true),
                    ask("list", RUNS, TEAM_B, true),
                    ask("create", RUNS, TEAM_A, false),
                    ask("list", RUNS, "default", false),
                    ask("list", "pods", TEAM_B, true),
                    ask("create", "pods", TEAM_B, false),
                    ask("create", "roles", TEAM_B, false),
                ],
            ),
            (
                "unbound user mallory",
                Some(mallory.kubeconfig.clone()),
                vec![
                    ask("get", RUNS, "default", false),
                    ask("list", RUNS, TEAM_A, false),
                    ask_status("patch", TEAM_A, false),
                    ask("create", "namespaces", "", false),
                    ask("list", "serviceaccounts", TEAM_A, false),
                    // system:basic-user, through system:authenticated.
                    ask(
                        "create",
                        "selfsubjectaccessreviews.authorization.k8s.io",
                        "",
                        true,
                    ),
                ],
            ),
            (
                "component gateway",
                Some(server.component_kubeconfig("gateway")),
                vec![
                    ask("create", "tokenreviews.authentication.k8s.io", "", true),
                    ask(
                        "create",
                        "subjectaccessreviews.authorization.k8s.io",
                        "",
                        true,
                    ),
                    ask("get", RUNS, TEAM_A, true),
                    ask("watch", RUNS, TEAM_B, true),
                    ask("delete", RUNS, TEAM_A, false),
                    ask("create", RUNS, TEAM_A, false),
                    ask_status("patch", TEAM_A, false),
                    ask("create", "pods", TEAM_A, false),
                    ask_token(TEAM_A, false),
                ],
            ),
            (
                "component runtimed",
                Some(server.component_kubeconfig("runtimed")),
                vec![
                    ask_status("patch", TEAM_A, true),
                    ask_status("update", TEAM_B, true),
                    ask("patch", RUNS, TEAM_A, true),
                    ask("delete", RUNS, TEAM_A, false),
                    ask("create", RUNS, TEAM_A, false),
                    ask("create", "pods", TEAM_A, false),
                    ask("list", "pods", TEAM_A, true),
                    // runtimed authorizes every call it serves with the caller's token
                    // (kruntimes-wire), and watches what those decisions rest on: read only.
                    ask("create", "tokenreviews.authentication.k8s.io", "", true),
                    ask(
                        "create",
                        "subjectaccessreviews.authorization.k8s.io",
                        "",
                        true,
                    ),
                    ask("watch", "rolebindings", TEAM_A, true),
                    ask("create", "rolebindings", TEAM_A, false),
                    ask("delete", "serviceaccounts", TEAM_A, false),
                    ask("get", "serviceaccounts", TEAM_A, false),
                ],
            ),
            (
                "component controller-manager",
                Some(server.component_kubeconfig("controller-manager")),
                vec![
                    ask("create", "pods", TEAM_A, true),
                    ask("delete", "pods", TEAM_B, true),
                    ask("delete", RUNS, TEAM_A, true),
                    ask_status("patch", TEAM_A, true),
                    ask("create", RUNS, TEAM_A, false),
                    ask(
                        "create",
                        "leases.coordination.k8s.io",
                        "kruntimes-system",
                        true,
                    ),
                    // The workers' identity in each namespace (the Kubernetes
                    // provisioner): it makes ServiceAccounts and bindings, and never
                    // deletes them, writes a role or mints a token.
                    ask("create", "serviceaccounts", TEAM_A, true),
                    ask("create", "rolebindings", TEAM_A, true),
                    ask("delete", "rolebindings", TEAM_A, false),
                    ask("create", "roles", TEAM_A, false),
                    ask_token(TEAM_A, false),
                    ask("list", "secrets", TEAM_A, false),
                ],
            ),
        ];

        let mut wrong = Vec::new();
        let mut asked = 0;
        for (subject, kubeconfig, asks) in &subjects {
            for q in asks {
                asked += 1;
                let got = can_i(&server, kubeconfig.as_deref(), q).await?;
                if got != q.want {
                    wrong.push(format!(
                        "{subject}: can-i {} {}{}{}: got {}, want {}",
                        q.verb,
                        q.resource,
                        if q.subresource.is_empty() {
                            String::new()
                        } else {
                            format!(" --subresource={}", q.subresource)
                        },
                        if q.namespace.is_empty() {
                            String::new()
                        } else {
                            format!(" -n {}", q.namespace)
                        },
                        answer(got),
                        answer(q.want)
                    ));
                }
            }
        }
        ensure!(
            wrong.is_empty(),
            "{} of {asked} kubectl auth can-i answers are wrong:\n{}",
            wrong.len(),
            wrong.join("\n")
        );

        // `auth can-i --list` (SelfSubjectRulesReview) shows the agent its rules in team-a.
        let list = kubectl_ok(
            &server,
            agent.path(),
            &["auth", "can-i", "--list", "-n", TEAM_A],
        )
        .await?;
        ensure!(
            list.lines()
                .any(|l| l.starts_with("runs.kruntimes.io ") && l.contains("[get list]")),
            "auth can-i --list for the agent lacks `runs.kruntimes.io ... [get list]`:\n{list}"
        );
        Ok(())
    })
    .await
}

fn answer(yes: bool) -> &'static str {
    if yes { "yes" } else { "no" }
}

// ---------------------------------------------------------------------------------------
// Cross-namespace refusal
// ---------------------------------------------------------------------------------------

/// A token bound in one namespace reads Runs there and nowhere else. The refusal is a 403
/// `Forbidden` Status naming the user, verb, resource and namespace, through kube-rs and
/// through kubectl; existing and missing objects are refused alike, so nothing leaks.
#[tokio::test(flavor = "multi_thread")]
async fn namespace_scoped_token_is_forbidden_in_other_namespaces() -> Result<()> {
    let (server, admin) = start_server().await?;
    within("cross-namespace refusal", async {
        make_policy(&server).await?;
        create_run(&admin, TEAM_A, "mine").await?;
        create_run(&admin, TEAM_B, "theirs").await?;
        let agent = agent_token(&server).await?;
        let client = agent.client().await?;

        // Allowed in its own namespace.
        let own: Api<Run> = Api::namespaced(client.clone(), TEAM_A);
        let names: Vec<String> = own
            .list(&ListParams::default())
            .await
            .context("the agent lists Runs in team-a")?
            .into_iter()
            .map(|r| r.name_any())
            .collect();
        ensure!(names == ["mine"], "the agent sees {names:?} in team-a");
        own.get("mine").await.context("the agent gets team-a/mine")?;
        // ... but only to read.
        let status = expect_status(
            "agent creates a Run in team-a",
            own.create(&PostParams::default(), &task_run("new")).await,
        )?;
        ensure_forbidden(
            "agent creates a Run in team-a",
            &status,
            AGENT_USER,
            "create",
            "in the namespace \"team-a\"",
        )?;

        // Refused in another namespace: list, get of an existing and of a missing Run.
        let other: Api<Run> = Api::namespaced(client.clone(), TEAM_B);
        let status = expect_status(
            "agent lists Runs in team-b",
            other.list(&ListParams::default()).await,
        )?;
        ensure_forbidden(
            "agent lists Runs in team-b",
            &status,
            AGENT_USER,
            "list",
            "in the namespace \"team-b\"",
        )?;
        for name in ["theirs", "missing"] {
            let what = format!("agent gets team-b/{name}");
            let status = expect_status(&what, other.get(name).await)?;
            ensure_forbidden(&what, &status, AGENT_USER, "get", "in the namespace \"team-b\"")?;
            ensure!(
                status.message.contains(&format!("runs.kruntimes.io \"{name}\"")),
                "{what}: the 403 does not name the Run: {:?}",
                status.message
            );
        }
        // Nor watch there.
        let status = expect_status(
            "agent watches Runs in team-b",
            other
                .watch(&WatchParams::default(), "0")
                .await
                .map(|_| "a watch stream"),
        )?;
        ensure_forbidden(
            "agent watches Runs in team-b",
            &status,
            AGENT_USER,
            "watch",
            "in the namespace \"team-b\"",
        )?;
        // Reading a Run is not writing its status; the refusal names the subresource.
        let status = expect_status(
            "agent patches team-a/mine status",
            own.patch_status(
                "mine",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Scheduled"}})),
            )
            .await,
        )?;
        ensure_status("agent patches team-a/mine status", &status, 403, "Forbidden")?;
        ensure!(
            status.message.contains("cannot patch resource \"runs/status\""),
            "the 403 for runs/status does not name the subresource: {:?}",
            status.message
        );
        // Nor across all namespaces.
        let all: Api<Run> = Api::all(client.clone());
        let status = expect_status(
            "agent lists Runs in all namespaces",
            all.list(&ListParams::default()).await,
        )?;
        ensure_forbidden(
            "agent lists Runs in all namespaces",
            &status,
            AGENT_USER,
            "list",
            "at the cluster scope",
        )?;

        // The same through kubectl: it prints the server's message.
        let stderr = kubectl_err(&server, agent.path(), &["get", "runs", "-n", TEAM_B]).await?;
        let want = "Error from server (Forbidden): runs.kruntimes.io is forbidden: User \"system:serviceaccount:team-a:agent\" cannot list resource \"runs\" in API group \"kruntimes.io\" in the namespace \"team-b\"";
        ensure!(
            stderr.contains(want),
            "kubectl get runs -n team-b as the agent:\nwant {want}\ngot  {stderr}"
        );
        let stderr = kubectl_err(
            &server,
            agent.path(),
            &["get", "run", "theirs", "-n", TEAM_B, "-o", "yaml"],
        )
        .await?;
        let want = "Error from server (Forbidden): runs.kruntimes.io \"theirs\" is forbidden: User \"system:serviceaccount:team-a:agent\" cannot get resource \"runs\" in API group \"kruntimes.io\" in the namespace \"team-b\"";
        ensure!(
            stderr.contains(want),
            "kubectl get run theirs -n team-b as the agent:\nwant {want}\ngot  {stderr}"
        );
        let out = kubectl_ok(
            &server,
            agent.path(),
            &["get", "runs", "-n", TEAM_A, "-o", "name"],
        )
        .await?;
        ensure!(
            out.trim() == "run.kruntimes.io/mine",
            "kubectl get runs -n team-a as the agent printed {out:?}"
        );
        Ok(())
    })
    .await
}

// ---------------------------------------------------------------------------------------
// Expiry and revocation
// ---------------------------------------------------------------------------------------

/// Expects the request to be refused as unauthenticated.
fn ensure_unauthorized<T: std::fmt::Debug>(what: &str, result: kube::Result<T>) -> Result<()> {
    let status = expect_status(what, result)?;
    ensure_status(what, &status, 401, "Unauthorized")
}

/// A user token issued for two seconds works, then is refused with 401 no later than one
/// second after the expirationTimestamp its AccessToken states (and not before it).
#[tokio::test(flavor = "multi_thread")]
async fn expired_token_is_refused_within_one_second() -> Result<()> {
    let (server, admin) = start_server().await?;
    within("token expiry", async {
        make_policy(&server).await?;
        let issued = issue_user_token(&admin, "viewer-of-default", &[], Some(2)).await?;
        let stored = access_tokens(admin.clone()).get(&issued.name).await?;
        let expiry_text = stored.data["spec"]["expirationTimestamp"]
            .as_str()
            .with_context(|| {
                format!(
                    "AccessToken {} has no spec.expirationTimestamp: {}",
                    issued.name, stored.data
                )
            })?
            .to_string();
        let expiry = parse_time(&expiry_text)?;

        let bearer = Bearer::new(&server, &issued.token)?;
        let runs: Api<Run> = Api::namespaced(bearer.client().await?, "default");
        let first = SystemTime::now();
        runs.list(&ListParams::default())
            .await
            .context("a fresh two-second token is refused")?;
        ensure!(
            first < expiry,
            "the token expired ({expiry_text}) before it could be used; the machine is too slow"
        );

        // Poll until refused; the hard deadline keeps a never-expiring token from hanging.
        let hard_deadline = expiry + Duration::from_secs(10);
        let mut last_success_sent = first;
        let (refused_sent, refused_received) = loop {
            let sent = SystemTime::now();
            ensure!(
                sent < hard_deadline,
                "the token was still accepted 10 s after its expirationTimestamp {expiry_text}"
            );
            match runs.list(&ListParams::default()).await {
                Ok(_) => last_success_sent = sent,
                Err(kube::Error::Api(status)) if status.code == 401 => {
                    ensure_status("the expired token", &status, 401, "Unauthorized")?;
                    break (sent, SystemTime::now());
                }
                Err(other) => bail!("polling the expiring token: {other:#}"),
            }
            tokio::time::sleep(EXPIRY_POLL).await;
        };
        let late = |t: SystemTime| match t.duration_since(expiry) {
            Ok(d) => format!("{d:?} after expiry"),
            Err(e) => format!("{:?} before expiry", e.duration()),
        };
        ensure!(
            refused_received >= expiry,
            "the token was refused {} (expirationTimestamp {expiry_text})",
            late(refused_received)
        );
        ensure!(
            refused_sent <= expiry + REFUSAL_BOUND,
            "the first refused request was sent {}; a request sent {} was still accepted",
            late(refused_sent),
            late(last_success_sent)
        );
        ensure!(
            last_success_sent < expiry + REFUSAL_BOUND,
            "a request sent {} was accepted",
            late(last_success_sent)
        );
        ensure!(
            reviewed_user(&admin, &issued.token).await?.is_none(),
            "TokenReview still authenticates the expired token"
        );
        // The refusal sticks.
        ensure_unauthorized(
            "the expired token, again",
            runs.list(&ListParams::default()).await,
        )?;
        let stderr = kubectl_err(&server, bearer.path(), &["get", "runs"]).await?;
        ensure!(
            stderr.contains("Unauthorized"),
            "kubectl with the expired token: {stderr}"
        );
        Ok(())
    })
    .await
}

/// Deleting an AccessToken (through kube-rs, or `krt token revoke`) revokes it: the very next
/// request is a 401. Deleting a ServiceAccount does the same to its tokens, and recreating it
/// under the same name does not bring them back. Unknown tokens are 401 too.
#[tokio::test(flavor = "multi_thread")]
async fn revoked_tokens_are_refused_at_once() -> Result<()> {
    let (server, admin) = start_server().await?;
    within("token revocation", async {
        make_policy(&server).await?;

        // Delete the AccessToken object.
        let issued = issue_user_token(&admin, "viewer-of-default", &[], None).await?;
        let bearer = Bearer::new(&server, &issued.token)?;
        let runs: Api<Run> = Api::namespaced(bearer.client().await?, "default");
        runs.list(&ListParams::default())
            .await
            .context("the fresh token is refused")?;
        access_tokens(admin.clone())
            .delete(&issued.name, &DeleteParams::default())
            .await
            .context("delete the AccessToken")?;
        ensure_unauthorized(
            "the first request after deleting the AccessToken",
            runs.list(&ListParams::default()).await,
        )?;
        ensure!(
            reviewed_user(&admin, &issued.token).await?.is_none(),
            "TokenReview authenticates a revoked token"
        );

        // krt token revoke.
        let token = krt_ok(&server, &["token", "create", "--user", "viewer-of-default"]).await?;
        let token = token.trim();
        let bearer = Bearer::new(&server, token)?;
        let runs: Api<Run> = Api::namespaced(bearer.client().await?, "default");
        runs.list(&ListParams::default())
            .await
            .context("the krt token is refused")?;
        let names: Vec<String> = access_token_users(&admin)
            .await?
            .into_iter()
            .filter(|(_, user, _)| user == "viewer-of-default")
            .map(|(name, _, _)| name)
            .collect();
        ensure!(names.len() == 1, "tokens of viewer-of-default: {names:?}");
        let out = krt_ok(&server, &["token", "revoke", &names[0]]).await?;
        ensure!(
            out.trim() == format!("token {} revoked", names[0]),
            "krt token revoke printed {out:?}"
        );
        ensure_unauthorized(
            "the first request after krt token revoke",
            runs.list(&ListParams::default()).await,
        )?;
        let stderr = kubectl_err(&server, bearer.path(), &["get", "runs"]).await?;
        ensure!(
            stderr.contains("Unauthorized"),
            "kubectl with a revoked token: {stderr}"
        );

        // Deleting the ServiceAccount.
        let agent = agent_token(&server).await?;
        let runs: Api<Run> = Api::namespaced(agent.client().await?, TEAM_A);
        runs.list(&ListParams::default())
            .await
            .context("the agent's token is refused")?;
        kubectl_ok(
            &server,
            None,
            &["delete", "serviceaccount", AGENT, "-n", TEAM_A],
        )
        .await?;
        ensure_unauthorized(
            "the agent's token after its ServiceAccount was deleted",
            runs.list(&ListParams::default()).await,
        )?;
        ensure!(
            reviewed_user(&admin, &agent.token).await?.is_none(),
            "TokenReview authenticates the token of a deleted ServiceAccount"
        );
        kubectl_ok(
            &server,
            None,
            &["create", "serviceaccount", AGENT, "-n", TEAM_A],
        )
        .await?;
        ensure_unauthorized(
            "the old token after the ServiceAccount was recreated",
            runs.list(&ListParams::default()).await,
        )?;
        let fresh = agent_token(&server).await?;
        Api::<Run>::namespaced(fresh.client().await?, TEAM_A)
            .list(&ListParams::default())
            .await
            .context("a token of the recreated ServiceAccount is refused")?;

        // A token the server never issued.
        let unknown = Bearer::new(&server, "not-a-token-the-server-issued")?;
        ensure_unauthorized(
            "an unknown token",
            Api::<Run>::namespaced(unknown.client().await?, "default")
                .list(&ListParams::default())
                .await,
        )?;
        Ok(())
    })
    .await
}

// ---------------------------------------------------------------------------------------
// Review APIs through kube-rs
// ---------------------------------------------------------------------------------------

/// TokenReview and SubjectAccessReview, asked as the gateway asks them (with the gateway's
/// own least-privilege identity), answer for ServiceAccount, group-bound, unbound, revoked
/// and unknown tokens; LocalSubjectAccessReview and SelfSubjectAccessReview agree.
#[tokio::test(flavor = "multi_thread")]
async fn token_and_access_reviews_answer_for_issued_tokens() -> Result<()> {
    let (server, admin) = start_server().await?;
    within("review APIs", async {
        make_policy(&server).await?;
        let gateway = client_from(&server.component_kubeconfig("gateway")).await?;
        let agent = agent_token(&server).await?;
        let alice = issue_user_token(&admin, "alice", &[DEVS], Some(3600)).await?;
        let mallory = issue_user_token(&admin, "mallory", &[], None).await?;
        let revoked = issue_user_token(&admin, "revoked", &[DEVS], None).await?;
        access_tokens(admin.clone())
            .delete(&revoked.name, &DeleteParams::default())
            .await?;

        // TokenReview.
        let sa_uid = Api::<ServiceAccount>::namespaced(admin.clone(), TEAM_A)
            .get(AGENT)
            .await?
            .uid()
            .context("the ServiceAccount has no uid")?;
        let (agent_user, agent_uid, agent_groups) = reviewed_user(&gateway, &agent.token)
            .await?
            .context("TokenReview does not authenticate the agent")?;
        ensure!(agent_user == AGENT_USER, "agent user {agent_user:?}");
        ensure!(agent_uid == sa_uid, "agent uid {agent_uid:?} != {sa_uid:?}");
        let mut sorted = agent_groups.clone();
        sorted.sort();
        ensure!(
            sorted
                == [
                    "system:authenticated",
                    "system:serviceaccounts",
                    "system:serviceaccounts:team-a"
                ],
            "agent groups {agent_groups:?}"
        );
        let (alice_user, _, alice_groups) = reviewed_user(&gateway, &alice.token)
            .await?
            .context("TokenReview does not authenticate alice")?;
        ensure!(alice_user == "alice", "alice user {alice_user:?}");
        let mut sorted = alice_groups.clone();
        sorted.sort();
        ensure!(
            sorted == [DEVS, "system:authenticated"],
            "alice groups {alice_groups:?}"
        );
        let (mallory_user, _, mallory_groups) = reviewed_user(&gateway, &mallory.token)
            .await?
            .context("TokenReview does not authenticate mallory")?;
        ensure!(
            mallory_user == "mallory" && mallory_groups == ["system:authenticated"],
            "mallory: {mallory_user:?} {mallory_groups:?}"
        );
        for (what, token) in [
            ("a revoked token", revoked.token.as_str()),
            ("an unknown token", "not-a-token-the-server-issued"),
            ("an empty token", ""),
        ] {
            let review = token_review(&gateway, token).await?;
            let status = review.status.context("TokenReview without status")?;
            ensure!(
                status.authenticated != Some(true) && status.user.is_none(),
                "TokenReview of {what}: {status:?}"
            );
            ensure!(
                review.spec.token.is_none(),
                "TokenReview of {what} echoes the token back"
            );
        }

        // SubjectAccessReview, with the identities TokenReview returned.
        // (verb, namespace, subresource, name, allowed) per subject.
        let agent_asks = [
            ("get", TEAM_A, "", "r1", true),
            ("list", TEAM_A, "", "", true),
            ("delete", TEAM_A, "", "r1", true),
            ("delete", TEAM_A, "", "r2", false),
            ("get", TEAM_B, "", "r1", false),
            ("list", TEAM_B, "", "", false),
            ("list", "", "", "", false),
            ("patch", TEAM_A, "status", "r1", false),
        ];
        let alice_asks = [
            ("patch", TEAM_A, "status", "r1", true),
            ("get", TEAM_A, "", "r1", false),
            ("create", TEAM_B, "", "", true),
            ("create", TEAM_A, "", "", false),
        ];
        let mallory_asks = [
            ("get", "default", "", "r1", false),
            ("patch", TEAM_A, "status", "r1", false),
        ];
        let mut wrong = Vec::new();
        for (user, groups, asks) in [
            (&agent_user, &agent_groups, &agent_asks[..]),
            (&alice_user, &alice_groups, &alice_asks[..]),
            (&mallory_user, &mallory_groups, &mallory_asks[..]),
        ] {
            for &(verb, ns, sub, name, want) in asks {
                let attributes = run_attributes(verb, ns, sub, name);
                let got = subject_access_review(&gateway, user, groups, attributes).await?;
                if got != want {
                    let sub = if sub.is_empty() {
                        String::new()
                    } else {
                        format!("/{sub}")
                    };
                    wrong.push(format!(
                        "{user} {groups:?} {verb} runs{sub} {ns}/{name}: got {got}, want {want}"
                    ));
                }
            }
        }
        // Group membership alone decides: devs without a user name it knows.
        let devs_only = subject_access_review(
            &gateway,
            "someone-else",
            &[DEVS.to_string()],
            run_attributes("patch", TEAM_B, "status", "x"),
        )
        .await?;
        if !devs_only {
            wrong.push("someone-else [devs] patch runs/status team-b/x: got false, want true".into());
        }
        ensure!(
            wrong.is_empty(),
            "SubjectAccessReview answers are wrong:\n{}",
            wrong.join("\n")
        );

        // LocalSubjectAccessReview in team-a agrees (asked by the admin).
        let local = LocalSubjectAccessReview {
            metadata: kube::api::ObjectMeta {
                namespace: Some(TEAM_A.into()),
                ..Default::default()
            },
            spec: SubjectAccessReviewSpec {
                user: Some(agent_user.clone()),
                groups: Some(agent_groups.clone()),
                resource_attributes: Some(run_attributes("list", TEAM_A, "", "")),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer = Api::<LocalSubjectAccessReview>::namespaced(admin.clone(), TEAM_A)
            .create(&PostParams::default(), &local)
            .await
            .context("create a LocalSubjectAccessReview")?;
        ensure!(
            answer.status.as_ref().is_some_and(|s| s.allowed),
            "LocalSubjectAccessReview: {:?}",
            answer.status
        );

        // SelfSubjectAccessReview as the agent itself.
        let agent_client = agent.client().await?;
        for (ns, want) in [(TEAM_A, true), (TEAM_B, false)] {
            let review = SelfSubjectAccessReview {
                spec: SelfSubjectAccessReviewSpec {
                    resource_attributes: Some(run_attributes("list", ns, "", "")),
                    ..Default::default()
                },
                ..Default::default()
            };
            let answer = Api::<SelfSubjectAccessReview>::all(agent_client.clone())
                .create(&PostParams::default(), &review)
                .await
                .context("create a SelfSubjectAccessReview as the agent")?;
            let got = answer.status.context("no status")?.allowed;
            ensure!(got == want, "SelfSubjectAccessReview list runs in {ns}: {got}");
        }

        // Reviewing tokens is not for everyone: mallory may not.
        let status = expect_status(
            "mallory creates a TokenReview",
            Api::<TokenReview>::all(Bearer::new(&server, &mallory.token)?.client().await?)
                .create(
                    &PostParams::default(),
                    &TokenReview {
                        spec: TokenReviewSpec {
                            token: Some(agent.token.clone()),
                            ..Default::default()
                        },
                        ..Default::default()
                    },
                )
                .await,
        )?;
        ensure_status("mallory creates a TokenReview", &status, 403, "Forbidden")?;

        // The gateway reviews, but cannot mint tokens, delete Runs or grant itself more.
        let status = expect_status(
            "the gateway issues an AccessToken",
            access_tokens(gateway.clone())
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({
                        "apiVersion": "auth.kruntimes.io/v1alpha1",
                        "kind": "AccessToken",
                        "metadata": {},
                        "spec": {"user": {"username": "eve", "groups": [DEVS]}},
                    }))?,
                )
                .await,
        )?;
        ensure_status("the gateway issues an AccessToken", &status, 403, "Forbidden")?;
        create_run(&admin, TEAM_A, "r1").await?;
        let status = expect_status(
            "the gateway deletes a Run",
            Api::<Run>::namespaced(gateway.clone(), TEAM_A)
                .delete("r1", &DeleteParams::default())
                .await,
        )?;
        ensure_forbidden(
            "the gateway deletes a Run",
            &status,
            "system:serviceaccount:kruntimes-system:kruntimes-gateway",
            "delete",
            "in the namespace \"team-a\"",
        )?;
        let status = expect_status(
            "the gateway binds itself to cluster-admin",
            Api::<ClusterRoleBinding>::all(gateway.clone())
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({
                        "apiVersion": "rbac.authorization.k8s.io/v1",
                        "kind": "ClusterRoleBinding",
                        "metadata": {"name": "gateway-escalates"},
                        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
                        "subjects": [{"kind": "ServiceAccount", "name": "kruntimes-gateway", "namespace": "kruntimes-system"}],
                    }))?,
                )
                .await,
        )?;
        ensure_status(
            "the gateway binds itself to cluster-admin",
            &status,
            403,
            "Forbidden",
        )?;
        Ok(())
    })
    .await
}

/// A user who may manage Roles and RoleBindings in a namespace still cannot grant what they
/// do not hold: binding cluster-admin or writing a Role with more rights is Forbidden, as on
/// a real cluster (privilege-escalation prevention).
#[tokio::test(flavor = "multi_thread")]
async fn rbac_managers_cannot_grant_more_than_they_hold() -> Result<()> {
    within("escalation", async {
        let (server, admin) = start_server().await?;
        kubectl_ok(&server, None, &["create", "namespace", TEAM_A]).await?;
        kubectl_ok(
            &server,
            None,
            &["create", "role", "rbac-manager", "-n", TEAM_A, "--verb=get,list,create,update",
              "--resource=roles.rbac.authorization.k8s.io,rolebindings.rbac.authorization.k8s.io,runs.kruntimes.io"],
        )
        .await?;
        kubectl_ok(
            &server,
            None,
            &["create", "rolebinding", "lead-manages", "-n", TEAM_A, "--role=rbac-manager", "--user=lead"],
        )
        .await?;
        let lead = issue_user_token(&admin, "lead", &[], None).await?;
        let lead = Bearer::new(&server, &lead.token)?;

        // Within what lead holds: allowed.
        kubectl_ok(
            &server,
            lead.path(),
            &["create", "role", "reader", "-n", TEAM_A, "--verb=get,list", "--resource=runs.kruntimes.io"],
        )
        .await?;
        kubectl_ok(
            &server,
            lead.path(),
            &["create", "rolebinding", "bob-reads", "-n", TEAM_A, "--role=reader", "--user=bob"],
        )
        .await?;

        // Beyond it: refused, and nothing is created.
        let refused = kubectl_err(
            &server,
            lead.path(),
            &["create", "role", "deleter", "-n", TEAM_A, "--verb=delete", "--resource=runs.kruntimes.io"],
        )
        .await?;
        ensure!(
            refused.contains("forbidden") && refused.contains("not currently held"),
            "a Role with more rights must be refused: {refused}"
        );
        let refused = kubectl_err(
            &server,
            lead.path(),
            &["create", "rolebinding", "lead-admin", "-n", TEAM_A, "--clusterrole=cluster-admin", "--user=lead"],
        )
        .await?;
        ensure!(
            refused.contains("forbidden") && refused.contains("not currently held"),
            "binding cluster-admin must be refused: {refused}"
        );
        let bindings = kubectl_ok(&server, None, &["get", "rolebindings", "-n", TEAM_A, "-o", "name"]).await?;
        ensure!(!bindings.contains("lead-admin"), "the refused binding exists: {bindings}");
        let lead_client = lead.client().await?;
        let denied = Api::<Run>::namespaced(lead_client, TEAM_A)
            .delete("anything", &Default::default())
            .await;
        let status = expect_status("lead deletes a Run", denied)?;
        ensure_status("lead deletes a Run", &status, 403, "Forbidden")?;
        Ok(())
    })
    .await
}

/// Acting as someone else — `kubectl --as`, or issuing a token in their name — takes the
/// impersonate verb; an AccessToken can only be issued by POST, never written by apply.
#[tokio::test(flavor = "multi_thread")]
async fn acting_as_another_identity_takes_the_impersonate_verb() -> Result<()> {
    within("impersonation", async {
        let (server, admin) = start_server().await?;
        kubectl_ok(&server, None, &["create", "namespace", TEAM_A]).await?;
        kubectl_ok(
            &server,
            None,
            &["create", "rolebinding", "bob-views", "-n", TEAM_A, "--clusterrole=view", "--user=bob"],
        )
        .await?;

        // The admin may impersonate: `--as` answers for bob, not for the admin.
        let as_bob = |verb: &'static str| {
            vec!["auth", "can-i", verb, RUNS, "-n", TEAM_A, "--as=bob"]
        };
        ensure!(kubectl_ok(&server, None, &as_bob("list")).await?.trim() == "yes");
        let out = kubectl(&server, None, &as_bob("delete")).await?;
        ensure!(
            !out.status.success() && text(&out.stdout).trim() == "no",
            "--as must evaluate bob's rights, not the admin's: {}",
            text(&out.stdout)
        );

        // A token issuer without impersonate may issue only for itself.
        kubectl_ok(
            &server,
            None,
            &["create", "clusterrole", "token-issuer", "--verb=create,patch", "--resource=accesstokens.auth.kruntimes.io"],
        )
        .await?;
        kubectl_ok(
            &server,
            None,
            &["create", "clusterrolebinding", "carol-issues", "--clusterrole=token-issuer", "--user=carol"],
        )
        .await?;
        let carol = issue_user_token(&admin, "carol", &[], None).await?;
        let carol = Bearer::new(&server, &carol.token)?;
        let carol_client = carol.client().await?;
        issue_user_token(&carol_client, "carol", &[], Some(600))
            .await
            .context("carol issues a token for herself")?;
        let for_bob = issue_user_token(&carol_client, "bob", &[], Some(600)).await;
        let status = match for_bob {
            Err(e) => match e.downcast_ref::<kube::Error>() {
                Some(kube::Error::Api(status)) => (**status).clone(),
                _ => bail!("issuing for bob: expected an API error, got {e:#}"),
            },
            Ok(_) => bail!("carol issued a token for bob without the impersonate verb"),
        };
        ensure_status("carol issues for bob", &status, 403, "Forbidden")?;
        ensure!(status.message.contains("impersonate"), "{}", status.message);

        // Apply cannot write an AccessToken (it would choose its own digest and identity).
        let forged = json!({
            "apiVersion": "auth.kruntimes.io/v1alpha1",
            "kind": "AccessToken",
            "metadata": {"name": "tforged"},
            "spec": {"digest": "sha256:00", "user": {"username": "evil", "groups": ["system:masters"]}},
        });
        let applied = access_tokens(carol_client)
            .patch(
                "tforged",
                &kube::api::PatchParams::apply("carol"),
                &kube::api::Patch::Apply(&forged),
            )
            .await;
        let status = expect_status("apply an AccessToken", applied)?;
        ensure!(status.code == 405, "apply-create of an AccessToken must be refused: {status:?}");
        ensure!(
            access_tokens(admin.clone()).get_opt("tforged").await?.is_none(),
            "the forged AccessToken exists"
        );
        Ok(())
    })
    .await
}
