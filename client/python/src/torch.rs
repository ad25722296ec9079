//! The PyTorch allocator on broker leases: the C hooks PyTorch's
//! `CUDAPluggableAllocator` loads from this very shared object
//! (`gpubroker_torch_alloc`, `gpubroker_torch_free`), the [`gpubroker_suballoc`] allocator
//! they call, and its CUDA backend over the client crate: a segment is one CUDA VMM lease
//! of the process's own session, a [`Resident`] mapped at an address range of its own,
//! released after its mapping is closed. Stream order uses CUDA events
//! (`cuEventRecord`/`cuEventQuery`). Reclaim requests and revocations are handled on a
//! Rust thread reading the session's events: no GIL, no Python callback.
//!
//! **Retained segments.** With `install(retain=...)` the session retains mappings: a free
//! segment released (`empty_cache`) keeps its range mapped, held for this process, and the
//! next segment of its size is that block at that address ([`Resident::new`] takes the
//! range back): one RPC. The client crate's listener lets them go when the broker asks; a
//! refused acquire lets them go and asks once more; segments the broker asked back are
//! released unretained.
//!
//! **Sleep and wake.** A segment of CUDA VMM memory is a [`Resident`] (the client crate's:
//! its own reserved address range), so [`_torch_sleep`] can give every segment's memory
//! back (contents optionally saved to host-tier leases) and [`_torch_wake`] get it again at
//! the same addresses: PyTorch's tensors keep their pointers and, when saved, their bytes.
//! While asleep the alloc hook refuses (PyTorch raises its OOM).
//!
//! `gpubroker/torch.py` installs the hooks behind a `MemPool` that every thread and stream
//! allocates from, so PyTorch's own caching allocator sits on top (one hook call per
//! PyTorch segment) and turns a failed hook call into `torch.OutOfMemoryError`.

use std::any::Any;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cudarc::driver::sys::{self, CUcontext, CUevent, CUresult, CUstream};
use futures::StreamExt;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use gpu_broker_client::{
    ClientError, Contents, Lease, LeaseHandle, MemoryKind, Resident, Session, SessionEvent,
};
use gpubroker_suballoc::{Backend, Config, EventId, Granted, Refused, Stream, SubAllocator};

use crate::api::PySession;
use crate::errors;
use crate::rt;

/// One segment, a resident lease (VMM memory: it can sleep and wake at its address): the
/// sub-allocator knows it by its first lease's id. Boxed as the allocator's token.
struct ResidentSegment {
    first_id: String,
    /// The region tag whose allocator holds it (`None`: the process-wide allocator).
    tag: Option<String>,
    resident: parking_lot::Mutex<Option<Resident>>,
}

/// Resident segments by base address, and which first id each current lease id belongs
/// to (a wake gives a segment a new lease; reclaim requests name the new one).
#[derive(Default)]
struct Residents {
    by_base: std::collections::BTreeMap<u64, Arc<ResidentSegment>>,
    first_id: HashMap<String, String>,
}

fn residents() -> &'static parking_lot::Mutex<Residents> {
    static R: OnceLock<parking_lot::Mutex<Residents>> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// Set while the segments sleep: the alloc hook refuses.
static ASLEEP: AtomicBool = AtomicBool::new(false);

/// What a reclaim request of a resident segment does (`install(sleep_on_reclaim=...)`):
/// 0 drain the segment (the default), 1 sleep every segment without contents, 2 sleep
/// every segment saving the contents.
static SLEEP_ON_RECLAIM: AtomicU8 = AtomicU8::new(0);
/// Sleeps reclaim requests triggered.
static RECLAIM_SLEEPS: AtomicU64 = AtomicU64::new(0);
/// Segments granted from a block this process retained (`install(retain=...)`): one RPC,
/// mapped already at the address the released segment had.
static RETAINED_ACQUIRES: AtomicU64 = AtomicU64::new(0);

/// First lease ids of segments the broker asked back (a reclaim request, a revocation):
/// released without being retained, even when that waits for a drain to finish.
fn asked_back() -> &'static parking_lot::Mutex<std::collections::HashSet<String>> {
    static S: OnceLock<parking_lot::Mutex<std::collections::HashSet<String>>> = OnceLock::new();
    S.get_or_init(Default::default)
}

