//! How leases and sessions end: released by the holder, abandoned when a session ends,
//! revoked (reclaim deadline missed or an operator's `RevokeLease`). Memory that a live
//! process may still have mapped is **quarantined**: counted, never handed to anyone else,
//! until the holder's process is gone (or, when its pid is unknown, a timeout passes).

use super::effects::{Counted, Effect, Watch};
use super::{lease_not_found, Arbiter, Quarantined, ReclaimPolicy, State};
use crate::device::BackendKind;
use crate::error::BrokerResult;
use crate::lease::{LeaseState, LeaseView};
use crate::ledger::Tier;
use crate::process::process_gone;
use crate::session::{Peer, SessionEvent};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use uuid::Uuid;

/// What becomes of an ended lease's block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ending {
    /// Nobody maps it any more: cache it for reuse.
    Cache,
    /// Free it on the device now (a mapping that survives cannot reach anyone else).
    Destroy,
    /// A live process may map it: hold it until `pid` exits (or a timeout if unknown).
    Quarantine { pid: Option<u32> },
}

impl Arbiter {
    /// The holder gives a lease back (it promises it closed every mapping).
    pub fn release(self: &Arc<Self>, tenant: &str, lease: Uuid) -> BrokerResult<()> {
        let mut st = self.lock();
        match st.leases.get(&lease) {
            Some(l) if l.tenant == tenant => {}
            _ => return Err(lease_not_found(lease)),
        }
        self.end_lease(&mut st, lease, Ending::Cache);
        self.drain(&mut st);
        tracing::debug!(%lease, tenant, "lease released");
        Ok(())
    }

    /// What to do with memory a session held when it ended without releasing it.
    /// `gone`: the peer process was found gone (read from `/proc` before the state lock was
    /// taken: no `/proc` read happens under it).
    fn abandoned(&self, peer: &Peer, device: u32, tier: Tier, gone: bool) -> Ending {
        match peer.pid {
            Some(_) if gone => Ending::Cache,
            Some(pid) => Ending::Quarantine { pid: Some(pid) },
            None if tier == Tier::Host || self.backend(device) == BackendKind::Host => {
                Ending::Destroy
            }
            None => Ending::Quarantine { pid: None },
        }
    }

    /// Is the peer process `find` names (under a short state lock) gone? Read from `/proc`
    /// after the lock is released. False when there is no such peer or its pid is unknown.
    fn peer_gone(&self, find: impl FnOnce(&State) -> Option<Peer>) -> bool {
        let pid = find(&self.lock()).and_then(|p| p.pid);
        pid.is_some_and(process_gone)
    }

    /// Ends a lease; returns its view. Does not run the queue (callers do).
    pub(crate) fn end_lease(
        self: &Arc<Self>,
        st: &mut State,
        id: Uuid,
        ending: Ending,
    ) -> Option<LeaseView> {
        let lease = st.leases.remove(&id)?;
        st.fx.push(Effect::ForgetTickets { lease: id });
        let view = st.view(&lease);
        if let Some(s) = st.sessions.get_mut(&lease.session) {
            s.leases.remove(&id);
        }
        let bytes = lease.bytes();
        let d = lease.device;
        let tenant = lease.tenant.clone();
        let mut block = lease.block;
        if lease.tier == Tier::Host {
            st.ledger.uncharge_host(&tenant, bytes);
            // Host fallback files are never reused: a surviving mapping reaches nobody.
            st.fx.free_host(block);
            return Some(view);
        }
        st.ledger.uncharge(&tenant, d, bytes);
        block.last_tenant = Some(tenant.clone());
        // Importers of its publication, or other processes that fetched its descriptor,
        // may keep the block (`sharing.rs`).
        let Some((block, ending)) = self.sharing_lease_ended(st, id, &tenant, d, block, ending)
        else {
            // Still held for others: its bytes do not come back into a reservation.
            if let Some(r) = lease.reservation {
                self.lease_left_reservation(st, r, bytes, false);
            }
            return Some(view);
        };
        let pool = &mut st.pools[d as usize];
        match ending {
            Ending::Cache => pool.release_to_cache(block),
            Ending::Destroy => {
                pool.release_destroyed(bytes);
                st.fx.free(d, block);
            }
            Ending::Quarantine { pid } => {
                st.fx.count(Counted::Quarantined);
                pool.release_to_quarantine(bytes);
                st.ledger.add_quarantine(&tenant, d, bytes);
                st.quarantine.insert(
                    id,
                    Quarantined {
                        tenant,
                        device: d,
                        block,
                        pid,
                        since: Instant::now(),
                    },
                );
                st.fx.watch(Watch::Quarantine { lease: id, pid });
            }
        }
        if let Some(r) = lease.reservation {
            let back = !matches!(ending, Ending::Quarantine { .. });
            self.lease_left_reservation(st, r, bytes, back);
        }
        Some(view)
    }

