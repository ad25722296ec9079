//! A session as the admin service reports it ([`SessionInfo`], from `ListSessions`): the
//! operator's record, not the worker's handle (that is [`crate::Session`]).

use serde::Serialize;

use gpu_broker_proto::v1 as pb;

/// A session as the admin service reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SessionInfo {
    /// Session id.
    pub session_id: String,
    /// Tenant of the session.
    pub tenant: String,
    /// Name the worker gave.
    pub name: String,
    /// Peer process id (0 when unknown, e.g. over TCP).
    pub peer_pid: u32,
    /// Peer user id (0 when unknown).
    pub peer_uid: u32,
    /// When it opened, milliseconds since the Unix epoch.
    pub opened_unix_ms: i64,
    /// Live leases of the session.
    pub lease_count: u32,
    /// Bytes those leases hold.
    pub held_bytes: u64,
    /// `"unix"` or `"tcp"`.
    pub transport: String,
    /// GPU memory the peer process uses (NVML; 0 when unknown).
    pub gpu_used_bytes: u64,
    /// Of that, memory beyond its leases (own allocations and CUDA context).
    pub own_alloc_bytes: u64,
    /// The worker allocates more GPU memory behind the broker's back than allowed.
    pub over_allowance: bool,
    /// Room of the session's process reservation (`gpu-brokerctl run`), less what its
    /// process's leases drew.
    pub process_reserved_bytes: u64,
}

impl From<pb::SessionInfo> for SessionInfo {
    fn from(s: pb::SessionInfo) -> Self {
        SessionInfo {
            session_id: s.session_id,
            tenant: s.tenant,
            name: s.name,
            peer_pid: s.peer_pid,
            peer_uid: s.peer_uid,
            opened_unix_ms: s.opened_unix_ms,
            lease_count: s.lease_count,
            held_bytes: s.held_bytes,
            transport: s.transport,
            gpu_used_bytes: s.gpu_used_bytes,
            own_alloc_bytes: s.own_alloc_bytes,
            over_allowance: s.over_allowance,
            process_reserved_bytes: s.process_reserved_bytes,
        }
    }
}
