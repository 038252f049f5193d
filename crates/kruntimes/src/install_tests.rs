//! The Kustomize install (`deploy/`) against the command line it runs: every component's
//! arguments parse as `kruntimes` parses them, and the parts that name one another agree
//! (ports, probes, ServiceAccounts, Secrets, selectors, the gateway's DNS name).
//!
//! The manifests are rendered by the real `kubectl kustomize`, as `kubectl apply -k`
//! renders them; `scripts/validate-manifests.sh` validates the same render against the
//! Kubernetes schemas.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::Parser;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Container, PodTemplateSpec, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::Value;

use super::{Cli, Command};

/// The image the control-plane Deployments run (kustomize's `images:` sets its tag).
const CONTROL_PLANE_IMAGE: &str = "kruntimes/control-plane";

fn deploy_dir(part: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(part)
}

/// `kubectl kustomize DIR`, as objects.
fn render(part: &str) -> Vec<Value> {
    let out = std::process::Command::new("/usr/bin/kubectl")
        .arg("kustomize")
        .arg(deploy_dir(part))
        .output()
        .expect("run /usr/bin/kubectl kustomize");
    assert!(
        out.status.success(),
        "kubectl kustomize deploy/{part} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .collect()
}

fn of_kind<T: serde::de::DeserializeOwned>(objects: &[Value], kind: &str) -> Vec<T> {
    objects
        .iter()
        .filter(|o| o["kind"] == kind)
        .map(|o| serde_json::from_value(o.clone()).unwrap())
        .collect()
}

fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    assert!(
        selector.match_expressions.is_none(),
        "the install uses matchLabels only"
    );
    selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v))
}

fn pod_labels(template: &PodTemplateSpec) -> BTreeMap<String, String> {
    template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default()
}

/// The first container of `deployment`'s Pod template.
fn first_container(deployment: &Deployment) -> &Container {
    &deployment
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0]
}

fn container_port(container: &Container, port: &IntOrString) -> i32 {
    let ports = container.ports.iter().flatten();
    match port {
        IntOrString::Int(n) => {
            assert!(
                ports.clone().any(|p| p.container_port == *n),
                "{}: port {n} is not a container port",
                container.name
            );
            *n
        }
        IntOrString::String(name) => {
            ports
                .clone()
                .find(|p| p.name.as_deref() == Some(name))
                .unwrap_or_else(|| panic!("{}: no port named {name}", container.name))
                .container_port
        }
    }
}

/// The value of `--flag=VALUE` in `args`.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let prefix = format!("--{name}=");
    args.iter().find_map(|a| a.strip_prefix(&prefix))
}

/// The listening port of the address flag of the component `args` run.
fn listen_port(args: &[String]) -> i32 {
    let address = match args[0].as_str() {
        "gateway" => flag(args, "addr"),
        "controller-manager" => flag(args, "health-addr"),
        other => panic!("no listening address known for {other}"),
    }
    .unwrap_or_else(|| panic!("{} listens on its default loopback address", args[0]));
    let address: std::net::SocketAddr = address.parse().unwrap();
    assert!(
        address.ip().is_unspecified(),
        "{} listens on {address}: unreachable from outside its Pod",
        args[0]
    );
    i32::from(address.port())
}

/// A file the arguments name, as the volume and key that provide it.
fn file_source<'a>(
    deployment: &'a Deployment,
    container: &Container,
    file: &Path,
) -> (&'a k8s_openapi::api::core::v1::Volume, Option<String>) {
    let pod = deployment
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let mount = container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| file.starts_with(&m.mount_path))
        .unwrap_or_else(|| {
            panic!(
                "{}: nothing is mounted at {}",
                container.name,
                file.display()
            )
        });
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .unwrap_or_else(|| panic!("no volume {}", mount.name));
    let rest = file.strip_prefix(&mount.mount_path).unwrap();
    let key = (!rest.as_os_str().is_empty()).then(|| rest.to_string_lossy().into_owned());
    (volume, key)
}

