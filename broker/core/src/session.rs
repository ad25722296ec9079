//! Sessions: a connected worker. A session has a tenant, the peer's pid/uid when it came
//! over the Unix socket, and the leases it holds; the events sent back to the worker
//! (reclaim requested, lease revoked, shutting down) are [`SessionEvent`]s, delivered
//! through the arbiter shell's outbox by session id (the session holds no channel). When its stream ends, its peer
//! process exits, or it shows no activity for the keepalive timeout, the arbiter ends it
//! and releases everything it held. Whether a peer process lives is `crate::process`'s
//! business.

use crate::id_map::{IdMap, IdSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use uuid::Uuid;

/// How the worker reached the broker, with what the kernel says about it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Peer {
    /// Process id from `SO_PEERCRED` (Unix socket only).
    pub pid: Option<u32>,
    pub uid: Option<u32>,
    pub unix: bool,
}

/// Events sent to a worker on its session stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SessionEvent {
    ReclaimRequested {
        lease_id: Uuid,
        bytes: u64,
        deadline: SystemTime,
        reason: String,
    },
    LeaseRevoked {
        lease_id: Uuid,
        reason: String,
    },
    ShuttingDown {
        reason: String,
        grace: Duration,
    },
    /// The compute turn is past its quantum and others wait: release it by `deadline`.
    YieldRequested {
        turn_id: Uuid,
        device: u32,
        deadline: SystemTime,
    },
    /// The compute turn was taken away (held past quantum + grace while others waited).
    TurnRevoked {
        turn_id: Uuid,
        device: u32,
        reason: String,
    },
    /// The broker wants back a block this session's process retained mapped (ended lease
    /// `lease_id`, `state/retained.rs`): it unmaps it and confirms with `ReleaseLease`.
    DropRetained {
        lease_id: Uuid,
    },
    /// A device the session holds leases on was marked unhealthy.
    DeviceUnhealthy {
        device: u32,
        uuid: String,
        reason: String,
    },
}

/// A connected worker.
#[derive(Debug)]
pub struct Session {
    pub id: Uuid,
    pub tenant: String,
    pub name: String,
    pub peer: Peer,
    pub opened: SystemTime,
    /// Last activity; shared with the session's event stream, which marks it without the
    /// state lock.
    pub last_seen: Arc<Activity>,
    /// The leases it holds: only the core's lease table moves them (a session starts with
    /// none; [`Session::held`], [`Session::let_go`]), so the two never disagree.
    leases: IdSet<Uuid>,
    /// What NVML last said about the peer process's GPU memory.
    pub gpu: Option<GpuUse>,
    /// The id of the token the session was opened with: revoking that token, or its
    /// expiry, ends the session (`arbiter/revocation.rs`).
    pub token_id: Option<String>,
    /// SHA-256 (hex) of the secret its worker resumes it with after a broker restart
    /// (`arbiter/restart/resume.rs`); None: it cannot be resumed.
    pub resume_hash: Option<String>,
    /// When its peer process started (`/proc/<pid>/stat`), so a restarted broker does not
    /// take another process of the same pid for it.
    pub peer_start: Option<u64>,
    /// Where its peer process runs (read by the shell when it opened): kept with the
    /// blocks the process may keep (`process_place.rs`).
    pub place: Option<Arc<crate::process_place::Place>>,
}

impl Session {
    /// A session just opened: active now, holding nothing, no GPU use seen yet.
    pub fn new(id: Uuid, tenant: &str, name: &str, peer: Peer, token_id: Option<String>) -> Self {
        Session {
            id,
            tenant: tenant.to_string(),
            name: name.to_string(),
            peer,
            opened: SystemTime::now(),
            last_seen: Activity::new(),
            leases: IdSet::default(),
            gpu: None,
            token_id,
            resume_hash: None,
            peer_start: None,
            place: None,
        }
    }
    /// The leases it holds.
    pub fn leases(&self) -> &IdSet<Uuid> {
        &self.leases
    }
    /// It holds lease `id` now (the core, adding the lease to its table).
    pub fn held(&mut self, id: Uuid) {
        self.leases.insert(id);
    }
    /// It no longer holds lease `id` (the core, removing the lease from its table).
    pub fn let_go(&mut self, id: &Uuid) {
        self.leases.remove(id);
    }
}

