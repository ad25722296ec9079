//! Sessions, as the service opens and serves them: open (with the secret that resumes one
//! after a restart), keep alive, a session's peer, find a caller's own lease with its peer, and
//! what NVML says each session's processes use. [`Sessions`] (reached
//! by [`Arbiter::sessions`]) keeps no fields: the sessions live in the state, their
//! mailboxes in the outbox. Ending one is `ending.rs`; ending those of a revoked or
//! lapsed token, `revocation.rs` (on [`Sessions`] too).

use super::{lease_not_found, restart, session_not_found, Arbiter, MAX_LABEL};
use crate::error::BrokerResult;
use crate::lease::LeaseView;
use crate::session::{Peer, Session, SessionEvent};
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::mpsc;
use uuid::Uuid;

/// The sessions of one arbiter ([`Arbiter::sessions`]).
pub struct Sessions<'a> {
    pub(super) arb: &'a Arc<Arbiter>,
}

impl Sessions<'_> {
    /// The peer a session of `tenant` was opened from (`NOT_FOUND` otherwise).
    pub(crate) fn peer(&self, tenant: &str, session: Uuid) -> BrokerResult<Peer> {
        match self.arb.lock().sessions().get(&session) {
            Some(s) if s.tenant == tenant => Ok(s.peer),
            _ => Err(session_not_found(session)),
        }
    }

    /// A live lease of `tenant` with the peer of its session (`NOT_FOUND` otherwise).
    pub(crate) fn own_lease(&self, tenant: &str, lease: Uuid) -> BrokerResult<(LeaseView, Peer)> {
        let st = self.arb.lock();
        match st.leases().get(&lease) {
            Some(l) if l.tenant == tenant => {
                let peer = st
                    .sessions()
                    .get(&l.session)
                    .map(|s| s.peer)
                    .unwrap_or_default();
                Ok((st.view(l), peer))
            }
            _ => Err(lease_not_found(lease)),
        }
    }

    /// Opens a session on behalf of the token `token_id` (the caller's: the session ends
    /// when that token is revoked or expires); returns its id, its event receiver and the
    /// secret that resumes the session after a broker restart (`restart/resume.rs`; empty without a
    /// keeper, which alone keeps sessions across restarts, and for a peer with no pid,
    /// which cannot resume).
    #[allow(clippy::type_complexity)]
    pub(crate) fn open(
        &self,
        tenant: &str,
        name: &str,
        peer: Peer,
        token_id: Option<String>,
    ) -> BrokerResult<(Uuid, mpsc::UnboundedReceiver<SessionEvent>, String)> {
        self.arb.lifecycle.refuse_new_work()?;
        crate::bounds::check("session name", name, MAX_LABEL)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let id = Uuid::now_v7();
        // Read before the lock: the peer's start time (/proc), so a restarted broker
        // tells it from another process of the same pid.
        let peer_start = peer.pid.and_then(crate::process::start_ticks);
        // Where it runs, kept with the blocks it may hand on (`kept_holders.rs`).
        let place = self
            .arb
            .stranded()
            .holders()
            .zip(peer.pid)
            .and_then(|(f, pid)| f.place(pid));
        let (secret, hash) = match peer_start.filter(|_| self.arb.restart().keeps_leases()) {
            Some(_) => {
                let (s, h) = restart::new_resume_secret();
                (s, Some(h))
            }
            None => (String::new(), None),
        };
        {
            let mut st = self.arb.lock();
            let mut s = Session::new(id, tenant, name, peer, token_id);
            s.resume_hash = hash;
            s.peer_start = peer_start;
            s.place = place;
            st.open_session(s, self.arb.cfg.max_sessions_per_tenant)?;
            // Its mailbox is in place in the hold that opened it, so before any
            // transition can tell it something (effects run when the guard drops).
            self.arb.outbox.open(&st, id, tx);
        }
        tracing::info!(session = %id, tenant, name, pid = ?peer.pid, "session opened");
        Ok((id, rx, secret))
    }

    /// Marks a session active (keepalive).
    pub(crate) fn touch(&self, tenant: &str, session: Uuid) -> BrokerResult<()> {
        let st = self.arb.lock();
        match st.sessions().get(&session) {
            Some(s) if s.tenant == tenant => {
                s.last_seen.touch();
                Ok(())
            }
            _ => Err(session_not_found(session)),
        }
    }

    /// A session's activity mark, for its event stream to touch without the state lock.
    pub(crate) fn activity(&self, session: Uuid) -> Option<Arc<crate::session::Activity>> {
        self.arb
            .lock()
            .sessions()
            .get(&session)
            .map(|s| s.last_seen.clone())
    }

    /// Attributes per-process GPU memory (NVML) to sessions by peer pid, and reports a
    /// worker whose memory beyond its leases exceeds `allowance` (its own `cudaMalloc`).
    pub(super) fn apply_process_usage(&self, usage: &HashMap<u32, u64>, allowance: u64) {
        let covered = self.arb.reservations().covered_usage(usage);
        let mut st = self.arb.lock();
        let (sessions, leases, reservations) = (st.sessions(), st.leases(), st.reservations());
        let mut seen = Vec::new();
        for s in sessions.iter() {
            let Some(pid) = s.peer.pid else { continue };
            let used = usage.get(&pid).copied().unwrap_or(0);
            // NVML attributes memory to the process that allocated it: memory a worker
            // maps through an IPC handle is the broker's, not the worker's (measured on
            // an H200, driver 580). So all of `used` is the worker's own: its CUDA
            // context plus whatever it allocated itself.
            let mut own = used;
            let mut used = used;
            let mut allowance = allowance;
            // A process a reservation covers allocates within it: its tree's memory is
            // over only beyond the reservation's room (`reservations.rs`). The session
            // holding the reservation shows the whole tree's memory.
            if let Some(r) = covered.by_pid.get(&pid).and_then(|r| reservations.get(r)) {
                let tree = covered.tree_used.get(&r.id).copied().unwrap_or(0);
                allowance = allowance.saturating_add(r.room());
                if r.session == s.id {
                    used = tree;
                }
                own = tree;
            }
            let held: u64 = s
                .leases()
                .iter()
                .filter_map(|l| leases.get(l))
                .filter(|l| l.tier == crate::ledger::Tier::Device)
                .map(|l| l.bytes())
                .sum();
            let over = own > allowance;
            let was_over = s.gpu.is_some_and(|g| g.over);
            if over && !was_over {
                tracing::warn!(
                    session = %s.id,
                    tenant = %s.tenant,
                    pid,
                    used,
                    leased = held,
                    own,
                    allowance,
                    "worker uses GPU memory beyond its leases (its own allocations)"
                );
            }
            seen.push((s.id, crate::session::GpuUse { used, own, over }));
        }
        for (id, gpu) in seen {
            st.set_session_gpu(&id, gpu);
        }
    }
}
