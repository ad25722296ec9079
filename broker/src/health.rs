//! Device health: a monitor that checks every device each `--health-interval` and marks
//! it unhealthy when something is wrong, and back when it is right again.
//!
//! What counts as wrong:
//! * the device does not answer a health check ([`Device::health`](crate::device::Device::health),
//!   run on its device thread) within `--health-timeout`: "stopped answering";
//! * the health check fails (for CUDA: a driver call on a broken context);
//! * on NVIDIA GPUs, through NVML where it loads (`faults.rs`): a critical Xid event other than the ones
//!   applications cause (13, 31, 43, 45, 68, 109), new uncorrectable ECC errors since the
//!   broker started (volatile counter), pages waiting to be retired, or NVML saying the GPU
//!   is lost. Xid and ECC faults stay until an operator clears them (the counters do not go
//!   back down by themselves); the rest clear when the check passes again.
//!
//! An unhealthy device takes no new leases (`availability.rs`), waiters that can go nowhere
//! else are told why, and every session holding leases there gets a `DeviceUnhealthy`
//! event; the leases stay with their holders. Operators see it in `GetDevices`, the drain
//! report and the audit log, and may mark a device unhealthy or healthy themselves
//! (`SetDeviceHealth`); a device an operator marked stays so until an operator clears it.
//! Marking is the arbiter's (`arbiter/health.rs`); this module holds the monitor that
//! drives it and the task that keeps gRPC health in step with the devices.
//!
//! MIG: a GPU in MIG mode is refused at start ([`mig_refusal`]): the broker serves whole
//! GPUs, whose memory one CUDA context can allocate; MIG instances would need one context
//! per instance and `CUDA_VISIBLE_DEVICES` per worker, which is not built.

use crate::arbiter::Arbiter;
use crate::audit::Who;
use crate::faults::FaultSource;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How often and how patiently to check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthConfig {
    /// Zero: no monitor.
    pub interval: Duration,
    pub timeout: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            interval: crate::defaults::HEALTH_INTERVAL,
            timeout: crate::defaults::HEALTH_TIMEOUT,
        }
    }
}

/// Runs the health monitor until `stop`, as the named worker `health-monitor` (joined
/// by [`Lifecycle::join`](crate::arbiter::Lifecycle::join)): every `cfg.interval`, each device's health check
/// (with `cfg.timeout`) and `source`'s faults. False when `cfg` turns it off.
pub fn spawn_monitor(
    arb: &Arc<Arbiter>,
    cfg: HealthConfig,
    source: Option<Box<dyn FaultSource>>,
    stop: CancellationToken,
) -> bool {
    if cfg.interval.is_zero() {
        return false;
    }
    let me = arb.clone();
    let source = source.map(|s| Arc::new(Mutex::new(s)));
    arb.lifecycle().set_fault_source(source.clone());
    // Marks are synchronous: stopping at an await leaves none half-made.
    arb.lifecycle()
        .spawn_worker("health-monitor", stop.clone(), async move {
            let n = me.devices.len();
            let busy: Vec<Arc<AtomicBool>> =
                (0..n).map(|_| Arc::new(AtomicBool::new(false))).collect();
            let mut since: Vec<Option<Instant>> = vec![None; n];
            let system = Who::system("health monitor");
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(cfg.interval) => {}
                }
                let nvml = match &source {
                    Some(s) => {
                        let s = s.clone();
                        tokio::task::spawn_blocking(move || s.lock().poll())
                            .await
                            .unwrap_or_default()
                    }
                    None => HashMap::new(),
                };
                for i in 0..n {
                    let d = i as u32;
                    let problem = if busy[i].load(Ordering::SeqCst) {
                        // The previous check has not come back.
                        match since[i] {
                            Some(t) if t.elapsed() >= cfg.timeout => Some(format!(
                                "stopped answering: no reply to a health check for {} s",
                                t.elapsed().as_secs()
                            )),
                            _ => continue,
                        }
                    } else {
                        busy[i].store(true, Ordering::SeqCst);
                        since[i] = Some(Instant::now());
                        let flag = busy[i].clone();
                        let call = me.devices[i].thread.call(move |dev| {
                            let r = dev.health();
                            flag.store(false, Ordering::SeqCst);
                            r
                        });
                        match tokio::time::timeout(cfg.timeout, call).await {
                            Ok(Ok(Ok(()))) => {
                                since[i] = None;
                                None
                            }
                            Ok(Ok(Err(e))) => Some(format!("health check failed: {e}")),
                            Ok(Err(e)) => Some(format!("health check failed: {e}")),
                            Err(_) => Some(format!(
                                "stopped answering: no reply to a health check within {} s",
                                cfg.timeout.as_secs()
                            )),
                        }
                    };
                    let problem = problem.or_else(|| nvml.get(&d).cloned());
                    let r = match problem {
                        Some(reason) => me
                            .device_health()
                            .mark_unhealthy(d, &reason, false, &system),
                        None => me.device_health().mark_healthy(d, false, &system),
                    };
                    if let Err(e) = r {
                        tracing::error!(device = d, error = %e, "health monitor");
                    }
                }
            }
        });
    true
}

