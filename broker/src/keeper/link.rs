//! The broker's end of the keeper socket: it sends every change of a kept record in the
//! order the state lock made them (a write is a `sendmsg` into the keeper's queue, made
//! under the lock so no later change overtakes it), and at start reads back everything
//! the keeper holds. A keeper that went away (its end closed: [`KeeperLink::watch`]), or
//! that stalls (stopped, swapped out) so a write finds no room in its queue for
//! [`WRITE_DEADLINE`], is declared lost: logged once, counted by the caller, its
//! connection closed (a stalled keeper is told to forget everything once it reads again);
//! the broker keeps serving. So a stalled keeper holds the state lock for one deadline at
//! most, never forever. A keeper that comes back (a new one on the socket, or the stalled
//! one reading again) is connected to again and told to forget what it holds
//! ([`KeeperLink::reconnect`], off the lock); the caller then installs that connection and
//! writes every live record again under the state lock ([`KeeperLink::resume`],
//! `arbiter/restart/relink.rs`), so from then on the keeper holds exactly the broker's state.

use super::wire::{self, Message};
use parking_lot::Mutex;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// How long a dump may take before the keeper counts as not answering (a keeper busy with
/// another broker never answers).
pub const DUMP_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a write may wait for room in the keeper's queue before the keeper is
/// declared lost. Writes are made under the state lock: this bounds how long a stalled
/// keeper can stop the broker (the queue absorbs a few hundred changes before any wait).
pub const WRITE_DEADLINE: Duration = Duration::from_secs(2);

pub use super::place::Entry;

/// Why the keeper could not be used.
#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    #[error("cannot reach the keeper at {path}: {source}")]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the keeper at {path} did not hand back its records: {source}")]
    Dump {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the systemd file-descriptor store cannot be used: {0}")]
    FdStore(#[source] std::io::Error),
}

/// The connection to the keeper.
pub struct KeeperLink {
    path: PathBuf,
    /// None once the keeper is lost: closed, so a keeper that reads again moves on to the
    /// next connection.
    sock: Mutex<Option<OwnedFd>>,
    broken: AtomicBool,
    /// Messages sent (puts and removes).
    sent: AtomicU64,
    /// A connection to a keeper that came back, emptied ([`KeeperLink::reconnect`]),
    /// waiting to be installed ([`KeeperLink::resume`]).
    fresh: Mutex<Option<OwnedFd>>,
}

impl KeeperLink {
    /// Connects to the keeper at `path`.
    pub fn connect(path: &Path) -> Result<KeeperLink, KeeperError> {
        let sock = connect_for_writes(path).map_err(|source| KeeperError::Connect {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(KeeperLink {
            path: path.to_path_buf(),
            sock: Mutex::new(Some(sock)),
            broken: AtomicBool::new(false),
            sent: AtomicU64::new(0),
            fresh: Mutex::new(None),
        })
    }

    /// Everything the keeper holds (it keeps its own copies).
    pub fn dump(&self) -> Result<Vec<Entry>, KeeperError> {
        let err = |source| KeeperError::Dump {
            path: self.path.clone(),
            source,
        };
        let sock = self.sock.lock();
        let sock = sock.as_ref().ok_or_else(|| {
            err(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                "the keeper is lost",
            ))
        })?;
        dump_from(sock).map_err(err)
    }

    /// Keeps `record` under `key`, with a copy of `fd` if given.
    pub fn put(&self, key: String, record: serde_json::Value, fd: Option<BorrowedFd<'_>>) {
        self.send(&Message::Put { key, record }, fd);
    }

    /// Drops what is kept under `key`.
    pub fn remove(&self, key: String) {
        self.send(&Message::Remove { key }, None);
    }

    /// Has a write failed (the keeper is gone)?
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    /// Messages sent so far.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    fn send(&self, msg: &Message, fd: Option<BorrowedFd<'_>>) {
        if self.is_broken() {
            return;
        }
        let mut sock = self.sock.lock();
        let Some(conn) = sock.as_ref() else { return };
        match wire::send(conn, msg, fd) {
            Ok(()) => {
                self.sent.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.lose(&mut sock, &e);
            }
        }
    }

    /// Declares the keeper lost because of `e` (false when it was already) and closes
    /// the connection held in `sock`.
    fn lose(&self, sock: &mut Option<OwnedFd>, e: &std::io::Error) -> bool {
        let conn = sock.take();
        if self.broken.swap(true, Ordering::Relaxed) {
            return false;
        }
        let stalled = e.kind() == std::io::ErrorKind::WouldBlock;
        tracing::error!(keeper = %self.path.display(), error = %e, stalled, deadline = ?WRITE_DEADLINE, "the keeper is lost: leases are not kept until it is back");
        if let (true, Some(conn)) = (stalled, conn) {
            forget_when_it_reads(conn);
        }
        true
    }

    /// Waits up to `wait` for the keeper to close its end of the connection (it died, or
    /// was restarted); true when it did (then call [`KeeperLink::lose_closed`]). False at
    /// once when there is no connection.
    pub fn watch(&self, wait: Duration) -> bool {
        let Some(conn) = self.sock.lock().as_ref().and_then(|s| s.try_clone().ok()) else {
            return false;
        };
        let mut pfd = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(&conn),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        let ms = wait.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd, of a descriptor this function owns.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        n > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }

    /// The keeper closed its end ([`KeeperLink::watch`] said so): declares it lost; true
    /// when this call did. Called under the state lock, as every write is, so the caller
    /// counts each loss once.
    pub fn lose_closed(&self) -> bool {
        let mut sock = self.sock.lock();
        let e = std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "the keeper closed its end",
        );
        self.lose(&mut sock, &e)
    }

    /// Connects to a keeper on the socket again (one that came back, or the stalled one
    /// reading again), tells it to forget what it holds (stale: blocks freed since would
    /// keep their memory) and checks that it did by a dump that must come back empty.
    /// Off the state lock: it waits while the keeper finishes with the old connection.
    /// The connection waits for [`KeeperLink::resume`].
    pub fn reconnect(&self) -> std::io::Result<()> {
        let sock = connect_for_writes(&self.path)?;
        wire::send(&sock, &Message::Forget, None)?;
        let left = dump_from(&sock)?;
        if !left.is_empty() {
            return Err(std::io::Error::other(format!(
                "the keeper still holds {} records after it was told to forget",
                left.len()
            )));
        }
        *self.fresh.lock() = Some(sock);
        Ok(())
    }

    /// Writes go to the connection [`KeeperLink::reconnect`] made from now on; false when
    /// there is none. Under the state lock: the caller then writes every live record
    /// again, before any other change.
    pub fn resume(&self) -> bool {
        let Some(fresh) = self.fresh.lock().take() else {
            return false;
        };
        *self.sock.lock() = Some(fresh);
        self.broken.store(false, Ordering::Relaxed);
        true
    }
}

