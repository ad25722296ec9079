//! Quarantined memory as operators see it ([`QuarantinedBlock`]): the block of an ended
//! lease that a live process may still map, with that process, from `ListQuarantined`.

use serde::{Deserialize, Serialize};

use gpu_broker_proto::v1 as pb;

/// One quarantined block; it returns to use when its holder lets go or exits.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuarantinedBlock {
    /// The lease it belonged to.
    pub lease_id: String,
    pub tenant: String,
    pub device: u32,
    pub bytes: u64,
    /// The process that may still map it (`None`: unknown, a TCP peer).
    pub pid: Option<u32>,
    /// Milliseconds since the Unix epoch.
    pub since_unix_ms: i64,
}

impl From<pb::QuarantinedBlock> for QuarantinedBlock {
    fn from(q: pb::QuarantinedBlock) -> Self {
        QuarantinedBlock {
            lease_id: q.lease_id,
            tenant: q.tenant,
            device: q.device,
            bytes: q.bytes,
            pid: (q.pid != 0).then_some(q.pid),
            since_unix_ms: q.since_unix_ms,
        }
    }
}
