//! Process reservations: device memory a session sets aside for its *process* to allocate
//! itself (`cudaMalloc` in an unmodified program; `gpu-brokerctl run` makes one for the
//! program it starts). A reservation waits in the same queue as lease requests, under the
//! same quota, priority, fair share and guarantees, and ends with its session (or
//! `ReleaseProcessMemory`).
//!
//! How it is charged, without counting anything twice:
//!
//! * A reservation of `N` bytes on device `d` charges its tenant `N` (`Usage::
//!   process_reserved_bytes`, part of what the limit is checked against) and keeps `N` of
//!   `d`'s leasable memory promised (`Pool::process_reserved`).
//! * The process tree it covers is the session's peer process and every descendant (a
//!   child started by `run`, its workers). Memory those processes allocate themselves (NVML)
//!   is inside the reservation: it does not shrink the leasable amount (the room is already
//!   counted as held, so the outside-memory estimate leaves it), and it does not make a
//!   session "over its allowance" (nor appear in `gpu-brokerctl leaks`) until the tree
//!   uses more than the reservation's room plus `--own-alloc-allowance`.
//! * A lease asked for by a session of a covered process, of the same tenant, on the
//!   reservation's device (or on no named device) is **drawn from the reservation**: its
//!   bytes move out of the reservation's room into an ordinary lease (charged as held), so
//!   the tenant's total stays `N`. It needs no queue (the memory is set aside already) and
//!   fails with `RESOURCE_EXHAUSTED` when it does not fit in what is left, because under
//!   MPS memory a client maps through a handle counts against that client's pinned limit,
//!   which is the reservation. When the lease ends its bytes go back into the room, unless
//!   they are quarantined (a live process still maps them): then the quarantine holds them
//!   and the room stays smaller.
//! * When the reservation ends, its remaining room is uncharged; leases drawn from it that
//!   outlive it stay ordinary leases.
//!
//! * A **claim reservation** (a Kubernetes ResourceClaim the DRA driver prepared,
//!   `arbiter/claims.rs`) is charged the same way but belongs to no session and covers no
//!   process tree: it is bound to a worker token minted with it, and a lease asked for by a
//!   session opened with that token is drawn from it. It ends when the claim is released
//!   (`ReleaseClaim`), which also revokes the token.
//!
//! This module holds the records the arbiter's core owns (the requests, the reservations,
//! their table); the arbiter's methods that reserve, release, list and draw from them are
//! in `arbiter/reservations.rs`.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};
use uuid::Uuid;

/// The part of a queued request that makes it a process reservation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessAsk {
    /// Share of the device's SMs asked for (1-100), if any.
    pub compute_percent: Option<u32>,
}

/// A reservation request, after the service layer checked its shape.
#[derive(Clone, Debug)]
pub struct ReserveRequest {
    pub tenant: String,
    pub session: Uuid,
    pub bytes: u64,
    pub device: Option<u32>,
    pub wait: Duration,
    pub label: String,
    pub compute_percent: Option<u32>,
}

/// A live reservation.
#[derive(Clone, Debug)]
pub struct Reservation {
    pub id: Uuid,
    pub tenant: String,
    pub session: Uuid,
    pub device: u32,
    /// Rounded size.
    pub bytes: u64,
    pub requested_bytes: u64,
    pub label: String,
    /// The session's peer process: the root of the process tree it covers.
    pub pid: Option<u32>,
    pub compute_percent: Option<u32>,
    pub created: SystemTime,
    /// Bytes drawn by leases of the process (in flight or live).
    pub drawn: u64,
    /// Bytes of drawn leases that ended quarantined: no longer the reservation's.
    pub lost: u64,
    /// The program's process group (`SetProcessGroup`), stopped when the reservation ends.
    pub group: Option<crate::process_group::ProcessGroup>,
    /// The claim it stands for, when it is a claim reservation (no session, no process).
    pub claim: Option<ClaimBinding>,
}

