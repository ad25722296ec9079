//! The ledger: tenants, their quotas and live usage counters — the single source of
//! truth for "who holds what". **Quotas are enforced here** ([`Ledger::check_charge`]):
//! every byte a tenant holds or has reserved was charged through this module, and every
//! charge is undone exactly once. The ledger never talks to a device; the arbiter calls
//! it under the broker's state lock, which makes racing requests see exact numbers.

use crate::error::{BrokerError, BrokerResult};
use crate::units::show;
use std::collections::BTreeMap;

pub use crate::quota::{Quota, QuotaPatch};
pub use crate::tier::Tier;

impl Tenant {
    /// What a new quota means for what the tenant holds now: one line per limit it is
    /// already above (nothing is revoked; new requests are refused until it is below).
    pub fn over_quota_warnings(&self) -> Vec<String> {
        let (q, u) = (&self.quota, &self.usage);
        let mut out = Vec::new();
        if u.committed_bytes() > q.limit_bytes {
            out.push(format!(
                "tenant {:?} holds {} ({} leases, {} quarantined), above its new limit {}: its leases stay; \
                 new requests are refused until it holds less than the limit (revoke leases to take memory back now)",
                self.name,
                show(u.committed_bytes()),
                u.lease_count,
                show(u.quarantined_bytes),
                show(q.limit_bytes)
            ));
        }
        // max_leases bounds device and host leases together (as `check_charge` counts).
        let leases = u.lease_count + u.host_lease_count;
        if q.max_leases > 0 && leases > q.max_leases {
            out.push(format!(
                "tenant {:?} has {} leases, above its new max-leases {}: they stay; new requests are refused until it has fewer",
                self.name, leases, q.max_leases
            ));
        }
        for (&device, &limit) in &q.device_limit_bytes {
            let held = self.device_bytes.get(&device).copied().unwrap_or(0);
            if held > limit {
                out.push(format!(
                    "tenant {:?} holds {} on device {device}, above its new limit {} there: those leases stay; \
                     no new leases on that device until it holds less",
                    self.name,
                    show(held),
                    show(limit)
                ));
            }
        }
        if u.host_held_bytes > q.host_limit_bytes {
            out.push(format!(
                "tenant {:?} holds {} of host fallback, above its new host limit {}: those leases stay; no more host fallback until it holds less",
                self.name,
                show(u.host_held_bytes),
                show(q.host_limit_bytes)
            ));
        }
        out
    }
}

/// Live counters of one tenant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Device bytes of live leases.
    pub held_bytes: u64,
    /// Live device leases.
    pub lease_count: u32,
    /// Device bytes admitted but not yet turned into leases (allocation in flight).
    pub reserved_bytes: u64,
    /// Admissions in flight.
    pub reserved_count: u32,
    /// Bytes of ended leases a live process may still map.
    pub quarantined_bytes: u64,
    /// Host-fallback bytes of live leases.
    pub host_held_bytes: u64,
    /// Host-fallback leases.
    pub host_lease_count: u32,
    /// Device bytes reserved for processes to allocate themselves (`reservations.rs`),
    /// less what their leases drew from them (those bytes are in `held_bytes`).
    pub process_reserved_bytes: u64,
    /// Live process reservations.
    pub process_reservations: u32,
}

impl Usage {
    /// Device bytes held, reserved, or quarantined (ended leases a live process of the
    /// tenant may still map): what the limit is checked against. Quarantined bytes count
    /// because they are still in the tenant's hands.
    pub fn committed_bytes(&self) -> u64 {
        self.held_bytes + self.reserved_bytes + self.quarantined_bytes + self.process_reserved_bytes
    }
}

/// A tenant: name, quota, usage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tenant {
    pub name: String,
    pub quota: Quota,
    pub usage: Usage,
    /// Device bytes held, in flight or quarantined, per device index (what
    /// `Quota::device_limit_bytes` caps); devices at 0 are left out. Sums to
    /// `usage.committed_bytes()`.
    pub device_bytes: BTreeMap<u32, u64>,
}

impl Tenant {
    /// Bytes held beyond the guarantee (memory others' guarantees may take back).
    pub fn borrowed_bytes(&self) -> u64 {
        self.usage
            .committed_bytes()
            .saturating_sub(self.quota.guaranteed_bytes)
    }

