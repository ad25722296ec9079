//! Tests of where the arbiter's effects run: an operator's call served on the operators'
//! runtime (`read_pool.rs`) that lets a waiter in or starts a watcher leaves the grant's
//! device work and the watcher to the main runtime. Each test stalls the operators'
//! runtime (its one worker blocked) right after the call: what the call asked for must
//! still happen. A grant with no runtime at all to run on is rolled back and answered.

use crate::arbiter::tests::{quota, req};
use crate::arbiter::{host_arbiter, AcquireRequest, Arbiter, ArbiterConfig};
use crate::error::BrokerResult;
use crate::lease::LeaseView;
use crate::service::admin::AdminService;
use crate::session::Peer;
use gpu_broker_proto::v1 as pb;
use gpu_broker_proto::v1::admin_server::Admin;
use std::sync::{mpsc, Arc};
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// A failure detector, not a speed limit.
const BOUNDED: Duration = Duration::from_secs(10);

/// The broker's two runtimes: the main one (one worker, "main-worker", where the
/// background work starts) and the operators' one (one worker).
struct Runtimes {
    main: tokio::runtime::Runtime,
    ops: crate::read_pool::ReadPool,
    stop: tokio_util::sync::CancellationToken,
}

impl Runtimes {
    fn start(arb: &Arc<Arbiter>) -> Runtimes {
        let main = crate::read_pool::main_runtime_of_one_worker();
        let stop = tokio_util::sync::CancellationToken::new();
        let a = arb.clone();
        let s = stop.clone();
        main.block_on(async move { a.tasks().start(s) });
        Runtimes {
            main,
            ops: crate::read_pool::ReadPool::start(1).unwrap(),
            stop,
        }
    }

    /// Runs `call` on the operators' runtime, then keeps its only worker blocked until
    /// the returned sender is used (or dropped). Returns once `call` has finished.
    fn on_ops_then_stall<F>(&self, call: F) -> mpsc::Sender<()>
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let (release, released) = mpsc::channel::<()>();
        let (done, called) = mpsc::channel::<String>();
        self.ops.handle().unwrap().spawn(async move {
            call.await;
            let _ = done.send(std::thread::current().name().unwrap_or("").to_string());
            // Blocks the worker: nothing else runs on this runtime meanwhile.
            let _ = released.recv_timeout(Duration::from_secs(30));
        });
        let ran_on = called
            .recv_timeout(BOUNDED)
            .expect("the operator's call ran");
        assert_eq!(ran_on, crate::read_pool::THREAD_NAME);
        release
    }

    /// An operator's RevokeLease of `lease`, served on the operators' runtime, which then
    /// stalls ([`Runtimes::on_ops_then_stall`]).
    fn revoke_then_stall(&self, arb: &Arc<Arbiter>, lease: &LeaseView) -> mpsc::Sender<()> {
        let svc = AdminService::new(arb.clone());
        let id = lease.id.to_string();
        self.on_ops_then_stall(async move {
            svc.revoke_lease(tonic::Request::new(pb::RevokeLeaseRequest {
                lease_id: id,
                reason: String::new(),
            }))
            .await
            .unwrap();
        })
    }
}

