//! Memory a free left on a device because processes outside the broker kept it (its
//! charge is the core's: `core/src/state/stranded.rs`). [`Stranded`] (reached by
//! [`Arbiter::stranded`]) charges it to the tenant that answers for it once the device
//! thread found it kept (`Stranded::reporter`, handed to the free by
//! `Arbiter::free_on_device`), looks again at a kept memfd until it is let go (`looks.rs`),
//! and holds the finder of other holders near the recorded ones (`kept_holders.rs`; NVML,
//! set once at start). A restart takes the charges back in `restart/stranded.rs`.

mod looks;

pub(crate) use looks::KeptFile;

use super::Arbiter;
use crate::kept_holders::HolderFinder;
use crate::memfd_holders::MemFile;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use uuid::Uuid;

/// The memory kept outside the broker of one arbiter ([`Arbiter::stranded`]).
pub struct Stranded<'a> {
    pub(super) arb: &'a Arbiter,
    pub(super) state: &'a StrandedState,
}

/// What the feature holds of one arbiter.
#[derive(Default)]
pub(crate) struct StrandedState {
    /// Kept memfds looked at again until let go (`looks.rs`).
    looks: looks::KeptLooks,
    /// Who else may keep CUDA memory a free left on the card (`kept_holders.rs`; NVML):
    /// set once at start where there is a lister.
    holders: OnceLock<Arc<HolderFinder>>,
}

impl<'a> Stranded<'a> {
    /// Memory a free left on a device is charged until every process near its recorded
    /// holders with a context there (`finder`'s lister: NVML) has exited, not only the
    /// recorded ones (`kept_holders.rs`). Set once, before sessions open; false when set
    /// already.
    pub fn find_holders_with(&self, finder: HolderFinder) -> bool {
        // Sessions taken back from a keeper opened before: their peers' places are read now.
        let peers: Vec<(Uuid, u32)> = self
            .arb
            .lock()
            .sessions()
            .iter()
            .filter_map(|s| Some((s.id, s.peer.pid?)))
            .collect();
        let places: Vec<_> = peers
            .into_iter()
            .filter_map(|(id, pid)| Some((id, finder.place(pid)?)))
            .collect();
        let mut st = self.arb.lock();
        for (id, place) in places {
            st.place_peer(id, place);
        }
        drop(st);
        // Memory kept outside the broker taken back: looked for near its holders too.
        self.arb.restart().watch_adopted_stranded(&finder);
        self.state.holders.set(Arc::new(finder)).is_ok()
    }

