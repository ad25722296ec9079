//! Process reservations (`crate::reservations` has the table and the shell's requests):
//! the room a reserved process allocates within is charged to its tenant and counted as
//! held on its device; a lease its process asks for is drawn from that room and goes
//! back into it when it ends (unless it was quarantined).

use super::State;
use crate::error::{BrokerError, BrokerResult};
use crate::queue::Ask;
use crate::reservations::{ClaimAsk, Reservation};
use std::time::SystemTime;
use uuid::Uuid;

impl State {
    /// Grants a queued reservation of `ask` on device `d` (the queue found room and
    /// quota): its room is charged to the tenant and kept on the device (cached blocks in
    /// the way are freed). Returns its id; refused when its session is gone or already
    /// holds one, or the tenant's quota does not allow it.
    pub fn grant_process(&mut self, ask: &Ask, d: u32) -> BrokerResult<Uuid> {
        let pid = match self.sessions.get(&ask.session) {
            Some(s) if s.tenant == ask.tenant => s.peer.pid,
            _ => return Err(crate::error::session_not_found(ask.session)),
        };
        if let Some(r) = self.reservations.of_session(ask.session).next() {
            return Err(BrokerError::ReservationHeld {
                session: ask.session,
                reservation: r.id,
            });
        }
        self.hold_room(&ask.tenant, d, ask.bytes)?;
        let r = Reservation {
            id: self.new_v7_id(),
            tenant: ask.tenant.clone(),
            session: ask.session,
            device: d,
            bytes: ask.bytes,
            requested_bytes: ask.requested_bytes,
            label: ask.label.clone(),
            pid,
            compute_percent: ask.process.as_ref().and_then(|p| p.compute_percent),
            created: self.clock.wall,
            drawn: 0,
            lost: 0,
            group: None,
            claim: None,
        };
        let id = r.id;
        self.reservations.by_id.insert(id, r);
        self.keep_reservation(id);
        Ok(id)
    }

    /// Pushes session reservation `id` for the keeper (a claim's is the store's).
    fn keep_reservation(&mut self, id: Uuid) {
        let Some(r) = self
            .reservations
            .by_id
            .get(&id)
            .filter(|r| r.claim.is_none())
        else {
            return;
        };
        let record = crate::kept::ReservationRecord::from(r);
        self.keep(|| crate::effects::Keep::Reservation(record));
    }

    /// Takes back kept reservation `r` of a session taken back (same id, tenant, device
    /// and room; charged beyond its quota if that shrank meanwhile: its process runs).
    /// Its drawn leases are taken back after it and drawn from it again
    /// ([`State::adopt_lease`]). Refused when its session was not taken back or holds
    /// one, or its tenant or device is gone; what is left of its program's group is then
    /// stopped ([`State::reservation_not_kept`]).
    pub fn adopt_reservation(&mut self, r: Reservation) -> Result<(), super::adopt::NotAdopted> {
        let group = r.group;
        let out = self.take_back_reservation(r);
        if out.is_err() {
            self.reservation_not_kept(group);
        }
        out
    }

    /// A kept reservation that a restart does not take back: what is left of its program's
    /// process group is stopped, as an ended reservation's is, since nothing charges it
    /// any more.
    pub fn reservation_not_kept(&mut self, group: Option<crate::process_group::ProcessGroup>) {
        if let Some(g) = group {
            self.fx.stop_group(g);
        }
    }

    fn take_back_reservation(
        &mut self,
        mut r: Reservation,
    ) -> Result<(), super::adopt::NotAdopted> {
        use super::adopt::NotAdopted;
        let ok = self
            .sessions
            .get(&r.session)
            .is_some_and(|s| s.tenant == r.tenant);
        if !ok || self.reservations.of_session(r.session).next().is_some() {
            return Err(NotAdopted::Session);
        }
        if r.device as usize >= self.pools.len() || self.reservations.by_id.contains_key(&r.id) {
            return Err(NotAdopted::Device);
        }
        r.drawn = 0;
        r.lost = r.lost.min(r.bytes);
        r.claim = None;
        let room = r.room();
        self.ledger
            .adopt_process(&r.tenant, r.device, room)
            .map_err(|_| NotAdopted::Tenant)?;
        self.pools[r.device as usize].adopt_process(room);
        self.reservations.by_id.insert(r.id, r);
        Ok(())
    }

    /// Charges `bytes` of room to `tenant` and keeps them on device `d` (cached blocks in
    /// the way are freed): what every reservation holds, before it is recorded.
    fn hold_room(&mut self, tenant: &str, d: u32, bytes: u64) -> BrokerResult<()> {
        self.ledger.charge_process(tenant, d, bytes)?;
        for b in self.pools[d as usize].reserve_process(bytes) {
            self.fx.free(d, b);
        }
        Ok(())
    }

    /// Grants claim reservation `ask` at once (no session, no process): refused, as a
    /// request that does not wait, when the tenant's quota or the device's room (less
    /// other tenants' unused guarantees) does not hold it. The caller checked that its
    /// device is open.
    pub fn grant_claim(&mut self, ask: ClaimAsk) -> BrokerResult<Uuid> {
        let id = self.new_v7_id();
        let created = self.clock.wall;
        self.charge_claim(id, created, ask)
    }

