//! What a ResourceClaim was allocated on this driver: for each result of
//! `status.allocation.devices.results[]` naming the driver, the device (`gpu-N`: broker
//! device `N`), its pool and the memory it consumes (`consumedCapacity.memory`).

use crate::quantity::parse_bytes;
use k8s_openapi::api::resource::v1::ResourceClaim;
use thiserror::Error;

/// Why a claim cannot be prepared from what the API server holds.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum AllocationError {
    #[error("the claim is not allocated")]
    NotAllocated,
    #[error("the claim's uid is {found}, not {expected}: it was deleted and made again")]
    UidMismatch { expected: String, found: String },
    #[error("the claim has no device of driver {0}")]
    NoDevice(String),
    #[error("the claim has {0} devices of this driver; one per claim is supported")]
    ManyDevices(usize),
    #[error("device {0:?} is not one of this driver's (gpu-N)")]
    BadDevice(String),
    #[error("device {device} has no consumedCapacity.memory: the cluster needs the DRAConsumableCapacity feature")]
    NoMemory { device: String },
    #[error("consumedCapacity.memory: {0}")]
    BadMemory(String),
}

/// One device allocated to the claim on this driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocated {
    /// The claim's request it answers.
    pub request: String,
    pub pool: String,
    /// `gpu-N`.
    pub device: String,
    /// The broker's device index (`N`).
    pub index: u32,
    /// `consumedCapacity.memory`, in bytes.
    pub bytes: u64,
    pub share_id: Option<String>,
}

/// The broker device index a slice device name stands for (`gpu-3`: 3).
pub fn device_index(name: &str) -> Option<u32> {
    let n = name.strip_prefix("gpu-")?;
    if n.is_empty() || (n.len() > 1 && n.starts_with('0')) {
        return None;
    }
    n.parse().ok()
}

/// The device name of broker device `index`.
pub fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// The one device `claim` (whose uid must be `uid`) was allocated on `driver`.
pub fn allocated(
    claim: &ResourceClaim,
    uid: &str,
    driver: &str,
) -> Result<Allocated, AllocationError> {
    let found = claim.metadata.uid.clone().unwrap_or_default();
    if found != uid {
        return Err(AllocationError::UidMismatch {
            expected: uid.to_string(),
            found,
        });
    }
    let results = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_deref())
        .ok_or(AllocationError::NotAllocated)?;
    let mine: Vec<_> = results.iter().filter(|r| r.driver == driver).collect();
    let r = match mine.as_slice() {
        [] => return Err(AllocationError::NoDevice(driver.to_string())),
        [r] => *r,
        many => return Err(AllocationError::ManyDevices(many.len())),
    };
    let index =
        device_index(&r.device).ok_or_else(|| AllocationError::BadDevice(r.device.clone()))?;
    let memory = r
        .consumed_capacity
        .as_ref()
        .and_then(|c| c.get("memory"))
        .ok_or_else(|| AllocationError::NoMemory {
            device: r.device.clone(),
        })?;
    let bytes = parse_bytes(&memory.0).map_err(|e| AllocationError::BadMemory(e.to_string()))?;
    Ok(Allocated {
        request: r.request.clone(),
        pool: r.pool.clone(),
        device: r.device.clone(),
        index,
        bytes,
        share_id: r.share_id.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(results: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "u1"},
            "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {"results": results}}}
        }))
        .unwrap()
    }

    #[test]
    fn the_drivers_device_and_consumed_memory_are_read() {
        let c = claim(serde_json::json!([
            {"request": "other", "driver": "x.io", "pool": "p", "device": "d"},
            {"request": "gpu", "driver": "gpu-broker.io", "pool": "node-a", "device": "gpu-1",
             "shareID": "s-1", "consumedCapacity": {"memory": "8Gi"}}
        ]));
        let a = allocated(&c, "u1", "gpu-broker.io").unwrap();
        assert_eq!(
            a,
            Allocated {
                request: "gpu".into(),
                pool: "node-a".into(),
                device: "gpu-1".into(),
                index: 1,
                bytes: 8 << 30,
                share_id: Some("s-1".into()),
            }
        );
        assert!(matches!(
            allocated(&c, "u2", "gpu-broker.io"),
            Err(AllocationError::UidMismatch { .. })
        ));
        assert_eq!(
            allocated(&c, "u1", "y.io"),
            Err(AllocationError::NoDevice("y.io".into()))
        );
        let c = claim(serde_json::json!([
            {"request": "gpu", "driver": "gpu-broker.io", "pool": "p", "device": "gpu-0"}
        ]));
        assert!(matches!(
            allocated(&c, "u1", "gpu-broker.io"),
            Err(AllocationError::NoMemory { .. })
        ));
        let c = claim(serde_json::json!([
            {"request": "gpu", "driver": "gpu-broker.io", "pool": "p", "device": "nvidia-0",
             "consumedCapacity": {"memory": "1Gi"}}
        ]));
        assert!(matches!(
            allocated(&c, "u1", "gpu-broker.io"),
            Err(AllocationError::BadDevice(_))
        ));
        let mut unallocated = claim(serde_json::json!([]));
        unallocated.status = None;
        assert_eq!(
            allocated(&unallocated, "u1", "gpu-broker.io"),
            Err(AllocationError::NotAllocated)
        );
    }

    #[test]
    fn device_names_are_gpu_and_the_index() {
        assert_eq!(device_index("gpu-0"), Some(0));
        assert_eq!(device_index("gpu-12"), Some(12));
        for bad in ["gpu-", "gpu-01", "gpu--1", "cpu-1", "gpu-x"] {
            assert_eq!(device_index(bad), None, "{bad}");
        }
        assert_eq!(device_name(3), "gpu-3");
    }
}
