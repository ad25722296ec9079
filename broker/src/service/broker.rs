//! The `Broker` service (workers): sessions, leases, usage. Thin: authenticate (done by
//! the interceptor), convert, delegate to the arbiter, convert back.

use super::convert::{self, parse_id, parse_ids};
use super::events::EventStream;
use crate::arbiter::Arbiter;
use crate::auth::tenant_of;
use crate::error::BrokerError;
use crate::fd::handles;
use crate::grpc_status::status;
use crate::session::Peer;
use gpu_broker_proto::v1 as pb;
use gpu_broker_proto::v1::broker_server::Broker;
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::server::UdsConnectInfo;
use tonic::{Request, Response, Status};
use tracing::Instrument;

/// Longest heartbeat period of session streams (shorter when the keepalive timeout is).
const HEARTBEAT: Duration = Duration::from_secs(5);

/// The worker-facing service.
pub struct BrokerService {
    arb: Arc<Arbiter>,
}

impl BrokerService {
    pub fn new(arb: Arc<Arbiter>) -> BrokerService {
        BrokerService { arb }
    }
}

/// Heartbeats come often enough that an open stream its client reads keeps its session
/// alive.
pub fn heartbeat_period(keepalive_timeout: Duration) -> Duration {
    if keepalive_timeout.is_zero() {
        HEARTBEAT
    } else {
        HEARTBEAT
            .min(keepalive_timeout / 3)
            .max(Duration::from_millis(50))
    }
}

/// A process reservation is made, named a process group and released by its session's
/// user only: its end stops that group, with the broker's rights (often root). Unlike a
/// lease request, a caller whose uid is unknown (TCP) may not act for a session whose uid
/// is known, as nothing it is sent would otherwise stop it.
/// The claim whose token made `req` (`claim/<uid>`, minted with the claim's reservation).
fn claim_of<T>(req: &Request<T>) -> Option<String> {
    let p = req.extensions().get::<crate::auth::Principal>()?;
    crate::arbiter::claims::claim_of_token_name(&p.name).map(str::to_string)
}

fn check_reservation_caller(session: &Peer, caller: &Peer) -> Result<(), BrokerError> {
    match (session.uid, caller.uid) {
        (Some(s), Some(c)) if s == c => Ok(()),
        (Some(_), _) => Err(BrokerError::SessionOfAnotherUser),
        (None, _) => Ok(()),
    }
}

fn peer_of<T>(req: &Request<T>) -> Peer {
    match req.extensions().get::<UdsConnectInfo>() {
        Some(info) => Peer {
            // A peer in another PID namespace shows as pid 0: its pid is unknown (it lives
            // by its stream and keepalives, its memory ends like a TCP peer's), not dead.
            pid: info
                .peer_cred
                .and_then(|c| c.pid())
                .and_then(|p| u32::try_from(p).ok())
                .filter(|&p| p != 0),
            uid: info.peer_cred.map(|c| c.uid()),
            unix: true,
        },
        None => Peer::default(),
    }
}

/// The request's bearer token (the gate checked it), kept for [`BrokerService::waited`].
fn bearer_of<T>(req: &Request<T>) -> Option<String> {
    let value = req.metadata().get("authorization")?.to_str().ok();
    crate::auth::bearer(value).ok().map(str::to_string)
}

impl BrokerService {
    /// The refusal of a call that waited for `session`: when the session ended because
    /// the call's own token stopped authenticating meanwhile (revoked, or expired), the
    /// token's refusal, as any call with it now gets; else `e` as it is.
    fn waited(&self, e: BrokerError, session: uuid::Uuid, token: Option<&str>) -> Status {
        use crate::error::Missing;
        if let (BrokerError::NotFound(Missing::Session(id)), Some(token)) = (&e, token) {
            if *id == session {
                if let Err(refused) = self.arb.authenticator().authenticate(token) {
                    return refused.into();
                }
            }
        }
        status(e)
    }
}

#[tonic::async_trait]
impl Broker for BrokerService {
    type OpenSessionStream = EventStream;