    /// Guaranteed bytes this tenant is not using: kept free for it.
    pub fn unused_guarantee(&self) -> u64 {
        self.quota
            .guaranteed_bytes
            .saturating_sub(self.usage.committed_bytes())
    }
}

/// Checks a tenant name: 1-64 of `[A-Za-z0-9._-]`.
pub fn validate_tenant_name(name: &str) -> BrokerResult<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(BrokerError::InvalidArgument(format!(
            "invalid tenant name {name:?}: use 1-64 characters of A-Z a-z 0-9 . _ -"
        )))
    }
}

/// Every tenant, by name.
#[derive(Debug, Default)]
pub struct Ledger {
    tenants: BTreeMap<String, Tenant>,
    /// Tenants being deleted (their removal is being committed to the store): they take
    /// no new charge, so they still hold nothing when the deletion is applied.
    closing: std::collections::BTreeSet<String>,
}

impl Ledger {
    pub fn new() -> Ledger {
        Ledger::default()
    }

    pub fn get(&self, name: &str) -> Option<&Tenant> {
        self.tenants.get(name)
    }

    pub fn tenants(&self) -> impl Iterator<Item = &Tenant> {
        self.tenants.values()
    }

    /// Tenants by name, after `after` (exclusive), for paginated listings.
    pub fn tenants_after<'a>(
        &'a self,
        after: Option<&str>,
    ) -> impl Iterator<Item = &'a Tenant> + 'a {
        use std::ops::Bound;
        let lower = match after {
            Some(a) => Bound::Excluded(a.to_string()),
            None => Bound::Unbounded,
        };
        self.tenants
            .range::<String, _>((lower, Bound::Unbounded))
            .map(|(_, t)| t)
    }

    fn get_mut(&mut self, name: &str) -> BrokerResult<&mut Tenant> {
        self.tenants
            .get_mut(name)
            .ok_or_else(|| BrokerError::tenant_not_found(name))
    }

    /// Checks a quota on its own: the guarantee fits in the limit.
    pub fn validate_quota(q: &Quota) -> BrokerResult<()> {
        if q.guaranteed_bytes > q.limit_bytes {
            return Err(BrokerError::InvalidArgument(format!(
                "guaranteed {} exceeds limit {}",
                show(q.guaranteed_bytes),
                show(q.limit_bytes)
            )));
        }
        Ok(())
    }

    /// Sum of every tenant's guarantee, with `name`'s replaced by `guaranteed`.
    pub fn guarantees_with(&self, name: &str, guaranteed: u64) -> u64 {
        self.tenants
            .values()
            .filter(|t| t.name != name)
            .map(|t| t.quota.guaranteed_bytes)
            .fold(guaranteed, u64::saturating_add)
    }

    /// Unused guarantees of every tenant but `name`: memory kept free for others.
    pub fn others_unused_guarantees(&self, name: &str) -> u64 {
        self.tenants
            .values()
            .filter(|t| t.name != name)
            .map(|t| t.unused_guarantee())
            .fold(0, u64::saturating_add)
    }

    /// Would `bytes` more keep `name` within its guarantee?
    pub fn within_guarantee(&self, name: &str, bytes: u64) -> bool {
        self.tenants.get(name).is_some_and(|t| {
            t.usage.committed_bytes().saturating_add(bytes) <= t.quota.guaranteed_bytes
        })
    }

    /// Creates or updates a tenant. Returns true when it was created. Lowering a limit
    /// below what the tenant holds is allowed: it keeps its leases but gets no more.
    pub fn set_quota(&mut self, name: &str, quota: Quota) -> BrokerResult<bool> {
        validate_tenant_name(name)?;
        Self::validate_quota(&quota)?;
        match self.tenants.get_mut(name) {
            Some(t) => {
                t.quota = quota;
                Ok(false)
            }
            None => {
                self.tenants.insert(
                    name.to_string(),
                    Tenant {
                        name: name.to_string(),
                        quota,
                        usage: Usage::default(),
                        device_bytes: BTreeMap::new(),
                    },
                );
                Ok(true)
            }
        }
    }

    /// Removes a tenant that holds nothing.
    pub fn delete(&mut self, name: &str) -> BrokerResult<()> {
        self.check_deletable(name)?;
        self.tenants.remove(name);
        self.closing.remove(name);
        Ok(())
    }

    /// Starts deleting a tenant that holds nothing: from now on it takes no new charge
    /// (`check_charge` answers as for a tenant that does not exist). Undo with [`Ledger::reopen`].
    pub fn close(&mut self, name: &str) -> BrokerResult<()> {
        self.check_deletable(name)?;
        self.closing.insert(name.to_string());
        Ok(())
    }

    /// A deletion did not happen after all (the store refused it): the tenant takes
    /// charges again.
    pub fn reopen(&mut self, name: &str) {
        self.closing.remove(name);
    }

    /// Is the tenant being deleted?
    pub fn is_closing(&self, name: &str) -> bool {
        self.closing.contains(name)
    }

    /// Fails unless the tenant exists and holds nothing.
    pub fn check_deletable(&self, name: &str) -> BrokerResult<()> {
        let t = self
            .tenants
            .get(name)
            .ok_or_else(|| BrokerError::tenant_not_found(name))?;
        let u = t.usage;
        if u.committed_bytes() > 0
            || u.lease_count > 0
            || u.host_lease_count > 0
            || u.quarantined_bytes > 0
        {
            return Err(BrokerError::TenantInUse {
                tenant: name.to_string(),
                leases: u64::from(u.lease_count + u.host_lease_count),
                bytes: u.held_bytes + u.host_held_bytes + u.quarantined_bytes,
            });
        }
        Ok(())
    }

    /// Can `name` take `bytes` more of `tier` now? Quota enforcement lives here.
    pub fn check_charge(&self, name: &str, bytes: u64, tier: Tier) -> BrokerResult<()> {
        let t = self
            .tenants
            .get(name)
            .filter(|_| !self.closing.contains(name))
            .ok_or_else(|| BrokerError::tenant_not_found(name))?;
        let (u, q) = (&t.usage, &t.quota);
        let (used, limit) = match tier {
            Tier::Device => (u.committed_bytes(), q.limit_bytes),
            Tier::Host => (u.host_held_bytes, q.host_limit_bytes),
        };
        // One count for both tiers: `max_leases` bounds what the tenant holds in all.
        let count = u.lease_count + u.reserved_count + u.host_lease_count;
        if used.saturating_add(bytes) > limit {
            return Err(BrokerError::QuotaExceeded {
                tenant: name.to_string(),
                tier,
                requested: bytes,
                held: used,
                limit,
            });
        }
        if q.max_leases > 0 && count >= q.max_leases {
            return Err(BrokerError::LeaseCountLimit {
                tenant: name.to_string(),
                count: u64::from(count),
                max: u64::from(q.max_leases),
            });
        }
        Ok(())
    }

    /// Device bytes `name` holds on `device` (held, in flight, quarantined).
    pub fn device_committed(&self, name: &str, device: u32) -> u64 {
        self.tenants
            .get(name)
            .and_then(|t| t.device_bytes.get(&device).copied())
            .unwrap_or(0)
    }

    /// Can `name` take `bytes` more on `device` under its per-device cap there? (The
    /// total is `check_charge`'s.) Per-device enforcement lives here.
    pub fn check_device(&self, name: &str, device: u32, bytes: u64) -> BrokerResult<()> {
        let t = self
            .tenants
            .get(name)
            .ok_or_else(|| BrokerError::tenant_not_found(name))?;
        let Some(limit) = t.quota.device_limit(device) else {
            return Ok(());
        };
        let held = t.device_bytes.get(&device).copied().unwrap_or(0);
        if held.saturating_add(bytes) > limit {
            return Err(BrokerError::DeviceQuotaExceeded {
                tenant: name.to_string(),
                device,
                requested: bytes,
                held,
                limit,
            });
        }
        Ok(())
    }

    /// The refusal when `bytes` can never fit `name`'s caps on any of `devices` (each
    /// cap is below the request), whatever it releases; None when some device could.
    pub fn device_caps_never_fit(
        &self,
        name: &str,
        devices: &[u32],
        bytes: u64,
    ) -> Option<BrokerError> {
        let t = self.tenants.get(name)?;
        let mut worst = None;
        for &d in devices {
            match t.quota.device_limit(d) {
                Some(limit) if limit < bytes => {
                    worst.get_or_insert(BrokerError::DeviceQuotaExceeded {
                        tenant: name.to_string(),
                        device: d,
                        requested: bytes,
                        held: t.device_bytes.get(&d).copied().unwrap_or(0),
                        limit,
                    });
                }
                _ => return None,
            }
        }
        worst
    }

    // Called by every byte mover after it changed the usage counters: the per-device
    // bytes move with them, and (debug builds) still add up to the tenant's total.
    fn add_device_bytes(t: &mut Tenant, device: u32, bytes: u64) {
        *t.device_bytes.entry(device).or_insert(0) += bytes;
        Self::debug_check_device_sum(t);
    }

    fn sub_device_bytes(t: &mut Tenant, device: u32, bytes: u64) {
        match t.device_bytes.get_mut(&device) {
            Some(b) => {
                *b -= bytes;
                if *b == 0 {
                    t.device_bytes.remove(&device);
                }
            }
            None => debug_assert_eq!(
                bytes, 0,
                "tenant {:?} holds nothing on device {device}",
                t.name
            ),
        }
        Self::debug_check_device_sum(t);
    }

    fn debug_check_device_sum(t: &Tenant) {
        debug_assert_eq!(
            t.device_bytes.values().sum::<u64>(),
            t.usage.committed_bytes(),
            "tenant {:?}: per-device bytes {:?} do not add up to its committed bytes",
            t.name,
            t.device_bytes
        );
    }

    /// Charges an admission in flight on `device` (device tier). Call after
    /// `check_charge` and `check_device`.
    pub fn reserve(&mut self, name: &str, device: u32, bytes: u64) -> BrokerResult<()> {
        self.check_charge(name, bytes, Tier::Device)?;
        self.check_device(name, device, bytes)?;
        let t = self.get_mut(name)?;
        t.usage.reserved_bytes += bytes;
        t.usage.reserved_count += 1;
        Self::add_device_bytes(t, device, bytes);
        Ok(())
    }

    /// Undoes a reservation that did not become a lease.
    pub fn unreserve(&mut self, name: &str, device: u32, bytes: u64) {
        if let Ok(t) = self.get_mut(name) {
            t.usage.reserved_bytes -= bytes;
            t.usage.reserved_count -= 1;
            Self::sub_device_bytes(t, device, bytes);
        }
    }

    /// Turns a reservation into a held lease (same device: its per-device bytes stay).
    pub fn commit(&mut self, name: &str, bytes: u64) {
        if let Ok(t) = self.get_mut(name) {
            t.usage.reserved_bytes -= bytes;
            t.usage.reserved_count -= 1;
            t.usage.held_bytes += bytes;
            t.usage.lease_count += 1;
        }
    }

    /// Charges a lease a restarted broker took back (`arbiter/restart/`): no quota check,
    /// the memory is in use whatever the quota says now.
    pub fn adopt(&mut self, name: &str, device: u32, bytes: u64) -> BrokerResult<()> {
        let t = self.get_mut(name)?;
        t.usage.held_bytes += bytes;
        t.usage.lease_count += 1;
        Self::add_device_bytes(t, device, bytes);
        Ok(())
    }

    /// Charges a host-tier lease a restarted broker took back: no limit check, as
    /// [`Ledger::adopt`].
    pub fn adopt_host(&mut self, name: &str, bytes: u64) -> BrokerResult<()> {
        let u = &mut self.get_mut(name)?.usage;
        u.host_held_bytes += bytes;
        u.host_lease_count += 1;
        Ok(())
    }

    /// A device lease on `device` ended.
    pub fn uncharge(&mut self, name: &str, device: u32, bytes: u64) {
        if let Ok(t) = self.get_mut(name) {
            t.usage.held_bytes -= bytes;
            t.usage.lease_count -= 1;
            Self::sub_device_bytes(t, device, bytes);
        }
    }

    /// Charges a host-fallback lease (checks first).
    pub fn charge_host(&mut self, name: &str, bytes: u64) -> BrokerResult<()> {
        self.check_charge(name, bytes, Tier::Host)?;
        let u = &mut self.get_mut(name)?.usage;
        u.host_held_bytes += bytes;
        u.host_lease_count += 1;
        Ok(())
    }

    /// A host-fallback lease ended.
    pub fn uncharge_host(&mut self, name: &str, bytes: u64) {
        if let Ok(t) = self.get_mut(name) {
            t.usage.host_held_bytes -= bytes;
            t.usage.host_lease_count -= 1;
        }
    }

    /// Memory of an ended lease on `device` stays mapped by a live process.
    pub fn add_quarantine(&mut self, name: &str, device: u32, bytes: u64) {
        if let Ok(t) = self.get_mut(name) {
            t.usage.quarantined_bytes += bytes;
            Self::add_device_bytes(t, device, bytes);
        }
    }

    /// Quarantined memory on `device` was let go.
    pub fn remove_quarantine(&mut self, name: &str, device: u32, bytes: u64) {
        if let Ok(t) = self.get_mut(name) {
            t.usage.quarantined_bytes -= bytes;
            Self::sub_device_bytes(t, device, bytes);
        }
    }

    /// Can `name` reserve `bytes` more for a process? The byte limit only: a process
    /// reservation is not a lease, so `max_leases` does not bound it.
    pub fn check_process_charge(&self, name: &str, bytes: u64) -> BrokerResult<()> {
        let t = self
            .tenants
            .get(name)
            .ok_or_else(|| BrokerError::tenant_not_found(name))?;
        let used = t.usage.committed_bytes();
        if used.saturating_add(bytes) > t.quota.limit_bytes {
            return Err(BrokerError::QuotaExceeded {
                tenant: name.to_string(),
                tier: Tier::Device,
                requested: bytes,
                held: used,
                limit: t.quota.limit_bytes,
            });
        }
        Ok(())
    }

    /// Charges a new process reservation on `device` (checks the limit and the
    /// device's cap first).
    pub fn charge_process(&mut self, name: &str, device: u32, bytes: u64) -> BrokerResult<()> {
        self.check_process_charge(name, bytes)?;
        self.check_device(name, device, bytes)?;
        let t = self.get_mut(name)?;
        t.usage.process_reserved_bytes += bytes;
        t.usage.process_reservations += 1;
        Self::add_device_bytes(t, device, bytes);
        Ok(())
    }

    /// A kept process reservation taken back at a restart: charged `bytes` (its room)
    /// unchecked, beyond the quota if that shrank meanwhile (its process runs).
    pub fn adopt_process(&mut self, name: &str, device: u32, bytes: u64) -> BrokerResult<()> {
        let t = self.get_mut(name)?;
        t.usage.process_reserved_bytes += bytes;
        t.usage.process_reservations += 1;
        Self::add_device_bytes(t, device, bytes);
        Ok(())
    }

    /// A process reservation on `device` ended with `bytes` still charged to it.
    pub fn uncharge_process(&mut self, name: &str, device: u32, bytes: u64) {
        if let Ok(t) = self.get_mut(name) {
            t.usage.process_reserved_bytes -= bytes;
            t.usage.process_reservations -= 1;
            Self::sub_device_bytes(t, device, bytes);
        }
    }

    /// Moves `bytes` of a live process reservation on `device` out of it (`into ==
    /// false`: a lease of the process draws them and is charged for them itself, on the
    /// same device) or back into it.
    pub fn shift_process(&mut self, name: &str, device: u32, bytes: u64, into: bool) {
        if let Ok(t) = self.get_mut(name) {
            if into {
                t.usage.process_reserved_bytes += bytes;
                Self::add_device_bytes(t, device, bytes);
            } else {
                t.usage.process_reserved_bytes -= bytes;
                Self::sub_device_bytes(t, device, bytes);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(limit: u64) -> Quota {
        Quota {
            limit_bytes: limit,
            max_leases: 2,
            ..Quota::default()
        }
    }

    #[test]
    fn a_patch_changes_only_its_fields() {
        let base = Quota {
            limit_bytes: 10,
            max_leases: 3,
            priority: 2,
            guaranteed_bytes: 4,
            host_limit_bytes: 5,
            turn_weight: 7,
            device_limit_bytes: BTreeMap::from([(1, 6)]),
        };
        let p = QuotaPatch {
            limit_bytes: Some(20),
            ..QuotaPatch::default()
        };
        assert_eq!(
            p.apply(Some(&base)).unwrap(),
            Quota {
                limit_bytes: 20,
                ..base
            }
        );
        assert_eq!(
            p.apply(None).unwrap(),
            Quota {
                limit_bytes: 20,
                ..Quota::default()
            }
        );
        let no_limit = QuotaPatch {
            priority: Some(1),
            ..QuotaPatch::default()
        };
        assert!(matches!(
            no_limit.apply(None),
            Err(BrokerError::InvalidArgument(m)) if m.contains("limit")
        ));
        assert!(QuotaPatch::default().is_empty() && !p.is_empty());
    }

    #[test]
    fn a_limit_below_usage_is_explained() {
        let mut l = Ledger::new();
        l.set_quota("a", quota(10)).unwrap();
        l.reserve("a", 0, 8).unwrap();
        l.commit("a", 8);
        assert!(l.get("a").unwrap().over_quota_warnings().is_empty());
        l.set_quota("a", quota(4)).unwrap();
        let w = l.get("a").unwrap().over_quota_warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("leases stay") && w[0].contains("refused"),
            "{w:?}"
        );
    }

    #[test]
    fn max_leases_counts_device_and_host_leases_together() {
        let mut l = Ledger::new();
        l.set_quota(
            "a",
            Quota {
                host_limit_bytes: 100,
                ..quota(100)
            },
        )
        .unwrap();
        l.reserve("a", 0, 1).unwrap();
        l.commit("a", 1);
        l.charge_host("a", 1).unwrap();
        for tier in [Tier::Device, Tier::Host] {
            assert!(
                matches!(
                    l.check_charge("a", 1, tier),
                    Err(BrokerError::LeaseCountLimit { .. })
                ),
                "{tier:?}: max_leases 2 already reached by one device and one host lease"
            );
        }
        l.uncharge_host("a", 1);
        assert!(l.check_charge("a", 1, Tier::Host).is_ok());
    }

    #[test]
    fn max_leases_warning_counts_host_leases_too() {
        let mut l = Ledger::new();
        let q = Quota {
            host_limit_bytes: 100,
            max_leases: 3,
            ..quota(100)
        };
        l.set_quota("a", q.clone()).unwrap();
        l.reserve("a", 0, 1).unwrap();
        l.commit("a", 1);
        l.charge_host("a", 1).unwrap();
        l.charge_host("a", 1).unwrap();
        assert!(l.get("a").unwrap().over_quota_warnings().is_empty());
        l.set_quota("a", Quota { max_leases: 2, ..q }).unwrap();
        let w = l.get("a").unwrap().over_quota_warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("3 leases") && w[0].contains("max-leases 2"),
            "{w:?}"
        );
    }

    #[test]
    fn set_quota_creates_then_updates() {
        let mut l = Ledger::new();
        assert!(l.set_quota("a", quota(10)).unwrap());
        assert!(!l.set_quota("a", quota(20)).unwrap());
        assert_eq!(l.get("a").unwrap().quota.limit_bytes, 20);
    }

    #[test]
    fn rejects_bad_names_and_guarantees() {
        let mut l = Ledger::new();
        assert!(matches!(
            l.set_quota("", quota(1)),
            Err(BrokerError::InvalidArgument(_))
        ));
        assert!(matches!(
            l.set_quota("a b", quota(1)),
            Err(BrokerError::InvalidArgument(_))
        ));
        let q = Quota {
            limit_bytes: 1,
            guaranteed_bytes: 2,
            ..Quota::default()
        };
        assert!(matches!(
            l.set_quota("a", q),
            Err(BrokerError::InvalidArgument(_))
        ));
    }

    #[test]
    fn limit_counts_reservations_and_leases() {
        let mut l = Ledger::new();
        l.set_quota("a", quota(10)).unwrap();
        l.reserve("a", 0, 6).unwrap();
        let err = l.reserve("a", 0, 6).unwrap_err();
        match err {
            e @ BrokerError::QuotaExceeded { .. } => {
                assert!(e.to_string().contains("limit"), "{e}")
            }
            other => panic!("{other:?}"),
        }
        l.commit("a", 6);
        l.reserve("a", 0, 4).unwrap();
        // max_leases = 2: one held + one reserved.
        l.unreserve("a", 0, 4);
        l.reserve("a", 0, 1).unwrap();
        l.commit("a", 1);
        assert!(matches!(
            l.reserve("a", 0, 1),
            Err(BrokerError::LeaseCountLimit { .. })
        ));
        l.uncharge("a", 0, 6);
        l.uncharge("a", 0, 1);
        assert_eq!(l.get("a").unwrap().usage, Usage::default());
    }

    #[test]
    fn delete_refused_while_holding() {
        let mut l = Ledger::new();
        l.set_quota("a", quota(10)).unwrap();
        l.reserve("a", 0, 2).unwrap();
        l.commit("a", 2);
        assert!(matches!(
            l.delete("a"),
            Err(BrokerError::TenantInUse { .. })
        ));
        l.uncharge("a", 0, 2);
        l.delete("a").unwrap();
        assert!(l.get("a").is_none());
        assert!(matches!(l.delete("a"), Err(BrokerError::NotFound(_))));
    }

    #[test]
    fn quarantined_bytes_count_against_the_limit() {
        let mut l = Ledger::new();
        l.set_quota("a", quota(10)).unwrap();
        l.reserve("a", 0, 6).unwrap();
        l.commit("a", 6);
        l.uncharge("a", 0, 6);
        l.add_quarantine("a", 0, 6);
        assert!(matches!(
            l.reserve("a", 0, 6),
            Err(BrokerError::QuotaExceeded { .. })
        ));
        l.remove_quarantine("a", 0, 6);
        l.reserve("a", 0, 6).unwrap();
    }

    #[test]
    fn borrowed_is_beyond_guarantee() {
        let mut l = Ledger::new();
        let q = Quota {
            limit_bytes: 10,
            guaranteed_bytes: 4,
            ..Quota::default()
        };
        l.set_quota("a", q).unwrap();
        l.reserve("a", 0, 6).unwrap();
        let t = l.get("a").unwrap();
        assert_eq!(t.borrowed_bytes(), 2);
        assert_eq!(t.unused_guarantee(), 0);
    }

    #[test]
    fn per_device_caps_count_held_in_flight_and_quarantined_bytes() {
        let mut l = Ledger::new();
        l.set_quota(
            "a",
            Quota {
                limit_bytes: 100,
                device_limit_bytes: BTreeMap::from([(0, 30)]),
                ..Quota::default()
            },
        )
        .unwrap();
        // Device 0: capped at 30; device 1: only the total bounds it.
        l.reserve("a", 0, 20).unwrap();
        assert_eq!(l.device_committed("a", 0), 20);
        assert!(matches!(
            l.reserve("a", 0, 11),
            Err(BrokerError::DeviceQuotaExceeded {
                device: 0,
                requested: 11,
                held: 20,
                limit: 30,
                ..
            })
        ));
        assert_eq!(
            l.get("a").unwrap().usage.reserved_count,
            1,
            "a refusal charges nothing"
        );
        l.reserve("a", 0, 10).unwrap();
        l.reserve("a", 1, 60).unwrap();
        assert!(l.check_device("a", 1, 1000).is_ok(), "no cap on device 1");
        l.commit("a", 20);
        l.commit("a", 10);
        l.commit("a", 60);
        assert_eq!(l.device_committed("a", 0), 30);
        // A lease ending in quarantine still counts on its device until let go.
        l.uncharge("a", 0, 20);
        l.add_quarantine("a", 0, 20);
        assert!(l.check_device("a", 0, 1).is_err());
        l.remove_quarantine("a", 0, 20);
        assert_eq!(l.device_committed("a", 0), 10);
        assert!(l.check_device("a", 0, 20).is_ok());
        let t = l.get("a").unwrap();
        assert_eq!(
            t.device_bytes.values().sum::<u64>(),
            t.usage.committed_bytes(),
            "per-device bytes add up to the total"
        );
        // Lowering the cap below what it holds is explained, not enforced backwards.
        let mut q = t.quota.clone();
        q.device_limit_bytes.insert(1, 50);
        l.set_quota("a", q).unwrap();
        let w = l.get("a").unwrap().over_quota_warnings();
        assert!(w.iter().any(|w| w.contains("device 1")), "{w:?}");
        l.uncharge("a", 1, 60);
        l.uncharge("a", 0, 10);
        assert!(l.get("a").unwrap().device_bytes.is_empty());
    }

    #[test]
    fn a_request_above_every_cap_can_never_fit() {
        let mut l = Ledger::new();
        l.set_quota(
            "a",
            Quota {
                limit_bytes: 100,
                device_limit_bytes: BTreeMap::from([(0, 30), (1, 40)]),
                ..Quota::default()
            },
        )
        .unwrap();
        assert!(l.device_caps_never_fit("a", &[0, 1], 40).is_none());
        assert!(matches!(
            l.device_caps_never_fit("a", &[0, 1], 41),
            Some(BrokerError::DeviceQuotaExceeded {
                device: 0,
                limit: 30,
                ..
            })
        ));
        assert!(matches!(
            l.device_caps_never_fit("a", &[1], 41),
            Some(BrokerError::DeviceQuotaExceeded {
                device: 1,
                limit: 40,
                ..
            })
        ));
        assert!(
            l.device_caps_never_fit("a", &[0, 2], 41).is_none(),
            "device 2 has no cap"
        );
        assert!(l.device_caps_never_fit("a", &[], 41).is_none());
    }
}
