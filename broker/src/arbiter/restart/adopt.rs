//! The take-back at start: [`Restart::adopt_dumped`] reads what the keeper held (its
//! dump) and takes back the sessions whose peer process still lives (same pid and start
//! time) with their leases (same id, bytes, tenant, memory: the kept descriptor becomes the
//! block again); what belonged to processes that died meanwhile is dropped, so its memory
//! goes. The processes a kept block reached, and a lease's recipients outside its session,
//! come back with it while they live (read from `/proc` before the lock: [`Liveness`]).
//! Process reservations (`process.rs`), shared leases (`shared.rs`) and memory kept outside
//! the broker (`stranded.rs`) are taken back by their own steps; [`RestartReport`] says what
//! came back and where the start's time went.

use super::Restart;
use crate::keeper::records::{self, from_unix_ms, Kept, LeaseRecord, SessionRecord};
use crate::keeper::Place;
use crate::pool::Block;
use crate::session::{Peer, Session};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use uuid::Uuid;

/// What a start took back from the keeper.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestartReport {
    /// Records the keeper held.
    pub kept_records: usize,
    pub sessions_adopted: usize,
    pub sessions_reclaimed: usize,
    pub leases_adopted: usize,
    pub leases_reclaimed: usize,
    pub bytes_adopted: u64,
    /// Blocks of ended leases held for importers: taken back, and let go (no importer
    /// came back).
    pub held_adopted: usize,
    pub held_let_go: usize,
    /// Imports let go while processes that may map them live: taken back, and ended.
    pub lingering_adopted: usize,
    pub lingering_ended: usize,
    /// Charges of memory kept outside the broker after its free: charged again (and
    /// their bytes), and lifted (no holder lives).
    pub stranded_adopted: usize,
    pub stranded_bytes: u64,
    pub stranded_lifted: usize,
    /// Records this broker could not read (dropped).
    pub unreadable: usize,
    /// The start's wall time up to the last lease taken back and the kept drains: from
    /// the process's start when `main` timed the steps before the adoption, else from
    /// asking the keeper for its records. Steps that ran beside others (the keeper's dump
    /// while the devices opened, each device's take-back) are not added again.
    pub took: Duration,
    /// Where the start's time went, step by step: from the process's start (opening the
    /// store, the devices, loading the state), the adoption's steps, then the steps up to
    /// serving. The keeper's dump runs while the devices open, and the devices take their
    /// blocks back at once (`device N take-back`, inside `take-back`): those overlap.
    pub phases: Vec<Phase>,
}

/// One step of a start and how long it took.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Phase {
    pub name: String,
    pub took: Duration,
}

impl RestartReport {
    /// The phases in a line: `open devices 310 ms, keeper dump 120 ms, ...`.
    pub fn phases_line(&self) -> String {
        self.phases
            .iter()
            .map(|p| format!("{} {}", p.name, ms(p.took)))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Milliseconds with one decimal below 10 ms (`0.4 ms`, `12 ms`).
fn ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1000.0;
    if ms < 10.0 {
        format!("{ms:.1} ms")
    } else {
        format!("{ms:.0} ms")
    }
}

/// Times a restart's steps one after the other, and the wall time they cover.
struct Laps {
    last: Instant,
    phases: Vec<Phase>,
    /// The steps one after the other so far: those before, and each lap.
    wall: Duration,
}

impl Laps {
    /// Starting now, after the steps `before` (the process's start, timed by `main`: one
    /// after the other).
    fn new(before: Vec<Phase>) -> Laps {
        Laps {
            last: Instant::now(),
            wall: before.iter().map(|p| p.took).sum(),
            phases: before,
        }
    }

    /// The step that ends now, named `name`.
    fn lap(&mut self, name: &str) {
        let now = Instant::now();
        let took = now - self.last;
        self.push(name, took);
        self.wall += took;
        self.last = now;
    }

    /// A step timed elsewhere that ran beside the others (the dump while the devices
    /// opened, a device's job): shown, not added to the wall time.
    fn push(&mut self, name: impl Into<String>, took: Duration) {
        self.phases.push(Phase {
            name: name.into(),
            took,
        });
    }
}

/// Whether the processes named by kept records still live: each pid's start time read
/// once (`/proc/<pid>/stat`), however many records name it.
#[derive(Default)]
pub(super) struct Liveness(HashMap<u32, Option<u64>>);

impl Liveness {
    /// Is process `pid` the one that started at `start` (not a reused pid)?
    pub(super) fn is(&mut self, pid: u32, start: u64) -> bool {
        self.start_of(pid) == Some(start)
    }

    /// When process `pid` started (None: gone).
    fn start_of(&mut self, pid: u32) -> Option<u64> {
        *self
            .0
            .entry(pid)
            .or_insert_with(|| crate::process::start_ticks(pid))
    }

    /// Those of a lease's recorded recipients `kept` still alive ([`Liveness::alive`]),
    /// and pid 0 (a process of another pid namespace: undecidable, so counted alive, as
    /// before the restart).
    pub(super) fn recipients(
        &mut self,
        kept: &[records::ProcessRecord],
    ) -> std::collections::BTreeMap<u32, Option<u64>> {
        let undecided = kept.iter().filter(|p| p.pid == 0).map(|p| (0, p.start));
        let mut out: std::collections::BTreeMap<_, _> = undecided.collect();
        out.extend(self.alive(kept));
        out
    }

