//! Lease tickets: how a worker gets the file descriptor of an fd lease (the table and the
//! protocol's bytes; the socket that serves them is `ticket_server.rs`, above the
//! arbiter). A grant (or `RenewLeaseTicket`) mints a **ticket**: 32 random bytes, single
//! use, valid for the configured TTL, bound to the lease and to the credentials of the
//! process that asked (uid always; pid when the kernel shows it). The worker connects to the
//! broker's ticket socket (a Unix stream socket), sends the ticket bytes and receives one
//! byte of data carrying exactly one descriptor in `SCM_RIGHTS`. A wrong, reused, expired
//! or foreign ticket gets nothing: the connection is closed, the attempt logged and counted
//! (`gpu_broker_ticket_refusals_total{reason}`), the lease untouched. Ending a lease drops
//! its tickets' descriptors but keeps each unredeemed ticket as a **tombstone** until its
//! expiry: its rightful peer presenting it learns "lease ended" (`gpu_broker_proto::ticket`)
//! instead of a bare refusal; any other peer still learns nothing. The wire protocol is in
//! `docs/protocol.md`.

use crate::device::SharedFd;
use crate::fd::descriptor_channels::DescriptorChannels;
use crate::id_map::IdMap;
use crate::lease::LiveMark;
use parking_lot::Mutex;
use std::collections::{BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use uuid::Uuid;

/// Length of every ticket, in bytes.
pub const TICKET_LEN: usize = 32;
/// Most unredeemed tickets one lease may have (older ones are dropped first).
const MAX_PER_LEASE: usize = 16;
/// Most tombstones kept in all (the oldest go first): each ended lease leaves at most
/// `MAX_PER_LEASE`, and they live no longer than the TTL.
const MAX_TOMBSTONES: usize = 4096;

/// A ticket's bytes.
pub type Ticket = [u8; TICKET_LEN];

/// Who may redeem a ticket: the uid of the session, and the pid of the process that asked
/// for the ticket when the kernel showed one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Binding {
    pub uid: u32,
    pub pid: Option<u32>,
}

/// Why a ticket was refused: the metrics own the reasons (the labels of the refusal
/// counter), so the metrics need not import the ticket server.
pub use crate::metrics::TicketRefusal as Refusal;

struct Entry {
    lease: Uuid,
    binding: Binding,
    expires: Instant,
    fd: SharedFd,
    to: Recipient,
}

/// Whom a ticket's descriptor goes to, as the minting call saw it, with the lease's mark
/// (`LiveMark`: whether the lease is still in the lease table; an import has none).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Recipient {
    /// The process of the lease's own session (its bound pid is the session's peer pid,
    /// fixed when the session opened): the table refuses the ticket once the mark is
    /// cleared (minted late or redeemed late alike), so the server sends without asking
    /// the arbiter.
    SessionProcess(LiveMark),
    /// Possibly another process (a forked child, another process of the same user, a peer
    /// without a pid) and every import: the server asks the arbiter first
    /// (`Arbiter::fd_delivering`), which records the recipient. A lease's mark still lets
    /// the table drop a ticket of an ended lease early.
    Other(Option<LiveMark>),
}

impl Recipient {
    fn mark(&self) -> Option<&LiveMark> {
        match self {
            Recipient::SessionProcess(m) => Some(m),
            Recipient::Other(m) => m.as_ref(),
        }
    }

    /// Must the server ask the arbiter before the descriptor leaves?
    pub fn needs_arbiter(&self) -> bool {
        matches!(self, Recipient::Other(_))
    }

    /// Has the lease left the lease table?
    fn ended(&self) -> bool {
        self.mark().is_some_and(|m| !m.is_live())
    }
}

/// What a redeemed ticket gives: the lease, its descriptor, and whom it goes to.
#[derive(Debug, PartialEq, Eq)]
pub struct Redeemed {
    pub lease: Uuid,
    pub fd: SharedFd,
    pub to: Recipient,
}

/// An unredeemed ticket of a lease that ended: who may learn so, and until when.
struct Tombstone {
    binding: Binding,
    expires: Instant,
}

#[derive(Default)]
struct Inner {
    by_ticket: IdMap<Ticket, Entry>,
    by_lease: IdMap<Uuid, Vec<Ticket>>,
    /// Every live ticket by its expiry, so purging looks only at the expired ones (not
    /// the whole table on every mint). In step with `by_ticket`: every entry leaves both
    /// through [`Inner::take`]. Ordered by deadline, not by mint: the TTL may change.
    by_expiry: BTreeSet<(Instant, Ticket)>,
    tombstones: IdMap<Ticket, Tombstone>,
    /// Tombstones in the order they were laid (for the bound).
    tomb_order: VecDeque<Ticket>,
    /// Tests: live entries a purge looked at.
    #[cfg(test)]
    purge_visits: usize,
}

