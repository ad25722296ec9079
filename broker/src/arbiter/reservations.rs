//! The arbiter's side of process reservations (`crate::reservations` has the records,
//! the table and how a reservation is charged): reserve (validated, queued like a lease
//! request, then given the managed MPS daemon's environment), release, name the program's
//! process group, and the peer of a reservation's session (the service checks the caller of
//! a release or a group against it) ([`Reservations`], reached by
//! [`Arbiter::reservations`]); and the hooks admission and the outside-memory look call: the
//! caller's process lineage (read from `/proc` outside the state lock), drawing a lease from
//! the reservation that covers its process, and which GPU processes a reservation covers.

use crate::arbiter::queue::{Ask, Granted};
use crate::arbiter::{AcquireRequest, Arbiter, State};
use crate::error::{BrokerError, BrokerResult, Missing};
use crate::process::lineage;
use crate::reservations::{ProcessAsk, Reservation, ReservationView, ReserveRequest};
use crate::session::Peer;
use std::collections::HashMap;
use std::sync::Arc;
use uuid::Uuid;

/// A lease request of a reserved process, ready to be granted from its reservation.
pub(crate) struct Drawn {
    pub ask: Ask,
    pub priority: i32,
    pub device: u32,
}

/// What NVML says about the process trees of reservations: for each pid covered, the
/// reservation it falls in; for each reservation, its tree's own GPU memory.
#[derive(Debug, Default)]
pub(crate) struct Covered {
    pub by_pid: HashMap<u32, Uuid>,
    pub tree_used: HashMap<Uuid, u64>,
}

/// The process reservations of one arbiter ([`Arbiter::reservations`]); it keeps no fields
/// (the reservations live in the state, charged there like leases).
pub struct Reservations<'a> {
    pub(super) arb: &'a Arc<Arbiter>,
}

