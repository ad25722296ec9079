//! Two-process check of `gpu_broker_client::cuda` on a real GPU (feature `cuda`).
//!
//! `cuda_ipc_check` (parent): allocates a block with the raw driver API (as the broker's
//! `CudaDevice` does: `cuMemAlloc_v2` + `SYNC_MEMOPS` + `cuIpcGetMemHandle`), checks that
//! opening its own handle is refused with `CudaError::OwnProcess`, then runs itself as a
//! child that maps the handle, checks the bytes, writes a pattern and exits; the parent
//! reads the pattern back. Prints `skipped: ...` and exits 0 without a driver or GPU.
//!
//! `cuda_ipc_check child <device> <handle-hex> <bytes> <expect> <write-seed>`: the worker
//! side, also used by the broker's `cuda_conformance` test (which exports with the real
//! `CudaDevice`). `<expect>` is `zero`, `any` or a pattern seed (0-255). It opens the handle
//! twice (same pointer, refcount 2), drops one, checks `<expect>`, writes pattern
//! `<write-seed>` over the whole lease, closes the last mapping (refcount 0), opens the
//! handle again and checks the pattern is there.
//!
//! Run: `cargo run --release -p gpu-broker-client --features cuda --example cuda_ipc_check`.

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
        eprintln!("cuda_ipc_check FAILED: {e}");
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
mod real {

