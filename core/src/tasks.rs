//! Shutdown helpers shared by every role's background tasks: a `watch` channel turning true stops them.

use tokio::sync::watch;

/// Resolves once `shutdown` is true (or its sender is gone).
pub async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|s| *s).await.map(|_| ());
}

/// Runs `f` every `period` (the first time at once) until `shutdown`: every role's periodic chores.
pub async fn every<F, Fut>(period: std::time::Duration, mut shutdown: watch::Receiver<bool>, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut tick = tokio::time::interval(period);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopped(&mut shutdown) => break,
        }
        f().await;
    }
}
