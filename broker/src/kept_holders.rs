//! Who may keep CUDA memory the broker freed when the driver says it stayed on the card
//! (`device/free_check.rs`). The broker recorded the processes the block's descriptor
//! reached, but a recorded process can hand the memory on where the broker never sees it:
//! to a child that read its parent's ticket reply, to any process over `SCM_RIGHTS`. The
//! driver cannot say who holds an import; NVML can list the processes with a context on
//! the device ([`ContextLister`]). Of those, the ones near a recorded holder may keep it
//! too: its descendants, and processes of its cgroup, its pid namespace or its uid, where
//! that place is not one the broker shares (its own cgroup, pid namespace and uid, and
//! uid 0, would take in every process on a node). The charge stays until they have all
//! exited, asked again when the last one does.
//!
//! A holder's place is read when its session opens ([`HolderFinder::place`]) and kept by
//! the core with the records of that process, then with the block its descriptor reached
//! (`pool::Reached`): processes near one that exited before its block was freed are still
//! found, however many other processes came and went meanwhile.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};

pub use gpu_broker_core::process_place::{Place, Tie};

/// Lists the processes with a context on a device: NVML on a GPU node; tests give their
/// own (the host backend has none).
pub trait ContextLister: Send + Sync {
    /// The pids with a context on the device of UUID `uuid` (`GPU-...`); `None` when it
    /// cannot tell.
    fn processes_on(&self, uuid: &str) -> Option<Vec<u32>>;
}

/// Reads live process `pid`'s place; `None` when it is gone.
pub fn read_place(pid: u32) -> Option<Place> {
    let start = Some(crate::process::start_ticks(pid)?);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok();
    let uid = status.as_deref().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    });
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .ok()
        .map(|c| c.trim().to_string())
        .filter(|c| !c.is_empty());
    let pid_ns = std::fs::read_link(format!("/proc/{pid}/ns/pid"))
        .ok()
        .and_then(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
        });
    Some(Place {
        pid,
        start,
        uid,
        cgroup,
        pid_ns,
    })
}

/// A process found that may keep the memory, and the recorded holder it is near (whose
/// tenant answers for it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    pub pid: u32,
    pub near: u32,
}

/// What [`HolderFinder::find`] found.
#[derive(Debug)]
pub struct Finding {
    /// The processes that may keep the memory.
    pub found: Vec<Found>,
    /// The places to look near when the last of them exits ([`HolderFinder::watch`]).
    pub places: Vec<Arc<Place>>,
}

/// Stranded memory being watched: where to look again when its last process exits.
#[derive(Debug)]
struct Watched {
    uuid: String,
    /// The recorded holders' places and those of the processes found near them, shared
    /// with every other block watched near them.
    places: Vec<Arc<Place>>,
    /// Processes seen exiting: not named again (NVML may list one a moment after).
    gone: HashSet<u32>,
}

/// The policy with its lister, the places remembered, and the stranded memory it watches.
pub struct HolderFinder {
    lister: Arc<dyn ContextLister>,
    own: Place,
    me: u32,
    /// The places handed out, by pid, so that blocks watched near one process share one
    /// copy: a cache only (entries no block holds any more are swept).
    shared: parking_lot::Mutex<Shared>,
    watched: parking_lot::Mutex<HashMap<uuid::Uuid, Watched>>,
}

#[derive(Default)]
struct Shared {
    by_pid: HashMap<u32, Weak<Place>>,
    /// Its size after the last sweep: swept again when it doubled.
    swept: usize,
}

impl HolderFinder {
    /// A finder that excludes the broker's own places.
    pub fn new(lister: Arc<dyn ContextLister>) -> HolderFinder {
        let me = std::process::id();
        HolderFinder::with_own(lister, read_place(me).unwrap_or_default())
    }

    /// A finder that excludes the places of `own` (tests: [`Place::nowhere`]).
    pub fn with_own(lister: Arc<dyn ContextLister>, own: Place) -> HolderFinder {
        HolderFinder {
            lister,
            own,
            me: std::process::id(),
            shared: Default::default(),
            watched: Default::default(),
        }
    }

    /// Where live process `pid` runs (`/proc`), to keep with its records; `None` when
    /// it is gone.
    pub fn place(&self, pid: u32) -> Option<Arc<Place>> {
        read_place(pid).map(|p| self.share(p))
    }

