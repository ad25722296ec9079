//! A broker restart that loses no lease: the shell's side of the keeper (`keeper/`).
//! Every session's and lease's start and end reaches the keeper as the lock guard runs the
//! transition's `Effect::Keep` ([`Arbiter::keep`], under the lock, before any reply). At
//! start, [`Arbiter::adopt_from_keeper`] reads back what the keeper holds and takes back
//! the sessions whose peer process still lives (same pid and start time) with their
//! leases (same id, bytes, tenant, memory: the kept descriptor becomes the block again);
//! what belonged to processes that died meanwhile is dropped, so its memory goes. A worker
//! then resumes its session with its secret from the same process
//! ([`Arbiter::resume_session`]); a session nobody resumes ends with the keepalive timeout
//! or its process.

use super::effects::Keep;
use super::{Arbiter, Ending};
use crate::error::{BrokerError, BrokerResult};
use crate::keeper::records::{self, Kept, LeaseRecord, SessionRecord};
use crate::keeper::{KeeperError, Place};
use crate::pool::Block;
use crate::session::{Peer, Session, SessionEvent};
use std::collections::HashSet;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::mpsc;
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
    /// Records this broker could not read (dropped).
    pub unreadable: usize,
    /// From the keeper's answer to the last lease taken back.
    pub took: Duration,
}

/// A session's resume secret and its hash (what is kept).
pub(crate) fn new_resume_secret() -> (String, String) {
    let secret: [u8; 32] = rand::random();
    let secret = hex::encode(secret);
    (secret.clone(), secret_hash(&secret))
}

fn secret_hash(secret: &str) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(secret.as_bytes()))
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn from_unix_ms(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
}

impl Arbiter {
    /// Runs `Effect::Keep`: tells the keeper (if there is one), between the crash points
    /// of that change.
    pub(crate) fn keep(&self, k: Keep) {
        let Some(link) = self.keeper.get() else {
            return;
        };
        let name = k.name();
        self.crash.pass("before-keep", name);
        let was_broken = link.is_broken();
        match k {
            Keep::Session(r) => link.put(r.key(), to_json(&r), None),
            Keep::SessionEnded(id) => link.remove(records::session_key(&id)),
            Keep::Lease(r, fd) => link.put(r.key(), to_json(&r), Some(fd.0.as_fd())),
            Keep::LeaseEnded(id) => link.remove(records::lease_key(&id)),
            Keep::Quarantine(mut r, fd) => {
                // A session's end quarantines its leases after it left the table: its
                // process's start time (so a reused pid is not taken for it) is read here.
                if r.pid_start.is_none() {
                    r.pid_start = r.pid.and_then(crate::process::start_ticks);
                }
                link.put(r.key(), to_json(&r), Some(fd.0.as_fd()))
            }
            Keep::QuarantineLifted(id) => link.remove(records::quarantine_key(&id)),
        }
        if !was_broken && link.is_broken() {
            self.metrics.count_keeper_lost();
        }
        self.crash.pass("after-keep", name);
    }

    /// Keeps device `device`'s drain (None: it ended), under the state lock like every
    /// kept change, between the crash points `before-keep:drain` and `after-keep:drain`.
    pub(crate) fn keep_drain(&self, device: u32, drain: Option<&crate::availability::Drain>) {
        let Some(link) = self.keeper.get() else {
            return;
        };
        self.crash.pass("before-keep", "drain");
        let was_broken = link.is_broken();
        match drain {
            Some(d) => {
                let r = records::DrainRecord {
                    v: records::RECORD_VERSION,
                    device,
                    since_unix_ms: unix_ms(d.since),
                    deadline_unix_ms: d.deadline.map(unix_ms),
                    reason: d.reason.clone(),
                };
                link.put(r.key(), to_json(&r), None);
            }
            None => link.remove(records::drain_key(device)),
        }
        if !was_broken && link.is_broken() {
            self.metrics.count_keeper_lost();
        }
        self.crash.pass("after-keep", "drain");
    }

