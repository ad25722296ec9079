//! Conversions between proto messages and domain types.

use crate::arbiter::{DeviceReport, DrainReport, QuotaUpdate, SessionView, TenantView};
use crate::audit::AuditRecord;
use crate::auth::{Scope, TokenEntry};
use crate::device::Handle;
use crate::error::BrokerError;
use crate::lease::LeaseView;
use crate::ledger::{Quota, QuotaPatch, Tier, Usage};
use gpu_broker_proto::v1 as pb;
use std::time::SystemTime;
use uuid::Uuid;

pub(crate) use crate::units::unix_ms;

/// Parses a UUID field, naming the field in the error.
pub fn parse_id(field: &str, s: &str) -> Result<Uuid, BrokerError> {
    crate::bounds::check(field, s, crate::bounds::MAX_ID_BYTES)?;
    Uuid::parse_str(s)
        .map_err(|_| BrokerError::InvalidArgument(format!("{field} {s:?} is not a UUID")))
}

/// Every id of `ids` (a repeated field named `field`), or the first that is not one.
pub fn parse_ids(field: &str, ids: &[String]) -> Result<Vec<Uuid>, BrokerError> {
    ids.iter().map(|s| parse_id(field, s)).collect()
}

/// The domain request of `r`, an `AcquireLeaseRequest` of `tenant` for `session` (its
/// values still to be validated: `Arbiter::validate`).
pub fn acquire_request(
    tenant: String,
    session: Uuid,
    r: pb::AcquireLeaseRequest,
) -> Result<crate::arbiter::AcquireRequest, BrokerError> {
    let fallback = pb::Fallback::try_from(r.fallback)
        .map_err(|_| BrokerError::InvalidArgument(format!("unknown fallback {}", r.fallback)))?;
    Ok(crate::arbiter::AcquireRequest {
        tenant,
        session,
        bytes: r.bytes,
        device: r.device,
        wait: std::time::Duration::from_millis(r.wait_ms.unwrap_or(0)),
        label: r.label,
        reclaimable: r.reclaimable,
        fallback_host: fallback == pb::Fallback::Host,
    })
}

pub fn lease(v: &LeaseView) -> pb::Lease {
    pb::Lease {
        lease_id: v.id.to_string(),
        device: v.device,
        bytes: v.bytes,
        requested_bytes: v.requested_bytes,
        offset: 0,
        label: v.label.clone(),
        session_id: v.session.to_string(),
        tenant: v.tenant.clone(),
        state: if v.revoked {
            pb::LeaseState::Revoked as i32
        } else if v.reclaim_deadline.is_some() {
            pb::LeaseState::ReclaimRequested as i32
        } else {
            pb::LeaseState::Active as i32
        },
        tier: match v.tier {
            Tier::Device => pb::MemoryTier::Device as i32,
            Tier::Host => pb::MemoryTier::Host as i32,
        },
        created_unix_ms: unix_ms(v.created),
        reclaimable: v.reclaimable,
        reclaim_deadline_unix_ms: v.reclaim_deadline.map(unix_ms).unwrap_or(0),
        borrowed: v.borrowed,
        handle: Some(match &v.handle {
            // Listings carry no ticket (and no socket): AcquireLease and RenewLeaseTicket
            // fill both in for the caller.
            Handle::Fd {
                kind,
                block_id,
                size,
                ..
            } => pb::lease::Handle::Fd(pb::FdHandle {
                socket_path: String::new(),
                ticket: Vec::new(),
                memory_kind: memory_kind(*kind) as i32,
                block_id: *block_id,
                size: *size,
                ticket_ttl_ms: 0,
                retained: false,
                pushed: false,
            }),
        }),
        device_uuid: String::new(),
    }
}

/// [`lease`] with the device's UUID filled in (none for the host fallback tier).
pub fn lease_on(v: &LeaseView, arb: &crate::arbiter::Arbiter) -> pb::Lease {
    let mut l = lease(v);
    if v.tier == Tier::Device {
        l.device_uuid = arb.devices().uuid(v.device);
    }
    l
}

pub fn memory_kind(k: crate::device::MemoryKind) -> pb::MemoryKind {
    match k {
        crate::device::MemoryKind::CudaVmm => pb::MemoryKind::CudaVmm,
        crate::device::MemoryKind::HostMemfd => pb::MemoryKind::HostMemfd,
    }
}