    /// A claim reservation a previous broker granted (and the shell kept in its store),
    /// taken again at start with its id and creation time: checked and charged as
    /// [`State::grant_claim`] checks and charges a new one.
    pub fn restore_claim(
        &mut self,
        id: Uuid,
        created: SystemTime,
        ask: ClaimAsk,
    ) -> BrokerResult<Uuid> {
        if self.reservations.by_id.contains_key(&id) {
            return Err(BrokerError::FailedPrecondition(format!(
                "reservation {id} already exists"
            )));
        }
        if ask.device as usize >= self.pools.len() {
            return Err(BrokerError::InvalidArgument(format!(
                "device {} does not exist",
                ask.device
            )));
        }
        self.charge_claim(id, created, ask)
    }

    fn charge_claim(&mut self, id: Uuid, created: SystemTime, ask: ClaimAsk) -> BrokerResult<Uuid> {
        let ClaimAsk {
            tenant,
            device: d,
            bytes,
            label,
            binding,
        } = ask;
        if self.reservations.of_claim(&binding.uid).is_some() {
            return Err(BrokerError::FailedPrecondition(format!(
                "claim {} already has a reservation",
                binding.uid
            )));
        }
        self.ledger.check_process_charge(&tenant, bytes)?;
        self.ledger.check_device(&tenant, d, bytes)?;
        let p = &self.pools[d as usize];
        let guaranteed = self.ledger.others_unused_guarantees(&tenant);
        if p.available().saturating_sub(guaranteed) < bytes {
            let (held, limit) = self
                .ledger
                .get(&tenant)
                .map(|t| (t.usage.committed_bytes(), t.quota.limit_bytes))
                .unwrap_or((0, 0));
            return Err(BrokerError::NoCapacity {
                tenant,
                requested: bytes,
                devices: vec![crate::error::DeviceRoom {
                    device: d,
                    free: p.available(),
                    leasable: p.leasable(),
                }],
                guaranteed,
                held,
                limit,
                waiting: self.queue.len(),
            });
        }
        self.hold_room(&tenant, d, bytes)?;
        let r = Reservation {
            id,
            tenant,
            session: Uuid::nil(),
            device: d,
            bytes,
            requested_bytes: bytes,
            label,
            pid: None,
            compute_percent: None,
            created,
            drawn: 0,
            lost: 0,
            group: None,
            claim: Some(binding),
        };
        self.reservations.by_id.insert(id, r);
        Ok(id)
    }

    /// Names the process group of reservation `id`'s program (stopped when it ends).
    pub fn set_process_group(&mut self, id: Uuid, g: crate::process_group::ProcessGroup) {
        if let Some(r) = self.reservations.by_id.get_mut(&id) {
            r.group = Some(g);
        }
        self.keep_reservation(id);
    }

    /// Ends one reservation: its room is uncharged (and what is left of its program's
    /// process group stopped). The queue runs after the hold.
    pub fn end_reservation(&mut self, id: Uuid) {
        let Some(r) = self.reservations.by_id.remove(&id) else {
            return;
        };
        self.wake_queue();
        let room = r.room();
        self.ledger.uncharge_process(&r.tenant, r.device, room);
        self.pools[r.device as usize].unreserve_process(room);
        if let Some(g) = r.group {
            self.fx.stop_group(g);
        }
        if r.claim.is_none() {
            self.keep(|| crate::effects::Keep::ReservationEnded(id));
        }
        tracing::info!(reservation = %id, tenant = %r.tenant, session = %r.session, bytes = r.bytes, drawn = r.drawn, "process reservation ended");
    }

    /// A session ended: so do its reservations.
    pub fn end_session_reservations(&mut self, session: Uuid) {
        let ids: Vec<Uuid> = self
            .reservations
            .of_session(session)
            .map(|r| r.id)
            .collect();
        for id in ids {
            self.end_reservation(id);
        }
    }

    /// Takes `bytes` out of reservation `rid`'s room for a lease of its process (the
    /// caller checked that they fit): they leave the room in the ledger and the pool, to
    /// be reserved as a grant.
    pub fn draw(&mut self, rid: Uuid, tenant: &str, bytes: u64) {
        let Some(r) = self.reservations.by_id.get_mut(&rid) else {
            return;
        };
        r.drawn += bytes;
        let d = r.device;
        self.ledger.shift_process(tenant, d, bytes, false);
        self.pools[d as usize].unreserve_process(bytes);
    }

    /// A drawn ask did not become a lease: its bytes (just given back to the pool and the
    /// ledger) return to its reservation's room, if the reservation is still there.
    pub fn undraw(&mut self, ask: &Ask) {
        if let Some(rid) = ask.draw {
            self.lease_left_reservation(rid, ask.bytes, true);
        }
    }

    /// `bytes` drawn from reservation `rid` came back: into its room when `back` and the
    /// device still has the room, else (quarantined) they stay out of it.
    pub fn lease_left_reservation(&mut self, rid: Uuid, bytes: u64, back: bool) {
        let Some(r) = self.reservations.by_id.get_mut(&rid) else {
            return;
        };
        r.drawn = r.drawn.saturating_sub(bytes);
        let d = r.device as usize;
        let tenant = r.tenant.clone();
        if back && self.pools[d].available() >= bytes {
            self.ledger.shift_process(&tenant, d as u32, bytes, true);
            for b in self.pools[d].reserve_process(bytes) {
                self.fx.free(d as u32, b);
            }
        } else if let Some(r) = self.reservations.by_id.get_mut(&rid) {
            r.lost += bytes;
            // Its room shrank for good: a restart must not give it back.
            self.keep_reservation(rid);
        }
    }
}
