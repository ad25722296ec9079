//! A small in-process fake of the broker's two gRPC services, served on a Unix socket in
//! a temp dir, that records what a client sends: shared by the client crate's tests and
//! the CLI's (`client/ctl/tests/cli.rs`), each of which uses part of it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use parking_lot::Mutex;
use tokio::net::UnixListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::{Request, Response, Status};

use gpu_broker_client::proto::v1 as pb;
use gpu_broker_client::Code;
use pb::admin_server::{Admin, AdminServer};
use pb::broker_server::{Broker, BrokerServer};
pub const TENANT_TOKEN: &str = "tenant-token";
pub const ADMIN_TOKEN: &str = "admin-token";
pub const GRANULARITY: u64 = 2 << 20;
pub const QUOTA: u64 = 1 << 30;

#[derive(Default)]
pub struct State {
    pub next_id: u64,
    pub sessions: HashMap<String, mpsc::Sender<Result<pb::SessionEvent, Status>>>,
    pub session_names: HashMap<String, String>,
    pub session_ends: HashMap<String, tokio::sync::oneshot::Sender<()>>,
    pub ended_sessions: Vec<String>,
    pub keepalives: HashMap<String, u32>,
    pub last_acquire: Option<pb::AcquireLeaseRequest>,
    pub leases: HashMap<String, pb::Lease>,
    pub tenants: HashMap<String, pb::Quota>,
    pub tokens: HashMap<String, (String, String)>, // id -> (token, tenant)
    /// Every `ReleaseLease` received, in order.
    pub releases: Vec<String>,
    /// When set, `OpenSession` fails with this code.
    pub refuse_sessions: Option<Code>,
    /// Sessions whose keepalives get `NOT_FOUND`.
    pub forgotten: Vec<String>,
    /// How long `GetUsage` takes to answer (a call in flight for the transport tests).
    pub usage_delay: Option<Duration>,
}

#[derive(Clone)]
pub struct Fake {
    pub state: Arc<Mutex<State>>,
    pub dir: PathBuf,
    pub keepalive_ms: u64,
}

pub fn bearer<T>(req: &Request<T>) -> Option<String> {
    req.metadata()
        .get("authorization")?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::to_string)
}

impl Fake {
    pub fn tenant<T>(&self, req: &Request<T>) -> Result<String, Status> {
        match bearer(req).as_deref() {
            Some(TENANT_TOKEN) => Ok("team-a".into()),
            _ => Err(Status::unauthenticated("unknown token")),
        }
    }

    pub fn admin<T>(&self, req: &Request<T>) -> Result<(), Status> {
        match bearer(req).as_deref() {
            Some(ADMIN_TOKEN) => Ok(()),
            Some(TENANT_TOKEN) => Err(Status::permission_denied(
                "tenant token on the admin service",
            )),
            _ => Err(Status::unauthenticated("unknown token")),
        }
    }

    pub fn push(&self, session_id: &str, event: pb::session_event::Event) {
        let tx = self.state.lock().sessions.get(session_id).cloned();
        if let Some(tx) = tx {
            let _ = tx.try_send(Ok(pb::SessionEvent { event: Some(event) }));
        }
    }

    pub fn tenant_info(&self, name: &str, quota: pb::Quota) -> pb::TenantInfo {
        let st = self.state.lock();
        let held: u64 = st
            .leases
            .values()
            .filter(|l| l.tenant == name)
            .map(|l| l.bytes)
            .sum();
        pb::TenantInfo {
            name: name.to_string(),
            quota: Some(quota),
            usage: Some(pb::Usage {
                held_bytes: held,
                ..Default::default()
            }),
            token_count: st.tokens.values().filter(|(_, t)| t == name).count() as u32,
        }
    }
}

