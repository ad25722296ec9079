//! The Python classes over the client crate: `Broker` (a connection with a tenant token),
//! `Session`, `Lease`, `EventStream`, `Usage`, and `Memory` (a mapped lease's address,
//! kept alive by every array or tensor viewing it). Sessions, keepalive, events,
//! reconnection and the CUDA handle cache are the client crate's; this module only
//! translates, blocks without the GIL, and owns the mappings' lifetimes.
//!
//! **Mappings and release.** A lease is mapped on first use (`as_numpy`, `as_torch`,
//! `as_cupy`) and stays mapped while any view of it lives: every view holds a `Memory`,
//! which holds the lease's core. `Lease.release()` with views still alive raises
//! `FailedPrecondition` (releasing would let the broker hand the bytes to someone else
//! while this process still reads them); leaving a `with` block instead defers the
//! release until the last view is gone.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use gpu_broker_client::cuda::HostRegistration;
use gpu_broker_client::{
    Backoff, Client, Lease, LeaseInfo, Session, SessionEvent, SessionEvents, Usage,
};

use crate::errors::{self, IntoPyResult};
use crate::rt;

/// Connects to the broker at `address` with a tenant `token` (no defaults here; see
/// `gpubroker.connect`).
#[pyfunction]
pub fn _connect(py: Python<'_>, address: String, token: String) -> PyResult<Broker> {
    let addr = address.clone();
    let client = rt::wait(py, async move { Client::connect(&addr, token).await }, None)?
        .unwrap_or_else(|| {
            Err(gpu_broker_client::ClientError::Transport(
                "cancelled".into(),
            ))
        })
        .py()?;
    Ok(Broker { client, address })
}

/// A connection to the broker, authenticated as one tenant. Open sessions with
/// `session(name)`; `usage()` needs no session.
#[pyclass(frozen, module = "gpubroker._native")]
pub struct Broker {
    client: Client,
    address: String,
}

#[pymethods]
impl Broker {
    /// Opens a session named `name` (shown to operators). With `reconnect=True` the
    /// session survives broker restarts: it re-opens with backoff and reports
    /// `Reconnected` (the old session's leases are gone), or `Resumed` when a broker with a
    /// keeper kept it (leases and mappings live on). A context manager: leaving the
    /// `with` block ends the session and the broker takes back its leases.
    #[pyo3(signature = (name, *, reconnect = false))]
    fn session(&self, py: Python<'_>, name: String, reconnect: bool) -> PyResult<PySession> {
        let client = self.client.clone();
        let opened = rt::wait(
            py,
            async move {
                let builder = client.session_builder(name);
                if reconnect {
                    builder.reconnect(Backoff::default()).open().await
                } else {
                    builder.open().await
                }
            },
            None,
        )?;
        let session = opened
            .unwrap_or_else(|| {
                Err(gpu_broker_client::ClientError::Transport(
                    "cancelled".into(),
                ))
            })
            .py()?;
        Ok(PySession::new(session))
    }

    /// The tenant's quota and live usage.
    fn usage(&self, py: Python<'_>) -> PyResult<PyUsage> {
        let client = self.client.clone();
        let usage = rt::block_on(py, async move { client.usage().await })?.py()?;
        Ok(PyUsage::from(usage))
    }

    /// What the broker says about itself (`GetInfo`): a dict with `version` (its
    /// release), `api_revision`, `backend`, `device_count` and `features`. A broker too
    /// old to have `GetInfo` raises `BrokerError` with code `UNIMPLEMENTED`.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let client = self.client.clone();
        let i = rt::block_on(py, async move { client.broker_info().await })?.py()?;
        let d = pyo3::types::PyDict::new(py);
        d.set_item("version", i.version)?;
        d.set_item("api_revision", i.api_revision)?;
        d.set_item("backend", i.backend)?;
        d.set_item("device_count", i.device_count)?;
        d.set_item("features", i.features)?;
        Ok(d)
    }

    /// The address this broker was reached at.
    #[getter]
    fn address(&self) -> String {
        self.address.clone()
    }

    fn __repr__(&self) -> String {
        format!("<gpubroker.Broker {}>", self.address)
    }
}

/// Forgets `value` in a forked child (where its destructor would talk to a runtime or a
/// CUDA context that the child does not have), drops it otherwise.
fn drop_here<T>(value: T) {
    if rt::same_process() {
        drop(value);
    } else {
        std::mem::forget(value);
    }
}

