//! The data directory of `kruntimes up`: the exclusive lock that keeps a second `kruntimes
//! up` away from it.
//!
//! `DATA_DIR/lock` holds an exclusive `flock` for the whole life of the process and the
//! holder's PID as its text. The kernel drops the lock when the process ends, however it
//! ends (SIGKILL included), so a lock that can be taken means that no earlier `kruntimes
//! up` of this directory still runs. The file itself is never removed: removing it would
//! let a second process lock a new file while the first still holds the old one.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// The lock file's name inside the data directory.
pub const LOCK_FILE: &str = "lock";

/// The most bytes of the lock file read to name the holder (a PID and a newline).
const MAX_LOCK_TEXT: u64 = 64;

/// Why the data directory could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("failed to create the data directory {path}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to open the lock file {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the data directory {dir} is in use by another kruntimes up ({holder}); stop it, or \
         start with another --data-dir"
    )]
    Held { dir: PathBuf, holder: String },
    #[error("failed to lock {path}")]
    Lock {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to write this process's PID into {path}")]
    WritePid {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The held lock of a data directory; dropping it (or the process ending) releases it.
#[derive(Debug)]
pub struct DataDirLock {
    _file: File,
}

/// Creates `dir` when missing and takes its exclusive lock at once (never waits), writing
/// this process's PID into `DATA_DIR/lock`. Fails with [`LockError::Held`], naming the
/// holder's PID, when another process holds it.
pub fn lock(dir: &Path) -> Result<DataDirLock, LockError> {
    std::fs::create_dir_all(dir).map_err(|source| LockError::CreateDir {
        path: dir.to_path_buf(),
        source,
    })?;
    let path = dir.join(LOCK_FILE);
    // Not truncated on open: the holder's PID must stay readable for the one refused.
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|source| LockError::Open {
            path: path.clone(),
            source,
        })?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            return Err(LockError::Held {
                dir: dir.to_path_buf(),
                holder: holder(&mut file),
            });
        }
        Err(TryLockError::Error(source)) => return Err(LockError::Lock { path, source }),
    }
    let pid = std::process::id();
    let written = file
        .set_len(0)
        .and_then(|()| file.seek(SeekFrom::Start(0)))
        .and_then(|_| writeln!(file, "{pid}"))
        .and_then(|()| file.sync_all());
    written.map_err(|source| LockError::WritePid { path, source })?;
    Ok(DataDirLock { _file: file })
}

/// Who holds the lock, as the lock file says: `PID n`, or why it cannot be told.
fn holder(file: &mut File) -> String {
    let mut text = String::new();
    match file.take(MAX_LOCK_TEXT).read_to_string(&mut text) {
        Ok(_) => match text.trim().parse::<u32>() {
            Ok(pid) => format!("PID {pid}"),
            // The holder locks before it writes its PID; it may be between the two.
            Err(_) => "PID not written yet".to_string(),
        },
        Err(error) => format!("PID unreadable: {error}"),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_of_the_same_directory_is_refused_naming_the_holder() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("data");
        let held = lock(&dir).unwrap();
        let text = std::fs::read_to_string(dir.join(LOCK_FILE)).unwrap();
        assert_eq!(text.trim(), std::process::id().to_string());
        // flock locks belong to the open file description, so a second open in this
        // process conflicts just as another process would.
        let error = lock(&dir).unwrap_err();
        let message = error.to_string();
        assert!(matches!(error, LockError::Held { .. }), "{message}");
        assert!(
            message.contains(&format!("PID {}", std::process::id())),
            "{message}"
        );
        // Refusing changed nothing: the holder's PID is still there.
        let after = std::fs::read_to_string(dir.join(LOCK_FILE)).unwrap();
        assert_eq!(after, text);
        drop(held);
        lock(&dir).unwrap();
    }
}
