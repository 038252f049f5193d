//! The `gvisor` backend's containers: one `runsc` sandbox per task execution, function
//! registration or session, built from an OCI bundle whose root is a read-only view of
//! the system plus the writable host paths, with no network but loopback. Programs run in
//! it through the helper's `exec` mode (`isolation::gvisor`).
#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::fs::File;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use crate::sandbox::isolation::confine;
use crate::sandbox::isolation::gvisor::{HELPER_INSIDE, INIT_ARG};
use crate::sandbox::isolation::holder::SYSTEM_DIRS;
use crate::sandbox::isolation::{self, Place, SpawnSpec};

/// How long `runsc run` and `runsc delete` may take.
const RUNSC_LIMIT: Duration = Duration::from_secs(20);
/// At most this much of `runsc`'s own log is quoted in an error.
const LOG_QUOTE_MAX: u64 = 2048;

/// Which `runsc` to run, and how.
#[derive(Debug, Clone)]
pub struct Runsc {
    pub binary: PathBuf,
    /// The platform that intercepts system calls: `systrap` (the default) or `ptrace`.
    pub platform: String,
}

/// The server-wide part of the `gvisor` backend: where `runsc` keeps its state and where
/// the bundles are.
#[derive(Debug)]
pub struct Gvisor {
    runsc: Runsc,
    state: PathBuf,
    bundles: PathBuf,
    /// The helper binary on the host (bound into every sandbox at `HELPER_INSIDE`).
    helper: PathBuf,
    /// `runsc --version`'s first line.
    pub version: String,
}

/// A running container.
#[derive(Debug)]
pub struct Running {
    pub id: String,
    /// The sandbox process (the sandbox kernel), as a pidfd.
    sentry: OwnedFd,
    bundle: PathBuf,
}

impl Running {
    /// Whether the sandbox kernel has ended (an OOM kill ends all of it).
    pub fn ended(&self) -> bool {
        confine::pidfd_exited(&self.sentry)
    }

    /// A pidfd of the sandbox kernel, to wait for its end without holding the container.
    pub fn watch(&self) -> std::io::Result<OwnedFd> {
        self.sentry.try_clone()
    }

    /// Kills the sandbox kernel (and with it every program in the sandbox).
    pub fn kill(&self) {
        confine::pidfd_kill(&self.sentry);
    }
}