/// A worker session. Leases are taken through it; its events (reclaim requests,
/// revocations, shutdown, reconnection) arrive on `events()`.
#[pyclass(frozen, name = "Session", module = "gpubroker._native")]
pub struct PySession {
    inner: Mutex<Option<Session>>,
    id: String,
    name: String,
    tenant: String,
}

impl Drop for PySession {
    fn drop(&mut self) {
        drop_here(self.inner.lock().take());
    }
}

impl PySession {
    fn new(session: Session) -> Self {
        PySession {
            id: session.id(),
            name: session.name().to_string(),
            tenant: session.tenant(),
            inner: Mutex::new(Some(session)),
        }
    }

    /// The client crate's session (for the torch allocator).
    pub(crate) fn client_session(&self) -> PyResult<Session> {
        self.session()
    }

    fn session(&self) -> PyResult<Session> {
        self.inner.lock().clone().ok_or_else(|| {
            errors::local(
                "FailedPrecondition",
                &format!("session {} was closed", self.id),
            )
        })
    }
}

#[pymethods]
impl PySession {
    /// Acquires `nbytes` of memory (rounded up to the broker's granularity). `device`:
    /// a device index (default: wherever it fits). `wait`: seconds to queue when memory
    /// is short (default: fail at once). `reclaimable`: agree to give it back when asked
    /// (`ReclaimRequested`). `fallback_host`: accept host memory when the device is full.
    /// Raises `QuotaExceeded`, `WaitTimeout`, `InvalidArgument`, ...
    #[pyo3(signature = (nbytes, *, device = None, wait = None, label = None, reclaimable = false, fallback_host = false))]
    #[allow(clippy::too_many_arguments)]
    fn lease(
        &self,
        py: Python<'_>,
        nbytes: u64,
        device: Option<u32>,
        wait: Option<f64>,
        label: Option<String>,
        reclaimable: bool,
        fallback_host: bool,
    ) -> PyResult<PyLease> {
        let session = self.session()?;
        let wait = wait.map(|w| rt::seconds("wait", w)).transpose()?;
        let granted = rt::wait(
            py,
            async move {
                let mut request = session
                    .lease_request(nbytes)
                    .reclaimable(reclaimable)
                    .fallback_host(fallback_host);
                if let Some(d) = device {
                    request = request.device(d);
                }
                if let Some(w) = wait {
                    request = request.wait(w);
                }
                if let Some(l) = label {
                    request = request.label(l);
                }
                request.send().await
            },
            None,
        )?;
        let lease = granted
            .unwrap_or_else(|| {
                Err(gpu_broker_client::ClientError::Transport(
                    "cancelled".into(),
                ))
            })
            .py()?;
        Ok(PyLease::new(lease))
    }

    /// A new iterator over this session's events (see `gpubroker.events`). The first
    /// call also yields events that arrived before it; later calls start from now. It
    /// ends after `Closed`.
    fn events(&self) -> PyResult<EventStream> {
        Ok(EventStream::new(self.session()?.events()))
    }

    /// Calls `callback(event)` for every `ReclaimRequested` from now on, on a background
    /// thread (the callback runs with the GIL; release the lease in it).
    fn on_reclaim(&self, callback: Py<PyAny>) -> PyResult<()> {
        let mut events = self.session()?.events();
        let handle = rt::handle();
        std::thread::Builder::new()
            .name("gpubroker-reclaim".into())
            .spawn(move || {
                while let Some(event) = handle.block_on(events.next()) {
                    if !matches!(event, SessionEvent::ReclaimRequested { .. }) {
                        continue;
                    }
                    Python::attach(|py| {
                        let called = event_to_py(py, &event)
                            .and_then(|ev| callback.call1(py, (ev,)).map(drop));
                        if let Err(e) = called {
                            e.print(py);
                        }
                    });
                }
            })
            .map_err(|e| errors::local("BrokerError", &format!("cannot start a thread: {e}")))?;
        Ok(())
    }

