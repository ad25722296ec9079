//! A broker run as a systemd unit with a file-descriptor store (a fake manager,
//! `tests/support/systemd.rs`: `$NOTIFY_SOCKET`, `$FDSTORE`, the store handed back at
//! descriptors 3.. with `LISTEN_FDS`/`LISTEN_FDNAMES`/`LISTEN_PID`) keeps its leases there
//! with no keeper: after a SIGKILL the live worker's leases come back with the same ids,
//! bytes, tenant and memory, quotas exact; a lease released before the kill left the store
//! (`FDSTOREREMOVE=1`), and so did a dead worker's after the restart.

use super::*;
use futures::StreamExt;
use gpu_broker_client::{Backoff, Client, SessionEvent};

async fn held_bytes(b: &Broker, tenant: &str) -> (u64, u32) {
    let t = b.admin().await.unwrap().get_quota(tenant).await.unwrap();
    (t.usage.held_bytes, t.usage.lease_count)
}

async fn lease_ids(b: &Broker) -> Vec<String> {
    let mut ids: Vec<String> = b
        .admin()
        .await
        .unwrap()
        .list_all_leases(None)
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.lease_id)
        .collect();
    ids.sort();
    ids
}

fn lease_names(sd: &FakeSystemd) -> Vec<String> {
    let mut n: Vec<String> = sd
        .names()
        .into_iter()
        .filter(|n| n.starts_with("lease/"))
        .collect();
    n.sort();
    n
}

fn removed(sd: &FakeSystemd, name: &str) -> bool {
    sd.messages()
        .iter()
        .any(|m| m.contains("FDSTOREREMOVE=1") && m.contains(&format!("FDNAME={name}\n")))
}

