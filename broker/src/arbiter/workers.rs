//! The broker's background workers, by name. The arbiter's own: `ticker` (compute-turn
//! quanta, reclaim deadlines, the keepalive reaper, reclaim re-arming), `leasable-refresh`
//! (memory used outside the broker) and `gpu-process-watch` (NVML memory per session).
//! Registered by the broker's other loops through the arbiter's [`super::Lifecycle`]
//! (`spawn_worker`, `spawn_worker_to_end`): `health-monitor` and `grpc-health` (`health.rs`),
//! `tenants-config-watch` (`tenants_config.rs`), `admin-writable-health` (`server.rs`),
//! `tls-reload` (`tls.rs`), `metrics-http` (the metrics listener, on the operators'
//! runtime) and `signal-wait` (SIGTERM/SIGINT start the shutdown; both `server.rs`) and
//! `sighup` (`main.rs`). Each runs until its stop token is cancelled; [`Workers::join`]
//! waits for them to end (the shutdown path, before the store writer stops) and names any
//! that did not.

use parking_lot::Mutex;
use std::future::Future;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The running workers.
#[derive(Debug, Default)]
pub struct Workers {
    /// A leaf lock, taken with no other lock held (to add a worker, list them, or take
    /// them all for the join) and released before any wait.
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

    /// Starts `work` as worker `name`, left to end on its own: it watches its stop token
    /// itself, at the points where stopping leaves nothing half-done (a reload in flight
    /// finishes first).
    pub fn spawn_to_end(
        &self,
        name: &'static str,
        work: impl Future<Output = ()> + Send + 'static,
    ) {
        self.spawn_to_end_on(&tokio::runtime::Handle::current(), name, work);
    }

    /// [`Workers::spawn_to_end`] on runtime `rt` (the operators' runtime, say).
    pub fn spawn_to_end_on(
        &self,
        rt: &tokio::runtime::Handle,
        name: &'static str,
        work: impl Future<Output = ()> + Send + 'static,
    ) {
        let handle = rt.spawn(async move {
            work.await;
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

    #[tokio::test]
    async fn a_worker_left_to_end_finishes_its_step_before_join_returns() {
        let w = Workers::default();
        let stop = CancellationToken::new();
        let (step_tx, step_rx) = tokio::sync::oneshot::channel::<()>();
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, d) = (stop.clone(), done.clone());
        w.spawn_to_end("careful", async move {
            // A step already begun when the stop comes is finished, then the token read.
            let _ = step_rx.await;
            d.store(true, std::sync::atomic::Ordering::SeqCst);
            s.cancelled().await;
        });
        tokio::task::yield_now().await;
        stop.cancel();
        let join = tokio::spawn(async move {
            let stuck = w.join(Duration::from_secs(5)).await;
            (stuck, w.names())
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!join.is_finished(), "join waits for the step in flight");
        step_tx.send(()).unwrap();
        let (stuck, names) = join.await.unwrap();
        assert!(stuck.is_empty() && names.is_empty(), "{stuck:?} {names:?}");
        assert!(done.load(std::sync::atomic::Ordering::SeqCst));
    }
}