    /// Keeps the memory and mappings of leases released from now on in this process, up
    /// to `nbytes` in all (0: off, the default): the broker holds each released block for
    /// this process, and the next lease of its size is that block, granted with no ticket
    /// and mapped already (`Lease.retained`). Retained blocks stay counted to the tenant
    /// until let go: past the bound (oldest first), when the broker asks for them because
    /// others wait (answered on the package's runtime, no GIL needed), on
    /// `drop_retained()`, or when the process exits. A lowered bound lets go at once.
    fn retain_mappings(&self, nbytes: u64) -> PyResult<()> {
        rt::check_process()?;
        // The listener it may start runs on the session's runtime (the package's).
        self.session()?.retain_mappings(nbytes);
        Ok(())
    }

    /// Bytes of released blocks this process retains now (`retain_mappings`).
    #[getter]
    fn retained_nbytes(&self) -> u64 {
        self.inner.lock().as_ref().map_or(0, |s| s.retained_bytes())
    }

    /// Lets go of every block this process retains (each confirmed to the broker, which
    /// may then hand the memory on).
    fn drop_retained(&self, py: Python<'_>) -> PyResult<()> {
        let session = self.session()?;
        rt::block_on(py, async move {
            session.drop_retained().await;
            Ok::<(), gpu_broker_client::ClientError>(())
        })?
        .py()
    }

    /// The tenant's quota and live usage.
    fn usage(&self, py: Python<'_>) -> PyResult<PyUsage> {
        let session = self.session()?;
        let usage = rt::block_on(py, async move { session.usage().await })?.py()?;
        Ok(PyUsage::from(usage))
    }

    /// Ends the session now: the broker takes back every lease it still holds.
    fn close(&self) {
        if let Some(s) = self.inner.lock().take() {
            s.close();
            drop_here(s);
        }
    }

    /// Session id (with reconnection: the current broker session's).
    #[getter]
    fn id(&self) -> String {
        match self.inner.lock().as_ref() {
            Some(s) => s.id(),
            None => self.id.clone(),
        }
    }

    /// Name given at open time.
    #[getter]
    fn name(&self) -> String {
        self.name.clone()
    }

    /// The tenant of the token.
    #[getter]
    fn tenant(&self) -> String {
        self.tenant.clone()
    }

    /// True once the session is over (closed here, or ended by the broker).
    #[getter]
    fn closed(&self) -> bool {
        self.inner.lock().as_ref().is_none_or(|s| s.is_closed())
    }

    /// False while a reconnecting session is between broker sessions (and once closed).
    #[getter]
    fn connected(&self) -> bool {
        self.inner.lock().as_ref().is_some_and(|s| s.is_connected())
    }

    /// Seconds the broker keeps a quiet session (keepalives are sent automatically).
    #[getter]
    fn keepalive_timeout(&self) -> Option<f64> {
        self.inner
            .lock()
            .as_ref()
            .and_then(|s| s.keepalive_timeout())
            .map(|d| d.as_secs_f64())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> bool {
        self.close();
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "<gpubroker.Session {} name={:?} tenant={:?}{}>",
            self.id(),
            self.name,
            self.tenant,
            if self.closed() { " closed" } else { "" }
        )
    }
}

/// A lease and the CUDA registration of its host mapping; views hold it alive through
/// [`Memory`]. The mappings are the lease's own (`Lease::mapped`, `Lease::mapped_cuda`):
/// closed when it is released, or kept with the block when the session retains it
/// (`retain_mappings`). Fields drop in order: the registration, then the lease (whose drop
/// closes its mapping and releases it in the background when it was not released).
struct LeaseCore {
    registration: Mutex<Option<HostRegistration<'static>>>,
    lease: Mutex<Option<Lease>>,
}

impl Drop for LeaseCore {
    fn drop(&mut self) {
        drop_here(self.registration.lock().take());
        drop_here(self.lease.lock().take());
    }
}

impl LeaseCore {
    /// Drops what borrows the lease's mapping (before the lease is released or taken).
    fn unmap(&self) {
        drop(self.registration.lock().take());
    }
}

/// Memory granted by the broker. A context manager: leaving the `with` block releases
/// it (after the last array or tensor viewing it is gone).
#[pyclass(frozen, name = "Lease", module = "gpubroker._native")]
pub struct PyLease {
    info: LeaseInfo,
    session_id: String,
    core: Mutex<Option<Arc<LeaseCore>>>,
}