pub type EventStream = Pin<Box<dyn Stream<Item = Result<pb::SessionEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Broker for Fake {
    type OpenSessionStream = EventStream;

    async fn open_session(
        &self,
        req: Request<pb::OpenSessionRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let tenant = self.tenant(&req)?;
        if let Some(code) = self.state.lock().refuse_sessions {
            return Err(Status::new(code, "refused by the test"));
        }
        let (tx, rx) = mpsc::channel(16);
        let (end_tx, end_rx) = tokio::sync::oneshot::channel::<()>();
        let id = {
            let mut st = self.state.lock();
            st.next_id += 1;
            let id = format!("s-{}", st.next_id);
            st.sessions.insert(id.clone(), tx.clone());
            st.session_names.insert(id.clone(), req.into_inner().name);
            st.session_ends.insert(id.clone(), end_tx);
            id
        };
        let opened = pb::SessionOpened {
            session_id: id.clone(),
            tenant,
            broker_version: "fake".into(),
            keepalive_timeout_ms: self.keepalive_ms,
            peer_pid: 4242,
            ..Default::default()
        };
        tx.send(Ok(pb::SessionEvent {
            event: Some(pb::session_event::Event::Opened(opened)),
        }))
        .await
        .map_err(|_| Status::internal("stream gone"))?;
        // Notice when the client drops the stream.
        let state = self.state.clone();
        tokio::spawn(async move {
            tx.closed().await;
            let mut st = state.lock();
            st.sessions.remove(&id);
            st.leases.retain(|_, l| l.session_id != id);
            st.ended_sessions.push(id);
        });
        Ok(Response::new(Box::pin(
            ReceiverStream::new(rx).take_until(end_rx),
        )))
    }

    async fn acquire_lease(
        &self,
        req: Request<pb::AcquireLeaseRequest>,
    ) -> Result<Response<pb::AcquireLeaseResponse>, Status> {
        let tenant = self.tenant(&req)?;
        let r = req.into_inner();
        self.state.lock().last_acquire = Some(r.clone());
        if r.bytes == 0 {
            return Err(Status::invalid_argument("bytes must be > 0"));
        }
        let bytes = r.bytes.div_ceil(GRANULARITY) * GRANULARITY;
        if bytes > QUOTA {
            return Err(Status::resource_exhausted(format!(
                "tenant team-a: {bytes} bytes would exceed the quota of {QUOTA}"
            )));
        }
        let mut st = self.state.lock();
        if !st.sessions.contains_key(&r.session_id) {
            return Err(Status::not_found("no such session"));
        }
        st.next_id += 1;
        let id = format!("l-{}", st.next_id);
        let path = self.dir.join(format!("{id}.shm"));
        let file = std::fs::File::create(&path).map_err(|e| Status::internal(e.to_string()))?;
        file.set_len(bytes)
            .map_err(|e| Status::internal(e.to_string()))?;
        let lease = pb::Lease {
            lease_id: id.clone(),
            device: r.device.unwrap_or(0),
            bytes,
            requested_bytes: r.bytes,
            label: r.label,
            session_id: r.session_id,
            tenant,
            state: pb::LeaseState::Active as i32,
            tier: if r.fallback == pb::Fallback::Host as i32 {
                pb::MemoryTier::Host as i32
            } else {
                pb::MemoryTier::Device as i32
            },
            created_unix_ms: 1,
            reclaimable: r.reclaimable,
            handle: Some(pb::lease::Handle::HostShm(path.display().to_string())),
            ..Default::default()
        };
        let mut lease = lease;
        if lease.label == "no-handle" {
            // What an older broker's legacy CUDA IPC handle (a reserved field now) reads as.
            lease.handle = None;
        }
        st.leases.insert(id, lease.clone());
        Ok(Response::new(pb::AcquireLeaseResponse {
            lease: Some(lease),
        }))
    }

    async fn release_lease(
        &self,
        req: Request<pb::ReleaseLeaseRequest>,
    ) -> Result<Response<pb::ReleaseLeaseResponse>, Status> {
        self.tenant(&req)?;
        let id = req.into_inner().lease_id;
        let mut st = self.state.lock();
        st.releases.push(id.clone());
        match st.leases.remove(&id) {
            Some(_) => Ok(Response::new(pb::ReleaseLeaseResponse::default())),
            None => Err(Status::not_found(format!("no lease {id}"))),
        }
    }

    async fn list_leases(
        &self,
        req: Request<pb::ListLeasesRequest>,
    ) -> Result<Response<pb::ListLeasesResponse>, Status> {
        let tenant = self.tenant(&req)?;
        let leases = self
            .state
            .lock()
            .leases
            .values()
            .filter(|l| l.tenant == tenant)
            .cloned()
            .collect();
        Ok(Response::new(pb::ListLeasesResponse {
            leases,
            next_page_token: String::new(),
        }))
    }

    async fn get_usage(
        &self,
        req: Request<pb::GetUsageRequest>,
    ) -> Result<Response<pb::GetUsageResponse>, Status> {
        let tenant = self.tenant(&req)?;
        let delay = self.state.lock().usage_delay;
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        let st = self.state.lock();
        let held = st.leases.values().map(|l| l.bytes).sum();
        Ok(Response::new(pb::GetUsageResponse {
            tenant,
            quota: Some(pb::Quota {
                limit_bytes: QUOTA,
                max_leases: 8,
                ..Default::default()
            }),
            usage: Some(pb::Usage {
                held_bytes: held,
                lease_count: st.leases.len() as u32,
                session_count: st.sessions.len() as u32,
                ..Default::default()
            }),
        }))
    }

    async fn renew_lease_ticket(
        &self,
        req: Request<pb::RenewLeaseTicketRequest>,
    ) -> Result<Response<pb::RenewLeaseTicketResponse>, Status> {
        self.tenant(&req)?;
        Err(Status::failed_precondition(
            "the fake broker serves no fd leases",
        ))
    }

    async fn keepalive(
        &self,
        req: Request<pb::KeepaliveRequest>,
    ) -> Result<Response<pb::KeepaliveResponse>, Status> {
        self.tenant(&req)?;
        let id = req.into_inner().session_id;
        let mut st = self.state.lock();
        if st.forgotten.contains(&id) {
            return Err(Status::not_found(format!("no session {id}")));
        }
        *st.keepalives.entry(id).or_default() += 1;
        Ok(Response::new(pb::KeepaliveResponse {}))
    }

    async fn acquire_turn(
        &self,
        _req: Request<pb::AcquireTurnRequest>,
    ) -> Result<Response<pb::AcquireTurnResponse>, Status> {
        Err(Status::unimplemented(
            "the fake broker has no compute turns",
        ))
    }

    async fn release_turn(
        &self,
        _req: Request<pb::ReleaseTurnRequest>,
    ) -> Result<Response<pb::ReleaseTurnResponse>, Status> {
        Err(Status::unimplemented(
            "the fake broker has no compute turns",
        ))
    }

    async fn get_info(
        &self,
        _req: Request<pb::GetInfoRequest>,
    ) -> Result<Response<pb::GetInfoResponse>, Status> {
        Err(Status::unimplemented("an old broker"))
    }

    async fn publish_lease(
        &self,
        _req: Request<pb::PublishLeaseRequest>,
    ) -> Result<Response<pb::PublishLeaseResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn unpublish_lease(
        &self,
        _req: Request<pb::UnpublishLeaseRequest>,
    ) -> Result<Response<pb::UnpublishLeaseResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn import_lease(
        &self,
        _req: Request<pb::ImportLeaseRequest>,
    ) -> Result<Response<pb::ImportLeaseResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn release_import(
        &self,
        _req: Request<pb::ReleaseImportRequest>,
    ) -> Result<Response<pb::ReleaseImportResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn list_shared_leases(
        &self,
        _req: Request<pb::ListSharedLeasesRequest>,
    ) -> Result<Response<pb::ListSharedLeasesResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn reserve_process_memory(
        &self,
        req: Request<pb::ReserveProcessMemoryRequest>,
    ) -> Result<Response<pb::ReserveProcessMemoryResponse>, Status> {
        self.tenant(&req)?;
        Err(Status::unimplemented("an old broker"))
    }

    async fn release_process_memory(
        &self,
        req: Request<pb::ReleaseProcessMemoryRequest>,
    ) -> Result<Response<pb::ReleaseProcessMemoryResponse>, Status> {
        self.tenant(&req)?;
        Err(Status::unimplemented("an old broker"))
    }

    async fn set_process_group(
        &self,
        req: Request<pb::SetProcessGroupRequest>,
    ) -> Result<Response<pb::SetProcessGroupResponse>, Status> {
        self.tenant(&req)?;
        Err(Status::unimplemented("an old broker"))
    }
}

