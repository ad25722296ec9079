//! The crash-point matrix: a broker with a keeper (and again with systemd's fd store, a
//! fake manager of `tests/support/systemd.rs`) is SIGKILLed at each step of each
//! state-changing operation whose order matters for a restart (before and after each
//! write to the keeper: `GPU_BROKER_CRASH_AT`, `broker/src/crash_point.rs`), restarted,
//! and then the books must agree everywhere: the leases the live worker holds are exactly
//! the broker's (same ids), its tenant's held bytes are their sum, the keeper holds one
//! descriptor per lease and the broker one per lease, cached or quarantined block, and
//! what nobody holds is gone. Operations: acquire (fresh and from the cache), release, revoke,
//! session open and end, and (`after:<op>` once the operation's lock was let go) reclaim
//! (request and forced revoke at its deadline, here a drain's), quarantine and its lift,
//! publish/import/release-import, a publisher's release while imported and an importer's
//! session end while its process lives, a renewed-ticket recipient's fetch and its lease's
//! release while it maps the memory, process reservation and its release, drain.
//! Drains, the quarantine of a live process, publications, imports, blocks held for
//! importers and lingering imports are kept (checked here); what a restart lets go is
//! docs/operations.md's list, and the books agree either way.

use super::*;
use futures::StreamExt;
use gpu_broker_client::{Backoff, Client, Lease, Session, SessionEvent};

const SIZE: u64 = 8 * MIB;

/// A broker built without crash points (a release build without the `crash-points`
/// feature) ignores `GPU_BROKER_CRASH_AT`: nothing to test then.
fn skipped() -> bool {
    if gpu_broker::crash_point::HONOURED {
        return false;
    }
    eprintln!("skipped: this build ignores GPU_BROKER_CRASH_AT (build with --features gpu-broker/crash-points)");
    true
}

/// Where the broker keeps its leases: the matrix runs against each.
#[derive(Clone, Copy, Debug)]
enum Where {
    Keeper,
    FdStore,
}

/// A place holding leases: a keeper process or a (fake) systemd's fd store.
enum Held {
    Keeper(Box<Keeper>),
    FdStore(std::sync::Arc<FakeSystemd>),
}

impl Held {
    /// How many lease memory objects it holds.
    fn memfds(&self) -> usize {
        match self {
            Held::Keeper(k) => k.memfds(),
            Held::FdStore(sd) => sd.memfds(),
        }
    }
}

struct Case {
    keeper: Held,
    b: Broker,
    token: String,
}

impl Case {
    /// A keeper (or a systemd fd store) and a broker that dies at `point`.
    async fn start(point: &str, place: Where) -> Case {
        Case::start_with(point, place, &[]).await
    }

    /// [`Case::start`], the broker given `flags` too.
    async fn start_with(point: &str, place: Where, flags: &[&str]) -> Case {
        let mut opts = BrokerOpts {
            capacity: "256MiB",
            extra: vec![
                "--keepalive-timeout".into(),
                "2s".into(),
                "--host-fallback-capacity".into(),
                "64MiB".into(),
            ],
            ..BrokerOpts::default()
        };
        opts.extra.extend(flags.iter().map(|f| f.to_string()));
        let (keeper, mut b) = match place {
            Where::Keeper => {
                let keeper = Keeper::start().await.unwrap();
                let mut opts = opts;
                opts.extra.extend(keeper.flags());
                let b = Broker::start_with(opts).unwrap();
                (Held::Keeper(Box::new(keeper)), b)
            }
            Where::FdStore => {
                let sd = FakeSystemd::start(1024).unwrap();
                let b = Broker::start_under(sd.clone(), opts).unwrap();
                (Held::FdStore(sd), b)
            }
        };
        let quota = QuotaSpec {
            host_limit_bytes: 32 * MIB,
            ..QuotaSpec::new(128 * MIB)
        };
        let token = b.tenant("t", quota).await.unwrap();
        // The crash point is armed from the next start: restart once with it.
        b.kill().unwrap();
        b.env = vec![("GPU_BROKER_CRASH_AT".into(), point.into())];
        b.spawn().unwrap();
        b.env.clear();
        Case { keeper, b, token }
    }

    async fn session(&self) -> Session {
        let client = Client::connect(&self.b.uri(), self.token.clone())
            .await
            .unwrap();
        client
            .session_builder("w")
            .reconnect(Backoff::new(
                Duration::from_millis(20),
                Duration::from_millis(200),
            ))
            .await
            .unwrap()
    }

    /// A session retaining up to two blocks that has retained one (leased and released
    /// over gRPC, so its lease line opens at the next lease), and its events.
    async fn retaining(&self) -> (Session, gpu_broker_client::SessionEvents) {
        let s = self.session().await;
        s.retain_mappings(2 * SIZE);
        let events = s.events();
        s.lease(SIZE).await.unwrap().release().await.unwrap();
        assert_eq!(s.retained_bytes(), SIZE, "retained");
        (s, events)
    }

    /// Waits for the broker to die at its crash point, then starts it again (unarmed).
    async fn restart_after_crash(&mut self, point: &str) {
        self.crashed(point).await;
        self.b.kill().unwrap();
        self.b.spawn().unwrap();
    }

    /// Waits for the broker to die at its crash point (it is not started again).
    async fn crashed(&mut self, point: &str) {
        let died = eventually(Duration::from_secs(10), || {
            let log = self.b.log_text();
            async move { log.contains("crash point reached") }
        })
        .await;
        assert!(
            died,
            "the broker did not reach {point}:\n{}",
            self.b.log_text()
        );
    }

