//! What happens to a holder that misses a reclaim deadline: a leaf, so the one default
//! (`defaults.rs`), the configuration's `--reclaim-policy` and the arbiter name one type.

/// What happens to a holder that misses a reclaim deadline (or whose lease an operator
/// revokes) while its process still runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReclaimPolicy {
    /// Revoke the lease and quarantine its memory until the process lets go or exits.
    Cooperative,
    /// Kill the holder process (pid from the Unix socket), then reuse the memory.
    Terminate,
}

impl ReclaimPolicy {
    /// Every policy.
    pub const ALL: [ReclaimPolicy; 2] = [ReclaimPolicy::Cooperative, ReclaimPolicy::Terminate];

    /// Its name in the configuration (`--reclaim-policy`).
    pub const fn name(self) -> &'static str {
        match self {
            ReclaimPolicy::Cooperative => "cooperative",
            ReclaimPolicy::Terminate => "terminate",
        }
    }

    /// The policy of that name.
    pub fn from_name(name: &str) -> Option<ReclaimPolicy> {
        ReclaimPolicy::ALL.into_iter().find(|p| p.name() == name)
    }
}

#[cfg(test)]
mod tests {
    use super::ReclaimPolicy;

    #[test]
    fn each_policy_reads_back_from_its_name() {
        for p in ReclaimPolicy::ALL {
            assert_eq!(ReclaimPolicy::from_name(p.name()), Some(p));
        }
        assert_eq!(ReclaimPolicy::from_name("kill"), None);
    }
}
