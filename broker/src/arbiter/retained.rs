//! The shell of retained blocks (`gpu_broker_core::state`'s `retained.rs`): a release
//! whose process keeps its mapping, a lease request answered with such a block (one lock
//! hold, no queue, no device work, no ticket), and the confirmation that it let go:
//! [`Retained`], reached by [`Arbiter::retained`], keeping no fields.

use super::Arbiter;
use super::ValidRequest;
use crate::error::{lease_not_found, BrokerResult};
use crate::lease::LeaseView;
use std::sync::Arc;
use std::time::Instant;
use uuid::Uuid;

/// What a release asking to retain its mapping did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retaining {
    /// The block is held for the caller's process, mapped.
    Retained,
    /// Nothing: the lease is still the caller's, to unmap and release plainly.
    Declined,
    /// The id named a block this tenant retained: let go into the cache.
    LetGo,
}

/// A session's process as an acquire needs it ([`Retained::session_peer`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionPeer {
    pub peer: crate::session::Peer,
    /// When the peer process started (`process::start_ticks`, read when the session opened).
    pub start: Option<u64>,
    /// It retains a block.
    pub retains: bool,
}

/// A session as its lease line sees it ([`Retained::line_session`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LineSession {
    pub tenant: String,
    pub peer: crate::session::Peer,
    /// When the peer process started, read when the session opened.
    pub start: Option<u64>,
    /// The token that opened it (`None`: a broker without tokens).
    pub token_id: Option<String>,
}

/// Retained blocks of one arbiter ([`Arbiter::retained`]). It keeps no fields: the
/// blocks live in the state.
pub(crate) struct Retained<'a> {
    pub(super) arb: &'a Arc<Arbiter>,
}

impl Retained<'_> {
    /// Releases lease `id` of `tenant` for process `caller` (the kernel's pid of the
    /// caller), retaining its block mapped for that process when it is the session's own
    /// and the memory was never shared. A release that cannot be retained (another process,
    /// a pid unknown, memory shared or drawn from a reservation) is declined and changes
    /// nothing when the caller `may_decline` (it still maps the block and releases it
    /// plainly once it let go); else it is a plain release. An id that names a block this
    /// tenant retained is that block let go.
    pub(crate) fn release(
        &self,
        tenant: &str,
        id: Uuid,
        caller: Option<u32>,
        may_decline: bool,
    ) -> BrokerResult<Retaining> {
        let Some(pid) = caller.filter(|&p| p != 0) else {
            if !may_decline {
                return self.arb.release(tenant, id).map(|()| Retaining::LetGo);
            }
            let mut st = self.arb.lock();
            return match st.has_lease(tenant, id) {
                true => Ok(Retaining::Declined),
                false if st.drop_retained(tenant, id) => Ok(Retaining::LetGo),
                false => Err(lease_not_found(id)),
            };
        };
        let mut st = self.arb.lock();
        if let Some(retained) = st.release_retained(tenant, id, pid, may_decline) {
            tracing::debug!(lease = %id, tenant, retained, "retaining release");
            return Ok(match (retained, may_decline) {
                (true, _) => Retaining::Retained,
                (false, true) => Retaining::Declined,
                (false, false) => Retaining::LetGo,
            });
        }
        if st.drop_retained(tenant, id) {
            return Ok(Retaining::LetGo);
        }
        Err(lease_not_found(id))
    }

    /// [`Retained::release`] asked on `session`'s lease line by its process `pid`, which
    /// may decline: `None` when the session is gone or not that process's, or the id
    /// names no lease of its tenant (gRPC then answers, a retained block let go included).
    pub(crate) fn release_on_line(&self, session: Uuid, id: Uuid, pid: u32) -> Option<Retaining> {
        let mut st = self.arb.lock();
        let tenant = st
            .sessions()
            .get(&session)
            .filter(|s| s.peer.pid == Some(pid))?
            .tenant
            .clone();
        let retained = st.release_retained(&tenant, id, pid, true)?;
        tracing::debug!(lease = %id, tenant, retained, "retaining release on a lease line");
        Some(match retained {
            true => Retaining::Retained,
            false => Retaining::Declined,
        })
    }

    /// The peer of `session` (of `tenant`, else `NOT_FOUND`), when its process started, and
    /// whether that process retains any block: an acquire asks
    /// [`Retained::acquire`] only then, so the ordinary path takes the state lock no
    /// more often than before.
    pub(crate) fn session_peer(&self, tenant: &str, session: Uuid) -> BrokerResult<SessionPeer> {
        let st = self.arb.lock();
        match st.sessions().get(&session) {
            Some(s) if s.tenant == tenant => Ok(SessionPeer {
                peer: s.peer,
                start: s.peer_start,
                retains: st.retains(session),
            }),
            _ => Err(crate::arbiter::session_not_found(session)),
        }
    }

    /// What a lease line of `session` needs of it (`fd/lease_line.rs`): its tenant, its
    /// process and the token it was opened with; `None` when there is no such session.
    pub(crate) fn line_session(&self, session: Uuid) -> Option<LineSession> {
        let st = self.arb.lock();
        let s = st.sessions().get(&session)?;
        Some(LineSession {
            tenant: s.tenant.clone(),
            peer: s.peer,
            start: s.peer_start,
            token_id: s.token_id.clone(),
        })
    }

    /// A lease for `req` made of a block process `caller` retained, when it has one that
    /// fits the request (`State::grant_retained`); `None`: the request takes the ordinary
    /// path.
    pub(crate) fn acquire(&self, req: &ValidRequest, caller: Option<u32>) -> Option<LeaseView> {
        let pid = caller.filter(|&p| p != 0)?;
        if self.arb.lifecycle.refuse_new_work().is_err() {
            return None;
        }
        let started = Instant::now();
        let view = {
            let mut st = self.arb.lock();
            let avail = self.arb.avail.read();
            st.grant_retained(req, pid, &avail)
        }?;
        self.arb
            .metrics
            .acquired(&Ok::<_, crate::error::BrokerError>(()), started.elapsed());
        Some(view)
    }
}
