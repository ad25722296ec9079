//! Retained blocks: a lease released by its session's own process with its mapping kept
//! (`ReleaseLease.retain_mapping`). The block is held for its tenant as a quarantine is
//! (counted in the tenant's quarantined bytes, watched until that process exits), so it
//! never reaches the cache, and so never another tenant, while the process may map it.
//! A later lease request of that session, from that process, of the block's size on a
//! device it may use is granted the same block (`grant_retained`): no queue, no ticket, no
//! import on the worker's side. The process lets go with a plain `ReleaseLease` of the
//! ended lease's id (`drop_retained`): the block then goes to the cache like any released
//! one; when it needs the memory for others the broker asks first (`ask_retained_back`:
//! `SessionEvent::DropRetained`).

use super::{Ending, State};
use crate::availability::Availability;
use crate::effects::{Counted, Watch};
use crate::lease::{Lease, LeaseState, LeaseView};
use crate::ledger::Tier;
use crate::request::ValidRequest;
use crate::session::SessionEvent;
use uuid::Uuid;

impl State {
    /// Whether `tenant` holds lease `id`.
    pub fn has_lease(&self, tenant: &str, id: Uuid) -> bool {
        self.leases.get(&id).is_some_and(|l| l.tenant == tenant)
    }

    /// Releases lease `id` of `tenant`, asked by process `caller`, retained mapped: when
    /// `caller` is its session's own process and the block was never shared (not
    /// published, sealed, or fetched by another process, not drawn from a process
    /// reservation, device memory). Otherwise, when the caller `may_decline`, nothing
    /// changes (`Some(false)`): the caller still maps the block, so releasing it now could
    /// let it be freed under that mapping; it unmaps and releases plainly. A caller that
    /// cannot be told so (a client older than declines) gets a plain release into the
    /// cache. `None` when `tenant` has no such lease.
    pub fn release_retained(
        &mut self,
        tenant: &str,
        id: Uuid,
        caller: u32,
        may_decline: bool,
    ) -> Option<bool> {
        let l = self.leases.get(&id).filter(|l| l.tenant == tenant)?;
        let session = l.session;
        let own = self
            .sessions
            .get(&session)
            .is_some_and(|s| s.peer.pid == Some(caller) && caller != 0);
        let shared = self.shared.by_lease.contains_key(&id)
            || self.sealing.contains(&id)
            || self
                .shared
                .recipients
                .get(&id)
                .is_some_and(|r| !r.is_empty());
        if !(own && !shared && l.tier == Tier::Device && l.reservation.is_none()) {
            if !may_decline {
                self.end_lease(id, Ending::Cache)?;
            }
            return Some(false);
        }
        self.end_lease(
            id,
            Ending::Retained {
                pid: caller,
                session,
            },
        )?;
        Some(true)
    }