/// Every unredeemed ticket, where the ticket server listens, and the descriptor channels
/// it keeps open (descriptors sent with the grant, no ticket).
pub struct TicketTable {
    inner: Mutex<Inner>,
    ttl: Mutex<Duration>,
    socket: Mutex<Option<PathBuf>>,
    channels: DescriptorChannels,
}

impl Default for TicketTable {
    fn default() -> Self {
        TicketTable {
            inner: Mutex::new(Inner::default()),
            ttl: Mutex::new(crate::defaults::TICKET_TTL),
            socket: Mutex::new(None),
            channels: DescriptorChannels::default(),
        }
    }
}

impl TicketTable {
    /// The workers' descriptor channels (`descriptor_channels.rs`).
    pub fn channels(&self) -> &DescriptorChannels {
        &self.channels
    }

    /// Sets the TTL of tickets minted from now on.
    pub fn set_ttl(&self, ttl: Duration) {
        *self.ttl.lock() = ttl.max(Duration::from_millis(1));
    }

    pub fn ttl(&self) -> Duration {
        *self.ttl.lock()
    }

    /// Records where the ticket server listens (fd leases are served only once it does).
    pub fn set_socket(&self, path: &Path) {
        *self.socket.lock() = Some(path.to_path_buf());
    }

    /// The ticket socket, if a ticket server runs.
    pub fn socket(&self) -> Option<PathBuf> {
        self.socket.lock().clone()
    }

    /// Mints a ticket for `lease` that delivers `fd` to a process matching `binding`
    /// (`to`: whether that process is the lease's session's own). A lease that already
    /// left the table (the service mints outside the arbiter's lock) gets only a tombstone:
    /// no descriptor is kept, and its peer learns "lease ended".
    pub fn mint(&self, lease: Uuid, binding: Binding, fd: SharedFd, to: Recipient) -> Ticket {
        let ticket: Ticket = rand::random();
        let now = Instant::now();
        let expires = now + self.ttl();
        let mut inner = self.inner.lock();
        inner.purge_expired(now);
        if to.ended() {
            inner.lay_tombstone(ticket, binding, expires);
            return ticket;
        }
        let list = inner.by_lease.entry(lease).or_default();
        list.push(ticket);
        let dropped = if list.len() > MAX_PER_LEASE {
            Some(list.remove(0))
        } else {
            None
        };
        if let Some(old) = dropped {
            inner.take(&old);
        }
        inner.by_expiry.insert((expires, ticket));
        inner.by_ticket.insert(
            ticket,
            Entry {
                lease,
                binding,
                expires,
                fd,
                to,
            },
        );
        ticket
    }

    /// Drops every ticket of a lease (it ended) and its descriptors; each unexpired one
    /// stays as a tombstone, so its holder learns that the lease ended.
    pub fn forget_lease(&self, lease: Uuid) {
        let now = Instant::now();
        let mut inner = self.inner.lock();
        inner.purge_expired(now);
        if let Some(list) = inner.by_lease.remove(&lease) {
            for t in list {
                if let Some(e) = inner.take(&t) {
                    inner.lay_tombstone(t, e.binding, e.expires);
                }
            }
        }
    }

    /// Unredeemed tickets (all leases).
    pub fn outstanding(&self) -> usize {
        self.inner.lock().by_ticket.len()
    }

    /// Tombstones kept (tickets of ended leases, not yet expired or presented).
    pub fn tombstones(&self) -> usize {
        self.inner.lock().tombstones.len()
    }

    /// Redeems `ticket` for a peer with `uid` and `pid`: the lease and its descriptor, once.
    /// A foreign peer does not use the ticket up (its rightful holder may still redeem it).
    pub fn redeem(&self, ticket: &[u8], uid: u32, pid: Option<u32>) -> Result<Redeemed, Refusal> {
        let key: Ticket = ticket.try_into().map_err(|_| Refusal::Malformed)?;
        let now = Instant::now();
        let mut inner = self.inner.lock();
        let Some(e) = inner.by_ticket.get(&key) else {
            return Err(inner.bury(&key, uid, pid, now));
        };
        if e.expires <= now {
            inner.remove(&key);
            return Err(Refusal::Expired);
        }
        if !e.binding.admits(uid, pid) {
            return Err(Refusal::Foreign);
        }
        let e = inner.remove(&key).ok_or(Refusal::Unknown)?;
        if e.to.ended() {
            // The lease ended and the end's forgetting has not run yet: its rightful peer
            // learns so, as from a tombstone.
            return Err(Refusal::LeaseEnded);
        }
        Ok(Redeemed {
            lease: e.lease,
            fd: e.fd,
            to: e.to,
        })
    }
}