impl PyLease {
    fn new(lease: Lease) -> Self {
        PyLease {
            info: lease.info().clone(),
            session_id: lease.session_id().to_string(),
            core: Mutex::new(Some(Arc::new(LeaseCore {
                registration: Mutex::new(None),
                lease: Mutex::new(Some(lease)),
            }))),
        }
    }

    fn core(&self) -> PyResult<Arc<LeaseCore>> {
        self.core.lock().clone().ok_or_else(|| {
            errors::local(
                "FailedPrecondition",
                &format!("lease {} was released", self.info.lease_id),
            )
        })
    }

    fn lost_check(&self, core: &LeaseCore) -> PyResult<()> {
        match core.lease.lock().as_ref() {
            Some(l) if l.is_lost() => {
                Err(errors::to_py(gpu_broker_client::ClientError::LeaseLost {
                    lease_id: self.info.lease_id.clone(),
                    session_id: self.session_id.clone(),
                }))
            }
            _ => Ok(()),
        }
    }

    /// Takes the lease out of this object for a wrapper that owns it from now on (a
    /// `Resident`): refused while arrays or tensors view it; this object reads as
    /// released afterwards.
    pub(crate) fn take_lease(&self) -> PyResult<Lease> {
        let Some(core) = self.core.lock().take() else {
            return Err(errors::local(
                "FailedPrecondition",
                &format!("lease {} was released", self.info.lease_id),
            ));
        };
        if Arc::strong_count(&core) > 1 {
            *self.core.lock() = Some(core);
            return Err(errors::local(
                "FailedPrecondition",
                &format!(
                    "lease {} is still viewed by arrays or tensors; delete them first",
                    self.info.lease_id
                ),
            ));
        }
        core.unmap();
        let lease = core.lease.lock().take();
        lease.ok_or_else(|| errors::local("FailedPrecondition", "lease released"))
    }

    /// The lease's own host mapping (a memfd fd lease or a legacy shared-memory file:
    /// `Lease::mapped`, made on first use, or kept from a retained block) as `(address,
    /// length)`.
    fn host_mapping(&self, core: &LeaseCore) -> PyResult<(u64, usize)> {
        let mut lease = core.lease.lock();
        let Some(lease) = lease.as_mut() else {
            return Err(errors::local("FailedPrecondition", "lease released"));
        };
        match lease.mapped() {
            Ok(m) => Ok((m.as_ptr() as u64, m.len())),
            Err(gpu_broker_client::ClientError::NotMappable) => Err(errors::local(
                "FailedPrecondition",
                &format!(
                    "lease {} is device memory ({} handle): use as_torch() or as_cupy()",
                    self.info.lease_id,
                    self.info.handle.kind()
                ),
            )),
            Err(e) => Err(errors::to_py(e)),
        }
    }

    /// `"host"` when the lease maps as host memory, `"device"` when it is CUDA memory.
    fn kind_of(&self, core: &LeaseCore) -> &'static str {
        let mappable = core
            .lease
            .lock()
            .as_ref()
            .is_some_and(|l| l.is_host_mappable());
        if mappable {
            "host"
        } else {
            "device"
        }
    }
}

#[pymethods]
impl PyLease {
    /// UUID of the lease.
    #[getter]
    fn id(&self) -> String {
        self.info.lease_id.clone()
    }

    /// Granted size in bytes (the request rounded up to the broker's granularity).
    #[getter]
    fn nbytes(&self) -> u64 {
        self.info.bytes
    }

    /// Size asked for.
    #[getter]
    fn requested_nbytes(&self) -> u64 {
        self.info.requested_bytes
    }

    /// Device index.
    #[getter]
    fn device(&self) -> u32 {
        self.info.device
    }

