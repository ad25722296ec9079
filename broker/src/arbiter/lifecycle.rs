//! The broker process's start and stop, apart from admission: the named workers
//! (`workers.rs`), the main runtime that effects' tasks run on, the store writer, the
//! managed MPS daemon with the compute modes read at start, the health monitor's fault
//! source, and the shutdown. [`Lifecycle`] owns the parts and knows nothing of the state:
//! the arbiter starts its own loops through it (`tasks.rs`), and [`Lifecycle::join`] stops
//! them, in order. [`Process`] (reached by [`Arbiter::lifecycle`]) adds what needs the
//! state: beginning the shutdown and freeing everything at its end.

use super::workers::Workers;
use super::{Arbiter, Ending};
use crate::error::{BrokerError, BrokerResult};
use crate::faults::FaultSource;
use crate::store_writer::{off_the_runtime, StoreWriter};
use parking_lot::Mutex;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A fault source shared by the health monitor and operators' resets.
pub(crate) type SharedFaultSource = Arc<Mutex<Box<dyn FaultSource>>>;

/// The broker's background machinery (one per arbiter).
#[derive(Default)]
pub struct Lifecycle {
    /// Background workers, joined at shutdown before the store writer stops.
    workers: Workers,
    /// The main runtime, learnt where the background work starts
    /// ([`Lifecycle::enter_main_runtime`]): effects' tasks (grants, watchers) run there,
    /// whichever runtime the transition that asked for them ran on.
    main_runtime: OnceLock<tokio::runtime::Handle>,
    /// The thread that runs operators' durable changes (`store_writer.rs`), started on
    /// first use; stopped by [`Lifecycle::join`] or when the arbiter is dropped.
    store_writer: OnceLock<StoreWriter>,
    /// The managed MPS daemon (`--mps`), set once at start.
    mps: OnceLock<Arc<crate::mps::Mps>>,
    /// Each device's compute mode (NVML) read at start, for a CUDA broker without `--mps`
    /// (with it the daemon's status has them).
    compute_modes: OnceLock<Vec<String>>,
    /// NVML faults, once the health monitor runs (operators' resets reach it). Lock order:
    /// this slot, then the source's own mutex, then nothing; neither is held while the
    /// state lock is taken (an operator's `SetDeviceHealth` resets the source, releases
    /// both, then marks the device).
    fault_source: Mutex<Option<SharedFaultSource>>,
    /// Whether the broker is shutting down, and whether it is freeing everything on exit.
    shutdown: Shutdown,
}

impl Lifecycle {
    /// Records the caller's runtime as the main one (the first call wins) and starts the
    /// store writer inside it: what effects and durable changes spawn (a grant's device
    /// work, a watcher) runs here from now on, also when an operator's call on the
    /// operators' runtime (or the store writer) is what let a waiter in.
    pub(crate) fn enter_main_runtime(&self) {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let _ = self.main_runtime.set(rt);
        }
        if let Err(e) = self.store_writer() {
            tracing::error!("{e}");
        }
    }

    /// Where effects' tasks run: the main runtime once [`Lifecycle::enter_main_runtime`]
    /// ran on it, else the caller's (an arbiter driven alone, in tests); None outside any.
    pub(crate) fn effects_runtime(&self) -> Option<tokio::runtime::Handle> {
        self.main_runtime
            .get()
            .cloned()
            .or_else(|| tokio::runtime::Handle::try_current().ok())
    }

    /// Starts `work` as one of the broker's named workers: dropped at its next await once
    /// `stop` is cancelled, and waited for by [`Lifecycle::join`].
    pub fn spawn_worker(
        &self,
        name: &'static str,
        stop: CancellationToken,
        work: impl Future<Output = ()> + Send + 'static,
    ) {
        self.workers.spawn(name, stop, work);
    }

    /// Starts `work` as a named worker that ends by itself once its stop token is
    /// cancelled (it checks the token where stopping leaves nothing half-done);
    /// [`Lifecycle::join`] waits for it before the store writer stops.
    pub fn spawn_worker_to_end(
        &self,
        name: &'static str,
        work: impl Future<Output = ()> + Send + 'static,
    ) {
        self.workers.spawn_to_end(name, work);
    }

    /// [`Lifecycle::spawn_worker_to_end`] on runtime `rt`: a worker served on the
    /// operators' runtime, joined with the others.
    pub fn spawn_worker_to_end_on(
        &self,
        rt: &tokio::runtime::Handle,
        name: &'static str,
        work: impl Future<Output = ()> + Send + 'static,
    ) {
        self.workers.spawn_to_end_on(rt, name, work);
    }

    /// Names of the background workers running now.
    pub fn worker_names(&self) -> Vec<&'static str> {
        self.workers.names()
    }

    /// Waits (up to `within`) for the background workers to end after their stop token
    /// was cancelled; returns the names of any that did not (they are aborted). Then the
    /// health monitor's fault source stops what it runs (`FaultSource::stop`: NVML's Xid
    /// event thread, joined), and the store writer stops, once the changes handed to it
    /// are done.
    pub async fn join(&self, within: Duration) -> Vec<&'static str> {
        let stuck = self.workers.join(within).await;
        self.stop_fault_source().await;
        self.stop_store_writer();
        stuck
    }

    /// The store writer, started on first use (inside the caller's runtime).
    pub(crate) fn store_writer(&self) -> BrokerResult<&StoreWriter> {
        if let Some(w) = self.store_writer.get() {
            return Ok(w);
        }
        let w = StoreWriter::start("store-writer")
            .map_err(|e| BrokerError::Internal(format!("starting the store writer: {e}")))?;
        // Another caller may have started one meanwhile: theirs is kept.
        let _ = self.store_writer.set(w);
        Ok(self.store_writer.get().expect("just set"))
    }

    /// Has a store writer started (or been stopped)?
    #[cfg(test)]
    pub(crate) fn has_store_writer(&self) -> bool {
        self.store_writer.get().is_some()
    }

    /// Stops the store writer (shutdown): the changes already handed to it finish first;
    /// later ones are refused as the broker shutting down (also when none came before:
    /// a stopped writer takes the empty slot, so none starts after).
    fn stop_store_writer(&self) {
        let w = self.store_writer.get_or_init(StoreWriter::stopped);
        off_the_runtime(|| w.stop());
    }

    /// The managed MPS daemon, when the broker runs one (`--mps`).
    pub fn mps(&self) -> Option<&Arc<crate::mps::Mps>> {
        self.mps.get()
    }

    /// Hands over the managed MPS daemon (once; later calls are ignored).
    pub fn set_mps(&self, mps: Arc<crate::mps::Mps>) {
        let _ = self.mps.set(mps);
    }

    /// Each device's compute mode, by index: the MPS daemon's record with `--mps`, else
    /// what was read at start (none on the host backend).
    pub fn compute_modes(&self) -> Vec<String> {
        match self.mps() {
            Some(m) => m.status().compute_modes,
            None => self.compute_modes.get().cloned().unwrap_or_default(),
        }
    }

    /// Records the devices' compute modes read at start (once).
    pub fn set_compute_modes(&self, modes: Vec<String>) {
        let _ = self.compute_modes.set(modes);
    }

    /// Keeps the health monitor's fault source, for operators' resets and the shutdown.
    pub(crate) fn set_fault_source(&self, source: Option<SharedFaultSource>) {
        *self.fault_source.lock() = source;
    }

    /// Forgets the faults the source has seen on device `index` (an operator marked it
    /// healthy). Takes the slot's lock, then the source's; call with no state lock held.
    pub(crate) fn reset_fault_source(&self, index: u32) {
        if let Some(s) = self.fault_source.lock().as_ref() {
            s.lock().reset(index);
        }
    }

    /// The health monitor's fault source (NVML's) ends what it runs on its own (the Xid
    /// event thread) and is waited for, off the runtime; the slot is left empty.
    async fn stop_fault_source(&self) {
        // The slot's lock is released before the source's is taken (the lock order).
        let source = self.fault_source.lock().take();
        if let Some(s) = source {
            let _ = tokio::task::spawn_blocking(move || s.lock().stop()).await;
        }
    }

    /// Is the broker shutting down?
    pub(crate) fn is_shutting_down(&self) -> bool {
        self.shutdown.begun()
    }

    /// `SHUTTING_DOWN` once the shutdown began: new work is refused.
    pub(super) fn refuse_new_work(&self) -> BrokerResult<()> {
        self.shutdown.refuse_new_work()
    }

    /// Do frees revoke the memory from processes that kept it (all but the shutdown's)?
    pub(super) fn frees_revoke(&self) -> bool {
        self.shutdown.revokes()
    }
}

