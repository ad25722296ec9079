//! The byte stream under a caller-driven connection: a Unix socket or a TCP stream (no
//! TLS: `https://` addresses keep tonic's channel).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

/// Where a caller-driven connection dials.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    /// A Unix socket path.
    Unix(std::path::PathBuf),
    /// `host:port` over TCP.
    Tcp(String),
}

impl Target {
    /// Opens the stream (TCP without Nagle's delay, as tonic's channel does).
    pub(crate) async fn dial(&self) -> io::Result<Io> {
        match self {
            Target::Unix(path) => Ok(Io::Unix(UnixStream::connect(path).await?)),
            Target::Tcp(addr) => {
                let stream = TcpStream::connect(addr.as_str()).await?;
                stream.set_nodelay(true)?;
                Ok(Io::Tcp(stream))
            }
        }
    }
}

/// An open stream of either kind.
#[derive(Debug)]
pub(crate) enum Io {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Unix(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tcp(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Unix(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tcp(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Unix(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Unix(s) => s.is_write_vectored(),
            Io::Tcp(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Unix(s) => Pin::new(s).poll_flush(cx),
            Io::Tcp(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Unix(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tcp(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}