    /// Those of `kept` still alive: the same start time where the record has one, else
    /// a process of that pid (a reused pid then counts: held longer, never shorter).
    pub(super) fn alive(&mut self, kept: &[records::ProcessRecord]) -> Vec<(u32, Option<u64>)> {
        kept.iter()
            .filter(|p| match p.start {
                Some(start) => self.is(p.pid, start),
                None => self.start_of(p.pid).is_some(),
            })
            .map(|p| (p.pid, p.start))
            .collect()
    }
}

/// The leases whose quarantine or held block was kept with the block's descriptor: those
/// records are written before the lease's end, so a crash between leaves both, and the
/// block is the quarantine's or held block's, not the lease's.
fn leases_taken_over<'a>(
    quarantines: &'a KeptWithFd<records::QuarantineRecord>,
    helds: &'a KeptWithFd<records::HeldRecord>,
) -> HashSet<&'a str> {
    let quarantined = quarantines.iter().filter(|(_, fd)| fd.is_some());
    let held = helds.iter().filter(|(_, fd)| fd.is_some());
    quarantined
        .map(|(q, _)| q.lease.as_str())
        .chain(held.map(|(h, _)| h.lease.as_str()))
        .collect()
}

/// The processes of `kept` (those a block's descriptor reached, as its record names
/// them) that still live, each with where it runs now (`/proc`, read with no lock held),
/// so that its free checks for them as before the restart.
fn reached_again(kept: &[records::ReachedRecord], alive: &mut Liveness) -> crate::pool::Reached {
    let mut out = crate::pool::Reached::default();
    for k in kept {
        let p = records::ProcessRecord {
            pid: k.pid,
            start: k.start,
        };
        if alive.alive(std::slice::from_ref(&p)).is_empty() {
            continue;
        }
        let place = crate::kept_holders::read_place(k.pid)
            .filter(|now| k.start.is_none_or(|s| now.start == Some(s)))
            .map(Arc::new);
        match &k.tenant {
            Some(t) => out.add_of(k.pid, t, place),
            None => out.add(k.pid, place),
        };
    }
    out
}

/// Records not taken back, counted by kind and reason: logged as one line each (a
/// restart after a crash may reclaim thousands).
#[derive(Default)]
struct Tally(BTreeMap<(&'static str, &'static str), (usize, u64)>);

impl Tally {
    fn add(&mut self, what: &'static str, why: &'static str, bytes: u64) {
        let e = self.0.entry((what, why)).or_default();
        e.0 += 1;
        e.1 += bytes;
    }

    fn log(&self) {
        for ((what, why), (count, bytes)) in &self.0 {
            tracing::info!(count, bytes, why, "{what}");
        }
    }
}

/// A kept block to make again on its device from its descriptor.
struct KeptBlock {
    /// Its device's index, or the host tier's slot after them ([`Restart::host_slot`]).
    device: u32,
    fd: OwnedFd,
    bytes: u64,
    block_id: u64,
}

impl KeptBlock {
    fn new(device: u32, fd: OwnedFd, bytes: u64, block_id: u64) -> KeptBlock {
        KeptBlock {
            device,
            fd,
            bytes,
            block_id,
        }
    }
}

