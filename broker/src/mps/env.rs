//! The environment an MPS client process gets for its reservation: the daemon's pipe
//! directory, the pinned device memory limit (the reservation's bytes) and the active
//! thread percentage (from `--compute` or the tenant's turn weight). Pure functions.

use std::path::Path;

/// A variable the driver reads at a client's first CUDA call.
pub const PIPE_DIRECTORY: &str = "CUDA_MPS_PIPE_DIRECTORY";
/// Where the MPS server of the client logs.
pub const LOG_DIRECTORY: &str = "CUDA_MPS_LOG_DIRECTORY";
/// `<ordinal>=<size>`: most device memory the client may pin (its own context included).
pub const PINNED_DEVICE_MEM_LIMIT: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
/// Share of the device's SMs the client may use, 1..=100.
pub const ACTIVE_THREAD_PERCENTAGE: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";

/// The MPS variables of one client process, in a fixed order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MpsEnv {
    pub vars: Vec<(String, String)>,
}

impl MpsEnv {
    /// The value of `name`, if set.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.vars
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The limit string for `bytes` on the client's device `ordinal`, in whole MiB rounded
/// down (the driver takes `M` and `G` suffixes; rounding down never grants more than the
/// reservation), at least 1 MiB.
pub fn pinned_limit(ordinal: u32, bytes: u64) -> String {
    let mib = (bytes >> 20).max(1);
    format!("{ordinal}={mib}M")
}

/// The active thread percentage of a client: `compute` when given (clamped to 1..=100),
/// else proportional to the tenant's turn weight against the heaviest weight among the
/// tenants (the heaviest gets 100), at least 1.
pub fn thread_percentage(compute: Option<u32>, weight: u32, max_weight: u32) -> u32 {
    if let Some(p) = compute {
        return p.clamp(1, 100);
    }
    let w = u64::from(weight.max(1));
    let max = u64::from(max_weight.max(weight).max(1));
    ((w * 100).div_ceil(max)).clamp(1, 100) as u32
}

/// The variables of a client that sees its reserved device as CUDA ordinal 0 (the runner
/// narrows `CUDA_VISIBLE_DEVICES` to that one device).
pub fn client_env(pipe_dir: &Path, log_dir: &Path, limit_bytes: u64, percentage: u32) -> MpsEnv {
    MpsEnv {
        vars: vec![
            (PIPE_DIRECTORY.into(), pipe_dir.display().to_string()),
            (LOG_DIRECTORY.into(), log_dir.display().to_string()),
            (PINNED_DEVICE_MEM_LIMIT.into(), pinned_limit(0, limit_bytes)),
            (
                ACTIVE_THREAD_PERCENTAGE.into(),
                percentage.clamp(1, 100).to_string(),
            ),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_is_whole_mib_rounded_down_never_zero() {
        assert_eq!(pinned_limit(0, 4 << 30), "0=4096M");
        assert_eq!(pinned_limit(1, (8 << 30) + 123), "1=8192M");
        assert_eq!(pinned_limit(0, (1 << 20) - 1), "0=1M");
        assert_eq!(pinned_limit(0, 0), "0=1M");
    }

    #[test]
    fn percentage_from_compute_or_weight() {
        assert_eq!(thread_percentage(Some(30), 4, 4), 30);
        assert_eq!(thread_percentage(Some(0), 4, 4), 1);
        assert_eq!(thread_percentage(Some(250), 1, 4), 100);
        assert_eq!(thread_percentage(None, 4, 4), 100);
        assert_eq!(thread_percentage(None, 2, 4), 50);
        assert_eq!(thread_percentage(None, 1, 4), 25);
        assert_eq!(thread_percentage(None, 1, 3), 34, "rounded up");
        assert_eq!(thread_percentage(None, 0, 0), 100, "weight 0 counts as 1");
        assert_eq!(thread_percentage(None, 8, 2), 100, "never above 100");
        assert_eq!(thread_percentage(None, 1, 1000), 1, "at least 1");
    }

    #[test]
    fn the_env_names_the_pipe_limit_and_share() {
        let e = client_env(
            Path::new("/run/b/mps"),
            Path::new("/var/b/log"),
            4 << 30,
            50,
        );
        assert_eq!(e.get(PIPE_DIRECTORY), Some("/run/b/mps"));
        assert_eq!(e.get(LOG_DIRECTORY), Some("/var/b/log"));
        assert_eq!(e.get(PINNED_DEVICE_MEM_LIMIT), Some("0=4096M"));
        assert_eq!(e.get(ACTIVE_THREAD_PERCENTAGE), Some("50"));
        assert_eq!(e.get("OTHER"), None);
    }
}
