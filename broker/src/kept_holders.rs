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
//! A holder's place is read when it is first seen (its session opens, a descriptor goes
//! to it) and remembered, bounded, so that processes near one that exited before its
//! block was freed are still found.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

/// How many processes' places are remembered (the oldest is forgotten first).
const REMEMBERED: usize = 4096;

/// Lists the processes with a context on a device: NVML on a GPU node; tests give their
/// own (the host backend has none).
pub trait ContextLister: Send + Sync {
    /// The pids with a context on the device of UUID `uuid` (`GPU-...`); `None` when it
    /// cannot tell.
    fn processes_on(&self, uuid: &str) -> Option<Vec<u32>>;
}

/// Where a process runs: what tells which other processes it could share memory with
/// unseen. `None` fields were unreadable and match nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Place {
    /// The process whose place it is.
    pub pid: u32,
    /// Start time (`/proc/PID/stat`): tells the process from a later one of its pid.
    pub start: Option<u64>,
    /// Its real uid (`/proc/PID/status`).
    pub uid: Option<u32>,
    /// `/proc/PID/cgroup` as read.
    pub cgroup: Option<String>,
    /// The pid namespace's inode (`/proc/PID/ns/pid`).
    pub pid_ns: Option<u64>,
}

impl Place {
    /// Reads live process `pid`'s place; `None` when it is gone.
    pub fn read(pid: u32) -> Option<Place> {
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

    /// A place that shares nothing: as the broker's own, it excludes no place (tests).
    pub fn nowhere() -> Place {
        Place::default()
    }

    /// The closest place `self` shares with `other` that `own` (the broker's) does not.
    pub fn shared_with(&self, other: &Place, own: &Place) -> Option<Tie> {
        fn same<T: PartialEq>(a: &Option<T>, b: &Option<T>, own: &Option<T>) -> bool {
            a.is_some() && a == b && a != own
        }
        if same(&self.pid_ns, &other.pid_ns, &own.pid_ns) {
            Some(Tie::PidNamespace)
        } else if same(&self.cgroup, &other.cgroup, &own.cgroup) {
            Some(Tie::Cgroup)
        } else if self.uid != Some(0) && same(&self.uid, &other.uid, &own.uid) {
            Some(Tie::Uid)
        } else {
            None
        }
    }
}

/// How a process found is tied to a recorded holder, closest first: where several
/// holders (of several tenants) are near it, the closest answers for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tie {
    /// It descends from the holder, still alive.
    Descendant,
    PidNamespace,
    Cgroup,
    Uid,
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
    places: parking_lot::Mutex<Remembered>,
    watched: parking_lot::Mutex<HashMap<uuid::Uuid, Watched>>,
}

#[derive(Default)]
struct Remembered {
    by_pid: HashMap<u32, Arc<Place>>,
    order: VecDeque<u32>,
}

impl HolderFinder {
    /// A finder that excludes the broker's own places.
    pub fn new(lister: Arc<dyn ContextLister>) -> HolderFinder {
        let me = std::process::id();
        HolderFinder::with_own(lister, Place::read(me).unwrap_or_default())
    }

    /// A finder that excludes the places of `own` (tests: [`Place::nowhere`]).
    pub fn with_own(lister: Arc<dyn ContextLister>, own: Place) -> HolderFinder {
        HolderFinder {
            lister,
            own,
            me: std::process::id(),
            places: Default::default(),
            watched: Default::default(),
        }
    }

    /// Remembers live process `pid`'s place (read from `/proc` unless known for this very
    /// process: a place remembered for an earlier process of the pid is replaced, or the
    /// later one's would be lost once it exits).
    pub fn remember(&self, pid: u32) {
        let known = self.places.lock().by_pid.get(&pid).map(|p| p.start);
        if known.is_some_and(|start| start.is_some() && start == crate::process::start_ticks(pid)) {
            return;
        }
        if let Some(p) = Place::read(pid) {
            self.keep(Arc::new(p));
        }
    }

    fn keep(&self, p: Arc<Place>) {
        let mut r = self.places.lock();
        match r.by_pid.insert(p.pid, p.clone()) {
            None => r.order.push_back(p.pid),
            // Another process of the pid: the newest seen, forgotten last.
            Some(old) if old.start != p.start => {
                r.order.retain(|&q| q != p.pid);
                r.order.push_back(p.pid);
            }
            Some(_) => {}
        }
        while r.order.len() > REMEMBERED {
            if let Some(old) = r.order.pop_front() {
                r.by_pid.remove(&old);
            }
        }
    }