/// Segments are leases of one session; events and contexts through the driver API.
pub struct LeaseBackend {
    session: Session,
    handle: tokio::runtime::Handle,
    reclaimable: bool,
    /// The region tag its segments belong to (`None`: the process-wide allocator).
    tag: Option<String>,
    /// The broker's device UUIDs by index (`GetInfo`; empty from a broker that does not
    /// say): PyTorch's device numbers are this process's CUDA ordinals, which are the
    /// broker's indices only when both see the same devices in the same order.
    broker_uuids: Vec<String>,
}

impl LeaseBackend {
    /// The same session and devices, for the segments of region `tag`.
    pub(crate) fn for_region(&self, tag: &str, reclaimable: bool) -> LeaseBackend {
        LeaseBackend {
            session: self.session.clone(),
            handle: self.handle.clone(),
            reclaimable,
            tag: Some(tag.to_string()),
            broker_uuids: self.broker_uuids.clone(),
        }
    }

    /// The broker device of this process's CUDA ordinal `device` (by UUID, else the same
    /// number).
    fn broker_device(&self, device: u32) -> u32 {
        gpu_broker_client::ordinal::index_for(
            &self.broker_uuids,
            gpu_broker_client::cuda::ordinal_uuid(device).as_deref(),
            device,
        )
    }
}

fn refused(e: ClientError) -> Refused {
    Refused {
        code: e.code_name().to_string(),
        reason: e.reason().map(|r| r.as_str().to_string()),
        cause: e.detail("cause").map(str::to_string),
        message: e.message(),
    }
}

/// The primary context of `device`, retained once per process.
fn primary_context(device: u32) -> Option<CUcontext> {
    static CONTEXTS: OnceLock<parking_lot::Mutex<Vec<Option<usize>>>> = OnceLock::new();
    let table = CONTEXTS.get_or_init(|| parking_lot::Mutex::new(Vec::new()));
    let mut t = table.lock();
    let i = device as usize;
    if t.len() <= i {
        t.resize(i + 1, None);
    }
    if let Some(ctx) = t[i] {
        return Some(ctx as CUcontext);
    }
    // SAFETY: plain driver calls with valid out pointers; libcuda is present because a
    // segment was mapped on this device before any event call.
    unsafe {
        if !sys::is_culib_present() || sys::cuInit(0) != CUresult::CUDA_SUCCESS {
            return None;
        }
        let mut dev = 0;
        if sys::cuDeviceGet(&mut dev, device as c_int) != CUresult::CUDA_SUCCESS {
            return None;
        }
        let mut ctx: CUcontext = std::ptr::null_mut();
        if sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) != CUresult::CUDA_SUCCESS {
            return None;
        }
        t[i] = Some(ctx as usize);
        Some(ctx)
    }
}

/// Runs `f` with `device`'s primary context current on this thread.
fn in_context<T>(device: u32, f: impl FnOnce() -> T) -> T {
    let pushed = primary_context(device)
        // SAFETY: a retained primary context.
        .is_some_and(|ctx| unsafe { sys::cuCtxPushCurrent_v2(ctx) } == CUresult::CUDA_SUCCESS);
    let out = f();
    if pushed {
        let mut old: CUcontext = std::ptr::null_mut();
        // SAFETY: balances the push.
        unsafe {
            sys::cuCtxPopCurrent_v2(&mut old);
        }
    }
    out
}

/// The device of each live event (its context is made current to query or wait for it).
fn event_devices() -> &'static parking_lot::Mutex<std::collections::HashMap<EventId, u32>> {
    static T: OnceLock<parking_lot::Mutex<std::collections::HashMap<EventId, u32>>> =
        OnceLock::new();
    T.get_or_init(Default::default)
}

fn event_device(event: EventId) -> u32 {
    event_devices().lock().get(&event).copied().unwrap_or(0)
}

