//! Memory a worker keeps mapped after its lease left its tenant (released host memory, a
//! block it sealed, a cached block evicted for another tenant) is revoked when the broker
//! frees it: the memfd is truncated, so the kept mapping and descriptor hold nothing and
//! touching the mapping faults. Without that, a tenant with a 64 MiB limit ends up holding
//! many times its limit while the books say 0.

use super::*;
use gpu_broker_client::proto::v1 as pb;
use gpu_broker_client::{Client, Lease};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A memory object this test keeps past its lease's release: a duplicate of the lease's
/// descriptor and a shared, written mapping of it.
struct Kept {
    fd: OwnedFd,
    addr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory this test owns; only the test touches it.
unsafe impl Send for Kept {}

impl Kept {
    /// Keeps `lease`'s memory: dups its descriptor, maps it shared and writes every page.
    fn of(lease: &Lease) -> Kept {
        let fd = lease.fd().expect("an fd lease").as_raw_fd();
        // SAFETY: dup of a valid descriptor; close-on-exec, so that a broker another test
        // spawns meanwhile does not inherit it (and count it as its own memfd).
        let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        assert!(dup >= 0, "dup: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(dup) };
        let len = lease.bytes() as usize;
        // SAFETY: a shared mapping of a valid memfd of `len` bytes.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(
            addr,
            libc::MAP_FAILED,
            "{}",
            std::io::Error::last_os_error()
        );
        let addr = addr.cast::<u8>();
        // SAFETY: `addr` maps `len` writable bytes.
        unsafe { std::ptr::write_bytes(addr, 0x5a, len) };
        Kept { fd, addr, len }
    }

    /// Bytes of memory the object still has (its allocated blocks).
    fn held(&self) -> u64 {
        // SAFETY: fstat into a zeroed stat of a valid descriptor.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        let rc = unsafe { libc::fstat(self.fd.as_raw_fd(), &mut st) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        st.st_blocks as u64 * 512
    }

    /// Does touching the kept mapping fault (SIGBUS: the object was truncated)? Tried in
    /// a forked child, which reads one byte and exits.
    fn faults_on_touch(&self) -> bool {
        let at = self.addr as usize + self.len / 2;
        // SAFETY: the child only reads memory and calls _exit (async-signal-safe).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: inside the mapping; a fault kills the child, which is the answer.
            unsafe {
                std::ptr::read_volatile(at as *const u8);
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGBUS
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.addr.cast(), self.len) };
    }
}

/// Total bytes the kept objects still hold, once the broker's frees had time to run.
async fn settled_total(kept: &[Kept], at_most: u64) -> u64 {
    let total = || kept.iter().map(Kept::held).sum::<u64>();
    eventually(Duration::from_secs(10), || async { total() <= at_most }).await;
    total()
}

/// A host-backend broker of one 512 MiB device.
fn broker_of_512_mib() -> Broker {
    Broker::start_with(BrokerOpts {
        capacity: "512MiB",
        ..BrokerOpts::default()
    })
    .unwrap()
}

async fn client_of(b: &Broker, name: &str, q: QuotaSpec) -> Client {
    let token = b.tenant(name, q).await.unwrap();
    Client::connect(&b.uri(), token).await.unwrap()
}

/// Twelve rounds of: a 64 MiB host-tier lease, mapped and written, released, the mapping
/// (and a descriptor) kept. The broker frees host memory at the release; its free revokes
/// the memfd, so the process holds nothing of it and the tenant is charged nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_memory_kept_mapped_after_its_release_is_revoked() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "512MiB",
        extra: vec!["--host-fallback-capacity".into(), "1GiB".into()],
        ..BrokerOpts::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let q = QuotaSpec {
        host_limit_bytes: 64 * MIB,
        ..QuotaSpec::new(64 * MIB)
    };
    let c = client_of(&b, "t", q).await;
    let s = c.session("keeper").await.unwrap();
    let mut kept = Vec::new();
    for _ in 0..12 {
        let l = s
            .lease_request(64 * MIB)
            .host_tier(true)
            .send()
            .await
            .unwrap();
        kept.push(Kept::of(&l));
        l.release().await.unwrap();
    }
    let total = settled_total(&kept, 0).await;
    assert_eq!(total, 0, "the process still holds {} MiB", total / MIB);
    assert!(kept.iter().all(Kept::faults_on_touch));
    let u = tenant(&admin, "t").await.usage;
    assert_eq!((u.host_held_bytes, u.quarantined_bytes), (0, 0), "{u:?}");
    // The tenant's next lease is served as before.
    let l = s
        .lease_request(64 * MIB)
        .host_tier(true)
        .send()
        .await
        .unwrap();
    l.map().unwrap().fill(1);
    l.release().await.unwrap();
    assert_broker_alive(&b);
}

