//! A bare protocol connection for tests that send hand-made (or broken) frames.

use std::path::Path;
use std::time::Duration;

use floodgate_protocol::{decode, DecodeError, Frame};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

trait Duplex: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Duplex for T {}

/// A raw connection to an agent (its Unix socket or its `--listen-tcp` address).
pub struct RawConn {
    stream: Box<dyn Duplex>,
    buf: Vec<u8>,
}

impl RawConn {
    /// Connects to the agent's socket.
    pub async fn connect(path: &Path) -> std::io::Result<Self> {
        Ok(RawConn {
            stream: Box::new(UnixStream::connect(path).await?),
            buf: Vec::new(),
        })
    }

    /// Connects to the agent's TCP listener.
    pub async fn connect_tcp(addr: std::net::SocketAddr) -> std::io::Result<Self> {
        Ok(RawConn {
            stream: Box::new(TcpStream::connect(addr).await?),
            buf: Vec::new(),
        })
    }

    /// Connects over TCP from `local` (another loopback address is another peer to the agent).
    pub async fn connect_tcp_from(
        local: std::net::IpAddr,
        addr: std::net::SocketAddr,
    ) -> std::io::Result<Self> {
        Ok(RawConn {
            stream: Box::new(crate::raw_http::connect_from(local, addr).await),
            buf: Vec::new(),
        })
    }

    /// Writes bytes as they are.
    pub async fn send_bytes(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes).await
    }

    /// Encodes and writes a frame.
    pub async fn send(&mut self, frame: &Frame) -> std::io::Result<()> {
        let bytes = frame.to_bytes().map_err(std::io::Error::other)?;
        self.send_bytes(&bytes).await
    }

    /// The next frame, or `None` when the agent closed the connection. Panics after 5 s.
    pub async fn recv(&mut self) -> Option<Frame> {
        tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match decode(&self.buf) {
                    Ok((frame, used)) => {
                        self.buf.drain(..used);
                        return Some(frame);
                    }
                    Err(DecodeError::Incomplete) => {}
                    Err(e) => panic!("agent sent a bad frame: {e}"),
                }
                match self.stream.read_buf(&mut self.buf).await {
                    Ok(0) | Err(_) => return None,
                    Ok(_) => {}
                }
            }
        })
        .await
        .expect("an answer or a close within 5 s")
    }
}
