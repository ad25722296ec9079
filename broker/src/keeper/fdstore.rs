//! systemd's file-descriptor store as the place kept things wait (`--keep-in fdstore`, a
//! [`Place`]). Each lease's block descriptor goes to the store under the lease's key as its
//! FDNAME (`FDSTORE=1`, `FDNAME=lease/<id>`, `FDPOLL=0`, the descriptor in `SCM_RIGHTS` on
//! the notify socket) and leaves it when the lease ends (`FDSTOREREMOVE=1`); the records
//! are a memfd journal in the store too ([`super::journal`]). A lease's block keeps its
//! lease's name when its quarantine or held-for-importers record takes it over
//! ([`descriptor_name`]). A descriptor is stored before
//! its record is written, and a record removed before its descriptor, so a record always
//! has its descriptor; a descriptor left without a record by a SIGKILL is let go at the
//! next start. systemd hands everything back at the next start (`LISTEN_FDS`,
//! `LISTEN_FDNAMES`, `LISTEN_PID`: [`take_handed_back`]); the store outlives the process
//! with `FileDescriptorStorePreserve=yes` (deploy/gpu-broker.service).

use super::journal::{self, Journal};
use super::place::{Entry, Place};
use super::records::{HELD_PREFIX, LEASE_PREFIX, QUARANTINE_PREFIX};
use super::wire::Message;
use super::KeeperError;
use parking_lot::Mutex;
use sd_notify::NotifyState;
use sendfd::SendWithFd;
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// How long a message to systemd may wait for room in its queue (a write runs under the
/// state lock; a manager that does not read for this long counts as gone).
const SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest FDNAME systemd takes.
const FDNAME_MAX: usize = 255;

/// Is `name` one systemd accepts as an FDNAME (printable ASCII, no `:`, at most 255)?
pub fn valid_fdname(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= FDNAME_MAX
        && name.bytes().all(|b| b.is_ascii_graphic() && b != b':')
}

/// Is `name` one of the names this broker stores under?
fn is_ours(name: &str) -> bool {
    journal::generation_of(name).is_some()
        || name.starts_with(LEASE_PREFIX)
        || name.starts_with(QUARANTINE_PREFIX)
        || name.starts_with(HELD_PREFIX)
}

/// The descriptors of ours systemd handed back at this start, with their names (others,
/// e.g. sockets of socket activation, are left alone). Call before any thread starts a
/// process: it marks them close-on-exec.
pub fn take_handed_back() -> Vec<(String, OwnedFd)> {
    match sd_notify::listen_fds_with_names() {
        Ok(fds) => fds
            .filter(|(_, name)| is_ours(name))
            // SAFETY: systemd passed these descriptors to this process (LISTEN_PID is
            // ours) and nothing else in it owns them.
            .map(|(raw, name)| (name, unsafe { OwnedFd::from_raw_fd(raw) }))
            .collect(),
        Err(e) => {
            eprintln!("gpu-broker: ignoring the descriptors systemd passed: {e}");
            Vec::new()
        }
    }
}

/// The name `key`'s descriptor is stored under. An ended lease's memory kept under its
/// quarantine's or held block's key is the descriptor its lease was stored with, and
/// systemd stores a descriptor once, under its first name: it keeps the lease's name (a
/// rename would be a removal then a store, and a crash between would lose it).
fn descriptor_name(key: &str) -> Cow<'_, str> {
    match key
        .strip_prefix(QUARANTINE_PREFIX)
        .or_else(|| key.strip_prefix(HELD_PREFIX))
    {
        Some(id) => Cow::Owned(format!("{LEASE_PREFIX}{id}")),
        None => Cow::Borrowed(key),
    }
}

fn connect_notify_socket() -> io::Result<UnixDatagram> {
    let path = std::env::var_os("NOTIFY_SOCKET")
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "$NOTIFY_SOCKET is not set"))?;
    let sock = UnixDatagram::unbound()?;
    use std::os::unix::ffi::OsStrExt;
    match path.as_bytes().strip_prefix(b"@") {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            sock.connect_addr(&addr)?;
        }
        None => sock.connect(&path)?,
    }
    sock.set_write_timeout(Some(SEND_TIMEOUT))?;
    Ok(sock)
}

