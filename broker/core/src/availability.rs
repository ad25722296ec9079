//! Which devices admit new leases. A device is open unless it is **draining** (an
//! operator asked, for maintenance: no new grants there, holders of reclaimable leases are
//! asked to release) or **unhealthy** (the health monitor saw a fault, or an operator marked
//! it: no new grants there either). The two are independent: undraining an unhealthy device
//! leaves it closed, and it reopens only when healthy again (or an operator says so).
//!
//! Pure bookkeeping with no locking of its own: the arbiter keeps it beside its state and
//! changes it under the state lock, so admission and the queue see one consistent picture.
//! Refusals are precise: a request pinned to a closed device is `FAILED_PRECONDITION`
//! (its own choice of device cannot be met), a request that could go anywhere while no
//! device is open is `UNAVAILABLE` (retry later or on another node).

use crate::error::BrokerError;
use std::collections::HashSet;
use std::time::SystemTime;
use uuid::Uuid;

/// A drain in progress on one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Drain {
    pub since: SystemTime,
    /// When the holders were asked to be done; `None`: no deadline.
    pub deadline: Option<SystemTime>,
    pub reason: String,
    /// Leases the drain asked to be released (their reclaim is withdrawn on undrain).
    pub asked: HashSet<Uuid>,
}

/// Why a device is unhealthy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    pub since: SystemTime,
    pub reason: String,
    /// Set by an operator (cleared only by an operator) rather than the monitor.
    pub by_operator: bool,
}

/// The admission state of one device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceState {
    pub drain: Option<Drain>,
    pub fault: Option<Fault>,
}

impl DeviceState {
    pub fn is_open(&self) -> bool {
        self.drain.is_none() && self.fault.is_none()
    }

    /// "draining (reason)", "unhealthy (reason)" or both; "" when open.
    pub fn why(&self) -> String {
        let mut v = Vec::new();
        if let Some(d) = &self.drain {
            v.push(format!("draining for maintenance ({})", d.reason));
        }
        if let Some(f) = &self.fault {
            v.push(format!("unhealthy ({})", f.reason));
        }
        v.join(" and ")
    }
}

/// Every device's admission state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Availability {
    devices: Vec<DeviceState>,
}

impl Availability {
    pub fn new(devices: usize) -> Availability {
        Availability {
            devices: vec![DeviceState::default(); devices],
        }
    }

    pub fn device(&self, d: u32) -> Option<&DeviceState> {
        self.devices.get(d as usize)
    }

    pub fn device_mut(&mut self, d: u32) -> Option<&mut DeviceState> {
        self.devices.get_mut(d as usize)
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// Does device `d` take new leases?
    pub fn admits(&self, d: u32) -> bool {
        self.device(d).is_some_and(DeviceState::is_open)
    }

    /// Why a request for `device` (or any device) cannot be admitted now; `None`: it can.
    pub fn refusal(&self, device: Option<u32>) -> Option<BrokerError> {
        match device {
            Some(d) => {
                let s = self.device(d)?;
                (!s.is_open()).then(|| BrokerError::DeviceClosed {
                    device: d,
                    unhealthy: s.fault.is_some(),
                    why: s.why(),
                })
            }
            None => {
                if self.devices.iter().any(DeviceState::is_open) || self.devices.is_empty() {
                    return None;
                }
                let why: Vec<String> = self
                    .devices
                    .iter()
                    .enumerate()
                    .map(|(i, s)| format!("device {i} is {}", s.why()))
                    .collect();
                Some(BrokerError::NoDeviceOpen {
                    why: why.join("; "),
                })
            }
        }
    }

    /// Devices whose drain is in progress.
    pub fn draining(&self) -> Vec<u32> {
        (0..self.devices.len() as u32)
            .filter(|&d| self.devices[d as usize].drain.is_some())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain() -> Drain {
        Drain {
            since: SystemTime::now(),
            deadline: None,
            reason: "kernel update".into(),
            asked: HashSet::new(),
        }
    }

    #[test]
    fn refusals_name_the_device_and_the_reason() {
        let mut a = Availability::new(2);
        assert!(a.refusal(None).is_none() && a.refusal(Some(1)).is_none());
        a.device_mut(1).unwrap().drain = Some(drain());
        assert!(!a.admits(1) && a.admits(0));
        match a.refusal(Some(1)) {
            Some(e @ BrokerError::DeviceClosed { device: 1, .. }) => {
                let m = e.to_string();
                assert!(m.contains("device 1") && m.contains("kernel update"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        assert!(a.refusal(None).is_none(), "device 0 is still open");
        a.device_mut(0).unwrap().fault = Some(Fault {
            since: SystemTime::now(),
            reason: "Xid 79".into(),
            by_operator: false,
        });
        match a.refusal(None) {
            Some(e @ BrokerError::NoDeviceOpen { .. }) => {
                let m = e.to_string();
                assert!(m.contains("Xid 79") && m.contains("kernel update"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        // Undraining leaves the fault.
        a.device_mut(1).unwrap().drain = None;
        assert!(a.admits(1));
        assert!(!a.admits(0));
        assert_eq!(a.draining(), Vec::<u32>::new());
        assert!(!a.admits(7), "unknown devices admit nothing");
    }
}