/// The wire quota as the broker's [`Quota`] (field for field; checks come later).
pub fn quota_from_wire(q: pb::Quota) -> Quota {
    {
        Quota {
            limit_bytes: q.limit_bytes,
            max_leases: q.max_leases,
            priority: q.priority,
            guaranteed_bytes: q.guaranteed_bytes,
            host_limit_bytes: q.host_limit_bytes,
            turn_weight: q.turn_weight,
            device_limit_bytes: q.device_limit_bytes.into_iter().collect(),
        }
    }
}

/// The broker's [`Quota`] as the wire quota.
pub fn quota_to_wire(q: Quota) -> pb::Quota {
    {
        pb::Quota {
            limit_bytes: q.limit_bytes,
            max_leases: q.max_leases,
            priority: q.priority,
            guaranteed_bytes: q.guaranteed_bytes,
            host_limit_bytes: q.host_limit_bytes,
            turn_weight: q.turn_weight,
            device_limit_bytes: q.device_limit_bytes.into_iter().collect(),
        }
    }
}

/// The wire patch as the broker's [`QuotaPatch`].
pub fn patch_from_wire(p: pb::QuotaPatch) -> QuotaPatch {
    {
        QuotaPatch {
            limit_bytes: p.limit_bytes,
            max_leases: p.max_leases,
            priority: p.priority,
            guaranteed_bytes: p.guaranteed_bytes,
            host_limit_bytes: p.host_limit_bytes,
            turn_weight: p.turn_weight,
            clear_device_limits: p.clear_device_limits,
            device_limits: p
                .device_limits
                .into_iter()
                .map(|d| (d.device, d.limit_bytes))
                .collect(),
        }
    }
}

/// The broker's [`QuotaPatch`] as the wire patch.
pub fn patch_to_wire(p: QuotaPatch) -> pb::QuotaPatch {
    {
        pb::QuotaPatch {
            limit_bytes: p.limit_bytes,
            max_leases: p.max_leases,
            priority: p.priority,
            guaranteed_bytes: p.guaranteed_bytes,
            host_limit_bytes: p.host_limit_bytes,
            turn_weight: p.turn_weight,
            clear_device_limits: p.clear_device_limits,
            device_limits: p
                .device_limits
                .into_iter()
                .map(|(device, limit_bytes)| pb::DeviceLimit {
                    device,
                    limit_bytes,
                })
                .collect(),
        }
    }
}

/// A `SetQuota` request's change: the whole `quota`, or only the fields of `patch`.
pub fn quota_update(
    quota: Option<pb::Quota>,
    patch: Option<pb::QuotaPatch>,
) -> Result<QuotaUpdate, BrokerError> {
    match (quota, patch) {
        (Some(_), Some(_)) => Err(BrokerError::InvalidArgument(
            "give either quota (replace) or patch (change some fields), not both".into(),
        )),
        (Some(q), None) => Ok(QuotaUpdate::Replace(quota_from_wire(q))),
        (None, Some(p)) => {
            let patch = patch_from_wire(p);
            if patch.is_empty() {
                return Err(BrokerError::InvalidArgument(
                    "the quota patch changes nothing: give at least one field".into(),
                ));
            }
            Ok(QuotaUpdate::Patch(patch))
        }
        (None, None) => Err(BrokerError::InvalidArgument(
            "quota or patch is required".into(),
        )),
    }
}

pub fn usage(u: &Usage, t: &TenantView) -> pb::Usage {
    pb::Usage {
        held_bytes: u.held_bytes,
        lease_count: u.lease_count,
        borrowed_bytes: t.borrowed_bytes,
        quarantined_bytes: u.quarantined_bytes,
        host_held_bytes: u.host_held_bytes,
        session_count: t.sessions,
        waiting_requests: t.waiting,
        queue_position: t.queue_position,
        turns: t.turns.turns,
        compute_ms: t.turns.compute.as_millis() as u64,
        overrun_ms: t.turns.overrun.as_millis() as u64,
        device_committed_bytes: t.device_bytes.clone().into_iter().collect(),
        process_reserved_bytes: u.process_reserved_bytes,
        process_reservations: u.process_reservations,
    }
}

pub fn tenant(t: &TenantView) -> pb::TenantInfo {
    pb::TenantInfo {
        name: t.name.clone(),
        quota: Some(quota_to_wire(t.quota.clone())),
        usage: Some(usage(&t.usage, t)),
        token_count: t.tokens,
    }
}

