//! Which memory a charge draws on: the device's, or host memory (a lease that fell back
//! to the host). A leaf: the ledger charges by it, errors name it, leases carry it.

/// Which pool a charge draws on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Device,
    Host,
}
