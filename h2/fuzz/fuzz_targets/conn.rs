//! Fuzz target: a whole connection. The input, after the client preface, is what a client sends,
//! written in pieces whose sizes the input's first byte picks; the service answers one method at
//! once and another after a timer, so streams are answered in both paths. Time is tokio's paused
//! clock: timeouts fire as soon as the server would wait for them. The server must end (the input
//! runs out, then the socket closes) without a panic in its task.
#![no_main]

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use floodgate_h2::{serve, Config, Service, Status};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Mixed;

impl Service for Mixed {
    type Future = Pin<Box<dyn Future<Output = Result<Vec<u8>, Status>> + Send>>;

    fn call(&self, method: usize, message: &[u8], _trace: Option<&[u8]>) -> Self::Future {
        let answer = message.to_vec();
        match method {
            0 => Box::pin(std::future::ready(Ok(answer))),
            _ => Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(1)).await;
                if answer.first() == Some(&0xff) {
                    Err(Status::new(13, "the slow method says no"))
                } else {
                    Ok(answer)
                }
            }),
        }
    }

    fn read_traceparent(&self) -> bool {
        true
    }
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&pick, input)) = data.split_first() else {
        return;
    };
    let piece = usize::from(pick % 64) + 1;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let (client, server) = tokio::io::duplex(1 << 16);
        let (_stop_tx, stop) = tokio::sync::watch::channel(false);
        let config = Arc::new(Config::new(&[b"/a.B/Now", b"/a.B/Later"], &[b"a.B"]));
        let served = tokio::spawn(serve(server, Arc::new(Mixed), config, stop));
        let (mut rd, mut wr) = tokio::io::split(client);
        let drain = tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            while matches!(rd.read(&mut buf).await, Ok(n) if n > 0) {}
        });
        let _ = wr.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
        for chunk in input.chunks(piece) {
            if wr.write_all(chunk).await.is_err() {
                break;
            }
            tokio::task::yield_now().await;
        }
        let _ = wr.shutdown().await;
        drop(wr);
        // Paused time: the server's timers (frame timeout, linger, keepalive) pass at once.
        let ended = tokio::time::timeout(Duration::from_secs(600), served).await;
        match ended {
            Ok(Ok(_)) => {}
            Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Ok(Err(e)) => panic!("the connection's task failed: {e}"),
            Err(_) => panic!("the connection did not end within 600 s of its input ending"),
        }
        drain.abort();
    });
});
