//! Tenants as the client sees them: a [`QuotaSpec`] (the limits an operator sets),
//! [`UsageCounters`] (what the tenant holds right now), [`TenantInfo`] (both, as the
//! admin service reports them) and [`Usage`] (a worker's view of its own tenant: both, embedded).
//! Plain data with `serde` support, converted from the gRPC messages.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use gpu_broker_proto::v1 as pb;

/// A tenant's limits. [`AdminClient::set_quota`](crate::AdminClient::set_quota) replaces
/// all of them at once; [`QuotaPatch`] changes only some.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaSpec {
    /// Most device bytes the tenant may hold at once (granted, rounded sizes).
    pub limit_bytes: u64,
    /// Most live leases; 0 means no limit.
    pub max_leases: u32,
    /// Higher goes first in queues and may reclaim from lower.
    pub priority: i32,
    /// Device bytes kept available for this tenant; must be <= `limit_bytes`.
    pub guaranteed_bytes: u64,
    /// Most host-fallback bytes at once (0: no host fallback).
    pub host_limit_bytes: u64,
    /// Share of compute turns relative to other tenants (0 counts as 1).
    #[serde(default)]
    pub turn_weight: u32,
    /// Per-device caps by device index (on top of `limit_bytes`); a device without an
    /// entry is bounded by the total alone, 0 keeps the tenant off it.
    #[serde(default)]
    pub device_limit_bytes: BTreeMap<u32, u64>,
}

impl QuotaSpec {
    /// A quota of `limit_bytes` with every other field at its default (0).
    pub fn new(limit_bytes: u64) -> Self {
        QuotaSpec {
            limit_bytes,
            ..Default::default()
        }
    }
}

impl From<pb::Quota> for QuotaSpec {
    fn from(q: pb::Quota) -> Self {
        QuotaSpec {
            limit_bytes: q.limit_bytes,
            max_leases: q.max_leases,
            priority: q.priority,
            guaranteed_bytes: q.guaranteed_bytes,
            host_limit_bytes: q.host_limit_bytes,
            turn_weight: q.turn_weight,
            device_limit_bytes: q.device_limit_bytes.into_iter().collect(),
        }
    }
}

impl From<QuotaSpec> for pb::Quota {
    fn from(q: QuotaSpec) -> Self {
        pb::Quota {
            limit_bytes: q.limit_bytes,
            max_leases: q.max_leases,
            priority: q.priority,
            guaranteed_bytes: q.guaranteed_bytes,
            host_limit_bytes: q.host_limit_bytes,
            turn_weight: q.turn_weight,
            device_limit_bytes: q.device_limit_bytes.into_iter().collect(),
        }
    }
}

/// Some of a tenant's limits: the fields given change, the others keep their current
/// values (a new tenant starts from zeros and needs `limit_bytes`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaPatch {
    pub limit_bytes: Option<u64>,
    pub max_leases: Option<u32>,
    pub priority: Option<i32>,
    pub guaranteed_bytes: Option<u64>,
    pub host_limit_bytes: Option<u64>,
    pub turn_weight: Option<u32>,
    /// Remove every per-device cap before applying `device_limits`.
    #[serde(default)]
    pub clear_device_limits: bool,
    /// Per-device caps to set (`Some(bytes)`) or remove (`None`), in order.
    #[serde(default)]
    pub device_limits: Vec<(u32, Option<u64>)>,
}

impl QuotaPatch {
    /// True when no field is given.
    pub fn is_empty(&self) -> bool {
        *self == QuotaPatch::default()
    }
}

impl From<QuotaPatch> for pb::QuotaPatch {
    fn from(q: QuotaPatch) -> Self {
        pb::QuotaPatch {
            limit_bytes: q.limit_bytes,
            max_leases: q.max_leases,
            priority: q.priority,
            guaranteed_bytes: q.guaranteed_bytes,
            host_limit_bytes: q.host_limit_bytes,
            turn_weight: q.turn_weight,
            clear_device_limits: q.clear_device_limits,
            device_limits: q
                .device_limits
                .into_iter()
                .map(|(device, limit_bytes)| pb::DeviceLimit {
                    device,
                    limit_bytes,
                })
                .collect(),
        }
    }
}

