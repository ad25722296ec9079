//! The `host` backend: a simulated device whose allocations are real memory objects made
//! with `memfd_create`, so a worker that receives the descriptor (over the ticket socket,
//! with `SCM_RIGHTS`) maps the same pages and sees the bytes the broker or another mapping
//! wrote. A memfd has no path: nothing to guess or list, no file to clean up after any
//! crash (the memory goes when the last descriptor and mapping of it go), and workers of
//! any uid can map the descriptor they were given. Capacity is enforced exactly like a
//! GPU's: an allocation that would exceed it fails with `OutOfMemory`.

use super::{
    check_range, new_block_id, Allocation, BackendKind, Device, DeviceDesc, DeviceError, Handle,
    MemInfo, MemoryKind, SharedFd,
};
use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// Granularity of the simulated device: 2 MiB, as the GPU's.
pub const HOST_GRANULARITY: u64 = 2 << 20;

/// The `model` of every simulated device.
pub const HOST_MODEL: &str = "host simulation";

/// A stable synthetic UUID for simulated device `index`: `HOST-` and the first 16 bytes of
/// SHA-256 over `seed` and the index, shaped as a version-8 UUID. The same seed and index
/// always give the same UUID; another seed (another broker's state directory) gives
/// another.
pub fn synthetic_uuid(seed: &str, index: u32) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"gpu-broker host device\0");
    h.update(seed.as_bytes());
    h.update(b"\0");
    h.update(index.to_le_bytes());
    let digest = h.finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&digest[..16]);
    format!(
        "HOST-{}",
        uuid::Builder::from_custom_bytes(b).into_uuid().hyphenated()
    )
}

/// One live memory object.
struct Live {
    fd: SharedFd,
    block_id: u64,
}

/// A simulated device backed by memfd memory objects.
pub struct HostDevice {
    desc: DeviceDesc,
    allocated: u64,
    next_id: u64,
    live: HashMap<u64, Live>,
    /// The seals each new memfd gets ([`CREATION_SEALS`], or [`CLOSED_SEALS`]).
    seals: libc::c_int,
}

impl HostDevice {
    /// A device of `capacity` bytes.
    pub fn new(index: u32, capacity: u64) -> Result<HostDevice, DeviceError> {
        // A fresh identity each start unless `with_uuid_seed` gives a stable one.
        let seed = format!(
            "gpu-broker-{}-{}-dev{index}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        Ok(HostDevice {
            desc: DeviceDesc {
                index,
                name: format!("host-sim-{index}"),
                uuid: synthetic_uuid(&seed, index),
                model: HOST_MODEL.to_string(),
                backend: BackendKind::Host,
                total_bytes: capacity,
                granularity: HOST_GRANULARITY,
            },
            allocated: 0,
            next_id: 1,
            live: HashMap::new(),
            seals: CREATION_SEALS,
        })
    }

    /// Makes memfds nobody can seal further ([`CLOSED_SEALS`]): for memory that is never
    /// published (the host tier), so no holder can seal it against the revoking truncation.
    pub fn with_sealing_closed(mut self) -> HostDevice {
        self.seals = CLOSED_SEALS;
        self
    }

    /// Gives the device a stable identity: [`synthetic_uuid`] of `seed` (the broker passes
    /// its state directory, so a restarted broker's devices keep their UUIDs).
    pub fn with_uuid_seed(mut self, seed: &str) -> HostDevice {
        self.desc.uuid = synthetic_uuid(seed, self.desc.index);
        self
    }

    fn live(&self, alloc: &Allocation) -> Result<&Live, DeviceError> {
        self.live
            .get(&alloc.id)
            .ok_or(DeviceError::UnknownAllocation(alloc.id))
    }

    /// A `File` over a duplicate of the allocation's descriptor (for reads and writes).
    fn file(&self, alloc: &Allocation) -> Result<File, DeviceError> {
        let fd = self
            .live(alloc)?
            .fd
            .0
            .try_clone()
            .map_err(|e| io(alloc, e))?;
        Ok(File::from(fd))
    }
}

