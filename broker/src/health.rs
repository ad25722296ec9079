//! Device health: a monitor that checks every device each `--health-interval` and marks
//! it unhealthy when something is wrong, and back when it is right again.
//!
//! What counts as wrong:
//! * the device does not answer a health check ([`Device::health`](crate::device::Device::health),
//!   run on its device thread) within `--health-timeout`: "stopped answering";
//! * the health check fails (for CUDA: a driver call on a broken context);
//! * on NVIDIA GPUs, through NVML where it loads: a critical Xid event other than the ones
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
//!
//! MIG: a GPU in MIG mode is refused at start ([`mig_refusal`]): the broker serves whole
//! GPUs, whose memory one CUDA context can allocate; MIG instances would need one context
//! per instance and `CUDA_VISIBLE_DEVICES` per worker, which is not built.

use crate::arbiter::Arbiter;
use crate::audit::Who;
use crate::availability::Fault;
use crate::error::{BrokerError, BrokerResult};
use crate::session::SessionEvent;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio_util::sync::CancellationToken;

/// Xid codes that applications cause (bad kernels, page faults): not the GPU's fault. The
/// same list NVIDIA's Kubernetes device plugin skips.
pub const APPLICATION_XIDS: &[u64] = &[13, 31, 43, 45, 68, 109];

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

/// Faults another source (NVML) reports, by broker device index.
pub trait FaultSource: Send {
    /// The current fault of each device that has one.
    fn poll(&mut self) -> HashMap<u32, String>;
    /// An operator cleared device `index`: forget what was seen so far.
    fn reset(&mut self, index: u32);
}

impl Arbiter {
    /// Marks device `index` unhealthy for `reason`: see the module doc. Returns false if
    /// it already was.
    pub fn mark_unhealthy(
        self: &Arc<Self>,
        index: u32,
        reason: &str,
        by_operator: bool,
        who: &Who,
    ) -> BrokerResult<bool> {
        self.check_device_index(index)?;
        let uuid = self.device_uuid(index);
        let holders = {
            let mut st = self.lock();
            {
                let mut avail = self.avail.write();
                let Some(s) = avail.device_mut(index) else {
                    return Ok(false);
                };
                match &mut s.fault {
                    Some(f) => {
                        // An operator's mark outranks the monitor's; same reason: nothing new.
                        if f.reason == reason && f.by_operator == by_operator {
                            return Ok(false);
                        }
                        f.reason = reason.to_string();
                        f.by_operator |= by_operator;
                    }
                    None => {
                        s.fault = Some(Fault {
                            since: SystemTime::now(),
                            reason: reason.to_string(),
                            by_operator,
                        })
                    }
                }
            }
            self.fail_stranded_waiters(&mut st);
            let sessions: std::collections::HashSet<uuid::Uuid> = st
                .leases()
                .iter()
                .filter(|l| l.device == index && l.tier == crate::ledger::Tier::Device)
                .map(|l| l.session)
                .collect();
            for s in &sessions {
                if let Some(s) = st.sessions().get(s) {
                    let to = s.id;
                    st.fx().notify(
                        to,
                        SessionEvent::DeviceUnhealthy {
                            device: index,
                            uuid: uuid.clone(),
                            reason: reason.to_string(),
                        },
                    );
                }
            }
            sessions.len()
        };
        tracing::error!(device = index, %uuid, reason, by_operator, sessions_told = holders, "DEVICE UNHEALTHY: no new leases on it");
        self.audit(
            who,
            "device.health",
            "",
            &index.to_string(),
            Some(serde_json::json!({"healthy": true})),
            Some(serde_json::json!({"healthy": false, "reason": reason})),
        );
        Ok(true)
    }

    /// Marks device `index` healthy again. The monitor cannot clear an operator's mark
    /// (`by_operator` false); an operator clears anything. Returns false if it was healthy.
    pub fn mark_healthy(
        self: &Arc<Self>,
        index: u32,
        by_operator: bool,
        who: &Who,
    ) -> BrokerResult<bool> {
        self.check_device_index(index)?;
        let before = {
            let mut st = self.lock();
            let before = {
                let mut avail = self.avail.write();
                let Some(s) = avail.device_mut(index) else {
                    return Ok(false);
                };
                match &s.fault {
                    None => return Ok(false),
                    Some(f) if f.by_operator && !by_operator => return Ok(false),
                    Some(f) => {
                        let r = f.reason.clone();
                        s.fault = None;
                        r
                    }
                }
            };
            // Waiters may fit there now.
            self.drain(&mut st);
            before
        };
        tracing::warn!(device = index, by_operator, was = %before, "device healthy again: admitting");
        self.audit(
            who,
            "device.health",
            "",
            &index.to_string(),
            Some(serde_json::json!({"healthy": false, "reason": before})),
            Some(serde_json::json!({"healthy": true})),
        );
        Ok(true)
    }

