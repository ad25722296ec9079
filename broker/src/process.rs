//! Process liveness: whether a pid still runs (`kill(pid, 0)` and `/proc` state; a zombie
//! counts as gone), a process held by its pidfd ([`Pinned`]: whether that very process
//! still runs, and when it exits) and a future that resolves when a pid exits (pidfd,
//! falling back to polling). Used for session peers (their memory may be reused once they are gone) and
//! for block files left by a dead broker. A check that cannot decide (no descriptor left
//! to read `/proc`, pid 0 from a peer in another PID namespace) answers
//! [`Liveness::Unknown`], and nothing treats unknown as gone. Also the one reader of
//! `/proc/PID/stat` (its fields, a process's parent and lineage) for the rest of the broker.

use std::time::Duration;

/// What the broker can tell about a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// It runs (or exists and its state could not be read).
    Alive,
    /// It exited (a zombie counts: its memory mappings are already released).
    Gone,
    /// The broker cannot tell (pid 0, or every check failed for another reason).
    Unknown,
}

/// What the broker can tell about process `pid`. Needs no file descriptor to say
/// "exists" (`kill(pid, 0)`); reads `/proc/<pid>/stat` only to spot a zombie.
pub fn liveness(pid: u32) -> Liveness {
    // pid 0 is what SO_PEERCRED reports for a peer outside our PID namespace, and
    // `kill(0, 0)` would address our own process group.
    if pid == 0 {
        return Liveness::Unknown;
    }
    // Beyond pid_t: no process can have it.
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return Liveness::Gone;
    };
    // SAFETY: signal 0 only checks for existence and permission; it delivers nothing.
    let rc = unsafe { libc::kill(p, 0) };
    let exists = if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    };
    classify(exists, std::fs::read_to_string(format!("/proc/{pid}/stat")))
}

/// The decision, from what `kill(pid, 0)` and reading `/proc/<pid>/stat` returned.
fn classify(exists: std::io::Result<()>, stat: std::io::Result<String>) -> Liveness {
    match exists {
        Ok(()) => {}
        // EPERM: it exists, owned by someone we may not signal.
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => {}
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Liveness::Gone,
        Err(_) => return Liveness::Unknown,
    }
    match stat {
        Ok(stat) => {
            // Format: pid (comm) state ... ; comm may hold spaces and parentheses.
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().next());
            if matches!(state, Some("Z") | Some("X") | Some("x")) {
                Liveness::Gone
            } else {
                Liveness::Alive
            }
        }
        // Exited between the two checks.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Liveness::Gone,
        // It exists; its state is unreadable (EMFILE, say): it may still map memory.
        Err(_) => Liveness::Alive,
    }
}

/// Is process `pid` certainly gone? Unknown is not gone.
pub fn process_gone(pid: u32) -> bool {
    liveness(pid) == Liveness::Gone
}

/// Is process `pid` still running (or possibly running: unknown counts as alive)?
pub fn process_alive(pid: u32) -> bool {
    !process_gone(pid)
}

/// Resolves when process `pid` is certainly gone. Uses a pidfd (no polling, immune to
/// pid reuse after the watch starts) and falls back to polling every 200 ms; for a pid
/// that can never be decided (0) it never resolves: callers race it against their own
/// end (see [`wait_for_exit_or`]).
pub async fn wait_for_exit(pid: u32) {
    if pid == 0 {
        std::future::pending::<()>().await;
    }
    if let Some(fd) = pidfd_open(pid) {
        // SAFETY: `fd` is an OwnedFd moved into the AsyncFd, so it stays open exactly as
        // long as the registration.
        let registered = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
        };
        if let Ok(afd) = registered {
            let _ = afd.readable().await;
            return;
        }
    }
    while !process_gone(pid) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits for `pid` to exit unless `stop` is cancelled first; returns whether it exited.
/// The pidfd (if any) is closed when this returns, so a watcher tied to something that
/// ends (a session) holds no descriptor past it.
pub async fn wait_for_exit_or(pid: u32, stop: tokio_util::sync::CancellationToken) -> bool {
    tokio::select! {
        _ = wait_for_exit(pid) => true,
        _ = stop.cancelled() => false,
    }
}

/// A process held by its pidfd: whether that very process still runs is one `poll`, with
/// no `/proc` read, and stays true of it however its pid is given out after it exits.
pub struct Pinned {
    fd: std::os::fd::OwnedFd,
}

impl Pinned {
    /// The process that has `pid` now (`None`: no such process, or no pidfds).
    pub fn open(pid: u32) -> Option<Pinned> {
        pidfd_open(pid).map(|fd| Pinned { fd })
    }

    /// Has it not exited yet? (A pidfd turns readable when its process exits.)
    pub fn running(&self) -> bool {
        let mut fds = [rustix::event::PollFd::new(
            &self.fd,
            rustix::event::PollFlags::IN,
        )];
        let now = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // A poll that fails says nothing: unknown is not gone.
        !matches!(rustix::event::poll(&mut fds, Some(&now)), Ok(n) if n > 0)
    }

