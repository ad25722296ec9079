//! The memory a device hands out, as the broker's records hold it: an [`Allocation`], the
//! [`Handle`] another process maps it through (a shared descriptor, [`SharedFd`]), and why a
//! device operation failed ([`DeviceError`]). The devices themselves (driver calls, device
//! threads) are the daemon's (`gpu_broker::device`).

use std::fmt;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;

/// One live allocation of a device. Owned: exactly one holder, consumed by [`Device::free`].
#[derive(Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Unique per device for the device's lifetime.
    pub id: u64,
    /// Size in bytes (what was asked of the device).
    pub bytes: u64,
    /// Device pointer (`CUdeviceptr`) for `cuda`; 0 for `host`.
    pub addr: u64,
    /// Backing file, for backends that have one (none today: host memory is a memfd).
    pub path: Option<PathBuf>,
}

/// What the file descriptor of a [`Handle::Fd`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// CUDA VMM memory (`cuMemCreate`) exported as a POSIX file descriptor.
    CudaVmm,
    /// A `memfd_create` memory object.
    HostMemfd,
}

/// A file descriptor shared by the pool and the tickets that deliver it; closed when the
/// last holder drops it. Equal only to itself (same descriptor object).
#[derive(Clone)]
pub struct SharedFd(pub Arc<OwnedFd>);

impl SharedFd {
    pub fn new(fd: OwnedFd) -> SharedFd {
        SharedFd(Arc::new(fd))
    }
    /// The descriptor number in the broker (valid while this lives).
    pub fn raw(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl PartialEq for SharedFd {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
impl Eq for SharedFd {}

impl fmt::Debug for SharedFd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fd {}", self.raw())
    }
}

/// How another process maps an allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Handle {
    /// A file descriptor, sent only over the ticket socket with `SCM_RIGHTS`.
    Fd {
        kind: MemoryKind,
        fd: SharedFd,
        /// Identifies the memory object (random, per object).
        block_id: u64,
        /// Size of the memory object.
        size: u64,
    },
}

/// Why a device operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("device out of memory: asked for {requested} bytes, {free} free")]
    OutOfMemory { requested: u64, free: u64 },
    #[error("invalid allocation size {0}")]
    InvalidSize(u64),
    #[error("unknown allocation {0}")]
    UnknownAllocation(u64),
    #[error("out of range access: offset {offset} + {len} > {bytes}")]
    OutOfRange { offset: u64, len: u64, bytes: u64 },
    #[error("CUDA driver call {call} failed: {message}")]
    Driver { call: &'static str, message: String },
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    #[error("the device thread has stopped")]
    ThreadGone,
}
