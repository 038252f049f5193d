//! Lexical checks of what a session request names: workspace paths, operation IDs and a
//! command's environment overrides (`runtime.proto`, "SessionRuntime").
//!
//! Owns the rules a path must meet before it reaches the filesystem: '/'-separated,
//! relative, 1..=4096 bytes, every component 1..=255 bytes, no NUL, no empty, `.` or `..`
//! component. A path that passes is still resolved beneath the workspace by the kernel
//! (see [`super::files`]); this module never touches the filesystem and never decides
//! what a name means. Backslashes, percent signs and look-alike Unicode (fullwidth dots
//! and solidi, bidirectional marks, combining characters) are ordinary bytes of a name:
//! they cannot leave the workspace, because only '/' separates and only `..` ascends.
#![forbid(unsafe_code)]

use crate::ids;

/// The longest workspace path accepted, in bytes.
pub const MAX_PATH_BYTES: usize = 4096;
/// The longest component of a workspace path accepted, in bytes.
pub const MAX_COMPONENT_BYTES: usize = 255;
pub use kruntimes_api::lifecycle::MAX_OPERATION_ID_BYTES;
/// At most this many environment overrides per command.
pub const MAX_COMMAND_ENV: usize = 64;
/// The longest name of a command's environment variable.
pub const MAX_COMMAND_ENV_NAME_BYTES: usize = 256;
/// The longest value of a command's environment variable.
pub const MAX_COMMAND_ENV_VALUE_BYTES: usize = 8 * 1024;

