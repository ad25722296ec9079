//! Sessions outlive nothing that let them in: a session remembers the token it was opened
//! with, and when that token is revoked (at once) or expires (on the next sweep of the
//! background ticker) the session ends like any other — waiters are refused, leases end
//! (quarantined while the peer may still map them), and its event stream closes, so a
//! reconnecting worker meets `UNAUTHENTICATED`.

use super::sessions::Sessions;
use uuid::Uuid;

impl Sessions<'_> {
    /// Ends every session opened with `token_id`. Returns how many.
    pub(crate) fn end_of_token(&self, token_id: &str, reason: &str) -> usize {
        let ids: Vec<Uuid> = self
            .arb
            .lock()
            .sessions()
            .iter()
            .filter(|s| s.token_id.as_deref() == Some(token_id))
            .map(|s| s.id)
            .collect();
        for id in &ids {
            self.arb.end_session(*id, reason);
        }
        if !ids.is_empty() {
            tracing::warn!(token_id, sessions = ids.len(), reason, "sessions ended");
        }
        ids.len()
    }

    /// Ends the sessions whose token no longer authenticates (expired, or removed by a
    /// path other than `revoke_token`). Returns how many.
    pub(super) fn end_of_lapsed_tokens(&self) -> usize {
        let live = self.arb.auth.live_token_ids();
        let ids: Vec<Uuid> = self
            .arb
            .lock()
            .sessions()
            .iter()
            .filter(|s| s.token_id.as_ref().is_some_and(|t| !live.contains(t)))
            .map(|s| s.id)
            .collect();
        for id in &ids {
            self.arb.end_session(*id, "the session's token expired");
        }
        ids.len()
    }
}

#[cfg(test)]
mod tests {
    use crate::arbiter::tokens::TokenSpec;
    use crate::arbiter::{Arbiter, ArbiterConfig};
    use crate::auth::Scope;
    use crate::ledger::Quota;
    use crate::session::Peer;
    use std::sync::Arc;
    use std::time::Duration;

    fn arbiter() -> Arc<Arbiter> {
        let arb = crate::arbiter::host_arbiter(64 << 20, 1, ArbiterConfig::default());
        arb.set_quota(
            "a",
            Quota {
                limit_bytes: 32 << 20,
                ..Quota::default()
            },
        )
        .unwrap();
        arb
    }

    fn worker_token(arb: &Arc<Arbiter>, ttl: Option<Duration>) -> String {
        arb.changes()
            .issue_token(
                TokenSpec {
                    tenant: Some("a".into()),
                    scope: Scope::Worker,
                    ttl,
                    name: "w".into(),
                    description: String::new(),
                },
                None,
            )
            .unwrap()
            .entry
            .token_id
    }

    #[test]
    fn revoking_a_token_ends_its_sessions_and_no_others() {
        let arb = arbiter();
        let (t1, t2) = (worker_token(&arb, None), worker_token(&arb, None));
        let open = |t: &str| {
            arb.sessions()
                .open("a", "s", Peer::default(), Some(t.to_string()))
                .map(|(id, rx, _)| (id, rx))
                .unwrap()
        };
        let (s1, mut rx1) = open(&t1);
        let (s1b, _rx1b) = open(&t1);
        let (s2, mut rx2) = open(&t2);
        let (untracked, _rx3) = arb.open_session("a", "s", Peer::default()).unwrap();
        arb.changes().revoke_token(&t1, None).unwrap();
        let live = arb.lock().sessions().ids();
        assert!(!live.contains(&s1) && !live.contains(&s1b), "{live:?}");
        assert!(live.contains(&s2) && live.contains(&untracked), "{live:?}");
        // The ended session's event channel is closed; the other's is not.
        assert!(matches!(
            rx1.try_recv(),
            Err(tokio::sync::mpsc::error::TryRecvError::Disconnected)
        ));
        assert!(matches!(
            rx2.try_recv(),
            Err(tokio::sync::mpsc::error::TryRecvError::Empty)
        ));
    }

    #[test]
    fn the_sweep_ends_sessions_of_expired_tokens_only() {
        let arb = arbiter();
        let short = worker_token(&arb, Some(Duration::from_millis(1)));
        let long = worker_token(&arb, Some(Duration::from_secs(3600)));
        let (s_short, _a) = arb
            .sessions()
            .open("a", "s", Peer::default(), Some(short))
            .map(|(id, rx, _)| (id, rx))
            .unwrap();
        let (s_long, _b) = arb
            .sessions()
            .open("a", "s", Peer::default(), Some(long))
            .map(|(id, rx, _)| (id, rx))
            .unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(arb.sessions().end_of_lapsed_tokens(), 1);
        let live = arb.lock().sessions().ids();
        assert_eq!(live, vec![s_long], "{s_short} should have ended");
        assert_eq!(arb.sessions().end_of_lapsed_tokens(), 0);
    }
}
