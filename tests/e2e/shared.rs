//! Shared read-only leases (host backend): charged once to the publisher, invisible to
//! tenants not listed, read-only by every route the OS offers, alive until unpublished (or
//! the publisher's lease ends) and the last importer let go, including importers that
//! crash or whose session ends while their process lives. Also: a process outside the
//! holder's session that fetched a lease's descriptor keeps its memory counted.

use gpu_broker_client::{Client, Code, QuotaSpec};
use gpu_broker_tests::*;
use std::os::fd::AsRawFd;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

async fn usage(c: &Client) -> (u64, u64) {
    let u = c.usage().await.unwrap();
    (u.usage.held_bytes, u.usage.quarantined_bytes)
}

/// Waits until `c`'s tenant holds `held` and has `quarantined` bytes quarantined.
async fn usage_becomes(c: &Client, held: u64, quarantined: u64) -> bool {
    eventually(T, || async { usage(c).await == (held, quarantined) }).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_lease_is_charged_once_and_hidden_from_tenants_not_listed() {
    let b = Broker::start().unwrap();
    let alice = b.client("alice", GIB).await.unwrap();
    let bob = b.client("bob", GIB).await.unwrap();
    let carol = b.client("carol", GIB).await.unwrap();
    let sa = alice.session("publisher").await.unwrap();
    let lease = sa.lease(8 * MIB).await.unwrap();
    let mut m = lease.map().unwrap();
    m[..5].copy_from_slice(b"hello");
    m[8 * MIB as usize - 1] = 0x5a;
    let shared = lease.publish("weights", &["bob"]).await.unwrap();
    assert!(shared.published && shared.read_only_enforced);
    assert_eq!((shared.bytes, shared.import_count), (8 * MIB, 0));
    assert_eq!(shared.tenants, vec!["bob".to_string()]);

    // Two of bob's sessions import it; they see alice's bytes and her later writes.
    let sb1 = bob.session("reader-1").await.unwrap();
    let sb2 = bob.session("reader-2").await.unwrap();
    let i1 = sb1.import("alice", "weights").await.unwrap();
    let i2 = sb2.import("alice", "weights").await.unwrap();
    assert!(
        i1.info().imports.is_empty(),
        "importers do not see each other"
    );
    let r1 = i1.map().unwrap();
    assert_eq!(&r1[..5], b"hello");
    assert_eq!(r1[8 * MIB as usize - 1], 0x5a);
    m[0] = b'J';
    assert_eq!(i2.map().unwrap()[0], b'J');

    // Charged once, to alice; bob holds nothing.
    assert_eq!(usage(&alice).await, (8 * MIB, 0));
    assert_eq!(usage(&bob).await, (0, 0));

    // Carol is not listed: NOT_FOUND, the same as a name that does not exist.
    let sc = carol.session("outsider").await.unwrap();
    let e = sc.import("alice", "weights").await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    let e2 = sc.import("alice", "no-such-name").await.unwrap_err();
    assert_eq!(e2.code(), Code::NotFound);
    assert_eq!(
        e.to_string().replace("weights", "X"),
        e2.to_string().replace("no-such-name", "X"),
        "a refusal says nothing about whether the name exists"
    );
    assert!(carol.list_shared().await.unwrap().is_empty());

    // Listings: bob sees it without importers, alice with both, operators with both.
    let seen = bob.list_shared().await.unwrap();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].imports.is_empty());
    assert_eq!(seen[0].import_count, 2);
    let own = alice.list_shared().await.unwrap();
    assert_eq!(own[0].imports.len(), 2);
    assert!(own[0]
        .imports
        .iter()
        .all(|i| i.tenant == "bob" && !i.lingering));
    let admin = b.admin().await.unwrap();
    let all = admin.list_shared(None).await.unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].publisher, "alice");
    assert_eq!(all[0].imports.len(), 2);
    assert!(admin.list_shared(Some("bob")).await.unwrap().is_empty());

    // Names are per tenant: bob may publish "weights" too; alice may not twice.
    let other = sa.lease(2 * MIB).await.unwrap();
    let e = other.publish("weights", &[]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert_eq!(
        e.reason(),
        Some(&gpu_broker_client::error::Reason::SharedNameTaken),
        "{e}"
    );
    let bl = sb1.lease(2 * MIB).await.unwrap();
    bl.publish("weights", &[]).await.unwrap();
    // Bad names are refused.
    let e = other.publish("", &[]).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = other.publish(&"n".repeat(300), &[]).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    // Only one's own leases: bob cannot publish alice's.
    let e = bob
        .raw()
        .publish_lease(gpu_broker_client::proto::v1::PublishLeaseRequest {
            lease_id: lease.id().to_string(),
            name: "stolen".into(),
            tenants: vec![],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);

    drop(r1);
    i1.release().await.unwrap();
    i2.release().await.unwrap();
    drop(m);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn importers_cannot_write_shared_host_memory_by_any_route() {
    let b = Broker::start().unwrap();
    let alice = b.client("alice", GIB).await.unwrap();
    let bob = b.client("bob", GIB).await.unwrap();
    let sa = alice.session("p").await.unwrap();
    let lease = sa.lease(2 * MIB).await.unwrap();
    lease.map().unwrap().fill(0x11);
    lease.publish("ro", &["bob"]).await.unwrap();
    let sb = bob.session("r").await.unwrap();
    let import = sb.import("alice", "ro").await.unwrap();
    let fd = import.fd().as_raw_fd();
    let len = 2 * MIB as usize;
    // SAFETY: syscalls on a descriptor we own, with checked results.
    unsafe {
        assert_eq!(libc::write(fd, [0u8].as_ptr().cast(), 1), -1, "write(2)");
        let w = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        );
        assert_eq!(w, libc::MAP_FAILED, "a writable shared mapping");
        // Reopening the descriptor read-write through /proc succeeds; the seal holds.
        let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).unwrap();
        let rw = libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
        assert!(rw >= 0);
        assert_eq!(libc::pwrite(rw, [0u8].as_ptr().cast(), 1, 0), -1);
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EPERM)
        );
        let w = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            rw,
            0,
        );
        assert_eq!(
            w,
            libc::MAP_FAILED,
            "writable through the reopened descriptor"
        );
        let r = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            rw,
            0,
        );
        assert_ne!(r, libc::MAP_FAILED);
        assert_ne!(
            libc::mprotect(r, len, libc::PROT_READ | libc::PROT_WRITE),
            0,
            "mprotect to writable"
        );
        assert_ne!(libc::ftruncate(rw, 0), 0, "shrinking");
        assert_ne!(
            libc::fallocate(rw, 0x02 | 0x01, 0, 4096),
            0,
            "punching a hole"
        );
        assert_eq!(*r.cast::<u8>(), 0x11);
        libc::munmap(r, len);
        libc::close(rw);
    }
    // The bytes are alice's, unchanged.
    assert!(import.map().unwrap().iter().all(|&x| x == 0x11));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_lives_until_unpublished_and_the_last_importer_let_go() {
    let b = Broker::start().unwrap();
    let alice = b.client("alice", GIB).await.unwrap();
    let bob = b.client("bob", GIB).await.unwrap();
    let sa = alice.session("p").await.unwrap();
    let sb = bob.session("r").await.unwrap();

    // Unpublish with a live importer: no new imports; the importer keeps reading.
    let lease = sa.lease(4 * MIB).await.unwrap();
    lease.map().unwrap().fill(0x22);
    lease.publish("a", &["bob"]).await.unwrap();
    let import = sb.import("alice", "a").await.unwrap();
    let un = alice.unpublish("a").await.unwrap();
    assert!(!un.published);
    assert_eq!(un.import_count, 1);
    assert_eq!(
        sb.import("alice", "a").await.unwrap_err().code(),
        Code::NotFound
    );
    assert_eq!(
        alice.unpublish("a").await.unwrap_err().code(),
        Code::NotFound
    );
    // The publisher releases its lease: the memory is still charged to alice (held for
    // bob), and bob still reads it.
    lease.release().await.unwrap();
    assert_eq!(usage(&alice).await, (0, 4 * MIB));
    assert!(import.map().unwrap().iter().all(|&x| x == 0x22));
    let listed = b.admin().await.unwrap().list_shared(None).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert!(listed[0].lease_id.is_empty() && !listed[0].published);
    // The last importer lets go: the memory is gone, and so is the listing.
    import.release().await.unwrap();
    assert!(
        usage_becomes(&alice, 0, 0).await,
        "{:?}",
        usage(&alice).await
    );
    assert!(b
        .admin()
        .await
        .unwrap()
        .list_shared(None)
        .await
        .unwrap()
        .is_empty());

    // The publisher's session ends (its process is killed): the name goes at once, the
    // memory when bob lets go.
    let alice_token = b.tenant("alice2", QuotaSpec::new(GIB)).await.unwrap();
    let alice2 = Client::connect(&b.uri(), alice_token.clone())
        .await
        .unwrap();
    let mut publisher = hold(&b, &alice_token, &["--bytes", "2MiB", "--pattern", "0x66"])
        .await
        .unwrap();
    publisher.proc.send("publish b bob").await.unwrap();
    publisher.proc.line_starting("PUBLISHED", T).await.unwrap();
    let import = sb.import("alice2", "b").await.unwrap();
    publisher.proc.signal(libc::SIGKILL);
    let _ = publisher.proc.wait(T).await;
    assert!(
        usage_becomes(&alice2, 0, 2 * MIB).await,
        "{:?}",
        usage(&alice2).await
    );
    assert_eq!(
        sb.import("alice2", "b").await.unwrap_err().code(),
        Code::NotFound
    );
    assert!(import.map().unwrap().iter().all(|&x| x == 0x66));
    import.release().await.unwrap();
    assert!(
        usage_becomes(&alice2, 0, 0).await,
        "{:?}",
        usage(&alice2).await
    );

    // A session that ends while its process lives keeps its memory quarantined as
    // always, and the name is gone at once.
    let sa3 = alice.session("p3").await.unwrap();
    let lease = sa3.lease(2 * MIB).await.unwrap();
    lease.publish("d", &["bob"]).await.unwrap();
    let import = sb.import("alice", "d").await.unwrap();
    lease.detach();
    sa3.close();
    drop(sa3);
    assert!(
        usage_becomes(&alice, 0, 2 * MIB).await,
        "{:?}",
        usage(&alice).await
    );
    assert_eq!(
        sb.import("alice", "d").await.unwrap_err().code(),
        Code::NotFound
    );
    import.release().await.unwrap();
    assert!(
        eventually(T, || async {
            b.admin()
                .await
                .unwrap()
                .list_shared(None)
                .await
                .unwrap()
                .is_empty()
        })
        .await
    );
    assert_eq!(
        usage(&alice).await,
        (0, 2 * MIB),
        "this process may still map it"
    );

    // Unpublished with no importers and then released: gone at once, nothing held.
    let lease = sa.lease(2 * MIB).await.unwrap();
    lease.publish("c", &[]).await.unwrap();
    alice.unpublish("c").await.unwrap();
    // It may be published again under a new name.
    lease.publish("c2", &[]).await.unwrap();
    lease.release().await.unwrap();
    assert_eq!(usage(&alice).await, (0, 2 * MIB));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_importer_lets_go_and_one_that_outlives_its_session_holds() {
    let b = Broker::start().unwrap();
    let alice = b.client("alice", GIB).await.unwrap();
    let bob_token = b.tenant("bob", QuotaSpec::new(GIB)).await.unwrap();
    let sa = alice.session("p").await.unwrap();
    let lease = sa.lease(4 * MIB).await.unwrap();
    lease.map().unwrap().fill(0x33);
    lease.publish("w", &["bob"]).await.unwrap();

    let spawn = |b: &Broker| {
        Proc::spawn(worker_cmd(
            b,
            &bob_token,
            &["import", "--publisher", "alice", "--name", "w"],
        ))
        .unwrap()
    };
    // Importer 1 is SIGKILLed; importer 2 ends its session but keeps its mapping.
    let mut crashed = spawn(&b);
    let line = crashed.line_starting("IMPORTED ", T).await.unwrap();
    assert!(line.ends_with("0x33"), "{line}");
    let mut lingering = spawn(&b);
    lingering.line_starting("READY", T).await.unwrap();
    lingering.send("close").await.unwrap();
    lingering.line_starting("CLOSED", T).await.unwrap();
    let admin = b.admin().await.unwrap();
    assert!(
        eventually(T, || async {
            let l = admin.list_shared(None).await.unwrap();
            l.len() == 1 && l[0].imports.iter().filter(|i| i.lingering).count() == 1
        })
        .await
    );
    crashed.signal(libc::SIGKILL);
    let _ = crashed.wait(T).await;
    assert!(
        eventually(T, || async {
            admin.list_shared(None).await.unwrap()[0].import_count == 1
        })
        .await,
        "the crashed importer's import ended"
    );
    // The publisher lets go: the lingering importer's process still maps it.
    lease.release().await.unwrap();
    assert_eq!(usage(&alice).await, (0, 4 * MIB));
    // It exits: the memory is freed.
    lingering.send("exit").await.unwrap();
    let _ = lingering.wait(T).await;
    assert!(
        usage_becomes(&alice, 0, 0).await,
        "{:?}",
        usage(&alice).await
    );
    assert!(admin.list_shared(None).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_fetched_a_lease_with_a_renewed_ticket_keeps_it_counted() {
    let b = Broker::start().unwrap();
    let token = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    let alice = Client::connect(&b.uri(), token.clone()).await.unwrap();
    let s = alice.session("holder").await.unwrap();
    let lease = s.lease(4 * MIB).await.unwrap();
    lease.map().unwrap().fill(0x44);
    // Another process of the tenant fetches the descriptor (RenewLeaseTicket) and maps it.
    let mut child = Proc::spawn(worker_cmd(
        &b,
        &token,
        &["read", "--lease", lease.id(), "--hold"],
    ))
    .unwrap();
    let sum = child.line_starting("SUM ", T).await.unwrap();
    assert!(sum.ends_with("0x44"), "{sum}");
    // The holder releases; the child still maps the memory: it stays counted.
    lease.release().await.unwrap();
    assert_eq!(usage(&alice).await, (0, 4 * MIB));
    child.signal(libc::SIGKILL);
    let _ = child.wait(T).await;
    assert!(
        usage_becomes(&alice, 0, 0).await,
        "{:?}",
        usage(&alice).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_its_holder_sealed_is_not_handed_out_again() {
    let b = Broker::start().unwrap();
    let alice = b.client("alice", GIB).await.unwrap();
    let s = alice.session("w").await.unwrap();
    let lease = s.lease(2 * MIB).await.unwrap();
    let block = |l: &gpu_broker_client::Lease| match l.handle() {
        gpu_broker_client::LeaseHandle::Fd(i) => i.block_id,
        h => panic!("{h:?}"),
    };
    let first = block(&lease);
    // Without seals of its own, a released block comes back to the same tenant.
    lease.release().await.unwrap();
    let lease = s.lease(2 * MIB).await.unwrap();
    assert_eq!(block(&lease), first);
    // The holder seals it (it may; it stays sealable for publishing).
    let fd = lease.fd().unwrap().as_raw_fd();
    // SAFETY: fcntl on the lease's descriptor.
    assert_eq!(
        unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SEAL) },
        0
    );
    let e = lease.publish("x", &[]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert_eq!(
        e.reason(),
        Some(&gpu_broker_client::error::Reason::SealFailed),
        "{e}"
    );
    assert_eq!(e.detail("lease_id"), Some(lease.id()), "{e}");
    lease.release().await.unwrap();
    // The next lease is a fresh memory object that can be written and published.
    let lease = s.lease(2 * MIB).await.unwrap();
    assert_ne!(block(&lease), first);
    lease.map().unwrap().fill(1);
    lease.publish("x", &[]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_held_for_importers_is_listed_as_quarantined_with_every_holder() {
    use gpu_broker_client::HoldReason;
    let b = Broker::start().unwrap();
    let alice = b.client("alice", GIB).await.unwrap();
    let bob_token = b.tenant("bob", QuotaSpec::new(GIB)).await.unwrap();
    let sa = alice.session("p").await.unwrap();
    let lease = sa.lease(4 * MIB).await.unwrap();
    lease.map().unwrap().fill(0x55);
    let shared = lease.publish("w", &["bob"]).await.unwrap();
    let spawn = |b: &Broker| {
        Proc::spawn(worker_cmd(
            b,
            &bob_token,
            &["import", "--publisher", "alice", "--name", "w"],
        ))
        .unwrap()
    };
    // One live importer, and one whose session ended while its process maps the memory.
    let mut live = spawn(&b);
    live.line_starting("READY", T).await.unwrap();
    let mut lingering = spawn(&b);
    lingering.line_starting("READY", T).await.unwrap();
    lingering.send("close").await.unwrap();
    lingering.line_starting("CLOSED", T).await.unwrap();
    let admin = b.admin().await.unwrap();
    // While the publisher's lease lives nothing is quarantined: it is simply leased.
    assert!(admin.list_quarantined().await.unwrap().is_empty());

    // The publisher lets go: the block is held for both importers, and listed.
    lease.release().await.unwrap();
    assert_eq!(usage(&alice).await, (0, 4 * MIB));
    let q = admin.list_quarantined().await.unwrap();
    assert_eq!(q.len(), 1, "{q:?}");
    let mut pids = vec![live.pid, lingering.pid];
    pids.sort_unstable();
    assert_eq!(q[0].tenant, "alice");
    assert_eq!(q[0].bytes, 4 * MIB);
    assert_eq!(q[0].reason, HoldReason::Importers);
    assert_eq!(q[0].holder_pids, pids);
    assert_eq!(q[0].importers, 2);
    assert_eq!(
        q[0].publication_id.as_deref(),
        Some(shared.publication_id.as_str())
    );
    assert_eq!(q[0].pid, None, "the publisher released it itself");
    assert_eq!(q[0].lease_id, lease_id_of(&shared));

    // `gpu-brokerctl leaks` shows it with why and who.
    let out = b.ctl().args(["leaks"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let section = text
        .split("QUARANTINED MEMORY (1 blocks")
        .nth(1)
        .unwrap_or("");
    let want_pids = format!("{},{}", pids[0], pids[1]);
    for want in ["alice", "4.0 MiB", "2 importers", want_pids.as_str()] {
        assert!(section.contains(want), "{want:?} in\n{text}");
    }

    // Nothing lifts it: the lease is gone, so a revoke finds nothing, and it stays held.
    let e = admin
        .revoke_lease(&q[0].lease_id, "lift")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    assert_eq!(admin.list_quarantined().await.unwrap().len(), 1);

    // The lingering importer's process exits: one holder left.
    lingering.send("exit").await.unwrap();
    let _ = lingering.wait(T).await;
    assert!(
        eventually(T, || async {
            let q = admin.list_quarantined().await.unwrap();
            q.len() == 1 && q[0].holder_pids == vec![live.pid] && q[0].importers == 1
        })
        .await,
        "{:?}",
        admin.list_quarantined().await
    );
    // The last importer crashes: freed, and the listing is empty.
    live.signal(libc::SIGKILL);
    let _ = live.wait(T).await;
    assert!(
        usage_becomes(&alice, 0, 0).await,
        "{:?}",
        usage(&alice).await
    );
    assert!(admin.list_quarantined().await.unwrap().is_empty());
}

/// The publisher's lease id as the publication first named it.
fn lease_id_of(s: &gpu_broker_client::SharedLeaseInfo) -> String {
    assert!(!s.lease_id.is_empty(), "published from a live lease");
    s.lease_id.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_renewed_ticket_recipient_maps_is_listed_with_its_pid() {
    use gpu_broker_client::HoldReason;
    let b = Broker::start().unwrap();
    let token = b.tenant("alice", QuotaSpec::new(GIB)).await.unwrap();
    let alice = Client::connect(&b.uri(), token.clone()).await.unwrap();
    let s = alice.session("holder").await.unwrap();
    let lease = s.lease(2 * MIB).await.unwrap();
    let id = lease.id().to_string();
    let mut child =
        Proc::spawn(worker_cmd(&b, &token, &["read", "--lease", &id, "--hold"])).unwrap();
    child.line_starting("SUM ", T).await.unwrap();
    lease.release().await.unwrap();
    let admin = b.admin().await.unwrap();
    let q = admin.list_quarantined().await.unwrap();
    assert_eq!(q.len(), 1, "{q:?}");
    assert_eq!(
        (q[0].lease_id.as_str(), q[0].tenant.as_str(), q[0].bytes),
        (id.as_str(), "alice", 2 * MIB)
    );
    assert_eq!(q[0].reason, HoldReason::Recipients);
    assert_eq!(q[0].holder_pids, vec![child.pid]);
    assert_eq!((q[0].publication_id.as_deref(), q[0].importers), (None, 0));
    child.signal(libc::SIGKILL);
    let _ = child.wait(T).await;
    assert!(
        eventually(T, || async {
            admin.list_quarantined().await.unwrap().is_empty()
        })
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_lease_listings_come_in_pages() {
    use gpu_broker_client::proto::v1 as pb;
    let b = Broker::start().unwrap();
    let alice = b.client("alice", GIB).await.unwrap();
    let bob = b.client("bob", GIB).await.unwrap();
    let sa = alice.session("p").await.unwrap();
    let mut leases = Vec::new();
    // Five publications; bob may read the even ones.
    for i in 0..5 {
        let l = sa.lease(2 * MIB).await.unwrap();
        let readers: &[&str] = if i % 2 == 0 { &["bob"] } else { &[] };
        l.publish(&format!("p{i}"), readers).await.unwrap();
        leases.push(l);
    }
    let admin = b.admin().await.unwrap();
    let names = |v: &[gpu_broker_client::SharedLeaseInfo]| {
        v.iter().map(|s| s.name.clone()).collect::<Vec<_>>()
    };
    // Operators: pages of 2, 2 and 1, oldest first, the same as the whole listing.
    let (p1, t1) = admin.list_shared_page(None, 2, "").await.unwrap();
    let t1 = t1.expect("a second page");
    let (p2, t2) = admin.list_shared_page(None, 2, &t1).await.unwrap();
    let (p3, t3) = admin.list_shared_page(None, 2, &t2.unwrap()).await.unwrap();
    assert_eq!((p1.len(), p2.len(), p3.len(), t3), (2, 2, 1, None));
    let all: Vec<String> = [names(&p1), names(&p2), names(&p3)].concat();
    assert_eq!(all, ["p0", "p1", "p2", "p3", "p4"]);
    assert_eq!(names(&admin.list_shared(None).await.unwrap()), all);
    assert_eq!(
        names(&admin.list_shared_paged(Some("alice"), 1).await.unwrap()),
        all
    );
    assert!(p1.iter().all(|s| s.publisher == "alice"));
    // A worker of bob: only the three published for it, in pages of 2.
    let (b1, bt) = bob.list_shared_page(2, "").await.unwrap();
    let (b2, bt2) = bob.list_shared_page(2, &bt.unwrap()).await.unwrap();
    assert_eq!(bt2, None);
    assert_eq!([names(&b1), names(&b2)].concat(), ["p0", "p2", "p4"]);
    assert_eq!(names(&bob.list_shared().await.unwrap()), ["p0", "p2", "p4"]);
    // The publisher sees its own, with a token that goes on past the unpublished ones.
    alice.unpublish("p1").await.unwrap();
    let (a1, at) = alice.list_shared_page(3, "").await.unwrap();
    assert_eq!(names(&a1), ["p0", "p2", "p3"]);
    let (a2, at2) = alice.list_shared_page(3, &at.unwrap()).await.unwrap();
    assert_eq!((names(&a2), at2), (vec!["p4".to_string()], None));
    // Tokens the broker did not give out: INVALID_ARGUMENT, and it keeps serving.
    for bad in ["abc", "-1", &"9".repeat(300)] {
        let e = admin.list_shared_page(None, 2, bad).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{bad}: {e}");
        let e = bob
            .raw()
            .list_shared_leases(pb::ListSharedLeasesRequest {
                page_size: 2,
                page_token: bad.to_string(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad}: {e}");
    }
    assert_eq!(bob.list_shared().await.unwrap().len(), 3);
    // The CLI walks the pages.
    let out = tokio::process::Command::from(b.ctl())
        .args(["--json", "shared", "--page-size", "2"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let listed: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        listed,
        ["p0", "p2", "p3", "p4"],
        "unpublished and not imported: gone"
    );
    drop(leases);
}
