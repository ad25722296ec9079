//! The shared-lease calls of the `Broker` service (publish, unpublish, import, release an
//! import, list) and `Admin.ListSharedLeases`, as plain functions the service impls
//! delegate to: check the caller, call the arbiter, convert. An import's descriptor goes
//! through the ticket socket like a lease's (`handles::fd_handle_of`).

use super::convert::{self, parse_id};
use crate::arbiter::listing::{self, SharedViewer};
use crate::arbiter::{Arbiter, ImportGrant};
use crate::error::BrokerError;
use crate::fd::handles;
use crate::session::Peer;
use crate::sharing::SharedView;
use gpu_broker_proto::v1 as pb;
use std::sync::Arc;

/// The proto form of a publication.
pub fn shared(v: &SharedView, arb: &Arbiter) -> pb::SharedLease {
    pb::SharedLease {
        publication_id: v.id.to_string(),
        publisher: v.publisher.clone(),
        name: v.name.clone().unwrap_or_default(),
        lease_id: v.lease.map(|l| l.to_string()).unwrap_or_default(),
        device: v.device,
        device_uuid: arb.devices().uuid(v.device),
        bytes: v.bytes,
        memory_kind: convert::memory_kind(v.kind) as i32,
        tenants: v.readers.clone(),
        published: v.name.is_some(),
        published_unix_ms: convert::unix_ms(v.published_at),
        read_only_enforced: v.enforced,
        imports: v
            .imports
            .iter()
            .map(|i| pb::SharedImport {
                import_id: i.id.to_string(),
                tenant: i.tenant.clone(),
                session_id: i.session.to_string(),
                pid: i.pid.unwrap_or(0),
                imported_unix_ms: convert::unix_ms(i.created),
                lingering: i.lingering,
            })
            .collect(),
        import_count: u32::try_from(v.import_count).unwrap_or(u32::MAX),
    }
}

/// `PublishLease`.
pub fn publish(
    arb: &Arbiter,
    tenant: &str,
    r: &pb::PublishLeaseRequest,
) -> Result<pb::PublishLeaseResponse, BrokerError> {
    let lease = parse_id("lease_id", &r.lease_id)?;
    let v = arb.sharing().publish(tenant, lease, &r.name, &r.tenants)?;
    Ok(pb::PublishLeaseResponse {
        shared: Some(shared(&v, arb)),
    })
}

/// `UnpublishLease`.
pub fn unpublish(
    arb: &Arc<Arbiter>,
    tenant: &str,
    r: &pb::UnpublishLeaseRequest,
) -> Result<pb::UnpublishLeaseResponse, BrokerError> {
    let v = arb.sharing().unpublish(tenant, &r.name)?;
    Ok(pb::UnpublishLeaseResponse {
        shared: Some(shared(&v, arb)),
    })
}

/// The `FdHandle` of an import, with a fresh ticket bound to `caller`.
pub fn import_fd(
    arb: &Arbiter,
    g: &ImportGrant,
    caller: &Peer,
) -> Result<pb::FdHandle, BrokerError> {
    handles::fd_handle_of(arb, g.id, g.kind, &g.fd, g.block_id, g.size, caller)
}

/// `ImportLease`: the caller must be able to receive descriptors before anything changes.
pub fn import(
    arb: &Arc<Arbiter>,
    tenant: &str,
    caller: &Peer,
    r: &pb::ImportLeaseRequest,
) -> Result<pb::ImportLeaseResponse, BrokerError> {
    let session = parse_id("session_id", &r.session_id)?;
    handles::check_same_user(&arb.sessions().peer(tenant, session)?, caller)?;
    handles::check_fd_receivable(arb, caller)?;
    let g = arb
        .sharing()
        .import(tenant, session, &r.publisher, &r.name)?;
    let fd = match import_fd(arb, &g, caller) {
        Ok(fd) => fd,
        Err(e) => {
            let _ = arb.sharing().release_import(tenant, g.id);
            return Err(e);
        }
    };
    Ok(pb::ImportLeaseResponse {
        import_id: g.id.to_string(),
        shared: Some(shared(&g.shared, arb)),
        fd: Some(fd),
    })
}

/// `ReleaseImport`.
pub fn release_import(
    arb: &Arc<Arbiter>,
    tenant: &str,
    r: &pb::ReleaseImportRequest,
) -> Result<pb::ReleaseImportResponse, BrokerError> {
    let id = parse_id("import_id", &r.import_id)?;
    arb.sharing().release_import(tenant, id)?;
    Ok(pb::ReleaseImportResponse {})
}

/// `Broker.ListSharedLeases` (one page).
pub fn list_visible(
    arb: &Arbiter,
    tenant: &str,
    r: &pb::ListSharedLeasesRequest,
) -> Result<pb::ListSharedLeasesResponse, BrokerError> {
    let page = arb.views().shared_page(
        SharedViewer::Tenant(tenant),
        &r.page_token,
        listing::page_size(r.page_size),
    )?;
    Ok(pb::ListSharedLeasesResponse {
        shared: page.items.iter().map(|v| shared(v, arb)).collect(),
        next_page_token: page.next.unwrap_or_default(),
    })
}

/// `Admin.ListSharedLeases` (one page).
pub fn list_all(
    arb: &Arbiter,
    r: &pb::AdminListSharedLeasesRequest,
) -> Result<pb::AdminListSharedLeasesResponse, BrokerError> {
    let page = arb.views().shared_page(
        SharedViewer::Operator(convert::filter(&r.tenant)),
        &r.page_token,
        listing::page_size(r.page_size),
    )?;
    Ok(pb::AdminListSharedLeasesResponse {
        shared: page.items.iter().map(|v| shared(v, arb)).collect(),
        next_page_token: page.next.unwrap_or_default(),
    })
}

/// A renewed ticket for import `id` of `tenant` (`RenewLeaseTicket` names imports too).
pub fn renew_import(
    arb: &Arbiter,
    tenant: &str,
    id: uuid::Uuid,
    caller: &Peer,
) -> Result<Option<pb::FdHandle>, BrokerError> {
    match arb.sharing().own_import(tenant, id) {
        Ok((g, session)) => {
            handles::check_same_user(&session, caller)?;
            Ok(Some(import_fd(arb, &g, caller)?))
        }
        Err(BrokerError::NotFound(_)) => Ok(None),
        Err(e) => Err(e),
    }
}
