//! Faults a GPU reports outside the device's own health check: the [`FaultSource`]
//! trait the arbiter holds (polled by the health monitor, reset when an operator clears a
//! device) and NVML's implementation ([`NvmlFaults`]): critical Xid events other than the
//! ones applications cause ([`APPLICATION_XIDS`]), new uncorrectable ECC errors since the
//! broker started, pages waiting to be retired, a lost GPU.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Xid codes that applications cause (bad kernels, page faults): not the GPU's fault. The
/// same list NVIDIA's Kubernetes device plugin skips.
pub const APPLICATION_XIDS: &[u64] = &[13, 31, 43, 45, 68, 109];

/// Faults another source (NVML) reports, by broker device index.
pub trait FaultSource: Send {
    /// The current fault of each device that has one.
    fn poll(&mut self) -> HashMap<u32, String>;
    /// An operator cleared device `index`: forget what was seen so far.
    fn reset(&mut self, index: u32);
    /// The broker stops: end what the source runs on its own (NVML's Xid event thread)
    /// and wait for it. Called once, by `Lifecycle::join`; nothing by default.
    fn stop(&mut self) {}
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
    /// Tells the Xid event thread to end (it looks between waits of at most 1 s), and the
    /// thread, joined by [`FaultSource::stop`].
    xid_stop: Arc<AtomicBool>,
    xid_thread: Option<std::thread::JoinHandle<()>>,
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
        let xid_stop = Arc::new(AtomicBool::new(false));
        let (x, u, stop) = (xids.clone(), uuids.clone(), xid_stop.clone());
        let xid_thread = std::thread::Builder::new()
            .name("nvml-xid-events".into())
            .spawn(move || xid_events(u, x, &stop))
            .map_err(|e| tracing::warn!(error = %e, "no Xid event thread"))
            .ok();
        tracing::info!(devices = uuids.len(), "NVML health checks on");
        Some(NvmlFaults {
            nvml,
            uuids,
            ecc_base,
            xids,
            xid_stop,
            xid_thread,
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

    fn stop(&mut self) {
        self.xid_stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.xid_thread.take() {
            if t.join().is_err() {
                tracing::warn!("the Xid event thread panicked");
            }
        }
    }
}

impl Drop for NvmlFaults {
    /// Never left running: told to end (not waited for here; `stop` waits).
    fn drop(&mut self) {
        self.xid_stop.store(true, Ordering::SeqCst);
    }
}

/// The Xid event loop (its own NVML handle: event sets borrow it), until `stop`.
fn xid_events(uuids: Vec<String>, out: Arc<Mutex<HashMap<String, Vec<u64>>>>, stop: &AtomicBool) {
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
    while !stop.load(Ordering::SeqCst) {
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