/// Name under which gRPC health reports device `index` (SERVING: admits new leases).
pub fn grpc_device_service(index: u32) -> String {
    format!("gpubroker.v1.Device/{index}")
}

/// Keeps the gRPC health service in step with the devices until `stop`: each device's
/// [`grpc_device_service`] is SERVING while it admits new leases (open: not draining, not
/// unhealthy), and `gpubroker.v1.Broker` is NOT_SERVING while no device does (readiness:
/// send no work here). Stops touching anything once the broker shuts down.
pub async fn report_grpc_health(
    arb: Arc<Arbiter>,
    reporter: tonic_health::server::HealthReporter,
    stop: CancellationToken,
) {
    use tonic_health::ServingStatus;
    let status = |up: bool| {
        if up {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        }
    };
    let mut last: Option<Vec<bool>> = None;
    loop {
        if arb.lifecycle().is_shutting_down() {
            return;
        }
        let open: Vec<bool> = {
            let avail = arb.avail.read();
            (0..arb.devices().len() as u32)
                .map(|d| avail.admits(d))
                .collect()
        };
        if last.as_ref() != Some(&open) {
            for (d, up) in open.iter().enumerate() {
                reporter
                    .set_service_status(grpc_device_service(d as u32), status(*up))
                    .await;
            }
            // Shutting down meanwhile: the server's NOT_SERVING stands.
            let up = open.iter().any(|o| *o)
                && !stop.is_cancelled()
                && !arb.lifecycle().is_shutting_down();
            reporter
                .set_service_status("gpubroker.v1.Broker", status(up))
                .await;
            last = Some(open);
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
}

/// Why the broker refuses to serve these CUDA devices (by UUID): one is in MIG mode.
/// `None`: serve them (also when NVML does not load: MIG then shows as `MIG-` UUIDs).
pub fn mig_refusal(uuids: &[String]) -> Option<String> {
    if let Some((i, u)) = uuids
        .iter()
        .enumerate()
        .find(|(_, u)| u.starts_with("MIG-"))
    {
        return Some(mig_message(i, u));
    }
    let nvml = nvml_wrapper::Nvml::init().ok()?;
    uuids.iter().enumerate().find_map(|(i, u)| {
        let dev = nvml.device_by_uuid(u.as_str()).ok()?;
        let mode = dev.mig_mode().ok()?;
        (mode.current == 1).then(|| mig_message(i, u))
    })
}

fn mig_message(i: usize, uuid: &str) -> String {
    format!(
        "device {i} ({uuid}) is in MIG mode; the broker serves whole GPUs only. Disable MIG \
         (nvidia-smi -i {i} -mig 0, then reset the GPU) or leave the device out with --devices"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arbiter::{AcquireRequest, ArbiterConfig, DeviceSlot};
    use crate::auth::Authenticator;
    use crate::device::faulty::{FaultSwitch, FaultyDevice};
    use crate::device::host::HostDevice;
    use crate::device::thread::DeviceThread;
    use crate::device::Device;
    use crate::error::BrokerError;
    use crate::ledger::Quota;
    use crate::session::{Peer, SessionEvent};

    const MIB: u64 = 1 << 20;

    /// Is device `index` healthy (not marked unhealthy)?
    fn is_healthy(arb: &Arbiter, index: u32) -> bool {
        arb.avail
            .read()
            .device(index)
            .is_some_and(|s| s.fault.is_none())
    }

    /// Why device `index` was marked unhealthy ("" when it is healthy).
    fn unhealthy_reason(arb: &Arbiter, index: u32) -> String {
        let avail = arb.avail.read();
        let fault = avail.device(index).and_then(|s| s.fault.as_ref());
        fault.map(|f| f.reason.clone()).unwrap_or_default()
    }

    /// Two 64 MiB fault-injecting devices.
    fn fixture() -> (Arc<Arbiter>, Vec<FaultSwitch>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let switches = vec![FaultSwitch::default(), FaultSwitch::default()];
        let slots = switches
            .iter()
            .enumerate()
            .map(|(i, sw)| {
                let sw = sw.clone();
                let thread = DeviceThread::spawn(format!("faulty-{i}"), move || {
                    let inner = Box::new(HostDevice::new(i as u32, 64 * MIB)?);
                    Ok(Box::new(FaultyDevice::new(inner, sw)) as Box<dyn Device>)
                })
                .unwrap();
                DeviceSlot {
                    thread,
                    initial_leasable: 64 * MIB,
                    external_at_start: 0,
                    taken_back: Default::default(),
                    headroom: 0,
                }
            })
            .collect();
        let arb = Arbiter::new(
            slots,
            None,
            None,
            Arc::new(Authenticator::new("x")),
            ArbiterConfig::default(),
        )
        .unwrap();
        (arb, switches, dir)
    }

    fn ask(session: uuid::Uuid, device: Option<u32>, bytes: u64) -> AcquireRequest {
        AcquireRequest {
            tenant: "a".into(),
            session,
            bytes,
            device,
            wait: Duration::ZERO,
            label: String::new(),
            reclaimable: false,
            fallback_host: false,
        }
    }

    struct Fake(Arc<Mutex<HashMap<u32, String>>>, Arc<Mutex<Vec<u32>>>);
    impl FaultSource for Fake {
        fn poll(&mut self) -> HashMap<u32, String> {
            self.0.lock().clone()
        }
        fn reset(&mut self, index: u32) {
            self.0.lock().remove(&index);
            self.1.lock().push(index);
        }
    }

    /// A fault source that runs something of its own: counts its stops.
    struct Runs(Arc<std::sync::atomic::AtomicUsize>);
    impl FaultSource for Runs {
        fn poll(&mut self) -> HashMap<u32, String> {
            HashMap::new()
        }
        fn reset(&mut self, _: u32) {}
        fn stop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// What a fault source runs on its own (NVML's Xid event thread) is stopped and waited
    /// for once, when the workers are joined at the broker's stop; not before.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_fault_source_is_stopped_when_the_workers_are_joined() {
        let (arb, _sw, _dir) = fixture();
        let stops = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stop = CancellationToken::new();
        let cfg = HealthConfig {
            interval: Duration::from_millis(10),
            timeout: Duration::from_millis(200),
        };
        assert!(spawn_monitor(
            &arb,
            cfg,
            Some(Box::new(Runs(stops.clone()))),
            stop.clone()
        ));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(stops.load(Ordering::SeqCst), 0, "running until the stop");
        stop.cancel();
        assert!(arb
            .lifecycle()
            .join(Duration::from_secs(5))
            .await
            .is_empty());
        assert_eq!(stops.load(Ordering::SeqCst), 1);
        arb.lifecycle().join(Duration::from_secs(5)).await;
        assert_eq!(stops.load(Ordering::SeqCst), 1, "stopped once");
    }

    async fn until(what: &str, mut f: impl FnMut() -> bool) {
        for _ in 0..500 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("timed out waiting for {what}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failing_or_silent_device_is_closed_its_holders_told_and_reopened_when_healthy() {
        let (arb, sw, _dir) = fixture();
        arb.set_quota(
            "a",
            Quota {
                limit_bytes: 256 * MIB,
                ..Quota::default()
            },
        )
        .unwrap();
        let (s, mut events) = arb.open_session("a", "t", Peer::default()).unwrap();
        let on1 = arb.acquire(ask(s, Some(1), 4 * MIB)).await.unwrap();
        let nvml = Arc::new(Mutex::new(HashMap::new()));
        let resets = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let cfg = HealthConfig {
            interval: Duration::from_millis(20),
            timeout: Duration::from_millis(200),
        };
        assert!(!spawn_monitor(
            &arb,
            HealthConfig {
                interval: Duration::ZERO,
                ..cfg
            },
            None,
            stop.clone(),
        ));
        assert!(
            arb.lifecycle().worker_names().is_empty(),
            "a zero interval: no monitor"
        );
        assert!(spawn_monitor(
            &arb,
            cfg,
            Some(Box::new(Fake(nvml.clone(), resets.clone()))),
            stop.clone(),
        ));
        assert_eq!(arb.lifecycle().worker_names(), vec!["health-monitor"]);

        // A failing health check: closed, the holder is told.
        sw[1].unhealthy("injected Xid 79");
        until("device 1 unhealthy", || !is_healthy(&arb, 1)).await;
        let ev = events.recv().await.unwrap();
        match ev {
            SessionEvent::DeviceUnhealthy {
                device,
                reason,
                uuid,
            } => {
                assert_eq!(device, 1);
                assert!(reason.contains("injected Xid 79"), "{reason}");
                assert_eq!(uuid, arb.devices().uuid(1));
            }
            other => panic!("{other:?}"),
        }
        let e = arb.acquire(ask(s, Some(1), 2 * MIB)).await.unwrap_err();
        assert!(
            matches!(e, BrokerError::DeviceClosed { unhealthy: true, ref why, .. } if why.contains("unhealthy")),
            "{e:?}"
        );
        let elsewhere = arb.acquire(ask(s, None, 2 * MIB)).await.unwrap();
        assert_eq!(elsewhere.device, 0);
        let report = arb.views().device_reports().await;
        assert!(report[1].fault.as_deref().unwrap().contains("Xid 79"));
        let text = arb
            .views()
            .metrics_text(crate::metrics::Format::PrometheusText)
            .await;
        let healthy: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("gpu_broker_device_healthy{"))
            .collect();
        assert_eq!(healthy.len(), 2, "{text}");
        assert!(
            healthy
                .iter()
                .any(|l| l.contains("gpu=\"1\"") && l.ends_with(" 0")),
            "{healthy:?}"
        );
        assert!(
            healthy
                .iter()
                .any(|l| l.contains("gpu=\"0\"") && l.ends_with(" 1")),
            "{healthy:?}"
        );
        assert!(report[0].fault.is_none());
        // The lease there stays its holder's.
        assert!(arb.views().leases(Some("a")).iter().any(|l| l.id == on1.id));

        // Healthy again: reopened by the monitor.
        sw[1].heal();
        until("device 1 healthy", || is_healthy(&arb, 1)).await;
        arb.acquire(ask(s, Some(1), 2 * MIB)).await.unwrap();

        // A device that stops answering: unhealthy after the timeout, back when it answers.
        sw[0].hang(true);
        until("device 0 silent", || !is_healthy(&arb, 0)).await;
        assert!(unhealthy_reason(&arb, 0).contains("stopped answering"));
        sw[0].hang(false);
        until("device 0 answering", || is_healthy(&arb, 0)).await;

        // An NVML fault (sticky in its source) closes it until an operator clears it,
        // which resets the source.
        nvml.lock().insert(0, "Xid 48 (double-bit ECC)".to_string());
        until("device 0 NVML fault", || !is_healthy(&arb, 0)).await;
        let op = Who::system("test operator");
        assert!(arb.device_health().set(0, true, "", &op).unwrap());
        assert_eq!(*resets.lock(), vec![0]);
        until("device 0 cleared", || is_healthy(&arb, 0)).await;

        // An operator's mark holds against a passing check; only an operator clears it.
        assert!(arb.device_health().set(0, false, "bad fan", &op).unwrap());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !is_healthy(&arb, 0),
            "the monitor must not clear an operator's mark"
        );
        assert!(!arb.device_health().set(0, false, "bad fan", &op).unwrap());
        assert!(arb.device_health().set(0, true, "", &op).unwrap());
        assert!(is_healthy(&arb, 0));
        assert!(matches!(
            arb.device_health().set(9, true, "", &op),
            Err(BrokerError::UnknownDevice { device: 9, .. })
        ));
        // Every verdict is in the audit log.
        let log = arb.durable.list_audit(&Default::default()).unwrap();
        assert!(log.iter().filter(|r| r.action == "device.health").count() >= 8);
        stop.cancel();
        // The shutdown path waits for the monitor: it has ended when the join returns.
        assert!(arb
            .lifecycle()
            .join(Duration::from_secs(5))
            .await
            .is_empty());
        assert!(arb.lifecycle().worker_names().is_empty());
    }

    #[test]
    fn mig_uuids_are_refused_with_a_remedy() {
        let why = mig_refusal(&["GPU-1".into(), "MIG-2f7e".into()]).unwrap();
        assert!(
            why.contains("device 1") && why.contains("MIG") && why.contains("--devices"),
            "{why}"
        );
    }
}
