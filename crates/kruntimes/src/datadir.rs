//! The data directory of `kruntimes up`: the exclusive lock that keeps a second `kruntimes
//! up` away from it, and the cleanup of what a dead incarnation left there.
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
        "the data directory {dir} is in use by another kruntimes process ({holder}); stop it, \
         or start with another --data-dir"
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
    lock_named(dir, LOCK_FILE)
}

/// [`lock`] on the lock file `name` of `dir`, for a part of the data directory that one
/// process at a time uses (`workers.lock`: the local provisioner's workers).
pub fn lock_named(dir: &Path, name: &str) -> Result<DataDirLock, LockError> {
    std::fs::create_dir_all(dir).map_err(|source| LockError::CreateDir {
        path: dir.to_path_buf(),
        source,
    })?;
    let path = dir.join(name);
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

/// What [`clean_leftovers`] found of a dead incarnation's workers.
#[derive(Debug, Default)]
pub struct Leftovers {
    /// Workspaces, outputs, sockets and TLS material removed.
    pub removed: Vec<PathBuf>,
    /// Empty cgroups of dead runtime servers removed.
    pub cgroups: Vec<PathBuf>,
    /// What could not be removed, and why.
    pub kept: Vec<(PathBuf, String)>,
    /// The orphaned sandbox processes killed (PID and name): gVisor sandboxes, and
    /// whatever was left in a dead runtime server's cgroup.
    pub killed: Vec<(u32, String)>,
}

/// Removes what the workers of an earlier, dead `kruntimes up` of `data_dir` left: under
/// each `DATA_DIR/workers/<pod>/`, everything in `root/` but the `*.log` files (the logs of
/// finished Runs stay readable), the socket and `tls/`; and the empty cgroup parent
/// (`kruntimes/rs-<hash of root>`) of its runtime server with the empty execution cgroups
/// in it. Cgroups are only ever `rmdir`ed: one that still holds a process stays, and is
/// reported in [`Leftovers::kept`].
///
/// Call it while holding the data directory's lock and before any worker starts: the lock
/// means that no earlier `kruntimes up` of the directory still runs, so every worker
/// directory there belongs to a dead incarnation (new incarnations get new names).
pub fn clean_leftovers(data_dir: &Path) -> Leftovers {
    let mut found = Leftovers::default();
    let Ok(workers) = std::fs::read_dir(data_dir.join("workers")) else {
        return found;
    };
    for worker in workers.flatten() {
        let dir = worker.path();
        if !dir.is_dir() {
            continue;
        }
        // The workers of a SIGKILLed `kruntimes up` outlive it for their drain (they see
        // their stdin close, not the signal), and under gvisor `runsc` keeps its state in
        // the root: a worker whose directory a live process still names is left to end
        // itself, and the next start cleans it.
        let naming = processes_naming(&dir);
        if let Some((pid, _)) = naming.iter().find(|(_, name)| !is_runsc(name)) {
            found
                .kept
                .push((dir.clone(), format!("process {pid} of it still runs")));
            continue;
        }
        // Only gVisor sandboxes left, their runtime server gone: one whose init was not
        // yet started when the `runsc run` starting it was killed with the rest waits for
        // ever (the others end when their init sees the server's lifeline close). Kill
        // them all; a sandbox is never shared between workers.
        if !naming.is_empty()
            && let Some(pid) = kill_sandboxes(&dir, &naming, &mut found)
        {
            found.kept.push((
                dir.clone(),
                format!("gVisor process {pid} of it did not end"),
            ));
            continue;
        }
        let root = dir.join("root");
        // The runtime server named its cgroup parent after its canonical root, so the name
        // is computed before the root's contents go.
        if let Ok(canonical) = root.canonicalize()
            && let Ok(parent) =
                kruntimes_runtime_server::sandbox::cgroup::default_parent_path(&canonical)
            && parent.is_dir()
        {
            if let Some(pid) = kill_cgroup(&parent, &mut found) {
                found.kept.push((
                    parent.clone(),
                    format!("sandbox process {pid} of it did not end"),
                ));
            }
            remove_cgroup_tree(&parent, &mut found);
        }
        if root.is_dir() {
            let before = found.removed.len();
            remove_all_but_logs(&root, &mut found);
            if found.removed.len() > before {
                // One entry for the root, not one per file.
                found.removed.truncate(before);
                found.removed.push(root.clone());
            }
        }
        for leftover in [dir.join("runtime.sock"), dir.join("tls")] {
            let removed = if leftover.is_dir() {
                std::fs::remove_dir_all(&leftover)
            } else {
                std::fs::remove_file(&leftover)
            };
            match removed {
                Ok(()) => found.removed.push(leftover),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => found.kept.push((leftover, error.to_string())),
            }
        }
    }
    found
}

/// The live processes whose command line names `dir` (a worker's runtime server, runtimed
/// or gVisor sandbox), with their names (`/proc/PID/comm`).
fn processes_naming(dir: &Path) -> Vec<(u32, String)> {
    let needle = dir.as_os_str().as_encoded_bytes();
    let own = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            if pid == own {
                return None;
            }
            // A zombie's command line reads empty: it is gone but for its exit status.
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            if !cmdline.windows(needle.len()).any(|w| w == needle) {
                return None;
            }
            let name = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            Some((pid, name.trim().to_owned()))
        })
        .collect()
}

