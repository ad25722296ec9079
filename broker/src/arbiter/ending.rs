//! How leases and sessions end: released by the holder, abandoned when a session ends,
//! revoked (reclaim deadline missed or an operator's `RevokeLease`). Memory that a live
//! process may still have mapped is **quarantined**: counted, never handed to anyone else,
//! until the holder's process is gone (or, when its pid is unknown, a timeout passes).

use super::effects::{Counted, Effect};
use super::{lease_not_found, Arbiter, Ending, ReclaimPolicy, State};
use crate::error::BrokerResult;
use crate::lease::{LeaseState, LeaseView};
use crate::process::process_gone;
use crate::session::{Peer, SessionEvent};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uuid::Uuid;

impl Arbiter {
    /// The holder gives a lease back (it promises it closed every mapping).
    pub fn release(self: &Arc<Self>, tenant: &str, lease: Uuid) -> BrokerResult<()> {
        let mut st = self.lock();
        match st.leases().get(&lease) {
            Some(l) if l.tenant == tenant => {}
            _ => return Err(lease_not_found(lease)),
        }
        self.end_lease(&mut st, lease, Ending::Cache);
        self.drain(&mut st);
        tracing::debug!(%lease, tenant, "lease released");
        Ok(())
    }

    /// Is the peer process `find` names (under a short state lock) gone? Read from `/proc`
    /// after the lock is released. False when there is no such peer or its pid is unknown.
    fn peer_gone(&self, find: impl FnOnce(&State) -> Option<Peer>) -> bool {
        let pid = find(&self.lock()).and_then(|p| p.pid);
        pid.is_some_and(process_gone)
    }

    /// Ends a lease; returns its view. Does not run the queue (callers do). Processes
    /// outside the session that fetched its descriptor are looked at after the unlock
    /// (`Effect::CheckGone`): no `/proc` read under the lock.
    pub(crate) fn end_lease(
        self: &Arc<Self>,
        st: &mut State,
        id: Uuid,
        ending: Ending,
    ) -> Option<LeaseView> {
        st.end_lease(id, ending)
    }

    /// The holder of quarantined memory is gone: cache (or free) the block.
    pub(super) fn unquarantine(self: &Arc<Self>, id: Uuid, destroy: bool) {
        let mut st = self.lock();
        if st.lift_quarantine(id, destroy) {
            self.drain(&mut st);
        }
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
        let gone = forced.is_none() && self.peer_gone(|st| st.sessions().get(&id).map(|s| s.peer));
        let mut st = self.lock();
        let Some((session, bytes)) = st.end_session(id, forced, gone) else {
            return;
        };
        tracing::info!(session = %id, tenant = %session.tenant, reason, leases = session.leases.len(), bytes, "session ended");
        self.drain(&mut st);
    }

    /// Takes a lease away (operator, or reclaim deadline missed). The holder is told; its
    /// memory is quarantined until its process lets go, or with the `terminate` policy the
    /// process is killed first.
    pub fn revoke(self: &Arc<Self>, id: Uuid, reason: &str) -> BrokerResult<LeaseView> {
        let gone = self.peer_gone(|st| {
            let l = st.leases().get(&id)?;
            st.sessions().get(&l.session).map(|s| s.peer)
        });
        let mut st = self.lock();
        let Some(l) = st.leases().get(&id) else {
            return Err(lease_not_found(id));
        };
        let (session, device, tier) = (l.session, l.device, l.tier);
        let peer = st
            .sessions()
            .get(&session)
            .map(|s| s.peer)
            .unwrap_or_default();
        if let Some(s) = st.sessions().get(&session) {
            let to = s.id;
            st.fx().notify(
                to,
                SessionEvent::LeaseRevoked {
                    lease_id: id,
                    reason: reason.to_string(),
                },
            );
        }
        let mut ending = st.abandoned(&peer, device, tier, gone);
        if let (Ending::Quarantine { pid: Some(pid) }, ReclaimPolicy::Terminate) =
            (ending, self.cfg.reclaim_policy)
        {
            st.fx().push(Effect::Kill { pid });
            ending = Ending::Quarantine { pid: Some(pid) };
        }
        let view = self.end_lease(&mut st, id, ending).map(|v| LeaseView {
            revoked: true,
            reclaim_deadline: None,
            ..v
        });
        tracing::warn!(lease = %id, reason, ?ending, "lease revoked");
        st.fx().count(Counted::Revoked(
            if reason == super::RECLAIM_DEADLINE_MISSED {
                crate::metrics::Revocation::ReclaimDeadline
            } else {
                crate::metrics::Revocation::Operator
            },
        ));
        self.drain(&mut st);
        view.ok_or_else(|| lease_not_found(id))
    }

    /// Revokes leases whose reclaim deadline passed. Returns how many.
    pub(crate) fn enforce_reclaim_deadlines(self: &Arc<Self>) -> usize {
        let now = Instant::now();
        let late: Vec<Uuid> = {
            let st = self.lock();
            st.leases()
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
        st.rearm_reclaim(older_than, Instant::now());
        self.drain(&mut st);
    }
}
