//! Resource limits of `namespaces` sandboxes: one cgroup per sandbox with memory, pids
//! and CPU limits, on whichever hierarchy has the controllers.
//!
//! On a hybrid host (cgroup v1 controllers beside a unified v2 hierarchy without them)
//! the limits live in v1 cgroups `<controller mount>/<own path>/kruntimes/rs-<hash>/<name>`
//! that the sandbox's holder and every program in the sandbox join. On a host whose v2
//! hierarchy has the controllers delegated to the server's parent cgroup, the limits are
//! written into the execution's own v2 cgroup. Killing never happens here: the execution
//! cgroups (v2) and the sandbox's PID namespace do that.
#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::sandbox::cgroup::ExecCgroup;

/// The limits of one sandbox; `None` leaves a resource unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: Option<u64>,
    pub pids: Option<u64>,
    /// CPU in thousandths of a core.
    pub cpu_millis: Option<u64>,
}

impl Default for Limits {
    /// 1 GiB of memory, 1024 processes, no CPU limit.
    fn default() -> Self {
        Self {
            memory_bytes: Some(1 << 30),
            pids: Some(1024),
            cpu_millis: None,
        }
    }
}

/// A memory quantity as Kubernetes writes it (`256Mi`, `1Gi`, `500M`, `1048576`), in bytes.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let units: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    let (number, unit) = units
        .iter()
        .find_map(|(suffix, unit)| text.strip_suffix(suffix).map(|n| (n, *unit)))
        .unwrap_or((text, 1));
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{text:?} is not a positive memory quantity (like 256Mi)"))
}

/// A CPU quantity as Kubernetes writes it (`500m`, `2`, `1.5`), in thousandths of a core.
pub fn parse_cpu_millis(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let bad = || format!("{text:?} is not a positive CPU quantity (like 500m or 2)");
    let millis = match text.strip_suffix('m') {
        Some(n) => n.parse::<u64>().map_err(|_| bad())?,
        None => {
            let cores: f64 = text.parse().map_err(|_| bad())?;
            if !cores.is_finite() || cores <= 0.0 || cores > 1e6 {
                return Err(bad());
            }
            (cores * 1000.0).round() as u64
        }
    };
    if millis == 0 {
        return Err(bad());
    }
    Ok(millis)
}

/// The CFS period used for CPU limits (100 ms).
const CPU_PERIOD_US: u64 = 100_000;

/// Where limit cgroups are made.
#[derive(Debug, Clone)]
pub enum LimitParents {
    /// cgroup v1: (controller, the per-server parent directory) for memory, pids and cpu.
    V1(Vec<(&'static str, PathBuf)>),
    /// cgroup v2 with the controllers enabled for execution cgroups.
    V2,
}

/// The v1 hierarchies' mount points and roots, by controller, from `/proc/self/mountinfo`.
pub fn parse_v1_mounts(mountinfo: &str, controller: &str) -> Option<(PathBuf, String)> {
    mountinfo.lines().find_map(|line| {
        let (pre, post) = line.split_once(" - ")?;
        let mut post = post.split_whitespace();
        if post.next()? != "cgroup" {
            return None;
        }
        let options = post.nth(1)?;
        if !options.split(',').any(|o| o == controller) {
            return None;
        }
        let fields: Vec<&str> = pre.split_whitespace().collect();
        Some((PathBuf::from(fields.get(4)?), (*fields.get(3)?).to_owned()))
    })
}

/// This process's path in the v1 hierarchy of `controller` (`N:<controllers>:<path>` of
/// `/proc/self/cgroup`).
pub fn parse_v1_own(proc_cgroup: &str, controller: &str) -> Option<String> {
    proc_cgroup.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let _ = parts.next()?;
        let controllers = parts.next()?;
        let path = parts.next()?;
        controllers
            .split(',')
            .any(|c| c == controller)
            .then(|| path.trim().to_owned())
    })
}