    fn check_device_index(&self, index: u32) -> BrokerResult<()> {
        if index as usize >= self.devices.len() {
            return Err(BrokerError::InvalidArgument(format!(
                "unknown device {index}: this broker has {} device(s)",
                self.devices.len()
            )));
        }
        Ok(())
    }

    /// How many devices the broker serves.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Is device `index` healthy (not marked unhealthy)?
    pub fn device_healthy(&self, index: u32) -> bool {
        self.avail
            .read()
            .device(index)
            .is_some_and(|s| s.fault.is_none())
    }

    /// Devices marked unhealthy, with the reason.
    pub fn unhealthy_devices(&self) -> Vec<(u32, String)> {
        let avail = self.avail.read();
        (0..avail.len() as u32)
            .filter_map(|d| {
                avail
                    .device(d)
                    .and_then(|s| s.fault.as_ref().map(|f| (d, f.reason.clone())))
            })
            .collect()
    }

    /// Runs the health monitor until `stop`: every `cfg.interval`, each device's health
    /// check (with `cfg.timeout`) and `source`'s faults.
    pub fn spawn_health_monitor(
        self: &Arc<Self>,
        cfg: HealthConfig,
        source: Option<Box<dyn FaultSource>>,
        stop: CancellationToken,
    ) -> Option<tokio::task::JoinHandle<()>> {
        if cfg.interval.is_zero() {
            return None;
        }
        let me = self.clone();
        let source = source.map(|s| Arc::new(Mutex::new(s)));
        *self.health_source.lock() = source.clone();
        Some(tokio::spawn(async move {
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
                        Some(reason) => me.mark_unhealthy(d, &reason, false, &system),
                        None => me.mark_healthy(d, false, &system),
                    };
                    if let Err(e) = r {
                        tracing::error!(device = d, error = %e, "health monitor");
                    }
                }
            }
        }))
    }

    /// An operator's verdict on device `index` (`SetDeviceHealth`).
    pub fn set_device_health(
        self: &Arc<Self>,
        index: u32,
        healthy: bool,
        reason: &str,
        who: &Who,
    ) -> BrokerResult<bool> {
        if reason.len() > crate::arbiter::MAX_LABEL {
            return Err(BrokerError::InvalidArgument(format!(
                "reason longer than {} bytes",
                crate::arbiter::MAX_LABEL
            )));
        }
        if healthy {
            if let Some(s) = self.health_source.lock().as_ref() {
                s.lock().reset(index);
            }
            self.mark_healthy(index, true, who)
        } else {
            let reason = if reason.is_empty() {
                "marked unhealthy by an operator"
            } else {
                reason
            };
            self.mark_unhealthy(index, reason, true, who)
        }
    }
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
        if arb.is_draining() {
            return;
        }
        let open: Vec<bool> = {
            let avail = arb.avail.read();
            (0..arb.device_count() as u32)
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
            let up = open.iter().any(|o| *o) && !stop.is_cancelled() && !arb.is_draining();
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

/// NVML's view of the broker's GPUs (matched by UUID): Xid events (from a thread that
/// waits for them), uncorrectable ECC errors since start, pending page retirement, lost
/// GPUs.
pub struct NvmlFaults {
    nvml: nvml_wrapper::Nvml,
    /// Broker index -> UUID.
    uuids: Vec<String>,
    /// Uncorrectable volatile ECC count at start (or at the last operator reset).
    ecc_base: HashMap<u32, u64>,
    /// Critical Xids seen, by UUID.
    xids: Arc<Mutex<HashMap<String, Vec<u64>>>>,
}

impl NvmlFaults {
    /// Opens NVML for the devices with these UUIDs (broker index order); `None` where
    /// NVML does not load. Starts the Xid event thread.
    pub fn open(uuids: Vec<String>) -> Option<NvmlFaults> {
        let nvml = nvml_wrapper::Nvml::init().ok()?;
        let mut ecc_base = HashMap::new();
        for (i, u) in uuids.iter().enumerate() {
            if let Ok(dev) = nvml.device_by_uuid(u.as_str()) {
                if let Ok(n) = dev.total_ecc_errors(
                    nvml_wrapper::enum_wrappers::device::MemoryError::Uncorrected,
                    nvml_wrapper::enum_wrappers::device::EccCounter::Volatile,
                ) {
                    ecc_base.insert(i as u32, n);
                }
            }
        }
        let xids: Arc<Mutex<HashMap<String, Vec<u64>>>> = Arc::default();
        let (x, u) = (xids.clone(), uuids.clone());
        let spawned = std::thread::Builder::new()
            .name("nvml-xid-events".into())
            .spawn(move || xid_events(u, x));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no Xid event thread");
        }
        tracing::info!(devices = uuids.len(), "NVML health checks on");
        Some(NvmlFaults {
            nvml,
            uuids,
            ecc_base,
            xids,
        })
    }

    fn fault_of(&self, index: u32, uuid: &str) -> Option<String> {
        use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
        use nvml_wrapper::error::NvmlError;
        let dev = match self.nvml.device_by_uuid(uuid) {
            Ok(d) => d,
            Err(NvmlError::GpuLost) => {
                return Some("NVML: the GPU is lost (fell off the bus)".into())
            }
            Err(e) => return Some(format!("NVML cannot find the GPU: {e}")),
        };
        if let Some(x) = self.xids.lock().get(uuid).and_then(|v| v.last().copied()) {
            return Some(format!("Xid {x} (critical GPU error; see the kernel log)"));
        }
        match dev.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile) {
            Ok(n) => {
                let base = self.ecc_base.get(&index).copied().unwrap_or(0);
                if n > base {
                    return Some(format!(
                        "{} new uncorrectable ECC error(s) since the broker started",
                        n - base
                    ));
                }
            }
            Err(NvmlError::GpuLost) => return Some("NVML: the GPU is lost".into()),
            Err(_) => {}
        }
        match dev.are_pages_pending_retired() {
            Ok(true) => Some("memory pages are waiting to be retired: reset the GPU".into()),
            Err(NvmlError::GpuLost) => Some("NVML: the GPU is lost".into()),
            _ => None,
        }
    }

    /// What NVML reports about each device now (for the GPU check: healthy and real).
    pub fn describe(&self) -> Vec<String> {
        use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
        self.uuids
            .iter()
            .enumerate()
            .map(|(i, u)| match self.nvml.device_by_uuid(u.as_str()) {
                Ok(d) => format!(
                    "device {i} {u}: name {:?}, uncorrectable ECC (volatile) {:?}, pages pending retirement {:?}, MIG {:?}, fault {:?}",
                    d.name().unwrap_or_default(),
                    d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile),
                    d.are_pages_pending_retired(),
                    d.mig_mode().map(|m| m.current),
                    self.fault_of(i as u32, u)
                ),
                Err(e) => format!("device {i} {u}: NVML error {e}"),
            })
            .collect()
    }
}

