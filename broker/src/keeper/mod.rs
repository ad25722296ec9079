//! The keeper: where a broker's lease descriptors and the records of its sessions and
//! leases wait across a broker restart. [`place`] is the seam; two places implement it: a
//! keeper process (`gpu-broker keeper`, [`serve`]; the broker's end [`link`]) and systemd's
//! file-descriptor store ([`fdstore`], its records in a memfd [`journal`]); [`choose`]
//! picks one. Either holds a copy of every leased block's descriptor (so the memory
//! outlives the broker) with the lease's record; the broker writes each change as the
//! state lock makes it and, when it starts again, reads everything back and adopts the
//! leases of holders still alive (`arbiter/adopt.rs`). [`wire`] is the keeper's socket and
//! its messages, [`records`] the versioned records.

pub mod choose;
pub mod fdstore;
pub mod journal;
pub mod link;
pub mod place;
pub mod serve;
pub use gpu_broker_core::kept as records;
pub mod wire;

pub use choose::{choose, Choice, KeepIn, SystemdEnv};
pub use fdstore::FdStore;
pub use link::{KeeperError, KeeperLink};
pub use place::{Entry, Place};
pub use records::{Kept, LeaseRecord, SessionRecord, RECORD_VERSION};

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    /// Puts, replacements and removes reach the keeper in order; a dump hands back every
    /// record with a working copy of its descriptor, and the keeper keeps its own; a
    /// broker that died mid-way leaves what it wrote.
    #[test]
    fn a_keeper_keeps_records_and_descriptors_across_connections() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keeper.sock");
        let listener = wire::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let mut kept = serve::Kept::default();
            for _ in 0..2 {
                let conn = wire::accept(&listener).unwrap();
                serve::serve_connection(&conn, &mut kept).unwrap();
            }
            (kept.len(), kept.descriptors())
        });
        let memfd = crate::device::host::memfd("keeper-test", 4096).unwrap();
        std::fs::File::from(memfd.try_clone().unwrap())
            .write_all_at(b"kept", 0)
            .unwrap();
        {
            let link = KeeperLink::connect(&path).unwrap();
            assert!(link.dump().unwrap().is_empty());
            link.put(
                "lease/a".into(),
                serde_json::json!({"v": 1}),
                Some(memfd.as_fd()),
            );
            link.put(
                "lease/b".into(),
                serde_json::json!({"v": 1}),
                Some(memfd.as_fd()),
            );
            link.put(
                "session/s".into(),
                serde_json::json!({"v": 1, "n": 1}),
                None,
            );
            link.put(
                "session/s".into(),
                serde_json::json!({"v": 1, "n": 2}),
                None,
            );
            link.remove("lease/b".into());
            assert_eq!(link.sent(), 5);
            // Dropped without a word: as a SIGKILLed broker's socket.
        }
        drop(memfd);
        let link = KeeperLink::connect(&path).unwrap();
        let entries = link.dump().unwrap();
        let keys: Vec<&str> = entries.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(keys, ["lease/a", "session/s"]);
        assert_eq!(entries[1].record["n"], 2);
        assert!(entries[1].fd.is_none());
        let fd = entries[0].fd.as_ref().unwrap().try_clone().unwrap();
        let mut buf = [0u8; 4];
        std::fs::File::from(fd).read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(
            &buf, b"kept",
            "the memory outlived every broker-side descriptor"
        );
        drop(entries);
        drop(link);
        assert_eq!(server.join().unwrap(), (2, 1));
    }

    use std::os::unix::fs::FileExt;

    /// A message that is not the protocol's ends the connection with an error; a
    /// second keeper on a live socket is refused.
    #[test]
    fn garbage_and_a_second_keeper_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keeper.sock");
        let listener = wire::bind(&path).unwrap();
        let client = wire::connect(&path).unwrap();
        let conn = wire::accept(&listener).unwrap();
        // SAFETY: a plain write of a few bytes on our own socket.
        let n = unsafe {
            libc::write(
                std::os::fd::AsRawFd::as_raw_fd(&client),
                b"nope".as_ptr().cast(),
                4,
            )
        };
        assert_eq!(n, 4);
        let mut kept = serve::Kept::default();
        let e = serve::serve_connection(&conn, &mut kept).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        assert!(kept.is_empty());
        assert!(wire::bind(&path).is_err());
    }
}
