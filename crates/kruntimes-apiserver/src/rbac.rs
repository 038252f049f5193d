//! RBAC authorization, evaluated as Kubernetes does: default deny; ClusterRoleBindings grant
//! everywhere, RoleBindings grant in their namespace (through a Role of that namespace or a
//! ClusterRole); rules match on verbs, API groups, resources (with `resource/subresource`),
//! resource names and non-resource URLs. Members of `system:masters` may do anything.

use serde_json::{Value, json};

use crate::auth::Identity;
use crate::store::{Key, Snapshot};

/// What a request does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attributes {
    Resource {
        verb: String,
        group: String,
        resource: String,
        subresource: String,
        namespace: String,
        name: String,
    },
    NonResource {
        verb: String,
        path: String,
    },
}

/// The answer, with a reason for either outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    pub reason: String,
}

pub const MASTERS: &str = "system:masters";

fn strings(value: Option<&Value>) -> Vec<&str> {
    value
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn rule_allows(rule: &Value, attrs: &Attributes) -> bool {
    let verbs = strings(rule.get("verbs"));
    match attrs {
        Attributes::Resource {
            verb,
            group,
            resource,
            subresource,
            name,
            ..
        } => {
            let groups = strings(rule.get("apiGroups"));
            let resources = strings(rule.get("resources"));
            let names = strings(rule.get("resourceNames"));
            let combined = if subresource.is_empty() {
                resource.clone()
            } else {
                format!("{resource}/{subresource}")
            };
            let resource_match = resources.iter().any(|r| {
                *r == "*"
                    || *r == combined
                    || (!subresource.is_empty() && *r == format!("*/{subresource}"))
                    || (subresource.is_empty() && *r == resource)
                    || (!subresource.is_empty() && *r == format!("{resource}/*"))
            });
            (verbs.contains(&"*") || verbs.contains(&verb.as_str()))
                && (groups.contains(&"*") || groups.contains(&group.as_str()))
                && resource_match
                && (names.is_empty() || (!name.is_empty() && names.contains(&name.as_str())))
        }
        Attributes::NonResource { verb, path } => {
            let urls = strings(rule.get("nonResourceURLs"));
            (verbs.contains(&"*") || verbs.contains(&verb.as_str()))
                && urls.iter().any(|u| {
                    *u == "*"
                        || *u == path
                        || u.strip_suffix('*')
                            .is_some_and(|prefix| path.starts_with(prefix))
                })
        }
    }
}

fn subject_matches(subject: &Value, identity: &Identity, binding_namespace: &str) -> bool {
    let kind = subject.get("kind").and_then(Value::as_str).unwrap_or("");
    let name = subject.get("name").and_then(Value::as_str).unwrap_or("");
    match kind {
        "User" => identity.username == name,
        "Group" => identity.groups.iter().any(|g| g == name),
        "ServiceAccount" => {
            let ns = subject
                .get("namespace")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .unwrap_or(binding_namespace);
            identity.username == format!("system:serviceaccount:{ns}:{name}")
        }
        _ => false,
    }
}

/// The rules of the role a binding references; `None` when the reference does not resolve
/// (unknown kind, a Role from a ClusterRoleBinding, or a missing role).
fn resolve_role<'a>(
    snap: &'a Snapshot,
    role_ref: &Value,
    binding_namespace: &str,
) -> Option<Vec<&'a Value>> {
    let kind = role_ref.get("kind").and_then(Value::as_str).unwrap_or("");
    let name = role_ref.get("name").and_then(Value::as_str).unwrap_or("");
    let key = match kind {
        "ClusterRole" => Key {
            resource: "clusterroles.rbac.authorization.k8s.io".into(),
            namespace: String::new(),
            name: name.to_string(),
        },
        "Role" if !binding_namespace.is_empty() => Key {
            resource: "roles.rbac.authorization.k8s.io".into(),
            namespace: binding_namespace.to_string(),
            name: name.to_string(),
        },
        _ => return None,
    };
    let role = snap.objects.get(&key)?;
    Some(
        role.object
            .get("rules")
            .and_then(Value::as_array)
            .map(|rules| rules.iter().collect())
            .unwrap_or_default(),
    )
}

