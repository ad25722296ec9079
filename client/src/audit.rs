//! The broker's audit log as the admin service reports it: [`AuditEntry`] (one operator
//! change: when, who, what, before and after) and [`AuditFilter`] (which to list).

use serde::Serialize;

use gpu_broker_proto::v1 as pb;

/// One recorded change.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct AuditEntry {
    /// Increasing sequence number.
    pub seq: u64,
    /// When, milliseconds since the Unix epoch.
    pub unix_ms: i64,
    /// Token that made it (`admin-file` for the admin token file, `system` for the
    /// broker itself).
    pub token_id: String,
    pub token_name: String,
    pub scope: String,
    /// Peer credentials on the Unix socket.
    pub peer_uid: Option<u32>,
    pub peer_pid: Option<u32>,
    /// What, e.g. `quota.set`, `token.issue`, `lease.revoke`.
    pub action: String,
    /// Tenant concerned ("" if none).
    pub tenant: String,
    /// Object concerned (token id, lease id, device; "" if none).
    pub target: String,
    /// Values before and after, as JSON text ("" when none).
    pub before_json: String,
    pub after_json: String,
}

impl From<pb::AuditEntry> for AuditEntry {
    fn from(e: pb::AuditEntry) -> Self {
        AuditEntry {
            seq: e.seq,
            unix_ms: e.unix_ms,
            token_id: e.token_id,
            token_name: e.token_name,
            scope: e.scope,
            peer_uid: e.peer_uid,
            peer_pid: e.peer_pid,
            action: e.action,
            tenant: e.tenant,
            target: e.target,
            before_json: e.before_json,
            after_json: e.after_json,
        }
    }
}

/// Which changes to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditFilter {
    /// Only changes at or after this instant (ms since the epoch).
    pub since_unix_ms: Option<i64>,
    /// Only changes concerning this tenant.
    pub tenant: Option<String>,
    /// The newest this many (0: the broker's cap, 10,000).
    pub limit: u32,
}