fn send(sock: &UnixDatagram, states: &[NotifyState], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let mut msg = String::new();
    for s in states {
        msg.push_str(&s.to_string());
        msg.push('\n');
    }
    let n = match fd {
        Some(fd) => sock.send_with_fd(msg.as_bytes(), &[fd.as_raw_fd()])?,
        None => sock.send(msg.as_bytes())?,
    };
    if n != msg.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "a short notify message",
        ));
    }
    Ok(())
}

fn store(sock: &UnixDatagram, name: &str, fd: BorrowedFd<'_>) -> io::Result<()> {
    // FDPOLL=0: a device descriptor must not be dropped for a poll event it reports.
    send(
        sock,
        &[
            NotifyState::FdStore,
            NotifyState::FdName(name),
            NotifyState::Custom("FDPOLL=0"),
        ],
        Some(fd),
    )
}

fn unstore(sock: &UnixDatagram, name: &str) -> io::Result<()> {
    send(
        sock,
        &[NotifyState::FdStoreRemove, NotifyState::FdName(name)],
        None,
    )
}

/// Lets go of descriptors systemd handed back that no place will use (`--keep-in none`
/// or a keeper): they leave the store, so their memory goes.
pub fn let_go(handed: Vec<(String, OwnedFd)>) {
    if handed.is_empty() {
        return;
    }
    let names: HashSet<String> = handed.into_iter().map(|(n, _)| n).collect();
    match connect_notify_socket() {
        Ok(sock) => {
            for name in &names {
                if let Err(e) = unstore(&sock, name) {
                    tracing::warn!(name, error = %e, "could not take a descriptor out of the fd store");
                }
            }
            tracing::warn!(
                descriptors = names.len(),
                "the fd store held leases of a previous broker that this one does not keep (--keep-in): let go"
            );
        }
        Err(e) => {
            tracing::warn!(error = %e, "the fd store handed back descriptors, and cannot be told to drop them")
        }
    }
}

/// What systemd handed back at this start, as read.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Intake {
    /// Records in the newest journal.
    pub records: usize,
    /// Lease descriptors that came with a record.
    pub descriptors: usize,
    /// Lease descriptors without a record (their lease had ended): let go.
    pub orphans: usize,
    /// Journal lines not understood, or journals not readable.
    pub unreadable: usize,
}

/// The fd store as a [`Place`].
pub struct FdStore {
    inner: Mutex<Inner>,
    broken: AtomicBool,
    sent: AtomicU64,
    /// `$FDSTORE`: how many descriptors the store takes.
    capacity: Option<usize>,
    intake: Intake,
}

struct Inner {
    sock: UnixDatagram,
    journal: Journal,
    /// Names of the lease descriptors in the store, with the keys whose descriptor each is
    /// (a lease's, then its quarantine's or held block's): it leaves with the last.
    stored: HashMap<String, BTreeSet<String>>,
    /// What the store handed back, until [`Place::dump`] takes it.
    entries: Vec<Entry>,
    full_warned: bool,
}

impl FdStore {
    /// Takes what systemd handed back (`handed`, from [`take_handed_back`]): the newest
    /// journal's records with their descriptors, for [`Place::dump`]. Its live records go
    /// to a new journal generation, stored before the old ones and any descriptor without
    /// a record leave the store. `capacity`: `$FDSTORE`.
    pub fn open(
        handed: Vec<(String, OwnedFd)>,
        capacity: Option<usize>,
    ) -> Result<FdStore, KeeperError> {
        let sock = connect_notify_socket().map_err(KeeperError::FdStore)?;
        FdStore::open_on(sock, handed, capacity)
    }