impl Backend for LeaseBackend {
    fn acquire(&self, device: u32, bytes: u64, wait: Option<Duration>) -> Result<Granted, Refused> {
        let session = self.session.clone();
        let reclaimable = self.reclaimable;
        let broker_device = self.broker_device(device);
        let label = match &self.tag {
            Some(tag) => format!("gpubroker.torch region {tag}"),
            None => "gpubroker.torch".to_string(),
        };
        let lease = self
            .handle
            .block_on(async move {
                let ask = || {
                    let mut request = session
                        .lease_request(bytes)
                        .device(broker_device)
                        .label(label.clone())
                        .reclaimable(reclaimable);
                    if let Some(w) = wait {
                        request = request.wait(w);
                    }
                    request.send()
                };
                match ask().await {
                    // Segments this process retains count to the tenant: on a refusal for
                    // room, let them go and ask once more (not after a wait ran out: a
                    // waiting request has had them asked back already).
                    Err(e) if session.retained_bytes() > 0 && wants_room(&e) => {
                        tracing::debug!(error = %e, "gpubroker.torch: letting retained segments go");
                        session.drop_retained().await;
                        ask().await
                    }
                    r => r,
                }
            })
            .map_err(refused)?;
        if matches!(lease.handle(), LeaseHandle::Fd(i) if i.retained) {
            RETAINED_ACQUIRES.fetch_add(1, Ordering::Relaxed);
        }
        let vmm =
            matches!(lease.handle(), LeaseHandle::Fd(i) if i.memory_kind == MemoryKind::CudaVmm);
        if !vmm {
            // Host memory cannot back CUDA tensors; dropping the lease releases it.
            return Err(refused(ClientError::NotMappable));
        }
        let (bytes, lease_id) = (lease.bytes(), lease.id().to_string());
        // A failed mapping drops the lease, which releases it in the background.
        let r = Resident::new(lease).map_err(refused)?;
        let base = r.addr();
        let seg = Arc::new(ResidentSegment {
            first_id: lease_id.clone(),
            tag: self.tag.clone(),
            resident: parking_lot::Mutex::new(Some(r)),
        });
        let mut reg = residents().lock();
        reg.by_base.insert(base, seg.clone());
        reg.first_id.insert(lease_id.clone(), lease_id.clone());
        Ok(Granted {
            base,
            bytes,
            lease_id,
            token: Box::new(seg),
        })
    }

    fn release(&self, token: Box<dyn Any + Send>) {
        let Ok(seg) = token.downcast::<Arc<ResidentSegment>>() else {
            tracing::error!("gpubroker.torch: a foreign segment token");
            return;
        };
        let r = seg.resident.lock().take();
        {
            let mut reg = residents().lock();
            if let Some(r) = &r {
                reg.by_base.remove(&r.addr());
            }
            reg.first_id.retain(|_, first| *first != seg.first_id);
        }
        let asked_back = asked_back().lock().remove(&seg.first_id);
        if let Some(r) = r {
            // Revoked or lost leases are already gone. A free segment is retained mapped
            // when the session retains (`install(retain=...)`), unless the broker asked
            // for it.
            let released = if asked_back {
                self.handle.block_on(r.release_unretained())
            } else {
                self.handle.block_on(r.release())
            };
            if let Err(e) = released {
                tracing::debug!(lease_id = seg.first_id, error = %e, "segment release");
            }
        }
    }

    fn record(&self, device: u32, stream: Stream) -> Result<EventId, String> {
        if is_capturing(stream) {
            // A block PyTorch gives back from a graph's pool while that graph is being
            // captured: recording an event would add a node to the graph (and querying
            // it is illegal); the captured work runs only at replay, after this.
            return Ok(NO_EVENT);
        }
        in_context(device, || {
            let mut ev: CUevent = std::ptr::null_mut();
            // SAFETY: valid out pointer; the device's context is current.
            let rc = unsafe {
                sys::cuEventCreate(
                    &mut ev,
                    sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as std::ffi::c_uint,
                )
            };
            if rc != CUresult::CUDA_SUCCESS {
                return Err(format!("cuEventCreate: {rc:?}"));
            }
            // SAFETY: `stream` is the CUDA stream PyTorch allocated on (0: legacy default).
            let rc = unsafe { sys::cuEventRecord(ev, stream as CUstream) };
            if rc != CUresult::CUDA_SUCCESS {
                // SAFETY: created above, destroyed once.
                unsafe { sys::cuEventDestroy_v2(ev) };
                return Err(format!("cuEventRecord: {rc:?}"));
            }
            let id = ev as u64;
            event_devices().lock().insert(id, device);
            Ok(id)
        })
    }

    fn query(&self, event: EventId) -> bool {
        if event == NO_EVENT {
            return true;
        }
        // SAFETY: a live event recorded by `record`.
        in_context(event_device(event), || unsafe {
            sys::cuEventQuery(event as CUevent) != CUresult::CUDA_ERROR_NOT_READY
        })
    }

    fn synchronize(&self, event: EventId) {
        if event == NO_EVENT {
            return;
        }
        // SAFETY: a live event recorded by `record`.
        in_context(event_device(event), || unsafe {
            sys::cuEventSynchronize(event as CUevent);
        });
    }

