//! A reserved address range of this process that memory is mapped over, unmapped and
//! mapped again at the same addresses: a [`crate::Resident`]'s, and a retained block's
//! (`retained.rs`) when a resident's lease was released with its mapping kept. Host
//! memory: an anonymous `PROT_NONE` reservation a memfd is mapped over with `MAP_FIXED`;
//! CUDA VMM memory (feature `cuda`): a [`crate::cuda::VaRange`].

#[cfg(feature = "cuda")]
use std::fmt;
use std::os::fd::BorrowedFd;

use crate::error::ClientError;

/// A reserved address range of this process.
pub(crate) enum Range {
    Host {
        addr: usize,
        len: usize,
    },
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::VaRange),
}

/// How a CUDA resident's contents travel to and from its host-tier lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Staging {
    /// The host lease's mapping is page-locked (`cuMemHostRegister`) for each copy, so the
    /// DMA goes straight into it; a registration that fails falls back to
    /// [`Staging::Pageable`].
    #[default]
    Pinned,
    /// A plain copy to and from pageable memory (the driver stages it through a buffer
    /// of its own).
    Pageable,
}

impl Staging {
    /// `GPU_BROKER_SLEEP_STAGING` (`pinned` or `pageable`; anything else: the default).
    pub(crate) fn from_env() -> Staging {
        match std::env::var("GPU_BROKER_SLEEP_STAGING").as_deref() {
            Ok("pageable") => Staging::Pageable,
            _ => Staging::Pinned,
        }
    }
}

pub(crate) fn os_err(what: &str) -> ClientError {
    let e = std::io::Error::last_os_error();
    ClientError::Io(std::io::Error::new(e.kind(), format!("{what}: {e}")))
}

#[cfg(feature = "cuda")]
pub(crate) fn cuda_err(e: impl fmt::Display) -> ClientError {
    ClientError::Cuda(e.to_string())
}

impl Range {
    pub(crate) fn reserve_host(len: u64) -> Result<Range, ClientError> {
        let n = usize::try_from(len)
            .map_err(|_| ClientError::Protocol(format!("{len} bytes do not fit this process")))?;
        // SAFETY: a fresh anonymous reservation; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                n,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("reserving an address range"));
        }
        Ok(Range::Host {
            addr: p as usize,
            len: n,
        })
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> u64 {
        match self {
            Range::Host { len, .. } => *len as u64,
            #[cfg(feature = "cuda")]
            Range::Cuda(r) => r.len(),
        }
    }

    pub(crate) fn addr(&self) -> u64 {
        match self {
            Range::Host { addr, .. } => *addr as u64,
            #[cfg(feature = "cuda")]
            Range::Cuda(r) => r.device_ptr(),
        }
    }

    /// Maps the memory of descriptor `fd` (at least the range's length) over the range.
    pub(crate) fn map(&mut self, fd: BorrowedFd<'_>) -> Result<(), ClientError> {
        match self {
            Range::Host { addr, len } => {
                use std::os::fd::AsRawFd;
                // SAFETY: replaces our own reservation (or mapping) of `len` bytes at `addr`
                // with the lease's memfd, which is at least `len` bytes (its lease size).
                let p = unsafe {
                    libc::mmap(
                        *addr as *mut libc::c_void,
                        *len,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED | libc::MAP_FIXED,
                        fd.as_raw_fd(),
                        0,
                    )
                };
                if p == libc::MAP_FAILED {
                    return Err(os_err("mapping a lease at its kept address"));
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Range::Cuda(r) => r.map(fd).map_err(cuda_err),
        }
    }

    /// Unmaps the memory, keeping the range reserved.
    pub(crate) fn unmap(&mut self) -> Result<(), ClientError> {
        match self {
            Range::Host { addr, len } => {
                // SAFETY: replaces our own mapping at `addr` with a fresh reservation.
                let p = unsafe {
                    libc::mmap(
                        *addr as *mut libc::c_void,
                        *len,
                        libc::PROT_NONE,
                        libc::MAP_PRIVATE
                            | libc::MAP_ANONYMOUS
                            | libc::MAP_NORESERVE
                            | libc::MAP_FIXED,
                        -1,
                        0,
                    )
                };
                if p == libc::MAP_FAILED {
                    return Err(os_err("unmapping a sleeping lease"));
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Range::Cuda(r) => r.unmap().map_err(cuda_err),
        }
    }

    /// Copies the mapped memory into `dst`.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn save(&self, dst: &mut [u8], staging: Staging) -> Result<(), ClientError> {
        match self {
            Range::Host { addr, len } => {
                // SAFETY: `len` mapped, readable bytes at `addr`; `dst` is as long (checked
                // by the caller) and another mapping.
                unsafe {
                    std::ptr::copy_nonoverlapping(*addr as *const u8, dst.as_mut_ptr(), *len)
                };
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Range::Cuda(r) => {
                if staging == Staging::Pinned {
                    match r.copy_to_host_pinned(dst) {
                        Ok(()) => return Ok(()),
                        Err(e) => {
                            tracing::debug!(error = %e, "pinned staging failed; copying pageable")
                        }
                    }
                }
                r.copy_to_host(dst).map_err(cuda_err)
            }
        }
    }

    /// Copies `src` into the mapped memory.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn restore(&self, src: &[u8], staging: Staging) -> Result<(), ClientError> {
        match self {
            Range::Host { addr, len } => {
                // SAFETY: `len` mapped, writable bytes at `addr`; `src` is as long.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), *addr as *mut u8, *len) };
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Range::Cuda(r) => {
                if staging == Staging::Pinned {
                    match r.copy_from_host_pinned(src) {
                        Ok(()) => return Ok(()),
                        Err(e) => {
                            tracing::debug!(error = %e, "pinned staging failed; copying pageable")
                        }
                    }
                }
                r.copy_from_host(src).map_err(cuda_err)
            }
        }
    }
}

impl Drop for Range {
    fn drop(&mut self) {
        // A CUDA range frees itself (`VaRange`'s drop).
        #[allow(irrefutable_let_patterns)]
        if let Range::Host { addr, len } = self {
            // SAFETY: our own range (mapped or reserved), unmapped once.
            unsafe { libc::munmap(*addr as *mut libc::c_void, *len) };
        }
    }
}