    /// `p`, as the one copy handed out for its process when that is the same.
    fn share(&self, p: Place) -> Arc<Place> {
        let mut s = self.shared.lock();
        if let Some(known) = s.by_pid.get(&p.pid).and_then(Weak::upgrade) {
            if *known == p {
                return known;
            }
        }
        let p = Arc::new(p);
        s.by_pid.insert(p.pid, Arc::downgrade(&p));
        if s.by_pid.len() > 2 * s.swept.max(64) {
            s.by_pid.retain(|_, w| w.strong_count() > 0);
            s.swept = s.by_pid.len();
        }
        p
    }

    /// Process `pid`'s places: `known` (kept with the block) and as read now when it
    /// lives and is another process of the pid or has moved (either may be the one the
    /// block reached).
    fn places_of(&self, pid: u32, known: Option<&Arc<Place>>) -> Vec<Arc<Place>> {
        let now = read_place(pid);
        let mut out = Vec::new();
        match (known, now) {
            (Some(k), Some(n)) if **k == n => out.push(k.clone()),
            (known, now) => {
                out.extend(known.cloned());
                out.extend(now.map(|n| self.share(n)));
            }
        }
        out
    }

    /// After a free on device `uuid` that did not give the memory back: the processes with
    /// a context there, alive, not in `named` (already charged for) and not the broker,
    /// near one of the processes the block `reached` (or descended from a live one), each
    /// as the one it is closest to ([`Tie`]), and the places to look near again
    /// ([`HolderFinder::watch`]).
    pub fn find(&self, uuid: &str, reached: &crate::pool::Reached, named: &[u32]) -> Finding {
        let mut places: Vec<Arc<Place>> = reached
            .pids()
            .iter()
            .zip(reached.places())
            .flat_map(|(&pid, known)| self.places_of(pid, known.as_ref()))
            .collect();
        let found = self.on_device_near(uuid, &places, named, &HashSet::new());
        places.extend(found.iter().filter_map(|f| self.place(f.pid)));
        Finding { found, places }
    }

    /// The processes with a context on device `uuid` near one of `places`, but for the
    /// broker, those `named` and those `gone`.
    fn on_device_near(
        &self,
        uuid: &str,
        places: &[Arc<Place>],
        named: &[u32],
        gone: &HashSet<u32>,
    ) -> Vec<Found> {
        if places.is_empty() {
            return Vec::new();
        }
        let Some(on_device) = self.lister.processes_on(uuid) else {
            return Vec::new();
        };
        let mut found = Vec::new();
        for pid in on_device {
            if pid == self.me
                || named.contains(&pid)
                || gone.contains(&pid)
                || crate::process::process_gone(pid)
            {
                continue;
            }
            let Some(place) = read_place(pid) else {
                continue;
            };
            // Its ancestors, of which a recorded one still alive (same start) hands down.
            let lineage: Vec<u32> = crate::process::lineage(pid).skip(1).collect();
            let descends = |h: &Place| {
                lineage.contains(&h.pid)
                    && h.start.is_some()
                    && crate::process::start_ticks(h.pid) == h.start
            };
            // The closest holder answers; of holders as close, the first recorded.
            let near = places
                .iter()
                .filter_map(|h| {
                    let tie = if descends(h) {
                        Some(Tie::Descendant)
                    } else {
                        place.shared_with(h, &self.own)
                    };
                    tie.map(|t| (t, h))
                })
                .min_by_key(|(t, _)| *t)
                .map(|(_, h)| h);
            if let Some(h) = near {
                found.push(Found { pid, near: h.pid });
            }
        }
        found
    }

    /// Watches stranded memory `id` on device `uuid`: near `places` when its last process
    /// exits ([`HolderFinder::look_again`]).
    pub fn watch(&self, id: uuid::Uuid, uuid: &str, places: Vec<Arc<Place>>) {
        self.watched.lock().insert(
            id,
            Watched {
                uuid: uuid.to_string(),
                places,
                gone: HashSet::new(),
            },
        );
    }

    /// Process `pid` of stranded memory `id` exited.
    pub fn exited(&self, id: uuid::Uuid, pid: u32) {
        if let Some(w) = self.watched.lock().get_mut(&id) {
            w.gone.insert(pid);
        }
    }

