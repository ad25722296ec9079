//! Endings: a lease ends into the cache, a free on the device, or quarantine (a live
//! process may still map it); quarantine is lifted when that process exits (or a timeout
//! passes); a session's end; shutdown's start (sessions told, waiters refused) and
//! everything freed at its end.

use super::{Quarantined, State};
use crate::effects::{Counted, Effect, Watch};
use crate::lease::{LeaseState, LeaseView, Revocation};
use crate::ledger::Tier;
use crate::session::{Peer, Session, SessionEvent};
use std::time::Duration;
use uuid::Uuid;

/// Why a lease is taken away from its holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Revoke {
    /// An operator's `RevokeLease`, with the reason its holder is told.
    Operator(String),
    /// The holder missed its reclaim deadline.
    ReclaimDeadline,
}

impl Revoke {
    /// What the holder is told (`SessionEvent::LeaseRevoked`).
    pub fn reason(&self) -> &str {
        match self {
            Revoke::Operator(reason) => reason,
            Revoke::ReclaimDeadline => crate::lease::RECLAIM_DEADLINE_MISSED,
        }
    }
    /// The `reason` label of the revocations counter.
    pub fn label(&self) -> Revocation {
        match self {
            Revoke::Operator(_) => Revocation::Operator,
            Revoke::ReclaimDeadline => Revocation::ReclaimDeadline,
        }
    }
}

/// What becomes of an ended lease's block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Nobody maps it any more: cache it for reuse.
    Cache,
    /// Free it on the device now (a mapping that survives cannot reach anyone else).
    Destroy,
    /// A live process may map it: hold it until `pid` exits (or a timeout if unknown).
    Quarantine { pid: Option<u32> },
    /// Its holder's process keeps it mapped on purpose (`retained.rs`): held for the
    /// tenant as a quarantine is, until `pid` exits or says it let go, and granted again
    /// to `session` without a ticket.
    Retained { pid: u32, session: Uuid },
}

impl Ending {
    /// The process a quarantine of this ending waits for (`None`: none, or unknown).
    pub fn holder(self) -> Option<u32> {
        match self {
            Ending::Quarantine { pid } => pid,
            Ending::Retained { pid, .. } => Some(pid),
            Ending::Cache | Ending::Destroy => None,
        }
    }

    /// Is the block held for a process that may map it (quarantined or retained)?
    pub fn held(self) -> bool {
        matches!(self, Ending::Quarantine { .. } | Ending::Retained { .. })
    }
}

impl State {
    /// What to do with memory a session held when it ended without releasing it.
    /// `gone`: the peer process was found gone (the shell reads `/proc` before the lock).
    pub fn abandoned(&self, peer: &Peer, device: u32, tier: Tier, gone: bool) -> Ending {
        match peer.pid {
            Some(_) if gone => Ending::Cache,
            Some(pid) => Ending::Quarantine { pid: Some(pid) },
            None if tier == Tier::Host || self.host_backed(device) => Ending::Destroy,
            None => Ending::Quarantine { pid: None },
        }
    }

    /// Takes lease `id` away: its holder is told why, its memory ends as abandoned memory
    /// does ([`State::abandoned`]: quarantined while its process may map it), and with
    /// `kill` (the `terminate` reclaim policy) that process is killed first; counted by
    /// `why`. `gone`: the holder's process was found gone (the shell reads `/proc` before
    /// the lock). Returns the revoked lease's view and how its memory ended (`None`,
    /// nothing changed, when there is no such lease). The queue runs after the hold (its
    /// lease's end asks for it).
    pub fn revoke(
        &mut self,
        id: Uuid,
        why: &Revoke,
        gone: bool,
        kill: bool,
    ) -> Option<(LeaseView, Ending)> {
        let l = self.leases.get(&id)?;
        let (session, device, tier) = (l.session, l.device, l.tier);
        let peer = match self.sessions.get(&session) {
            Some(s) => {
                self.fx.notify(
                    session,
                    SessionEvent::LeaseRevoked {
                        lease_id: id,
                        reason: why.reason().to_string(),
                    },
                );
                s.peer
            }
            None => Peer::default(),
        };
        let ending = self.abandoned(&peer, device, tier, gone);
        if let (Ending::Quarantine { pid: Some(pid) }, true) = (ending, kill) {
            self.fx.push(Effect::Kill { pid });
        }
        let view = self.end_lease(id, ending)?;
        self.fx.count(Counted::Revoked(why.label()));
        Some((
            LeaseView {
                revoked: true,
                reclaim_deadline: None,
                ..view
            },
            ending,
        ))
    }

