//! The pool: per-device memory accounting and the block cache. It rounds sizes up to the
//! device's granularity, keeps freed blocks for reuse (a reused block costs no driver call),
//! says when a block must be **scrubbed** (zeroed) because it last belonged to another
//! tenant, and trims the cache (least recently used first) when a fresh allocation would
//! otherwise not fit under the leasable limit. It never decides *who* gets memory (that is
//! the arbiter) and never calls the device itself: it returns the blocks the caller must
//! free or scrub on the device thread.
//!
//! Every byte of the device the broker allocated is in exactly one state:
//! `leased + reserved + quarantined + cached` = what the broker holds on the device
//! (counting queued frees as done: the device thread runs jobs in order).

use crate::memory::{Allocation, Handle};
use crate::process_place::Place;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

/// One device allocation with its exported handle (for fd handles, the exported
/// descriptor itself: a pooled block costs no export).
#[derive(Debug)]
pub struct Block {
    pub alloc: Allocation,
    pub handle: Handle,
    /// Tenant whose bytes it may contain; `None` when known to be zero.
    pub last_tenant: Option<String>,
    /// Processes its descriptor reached that may keep it past their lease's end (a
    /// holder that released it): CUDA memory cannot be revoked, so its free is checked
    /// (`state/stranded.rs`).
    pub reached: Reached,
}

impl Block {
    pub fn bytes(&self) -> u64 {
        self.alloc.bytes
    }
}

/// The processes a block's descriptor reached that may keep it past their lease's end, at
/// most [`Reached::MAX`], newest last (a reused block's earlier holders are mostly gone;
/// the oldest is forgotten first), each with where it ran (`process_place.rs`: kept with the
/// block, so no other process's doing can make it forgotten before the block's free) and
/// with its tenant when that is not the block's own (another tenant's importer of a
/// publication). Boxed, and nothing for a block no lease ended on, so a block stays small.
#[derive(Clone, Debug, Default)]
pub struct Reached(Option<Box<Pids>>);

/// The pids behind [`Reached`]'s one thin pointer, and beside each the tenant of a
/// process of another tenant than the block's (`None`: the block's own).
#[derive(Clone, Debug, Default)]
struct Pids {
    pids: Vec<u32>,
    tenants: Vec<Option<Box<str>>>,
    /// Shared with the records of the process (its session's, other blocks').
    places: Vec<Option<Arc<Place>>>,
}

impl Reached {
    /// How many processes a block remembers.
    pub const MAX: usize = 64;

    /// Process `pid` of the block's own tenant, running at `place` (when known), had the
    /// descriptor and may keep it after its lease ended.
    pub fn add(&mut self, pid: u32, place: Option<Arc<Place>>) -> bool {
        self.add_with(pid, None, place)
    }

    /// Process `pid` of tenant `tenant`, not the block's, had the descriptor (an importer
    /// of its publication) and may keep it after it let go.
    pub fn add_of(&mut self, pid: u32, tenant: &str, place: Option<Arc<Place>>) -> bool {
        self.add_with(pid, Some(tenant.into()), place)
    }

    /// True when it names a process it did not (a new pid, one of another tenant, or a
    /// later process of the pid: another start time).
    fn add_with(&mut self, pid: u32, tenant: Option<Box<str>>, place: Option<Arc<Place>>) -> bool {
        let p = self.0.get_or_insert_with(Box::default);
        let mut new = true;
        if let Some(i) = p.pids.iter().position(|&q| q == pid) {
            let start = |place: &Option<Arc<Place>>| place.as_ref().and_then(|p| p.start);
            new = p.tenants[i] != tenant || start(&p.places[i]) != start(&place);
            p.pids.remove(i);
            p.tenants.remove(i);
            p.places.remove(i);
        }
        if p.pids.len() >= Self::MAX {
            p.pids.remove(0);
            p.tenants.remove(0);
            p.places.remove(0);
        }
        p.pids.push(pid);
        p.tenants.push(tenant);
        p.places.push(place);
        new
    }

    /// Its processes as kept records name them, oldest first (a start time from the
    /// process's place, where known).
    pub fn records(&self) -> Vec<crate::kept::ReachedRecord> {
        let Some(p) = self.0.as_deref() else {
            return Vec::new();
        };
        p.pids
            .iter()
            .zip(&p.tenants)
            .zip(&p.places)
            .map(|((&pid, tenant), place)| crate::kept::ReachedRecord {
                pid,
                start: place.as_ref().and_then(|p| p.start),
                tenant: tenant.as_deref().map(str::to_string),
            })
            .collect()
    }