/// What [`Restart::adopt_blocks`] took back (session, lease, bytes) and what it did not.
#[derive(Default)]
struct TakenBack {
    leases: Vec<(Uuid, Uuid, u64)>,
    leases_refused: Vec<(LeaseRecord, &'static str)>,
    quarantines_refused: Vec<(records::QuarantineRecord, &'static str)>,
    /// Held blocks taken back (their publications and imports come next).
    held: Vec<records::HeldRecord>,
    held_refused: Vec<(records::HeldRecord, &'static str)>,
}

/// Kept memory of one block: a lease's, a quarantine's, or a held block's.
type KeptWithFd<R> = Vec<(R, Option<OwnedFd>)>;

/// Kept session `r` as a session again, when its peer process is the one that opened it.
fn session_of(r: &SessionRecord, alive: &mut Liveness) -> Result<Session, &'static str> {
    let id: Uuid = r.id.parse().map_err(|_| "unreadable id")?;
    let (Some(pid), Some(start)) = (r.pid, r.pid_start) else {
        return Err("its process is unknown (not a Unix socket peer)");
    };
    if !alive.is(pid, start) {
        return Err("its process is gone");
    }
    let peer = Peer {
        pid: r.pid,
        uid: r.uid,
        unix: r.unix,
    };
    let mut s = Session::new(id, &r.tenant, &r.name, peer, r.token_id.clone());
    s.opened = from_unix_ms(r.opened_unix_ms);
    s.resume_hash = r.resume_hash.clone();
    s.peer_start = r.pid_start;
    Ok(s)
}

impl Restart<'_> {
    /// Drains the device of kept drain `r` again, as the previous broker had it: same
    /// reason and start, the same deadline (wall clock) for its reclaimable holders, asked
    /// again; a deadline that passed meanwhile gives them the usual reclaim deadline.
    fn drain_again(&self, mut r: records::DrainRecord) {
        // A drain whose device moved had its old key removed by the caller; it is kept
        // again under its device's index now (below), or dropped.
        let device = self
            .arb
            .devices
            .named_by(r.device, r.device_uuid.as_deref());
        let Some(device) = device else {
            tracing::warn!(
                device = r.device,
                uuid = ?r.device_uuid,
                "a kept drain names no device of this broker: dropped"
            );
            return;
        };
        r.device = device;
        let left = r.deadline_unix_ms.and_then(|ms| {
            from_unix_ms(ms)
                .duration_since(SystemTime::now())
                .ok()
                .filter(|d| !d.is_zero())
        });
        match self.arb.drains().start(Some(r.device), left, &r.reason) {
            Ok(_) => {
                // Bookkeeping only (the start it had): which devices admit is unchanged.
                self.arb.lock().change_devices(|avail| {
                    if let Some(Some(d)) = avail.device_mut(r.device).map(|s| s.drain.as_mut()) {
                        d.since = from_unix_ms(r.since_unix_ms);
                        self.keep_drain(r.device, Some(d));
                    }
                    None::<()>
                });
                tracing::warn!(device = r.device, reason = %r.reason, ?left, "kept drain taken back: the device stays closed");
            }
            Err(e) => {
                tracing::warn!(device = r.device, error = %e, "a kept drain could not be taken back")
            }
        }
    }

    /// Takes back what `link` holds (a keeper or systemd's fd store; before serving), then
    /// sends it every change from now on. See the module documentation.
    #[cfg(test)]
    pub(in crate::arbiter) fn adopt_from_keeper(
        &self,
        link: impl Place + 'static,
    ) -> Result<RestartReport, crate::keeper::KeeperError> {
        let dumped = crate::keeper::place::dump(link)?;
        Ok(self.adopt_dumped(dumped, Vec::new()))
    }

    /// Takes back what a place handed back (its dump, made by [`crate::keeper::place::dump`]
    /// while the devices opened, or just now), then sends it every change from now on.
    /// `before`: the start's steps before this (`startup.rs`), first in the report.
    pub fn adopt_dumped<P: Place + 'static>(
        &self,
        dumped: crate::keeper::place::Dumped<P>,
        before: Vec<Phase>,
    ) -> RestartReport {
        let crate::keeper::place::Dumped {
            place: link,
            entries,
            took: dump_took,
        } = dumped;
        // The dump ran beside the steps before (the devices opening); without them, it
        // was this start's first step.
        let dump_first = before.is_empty();
        let mut laps = Laps::new(before);
        laps.push("keeper dump", dump_took);
        if dump_first {
            laps.wall += dump_took;
        }
        let mut report = RestartReport {
            kept_records: entries.len(),
            ..RestartReport::default()
        };
        let mut sessions = Vec::new();
        let mut leases: Vec<(LeaseRecord, Option<OwnedFd>)> = Vec::new();
        let mut drains = Vec::new();
        let mut quarantines: Vec<(records::QuarantineRecord, Option<OwnedFd>)> = Vec::new();
        let mut publications = Vec::new();
        let mut imports = Vec::new();
        let mut reservations = Vec::new();
        let mut reclaims = Vec::new();
        let mut helds: KeptWithFd<records::HeldRecord> = Vec::new();
        let mut lingerings = Vec::new();
        let mut strandeds = Vec::new();
        for e in entries {
            match records::parse(&e.key, e.record) {
                Ok(Kept::Session(s)) => sessions.push(s),
                Ok(Kept::Lease(l)) => leases.push((l, e.fd)),
                Ok(Kept::Drain(d)) => drains.push(d),
                Ok(Kept::Quarantine(q)) => quarantines.push((q, e.fd)),
                Ok(Kept::Publication(p)) => publications.push(p),
                Ok(Kept::Import(i)) => imports.push(i),
                Ok(Kept::Reservation(r)) => reservations.push(r),
                Ok(Kept::Reclaim(r)) => reclaims.push(r),
                Ok(Kept::Held(h)) => helds.push((h, e.fd)),
                Ok(Kept::Lingering(l)) => lingerings.push(l),
                Ok(Kept::Stranded(s)) => strandeds.push(s),
                Err(err) => {
                    tracing::warn!(error = %err, "dropping a kept record");
                    report.unreadable += 1;
                    link.remove(e.key);
                }
            }
        }
        // Memory and drains go to the device that has their UUID now, wherever it is.
        let mut device_gone = Vec::new();
        leases.retain_mut(|(r, _)| {
            // The host tier is no device: its leases go to this broker's host tier.
            let device = match r.tier.as_str() {
                "host" => Some(r.device),
                _ => self
                    .arb
                    .devices
                    .named_by(r.device, r.device_uuid.as_deref()),
            };
            match device {
                Some(d) => {
                    r.device = d;
                    true
                }
                None => {
                    device_gone.push(r.clone());
                    false
                }
            }
        });
        let (quarantines, quarantine_device_gone) =
            self.arb.devices.renumber(quarantines, |(q, _)| {
                (&mut q.device, q.device_uuid.as_deref())
            });
        let (helds, held_device_gone) = self
            .arb
            .devices
            .renumber(helds, |(h, _)| (&mut h.device, h.device_uuid.as_deref()));
        let (strandeds, stranded_device_gone) = self
            .arb
            .devices
            .renumber(strandeds, |s| (&mut s.device, s.device_uuid.as_deref()));
        let (reservations, reservation_device_gone) = self
            .arb
            .devices
            .renumber(reservations, |r| (&mut r.device, r.device_uuid.as_deref()));
        laps.lap("parse");
        let mut alive = Liveness::default();
        let (adopted, refused_sessions) = self.adopt_sessions(sessions, &mut alive);
        report.sessions_adopted = adopted.len();
        let mut tally = Tally::default();
        for (r, why) in refused_sessions {
            tracing::debug!(session = %r.id, tenant = %r.tenant, pid = ?r.pid, why, "kept session not taken back");
            tally.add("kept sessions not taken back", why, 0);
            report.sessions_reclaimed += 1;
            link.remove(r.key());
        }
        // Before the leases: a lease drawn from one is drawn from it again.
        for (r, why) in self.adopt_reservations(reservations) {
            tally.add("kept reservations not taken back", why, r.bytes);
            link.remove(r.key());
        }
        if !reservation_device_gone.is_empty() {
            let mut st = self.arb.lock();
            for r in &reservation_device_gone {
                st.reservation_not_kept(super::process::group_of(r));
            }
        }
        for r in reservation_device_gone {
            tally.add("kept reservations not taken back", "its device is gone", 0);
            link.remove(r.key());
        }
        laps.lap("sessions");
        // Memory kept outside the broker whose holders live: charged again below.
        let mut stranded_lifted = Vec::new();
        let mut stranded_ready = Vec::new();
        for r in strandeds {
            match super::stranded::adoptable(&r, &mut alive) {
                Ok(a) => stranded_ready.push((r, a)),
                Err(why) => stranded_lifted.push((r, why)),
            }
        }
        // Charged again before the count below: only a charge taken back is the broker's
        // (one whose tenant is gone stays outside memory).
        let mut stranded = self.adopt_stranded(stranded_ready);
        // Kept device memory, leases' and quarantines' alike (with their descriptors), and
        // what processes keep of it outside the broker (charged again, so the broker's).
        // A lease whose quarantine or held block has its descriptor too (a crash between
        // their writes) is one block: counted once, with the record that keeps it.
        let taken_over = leases_taken_over(&quarantines, &helds);
        let kept = leases
            .iter()
            .filter(|(r, fd)| {
                fd.is_some() && r.tier == "device" && !taken_over.contains(r.id.as_str())
            })
            .map(|(r, _)| (r.device, r.bytes))
            .chain(
                quarantines
                    .iter()
                    .filter(|(_, fd)| fd.is_some())
                    .map(|(q, _)| (q.device, q.bytes)),
            )
            .chain(
                helds
                    .iter()
                    .filter(|(_, fd)| fd.is_some())
                    .map(|(h, _)| (h.device, h.bytes)),
            )
            .chain(stranded.charged.iter().copied())
            .collect::<Vec<_>>();
        drop(taken_over);
        self.count_kept_memory_as_ours(&kept);
        let mut taken =
            self.adopt_blocks(leases, quarantines, helds, &adopted, &mut alive, &mut laps);
        taken.held_refused.extend(
            held_device_gone
                .into_iter()
                .map(|(h, _)| (h, "its device is gone")),
        );
        for (h, why) in std::mem::take(&mut taken.held_refused) {
            tracing::debug!(lease = %h.lease, tenant = %h.tenant, bytes = h.bytes, why, "kept held block let go");
            tally.add("kept blocks held for importers let go", why, h.bytes);
            report.held_let_go += 1;
            link.remove(h.key());
        }
        taken
            .leases_refused
            .extend(device_gone.into_iter().map(|r| (r, "its device is gone")));
        taken.quarantines_refused.extend(
            quarantine_device_gone
                .into_iter()
                .map(|(q, _)| (q, "its device is gone")),
        );
        for (r, why) in taken.leases_refused {
            tracing::debug!(lease = %r.id, session = %r.session, tenant = %r.tenant, bytes = r.bytes, why, "kept lease reclaimed");
            tally.add("kept leases reclaimed", why, r.bytes);
            report.leases_reclaimed += 1;
            link.remove(r.key());
        }
        for (q, why) in taken.quarantines_refused {
            tracing::debug!(lease = %q.lease, tenant = %q.tenant, bytes = q.bytes, pid = ?q.pid, why, "kept quarantine let go");
            tally.add("kept quarantines let go", why, q.bytes);
            link.remove(q.key());
        }
        let held = std::mem::take(&mut taken.held);
        report.held_adopted = held.len();
        report.lingering_adopted = lingerings.len();
        for (key, why) in self.adopt_shared(publications, held, lingerings, imports, &mut alive) {
            if key.starts_with(records::HELD_PREFIX) {
                report.held_adopted -= 1;
                report.held_let_go += 1;
            } else if key.starts_with(records::LINGERING_PREFIX) {
                report.lingering_adopted -= 1;
                report.lingering_ended += 1;
            }
            tally.add("kept publications and imports not taken back", why, 0);
            link.remove(key);
        }
        laps.lap("shared leases");
        stranded.lifted.extend(stranded_lifted);
        report.stranded_adopted = stranded.adopted;
        report.stranded_bytes = stranded.bytes;
        stranded.lifted.extend(
            stranded_device_gone
                .into_iter()
                .map(|s| (s, "its device is gone")),
        );
        for (s, why) in std::mem::take(&mut stranded.lifted) {
            tracing::debug!(id = %s.id, tenant = %s.tenant, bytes = s.bytes, why, "kept charge of memory kept outside the broker lifted");
            tally.add(
                "kept charges of memory kept outside the broker lifted",
                why,
                s.bytes,
            );
            report.stranded_lifted += 1;
            link.remove(s.key());
        }
        laps.lap("stranded memory");

        tally.log();
        let mut waiting = self.state.awaiting_resume.lock();
        for (session, lease, bytes) in taken.leases {
            report.leases_adopted += 1;
            report.bytes_adopted += bytes;
            waiting.entry(session).or_default().push(lease);
        }
        drop(waiting);
        // From here every change is kept: nothing else runs before serving.
        let place = link.describe();
        let comes_back = link.as_keeper().is_some();
        let _ = self.state.keeper.set(Arc::new(link));
        self.arb.lock().set_keeping(true);
        if comes_back {
            self.spawn_relink();
        }
        laps.lap("keeper re-armed");
        // Every moved drain's old key goes first: two drained devices that swapped indexes
        // would otherwise each remove the key the other just wrote.
        for d in &drains {
            if self
                .arb
                .devices
                .named_by(d.device, d.device_uuid.as_deref())
                != Some(d.device)
            {
                if let Some(link) = self.state.keeper.get() {
                    link.remove(d.key());
                }
            }
        }
        for d in drains {
            self.drain_again(d);
        }
        laps.lap("drains");
        // After the drains: a lease a drain asks back again keeps the drain's deadline.
        let mut dropped = 0;
        for r in reclaims {
            if !self.ask_again(&r) {
                dropped += 1;
                if let Some(link) = self.state.keeper.get() {
                    link.remove(r.key());
                }
            }
        }
        if dropped > 0 {
            tracing::info!(
                count = dropped,
                "kept reclaim requests of leases not taken back dropped"
            );
        }
        report.took = laps.wall;
        report.phases = laps.phases;
        self.arb.metrics.count_restart(
            (report.sessions_adopted, report.sessions_reclaimed),
            (report.leases_adopted, report.leases_reclaimed),
        );
        self.arb.metrics.count_restart_kept(
            (report.held_adopted, report.held_let_go),
            (report.lingering_adopted, report.lingering_ended),
            (report.stranded_adopted, report.stranded_lifted),
        );
        tracing::info!(
            records = report.kept_records,
            sessions_adopted = report.sessions_adopted,
            sessions_reclaimed = report.sessions_reclaimed,
            leases_adopted = report.leases_adopted,
            leases_reclaimed = report.leases_reclaimed,
            bytes_adopted = report.bytes_adopted,
            held_adopted = report.held_adopted,
            lingering_adopted = report.lingering_adopted,
            stranded_adopted = report.stranded_adopted,
            unreadable = report.unreadable,
            took = ?report.took,
            phases = %report.phases_line(),
            %place,
            "took back what the keeper held"
        );
        *self.state.report.lock() = Some(report.clone());
        report
    }

