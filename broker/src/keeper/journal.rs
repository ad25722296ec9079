//! The records of the systemd fd store ([`super::fdstore`]): an append-only journal in a
//! memfd that is itself in the store (FDNAME `records-<generation>`). A memfd because the
//! records then live exactly as long as the descriptors they describe (both go with the
//! store: a node reboot, `systemctl clean --what=fdstore`), nothing is left on disk for a
//! later boot to misread, and a write is in the store the moment it returns (the store
//! holds the same file), so a SIGKILL right after it loses nothing. Each line is a keeper
//! message ([`Message::Put`] or [`Message::Remove`], the same JSON as the keeper's socket);
//! a line cut by a SIGKILL mid-write has no newline and is ignored. When the journal has
//! grown well past what is live, the live records are written to a new generation, which
//! is stored before the old one is removed (a restart between the two reads the newest).

use super::wire::Message;
use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;

/// The FDNAME prefix of a journal generation.
pub const NAME_PREFIX: &str = "records-";

/// A journal is rewritten when it is larger than this and than [`COMPACT_FACTOR`] times
/// what is live.
const COMPACT_MIN_BYTES: u64 = 1 << 20;
const COMPACT_FACTOR: u64 = 4;

/// The journal being written.
pub struct Journal {
    file: File,
    generation: u64,
    /// Bytes written.
    len: u64,
    /// The live records' lines, by key (what a compaction writes).
    live: BTreeMap<String, Vec<u8>>,
    live_bytes: u64,
}

/// What a journal read back holds.
#[derive(Debug, Default)]
pub struct ReadBack {
    pub records: BTreeMap<String, serde_json::Value>,
    /// Lines that were not a put or a remove (a later version's, or damaged).
    pub skipped: usize,
}

/// The generation a store name belongs to, if it is a journal's.
pub fn generation_of(name: &str) -> Option<u64> {
    name.strip_prefix(NAME_PREFIX)?.parse().ok()
}

fn line(msg: &Message) -> io::Result<Vec<u8>> {
    let mut l = serde_json::to_vec(msg).map_err(io::Error::other)?;
    l.push(b'\n');
    Ok(l)
}

impl Journal {
    /// A new journal of generation `generation` holding `records`.
    pub fn create(
        generation: u64,
        records: &BTreeMap<String, serde_json::Value>,
    ) -> io::Result<Journal> {
        // Not named `gpu-broker...`: that prefix is the lease blocks'.
        let fd = crate::device::host::memfd_sealed("kept-records", 0, 0)?;
        let mut j = Journal {
            file: File::from(fd),
            generation,
            len: 0,
            live: BTreeMap::new(),
            live_bytes: 0,
        };
        let mut all = Vec::new();
        for (key, record) in records {
            let l = line(&Message::Put {
                key: key.clone(),
                record: record.clone(),
            })?;
            all.extend_from_slice(&l);
            j.live_bytes += l.len() as u64;
            j.live.insert(key.clone(), l);
        }
        j.file.write_all_at(&all, 0)?;
        j.len = all.len() as u64;
        Ok(j)
    }

    /// Reads the journal in `fd` (another broker's): the records live at its end.
    pub fn read(fd: &OwnedFd) -> io::Result<ReadBack> {
        let file = File::from(fd.try_clone()?);
        let size = file.metadata()?.len();
        let mut buf = vec![0u8; size as usize];
        // At an offset: the store's copy shares the file position.
        file.read_exact_at(&mut buf, 0)?;
        let mut out = ReadBack::default();
        let mut lines = buf.split(|b| *b == b'\n').collect::<Vec<_>>();
        // What follows the last newline is a line cut short (or nothing).
        lines.pop();
        for l in lines {
            match serde_json::from_slice::<Message>(l) {
                Ok(Message::Put { key, record }) => {
                    out.records.insert(key, record);
                }
                Ok(Message::Remove { key }) => {
                    out.records.remove(&key);
                }
                _ => out.skipped += 1,
            }
        }
        Ok(out)
    }

