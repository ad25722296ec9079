//! The worker side of a CUDA lease: import the CUDA VMM memory of an fd lease
//! (`cuMemImportFromShareableHandle`, reserve an address range, `cuMemMap`,
//! `cuMemSetAccess`) and get a device pointer usable in this process (feature `cuda`;
//! libcuda is loaded at run time, so this builds and links on machines without CUDA).
//! Legacy CUDA IPC handles are not opened: brokers no longer serve them
//! (`docs/security.md`).
//!
//! - **VMM imports are cached per block** (`(device, block_id)`): mapping a lease again
//!   while a mapping of its block lives returns the same pointer. Dropping the last mapping
//!   unmaps, releases the imported handle and frees the address range, in that order; the
//!   descriptor itself stays with the [`crate::Lease`] and is closed when it goes.
//!
//! # Rules this module follows (and you must too)
//!
//! - **Close before release.** Drop every mapping of a lease (so the import is released)
//!   before calling `ReleaseLease`; the broker frees or reuses the memory after that.
//! - **Contexts.** Mappings live in the device's *primary* context (the one the CUDA
//!   runtime, PyTorch and CuPy use). [`map_vmm`] leaves that context current on the calling
//!   thread, as the runtime would, so the pointer is usable at once; the copy helpers and
//!   the close push and pop it and leave the caller's current context as it was.

use cudarc::driver::sys::{self, CUcontext, CUdevice, CUdeviceptr, CUresult};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::sync::{LazyLock, OnceLock};

/// Why a CUDA mapping could not be made or used.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No CUDA driver library, or the driver cannot be initialised.
    #[error("CUDA is not available in this process: {0}")]
    Unavailable(String),
    /// The device ordinal does not exist here.
    #[error("CUDA device {device} does not exist (the driver sees {count})")]
    NoSuchDevice { device: u32, count: u32 },
    /// A lease size of zero.
    #[error("invalid lease size {0}")]
    InvalidSize(u64),
    /// The lease claims more bytes than the memory object behind the descriptor has.
    #[error(
        "the lease is {bytes} bytes but the memory object behind its descriptor has only {alloc_bytes}"
    )]
    SizeMismatch { bytes: u64, alloc_bytes: u64 },
    /// A copy outside the mapping.
    #[error("out of range access: offset {offset} + {len} > {bytes}")]
    OutOfRange { offset: u64, len: u64, bytes: u64 },
    /// Any other driver failure, with the call, the numeric `CUresult` and its text.
    #[error("CUDA driver call {call} failed: {message}")]
    Driver {
        call: &'static str,
        code: u32,
        message: String,
    },
}

fn lib_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen libcuda by its usual names.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// True when libcuda is present, `cuInit` succeeds and at least one device exists. Never
/// panics.
pub fn is_available() -> bool {
    std::panic::catch_unwind(|| init().and_then(|()| device_count()).is_ok_and(|n| n > 0))
        .unwrap_or(false)
}

fn init() -> Result<(), CudaError> {
    if !lib_present() {
        return Err(CudaError::Unavailable(
            "libcuda (the CUDA driver library) was not found".to_string(),
        ));
    }
    // SAFETY: library present; cuInit may be called repeatedly.
    check("cuInit", unsafe { sys::cuInit(0) })
}

fn device_count() -> Result<u32, CudaError> {
    let mut n: std::ffi::c_int = 0;
    // SAFETY: library loaded and initialised; valid out pointer.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(u32::try_from(n).unwrap_or(0))
}

/// `NAME (description)` for a driver result.
fn describe(code: CUresult) -> String {
    let mut text = None;
    if lib_present() {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: library loaded; on success `p` is a static NUL-terminated string.
        if unsafe { sys::cuGetErrorString(code, &mut p) } == CUresult::CUDA_SUCCESS && !p.is_null()
        {
            // SAFETY: see above.
            text = Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
        }
    }
    format_driver_error(code, text.as_deref())
}

