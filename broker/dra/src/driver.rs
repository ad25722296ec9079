//! Preparing and unpreparing claims, one at a time (one lock over the checkpoint).
//!
//! Prepare: the ResourceClaim is read from the API server (the kubelet sends only its
//! namespace, name and uid); its allocation on this driver (`allocation.rs`) becomes a
//! claim reservation at the broker under the tenant of the claim's namespace, with a token
//! bound to it; the token and the variables reach the container through a CDI spec.
//! The checkpoint says `PrepareStarted` before the broker is asked and `PrepareCompleted`
//! once everything exists; a second prepare of a completed claim answers from it. A
//! started one found later (the plugin died in the middle) is rolled back and prepared
//! afresh; entries of another boot are rolled back when the driver opens.
//!
//! Unprepare: the reservation ends and its token is revoked at the broker, the CDI spec
//! and token file are removed, the entry goes. An unknown claim is done already.
//!
//! A restarted broker takes its claim reservations and their tokens back from its store;
//! one it does not hold any more (its state lost, released by an operator, no longer
//! fitting) is reserved again by [`Driver::reserve_lost`], which rewrites the token file
//! in place.
//!
//! What a claim cannot get (over its tenant's quota, no room, not allocated here) is an
//! error on that claim, returned to the kubelet in its response.

use crate::allocation::{allocated, Allocated};
use crate::broker::Broker;
use crate::cdi::{CdiLayout, ClaimEdits};
use crate::checkpoint::{
    boot_id, Checkpoint, CheckpointError, CheckpointFile, ClaimEntry, ClaimState, PreparedDevice,
};
use k8s_openapi::api::resource::v1::ResourceClaim;
use std::collections::{BTreeMap, HashMap};
use tokio::sync::Mutex;

/// A claim as the kubelet names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// Which tenant a namespace's claims are charged to: the namespace's own name unless
/// mapped (`--tenant NAMESPACE=TENANT`).
#[derive(Clone, Debug, Default)]
pub struct TenantMap(pub HashMap<String, String>);

impl TenantMap {
    pub fn tenant_of<'a>(&'a self, namespace: &'a str) -> &'a str {
        self.0
            .get(namespace)
            .map(String::as_str)
            .unwrap_or(namespace)
    }
}

/// How the driver is set up.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    pub driver_name: String,
    pub tenants: TenantMap,
    /// A CDI kind for the GPU itself (NVIDIA's toolkit: `nvidia.com/gpu`), whose
    /// `<kind>=<uuid>` device is returned beside the claim's; none on the host backend.
    pub gpu_cdi_kind: Option<String>,
}

/// The driver's node side.
pub struct Driver {
    cfg: DriverConfig,
    broker: Broker,
    kube: kube::Client,
    layout: CdiLayout,
    file: CheckpointFile,
    /// The checkpoint as on disk; held for the whole of each prepare and unprepare, so
    /// claims are handled one at a time.
    state: Mutex<Checkpoint>,
}

impl Driver {
    /// Opens the checkpoint and rolls back what it must: prepares left half-done by a
    /// previous run, and every claim of another boot (the broker's memory did not outlive
    /// it; its token did, and is revoked).
    pub async fn open(
        cfg: DriverConfig,
        broker: Broker,
        kube: kube::Client,
        layout: CdiLayout,
        file: CheckpointFile,
    ) -> Result<Driver, CheckpointError> {
        let mut ck = {
            let reading = file.clone();
            on_blocking_thread(move || reading.load())
                .await
                .map_err(|e| file_work_stopped(&file, e))??
        };
        let boot = boot_id();
        let driver = Driver {
            cfg,
            broker,
            kube,
            layout,
            file,
            state: Mutex::new(Checkpoint::default()),
        };
        let other_boot = ck.boot_id != boot;
        let undo: Vec<String> = ck
            .claims
            .iter()
            .filter(|(_, e)| other_boot || e.state == ClaimState::PrepareStarted)
            .map(|(uid, _)| uid.clone())
            .collect();
        ck.boot_id = boot;
        for uid in undo {
            match driver.roll_back(&uid).await {
                Ok(()) => {
                    ck.claims.remove(&uid);
                }
                // Kept: the next prepare or unprepare of the claim tries again.
                Err(e) => tracing::warn!(claim = %uid, error = %e, "rolling back a claim at start"),
            }
        }
        {
            let (file, saved) = (driver.file.clone(), ck.clone());
            on_blocking_thread(move || file.save(&saved))
                .await
                .map_err(|e| file_work_stopped(&driver.file, e))??;
        }
        *driver.state.lock().await = ck;
        Ok(driver)
    }