    fn destroy(&self, event: EventId) {
        if event == NO_EVENT {
            return;
        }
        let device = event_devices().lock().remove(&event).unwrap_or(0);
        // SAFETY: a live event recorded by `record`, destroyed once (the allocator counts).
        in_context(device, || unsafe {
            sys::cuEventDestroy_v2(event as CUevent);
        });
    }

    fn synchronize_device(&self, device: u32) {
        // SAFETY: the device's primary context is current.
        in_context(device, || unsafe {
            sys::cuCtxSynchronize();
        });
    }
}

static ALLOCATOR: OnceLock<SubAllocator<LeaseBackend>> = OnceLock::new();

/// The event of a block freed on a stream under CUDA graph capture: none is recorded.
const NO_EVENT: EventId = 0;

/// True while `stream` is being captured into a CUDA graph.
fn is_capturing(stream: Stream) -> bool {
    if stream == 0 {
        return false; // the legacy default stream cannot be captured
    }
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a live stream PyTorch handed us; valid out pointer.
    let rc = unsafe { sys::cuStreamIsCapturing(stream as CUstream, &mut status) };
    rc == CUresult::CUDA_SUCCESS
        && status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
}

/// Runs `f` with this thread in relaxed stream-capture mode when `stream` is being
/// captured: taking and mapping a lease, and querying other streams' events, are
/// "unsafe" calls a global-mode capture would otherwise refuse (PyTorch does the same
/// around its own cudaMalloc during capture).
fn capture_tolerant<T>(stream: Stream, f: impl FnOnce() -> T) -> T {
    if !is_capturing(stream) {
        return f();
    }
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: valid in/out pointer; restored below.
    let swapped =
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) } == CUresult::CUDA_SUCCESS;
    let out = f();
    if swapped {
        // SAFETY: puts back the mode the thread had.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
    out
}

/// Blocks used on several streams (`record_stream`, NCCL) come back to PyTorch's pool
/// only once no pool routing is active, which under `install()` is never: so a hook call
/// (PyTorch missed its cache) asks the main thread, through a pending call, to run
/// `gpubroker.torch`'s `_reuse_stream_blocks_soon`, at most once per interval.
struct StreamBlockFlush {
    callback: Py<PyAny>,
    interval_ns: u64,
}

static FLUSH: OnceLock<StreamBlockFlush> = OnceLock::new();
static FLUSH_QUEUED: AtomicBool = AtomicBool::new(false);
static FLUSH_LAST_NS: AtomicU64 = AtomicU64::new(0);
/// Pending calls queued (`memory_stats()["stream_block_flushes"]`).
static FLUSHES: AtomicU64 = AtomicU64::new(0);

fn monotonic_ns() -> u64 {
    static START: OnceLock<std::time::Instant> = OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_nanos() as u64
}

fn schedule_stream_block_flush() {
    let Some(flush) = FLUSH.get() else { return };
    // 0: never flushed.
    let now = monotonic_ns().max(1);
    let last = FLUSH_LAST_NS.load(Ordering::Relaxed);
    if (last != 0 && now.saturating_sub(last) < flush.interval_ns)
        || FLUSH_QUEUED.swap(true, Ordering::SeqCst)
    {
        return;
    }
    FLUSH_LAST_NS.store(now, Ordering::Relaxed);
    // SAFETY: Py_AddPendingCall may be called from any thread without the GIL.
    if unsafe { pyo3::ffi::Py_AddPendingCall(Some(run_stream_block_flush), std::ptr::null_mut()) }
        != 0
    {
        FLUSH_QUEUED.store(false, Ordering::SeqCst);
    }
}

/// The pending call: runs on the main thread with the GIL, between bytecodes.
extern "C" fn run_stream_block_flush(_: *mut c_void) -> c_int {
    FLUSH_QUEUED.store(false, Ordering::SeqCst);
    let _ = std::panic::catch_unwind(|| {
        if let Some(flush) = FLUSH.get() {
            FLUSHES.fetch_add(1, Ordering::Relaxed);
            Python::attach(|py| {
                // Never raise into whatever the main thread was running.
                if let Err(e) = flush.callback.call0(py) {
                    tracing::debug!(error = %e, "gpubroker.torch: stream-block flush");
                }
            });
        }
    });
    0
}

