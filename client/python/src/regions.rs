//! Tagged regions, the way serving engines release and re-take memory
//! (`torch_memory_saver`'s model): while a region is open (`_region_enter(tag, backup)`,
//! process-wide, as that package does it), the PyTorch hooks serve allocations from a
//! sub-allocator of the region's tag, whose segments are leases of their own. Pausing a
//! tag gives those leases back to the broker (contents saved to host-tier leases when the
//! region asked for a backup) while keeping every address; resuming takes leases again at
//! the same addresses. A reclaim request for a region's lease can pause its tag.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, RwLock};
use pyo3::prelude::*;

use gpu_broker_client::{Contents, SessionEvent};
use gpubroker_suballoc::{Config, Reclaim, SubAllocator};

use crate::errors;
use crate::rt;
use crate::torch::{installed_allocator, set_region_awake, tag_of_lease, LeaseBackend};

/// One tag's allocator and state.
pub struct Region {
    alloc: SubAllocator<LeaseBackend>,
    /// Pausing saves the contents (the region asked for a CPU backup).
    backup: AtomicBool,
    paused: AtomicBool,
}

impl Region {
    /// Its allocator.
    pub fn allocator(&self) -> &SubAllocator<LeaseBackend> {
        &self.alloc
    }

    /// True between a pause and a complete resume.
    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }
}

/// Segment size and reclaim policy of region allocators (`_regions_configure`).
#[derive(Clone, Copy)]
struct Settings {
    segment_bytes: u64,
    pause_on_reclaim: bool,
}

static SETTINGS: Mutex<Settings> = Mutex::new(Settings {
    segment_bytes: 64 << 20,
    pause_on_reclaim: false,
});

fn regions() -> &'static RwLock<HashMap<String, Arc<Region>>> {
    static R: OnceLock<RwLock<HashMap<String, Arc<Region>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// The open region: (tag, backup).
static OPEN: Mutex<Option<(String, bool)>> = Mutex::new(None);

/// The region allocations go to now (created on first use), or `None` outside regions.
pub fn current(main: &SubAllocator<LeaseBackend>) -> Option<Arc<Region>> {
    let (tag, backup) = OPEN.lock().clone()?;
    if let Some(r) = regions().read().get(&tag) {
        if backup {
            r.backup.store(true, Ordering::SeqCst);
        }
        return Some(r.clone());
    }
    let settings = *SETTINGS.lock();
    let mut map = regions().write();
    let r = map.entry(tag.clone()).or_insert_with(|| {
        let config = Config {
            segment_bytes: settings.segment_bytes.max(main.config().granularity),
            ..main.config()
        };
        let backend = main.backend().for_region(&tag, settings.pause_on_reclaim);
        Arc::new(Region {
            alloc: SubAllocator::new(backend, config),
            backup: AtomicBool::new(backup),
            paused: AtomicBool::new(false),
        })
    });
    Some(r.clone())
}

/// Frees `ptr` if a region's allocator holds it.
pub fn free(ptr: u64) -> Option<()> {
    regions()
        .read()
        .values()
        .find_map(|r| r.alloc.free(ptr).ok())
}

/// A reclaim request (or revocation) for a region's segment: drained like the
/// process-wide allocator's.
pub fn reclaim(lease_id: &str) -> Reclaim {
    regions()
        .read()
        .values()
        .map(|r| r.alloc.reclaim(lease_id))
        .find(|o| *o != Reclaim::Unknown)
        .unwrap_or(Reclaim::Unknown)
}

/// With pause-on-reclaim: a reclaim request for a region's lease pauses its whole tag
/// (contents saved as the region asked), so the reclaim completes by itself. True when
/// the lease was a region's.
pub fn pause_on_reclaim(event: &SessionEvent, lease_id: &str) -> bool {
    if !SETTINGS.lock().pause_on_reclaim || !matches!(event, SessionEvent::ReclaimRequested { .. })
    {
        return false;
    }
    let Some(tag) = tag_of_lease(lease_id) else {
        return false;
    };
    match pause(Some(&tag)) {
        Ok(given) => tracing::info!(
            tag,
            given,
            "gpubroker.torch: region paused on a reclaim request"
        ),
        Err(e) => {
            tracing::warn!(tag, error = %e, "gpubroker.torch: a reclaim request could not pause the region")
        }
    }
    true
}

