//! Reading a ticket off a ticket connection together with who wrote it: the kernel's
//! `SCM_CREDENTIALS` of every process that sent a part of it. `SO_PEERCRED` names only the
//! process that connected; a child that inherited (or was passed) that connection writes
//! as itself, and the kernel says so (`SO_PASSCRED` on the listening socket, inherited by
//! each accepted one, makes it attach the writer's pid to everything written, also before
//! the accept). Only a process with `CAP_SYS_ADMIN` could claim another pid.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use tokio::io::Interest;
use tokio::net::UnixStream;

/// Turns `SO_PASSCRED` on for `sock` (a listening socket passes it on to what it accepts).
pub fn pass_credentials(sock: RawFd) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: setsockopt of an int on a valid socket.
    let rc = unsafe {
        libc::setsockopt(
            sock,
            libc::SOL_SOCKET,
            libc::SO_PASSCRED,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
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
/// it. A stream read stops where the writer changes, so one call has one writer.
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
        pass_credentials(listener.as_raw_fd()).unwrap();
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

    #[tokio::test]
    async fn an_early_end_is_unexpected_eof() {
        let (a, b) = UnixStream::pair().unwrap();
        pass_credentials(a.as_raw_fd()).unwrap();
        b.try_write(&[1u8; 3]).unwrap();
        drop(b);
        let mut buf = [0u8; 32];
        let e = read_exact_with_writers(&a, &mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
