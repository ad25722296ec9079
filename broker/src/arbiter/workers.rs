//! The arbiter's background workers, by name: `ticker` (compute-turn quanta, reclaim
//! deadlines, the keepalive reaper, reclaim re-arming), `leasable-refresh` (memory used
//! outside the broker) and `gpu-process-watch` (NVML memory per session). Each runs until
//! its stop token is cancelled; [`Workers::join`] waits for them to end (the shutdown
//! path) and names any that did not.

use parking_lot::Mutex;
use std::future::Future;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The running workers.
#[derive(Debug, Default)]
pub struct Workers {
    running: Mutex<Vec<(&'static str, JoinHandle<()>)>>,
}

impl Workers {
    /// Starts `work` as worker `name`; it ends when `stop` is cancelled (or on its own).
    pub fn spawn(
        &self,
        name: &'static str,
        stop: CancellationToken,
        work: impl Future<Output = ()> + Send + 'static,
    ) {
        let handle = tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = work => {}
            }
            tracing::debug!(worker = name, "worker stopped");
        });
        let mut running = self.running.lock();
        running.retain(|(_, h)| !h.is_finished());
        running.push((name, handle));
    }

    /// Names of the workers still running.
    pub fn names(&self) -> Vec<&'static str> {
        self.running
            .lock()
            .iter()
            .filter(|(_, h)| !h.is_finished())
            .map(|(n, _)| *n)
            .collect()
    }

    /// Waits up to `within` for every worker to end (their stop tokens cancelled first by
    /// the caller); returns the names of those still running, which are aborted.
    pub async fn join(&self, within: Duration) -> Vec<&'static str> {
        let all: Vec<_> = std::mem::take(&mut *self.running.lock());
        let deadline = tokio::time::Instant::now() + within;
        let mut stuck = Vec::new();
        for (name, mut h) in all {
            if tokio::time::timeout_at(deadline, &mut h).await.is_err() {
                tracing::warn!(worker = name, "worker did not stop in time; aborted");
                h.abort();
                stuck.push(name);
            }
        }
        stuck
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn workers_stop_with_their_token_and_are_named_until_then() {
        let w = Workers::default();
        let stop = CancellationToken::new();
        w.spawn("forever", stop.clone(), std::future::pending());
        w.spawn("also", stop.clone(), async {
            loop {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        tokio::task::yield_now().await;
        assert_eq!(w.names(), vec!["forever", "also"]);
        stop.cancel();
        assert!(w.join(Duration::from_secs(5)).await.is_empty());
        assert!(w.names().is_empty());
    }

    #[tokio::test]
    async fn a_worker_whose_token_is_not_cancelled_is_named_and_aborted() {
        let w = Workers::default();
        w.spawn("stubborn", CancellationToken::new(), std::future::pending());
        assert_eq!(w.join(Duration::from_millis(50)).await, vec!["stubborn"]);
    }
}
