//! Opens the node's devices for the configured backend: `auto` picks CUDA when a driver
//! and a GPU are usable and falls back to the host simulation (loudly) otherwise. Each
//! device gets its own thread, and its leasable amount is fixed here: what was free at
//! start minus the headroom.

use crate::device::cuda::{self, CudaDevice};
use crate::device::host::HostDevice;
use crate::device::thread::DeviceThread;
use crate::device::{Device, DeviceError};
use std::sync::atomic::{AtomicU64, Ordering};

/// Which device backend to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// CUDA when a driver and a GPU are usable, otherwise the host simulation.
    Auto,
    /// The simulated device (shared-memory files).
    Host,
    /// Real GPUs through the CUDA driver API.
    Cuda,
}

/// Headroom kept free on each device: bytes or a percentage of its total.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Headroom {
    Bytes(u64),
    Percent(f64),
}

impl Headroom {
    /// Headroom of a device of `total` bytes.
    pub fn of(&self, total: u64) -> u64 {
        match *self {
            Headroom::Bytes(b) => b.min(total),
            Headroom::Percent(p) => ((total as f64) * p / 100.0) as u64,
        }
    }
}

/// One device as the arbiter knows it.
pub struct DeviceSlot {
    pub thread: DeviceThread,
    /// Leasable bytes decided at start (free at start minus headroom).
    pub initial_leasable: u64,
    /// Memory used by others when the broker started.
    pub external_at_start: u64,
    /// Memory kept free on the device (configured headroom).
    pub headroom: u64,
    /// Bytes of kept leases a start took back from the keeper (CUDA): in use when
    /// `initial_leasable` and `external_at_start` were read, yet the broker's, not others'.
    pub taken_back: AtomicU64,
}

impl DeviceSlot {
    /// Leasable bytes at start, the memory taken back from the keeper included.
    pub fn leasable_at_start(&self) -> u64 {
        self.initial_leasable + self.taken_back.load(Ordering::Relaxed)
    }

    /// Memory others used at start, without what the broker took back.
    pub fn external_at_start(&self) -> u64 {
        self.external_at_start
            .saturating_sub(self.taken_back.load(Ordering::Relaxed))
    }
}

/// The broker's devices, in index order: a device's index is its place here.
pub struct Devices(Vec<DeviceSlot>);

impl From<Vec<DeviceSlot>> for Devices {
    fn from(slots: Vec<DeviceSlot>) -> Self {
        Devices(slots)
    }
}

impl std::ops::Deref for Devices {
    type Target = [DeviceSlot];
    fn deref(&self) -> &[DeviceSlot] {
        &self.0
    }
}

impl Devices {
    /// `UNKNOWN_DEVICE` unless `index` names a device.
    pub fn check_index(&self, index: u32) -> Result<(), crate::error::BrokerError> {
        if index as usize >= self.len() {
            return Err(crate::error::BrokerError::unknown_device(index, self.len()));
        }
        Ok(())
    }

    /// Device `index`, or every device when `None`.
    pub fn one_or_all(&self, index: Option<u32>) -> Result<Vec<u32>, crate::error::BrokerError> {
        match index {
            Some(d) => {
                self.check_index(d)?;
                Ok(vec![d])
            }
            None => Ok((0..self.len() as u32).collect()),
        }
    }

    /// Device `index`'s UUID (empty when there is no such device).
    pub fn uuid(&self, index: u32) -> String {
        self.get(index as usize)
            .map(|d| d.thread.desc().uuid.clone())
            .unwrap_or_default()
    }

    /// Device `index`'s UUID as records keep it (None when it has none).
    pub fn recorded_uuid(&self, index: u32) -> Option<String> {
        Some(self.uuid(index)).filter(|u| !u.is_empty())
    }

    /// The index now of the device a record of device `index` (kept memory, a drain)
    /// belongs to: the device of UUID `uuid`, wherever it is; without one (a record of an
    /// earlier version), the device at `index`. None: this broker has no such device.
    pub fn named_by(&self, index: u32, uuid: Option<&str>) -> Option<u32> {
        match uuid {
            Some(u) => self
                .iter()
                .position(|d| d.thread.desc().uuid == u)
                .map(|i| i as u32),
            None => ((index as usize) < self.len()).then_some(index),
        }
    }

    /// Kept records of `items` renumbered to the index now of the device each belongs to
    /// ([`Devices::named_by`]; `at` says where a record keeps its index and UUID), and
    /// apart, those of a device this broker no longer has.
    pub fn renumber<T>(
        &self,
        items: Vec<T>,
        at: impl Fn(&mut T) -> (&mut u32, Option<&str>),
    ) -> (Vec<T>, Vec<T>) {
        let mut here = Vec::with_capacity(items.len());
        let mut gone = Vec::new();
        for mut item in items {
            let (index, uuid) = at(&mut item);
            match self.named_by(*index, uuid) {
                Some(now) => {
                    *index = now;
                    here.push(item);
                }
                None => gone.push(item),
            }
        }
        (here, gone)
    }

    /// Whether any device is a CUDA GPU (not the host simulation).
    pub fn any_cuda(&self) -> bool {
        self.iter()
            .any(|d| d.thread.desc().backend == crate::device::BackendKind::Cuda)
    }
}

