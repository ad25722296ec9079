//! Quarantined memory as operators see it ([`QuarantinedBlock`]): the block of an ended
//! lease that a live process may still map, with the processes that may, from
//! `ListQuarantined`. That includes memory held for importers of a shared lease whose
//! publisher's lease ended, and memory of a lease whose descriptor other processes fetched.
//! No operator call lifts any of it: the broker keeps counting it until every holder let
//! go or exited (holders of unknown pid: until `--quarantine-timeout`).

use serde::{Deserialize, Serialize};

use gpu_broker_proto::v1 as pb;

/// Why a quarantined block is still held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldReason {
    /// A broker that does not say.
    #[default]
    Unspecified,
    /// The lease ended while its process lives.
    Holder,
    /// The lease was published and ended while importers hold the memory.
    Importers,
    /// Processes outside the lease's session fetched its descriptor.
    Recipients,
    /// The broker freed it, but a process that had its descriptor keeps it on the device.
    KeptAfterFree,
}

impl HoldReason {
    /// A few words for tables.
    pub fn describe(self) -> &'static str {
        match self {
            HoldReason::Unspecified => "-",
            HoldReason::Holder => "holder",
            HoldReason::Importers => "importers",
            HoldReason::Recipients => "fd recipients",
            HoldReason::KeptAfterFree => "kept after free",
        }
    }
}

/// One quarantined block; it returns to use when its holders let go or exit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuarantinedBlock {
    /// The lease it belonged to.
    pub lease_id: String,
    pub tenant: String,
    pub device: u32,
    pub bytes: u64,
    /// The lease's own process that may still map it (`None`: unknown, a TCP peer, or
    /// only other processes hold it).
    pub pid: Option<u32>,
    /// Milliseconds since the Unix epoch.
    pub since_unix_ms: i64,
    #[serde(default)]
    pub reason: HoldReason,
    /// Every process that may still map it, sorted.
    #[serde(default)]
    pub holder_pids: Vec<u32>,
    /// The shared lease whose importers hold it (reason [`HoldReason::Importers`]).
    #[serde(default)]
    pub publication_id: Option<String>,
    /// Live or lingering imports of that publication.
    #[serde(default)]
    pub importers: u32,
}

impl From<pb::QuarantinedBlock> for QuarantinedBlock {
    fn from(q: pb::QuarantinedBlock) -> Self {
        let reason = match pb::HoldReason::try_from(q.reason) {
            Ok(pb::HoldReason::Holder) => HoldReason::Holder,
            Ok(pb::HoldReason::Importers) => HoldReason::Importers,
            Ok(pb::HoldReason::Recipients) => HoldReason::Recipients,
            Ok(pb::HoldReason::KeptAfterFree) => HoldReason::KeptAfterFree,
            _ => HoldReason::Unspecified,
        };
        let mut holder_pids = q.holder_pids;
        if holder_pids.is_empty() && q.pid != 0 {
            // An older broker names only the lease's own process.
            holder_pids.push(q.pid);
        }
        QuarantinedBlock {
            lease_id: q.lease_id,
            tenant: q.tenant,
            device: q.device,
            bytes: q.bytes,
            pid: (q.pid != 0).then_some(q.pid),
            since_unix_ms: q.since_unix_ms,
            reason,
            holder_pids,
            publication_id: (!q.publication_id.is_empty()).then_some(q.publication_id),
            importers: q.importers,
        }
    }
}
