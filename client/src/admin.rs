//! The operator-facing client: one method per `Admin` RPC, taking and returning plain
//! domain types ([`TenantInfo`], [`QuotaSpec`], [`IssuedToken`], [`TokenInfo`],
//! [`LeaseInfo`], [`SessionInfo`], [`DeviceInfo`]). Calls carry the admin token as
//! `authorization: Bearer <token>`; a tenant token gets `PERMISSION_DENIED`.

use tonic::transport::Channel;

use gpu_broker_proto::v1 as pb;
use pb::admin_client::AdminClient as RawAdminClient;

use crate::audit::{AuditEntry, AuditFilter};
use crate::connect::{self, AuthChannel};
use crate::device::DeviceInfo;
use crate::drain::DrainStatus;
use crate::error::ClientError;
use crate::lease_info::LeaseInfo;
use crate::quarantine::QuarantinedBlock;
use crate::session_info::SessionInfo;
use crate::tenant::{QuotaChange, QuotaPatch, QuotaSpec, TenantInfo};
use crate::token::{IssuedToken, TokenInfo, TokenOptions};

/// A connection to the broker's admin service. Cheap to clone.
#[derive(Clone, Debug)]
pub struct AdminClient {
    admin: RawAdminClient<AuthChannel>,
}

fn tenant_of(tenant: Option<pb::TenantInfo>, rpc: &str) -> Result<TenantInfo, ClientError> {
    tenant
        .map(TenantInfo::from)
        .ok_or_else(|| ClientError::Protocol(format!("{rpc} reply carries no tenant")))
}

impl AdminClient {
    /// Connects now to `uri` with an admin token.
    pub async fn connect(
        uri: &str,
        admin_token: impl Into<String>,
    ) -> Result<AdminClient, ClientError> {
        AdminClient::connect_with(uri, admin_token, &connect::ConnectOptions::from_env()).await
    }

    /// [`AdminClient::connect`] with explicit TLS options (CA file, client certificate).
    pub async fn connect_with(
        uri: &str,
        admin_token: impl Into<String>,
        opts: &connect::ConnectOptions,
    ) -> Result<AdminClient, ClientError> {
        let transport = connect::connect_transport_with(uri, opts).await?;
        AdminClient::from_transport(transport, admin_token)
    }

    /// Uses an existing tonic channel (custom transports, tests).
    pub fn from_channel(
        channel: Channel,
        admin_token: impl Into<String>,
    ) -> Result<AdminClient, ClientError> {
        AdminClient::from_transport(channel, admin_token)
    }

    /// Uses an existing transport ([`connect::connect_transport_with`], or a channel).
    pub fn from_transport(
        transport: impl Into<connect::Transport>,
        admin_token: impl Into<String>,
    ) -> Result<AdminClient, ClientError> {
        let token = admin_token.into();
        Ok(AdminClient {
            admin: RawAdminClient::new(connect::authenticated(transport, &token)?),
        })
    }

    /// The generated gRPC client, authenticated, for calls this crate does not wrap.
    pub fn raw(&self) -> RawAdminClient<AuthChannel> {
        self.admin.clone()
    }

    /// Creates the tenant if new, else replaces its whole quota.
    pub async fn set_quota(
        &self,
        tenant: &str,
        quota: QuotaSpec,
    ) -> Result<TenantInfo, ClientError> {
        let reply = self
            .raw()
            .set_quota(pb::SetQuotaRequest {
                tenant: tenant.to_string(),
                quota: Some(quota.into()),
                patch: None,
            })
            .await?
            .into_inner();
        tenant_of(reply.tenant, "SetQuota")
    }

    /// Creates the tenant if new (then `patch` must give a limit), else changes only the
    /// fields `patch` gives. The reply says what the change means for what the tenant
    /// holds (warnings, e.g. a limit below its current usage).
    pub async fn patch_quota(
        &self,
        tenant: &str,
        patch: QuotaPatch,
    ) -> Result<QuotaChange, ClientError> {
        let reply = self
            .raw()
            .set_quota(pb::SetQuotaRequest {
                tenant: tenant.to_string(),
                quota: None,
                patch: Some(patch.into()),
            })
            .await?
            .into_inner();
        Ok(QuotaChange {
            tenant: tenant_of(reply.tenant, "SetQuota")?,
            created: reply.created,
            warnings: reply.warnings,
        })
    }

