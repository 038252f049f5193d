//! The embedded API server against hostile and malformed requests (issue 14 items 3, 5 and
//! 8): nested YAML, oversized and slow bodies, slow headers, bad `dryRun` values, unknown
//! media types and garbage apply bodies. Each test starts its own `kruntimes up
//! --apiserver-only` on an ephemeral port and speaks raw HTTP/1.1 over TLS to it, so it can
//! send what no well-behaved client would.
//!
//! Nothing sleeps to synchronise: every wait is on an answer, an end of stream or a task,
//! under a deadline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use kruntimes_testkit::Server;
use kruntimes_testkit::setup::{kruntimes_rule, service_account_token};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// The longest one raw request may take before the test fails.
const REQUEST_DEADLINE: Duration = Duration::from_secs(60);
/// Answers are read up to this size.
const MAX_ANSWER: usize = 1 << 20;

/// A raw HTTPS client of one server: its address, its CA and the admin token.
#[derive(Clone)]
struct Raw {
    addr: String,
    connector: TlsConnector,
    admin: String,
}

/// A parsed answer.
#[derive(Debug)]
struct Answer {
    code: u16,
    head: String,
    body: String,
}

impl Answer {
    /// The value of header `name` (case-insensitive).
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    fn json(&self) -> Result<Value> {
        serde_json::from_str(&self.body).with_context(|| format!("not JSON: {:?}", self.body))
    }

    /// Checks the code and that the body is a Kubernetes Status with this code.
    fn status(&self, code: u16) -> Result<Value> {
        ensure!(self.code == code, "expected {code}, got {self:?}");
        ensure!(
            self.header("content-type") == Some("application/json"),
            "a Status is JSON: {self:?}"
        );
        let status = self.json()?;
        ensure!(
            status["kind"] == "Status" && status["code"] == code,
            "expected a Status {code}: {status}"
        );
        Ok(status)
    }
}

impl Raw {
    async fn new(server: &Server) -> Result<Raw> {
        let ca = std::fs::read(server.data_dir().join("pki").join("ca.crt"))
            .context("read the server's CA")?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pemfile::certs(&mut ca.as_slice()) {
            roots.add(cert.context("parse the CA")?)?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let addr = server
            .url()
            .strip_prefix("https://")
            .context("the server URL is not https")?
            .to_string();
        Ok(Raw {
            addr,
            connector: TlsConnector::from(Arc::new(config)),
            admin: kruntimes_testkit::admin_token(&server.kubeconfig_path())?,
        })
    }

    async fn connect(&self) -> Result<TlsStream<tokio::net::TcpStream>> {
        let tcp = tokio::net::TcpStream::connect(&self.addr).await?;
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?.to_owned();
        Ok(self.connector.connect(name, tcp).await?)
    }

    /// Sends one request (`Connection: close`) and reads the whole answer.
    async fn send(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Answer> {
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n",
            self.addr
        );
        if let Some(token) = token {
            head.push_str(&format!("Authorization: Bearer {token}\r\n"));
        }
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        if !headers
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case("content-length"))
        {
            head.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
        head.push_str("\r\n");
        let exchange = async {
            let mut stream = self.connect().await?;
            stream.write_all(head.as_bytes()).await?;
            stream.write_all(body).await?;
            stream.flush().await?;
            read_answer(&mut stream).await
        };
        tokio::time::timeout(REQUEST_DEADLINE, exchange)
            .await
            .with_context(|| format!("{method} {path}: no answer within {REQUEST_DEADLINE:?}"))?
    }

    async fn admin(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Answer> {
        let token = self.admin.clone();
        self.send(method, path, Some(&token), headers, body).await
    }
}

/// Reads an HTTP/1.1 answer to its end (the server closes after `Connection: close`).
async fn read_answer(stream: &mut TlsStream<tokio::net::TcpStream>) -> Result<Answer> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            // A peer that closes without close_notify still delivered its answer.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e.into()),
        }
        ensure!(
            raw.len() <= MAX_ANSWER,
            "answer larger than {MAX_ANSWER} bytes"
        );
    }
    parse_answer(&raw)
}

