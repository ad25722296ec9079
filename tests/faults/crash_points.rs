//! The crash-point matrix: a broker with a keeper (and again with systemd's fd store, a
//! fake manager of `tests/support/systemd.rs`) is SIGKILLed at each step of each
//! state-changing operation whose order matters for a restart (before and after each
//! write to the keeper: `GPU_BROKER_CRASH_AT`, `broker/src/crash_point.rs`), restarted,
//! and then the books must agree everywhere: the leases the live worker holds are exactly
//! the broker's (same ids), its tenant's held bytes are their sum, the keeper holds one
//! descriptor per lease and the broker one per lease, cached or quarantined block, and
//! what nobody holds is gone. Operations: acquire (fresh and from the cache), release, revoke,
//! session open and end. Not covered (kept by nobody across a restart, see
//! docs/operations.md): quarantine and its lift, publish/import, process reservations,
//! drain, reclaim requests.

use super::*;
use futures::StreamExt;
use gpu_broker_client::{Backoff, Client, Lease, Session, SessionEvent};

const SIZE: u64 = 8 * MIB;

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
        let opts = BrokerOpts {
            capacity: "256MiB",
            extra: vec!["--keepalive-timeout".into(), "2s".into()],
            ..BrokerOpts::default()
        };
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
        let token = b.tenant("t", QuotaSpec::new(128 * MIB)).await.unwrap();
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

    /// Waits for the broker to die at its crash point, then starts it again (unarmed).
    async fn restart_after_crash(&mut self, point: &str) {
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
        self.b.kill().unwrap();
        self.b.spawn().unwrap();
    }

    /// Everything agrees with the worker holding exactly `held`.
    async fn check(&self, point: &str, held: &[&Lease]) {
        let mut want: Vec<String> = held.iter().map(|l| l.id().to_string()).collect();
        want.sort();
        let bytes: u64 = held.iter().map(|l| l.bytes()).sum();
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
            let kept = self.keeper.memfds();
            let own = self.b.memfds().len() as u64;
            let ok = ids == want
                && u.held_bytes == bytes
                && u.lease_count as usize == want.len()
                && kept == want.len()
                && own == want.len() as u64 + cached;
            let last = format!(
                "leases {ids:?} (want {want:?}), held {} in {} (want {bytes}), keeper {kept}, broker {own} with {cached} cached or quarantined",
                u.held_bytes, u.lease_count
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
    acquire(Where::Keeper).await
}

#[tokio::test]
async fn acquire_fresh_and_from_the_cache_in_the_fd_store() {
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

#[tokio::test]
async fn release_and_revoke() {
    release(Where::Keeper).await
}

#[tokio::test]
async fn release_and_revoke_in_the_fd_store() {
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
            let mut held = vec![&keep];
            match (&a, point.starts_with("after")) {
                // The revocation reached the keeper, not the worker: it learns it now.
                (Some(_), true) => assert_eq!(lost_leases, std::slice::from_ref(&a_id), "{point}"),
                // The revocation died with the broker: the lease is still held.
                (Some(a), false) => {
                    assert!(lost_leases.is_empty(), "{point}: {e:?}");
                    held.push(a);
                }
                (None, _) => assert!(lost_leases.is_empty(), "{point}: {e:?}"),
            }
            c.check(&format!("{point} revoke={revoke}"), &held).await;
        }
    }
}

#[tokio::test]
async fn session_open_and_end() {
    session_start_end(Where::Keeper).await
}

#[tokio::test]
async fn session_open_and_end_in_the_fd_store() {
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