    /// `"device"` or `"host"` (host memory granted as a fallback).
    #[getter]
    fn tier(&self) -> &'static str {
        self.info.tier.as_str()
    }

    /// How the memory is reached: `"fd"` (a memfd or CUDA VMM memory), `"host_shm"`
    /// (older brokers), `"unknown"`.
    #[getter]
    fn handle_kind(&self) -> &'static str {
        self.info.handle.kind()
    }

    /// Label given at acquire time.
    #[getter]
    fn label(&self) -> String {
        self.info.label.clone()
    }

    /// The holder agreed to give it back on request.
    #[getter]
    fn reclaimable(&self) -> bool {
        self.info.reclaimable
    }

    /// Broker session the lease was acquired on.
    #[getter]
    fn session_id(&self) -> String {
        self.session_id.clone()
    }

    /// True once released (or handed to a deferred release).
    #[getter]
    fn released(&self) -> bool {
        self.core.lock().is_none()
    }

    /// True once the broker session it was acquired on is lost (reconnecting sessions):
    /// its memory is gone.
    #[getter]
    fn lost(&self) -> bool {
        self.core
            .lock()
            .as_ref()
            .and_then(|c| c.lease.lock().as_ref().map(|l| l.is_lost()))
            .unwrap_or(false)
    }

    /// True when granted from a block this process retained (`Session.retain_mappings`):
    /// no ticket came, and its mapping is the one the released lease had.
    #[getter]
    fn retained(&self) -> bool {
        matches!(&self.info.handle, gpu_broker_client::LeaseHandle::Fd(i) if i.retained)
    }

    /// Gives the memory back now. Raises `FailedPrecondition` while arrays or tensors
    /// still view it (delete them first), `NotFound` when the broker no longer has it
    /// (revoked, or lost with its session). Releasing twice does nothing.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let Some(core) = self.core.lock().take() else {
            return Ok(());
        };
        let views = Arc::strong_count(&core) - 1;
        if views > 0 {
            *self.core.lock() = Some(core);
            return Err(errors::local(
                "FailedPrecondition",
                &format!(
                    "lease {} is still viewed by {views} array(s) or tensor(s); delete them \
                     before releasing (the broker may hand released memory to another tenant)",
                    self.info.lease_id
                ),
            ));
        }
        core.unmap();
        let lease = core.lease.lock().take();
        drop(core);
        match lease {
            Some(lease) => rt::block_on(py, async move { lease.release().await })?.py(),
            None => Ok(()),
        }
    }

    /// Releases now when nothing views the lease, otherwise once the last view is gone.
    /// What leaving a `with` block does. Returns True when released now.
    fn release_when_unused(&self, py: Python<'_>) -> PyResult<bool> {
        let Some(core) = self.core.lock().take() else {
            return Ok(true);
        };
        if Arc::strong_count(&core) > 1 {
            // The last Memory drops the core: mappings close, then the lease is released
            // in the background.
            drop(core);
            return Ok(false);
        }
        *self.core.lock() = Some(core);
        self.release(py).map(|()| true)
    }

    /// A new, unredeemed ticket of this fd lease (`RenewLeaseTicket`), as
    /// `(socket_path, ticket bytes)`: for redeeming it with plain sockets, as
    /// `docs/protocol.md` describes.
    fn _fresh_ticket<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(String, Bound<'py, pyo3::types::PyBytes>)> {
        let core = self.core()?;
        let client = core
            .lease
            .lock()
            .as_ref()
            .map(|l| l.session().client().clone())
            .ok_or_else(|| errors::local("FailedPrecondition", "lease released"))?;
        let id = self.info.lease_id.clone();
        let reply = rt::block_on(py, async move {
            client
                .raw()
                .renew_lease_ticket(gpu_broker_client::proto::v1::RenewLeaseTicketRequest {
                    lease_id: id,
                })
                .await
                .map_err(gpu_broker_client::ClientError::from)
        })?
        .py()?
        .into_inner();
        let fd = reply
            .fd
            .ok_or_else(|| errors::local("BrokerError", "RenewLeaseTicket carried no handle"))?;
        Ok((fd.socket_path, pyo3::types::PyBytes::new(py, &fd.ticket)))
    }

    /// `"host"` (maps as host memory: as_numpy works) or `"device"` (CUDA memory).
    fn _memory_kind(&self) -> PyResult<&'static str> {
        let core = self.core()?;
        Ok(self.kind_of(&core))
    }

    /// The host address of the lease's shared-memory mapping (mapped on first use) as a
    /// `Memory` that keeps the mapping alive; `as_numpy` builds on it.
    fn _host_memory(&self) -> PyResult<Memory> {
        let core = self.core()?;
        self.lost_check(&core)?;
        let (ptr, _) = self.host_mapping(&core)?;
        Ok(Memory {
            core,
            ptr,
            nbytes: self.info.bytes,
            kind: "host",
            device: self.info.device,
        })
    }

    /// A device pointer to the lease as a `Memory`: the CUDA handle opened in this
    /// process (reference-counted by the client crate), or for host memory its
    /// registration with CUDA (pinned, mapped). `as_torch`/`as_cupy` build on it.
    fn _cuda_memory(&self, py: Python<'_>) -> PyResult<Memory> {
        let core = self.core()?;
        self.lost_check(&core)?;
        // This process's CUDA ordinal of the lease's device (by UUID: the broker's index
        // differs when the CUDA_VISIBLE_DEVICES differ, as under `gpu-brokerctl run`).
        let device =
            gpu_broker_client::cuda::local_ordinal(self.info.device, &self.info.device_uuid);
        let ptr = match self.kind_of(&core) {
            "host" => {
                let (addr, len) = self.host_mapping(&core)?;
                let mut reg = core.registration.lock();
                if reg.is_none() {
                    // SAFETY: the registration is stored next to the lease owning the
                    // mapping in the same core and dropped before it (field order,
                    // `unmap`), so the borrowed memory outlives the registration; the
                    // mapping's address never moves while the lease keeps it.
                    let slice: &'static mut [u8] =
                        unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
                    let made = py.detach(|| gpu_broker_client::cuda::register_host(slice, device));
                    *reg =
                        Some(made.map_err(|e| {
                            errors::local("FailedPrecondition", &format!("CUDA: {e}"))
                        })?);
                }
                reg.as_ref().map_or(0, |r| r.device_ptr())
            }
            _ => {
                let mut lease = core.lease.lock();
                let Some(lease) = lease.as_mut() else {
                    return Err(errors::local("FailedPrecondition", "lease released"));
                };
                // The lease's own mapping, made on first use (or kept from a retained block).
                let mapped = py.detach(|| lease.mapped_cuda().map(|m| m.device_ptr()));
                mapped.map_err(|e| match e {
                    gpu_broker_client::ClientError::Cuda(m) => {
                        errors::local("FailedPrecondition", &format!("CUDA: {m}"))
                    }
                    other => errors::to_py(other),
                })?
            }
        };
        Ok(Memory {
            core,
            ptr,
            nbytes: self.info.bytes,
            kind: "cuda",
            device,
        })
    }

    /// Zero-copy numpy view of a host shared-memory lease (the host backend, or a
    /// host-fallback lease). `dtype` any numpy dtype; `shape` defaults to as many
    /// elements as fit.
    #[pyo3(signature = (dtype = None, shape = None))]
    fn as_numpy<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<Bound<'py, PyAny>>,
        shape: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        array_view(slf.as_any(), "as_numpy", dtype, shape)
    }

    /// Zero-copy torch tensor: device memory becomes a CUDA tensor (through the CUDA
    /// handle the client crate imports); host memory a CPU tensor (pinned when CUDA is
    /// present). `dtype` a torch dtype (default uint8).
    #[pyo3(signature = (dtype = None, shape = None))]
    fn as_torch<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<Bound<'py, PyAny>>,
        shape: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        array_view(slf.as_any(), "as_torch", dtype, shape)
    }

    /// Zero-copy CuPy array on the lease's device (host memory: registered and mapped).
    #[pyo3(signature = (dtype = None, shape = None))]
    fn as_cupy<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<Bound<'py, PyAny>>,
        shape: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        array_view(slf.as_any(), "as_cupy", dtype, shape)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.release_when_unused(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "<gpubroker.Lease {} {} bytes device={} tier={}{}>",
            self.info.lease_id,
            self.info.bytes,
            self.info.device,
            self.info.tier.as_str(),
            if self.released() { " released" } else { "" }
        )
    }
}