/// Whether a process of this name is part of a gVisor sandbox (`runsc`, `runsc-sandbox`,
/// `runsc-gofer`).
fn is_runsc(name: &str) -> bool {
    name.starts_with("runsc")
}

/// How long killed sandbox processes get to end.
const SANDBOX_KILL_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// SIGKILLs `naming` (the gVisor processes of worker directory `dir`) and waits for them
/// to end; the PID of one that is still there at the deadline, if any.
fn kill_sandboxes(dir: &Path, naming: &[(u32, String)], found: &mut Leftovers) -> Option<u32> {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    for (pid, name) in naming {
        let Ok(raw) = i32::try_from(*pid) else {
            continue;
        };
        if kill(Pid::from_raw(raw), Signal::SIGKILL).is_ok() {
            found.killed.push((*pid, name.clone()));
        }
    }
    let deadline = std::time::Instant::now() + SANDBOX_KILL_WAIT;
    loop {
        let left = processes_naming(dir);
        let (pid, _) = left.first()?;
        if std::time::Instant::now() >= deadline {
            return Some(*pid);
        }
        // Nothing to wait on for processes that are not our children: look again shortly.
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// SIGKILLs every process left in the dead runtime server's cgroup `parent` (its
/// sandboxes' processes, whose command lines need not name the worker: a sandbox's PID 1
/// dies with its launcher, but the rest of its namespace may still be ending when this
/// start runs) through `cgroup.kill`, and waits for the cgroup to empty so that it can be
/// removed. The cgroup is named after this data directory's worker root, and the lock
/// says its server is dead, so nothing in it belongs to anyone else. Returns the PID of a
/// process still there at the deadline, if any (as text).
fn kill_cgroup(parent: &Path, found: &mut Leftovers) -> Option<String> {
    let cgroup = kruntimes_runtime_server::sandbox::cgroup::ExecCgroup::at(parent.to_path_buf());
    if !cgroup.populated().unwrap_or(false) {
        return None;
    }
    let names: Vec<(u32, String)> = cgroup
        .pids_beneath()
        .unwrap_or_default()
        .into_iter()
        .filter_map(|pid| u32::try_from(pid).ok())
        .map(|pid| {
            let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            (pid, name.trim().to_owned())
        })
        .collect();
    // The parent's `cgroup.kill` kills its whole subtree (without it, `kill_all` sweeps
    // the `cgroup.procs` of the subtree).
    if let Err(error) = cgroup.kill_all() {
        found.kept.push((parent.to_path_buf(), error.to_string()));
    }
    found.killed.extend(names);
    match cgroup.wait_empty_blocking(SANDBOX_KILL_WAIT) {
        Ok(true) => None,
        _ => {
            let left = cgroup.pids_beneath().unwrap_or_default();
            // Populated with no PID to name: a process between cgroups, or a zombie.
            Some(
                left.first()
                    .map_or_else(|| "(none listed)".to_string(), i32::to_string),
            )
        }
    }
}

/// Removes everything beneath `dir` but `*.log` files, and the directories left empty.
/// Returns whether `dir` itself is now empty.
fn remove_all_but_logs(dir: &Path, found: &mut Leftovers) -> bool {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) => {
            found.kept.push((dir.to_path_buf(), error.to_string()));
            return false;
        }
    };
    let mut empty = true;
    for entry in entries.flatten() {
        let path = entry.path();
        // Not followed: a symlink is removed as a link, whatever it points to.
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if is_dir {
            if remove_all_but_logs(&path, found) {
                match std::fs::remove_dir(&path) {
                    Ok(()) => found.removed.push(path),
                    Err(error) => {
                        found.kept.push((path, error.to_string()));
                        empty = false;
                    }
                }
            } else {
                empty = false;
            }
        } else if path.extension().is_some_and(|e| e == "log") {
            empty = false;
        } else {
            match std::fs::remove_file(&path) {
                Ok(()) => found.removed.push(path),
                Err(error) => {
                    found.kept.push((path, error.to_string()));
                    empty = false;
                }
            }
        }
    }
    empty
}

