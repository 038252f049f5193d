//! `krt token create|list|revoke`: bearer tokens for ServiceAccounts and users.

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::core::GroupVersionKind;
use serde_json::json;

use crate::conn::{Conn, explain};

#[derive(Subcommand, Debug)]
pub enum TokenCommand {
    /// Issue a token for a ServiceAccount (like `kubectl create token`) or, with --user,
    /// for a user. Prints the token; it is shown only once.
    Create {
        /// The ServiceAccount to issue for (in the namespace of -n).
        service_account: Option<String>,
        /// Issue for this user name instead of a ServiceAccount.
        #[arg(long, conflicts_with = "service_account")]
        user: Option<String>,
        /// Groups of the user (repeatable).
        #[arg(long = "group", requires = "user")]
        groups: Vec<String>,
        /// How long the token is valid, e.g. 10m, 1h, 24h (ServiceAccounts: at least 10m).
        #[arg(long)]
        duration: Option<String>,
    },
    /// List issued tokens (never their secret part).
    List,
    /// Revoke a token by its name (see `krt token list`).
    Revoke { name: String },
}

fn access_tokens(client: kube::Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("auth.kruntimes.io", "v1alpha1", "AccessToken");
    let resource = ApiResource::from_gvk_with_plural(&gvk, "accesstokens");
    Api::all_with(client, &resource)
}

/// Why `--user`, `list` and `revoke` fail on a cluster: AccessTokens are the embedded API
/// server's own kind.
pub const STANDALONE_ONLY: &str = "user tokens (`krt token create --user`, `krt token list`, \
     `krt token revoke`) exist only on the embedded API server of `kruntimes up`; this API \
     server does not serve auth.kruntimes.io/v1alpha1 AccessTokens (a Kubernetes cluster \
     does not). On a cluster, issue a ServiceAccount token with `krt token create \
     SERVICEACCOUNT` (or `kubectl create token`) and grant it access with RBAC";

/// Fails with [`STANDALONE_ONLY`] when the API server does not serve AccessTokens, as a
/// cluster's does not (its discovery answers 404 for the group). Any other failure is left
/// to the call that follows, which reports it.
async fn require_access_tokens(client: &kube::Client) -> Result<()> {
    match client
        .list_api_group_resources("auth.kruntimes.io/v1alpha1")
        .await
    {
        Ok(list) if list.resources.iter().any(|r| r.name == "accesstokens") => Ok(()),
        Ok(_) => bail!(STANDALONE_ONLY),
        Err(kube::Error::Api(status)) if status.code == 404 => bail!(STANDALONE_ONLY),
        Err(_) => Ok(()),
    }
}

/// Seconds of a `--duration`, at least one.
pub fn seconds(duration: &str) -> Result<i64> {
    let d = kruntimes_api::duration::parse(duration)
        .with_context(|| format!("invalid --duration {duration:?}"))?;
    let secs = d.as_secs();
    if secs == 0 {
        bail!("--duration must be at least one second");
    }
    Ok(i64::try_from(secs)?)
}

pub async fn run(conn: Conn, command: TokenCommand) -> Result<()> {
    let client = conn.client;
    match command {
        TokenCommand::Create {
            service_account,
            user,
            groups,
            duration,
        } => {
            let expiration = duration.as_deref().map(seconds).transpose()?;
            let token = match (service_account, user) {
                (Some(sa), None) => {
                    let api: Api<ServiceAccount> = Api::namespaced(client, &conn.namespace);
                    let request = TokenRequest {
                        spec: TokenRequestSpec {
                            expiration_seconds: expiration,
                            ..Default::default()
                        },
                        ..Default::default()
                    };
                    let answer = api
                        .create_token_request(&sa, &PostParams::default(), &request)
                        .await
                        .map_err(explain)?;
                    answer
                        .status
                        .map(|s| s.token)
                        .context("the server returned no token")?
                }
                (None, Some(user)) => {
                    require_access_tokens(&client).await?;
                    let mut spec = json!({"user": {"username": user, "groups": groups}});
                    if let Some(e) = expiration {
                        spec["expirationSeconds"] = json!(e);
                    }
                    let object: DynamicObject = serde_json::from_value(json!({
                        "apiVersion": "auth.kruntimes.io/v1alpha1",
                        "kind": "AccessToken",
                        "metadata": {},
                        "spec": spec,
                    }))?;
                    let created = access_tokens(client)
                        .create(&PostParams::default(), &object)
                        .await
                        .map_err(explain)?;
                    created.data["status"]["token"]
                        .as_str()
                        .context("the server returned no token")?
                        .to_string()
                }
                _ => bail!("name a ServiceAccount, or pass --user NAME"),
            };
            print!("{token}");
            if atty_stdout() {
                println!();
            }
        }
        TokenCommand::List => {
            require_access_tokens(&client).await?;
            let list =
                kruntimes_api::paging::list_all(&access_tokens(client), &ListParams::default())
                    .await
                    .map_err(explain)?;
            println!("{:<42} {:<50} EXPIRES", "NAME", "USER");
            for token in list {
                let spec = &token.data["spec"];
                println!(
                    "{:<42} {:<50} {}",
                    token.metadata.name.unwrap_or_default(),
                    spec["user"]["username"].as_str().unwrap_or(""),
                    spec["expirationTimestamp"].as_str().unwrap_or("never")
                );
            }
        }
        TokenCommand::Revoke { name } => {
            require_access_tokens(&client).await?;
            access_tokens(client)
                .delete(&name, &DeleteParams::default())
                .await
                .map_err(explain)?;
            println!("token {name} revoked");
        }
    }
    Ok(())
}

fn atty_stdout() -> bool {
    use std::io::IsTerminal;
    std::io::stdout().is_terminal()
}
