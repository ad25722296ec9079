//! `gpubroker.Resident`: a lease mapped at addresses that survive sleep and wake (the
//! client crate's [`Resident`]). `sleep(save=True)` gives the memory back (the contents
//! saved to a host-tier lease), keeping the addresses; `wake(wait=...)` asks for memory
//! again (waiting or refused like `Session.lease`), maps it at the same addresses and
//! restores the contents. Arrays and tensors made from it (`as_numpy`, `as_torch`,
//! `as_cupy`) keep pointing at the same memory across both: touch them only while awake.
//!
//! `sleep_on_reclaim(save=True)` makes it sleep by itself when the broker asks for its
//! lease back (a reclaim request): a task on the package's runtime watches the session's
//! events, takes the resident (waiting for a sleep or wake of the caller to finish), and
//! sleeps it, so the reclaim completes without a Python handler. The caller learns of it
//! from `awake`/`reclaim_sleeps` and wakes it when it wants the memory again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::StreamExt;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use gpu_broker_client::{Contents, Resident};

use crate::api::PyLease;
use crate::errors::{self, IntoPyResult};
use crate::rt;

struct Cell {
    /// `None` while a sleep or wake runs, and once released.
    resident: Mutex<Option<Resident>>,
    released: Mutex<bool>,
    /// The reclaim watcher (`sleep_on_reclaim`), stopped on release.
    watcher: Mutex<Option<tokio::task::AbortHandle>>,
    /// Sleeps a reclaim request triggered, and why the last one failed.
    reclaim_sleeps: AtomicU64,
    reclaim_error: Mutex<Option<String>>,
}

impl Drop for Cell {
    fn drop(&mut self) {
        if let Some(w) = self.watcher.get_mut().take() {
            w.abort();
        }
    }
}