impl Reservations<'_> {
    /// The peer of the session a process reservation of `tenant` belongs to (`NOT_FOUND`
    /// otherwise).
    pub(crate) fn peer(&self, tenant: &str, id: Uuid) -> BrokerResult<Peer> {
        let st = self.arb.lock();
        match st.reservations().get(&id) {
            Some(r) if r.tenant == tenant => Ok(st
                .sessions()
                .get(&r.session)
                .map(|s| s.peer)
                .unwrap_or_default()),
            _ => Err(BrokerError::NotFound(Missing::Reservation(id))),
        }
    }

    /// Reserves device memory for the session's process: now, after waiting up to
    /// `req.wait` in the lease queue, or fails with the reason (the statuses of a lease
    /// request). The reply carries the environment managed MPS wants the process to have.
    pub(crate) async fn reserve(&self, req: ReserveRequest) -> BrokerResult<ReservationView> {
        if let Some(p) = req.compute_percent {
            if !(1..=100).contains(&p) {
                return Err(BrokerError::InvalidArgument(format!(
                    "compute percent {p} is outside 1-100"
                )));
            }
        }
        // Under managed MPS the client's CUDA context and libraries count against its
        // pinned limit: the reservation (limit and charge) gets them on top, so the
        // program can allocate what it asked for.
        let overhead = if req.bytes == 0 {
            0 // refused by `validate` as any empty request
        } else {
            self.arb.lifecycle.mps().map_or(0, |m| m.context_overhead())
        };
        let bytes = req.bytes.checked_add(overhead).ok_or_else(|| {
            BrokerError::InvalidArgument(format!("{} bytes is too large", req.bytes))
        })?;
        let acquire = AcquireRequest {
            tenant: req.tenant.clone(),
            session: req.session,
            bytes,
            device: req.device,
            wait: req.wait,
            label: req.label.clone(),
            reclaimable: false,
            fallback_host: false,
        };
        let acquire = self.arb.validate(acquire)?;
        // Refuse at once what the environment cannot serve (the MPS daemon is down).
        self.env(req.device.unwrap_or(0), bytes, &req)?;
        let ask = ProcessAsk {
            compute_percent: req.compute_percent,
        };
        let mut waited = false;
        let granted = self
            .arb
            .acquire_untimed(acquire, Some(ask), &mut waited)
            .await?;
        let Granted::Process(mut view) = granted else {
            return Err(BrokerError::Internal(
                "a process reservation was granted a lease".into(),
            ));
        };
        match self.env(view.device, view.bytes, &req) {
            Ok(env) => view.env = env,
            Err(e) => {
                let _ = self.release(&req.tenant, view.id);
                return Err(e);
            }
        }
        tracing::info!(reservation = %view.id, tenant = %view.tenant, session = %view.session, device = view.device, bytes = view.bytes, pid = ?view.pid, "process memory reserved");
        self.arb.crash.pass("after", "reserve");
        Ok(view)
    }

    /// The managed MPS daemon's variables for a reservation (`crate::mps`; nothing
    /// without `--mps`). `UNAVAILABLE` while the daemon is down.
    pub(super) fn env(
        &self,
        device: u32,
        bytes: u64,
        req: &ReserveRequest,
    ) -> BrokerResult<Vec<(String, String)>> {
        let Some(mps) = self.arb.lifecycle.mps() else {
            return Ok(Vec::new());
        };
        let (weight, max_weight) = {
            let st = self.arb.lock();
            let w = |t: &crate::ledger::Tenant| t.quota.turn_weight.max(1);
            (
                st.ledger().get(&req.tenant).map(w).unwrap_or(1),
                st.ledger().tenants().map(w).max().unwrap_or(1),
            )
        };
        let percentage = crate::mps::thread_percentage(req.compute_percent, weight, max_weight);
        Ok(mps.client_env(device, bytes, percentage)?.vars)
    }

    /// Ends a reservation of `tenant` early (its session keeps going).
    pub(crate) fn release(&self, tenant: &str, id: Uuid) -> BrokerResult<()> {
        let mut st = self.arb.lock();
        match st.reservations().get(&id) {
            Some(r) if r.tenant == tenant => {}
            _ => return Err(BrokerError::NotFound(Missing::Reservation(id))),
        }
        st.end_reservation(id);
        drop(st);
        self.arb.crash.pass("after", "release-reservation");
        Ok(())
    }

    /// Names the process group of a reservation's program (its leader `pgid` must be a
    /// child of the session's process, of its uid, leading its group): when the
    /// reservation ends, what is left of the group is stopped.
    pub(crate) fn set_process_group(&self, tenant: &str, id: Uuid, pgid: u32) -> BrokerResult<()> {
        let root = |st: &State| {
            st.reservations()
                .get(&id)
                .filter(|r| r.tenant == tenant)
                .map(|r| {
                    (
                        r.pid,
                        st.sessions().get(&r.session).and_then(|s| s.peer.uid),
                    )
                })
                .ok_or(BrokerError::NotFound(Missing::Reservation(id)))
        };
        let (pid, uid) = root(&self.arb.lock())?;
        // `/proc` is read with no lock held.
        let g = crate::process_group::verify(pgid, pid, uid).map_err(|e| {
            BrokerError::ProcessGroupRefused {
                pgid,
                why: e.to_string(),
            }
        })?;
        let mut st = self.arb.lock();
        if root(&st)? != (pid, uid) {
            return Err(BrokerError::NotFound(Missing::Reservation(id)));
        }
        st.set_process_group(id, g);
        tracing::info!(reservation = %id, pgid, "process group of the reservation's program");
        Ok(())
    }

    /// Which GPU processes (pid -> bytes, NVML) lie in a reservation's process tree, and
    /// how much each tree uses. Reads `/proc` outside the state lock.
    pub(super) fn covered_usage(&self, usage: &HashMap<u32, u64>) -> Covered {
        let roots: HashMap<u32, Uuid> = {
            let st = self.arb.lock();
            st.reservations()
                .iter()
                .filter_map(|r| r.pid.map(|p| (p, r.id)))
                .collect()
        };
        let mut out = Covered::default();
        if roots.is_empty() {
            return out;
        }
        for (&pid, &bytes) in usage {
            if let Some(rid) = lineage(pid).find_map(|p| roots.get(&p).copied()) {
                out.by_pid.insert(pid, rid);
                *out.tree_used.entry(rid).or_default() += bytes;
            }
        }
        for (&pid, &rid) in &roots {
            out.by_pid.insert(pid, rid);
        }
        out
    }
}

