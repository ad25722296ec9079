//! The process group of a reserved program (`gpu-brokerctl run`): the runner starts its
//! program as the leader of a new process group and names that group to the broker
//! (`SetProcessGroup`); when the reservation ends (its session ended, also because the
//! runner was killed, or it was released) the broker stops every process left in the group
//! — SIGTERM, then SIGKILL after the grace — so that no descendant runs on unaccounted.
//!
//! The broker may run as root, so it signals only what the tenant's own process could:
//! the group is accepted only when its leader is a child of the session's peer process,
//! of the peer's uid, and leads its group; at the end only members of the group with that
//! real uid are signalled, each through a pidfd (immune to pid reuse between the scan and
//! the signal). A descendant that leaves the group (`setsid`, `setpgid`) escapes it.
//! The leader's start time is kept too: a group whose number was given to a new leader
//! after the old group died out entirely is another group, and is left alone.

use std::time::{Duration, Instant};

pub use gpu_broker_core::process_group::ProcessGroup;

/// Why a process group was not accepted.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GroupError {
    #[error("process {0} does not exist")]
    NoSuchProcess(u32),
    #[error("process {pgid} is not a child of the session's process {parent}")]
    NotAChild { pgid: u32, parent: u32 },
    #[error("process {0} does not lead its own process group")]
    NotALeader(u32),
    #[error("process {pgid} runs as uid {uid}, not the session's uid {want}")]
    OtherUser { pgid: u32, uid: u32, want: u32 },
    #[error("the session's process is unknown (not a local Unix-socket peer)")]
    UnknownPeer,
}

/// `(ppid, pgrp)` of a process, from `/proc/PID/stat`.
fn parent_and_group(pid: u32) -> Option<(u32, u32)> {
    // "state ppid pgrp session ..." after "pid (comm)".
    let rest = crate::process::stat_fields(pid)?;
    let mut f = rest.split_whitespace();
    let state = f.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
}

/// When a process started (clock ticks since boot), from `/proc/PID/stat`.
fn start_time(pid: u32) -> Option<u64> {
    // After "pid (comm)", field 3 (state) comes first; starttime is field 22.
    crate::process::stat_fields(pid)?
        .split_whitespace()
        .nth(22 - 3)?
        .parse()
        .ok()
}

/// Is `g` still the group that was accepted? Its leader, if alive, is the same process
/// (a live group without its leader keeps its number: the kernel does not reuse it).
fn same_group(g: ProcessGroup) -> bool {
    start_time(g.pgid).is_none_or(|t| t == g.leader_start)
}

/// Real uid of a process, from `/proc/PID/status`.
fn real_uid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Accepts `pgid` as the group of a reservation whose session's process is `parent`
/// (uid `uid`): its leader must be a child of `parent`, of that uid, leading its group.
pub fn verify(
    pgid: u32,
    parent: Option<u32>,
    uid: Option<u32>,
) -> Result<ProcessGroup, GroupError> {
    let (Some(parent), Some(want)) = (parent, uid) else {
        return Err(GroupError::UnknownPeer);
    };
    let (ppid, pgrp) = parent_and_group(pgid).ok_or(GroupError::NoSuchProcess(pgid))?;
    if ppid != parent {
        return Err(GroupError::NotAChild { pgid, parent });
    }
    if pgrp != pgid {
        return Err(GroupError::NotALeader(pgid));
    }
    let uid = real_uid(pgid).ok_or(GroupError::NoSuchProcess(pgid))?;
    if uid != want {
        return Err(GroupError::OtherUser { pgid, uid, want });
    }
    let leader_start = start_time(pgid).ok_or(GroupError::NoSuchProcess(pgid))?;
    Ok(ProcessGroup {
        pgid,
        uid: want,
        leader_start,
    })
}

/// Live members of the group with its uid (never the broker itself); none when the
/// number now belongs to another group.
pub fn members(g: ProcessGroup) -> Vec<u32> {
    if !same_group(g) {
        return Vec::new();
    }
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|&pid| parent_and_group(pid).is_some_and(|(_, pgrp)| pgrp == g.pgid))
        .filter(|&pid| real_uid(pid) == Some(g.uid))
        .collect()
}

/// Sends `sig` to `pid` through a pidfd opened now, after checking (with the pidfd
/// open, so the pid cannot be reused meanwhile) that it is still in the group.
fn signal_member(pid: u32, g: ProcessGroup, sig: i32) {
    // SAFETY: plain syscalls; the descriptor is owned and closed below.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return;
    }
    let fd = fd as libc::c_int;
    if parent_and_group(pid).is_some_and(|(_, pgrp)| pgrp == g.pgid) && real_uid(pid) == Some(g.uid)
    {
        // SAFETY: pidfd_send_signal on the pidfd opened above.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd,
                sig,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            );
        }
    }
    // SAFETY: closing the descriptor opened above.
    unsafe { libc::close(fd) };
}

/// [`members`], read off the async threads (`/proc` of the whole node).
async fn members_now(g: ProcessGroup) -> Vec<u32> {
    tokio::task::spawn_blocking(move || members(g))
        .await
        .unwrap_or_default()
}

