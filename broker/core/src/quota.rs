//! A tenant's quota, defined once: [`Quota`] (the limits an operator set) and
//! [`QuotaPatch`] (a change of some of them). The same type is what the ledger enforces,
//! what the state store persists (as JSON, through serde: `store::TenantRecord` flattens
//! it, so the field names are the file format) and what the audit log and the tenants
//! config file print; the gRPC messages are converted at the API edge
//! (`service/convert.rs`, one `From` pair each way).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{BrokerError, BrokerResult};

/// A tenant's limits, as an operator set them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
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
    /// Per-device caps by device index: most device bytes held at once on that device
    /// (counted like `limit_bytes`), on top of the total. A device without an entry is
    /// bounded by the total alone; 0 keeps the tenant off it. Left out of the state file
    /// when empty (so a quota without caps is stored as before).
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        with = "by_device"
    )]
    pub device_limit_bytes: BTreeMap<u32, u64>,
}

impl Quota {
    /// The quota as the audit log and the tenants config file's reports show it: its
    /// serde form, the same fields as in the state file.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_default()
    }

    /// The cap on `device`, if the quota has one.
    pub fn device_limit(&self, device: u32) -> Option<u64> {
        self.device_limit_bytes.get(&device).copied()
    }

    /// Checks the per-device caps against a node of `devices` devices: each names one.
    pub fn validate_devices(&self, devices: usize) -> BrokerResult<()> {
        match self
            .device_limit_bytes
            .keys()
            .find(|&&d| d as usize >= devices)
        {
            Some(d) => Err(BrokerError::InvalidArgument(format!(
                "per-device limit for device {d}, but this node has {devices} device{} (0..{})",
                if devices == 1 { "" } else { "s" },
                devices.saturating_sub(1)
            ))),
            None => Ok(()),
        }
    }
}

/// A map by device index as JSON wants it: keys are the index in decimal (`{"1": 7}`),
/// read back strictly. (serde's own integer-key support does not survive `flatten`, which
/// the state file's tenant record uses.)
mod by_device {
    use std::collections::BTreeMap;

    use serde::de::Error;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(map: &BTreeMap<u32, u64>, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(map.iter().map(|(d, b)| (d.to_string(), b)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<u32, u64>, D::Error> {
        BTreeMap::<String, u64>::deserialize(d)?
            .into_iter()
            .map(|(k, v)| {
                k.parse::<u32>()
                    .map(|k| (k, v))
                    .map_err(|_| D::Error::custom(format!("{k:?} is not a device index")))
            })
            .collect()
    }
}

/// A partial quota: the fields given change, the others keep their values (a new tenant
/// starts from zeros). What `SetQuota` with a patch and the config file's tenant tables
/// apply.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QuotaPatch {
    pub limit_bytes: Option<u64>,
    pub max_leases: Option<u32>,
    pub priority: Option<i32>,
    pub guaranteed_bytes: Option<u64>,
    pub host_limit_bytes: Option<u64>,
    pub turn_weight: Option<u32>,
    /// Remove every per-device cap before applying `device_limits`.
    pub clear_device_limits: bool,
    /// Per-device caps to set (`Some`) or remove (`None`), in order.
    pub device_limits: Vec<(u32, Option<u64>)>,
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
        let mut device_limit_bytes = if self.clear_device_limits {
            BTreeMap::new()
        } else {
            base.device_limit_bytes.clone()
        };
        for &(device, limit) in &self.device_limits {
            match limit {
                Some(l) => device_limit_bytes.insert(device, l),
                None => device_limit_bytes.remove(&device),
            };
        }
        Ok(Quota {
            device_limit_bytes,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_limits_patch_set_remove_and_clear() {
        let base = Quota {
            limit_bytes: 100,
            device_limit_bytes: BTreeMap::from([(0, 10), (1, 20)]),
            ..Quota::default()
        };
        let set = QuotaPatch {
            device_limits: vec![(1, None), (2, Some(30)), (0, Some(11))],
            ..QuotaPatch::default()
        };
        assert!(!set.is_empty());
        let q = set.apply(Some(&base)).unwrap();
        assert_eq!(q.device_limit_bytes, BTreeMap::from([(0, 11), (2, 30)]));
        assert_eq!((q.device_limit(0), q.device_limit(1)), (Some(11), None));
        assert_eq!(q.limit_bytes, 100, "other fields keep their values");
        let replace = QuotaPatch {
            clear_device_limits: true,
            device_limits: vec![(3, Some(0))],
            ..QuotaPatch::default()
        };
        let q = replace.apply(Some(&base)).unwrap();
        assert_eq!(q.device_limit_bytes, BTreeMap::from([(3, 0)]));
        let untouched = QuotaPatch {
            limit_bytes: Some(5),
            ..QuotaPatch::default()
        };
        assert_eq!(
            untouched.apply(Some(&base)).unwrap().device_limit_bytes,
            base.device_limit_bytes
        );
    }

    #[test]
    fn device_limits_must_name_devices_of_the_node() {
        let q = Quota {
            device_limit_bytes: BTreeMap::from([(1, 10)]),
            ..Quota::default()
        };
        assert!(q.validate_devices(2).is_ok());
        let err = q.validate_devices(1).unwrap_err().to_string();
        assert!(
            err.contains("device 1") && err.contains("1 device"),
            "{err}"
        );
        assert!(Quota::default().validate_devices(0).is_ok());
    }

    #[test]
    fn the_state_file_form_keeps_old_records_and_names_caps_by_device() {
        let old = Quota {
            limit_bytes: 1,
            ..Quota::default()
        };
        let json = serde_json::to_string(&old).unwrap();
        assert!(!json.contains("device_limit_bytes"), "{json}");
        let capped = Quota {
            device_limit_bytes: BTreeMap::from([(1, 7)]),
            ..old.clone()
        };
        let json = serde_json::to_value(&capped).unwrap();
        assert_eq!(json["device_limit_bytes"]["1"], 7);
        let back: Quota = serde_json::from_value(json).unwrap();
        assert_eq!(back, capped);
    }
}
