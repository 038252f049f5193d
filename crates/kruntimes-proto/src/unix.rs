//! A tonic [`Channel`] to a server on a Unix socket: how runtimed reaches its local runtime
//! server. Transport glue only; it knows nothing of the services.

use std::path::PathBuf;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// Why a channel could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("failed to connect to the gRPC server on Unix socket {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
}

/// Connects to the gRPC server listening on the Unix socket at `path`. The channel
/// reconnects by itself if the server restarts.
pub async fn connect(path: impl Into<PathBuf>) -> Result<Channel, ConnectError> {
    let path = path.into();
    let socket = path.clone();
    // The URI is required by the API but unused: every connection goes to `socket`.
    Endpoint::from_static("http://runtime-server.invalid")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { UnixStream::connect(socket).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|source| ConnectError::Connect { path, source })
}
