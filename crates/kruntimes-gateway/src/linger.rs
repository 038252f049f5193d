//! A lingering close for the gateway's TCP connections.
//!
//! When the gateway refuses a request before reading its body (a 413 on a declared
//! length, an upload over the file cap), the client is often still sending that body.
//! Closing the socket then makes the kernel answer the client's next segments with a
//! reset, and a client whose write fails first (asyncio, for one, drops the connection on
//! a failed write without reading what already arrived) never sees the refusal: the
//! caller gets "connection reset" instead of a 413. The fix is the one web servers have
//! long used: after the answer is written and the write side shut down, keep reading and
//! discarding for a bounded time, so the client reads the answer and closes first.
//!
//! [`Lingering`] wraps the TCP stream beneath TLS. It is a plain pass-through until it is
//! dropped; then, if a linger slot is free, a task shuts the write side down (a no-op when
//! the TLS layer already did) and reads until the client closes, for at most
//! [`LINGER_FOR`] in all and [`LINGER_SILENCE`] without a byte. A client that closed first
//! ends it at once.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The longest a closed connection keeps reading, in all.
pub(crate) const LINGER_FOR: Duration = Duration::from_secs(5);
/// A lingering connection that receives nothing for this long is closed.
pub(crate) const LINGER_SILENCE: Duration = Duration::from_secs(1);
/// The most connections lingering at once; beyond it, a connection closes at once.
pub(crate) const MAX_LINGERING: usize = 1024;

/// The linger slots of one server.
#[derive(Clone, Debug)]
pub(crate) struct Lingerers(Arc<Semaphore>);

impl Lingerers {
    pub(crate) fn new() -> Lingerers {
        Lingerers(Arc::new(Semaphore::new(MAX_LINGERING)))
    }

    /// `tcp`, to linger when it is dropped.
    pub(crate) fn wrap(&self, tcp: TcpStream) -> Lingering {
        Lingering {
            tcp: Some(tcp),
            slots: self.0.clone(),
        }
    }
}

/// A TCP stream that lingers when dropped (see the module documentation).
#[derive(Debug)]
pub(crate) struct Lingering {
    /// `None` only once dropped.
    tcp: Option<TcpStream>,
    slots: Arc<Semaphore>,
}

impl Lingering {
    fn stream(&mut self) -> io::Result<Pin<&mut TcpStream>> {
        match self.tcp.as_mut() {
            Some(tcp) => Ok(Pin::new(tcp)),
            None => Err(io::ErrorKind::NotConnected.into()),
        }
    }
}

impl AsyncRead for Lingering {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut().stream() {
            Ok(tcp) => tcp.poll_read(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

impl AsyncWrite for Lingering {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut().stream() {
            Ok(tcp) => tcp.poll_write(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut().stream() {
            Ok(tcp) => tcp.poll_write_vectored(cx, bufs),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.as_ref().is_some_and(|tcp| tcp.is_write_vectored())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().stream() {
            Ok(tcp) => tcp.poll_flush(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().stream() {
            Ok(tcp) => tcp.poll_shutdown(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

impl Drop for Lingering {
    fn drop(&mut self) {
        let Some(tcp) = self.tcp.take() else {
            return;
        };
        // No slot (or no runtime, at process exit): close at once, as without lingering.
        let Ok(slot) = self.slots.clone().try_acquire_owned() else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(linger(tcp, slot));
        }
    }
}

/// Shuts `tcp`'s write side and reads and drops what still comes, until the peer closes,
/// for at most [`LINGER_FOR`] and [`LINGER_SILENCE`] between two reads.
async fn linger(mut tcp: TcpStream, _slot: OwnedSemaphorePermit) {
    let _ = tokio::time::timeout(LINGER_SILENCE, tcp.shutdown()).await;
    let discard = async {
        let mut scratch = vec![0u8; 64 * 1024];
        while let Ok(Ok(read)) = tokio::time::timeout(LINGER_SILENCE, tcp.read(&mut scratch)).await
        {
            if read == 0 {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(LINGER_FOR, discard).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// A pair of connected streams: the server's (wrapped) and the client's.
    async fn pair(lingerers: &Lingerers) -> io::Result<(Lingering, TcpStream)> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let client = TcpStream::connect(listener.local_addr()?).await?;
        let (server, _) = listener.accept().await?;
        Ok((lingerers.wrap(server), client))
    }

    #[tokio::test]
    async fn a_dropped_connection_reads_on_until_the_client_closes() -> io::Result<()> {
        let lingerers = Lingerers::new();
        let (mut server, mut client) = pair(&lingerers).await?;
        server.write_all(b"refused").await?;
        server.shutdown().await?;
        drop(server);
        // The client reads the answer and the end of it, then sends 8 MiB more: without the
        // linger, the closed socket resets the connection and these writes fail.
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await?;
        assert_eq!(answer, b"refused");
        let chunk = vec![b'x'; 64 * 1024];
        let writes = async {
            for _ in 0..128 {
                client.write_all(&chunk).await?;
            }
            client.flush().await
        };
        tokio::time::timeout(Duration::from_secs(30), writes)
            .await
            .map_err(|_| io::Error::other("the writes did not finish"))??;
        assert_eq!(lingerers.0.available_permits(), MAX_LINGERING - 1);
        // Closing ends the linger, and its slot comes back.
        drop(client);
        let all = tokio::time::timeout(
            Duration::from_secs(30),
            lingerers.0.acquire_many(MAX_LINGERING as u32),
        )
        .await
        .map_err(|_| io::Error::other("the linger did not end"))?;
        drop(all);
        Ok(())
    }

    #[tokio::test]
    async fn without_a_free_slot_a_connection_closes_at_once() -> io::Result<()> {
        let lingerers = Lingerers::new();
        let taken = lingerers
            .0
            .clone()
            .acquire_many_owned(MAX_LINGERING as u32)
            .await;
        let (server, mut client) = pair(&lingerers).await?;
        drop(server);
        // Nothing reads on: the closed socket resets the connection, so 8 MiB cannot all
        // be written.
        let chunk = vec![b'x'; 64 * 1024];
        let writes = async {
            for _ in 0..128 {
                client.write_all(&chunk).await?;
            }
            client.flush().await
        };
        let written = tokio::time::timeout(Duration::from_secs(30), writes)
            .await
            .map_err(|_| io::Error::other("the writes neither failed nor finished"))?;
        assert!(
            written.is_err(),
            "the writes succeeded without a lingering reader"
        );
        drop(taken);
        Ok(())
    }
}