/// What a quota change did: the tenant now, whether it was created, and what the change
/// means for what it holds (e.g. a limit below its usage).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaChange {
    pub tenant: TenantInfo,
    pub created: bool,
    pub warnings: Vec<String>,
}

/// Live usage of one tenant.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageCounters {
    /// Device bytes held (granted sizes).
    pub held_bytes: u64,
    /// Live leases.
    pub lease_count: u32,
    /// Bytes held beyond the tenant's guarantee.
    pub borrowed_bytes: u64,
    /// Bytes of revoked or abandoned leases a live process may still have mapped.
    pub quarantined_bytes: u64,
    /// Host-fallback bytes held.
    pub host_held_bytes: u64,
    /// Open sessions.
    pub session_count: u32,
    /// Requests now waiting in a queue.
    pub waiting_requests: u32,
    /// Compute turns that ended.
    #[serde(default)]
    pub turns: u64,
    /// Total time those turns were held, in milliseconds.
    #[serde(default)]
    pub compute_ms: u64,
    /// Time held past the quantum while others waited, in milliseconds.
    #[serde(default)]
    pub overrun_ms: u64,
    /// Device bytes held per device index (held, in flight, quarantined: what
    /// [`QuotaSpec::device_limit_bytes`] caps); devices with nothing are left out.
    #[serde(default)]
    pub device_committed_bytes: BTreeMap<u32, u64>,
    /// Device bytes reserved for processes to allocate themselves, less what their
    /// leases drew (see [`crate::reservation`]).
    #[serde(default)]
    pub process_reserved_bytes: u64,
    /// Live process reservations.
    #[serde(default)]
    pub process_reservations: u32,
    /// Where the tenant's first waiting request stands in the node's order of service
    /// (1: next); 0 when none waits (or the broker is older than this field).
    #[serde(default)]
    pub queue_position: u32,
}

impl From<pb::Usage> for UsageCounters {
    fn from(u: pb::Usage) -> Self {
        UsageCounters {
            held_bytes: u.held_bytes,
            lease_count: u.lease_count,
            borrowed_bytes: u.borrowed_bytes,
            quarantined_bytes: u.quarantined_bytes,
            host_held_bytes: u.host_held_bytes,
            session_count: u.session_count,
            waiting_requests: u.waiting_requests,
            turns: u.turns,
            compute_ms: u.compute_ms,
            overrun_ms: u.overrun_ms,
            device_committed_bytes: u.device_committed_bytes.into_iter().collect(),
            process_reserved_bytes: u.process_reserved_bytes,
            process_reservations: u.process_reservations,
            queue_position: u.queue_position,
        }
    }
}

/// A tenant with its quota and live usage (admin view).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantInfo {
    /// Tenant name.
    pub name: String,
    /// Its limits.
    pub quota: QuotaSpec,
    /// What it holds now.
    pub usage: UsageCounters,
    /// Live tokens of the tenant.
    pub token_count: u32,
}

impl From<pb::TenantInfo> for TenantInfo {
    fn from(t: pb::TenantInfo) -> Self {
        TenantInfo {
            name: t.name,
            quota: t.quota.map(Into::into).unwrap_or_default(),
            usage: t.usage.map(Into::into).unwrap_or_default(),
            token_count: t.token_count,
        }
    }
}

/// The calling worker's own tenant: its quota and live usage. The quota is the one
/// [`QuotaSpec`] and the counters the one [`UsageCounters`], embedded (and serialised as
/// `quota` and `usage` objects, as in [`TenantInfo`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tenant name.
    pub tenant: String,
    /// Its limits.
    pub quota: QuotaSpec,
    /// What it holds now.
    pub usage: UsageCounters,
}

