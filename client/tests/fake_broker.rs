//! The client crate against a small in-process fake of the broker's two gRPC services,
//! served on a Unix socket in a temp dir: checks what the client sends (auth header,
//! request fields, keepalives, release on drop, stream end on session drop) and how it
//! reads replies and events. The real broker is tested end to end in `tests/`.

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
use gpu_broker_client::{
    AdminClient, Backoff, Client, ClientError, Code, HostMapping, Lease, LeaseHandle, QuotaSpec,
    ReclaimRequest, SessionEvent, SessionEvents, Tier,
};
use pb::admin_server::{Admin, AdminServer};
use pb::broker_server::{Broker, BrokerServer};

const TENANT_TOKEN: &str = "tenant-token";
const ADMIN_TOKEN: &str = "admin-token";
const GRANULARITY: u64 = 2 << 20;
const QUOTA: u64 = 1 << 30;

#[derive(Default)]
struct State {
    next_id: u64,
    sessions: HashMap<String, mpsc::Sender<Result<pb::SessionEvent, Status>>>,
    session_names: HashMap<String, String>,
    session_ends: HashMap<String, tokio::sync::oneshot::Sender<()>>,
    ended_sessions: Vec<String>,
    keepalives: HashMap<String, u32>,
    last_acquire: Option<pb::AcquireLeaseRequest>,
    leases: HashMap<String, pb::Lease>,
    tenants: HashMap<String, pb::Quota>,
    tokens: HashMap<String, (String, String)>, // id -> (token, tenant)
    /// Every `ReleaseLease` received, in order.
    releases: Vec<String>,
    /// When set, `OpenSession` fails with this code.
    refuse_sessions: Option<Code>,
    /// Sessions whose keepalives get `NOT_FOUND`.
    forgotten: Vec<String>,
}

#[derive(Clone)]
struct Fake {
    state: Arc<Mutex<State>>,
    dir: PathBuf,
    keepalive_ms: u64,
}

fn bearer<T>(req: &Request<T>) -> Option<String> {
    req.metadata()
        .get("authorization")?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::to_string)
}

impl Fake {
    fn tenant<T>(&self, req: &Request<T>) -> Result<String, Status> {
        match bearer(req).as_deref() {
            Some(TENANT_TOKEN) => Ok("team-a".into()),
            _ => Err(Status::unauthenticated("unknown token")),
        }
    }

    fn admin<T>(&self, req: &Request<T>) -> Result<(), Status> {
        match bearer(req).as_deref() {
            Some(ADMIN_TOKEN) => Ok(()),
            Some(TENANT_TOKEN) => Err(Status::permission_denied(
                "tenant token on the admin service",
            )),
            _ => Err(Status::unauthenticated("unknown token")),
        }
    }

    fn push(&self, session_id: &str, event: pb::session_event::Event) {
        let tx = self.state.lock().sessions.get(session_id).cloned();
        if let Some(tx) = tx {
            let _ = tx.try_send(Ok(pb::SessionEvent { event: Some(event) }));
        }
    }