#[tonic::async_trait]
impl Admin for Fake {
    async fn set_quota(
        &self,
        req: Request<pb::SetQuotaRequest>,
    ) -> Result<Response<pb::SetQuotaResponse>, Status> {
        self.admin(&req)?;
        let r = req.into_inner();
        let quota = match (r.quota, r.patch) {
            (Some(q), _) => q,
            (None, Some(p)) => {
                let old = self.state.lock().tenants.get(&r.tenant).cloned();
                let old = old.unwrap_or_default();
                pb::Quota {
                    limit_bytes: p.limit_bytes.unwrap_or(old.limit_bytes),
                    max_leases: p.max_leases.unwrap_or(old.max_leases),
                    priority: p.priority.unwrap_or(old.priority),
                    guaranteed_bytes: p.guaranteed_bytes.unwrap_or(old.guaranteed_bytes),
                    host_limit_bytes: p.host_limit_bytes.unwrap_or(old.host_limit_bytes),
                    turn_weight: p.turn_weight.unwrap_or(old.turn_weight),
                    device_limit_bytes: old.device_limit_bytes,
                }
            }
            (None, None) => pb::Quota::default(),
        };
        if quota.guaranteed_bytes > quota.limit_bytes {
            return Err(Status::invalid_argument(
                "guaranteed_bytes exceeds limit_bytes",
            ));
        }
        let created = self
            .state
            .lock()
            .tenants
            .insert(r.tenant.clone(), quota.clone())
            .is_none();
        Ok(Response::new(pb::SetQuotaResponse {
            tenant: Some(self.tenant_info(&r.tenant, quota)),
            created,
            warnings: Vec::new(),
        }))
    }