    /// Prepares each claim; the answer per claim uid.
    pub async fn prepare(
        &self,
        claims: &[ClaimRef],
    ) -> BTreeMap<String, Result<PreparedDevice, String>> {
        let mut out = BTreeMap::new();
        let mut ck = self.state.lock().await;
        for c in claims {
            let r = self.prepare_one(&mut ck, c).await;
            if let Err(e) = &r {
                tracing::warn!(claim = %c.uid, namespace = %c.namespace, name = %c.name, error = %e, "prepare failed");
            }
            out.insert(c.uid.clone(), r);
        }
        out
    }

    /// Unprepares each claim; the answer per claim uid.
    pub async fn unprepare(&self, claims: &[ClaimRef]) -> BTreeMap<String, Result<(), String>> {
        let mut out = BTreeMap::new();
        let mut ck = self.state.lock().await;
        for c in claims {
            let r = self.unprepare_one(&mut ck, &c.uid).await;
            if let Err(e) = &r {
                tracing::warn!(claim = %c.uid, error = %e, "unprepare failed");
            }
            out.insert(c.uid.clone(), r);
        }
        out
    }

    /// Unprepares every prepared claim whose ResourceClaim is gone from the API server (or
    /// was made again under another uid): the kubelet will not ask for those. Returns the
    /// uids cleaned.
    pub async fn clean_stale(&self) -> Vec<String> {
        let entries: Vec<(String, ClaimEntry)> = {
            let ck = self.state.lock().await;
            ck.claims
                .iter()
                .map(|(u, e)| (u.clone(), e.clone()))
                .collect()
        };
        let mut cleaned = Vec::new();
        for (uid, e) in entries {
            let api: kube::Api<ResourceClaim> =
                kube::Api::namespaced(self.kube.clone(), &e.namespace);
            let gone = match api.get_opt(&e.name).await {
                Ok(None) => true,
                Ok(Some(c)) => c.metadata.uid.as_deref() != Some(uid.as_str()),
                Err(err) => {
                    tracing::debug!(claim = %uid, error = %err, "reading a claim for the stale check");
                    false
                }
            };
            if gone {
                let mut ck = self.state.lock().await;
                match self.unprepare_one(&mut ck, &uid).await {
                    Ok(()) => {
                        tracing::info!(claim = %uid, namespace = %e.namespace, name = %e.name, "stale claim cleaned up");
                        cleaned.push(uid);
                    }
                    Err(err) => {
                        tracing::warn!(claim = %uid, error = %err, "cleaning a stale claim")
                    }
                }
            }
        }
        cleaned
    }

