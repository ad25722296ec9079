//! Claim reservations: the memory a Kubernetes ResourceClaim was allocated, set aside at
//! the broker for the claim's pod when the DRA driver (`broker/dra`) prepares it. A claim
//! reservation is charged like a process reservation (`crate::reservations`) but belongs
//! to no session: it is bound to a worker token minted with it, and leases of sessions
//! opened with that token are drawn from it. Releasing the claim ends the reservation and
//! revokes the token (which ends the sessions opened with it). Each claim reservation is
//! kept in the store (`store::ClaimRecord`) while it lasts: a restarted broker takes it
//! again at start ([`Claims::restore_all`]), before anything is served.
//!
//! [`Claims`] (reached by [`Arbiter::claims`]) owns the claims' operations: reserve,
//! release, list, restore; it keeps no fields of its own (a claim reservation lives with
//! the other reservations in the state, its token with the others).

use super::tokens::TokenSpec;
use super::Arbiter;
use crate::audit::Who;
use crate::auth::Scope;
use crate::error::{BrokerError, BrokerResult, Missing};
use crate::reservations::{ClaimAsk, ClaimBinding, ReservationView, ReserveRequest};
use crate::store::ClaimRecord;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// Longest claim uid accepted (Kubernetes uids are 36 bytes).
pub const MAX_CLAIM_UID: usize = 128;

/// A claim to reserve for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimRequest {
    /// The ResourceClaim's uid: names the reservation and its token (`claim/<uid>`).
    pub uid: String,
    pub tenant: String,
    pub bytes: u64,
    pub device: u32,
    /// Shown to operators (the driver sends `namespace/name`).
    pub label: String,
}

/// A claim's reservation and the token bound to it (its secret shown only now).
#[derive(Clone, Debug)]
pub struct ClaimGrant {
    pub reservation: ReservationView,
    pub token: String,
    pub token_id: String,
}

/// What the names of claims' tokens start with (no other token's may).
pub const CLAIM_TOKEN_PREFIX: &str = "claim/";

/// The name of a claim's token.
pub fn claim_token_name(uid: &str) -> String {
    format!("{CLAIM_TOKEN_PREFIX}{uid}")
}

/// The claim uid a token of this name is bound to (the inverse of [`claim_token_name`]):
/// such names are ReserveClaim's alone.
pub fn claim_of_token_name(name: &str) -> Option<&str> {
    name.strip_prefix(CLAIM_TOKEN_PREFIX)
}

/// The Kubernetes claims' reservations of one arbiter ([`Arbiter::claims`]).
pub struct Claims<'a> {
    pub(super) arb: &'a Arc<Arbiter>,
}