    /// Asks the holder of the lease of kept reclaim request `r` again, by the same
    /// deadline (one that passed during the outage: the usual reclaim deadline from now).
    /// False when that lease was not taken back.
    fn ask_again(&self, r: &records::ReclaimRecord) -> bool {
        let Ok(lease) = r.lease.parse::<Uuid>() else {
            return false;
        };
        let now = SystemTime::now();
        let deadline = Some(from_unix_ms(r.deadline_unix_ms))
            .filter(|d| *d > now)
            .unwrap_or(now + self.arb.cfg.reclaim_deadline);
        self.arb.lock().adopt_reclaim(lease, deadline)
    }

    /// Opens the kept sessions `records` again whose peer process is the one that opened
    /// them (one lock hold for all): their ids, and those not taken back with why.
    fn adopt_sessions(
        &self,
        records: Vec<SessionRecord>,
        alive: &mut Liveness,
    ) -> (HashSet<Uuid>, Vec<(SessionRecord, &'static str)>) {
        let mut refused = Vec::new();
        let mut opened = Vec::new();
        for r in records {
            match session_of(&r, alive) {
                Ok(mut s) => {
                    // Where its peer runs, as a session opened now has it (set before the
                    // take-back by `main`).
                    s.place = self
                        .arb
                        .stranded()
                        .holders()
                        .zip(s.peer.pid)
                        .and_then(|(f, p)| f.place(p));
                    opened.push((r, s))
                }
                Err(why) => refused.push((r, why)),
            }
        }
        let mut adopted = HashSet::with_capacity(opened.len());
        let mut st = self.arb.lock();
        for (r, s) in opened {
            let id = s.id;
            match st.adopt_session(s) {
                Ok(()) => {
                    adopted.insert(id);
                }
                Err(_) => refused.push((r, "its tenant is gone")),
            }
        }
        drop(st);
        (adopted, refused)
    }

    /// Kept CUDA memory was in use when the devices opened, so their leasable bytes and
    /// the memory used outside the broker were read without it: it is the broker's (taken
    /// back now, or freed once the keeper's and our copies close), so each device's
    /// leasable amount grows by it and the outside measure stops counting it.
    fn count_kept_memory_as_ours(&self, kept_blocks: &[(u32, u64)]) {
        let mut kept = vec![0u64; self.arb.devices.len()];
        for &(d, bytes) in kept_blocks {
            let Some(slot) = self.arb.devices.get(d as usize) else {
                continue;
            };
            if slot.thread.desc().backend == crate::device::BackendKind::Cuda {
                kept[d as usize] = kept[d as usize].saturating_add(bytes);
            }
        }
        let mut st = self.arb.lock();
        for (d, bytes) in kept.into_iter().enumerate() {
            if bytes == 0 {
                continue;
            }
            let slot = &self.arb.devices[d];
            slot.taken_back
                .store(bytes, std::sync::atomic::Ordering::Relaxed);
            let gran = st.pools()[d].granularity();
            st.set_leasable(d as u32, slot.leasable_at_start() / gran * gran);
        }
    }

    /// Takes back the kept leases `leases` of the sessions taken back (`sessions`) and the
    /// kept quarantines `quarantines` whose process lives: their blocks made again by one
    /// job per device (all devices at once, [`Restart::take_back_blocks`]), then adopted
    /// in one lock hold. What was not taken back is returned with why.
    fn adopt_blocks(
        &self,
        leases: KeptWithFd<LeaseRecord>,
        quarantines: KeptWithFd<records::QuarantineRecord>,
        helds: KeptWithFd<records::HeldRecord>,
        sessions: &HashSet<Uuid>,
        alive: &mut Liveness,
        laps: &mut Laps,
    ) -> TakenBack {
        let mut out = TakenBack::default();
        let mut blocks = Vec::new();
        let mut lease_ids = Vec::new();
        // A lease whose quarantine or held block was kept ended: their records are written
        // before the lease's end is, so a crash between leaves both, and the end wins (in
        // systemd's fd store the descriptor has moved to it already).
        let ended = leases_taken_over(&quarantines, &helds);
        let (leases, ended_leases): (Vec<_>, Vec<_>) = leases
            .into_iter()
            .partition(|(r, _)| !ended.contains(r.id.as_str()));
        drop(ended);
        out.leases_refused.extend(
            ended_leases
                .into_iter()
                .map(|(r, _)| (r, "its end was kept")),
        );
        for (r, fd) in leases {
            match self.adoptable(&r, fd, sessions) {
                Ok((id, session, fd)) => {
                    let slot = match r.tier.as_str() {
                        "host" => self.host_slot(),
                        _ => r.device,
                    };
                    blocks.push(KeptBlock::new(slot, fd, r.bytes, r.block_id));
                    // Read here, with no lock held: which of them still live.
                    let recipients = alive.recipients(&r.recipients);
                    let reached = reached_again(&r.reached, alive);
                    lease_ids.push((r, id, session, recipients, reached));
                }
                Err(why) => out.leases_refused.push((r, why)),
            }
        }
        // A block is made once. A retained block leased again has its quarantine's record
        // removed after the lease's is written: a crash between leaves both, and the lease
        // wins; of two quarantines of one block (written by a broker that did not remove
        // it), one is taken.
        let mut taken: HashSet<(u32, u64)> = lease_ids
            .iter()
            .filter(|(r, ..)| r.tier != "host")
            .map(|(r, ..)| (r.device, r.block_id))
            .collect();
        let mut quarantine_ids = Vec::new();
        for (q, fd) in quarantines {
            if taken.contains(&(q.device, q.block_id)) {
                out.quarantines_refused
                    .push((q, "another kept record holds its block"));
                continue;
            }
            match self.adoptable_quarantine(&q, fd, alive) {
                Ok((lease, pid, fd)) => {
                    taken.insert((q.device, q.block_id));
                    blocks.push(KeptBlock::new(q.device, fd, q.bytes, q.block_id));
                    let reached = reached_again(&q.reached, alive);
                    quarantine_ids.push((q, lease, pid, reached));
                }
                Err(why) => out.quarantines_refused.push((q, why)),
            }
        }
        let mut held_ids = Vec::new();
        for (h, fd) in helds {
            // A held block whose quarantine was kept too (a crash between the quarantine's
            // record and the held block's let-go) is that quarantine's: one block, made
            // once (freeing a second copy would revoke the memory under the first).
            if quarantine_ids.iter().any(|(q, ..)| q.lease == h.lease) {
                out.held_refused.push((h, "its quarantine was kept"));
                continue;
            }
            match self.adoptable_held(&h, fd, alive) {
                Ok((a, fd)) => {
                    blocks.push(KeptBlock::new(h.device, fd, h.bytes, h.block_id));
                    let reached = reached_again(&h.reached, alive);
                    held_ids.push((h, a, reached));
                }
                Err(why) => out.held_refused.push((h, why)),
            }
        }
        laps.lap("liveness and descriptor checks");
        let (made, device_times) = self.take_back_blocks(blocks);
        for (d, took) in device_times {
            match d == self.host_slot() {
                true => laps.push("host tier take-back", took),
                false => laps.push(format!("device {d} take-back"), took),
            }
        }
        laps.lap("take-back");
        let mut made = made.into_iter();
        let mut unneeded = Vec::new();
        let mut st = self.arb.lock();
        for (r, id, session, recipients, reached) in lease_ids {
            let Some(Some((alloc, handle))) = made.next() else {
                out.leases_refused
                    .push((r, "the device refused its memory"));
                continue;
            };
            let block = Block {
                alloc,
                handle,
                last_tenant: Some(r.tenant.clone()),
                reached,
            };
            let a = crate::arbiter::state::Adopted {
                id,
                tenant: r.tenant.clone(),
                session,
                device: r.device,
                requested_bytes: r.requested_bytes,
                label: r.label.clone(),
                reclaimable: r.reclaimable,
                created: from_unix_ms(r.created_unix_ms),
                priority: r.priority,
                reservation: r.reservation.as_deref().and_then(|s| s.parse().ok()),
                recipients,
            };
            let (slot, adopted) = match r.tier.as_str() {
                "host" => (self.host_slot(), st.adopt_host_lease(a, block)),
                _ => (r.device, st.adopt_lease(a, block)),
            };
            match adopted {
                Ok(_) => out.leases.push((session, id, r.bytes)),
                Err((why, block)) => {
                    tracing::debug!(?why, "kept lease not taken back");
                    unneeded.push((slot, block));
                    out.leases_refused
                        .push((r, "its session or tenant is gone"));
                }
            }
        }
        for (q, lease, pid, reached) in quarantine_ids {
            let Some(Some((alloc, handle))) = made.next() else {
                out.quarantines_refused
                    .push((q, "the device refused its memory"));
                continue;
            };
            let block = Block {
                alloc,
                handle,
                last_tenant: Some(q.tenant.clone()),
                // Its process is added when the quarantine lifts; earlier ones that live
                // may keep it too.
                reached,
            };
            let a = crate::arbiter::state::AdoptedQuarantine {
                lease,
                tenant: q.tenant.clone(),
                device: q.device,
                pid: Some(pid),
                pid_start: q.pid_start,
                destroy: q.destroy,
                retained_by: q
                    .retained_by
                    .as_deref()
                    .and_then(|s| uuid::Uuid::parse_str(s).ok()),
            };
            if let Err((_, block)) = st.adopt_quarantine(a, block) {
                unneeded.push((q.device, block));
                out.quarantines_refused.push((q, "its tenant is gone"));
            }
        }
        for (h, a, reached) in held_ids {
            let Some(Some((alloc, handle))) = made.next() else {
                out.held_refused.push((h, "the device refused its memory"));
                continue;
            };
            let block = Block {
                alloc,
                handle,
                last_tenant: Some(h.tenant.clone()),
                // Freed once every importer let go; processes it reached before that
                // live may keep it.
                reached,
            };
            match st.adopt_held(a, block) {
                Ok(()) => out.held.push(h),
                Err((_, block)) => {
                    unneeded.push((h.device, block));
                    out.held_refused.push((h, "its tenant is gone"));
                }
            }
        }
        drop(st);
        // Nobody counted maps them: their holders' sessions are gone.
        for (d, block) in unneeded {
            self.free_in_slot(d, block);
        }
        laps.lap("adopt under the lock");
        out
    }

    /// Makes the kept blocks `blocks` again from their descriptors: one job per device,
    /// queued on every device thread before any is waited for (so the devices work at
    /// once). Each block's allocation and handle, or None (its descriptor given back to
    /// the budget, what was made of it freed), in order; and each device's job time.
    #[allow(clippy::type_complexity)]
    fn take_back_blocks(
        &self,
        blocks: Vec<KeptBlock>,
    ) -> (
        Vec<Option<(crate::device::Allocation, crate::device::Handle)>>,
        Vec<(u32, Duration)>,
    ) {
        let n = blocks.len();
        // One slot per device, and the host tier's after them.
        let mut per_device: Vec<Vec<(usize, KeptBlock)>> =
            (0..=self.arb.devices.len()).map(|_| Vec::new()).collect();
        for (i, b) in blocks.into_iter().enumerate() {
            // `adoptable` checked the device.
            per_device[b.device as usize].push((i, b));
        }
        let mut queued = Vec::new();
        for (d, batch) in per_device.into_iter().enumerate() {
            if batch.is_empty() {
                continue;
            }
            let (order, batch): (Vec<usize>, Vec<KeptBlock>) = batch.into_iter().unzip();
            let (tx, rx) = std::sync::mpsc::channel();
            let thread = match self.arb.devices.get(d) {
                Some(slot) => Some(&slot.thread),
                None => self.arb.host_tier.as_ref(),
            };
            let Some(thread) = thread else { continue };
            let submitted = thread.submit(move |dev| {
                let t = Instant::now();
                let made = batch
                    .into_iter()
                    .map(|b| {
                        let alloc = dev.adopt(b.fd, b.bytes, b.block_id)?;
                        let handle = dev.export(&alloc);
                        Ok::<_, crate::device::DeviceError>((alloc, handle))
                    })
                    .collect::<Vec<_>>();
                let _ = tx.send((made, t.elapsed()));
            });
            queued.push((d as u32, order, submitted.ok().map(|()| rx)));
        }
        let mut out: Vec<Option<_>> = (0..n).map(|_| None).collect();
        let mut times = Vec::new();
        for (d, order, rx) in queued {
            let Some((made, took)) = rx.and_then(|rx| rx.recv().ok()) else {
                tracing::warn!(
                    device = d,
                    blocks = order.len(),
                    "kept memory could not be taken back: the device thread is gone"
                );
                for _ in &order {
                    self.arb.fds.give_back();
                }
                continue;
            };
            times.push((d, took));
            let mut refused = 0usize;
            let mut first_error = None;
            for (i, m) in order.into_iter().zip(made) {
                match m {
                    Ok((alloc, Ok(handle))) => out[i] = Some((alloc, handle)),
                    Ok((alloc, Err(e))) => {
                        self.arb.fds.give_back();
                        self.free_in_slot(d, alloc);
                        refused += 1;
                        first_error.get_or_insert(e);
                    }
                    Err(e) => {
                        self.arb.fds.give_back();
                        refused += 1;
                        first_error.get_or_insert(e);
                    }
                }
            }
            if let Some(e) = first_error {
                tracing::warn!(device = d, blocks = refused, error = %e, "kept memory could not be taken back");
            }
        }
        (out, times)
    }

    /// Whether kept lease `r` can be taken back: its ids and descriptor (counted against
    /// the descriptor budget), or why not.
    fn adoptable(
        &self,
        r: &LeaseRecord,
        fd: Option<OwnedFd>,
        sessions: &HashSet<Uuid>,
    ) -> Result<(Uuid, Uuid, OwnedFd), &'static str> {
        let (Ok(id), Ok(session)) = (r.id.parse::<Uuid>(), r.session.parse::<Uuid>()) else {
            return Err("unreadable id");
        };
        if !sessions.contains(&session) {
            return Err("its session was not taken back");
        }
        let fd = fd.ok_or("no descriptor came with it")?;
        match r.tier.as_str() {
            "device" => self.block_fits(r.device, &r.kind)?,
            "host" => self.host_block_fits(&r.kind)?,
            _ => return Err("its tier is unknown"),
        }
        Ok((id, session, fd))
    }