    /// Every process of stranded memory `id` exited: the processes near its places with a
    /// context on its device now (none: it may be let go, and is forgotten here). Blocks
    /// (NVML, `/proc`): called off the runtime.
    pub fn look_again(&self, id: uuid::Uuid) -> Vec<u32> {
        let Some((uuid, places, gone)) = self
            .watched
            .lock()
            .get(&id)
            .map(|w| (w.uuid.clone(), w.places.clone(), w.gone.clone()))
        else {
            return Vec::new();
        };
        let found: Vec<u32> = self
            .on_device_near(&uuid, &places, &[], &gone)
            .into_iter()
            .map(|f| f.pid)
            .collect();
        if found.is_empty() {
            self.forget(id);
        } else {
            let more: Vec<Arc<Place>> = found.iter().filter_map(|&p| self.place(p)).collect();
            if let Some(w) = self.watched.lock().get_mut(&id) {
                for p in more {
                    if !w.places.contains(&p) {
                        w.places.push(p);
                    }
                }
            }
        }
        found
    }

    /// Stranded memory `id` is let go.
    pub fn forget(&self, id: uuid::Uuid) {
        self.watched.lock().remove(&id);
    }

    /// How much stranded memory is watched (tests, operators).
    pub fn watching(&self) -> usize {
        self.watched.lock().len()
    }
}