impl LimitParents {
    /// Finds where limits can be set: v1 memory and pids hierarchies (cpu when present)
    /// when they exist, else v2 when `v2_parent` offers the controllers. `Err` says why no
    /// limits can be set.
    pub fn discover(root: &Path, v2_parent: Option<&Path>) -> Result<Self, String> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
        let digest = Sha256::digest(root.as_os_str().as_encoded_bytes());
        let leaf = format!("rs-{}", &hex::encode(digest)[..16]);
        let mut v1 = Vec::new();
        for controller in ["memory", "pids", "cpu"] {
            let (Some((mount, mount_root)), Some(path)) = (
                parse_v1_mounts(&mountinfo, controller),
                parse_v1_own(&own, controller),
            ) else {
                continue;
            };
            let Some(dir) = crate::sandbox::cgroup::own_cgroup_dir(&mount, &mount_root, &path)
            else {
                continue;
            };
            let parent = dir.join("kruntimes").join(&leaf);
            if std::fs::create_dir_all(&parent).is_ok() {
                v1.push((controller, parent));
            }
        }
        if v1.iter().any(|(c, _)| *c == "memory") && v1.iter().any(|(c, _)| *c == "pids") {
            return Ok(Self::V1(v1));
        }
        let Some(parent) = v2_parent else {
            return Err("no cgroup v1 memory and pids hierarchies and no cgroup v2 parent".into());
        };
        enable_v2_controllers(parent)?;
        Ok(Self::V2)
    }

    /// Creates the limit cgroup `name` for a sandbox whose programs run in `exec` (v2).
    pub fn create(
        &self,
        name: &str,
        limits: Limits,
        exec: Option<&ExecCgroup>,
    ) -> Result<LimitGroup, String> {
        match self {
            Self::V1(parents) => {
                let mut group = LimitGroup {
                    dirs: Vec::new(),
                    memory: None,
                    v2: false,
                };
                for (controller, parent) in parents {
                    let dir = parent.join(name);
                    match std::fs::create_dir(&dir) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                        Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
                    }
                    group.dirs.push(dir.clone());
                    match *controller {
                        "memory" => {
                            if let Some(bytes) = limits.memory_bytes {
                                write(&dir, "memory.limit_in_bytes", &bytes.to_string())?;
                                // Without swap accounting the file is missing: fine.
                                let _ = std::fs::write(
                                    dir.join("memory.memsw.limit_in_bytes"),
                                    bytes.to_string(),
                                );
                                let _ = std::fs::write(dir.join("memory.swappiness"), "0");
                            }
                            group.memory = Some(dir);
                        }
                        "pids" => {
                            if let Some(pids) = limits.pids {
                                write(&dir, "pids.max", &pids.to_string())?;
                            }
                        }
                        _ => {
                            if let Some(millis) = limits.cpu_millis {
                                write(&dir, "cpu.cfs_period_us", &CPU_PERIOD_US.to_string())?;
                                let quota = (millis * CPU_PERIOD_US / 1000).max(1000);
                                write(&dir, "cpu.cfs_quota_us", &quota.to_string())?;
                            }
                        }
                    }
                }
                Ok(group)
            }
            Self::V2 => {
                // Without an execution cgroup (the start-up probe) there is nothing to limit.
                let Some(exec) = exec else {
                    return Ok(LimitGroup {
                        dirs: Vec::new(),
                        memory: None,
                        v2: true,
                    });
                };
                let dir = exec.path().to_owned();
                if let Some(bytes) = limits.memory_bytes {
                    write(&dir, "memory.max", &bytes.to_string())?;
                    let _ = std::fs::write(dir.join("memory.swap.max"), "0");
                }
                if let Some(pids) = limits.pids {
                    write(&dir, "pids.max", &pids.to_string())?;
                }
                if let Some(millis) = limits.cpu_millis {
                    let quota = (millis * CPU_PERIOD_US / 1000).max(1000);
                    write(&dir, "cpu.max", &format!("{quota} {CPU_PERIOD_US}"))?;
                }
                Ok(LimitGroup {
                    dirs: Vec::new(),
                    memory: Some(dir),
                    v2: true,
                })
            }
        }
    }

    /// Removes the per-server parents (when empty).
    pub fn remove_if_empty(&self) {
        if let Self::V1(parents) = self {
            for (_, parent) in parents {
                let _ = std::fs::remove_dir(parent);
                if let Some(up) = parent.parent()
                    && up.file_name().is_some_and(|n| n == "kruntimes")
                {
                    let _ = std::fs::remove_dir(up);
                }
            }
        }
    }

    /// Removes limit cgroups that a previous server left (their processes are gone with
    /// their holders; an occupied one stays).
    pub fn clean_leftovers(&self) {
        if let Self::V1(parents) = self {
            for (_, parent) in parents {
                let Ok(entries) = std::fs::read_dir(parent) else {
                    continue;
                };
                for entry in entries.flatten() {
                    if entry.path().is_dir() {
                        let _ = std::fs::remove_dir(entry.path());
                    }
                }
            }
        }
    }
}

fn write(dir: &Path, file: &str, value: &str) -> Result<(), String> {
    std::fs::write(dir.join(file), value)
        .map_err(|e| format!("cannot write {value} to {}: {e}", dir.join(file).display()))
}

