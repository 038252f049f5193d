//! Mutual TLS on runtimed's gRPC port under `kruntimes up`: every worker incarnation gets a
//! certificate from the data directory's CA, issued for its Pod name; its port admits only
//! clients with a certificate from that CA; the gateway and forwarding peers verify the
//! worker as the Pod they mean to reach.

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use common::{DEADLINE, create, create_runtime, endpoint, python, wait_ready};
use k8s_openapi::api::core::v1::Pod;
use kruntimes_apiserver::tls::{WorkloadCert, issue_workload};
use kruntimes_proto::runtimed::v1::RunLogsRequest;
use kruntimes_proto::runtimed::v1::runtimed_client::RuntimedClient;
use kruntimes_testkit::{Options, Server, within};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

/// Certificates the test issues itself.
const VALIDITY: Duration = Duration::from_secs(3600);

/// The ready worker Pods of `runtime` in namespace default, by name.
async fn worker_pods(client: &Client, runtime: &str) -> Result<Vec<Pod>> {
    let pods = Api::<Pod>::namespaced(client.clone(), "default");
    let params = ListParams::default().labels(&format!("kruntimes.io/runtime={runtime}"));
    let mut ready: Vec<Pod> = pods
        .list(&params)
        .await?
        .items
        .into_iter()
        .filter(|pod| {
            pod.metadata.deletion_timestamp.is_none()
                && pod
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .into_iter()
                    .flatten()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
        })
        .collect();
    ready.sort_by_key(|pod| pod.name_any());
    Ok(ready)
}

/// Where the worker Pod's runtimed listens (`status.podIP`, the port named `runtimed`).
fn runtimed_addr(pod: &Pod) -> Result<SocketAddr> {
    let ip = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .context("the Pod has no IP")?;
    let port = pod
        .spec
        .as_ref()
        .into_iter()
        .flat_map(|spec| spec.containers.iter())
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some("runtimed"))
        .map(|p| p.container_port)
        .context("the Pod has no runtimed port")?;
    Ok(SocketAddr::new(ip.parse()?, u16::try_from(port)?))
}

/// The command line of the runtimed of worker Pod `pod`.
fn runtimed_cmdline(pod: &str) -> Result<String> {
    let needle = format!("--pod-name {pod} ");
    let found = kruntimes_testkit::procs::matching(|p| {
        p.cmdline.contains(&needle) && p.cmdline.contains(" runtimed ")
    });
    match found.as_slice() {
        [one] => Ok(one.cmdline.clone()),
        other => bail!("expected one runtimed for Pod {pod}, found {other:?}"),
    }
}

/// What a connection to a runtimed port came to.
#[derive(Debug)]
enum Probe {
    /// runtimed itself answered the call (NOT_FOUND for a Run it does not have).
    Answered,
    /// The connection or the call failed before runtimed answered.
    Refused(String),
}

/// Connects to `addr` with `tls` (plaintext when `None`) and asks runtimed for the logs
/// of a Run it does not have: only runtimed's own NOT_FOUND counts as an answer.
async fn probe(addr: SocketAddr, tls: Option<ClientTlsConfig>) -> Result<Probe> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = tonic::transport::Endpoint::from_shared(format!("{scheme}://{addr}"))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10));
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls)?;
    }
    let channel = match endpoint.connect().await {
        Ok(channel) => channel,
        Err(error) => return Ok(Probe::Refused(format!("connect: {error:?}"))),
    };
    let request = RunLogsRequest {
        namespace: "default".into(),
        name: "no-such-run".into(),
        ..RunLogsRequest::default()
    };
    Ok(match RuntimedClient::new(channel).run_logs(request).await {
        // runtimed itself refuses a call without a bearer token.
        Err(status)
            if status.code() == tonic::Code::Unauthenticated
                && status.message().contains("no bearer token") =>
        {
            Probe::Answered
        }
        Err(status) => Probe::Refused(format!("{status:?}")),
        Ok(_) => bail!("runtimed streamed logs of a Run that does not exist"),
    })
}