fn role_rules<'a>(snap: &'a Snapshot, role_ref: &Value, binding_namespace: &str) -> Vec<&'a Value> {
    resolve_role(snap, role_ref, binding_namespace).unwrap_or_default()
}

/// Every rule that applies to `identity` in `namespace` (cluster-wide rules included), with
/// the binding that grants it.
pub fn rules_for<'a>(
    snap: &'a Snapshot,
    identity: &Identity,
    namespace: &str,
) -> Vec<(String, &'a Value)> {
    let mut out = Vec::new();
    let scan = |resource: &str, ns: &str, out: &mut Vec<(String, &'a Value)>| {
        let lower = Key {
            resource: resource.into(),
            namespace: ns.to_string(),
            name: String::new(),
        };
        for (key, stored) in snap.objects.range(lower..) {
            if *key.resource != *resource || key.namespace != ns {
                break;
            }
            let binding = &stored.object;
            let bound = binding
                .get("subjects")
                .and_then(Value::as_array)
                .is_some_and(|subjects| subjects.iter().any(|s| subject_matches(s, identity, ns)));
            if !bound {
                continue;
            }
            let kind = if ns.is_empty() {
                "ClusterRoleBinding"
            } else {
                "RoleBinding"
            };
            let label = format!("{kind} \"{}\"", key.name);
            for rule in role_rules(snap, binding.get("roleRef").unwrap_or(&Value::Null), ns) {
                out.push((label.clone(), rule));
            }
        }
    };
    scan(
        "clusterrolebindings.rbac.authorization.k8s.io",
        "",
        &mut out,
    );
    if !namespace.is_empty() {
        scan(
            "rolebindings.rbac.authorization.k8s.io",
            namespace,
            &mut out,
        );
    }
    out
}

/// Decides whether `identity` may do `attrs`.
pub fn authorize(snap: &Snapshot, identity: &Identity, attrs: &Attributes) -> Decision {
    if identity.groups.iter().any(|g| g == MASTERS) {
        return Decision {
            allowed: true,
            reason: format!("member of {MASTERS}"),
        };
    }
    let namespace = match attrs {
        Attributes::Resource { namespace, .. } => namespace.as_str(),
        Attributes::NonResource { .. } => "",
    };
    for (granted_by, rule) in rules_for(snap, identity, namespace) {
        if rule_allows(rule, attrs) {
            return Decision {
                allowed: true,
                reason: format!("RBAC: allowed by {granted_by}"),
            };
        }
    }
    Decision {
        allowed: false,
        reason: String::new(),
    }
}

/// Splits a rule into the single permissions it grants (one verb, group, resource and
/// name each), which the granter must hold one by one.
fn atomic_permissions(rule: &Value, namespace: &str) -> Vec<Attributes> {
    let verbs = strings(rule.get("verbs"));
    let mut out = Vec::new();
    for url in strings(rule.get("nonResourceURLs")) {
        for verb in &verbs {
            out.push(Attributes::NonResource {
                verb: (*verb).to_string(),
                path: url.to_string(),
            });
        }
    }
    let names = strings(rule.get("resourceNames"));
    let names: Vec<&str> = if names.is_empty() { vec![""] } else { names };
    for group in strings(rule.get("apiGroups")) {
        for resource in strings(rule.get("resources")) {
            let (resource, subresource) = resource.split_once('/').unwrap_or((resource, ""));
            for verb in &verbs {
                for name in &names {
                    out.push(Attributes::Resource {
                        verb: (*verb).to_string(),
                        group: group.to_string(),
                        resource: resource.to_string(),
                        subresource: subresource.to_string(),
                        namespace: namespace.to_string(),
                        name: (*name).to_string(),
                    });
                }
            }
        }
    }
    out
}

