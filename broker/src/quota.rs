//! A tenant's quota, defined once: [`Quota`] (the limits an operator set) and
//! [`QuotaPatch`] (a change of some of them). The same type is what the ledger enforces,
//! what the state store persists (as JSON, through serde: `store::TenantRecord` flattens
//! it, so the field names are the file format) and what the audit log and the tenants
//! config file print; the gRPC messages are converted at the API edge
//! (`service/convert.rs`, one `From` pair each way).

use serde::{Deserialize, Serialize};

use crate::error::{BrokerError, BrokerResult};

/// A tenant's limits, as an operator set them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quota {
    /// Most device bytes held at once (granted, rounded sizes).
    pub limit_bytes: u64,
    /// Most live leases, device and host-fallback together; 0 means no limit.
    pub max_leases: u32,
    /// Higher goes first in queues and may reclaim from lower.
    pub priority: i32,
    /// Device bytes kept available for this tenant (<= limit_bytes).
    pub guaranteed_bytes: u64,
    /// Most host-fallback bytes held at once.
    pub host_limit_bytes: u64,
    /// Share of compute turns relative to other tenants (0 counts as 1). Absent in
    /// state files written before turns existed.
    #[serde(default)]
    pub turn_weight: u32,
}

impl Quota {
    /// The quota as the audit log and the tenants config file's reports show it: its
    /// serde form, the same fields as in the state file.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_default()
    }
}

/// A partial quota: the fields given change, the others keep their values (a new tenant
/// starts from zeros). What `SetQuota` with a patch and the config file's tenant tables
/// apply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuotaPatch {
    pub limit_bytes: Option<u64>,
    pub max_leases: Option<u32>,
    pub priority: Option<i32>,
    pub guaranteed_bytes: Option<u64>,
    pub host_limit_bytes: Option<u64>,
    pub turn_weight: Option<u32>,
}

impl QuotaPatch {
    /// The quota after applying this patch to `current` (None: a new tenant, which needs
    /// a limit).
    pub fn apply(&self, current: Option<&Quota>) -> BrokerResult<Quota> {
        let Some(base) = current else {
            if self.limit_bytes.is_none() {
                return Err(BrokerError::InvalidArgument(
                    "a new tenant needs limit_bytes (--limit)".into(),
                ));
            }
            return self.apply(Some(&Quota::default()));
        };
        Ok(Quota {
            limit_bytes: self.limit_bytes.unwrap_or(base.limit_bytes),
            max_leases: self.max_leases.unwrap_or(base.max_leases),
            priority: self.priority.unwrap_or(base.priority),
            guaranteed_bytes: self.guaranteed_bytes.unwrap_or(base.guaranteed_bytes),
            host_limit_bytes: self.host_limit_bytes.unwrap_or(base.host_limit_bytes),
            turn_weight: self.turn_weight.unwrap_or(base.turn_weight),
        })
    }

    /// True when no field is given.
    pub fn is_empty(&self) -> bool {
        *self == QuotaPatch::default()
    }
}