    fn tenant_info(&self, name: &str, quota: pb::Quota) -> pb::TenantInfo {
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

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::SessionEvent, Status>> + Send>>;

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
            Some(_) => Ok(Response::new(pb::ReleaseLeaseResponse {})),
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
}

struct Harness {
    _dir: tempfile::TempDir,
    uri: String,
    fake: Fake,
}

async fn start(keepalive_ms: u64) -> Harness {
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
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn session_lease_map_release() {
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client.session("trainer-3").await.unwrap();
    assert_eq!(session.id(), "s-1");
    assert_eq!(session.tenant(), "team-a");
    assert_eq!(session.peer_pid(), 4242);
    assert_eq!(session.keepalive_timeout(), None);
    assert_eq!(h.fake.state.lock().session_names["s-1"], "trainer-3");

    let lease = session
        .lease_request(3 << 20)
        .device(1)
        .wait(Duration::from_millis(1500))
        .label("kv-cache")
        .reclaimable(true)
        .fallback_host(true)
        .send()
        .await
        .unwrap();
    let sent = h.fake.state.lock().last_acquire.clone().unwrap();
    assert_eq!(sent.session_id, "s-1");
    assert_eq!(sent.bytes, 3 << 20);
    assert_eq!(sent.device, Some(1));
    assert_eq!(sent.wait_ms, Some(1500));
    assert_eq!(sent.label, "kv-cache");
    assert!(sent.reclaimable);
    assert_eq!(sent.fallback, pb::Fallback::Host as i32);

    assert_eq!(lease.bytes(), 4 << 20);
    assert_eq!(lease.requested_bytes(), 3 << 20);
    assert_eq!(lease.device(), 1);
    assert_eq!(lease.tier(), Tier::Host);
    assert_eq!(lease.label(), "kv-cache");
    let LeaseHandle::HostShm(path) = lease.handle().clone() else {
        panic!("expected host_shm, got {:?}", lease.handle())
    };

    {
        let mut mapping = lease.map().unwrap();
        assert_eq!(mapping.len() as u64, lease.bytes());
        mapping[..4].copy_from_slice(b"ping");
        let other = HostMapping::open(&path, 0, lease.bytes()).unwrap();
        assert_eq!(&other[..4], b"ping");
    }

    let usage = session.usage().await.unwrap();
    assert_eq!(usage.usage.held_bytes, 4 << 20);
    assert_eq!(usage.quota.limit_bytes, QUOTA);
    assert_eq!(session.list_leases().await.unwrap().len(), 1);

    lease.release().await.unwrap();
    assert!(session.list_leases().await.unwrap().is_empty());

    // Plain `lease(bytes)`: defaults.
    let lease = session.lease(1).await.unwrap();
    let sent = h.fake.state.lock().last_acquire.clone().unwrap();
    assert_eq!(
        (sent.device, sent.wait_ms, sent.reclaimable),
        (None, None, false)
    );
    assert_eq!(sent.fallback, pb::Fallback::None as i32);
    assert_eq!(lease.tier(), Tier::Device);
    let info = lease.detach();
    client.release_lease(&info.lease_id).await.unwrap();
    let err = client.release_lease(&info.lease_id).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}

#[tokio::test]
async fn errors_carry_codes() {
    let h = start(0).await;
    let bad = Client::connect(&h.uri, "wrong").await.unwrap();
    let err = bad.session("x").await.unwrap_err();
    assert!(matches!(err, ClientError::Unauthenticated(_)), "{err}");

    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client.session("x").await.unwrap();
    let err = session.lease(0).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = session.lease(2 << 30).await.unwrap_err();
    assert!(matches!(err, ClientError::ResourceExhausted(_)), "{err}");
    assert!(
        err.to_string()
            .starts_with("RESOURCE_EXHAUSTED: tenant team-a"),
        "{err}"
    );

    let admin_with_tenant_token = AdminClient::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let err = admin_with_tenant_token.list_tenants().await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied);

    let lease = session.lease_request(1).label("no-handle").await.unwrap();
    assert!(matches!(lease.handle(), LeaseHandle::Unknown));
    let err = lease.map().map(|_| ()).unwrap_err();
    assert!(matches!(err, ClientError::NotMappable), "{err}");
    lease.release().await.unwrap();
}

#[tokio::test]
async fn dropped_lease_is_released_in_the_background() {
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client.session("x").await.unwrap();
    let lease = session.lease(1 << 20).await.unwrap();
    assert_eq!(h.fake.state.lock().leases.len(), 1);
    drop(lease);
    eventually("release after drop", || {
        h.fake.state.lock().leases.is_empty()
    })
    .await;
    assert!(h.fake.state.lock().ended_sessions.is_empty());
}

#[tokio::test]
async fn dropping_the_session_ends_the_stream_but_leases_keep_it_open() {
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client.session("x").await.unwrap();
    let clone = session.clone();
    let lease = session.lease(1 << 20).await.unwrap();
    drop(session);
    drop(clone);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        h.fake.state.lock().ended_sessions.is_empty(),
        "a live lease keeps its session"
    );
    let lease_session = lease.session().clone();
    drop(lease);
    drop(lease_session);
    eventually("session end", || {
        h.fake.state.lock().ended_sessions == ["s-1"]
    })
    .await;
}