#[tokio::test]
async fn leases_wait_in_the_fd_store_across_a_broker_sigkill() {
    let sd = FakeSystemd::start(64).unwrap();
    let mut b = Broker::start_under(
        sd.clone(),
        BrokerOpts {
            capacity: "256MiB",
            ..BrokerOpts::default()
        },
    )
    .unwrap();
    let token = b.tenant("alpha", QuotaSpec::new(64 * MIB)).await.unwrap();
    let client = Client::connect(&b.uri(), token).await.unwrap();
    let session = client
        .session_builder("w")
        .reconnect(Backoff::new(
            Duration::from_millis(20),
            Duration::from_millis(200),
        ))
        .await
        .unwrap();
    let mut events = session.events();
    let a = session.lease(8 * MIB).await.unwrap();
    let c = session.lease(4 * MIB).await.unwrap();
    let gone = session.lease(2 * MIB).await.unwrap();
    let gone_id = gone.id().to_string();
    gone.release().await.unwrap();
    let mut mapping = a.map().unwrap();
    mapping.as_mut_slice()[..5].copy_from_slice(b"hello");
    let before = lease_ids(&b).await;
    assert_eq!(held_bytes(&b, "alpha").await, (12 * MIB, 2));
    let mut want = vec![format!("lease/{}", a.id()), format!("lease/{}", c.id())];
    want.sort();
    assert_eq!(lease_names(&sd), want, "{}", b.log_text());
    assert_eq!(sd.memfds(), 2, "the store holds each live lease's memory");
    assert!(
        removed(&sd, &format!("lease/{gone_id}")),
        "a released lease leaves the store: {:?}",
        sd.messages()
    );
    assert!(
        sd.names().iter().any(|n| n.starts_with("records-")),
        "the records are in the store: {:?}",
        sd.names()
    );

    b.kill().unwrap();
    b.spawn().unwrap();
    let resumed = tokio::time::timeout(Duration::from_secs(15), async {
        while let Some(e) = events.next().await {
            if matches!(
                e,
                SessionEvent::Resumed { .. } | SessionEvent::Reconnected { .. }
            ) {
                return e;
            }
        }
        panic!("the session closed")
    })
    .await
    .expect("resumed within 15 s");
    let SessionEvent::Resumed {
        mut kept_leases,
        lost_leases,
        ..
    } = resumed
    else {
        panic!("expected Resumed, got {resumed:?}\n{}", b.log_text())
    };
    kept_leases.sort();
    let mut mine = vec![a.id().to_string(), c.id().to_string()];
    mine.sort();
    assert_eq!(kept_leases, mine);
    assert!(lost_leases.is_empty());

    // Same ids, bytes and tenant; the released lease is not back; the memory is the same.
    assert_eq!(lease_ids(&b).await, before);
    assert_eq!(held_bytes(&b, "alpha").await, (12 * MIB, 2));
    let leases = b
        .admin()
        .await
        .unwrap()
        .list_all_leases(None)
        .await
        .unwrap();
    assert!(leases.iter().all(|l| l.tenant == "alpha"), "{leases:?}");
    mapping.as_mut_slice()[5..8].copy_from_slice(b"!!!");
    drop(mapping);
    let again = a.map().unwrap();
    assert_eq!(&again.as_slice()[..8], b"hello!!!");
    drop(again);
    assert_eq!(
        b.memfds().len(),
        2,
        "the broker holds the adopted blocks, and no cached one"
    );
    let status = b.ctl().arg("status").output().unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        text.contains("took back 2 leases (12.0 MiB) of 1 sessions, reclaimed 0 leases"),
        "{text}"
    );
    let log = b.log_text();
    assert!(log.contains("place=systemd's fd store"), "{log}");

    // The quota is enforced over them; a release takes a lease out of the store.
    let over = session.lease(56 * MIB).await;
    assert_eq!(code_of(&over), Some(Code::ResourceExhausted), "{over:?}");
    a.release().await.unwrap();
    assert_eq!(held_bytes(&b, "alpha").await, (4 * MIB, 1));
    assert_eq!(lease_names(&sd), [format!("lease/{}", c.id())]);
    // Released before the session closes: a lease still held when its session ends with
    // its process alive is quarantined (and kept in the store as such).
    c.release().await.unwrap();
    session.close();
    drop(session);
    assert!(
        eventually(Duration::from_secs(5), || async {
            held_bytes(&b, "alpha").await == (0, 0)
        })
        .await
    );
    assert!(
        eventually(Duration::from_secs(5), || async { sd.memfds() == 0 }).await,
        "the store let go of every released block: {:?}",
        sd.names()
    );
    // Exactly one journal generation is left in the store.
    assert_eq!(sd.names().len(), 1, "{:?}", sd.names());
}

#[tokio::test]
async fn a_dead_workers_leases_leave_the_fd_store_at_the_restart() {
    let sd = FakeSystemd::start(64).unwrap();
    let mut b = Broker::start_under(
        sd.clone(),
        BrokerOpts {
            capacity: "256MiB",
            ..BrokerOpts::default()
        },
    )
    .unwrap();
    let token = b.tenant("beta", QuotaSpec::new(64 * MIB)).await.unwrap();
    let mut w = Proc::spawn(fault_cmd(
        &b,
        &token,
        "hold",
        &["--count", "2", "--mib", "8"],
    ))
    .unwrap();
    events_until(&mut w, "holding", Duration::from_secs(10)).await;
    assert_eq!(held_bytes(&b, "beta").await, (16 * MIB, 2));
    let held = lease_names(&sd);
    assert_eq!(held.len(), 2);
    b.kill().unwrap();
    w.kill().await.unwrap();
    b.spawn().unwrap();
    assert_eq!(held_bytes(&b, "beta").await, (0, 0));
    assert!(lease_ids(&b).await.is_empty());
    assert!(b.memfds().is_empty(), "no block left without an owner");
    assert!(lease_names(&sd).is_empty(), "{:?}", sd.names());
    assert_eq!(sd.memfds(), 0);
    for name in held {
        assert!(removed(&sd, &name), "{name}");
    }
    assert!(b.log_text().contains("leases_reclaimed=2"));
}