/// Enables memory, pids and cpu for the children of `parent` (and of its parent, the
/// server's `kruntimes` directory), or says why that is impossible.
fn enable_v2_controllers(parent: &Path) -> Result<(), String> {
    let up = parent.parent().ok_or("the v2 parent has no parent")?;
    for dir in [up, parent] {
        let available = std::fs::read_to_string(dir.join("cgroup.controllers"))
            .map_err(|e| format!("cannot read {}/cgroup.controllers: {e}", dir.display()))?;
        for controller in ["memory", "pids"] {
            if !available.split_whitespace().any(|c| c == controller) {
                return Err(format!(
                    "cgroup v2 controller {controller} is not delegated to {}",
                    dir.display()
                ));
            }
        }
        let wanted = if available.split_whitespace().any(|c| c == "cpu") {
            "+memory +pids +cpu"
        } else {
            "+memory +pids"
        };
        std::fs::write(dir.join("cgroup.subtree_control"), wanted)
            .map_err(|e| format!("cannot enable {wanted} in {}: {e}", dir.display()))?;
    }
    Ok(())
}

/// One sandbox's limit cgroups.
#[derive(Debug)]
pub struct LimitGroup {
    /// v1 directories the sandbox's processes join (none on v2).
    dirs: Vec<PathBuf>,
    /// Where `oom_kill` is counted.
    memory: Option<PathBuf>,
    v2: bool,
}

impl LimitGroup {
    /// `cgroup.procs` of each v1 directory, open for writing, for a process to join.
    pub fn open_procs(&self) -> Result<Vec<File>, String> {
        self.dirs
            .iter()
            .map(|dir| {
                OpenOptions::new()
                    .write(true)
                    .open(dir.join("cgroup.procs"))
                    .map_err(|e| format!("cannot open {}/cgroup.procs: {e}", dir.display()))
            })
            .collect()
    }

    /// How many processes the kernel's OOM killer has killed in the sandbox so far.
    pub fn oom_kills(&self) -> u64 {
        let Some(dir) = &self.memory else {
            return 0;
        };
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        std::fs::read_to_string(dir.join(file))
            .ok()
            .and_then(|text| {
                text.lines()
                    .find_map(|l| l.strip_prefix("oom_kill "))
                    .and_then(|n| n.trim().parse().ok())
            })
            .unwrap_or(0)
    }

    /// Removes the v1 directories once their processes are gone (waiting up to `limit`).
    pub async fn remove(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        for dir in &self.dirs {
            loop {
                match std::fs::remove_dir(dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    Err(e) => {
                        if tokio::time::Instant::now() >= deadline {
                            tracing::warn!(cgroup = %dir.display(), error = %e, "limit cgroup not removed");
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
35 24 0:30 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
36 35 0:31 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw
37 35 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
38 35 0:33 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
39 35 0:34 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
";

    #[test]
    fn finds_v1_hierarchies_by_controller() {
        assert_eq!(
            parse_v1_mounts(MOUNTINFO, "memory"),
            Some((PathBuf::from("/sys/fs/cgroup/memory"), "/".to_owned()))
        );
        assert_eq!(
            parse_v1_mounts(MOUNTINFO, "cpu"),
            Some((PathBuf::from("/sys/fs/cgroup/cpu,cpuacct"), "/".to_owned()))
        );
        assert_eq!(parse_v1_mounts(MOUNTINFO, "hugetlb"), None);
    }

    #[test]
    fn quantities() {
        assert_eq!(parse_bytes("256Mi").unwrap(), 256 << 20);
        assert_eq!(parse_bytes("1Gi").unwrap(), 1 << 30);
        assert_eq!(parse_bytes("500M").unwrap(), 500_000_000);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        for bad in ["", "0", "-1Mi", "1.5Gi", "Mi", "99999999999Ti"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_cpu_millis("500m").unwrap(), 500);
        assert_eq!(parse_cpu_millis("2").unwrap(), 2000);
        assert_eq!(parse_cpu_millis("1.5").unwrap(), 1500);
        for bad in ["", "0", "0m", "-1", "x", "NaN", "inf"] {
            assert!(parse_cpu_millis(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn own_v1_paths() {
        let text = "8:pids:/\n4:memory:/process_api/x\n2:cpu,cpuacct:/a\n0::/\n";
        assert_eq!(
            parse_v1_own(text, "memory").as_deref(),
            Some("/process_api/x")
        );
        assert_eq!(parse_v1_own(text, "cpu").as_deref(), Some("/a"));
        assert_eq!(parse_v1_own(text, "blkio"), None);
    }
}