    /// Ends a lease; returns its view. Processes outside its session that fetched its
    /// descriptor count as alive until the shell looked (`shared.rs`). The queue runs
    /// after the hold.
    pub fn end_lease(&mut self, id: Uuid, ending: Ending) -> Option<LeaseView> {
        let lease = self.leases.remove(&id)?;
        self.wake_queue();
        // Its end is kept after what keeps its memory (a quarantine, a held block), so a
        // crash between leaves the memory with the keeper: a restart takes back the
        // quarantine or held block, not the lease.
        let reclaim = matches!(lease.state, LeaseState::ReclaimRequested { .. });
        self.fx.push(Effect::ForgetTickets { lease: id });
        let view = self.view(&lease);
        if let Some(s) = self.sessions.get_mut(&lease.session) {
            s.let_go(&id);
        }
        let bytes = lease.bytes();
        let d = lease.device;
        let tenant = lease.tenant.clone();
        let mut block = lease.block;
        if lease.tier == Tier::Host {
            // Processes it was given to are not followed: the file is never reused.
            self.shared.recipients.remove(&id);
            self.sealing.remove(&id);
            self.ledger.uncharge_host(&tenant, bytes);
            self.keep_lease_ended(id, reclaim);
            // Host fallback files are never reused: a surviving mapping reaches nobody.
            self.fx.free_host(block);
            return Some(view);
        }
        self.ledger.uncharge(&tenant, d, bytes);
        block.last_tenant = Some(tenant.clone());
        // Its holder let go by word only (a release, a revocation it survived or not): it
        // may keep its import, which no free of CUDA memory can take back.
        if matches!(ending, Ending::Cache | Ending::Destroy) {
            if let Some(s) = self.sessions.get(&lease.session) {
                if let Some(pid) = s.peer.pid {
                    block.reached.add(pid, s.place.clone());
                }
            }
        }
        // Importers of its publication, or other processes that fetched its descriptor,
        // may keep the block (`shared.rs`).
        let holder_start = self.start_of(lease.session, ending.holder());
        let ended = super::shared::EndedLease {
            id,
            tenant: tenant.clone(),
            device: d,
            ending,
            holder_start,
            holder_place: self.place_of(lease.session, ending.holder()),
            reservation: lease.reservation,
            reclaim,
        };
        let Some((block, ending, destroy, publication)) = self.shared_lease_ended(ended, block)
        else {
            // Held for others (its reservation's bytes settled there).
            return Some(view);
        };
        let pool = &mut self.pools[d as usize];
        match ending {
            Ending::Cache => pool.release_to_cache(block),
            Ending::Destroy => {
                pool.release_destroyed(bytes);
                self.fx.free(d, block);
            }
            Ending::Quarantine { .. } | Ending::Retained { .. } => {
                let (pid, retained_by) = match ending {
                    Ending::Retained { pid, session } => (Some(pid), Some(session)),
                    _ => (ending.holder(), None),
                };
                if retained_by.is_none() {
                    self.fx.count(Counted::Quarantined);
                }
                pool.release_to_quarantine(bytes);
                self.ledger.add_quarantine(&tenant, d, bytes);
                self.quarantine.insert(
                    id,
                    Quarantined {
                        tenant,
                        device: d,
                        block,
                        pid,
                        pid_start: holder_start.filter(|_| pid == ending.holder()),
                        place: self
                            .place_of(lease.session, pid)
                            .filter(|_| pid == ending.holder()),
                        since: self.clock.now,
                        destroy,
                        retained_by,
                        asked_back: false,
                    },
                );
                self.fx.watch(Watch::Quarantine { lease: id, pid });
                self.keep_quarantine(id);
                if let Some(session) = retained_by {
                    self.retained.entry(session).or_default().insert(id);
                }
            }
        }
        self.keep_lease_ended(id, reclaim);
        if let Some(p) = publication {
            self.keep(|| crate::effects::Keep::PublicationEnded(p));
        }
        if let Some(r) = lease.reservation {
            let back = !ending.held();
            self.lease_left_reservation(r, bytes, back);
        }
        Some(view)
    }

    /// Keeps the end of lease `id` (and of its reclaim request when it had one).
    pub(super) fn keep_lease_ended(&mut self, id: Uuid, reclaim: bool) {
        self.keep(|| crate::effects::Keep::LeaseEnded(id));
        if reclaim {
            self.keep(|| crate::effects::Keep::ReclaimEnded(id));
        }
    }

