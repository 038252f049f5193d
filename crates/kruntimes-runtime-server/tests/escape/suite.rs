//! The escape suite of the sandboxes: what a command inside a session must not reach, each
//! item a test against the real binary. Included once per backend (`namespaces.rs`,
//! `gvisor.rs`, which set `BACKEND`) by `tests/sessions.rs`, whose helpers it uses. Every
//! test asks for its backend explicitly: a machine that cannot run it fails here rather
//! than passing quietly.

use super::*;
use kruntimes_runtime_server::sandbox::isolation::confine::{DENIED, DENIED_WITH_NEWUSER};

/// A server whose sessions run in `BACKEND` sandboxes with small limits.
async fn hardened() -> TestServer {
    TestServer::start_with(
        tempfile::tempdir().unwrap(),
        "bash",
        &[
            "--session-termination-grace",
            "400ms",
            "--sandbox",
            match BACKEND {
                Backend::Namespaces => "namespaces",
                Backend::Gvisor => "gvisor",
            },
            "--sandbox-memory",
            "256Mi",
            "--sandbox-pids",
            "64",
        ],
    )
    .await
}

/// The host pids in the cgroup of the session's commands.
fn command_pids(caps: &pb::CapabilitiesResponse, id: &pb::ExecutionId) -> Vec<i32> {
    let procs = Path::new(&caps.cgroup_parent)
        .join(format!("ss-{}-{}", id.run_uid, id.attempt))
        .join("cgroup.procs");
    std::fs::read_to_string(procs)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Runs `script` with the system's python in the session; everything it streamed.
async fn python(server: &TestServer, id: &pb::ExecutionId, script: &str) -> Done {
    op(
        server,
        id,
        Operation::Command(command(&["/usr/bin/python3", "-c", script], "")),
    )
    .await
    .unwrap()
}

/// Waits (within the deadline) until none of `pids` is alive.
async fn await_gone(pids: &[i32], what: &str) {
    let deadline = Instant::now() + DEADLINE;
    while pids.iter().any(|pid| alive(*pid)) {
        assert!(Instant::now() < deadline, "{what}: {pids:?} survived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `gvisor`: the session's container, as `runsc` names it.
fn container(id: &pb::ExecutionId) -> String {
    format!("ss-{}-{}", id.run_uid, id.attempt)
}

/// `gvisor`: the commands of the processes in the session's sandbox, from `runsc ps`
/// (empty once the container is gone).
fn sandbox_processes(server: &TestServer, id: &pb::ExecutionId) -> Vec<String> {
    let mut root = std::ffi::OsString::from("--root=");
    root.push(server.root().join(".gvisor/state"));
    let out = std::process::Command::new("runsc")
        .arg(root)
        .args(["ps", &container(id)])
        .stderr(std::process::Stdio::null())
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().last().map(str::to_owned))
        .collect()
}

/// The session's sandbox's own host processes: the `namespaces` holder, or gVisor's
/// kernel and file proxy.
fn sandbox_host_pids(id: &pb::ExecutionId) -> Vec<i32> {
    match BACKEND {
        // A holder built for the session names its paths on its command line; a warm one
        // (built ahead, its paths bound when the session took it) has them in its mounts.
        Backend::Namespaces => kruntimes_testkit::procs::matching(|p| {
            p.cmdline.contains("__sandbox-holder")
                && (p.cmdline.contains(&id.run_uid)
                    || std::fs::read_to_string(format!("/proc/{}/mountinfo", p.pid))
                        .is_ok_and(|m| m.contains(&id.run_uid)))
        })
        .into_iter()
        .map(|p| p.pid)
        .collect(),
        Backend::Gvisor => kruntimes_testkit::procs::mentioning(&container(id))
            .into_iter()
            .filter(|p| p.cmdline.starts_with("runsc-"))
            .map(|p| p.pid)
            .collect(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_run_as_an_unprivileged_user_with_seccomp() {
    let server = hardened().await;
    let caps = server.capabilities().await;
    match BACKEND {
        Backend::Namespaces => {
            assert_eq!(caps.isolation(), pb::Isolation::Namespaces, "{caps:?}");
            assert!(caps.isolation_detail.contains("landlock"), "{caps:?}");
        }
        Backend::Gvisor => {
            assert_eq!(caps.isolation(), pb::Isolation::Gvisor, "{caps:?}");
            assert!(caps.isolation_detail.contains("runsc"), "{caps:?}");
        }
    }
    let id = open(&server).await;
    let out = sh(
        &server,
        &id,
        "id -u; id -g; grep -E '^(CapEff|CapPrm|CapBnd|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status | tr -s '\\t ' ' '; hostname",
    )
    .await
    .ok();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(&lines[..2], ["65534", "65534"], "{out}");
    // gVisor's /proc/PID/status has no CapAmb or NoNewPrivs line: ask prctl(2) instead.
    let caps: &[&str] = match BACKEND {
        Backend::Namespaces => &["CapEff", "CapPrm", "CapBnd", "CapAmb"],
        Backend::Gvisor => &["CapEff", "CapPrm", "CapBnd"],
    };
    for cap in caps {
        assert!(
            lines.contains(&format!("{cap}: 0000000000000000").as_str()),
            "{cap} in {out}"
        );
    }
    assert!(lines.contains(&"Seccomp: 2"), "{out}");
    match BACKEND {
        Backend::Namespaces => assert!(lines.contains(&"NoNewPrivs: 1"), "{out}"),
        Backend::Gvisor => {
            let prctl = python(
                &server,
                &id,
                "import ctypes; libc = ctypes.CDLL(None); print(libc.prctl(39, 0, 0, 0, 0), libc.prctl(23, 21, 0, 0, 0))",
            )
            .await
            .ok();
            // PR_GET_NO_NEW_PRIVS is 1; CAP_SYS_ADMIN (21) is not in the bounding set.
            assert_eq!(prctl, "1 0\n");
        }
    }
    assert_eq!(lines.last(), Some(&"sandbox"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_files_outside_the_view_cannot_be_read() {
    let server = hardened().await;
    let secret = format!("SENTINEL-{}", new_id().run_uid);
    // One sentinel beside the test, one in the server's root beside every workspace, one
    // in another session's workspace.
    let outside = tempfile::tempdir().unwrap();
    let planted = outside.path().join("sentinel");
    std::fs::write(&planted, &secret).unwrap();
    let in_root = server.root().join("sentinel");
    std::fs::write(&in_root, &secret).unwrap();
    let other = open(&server).await;
    let other_ws = workspace(&status(&server, &other).await.unwrap());
    std::fs::write(other_ws.join("secret"), &secret).unwrap();

    let id = open(&server).await;
    let paths = [
        planted.display().to_string(),
        in_root.display().to_string(),
        other_ws.join("secret").display().to_string(),
        "/etc/shadow".to_owned(),
        "/root/.bashrc".to_owned(),
        "/sys/kernel/notes".to_owned(),
    ]
    .into_iter()
    // gVisor shows every process's environ to the whole sandbox; there /proc/1 is the
    // command's own namespace init, whose environment is empty (checked below).
    .chain((BACKEND == Backend::Namespaces).then(|| "/proc/1/environ".to_owned()))
    .collect::<Vec<_>>();
    let mut line = String::new();
    for path in &paths {
        line.push_str(&format!(
            "if cat '{path}' >/dev/null 2>&1; then echo 'READ {path}'; fi; "
        ));
    }
    line.push_str(&format!(
        "ls -a / /tmp; ls '{}' 2>&1; ls '{}' 2>&1; true",
        outside.path().display(),
        server.root().display()
    ));
    let done = sh(&server, &id, &line).await;
    let out = done.ok();
    assert!(!out.contains("READ "), "{out}");
    assert!(!out.contains(&secret), "{out}");
    assert!(!out.contains("sentinel"), "{out}");
    // The root holds only the system view (and under gVisor its own synthetic /sys,
    // which it always mounts; the host's /sys/kernel/notes is not readable above).
    let root: BTreeSet<&str> = out.lines().skip(1).take_while(|l| !l.is_empty()).collect();
    let hidden: &[&str] = match BACKEND {
        Backend::Namespaces => &["root", "home", "var", "opt", "srv", "boot", "sys"],
        Backend::Gvisor => &["root", "home", "var", "opt", "srv", "boot"],
    };
    for name in hidden {
        assert!(!root.contains(name), "/{name} is visible: {out}");
    }
    if BACKEND == Backend::Gvisor {
        // gVisor gives every process at least HOME; the session's variables stay out.
        let environ = sh(&server, &id, "tr '\\0' '\\n' < /proc/1/environ")
            .await
            .ok();
        assert!(
            !environ.contains("KRUNTIME"),
            "the init's environment: {environ}"
        );
        assert!(
            !environ.contains("PATH="),
            "the init's environment: {environ}"
        );
    }
    // Nothing changed.
    assert_eq!(std::fs::read_to_string(&planted).unwrap(), secret);
    assert_eq!(std::fs::read_to_string(&in_root).unwrap(), secret);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writing_outside_the_workspace_fails() {
    let server = hardened().await;
    let outside = tempfile::tempdir().unwrap();
    let id = open(&server).await;
    let ws = workspace(&status(&server, &id).await.unwrap());
    let name = format!("escape-{}", id.run_uid);
    let targets = [
        format!("/{name}"),
        format!("/usr/{name}"),
        format!("/etc/{name}"),
        format!("/usr/bin/{name}"),
        format!("/dev/{name}"),
        format!("{}/{name}", outside.path().display()),
        format!("{}/{name}", server.root().display()),
        format!("{}/../{name}", ws.display()),
    ];
    let mut line = String::new();
    for target in &targets {
        line.push_str(&format!(
            "if (echo x > '{target}') 2>/dev/null; then echo 'WROTE {target}'; fi; "
        ));
    }
    line.push_str(&format!(
        "echo x > /tmp/{name} && echo 'private tmp'; echo y > inside && echo 'workspace'; mkdir -p a/b && echo 'mkdir'"
    ));
    let out = sh(&server, &id, &line).await.ok();
    assert!(!out.contains("WROTE"), "{out}");
    assert!(out.contains("private tmp"), "{out}");
    assert!(out.contains("workspace"), "{out}");
    assert!(out.contains("mkdir"), "{out}");
    for target in &targets {
        assert!(!Path::new(target).exists(), "{target} was written");
    }
    assert!(
        !Path::new("/tmp").join(&name).exists(),
        "/tmp is the host's"
    );
    // The workspace is the host's, and what the sandbox made there is its user's.
    let inside = ws.join("inside");
    assert_eq!(std::fs::read_to_string(&inside).unwrap(), "y\n");
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&inside.metadata().unwrap()),
        65534
    );
    // A file the server writes for the session stays writable by the sandbox user.
    op(&server, &id, write("given.txt", b"from the server"))
        .await
        .unwrap()
        .ok();
    op(&server, &id, mkdir("made/by/server", true))
        .await
        .unwrap()
        .ok();
    let out = sh(
        &server,
        &id,
        "echo more >> given.txt && touch made/by/server/x && cat given.txt",
    )
    .await
    .ok();
    assert_eq!(out, "from the servermore\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_processes_are_not_visible() {
    let server = hardened().await;
    let id = open(&server).await;
    let server_pid = server.child.id();
    let out = sh(
        &server,
        &id,
        &format!(
            "ls /proc | grep -cE '^[0-9]+$'; cat /proc/[0-9]*/comm; if kill -0 {server_pid} 2>/dev/null; then echo SEEN; fi; ls /proc/{server_pid} >/dev/null 2>&1 && echo LISTED; true"
        ),
    )
    .await
    .ok();
    let mut lines = out.lines();
    let count: usize = lines.next().unwrap().parse().unwrap();
    // The command, its shell and what it runs; never the host's hundreds.
    assert!(count <= 6, "{count} processes visible: {out}");
    for comm in lines {
        assert!(!comm.contains("kruntimes"), "{out}");
        assert!(!comm.starts_with("sessions-"), "{out}");
        assert!(!comm.contains("cargo"), "{out}");
    }
    assert!(!out.contains("SEEN"), "{out}");
    assert!(!out.contains("LISTED"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_connection_reaches_the_host_loopback() {
    let server = hardened().await;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let id = open(&server).await;
    let script = format!(
        r#"
import socket, threading
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("REACHED the host")
except OSError as e:
    print("refused", e.errno)
try:
    socket.create_connection(("10.0.2.2", 80), timeout=1)
    print("REACHED the network")
except OSError as e:
    print("unreachable", e.errno)
own = socket.socket()
own.bind(("127.0.0.1", 0))
own.listen()
def serve():
    conn, _ = own.accept()
    conn.sendall(b"pong")
    conn.close()
threading.Thread(target=serve).start()
client = socket.create_connection(own.getsockname(), timeout=2)
print("loopback", client.recv(4).decode())
print(sorted(line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]))
"#
    );
    let out = python(&server, &id, &script).await.ok();
    assert!(!out.contains("REACHED"), "{out}");
    assert!(out.contains("refused"), "{out}");
    assert!(out.contains("loopback pong"), "{out}");
    assert!(out.contains("['lo']"), "{out}");
    assert_eq!(
        listener.accept().map(|_| ()).unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock,
        "a connection reached the host's listener"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_bomb_is_capped_by_the_pids_limit() {
    let server = hardened().await;
    let id = open(&server).await;
    // Counting: forks succeed up to the limit (64 for the whole sandbox), then EAGAIN.
    let counting = r#"
import os, time
children = []
try:
    for _ in range(1000):
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        children.append(pid)
    print("uncapped", len(children))
except OSError as e:
    print("capped", len(children), e.errno)
"#;
    let out = python(&server, &id, counting).await.ok();
    let fields: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(fields[0], "capped", "{out}");
    // The cgroup counts the shell and python too; gVisor's RLIMIT_NPROC counts the
    // sandbox user's processes beyond python itself.
    assert!(fields[1].parse::<usize>().unwrap() <= 64, "{out}");
    assert_eq!(fields[2], "11", "EAGAIN: {out}");
    // A real fork bomb: capped, ended by the timeout with everything it made, and the
    // session goes on.
    let bomb = run(
        &server,
        request(
            &id,
            shell("bomb() { bomb | bomb & }; bomb; wait"),
            Some(Duration::from_secs(2)),
        ),
    )
    .await
    .unwrap();
    assert!(
        matches!(
            bomb.state(),
            pb::OperationState::TimedOut
                | pb::OperationState::Succeeded
                | pb::OperationState::Failed
        ),
        "{:?}",
        bomb.completed
    );
    let caps = server.capabilities().await;
    assert!(command_pids(&caps, &id).is_empty());
    assert_eq!(sh(&server, &id, "echo alive").await.ok(), "alive\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocation_over_the_memory_limit_is_oom_killed_and_the_session_goes_on() {
    let server = hardened().await;
    let id = open(&server).await;
    let done = python(&server, &id, "b = b'x' * (1 << 30); print(len(b))").await;
    done.failed("OOMKilled");
    assert_eq!(done.completed.signal, Some(9), "{:?}", done.completed);
    assert!(done.stdout.is_empty());
    assert_eq!(sh(&server, &id, "echo next").await.ok(), "next\n");
    // Well under the limit is fine.
    let out = python(&server, &id, "b = b'x' * (64 << 20); print(len(b))")
        .await
        .ok();
    assert_eq!(out, format!("{}\n", 64 << 20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_setsid_double_fork_dies_on_cancel_and_on_close() {
    let server = hardened().await;
    let caps = server.capabilities().await;
    let id = open(&server).await;
    let line = "setsid bash -c 'sleep 1000 & sleep 1000 & wait' & echo started; wait";
    for ending in ["cancel", "close"] {
        let mut stream = begin(&server, request(&id, shell(line), None))
            .await
            .unwrap();
        assert_eq!(stdout_lines(&mut stream, 1).await, ["started"]);
        if BACKEND == Backend::Gvisor {
            // The programs are gVisor's processes, not the host's: follow them with
            // `runsc ps`, and the sandbox's own host processes on close.
            let sleeps = || {
                sandbox_processes(&server, &id)
                    .iter()
                    .filter(|c| *c == "sleep")
                    .count()
            };
            let deadline = Instant::now() + DEADLINE;
            while sleeps() < 2 {
                assert!(
                    Instant::now() < deadline,
                    "the sleeps did not start: {:?}",
                    sandbox_processes(&server, &id)
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let host = sandbox_host_pids(&id);
            assert!(!host.is_empty(), "the sandbox runs on the host");
            match ending {
                "cancel" => {
                    drop(stream);
                    await_idle(&server, &id).await;
                    let deadline = Instant::now() + DEADLINE;
                    while sleeps() > 0 {
                        assert!(Instant::now() < deadline, "the sleeps survived the cancel");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    assert!(host.iter().all(|pid| alive(*pid)), "the sandbox goes on");
                }
                _ => {
                    close(&server, &id, Some(Duration::from_millis(100)), true)
                        .await
                        .unwrap();
                    drop(stream);
                    await_gone(&host, "the sandbox").await;
                    assert!(sandbox_processes(&server, &id).is_empty());
                }
            }
            continue;
        }
        // The shell, the setsid'd shell, two sleeps (and the process that waits for the
        // command): all in the command's cgroup, whatever session they made.
        let deadline = Instant::now() + DEADLINE;
        let pids = loop {
            let pids = command_pids(&caps, &id);
            if pids.len() >= 4 {
                break pids;
            }
            assert!(
                Instant::now() < deadline,
                "processes did not start: {pids:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert!(pids.iter().all(|pid| alive(*pid)), "{pids:?}");
        match ending {
            "cancel" => drop(stream),
            _ => {
                close(&server, &id, Some(Duration::from_millis(100)), true)
                    .await
                    .unwrap();
                drop(stream);
            }
        }
        await_gone(&pids, ending).await;
        if ending == "cancel" {
            await_idle(&server, &id).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_system_calls_fail_and_what_python_needs_works() {
    let server = hardened().await;
    let id = open(&server).await;
    let denied: Vec<(String, i64, u64)> = DENIED
        .iter()
        .map(|(name, nr)| ((*name).to_owned(), *nr, 0u64))
        .chain(
            DENIED_WITH_NEWUSER
                .iter()
                .map(|(name, nr)| ((*name).to_owned(), *nr, libc::CLONE_NEWUSER as u64)),
        )
        .collect();
    let allowed: Vec<(&str, i64)> = vec![
        ("getpid", libc::SYS_getpid),
        ("getppid", libc::SYS_getppid),
        ("getuid", libc::SYS_getuid),
        ("sched_yield", libc::SYS_sched_yield),
        ("brk", libc::SYS_brk),
        ("dup", libc::SYS_dup),
        ("uname", libc::SYS_uname),
        ("getcwd", libc::SYS_getcwd),
        ("clock_gettime", libc::SYS_clock_gettime),
        ("getrandom", libc::SYS_getrandom),
        ("pipe2", libc::SYS_pipe2),
        ("socket", libc::SYS_socket),
        ("epoll_create1", libc::SYS_epoll_create1),
        ("eventfd2", libc::SYS_eventfd2),
        ("memfd_create", libc::SYS_memfd_create),
        ("prlimit64", libc::SYS_prlimit64),
    ];
    let script = format!(
        r#"
import ctypes, json, os, subprocess, tempfile, threading, socket, select, sqlite3
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
buf = ctypes.create_string_buffer(4096)
def call(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return r, ctypes.get_errno()
out = {{"denied": {{}}, "allowed": {{}}, "works": {{}}}}
for name, nr, flags in {denied}:
    out["denied"][name] = call(nr, flags, 0, 0, 0, 0, 0)
out["clone3"] = call({clone3}, 0, 0)
out["x32"] = call(0x40000000 | {getpid}, 0, 0)
args = {{
    "dup": (1,), "uname": (ctypes.addressof(buf),), "getcwd": (ctypes.addressof(buf), 4096),
    "clock_gettime": (1, ctypes.addressof(buf)), "getrandom": (ctypes.addressof(buf), 8, 0),
    "pipe2": (ctypes.addressof(buf), 0o2000000), "socket": (1, 1, 0), "brk": (0,),
    "epoll_create1": (0,), "eventfd2": (0, 0), "memfd_create": (ctypes.addressof(buf), 0),
    "prlimit64": (0, 7, 0, ctypes.addressof(buf)),
}}
for name, nr in {allowed}:
    out["allowed"][name] = call(nr, *args.get(name, ()))
def check(name, f):
    try:
        f()
        out["works"][name] = True
    except Exception as e:
        out["works"][name] = repr(e)
def thread():
    t = threading.Thread(target=lambda: None); t.start(); t.join()
check("thread", thread)
check("subprocess", lambda: subprocess.run(["/bin/true"], check=True))
def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
check("fork", fork)
check("tempfile", lambda: tempfile.TemporaryFile().write(b"x"))
def pair():
    a, b = socket.socketpair()
    a.send(b"x")
    assert b.recv(1) == b"x"
check("socketpair", pair)
check("epoll", lambda: select.epoll().close())
check("urandom", lambda: os.urandom(16))
check("sqlite", lambda: sqlite3.connect(":memory:").execute("select 1").fetchall())
print(json.dumps(out))
"#,
        denied = serde_json::to_string(&denied).unwrap(),
        allowed = serde_json::to_string(&allowed).unwrap(),
        clone3 = libc::SYS_clone3,
        getpid = libc::SYS_getpid,
    );
    let done = python(&server, &id, &script).await;
    let out = done.ok();
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    for (name, _, _) in &denied {
        let [r, errno] = report["denied"][name].as_array().unwrap().as_slice() else {
            panic!("{name}: {report}");
        };
        assert_eq!(r.as_i64(), Some(-1), "{name} succeeded: {report}");
        assert_eq!(errno.as_i64(), Some(libc::EPERM as i64), "{name}: {report}");
    }
    assert_eq!(
        report["clone3"],
        serde_json::json!([-1, libc::ENOSYS]),
        "{report}"
    );
    // x32 numbers never reach the rules (ENOSYS from the filter, or from a kernel
    // without x32).
    assert_eq!(
        report["x32"],
        serde_json::json!([-1, libc::ENOSYS]),
        "{report}"
    );
    for (name, _) in &allowed {
        let [r, errno] = report["allowed"][name].as_array().unwrap().as_slice() else {
            panic!("{name}: {report}");
        };
        assert!(
            r.as_i64().unwrap() >= 0,
            "{name} failed with errno {errno}: {report}"
        );
    }
    for (name, works) in report["works"].as_object().unwrap() {
        assert_eq!(works, &serde_json::json!(true), "{name}: {report}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sandbox_cannot_trace_or_signal_its_runtime_server() {
    let server = hardened().await;
    let id = open(&server).await;
    let pid = server.child.id();
    let script = format!(
        r#"
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
ctypes.set_errno(0)
print("ptrace", libc.ptrace(16, {pid}, 0, 0), ctypes.get_errno())
for sig in (0, signal.SIGTERM, signal.SIGKILL):
    try:
        os.kill({pid}, sig)
        print("SIGNALLED", sig)
    except OSError as e:
        print("kill", int(sig), e.errno)
print(os.path.exists("/proc/{pid}"))
"#
    );
    let out = python(&server, &id, &script).await;
    let text = out.ok();
    assert!(
        text.starts_with(&format!("ptrace -1 {}\n", libc::EPERM)),
        "{text}"
    );
    assert!(!text.contains("SIGNALLED"), "{text}");
    assert!(text.contains("False"), "{text}");
    assert!(alive(pid as i32));
    assert!(server.capabilities().await.ready);
    assert_eq!(sh(&server, &id, "echo still").await.ok(), "still\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_whose_sandbox_ends_fails_with_sandbox_lost() {
    let server = hardened().await;
    let id = open(&server).await;
    assert_eq!(sh(&server, &id, "echo up").await.ok(), "up\n");
    // Kill the session's holder from outside, as a crash would: its PID 1 dies with it.
    let holders = sandbox_host_pids(&id);
    assert!(!holders.is_empty(), "the holder runs");
    for pid in &holders {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
    }
    // Under gvisor the next command starts at once, while the sandbox kernel still exits
    // (its threads outlive the kill): the command's end is seen before the sandbox's.
    if BACKEND == Backend::Namespaces {
        await_gone(&holders, "the holder").await;
    }
    let done = sh(&server, &id, "echo never").await;
    done.failed("SandboxLost");
    let status = status(&server, &id).await.unwrap();
    assert_eq!(status.state(), pb::SessionState::Failed, "{status:?}");
    assert_eq!(status.reason, "SandboxLost", "{status:?}");
    // The server itself goes on.
    assert!(server.capabilities().await.ready);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_kills_itself_is_signaled_and_the_sandbox_lives_on() {
    let server = hardened().await;
    let id = open(&server).await;
    let done = sh(&server, &id, "kill -KILL $$").await;
    done.failed("Signaled");
    assert_eq!(done.completed.signal, Some(9));
    let status = status(&server, &id).await.unwrap();
    assert_eq!(status.state(), pb::SessionState::Ready, "{status:?}");
    assert_eq!(sh(&server, &id, "echo still").await.ok(), "still\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_takes_its_sandboxes_with_it() {
    let mut server = hardened().await;
    let id = open(&server).await;
    let mut stream = begin(
        &server,
        request(&id, shell("echo started; sleep 1000"), None),
    )
    .await
    .unwrap();
    assert_eq!(stdout_lines(&mut stream, 1).await, ["started"]);
    let sandbox = sandbox_host_pids(&id);
    assert!(!sandbox.is_empty(), "the sandbox runs");
    // A crash: no shutdown, no closing. The lifeline ends every sandbox, and with it the
    // command and everything on the host that served it.
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    drop(stream);
    await_gone(&sandbox, "the sandbox").await;
    let deadline = Instant::now() + DEADLINE;
    loop {
        let left: Vec<i32> = kruntimes_testkit::procs::mentioning(&id.run_uid)
            .into_iter()
            .map(|p| p.pid)
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "left behind: {left:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Two sessions on one server (one worker): `a` holds a secret in its environment
/// (`A_SECRET`) and in a file of its workspace its own command wrote, and runs a long
/// command whose argv 0 is `marker`, which holds its queue; `b` is the neighbour whose
/// commands try to reach it, with a secret of its own (`B_SECRET`) for the controls.
struct Neighbours {
    a: pb::ExecutionId,
    b: pb::ExecutionId,
    a_ws: PathBuf,
    b_ws: PathBuf,
    a_secret: String,
    b_secret: String,
    marker: String,
    /// `a`'s running command (`sleep` behind `marker`); dropping it cancels it.
    running: tonic::Streaming<pb::SessionOperationEvent>,
}

async fn neighbours(server: &TestServer) -> Neighbours {
    let a = new_id();
    let b = new_id();
    let a_secret = format!("A-SECRET-{}", a.run_uid);
    let b_secret = format!("B-SECRET-{}", b.run_uid);
    let marker = format!("marker-{}", a.run_uid);
    let a_ws = workspace(
        &register_with(server, &a, Vec::new(), env(&[("A_SECRET", &a_secret)]))
            .await
            .unwrap(),
    );
    let b_ws = workspace(
        &register_with(server, &b, Vec::new(), env(&[("B_SECRET", &b_secret)]))
            .await
            .unwrap(),
    );
    // Written by the sandbox's user, the same uid as `b`'s: only the sandbox keeps it apart.
    sh(
        server,
        &a,
        "mkdir -p private && echo \"$A_SECRET\" > private/secret",
    )
    .await
    .ok();
    let mut running = begin(
        server,
        request(
            &a,
            shell(&format!("echo started; exec -a {marker} sleep 1000")),
            None,
        ),
    )
    .await
    .unwrap();
    assert_eq!(stdout_lines(&mut running, 1).await, ["started"]);
    Neighbours {
        a,
        b,
        a_ws,
        b_ws,
        a_secret,
        b_secret,
        marker,
        running,
    }
}

impl Neighbours {
    /// `a`'s command still runs, and once cancelled `a` still has its file and its
    /// environment: the secrets `b` did not find were there to find.
    async fn a_is_untouched(self, server: &TestServer) {
        assert!(
            !status(server, &self.a)
                .await
                .unwrap()
                .running_operation_id
                .is_empty(),
            "a's command ended"
        );
        drop(self.running);
        await_idle(server, &self.a).await;
        let out = sh(
            server,
            &self.a,
            "cat private/secret; echo \"$A_SECRET\"; ls private",
        )
        .await
        .ok();
        let secret = &self.a_secret;
        assert_eq!(out, format!("{secret}\n{secret}\nsecret\n"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sessions_cannot_read_or_write_each_others_files() {
    let server = hardened().await;
    let n = neighbours(&server).await;
    let theirs = n.a_ws.join("private/secret").display().to_string();
    let their_ws = n.a_ws.display().to_string();
    let parent = n.a_ws.parent().unwrap().display().to_string();
    // By absolute path, through /proc (every process's root and cwd), through symlinks
    // and a hard link; then writes into the other workspace the same ways.
    let line = format!(
        r#"
echo mine > mine
cat "$PWD/mine" && echo 'control: own absolute path'
ln -s "$PWD/mine" own-link && cat own-link && echo 'control: own symlink'
cat '{theirs}' 2>/dev/null && echo 'READ by path'
ls '{their_ws}' 2>/dev/null && echo 'LISTED by path'
ls -a '{parent}' 2>/dev/null | grep -c -- '{a}'
for p in /proc/[0-9]* /proc/self /proc/thread-self; do
    cat "$p/root{theirs}" 2>/dev/null && echo "READ via $p/root"
    ls "$p/cwd/private" 2>/dev/null && echo "LISTED via $p/cwd"
done
ln -s '{theirs}' file-link; cat file-link 2>/dev/null && echo 'READ via a symlink'
ln -s '{their_ws}' dir-link; cat dir-link/private/secret 2>/dev/null && echo 'READ via a directory symlink'
ln -s '{relative}' relative-link; cat relative-link 2>/dev/null && echo 'READ via a relative symlink'
ln '{theirs}' hard-link 2>/dev/null && echo 'LINKED hard'
(echo pwned > '{their_ws}/planted') 2>/dev/null && echo 'WROTE by path'
(echo pwned > dir-link/planted) 2>/dev/null && echo 'WROTE via a directory symlink'
(echo pwned > file-link) 2>/dev/null && echo 'WROTE via a file symlink'
mv mine '{their_ws}/moved' 2>/dev/null && echo 'MOVED in'
rm -f '{theirs}' 2>/dev/null; true
"#,
        a = n.a.run_uid,
        relative = "../".repeat(16) + theirs.trim_start_matches('/'),
    );
    let out = sh(&server, &n.b, &line).await.ok();
    assert!(out.contains("control: own absolute path"), "{out}");
    assert!(out.contains("control: own symlink"), "{out}");
    for word in ["READ", "LISTED", "LINKED", "WROTE", "MOVED"] {
        assert!(!out.contains(word), "{word}: {out}");
    }
    assert!(!out.contains(&n.a_secret), "{out}");
    // The other workspace is not even a name in the parent directory.
    let shown: Vec<&str> = out.lines().filter(|l| l.parse::<u32>().is_ok()).collect();
    assert_eq!(shown, ["0"], "{out}");
    // The server's file operations do not follow the links the neighbour made either.
    for link in ["file-link", "dir-link", "relative-link"] {
        assert_eq!(
            code(read(&server, &n.b, link).await),
            tonic::Code::InvalidArgument,
            "{link}"
        );
    }
    assert_eq!(
        code(read(&server, &n.b, "dir-link/private/secret").await),
        tonic::Code::InvalidArgument
    );
    assert_eq!(
        code(list(&server, &n.b, "dir-link", 0, "").await),
        tonic::Code::InvalidArgument
    );
    op(&server, &n.b, write("dir-link/planted", b"pwned"))
        .await
        .unwrap()
        .failed("PathEscapes");
    // Nothing in `a`'s workspace changed: only what its own command made is there.
    let mut names: Vec<String> = std::fs::read_dir(&n.a_ws)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["private"], "{out}");
    assert_eq!(
        std::fs::read_to_string(n.a_ws.join("private/secret")).unwrap(),
        format!("{}\n", n.a_secret)
    );
    assert!(n.b_ws.join("mine").exists(), "the neighbour's own file");
    n.a_is_untouched(&server).await;
}

/// What `b` sees of every process in its /proc: pid → (cmdline, environ), each NUL
/// turned into a space, or the error; and its own pid. No secret or marker is in the script.
const PROCESS_DUMP: &str = r#"
import json, os
procs = {}
for p in os.listdir("/proc"):
    if not p.isdigit():
        continue
    entry = {}
    for f in ("cmdline", "environ"):
        try:
            with open(f"/proc/{p}/{f}", "rb") as fh:
                entry[f] = fh.read().replace(b"\0", b" ").decode("latin-1")
        except OSError as e:
            entry[f] = f"error {e.errno}"
    procs[p] = entry
print(json.dumps({"procs": procs, "self": str(os.getpid())}))
"#;

/// The processes of a [`PROCESS_DUMP`] report as `pid: cmdline` (cut to 100 bytes) for a
/// failure message: never their environments, which a broken sandbox would fill with the
/// host's.
fn processes(report: &serde_json::Value) -> String {
    let mut lines = String::new();
    for (pid, entry) in report["procs"].as_object().into_iter().flatten() {
        let cmdline = entry["cmdline"].as_str().unwrap_or_default();
        let cut = cmdline
            .char_indices()
            .nth(100)
            .map_or(cmdline.len(), |(i, _)| i);
        lines.push_str(&format!("\n{pid}: {}", &cmdline[..cut]));
    }
    lines
}

/// The pids of a [`PROCESS_DUMP`] report whose environment holds `needle`.
fn environ_holding(report: &serde_json::Value, needle: &str) -> Vec<String> {
    report["procs"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(_, e)| e["environ"].as_str().unwrap_or_default().contains(needle))
        .map(|(pid, _)| pid.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sessions_cannot_see_or_signal_each_others_processes() {
    let server = hardened().await;
    let n = neighbours(&server).await;
    let caps = server.capabilities().await;
    // `a`'s processes as the host numbers them: its command's (namespaces), or its
    // sandbox's kernel and file proxy (gvisor, whose `sleep` is gVisor's own process).
    let host_pids = match BACKEND {
        Backend::Namespaces => command_pids(&caps, &n.a),
        Backend::Gvisor => sandbox_host_pids(&n.a),
    };
    assert!(!host_pids.is_empty(), "a's processes run");
    if BACKEND == Backend::Gvisor {
        assert!(
            sandbox_processes(&server, &n.a)
                .iter()
                .any(|c| c == "sleep"),
            "{:?}",
            sandbox_processes(&server, &n.a)
        );
    }
    let dump = python(&server, &n.b, PROCESS_DUMP).await.ok();
    let report: serde_json::Value = serde_json::from_str(dump.trim()).unwrap();
    let procs = report["procs"].as_object().unwrap();
    let dump = processes(&report);
    // The neighbour sees only its own few processes, and none of `a`'s.
    assert!(
        procs.len() <= 6,
        "{} processes visible: {dump}",
        procs.len()
    );
    let own = &procs[report["self"].as_str().unwrap()];
    assert!(
        own["cmdline"].as_str().unwrap().contains("python3"),
        "control: its own cmdline: {dump}"
    );
    for (pid, entry) in procs {
        let cmdline = entry["cmdline"].as_str().unwrap();
        assert!(!cmdline.contains(&n.marker), "a's command as {pid}: {dump}");
        assert!(!cmdline.contains("sleep"), "a's sleep as {pid}: {dump}");
    }
    for pid in &host_pids {
        assert!(!procs.contains_key(&pid.to_string()), "{pid}: {dump}");
    }
    // Signals by the host's numbers: none exists in the neighbour's view; SIGKILL too.
    let script = format!(
        r#"
import os, signal
for pid in {host_pids:?}:
    for sig in (0, signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
            print("SIGNALLED", pid, int(sig))
        except OSError as e:
            print("kill", pid, int(sig), e.errno)
    print("exists", pid, os.path.exists(f"/proc/{{pid}}"))
"#
    );
    let out = python(&server, &n.b, &script).await.ok();
    assert!(!out.contains("SIGNALLED"), "{out}");
    assert!(!out.contains("True"), "{out}");
    assert_eq!(
        out.lines()
            .filter(|l| l.starts_with("kill "))
            .filter(|l| l.ends_with(&format!(" {}", libc::ESRCH)))
            .count(),
        host_pids.len() * 3,
        "every signal: no such process: {out}"
    );
    // A signal to every process it may signal (-1) reaches none of `a`'s.
    sh(&server, &n.b, "kill -KILL -1 2>/dev/null; true").await;
    assert!(host_pids.iter().all(|pid| alive(*pid)), "{host_pids:?}");
    n.a_is_untouched(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sessions_cannot_read_each_others_environment() {
    let server = hardened().await;
    let n = neighbours(&server).await;
    let raw = python(&server, &n.b, PROCESS_DUMP).await.ok();
    let report: serde_json::Value = serde_json::from_str(raw.trim()).unwrap();
    let dump = processes(&report);
    for needle in [n.a_secret.as_str(), "A_SECRET"] {
        assert!(
            environ_holding(&report, needle).is_empty() && !raw.contains(needle),
            "{needle} in the environment of {:?}:{dump}",
            environ_holding(&report, needle)
        );
    }
    // Control: the neighbour reads its own environment through /proc.
    let own = &report["procs"][report["self"].as_str().unwrap()];
    assert!(
        own["environ"]
            .as_str()
            .unwrap()
            .contains(&format!("B_SECRET={}", n.b_secret)),
        "control: its own environment:{dump}"
    );
    // Nor by name, nor through any file it can reach.
    let out = sh(
        &server,
        &n.b,
        "echo \"[$A_SECRET]\"; env | grep -c A_SECRET; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c SECRET= ; true",
    )
    .await
    .ok();
    // `[]`, no A_SECRET in env, and only B_SECRET in its own processes' environments.
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[..2], ["[]", "0"], "{out}");
    assert!(!out.contains(&n.a_secret), "{out}");
    let seen: usize = lines[2].parse().unwrap();
    assert!(seen >= 1, "control: its own B_SECRET: {out}");
    let own = sh(
        &server,
        &n.b,
        "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | grep SECRET= | sort -u",
    )
    .await
    .ok();
    // Named only in the message: a broken sandbox would show the host's variables here.
    let names: Vec<&str> = own.lines().filter_map(|l| l.split('=').next()).collect();
    assert!(
        own == format!("B_SECRET={}\n", n.b_secret),
        "the variables named SECRET in its processes: {names:?}"
    );
    n.a_is_untouched(&server).await;
}
