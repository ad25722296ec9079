//! Sleep and wake: a lease's memory given back while its addresses are kept. A
//! [`Resident`] maps a lease at a virtual address range of its own; [`Resident::sleep`]
//! unmaps the memory and releases the lease (optionally saving its contents to a host-tier
//! lease first), keeping the range reserved; [`Resident::wake`] asks for memory again
//! (waiting or refused exactly like an acquire: it *is* one), maps it at the same
//! addresses and restores the saved contents. Pointers into the range stay valid across
//! both, so a tensor (or anything) that points into it works again after a wake.
//!
//! While asleep the tenant is charged nothing for the device memory (the lease is
//! released) and the host-tier lease's size for saved contents. Touching the range while
//! asleep faults (host: `PROT_NONE`; CUDA: nothing is mapped).
//!
//! Host memory (memfd leases: the host backend, host-fallback leases) keeps the range as a
//! `PROT_NONE` anonymous reservation and maps the memfd over it with `MAP_FIXED`; CUDA VMM
//! memory (feature `cuda`) keeps the `cuMemAddressReserve` range and maps a new import of
//! each lease there ([`crate::cuda::VaRange`]). Its contents travel to and from the
//! host-tier lease page-locked ([`Staging::Pinned`]: the host lease's mapping is
//! registered with CUDA for the copy) unless [`Staging::Pageable`] is chosen
//! ([`Resident::set_staging`], or `GPU_BROKER_SLEEP_STAGING=pageable`).
//!
//! **Sleeping on a reclaim request.** [`Resident::sleep_on_reclaim`] turns a resident into
//! an [`AutoSleep`]: a task watches the session's events, and when the broker asks for the
//! resident's current lease back (a reclaim request: a higher-priority tenant waits, a
//! drain) it sleeps by itself, with or without its contents, so the reclaim completes
//! without the worker's own handler. The resident sits behind an async mutex: the worker
//! uses the memory through [`AutoSleep::lock`], and a reclaim waits until the guard is
//! dropped (so nothing is unmapped under a borrow; a guard held past the reclaim deadline
//! gets the lease revoked, as for any holder). Only reclaimable leases are ever asked.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

use crate::address_range::Range;
pub use crate::address_range::Staging;
use crate::error::ClientError;
use crate::fd::MemoryKind;
use crate::lease::{Lease, LeaseHandle};
use crate::session::Session;

/// What a sleep does with the contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Contents {
    /// Dropped: the memory after a wake is whatever the new lease holds (zeros or the
    /// tenant's own earlier bytes).
    #[default]
    Discard,
    /// Copied to a host-tier lease on sleep and back on wake.
    Save,
}

/// A lease mapped at addresses that survive sleep and wake.
pub struct Resident {
    session: Session,
    /// `None` only once [`Resident::release`] handed it to the lease it releases.
    range: Option<Range>,
    requested: u64,
    bytes: u64,
    device: u32,
    label: String,
    reclaimable: bool,
    /// A host-tier lease: a wake asks the host tier again.
    host_tier: bool,
    lease: Option<Lease>,
    /// The host-tier lease holding the contents while asleep.
    saved: Option<Lease>,
    staging: Staging,
}

impl fmt::Debug for Resident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Resident")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("bytes", &self.bytes)
            .field("device", &self.device)
            .field("awake", &self.is_awake())
            .field("saved", &self.saved.is_some())
            .finish()
    }
}

/// The descriptor of fd lease `lease`.
fn lease_fd(lease: &Lease) -> Result<std::os::fd::BorrowedFd<'_>, ClientError> {
    lease
        .fd()
        .ok_or_else(|| ClientError::Protocol("an fd lease without its descriptor".into()))
}

impl Resident {
    /// Maps `lease` (an fd lease: a memfd, or CUDA VMM memory with feature `cuda`) at an
    /// address range of its own. `NotMappable` for other handles.
    pub fn new(lease: Lease) -> Result<Resident, ClientError> {
        let kind = match lease.handle() {
            LeaseHandle::Fd(i) => i.memory_kind,
            _ => return Err(ClientError::NotMappable),
        };
        let mut lease = lease;
        let bytes = lease.bytes();
        // A block this process retained comes back mapped at the range it had.
        if let Some(range) = lease.take_range().filter(|r| r.len() == bytes) {
            return Ok(Resident::around(lease, range));
        }
        // A mapping of its own the lease may carry is not needed: the range maps it.
        lease.drop_mapping();
        let mut range = match kind {
            MemoryKind::HostMemfd => Range::reserve_host(bytes)?,
            #[cfg(feature = "cuda")]
            MemoryKind::CudaVmm => Range::Cuda(
                crate::cuda::VaRange::reserve(
                    crate::cuda::local_ordinal(lease.device(), lease.device_uuid()),
                    bytes,
                )
                .map_err(crate::address_range::cuda_err)?,
            ),
            _ => return Err(ClientError::NotMappable),
        };
        range.map(lease_fd(&lease)?)?;
        Ok(Resident::around(lease, range))
    }