/// Registers the main-thread callback that returns multi-stream blocks to PyTorch's
/// pool, run at most once per `interval_s` after a hook call.
#[pyfunction]
pub fn _torch_set_stream_block_flush(callback: Py<PyAny>, interval_s: f64) -> PyResult<()> {
    let interval_ns = (interval_s.max(0.0) * 1e9) as u64;
    FLUSH
        .set(StreamBlockFlush {
            callback,
            interval_ns,
        })
        .map_err(|_| errors::local("FailedPrecondition", "the flush is already registered"))
}

/// PyTorch's alloc hook: `void* alloc(ssize_t size, int device, cudaStream_t stream)`.
/// Null when the broker refused after waiting (PyTorch's caching allocator then raises
/// `torch.OutOfMemoryError`; the reason is in `_torch_last_error`).
#[no_mangle]
pub extern "C" fn gpubroker_torch_alloc(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let stream = stream as usize;
    std::panic::catch_unwind(|| {
        let (Some(a), Ok(size), Ok(device)) =
            (ALLOCATOR.get(), u64::try_from(size), u32::try_from(device))
        else {
            return std::ptr::null_mut();
        };
        if size == 0 {
            return std::ptr::null_mut();
        }
        if ASLEEP.load(Ordering::SeqCst) {
            tracing::warn!(
                size,
                device,
                "gpubroker.torch: allocation while asleep (wake() first)"
            );
            return std::ptr::null_mut();
        }
        schedule_stream_block_flush();
        let region = crate::regions::current(a);
        if region.as_ref().is_some_and(|r| r.is_paused()) {
            tracing::warn!(
                size,
                device,
                "gpubroker.torch: allocation in a paused region"
            );
            return std::ptr::null_mut();
        }
        let a = region.as_ref().map_or(a, |r| r.allocator());
        match capture_tolerant(stream, || a.alloc(device, size, stream)) {
            Ok(ptr) => ptr as *mut c_void,
            Err(e) => {
                tracing::warn!(size, device, error = %e, "gpubroker.torch: allocation failed");
                std::ptr::null_mut()
            }
        }
    })
    .unwrap_or(std::ptr::null_mut())
}

/// PyTorch's free hook: `void free(void* ptr, size_t size, int device, cudaStream_t stream)`.
#[no_mangle]
pub extern "C" fn gpubroker_torch_free(
    ptr: *mut c_void,
    _size: usize,
    _device: c_int,
    stream: *mut c_void,
) {
    let ptr = ptr as u64;
    let stream = stream as usize;
    let _ = std::panic::catch_unwind(|| {
        if let Some(a) = ALLOCATOR.get() {
            let freed = capture_tolerant(stream, || {
                a.free(ptr).or_else(|e| crate::regions::free(ptr).ok_or(e))
            });
            if let Err(e) = freed {
                tracing::error!(error = %e, "gpubroker.torch: free of an unknown pointer");
            }
        }
    });
}

/// Reads the session's events on a Rust thread: a reclaim request or a revocation of a
/// segment's lease releases it when no block lives in it (else drains it); a lost session
/// drains every segment it held.
fn watch_events(session: &Session) -> std::io::Result<()> {
    let mut events = session.events();
    let handle = rt::handle();
    std::thread::Builder::new()
        .name("gpubroker-torch-reclaim".into())
        .spawn(move || {
            while let Some(event) = handle.block_on(events.next()) {
                let Some(a) = ALLOCATOR.get() else { continue };
                let ids: Vec<String> = match &event {
                    SessionEvent::ReclaimRequested { lease_id, .. }
                    | SessionEvent::LeaseRevoked { lease_id, .. } => vec![lease_id.clone()],
                    SessionEvent::Reconnected { lost_leases, .. }
                    | SessionEvent::Resumed { lost_leases, .. } => lost_leases.clone(),
                    _ => continue,
                };
                for id in ids {
                    if crate::regions::pause_on_reclaim(&event, &id) || reclaim_sleeps(&event, &id)
                    {
                        continue;
                    }
                    // A woken segment's lease has a new id; the allocator knows the first.
                    let id = residents().lock().first_id.get(&id).cloned().unwrap_or(id);
                    asked_back().lock().insert(id.clone());
                    let mut outcome = a.reclaim(&id);
                    if outcome == gpubroker_suballoc::Reclaim::Unknown {
                        outcome = crate::regions::reclaim(&id);
                    }
                    if outcome == gpubroker_suballoc::Reclaim::Unknown {
                        asked_back().lock().remove(&id);
                    }
                    tracing::info!(lease_id = id, ?outcome, "gpubroker.torch: reclaim");
                }
            }
        })
        .map(drop)
}