    /// The processes, oldest first.
    pub fn pids(&self) -> &[u32] {
        self.0.as_deref().map_or(&[], |p| p.pids.as_slice())
    }

    /// Where each of [`Reached::pids`] ran, when known.
    pub fn places(&self) -> &[Option<Arc<Place>>] {
        self.0.as_deref().map_or(&[], |p| p.places.as_slice())
    }

    pub fn is_empty(&self) -> bool {
        self.pids().is_empty()
    }

    /// Who answers for the block's memory kept, after its free, by some of `keepers`
    /// (live processes it reached): the block's tenant `own` when one of them is its own
    /// (or unknown here); else the tenant of the newest of them, another tenant's
    /// importer, which kept what it was lent. The driver cannot say which process kept
    /// CUDA memory, so a process of the block's tenant, which could have, is answered for
    /// first: an importer is charged only when none of the publisher's could hold it.
    pub fn answers_for(&self, keepers: &[u32], own: &str) -> String {
        let Some(p) = self.0.as_deref() else {
            return own.to_string();
        };
        let mut other = None;
        for &k in keepers {
            match p.pids.iter().position(|&q| q == k) {
                Some(i) => match &p.tenants[i] {
                    Some(t) => {
                        if other.is_none_or(|(j, _)| j < i) {
                            other = Some((i, t));
                        }
                    }
                    None => return own.to_string(),
                },
                None => return own.to_string(),
            }
        }
        other.map_or_else(|| own.to_string(), |(_, t)| t.to_string())
    }
}

/// Counters shown to operators.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub leasable: u64,
    pub leased: u64,
    pub reserved: u64,
    pub quarantined: u64,
    pub cached: u64,
    /// Room kept for processes to allocate themselves (process reservations).
    pub process_reserved: u64,
    pub cached_blocks: u64,
    pub hits: u64,
    pub misses: u64,
    pub scrubs: u64,
    pub evictions: u64,
}

/// Accounting and cache of one device.
#[derive(Debug)]
pub struct Pool {
    index: u32,
    granularity: u64,
    total: u64,
    headroom: u64,
    leasable: u64,
    leased: u64,
    reserved: u64,
    quarantined: u64,
    cached: u64,
    /// Room of process reservations (`reservations.rs`): memory their processes allocate
    /// themselves, counted as held so admissions and the outside-memory estimate leave it.
    process_reserved: u64,
    lease_count: u32,
    next_seq: u64,
    /// Cached blocks in least-recently-used order.
    lru: BTreeMap<u64, Block>,
    by_size: HashMap<u64, BTreeSet<u64>>,
    by_size_tenant: HashMap<(u64, Option<String>), BTreeSet<u64>>,
    hits: u64,
    misses: u64,
    scrubs: u64,
    evictions: u64,
}

/// Where the memory of an admitted request comes from.
#[derive(Debug)]
pub enum Source {
    /// A cached block; `scrub` when it last held another tenant's bytes.
    Cached { block: Block, scrub: bool },
    /// A fresh allocation, after freeing the `evicted` cached blocks.
    Fresh { evicted: Vec<Block> },
}

impl Pool {
    /// A pool over a device of `total` bytes of which `leasable` may be handed out.
    pub fn new(index: u32, granularity: u64, total: u64, leasable: u64) -> Pool {
        Pool {
            index,
            granularity,
            total,
            headroom: total.saturating_sub(leasable),
            leasable,
            leased: 0,
            reserved: 0,
            quarantined: 0,
            cached: 0,
            process_reserved: 0,
            lease_count: 0,
            next_seq: 0,
            lru: BTreeMap::new(),
            by_size: HashMap::new(),
            by_size_tenant: HashMap::new(),
            hits: 0,
            misses: 0,
            scrubs: 0,
            evictions: 0,
        }
    }

    pub fn index(&self) -> u32 {
        self.index
    }
    pub fn granularity(&self) -> u64 {
        self.granularity
    }
    pub fn total(&self) -> u64 {
        self.total
    }
    pub fn headroom(&self) -> u64 {
        self.headroom
    }
    pub fn leasable(&self) -> u64 {
        self.leasable
    }
    pub fn lease_count(&self) -> u32 {
        self.lease_count
    }

    /// Bytes promised to someone: leased, being allocated, quarantined, or kept for a
    /// reserved process.
    pub fn committed(&self) -> u64 {
        self.leased + self.reserved + self.quarantined + self.process_reserved
    }

