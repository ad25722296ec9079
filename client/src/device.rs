//! Devices as the admin service reports them: capacity, what the broker may lease,
//! and where every byte is (leased, cached for reuse, quarantined, used outside the
//! broker).

use serde::Serialize;

use gpu_broker_proto::v1 as pb;

/// One device the broker manages.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DeviceInfo {
    /// Device index (as used in lease requests).
    pub index: u32,
    /// Device name (e.g. `NVIDIA H200`).
    pub name: String,
    /// `"cuda"` or `"host"`.
    pub backend: String,
    /// Total memory of the device.
    pub total_bytes: u64,
    /// Free right now, as the driver reports it.
    pub free_bytes: u64,
    /// Most the broker will hand out.
    pub leasable_bytes: u64,
    /// Held by leases.
    pub leased_bytes: u64,
    /// Freed blocks kept for reuse.
    pub cached_bytes: u64,
    /// Kept free so nobody hits an out-of-memory error.
    pub headroom_bytes: u64,
    /// Revoked or abandoned memory that may still be mapped.
    pub quarantined_bytes: u64,
    /// Memory used on the device outside the broker (and outside process reservations).
    pub external_used_bytes: u64,
    /// Kept for reserved processes to allocate themselves (`gpu-brokerctl run`).
    pub process_reserved_bytes: u64,
    /// Allocation granularity: lease sizes round up to a multiple of it.
    pub granularity_bytes: u64,
    /// Live leases on the device.
    pub lease_count: u32,
    /// Requests waiting for this device.
    pub waiting_requests: u32,
    /// Tenant holding the compute turn ("" when free).
    pub turn_holder: String,
    /// Requests waiting for the compute turn.
    pub turns_waiting: u32,
    /// Stable identity: `GPU-<uuid>` (as `nvidia-smi` prints it) or `HOST-<uuid>` for a
    /// simulated device. Empty from a broker that predates it.
    pub uuid: String,
    /// Product name (e.g. `NVIDIA H200`).
    pub model: String,
    /// Draining for maintenance (no new leases), and why.
    pub draining: bool,
    pub drain_reason: String,
    /// Marked unhealthy (no new leases), and why.
    pub unhealthy: bool,
    pub health_reason: String,
    /// The broker's managed MPS daemon: "" without `--mps`, else "starting", "running",
    /// "down" (MPS reservations refused) or "stopped"; with a one-line detail.
    pub mps_state: String,
    pub mps_detail: String,
    /// Client processes connected to the MPS servers.
    pub mps_clients: u32,
    /// Compute mode as NVML reports it ("" when not read).
    pub compute_mode: String,
    /// Holders of compute turns now (at most the broker's `--turn-slots`).
    pub turn_holders: u32,
}

impl From<pb::DeviceInfo> for DeviceInfo {
    fn from(d: pb::DeviceInfo) -> Self {
        DeviceInfo {
            index: d.index,
            name: d.name,
            backend: d.backend,
            total_bytes: d.total_bytes,
            free_bytes: d.free_bytes,
            leasable_bytes: d.leasable_bytes,
            leased_bytes: d.leased_bytes,
            cached_bytes: d.cached_bytes,
            headroom_bytes: d.headroom_bytes,
            quarantined_bytes: d.quarantined_bytes,
            external_used_bytes: d.external_used_bytes,
            process_reserved_bytes: d.process_reserved_bytes,
            granularity_bytes: d.granularity_bytes,
            lease_count: d.lease_count,
            waiting_requests: d.waiting_requests,
            turn_holder: d.turn_holder,
            turns_waiting: d.turns_waiting,
            uuid: d.uuid,
            model: d.model,
            draining: d.draining,
            drain_reason: d.drain_reason,
            unhealthy: d.unhealthy,
            health_reason: d.health_reason,
            mps_state: d.mps_state,
            mps_detail: d.mps_detail,
            mps_clients: d.mps_clients,
            compute_mode: d.compute_mode,
            turn_holders: d.turn_holders,
        }
    }
}
