//! The `host` backend: a simulated device whose allocations are real shared-memory files
//! (by default under `/dev/shm`), so a second process can map a lease and see the bytes
//! the first one wrote. Capacity is enforced exactly like a GPU's: an allocation that
//! would exceed it fails with `OutOfMemory`. Files are created 0600 with unique names,
//! removed on free, and every remaining one is removed when the device is dropped.

use super::{
    check_range, Allocation, BackendKind, Device, DeviceDesc, DeviceError, Handle, MemInfo,
};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

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

/// A simulated device backed by files in a directory.
pub struct HostDevice {
    desc: DeviceDesc,
    dir: PathBuf,
    prefix: String,
    allocated: u64,
    next_id: u64,
    live: HashMap<u64, PathBuf>,
    /// Marks this device's files as a live broker's (see `shm_owner`).
    _owner: super::shm_owner::OwnerLock,
}

impl HostDevice {
    /// A device of `capacity` bytes whose blocks are files in `dir` (created if missing).
    pub fn new(index: u32, capacity: u64, dir: &Path) -> Result<HostDevice, DeviceError> {
        std::fs::create_dir_all(dir).map_err(|source| DeviceError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        super::shm_owner::remove_stale_files(dir);
        let prefix = format!(
            "gpu-broker-{}-{}-dev{}-",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8],
            index
        );
        let uuid = synthetic_uuid(&prefix, index);
        let owner =
            super::shm_owner::OwnerLock::take(dir, &prefix).map_err(|source| DeviceError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
        Ok(HostDevice {
            _owner: owner,
            desc: DeviceDesc {
                index,
                name: format!("host-sim-{index}"),
                uuid,
                model: HOST_MODEL.to_string(),
                backend: BackendKind::Host,
                total_bytes: capacity,
                granularity: HOST_GRANULARITY,
            },
            dir: dir.to_path_buf(),
            prefix,
            allocated: 0,
            next_id: 1,
            live: HashMap::new(),
        })
    }

    /// Gives the device a stable identity: [`synthetic_uuid`] of `seed` (the broker passes
    /// its state directory, so a restarted broker's devices keep their UUIDs).
    pub fn with_uuid_seed(mut self, seed: &str) -> HostDevice {
        self.desc.uuid = synthetic_uuid(seed, self.desc.index);
        self
    }

    /// Directory holding the block files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn open(&self, alloc: &Allocation) -> Result<(File, PathBuf), DeviceError> {
        let path = self
            .live
            .get(&alloc.id)
            .ok_or(DeviceError::UnknownAllocation(alloc.id))?
            .clone();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|source| DeviceError::Io {
                path: path.clone(),
                source,
            })?;
        Ok((file, path))
    }
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
        let path = self.dir.join(format!("{}{id}", self.prefix));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|source| DeviceError::Io {
                path: path.clone(),
                source,
            })?;
        if let Err(source) = file.set_len(bytes) {
            let _ = std::fs::remove_file(&path);
            return Err(DeviceError::Io { path, source });
        }
        self.allocated += bytes;
        self.live.insert(id, path.clone());
        Ok(Allocation {
            id,
            bytes,
            addr: 0,
            path: Some(path),
        })
    }

    fn free(&mut self, alloc: Allocation) -> Result<(), DeviceError> {
        let path = self
            .live
            .remove(&alloc.id)
            .ok_or(DeviceError::UnknownAllocation(alloc.id))?;
        self.allocated -= alloc.bytes;
        std::fs::remove_file(&path).map_err(|source| DeviceError::Io { path, source })
    }

    fn export(&mut self, alloc: &Allocation) -> Result<Handle, DeviceError> {
        let path = self
            .live
            .get(&alloc.id)
            .ok_or(DeviceError::UnknownAllocation(alloc.id))?;
        Ok(Handle::HostShm(path.clone()))
    }

    fn scrub(&mut self, alloc: &Allocation) -> Result<(), DeviceError> {
        let (mut file, path) = self.open(alloc)?;
        // Punching a hole zeroes the range and gives the pages back at once on tmpfs.
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
        // Filesystems without hole punching: write zeros.
        let zeros = vec![0u8; 1 << 20];
        let io = |source| DeviceError::Io {
            path: path.clone(),
            source,
        };
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        let mut left = alloc.bytes;
        while left > 0 {
            let n = left.min(zeros.len() as u64) as usize;
            file.write_all(&zeros[..n]).map_err(io)?;
            left -= n as u64;
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
        let (file, path) = self.open(alloc)?;
        let mut buf = vec![0u8; len];
        file.read_exact_at(&mut buf, offset)
            .map_err(|source| DeviceError::Io { path, source })?;
        Ok(buf)
    }

    fn write(&mut self, alloc: &Allocation, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        check_range(alloc, offset, data.len() as u64)?;
        let (file, path) = self.open(alloc)?;
        file.write_all_at(data, offset)
            .map_err(|source| DeviceError::Io { path, source })
    }
}

impl Drop for HostDevice {
    fn drop(&mut self) {
        for path in self.live.values() {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_backend_passes_conformance() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        crate::device::conformance::run_all(&mut || {
            Ok(Box::new(HostDevice::new(0, 256 << 20, &d)?) as Box<dyn Device>)
        });
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(left.is_empty(), "files left behind: {left:?}");
    }

    #[test]
    fn synthetic_uuids_are_stable_per_seed_and_index() {
        let a = synthetic_uuid("/var/lib/gpu-broker", 0);
        assert_eq!(a, synthetic_uuid("/var/lib/gpu-broker", 0));
        assert_ne!(a, synthetic_uuid("/var/lib/gpu-broker", 1));
        assert_ne!(a, synthetic_uuid("/var/lib/other", 0));
        let u = uuid::Uuid::parse_str(a.strip_prefix("HOST-").unwrap()).unwrap();
        assert_eq!(u.get_version_num(), 8);
        let dir = tempfile::tempdir().unwrap();
        let dev = HostDevice::new(3, 16 << 20, dir.path())
            .unwrap()
            .with_uuid_seed("/var/lib/gpu-broker");
        assert_eq!(dev.desc().uuid, synthetic_uuid("/var/lib/gpu-broker", 3));
        assert_eq!(dev.desc().model, HOST_MODEL);
    }

    #[test]
    fn stale_files_of_dead_brokers_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let stale = dir.path().join("gpu-broker-4294967294-abcd1234-dev0-1");
        let other = dir.path().join("unrelated-file");
        std::fs::write(&stale, b"x").unwrap();
        std::fs::write(&other, b"x").unwrap();
        let _dev = HostDevice::new(0, 16 << 20, dir.path()).unwrap();
        assert!(!stale.exists());
        assert!(other.exists());
    }

    #[test]
    fn files_are_private_and_removed_on_drop() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let mut dev = HostDevice::new(0, 16 << 20, dir.path()).unwrap();
        let a = dev.alloc(4096).unwrap();
        let path = a.path.clone().unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        drop(dev);
        assert!(!path.exists());
    }
}
