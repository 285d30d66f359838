//! Waiting for a condition with a patience bound, instead of sleeping a fixed time.

use std::future::Future;
use std::time::{Duration, Instant};

/// Polls `f` every 5 ms until it returns `Some`, and returns that; panics naming `what` after
/// `patience`.
pub async fn eventually<T, F, Fut>(what: &str, patience: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + patience;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if Instant::now() >= deadline {
            panic!("not within {patience:?}: {what}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
