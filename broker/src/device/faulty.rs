//! A fault-injecting device for tests on machines without a GPU: wraps another device and,
//! on command through its [`FaultSwitch`], fails health checks with a reason (as a GPU
//! after an Xid or ECC error would), stops answering altogether (every call blocks until
//! the switch is released, as a GPU that fell off the bus makes driver calls hang), or
//! fails allocations, or keeps freed memory on the device (as an importer keeps CUDA
//! memory). With no fault switched on it behaves exactly like the device it wraps and
//! passes the conformance suite.

use super::{Allocation, Device, DeviceDesc, DeviceError, Handle, MemInfo};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;

/// What to break.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Health checks fail with this reason.
    pub unhealthy: Option<String>,
    /// Every call blocks while this is set.
    pub hang: bool,
    /// Allocations fail.
    pub fail_alloc: bool,
    /// Exports fail (after an allocation succeeded).
    pub fail_export: bool,
    /// Freed memory stays on the device, as a CUDA block does while another process
    /// holds its import: the free memory reported does not rise by it.
    pub keep_freed: bool,
}

/// The remote control of a [`FaultyDevice`]; cheap to clone, usable from any thread.
#[derive(Clone, Debug, Default)]
pub struct FaultSwitch(Arc<Mutex<Faults>>);

impl FaultSwitch {
    pub fn set(&self, f: Faults) {
        *self.0.lock() = f;
    }
    pub fn unhealthy(&self, reason: &str) {
        self.0.lock().unhealthy = Some(reason.to_string());
    }
    pub fn hang(&self, on: bool) {
        self.0.lock().hang = on;
    }
    pub fn heal(&self) {
        *self.0.lock() = Faults::default();
    }
    fn get(&self) -> Faults {
        self.0.lock().clone()
    }
}

/// A device with switchable faults (see the module doc).
pub struct FaultyDevice {
    inner: Box<dyn Device>,
    switch: FaultSwitch,
    /// Freed bytes kept on the device (`Faults::keep_freed`).
    kept: u64,
}

impl FaultyDevice {
    pub fn new(inner: Box<dyn Device>, switch: FaultSwitch) -> FaultyDevice {
        FaultyDevice {
            inner,
            switch,
            kept: 0,
        }
    }

    /// Blocks while the device is told to hang.
    fn stall(&self) {
        while self.switch.get().hang {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Device for FaultyDevice {
    fn desc(&self) -> &DeviceDesc {
        self.inner.desc()
    }
    fn mem_info(&mut self) -> Result<MemInfo, DeviceError> {
        self.stall();
        let info = self.inner.mem_info()?;
        Ok(MemInfo {
            free: info.free.saturating_sub(self.kept),
            ..info
        })
    }
    fn fresh_is_zeroed(&self) -> bool {
        self.inner.fresh_is_zeroed()
    }
    fn alloc(&mut self, bytes: u64) -> Result<Allocation, DeviceError> {
        self.stall();
        if self.switch.get().fail_alloc {
            return Err(DeviceError::Driver {
                call: "alloc",
                message: "injected fault".into(),
            });
        }
        self.inner.alloc(bytes)
    }
    fn free(&mut self, alloc: Allocation) -> Result<(), DeviceError> {
        self.stall();
        let bytes = alloc.bytes;
        self.inner.free(alloc)?;
        if self.switch.get().keep_freed {
            self.kept += bytes;
        }
        Ok(())
    }
    fn revoke(&mut self, alloc: &Allocation) -> Result<(), DeviceError> {
        self.stall();
        self.inner.revoke(alloc)
    }
    fn adopt(
        &mut self,
        fd: std::os::fd::OwnedFd,
        bytes: u64,
        block_id: u64,
    ) -> Result<Allocation, DeviceError> {
        self.stall();
        self.inner.adopt(fd, bytes, block_id)
    }
    fn export(&mut self, alloc: &Allocation) -> Result<Handle, DeviceError> {
        self.stall();
        if self.switch.get().fail_export {
            return Err(DeviceError::Driver {
                call: "export",
                message: "injected fault".into(),
            });
        }
        self.inner.export(alloc)
    }
    fn scrub(&mut self, alloc: &Allocation) -> Result<(), DeviceError> {
        self.stall();
        self.inner.scrub(alloc)
    }
    fn read(
        &mut self,
        alloc: &Allocation,
        offset: u64,
        len: usize,
    ) -> Result<Vec<u8>, DeviceError> {
        self.stall();
        self.inner.read(alloc, offset, len)
    }
    fn write(&mut self, alloc: &Allocation, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.stall();
        self.inner.write(alloc, offset, data)
    }
    fn health(&mut self) -> Result<(), DeviceError> {
        self.stall();
        if let Some(reason) = self.switch.get().unhealthy {
            return Err(DeviceError::Unavailable(reason));
        }
        self.inner.health()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::host::HostDevice;

    #[test]
    fn without_faults_it_passes_conformance_and_with_them_it_fails_health() {
        crate::device::conformance::run_all(&mut || {
            let inner = Box::new(HostDevice::new(0, 256 << 20)?);
            Ok(Box::new(FaultyDevice::new(inner, FaultSwitch::default())) as Box<dyn Device>)
        });
        let switch = FaultSwitch::default();
        let mut dev = FaultyDevice::new(
            Box::new(HostDevice::new(0, 16 << 20).unwrap()),
            switch.clone(),
        );
        switch.unhealthy("Xid 79 (fallen off the bus)");
        match dev.health() {
            Err(DeviceError::Unavailable(m)) => assert!(m.contains("Xid 79")),
            other => panic!("{other:?}"),
        }
        switch.set(Faults {
            fail_alloc: true,
            ..Default::default()
        });
        assert!(dev.health().is_ok());
        assert!(dev.alloc(2 << 20).is_err());
        switch.heal();
        let a = dev.alloc(2 << 20).unwrap();
        dev.free(a).unwrap();
    }

    #[test]
    fn memory_kept_on_free_does_not_come_back_and_a_plain_free_does() {
        use crate::device::free_check::Returned;
        let switch = FaultSwitch::default();
        let mut dev = FaultyDevice::new(
            Box::new(HostDevice::new(0, 16 << 20).unwrap()),
            switch.clone(),
        );
        let a = dev.alloc(4 << 20).unwrap();
        assert_eq!(dev.free_checked(a, None).unwrap(), Returned::Yes);
        switch.set(Faults {
            keep_freed: true,
            ..Default::default()
        });
        let a = dev.alloc(4 << 20).unwrap();
        assert_eq!(dev.free_checked(a, None).unwrap(), Returned::No);
        assert_eq!(dev.mem_info().unwrap().free, 12 << 20);
    }
}
