//! The plain records of a lease as the broker reports it: [`LeaseInfo`] (what the list
//! calls and a grant return), how to reach its memory ([`LeaseHandle`]), its [`Tier`] and
//! [`LeaseState`], converted from the protobuf types. No behaviour: the held lease is
//! [`crate::Lease`].

use std::fmt;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;

use gpu_broker_proto::v1 as pb;

use crate::fd::FdInfo;

/// How to reach a lease's memory.
#[derive(Clone, PartialEq, Eq)]
pub enum LeaseHandle {
    /// Legacy (older brokers): a shared-memory file of the lease's size: [`Lease::map`](crate::Lease::map) it.
    HostShm(PathBuf),
    /// A file descriptor from the broker's ticket server (the only kind brokers serve): a memfd
    /// ([`Lease::map`](crate::Lease::map)) or CUDA VMM memory (`Lease::map_cuda`, `cuda` feature). The
    /// [`Lease`](crate::Lease) fetched it when it was granted.
    Fd(FdInfo),
    /// No handle, or a kind this client does not know yet.
    Unknown,
}

impl LeaseHandle {
    /// `"host_shm"`, `"fd"` or `"unknown"`.
    pub fn kind(&self) -> &'static str {
        match self {
            LeaseHandle::HostShm(_) => "host_shm",
            LeaseHandle::Fd(_) => "fd",
            LeaseHandle::Unknown => "unknown",
        }
    }
}

impl fmt::Debug for LeaseHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeaseHandle::HostShm(p) => f.debug_tuple("HostShm").field(p).finish(),
            LeaseHandle::Fd(i) => f.debug_tuple("Fd").field(i).finish(),
            LeaseHandle::Unknown => f.write_str("Unknown"),
        }
    }
}

/// Serialized as `{"host_shm": "<path>"}`,
/// `{"fd": {"memory_kind": .., "block_id": .., ..}}` (never the ticket) or `null`.
impl Serialize for LeaseHandle {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            LeaseHandle::HostShm(p) => {
                let mut m = s.serialize_map(Some(1))?;
                m.serialize_entry("host_shm", p)?;
                m.end()
            }
            LeaseHandle::Fd(i) => {
                let mut m = s.serialize_map(Some(1))?;
                m.serialize_entry("fd", i)?;
                m.end()
            }
            LeaseHandle::Unknown => s.serialize_none(),
        }
    }
}

impl From<Option<pb::lease::Handle>> for LeaseHandle {
    fn from(h: Option<pb::lease::Handle>) -> Self {
        match h {
            Some(pb::lease::Handle::HostShm(path)) => LeaseHandle::HostShm(PathBuf::from(path)),
            Some(pb::lease::Handle::Fd(h)) => LeaseHandle::Fd(FdInfo::from(h)),
            None => LeaseHandle::Unknown,
        }
    }
}

/// Where a lease's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Device (GPU) memory, or the host backend's simulated device memory.
    Device,
    /// Host shared memory granted as a fallback.
    Host,
    /// Not set by the broker.
    Unknown,
}

impl Tier {
    /// `"device"`, `"host"` or `"unknown"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Unknown => "unknown",
        }
    }
}

impl From<i32> for Tier {
    fn from(v: i32) -> Self {
        match pb::MemoryTier::try_from(v) {
            Ok(pb::MemoryTier::Device) => Tier::Device,
            Ok(pb::MemoryTier::Host) => Tier::Host,
            _ => Tier::Unknown,
        }
    }
}

/// Where a lease is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LeaseState {
    /// Held.
    Active,
    /// The broker asked the holder to give it back before a deadline.
    ReclaimRequested,
    /// Taken away; the memory stays quarantined until the holder lets go of it.
    Revoked,
    /// Not set by the broker.
    Unknown,
}

impl LeaseState {
    /// `"active"`, `"reclaim_requested"`, `"revoked"` or `"unknown"`.
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseState::Active => "active",
            LeaseState::ReclaimRequested => "reclaim_requested",
            LeaseState::Revoked => "revoked",
            LeaseState::Unknown => "unknown",
        }
    }
}

impl From<i32> for LeaseState {
    fn from(v: i32) -> Self {
        match pb::LeaseState::try_from(v) {
            Ok(pb::LeaseState::Active) => LeaseState::Active,
            Ok(pb::LeaseState::ReclaimRequested) => LeaseState::ReclaimRequested,
            Ok(pb::LeaseState::Revoked) => LeaseState::Revoked,
            _ => LeaseState::Unknown,
        }
    }
}

