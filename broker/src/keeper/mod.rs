//! The keeper: where a broker's lease descriptors and the records of its sessions and
//! leases wait across a broker restart. [`place`] is the seam; two places implement it: a
//! keeper process (`gpu-broker keeper`, [`serve`]; the broker's end [`link`]) and systemd's
//! file-descriptor store ([`fdstore`], its records in a memfd [`journal`]); [`choose`]
//! picks one. Either holds a copy of every leased block's descriptor (so the memory
//! outlives the broker) with the lease's record; the broker writes each change as the
//! state lock makes it and, when it starts again, reads everything back and adopts the
//! leases of holders still alive (`arbiter/restart/`). A keeper process lost while the
//! broker runs is reconnected to and filled again with everything live ([`link`],
//! `arbiter/restart/relink.rs`). [`wire`] is the keeper's socket and its messages, [`records`]
//! the versioned records.

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
        let server = keeper_serving(&path, 2);
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
        let kept = server.join().unwrap();
        assert_eq!((kept.len(), kept.descriptors()), (2, 1));
    }

    use std::os::unix::fs::FileExt;

    /// A keeper on `path` serving `connections` brokers one after the other, on a thread;
    /// what it kept when the last one went.
    fn keeper_serving(
        path: &std::path::Path,
        connections: usize,
    ) -> std::thread::JoinHandle<serve::Kept> {
        let listener = wire::bind(path).unwrap();
        std::thread::spawn(move || {
            let mut kept = serve::Kept::default();
            for _ in 0..connections {
                let conn = wire::accept(&listener).unwrap();
                serve::serve_connection(&conn, &mut kept).unwrap();
            }
            kept
        })
    }

    /// A memfd holding `text` at its start.
    fn memfd_with(text: &str) -> std::os::fd::OwnedFd {
        let fd = crate::device::host::memfd("keeper-test", 4096).unwrap();
        std::fs::File::from(fd.try_clone().unwrap())
            .write_all_at(text.as_bytes(), 0)
            .unwrap();
        fd
    }

    fn text_of(fd: &std::os::fd::OwnedFd, len: usize) -> String {
        let mut buf = vec![0u8; len];
        std::fs::File::from(fd.try_clone().unwrap())
            .read_exact_at(&mut buf, 0)
            .unwrap();
        String::from_utf8(buf).unwrap()
    }

    /// A dump of more records than one message holds comes back in batches, each record
    /// with its own descriptor (records without one between them), in key order.
    #[test]
    fn a_large_dump_comes_back_in_batches_with_every_descriptor_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keeper.sock");
        let server = keeper_serving(&path, 2);
        let n = 3 * wire::MAX_BATCH + 17;
        {
            let link = KeeperLink::connect(&path).unwrap();
            for i in 0..n {
                let key = format!("lease/{i:05}");
                // A long label: fewer records fit in one message than MAX_BATCH.
                let record = serde_json::json!({"v": 1, "i": i, "label": "x".repeat(300)});
                if i % 3 == 0 {
                    link.put(key, record, None);
                } else {
                    let fd = memfd_with(&format!("{i:05}"));
                    link.put(key, record, Some(fd.as_fd()));
                }
            }
        }
        let link = KeeperLink::connect(&path).unwrap();
        let entries = link.dump().unwrap();
        assert_eq!(entries.len(), n);
        for (i, e) in entries.iter().enumerate() {
            assert_eq!(e.key, format!("lease/{i:05}"));
            assert_eq!(e.record["i"], i);
            match &e.fd {
                None => assert_eq!(i % 3, 0, "record {i} lost its descriptor"),
                Some(fd) => assert_eq!(text_of(fd, 5), format!("{i:05}"), "record {i}"),
            }
        }
        drop(link);
        server.join().unwrap();
    }

    /// A keeper of an earlier version knows no batches: it reads the batched dump request
    /// as a plain dump (the request as an earlier `Message` reads it) and answers entry by
    /// entry, which the broker takes as well; a broker of an earlier version asks without
    /// `batch` and gets entry by entry from this keeper.
    #[test]
    fn dumps_work_between_this_version_and_the_one_before_batches() {
        #[derive(serde::Deserialize, PartialEq, Debug)]
        #[serde(tag = "op", rename_all = "kebab-case")]
        enum Earlier {
            Dump,
        }
        let asked = serde_json::to_vec(&wire::Message::Dump {
            batch: Some(wire::MAX_BATCH as u32),
        })
        .unwrap();
        assert_eq!(
            serde_json::from_slice::<Earlier>(&asked).unwrap(),
            Earlier::Dump
        );
        assert_eq!(
            serde_json::from_slice::<wire::Message>(br#"{"op":"dump"}"#).unwrap(),
            wire::Message::Dump { batch: None }
        );

        // An earlier keeper: one entry per message, whatever the request says.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keeper.sock");
        let listener = wire::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let conn = wire::accept(&listener).unwrap();
            let (msg, _) = wire::recv(&conn).unwrap().unwrap();
            assert!(matches!(msg, wire::Message::Dump { .. }), "{msg:?}");
            for i in 0..3 {
                let fd = memfd_with(&format!("{i}"));
                let entry = wire::Message::Entry {
                    key: format!("lease/{i}"),
                    record: serde_json::json!({"v": 1}),
                    has_fd: true,
                };
                wire::send(&conn, &entry, Some(fd.as_fd())).unwrap();
            }
            wire::send(&conn, &wire::Message::End { count: 3 }, None).unwrap();
            // Until the broker has read everything.
            let _ = wire::recv(&conn);
        });
        let link = KeeperLink::connect(&path).unwrap();
        let entries = link.dump().unwrap();
        let got: Vec<(String, String)> = entries
            .iter()
            .map(|e| (e.key.clone(), text_of(e.fd.as_ref().unwrap(), 1)))
            .collect();
        assert_eq!(
            got,
            [("lease/0", "0"), ("lease/1", "1"), ("lease/2", "2")]
                .map(|(k, t)| (k.to_string(), t.to_string()))
        );
        drop(link);
        server.join().unwrap();

        // An earlier broker's plain dump from this keeper: entry by entry.
        let path = dir.path().join("keeper2.sock");
        let server = keeper_serving(&path, 2);
        let link = KeeperLink::connect(&path).unwrap();
        let fd = memfd_with("a");
        link.put(
            "lease/a".into(),
            serde_json::json!({"v": 1}),
            Some(fd.as_fd()),
        );
        link.put("session/s".into(), serde_json::json!({"v": 1}), None);
        drop(link);
        let sock = wire::connect(&path).unwrap();
        wire::send(&sock, &wire::Message::Dump { batch: None }, None).unwrap();
        let mut got = Vec::new();
        loop {
            match wire::recv(&sock).unwrap().unwrap() {
                (wire::Message::Entry { key, has_fd, .. }, fd) => {
                    assert_eq!(has_fd, fd.is_some());
                    got.push(key);
                }
                (wire::Message::End { count }, _) => {
                    assert_eq!(count, 2);
                    break;
                }
                (other, _) => panic!("{other:?}"),
            }
        }
        assert_eq!(got, ["lease/a", "session/s"]);
        drop(sock);
        server.join().unwrap();
    }

    /// A link whose keeper closed its end sees it and is declared lost once; it then
    /// reconnects to the next keeper on the socket, which is told to forget what it held
    /// (here an earlier broker's stale lease) before anything is written again, and the
    /// writes after `resume` reach it.
    #[test]
    fn a_lost_link_reconnects_to_the_next_keeper_and_empties_it_first() {
        use std::time::Duration;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keeper.sock");
        let listener = wire::bind(&path).unwrap();
        let link = KeeperLink::connect(&path).unwrap();
        let conn = wire::accept(&listener).unwrap();
        assert!(
            !link.watch(Duration::from_millis(10)),
            "the keeper is there"
        );
        // The keeper dies.
        drop((conn, listener));
        assert!(link.watch(Duration::from_secs(5)));
        assert!(link.lose_closed());
        assert!(!link.lose_closed(), "declared lost once");
        assert!(link.is_broken());
        assert!(!link.resume(), "nothing to resume before a reconnect");
        link.put("lease/while-lost".into(), serde_json::json!({"v": 1}), None);

        // The next keeper, holding what an earlier broker left.
        let server = keeper_serving(&path, 3);
        {
            let stale = KeeperLink::connect(&path).unwrap();
            let fd = memfd_with("stale");
            stale.put(
                "lease/stale".into(),
                serde_json::json!({"v": 1}),
                Some(fd.as_fd()),
            );
        }
        link.reconnect().unwrap();
        assert!(link.resume());
        assert!(!link.is_broken());
        let fd = memfd_with("live");
        link.put(
            "lease/live".into(),
            serde_json::json!({"v": 1}),
            Some(fd.as_fd()),
        );
        drop(link);
        let reader = KeeperLink::connect(&path).unwrap();
        let entries = reader.dump().unwrap();
        let keys: Vec<&str> = entries.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(keys, ["lease/live"]);
        assert_eq!(text_of(entries[0].fd.as_ref().unwrap(), 4), "live");
        drop((entries, reader));
        let kept = server.join().unwrap();
        assert_eq!((kept.len(), kept.descriptors()), (1, 1));
    }

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