/// Sends `Invoke` for a Run UID nobody has, with a (forged) authorization decision and a
/// token that is never reviewed (the Run is unknown), as the holder of `tls`'s certificate;
/// the status runtimed answers.
async fn invoke_as(addr: SocketAddr, tls: ClientTlsConfig, hops: u32) -> Result<tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))?
        .tls_config(tls)?
        .connect()
        .await?;
    let until = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis()
        + 10_000;
    let mut request = tonic::Request::new(kruntimes_proto::runtimed::v1::InvokeRequest {
        namespace: "default".into(),
        runtime: "python".into(),
        run_uid: "00000000-0000-0000-0000-000000000000".into(),
        invocation_id: "identity-probe".into(),
        payload: b"{}".to_vec(),
        hops,
        ..Default::default()
    });
    request
        .metadata_mut()
        .insert("x-kruntimes-authorized-until", until.to_string().parse()?);
    request
        .metadata_mut()
        .insert("authorization", "Bearer some-token".parse()?);
    match RuntimedClient::new(channel).invoke(request).await {
        Ok(answer) => bail!("runtimed invoked a Run nobody has: {answer:?}"),
        Err(status) => Ok(status),
    }
}

/// The worker identity of Pod `pod` in `namespace`, as docs/task-mode.md gives it: what a
/// worker's certificate is issued for and what its clients verify it as.
fn worker_identity(namespace: &str, pod: &str) -> String {
    format!("{pod}.{namespace}.kruntimes-worker")
}

/// A client TLS configuration that trusts `ca_pem`, verifies the server as `name`, and
/// presents `identity` when given.
fn client_tls(ca_pem: &str, name: &str, identity: Option<&WorkloadCert>) -> ClientTlsConfig {
    let config = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name(name);
    match identity {
        Some(cert) => config.identity(Identity::from_pem(&cert.cert_pem, &cert.key_pem)),
        None => config,
    }
}

/// Fails unless `probe` was refused; says why it was, for whoever reads the test output.
fn expect_refused(what: &str, probe: Probe) -> Result<()> {
    match probe {
        Probe::Refused(why) => {
            eprintln!("{what}: refused as expected ({why})");
            Ok(())
        }
        Probe::Answered => bail!("{what}: runtimed answered"),
    }
}

fn mode(path: &Path) -> Result<u32> {
    Ok(std::fs::metadata(path)
        .with_context(|| format!("stat {}", path.display()))?
        .permissions()
        .mode()
        & 0o777)
}

#[tokio::test]
async fn invocations_cross_mutual_tls_from_the_gateway_and_between_workers() -> Result<()> {
    // Service routing: the gateway calls either worker, and the one that does not own the
    // function forwards to the owner, so both hops run over mutual TLS.
    let mut options = Options::full();
    options.extra_args = vec!["--invoke-routing".into(), "service".into()];
    let (server, client) = Server::start_async(options).await?;
    create_runtime(&client, "pair", "python", 2, 4).await?;
    let workers = worker_pods(&client, "pair").await?;
    ensure!(workers.len() == 2, "two ready workers: {workers:?}");
    for pod in &workers {
        let cmdline = runtimed_cmdline(&pod.name_any())?;
        for flag in ["--tls-cert", "--tls-key", "--tls-ca"] {
            ensure!(
                cmdline.contains(flag),
                "runtimed runs with {flag}: {cmdline}"
            );
        }
        let log = server
            .data_dir()
            .join("workers")
            .join(pod.name_any())
            .join("runtimed.log");
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        ensure!(
            !log.contains("without TLS"),
            "runtimed warned that it runs without TLS: {log}"
        );
    }

    let mut spec = python("def handle(event):\n    return {\"got\": event}\n");
    spec.runtime = "pair".into();
    create(&client, "secured", spec).await?;
    let run = wait_ready(&client, "secured").await?;
    let owner = run
        .status
        .as_ref()
        .and_then(|s| s.assigned_pod.clone())
        .context("a Ready function has an owner")?;
    let fe = endpoint(&server, &run)?;
    let mut hops = BTreeSet::new();
    for i in 0..4 {
        let answer = fe.invoke_json(&format!("tls-{i}"), json!(i)).await?;
        ensure!(answer.status == 200, "{answer:?}");
        ensure!(answer.body["outcome"] == "Succeeded", "{answer:?}");
        ensure!(answer.body["result"] == json!({"got": i}), "{answer:?}");
        ensure!(
            answer.served_by.as_deref() == Some(owner.as_str()),
            "{answer:?}"
        );
        hops.insert(answer.hops.clone().unwrap_or_default());
    }
    ensure!(
        hops.contains("0") && hops.contains("1"),
        "calls reached the owner directly and through the other worker: {hops:?}"
    );
    Ok(())
}