/// With `install(sleep_on_reclaim=True)`: a reclaim request of a resident segment's
/// current lease puts every segment to sleep (as `sleep()` does: the devices are
/// synchronized first), so the reclaim completes by itself. True when it did (or tried:
/// a failure is logged, and the broker revokes at the deadline).
fn reclaim_sleeps(event: &SessionEvent, lease_id: &str) -> bool {
    let contents = match SLEEP_ON_RECLAIM.load(Ordering::SeqCst) {
        1 => Contents::Discard,
        2 => Contents::Save,
        _ => return false,
    };
    if !matches!(event, SessionEvent::ReclaimRequested { .. })
        || !residents().lock().first_id.contains_key(lease_id)
    {
        return false;
    }
    match sleep_all(contents, &rt::handle()) {
        Ok(given) => {
            RECLAIM_SLEEPS.fetch_add(1, Ordering::SeqCst);
            tracing::info!(
                lease_id,
                given,
                "gpubroker.torch: slept on a reclaim request"
            );
        }
        Err(e) => {
            tracing::warn!(lease_id, error = %e, "gpubroker.torch: a reclaim request could not put the segments to sleep");
        }
    }
    true
}

/// The region tag of the resident segment whose current lease is `lease_id`, if any.
pub(crate) fn tag_of_lease(lease_id: &str) -> Option<String> {
    let reg = residents().lock();
    let first = reg.first_id.get(lease_id)?;
    reg.by_base
        .values()
        .find(|seg| &seg.first_id == first)
        .and_then(|seg| seg.tag.clone())
}

/// Sleeps (`contents` saved or not) or wakes every resident segment of region `tag`;
/// the bytes moved. A wake refused by the broker stops there (the rest stay asleep).
pub(crate) fn set_region_awake(
    tag: &str,
    awake: bool,
    contents: Contents,
    wait: Option<Duration>,
) -> Result<u64, ClientError> {
    let segs: Vec<Arc<ResidentSegment>> = residents()
        .lock()
        .by_base
        .values()
        .filter(|seg| seg.tag.as_deref() == Some(tag))
        .cloned()
        .collect();
    let handle = rt::handle();
    let mut moved = 0;
    for seg in segs {
        let mut g = seg.resident.lock();
        let Some(r) = g.as_mut() else { continue };
        if r.is_awake() == awake {
            continue;
        }
        if awake {
            handle.block_on(r.wake(wait))?;
            if let Some(id) = r.lease().map(|l| l.id().to_string()) {
                residents().lock().first_id.insert(id, seg.first_id.clone());
            }
        } else {
            // Work queued on any stream must finish before its memory goes.
            // SAFETY: the device's primary context is current.
            in_context(r.device(), || unsafe {
                sys::cuCtxSynchronize();
            });
            let old = r.lease().map(|l| l.id().to_string());
            handle.block_on(r.sleep(contents))?;
            if let Some(old) = old.filter(|old| *old != seg.first_id) {
                residents().lock().first_id.remove(&old);
            }
        }
        moved += r.len();
    }
    Ok(moved)
}

/// Runs `f` with the lease (`None` while asleep) and base address of the segment that
/// holds device address `ptr`; `None` when no segment does.
pub(crate) fn segment_of<T>(ptr: u64, f: impl FnOnce(Option<&Lease>, u64) -> T) -> Option<T> {
    let seg = {
        let reg = residents().lock();
        let (_, seg) = reg.by_base.range(..=ptr).next_back()?;
        seg.clone()
    };
    let g = seg.resident.lock();
    let r = g.as_ref()?;
    if ptr >= r.addr() + r.len() {
        return None;
    }
    Some(f(r.lease(), r.addr()))
}

impl LeaseBackend {
    /// The tenant the segments are leased for.
    pub(crate) fn tenant(&self) -> String {
        self.session.tenant()
    }
}

/// The process-wide allocator, once installed.
pub(crate) fn installed_allocator() -> Option<&'static SubAllocator<LeaseBackend>> {
    ALLOCATOR.get()
}

