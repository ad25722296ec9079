//! Draining as the admin service reports it: [`DrainStatus`] (every device: draining or
//! not, since when, until when, what is still on it) and [`DeviceDrain`].

use serde::Serialize;

use gpu_broker_proto::v1 as pb;

/// Progress of one device.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DeviceDrain {
    pub index: u32,
    pub uuid: String,
    pub draining: bool,
    /// When the drain started, ms since the epoch (`None`: not draining).
    pub since_unix_ms: Option<i64>,
    /// When holders were asked to be done, ms since the epoch.
    pub deadline_unix_ms: Option<i64>,
    pub reason: String,
    /// Leases still on the device, and their bytes.
    pub leases: u32,
    pub bytes: u64,
    /// Of those, asked to be released and not yet gone.
    pub reclaim_requested: u32,
    /// Of those, not reclaimable (left to their holders).
    pub not_reclaimable: u32,
    /// Memory of ended leases a holder may still map.
    pub quarantined_bytes: u64,
}

impl DeviceDrain {
    /// Nothing left on the device.
    pub fn is_empty(&self) -> bool {
        self.leases == 0 && self.quarantined_bytes == 0
    }
}

/// Progress of every device.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DrainStatus {
    pub devices: Vec<DeviceDrain>,
    /// Every draining device is empty.
    pub complete: bool,
}

impl From<pb::DrainResponse> for DrainStatus {
    fn from(r: pb::DrainResponse) -> Self {
        let opt = |v: i64| (v != 0).then_some(v);
        DrainStatus {
            complete: r.complete,
            devices: r
                .devices
                .into_iter()
                .map(|d| DeviceDrain {
                    index: d.index,
                    uuid: d.uuid,
                    draining: d.draining,
                    since_unix_ms: opt(d.since_unix_ms),
                    deadline_unix_ms: opt(d.deadline_unix_ms),
                    reason: d.reason,
                    leases: d.leases,
                    bytes: d.bytes,
                    reclaim_requested: d.reclaim_requested,
                    not_reclaimable: d.not_reclaimable,
                    quarantined_bytes: d.quarantined_bytes,
                })
                .collect(),
        }
    }
}
