//! Draining devices for maintenance: stop admitting there, tell waiting requests that
//! can now go nowhere why (`FAILED_PRECONDITION` when pinned to a drained device,
//! `UNAVAILABLE` when no device is open), ask the holders of reclaimable leases there to
//! release by the deadline (the ordinary reclaim path: a missed deadline revokes), and
//! report progress until the devices hold nothing. Leases that are not reclaimable are
//! left to their holders; the report counts them. Undrain reopens the devices and
//! withdraws the drain's reclaim requests that are still pending. [`Drains`] (reached by
//! [`Arbiter::drains`]) starts, ends and reports them.

use super::{Arbiter, State};
use crate::availability::{Availability, Drain};
use crate::backend::Devices;
use crate::error::{BrokerError, BrokerResult};
use crate::lease::LeaseState;
use crate::ledger::Tier;
use std::collections::HashSet;
use std::time::{Duration, SystemTime};

/// Longest drain deadline accepted.
pub const MAX_DRAIN_DEADLINE: Duration = Duration::from_secs(7 * 24 * 3600);

/// Progress of one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceDrain {
    pub index: u32,
    pub uuid: String,
    pub draining: bool,
    pub since: Option<SystemTime>,
    pub deadline: Option<SystemTime>,
    pub reason: String,
    /// Leases still on the device, and their bytes.
    pub leases: u32,
    pub bytes: u64,
    /// Of those, asked to be released and not yet gone.
    pub reclaim_requested: u32,
    /// Of those, not reclaimable (the drain cannot ask for them).
    pub not_reclaimable: u32,
    /// Memory of ended leases a holder may still map.
    pub quarantined_bytes: u64,
}

impl DeviceDrain {
    /// Draining and nothing left on it.
    pub fn is_empty(&self) -> bool {
        self.leases == 0 && self.quarantined_bytes == 0
    }
}

/// Progress of every device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrainReport {
    pub devices: Vec<DeviceDrain>,
}

impl DrainReport {
    /// Every draining device is empty (and at least one drains).
    pub fn complete(&self) -> bool {
        self.devices.iter().any(|d| d.draining)
            && self
                .devices
                .iter()
                .filter(|d| d.draining)
                .all(DeviceDrain::is_empty)
    }

    /// Every device's progress, read from the state (under its lock), the devices'
    /// admission states and their identities.
    pub(super) fn of(st: &State, avail: &Availability, devices: &Devices) -> DrainReport {
        let progress = (0..devices.len() as u32)
            .map(|d| {
                let drain = avail.device(d).and_then(|s| s.drain.clone());
                let on: Vec<_> = st
                    .leases()
                    .iter()
                    .filter(|l| l.tier == Tier::Device && l.device == d)
                    .collect();
                DeviceDrain {
                    index: d,
                    uuid: devices.uuid(d),
                    draining: drain.is_some(),
                    since: drain.as_ref().map(|x| x.since),
                    deadline: drain.as_ref().and_then(|x| x.deadline),
                    reason: drain.map(|x| x.reason).unwrap_or_default(),
                    leases: on.len() as u32,
                    bytes: on.iter().map(|l| l.bytes()).sum(),
                    reclaim_requested: on
                        .iter()
                        .filter(|l| matches!(l.state, LeaseState::ReclaimRequested { .. }))
                        .count() as u32,
                    not_reclaimable: on.iter().filter(|l| !l.reclaimable).count() as u32,
                    quarantined_bytes: st.pools()[d as usize].stats().quarantined,
                }
            })
            .collect();
        DrainReport { devices: progress }
    }
}

/// The drains of one arbiter's devices ([`Arbiter::drains`]); it keeps no fields (a
/// drain lives in the devices' availability, changed under the state lock).
pub struct Drains<'a> {
    pub(super) arb: &'a Arbiter,
}

