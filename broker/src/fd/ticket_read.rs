//! Reading a ticket off a ticket connection together with who wrote it: the kernel's
//! `SCM_CREDENTIALS` of every process that sent a part of it. `SO_PEERCRED` names only the
//! process that connected; a child that inherited (or was passed) that connection writes
//! as itself, and the kernel says so (`SO_PASSCRED` on the listening socket, inherited by
//! each accepted one, makes it attach the writer's pid to everything written, also before
//! the accept). Only a process with `CAP_SYS_ADMIN` could claim another pid.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use tokio::io::Interest;
use tokio::net::UnixStream;

/// Turns `SO_PASSCRED` on for `sock` (a listening socket passes it on to what it accepts).
pub fn pass_credentials(sock: impl AsFd) -> io::Result<()> {
    Ok(rustix::net::sockopt::set_socket_passcred(sock, true)?)
}

/// What was read: the bytes, and the pids of the processes that wrote them, as the
/// kernel attached them (0: a process the broker's PID namespace cannot see). Empty when
/// the kernel attached none (credentials not passed).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Written {
    pub writers: Vec<u32>,
}

/// Fills `buf` from `stream` (the peer's credentials come with each part); an early end
/// of the stream is `UnexpectedEof`. Descriptors a peer sends along are closed.
pub async fn read_exact_with_writers(stream: &UnixStream, buf: &mut [u8]) -> io::Result<Written> {
    let mut got = 0;
    let mut written = Written::default();
    while got < buf.len() {
        stream.readable().await?;
        match stream.try_io(Interest::READABLE, || {
            recv_part(stream.as_raw_fd(), &mut buf[got..])
        }) {
            Ok((0, _)) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok((n, pid)) => {
                got += n;
                if let Some(p) = pid {
                    if !written.writers.contains(&p) {
                        written.writers.push(p);
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(written)
}

/// One `recvmsg` into `buf`: how many bytes, and the writer's pid if the kernel attached
/// it. A stream read stops where the writer changes, so one call has one writer. Control
/// data the kernel had to cut (more descriptors than the room) fails the read: a
/// writer's credentials must never be missing unseen.
///
/// Hand-written, not `rustix::net::recvmsg`: rustix reads `SCM_CREDENTIALS` into a
/// non-zero `Pid`, and the kernel writes pid 0 for a writer outside the broker's pid
/// namespace (undefined behaviour there, and the case the ticket server refuses).
fn recv_part(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<u32>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // Room for the credentials and a few descriptors (which are closed: a ticket brings
    // none; any beyond the room the kernel drops itself).
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe {
        libc::CMSG_SPACE(std::mem::size_of::<libc::ucred>() as u32)
            + libc::CMSG_SPACE((4 * std::mem::size_of::<RawFd>()) as u32)
    } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: zeroed msghdr, then every pointer set outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: a valid socket and message buffers.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut pid = None;
    // SAFETY: walking the control messages the kernel wrote into `control`.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            let data = libc::CMSG_DATA(c);
            match ((*c).cmsg_level, (*c).cmsg_type) {
                (libc::SOL_SOCKET, libc::SCM_CREDENTIALS) => {
                    let cred = std::ptr::read_unaligned(data.cast::<libc::ucred>());
                    pid = u32::try_from(cred.pid).ok();
                }
                (libc::SOL_SOCKET, libc::SCM_RIGHTS) => {
                    let len = (*c).cmsg_len as usize - (data as usize - c as usize);
                    for i in 0..len / std::mem::size_of::<RawFd>() {
                        let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                        drop(OwnedFd::from_raw_fd(fd));
                    }
                }
                _ => {}
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & (libc::MSG_CTRUNC | libc::MSG_TRUNC) != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a ticket connection's control data was cut",
        ));
    }
    Ok((n as usize, pid))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// The kernel names the writer, not the connector: a forked child writing on its
    /// parent's connection is seen as itself, also when it wrote before the accept.
    #[tokio::test]
    async fn a_child_writing_on_its_parents_connection_is_named_as_itself() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        pass_credentials(&listener).unwrap();
        let me = std::process::id();
        // This process connects and writes half; a forked child writes the rest.
        let mut c = std::os::unix::net::UnixStream::connect(&path).unwrap();
        c.write_all(&[1u8; 16]).unwrap();
        // SAFETY: the child only writes and exits (async-signal-safe calls).
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            let b = [2u8; 16];
            // SAFETY: a write on an inherited socket, then _exit.
            unsafe {
                libc::write(c.as_raw_fd(), b.as_ptr().cast(), b.len());
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(child, &mut status, 0) };
        let (s, _) = listener.accept().await.unwrap();
        let peer = s.peer_cred().unwrap().pid().unwrap() as u32;
        assert_eq!(peer, me, "SO_PEERCRED names the connector");
        let mut buf = [0u8; 32];
        let w = read_exact_with_writers(&s, &mut buf).await.unwrap();
        assert_eq!(&buf[..16], &[1u8; 16]);
        assert_eq!(&buf[16..], &[2u8; 16]);
        assert_eq!(w.writers, vec![me, child as u32]);
    }

    /// A part the kernel attached no writer to (written before credentials were passed)
    /// reads as pid 0, like a writer outside the broker's pid namespace: the ticket
    /// server refuses such a writer, so it must not be lost or read as another pid.
    #[tokio::test]
    async fn a_part_without_a_visible_writer_is_read_as_pid_0() {
        let (a, b) = UnixStream::pair().unwrap();
        b.try_write(&[1u8; 8]).unwrap();
        pass_credentials(&a).unwrap();
        pass_credentials(&b).unwrap();
        b.try_write(&[2u8; 8]).unwrap();
        let mut buf = [0u8; 16];
        let w = read_exact_with_writers(&a, &mut buf).await.unwrap();
        assert_eq!(w.writers, vec![0, std::process::id()]);
    }

    /// More descriptors than the room for them (the kernel cuts the control data): the
    /// read fails (a writer's credentials must never go missing unseen) and the
    /// descriptors that arrived are closed.
    #[tokio::test]
    async fn a_cut_control_message_fails_and_closes_what_arrived() {
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        use std::mem::MaybeUninit;
        let (a, b) = UnixStream::pair().unwrap();
        pass_credentials(&a).unwrap();
        let (mut r, w) = std::io::pipe().unwrap();
        let fds = [w.as_fd(); 16];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(16))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
        let payload = [1u8; 8];
        let sent = rustix::net::sendmsg(
            &b,
            &[io::IoSlice::new(&payload)],
            &mut control,
            SendFlags::empty(),
        )
        .unwrap();
        assert_eq!(sent, payload.len());
        drop(w);
        let mut buf = [0u8; 8];
        let e = read_exact_with_writers(&a, &mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        // Every write end is closed once the broker closed those that arrived (a fork
        // in another test may hold one a moment longer).
        // SAFETY: fcntl flags on a descriptor this test owns.
        assert_eq!(
            unsafe { libc::fcntl(r.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) },
            0
        );
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let mut one = [0u8; 1];
            match std::io::Read::read(&mut r, &mut one) {
                Ok(0) => break,
                Ok(_) => panic!("nothing was written to the pipe"),
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(10))
                }
                Err(e) => panic!("a write end of the pipe stayed open: {e}"),
            }
        }
    }

    #[tokio::test]
    async fn an_early_end_is_unexpected_eof() {
        let (a, b) = UnixStream::pair().unwrap();
        pass_credentials(&a).unwrap();
        b.try_write(&[1u8; 3]).unwrap();
        drop(b);
        let mut buf = [0u8; 32];
        let e = read_exact_with_writers(&a, &mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