/// Device memory (host backend) its holder sealed is never handed out again: each next
/// lease is a fresh object and the sealed one is freed. Kept mapped, the freed objects
/// would add up to 768 MiB on a 512 MiB device for a tenant limited to 64 MiB; revoked,
/// only the last one (still in its tenant's cache) holds memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_device_memory_kept_mapped_is_revoked_when_freed() {
    let b = broker_of_512_mib();
    let c = client_of(&b, "t", QuotaSpec::new(64 * MIB)).await;
    let s = c.session("sealer").await.unwrap();
    let mut kept = Vec::new();
    for _ in 0..12 {
        let l = s.lease(64 * MIB).await.unwrap();
        let k = Kept::of(&l);
        // A seal that leaves the object truncatable: the broker frees it, never reuses it.
        // SAFETY: fcntl on our own descriptor.
        let rc = unsafe {
            libc::fcntl(
                k.fd.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_FUTURE_WRITE,
            )
        };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        kept.push(k);
        l.release().await.unwrap();
    }
    let total = settled_total(&kept, 64 * MIB).await;
    assert!(
        total <= 64 * MIB,
        "the process still holds {} MiB",
        total / MIB
    );
    assert!(kept[..11].iter().all(Kept::faults_on_touch));
    assert_broker_alive(&b);
}

/// A cached block evicted for another tenant's grant is revoked: the tenant that kept it
/// mapped after its release does not hold device memory the books give to another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_block_evicted_for_another_tenant_is_revoked() {
    let b = broker_of_512_mib();
    let a = client_of(&b, "a", QuotaSpec::new(512 * MIB)).await;
    let other = client_of(&b, "b", QuotaSpec::new(512 * MIB)).await;
    let sa = a.session("keeper").await.unwrap();
    let l = sa.lease(256 * MIB).await.unwrap();
    let k = Kept::of(&l);
    l.release().await.unwrap();
    assert_eq!(
        k.held(),
        256 * MIB,
        "cached for its tenant, still its pages"
    );
    let sb = other.session("taker").await.unwrap();
    let full = sb.lease(512 * MIB).await.unwrap();
    full.map().unwrap().fill(3);
    let total = settled_total(std::slice::from_ref(&k), 0).await;
    assert_eq!(
        total,
        0,
        "the evicted block still holds {} MiB",
        total / MIB
    );
    assert!(k.faults_on_touch());
    assert_broker_alive(&b);
}

/// The broker's shutdown frees every block without revoking it: a worker that still maps
/// its leases when the broker stops keeps reading what it wrote (its session is gone, its
/// memory with it once it lets go).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shutdown_leaves_kept_mappings_their_memory() {
    let mut b = Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        extra: vec!["--host-fallback-capacity".into(), "64MiB".into()],
        ..BrokerOpts::default()
    })
    .unwrap();
    let q = QuotaSpec {
        host_limit_bytes: 16 * MIB,
        ..QuotaSpec::new(16 * MIB)
    };
    let c = client_of(&b, "t", q).await;
    let s = c.session("stays").await.unwrap();
    let dev = s.lease(8 * MIB).await.unwrap();
    let host = s
        .lease_request(8 * MIB)
        .host_tier(true)
        .send()
        .await
        .unwrap();
    let kept = [Kept::of(&dev), Kept::of(&host)];
    b.stop(Duration::from_secs(20)).unwrap();
    for k in &kept {
        assert_eq!(k.held(), 8 * MIB);
        // SAFETY: the kept mapping of `len` bytes, still backed.
        let all = unsafe { std::slice::from_raw_parts(k.addr, k.len) };
        assert!(all.iter().all(|&x| x == 0x5a));
    }
}

