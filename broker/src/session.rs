//! Sessions: a connected worker. A session has a tenant, the event stream back to the
//! worker (reclaim requested, lease revoked, shutting down), the peer's pid/uid when it
//! came over the Unix socket, and the leases it holds. When its stream ends, its peer
//! process exits, or it shows no activity for the keepalive timeout, the arbiter ends it
//! and releases everything it held. This module also owns the process-liveness helpers
//! (`/proc` state and pidfd exit watching).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::mpsc;
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
}

/// A connected worker.
#[derive(Debug)]
pub struct Session {
    pub id: Uuid,
    pub tenant: String,
    pub name: String,
    pub peer: Peer,
    pub opened: SystemTime,
    pub last_seen: Instant,
    pub events: mpsc::UnboundedSender<SessionEvent>,
    pub leases: HashSet<Uuid>,
    /// What NVML last said about the peer process's GPU memory.
    pub gpu: Option<GpuUse>,
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

impl Session {
    /// Sends an event; a worker that stopped listening just misses it.
    pub fn notify(&self, event: SessionEvent) {
        let _ = self.events.send(event);
    }
}

/// Every open session, by id.
#[derive(Debug, Default)]
pub struct SessionTable {
    sessions: HashMap<Uuid, Session>,
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
            .filter(|s| now.duration_since(s.last_seen) > timeout)
            .map(|s| s.id)
            .collect()
    }
}

/// Is process `pid` still running? A zombie (exited, not yet reaped) counts as gone:
/// its memory mappings are already released.
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // Format: pid (comm) state ... ; comm may hold spaces and parentheses.
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().next());
            !matches!(state, Some("Z") | Some("X") | Some("x"))
        }
        Err(_) => false,
    }
}

/// Resolves when process `pid` exits. Uses a pidfd (no polling, immune to pid reuse
/// after the watch starts) and falls back to polling `/proc` every 200 ms.
pub async fn wait_for_exit(pid: u32) {
    if let Some(fd) = pidfd_open(pid) {
        // SAFETY: `fd` is an OwnedFd moved into the AsyncFd, so it stays open exactly as
        // long as the registration.
        let registered = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
        };
        if let Ok(afd) = registered {
            let _ = afd.readable().await;
            return;
        }
    }
    while process_alive(pid) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn pidfd_open(pid: u32) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: plain syscall; a non-negative result is a new fd we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fd is a fresh, valid descriptor owned by nobody else.
    Some(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_is_alive_and_bogus_pid_is_not() {
        assert!(process_alive(std::process::id()));
        assert!(!process_alive(u32::MAX - 1));
    }

    #[tokio::test]
    async fn wait_for_exit_sees_a_child_exit() {
        let mut child = std::process::Command::new("sleep")
            .arg("0.2")
            .spawn()
            .unwrap();
        let pid = child.id();
        let waiter = tokio::spawn(wait_for_exit(pid));
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("exit seen within 5 s")
            .unwrap();
        let _ = child.wait();
        assert!(!process_alive(pid));
    }
}
