//! Lingering imports at scale: the imports of a live process whose sessions ended share
//! one watcher (one pidfd, one task) with everything else that waits on that process, the
//! per-tenant cap counts them, and the session index answers what a scan of every import
//! would.

use super::tests::{live_process, quota, req};
use super::*;
use crate::error::BrokerError;

const MIB: u64 = 1 << 20;

/// How many pidfds this process holds on process `pid` (a pidfd's `fdinfo` names it).
fn pidfds_on(pid: u32) -> usize {
    let want = format!("Pid:\t{pid}");
    std::fs::read_dir("/proc/self/fdinfo")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| std::fs::read_to_string(e.path()).is_ok_and(|s| s.lines().any(|l| l == want)))
        .count()
}

/// `tenant` publishes `n` leases of 2 MiB, named `w0`, `w1`, ..., for `readers`.
async fn publish(arb: &Arc<Arbiter>, tenant: &str, n: usize, readers: &[String]) -> Vec<String> {
    let (s, rx) = arb
        .open_session(tenant, "publisher", Peer::default())
        .unwrap();
    std::mem::forget(rx);
    let mut names = Vec::new();
    for k in 0..n {
        let l = arb.acquire(req(tenant, s, 2 * MIB)).await.unwrap();
        let name = format!("w{k}");
        arb.sharing().publish(tenant, l.id, &name, readers).unwrap();
        names.push(name);
    }
    names
}

/// Imports of `tenant`, (live, lingering).
fn imports_of(arb: &Arbiter, tenant: &str) -> (usize, usize) {
    let st = arb.lock();
    let all: Vec<&crate::sharing::Import> = st
        .shared()
        .pubs
        .values()
        .flat_map(|p| p.imports.values())
        .filter(|i| i.tenant == tenant)
        .collect();
    let lingering = all.iter().filter(|i| i.lingering.is_some()).count();
    (all.len() - lingering, lingering)
}

/// Waits (up to 5 s) for `done`.
async fn until(mut done: impl FnMut() -> bool) {
    for _ in 0..500 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sessions of one live process import the same publications many times, then end while
/// the process lives: the imports linger for it, all on one watcher (one pidfd), and they
/// all end when it exits. A watcher per import let one process hold thousands of the
/// broker's descriptors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lingering_imports_of_one_process_share_one_watcher() {
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    arb.set_quota("a", quota(64 * MIB)).unwrap();
    let names = publish(&arb, "a", 4, &[]).await;
    let (mut child, peer) = live_process();
    let pid = child.id();
    let mut sessions = Vec::new();
    for _ in 0..4 {
        let (s, rx) = arb.open_session("a", "reader", peer).unwrap();
        std::mem::forget(rx);
        for k in 0..64 {
            arb.sharing()
                .import("a", s, "a", &names[k % names.len()])
                .unwrap();
        }
        sessions.push(s);
    }
    for s in sessions {
        arb.end_session(s, "test");
    }
    assert_eq!(imports_of(&arb, "a"), (0, 256));
    // Give the watchers' tasks time to open their pidfds.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pidfds = pidfds_on(pid);
    assert!(pidfds <= 1, "{pidfds} pidfds on one process");
    assert_eq!(arb.watchers.processes(), 1, "one watcher for the process");
    assert_eq!(arb.watchers.len(), 256, "a watch per lingering import");
    child.kill().unwrap();
    child.wait().unwrap();
    until(|| imports_of(&arb, "a") == (0, 0)).await;
    assert_eq!(imports_of(&arb, "a"), (0, 0));
    until(|| pidfds_on(pid) == 0 && arb.watchers.len() == 0).await;
    assert_eq!((pidfds_on(pid), arb.watchers.len()), (0, 0));
    let st = arb.lock();
    assert!(st.shared().pubs.values().all(|p| p.imports.is_empty()));
}