    /// One tenant's quota and usage.
    pub async fn get_quota(&self, tenant: &str) -> Result<TenantInfo, ClientError> {
        let reply = self
            .raw()
            .get_quota(pb::GetQuotaRequest {
                tenant: tenant.to_string(),
            })
            .await?
            .into_inner();
        tenant_of(reply.tenant, "GetQuota")
    }

    /// Every tenant with quota and usage (all pages).
    pub async fn list_tenants(&self) -> Result<Vec<TenantInfo>, ClientError> {
        crate::paging::all_pages(|token| async move { self.list_tenants_page(0, &token).await })
            .await
    }

    /// One page of tenants: `page_size` 0 is the broker's default; `page_token` empty for
    /// the first page, else the token the previous page returned. Returns the page and the
    /// next page's token (None on the last page).
    pub async fn list_tenants_page(
        &self,
        page_size: u32,
        page_token: &str,
    ) -> Result<(Vec<TenantInfo>, Option<String>), ClientError> {
        let reply = self
            .raw()
            .list_tenants(pb::ListTenantsRequest {
                page_size,
                page_token: page_token.to_string(),
            })
            .await?
            .into_inner();
        Ok((
            reply.tenants.into_iter().map(TenantInfo::from).collect(),
            Some(reply.next_page_token).filter(|t| !t.is_empty()),
        ))
    }

    /// Deletes a tenant (`FAILED_PRECONDITION` while it holds leases).
    pub async fn delete_tenant(&self, tenant: &str) -> Result<(), ClientError> {
        self.raw()
            .delete_tenant(pb::DeleteTenantRequest {
                tenant: tenant.to_string(),
            })
            .await?;
        Ok(())
    }

    /// Issues a new bearer token for `tenant`.
    pub async fn issue_token(
        &self,
        tenant: &str,
        description: &str,
    ) -> Result<IssuedToken, ClientError> {
        self.issue_token_with(
            Some(tenant),
            &TokenOptions {
                description: description.to_string(),
                ..Default::default()
            },
        )
        .await
    }

    /// Issues a token of a scope, with an optional time to live and a name. `tenant` is
    /// required for worker tokens, optional for read tokens (`None`: node-wide) and
    /// absent for admin tokens.
    pub async fn issue_token_with(
        &self,
        tenant: Option<&str>,
        opts: &TokenOptions,
    ) -> Result<IssuedToken, ClientError> {
        let ttl_ms = match opts.ttl {
            None => None,
            Some(d) => Some(u64::try_from(d.as_millis()).map_err(|_| {
                ClientError::InvalidArgument(format!("ttl {d:?} is too long").into())
            })?),
        };
        let reply = self
            .raw()
            .issue_token(pb::IssueTokenRequest {
                tenant: tenant.unwrap_or_default().to_string(),
                description: opts.description.clone(),
                scope: opts.scope.to_proto() as i32,
                ttl_ms,
                name: opts.name.clone(),
            })
            .await?
            .into_inner();
        Ok(IssuedToken::from(reply))
    }

    /// Replaces the broker's admin token file's token with a new one and returns it with
    /// the instant (ms since the epoch) the old one stops working (`grace` from now).
    pub async fn rotate_admin_token(
        &self,
        grace: std::time::Duration,
    ) -> Result<(String, i64), ClientError> {
        let reply = self
            .raw()
            .rotate_admin_token(pb::RotateAdminTokenRequest {
                grace_ms: u64::try_from(grace.as_millis()).unwrap_or(u64::MAX),
            })
            .await?
            .into_inner();
        Ok((reply.token, reply.old_valid_until_unix_ms))
    }