impl Drop for Runtimes {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// On a 64 MiB device, `a` holds it all from a session with no pid (a TCP peer: revoked,
/// its memory is destroyed at once on a host-backed device) and `b` waits on `rt` for
/// 32 MiB. Returns `a`'s lease and `b`'s answer, once `b` is queued.
fn one_holds_all_one_waits(
    arb: &Arc<Arbiter>,
    rt: &tokio::runtime::Runtime,
) -> (LeaseView, mpsc::Receiver<BrokerResult<LeaseView>>) {
    for t in ["a", "b"] {
        arb.set_quota(t, quota(64 * MIB)).unwrap();
    }
    let (sa, ea) = arb.open_session("a", "t", Peer::default()).unwrap();
    let (sb, eb) = arb.open_session("b", "t", Peer::default()).unwrap();
    std::mem::forget((ea, eb));
    let a = arb.clone();
    let held = rt
        .block_on(async move { a.acquire(req("a", sa, 64 * MIB)).await })
        .unwrap();
    let (answer, answered) = mpsc::channel();
    let a = arb.clone();
    rt.spawn(async move {
        let r = a
            .acquire(AcquireRequest {
                wait: Duration::from_secs(30),
                ..req("b", sb, 32 * MIB)
            })
            .await;
        let _ = answer.send(r);
    });
    let t0 = std::time::Instant::now();
    while arb.lock().queue().is_empty() {
        assert!(t0.elapsed() < BOUNDED, "b never queued");
        std::thread::sleep(Duration::from_millis(5));
    }
    (held, answered)
}

#[test]
fn a_waiter_let_in_by_an_operators_revoke_is_granted_on_the_main_runtime() {
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    let rts = Runtimes::start(&arb);
    let (held, grant) = one_holds_all_one_waits(&arb, &rts.main);
    // The operator revokes `a`'s lease on the operators' runtime, which then stalls.
    let release = rts.revoke_then_stall(&arb, &held);
    let lease = grant
        .recv_timeout(BOUNDED)
        .expect("the grant's device work ran on the main runtime, not the stalled one")
        .unwrap();
    assert_eq!((lease.tenant.as_str(), lease.bytes), ("b", 32 * MIB));
    assert_eq!(arb.views().tenant("b").unwrap().usage.held_bytes, 32 * MIB);
    release.send(()).unwrap();
}

#[test]
fn a_quarantine_watcher_started_by_an_operators_revoke_runs_on_the_main_runtime() {
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    let rts = Runtimes::start(&arb);
    arb.set_quota("a", quota(64 * MIB)).unwrap();
    // The holder is a live process: its revoked memory is quarantined until it exits.
    let mut holder = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let peer = Peer {
        pid: Some(holder.id()),
        uid: None,
        unix: true,
    };
    let a = arb.clone();
    let held = rts
        .main
        .block_on(async move {
            let (s, events) = a.open_session("a", "t", peer).unwrap();
            let l = a.acquire(req("a", s, 32 * MIB)).await;
            std::mem::forget(events);
            l
        })
        .unwrap();
    let release = rts.revoke_then_stall(&arb, &held);
    assert_eq!(
        arb.views().quarantined().len(),
        1,
        "quarantined while it lives"
    );
    holder.kill().unwrap();
    holder.wait().unwrap();
    let t0 = std::time::Instant::now();
    while !arb.views().quarantined().is_empty() {
        assert!(
            t0.elapsed() < BOUNDED,
            "the watcher never fired: it runs on the stalled operators' runtime"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(arb.views().tenant("a").unwrap().usage.held_bytes, 0);
    release.send(()).unwrap();
}

#[test]
fn a_grant_with_no_runtime_to_run_on_is_rolled_back_and_answered() {
    // No background work started (no main runtime known), and the queue run from a
    // thread outside any runtime: the grant cannot do its device work anywhere.
    let arb = host_arbiter(64 * MIB, 1, ArbiterConfig::default());
    let rt = crate::read_pool::main_runtime_of_one_worker();
    let (held, answer) = one_holds_all_one_waits(&arb, &rt);
    assert!(tokio::runtime::Handle::try_current().is_err());
    arb.revoke(
        held.id,
        &crate::arbiter::state::Revoke::Operator("test".into()),
    )
    .unwrap();
    let e = answer.recv_timeout(BOUNDED).unwrap().unwrap_err();
    assert!(
        matches!(&e, crate::error::BrokerError::Internal(m) if m.contains("no runtime")),
        "{e:?}"
    );
    // The reservation was given back: nothing held, the whole device grantable again.
    assert_eq!(arb.views().tenant("b").unwrap().usage.held_bytes, 0);
    let (sb, _eb) = arb.open_session("b", "t", Peer::default()).unwrap();
    let a = arb.clone();
    let lease = rt
        .block_on(async move { a.acquire(req("b", sb, 64 * MIB)).await })
        .unwrap();
    assert_eq!(lease.bytes, 64 * MIB);
}
