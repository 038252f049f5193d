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
        Err(status)
            if status.code() == tonic::Code::NotFound
                && status.message().contains("no Run of that name") =>
        {
            Probe::Answered
        }
        Err(status) => Probe::Refused(format!("{status:?}")),
        Ok(_) => bail!("runtimed streamed logs of a Run that does not exist"),
    })
}

/// Sends `Invoke` for a Run UID nobody has, with a current authorization decision, as the
/// holder of `tls`'s certificate; the status runtimed answers.
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
    match RuntimedClient::new(channel).invoke(request).await {
        Ok(answer) => bail!("runtimed invoked a Run nobody has: {answer:?}"),
        Err(status) => Ok(status),
    }
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
    let accepted = probe(addr, Some(client_tls(&ca_pem, &name, Some(&ours)))).await?;
    ensure!(matches!(accepted, Probe::Answered), "{accepted:?}");

    // Plaintext, TLS without a client certificate, and a certificate of another CA are
    // refused before runtimed answers.
    expect_refused("plaintext", probe(addr, None).await?)?;
    let anonymous = client_tls(&ca_pem, &name, None);
    expect_refused("no client certificate", probe(addr, Some(anonymous)).await?)?;
    let stranger = tempfile::tempdir()?;
    kruntimes_apiserver::tls::prepare(stranger.path(), "127.0.0.1".parse()?)?;
    let foreign = issue_workload(stranger.path(), "e2e-client", &[], VALIDITY)?;
    let foreign = client_tls(&ca_pem, &name, Some(&foreign));
    expect_refused(
        "a certificate of another CA",
        probe(addr, Some(foreign)).await?,
    )?;
    // The worker proves its workload identity: a client that means another Pod refuses it.
    let mistaken = client_tls(&ca_pem, "python-other", Some(&ours));
    expect_refused(
        "the worker as another Pod",
        probe(addr, Some(mistaken)).await?,
    )?;

    // Invoke carries an authorization decision that runtimed reuses, so the port takes
    // it only from the gateway (hops 0) or, forwarded, from a worker of this Runtime
    // (hops 1): any other certificate of the CA is refused.
    let as_client = client_tls(&ca_pem, &name, Some(&ours));
    for hops in [0, 1] {
        let refused = invoke_as(addr, as_client.clone(), hops).await?;
        ensure!(
            refused.code() == tonic::Code::PermissionDenied,
            "an invocation from e2e-client with hops {hops}: {refused:?}"
        );
    }
    let gateway = issue_workload(&pki, "kruntimes-gateway", &[], VALIDITY)?;
    let past_identity = invoke_as(addr, client_tls(&ca_pem, &name, Some(&gateway)), 0).await?;
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