/// Privilege-escalation prevention, as Kubernetes does it: a user may create or change a
/// Role or ClusterRole only with every permission it grants (or the `escalate` verb on it),
/// and a RoleBinding or ClusterRoleBinding only with every permission of the role it
/// references (or the `bind` verb on that role). Returns the first permission missing.
pub fn check_escalation(
    snap: &Snapshot,
    identity: &Identity,
    kind: &str,
    namespace: &str,
    object: &Value,
) -> Result<(), String> {
    let holds_verb = |verb: &str, resource: &str, name: &str| {
        authorize(
            snap,
            identity,
            &Attributes::Resource {
                verb: verb.into(),
                group: "rbac.authorization.k8s.io".into(),
                resource: resource.into(),
                subresource: String::new(),
                namespace: namespace.into(),
                name: name.into(),
            },
        )
        .allowed
    };
    let name = object
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    let rules: Vec<Value> = match kind {
        "Role" | "ClusterRole" => {
            let resource = if kind == "Role" {
                "roles"
            } else {
                "clusterroles"
            };
            if holds_verb("escalate", resource, name) {
                return Ok(());
            }
            object
                .get("rules")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default()
        }
        "RoleBinding" | "ClusterRoleBinding" => {
            let role_ref = object.get("roleRef").cloned().unwrap_or(Value::Null);
            let role_kind = role_ref.get("kind").and_then(Value::as_str).unwrap_or("");
            let role_name = role_ref.get("name").and_then(Value::as_str).unwrap_or("");
            let resource = if role_kind == "Role" {
                "roles"
            } else {
                "clusterroles"
            };
            if holds_verb("bind", resource, role_name) {
                return Ok(());
            }
            // Binding a role that does not exist (yet) would grant whatever it later holds.
            match resolve_role(snap, &role_ref, namespace) {
                Some(rules) => rules.into_iter().cloned().collect(),
                None => {
                    return Err(format!(
                        "{role_kind} \"{role_name}\" not found; only a user with the bind verb may bind a role that does not exist"
                    ));
                }
            }
        }
        _ => return Ok(()),
    };
    for rule in &rules {
        for permission in atomic_permissions(rule, namespace) {
            if !authorize(snap, identity, &permission).allowed {
                let held = match permission {
                    Attributes::Resource {
                        verb,
                        group,
                        resource,
                        subresource,
                        name,
                        ..
                    } => {
                        let resource = if subresource.is_empty() {
                            resource
                        } else {
                            format!("{resource}/{subresource}")
                        };
                        let names = if name.is_empty() {
                            String::new()
                        } else {
                            format!("\"{name}\"")
                        };
                        format!(
                            "APIGroups:[\"{group}\"], Resources:[\"{resource}\"], ResourceNames:[{names}], Verbs:[\"{verb}\"]"
                        )
                    }
                    Attributes::NonResource { verb, path } => {
                        format!("NonResourceURLs:[\"{path}\"], Verbs:[\"{verb}\"]")
                    }
                };
                return Err(format!(
                    "user \"{}\" is attempting to grant RBAC permissions not currently held: {{{held}}}",
                    identity.username
                ));
            }
        }
    }
    Ok(())
}

/// The `Forbidden` message Kubernetes writes.
pub fn forbidden_message(identity: &Identity, attrs: &Attributes) -> String {
    match attrs {
        Attributes::Resource {
            verb,
            group,
            resource,
            subresource,
            namespace,
            name,
        } => {
            let qualified = if group.is_empty() {
                resource.clone()
            } else {
                format!("{resource}.{group}")
            };
            let what = if name.is_empty() {
                qualified
            } else {
                format!("{qualified} \"{name}\"")
            };
            let resource_text = if subresource.is_empty() {
                format!("resource \"{resource}\"")
            } else {
                format!("resource \"{resource}/{subresource}\"")
            };
            let scope = if namespace.is_empty() {
                "at the cluster scope".to_string()
            } else {
                format!("in the namespace \"{namespace}\"")
            };
            format!(
                "{what} is forbidden: User \"{}\" cannot {verb} {resource_text} in API group \"{group}\" {scope}",
                identity.username
            )
        }
        Attributes::NonResource { verb, path } => format!(
            "forbidden: User \"{}\" cannot {verb} path \"{path}\"",
            identity.username
        ),
    }
}