/// Watches `events` for reclaim requests of the resident's current lease and sleeps it.
async fn sleep_on_reclaims(
    cell: Weak<Cell>,
    mut events: gpu_broker_client::SessionEvents,
    contents: Contents,
) {
    while let Some(event) = events.next().await {
        let Some(request) = event.reclaim_request() else {
            continue;
        };
        let Some(c) = cell.upgrade() else { return };
        // A sleep or wake the caller runs holds the resident: wait for it (until the
        // deadline: then the broker revokes the lease anyway).
        let mut r = loop {
            if *c.released.lock() {
                return;
            }
            if let Some(r) = c.resident.lock().take() {
                break Some(r);
            }
            if request.time_left().is_zero() {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let Some(res) = r.as_mut() else { continue };
        if res.lease().map(|l| l.id()) == Some(request.lease_id.as_str()) {
            match res.sleep(contents).await {
                Ok(()) => {
                    c.reclaim_sleeps.fetch_add(1, Ordering::SeqCst);
                    tracing::info!(
                        lease_id = request.lease_id,
                        "gpubroker.Resident slept on a reclaim request"
                    );
                }
                Err(e) => {
                    tracing::warn!(lease_id = request.lease_id, error = %e, "a reclaim request could not put a gpubroker.Resident to sleep");
                    *c.reclaim_error.lock() = Some(e.to_string());
                }
            }
        }
        *c.resident.lock() = r;
    }
}

/// A lease whose memory can sleep and wake at the same addresses.
#[pyclass(frozen, name = "Resident", module = "gpubroker._native")]
pub struct PyResident {
    cell: Arc<Cell>,
    addr: u64,
    nbytes: u64,
    device: u32,
    host: bool,
    tier: &'static str,
    id: String,
}

impl PyResident {
    fn take(&self) -> PyResult<Resident> {
        if *self.cell.released.lock() {
            return Err(errors::local(
                "FailedPrecondition",
                "the resident lease was released",
            ));
        }
        self.cell.resident.lock().take().ok_or_else(|| {
            errors::local(
                "FailedPrecondition",
                "another sleep or wake of this lease is running",
            )
        })
    }

    fn put(&self, r: Resident) {
        *self.cell.resident.lock() = Some(r);
    }

    fn memory(&self, kind: &'static str) -> PyResult<ResidentMemory> {
        let awake = self
            .cell
            .resident
            .lock()
            .as_ref()
            .is_some_and(|r| r.is_awake());
        if !awake {
            return Err(errors::local(
                "FailedPrecondition",
                "the resident lease is asleep (or busy): wake() it before making views",
            ));
        }
        Ok(ResidentMemory {
            _cell: self.cell.clone(),
            ptr: self.addr,
            nbytes: self.nbytes,
            kind,
            device: self.device,
        })
    }
}

#[pymethods]
impl PyResident {
    /// Takes over `lease` (nothing may view it) and maps it at addresses of its own.
    #[new]
    fn new(py: Python<'_>, lease: &PyLease) -> PyResult<Self> {
        rt::check_process()?;
        let lease = lease.take_lease()?;
        let id = lease.id().to_string();
        let tier = lease.tier().as_str();
        let r = py.detach(|| Resident::new(lease)).py()?;
        Ok(PyResident {
            addr: r.addr(),
            nbytes: r.len(),
            device: r.device(),
            host: r.is_host(),
            tier,
            id,
            cell: Arc::new(Cell {
                resident: Mutex::new(Some(r)),
                released: Mutex::new(false),
                watcher: Mutex::new(None),
                reclaim_sleeps: AtomicU64::new(0),
                reclaim_error: Mutex::new(None),
            }),
        })
    }

    /// The address the memory is mapped at, awake or asleep (host or device pointer).
    #[getter]
    fn addr(&self) -> u64 {
        self.addr
    }

    /// Size in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.nbytes
    }

    /// Device index (a wake asks for the same device).
    #[getter]
    fn device(&self) -> u32 {
        self.device
    }

    /// `"device"` (or `"host"` for a host-fallback lease).
    #[getter]
    fn tier(&self) -> &'static str {
        self.tier
    }

    /// Id of the lease it was made from.
    #[getter]
    fn first_lease_id(&self) -> String {
        self.id.clone()
    }

    /// The lease mapped now (None while asleep).
    #[getter]
    fn lease_id(&self) -> Option<String> {
        self.cell
            .resident
            .lock()
            .as_ref()
            .and_then(|r| r.lease().map(|l| l.id().to_string()))
    }

    /// True while memory is mapped.
    #[getter]
    fn awake(&self) -> bool {
        self.cell
            .resident
            .lock()
            .as_ref()
            .is_some_and(|r| r.is_awake())
    }

    /// True while asleep with its contents kept in a host-tier lease.
    #[getter]
    fn saved(&self) -> bool {
        self.cell
            .resident
            .lock()
            .as_ref()
            .is_some_and(|r| r.has_saved_contents())
    }

    /// Gives the memory back, keeping the addresses; `save=True` keeps the contents in a
    /// host-tier lease (charged under the tenant's host limit). CUDA: waits for the
    /// device's queued work first. Sleeping twice does nothing.
    #[pyo3(signature = (save = true))]
    fn sleep(&self, py: Python<'_>, save: bool) -> PyResult<()> {
        let mut r = self.take()?;
        let contents = if save {
            Contents::Save
        } else {
            Contents::Discard
        };
        let out = rt::block_on(py, async move {
            let res = r.sleep(contents).await;
            (r, res)
        });
        match out {
            Ok((r, res)) => {
                self.put(r);
                res.py()
            }
            Err(e) => Err(e),
        }
    }

    /// From now on, sleep by itself (with the contents saved when `save`) whenever the
    /// broker asks for the current lease back; only reclaimable leases are asked (wakes
    /// keep the first lease's `reclaimable`). Arrays and tensors made from it must not be
    /// touched once it slept (check `awake`; `wake()` it first). Calling it again changes
    /// `save`.
    #[pyo3(signature = (save = true))]
    fn sleep_on_reclaim(&self, save: bool) -> PyResult<()> {
        rt::check_process()?;
        if *self.cell.released.lock() {
            return Err(errors::local(
                "FailedPrecondition",
                "the resident lease was released",
            ));
        }
        let events = {
            let g = self.cell.resident.lock();
            let r = g.as_ref().ok_or_else(|| {
                errors::local(
                    "FailedPrecondition",
                    "another sleep or wake of this lease is running",
                )
            })?;
            r.session().events()
        };
        let contents = if save {
            Contents::Save
        } else {
            Contents::Discard
        };
        let task = rt::handle().spawn(sleep_on_reclaims(
            Arc::downgrade(&self.cell),
            events,
            contents,
        ));
        if let Some(old) = self.cell.watcher.lock().replace(task.abort_handle()) {
            old.abort();
        }
        Ok(())
    }

    /// How many times a reclaim request put it to sleep (`sleep_on_reclaim`).
    #[getter]
    fn reclaim_sleeps(&self) -> u64 {
        self.cell.reclaim_sleeps.load(Ordering::SeqCst)
    }

    /// Why the last reclaim-triggered sleep failed (then the lease stayed mapped and the
    /// broker revokes it at the deadline), cleared by reading it; `None` if none did.
    fn take_reclaim_error(&self) -> Option<String> {
        self.cell.reclaim_error.lock().take()
    }

    /// Gets memory again at the same addresses (waiting up to `wait` seconds in the
    /// broker's queue; `None`: do not wait) and restores saved contents. Refused like
    /// `Session.lease` (the same exceptions); stays asleep then. Waking twice does nothing.
    #[pyo3(signature = (wait = None))]
    fn wake(&self, py: Python<'_>, wait: Option<f64>) -> PyResult<()> {
        let wait = wait.map(|w| rt::seconds("wait", w)).transpose()?;
        let mut r = self.take()?;
        let out = rt::block_on(py, async move {
            let res = r.wake(wait).await;
            (r, res)
        });
        match out {
            Ok((r, res)) => {
                self.put(r);
                res.py()
            }
            Err(e) => Err(e),
        }
    }

    /// Unmaps and gives everything back (the lease, or the saved contents). Views made
    /// from it must be gone; releasing twice does nothing.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        if *self.cell.released.lock() {
            return Ok(());
        }
        let views = Arc::strong_count(&self.cell) - 1;
        if views > 0 {
            return Err(errors::local(
                "FailedPrecondition",
                &format!("still viewed by {views} array(s) or tensor(s); delete them first"),
            ));
        }
        let r = self.take()?;
        *self.cell.released.lock() = true;
        if let Some(w) = self.cell.watcher.lock().take() {
            w.abort();
        }
        rt::block_on(py, async move { r.release().await })?.py()
    }

    /// `"host"` or `"device"`.
    fn _memory_kind(&self) -> &'static str {
        if self.host {
            "host"
        } else {
            "device"
        }
    }

    fn _host_memory(&self) -> PyResult<ResidentMemory> {
        if !self.host {
            return Err(errors::local(
                "FailedPrecondition",
                "a CUDA resident lease: use as_torch() or as_cupy()",
            ));
        }
        self.memory("host")
    }

    fn _cuda_memory(&self) -> PyResult<ResidentMemory> {
        if self.host {
            return Err(errors::local(
                "FailedPrecondition",
                "a host-memory resident lease: use as_numpy() (or as_torch() for a CPU tensor)",
            ));
        }
        self.memory("cuda")
    }

    /// Zero-copy numpy view (host memory), valid while awake.
    #[pyo3(signature = (dtype = None, shape = None))]
    fn as_numpy<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<Bound<'py, PyAny>>,
        shape: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        crate::api::array_view(slf.as_any(), "as_numpy", dtype, shape)
    }

    /// Zero-copy torch tensor (CUDA memory: a CUDA tensor whose address survives sleep
    /// and wake; host memory: a CPU tensor), valid while awake.
    #[pyo3(signature = (dtype = None, shape = None))]
    fn as_torch<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<Bound<'py, PyAny>>,
        shape: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        crate::api::array_view(slf.as_any(), "as_torch", dtype, shape)
    }

    /// Zero-copy CuPy array (CUDA memory), valid while awake.
    #[pyo3(signature = (dtype = None, shape = None))]
    fn as_cupy<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<Bound<'py, PyAny>>,
        shape: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        crate::api::array_view(slf.as_any(), "as_cupy", dtype, shape)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        if Arc::strong_count(&self.cell) == 1 {
            self.release(py)?;
        }
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "<gpubroker.Resident 0x{:x} {} bytes device={} {}>",
            self.addr,
            self.nbytes,
            self.device,
            if self.awake() { "awake" } else { "asleep" }
        )
    }
}

/// The address of a resident lease, held by the arrays and tensors made from it (the
/// range stays reserved while one lives).
#[pyclass(frozen, module = "gpubroker._native")]
pub struct ResidentMemory {
    _cell: Arc<Cell>,
    ptr: u64,
    nbytes: u64,
    kind: &'static str,
    device: u32,
}

#[pymethods]
impl ResidentMemory {
    #[getter]
    fn ptr(&self) -> u64 {
        self.ptr
    }
    #[getter]
    fn nbytes(&self) -> u64 {
        self.nbytes
    }
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind
    }
    #[getter]
    fn device(&self) -> u32 {
        self.device
    }
}
