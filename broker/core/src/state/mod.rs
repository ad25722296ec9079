//! The arbiter's core: every byte the broker holds and every table that says whose it is
//! (ledger, pools, lease table, sessions, wait queue, quarantine, shared blocks, process
//! reservations), behind private fields. It is synchronous and does no I/O of its own: no
//! tokio runtime, no device calls, no `/proc` reads, no clock reads (the shell gives it the
//! hold's time, [`Clock`]), no locks (the shell, `arbiter/effects.rs`, holds the one lock
//! around it). Each transition is one method that
//! updates everything it concerns together and pushes what the shell must do afterwards
//! (free a block, start or stop a watcher, answer a waiter, tell a session, count) onto
//! [`State::fx`]. The byte-state invariant is written once, here
//! ([`State::check_invariant`]): the lock guard checks it after every transition in debug
//! builds, and the model test (`state/tests.rs`) drives the core directly.
//!
//! Transitions: `grant.rs` (reserve, commit or give back a grant; host-fallback leases),
//! `end.rs` (end a lease into the cache, a free or quarantine; lift a quarantine; a
//! session's end; free everything at shutdown), `shared.rs` (publish, unpublish, import,
//! recipients of descriptors; blocks held for importers and fd recipients, and the look at
//! processes counted alive), `stranded.rs` (freed memory a process outside the broker
//! kept, charged to its tenant until that process exits), `process.rs` (process reservations: grant, end, draw a lease from one,
//! give it back), `devices.rs` (a drain's reclaim requests and their withdrawal, telling
//! holders of an unhealthy device), `queue.rs` (the queue policy: queue a request, one pass deciding what
//! fits where, the whole queue run, refusing what can never fit, reclaim requests), `retained.rs`
//! (a released block its process keeps mapped: held for the tenant, granted to that
//! process again without a ticket, let go when told), `adopt.rs` and `adopt_shared.rs`
//! (a restart's take-back of kept sessions, leases, quarantines, publications, imports), and here:
//! opening a session, leasable and headroom changes, quota changes.

// No clock, no file or socket (`clippy.toml` lists them); the tests may read clocks.
#![cfg_attr(not(test), deny(clippy::disallowed_methods, clippy::disallowed_types))]

mod adopt;
mod adopt_shared;
mod devices;
mod end;
mod grant;
mod kept_now;
mod process;
mod queue;
#[cfg(test)]
mod queue_tests;
mod retained;
#[cfg(test)]
mod retained_tests;
mod shared;
mod stranded;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod transition_tests;

pub use adopt::{Adopted, AdoptedQuarantine, NotAdopted};
pub use adopt_shared::{AdoptedHeld, AdoptedHeldPublication, AdoptedImport, AdoptedLingering};
pub use end::{Ending, Revoke};
pub use queue::{Enqueued, QueueEnv};
pub use shared::{Holding, NewPublication, Recipient, SealCheck};
pub use stranded::{AdoptedStranded, Stranded};

use crate::effects::{Effects, Watch};
use crate::error::{BrokerError, BrokerResult, Missing};
use crate::id_map::IdMap;
use crate::lease::{Lease, LeaseState, LeaseTable, LeaseView};
use crate::ledger::{Ledger, Tier};
use crate::pool::{Block, Pool};
use crate::queue::WaitQueue;
use crate::quota::Quota;
use crate::reservations::ReservationTable;
use crate::session::{Session, SessionTable};
use crate::sharing::SharedTable;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime};
use uuid::Uuid;

/// The session being ended, as it was: its leases end after it left the table.
#[derive(Debug)]
struct EndingSession {
    id: Uuid,
    pid: Option<u32>,
    start: Option<u64>,
    place: Option<Arc<crate::process_place::Place>>,
}