/// Why a path, an operation ID or an environment override was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("{field} is empty")]
    Empty { field: &'static str },
    #[error("{field} is {len} bytes, more than {MAX_PATH_BYTES}")]
    TooLong { field: &'static str, len: usize },
    #[error("{field} {path:?} is absolute; paths are relative to the workspace")]
    Absolute { field: &'static str, path: String },
    #[error("{field} {path:?} contains NUL")]
    Nul { field: &'static str, path: String },
    #[error("{field} {path:?} has an empty component (a doubled or trailing '/')")]
    EmptyComponent { field: &'static str, path: String },
    #[error("{field} {path:?} has a '.' or '..' component")]
    DotComponent { field: &'static str, path: String },
    #[error("{field} {path:?} has a component longer than {MAX_COMPONENT_BYTES} bytes")]
    ComponentTooLong { field: &'static str, path: String },
    #[error("operation_id {0:?} is not 1 to {MAX_OPERATION_ID_BYTES} bytes of [A-Za-z0-9._-]")]
    OperationId(String),
    #[error("env: {0}")]
    Env(String),
}

/// Checks a workspace path. `allow_empty`: the empty path names the workspace itself
/// (ListSessionFiles only). `field` names the request field in the error.
pub fn validate_path(field: &'static str, path: &str, allow_empty: bool) -> Result<(), PathError> {
    if path.is_empty() {
        return if allow_empty {
            Ok(())
        } else {
            Err(PathError::Empty { field })
        };
    }
    if path.len() > MAX_PATH_BYTES {
        return Err(PathError::TooLong {
            field,
            len: path.len(),
        });
    }
    let shown = || ids::bounded(path);
    if path.contains('\0') {
        return Err(PathError::Nul {
            field,
            path: shown(),
        });
    }
    if path.starts_with('/') {
        return Err(PathError::Absolute {
            field,
            path: shown(),
        });
    }
    for component in path.split('/') {
        validate_component(component).map_err(|kind| match kind {
            ComponentError::Empty => PathError::EmptyComponent {
                field,
                path: shown(),
            },
            ComponentError::Dot => PathError::DotComponent {
                field,
                path: shown(),
            },
            ComponentError::TooLong => PathError::ComponentTooLong {
                field,
                path: shown(),
            },
        })?;
    }
    Ok(())
}

/// Why one component was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ComponentError {
    Empty,
    Dot,
    TooLong,
}

/// Checks one component (no '/' inside it is assumed; a caller that did not split on
/// '/' checks that itself).
pub(crate) fn validate_component(component: &str) -> Result<(), ComponentError> {
    if component.is_empty() {
        Err(ComponentError::Empty)
    } else if component == "." || component == ".." {
        Err(ComponentError::Dot)
    } else if component.len() > MAX_COMPONENT_BYTES {
        Err(ComponentError::TooLong)
    } else {
        Ok(())
    }
}

/// Whether `name` is one valid component: what a listing returns and a page token holds.
pub fn is_component(name: &str) -> bool {
    !name.contains('/') && !name.contains('\0') && validate_component(name).is_ok()
}

/// Joins a directory (validated, possibly empty) and a child's name.
pub fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_owned()
    } else {
        format!("{dir}/{name}")
    }
}

/// Checks an operation ID: 1..=128 bytes of `[A-Za-z0-9._-]`.
pub fn validate_operation_id(id: &str) -> Result<(), PathError> {
    if kruntimes_api::lifecycle::is_operation_id(id) {
        Ok(())
    } else {
        Err(PathError::OperationId(ids::bounded(id)))
    }
}

/// Checks a command's environment overrides: at most [`MAX_COMMAND_ENV`] variables, names
/// 1..=256 bytes of `[A-Za-z0-9_]` not starting with a digit or `KRUNTIME_`, values at most
/// [`MAX_COMMAND_ENV_VALUE_BYTES`] without NUL.
pub fn validate_command_env(env: &[(String, String)]) -> Result<(), PathError> {
    if env.len() > MAX_COMMAND_ENV {
        return Err(PathError::Env(format!(
            "more than {MAX_COMMAND_ENV} variables"
        )));
    }
    for (name, value) in env {
        let name_ok = !name.is_empty()
            && name.len() <= MAX_COMMAND_ENV_NAME_BYTES
            && !name.as_bytes()[0].is_ascii_digit()
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !name_ok {
            return Err(PathError::Env(format!(
                "name {:?} is not 1 to {MAX_COMMAND_ENV_NAME_BYTES} bytes of [A-Za-z0-9_] starting with a letter or '_'",
                ids::bounded(name)
            )));
        }
        if name.starts_with(crate::tasks::executor::RESERVED_ENV_PREFIX) {
            return Err(PathError::Env(format!(
                "{} is reserved (prefix {})",
                ids::bounded(name),
                crate::tasks::executor::RESERVED_ENV_PREFIX
            )));
        }
        if value.len() > MAX_COMMAND_ENV_VALUE_BYTES || value.contains('\0') {
            return Err(PathError::Env(format!(
                "the value of {name} is over {MAX_COMMAND_ENV_VALUE_BYTES} bytes or contains NUL"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn accepts_relative_paths_of_normal_components() {
        for ok in [
            "a",
            "a/b/c.txt",
            ".hidden",
            "...",
            "..a",
            "a..",
            "a\\..\\..\\etc",
            "\u{ff0e}\u{ff0e}",
            "\u{ff0e}\u{ff0e}\u{ff0f}x",
            "\u{202e}txt.exe",
            "e\u{301}",
            "%2e%2e",
            " ",
            "a b/c d",
        ] {
            assert!(validate_path("path", ok, false).is_ok(), "{ok:?}");
        }
        let deepest = vec!["a"; MAX_PATH_BYTES / 2].join("/");
        assert!(deepest.len() < MAX_PATH_BYTES);
        assert!(validate_path("path", &deepest, false).is_ok());
        let widest = "x".repeat(MAX_COMPONENT_BYTES);
        assert!(validate_path("path", &widest, false).is_ok());
        assert!(validate_path("path", &format!("{widest}/{widest}"), false).is_ok());
    }

    type Expect = fn(&PathError) -> bool;

    #[test]
    fn refuses_everything_else() {
        let cases: Vec<(String, Expect)> = vec![
            ("".into(), |e| matches!(e, PathError::Empty { .. })),
            ("/".into(), |e| matches!(e, PathError::Absolute { .. })),
            ("/etc/passwd".into(), |e| {
                matches!(e, PathError::Absolute { .. })
            }),
            ("//x".into(), |e| matches!(e, PathError::Absolute { .. })),
            ("..".into(), |e| matches!(e, PathError::DotComponent { .. })),
            ("../x".into(), |e| {
                matches!(e, PathError::DotComponent { .. })
            }),
            ("a/../../x".into(), |e| {
                matches!(e, PathError::DotComponent { .. })
            }),
            ("a/..".into(), |e| {
                matches!(e, PathError::DotComponent { .. })
            }),
            (".".into(), |e| matches!(e, PathError::DotComponent { .. })),
            ("./a".into(), |e| {
                matches!(e, PathError::DotComponent { .. })
            }),
            ("a/./b".into(), |e| {
                matches!(e, PathError::DotComponent { .. })
            }),
            ("a//b".into(), |e| {
                matches!(e, PathError::EmptyComponent { .. })
            }),
            ("a/".into(), |e| {
                matches!(e, PathError::EmptyComponent { .. })
            }),
            ("a\0b".into(), |e| matches!(e, PathError::Nul { .. })),
            ("\0".into(), |e| matches!(e, PathError::Nul { .. })),
            ("x".repeat(MAX_COMPONENT_BYTES + 1), |e| {
                matches!(e, PathError::ComponentTooLong { .. })
            }),
            // 128 three-byte characters: 384 bytes in one component.
            ("\u{ff0e}".repeat(128), |e| {
                matches!(e, PathError::ComponentTooLong { .. })
            }),
            (vec!["ab"; 1366].join("/"), |e| {
                matches!(e, PathError::TooLong { .. })
            }),
        ];
        for (path, expected) in cases {
            let err = validate_path("path", &path, false).unwrap_err();
            assert!(expected(&err), "{path:?}: {err:?}");
            // Messages stay bounded whatever the input.
            assert!(err.to_string().len() < 400, "{err}");
        }
        assert!(validate_path("path", "", true).is_ok());
        assert!(validate_path("path", "/", true).is_err());
    }

    #[test]
    fn path_length_bound_is_inclusive() {
        let mut path = vec!["a"; MAX_PATH_BYTES / 2].join("/");
        path.push_str("/b");
        assert_eq!(path.len(), MAX_PATH_BYTES + 1);
        assert!(validate_path("path", &path, false).is_err());
        path.truncate(MAX_PATH_BYTES);
        path.pop();
        path.push('c');
        assert_eq!(path.len(), MAX_PATH_BYTES);
        assert!(validate_path("path", &path, false).is_ok());
    }

    #[test]
    fn components() {
        assert!(is_component("a"));
        assert!(is_component("a\\b"));
        for bad in ["", ".", "..", "a/b", "a\0"] {
            assert!(!is_component(bad), "{bad:?}");
        }
        assert!(!is_component(&"x".repeat(256)));
        assert_eq!(join("", "a"), "a");
        assert_eq!(join("d/e", "a"), "d/e/a");
    }

    /// Every path that passes, assembled at random from hostile pieces, is relative and made
    /// only of normal components, as the standard library sees it too.
    #[test]
    fn accepted_random_paths_are_relative_and_normal() {
        use rand::Rng;
        let pieces = [
            "..", ".", "/", "//", "a", "b", "\\", "\0", "\u{ff0e}", "\u{ff0f}", "%2e", "\u{202e}",
            "\u{301}", " ", "...",
        ];
        let mut rng = rand::rng();
        let mut accepted = 0;
        for _ in 0..20_000 {
            let n = rng.random_range(1..8);
            let path: String = (0..n)
                .map(|_| pieces[rng.random_range(0..pieces.len())])
                .collect();
            if validate_path("path", &path, false).is_err() {
                continue;
            }
            accepted += 1;
            assert!(!path.starts_with('/') && !path.contains('\0'), "{path:?}");
            assert!(
                path.split('/')
                    .all(|c| !c.is_empty() && c != "." && c != ".."),
                "{path:?}"
            );
            assert!(
                std::path::Path::new(&path)
                    .components()
                    .all(|c| matches!(c, std::path::Component::Normal(_))),
                "{path:?}"
            );
        }
        assert!(accepted > 100, "{accepted}");
    }

    #[test]
    fn operation_ids() {
        for ok in ["op-1", "a", "A.b_c-9", &"x".repeat(128)] {
            assert!(validate_operation_id(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a b", "a/b", "ü", "op:1", &"x".repeat(129)] {
            assert!(validate_operation_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn command_env() {
        let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect()
        };
        assert!(validate_command_env(&env(&[("A", "1"), ("_b9", ""), ("PATH", "/x")])).is_ok());
        for bad in [
            env(&[("", "1")]),
            env(&[("9A", "1")]),
            env(&[("A-B", "1")]),
            env(&[("A=B", "1")]),
            env(&[("KRUNTIME_ARTIFACTS_DIR", "/tmp")]),
            env(&[("A", "x\0y")]),
        ] {
            assert!(validate_command_env(&bad).is_err(), "{bad:?}");
        }
        let long_value = vec![("A".to_owned(), "v".repeat(MAX_COMMAND_ENV_VALUE_BYTES + 1))];
        assert!(validate_command_env(&long_value).is_err());
        let long_name = vec![("A".repeat(MAX_COMMAND_ENV_NAME_BYTES + 1), String::new())];
        assert!(validate_command_env(&long_name).is_err());
        let many: Vec<(String, String)> = (0..=MAX_COMMAND_ENV)
            .map(|i| (format!("V{i}"), String::new()))
            .collect();
        assert!(validate_command_env(&many).is_err());
        assert!(validate_command_env(&many[..MAX_COMMAND_ENV]).is_ok());
    }
}
