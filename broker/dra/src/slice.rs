//! The node's ResourceSlice, built from what the broker says of its devices: one device
//! per GPU that takes leases (a draining or unhealthy one is left out), shared by many
//! claims (`allowMultipleAllocations`), whose `capacity.memory` is the broker's leasable
//! bytes with a request policy on the broker's allocation granularity. The shape is
//! written down in `docs/kubernetes.md` ("ResourceSlice").

use crate::allocation::device_name;
use crate::broker::Inventory;
use crate::quantity::format_bytes;
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use std::collections::BTreeMap;

/// The step when the broker reports no granularity (CUDA's usual 2 MiB).
pub const DEFAULT_STEP: u64 = 2 << 20;
/// What a claim that asks for no particular amount consumes (less on a smaller device).
pub const DEFAULT_REQUEST: u64 = 1 << 30;

/// The slice's name: one per node and driver.
pub fn slice_name(node: &str, driver: &str) -> String {
    format!("{node}-{driver}")
}

/// The devices of the slice, from the broker's inventory.
pub fn devices(inv: &Inventory) -> Vec<Device> {
    inv.devices
        .iter()
        .filter(|d| !d.draining && !d.unhealthy)
        .filter_map(|d| {
            let step = if d.granularity_bytes > 0 {
                d.granularity_bytes
            } else {
                DEFAULT_STEP
            };
            let value = d.leasable_bytes / step * step;
            if value == 0 {
                return None;
            }
            let default = DEFAULT_REQUEST.min(value) / step * step;
            let q = |b: u64| Quantity(format_bytes(b));
            let attr = |s: &str| DeviceAttribute {
                string: Some(s.to_string()),
                ..Default::default()
            };
            let mut attributes = BTreeMap::from([
                ("uuid".to_string(), attr(&d.uuid)),
                ("model".to_string(), attr(&d.model)),
                (
                    "index".to_string(),
                    DeviceAttribute {
                        int: Some(i64::from(d.index)),
                        ..Default::default()
                    },
                ),
            ]);
            if !inv.version.is_empty() {
                attributes.insert(
                    "brokerVersion".to_string(),
                    DeviceAttribute {
                        version: Some(inv.version.clone()),
                        ..Default::default()
                    },
                );
            }
            let memory = DeviceCapacity {
                value: q(value),
                request_policy: Some(CapacityRequestPolicy {
                    default: Some(q(default)),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: q(step),
                        max: Some(q(value)),
                        step: Some(q(step)),
                    }),
                    valid_values: None,
                }),
            };
            Some(Device {
                name: device_name(d.index),
                allow_multiple_allocations: Some(true),
                attributes: Some(attributes),
                capacity: Some(BTreeMap::from([("memory".to_string(), memory)])),
                ..Default::default()
            })
        })
        .collect()
}

/// The whole slice of `node` at pool generation `generation`.
pub fn build(driver: &str, node: &str, generation: i64, inv: &Inventory) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(node, driver)),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: driver.to_string(),
            node_name: Some(node.to_string()),
            pool: ResourcePool {
                name: node.to_string(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(devices(inv)),
            ..Default::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_broker_proto::v1::DeviceInfo;

    fn gpu(index: u32, leasable: u64) -> DeviceInfo {
        DeviceInfo {
            index,
            uuid: format!("GPU-{index}"),
            model: "NVIDIA H200".into(),
            leasable_bytes: leasable,
            granularity_bytes: 2 << 20,
            ..Default::default()
        }
    }

    #[test]
    fn the_slice_has_one_shared_device_per_open_gpu_with_its_leasable_memory() {
        let mut drained = gpu(1, 80 << 30);
        drained.draining = true;
        let mut sick = gpu(2, 80 << 30);
        sick.unhealthy = true;
        let inv = Inventory {
            version: "0.1.0".into(),
            devices: vec![
                gpu(0, (125 << 30) + 12345),
                drained,
                sick,
                gpu(3, 1 << 20),
                gpu(4, 512 << 20),
            ],
        };
        let s = build("gpu-broker.io", "node-a", 3, &inv);
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["metadata"]["name"], "node-a-gpu-broker.io");
        assert_eq!(v["spec"]["driver"], "gpu-broker.io");
        assert_eq!(v["spec"]["nodeName"], "node-a");
        assert_eq!(
            v["spec"]["pool"],
            serde_json::json!({"name": "node-a", "generation": 3, "resourceSliceCount": 1})
        );
        let devices = v["spec"]["devices"].as_array().unwrap();
        let names: Vec<&str> = devices
            .iter()
            .map(|d| d["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            ["gpu-0", "gpu-4"],
            "drained, unhealthy and too small left out"
        );
        let d = &devices[0];
        assert_eq!(d["allowMultipleAllocations"], true);
        assert_eq!(d["attributes"]["uuid"]["string"], "GPU-0");
        assert_eq!(d["attributes"]["model"]["string"], "NVIDIA H200");
        assert_eq!(d["attributes"]["index"]["int"], 0);
        assert_eq!(d["attributes"]["brokerVersion"]["version"], "0.1.0");
        assert_eq!(
            d["capacity"]["memory"],
            serde_json::json!({
                "value": "125Gi",
                "requestPolicy": {"default": "1Gi", "validRange": {"min": "2Mi", "max": "125Gi", "step": "2Mi"}}
            })
        );
        assert_eq!(
            devices[1]["capacity"]["memory"]["requestPolicy"]["default"],
            "512Mi"
        );
    }
}
