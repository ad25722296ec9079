//! The `cuda` backend: one real GPU through the CUDA driver API (cudarc's raw `sys` layer,
//! libcuda loaded at run time, so the broker builds and runs on machines without CUDA).
//!
//! A [`CudaDevice`] owns, for one device ordinal: a retained reference to the device's
//! primary context, one non-blocking stream used only for scrubs, and every allocation it
//! made (a map id -> device pointer; whatever is still live when it is dropped is freed).
//!
//! Allocations are **CUDA VMM memory**: `cuMemCreate`
//! with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` at the allocation granularity, mapped
//! into the broker's own address space (reserve, map, set access) so the broker can zero it,
//! and exported once as a file descriptor that stays with the block (a pooled block costs no
//! export). Workers get that descriptor over the ticket socket and import it; the physical
//! memory lives until the last holder (the broker's handle, every import) lets go.
//!
//! The broker never exports legacy CUDA IPC handles (`cuIpcGetMemHandle`): any process on
//! the node can forge them (`docs/security.md`).
//!
//! Driver calls act on the context current on the calling OS thread: open a device with
//! [`CudaDevice::open`] on the thread that will use it (the device thread, see
//! [`super::thread`]); every method also makes the context current again, which is cheap.
//!
//! Without libcuda every entry point returns an error instead of panicking (cudarc panics
//! on the first driver call when the library is missing, so presence is checked first).

use super::{
    check_range, new_block_id, Allocation, BackendKind, Device, DeviceDesc, DeviceError, Handle,
    MemInfo, MemoryKind, SharedFd,
};
use cudarc::driver::sys::{self, CUcontext, CUdevice, CUdeviceptr, CUresult, CUstream};
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::sync::OnceLock;

/// Allocation granularity reported for CUDA devices: 2 MiB (the driver's large-page size;
/// leases are rounded up to it by the pool).
pub const CUDA_GRANULARITY: u64 = 2 << 20;

/// Whether libcuda can be loaded. Cached: checked once per process.
fn lib_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries to dlopen the library by its usual names.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Why the CUDA backend cannot be used, or `None` when a driver and at least one GPU are
/// present. Never panics.
pub fn unavailable_reason() -> Option<String> {
    if !lib_present() {
        return Some("libcuda (the CUDA driver library) was not found".to_string());
    }
    match std::panic::catch_unwind(device_count) {
        Ok(Ok(0)) => Some("the CUDA driver reports no devices".to_string()),
        Ok(Ok(_)) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(_) => Some("the CUDA driver library could not be used (panic while probing)".into()),
    }
}

/// True when libcuda is present, `cuInit` succeeds and there is at least one device.
/// Never panics.
pub fn is_available() -> bool {
    unavailable_reason().is_none()
}

/// Number of CUDA devices the driver sees.
pub fn device_count() -> Result<u32, DeviceError> {
    init()?;
    let mut n: std::ffi::c_int = 0;
    // SAFETY: the library is loaded (checked by `init`) and `n` is a valid out pointer.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(u32::try_from(n).unwrap_or(0))
}

/// Loads the library (or says why not) and runs `cuInit(0)`.
fn init() -> Result<(), DeviceError> {
    if !lib_present() {
        return Err(DeviceError::Unavailable(
            "libcuda (the CUDA driver library) was not found".to_string(),
        ));
    }
    // SAFETY: the library is present; cuInit may be called any number of times.
    check("cuInit", unsafe { sys::cuInit(0) })
}

/// Human-readable text for a driver result: its name (e.g. `CUDA_ERROR_OUT_OF_MEMORY`)
/// and, when the driver can describe it, the description.
fn describe(code: CUresult) -> String {
    let text = if lib_present() {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: the library is loaded; on success `p` points at a static C string.
        let rc = unsafe { sys::cuGetErrorString(code, &mut p) };
        if rc == CUresult::CUDA_SUCCESS && !p.is_null() {
            // SAFETY: the driver returned a NUL-terminated string with static lifetime.
            Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        } else {
            None
        }
    } else {
        None
    };
    format_driver_error(code, text.as_deref())
}