#[tokio::test]
async fn a_worker_port_admits_only_clients_with_a_certificate_of_the_cluster_ca() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    let pods = worker_pods(&client, "python").await?;
    let pod = pods.first().context("a ready python worker")?;
    let name = pod.name_any();
    let identity = worker_identity("default", &name);
    let addr = runtimed_addr(pod)?;
    let pki = server.data_dir().join("pki");
    let ca_pem = std::fs::read_to_string(pki.join("ca.crt"))?;

    // The worker's material: DIR/tls/{tls.crt,tls.key,ca.crt}, the key private, the CA the
    // data directory's; runtimed reads them from there and never logs the key.
    let dir = server.data_dir().join("workers").join(&name);
    let tls_dir = dir.join("tls");
    let (cert, key, ca) = (
        tls_dir.join("tls.crt"),
        tls_dir.join("tls.key"),
        tls_dir.join("ca.crt"),
    );
    for file in [&cert, &key, &ca] {
        ensure!(file.is_file(), "{} exists", file.display());
    }
    ensure!(
        mode(&key)? == 0o600,
        "the key is 0600, not {:o}",
        mode(&key)?
    );
    ensure!(mode(&tls_dir)? == 0o700, "{:o}", mode(&tls_dir)?);
    ensure!(
        std::fs::read_to_string(&ca)? == ca_pem,
        "the worker trusts the data directory's CA"
    );
    let cmdline = runtimed_cmdline(&name)?;
    ensure!(
        cmdline.contains(&format!("--tls-key {}", key.display())),
        "{cmdline}"
    );
    let key_pem = std::fs::read_to_string(&key)?;
    let key_line = key_pem
        .lines()
        .find(|line| !line.starts_with("-----") && line.len() > 16)
        .context("a key body")?;
    for log in ["runtimed.log", "runtime-server.log"] {
        let text = std::fs::read_to_string(dir.join(log)).unwrap_or_default();
        ensure!(!text.contains(key_line), "{log} shows the key");
    }

    // A client with a certificate from the data directory's CA is answered by runtimed.
    let ours = issue_workload(&pki, "e2e-client", &[], VALIDITY)?;
    let accepted = probe(addr, Some(client_tls(&ca_pem, &identity, Some(&ours)))).await?;
    ensure!(matches!(accepted, Probe::Answered), "{accepted:?}");

    // Plaintext, TLS without a client certificate, and a certificate of another CA are
    // refused before runtimed answers.
    expect_refused("plaintext", probe(addr, None).await?)?;
    let anonymous = client_tls(&ca_pem, &identity, None);
    expect_refused("no client certificate", probe(addr, Some(anonymous)).await?)?;
    let stranger = tempfile::tempdir()?;
    kruntimes_apiserver::tls::prepare(stranger.path(), "127.0.0.1".parse()?)?;
    let foreign = issue_workload(stranger.path(), "e2e-client", &[], VALIDITY)?;
    let foreign = client_tls(&ca_pem, &identity, Some(&foreign));
    expect_refused(
        "a certificate of another CA",
        probe(addr, Some(foreign)).await?,
    )?;
    // The worker proves its workload identity, its namespace included: a client that
    // means another Pod, or the Pod of that name in another namespace, refuses it; so does
    // one that verifies the bare Pod name, which no worker certificate carries.
    for (what, mistaken) in [
        ("another Pod", worker_identity("default", "python-other")),
        (
            "the same Pod name in another namespace",
            worker_identity("other", &name),
        ),
        ("the bare Pod name", name.clone()),
    ] {
        let mistaken = client_tls(&ca_pem, &mistaken, Some(&ours));
        expect_refused(
            &format!("the worker as {what}"),
            probe(addr, Some(mistaken)).await?,
        )?;
    }

    // Invoke is taken only from the gateway (hops 0) or, forwarded, from a worker of this
    // Runtime (hops 1): any other certificate of the CA is refused (and every caller's
    // token is authorized besides: see the forged-decision test below).
    let as_client = client_tls(&ca_pem, &identity, Some(&ours));
    for hops in [0, 1] {
        let refused = invoke_as(addr, as_client.clone(), hops).await?;
        ensure!(
            refused.code() == tonic::Code::PermissionDenied,
            "an invocation from e2e-client with hops {hops}: {refused:?}"
        );
    }
    // A forwarder must be a worker of this Runtime in this namespace: a certificate of the
    // CA for the same Pod name in another namespace, or for the bare Pod name, is refused.
    for impostor in [worker_identity("other", &name), name.clone()] {
        let impostor_cert = issue_workload(&pki, &impostor, &[], VALIDITY)?;
        let refused = invoke_as(
            addr,
            client_tls(&ca_pem, &identity, Some(&impostor_cert)),
            1,
        )
        .await?;
        ensure!(
            refused.code() == tonic::Code::PermissionDenied,
            "a forwarded invocation from {impostor}: {refused:?}"
        );
    }
    let gateway = issue_workload(&pki, "kruntimes-gateway", &[], VALIDITY)?;
    let past_identity = invoke_as(addr, client_tls(&ca_pem, &identity, Some(&gateway)), 0).await?;
    ensure!(
        past_identity.code() == tonic::Code::NotFound,
        "the gateway's identity gets past the check to the unknown Run: {past_identity:?}"
    );

    // The material goes with the incarnation; the logs stay.
    Api::<kruntimes_api::Runtime>::namespaced(client.clone(), "default")
        .patch(
            "python",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 0}})),
        )
        .await?;
    within(
        DEADLINE,
        "the stopped worker's TLS material is removed",
        async {
            while tls_dir.exists() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(())
        },
    )
    .await?;
    ensure!(dir.join("runtimed.log").is_file(), "the logs stay");
    Ok(())
}