/// Memory of an ended lease that a live process may still map.
#[derive(Debug)]
pub struct Quarantined {
    pub tenant: String,
    pub device: u32,
    pub block: Block,
    pub pid: Option<u32>,
    /// When `pid` started (its session's peer start, taken when the quarantine was made):
    /// a restarted or relinked keeper's record carries it, so a later reuse of the pid is
    /// never taken for the holder.
    pub pid_start: Option<u64>,
    /// Where `pid` runs (its session's record): the block keeps it when lifted.
    pub place: Option<Arc<crate::process_place::Place>>,
    pub since: Instant,
    /// Freed, never cached, when lifted: the block was published (or its memfd sealed
    /// for a publish), so others may hold its descriptor.
    pub destroy: bool,
    /// Retained mapped by its holder's process on purpose (`retained.rs`): this session
    /// (of that process) is granted it again with no ticket.
    pub retained_by: Option<Uuid>,
    /// Its process was asked to let go of it (`SessionEvent::DropRetained`, once).
    pub asked_back: bool,
}

/// The time of the lock hold a transition runs in, on the monotonic and the wall clock:
/// read by the shell when it takes the lock (`Arbiter::lock`, [`State::set_clock`]). The
/// core reads no clock of its own; what it stamps (a lease's or a reservation's creation,
/// when memory was quarantined or held) carries this time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Clock {
    pub now: Instant,
    pub wall: SystemTime,
}

#[cfg(test)]
impl Clock {
    /// Both clocks, now (the core's tests start their cores with it).
    pub fn read() -> Clock {
        Clock {
            now: Instant::now(),
            wall: SystemTime::now(),
        }
    }
}

/// Everything behind the arbiter's lock.
pub struct State {
    ledger: Ledger,
    pools: Vec<Pool>,
    /// Per device: is it the host simulation (a surviving mapping of a destroyed block
    /// reaches nobody, so abandoned memory of an unknown pid is freed, not quarantined).
    host_backed: Vec<bool>,
    leases: LeaseTable,
    sessions: SessionTable,
    queue: WaitQueue,
    quarantine: IdMap<Uuid, Quarantined>,
    /// Memory freed on a device that processes outside the broker kept (`stranded.rs`).
    stranded: IdMap<Uuid, Stranded>,
    /// The quarantined blocks each session's process retained (`retained.rs`), by the
    /// session: a lease request finds its own without a scan, one that has none at once.
    retained: IdMap<Uuid, crate::id_map::IdSet<Uuid>>,
    seq: u64,
    /// Shared read-only leases and the blocks held for their importers (`sharing.rs`).
    shared: SharedTable,
    /// Held blocks of ended leases whose fd recipients the shell has yet to look at
    /// (`shared.rs`); each is in `shared.held`.
    unchecked: IdMap<Uuid, shared::Unchecked>,
    /// Live leases a publish is sealing (or sealed) with no lock held (`shared.rs`): when
    /// they end, their block is freed, never cached.
    sealing: crate::id_map::IdSet<Uuid>,
    /// Process reservations (`reservations.rs`).
    reservations: ReservationTable,
    /// What the transitions under the current lock asked for (`effects.rs`); taken and run
    /// by the lock guard when it drops. Only the core's transitions push onto it.
    fx: Effects,
    /// A transition in this hold gave memory back or changed what fits (a release, a
    /// session's end, a quota, a device reopened): the shell's lock guard runs the queue
    /// before it lets go of the lock ([`State::take_queue_due`]), so no caller can forget.
    queue_due: bool,
    /// Host-fallback leases charged in the ledger whose memory is being made (bytes,
    /// count per tenant): the invariant counts them with the host leases.
    host_pending: HashMap<String, (u64, u32)>,
    /// The shell's look at a host memfd's seals (`shared.rs`): the core asks, never reads.
    seals: SealCheck,
    /// The current hold's time (set by the shell when it takes the lock).
    clock: Clock,
    /// Keeps the version-7 ids the core makes (process reservations) in the order they
    /// were made, also within one millisecond.
    ids: uuid::ContextV7,
    /// A keeper holds sessions and leases across restarts: their changes are pushed as
    /// `Effect::Keep`.
    keeping: bool,
    /// The session `end_session` is ending (it left the table first), its peer pid and
    /// that process's start time: what its leases' quarantines record.
    ending_session: Option<EndingSession>,
}

