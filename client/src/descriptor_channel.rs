//! This process's descriptor channel: a connection to the broker's ticket socket on which
//! the broker sends the descriptor of each lease it grants this process, with the grant
//! (asked with `AcquireLeaseRequest.push_descriptor`, answered `FdHandle.pushed`, no
//! ticket), so a lease costs no ticket round trip. The broker sends it before its reply, so
//! the descriptor is already here when the reply is: taking it is a read that never waits.
//!
//! Opened after a descriptor came with a ticket (the reply names the socket): the
//! connection's first bytes are `CHANNEL_HELLO`, answered `CHANNEL_OPEN_REPLY`; an older
//! broker closes it, and is not asked again for [`REFUSED_FOR`]; a busy one (at a limit)
//! for [`BUSY_FOR`]. The broker closes an
//! idle channel; that is seen at the next read, and the next ticket opens another.
//!
//! Descriptors come in order, possibly for other leases of this process than the one
//! looked for (grants of other threads): each is kept here by lease id until its lease
//! takes it; one not taken within [`UNCLAIMED_FOR`] (its acquire was abandoned) is closed
//! by the next read of the channel after that.
//! Like kept ticket connections (`ticket_channel.rs`), a channel belongs to the process
//! that opened it: a forked child never reads its parent's (the descriptors on it are the
//! parent's), nor waits on its lock; it opens its own.

use gpu_broker_proto::ticket::{
    BUSY_REPLY, CHANNEL_HELLO, CHANNEL_OPEN_REPLY, PUSHED_FD, PUSHED_LEN,
};
use parking_lot::Mutex;
use rustix::net::RecvFlags;
use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::time::{Duration, Instant};

/// A broker that refused a channel (an older one) is asked again after this long.
pub const REFUSED_FOR: Duration = Duration::from_secs(60);
/// A broker that answered "busy" (at a connection limit, or every channel slot of this
/// uid taken) is asked again after this long: soon, but not at every lease, which would
/// pay a connect each while the slots stay taken.
pub const BUSY_FOR: Duration = Duration::from_secs(1);
/// A descriptor no lease took within this long is closed.
pub const UNCLAIMED_FOR: Duration = Duration::from_secs(10);
/// How long opening a channel may wait for the broker's answer.
const OPEN_TIMEOUT: Duration = Duration::from_secs(2);

/// A lease id's 16 bytes.
pub type LeaseKey = [u8; 16];

/// One ticket socket's channel and what came on it.
#[derive(Default)]
struct Channel {
    conn: Option<UnixStream>,
    /// Descriptors read, by lease id, with when they were read.
    waiting: HashMap<LeaseKey, (OwnedFd, Instant)>,
    /// A fetch is opening one.
    opening: bool,
    /// The broker refused one: not asked again before then.
    refused_until: Option<Instant>,
}

/// The channels and the process they belong to.
struct Channels {
    owner: u32,
    /// Whether any channel is open (read without the lock on every acquire).
    any_open: AtomicBool,
    sockets: Mutex<HashMap<PathBuf, Channel>>,
}

/// This process's [`Channels`] (as `ticket_channel::KEPT`: a forked child finds its
/// parent's, owned by another pid, closes them where it can take their lock, and puts
/// its own in their place; the parent's is leaked in the child, never used).
static CHANNELS: AtomicPtr<Channels> = AtomicPtr::new(std::ptr::null_mut());

fn mine() -> &'static Channels {
    let me = std::process::id();
    loop {
        let cur = CHANNELS.load(Ordering::Acquire);
        // SAFETY: a published `Channels` is never freed (see `CHANNELS`).
        let found = unsafe { cur.as_ref() };
        if let Some(c) = found.filter(|c| c.owner == me) {
            return c;
        }
        if let Some(mut parents) = found.and_then(|c| c.sockets.try_lock()) {
            parents.clear();
        }
        let fresh = Box::into_raw(Box::new(Channels {
            owner: me,
            any_open: AtomicBool::new(false),
            sockets: Mutex::default(),
        }));
        match CHANNELS.compare_exchange(cur, fresh, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: just published, never freed from now on.
            Ok(_) => return unsafe { &*fresh },
            // SAFETY: `fresh` was never published: still ours alone.
            Err(_) => drop(unsafe { Box::from_raw(fresh) }),
        }
    }
}

