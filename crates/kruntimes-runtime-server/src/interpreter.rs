//! Adapters and their interpreters, resolved once at startup.
//!
//! On the project's machines the `python3` first on PATH is a pyenv shim that costs about
//! 100 ms per start against about 10 ms for `/usr/bin/python3`, so resolution prefers the
//! system interpreter unless one is configured. Owns that choice; never starts a program.
#![forbid(unsafe_code)]

use std::fmt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// Which language a server runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adapter {
    Bash,
    Python,
}

impl Adapter {
    pub fn name(self) -> &'static str {
        match self {
            Adapter::Bash => "bash",
            Adapter::Python => "python",
        }
    }

    /// Command names that mean "this adapter's interpreter" in an entrypoint.
    pub fn interpreter_names(self) -> &'static [&'static str] {
        match self {
            Adapter::Bash => &["bash"],
            Adapter::Python => &["python", "python3"],
        }
    }

    /// Well-known absolute paths tried before PATH, in order.
    fn preferred(self) -> &'static [&'static str] {
        match self {
            Adapter::Bash => &["/bin/bash", "/usr/bin/bash"],
            Adapter::Python => &["/usr/bin/python3", "/usr/local/bin/python3"],
        }
    }

    fn path_name(self) -> &'static str {
        match self {
            Adapter::Bash => "bash",
            Adapter::Python => "python3",
        }
    }
}

impl fmt::Display for Adapter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Adapter {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "bash" => Ok(Adapter::Bash),
            "python" => Ok(Adapter::Python),
            other => Err(format!(
                "unknown adapter {other:?} (expected bash or python)"
            )),
        }
    }
}

/// Why no interpreter could be resolved.
#[derive(Debug, thiserror::Error)]
pub enum InterpreterError {
    #[error("configured interpreter {path} is not an executable file")]
    NotExecutable { path: PathBuf },
    #[error("no {adapter} interpreter found (tried {tried}, then PATH)")]
    NotFound { adapter: Adapter, tried: String },
}

/// Resolves the interpreter of `adapter`: `configured` if given (it must be an executable
/// file), else the first executable of the adapter's preferred paths, else the first match
/// on `path_var` that is not a pyenv-style shim, else any match on `path_var`.
pub fn resolve(
    adapter: Adapter,
    configured: Option<&Path>,
    path_var: Option<&str>,
) -> Result<PathBuf, InterpreterError> {
    if let Some(path) = configured {
        return if is_executable(path) {
            Ok(path.to_owned())
        } else {
            Err(InterpreterError::NotExecutable {
                path: path.to_owned(),
            })
        };
    }
    if let Some(found) = adapter
        .preferred()
        .iter()
        .map(Path::new)
        .find(|p| is_executable(p))
    {
        return Ok(found.to_owned());
    }
    let on_path: Vec<PathBuf> = path_var
        .unwrap_or_default()
        .split(':')
        .filter(|dir| dir.starts_with('/'))
        .map(|dir| Path::new(dir).join(adapter.path_name()))
        .filter(|p| is_executable(p))
        .collect();
    on_path
        .iter()
        .find(|p| !p.components().any(|c| c.as_os_str() == "shims"))
        .or(on_path.first())
        .cloned()
        .ok_or_else(|| InterpreterError::NotFound {
            adapter,
            tried: adapter.preferred().join(", "),
        })
}

fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn exe(dir: &Path, rel: &str) -> PathBuf {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[test]
    fn configured_wins_and_must_be_executable() {
        let dir = tempfile::tempdir().unwrap();
        let mine = exe(dir.path(), "my/python");
        assert_eq!(resolve(Adapter::Python, Some(&mine), None).unwrap(), mine);
        let plain = dir.path().join("plain");
        std::fs::write(&plain, "").unwrap();
        assert!(matches!(
            resolve(Adapter::Python, Some(&plain), None),
            Err(InterpreterError::NotExecutable { .. })
        ));
    }

    #[test]
    fn system_python_is_preferred_over_a_shim_on_path() {
        let dir = tempfile::tempdir().unwrap();
        let shims = dir.path().join(".pyenv/shims");
        exe(dir.path(), ".pyenv/shims/python3");
        let path_var = format!("{}:/usr/bin", shims.display());
        let got = resolve(Adapter::Python, None, Some(&path_var)).unwrap();
        if Path::new("/usr/bin/python3").exists() {
            assert_eq!(got, Path::new("/usr/bin/python3"));
        } else {
            assert_eq!(got, shims.join("python3"));
        }
    }

    #[test]
    fn path_search_skips_shims_when_it_can() {
        let dir = tempfile::tempdir().unwrap();
        exe(dir.path(), "shims/bash");
        let real = exe(dir.path(), "real/bash");
        let path_var = format!(
            "{}:{}",
            dir.path().join("shims").display(),
            dir.path().join("real").display()
        );
        // Only meaningful where no preferred bash exists; otherwise that one wins.
        let got = resolve(Adapter::Bash, None, Some(&path_var)).unwrap();
        assert!(
            got == real || Path::new("/bin/bash").exists() || Path::new("/usr/bin/bash").exists()
        );
    }

    #[test]
    fn adapters_parse() {
        assert_eq!("bash".parse::<Adapter>(), Ok(Adapter::Bash));
        assert_eq!("python".parse::<Adapter>(), Ok(Adapter::Python));
        assert!("ruby".parse::<Adapter>().is_err());
    }
}