fn selected(tag: Option<&str>) -> Vec<(String, Arc<Region>)> {
    regions()
        .read()
        .iter()
        .filter(|(t, _)| tag.is_none_or(|want| want == t.as_str()))
        .map(|(t, r)| (t.clone(), r.clone()))
        .collect()
}

fn pause(tag: Option<&str>) -> Result<u64, gpu_broker_client::ClientError> {
    let mut given = 0;
    for (t, r) in selected(tag) {
        r.paused.store(true, Ordering::SeqCst);
        let contents = if r.backup.load(Ordering::SeqCst) {
            Contents::Save
        } else {
            Contents::Discard
        };
        given += set_region_awake(&t, false, contents, None)?;
    }
    Ok(given)
}

/// Sets how region allocators are made: bytes per segment lease, and whether a reclaim
/// request for a region's lease pauses its tag (the leases are then reclaimable).
#[pyfunction]
pub fn _regions_configure(segment_bytes: u64, pause_on_reclaim: bool) {
    *SETTINGS.lock() = Settings {
        segment_bytes,
        pause_on_reclaim,
    };
}

/// Opens a region (`None`: allocations leave regions, as `disable()`); returns the one
/// that was open, to restore.
#[pyfunction]
#[pyo3(signature = (tag, backup = false))]
pub fn _region_enter(tag: Option<String>, backup: bool) -> Option<(String, bool)> {
    std::mem::replace(&mut *OPEN.lock(), tag.map(|t| (t, backup)))
}

/// Pauses `tag`'s regions (`None`: all; a tag never used: none): the device synchronized, contents saved where
/// the region asked for a backup, the leases released, every address kept. Returns the
/// device bytes given back.
#[pyfunction]
#[pyo3(signature = (tag = None))]
pub fn _regions_pause(py: Python<'_>, tag: Option<String>) -> PyResult<u64> {
    if installed_allocator().is_none() {
        return Err(errors::local(
            "FailedPrecondition",
            "gpubroker.torch is not installed",
        ));
    }
    rt::check_process()?;
    // A tag no region used pauses nothing (engines pause every tag they know of).
    py.detach(|| pause(tag.as_deref())).map_err(errors::to_py)
}

/// Resumes `tag`'s regions (`None`: all): leases taken again (waiting up to `wait_s` for
/// each; `None`: not at all), mapped at the same addresses, contents restored. A refusal
/// leaves the rest paused; call again. Returns the bytes resumed.
#[pyfunction]
#[pyo3(signature = (tag = None, wait_s = None))]
pub fn _regions_resume(py: Python<'_>, tag: Option<String>, wait_s: Option<f64>) -> PyResult<u64> {
    rt::check_process()?;
    let wait = wait_s.map(|w| rt::seconds("wait", w)).transpose()?;
    let chosen = selected(tag.as_deref());
    py.detach(|| {
        let mut woke = 0;
        for (t, r) in chosen {
            woke += set_region_awake(&t, true, Contents::Discard, wait)?;
            r.paused.store(false, Ordering::SeqCst);
        }
        Ok(woke)
    })
    .map_err(errors::to_py)
}

/// Per tag: `{"leased_bytes", "allocated_bytes", "segments", "paused"}`.
#[pyfunction]
pub fn _regions_stats() -> HashMap<String, HashMap<&'static str, u64>> {
    regions()
        .read()
        .iter()
        .map(|(t, r)| {
            let s = r.alloc.stats();
            let mut m = HashMap::new();
            m.insert("leased_bytes", s.reserved_bytes);
            m.insert("allocated_bytes", s.allocated_bytes);
            m.insert("segments", s.segments);
            m.insert("paused", u64::from(r.is_paused()));
            (t.clone(), m)
        })
        .collect()
}