    async fn get_quota(
        &self,
        req: Request<pb::GetQuotaRequest>,
    ) -> Result<Response<pb::GetQuotaResponse>, Status> {
        self.admin(&req)?;
        let name = req.into_inner().tenant;
        let quota = self.state.lock().tenants.get(&name).cloned();
        match quota {
            Some(q) => Ok(Response::new(pb::GetQuotaResponse {
                tenant: Some(self.tenant_info(&name, q)),
            })),
            None => Err(Status::not_found(format!("no tenant {name:?}"))),
        }
    }

    async fn list_tenants(
        &self,
        req: Request<pb::ListTenantsRequest>,
    ) -> Result<Response<pb::ListTenantsResponse>, Status> {
        self.admin(&req)?;
        let mut all: Vec<(String, pb::Quota)> = self
            .state
            .lock()
            .tenants
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        let tenants = all
            .into_iter()
            .map(|(n, q)| self.tenant_info(&n, q))
            .collect();
        Ok(Response::new(pb::ListTenantsResponse {
            tenants,
            next_page_token: String::new(),
        }))
    }

    async fn delete_tenant(
        &self,
        req: Request<pb::DeleteTenantRequest>,
    ) -> Result<Response<pb::DeleteTenantResponse>, Status> {
        self.admin(&req)?;
        let name = req.into_inner().tenant;
        let mut st = self.state.lock();
        if st.leases.values().any(|l| l.tenant == name) {
            return Err(Status::failed_precondition(format!(
                "tenant {name:?} holds leases"
            )));
        }
        match st.tenants.remove(&name) {
            Some(_) => Ok(Response::new(pb::DeleteTenantResponse {})),
            None => Err(Status::not_found(format!("no tenant {name:?}"))),
        }
    }