    /// `lease` mapped over `range`.
    fn around(lease: Lease, range: Range) -> Resident {
        Resident {
            session: lease.session().clone(),
            range: Some(range),
            requested: lease.requested_bytes(),
            bytes: lease.bytes(),
            device: lease.device(),
            label: lease.label().to_string(),
            reclaimable: lease.info().reclaimable,
            host_tier: lease.tier() == crate::lease::Tier::Host,
            lease: Some(lease),
            saved: None,
            staging: Staging::from_env(),
        }
    }

    /// The range (there until [`Resident::release`] hands it on).
    fn range(&mut self) -> Result<&mut Range, ClientError> {
        self.range
            .as_mut()
            .ok_or_else(|| ClientError::Protocol("the resident's range was handed on".into()))
    }

    /// How contents are copied for CUDA memory (default [`Staging::Pinned`], or
    /// `GPU_BROKER_SLEEP_STAGING=pageable` in the environment); host memory is a memcpy.
    pub fn set_staging(&mut self, staging: Staging) {
        self.staging = staging;
    }

    /// The staging in use.
    pub fn staging(&self) -> Staging {
        self.staging
    }

    /// The session its leases are asked on.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Start of the range (a host pointer for host memory, a `CUdeviceptr` for CUDA).
    pub fn addr(&self) -> u64 {
        self.range.as_ref().map_or(0, Range::addr)
    }

    /// Length of the range (the lease's granted size).
    pub fn len(&self) -> u64 {
        self.bytes
    }

    /// True for a zero-length range (never).
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The device the memory lives on (a wake asks for the same one).
    pub fn device(&self) -> u32 {
        self.device
    }

    /// Is memory mapped now?
    pub fn is_awake(&self) -> bool {
        self.lease.is_some()
    }

    /// Are the contents kept in a host-tier lease (asleep with [`Contents::Save`])?
    pub fn has_saved_contents(&self) -> bool {
        self.saved.is_some()
    }

    /// The lease mapped now (awake only).
    pub fn lease(&self) -> Option<&Lease> {
        self.lease.as_ref()
    }

    /// The mapped bytes (host memory, awake); `None` otherwise.
    pub fn as_slice(&self) -> Option<&[u8]> {
        match (&self.range, &self.lease) {
            // SAFETY: `len` mapped readable bytes while awake; borrowed from `self`.
            (Some(Range::Host { addr, len }), Some(_)) => {
                Some(unsafe { std::slice::from_raw_parts(*addr as *const u8, *len) })
            }
            _ => None,
        }
    }