/// An address inside a mapped lease, held by every array or tensor made from it: while
/// one lives, the mapping stays open and the lease is not released.
#[pyclass(frozen, module = "gpubroker._native")]
pub struct Memory {
    #[allow(dead_code)]
    core: Arc<LeaseCore>,
    ptr: u64,
    nbytes: u64,
    kind: &'static str,
    device: u32,
}

#[pymethods]
impl Memory {
    /// The address (host or device).
    #[getter]
    fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Bytes mapped.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.nbytes
    }
    /// `"host"` (a host address) or `"cuda"` (a device address).
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind
    }
    /// The CUDA device of a `"cuda"` address.
    #[getter]
    fn device(&self) -> u32 {
        self.device
    }
    fn __repr__(&self) -> String {
        format!(
            "<gpubroker.Memory {} 0x{:x} {} bytes>",
            self.kind, self.ptr, self.nbytes
        )
    }
}

/// Iterator over one session's events; ends after `Closed`.
#[pyclass(frozen, module = "gpubroker._native")]
pub struct EventStream {
    events: Arc<tokio::sync::Mutex<SessionEvents>>,
    done: Mutex<bool>,
}

impl Drop for EventStream {
    fn drop(&mut self) {
        if !rt::same_process() {
            // Leave the stream's channel alone in a forked child.
            std::mem::forget(self.events.clone());
        }
    }
}

