//! Warm `namespaces` sandboxes (`--warm-sandboxes`): built ahead of time, each taken by one
//! Run and destroyed after it, never handed to a second Run, all gone at shutdown. Real
//! binary, real sandboxes; waits are on conditions with a deadline.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{DEADLINE, TestServer, new_id};
use kruntimes_proto::runtime::v1 as pb;
use kruntimes_runtime_server::sandbox::isolation::holder::HOLDER_ARG;

/// Writes a marker into the sandbox's private `/tmp` after printing the markers `/tmp`
/// held (the mount points of the Run's own paths may be there too when the test's root is
/// beneath the host's /tmp), and checks that the Run's workspace is bound writable.
const SCRIPT: &str = r#"echo "marks=[$(ls -A /tmp | grep '^mark-')]"
touch "/tmp/mark-$KRUNTIME_RUN_UID"
echo hi > "$KRUNTIME_WORKSPACE/out" && [ "$(cat "$KRUNTIME_WORKSPACE/out")" = hi ] && echo ws=ok
"#;

fn request() -> pb::ExecuteRequest {
    pb::ExecuteRequest {
        id: Some(new_id()),
        files: vec![pb::SourceFile {
            path: "main.sh".to_owned(),
            content: SCRIPT.as_bytes().to_vec(),
            executable: false,
        }],
        entrypoint: "main.sh".to_owned(),
        ..Default::default()
    }
}

/// The pids of this server's warm holders (parent and init of each; they share a
/// command line), bound or not.
fn warm_holders(stage: &Path) -> HashSet<i32> {
    let stage = stage.display().to_string();
    kruntimes_testkit::procs::matching(|p| {
        p.cmdline.contains(HOLDER_ARG)
            && p.cmdline.contains(&stage)
            && p.cmdline.contains("--control-fd")
    })
    .into_iter()
    .map(|p| p.pid)
    .collect()
}

/// Waits (with the deadline) until `done` holds for the warm holders.
async fn wait_holders(stage: &Path, what: &str, done: impl Fn(&HashSet<i32>) -> bool) {
    let until = Instant::now() + DEADLINE;
    loop {
        let holders = warm_holders(stage);
        if done(&holders) {
            return;
        }
        assert!(Instant::now() < until, "{what}: holders {holders:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn run_checked(server: &TestServer) {
    let status = server.run(request()).await;
    assert_eq!(
        status.state(),
        pb::ExecutionState::Succeeded,
        "status {status:?}"
    );
    let stdout = String::from_utf8(status.stdout_tail.unwrap().data).unwrap();
    // An empty /tmp: no earlier Run's marker, so no sandbox was handed out twice.
    assert_eq!(stdout, "marks=[]\nws=ok\n");
}

#[tokio::test(flavor = "multi_thread")]
async fn warm_sandboxes_are_taken_once_destroyed_after_use_and_gone_at_shutdown() {
    let server = TestServer::start_with(
        tempfile::tempdir().unwrap(),
        "bash",
        &["--sandbox", "namespaces", "--warm-sandboxes", "2"],
    )
    .await;
    let stage: PathBuf = server.root().canonicalize().unwrap().join(".sandbox-stage");
    // The pool fills: two sandboxes of two processes each.
    wait_holders(&stage, "the pool fills", |h| h.len() >= 4).await;
    let first = warm_holders(&stage);

    for _ in 0..6 {
        run_checked(&server).await;
    }
    // The first two were taken (and destroyed with their Runs); the pool refilled.
    wait_holders(&stage, "the pool refills with new sandboxes", |h| {
        h.len() >= 4 && h.is_disjoint(&first)
    })
    .await;

    // Concurrent takes: each Run still gets its own never-used sandbox.
    let runs: Vec<_> = (0..6).map(|_| run_checked(&server)).collect();
    futures_join_all(runs).await;

    drop(server);
    // Shutdown destroyed the pool: no holder of this server is left.
    assert_eq!(warm_holders(&stage), HashSet::new());
}

/// Runs the futures concurrently on this task.
async fn futures_join_all<F: std::future::Future<Output = ()>>(futures: Vec<F>) {
    let mut set = Vec::new();
    for f in futures {
        set.push(Box::pin(f));
    }
    let mut pending: Vec<_> = set.into_iter().map(Some).collect();
    std::future::poll_fn(|cx| {
        let mut all = true;
        for slot in &mut pending {
            if let Some(f) = slot {
                if f.as_mut().poll(cx).is_ready() {
                    *slot = None;
                } else {
                    all = false;
                }
            }
        }
        if all {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_pool_no_warm_sandbox_is_built() {
    let server = TestServer::start_with(
        tempfile::tempdir().unwrap(),
        "bash",
        &["--sandbox", "namespaces", "--warm-sandboxes", "0"],
    )
    .await;
    let stage = server.root().canonicalize().unwrap().join(".sandbox-stage");
    run_checked(&server).await;
    assert_eq!(warm_holders(&stage), HashSet::new());
}