fn format_driver_error(code: CUresult, description: Option<&str>) -> String {
    match description {
        Some(d) if !d.is_empty() => format!("{code:?} ({d})"),
        _ => format!("{code:?}"),
    }
}

fn driver_error(call: &'static str, rc: CUresult) -> CudaError {
    CudaError::Driver {
        call,
        code: rc as u32,
        message: describe(rc),
    }
}

fn check(call: &'static str, rc: CUresult) -> Result<(), CudaError> {
    if rc == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_error(call, rc))
    }
}

/// What an import is keyed by: a VMM block's id (per device).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Key {
    Vmm(u32, u64),
    /// A read-only import of a shared lease (never shared with a writable one).
    VmmReadOnly(u32, u64),
    /// A read-write import of a shared lease (never shared either).
    VmmImport(u32, u64),
}

/// One imported VMM block in this process.
struct Entry {
    ptr: CUdeviceptr,
    count: usize,
    /// The imported handle.
    handle: sys::CUmemGenericAllocationHandle,
    /// The mapped length.
    len: usize,
}

static OPEN: LazyLock<Mutex<HashMap<Key, Entry>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// How many live [`CudaMapping`]s share the import of VMM block `block_id` on `device`.
pub fn vmm_import_count(block_id: u64, device: u32) -> usize {
    OPEN.lock()
        .get(&Key::Vmm(device, block_id))
        .map_or(0, |e| e.count)
}

/// A device pointer to a leased allocation: an imported VMM block. Dropping the last
/// mapping of a block unmaps it, releases the import and frees the address range.
/// `Send + Sync`.
#[derive(Debug)]
pub struct CudaMapping {
    device: u32,
    cu_device: CUdevice,
    /// The retained primary context, as an address (kept `Send`/`Sync`).
    ctx: usize,
    key: Key,
    ptr: CUdeviceptr,
    len: u64,
    alloc_bytes: u64,
    released: bool,
}

/// Pushes a context on the calling thread and pops it when dropped.
struct Pushed;

impl Pushed {
    fn new(ctx: usize) -> Result<Pushed, CudaError> {
        // SAFETY: `ctx` is a primary context retained by a live mapping.
        check("cuCtxPushCurrent", unsafe {
            sys::cuCtxPushCurrent_v2(ctx as CUcontext)
        })?;
        Ok(Pushed)
    }
}

impl Drop for Pushed {
    fn drop(&mut self) {
        let mut old: CUcontext = std::ptr::null_mut();
        // SAFETY: balances the push in `new`.
        let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut old) };
    }
}

/// Retains `device`'s primary context and makes it current; returns (CUdevice, context).
fn retain_primary(device: u32) -> Result<(CUdevice, CUcontext), CudaError> {
    init()?;
    let count = device_count()?;
    if device >= count {
        return Err(CudaError::NoSuchDevice { device, count });
    }
    let ord =
        std::ffi::c_int::try_from(device).map_err(|_| CudaError::NoSuchDevice { device, count })?;
    let mut dev: CUdevice = 0;
    // SAFETY: initialised; valid out pointer.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ord) })?;
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: valid device and out pointer.
    check("cuDevicePrimaryCtxRetain", unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
    })?;
    // SAFETY: `ctx` was just retained.
    if let Err(e) = check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) }) {
        // SAFETY: balances the retain above.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(dev) };
        return Err(e);
    }
    Ok((dev, ctx))
}

/// Imports the CUDA VMM memory of an fd lease on `device`: the descriptor `fd` (the
/// lease's: it is not consumed or closed), a memory object of `size` bytes identified by
/// `block_id`, of which the lease is the first `bytes`. An import of the same block that is
/// still mapped in this process is shared (same pointer). Leaves the device's primary
/// context current on the calling thread.
pub fn map_vmm(
    fd: std::os::fd::BorrowedFd<'_>,
    device: u32,
    bytes: u64,
    size: u64,
    block_id: u64,
) -> Result<CudaMapping, CudaError> {
    map_vmm_with(fd, device, bytes, size, Key::Vmm(device, block_id))
}