pub fn token(t: &TokenEntry, last_used: Option<i64>) -> pb::TokenInfo {
    pb::TokenInfo {
        token_id: t.token_id.clone(),
        tenant: t.tenant.clone(),
        description: t.description.clone(),
        created_unix_ms: t.created_unix_ms,
        name: t.name.clone(),
        scope: scope(t.scope) as i32,
        expires_unix_ms: t.expires_unix_ms.unwrap_or(0),
        last_used_unix_ms: last_used.unwrap_or(0),
    }
}

pub fn scope(s: Scope) -> pb::TokenScope {
    match s {
        Scope::Worker => pb::TokenScope::Worker,
        Scope::Read => pb::TokenScope::Read,
        Scope::Admin => pb::TokenScope::Admin,
    }
}

pub fn scope_from(v: i32) -> Result<Scope, BrokerError> {
    match pb::TokenScope::try_from(v) {
        Ok(pb::TokenScope::Unspecified | pb::TokenScope::Worker) => Ok(Scope::Worker),
        Ok(pb::TokenScope::Read) => Ok(Scope::Read),
        Ok(pb::TokenScope::Admin) => Ok(Scope::Admin),
        Err(_) => Err(BrokerError::InvalidArgument(format!(
            "unknown token scope {v}"
        ))),
    }
}

pub fn audit_entry(r: &AuditRecord) -> pb::AuditEntry {
    let json =
        |v: &Option<serde_json::Value>| v.as_ref().map(|v| v.to_string()).unwrap_or_default();
    pb::AuditEntry {
        seq: r.seq,
        unix_ms: r.unix_ms,
        token_id: r.who.token_id.clone(),
        token_name: r.who.name.clone(),
        scope: r.who.scope.clone(),
        peer_uid: r.who.peer_uid,
        peer_pid: r.who.peer_pid,
        action: r.action.clone(),
        tenant: r.tenant.clone(),
        target: r.target.clone(),
        before_json: json(&r.before),
        after_json: json(&r.after),
    }
}

pub fn session(s: &SessionView) -> pb::SessionInfo {
    pb::SessionInfo {
        session_id: s.id.to_string(),
        tenant: s.tenant.clone(),
        name: s.name.clone(),
        peer_pid: s.pid.unwrap_or(0),
        peer_uid: s.uid.unwrap_or(0),
        opened_unix_ms: unix_ms(s.opened),
        lease_count: s.lease_count,
        held_bytes: s.held_bytes,
        transport: if s.unix { "unix" } else { "tcp" }.into(),
        gpu_used_bytes: s.gpu.map(|g| g.used).unwrap_or(0),
        own_alloc_bytes: s.gpu.map(|g| g.own).unwrap_or(0),
        over_allowance: s.gpu.is_some_and(|g| g.over),
        process_reserved_bytes: s.process_reserved,
    }
}

pub fn device(d: &DeviceReport) -> pb::DeviceInfo {
    pb::DeviceInfo {
        index: d.index,
        name: d.name.clone(),
        backend: d.backend.clone(),
        total_bytes: d.total,
        free_bytes: d.free,
        leasable_bytes: d.leasable,
        leased_bytes: d.leased,
        cached_bytes: d.cached,
        headroom_bytes: d.headroom,
        quarantined_bytes: d.quarantined,
        external_used_bytes: d.external_used,
        granularity_bytes: d.granularity,
        lease_count: d.lease_count,
        waiting_requests: d.waiting,
        turn_holder: d.turn_holder.clone().unwrap_or_default(),
        turns_waiting: d.turns_waiting,
        uuid: d.uuid.clone(),
        model: d.model.clone(),
        draining: d.drain_reason.is_some(),
        drain_reason: d.drain_reason.clone().unwrap_or_default(),
        unhealthy: d.fault.is_some(),
        health_reason: d.fault.clone().unwrap_or_default(),
        process_reserved_bytes: d.process_reserved,
        // Filled by the admin service from the MPS supervisor and the turn scheduler.
        ..Default::default()
    }
}

pub fn drain_report(r: &DrainReport) -> pb::DrainResponse {
    let ms = |t: Option<SystemTime>| t.map(unix_ms).unwrap_or(0);
    pb::DrainResponse {
        complete: r.complete(),
        devices: r
            .devices
            .iter()
            .map(|d| pb::DeviceDrain {
                index: d.index,
                uuid: d.uuid.clone(),
                draining: d.draining,
                since_unix_ms: ms(d.since),
                deadline_unix_ms: ms(d.deadline),
                reason: d.reason.clone(),
                leases: d.leases,
                bytes: d.bytes,
                reclaim_requested: d.reclaim_requested,
                not_reclaimable: d.not_reclaimable,
                quarantined_bytes: d.quarantined_bytes,
            })
            .collect(),
    }
}