    /// Bytes the broker holds on the device (committed plus cached).
    pub fn held_on_device(&self) -> u64 {
        self.committed() + self.cached
    }

    /// Bytes that can still be promised (the cache can always be trimmed).
    pub fn available(&self) -> u64 {
        self.leasable.saturating_sub(self.committed())
    }

    /// Rounds a request up to the granularity; `None` on overflow.
    pub fn round(&self, bytes: u64) -> Option<u64> {
        crate::units::round_up(bytes, self.granularity)
    }

    /// Is there a cached block of exactly `bytes` (a grant from it needs no allocation)?
    pub fn has_cached(&self, bytes: u64) -> bool {
        self.by_size.get(&bytes).is_some_and(|s| !s.is_empty())
    }

    /// Admits `bytes` (caller checked `available() >= bytes`) and says where they come from.
    pub fn reserve(&mut self, bytes: u64, tenant: &str) -> Source {
        debug_assert!(self.available() >= bytes);
        self.reserve_unchecked(bytes, tenant)
    }

    /// Admits `bytes` a process reservation just gave up for a lease of its process
    /// (`unreserve_process` before): the pool's commitment stays what it was, so there is
    /// no fit to check — a device whose leasable shrank below what it holds (memory used
    /// outside the broker) stays over-committed by the same amount, never more.
    pub fn reserve_drawn(&mut self, bytes: u64, tenant: &str) -> Source {
        self.reserve_unchecked(bytes, tenant)
    }

    fn reserve_unchecked(&mut self, bytes: u64, tenant: &str) -> Source {
        self.reserved += bytes;
        if let Some(block) = self.take_cached(bytes, tenant) {
            self.hits += 1;
            let scrub = block.last_tenant.as_deref().is_some_and(|t| t != tenant);
            if scrub {
                self.scrubs += 1;
            }
            return Source::Cached { block, scrub };
        }
        self.misses += 1;
        Source::Fresh {
            evicted: self.evict_to_fit(),
        }
    }

    /// The cached block `reserve` returned was not used (another tenant's, possibly still
    /// mapped) and a fresh one is allocated instead: count it as a miss.
    pub fn note_replaced(&mut self, scrubbed: bool) {
        self.hits -= 1;
        self.misses += 1;
        if scrubbed {
            self.scrubs -= 1;
        }
    }

    /// Undoes `reserve` when the memory did not become a lease. `block` is the block that
    /// was obtained (cached again), if any.
    pub fn unreserve(&mut self, bytes: u64, block: Option<Block>) {
        self.reserved -= bytes;
        if let Some(b) = block {
            self.put_cached(b);
        }
    }

    /// A reservation became a lease.
    pub fn commit(&mut self, bytes: u64) {
        self.reserved -= bytes;
        self.leased += bytes;
        self.lease_count += 1;
    }

    /// A lease a restarted broker took back holds `bytes` (no fit check: it is in use).
    pub fn adopt(&mut self, bytes: u64) {
        self.leased += bytes;
        self.lease_count += 1;
    }

    /// A lease ended and its block is safe to reuse: cache it.
    pub fn release_to_cache(&mut self, block: Block) {
        self.leased -= block.bytes();
        self.lease_count -= 1;
        self.put_cached(block);
    }

    /// A lease ended and its block must be destroyed: the caller frees it on the device.
    pub fn release_destroyed(&mut self, bytes: u64) {
        self.leased -= bytes;
        self.lease_count -= 1;
    }

    /// A lease ended but a live process may still map its block.
    pub fn release_to_quarantine(&mut self, bytes: u64) {
        self.leased -= bytes;
        self.lease_count -= 1;
        self.quarantined += bytes;
    }

    /// A quarantined block's holder is gone: cache the block.
    pub fn unquarantine_to_cache(&mut self, block: Block) {
        self.quarantined -= block.bytes();
        self.put_cached(block);
    }

    /// A quarantined block is freed on the device.
    pub fn unquarantine_destroyed(&mut self, bytes: u64) {
        self.quarantined -= bytes;
    }

    /// Memory the broker freed stayed on the device, kept by a process outside it
    /// (`state/stranded.rs`): counted as quarantined until that process exits, so the
    /// outside-memory estimate does not count it too. It may take the pool past its
    /// leasable amount for a while, as memory outside the broker does.
    pub fn strand(&mut self, bytes: u64) {
        self.quarantined += bytes;
    }