/// What the backend needs to know.
#[derive(Clone, Debug)]
pub struct BackendSpec {
    pub choice: BackendChoice,
    pub cuda_devices: Option<Vec<u32>>,
    pub host_capacity: u64,
    pub host_devices: u32,
    pub headroom: Headroom,
    /// Seed of the host devices' synthetic UUIDs (the broker passes its state directory,
    /// so they survive restarts); `None`: a fresh identity each start.
    pub host_uuid_seed: Option<String>,
}

/// Why devices could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("CUDA backend requested but not usable: {0}")]
    CudaUnavailable(String),
    #[error("CUDA device {0} does not exist (this node has {1})")]
    NoSuchDevice(u32, u32),
    #[error("opening device {index}: {source}")]
    Open {
        index: u32,
        #[source]
        source: DeviceError,
    },
    #[error("no devices to serve")]
    NoDevices,
}

/// Opens every device; returns them with their leasable amounts.
pub fn open_devices(spec: &BackendSpec) -> Result<Vec<DeviceSlot>, BackendError> {
    let use_cuda = match spec.choice {
        BackendChoice::Host => false,
        BackendChoice::Cuda => {
            if let Some(reason) = cuda::unavailable_reason() {
                return Err(BackendError::CudaUnavailable(reason));
            }
            true
        }
        BackendChoice::Auto => match cuda::unavailable_reason() {
            None => true,
            Some(reason) => {
                tracing::warn!(
                    %reason,
                    "NO USABLE GPU: serving the HOST SIMULATION ({} device(s) of {}); leases are memfd host memory, not GPU memory",
                    spec.host_devices,
                    crate::units::human(spec.host_capacity),
                );
                false
            }
        },
    };
    let threads = if use_cuda {
        open_cuda(spec.cuda_devices.as_deref())?
    } else {
        open_host(
            spec.host_devices,
            spec.host_capacity,
            spec.host_uuid_seed.as_deref(),
        )?
    };
    if threads.is_empty() {
        return Err(BackendError::NoDevices);
    }
    threads
        .into_iter()
        .map(|t| slot(t, spec.headroom))
        .collect()
}

fn open_host(
    count: u32,
    capacity: u64,
    seed: Option<&str>,
) -> Result<Vec<DeviceThread>, BackendError> {
    (0..count)
        .map(|i| {
            let seed = seed.map(str::to_string);
            DeviceThread::spawn(format!("device-host-{i}"), move || {
                let dev = HostDevice::new(i, capacity)?;
                let dev = match seed {
                    Some(s) => dev.with_uuid_seed(&s),
                    None => dev,
                };
                Ok(Box::new(dev) as Box<dyn Device>)
            })
            .map_err(|source| BackendError::Open { index: i, source })
        })
        .collect()
}

fn open_cuda(wanted: Option<&[u32]>) -> Result<Vec<DeviceThread>, BackendError> {
    let count = cuda::device_count().map_err(|e| BackendError::CudaUnavailable(e.to_string()))?;
    let ordinals: Vec<u32> = match wanted {
        Some(w) => w.to_vec(),
        None => (0..count).collect(),
    };
    if let Some(&ordinal) = ordinals.iter().find(|&&o| o >= count) {
        return Err(BackendError::NoSuchDevice(ordinal, count));
    }
    // Every device opens at once (its context on its own thread), then each is waited for.
    let opening = ordinals
        .iter()
        .map(|&ordinal| {
            let started = DeviceThread::start(format!("device-cuda-{ordinal}"), move || {
                Ok(Box::new(CudaDevice::open(ordinal)?) as Box<dyn Device>)
            });
            (ordinal, started)
        })
        .collect::<Vec<_>>();
    opening
        .into_iter()
        .map(|(ordinal, started)| {
            started
                .and_then(|o| o.ready())
                .map_err(|source| BackendError::Open {
                    index: ordinal,
                    source,
                })
        })
        .collect()
}

fn slot(thread: DeviceThread, headroom: Headroom) -> Result<DeviceSlot, BackendError> {
    let index = thread.desc().index;
    let info = thread
        .call_blocking(|d| d.mem_info())
        .and_then(|r| r)
        .map_err(|source| BackendError::Open { index, source })?;
    let headroom = headroom.of(info.total);
    let gran = thread.desc().granularity;
    // Whole granules only: a lease is always a multiple of the granularity.
    let leasable = info.free.saturating_sub(headroom) / gran * gran;
    tracing::info!(
        device = index,
        name = %thread.desc().name,
        uuid = %thread.desc().uuid,
        backend = %thread.desc().backend,
        total = info.total,
        free = info.free,
        headroom,
        leasable,
        "device ready"
    );
    Ok(DeviceSlot {
        headroom,
        initial_leasable: leasable,
        external_at_start: info.total - info.free,
        taken_back: AtomicU64::new(0),
        thread,
    })
}

/// The host-memory fallback tier: one more simulated device (memfd memory), never counted
/// as a GPU.
pub fn open_host_tier(capacity: u64) -> Result<Option<DeviceThread>, BackendError> {
    if capacity == 0 {
        return Ok(None);
    }
    DeviceThread::spawn("host-fallback".into(), move || {
        // Host-tier leases are never published: their memfds take no seal from a holder.
        let dev = HostDevice::new(u32::MAX, capacity)?.with_sealing_closed();
        Ok(Box::new(dev) as Box<dyn Device>)
    })
    .map(Some)
    .map_err(|source| BackendError::Open {
        index: u32::MAX,
        source,
    })
}