impl ContextLister for crate::gpu_processes::ProcessMonitor {
    fn processes_on(&self, uuid: &str) -> Option<Vec<u32>> {
        self.compute_pids(uuid)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A process (`sh`) with a child (`sleep 60`): the process and the child's pid.
    pub(crate) fn sh_with_child() -> (std::process::Child, u32) {
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "sleep 60 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(sh.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        (sh, line.trim().parse().unwrap())
    }

    fn place(pid: u32, uid: u32, cgroup: &str, ns: u64) -> Place {
        Place {
            pid,
            start: Some(1),
            uid: Some(uid),
            cgroup: Some(cgroup.into()),
            pid_ns: Some(ns),
        }
    }

    /// Near: a place shared that the broker does not share; the broker's own cgroup, pid
    /// namespace and uid, and uid 0, bind nobody; an unread field matches nothing.
    #[test]
    fn near_is_a_shared_place_the_broker_does_not_share() {
        let own = place(1, 0, "0::/system.slice/gpu-broker.service", 100);
        let holder = place(10, 1000, "0::/kubepods/pod-a/c1", 200);
        // Its container's cgroup, its pid namespace, its uid: each alone is near.
        let tie = |p: Place| p.shared_with(&holder, &own);
        assert_eq!(
            tie(place(11, 2000, "0::/kubepods/pod-a/c1", 300)),
            Some(Tie::Cgroup)
        );
        assert_eq!(tie(place(12, 2000, "0::/x", 200)), Some(Tie::PidNamespace));
        assert_eq!(tie(place(13, 1000, "0::/x", 300)), Some(Tie::Uid));
        // Of several places shared, the closest.
        assert_eq!(
            tie(place(15, 1000, "0::/kubepods/pod-a/c1", 200)),
            Some(Tie::PidNamespace)
        );
        assert_eq!(
            tie(place(16, 1000, "0::/kubepods/pod-a/c1", 300)),
            Some(Tie::Cgroup)
        );
        // Another tenant's pod, another uid, the host's namespace: not near.
        assert!(place(14, 2000, "0::/kubepods/pod-b/c1", 300)
            .shared_with(&holder, &own)
            .is_none());
        // What the broker shares binds nobody.
        let host = place(20, 0, "0::/system.slice/gpu-broker.service", 100);
        assert!(place(21, 0, "0::/system.slice/gpu-broker.service", 100)
            .shared_with(&host, &own)
            .is_none());
        // uid 0 alone binds nobody, even where the broker runs as another uid.
        let own_user = place(1, 999, "0::/b", 100);
        let root = place(30, 0, "0::/r1", 100);
        assert!(place(31, 0, "0::/r2", 100)
            .shared_with(&root, &own_user)
            .is_none());
        // Unread fields match nothing.
        assert!(Place::nowhere()
            .shared_with(&Place::nowhere(), &own_user)
            .is_none());
        // With nothing excluded (tests), a same cgroup is near.
        assert!(place(40, 0, "0::/t", 100)
            .shared_with(&place(41, 0, "0::/t", 100), &Place::nowhere())
            .is_some());
    }

    /// This process's place reads back; a gone pid has none.
    #[test]
    fn a_live_process_has_a_place_and_a_gone_one_none() {
        let me = read_place(std::process::id()).unwrap();
        assert!(me.start.is_some());
        // SAFETY: getuid cannot fail.
        assert_eq!(me.uid, Some(unsafe { libc::getuid() }));
        assert!(me.pid_ns.is_some());
        assert_eq!(read_place(u32::MAX - 1), None);
    }

    /// A block's record of the processes it reached, with the places given.
    fn reached(of: &[(u32, Option<Arc<Place>>)]) -> crate::pool::Reached {
        let mut r = crate::pool::Reached::default();
        for (pid, place) in of {
            r.add(*pid, place.clone());
        }
        r
    }

    struct Listed(Vec<u32>);
    impl ContextLister for Listed {
        fn processes_on(&self, _: &str) -> Option<Vec<u32>> {
            Some(self.0.clone())
        }
    }

    /// A child of a live recorded holder with a context is found (even in the broker's
    /// own places, which bind nobody else); the broker itself and processes named already
    /// are not; nothing is found near no recorded holder.
    #[test]
    fn a_child_of_a_live_holder_is_found_and_the_broker_never() {
        let (mut child, grandchild) = sh_with_child();
        let me = std::process::id();
        let finder = HolderFinder::new(Arc::new(Listed(vec![me, grandchild])));
        let block = reached(&[(child.id(), None)]);
        let Finding { found, places } = finder.find("GPU-x", &block, &[child.id()]);
        assert_eq!(
            found,
            vec![Found {
                pid: grandchild,
                near: child.id()
            }]
        );
        assert_eq!(places.len(), 2);
        assert!(finder.find("GPU-x", &block, &[grandchild]).found.is_empty());
        assert!(finder.find("GPU-x", &reached(&[]), &[]).found.is_empty());
        // SAFETY: a pid this test started.
        unsafe { libc::kill(grandchild as i32, libc::SIGKILL) };
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A holder that exited before its block was freed: the block kept its place (read
    /// when its session opened), so the process of its cgroup is still found near it,
    /// whatever else the broker saw meanwhile. (Places used to be remembered in one list
    /// of the newest 4,096 processes, which other processes could flush.)
    #[test]
    fn a_block_keeps_the_place_of_a_holder_that_exited() {
        let mut worker = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let mut near = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let finder = HolderFinder::with_own(Arc::new(Listed(vec![near.id()])), Place::nowhere());
        let block = reached(&[(worker.id(), finder.place(worker.id()))]);
        worker.kill().unwrap();
        worker.wait().unwrap();
        let found = finder.find("GPU-x", &block, &[]).found;
        assert_eq!(
            found,
            vec![Found {
                pid: near.id(),
                near: worker.id()
            }],
            "the process of the worker's cgroup is found near the worker as it was"
        );
        near.kill().unwrap();
        near.wait().unwrap();
    }

    /// A process near several recorded holders answers as the closest, whatever their
    /// order: an importer's child is its importer's, not that of the publisher recorded
    /// first in the importer's cgroup (tenants sharing a uid or a cgroup).
    #[test]
    fn the_closest_holder_answers_not_the_first_recorded() {
        let (mut importer, child) = sh_with_child();
        let finder = HolderFinder::with_own(Arc::new(Listed(vec![child])), Place::nowhere());
        // The publisher, gone, recorded first: it ran in the child's cgroup.
        let publisher = u32::MAX - 3;
        let publisher_place = Arc::new(Place {
            pid: publisher,
            start: Some(1),
            uid: None,
            cgroup: read_place(child).unwrap().cgroup,
            pid_ns: None,
        });
        let block = reached(&[(publisher, Some(publisher_place)), (importer.id(), None)]);
        let found = finder.find("GPU-x", &block, &[importer.id()]).found;
        assert_eq!(
            found,
            vec![Found {
                pid: child,
                near: importer.id()
            }]
        );
        // SAFETY: a pid this test started.
        unsafe { libc::kill(child as i32, libc::SIGKILL) };
        importer.kill().unwrap();
        importer.wait().unwrap();
    }

    /// Blocks watched near the same holders share their places: one per process, not a
    /// copy per block.
    #[test]
    fn blocks_watched_near_one_holder_share_its_place() {
        let mut holder = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let finder = HolderFinder::with_own(Arc::new(Listed(vec![])), Place::nowhere());
        let place = finder.place(holder.id()).unwrap();
        let block = reached(&[(holder.id(), Some(place.clone()))]);
        let a = finder.find("GPU-x", &block, &[holder.id()]).places;
        let b = finder.find("GPU-x", &block, &[holder.id()]).places;
        assert_eq!((a.len(), b.len()), (1, 1));
        assert!(Arc::ptr_eq(&a[0], &place) && Arc::ptr_eq(&b[0], &place));
        // A process read again shares the copy handed out while a block holds it.
        assert!(Arc::ptr_eq(&finder.place(holder.id()).unwrap(), &place));
        holder.kill().unwrap();
        holder.wait().unwrap();
    }
}
