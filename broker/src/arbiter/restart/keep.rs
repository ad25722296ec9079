//! The write side of a restart: every session's and lease's start and end (and every
//! quarantine, drain, publication, import, reservation, reclaim request, held block,
//! lingering import and charge of memory kept outside the broker) reaches the keeper as the
//! lock guard runs the transition's `Effect::Keep` ([`Restart::keep`], under the lock,
//! before any reply), between the change's crash points. A device's drain is kept the same
//! way ([`Restart::keep_drain`]); `relink.rs` writes the same records to a keeper that
//! came back.

use super::Restart;
use crate::arbiter::effects::Keep;
use crate::keeper::records::{self, unix_ms};
use crate::keeper::Place;
use std::os::fd::AsFd;

impl Restart<'_> {
    /// Runs `Effect::Keep`: tells the keeper (if there is one), between the crash points
    /// of that change.
    pub(in crate::arbiter) fn keep(&self, k: Keep) {
        let Some(link) = self.state.keeper.get() else {
            return;
        };
        let name = k.name();
        self.arb.crash.pass("before-keep", name);
        let was_broken = link.is_broken();
        self.write_kept(&**link, k);
        if !was_broken && link.is_broken() {
            self.arb.metrics.count_keeper_lost();
        }
        self.arb.crash.pass("after-keep", name);
    }

    /// Writes change `k` to `link` (under the state lock).
    pub(super) fn write_kept(&self, link: &dyn Place, k: Keep) {
        match k {
            Keep::Session(r) => link.put(r.key(), to_json(&r), None),
            Keep::SessionEnded(id) => link.remove(records::session_key(&id)),
            Keep::Lease(mut r, fd) => {
                if r.tier == "device" {
                    r.device_uuid = self.arb.devices.recorded_uuid(r.device);
                }
                link.put(r.key(), to_json(&r), Some(fd.0.as_fd()))
            }
            Keep::LeaseEnded(id) => link.remove(records::lease_key(&id)),
            Keep::Quarantine(mut r, fd) => {
                // Its process's start time came from the core (taken when the quarantine
                // was made): read here, it could be a later process's that reused the pid.
                r.device_uuid = self.arb.devices.recorded_uuid(r.device);
                link.put(r.key(), to_json(&r), Some(fd.0.as_fd()))
            }
            Keep::QuarantineLifted(id) => link.remove(records::quarantine_key(&id)),
            Keep::Publication(r) => link.put(r.key(), to_json(&r), None),
            Keep::PublicationEnded(id) => link.remove(records::publication_key(&id)),
            Keep::Import(r) => link.put(r.key(), to_json(&r), None),
            Keep::ImportEnded(id) => link.remove(records::import_key(&id)),
            Keep::Reservation(mut r) => {
                r.device_uuid = self.arb.devices.recorded_uuid(r.device);
                link.put(r.key(), to_json(&r), None)
            }
            Keep::ReservationEnded(id) => link.remove(records::reservation_key(&id)),
            Keep::Reclaim(r) => link.put(r.key(), to_json(&r), None),
            Keep::ReclaimEnded(id) => link.remove(records::reclaim_key(&id)),
            Keep::Held(mut r, fd) => {
                r.device_uuid = self.arb.devices.recorded_uuid(r.device);
                link.put(r.key(), to_json(&r), Some(fd.0.as_fd()))
            }
            Keep::HeldLetGo(id) => link.remove(records::held_key(&id)),
            Keep::Lingering(r) => link.put(r.key(), to_json(&r), None),
            Keep::LingeringEnded(id) => link.remove(records::lingering_key(&id)),
            Keep::Stranded(mut r) => {
                r.device_uuid = self.arb.devices.recorded_uuid(r.device);
                link.put(r.key(), to_json(&r), None)
            }
            Keep::StrandedLifted(id) => link.remove(records::stranded_key(&id)),
        }
    }

    /// Keeps device `device`'s drain (None: it ended), under the state lock like every
    /// kept change, between the crash points `before-keep:drain` and `after-keep:drain`.
    pub(in crate::arbiter) fn keep_drain(
        &self,
        device: u32,
        drain: Option<&crate::availability::Drain>,
    ) {
        let Some(link) = self.state.keeper.get() else {
            return;
        };
        self.arb.crash.pass("before-keep", "drain");
        let was_broken = link.is_broken();
        self.write_drain(&**link, device, drain);
        if !was_broken && link.is_broken() {
            self.arb.metrics.count_keeper_lost();
        }
        self.arb.crash.pass("after-keep", "drain");
    }

    /// Writes device `device`'s drain (None: it ended) to `link` (under the state lock).
    pub(super) fn write_drain(
        &self,
        link: &dyn Place,
        device: u32,
        drain: Option<&crate::availability::Drain>,
    ) {
        match drain {
            Some(d) => {
                let r = records::DrainRecord {
                    v: records::RECORD_VERSION,
                    device,
                    since_unix_ms: unix_ms(d.since),
                    deadline_unix_ms: d.deadline.map(unix_ms),
                    reason: d.reason.clone(),
                    device_uuid: self.arb.devices.recorded_uuid(device),
                };
                link.put(r.key(), to_json(&r), None);
            }
            None => link.remove(records::drain_key(device)),
        }
    }
}

fn to_json<T: serde::Serialize>(r: &T) -> serde_json::Value {
    serde_json::to_value(r).unwrap_or_default()
}