    async fn issue_token(
        &self,
        req: Request<pb::IssueTokenRequest>,
    ) -> Result<Response<pb::IssueTokenResponse>, Status> {
        self.admin(&req)?;
        let r = req.into_inner();
        let mut st = self.state.lock();
        st.next_id += 1;
        let (id, token) = (
            format!("tid-{}", st.next_id),
            format!("secret-{}", st.next_id),
        );
        st.tokens
            .insert(id.clone(), (token.clone(), r.tenant.clone()));
        Ok(Response::new(pb::IssueTokenResponse {
            token,
            token_id: id,
            tenant: r.tenant,
            ..Default::default()
        }))
    }

    async fn revoke_token(
        &self,
        req: Request<pb::RevokeTokenRequest>,
    ) -> Result<Response<pb::RevokeTokenResponse>, Status> {
        self.admin(&req)?;
        let r = req.into_inner();
        let mut st = self.state.lock();
        let id = if !r.token_id.is_empty() {
            if !r.token_id.starts_with("tid-") {
                return Err(Status::invalid_argument("malformed token id"));
            }
            Some(r.token_id)
        } else {
            st.tokens
                .iter()
                .find(|(_, (t, _))| *t == r.token)
                .map(|(id, _)| id.clone())
        };
        match id.and_then(|id| st.tokens.remove(&id)) {
            Some(_) => Ok(Response::new(pb::RevokeTokenResponse {})),
            None => Err(Status::not_found("no such token")),
        }
    }

    async fn list_tokens(
        &self,
        req: Request<pb::ListTokensRequest>,
    ) -> Result<Response<pb::ListTokensResponse>, Status> {
        self.admin(&req)?;
        let tenant = req.into_inner().tenant;
        let tokens = self
            .state
            .lock()
            .tokens
            .iter()
            .filter(|(_, (_, t))| tenant.is_empty() || *t == tenant)
            .map(|(id, (_, t))| pb::TokenInfo {
                token_id: id.clone(),
                tenant: t.clone(),
                description: "d".into(),
                created_unix_ms: 1,
                ..Default::default()
            })
            .collect();
        Ok(Response::new(pb::ListTokensResponse { tokens }))
    }

    async fn list_all_leases(
        &self,
        req: Request<pb::ListAllLeasesRequest>,
    ) -> Result<Response<pb::ListAllLeasesResponse>, Status> {
        self.admin(&req)?;
        let tenant = req.into_inner().tenant;
        let leases = self
            .state
            .lock()
            .leases
            .values()
            .filter(|l| tenant.is_empty() || l.tenant == tenant)
            .cloned()
            .collect();
        Ok(Response::new(pb::ListAllLeasesResponse {
            leases,
            next_page_token: String::new(),
        }))
    }

    async fn revoke_lease(
        &self,
        req: Request<pb::RevokeLeaseRequest>,
    ) -> Result<Response<pb::RevokeLeaseResponse>, Status> {
        self.admin(&req)?;
        let r = req.into_inner();
        let lease = {
            let mut st = self.state.lock();
            let lease = st
                .leases
                .get_mut(&r.lease_id)
                .ok_or_else(|| Status::not_found("no such lease"))?;
            lease.state = pb::LeaseState::Revoked as i32;
            lease.clone()
        };
        self.push(
            &lease.session_id,
            pb::session_event::Event::LeaseRevoked(pb::LeaseRevoked {
                lease_id: r.lease_id,
                reason: r.reason,
            }),
        );
        Ok(Response::new(pb::RevokeLeaseResponse {
            lease: Some(lease),
        }))
    }

    async fn list_sessions(
        &self,
        req: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        self.admin(&req)?;
        let st = self.state.lock();
        let sessions = st
            .sessions
            .keys()
            .map(|id| pb::SessionInfo {
                session_id: id.clone(),
                tenant: "team-a".into(),
                name: st.session_names.get(id).cloned().unwrap_or_default(),
                peer_pid: 4242,
                transport: "unix".into(),
                ..Default::default()
            })
            .collect();
        Ok(Response::new(pb::ListSessionsResponse {
            sessions,
            next_page_token: String::new(),
        }))
    }