/// `--keep-in none` under a manager with a store: nothing is stored, a restart ends the
/// session, and what a previous broker left in the store is let go.
#[tokio::test]
async fn keep_in_none_stores_nothing_and_lets_go_of_what_was_stored() {
    let sd = FakeSystemd::start(64).unwrap();
    let mut b = Broker::start_under(
        sd.clone(),
        BrokerOpts {
            capacity: "256MiB",
            ..BrokerOpts::default()
        },
    )
    .unwrap();
    let client = b.client("gamma", 64 * MIB).await.unwrap();
    let session = client.session("w").await.unwrap();
    let _a = session.lease(4 * MIB).await.unwrap();
    assert_eq!(sd.memfds(), 1);
    b.kill().unwrap();
    b.args_mut().extend(["--keep-in".into(), "none".into()]);
    b.spawn().unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async { sd.memfds() == 0 }).await,
        "{:?}",
        sd.names()
    );
    assert!(sd.names().is_empty(), "{:?}", sd.names());
    assert_eq!(held_bytes(&b, "gamma").await, (0, 0));
    let client = b.client("delta", 64 * MIB).await.unwrap();
    let session = client.session("w").await.unwrap();
    let _b = session.lease(4 * MIB).await.unwrap();
    assert_eq!(b.memfds().len(), 1);
    assert_eq!(sd.memfds(), 0, "nothing stored with --keep-in none");
}

/// `SIGTERM` (`systemctl restart`, `systemctl stop`) ends nothing: the next start takes
/// the session and its lease back from the store.
#[tokio::test]
async fn sigterm_leaves_the_leases_in_the_fd_store() {
    let sd = FakeSystemd::start(64).unwrap();
    let mut b = Broker::start_under(
        sd.clone(),
        BrokerOpts {
            capacity: "256MiB",
            ..BrokerOpts::default()
        },
    )
    .unwrap();
    let token = b.tenant("eps", QuotaSpec::new(64 * MIB)).await.unwrap();
    let client = Client::connect(&b.uri(), token).await.unwrap();
    let session = client
        .session_builder("w")
        .reconnect(Backoff::new(
            Duration::from_millis(20),
            Duration::from_millis(200),
        ))
        .await
        .unwrap();
    let a = session.lease(4 * MIB).await.unwrap();
    let status = b.stop(Duration::from_secs(5)).unwrap();
    assert!(status.success(), "{status:?}");
    assert_eq!(sd.memfds(), 1, "{:?}", sd.names());
    b.spawn().unwrap();
    assert_eq!(held_bytes(&b, "eps").await, (4 * MIB, 1));
    assert_eq!(lease_ids(&b).await, [a.id().to_string()]);
}

/// `--keep-in fdstore` outside systemd (no notify socket) stops the broker at start with
/// why, before it serves anything; `--keep-in keeper` without a keeper too.
#[test]
fn a_forced_place_that_is_not_there_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("b.sock");
    for (place, why) in [
        ("fdstore", "needs systemd's notify socket"),
        ("keeper", "needs --keeper PATH"),
    ] {
        let out = Command::new(bin("gpu-broker"))
            .args(["--backend", "host", "--socket"])
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(["--keep-in", place])
            .env_remove("NOTIFY_SOCKET")
            .env_remove("GPU_BROKER_KEEPER")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{place}: {err}");
        assert!(err.contains(why), "{place}: {err}");
        assert!(!socket.exists(), "it served nothing");
    }
}

/// The same with no keeper: the charge of memory a worker keeps after its free is kept in
/// the fd store's records across a SIGKILL, and leaves them once the worker exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_kept_after_its_free_stays_charged_across_a_sigkill_with_the_fd_store() {
    let sd = FakeSystemd::start(64).unwrap();
    let mut b = Broker::start_under(
        sd.clone(),
        BrokerOpts {
            capacity: "256MiB",
            extra: vec!["--metrics-listen".into(), "127.0.0.1:0".into()],
            ..BrokerOpts::default()
        },
    )
    .unwrap();
    super::keeper::stranded_charge_survives_a_sigkill(&mut b).await;
}