/// Puts every awake resident segment to sleep (allocations fail from now on); the
/// device bytes given back.
fn sleep_all(contents: Contents, handle: &tokio::runtime::Handle) -> Result<u64, ClientError> {
    ASLEEP.store(true, Ordering::SeqCst);
    // Asleep holds no device memory: segments retained mapped go too.
    if let Some(a) = ALLOCATOR.get() {
        handle.block_on(a.backend().session.drop_retained());
    }
    let segs: Vec<Arc<ResidentSegment>> = residents().lock().by_base.values().cloned().collect();
    let mut given = 0;
    for seg in segs {
        let mut g = seg.resident.lock();
        let Some(r) = g.as_mut() else { continue };
        if !r.is_awake() {
            continue;
        }
        // Work queued on any stream must finish before its memory goes.
        // SAFETY: the device's primary context is current.
        in_context(r.device(), || unsafe {
            sys::cuCtxSynchronize();
        });
        let old = r.lease().map(|l| l.id().to_string());
        handle.block_on(r.sleep(contents))?;
        given += r.len();
        if let Some(old) = old {
            if old != seg.first_id {
                residents().lock().first_id.remove(&old);
            }
        }
    }
    Ok(given)
}

/// Sets up the allocator on `session` (once per process).
#[pyfunction]
#[pyo3(signature = (session, segment_bytes, wait_s, reclaimable, sleep_on_reclaim = None, retain_bytes = 0))]
pub fn _torch_install(
    py: Python<'_>,
    session: &PySession,
    segment_bytes: u64,
    wait_s: f64,
    reclaimable: bool,
    sleep_on_reclaim: Option<bool>,
    retain_bytes: u64,
) -> PyResult<()> {
    rt::check_process()?;
    if ALLOCATOR.get().is_some() {
        return Err(errors::local(
            "FailedPrecondition",
            "gpubroker.torch is already installed in this process",
        ));
    }
    let wait = rt::seconds("wait", wait_s)?;
    let session = session.client_session()?;
    let config = Config {
        segment_bytes: segment_bytes.max(2 << 20),
        wait,
        ..Config::default()
    };
    // `Some(save)`: sleep on reclaim requests (the segments must be reclaimable for the
    // broker to ask).
    SLEEP_ON_RECLAIM.store(
        match sleep_on_reclaim {
            None => 0,
            Some(false) => 1,
            Some(true) => 2,
        },
        Ordering::SeqCst,
    );
    let reclaimable = reclaimable || sleep_on_reclaim.is_some();
    watch_events(&session)
        .map_err(|e| errors::local("BrokerError", &format!("cannot start a thread: {e}")))?;
    let handle = rt::handle();
    let client = session.client().clone();
    let broker_uuids = py
        .detach(|| handle.block_on(client.broker_info()))
        .map(|i| i.device_uuids)
        .unwrap_or_default();
    if retain_bytes > 0 {
        // Free segments released (`empty_cache`) stay mapped, held for this process: the
        // next segment of a size released is one RPC, at the address it had.
        session.retain_mappings(retain_bytes);
    }
    let backend = LeaseBackend {
        session,
        handle,
        reclaimable,
        tag: None,
        broker_uuids,
    };
    ALLOCATOR
        .set(SubAllocator::new(backend, config))
        .map_err(|_| errors::local("FailedPrecondition", "gpubroker.torch installed twice"))
}

fn allocator() -> PyResult<&'static SubAllocator<LeaseBackend>> {
    ALLOCATOR.get().ok_or_else(|| {
        errors::local(
            "FailedPrecondition",
            "gpubroker.torch is not installed (call gpubroker.torch.install())",
        )
    })
}

/// The allocator's counters and gauges.
#[pyfunction]
pub fn _torch_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let s = allocator()?.stats();
    let d = PyDict::new(py);
    d.set_item("allocated_bytes", s.allocated_bytes)?;
    d.set_item("requested_bytes", s.requested_bytes)?;
    d.set_item("reserved_bytes", s.reserved_bytes)?;
    d.set_item("leased_bytes", s.reserved_bytes)?;
    d.set_item("peak_allocated_bytes", s.peak_allocated_bytes)?;
    d.set_item("peak_reserved_bytes", s.peak_reserved_bytes)?;
    d.set_item("segments", s.segments)?;
    d.set_item("draining_segments", s.draining_segments)?;
    d.set_item("active_blocks", s.active_blocks)?;
    d.set_item("free_blocks", s.free_blocks)?;
    d.set_item("allocs", s.allocs)?;
    d.set_item("frees", s.frees)?;
    d.set_item("broker_acquires", s.broker_acquires)?;
    d.set_item("broker_releases", s.broker_releases)?;
    d.set_item("broker_calls", s.broker_acquires + s.broker_releases)?;
    d.set_item("waits", s.waits)?;
    d.set_item("stream_syncs", s.stream_syncs)?;
    d.set_item("ooms", s.ooms)?;
    d.set_item("reclaimed_segments", s.reclaimed_segments)?;
    d.set_item("reclaim_sleeps", RECLAIM_SLEEPS.load(Ordering::SeqCst))?;
    d.set_item(
        "retained_acquires",
        RETAINED_ACQUIRES.load(Ordering::Relaxed),
    )?;
    d.set_item("stream_block_flushes", FLUSHES.load(Ordering::Relaxed))?;
    Ok(d)
}

