//! Two-process check of `gpu_broker_client::cuda` on a real GPU (feature `cuda`).
//!
//! `cuda_fd_check` (parent): creates a block with the raw driver API as the broker's
//! `CudaDevice` does (`cuMemCreate` with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, mapped
//! here, zeroed, exported as a file descriptor), then runs itself as a child that inherits
//! the descriptor, imports and maps it, checks the bytes, writes a pattern and exits; the
//! parent reads the pattern back through its own mapping. Prints `skipped: ...` and exits 0
//! without a driver or GPU.
//!
//! `cuda_fd_check child <device> <fd> <bytes> <size> <expect> <write-seed>`: the worker
//! side, also used by the broker's `cuda_conformance` test (which exports with the real
//! `CudaDevice`). `<fd>` is an inherited descriptor of a VMM memory object of `<size>`
//! bytes, of which the lease is the first `<bytes>`; `<expect>` is `zero`, `any` or a
//! pattern seed (0-255). It maps the block twice (same pointer, import count 2), drops one,
//! checks `<expect>`, writes pattern `<write-seed>` over the whole lease, closes the last
//! mapping (count 0: unmapped and released), maps it again and checks the pattern is there.
//!
//! Run: `cargo run --release -p gpu-broker-client --features cuda --example cuda_fd_check`.

#[cfg(not(feature = "cuda"))]
fn main() {
    println!("skipped: built without the `cuda` feature (add --features cuda)");
}