/// Milliseconds since the epoch, for event payloads.
pub fn now_ms() -> i64 {
    unix_ms(SystemTime::now())
}

/// An optional tenant filter: empty means all.
pub fn filter(s: &str) -> Option<&str> {
    if s.is_empty() {
        None
    } else {
        Some(s)
    }
}

pub fn info(i: &crate::info::BrokerInfo) -> pb::GetInfoResponse {
    pb::GetInfoResponse {
        version: i.version.to_string(),
        api_revision: i.api_revision,
        backend: i.backend.clone(),
        device_count: i.device_count,
        features: i.features.iter().map(|f| f.to_string()).collect(),
        device_uuids: i.device_uuids.clone(),
        started_unix_ms: crate::units::unix_ms(i.started),
        keeper: i.keeper,
        restart: i.restart.as_ref().map(|r| pb::RestartInfo {
            sessions_adopted: r.sessions_adopted as u32,
            sessions_reclaimed: r.sessions_reclaimed as u32,
            leases_adopted: r.leases_adopted as u32,
            leases_reclaimed: r.leases_reclaimed as u32,
            bytes_adopted: r.bytes_adopted,
            held_adopted: r.held_adopted as u32,
            held_let_go: r.held_let_go as u32,
            lingering_adopted: r.lingering_adopted as u32,
            lingering_ended: r.lingering_ended as u32,
            stranded_adopted: r.stranded_adopted as u32,
            stranded_bytes: r.stranded_bytes,
            stranded_lifted: r.stranded_lifted as u32,
            took_ms: r.took.as_millis() as u64,
            phases: r
                .phases
                .iter()
                .map(|p| pb::RestartPhase {
                    name: p.name.clone(),
                    micros: p.took.as_micros() as u64,
                })
                .collect(),
        }),
    }
}

pub fn reservation(r: &crate::reservations::ReservationView) -> pb::ProcessReservation {
    pb::ProcessReservation {
        reservation_id: r.id.to_string(),
        session_id: r.session.to_string(),
        tenant: r.tenant.clone(),
        device: r.device,
        device_uuid: r.device_uuid.clone(),
        bytes: r.bytes,
        requested_bytes: r.requested_bytes,
        drawn_bytes: r.drawn_bytes,
        label: r.label.clone(),
        pid: r.pid.unwrap_or(0),
        created_unix_ms: r.created.map(unix_ms).unwrap_or(0),
    }
}

/// A claim reservation (`Admin.ReserveClaim`, `ListClaims`).
pub fn claim(
    c: &crate::reservations::ClaimBinding,
    r: &crate::reservations::ReservationView,
) -> pb::ClaimReservation {
    pb::ClaimReservation {
        claim: c.uid.clone(),
        reservation_id: r.id.to_string(),
        tenant: r.tenant.clone(),
        device: r.device,
        device_uuid: r.device_uuid.clone(),
        bytes: r.bytes,
        drawn_bytes: r.drawn_bytes,
        label: r.label.clone(),
        created_unix_ms: r.created.map(unix_ms).unwrap_or(0),
        token_id: c.token_id.clone(),
    }
}

/// Who is behind an operator request, for the audit log: read from the request at the
/// edge, so the audit records name no transport.
impl crate::audit::Who {
    /// The caller of a request: its principal (put there by the gate) and peer.
    pub fn of<T>(req: &tonic::Request<T>) -> Self {
        let p = req.extensions().get::<crate::auth::Principal>();
        let cred = req
            .extensions()
            .get::<tonic::transport::server::UdsConnectInfo>()
            .and_then(|i| i.peer_cred);
        Self {
            token_id: p.map(|p| p.token_id.clone()).unwrap_or_default(),
            name: p.map(|p| p.name.clone()).unwrap_or_default(),
            scope: p.map(|p| p.scope.as_str().to_string()).unwrap_or_default(),
            peer_uid: cred.map(|c| c.uid()),
            peer_pid: cred
                .and_then(|c| c.pid())
                .and_then(|p| u32::try_from(p).ok()),
        }
    }
}