/// Every control-plane container's arguments parse as the `kruntimes` command line parses
/// them, and every port, probe, file, ServiceAccount, Service, budget and policy of the
/// install names something the install has.
#[test]
fn the_install_runs_commands_that_parse_and_its_parts_agree() {
    let objects = render("");
    let deployments: Vec<Deployment> = of_kind(&objects, "Deployment");
    let services: Vec<Service> = of_kind(&objects, "Service");
    let budgets: Vec<PodDisruptionBudget> = of_kind(&objects, "PodDisruptionBudget");
    let policies: Vec<NetworkPolicy> = of_kind(&objects, "NetworkPolicy");
    let names = |kind: &str| -> Vec<(String, String)> {
        objects
            .iter()
            .filter(|o| o["kind"] == kind)
            .map(|o| {
                let namespace = o["metadata"]["namespace"].as_str().unwrap_or_default();
                let name = o["metadata"]["name"].as_str().unwrap();
                (namespace.to_owned(), name.to_owned())
            })
            .collect()
    };
    assert!(names("Namespace").contains(&(String::new(), "kruntimes-system".into())));
    let accounts = names("ServiceAccount");

    let mut components = BTreeMap::new();
    // (component, container port) of every control-plane container.
    for deployment in &deployments {
        let namespace = deployment.metadata.namespace.clone().unwrap();
        assert_eq!(namespace, "kruntimes-system");
        let spec = deployment.spec.as_ref().unwrap();
        assert!(selects(&spec.selector, &pod_labels(&spec.template)));
        assert!(
            spec.replicas.unwrap_or(1) >= 2,
            "{:?}: one replica leaves nothing through a disruption",
            deployment.metadata.name
        );
        let pod = spec.template.spec.as_ref().unwrap();
        let account = pod.service_account_name.clone().unwrap();
        assert!(
            accounts.contains(&(namespace.clone(), account.clone())),
            "ServiceAccount {namespace}/{account} is not in the install"
        );
        for container in &pod.containers {
            let image = container.image.as_deref().unwrap();
            assert!(image.starts_with(CONTROL_PLANE_IMAGE), "{image}");
            let args = container.args.clone().unwrap();
            let argv = std::iter::once("kruntimes".to_owned()).chain(args.iter().cloned());
            let parsed = Cli::try_parse_from(argv)
                .unwrap_or_else(|e| panic!("{}'s arguments do not parse: {e}", container.name));
            assert_eq!(flag(&args, "log-format"), Some("json"));
            match parsed.command {
                Command::Gateway(_) | Command::ControllerManager(_) => {}
                _ => panic!("{} runs {}", container.name, args[0]),
            }
            let port = listen_port(&args);
            for probe in [&container.liveness_probe, &container.readiness_probe] {
                let probe = probe
                    .as_ref()
                    .unwrap_or_else(|| panic!("{}: a probe is missing", container.name));
                let get = probe.http_get.as_ref().unwrap();
                assert_eq!(container_port(container, &get.port), port);
                let https = args[0] == "gateway";
                assert_eq!(
                    get.scheme.as_deref() == Some("HTTPS"),
                    https,
                    "{}",
                    container.name
                );
            }
            let security = container.security_context.as_ref().unwrap();
            assert_eq!(security.read_only_root_filesystem, Some(true));
            assert_eq!(security.allow_privilege_escalation, Some(false));
            for file_flag in ["data-dir", "tls-cert", "tls-key", "tls-ca", "gateway-ca"] {
                let Some(file) = flag(&args, file_flag) else {
                    continue;
                };
                let (volume, key) = file_source(deployment, container, Path::new(file));
                if let (Some(secret), Some(key)) = (&volume.secret, key) {
                    assert_eq!(secret.secret_name.as_deref(), Some("kruntimes-gateway-tls"));
                    if let Some(items) = &secret.items {
                        assert!(
                            items.iter().any(|i| i.key == key && i.path == key),
                            "--{file_flag}: the Secret volume does not project {key}"
                        );
                    } else {
                        assert!(["tls.crt", "tls.key", "ca.crt"].contains(&key.as_str()));
                    }
                } else {
                    assert!(volume.empty_dir.is_some(), "--{file_flag}: {volume:?}");
                }
            }
            components.insert(args[0].clone(), (pod_labels(&spec.template), port));
        }
    }
    assert_eq!(
        components.keys().collect::<Vec<_>>(),
        ["controller-manager", "gateway"]
    );

    // The gateway's Service reaches the gateway's port, and the controller-manager
    // publishes the Service's DNS name.
    let [service] = services.as_slice() else {
        panic!("one Service expected, got {}", services.len())
    };
    let service_spec = service.spec.as_ref().unwrap();
    let selected = BTreeMap::from_iter(service_spec.selector.clone().unwrap());
    let (gateway_labels, gateway_port) = &components["gateway"];
    assert!(
        selected
            .iter()
            .all(|(k, v)| gateway_labels.get(k) == Some(v))
    );
    let service_port = &service_spec.ports.as_ref().unwrap()[0];
    assert_eq!(service_port.port, 443);
    let gateway = deployments
        .iter()
        .find(|d| selects(&d.spec.as_ref().unwrap().selector, gateway_labels))
        .unwrap();
    let gateway_container = first_container(gateway);
    let target = service_port.target_port.as_ref().expect("a targetPort");
    assert_eq!(container_port(gateway_container, target), *gateway_port);
    let manager = deployments
        .iter()
        .find(|d| d.metadata.name.as_deref() == Some("kruntimes-controller-manager"))
        .unwrap();
    let manager_args = first_container(manager).args.clone().unwrap();
    let url = format!(
        "https://{}.{}.svc",
        service.metadata.name.as_deref().unwrap(),
        service.metadata.namespace.as_deref().unwrap()
    );
    assert_eq!(flag(&manager_args, "gateway-url"), Some(url.as_str()));
    let certificates = render("cert-manager");
    let gateway_certificate = certificates
        .iter()
        .find(|o| o["spec"]["secretName"] == "kruntimes-gateway-tls")
        .expect("the cert-manager part issues kruntimes-gateway-tls");
    assert!(
        gateway_certificate["spec"]["dnsNames"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| url.strip_prefix("https://") == n.as_str()),
        "the gateway's certificate does not name {url}"
    );

    // Each budget covers one component; each policy with a selector selects one, and the
    // ports it opens are that component's.
    for budget in &budgets {
        let selector = budget.spec.as_ref().unwrap().selector.as_ref().unwrap();
        assert_eq!(
            components
                .values()
                .filter(|(l, _)| selects(selector, l))
                .count(),
            1,
            "{:?}",
            budget.metadata.name
        );
    }
    let mut policed = 0;
    for policy in &policies {
        let spec = policy.spec.as_ref().unwrap();
        if spec
            .pod_selector
            .as_ref()
            .is_none_or(|s| s.match_labels.is_none())
        {
            continue;
        }
        let selector = spec.pod_selector.as_ref().unwrap();
        let (_, port) = components
            .values()
            .find(|(l, _)| selects(selector, l))
            .unwrap_or_else(|| panic!("{:?} selects no component", policy.metadata.name));
        for rule in spec.ingress.iter().flatten() {
            for p in rule.ports.iter().flatten() {
                assert_eq!(p.port, Some(IntOrString::Int(*port)));
            }
        }
        policed += 1;
    }
    assert_eq!(
        policed,
        components.len(),
        "a component has no NetworkPolicy of its own"
    );
}

/// The Dockerfile builds with the toolchain the workspace declares, and makes the image the
/// install runs.
#[test]
fn the_dockerfile_builds_what_the_install_runs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dockerfile = std::fs::read_to_string(root.join("Dockerfile")).unwrap();
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let rust_version = manifest
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .unwrap()
        .trim_matches('"');
    assert!(
        dockerfile.contains(&format!("FROM rust:{rust_version}-bookworm AS build")),
        "the Dockerfile's toolchain is not rust-version {rust_version}"
    );
    for stage in ["control-plane", "runtime"] {
        assert!(
            dockerfile.contains(&format!(" AS {stage}\n")),
            "no stage {stage}"
        );
    }
    assert!(dockerfile.contains(&format!("-t {CONTROL_PLANE_IMAGE}:")));
    let kustomization = std::fs::read_to_string(deploy_dir("kustomization.yaml")).unwrap();
    assert!(kustomization.contains(&format!("- name: {CONTROL_PLANE_IMAGE}\n")));
}
