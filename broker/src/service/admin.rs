//! The `Admin` service (operators): quotas, tenants, tokens, leases, sessions, devices.
//! Thin: the interceptor admitted only the admin; this converts and delegates.

use super::convert::{self, filter, parse_id};
use crate::arbiter::Arbiter;
use gpu_broker_proto::v1 as pb;
use gpu_broker_proto::v1::admin_server::Admin;
use std::sync::Arc;
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
        let r = req.into_inner();
        let update = convert::quota_update(r.quota, r.patch)?;
        let c = self.arb.change_quota(&r.tenant, update)?;
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
        let t = self.arb.get_tenant(&req.get_ref().tenant)?;
        Ok(Response::new(pb::GetQuotaResponse {
            tenant: Some(convert::tenant(&t)),
        }))
    }

    async fn list_tenants(
        &self,
        _req: Request<pb::ListTenantsRequest>,
    ) -> Result<Response<pb::ListTenantsResponse>, Status> {
        Ok(Response::new(pb::ListTenantsResponse {
            tenants: self
                .arb
                .list_tenants()
                .iter()
                .map(convert::tenant)
                .collect(),
        }))
    }

    async fn delete_tenant(
        &self,
        req: Request<pb::DeleteTenantRequest>,
    ) -> Result<Response<pb::DeleteTenantResponse>, Status> {
        self.arb.delete_tenant(&req.get_ref().tenant)?;
        Ok(Response::new(pb::DeleteTenantResponse {}))
    }

    async fn issue_token(
        &self,
        req: Request<pb::IssueTokenRequest>,
    ) -> Result<Response<pb::IssueTokenResponse>, Status> {
        let r = req.into_inner();
        let (token, token_id) = self.arb.issue_token(&r.tenant, &r.description)?;
        Ok(Response::new(pb::IssueTokenResponse {
            token,
            token_id,
            tenant: r.tenant,
        }))
    }

    async fn revoke_token(
        &self,
        req: Request<pb::RevokeTokenRequest>,
    ) -> Result<Response<pb::RevokeTokenResponse>, Status> {
        let r = req.into_inner();
        let key = if r.token_id.is_empty() {
            r.token
        } else {
            r.token_id
        };
        if key.is_empty() {
            return Err(Status::invalid_argument("token_id or token is required"));
        }
        self.arb.revoke_token(&key)?;
        Ok(Response::new(pb::RevokeTokenResponse {}))
    }

    async fn list_tokens(
        &self,
        req: Request<pb::ListTokensRequest>,
    ) -> Result<Response<pb::ListTokensResponse>, Status> {
        let tenant = filter(&req.get_ref().tenant);
        self.arb.check_tenant_filter(tenant)?;
        let tokens = self.arb.list_tokens(tenant);
        Ok(Response::new(pb::ListTokensResponse {
            tokens: tokens.iter().map(convert::token).collect(),
        }))
    }

    async fn list_all_leases(
        &self,
        req: Request<pb::ListAllLeasesRequest>,
    ) -> Result<Response<pb::ListAllLeasesResponse>, Status> {
        let tenant = filter(&req.get_ref().tenant);
        self.arb.check_tenant_filter(tenant)?;
        let leases = self.arb.list_all_leases(tenant);
        Ok(Response::new(pb::ListAllLeasesResponse {
            leases: leases
                .iter()
                .map(|l| convert::lease_on(l, &self.arb))
                .collect(),
        }))
    }

    async fn revoke_lease(
        &self,
        req: Request<pb::RevokeLeaseRequest>,
    ) -> Result<Response<pb::RevokeLeaseResponse>, Status> {
        let r = req.into_inner();
        let id = parse_id("lease_id", &r.lease_id)?;
        let reason = if r.reason.is_empty() {
            "revoked by an operator".to_string()
        } else {
            r.reason
        };
        let lease = self.arb.revoke(id, &reason)?;
        Ok(Response::new(pb::RevokeLeaseResponse {
            lease: Some(convert::lease_on(&lease, &self.arb)),
        }))
    }

    async fn list_sessions(
        &self,
        req: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        let tenant = filter(&req.get_ref().tenant);
        self.arb.check_tenant_filter(tenant)?;
        let sessions = self.arb.list_sessions(tenant);
        Ok(Response::new(pb::ListSessionsResponse {
            sessions: sessions.iter().map(convert::session).collect(),
        }))
    }

    async fn get_devices(
        &self,
        _req: Request<pb::GetDevicesRequest>,
    ) -> Result<Response<pb::GetDevicesResponse>, Status> {
        let devices = self.arb.devices().await;
        Ok(Response::new(pb::GetDevicesResponse {
            devices: devices.iter().map(convert::device).collect(),
        }))
    }
}