/// Everything the broker reports about a lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeaseInfo {
    /// UUID of the lease.
    pub lease_id: String,
    /// Device index.
    pub device: u32,
    /// Granted size (the request rounded up to the allocation granularity).
    pub bytes: u64,
    /// Size asked for.
    pub requested_bytes: u64,
    /// Offset of the lease inside the exported allocation.
    pub offset: u64,
    /// Free-form label given at acquire time.
    pub label: String,
    /// Session holding the lease.
    pub session_id: String,
    /// Tenant holding the lease.
    pub tenant: String,
    /// Life-cycle state.
    pub state: LeaseState,
    /// Device or host memory.
    pub tier: Tier,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_unix_ms: i64,
    /// The holder agreed to give it back on request.
    pub reclaimable: bool,
    /// Deadline of a pending reclaim request, milliseconds since the Unix epoch.
    pub reclaim_deadline_unix_ms: Option<i64>,
    /// Taken beyond the tenant's guarantee.
    pub borrowed: bool,
    /// How to map the memory.
    pub handle: LeaseHandle,
    /// UUID of the device (`GPU-...` / `HOST-...`; empty for host-fallback memory or an
    /// older broker).
    pub device_uuid: String,
}

impl LeaseInfo {
    /// Creation time.
    pub fn created(&self) -> SystemTime {
        unix_ms(self.created_unix_ms)
    }
}

pub(crate) fn unix_ms(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

impl From<pb::Lease> for LeaseInfo {
    fn from(l: pb::Lease) -> Self {
        LeaseInfo {
            state: LeaseState::from(l.state),
            tier: Tier::from(l.tier),
            handle: LeaseHandle::from(l.handle),
            reclaim_deadline_unix_ms: (l.reclaim_deadline_unix_ms != 0)
                .then_some(l.reclaim_deadline_unix_ms),
            lease_id: l.lease_id,
            device: l.device,
            bytes: l.bytes,
            requested_bytes: l.requested_bytes,
            offset: l.offset,
            label: l.label,
            session_id: l.session_id,
            tenant: l.tenant,
            created_unix_ms: l.created_unix_ms,
            reclaimable: l.reclaimable,
            borrowed: l.borrowed,
            device_uuid: l.device_uuid,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn proto_lease(handle: Option<pb::lease::Handle>) -> pb::Lease {
        pb::Lease {
            lease_id: "0b6e".into(),
            device: 1,
            bytes: 4 << 20,
            requested_bytes: 3 << 20,
            state: pb::LeaseState::Active as i32,
            tier: pb::MemoryTier::Host as i32,
            created_unix_ms: 1_700_000_000_000,
            handle,
            ..Default::default()
        }
    }

    #[test]
    fn converts_handles() {
        // A reply of an older broker with a legacy CUDA IPC handle (field 20, now reserved)
        // decodes to no handle: this client cannot open one.
        let old = pb::Lease::decode(&[0xa2, 0x01, 0x02, 0x07, 0x07][..]).unwrap();
        assert_eq!(LeaseInfo::from(old).handle, LeaseHandle::Unknown);
        let shm = LeaseInfo::from(proto_lease(Some(pb::lease::Handle::HostShm(
            "/dev/shm/x".into(),
        ))));
        assert_eq!(shm.handle, LeaseHandle::HostShm("/dev/shm/x".into()));
        assert_eq!(
            LeaseInfo::from(proto_lease(None)).handle,
            LeaseHandle::Unknown
        );
    }

    #[test]
    fn converts_fields() {
        let info = LeaseInfo::from(proto_lease(None));
        assert_eq!(info.tier, Tier::Host);
        assert_eq!(info.state, LeaseState::Active);
        assert_eq!(info.reclaim_deadline_unix_ms, None);
        assert_eq!(info.bytes, 4 << 20);
        assert_eq!(
            info.created(),
            UNIX_EPOCH + Duration::from_millis(1_700_000_000_000)
        );
        assert_eq!(Tier::from(0), Tier::Unknown);
        assert_eq!(Tier::from(99), Tier::Unknown);
        assert_eq!(LeaseState::from(3), LeaseState::Revoked);
    }

    #[test]
    fn serializes_to_json() {
        let mut info = LeaseInfo::from(proto_lease(Some(pb::lease::Handle::HostShm(
            "/dev/shm/a".into(),
        ))));
        let json = serde_json::to_value(&info).unwrap();
        assert_eq!(json["tier"], "host");
        assert_eq!(json["state"], "active");
        let json = serde_json::to_value(&info).unwrap();
        assert_eq!(json["handle"]["host_shm"], "/dev/shm/a");
        info.handle = LeaseHandle::Unknown;
        assert!(serde_json::to_value(&info).unwrap()["handle"].is_null());
    }
}
