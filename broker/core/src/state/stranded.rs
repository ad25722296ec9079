//! Stranded memory: memory the broker freed that stayed on the device because a process
//! outside it kept the block's import (CUDA VMM memory lives until its last importer lets
//! go, and the driver offers no revocation). The shell learns it from the driver when the
//! free is done (the device's free memory did not rise by the block) and hands it here:
//! it is charged again to the block's tenant, as quarantined bytes, until every process
//! that may keep it has exited (`Watch::Stranded`), so a tenant cannot keep memory past
//! its quota by releasing and keeping, and the outside-memory estimate (device used less
//! what the broker holds) does not count it a second time.

use super::State;
use crate::effects::Watch;
use std::collections::BTreeSet;
use std::time::Instant;
use uuid::Uuid;

/// Memory freed on a device and kept there by processes outside the broker.
#[derive(Debug)]
pub struct Stranded {
    pub tenant: String,
    pub device: u32,
    pub bytes: u64,
    /// The processes that may keep it, each watched; it is let go when none is left.
    pub pids: BTreeSet<u32>,
    pub since: Instant,
}

impl State {
    /// A free of `bytes` on `device` did not give the memory back: processes `pids`, which
    /// had the block's descriptor, may keep it. It is charged to `tenant` (the block's) as
    /// quarantined until they all exit. Returns its id; `None` (nothing counted) when no
    /// process is named or the tenant no longer exists: the memory then stays outside
    /// the books, as before.
    pub fn stranded(
        &mut self,
        tenant: &str,
        device: u32,
        bytes: u64,
        pids: impl IntoIterator<Item = u32>,
    ) -> Option<Uuid> {
        let pids: BTreeSet<u32> = pids.into_iter().collect();
        if pids.is_empty() || bytes == 0 || self.ledger.get(tenant).is_none() {
            return None;
        }
        let pool = self.pools.get_mut(device as usize)?;
        pool.strand(bytes);
        // The device has that much less room: cached blocks beyond it go back.
        let leasable = pool.leasable();
        self.set_leasable(device, leasable);
        self.ledger.add_quarantine(tenant, device, bytes);
        let id = Uuid::new_v4();
        for &pid in &pids {
            self.fx.watch(Watch::Stranded { id, pid });
        }
        self.stranded.insert(
            id,
            Stranded {
                tenant: tenant.to_string(),
                device,
                bytes,
                pids,
                since: self.clock.now,
            },
        );
        Some(id)
    }

    /// Process `pid` that may keep stranded memory `id` exited; the last one lets it go
    /// (the queue runs after the hold). True when that was the last.
    pub fn stranded_holder_gone(&mut self, id: Uuid, pid: u32) -> bool {
        let Some(s) = self.stranded.get_mut(&id) else {
            return false;
        };
        s.pids.remove(&pid);
        if !s.pids.is_empty() {
            return false;
        }
        let Some(s) = self.stranded.remove(&id) else {
            return false;
        };
        self.unstrand(&s);
        tracing::info!(tenant = %s.tenant, device = s.device, bytes = s.bytes, held_for = ?self.clock.now.saturating_duration_since(s.since), "memory kept outside the broker let go");
        true
    }

    /// Stranded memory, by id (views and tests).
    pub fn stranded_memory(&self) -> impl Iterator<Item = (&Uuid, &Stranded)> {
        self.stranded.iter()
    }

    /// Shutdown: the books are closed, the watchers forgotten.
    pub(super) fn forget_stranded(&mut self) {
        let all: Vec<Uuid> = self.stranded.keys().copied().collect();
        for id in all {
            if let Some(s) = self.stranded.remove(&id) {
                for &pid in &s.pids {
                    self.fx.unwatch(Watch::Stranded { id, pid });
                }
                self.unstrand(&s);
            }
        }
    }

    fn unstrand(&mut self, s: &Stranded) {
        self.wake_queue();
        self.ledger.remove_quarantine(&s.tenant, s.device, s.bytes);
        if let Some(pool) = self.pools.get_mut(s.device as usize) {
            pool.unquarantine_destroyed(s.bytes);
        }
    }
}
