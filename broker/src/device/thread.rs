//! One dedicated OS thread per device. CUDA driver calls act on the context current on the
//! calling thread and tokio moves tasks between threads, so every call on a device goes
//! through this thread, fed by a channel; async callers await a oneshot reply and never
//! block on the driver.
//!
//! Jobs run in the order they were queued: the lock guard (`arbiter/effects.rs`) queues a
//! free before it releases the state lock, so the free reaches the device ahead of any
//! allocation admitted after it.

use super::{Device, DeviceDesc, DeviceError};
use std::sync::mpsc;
use tokio::sync::oneshot;

type Job = Box<dyn FnOnce(&mut dyn Device) + Send>;

/// A device thread whose device is opening ([`DeviceThread::start`]).
pub struct Opening {
    ready: mpsc::Receiver<Result<DeviceDesc, DeviceError>>,
    jobs: mpsc::Sender<Job>,
}

impl Opening {
    /// Waits until the device opened: its handle, or why it could not open.
    pub fn ready(self) -> Result<DeviceThread, DeviceError> {
        let desc = self.ready.recv().map_err(|_| DeviceError::ThreadGone)??;
        Ok(DeviceThread {
            desc,
            jobs: self.jobs,
        })
    }
}

/// A cheap, cloneable handle to a device living on its own thread.
#[derive(Clone)]
pub struct DeviceThread {
    desc: DeviceDesc,
    jobs: mpsc::Sender<Job>,
}

impl DeviceThread {
    /// Starts a thread, builds the device on it with `open` (so a CUDA context is created
    /// and made current on that thread), and returns a handle once the device is ready.
    pub fn spawn<F>(name: String, open: F) -> Result<DeviceThread, DeviceError>
    where
        F: FnOnce() -> Result<Box<dyn Device>, DeviceError> + Send + 'static,
    {
        Self::start(name, open)?.ready()
    }

    /// [`DeviceThread::spawn`] without waiting for the device to open: several devices
    /// open at once (a CUDA context takes a while each), each waited for with
    /// [`Opening::ready`]. An `Opening` dropped unwaited lets its device go once open.
    pub fn start<F>(name: String, open: F) -> Result<Opening, DeviceError>
    where
        F: FnOnce() -> Result<Box<dyn Device>, DeviceError> + Send + 'static,
    {
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<DeviceDesc, DeviceError>>();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let mut device = match open() {
                    Ok(d) => {
                        let _ = ready_tx.send(Ok(d.desc().clone()));
                        d
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                while let Ok(job) = jobs_rx.recv() {
                    job(device.as_mut());
                }
                // Channel closed: every handle is gone; dropping the device releases it.
                drop(device);
            })
            .map_err(|e| DeviceError::Unavailable(format!("cannot start device thread: {e}")))?;
        Ok(Opening {
            ready: ready_rx,
            jobs: jobs_tx,
        })
    }

    /// What the device is.
    pub fn desc(&self) -> &DeviceDesc {
        &self.desc
    }

    /// Runs `f` on the device thread and awaits its result.
    pub async fn call<R, F>(&self, f: F) -> Result<R, DeviceError>
    where
        R: Send + 'static,
        F: FnOnce(&mut dyn Device) -> R + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        self.jobs
            .send(Box::new(move |d: &mut dyn Device| {
                let _ = tx.send(f(d));
            }))
            .map_err(|_| DeviceError::ThreadGone)?;
        rx.await.map_err(|_| DeviceError::ThreadGone)
    }

    /// Runs `f` on the device thread and blocks the calling (non-async) thread for it.
    pub fn call_blocking<R, F>(&self, f: F) -> Result<R, DeviceError>
    where
        R: Send + 'static,
        F: FnOnce(&mut dyn Device) -> R + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        self.jobs
            .send(Box::new(move |d: &mut dyn Device| {
                let _ = tx.send(f(d));
            }))
            .map_err(|_| DeviceError::ThreadGone)?;
        rx.recv().map_err(|_| DeviceError::ThreadGone)
    }
}

impl DeviceThread {
    /// Queues `f` on the device thread without waiting for it. Jobs run in the order they
    /// were queued, so a free queued here happens before any later allocation.
    pub fn submit<F>(&self, f: F) -> Result<(), DeviceError>
    where
        F: FnOnce(&mut dyn Device) + Send + 'static,
    {
        self.jobs
            .send(Box::new(f))
            .map_err(|_| DeviceError::ThreadGone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Devices started with `start` open at once: each one's open waits until the other's
    /// has begun (serial opening would never get there).
    #[test]
    fn devices_started_together_open_at_once() {
        let (a_tx, a_rx) = mpsc::channel::<()>();
        let (b_tx, b_rx) = mpsc::channel::<()>();
        let open = |index: u32, mine: mpsc::Sender<()>, theirs: mpsc::Receiver<()>| {
            move || {
                mine.send(()).unwrap();
                theirs
                    .recv_timeout(Duration::from_secs(20))
                    .map_err(|_| DeviceError::Unavailable("opened one after the other".into()))?;
                Ok(
                    Box::new(super::super::host::HostDevice::new(index, 4 << 20)?)
                        as Box<dyn Device>,
                )
            }
        };
        let a = DeviceThread::start("test-a".into(), open(0, a_tx, b_rx)).unwrap();
        let b = DeviceThread::start("test-b".into(), open(1, b_tx, a_rx)).unwrap();
        let (a, b) = (a.ready().unwrap(), b.ready().unwrap());
        assert_eq!((a.desc().index, b.desc().index), (0, 1));
        let free = b
            .call_blocking(|d| d.mem_info().map(|m| m.free))
            .unwrap()
            .unwrap();
        assert_eq!(free, 4 << 20);
    }
}