/// A forked child that only reads the ticket reply its parent asked for: the parent (the
/// session's own process) connects to the ticket socket and writes a ticket of its lease;
/// the child receives the descriptor, seals the memfd against shrinking (no free can
/// revoke it), maps and writes it, and keeps it. The broker never saw the child. The
/// parent releases the lease and another tenant's grant frees the block: the memory the
/// child keeps stays charged to the lease's tenant, and goes once the child exits. It used
/// to be charged to nobody (only the recorded processes were looked at; none held it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_that_read_its_parents_ticket_reply_keeps_its_memory_charged() {
    let (b, a, child, _full) = child_keeps_a_freed_block().await;
    let quarantined = || async { a.usage().await.unwrap().usage.quarantined_bytes };
    drop(child);
    eventually(Duration::from_secs(10), || async {
        quarantined().await == 0
    })
    .await;
    assert_eq!(quarantined().await, 0, "let go once the child exited");
    assert_broker_alive(&b);
}

/// The same child unmaps and closes the memory while it lives on: the broker looks again
/// and lifts the charge within its look period (1 s, doubling while kept). Kept, it stays
/// charged across looks. The charge used to last until the holder exited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_lets_go_of_a_kept_memfd_while_alive_is_uncharged() {
    let (b, a, child, _full) = child_keeps_a_freed_block().await;
    let quarantined = || async { a.usage().await.unwrap().usage.quarantined_bytes };
    // Looked at after 1 s and 2 s more: still kept.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(quarantined().await, 32 * MIB, "kept: still charged");
    assert!(child.let_go(), "the child unmapped");
    eventually(Duration::from_secs(15), || async {
        quarantined().await == 0
    })
    .await;
    assert_eq!(
        quarantined().await,
        0,
        "let go of while alive: uncharged within the look period"
    );
    assert!(child.alive());
    assert_broker_alive(&b);
}

/// A forked child that only reads the ticket reply its parent asked for: the parent (the
/// session's own process) connects to the ticket socket and writes a ticket of its lease;
/// the child receives the descriptor, seals the memfd against shrinking (no free can
/// revoke it), maps and writes it, and keeps it. The broker never saw the child. The
/// parent releases the lease and another tenant's grant frees the block: the memory the
/// child keeps is charged to the lease's tenant (it used to be charged to nobody: only the
/// recorded processes were looked at, and none held it). Returns the broker, the tenant's
/// client, the child and the other tenant's lease.
async fn child_keeps_a_freed_block() -> (Broker, Client, ForkedReader, Lease) {
    let b = Broker::start_with(BrokerOpts {
        capacity: "64MiB",
        ..BrokerOpts::default()
    })
    .unwrap();
    let a = client_of(&b, "a", QuotaSpec::new(64 * MIB)).await;
    let other = client_of(&b, "b", QuotaSpec::new(64 * MIB)).await;
    let sa = a.session("parent").await.unwrap();
    let l = sa.lease(32 * MIB).await.unwrap();
    let h = a
        .raw()
        .renew_lease_ticket(pb::RenewLeaseTicketRequest {
            lease_id: l.id().into(),
        })
        .await
        .unwrap()
        .into_inner()
        .fd
        .unwrap();
    let mut conn = std::os::unix::net::UnixStream::connect(&h.socket_path).unwrap();
    std::io::Write::write_all(&mut conn, &h.ticket).unwrap();
    let child = ForkedReader::start(conn.as_raw_fd(), 32 * MIB as usize);
    drop(conn);
    assert!(
        child.kept(),
        "the child got, sealed and mapped the descriptor"
    );
    l.release().await.unwrap();
    let sb = other.session("taker").await.unwrap();
    let full = sb.lease(48 * MIB).await.unwrap();
    let quarantined = || async { a.usage().await.unwrap().usage.quarantined_bytes };
    eventually(Duration::from_secs(10), || async {
        quarantined().await == 32 * MIB
    })
    .await;
    assert_eq!(
        quarantined().await,
        32 * MIB,
        "the child's kept memory is charged to a"
    );
    std::mem::forget(sa);
    (b, a, child, full)
}