/// Like [`map_vmm`] with read access only (`cuMemSetAccess` `PROT_READ`): how this client
/// maps an imported shared lease. The driver enforces the access this process sets; the
/// broker cannot stop another importer from setting read-write (`docs/security.md`).
/// Never shares a mapping with a writable import of the same block.
pub fn map_vmm_read_only(
    fd: std::os::fd::BorrowedFd<'_>,
    device: u32,
    bytes: u64,
    size: u64,
) -> Result<CudaMapping, CudaError> {
    // A key of its own for every call: nothing is shared with another mapping.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    map_vmm_with(fd, device, bytes, size, Key::VmmReadOnly(device, id))
}

/// Like [`map_vmm_read_only`] with read and write access: how a process maps a lease its
/// own tenant published for it (e.g. a CUDA tensor sent through `torch.multiprocessing`),
/// where both sides write. A mapping of its own, never shared.
pub fn map_vmm_import(
    fd: std::os::fd::BorrowedFd<'_>,
    device: u32,
    bytes: u64,
    size: u64,
) -> Result<CudaMapping, CudaError> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    map_vmm_with(fd, device, bytes, size, Key::VmmImport(device, id))
}

fn map_vmm_with(
    fd: std::os::fd::BorrowedFd<'_>,
    device: u32,
    bytes: u64,
    size: u64,
    key: Key,
) -> Result<CudaMapping, CudaError> {
    use std::os::fd::AsRawFd;
    if bytes == 0 {
        return Err(CudaError::InvalidSize(bytes));
    }
    if bytes > size {
        return Err(CudaError::SizeMismatch {
            bytes,
            alloc_bytes: size,
        });
    }
    let len = usize::try_from(size).map_err(|_| CudaError::InvalidSize(size))?;
    let (cu_device, ctx) = retain_primary(device)?;
    let release_ctx = || {
        // SAFETY: balances the retain in `retain_primary`.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(cu_device) };
    };
    let read_only = matches!(key, Key::VmmReadOnly(..));
    let mut open = OPEN.lock();
    let ptr = match open.get_mut(&key) {
        Some(e) => {
            e.count += 1;
            e.ptr
        }
        None => match import_and_map(fd.as_raw_fd(), cu_device, len, read_only) {
            Ok((ptr, handle)) => {
                open.insert(
                    key,
                    Entry {
                        ptr,
                        count: 1,
                        handle,
                        len,
                    },
                );
                ptr
            }
            Err(e) => {
                release_ctx();
                return Err(e);
            }
        },
    };
    drop(open);
    Ok(CudaMapping {
        device,
        cu_device,
        ctx: ctx as usize,
        key,
        ptr,
        len: bytes,
        alloc_bytes: size,
        released: false,
    })
}

/// Import, reserve, map, set access; undoes what it did on failure. Context current.
fn import_and_map(
    fd: std::os::fd::RawFd,
    cu_device: CUdevice,
    len: usize,
    read_only: bool,
) -> Result<(CUdeviceptr, sys::CUmemGenericAllocationHandle), CudaError> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: the driver reads the descriptor number (passed as the pointer value, as the
    // API defines for POSIX descriptors) and does not take ownership of it.
    check("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            fd as isize as *mut c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    })?;
    let mut ptr: CUdeviceptr = 0;
    // SAFETY: valid out pointer; default alignment (the allocation granularity).
    if let Err(e) = check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut ptr, len, 0, 0, 0)
    }) {
        // SAFETY: releases the import just made.
        let _ = unsafe { sys::cuMemRelease(handle) };
        return Err(e);
    }
    // SAFETY: the reserved range is `len` bytes; the handle's allocation is `len` bytes.
    if let Err(e) = check("cuMemMap", unsafe { sys::cuMemMap(ptr, len, 0, handle, 0) }) {
        // SAFETY: undo the reservation and the import above.
        unsafe {
            let _ = sys::cuMemAddressFree(ptr, len);
            let _ = sys::cuMemRelease(handle);
        }
        return Err(e);
    }
    let access = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: cu_device,
        },
        flags: if read_only {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ
        } else {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        },
    };
    // SAFETY: the mapped range; one valid access descriptor.
    if let Err(e) = check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(ptr, len, &access, 1)
    }) {
        // SAFETY: undo the mapping, the reservation and the import above.
        unsafe {
            let _ = sys::cuMemUnmap(ptr, len);
            let _ = sys::cuMemAddressFree(ptr, len);
            let _ = sys::cuMemRelease(handle);
        }
        return Err(e);
    }
    Ok((ptr, handle))
}

