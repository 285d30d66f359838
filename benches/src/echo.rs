//! The bare Unix-socket baseline: a server that answers each frame with a Decision-sized frame at
//! once, with the same runtime shape as the agent (tokio, one task per connection, batched writes).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use floodgate_protocol::{decode, Body, Decision, DecodeError, Frame, ItemDecision, Source, Verdict};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The echo server process, killed on drop.
pub struct EchoProcess(Child);

impl EchoProcess {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for EchoProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `loadgen echo --socket PATH` as its own process and waits for the socket.
pub fn spawn(socket: &Path) -> anyhow::Result<EchoProcess> {
    let exe = std::env::current_exe()?;
    let child = Command::new(exe)
        .arg("echo")
        .arg("--socket")
        .arg(socket)
        .stdout(Stdio::null())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(socket).is_err() {
        anyhow::ensure!(Instant::now() < deadline, "echo server did not start");
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(EchoProcess(child))
}

/// The answer the echo server sends: exactly the shape (and size) of an agent's one-item Decision.
fn answer(id: u32, out: &mut Vec<u8>) {
    let v = Verdict {
        allowed: true,
        log_only: false,
        holds_lease: false,
        over_quota: false,
        source: Source::Local,
        limit: 1_000_000_000_000,
        remaining: 999_999_999_999,
        reset_at_ms: 1_800_000_000_000,
        retry_after_ms: 0,
    };
    let d = Decision {
        combined: v,
        items: vec![ItemDecision {
            rule_id: "bench".into(),
            verdict: v,
            window_ms: 0,
        }],
    };
    Frame::new(id, Body::Decision(d))
        .encode(out)
        .expect("valid decision");
}

/// Serves until killed.
pub fn serve(socket: &PathBuf) -> anyhow::Result<()> {
    let _ = std::fs::remove_file(socket);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let listener = tokio::net::UnixListener::bind(socket)?;
        loop {
            let (stream, _) = listener.accept().await?;
            tokio::spawn(async move {
                let (mut rd, mut wr) = stream.into_split();
                let mut buf = Vec::with_capacity(16 * 1024);
                let mut out = Vec::with_capacity(16 * 1024);
                loop {
                    if buf.capacity() - buf.len() < 4096 {
                        buf.reserve(16 * 1024);
                    }
                    match rd.read_buf(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                    let mut pos = 0;
                    loop {
                        match decode(&buf[pos..]) {
                            Ok((frame, used)) => {
                                pos += used;
                                answer(frame.request_id, &mut out);
                            }
                            Err(DecodeError::Incomplete) => break,
                            Err(_) => return,
                        }
                    }
                    buf.drain(..pos);
                    if !out.is_empty() {
                        if wr.write_all(&out).await.is_err() {
                            return;
                        }
                        out.clear();
                    }
                }
            });
        }
    })
}
