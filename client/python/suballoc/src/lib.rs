//! The caching sub-allocator behind `gpubroker.torch`: it carves the memory PyTorch asks
//! for out of large **segments**, each one broker lease mapped into the process, so a
//! training job's CUDA memory lives inside its tenant's quota and almost no allocation
//! costs a broker call.
//!
//! What it owns (and tests against a fake device, `tests` below):
//! - **split and coalesce**: best fit over the free blocks of the oldest segment that
//!   can serve the request (so allocations pack into the first segments and the later
//!   ones empty out, to be given back); a block is split to the (aligned) size asked,
//!   and freed blocks merge with free neighbours;
//! - **stream-ordered reuse**: a freed block remembers an event recorded on the stream it
//!   was used on; it is handed to the same stream at once, to another stream only once
//!   that event completed (or after waiting for it, before asking the broker for more);
//! - **growth**: a miss takes a new segment of `Config::segment_bytes` (or the request
//!   rounded up to the granularity) without waiting; when that is refused it gives back
//!   its fully free segments and asks for an exact-size lease, still without waiting.
//!   Over the tenant's own quota it then fails at once (nothing comes by waiting); only
//!   a full card waits for an exact-size lease up to `Config::wait` (the broker's
//!   queue). A failure carries the broker's message (kept in
//!   [`SubAllocator::last_error`]);
//! - **reclaim**: a reclaim request (or revocation) for a segment with no live block
//!   releases it at once; a segment still in use is drained: nothing new is placed in it
//!   and it is released when its last block is freed. [`SubAllocator::empty_cache`]
//!   releases every fully free segment.
//!
//! The device side (leases, mappings, events) is the [`Backend`] trait: the CUDA backend
//! over broker leases lives in the `gpubroker` extension; this crate never makes a CUDA
//! or gRPC call itself and never touches Python.

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::Duration;

use parking_lot::Mutex;

/// A CUDA stream as an address (`cudaStream_t`; 0 is the legacy default stream).
pub type Stream = usize;

/// An event the backend recorded on a stream.
pub type EventId = u64;

/// A segment the backend acquired: `bytes` of device memory at `base`, held as one lease.
pub struct Granted {
    /// Device address of the segment's first byte.
    pub base: u64,
    /// Its size (the lease's granted size).
    pub bytes: u64,
    /// The lease's id (what reclaim requests and revocations name).
    pub lease_id: String,
    /// What the backend needs to give it back (mapping + lease); handed to `release`.
    pub token: Box<dyn Any + Send>,
}

impl fmt::Debug for Granted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Granted")
            .field("base", &format_args!("{:#x}", self.base))
            .field("bytes", &self.bytes)
            .field("lease_id", &self.lease_id)
            .finish_non_exhaustive()
    }
}

/// Why the backend could not give a segment: the broker's refusal, as it said it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The gRPC code's name (`RESOURCE_EXHAUSTED`, `DEADLINE_EXCEEDED`, ...).
    pub code: String,
    /// The broker's machine-readable reason (`QUOTA_EXCEEDED`, `WAIT_EXPIRED`, ...),
    /// where it sent one.
    pub reason: Option<String>,
    /// For a lost wait, the reason it would have been refused with without waiting
    /// (`CAPACITY_EXHAUSTED`, `QUOTA_EXCEEDED`, ...).
    pub cause: Option<String>,
    /// The broker's message (it carries the numbers).
    pub message: String,
}

impl Refused {
    /// A refusal with no machine-readable reason (a local one).
    pub fn plain(code: &str, message: String) -> Self {
        Refused {
            code: code.into(),
            reason: None,
            cause: None,
            message,
        }
    }
}

impl fmt::Display for Refused {
    /// `CODE (REASON, cause CAUSE): message`, leaving out what is not known.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.code)?;
        match (&self.reason, &self.cause) {
            (Some(r), Some(c)) => write!(f, " ({r}, cause {c})")?,
            (Some(r), None) => write!(f, " ({r})")?,
            _ => {}
        }
        write!(f, ": {}", self.message)
    }
}

