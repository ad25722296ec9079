//! How leases and sessions end: released by the holder, abandoned when a session ends,
//! revoked (reclaim deadline missed or an operator's `RevokeLease`). Memory that a live
//! process may still have mapped is **quarantined**: counted, never handed to anyone else,
//! until the holder's process is gone (or, when its pid is unknown, a timeout passes).

use super::state::Revoke;
use super::{lease_not_found, Arbiter, Ending, ReclaimPolicy, State};
use crate::error::BrokerResult;
use crate::lease::LeaseView;
use crate::process::process_gone;
use crate::session::Peer;
use std::sync::Arc;
use uuid::Uuid;

impl Arbiter {
    /// The holder gives a lease back (it promises it closed every mapping).
    pub fn release(self: &Arc<Self>, tenant: &str, lease: Uuid) -> BrokerResult<()> {
        let mut st = self.lock();
        let ours = st.leases().get(&lease).is_some_and(|l| l.tenant == tenant);
        if !ours {
            // A block its process retained (`retained.rs`), now let go.
            return match st.drop_retained(tenant, lease) {
                true => Ok(()),
                false => Err(lease_not_found(lease)),
            };
        }
        st.end_lease(lease, Ending::Cache);
        tracing::debug!(%lease, tenant, "lease released");
        Ok(())
    }

    /// Is the peer process `find` names (under a short state lock) gone? Read from `/proc`
    /// after the lock is released. False when there is no such peer or its pid is unknown.
    fn peer_gone(&self, find: impl FnOnce(&State) -> Option<Peer>) -> bool {
        let pid = find(&self.lock()).and_then(|p| p.pid);
        pid.is_some_and(process_gone)
    }

    /// The holder of quarantined memory is gone: cache (or free) the block.
    pub(super) fn unquarantine(self: &Arc<Self>, id: Uuid, destroy: bool) {
        self.lock().lift_quarantine(id, destroy);
        self.crash.pass("after", "lift");
    }

    /// Ends a session: its waiting requests fail, its leases end (cached if its process is
    /// gone, otherwise quarantined or destroyed).
    pub fn end_session(self: &Arc<Self>, id: Uuid, reason: &str) {
        self.end_session_with(id, reason, None);
    }

    /// Ends a session, its leases ending by `forced` when given (the shutdown destroys
    /// them) instead of by whether its process is gone.
    pub(super) fn end_session_with(&self, id: Uuid, reason: &str, forced: Option<Ending>) {
        let gone = forced.is_none() && self.peer_gone(|st| st.sessions().get(&id).map(|s| s.peer));
        let mut st = self.lock();
        let Some((session, bytes)) = st.end_session(id, forced, gone) else {
            return;
        };
        self.restart().forget_resume(&id);
        tracing::info!(session = %id, tenant = %session.tenant, reason, leases = session.leases().len(), bytes, "session ended");
    }

    /// Takes a lease away for `why` (an operator's word, with what its holder is told, or
    /// a missed reclaim deadline). The holder is told; its memory is quarantined until its
    /// process lets go, or with the `terminate` policy the process is killed first. The
    /// holder's process is looked at before the lock, then one transition
    /// (`State::revoke`) does the rest.
    pub fn revoke(self: &Arc<Self>, id: Uuid, why: &Revoke) -> BrokerResult<LeaseView> {
        let gone = self.peer_gone(|st| {
            let l = st.leases().get(&id)?;
            st.sessions().get(&l.session).map(|s| s.peer)
        });
        let kill = self.cfg.reclaim_policy == ReclaimPolicy::Terminate;
        let mut st = self.lock();
        let (view, ending) = st
            .revoke(id, why, gone, kill)
            .ok_or_else(|| lease_not_found(id))?;
        tracing::warn!(lease = %id, reason = why.reason(), ?ending, "lease revoked");
        Ok(view)
    }
}
