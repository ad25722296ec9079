//! Stranded memory: memory the broker freed that stayed on the device because a process
//! outside it kept the block's import (CUDA VMM memory lives until its last importer lets
//! go, and the driver offers no revocation). The shell learns it from the driver when the
//! free is done (the device's free memory did not rise by the block) and hands it here:
//! it is charged again to the block's tenant, as quarantined bytes, until every process
//! that may keep it has exited (`Watch::Stranded`), so a tenant cannot keep memory past
//! its quota by releasing and keeping, and the outside-memory estimate (device used less
//! what the broker holds) does not count it a second time. Where the shell can tell that
//! memory was let go while its processes live (a memfd: it looks again, with backoff), it
//! says so ([`State::stranded_let_go`], [`State::stranded_released`]); memory whose every
//! holder it can tell apart from the processes it names (a memfd the kernel says is
//! still held, by whomever) is not watched at all ([`State::stranded_unwatched`]): only
//! the shell's look lets it go.
//!
//! CUDA memory may also be kept by a process the broker never recorded (a child that read
//! its parent's descriptor, a process it was sent to): the shell then names, beside the
//! recorded processes, those near them with a context on the device
//! (`kept_holders.rs`), and asks again when the last named one exits
//! ([`State::stranded_rechecking`]): the charge goes only once no such process is left.
//!
//! Each charge is kept (`stranded/<id>`, with its processes' start times where the shell
//! gave them: [`State::stranded_holders_started`]) until it is lifted, so a restarted
//! broker charges it again while one of those processes lives
//! ([`State::adopt_stranded`]).

use super::State;
use crate::effects::{Keep, Watch};
use crate::kept::{FileHandleRecord, ProcessRecord, StrandedRecord};
use crate::memory::MemoryKind;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Instant, SystemTime};
use uuid::Uuid;

/// Memory freed on a device and kept there by processes outside the broker.
#[derive(Debug)]
pub struct Stranded {
    pub tenant: String,
    pub device: u32,
    pub bytes: u64,
    /// The processes that may keep it. Watched: it is let go when none is left;
    /// unwatched: the ones found keeping it, named for operators (it is let go only when
    /// the shell says nobody holds it).
    pub pids: BTreeSet<u32>,
    pub watched: bool,
    /// When its last watched process exits the shell looks for others that may keep it
    /// ([`State::stranded_rechecked`]) before it is let go.
    pub recheck: bool,
    pub since: Instant,
    /// When it was stranded (wall clock, for its record).
    pub since_wall: SystemTime,
    /// When its processes started, where the shell said (its record names them so).
    pub starts: BTreeMap<u32, u64>,
    /// Its memory's kind, where the shell said.
    pub kind: Option<MemoryKind>,
    /// Its memfd's file handle, where the shell gave one (kept in its record).
    pub file_handle: Option<FileHandleRecord>,
}

/// Stranded memory to take back at a restart (from its record): its processes are those
/// still alive (the shell looked).
#[derive(Clone, Debug)]
pub struct AdoptedStranded {
    pub id: Uuid,
    pub tenant: String,
    pub device: u32,
    pub bytes: u64,
    /// Processes that may keep it, with their start times when known.
    pub holders: BTreeMap<u32, Option<u64>>,
    pub recheck: bool,
    pub kind: Option<MemoryKind>,
    /// When it was stranded (its record's time).
    pub stranded_at: SystemTime,
    /// Its memfd's file handle, from its record.
    pub file_handle: Option<FileHandleRecord>,
    /// Its holders are watched, their exits lifting it; false: the shell asks the kernel
    /// whether its file lives (by `file_handle`) and says when it is let go.
    pub watched: bool,
}

