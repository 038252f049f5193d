//! The layout of a log store: where the stdout and stderr of one attempt of a task Run are
//! kept when the worker writes them outside its disposable workspace (`kruntimes up` keeps
//! one store per data directory, `DATA_DIR/logs`; docs/task-mode.md, "Logs").
//!
//! ```text
//! STORE/<run-uid>/<attempt>/
//!   stdout.log
//!   stderr.log
//! ```
//!
//! Run UIDs are unique across namespaces, so the store is keyed by UID alone. The writer
//! (the runtime server) creates an attempt's directory when the attempt starts; the store's
//! keeper (`kruntimes up`) removes a Run's directory when the Run is deleted and the oldest
//! finished Runs' directories when the store outgrows its cap; readers (the gateway) only
//! read. This module only composes and checks paths: it does no I/O.

use std::path::{Path, PathBuf};

/// The file of an attempt's stdout.
pub const STDOUT_FILE: &str = "stdout.log";
/// The file of an attempt's stderr.
pub const STDERR_FILE: &str = "stderr.log";
/// The longest Run UID a store keeps.
pub const MAX_UID_BYTES: usize = 64;

/// Whether `uid` can name a directory of the store: 1 to 64 ASCII letters, digits and
/// hyphens (what the API server assigns), so that it never escapes the store.
pub fn is_store_uid(uid: &str) -> bool {
    !uid.is_empty()
        && uid.len() <= MAX_UID_BYTES
        && uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// `STORE/<run-uid>`, or `None` when `uid` is not a store UID ([`is_store_uid`]).
pub fn run_dir(store: &Path, uid: &str) -> Option<PathBuf> {
    is_store_uid(uid).then(|| store.join(uid))
}

/// `STORE/<run-uid>/<attempt>`, or `None` when `uid` is not a store UID or `attempt` is 0.
pub fn attempt_dir(store: &Path, uid: &str, attempt: u32) -> Option<PathBuf> {
    if attempt == 0 {
        return None;
    }
    run_dir(store, uid).map(|dir| dir.join(attempt.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_stay_inside_the_store() {
        let store = Path::new("/data/logs");
        assert_eq!(
            attempt_dir(store, "0c4e-77ab", 2),
            Some(PathBuf::from("/data/logs/0c4e-77ab/2"))
        );
        for bad in ["", "..", "a/b", "a.b", &"u".repeat(65), "ü"] {
            assert_eq!(run_dir(store, bad), None, "{bad:?}");
        }
        assert_eq!(attempt_dir(store, "u", 0), None);
    }
}
