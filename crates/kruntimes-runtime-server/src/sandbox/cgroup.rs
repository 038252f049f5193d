//! cgroup v2 containment: one cgroup per execution under a per-server parent.
//!
//! A process group is not containment: a child that calls `setsid()` leaves it. A cgroup
//! is inherited by every descendant, and a process cannot leave it without write access
//! to another cgroup's `cgroup.procs`, so `cgroup.kill` (or a sweep of `cgroup.procs`)
//! reaches the whole tree. This module owns discovery of the unified hierarchy, the
//! per-server parent `<own cgroup>/kruntimes/rs-<hash of root>`, and creating, signalling,
//! draining and removing execution cgroups. It enables no controllers (no limits: that is
//! the namespaces backend's job). The child joins its cgroup before exec (see `isolation`);
//! the one process moved afterwards is the python adapter's warm spare, which is moved
//! into a registration's cgroup before it runs any of that registration's code.
#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::{Pid, getpgid};
use sha2::{Digest, Sha256};

/// Why a cgroup operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("failed to {action} cgroup {path}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError {
    let path = path.to_owned();
    move |source| CgroupError::Io {
        action,
        path,
        source,
    }
}

/// The mount point and mount root of the cgroup2 hierarchy in `/proc/self/mountinfo`.
pub fn parse_cgroup2_mount(mountinfo: &str) -> Option<(PathBuf, String)> {
    mountinfo.lines().find_map(|line| {
        let (pre, post) = line.split_once(" - ")?;
        if post.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let fields: Vec<&str> = pre.split_whitespace().collect();
        Some((PathBuf::from(fields.get(4)?), (*fields.get(3)?).to_owned()))
    })
}

/// This process's cgroup v2 path (the `0::` line of `/proc/self/cgroup`).
pub fn parse_own_cgroup(proc_cgroup: &str) -> Option<String> {
    proc_cgroup
        .lines()
        .find_map(|line| line.strip_prefix("0::"))
        .map(|p| p.trim().to_owned())
}

/// Where this process's cgroup is in the filesystem, from the mount and its own path.
pub fn own_cgroup_dir(mount: &Path, mount_root: &str, own: &str) -> Option<PathBuf> {
    let rel = if mount_root == "/" {
        own
    } else {
        own.strip_prefix(mount_root)?
    };
    let rel = rel.trim_start_matches('/');
    if rel.split('/').any(|c| c == "..") {
        return None;
    }
    Some(if rel.is_empty() {
        mount.to_owned()
    } else {
        mount.join(rel)
    })
}

/// Where [`CgroupParent::discover`] puts the parent of a server whose (canonical) root is
/// `root`, without creating it: `<this process's cgroup>/kruntimes/rs-<hash of root>`. A
/// process in the same cgroup as the server (`kruntimes up`, which starts it) finds there
/// what a dead server left.
pub fn default_parent_path(root: &Path) -> Result<PathBuf, String> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
    let (mount, mount_root) =
        parse_cgroup2_mount(&mountinfo).ok_or("no cgroup2 (unified) hierarchy is mounted")?;
    let own = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
    let own = parse_own_cgroup(&own).ok_or("this process has no cgroup v2 path")?;
    let dir = own_cgroup_dir(&mount, &mount_root, &own)
        .ok_or_else(|| format!("own cgroup {own} is outside the visible hierarchy {mount_root}"))?;
    let digest = Sha256::digest(root.as_os_str().as_encoded_bytes());
    Ok(dir
        .join("kruntimes")
        .join(format!("rs-{}", &hex::encode(digest)[..16])))
}

/// The per-server parent cgroup under which every execution gets its own.
#[derive(Debug, Clone)]
pub struct CgroupParent {
    path: PathBuf,
}