/// A session Run of `runtime`.
fn session_spec(runtime: &str) -> kruntimes_api::RunSpec {
    let mut spec = kruntimes_api::RunSpec::task(runtime, "unused");
    spec.mode = kruntimes_api::run::RunMode {
        session: Some(kruntimes_api::run::SessionMode::default()),
        ..kruntimes_api::run::RunMode::default()
    };
    spec
}

/// Issues a token for user `user` (an AccessToken) with the admin client.
async fn user_token(admin: &Client, user: &str) -> Result<String> {
    use kube::api::{ApiResource, DynamicObject, PostParams};
    let gvk = kube::api::GroupVersionKind::gvk("auth.kruntimes.io", "v1alpha1", "AccessToken");
    let tokens = Api::<DynamicObject>::all_with(
        admin.clone(),
        &ApiResource::from_gvk_with_plural(&gvk, "accesstokens"),
    );
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "auth.kruntimes.io/v1alpha1",
        "kind": "AccessToken",
        "metadata": {},
        "spec": {"user": {"username": user, "groups": []}},
    }))?;
    let created = tokens.create(&PostParams::default(), &object).await?;
    Ok(created.data["status"]["token"]
        .as_str()
        .context("the AccessToken has no status.token")?
        .to_string())
}

/// What a call to runtimed carries besides its message.
#[derive(Clone, Copy, Debug)]
enum Credential<'a> {
    /// Only a forged decision, no token.
    ForgedOnly,
    /// A forged decision and this token.
    Token(&'a str),
}

/// `message` as a call with a forged `x-kruntimes-authorized-until` (10 s ahead, what the
/// gateway used to send and runtimed used to trust) and, maybe, a token.
fn forged<T>(message: T, credential: Credential<'_>) -> Result<tonic::Request<T>> {
    let until = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis()
        + 10_000;
    let mut request = tonic::Request::new(message);
    let metadata = request.metadata_mut();
    metadata.insert("x-kruntimes-authorized-until", until.to_string().parse()?);
    if let Credential::Token(token) = credential {
        metadata.insert("authorization", format!("Bearer {token}").parse()?);
    }
    Ok(request)
}

