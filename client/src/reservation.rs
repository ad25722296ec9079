//! Process reservations for workers: device memory set aside for the calling process
//! (and its children) to allocate itself, e.g. an unmodified program's `cudaMalloc`.
//! Ask with `ReservationRequest::new(&session, bytes).wait(d).await`; it waits like a
//! lease request and ends with the session (or [`ProcessReservation::release`]). Leases
//! that sessions of the reserved process ask for on its device are drawn from it.
//! `gpu-brokerctl run` is built on it.

use crate::error::ClientError;
use crate::session::Session;
use crate::Client;
use gpu_broker_proto::v1 as pb;
use serde::Serialize;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::time::Duration;

/// A reservation request to refine, then `.await` (or `.send().await`).
#[must_use]
pub struct ReservationRequest<'s> {
    session: &'s Session,
    bytes: u64,
    device: Option<u32>,
    wait: Option<Duration>,
    label: String,
    compute_percent: Option<u32>,
}

impl<'s> ReservationRequest<'s> {
    /// `bytes` for the process of `session` (the process that opened it).
    pub fn new(session: &'s Session, bytes: u64) -> Self {
        ReservationRequest {
            session,
            bytes,
            device: None,
            wait: None,
            label: String::new(),
            compute_percent: None,
        }
    }

    /// On this device (default: where it fits best).
    pub fn device(mut self, device: u32) -> Self {
        self.device = Some(device);
        self
    }

    /// Waits up to `wait` in the queue (default: do not wait).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// A label shown to operators.
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = label.into();
        self
    }

    /// Share of the device's SMs under managed MPS (1-100).
    pub fn compute_percent(mut self, percent: u32) -> Self {
        self.compute_percent = Some(percent);
        self
    }

    /// Asks the broker.
    pub async fn send(self) -> Result<ProcessReservation, ClientError> {
        let client = self.session.client().clone();
        let reply = client
            .raw()
            .reserve_process_memory(pb::ReserveProcessMemoryRequest {
                session_id: self.session.id().to_string(),
                bytes: self.bytes,
                device: self.device,
                wait_ms: self.wait.map(|w| w.as_millis() as u64),
                label: self.label,
                compute_percent: self.compute_percent,
            })
            .await?
            .into_inner();
        let r = reply.reservation.unwrap_or_default();
        let mut mps_env: Option<Vec<(String, String)>> = reply
            .mps
            .map(|m| m.vars.into_iter().collect::<Vec<(String, String)>>());
        if let Some(v) = mps_env.as_mut() {
            v.sort();
        }
        Ok(ProcessReservation {
            client,
            info: ReservationInfo {
                reservation_id: r.reservation_id,
                session_id: r.session_id,
                tenant: r.tenant,
                device: r.device,
                device_uuid: r.device_uuid,
                bytes: r.bytes,
                requested_bytes: r.requested_bytes,
                drawn_bytes: r.drawn_bytes,
                pid: r.pid,
                mps_env,
            },
        })
    }
}

impl<'s> IntoFuture for ReservationRequest<'s> {
    type Output = Result<ProcessReservation, ClientError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 's>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.send())
    }
}

/// What the broker granted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReservationInfo {
    pub reservation_id: String,
    pub session_id: String,
    pub tenant: String,
    /// Broker device index.
    pub device: u32,
    /// `GPU-<uuid>` (or `HOST-<uuid>` on the host backend): for `CUDA_VISIBLE_DEVICES`.
    pub device_uuid: String,
    /// Rounded up to the device's granularity.
    pub bytes: u64,
    pub requested_bytes: u64,
    /// Of `bytes`, what leases of the process drew from it (at grant: 0).
    pub drawn_bytes: u64,
    /// The process it covers with its descendants (0: unknown).
    pub pid: u32,
    /// Environment for a client of the broker's managed MPS; `None` without it.
    pub mps_env: Option<Vec<(String, String)>>,
}

/// A live process reservation. It ends with its session; dropping it does nothing.
#[derive(Debug)]
pub struct ProcessReservation {
    client: Client,
    info: ReservationInfo,
}

impl ProcessReservation {
    /// What was granted.
    pub fn info(&self) -> &ReservationInfo {
        &self.info
    }

    /// Ends the reservation now (its session keeps going).
    pub async fn release(self) -> Result<(), ClientError> {
        self.client
            .raw()
            .release_process_memory(pb::ReleaseProcessMemoryRequest {
                reservation_id: self.info.reservation_id.clone(),
            })
            .await?;
        Ok(())
    }

    /// Names the process group of the program the reservation is for (its leader, a
    /// child of this process, e.g. started with `process_group(0)`): when the reservation
    /// ends, the broker stops what is left of the group.
    pub async fn set_process_group(&self, pgid: u32) -> Result<(), ClientError> {
        self.client
            .raw()
            .set_process_group(pb::SetProcessGroupRequest {
                reservation_id: self.info.reservation_id.clone(),
                pgid,
            })
            .await?;
        Ok(())
    }
}
