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

/// Who kept a memfd freed unrevoked (sealed against shrinking).
#[derive(Debug, PartialEq, Eq)]
pub struct KeptMemfd {
    /// The processes that answer for it: those found keeping it, or, when none was read
    /// through, those that could not be (none: a process the broker never saw).
    pub answering: Vec<u32>,
    /// Every process found keeping it or not read through: named, and looked at again.
    pub pids: Vec<u32>,
    /// The kernel says whether the file lives (`memfd_alive.rs`): that, not the named
    /// processes' exits, says when it is let go.
    pub by_handle: bool,
}

/// After the free of a memfd that could not be revoked, and the broker's own descriptor
/// closed: does anyone keep it, and who answers? Asks the kernel whether the file lives
/// (anyone at all, recorded or not: a child that read its parent's descriptor), then
/// looks at the live processes the broker recorded (`recorded`) for whom to charge.
/// `None`: nobody keeps it (or, the kernel not asked, none of `recorded` does).
pub fn memfd_kept(
    file: &crate::memfd_holders::MemFile,
    recorded: &[u32],
    prober: Option<&crate::memfd_alive::Prober>,
) -> Option<KeptMemfd> {
    use crate::memfd_alive::Alive;
    let ask = || match (file.handle.as_ref(), prober) {
        (Some(h), Some(p)) => p.alive(h),
        _ => Alive::Unknown,
    };
    let mut alive = ask();
    if alive == Alive::No {
        return None;
    }
    let found = crate::memfd_holders::holding(file.id, recorded);
    let nobody_named = found.holding.is_empty() && found.unknown.is_empty();
    // A copy of the descriptor the broker is closing (an undelivered ticket's) may hold
    // the file for a moment.
    let mut i = 0;
    while alive == Alive::Yes && nobody_named && i < REREADS {
        std::thread::sleep(REREAD_EVERY);
        alive = ask();
        i += 1;
    }
    kept_by(alive, found)
}

/// Who answers for a memfd kept, from the kernel's word (`alive`) and the look at the
/// recorded processes (`found`). A process is charged on a look that did not finish only
/// when no look finished on a keeper: the tenant of a process found keeping it answers
/// first, and one not read through is looked at again (`arbiter/stranded/looks.rs`).
fn kept_by(
    alive: crate::memfd_alive::Alive,
    found: crate::memfd_holders::Holders,
) -> Option<KeptMemfd> {
    use crate::memfd_alive::Alive;
    let nobody_named = found.holding.is_empty() && found.unknown.is_empty();
    let by_handle = match alive {
        Alive::No => return None,
        Alive::Yes => true,
        Alive::Unknown if nobody_named => return None,
        Alive::Unknown => false,
    };
    let answering = if found.holding.is_empty() {
        found.unknown.clone()
    } else {
        found.holding.clone()
    };
    let mut pids = found.holding;
    pids.extend(found.unknown);
    Some(KeptMemfd {
        answering,
        pids,
        by_handle,
    })
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

    /// Who answers for a kept memfd: a process whose look did not finish is charged only
    /// when no process was found keeping it, and is named (looked at again) either way;
    /// the kernel's "still held" with nobody found charges the block's tenant (a process
    /// the broker never saw: `answering` empty); its "gone" charges nobody.
    #[test]
    fn an_unfinished_look_answers_only_when_no_keeper_was_found() {
        use crate::memfd_alive::Alive;
        use crate::memfd_holders::Holders;
        let found = |holding: &[u32], unknown: &[u32]| Holders {
            holding: holding.to_vec(),
            unknown: unknown.to_vec(),
        };
        let k = kept_by(Alive::Yes, found(&[2], &[1])).unwrap();
        assert_eq!(
            (k.answering, k.pids, k.by_handle),
            (vec![2], vec![2, 1], true)
        );
        let k = kept_by(Alive::Unknown, found(&[], &[1])).unwrap();
        assert_eq!(
            (k.answering, k.pids, k.by_handle),
            (vec![1], vec![1], false)
        );
        let k = kept_by(Alive::Yes, found(&[], &[])).unwrap();
        assert_eq!((k.answering, k.pids, k.by_handle), (vec![], vec![], true));
        assert_eq!(kept_by(Alive::No, found(&[2], &[1])), None);
        assert_eq!(kept_by(Alive::Unknown, found(&[], &[])), None);
    }
}
