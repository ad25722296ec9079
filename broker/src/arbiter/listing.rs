//! The operators' views: paginated listings (tenants, leases, sessions, shared leases). Each page is built under one short hold
//! of the state lock — only what the page needs is copied, and per-tenant token counts and
//! compute-turn usage are read after the lock is released — so a listing never stalls
//! admission for long, however many tenants or leases there are. Tenants come from the
//! ledger's ordered map and leases from the lease table's indexes (by grant sequence, and
//! per tenant), so a page costs what it holds, not the size of the table. Page tokens are
//! opaque to clients: the last key of the page (tenant name, lease sequence number,
//! session id, publication sequence number).
//! The whole-list methods (`tenants`, `leases`, ...) walk the pages. [`Views`] (reached by
//! [`Arbiter::views`]) owns every read-only view operators get: these listings, a tenant,
//! the devices' reports, the quarantine, the `/metrics` text; it keeps no fields (it reads
//! the state).
//! Chunks release the lock fairly (`Locked::unlock_fair`): a take waiting behind one chunk
//! gets the lock before the listing takes it for the next.

use super::admin::tenant_view;
use super::{Arbiter, DeviceReport, QuarantineView, SessionView, TenantView};
use crate::bounds;
use crate::error::{BrokerError, BrokerResult};
use crate::lease::LeaseView;
use std::collections::HashMap;
use uuid::Uuid;

/// Page size when a request gives none.
pub const DEFAULT_PAGE_SIZE: usize = 500;
/// Largest page a request may ask for (larger asks get this many).
pub const MAX_PAGE_SIZE: usize = 5000;
/// Most items copied under one hold of the state lock: a page is built in chunks of this
/// many (the lock is released between them), so even a page of [`MAX_PAGE_SIZE`] holds it
/// only as long as this many items take to copy (tens of microseconds).
const HOLD_CHUNK: usize = 100;

/// One page of a listing; `next` is the token of the next page (None: this was the last).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub next: Option<String>,
}

/// The page size for a requested one (0: the default; capped at [`MAX_PAGE_SIZE`]).
pub fn page_size(requested: u32) -> usize {
    match requested as usize {
        0 => DEFAULT_PAGE_SIZE,
        n => n.min(MAX_PAGE_SIZE),
    }
}

fn bad_token() -> BrokerError {
    BrokerError::InvalidArgument(
        "page_token is not a token this broker gave out (pass next_page_token unchanged)".into(),
    )
}

/// The `size` smallest of `keyed` by key, sorted, and whether more were left.
fn smallest<K: Ord + Copy, T>(mut keyed: Vec<(K, T)>, size: usize) -> (Vec<(K, T)>, bool) {
    let more = keyed.len() > size;
    if more {
        keyed.select_nth_unstable_by_key(size, |k| k.0);
        keyed.truncate(size);
    }
    keyed.sort_unstable_by_key(|k| k.0);
    (keyed, more)
}

/// Who lists shared leases.
#[derive(Clone, Copy, Debug)]
pub enum SharedViewer<'a> {
    /// A worker of this tenant: its own publications (with importers) and those published
    /// for it (without).
    Tenant(&'a str),
    /// An operator: every publication (of this publisher only, if given), with importers.
    Operator(Option<&'a str>),
}

impl SharedViewer<'_> {
    fn sees(&self, p: &crate::sharing::Publication) -> bool {
        match self {
            SharedViewer::Tenant(t) => p.publisher == *t || p.readable_by(t),
            SharedViewer::Operator(publisher) => publisher.is_none_or(|t| p.publisher == t),
        }
    }

    fn sees_imports(&self, p: &crate::sharing::Publication) -> bool {
        match self {
            SharedViewer::Tenant(t) => p.publisher == *t,
            SharedViewer::Operator(_) => true,
        }
    }
}

/// The operators' read-only views of one arbiter ([`Arbiter::views`]): listings page by
/// page, a tenant, the devices, the `/metrics` text.
pub struct Views<'a> {
    pub(super) arb: &'a Arbiter,
}