/// A rule as JSON, for bootstrap objects.
pub fn rule(verbs: &[&str], groups: &[&str], resources: &[&str]) -> Value {
    json!({"verbs": verbs, "apiGroups": groups, "resources": resources})
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::store::Stored;

    fn put(snap: &mut Snapshot, resource: &str, ns: &str, name: &str, object: Value) {
        snap.objects.insert(
            Key {
                resource: Arc::from(resource),
                namespace: ns.into(),
                name: name.into(),
            },
            Stored {
                rv: 1,
                object: Arc::new(object),
            },
        );
    }

    fn res(verb: &str, resource: &str, sub: &str, ns: &str, name: &str) -> Attributes {
        Attributes::Resource {
            verb: verb.into(),
            group: "kruntimes.io".into(),
            resource: resource.into(),
            subresource: sub.into(),
            namespace: ns.into(),
            name: name.into(),
        }
    }

    fn user(name: &str, groups: &[&str]) -> Identity {
        Identity {
            username: name.into(),
            uid: String::new(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
        }
    }

    #[test]
    fn evaluates_roles_bindings_and_subresources() {
        let mut snap = Snapshot::default();
        put(
            &mut snap,
            "roles.rbac.authorization.k8s.io",
            "team",
            "reader",
            json!({
                "rules": [rule(&["get", "list"], &["kruntimes.io"], &["runs"]),
                          {"verbs": ["get"], "apiGroups": ["kruntimes.io"], "resources": ["runtimes"], "resourceNames": ["python"]}]
            }),
        );
        put(
            &mut snap,
            "rolebindings.rbac.authorization.k8s.io",
            "team",
            "sa-reader",
            json!({
                "subjects": [{"kind": "ServiceAccount", "name": "bot"}],
                "roleRef": {"kind": "Role", "name": "reader", "apiGroup": "rbac.authorization.k8s.io"}
            }),
        );
        put(
            &mut snap,
            "clusterroles.rbac.authorization.k8s.io",
            "",
            "status-writer",
            json!({
                "rules": [rule(&["update", "patch"], &["kruntimes.io"], &["runs/status"])]
            }),
        );
        put(
            &mut snap,
            "clusterrolebindings.rbac.authorization.k8s.io",
            "",
            "devs-status",
            json!({
                "subjects": [{"kind": "Group", "name": "devs"}],
                "roleRef": {"kind": "ClusterRole", "name": "status-writer"}
            }),
        );
        let bot = user(
            "system:serviceaccount:team:bot",
            &["system:serviceaccounts"],
        );
        let dev = user("alice", &["devs"]);
        let admin = user("root", &[MASTERS]);
        let cases = [
            (&bot, res("get", "runs", "", "team", "r1"), true),
            (&bot, res("list", "runs", "", "team", ""), true),
            (&bot, res("list", "runs", "", "other", ""), false),
            (&bot, res("delete", "runs", "", "team", "r1"), false),
            (&bot, res("get", "runs", "status", "team", "r1"), false),
            (&bot, res("get", "runtimes", "", "team", "python"), true),
            (&bot, res("get", "runtimes", "", "team", "bash"), false),
            (&bot, res("list", "runtimes", "", "team", ""), false),
            (&dev, res("patch", "runs", "status", "any", "r1"), true),
            (&dev, res("patch", "runs", "", "any", "r1"), false),
            (&admin, res("delete", "runs", "", "x", "y"), true),
        ];
        for (who, attrs, want) in cases {
            assert_eq!(
                authorize(&snap, who, &attrs).allowed,
                want,
                "{} {attrs:?}",
                who.username
            );
        }
    }

    #[test]
    fn non_resource_urls_match_exactly_or_by_prefix() {
        let mut snap = Snapshot::default();
        put(
            &mut snap,
            "clusterroles.rbac.authorization.k8s.io",
            "",
            "disc",
            json!({
                "rules": [{"verbs": ["get"], "nonResourceURLs": ["/version", "/apis/*"]}]
            }),
        );
        put(
            &mut snap,
            "clusterrolebindings.rbac.authorization.k8s.io",
            "",
            "disc",
            json!({
                "subjects": [{"kind": "Group", "name": "system:authenticated"}],
                "roleRef": {"kind": "ClusterRole", "name": "disc"}
            }),
        );
        let u = user("u", &["system:authenticated"]);
        let nr = |verb: &str, path: &str| Attributes::NonResource {
            verb: verb.into(),
            path: path.into(),
        };
        assert!(authorize(&snap, &u, &nr("get", "/version")).allowed);
        assert!(authorize(&snap, &u, &nr("get", "/apis/kruntimes.io")).allowed);
        assert!(!authorize(&snap, &u, &nr("get", "/metrics")).allowed);
        assert!(!authorize(&snap, &u, &nr("post", "/version")).allowed);
    }

    #[test]
    fn nobody_grants_what_they_do_not_hold() {
        let mut snap = Snapshot::default();
        put(
            &mut snap,
            "clusterroles.rbac.authorization.k8s.io",
            "",
            "cluster-admin",
            json!({
                "rules": [rule(&["*"], &["*"], &["*"])]
            }),
        );
        put(
            &mut snap,
            "roles.rbac.authorization.k8s.io",
            "team",
            "rbac-editor",
            json!({
                "rules": [rule(&["create", "update", "get"], &["rbac.authorization.k8s.io"], &["roles", "rolebindings"]),
                          rule(&["get", "list"], &["kruntimes.io"], &["runs"])]
            }),
        );
        put(
            &mut snap,
            "rolebindings.rbac.authorization.k8s.io",
            "team",
            "lead",
            json!({
                "subjects": [{"kind": "User", "name": "lead"}],
                "roleRef": {"kind": "Role", "name": "rbac-editor"}
            }),
        );
        let lead = user("lead", &[]);
        let reader = json!({"metadata": {"name": "r"}, "rules": [rule(&["get"], &["kruntimes.io"], &["runs"])]});
        assert!(check_escalation(&snap, &lead, "Role", "team", &reader).is_ok());
        let writer = json!({"metadata": {"name": "w"}, "rules": [rule(&["delete"], &["kruntimes.io"], &["runs"])]});
        let refused =
            check_escalation(&snap, &lead, "Role", "team", &writer).expect_err("escalation");
        assert!(refused.contains("delete"), "{refused}");
        let bind_admin = json!({"metadata": {"name": "b"}, "roleRef": {"kind": "ClusterRole", "name": "cluster-admin"},
                                "subjects": [{"kind": "User", "name": "lead"}]});
        assert!(check_escalation(&snap, &lead, "RoleBinding", "team", &bind_admin).is_err());
        let admin = user("root", &[MASTERS]);
        assert!(check_escalation(&snap, &admin, "RoleBinding", "team", &bind_admin).is_ok());
        assert!(
            check_escalation(&snap, &lead, "Role", "other", &reader).is_err(),
            "no rights in another namespace"
        );
    }

    #[test]
    fn forbidden_messages_name_the_refusal() {
        let u = user("system:serviceaccount:a:b", &[]);
        assert_eq!(
            forbidden_message(&u, &res("list", "runs", "", "other", "")),
            "runs.kruntimes.io is forbidden: User \"system:serviceaccount:a:b\" cannot list resource \"runs\" in API group \"kruntimes.io\" in the namespace \"other\""
        );
    }
}
