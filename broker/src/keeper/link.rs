//! The broker's end of the keeper socket: it sends every change of a kept record in the
//! order the state lock made them (a write is a `sendmsg` into the keeper's queue, made
//! under the lock so no later change overtakes it), and at start reads back everything
//! the keeper holds. A keeper that went away is logged once and counted; the broker keeps
//! serving (its leases are then lost with its next restart, as without a keeper).

use super::wire::{self, Message};
use parking_lot::Mutex;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// How long a dump may take before the keeper counts as not answering (a keeper busy with
/// another broker never answers).
pub const DUMP_TIMEOUT: Duration = Duration::from_secs(10);

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
        wire::send(&sock, &Message::Dump, None).map_err(err)?;
        let mut out = Vec::new();
        loop {
            match wire::recv(&sock).map_err(err)? {
                Some((Message::Entry { key, record, .. }, fd)) => {
                    out.push(Entry { key, record, fd })
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
        let r = wire::send(&self.sock.lock(), msg, fd);
        match r {
            Ok(()) => {
                self.sent.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                if !self.broken.swap(true, Ordering::Relaxed) {
                    tracing::error!(keeper = %self.path.display(), error = %e, "the keeper is gone: leases made from now on do not survive a broker restart");
                }
            }
        }
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
