//! Overtaking a request blocked by held memory. Such a request (the head) cannot use the
//! free memory anyway, so while it is young, requests of *other* tenants of its priority
//! that fit are granted ahead of it: memory is used instead of kept idle, and a big waiter
//! does not get everyone of its priority refused. Once the head has waited
//! `--overtake-age` it blocks its devices for everyone ranked after it, so memory that
//! comes back accumulates for it and it is granted within that age plus the time the
//! holders take to release: it cannot starve. The rule is an age, not a count of
//! overtakes: a count is spent in milliseconds by a busy tenant (utilization falls back to
//! what is held) and lasts forever under a trickle, while an age bounds what the head
//! waits for in time, whatever the request rate. Its own tenant's later requests never
//! overtake it (first come, first served within a tenant), nor do lower priorities.
//!
//! Pure: the clock reading is an argument (`Arbiter::drain` reads it once per pass).

use std::time::{Duration, Instant};

/// May requests of other tenants of its priority that fit go ahead of a head blocked by
/// capacity that has been waiting since `since`, at `now`, under `max_age`
/// (`--overtake-age`; zero: never)?
pub fn open_to_overtakers(since: Instant, now: Instant, max_age: Duration) -> bool {
    now.saturating_duration_since(since) < max_age
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_head_is_overtaken_only_while_younger_than_the_age() {
        let t0 = Instant::now();
        let age = Duration::from_secs(2);
        assert!(open_to_overtakers(t0, t0, age));
        assert!(open_to_overtakers(
            t0,
            t0 + Duration::from_millis(1999),
            age
        ));
        assert!(!open_to_overtakers(t0, t0 + age, age));
        assert!(!open_to_overtakers(t0, t0 + Duration::from_secs(60), age));
        // A clock reading before `since` (read earlier in the pass) is age zero.
        assert!(open_to_overtakers(t0 + age, t0, age));
    }

    #[test]
    fn a_zero_age_never_lets_anyone_overtake() {
        let t0 = Instant::now();
        assert!(!open_to_overtakers(t0, t0, Duration::ZERO));
    }
}