impl CudaMapping {
    /// The device pointer (`CUdeviceptr`) of the start of the leased memory, valid in the
    /// device's primary context of this process while the mapping lives.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Usable length in bytes (the lease size).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Same as [`CudaMapping::len`].
    pub fn bytes(&self) -> u64 {
        self.len
    }

    /// Never true for a mapping made by this module.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size of the whole allocation behind the handle (>= `len`).
    pub fn allocation_bytes(&self) -> u64 {
        self.alloc_bytes
    }

    /// The CUDA device ordinal.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// The block id of a VMM import (`None` for imports of shared leases).
    pub fn block_id(&self) -> Option<u64> {
        match self.key {
            Key::Vmm(_, b) => Some(b),
            Key::VmmReadOnly(..) | Key::VmmImport(..) => None,
        }
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), CudaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(CudaError::OutOfRange {
                offset,
                len,
                bytes: self.len,
            }),
        }
    }

    /// Copies `data` to the device at `offset`; complete when it returns.
    pub fn copy_from_host(&self, offset: u64, data: &[u8]) -> Result<(), CudaError> {
        self.check_range(offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(());
        }
        let _ctx = Pushed::new(self.ctx)?;
        // SAFETY: the range lies inside the open mapping; `data` is readable for its length.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(
                self.ptr.wrapping_add(offset),
                data.as_ptr() as *const c_void,
                data.len(),
            )
        })?;
        // A copy from pageable memory may return before its DMA lands; wait for it.
        // SAFETY: the null stream of the current (pushed) context.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(std::ptr::null_mut())
        })
    }

    /// Copies `out.len()` bytes at `offset` from the device into `out`.
    pub fn copy_to_host(&self, offset: u64, out: &mut [u8]) -> Result<(), CudaError> {
        self.check_range(offset, out.len() as u64)?;
        if out.is_empty() {
            return Ok(());
        }
        let _ctx = Pushed::new(self.ctx)?;
        // SAFETY: the range lies inside the open mapping; `out` is writable for its length.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(
                out.as_mut_ptr() as *mut c_void,
                self.ptr.wrapping_add(offset),
                out.len(),
            )
        })
    }

    /// Drops this mapping now and reports a failure to close the handle (dropping does the
    /// same but can only log).
    pub fn close(mut self) -> Result<(), CudaError> {
        self.release()
    }

    fn release(&mut self) -> Result<(), CudaError> {
        if self.released {
            return Ok(());
        }
        self.released = true;
        let mut result = Ok(());
        {
            let mut open = OPEN.lock();
            let last = match open.get_mut(&self.key) {
                Some(e) => {
                    e.count -= 1;
                    e.count == 0
                }
                None => false,
            };
            if last {
                if let Some(e) = open.remove(&self.key) {
                    // SAFETY: the last user of this import, in its context: unmap, then
                    // release the imported handle, then free the address range; once.
                    result = Pushed::new(self.ctx).and_then(|_ctx| unsafe {
                        let unmapped = check("cuMemUnmap", sys::cuMemUnmap(e.ptr, e.len));
                        let released = check("cuMemRelease", sys::cuMemRelease(e.handle));
                        let freed = check("cuMemAddressFree", sys::cuMemAddressFree(e.ptr, e.len));
                        unmapped.and(released).and(freed)
                    });
                }
            }
        }
        // SAFETY: balances the retain made when this mapping was opened.
        let rc = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.cu_device) };
        result.and(check("cuDevicePrimaryCtxRelease", rc))
    }
}