impl Usage {
    /// The quota part (a copy of [`Usage::quota`](#structfield.quota)).
    pub fn quota(&self) -> QuotaSpec {
        self.quota.clone()
    }

    /// The live-usage part (a copy of [`Usage::usage`](#structfield.usage)).
    pub fn counters(&self) -> UsageCounters {
        self.usage.clone()
    }

    /// Device bytes the tenant may still take under its limit.
    pub fn available_bytes(&self) -> u64 {
        self.quota.limit_bytes.saturating_sub(self.usage.held_bytes)
    }
}

impl From<pb::GetUsageResponse> for Usage {
    fn from(r: pb::GetUsageResponse) -> Self {
        Usage {
            tenant: r.tenant,
            quota: r.quota.map(Into::into).unwrap_or_default(),
            usage: r.usage.map(Into::into).unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_flattens_and_splits_back() {
        let resp = pb::GetUsageResponse {
            tenant: "a".into(),
            quota: Some(pb::Quota {
                limit_bytes: 100,
                max_leases: 3,
                priority: -2,
                guaranteed_bytes: 40,
                host_limit_bytes: 7,
                turn_weight: 0,
                device_limit_bytes: [(1, 50)].into(),
            }),
            usage: Some(pb::Usage {
                held_bytes: 60,
                lease_count: 2,
                device_committed_bytes: [(1, 60)].into(),
                ..Default::default()
            }),
        };
        let u = Usage::from(resp);
        assert_eq!(u.tenant, "a");
        assert_eq!(
            u.quota(),
            QuotaSpec {
                limit_bytes: 100,
                max_leases: 3,
                priority: -2,
                guaranteed_bytes: 40,
                host_limit_bytes: 7,
                turn_weight: 0,
                device_limit_bytes: BTreeMap::from([(1, 50)]),
            }
        );
        assert_eq!(u.counters().held_bytes, 60);
        assert_eq!(
            u.counters().device_committed_bytes,
            BTreeMap::from([(1, 60)])
        );
        assert_eq!(u.available_bytes(), 40);
        let back: pb::Quota = u.quota().into();
        assert_eq!(QuotaSpec::from(back), u.quota());
    }

    #[test]
    fn usage_embeds_the_one_quota_and_round_trips() {
        let u = Usage {
            tenant: "a".into(),
            quota: QuotaSpec {
                limit_bytes: 100,
                device_limit_bytes: BTreeMap::from([(1, 50)]),
                ..QuotaSpec::new(100)
            },
            usage: UsageCounters {
                held_bytes: 60,
                device_committed_bytes: BTreeMap::from([(1, 60)]),
                ..Default::default()
            },
        };
        let json = serde_json::to_value(&u).unwrap();
        // The shape of a `TenantInfo`: the quota and the counters as their own objects.
        assert_eq!(json["tenant"], "a");
        assert_eq!(json["quota"], serde_json::to_value(&u.quota).unwrap());
        assert_eq!(json["usage"]["held_bytes"], 60);
        assert_eq!(json["quota"]["device_limit_bytes"]["1"], 50);
        assert_eq!(json["usage"]["device_committed_bytes"]["1"], 60);
        let back: Usage = serde_json::from_value(json).unwrap();
        assert_eq!(back, u);
        assert_eq!(
            Usage::from(pb::GetUsageResponse {
                tenant: "b".into(),
                ..Default::default()
            }),
            Usage {
                tenant: "b".into(),
                ..Default::default()
            }
        );
    }

    #[test]
    fn tenant_info_missing_parts_default() {
        let t = TenantInfo::from(pb::TenantInfo {
            name: "x".into(),
            ..Default::default()
        });
        assert_eq!(t.quota, QuotaSpec::default());
        assert_eq!(t.usage, UsageCounters::default());
    }
}
