//! What a broker says about itself ([`BrokerInfo`]: release, API revision, backend,
//! features) and the check this crate makes against it: a broker whose API revision is
//! below [`REQUIRED_API_REVISION`] (or that predates `GetInfo` altogether) gets a warning,
//! since calls this crate makes may be unknown to it.

use serde::Serialize;

use gpu_broker_proto::v1 as pb;

use crate::error::ClientError;

/// The broker API revision this crate is written against.
pub const REQUIRED_API_REVISION: u32 = 3;

/// A broker's description of itself.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct BrokerInfo {
    /// The broker's release.
    pub version: String,
    /// Its API revision.
    pub api_revision: u32,
    /// `"cuda"` or `"host"`.
    pub backend: String,
    pub device_count: u32,
    /// Optional features it has.
    pub features: Vec<String>,
    /// Each device's UUID by index (empty from a broker that does not say).
    pub device_uuids: Vec<String>,
    /// When the broker process started (Unix milliseconds; 0 from a broker that does not
    /// say).
    pub started_unix_ms: i64,
    /// Whether a keeper holds its sessions and leases across restarts.
    pub keeper: bool,
    /// What its start took back from the keeper.
    pub restart: Option<RestartInfo>,
}

/// What a broker start took back from its keeper.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RestartInfo {
    pub sessions_adopted: u32,
    /// Sessions whose process had died meanwhile (their leases were reclaimed).
    pub sessions_reclaimed: u32,
    pub leases_adopted: u32,
    pub leases_reclaimed: u32,
    pub bytes_adopted: u64,
    /// Blocks of ended leases held for importers: taken back, and let go.
    pub held_adopted: u32,
    pub held_let_go: u32,
    /// Imports let go while processes that may map them live: taken back, and ended.
    pub lingering_adopted: u32,
    pub lingering_ended: u32,
    /// Charges of memory kept outside the broker after its free: charged again (and
    /// their bytes), and lifted (no holder lives).
    pub stranded_adopted: u32,
    pub stranded_bytes: u64,
    pub stranded_lifted: u32,
    /// The start's wall time, from the process's start to the last lease taken back
    /// (steps that overlap counted once).
    pub took_ms: u64,
    /// Where the start's time went, step by step (name, microseconds), from the
    /// process's start to serving; some steps overlap (the broker's `RestartPhase`).
    pub phases: Vec<(String, u64)>,
}

impl From<pb::GetInfoResponse> for BrokerInfo {
    fn from(r: pb::GetInfoResponse) -> Self {
        BrokerInfo {
            version: r.version,
            api_revision: r.api_revision,
            backend: r.backend,
            device_count: r.device_count,
            features: r.features,
            device_uuids: r.device_uuids,
            started_unix_ms: r.started_unix_ms,
            keeper: r.keeper,
            restart: r.restart.map(|x| RestartInfo {
                sessions_adopted: x.sessions_adopted,
                sessions_reclaimed: x.sessions_reclaimed,
                leases_adopted: x.leases_adopted,
                leases_reclaimed: x.leases_reclaimed,
                bytes_adopted: x.bytes_adopted,
                held_adopted: x.held_adopted,
                held_let_go: x.held_let_go,
                lingering_adopted: x.lingering_adopted,
                lingering_ended: x.lingering_ended,
                stranded_adopted: x.stranded_adopted,
                stranded_bytes: x.stranded_bytes,
                stranded_lifted: x.stranded_lifted,
                took_ms: x.took_ms,
                phases: x.phases.into_iter().map(|p| (p.name, p.micros)).collect(),
            }),
        }
    }
}

/// The warning to give about a broker, given what `GetInfo` returned; `None`: it is new
/// enough, or it could not be asked for reasons that its real calls will report.
pub fn version_warning(info: &Result<BrokerInfo, ClientError>) -> Option<String> {
    match info {
        Ok(i) if i.api_revision < REQUIRED_API_REVISION => Some(format!(
            "the broker (version {}, API revision {}) is older than this client needs (API revision {REQUIRED_API_REVISION}): some calls may fail as unimplemented; upgrade the broker",
            i.version, i.api_revision
        )),
        Ok(_) => None,
        Err(e) if e.code() == crate::Code::Unimplemented => Some(format!(
            "the broker predates API revision {REQUIRED_API_REVISION} (it has no GetInfo): some calls may fail as unimplemented; upgrade the broker"
        )),
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn older_brokers_are_named() {
        let old = Ok(BrokerInfo {
            version: "0.0.9".into(),
            api_revision: 1,
            ..Default::default()
        });
        assert!(version_warning(&old).unwrap().contains("0.0.9"));
        let new = Ok(BrokerInfo {
            api_revision: REQUIRED_API_REVISION,
            ..Default::default()
        });
        assert_eq!(version_warning(&new), None);
        let none = Err(ClientError::from(tonic::Status::unimplemented("x")));
        assert!(version_warning(&none).unwrap().contains("predates"));
        let denied = Err(ClientError::from(tonic::Status::unauthenticated("x")));
        assert_eq!(version_warning(&denied), None);
    }
}