    async fn drain(
        &self,
        _req: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn undrain(
        &self,
        _req: Request<pb::UndrainRequest>,
    ) -> Result<Response<pb::DrainResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn get_drain(
        &self,
        _req: Request<pb::GetDrainRequest>,
    ) -> Result<Response<pb::DrainResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn set_device_health(
        &self,
        _req: Request<pb::SetDeviceHealthRequest>,
    ) -> Result<Response<pb::SetDeviceHealthResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn list_shared_leases(
        &self,
        _req: Request<pb::AdminListSharedLeasesRequest>,
    ) -> Result<Response<pb::AdminListSharedLeasesResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn get_info(
        &self,
        req: Request<pb::GetInfoRequest>,
    ) -> Result<Response<pb::GetInfoResponse>, Status> {
        self.admin(&req)?;
        // The fake's admin side is current (its worker side is an old broker).
        Ok(Response::new(pb::GetInfoResponse {
            version: "fake".into(),
            api_revision: gpu_broker_client::REQUIRED_API_REVISION,
            ..Default::default()
        }))
    }

    async fn rotate_admin_token(
        &self,
        _req: Request<pb::RotateAdminTokenRequest>,
    ) -> Result<Response<pb::RotateAdminTokenResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn list_audit(
        &self,
        _req: Request<pb::ListAuditRequest>,
    ) -> Result<Response<pb::ListAuditResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn get_devices(
        &self,
        req: Request<pb::GetDevicesRequest>,
    ) -> Result<Response<pb::GetDevicesResponse>, Status> {
        self.admin(&req)?;
        Ok(Response::new(pb::GetDevicesResponse {
            devices: vec![pb::DeviceInfo {
                index: 0,
                name: "fake".into(),
                backend: "host".into(),
                total_bytes: 8 << 30,
                granularity_bytes: GRANULARITY,
                ..Default::default()
            }],
        }))
    }

    async fn list_quarantined(
        &self,
        req: Request<pb::ListQuarantinedRequest>,
    ) -> Result<Response<pb::ListQuarantinedResponse>, Status> {
        self.admin(&req)?;
        Ok(Response::new(pb::ListQuarantinedResponse {
            blocks: vec![],
        }))
    }
    async fn reserve_claim(
        &self,
        req: Request<pb::ReserveClaimRequest>,
    ) -> Result<Response<pb::ReserveClaimResponse>, Status> {
        self.admin(&req)?;
        Err(Status::unimplemented("the fake broker keeps no claims"))
    }

    async fn release_claim(
        &self,
        req: Request<pb::ReleaseClaimRequest>,
    ) -> Result<Response<pb::ReleaseClaimResponse>, Status> {
        self.admin(&req)?;
        Err(Status::unimplemented("the fake broker keeps no claims"))
    }

    async fn list_claims(
        &self,
        req: Request<pb::ListClaimsRequest>,
    ) -> Result<Response<pb::ListClaimsResponse>, Status> {
        self.admin(&req)?;
        Ok(Response::new(pb::ListClaimsResponse::default()))
    }
}

pub struct Harness {
    pub _dir: tempfile::TempDir,
    pub uri: String,
    pub fake: Fake,
}

pub async fn start(keepalive_ms: u64) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("broker.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let fake = Fake {
        state: Arc::default(),
        dir: dir.path().to_path_buf(),
        keepalive_ms,
    };
    let server = tonic::transport::Server::builder()
        .add_service(BrokerServer::new(fake.clone()))
        .add_service(AdminServer::new(fake.clone()))
        .serve_with_incoming(UnixListenerStream::new(listener));
    tokio::spawn(server);
    Harness {
        uri: format!("unix://{}", sock.display()),
        _dir: dir,
        fake,
    }
}

/// Polls `cond` until it holds or 5 s pass.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
