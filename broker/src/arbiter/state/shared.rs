//! Shared blocks: when a published lease (or one whose descriptor another process
//! fetched) ends, its block is held, counted as its tenant's quarantined bytes, until the
//! last importer and every such process let go; imports end (or linger while their
//! process may map the memory). The publication table itself is `crate::sharing`; the
//! requests (publish, import, release) are the shell's `arbiter/sharing.rs`.

use super::{Ending, State};
use crate::arbiter::effects::{Effect, Effects, Watch};
use crate::device::{Handle, MemoryKind};
use crate::pool::Block;
use crate::session::Peer;
use crate::sharing::{self, Held, Waiters};
use std::time::Instant;
use uuid::Uuid;

/// Does the block carry only the seals it was made with (host memory), so it may be
/// cached for its tenant's next lease? (Reads the seals of a memfd the broker owns.)
pub(crate) fn pristine(block: &Block) -> bool {
    match &block.handle {
        Handle::Fd {
            kind: MemoryKind::HostMemfd,
            fd,
            ..
        } => sharing::seals_untouched(fd),
        _ => true,
    }
}

impl State {
    /// Hook of [`State::end_lease`] (after the lease left the table and its charge became
    /// free): returns the block and how it ends, or `None` when it is held here because
    /// importers or other processes may still map it.
    pub(crate) fn shared_lease_ended(
        &mut self,
        lease: Uuid,
        tenant: &str,
        device: u32,
        block: Block,
        ending: Ending,
        alive: &dyn Fn(u32) -> bool,
    ) -> Option<(Block, Ending)> {
        let publication = self.shared.by_lease.get(&lease).copied();
        let recipients: Vec<u32> = self
            .shared
            .recipients
            .remove(&lease)
            .unwrap_or_default()
            .into_iter()
            .filter(|&p| alive(p))
            .collect();
        if publication.is_none() && recipients.is_empty() {
            // A memfd its holder sealed (it may do so) never returns to the cache: the
            // next lease must get memory it can write and publish.
            let ending = match ending {
                Ending::Cache if !pristine(&block) => Ending::Destroy,
                e => e,
            };
            return Some((block, ending));
        }
        let mut imported = false;
        if let Some(pid) = publication {
            if let Some(p) = self.shared.pubs.get_mut(&pid) {
                p.lease_live = false;
                imported = !p.imports.is_empty();
                if let Some(name) = p.name.take() {
                    self.shared.by_name.remove(&(p.publisher.clone(), name));
                }
            }
        }
        // A published block never returns to the cache: other tenants had its
        // descriptor, and a memfd stays sealed.
        let destroy = publication.is_some() || ending == Ending::Destroy;
        if !imported && recipients.is_empty() {
            if let Some(pid) = publication {
                self.forget_publication(pid);
            }
            let ending = match ending {
                Ending::Cache if destroy => Ending::Destroy,
                e => e,
            };
            return Some((block, ending));
        }
        let bytes = block.bytes();
        self.pools[device as usize].release_to_quarantine(bytes);
        self.ledger.add_quarantine(tenant, device, bytes);
        let mut waiters = Waiters::default();
        let holder = match ending {
            Ending::Quarantine { pid } => pid,
            _ => None,
        };
        match ending {
            Ending::Quarantine { pid: Some(p) } => {
                waiters.pids.insert(p);
            }
            Ending::Quarantine { pid: None } => waiters.timeout = true,
            Ending::Cache | Ending::Destroy => {}
        }
        waiters.pids.extend(recipients);
        for &pid in &waiters.pids {
            self.fx.watch(Watch::Held {
                lease,
                pid: Some(pid),
            });
        }
        if waiters.timeout {
            self.fx.watch(Watch::Held { lease, pid: None });
        }
        tracing::info!(%lease, tenant, imported, waiting = waiters.pids.len(), "lease ended; its memory is held while others may map it");
        self.shared.held.insert(
            lease,
            Held {
                tenant: tenant.to_string(),
                device,
                block,
                since: Instant::now(),
                publication: imported.then_some(publication).flatten(),
                waiters,
                destroy,
                holder,
            },
        );
        if !imported {
            if let Some(pid) = publication {
                self.forget_publication(pid);
            }
        }
        None
    }

    /// Hook of `end_session`: the session's imports end (lingering while its process, or
    /// a process that fetched their descriptor, lives).
    pub(crate) fn shared_session_ended(
        &mut self,
        session: Uuid,
        peer: &Peer,
        alive: &dyn Fn(u32) -> bool,
    ) {
        let imports = self.shared.imports_of_session(session);
        if imports.is_empty() {
            return;
        }
        for id in imports {
            let device = self.shared.of_import(&id).map(|p| p.device).unwrap_or(0);
            let ending = match peer.pid {
                Some(pid) if !alive(pid) => Ending::Cache,
                Some(pid) => Ending::Quarantine { pid: Some(pid) },
                None if self.host_backed(device) => Ending::Destroy,
                None => Ending::Quarantine { pid: None },
            };
            self.import_let_go(id, ending, alive);
        }
    }