impl Drop for CudaMapping {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            tracing::warn!(device = self.device, error = %e, "closing a CUDA mapping failed");
        }
    }
}

/// Host memory (e.g. the mapping of a host-fallback lease) registered with CUDA for
/// zero-copy access: kernels read and write it through [`HostRegistration::device_ptr`].
/// Borrows the memory, so it cannot be unmapped while registered; dropping it unregisters.
#[derive(Debug)]
pub struct HostRegistration<'a> {
    cu_device: CUdevice,
    ctx: usize,
    host: usize,
    len: u64,
    dev_ptr: CUdeviceptr,
    _mem: std::marker::PhantomData<&'a mut [u8]>,
}

/// Registers `mem` (page-locked, portable, mapped into `device`'s address space) and
/// returns its device pointer. Leaves the device's primary context current.
pub fn register_host(mem: &mut [u8], device: u32) -> Result<HostRegistration<'_>, CudaError> {
    if mem.is_empty() {
        return Err(CudaError::InvalidSize(0));
    }
    let (cu_device, ctx) = retain_primary(device)?;
    let host = mem.as_mut_ptr();
    let flags =
        (sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP) as std::ffi::c_uint;
    // SAFETY: `host..host+len` is memory this process owns, borrowed for the registration's
    // lifetime; the primary context is current.
    let rc = unsafe { sys::cuMemHostRegister_v2(host as *mut c_void, mem.len(), flags) };
    if let Err(e) = check("cuMemHostRegister", rc) {
        // SAFETY: balances the retain in `retain_primary`.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(cu_device) };
        return Err(e);
    }
    let mut dev_ptr: CUdeviceptr = 0;
    // SAFETY: the range was just registered with DEVICEMAP; valid out pointer.
    let rc = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev_ptr, host as *mut c_void, 0) };
    if let Err(e) = check("cuMemHostGetDevicePointer", rc) {
        // SAFETY: undo the registration and the retain above.
        unsafe {
            let _ = sys::cuMemHostUnregister(host as *mut c_void);
            let _ = sys::cuDevicePrimaryCtxRelease_v2(cu_device);
        }
        return Err(e);
    }
    Ok(HostRegistration {
        cu_device,
        ctx: ctx as usize,
        host: host as usize,
        len: mem.len() as u64,
        dev_ptr,
        _mem: std::marker::PhantomData,
    })
}

impl HostRegistration<'_> {
    /// The device-side address of the host memory.
    pub fn device_ptr(&self) -> u64 {
        self.dev_ptr
    }

    /// Registered length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false (empty memory is refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Has the GPU set every byte to `value` through the device pointer (a `cuMemsetD8` on
    /// the device side, then a synchronize): proof that device writes land in host memory.
    pub fn device_memset(&self, value: u8) -> Result<(), CudaError> {
        let _ctx = Pushed::new(self.ctx)?;
        // SAFETY: the device pointer maps `len` registered bytes; the context is current.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(self.dev_ptr, value, self.len as usize)
        })?;
        // SAFETY: the context is current.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }
}