/// The device side of the allocator.
pub trait Backend: Send + Sync {
    /// Takes a segment of at least `bytes` on `device`; with `wait`, the broker may
    /// queue the request that long. Blocks the calling thread (never needs the GIL).
    fn acquire(&self, device: u32, bytes: u64, wait: Option<Duration>) -> Result<Granted, Refused>;
    /// Gives a segment back (unmap, then release the lease). Every event recorded on its
    /// blocks has completed.
    fn release(&self, token: Box<dyn Any + Send>);
    /// Records an event on `stream` of `device`.
    fn record(&self, device: u32, stream: Stream) -> Result<EventId, String>;
    /// True once the event completed.
    fn query(&self, event: EventId) -> bool;
    /// Waits for the event.
    fn synchronize(&self, event: EventId);
    /// Frees the event.
    fn destroy(&self, event: EventId);
    /// Waits for all work on `device` (when an event could not be recorded).
    fn synchronize_device(&self, device: u32);
}

/// Tuning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Size of a new segment (one lease); larger requests get a segment of their own.
    pub segment_bytes: u64,
    /// The broker's allocation granularity: exact-size leases are rounded up to it.
    pub granularity: u64,
    /// Every block starts at a multiple of this (and sizes are rounded up to it).
    pub alignment: u64,
    /// How long an allocation waits in the broker's queue before it fails.
    pub wait: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            segment_bytes: 1 << 30,
            granularity: 2 << 20,
            alignment: 512,
            wait: Duration::from_secs(60),
        }
    }
}

/// Why an allocation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllocError {
    /// The broker refused (quota or card full after waiting, or another refusal).
    Refused(Refused),
    /// A size no segment can have.
    TooLarge(u64),
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::Refused(r) => write!(f, "no segment could be leased and mapped: {r}"),
            AllocError::TooLarge(n) => write!(f, "cannot allocate {n} bytes"),
        }
    }
}

impl std::error::Error for AllocError {}

/// Why a free failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FreeError {
    /// The pointer is not a live allocation of this allocator.
    Unknown(u64),
}

impl fmt::Display for FreeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FreeError::Unknown(p) => write!(f, "{p:#x} is not a live allocation"),
        }
    }
}

impl std::error::Error for FreeError {}

/// What a reclaim request (or revocation) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reclaim {
    /// The segment had no live block: released.
    Released,
    /// The segment still holds live blocks: nothing new goes there, and it is released
    /// when the last one is freed.
    Draining,
    /// Not a segment of this allocator.
    Unknown,
}

/// Counters and gauges (`gpubroker.torch.memory_stats()`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes of live blocks (aligned sizes).
    pub allocated_bytes: u64,
    /// Bytes asked for by live blocks.
    pub requested_bytes: u64,
    /// Bytes of every segment held (= leased bytes).
    pub reserved_bytes: u64,
    /// Highest `allocated_bytes` seen.
    pub peak_allocated_bytes: u64,
    /// Highest `reserved_bytes` seen.
    pub peak_reserved_bytes: u64,
    /// Segments (leases) held.
    pub segments: u64,
    /// Of those, draining (asked back, still in use).
    pub draining_segments: u64,
    /// Live blocks.
    pub active_blocks: u64,
    /// Free blocks.
    pub free_blocks: u64,
    /// Allocations served.
    pub allocs: u64,
    /// Frees.
    pub frees: u64,
    /// Allocations that reached the broker (a segment acquired or refused).
    pub broker_acquires: u64,
    /// Segments given back.
    pub broker_releases: u64,
    /// Allocations that waited in the broker's queue.
    pub waits: u64,
    /// Allocations that waited for another stream's work before reusing a block.
    pub stream_syncs: u64,
    /// Allocations that failed.
    pub ooms: u64,
    /// Segments released because the broker asked for them (or revoked them).
    pub reclaimed_segments: u64,
}

#[derive(Debug)]
enum Use {
    Free { pending: Vec<(Stream, EventId)> },
    Used { stream: Stream, requested: u64 },
}

#[derive(Debug)]
struct Block {
    size: u64,
    used: Use,
}

struct Segment {
    device: u32,
    base: u64,
    bytes: u64,
    lease_id: String,
    token: Option<Box<dyn Any + Send>>,
    /// Blocks by offset; together they cover the segment.
    blocks: BTreeMap<u64, Block>,
    used_bytes: u64,
    draining: bool,
}