/// The worker of `run`: its Pod name, Pod UID, attempt and runtimed address.
async fn owner_of(
    client: &Client,
    run: &kruntimes_api::Run,
) -> Result<(String, String, u32, SocketAddr)> {
    let status = run.status.clone().unwrap_or_default();
    let pod_name = status.assigned_pod.context("an assigned Pod")?;
    let pod_uid = status.assigned_pod_uid.context("an assigned Pod UID")?;
    let attempt = u32::try_from(status.attempt.unwrap_or(1))?;
    let pod = Api::<Pod>::namespaced(client.clone(), "default")
        .get(&pod_name)
        .await?;
    Ok((pod_name, pod_uid, attempt, runtimed_addr(&pod)?))
}

/// Regression (issue 15 item 4): runtimed took any `x-kruntimes-authorized-until` at most
/// 31 s ahead from a caller with the gateway's or a worker's certificate, bound to neither
/// the token nor the Run. Now every call is authorized with the caller's token for the
/// exact Run: with the gateway's own certificate, a forged decision without a token, with
/// an unknown token or with the token of a user who may not get the Run is refused on
/// every call (invoke, the session calls, files, logs), and so is a forwarded call from a
/// worker's certificate. The admin's token still gets through, so the refusals are the
/// token's.
#[tokio::test]
async fn a_forged_authorization_decision_is_refused_on_every_runtimed_call() -> Result<()> {
    use kruntimes_proto::runtimed::v1 as pb;

    let (server, client) = Server::start_async(Options::full()).await?;
    create_runtime(&client, "solo", "bash", 1, 2).await?;
    create(
        &client,
        "forged-fn",
        python("def handle(event):\n    return {\"got\": event}\n"),
    )
    .await?;
    create(&client, "forged-session", session_spec("solo")).await?;
    let function = wait_ready(&client, "forged-fn").await?;
    let session = wait_ready(&client, "forged-session").await?;
    let function_uid = function.uid().context("uid")?;
    let session_uid = session.uid().context("uid")?;
    let (fn_pod, fn_pod_uid, fn_attempt, fn_addr) = owner_of(&client, &function).await?;
    let (_, _, _, session_addr) = owner_of(&client, &session).await?;

    let pki = server.data_dir().join("pki");
    let ca_pem = std::fs::read_to_string(pki.join("ca.crt"))?;
    let gateway = issue_workload(&pki, "kruntimes-gateway", &[], VALIDITY)?;
    let connect = |addr: SocketAddr, server_name: String, identity: WorkloadCert| {
        let ca_pem = ca_pem.clone();
        async move {
            let channel = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))?
                .tls_config(client_tls(&ca_pem, &server_name, Some(&identity)))?
                .timeout(Duration::from_secs(30))
                .connect()
                .await?;
            Ok::<_, anyhow::Error>(RuntimedClient::new(channel))
        }
    };
    let mut to_function = connect(
        fn_addr,
        worker_identity("default", &fn_pod),
        gateway.clone(),
    )
    .await?;
    let session_pod = session
        .status
        .as_ref()
        .and_then(|s| s.assigned_pod.clone())
        .context("an assigned Pod")?;
    let mut to_session = connect(
        session_addr,
        worker_identity("default", &session_pod),
        gateway,
    )
    .await?;

    let admin_token = kruntimes_testkit::admin_token(&server.kubeconfig_path())?;
    let mallory = user_token(&client, "mallory").await?;
    let route = |hops| pb::SessionRoute {
        namespace: "default".into(),
        runtime: "solo".into(),
        run_uid: session_uid.clone(),
        hops,
        ..pb::SessionRoute::default()
    };
    let invoke = |hops, expected_attempt, expected_pod_uid: &str| pb::InvokeRequest {
        namespace: "default".into(),
        runtime: "python".into(),
        run_uid: function_uid.clone(),
        invocation_id: format!("forged-{hops}"),
        payload: b"1".to_vec(),
        hops,
        expected_attempt,
        expected_pod_uid: expected_pod_uid.to_string(),
        ..pb::InvokeRequest::default()
    };

    for (credential, expected) in [
        (Credential::ForgedOnly, tonic::Code::Unauthenticated),
        (
            Credential::Token("forged-token"),
            tonic::Code::Unauthenticated,
        ),
        (Credential::Token(&mallory), tonic::Code::PermissionDenied),
    ] {
        let mut answers: Vec<(&str, Result<(), tonic::Status>)> = Vec::new();
        answers.push((
            "Invoke",
            to_function
                .invoke(forged(invoke(0, 0, ""), credential)?)
                .await
                .map(drop),
        ));
        answers.push((
            "GetSession",
            to_session
                .get_session(forged(route(0), credential)?)
                .await
                .map(drop),
        ));
        answers.push((
            "RenewSessionLease",
            to_session
                .renew_session_lease(forged(route(0), credential)?)
                .await
                .map(drop),
        ));
        let operation = kruntimes_proto::runtime::v1::SessionOperationRequest {
            operation_id: "forged-op".into(),
            ..Default::default()
        };
        answers.push((
            "SendOperation",
            to_session
                .send_operation(forged(
                    pb::SendOperationRequest {
                        route: Some(route(0)),
                        operation: Some(operation),
                    },
                    credential,
                )?)
                .await
                .map(drop),
        ));
        answers.push((
            "CancelOperation",
            to_session
                .cancel_operation(forged(
                    pb::CancelOperationRequest {
                        route: Some(route(0)),
                        operation_id: "forged-op".into(),
                    },
                    credential,
                )?)
                .await
                .map(drop),
        ));
        answers.push((
            "ReadFile",
            to_session
                .read_file(forged(
                    pb::ReadFileRequest {
                        route: Some(route(0)),
                        path: "x".into(),
                    },
                    credential,
                )?)
                .await
                .map(drop),
        ));
        answers.push((
            "ListFiles",
            to_session
                .list_files(forged(
                    pb::ListFilesRequest {
                        route: Some(route(0)),
                        path: String::new(),
                        limit: 10,
                        page_token: String::new(),
                    },
                    credential,
                )?)
                .await
                .map(drop),
        ));
        answers.push((
            "RunLogs",
            to_session
                .run_logs(forged(
                    RunLogsRequest {
                        namespace: "default".into(),
                        name: "forged-session".into(),
                        ..RunLogsRequest::default()
                    },
                    credential,
                )?)
                .await
                .map(drop),
        ));
        for (call, answer) in answers {
            match answer {
                Err(status) if status.code() == expected => {}
                other => bail!("{call} with {credential:?}: expected {expected:?}, got {other:?}"),
            }
        }
    }

    // A forwarded call from a worker's certificate (the function's own worker identity,
    // hops 1, the expectations right) is authorized by the owner too.
    let fn_identity = worker_identity("default", &fn_pod);
    let worker = issue_workload(&pki, &fn_identity, &[], VALIDITY)?;
    let mut as_worker = connect(fn_addr, fn_identity, worker).await?;
    let refused = as_worker
        .invoke(forged(
            invoke(1, fn_attempt, &fn_pod_uid),
            Credential::ForgedOnly,
        )?)
        .await;
    ensure!(
        matches!(&refused, Err(status) if status.code() == tonic::Code::Unauthenticated),
        "a forwarded invocation with a forged decision: {refused:?}"
    );
    let refused = as_worker
        .invoke(forged(
            invoke(1, fn_attempt, &fn_pod_uid),
            Credential::Token(&mallory),
        )?)
        .await;
    ensure!(
        matches!(&refused, Err(status) if status.code() == tonic::Code::PermissionDenied),
        "a forwarded invocation with another user's token: {refused:?}"
    );

    // The admin's token is authorized: the same calls get through.
    let served = to_function
        .invoke(forged(invoke(0, 0, ""), Credential::Token(&admin_token))?)
        .await?
        .into_inner();
    ensure!(served.served_by == fn_pod, "{served:?}");
    let forwarded = as_worker
        .invoke(forged(
            invoke(1, fn_attempt, &fn_pod_uid),
            Credential::Token(&admin_token),
        )?)
        .await?
        .into_inner();
    ensure!(forwarded.hops == 1, "{forwarded:?}");
    let info = to_session
        .get_session(forged(route(0), Credential::Token(&admin_token))?)
        .await?
        .into_inner();
    ensure!(info.run_name == "forged-session", "{info:?}");
    Ok(())
}

