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

/// Listens at `path` and serves brokers until the process is killed.
pub fn run(path: &Path) -> io::Result<()> {
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
        match wire::peer_uid(&conn) {
            Ok(uid) if uid == me || uid == 0 => {}
            other => {
                eprintln!("gpu-broker keeper: refused a connection of uid {other:?}");
                continue;
            }
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
    while let Some((msg, fd)) = wire::recv(conn)? {
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
            Message::Dump => {
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
            Message::Entry { .. } | Message::End { .. } => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a broker sent a keeper's message",
                ));
            }
        }
    }
    Ok(())
}