    /// Whether kept quarantine `r` can be taken back: while the process that may map its
    /// memory is the one it was (same pid and start time) it stays counted to its tenant
    /// until that process exits; otherwise its memory goes with the keeper's copy. Its
    /// lease id, pid and descriptor (counted against the budget), or why not.
    fn adoptable_quarantine(
        &self,
        r: &records::QuarantineRecord,
        fd: Option<OwnedFd>,
        alive: &mut Liveness,
    ) -> Result<(Uuid, u32, OwnedFd), &'static str> {
        let lease: Uuid = r.lease.parse().map_err(|_| "unreadable id")?;
        let (Some(pid), Some(start)) = (r.pid, r.pid_start) else {
            return Err("its process is unknown");
        };
        if !alive.is(pid, start) {
            return Err("its process is gone");
        }
        let fd = fd.ok_or("no descriptor came with it")?;
        self.block_fits(r.device, &r.kind)?;
        Ok((lease, pid, fd))
    }

    /// Whether kept held block `r` can be taken back: what of it the core takes (its
    /// processes still alive) and its descriptor (counted against the budget), or why
    /// not. Its importers are looked at later: a block none of them holds is let go then.
    fn adoptable_held(
        &self,
        r: &records::HeldRecord,
        fd: Option<OwnedFd>,
        alive: &mut Liveness,
    ) -> Result<(crate::arbiter::state::AdoptedHeld, OwnedFd), &'static str> {
        let lease: Uuid = r.lease.parse().map_err(|_| "unreadable id")?;
        let fd = fd.ok_or("no descriptor came with it")?;
        self.block_fits(r.device, &r.kind)?;
        // Processes outside its lease's session that fetched its descriptor are named
        // with their start times apart: one whose pid a later process took is not waited
        // for.
        let recipients = alive.recipients(&r.recipients);
        let recorded: HashSet<u32> = r.recipients.iter().map(|p| p.pid).collect();
        Ok((
            crate::arbiter::state::AdoptedHeld {
                lease,
                tenant: r.tenant.clone(),
                device: r.device,
                // A process in another pid namespace (pid 0) cannot be looked at: waited
                // for, as before the restart.
                waiters: alive
                    .recipients(&r.waiters)
                    .into_iter()
                    .filter(|(p, _)| !recorded.contains(p) || recipients.contains_key(p))
                    .collect(),
                recipient_starts: recipients
                    .into_iter()
                    .filter_map(|(p, s)| Some((p, s?)))
                    .collect(),
                timeout: r.timeout,
                destroy: r.destroy,
            },
            fd,
        ))
    }

    /// Whether host-tier memory of `kind` can be taken back by this broker's host tier;
    /// if so its descriptor is counted against the budget.
    fn host_block_fits(&self, kind: &str) -> Result<(), &'static str> {
        if self.arb.host_tier.is_none() {
            return Err("this broker has no host tier");
        }
        if kind != "host-memfd" {
            return Err("its memory is of another backend");
        }
        if self.arb.fds.take(0).is_err() {
            return Err("out of descriptors");
        }
        Ok(())
    }

    /// The host tier's slot among the devices' when kept blocks are taken back: after
    /// them.
    fn host_slot(&self) -> u32 {
        self.arb.devices.len() as u32
    }

    /// Frees `what`, made in slot `slot` (a device, or the host tier's).
    fn free_in_slot(&self, slot: u32, what: impl Into<crate::arbiter::Unneeded>) {
        match slot == self.host_slot() {
            true => self.arb.free_host(what),
            false => self.arb.free_on_device(slot, what),
        }
    }

    /// Whether memory of `kind` kept on `device` can be taken back by this broker's
    /// device of that index; if so its descriptor is counted against the budget.
    fn block_fits(&self, device: u32, kind: &str) -> Result<(), &'static str> {
        let Some(slot) = self.arb.devices.get(device as usize) else {
            return Err("no such device");
        };
        let kind_ok = matches!(
            (slot.thread.desc().backend, kind),
            (crate::device::BackendKind::Host, "host-memfd")
                | (crate::device::BackendKind::Cuda, "cuda-vmm")
        );
        if !kind_ok {
            return Err("its memory is of another backend");
        }
        if self.arb.fds.take(0).is_err() {
            return Err("out of descriptors");
        }
        Ok(())
    }
}