    /// A lease for `req`, asked by process `caller`, made of a block that process retained
    /// (its session's, the request's size rounded as a grant rounds it, on a device it may
    /// use and that admits leases): the block goes from held to leased, no bytes move
    /// between tenants or out of the pool. `None` when there is none, or the tenant's limits
    /// refuse another lease now (the request then takes the ordinary path).
    pub fn grant_retained(
        &mut self,
        req: &ValidRequest,
        caller: u32,
        avail: &Availability,
    ) -> Option<LeaseView> {
        let own = self
            .sessions
            .get(&req.session)
            .is_some_and(|s| s.tenant == req.tenant && s.peer.pid == Some(caller) && caller != 0);
        if !own {
            return None;
        }
        let candidates = self.candidates(avail, req.device);
        let id = self
            .retained
            .get(&req.session)?
            .iter()
            .copied()
            .find(|id| {
                self.quarantine.get(id).is_some_and(|q| {
                    !q.destroy
                        && candidates.contains(&q.device)
                        && crate::units::round_up(
                            req.bytes,
                            self.pools[q.device as usize].granularity(),
                        ) == Some(q.block.bytes())
                })
            })?;
        let q = self.quarantine.get(&id)?;
        // Its holder sealed it (it may): the tenant's lease must be memory it can write.
        if !self.pristine(&q.block) {
            return None;
        }
        let (d, bytes) = (q.device, q.block.bytes());
        // Its bytes leave the quarantine and come back as a lease: the tenant's limits are
        // checked again (the lease count, a quota lowered since), and on a refusal it stays.
        self.ledger.remove_quarantine(&req.tenant, d, bytes);
        if self.ledger.reserve(&req.tenant, d, bytes).is_err() {
            self.ledger.add_quarantine(&req.tenant, d, bytes);
            return None;
        }
        let q = self.quarantine.remove(&id)?;
        self.unindex_retained(req.session, id);
        self.fx.unwatch(Watch::Quarantine {
            lease: id,
            pid: q.pid,
        });
        self.ledger.commit(&req.tenant, bytes);
        self.pools[d as usize].unquarantine_to_lease(bytes);
        self.fx.count(Counted::Granted(Tier::Device));
        let priority = self
            .ledger
            .get(&req.tenant)
            .map(|t| t.quota.priority)
            .unwrap_or(0);
        let seq = self.next_seq();
        let lease = Lease {
            id: Uuid::new_v4(),
            tenant: req.tenant.clone(),
            session: req.session,
            device: d,
            tier: Tier::Device,
            requested_bytes: req.bytes,
            label: req.label.clone(),
            reclaimable: req.reclaimable,
            created: self.clock.wall,
            state: LeaseState::Active,
            priority,
            seq,
            block: q.block,
            reservation: None,
            live: crate::lease::LiveMark::default(),
        };
        tracing::debug!(lease = %lease.id, retained = %id, tenant = %req.tenant, device = d, bytes, "retained block leased again");
        let view = self.insert_lease(lease);
        // After the lease's record: a restart between the two finds the block in both,
        // and the lease wins (`restart/adopt.rs`).
        self.keep(|| crate::effects::Keep::QuarantineLifted(id));
        Some(view)
    }

    /// Does `session`'s process retain any block? (No lease request of it needs a look.)
    pub fn retains(&self, session: Uuid) -> bool {
        self.retained.contains_key(&session)
    }

    /// Block `id` retained for `session` left the quarantine.
    pub(super) fn unindex_retained(&mut self, session: Uuid, id: Uuid) {
        if let Some(ids) = self.retained.get_mut(&session) {
            ids.remove(&id);
            if ids.is_empty() {
                self.retained.remove(&session);
            }
        }
    }

    /// The process that retained the block of ended lease `id` (of `tenant`) let go of
    /// it: it goes to the cache (or is freed, as a lifted quarantine is). False when
    /// `tenant` retains no such block.
    pub fn drop_retained(&mut self, tenant: &str, id: Uuid) -> bool {
        let ours = self
            .quarantine
            .get(&id)
            .is_some_and(|q| q.retained_by.is_some() && q.tenant == tenant);
        ours && self.lift_quarantine(id, false)
    }

    /// Asks the processes retaining blocks on device `d` (every device when `None`) to
    /// let go (`SessionEvent::DropRetained`, once per block): memory is wanted for
    /// others. Returns how many were asked.
    pub fn ask_retained_back(&mut self, d: Option<u32>) -> usize {
        let mut asked = 0;
        for (id, q) in self.quarantine.iter_mut() {
            let Some(session) = q.retained_by else {
                continue;
            };
            if d.is_some_and(|d| d != q.device) || q.asked_back {
                continue;
            }
            q.asked_back = true;
            asked += 1;
            self.fx
                .notify(session, SessionEvent::DropRetained { lease_id: *id });
        }
        asked
    }

    /// Asks retained blocks back on every device a waiting request may use.
    pub(super) fn ask_retained_back_for_waiters(&mut self) {
        let mut devices: Vec<Option<u32>> = self.queue.iter().map(|w| w.ask.device).collect();
        if devices.contains(&None) {
            devices = vec![None];
        }
        devices.sort_unstable();
        devices.dedup();
        for d in devices {
            self.ask_retained_back(d);
        }
    }
}