impl State {
    /// A core over these device pools (`host_backed`: which are the host simulation),
    /// asking `seals` whether a host memfd is still as it was made; its clock starts at
    /// `clock`.
    pub fn new(pools: Vec<Pool>, host_backed: Vec<bool>, seals: SealCheck, clock: Clock) -> State {
        State {
            ledger: Ledger::default(),
            pools,
            host_backed,
            leases: LeaseTable::default(),
            sessions: SessionTable::default(),
            queue: WaitQueue::default(),
            quarantine: IdMap::default(),
            stranded: IdMap::default(),
            retained: IdMap::default(),
            seq: 0,
            shared: SharedTable::default(),
            unchecked: IdMap::default(),
            sealing: Default::default(),
            reservations: ReservationTable::default(),
            fx: Effects::default(),
            queue_due: false,
            host_pending: HashMap::new(),
            seals,
            clock,
            ids: uuid::ContextV7::new(),
            keeping: false,
            ending_session: None,
        }
    }

    /// From now on every session's and lease's start and end is pushed for the keeper.
    pub fn set_keeping(&mut self, keeping: bool) {
        self.keeping = keeping;
    }

    /// Pushes a change for the keeper, when there is one.
    fn keep(&mut self, k: impl FnOnce() -> crate::effects::Keep) {
        if self.keeping {
            self.fx.push(crate::effects::Effect::Keep { change: k() });
        }
    }

    /// When process `pid` of session `session` started, as the session recorded it (an
    /// open session, or the one being ended); None for another pid or an unknown start.
    fn start_of(&self, session: Uuid, pid: Option<u32>) -> Option<u64> {
        let pid = pid?;
        match self.sessions.get(&session) {
            Some(s) => s.peer_start.filter(|_| s.peer.pid == Some(pid)),
            None => self
                .ending_session
                .as_ref()
                .filter(|e| e.id == session && e.pid == Some(pid))
                .and_then(|e| e.start),
        }
    }

    /// Where process `pid` runs, when it is session `session`'s peer (or the ending one's).
    fn place_of(
        &self,
        session: Uuid,
        pid: Option<u32>,
    ) -> Option<Arc<crate::process_place::Place>> {
        let pid = pid?;
        match self.sessions.get(&session) {
            Some(s) => s.place.clone().filter(|_| s.peer.pid == Some(pid)),
            None => self
                .ending_session
                .as_ref()
                .filter(|e| e.id == session && e.pid == Some(pid))
                .and_then(|e| e.place.clone()),
        }
    }

    /// The time of the hold that begins: the shell's reading of both clocks when it took
    /// the lock. Every transition in the hold stamps with it.
    pub fn set_clock(&mut self, clock: Clock) {
        self.clock = clock;
    }
    /// The current hold's time.
    pub fn clock(&self) -> Clock {
        self.clock
    }

    /// A fresh version-7 id stamped with the hold's wall clock, after every id made before.
    fn new_v7_id(&self) -> Uuid {
        let since = self
            .clock
            .wall
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let ts = uuid::Timestamp::from_unix(&self.ids, since.as_secs(), since.subsec_nanos());
        Uuid::new_v7(ts)
    }

