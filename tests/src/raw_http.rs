//! Hand-made HTTP/1.1 against the agent's and the rules service's listeners: from a chosen loopback
//! address (each of 127.0.0.0/8 is a peer of its own), half-sent, one exchange on a kept-alive
//! connection, and whether the server has closed a connection.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// A connection to `addr` from `from` (e.g. `127.0.0.2`: Linux answers every 127/8 address on lo).
pub async fn connect_from(from: IpAddr, addr: SocketAddr) -> TcpStream {
    let socket = match from {
        IpAddr::V4(_) => TcpSocket::new_v4(),
        IpAddr::V6(_) => TcpSocket::new_v6(),
    }
    .expect("a socket");
    socket
        .bind(SocketAddr::new(from, 0))
        .expect("bind the source address");
    socket.connect(addr).await.expect("connect")
}

/// A connection from `from` that sends a request's line and one header, and never the rest.
pub async fn half_sent(from: IpAddr, addr: SocketAddr, path: &str) -> TcpStream {
    let mut s = connect_from(from, addr).await;
    // A refused connection may already be closed; the write then fails, which is fine here.
    let _ = s
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n").as_bytes())
        .await;
    s
}

/// Whether the server has closed `s` (end of stream or reset): false while it is open and silent.
/// Panics if the server sent bytes instead.
pub fn closed(s: &TcpStream) -> bool {
    let mut buf = [0u8; 512];
    match s.try_read(&mut buf) {
        Ok(0) => true,
        Ok(n) => {
            // hyper answers a head that timed out with nothing, a refused connection gets nothing:
            // bytes here would be an answer the test did not expect.
            panic!("the server answered: {:?}", String::from_utf8_lossy(&buf[..n]))
        }
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
        Err(_) => true,
    }
}

/// Sends `request` (a whole HTTP/1.1 request) on `s` and reads one answer, keeping the connection
/// open: (status, head, body). Panics after 5 s.
pub async fn exchange(s: &mut TcpStream, request: &str) -> (u16, String, String) {
    let fut = async {
        s.write_all(request.as_bytes()).await.expect("write the request");
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let n = s.read(&mut chunk).await.expect("read the answer");
            assert!(n > 0, "the connection closed before an answer");
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let length: usize = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().ok())?
            })
            .unwrap_or(0);
        while buf.len() < head_end + length {
            let n = s.read(&mut chunk).await.expect("read the body");
            assert!(n > 0, "the connection closed mid-body");
            buf.extend_from_slice(&chunk[..n]);
        }
        let status = head.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = String::from_utf8_lossy(&buf[head_end..head_end + length]).into_owned();
        (status, head, body)
    };
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .expect("an answer within 5 s")
}