    async fn open_session(
        &self,
        req: Request<pb::OpenSessionRequest>,
    ) -> Result<Response<Self::OpenSessionStream>, Status> {
        let tenant = tenant_of(&req)?;
        let peer = peer_of(&req);
        let token_id = req
            .extensions()
            .get::<crate::auth::Principal>()
            .map(|p| p.token_id.clone());
        let r = req.into_inner();
        let keepalive_timeout_ms = self.arb.config().keepalive_timeout.as_millis() as u64;
        let heartbeat = heartbeat_period(self.arb.config().keepalive_timeout);
        if !r.resume_session_id.is_empty() {
            // A worker whose broker restarted resumes its session (kept by the keeper).
            let id = parse_id("resume_session_id", &r.resume_session_id).map_err(status)?;
            let held = parse_ids("held_lease_ids", &r.held_lease_ids).map_err(status)?;
            let let_go = parse_ids("let_go_lease_ids", &r.let_go_lease_ids).map_err(status)?;
            crate::bounds::check("resume_secret", &r.resume_secret, 128).map_err(status)?;
            let (rx, kept, ended) = self
                .arb
                .restart()
                .resume_session(&tenant, id, &r.resume_secret, peer, &held, &let_go)
                .map_err(status)?;
            let opened = pb::SessionOpened {
                session_id: id.to_string(),
                tenant,
                broker_version: env!("CARGO_PKG_VERSION").into(),
                keepalive_timeout_ms,
                peer_pid: peer.pid.unwrap_or(0),
                resume_secret: r.resume_secret,
                resumed: true,
            };
            let resumed = pb::Resumed {
                session_id: id.to_string(),
                kept_lease_ids: kept.iter().map(|l| l.to_string()).collect(),
                ended_lease_ids: ended.iter().map(|l| l.to_string()).collect(),
            };
            return Ok(Response::new(
                EventStream::new(self.arb.clone(), id, opened, rx, heartbeat).then(
                    pb::SessionEvent {
                        event: Some(pb::session_event::Event::Resumed(resumed)),
                    },
                ),
            ));
        }
        let (id, rx, secret) = self
            .arb
            .sessions()
            .open(&tenant, &r.name, peer, token_id)
            .map_err(status)?;
        let opened = pb::SessionOpened {
            session_id: id.to_string(),
            tenant,
            broker_version: env!("CARGO_PKG_VERSION").into(),
            keepalive_timeout_ms,
            peer_pid: peer.pid.unwrap_or(0),
            resume_secret: secret,
            resumed: false,
        };
        Ok(Response::new(EventStream::new(
            self.arb.clone(),
            id,
            opened,
            rx,
            heartbeat,
        )))
    }

    async fn acquire_lease(
        &self,
        req: Request<pb::AcquireLeaseRequest>,
    ) -> Result<Response<pb::AcquireLeaseResponse>, Status> {
        if let Some(uid) = claim_of(&req) {
            // Without its reservation a claim's lease would be an ordinary one, on any
            // device, beside what the scheduler placed.
            if !self.arb.claims().is_held(&uid) {
                return Err(status(BrokerError::ClaimNotReserved { claim: uid }));
            }
        }
        let tenant = tenant_of(&req)?;
        let caller = peer_of(&req);
        let token = bearer_of(&req);
        let mut r = req.into_inner();
        let session = parse_id("session_id", &r.session_id).map_err(status)?;
        let span = tracing::debug_span!("acquire", %tenant, %session, bytes = r.bytes);
        let (host_tier, push_descriptor) = (r.host_tier, r.push_descriptor);
        let accept_handles = std::mem::take(&mut r.accept_handles);
        let asked = convert::acquire_request(tenant, session, r).map_err(status)?;
        let accept = handles::parse_accept(&accept_handles).map_err(status)?;
        // Bad values first (as before), then whether this caller can use what it would get.
        let acquire = self.arb.validate(asked).map_err(status)?;
        let session_of = self
            .arb
            .retained()
            .session_peer(&acquire.tenant, session)
            .map_err(status)?;
        let (session_peer, retains) = (session_of.peer, session_of.retains);
        handles::check_same_user(&session_peer, &caller).map_err(status)?;
        handles::check_servable(&self.arb, accept, &caller).map_err(status)?;
        // The session's own process may have retained a block of this size: one lock
        // hold, no ticket (its descriptor and mapping are still in that process).
        let own = caller
            .pid
            .filter(|&p| p != 0 && Some(p) == session_peer.pid);
        if retains && !host_tier {
            if let Some(lease) = self.arb.retained().acquire(&acquire, own) {
                let mut reply = convert::lease_on(&lease, &self.arb);
                reply.handle = Some(pb::lease::Handle::Fd(handles::retained_handle(
                    &self.arb, &lease,
                )));
                return Ok(Response::new(pb::AcquireLeaseResponse {
                    lease: Some(reply),
                }));
            }
        }
        let lease = if host_tier {
            self.arb.acquire_host_tier(acquire).instrument(span).await
        } else {
            self.arb.acquire_validated(acquire).instrument(span).await
        }
        .map_err(|e| self.waited(e, session, token.as_deref()))?;
        let mut reply = convert::lease_on(&lease, &self.arb);
        // The descriptor with the grant, on the process's descriptor channel, when it asks.
        let pushed = push_descriptor
            .then(|| handles::pushed_handle(&self.arb, &lease, &caller, &session_of))
            .flatten();
        if let Some(fd) = pushed {
            reply.handle = Some(pb::lease::Handle::Fd(fd));
            return Ok(Response::new(pb::AcquireLeaseResponse {
                lease: Some(reply),
            }));
        }
        match handles::fd_handle(&self.arb, &lease, &caller, &session_peer) {
            Ok(fd) => reply.handle = Some(pb::lease::Handle::Fd(fd)),
            Err(e) => {
                // Checked before the grant; if it fails now nobody can map the lease.
                let _ = self.arb.release(&lease.tenant, lease.id);
                return Err(status(e));
            }
        }
        Ok(Response::new(pb::AcquireLeaseResponse {
            lease: Some(reply),
        }))
    }