    /// Everything agrees with the worker holding exactly `held`.
    async fn check(&self, point: &str, held: &[&Lease]) {
        self.check_with(point, held, 0).await
    }

    /// [`Case::check`], the broker holding `extra` descriptors more (a publication's
    /// read-only reopen of its memfd).
    async fn check_with(&self, point: &str, held: &[&Lease], extra: u64) {
        let mut want: Vec<String> = held.iter().map(|l| l.id().to_string()).collect();
        want.sort();
        let on_host = |l: &&&Lease| l.tier() == gpu_broker_client::Tier::Host;
        let bytes: u64 = held.iter().filter(|l| !on_host(l)).map(|l| l.bytes()).sum();
        let on_device = held.iter().filter(|l| !on_host(l)).count();
        let host_bytes: u64 = held.iter().filter(on_host).map(|l| l.bytes()).sum();
        let deadline = Instant::now() + Duration::from_secs(8);
        let (ok, last) = loop {
            let admin = self.b.admin().await.unwrap();
            let mut ids: Vec<String> = admin
                .list_all_leases(None)
                .await
                .unwrap()
                .into_iter()
                .map(|l| l.lease_id)
                .collect();
            ids.sort();
            let u = admin.get_quota("t").await.unwrap().usage;
            let dev = &admin.get_devices().await.unwrap()[0];
            // Blocks the pool keeps: cached, or quarantined while a live process (this
            // test's) may map them.
            let cached = (dev.cached_bytes + dev.quarantined_bytes) / SIZE;
            // The place holds each lease's block and each quarantined one (its process
            // may map it: it stays counted across a restart).
            let quarantined = (dev.quarantined_bytes / SIZE) as usize;
            let kept = self.keeper.memfds();
            let fds = self.b.memfds();
            let own = fds.len() as u64;
            // Each block is one memory object: two of the broker's records of one block
            // (its memory made twice) would be two descriptors of one memfd.
            let objects: std::collections::HashSet<u64> = fds
                .iter()
                .filter_map(|p| std::fs::metadata(p).ok())
                .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
                .collect();
            let ok = ids == want
                && u.held_bytes == bytes
                && u.lease_count as usize == on_device
                && u.host_held_bytes == host_bytes
                && kept == want.len() + quarantined
                && own == want.len() as u64 + cached + extra
                && objects.len() as u64 + extra == own;
            let last = format!(
                "leases {ids:?} (want {want:?}), held {} in {} (want {bytes}), host {} (want {host_bytes}), keeper {kept}, broker {own} ({} memory objects) with {cached} cached or quarantined",
                u.held_bytes,
                u.lease_count,
                u.host_held_bytes,
                objects.len()
            );
            if ok || Instant::now() > deadline {
                break (ok, last);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(ok, "{point}: {last}\n{}", self.b.log_text());
    }
}

async fn resumed_or_closed(events: &mut gpu_broker_client::SessionEvents) -> SessionEvent {
    tokio::time::timeout(Duration::from_secs(15), async {
        while let Some(e) = events.next().await {
            if matches!(
                e,
                SessionEvent::Resumed { .. }
                    | SessionEvent::Reconnected { .. }
                    | SessionEvent::Closed { .. }
            ) {
                return e;
            }
        }
        panic!("events ended")
    })
    .await
    .expect("the session came back within 15 s")
}

#[tokio::test]
async fn acquire_fresh_and_from_the_cache() {
    if skipped() {
        return;
    }
    acquire(Where::Keeper).await
}

#[tokio::test]
async fn acquire_fresh_and_from_the_cache_in_the_fd_store() {
    if skipped() {
        return;
    }
    acquire(Where::FdStore).await
}

async fn acquire(place: Where) {
    for (point, n) in [
        ("before-keep:lease", 1),
        ("after-keep:lease", 1),
        ("before-keep:lease", 2),
        ("after-keep:lease", 2),
    ] {
        let point = format!("{point}#{n}");
        let mut c = Case::start(&point, place).await;
        let s = c.session().await;
        let mut events = s.events();
        let mut held = Vec::new();
        if n == 2 {
            // The second grant reuses the first one's cached block.
            let first = s.lease(SIZE).await.unwrap();
            first.release().await.unwrap();
        }
        let call = {
            let s = s.clone();
            tokio::spawn(async move { s.lease(SIZE).await })
        };
        c.restart_after_crash(&point).await;
        let e = resumed_or_closed(&mut events).await;
        assert!(matches!(e, SessionEvent::Resumed { .. }), "{point}: {e:?}");
        // The call made across the crash went through exactly once.
        held.push(call.await.unwrap().expect("the acquire across the crash"));
        c.check(&point, &held.iter().collect::<Vec<_>>()).await;
    }
}

/// A retained block leased again, and released again, on the session's lease line while
/// the broker dies around the keeper's write: the line closes with no answer, the client
/// asks over gRPC once the session is resumed, the call goes through once, and once let
/// go nothing stays counted, but for a grant kept and never answered: the block was the
/// process's, mapped, so the resume ends it as memory that process may map (quarantined
/// while it lives), never into the cache under its mapping.
#[tokio::test]
async fn retained_lease_and_release_on_the_lease_line() {
    if skipped() {
        return;
    }
    for point in [
        "before-keep:lease#2",
        "after-keep:lease#2",
        "before-keep:lease-ended#2",
        "after-keep:lease-ended#2",
    ] {
        let releasing = point.contains("lease-ended");
        let mut c = Case::start(point, Where::Keeper).await;
        let (s, mut events) = c.retaining().await;
        let again = match releasing {
            true => Some(s.lease(SIZE).await.unwrap()),
            false => None,
        };
        let call = {
            let s = s.clone();
            tokio::spawn(async move {
                match again {
                    Some(l) => l.release().await.map(|()| None),
                    None => s.lease(SIZE).await.map(Some),
                }
            })
        };
        c.restart_after_crash(point).await;
        let e = resumed_or_closed(&mut events).await;
        assert!(matches!(e, SessionEvent::Resumed { .. }), "{point}: {e:?}");
        let held = call.await.unwrap().expect("the call across the crash");
        c.check(point, &held.iter().collect::<Vec<_>>()).await;
        // Everything let go: nothing stays counted.
        if let Some(l) = held {
            l.release().await.unwrap();
        }
        s.drop_retained().await;
        c.check(&format!("{point}, let go"), &[]).await;
        let lost_grant = point == "after-keep:lease#2";
        let u = s.usage().await.unwrap().usage;
        assert_eq!(
            (u.held_bytes, u.quarantined_bytes),
            (0, if lost_grant { SIZE } else { 0 }),
            "{point}"
        );
    }
}

/// A lease line's answer cut by a crash after its first part: the lease is an error (the
/// broker may have granted it, so it is not asked again over gRPC), the process lets go
/// of its retained blocks, and after the restart the grant it never got ends as memory
/// it may map; the session goes on.
#[tokio::test]
async fn a_lease_line_answer_cut_by_a_crash() {
    if skipped() {
        return;
    }
    let point = "mid:line-answer";
    let mut c = Case::start(point, Where::Keeper).await;
    let (s, mut events) = c.retaining().await;
    let call = {
        let s = s.clone();
        tokio::spawn(async move { s.lease(SIZE).await })
    };
    c.restart_after_crash(point).await;
    let got = call.await.unwrap();
    assert!(
        matches!(got, Err(gpu_broker_client::ClientError::Protocol(_))),
        "{:?}",
        got.map(|l| l.id().to_string())
    );
    assert_eq!(s.retained_bytes(), 0, "its retained blocks let go");
    let e = resumed_or_closed(&mut events).await;
    assert!(matches!(e, SessionEvent::Resumed { .. }), "{e:?}");
    c.check(point, &[]).await;
    let u = s.usage().await.unwrap().usage;
    assert_eq!((u.held_bytes, u.quarantined_bytes), (0, SIZE));
    let l = s.lease(SIZE).await.unwrap();
    c.check(point, &[&l]).await;
}

/// A lease dropped (not released by call) whose release a crash cut, before and after its
/// end reached the keeper: the release waits out the restart, the resume names the lease
/// let go, and nothing of it stays held or counted.
#[tokio::test]
async fn a_dropped_leases_release_cut_by_a_crash() {
    if skipped() {
        return;
    }
    for point in ["before-keep:lease-ended", "after-keep:lease-ended"] {
        let mut c = Case::start(point, Where::Keeper).await;
        let s = c.session().await;
        let mut events = s.events();
        let keep = s.lease(SIZE).await.unwrap();
        drop(s.lease(SIZE).await.unwrap());
        c.restart_after_crash(point).await;
        let e = resumed_or_closed(&mut events).await;
        let SessionEvent::Resumed { lost_leases, .. } = &e else {
            panic!("{point}: {e:?}")
        };
        assert!(
            lost_leases.is_empty(),
            "{point}: a release is not a loss: {e:?}"
        );
        c.check(point, &[&keep]).await;
        let u = s.usage().await.unwrap().usage;
        assert_eq!((u.held_bytes, u.quarantined_bytes), (SIZE, 0), "{point}");
    }
}

/// A retaining release whose answer on the lease line a crash cut: the release unmaps and
/// ends the lease plainly once the session is resumed (the lease named let go, or the
/// block the broker retained let go by the same id), and nothing stays counted.
#[tokio::test]
async fn a_lease_line_release_cut_by_a_crash() {
    if skipped() {
        return;
    }
    // The first answer on the line is the block's second lease; the second, its release.
    let point = "mid:line-answer#2";
    let mut c = Case::start(point, Where::Keeper).await;
    let (s, mut events) = c.retaining().await;
    let l = s.lease(SIZE).await.unwrap();
    let call = tokio::spawn(async move { l.release().await });
    c.restart_after_crash(point).await;
    let e = resumed_or_closed(&mut events).await;
    let SessionEvent::Resumed { lost_leases, .. } = &e else {
        panic!("{e:?}")
    };
    assert!(lost_leases.is_empty(), "a release is not a loss: {e:?}");
    call.await.unwrap().expect("the release across the crash");
    assert_eq!(s.retained_bytes(), 0);
    c.check(point, &[]).await;
    let u = s.usage().await.unwrap().usage;
    assert_eq!((u.held_bytes, u.quarantined_bytes), (0, 0));
}

#[tokio::test]
async fn host_tier_acquire_and_release() {
    if skipped() {
        return;
    }
    host_tier(Where::Keeper).await
}

#[tokio::test]
async fn host_tier_acquire_and_release_in_the_fd_store() {
    if skipped() {
        return;
    }
    host_tier(Where::FdStore).await
}

/// A host-tier lease of `s`, its first bytes `text`.
async fn host_lease_with(s: &Session, text: &[u8]) -> Lease {
    let l = s.lease_request(SIZE).host_tier(true).send().await.unwrap();
    l.map().unwrap().as_mut_slice()[..text.len()].copy_from_slice(text);
    l
}

/// Host-tier leases are kept as device leases are: a crash at each step of a host-tier
/// acquire and release keeps the live worker's host leases (same ids, bytes, tenant and
/// memory: what it wrote is there), charged to its host bytes exactly.
async fn host_tier(place: Where) {
    for point in [
        "before-keep:lease#2",
        "after-keep:lease#2",
        "before-keep:lease-ended",
        "after-keep:lease-ended",
    ] {
        let mut c = Case::start(point, place).await;
        let s = c.session().await;
        let mut events = s.events();
        let kept = host_lease_with(&s, b"kept").await;
        let call = if point.ends_with("lease#2") {
            let s = s.clone();
            tokio::spawn(async move { Some(s.lease_request(SIZE).host_tier(true).send().await) })
        } else {
            let gone = host_lease_with(&s, b"gone").await;
            tokio::spawn(async move {
                gone.release().await.expect("the release across the crash");
                None
            })
        };
        c.restart_after_crash(point).await;
        let e = resumed_or_closed(&mut events).await;
        let SessionEvent::Resumed { lost_leases, .. } = &e else {
            panic!("{point}: {e:?}")
        };
        assert!(lost_leases.is_empty(), "{point}: {e:?}");
        let mut held = vec![&kept];
        let made = call
            .await
            .unwrap()
            .map(|r| r.expect("the acquire across the crash"));
        held.extend(made.as_ref());
        c.check(point, &held).await;
        assert_eq!(&kept.map().unwrap().as_slice()[..4], b"kept", "{point}");
    }
}

#[tokio::test]
async fn release_and_revoke() {
    if skipped() {
        return;
    }
    release(Where::Keeper).await
}

#[tokio::test]
async fn release_and_revoke_in_the_fd_store() {
    if skipped() {
        return;
    }
    release(Where::FdStore).await
}

async fn release(place: Where) {
    for point in ["before-keep:lease-ended", "after-keep:lease-ended"] {
        for revoke in [false, true] {
            let mut c = Case::start(point, place).await;
            let s = c.session().await;
            let mut events = s.events();
            let a = s.lease(SIZE).await.unwrap();
            let keep = s.lease(SIZE).await.unwrap();
            let a_id = a.id().to_string();
            let (call, a) = if revoke {
                let admin = c.b.admin().await.unwrap();
                let id = a_id.clone();
                let t = tokio::spawn(async move {
                    // Cut by the crash, or answered: what counts is the books after.
                    let _ = admin.revoke_lease(&id, "test").await;
                    Ok(())
                });
                (t, Some(a))
            } else {
                (tokio::spawn(async move { a.release().await }), None)
            };
            c.restart_after_crash(point).await;
            let e = resumed_or_closed(&mut events).await;
            let SessionEvent::Resumed { lost_leases, .. } = &e else {
                panic!("{point}: {e:?}")
            };
            // A release across the crash ended before it, or its retry ended it after.
            call.await.unwrap().expect("the release across the crash");
            let held = vec![&keep];
            match &a {
                // The revocation's quarantine (its process lives) reached the keeper before
                // the lease's end, not the worker: it learns it now.
                Some(_) => assert_eq!(lost_leases, std::slice::from_ref(&a_id), "{point}"),
                None => assert!(lost_leases.is_empty(), "{point}: {e:?}"),
            }
            c.check(&format!("{point} revoke={revoke}"), &held).await;
        }
    }
}

#[tokio::test]
async fn session_open_and_end() {
    if skipped() {
        return;
    }
    session_start_end(Where::Keeper).await
}

#[tokio::test]
async fn session_open_and_end_in_the_fd_store() {
    if skipped() {
        return;
    }
    session_start_end(Where::FdStore).await
}

async fn session_start_end(place: Where) {
    // Ending a session: its leases' ends, then its own.
    for point in [
        "before-keep:lease-ended",
        "after-keep:lease-ended",
        "before-keep:session-ended",
        "after-keep:session-ended",
        "after-keep:session",
    ] {
        let mut c = Case::start(point, place).await;
        if point == "after-keep:session" {
            // The worker never learnt of the session (its open failed): the kept one is
            // taken back, never resumed, and ends with the keepalive timeout.
            let client = Client::connect(&c.b.uri(), c.token.clone()).await.unwrap();
            assert!(client.session("w").await.is_err());
            c.restart_after_crash(point).await;
        } else {
            let s = c.session().await;
            let _a = s.lease(SIZE).await.unwrap();
            let _b = s.lease(SIZE).await.unwrap();
            s.close();
            drop((_a, _b, s));
            c.restart_after_crash(point).await;
        }
        // Nobody resumes what was left: it ends (keepalive timeout 2 s), and everything
        // it held goes.
        c.check(point, &[]).await;
        let admin = c.b.admin().await.unwrap();
        assert!(
            eventually(Duration::from_secs(8), || async {
                admin.list_sessions(None).await.unwrap().is_empty()
            })
            .await,
            "{point}: a session nobody resumes ends"
        );
    }
}

/// Waits for the worker's session to come back after the restart.
async fn resumed(point: &str, events: &mut gpu_broker_client::SessionEvents) {
    let e = resumed_or_closed(events).await;
    assert!(matches!(e, SessionEvent::Resumed { .. }), "{point}: {e:?}");
}

#[tokio::test]
async fn reclaim_request() {
    if skipped() {
        return;
    }
    // A higher-priority tenant's request that fits only with memory back asks the
    // holder of a reclaimable lease to give it back by a deadline (3 s here). The request
    // is kept: after the restart the lease is still asked back by the same wall-clock
    // deadline, and revoked at it.
    for point in [
        "before-keep:reclaim-asked",
        "after-keep:reclaim-asked",
        "after:reclaim",
    ] {
        let mut c = Case::start_with(point, Where::Keeper, &["--reclaim-deadline", "3s"]).await;
        let hi = c.b.tenant("hi", quota(256 * MIB, 0, 10)).await.unwrap();
        let s = c.session().await;
        let mut events = s.events();
        let keep = s.lease(SIZE).await.unwrap();
        let r = s
            .lease_request(120 * MIB)
            .reclaimable(true)
            .send()
            .await
            .unwrap();
        let hs = Client::connect(&c.b.uri(), hi)
            .await
            .unwrap()
            .session("hi")
            .await
            .unwrap();
        // Cut by the crash.
        let _ = hs
            .lease_request(136 * MIB)
            .wait(Duration::from_secs(5))
            .send()
            .await;
        let cut = std::time::SystemTime::now();
        c.restart_after_crash(point).await;
        resumed(point, &mut events).await;
        let admin = c.b.admin().await.unwrap();
        let deadline = admin
            .list_all_leases(Some("t"))
            .await
            .unwrap()
            .into_iter()
            .find(|l| l.lease_id == r.id())
            .and_then(|l| l.reclaim_deadline_unix_ms);
        if point == "before-keep:reclaim-asked" {
            // The request died with the broker: the lease comes back active.
            assert_eq!(deadline, None, "{point}");
            c.check(point, &[&keep, &r]).await;
            continue;
        }
        // The deadline asked before the crash, not a new one from the restart.
        let latest = cut + Duration::from_secs(3);
        let latest = latest
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64;
        let deadline = deadline.unwrap_or_else(|| panic!("{point}: the reclaim request is kept"));
        assert!(
            deadline <= latest,
            "{point}: deadline {deadline} after {latest}"
        );
        // At it, the lease is revoked (nobody waits for it any more: the request stands),
        // its memory quarantined while this process may map it.
        let revoked = eventually(Duration::from_secs(8), || async {
            let ids: Vec<String> = admin
                .list_all_leases(Some("t"))
                .await
                .unwrap()
                .into_iter()
                .map(|l| l.lease_id)
                .collect();
            let u = admin.get_quota("t").await.unwrap().usage;
            ids == [keep.id()] && u.held_bytes == SIZE && u.quarantined_bytes == 120 * MIB
        })
        .await;
        assert!(
            revoked,
            "{point}: revoked at its deadline\n{}",
            c.b.log_text()
        );
    }
}

#[tokio::test]
async fn drain_its_reclaim_deadline_and_quarantine() {
    if skipped() {
        return;
    }
    // A drain with a deadline asks the holder of a reclaimable lease to give it back; it
    // does not, so at the deadline the lease is revoked and, its process alive,
    // quarantined. The drain is kept: the device stays closed after the restart.
    for point in [
        "before-keep:drain",
        "after-keep:drain",
        "after:drain",
        "after:reclaim-revoke",
        "after:quarantine",
    ] {
        let mut c = Case::start(point, Where::Keeper).await;
        let s = c.session().await;
        let mut events = s.events();
        let keep = s.lease(SIZE).await.unwrap();
        let r = s
            .lease_request(SIZE)
            .reclaimable(true)
            .send()
            .await
            .unwrap();
        let admin = c.b.admin().await.unwrap();
        // Cut by the crash, or answered.
        let _ = admin
            .drain(Some(0), Some(Duration::from_millis(300)), "test")
            .await;
        c.restart_after_crash(point).await;
        resumed(point, &mut events).await;
        let revoked = matches!(point, "after:reclaim-revoke" | "after:quarantine");
        let held: Vec<&Lease> = if revoked {
            vec![&keep]
        } else {
            vec![&keep, &r]
        };
        c.check(point, &held).await;
        let admin = c.b.admin().await.unwrap();
        // The revoked lease's memory, quarantined while this process may map it, stays
        // counted to the tenant across the restart.
        let q = admin.get_quota("t").await.unwrap().usage.quarantined_bytes;
        assert_eq!(q, if revoked { SIZE } else { 0 }, "{point}");
        let drain = admin.drain_status().await.unwrap();
        let kept = point != "before-keep:drain";
        assert_eq!(drain.devices[0].draining, kept, "{point}: {drain:?}");
        if kept {
            assert_eq!(drain.devices[0].reason, "test", "{point}");
            let refused = s.lease_request(SIZE).device(0).send().await;
            assert_eq!(
                code_of(&refused),
                Some(Code::FailedPrecondition),
                "{point}: a drained device took a lease"
            );
            admin.undrain(Some(0)).await.unwrap();
        }
        s.lease(SIZE).await.expect("the device takes leases again");
    }
}

#[tokio::test]
async fn quarantine_lift() {
    if skipped() {
        return;
    }
    // A worker's lease is revoked while its process lives (quarantined), then the worker
    // dies and the quarantine is lifted.
    let point = "after:lift";
    let mut c = Case::start(point, Where::Keeper).await;
    let s = c.session().await;
    let mut events = s.events();
    let keep = s.lease(SIZE).await.unwrap();
    let mut w = Proc::spawn(fault_cmd(
        &c.b,
        &c.token,
        "hold",
        &["--count", "1", "--mib", "8"],
    ))
    .unwrap();
    let got = events_until(&mut w, "granted", Duration::from_secs(10)).await;
    let id = got.last().unwrap()["id"].as_str().unwrap().to_string();
    events_until(&mut w, "holding", Duration::from_secs(10)).await;
    let admin = c.b.admin().await.unwrap();
    admin.revoke_lease(&id, "test").await.unwrap();
    let dev = &admin.get_devices().await.unwrap()[0];
    assert_eq!(
        dev.quarantined_bytes, SIZE,
        "the revoked lease is quarantined"
    );
    w.kill().await.unwrap();
    c.restart_after_crash(point).await;
    resumed(point, &mut events).await;
    c.check(point, &[&keep]).await;
}

#[tokio::test]
async fn publish_import_and_release_import() {
    if skipped() {
        return;
    }
    shared(Where::Keeper).await
}

#[tokio::test]
async fn publish_import_and_release_import_in_the_fd_store() {
    if skipped() {
        return;
    }
    shared(Where::FdStore).await
}

/// A publication of a kept lease and the imports whose descriptor reached the worker are
/// kept: after the restart the name is still published (a new import reads the same
/// memory), the import the worker held is still its own (the publisher's released block
/// is held for it, counted to the tenant, until it lets go), and an import or release
/// the crash cut is neither lost nor doubled.
async fn shared(place: Where) {
    // (point, stage cut: 0 publish, 1 a second import, 2 that import's release)
    for (point, stage) in [
        ("before-keep:publication", 0),
        ("after-keep:publication", 0),
        ("after:publish", 0),
        ("before-keep:import#2", 1),
        ("after-keep:import#2", 1),
        ("after:import#2", 1),
        ("before-keep:import-ended", 2),
        ("after-keep:import-ended", 2),
        ("after:release-import", 2),
    ] {
        let mut c = Case::start(point, place).await;
        let s = c.session().await;
        let mut events = s.events();
        let p = s.lease(SIZE).await.unwrap();
        p.map().unwrap().as_mut_slice()[0] = 7;
        let held = if stage == 0 {
            // Cut by the crash (its answer is lost, not its effect).
            let _ = p.publish("shared", &[]).await;
            None
        } else {
            p.publish("shared", &[]).await.unwrap();
            Some(s.import("t", "shared").await.unwrap())
        };
        let call = (stage > 0).then(|| {
            let s = s.clone();
            tokio::spawn(async move {
                let i = s.import("t", "shared").await?;
                if stage == 2 {
                    i.release().await?;
                } else {
                    i.detach();
                }
                Ok::<_, gpu_broker_client::ClientError>(())
            })
        });
        c.restart_after_crash(point).await;
        resumed(point, &mut events).await;
        let call = match call {
            Some(call) => Some(call.await.unwrap()),
            None => None,
        };
        let published = point != "before-keep:publication";
        match stage {
            // The descriptor never reached the worker: the import is not its own.
            1 => assert!(call.unwrap().is_err(), "{point}: the import was cut"),
            // The release waited out the restart and went through.
            2 => call.unwrap().expect("the release across the crash"),
            _ => {}
        }
        c.check_with(point, &[&p], u64::from(published)).await;
        let admin = c.b.admin().await.unwrap();
        let listed = admin.list_shared(Some("t")).await.unwrap();
        let want_imports: Vec<String> = held.iter().map(|i| i.id().to_string()).collect();
        if published {
            assert_eq!(listed.len(), 1, "{point}: {listed:?}");
            assert_eq!(listed[0].name, "shared", "{point}");
            let imports: Vec<String> = listed[0]
                .imports
                .iter()
                .map(|i| i.import_id.clone())
                .collect();
            assert_eq!(
                imports, want_imports,
                "{point}: the worker's imports, no other"
            );
            // A new importer finds the name and the same memory.
            let again = s.import("t", "shared").await.expect("imported again");
            assert_eq!(again.map().unwrap()[0], 7, "{point}");
            again.release().await.unwrap();
        } else {
            assert!(listed.is_empty(), "{point}: {listed:?}");
            assert!(s.import("t", "shared").await.is_err(), "{point}");
        }
        // The publisher lets go: the block is held for the import that outlived the
        // restart, counted to the tenant, until it lets go too.
        p.release().await.unwrap();
        let quarantined = || async {
            c.b.admin()
                .await
                .unwrap()
                .get_quota("t")
                .await
                .unwrap()
                .usage
                .quarantined_bytes
        };
        if let Some(i) = held {
            assert_eq!(quarantined().await, SIZE, "{point}: held for the importer");
            i.release().await.unwrap();
        }
        // The fake fd store lives in this process, which is also the importer: a free
        // that overtakes its removal of the block finds this process holding the sealed
        // memfd, and charges it until this process exits (no real systemd does).
        if matches!(place, Where::Keeper) {
            assert!(
                eventually(Duration::from_secs(5), || async {
                    quarantined().await == 0
                })
                .await,
                "{point}: nothing held once every importer let go"
            );
        }
        // The publisher's block, once released, is never handed out sealed read-only.
        let again = s.lease(SIZE).await.unwrap();
        let mut m = again.map().expect("a writable mapping of the next lease");
        m.as_mut_slice()[0] = 1;
    }
}

#[tokio::test]
async fn process_reservation_and_its_release() {
    if skipped() {
        return;
    }
    // A session's process reservation is kept with its session: after the restart it
    // holds the same room (what a lease of its process drew from it stays drawn, and goes
    // back into it when released), or is gone if its end was kept.
    for (point, release) in [
        ("before-keep:reservation", false),
        ("after-keep:reservation", false),
        ("after:reserve", false),
        ("before-keep:reservation-ended", true),
        ("after-keep:reservation-ended", true),
        ("after:release-reservation", true),
    ] {
        let mut c = Case::start(point, Where::Keeper).await;
        let s = c.session().await;
        let mut events = s.events();
        let keep = s.lease(SIZE).await.unwrap();
        let mut granted = None;
        let mut drawn = None;
        let call = if release {
            let r = gpu_broker_client::ReservationRequest::new(&s, 3 * SIZE)
                .send()
                .await
                .unwrap();
            granted = Some(r.info().reservation_id.clone());
            // This process's own lease: drawn from its reservation.
            drawn = Some(s.lease(SIZE).await.unwrap());
            tokio::spawn(async move { r.release().await.map(drop) })
        } else {
            let s = s.clone();
            tokio::spawn(async move {
                gpu_broker_client::ReservationRequest::new(&s, 3 * SIZE)
                    .send()
                    .await
                    .map(drop)
            })
        };
        c.restart_after_crash(point).await;
        resumed(point, &mut events).await;
        // Cut by the crash, or answered: what counts is the books after.
        let _ = call.await.unwrap();
        let kept = matches!(
            point,
            "after-keep:reservation" | "after:reserve" | "before-keep:reservation-ended"
        );
        let mut held = vec![&keep];
        held.extend(drawn.as_ref());
        c.check(point, &held).await;
        let room = 3 * SIZE - drawn.as_ref().map_or(0, |d| d.bytes());
        let reserved = || async {
            let admin = c.b.admin().await.unwrap();
            let dev = admin.get_devices().await.unwrap()[0].process_reserved_bytes;
            let t = admin
                .get_quota("t")
                .await
                .unwrap()
                .usage
                .process_reserved_bytes;
            (dev, t)
        };
        let want = if kept { room } else { 0 };
        assert_eq!(reserved().await, (want, want), "{point}");
        let again = gpu_broker_client::ReservationRequest::new(&s, SIZE)
            .send()
            .await;
        if kept {
            // The same reservation: a second one is refused, naming it.
            let e = again.expect_err("one reservation per session");
            let named = e
                .refusal()
                .and_then(|r| r.metadata.get("reservation_id").cloned());
            assert!(named.is_some(), "{point}: {e}");
            if let Some(id) = &granted {
                assert_eq!(named.as_ref(), Some(id), "{point}: same id");
            }
        } else {
            let r = again.expect("the session may reserve again");
            r.release().await.unwrap();
        }
        if let Some(d) = drawn {
            // Its bytes go back into the room of a reservation taken back.
            d.release().await.unwrap();
            let want = if kept { 3 * SIZE } else { 0 };
            assert_eq!(reserved().await, (want, want), "{point}: drawn bytes back");
        }
        c.check(point, &[&keep]).await;
    }
}

#[tokio::test]
async fn publisher_ends_while_imported_and_importer_session_ends_while_its_process_lives() {
    if skipped() {
        return;
    }
    held_and_lingering(Where::Keeper).await
}

#[tokio::test]
async fn publisher_ends_while_imported_and_importer_session_ends_while_its_process_lives_in_the_fd_store(
) {
    if skipped() {
        return;
    }
    held_and_lingering(Where::FdStore).await
}

/// The publisher's lease ends while others import it (its block is held for them,
/// counted to the publisher), and an importer's session ends while its process lives (its
/// import lingers): a crash at each step keeps both. After the restart the publisher's
/// tenant is charged the held block exactly, the descriptors agree, the importers' memory
/// is as it was; an importer that died during the outage (stage 2) is let go at the
/// restart; the block goes, uncharged, only once the last importer let go.
/// Tenant `t`'s quarantined bytes (blocks held for importers among them).
async fn quarantined_of(b: &Broker) -> u64 {
    let admin = b.admin().await.unwrap();
    admin.get_quota("t").await.unwrap().usage.quarantined_bytes
}

/// How many imports tenant `t`'s publication has (0 without one).
async fn imports_of(b: &Broker) -> usize {
    let admin = b.admin().await.unwrap();
    let l = admin.list_shared(Some("t")).await.unwrap();
    l.first().map(|p| p.imports.len()).unwrap_or(0)
}

async fn held_and_lingering(place: Where) {
    // (point, stage cut: 1 the publisher's release, 2 the importer's session end, its
    // process killed during the outage, 3 the same, its process alive after the restart)
    for (point, stage) in [
        ("before-keep:held", 1),
        ("after-keep:held", 1),
        ("after-keep:lease-ended", 1),
        ("after-keep:publication-ended", 1),
        ("before-keep:lingering", 2),
        ("after-keep:lingering", 2),
        ("after-keep:import-ended", 2),
        ("after-keep:session-ended", 2),
        ("before-keep:lingering", 3),
        ("after-keep:lingering", 3),
        ("after-keep:import-ended", 3),
        ("after-keep:session-ended", 3),
    ] {
        let mut c = Case::start(point, place).await;
        let s = c.session().await;
        let mut events = s.events();
        let keep = s.lease(SIZE).await.unwrap();
        let p = s.lease(SIZE).await.unwrap();
        p.map().unwrap().as_mut_slice()[0] = 7;
        p.publish("shared", &[]).await.unwrap();
        // This process's import, and another process's.
        let mine = s.import("t", "shared").await.unwrap();
        let mut w = Proc::spawn(fault_cmd(
            &c.b,
            &c.token,
            "import",
            &["--publisher", "t", "--name", "shared"],
        ))
        .unwrap();
        let got = events_until(&mut w, "imported", Duration::from_secs(10)).await;
        assert_eq!(got.last().unwrap()["byte"], 7, "{point}");
        if stage == 1 {
            let release = tokio::spawn(async move { p.release().await });
            c.restart_after_crash(point).await;
            resumed(point, &mut events).await;
            release
                .await
                .unwrap()
                .expect("the release across the crash");
        } else {
            p.release().await.unwrap();
            assert_eq!(
                quarantined_of(&c.b).await,
                SIZE,
                "{point}: held for the importers"
            );
            w.send("close").await.unwrap();
            events_until(&mut w, "session-closed", Duration::from_secs(10)).await;
            c.crashed(point).await;
            if stage == 2 {
                // The importer dies during the outage: its import is let go at the restart.
                w.kill().await.unwrap();
            }
            c.b.kill().unwrap();
            c.b.spawn().unwrap();
            resumed(point, &mut events).await;
        }
        // Held for the importers, counted to the publisher: one block more in the keeper
        // and in the broker, with its publication's read-only reopen.
        // Stage 3's importer lives: its import lingers (kept, or its session was kept and
        // nobody resumes it).
        let want_imports = if stage == 2 { 1 } else { 2 };
        assert!(
            eventually(Duration::from_secs(8), || async {
                imports_of(&c.b).await == want_imports
            })
            .await,
            "{point}: {} imports listed, want {want_imports}\n{}",
            imports_of(&c.b).await,
            c.b.log_text()
        );
        c.check_with(point, &[&keep], 1).await;
        assert_eq!(
            quarantined_of(&c.b).await,
            SIZE,
            "{point}: held, counted once"
        );
        assert_eq!(
            mine.map().unwrap()[0],
            7,
            "{point}: the import maps the same memory"
        );
        if stage != 2 {
            // The other importer dies: its import (lingering once its session ended or was
            // not resumed) ends; this process's still holds the block.
            w.kill().await.unwrap();
            assert!(
                eventually(Duration::from_secs(8), || async {
                    imports_of(&c.b).await == 1
                })
                .await,
                "{point}: the dead importer's import ends"
            );
            assert_eq!(
                quarantined_of(&c.b).await,
                SIZE,
                "{point}: still held for mine"
            );
        }
        mine.release().await.unwrap();
        if matches!(place, Where::Keeper) {
            // (The fake fd store lives in this process: see `shared`.)
            assert!(
                eventually(Duration::from_secs(5), || async {
                    quarantined_of(&c.b).await == 0
                })
                .await,
                "{point}: let go once every importer did\n{}",
                c.b.log_text()
            );
            c.check(point, &[&keep]).await;
        }
    }
}

#[tokio::test]
async fn a_recipient_fetches_and_the_lease_ends_while_it_maps_it() {
    if skipped() {
        return;
    }
    recipient(Where::Keeper).await
}

#[tokio::test]
async fn a_recipient_fetches_and_the_lease_ends_while_it_maps_it_in_the_fd_store() {
    if skipped() {
        return;
    }
    recipient(Where::FdStore).await
}

/// A process outside the lease's session fetches its descriptor with a renewed ticket
/// (`e2e-worker read --hold`) and maps it; a crash where the lease's record comes to name
/// it (before the descriptor leaves: the fetch fails, the process exits) or at each step
/// of the lease's release while it maps the memory. After the restart the books agree;
/// memory a live recipient maps is held, charged to the tenant, and goes (uncharged, out
/// of the keeper) once it exits.
async fn recipient(place: Where) {
    for point in [
        "after-keep:lease#2",
        "before-keep:held",
        "after-keep:held",
        "after-keep:lease-ended",
    ] {
        let mut c = Case::start(point, place).await;
        let s = c.session().await;
        let mut events = s.events();
        let l = s.lease(SIZE).await.unwrap();
        let id = l.id().to_string();
        let mut child = Proc::spawn(worker_cmd(
            &c.b,
            &c.token,
            &["read", "--lease", &id, "--hold"],
        ))
        .unwrap();
        let fetch_cut = point == "after-keep:lease#2";
        if fetch_cut {
            c.restart_after_crash(point).await;
            resumed(point, &mut events).await;
            let _ = child.wait(Duration::from_secs(10)).await;
            l.release().await.unwrap();
        } else {
            child
                .line_starting("SUM ", Duration::from_secs(10))
                .await
                .unwrap();
            let release = tokio::spawn(async move { l.release().await });
            c.restart_after_crash(point).await;
            resumed(point, &mut events).await;
            release
                .await
                .unwrap()
                .expect("the release across the crash");
            assert!(
                eventually(Duration::from_secs(8), || async {
                    quarantined_of(&c.b).await == SIZE
                })
                .await,
                "{point}: held for the recipient\n{}",
                c.b.log_text()
            );
            c.check(point, &[]).await;
            child.signal(libc::SIGKILL);
            let _ = child.wait(Duration::from_secs(10)).await;
        }
        assert!(
            eventually(Duration::from_secs(8), || async {
                quarantined_of(&c.b).await == 0
            })
            .await,
            "{point}: let go once the recipient exited\n{}",
            c.b.log_text()
        );
        c.check(point, &[]).await;
    }
}