    /// Reserves again at the broker every prepared claim it no longer holds (its state
    /// lost, released behind the driver's back, not taken again at a restart): the old token
    /// is revoked, a new one written over the claim's token file (the container's mount
    /// sees it) and the CDI spec rewritten. Returns the uids reserved again.
    pub async fn reserve_lost(&self) -> Vec<String> {
        let held: std::collections::HashSet<String> = match self.broker.list_claims().await {
            Ok(c) => c.into_iter().map(|c| c.claim).collect(),
            Err(e) => {
                tracing::debug!(error = %e, "listing the broker's claims");
                return Vec::new();
            }
        };
        let mut ck = self.state.lock().await;
        let lost: Vec<(String, ClaimEntry)> = ck
            .claims
            .iter()
            .filter(|(uid, e)| e.state == ClaimState::PrepareCompleted && !held.contains(*uid))
            .map(|(u, e)| (u.clone(), e.clone()))
            .collect();
        let mut again = Vec::new();
        for (uid, e) in lost {
            let Some(d) = e.device.clone() else { continue };
            let c = ClaimRef {
                namespace: e.namespace.clone(),
                name: e.name.clone(),
                uid: uid.clone(),
            };
            let a = Allocated {
                request: d.request,
                pool: d.pool,
                device: d.device,
                index: e.index,
                bytes: e.bytes,
                share_id: d.share_id,
            };
            if let Err(err) = self.broker.release_claim(&uid).await {
                tracing::warn!(claim = %uid, error = %err, "revoking a lost claim's token");
                continue;
            }
            match self.reserve(&c, &a).await {
                Ok((reservation_id, device)) => {
                    if let Some(entry) = ck.claims.get_mut(&uid) {
                        entry.reservation_id = reservation_id;
                        entry.device = Some(device);
                    }
                    if let Err(err) = self.save(&ck).await {
                        tracing::error!(claim = %uid, error = %err, "recording a claim reserved again");
                    }
                    tracing::info!(claim = %uid, bytes = e.bytes, "claim reserved again at the broker");
                    again.push(uid);
                }
                Err(err) => {
                    tracing::warn!(claim = %uid, error = %err, "reserving a lost claim again")
                }
            }
        }
        again
    }

    /// The checkpoint as it stands.
    pub async fn checkpoint(&self) -> Checkpoint {
        self.state.lock().await.clone()
    }

    async fn prepare_one(
        &self,
        ck: &mut Checkpoint,
        c: &ClaimRef,
    ) -> Result<PreparedDevice, String> {
        match ck.claims.get(&c.uid) {
            Some(e) if e.state == ClaimState::PrepareCompleted => {
                if let Some(d) = &e.device {
                    return Ok(d.clone());
                }
            }
            Some(_) => {
                // A prepare that did not finish: undo what it did, then start again.
                self.roll_back(&c.uid).await?;
                ck.claims.remove(&c.uid);
                self.save(ck).await?;
            }
            None => {}
        }
        let api: kube::Api<ResourceClaim> = kube::Api::namespaced(self.kube.clone(), &c.namespace);
        let claim = api
            .get(&c.name)
            .await
            .map_err(|e| format!("reading ResourceClaim {}/{}: {e}", c.namespace, c.name))?;
        let a = allocated(&claim, &c.uid, &self.cfg.driver_name)
            .map_err(|e| format!("ResourceClaim {}/{}: {e}", c.namespace, c.name))?;
        ck.claims.insert(
            c.uid.clone(),
            ClaimEntry {
                state: ClaimState::PrepareStarted,
                namespace: c.namespace.clone(),
                name: c.name.clone(),
                reservation_id: String::new(),
                device: None,
                index: a.index,
                bytes: a.bytes,
            },
        );
        self.save(ck).await?;
        match self.reserve(c, &a).await {
            Ok((reservation_id, device)) => {
                ck.claims.insert(
                    c.uid.clone(),
                    ClaimEntry {
                        state: ClaimState::PrepareCompleted,
                        namespace: c.namespace.clone(),
                        name: c.name.clone(),
                        reservation_id,
                        device: Some(device.clone()),
                        index: a.index,
                        bytes: a.bytes,
                    },
                );
                self.save(ck).await?;
                tracing::info!(claim = %c.uid, namespace = %c.namespace, name = %c.name, device = %a.device, bytes = a.bytes, "claim prepared");
                Ok(device)
            }
            Err(e) => {
                if self.roll_back(&c.uid).await.is_ok() {
                    ck.claims.remove(&c.uid);
                    self.save(ck).await?;
                }
                Err(e)
            }
        }
    }