fn parse_answer(raw: &[u8]) -> Result<Answer> {
    let text = String::from_utf8_lossy(raw);
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("no complete answer head in {text:?}"))?;
    let code: u16 = head
        .split_whitespace()
        .nth(1)
        .context("no status code")?
        .parse()?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(rest)?
    } else {
        rest.to_string()
    };
    Ok(Answer {
        code,
        head: head.to_string(),
        body,
    })
}

fn dechunk(mut rest: &str) -> Result<String> {
    let mut out = String::new();
    loop {
        let (size, tail) = rest.split_once("\r\n").context("bad chunk")?;
        let size = usize::from_str_radix(size.trim(), 16)?;
        if size == 0 {
            return Ok(out);
        }
        out.push_str(tail.get(..size).context("short chunk")?);
        rest = tail.get(size + 2..).context("short chunk")?;
    }
}

/// `depth` nested flow sequences: `[[[...]]]`.
fn nested_yaml(depth: usize) -> Vec<u8> {
    let mut body = vec![b'['; depth];
    body.extend(std::iter::repeat_n(b']', depth));
    body
}

/// Runs `attack` from four tasks in a loop while probing an admin `list runs` and
/// `/readyz`, each of which must be served within a generous second (the issue's acceptance
/// is 100 ms, on a quieter machine). Returns every attack answer with how long it took.
async fn probe_during(
    raw: &Raw,
    attack: impl Fn(Raw) -> futures::future::BoxFuture<'static, Result<Answer>> + Clone + Send + 'static,
) -> Result<Vec<(Duration, Answer)>> {
    let attacking = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let mut attackers = Vec::new();
    for _ in 0..4 {
        let (raw, attacking, attack) = (raw.clone(), attacking.clone(), attack.clone());
        attackers.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            // Keep attacking until the probes are done, so they run during the attack.
            while attacking.load(std::sync::atomic::Ordering::SeqCst) || answers.is_empty() {
                let started = Instant::now();
                let answer = attack(raw.clone()).await?;
                answers.push((started.elapsed(), answer));
            }
            anyhow::Ok(answers)
        }));
    }
    let mut slowest = Duration::ZERO;
    let probed = async {
        for _ in 0..5 {
            for path in [
                "/apis/kruntimes.io/v1alpha1/namespaces/default/runs",
                "/readyz",
            ] {
                let started = Instant::now();
                let answer = raw.admin("GET", path, &[], b"").await?;
                let took = started.elapsed();
                ensure!(
                    answer.code == 200,
                    "GET {path} during the attack: {answer:?}"
                );
                ensure!(
                    took < Duration::from_secs(1),
                    "GET {path} took {took:?} during the attack"
                );
                slowest = slowest.max(took);
            }
        }
        anyhow::Ok(())
    }
    .await;
    // The figure the issue asks for, printed (not asserted: timing belongs in benchmarks).
    eprintln!("slowest legitimate request during the attack: {slowest:?}");
    attacking.store(false, std::sync::atomic::Ordering::SeqCst);
    probed?;
    let mut all = Vec::new();
    for attacker in attackers {
        all.extend(attacker.await??);
    }
    Ok(all)
}

async fn start() -> Result<(Server, Raw)> {
    start_with(&[]).await
}

/// Starts `kruntimes up --apiserver-only` with `extra` arguments.
async fn start_with(extra: &[&str]) -> Result<(Server, Raw)> {
    let options = kruntimes_testkit::Options {
        extra_args: extra.iter().map(|a| a.to_string()).collect(),
        ..kruntimes_testkit::Options::default()
    };
    let server = tokio::task::spawn_blocking(move || Server::start_with(options))
        .await
        .context("join the server start")??;
    let raw = Raw::new(&server).await?;
    Ok((server, raw))
}

/// A token of a ServiceAccount that may only read Runs in `default`.
async fn read_only_token(server: &Server) -> Result<String> {
    let admin = server.client().await?;
    service_account_token(
        &admin,
        "default",
        "reader",
        vec![kruntimes_rule(&["get", "list"], &["runs"])],
        3600,
    )
    .await
}