    /// Recorded operator changes, oldest first.
    pub async fn list_audit(&self, filter: &AuditFilter) -> Result<Vec<AuditEntry>, ClientError> {
        let reply = self
            .raw()
            .list_audit(pb::ListAuditRequest {
                since_unix_ms: filter.since_unix_ms,
                tenant: filter.tenant.clone().unwrap_or_default(),
                limit: filter.limit,
            })
            .await?
            .into_inner();
        Ok(reply.entries.into_iter().map(AuditEntry::from).collect())
    }

    /// Revokes a token given either its id or the token itself: tried as an id first,
    /// then (on `NOT_FOUND` or `INVALID_ARGUMENT`) as the token.
    pub async fn revoke_token(&self, id_or_token: &str) -> Result<(), ClientError> {
        let by_id = pb::RevokeTokenRequest {
            token_id: id_or_token.to_string(),
            token: String::new(),
        };
        let first = match self.raw().revoke_token(by_id).await {
            Ok(_) => return Ok(()),
            Err(status) => ClientError::from(status),
        };
        if !matches!(
            first,
            ClientError::NotFound(_) | ClientError::InvalidArgument(_)
        ) {
            return Err(first);
        }
        let by_token = pb::RevokeTokenRequest {
            token_id: String::new(),
            token: id_or_token.to_string(),
        };
        match self.raw().revoke_token(by_token).await {
            Ok(_) => Ok(()),
            Err(status) => {
                let second = ClientError::from(status);
                match (&first, &second) {
                    (_, ClientError::InvalidArgument(_)) | (ClientError::NotFound(_), _) => {
                        Err(first)
                    }
                    _ => Err(second),
                }
            }
        }
    }

    /// Revokes a token by its public id only.
    pub async fn revoke_token_id(&self, token_id: &str) -> Result<(), ClientError> {
        self.raw()
            .revoke_token(pb::RevokeTokenRequest {
                token_id: token_id.to_string(),
                token: String::new(),
            })
            .await?;
        Ok(())
    }

    /// Live tokens, of one tenant or all.
    pub async fn list_tokens(&self, tenant: Option<&str>) -> Result<Vec<TokenInfo>, ClientError> {
        let reply = self
            .raw()
            .list_tokens(pb::ListTokensRequest {
                tenant: tenant.unwrap_or_default().to_string(),
            })
            .await?
            .into_inner();
        Ok(reply.tokens.into_iter().map(TokenInfo::from).collect())
    }

    /// Every lease, of one tenant or all (all pages, in the order they were granted).
    pub async fn list_all_leases(
        &self,
        tenant: Option<&str>,
    ) -> Result<Vec<LeaseInfo>, ClientError> {
        crate::paging::all_pages(|token| async move {
            self.list_all_leases_page(tenant, 0, &token).await
        })
        .await
    }

    /// One page of leases (see [`AdminClient::list_tenants_page`] for the paging).
    pub async fn list_all_leases_page(
        &self,
        tenant: Option<&str>,
        page_size: u32,
        page_token: &str,
    ) -> Result<(Vec<LeaseInfo>, Option<String>), ClientError> {
        let reply = self
            .raw()
            .list_all_leases(pb::ListAllLeasesRequest {
                tenant: tenant.unwrap_or_default().to_string(),
                page_size,
                page_token: page_token.to_string(),
            })
            .await?
            .into_inner();
        Ok((
            reply.leases.into_iter().map(LeaseInfo::from).collect(),
            Some(reply.next_page_token).filter(|t| !t.is_empty()),
        ))
    }

    /// Takes a lease away; its holder gets a `LeaseRevoked` event.
    pub async fn revoke_lease(
        &self,
        lease_id: &str,
        reason: &str,
    ) -> Result<LeaseInfo, ClientError> {
        let reply = self
            .raw()
            .revoke_lease(pb::RevokeLeaseRequest {
                lease_id: lease_id.to_string(),
                reason: reason.to_string(),
            })
            .await?
            .into_inner();
        reply
            .lease
            .map(LeaseInfo::from)
            .ok_or_else(|| ClientError::Protocol("RevokeLease reply carries no lease".into()))
    }

