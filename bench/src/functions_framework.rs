//! Google's Functions Framework for Python, the reference for `bench-functions`: the same
//! echo handler served by `functions-framework` (its gunicorn server, plain HTTP, one hop
//! on loopback), invoked by the same HTTP client stack as the gateway, in the same run.
//!
//! The framework is installed with pip into a virtualenv of Debian's `/usr/bin/python3`
//! (`--functions-framework-venv`, made on first use), started in its own process group and
//! killed with it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use http_body_util::BodyExt;

/// The framework's version pinned for the comparison.
pub const VERSION: &str = "3.10.2";

/// The handler: decode the request's JSON and answer it, as the kruntimes handler does.
const MAIN_PY: &str = "import functions_framework\nfrom flask import jsonify\n\n\
@functions_framework.http\ndef handle(request):\n    return jsonify(request.get_json())\n";

/// A running `functions-framework`, killed (with its process group) on drop.
pub struct Framework {
    child: Child,
    pub url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Framework {
    fn drop(&mut self) {
        let pgid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

/// Makes the virtualenv `venv` with the framework unless it has it already.
pub fn install(venv: &Path) -> Result<()> {
    let stamp = venv.join(format!(".functions-framework-{VERSION}"));
    if stamp.exists() {
        return Ok(());
    }
    let status = Command::new("/usr/bin/python3")
        .args(["-m", "venv"])
        .arg(venv)
        .status()
        .context("run /usr/bin/python3 -m venv")?;
    ensure!(
        status.success(),
        "python3 -m venv {} failed",
        venv.display()
    );
    let status = Command::new(venv.join("bin/pip"))
        .args(["install", "-q", &format!("functions-framework=={VERSION}")])
        .stdout(Stdio::null())
        .status()
        .context("run pip")?;
    ensure!(
        status.success(),
        "pip install functions-framework=={VERSION} failed"
    );
    std::fs::write(&stamp, b"")?;
    Ok(())
}

/// Starts the framework on a free loopback port and waits (up to 60 s) until it answers.
pub async fn start(venv: &Path) -> Result<Framework> {
    // Absolute: the framework starts in its own directory.
    let venv = &std::path::absolute(venv)?;
    install(venv)?;
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("main.py"), MAIN_PY)?;
    // A port the kernel picked, released for the framework to bind (a bench, not a test).
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let binary: PathBuf = venv.join("bin/functions-framework");
    let child = {
        use std::os::unix::process::CommandExt;
        Command::new(&binary)
            .args([
                "--source",
                "main.py",
                "--target",
                "handle",
                "--host",
                "127.0.0.1",
            ])
            .args(["--port", &port.to_string()])
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .with_context(|| format!("start {}", binary.display()))?
    };
    let framework = Framework {
        child,
        url: format!("http://127.0.0.1:{port}/"),
        _dir: dir,
    };
    let client = Client::new(&framework.url)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match client.invoke(&serde_json::json!({"ready": true})).await {
            Ok(()) => return Ok(framework),
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => bail!("functions-framework did not answer within 60 s: {e:#}"),
        }
    }
}

/// One kept-alive plain-HTTP connection to the framework, through the same client stack
/// (kube's hyper client) as the gateway's invoker.
#[derive(Clone)]
pub struct Client {
    client: kube::Client,
}

impl Client {
    pub fn new(url: &str) -> Result<Client> {
        let mut config = kube::Config::new(url.parse()?);
        config.default_retry = false;
        Ok(Client {
            client: kube::Client::try_from(config)?,
        })
    }

    /// Invokes once; fails unless the answer is 200 with the request echoed.
    pub async fn invoke(&self, event: &serde_json::Value) -> Result<()> {
        let answer = post_json(&self.client, "/", event).await?;
        ensure!(
            &answer == event,
            "functions-framework did not echo: {answer}"
        );
        Ok(())
    }
}

/// POSTs `event` as JSON to `path` and returns the answer's JSON; fails unless it is 200.
pub async fn post_json(
    client: &kube::Client,
    path: &str,
    event: &serde_json::Value,
) -> Result<serde_json::Value> {
    let request = http::Request::post(path)
        .header("content-type", "application/json")
        .body(kube::client::Body::from(serde_json::to_vec(event)?))?;
    let response = client.send(request).await.context("invoke")?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    ensure!(
        status == http::StatusCode::OK,
        "{path} answered {status}: {}",
        String::from_utf8_lossy(&body)
    );
    Ok(serde_json::from_slice(&body)?)
}