/// `NAME (description)`, or just `NAME` without a description. (The enum's `Debug` is the
/// driver's own name for the code, so `cuGetErrorName` adds nothing.)
fn format_driver_error(code: CUresult, description: Option<&str>) -> String {
    match description {
        Some(d) if !d.is_empty() => format!("{code:?} ({d})"),
        _ => format!("{code:?}"),
    }
}

/// Maps a driver result to `Ok` or `DeviceError::Driver`.
fn check(call: &'static str, rc: CUresult) -> Result<(), DeviceError> {
    if rc == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DeviceError::Driver {
            call,
            message: describe(rc),
        })
    }
}

/// A live allocation as this device recorded it.
#[derive(Clone, Debug)]
struct Live {
    /// The address handed out in its `Allocation` (0 for kept memory: see `mapping`).
    ptr: CUdeviceptr,
    bytes: u64,
    /// Where it is mapped in the broker and its VMM handle. Memory taken back from a
    /// previous broker ([`Device::adopt`]) is imported and mapped only when the broker
    /// first touches it (a scrub, read or write; a kept block is freed when its lease
    /// ends, never reused, so mostly never): importing and mapping each of thousands of
    /// kept blocks (~100 us each) would hold up a restart's serving.
    mapping: Option<Mapping>,
    /// Its exported descriptor.
    vmm: Vmm,
}

/// An allocation's mapping in the broker's address space.
#[derive(Clone, Copy, Debug)]
struct Mapping {
    ptr: CUdeviceptr,
    handle: sys::CUmemGenericAllocationHandle,
}

/// The VMM side of an allocation.
#[derive(Clone, Debug)]
struct Vmm {
    fd: SharedFd,
    block_id: u64,
}

/// One GPU, driven through its primary context. See the module documentation.
pub struct CudaDevice {
    desc: DeviceDesc,
    dev: CUdevice,
    ctx: CUcontext,
    stream: CUstream,
    next_id: u64,
    live: HashMap<u64, Live>,
    /// The device number of the driver's control device (`/dev/nvidiactl`), which every
    /// exported VMM descriptor is: a kept descriptor must be one (read once, at open).
    control_rdev: Option<u64>,
}

// SAFETY: the context and stream are opaque driver handles that are valid on any thread once
// the context is made current there, which every method does. A `CudaDevice` is moved onto
// its device thread once and then used only from there (`Device` takes `&mut self`).
unsafe impl Send for CudaDevice {}