    /// The holder of quarantined memory is gone (`destroy`: or the timeout passed): the
    /// block is cached, or freed when asked, when it was ever published or sealed, or
    /// when its memfd is no longer pristine. False when it was not quarantined; else the
    /// queue runs after the hold.
    pub fn lift_quarantine(&mut self, id: Uuid, destroy: bool) -> bool {
        let Some(mut q) = self.quarantine.remove(&id) else {
            return false;
        };
        // Lifted while its process may live (a retained block let go by word, a timeout):
        // a later free checks that the memory came back.
        if let Some(pid) = q.pid {
            q.block.reached.add(pid, q.place.clone());
        }
        if let Some(session) = q.retained_by {
            self.unindex_retained(session, id);
        }
        self.wake_queue();
        self.fx.unwatch(Watch::Quarantine {
            lease: id,
            pid: q.pid,
        });
        self.keep(|| crate::effects::Keep::QuarantineLifted(id));
        let bytes = q.block.bytes();
        self.ledger.remove_quarantine(&q.tenant, q.device, bytes);
        let destroy = destroy || q.destroy || !self.pristine(&q.block);
        let pool = &mut self.pools[q.device as usize];
        if destroy {
            pool.unquarantine_destroyed(bytes);
            self.fx.free(q.device, q.block);
        } else {
            pool.unquarantine_to_cache(q.block);
        }
        tracing::info!(lease = %id, tenant = %q.tenant, pid = ?q.pid, held_for = ?self.clock.now.saturating_duration_since(q.since), "quarantine lifted");
        true
    }

    /// Ends a session: its waiting requests are refused, its leases end (as `forced`
    /// says, else as [`State::abandoned`] decides with `gone`), its imports (lingering
    /// unless `gone`) and process reservations end. `gone`: the shell found its peer
    /// process gone before the lock. Returns it and the bytes it held (none if it was not
    /// open). The queue runs after the hold when it was.
    pub fn end_session(
        &mut self,
        id: Uuid,
        forced: Option<Ending>,
        gone: bool,
    ) -> Option<(Session, u64)> {
        let session = self.sessions.remove(&id)?;
        self.ending_session = Some(super::EndingSession {
            id,
            pid: session.peer.pid,
            start: session.peer_start,
            place: session.place.clone(),
        });
        self.wake_queue();
        for w in self.queue.remove_session(id) {
            self.fx
                .reply(w.id, Err(crate::error::session_not_found(id)));
        }
        self.fx.push(Effect::EndTurns { session: id });
        if let Some(pid) = session.peer.pid {
            self.fx.unwatch(Watch::Session { session: id, pid });
        }
        let mut bytes = 0;
        for lease in session.leases() {
            let Some(l) = self.leases.get(lease) else {
                continue;
            };
            let e = forced.unwrap_or_else(|| self.abandoned(&session.peer, l.device, l.tier, gone));
            bytes += l.bytes();
            self.end_lease(*lease, e);
        }
        self.shared_session_ended(id, &session.peer, gone);
        self.ending_session = None;
        self.end_session_reservations(id);
        self.keep(|| crate::effects::Keep::SessionEnded(id));
        // Last: events pushed above still reach the session's stream.
        self.fx.push(Effect::Hangup { session: id });
        Some((session, bytes))
    }

    /// Shutdown begins: every open session is told (`ShuttingDown`, with the `grace` it
    /// has to finish) and every waiting request is refused (`ShuttingDown`). Memory stays
    /// as it is until the sessions end.
    pub fn begin_shutdown(&mut self, grace: Duration) {
        for to in self.sessions.ids() {
            self.fx.notify(
                to,
                SessionEvent::ShuttingDown {
                    reason: "broker shutting down".into(),
                    grace,
                },
            );
        }
        self.refuse_all_waiters(&crate::error::BrokerError::ShuttingDown);
    }

    /// Shutdown: every quarantined and held block, and every cached block, is freed (and
    /// the publications and imports of that memory are forgotten).
    pub fn free_everything(&mut self) {
        let quarantined: Vec<Uuid> = self.quarantine.keys().copied().collect();
        for id in quarantined {
            self.lift_quarantine(id, true);
        }
        let held: Vec<Uuid> = self.shared.held.keys().copied().collect();
        for id in held {
            self.free_held(id);
        }
        self.forget_all_shared();
        self.forget_stranded();
        for i in 0..self.pools.len() {
            for b in self.pools[i].take_cache() {
                self.fx.free(i as u32, b);
            }
        }
    }
}