#[tokio::test]
async fn close_ends_the_session_for_every_clone() {
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client.session("x").await.unwrap();
    let keep = session.clone();
    let mut events = session.events();
    session.close();
    assert!(keep.is_closed());
    assert!(matches!(
        events.next().await,
        Some(SessionEvent::Closed { .. })
    ));
    assert!(events.next().await.is_none());
    eventually("session end", || {
        h.fake.state.lock().ended_sessions.len() == 1
    })
    .await;
}

#[tokio::test]
async fn events_reach_subscribers_and_callbacks() {
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let admin = AdminClient::connect(&h.uri, ADMIN_TOKEN).await.unwrap();
    let session = client.session("x").await.unwrap();
    let mut events = session.events();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    let callback = session.on_event(move |ev| sink.lock().push(ev));

    let lease = session.lease(1 << 20).await.unwrap();
    let revoked = admin
        .revoke_lease(lease.id(), "operator says so")
        .await
        .unwrap();
    assert_eq!(revoked.lease_id, lease.id());
    let ev = tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        ev,
        SessionEvent::LeaseRevoked {
            lease_id: lease.id().to_string(),
            reason: "operator says so".into()
        }
    );

    h.fake.push(
        &session.id(),
        pb::session_event::Event::Heartbeat(pb::Heartbeat { unix_ms: 5 }),
    );
    h.fake.push(
        &session.id(),
        pb::session_event::Event::ReclaimRequested(pb::ReclaimRequested {
            lease_id: lease.id().to_string(),
            bytes: 1 << 20,
            deadline_unix_ms: 10_000,
            reason: "priority".into(),
        }),
    );
    let ev = tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(ev, SessionEvent::ReclaimRequested { bytes, .. } if bytes == 1 << 20),
        "{ev:?}"
    );

    // The broker ends the stream: Closed, then the stream ends.
    h.fake.state.lock().session_ends.clear();
    let ev = tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ev, SessionEvent::Closed { reason: None });
    assert!(events.next().await.is_none());
    tokio::time::timeout(Duration::from_secs(5), callback)
        .await
        .unwrap()
        .unwrap();
    let seen = seen.lock().clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(seen[2].is_closed());
    drop(lease);
}

#[tokio::test]
async fn keepalives_are_sent() {
    let h = start(150).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client.session("x").await.unwrap();
    assert_eq!(
        session.keepalive_timeout(),
        Some(Duration::from_millis(150))
    );
    eventually("three keepalives", || {
        h.fake
            .state
            .lock()
            .keepalives
            .get("s-1")
            .copied()
            .unwrap_or(0)
            >= 3
    })
    .await;
}

