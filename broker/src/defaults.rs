//! The broker's default settings, in one place: the command line's defaults
//! (`config.rs`, shown by `--help`) and the `Default` of each component's settings
//! (`ArbiterConfig`, `TurnConfig`, `HealthConfig`, the listeners' `Limits`, `RateConfig`,
//! the ticket table's TTL) are these values.

use crate::reclaim_policy::ReclaimPolicy;
use std::time::Duration;

pub use gpu_broker_core::defaults::*;

/// `--reclaim-policy`: what happens to a holder that misses its reclaim deadline.
pub const RECLAIM_POLICY: ReclaimPolicy = ReclaimPolicy::Cooperative;
/// `--ticket-ttl`: how long a lease ticket stays valid.
pub const TICKET_TTL: Duration = Duration::from_secs(30);
/// `--tenant-rpc-rate`: calls per second each tenant may make (0: no limit).
pub const TENANT_RPC_RATE: f64 = 0.0;
/// `--tenant-rpc-burst`: most calls a tenant may make in a burst above its rate.
pub const TENANT_RPC_BURST: f64 = 100.0;
/// `--shutdown-grace`: time sessions get to release their leases on shutdown.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// `--lock-hold-cpu-clock`: the state lock's holds are counted by the wall clock only (the
/// CPU clock is a system call on every take).
pub const LOCK_HOLD_CPU_CLOCK: bool = false;

/// `--reclaim-deadline`: time a holder has to release a lease after a reclaim request.
pub const RECLAIM_DEADLINE: Duration = Duration::from_secs(5);
/// `--token-review-cache`: how long the API server's answer about a ServiceAccount token
/// is trusted.
pub const TOKEN_REVIEW_CACHE: Duration = Duration::from_secs(30);
/// `--keepalive-timeout`: a quiet session ends after this.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(30);
/// `--quarantine-timeout`: quarantined memory of a holder with unknown pid is freed after this.
pub const QUARANTINE_TIMEOUT: Duration = Duration::from_secs(300);
/// First look again at memory a process kept after its free, where the broker can tell it
/// was let go (a memfd); then with backoff up to 64 times this (`arbiter/stranded/looks.rs`).
pub const KEPT_MEMORY_LOOK: Duration = Duration::from_secs(1);
/// `--max-sessions-per-tenant`.
pub const MAX_SESSIONS_PER_TENANT: usize = 1024;
/// `--max-waiting-per-tenant`.
pub const MAX_WAITING_PER_TENANT: usize = 1024;
/// `--process-stop-grace`: how long the processes left in an ended reservation's process
/// group have between SIGTERM and SIGKILL.
pub const PROCESS_STOP_GRACE: Duration = Duration::from_secs(10);
/// `--mps-health-interval`: how often the managed MPS daemon is checked.
pub const MPS_HEALTH_INTERVAL: Duration = Duration::from_secs(2);
/// `--health-interval`: how often the health monitor checks every device.
pub const HEALTH_INTERVAL: Duration = Duration::from_secs(5);
/// `--health-timeout`: a device that does not answer a check within this is unhealthy.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(10);
/// `--overtake-age`: a request blocked by held memory is overtaken by other tenants'
/// requests of its priority that fit only while it has waited less than this.
pub const OVERTAKE_AGE: Duration = Duration::from_secs(2);
/// Longest wait a request may ask for (not a flag).
pub const MAX_WAIT: Duration = Duration::from_secs(3600);
/// How often leasable memory is refreshed from the devices (not a flag).
pub const REFRESH_INTERVAL: Duration = Duration::from_secs(1);

/// A duration as the command line writes it (`5s`, `5m`, `100ms`), for clap's defaults.
pub fn text(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// `--admin-threads`: threads of the runtime of listings, operator reads and `/metrics`.
pub const ADMIN_THREADS: u16 = 2;

/// `--max-connections`: most open connections in all (0: derived from the descriptor limit).
pub const MAX_CONNECTIONS: usize = 0;
/// `--max-connections-per-uid`: most open connections of one peer uid on the Unix socket.
pub const MAX_CONNECTIONS_PER_UID: usize = 256;
/// `--admin-connection-reserve`: connections kept for root and the broker's own user.
pub const ADMIN_CONNECTION_RESERVE: usize = 16;
/// `--handshake-timeout`: a new connection must send its HTTP/2 preface within this.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// `--max-streams-per-connection`: most concurrent HTTP/2 streams on one connection.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 256;
/// `--max-unauthenticated-streams`: most open calls needing no token, per listener.
pub const MAX_UNAUTHENTICATED_STREAMS: usize = 128;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_back_as_themselves() {
        for d in [
            RECLAIM_DEADLINE,
            TOKEN_REVIEW_CACHE,
            KEEPALIVE_TIMEOUT,
            QUARANTINE_TIMEOUT,
            TURN_QUANTUM,
            TURN_GRACE,
            TURN_ANTICIPATION,
            PROCESS_STOP_GRACE,
            MPS_HEALTH_INTERVAL,
            HEALTH_INTERVAL,
            HEALTH_TIMEOUT,
            OVERTAKE_AGE,
            HANDSHAKE_TIMEOUT,
            TICKET_TTL,
            SHUTDOWN_GRACE,
        ] {
            assert_eq!(crate::units::parse_duration(&text(d)), Ok(d), "{}", text(d));
        }
        assert_eq!(text(QUARANTINE_TIMEOUT), "5m");
        assert_eq!(text(TURN_QUANTUM), "100ms");
    }
}