impl Claims<'_> {
    /// Reserves `req.bytes` on `req.device` for claim `req.uid` under its tenant, now or
    /// never (a placement the scheduler made does not queue), and mints the worker token
    /// bound to it. The token is durable before the reservation exists; a refused
    /// reservation revokes it again. `FAILED_PRECONDITION` when the claim already has one.
    pub(crate) async fn reserve(&self, req: ClaimRequest, who: Who) -> BrokerResult<ClaimGrant> {
        self.check(&req)?;
        let spec = TokenSpec {
            tenant: Some(req.tenant.clone()),
            scope: Scope::Worker,
            ttl: None,
            name: claim_token_name(&req.uid),
            description: format!("ResourceClaim {}", req.label),
        };
        let by = who.clone();
        let issued = self
            .arb
            .changes()
            .run(move |arb| arb.changes().issue_token(spec, Some(&by)))
            .await?;
        let token_id = issued.entry.token_id.clone();
        match self.grant(&req, &token_id) {
            Ok(mut reservation) => {
                // The managed MPS daemon's variables for the claim's processes (none
                // without `--mps`): their pinned device memory limit is the reservation.
                let ask = process_ask(&req, reservation.bytes);
                match self
                    .arb
                    .reservations()
                    .env(req.device, reservation.bytes, &ask)
                {
                    Ok(env) => reservation.env = env,
                    Err(e) => {
                        self.undo(&req.uid, &token_id, who).await;
                        return Err(e);
                    }
                }
                let record = claim_record(&req, &reservation, &token_id);
                let kept = self
                    .arb
                    .changes()
                    .run(move |arb| arb.changes().commit(|s| s.put_claim(&record)))
                    .await;
                if let Err(e) = kept {
                    self.undo(&req.uid, &token_id, who).await;
                    return Err(e);
                }
                tracing::info!(claim = %req.uid, reservation = %reservation.id, tenant = %req.tenant, device = req.device, bytes = reservation.bytes, "claim reserved");
                Ok(ClaimGrant {
                    reservation,
                    token: issued.token,
                    token_id,
                })
            }
            Err(e) => {
                self.undo(&req.uid, &token_id, who).await;
                Err(e)
            }
        }
    }

    /// Revokes claim `uid`'s token (ending the sessions opened with it) and ends its
    /// reservation. `NOT_FOUND` when the claim has neither.
    pub(crate) async fn release(&self, uid: &str, who: Who) -> BrokerResult<()> {
        // The token first: its sessions end (their leases with them) before the room
        // they drew from goes.
        let name = claim_token_name(uid);
        let tokens: Vec<String> = self
            .arb
            .auth
            .list(None)
            .into_iter()
            .filter(|t| t.name == name)
            .map(|t| t.token_id)
            .collect();
        for id in &tokens {
            let (id, by) = (id.clone(), who.clone());
            match self
                .arb
                .changes()
                .run(move |arb| arb.changes().revoke_token(&id, Some(&by)))
                .await
            {
                Ok(()) | Err(BrokerError::NotFound(_)) => {}
                Err(e) => return Err(e),
            }
        }
        let ended = {
            let mut st = self.arb.lock();
            let found = st.reservations().of_claim(uid).map(|r| r.id);
            if let Some(id) = found {
                st.end_reservation(id);
            }
            found
        };
        let kept = self.forget(uid).await?;
        if ended.is_none() && tokens.is_empty() && !kept {
            return Err(BrokerError::NotFound(Missing::Claim(uid.to_string())));
        }
        tracing::info!(claim = %uid, reservation = ?ended, "claim released");
        Ok(())
    }

    /// Whether claim `uid` has its reservation here.
    pub(crate) fn is_held(&self, uid: &str) -> bool {
        self.arb.lock().reservations().of_claim(uid).is_some()
    }

    /// The claim reservations, oldest first.
    pub(crate) fn list(&self) -> Vec<(ClaimBinding, ReservationView)> {
        let st = self.arb.lock();
        let mut v: Vec<(ClaimBinding, ReservationView)> = st
            .reservations()
            .iter()
            .filter_map(|r| {
                let c = r.claim.clone()?;
                Some((c, r.view(self.arb.devices.uuid(r.device))))
            })
            .collect();
        v.sort_by_key(|(_, r)| (r.created, r.id));
        v
    }

    /// The request's values, the device's state and whether the claim is new.
    fn check(&self, req: &ClaimRequest) -> BrokerResult<()> {
        if req.uid.is_empty() || req.uid.len() > MAX_CLAIM_UID {
            return Err(BrokerError::InvalidArgument(format!(
                "claim uid must be 1-{MAX_CLAIM_UID} bytes"
            )));
        }
        if req.uid.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err(BrokerError::InvalidArgument(
                "claim uid must not contain spaces or control characters".into(),
            ));
        }
        self.arb.validate(super::AcquireRequest {
            tenant: req.tenant.clone(),
            session: uuid::Uuid::nil(),
            bytes: req.bytes,
            device: Some(req.device),
            wait: Duration::ZERO,
            label: req.label.clone(),
            reclaimable: false,
            fallback_host: false,
        })?;
        let st = self.arb.lock();
        if st.ledger().get(&req.tenant).is_none() {
            return Err(BrokerError::tenant_not_found(&req.tenant));
        }
        if st.reservations().of_claim(&req.uid).is_some() {
            return Err(BrokerError::FailedPrecondition(format!(
                "claim {} already has a reservation",
                req.uid
            )));
        }
        if let Some(e) = self.arb.avail.read().refusal(Some(req.device)) {
            return Err(e);
        }
        Ok(())
    }

    /// The reservation itself, under the state lock (the device's state checked again).
    fn grant(&self, req: &ClaimRequest, token_id: &str) -> BrokerResult<ReservationView> {
        let mut st = self.arb.lock();
        if let Some(e) = self.arb.avail.read().refusal(Some(req.device)) {
            return Err(e);
        }
        let gran = st.pools()[req.device as usize].granularity();
        let bytes = crate::units::round_up(req.bytes, gran).ok_or_else(|| {
            BrokerError::InvalidArgument(format!("size {} is too large", req.bytes))
        })?;
        let id = st.grant_claim(ClaimAsk {
            tenant: req.tenant.clone(),
            device: req.device,
            bytes,
            label: req.label.clone(),
            binding: ClaimBinding {
                uid: req.uid.clone(),
                token_id: token_id.to_string(),
            },
        })?;
        let r = st
            .reservations()
            .get(&id)
            .ok_or_else(|| BrokerError::Internal("a granted claim is gone".into()))?;
        let mut view = r.view(self.arb.devices.uuid(r.device));
        view.requested_bytes = req.bytes;
        Ok(view)
    }

    /// A claim that could not be reserved: its reservation (if made) ends and its token
    /// is revoked, so nothing of it is left.
    pub(super) async fn undo(&self, uid: &str, token_id: &str, who: Who) {
        // Only the reservation this call made (bound to its token): a concurrent reserve
        // of the same claim that won keeps its reservation and its stored record.
        let mine = {
            let mut st = self.arb.lock();
            let mine = st
                .reservations()
                .of_claim(uid)
                .filter(|r| r.claim.as_ref().is_some_and(|c| c.token_id == token_id))
                .map(|r| r.id);
            if let Some(id) = mine {
                st.end_reservation(id);
            }
            mine.is_some()
        };
        let id = token_id.to_string();
        if let Err(e) = self
            .arb
            .changes()
            .run(move |arb| arb.changes().revoke_token(&id, Some(&who)))
            .await
        {
            tracing::error!(claim = %uid, token_id, error = %e, "revoking a refused claim's token");
        }
        if mine {
            if let Err(e) = self.forget(uid).await {
                tracing::error!(claim = %uid, error = %e, "forgetting a refused claim");
            }
        }
    }

    /// Deletes claim `uid`'s record from the store; whether there was one.
    async fn forget(&self, uid: &str) -> BrokerResult<bool> {
        let uid = uid.to_string();
        self.arb
            .changes()
            .run(move |arb| arb.changes().commit(|s| s.delete_claim(&uid)))
            .await
    }

    /// Takes the stored claim reservations again (start, after the tenants and tokens):
    /// each with its id, bytes and token. A record whose token is gone (revoked, its tenant
    /// deleted) is stale and deleted; one that does not fit any more (its device changed,
    /// its quota shrank) is logged and left for the driver, whose next `ReserveClaim`
    /// reports why on the claim.
    pub(super) fn restore_all(&self, store: &crate::store::Store) -> BrokerResult<usize> {
        let records = store.load_claims().map_err(super::audit::store_err)?;
        let live = self.arb.auth.live_token_ids();
        let mut restored = 0;
        for c in records {
            if !live.contains(&c.token_id) {
                tracing::info!(claim = %c.uid, token_id = %c.token_id, "stored claim's token is gone: claim forgotten");
                store
                    .delete_claim(&c.uid)
                    .map_err(super::audit::store_err)?;
                continue;
            }
            match self.restore(&c) {
                Ok(()) => restored += 1,
                Err(e) => {
                    tracing::error!(claim = %c.uid, tenant = %c.tenant, device = c.device, bytes = c.bytes, error = %e, "a stored claim reservation was not taken again")
                }
            }
        }
        Ok(restored)
    }

    fn restore(&self, c: &ClaimRecord) -> BrokerResult<()> {
        let id = uuid::Uuid::parse_str(&c.reservation_id)
            .map_err(|e| BrokerError::Internal(format!("reservation id: {e}")))?;
        if (c.device as usize) < self.arb.devices.len()
            && self.arb.devices.uuid(c.device) != c.device_uuid
        {
            return Err(BrokerError::FailedPrecondition(format!(
                "device {} is now {}, not {}",
                c.device,
                self.arb.devices.uuid(c.device),
                c.device_uuid
            )));
        }
        let created = SystemTime::UNIX_EPOCH + Duration::from_millis(c.created_unix_ms);
        let ask = ClaimAsk {
            tenant: c.tenant.clone(),
            device: c.device,
            bytes: c.bytes,
            label: c.label.clone(),
            binding: ClaimBinding {
                uid: c.uid.clone(),
                token_id: c.token_id.clone(),
            },
        };
        let mut st = self.arb.lock();
        st.restore_claim(id, created, ask)?;
        tracing::info!(claim = %c.uid, reservation = %id, tenant = %c.tenant, device = c.device, bytes = c.bytes, "claim reservation taken again");
        Ok(())
    }
}

/// The claim as a process reservation's request, for the MPS daemon's variables.
fn process_ask(req: &ClaimRequest, bytes: u64) -> ReserveRequest {
    ReserveRequest {
        tenant: req.tenant.clone(),
        session: uuid::Uuid::nil(),
        bytes,
        device: Some(req.device),
        wait: Duration::ZERO,
        label: req.label.clone(),
        compute_percent: None,
    }
}

/// The store's record of a granted claim.
fn claim_record(req: &ClaimRequest, r: &ReservationView, token_id: &str) -> ClaimRecord {
    ClaimRecord {
        uid: req.uid.clone(),
        reservation_id: r.id.to_string(),
        tenant: req.tenant.clone(),
        device: r.device,
        device_uuid: r.device_uuid.clone(),
        bytes: r.bytes,
        label: req.label.clone(),
        token_id: token_id.to_string(),
        created_unix_ms: crate::units::unix_ms(r.created.unwrap_or_else(SystemTime::now)).max(0)
            as u64,
    }
}