    /// The finder of processes that may keep freed memory, where there is one.
    pub(crate) fn holders(&self) -> Option<&'a Arc<HolderFinder>> {
        self.state.holders.get()
    }

    /// What the device thread calls when a free did not give the memory back: the bytes
    /// are charged again to the tenant that answers for them (the block's, or another
    /// tenant's importer: `Reached::answers_for`) (`State::stranded`), on the main runtime
    /// (inline when there is none), never on the device thread under a lock it could wait
    /// on.
    pub(super) fn reporter(
        &self,
        kind: Option<crate::device::MemoryKind>,
    ) -> impl FnOnce(u32, String, u64, Vec<u32>, Kept) + Send + 'static {
        let me = self.arb.me.clone();
        let rt = self.arb.lifecycle.effects_runtime();
        let unverified = self.arb.unverified.clone();
        move |device, tenant, bytes, pids, kept| {
            let (memfd, recheck) = match kept {
                Kept::Memfd(looks) => (Some(looks), None),
                Kept::Cuda(recheck) => (None, recheck),
            };
            // Its record names its processes by start too: a reused pid is not one. Read
            // here, on the free's thread, not on a runtime thread.
            let starts: Vec<(u32, u64)> = pids
                .iter()
                .filter_map(|&p| crate::process::start_ticks(p).map(|s| (p, s)))
                .collect();
            let charge = move || {
                let pending = &unverified[device as usize];
                let Some(arb) = me.upgrade() else {
                    pending.fetch_sub(bytes, Ordering::SeqCst);
                    return;
                };
                let by_handle = memfd.as_ref().is_some_and(|m| m.by_handle);
                // A memfd the kernel says lives, held by nobody the broker recorded: maybe a
                // copy of its own still closing (a keeper's, an undelivered ticket's). It is
                // charged at the first look if it still lives then (`looks.rs`); until
                // then its bytes stay unverified: the broker's, never outside memory.
                if let (true, true, Some(MemfdKept { file, .. })) =
                    (by_handle, pids.is_empty(), &memfd)
                {
                    let deferred = arb.stranded().look_again(looks::KeptFile {
                        id: None,
                        unverified: Some(looks::Unverified {
                            tenant: tenant.clone(),
                            device,
                            bytes,
                        }),
                        file: file.clone(),
                        pids: Vec::new(),
                        by_handle,
                    });
                    // No looks (no runtime): charged at once.
                    if deferred {
                        return;
                    }
                }
                let mut st = arb.lock();
                let id = if by_handle {
                    st.stranded_unwatched(&tenant, device, bytes, pids.iter().copied())
                } else if let Some(Recheck {
                    finder,
                    uuid,
                    places,
                }) = recheck
                {
                    // Processes near its holders are looked for again when the last
                    // named one exits: watched before any exit can be seen.
                    let id = st.stranded_rechecking(&tenant, device, bytes, pids.iter().copied());
                    if let Some(id) = id {
                        finder.watch(id, &uuid, places);
                    }
                    id
                } else {
                    st.stranded(&tenant, device, bytes, pids.iter().copied())
                };
                if let Some(id) = id {
                    // Its file handle (a memfd's) lets a restarted broker ask the kernel.
                    let handle = memfd
                        .as_ref()
                        .and_then(|m| m.file.handle.as_ref())
                        .map(|h| h.record());
                    st.stranded_holders_started(id, kind, handle, starts);
                }
                // In the same hold: the refresh sees the bytes as unverified or as the
                // tenant's, never as both or neither.
                pending.fetch_sub(bytes, Ordering::SeqCst);
                drop(st);
                tracing::warn!(device, tenant, bytes, ?pids, charged = id.is_some(), "freed memory stayed on the device: a process that had its descriptor keeps it; charged to its tenant until it lets go");
                // A memfd: looked at again, its charge lifted once let go.
                if let (Some(id), Some(MemfdKept { file, by_handle })) = (id, memfd) {
                    let _ = arb.stranded().look_again(looks::KeptFile {
                        id: Some(id),
                        unverified: None,
                        file,
                        pids,
                        by_handle,
                    });
                }
            };
            match rt {
                Some(rt) => {
                    rt.spawn(async move { charge() });
                }
                None => charge(),
            }
        }
    }

    /// The kernel's prober of kept memfds (`None` where a memfd cannot be made).
    pub(super) fn prober(&self) -> Option<Arc<crate::memfd_alive::Prober>> {
        self.state.looks.prober()
    }
}

/// What a free found kept, as the reporter takes it.
pub(super) enum Kept {
    /// A memfd to look at again (`looks.rs`).
    Memfd(MemfdKept),
    /// CUDA memory, which cannot be looked at; with a finder, where to look for its
    /// holders again when the last named one exits (`kept_holders.rs`).
    Cuda(Option<Recheck>),
}

/// A memfd a free found kept.
pub(super) struct MemfdKept {
    pub(super) file: MemFile,
    /// Does the kernel say when it is let go (`looks.rs`)?
    pub(super) by_handle: bool,
}

/// Where to look for the holders of CUDA memory kept again.
pub(super) struct Recheck {
    pub(super) finder: Arc<HolderFinder>,
    /// The device's UUID.
    pub(super) uuid: String,
    /// The places to look near, shared with other blocks'.
    pub(super) places: Vec<Arc<crate::kept_holders::Place>>,
}