/// Issue 14 item 3: a 200 KB `application/yaml` body of 100,000 nested brackets took 19 s
/// of CPU to be refused (quadratic), and four at once (through
/// `selfsubjectaccessreviews`, which any token may call) held an admin `list runs` and
/// `/readyz` for tens of seconds. Now nesting is bounded before parsing, in linear time,
/// and large parses run off the async workers: the attack is refused with 400 at once and
/// legitimate requests are served while it goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_yaml_is_refused_quickly_and_does_not_stall_other_requests() -> Result<()> {
    let (server, raw) = start().await?;
    let token = read_only_token(&server).await?;
    let body = Arc::new(nested_yaml(100_000));
    let attack = {
        let (token, body) = (token.clone(), body.clone());
        move |raw: Raw| {
            let (token, body) = (token.clone(), body.clone());
            Box::pin(async move {
                raw.send(
                    "POST",
                    "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                    Some(&token),
                    &[("Content-Type", "application/yaml")],
                    &body,
                )
                .await
            }) as futures::future::BoxFuture<'static, Result<Answer>>
        }
    };
    for (took, answer) in probe_during(&raw, attack).await? {
        let status = answer.status(400)?;
        ensure!(
            status["message"]
                .as_str()
                .is_some_and(|m| m.contains("nested deeper")),
            "the refusal says why: {status}"
        );
        // Generous: refused in linear time, far from the 19 s the issue measured.
        ensure!(
            took < Duration::from_secs(5),
            "a nested body took {took:?} to refuse"
        );
    }
    // The same nesting in a create, an update and an apply is refused the same way.
    let runs = "/apis/kruntimes.io/v1alpha1/namespaces/default/runs";
    let yaml = [("Content-Type", "application/yaml")];
    raw.admin("POST", runs, &yaml, &body).await?.status(400)?;
    let apply = [("Content-Type", "application/apply-patch+yaml")];
    raw.admin("PATCH", &format!("{runs}/x?fieldManager=t"), &apply, &body)
        .await?
        .status(400)?;
    // Flow collections under the limit are still parsed.
    let plain = "apiVersion: kruntimes.io/v1alpha1\nkind: Run\nmetadata: {name: plain, labels: {a: b}}\nspec: {runtime: rt, mode: {task: {entrypoint: main.py, args: [x]}}}\n";
    let created = raw.admin("POST", runs, &yaml, plain.as_bytes()).await?;
    ensure!(created.code == 201, "a plain YAML create: {created:?}");
    Ok(())
}

/// Issue 14 item 3, the other half: a large YAML body that is within every bound still costs
/// real CPU to decode (about a second per MiB in a debug build). It is decoded on the
/// blocking pool, one at a time, so four such bodies at once from a read-only token leave
/// the async workers free for everyone else; before, the decode ran on the async workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_yaml_bodies_are_decoded_off_the_async_workers() -> Result<()> {
    let (server, raw) = start().await?;
    let token = read_only_token(&server).await?;
    let mut yaml = String::from(
        "apiVersion: authorization.k8s.io/v1\nkind: SelfSubjectAccessReview\nspec:\n  resourceAttributes: {verb: list, group: kruntimes.io, resource: runs, namespace: default}\nmetadata:\n  annotations:\n",
    );
    let mut i = 0;
    while yaml.len() < 1 << 20 {
        yaml.push_str(&format!("    k{i}: v\n"));
        i += 1;
    }
    let body = Arc::new(yaml.into_bytes());
    let attack = {
        let (token, body) = (token.clone(), body.clone());
        move |raw: Raw| {
            let (token, body) = (token.clone(), body.clone());
            Box::pin(async move {
                raw.send(
                    "POST",
                    "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                    Some(&token),
                    &[("Content-Type", "application/yaml")],
                    &body,
                )
                .await
            }) as futures::future::BoxFuture<'static, Result<Answer>>
        }
    };
    for (_, answer) in probe_during(&raw, attack).await? {
        ensure!(answer.code == 201, "a large review: {answer:?}");
        ensure!(
            answer.json()?["status"]["allowed"] == true,
            "the reader may list runs: {}",
            answer.body
        );
    }
    Ok(())
}

const RUNS: &str = "/apis/kruntimes.io/v1alpha1/namespaces/default/runs";

