//! Looks again at freed memory that processes kept (`core/src/state/stranded.rs`) where
//! the broker can tell that it was let go: a memfd (host backend). Its charge goes when
//! the kernel says the file no longer lives (`memfd_alive.rs`), or, where the broker may
//! not ask it, when none of the processes found keeping it maps it or holds a descriptor
//! of it any more (`memfd_holders.rs`); a process not read through is looked at again.
//! CUDA memory cannot be asked after its free: its charge waits for its holders' exits.
//!
//! One task per arbiter, started with the first record, idle (waiting on its channel)
//! while there is none, and ended when the arbiter goes (it holds it weakly, like the
//! watchers). Each record is looked at after [`Arbiter::config`]'s
//! `kept_memory_look`, then at doubling intervals up to [`MAX_BACKOFF`] times that while
//! it is still kept; at most [`PER_ROUND`] records a round, on a blocking thread (never a
//! runtime's worker: a holder scan may take 50 ms a process).

use super::Stranded;
use crate::arbiter::Arbiter;
use crate::memfd_alive::{Alive, Prober};
use crate::memfd_holders::MemFile;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use uuid::Uuid;

/// Most records looked at in one round (the rest wait for the next).
const PER_ROUND: usize = 64;
/// The longest interval between two looks at a record, in units of the first.
const MAX_BACKOFF: u32 = 64;

/// A kept memfd's charge, to be looked at again.
#[derive(Debug)]
pub(crate) struct KeptFile {
    /// The stranded record (`State::stranded`); `None` until it is charged.
    pub id: Option<Uuid>,
    /// Bytes not charged yet (held by nobody the broker recorded): charged at the first
    /// look that finds the file still alive, let go at one that finds it gone.
    pub unverified: Option<Unverified>,
    pub file: MemFile,
    /// The processes named as keeping it.
    pub pids: Vec<u32>,
    /// The kernel says whether the file lives: the record is unwatched, let go only here.
    pub by_handle: bool,
}

/// Memory kept by nobody the broker recorded, not charged yet: counted in the arbiter's
/// unverified bytes meanwhile.
#[derive(Debug)]
pub(crate) struct Unverified {
    pub tenant: String,
    pub device: u32,
    pub bytes: u64,
}

/// The arbiter's end of the looks: where records go, and the kernel's prober.
#[derive(Debug, Default)]
pub(crate) struct KeptLooks {
    to_task: OnceLock<mpsc::UnboundedSender<KeptFile>>,
    prober: OnceLock<Option<Arc<Prober>>>,
}

impl KeptLooks {
    /// The kernel's prober (`None` where a memfd cannot be made).
    pub(crate) fn prober(&self) -> Option<Arc<Prober>> {
        self.prober
            .get_or_init(|| match Prober::new() {
                Ok(p) => Some(Arc::new(p)),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot make the memfd prober: kept memfds are looked for by process only");
                    None
                }
            })
            .clone()
    }
}

/// What a look found.
enum Found {
    /// Nobody holds it any more.
    Released,
    /// Still kept; these named processes no longer hold it.
    Kept { let_go: Vec<u32> },
}

impl Stranded<'_> {
    /// Looks at `kept` again from now on, until its charge goes. Needs a runtime (the
    /// charge is made on one); without it nothing looks (false: a charged record then
    /// waits for its holders' exits).
    pub(crate) fn look_again(&self, kept: KeptFile) -> bool {
        let tx = self.state.looks.to_task.get_or_init(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(looks(self.arb.me(), rx, self.arb.cfg.kept_memory_look));
                }
                Err(_) => {
                    tracing::warn!("no runtime: memory kept after its free is not looked at again")
                }
            }
            tx
        });
        tx.send(kept).is_ok()
    }
}

/// A record waiting for its next look.
struct Waiting {
    kept: KeptFile,
    every: Duration,
    next: Instant,
}

