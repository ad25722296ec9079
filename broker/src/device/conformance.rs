//! The conformance suite every `Device` backend must pass: the same checks run against
//! `host` in CI and against `cuda` on the GPU machine. Each check opens a fresh device
//! through the caller's `open` function and panics with a precise message on failure.
//! It lives in the library (not behind `cfg(test)`) so GPU test binaries can run it.

use super::{Allocation, Device, DeviceError, Handle};

/// Opens a fresh device for one check.
pub type Open<'a> = &'a mut dyn FnMut() -> Result<Box<dyn Device>, DeviceError>;

/// Runs every check; panics on the first failure.
pub fn run_all(open: Open<'_>) {
    for (name, check) in CHECKS {
        let mut dev = match open() {
            Ok(d) => d,
            Err(e) => panic!("conformance {name}: cannot open device: {e}"),
        };
        check(dev.as_mut());
        eprintln!("conformance {name}: ok ({})", dev.desc().backend);
    }
}

type Check = fn(&mut dyn Device);

/// Every check, by name.
pub const CHECKS: &[(&str, Check)] = &[
    ("describes_itself", describes_itself),
    ("answers_health_checks", answers_health_checks),
    ("rejects_zero_size", rejects_zero_size),
    ("refuses_more_than_capacity", refuses_more_than_capacity),
    ("alloc_and_free_move_mem_info", alloc_and_free_move_mem_info),
    ("write_read_round_trip", write_read_round_trip),
    ("allocations_are_independent", allocations_are_independent),
    ("scrub_zeroes_everything", scrub_zeroes_everything),
    (
        "export_gives_distinct_handles",
        export_gives_distinct_handles,
    ),
    (
        "unknown_allocation_is_an_error",
        unknown_allocation_is_an_error,
    ),
    (
        "out_of_range_access_is_an_error",
        out_of_range_access_is_an_error,
    ),
    (
        "many_allocations_return_all_memory",
        many_allocations_return_all_memory,
    ),
    (
        "kept_memory_is_taken_back_whole",
        kept_memory_is_taken_back_whole,
    ),
];

const MIB: u64 = 1 << 20;

fn free_now(dev: &mut dyn Device) -> u64 {
    dev.mem_info().expect("mem_info").free
}

fn describes_itself(dev: &mut dyn Device) {
    let d = dev.desc().clone();
    assert!(d.total_bytes > 0, "total_bytes must be positive");
    assert!(
        d.granularity.is_power_of_two() && d.granularity >= 4096,
        "granularity {} must be a power of two >= 4096",
        d.granularity
    );
    assert_eq!(dev.capacity(), d.total_bytes);
    // Identity: `GPU-`/`HOST-` and a hyphenated UUID, and a model name.
    let parsed = d
        .uuid
        .split_once('-')
        .map(|(kind, rest)| (kind, uuid::Uuid::parse_str(rest)));
    assert!(
        matches!(parsed, Some(("GPU" | "HOST", Ok(_)))),
        "uuid {:?} must be GPU-<uuid> or HOST-<uuid>",
        d.uuid
    );
    assert!(!d.model.is_empty(), "model must be set");
    let m = dev.mem_info().expect("mem_info");
    assert!(m.free <= m.total, "free {} > total {}", m.free, m.total);
    assert_eq!(m.total, d.total_bytes, "mem_info total != desc total");
}

fn answers_health_checks(dev: &mut dyn Device) {
    if let Err(e) = dev.health() {
        panic!("a freshly opened device must report healthy, got {e}");
    }
    let a = dev.alloc(dev.desc().granularity).expect("alloc");
    assert!(dev.health().is_ok(), "healthy with an allocation");
    dev.free(a).expect("free");
}

fn rejects_zero_size(dev: &mut dyn Device) {
    match dev.alloc(0) {
        Err(DeviceError::InvalidSize(0)) => {}
        other => panic!("alloc(0) must be InvalidSize, got {other:?}"),
    }
}

fn refuses_more_than_capacity(dev: &mut dyn Device) {
    let too_much = dev.capacity() + dev.desc().granularity;
    match dev.alloc(too_much) {
        Err(DeviceError::OutOfMemory { requested, .. }) => assert_eq!(requested, too_much),
        other => panic!("alloc beyond capacity must be OutOfMemory, got {other:?}"),
    }
    // The device still works afterwards.
    let a = dev.alloc(2 * MIB).expect("alloc after refused alloc");
    dev.free(a).expect("free");
}

fn alloc_and_free_move_mem_info(dev: &mut dyn Device) {
    let bytes = 64 * MIB;
    let before = free_now(dev);
    let a = dev.alloc(bytes).expect("alloc 64 MiB");
    assert_eq!(a.bytes, bytes);
    let during = free_now(dev);
    assert!(
        before.saturating_sub(during) >= bytes,
        "free memory fell by {} after allocating {bytes}",
        before.saturating_sub(during)
    );
    dev.free(a).expect("free");
    let after = free_now(dev);
    assert!(
        after.saturating_sub(during) >= bytes,
        "free memory rose by {} after freeing {bytes}",
        after.saturating_sub(during)
    );
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1)
        .collect()
}

fn write_read_round_trip(dev: &mut dyn Device) {
    let a = dev.alloc(4 * MIB).expect("alloc");
    let data = pattern(7, 1 << 16);
    dev.write(&a, 3 * MIB, &data).expect("write");
    let back = dev.read(&a, 3 * MIB, data.len()).expect("read");
    assert_eq!(back, data, "read back differs from what was written");
    dev.free(a).expect("free");
}