impl Drop for HostRegistration<'_> {
    fn drop(&mut self) {
        if let Ok(_ctx) = Pushed::new(self.ctx) {
            // SAFETY: registered in `register_host`, unregistered once here.
            let rc = unsafe { sys::cuMemHostUnregister(self.host as *mut c_void) };
            if let Err(e) = check("cuMemHostUnregister", rc) {
                tracing::warn!(error = %e, "unregistering host memory failed");
            }
        }
        // SAFETY: balances the retain in `register_host`.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.cu_device) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_maps_on_the_local_ordinal_of_its_uuid() {
        let local = local_uuids();
        if local.is_empty() {
            // No driver here: the broker's index is the ordinal.
            assert_eq!(
                local_ordinal(3, "GPU-0a1b2c3d-0000-1111-2222-333344445555"),
                3
            );
            assert_eq!(ordinal_uuid(0), None);
        } else {
            // Each local device is found by its own UUID, whatever the broker's index.
            for (i, u) in local.iter().enumerate() {
                if let Some(u) = u {
                    assert!(u.starts_with("GPU-") && u.len() == 40, "{u}");
                    assert_eq!(local_ordinal(99, u), i as u32);
                    assert_eq!(ordinal_uuid(i as u32).as_deref(), Some(u.as_str()));
                }
            }
        }
    }

    #[test]
    fn without_a_driver_nothing_panics() {
        let available = is_available();
        if !lib_present() {
            assert!(!available);
            let f = std::fs::File::open("/dev/null").unwrap();
            use std::os::fd::AsFd;
            match map_vmm(f.as_fd(), 0, 4096, 4096, 7) {
                Err(CudaError::Unavailable(msg)) => assert!(msg.contains("libcuda")),
                other => panic!("expected Unavailable, got {other:?}"),
            }
            assert_eq!(vmm_import_count(7, 0), 0);
        }
    }

    #[test]
    fn vmm_sizes_are_checked_before_the_driver() {
        let f = std::fs::File::open("/dev/null").unwrap();
        use std::os::fd::AsFd;
        assert!(matches!(
            map_vmm(f.as_fd(), 0, 0, 4096, 1),
            Err(CudaError::InvalidSize(0))
        ));
        assert!(matches!(
            map_vmm(f.as_fd(), 0, 8192, 4096, 1),
            Err(CudaError::SizeMismatch { .. })
        ));
        assert_eq!(vmm_import_count(1, 0), 0);
    }

    #[test]
    fn driver_errors_name_the_call_and_the_code() {
        match driver_error(
            "cuMemImportFromShareableHandle",
            CUresult::CUDA_ERROR_INVALID_VALUE,
        ) {
            CudaError::Driver { call, code, .. } => {
                assert_eq!(call, "cuMemImportFromShareableHandle");
                assert_eq!(code, 1);
            }
            other => panic!("expected Driver, got {other:?}"),
        }
    }

    #[test]
    fn driver_error_text_has_name_and_description() {
        assert_eq!(
            format_driver_error(CUresult::CUDA_ERROR_OUT_OF_MEMORY, Some("out of memory")),
            "CUDA_ERROR_OUT_OF_MEMORY (out of memory)"
        );
        assert_eq!(
            format_driver_error(CUresult::CUDA_ERROR_ALREADY_MAPPED, None),
            "CUDA_ERROR_ALREADY_MAPPED"
        );
    }

    #[test]
    fn mappings_are_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<CudaMapping>();
    }
}

/// A reserved device virtual address range that VMM memory can be mapped into, unmapped
/// and mapped again at the same address (what a sleeping lease keeps: pointers into it stay
/// valid across sleep and wake). Holds a retain of the device's primary context; dropping
/// it unmaps what is mapped, releases the import and frees the range.
#[derive(Debug)]
pub struct VaRange {
    device: u32,
    cu_device: CUdevice,
    ctx: usize,
    ptr: CUdeviceptr,
    len: usize,
    /// The imported handle mapped into the range now.
    mapped: Option<sys::CUmemGenericAllocationHandle>,
}

