//! The keeper process (`gpu-broker keeper --socket PATH`): one thread, no CUDA, no
//! runtime. It holds the descriptors and records a broker sends it, drops them when told,
//! and hands copies of all of them to the next broker that asks; it serves one broker
//! connection at a time, in order, so a restarted broker reads everything its predecessor
//! wrote before it died. Only a process of the keeper's own uid (or root) may connect.

use super::wire::{self, Message};
use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

/// What the keeper holds: records by key, each with its descriptor if it came with one.
#[derive(Default)]
pub struct Kept {
    entries: BTreeMap<String, (serde_json::Value, Option<OwnedFd>)>,
}

impl Kept {
    /// How many records it holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// How many descriptors it holds.
    pub fn descriptors(&self) -> usize {
        self.entries.values().filter(|(_, fd)| fd.is_some()).count()
    }
}

/// How long the keeper waits for a broker to take a message of the dump: a peer that
/// stops reading cannot keep the next broker from the keeper.
const SEND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Listens at `path` and serves brokers until the process is killed. The socket's
/// directory is created 0700 when missing: it must be one no worker can reach (a
/// container that mounts the broker's socket directory must not see the keeper's).
pub fn run(path: &Path) -> io::Result<()> {
    if let Some(dir) = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty() && !d.exists())
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    let listener = wire::bind(path)?;
    // Descriptors of other processes' memory live here: keep other processes of this
    // user from taking them through /proc/<pid>/fd.
    // SAFETY: plain prctl on this process.
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
    }
    eprintln!("gpu-broker keeper: listening on {}", path.display());
    let mut kept = Kept::default();
    // SAFETY: getuid has no failure mode.
    let me = unsafe { libc::getuid() };
    loop {
        let conn = wire::accept(&listener)?;
        // Only the keeper's own user (the broker runs as it): root in a container that
        // could reach the socket is not trusted with every tenant's memory.
        match wire::peer_uid(&conn) {
            Ok(uid) if uid == me => {}
            other => {
                eprintln!("gpu-broker keeper: refused a connection of uid {other:?}");
                continue;
            }
        }
        if let Err(e) = wire::set_send_timeout(&conn, Some(SEND_TIMEOUT)) {
            eprintln!("gpu-broker keeper: connection refused: {e}");
            continue;
        }
        match serve_connection(&conn, &mut kept) {
            Ok(()) => eprintln!(
                "gpu-broker keeper: broker left; keeping {} records, {} descriptors",
                kept.len(),
                kept.descriptors()
            ),
            Err(e) => eprintln!("gpu-broker keeper: connection ended: {e}"),
        }
    }
}

/// Serves one broker until it goes away.
pub fn serve_connection(conn: &OwnedFd, kept: &mut Kept) -> io::Result<()> {
    let mut buf = Vec::new();
    while let Some((msg, fd)) = wire::recv_into(conn, &mut buf)? {
        match msg {
            Message::Put { key, record } => {
                // The copy it replaces (if any) closes here.
                kept.entries.insert(key, (record, fd));
            }
            Message::Remove { key } => {
                kept.entries.remove(&key);
            }
            Message::Forget => {
                eprintln!(
                    "gpu-broker keeper: the broker gave up on this keeper; dropping {} records",
                    kept.len()
                );
                kept.entries.clear();
            }
            Message::Dump { batch: None } => {
                for (key, (record, fd)) in &kept.entries {
                    let entry = Message::Entry {
                        key: key.clone(),
                        record: record.clone(),
                        has_fd: fd.is_some(),
                    };
                    wire::send(conn, &entry, fd.as_ref().map(|f| f.as_fd()))?;
                }
                wire::send(
                    conn,
                    &Message::End {
                        count: kept.entries.len() as u64,
                    },
                    None,
                )?;
            }
            Message::Dump { batch: Some(most) } => {
                let mut batch = wire::BatchWriter::new(conn, most as usize);
                for (key, (record, fd)) in &kept.entries {
                    let entry = wire::BatchEntry {
                        key: key.clone(),
                        record: record.clone(),
                        has_fd: fd.is_some(),
                    };
                    batch.add(&entry, fd.as_ref().map(|f| f.as_fd()))?;
                }
                batch.flush()?;
                wire::send(
                    conn,
                    &Message::End {
                        count: kept.entries.len() as u64,
                    },
                    None,
                )?;
            }
            Message::Entry { .. } | Message::Entries { .. } | Message::End { .. } => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a broker sent a keeper's message",
                ));
            }
        }
    }
    Ok(())
}