    /// Open sessions, of one tenant or all (all pages, oldest first).
    pub async fn list_sessions(
        &self,
        tenant: Option<&str>,
    ) -> Result<Vec<SessionInfo>, ClientError> {
        crate::paging::all_pages(
            |token| async move { self.list_sessions_page(tenant, 0, &token).await },
        )
        .await
    }

    /// One page of sessions (see [`AdminClient::list_tenants_page`] for the paging).
    pub async fn list_sessions_page(
        &self,
        tenant: Option<&str>,
        page_size: u32,
        page_token: &str,
    ) -> Result<(Vec<SessionInfo>, Option<String>), ClientError> {
        let reply = self
            .raw()
            .list_sessions(pb::ListSessionsRequest {
                tenant: tenant.unwrap_or_default().to_string(),
                page_size,
                page_token: page_token.to_string(),
            })
            .await?
            .into_inner();
        Ok((
            reply.sessions.into_iter().map(SessionInfo::from).collect(),
            Some(reply.next_page_token).filter(|t| !t.is_empty()),
        ))
    }

    /// The devices the broker manages.
    pub async fn get_devices(&self) -> Result<Vec<DeviceInfo>, ClientError> {
        let reply = self
            .raw()
            .get_devices(pb::GetDevicesRequest {})
            .await?
            .into_inner();
        Ok(reply.devices.into_iter().map(DeviceInfo::from).collect())
    }

    /// Starts draining `device` (or the node): no new leases there; holders of
    /// reclaimable leases are asked to release within `deadline` (absent: the broker's
    /// reclaim deadline). Returns the progress.
    pub async fn drain(
        &self,
        device: Option<u32>,
        deadline: Option<std::time::Duration>,
        reason: &str,
    ) -> Result<DrainStatus, ClientError> {
        let reply = self
            .raw()
            .drain(pb::DrainRequest {
                device,
                deadline_ms: deadline.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                reason: reason.to_string(),
            })
            .await?
            .into_inner();
        Ok(DrainStatus::from(reply))
    }

    /// Reopens `device` (or every device).
    pub async fn undrain(&self, device: Option<u32>) -> Result<DrainStatus, ClientError> {
        let reply = self
            .raw()
            .undrain(pb::UndrainRequest { device })
            .await?
            .into_inner();
        Ok(DrainStatus::from(reply))
    }

    /// Progress of drains.
    pub async fn drain_status(&self) -> Result<DrainStatus, ClientError> {
        let reply = self
            .raw()
            .get_drain(pb::GetDrainRequest {})
            .await?
            .into_inner();
        Ok(DrainStatus::from(reply))
    }

    /// Memory of ended leases that a live process may still map, oldest first.
    pub async fn list_quarantined(&self) -> Result<Vec<QuarantinedBlock>, ClientError> {
        let reply = self
            .raw()
            .list_quarantined(pb::ListQuarantinedRequest {})
            .await?
            .into_inner();
        Ok(reply
            .blocks
            .into_iter()
            .map(QuarantinedBlock::from)
            .collect())
    }

    /// An operator's verdict on a device: `healthy == false` marks it unhealthy (no new
    /// leases; stays until cleared), `true` clears any mark. Returns whether it changed.
    pub async fn set_device_health(
        &self,
        device: u32,
        healthy: bool,
        reason: &str,
    ) -> Result<bool, ClientError> {
        let reply = self
            .raw()
            .set_device_health(pb::SetDeviceHealthRequest {
                device,
                healthy,
                reason: reason.to_string(),
            })
            .await?
            .into_inner();
        Ok(reply.changed)
    }

    /// The broker's version, API revision and features.
    pub async fn broker_info(&self) -> Result<crate::info::BrokerInfo, ClientError> {
        let reply = self
            .raw()
            .get_info(pb::GetInfoRequest {})
            .await?
            .into_inner();
        Ok(crate::info::BrokerInfo::from(reply))
    }
}
