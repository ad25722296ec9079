//! Background loops of the arbiter ([`Tasks`], reached by [`Arbiter::tasks`]), named workers (`workers.rs`) stopped by a cancellation
//! token: the keepalive reaper
//! (idle sessions end), reclaim deadlines (late holders are revoked), compute-turn
//! quanta, the leasable refresh (memory taken by processes outside the broker shrinks what
//! it hands out), and the NVML process watch (GPU memory per session).

use super::state::Revoke;
use super::Arbiter;
use crate::lease::LeaseState;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Growth of memory used outside the broker below this is noise (driver bookkeeping,
/// the broker's own context growing), not a neighbour: 64 MiB, or 1/1024 of a small device.
fn outside_noise(total: u64) -> u64 {
    (64u64 << 20).min(total / 1024)
}

/// The background loops of one arbiter ([`Arbiter::tasks`]); the workers that run them are
/// the lifecycle's (`lifecycle.rs`), so it keeps no fields.
pub struct Tasks<'a> {
    pub(super) arb: &'a Arc<Arbiter>,
}

impl Tasks<'_> {
    /// Starts the background workers (`workers.rs`); they end when `stop` is cancelled
    /// ([`Lifecycle::join`](super::Lifecycle::join) waits for them).
    pub(crate) fn start(&self, stop: CancellationToken) {
        // This is the main runtime: effects' tasks and the store writer's changes run
        // here from now on, not in whichever runtime asks first.
        self.arb.lifecycle.enter_main_runtime();
        let me = self.arb.clone();
        self.arb
            .lifecycle
            .spawn_worker("ticker", stop.clone(), async move {
                // Fine enough for compute-turn quanta of tens of milliseconds.
                let mut tick = tokio::time::interval(Duration::from_millis(20));
                let mut last_reap = Instant::now();
                loop {
                    tick.tick().await;
                    // Kept slots past their window, yield requests past the quantum,
                    // turns taken past quantum + grace.
                    me.with_turns(|t| t.tick(Instant::now(), std::time::SystemTime::now()));
                    me.tasks().enforce_reclaim_deadlines();
                    if last_reap.elapsed() >= Duration::from_millis(500) {
                        last_reap = Instant::now();
                        me.tasks().reap_idle_sessions();
                        me.sessions().end_of_lapsed_tokens();
                        me.tasks().rearm_reclaim(me.cfg.reclaim_deadline * 2);
                    }
                }
            });
        let me = self.arb.clone();
        self.arb
            .lifecycle
            .spawn_worker("leasable-refresh", stop, async move {
                let mut tick = tokio::time::interval(me.cfg.refresh_interval);
                loop {
                    tick.tick().await;
                    me.tasks().refresh_leasable().await;
                }
            });
    }

    /// Every 2 s, attributes per-process GPU memory (NVML) to sessions and reports
    /// workers that allocate beyond `allowance` on their own; ends when `stop` is cancelled.
    pub fn spawn_process_watch(
        &self,
        monitor: Arc<crate::gpu_processes::ProcessMonitor>,
        allowance: u64,
        stop: CancellationToken,
    ) {
        let me = self.arb.clone();
        self.arb
            .lifecycle
            .spawn_worker("gpu-process-watch", stop, async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    let m = monitor.clone();
                    if let Ok(usage) = tokio::task::spawn_blocking(move || m.usage_by_pid()).await {
                        me.sessions().apply_process_usage(&usage, allowance);
                    }
                }
            });
    }

    /// Ends sessions idle for longer than the keepalive timeout.
    fn reap_idle_sessions(&self) {
        let timeout = self.arb.cfg.keepalive_timeout;
        if timeout.is_zero() {
            return;
        }
        let idle = self.arb.lock().sessions().idle(timeout, Instant::now());
        for id in idle {
            self.arb.end_session(id, "no keepalive within the timeout");
        }
    }

    /// Re-reads each device's free memory. Memory used outside the broker beyond what
    /// was used at start shrinks the leasable amount (and trims the cache to fit).
    pub(super) async fn refresh_leasable(&self) {
        for (i, slot) in self.arb.devices.iter().enumerate() {
            // Nothing outside the broker uses a simulated device.
            if slot.thread.desc().backend == crate::device::BackendKind::Host {
                continue;
            }
            let Ok(Ok(info)) = slot.thread.call(|d| d.mem_info()).await else {
                continue;
            };
            let mut st = self.arb.lock();
            let pool = &st.pools()[i];
            // Memory a free left with a process outside the broker is the broker's while
            // its charge is on its way (`Arbiter::free_on_device`).
            let held = pool.held_on_device() + self.arb.unverified.of(i);
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

    /// Revokes leases whose reclaim deadline passed. Returns how many.
    pub(super) fn enforce_reclaim_deadlines(&self) -> usize {
        let late: Vec<Uuid> = {
            let st = self.arb.lock();
            let now = st.clock().now;
            st.leases()
                .iter()
                .filter(|l| matches!(l.state, LeaseState::ReclaimRequested { deadline, .. } if deadline <= now))
                .map(|l| l.id)
                .collect()
        };
        for id in &late {
            let _ = self.arb.revoke(*id, &Revoke::ReclaimDeadline);
        }
        late.len()
    }

    /// Re-arms reclaim for waiters whose earlier request was not enough.
    pub(super) fn rearm_reclaim(&self, older_than: Duration) {
        let mut st = self.arb.lock();
        let now = st.clock().now;
        st.rearm_reclaim(older_than, now);
    }
}