    /// Drains the device of kept drain `r` again, as the previous broker had it: same
    /// reason and start, the same deadline (wall clock) for its reclaimable holders, asked
    /// again; a deadline that passed meanwhile gives them the usual reclaim deadline.
    fn drain_again(self: &Arc<Self>, r: records::DrainRecord) {
        if r.device as usize >= self.devices.len() {
            tracing::warn!(
                device = r.device,
                "a kept drain names no device of this broker: dropped"
            );
            if let Some(link) = self.keeper.get() {
                link.remove(r.key());
            }
            return;
        }
        let left = r.deadline_unix_ms.and_then(|ms| {
            from_unix_ms(ms)
                .duration_since(SystemTime::now())
                .ok()
                .filter(|d| !d.is_zero())
        });
        match self.start_drain(Some(r.device), left, &r.reason) {
            Ok(_) => {
                let st = self.lock();
                let mut avail = self.avail.write();
                if let Some(Some(d)) = avail.device_mut(r.device).map(|s| s.drain.as_mut()) {
                    d.since = from_unix_ms(r.since_unix_ms);
                    self.keep_drain(r.device, Some(d));
                }
                drop(avail);
                drop(st);
                tracing::warn!(device = r.device, reason = %r.reason, ?left, "kept drain taken back: the device stays closed");
            }
            Err(e) => {
                tracing::warn!(device = r.device, error = %e, "a kept drain could not be taken back")
            }
        }
    }

    /// A crash point outside the keeper's writes (`crash_point.rs`).
    pub fn crash_point(&self, kind: &str, what: &str) {
        self.crash.pass(kind, what);
    }

    /// What this start took back from the keeper (None without a keeper).
    pub fn restart_report(&self) -> Option<&RestartReport> {
        self.restart.get()
    }

    /// Session `id` ended: nothing of it awaits a resume any more.
    pub(crate) fn forget_resume(&self, id: &Uuid) {
        self.awaiting_resume.lock().remove(id);
    }

    /// This arbiter, weakly (a task that must not keep it alive).
    pub(crate) fn me(&self) -> std::sync::Weak<Arbiter> {
        self.me.clone()
    }

    /// Is a keeper holding this broker's leases?
    pub fn keeps_leases(&self) -> bool {
        self.keeper.get().is_some_and(|k| !k.is_broken())
    }

    /// Takes back what `link` holds (a keeper or systemd's fd store; before serving), then
    /// sends it every change from now on. See the module documentation.
    pub fn adopt_from_keeper(
        self: &Arc<Self>,
        link: impl Place + 'static,
    ) -> Result<RestartReport, KeeperError> {
        let t0 = Instant::now();
        let entries = link.dump()?;
        let mut report = RestartReport {
            kept_records: entries.len(),
            ..RestartReport::default()
        };
        let mut sessions = Vec::new();
        let mut leases = Vec::new();
        let mut drains = Vec::new();
        let mut quarantines = Vec::new();
        for e in entries {
            match records::parse(&e.key, e.record) {
                Ok(Kept::Session(s)) => sessions.push(s),
                Ok(Kept::Lease(l)) => leases.push((l, e.fd)),
                Ok(Kept::Drain(d)) => drains.push(d),
                Ok(Kept::Quarantine(q)) => quarantines.push((q, e.fd)),
                Err(err) => {
                    tracing::warn!(error = %err, "dropping a kept record");
                    report.unreadable += 1;
                    link.remove(e.key);
                }
            }
        }
        let mut adopted = HashSet::new();
        for r in sessions {
            match self.adopt_session(&r) {
                Ok(id) => {
                    adopted.insert(id);
                    report.sessions_adopted += 1;
                }
                Err(why) => {
                    tracing::info!(session = %r.id, tenant = %r.tenant, pid = ?r.pid, why, "kept session not taken back");
                    report.sessions_reclaimed += 1;
                    link.remove(r.key());
                }
            }
        }
        // Kept device memory, leases' and quarantines' alike (with their descriptors).
        let kept = leases
            .iter()
            .filter(|(r, fd)| fd.is_some() && r.tier == "device")
            .map(|(r, _)| (r.device, r.bytes))
            .chain(
                quarantines
                    .iter()
                    .filter(|(_, fd)| fd.is_some())
                    .map(|(q, _)| (q.device, q.bytes)),
            )
            .collect::<Vec<_>>();
        self.count_kept_memory_as_ours(&kept);
        let (taken, refused) = self.adopt_leases(leases, &adopted);
        for (r, why) in refused {
            tracing::info!(lease = %r.id, session = %r.session, tenant = %r.tenant, bytes = r.bytes, why, "kept lease reclaimed");
            report.leases_reclaimed += 1;
            link.remove(r.key());
        }
        for (q, fd) in quarantines {
            if let Err(why) = self.adopt_quarantine(&q, fd) {
                tracing::info!(lease = %q.lease, tenant = %q.tenant, bytes = q.bytes, pid = ?q.pid, why, "kept quarantine let go");
                link.remove(q.key());
            }
        }
        let mut waiting = self.awaiting_resume.lock();
        for (session, lease, bytes) in taken {
            report.leases_adopted += 1;
            report.bytes_adopted += bytes;
            waiting.entry(session).or_default().push(lease);
        }
        drop(waiting);
        // From here every change is kept: nothing else runs before serving.
        let place = link.describe();
        let _ = self.keeper.set(Arc::new(link));
        self.lock().set_keeping(true);
        for d in drains {
            self.drain_again(d);
        }
        report.took = t0.elapsed();
        self.metrics.count_restart(
            (report.sessions_adopted, report.sessions_reclaimed),
            (report.leases_adopted, report.leases_reclaimed),
        );
        tracing::info!(
            records = report.kept_records,
            sessions_adopted = report.sessions_adopted,
            sessions_reclaimed = report.sessions_reclaimed,
            leases_adopted = report.leases_adopted,
            leases_reclaimed = report.leases_reclaimed,
            bytes_adopted = report.bytes_adopted,
            unreadable = report.unreadable,
            took = ?report.took,
            %place,
            "took back what the keeper held"
        );
        let _ = self.restart.set(report.clone());
        Ok(report)
    }