impl State {
    /// A free of `bytes` on `device` did not give the memory back: processes `pids`, which
    /// had the block's descriptor, may keep it. It is charged to `tenant` (the block's) as
    /// quarantined until they all exit. Returns its id; `None` (nothing counted) when no
    /// process is named or the tenant no longer exists: the memory then stays outside
    /// the books, as before.
    pub fn stranded(
        &mut self,
        tenant: &str,
        device: u32,
        bytes: u64,
        pids: impl IntoIterator<Item = u32>,
    ) -> Option<Uuid> {
        let pids: BTreeSet<u32> = pids.into_iter().collect();
        if pids.is_empty() {
            return None;
        }
        self.strand(tenant, device, bytes, pids, true, false)
    }

    /// [`State::stranded`], for memory that processes the broker never recorded may keep
    /// too: when the last of `pids` exits it is not let go but waits for the shell's look
    /// ([`State::stranded_awaits_recheck`], then [`State::stranded_rechecked`]).
    pub fn stranded_rechecking(
        &mut self,
        tenant: &str,
        device: u32,
        bytes: u64,
        pids: impl IntoIterator<Item = u32>,
    ) -> Option<Uuid> {
        let pids: BTreeSet<u32> = pids.into_iter().collect();
        if pids.is_empty() {
            return None;
        }
        self.strand(tenant, device, bytes, pids, true, true)
    }

    /// A free of `bytes` on `device` did not give the memory back and the shell can tell
    /// when it is let go, whoever keeps it (a memfd the kernel says still lives): charged
    /// to `tenant` as quarantined, `pids` named as those found keeping it (none: a process
    /// the broker never saw), until [`State::stranded_released`]. No process is watched:
    /// one the broker never saw may outlive them.
    pub fn stranded_unwatched(
        &mut self,
        tenant: &str,
        device: u32,
        bytes: u64,
        pids: impl IntoIterator<Item = u32>,
    ) -> Option<Uuid> {
        self.strand(
            tenant,
            device,
            bytes,
            pids.into_iter().collect(),
            false,
            false,
        )
    }

    fn strand(
        &mut self,
        tenant: &str,
        device: u32,
        bytes: u64,
        pids: BTreeSet<u32>,
        watched: bool,
        recheck: bool,
    ) -> Option<Uuid> {
        if bytes == 0 || self.ledger.get(tenant).is_none() {
            return None;
        }
        let pool = self.pools.get_mut(device as usize)?;
        pool.strand(bytes);
        // The device has that much less room: cached blocks beyond it go back.
        let leasable = pool.leasable();
        self.set_leasable(device, leasable);
        self.ledger.add_quarantine(tenant, device, bytes);
        let id = Uuid::new_v4();
        if watched {
            for &pid in &pids {
                self.fx.watch(Watch::Stranded { id, pid });
            }
        }
        self.stranded.insert(
            id,
            Stranded {
                tenant: tenant.to_string(),
                device,
                bytes,
                pids,
                watched,
                recheck,
                since: self.clock.now,
                since_wall: self.clock.wall,
                starts: BTreeMap::new(),
                kind: None,
                file_handle: None,
            },
        );
        self.keep_stranded(id);
        Some(id)
    }

    /// The shell read when the processes of stranded memory `id` started (`starts`), and
    /// its memory's kind and its memfd's file handle where it knows them: its record
    /// names them, so a restarted broker takes no reused pid for one of them and can ask
    /// the kernel about the file.
    pub fn stranded_holders_started(
        &mut self,
        id: Uuid,
        kind: Option<MemoryKind>,
        file_handle: Option<FileHandleRecord>,
        starts: impl IntoIterator<Item = (u32, u64)>,
    ) {
        let Some(s) = self.stranded.get_mut(&id) else {
            return;
        };
        s.kind = kind.or(s.kind);
        s.file_handle = file_handle.or(s.file_handle.take());
        for (pid, start) in starts {
            if s.pids.contains(&pid) {
                s.starts.insert(pid, start);
            }
        }
        self.keep_stranded(id);
    }