impl CudaDevice {
    /// Opens device `ordinal` for VMM memory exported as file descriptors: retains its
    /// primary context, makes it current on the calling thread and creates the scrub stream.
    /// Call it on the thread that will use the device.
    pub fn open(ordinal: u32) -> Result<CudaDevice, DeviceError> {
        init()?;
        let ord = std::ffi::c_int::try_from(ordinal)
            .map_err(|_| DeviceError::Unavailable(format!("no CUDA device {ordinal}")))?;
        let count = device_count()?;
        if ordinal >= count {
            return Err(DeviceError::Unavailable(format!(
                "no CUDA device {ordinal}: the driver sees {count}"
            )));
        }
        let mut dev: CUdevice = 0;
        // SAFETY: library loaded and initialised; valid out pointer.
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ord) })?;

        let mut name_buf = [0 as c_char; 256];
        // SAFETY: the buffer is 256 bytes and we pass its length; the driver NUL-terminates.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(
                name_buf.as_mut_ptr(),
                name_buf.len() as std::ffi::c_int,
                dev,
            )
        })?;
        let name = name_from_buf(&name_buf);

        let mut raw_uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: valid out pointer to a 16-byte CUuuid, valid device.
        check("cuDeviceGetUuid_v2", unsafe {
            sys::cuDeviceGetUuid_v2(&mut raw_uuid, dev)
        })?;
        let uuid = format_gpu_uuid(&raw_uuid.bytes.map(|b| b as u8));

        let mut total: usize = 0;
        // SAFETY: valid out pointer, valid device.
        check("cuDeviceTotalMem", unsafe {
            sys::cuDeviceTotalMem_v2(&mut total, dev)
        })?;

        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: valid out pointer, valid device.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        // From here on, the partly built device releases what it holds if a step fails.
        let mut this = CudaDevice {
            desc: DeviceDesc {
                index: ordinal,
                model: name.clone(),
                name,
                uuid,
                backend: BackendKind::Cuda,
                total_bytes: total as u64,
                granularity: CUDA_GRANULARITY,
            },
            dev,
            ctx,
            control_rdev: control_device(),
            stream: std::ptr::null_mut(),
            next_id: 1,
            live: HashMap::new(),
        };
        this.make_current()?;
        let mut stream: CUstream = std::ptr::null_mut();
        // SAFETY: context current; valid out pointer.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as std::ffi::c_uint,
            )
        })?;
        this.stream = stream;
        // Leases are whole granules of VMM memory.
        let mut g: usize = 0;
        let prop = this.vmm_prop();
        // SAFETY: valid out pointer and property struct.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        let g = (g as u64).max(1).next_power_of_two();
        this.desc.granularity = this.desc.granularity.max(g);

        // The context's view of total memory is what `mem_info` reports; keep them equal.
        let info = this.mem_info()?;
        if info.total != this.desc.total_bytes {
            tracing::warn!(
                device = ordinal,
                device_total = this.desc.total_bytes,
                context_total = info.total,
                "cuDeviceTotalMem and cuMemGetInfo disagree; using cuMemGetInfo's total"
            );
            this.desc.total_bytes = info.total;
        }
        tracing::info!(
            device = ordinal,
            name = %this.desc.name,
            uuid = %this.desc.uuid,
            total_bytes = this.desc.total_bytes,
            "opened CUDA device"
        );
        Ok(this)
    }

    /// The raw `CUdevice` handle.
    pub fn cu_device(&self) -> i32 {
        self.dev
    }

    /// Allocation properties of this device's VMM memory: pinned device memory that can be
    /// exported as a POSIX file descriptor.
    fn vmm_prop(&self) -> sys::CUmemAllocationProp {
        // SAFETY: an all-zero property struct is valid (no flags, null metadata).
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: self.dev,
        };
        prop
    }

    /// Creates VMM memory of `size` bytes, maps it here, exports it: (mapping, VMM part).
    /// Undoes what it did on failure. Context current.
    fn vmm_alloc(&mut self, size: usize) -> Result<(Mapping, Vmm), DeviceError> {
        let prop = self.vmm_prop();
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out pointer and properties; `size` is a multiple of the granularity
        // (the pool rounds every lease up to it).
        let rc = unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) };
        if rc == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(DeviceError::OutOfMemory {
                requested: size as u64,
                free: self.free_bytes(),
            });
        }
        check("cuMemCreate", rc)?;
        let release = |h| {
            // SAFETY: a handle created above and never handed out.
            let _ = unsafe { sys::cuMemRelease(h) };
        };
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: valid out pointer; default alignment.
        if let Err(e) = check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0)
        }) {
            release(handle);
            return Err(e);
        }
        let unreserve = |p| {
            // SAFETY: the range reserved above.
            let _ = unsafe { sys::cuMemAddressFree(p, size) };
        };
        // SAFETY: the reserved range and the allocation are both `size` bytes.
        if let Err(e) = check("cuMemMap", unsafe {
            sys::cuMemMap(ptr, size, 0, handle, 0)
        }) {
            unreserve(ptr);
            release(handle);
            return Err(e);
        }
        let undo = |p, h| {
            // SAFETY: the mapping, range and handle made above.
            unsafe {
                let _ = sys::cuMemUnmap(p, size);
                let _ = sys::cuMemAddressFree(p, size);
                let _ = sys::cuMemRelease(h);
            }
        };
        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the mapped range; one access descriptor.
        if let Err(e) = check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, size, &access, 1)
        }) {
            undo(ptr, handle);
            return Err(e);
        }
        let mut raw: std::ffi::c_int = -1;
        // SAFETY: for POSIX descriptors the out pointer receives an int.
        if let Err(e) = check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                &mut raw as *mut std::ffi::c_int as *mut c_void,
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        }) {
            undo(ptr, handle);
            return Err(e);
        }
        // SAFETY: the driver gave us a new descriptor that nobody else owns.
        let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        // Never inherited by processes the broker starts.
        // SAFETY: fcntl on the descriptor just received.
        unsafe {
            libc::fcntl(raw, libc::F_SETFD, libc::FD_CLOEXEC);
        }
        Ok((
            Mapping { ptr, handle },
            Vmm {
                fd: SharedFd::new(fd),
                block_id: new_block_id(),
            },
        ))
    }

    /// Imports VMM memory a previous broker exported (its descriptor `fd`) and maps it
    /// here: (pointer, handle). Undoes what it did on failure. Context current.
    fn vmm_import(
        &mut self,
        fd: &std::os::fd::OwnedFd,
        size: usize,
    ) -> Result<(CUdeviceptr, sys::CUmemGenericAllocationHandle), DeviceError> {
        use std::os::fd::AsRawFd;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for POSIX descriptors the driver takes the descriptor number itself as
        // the pointer-sized argument; it does not take ownership of it.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        let release = |h| {
            // SAFETY: the handle imported above, never handed out.
            let _ = unsafe { sys::cuMemRelease(h) };
        };
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: valid out pointer; default alignment.
        if let Err(e) = check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0)
        }) {
            release(handle);
            return Err(e);
        }
        // SAFETY: the reserved range and the imported allocation are both `size` bytes.
        if let Err(e) = check("cuMemMap", unsafe {
            sys::cuMemMap(ptr, size, 0, handle, 0)
        }) {
            // SAFETY: the range reserved above.
            let _ = unsafe { sys::cuMemAddressFree(ptr, size) };
            release(handle);
            return Err(e);
        }
        let access = sys::CUmemAccessDesc {
            location: self.vmm_prop().location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the mapped range; one access descriptor.
        if let Err(e) = check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, size, &access, 1)
        }) {
            // SAFETY: the mapping, range and handle made above.
            unsafe {
                let _ = sys::cuMemUnmap(ptr, size);
                let _ = sys::cuMemAddressFree(ptr, size);
            }
            release(handle);
            return Err(e);
        }
        Ok((ptr, handle))
    }

    /// Unmaps and releases VMM memory (the physical memory stays while importers hold it;
    /// kept memory never mapped here has nothing to undo: its descriptor closes).
    fn vmm_free(&self, live: &Live) -> Result<(), DeviceError> {
        let Some(m) = live.mapping else {
            return Ok(());
        };
        let size = usize::try_from(live.bytes).map_err(|_| DeviceError::InvalidSize(live.bytes))?;
        // SAFETY: the broker's own mapping of a live VMM allocation, undone once.
        unsafe {
            check("cuMemUnmap", sys::cuMemUnmap(m.ptr, size))?;
            check("cuMemAddressFree", sys::cuMemAddressFree(m.ptr, size))?;
            check("cuMemRelease", sys::cuMemRelease(m.handle))
        }
    }

    /// Where `alloc` is mapped in the broker, importing and mapping kept memory the first
    /// time (see [`Live::mapping`]). Makes the context current.
    fn mapped(&mut self, alloc: &Allocation) -> Result<CUdeviceptr, DeviceError> {
        let live = self.lookup(alloc)?;
        self.make_current()?;
        if let Some(m) = live.mapping {
            return Ok(m.ptr);
        }
        let size = usize::try_from(live.bytes).map_err(|_| DeviceError::InvalidSize(live.bytes))?;
        let (ptr, handle) = self.vmm_import(&live.vmm.fd.0, size)?;
        if let Some(l) = self.live.get_mut(&alloc.id) {
            l.mapping = Some(Mapping { ptr, handle });
        }
        Ok(ptr)
    }

    /// Number of allocations this device currently holds.
    pub fn live_allocations(&self) -> usize {
        self.live.len()
    }

    /// Makes this device's primary context current on the calling thread.
    fn make_current(&self) -> Result<(), DeviceError> {
        // SAFETY: `ctx` is a retained primary context, valid until `Drop` releases it.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }

    /// Looks up a live allocation; the caller's `Allocation` must match what was handed out
    /// (same pointer and size), so a forged or stale one cannot reach other memory.
    fn lookup(&self, alloc: &Allocation) -> Result<Live, DeviceError> {
        match self.live.get(&alloc.id) {
            Some(l) if l.ptr == alloc.addr && l.bytes == alloc.bytes => Ok(l.clone()),
            _ => Err(DeviceError::UnknownAllocation(alloc.id)),
        }
    }

    /// Free bytes right now, or 0 if the driver cannot say (used for error reports only).
    fn free_bytes(&self) -> u64 {
        let mut free: usize = 0;
        let mut total: usize = 0;
        // SAFETY: valid out pointers; context current (callers made it so).
        let rc = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
        if rc == CUresult::CUDA_SUCCESS {
            free as u64
        } else {
            0
        }
    }
}