    /// Appends `msg` (a put or a remove).
    pub fn append(&mut self, msg: &Message) -> io::Result<()> {
        let l = line(msg)?;
        self.file.write_all_at(&l, self.len)?;
        self.len += l.len() as u64;
        match msg {
            Message::Put { key, .. } => {
                self.live_bytes += l.len() as u64;
                if let Some(old) = self.live.insert(key.clone(), l) {
                    self.live_bytes -= old.len() as u64;
                }
            }
            Message::Remove { key } => {
                if let Some(old) = self.live.remove(key) {
                    self.live_bytes -= old.len() as u64;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Has it grown enough past what is live to be rewritten?
    pub fn wants_compaction(&self) -> bool {
        self.len > COMPACT_MIN_BYTES && self.len > COMPACT_FACTOR * self.live_bytes
    }

    /// The next generation, holding only what is live.
    pub fn compacted(&self) -> io::Result<Journal> {
        let fd = crate::device::host::memfd_sealed("kept-records", 0, 0)?;
        let file = File::from(fd);
        let all: Vec<u8> = self.live.values().flatten().copied().collect();
        file.write_all_at(&all, 0)?;
        Ok(Journal {
            file,
            generation: self.generation + 1,
            len: all.len() as u64,
            live: self.live.clone(),
            live_bytes: self.live_bytes,
        })
    }

    /// Its name in the store.
    pub fn name(&self) -> String {
        format!("{NAME_PREFIX}{}", self.generation)
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Bytes written.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn put(key: &str, n: u64) -> Message {
        Message::Put {
            key: key.into(),
            record: json!({"v": 1, "n": n}),
        }
    }

    /// What is appended is read back from another descriptor of the same memfd, removes
    /// and replacements applied; a line cut short at the end is ignored.
    #[test]
    fn appends_are_read_back_and_a_cut_tail_is_ignored() {
        let mut j = Journal::create(3, &BTreeMap::new()).unwrap();
        j.append(&put("lease/a", 1)).unwrap();
        j.append(&put("lease/b", 1)).unwrap();
        j.append(&put("session/s", 1)).unwrap();
        j.append(&put("session/s", 2)).unwrap();
        j.append(&Message::Remove {
            key: "lease/b".into(),
        })
        .unwrap();
        // A write cut by a SIGKILL: no newline.
        j.file
            .write_all_at(br#"{"op":"put","key":"lea"#, j.len)
            .unwrap();
        let fd: OwnedFd = j.fd().try_clone_to_owned().unwrap();
        let back = Journal::read(&fd).unwrap();
        let keys: Vec<&str> = back.records.keys().map(|k| k.as_str()).collect();
        assert_eq!(keys, ["lease/a", "session/s"]);
        assert_eq!(back.records["session/s"]["n"], 2);
        assert_eq!(back.skipped, 0);
        assert_eq!(
            (j.name(), generation_of(&j.name())),
            ("records-3".into(), Some(3))
        );
        assert_eq!(generation_of("lease/records-3"), None);
    }

    /// A journal as this version writes it, byte for byte: the next version must read it
    /// (an upgrade in place reads what the previous broker left in the store).
    #[test]
    fn a_journal_written_by_this_version_is_read_back() {
        let text = concat!(
            r#"{"op":"put","key":"lease/l1","record":{"id":"l1","v":1}}"#,
            "\n",
            r#"{"op":"put","key":"session/s1","record":{"id":"s1","v":1}}"#,
            "\n",
            r#"{"op":"remove","key":"lease/l1"}"#,
            "\n",
        );
        let mut j = Journal::create(1, &BTreeMap::new()).unwrap();
        for msg in [
            Message::Put {
                key: "lease/l1".into(),
                record: json!({"v": 1, "id": "l1"}),
            },
            Message::Put {
                key: "session/s1".into(),
                record: json!({"v": 1, "id": "s1"}),
            },
            Message::Remove {
                key: "lease/l1".into(),
            },
        ] {
            j.append(&msg).unwrap();
        }
        let fd: OwnedFd = j.fd().try_clone_to_owned().unwrap();
        let mut written = vec![0u8; j.len() as usize];
        File::from(fd.try_clone().unwrap())
            .read_exact_at(&mut written, 0)
            .unwrap();
        assert_eq!(String::from_utf8(written).unwrap(), text);
        let back = Journal::read(&fd).unwrap();
        assert_eq!(back.records.len(), 1);
        assert_eq!(back.records["session/s1"]["id"], "s1");
    }

    /// A compaction writes only what is live, into the next generation.
    #[test]
    fn a_compaction_keeps_only_what_is_live() {
        let mut j = Journal::create(1, &BTreeMap::new()).unwrap();
        for i in 0..20_000u64 {
            j.append(&put(&format!("lease/{i}"), i)).unwrap();
            if i > 0 {
                j.append(&Message::Remove {
                    key: format!("lease/{}", i - 1),
                })
                .unwrap();
            }
        }
        assert!(j.wants_compaction(), "{} bytes", j.len());
        let c = j.compacted().unwrap();
        assert_eq!(c.generation(), 2);
        assert!(c.len() < 100, "{} bytes", c.len());
        let back = Journal::read(&c.fd().try_clone_to_owned().unwrap()).unwrap();
        assert_eq!(back.records.len(), 1);
        assert_eq!(back.records["lease/19999"]["n"], 19999);
    }
}