    /// Stranded memory `id`'s record (while it is charged).
    pub(super) fn stranded_record(&self, id: Uuid) -> Option<StrandedRecord> {
        let s = self.stranded.get(&id)?;
        Some(StrandedRecord {
            v: crate::kept::RECORD_VERSION,
            id: id.to_string(),
            tenant: s.tenant.clone(),
            device: s.device,
            bytes: s.bytes,
            kind: s.kind.map(|k| super::shared::kind_name(k).to_string()),
            holders: s
                .pids
                .iter()
                .map(|&pid| ProcessRecord {
                    pid,
                    start: s.starts.get(&pid).copied(),
                })
                .collect(),
            watched: s.watched,
            recheck: s.recheck,
            stranded_unix_ms: crate::kept::unix_ms(s.since_wall),
            device_uuid: None,
            file_handle: s.file_handle.clone(),
        })
    }

    fn keep_stranded(&mut self, id: Uuid) {
        if let Some(r) = self.stranded_record(id) {
            self.keep(|| Keep::Stranded(r));
        }
    }

    /// Takes back stranded memory `a` at a restart: charged again to its tenant as
    /// quarantined, its living processes watched, or, unwatched, named while the shell
    /// asks the kernel about its memfd by its file handle (no copy of the memory was
    /// kept). Nothing is pushed for the keeper: it holds the record. Refused when no
    /// process lives (watched), its tenant or device is gone, or it is larger than its device (a
    /// damaged record: charging it would wrap the counts).
    pub fn adopt_stranded(&mut self, a: AdoptedStranded) -> Result<(), super::NotAdopted> {
        let Some(pool) = self.pools.get(a.device as usize) else {
            return Err(super::NotAdopted::Device);
        };
        if a.bytes > pool.total() {
            return Err(super::NotAdopted::Device);
        }
        if a.bytes == 0 || self.ledger.get(&a.tenant).is_none() {
            return Err(super::NotAdopted::Tenant);
        }
        if (a.watched && a.holders.is_empty()) || self.stranded.contains_key(&a.id) {
            return Err(super::NotAdopted::Session);
        }
        let pool = &mut self.pools[a.device as usize];
        pool.strand(a.bytes);
        let leasable = pool.leasable();
        self.set_leasable(a.device, leasable);
        self.ledger.add_quarantine(&a.tenant, a.device, a.bytes);
        if a.watched {
            for &pid in a.holders.keys() {
                self.fx.watch(Watch::Stranded { id: a.id, pid });
            }
        }
        self.stranded.insert(
            a.id,
            Stranded {
                tenant: a.tenant,
                device: a.device,
                bytes: a.bytes,
                pids: a.holders.keys().copied().collect(),
                watched: a.watched,
                recheck: a.recheck,
                since: self.clock.now,
                since_wall: a.stranded_at,
                starts: a
                    .holders
                    .iter()
                    .filter_map(|(&p, s)| s.map(|s| (p, s)))
                    .collect(),
                kind: a.kind,
                file_handle: a.file_handle,
            },
        );
        Ok(())
    }

    /// The shell looked: process `pid`, alive, no longer keeps stranded memory `id`. Of
    /// watched memory its watch goes and the last such lets it go (as an exit would); of
    /// unwatched memory it is no longer named. True when the memory was let go.
    pub fn stranded_let_go(&mut self, id: Uuid, pid: u32) -> bool {
        let Some(s) = self.stranded.get_mut(&id) else {
            return false;
        };
        if !s.pids.contains(&pid) {
            return false;
        }
        if !s.watched {
            s.pids.remove(&pid);
            self.keep_stranded(id);
            return false;
        }
        self.fx.unwatch(Watch::Stranded { id, pid });
        self.stranded_holder_gone(id, pid)
    }