/// Should an acquire ask for its descriptor on a channel? (One is open, to some broker:
/// a broker without this process's channel mints a ticket as before.)
pub fn wanted() -> bool {
    mine().any_open.load(Ordering::Relaxed)
}

/// The descriptor the broker sent for lease `lease` on the channel of one of `places`
/// (reading what came on them), if it came.
pub fn take(places: &[PathBuf], lease: &LeaseKey) -> Option<OwnedFd> {
    let chans = mine();
    let mut sockets = chans.sockets.lock();
    let mut found = None;
    for place in places {
        let Some(ch) = sockets.get_mut(place) else {
            continue;
        };
        found = ch.waiting.remove(lease).map(|(fd, _)| fd);
        found = found.or_else(|| ch.read_until(Some(lease)));
        if found.is_some() {
            break;
        }
    }
    chans.note_open(&sockets);
    found
}

/// Opens a channel to the first of `places` that answers, unless one is open (read to
/// see that it still is), being opened, or was refused lately. Errors are not the
/// caller's: without a channel, descriptors come with tickets.
pub async fn ensure_open(places: &[PathBuf]) {
    let chans = mine();
    let Some(place) = places.first() else { return };
    {
        let mut sockets = chans.sockets.lock();
        let ch = sockets.entry(place.clone()).or_default();
        ch.read_all();
        let now = Instant::now();
        let refused = ch.refused_until.is_some_and(|t| now < t);
        if ch.conn.is_some() || ch.opening || refused {
            chans.note_open(&sockets);
            return;
        }
        ch.opening = true;
    }
    let opened = tokio::time::timeout(OPEN_TIMEOUT, open(places)).await;
    let mut sockets = chans.sockets.lock();
    let ch = sockets.entry(place.clone()).or_default();
    ch.opening = false;
    match opened {
        Ok(Ok(Some(conn))) => ch.conn = Some(conn),
        // Refused (an older broker) or not answered: tickets, and not again for a while.
        Ok(Ok(None)) | Err(_) => ch.refused_until = Some(Instant::now() + REFUSED_FOR),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {
            ch.refused_until = Some(Instant::now() + BUSY_FOR)
        }
        // Not reached (the socket moved): the next ticket tries again.
        Ok(Err(_)) => {}
    }
    chans.note_open(&sockets);
}

/// Connects, asks for a channel and reads the answer: the connection when the broker
/// made it this process's channel, `None` when it refused.
async fn open(places: &[PathBuf]) -> std::io::Result<Option<UnixStream>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut last = None;
    for p in places {
        let mut s = match tokio::net::UnixStream::connect(p).await {
            Ok(s) => s,
            Err(e) => {
                last = Some(e);
                continue;
            }
        };
        s.write_all(&CHANNEL_HELLO).await?;
        let mut b = [0u8; 1];
        let n = s.read(&mut b).await?;
        if n == 1 && b[0] == CHANNEL_OPEN_REPLY {
            let conn = s.into_std()?;
            conn.set_nonblocking(true)?;
            return Ok(Some(conn));
        }
        // Busy (at a limit) is not a refusal: asked again after [`BUSY_FOR`].
        if n == 1 && b[0] == BUSY_REPLY {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        return Ok(None);
    }
    Err(last.unwrap_or_else(|| std::io::ErrorKind::NotFound.into()))
}

impl Channels {
    /// Keeps [`wanted`]'s answer in step with the channels.
    fn note_open(&self, sockets: &HashMap<PathBuf, Channel>) {
        let open = sockets.values().any(|c| c.conn.is_some());
        self.any_open.store(open, Ordering::Relaxed);
    }
}