impl Views<'_> {
    /// Every quarantined block (memory a live process may still map), oldest first: the
    /// quarantine's and the blocks held for shared-lease importers and other processes.
    pub(crate) fn quarantined(&self) -> Vec<QuarantineView> {
        let st = self.arb.lock();
        let now = (std::time::Instant::now(), std::time::SystemTime::now());
        let mut v: Vec<QuarantineView> = st
            .quarantine()
            .iter()
            .map(|(id, q)| QuarantineView {
                lease: *id,
                tenant: q.tenant.clone(),
                device: q.device,
                bytes: q.block.bytes(),
                pid: q.pid,
                since: now.1 - now.0.saturating_duration_since(q.since),
                reason: crate::views::HoldReason::Holder,
                holders: q.pid.into_iter().collect(),
                publication: None,
            })
            .collect();
        // Blocks held for importers of shared leases and other processes (`sharing.rs`).
        v.extend(st.shared().held_views(now));
        // Freed memory a process kept (`state/stranded.rs`).
        v.extend(st.stranded_memory().map(|(id, s)| QuarantineView {
            lease: *id,
            tenant: s.tenant.clone(),
            device: s.device,
            bytes: s.bytes,
            pid: s.pids.first().copied(),
            since: now.1 - now.0.saturating_duration_since(s.since),
            reason: crate::views::HoldReason::KeptAfterFree,
            holders: s.pids.iter().copied().collect(),
            publication: None,
        }));
        v.sort_by_key(|q| q.since);
        v
    }

    /// Every tenant by name, page by page.
    pub fn tenants(&self) -> Vec<TenantView> {
        all_pages(|t| self.tenants_page(t, DEFAULT_PAGE_SIZE))
    }

    /// Every lease (of `tenant`, or all) in the order granted, page by page.
    pub fn leases(&self, tenant: Option<&str>) -> Vec<LeaseView> {
        all_pages(|t| self.leases_page(tenant, t, DEFAULT_PAGE_SIZE))
    }

    /// Tenants by name, after `token`.
    pub(crate) fn tenants_page(&self, token: &str, size: usize) -> BrokerResult<Page<TenantView>> {
        bounds::check("page_token", token, bounds::MAX_TENANT_BYTES)?;
        let size = size.max(1);
        let mut views: Vec<TenantView> = Vec::new();
        let mut cursor = token.to_string();
        loop {
            let want = (size - views.len()).min(HOLD_CHUNK);
            let (chunk, more) = self.tenants_chunk(&cursor, want);
            views.extend(chunk);
            if !more {
                break Ok(self.finish_tenants(views, false));
            }
            if views.len() >= size {
                break Ok(self.finish_tenants(views, true));
            }
            cursor = views.last().map(|v| v.name.clone()).unwrap_or_default();
        }
    }

    /// Up to `want` tenants after `after` ("": from the first) under one hold of the state
    /// lock, and whether more follow.
    fn tenants_chunk(&self, after: &str, want: usize) -> (Vec<TenantView>, bool) {
        let st = self.arb.lock();
        let mut it = st
            .ledger()
            .tenants_after((!after.is_empty()).then_some(after));
        let page: Vec<_> = it.by_ref().take(want).collect();
        let more = it.next().is_some();
        let mut counts: HashMap<&str, (u32, u32)> =
            page.iter().map(|t| (t.name.as_str(), (0, 0))).collect();
        for s in st.sessions().iter() {
            if let Some(c) = counts.get_mut(s.tenant.as_str()) {
                c.0 += 1;
            }
        }
        for w in st.queue().iter() {
            if let Some(c) = counts.get_mut(w.ask.tenant.as_str()) {
                c.1 += 1;
            }
        }
        // Each waiting tenant's place in the order of service: its first waiter's.
        let mut positions: HashMap<&str, u32> = HashMap::new();
        if !st.queue().is_empty() {
            for (i, id) in st.queue().order(st.ledger()).iter().enumerate() {
                if let Some(w) = st.queue().get(*id) {
                    if counts.contains_key(w.ask.tenant.as_str()) {
                        positions
                            .entry(w.ask.tenant.as_str())
                            .or_insert(i as u32 + 1);
                    }
                }
            }
        }
        let views = page
            .iter()
            .map(|t| {
                let (sessions, waiting) = counts.get(t.name.as_str()).copied().unwrap_or((0, 0));
                let mut v = TenantView::of(t, sessions, waiting);
                v.queue_position = positions.get(t.name.as_str()).copied().unwrap_or(0);
                v
            })
            .collect();
        drop((counts, positions, page, it));
        st.unlock_fair();
        (views, more)
    }

    /// Token counts (the authenticator's own table) and turns, outside the state lock;
    /// the page's next token.
    fn finish_tenants(&self, mut views: Vec<TenantView>, more: bool) -> Page<TenantView> {
        let tokens = self.arb.auth.counts();
        for v in &mut views {
            v.tokens = tokens.get(&v.name).copied().unwrap_or(0);
            v.turns = self.arb.scheduler.usage(&v.name);
        }
        let next = if more {
            views.last().map(|v| v.name.clone())
        } else {
            None
        };
        Page { items: views, next }
    }

    /// Leases (of `tenant`, or all) in the order they were granted, after `token`.
    pub(crate) fn leases_page(
        &self,
        tenant: Option<&str>,
        token: &str,
        size: usize,
    ) -> BrokerResult<Page<LeaseView>> {
        bounds::check("page_token", token, bounds::MAX_ID_BYTES)?;
        let after: u64 = if token.is_empty() {
            0
        } else {
            token.parse().map_err(|_| bad_token())?
        };
        let size = size.max(1);
        let mut items: Vec<LeaseView> = Vec::new();
        let mut cursor = after;
        loop {
            let want = (size - items.len()).min(HOLD_CHUNK);
            let (chunk, more) = {
                let st = self.arb.lock();
                let (page, more) = st.leases().page_after(tenant, cursor, want);
                let chunk: Vec<(u64, LeaseView)> =
                    page.iter().map(|l| (l.seq, st.view(l))).collect();
                drop(page);
                st.unlock_fair();
                (chunk, more)
            };
            if let Some((seq, _)) = chunk.last() {
                cursor = *seq;
            }
            items.extend(chunk.into_iter().map(|(_, v)| v));
            if !more || items.len() >= size {
                let next = more.then(|| cursor.to_string());
                return Ok(Page { items, next });
            }
        }
    }

    /// Sessions (of `tenant`, or all) by id (the order they were opened), after `token`.
    pub(crate) fn sessions_page(
        &self,
        tenant: Option<&str>,
        token: &str,
        size: usize,
    ) -> BrokerResult<Page<SessionView>> {
        bounds::check("page_token", token, bounds::MAX_ID_BYTES)?;
        let after = if token.is_empty() {
            Uuid::nil()
        } else {
            Uuid::parse_str(token).map_err(|_| bad_token())?
        };
        let size = size.max(1);
        let st = self.arb.lock();
        let keyed: Vec<(Uuid, &crate::session::Session)> = st
            .sessions()
            .iter()
            .filter(|s| s.id > after && tenant.is_none_or(|t| s.tenant == t))
            .map(|s| (s.id, s))
            .collect();
        let (page, more) = smallest(keyed, size);
        let items: Vec<SessionView> = page
            .iter()
            .map(|(_, s)| SessionView {
                id: s.id,
                tenant: s.tenant.clone(),
                name: s.name.clone(),
                pid: s.peer.pid,
                uid: s.peer.uid,
                unix: s.peer.unix,
                opened: s.opened,
                lease_count: s.leases().len() as u32,
                held_bytes: s
                    .leases()
                    .iter()
                    .filter_map(|l| st.leases().get(l))
                    .map(|l| l.bytes())
                    .sum(),
                gpu: s.gpu,
                process_reserved: st.reservations().room_of_session(s.id),
            })
            .collect();
        let next = if more {
            page.last().map(|(id, _)| id.to_string())
        } else {
            None
        };
        drop(page);
        drop(st);
        Ok(Page { items, next })
    }

    /// Shared leases `viewer` may see, in the order they were first published, after
    /// `token`.
    pub(crate) fn shared_page(
        &self,
        viewer: SharedViewer<'_>,
        token: &str,
        size: usize,
    ) -> BrokerResult<Page<crate::sharing::SharedView>> {
        bounds::check("page_token", token, bounds::MAX_ID_BYTES)?;
        let after: u64 = if token.is_empty() {
            0
        } else {
            token.parse().map_err(|_| bad_token())?
        };
        let size = size.max(1);
        let st = self.arb.lock();
        let keyed: Vec<(u64, &crate::sharing::Publication)> = st
            .shared()
            .pubs
            .values()
            .filter(|p| p.seq > after && p.listed() && viewer.sees(p))
            .map(|p| (p.seq, p))
            .collect();
        let (page, more) = smallest(keyed, size);
        let items: Vec<_> = page
            .iter()
            .map(|(_, p)| p.view(viewer.sees_imports(p)))
            .collect();
        let next = if more {
            page.last().map(|(seq, _)| seq.to_string())
        } else {
            None
        };
        drop(page);
        drop(st);
        Ok(Page { items, next })
    }

    /// Fills in what [`tenant_view`] leaves out, with no state lock held.
    pub(super) fn finish_tenant(&self, mut v: TenantView) -> TenantView {
        v.tokens = self.arb.auth.count(&v.name) as u32;
        v.turns = self.arb.scheduler.usage(&v.name);
        v
    }

    /// Fails with `NOT_FOUND` when a tenant filter names no tenant (an operator's typo
    /// must not look like "nothing there").
    pub(crate) fn check_tenant_filter(&self, tenant: Option<&str>) -> BrokerResult<()> {
        match tenant {
            Some(name) if self.arb.lock().ledger().get(name).is_none() => {
                Err(BrokerError::tenant_not_found(name))
            }
            _ => Ok(()),
        }
    }

    /// Tenant `name`: its quota and usage.
    pub fn tenant(&self, name: &str) -> BrokerResult<TenantView> {
        let view = {
            let st = self.arb.lock();
            let t = st
                .ledger()
                .get(name)
                .ok_or_else(|| BrokerError::tenant_not_found(name))?;
            tenant_view(&st, t)
        };
        Ok(self.finish_tenant(view))
    }

    /// The `/metrics` text: the arbiter's counters and gauges from snapshots of its state.
    pub async fn metrics_text(&self, format: crate::metrics::Format) -> String {
        let devices = self.device_reports().await;
        let tenants = self.tenants();
        let sessions = self.session_count();
        crate::metrics::render(
            &self.arb.metrics,
            |reg| self.arb.scheduler.register_metrics(reg),
            &devices,
            &tenants,
            sessions,
            format,
        )
    }

    /// Every device with its memory picture. Reads each device's free memory.
    pub async fn device_reports(&self) -> Vec<DeviceReport> {
        let mut out = Vec::new();
        for (i, slot) in self.arb.devices.iter().enumerate() {
            let desc = slot.thread.desc().clone();
            let info = slot.thread.call(|d| d.mem_info()).await;
            let free = match info {
                Ok(Ok(m)) => m.free,
                _ => 0,
            };
            let (turn_holder, turns_waiting) = self.arb.scheduler.device_state(i as u32);
            let avail = self
                .arb
                .avail
                .read()
                .device(i as u32)
                .cloned()
                .unwrap_or_default();
            let st = self.arb.lock();
            let p = &st.pools()[i];
            let s = p.stats();
            let held = p.held_on_device() + self.arb.unverified.of(i);
            out.push(DeviceReport {
                index: i as u32,
                name: desc.name,
                uuid: desc.uuid,
                model: desc.model,
                backend: desc.backend.to_string(),
                total: desc.total_bytes,
                free,
                leasable: s.leasable,
                leased: s.leased,
                cached: s.cached,
                headroom: p.headroom(),
                quarantined: s.quarantined,
                process_reserved: s.process_reserved,
                external_used: desc.total_bytes.saturating_sub(free).saturating_sub(held),
                granularity: desc.granularity,
                lease_count: p.lease_count(),
                waiting: st
                    .queue()
                    .iter()
                    .filter(|w| w.ask.device.is_none_or(|d| d == i as u32))
                    .count() as u32,
                turn_holder,
                turns_waiting,
                drain_reason: avail.drain.map(|d| d.reason),
                fault: avail.fault.map(|f| f.reason),
            });
        }
        out
    }

    /// Every listed publication (of `publisher` only, if given), with importers, oldest
    /// first, page by page.
    #[cfg(test)]
    pub(crate) fn shared(&self, publisher: Option<&str>) -> Vec<crate::sharing::SharedView> {
        all_pages(|t| self.shared_page(SharedViewer::Operator(publisher), t, DEFAULT_PAGE_SIZE))
    }

    /// Number of open sessions.
    pub fn session_count(&self) -> usize {
        self.arb.lock().sessions().len()
    }

    /// The reservations of `tenant` (all tenants: None), oldest first.
    pub(crate) fn reservations(
        &self,
        tenant: Option<&str>,
    ) -> Vec<crate::reservations::ReservationView> {
        let st = self.arb.lock();
        let mut v: Vec<crate::reservations::ReservationView> = st
            .reservations()
            .iter()
            .filter(|r| tenant.is_none_or(|t| r.tenant == t))
            .map(|r| r.view(self.arb.devices.uuid(r.device)))
            .collect();
        v.sort_by_key(|r| (r.created, r.id));
        v
    }
}