#[cfg(feature = "cuda")]
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let result = if args.get(1).map(String::as_str) == Some("child") {
        real::child(&args[2..])
    } else {
        real::parent()
    };
    if let Err(e) = result {
        eprintln!("cuda_fd_check FAILED: {e}");
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
mod real {
    use cudarc::driver::sys::{self, CUresult};
    use gpu_broker_client::cuda::{self, CudaError};
    use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd};
    use std::time::{Duration, Instant};

    /// The test pattern both sides agree on (never zero, so a scrubbed block never
    /// matches). The broker's `cuda_conformance` test has the same function.
    pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| ((((i as u64).wrapping_mul(2654435761) >> 7) as u8) ^ seed) | 1)
            .collect()
    }

    type Res<T> = Result<T, String>;

    /// The cache key of the child's imports (any id: one block per child).
    const BLOCK: u64 = 1;

    fn ck(call: &str, rc: CUresult) -> Res<()> {
        if rc == CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{call} failed: {rc:?}"))
        }
    }

    fn ms(d: Duration) -> String {
        format!("{:.3} ms", d.as_secs_f64() * 1e3)
    }

    fn first_mismatch(got: &[u8], want: &[u8]) -> Option<usize> {
        got.iter().zip(want).position(|(a, b)| a != b)
    }

    fn num<T: std::str::FromStr>(what: &str, s: &str) -> Res<T>
    where
        T::Err: std::fmt::Display,
    {
        s.parse().map_err(|e| format!("{what}: {e}"))
    }

    /// The worker side. Args: device, fd, bytes, size, expect, write seed.
    pub fn child(args: &[String]) -> Res<()> {
        let [device, fd, bytes, size, expect, write] = args else {
            return Err("usage: child <device> <fd> <bytes> <size> <expect> <write-seed>".into());
        };
        let device: u32 = num("device", device)?;
        let raw: i32 = num("fd", fd)?;
        let bytes: u64 = num("bytes", bytes)?;
        let size: u64 = num("size", size)?;
        let write: u8 = num("write seed", write)?;
        let len = usize::try_from(bytes).map_err(|e| e.to_string())?;
        // SAFETY: the parent left this descriptor open for us; we own it from here.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let bfd = || -> BorrowedFd<'_> { std::os::fd::AsFd::as_fd(&fd) };

        let t = Instant::now();
        let m1 = cuda::map_vmm(bfd(), device, bytes, size, BLOCK).map_err(|e| e.to_string())?;
        let first_open = t.elapsed();
        let t = Instant::now();
        let m2 = cuda::map_vmm(bfd(), device, bytes, size, BLOCK).map_err(|e| e.to_string())?;
        let second_open = t.elapsed();
        if m1.device_ptr() != m2.device_ptr() {
            return Err(format!(
                "second import gave another pointer: {:#x} vs {:#x}",
                m1.device_ptr(),
                m2.device_ptr()
            ));
        }
        if cuda::vmm_import_count(BLOCK, device) != 2 {
            return Err(format!(
                "import count {} != 2",
                cuda::vmm_import_count(BLOCK, device)
            ));
        }
        if m1.len() != bytes || m2.allocation_bytes() != size {
            return Err(format!(
                "lengths: lease {} object {} (asked {bytes} of {size})",
                m1.len(),
                m2.allocation_bytes()
            ));
        }
        println!(
            "child: imported {bytes} bytes at {:#x} (object {size} bytes) first import {} (incl. context), cached import {}",
            m1.device_ptr(),
            ms(first_open),
            ms(second_open)
        );
        drop(m2);
        if cuda::vmm_import_count(BLOCK, device) != 1 {
            return Err("import count after dropping one mapping != 1".into());
        }

        let mut back = vec![0u8; len];
        let t = Instant::now();
        m1.copy_to_host(0, &mut back).map_err(|e| e.to_string())?;
        let dtoh = t.elapsed();
        match expect.as_str() {
            "any" => {}
            "zero" => {
                if let Some(i) = back.iter().position(|&b| b != 0) {
                    return Err(format!("expected zeros, byte {i} is {}", back[i]));
                }
            }
            seed => {
                let seed: u8 = num("expect", seed)?;
                if let Some(i) = first_mismatch(&back, &pattern(seed, len)) {
                    return Err(format!("byte {i} differs from pattern {seed}"));
                }
            }
        }
        println!(
            "child: content is as expected ({expect}); copy_to_host {}",
            ms(dtoh)
        );

        let data = pattern(write, len);
        let t = Instant::now();
        m1.copy_from_host(0, &data).map_err(|e| e.to_string())?;
        println!(
            "child: wrote pattern {write}; copy_from_host {}",
            ms(t.elapsed())
        );
        if !matches!(
            m1.copy_from_host(bytes, &[1]),
            Err(CudaError::OutOfRange { .. })
        ) {
            return Err("write past the end was not refused".into());
        }

        let t = Instant::now();
        m1.close().map_err(|e| e.to_string())?;
        let close = t.elapsed();
        if cuda::vmm_import_count(BLOCK, device) != 0 {
            return Err("import count after closing the last mapping != 0".into());
        }
        let m3 = cuda::map_vmm(bfd(), device, bytes, size, BLOCK).map_err(|e| e.to_string())?;
        let mut again = vec![0u8; len];
        m3.copy_to_host(0, &mut again).map_err(|e| e.to_string())?;
        if let Some(i) = first_mismatch(&again, &data) {
            return Err(format!(
                "after a new import, byte {i} differs from what was written"
            ));
        }
        drop(m3);
        println!(
            "child: close {}; imported again after close and saw the pattern; import cache ok",
            ms(close)
        );
        Ok(())
    }

    /// Parent: create and export with the raw driver API, run the child, read back.
    pub fn parent() -> Res<()> {
        if !cuda::is_available() {
            println!("skipped: no CUDA driver/GPU on this machine (cuda_fd_check)");
            return Ok(());
        }
        const BYTES: u64 = 64 << 20;
        let size = BYTES as usize;
        let device = 0u32;
        let t0 = Instant::now();
        // SAFETY (all calls below): straightforward driver API use on this thread, with
        // valid out pointers, the primary context current, and ranges inside `ptr`.
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        unsafe {
            ck("cuInit", sys::cuInit(0))?;
            ck("cuDeviceGet", sys::cuDeviceGet(&mut dev, device as i32))?;
            ck(
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            )?;
            ck("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))?;
        }
        println!("parent: context ready in {}", ms(t0.elapsed()));
        // SAFETY: an all-zero property struct is valid; the fields the call needs are set.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: dev,
        };
        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        let mut ptr = 0u64;
        let mut raw: std::ffi::c_int = -1;
        unsafe {
            ck("cuMemCreate", sys::cuMemCreate(&mut handle, size, &prop, 0))?;
            ck(
                "cuMemAddressReserve",
                sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0),
            )?;
            ck("cuMemMap", sys::cuMemMap(ptr, size, 0, handle, 0))?;
            ck("cuMemSetAccess", sys::cuMemSetAccess(ptr, size, &access, 1))?;
            ck("cuMemsetD8", sys::cuMemsetD8_v2(ptr, 0, size))?;
            ck("cuCtxSynchronize", sys::cuCtxSynchronize())?;
            ck(
                "cuMemExportToShareableHandle",
                sys::cuMemExportToShareableHandle(
                    &mut raw as *mut std::ffi::c_int as *mut std::ffi::c_void,
                    handle,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                ),
            )?;
            // The child inherits it.
            libc::fcntl(raw, libc::F_SETFD, 0);
        }
        // SAFETY: the driver gave us this new descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        println!("parent: exported {BYTES} bytes at {ptr:#x} as fd {raw}");

        // A child process imports it, checks zeros, writes pattern 42.
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let t = Instant::now();
        let status = std::process::Command::new(exe)
            .args([
                "child",
                &device.to_string(),
                &raw.to_string(),
                &BYTES.to_string(),
                &BYTES.to_string(),
                "zero",
                "42",
            ])
            .status()
            .map_err(|e| format!("spawn child: {e}"))?;
        println!("parent: child ran in {} ({status})", ms(t.elapsed()));
        drop(fd);
        if !status.success() {
            return Err(format!("child failed: {status}"));
        }

        // The parent sees the child's writes.
        let mut back = vec![0u8; size];
        unsafe {
            ck("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))?;
            ck(
                "cuMemcpyDtoH",
                sys::cuMemcpyDtoH_v2(back.as_mut_ptr() as *mut std::ffi::c_void, ptr, size),
            )?;
        }
        if let Some(i) = first_mismatch(&back, &pattern(42, size)) {
            return Err(format!("parent: byte {i} differs from the child's pattern"));
        }
        println!("parent: read back the child's pattern: ok");
        unsafe {
            ck("cuMemUnmap", sys::cuMemUnmap(ptr, size))?;
            ck("cuMemAddressFree", sys::cuMemAddressFree(ptr, size))?;
            ck("cuMemRelease", sys::cuMemRelease(handle))?;
            ck(
                "cuDevicePrimaryCtxRelease",
                sys::cuDevicePrimaryCtxRelease_v2(dev),
            )?;
        }
        println!("cuda_fd_check: ALL OK");
        Ok(())
    }
}