impl EventStream {
    fn new(events: SessionEvents) -> Self {
        EventStream {
            events: Arc::new(tokio::sync::Mutex::new(events)),
            done: Mutex::new(false),
        }
    }

    fn next_event(&self, py: Python<'_>, timeout: Option<Duration>) -> PyResult<Option<Py<PyAny>>> {
        if *self.done.lock() {
            return Ok(None);
        }
        let events = self.events.clone();
        // The stream stays in the shared cell when a timeout or Ctrl-C cancels the wait
        // (its receiver is cancel-safe), so the next call continues where this one was.
        let got = rt::wait(py, async move { events.lock().await.next().await }, timeout)?;
        match got {
            None => Ok(None),
            Some(None) => {
                *self.done.lock() = true;
                Ok(None)
            }
            Some(Some(event)) => {
                if event.is_closed() {
                    *self.done.lock() = true;
                }
                Ok(Some(event_to_py(py, &event)?))
            }
        }
    }
}

#[pymethods]
impl EventStream {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        self.next_event(py, None)
    }

    /// The next event, or None when `timeout` seconds pass first (or the stream ended).
    #[pyo3(signature = (timeout = None))]
    fn next(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Py<PyAny>>> {
        let timeout = timeout.map(|t| rt::seconds("timeout", t)).transpose()?;
        self.next_event(py, timeout)
    }
}

fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A session event as a `gpubroker.events` object.
pub fn event_to_py(py: Python<'_>, event: &SessionEvent) -> PyResult<Py<PyAny>> {
    let m = py.import("gpubroker.events")?;
    let kw = PyDict::new(py);
    let class = match event {
        SessionEvent::ReclaimRequested {
            lease_id,
            bytes,
            deadline,
            reason,
        } => {
            kw.set_item("lease_id", lease_id)?;
            kw.set_item("nbytes", bytes)?;
            kw.set_item("deadline", unix_seconds(*deadline))?;
            kw.set_item("reason", reason)?;
            "ReclaimRequested"
        }
        SessionEvent::LeaseRevoked { lease_id, reason } => {
            kw.set_item("lease_id", lease_id)?;
            kw.set_item("reason", reason)?;
            "LeaseRevoked"
        }
        SessionEvent::ShuttingDown { reason, grace } => {
            kw.set_item("reason", reason)?;
            kw.set_item("grace", grace.as_secs_f64())?;
            "ShuttingDown"
        }
        SessionEvent::YieldRequested {
            turn_id,
            device,
            deadline,
        } => {
            kw.set_item("turn_id", turn_id)?;
            kw.set_item("device", device)?;
            kw.set_item("deadline", unix_seconds(*deadline))?;
            "YieldRequested"
        }
        SessionEvent::TurnRevoked {
            turn_id,
            device,
            reason,
        } => {
            kw.set_item("turn_id", turn_id)?;
            kw.set_item("device", device)?;
            kw.set_item("reason", reason)?;
            "TurnRevoked"
        }
        SessionEvent::DeviceUnhealthy {
            device,
            uuid,
            reason,
        } => {
            kw.set_item("device", device)?;
            kw.set_item("uuid", uuid)?;
            kw.set_item("reason", reason)?;
            "DeviceUnhealthy"
        }
        SessionEvent::Disconnected { session_id, reason } => {
            kw.set_item("session_id", session_id)?;
            kw.set_item("reason", reason)?;
            "Disconnected"
        }
        SessionEvent::Reconnected {
            old_session_id,
            new_session_id,
            lost_leases,
        } => {
            kw.set_item("old_session_id", old_session_id)?;
            kw.set_item("new_session_id", new_session_id)?;
            kw.set_item("lost_leases", lost_leases.clone())?;
            "Reconnected"
        }
        SessionEvent::Resumed {
            session_id,
            kept_leases,
            lost_leases,
        } => {
            kw.set_item("session_id", session_id)?;
            kw.set_item("kept_leases", kept_leases.clone())?;
            kw.set_item("lost_leases", lost_leases.clone())?;
            "Resumed"
        }
        SessionEvent::Closed { reason } => {
            kw.set_item("reason", reason.clone())?;
            "Closed"
        }
        other => {
            kw.set_item("description", format!("{other:?}"))?;
            "Unknown"
        }
    };
    Ok(m.getattr(class)?.call((), Some(&kw))?.unbind())
}