    /// Takes back kept quarantine `r` while the process that may map its memory is the
    /// one it was (same pid and start time): counted to its tenant again until it exits.
    /// Otherwise its memory goes with the keeper's copy.
    fn adopt_quarantine(
        &self,
        r: &records::QuarantineRecord,
        fd: Option<std::os::fd::OwnedFd>,
    ) -> Result<(), &'static str> {
        let lease: Uuid = r.lease.parse().map_err(|_| "unreadable id")?;
        let (Some(pid), Some(start)) = (r.pid, r.pid_start) else {
            return Err("its process is unknown");
        };
        if crate::process::start_ticks(pid) != Some(start) {
            return Err("its process is gone");
        }
        let fd = fd.ok_or("no descriptor came with it")?;
        let Some(slot) = self.devices.get(r.device as usize) else {
            return Err("no such device");
        };
        let kind_ok = matches!(
            (slot.thread.desc().backend, r.kind.as_str()),
            (crate::device::BackendKind::Host, "host-memfd")
                | (crate::device::BackendKind::Cuda, "cuda-vmm")
        );
        if !kind_ok {
            return Err("its memory is of another backend");
        }
        if self.fds.take(0).is_err() {
            return Err("out of descriptors");
        }
        let (bytes, block_id) = (r.bytes, r.block_id);
        let made = slot.thread.call_blocking(move |dev| {
            let alloc = dev.adopt(fd, bytes, block_id)?;
            let handle = dev.export(&alloc);
            Ok::<_, crate::device::DeviceError>((alloc, handle))
        });
        let (alloc, handle) = match made {
            Ok(Ok((alloc, Ok(handle)))) => (alloc, handle),
            Ok(Ok((alloc, Err(_)))) => {
                self.fds.give_back();
                self.free_on_device(r.device, alloc);
                return Err("the device refused its memory");
            }
            _ => {
                self.fds.give_back();
                return Err("the device refused its memory");
            }
        };
        let block = Block {
            alloc,
            handle,
            last_tenant: Some(r.tenant.clone()),
            // Freed only once the quarantine's process exited: nobody left to check for.
            reached: Default::default(),
        };
        let a = super::state::AdoptedQuarantine {
            lease,
            tenant: r.tenant.clone(),
            device: r.device,
            pid: Some(pid),
            destroy: r.destroy,
        };
        let refused = self.lock().adopt_quarantine(a, block);
        if let Err((_, block)) = refused {
            self.free_on_device(r.device, block);
            return Err("its tenant is gone");
        }
        Ok(())
    }

    /// Opens kept session `r` again when its peer process is the one that opened it.
    fn adopt_session(&self, r: &SessionRecord) -> Result<Uuid, &'static str> {
        let id: Uuid = r.id.parse().map_err(|_| "unreadable id")?;
        let (Some(pid), Some(start)) = (r.pid, r.pid_start) else {
            return Err("its process is unknown (not a Unix socket peer)");
        };
        if crate::process::start_ticks(pid) != Some(start) {
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
        self.lock()
            .adopt_session(s)
            .map_err(|_| "its tenant is gone")?;
        Ok(id)
    }

    /// Takes back the kept leases `leases` of the sessions taken back (`sessions`), in
    /// batches: one job per device makes their blocks again, one lock hold adopts them.
    /// Those taken back (session, lease, bytes), and those not with why.
    /// Kept CUDA memory was in use when the devices opened, so their leasable bytes and
    /// the memory used outside the broker were read without it: it is the broker's (taken
    /// back now, or freed once the keeper's and our copies close), so each device's
    /// leasable amount grows by it and the outside measure stops counting it.
    fn count_kept_memory_as_ours(&self, kept_blocks: &[(u32, u64)]) {
        let mut kept = vec![0u64; self.devices.len()];
        for &(d, bytes) in kept_blocks {
            let Some(slot) = self.devices.get(d as usize) else {
                continue;
            };
            if slot.thread.desc().backend == crate::device::BackendKind::Cuda {
                kept[d as usize] = kept[d as usize].saturating_add(bytes);
            }
        }
        let mut st = self.lock();
        for (d, bytes) in kept.into_iter().enumerate() {
            if bytes == 0 {
                continue;
            }
            let slot = &self.devices[d];
            slot.taken_back
                .store(bytes, std::sync::atomic::Ordering::Relaxed);
            let gran = st.pools()[d].granularity();
            st.set_leasable(d as u32, slot.leasable_at_start() / gran * gran);
        }
    }

    #[allow(clippy::type_complexity)]
    fn adopt_leases(
        &self,
        leases: Vec<(LeaseRecord, Option<std::os::fd::OwnedFd>)>,
        sessions: &HashSet<Uuid>,
    ) -> (Vec<(Uuid, Uuid, u64)>, Vec<(LeaseRecord, &'static str)>) {
        let mut refused = Vec::new();
        // Per device: the records and their descriptors that may be taken back.
        let mut by_device: Vec<Vec<(LeaseRecord, Uuid, Uuid, std::os::fd::OwnedFd)>> =
            (0..self.devices.len()).map(|_| Vec::new()).collect();
        for (r, fd) in leases {
            match self.adoptable(&r, fd, sessions) {
                Ok((id, session, fd)) => by_device[r.device as usize].push((r, id, session, fd)),
                Err(why) => refused.push((r, why)),
            }
        }
        let mut made = Vec::new();
        for (d, batch) in by_device.into_iter().enumerate() {
            if batch.is_empty() {
                continue;
            }
            let (records, fds): (Vec<_>, Vec<_>) = batch
                .into_iter()
                .map(|(r, id, session, fd)| {
                    let what = r_bytes_id(&r);
                    ((r, id, session), (fd, what))
                })
                .unzip();
            let blocks = self.devices[d].thread.call_blocking(move |dev| {
                fds.into_iter()
                    .map(|(fd, (bytes, block_id))| {
                        let alloc = dev.adopt(fd, bytes, block_id)?;
                        let handle = dev.export(&alloc);
                        Ok::<_, crate::device::DeviceError>((alloc, handle))
                    })
                    .collect::<Vec<_>>()
            });
            let blocks = match blocks {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(device = d, error = %e, "kept memory could not be taken back");
                    for (r, ..) in records {
                        self.fds.give_back();
                        refused.push((r, "the device refused its memory"));
                    }
                    continue;
                }
            };
            for ((r, id, session), block) in records.into_iter().zip(blocks) {
                match block {
                    Ok((alloc, Ok(handle))) => made.push((r, id, session, alloc, handle)),
                    Ok((alloc, Err(e))) => {
                        self.fds.give_back();
                        self.free_on_device(r.device, alloc);
                        tracing::warn!(lease = %r.id, error = %e, "kept memory could not be exported again");
                        refused.push((r, "the device refused its memory"));
                    }
                    Err(e) => {
                        self.fds.give_back();
                        tracing::warn!(lease = %r.id, error = %e, "kept memory could not be taken back");
                        refused.push((r, "the device refused its memory"));
                    }
                }
            }
        }
        let mut taken = Vec::with_capacity(made.len());
        let mut unneeded = Vec::new();
        {
            let mut st = self.lock();
            for (r, id, session, alloc, handle) in made {
                let block = Block {
                    alloc,
                    handle,
                    last_tenant: Some(r.tenant.clone()),
                    reached: Default::default(),
                };
                let a = super::state::Adopted {
                    id,
                    tenant: r.tenant.clone(),
                    session,
                    device: r.device,
                    requested_bytes: r.requested_bytes,
                    label: r.label.clone(),
                    reclaimable: r.reclaimable,
                    created: from_unix_ms(r.created_unix_ms),
                    priority: r.priority,
                };
                match st.adopt_lease(a, block) {
                    Ok(_) => taken.push((session, id, r.bytes)),
                    Err((why, block)) => {
                        tracing::debug!(?why, "kept lease not taken back");
                        unneeded.push((r.device, block));
                        refused.push((r, "its session or tenant is gone"));
                    }
                }
            }
        }
        // Nobody counted maps them: their holders' sessions are gone.
        for (d, block) in unneeded {
            self.free_on_device(d, block);
        }
        (taken, refused)
    }

    /// Whether kept lease `r` can be taken back: its ids and descriptor (counted against
    /// the descriptor budget), or why not.
    fn adoptable(
        &self,
        r: &LeaseRecord,
        fd: Option<std::os::fd::OwnedFd>,
        sessions: &HashSet<Uuid>,
    ) -> Result<(Uuid, Uuid, std::os::fd::OwnedFd), &'static str> {
        let (Ok(id), Ok(session)) = (r.id.parse::<Uuid>(), r.session.parse::<Uuid>()) else {
            return Err("unreadable id");
        };
        if !sessions.contains(&session) {
            return Err("its session was not taken back");
        }
        let fd = fd.ok_or("no descriptor came with it")?;
        if r.tier != "device" {
            return Err("host-tier leases are not taken back");
        }
        let Some(slot) = self.devices.get(r.device as usize) else {
            return Err("no such device");
        };
        let kind_ok = matches!(
            (slot.thread.desc().backend, r.kind.as_str()),
            (crate::device::BackendKind::Host, "host-memfd")
                | (crate::device::BackendKind::Cuda, "cuda-vmm")
        );
        if !kind_ok {
            return Err("its memory is of another backend");
        }
        if self.fds.take(0).is_err() {
            return Err("out of descriptors");
        }
        Ok((id, session, fd))
    }

    /// Attaches the caller's stream to `id`, a session taken back from the keeper: only
    /// its own process (`peer`: same pid and uid) with its secret, of `tenant`, and only
    /// while no stream has it. Leases taken back with it that the worker does not name in
    /// `held` end (it never learnt of them; leases granted since the restart stay). Its
    /// events, the leases kept, and those gone: ended now, or named but no longer there
    /// (ended before the restart: their end reached the keeper, not the worker).
    #[allow(clippy::type_complexity)]
    pub fn resume_session(
        self: &Arc<Self>,
        tenant: &str,
        id: Uuid,
        secret: &str,
        peer: Peer,
        held: &[Uuid],
    ) -> BrokerResult<(mpsc::UnboundedReceiver<SessionEvent>, Vec<Uuid>, Vec<Uuid>)> {
        // A closing broker reopens no mailbox (open_session refuses likewise).
        self.check_not_shutting_down()?;
        let refused = || BrokerError::NotFound(crate::error::Missing::Session(id));
        let hash = secret_hash(secret);
        let (tx, rx) = mpsc::unbounded_channel();
        let mut st = self.lock();
        let Some(s) = st.sessions().get(&id) else {
            return Err(refused());
        };
        use subtle::ConstantTimeEq;
        let secret_ok = s
            .resume_hash
            .as_deref()
            .is_some_and(|h| bool::from(h.as_bytes().ct_eq(hash.as_bytes())));
        let same_process = peer.pid.is_some() && s.peer.pid == peer.pid && s.peer.uid == peer.uid;
        if s.tenant != tenant || !secret_ok || !same_process || self.outbox.sender(&id).is_some() {
            tracing::warn!(session = %id, tenant, pid = ?peer.pid, "a resume was refused");
            return Err(refused());
        }
        s.last_seen.touch();
        let held: HashSet<Uuid> = held.iter().copied().collect();
        let adopted = self.awaiting_resume.lock().remove(&id).unwrap_or_default();
        let (kept, ended): (Vec<Uuid>, Vec<Uuid>) = adopted
            .into_iter()
            .filter(|l| s.leases().contains(l))
            .partition(|l| held.contains(l));
        let gone: Vec<Uuid> = held
            .iter()
            .filter(|l| !s.leases().contains(l))
            .copied()
            .collect();
        self.outbox.open(id, tx);
        for l in &ended {
            // Never handed to the worker (it does not know it): nobody maps it.
            st.end_lease(*l, Ending::Cache);
        }
        drop(st);
        tracing::info!(session = %id, tenant, kept = kept.len(), ended = ended.len(), "session resumed");
        self.metrics.count_resumed();
        Ok((rx, kept, ended.into_iter().chain(gone).collect()))
    }
}

/// A record's bytes and block id (what the device needs to take its memory back).
fn r_bytes_id(r: &LeaseRecord) -> (u64, u64) {
    (r.bytes, r.block_id)
}

fn to_json<T: serde::Serialize>(r: &T) -> serde_json::Value {
    serde_json::to_value(r).unwrap_or_default()
}
