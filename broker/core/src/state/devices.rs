//! Transitions a closing device asks of its holders, each one method: a drain asks the
//! holders of reclaimable leases there to give them back by a deadline (the lease is
//! marked, its session told), an undrain withdraws what it asked that is still pending,
//! and a device found unhealthy tells every session holding a lease on it. Which devices
//! are closed (`crate::availability`) is the shell's; the core is told which.

use super::State;
use crate::lease::LeaseState;
use crate::ledger::Tier;
use crate::session::SessionEvent;
use std::collections::BTreeSet;
use std::time::{Instant, SystemTime};
use uuid::Uuid;

impl State {
    /// Devices `targets` are draining (`why`: the operator's reason): every active
    /// reclaimable device lease there is asked back by `due` (`due_wall` on the wall
    /// clock) and its session told. Returns the leases asked, with their devices.
    pub fn ask_drain_reclaim(
        &mut self,
        targets: &[u32],
        due: Instant,
        due_wall: SystemTime,
        why: &str,
    ) -> Vec<(u32, Uuid)> {
        let asked: Vec<(u32, Uuid, Uuid, u64)> = self
            .leases
            .iter()
            .filter(|l| l.tier == Tier::Device && targets.contains(&l.device))
            .filter(|l| l.reclaimable && matches!(l.state, LeaseState::Active))
            .map(|l| (l.device, l.id, l.session, l.bytes()))
            .collect();
        for &(device, id, session, bytes) in &asked {
            self.set_lease_state(
                &id,
                LeaseState::ReclaimRequested {
                    deadline: due,
                    deadline_wall: due_wall,
                },
            );
            if self.sessions.get(&session).is_some() {
                self.fx.notify(
                    session,
                    SessionEvent::ReclaimRequested {
                        lease_id: id,
                        bytes,
                        deadline: due_wall,
                        reason: format!("device {device} is draining for maintenance ({why})"),
                    },
                );
            }
        }
        asked.into_iter().map(|(d, id, _, _)| (d, id)).collect()
    }

    /// A drain ended: those of the leases it asked back (`asked`) that still exist and are
    /// still asked are active again (their holders are not told). Returns how many.
    pub fn withdraw_drain_reclaim<'a>(
        &mut self,
        asked: impl IntoIterator<Item = &'a Uuid>,
    ) -> usize {
        let mut withdrawn = 0;
        for id in asked {
            let pending = self
                .leases
                .get(id)
                .is_some_and(|l| matches!(l.state, LeaseState::ReclaimRequested { .. }));
            if pending {
                self.set_lease_state(id, LeaseState::Active);
                withdrawn += 1;
            }
        }
        withdrawn
    }

    /// Device `device` (its `uuid`) was found unhealthy for `reason`: every session
    /// holding a device lease there is told once. Returns how many sessions hold one.
    pub fn tell_device_unhealthy(&mut self, device: u32, uuid: &str, reason: &str) -> usize {
        let sessions: BTreeSet<Uuid> = self
            .leases
            .iter()
            .filter(|l| l.device == device && l.tier == Tier::Device)
            .map(|l| l.session)
            .collect();
        for &s in &sessions {
            if self.sessions.get(&s).is_some() {
                self.fx.notify(
                    s,
                    SessionEvent::DeviceUnhealthy {
                        device,
                        uuid: uuid.to_string(),
                        reason: reason.to_string(),
                    },
                );
            }
        }
        sessions.len()
    }
}