    /// A block its holder's process retained mapped is leased to it again (no fit to
    /// check: its bytes were held all along).
    pub fn unquarantine_to_lease(&mut self, bytes: u64) {
        self.quarantined -= bytes;
        self.leased += bytes;
        self.lease_count += 1;
    }

    /// Keeps `bytes` (caller checked `available() >= bytes`) for a reserved process.
    /// Returns the cached blocks to free so the broker's holdings fit under the limit.
    pub fn reserve_process(&mut self, bytes: u64) -> Vec<Block> {
        debug_assert!(self.available() >= bytes);
        self.process_reserved += bytes;
        self.evict_to_fit()
    }

    /// A kept process reservation's room taken back at a restart (no check, like
    /// [`Pool::adopt`]: the process runs).
    pub fn adopt_process(&mut self, bytes: u64) {
        self.process_reserved += bytes;
    }

    /// Gives back `bytes` of process-reserved room (the reservation ended, or a lease of
    /// the process draws them and they become a reservation of an allocation).
    pub fn unreserve_process(&mut self, bytes: u64) {
        self.process_reserved -= bytes;
    }

    /// Changes the leasable limit (processes outside the broker took or gave back memory).
    /// Returns the cached blocks to free so the broker's holdings fit again.
    pub fn set_leasable(&mut self, leasable: u64) -> Vec<Block> {
        self.leasable = leasable;
        self.evict_to_fit()
    }

    /// Sets the headroom shown to operators (the configured amount kept free).
    pub fn set_headroom(&mut self, headroom: u64) {
        self.headroom = headroom;
    }

    /// Evicts least recently used cached blocks until at least `bytes` are evicted (or the
    /// cache is empty): memory to give back to the device for processes outside the broker.
    pub fn evict_bytes(&mut self, bytes: u64) -> Vec<Block> {
        let mut out = Vec::new();
        let mut freed = 0;
        while freed < bytes {
            let Some(&seq) = self.lru.keys().next() else {
                break;
            };
            if let Some(b) = self.remove_seq(seq) {
                freed += b.bytes();
                self.evictions += 1;
                out.push(b);
            }
        }
        out
    }

    /// The cached blocks (tests: what may be handed out again).
    #[cfg(test)]
    pub fn cached_blocks(&self) -> impl Iterator<Item = &Block> {
        self.lru.values()
    }

    /// Removes every cached block (shutdown).
    pub fn take_cache(&mut self) -> Vec<Block> {
        let seqs: Vec<u64> = self.lru.keys().copied().collect();
        seqs.into_iter()
            .filter_map(|s| self.remove_seq(s))
            .collect()
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats {
            leasable: self.leasable,
            leased: self.leased,
            reserved: self.reserved,
            quarantined: self.quarantined,
            cached: self.cached,
            process_reserved: self.process_reserved,
            cached_blocks: self.lru.len() as u64,
            hits: self.hits,
            misses: self.misses,
            scrubs: self.scrubs,
            evictions: self.evictions,
        }
    }

    /// Evicts least recently used blocks until holdings fit under `leasable`.
    fn evict_to_fit(&mut self) -> Vec<Block> {
        let mut out = Vec::new();
        while self.held_on_device() > self.leasable {
            let Some(&seq) = self.lru.keys().next() else {
                break;
            };
            if let Some(b) = self.remove_seq(seq) {
                self.evictions += 1;
                out.push(b);
            }
        }
        out
    }