/// Walks every page of a listing (each page under its own short lock hold).
pub(super) fn all_pages<T>(mut page: impl FnMut(&str) -> BrokerResult<Page<T>>) -> Vec<T> {
    let mut out = Vec::new();
    let mut token = String::new();
    loop {
        match page(&token) {
            Ok(p) => {
                out.extend(p.items);
                match p.next {
                    Some(t) => token = t,
                    None => return out,
                }
            }
            // Our own tokens are always valid; nothing else can fail here.
            Err(_) => return out,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chunk's fair unlock releases the lock as a drop does (the hold is counted, the
    /// lock is free after it), and a take that found the lock held counts its wait. (That
    /// a fair unlock hands the lock to a parked waiter is `parking_lot`'s contract; a plain
    /// unlock does so too once a waiter has waited about 0.5 ms, so no test here could
    /// tell them apart by timing alone.)
    #[test]
    fn a_chunk_releases_the_lock_and_a_waiting_take_is_counted() {
        let arb = crate::arbiter::host_arbiter(1 << 30, 1, Default::default());
        let holds = arb.metrics.lock_holds.counts().0[0];
        arb.lock().unlock_fair();
        assert!(arb.state.try_lock().is_some(), "the lock is free again");
        assert_eq!(arb.metrics.lock_holds.counts().0[0], holds + 1);

        let waits = arb.metrics.lock_holds.wait_counts()[0];
        let chunk = arb.lock();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = {
            let arb = arb.clone();
            std::thread::spawn(move || {
                tx.send(()).unwrap();
                drop(arb.lock());
            })
        };
        rx.recv().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        chunk.unlock_fair();
        waiter.join().unwrap();
        assert_eq!(arb.metrics.lock_holds.wait_counts()[0], waits + 1);
    }

    #[test]
    fn page_sizes_default_and_cap() {
        assert_eq!(page_size(0), DEFAULT_PAGE_SIZE);
        assert_eq!(page_size(7), 7);
        assert_eq!(page_size(u32::MAX), MAX_PAGE_SIZE);
    }

    #[test]
    fn smallest_keeps_the_first_keys_in_order() {
        let v: Vec<(u64, ())> = [9, 3, 7, 1, 5].iter().map(|&k| (k, ())).collect();
        let (p, more) = smallest(v.clone(), 3);
        assert_eq!(p.iter().map(|k| k.0).collect::<Vec<_>>(), vec![1, 3, 5]);
        assert!(more);
        let (p, more) = smallest(v, 5);
        assert_eq!(p.len(), 5);
        assert!(!more);
    }
}
