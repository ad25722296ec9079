//! Background loops of the arbiter, named workers (`workers.rs`) stopped by a cancellation
//! token: the keepalive reaper
//! (idle sessions end), reclaim deadlines (late holders are revoked), compute-turn
//! quanta, the leasable refresh (memory taken by processes outside the broker shrinks what
//! it hands out), and the NVML process watch (GPU memory per session).

use super::Arbiter;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Growth of memory used outside the broker below this is noise (driver bookkeeping,
/// the broker's own context growing), not a neighbour: 64 MiB, or 1/1024 of a small device.
fn outside_noise(total: u64) -> u64 {
    (64u64 << 20).min(total / 1024)
}

impl Arbiter {
    /// Starts the background workers (`workers.rs`); they end when `stop` is cancelled
    /// ([`Arbiter::join_workers`] waits for them).
    pub fn spawn_background(self: &Arc<Self>, stop: CancellationToken) {
        // This is the main runtime: what effects spawn (a grant's device work, a watcher)
        // runs here from now on, also when an operator's call on the operators' runtime
        // (or the store writer) is what let a waiter in.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let _ = self.main_runtime.set(rt);
        }
        // The store writer starts here, inside the main runtime (what its changes spawn,
        // grants and watchers, runs there), not in whichever runtime asks first.
        if let Err(e) = self.store_writer() {
            tracing::error!("{e}");
        }
        let me = self.clone();
        self.workers.spawn("ticker", stop.clone(), async move {
            // Fine enough for compute-turn quanta of tens of milliseconds.
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            let mut last_reap = Instant::now();
            loop {
                tick.tick().await;
                me.tick_turns();
                me.enforce_reclaim_deadlines();
                if last_reap.elapsed() >= Duration::from_millis(500) {
                    last_reap = Instant::now();
                    me.reap_idle_sessions();
                    me.end_sessions_of_lapsed_tokens();
                    me.rearm_reclaim(me.cfg.reclaim_deadline * 2);
                }
            }
        });
        let me = self.clone();
        self.workers.spawn("leasable-refresh", stop, async move {
            let mut tick = tokio::time::interval(me.cfg.refresh_interval);
            loop {
                tick.tick().await;
                me.refresh_leasable().await;
            }
        });
    }

    /// Waits (up to `within`) for the background workers to end after their stop token
    /// was cancelled; returns the names of any that did not (they are aborted). Then the
    /// health monitor's fault source stops what it runs (`FaultSource::stop`: NVML's Xid
    /// event thread, joined), and the store writer stops, once the changes handed to it
    /// are done.
    pub async fn join_workers(&self, within: Duration) -> Vec<&'static str> {
        let stuck = self.workers.join(within).await;
        self.stop_fault_source().await;
        self.stop_store_writer();
        stuck
    }

    /// The health monitor's fault source (NVML's) ends what it runs on its own (the Xid
    /// event thread) and is waited for, off the runtime; the slot is left empty.
    async fn stop_fault_source(&self) {
        // The slot's lock is released before the source's is taken (the lock order).
        let source = self.health_source.lock().take();
        if let Some(s) = source {
            let _ = tokio::task::spawn_blocking(move || s.lock().stop()).await;
        }
    }

    /// Where effects' tasks run: the main runtime once [`Arbiter::spawn_background`] ran
    /// on it, else the caller's (an arbiter driven alone, in tests); None outside any.
    pub(crate) fn effects_runtime(&self) -> Option<tokio::runtime::Handle> {
        self.main_runtime
            .get()
            .cloned()
            .or_else(|| tokio::runtime::Handle::try_current().ok())
    }

    /// Names of the background workers running now.
    pub fn worker_names(&self) -> Vec<&'static str> {
        self.workers.names()
    }

    /// Every 2 s, attributes per-process GPU memory (NVML) to sessions and reports
    /// workers that allocate beyond `allowance` on their own; ends when `stop` is cancelled.
    pub fn spawn_process_watch(
        self: &Arc<Self>,
        monitor: crate::gpu_processes::ProcessMonitor,
        allowance: u64,
        stop: CancellationToken,
    ) {
        let me = self.clone();
        let monitor = Arc::new(monitor);
        self.workers.spawn("gpu-process-watch", stop, async move {
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                let m = monitor.clone();
                if let Ok(usage) = tokio::task::spawn_blocking(move || m.usage_by_pid()).await {
                    me.apply_process_usage(&usage, allowance);
                }
            }
        });
    }

    /// Ends sessions idle for longer than the keepalive timeout.
    pub(crate) fn reap_idle_sessions(self: &Arc<Self>) {
        let timeout = self.cfg.keepalive_timeout;
        if timeout.is_zero() {
            return;
        }
        let idle = self.lock().sessions().idle(timeout, Instant::now());
        for id in idle {
            self.end_session(id, "no keepalive within the timeout");
        }
    }

    /// Re-reads each device's free memory. Memory used outside the broker beyond what
    /// was used at start shrinks the leasable amount (and trims the cache to fit).
    pub(crate) async fn refresh_leasable(self: &Arc<Self>) {
        for (i, slot) in self.devices.iter().enumerate() {
            // Nothing outside the broker uses a simulated device.
            if slot.thread.desc().backend == crate::device::BackendKind::Host {
                continue;
            }
            let Ok(Ok(info)) = slot.thread.call(|d| d.mem_info()).await else {
                continue;
            };
            let mut st = self.lock();
            let pool = &st.pools()[i];
            let held = pool.held_on_device();
            let external = info.total.saturating_sub(info.free).saturating_sub(held);
            // Ignore small drift (driver bookkeeping, the broker's own context growing):
            // the headroom covers it, and the leasable amount does not flap.
            let mut grown = external.saturating_sub(slot.external_at_start());
            if grown < outside_noise(info.total) {
                grown = 0;
            }
            let gran = pool.granularity();
            let leasable = slot.leasable_at_start().saturating_sub(grown) / gran * gran;
            if leasable != pool.leasable() {
                tracing::warn!(
                    device = i,
                    external,
                    leasable,
                    "memory used outside the broker changed; leasable adjusted"
                );
                st.set_leasable(i as u32, leasable);
            }
            // Keep the headroom free for everyone: when processes outside the broker ate
            // into it, give cached (unused) blocks back to the device.
            if info.free < slot.headroom && st.pools()[i].stats().cached > 0 {
                let short = slot.headroom - info.free;
                let blocks = st.evict_cached(i as u32, short);
                tracing::warn!(
                    device = i,
                    free = info.free,
                    headroom = slot.headroom,
                    blocks,
                    "free memory below the headroom: cached blocks given back to the device"
                );
            }
        }
    }
}