/// Issue 14 item 5: `Content-Length: 10 GiB` with one byte sent got no answer for 90 s.
/// It is refused at the header: 413 with a Status, at once (well before the default 30 s
/// body timeout), and the connection is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_declared_body_is_refused_at_the_header() -> Result<()> {
    let (_server, raw) = start().await?;
    let started = Instant::now();
    let answer = raw
        .admin(
            "POST",
            RUNS,
            &[
                ("Content-Type", "application/json"),
                ("Content-Length", "10737418240"),
            ],
            b"{",
        )
        .await?;
    let took = started.elapsed();
    let status = answer.status(413)?;
    ensure!(
        status["reason"] == "RequestEntityTooLarge",
        "413 reason: {status}"
    );
    ensure!(
        answer.header("connection") == Some("close"),
        "the connection is closed after a refused body: {answer:?}"
    );
    ensure!(
        took < Duration::from_secs(10),
        "the 413 took {took:?}: it waited for the body"
    );
    // Without a token it is 401, before anything else.
    let answer = raw
        .send(
            "POST",
            RUNS,
            None,
            &[("Content-Length", "10737418240")],
            b"{",
        )
        .await?;
    ensure!(answer.code == 401, "without a token: {answer:?}");
    // A body within the limit is still served.
    let run = br#"{"apiVersion":"kruntimes.io/v1alpha1","kind":"Run","metadata":{"name":"small"},"spec":{"runtime":"rt","mode":{"task":{"entrypoint":"main.py"}}}}"#;
    let answer = raw
        .admin("POST", RUNS, &[("Content-Type", "application/json")], run)
        .await?;
    ensure!(answer.code == 201, "a small create: {answer:?}");
    Ok(())
}

/// Issue 14 item 5: a body that arrives slowly (here: one byte of a declared 100, then
/// nothing) is answered 408 once the body timeout passes, instead of holding the request
/// open for as long as the client likes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_body_is_answered_408_after_the_body_timeout() -> Result<()> {
    let (_server, raw) = start_with(&["--apiserver-body-timeout", "1s"]).await?;
    let answer = raw
        .admin(
            "POST",
            RUNS,
            &[
                ("Content-Type", "application/json"),
                ("Content-Length", "100"),
            ],
            b"{",
        )
        .await?;
    let status = answer.status(408)?;
    ensure!(status["reason"] == "Timeout", "408 reason: {status}");
    Ok(())
}