#[derive(Default)]
struct State {
    segments: BTreeMap<u64, Segment>,
    next_segment: u64,
    /// Live block address -> segment id.
    live: HashMap<u64, u64>,
    /// How many free blocks hold each event.
    event_refs: HashMap<EventId, u32>,
    stats: Stats,
}

/// The allocator. `Sync`: every call may come from any thread.
pub struct SubAllocator<B: Backend> {
    backend: B,
    config: Config,
    state: Mutex<State>,
    last_error: Mutex<Option<AllocError>>,
}

fn round_up(n: u64, to: u64) -> Option<u64> {
    let to = to.max(1);
    n.checked_add(to - 1).map(|v| v / to * to)
}

/// A segment taken out of the state, to release outside the lock.
struct Leaving {
    token: Option<Box<dyn Any + Send>>,
    events: Vec<EventId>,
}

impl<B: Backend> SubAllocator<B> {
    /// An allocator with no segments yet.
    pub fn new(backend: B, config: Config) -> Self {
        SubAllocator {
            backend,
            config,
            state: Mutex::new(State::default()),
            last_error: Mutex::new(None),
        }
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The configuration.
    pub fn config(&self) -> Config {
        self.config
    }

    /// Allocates `size` bytes on `device` for use on `stream`; returns the device address.
    pub fn alloc(&self, device: u32, size: u64, stream: Stream) -> Result<u64, AllocError> {
        let need =
            round_up(size.max(1), self.config.alignment).ok_or(AllocError::TooLarge(size))?;
        let exact = round_up(need, self.config.granularity).ok_or(AllocError::TooLarge(size))?;
        if let Some(ptr) = self.carve(device, need, size, stream, false) {
            return Ok(ptr);
        }
        // A new segment, without waiting.
        let seg = self.config.segment_bytes.max(exact);
        let first = match self.acquire_and_carve(device, seg, None, need, size, stream) {
            Ok(ptr) => return Ok(ptr),
            Err(r) => {
                tracing::debug!(device, seg, refused = %r, "no segment without waiting");
                r
            }
        };
        // A block another stream freed, once its work is done.
        if let Some(ptr) = self.carve(device, need, size, stream, true) {
            return Ok(ptr);
        }
        // Give back what does not fit and ask for exactly this, still without waiting.
        let released = self.release_free_segments(Some(device));
        let refused = if released > 0 || exact < seg {
            match self.acquire_and_carve(device, exact, None, need, size, stream) {
                Ok(ptr) => return Ok(ptr),
                Err(r) => r,
            }
        } else {
            first
        };
        // Over the tenant's own quota nothing can come by waiting: fail now. Only a full
        // card (other tenants' memory) is worth the broker's queue.
        let refused = if worth_waiting(&refused) {
            self.state.lock().stats.waits += 1;
            match self.acquire_and_carve(device, exact, Some(self.config.wait), need, size, stream)
            {
                Ok(ptr) => return Ok(ptr),
                Err(r) => r,
            }
        } else {
            refused
        };
        self.state.lock().stats.ooms += 1;
        let err = AllocError::Refused(refused);
        *self.last_error.lock() = Some(err.clone());
        Err(err)
    }

    /// Frees a block `alloc` returned; `stream` is ignored (the block remembers the
    /// stream it was allocated for, which is the one its work was queued on).
    pub fn free(&self, ptr: u64) -> Result<(), FreeError> {
        let leaving = {
            let mut st = self.state.lock();
            let seg_id = st.live.remove(&ptr).ok_or(FreeError::Unknown(ptr))?;
            let State {
                segments,
                event_refs,
                stats,
                ..
            } = &mut *st;
            let Some(seg) = segments.get_mut(&seg_id) else {
                return Err(FreeError::Unknown(ptr));
            };
            let off = ptr - seg.base;
            let Some(block) = seg.blocks.get_mut(&off) else {
                return Err(FreeError::Unknown(ptr));
            };
            let Use::Used { stream, requested } = block.used else {
                return Err(FreeError::Unknown(ptr));
            };
            let size = block.size;
            let pending = match self.backend.record(seg.device, stream) {
                Ok(ev) => {
                    *event_refs.entry(ev).or_default() += 1;
                    vec![(stream, ev)]
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot record a CUDA event; synchronizing the device");
                    self.backend.synchronize_device(seg.device);
                    Vec::new()
                }
            };
            block.used = Use::Free { pending };
            seg.used_bytes -= size;
            stats.allocated_bytes -= size;
            stats.requested_bytes -= requested;
            stats.active_blocks -= 1;
            stats.free_blocks += 1;
            stats.frees += 1;
            coalesce(seg, off, stats);
            if seg.draining && seg.used_bytes == 0 {
                Some(self.take_segment(&mut st, seg_id))
            } else {
                None
            }
        };
        if let Some(l) = leaving {
            self.finish_release(l);
        }
        Ok(())
    }

    /// A reclaim request (or revocation) for the segment of `lease_id`.
    pub fn reclaim(&self, lease_id: &str) -> Reclaim {
        let leaving = {
            let mut st = self.state.lock();
            let Some((&id, seg)) = st.segments.iter_mut().find(|(_, s)| s.lease_id == lease_id)
            else {
                return Reclaim::Unknown;
            };
            if seg.used_bytes > 0 {
                if !seg.draining {
                    seg.draining = true;
                    st.stats.draining_segments += 1;
                }
                return Reclaim::Draining;
            }
            st.stats.reclaimed_segments += 1;
            self.take_segment(&mut st, id)
        };
        self.finish_release(leaving);
        Reclaim::Released
    }

    /// Releases every fully free segment (of `device`, or of all devices); returns the
    /// bytes given back.
    pub fn release_free_segments(&self, device: Option<u32>) -> u64 {
        let (leaving, bytes) = {
            let mut st = self.state.lock();
            let ids: Vec<(u64, u64)> = st
                .segments
                .iter()
                .filter(|(_, s)| s.used_bytes == 0 && device.is_none_or(|d| d == s.device))
                .map(|(&id, s)| (id, s.bytes))
                .collect();
            let bytes = ids.iter().map(|(_, b)| b).sum();
            let leaving: Vec<Leaving> = ids
                .into_iter()
                .map(|(id, _)| self.take_segment(&mut st, id))
                .collect();
            (leaving, bytes)
        };
        for l in leaving {
            self.finish_release(l);
        }
        bytes
    }

    /// What `gpubroker.torch.empty_cache()` does: releases every fully free segment.
    pub fn empty_cache(&self) -> u64 {
        self.release_free_segments(None)
    }

    /// Counters and gauges now.
    pub fn stats(&self) -> Stats {
        self.state.lock().stats
    }

    /// The lease ids of the segments held now.
    pub fn lease_ids(&self) -> Vec<String> {
        self.state
            .lock()
            .segments
            .values()
            .map(|s| s.lease_id.clone())
            .collect()
    }

    /// The message of the last failed allocation (the broker's refusal).
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().as_ref().map(ToString::to_string)
    }