impl Gvisor {
    /// Checks that `runsc` runs and prepares its directories beneath `root`.
    pub fn new(runsc: Runsc, root: &Path, helper: PathBuf) -> Result<Self, String> {
        let output = std::process::Command::new(&runsc.binary)
            .arg("--version")
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", runsc.binary.display()))?;
        let version = String::from_utf8_lossy(&output.stdout)
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_owned();
        if !output.status.success() || version.is_empty() {
            return Err(format!("{} --version failed", runsc.binary.display()));
        }
        // Debian bookworm's build (20221219) has no systrap platform and breaks stat(1);
        // bookworm-backports' (20240729) works.
        let date = version
            .rsplit(['~', '-'])
            .find_map(|part| part.split('.').next()?.parse::<u64>().ok())
            .filter(|d| *d > 20_000_000);
        if let Some(date) = date
            && date < 20_240_101
        {
            return Err(format!(
                "{version} is too old (install runsc from bookworm-backports: the systrap platform and statx need 2024 or later)"
            ));
        }
        let base = root.join(".gvisor");
        let state = base.join("state");
        let bundles = base.join("bundles");
        for dir in [&state, &bundles] {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        Ok(Self {
            runsc,
            state,
            bundles,
            helper,
            version,
        })
    }

    /// `runsc`'s global flags.
    pub fn flags(&self) -> Vec<OsString> {
        let mut root = OsString::from("--root=");
        root.push(&self.state);
        vec![
            root,
            "--network=none".into(),
            format!("--platform={}", self.runsc.platform).into(),
            "--ignore-cgroups".into(),
            // Not `--host-fifo=open`: with runsc 20240729 a reader of a host FIFO may
            // lose what was written and spin at full CPU (seen here within a few dozen
            // opens). A FIFO made inside the sandbox works; the host's cannot be opened.
            "--overlay2=none".into(),
        ]
    }

    pub fn binary(&self) -> &Path {
        &self.runsc.binary
    }

    pub fn helper(&self) -> &Path {
        &self.helper
    }

    /// Removes the containers and bundles a previous server with this root left (its
    /// sandboxes ended with its lifeline).
    pub async fn clean_leftovers(&self) {
        let Ok(entries) = std::fs::read_dir(&self.bundles) else {
            return;
        };
        for entry in entries.flatten() {
            let id = entry.file_name().to_string_lossy().into_owned();
            self.delete(&id).await;
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }

    /// `runsc delete --force id`, waited for (within [`RUNSC_LIMIT`]).
    async fn delete(&self, id: &str) {
        let child = tokio::process::Command::new(&self.runsc.binary)
            .args(self.flags())
            .args(["delete", "--force", id])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn();
        if let Ok(mut child) = child
            && tokio::time::timeout(RUNSC_LIMIT, child.wait())
                .await
                .is_err()
        {
            tracing::warn!(container = id, "runsc delete did not finish");
        }
    }

    /// Starts container `id`: the bundle, then `runsc run --detach` in the limit cgroups
    /// (`cgroups`), whose init watches `lifeline`.
    pub async fn run(
        &self,
        id: &str,
        writable: &[PathBuf],
        tmp_bytes: u64,
        cgroups: Arc<[File]>,
        lifeline: OwnedFd,
    ) -> Result<Running, String> {
        let bundle = self.bundles.join(id);
        let started = self
            .start(id, &bundle, writable, tmp_bytes, cgroups, lifeline)
            .await;
        match started {
            Ok(sentry) => Ok(Running {
                id: id.to_owned(),
                sentry,
                bundle,
            }),
            Err(e) => {
                self.delete(id).await;
                let _ = std::fs::remove_dir_all(&bundle);
                Err(e)
            }
        }
    }

    async fn start(
        &self,
        id: &str,
        bundle: &Path,
        writable: &[PathBuf],
        tmp_bytes: u64,
        cgroups: Arc<[File]>,
        lifeline: OwnedFd,
    ) -> Result<OwnedFd, String> {
        let io = |what: &str| {
            let what = what.to_owned();
            move |e: std::io::Error| format!("{what}: {e}")
        };
        let _ = std::fs::remove_dir_all(bundle);
        let rootfs = bundle.join("rootfs");
        std::fs::create_dir_all(&rootfs).map_err(io("bundle"))?;
        let config = self.config(&rootfs, writable, tmp_bytes)?;
        std::fs::write(bundle.join("config.json"), config).map_err(io("config.json"))?;
        let log = bundle.join("runsc.log");
        let pid_file = bundle.join("pid");
        let mut args = self.flags();
        args.push("run".into());
        args.push("--detach".into());
        args.push("--pass-fd=3:3".into());
        args.push("--pass-fd=4:4".into());
        let mut pid_arg = OsString::from("--pid-file=");
        pid_arg.push(&pid_file);
        args.push(pid_arg);
        let mut bundle_arg = OsString::from("--bundle=");
        bundle_arg.push(bundle);
        args.push(bundle_arg);
        args.push(id.into());
        let (ready_read, ready_write) = std::io::pipe().map_err(io("ready pipe"))?;
        let mut child = isolation::spawn(SpawnSpec {
            program: self.runsc.binary.clone().into_os_string(),
            args,
            env: vec![("PATH".into(), "/usr/sbin:/usr/bin:/sbin:/bin".into())],
            cwd: PathBuf::from("/"),
            stdin: isolation::Stdio::null(),
            stdout: isolation::Stdio::null(),
            // The sandbox inherits it: a file, never a pipe someone waits on.
            stderr: File::create(&log).map_err(io("runsc log"))?.into(),
            cgroup_procs: None,
            extra_fds: vec![lifeline, ready_write.into()],
            place: Place::Joined { cgroups },
        })
        .map_err(|e| format!("cannot run {}: {}", self.runsc.binary.display(), e.source))?;
        let status = match tokio::time::timeout(RUNSC_LIMIT, child.wait()).await {
            Ok(status) => status.map_err(io("runsc run"))?,
            Err(_) => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                return Err(format!("runsc run did not finish within {RUNSC_LIMIT:?}"));
            }
        };
        if !status.success() {
            return Err(format!("runsc run failed ({status}): {}", quote(&log)));
        }
        match tokio::time::timeout(RUNSC_LIMIT, crate::sandbox::read_line(ready_read)).await {
            Ok(Ok(line)) if line == "ready" => {}
            Ok(Ok(_)) => return Err("the sandbox's init ended before it was ready".into()),
            Ok(Err(e)) => return Err(format!("the sandbox's ready pipe: {e}")),
            Err(_) => {
                return Err(format!(
                    "the sandbox's init was not ready within {RUNSC_LIMIT:?}"
                ));
            }
        }
        let pid: u32 = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .ok_or("runsc run wrote no sandbox pid")?;
        confine::pidfd_open(pid).map_err(|e| format!("pidfd of the sandbox: {e}"))
    }

    /// The bundle's `config.json`, after making the mount points in `rootfs`.
    fn config(
        &self,
        rootfs: &Path,
        writable: &[PathBuf],
        tmp_bytes: u64,
    ) -> Result<Vec<u8>, String> {
        let io = |path: &Path| {
            let path = path.display().to_string();
            move |e: std::io::Error| format!("{path}: {e}")
        };
        let inside = |path: &Path| rootfs.join(path.strip_prefix("/").unwrap_or(path));
        for dir in ["proc", "dev", "tmp", ".kruntimes"] {
            std::fs::create_dir_all(rootfs.join(dir)).map_err(io(&rootfs.join(dir)))?;
        }
        let helper_point = inside(Path::new(HELPER_INSIDE));
        File::create(&helper_point).map_err(io(&helper_point))?;
        let mut mounts = vec![
            serde_json::json!({"destination": "/proc", "type": "proc", "source": "proc"}),
            serde_json::json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
                "options": ["nosuid", "noexec", "mode=755"]}),
            serde_json::json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
                "options": ["nosuid", "nodev", "mode=1777"]}),
            serde_json::json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                "options": ["nosuid", "nodev", "mode=1777", format!("size={tmp_bytes}")]}),
        ];
        for dir in SYSTEM_DIRS {
            let host = Path::new(dir);
            let Ok(meta) = std::fs::symlink_metadata(host) else {
                continue;
            };
            let point = inside(host);
            if meta.is_symlink() {
                let target = std::fs::read_link(host).map_err(io(host))?;
                std::os::unix::fs::symlink(target, &point).map_err(io(&point))?;
            } else if meta.is_dir() {
                std::fs::create_dir_all(&point).map_err(io(&point))?;
                mounts.push(
                    serde_json::json!({"destination": dir, "type": "bind", "source": dir,
                    "options": ["rbind", "ro", "nosuid", "nodev"]}),
                );
            }
        }
        mounts.push(
            serde_json::json!({"destination": HELPER_INSIDE, "type": "bind",
            "source": self.helper, "options": ["bind", "ro", "nosuid", "nodev"]}),
        );
        for path in writable {
            let point = inside(path);
            if path.is_dir() {
                std::fs::create_dir_all(&point).map_err(io(&point))?;
            } else {
                if let Some(parent) = point.parent() {
                    std::fs::create_dir_all(parent).map_err(io(parent))?;
                }
                File::create(&point).map_err(io(&point))?;
            }
            mounts.push(
                serde_json::json!({"destination": path, "type": "bind", "source": path,
                "options": ["rbind", "rw", "nosuid", "nodev"]}),
            );
        }
        let config = serde_json::json!({
            "ociVersion": "1.0.2",
            "process": {
                "user": {"uid": 0, "gid": 0},
                "args": std::iter::once(HELPER_INSIDE.to_owned())
                    .chain(std::iter::once(INIT_ARG.to_owned()))
                    .chain(writable.iter().map(|p| p.display().to_string()))
                    .collect::<Vec<_>>(),
                "env": ["PATH=/usr/local/bin:/usr/bin:/bin"],
                "cwd": "/",
                // To kill every process of the container when the server is gone.
                "capabilities": {
                    "bounding": ["CAP_KILL"],
                    "effective": ["CAP_KILL"],
                    "permitted": ["CAP_KILL"],
                },
                "noNewPrivileges": true,
            },
            "root": {"path": "rootfs", "readonly": true},
            "hostname": "sandbox",
            "mounts": mounts,
            "linux": {
                "namespaces": [
                    {"type": "pid"}, {"type": "network"}, {"type": "ipc"},
                    {"type": "uts"}, {"type": "mount"},
                ],
            },
        });
        serde_json::to_vec_pretty(&config).map_err(|e| format!("config.json: {e}"))
    }

    /// Ends the container: kills its sandbox kernel (every program in it dies with it),
    /// then has `runsc` forget it and removes the bundle. Waited for (about a second:
    /// `runsc delete` is slow even for a dead sandbox), so that the container's ID is free
    /// again and nothing of it is left when the sandbox's owner goes on.
    pub async fn remove(&self, running: Running) {
        confine::pidfd_kill(&running.sentry);
        self.delete(&running.id).await;
        let _ = std::fs::remove_dir_all(&running.bundle);
    }
}

/// The end of `runsc`'s log, for an error message.
fn quote(log: &Path) -> String {
    let Ok(mut file) = File::open(log) else {
        return "no log".into();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut text = String::new();
    if len > LOG_QUOTE_MAX {
        use std::io::Seek;
        let _ = file.seek(std::io::SeekFrom::Start(len - LOG_QUOTE_MAX));
    }
    let _ = file.take(LOG_QUOTE_MAX).read_to_string(&mut text);
    text.trim().replace('\n', "; ")
}