/// Rounds of SIGKILL at most after the grace: each round also reaches processes forked
/// since the previous scan.
const KILL_ROUNDS: usize = 50;

/// Stops the group: SIGTERM to each member, then SIGKILL to those left after `grace`
/// (again until none is left, so processes forked meanwhile go too). Returns how many
/// were signalled at first.
pub async fn stop(g: ProcessGroup, grace: Duration) -> usize {
    let first = members_now(g).await;
    if first.is_empty() {
        return 0;
    }
    tracing::info!(
        pgid = g.pgid,
        processes = first.len(),
        "stopping the process group of an ended reservation"
    );
    for &pid in &first {
        signal_member(pid, g, libc::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    let mut left = members_now(g).await;
    while !left.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        left = members_now(g).await;
    }
    if left.is_empty() {
        return first.len();
    }
    tracing::warn!(
        pgid = g.pgid,
        processes = left.len(),
        grace_ms = grace.as_millis() as u64,
        "process group still running after the grace; killing it"
    );
    for _ in 0..KILL_ROUNDS {
        for &pid in &left {
            signal_member(pid, g, libc::SIGKILL);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        left = members_now(g).await;
        if left.is_empty() {
            break;
        }
    }
    if !left.is_empty() {
        tracing::warn!(
            pgid = g.pgid,
            processes = left.len(),
            "process group outlived the kill rounds"
        );
    }
    first.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};

    fn me() -> (u32, u32) {
        // SAFETY: plain queries of this process.
        (std::process::id(), unsafe { libc::getuid() })
    }

    /// `sh -c script` as the leader of a new process group.
    fn leader(script: &str) -> std::process::Child {
        Command::new("sh")
            .args(["-c", script])
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    }

    fn gone_within(pids: &[u32], within: Duration) -> bool {
        let end = Instant::now() + within;
        while Instant::now() < end {
            if pids.iter().all(|&p| parent_and_group(p).is_none()) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    #[test]
    fn only_a_child_leading_its_own_group_of_the_peers_uid_is_accepted() {
        let (pid, uid) = me();
        let mut c = leader("sleep 30");
        let cpid = c.id();
        let g = verify(cpid, Some(pid), Some(uid)).unwrap();
        assert_eq!((g.pgid, g.uid), (cpid, uid));
        assert_eq!(Some(g.leader_start), start_time(cpid));
        assert_eq!(
            verify(cpid, Some(1), Some(uid)),
            Err(GroupError::NotAChild {
                pgid: cpid,
                parent: 1
            })
        );
        assert!(matches!(
            verify(cpid, Some(pid), Some(uid + 1)),
            Err(GroupError::OtherUser { .. })
        ));
        assert_eq!(verify(cpid, None, Some(uid)), Err(GroupError::UnknownPeer));
        // A child in this process's group is not a group leader.
        let mut same = Command::new("sleep").arg("30").spawn().unwrap();
        assert_eq!(
            verify(same.id(), Some(pid), Some(uid)),
            Err(GroupError::NotALeader(same.id()))
        );
        assert_eq!(
            verify(u32::MAX - 1, Some(pid), Some(uid)),
            Err(GroupError::NoSuchProcess(u32::MAX - 1))
        );
        for ch in [&mut c, &mut same] {
            let _ = ch.kill();
            let _ = ch.wait();
        }
    }

    #[tokio::test]
    async fn a_group_number_now_led_by_another_process_is_left_alone() {
        let (pid, uid) = me();
        let mut c = leader("sleep 30");
        let g = verify(c.id(), Some(pid), Some(uid)).unwrap();
        // The same number as if a process started later had been given it.
        let later = ProcessGroup {
            leader_start: g.leader_start + 1,
            ..g
        };
        assert!(members(later).is_empty());
        assert_eq!(stop(later, Duration::from_millis(10)).await, 0);
        assert!(
            parent_and_group(c.id()).is_some(),
            "the other group still runs"
        );
        assert!(
            members(g).contains(&c.id()),
            "the accepted group is still found"
        );
        assert!(stop(g, Duration::from_millis(10)).await >= 1);
        let _ = c.wait();
    }

    #[tokio::test]
    async fn stop_ends_the_leader_and_its_descendants_and_kills_those_that_ignore_term() {
        let (pid, uid) = me();
        // A grandchild that ignores SIGTERM (the ignored disposition survives exec).
        let mut c = leader("(trap '' TERM; exec sleep 30) & sleep 30 & wait");
        let g = verify(c.id(), Some(pid), Some(uid)).unwrap();
        let mut all = Vec::new();
        for _ in 0..100 {
            all = members(g);
            if all.len() >= 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(all.len() >= 3, "leader and two children: {all:?}");
        assert!(!all.contains(&pid), "never the caller itself");
        let signalled = stop(g, Duration::from_millis(300)).await;
        assert!(signalled >= 3);
        let _ = c.wait();
        assert!(
            gone_within(&all, Duration::from_secs(2)),
            "left: {:?}",
            members(g)
        );
        assert!(members(g).is_empty());
        assert_eq!(stop(g, Duration::from_millis(10)).await, 0, "nothing left");
    }
}