#[tokio::test]
async fn admin_calls() {
    let h = start(0).await;
    let admin = AdminClient::connect(&h.uri, ADMIN_TOKEN).await.unwrap();
    let quota = QuotaSpec {
        limit_bytes: 8 << 30,
        max_leases: 4,
        priority: 2,
        guaranteed_bytes: 1 << 30,
        host_limit_bytes: 0,
        turn_weight: 0,
        device_limit_bytes: Default::default(),
    };
    let info = admin.set_quota("a", quota.clone()).await.unwrap();
    assert_eq!(
        (info.name.as_str(), info.quota.clone()),
        ("a", quota.clone())
    );
    assert_eq!(admin.get_quota("a").await.unwrap().quota, quota);
    let err = admin.get_quota("zz").await.unwrap_err();
    assert!(matches!(err, ClientError::NotFound(_)));
    let err = admin
        .set_quota(
            "b",
            QuotaSpec {
                guaranteed_bytes: 2,
                ..QuotaSpec::new(1)
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(admin.list_tenants().await.unwrap().len(), 1);

    let t1 = admin.issue_token("a", "ci").await.unwrap();
    let t2 = admin.issue_token("a", "ci").await.unwrap();
    assert_eq!(t1.tenant, "a");
    assert!(!format!("{t1:?}").contains(&t1.token));
    assert_eq!(admin.list_tokens(Some("a")).await.unwrap().len(), 2);
    assert_eq!(admin.list_tokens(Some("other")).await.unwrap().len(), 0);
    admin.revoke_token(&t1.token_id).await.unwrap(); // by id
    admin.revoke_token(&t2.token).await.unwrap(); // by the token itself
    let err = admin.revoke_token(&t2.token).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err}");
    assert!(admin.list_tokens(None).await.unwrap().is_empty());

    let devices = admin.get_devices().await.unwrap();
    assert_eq!(devices[0].granularity_bytes, GRANULARITY);
    assert!(admin.list_all_leases(None).await.unwrap().is_empty());
    assert!(admin.list_sessions(Some("a")).await.unwrap().is_empty());
    admin.delete_tenant("a").await.unwrap();
    assert!(matches!(
        admin.delete_tenant("a").await,
        Err(ClientError::NotFound(_))
    ));
}

fn ctl(uri: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_gpu-brokerctl"))
        .args(["--broker", uri, "--token", ADMIN_TOKEN])
        .args(args)
        .env_remove("GPU_BROKER_ADDR")
        .env_remove("GPU_BROKER_ADMIN_TOKEN")
        .env_remove("GPU_BROKER_ADMIN_TOKEN_FILE")
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_against_the_fake() {
    let h = start(0).await;
    let run = |args: &'static [&'static str]| {
        let uri = h.uri.clone();
        tokio::task::spawn_blocking(move || ctl(&uri, args))
    };
    let out = run(&[
        "quota",
        "set",
        "a",
        "--limit",
        "8GiB",
        "--guaranteed",
        "512MiB",
        "--priority",
        "-1",
    ])
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("TENANT"), "{text}");
    assert!(
        text.contains("8.0 GiB") && text.contains("512.0 MiB"),
        "{text}"
    );

    let out = run(&["tokens", "issue", "a", "--description", "ci"])
        .await
        .unwrap();
    assert!(out.status.success());
    let token = String::from_utf8(out.stdout).unwrap();
    assert!(
        token.starts_with("secret-") && token.ends_with('\n') && token.lines().count() == 1,
        "{token:?}"
    );

    let out = run(&["--json", "tenants", "list"]).await.unwrap();
    assert!(out.status.success());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json[0]["name"], "a");
    assert_eq!(json[0]["quota"]["limit_bytes"], 8u64 << 30);
    assert_eq!(json[0]["quota"]["priority"], -1);

    for args in [
        &["devices"][..],
        &["leases", "list"],
        &["sessions", "list", "--tenant", "a"],
        &["tokens", "list"],
    ] {
        let out = run(args).await.unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    let out = run(&["quota", "get", "nobody"]).await.unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.starts_with("error: NOT_FOUND: "), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn cli_reports_unreachable_broker() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-brokerctl"))
        .args([
            "--broker",
            "unix:///nonexistent/gpu-broker.sock",
            "--token",
            "x",
            "devices",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.starts_with("error: ") && err.contains("/nonexistent/gpu-broker.sock"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}

fn fast() -> Backoff {
    Backoff::new(Duration::from_millis(20), Duration::from_millis(200))
}

/// The next event within 5 s, skipping heartbeat-free noise is not needed: the fake
/// sends only what a test pushes.
async fn next_event(events: &mut SessionEvents) -> SessionEvent {
    tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .expect("an event within 5 s")
        .expect("the event stream goes on")
}

#[tokio::test]
async fn reconnecting_session_replaces_a_lost_one_and_old_leases_send_nothing() {
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client.session_builder("w").reconnect(fast()).await.unwrap();
    let mut events = session.events();
    assert_eq!(session.id(), "s-1");
    let kept_id: String = session.id();
    let a = session.lease(1 << 20).await.unwrap(); // l-2
    let b = session.lease(1 << 20).await.unwrap(); // l-3
    let c = session.lease(1 << 20).await.unwrap(); // l-4
    let detached = session.lease(1 << 20).await.unwrap().detach(); // l-5
    c.release().await.unwrap();
    assert_eq!(h.fake.state.lock().releases, ["l-4"]);

    // The broker ends the stream: the session is lost and re-opened.
    h.fake.state.lock().session_ends.clear();
    assert_eq!(
        next_event(&mut events).await,
        SessionEvent::Disconnected {
            session_id: "s-1".into(),
            reason: "the broker ended the session".into()
        }
    );
    assert_eq!(
        next_event(&mut events).await,
        SessionEvent::Reconnected {
            old_session_id: "s-1".into(),
            new_session_id: "s-6".into(),
            lost_leases: vec!["l-2".into(), "l-3".into()],
        }
    );
    assert_eq!(session.id(), "s-6");
    assert_eq!(kept_id, "s-1", "ids handed out earlier stay valid");
    assert!(session.is_connected());
    assert_eq!(h.fake.state.lock().session_names["s-6"], "w");
    assert!(a.is_lost() && b.is_lost());
    assert!(matches!(a.map(), Err(ClientError::LeaseLost { .. })));
    assert_eq!(a.session_id(), "s-1");
    assert_eq!(detached.session_id, "s-1");

    // Old leases: release fails locally, drop sends nothing.
    let err = a.release().await.unwrap_err();
    assert!(
        matches!(&err, ClientError::LeaseLost { lease_id, session_id } if lease_id == "l-2" && session_id == "s-1"),
        "{err}"
    );
    drop(b);
    // A new lease goes to the new session and is released normally when dropped.
    let fresh = session.lease(1 << 20).await.unwrap();
    assert_eq!(
        h.fake
            .state
            .lock()
            .last_acquire
            .as_ref()
            .unwrap()
            .session_id,
        "s-6"
    );
    assert_eq!(fresh.session_id(), "s-6");
    let fresh_id = fresh.id().to_string();
    drop(fresh);
    eventually("release of the fresh lease", || {
        h.fake.state.lock().releases.len() == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(h.fake.state.lock().releases, ["l-4".to_string(), fresh_id]);
    session.close();
    assert!(matches!(
        next_event(&mut events).await,
        SessionEvent::Closed { reason: Some(_) }
    ));
}

#[tokio::test]
async fn silent_stream_and_rejected_keepalive_count_as_lost() {
    // No heartbeats from the fake: the idle timeout fires.
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client
        .session_builder("w")
        .reconnect(fast())
        .idle_timeout(Some(Duration::from_millis(300)))
        .await
        .unwrap();
    let mut events = session.events();
    let ev = next_event(&mut events).await;
    assert!(
        matches!(&ev, SessionEvent::Disconnected { session_id, reason } if session_id == "s-1" && reason.contains("no message")),
        "{ev:?}"
    );
    assert!(matches!(
        next_event(&mut events).await,
        SessionEvent::Reconnected { .. }
    ));
    eventually("the old stream dropped", || {
        h.fake
            .state
            .lock()
            .ended_sessions
            .iter()
            .any(|s| s == "s-1")
    })
    .await;
    drop(session);

    // A keepalive refused with NOT_FOUND: the broker forgot the session.
    let h = start(90).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client
        .session_builder("w")
        .reconnect(fast())
        .idle_timeout(None)
        .await
        .unwrap();
    let mut events = session.events();
    h.fake.state.lock().forgotten.push("s-1".into());
    let ev = next_event(&mut events).await;
    assert!(
        matches!(&ev, SessionEvent::Disconnected { reason, .. } if reason.contains("NOT_FOUND")),
        "{ev:?}"
    );
    assert!(matches!(
        next_event(&mut events).await,
        SessionEvent::Reconnected { new_session_id, .. } if new_session_id == "s-2"
    ));
}

#[tokio::test]
async fn reconnecting_stops_on_permanent_refusal_or_after_the_limit() {
    for (code, give_up, expect) in [
        (Code::Unauthenticated, None, "UNAUTHENTICATED"),
        (Code::NotFound, None, "NOT_FOUND"),
        (
            Code::Unavailable,
            Some(Duration::from_millis(300)),
            "gave up",
        ),
    ] {
        let h = start(0).await;
        let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
        let mut builder = client.session_builder("w").reconnect(fast());
        if let Some(limit) = give_up {
            builder = builder.give_up_after(limit);
        }
        let session = builder.open().await.unwrap();
        let mut events = session.events();
        let lease = session.lease(1 << 20).await.unwrap();
        {
            let mut st = h.fake.state.lock();
            st.refuse_sessions = Some(code);
            st.session_ends.clear();
        }
        assert!(matches!(
            next_event(&mut events).await,
            SessionEvent::Disconnected { .. }
        ));
        let ev = next_event(&mut events).await;
        assert!(
            matches!(&ev, SessionEvent::Closed { reason: Some(r) } if r.contains(expect)),
            "{code:?}: {ev:?}"
        );
        assert!(events.next().await.is_none());
        assert!(session.is_closed() && !session.is_connected());
        assert!(matches!(
            lease.release().await,
            Err(ClientError::LeaseLost { .. })
        ));
        assert!(h.fake.state.lock().releases.is_empty());
    }
}

#[tokio::test]
async fn reclaim_handler_releases_leases() {
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let session = client.session("w").await.unwrap();
    let held: Arc<Mutex<HashMap<String, Lease>>> = Arc::default();
    for _ in 0..2 {
        let lease = session
            .lease_request(1 << 20)
            .reclaimable(true)
            .await
            .unwrap();
        held.lock().insert(lease.id().to_string(), lease);
    }
    let asked: Arc<Mutex<Vec<ReclaimRequest>>> = Arc::default();
    let handler = session.on_reclaim({
        let (held, asked) = (held.clone(), asked.clone());
        move |req: ReclaimRequest| {
            asked.lock().push(req.clone());
            let lease = held.lock().remove(&req.lease_id);
            async move {
                match lease {
                    Some(lease) => lease.release().await,
                    None => Err(ClientError::NotFound(req.lease_id.into())),
                }
            }
        }
    });
    let deadline_ms = (std::time::SystemTime::now() + Duration::from_secs(5))
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    for lease_id in ["l-2", "unknown"] {
        h.fake.push(
            &session.id(),
            pb::session_event::Event::ReclaimRequested(pb::ReclaimRequested {
                lease_id: lease_id.into(),
                bytes: 1 << 20,
                deadline_unix_ms: deadline_ms,
                reason: "priority".into(),
            }),
        );
    }
    eventually("the reclaimed lease released", || {
        h.fake.state.lock().releases == ["l-2"]
    })
    .await;
    eventually("both requests handled", || asked.lock().len() == 2).await;
    let first = asked.lock()[0].clone();
    assert_eq!(first.lease_id, "l-2");
    assert_eq!(first.bytes, 1 << 20);
    assert!(first.time_left() > Duration::from_secs(2));
    assert_eq!(held.lock().len(), 1);
    session.close();
    tokio::time::timeout(Duration::from_secs(5), handler)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn a_broker_without_get_info_is_reported_as_older() {
    let h = start(0).await;
    let client = Client::connect(&h.uri, TENANT_TOKEN).await.unwrap();
    let w = gpu_broker_client::version_warning(&client.broker_info().await).unwrap();
    assert!(w.contains("predates") && w.contains("upgrade"), "{w}");
    // Everything else still works against it.
    client.usage().await.unwrap();
}