    /// The shell looked: nobody holds stranded memory `id` any more (the kernel says the
    /// memfd is gone). It is let go, its watches with it. False when it was not stranded.
    pub fn stranded_released(&mut self, id: Uuid) -> bool {
        let Some(s) = self.stranded.remove(&id) else {
            return false;
        };
        if s.watched {
            for &pid in &s.pids {
                self.fx.unwatch(Watch::Stranded { id, pid });
            }
        }
        self.unstrand(&s);
        self.keep(|| Keep::StrandedLifted(id));
        tracing::info!(tenant = %s.tenant, device = s.device, bytes = s.bytes, held_for = ?self.clock.now.saturating_duration_since(s.since), "memory kept outside the broker let go");
        true
    }

    /// Is memory `id` still stranded (the shell's looks stop when not)?
    pub fn is_stranded(&self, id: Uuid) -> bool {
        self.stranded.contains_key(&id)
    }

    /// Process `pid` that may keep stranded memory `id` exited; the last one lets it go
    /// (the queue runs after the hold), unless the shell is to look for others first
    /// ([`State::stranded_rechecking`]). True when it was let go.
    pub fn stranded_holder_gone(&mut self, id: Uuid, pid: u32) -> bool {
        let Some(s) = self.stranded.get_mut(&id) else {
            return false;
        };
        let removed = s.pids.remove(&pid);
        if !s.pids.is_empty() || !s.watched || s.recheck {
            if removed {
                self.keep_stranded(id);
            }
            return false;
        }
        self.let_go_stranded(id)
    }

    /// Has every named process of stranded memory `id` exited while processes the broker
    /// never recorded may keep it (the shell looks: [`State::stranded_rechecked`])?
    pub fn stranded_awaits_recheck(&self, id: Uuid) -> bool {
        self.stranded
            .get(&id)
            .is_some_and(|s| s.watched && s.recheck && s.pids.is_empty())
    }

    /// The shell looked for processes that may keep stranded memory `id` once its named
    /// ones had exited and found `pids`: they are named and watched in turn; none lets it
    /// go (the queue runs after the hold). True when it was let go.
    pub fn stranded_rechecked(&mut self, id: Uuid, pids: impl IntoIterator<Item = u32>) -> bool {
        if !self.stranded_awaits_recheck(id) {
            return false;
        }
        let Some(s) = self.stranded.get_mut(&id) else {
            return false;
        };
        let named: Vec<u32> = pids.into_iter().filter(|&p| s.pids.insert(p)).collect();
        if named.is_empty() {
            return self.let_go_stranded(id);
        }
        for pid in named {
            self.fx.watch(Watch::Stranded { id, pid });
        }
        self.keep_stranded(id);
        false
    }

    fn let_go_stranded(&mut self, id: Uuid) -> bool {
        let Some(s) = self.stranded.remove(&id) else {
            return false;
        };
        self.unstrand(&s);
        self.keep(|| Keep::StrandedLifted(id));
        tracing::info!(tenant = %s.tenant, device = s.device, bytes = s.bytes, held_for = ?self.clock.now.saturating_duration_since(s.since), "memory kept outside the broker let go");
        true
    }

    /// Stranded memory, by id (views and tests).
    pub fn stranded_memory(&self) -> impl Iterator<Item = (&Uuid, &Stranded)> {
        self.stranded.iter()
    }

    /// Shutdown: the books are closed, the watchers forgotten.
    pub(super) fn forget_stranded(&mut self) {
        let all: Vec<Uuid> = self.stranded.keys().copied().collect();
        for id in all {
            if let Some(s) = self.stranded.remove(&id) {
                if s.watched {
                    for &pid in &s.pids {
                        self.fx.unwatch(Watch::Stranded { id, pid });
                    }
                }
                self.unstrand(&s);
            }
        }
    }

    fn unstrand(&mut self, s: &Stranded) {
        self.wake_queue();
        self.ledger.remove_quarantine(&s.tenant, s.device, s.bytes);
        if let Some(pool) = self.pools.get_mut(s.device as usize) {
            pool.unquarantine_destroyed(s.bytes);
        }
    }
}