    async fn release_lease(
        &self,
        req: Request<pb::ReleaseLeaseRequest>,
    ) -> Result<Response<pb::ReleaseLeaseResponse>, Status> {
        let tenant = tenant_of(&req)?;
        let caller = peer_of(&req);
        let id = parse_id("lease_id", &req.get_ref().lease_id).map_err(status)?;
        let _span = tracing::debug_span!("release", %tenant, lease = %id).entered();
        let answer = if req.get_ref().retain_mapping {
            // Only a Unix-socket caller's pid is the kernel's.
            let pid = caller.pid.filter(|_| caller.unix);
            self.arb
                .retained()
                .release(&tenant, id, pid, req.get_ref().may_decline)
                .map_err(status)?
        } else {
            self.arb.release(&tenant, id).map_err(status)?;
            crate::arbiter::Retaining::LetGo
        };
        Ok(Response::new(pb::ReleaseLeaseResponse {
            retained: answer == crate::arbiter::Retaining::Retained,
            declined: answer == crate::arbiter::Retaining::Declined,
        }))
    }

    async fn list_leases(
        &self,
        req: Request<pb::ListLeasesRequest>,
    ) -> Result<Response<pb::ListLeasesResponse>, Status> {
        let tenant = tenant_of(&req)?;
        let r = req.get_ref();
        let size = crate::arbiter::listing::page_size(r.page_size);
        let page = self
            .arb
            .views()
            .leases_page(Some(&tenant), &r.page_token, size)
            .map_err(status)?;
        Ok(Response::new(pb::ListLeasesResponse {
            leases: page
                .items
                .iter()
                .map(|l| convert::lease_on(l, &self.arb))
                .collect(),
            next_page_token: page.next.unwrap_or_default(),
        }))
    }

    async fn get_usage(
        &self,
        req: Request<pb::GetUsageRequest>,
    ) -> Result<Response<pb::GetUsageResponse>, Status> {
        let tenant = tenant_of(&req)?;
        let t = self.arb.views().tenant(&tenant).map_err(status)?;
        Ok(Response::new(pb::GetUsageResponse {
            tenant: t.name.clone(),
            quota: Some(convert::quota_to_wire(t.quota.clone())),
            usage: Some(convert::usage(&t.usage, &t)),
        }))
    }

    async fn acquire_turn(
        &self,
        req: Request<pb::AcquireTurnRequest>,
    ) -> Result<Response<pb::AcquireTurnResponse>, Status> {
        let tenant = tenant_of(&req)?;
        let token = bearer_of(&req);
        let r = req.into_inner();
        let session = parse_id("session_id", &r.session_id).map_err(status)?;
        let span = tracing::info_span!("turn", %tenant, %session, device = r.device);
        let wait = Duration::from_millis(r.wait_ms.unwrap_or(0));
        let grant = self
            .arb
            .turns()
            .acquire(&tenant, session, r.device, wait)
            .instrument(span)
            .await
            .map_err(|e| self.waited(e, session, token.as_deref()))?;
        self.arb.scheduler.observe_handoff(&grant);
        Ok(Response::new(pb::AcquireTurnResponse {
            turn_id: grant.turn_id.to_string(),
            device: grant.device,
            quantum_ms: grant.quantum.as_millis() as u64,
        }))
    }