impl Binding {
    /// Whether a peer with `uid` and `pid` is the one this binding names.
    fn admits(&self, uid: u32, pid: Option<u32>) -> bool {
        let pid_ok = match self.pid {
            Some(want) => pid == Some(want),
            None => true,
        };
        self.uid == uid && pid_ok
    }
}

impl Inner {
    /// A ticket not in the live table: "lease ended" (once) for the rightful peer of an
    /// unexpired tombstone; "unknown" for everyone else, so a foreign peer learns nothing.
    fn bury(&mut self, key: &Ticket, uid: u32, pid: Option<u32>, now: Instant) -> Refusal {
        match self.tombstones.get(key) {
            Some(t) if t.expires > now && t.binding.admits(uid, pid) => {
                self.tombstones.remove(key);
                Refusal::LeaseEnded
            }
            Some(t) if t.expires <= now => {
                self.tombstones.remove(key);
                Refusal::Unknown
            }
            _ => Refusal::Unknown,
        }
    }

    fn lay_tombstone(&mut self, ticket: Ticket, binding: Binding, expires: Instant) {
        self.tombstones
            .insert(ticket, Tombstone { binding, expires });
        self.tomb_order.push_back(ticket);
        while self.tombstones.len() > MAX_TOMBSTONES {
            match self.tomb_order.pop_front() {
                Some(old) => {
                    self.tombstones.remove(&old);
                }
                None => break,
            }
        }
        // Keep the order queue no larger than twice the table (entries whose tombstone was
        // already presented or purged linger in it until then).
        if self.tomb_order.len() > 2 * self.tombstones.len().max(MAX_PER_LEASE) {
            let live = &self.tombstones;
            self.tomb_order.retain(|t| live.contains_key(t));
        }
    }

    /// Takes a live entry out of the ticket table and the expiry order (not `by_lease`).
    fn take(&mut self, key: &Ticket) -> Option<Entry> {
        let e = self.by_ticket.remove(key)?;
        self.by_expiry.remove(&(e.expires, *key));
        Some(e)
    }

    /// Takes a live entry out of every index.
    fn remove(&mut self, key: &Ticket) -> Option<Entry> {
        let e = self.take(key)?;
        if let Some(list) = self.by_lease.get_mut(&e.lease) {
            list.retain(|t| t != key);
            if list.is_empty() {
                self.by_lease.remove(&e.lease);
            }
        }
        Some(e)
    }

