//! GPU memory per process, read through NVML (libnvidia-ml, loaded at run time; absent
//! on machines without an NVIDIA driver). The broker uses it to attribute GPU memory to
//! sessions by their peer pid and to report a worker that allocates GPU memory beyond its
//! leases with its own `cudaMalloc` (more than its CUDA context needs), and to list who
//! may keep memory a free left on a device (`kept_holders.rs`).

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::Nvml;
use std::collections::HashMap;

/// A handle on NVML.
pub struct ProcessMonitor {
    nvml: Nvml,
}

impl ProcessMonitor {
    /// Loads NVML; `None` (with the reason logged) where it is not available.
    pub fn open() -> Option<ProcessMonitor> {
        match Nvml::init() {
            Ok(nvml) => Some(ProcessMonitor { nvml }),
            Err(e) => {
                tracing::info!(error = %e, "NVML not available: no per-process GPU memory attribution");
                None
            }
        }
    }

    /// The processes with a compute context on the device of UUID `uuid` (who may hold
    /// its memory: `kept_holders.rs`); `None` when NVML cannot say.
    pub fn compute_pids(&self, uuid: &str) -> Option<Vec<u32>> {
        let dev = self.nvml.device_by_uuid(uuid).ok()?;
        match dev.running_compute_processes() {
            Ok(procs) => Some(procs.into_iter().map(|p| p.pid).collect()),
            Err(e) => {
                tracing::debug!(uuid, error = %e, "NVML process list failed");
                None
            }
        }
    }

    /// GPU memory used by each process, summed over every GPU of the node.
    pub fn usage_by_pid(&self) -> HashMap<u32, u64> {
        let mut out: HashMap<u32, u64> = HashMap::new();
        let count = self.nvml.device_count().unwrap_or(0);
        for i in 0..count {
            let Ok(dev) = self.nvml.device_by_index(i) else {
                continue;
            };
            let procs = match dev.running_compute_processes() {
                Ok(p) => p,
                Err(e) => {
                    tracing::debug!(device = i, error = %e, "NVML process list failed");
                    continue;
                }
            };
            for p in procs {
                if let UsedGpuMemory::Used(bytes) = p.used_gpu_memory {
                    *out.entry(p.pid).or_default() += bytes;
                }
            }
        }
        out
    }
}