    /// The holder of quarantined memory is gone: cache (or free) the block.
    pub(super) fn unquarantine(self: &Arc<Self>, id: Uuid, destroy: bool) {
        let mut st = self.lock();
        let Some(q) = st.quarantine.remove(&id) else {
            return;
        };
        st.fx.unwatch(Watch::Quarantine {
            lease: id,
            pid: q.pid,
        });
        let bytes = q.block.bytes();
        st.ledger.remove_quarantine(&q.tenant, q.device, bytes);
        let pool = &mut st.pools[q.device as usize];
        if destroy {
            pool.unquarantine_destroyed(bytes);
            st.fx.free(q.device, q.block);
        } else {
            pool.unquarantine_to_cache(q.block);
        }
        tracing::info!(lease = %id, tenant = %q.tenant, pid = ?q.pid, held_for = ?q.since.elapsed(), "quarantine lifted");
        self.drain(&mut st);
    }

    /// Ends a session: its waiting requests fail, its leases end (cached if its process is
    /// gone, otherwise quarantined or destroyed).
    pub fn end_session(self: &Arc<Self>, id: Uuid, reason: &str) {
        self.end_session_inner(id, reason, None);
    }

    pub(crate) fn end_session_with(self: &Arc<Self>, id: Uuid, reason: &str, ending: Ending) {
        self.end_session_inner(id, reason, Some(ending));
    }

    fn end_session_inner(self: &Arc<Self>, id: Uuid, reason: &str, forced: Option<Ending>) {
        let gone = forced.is_none() && self.peer_gone(|st| st.sessions.get(&id).map(|s| s.peer));
        let mut st = self.lock();
        let Some(session) = st.sessions.remove(&id) else {
            return;
        };
        for w in st.queue.remove_session(id) {
            st.fx.reply(w.reply, Err(super::session_not_found(id)));
        }
        st.fx.push(Effect::EndTurns { session: id });
        if let Some(pid) = session.peer.pid {
            st.fx.unwatch(Watch::Session { session: id, pid });
        }
        let mut bytes = 0;
        let count = session.leases.len();
        for lease in &session.leases {
            let Some(l) = st.leases.get(lease) else {
                continue;
            };
            let ending =
                forced.unwrap_or_else(|| self.abandoned(&session.peer, l.device, l.tier, gone));
            bytes += l.bytes();
            self.end_lease(&mut st, *lease, ending);
        }
        self.sharing_session_ended(&mut st, id, &session.peer);
        self.end_session_reservations(&mut st, id);
        tracing::info!(session = %id, tenant = %session.tenant, reason, leases = count, bytes, "session ended");
        self.drain(&mut st);
    }