    /// [`FdStore::open`] with the notify socket `sock` (connected).
    pub fn open_on(
        sock: UnixDatagram,
        handed: Vec<(String, OwnedFd)>,
        capacity: Option<usize>,
    ) -> Result<FdStore, KeeperError> {
        let mut journals = Vec::new();
        let mut fds = BTreeMap::new();
        for (name, fd) in handed {
            if let Some(g) = journal::generation_of(&name) {
                journals.push((g, name, fd));
            } else {
                // Two under one name (never written so): the first; the store keeps both
                // until the name is removed.
                fds.entry(name).or_insert(fd);
            }
        }
        journals.sort_by_key(|(g, ..)| *g);
        let mut intake = Intake::default();
        let back = match journals.last() {
            Some((_, name, fd)) => match Journal::read(fd) {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(name, error = %e, "the fd store's records cannot be read: its leases are let go");
                    intake.unreadable += 1;
                    journal::ReadBack::default()
                }
            },
            None => journal::ReadBack::default(),
        };
        intake.records = back.records.len();
        intake.unreadable += back.skipped;
        let generation = journals.last().map_or(1, |(g, ..)| g + 1);
        let j = Journal::create(generation, &back.records).map_err(KeeperError::FdStore)?;
        store(&sock, &j.name(), j.fd()).map_err(KeeperError::FdStore)?;
        for (_, name, _) in &journals {
            unstore(&sock, name).map_err(KeeperError::FdStore)?;
        }
        let mut stored: HashMap<String, BTreeSet<String>> = HashMap::new();
        let mut entries = Vec::with_capacity(back.records.len());
        for (key, record) in back.records {
            // Under its own name (a store an earlier version wrote) or its lease's.
            let name = [key.clone(), descriptor_name(&key).into_owned()]
                .into_iter()
                .find(|n| fds.contains_key(n));
            let fd = name.as_ref().and_then(|n| match fds[n].try_clone() {
                Ok(fd) => Some(fd),
                Err(e) => {
                    tracing::error!(key, error = %e, "a kept descriptor cannot be copied: its lease is let go");
                    None
                }
            });
            if let (Some(name), Some(_)) = (name, &fd) {
                stored.entry(name).or_default().insert(key.clone());
                intake.descriptors += 1;
            }
            entries.push(Entry { key, record, fd });
        }
        for name in fds.keys().filter(|n| !stored.contains_key(*n)) {
            unstore(&sock, name).map_err(KeeperError::FdStore)?;
            intake.orphans += 1;
        }
        tracing::info!(
            records = intake.records,
            descriptors = intake.descriptors,
            without_record = intake.orphans,
            unreadable = intake.unreadable,
            journal = %j.name(),
            capacity = ?capacity,
            "systemd's fd store keeps leases across restarts"
        );
        Ok(FdStore {
            inner: Mutex::new(Inner {
                sock,
                journal: j,
                stored,
                entries,
                full_warned: false,
            }),
            broken: AtomicBool::new(false),
            sent: AtomicU64::new(0),
            capacity,
            intake,
        })
    }

    /// What this start found in the store.
    pub fn intake(&self) -> &Intake {
        &self.intake
    }

    /// How many lease descriptors it has put in the store and not removed.
    pub fn stored(&self) -> usize {
        self.inner.lock().stored.len()
    }

    fn failed(&self, e: io::Error) {
        if !self.broken.swap(true, Ordering::Relaxed) {
            tracing::error!(error = %e, "systemd's fd store cannot be written: leases made from now on do not survive a broker restart");
        }
    }

    /// Stores `fd` for `key` unless its name is there already or the store is full.
    fn store_lease(&self, inner: &mut Inner, key: &str, fd: BorrowedFd<'_>) -> io::Result<()> {
        let name = descriptor_name(key);
        if let Some(keys) = inner.stored.get_mut(name.as_ref()) {
            keys.insert(key.to_string());
            return Ok(());
        }
        if !valid_fdname(&name) {
            tracing::warn!(
                key,
                "not a valid FDNAME: this lease does not survive a restart"
            );
            return Ok(());
        }
        // Room for the journal and the next generation of it.
        if self.capacity.is_some_and(|c| inner.stored.len() + 2 >= c) {
            if !inner.full_warned {
                inner.full_warned = true;
                tracing::warn!(
                    capacity = ?self.capacity,
                    "systemd's fd store is full (FileDescriptorStoreMax=): leases beyond it do not survive a restart"
                );
            }
            return Ok(());
        }
        store(&inner.sock, &name, fd)?;
        inner
            .stored
            .insert(name.into_owned(), BTreeSet::from([key.to_string()]));
        Ok(())
    }

    fn compact_if_due(&self, inner: &mut Inner) -> io::Result<()> {
        if !inner.journal.wants_compaction() {
            return Ok(());
        }
        let next = inner.journal.compacted()?;
        store(&inner.sock, &next.name(), next.fd())?;
        let old = std::mem::replace(&mut inner.journal, next);
        unstore(&inner.sock, &old.name())
    }
}