/// When a session last showed activity: a lock-free timestamp (nanoseconds since the
/// session opened), so its event stream can mark it from `poll_next` without the state lock.
#[derive(Debug)]
pub struct Activity {
    base: Instant,
    nanos: AtomicU64,
}

impl Activity {
    /// Active now.
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity {
            base: Instant::now(),
            nanos: AtomicU64::new(0),
        })
    }

    /// The session was active just now.
    pub fn touch(&self) {
        let n = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_max(n, Ordering::Relaxed);
    }

    /// When it was last active.
    pub fn last(&self) -> Instant {
        self.base + Duration::from_nanos(self.nanos.load(Ordering::Relaxed))
    }
}

/// GPU memory of a session's peer process (NVML).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuUse {
    /// All GPU memory the process uses.
    pub used: u64,
    /// The process's own allocations and CUDA context (NVML does not count memory it
    /// maps through IPC handles, so this is all of `used`).
    pub own: u64,
    /// `own` is above the allowance.
    pub over: bool,
}

/// Every open session, by id.
#[derive(Debug, Default)]
pub struct SessionTable {
    sessions: IdMap<Uuid, Session>,
}

impl SessionTable {
    pub fn insert(&mut self, s: Session) {
        self.sessions.insert(s.id, s);
    }
    pub fn get(&self, id: &Uuid) -> Option<&Session> {
        self.sessions.get(id)
    }
    pub fn get_mut(&mut self, id: &Uuid) -> Option<&mut Session> {
        self.sessions.get_mut(id)
    }
    pub fn remove(&mut self, id: &Uuid) -> Option<Session> {
        self.sessions.remove(id)
    }
    pub fn iter(&self) -> impl Iterator<Item = &Session> {
        self.sessions.values()
    }
    pub fn len(&self) -> usize {
        self.sessions.len()
    }
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }
    pub fn ids(&self) -> Vec<Uuid> {
        self.sessions.keys().copied().collect()
    }
    /// Sessions of `tenant`.
    pub fn count_of(&self, tenant: &str) -> usize {
        self.sessions
            .values()
            .filter(|s| s.tenant == tenant)
            .count()
    }
    /// Sessions idle for longer than `timeout`.
    pub fn idle(&self, timeout: Duration, now: Instant) -> Vec<Uuid> {
        self.sessions
            .values()
            .filter(|s| now.saturating_duration_since(s.last_seen.last()) > timeout)
            .map(|s| s.id)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_session_holds_nothing_and_its_leases_move_only_through_held_and_let_go() {
        let mut s = Session::new(Uuid::now_v7(), "a", "w", Peer::default(), None);
        assert!(s.leases().is_empty() && s.gpu.is_none());
        let (l1, l2) = (Uuid::now_v7(), Uuid::now_v7());
        s.held(l1);
        s.held(l2);
        s.held(l1);
        s.let_go(&l2);
        assert_eq!(s.leases().iter().copied().collect::<Vec<_>>(), vec![l1]);
        s.let_go(&l2);
        s.let_go(&l1);
        assert!(s.leases().is_empty());
    }

    #[test]
    fn activity_moves_forward_without_a_lock_and_idle_reads_it() {
        let a = Activity::new();
        let t0 = a.last();
        std::thread::sleep(Duration::from_millis(2));
        a.touch();
        let t1 = a.last();
        assert!(t1 > t0);
        // A touch never moves it back.
        a.nanos.store(0, Ordering::Relaxed);
        a.touch();
        assert!(a.last() >= t1);
    }
}