    /// The last failed allocation's error, and forgets it (a later, unrelated failure
    /// does not repeat an old reason).
    pub fn take_last_error(&self) -> Option<AllocError> {
        self.last_error.lock().take()
    }

    /// Best fit over the usable free blocks of the oldest segment that has one; with
    /// `sync`, also blocks whose only obstacle is another stream's pending work (waited
    /// for here).
    fn carve(
        &self,
        device: u32,
        need: u64,
        requested: u64,
        stream: Stream,
        sync: bool,
    ) -> Option<u64> {
        let mut st = self.state.lock();
        let State {
            segments,
            live,
            event_refs,
            stats,
            ..
        } = &mut *st;
        let mut best: Option<(u64, u64, u64, bool)> = None; // (size, seg, off, needs_sync)
        for (&id, seg) in segments.iter_mut() {
            if seg.device != device || seg.draining {
                continue;
            }
            for (&off, block) in seg.blocks.iter_mut() {
                let Use::Free { pending } = &mut block.used else {
                    continue;
                };
                if block.size < need {
                    continue;
                }
                // Forget completed events; the rest must be on this stream (or waited for).
                pending.retain(|&(s, ev)| {
                    if s != stream && self.backend.query(ev) {
                        unref(event_refs, &self.backend, ev);
                        false
                    } else {
                        true
                    }
                });
                let blocked = pending.iter().any(|&(s, _)| s != stream);
                if blocked && !sync {
                    continue;
                }
                if best.is_none_or(|(size, ..)| block.size < size) {
                    best = Some((block.size, id, off, blocked));
                }
            }
            // The oldest segment that fits wins (best fit within it): allocations pack
            // into the first segments, so the later ones empty out and can go back.
            if best.is_some() {
                break;
            }
        }
        let (_, id, off, blocked) = best?;
        let seg = segments.get_mut(&id)?;
        let mut block = seg.blocks.remove(&off)?;
        let Use::Free { pending } =
            std::mem::replace(&mut block.used, Use::Used { stream, requested })
        else {
            return None;
        };
        if blocked {
            stats.stream_syncs += 1;
        }
        let mut kept = Vec::new();
        for (s, ev) in pending {
            if s != stream {
                // Another stream's work on these bytes must finish first.
                self.backend.synchronize(ev);
                unref(event_refs, &self.backend, ev);
            } else {
                kept.push((s, ev));
            }
        }
        if block.size > need {
            for &(_, ev) in &kept {
                *event_refs.entry(ev).or_default() += 1;
            }
            seg.blocks.insert(
                off + need,
                Block {
                    size: block.size - need,
                    used: Use::Free {
                        pending: kept.clone(),
                    },
                },
            );
            stats.free_blocks += 1;
        }
        // Work queued on the same stream runs after what is pending: nothing to keep.
        for (_, ev) in kept {
            unref(event_refs, &self.backend, ev);
        }
        block.size = need;
        seg.blocks.insert(off, block);
        seg.used_bytes += need;
        stats.free_blocks -= 1;
        stats.active_blocks += 1;
        stats.allocs += 1;
        stats.allocated_bytes += need;
        stats.requested_bytes += requested;
        stats.peak_allocated_bytes = stats.peak_allocated_bytes.max(stats.allocated_bytes);
        let ptr = seg.base + off;
        live.insert(ptr, id);
        Some(ptr)
    }

