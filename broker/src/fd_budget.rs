//! The broker's descriptor budget. Every block holds a descriptor from its allocation to
//! its free (an exported CUDA object, a memfd), a published memfd one more (its importers'
//! read-only reopen), and every watched process a pidfd. These are counted against the
//! process's descriptor limit (`RLIMIT_NOFILE`, read when the arbiter starts) less a
//! reserve kept for what a client cannot be refused without harm: accepting connections
//! (`--max-connections`), the operators, the listeners, the state file, the ticket and
//! metrics connections, the runtime's own. A new block that would eat into the reserve is
//! refused ([`BrokerError::OutOfDescriptors`]), so many small leases end in a clear
//! refusal, not in a broker that cannot accept a connection. Also the limit itself: read,
//! and raised to the hard limit at start.
//!
//! Known slack: a block's count is given back at its free, while a ticket minted for it
//! may keep the descriptor open until the ticket is redeemed or expires (bounded by the
//! per-lease ticket cap and the ticket TTL); and the reserve is at most half the limit, so
//! under a limit below twice `--max-connections` + 1,024 a full broker can still run out
//! (raise `LimitNOFILE`, as the shipped unit does).

pub use gpu_broker_core::fd_budget::{FdBudget, FdHeld};

/// Descriptors kept beyond the connections: the listeners, the state file, the metrics
/// (64) and ticket (272) connections, the runtime's and the drivers' own (512), the
/// workers' descriptor channels (`fd::descriptor_channels::MAX_CHANNELS`) and sessions'
/// lease lines (`fd::lease_line::MAX_LINES`).
pub const RESERVE_BEYOND_CONNECTIONS: usize =
    512 + crate::fd::descriptor_channels::MAX_CHANNELS + crate::fd::lease_line::MAX_LINES;

/// The reserve to keep with `max_connections` connections allowed: those and
/// [`RESERVE_BEYOND_CONNECTIONS`], but never more than half the limit (a broker under a
/// small limit still grants leases).
pub fn reserve_for(max_connections: usize) -> usize {
    (max_connections + RESERVE_BEYOND_CONNECTIONS).min(nofile_limit() / 2)
}

/// `--max-connections 0`: half of the descriptor limit, 32 to 4096.
pub fn default_max_connections() -> usize {
    (nofile_limit() / 2).clamp(32, 4096)
}

/// The soft `RLIMIT_NOFILE` of this process.
pub fn nofile_limit() -> usize {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return 1024;
    }
    usize::try_from(r.rlim_cur).unwrap_or(usize::MAX)
}

/// Raises the soft descriptor limit to the hard one (systemd's soft default is 1024);
/// returns the soft limit now in force.
pub fn raise_nofile_limit() -> usize {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            let want = libc::rlimit {
                rlim_cur: r.rlim_max,
                rlim_max: r.rlim_max,
            };
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &want);
        }
    }
    nofile_limit()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_keeps_at_most_half_the_limit() {
        assert!(reserve_for(usize::MAX / 4) <= nofile_limit() / 2);
        assert_eq!(
            reserve_for(0),
            RESERVE_BEYOND_CONNECTIONS.min(nofile_limit() / 2)
        );
    }
}
