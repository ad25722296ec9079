//! Where a process runs (its uid, cgroup, pid namespace, start time): what tells which
//! other processes it could hand memory to unseen. The shell reads it from `/proc` when a
//! process is first seen (its session opens); the core keeps it with the records of that
//! process and, once its lease or import ends, with the block it may keep
//! (`pool::Reached`), so it lasts exactly as long as the block can be found kept.

/// A process's place. `None` fields were unreadable and match nothing.
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