impl FaultSource for NvmlFaults {
    fn poll(&mut self) -> HashMap<u32, String> {
        self.uuids
            .iter()
            .enumerate()
            .filter_map(|(i, u)| self.fault_of(i as u32, u).map(|f| (i as u32, f)))
            .collect()
    }

    fn reset(&mut self, index: u32) {
        use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
        let Some(u) = self.uuids.get(index as usize) else {
            return;
        };
        self.xids.lock().remove(u);
        if let Ok(d) = self.nvml.device_by_uuid(u.as_str()) {
            if let Ok(n) = d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile) {
                self.ecc_base.insert(index, n);
            }
        }
    }
}

/// The Xid event loop (its own NVML handle: event sets borrow it).
fn xid_events(uuids: Vec<String>, out: Arc<Mutex<HashMap<String, Vec<u64>>>>) {
    use nvml_wrapper::bitmasks::event::EventTypes;
    use nvml_wrapper::enums::event::XidError;
    let Ok(nvml) = nvml_wrapper::Nvml::init() else {
        return;
    };
    let Ok(mut set) = nvml.create_event_set() else {
        return;
    };
    for u in &uuids {
        let Ok(dev) = nvml.device_by_uuid(u.as_str()) else {
            continue;
        };
        set = match dev.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(uuid = %u, error = %e.error, "cannot watch Xid events");
                return;
            }
        };
    }
    loop {
        match set.wait(1000) {
            Ok(ev) => {
                let Some(XidError::Value(xid)) = ev.event_data else {
                    continue;
                };
                let uuid = ev.device.uuid().unwrap_or_default();
                if APPLICATION_XIDS.contains(&xid) {
                    tracing::info!(%uuid, xid, "Xid event caused by an application: device stays healthy");
                    continue;
                }
                tracing::error!(%uuid, xid, "critical Xid event");
                out.lock().entry(uuid).or_default().push(xid);
            }
            Err(nvml_wrapper::error::NvmlError::Timeout) => {}
            Err(e) => {
                tracing::warn!(error = %e, "Xid event wait failed; no more Xid events");
                return;
            }
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
    use crate::ledger::Quota;
    use crate::session::Peer;

    const MIB: u64 = 1 << 20;

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
        arb.spawn_health_monitor(
            cfg,
            Some(Box::new(Fake(nvml.clone(), resets.clone()))),
            stop.clone(),
        );

        // A failing health check: closed, the holder is told.
        sw[1].unhealthy("injected Xid 79");
        until("device 1 unhealthy", || !arb.device_healthy(1)).await;
        let ev = events.recv().await.unwrap();
        match ev {
            SessionEvent::DeviceUnhealthy {
                device,
                reason,
                uuid,
            } => {
                assert_eq!(device, 1);
                assert!(reason.contains("injected Xid 79"), "{reason}");
                assert_eq!(uuid, arb.device_uuid(1));
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
        let report = arb.devices().await;
        assert!(report[1].fault.as_deref().unwrap().contains("Xid 79"));
        let text = arb
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
                .any(|l| l.contains("device=\"1\"") && l.ends_with(" 0")),
            "{healthy:?}"
        );
        assert!(
            healthy
                .iter()
                .any(|l| l.contains("device=\"0\"") && l.ends_with(" 1")),
            "{healthy:?}"
        );
        assert!(report[0].fault.is_none());
        // The lease there stays its holder's.
        assert!(arb.list_leases("a").iter().any(|l| l.id == on1.id));

        // Healthy again: reopened by the monitor.
        sw[1].heal();
        until("device 1 healthy", || arb.device_healthy(1)).await;
        arb.acquire(ask(s, Some(1), 2 * MIB)).await.unwrap();

        // A device that stops answering: unhealthy after the timeout, back when it answers.
        sw[0].hang(true);
        until("device 0 silent", || !arb.device_healthy(0)).await;
        assert!(arb.unhealthy_devices()[0].1.contains("stopped answering"));
        sw[0].hang(false);
        until("device 0 answering", || arb.device_healthy(0)).await;

        // An NVML fault (sticky in its source) closes it until an operator clears it,
        // which resets the source.
        nvml.lock().insert(0, "Xid 48 (double-bit ECC)".to_string());
        until("device 0 NVML fault", || !arb.device_healthy(0)).await;
        let op = Who::system("test operator");
        assert!(arb.set_device_health(0, true, "", &op).unwrap());
        assert_eq!(*resets.lock(), vec![0]);
        until("device 0 cleared", || arb.device_healthy(0)).await;

        // An operator's mark holds against a passing check; only an operator clears it.
        assert!(arb.set_device_health(0, false, "bad fan", &op).unwrap());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !arb.device_healthy(0),
            "the monitor must not clear an operator's mark"
        );
        assert!(!arb.set_device_health(0, false, "bad fan", &op).unwrap());
        assert!(arb.set_device_health(0, true, "", &op).unwrap());
        assert!(arb.device_healthy(0));
        assert!(matches!(
            arb.set_device_health(9, true, "", &op),
            Err(BrokerError::InvalidArgument(_))
        ));
        // Every verdict is in the audit log.
        let log = arb.list_audit(&Default::default()).unwrap();
        assert!(log.iter().filter(|r| r.action == "device.health").count() >= 8);
        stop.cancel();
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