impl CgroupParent {
    /// Finds the unified hierarchy and creates `<own cgroup>/kruntimes/rs-<hash of root>`
    /// (or `explicit` when given). The name is stable for a root directory, so a restarted
    /// server finds the cgroups its predecessor left. Returns why cgroups cannot be used.
    pub fn discover(root: &Path, explicit: Option<&Path>) -> Result<Self, String> {
        let path = match explicit {
            Some(path) => path.to_owned(),
            None => default_parent_path(root)?,
        };
        std::fs::create_dir_all(&path)
            .map_err(|e| format!("cannot create cgroup {}: {e}", path.display()))?;
        if !path.join("cgroup.procs").exists() {
            return Err(format!("{} is not a cgroup v2 directory", path.display()));
        }
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The cgroup named `name` (one path component) under this parent; not created.
    pub fn child(&self, name: &str) -> ExecCgroup {
        ExecCgroup {
            path: self.path.join(name),
        }
    }

    /// Removes the parent and its `kruntimes` directory when they are empty.
    pub fn remove_if_empty(&self) {
        // Failures mean another execution or server still uses them.
        let _ = std::fs::remove_dir(&self.path);
        if let Some(up) = self.path.parent()
            && up.file_name().is_some_and(|n| n == "kruntimes")
        {
            let _ = std::fs::remove_dir(up);
        }
    }
}

/// One execution's cgroup.
#[derive(Debug, Clone)]
pub struct ExecCgroup {
    path: PathBuf,
}

impl ExecCgroup {
    /// The cgroup at `path` (a directory of the unified hierarchy); not created.
    pub fn at(path: PathBuf) -> Self {
        Self { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Creates the cgroup (an existing one is reused).
    pub fn create(&self) -> Result<(), CgroupError> {
        match std::fs::create_dir(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(io_err("create", &self.path)(e)),
        }
    }

    pub fn exists(&self) -> bool {
        self.path.join("cgroup.procs").exists()
    }

    /// `cgroup.procs` opened for writing, for a child to join before exec.
    pub fn open_procs(&self) -> Result<File, CgroupError> {
        let procs = self.path.join("cgroup.procs");
        OpenOptions::new()
            .write(true)
            .open(&procs)
            .map_err(io_err("open", &procs))
    }

    /// Moves process `pid` (all its threads) into the cgroup.
    pub fn attach(&self, pid: u32) -> Result<(), CgroupError> {
        let mut procs = self.open_procs()?;
        procs
            .write_all(pid.to_string().as_bytes())
            .map_err(io_err("move a process into", &self.path))
    }

    /// The processes in the cgroup now.
    pub fn pids(&self) -> Result<Vec<i32>, CgroupError> {
        let procs = self.path.join("cgroup.procs");
        let text = std::fs::read_to_string(&procs).map_err(io_err("read", &procs))?;
        Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
    }

    /// The processes in the cgroup and in every cgroup beneath it now.
    pub fn pids_beneath(&self) -> Result<Vec<i32>, CgroupError> {
        let mut pids = self.pids()?;
        let children = std::fs::read_dir(&self.path).map_err(io_err("read", &self.path))?;
        for child in children.flatten() {
            // A child removed meanwhile holds nothing.
            if child.file_type().is_ok_and(|t| t.is_dir())
                && let Ok(beneath) = ExecCgroup::at(child.path()).pids_beneath()
            {
                pids.extend(beneath);
            }
        }
        Ok(pids)
    }

    /// Sends `signal` to every process in the cgroup that is not in process group `pgid`
    /// (a sweep; processes forked meanwhile may be missed, which is why the final kill uses
    /// `cgroup.kill`). The caller signals the group itself: a process signalled twice runs
    /// a TERM trap twice, and many servers take a second SIGTERM as "exit now".
    pub fn signal_outside_group(&self, signal: Signal, pgid: u32) -> Result<(), CgroupError> {
        for pid in outside_group(self.pids()?, pgid) {
            // ESRCH: it exited meanwhile.
            let _ = kill(Pid::from_raw(pid), signal);
        }
        Ok(())
    }

    /// SIGKILLs every process in the cgroup and the cgroups beneath it, forks in flight
    /// included, through `cgroup.kill` (Linux 5.14+); on older kernels by sweeping the
    /// `cgroup.procs` of the cgroup and its descendants until they are empty or 100 rounds
    /// have passed.
    pub fn kill_all(&self) -> Result<(), CgroupError> {
        let kill_file = self.path.join("cgroup.kill");
        match OpenOptions::new().write(true).open(&kill_file) {
            Ok(mut file) => file.write_all(b"1").map_err(io_err("kill", &self.path)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && self.exists() => {
                for _ in 0..100 {
                    let pids = self.pids_beneath()?;
                    if pids.is_empty() {
                        break;
                    }
                    for pid in pids {
                        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                    }
                }
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err("open", &kill_file)(e)),
        }
    }

    /// Whether any process is in the cgroup (`populated` of `cgroup.events`); a missing
    /// cgroup is empty.
    pub fn populated(&self) -> Result<bool, CgroupError> {
        let events = self.path.join("cgroup.events");
        match std::fs::read_to_string(&events) {
            Ok(text) => Ok(text.lines().any(|l| l.trim() == "populated 1")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io_err("read", &events)(e)),
        }
    }

    /// Waits until the cgroup is empty, checking every few milliseconds, for at most
    /// `limit`. Returns whether it emptied.
    pub async fn wait_empty(&self, limit: Duration) -> Result<bool, CgroupError> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if !self.populated()? {
                return Ok(true);
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(false);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// [`ExecCgroup::wait_empty`] for callers outside the async runtime (startup).
    pub fn wait_empty_blocking(&self, limit: Duration) -> Result<bool, CgroupError> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if !self.populated()? {
                return Ok(true);
            }
            if std::time::Instant::now() >= deadline {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Removes the (empty) cgroup; a missing one is fine.
    pub fn remove(&self) -> Result<(), CgroupError> {
        match std::fs::remove_dir(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err("remove", &self.path)(e)),
        }
    }
}

/// The processes of `pids` that are not in process group `pgid`. One that has exited
/// meanwhile is left out.
fn outside_group(pids: Vec<i32>, pgid: u32) -> Vec<i32> {
    pids.into_iter()
        .filter(|&pid| {
            getpgid(Some(Pid::from_raw(pid)))
                .is_ok_and(|group| u32::try_from(group.as_raw()).ok() != Some(pgid))
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::unix::process::CommandExt;

    use super::*;

    #[test]
    fn only_processes_outside_the_group_are_signalled_one_by_one() {
        let spawn = |group: u32| {
            std::process::Command::new("sleep")
                .arg("1000")
                .process_group(group as i32)
                .spawn()
                .unwrap()
        };
        let mut leader = spawn(0);
        let pgid = leader.id();
        // `member` joins the leader's group; `other` has a group of its own.
        let (mut member, mut other) = (spawn(pgid), spawn(0));
        let mut gone = spawn(0);
        let gone_pid = gone.id() as i32;
        gone.kill().unwrap();
        gone.wait().unwrap();

        let pids = [&leader, &member, &other]
            .map(|c| c.id() as i32)
            .into_iter()
            .chain([gone_pid])
            .collect();
        let outside = outside_group(pids, pgid);
        let other_pid = other.id() as i32;
        // Ended before the assertion, so that a failure leaves no process behind.
        for child in [&mut leader, &mut member, &mut other] {
            child.kill().unwrap();
            child.wait().unwrap();
        }
        assert_eq!(outside, [other_pid]);
    }

    const HYBRID: &str = "\
24 30 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
35 24 0:30 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
36 35 0:31 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw
37 35 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
";

    #[test]
    fn finds_the_unified_mount() {
        assert_eq!(
            parse_cgroup2_mount(HYBRID),
            Some((PathBuf::from("/sys/fs/cgroup/unified"), "/".to_owned()))
        );
        assert_eq!(
            parse_cgroup2_mount("1 2 0:1 / / rw - ext4 /dev/sda rw\n"),
            None
        );
    }

    #[test]
    fn own_cgroup_line() {
        let text = "4:memory:/process_api/x\n1:cpu:/\n0::/user.slice/app.scope\n";
        assert_eq!(
            parse_own_cgroup(text).as_deref(),
            Some("/user.slice/app.scope")
        );
        assert_eq!(parse_own_cgroup("4:memory:/x\n"), None);
    }

    #[test]
    fn own_cgroup_dir_joins_beneath_the_mount() {
        let mount = Path::new("/sys/fs/cgroup");
        assert_eq!(own_cgroup_dir(mount, "/", "/").unwrap(), mount);
        assert_eq!(
            own_cgroup_dir(mount, "/", "/a/b").unwrap(),
            mount.join("a/b")
        );
        assert_eq!(
            own_cgroup_dir(mount, "/a", "/a/b").unwrap(),
            mount.join("b")
        );
        assert_eq!(own_cgroup_dir(mount, "/a", "/c"), None);
        assert_eq!(own_cgroup_dir(mount, "/", "/a/../../etc"), None);
    }
}