/// If `req` comes from a process (`lineage`: it and its ancestors) a reservation of
/// its tenant covers, on that reservation's device, takes its bytes out of the
/// reservation's room and returns the ask to grant at once. `RESERVATION_EXCEEDED`
/// when it does not fit in the room.
pub(super) fn draw_from_reservation(
    st: &mut State,
    req: &AcquireRequest,
    lineage: &[u32],
) -> BrokerResult<Option<Drawn>> {
    if st.reservations().is_empty() {
        return Ok(None);
    }
    let r = match claim_of_session(st, req) {
        // A session of a claim's token draws from the claim's reservation only: a
        // lease pinned to another device is refused below, not charged beside it.
        Some(r) => r,
        None => {
            // The lineage was read for the session's peer before the lock.
            let peer = st.sessions().get(&req.session).and_then(|s| s.peer.pid);
            if lineage.is_empty() || peer != lineage.first().copied() {
                return Ok(None);
            }
            let Some(r) = st.reservations().covering(lineage, |r| {
                r.tenant == req.tenant && req.device.is_none_or(|d| d == r.device)
            }) else {
                return Ok(None);
            };
            r
        }
    };
    if let Some(d) = req.device.filter(|&d| d != r.device) {
        return Err(BrokerError::InvalidArgument(format!(
            "this session's claim reserved device {}, not device {d}",
            r.device
        )));
    }
    let (rid, d) = (r.id, r.device);
    let gran = st.pools()[d as usize].granularity();
    let bytes = crate::units::round_up(req.bytes, gran)
        .ok_or_else(|| BrokerError::InvalidArgument(format!("size {} is too large", req.bytes)))?;
    if bytes > r.room() {
        return Err(BrokerError::ReservationExceeded {
            reservation: rid,
            pid: r.pid.unwrap_or(0),
            requested: bytes,
            reserved: r.bytes,
            drawn: r.drawn + r.lost,
        });
    }
    let priority = st
        .ledger()
        .get(&req.tenant)
        .map(|t| t.quota.priority)
        .unwrap_or(0);
    st.draw(rid, &req.tenant, bytes);
    Ok(Some(Drawn {
        ask: Ask {
            tenant: req.tenant.clone(),
            session: req.session,
            bytes,
            requested_bytes: req.bytes,
            device: Some(d),
            label: req.label.clone(),
            reclaimable: req.reclaimable,
            process: None,
            draw: Some(rid),
        },
        priority,
        device: d,
    }))
}

/// Whether a lease request must be looked at against the process reservations first:
/// the pid of its session's peer when a reservation exists and the peer is known (the
/// caller then reads the peer's lineage from `/proc` outside the lock and offers the
/// request again with it). Read under the lock the offer holds, so a broker with no
/// reservation takes the lock once per acquire.
pub(super) fn lineage_needed(st: &State, req: &AcquireRequest) -> Option<u32> {
    if st.reservations().is_empty() || claim_of_session(st, req).is_some() {
        return None;
    }
    st.sessions().get(&req.session).and_then(|s| s.peer.pid)
}

/// Refuses a reservation the session cannot have: one per session (it stands for
/// the session's one process).
pub(super) fn check_process_ask(st: &State, req: &AcquireRequest) -> BrokerResult<()> {
    if let Some(r) = st.reservations().of_session(req.session).next() {
        return Err(BrokerError::ReservationHeld {
            session: req.session,
            reservation: r.id,
        });
    }
    Ok(())
}

/// The pids a process tree is made of (`pid`, its parent, ...), read from `/proc`
/// outside the state lock.
pub(super) fn caller_lineage(pid: u32) -> Vec<u32> {
    lineage(pid).collect()
}

