//! The ticket connections this process keeps open between leases. The broker serves ticket
//! after ticket on a connection that was just handed a descriptor, so a lease's ticket
//! costs one round trip instead of a connect, an accept and a close; it still checks who
//! wrote each ticket (uid and pid, from the kernel) as on a fresh connection.
//!
//! A connection is used by one fetch at a time (taken from here, given back after its
//! descriptor arrived), so concurrent fetches never share one. Connections are kept only
//! for the process that opened them: a forked child never writes on, or reads the replies
//! of, its parent's connections, nor waits on their lock (which a parent thread may have
//! held at the fork): it opens its own. One idle longer
//! than [`MAX_IDLE_AGE`] is closed rather than used (the broker closes its end after an
//! idle time of its own). A kept connection the broker closed (at its connection limit,
//! or an older broker that serves one ticket a connection) costs next to nothing: the
//! write fails and the read ends at once, and the ticket goes over a fresh connection.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::time::{Duration, Instant};

/// Most idle connections kept per ticket socket.
const MAX_IDLE: usize = 64;
/// An idle connection older than this is closed, not used: well inside the broker's idle
/// time, so a kept connection is rarely found closed.
pub const MAX_IDLE_AGE: Duration = Duration::from_millis(500);

struct Idle {
    conn: UnixStream,
    since: Instant,
}

#[derive(Default)]
struct Socket {
    idle: Vec<Idle>,
}

/// The kept connections and the process they belong to.
struct Kept {
    owner: u32,
    sockets: Mutex<HashMap<PathBuf, Socket>>,
}

/// This process's [`Kept`]. A forked child finds its parent's here, owned by another pid:
/// it closes the parent's connections where it can take their lock (one held by a parent
/// thread, which does not exist in the child, would never be unlocked: then they stay open
/// until an exec closes them) and puts a fresh one of its own in its place. The parent's
/// `Kept` itself is leaked in the child, never used.
static KEPT: AtomicPtr<Kept> = AtomicPtr::new(std::ptr::null_mut());

/// This process's kept connections (made on first use, and again after a fork).
fn mine() -> &'static Kept {
    let me = std::process::id();
    loop {
        let cur = KEPT.load(Ordering::Acquire);
        // SAFETY: a published `Kept` is never freed (see `KEPT`).
        let found = unsafe { cur.as_ref() };
        if let Some(k) = found.filter(|k| k.owner == me) {
            return k;
        }
        if let Some(mut parents) = found.and_then(|k| k.sockets.try_lock()) {
            parents.clear();
        }
        let fresh = Box::into_raw(Box::new(Kept {
            owner: me,
            sockets: Mutex::default(),
        }));
        match KEPT.compare_exchange(cur, fresh, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: just published, never freed from now on.
            Ok(_) => return unsafe { &*fresh },
            // SAFETY: `fresh` was never published: still ours alone.
            Err(_) => drop(unsafe { Box::from_raw(fresh) }),
        }
    }
}

/// Runs `f` on this process's sockets, under their lock (never a parent's: see `KEPT`).
fn with<R>(f: impl FnOnce(&mut HashMap<PathBuf, Socket>) -> R) -> R {
    f(&mut mine().sockets.lock())
}

/// An idle connection to `socket`, if one young enough is kept.
pub fn take(socket: &Path) -> Option<UnixStream> {
    let now = Instant::now();
    with(|sockets| {
        let s = sockets.get_mut(socket)?;
        while let Some(i) = s.idle.pop() {
            if now.duration_since(i.since) < MAX_IDLE_AGE {
                return Some(i.conn);
            }
            // The rest are older still (given back in order).
            s.idle.clear();
        }
        None
    })
}

/// Keeps `conn` (just handed a descriptor) for the next ticket to `socket`.
pub fn give_back(socket: &Path, conn: UnixStream) {
    let now = Instant::now();
    with(|sockets| {
        let s = sockets.entry(socket.to_path_buf()).or_default();
        if s.idle.len() >= MAX_IDLE {
            return;
        }
        s.idle.push(Idle { conn, since: now });
    })
}

/// The broker closed a kept connection to `socket` before looking at a ticket: the
/// others kept with it are likely closed too.
pub fn closed_unused(socket: &Path) {
    with(|sockets| {
        if let Some(s) = sockets.get_mut(socket) {
            s.idle.clear();
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_connection_is_taken_once_and_old_ones_are_not_used() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        let (a, _b) = UnixStream::pair().unwrap();
        give_back(&path, a);
        assert!(take(&path).is_some());
        assert!(take(&path).is_none(), "one fetch at a time per connection");
        let (c, _d) = UnixStream::pair().unwrap();
        give_back(&path, c);
        std::thread::sleep(MAX_IDLE_AGE);
        assert!(
            take(&path).is_none(),
            "idle too long: the broker may have let it go"
        );
    }

    /// A forked child never uses its parent's kept connection: it would write its tickets
    /// on it, and could read the replies meant for the parent.
    #[test]
    fn a_forked_child_does_not_use_its_parents_connections() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.sock");
        let (a, _b) = UnixStream::pair().unwrap();
        give_back(&path, a);
        // SAFETY: the child only looks at the kept connections and exits.
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            let got = take(&path).is_some();
            // SAFETY: leaving the child at once.
            unsafe { libc::_exit(i32::from(got)) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(child, &mut status, 0) };
        assert!(libc::WIFEXITED(status));
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "the child took its parent's connection"
        );
        let mine = take(&path).expect("the parent still has it");
        assert!(mine.as_raw_fd() >= 0);
    }

    /// A child forked while another thread of its parent held the kept connections'
    /// lock (that thread does not exist in the child, so nobody would ever unlock it)
    /// still fetches: it never waits on its parent's lock.
    #[test]
    fn a_child_forked_while_the_lock_is_held_does_not_wait_on_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sock");
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            with(|_| {
                held_tx.send(()).unwrap();
                let _ = done_rx.recv_timeout(std::time::Duration::from_secs(10));
            })
        });
        held_rx.recv().unwrap();
        // SAFETY: the child only looks at the kept connections and exits.
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            let (a, _b) = UnixStream::pair().unwrap();
            give_back(&path, a);
            let got = take(&path).is_some();
            // SAFETY: leaving the child at once.
            unsafe { libc::_exit(if got { 0 } else { 2 }) };
        }
        let mut status = 0;
        let start = Instant::now();
        let exited = loop {
            // SAFETY: waiting for our own child, without blocking.
            if unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) } == child {
                break true;
            }
            if start.elapsed() > Duration::from_secs(5) {
                // SAFETY: killing and reaping our own child.
                unsafe {
                    libc::kill(child, libc::SIGKILL);
                    libc::waitpid(child, &mut status, 0);
                }
                break false;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        done_tx.send(()).unwrap();
        holder.join().unwrap();
        assert!(
            exited,
            "the child hung on the lock its parent's thread held"
        );
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    }
}