    // Reading: every table, shared, never mutable from outside the core.

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }
    pub fn pools(&self) -> &[Pool] {
        &self.pools
    }
    pub fn leases(&self) -> &LeaseTable {
        &self.leases
    }
    pub fn sessions(&self) -> &SessionTable {
        &self.sessions
    }

    /// Session `id`'s peer runs at `place` (read by the shell for a session it took back
    /// after a restart, which came without one).
    pub fn place_peer(&mut self, id: Uuid, place: Arc<crate::process_place::Place>) {
        if let Some(s) = self.sessions.get_mut(&id) {
            if s.peer.pid == Some(place.pid) && s.place.is_none() {
                s.place = Some(place);
            }
        }
    }
    pub fn queue(&self) -> &WaitQueue {
        &self.queue
    }
    pub fn quarantine(&self) -> &IdMap<Uuid, Quarantined> {
        &self.quarantine
    }
    pub fn shared(&self) -> &SharedTable {
        &self.shared
    }
    pub fn reservations(&self) -> &ReservationTable {
        &self.reservations
    }
    /// Is device `d` the host simulation?
    pub fn host_backed(&self, d: u32) -> bool {
        self.host_backed.get(d as usize).copied().unwrap_or(true)
    }

    /// Whether a transition in this hold asked for the queue to run, clearing it: the
    /// lock guard asks before it lets go of the lock and then runs it
    /// ([`State::run_queue`], with what the shell reads for it).
    pub fn take_queue_due(&mut self) -> bool {
        std::mem::take(&mut self.queue_due)
    }

    /// Which devices admit grants changed (a drain began or ended, a device's health mark:
    /// the shell keeps which admit, and its lock guard calls this when it changes them):
    /// waiters may fit, or no device can serve them any more (the queue refuses those), so
    /// the queue runs after the hold.
    pub fn devices_changed(&mut self) {
        self.wake_queue();
    }

    /// A transition gave memory back or changed what fits: the queue runs after the hold.
    fn wake_queue(&mut self) {
        self.queue_due = true;
    }

    /// Did the transitions under the current lock push anything (the lock guard asks)?
    pub fn has_effects(&self) -> bool {
        !self.fx.is_empty()
    }
    /// What the transitions pushed, in order, taken by the lock guard to run them (and by
    /// the model test, which runs them itself). Only the core's transitions push effects.
    pub fn take_effects(&mut self) -> Effects {
        std::mem::take(&mut self.fx)
    }
    /// Pushes effects skipping the transitions: only for shell tests of how the lock
    /// guard runs what was pushed.
    #[cfg(any(test, feature = "testing"))]
    pub fn fx_behind_the_back(&mut self) -> &mut Effects {
        &mut self.fx
    }
    /// The ledger, mutable, skipping the transitions: only for the test that checks the
    /// invariant catches a hand-made mismatch.
    #[cfg(any(test, feature = "testing"))]
    pub fn ledger_behind_the_back(&mut self) -> &mut Ledger {
        &mut self.ledger
    }

    // Changes that move no bytes: the wait queue, session marks, a lease's reclaim
    // state (publications, imports and recipients: `shared.rs`).

    /// The wait queue, mutable, skipping the transitions (tests move waiters' clocks).
    #[cfg(any(test, feature = "testing"))]
    pub fn queue_mut(&mut self) -> &mut WaitQueue {
        &mut self.queue
    }
    /// Mark a lease's reclaim state (active, or asked back by a deadline).
    fn set_lease_state(&mut self, id: &Uuid, state: LeaseState) -> bool {
        let Some(l) = self.leases.get_mut(id) else {
            return false;
        };
        let was = std::mem::replace(&mut l.state, state);
        // A reclaim request's deadline is kept: a restart asks by the same one.
        match (was, state) {
            (_, LeaseState::ReclaimRequested { deadline_wall, .. }) if was != state => {
                let record = reclaim_record(*id, deadline_wall);
                self.keep(|| crate::effects::Keep::Reclaim(record));
            }
            (LeaseState::ReclaimRequested { .. }, LeaseState::Active) => {
                self.keep(|| crate::effects::Keep::ReclaimEnded(*id));
            }
            _ => {}
        }
        true
    }

    /// Asks the holder of lease `id` (just taken back at a restart) for it back again by
    /// `deadline_wall`, as the previous broker had asked (kept again, when keeping). False
    /// when there is no such lease; one asked already (by a drain taken back) is left as
    /// it is.
    pub fn adopt_reclaim(&mut self, id: Uuid, deadline_wall: std::time::SystemTime) -> bool {
        let left = deadline_wall
            .duration_since(self.clock.wall)
            .unwrap_or_default();
        let state = LeaseState::ReclaimRequested {
            deadline: self.clock.now + left,
            deadline_wall,
        };
        let Some(l) = self.leases.get(&id) else {
            return false;
        };
        if matches!(l.state, LeaseState::ReclaimRequested { .. }) {
            return true;
        }
        let (session, bytes) = (l.session, l.bytes());
        self.set_lease_state(&id, state);
        self.fx.notify(
            session,
            crate::session::SessionEvent::ReclaimRequested {
                lease_id: id,
                bytes,
                deadline: deadline_wall,
                reason: "asked again after a broker restart".into(),
            },
        );
        true
    }
    /// Mark what NVML says of a session's GPU use; false when there is no such session.
    /// (Its activity is marked through `Session::last_seen`, shared, with no lock.)
    pub fn set_session_gpu(&mut self, id: &Uuid, gpu: crate::session::GpuUse) -> bool {
        match self.sessions.get_mut(id) {
            Some(s) => {
                s.gpu = Some(gpu);
                true
            }
            None => false,
        }
    }

    // Transitions that move no bytes of a device.

    /// A session opens (it holds nothing yet); its peer process is watched. Refused when
    /// its tenant does not exist or is being deleted (`NotFound`), or already has
    /// `max_per_tenant` sessions open (`SessionLimit`); nothing changes then.
    pub fn open_session(&mut self, s: Session, max_per_tenant: usize) -> BrokerResult<()> {
        if self.ledger.get(&s.tenant).is_none() || self.ledger.is_closing(&s.tenant) {
            return Err(BrokerError::NotFound(Missing::TenantGone(s.tenant.clone())));
        }
        let open = self.sessions.count_of(&s.tenant);
        if open >= max_per_tenant {
            return Err(BrokerError::SessionLimit {
                tenant: s.tenant.clone(),
                open,
            });
        }
        if let Some(pid) = s.peer.pid {
            self.fx.watch(Watch::Session { session: s.id, pid });
        }
        self.keep(|| crate::effects::Keep::Session((&s).into()));
        self.sessions.insert(s);
        Ok(())
    }

    /// Sets a tenant's quota (creating it); true when it was created. A raised limit or a
    /// new guarantee may let waiters in, or call for reclaim: the queue runs after the hold.
    pub fn set_quota(&mut self, name: &str, quota: Quota) -> BrokerResult<bool> {
        let created = self.ledger.set_quota(name, quota)?;
        self.wake_queue();
        Ok(created)
    }
    /// Deletes a tenant that holds nothing.
    pub fn delete_tenant(&mut self, name: &str) -> BrokerResult<()> {
        self.ledger.delete(name)
    }
    /// A tenant being deleted takes no new charge.
    pub fn close_tenant(&mut self, name: &str) -> BrokerResult<()> {
        self.ledger.close(name)
    }
    /// Its deletion failed: it takes charges again.
    pub fn reopen_tenant(&mut self, name: &str) {
        self.ledger.reopen(name)
    }

    /// Device `d`'s leasable bytes change (memory outside the broker came or went); cached
    /// blocks beyond it are freed; the queue runs after the hold.
    pub fn set_leasable(&mut self, d: u32, leasable: u64) {
        let Some(pool) = self.pools.get_mut(d as usize) else {
            return;
        };
        self.queue_due = true;
        for b in pool.set_leasable(leasable) {
            self.fx.free(d, b);
        }
    }

    /// A host-fallback charge starts (`started`) or ends its flight (became a lease, or
    /// was uncharged).
    fn host_in_flight(&mut self, tenant: &str, bytes: u64, started: bool) {
        let e = self.host_pending.entry(tenant.to_string()).or_default();
        if started {
            e.0 += bytes;
            e.1 += 1;
        } else {
            e.0 -= bytes;
            e.1 -= 1;
            if e.1 == 0 {
                self.host_pending.remove(tenant);
            }
        }
    }

    /// Adds a lease to the table and its session (the caller charged it).
    fn insert_lease(&mut self, lease: Lease) -> LeaseView {
        if self.keeping {
            let k = self.lease_kept(&lease);
            self.keep(|| k);
        }
        self.insert_lease_kept(lease)
    }

    /// Lease `l`'s record, with the processes outside its session that fetched its
    /// descriptor, and a copy of its descriptor.
    fn lease_kept(&self, l: &Lease) -> crate::effects::Keep {
        let crate::memory::Handle::Fd { fd, .. } = &l.block.handle;
        let mut r: crate::kept::LeaseRecord = l.into();
        r.recipients = self.recipients_record(l.id);
        crate::effects::Keep::Lease(r, fd.clone())
    }

    /// Adds a lease the keeper already holds (adopted at start).
    fn insert_lease_kept(&mut self, lease: Lease) -> LeaseView {
        let view = self.view(&lease);
        if let Some(s) = self.sessions.get_mut(&lease.session) {
            s.held(lease.id);
        }
        self.leases.insert(lease);
        view
    }

    /// The next grant's sequence number (lease order).
    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// A lease's public view.
    pub fn view(&self, l: &Lease) -> LeaseView {
        let borrowed = self
            .ledger
            .get(&l.tenant)
            .is_some_and(|t| t.borrowed_bytes() > 0 && l.tier == Tier::Device);
        l.view(borrowed)
    }

    /// Gives cached blocks of device `d` back to the device, at least `bytes` of them
    /// (processes outside the broker ate into the headroom); how many blocks.
    pub fn evict_cached(&mut self, d: u32, bytes: u64) -> usize {
        let Some(pool) = self.pools.get_mut(d as usize) else {
            return 0;
        };
        let freed = pool.evict_bytes(bytes);
        let n = freed.len();
        for b in freed {
            self.fx.free(d, b);
        }
        n
    }

    /// Every byte in exactly one state, ledger and pools agreeing (checked after every
    /// transition in debug builds, and by the tests).
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    pub fn check_invariant(&self) -> Result<(), String> {
        #[derive(Default, PartialEq, Debug)]
        struct Sum {
            leased: u64,
            leases: u32,
            quarantined: u64,
            host: u64,
            host_leases: u32,
        }
        let mut by_device: Vec<Sum> = (0..self.pools.len()).map(|_| Sum::default()).collect();
        let mut by_tenant: HashMap<&str, Sum> = HashMap::new();
        for l in self.leases.iter() {
            if !l.live.is_live() {
                return Err(format!(
                    "lease {} is in the table with a cleared mark",
                    l.id
                ));
            }
            let t = by_tenant.entry(l.tenant.as_str()).or_default();
            match l.tier {
                Tier::Device => {
                    t.leased += l.bytes();
                    t.leases += 1;
                    let d = by_device
                        .get_mut(l.device as usize)
                        .ok_or_else(|| format!("lease {} on unknown device {}", l.id, l.device))?;
                    d.leased += l.bytes();
                    d.leases += 1;
                }
                Tier::Host => {
                    t.host += l.bytes();
                    t.host_leases += 1;
                }
            }
            match self.sessions.get(&l.session) {
                Some(s) if s.leases().contains(&l.id) => {}
                _ => return Err(format!("lease {} not listed by an open session", l.id)),
            }
        }
        for (t, (bytes, count)) in &self.host_pending {
            let t = by_tenant.entry(t.as_str()).or_default();
            t.host += bytes;
            t.host_leases += count;
        }
        // The retained index lists exactly the quarantined blocks retained, by session.
        let indexed: usize = self.retained.values().map(|ids| ids.len()).sum();
        let retained = self.quarantine.values().filter(|q| q.retained_by.is_some());
        if indexed != retained.count()
            || self.retained.iter().any(|(s, ids)| {
                ids.is_empty()
                    || ids
                        .iter()
                        .any(|id| self.quarantine.get(id).and_then(|q| q.retained_by) != Some(*s))
            })
        {
            return Err("the retained index disagrees with the quarantine".into());
        }
        // Quarantined: ended leases a live process may map, and blocks of ended shared
        // leases held for their importers (`sharing.rs`).
        let quarantined = self
            .quarantine
            .values()
            .map(|q| (q.tenant.as_str(), q.device, q.block.bytes()))
            .chain(
                self.shared
                    .held
                    .values()
                    .map(|h| (h.tenant.as_str(), h.device, h.block.bytes())),
            )
            .chain(
                self.stranded
                    .values()
                    .map(|s| (s.tenant.as_str(), s.device, s.bytes)),
            );
        for (tenant, device, bytes) in quarantined {
            by_tenant.entry(tenant).or_default().quarantined += bytes;
            if let Some(d) = by_device.get_mut(device as usize) {
                d.quarantined += bytes;
            }
        }
        for (i, (p, sum)) in self.pools.iter().zip(&by_device).enumerate() {
            let s = p.stats();
            let pool = Sum {
                leased: s.leased,
                leases: p.lease_count(),
                quarantined: s.quarantined,
                ..Sum::default()
            };
            if &pool != sum {
                return Err(format!(
                    "device {i}: pool says {pool:?}, leases and quarantine say {sum:?}"
                ));
            }
        }
        let mut reserved = 0u64;
        for t in self.ledger.tenants() {
            let u = &t.usage;
            reserved += u.reserved_bytes;
            let ledger = Sum {
                leased: u.held_bytes,
                leases: u.lease_count,
                quarantined: u.quarantined_bytes,
                host: u.host_held_bytes,
                host_leases: u.host_lease_count,
            };
            // Per device, the ledger counts what is reserved, held and quarantined there.
            let per_device: u64 = t.device_bytes.values().sum();
            if per_device != u.committed_bytes() {
                return Err(format!(
                    "tenant {:?}: its bytes per device add up to {per_device}, not {}",
                    t.name,
                    u.committed_bytes()
                ));
            }
            let sum = by_tenant.remove(t.name.as_str()).unwrap_or_default();
            if ledger != sum {
                return Err(format!(
                    "tenant {:?}: ledger says {ledger:?}, leases and quarantine say {sum:?}",
                    t.name
                ));
            }
        }
        if let Some((t, _)) = by_tenant.iter().find(|(_, s)| **s != Sum::default()) {
            return Err(format!(
                "tenant {t:?} holds memory but is not in the ledger"
            ));
        }
        let pooled: u64 = self.pools.iter().map(|p| p.stats().reserved).sum();
        if pooled != reserved {
            return Err(format!(
                "reserved: pools say {pooled}, ledger says {reserved}"
            ));
        }
        // Room kept for reserved processes (`reservations.rs`): the same in both.
        let in_pools: u64 = self.pools.iter().map(|p| p.stats().process_reserved).sum();
        let in_ledger: u64 = self
            .ledger
            .tenants()
            .map(|t| t.usage.process_reserved_bytes)
            .sum();
        if in_pools != in_ledger {
            return Err(format!(
                "process reservations: pools say {in_pools}, ledger says {in_ledger}"
            ));
        }
        if let Some(id) = self
            .unchecked
            .keys()
            .find(|id| !self.shared.held.contains_key(id))
        {
            return Err(format!(
                "lease {id} waits for a look at its recipients but is not held"
            ));
        }
        self.check_shared()?;
        self.leases.check_indexes()?;
        for s in self.sessions.iter() {
            if let Some(l) = s.leases().iter().find(|l| self.leases.get(l).is_none()) {
                return Err(format!(
                    "session {} lists lease {l}, which does not exist",
                    s.id
                ));
            }
        }
        Ok(())
    }
}

/// The record of a reclaim request of lease `id` due at `deadline_wall`.
pub(crate) fn reclaim_record(id: Uuid, deadline_wall: SystemTime) -> crate::kept::ReclaimRecord {
    crate::kept::ReclaimRecord {
        v: crate::kept::RECORD_VERSION,
        lease: id.to_string(),
        deadline_unix_ms: crate::kept::unix_ms(deadline_wall),
    }
}
