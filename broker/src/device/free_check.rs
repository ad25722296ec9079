//! Whether a free gave the memory back: CUDA VMM memory lives until its last holder lets
//! go and the driver cannot revoke it, but it can say how much of the card is free. Once
//! the broker has released its allocation handle and closed its descriptor, the free
//! memory rises by the block only if no other process still holds an import of it
//! (measured on the H200: it did not rise while an importer held it).
//!
//! Other processes allocate and free on the card at the same moment, so the reading is
//! judged with a slack ([`FREE_SLACK`]): an allocation elsewhere larger than the slack
//! between the two readings makes a returned block look kept (its tenant is charged until
//! the processes that had its descriptor exit: the safe side); a free elsewhere of nearly
//! the block's size makes a kept block look returned (it stays outside the books, as it
//! did before this check).

use super::{Allocation, Device, DeviceError, Handle};
use std::time::Duration;

/// How much less than the block the free memory may rise and still count as given back
/// (at most half the block): the driver's own bookkeeping moves by less than a 2 MiB page.
pub const FREE_SLACK: u64 = 2 << 20;

/// Readings after the free when the memory did not come back at once, apart by
/// [`REREAD_EVERY`]: a copy of the descriptor the broker is about to close (an undelivered
/// ticket's, dropped just after the free was queued) may hold the memory for a moment.
const REREADS: u32 = 3;
const REREAD_EVERY: Duration = Duration::from_millis(2);

/// What a checked free found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Returned {
    /// The device's free memory rose by the block.
    Yes,
    /// It did not: someone outside the broker still holds the memory.
    No,
    /// The device could not say (its memory info failed).
    Unknown,
}

/// Did the free memory rise from `before` to `after` by about `bytes`?
pub fn came_back(before: u64, after: u64, bytes: u64) -> bool {
    let slack = FREE_SLACK.min(bytes / 2);
    after.saturating_add(slack) >= before.saturating_add(bytes)
}

/// Frees `alloc`, closes the broker's descriptor of it (`handle`) and reads the device's
/// free memory around both: [`Device::free_checked`]'s default.
pub fn free_measured(
    dev: &mut (impl Device + ?Sized),
    alloc: Allocation,
    handle: Option<Handle>,
) -> Result<Returned, DeviceError> {
    let bytes = alloc.bytes;
    let before = dev.mem_info().ok();
    dev.free(alloc)?;
    drop(handle);
    let Some(before) = before else {
        return Ok(Returned::Unknown);
    };
    for i in 0..=REREADS {
        if i > 0 {
            std::thread::sleep(REREAD_EVERY);
        }
        match dev.mem_info() {
            Ok(now) if came_back(before.free, now.free, bytes) => return Ok(Returned::Yes),
            Ok(_) => {}
            Err(_) => return Ok(Returned::Unknown),
        }
    }
    Ok(Returned::No)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_rise_by_the_block_within_the_slack_is_a_return_and_none_is_not() {
        assert!(came_back(10 * MIB, 74 * MIB, 64 * MIB));
        // Another process allocated 1 MiB meanwhile: still a return.
        assert!(came_back(10 * MIB, 73 * MIB, 64 * MIB));
        // 4 MiB allocated elsewhere: taken for kept (the tenant is charged: safe side).
        assert!(!came_back(10 * MIB, 70 * MIB, 64 * MIB));
        // Nothing rose: kept.
        assert!(!came_back(10 * MIB, 10 * MIB, 64 * MIB));
        // Free memory fell (others allocated): kept.
        assert!(!came_back(10 * MIB, 8 * MIB, 2 * MIB));
        // A 2 MiB block: the slack is half of it.
        assert!(came_back(0, 2 * MIB, 2 * MIB));
        assert!(came_back(0, MIB, 2 * MIB));
        assert!(!came_back(0, MIB - 1, 2 * MIB));
    }
}