    fn put_cached(&mut self, block: Block) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let bytes = block.bytes();
        self.cached += bytes;
        self.by_size.entry(bytes).or_default().insert(seq);
        self.by_size_tenant
            .entry((bytes, block.last_tenant.clone()))
            .or_default()
            .insert(seq);
        self.lru.insert(seq, block);
    }

    fn take_cached(&mut self, bytes: u64, tenant: &str) -> Option<Block> {
        // Warmest block this tenant used last (no scrub), else a zeroed one, else any.
        let pick = |m: &HashMap<(u64, Option<String>), BTreeSet<u64>>, t: Option<String>| {
            m.get(&(bytes, t))
                .and_then(|s| s.iter().next_back().copied())
        };
        let seq = pick(&self.by_size_tenant, Some(tenant.to_string()))
            .or_else(|| pick(&self.by_size_tenant, None))
            .or_else(|| {
                self.by_size
                    .get(&bytes)
                    .and_then(|s| s.iter().next_back().copied())
            })?;
        self.remove_seq(seq)
    }

    fn remove_seq(&mut self, seq: u64) -> Option<Block> {
        let block = self.lru.remove(&seq)?;
        let bytes = block.bytes();
        self.cached -= bytes;
        if let Some(s) = self.by_size.get_mut(&bytes) {
            s.remove(&seq);
            if s.is_empty() {
                self.by_size.remove(&bytes);
            }
        }
        let key = (bytes, block.last_tenant.clone());
        if let Some(s) = self.by_size_tenant.get_mut(&key) {
            s.remove(&seq);
            if s.is_empty() {
                self.by_size_tenant.remove(&key);
            }
        }
        Some(block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn block(id: u64, bytes: u64, tenant: Option<&str>) -> Block {
        Block {
            alloc: Allocation {
                id,
                bytes,
                addr: 0,
                path: None,
            },
            handle: Handle::Fd {
                kind: crate::memory::MemoryKind::HostMemfd,
                fd: crate::memory::SharedFd::new(std::fs::File::open("/dev/null").unwrap().into()),
                block_id: id,
                size: bytes,
            },
            last_tenant: tenant.map(str::to_string),
            reached: Default::default(),
        }
    }

    #[test]
    fn a_block_remembers_the_newest_processes_it_reached_once_each() {
        let mut r = Reached::default();
        assert!(r.is_empty());
        assert!(r.add(7, None));
        assert!(r.add(8, None));
        assert!(!r.add(7, None), "named already: its record need not change");
        assert_eq!(r.pids(), &[8, 7]);
        for pid in 100..100 + Reached::MAX as u32 {
            r.add(pid, None);
        }
        assert_eq!(r.pids().len(), Reached::MAX);
        assert_eq!(r.pids()[0], 100, "the oldest went first");
        assert_eq!(*r.pids().last().unwrap(), 99 + Reached::MAX as u32);
        // Each process's place stays beside it.
        let place = Arc::new(Place {
            pid: 5,
            ..Place::default()
        });
        r.add(5, Some(place.clone()));
        r.add(6, None);
        let at = r.pids().iter().position(|&p| p == 5).unwrap();
        assert!(Arc::ptr_eq(r.places()[at].as_ref().unwrap(), &place));
        assert_eq!(r.places().len(), Reached::MAX);
    }

    /// What a kept record names of it: each process in order, its start time from its
    /// place, its tenant where that is not the block's.
    #[test]
    fn a_blocks_reached_processes_are_recorded_with_start_and_tenant() {
        let mut r = Reached::default();
        assert!(r.records().is_empty());
        let place = Arc::new(Place {
            pid: 7,
            start: Some(1234),
            ..Place::default()
        });
        r.add(7, Some(place));
        assert!(r.add_of(9, "b", None));
        assert!(r.add_of(9, "c", None), "another tenant's now");
        // A later process of pid 7 (another start time) is new; the same one is not.
        let later = |start| {
            Some(Arc::new(Place {
                pid: 7,
                start: Some(start),
                ..Place::default()
            }))
        };
        assert!(r.add(7, later(5678)), "a later process of the pid");
        assert!(!r.add(7, later(5678)), "the same process again");
        assert!(r.add(7, later(1234)));
        let rec = |pid, start, tenant: Option<&str>| crate::kept::ReachedRecord {
            pid,
            start,
            tenant: tenant.map(str::to_string),
        };
        assert_eq!(
            r.records(),
            [rec(9, None, Some("c")), rec(7, Some(1234), None)]
        );
    }

    #[test]
    fn memory_kept_is_answered_for_by_the_blocks_tenant_unless_only_importers_could_keep_it() {
        let mut r = Reached::default();
        r.add(1, None);
        r.add_of(2, "b", None);
        r.add_of(3, "c", None);
        // Only another tenant's importers alive: the newest one's tenant.
        assert_eq!(r.answers_for(&[2], "a"), "b");
        assert_eq!(r.answers_for(&[3, 2], "a"), "c");
        // One of the block's own processes could have kept it: its tenant.
        assert_eq!(r.answers_for(&[2, 1], "a"), "a");
        // A process this block does not know of, or none: its tenant.
        assert_eq!(r.answers_for(&[9], "a"), "a");
        assert_eq!(Reached::default().answers_for(&[2], "a"), "a");
        // Re-added as its own tenant's: no longer another's.
        r.add(2, None);
        assert_eq!(r.answers_for(&[2], "a"), "a");
        assert_eq!(r.pids(), &[1, 3, 2]);
    }

    fn lease_fresh(p: &mut Pool, id: u64, bytes: u64, tenant: &str) -> Block {
        match p.reserve(bytes, tenant) {
            Source::Fresh { .. } => {}
            other => panic!("expected fresh, got {other:?}"),
        }
        p.commit(bytes);
        block(id, bytes, Some(tenant))
    }

    #[test]
    fn rounds_to_granularity() {
        let p = Pool::new(0, 2 * MIB, 100 * MIB, 90 * MIB);
        assert_eq!(p.round(1), Some(2 * MIB));
        assert_eq!(p.round(3 * MIB), Some(4 * MIB));
        assert_eq!(p.headroom(), 10 * MIB);
    }

    #[test]
    fn reuse_same_tenant_needs_no_scrub_other_tenant_does() {
        let mut p = Pool::new(0, 2 * MIB, 100 * MIB, 100 * MIB);
        let b = lease_fresh(&mut p, 1, 4 * MIB, "a");
        p.release_to_cache(b);
        assert_eq!(p.stats().cached, 4 * MIB);
        match p.reserve(4 * MIB, "a") {
            Source::Cached { scrub, block } => {
                assert!(!scrub);
                p.commit(4 * MIB);
                p.release_to_cache(block);
            }
            other => panic!("{other:?}"),
        }
        match p.reserve(4 * MIB, "b") {
            Source::Cached { scrub, .. } => assert!(scrub),
            other => panic!("{other:?}"),
        }
        assert_eq!(p.stats().scrubs, 1);
    }

    #[test]
    fn prefers_own_block_over_another_tenants() {
        let mut p = Pool::new(0, 2 * MIB, 100 * MIB, 100 * MIB);
        let a = lease_fresh(&mut p, 1, 2 * MIB, "a");
        let b = lease_fresh(&mut p, 2, 2 * MIB, "b");
        p.release_to_cache(a);
        p.release_to_cache(b);
        match p.reserve(2 * MIB, "a") {
            Source::Cached { block, scrub } => {
                assert_eq!(block.alloc.id, 1);
                assert!(!scrub);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn evicts_lru_blocks_when_a_fresh_allocation_needs_room() {
        let mut p = Pool::new(0, 2 * MIB, 10 * MIB, 10 * MIB);
        let b1 = lease_fresh(&mut p, 1, 4 * MIB, "a");
        let b2 = lease_fresh(&mut p, 2, 4 * MIB, "a");
        p.release_to_cache(b1);
        p.release_to_cache(b2);
        assert_eq!(p.available(), 10 * MIB);
        match p.reserve(6 * MIB, "a") {
            Source::Fresh { evicted } => {
                // 8 cached + 6 new > 10: the oldest block goes first, one is enough.
                assert_eq!(evicted.len(), 1);
                assert_eq!(evicted[0].alloc.id, 1);
            }
            other => panic!("{other:?}"),
        }
        assert!(p.held_on_device() <= p.leasable());
    }

    #[test]
    fn quarantine_counts_until_released() {
        let mut p = Pool::new(0, 2 * MIB, 10 * MIB, 10 * MIB);
        let b = lease_fresh(&mut p, 1, 4 * MIB, "a");
        p.release_to_quarantine(4 * MIB);
        assert_eq!(p.available(), 6 * MIB);
        p.unquarantine_to_cache(b);
        assert_eq!(p.available(), 10 * MIB);
        assert_eq!(p.stats().quarantined, 0);
    }

    #[test]
    fn evict_bytes_takes_oldest_blocks_until_enough() {
        let mut p = Pool::new(0, 2 * MIB, 100 * MIB, 100 * MIB);
        let blocks: Vec<Block> = (1..=3)
            .map(|id| lease_fresh(&mut p, id, 4 * MIB, "a"))
            .collect();
        for b in blocks {
            p.release_to_cache(b);
        }
        let out = p.evict_bytes(6 * MIB);
        assert_eq!(
            out.iter().map(|b| b.alloc.id).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert_eq!(p.stats().cached, 4 * MIB);
    }

    #[test]
    fn shrinking_leasable_trims_cache() {
        let mut p = Pool::new(0, 2 * MIB, 10 * MIB, 10 * MIB);
        let b = lease_fresh(&mut p, 1, 4 * MIB, "a");
        p.release_to_cache(b);
        let freed = p.set_leasable(2 * MIB);
        assert_eq!(freed.len(), 1);
        assert_eq!(p.stats().cached, 0);
    }
}