    /// The mapped bytes, writable (host memory, awake); `None` otherwise.
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        match (&self.range, &self.lease) {
            // SAFETY: `len` mapped writable bytes while awake; borrowed mutably from `self`.
            (Some(Range::Host { addr, len }), Some(_)) => {
                Some(unsafe { std::slice::from_raw_parts_mut(*addr as *mut u8, *len) })
            }
            _ => None,
        }
    }

    /// Gives the memory back, keeping the addresses: with [`Contents::Save`] the contents
    /// go to a host-tier lease first (refused like any host lease: over the host limit,
    /// no host tier). Then the memory is unmapped and the lease released, so the tenant is
    /// no longer charged for it. Sleeping twice is a no-op. For CUDA memory it waits for the
    /// device's queued work first.
    pub async fn sleep(&mut self, contents: Contents) -> Result<(), ClientError> {
        let Some(lease) = self.lease.as_ref() else {
            return Ok(());
        };
        let saved = match contents {
            Contents::Discard => None,
            Contents::Save => {
                let host = self
                    .session
                    .lease_request(self.bytes)
                    .host_tier(true)
                    .label(format!("{} (saved while asleep)", lease.label()))
                    .send()
                    .await?;
                let mut m = host.map()?;
                let dst = m.get_mut(..self.bytes as usize).ok_or_else(|| {
                    ClientError::Protocol("the host lease is smaller than the lease".into())
                })?;
                let staging = self.staging;
                self.range()?.save(dst, staging)?;
                drop(m);
                Some(host)
            }
        };
        self.range()?.unmap()?;
        self.saved = saved;
        if let Some(lease) = self.lease.take() {
            // Asleep means given back: never retained.
            lease.release_unretained().await?;
        }
        Ok(())
    }

    /// Gets memory again at the same addresses: a new lease of the same size on the same
    /// device (waiting up to `wait` in the broker's queue, refused like any acquire), mapped
    /// over the range, with saved contents copied back (and their host lease released).
    /// Waking an awake resident is a no-op. On a refusal it stays asleep, contents kept.
    pub async fn wake(&mut self, wait: Option<Duration>) -> Result<(), ClientError> {
        if self.lease.is_some() {
            return Ok(());
        }
        let mut request = self
            .session
            .lease_request(self.requested)
            .device(self.device)
            .label(self.label.clone())
            .reclaimable(self.reclaimable)
            .host_tier(self.host_tier);
        if let Some(w) = wait {
            request = request.wait(w);
        }
        let lease = request.send().await?;
        if lease.bytes() != self.bytes {
            let got = lease.bytes();
            let _ = lease.release().await;
            return Err(ClientError::Protocol(format!(
                "woke with {got} bytes, the range is {}",
                self.bytes
            )));
        }
        // A block retained by this process comes mapped at a range of its own: the
        // resident's range maps it again instead.
        let mut lease = lease;
        lease.drop_mapping();
        self.range()?.map(lease_fd(&lease)?)?;
        if let Some(saved) = &self.saved {
            let m = saved.map()?;
            let src = m.get(..self.bytes as usize).ok_or_else(|| {
                ClientError::Protocol("the saved host lease is smaller than the range".into())
            })?;
            let (staging, range) = (self.staging, self.range.as_ref());
            range
                .ok_or_else(|| ClientError::Protocol("the resident's range was handed on".into()))?
                .restore(src, staging)?;
        }
        self.lease = Some(lease);
        if let Some(saved) = self.saved.take() {
            saved.release().await?;
        }
        Ok(())
    }
}

impl Resident {
    /// Host memory (`true`: [`Resident::addr`] is a host pointer) or CUDA memory.
    pub fn is_host(&self) -> bool {
        matches!(self.range, Some(Range::Host { .. }))
    }

    /// Unmaps, frees the range and gives everything back now (the lease if awake, the
    /// saved contents if asleep); dropping does the same with the releases in the
    /// background. When the session retains mappings ([`Session::retain_mappings`]) an
    /// awake resident's range stays mapped with its block: a [`Resident::new`] of the
    /// next lease granted from that block is at the same address, mapped already.
    pub async fn release(self) -> Result<(), ClientError> {
        self.release_with(true).await
    }

    /// [`Resident::release`], never retaining the block (memory the broker asked back).
    pub async fn release_unretained(self) -> Result<(), ClientError> {
        self.release_with(false).await
    }

    async fn release_with(mut self, retain: bool) -> Result<(), ClientError> {
        let lease = self.lease.take();
        let saved = self.saved.take();
        let range = self.range.take();
        drop(self);
        if let Some(mut l) = lease {
            match range {
                // The lease unmaps it before the broker hears of the release, unless the
                // broker retains the block for this process.
                Some(range) if retain => l.keep_range(range),
                Some(mut range) => range.unmap()?,
                None => {}
            }
            if retain {
                l.release().await?;
            } else {
                l.release_unretained().await?;
            }
        }
        if let Some(s) = saved {
            s.release().await?;
        }
        Ok(())
    }
}

impl Drop for Resident {
    fn drop(&mut self) {
        // Unmap before the lease goes (it is released in the background when dropped);
        // the range itself is freed when `range` drops.
        if self.lease.is_some() {
            if let Some(Err(e)) = self.range.as_mut().map(Range::unmap) {
                tracing::warn!(error = %e, "unmapping a resident lease failed");
            }
        }
    }
}

/// What an [`AutoSleep`]'s watcher shares with it.
#[derive(Default)]
struct AutoState {
    /// Sleeps a reclaim request triggered.
    sleeps: AtomicU64,
    changed: tokio::sync::Notify,
    last_error: parking_lot::Mutex<Option<String>>,
}