/// A claim reservation asked for: `bytes` (rounded to the device's granularity) for
/// `tenant` on `device`, bound to `binding`.
#[derive(Clone, Debug)]
pub struct ClaimAsk {
    pub tenant: String,
    pub device: u32,
    pub bytes: u64,
    pub label: String,
    pub binding: ClaimBinding,
}

/// What binds a claim reservation: the claim's uid and the token whose sessions draw from
/// it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimBinding {
    pub uid: String,
    pub token_id: String,
}

impl Reservation {
    /// Its public view (`device_uuid`: its device's UUID, which the core does not know).
    pub fn view(&self, device_uuid: String) -> ReservationView {
        ReservationView {
            id: self.id,
            tenant: self.tenant.clone(),
            session: self.session,
            device: self.device,
            device_uuid,
            bytes: self.bytes,
            requested_bytes: self.requested_bytes,
            drawn_bytes: self.drawn + self.lost,
            label: self.label.clone(),
            pid: self.pid,
            compute_percent: self.compute_percent,
            created: Some(self.created),
            env: Vec::new(),
        }
    }

    /// Bytes still charged to the reservation itself: the room its process allocates in.
    pub fn room(&self) -> u64 {
        self.bytes.saturating_sub(self.drawn + self.lost)
    }
}

/// A reservation's public view (plus the environment its process needs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReservationView {
    pub id: Uuid,
    pub tenant: String,
    pub session: Uuid,
    pub device: u32,
    pub device_uuid: String,
    pub bytes: u64,
    pub requested_bytes: u64,
    /// Bytes in leases drawn from it (and quarantined memory of such leases).
    pub drawn_bytes: u64,
    pub label: String,
    pub pid: Option<u32>,
    pub compute_percent: Option<u32>,
    pub created: Option<SystemTime>,
    /// Variables for the process (managed MPS); empty without it.
    pub env: Vec<(String, String)>,
}

/// Every live reservation, by id.
#[derive(Debug, Default)]
pub struct ReservationTable {
    pub by_id: HashMap<Uuid, Reservation>,
}

impl ReservationTable {
    pub fn get(&self, id: &Uuid) -> Option<&Reservation> {
        self.by_id.get(id)
    }
    pub fn iter(&self) -> impl Iterator<Item = &Reservation> {
        self.by_id.values()
    }
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
    pub fn len(&self) -> usize {
        self.by_id.len()
    }
    /// The reservations of a session.
    pub fn of_session(&self, session: Uuid) -> impl Iterator<Item = &Reservation> {
        self.by_id.values().filter(move |r| r.session == session)
    }
    /// The claim reservation of claim `uid`.
    pub fn of_claim(&self, uid: &str) -> Option<&Reservation> {
        self.by_id
            .values()
            .find(|r| r.claim.as_ref().is_some_and(|c| c.uid == uid))
    }

    /// The claim reservation bound to token `token_id`.
    pub fn bound_to(&self, token_id: &str) -> Option<&Reservation> {
        self.by_id
            .values()
            .find(|r| r.claim.as_ref().is_some_and(|c| c.token_id == token_id))
    }

    /// The reservation of `tenant` on a device `keep` accepts whose root is a pid of
    /// `lineage` (the caller, its parent, ...), nearest first.
    pub fn covering(
        &self,
        lineage: &[u32],
        keep: impl Fn(&Reservation) -> bool,
    ) -> Option<&Reservation> {
        let roots: HashMap<u32, &Reservation> = self
            .by_id
            .values()
            .filter(|r| keep(r))
            .filter_map(|r| r.pid.map(|p| (p, r)))
            .collect();
        lineage.iter().find_map(|p| roots.get(p).copied())
    }

    /// Room (bytes charged to reservations) of a session's reservations.
    pub fn room_of_session(&self, session: Uuid) -> u64 {
        self.of_session(session).map(Reservation::room).sum()
    }
}