/// A forked child reading a descriptor off `sock` (`SCM_RIGHTS`), which seals it against
/// shrinking, maps `len` bytes of it shared, writes them, unmaps them and closes every
/// descriptor when told, and waits to be killed. It makes only system calls: the parent is multi-threaded.
struct ForkedReader {
    pid: libc::pid_t,
    /// The child's bytes: 1 when it holds the mapping, then 2 once it unmapped it.
    report: OwnedFd,
    /// A byte here tells the child to unmap.
    go: OwnedFd,
}

impl ForkedReader {
    fn start(sock: i32, len: usize) -> ForkedReader {
        let mut pipe = [0; 2];
        let mut go = [0; 2];
        // SAFETY: pipes into two-descriptor arrays.
        unsafe {
            assert_eq!(libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC), 0);
            assert_eq!(libc::pipe2(go.as_mut_ptr(), libc::O_CLOEXEC), 0);
        }
        // SAFETY: the child calls only async-signal-safe functions and _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: system calls on the inherited socket and pipe, stack buffers only.
            unsafe {
                let mut byte = [0u8; 1];
                let mut iov = libc::iovec {
                    iov_base: byte.as_mut_ptr().cast(),
                    iov_len: 1,
                };
                let mut control = [0u64; 8];
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = &mut iov;
                msg.msg_iovlen = 1;
                msg.msg_control = control.as_mut_ptr().cast();
                msg.msg_controllen = std::mem::size_of_val(&control) as _;
                let mut ok = 0u8;
                let mut mapped = libc::MAP_FAILED;
                if libc::recvmsg(sock, &mut msg, 0) == 1 {
                    let cmsg = libc::CMSG_FIRSTHDR(&msg);
                    if !cmsg.is_null() && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<i32>());
                        let at = libc::mmap(
                            std::ptr::null_mut(),
                            len,
                            libc::PROT_READ | libc::PROT_WRITE,
                            libc::MAP_SHARED,
                            fd,
                            0,
                        );
                        if at != libc::MAP_FAILED
                            && libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) == 0
                        {
                            std::ptr::write_bytes(at.cast::<u8>(), 0x5a, len);
                            libc::close(fd);
                            mapped = at;
                            ok = 1;
                        }
                    }
                }
                libc::write(pipe[1], [ok].as_ptr().cast(), 1);
                let mut told = [0u8; 1];
                if libc::read(go[0], told.as_mut_ptr().cast(), 1) == 1 && ok == 1 {
                    libc::munmap(mapped, len);
                    // And every descriptor it inherited (its parent's copy of the lease's).
                    for fd in 3..4096 {
                        if fd != pipe[1] {
                            libc::close(fd);
                        }
                    }
                    libc::write(pipe[1], [2u8].as_ptr().cast(), 1);
                }
                loop {
                    libc::pause();
                }
            }
        }
        // SAFETY: closing our copies of the child's ends; owning ours.
        unsafe {
            libc::close(pipe[1]);
            libc::close(go[0]);
            ForkedReader {
                pid,
                report: OwnedFd::from_raw_fd(pipe[0]),
                go: OwnedFd::from_raw_fd(go[1]),
            }
        }
    }

    /// The child's next report byte (blocks until it wrote one).
    fn report(&self) -> u8 {
        let mut byte = [0u8; 1];
        // SAFETY: reading one byte into a stack buffer.
        let n = unsafe { libc::read(self.report.as_raw_fd(), byte.as_mut_ptr().cast(), 1) };
        if n == 1 {
            byte[0]
        } else {
            0
        }
    }

    /// Did the child get, seal and map the descriptor?
    fn kept(&self) -> bool {
        self.report() == 1
    }

    /// Tells the child to unmap; true once it did.
    fn let_go(&self) -> bool {
        // SAFETY: writing one byte to our pipe.
        let n = unsafe { libc::write(self.go.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
        n == 1 && self.report() == 2
    }

    /// Is the child still running?
    fn alive(&self) -> bool {
        // SAFETY: a null signal to our own child.
        unsafe { libc::kill(self.pid, 0) == 0 }
    }
}

impl Drop for ForkedReader {
    fn drop(&mut self) {
        // SAFETY: killing and reaping our own child.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}