impl Drains<'_> {
    /// Starts draining `device` (or every device): see the module doc. Draining a device
    /// that already drains updates its deadline and reason.
    pub(crate) fn start(
        &self,
        device: Option<u32>,
        deadline: Option<Duration>,
        reason: &str,
    ) -> BrokerResult<DrainReport> {
        let targets = self.arb.devices.one_or_all(device)?;
        if let Some(d) = deadline {
            if d.is_zero() || d > MAX_DRAIN_DEADLINE {
                return Err(BrokerError::InvalidArgument(format!(
                    "drain deadline must be more than 0 and at most {} hours",
                    MAX_DRAIN_DEADLINE.as_secs() / 3600
                )));
            }
        }
        if reason.len() > super::MAX_LABEL {
            return Err(BrokerError::InvalidArgument(format!(
                "reason longer than {} bytes",
                super::MAX_LABEL
            )));
        }
        let reason = if reason.is_empty() {
            "operator request".to_string()
        } else {
            reason.to_string()
        };
        let mut st = self.arb.lock();
        let clock = st.clock();
        let now = clock.wall;
        let deadline_wall = deadline.map(|d| now + d);
        st.change_devices(|avail| {
            for &d in &targets {
                if let Some(s) = avail.device_mut(d) {
                    let asked = s.drain.take().map(|x| x.asked).unwrap_or_default();
                    s.drain = Some(Drain {
                        since: now,
                        deadline: deadline_wall,
                        reason: reason.clone(),
                        asked,
                    });
                }
            }
            Some(())
        });
        // Waiters no open device can serve any more are refused now (pinned:
        // `FAILED_PRECONDITION`; unpinned: `UNAVAILABLE`), before the reclaim requests.
        st.settle();
        // Ask holders of reclaimable leases there to release by the deadline (or the
        // usual reclaim deadline).
        let grace = deadline.unwrap_or(self.arb.cfg.reclaim_deadline);
        let (due, due_wall) = (clock.now + grace, now + grace);
        let asked = st.ask_drain_reclaim(&targets, due, due_wall, &reason);
        // Bookkeeping only: which devices admit is as above.
        st.change_devices(|avail| {
            for (d, id) in &asked {
                if let Some(Some(drain)) = avail.device_mut(*d).map(|s| s.drain.as_mut()) {
                    drain.asked.insert(*id);
                }
            }
            // Kept under the state lock: a restart finds the device still draining.
            for &d in &targets {
                if let Some(Some(drain)) = avail.device(d).map(|s| s.drain.as_ref()) {
                    self.arb.restart().keep_drain(d, Some(drain));
                }
            }
            None::<()>
        });
        tracing::warn!(devices = ?targets, ?deadline, %reason, asked = asked.len(), "drain started");
        let report = DrainReport::of(&st, &self.arb.avail.read(), &self.arb.devices);
        drop(st);
        self.arb.crash.pass("after", "drain");
        Ok(report)
    }

    /// Reopens `device` (or every device) and withdraws the drain's pending reclaim
    /// requests. An unhealthy device stays closed.
    pub(crate) fn undrain(&self, device: Option<u32>) -> BrokerResult<DrainReport> {
        let targets = self.arb.devices.one_or_all(device)?;
        let mut st = self.arb.lock();
        let withdrawn = st
            .change_devices(|avail| {
                let mut withdrawn: HashSet<uuid::Uuid> = HashSet::new();
                for &d in &targets {
                    if let Some(drain) = avail.device_mut(d).and_then(|s| s.drain.take()) {
                        withdrawn.extend(drain.asked);
                    }
                }
                Some(withdrawn)
            })
            .unwrap_or_default();
        for &d in &targets {
            self.arb.restart().keep_drain(d, None);
        }
        st.withdraw_drain_reclaim(&withdrawn);
        tracing::warn!(devices = ?targets, withdrawn = withdrawn.len(), "drain ended");
        // The report shows what the queue granted on the reopened devices.
        st.settle();
        Ok(DrainReport::of(
            &st,
            &self.arb.avail.read(),
            &self.arb.devices,
        ))
    }

    /// Progress of every device.
    pub(crate) fn report(&self) -> DrainReport {
        let st = self.arb.lock();
        DrainReport::of(&st, &self.arb.avail.read(), &self.arb.devices)
    }
}