    /// Acquires a segment and serves the allocation from it in the same critical section
    /// (no other thread can take the fresh segment first).
    fn acquire_and_carve(
        &self,
        device: u32,
        bytes: u64,
        wait: Option<Duration>,
        need: u64,
        requested: u64,
        stream: Stream,
    ) -> Result<u64, Refused> {
        self.state.lock().stats.broker_acquires += 1;
        let granted = self.backend.acquire(device, bytes, wait)?;
        // One critical section from inserting the segment to carving from it: in between,
        // another thread's carve would take its first block (then both got its base) or
        // release it as wholly free.
        let mut st = self.state.lock();
        let id = {
            let id = st.next_segment;
            st.next_segment += 1;
            let mut blocks = BTreeMap::new();
            blocks.insert(
                0,
                Block {
                    size: granted.bytes,
                    used: Use::Free {
                        pending: Vec::new(),
                    },
                },
            );
            st.segments.insert(
                id,
                Segment {
                    device,
                    base: granted.base,
                    bytes: granted.bytes,
                    lease_id: granted.lease_id,
                    token: Some(granted.token),
                    blocks,
                    used_bytes: 0,
                    draining: false,
                },
            );
            st.stats.segments += 1;
            st.stats.free_blocks += 1;
            st.stats.reserved_bytes += granted.bytes;
            st.stats.peak_reserved_bytes =
                st.stats.peak_reserved_bytes.max(st.stats.reserved_bytes);
            id
        };
        if granted.bytes < need {
            return Err(Refused::plain(
                "INTERNAL",
                format!(
                    "the broker granted {} bytes for a request of {bytes}",
                    granted.bytes
                ),
            ));
        }
        // The fresh segment is wholly free: carve from it directly.
        let State {
            segments,
            live,
            stats,
            ..
        } = &mut *st;
        let seg = segments
            .get_mut(&id)
            .ok_or_else(|| Refused::plain("INTERNAL", "segment vanished".into()))?;
        let Some(mut block) = seg.blocks.remove(&0) else {
            return Err(Refused::plain(
                "INTERNAL",
                "fresh segment already used".into(),
            ));
        };
        if block.size > need {
            seg.blocks.insert(
                need,
                Block {
                    size: block.size - need,
                    used: Use::Free {
                        pending: Vec::new(),
                    },
                },
            );
            stats.free_blocks += 1;
        }
        block.size = need;
        block.used = Use::Used { stream, requested };
        seg.blocks.insert(0, block);
        seg.used_bytes = need;
        stats.free_blocks -= 1;
        stats.active_blocks += 1;
        stats.allocs += 1;
        stats.allocated_bytes += need;
        stats.requested_bytes += requested;
        stats.peak_allocated_bytes = stats.peak_allocated_bytes.max(stats.allocated_bytes);
        live.insert(seg.base, id);
        Ok(seg.base)
    }