fn io(alloc: &Allocation, source: std::io::Error) -> DeviceError {
    DeviceError::Io {
        path: PathBuf::from(format!("memfd:allocation-{}", alloc.id)),
        source,
    }
}

/// The seals every device lease memfd gets when it is made: no growing. Not against
/// shrinking: the broker's free truncates it (`Device::revoke`), which is what takes its
/// pages back from a mapping a holder kept after the memory left it.
pub const CREATION_SEALS: libc::c_int = libc::F_SEAL_GROW;

/// The seals of memfds that are never published (the host tier): no growing, and no
/// further seal, so no holder can keep the truncation out.
pub const CLOSED_SEALS: libc::c_int = libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A new close-on-exec, sealable memfd of `bytes` bytes named `name` (the name is only a
/// label in `/proc/<pid>/fd`), with the [`CREATION_SEALS`].
pub fn memfd(name: &str, bytes: u64) -> std::io::Result<OwnedFd> {
    memfd_sealed(name, bytes, CREATION_SEALS)
}

/// [`memfd`] with the seals `seals`.
pub fn memfd_sealed(name: &str, bytes: u64, seals: libc::c_int) -> std::io::Result<OwnedFd> {
    let cname = CString::new(name).map_err(std::io::Error::other)?;
    // SAFETY: a valid NUL-terminated name; flags are plain constants.
    let raw =
        unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let len = libc::off_t::try_from(bytes).map_err(std::io::Error::other)?;
    // SAFETY: ftruncate on the descriptor just created.
    if unsafe { libc::ftruncate(raw, len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // Workers get this descriptor. Without the grow seal a holder could grow it past its
    // quota (the pages live as long as the broker's descriptor). A holder may shrink it:
    // that hurts only its own tenant (the object goes to no other). It stays sealable
    // (device memory), so that publishing it (`sharing.rs`) can seal it read-only; a
    // holder that adds a seal itself only hurts its own tenant, and such an object never
    // returns to the cache.
    // SAFETY: fcntl on the descriptor just created.
    if unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, seals) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}

impl Device for HostDevice {
    fn desc(&self) -> &DeviceDesc {
        &self.desc
    }

    fn mem_info(&mut self) -> Result<MemInfo, DeviceError> {
        Ok(MemInfo {
            free: self.desc.total_bytes - self.allocated,
            total: self.desc.total_bytes,
        })
    }

    fn fresh_is_zeroed(&self) -> bool {
        true
    }

    fn alloc(&mut self, bytes: u64) -> Result<Allocation, DeviceError> {
        if bytes == 0 {
            return Err(DeviceError::InvalidSize(bytes));
        }
        let free = self.desc.total_bytes - self.allocated;
        if bytes > free {
            return Err(DeviceError::OutOfMemory {
                requested: bytes,
                free,
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        let name = format!("gpu-broker-dev{}-{id}", self.desc.index);
        let fd = memfd_sealed(&name, bytes, self.seals).map_err(|source| DeviceError::Io {
            path: PathBuf::from(format!("memfd:{name}")),
            source,
        })?;
        self.allocated += bytes;
        self.live.insert(
            id,
            Live {
                fd: SharedFd::new(fd),
                block_id: new_block_id(),
            },
        );
        Ok(Allocation {
            id,
            bytes,
            addr: 0,
            path: None,
        })
    }

    fn adopt(&mut self, fd: OwnedFd, bytes: u64, block_id: u64) -> Result<Allocation, DeviceError> {
        // A restart with a smaller capacity: what does not fit is not taken back.
        let free = self.desc.total_bytes - self.allocated;
        if bytes > free {
            return Err(DeviceError::OutOfMemory {
                requested: bytes,
                free,
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        self.allocated += bytes;
        self.live.insert(
            id,
            Live {
                fd: SharedFd::new(fd),
                block_id,
            },
        );
        Ok(Allocation {
            id,
            bytes,
            addr: 0,
            path: None,
        })
    }

    fn held_as_file(&self, handle: &Handle) -> Option<crate::memfd_holders::MemFile> {
        let Handle::Fd { fd, .. } = handle;
        crate::memfd_holders::MemFile::of(&*fd.0).ok()
    }

    fn revoke(&mut self, alloc: &Allocation) -> Result<(), DeviceError> {
        let fd = self.live(alloc)?.fd.raw();
        // Truncated to nothing: every mapping and descriptor of it, wherever a holder
        // passed it, loses the pages (a touch faults) and the memory is back at once.
        // SAFETY: ftruncate on a descriptor we own.
        if unsafe { libc::ftruncate(fd, 0) } != 0 {
            return Err(io(alloc, std::io::Error::last_os_error()));
        }
        Ok(())
    }

    fn free(&mut self, alloc: Allocation) -> Result<(), DeviceError> {
        // Dropping our descriptor; a mapping or descriptor a worker still has keeps its
        // pages unless `revoke` truncated it first (they reach nobody else: nothing else
        // can open this object).
        self.live
            .remove(&alloc.id)
            .ok_or(DeviceError::UnknownAllocation(alloc.id))?;
        self.allocated -= alloc.bytes;
        Ok(())
    }

    fn export(&mut self, alloc: &Allocation) -> Result<Handle, DeviceError> {
        let live = self.live(alloc)?;
        Ok(Handle::Fd {
            kind: MemoryKind::HostMemfd,
            fd: live.fd.clone(),
            block_id: live.block_id,
            size: alloc.bytes,
        })
    }

    fn scrub(&mut self, alloc: &Allocation) -> Result<(), DeviceError> {
        let file = self.file(alloc)?;
        use std::os::fd::AsRawFd;
        // Punching a hole zeroes the range and gives the pages back at once.
        // SAFETY: fallocate on a valid, owned fd with an in-range length.
        let rc = unsafe {
            libc::fallocate(
                file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                alloc.bytes as libc::off_t,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let zeros = vec![0u8; 1 << 20];
        let mut at = 0;
        while at < alloc.bytes {
            let n = (alloc.bytes - at).min(zeros.len() as u64) as usize;
            file.write_all_at(&zeros[..n], at)
                .map_err(|e| io(alloc, e))?;
            at += n as u64;
        }
        Ok(())
    }

    fn read(
        &mut self,
        alloc: &Allocation,
        offset: u64,
        len: usize,
    ) -> Result<Vec<u8>, DeviceError> {
        check_range(alloc, offset, len as u64)?;
        let file = self.file(alloc)?;
        let mut buf = vec![0u8; len];
        file.read_exact_at(&mut buf, offset)
            .map_err(|e| io(alloc, e))?;
        Ok(buf)
    }

    fn write(&mut self, alloc: &Allocation, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        check_range(alloc, offset, data.len() as u64)?;
        self.file(alloc)?
            .write_all_at(data, offset)
            .map_err(|e| io(alloc, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_backend_passes_conformance() {
        crate::device::conformance::run_all(&mut || {
            Ok(Box::new(HostDevice::new(0, 256 << 20)?) as Box<dyn Device>)
        });
    }

    #[test]
    fn a_holder_cannot_grow_lease_memory() {
        let mut dev = HostDevice::new(0, 16 << 20).unwrap();
        let a = dev.alloc(1 << 20).unwrap();
        let Handle::Fd { fd, .. } = dev.export(&a).unwrap();
        // What a worker could try with the descriptor it received.
        // SAFETY: plain syscalls on a valid descriptor.
        unsafe {
            assert_ne!(
                libc::ftruncate(fd.raw(), 64 << 20),
                0,
                "grown past the lease"
            );
        }
        // Only the seals it was made with (what the sharing rules call pristine).
        // SAFETY: fcntl on a valid descriptor.
        assert_eq!(
            unsafe { libc::fcntl(fd.raw(), libc::F_GET_SEALS) },
            CREATION_SEALS
        );
        let f = std::fs::File::from(fd.0.try_clone().unwrap());
        assert_eq!(f.metadata().unwrap().len(), 1 << 20);
        // The broker still writes and scrubs it.
        dev.write(&a, 0, &[7u8; 16]).unwrap();
        dev.scrub(&a).unwrap();
        assert_eq!(dev.read(&a, 0, 16).unwrap(), vec![0u8; 16]);
        dev.free(a).unwrap();
    }

    /// The free's revocation: a mapping kept of freed memory holds no page (a touch would
    /// fault), on the device and on the host tier (whose memfds take no seal at all).
    #[test]
    fn revoking_takes_the_pages_from_a_kept_mapping() {
        for mut dev in [
            HostDevice::new(0, 16 << 20).unwrap(),
            HostDevice::new(u32::MAX, 16 << 20)
                .unwrap()
                .with_sealing_closed(),
        ] {
            let a = dev.alloc(1 << 20).unwrap();
            let Handle::Fd { fd, .. } = dev.export(&a).unwrap();
            let f = std::fs::File::from(fd.0.try_clone().unwrap());
            f.write_all_at(&[7u8; 1 << 20], 0).unwrap();
            assert!(f.metadata().unwrap().len() == 1 << 20);
            dev.revoke(&a).unwrap();
            dev.free(a).unwrap();
            assert_eq!(f.metadata().unwrap().len(), 0, "truncated");
            use std::os::unix::fs::MetadataExt;
            assert_eq!(f.metadata().unwrap().blocks(), 0, "no page left");
        }
        // A holder cannot keep the host tier's revocation out with a seal of its own.
        let mut dev = HostDevice::new(u32::MAX, 16 << 20)
            .unwrap()
            .with_sealing_closed();
        let a = dev.alloc(1 << 20).unwrap();
        let Handle::Fd { fd, .. } = dev.export(&a).unwrap();
        // SAFETY: fcntl on a valid descriptor.
        let rc = unsafe { libc::fcntl(fd.raw(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
        assert_ne!(rc, 0);
        dev.revoke(&a).unwrap();
    }

    #[test]
    fn synthetic_uuids_are_stable_per_seed_and_index() {
        let a = synthetic_uuid("/var/lib/gpu-broker", 0);
        assert_eq!(a, synthetic_uuid("/var/lib/gpu-broker", 0));
        assert_ne!(a, synthetic_uuid("/var/lib/gpu-broker", 1));
        assert_ne!(a, synthetic_uuid("/var/lib/other", 0));
        let u = uuid::Uuid::parse_str(a.strip_prefix("HOST-").unwrap()).unwrap();
        assert_eq!(u.get_version_num(), 8);
        let dev = HostDevice::new(3, 16 << 20)
            .unwrap()
            .with_uuid_seed("/var/lib/gpu-broker");
        assert_eq!(dev.desc().uuid, synthetic_uuid("/var/lib/gpu-broker", 3));
        assert_eq!(dev.desc().model, HOST_MODEL);
    }

    #[test]
    fn memory_is_a_memfd_with_no_path_and_goes_with_its_descriptors() {
        let mut dev = HostDevice::new(0, 16 << 20).unwrap();
        let a = dev.alloc(4096).unwrap();
        assert!(a.path.is_none());
        let Handle::Fd { kind, fd, size, .. } = dev.export(&a).unwrap();
        assert_eq!((kind, size), (MemoryKind::HostMemfd, 4096));
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.raw())).unwrap();
        assert!(
            link.to_string_lossy()
                .starts_with("/memfd:gpu-broker-dev0-"),
            "{link:?}"
        );
        assert_eq!(std::sync::Arc::strong_count(&fd.0), 2);
        dev.free(a).unwrap();
        // Only the exported handle keeps it now; dropping that closes the memfd.
        assert_eq!(std::sync::Arc::strong_count(&fd.0), 1);
    }
}
