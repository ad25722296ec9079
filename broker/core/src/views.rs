//! What operators and `/metrics` see: plain snapshots of a tenant, a session, a quarantined
//! block and a device, built by the arbiter under its lock and read by the admin service,
//! `metrics.rs` and the status page. Data only: no locks, no behaviour, so the layers that
//! render them need not know the arbiter.

use crate::ledger::{Quota, Usage};
use std::time::SystemTime;
use uuid::Uuid;

/// A tenant with its live usage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantView {
    pub name: String,
    pub quota: Quota,
    pub usage: Usage,
    /// Device bytes per device index (`Tenant::device_bytes`).
    pub device_bytes: std::collections::BTreeMap<u32, u64>,
    pub borrowed_bytes: u64,
    pub sessions: u32,
    pub waiting: u32,
    /// Where the tenant's first waiting request stands in the order of service (1: next);
    /// 0 when none waits.
    pub queue_position: u32,
    pub tokens: u32,
    pub turns: crate::scheduler::TurnUsage,
}

impl TenantView {
    /// The ledger's part of a tenant's view, with its open sessions and waiting requests;
    /// tokens and compute turns are filled in after the state lock is released.
    pub fn of(t: &crate::ledger::Tenant, sessions: u32, waiting: u32) -> TenantView {
        TenantView {
            name: t.name.clone(),
            quota: t.quota.clone(),
            usage: t.usage,
            device_bytes: t.device_bytes.clone(),
            borrowed_bytes: t.borrowed_bytes(),
            sessions,
            waiting,
            queue_position: 0,
            tokens: 0,
            turns: Default::default(),
        }
    }
}

/// A session as operators see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionView {
    pub id: Uuid,
    pub tenant: String,
    pub name: String,
    pub pid: Option<u32>,
    pub uid: Option<u32>,
    pub unix: bool,
    pub opened: SystemTime,
    pub lease_count: u32,
    pub held_bytes: u64,
    pub gpu: Option<crate::session::GpuUse>,
    /// Room of the session's process reservation (`reservations.rs`).
    pub process_reserved: u64,
}

/// A quarantined block as operators see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuarantineView {
    pub lease: Uuid,
    pub tenant: String,
    pub device: u32,
    pub bytes: u64,
    pub pid: Option<u32>,
    pub since: SystemTime,
    pub reason: HoldReason,
    /// Every process that may still map it, sorted (empty: none known, a TCP peer).
    pub holders: Vec<u32>,
    /// The publication whose importers hold it, and how many imports it has.
    pub publication: Option<(Uuid, usize)>,
}

/// Why quarantined memory is still held. None of them can be lifted by an operator: the
/// memory may still be mapped, so it stays counted until its holders let go or exit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldReason {
    /// The lease ended while its process lives.
    Holder,
    /// The lease was published and ended while importers hold the memory.
    Importers,
    /// Processes outside the lease's session fetched its descriptor.
    Recipients,
    /// Freed, but a process that had its descriptor keeps it (`state/stranded.rs`).
    KeptAfterFree,
}

/// A device as operators see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceReport {
    pub index: u32,
    pub name: String,
    /// `GPU-<uuid>` / `HOST-<uuid>` (see `DeviceDesc::uuid`).
    pub uuid: String,
    pub model: String,
    pub backend: String,
    pub total: u64,
    pub free: u64,
    pub leasable: u64,
    pub leased: u64,
    pub cached: u64,
    pub headroom: u64,
    pub quarantined: u64,
    /// Memory on the device neither the broker's nor inside a process reservation.
    pub external_used: u64,
    /// Kept for reserved processes to allocate themselves.
    pub process_reserved: u64,
    pub granularity: u64,
    pub lease_count: u32,
    pub waiting: u32,
    /// Tenant holding the compute turn.
    pub turn_holder: Option<String>,
    pub turns_waiting: u32,
    /// Why the device drains (`None`: it does not).
    pub drain_reason: Option<String>,
    /// Why it is unhealthy (`None`: healthy).
    pub fault: Option<String>,
}