    /// Removes a segment (no live block) from the state.
    fn take_segment(&self, st: &mut State, id: u64) -> Leaving {
        let Some(mut seg) = st.segments.remove(&id) else {
            return Leaving {
                token: None,
                events: Vec::new(),
            };
        };
        let mut events = Vec::new();
        for block in seg.blocks.values_mut() {
            if let Use::Free { pending } = &mut block.used {
                for (_, ev) in pending.drain(..) {
                    events.push(ev);
                }
            }
            st.stats.free_blocks -= 1;
        }
        st.stats.segments -= 1;
        if seg.draining {
            st.stats.draining_segments -= 1;
        }
        st.stats.reserved_bytes -= seg.bytes;
        st.stats.broker_releases += 1;
        // Blocks never span segments, so every holder of these events was in this one:
        // they are waited for and destroyed outside the lock.
        events.sort_unstable();
        events.dedup();
        for ev in &events {
            st.event_refs.remove(ev);
        }
        Leaving {
            token: seg.token.take(),
            events,
        }
    }

    fn finish_release(&self, leaving: Leaving) {
        for ev in leaving.events {
            self.backend.synchronize(ev);
            self.backend.destroy(ev);
        }
        if let Some(token) = leaving.token {
            self.backend.release(token);
        }
    }
}

/// Refusals that name the tenant's own limits: its quota (overall or on the device), its
/// lease count, or a size the card can never hold. No other tenant's release changes
/// them, so waiting in the broker's queue would only stall the allocation.
const OWN_LIMITS: [&str; 4] = [
    "QUOTA_EXCEEDED",
    "DEVICE_QUOTA_EXCEEDED",
    "LEASE_COUNT_LIMIT",
    "REQUEST_TOO_LARGE",
];

/// Whether a refusal given without waiting may turn into a grant by waiting in the
/// broker's queue: a full card, or a refusal that names no reason (an older broker).
pub fn worth_waiting(refused: &Refused) -> bool {
    refused.code == "RESOURCE_EXHAUSTED"
        && !refused
            .reason
            .as_deref()
            .is_some_and(|r| OWN_LIMITS.contains(&r))
}

fn unref<B: Backend>(refs: &mut HashMap<EventId, u32>, backend: &B, ev: EventId) {
    if let Some(n) = refs.get_mut(&ev) {
        *n -= 1;
        if *n == 0 {
            refs.remove(&ev);
            backend.destroy(ev);
        }
    }
}

/// Merges the free block at `off` with free neighbours.
fn coalesce(seg: &mut Segment, off: u64, stats: &mut Stats) {
    let mut start = off;
    if let Some((&prev_off, prev)) = seg.blocks.range(..off).next_back() {
        if matches!(prev.used, Use::Free { .. }) && prev_off + prev.size == off {
            start = prev_off;
        }
    }
    loop {
        let Some(cur) = seg.blocks.get(&start) else {
            return;
        };
        let next_off = start + cur.size;
        let next_is_free = seg
            .blocks
            .get(&next_off)
            .is_some_and(|b| matches!(b.used, Use::Free { .. }));
        if !next_is_free || !matches!(cur.used, Use::Free { .. }) {
            return;
        }
        let Some(next) = seg.blocks.remove(&next_off) else {
            return;
        };
        let Some(cur) = seg.blocks.get_mut(&start) else {
            return;
        };
        cur.size += next.size;
        if let (Use::Free { pending }, Use::Free { pending: more }) = (&mut cur.used, next.used) {
            pending.extend(more);
        }
        stats.free_blocks -= 1;
    }
}

#[cfg(test)]
mod tests;
