//! Adoption of stranded memory: a restarted broker charges memory a free left with
//! processes outside it (`core/src/state/stranded.rs`) again to the same tenant while one
//! of the processes its record names lives (same pid and start time; a pid recorded
//! without one counts while it lives), and lifts it at once when none does. No copy of
//! the memory was kept (a keeper's descriptor would keep it alive after its holders let
//! go, and the kernel's look would count it as a holder); a memfd's record keeps its file
//! handle instead, by which the kernel is asked again (`stranded/looks.rs`): charged while
//! anyone, named or not, holds the file, lifted once nobody does. Without the handle or
//! the right to ask (CAP_DAC_READ_SEARCH) its charge waits for its named holders' exits,
//! CUDA memory's as before.

use super::adopt::Liveness;
use super::Restart;
use crate::arbiter::state::{AdoptedStranded, NotAdopted};
use crate::arbiter::stranded::KeptFile;
use crate::device::MemoryKind;
use crate::keeper::records::StrandedRecord;
use crate::memfd_alive::{Alive, FileHandle, Prober};
use crate::memfd_holders::{FileId, MemFile};
use std::time::{Duration, UNIX_EPOCH};
use uuid::Uuid;

/// What a start took back of stranded memory.
#[derive(Debug, Default)]
pub(super) struct StrandedTakenBack {
    pub adopted: usize,
    pub bytes: u64,
    /// The device and bytes of each charge taken back (the broker's memory from now).
    pub charged: Vec<(u32, u64)>,
    /// Lifted at once (their records leave the keeper), with why.
    pub lifted: Vec<(StrandedRecord, &'static str)>,
}

impl Restart<'_> {
    /// Charges kept stranded memory `ready` (their devices already this broker's
    /// indexes, their holders found alive: [`adoptable`]) again, in one lock hold; what
    /// was not taken back is lifted.
    pub(super) fn adopt_stranded(
        &self,
        ready: Vec<(StrandedRecord, AdoptedStranded)>,
    ) -> StrandedTakenBack {
        let mut out = StrandedTakenBack::default();
        if ready.is_empty() {
            return out;
        }
        let prober = self.arb.stranded().prober();
        let mut asked = Vec::with_capacity(ready.len());
        for (r, mut a) in ready {
            match file_now(&r, prober.as_deref()) {
                FileNow::Gone => {
                    out.lifted
                        .push((r, "the kernel says nobody holds its file any more"));
                    continue;
                }
                FileNow::Alive(file) => {
                    // Looked at by the kernel's word (a look before the charge finds
                    // nothing and ends): its holders are named, not watched.
                    a.watched = !self.arb.stranded().look_again(KeptFile {
                        id: Some(a.id),
                        unverified: None,
                        file,
                        pids: a.holders.keys().copied().collect(),
                        by_handle: true,
                    });
                }
                FileNow::Unknown => {}
            }
            if a.watched && a.holders.is_empty() {
                out.lifted.push((r, "none of its holders lives"));
                continue;
            }
            asked.push((r, a));
        }
        // Watched by the finder before the hold that starts its holders' watches: a holder
        // exiting right after is looked for near, never lifted unlooked.
        let finder = self.arb.stranded().holders();
        if let Some(f) = finder {
            for (r, a) in asked.iter().filter(|(_, a)| a.recheck && a.watched) {
                if let Some(uuid) = self.arb.devices.recorded_uuid(r.device) {
                    let places = a.holders.keys().filter_map(|&p| f.place(p)).collect();
                    f.watch(a.id, &uuid, places);
                }
            }
        }
        let mut st = self.arb.lock();
        for (r, a) in asked {
            let id = a.id;
            let adopted = st.adopt_stranded(a);
            if let (Err(_), Some(f)) = (&adopted, finder) {
                f.forget(id);
            }
            match adopted {
                Ok(()) => {
                    out.adopted += 1;
                    out.bytes += r.bytes;
                    out.charged.push((r.device, r.bytes));
                }
                Err(NotAdopted::Device) => out
                    .lifted
                    .push((r, "its device is gone, or it is larger than its device")),
                Err(NotAdopted::Tenant) => out.lifted.push((r, "its tenant is gone")),
                Err(_) => out.lifted.push((r, "no holder, or taken back already")),
            }
        }
        out
    }

    /// A finder of kept memory's holders set after the start: stranded memory taken back
    /// that looks for processes near its holders when they exit is watched by it, near
    /// where its living holders are now.
    pub(in crate::arbiter) fn watch_adopted_stranded(
        &self,
        finder: &crate::kept_holders::HolderFinder,
    ) {
        let rechecked: Vec<(Uuid, u32, Vec<u32>)> = self
            .arb
            .lock()
            .stranded_memory()
            .filter(|(_, s)| s.recheck && s.watched)
            .map(|(id, s)| (*id, s.device, s.pids.iter().copied().collect()))
            .collect();
        for (id, device, pids) in rechecked {
            let Some(uuid) = self.arb.devices.recorded_uuid(device) else {
                continue;
            };
            let places = pids.into_iter().filter_map(|p| finder.place(p)).collect();
            finder.watch(id, &uuid, places);
        }
    }
}

/// Kept stranded record `r` as the core takes it back, or why it is lifted.
pub(super) fn adoptable(
    r: &StrandedRecord,
    alive: &mut Liveness,
) -> Result<AdoptedStranded, &'static str> {
    let id: Uuid = r.id.parse().map_err(|_| "unreadable id")?;
    let holders: std::collections::BTreeMap<u32, Option<u64>> =
        alive.alive(&r.holders).into_iter().collect();
    // A memfd's file may be held by processes never named: the kernel says (below).
    if holders.is_empty() && r.file_handle.is_none() {
        return Err("none of its holders lives");
    }
    let kind = match r.kind.as_deref() {
        Some("cuda-vmm") => Some(MemoryKind::CudaVmm),
        Some("host-memfd") => Some(MemoryKind::HostMemfd),
        _ => None,
    };
    Ok(AdoptedStranded {
        id,
        tenant: r.tenant.clone(),
        device: r.device,
        bytes: r.bytes,
        holders,
        recheck: r.recheck,
        kind,
        stranded_at: UNIX_EPOCH + Duration::from_millis(r.stranded_unix_ms),
        file_handle: r.file_handle.clone(),
        watched: true,
    })
}

/// What the kernel says now of a kept memfd's file.
enum FileNow {
    /// Held by someone: looked at again by its handle.
    Alive(MemFile),
    /// Nobody holds it: its memory went back.
    Gone,
    /// No handle kept, or the broker may not ask: its holders' exits lift it.
    Unknown,
}

fn file_now(r: &StrandedRecord, prober: Option<&Prober>) -> FileNow {
    let (Some(handle), Some(prober)) = (
        r.file_handle.as_ref().and_then(FileHandle::from_record),
        prober,
    ) else {
        return FileNow::Unknown;
    };
    match prober.open(&handle) {
        // The path-only descriptor closes here: it only names the file for the looks.
        Ok(fd) => match FileId::of(&fd) {
            Ok(id) => FileNow::Alive(MemFile {
                id,
                handle: Some(handle),
            }),
            Err(_) => FileNow::Unknown,
        },
        Err(Alive::No) => FileNow::Gone,
        Err(_) => FileNow::Unknown,
    }
}