/// `rmdir`s the cgroup `dir` after its child cgroups, deepest first; a cgroup that still
/// holds a process (or a child that does) stays.
fn remove_cgroup_tree(dir: &Path, found: &mut Leftovers) {
    if let Ok(children) = std::fs::read_dir(dir) {
        for child in children.flatten() {
            if child.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup_tree(&child.path(), found);
            }
        }
    }
    match std::fs::remove_dir(dir) {
        Ok(()) => found.cgroups.push(dir.to_path_buf()),
        Err(error) => found.kept.push((dir.to_path_buf(), error.to_string())),
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

    #[test]
    fn leftovers_go_but_the_logs_of_finished_runs_stay() {
        let tmp = tempfile::tempdir().unwrap();
        let worker = tmp.path().join("workers").join("bash-abcde");
        let attempt = worker.join("root").join("uid-1").join("1");
        std::fs::create_dir_all(attempt.join("work").join("deep")).unwrap();
        std::fs::write(attempt.join("work").join("deep").join("f"), "x").unwrap();
        std::fs::write(attempt.join("outputs"), "a=b").unwrap();
        std::fs::write(attempt.join("stdout.log"), "out").unwrap();
        std::fs::create_dir_all(worker.join("tls")).unwrap();
        std::fs::write(worker.join("runtime.sock"), "").unwrap();
        std::fs::write(worker.join("runtimed.log"), "kept").unwrap();
        let found = clean_leftovers(tmp.path());
        assert!(found.kept.is_empty(), "{:?}", found.kept);
        assert!(found.removed.contains(&worker.join("root")), "{found:?}");
        assert!(!attempt.join("work").exists());
        assert!(!attempt.join("outputs").exists());
        assert!(!worker.join("tls").exists() && !worker.join("runtime.sock").exists());
        assert_eq!(
            std::fs::read_to_string(attempt.join("stdout.log")).unwrap(),
            "out"
        );
        assert!(worker.join("runtimed.log").exists());
        // Nothing left: a second start removes nothing.
        let again = clean_leftovers(tmp.path());
        assert!(
            again.removed.is_empty() && again.kept.is_empty(),
            "{again:?}"
        );
    }

    /// A shell that waits on its standard input (a pipe the test holds), named `name`
    /// (its `comm` is the name it was executed by: a symlink to `/bin/sh`) and with `dir`
    /// on its command line. Not a copy: a copy's write descriptor, inherited by a child
    /// another test forks meanwhile, made its exec fail with ETXTBSY now and then.
    ///
    /// Returned once the shell has said it runs: `spawn` returns when the child has let go
    /// of the parent's memory, before the kernel sets the new program's command line and
    /// name, and a scan of `/proc` in that window missed the process (the CI failure of
    /// 75667f5).
    fn waiting_process(tmp: &Path, name: &str, dir: &Path) -> std::process::Child {
        use std::io::BufRead;
        let program = tmp.join(name);
        std::os::unix::fs::symlink("/bin/sh", &program).unwrap();
        let mut child = std::process::Command::new(&program)
            .arg("-c")
            .arg("echo running; read never")
            .arg(dir.join("root/.gvisor/state"))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line, "running\n");
        child
    }

    #[test]
    fn orphaned_gvisor_sandboxes_are_killed_and_other_processes_keep_their_worker() {
        let tmp = tempfile::tempdir().unwrap();
        let orphaned = tmp.path().join("workers").join("bash-aaaaa");
        let draining = tmp.path().join("workers").join("bash-bbbbb");
        for worker in [&orphaned, &draining] {
            std::fs::create_dir_all(worker.join("root").join(".gvisor")).unwrap();
            std::fs::write(worker.join("runtime.sock"), "").unwrap();
        }
        let bin = tmp.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        let mut sandbox = waiting_process(&bin, "runsc-sandbox", &orphaned);
        let mut server = waiting_process(&bin, "kruntimes-runti", &draining);
        let found = clean_leftovers(tmp.path());
        assert_eq!(
            found.killed,
            vec![(sandbox.id(), "runsc-sandbox".to_owned())],
            "{found:?}"
        );
        assert!(!sandbox.wait().unwrap().success());
        assert!(!orphaned.join("runtime.sock").exists(), "{found:?}");
        // A process that is not a sandbox (a runtime server still draining) is left alone,
        // and so is its directory.
        assert!(
            found.kept.iter().any(|(dir, _)| dir == &draining),
            "{found:?}"
        );
        assert!(draining.join("runtime.sock").exists());
        assert!(server.try_wait().unwrap().is_none());
        server.kill().unwrap();
        server.wait().unwrap();
    }

    /// The CI failure of b0c386e: a SIGKILLed runtime server's sandbox processes, whose
    /// command lines do not name the worker, were still in its cgroup when the next start
    /// ran, so the cgroup stayed. They are killed through the cgroup and it goes.
    #[test]
    fn processes_left_in_a_dead_servers_cgroup_are_killed_and_the_cgroup_goes() {
        use kruntimes_runtime_server::sandbox::cgroup::CgroupParent;
        let tmp = tempfile::tempdir().unwrap();
        let worker = tmp.path().join("workers").join("bash-ccccc");
        let root = worker.join("root");
        std::fs::create_dir_all(&root).unwrap();
        let parent = match CgroupParent::discover(&root.canonicalize().unwrap(), None) {
            Ok(parent) => parent,
            Err(reason) => {
                eprintln!("skipped: cgroup v2 is not usable here: {reason}");
                return;
            }
        };
        let exec = parent.child("exec-1");
        exec.create().unwrap();
        let mut orphan = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg("read never")
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        exec.attach(orphan.id()).unwrap();
        let found = clean_leftovers(tmp.path());
        assert!(
            found.killed.iter().any(|(pid, _)| *pid == orphan.id()),
            "{found:?}"
        );
        assert!(!orphan.wait().unwrap().success());
        assert!(found.kept.is_empty(), "{found:?}");
        assert!(!parent.path().exists(), "{found:?}");
        assert!(
            found.cgroups.contains(&parent.path().to_path_buf()),
            "{found:?}"
        );
    }
}