    async fn release_turn(
        &self,
        req: Request<pb::ReleaseTurnRequest>,
    ) -> Result<Response<pb::ReleaseTurnResponse>, Status> {
        let received = std::time::Instant::now();
        let tenant = tenant_of(&req)?;
        let id = parse_id("turn_id", &req.get_ref().turn_id).map_err(status)?;
        let end = self
            .arb
            .turns()
            .release_received(&tenant, id, received)
            .map_err(status)?;
        if end.handed_off {
            // The direct hand-off: the waiter's task was woken on this worker thread by
            // its grant, and tokio runs it next when this task yields, so the waiter's
            // reply goes out before this one instead of behind this response's write or a
            // parked worker's wake-up.
            tokio::task::yield_now().await;
        }
        Ok(Response::new(pb::ReleaseTurnResponse {
            held_ms: end.held.as_millis() as u64,
            overrun_ms: end.overrun.as_millis() as u64,
        }))
    }

    async fn renew_lease_ticket(
        &self,
        req: Request<pb::RenewLeaseTicketRequest>,
    ) -> Result<Response<pb::RenewLeaseTicketResponse>, Status> {
        let tenant = tenant_of(&req)?;
        let caller = peer_of(&req);
        let id = parse_id("lease_id", &req.get_ref().lease_id).map_err(status)?;
        let _span = tracing::info_span!("renew_ticket", %tenant, lease = %id).entered();
        // An import's id renews the import's (read-only) descriptor.
        if let Some(fd) =
            super::shared::renew_import(&self.arb, &tenant, id, &caller).map_err(status)?
        {
            return Ok(Response::new(pb::RenewLeaseTicketResponse { fd: Some(fd) }));
        }
        let (view, session) = self.arb.sessions().own_lease(&tenant, id).map_err(status)?;
        handles::check_same_user(&session, &caller).map_err(status)?;
        let fd = handles::fd_handle(&self.arb, &view, &caller, &session).map_err(status)?;
        Ok(Response::new(pb::RenewLeaseTicketResponse { fd: Some(fd) }))
    }

    async fn keepalive(
        &self,
        req: Request<pb::KeepaliveRequest>,
    ) -> Result<Response<pb::KeepaliveResponse>, Status> {
        let tenant = tenant_of(&req)?;
        let id = parse_id("session_id", &req.get_ref().session_id).map_err(status)?;
        self.arb.sessions().touch(&tenant, id).map_err(status)?;
        Ok(Response::new(pb::KeepaliveResponse {}))
    }

    async fn get_info(
        &self,
        _req: Request<pb::GetInfoRequest>,
    ) -> Result<Response<pb::GetInfoResponse>, Status> {
        Ok(Response::new(convert::info(&crate::info::BrokerInfo::of(
            &self.arb,
        ))))
    }

    async fn publish_lease(
        &self,
        req: Request<pb::PublishLeaseRequest>,
    ) -> Result<Response<pb::PublishLeaseResponse>, Status> {
        let tenant = tenant_of(&req)?;
        Ok(Response::new(
            super::shared::publish(&self.arb, &tenant, req.get_ref()).map_err(status)?,
        ))
    }

    async fn unpublish_lease(
        &self,
        req: Request<pb::UnpublishLeaseRequest>,
    ) -> Result<Response<pb::UnpublishLeaseResponse>, Status> {
        let tenant = tenant_of(&req)?;
        Ok(Response::new(
            super::shared::unpublish(&self.arb, &tenant, req.get_ref()).map_err(status)?,
        ))
    }

    async fn import_lease(
        &self,
        req: Request<pb::ImportLeaseRequest>,
    ) -> Result<Response<pb::ImportLeaseResponse>, Status> {
        let tenant = tenant_of(&req)?;
        let caller = peer_of(&req);
        Ok(Response::new(
            super::shared::import(&self.arb, &tenant, &caller, req.get_ref()).map_err(status)?,
        ))
    }

    async fn release_import(
        &self,
        req: Request<pb::ReleaseImportRequest>,
    ) -> Result<Response<pb::ReleaseImportResponse>, Status> {
        let tenant = tenant_of(&req)?;
        Ok(Response::new(
            super::shared::release_import(&self.arb, &tenant, req.get_ref()).map_err(status)?,
        ))
    }

