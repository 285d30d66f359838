//! A small TCP proxy the tests own, to put latency between an agent and Redis.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Forwards 127.0.0.1:`port()` to a target port, delaying every chunk the target sends back by the
/// current delay, and each new connection's opening by the connect delay. Runs on its own thread and runtime, so it keeps time even when a test's runtime is
/// busy; stops on drop.
pub struct Proxy {
    port: u16,
    delay_ms: Arc<AtomicU64>,
    connect_delay_ms: Arc<AtomicU64>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Proxy {
    /// Starts a proxy to `target_port` with no delay.
    pub fn start(target_port: u16) -> Self {
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        std_listener.set_nonblocking(true).expect("nonblocking");
        let port = std_listener.local_addr().expect("addr").port();
        let delay_ms = Arc::new(AtomicU64::new(0));
        let connect_delay_ms = Arc::new(AtomicU64::new(0));
        let connect_delay = connect_delay_ms.clone();
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let delay = delay_ms.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("proxy runtime");
            rt.block_on(async move {
                let listener = TcpListener::from_std(std_listener).expect("listener");
                loop {
                    tokio::select! {
                        _ = &mut stopped => break,
                        accepted = listener.accept() => {
                            let Ok((client, _)) = accepted else { continue };
                            let delay = delay.clone();
                            let opening = connect_delay.load(Ordering::Relaxed);
                            tokio::spawn(async move {
                                if opening > 0 {
                                    tokio::time::sleep(Duration::from_millis(opening)).await;
                                }
                                let Ok(upstream) = TcpStream::connect(("127.0.0.1", target_port)).await else { return };
                                let (mut cr, mut cw) = client.into_split();
                                let (mut ur, mut uw) = upstream.into_split();
                                let up = tokio::spawn(async move { let _ = tokio::io::copy(&mut cr, &mut uw).await; });
                                let mut buf = vec![0u8; 64 * 1024];
                                loop {
                                    let n = match ur.read(&mut buf).await {
                                        Ok(0) | Err(_) => break,
                                        Ok(n) => n,
                                    };
                                    let d = delay.load(Ordering::Relaxed);
                                    if d > 0 {
                                        tokio::time::sleep(Duration::from_millis(d)).await;
                                    }
                                    if cw.write_all(&buf[..n]).await.is_err() {
                                        break;
                                    }
                                }
                                up.abort();
                            });
                        }
                    }
                }
            });
        });
        Proxy {
            port,
            delay_ms,
            connect_delay_ms,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// The port to connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT` through the proxy.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Delays every answer from the target by `d` from now on.
    pub fn set_delay(&self, d: Duration) {
        self.delay_ms.store(d.as_millis() as u64, Ordering::Relaxed);
    }

    /// Delays the opening of every connection accepted from now on by `d` (a slow connect, TLS
    /// handshake or AUTH): nothing is forwarded either way until then.
    pub fn set_connect_delay(&self, d: Duration) {
        self.connect_delay_ms
            .store(d.as_millis() as u64, Ordering::Relaxed);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
