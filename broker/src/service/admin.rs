//! The `Admin` service (operators): quotas, tenants, tokens, leases, sessions, devices.
//! Thin: the interceptor admitted only the admin; this converts and delegates.

use super::convert::{self, filter, parse_id};
use crate::arbiter::claims::ClaimRequest;
use crate::arbiter::listing::page_size;
use crate::arbiter::tokens::TokenSpec;
use crate::arbiter::Arbiter;
use crate::audit::{AuditFilter, Who};
use crate::bounds;
use crate::grpc_status::status;
use crate::reservations::ClaimBinding;
use gpu_broker_proto::v1 as pb;
use gpu_broker_proto::v1::admin_server::Admin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tonic::{Request, Response, Status};

/// The operator-facing service.
pub struct AdminService {
    arb: Arc<Arbiter>,
}

impl AdminService {
    pub fn new(arb: Arc<Arbiter>) -> AdminService {
        AdminService { arb }
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn set_quota(
        &self,
        req: Request<pb::SetQuotaRequest>,
    ) -> Result<Response<pb::SetQuotaResponse>, Status> {
        let who = Who::of(&req);
        let r = req.into_inner();
        bounds::tenant("tenant", &r.tenant).map_err(status)?;
        let update = convert::quota_update(r.quota, r.patch).map_err(status)?;
        // Committed with its audit record, on the store writer.
        let c = self
            .arb
            .changes()
            .run(move |arb| {
                arb.changes()
                    .change_quota(&r.tenant, update, Some((&who, "quota.set", "")))
            })
            .await
            .map_err(status)?;
        Ok(Response::new(pb::SetQuotaResponse {
            tenant: Some(convert::tenant(&c.tenant)),
            created: c.created,
            warnings: c.warnings,
        }))
    }

    async fn get_quota(
        &self,
        req: Request<pb::GetQuotaRequest>,
    ) -> Result<Response<pb::GetQuotaResponse>, Status> {
        bounds::tenant("tenant", &req.get_ref().tenant).map_err(status)?;
        let t = self
            .arb
            .views()
            .tenant(&req.get_ref().tenant)
            .map_err(status)?;
        Ok(Response::new(pb::GetQuotaResponse {
            tenant: Some(convert::tenant(&t)),
        }))
    }

    async fn list_tenants(
        &self,
        req: Request<pb::ListTenantsRequest>,
    ) -> Result<Response<pb::ListTenantsResponse>, Status> {
        let r = req.get_ref();
        let page = self
            .arb
            .views()
            .tenants_page(&r.page_token, page_size(r.page_size))
            .map_err(status)?;
        Ok(Response::new(pb::ListTenantsResponse {
            tenants: page.items.iter().map(convert::tenant).collect(),
            next_page_token: page.next.unwrap_or_default(),
        }))
    }

    async fn delete_tenant(
        &self,
        req: Request<pb::DeleteTenantRequest>,
    ) -> Result<Response<pb::DeleteTenantResponse>, Status> {
        bounds::tenant("tenant", &req.get_ref().tenant).map_err(status)?;
        let who = Who::of(&req);
        // Committed with its audit record, on the store writer.
        let name = req.into_inner().tenant;
        self.arb
            .changes()
            .run(move |arb| arb.changes().delete_tenant(&name, Some(&who)))
            .await
            .map_err(status)?;
        Ok(Response::new(pb::DeleteTenantResponse {}))
    }

    async fn issue_token(
        &self,
        req: Request<pb::IssueTokenRequest>,
    ) -> Result<Response<pb::IssueTokenResponse>, Status> {
        let who = Who::of(&req);
        let r = req.into_inner();
        bounds::tenant("tenant", &r.tenant).map_err(status)?;
        bounds::check("description", &r.description, bounds::MAX_TEXT_BYTES).map_err(status)?;
        if crate::arbiter::claims::claim_of_token_name(&r.name).is_some() {
            // Claims' tokens are minted with their reservation (ReserveClaim) and bound by it.
            return Err(status(crate::error::BrokerError::TokenNameReserved {
                prefix: crate::arbiter::claims::CLAIM_TOKEN_PREFIX,
            }));
        }
        let spec = TokenSpec {
            tenant: filter(&r.tenant).map(str::to_string),
            scope: convert::scope_from(r.scope).map_err(status)?,
            ttl: r.ttl_ms.map(Duration::from_millis),
            name: r.name,
            description: r.description,
        };
        // Committed with its audit record, on the store writer.
        let issued = self
            .arb
            .changes()
            .run(move |arb| arb.changes().issue_token(spec, Some(&who)))
            .await
            .map_err(status)?;
        let e = &issued.entry;
        Ok(Response::new(pb::IssueTokenResponse {
            token: issued.token.clone(),
            token_id: e.token_id.clone(),
            tenant: e.tenant.clone(),
            expires_unix_ms: e.expires_unix_ms.unwrap_or(0),
            scope: convert::scope(e.scope) as i32,
            name: e.name.clone(),
        }))
    }

    async fn revoke_token(
        &self,
        req: Request<pb::RevokeTokenRequest>,
    ) -> Result<Response<pb::RevokeTokenResponse>, Status> {
        let who = Who::of(&req);
        let r = req.into_inner();
        bounds::check("token", &r.token, bounds::MAX_TOKEN_BYTES).map_err(status)?;
        bounds::check("token_id", &r.token_id, bounds::MAX_TOKEN_BYTES).map_err(status)?;
        let key = if r.token_id.is_empty() {
            r.token
        } else {
            r.token_id
        };
        if key.is_empty() {
            return Err(Status::invalid_argument("token_id or token is required"));
        }
        // Committed with its audit record, on the store writer.
        self.arb
            .changes()
            .run(move |arb| arb.changes().revoke_token(&key, Some(&who)))
            .await
            .map_err(status)?;
        Ok(Response::new(pb::RevokeTokenResponse {}))
    }

    async fn list_tokens(
        &self,
        req: Request<pb::ListTokensRequest>,
    ) -> Result<Response<pb::ListTokensResponse>, Status> {
        bounds::tenant("tenant", &req.get_ref().tenant).map_err(status)?;
        let tenant = filter(&req.get_ref().tenant);
        self.arb
            .views()
            .check_tenant_filter(tenant)
            .map_err(status)?;
        let tokens = self.arb.authenticator().list(tenant);
        Ok(Response::new(pb::ListTokensResponse {
            tokens: tokens
                .iter()
                .map(|t| convert::token(t, self.arb.authenticator().last_used(&t.hash)))
                .collect(),
        }))
    }

    async fn list_all_leases(
        &self,
        req: Request<pb::ListAllLeasesRequest>,
    ) -> Result<Response<pb::ListAllLeasesResponse>, Status> {
        bounds::tenant("tenant", &req.get_ref().tenant).map_err(status)?;
        let tenant = filter(&req.get_ref().tenant);
        self.arb
            .views()
            .check_tenant_filter(tenant)
            .map_err(status)?;
        let r = req.get_ref();
        let page = self
            .arb
            .views()
            .leases_page(tenant, &r.page_token, page_size(r.page_size))
            .map_err(status)?;
        Ok(Response::new(pb::ListAllLeasesResponse {
            leases: page
                .items
                .iter()
                .map(|l| convert::lease_on(l, &self.arb))
                .collect(),
            next_page_token: page.next.unwrap_or_default(),
        }))
    }

    async fn revoke_lease(
        &self,
        req: Request<pb::RevokeLeaseRequest>,
    ) -> Result<Response<pb::RevokeLeaseResponse>, Status> {
        let who = Who::of(&req);
        let r = req.into_inner();
        let id = parse_id("lease_id", &r.lease_id).map_err(status)?;
        bounds::check("reason", &r.reason, bounds::MAX_REASON_BYTES).map_err(status)?;
        let reason = if r.reason.is_empty() {
            "revoked by an operator".to_string()
        } else {
            r.reason
        };
        let why = crate::arbiter::state::Revoke::Operator(reason);
        let lease = self.arb.revoke(id, &why).map_err(status)?;
        self.arb.changes().audit(
            &who,
            "lease.revoke",
            &lease.tenant,
            &lease.id.to_string(),
            Some(serde_json::json!({"bytes": lease.bytes, "device": lease.device, "session": lease.session.to_string()})),
            Some(serde_json::json!({"state": "revoked", "reason": why.reason()})),
        );
        self.arb.changes().audits_written().await;
        Ok(Response::new(pb::RevokeLeaseResponse {
            lease: Some(convert::lease_on(&lease, &self.arb)),
        }))
    }

    async fn list_sessions(
        &self,
        req: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        bounds::tenant("tenant", &req.get_ref().tenant).map_err(status)?;
        let tenant = filter(&req.get_ref().tenant);
        self.arb
            .views()
            .check_tenant_filter(tenant)
            .map_err(status)?;
        let r = req.get_ref();
        let page = self
            .arb
            .views()
            .sessions_page(tenant, &r.page_token, page_size(r.page_size))
            .map_err(status)?;
        Ok(Response::new(pb::ListSessionsResponse {
            sessions: page.items.iter().map(convert::session).collect(),
            next_page_token: page.next.unwrap_or_default(),
        }))
    }

    async fn get_devices(
        &self,
        _req: Request<pb::GetDevicesRequest>,
    ) -> Result<Response<pb::GetDevicesResponse>, Status> {
        let devices = self.arb.views().device_reports().await;
        let mut devices: Vec<pb::DeviceInfo> = devices.iter().map(convert::device).collect();
        for d in &mut devices {
            d.turn_holders = self.arb.scheduler.holders(d.index);
        }
        if let Some(mps) = self.arb.lifecycle().mps() {
            super::mps_report::fill(&mps.status(), &mut devices);
        } else {
            let modes = self.arb.lifecycle().compute_modes();
            for d in &mut devices {
                d.compute_mode = modes.get(d.index as usize).cloned().unwrap_or_default();
            }
        }
        Ok(Response::new(pb::GetDevicesResponse { devices }))
    }

    async fn rotate_admin_token(
        &self,
        req: Request<pb::RotateAdminTokenRequest>,
    ) -> Result<Response<pb::RotateAdminTokenResponse>, Status> {
        let who = Who::of(&req);
        let grace = Duration::from_millis(req.get_ref().grace_ms);
        // It writes and syncs the token file: off the runtime.
        let arb = self.arb.clone();
        let token = tokio::task::spawn_blocking(move || {
            crate::admin_token::rotate(arb.authenticator(), grace)
        })
        .await
        .map_err(|e| Status::internal(format!("rotating the admin token: {e}")))?
        .map_err(status)?;
        self.arb.changes().audit(
            &who,
            "admin_token.rotate",
            "",
            crate::auth::ADMIN_FILE_TOKEN_ID,
            None,
            Some(serde_json::json!({"old_token_grace_ms": req.get_ref().grace_ms})),
        );
        self.arb.changes().audits_written().await;
        Ok(Response::new(pb::RotateAdminTokenResponse {
            token,
            old_valid_until_unix_ms: convert::unix_ms(SystemTime::now() + grace),
        }))
    }

    async fn list_audit(
        &self,
        req: Request<pb::ListAuditRequest>,
    ) -> Result<Response<pb::ListAuditResponse>, Status> {
        let r = req.into_inner();
        let records = self
            .arb
            .durable
            .list_audit(&AuditFilter {
                since_unix_ms: r.since_unix_ms,
                tenant: filter(&r.tenant).map(str::to_string),
                limit: r.limit as usize,
            })
            .map_err(status)?;
        Ok(Response::new(pb::ListAuditResponse {
            entries: records.iter().map(convert::audit_entry).collect(),
        }))
    }

    async fn drain(
        &self,
        req: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainResponse>, Status> {
        let who = Who::of(&req);
        let r = req.into_inner();
        let before = self.arb.drains().report();
        let report = self
            .arb
            .drains()
            .start(
                r.device,
                r.deadline_ms.map(Duration::from_millis),
                &r.reason,
            )
            .map_err(status)?;
        self.arb.changes().audit(
            &who,
            "drain.start",
            "",
            &r.device.map(|d| d.to_string()).unwrap_or_else(|| "node".into()),
            Some(serde_json::json!({"draining": before.devices.iter().filter(|d| d.draining).map(|d| d.index).collect::<Vec<_>>()})),
            Some(serde_json::json!({"draining": report.devices.iter().filter(|d| d.draining).map(|d| d.index).collect::<Vec<_>>(), "deadline_ms": r.deadline_ms, "reason": r.reason})),
        );
        self.arb.changes().audits_written().await;
        Ok(Response::new(convert::drain_report(&report)))
    }

    async fn undrain(
        &self,
        req: Request<pb::UndrainRequest>,
    ) -> Result<Response<pb::DrainResponse>, Status> {
        let who = Who::of(&req);
        let device = req.get_ref().device;
        let before = self.arb.drains().report();
        let report = self.arb.drains().undrain(device).map_err(status)?;
        self.arb.changes().audit(
            &who,
            "drain.stop",
            "",
            &device.map(|d| d.to_string()).unwrap_or_else(|| "node".into()),
            Some(serde_json::json!({"draining": before.devices.iter().filter(|d| d.draining).map(|d| d.index).collect::<Vec<_>>()})),
            Some(serde_json::json!({"draining": report.devices.iter().filter(|d| d.draining).map(|d| d.index).collect::<Vec<_>>()})),
        );
        self.arb.changes().audits_written().await;
        Ok(Response::new(convert::drain_report(&report)))
    }

    async fn get_drain(
        &self,
        _req: Request<pb::GetDrainRequest>,
    ) -> Result<Response<pb::DrainResponse>, Status> {
        Ok(Response::new(convert::drain_report(
            &self.arb.drains().report(),
        )))
    }

    async fn list_shared_leases(
        &self,
        req: Request<pb::AdminListSharedLeasesRequest>,
    ) -> Result<Response<pb::AdminListSharedLeasesResponse>, Status> {
        Ok(Response::new(
            super::shared::list_all(&self.arb, req.get_ref()).map_err(status)?,
        ))
    }

    async fn reserve_claim(
        &self,
        req: Request<pb::ReserveClaimRequest>,
    ) -> Result<Response<pb::ReserveClaimResponse>, Status> {
        let who = Who::of(&req);
        let r = req.into_inner();
        bounds::tenant("tenant", &r.tenant).map_err(status)?;
        bounds::check("claim", &r.claim, crate::arbiter::claims::MAX_CLAIM_UID).map_err(status)?;
        bounds::check("label", &r.label, bounds::MAX_TEXT_BYTES).map_err(status)?;
        let uid = r.claim.clone();
        let g = self
            .arb
            .claims()
            .reserve(
                ClaimRequest {
                    uid: r.claim,
                    tenant: r.tenant,
                    bytes: r.bytes,
                    device: r.device,
                    label: r.label,
                },
                who,
            )
            .await
            .map_err(status)?;
        let binding = ClaimBinding {
            uid,
            token_id: g.token_id.clone(),
        };
        Ok(Response::new(pb::ReserveClaimResponse {
            reservation: Some(convert::claim(&binding, &g.reservation)),
            token: g.token,
            mps_env: g.reservation.env.iter().cloned().collect(),
        }))
    }

    async fn release_claim(
        &self,
        req: Request<pb::ReleaseClaimRequest>,
    ) -> Result<Response<pb::ReleaseClaimResponse>, Status> {
        let who = Who::of(&req);
        let r = req.into_inner();
        bounds::check("claim", &r.claim, crate::arbiter::claims::MAX_CLAIM_UID).map_err(status)?;
        if r.claim.is_empty() {
            return Err(Status::invalid_argument("claim is required"));
        }
        self.arb
            .claims()
            .release(&r.claim, who)
            .await
            .map_err(status)?;
        Ok(Response::new(pb::ReleaseClaimResponse {}))
    }

    async fn list_claims(
        &self,
        _req: Request<pb::ListClaimsRequest>,
    ) -> Result<Response<pb::ListClaimsResponse>, Status> {
        let claims = self.arb.claims().list();
        Ok(Response::new(pb::ListClaimsResponse {
            claims: claims.iter().map(|(c, r)| convert::claim(c, r)).collect(),
        }))
    }

    async fn list_quarantined(
        &self,
        _req: Request<pb::ListQuarantinedRequest>,
    ) -> Result<Response<pb::ListQuarantinedResponse>, Status> {
        let blocks = self
            .arb
            .views()
            .quarantined()
            .iter()
            .map(|q| pb::QuarantinedBlock {
                lease_id: q.lease.to_string(),
                tenant: q.tenant.clone(),
                device: q.device,
                bytes: q.bytes,
                pid: q.pid.unwrap_or(0),
                since_unix_ms: convert::unix_ms(q.since),
                reason: match q.reason {
                    crate::views::HoldReason::Holder => pb::HoldReason::Holder,
                    crate::views::HoldReason::Importers => pb::HoldReason::Importers,
                    crate::views::HoldReason::Recipients => pb::HoldReason::Recipients,
                    crate::views::HoldReason::KeptAfterFree => pb::HoldReason::KeptAfterFree,
                } as i32,
                holder_pids: q.holders.clone(),
                publication_id: q.publication.map(|p| p.0.to_string()).unwrap_or_default(),
                importers: q
                    .publication
                    .map(|p| u32::try_from(p.1).unwrap_or(u32::MAX))
                    .unwrap_or(0),
            })
            .collect();
        Ok(Response::new(pb::ListQuarantinedResponse { blocks }))
    }

    async fn set_device_health(
        &self,
        req: Request<pb::SetDeviceHealthRequest>,
    ) -> Result<Response<pb::SetDeviceHealthResponse>, Status> {
        let who = Who::of(&req);
        let r = req.into_inner();
        let changed = self
            .arb
            .device_health()
            .set(r.device, r.healthy, &r.reason, &who)
            .map_err(status)?;
        self.arb.changes().audits_written().await;
        Ok(Response::new(pb::SetDeviceHealthResponse { changed }))
    }

    async fn get_info(
        &self,
        _req: Request<pb::GetInfoRequest>,
    ) -> Result<Response<pb::GetInfoResponse>, Status> {
        Ok(Response::new(convert::info(&crate::info::BrokerInfo::of(
            &self.arb,
        ))))
    }
}