    fn purge_expired(&mut self, now: Instant) {
        while let Some(&(expires, t)) = self.by_expiry.first() {
            #[cfg(test)]
            {
                self.purge_visits += 1;
            }
            if expires > now {
                break;
            }
            self.remove(&t);
        }
        // Tombstones are laid when their lease ends, so roughly but not exactly in expiry
        // order (a ticket minted earlier may end later): this drops the expired ones at the
        // front; one left behind a younger one is still refused by its own expiry when
        // looked up, and the count stays bounded (`MAX_TOMBSTONES`).
        while let Some(front) = self.tomb_order.front() {
            match self.tombstones.get(front) {
                Some(t) if t.expires > now => break,
                Some(_) => {
                    self.tombstones.remove(front);
                }
                None => {}
            }
            self.tomb_order.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fd() -> SharedFd {
        SharedFd::new(crate::device::host::memfd("t", 4096).unwrap())
    }

    const ME: Binding = Binding {
        uid: 1000,
        pid: Some(42),
    };

    #[test]
    fn a_redeemed_ticket_says_whom_its_mint_named() {
        let t = TicketTable::default();
        let mark = LiveMark::default();
        let own = t.mint(
            Uuid::new_v4(),
            ME,
            fd(),
            Recipient::SessionProcess(mark.clone()),
        );
        let other = t.mint(Uuid::new_v4(), ME, fd(), Recipient::Other(None));
        assert_eq!(
            t.redeem(&own, 1000, Some(42)).unwrap().to,
            Recipient::SessionProcess(mark)
        );
        assert_eq!(
            t.redeem(&other, 1000, Some(42)).unwrap().to,
            Recipient::Other(None)
        );
    }

    /// The session's own process is served without the arbiter's look, so the table itself
    /// refuses a ticket once its lease left the lease table: redeemed after the end but
    /// before the end's forgetting ran, or minted after the end (the service mints outside
    /// the lock), which keeps no descriptor at all. Its rightful peer learns "lease ended";
    /// a foreign one learns nothing. A lease's `Other` ticket is refused the same way (the
    /// arbiter's look would refuse it too); an import's, with no mark, is left to that look.
    #[test]
    fn a_ticket_of_a_lease_that_left_the_table_delivers_nothing() {
        let t = TicketTable::default();
        let mark = LiveMark::default();
        let lease = Uuid::new_v4();
        let f = fd();
        let own = || Recipient::SessionProcess(mark.clone());
        let before = t.mint(lease, ME, f.clone(), own());
        let other = t.mint(lease, ME, f.clone(), Recipient::Other(Some(mark.clone())));
        let kept = t.mint(lease, ME, f.clone(), own());
        let import = t.mint(Uuid::new_v4(), ME, f.clone(), Recipient::Other(None));
        assert_eq!(std::sync::Arc::strong_count(&f.0), 5);
        mark.end_for_test();
        let late = t.mint(lease, ME, f.clone(), own());
        assert_eq!(
            std::sync::Arc::strong_count(&f.0),
            5,
            "a late mint keeps no fd"
        );
        assert_eq!((t.outstanding(), t.tombstones()), (4, 1));
        // A foreign peer: refused as for any ticket (a live entry) or learns nothing (the
        // late one's tombstone), and uses neither up.
        assert_eq!(
            t.redeem(&before, 1001, Some(42)).unwrap_err(),
            Refusal::Foreign
        );
        assert_eq!(
            t.redeem(&late, 1001, Some(42)).unwrap_err(),
            Refusal::Unknown
        );
        for k in [&before, &other, &late] {
            assert_eq!(
                t.redeem(k, 1000, Some(42)).unwrap_err(),
                Refusal::LeaseEnded
            );
            assert_eq!(t.redeem(k, 1000, Some(42)).unwrap_err(), Refusal::Unknown);
        }
        assert_eq!(
            std::sync::Arc::strong_count(&f.0),
            3,
            "`f`, `kept`, `import`"
        );
        // The end's forgetting still lays the remaining one's tombstone.
        t.forget_lease(lease);
        assert_eq!((t.outstanding(), t.tombstones()), (1, 1));
        assert_eq!(
            t.redeem(&kept, 1000, Some(42)).unwrap_err(),
            Refusal::LeaseEnded
        );
        assert_eq!(
            t.redeem(&import, 1000, Some(42)).unwrap().to,
            Recipient::Other(None)
        );
    }

    #[test]
    fn a_ticket_redeems_once_for_its_binding_only() {
        let t = TicketTable::default();
        let lease = Uuid::new_v4();
        let f = fd();
        let k = t.mint(lease, ME, f.clone(), Recipient::Other(None));
        assert_eq!(t.redeem(&k, 1001, Some(42)).unwrap_err(), Refusal::Foreign);
        assert_eq!(t.redeem(&k, 1000, Some(43)).unwrap_err(), Refusal::Foreign);
        assert_eq!(t.redeem(&k, 1000, None).unwrap_err(), Refusal::Foreign);
        let got = t.redeem(&k, 1000, Some(42)).unwrap();
        assert_eq!((got.lease, got.fd), (lease, f));
        assert_eq!(t.redeem(&k, 1000, Some(42)).unwrap_err(), Refusal::Unknown);
        assert_eq!(
            t.redeem(&[0u8; 32], 1000, Some(42)).unwrap_err(),
            Refusal::Unknown
        );
        assert_eq!(
            t.redeem(&k[..5], 1000, Some(42)).unwrap_err(),
            Refusal::Malformed
        );
        assert_eq!(t.outstanding(), 0);
    }

    #[test]
    fn unknown_pid_binding_checks_uid_only() {
        let t = TicketTable::default();
        let k = t.mint(
            Uuid::new_v4(),
            Binding { uid: 7, pid: None },
            fd(),
            Recipient::Other(None),
        );
        assert_eq!(t.redeem(&k, 8, Some(1)).unwrap_err(), Refusal::Foreign);
        assert!(t.redeem(&k, 7, Some(1)).is_ok());
    }

    #[test]
    fn expired_and_forgotten_tickets_are_refused() {
        let t = TicketTable::default();
        t.set_ttl(Duration::from_millis(1));
        let k = t.mint(Uuid::new_v4(), ME, fd(), Recipient::Other(None));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(t.redeem(&k, 1000, Some(42)).unwrap_err(), Refusal::Expired);
        t.set_ttl(Duration::from_secs(30));
        let lease = Uuid::new_v4();
        let k = t.mint(lease, ME, fd(), Recipient::Other(None));
        t.forget_lease(lease);
        assert_eq!(
            t.redeem(&k, 1000, Some(42)).unwrap_err(),
            Refusal::LeaseEnded
        );
        assert_eq!(t.redeem(&k, 1000, Some(42)).unwrap_err(), Refusal::Unknown);
        assert_eq!(t.outstanding(), 0);
        assert_eq!(t.tombstones(), 0);
    }

    #[test]
    fn an_ended_leases_ticket_says_so_to_its_peer_only_until_it_expires() {
        let t = TicketTable::default();
        let lease = Uuid::new_v4();
        let f = fd();
        let k1 = t.mint(lease, ME, f.clone(), Recipient::Other(None));
        let k2 = t.mint(lease, ME, f.clone(), Recipient::Other(None));
        let other = t.mint(Uuid::new_v4(), ME, f.clone(), Recipient::Other(None));
        t.forget_lease(lease);
        assert_eq!((t.outstanding(), t.tombstones()), (1, 2));
        // The tombstones hold no descriptor: only `f` and the live ticket's clone remain.
        assert_eq!(std::sync::Arc::strong_count(&f.0), 2);
        // A foreign peer learns nothing (as for a ticket never issued), and does not use
        // the tombstone up.
        assert_eq!(t.redeem(&k1, 1001, Some(42)).unwrap_err(), Refusal::Unknown);
        assert_eq!(t.redeem(&k1, 1000, Some(43)).unwrap_err(), Refusal::Unknown);
        assert_eq!(
            t.redeem(&k1, 1000, Some(42)).unwrap_err(),
            Refusal::LeaseEnded
        );
        assert_eq!(t.redeem(&k1, 1000, Some(42)).unwrap_err(), Refusal::Unknown);
        // The live ticket of another lease is untouched.
        assert!(t.redeem(&other, 1000, Some(42)).is_ok());
        // Past its expiry the tombstone is gone.
        t.set_ttl(Duration::from_millis(1));
        let short = Uuid::new_v4();
        let k3 = t.mint(short, ME, f.clone(), Recipient::Other(None));
        t.forget_lease(short);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(t.redeem(&k3, 1000, Some(42)).unwrap_err(), Refusal::Unknown);
        // Purging (on a mint) keeps the unexpired tombstone (k2).
        t.mint(Uuid::new_v4(), ME, f.clone(), Recipient::Other(None));
        assert_eq!(t.tombstones(), 1);
        assert_eq!(
            t.redeem(&k2, 1000, Some(42)).unwrap_err(),
            Refusal::LeaseEnded
        );
        assert_eq!(t.tombstones(), 0);
    }

    #[test]
    fn tombstones_are_bounded() {
        let t = TicketTable::default();
        let f = fd();
        let first_lease = Uuid::new_v4();
        let first = t.mint(first_lease, ME, f.clone(), Recipient::Other(None));
        t.forget_lease(first_lease);
        for _ in 0..MAX_TOMBSTONES {
            let l = Uuid::new_v4();
            t.mint(l, ME, f.clone(), Recipient::Other(None));
            t.forget_lease(l);
        }
        assert_eq!(t.tombstones(), MAX_TOMBSTONES);
        assert_eq!(
            t.redeem(&first, 1000, Some(42)).unwrap_err(),
            Refusal::Unknown,
            "the oldest tombstone went first"
        );
    }

    /// The expiry order holds exactly the live tickets.
    fn in_step(t: &TicketTable) {
        let inner = t.inner.lock();
        assert_eq!(inner.by_expiry.len(), inner.by_ticket.len());
        for (expires, k) in &inner.by_expiry {
            assert_eq!(inner.by_ticket.get(k).map(|e| e.expires), Some(*expires));
        }
    }

    /// A mint purges the expired tickets only: it looks at those and the first live one,
    /// never at every ticket of the table (a renewal flood of one tenant made every other
    /// tenant's mint walk all of them).
    #[test]
    fn a_mint_looks_at_the_expired_tickets_only() {
        let t = TicketTable::default();
        let f = fd();
        let leases: Vec<Uuid> = (0..64).map(|_| Uuid::new_v4()).collect();
        for l in &leases {
            for _ in 0..MAX_PER_LEASE {
                t.mint(*l, ME, f.clone(), Recipient::Other(None));
            }
        }
        assert_eq!(t.outstanding(), 64 * MAX_PER_LEASE);
        t.inner.lock().purge_visits = 0;
        t.mint(Uuid::new_v4(), ME, f.clone(), Recipient::Other(None));
        assert_eq!(t.inner.lock().purge_visits, 1, "the first live ticket only");
        // Past the cap a lease's oldest ticket goes, from every index.
        t.mint(leases[0], ME, f.clone(), Recipient::Other(None));
        assert_eq!(t.outstanding(), 64 * MAX_PER_LEASE + 1);
        in_step(&t);
        // Short-lived ones: the next mint looks at those (purged) and one live ticket.
        t.set_ttl(Duration::from_millis(1));
        for _ in 0..5 {
            t.mint(Uuid::new_v4(), ME, f.clone(), Recipient::Other(None));
        }
        std::thread::sleep(Duration::from_millis(5));
        t.set_ttl(Duration::from_secs(30));
        // (A slow machine may have purged some already, on the mints after them.)
        let expired = t.outstanding() - (64 * MAX_PER_LEASE + 1);
        assert!((1..=5).contains(&expired), "{expired}");
        t.inner.lock().purge_visits = 0;
        t.mint(Uuid::new_v4(), ME, f.clone(), Recipient::Other(None));
        assert_eq!(t.inner.lock().purge_visits, expired + 1);
        assert_eq!(t.outstanding(), 64 * MAX_PER_LEASE + 2);
        in_step(&t);
    }

    /// Tickets expire by their own deadline, whatever the order they were minted in (the
    /// TTL may shrink between mints): a long-lived ticket minted first outlives a
    /// short-lived one minted after it.
    #[test]
    fn tickets_expire_by_their_own_deadline() {
        let t = TicketTable::default();
        let f = fd();
        let (long_lease, short_lease) = (Uuid::new_v4(), Uuid::new_v4());
        let long = t.mint(long_lease, ME, f.clone(), Recipient::Other(None));
        t.set_ttl(Duration::from_millis(1));
        let short = t.mint(short_lease, ME, f.clone(), Recipient::Other(None));
        std::thread::sleep(Duration::from_millis(5));
        t.set_ttl(Duration::from_secs(30));
        t.mint(Uuid::new_v4(), ME, f.clone(), Recipient::Other(None));
        // The short one was purged (unknown now, its descriptor dropped); the long one
        // still redeems.
        assert_eq!(t.outstanding(), 2);
        assert_eq!(
            t.redeem(&short, 1000, Some(42)).unwrap_err(),
            Refusal::Unknown
        );
        assert_eq!(t.redeem(&long, 1000, Some(42)).unwrap().lease, long_lease);
        in_step(&t);
        // Redeemed, forgotten and refused as expired alike leave the expiry order too.
        let lease = Uuid::new_v4();
        t.mint(lease, ME, f.clone(), Recipient::Other(None));
        t.forget_lease(lease);
        t.set_ttl(Duration::from_millis(1));
        let late = t.mint(Uuid::new_v4(), ME, f.clone(), Recipient::Other(None));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(
            t.redeem(&late, 1000, Some(42)).unwrap_err(),
            Refusal::Expired
        );
        in_step(&t);
        assert_eq!(t.outstanding(), 1);
        assert_eq!(
            std::sync::Arc::strong_count(&f.0),
            2,
            "`f` and the live one"
        );
    }

    #[test]
    fn a_lease_keeps_a_bounded_number_of_tickets() {
        let t = TicketTable::default();
        let lease = Uuid::new_v4();
        let f = fd();
        let first = t.mint(lease, ME, f.clone(), Recipient::Other(None));
        for _ in 0..MAX_PER_LEASE {
            t.mint(lease, ME, f.clone(), Recipient::Other(None));
        }
        assert_eq!(t.outstanding(), MAX_PER_LEASE);
        assert_eq!(
            t.redeem(&first, 1000, Some(42)).unwrap_err(),
            Refusal::Unknown
        );
        in_step(&t);
    }
}