    /// Process `pid`'s places: as read now when it lives, and as remembered when that was
    /// another process of the pid (either may be the one the block reached).
    fn places_of(&self, pid: u32) -> Vec<Arc<Place>> {
        let known = self.places.lock().by_pid.get(&pid).cloned();
        let now = Place::read(pid);
        let mut out = Vec::new();
        match (known, now) {
            // The very process remembered, where it was: its one shared place.
            (Some(k), Some(n)) if *k == n => out.push(k),
            (known, now) => {
                if let Some(k) = known {
                    if now.as_ref().is_none_or(|n| n.start != k.start) {
                        out.push(k);
                    }
                }
                if let Some(n) = now {
                    let n = Arc::new(n);
                    self.keep(n.clone());
                    out.push(n);
                }
            }
        }
        out
    }

    /// Live process `pid`'s place, shared with the one remembered when it is the same
    /// process (a block watched near it costs a pointer, not a copy).
    fn live_place(&self, pid: u32) -> Option<Arc<Place>> {
        self.places_of(pid)
            .pop()
            .filter(|p| p.start == crate::process::start_ticks(pid))
    }

    /// After a free on device `uuid` that did not give the memory back: the processes with
    /// a context there, alive, not in `named` (already charged for) and not the broker,
    /// near one of the `recorded` processes (or descended from a live one), each as the
    /// one it is closest to ([`Tie`]), and the places to look near again
    /// ([`HolderFinder::watch`]).
    pub fn find(&self, uuid: &str, recorded: &[u32], named: &[u32]) -> Finding {
        let mut places: Vec<Arc<Place>> =
            recorded.iter().flat_map(|&p| self.places_of(p)).collect();
        let found = self.on_device_near(uuid, &places, named, &HashSet::new());
        places.extend(found.iter().filter_map(|f| self.live_place(f.pid)));
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
            let Some(place) = Place::read(pid) else {
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
            let more: Vec<Arc<Place>> = found.iter().filter_map(|&p| self.live_place(p)).collect();
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
mod tests {
    use super::*;

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
        let me = Place::read(std::process::id()).unwrap();
        assert!(me.start.is_some());
        // SAFETY: getuid cannot fail.
        assert_eq!(me.uid, Some(unsafe { libc::getuid() }));
        assert!(me.pid_ns.is_some());
        assert_eq!(Place::read(u32::MAX - 1), None);
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
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 60 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
            &mut line,
        )
        .unwrap();
        let grandchild: u32 = line.trim().parse().unwrap();
        let me = std::process::id();
        let finder = HolderFinder::new(Arc::new(Listed(vec![me, grandchild])));
        let Finding { found, places } = finder.find("GPU-x", &[child.id()], &[child.id()]);
        assert_eq!(
            found,
            vec![Found {
                pid: grandchild,
                near: child.id()
            }]
        );
        assert_eq!(places.len(), 2);
        assert!(finder
            .find("GPU-x", &[child.id()], &[grandchild])
            .found
            .is_empty());
        assert!(finder.find("GPU-x", &[], &[]).found.is_empty());
        // SAFETY: a pid this test started.
        unsafe { libc::kill(grandchild as i32, libc::SIGKILL) };
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A pid remembered for an earlier process and now run by a later one that the
    /// broker sees (its session opens) is remembered as the later one: when that one
    /// exits before its block is freed, the processes near it are still found.
    #[test]
    fn a_reused_pid_is_remembered_as_its_newest_process() {
        let mut worker = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let mut near = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let finder = HolderFinder::with_own(Arc::new(Listed(vec![near.id()])), Place::nowhere());
        // An earlier process of the worker's pid, elsewhere, remembered long ago.
        finder.keep(Arc::new(Place {
            pid: worker.id(),
            start: Some(1),
            uid: None,
            cgroup: Some("0::/elsewhere".into()),
            pid_ns: None,
        }));
        finder.remember(worker.id());
        worker.kill().unwrap();
        worker.wait().unwrap();
        let found = finder.find("GPU-x", &[worker.id()], &[]).found;
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
        let mut importer = std::process::Command::new("sh")
            .args(["-c", "sleep 60 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(importer.stdout.as_mut().unwrap()),
            &mut line,
        )
        .unwrap();
        let child: u32 = line.trim().parse().unwrap();
        let finder = HolderFinder::with_own(Arc::new(Listed(vec![child])), Place::nowhere());
        // The publisher, gone, recorded first: it ran in the child's cgroup.
        let publisher = u32::MAX - 3;
        finder.keep(Arc::new(Place {
            pid: publisher,
            start: Some(1),
            uid: None,
            cgroup: Place::read(child).unwrap().cgroup,
            pid_ns: None,
        }));
        let found = finder
            .find("GPU-x", &[publisher, importer.id()], &[importer.id()])
            .found;
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
        finder.remember(holder.id());
        let a = finder.find("GPU-x", &[holder.id()], &[holder.id()]).places;
        let b = finder.find("GPU-x", &[holder.id()], &[holder.id()]).places;
        assert_eq!((a.len(), b.len()), (1, 1));
        assert!(Arc::ptr_eq(&a[0], &b[0]));
        holder.kill().unwrap();
        holder.wait().unwrap();
    }
}