/// Connects to the keeper at `path`, its writes bounded by [`WRITE_DEADLINE`].
fn connect_for_writes(path: &Path) -> std::io::Result<OwnedFd> {
    let sock = wire::connect(path)?;
    wire::set_send_timeout(&sock, Some(WRITE_DEADLINE))?;
    Ok(sock)
}

/// Asks the keeper on `sock` for everything it holds and reads it (each message waited
/// for at most [`DUMP_TIMEOUT`]).
fn dump_from(sock: &OwnedFd) -> std::io::Result<Vec<Entry>> {
    wire::set_receive_timeout(sock, Some(DUMP_TIMEOUT))?;
    // In batches: a keeper of an earlier version answers entry by entry.
    let ask = Message::Dump {
        batch: Some(wire::MAX_BATCH as u32),
    };
    wire::send(sock, &ask, None)?;
    let mut out = Vec::new();
    let mut buf = Vec::new();
    let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    loop {
        match wire::recv_many(sock, &mut buf)? {
            Some((Message::Entry { key, record, .. }, mut fds)) => {
                if fds.len() > 1 {
                    return Err(bad(format!("{} descriptors on one entry", fds.len())));
                }
                out.push(Entry {
                    key,
                    record,
                    fd: fds.pop(),
                })
            }
            Some((Message::Entries { entries }, fds)) => {
                let wanted = entries.iter().filter(|e| e.has_fd).count();
                if wanted != fds.len() {
                    return Err(bad(format!(
                        "{} descriptors for {wanted} records that have one",
                        fds.len()
                    )));
                }
                let mut fds = fds.into_iter();
                out.extend(entries.into_iter().map(|e| Entry {
                    fd: if e.has_fd { fds.next() } else { None },
                    key: e.key,
                    record: e.record,
                }));
            }
            Some((Message::End { count }, _)) if count as usize == out.len() => break,
            Some((other, _)) => return Err(bad(format!("unexpected keeper message {other:?}"))),
            None => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the keeper closed the connection",
                ))
            }
        }
    }
    Ok(out)
}

/// Tells a stalled keeper, once it reads again, to drop what it holds: what this broker
/// changed since is not there, and the descriptors of blocks freed since would keep their
/// memory. From a thread of its own that may wait as long as the keeper sleeps (or until
/// this process ends); the broker never waits for it. The connection closes after it,
/// so the keeper moves on to the broker's next connection.
fn forget_when_it_reads(sock: OwnedFd) {
    let spawned = std::thread::Builder::new()
        .name("keeper-forget".into())
        .spawn(move || {
            let _ = wire::set_send_timeout(&sock, None);
            if wire::send(&sock, &Message::Forget, None).is_ok() {
                tracing::info!("the lost keeper read again and was told to forget");
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot tell the lost keeper to forget");
    }
}

impl super::place::Place for KeeperLink {
    fn describe(&self) -> String {
        format!("the keeper at {}", self.path.display())
    }
    fn dump(&self) -> Result<Vec<Entry>, KeeperError> {
        KeeperLink::dump(self)
    }
    fn put(&self, key: String, record: serde_json::Value, fd: Option<BorrowedFd<'_>>) {
        KeeperLink::put(self, key, record, fd)
    }
    fn remove(&self, key: String) {
        KeeperLink::remove(self, key)
    }
    fn is_broken(&self) -> bool {
        KeeperLink::is_broken(self)
    }
    fn sent(&self) -> u64 {
        KeeperLink::sent(self)
    }
    fn as_keeper(&self) -> Option<&KeeperLink> {
        Some(self)
    }
}