fn allocations_are_independent(dev: &mut dyn Device) {
    let a = dev.alloc(2 * MIB).expect("alloc a");
    let b = dev.alloc(2 * MIB).expect("alloc b");
    assert_ne!(a.id, b.id, "two live allocations share an id");
    dev.write(&a, 0, &pattern(1, 4096)).expect("write a");
    dev.write(&b, 0, &pattern(2, 4096)).expect("write b");
    assert_eq!(dev.read(&a, 0, 4096).expect("read a"), pattern(1, 4096));
    assert_eq!(dev.read(&b, 0, 4096).expect("read b"), pattern(2, 4096));
    dev.free(a).expect("free a");
    dev.free(b).expect("free b");
}

fn scrub_zeroes_everything(dev: &mut dyn Device) {
    let bytes = 4 * MIB;
    let a = dev.alloc(bytes).expect("alloc");
    let data = pattern(9, bytes as usize);
    dev.write(&a, 0, &data).expect("write");
    dev.scrub(&a).expect("scrub");
    let back = dev.read(&a, 0, bytes as usize).expect("read");
    if let Some(i) = back.iter().position(|&b| b != 0) {
        panic!("byte {i} is {} after scrub", back[i]);
    }
    dev.free(a).expect("free");
}

/// Memory taken back from its exported descriptor (as a restarted broker does with what
/// its keeper held) is the same memory: it reads what was written, writes reach the
/// original, a scrub zeroes it, it exports the same block, and both free.
fn kept_memory_is_taken_back_whole(dev: &mut dyn Device) {
    let bytes = 2 * dev.desc().granularity.max(MIB);
    let a = dev.alloc(bytes).expect("alloc");
    let data = pattern(5, 1 << 16);
    dev.write(&a, MIB, &data).expect("write");
    let Handle::Fd { fd, block_id, .. } = dev.export(&a).expect("export");
    let copy = fd.0.try_clone().expect("dup");
    drop(fd);
    let kept = dev.adopt(copy, bytes, block_id).expect("adopt");
    assert_ne!(kept.id, a.id, "a taken-back block shares an id");
    assert_eq!(
        dev.read(&kept, MIB, data.len()).expect("read kept"),
        data,
        "taken-back memory reads other bytes"
    );
    let Handle::Fd { block_id: b, .. } = dev.export(&kept).expect("export kept");
    assert_eq!(b, block_id, "a taken-back block is known by another id");
    dev.write(&kept, 0, &pattern(6, 4096)).expect("write kept");
    assert_eq!(dev.read(&a, 0, 4096).expect("read"), pattern(6, 4096));
    dev.scrub(&kept).expect("scrub kept");
    let back = dev.read(&a, 0, bytes as usize).expect("read after scrub");
    assert!(back.iter().all(|&b| b == 0), "a scrub left bytes behind");
    dev.free(kept).expect("free kept");
    dev.free(a).expect("free");
}

fn export_gives_distinct_handles(dev: &mut dyn Device) {
    let a = dev.alloc(2 * MIB).expect("alloc a");
    let b = dev.alloc(2 * MIB).expect("alloc b");
    let ha = dev.export(&a).expect("export a");
    let hb = dev.export(&b).expect("export b");
    assert_ne!(ha, hb, "two allocations exported the same handle");
    for (h, al) in [(&ha, &a), (&hb, &b)] {
        match h {
            Handle::Fd { kind, fd, size, .. } => {
                assert!(
                    *size >= al.bytes,
                    "exported object is smaller than the allocation"
                );
                // SAFETY: fcntl on a descriptor the handle keeps open.
                let flags = unsafe { libc::fcntl(fd.raw(), libc::F_GETFD) };
                assert!(flags >= 0, "exported fd is not open");
                assert!(
                    flags & libc::FD_CLOEXEC != 0,
                    "exported fd must be close-on-exec"
                );
                if *kind == crate::device::MemoryKind::HostMemfd {
                    let f = std::fs::File::from(fd.0.try_clone().expect("dup"));
                    let len = f.metadata().expect("fstat").len();
                    assert_eq!(len, *size, "memfd has the wrong size");
                }
            }
        }
    }
    dev.free(a).expect("free a");
    dev.free(b).expect("free b");
}

fn unknown_allocation_is_an_error(dev: &mut dyn Device) {
    let fake = Allocation {
        id: u64::MAX,
        bytes: 2 * MIB,
        addr: 0,
        path: None,
    };
    assert!(
        matches!(dev.scrub(&fake), Err(DeviceError::UnknownAllocation(_))),
        "scrub of an unknown allocation must fail"
    );
    assert!(
        matches!(dev.free(fake), Err(DeviceError::UnknownAllocation(_))),
        "free of an unknown allocation must fail"
    );
}

fn out_of_range_access_is_an_error(dev: &mut dyn Device) {
    let a = dev.alloc(2 * MIB).expect("alloc");
    assert!(matches!(
        dev.read(&a, 2 * MIB - 10, 11),
        Err(DeviceError::OutOfRange { .. })
    ));
    assert!(matches!(
        dev.write(&a, u64::MAX, &[1]),
        Err(DeviceError::OutOfRange { .. })
    ));
    dev.free(a).expect("free");
}

fn many_allocations_return_all_memory(dev: &mut dyn Device) {
    let before = free_now(dev);
    let mut live = Vec::new();
    for i in 0..32u64 {
        live.push(dev.alloc(2 * MIB * (1 + i % 3)).expect("alloc"));
    }
    for a in live {
        dev.free(a).expect("free");
    }
    let after = free_now(dev);
    // Drivers may keep a little bookkeeping; the host backend must be exact.
    let slack = if dev.desc().backend == super::BackendKind::Host {
        0
    } else {
        8 * MIB
    };
    assert!(
        after + slack >= before,
        "free memory {after} did not return to {before} after freeing everything"
    );
}