/// The driver's control device's number (`/dev/nvidiactl`, a character device); None
/// when there is none.
fn control_device() -> Option<u64> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    std::fs::metadata("/dev/nvidiactl")
        .ok()
        .filter(|m| m.file_type().is_char_device())
        .map(|m| m.rdev())
}

/// `fd`'s mode and device number (one `fstat`); None when it cannot be read.
fn mode_and_rdev(fd: &std::os::fd::OwnedFd) -> Option<(u32, u64)> {
    use std::os::fd::AsRawFd;
    // SAFETY: an all-zero stat is valid; fstat writes it for a valid descriptor.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and out pointer.
    let rc = unsafe { libc::fstat(fd.as_raw_fd(), &mut st) };
    (rc == 0).then_some((st.st_mode, st.st_rdev))
}

/// Is a descriptor of `mode` and device number `rdev` the driver's control device, whose
/// number is `control` (what an exported VMM descriptor is)? A character device of
/// another number (a buggy keeper's wrong descriptor), anything not a character device,
/// or no control device to compare with: no.
fn is_driver_descriptor(mode: u32, rdev: u64, control: Option<u64>) -> bool {
    mode & libc::S_IFMT == libc::S_IFCHR && control == Some(rdev)
}

/// The driver's 16 UUID bytes as `nvidia-smi` prints them (`GPU-xxxxxxxx-xxxx-...`).
pub(crate) fn format_gpu_uuid(bytes: &[u8; 16]) -> String {
    format!("GPU-{}", uuid::Uuid::from_bytes(*bytes).hyphenated())
}

