//! Quota enforcement under concurrency: 64 racing AcquireLease calls of one tenant.

use gpu_broker_client::QuotaSpec;
use gpu_broker_client::{Client, ClientError, Code, Session};
use gpu_broker_tests::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const LIMIT: u64 = 32 * MIB;

/// Fires 64 concurrent 2 MiB requests over 4 connections and 8 sessions; returns the
/// granted leases and the errors.
async fn burst(sessions: &[Session]) -> (Vec<gpu_broker_client::Lease>, Vec<ClientError>) {
    let start = Arc::new(tokio::sync::Barrier::new(64));
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let s = sessions[i % sessions.len()].clone();
            let start = start.clone();
            tokio::spawn(async move {
                start.wait().await;
                s.lease_request(2 * MIB)
                    .label(format!("burst-{i}"))
                    .send()
                    .await
            })
        })
        .collect();
    let mut ok = Vec::new();
    let mut err = Vec::new();
    for t in tasks {
        match tokio::time::timeout(Duration::from_secs(10), t)
            .await
            .expect("request finished")
            .unwrap()
        {
            Ok(l) => ok.push(l),
            Err(e) => err.push(e),
        }
    }
    (ok, err)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_is_exact_under_64_concurrent_requests() {
    let b = Broker::start().unwrap();
    let token = b.tenant("racer", QuotaSpec::new(LIMIT)).await.unwrap();
    let admin = b.admin().await.unwrap();
    let mut sessions = Vec::new();
    for c in 0..4 {
        let client = Client::connect(&b.uri(), token.clone()).await.unwrap();
        for s in 0..2 {
            sessions.push(client.session(format!("racer-{c}-{s}")).await.unwrap());
        }
    }

    // Watch usage while the requests race: it must never pass the limit.
    let stop = Arc::new(AtomicBool::new(false));
    let max_seen = Arc::new(AtomicU64::new(0));
    let watcher = {
        let (stop, max_seen, admin) = (stop.clone(), max_seen.clone(), admin.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                if let Ok(t) = admin.get_quota("racer").await {
                    max_seen.fetch_max(t.usage.held_bytes, Ordering::SeqCst);
                }
                if let Ok(d) = admin.get_devices().await {
                    max_seen.fetch_max(d[0].leased_bytes, Ordering::SeqCst);
                }
            }
        })
    };

    for round in 0..2 {
        // Round 0 allocates fresh blocks; round 1 races for the cached ones.
        let (ok, err) = burst(&sessions).await;
        assert_eq!(ok.len(), 16, "round {round}: granted {}", ok.len());
        assert_eq!(err.len(), 48, "round {round}");
        for e in &err {
            assert_eq!(e.code(), Code::ResourceExhausted, "round {round}: {e}");
            assert!(e.message().contains("racer"), "{e}");
        }
        let usage = sessions[0].usage().await.unwrap();
        assert_eq!(usage.usage.held_bytes, LIMIT, "round {round}");
        assert_eq!(usage.usage.lease_count, 16);
        assert_eq!(usage.usage.waiting_requests, 0);
        let all = admin.list_all_leases(Some("racer")).await.unwrap();
        assert_eq!(all.len(), 16);
        assert_eq!(all.iter().map(|l| l.bytes).sum::<u64>(), LIMIT);
        let mut ids: Vec<&str> = all.iter().map(|l| l.lease_id.as_str()).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 16, "lease ids are unique");
        let dev = &admin.get_devices().await.unwrap()[0];
        assert_eq!(dev.leased_bytes, LIMIT);
        assert_eq!(dev.lease_count, 16);
        for l in ok {
            l.release().await.unwrap();
        }
        let usage = sessions[0].usage().await.unwrap();
        assert_eq!(usage.usage.held_bytes, 0);
        let dev = &admin.get_devices().await.unwrap()[0];
        assert_eq!(dev.leased_bytes, 0);
        assert_eq!(dev.cached_bytes, LIMIT, "released blocks are cached");
    }
    stop.store(true, Ordering::SeqCst);
    watcher.await.unwrap();
    let max = max_seen.load(Ordering::SeqCst);
    assert!(max <= LIMIT, "usage reached {max} > limit {LIMIT}");
    assert!(max > 0, "the watcher saw the leases");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_leases_is_exact_under_concurrency() {
    let b = Broker::start().unwrap();
    let token = b
        .tenant(
            "counted",
            QuotaSpec {
                limit_bytes: 512 * MIB,
                max_leases: 5,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let client = Client::connect(&b.uri(), token).await.unwrap();
    let sessions = vec![
        client.session("a").await.unwrap(),
        client.session("b").await.unwrap(),
    ];
    let (ok, err) = burst(&sessions).await;
    assert_eq!(ok.len(), 5);
    assert_eq!(err.len(), 59);
    for e in &err {
        assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    }
    assert_eq!(sessions[0].usage().await.unwrap().usage.lease_count, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accounting_is_exact_after_churn_and_crashes() {
    let b = Broker::start_with(BrokerOpts {
        capacity: "128MiB",
        ..Default::default()
    })
    .unwrap();
    let admin = b.admin().await.unwrap();
    let ta = b.tenant("a", QuotaSpec::new(64 * MIB)).await.unwrap();
    let tb = b.tenant("b", QuotaSpec::new(96 * MIB)).await.unwrap();

    // Worker processes holding memory, to be killed in the middle of the churn.
    let mut workers = Vec::new();
    for (i, t) in [&ta, &tb, &ta, &tb].into_iter().enumerate() {
        let size = format!("{}MiB", 2 * (i + 1));
        workers.push(
            hold(&b, t, &["--bytes", &size, "--count", "2"])
                .await
                .unwrap(),
        );
    }
    // In-process churn: acquire (some waiting), write, release, across two tenants.
    let mut tasks = Vec::new();
    for (i, t) in [&ta, &tb, &ta, &tb, &ta, &tb].into_iter().enumerate() {
        let c = Client::connect(&b.uri(), t.clone()).await.unwrap();
        tasks.push(tokio::spawn(async move {
            let s = c.session(format!("churn-{i}")).await.unwrap();
            for round in 0..15u64 {
                let bytes = (1 + (round + i as u64) % 5) * 2 * MIB;
                let r = s
                    .lease_request(bytes)
                    .wait(Duration::from_millis(20 * (round % 3)))
                    .send()
                    .await;
                match r {
                    Ok(l) => {
                        l.map().unwrap().fill(round as u8);
                        l.release().await.unwrap();
                    }
                    Err(e) => assert!(
                        matches!(e.code(), Code::ResourceExhausted | Code::DeadlineExceeded),
                        "{e}"
                    ),
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    for w in &workers {
        w.proc.signal(libc::SIGKILL);
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(20), t)
            .await
            .unwrap()
            .unwrap();
    }
    for w in &mut workers {
        w.proc.kill().await.unwrap();
    }

    // Everything is back: nothing leased, quarantined or waiting; every cached byte is a
    // file on disk and every file is a cached block.
    assert!(
        eventually(Duration::from_secs(3), || async {
            let d = admin.get_devices().await.unwrap().remove(0);
            let sessions = admin.list_sessions(None).await.unwrap();
            d.leased_bytes == 0
                && d.quarantined_bytes == 0
                && d.lease_count == 0
                && sessions.is_empty()
        })
        .await,
        "{:?}",
        admin.get_devices().await
    );
    let d = admin.get_devices().await.unwrap().remove(0);
    assert_eq!(d.waiting_requests, 0);
    for t in admin.list_tenants().await.unwrap() {
        assert_eq!(t.usage, Default::default(), "{}", t.name);
    }
    let on_disk: u64 = b
        .memfds()
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    assert_eq!(on_disk, d.cached_bytes, "{:?}", b.memfds());
    assert_eq!(d.free_bytes, d.total_bytes - d.cached_bytes);
    assert!(d.cached_bytes <= d.leasable_bytes);
    assert!(admin.list_all_leases(None).await.unwrap().is_empty());
}