/// The DER of the leaf certificate the runtimed at `addr` presents to a new connection,
/// verified as `name` against `ca_pem`, with `identity` as the client certificate.
async fn presented_leaf(
    addr: SocketAddr,
    name: &str,
    ca_pem: &str,
    identity: &WorkloadCert,
) -> Result<Vec<u8>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut ca_pem.as_bytes()) {
        roots.add(cert?)?;
    }
    let chain =
        rustls_pemfile::certs(&mut identity.cert_pem.as_bytes()).collect::<Result<Vec<_>, _>>()?;
    let key =
        rustls_pemfile::private_key(&mut identity.key_pem.as_bytes())?.context("a private key")?;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)?;
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let server_name = rustls::pki_types::ServerName::try_from(name.to_string())?;
    let stream = connector.connect(server_name, tcp).await?;
    Ok(stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.first())
        .context("no certificate presented")?
        .to_vec())
}

/// Issue 17 item 4: the certificate files of a running worker, rotated in place as the
/// kubelet updates a Secret volume, are picked up by its runtimed for the connections made
/// after the rotation (it reads them every 10 s), while invocations through the gateway,
/// on the connection opened before, go on without one failing.
#[tokio::test]
async fn a_rotated_worker_certificate_is_picked_up_without_a_failed_invocation() -> Result<()> {
    let (server, client) = Server::start_async(Options::full()).await?;
    create(
        &client,
        "rotating",
        python("def handle(event):\n    return event\n"),
    )
    .await?;
    let run = wait_ready(&client, "rotating").await?;
    let function = endpoint(&server, &run)?;
    let (pod, _, _, addr) = owner_of(&client, &run).await?;
    let identity = worker_identity("default", &pod);
    let pki = server.data_dir().join("pki");
    let ca_pem = std::fs::read_to_string(pki.join("ca.crt"))?;
    let caller = issue_workload(&pki, "e2e-client", &[], VALIDITY)?;
    let tls_dir = server.data_dir().join("workers").join(&pod).join("tls");
    let first = rustls_pemfile::certs(&mut std::fs::read(tls_dir.join("tls.crt"))?.as_slice())
        .next()
        .context("a certificate")??
        .to_vec();
    ensure!(presented_leaf(addr, &identity, &ca_pem, &caller).await? == first);
    let answer = function.invoke_json("before", json!({"n": 0})).await?;
    ensure!(answer.status == 200, "{} {}", answer.status, answer.body);

    // Invocations, one after another, for as long as the rotation takes.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let invocations = tokio::spawn(async move {
        let mut served = 0u32;
        while !*stopped.borrow() {
            let id = format!("during-{served}");
            let answer = function.invoke_json(&id, json!({"n": served})).await?;
            ensure!(
                answer.status == 200 && answer.body["result"]["n"] == served,
                "invocation {id} during the rotation: {} {}",
                answer.status,
                answer.body
            );
            served += 1;
        }
        Ok::<_, anyhow::Error>(served)
    });

    let staged = tempfile::tempdir()?;
    let ip = "127.0.0.1".parse()?;
    let next = issue_workload(&pki, &identity, &[ip], VALIDITY)?.write(staged.path())?;
    let rotated = rustls_pemfile::certs(&mut std::fs::read(&next.cert)?.as_slice())
        .next()
        .context("a certificate")??
        .to_vec();
    for (new, old) in [(&next.cert, "tls.crt"), (&next.key, "tls.key")] {
        std::fs::rename(new, tls_dir.join(old))?;
    }
    within(
        DEADLINE,
        "a new connection to runtimed sees the rotated certificate",
        async {
            loop {
                if presented_leaf(addr, &identity, &ca_pem, &caller).await? == rotated {
                    return Ok(());
                }
                // runtimed reads its files every 10 s; the condition is the handshake.
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        },
    )
    .await?;
    stop.send(true)?;
    let served = invocations.await??;
    ensure!(served > 0, "no invocation ran during the rotation");
    eprintln!("{served} invocations during the rotation, none failed");
    Ok(())
}