/// The claim reservation bound to the token the request's session was opened with
/// (`arbiter/claims.rs`), of its tenant.
fn claim_of_session<'a>(st: &'a State, req: &AcquireRequest) -> Option<&'a Reservation> {
    let token = st.sessions().get(&req.session)?.token_id.as_deref()?;
    st.reservations()
        .bound_to(token)
        .filter(|r| r.tenant == req.tenant)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arbiter::tests::req;
    use crate::arbiter::ArbiterConfig;
    use crate::ledger::Quota;
    use crate::session::Peer;
    use std::time::Duration;

    const MIB: u64 = 1 << 20;

    fn arbiter(capacity: u64) -> Arc<Arbiter> {
        crate::arbiter::host_arbiter(capacity, 1, ArbiterConfig::default())
    }

    fn quota(limit: u64, guaranteed: u64) -> Quota {
        Quota {
            limit_bytes: limit,
            guaranteed_bytes: guaranteed,
            ..Quota::default()
        }
    }

    fn session(arb: &Arc<Arbiter>, tenant: &str, pid: Option<u32>) -> Uuid {
        let peer = Peer {
            pid,
            uid: None,
            unix: true,
        };
        let (id, rx) = arb.open_session(tenant, "t", peer).unwrap();
        std::mem::forget(rx);
        id
    }

    fn reserve(tenant: &str, session: Uuid, bytes: u64, wait: Duration) -> ReserveRequest {
        ReserveRequest {
            tenant: tenant.into(),
            session,
            bytes,
            device: None,
            wait,
            label: String::new(),
            compute_percent: None,
        }
    }

    fn usage(arb: &Arbiter, t: &str) -> crate::ledger::Usage {
        arb.views().tenant(t).unwrap().usage
    }

    /// Every byte is in one place: tenants' charges add up to the pool's promises, and
    /// neither exceeds its limit.
    fn check_books(arb: &Arbiter, limits: &[(&str, u64)]) {
        let st = arb.state.lock();
        let mut total = 0;
        for (t, limit) in limits {
            let u = st.ledger().get(t).unwrap().usage;
            assert!(u.committed_bytes() <= *limit, "{t} over its limit: {u:?}");
            let room: u64 = st
                .reservations()
                .iter()
                .filter(|r| r.tenant == *t)
                .map(Reservation::room)
                .sum();
            assert_eq!(u.process_reserved_bytes, room, "{t}");
            let t = st.ledger().get(t).unwrap();
            assert_eq!(
                t.device_bytes.values().sum::<u64>(),
                u.committed_bytes(),
                "{}: per-device bytes add up",
                t.name
            );
            total += u.committed_bytes();
        }
        let p = &st.pools()[0];
        assert_eq!(p.committed(), total, "pool promises = tenants' charges");
        assert!(p.committed() <= p.leasable());
        assert_eq!(p.stats().process_reserved, {
            let r: u64 = st.reservations().iter().map(Reservation::room).sum();
            r
        });
    }

    #[tokio::test]
    async fn a_reservation_is_charged_waits_for_room_and_ends_with_its_session() {
        let arb = arbiter(1024 * MIB);
        arb.set_quota("a", quota(512 * MIB, 0)).unwrap();
        arb.set_quota("b", quota(1024 * MIB, 0)).unwrap();
        let sa = session(&arb, "a", None);
        let r = arb
            .reservations()
            .reserve(reserve("a", sa, 300 * MIB, Duration::ZERO))
            .await
            .unwrap();
        assert_eq!((r.bytes, r.device, r.drawn_bytes), (300 * MIB, 0, 0));
        assert!(r.device_uuid.starts_with("HOST-"), "{}", r.device_uuid);
        let u = usage(&arb, "a");
        assert_eq!(
            (u.process_reserved_bytes, u.process_reservations),
            (300 * MIB, 1)
        );
        assert_eq!(u.held_bytes, 0, "not a lease");
        // The quota counts it: 300 + 300 > 512 (with a wait it would wait, as a lease).
        let sa2 = session(&arb, "a", None);
        let e = arb
            .reservations()
            .reserve(reserve("a", sa2, 300 * MIB, Duration::ZERO))
            .await
            .unwrap_err();
        assert!(matches!(e, BrokerError::QuotaExceeded { .. }), "{e:?}");
        // One per session.
        let e = arb
            .reservations()
            .reserve(reserve("a", sa, 2 * MIB, Duration::ZERO))
            .await
            .unwrap_err();
        assert!(
            matches!(e, BrokerError::ReservationHeld { session, .. } if session == sa),
            "{e:?}"
        );
        // The device counts it: b gets 1024 - 300 at most now, and waits for more.
        let sb = session(&arb, "b", None);
        let e = arb.acquire(req("b", sb, 800 * MIB)).await.unwrap_err();
        assert!(matches!(e, BrokerError::NoCapacity { .. }), "{e:?}");
        let big = arb.acquire(req("b", sb, 724 * MIB)).await.unwrap();
        let sb2 = session(&arb, "b", None);
        let waiting = {
            let arb = arb.clone();
            tokio::spawn(async move {
                arb.reservations()
                    .reserve(reserve("b", sb2, 200 * MIB, Duration::from_secs(10)))
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "waits while the device is full");
        arb.end_session(sa, "test");
        let rb = waiting.await.unwrap().unwrap();
        assert_eq!(rb.bytes, 200 * MIB);
        assert_eq!(
            usage(&arb, "a").process_reserved_bytes,
            0,
            "ended with the session"
        );
        assert_eq!(usage(&arb, "a").process_reservations, 0);
        check_books(&arb, &[("a", 512 * MIB), ("b", 1024 * MIB)]);
        arb.release("b", big.id).unwrap();
        arb.reservations().release("b", rb.id).unwrap();
        assert!(matches!(
            arb.reservations().release("b", rb.id),
            Err(BrokerError::NotFound(_))
        ));
        check_books(&arb, &[("a", 512 * MIB), ("b", 1024 * MIB)]);
        assert_eq!(arb.state.lock().pools()[0].committed(), 0);
    }

    #[tokio::test]
    async fn a_reservation_respects_other_tenants_guarantees() {
        let arb = arbiter(1024 * MIB);
        arb.set_quota("a", quota(1024 * MIB, 0)).unwrap();
        arb.set_quota("g", quota(512 * MIB, 400 * MIB)).unwrap();
        let sa = session(&arb, "a", None);
        let e = arb
            .reservations()
            .reserve(reserve("a", sa, 700 * MIB, Duration::ZERO))
            .await
            .unwrap_err();
        assert!(matches!(e, BrokerError::NoCapacity { .. }), "{e:?}");
        arb.reservations()
            .reserve(reserve("a", sa, 624 * MIB, Duration::ZERO))
            .await
            .unwrap();
        // g's guarantee is still there for it, as a reservation too.
        let sg = session(&arb, "g", None);
        arb.reservations()
            .reserve(reserve("g", sg, 400 * MIB, Duration::ZERO))
            .await
            .unwrap();
        check_books(&arb, &[("a", 1024 * MIB), ("g", 512 * MIB)]);
    }

    #[tokio::test]
    async fn a_reservation_counts_under_the_device_cap() {
        let arb = arbiter(1024 * MIB);
        let mut q = quota(1024 * MIB, 0);
        q.device_limit_bytes.insert(0, 100 * MIB);
        arb.set_quota("a", q).unwrap();
        let s = session(&arb, "a", None);
        let e = arb
            .reservations()
            .reserve(reserve("a", s, 200 * MIB, Duration::from_secs(5)))
            .await
            .unwrap_err();
        assert!(
            matches!(e, BrokerError::DeviceQuotaExceeded { .. }),
            "{e:?}"
        );
        arb.reservations()
            .reserve(reserve("a", s, 64 * MIB, Duration::ZERO))
            .await
            .unwrap();
        assert_eq!(arb.state.lock().ledger().device_committed("a", 0), 64 * MIB);
        let other = session(&arb, "a", None);
        let e = arb.acquire(req("a", other, 64 * MIB)).await.unwrap_err();
        assert!(
            matches!(e, BrokerError::DeviceQuotaExceeded { .. }),
            "{e:?}"
        );
        check_books(&arb, &[("a", 1024 * MIB)]);
        arb.end_session(s, "test");
        assert_eq!(arb.state.lock().ledger().device_committed("a", 0), 0);
    }

    #[tokio::test]
    async fn bad_reservations_are_invalid_arguments() {
        let arb = arbiter(1024 * MIB);
        arb.set_quota("a", quota(512 * MIB, 0)).unwrap();
        let s = session(&arb, "a", None);
        for (bytes, device, pct) in [
            (0, None, None),
            (MIB, Some(7), None),
            (MIB, None, Some(0)),
            (MIB, None, Some(101)),
        ] {
            let mut r = reserve("a", s, bytes, Duration::ZERO);
            r.device = device;
            r.compute_percent = pct;
            let e = arb.reservations().reserve(r).await.unwrap_err();
            match device {
                Some(7) => assert!(
                    matches!(e, BrokerError::UnknownDevice { device: 7, .. }),
                    "{e:?}"
                ),
                _ => assert!(matches!(e, BrokerError::InvalidArgument(_)), "{e:?}"),
            }
        }
        let e = arb
            .reservations()
            .reserve(reserve("a", Uuid::now_v7(), MIB, Duration::ZERO))
            .await
            .unwrap_err();
        assert!(matches!(e, BrokerError::NotFound(_)), "{e:?}");
        assert_eq!(usage(&arb, "a"), crate::ledger::Usage::default());
    }

    /// Leases of the reserved process come out of its reservation: the tenant's total stays
    /// the reservation, a lease beyond the room is refused, a released lease's bytes come
    /// back, and leases outliving the reservation stay ordinary leases.
    #[tokio::test]
    async fn leases_of_the_reserved_process_are_drawn_from_its_reservation() {
        let arb = arbiter(1024 * MIB);
        arb.set_quota("a", quota(600 * MIB, 0)).unwrap();
        let me = std::process::id();
        let owner = session(&arb, "a", Some(me));
        let r = arb
            .reservations()
            .reserve(reserve("a", owner, 512 * MIB, Duration::ZERO))
            .await
            .unwrap();
        // Another session of the same process (a worker library inside the program).
        let worker = session(&arb, "a", Some(me));
        let l = arb.acquire(req("a", worker, 128 * MIB)).await.unwrap();
        let u = usage(&arb, "a");
        assert_eq!(
            (u.held_bytes, u.process_reserved_bytes),
            (128 * MIB, 384 * MIB)
        );
        assert_eq!(u.committed_bytes(), 512 * MIB, "drawn, not charged twice");
        assert_eq!(
            arb.views().reservations(Some("a"))[0].drawn_bytes,
            128 * MIB
        );
        check_books(&arb, &[("a", 600 * MIB)]);
        // Beyond the room: refused, though the quota would have allowed 88 MiB more.
        let e = arb.acquire(req("a", worker, 400 * MIB)).await.unwrap_err();
        assert!(
            matches!(e, BrokerError::ReservationExceeded { requested, reserved, drawn, .. }
                if (requested, reserved, drawn) == (400 * MIB, 512 * MIB, 128 * MIB)),
            "{e:?}"
        );
        // Another process of the tenant is charged normally.
        let other = session(&arb, "a", None);
        let o = arb.acquire(req("a", other, 64 * MIB)).await.unwrap();
        assert_eq!(usage(&arb, "a").committed_bytes(), 576 * MIB);
        arb.release("a", o.id).unwrap();
        // Released: back into the room.
        arb.release("a", l.id).unwrap();
        let u = usage(&arb, "a");
        assert_eq!((u.held_bytes, u.process_reserved_bytes), (0, 512 * MIB));
        check_books(&arb, &[("a", 600 * MIB)]);
        // A drawn lease outliving the reservation stays an ordinary lease.
        let l = arb.acquire(req("a", worker, 64 * MIB)).await.unwrap();
        arb.reservations().release("a", r.id).unwrap();
        let u = usage(&arb, "a");
        assert_eq!(
            (
                u.held_bytes,
                u.process_reserved_bytes,
                u.process_reservations
            ),
            (64 * MIB, 0, 0)
        );
        arb.release("a", l.id).unwrap();
        check_books(&arb, &[("a", 600 * MIB)]);
        assert_eq!(arb.state.lock().pools()[0].committed(), 0);
    }

    #[tokio::test]
    async fn own_memory_within_the_reservation_is_not_over_the_allowance() {
        let arb = arbiter(1024 * MIB);
        arb.set_quota("a", quota(1024 * MIB, 0)).unwrap();
        let me = std::process::id();
        let parent = crate::process::parent_of(me).expect("the test has a parent");
        // The reservation is the parent's (as `run`'s is); this process is its child.
        let owner = session(&arb, "a", Some(parent));
        arb.reservations()
            .reserve(reserve("a", owner, 512 * MIB, Duration::ZERO))
            .await
            .unwrap();
        let child = session(&arb, "a", Some(me));
        let over = |arb: &Arbiter, id: Uuid| {
            arb.state
                .lock()
                .sessions()
                .get(&id)
                .and_then(|s| s.gpu)
                .map(|g| (g.used, g.over))
        };
        let usage: HashMap<u32, u64> = [(me, 600 * MIB)].into();
        arb.sessions().apply_process_usage(&usage, 100 * MIB);
        assert_eq!(
            over(&arb, child),
            Some((600 * MIB, false)),
            "within 512 + 100"
        );
        assert_eq!(
            over(&arb, owner),
            Some((600 * MIB, false)),
            "the tree's memory"
        );
        let usage: HashMap<u32, u64> = [(me, 700 * MIB)].into();
        arb.sessions().apply_process_usage(&usage, 100 * MIB);
        assert_eq!(over(&arb, child), Some((700 * MIB, true)), "beyond it");
        // Without a reservation the allowance alone counts.
        arb.end_session(owner, "test");
        let usage: HashMap<u32, u64> = [(me, 200 * MIB)].into();
        arb.sessions().apply_process_usage(&usage, 100 * MIB);
        assert_eq!(over(&arb, child), Some((200 * MIB, true)));
    }

    /// Many tenants reserving, leasing and ending sessions at once: no tenant ever holds
    /// more than its limit, the pool never promises more than it has, guarantees hold, and
    /// everything comes back to zero.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn reservations_are_exact_under_concurrency() {
        let arb = arbiter(1024 * MIB);
        let tenants = [
            ("a", 400 * MIB, 0),
            ("b", 600 * MIB, 0),
            ("g", 300 * MIB, 200 * MIB),
        ];
        for (t, limit, g) in tenants {
            arb.set_quota(t, quota(limit, g)).unwrap();
        }
        let limits: Vec<(&str, u64)> = tenants.iter().map(|(t, l, _)| (*t, *l)).collect();
        let mut tasks = Vec::new();
        for i in 0..48u64 {
            let arb = arb.clone();
            let (t, _, _) = tenants[(i % 3) as usize];
            tasks.push(tokio::spawn(async move {
                let me = std::process::id();
                let s = session(&arb, t, Some(me));
                let bytes = (16 + (i * 37) % 200) * MIB;
                let wait = Duration::from_millis(if i % 2 == 0 { 0 } else { 200 });
                let r = arb.reservations().reserve(reserve(t, s, bytes, wait)).await;
                let mut granted = 0;
                if r.is_ok() {
                    granted = 1;
                    // Some draw leases from it, some lease beside it.
                    let _ = arb.acquire(req(t, s, 8 * MIB)).await;
                }
                tokio::task::yield_now().await;
                if i % 4 == 0 {
                    if let Ok(r) = &r {
                        let _ = arb.reservations().release(t, r.id);
                    }
                }
                arb.end_session(s, "test");
                granted
            }));
        }
        let checker = {
            let arb = arb.clone();
            let limits = limits.clone();
            tokio::spawn(async move {
                for _ in 0..200 {
                    check_books(&arb, &limits);
                    {
                        // g's unused guarantee is never given away.
                        let st = arb.state.lock();
                        let g = st.ledger().get("g").unwrap();
                        let p = &st.pools()[0];
                        assert!(
                            p.available() >= g.unused_guarantee(),
                            "g's guarantee taken: available {} unused guarantee {}",
                            p.available(),
                            g.unused_guarantee()
                        );
                    }
                    tokio::task::yield_now().await;
                }
            })
        };
        let mut granted = 0;
        for t in tasks {
            granted += t.await.unwrap();
        }
        checker.await.unwrap();
        assert!(granted > 0);
        check_books(&arb, &limits);
        for (t, _, _) in tenants {
            let u = usage(&arb, t);
            assert_eq!(u.committed_bytes(), u.quarantined_bytes, "{t}: {u:?}");
            assert_eq!(u.process_reservations, 0);
        }
        assert!(arb.state.lock().reservations().is_empty());
    }
}