/// Releases every free segment (without the GIL); returns the bytes given back.
#[pyfunction]
pub fn _torch_empty_cache(py: Python<'_>) -> PyResult<u64> {
    let a = allocator()?;
    rt::check_process()?;
    Ok(py.detach(|| a.empty_cache()))
}

/// The last failed allocation, cleared by reading it: `{"error": text, "code": ...,
/// "reason": ..., "cause": ...}` (the broker's reason and, for a lost wait, its cause;
/// `None` for local failures), or `None`.
#[pyfunction]
pub fn _torch_take_last_error(py: Python<'_>) -> PyResult<Option<Bound<'_, PyDict>>> {
    let Some(err) = ALLOCATOR.get().and_then(|a| a.take_last_error()) else {
        return Ok(None);
    };
    let d = PyDict::new(py);
    d.set_item("error", err.to_string())?;
    if let gpubroker_suballoc::AllocError::Refused(r) = &err {
        d.set_item("code", &r.code)?;
        d.set_item("reason", &r.reason)?;
        d.set_item("cause", &r.cause)?;
    }
    Ok(Some(d))
}

/// Lease ids of the segments held now.
#[pyfunction]
pub fn _torch_lease_ids() -> PyResult<Vec<String>> {
    Ok(allocator()?.lease_ids())
}

/// Puts every resident segment to sleep: synchronizes the devices, saves the contents to
/// host-tier leases when `save`, unmaps, releases the leases (keeping every address).
/// Returns the device bytes given back. Allocations fail until [`_torch_wake`].
#[pyfunction]
#[pyo3(signature = (save))]
pub fn _torch_sleep(py: Python<'_>, save: bool) -> PyResult<u64> {
    allocator()?;
    rt::check_process()?;
    let contents = if save {
        Contents::Save
    } else {
        Contents::Discard
    };
    let handle = rt::handle();
    py.detach(|| sleep_all(contents, &handle))
        .map_err(errors::to_py)
}

/// Wakes every sleeping segment at its address (waiting up to `wait_s` seconds for each;
/// `None`: do not wait), restoring saved contents. On a refusal the rest stay asleep and
/// allocations keep failing; call again.
#[pyfunction]
#[pyo3(signature = (wait_s))]
pub fn _torch_wake(py: Python<'_>, wait_s: Option<f64>) -> PyResult<u64> {
    allocator()?;
    rt::check_process()?;
    let wait = wait_s.map(|w| rt::seconds("wait", w)).transpose()?;
    let segs: Vec<Arc<ResidentSegment>> = residents().lock().by_base.values().cloned().collect();
    let handle = rt::handle();
    let woke = py
        .detach(|| {
            let mut woke = 0;
            for seg in segs {
                let mut g = seg.resident.lock();
                let Some(r) = g.as_mut() else { continue };
                if r.is_awake() {
                    continue;
                }
                handle.block_on(r.wake(wait))?;
                woke += r.len();
                if let Some(id) = r.lease().map(|l| l.id().to_string()) {
                    residents().lock().first_id.insert(id, seg.first_id.clone());
                }
            }
            Ok::<u64, ClientError>(woke)
        })
        .map_err(errors::to_py)?;
    ASLEEP.store(false, Ordering::SeqCst);
    Ok(woke)
}

/// Is the allocator asleep?
#[pyfunction]
pub fn _torch_asleep() -> bool {
    ASLEEP.load(Ordering::SeqCst)
}

/// Whether `e` refused a lease for room (the tenant's or a device's limit, or the card):
/// what letting retained segments go can give.
fn wants_room(e: &ClientError) -> bool {
    use gpu_broker_client::error::Reason;
    matches!(
        e.reason(),
        Some(Reason::QuotaExceeded | Reason::DeviceQuotaExceeded | Reason::CapacityExhausted)
    )
}
