//! Execution identities and the request inputs that become paths or process arguments.
//!
//! Owns the validation of everything untrusted that names a directory or a file: the Run
//! UID (a lowercase hyphenated UUID, so it can never be `..`, absolute or contain `/`), the
//! attempt (a number), and the relative paths of source files. It never touches the
//! filesystem.
#![forbid(unsafe_code)]

use std::fmt;
use std::path::{Component, Path};

/// The longest source file path accepted.
pub const MAX_SOURCE_PATH_BYTES: usize = 1024;
/// The longest command name accepted as an entrypoint.
pub const MAX_COMMAND_BYTES: usize = 256;

/// Why an identity or a path was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("run UID {0:?} is not a lowercase hyphenated UUID")]
    RunUid(String),
    #[error(
        "source path {0:?} is not a relative path of normal components (no '.', '..', empty or absolute parts), at most {MAX_SOURCE_PATH_BYTES} bytes"
    )]
    SourcePath(String),
    #[error("command {0:?} is not a program name: 1 to {MAX_COMMAND_BYTES} bytes, no '/', no NUL")]
    Command(String),
}

/// One attempt of one Run: the key of every execution.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ExecutionKey {
    run_uid: String,
    attempt: u32,
}

impl ExecutionKey {
    /// Validates `run_uid` (see [`validate_run_uid`]).
    pub fn new(run_uid: &str, attempt: u32) -> Result<Self, IdError> {
        validate_run_uid(run_uid)?;
        Ok(Self {
            run_uid: run_uid.to_owned(),
            attempt,
        })
    }

    pub fn run_uid(&self) -> &str {
        &self.run_uid
    }

    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// A single path component naming this execution (its cgroup), `<uid>-<attempt>`.
    pub fn component(&self) -> String {
        format!("{}-{}", self.run_uid, self.attempt)
    }
}

impl fmt::Display for ExecutionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.run_uid, self.attempt)
    }
}

/// Accepts exactly `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` in lowercase hex, the shape of a
/// Kubernetes `metadata.uid`.
pub fn validate_run_uid(uid: &str) -> Result<(), IdError> {
    let bytes = uid.as_bytes();
    let ok = bytes.len() == 36
        && bytes.iter().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => *b == b'-',
            _ => b.is_ascii_digit() || (b'a'..=b'f').contains(b),
        });
    if ok {
        Ok(())
    } else {
        Err(IdError::RunUid(bounded(uid)))
    }
}

/// Accepts a relative path made only of normal components, written with `/`.
pub fn validate_source_path(path: &str) -> Result<(), IdError> {
    let err = || IdError::SourcePath(bounded(path));
    if path.is_empty() || path.len() > MAX_SOURCE_PATH_BYTES || path.contains('\0') {
        return Err(err());
    }
    // Reject empty components (`a//b`, trailing `/`) and `.` that Path would normalise away.
    if path
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(err());
    }
    if Path::new(path)
        .components()
        .all(|c| matches!(c, Component::Normal(_)))
    {
        Ok(())
    } else {
        Err(err())
    }
}

/// Accepts a program name to look up on PATH.
pub fn validate_command(command: &str) -> Result<(), IdError> {
    if command.is_empty()
        || command.len() > MAX_COMMAND_BYTES
        || command.contains('/')
        || command.contains('\0')
    {
        return Err(IdError::Command(bounded(command)));
    }
    Ok(())
}

/// At most 80 bytes of untrusted text for an error message, cut on a char boundary.
pub fn bounded(s: &str) -> String {
    if s.len() <= 80 {
        return s.to_owned();
    }
    let mut end = 80;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn run_uids() {
        let cases = [
            ("2c24c1f0-9f8f-4f80-82d5-3dd16a12d1e6", true),
            ("00000000-0000-0000-0000-000000000000", true),
            ("2C24C1F0-9F8F-4F80-82D5-3DD16A12D1E6", false),
            ("2c24c1f0-9f8f-4f80-82d5-3dd16a12d1e", false),
            ("2c24c1f0-9f8f-4f80-82d5-3dd16a12d1e6x", false),
            ("2c24c1f0x9f8f-4f80-82d5-3dd16a12d1e6", false),
            ("../../../../../../../../../etc/pass", false),
            ("2c24c1f0-9f8f-4f80-82d5-3dd16a12d/e6", false),
            ("", false),
            ("..", false),
        ];
        for (uid, ok) in cases {
            assert_eq!(validate_run_uid(uid).is_ok(), ok, "{uid:?}");
        }
    }

    #[test]
    fn source_paths() {
        let cases = [
            ("main.py", true),
            ("pkg/mod.py", true),
            (".hidden", true),
            ("a/b/c/d.sh", true),
            ("", false),
            ("/etc/passwd", false),
            ("../x", false),
            ("a/../../x", false),
            ("./a", false),
            ("a/./b", false),
            ("a//b", false),
            ("a/", false),
            ("..", false),
            ("a\0b", false),
        ];
        for (path, ok) in cases {
            assert_eq!(validate_source_path(path).is_ok(), ok, "{path:?}");
        }
        assert!(validate_source_path(&"a".repeat(MAX_SOURCE_PATH_BYTES + 1)).is_err());
    }

    #[test]
    fn commands() {
        assert!(validate_command("python3").is_ok());
        assert!(validate_command("").is_err());
        assert!(validate_command("/bin/sh").is_err());
        assert!(validate_command("./x").is_err());
    }

    #[test]
    fn component_is_one_path_component() {
        let key = ExecutionKey::new("2c24c1f0-9f8f-4f80-82d5-3dd16a12d1e6", 3).unwrap();
        assert_eq!(key.component(), "2c24c1f0-9f8f-4f80-82d5-3dd16a12d1e6-3");
        assert_eq!(key.to_string(), "2c24c1f0-9f8f-4f80-82d5-3dd16a12d1e6/3");
    }
}
