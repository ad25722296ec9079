//! Defaults of the core's settings that the daemon's flags override (`gpu_broker::defaults`
//! re-exports them beside its own).

use std::time::Duration;

/// `--turn-quantum`: how long a compute turn may last while others wait.
pub const TURN_QUANTUM: Duration = Duration::from_millis(100);

/// `--turn-grace`: how long after a yield request a turn is taken.
pub const TURN_GRACE: Duration = Duration::from_millis(100);

/// `--turn-slots`: turn holders per device at once.
pub const TURN_SLOTS: u32 = 1;

/// `--turn-anticipation`: how long a tenant below its weighted share keeps the turn slot
/// it gave back (zero: never).
pub const TURN_ANTICIPATION: Duration = Duration::ZERO;