    /// The test pattern both sides agree on (never zero, so a scrubbed block never
    /// matches). The broker's `cuda_conformance` test has the same function.
    pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| ((((i as u64).wrapping_mul(2654435761) >> 7) as u8) ^ seed) | 1)
            .collect()
    }
    use cudarc::driver::sys::{self, CUresult};
    use gpu_broker_client::cuda::{self, CudaError};
    use std::time::{Duration, Instant};

    type Res<T> = Result<T, String>;

    fn ck(call: &str, rc: CUresult) -> Res<()> {
        if rc == CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{call} failed: {rc:?}"))
        }
    }

    pub fn to_hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    pub fn from_hex(s: &str) -> Res<[u8; 64]> {
        if s.len() != 128 {
            return Err(format!("handle must be 128 hex digits, got {}", s.len()));
        }
        let mut out = [0u8; 64];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
        }
        Ok(out)
    }

    fn ms(d: Duration) -> String {
        format!("{:.3} ms", d.as_secs_f64() * 1e3)
    }

    fn first_mismatch(got: &[u8], want: &[u8]) -> Option<usize> {
        got.iter().zip(want).position(|(a, b)| a != b)
    }

    /// The worker side. Args: device, handle hex, bytes, expect, write seed.
    pub fn child(args: &[String]) -> Res<()> {
        let [device, hex, bytes, expect, write] = args else {
            return Err("usage: child <device> <handle-hex> <bytes> <expect> <write-seed>".into());
        };
        let device: u32 = device.parse().map_err(|e| format!("device: {e}"))?;
        let handle = from_hex(hex)?;
        let bytes: u64 = bytes.parse().map_err(|e| format!("bytes: {e}"))?;
        let write: u8 = write.parse().map_err(|e| format!("write seed: {e}"))?;
        let len = usize::try_from(bytes).map_err(|e| e.to_string())?;

        let t = Instant::now();
        let m1 = cuda::map_lease(&handle, device, bytes).map_err(|e| e.to_string())?;
        let first_open = t.elapsed();
        let t = Instant::now();
        let m2 = cuda::open_ipc(&handle, device).map_err(|e| e.to_string())?;
        let second_open = t.elapsed();
        if m1.device_ptr() != m2.device_ptr() {
            return Err(format!(
                "second open gave another pointer: {:#x} vs {:#x}",
                m1.device_ptr(),
                m2.device_ptr()
            ));
        }
        if cuda::open_count(&handle, device) != 2 {
            return Err(format!(
                "refcount {} != 2",
                cuda::open_count(&handle, device)
            ));
        }
        if m1.len() != bytes || m2.allocation_bytes() < bytes {
            return Err(format!(
                "lengths: lease {} alloc {} (asked {bytes})",
                m1.len(),
                m2.allocation_bytes()
            ));
        }
        println!(
            "child: opened {bytes} bytes at {:#x} (allocation {} bytes) first open {} (incl. context), cached open {}",
            m1.device_ptr(),
            m2.allocation_bytes(),
            ms(first_open),
            ms(second_open)
        );
        drop(m2);
        if cuda::open_count(&handle, device) != 1 {
            return Err("refcount after dropping one mapping != 1".into());
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
                let seed: u8 = seed.parse().map_err(|e| format!("expect: {e}"))?;
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
        if cuda::open_count(&handle, device) != 0 {
            return Err("refcount after closing the last mapping != 0".into());
        }
        let m3 = cuda::map_lease(&handle, device, bytes).map_err(|e| e.to_string())?;
        let mut again = vec![0u8; len];
        m3.copy_to_host(0, &mut again).map_err(|e| e.to_string())?;
        if let Some(i) = first_mismatch(&again, &data) {
            return Err(format!(
                "after reopen, byte {i} differs from what was written"
            ));
        }
        drop(m3);
        println!(
            "child: close {}; reopened after close and saw the pattern; refcount cache ok",
            ms(close)
        );
        Ok(())
    }

    /// Parent: export with the raw driver API, self-open check, run the child, read back.
    pub fn parent() -> Res<()> {
        if !cuda::is_available() {
            println!("skipped: no CUDA driver/GPU on this machine (cuda_ipc_check)");
            return Ok(());
        }
        const BYTES: u64 = 64 << 20;
        let device = 0u32;
        let t0 = Instant::now();
        // SAFETY (all calls below): straightforward driver API use on this thread, with
        // valid out pointers, the primary context current, and ranges inside `ptr`.
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        let mut ptr = 0u64;
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
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        unsafe {
            ck("cuMemAlloc", sys::cuMemAlloc_v2(&mut ptr, BYTES as usize))?;
            let one: u32 = 1;
            ck(
                "cuPointerSetAttribute",
                sys::cuPointerSetAttribute(
                    &one as *const u32 as *const std::ffi::c_void,
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
                    ptr,
                ),
            )?;
            ck("cuMemsetD8", sys::cuMemsetD8_v2(ptr, 0, BYTES as usize))?;
            ck(
                "cuIpcGetMemHandle",
                sys::cuIpcGetMemHandle(&mut handle, ptr),
            )?;
        }
        let hbytes = handle.reserved.map(|c| c as u8);
        let pid = std::process::id().to_le_bytes();
        let pid_at = hbytes.windows(4).position(|w| w == pid);
        println!(
            "parent: exported {BYTES} bytes at {ptr:#x}; handle {}; own pid {} {}",
            to_hex(&hbytes),
            std::process::id(),
            match pid_at {
                Some(i) => format!("appears in the handle at byte {i}"),
                None => "does not appear in the handle".to_string(),
            }
        );

        // 1. The exporting process must be refused, with a clear error. Anything else is
        // reported (and fails the run at the end) but the other checks still run.
        let mut self_open_problem = None;
        match cuda::open_ipc(&hbytes, device) {
            Err(CudaError::OwnProcess { driver }) => {
                println!("parent: self-open refused as OwnProcess ({driver})")
            }
            Err(other) => {
                println!("parent: WARNING self-open gave another error: {other:?}");
                self_open_problem = Some(format!("self-open: expected OwnProcess, got {other}"));
            }
            Ok(m) => {
                println!(
                    "parent: WARNING self-open succeeded at {:#x} (own pointer {ptr:#x})",
                    m.device_ptr()
                );
                self_open_problem = Some("self-open unexpectedly succeeded".to_string());
            }
        }
        if cuda::open_count(&hbytes, device) != 0 {
            return Err("failed self-open left a cache entry".into());
        }

        // 2. A child process maps it, checks zeros, writes pattern 42.
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let t = Instant::now();
        let status = std::process::Command::new(exe)
            .args([
                "child",
                &device.to_string(),
                &to_hex(&hbytes),
                &BYTES.to_string(),
                "zero",
                "42",
            ])
            .status()
            .map_err(|e| format!("spawn child: {e}"))?;
        println!("parent: child ran in {} ({status})", ms(t.elapsed()));
        if !status.success() {
            return Err(format!("child failed: {status}"));
        }

        // 3. The parent sees the child's writes.
        let mut back = vec![0u8; BYTES as usize];
        unsafe {
            ck("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))?;
            ck(
                "cuMemcpyDtoH",
                sys::cuMemcpyDtoH_v2(
                    back.as_mut_ptr() as *mut std::ffi::c_void,
                    ptr,
                    BYTES as usize,
                ),
            )?;
        }
        if let Some(i) = first_mismatch(&back, &pattern(42, BYTES as usize)) {
            return Err(format!("parent: byte {i} differs from the child's pattern"));
        }
        println!("parent: read back the child's pattern: ok");
        unsafe {
            ck("cuMemFree", sys::cuMemFree_v2(ptr))?;
            ck(
                "cuDevicePrimaryCtxRelease",
                sys::cuDevicePrimaryCtxRelease_v2(dev),
            )?;
        }
        if let Some(problem) = self_open_problem {
            return Err(problem);
        }
        println!("cuda_ipc_check: ALL OK");
        Ok(())
    }
}
