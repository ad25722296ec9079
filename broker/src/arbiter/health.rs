//! The arbiter's side of device health (`crate::health` has the monitor that drives it,
//! `crate::availability` the per-device record): mark a device unhealthy (its waiters
//! that can go nowhere else are told why, its holders get `DeviceUnhealthy`) or healthy
//! again (the queue runs), an operator's verdict (`SetDeviceHealth`, which also resets
//! the fault source's memory of the device), and which devices are healthy: [`DeviceHealth`],
//! reached by [`Arbiter::device_health`].

use super::Arbiter;
use crate::audit::Who;
use crate::availability::Fault;
use crate::error::{BrokerError, BrokerResult};
use std::sync::Arc;
use std::time::SystemTime;

/// The device health of one arbiter ([`Arbiter::device_health`]); the per-device record it
/// changes is the arbiter's availability (`effects.rs`), shared with drains.
pub struct DeviceHealth<'a> {
    pub(super) arb: &'a Arc<Arbiter>,
}

impl DeviceHealth<'_> {
    /// Marks device `index` unhealthy for `reason`: see the module doc. Returns false if
    /// it already was.
    pub(crate) fn mark_unhealthy(
        &self,
        index: u32,
        reason: &str,
        by_operator: bool,
        who: &Who,
    ) -> BrokerResult<bool> {
        self.arb.devices.check_index(index)?;
        let uuid = self.arb.devices.uuid(index);
        let holders = {
            let mut st = self.arb.lock();
            let marked = st.change_devices(|avail| {
                let s = avail.device_mut(index)?;
                match &mut s.fault {
                    Some(f) => {
                        // An operator's mark outranks the monitor's; same reason: nothing new.
                        if f.reason == reason && f.by_operator == by_operator {
                            return None;
                        }
                        f.reason = reason.to_string();
                        f.by_operator |= by_operator;
                    }
                    None => {
                        s.fault = Some(Fault {
                            since: SystemTime::now(),
                            reason: reason.to_string(),
                            by_operator,
                        })
                    }
                }
                Some(())
            });
            if marked.is_none() {
                return Ok(false);
            }
            // Waiters no open device can serve any more are refused now.
            st.settle();
            st.tell_device_unhealthy(index, &uuid, reason)
        };
        tracing::error!(device = index, %uuid, reason, by_operator, sessions_told = holders, "DEVICE UNHEALTHY: no new leases on it");
        self.arb.changes().audit(
            who,
            "device.health",
            "",
            &index.to_string(),
            Some(serde_json::json!({"healthy": true})),
            Some(serde_json::json!({"healthy": false, "reason": reason})),
        );
        Ok(true)
    }

    /// Marks device `index` healthy again. The monitor cannot clear an operator's mark
    /// (`by_operator` false); an operator clears anything. Returns false if it was healthy.
    pub(crate) fn mark_healthy(
        &self,
        index: u32,
        by_operator: bool,
        who: &Who,
    ) -> BrokerResult<bool> {
        self.arb.devices.check_index(index)?;
        let cleared = self.arb.lock().change_devices(|avail| {
            let s = avail.device_mut(index)?;
            match &s.fault {
                None => None,
                Some(f) if f.by_operator && !by_operator => None,
                Some(f) => {
                    let r = f.reason.clone();
                    s.fault = None;
                    Some(r)
                }
            }
        });
        let Some(before) = cleared else {
            return Ok(false);
        };
        tracing::warn!(device = index, by_operator, was = %before, "device healthy again: admitting");
        self.arb.changes().audit(
            who,
            "device.health",
            "",
            &index.to_string(),
            Some(serde_json::json!({"healthy": false, "reason": before})),
            Some(serde_json::json!({"healthy": true})),
        );
        Ok(true)
    }

    /// An operator's verdict on device `index` (`SetDeviceHealth`).
    pub(crate) fn set(
        &self,
        index: u32,
        healthy: bool,
        reason: &str,
        who: &Who,
    ) -> BrokerResult<bool> {
        if reason.len() > crate::arbiter::MAX_LABEL {
            return Err(BrokerError::InvalidArgument(format!(
                "reason longer than {} bytes",
                crate::arbiter::MAX_LABEL
            )));
        }
        if healthy {
            self.arb.lifecycle.reset_fault_source(index);
            self.mark_healthy(index, true, who)
        } else {
            let reason = if reason.is_empty() {
                "marked unhealthy by an operator"
            } else {
                reason
            };
            self.mark_unhealthy(index, reason, true, who)
        }
    }
}
