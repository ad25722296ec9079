//! The device conformance suite against the real `cuda` backend, on every GPU of the
//! machine, plus a cross-process check (the descriptor of a block exported by `CudaDevice`
//! imported by the client crate's CUDA module in a child process) and a few timings. Without a CUDA driver
//! or GPU each test prints `skipped: ...` and passes, so this runs everywhere;
//! `scripts/gpu-fd-check.sh` (part `fd` of `scripts/gpu-all.sh`) runs it on the GPU machine.

// A conformance test drives the device itself (`broker/clippy.toml`).
#![allow(clippy::disallowed_methods)]

use gpu_broker::device::cuda::{self, CudaDevice};
use gpu_broker::device::{conformance, Device, Handle};
use parking_lot::Mutex;
use std::time::{Duration, Instant};

/// The checks watch free memory, so tests in this binary never run at the same time.
static GPU: Mutex<()> = parking_lot::const_mutex(());

const MIB: u64 = 1 << 20;

/// Why to skip, printed in the agreed form, or `None` when a GPU is here.
fn skip_reason() -> Option<String> {
    cuda::unavailable_reason()
        .map(|reason| format!("skipped: no CUDA driver/GPU on this machine ({reason})"))
}

#[test]
fn cuda_backend_passes_conformance_on_every_gpu() {
    if let Some(msg) = skip_reason() {
        println!("{msg}");
        return;
    }
    let _gpu = GPU.lock();
    let n = cuda::device_count().expect("device_count");
    assert!(n > 0);
    for ordinal in 0..n {
        let t = Instant::now();
        conformance::run_all(&mut || Ok(Box::new(CudaDevice::open(ordinal)?) as Box<dyn Device>));
        println!(
            "device {ordinal} (VMM, fd handles): all {} conformance checks passed in {:.2?}",
            conformance::CHECKS.len(),
            t.elapsed()
        );
    }
}

/// Same as the `pattern` of `client/examples/cuda_fd_check.rs`.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((((i as u64).wrapping_mul(2654435761) >> 7) as u8) ^ seed) | 1)
        .collect()
}

/// Runs the worker side (`cuda_fd_check child ...`) in another process, which inherits a
/// duplicate of the block's descriptor (the broker's own is close-on-exec).
fn run_child(child: &str, handle: &Handle, bytes: u64, expect: &str, write: u8) {
    let Handle::Fd { fd, size, .. } = handle;
    // SAFETY: dup of a descriptor the handle keeps open; the copy is not close-on-exec.
    let copy = unsafe { libc::dup(fd.raw()) };
    assert!(copy >= 0, "dup: {}", std::io::Error::last_os_error());
    // SAFETY: the new descriptor is ours; closed when this drops (after the child ran).
    let _copy = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(copy) };
    let t = Instant::now();
    let out = std::process::Command::new(child)
        .args([
            "child",
            "0",
            &copy.to_string(),
            &bytes.to_string(),
            &size.to_string(),
            expect,
            &write.to_string(),
        ])
        .output()
        .expect("spawn the cuda_fd_check child");
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "child failed: {}", out.status);
    println!("  child process took {:.2?}", t.elapsed());
}

#[test]
fn cuda_block_maps_in_another_process() {
    if let Some(msg) = skip_reason() {
        println!("{msg}");
        return;
    }
    let Ok(child) = std::env::var("GPU_BROKER_CUDA_FD_CHILD") else {
        println!(
            "skipped: set GPU_BROKER_CUDA_FD_CHILD to the cuda_fd_check example binary \
             (scripts/gpu-fd-check.sh does)"
        );
        return;
    };
    let _gpu = GPU.lock();
    let mut dev = CudaDevice::open(0).expect("open device 0");
    // VMM memory comes in whole granules (the pool rounds leases up); the child maps a
    // lease smaller than the memory object, as a worker does.
    let bytes = 48 * MIB - 4096;
    let a = dev.alloc(48 * MIB).expect("alloc");
    dev.scrub(&a).expect("scrub");
    dev.write(&a, 0, &pattern(5, bytes as usize))
        .expect("write");
    let t = Instant::now();
    let handle = dev.export(&a).expect("export");
    println!("exported {bytes} bytes in {:.2?}", t.elapsed());

    // The worker sees what the broker wrote and writes its own pattern.
    run_child(&child, &handle, bytes, "5", 77);
    let back = dev.read(&a, 0, bytes as usize).expect("read");
    assert!(
        back == pattern(77, bytes as usize),
        "broker does not see the worker's writes"
    );
    println!("broker read back the worker's pattern");

    // A scrub is complete and visible to the next process that maps the block.
    let t = Instant::now();
    dev.scrub(&a).expect("scrub");
    println!("scrubbed {bytes} bytes in {:.2?}", t.elapsed());
    let again = dev.export(&a).expect("export again");
    assert_eq!(
        again, handle,
        "a block is exported once: the same descriptor"
    );
    run_child(&child, &again, bytes, "zero", 9);
    let back = dev.read(&a, 0, bytes as usize).expect("read");
    assert!(
        back == pattern(9, bytes as usize),
        "broker does not see the second worker's writes"
    );
    dev.free(a).expect("free");
    println!("cross-process check: ok");
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[test]
fn cuda_timings() {
    if let Some(msg) = skip_reason() {
        println!("{msg}");
        return;
    }
    let _gpu = GPU.lock();
    {
        let t = Instant::now();
        let mut dev = CudaDevice::open(0).expect("open device 0");
        println!("mode: VMM (cuMemCreate, fd export)");
        println!(
            "open device 0 ({}, {} bytes): {:.2?}",
            dev.desc().name,
            dev.desc().total_bytes,
            t.elapsed()
        );
        for (label, bytes) in [
            ("2 MiB", 2 * MIB),
            ("64 MiB", 64 * MIB),
            ("1 GiB", 1024 * MIB),
        ] {
            let (mut alloc, mut export, mut scrub, mut free) = (vec![], vec![], vec![], vec![]);
            for _ in 0..15 {
                let t = Instant::now();
                let a = dev.alloc(bytes).expect("alloc");
                alloc.push(t.elapsed());
                let t = Instant::now();
                dev.export(&a).expect("export");
                export.push(t.elapsed());
                let t = Instant::now();
                dev.scrub(&a).expect("scrub");
                scrub.push(t.elapsed());
                let t = Instant::now();
                dev.free(a).expect("free");
                free.push(t.elapsed());
            }
            println!(
                "{label}: median alloc {:.1?}, export {:.1?}, scrub {:.1?}, free {:.1?}",
                median(alloc),
                median(export),
                median(scrub),
                median(free)
            );
        }
        let t = Instant::now();
        let m = dev.mem_info().expect("mem_info");
        println!(
            "mem_info {:.1?}: free {} of {}",
            t.elapsed(),
            m.free,
            m.total
        );
        assert_eq!(dev.live_allocations(), 0);
    }
}