impl Place for FdStore {
    fn describe(&self) -> String {
        "systemd's fd store".into()
    }

    fn dump(&self) -> Result<Vec<Entry>, KeeperError> {
        Ok(std::mem::take(&mut self.inner.lock().entries))
    }

    fn put(&self, key: String, record: serde_json::Value, fd: Option<BorrowedFd<'_>>) {
        if self.is_broken() {
            return;
        }
        let mut inner = self.inner.lock();
        let r = (|| {
            if let Some(fd) = fd {
                self.store_lease(&mut inner, &key, fd)?;
            }
            inner.journal.append(&Message::Put { key, record })?;
            self.compact_if_due(&mut inner)
        })();
        match r {
            Ok(()) => {
                self.sent.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => self.failed(e),
        }
    }

    fn remove(&self, key: String) {
        if self.is_broken() {
            return;
        }
        let mut inner = self.inner.lock();
        let r = (|| {
            inner
                .journal
                .append(&Message::Remove { key: key.clone() })?;
            // Under its lease's name, or its own where an earlier version stored it.
            let name = [descriptor_name(&key).into_owned(), key.clone()]
                .into_iter()
                .find(|n| inner.stored.get(n).is_some_and(|keys| keys.contains(&key)));
            if let Some(name) = name {
                let keys = inner.stored.get_mut(&name).expect("found above");
                keys.remove(&key);
                if keys.is_empty() {
                    inner.stored.remove(&name);
                    unstore(&inner.sock, &name)?;
                }
            }
            self.compact_if_due(&mut inner)
        })();
        match r {
            Ok(()) => {
                self.sent.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => self.failed(e),
        }
    }

    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::os::fd::AsFd;

    /// The messages systemd would read on its end of `sock`, with their descriptors.
    fn read_all(sock: &UnixDatagram) -> Vec<(String, Option<OwnedFd>)> {
        use sendfd::RecvWithFd;
        sock.set_nonblocking(true).unwrap();
        let mut out = Vec::new();
        loop {
            let mut buf = [0u8; 4096];
            let mut fds = [-1; 2];
            match sock.recv_with_fd(&mut buf, &mut fds) {
                Ok((n, nfds)) => {
                    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                    // SAFETY: a descriptor just received, owned by nobody else.
                    let fd = (nfds == 1).then(|| unsafe { OwnedFd::from_raw_fd(fds[0]) });
                    out.push((text, fd));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return out,
                Err(e) => panic!("{e}"),
            }
        }
    }

    fn texts(m: &[(String, Option<OwnedFd>)]) -> Vec<String> {
        m.iter().map(|(t, _)| t.replace('\n', " ")).collect()
    }

    fn memfd() -> OwnedFd {
        crate::device::host::memfd("gpu-broker-test", 4096).unwrap()
    }

    /// At start the newest journal's records come back with their descriptors; its
    /// records move to a new generation stored before the old ones leave, and a
    /// descriptor without a record leaves the store. Afterwards a descriptor is stored
    /// once, before its record, removed after it, and not beyond the store's size.
    #[test]
    fn the_store_hands_back_records_with_descriptors_and_is_kept_in_step() {
        let mut old = Journal::create(2, &BTreeMap::new()).unwrap();
        old.append(&Message::Put {
            key: "lease/gone".into(),
            record: json!({"v": 1}),
        })
        .unwrap();
        let mut newest = Journal::create(3, &BTreeMap::new()).unwrap();
        for key in ["lease/a", "lease/b", "session/s"] {
            newest
                .append(&Message::Put {
                    key: key.into(),
                    record: json!({"v": 1, "k": key}),
                })
                .unwrap();
        }
        newest
            .append(&Message::Remove {
                key: "lease/b".into(),
            })
            .unwrap();
        let handed = vec![
            (old.name(), old.fd().try_clone_to_owned().unwrap()),
            (newest.name(), newest.fd().try_clone_to_owned().unwrap()),
            ("lease/a".to_string(), memfd()),
            ("lease/b".to_string(), memfd()),
        ];
        let (ours, systemd) = UnixDatagram::pair().unwrap();
        let store = FdStore::open_on(ours, handed, Some(4)).unwrap();
        assert_eq!(
            *store.intake(),
            Intake {
                records: 2,
                descriptors: 1,
                orphans: 1,
                unreadable: 0
            }
        );
        let m = read_all(&systemd);
        assert_eq!(
            texts(&m),
            [
                "FDSTORE=1 FDNAME=records-4 FDPOLL=0 ",
                "FDSTOREREMOVE=1 FDNAME=records-2 ",
                "FDSTOREREMOVE=1 FDNAME=records-3 ",
                "FDSTOREREMOVE=1 FDNAME=lease/b ",
            ]
        );
        let journal = m[0].1.as_ref().unwrap().try_clone().unwrap();
        let entries = store.dump().unwrap();
        let got: Vec<(&str, bool)> = entries
            .iter()
            .map(|e| (e.key.as_str(), e.fd.is_some()))
            .collect();
        assert_eq!(got, [("lease/a", true), ("session/s", false)]);

        let fd = memfd();
        let r = json!({"v": 1});
        store.put("lease/c".into(), r.clone(), Some(fd.as_fd()));
        // Already in the store: only the record changes.
        store.put("lease/a".into(), r.clone(), Some(fd.as_fd()));
        store.remove("lease/a".into());
        store.remove("session/s".into());
        // Size 4: two lease descriptors and room for two journal generations.
        store.put("lease/d".into(), r.clone(), Some(fd.as_fd()));
        store.put("lease/e".into(), r.clone(), Some(fd.as_fd()));
        let m = read_all(&systemd);
        assert_eq!(
            texts(&m),
            [
                "FDSTORE=1 FDNAME=lease/c FDPOLL=0 ",
                "FDSTOREREMOVE=1 FDNAME=lease/a ",
                "FDSTORE=1 FDNAME=lease/d FDPOLL=0 ",
            ]
        );
        assert!(m[0].1.is_some() && m[1].1.is_none());
        assert_eq!(store.stored(), 2);
        let back = Journal::read(&journal).unwrap();
        let keys: Vec<&str> = back.records.keys().map(|k| k.as_str()).collect();
        assert_eq!(keys, ["lease/c", "lease/d", "lease/e"]);
        assert!(!store.is_broken());

        // systemd gone: the store counts as broken, the broker goes on.
        drop(systemd);
        store.remove("lease/c".into());
        assert!(store.is_broken());
    }

    /// A journal grown well past what is live is rewritten: the new generation is stored
    /// before the old one leaves, and holds what is live.
    #[test]
    fn a_grown_journal_moves_to_a_new_generation_in_the_store() {
        let (ours, systemd) = UnixDatagram::pair().unwrap();
        let store = FdStore::open_on(ours, Vec::new(), None).unwrap();
        let fd = memfd();
        let record = json!({"v": 1, "pad": "x".repeat(200)});
        let mut seen = read_all(&systemd);
        for i in 0..4000 {
            store.put(format!("lease/{i}"), record.clone(), Some(fd.as_fd()));
            if i > 0 {
                store.remove(format!("lease/{}", i - 1));
            }
            // systemd reads as it goes.
            if i % 50 == 0 {
                seen.extend(read_all(&systemd));
            }
        }
        seen.extend(read_all(&systemd));
        assert!(!store.is_broken());
        let journals: Vec<(String, Option<OwnedFd>)> = seen
            .into_iter()
            .filter(|(t, _)| t.contains("records-"))
            .collect();
        assert_eq!(
            texts(&journals),
            [
                "FDSTORE=1 FDNAME=records-1 FDPOLL=0 ",
                "FDSTORE=1 FDNAME=records-2 FDPOLL=0 ",
                "FDSTOREREMOVE=1 FDNAME=records-1 ",
            ]
        );
        let back = Journal::read(journals[1].1.as_ref().unwrap()).unwrap();
        assert!(
            back.records.len() == 1 || back.records.len() == 2,
            "{}",
            back.records.len()
        );
        assert!(back.records.contains_key("lease/3999"));
    }

    /// A quarantine or held block taking over its lease's descriptor keeps the lease's name
    /// (no removal and store a crash could fall between): the name leaves with the last
    /// record that has it, and a restart hands the descriptor to that record, also when an
    /// earlier version stored it under the record's own name.
    #[test]
    fn a_quarantine_keeps_its_leases_descriptor_name_until_lifted() {
        let (ours, systemd) = UnixDatagram::pair().unwrap();
        let store = FdStore::open_on(ours, Vec::new(), None).unwrap();
        let fd = memfd();
        let r = json!({"v": 1});
        store.put("lease/a".into(), r.clone(), Some(fd.as_fd()));
        store.put("quarantine/a".into(), r.clone(), Some(fd.as_fd()));
        store.remove("lease/a".into());
        store.put("held/b".into(), r.clone(), Some(fd.as_fd()));
        let m = read_all(&systemd);
        let sent = texts(&m);
        let journal = m[0].1.as_ref().unwrap().try_clone().unwrap();
        assert_eq!(
            sent[1..],
            [
                "FDSTORE=1 FDNAME=lease/a FDPOLL=0 ",
                "FDSTORE=1 FDNAME=lease/b FDPOLL=0 ",
            ],
            "nothing removed while the quarantine has the descriptor"
        );
        assert_eq!(store.stored(), 2);

        // A restart: the quarantine gets the descriptor stored under its lease's name, the
        // held block one an earlier version stored under the record's own name.
        let handed = vec![
            ("records-1".to_string(), journal),
            ("lease/a".to_string(), memfd()),
            ("held/b".to_string(), memfd()),
        ];
        let (ours, systemd) = UnixDatagram::pair().unwrap();
        let store = FdStore::open_on(ours, handed, None).unwrap();
        assert_eq!(store.intake().descriptors, 2);
        assert_eq!(store.intake().orphans, 0);
        let got: Vec<(String, bool)> = store
            .dump()
            .unwrap()
            .into_iter()
            .map(|e| (e.key, e.fd.is_some()))
            .collect();
        assert_eq!(
            got,
            [
                ("held/b".to_string(), true),
                ("quarantine/a".to_string(), true)
            ]
        );
        read_all(&systemd);
        store.remove("quarantine/a".into());
        store.remove("held/b".into());
        assert_eq!(
            texts(&read_all(&systemd)),
            [
                "FDSTOREREMOVE=1 FDNAME=lease/a ",
                "FDSTOREREMOVE=1 FDNAME=held/b ",
            ]
        );
        assert_eq!(store.stored(), 0);
    }

    #[test]
    fn fdnames_are_printable_ascii_without_colons() {
        assert!(valid_fdname("lease/0193a0b2-0000-4000-8000-000000000002"));
        assert!(valid_fdname("records-12"));
        assert!(!valid_fdname("a:b"));
        assert!(!valid_fdname("a b"));
        assert!(!valid_fdname(""));
        assert!(!valid_fdname(&"x".repeat(256)));
    }
}