/// The device name from the driver's NUL-terminated buffer.
fn name_from_buf(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Device pointer plus offset, checked (the range itself was checked against the size).
fn at(ptr: CUdeviceptr, offset: u64) -> CUdeviceptr {
    ptr.wrapping_add(offset)
}

impl Device for CudaDevice {
    fn desc(&self) -> &DeviceDesc {
        &self.desc
    }

    fn mem_info(&mut self) -> Result<MemInfo, DeviceError> {
        self.make_current()?;
        let mut free: usize = 0;
        let mut total: usize = 0;
        // SAFETY: valid out pointers; context current.
        check("cuMemGetInfo", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn alloc(&mut self, bytes: u64) -> Result<Allocation, DeviceError> {
        if bytes == 0 {
            return Err(DeviceError::InvalidSize(bytes));
        }
        let size = usize::try_from(bytes).map_err(|_| DeviceError::InvalidSize(bytes))?;
        self.make_current()?;
        if bytes > self.desc.total_bytes {
            // Can never succeed; do not ask the driver.
            return Err(DeviceError::OutOfMemory {
                requested: bytes,
                free: self.free_bytes(),
            });
        }
        let (mapping, vmm) = self.vmm_alloc(size)?;
        let id = self.next_id;
        self.next_id += 1;
        self.live.insert(
            id,
            Live {
                ptr: mapping.ptr,
                bytes,
                mapping: Some(mapping),
                vmm,
            },
        );
        Ok(Allocation {
            id,
            bytes,
            addr: mapping.ptr,
            path: None,
        })
    }

    fn free(&mut self, alloc: Allocation) -> Result<(), DeviceError> {
        let live = self.lookup(&alloc)?;
        self.make_current()?;
        // Removed from the map only once the driver accepted the free.
        self.vmm_free(&live)?;
        self.live.remove(&alloc.id);
        Ok(())
    }

    fn adopt(
        &mut self,
        fd: std::os::fd::OwnedFd,
        bytes: u64,
        block_id: u64,
    ) -> Result<Allocation, DeviceError> {
        usize::try_from(bytes).map_err(|_| DeviceError::InvalidSize(bytes))?;
        if bytes == 0 || !bytes.is_multiple_of(self.desc.granularity) {
            return Err(DeviceError::InvalidSize(bytes));
        }
        // An exported VMM descriptor is the driver's control device (`/dev/nvidiactl`):
        // anything else is not this backend's memory, and its record is reclaimed. The
        // driver itself reads it only when the broker first touches the memory (`mapped`).
        let driver = mode_and_rdev(&fd)
            .is_some_and(|(mode, rdev)| is_driver_descriptor(mode, rdev, self.control_rdev));
        if !driver {
            return Err(DeviceError::Unavailable(
                "a kept descriptor is not CUDA memory".into(),
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.live.insert(
            id,
            Live {
                ptr: 0,
                bytes,
                mapping: None,
                vmm: Vmm {
                    fd: SharedFd::new(fd),
                    block_id,
                },
            },
        );
        Ok(Allocation {
            id,
            bytes,
            addr: 0,
            path: None,
        })
    }

    fn export(&mut self, alloc: &Allocation) -> Result<Handle, DeviceError> {
        let live = self.lookup(alloc)?;
        // Exported once at allocation; every lease of the block shares the descriptor.
        Ok(Handle::Fd {
            kind: MemoryKind::CudaVmm,
            fd: live.vmm.fd.clone(),
            block_id: live.vmm.block_id,
            size: live.bytes,
        })
    }

    fn scrub(&mut self, alloc: &Allocation) -> Result<(), DeviceError> {
        let ptr = self.mapped(alloc)?;
        let size =
            usize::try_from(alloc.bytes).map_err(|_| DeviceError::InvalidSize(alloc.bytes))?;
        // SAFETY: the whole range is the live allocation; the stream belongs to this context.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(ptr, 0, size, self.stream)
        })?;
        // The block must be zero before anyone else can see it.
        // SAFETY: our own stream.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.stream)
        })
    }

    fn read(
        &mut self,
        alloc: &Allocation,
        offset: u64,
        len: usize,
    ) -> Result<Vec<u8>, DeviceError> {
        check_range(alloc, offset, len as u64)?;
        let ptr = self.mapped(alloc)?;
        let mut buf = vec![0u8; len];
        if len == 0 {
            return Ok(buf);
        }
        // SAFETY: [offset, offset+len) lies inside the live allocation; `buf` has `len` bytes.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(buf.as_mut_ptr() as *mut c_void, at(ptr, offset), len)
        })?;
        Ok(buf)
    }

    fn write(&mut self, alloc: &Allocation, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        check_range(alloc, offset, data.len() as u64)?;
        let ptr = self.mapped(alloc)?;
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: [offset, offset+len) lies inside the live allocation; `data` is readable.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(at(ptr, offset), data.as_ptr() as *const c_void, data.len())
        })?;
        // VMM memory has no SYNC_MEMOPS: wait for the copy here.
        // SAFETY: context current.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if let Err(e) = self.make_current() {
            tracing::error!(device = self.desc.index, error = %e, "cannot make context current on drop");
        }
        let live: Vec<(u64, Live)> = self.live.drain().collect();
        for (id, live) in live {
            if let Err(e) = self.vmm_free(&live) {
                tracing::error!(device = self.desc.index, allocation = id, error = %e, "free on drop failed");
            }
        }
        if !self.stream.is_null() {
            // SAFETY: our stream, destroyed once.
            let rc = unsafe { sys::cuStreamDestroy_v2(self.stream) };
            if let Err(e) = check("cuStreamDestroy", rc) {
                tracing::error!(device = self.desc.index, error = %e, "stream destroy failed");
            }
            self.stream = std::ptr::null_mut();
        }
        // Leave no dangling current context on this thread, then drop our reference.
        // SAFETY: unsetting the current context is always allowed.
        let _ = unsafe { sys::cuCtxSetCurrent(std::ptr::null_mut()) };
        // SAFETY: balances the retain in `open`.
        let rc = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
        if let Err(e) = check("cuDevicePrimaryCtxRelease", rc) {
            tracing::error!(device = self.desc.index, error = %e, "primary context release failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn availability_checks_never_panic() {
        // On a machine without libcuda (CI, this build machine) everything says "no".
        let available = is_available();
        let reason = unavailable_reason();
        assert_eq!(available, reason.is_none());
        if !lib_present() {
            assert!(!available);
            assert!(reason.unwrap_or_default().contains("libcuda"));
            assert!(matches!(device_count(), Err(DeviceError::Unavailable(_))));
            assert!(matches!(
                CudaDevice::open(0),
                Err(DeviceError::Unavailable(_))
            ));
        }
    }

    /// A kept descriptor is taken back only when it is a character device of the
    /// control device's number: another character device (`/dev/null`), a memfd, or no
    /// control device to compare with are refused.
    #[test]
    fn only_the_drivers_control_device_is_taken_back() {
        use std::os::unix::fs::MetadataExt;
        let null = std::fs::File::open("/dev/null").unwrap();
        let null_rdev = null.metadata().unwrap().rdev();
        let null: std::os::fd::OwnedFd = null.into();
        let (mode, rdev) = mode_and_rdev(&null).unwrap();
        assert_eq!(rdev, null_rdev);
        assert!(is_driver_descriptor(mode, rdev, Some(null_rdev)));
        // /dev/nvidiactl is character device 195:255.
        let nvidiactl = libc::makedev(195, 255);
        assert!(!is_driver_descriptor(mode, rdev, Some(nvidiactl)));
        assert!(!is_driver_descriptor(mode, rdev, None));
        assert!(is_driver_descriptor(
            libc::S_IFCHR | 0o666,
            nvidiactl,
            Some(nvidiactl)
        ));
        let memfd = crate::device::host::memfd("cuda-check-test", 4096).unwrap();
        let (mode, rdev) = mode_and_rdev(&memfd).unwrap();
        assert!(
            !is_driver_descriptor(mode, rdev, Some(rdev)),
            "not a character device"
        );
        // On a machine without the driver there is nothing to compare with.
        if !std::path::Path::new("/dev/nvidiactl").exists() {
            assert_eq!(control_device(), None);
        }
    }

    #[test]
    fn success_maps_to_ok() {
        assert!(check("cuInit", CUresult::CUDA_SUCCESS).is_ok());
    }

    #[test]
    fn driver_errors_name_the_call_and_code() {
        let msg = format_driver_error(CUresult::CUDA_ERROR_OUT_OF_MEMORY, Some("out of memory"));
        assert_eq!(msg, "CUDA_ERROR_OUT_OF_MEMORY (out of memory)");
        assert_eq!(
            format_driver_error(CUresult::CUDA_ERROR_INVALID_CONTEXT, None),
            "CUDA_ERROR_INVALID_CONTEXT"
        );
        if !lib_present() {
            // Without the library the description is the code's name alone, and no panic.
            match check("cuMemAlloc", CUresult::CUDA_ERROR_INVALID_VALUE) {
                Err(DeviceError::Driver { call, message }) => {
                    assert_eq!(call, "cuMemAlloc");
                    assert_eq!(message, "CUDA_ERROR_INVALID_VALUE");
                }
                other => panic!("expected a driver error, got {other:?}"),
            }
        }
    }

    #[test]
    fn device_names_stop_at_nul() {
        let mut buf = [0 as c_char; 16];
        for (i, b) in b"NVIDIA H200".iter().enumerate() {
            buf[i] = *b as c_char;
        }
        assert_eq!(name_from_buf(&buf), "NVIDIA H200");
        assert_eq!(name_from_buf(&[0 as c_char; 4]), "");
    }

    #[test]
    fn gpu_uuids_print_like_nvidia_smi() {
        let mut b = [0u8; 16];
        b[0] = 0x8a;
        b[15] = 0x01;
        assert_eq!(
            format_gpu_uuid(&b),
            "GPU-8a000000-0000-0000-0000-000000000001"
        );
    }

    #[test]
    fn granularity_is_two_mib() {
        assert_eq!(CUDA_GRANULARITY, 2 * 1024 * 1024);
        assert!(CUDA_GRANULARITY.is_power_of_two());
    }
}