/// A [`Resident`] that sleeps by itself when the broker asks for its lease back (see the
/// module docs). Dropping it stops the watcher and drops the resident.
pub struct AutoSleep {
    resident: Arc<tokio::sync::Mutex<Resident>>,
    state: Arc<AutoState>,
    /// Tells the watcher to stop when dropped (between events: a sleep it started
    /// completes).
    stop: StopOnDrop,
    task: tokio::task::JoinHandle<()>,
}

impl fmt::Debug for AutoSleep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AutoSleep")
            .field("reclaim_sleeps", &self.reclaim_sleeps())
            .finish()
    }
}

impl Resident {
    /// Sleeps by itself (keeping `contents` as [`Resident::sleep`] does) whenever the
    /// broker sends a reclaim request for its current lease; wake it with
    /// [`AutoSleep::lock`] and [`Resident::wake`]. Only reclaimable leases are asked
    /// (the resident's lease, and the ones its wakes take, keep the first lease's
    /// `reclaimable`). The watcher starts at once, on the session's runtime.
    pub fn sleep_on_reclaim(self, contents: Contents) -> AutoSleep {
        let mut events = self.session.events();
        let session = self.session.clone();
        let resident = Arc::new(tokio::sync::Mutex::new(self));
        let state = Arc::new(AutoState::default());
        let (r, st) = (Arc::downgrade(&resident), state.clone());
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let task = session.spawn_task(async move {
            loop {
                let event = tokio::select! {
                    e = events.next() => e,
                    _ = stopped.changed() => None,
                };
                let Some(event) = event else { return };
                let Some(request) = event.reclaim_request() else {
                    continue;
                };
                let Some(r) = r.upgrade() else { return };
                let mut r = r.lock().await;
                if r.lease().map(Lease::id) != Some(request.lease_id.as_str()) {
                    continue;
                }
                match r.sleep(contents).await {
                    Ok(()) => {
                        tracing::info!(
                            lease_id = request.lease_id,
                            ?contents,
                            "resident slept on a reclaim request"
                        );
                        st.sleeps.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(e) => {
                        tracing::warn!(
                            lease_id = request.lease_id,
                            error = %e,
                            "a reclaim request could not put the resident to sleep"
                        );
                        *st.last_error.lock() = Some(e.to_string());
                    }
                }
                drop(r);
                st.changed.notify_waiters();
            }
        });
        AutoSleep {
            resident,
            state,
            stop: StopOnDrop(stop),
            task,
        }
    }
}

impl AutoSleep {
    /// The resident, for using its memory (a reclaim waits until the guard is dropped),
    /// sleeping or waking it by hand.
    pub async fn lock(&self) -> tokio::sync::MutexGuard<'_, Resident> {
        self.resident.lock().await
    }

    /// How many times a reclaim request put it to sleep.
    pub fn reclaim_sleeps(&self) -> u64 {
        self.state.sleeps.load(Ordering::SeqCst)
    }

    /// Waits until a reclaim request put it to sleep more than `seen` times (or a try
    /// failed: see [`AutoSleep::last_error`]), or `timeout` passed; returns the count.
    pub async fn reclaimed_after(&self, seen: u64, timeout: Duration) -> u64 {
        let wait = async {
            loop {
                let changed = self.state.changed.notified();
                if self.reclaim_sleeps() > seen || self.state.last_error.lock().is_some() {
                    return;
                }
                changed.await;
            }
        };
        let _ = tokio::time::timeout(timeout, wait).await;
        self.reclaim_sleeps()
    }

    /// Why the last reclaim-triggered sleep failed (the lease then stays mapped and the
    /// broker revokes it at the deadline), cleared by reading it.
    pub fn last_error(&self) -> Option<String> {
        self.state.last_error.lock().take()
    }

    /// Stops watching (after a reclaim-triggered sleep that is running) and gives the
    /// resident back.
    pub async fn into_inner(self) -> Resident {
        let AutoSleep {
            resident,
            stop,
            task,
            ..
        } = self;
        drop(stop);
        let _ = task.await;
        // The watcher held the resident only while running, and it has stopped; the
        // loop only guards against a holder this code does not know of.
        let mut resident = resident;
        loop {
            match Arc::try_unwrap(resident) {
                Ok(m) => return m.into_inner(),
                Err(still) => {
                    resident = still;
                    tokio::task::yield_now().await;
                }
            }
        }
    }
}

/// Stops the watcher when dropped.
struct StopOnDrop(tokio::sync::watch::Sender<bool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(true);
    }
}