impl VaRange {
    /// Reserves `len` bytes (a multiple of the allocation granularity) of `device`'s
    /// address space.
    pub fn reserve(device: u32, len: u64) -> Result<VaRange, CudaError> {
        let n = usize::try_from(len).map_err(|_| CudaError::InvalidSize(len))?;
        if n == 0 {
            return Err(CudaError::InvalidSize(len));
        }
        let (cu_device, ctx) = retain_primary(device)?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: valid out pointer; default alignment (the allocation granularity).
        if let Err(e) = check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, n, 0, 0, 0)
        }) {
            // SAFETY: balances the retain above.
            let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(cu_device) };
            return Err(e);
        }
        Ok(VaRange {
            device,
            cu_device,
            ctx: ctx as usize,
            ptr,
            len: n,
            mapped: None,
        })
    }

    /// Start of the range.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Length of the range in bytes.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// True for an empty range (never: `reserve` refuses zero).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Is memory mapped into the range now?
    pub fn is_mapped(&self) -> bool {
        self.mapped.is_some()
    }

    /// Imports the VMM memory of `fd` (an fd lease's descriptor, not consumed) and maps the
    /// range's length of it at the range's start, read-write for the device.
    pub fn map(&mut self, fd: std::os::fd::BorrowedFd<'_>) -> Result<(), CudaError> {
        use std::os::fd::AsRawFd;
        if self.mapped.is_some() {
            self.unmap()?;
        }
        let _ctx = Pushed::new(self.ctx)?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: the driver reads the descriptor number and does not take ownership.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as isize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        // SAFETY: the reserved range; the imported allocation is at least `len` bytes (the
        // caller's lease is the range's size).
        if let Err(e) = check("cuMemMap", unsafe {
            sys::cuMemMap(self.ptr, self.len, 0, handle, 0)
        }) {
            // SAFETY: releases the import just made.
            let _ = unsafe { sys::cuMemRelease(handle) };
            return Err(e);
        }
        let access = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.cu_device,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range just mapped; one valid access descriptor.
        if let Err(e) = check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(self.ptr, self.len, &access, 1)
        }) {
            // SAFETY: undo the mapping and the import above.
            unsafe {
                let _ = sys::cuMemUnmap(self.ptr, self.len);
                let _ = sys::cuMemRelease(handle);
            }
            return Err(e);
        }
        self.mapped = Some(handle);
        Ok(())
    }

    /// Unmaps the memory and releases its import; the range stays reserved. Waits for the
    /// device's queued work first (kernels may still use the memory).
    pub fn unmap(&mut self) -> Result<(), CudaError> {
        let Some(handle) = self.mapped.take() else {
            return Ok(());
        };
        let _ctx = Pushed::new(self.ctx)?;
        // SAFETY: the context is current; then unmap and release the handle mapped here.
        unsafe {
            let synced = check("cuCtxSynchronize", sys::cuCtxSynchronize());
            let unmapped = check("cuMemUnmap", sys::cuMemUnmap(self.ptr, self.len));
            let released = check("cuMemRelease", sys::cuMemRelease(handle));
            synced.and(unmapped).and(released)
        }
    }

    /// Copies the whole range to `dst` (its length), device to host.
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<(), CudaError> {
        self.check_copy(dst.len())?;
        let _ctx = Pushed::new(self.ctx)?;
        // SAFETY: `dst` has `len` writable bytes; the range is mapped (checked).
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr, self.len)
        })
    }

    /// Copies `src` (the range's length) into the range, host to device.
    pub fn copy_from_host(&self, src: &[u8]) -> Result<(), CudaError> {
        self.check_copy(src.len())?;
        let _ctx = Pushed::new(self.ctx)?;
        // SAFETY: `src` has `len` readable bytes; the range is mapped (checked).
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(self.ptr, src.as_ptr().cast(), self.len)
        })
    }

    fn check_copy(&self, n: usize) -> Result<(), CudaError> {
        if self.mapped.is_none() || n != self.len {
            return Err(CudaError::OutOfRange {
                offset: 0,
                len: n as u64,
                bytes: if self.mapped.is_some() {
                    self.len as u64
                } else {
                    0
                },
            });
        }
        Ok(())
    }
}

impl Drop for VaRange {
    fn drop(&mut self) {
        if let Err(e) = self.unmap() {
            tracing::warn!(device = self.device, error = %e, "unmapping a VA range failed");
        }
        if let Ok(_ctx) = Pushed::new(self.ctx) {
            // SAFETY: the range reserved in `reserve`, freed once; nothing is mapped now.
            let _ = unsafe { sys::cuMemAddressFree(self.ptr, self.len) };
        }
        // SAFETY: balances the retain in `reserve`.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.cu_device) };
    }
}

