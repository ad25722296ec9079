//! A restart's take-back of process reservations (after the sessions, before their
//! leases, so a lease drawn from one is drawn from it again): a kept reservation of a
//! session taken back comes back with the same id, device and room, charged to its tenant
//! as before; one whose session, tenant or device was not taken back leaves the keeper,
//! its bytes are no one's, and what is left of its program's process group is stopped.
//! The core's side is `State::adopt_reservation` (`core/src/state/process.rs`).

use super::Restart;
use crate::keeper::records::ReservationRecord;
use crate::reservations::Reservation;
use uuid::Uuid;

impl Restart<'_> {
    /// Takes back the kept reservations `records` (their devices already found by UUID)
    /// in one lock hold; returns those not taken back, with why.
    pub(super) fn adopt_reservations(
        &self,
        records: Vec<ReservationRecord>,
    ) -> Vec<(ReservationRecord, &'static str)> {
        let mut refused = Vec::new();
        let mut st = self.arb.lock();
        for rec in records {
            let (Ok(id), Ok(session)) = (rec.id.parse::<Uuid>(), rec.session.parse::<Uuid>())
            else {
                st.reservation_not_kept(group_of(&rec));
                refused.push((rec, "unreadable id"));
                continue;
            };
            let r = Reservation {
                id,
                tenant: rec.tenant.clone(),
                session,
                device: rec.device,
                bytes: rec.bytes,
                requested_bytes: rec.requested_bytes,
                label: rec.label.clone(),
                pid: rec.pid,
                compute_percent: rec.compute_percent,
                created: crate::keeper::records::from_unix_ms(rec.created_unix_ms),
                drawn: 0,
                lost: rec.lost,
                group: group_of(&rec),
                claim: None,
            };
            if let Err(why) = st.adopt_reservation(r) {
                tracing::debug!(reservation = %rec.id, session = %rec.session, ?why, "kept reservation not taken back");
                refused.push((rec, "its session, tenant or device is gone"));
            }
        }
        refused
    }
}

/// The process group a kept reservation names, if any.
pub(super) fn group_of(rec: &ReservationRecord) -> Option<crate::process_group::ProcessGroup> {
    rec.group
        .as_ref()
        .map(|g| crate::process_group::ProcessGroup {
            pgid: g.pgid,
            uid: g.uid,
            leader_start: g.leader_start,
        })
}