    /// An import's holder let go (`ending` says whether its process may still map it).
    pub(crate) fn import_let_go(
        &mut self,
        import: Uuid,
        ending: Ending,
        alive: &dyn Fn(u32) -> bool,
    ) {
        self.fx.push(Effect::ForgetTickets { lease: import });
        let recipients: Vec<u32> = self
            .shared
            .recipients
            .remove(&import)
            .unwrap_or_default()
            .into_iter()
            .filter(|&p| alive(p))
            .collect();
        let mut waiters = Waiters::default();
        if let Ending::Quarantine { pid } = ending {
            match pid {
                Some(p) => {
                    waiters.pids.insert(p);
                }
                None => waiters.timeout = true,
            }
        }
        waiters.pids.extend(recipients);
        if waiters.is_empty() {
            self.end_import(import);
            return;
        }
        let Some(pid) = self.shared.by_import.get(&import).copied() else {
            return;
        };
        for &p in &waiters.pids {
            self.fx.watch(Watch::Import {
                import,
                pid: Some(p),
            });
        }
        if waiters.timeout {
            self.fx.watch(Watch::Import { import, pid: None });
        }
        if let Some(i) = self
            .shared
            .pubs
            .get_mut(&pid)
            .and_then(|p| p.imports.get_mut(&import))
        {
            tracing::info!(%import, pids = ?waiters.pids, "import let go while processes may map it; lingering");
            i.lingering = Some(waiters);
        }
    }

    /// An import is over: nobody it was given to may map the memory any more.
    fn end_import(&mut self, import: Uuid) {
        self.fx.push(Effect::ForgetTickets { lease: import });
        self.shared.recipients.remove(&import);
        let Some(pid) = self.shared.by_import.remove(&import) else {
            return;
        };
        let Some(p) = self.shared.pubs.get_mut(&pid) else {
            return;
        };
        p.imports.remove(&import);
        tracing::debug!(%import, "import ended");
        if p.imports.is_empty() && !p.lease_live {
            let lease = p.lease;
            self.forget_publication(pid);
            if let Some(h) = self.shared.held.get_mut(&lease) {
                h.publication = None;
            }
            self.maybe_lift(lease);
        }
    }

    /// Drops a publication whose lease ended and that nobody imports.
    fn forget_publication(&mut self, id: Uuid) {
        if let Some(p) = self.shared.pubs.remove(&id) {
            self.shared.by_lease.remove(&p.lease);
            if let Some(n) = p.name {
                self.shared.by_name.remove(&(p.publisher, n));
            }
            for (&i, import) in &p.imports {
                self.shared.by_import.remove(&i);
                if let Some(w) = &import.lingering {
                    unwatch_import(&mut self.fx, i, w);
                }
            }
        }
    }

    /// Frees (or caches) a held block once nobody may map it.
    fn maybe_lift(&mut self, lease: Uuid) -> bool {
        let done = self
            .shared
            .held
            .get(&lease)
            .is_some_and(|h| h.publication.is_none() && h.waiters.is_empty());
        if !done {
            return false;
        }
        let Some(h) = self.shared.held.remove(&lease) else {
            return false;
        };
        let bytes = h.block.bytes();
        self.ledger.remove_quarantine(&h.tenant, h.device, bytes);
        let pool = &mut self.pools[h.device as usize];
        if h.destroy || !pristine(&h.block) {
            pool.unquarantine_destroyed(bytes);
            self.fx.free(h.device, h.block);
        } else {
            pool.unquarantine_to_cache(h.block);
        }
        tracing::info!(%lease, tenant = %h.tenant, held_for = ?h.since.elapsed(), "held memory let go by everyone");
        true
    }

    /// A held block's waiter (process `pid`, or with `None` the timeout) is gone; the
    /// block is let go once nobody may map it. True when memory came back.
    pub(crate) fn held_waiter_gone(&mut self, lease: Uuid, pid: Option<u32>) -> bool {
        if let Some(h) = self.shared.held.get_mut(&lease) {
            match pid {
                Some(p) => {
                    h.waiters.pids.remove(&p);
                }
                None => h.waiters.timeout = false,
            }
        }
        self.fx.unwatch(Watch::Held { lease, pid });
        self.maybe_lift(lease)
    }

    /// A lingering import's waiter (process `pid`, or with `None` the timeout) is gone;
    /// the import ends once nobody may map it. True when it ended.
    pub(crate) fn import_waiter_gone(&mut self, import: Uuid, pid: Option<u32>) -> bool {
        self.fx.unwatch(Watch::Import { import, pid });
        let Some(p) = self.shared.by_import.get(&import).copied() else {
            return false;
        };
        let Some(w) = self
            .shared
            .pubs
            .get_mut(&p)
            .and_then(|p| p.imports.get_mut(&import))
            .and_then(|i| i.lingering.as_mut())
        else {
            return false;
        };
        match pid {
            Some(p) => {
                w.pids.remove(&p);
            }
            None => w.timeout = false,
        }
        if w.is_empty() {
            self.end_import(import);
            return true;
        }
        false
    }

    /// Shutdown: a held block is freed, whoever may still map it.
    pub(crate) fn free_held(&mut self, lease: Uuid) {
        if let Some(h) = self.shared.held.remove(&lease) {
            unwatch_held(&mut self.fx, lease, &h.waiters);
            self.pools[h.device as usize].unquarantine_destroyed(h.block.bytes());
            self.ledger
                .remove_quarantine(&h.tenant, h.device, h.block.bytes());
            self.fx.free(h.device, h.block);
        }
    }
}

/// Stops the watchers of a lingering import's waiters.
fn unwatch_import(fx: &mut Effects, import: Uuid, w: &Waiters) {
    for &pid in &w.pids {
        fx.unwatch(Watch::Import {
            import,
            pid: Some(pid),
        });
    }
    if w.timeout {
        fx.unwatch(Watch::Import { import, pid: None });
    }
}

/// Stops the watchers of a held block's waiters (it is freed without them).
fn unwatch_held(fx: &mut Effects, lease: Uuid, w: &Waiters) {
    for &pid in &w.pids {
        fx.unwatch(Watch::Held {
            lease,
            pid: Some(pid),
        });
    }
    if w.timeout {
        fx.unwatch(Watch::Held { lease, pid: None });
    }
}