/// The process's lifecycle with its arbiter ([`Arbiter::lifecycle`]): the parts
/// ([`Lifecycle`], through `Deref`) and the shutdown, which needs the state.
pub struct Process<'a> {
    pub(super) arb: &'a Arbiter,
}

impl std::ops::Deref for Process<'_> {
    type Target = Lifecycle;
    fn deref(&self) -> &Lifecycle {
        &self.arb.lifecycle
    }
}

impl Process<'_> {
    /// Begins shutdown: refuse new work, tell every session.
    pub(crate) fn begin_shutdown(&self, grace: Duration) {
        self.arb.lifecycle.shutdown.begin();
        self.arb.lock().begin_shutdown(grace);
    }

    /// Ends every session and frees every block on the devices. Blocks until done.
    pub fn release_all(&self) {
        let arb = self.arb;
        arb.lifecycle.shutdown.begin_exit();
        let ids = arb.lock().sessions().ids();
        for id in ids {
            arb.end_session_with(id, "broker shut down", Some(Ending::Destroy));
        }
        let mut st = arb.lock();
        st.free_everything();
        drop(st);
        // Wait for the device threads to finish the frees queued above.
        for d in arb.devices.iter() {
            let _ = d.thread.call_blocking(|_| ());
        }
        if let Some(h) = &arb.host_tier {
            let _ = h.call_blocking(|_| ());
        }
    }
}

/// The broker's shutdown, as two marks: begun (new work is refused) and exiting (set once
/// the shutdown frees everything).
#[derive(Default)]
struct Shutdown {
    begun: AtomicBool,
    /// The shutdown's frees leave kept mappings alone (a worker may still read its memory
    /// after the broker is gone); every free before revokes (`Device::revoke`), so memory
    /// that left its tenant is held by nobody.
    exiting: AtomicBool,
}

impl Shutdown {
    /// Has the shutdown begun?
    fn begun(&self) -> bool {
        self.begun.load(Ordering::SeqCst)
    }

    /// `SHUTTING_DOWN` once the shutdown began: new work is refused.
    fn refuse_new_work(&self) -> BrokerResult<()> {
        match self.begun() {
            true => Err(BrokerError::ShuttingDown),
            false => Ok(()),
        }
    }

    /// Do frees revoke the memory from processes that kept it (all but the shutdown's)?
    fn revokes(&self) -> bool {
        !self.exiting.load(Ordering::SeqCst)
    }

    /// Refuses new work from now on.
    fn begin(&self) {
        self.begun.store(true, Ordering::SeqCst);
    }

    /// The shutdown frees everything now: its frees leave kept mappings alone.
    fn begin_exit(&self) {
        self.begin();
        self.exiting.store(true, Ordering::SeqCst);
    }
}