impl Channel {
    /// Reads every descriptor waiting on the connection (never waits); see
    /// [`Channel::read_until`].
    fn read_all(&mut self) {
        self.read_until(None);
    }

    /// Reads the descriptors waiting on the connection (never waits) until `lease`'s (if
    /// one is named), which it returns (the rest stay for a later read: one system call when the first is
    /// it); keeps the others for their leases and closes those no lease took in time. The
    /// connection is dropped when the broker closed it or sent something else than a
    /// descriptor message.
    fn read_until(&mut self, lease: Option<&LeaseKey>) -> Option<OwnedFd> {
        let mut found = None;
        if let Some(conn) = &self.conn {
            loop {
                match recv_pushed(conn.as_fd()) {
                    Ok(Some((key, fd))) if Some(&key) == lease => {
                        found = Some(fd);
                        break;
                    }
                    Ok(Some((key, fd))) => {
                        self.waiting.insert(key, (fd, Instant::now()));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Ok(None) | Err(_) => {
                        self.conn = None;
                        break;
                    }
                }
            }
        }
        if !self.waiting.is_empty() {
            let now = Instant::now();
            self.waiting
                .retain(|_, (_, at)| now.duration_since(*at) < UNCLAIMED_FOR);
        }
        found
    }
}

/// One descriptor message off a channel, without waiting: `Ok(None)` when the broker
/// closed it or sent something else (any descriptors that came are closed);
/// `WouldBlock` when nothing waits.
fn recv_pushed(sock: BorrowedFd<'_>) -> std::io::Result<Option<(LeaseKey, OwnedFd)>> {
    let mut data = [0u8; PUSHED_LEN];
    let (n, mut fds) = match crate::fd::recv_fds(sock, &mut data, RecvFlags::DONTWAIT) {
        Ok(got) => got,
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => return Ok(None),
        Err(e) => return Err(e),
    };
    if n != PUSHED_LEN || data[0] != PUSHED_FD || fds.len() != 1 {
        return Ok(None);
    }
    let mut key = [0u8; 16];
    key.copy_from_slice(&data[1..]);
    Ok(fds.pop().map(|fd| (key, fd)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn push(sock: &UnixStream, key: &LeaseKey) {
        let mut msg = [0u8; PUSHED_LEN];
        msg[0] = PUSHED_FD;
        msg[1..].copy_from_slice(key);
        let null = std::fs::File::open("/dev/null").unwrap();
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let fds = [std::os::fd::AsFd::as_fd(&null)];
        assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
        let iov = [std::io::IoSlice::new(&msg)];
        let sent = rustix::net::sendmsg(sock, &iov, &mut control, SendFlags::empty());
        assert_eq!(sent.unwrap(), PUSHED_LEN);
    }

    fn install(place: &Path, conn: UnixStream) {
        conn.set_nonblocking(true).unwrap();
        let chans = mine();
        let mut sockets = chans.sockets.lock();
        sockets.entry(place.to_path_buf()).or_default().conn = Some(conn);
        chans.note_open(&sockets);
    }

    /// Descriptors of other leases that came first are kept for their leases; each is
    /// taken once; a channel the broker closed is seen as closed.
    #[test]
    fn each_lease_takes_its_own_descriptor_once() {
        let place = PathBuf::from("/nonexistent/each-lease.sock");
        let (mine_end, broker) = UnixStream::pair().unwrap();
        install(&place, mine_end);
        assert!(wanted());
        push(&broker, &[1; 16]);
        push(&broker, &[2; 16]);
        let places = [place.clone()];
        assert!(take(&places, &[2; 16]).is_some());
        assert!(take(&places, &[2; 16]).is_none(), "taken twice");
        assert!(take(&places, &[1; 16]).is_some(), "kept for its lease");
        drop(broker);
        assert!(take(&places, &[3; 16]).is_none());
        let open = mine().sockets.lock()[&place].conn.is_some();
        assert!(!open, "the broker's close was not seen");
    }

    /// A broker that does not know channels (it closes the connection on the request, as
    /// on an unknown ticket) is not asked again for a while: leases keep their tickets.
    #[test]
    fn a_broker_that_refuses_a_channel_is_not_asked_again_soon() {
        use std::io::Read;
        let dir = tempfile::tempdir().unwrap();
        let place = dir.path().join("old.sock");
        let listener = std::os::unix::net::UnixListener::bind(&place).unwrap();
        let asked = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut b = [0u8; 32];
            s.read_exact(&mut b).unwrap();
            listener.set_nonblocking(true).unwrap();
            std::thread::sleep(Duration::from_millis(200));
            (b, listener.accept().is_ok())
        });
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(ensure_open(std::slice::from_ref(&place)));
        rt.block_on(ensure_open(std::slice::from_ref(&place)));
        let (hello, again) = asked.join().unwrap();
        assert_eq!(hello, CHANNEL_HELLO);
        assert!(!again, "asked again at once");
        let sockets = mine().sockets.lock();
        let ch = &sockets[&place];
        assert!(ch.conn.is_none() && ch.refused_until.is_some());
    }

    /// A broker at a limit answers "busy": not a refusal, so a lease asks for a channel
    /// again after [`BUSY_FOR`] (an older broker's refusal keeps tickets for a minute), but
    /// not at once (each lease would pay a connect while the slots stay taken).
    #[test]
    fn a_busy_broker_is_asked_again_soon_but_not_at_every_lease() {
        use std::io::{Read, Write};
        let dir = tempfile::tempdir().unwrap();
        let place = dir.path().join("busy.sock");
        let listener = std::os::unix::net::UnixListener::bind(&place).unwrap();
        let asked = std::thread::spawn(move || {
            let mut hellos = 0;
            for _ in 0..2 {
                let (mut s, _) = listener.accept().unwrap();
                let mut b = [0u8; 32];
                s.read_exact(&mut b).unwrap();
                assert_eq!(b, CHANNEL_HELLO);
                s.write_all(&[BUSY_REPLY]).unwrap();
                hellos += 1;
            }
            hellos
        });
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let asked_at = Instant::now();
        rt.block_on(ensure_open(std::slice::from_ref(&place)));
        {
            let sockets = mine().sockets.lock();
            let ch = &sockets[&place];
            let until = ch.refused_until.expect("asked again at the next lease");
            assert!(ch.conn.is_none() && until <= Instant::now() + BUSY_FOR);
            assert!(until >= asked_at + BUSY_FOR);
        }
        // Not asked at the next lease (the listener would count a second hello)...
        rt.block_on(ensure_open(std::slice::from_ref(&place)));
        // ...but once the pause is over.
        mine().sockets.lock().get_mut(&place).unwrap().refused_until = Some(Instant::now());
        rt.block_on(ensure_open(std::slice::from_ref(&place)));
        assert_eq!(asked.join().unwrap(), 2, "asked again after a busy answer");
        let sockets = mine().sockets.lock();
        assert!(sockets[&place]
            .refused_until
            .is_some_and(|t| t > Instant::now()));
    }

    /// A forked child never reads its parent's channel: the descriptors on it are the
    /// parent's.
    #[test]
    fn a_forked_child_does_not_read_its_parents_channel() {
        let place = PathBuf::from("/nonexistent/fork.sock");
        let (mine_end, broker) = UnixStream::pair().unwrap();
        install(&place, mine_end);
        push(&broker, &[7; 16]);
        // SAFETY: the child only looks at the channels and exits.
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            let got = take(std::slice::from_ref(&place), &[7; 16]).is_some();
            // SAFETY: leaving the child at once.
            unsafe { libc::_exit(i32::from(got)) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(child, &mut status, 0) };
        assert!(libc::WIFEXITED(status));
        assert_eq!(libc::WEXITSTATUS(status), 0, "the child read its parent's");
        assert!(
            take(&[place], &[7; 16]).is_some(),
            "the parent's is still there"
        );
    }
}
