//! A real S3-protocol server for tests: `s3s-fs` (objects as files under a temporary
//! root), served on `127.0.0.1:0` from its own thread and runtime, with SigV4
//! authentication by one generated access key, and one empty bucket.
//!
//! It is the S3 driver's counterpart in tests, never a mock: the driver speaks the real
//! protocol to it (signed requests, multipart uploads, listings, XML errors). Tests can
//! stop it (connections drop, the port refuses) and start it again on the same port to
//! exercise the store being down.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use anyhow::{Context, Result};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder as ConnBuilder;
use s3s::auth::SimpleAuth;
use s3s::service::S3ServiceBuilder;
use tokio::sync::oneshot;

/// The bucket every [`S3Server`] starts with.
pub const BUCKET: &str = "kruntimes-test";

/// A running S3-protocol server; stopped on drop.
pub struct S3Server {
    root: tempfile::TempDir,
    addr: SocketAddr,
    access_key: String,
    secret_key: String,
    running: Option<(oneshot::Sender<()>, JoinHandle<()>)>,
}

impl S3Server {
    /// Starts a server on `127.0.0.1:0` with an empty bucket [`BUCKET`].
    pub fn start() -> Result<S3Server> {
        let root = tempfile::Builder::new().prefix("kruntimes-s3").tempdir()?;
        std::fs::create_dir(root.path().join(BUCKET))?;
        let suffix = root
            .path()
            .file_name()
            .map(|n| {
                n.to_string_lossy()
                    .replace(|c: char| !c.is_ascii_alphanumeric(), "")
            })
            .unwrap_or_default();
        let mut server = S3Server {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            access_key: format!("AKTEST{suffix}"),
            secret_key: format!("secret-{suffix}-{}", std::process::id()),
            root,
            running: None,
        };
        server.serve()?;
        Ok(server)
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bucket, [`BUCKET`].
    pub fn bucket(&self) -> &str {
        BUCKET
    }

    /// The access key ID and secret the server accepts.
    pub fn credentials(&self) -> (&str, &str) {
        (&self.access_key, &self.secret_key)
    }

    /// The credentials as runtimed reads them: `AWS_ACCESS_KEY_ID` and
    /// `AWS_SECRET_ACCESS_KEY`, for [`crate::Options::env`].
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID".to_string(), self.access_key.clone()),
            ("AWS_SECRET_ACCESS_KEY".to_string(), self.secret_key.clone()),
        ]
    }

    /// The directory holding the bucket's objects: the object `key` is the file
    /// `bucket_dir().join(key)` once complete (uploads in progress live elsewhere).
    pub fn bucket_dir(&self) -> PathBuf {
        self.root.path().join(BUCKET)
    }

    /// The server's whole data directory.
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// Stops serving: the listener closes and open connections drop. Returns once the
    /// port refuses connections.
    pub fn stop(&mut self) {
        if let Some((stop, thread)) = self.running.take() {
            let _ = stop.send(());
            let _ = thread.join();
        }
    }

    /// Serves again on the same port, after [`S3Server::stop`].
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        self.serve()
    }

    fn serve(&mut self) -> Result<()> {
        let socket = std::net::TcpListener::bind(self.addr)
            .with_context(|| format!("bind the S3 server to {}", self.addr))?;
        socket.set_nonblocking(true)?;
        self.addr = socket.local_addr()?;
        let fs = s3s_fs::FileSystem::new(self.root.path())
            .map_err(|e| anyhow::anyhow!("open the S3 server's root: {e:?}"))?;
        let service = {
            let mut builder = S3ServiceBuilder::new(fs);
            builder.set_auth(SimpleAuth::from_single(
                self.access_key.clone(),
                self.secret_key.clone(),
            ));
            builder.build()
        };
        let (stop, mut stopped) = oneshot::channel::<()>();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name("s3-server".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let Ok(listener) = tokio::net::TcpListener::from_std(socket) else {
                        return;
                    };
                    let http = ConnBuilder::new(TokioExecutor::new());
                    let mut connections = tokio::task::JoinSet::new();
                    loop {
                        tokio::select! {
                            _ = &mut stopped => break,
                            accepted = listener.accept() => {
                                let Ok((stream, _)) = accepted else { continue };
                                let conn = http
                                    .serve_connection(TokioIo::new(stream), service.clone())
                                    .into_owned();
                                connections.spawn(async move {
                                    let _ = conn.await;
                                });
                            }
                            Some(_) = connections.join_next(), if !connections.is_empty() => {}
                        }
                    }
                    // Dropping the listener and the connections closes every socket.
                    drop(listener);
                    connections.shutdown().await;
                });
            })?;
        self.running = Some((stop, thread));
        Ok(())
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}
