//! URL paths of the Kubernetes API, parsed into what a request addresses.

use crate::resources::{self, ResourceDef};

/// What a path addresses.
#[derive(Debug)]
pub enum Route {
    Version,
    Health,
    Metrics,
    CoreVersions,
    Groups,
    Group(String),
    ResourceList { group: String, version: String },
    OpenApiV3Index,
    OpenApiV3 { group: String, version: String },
    OpenApiV2,
    Resource(ResourcePath),
}

/// A resource path: the collection, one object, or one object's subresource.
#[derive(Debug, Clone)]
pub struct ResourcePath {
    pub def: &'static ResourceDef,
    /// `None` for cluster-scoped kinds and for all-namespaces lists.
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub subresource: Option<String>,
}

/// Parses a request path; `None` when nothing is served there.
pub fn parse(path: &str) -> Option<Route> {
    let path = path.trim_end_matches('/');
    match path {
        "/version" => return Some(Route::Version),
        "/metrics" => return Some(Route::Metrics),
        "/readyz" | "/livez" | "/healthz" => return Some(Route::Health),
        "/api" => return Some(Route::CoreVersions),
        "/apis" => return Some(Route::Groups),
        "/openapi/v3" => return Some(Route::OpenApiV3Index),
        "/openapi/v2" => return Some(Route::OpenApiV2),
        _ => {}
    }
    if path.starts_with("/readyz/") || path.starts_with("/livez/") || path.starts_with("/healthz/")
    {
        return Some(Route::Health);
    }
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match segs.as_slice() {
        ["openapi", "v3", "api", version] => Some(Route::OpenApiV3 {
            group: String::new(),
            version: (*version).to_string(),
        }),
        ["openapi", "v3", "apis", group, version] => Some(Route::OpenApiV3 {
            group: (*group).to_string(),
            version: (*version).to_string(),
        }),
        ["api", "v1"] => Some(Route::ResourceList {
            group: String::new(),
            version: "v1".into(),
        }),
        ["api", "v1", rest @ ..] => resource_path("", "v1", rest).map(Route::Resource),
        ["apis", group] => {
            if resources::groups().iter().any(|(g, _)| g == group) {
                Some(Route::Group((*group).to_string()))
            } else {
                None
            }
        }
        ["apis", group, version] => {
            if resources::in_group(group, version).next().is_some() {
                Some(Route::ResourceList {
                    group: (*group).to_string(),
                    version: (*version).to_string(),
                })
            } else {
                None
            }
        }
        ["apis", group, version, rest @ ..] => {
            resource_path(group, version, rest).map(Route::Resource)
        }
        _ => None,
    }
}

fn resource_path(group: &str, version: &str, rest: &[&str]) -> Option<ResourcePath> {
    let owned = |s: &&str| (*s).to_string();
    // Namespaced form: namespaces/{ns}/{plural}[/{name}[/{sub}]], when {plural} is a
    // namespaced kind of this group; otherwise `namespaces` is the Namespace kind itself.
    if let ["namespaces", ns, plural, tail @ ..] = rest
        && let Some(def) = resources::find(group, version, plural)
        && def.namespaced
    {
        if ns.is_empty() {
            return None;
        }
        return match tail {
            [] => Some(ResourcePath {
                def,
                namespace: Some((*ns).to_string()),
                name: None,
                subresource: None,
            }),
            [name] => Some(ResourcePath {
                def,
                namespace: Some((*ns).to_string()),
                name: Some(owned(name)),
                subresource: None,
            }),
            [name, sub] => Some(ResourcePath {
                def,
                namespace: Some((*ns).to_string()),
                name: Some(owned(name)),
                subresource: Some(owned(sub)),
            }),
            _ => None,
        };
    }
    match rest {
        [plural] => Some(ResourcePath {
            def: resources::find(group, version, plural)?,
            namespace: None,
            name: None,
            subresource: None,
        }),
        [plural, name] => {
            let def = resources::find(group, version, plural)?;
            if def.namespaced {
                return None;
            }
            Some(ResourcePath {
                def,
                namespace: None,
                name: Some(owned(name)),
                subresource: None,
            })
        }
        [plural, name, sub] => {
            let def = resources::find(group, version, plural)?;
            if def.namespaced {
                return None;
            }
            Some(ResourcePath {
                def,
                namespace: None,
                name: Some(owned(name)),
                subresource: Some(owned(sub)),
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(path: &str) -> ResourcePath {
        match parse(path) {
            Some(Route::Resource(r)) => r,
            other => panic!("{path}: {other:?}"),
        }
    }

    #[test]
    fn resource_paths() {
        let r = res("/apis/kruntimes.io/v1alpha1/namespaces/default/runs/r1/status");
        assert_eq!(r.def.plural, "runs");
        assert_eq!(r.namespace.as_deref(), Some("default"));
        assert_eq!(r.name.as_deref(), Some("r1"));
        assert_eq!(r.subresource.as_deref(), Some("status"));
        let r = res("/apis/kruntimes.io/v1alpha1/runs");
        assert!(r.namespace.is_none() && r.name.is_none());
        let r = res("/api/v1/namespaces/team-a");
        assert_eq!(r.def.plural, "namespaces");
        assert_eq!(r.name.as_deref(), Some("team-a"));
        let r = res("/api/v1/namespaces/team-a/pods/p");
        assert_eq!(r.def.plural, "pods");
        let r = res("/api/v1/namespaces/team-a/status");
        assert_eq!(r.def.plural, "namespaces");
        assert_eq!(r.subresource.as_deref(), Some("status"));
        assert!(parse("/apis/kruntimes.io/v1alpha1/runs/r1").is_none());
        assert!(parse("/apis/nope/v1/things").is_none());
        assert!(matches!(
            parse("/apis/kruntimes.io/v1alpha1"),
            Some(Route::ResourceList { .. })
        ));
        assert!(matches!(
            parse("/openapi/v3/apis/kruntimes.io/v1alpha1"),
            Some(Route::OpenApiV3 { .. })
        ));
    }
}