/// A tenant's imports, live and lingering, are capped: once its sessions' imports linger
/// for a live process, a new session's import is refused with the typed cap (another
/// tenant's is not), until that process exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenant_cap_counts_lingering_imports() {
    const CAP: usize = crate::sharing::MAX_IMPORTS_PER_TENANT;
    // Thousands of imports in a debug build (the invariant checked on every hold) outlast
    // the keepalive on a loaded machine: the sessions must not end of silence meanwhile.
    let cfg = ArbiterConfig {
        keepalive_timeout: Duration::ZERO,
        ..ArbiterConfig::default()
    };
    let arb = host_arbiter(64 * MIB, 1, cfg);
    for t in ["a", "b", "c"] {
        arb.set_quota(t, quota(64 * MIB)).unwrap();
    }
    let names = publish(&arb, "a", 5, &["b".into(), "c".into()]).await;
    let (mut child, peer) = live_process();
    let mut sessions = Vec::new();
    for _ in 0..CAP / 1024 {
        let (s, rx) = arb.open_session("b", "reader", peer).unwrap();
        std::mem::forget(rx);
        sessions.push(s);
    }
    for k in 0..CAP {
        let s = sessions[k / 1024];
        arb.sharing()
            .import("b", s, "a", &names[k % names.len()])
            .unwrap();
    }
    for s in sessions {
        arb.end_session(s, "test");
    }
    assert_eq!(imports_of(&arb, "b"), (0, CAP));
    let (s, rx) = arb.open_session("b", "late", Peer::default()).unwrap();
    std::mem::forget(rx);
    match arb.sharing().import("b", s, "a", &names[0]) {
        Err(BrokerError::SharingLimit { what, max }) => {
            assert_eq!((what.name(), max), ("imports_per_tenant", CAP));
        }
        other => panic!("expected the tenant's import cap, got {other:?}"),
    }
    let (sc, rx) = arb.open_session("c", "other", Peer::default()).unwrap();
    std::mem::forget(rx);
    arb.sharing().import("c", sc, "a", &names[0]).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    until(|| imports_of(&arb, "b") == (0, 0)).await;
    arb.sharing().import("b", s, "a", &names[0]).unwrap();
}

/// The index of a session's live imports gives what a scan of every import gives, through
/// imports, releases, and sessions ending with their process alive or gone; the tenants'
/// counts likewise (the invariant checks both after every hold, too).
#[tokio::test]
async fn the_session_index_answers_as_a_scan_of_every_import() {
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    for t in ["a", "b"] {
        arb.set_quota(t, quota(64 * MIB)).unwrap();
    }
    let names = publish(&arb, "a", 3, &["b".into()]).await;
    let (mut child, peer) = live_process();
    let mut sessions = Vec::new();
    for (t, p) in [
        ("a", peer),
        ("b", Peer::default()),
        ("b", Peer::default()),
        ("a", Peer::default()),
    ] {
        let (s, rx) = arb.open_session(t, "r", p).unwrap();
        std::mem::forget(rx);
        sessions.push((t, s));
    }
    let mut imports = Vec::new();
    for k in 0..40 {
        let (t, s) = sessions[k % sessions.len()];
        imports.push((
            t,
            arb.sharing().import(t, s, "a", &names[k % 3]).unwrap().id,
        ));
    }
    let agree = |arb: &Arbiter| {
        let st = arb.lock();
        let sh = st.shared();
        for &(_, s) in &sessions {
            let mut scan: Vec<Uuid> = sh
                .pubs
                .values()
                .flat_map(|p| p.imports.values())
                .filter(|i| i.session == s && i.lingering.is_none())
                .map(|i| i.id)
                .collect();
            let mut index = sh.imports_of_session(s);
            scan.sort();
            index.sort();
            assert_eq!(index, scan);
        }
    };
    agree(&arb);
    for &(t, i) in imports.iter().step_by(3) {
        arb.sharing().release_import(t, i).unwrap();
    }
    agree(&arb);
    arb.end_session(sessions[0].1, "test");
    arb.end_session(sessions[2].1, "test");
    agree(&arb);
    assert_eq!(imports_of(&arb, "b"), (7, 0), "the live session's imports");
    assert_eq!(
        imports_of(&arb, "a"),
        (6, 6),
        "lingering for the live process"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    until(|| imports_of(&arb, "a").1 == 0).await;
    agree(&arb);
    assert_eq!(imports_of(&arb, "a"), (6, 0));
}
