//! The daemon's start, timed: `main` marks when it began and when each step before the
//! keeper's records are taken back ended (opening the store, the devices, loading the
//! state), and the steps after it up to serving, so a restart's report
//! (`arbiter/adopt.rs`) says where the time from process start to serving went.

use crate::arbiter::Phase;
use parking_lot::Mutex;
use std::time::Instant;

struct Clock {
    last: Instant,
    steps: Vec<Phase>,
}

static CLOCK: Mutex<Option<Clock>> = Mutex::new(None);

/// The process starts now (`main`'s first line). The time before it (loading the binary)
/// is not counted.
pub fn begin() {
    *CLOCK.lock() = Some(Clock {
        last: Instant::now(),
        steps: Vec::new(),
    });
}

/// The step named `name` ends now (since [`begin`] or the last step). Nothing without
/// [`begin`] (a broker built by tests).
pub fn step(name: &str) {
    let mut c = CLOCK.lock();
    let Some(c) = c.as_mut() else {
        return;
    };
    let now = Instant::now();
    c.steps.push(Phase {
        name: name.to_string(),
        took: now - c.last,
    });
    c.last = now;
}

/// The time since the last step is timed elsewhere (the adoption's own steps): the next
/// step starts now.
pub fn skip() {
    if let Some(c) = CLOCK.lock().as_mut() {
        c.last = Instant::now();
    }
}

/// The steps timed so far, taken (the next step is timed from the last one still).
pub fn steps() -> Vec<Phase> {
    CLOCK
        .lock()
        .as_mut()
        .map(|c| std::mem::take(&mut c.steps))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps are timed one after the other from `begin`, and taken once.
    #[test]
    fn steps_are_timed_in_order_and_taken_once() {
        begin();
        std::thread::sleep(std::time::Duration::from_millis(5));
        step("one");
        step("two");
        let s = steps();
        assert_eq!(
            s.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
            ["one", "two"]
        );
        assert!(s[0].took >= std::time::Duration::from_millis(5), "{s:?}");
        assert!(steps().is_empty());
        std::thread::sleep(std::time::Duration::from_millis(5));
        skip();
        step("three");
        let s = steps();
        assert_eq!(s.len(), 1);
        assert!(s[0].took < std::time::Duration::from_millis(5), "{s:?}");
    }
}