/// Slowloris: a connection that never finishes its request's headers is closed once the
/// header timeout passes; before, it stayed open for as long as the client kept it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_finishes_its_headers_is_closed() -> Result<()> {
    let (_server, raw) = start_with(&["--apiserver-header-timeout", "1s"]).await?;
    let mut stream = raw.connect().await?;
    stream
        .write_all(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        .await?;
    stream.flush().await?;
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(REQUEST_DEADLINE, async {
        let mut buf = [0u8; 1024];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => rest.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    ensure!(
        closed.is_ok(),
        "the server kept a connection without complete headers open for {REQUEST_DEADLINE:?}"
    );
    let text = String::from_utf8_lossy(&rest);
    ensure!(
        !text.contains(" 200 "),
        "an unfinished request was served: {text}"
    );
    // The server still serves complete requests.
    let answer = raw.admin("GET", "/readyz", &[], b"").await?;
    ensure!(answer.code == 200, "readyz: {answer:?}");
    Ok(())
}

fn run_json(name: &str) -> Vec<u8> {
    format!(
        r#"{{"apiVersion":"kruntimes.io/v1alpha1","kind":"Run","metadata":{{"name":"{name}"}},"spec":{{"runtime":"rt","mode":{{"task":{{"entrypoint":"main.py"}}}}}}}}"#
    )
    .into_bytes()
}

/// Issue 14 item 8 (API-server part): `dryRun=Maybe` created the object, a `text/plain`
/// body was decoded as JSON, and a garbage apply body was merged and answered 200. Now, as
/// on Kubernetes: an invalid dryRun value is 400, an unknown media type 415, a garbage
/// apply body 400, and none of them changes anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_dry_run_media_type_and_apply_body_are_refused_and_change_nothing() -> Result<()> {
    let (_server, raw) = start().await?;
    let json = [("Content-Type", "application/json")];
    let exists = |name: &str| {
        let raw = raw.clone();
        let path = format!("{RUNS}/{name}");
        async move {
            let answer = raw.admin("GET", &path, &[], b"").await?;
            anyhow::Ok(answer.code == 200)
        }
    };

    for query in [
        "dryRun=Maybe",
        "dryRun=all",
        "dryRun=",
        "dryRun=All&dryRun=Maybe",
    ] {
        let status = raw
            .admin(
                "POST",
                &format!("{RUNS}?{query}"),
                &json,
                &run_json("maybe"),
            )
            .await?
            .status(400)?;
        ensure!(
            status["message"]
                .as_str()
                .is_some_and(|m| m.contains("Invalid dryRun value")),
            "{query}: {status}"
        );
    }
    ensure!(!exists("maybe").await?, "a refused dry run created the Run");
    // dryRun=All still answers as a create would, and creates nothing.
    let answer = raw
        .admin(
            "POST",
            &format!("{RUNS}?dryRun=All"),
            &json,
            &run_json("dry"),
        )
        .await?;
    ensure!(answer.code == 201, "dryRun=All: {answer:?}");
    ensure!(!exists("dry").await?, "dryRun=All created the Run");

    let created = raw.admin("POST", RUNS, &json, &run_json("kept")).await?;
    ensure!(created.code == 201, "create: {created:?}");
    let before = raw
        .admin("GET", &format!("{RUNS}/kept"), &[], b"")
        .await?
        .json()?;
    let merge = [("Content-Type", "application/merge-patch+json")];
    raw.admin(
        "PATCH",
        &format!("{RUNS}/kept?dryRun=Maybe"),
        &merge,
        br#"{"metadata":{"labels":{"x":"y"}}}"#,
    )
    .await?
    .status(400)?;
    raw.admin("DELETE", &format!("{RUNS}/kept?dryRun=Maybe"), &[], b"")
        .await?
        .status(400)?;
    raw.admin(
        "DELETE",
        &format!("{RUNS}/kept"),
        &json,
        br#"{"dryRun":["Maybe"]}"#,
    )
    .await?
    .status(400)?;

    for content_type in [
        "text/plain",
        "application/xml",
        "application/apply-patch+yaml",
    ] {
        let status = raw
            .admin(
                "POST",
                RUNS,
                &[("Content-Type", content_type)],
                &run_json("plain"),
            )
            .await?
            .status(415)?;
        ensure!(
            status["message"]
                .as_str()
                .is_some_and(|m| m.contains("the body of the request was in an unknown format")),
            "{content_type}: {status}"
        );
    }
    ensure!(!exists("plain").await?, "a text/plain body created the Run");
    raw.admin(
        "PUT",
        &format!("{RUNS}/kept"),
        &[("Content-Type", "text/plain")],
        &run_json("kept"),
    )
    .await?
    .status(415)?;

    let apply = [("Content-Type", "application/apply-patch+yaml")];
    for garbage in [
        &b"garbage"[..],
        b"hello: world\n",
        b"{{{{",
        b"- 1\n- 2\n",
        b"\xff\xfe\x00garbage",
        b"apiVersion: v1\nkind: Pod\nmetadata: {name: kept}\n",
    ] {
        for name in ["kept", "new-from-garbage"] {
            let answer = raw
                .admin(
                    "PATCH",
                    &format!("{RUNS}/{name}?fieldManager=test"),
                    &apply,
                    garbage,
                )
                .await?;
            answer.status(400).with_context(|| {
                format!("apply {:?} to {name}", String::from_utf8_lossy(garbage))
            })?;
        }
    }
    ensure!(
        !exists("new-from-garbage").await?,
        "a garbage apply body created a Run"
    );
    let after = raw
        .admin("GET", &format!("{RUNS}/kept"), &[], b"")
        .await?
        .json()?;
    ensure!(
        after == before,
        "refused requests changed the Run:\nbefore {before}\nafter  {after}"
    );
    // A real apply body still works.
    let good = b"apiVersion: kruntimes.io/v1alpha1\nkind: Run\nmetadata:\n  name: kept\n  labels: {applied: \"yes\"}\n";
    let answer = raw
        .admin(
            "PATCH",
            &format!("{RUNS}/kept?fieldManager=test"),
            &apply,
            good,
        )
        .await?;
    ensure!(answer.code == 200, "a real apply: {answer:?}");
    Ok(())
}