    /// Resolves when it exits, unless `stop` is cancelled first; returns whether it exited.
    pub async fn exit_or(
        pinned: std::sync::Arc<Pinned>,
        stop: tokio_util::sync::CancellationToken,
    ) -> bool {
        let again = pinned.clone();
        // SAFETY: the registration holds a share of `pinned`, whose descriptor stays open
        // as long as any share does, so as long as the registration.
        let registered = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(pinned, tokio::io::Interest::READABLE)
        };
        let Ok(fd) = registered else {
            // Not one epoll can wait on: its pidfd asked every 200 ms.
            let exited = async {
                while again.running() {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            };
            return tokio::select! {
                _ = exited => true,
                _ = stop.cancelled() => false,
            };
        };
        tokio::select! {
            _ = fd.readable() => true,
            _ = stop.cancelled() => false,
        }
    }
}

impl std::os::fd::AsRawFd for Pinned {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }
}

fn pidfd_open(pid: u32) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: plain syscall; a non-negative result is a new fd we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fd is a fresh, valid descriptor owned by nobody else.
    Some(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// The fields of `/proc/PID/stat` after "pid (comm)", state first (comm may hold spaces
/// and parentheses); None if the process is gone or unreadable.
pub fn stat_fields(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(stat[stat.rfind(')')? + 1..].to_string())
}

/// When a live process started (clock ticks since boot, `/proc/PID/stat`'s field 22):
/// with its pid, what tells it from a later process given the same pid.
pub fn start_ticks(pid: u32) -> Option<u64> {
    stat_fields(pid)?.split_whitespace().nth(19)?.parse().ok()
}

/// The parent of a live process (None if gone or unknown).
pub fn parent_of(pid: u32) -> Option<u32> {
    stat_fields(pid)?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
        .filter(|&p: &u32| p != 0)
}

/// `pid`, its parent, grandparent, ..., at most 64 of them.
pub fn lineage(pid: u32) -> impl Iterator<Item = u32> {
    std::iter::successors(Some(pid), |&p| if p <= 1 { None } else { parent_of(p) }).take(64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stat_reader_finds_parent_and_lineage_and_nothing_for_a_gone_pid() {
        let me = std::process::id();
        let parent = parent_of(me).expect("the test has a parent");
        // SAFETY: getppid has no preconditions.
        assert_eq!(parent, unsafe { libc::getppid() } as u32);
        let up: Vec<u32> = lineage(me).collect();
        assert_eq!(&up[..2], &[me, parent]);
        assert!(up.len() <= 64);
        assert!(stat_fields(me)
            .unwrap()
            .trim_start()
            .starts_with(['R', 'S', 'D']));
        assert_eq!(stat_fields(u32::MAX - 1), None);
        assert_eq!(parent_of(u32::MAX - 1), None);
    }

    #[test]
    fn own_process_is_alive_and_bogus_pid_is_not() {
        assert!(process_alive(std::process::id()));
        assert_eq!(liveness(std::process::id()), Liveness::Alive);
        assert!(process_gone(u32::MAX - 1));
    }

    #[test]
    fn pid_zero_is_unknown_not_gone() {
        assert_eq!(liveness(0), Liveness::Unknown);
        assert!(!process_gone(0));
    }

    #[test]
    fn an_undecidable_check_is_never_gone() {
        fn emfile<T>() -> std::io::Result<T> {
            Err(std::io::Error::from_raw_os_error(libc::EMFILE))
        }
        // The process exists but /proc cannot be read (no descriptor left): alive.
        assert_eq!(classify(Ok(()), emfile()), Liveness::Alive);
        // Existence itself unknown (an odd errno): unknown.
        assert_eq!(classify(emfile(), emfile()), Liveness::Unknown);
        // Exists, owned by another user: alive.
        let eperm = Err(std::io::Error::from_raw_os_error(libc::EPERM));
        assert_eq!(classify(eperm, Ok("1 (x) S 0".into())), Liveness::Alive);
        // Gone for sure.
        let esrch = Err(std::io::Error::from_raw_os_error(libc::ESRCH));
        assert_eq!(classify(esrch, emfile()), Liveness::Gone);
        assert_eq!(classify(Ok(()), Ok("7 (a) b) Z 1".into())), Liveness::Gone);
    }

    #[tokio::test]
    async fn wait_for_exit_sees_a_child_exit() {
        let mut child = std::process::Command::new("sleep")
            .arg("0.2")
            .spawn()
            .unwrap();
        let pid = child.id();
        let waiter = tokio::spawn(wait_for_exit(pid));
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("exit seen within 5 s")
            .unwrap();
        let _ = child.wait();
        assert!(!process_alive(pid));
    }

    #[tokio::test]
    async fn a_cancelled_watch_closes_its_pidfd() {
        let fds = || std::fs::read_dir("/proc/self/fd").unwrap().count();
        let before = fds();
        let mut tasks = Vec::new();
        let mut stops = Vec::new();
        for _ in 0..20 {
            let stop = tokio_util::sync::CancellationToken::new();
            stops.push(stop.clone());
            tasks.push(tokio::spawn(wait_for_exit_or(std::process::id(), stop)));
        }
        tokio::task::yield_now().await;
        for s in &stops {
            s.cancel();
        }
        for t in tasks {
            assert!(!t.await.unwrap(), "our own process did not exit");
        }
        assert!(
            fds() < before + 5,
            "pidfds left open: {} -> {}",
            before,
            fds()
        );
    }
}
