//! The broker's end of the keeper socket: it sends every change of a kept record in the
//! order the state lock made them (a write is a `sendmsg` into the keeper's queue, made
//! under the lock so no later change overtakes it), and at start reads back everything
//! the keeper holds. A keeper that went away, or that stalls (stopped, swapped out) so a
//! write finds no room in its queue for [`WRITE_DEADLINE`], is declared lost: logged once,
//! counted by the caller, and told to forget everything once it reads again; the broker
//! keeps serving (its leases are then lost with its next restart, as without a keeper).
//! So a stalled keeper holds the state lock for one deadline at most, never forever.

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
    sock: Mutex<OwnedFd>,
    broken: AtomicBool,
    /// Messages sent (puts and removes).
    sent: AtomicU64,
}

impl KeeperLink {
    /// Connects to the keeper at `path`.
    pub fn connect(path: &Path) -> Result<KeeperLink, KeeperError> {
        let sock = wire::connect(path).map_err(|source| KeeperError::Connect {
            path: path.to_path_buf(),
            source,
        })?;
        wire::set_send_timeout(&sock, Some(WRITE_DEADLINE)).map_err(|source| {
            KeeperError::Connect {
                path: path.to_path_buf(),
                source,
            }
        })?;
        Ok(KeeperLink {
            path: path.to_path_buf(),
            sock: Mutex::new(sock),
            broken: AtomicBool::new(false),
            sent: AtomicU64::new(0),
        })
    }

    /// Everything the keeper holds (it keeps its own copies).
    pub fn dump(&self) -> Result<Vec<Entry>, KeeperError> {
        let err = |source| KeeperError::Dump {
            path: self.path.clone(),
            source,
        };
        let sock = self.sock.lock();
        wire::set_receive_timeout(&sock, Some(DUMP_TIMEOUT)).map_err(err)?;
        // In batches: a keeper of an earlier version answers entry by entry.
        let ask = Message::Dump {
            batch: Some(wire::MAX_BATCH as u32),
        };
        wire::send(&sock, &ask, None).map_err(err)?;
        let mut out = Vec::new();
        let mut buf = Vec::new();
        let bad = |why: String| err(std::io::Error::new(std::io::ErrorKind::InvalidData, why));
        loop {
            match wire::recv_many(&sock, &mut buf).map_err(err)? {
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
                Some((other, _)) => {
                    return Err(err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("unexpected keeper message {other:?}"),
                    )))
                }
                None => {
                    return Err(err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the keeper closed the connection",
                    )))
                }
            }
        }
        Ok(out)
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
        let sock = self.sock.lock();
        match wire::send(&sock, msg, fd) {
            Ok(()) => {
                self.sent.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                if self.broken.swap(true, Ordering::Relaxed) {
                    return;
                }
                let stalled = e.kind() == std::io::ErrorKind::WouldBlock;
                tracing::error!(keeper = %self.path.display(), error = %e, stalled, deadline = ?WRITE_DEADLINE, "the keeper is lost: leases are no longer kept, and none survives a broker restart");
                if stalled {
                    forget_when_it_reads(&sock);
                }
            }
        }
    }
}

/// Tells a stalled keeper, once it reads again, to drop what it holds: what this broker
/// changed since is not there, and the descriptors of blocks freed since would keep their
/// memory. From a thread of its own that may wait as long as the keeper sleeps (or until
/// this process ends); the broker never waits for it.
fn forget_when_it_reads(sock: &OwnedFd) {
    let Ok(sock) = sock.try_clone() else { return };
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
}