    /// The broker's reservation and the CDI spec of an allocated claim.
    async fn reserve(
        &self,
        c: &ClaimRef,
        a: &Allocated,
    ) -> Result<(String, PreparedDevice), String> {
        let tenant = self.cfg.tenants.tenant_of(&c.namespace).to_string();
        let r = self
            .broker
            .reserve_claim(gpu_broker_proto::v1::ReserveClaimRequest {
                claim: c.uid.clone(),
                tenant: tenant.clone(),
                bytes: a.bytes,
                device: a.index,
                label: format!("{}/{}", c.namespace, c.name),
            })
            .await
            .map_err(|s| {
                format!(
                    "gpu-broker refused {} bytes on {} for tenant {tenant:?}: {:?}: {}",
                    a.bytes,
                    a.device,
                    s.code(),
                    s.message()
                )
            })?;
        let res = r.reservation.unwrap_or_default();
        let mut mps_env: Vec<(String, String)> = r.mps_env.into_iter().collect();
        mps_env.sort();
        let edits = ClaimEdits {
            token: r.token,
            reservation_id: res.reservation_id.clone(),
            device_index: a.index,
            device_uuid: res.device_uuid.clone(),
            mps_env,
        };
        let (layout, uid) = (self.layout.clone(), c.uid.clone());
        let mut cdi_ids = vec![on_blocking_thread(move || layout.write(&uid, &edits))
            .await?
            .map_err(|e| format!("writing the claim's CDI spec: {e}"))?];
        if let Some(kind) = &self.cfg.gpu_cdi_kind {
            if !res.device_uuid.starts_with("HOST-") {
                cdi_ids.push(format!("{kind}={}", res.device_uuid));
            }
        }
        Ok((
            res.reservation_id,
            PreparedDevice {
                request: a.request.clone(),
                pool: a.pool.clone(),
                device: a.device.clone(),
                cdi_ids,
                share_id: a.share_id.clone(),
            },
        ))
    }

    async fn unprepare_one(&self, ck: &mut Checkpoint, uid: &str) -> Result<(), String> {
        // Also without an entry: a checkpoint lost or a claim of an older plugin leaves
        // nothing behind at the broker either.
        self.roll_back(uid).await?;
        if ck.claims.remove(uid).is_some() {
            self.save(ck).await?;
            tracing::info!(claim = %uid, "claim unprepared");
        }
        Ok(())
    }

    /// Ends the claim's reservation and token at the broker (if it has them) and removes
    /// its CDI spec and token file (if there).
    async fn roll_back(&self, uid: &str) -> Result<(), String> {
        self.broker.release_claim(uid).await.map_err(|s| {
            format!(
                "gpu-broker: releasing claim {uid}: {:?}: {}",
                s.code(),
                s.message()
            )
        })?;
        let (layout, owned) = (self.layout.clone(), uid.to_string());
        on_blocking_thread(move || layout.remove(&owned))
            .await?
            .map_err(|e| format!("removing claim {uid}'s CDI spec: {e}"))
    }

    async fn save(&self, ck: &Checkpoint) -> Result<(), String> {
        let (file, ck) = (self.file.clone(), ck.clone());
        on_blocking_thread(move || file.save(&ck))
            .await?
            .map_err(|e| e.to_string())
    }
}

/// Runs file work that syncs to disk (the checkpoint, a claim's token file and CDI spec)
/// on tokio's blocking threads: an fsync can take long, and would hold up the runtime's
/// workers meanwhile (the kubelet's other calls, the health stream, the publisher).
async fn on_blocking_thread<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| format!("file work stopped: {e}"))
}

fn file_work_stopped(file: &CheckpointFile, why: String) -> CheckpointError {
    CheckpointError::Io {
        path: file.path().to_path_buf(),
        source: std::io::Error::other(why),
    }
}