/// Page-locked staging for a [`VaRange`]'s copies: the host memory is registered with CUDA
/// (`cuMemHostRegister`) for the one copy, so the DMA goes straight into (or out of) it
/// instead of through the driver's pageable staging buffer. Registering pins (and faults
/// in) every page first; that is the price, paid once per copy.
impl VaRange {
    /// [`VaRange::copy_to_host`] into `dst` page-locked for the copy.
    pub fn copy_to_host_pinned(&self, dst: &mut [u8]) -> Result<(), CudaError> {
        self.check_copy(dst.len())?;
        let _ctx = Pushed::new(self.ctx)?;
        let _pin = Pinned::new(dst.as_mut_ptr().cast(), dst.len())?;
        // SAFETY: `dst` has `len` writable, registered bytes; the range is mapped.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr, self.len)
        })
    }

    /// [`VaRange::copy_from_host`] from `src` page-locked for the copy (the copy from
    /// page-locked memory is complete when it returns).
    pub fn copy_from_host_pinned(&self, src: &[u8]) -> Result<(), CudaError> {
        self.check_copy(src.len())?;
        let _ctx = Pushed::new(self.ctx)?;
        // The driver only reads through it; the memory is mapped writable by the caller.
        let _pin = Pinned::new(src.as_ptr() as *mut c_void, src.len())?;
        // SAFETY: `src` has `len` readable, registered bytes; the range is mapped.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(self.ptr, src.as_ptr().cast(), self.len)
        })
    }
}

/// Host memory registered with CUDA (in the current context) until dropped.
struct Pinned(*mut c_void);

impl Pinned {
    fn new(ptr: *mut c_void, len: usize) -> Result<Pinned, CudaError> {
        // SAFETY: `ptr..ptr+len` is memory of this process that outlives the guard (the
        // callers borrow it for the copy); a context is current.
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(ptr, len, 0)
        })?;
        Ok(Pinned(ptr))
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: registered in `new`, unregistered once, in the same (still current)
        // context.
        if let Err(e) = check("cuMemHostUnregister", unsafe {
            sys::cuMemHostUnregister(self.0)
        }) {
            tracing::warn!(error = %e, "unregistering staging memory failed");
        }
    }
}

/// The UUID (`GPU-…`, as NVML prints it) of each local CUDA ordinal, read once with
/// `cuDeviceGetUuid_v2` (`None` where the driver does not say; empty without CUDA). The
/// ordinals are this process's: after its `CUDA_VISIBLE_DEVICES`.
pub fn local_uuids() -> &'static [Option<String>] {
    static UUIDS: OnceLock<Vec<Option<String>>> = OnceLock::new();
    UUIDS.get_or_init(|| {
        if init().is_err() {
            return Vec::new();
        }
        let n = device_count().unwrap_or(0);
        (0..n)
            .map(|i| {
                let mut dev: CUdevice = 0;
                // SAFETY: initialised; valid out pointer; i < the device count.
                check("cuDeviceGet", unsafe {
                    sys::cuDeviceGet(&mut dev, i as std::ffi::c_int)
                })
                .ok()?;
                let mut u = sys::CUuuid { bytes: [0; 16] };
                // SAFETY: valid device and out pointer.
                check("cuDeviceGetUuid_v2", unsafe {
                    sys::cuDeviceGetUuid_v2(&mut u, dev)
                })
                .ok()?;
                Some(crate::ordinal::format_uuid(&u.bytes.map(|b| b as u8)))
            })
            .collect()
    })
}

/// The local CUDA ordinal of the broker's device `index` whose UUID is `uuid` (a lease's
/// `device` and `device_uuid`): the ordinal with that UUID, else `index`.
pub fn local_ordinal(index: u32, uuid: &str) -> u32 {
    crate::ordinal::ordinal_for(local_uuids(), uuid, index)
}

/// The UUID of local CUDA ordinal `ordinal`, if known.
pub fn ordinal_uuid(ordinal: u32) -> Option<String> {
    local_uuids().get(ordinal as usize).cloned().flatten()
}
