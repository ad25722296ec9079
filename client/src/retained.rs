//! Blocks this process retained mapped after releasing their leases, per session: with
//! [`crate::Session::retain_mappings`] a [`crate::Lease::release`] asks the broker to
//! hold the block for the tenant (`ReleaseLeaseRequest.retain_mapping`) and keeps the
//! lease's descriptor and mapping here; the next lease of that size the broker grants
//! from it (`FdHandle.retained`) takes them back: one RPC, no ticket, no import, no map.
//!
//! The cache is bounded in bytes: past its bound the oldest blocks are let go (unmapped,
//! closed, then confirmed with a release of their ended lease id, after which the broker
//! may hand the memory on; a release that went over the bound returns once confirmed). The broker asks for one back when others wait
//! ([`crate::SessionEvent::DropRetained`]): the session's listener lets it go the same
//! way. A retained block stays counted to the tenant until it is let go.

use std::collections::VecDeque;
use std::os::fd::OwnedFd;

use parking_lot::Mutex;

use crate::mapping::HostMapping;

/// A lease's own mapping, kept with its descriptor.
pub(crate) enum Kept {
    Host(HostMapping<'static>),
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaMapping),
    /// A [`crate::Resident`]'s address range, mapped.
    Range(crate::address_range::Range),
}

/// One retained block.
pub(crate) struct Entry {
    /// The ended lease the broker holds it under (the id to confirm with).
    pub ended: String,
    pub block_id: u64,
    pub bytes: u64,
    pub fd: OwnedFd,
    pub mapping: Option<Kept>,
}

/// The session's retained blocks, oldest first, and their bound in bytes (0: off).
#[derive(Default)]
pub(crate) struct RetainedCache {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    bound: u64,
    held: u64,
    entries: VecDeque<Entry>,
    /// Whether the listener for the broker's requests runs.
    listening: bool,
}

impl RetainedCache {
    /// Sets the bound; returns the entries now over it (to let go) and whether the
    /// listener must be started.
    pub fn set_bound(&self, bytes: u64) -> (Vec<Entry>, bool) {
        let mut i = self.inner.lock();
        i.bound = bytes;
        let start = bytes > 0 && !i.listening;
        i.listening |= start;
        (i.over_bound(), start)
    }

    /// Is retaining on?
    pub fn enabled(&self) -> bool {
        self.inner.lock().bound > 0
    }

    /// Keeps `e`; returns the entries to let go so the bound holds (possibly `e` itself,
    /// when it alone is larger).
    pub fn put(&self, e: Entry) -> Vec<Entry> {
        let mut i = self.inner.lock();
        i.held += e.bytes;
        i.entries.push_back(e);
        i.over_bound()
    }

    /// Is a block retained that a lease of `bytes` would be granted (its size is `bytes`
    /// rounded up to the device's granularity, at most 2 MiB)?
    pub fn fits(&self, bytes: u64) -> bool {
        const LARGEST_GRANULE: u64 = 2 << 20;
        let i = self.inner.lock();
        i.entries
            .iter()
            .any(|e| e.bytes >= bytes && e.bytes - bytes < LARGEST_GRANULE)
    }

    /// Takes the entry of block `block_id` (a lease was granted from it).
    pub fn take_block(&self, block_id: u64) -> Option<Entry> {
        self.inner.lock().take(|e| e.block_id == block_id)
    }

    /// Takes the entry retained under ended lease `id` (the broker wants it back).
    pub fn take_ended(&self, id: &str) -> Option<Entry> {
        self.inner.lock().take(|e| e.ended == id)
    }

    /// Takes every entry.
    pub fn take_all(&self) -> Vec<Entry> {
        let mut i = self.inner.lock();
        i.held = 0;
        i.entries.drain(..).collect()
    }

    /// Bytes retained now.
    pub fn held(&self) -> u64 {
        self.inner.lock().held
    }
}

impl Inner {
    fn take(&mut self, f: impl Fn(&Entry) -> bool) -> Option<Entry> {
        let at = self.entries.iter().position(f)?;
        let e = self.entries.remove(at)?;
        self.held -= e.bytes;
        Some(e)
    }

    fn over_bound(&mut self) -> Vec<Entry> {
        let mut out = Vec::new();
        while self.held > self.bound {
            let Some(e) = self.entries.pop_front() else {
                break;
            };
            self.held -= e.bytes;
            out.push(e);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u64, bytes: u64) -> Entry {
        let fd = std::fs::File::open("/dev/null").unwrap().into();
        Entry {
            ended: format!("lease-{id}"),
            block_id: id,
            bytes,
            fd,
            mapping: None,
        }
    }

    #[test]
    fn the_oldest_blocks_go_past_the_bound_and_entries_are_taken_by_block_or_lease() {
        let c = RetainedCache::default();
        assert!(!c.enabled());
        let (over, start) = c.set_bound(10);
        assert!(over.is_empty() && start);
        assert!(!c.set_bound(10).1, "one listener");
        assert!(c.put(entry(1, 4)).is_empty());
        assert!(c.put(entry(2, 4)).is_empty());
        let out = c.put(entry(3, 4));
        assert_eq!(out.iter().map(|e| e.block_id).collect::<Vec<_>>(), vec![1]);
        assert_eq!(c.held(), 8);
        assert_eq!(c.take_block(3).map(|e| e.block_id), Some(3));
        assert!(c.take_block(3).is_none());
        assert!(
            c.fits(4) && c.fits(3) && !c.fits(5),
            "a size rounded up to a block"
        );
        assert_eq!(c.take_ended("lease-2").map(|e| e.block_id), Some(2));
        assert_eq!(c.held(), 0);
        assert_eq!(c.put(entry(4, 11)).len(), 1, "larger than the bound alone");
        let (over, _) = c.set_bound(0);
        assert!(over.is_empty());
        assert!(!c.enabled());
    }
}
