//! Resuming a session taken back: a worker that reconnects after the restart names its
//! session, its secret (given when the session opened: [`new_resume_secret`], kept only
//! as a hash) and the leases it holds, from the same process; leases taken back that it
//! does not name end. Until then, those leases wait here (`RestartState`'s
//! `awaiting_resume`); a session nobody resumes ends with the keepalive timeout or its
//! process.

use super::Restart;
use crate::arbiter::Ending;
use crate::error::{BrokerError, BrokerResult};
use crate::session::{Peer, SessionEvent};
use std::collections::HashSet;
use tokio::sync::mpsc;
use uuid::Uuid;

impl Restart<'_> {
    /// Attaches the caller's stream to `id`, a session taken back from the keeper: only
    /// its own process (`peer`: same pid and uid) with its secret, of `tenant`, and only
    /// while no stream has it. Leases taken back with it that the worker does not name in
    /// `held` end: into the cache those it names in `let_go`, the others as abandoned
    /// memory (its process may map them); leases granted since the restart stay. Its
    /// events, the leases kept, and those gone: ended now, or named but no longer there
    /// (ended before the restart: their end reached the keeper, not the worker).
    #[allow(clippy::type_complexity)]
    pub(crate) fn resume_session(
        &self,
        tenant: &str,
        id: Uuid,
        secret: &str,
        peer: Peer,
        held: &[Uuid],
        let_go: &[Uuid],
    ) -> BrokerResult<(mpsc::UnboundedReceiver<SessionEvent>, Vec<Uuid>, Vec<Uuid>)> {
        // A closing broker reopens no mailbox (open_session refuses likewise).
        self.arb.lifecycle.refuse_new_work()?;
        let refused = || BrokerError::NotFound(crate::error::Missing::Session(id));
        let hash = secret_hash(secret);
        let (tx, rx) = mpsc::unbounded_channel();
        let mut st = self.arb.lock();
        let Some(s) = st.sessions().get(&id) else {
            return Err(refused());
        };
        use subtle::ConstantTimeEq;
        let secret_ok = s
            .resume_hash
            .as_deref()
            .is_some_and(|h| bool::from(h.as_bytes().ct_eq(hash.as_bytes())));
        let same_process = peer.pid.is_some() && s.peer.pid == peer.pid && s.peer.uid == peer.uid;
        if s.tenant != tenant
            || !secret_ok
            || !same_process
            || self.arb.outbox.sender(&id).is_some()
        {
            tracing::warn!(session = %id, tenant, pid = ?peer.pid, "a resume was refused");
            return Err(refused());
        }
        s.last_seen.touch();
        let held: HashSet<Uuid> = held.iter().copied().collect();
        let adopted = self
            .state
            .awaiting_resume
            .lock()
            .remove(&id)
            .unwrap_or_default();
        let (kept, ended): (Vec<Uuid>, Vec<Uuid>) = adopted
            .into_iter()
            .filter(|l| s.leases().contains(l))
            .partition(|l| held.contains(l));
        let gone: Vec<Uuid> = held
            .iter()
            .filter(|l| !s.leases().contains(l))
            .copied()
            .collect();
        let holder = s.peer;
        let let_go: HashSet<Uuid> = let_go.iter().copied().collect();
        self.arb.outbox.open(&st, id, tx);
        for l in &ended {
            // Let go by the worker: the cache's. Else its grant's answer was lost, and its
            // process may map it all the same: quarantined while that process lives.
            let ending = match st.leases().get(l) {
                Some(_) if let_go.contains(l) => Ending::Cache,
                Some(v) => st.abandoned(&holder, v.device, v.tier, false),
                None => continue,
            };
            st.end_lease(*l, ending);
        }
        drop(st);
        tracing::info!(session = %id, tenant, kept = kept.len(), ended = ended.len(), "session resumed");
        self.arb.metrics.count_resumed();
        Ok((rx, kept, ended.into_iter().chain(gone).collect()))
    }

    /// Session `id` ended: nothing of it awaits a resume any more.
    pub(in crate::arbiter) fn forget_resume(&self, id: &Uuid) {
        self.state.awaiting_resume.lock().remove(id);
    }
}

/// A session's resume secret and its hash (what is kept).
pub(crate) fn new_resume_secret() -> (String, String) {
    let secret: [u8; 32] = rand::random();
    let secret = hex::encode(secret);
    (secret.clone(), secret_hash(&secret))
}

fn secret_hash(secret: &str) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(secret.as_bytes()))
}