    /// Takes a lease away (operator, or reclaim deadline missed). The holder is told; its
    /// memory is quarantined until its process lets go, or with the `terminate` policy the
    /// process is killed first.
    pub fn revoke(self: &Arc<Self>, id: Uuid, reason: &str) -> BrokerResult<LeaseView> {
        let gone = self.peer_gone(|st| {
            let l = st.leases.get(&id)?;
            st.sessions.get(&l.session).map(|s| s.peer)
        });
        let mut st = self.lock();
        let Some(l) = st.leases.get(&id) else {
            return Err(lease_not_found(id));
        };
        let (session, device, tier) = (l.session, l.device, l.tier);
        let peer = st
            .sessions
            .get(&session)
            .map(|s| s.peer)
            .unwrap_or_default();
        if let Some(s) = st.sessions.get(&session) {
            let to = s.events.clone();
            st.fx.notify(
                &to,
                SessionEvent::LeaseRevoked {
                    lease_id: id,
                    reason: reason.to_string(),
                },
            );
        }
        let mut ending = self.abandoned(&peer, device, tier, gone);
        if let (Ending::Quarantine { pid: Some(pid) }, ReclaimPolicy::Terminate) =
            (ending, self.cfg.reclaim_policy)
        {
            st.fx.push(Effect::Kill { pid });
            ending = Ending::Quarantine { pid: Some(pid) };
        }
        let view = self.end_lease(&mut st, id, ending).map(|v| LeaseView {
            revoked: true,
            reclaim_deadline: None,
            ..v
        });
        tracing::warn!(lease = %id, reason, ?ending, "lease revoked");
        st.fx.count(Counted::Revoked(
            if reason == super::RECLAIM_DEADLINE_MISSED {
                crate::metrics::Revocation::ReclaimDeadline
            } else {
                crate::metrics::Revocation::Operator
            },
        ));
        self.drain(&mut st);
        view.ok_or_else(|| lease_not_found(id))
    }

