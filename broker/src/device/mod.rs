//! The `Device` trait: the seam between broker logic and hardware. A device hands out
//! whole allocations, exports them as handles another process can map, zeroes them, and
//! reports its memory. It knows nothing about tenants, quotas or gRPC.
//!
//! Backends: [`host`] (a simulated device made of memfd memory objects, for machines
//! without a GPU) and [`cuda`] (the CUDA driver API through cudarc, loaded at run time). Every
//! backend must pass the [`conformance`] suite. Each device lives on its own OS thread
//! ([`thread::DeviceThread`]) that does all of its driver work; the async side talks to it
//! through a channel and never blocks on the driver.

// The backends pass frees on, and their threads are made for blocking work
// (`broker/clippy.toml`).
#![allow(clippy::disallowed_methods)]

pub mod conformance;
pub mod cuda;
pub mod faulty;
pub mod free_check;
pub mod host;
pub mod shm_owner;
pub mod thread;

use std::fmt;

/// Which implementation backs a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// Simulated device made of shared-memory files.
    Host,
    /// A real GPU through the CUDA driver API.
    Cuda,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Host => "host",
            BackendKind::Cuda => "cuda",
        })
    }
}

/// What a device is: fixed for its lifetime.
#[derive(Clone, Debug)]
pub struct DeviceDesc {
    /// Index of the device on this node (the CUDA ordinal for `cuda`).
    pub index: u32,
    /// Human-readable name (e.g. "NVIDIA H200").
    pub name: String,
    /// Stable identity of the device: `GPU-<uuid>` from the driver for `cuda` (the form
    /// `nvidia-smi` prints and `CUDA_VISIBLE_DEVICES` accepts), `HOST-<uuid>` for `host`
    /// (see [`host::synthetic_uuid`]).
    pub uuid: String,
    /// Product name (e.g. "NVIDIA H200"; "host simulation" for `host`).
    pub model: String,
    pub backend: BackendKind,
    /// Total memory of the device in bytes.
    pub total_bytes: u64,
    /// Allocation granularity in bytes: leases are rounded up to a multiple of it.
    pub granularity: u64,
}

/// Free and total memory as the device reports it now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    pub free: u64,
    pub total: u64,
}

pub use gpu_broker_core::memory::{Allocation, DeviceError, Handle, MemoryKind, SharedFd};

/// A fresh random block id (identifies one memory object to workers).
pub fn new_block_id() -> u64 {
    rand::random::<u64>() | 1
}

/// A memory device. Implementations are `Send` (they move onto their device thread once)
/// but never shared: every call comes from that one thread.
pub trait Device: Send {
    /// What this device is.
    fn desc(&self) -> &DeviceDesc;
    /// Total memory the device has, in bytes (same as `desc().total_bytes`).
    fn capacity(&self) -> u64 {
        self.desc().total_bytes
    }
    /// Free and total memory right now, as the device (driver) sees it.
    fn mem_info(&mut self) -> Result<MemInfo, DeviceError>;
    /// True when fresh allocations are guaranteed to read as zeros (a new shared-memory
    /// file); false for CUDA, whose `cuMemAlloc` memory may hold an earlier owner's bytes.
    fn fresh_is_zeroed(&self) -> bool {
        false
    }
    /// Allocates `bytes` (> 0) as one allocation that can be exported on its own.
    fn alloc(&mut self, bytes: u64) -> Result<Allocation, DeviceError>;
    /// Frees an allocation. Callers guarantee no other process still maps it.
    fn free(&mut self, alloc: Allocation) -> Result<(), DeviceError>;
    /// Frees an allocation whose descriptor reached processes that may keep it, closes
    /// the broker's own descriptor (`handle`) and says whether the memory came back to the
    /// device ([`free_check`]). The default reads [`Device::mem_info`] around the free.
    fn free_checked(
        &mut self,
        alloc: Allocation,
        handle: Option<Handle>,
    ) -> Result<free_check::Returned, DeviceError> {
        free_check::free_measured(self, alloc, handle)
    }
    /// The file a process that keeps this memory shows in `/proc` (a memfd: mapped or
    /// held as a descriptor), so that a free the device could not revoke can find who
    /// kept it (`memfd_holders.rs`). `None` (the default) for memory that shows as no
    /// file of its own (CUDA: [`Device::free_checked`] asks the driver instead).
    fn held_as_file(&self, _handle: &Handle) -> Option<crate::memfd_holders::MemFile> {
        None
    }
    /// Takes the allocation's memory back from every process that may still map it, where
    /// the device can (a memfd is truncated); before a free of memory that left its
    /// tenant. The default does nothing: the driver offers no such revocation for CUDA
    /// memory, whose last importer keeps it alive.
    fn revoke(&mut self, _alloc: &Allocation) -> Result<(), DeviceError> {
        Ok(())
    }
    /// Takes back memory exported earlier (by a previous broker) from its descriptor
    /// `fd` of `bytes` bytes, known to workers as `block_id`: it becomes an allocation
    /// of this device whose [`Device::export`] hands out that same descriptor (CUDA
    /// refuses to re-export imported memory). The default cannot.
    fn adopt(
        &mut self,
        _fd: std::os::fd::OwnedFd,
        _bytes: u64,
        _block_id: u64,
    ) -> Result<Allocation, DeviceError> {
        Err(DeviceError::Unavailable(
            "this device cannot take back kept memory".into(),
        ))
    }
    /// Exports a handle another process can open to map the whole allocation.
    fn export(&mut self, alloc: &Allocation) -> Result<Handle, DeviceError>;
    /// Sets every byte of the allocation to zero.
    fn scrub(&mut self, alloc: &Allocation) -> Result<(), DeviceError>;
    /// Copies `len` bytes at `offset` out of the allocation (diagnostics and tests).
    fn read(&mut self, alloc: &Allocation, offset: u64, len: usize)
        -> Result<Vec<u8>, DeviceError>;
    /// Copies `data` into the allocation at `offset` (diagnostics and tests).
    fn write(&mut self, alloc: &Allocation, offset: u64, data: &[u8]) -> Result<(), DeviceError>;
    /// Answers a health check: `Ok` when the device works. The default asks for its
    /// memory info (a driver call that fails once a CUDA context is broken); a device that
    /// does not answer at all is found by the caller's timeout.
    fn health(&mut self) -> Result<(), DeviceError> {
        self.mem_info().map(|_| ())
    }
}

/// Checks `offset + len <= bytes` without overflow.
pub(crate) fn check_range(alloc: &Allocation, offset: u64, len: u64) -> Result<(), DeviceError> {
    match offset.checked_add(len) {
        Some(end) if end <= alloc.bytes => Ok(()),
        _ => Err(DeviceError::OutOfRange {
            offset,
            len,
            bytes: alloc.bytes,
        }),
    }
}