/// The task: takes records, looks at those due, applies what it found.
async fn looks(me: Weak<Arbiter>, mut rx: mpsc::UnboundedReceiver<KeptFile>, first: Duration) {
    let first = first.max(Duration::from_millis(1));
    let mut waiting: Vec<Waiting> = Vec::new();
    loop {
        let next = waiting.iter().map(|w| w.next).min();
        tokio::select! {
            kept = rx.recv() => match kept {
                Some(kept) => waiting.push(Waiting { kept, every: first, next: Instant::now() + first }),
                None => return,
            },
            _ = tokio::time::sleep_until(next.unwrap_or_else(Instant::now)), if next.is_some() => {
                let now = Instant::now();
                waiting.sort_by_key(|w| w.next);
                let due = waiting.iter().take_while(|w| w.next <= now).count().min(PER_ROUND);
                let mut round: Vec<Waiting> = waiting.drain(..due).collect();
                let Some(prober) = me.upgrade().map(|a| a.stranded_state.looks.prober()) else { return };
                let asks: Vec<(MemFile, Vec<u32>, bool)> = round
                    .iter()
                    .map(|w| (w.kept.file.clone(), w.kept.pids.clone(), w.kept.by_handle))
                    .collect();
                let found = tokio::task::spawn_blocking(move || {
                    asks.iter()
                        .map(|(file, pids, by_handle)| look(file, pids, *by_handle, prober.as_deref()))
                        .collect::<Vec<Found>>()
                })
                .await;
                let Some(arb) = me.upgrade() else { return };
                let Ok(found) = found else {
                    waiting.append(&mut round);
                    continue;
                };
                let mut st = arb.lock();
                for (mut w, found) in round.into_iter().zip(found) {
                    if let Some(u) = w.kept.unverified.take() {
                        // In the same hold as the charge: never both or neither.
                        let pending = &arb.unverified[u.device as usize];
                        let id = match found {
                            Found::Released => None,
                            Found::Kept { .. } => st.stranded_unwatched(&u.tenant, u.device, u.bytes, []),
                        };
                        pending.fetch_sub(u.bytes, std::sync::atomic::Ordering::SeqCst);
                        if id.is_some() {
                            tracing::warn!(device = u.device, tenant = u.tenant, bytes = u.bytes, "freed memory stayed on the device: a process the broker never saw keeps it; charged to its tenant until it lets go");
                        }
                        w.kept.id = id;
                        let Some(id) = id else { continue };
                        // Its record keeps the file's handle: a restarted broker asks by it.
                        let handle = w.kept.file.handle.as_ref().map(|h| h.record());
                        st.stranded_holders_started(id, Some(crate::device::MemoryKind::HostMemfd), handle, []);
                        w.next = Instant::now() + w.every;
                        waiting.push(w);
                        continue;
                    }
                    let Some(id) = w.kept.id else { continue };
                    let changed = match found {
                        Found::Released => {
                            st.stranded_released(id);
                            true
                        }
                        Found::Kept { let_go } => {
                            for &pid in &let_go {
                                st.stranded_let_go(id, pid);
                            }
                            w.kept.pids.retain(|p| !let_go.contains(p));
                            !let_go.is_empty()
                        }
                    };
                    if !st.is_stranded(id) {
                        continue;
                    }
                    if !changed {
                        w.every = (w.every * 2).min(first * MAX_BACKOFF);
                    }
                    w.next = Instant::now() + w.every;
                    waiting.push(w);
                }
            }
        }
    }
}

/// One look at a kept memfd: the kernel's word where it may be asked, else each named
/// process's entries. Runs on a blocking thread.
fn look(file: &MemFile, pids: &[u32], by_handle: bool, prober: Option<&Prober>) -> Found {
    if by_handle {
        let alive = match (file.handle.as_ref(), prober) {
            (Some(h), Some(p)) => p.alive(h),
            _ => Alive::Unknown,
        };
        if alive == Alive::No {
            return Found::Released;
        }
    }
    let found = crate::memfd_holders::holding(file.id, pids);
    let let_go = pids
        .iter()
        .copied()
        .filter(|p| !found.holding.contains(p) && !found.unknown.contains(p))
        .collect();
    Found::Kept { let_go }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    fn let_go(found: Found) -> Option<Vec<u32>> {
        match found {
            Found::Released => None,
            Found::Kept { let_go } => Some(let_go),
        }
    }

    /// Where the kernel may not be asked (no prober, or a record the free could not ask
    /// about), each named process is looked at: one that still maps the memfd is kept, one
    /// that let go is named as such. Asked, the kernel's "gone" releases the record.
    #[test]
    fn a_look_names_the_processes_that_let_go_and_the_kernel_releases() {
        let me = std::process::id();
        // SAFETY: memfd_create with a static name; checked below.
        let fd = unsafe { libc::memfd_create(c"look-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate and a shared mapping of our own memfd, unmapped below.
        let at = unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), 1 << 16), 0);
            libc::mmap(
                std::ptr::null_mut(),
                1 << 16,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(at, libc::MAP_FAILED);
        let file = MemFile::of(&fd).unwrap();
        drop(fd);
        let prober = Prober::new().unwrap();
        let may_ask = prober.alive(file.handle.as_ref().unwrap()) == Alive::Yes;
        assert_eq!(let_go(look(&file, &[me], false, None)), Some(vec![]));
        assert_eq!(
            let_go(look(&file, &[me], true, Some(&prober))),
            Some(vec![])
        );
        // SAFETY: unmapping what was mapped above.
        unsafe { libc::munmap(at, 1 << 16) };
        assert_eq!(
            let_go(look(&file, &[me, u32::MAX], false, None)),
            Some(vec![me, u32::MAX])
        );
        if may_ask {
            assert_eq!(let_go(look(&file, &[me], true, Some(&prober))), None);
        }
    }
}