    /// Asks holders of memory that waiter `id` is entitled to for it back: borrowed leases
    /// (when the waiter is within its guarantee) and reclaimable leases of lower priority,
    /// lowest priority and newest first, only as much as needed.
    pub(crate) fn request_reclaim(self: &Arc<Self>, st: &mut State, id: u64) {
        let Some(w) = st.queue.get(id) else { return };
        if w.reclaim_sent {
            return;
        }
        let ask = w.ask.clone();
        let priority = w.priority;
        if st.ledger.get(&ask.tenant).is_none() {
            return;
        }
        let within_guarantee = st.ledger.within_guarantee(&ask.tenant, ask.bytes);
        let devices = self.candidates(ask.device);
        // Free for this tenant: unpromised memory minus what is kept for others' guarantees.
        let node_free = st
            .pools
            .iter()
            .map(|p| p.available())
            .fold(0, u64::saturating_add);
        let for_tenant = node_free.saturating_sub(st.ledger.others_unused_guarantees(&ask.tenant));
        let best_free = devices
            .iter()
            .map(|&d| st.pools[d as usize].available())
            .max()
            .unwrap_or(0)
            .min(for_tenant);
        // Memory already on its way back counts: leases asked to go, and (with the
        // terminate policy) quarantine of holders being killed.
        let terminating = self.cfg.reclaim_policy == ReclaimPolicy::Terminate;
        let pending: u64 = st
            .leases
            .iter()
            .filter(|l| devices.contains(&l.device) && l.tier == Tier::Device)
            .filter(|l| matches!(l.state, LeaseState::ReclaimRequested { .. }))
            .map(|l| l.bytes())
            .chain(
                devices
                    .iter()
                    .filter(|_| terminating)
                    .map(|&d| st.pools[d as usize].stats().quarantined),
            )
            .fold(0, u64::saturating_add);
        // Under the cooperative policy, a holder that already ignored a reclaim (its
        // revoked memory sits in quarantine) frees nothing by losing more leases: ask others.
        let uncooperative: std::collections::HashSet<u32> = if terminating {
            Default::default()
        } else {
            st.quarantine.values().filter_map(|q| q.pid).collect()
        };
        let mut need = ask.bytes.saturating_sub(best_free.saturating_add(pending));
        if need == 0 {
            return;
        }
        let borrowed_of = |t: &str| st.ledger.get(t).map(|t| t.borrowed_bytes()).unwrap_or(0);
        let mut victims: Vec<(i32, u64, Uuid, u64, String)> = st
            .leases
            .iter()
            .filter(|l| l.tier == Tier::Device && devices.contains(&l.device))
            .filter(|l| matches!(l.state, LeaseState::Active))
            .filter(|l| l.tenant != ask.tenant)
            .filter(|l| {
                st.sessions
                    .get(&l.session)
                    .and_then(|s| s.peer.pid)
                    .is_none_or(|pid| !uncooperative.contains(&pid))
            })
            .filter(|l| {
                (within_guarantee && borrowed_of(&l.tenant) > 0)
                    || (l.reclaimable && l.priority < priority)
            })
            .map(|l| (l.priority, l.seq, l.id, l.bytes(), l.tenant.clone()))
            .collect();
        victims.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        let deadline = Instant::now() + self.cfg.reclaim_deadline;
        let deadline_wall = SystemTime::now() + self.cfg.reclaim_deadline;
        let mut taken_from: std::collections::HashMap<String, u64> = Default::default();
        for (_, _, lid, bytes, owner) in victims {
            if need == 0 {
                break;
            }
            // Take no more than the owner borrowed: memory within a guarantee is never
            // reclaimed, not even for a higher priority (it would only become the owner's
            // unused guarantee, kept from the waiter anyway).
            let taken = taken_from.entry(owner.clone()).or_default();
            if *taken >= borrowed_of(&owner) {
                continue;
            }
            *taken += bytes;
            let Some(l) = st.leases.get_mut(&lid) else {
                continue;
            };
            l.state = LeaseState::ReclaimRequested {
                deadline,
                deadline_wall,
            };
            let session = l.session;
            if let Some(s) = st.sessions.get(&session) {
                let to = s.events.clone();
                st.fx.notify(
                    &to,
                    SessionEvent::ReclaimRequested {
                        lease_id: lid,
                        bytes,
                        deadline: deadline_wall,
                        reason: format!(
                            "tenant {:?} (priority {priority}) is waiting for {}",
                            ask.tenant,
                            crate::units::show(ask.bytes)
                        ),
                    },
                );
            }
            st.fx.count(Counted::ReclaimRequested);
            tracing::info!(lease = %lid, owner = %owner, for_tenant = %ask.tenant, "reclaim requested");
            need = need.saturating_sub(bytes);
        }
        if let Some(w) = st.queue.get_mut(id) {
            w.reclaim_sent = true;
        }
    }

    /// Revokes leases whose reclaim deadline passed. Returns how many.
    pub(crate) fn enforce_reclaim_deadlines(self: &Arc<Self>) -> usize {
        let now = Instant::now();
        let late: Vec<Uuid> = {
            let st = self.lock();
            st.leases
                .iter()
                .filter(|l| matches!(l.state, LeaseState::ReclaimRequested { deadline, .. } if deadline <= now))
                .map(|l| l.id)
                .collect()
        };
        for id in &late {
            let _ = self.revoke(*id, super::RECLAIM_DEADLINE_MISSED);
        }
        late.len()
    }

    /// Re-arms reclaim for waiters whose earlier request was not enough.
    pub(crate) fn rearm_reclaim(self: &Arc<Self>, older_than: Duration) {
        let mut st = self.lock();
        let stale: Vec<u64> = st
            .queue
            .iter()
            .filter(|w| w.reclaim_sent && w.since.elapsed() > older_than)
            .map(|w| w.id)
            .collect();
        for id in stale {
            if let Some(w) = st.queue.get_mut(id) {
                w.reclaim_sent = false;
            }
        }
        self.drain(&mut st);
    }
}