/// The tenant's quota and live usage (`Session.usage()` / `Broker.usage()`): the client's
/// [`Usage`] itself, its attributes read from its quota and counters.
#[pyclass(frozen, name = "Usage", module = "gpubroker._native")]
pub struct PyUsage(Usage);

impl From<Usage> for PyUsage {
    fn from(u: Usage) -> Self {
        PyUsage(u)
    }
}

#[pymethods]
impl PyUsage {
    /// Tenant name.
    #[getter]
    fn tenant(&self) -> &str {
        &self.0.tenant
    }
    /// Most device bytes the tenant may hold.
    #[getter]
    fn limit_bytes(&self) -> u64 {
        self.0.quota.limit_bytes
    }
    /// Device bytes held now.
    #[getter]
    fn held_bytes(&self) -> u64 {
        self.0.usage.held_bytes
    }
    /// Live leases.
    #[getter]
    fn lease_count(&self) -> u32 {
        self.0.usage.lease_count
    }
    /// Most live leases (0: no limit).
    #[getter]
    fn max_leases(&self) -> u32 {
        self.0.quota.max_leases
    }
    /// Queue priority.
    #[getter]
    fn priority(&self) -> i32 {
        self.0.quota.priority
    }
    /// Bytes kept available for the tenant.
    #[getter]
    fn guaranteed_bytes(&self) -> u64 {
        self.0.quota.guaranteed_bytes
    }
    /// Held beyond the guarantee.
    #[getter]
    fn borrowed_bytes(&self) -> u64 {
        self.0.usage.borrowed_bytes
    }
    /// Bytes of ended leases a live process may still map.
    #[getter]
    fn quarantined_bytes(&self) -> u64 {
        self.0.usage.quarantined_bytes
    }
    /// Most host-fallback bytes.
    #[getter]
    fn host_limit_bytes(&self) -> u64 {
        self.0.quota.host_limit_bytes
    }
    /// Host-fallback bytes held.
    #[getter]
    fn host_held_bytes(&self) -> u64 {
        self.0.usage.host_held_bytes
    }
    /// Open sessions of the tenant.
    #[getter]
    fn session_count(&self) -> u32 {
        self.0.usage.session_count
    }
    /// Requests waiting in a queue.
    #[getter]
    fn waiting_requests(&self) -> u32 {
        self.0.usage.waiting_requests
    }
    /// Device bytes the tenant may still take under its limit.
    #[getter]
    fn available_bytes(&self) -> u64 {
        self.0.available_bytes()
    }
    /// Per-device caps by device index (on top of `limit_bytes`).
    #[getter]
    fn device_limit_bytes(&self) -> std::collections::BTreeMap<u32, u64> {
        self.0.quota.device_limit_bytes.clone()
    }
    /// Device bytes held per device index (what the caps count).
    #[getter]
    fn device_committed_bytes(&self) -> std::collections::BTreeMap<u32, u64> {
        self.0.usage.device_committed_bytes.clone()
    }

    fn __repr__(&self) -> String {
        format!(
            "<gpubroker.Usage tenant={:?} held={} of {} bytes, {} lease(s)>",
            self.0.tenant,
            self.0.usage.held_bytes,
            self.0.quota.limit_bytes,
            self.0.usage.lease_count
        )
    }
}

/// A zero-copy view of `obj`'s memory made by `gpubroker._arrays.<view>` (`as_numpy`,
/// `as_torch` or `as_cupy`): the one place leases and residents turn into arrays.
pub(crate) fn array_view<'py>(
    obj: &Bound<'py, PyAny>,
    view: &str,
    dtype: Option<Bound<'py, PyAny>>,
    shape: Option<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    obj.py()
        .import("gpubroker._arrays")?
        .call_method1(view, (obj, dtype, shape))
}