    async fn list_shared_leases(
        &self,
        req: Request<pb::ListSharedLeasesRequest>,
    ) -> Result<Response<pb::ListSharedLeasesResponse>, Status> {
        let tenant = tenant_of(&req)?;
        Ok(Response::new(
            super::shared::list_visible(&self.arb, &tenant, req.get_ref()).map_err(status)?,
        ))
    }

    async fn reserve_process_memory(
        &self,
        req: Request<pb::ReserveProcessMemoryRequest>,
    ) -> Result<Response<pb::ReserveProcessMemoryResponse>, Status> {
        if let Some(uid) = claim_of(&req) {
            // The scheduler placed the claim's bytes, not more: its pod leases from them.
            return Err(status(BrokerError::ClaimTokenCannotReserve { claim: uid }));
        }
        let tenant = tenant_of(&req)?;
        let caller = peer_of(&req);
        let r = req.into_inner();
        let session = parse_id("session_id", &r.session_id).map_err(status)?;
        crate::bounds::check("label", &r.label, crate::arbiter::MAX_LABEL).map_err(status)?;
        check_reservation_caller(
            &self.arb.sessions().peer(&tenant, session).map_err(status)?,
            &caller,
        )
        .map_err(status)?;
        let span = tracing::info_span!("reserve_process", %tenant, %session, bytes = r.bytes);
        let view = self
            .arb
            .reservations()
            .reserve(crate::reservations::ReserveRequest {
                tenant,
                session,
                bytes: r.bytes,
                device: r.device,
                wait: Duration::from_millis(r.wait_ms.unwrap_or(0)),
                label: r.label,
                compute_percent: r.compute_percent,
            })
            .instrument(span)
            .await
            .map_err(status)?;
        let mps = self
            .arb
            .lifecycle()
            .mps()
            .is_some()
            .then(|| pb::MpsEnvironment {
                vars: view.env.iter().cloned().collect(),
            });
        Ok(Response::new(pb::ReserveProcessMemoryResponse {
            reservation: Some(convert::reservation(&view)),
            mps,
        }))
    }

    async fn release_process_memory(
        &self,
        req: Request<pb::ReleaseProcessMemoryRequest>,
    ) -> Result<Response<pb::ReleaseProcessMemoryResponse>, Status> {
        let tenant = tenant_of(&req)?;
        let id = parse_id("reservation_id", &req.get_ref().reservation_id).map_err(status)?;
        check_reservation_caller(
            &self.arb.reservations().peer(&tenant, id).map_err(status)?,
            &peer_of(&req),
        )
        .map_err(status)?;
        self.arb
            .reservations()
            .release(&tenant, id)
            .map_err(status)?;
        Ok(Response::new(pb::ReleaseProcessMemoryResponse {}))
    }

    async fn set_process_group(
        &self,
        req: Request<pb::SetProcessGroupRequest>,
    ) -> Result<Response<pb::SetProcessGroupResponse>, Status> {
        let tenant = tenant_of(&req)?;
        let r = req.get_ref();
        let id = parse_id("reservation_id", &r.reservation_id).map_err(status)?;
        if r.pgid <= 1 {
            return Err(status(BrokerError::InvalidArgument(format!(
                "pgid {} is not a process group a program can lead",
                r.pgid
            ))));
        }
        // The group's leader must then be of the caller's uid too (the arbiter checks it
        // against the session's): the broker signals only what the caller could.
        check_reservation_caller(
            &self.arb.reservations().peer(&tenant, id).map_err(status)?,
            &peer_of(&req),
        )
        .map_err(status)?;
        self.arb
            .reservations()
            .set_process_group(&tenant, id, r.pgid)
            .map_err(status)?;
        Ok(Response::new(pb::SetProcessGroupResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reservation_is_acted_on_by_its_sessions_uid_only() {
        let p = |uid| Peer {
            uid,
            pid: None,
            unix: uid.is_some(),
        };
        assert!(check_reservation_caller(&p(Some(0)), &p(Some(0))).is_ok());
        for caller in [Some(65534), None] {
            assert!(matches!(
                check_reservation_caller(&p(Some(0)), &p(caller)),
                Err(BrokerError::SessionOfAnotherUser)
            ));
        }
        // A TCP session has no process group to stop.
        assert!(check_reservation_caller(&p(None), &p(Some(1))).is_ok());
    }
}
