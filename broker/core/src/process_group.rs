//! A reservation's process group as the broker accepted it: the numbers it is known by.
//! Checking a group and stopping it (`/proc`, pidfds, signals) is the daemon's
//! (`gpu_broker::process_group`).

/// A reservation's process group, as accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessGroup {
    pub pgid: u32,
    /// Real uid of the processes that may be signalled.
    pub uid: u32,
    /// The leader's start time (clock ticks since boot): the kernel hands the number out
    /// again only once the whole group is gone, and then to a process started later.
    pub leader_start: u64,
}
