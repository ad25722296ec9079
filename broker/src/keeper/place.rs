//! Where kept things wait: the seam between the broker and whatever holds its lease
//! descriptors and the records of its sessions and leases across its own restart. Two
//! places implement it: a keeper process ([`super::link`]) and systemd's file-descriptor
//! store ([`super::fdstore`]). The arbiter (`arbiter/restart/`) writes every change through
//! it under the state lock and reads everything back at start; the records are the same
//! versioned JSON in both ([`super::records`]).

use std::os::fd::{BorrowedFd, OwnedFd};

/// One record a place handed back, with its descriptor.
#[derive(Debug)]
pub struct Entry {
    pub key: String,
    pub record: serde_json::Value,
    pub fd: Option<OwnedFd>,
}

/// A place where kept records and descriptors wait for the next broker. Writes never fail
/// to the caller (they run under the state lock): a place that cannot be written any more
/// says so through [`Place::is_broken`] and logs it once.
pub trait Place: Send + Sync {
    /// What it is, for logs.
    fn describe(&self) -> String;
    /// Everything kept, read back before the broker serves (copies of the descriptors;
    /// the place keeps its own).
    fn dump(&self) -> Result<Vec<Entry>, super::KeeperError>;
    /// Keeps `record` under `key`, with a copy of `fd` if given, replacing what was kept
    /// under it.
    fn put(&self, key: String, record: serde_json::Value, fd: Option<BorrowedFd<'_>>);
    /// Drops what is kept under `key` (its descriptor copy closes).
    fn remove(&self, key: String);
    /// Has a write failed (what is kept from now on would be incomplete)?
    fn is_broken(&self) -> bool;
    /// Writes made so far.
    fn sent(&self) -> u64;
    /// The keeper process's link, when this place is one: a lost keeper can come back
    /// and be filled again (`arbiter/restart/relink.rs`); systemd's store cannot.
    fn as_keeper(&self) -> Option<&super::KeeperLink> {
        None
    }
}

/// What a place handed back at start, with the place and how long it took: made apart
/// from the adoption so it can run while the devices open (`main.rs`).
pub struct Dumped<P> {
    pub place: P,
    pub entries: Vec<Entry>,
    pub took: std::time::Duration,
}

/// Reads back everything `place` keeps ([`Place::dump`]), timed.
pub fn dump<P: Place>(place: P) -> Result<Dumped<P>, super::KeeperError> {
    let t = std::time::Instant::now();
    let entries = place.dump()?;
    Ok(Dumped {
        place,
        entries,
        took: t.elapsed(),
    })
}
