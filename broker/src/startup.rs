//! The daemon's start, timed: `main` makes a [`StartClock`] first thing and marks when each
//! step before the keeper's records are taken back ended (opening the store, the devices,
//! loading the state), and the steps after it up to serving, so a restart's report
//! (`arbiter/restart/`) says where the time from process start to serving went.

use crate::arbiter::Phase;
use std::time::Instant;

/// The steps of a start, each timed from the end of the one before.
pub struct StartClock {
    last: Instant,
    steps: Vec<Phase>,
}

impl StartClock {
    /// The process starts now (`main`'s first line; loading the binary before it is not
    /// counted).
    pub fn begin() -> StartClock {
        StartClock {
            last: Instant::now(),
            steps: Vec::new(),
        }
    }

    /// The step named `name` ends now.
    pub fn step(&mut self, name: &str) {
        let now = Instant::now();
        self.steps.push(Phase {
            name: name.to_string(),
            took: now - self.last,
        });
        self.last = now;
    }

    /// The time since the last step is timed elsewhere (the adoption's own steps): the
    /// next step starts now.
    pub fn skip(&mut self) {
        self.last = Instant::now();
    }

    /// The steps timed so far, taken (the next step is timed from the last one still).
    pub fn steps(&mut self) -> Vec<Phase> {
        std::mem::take(&mut self.steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Steps are timed one after the other from `begin`, taken once; a skipped stretch
    /// counts in no step.
    #[test]
    fn steps_are_timed_in_order_and_taken_once() {
        let mut c = StartClock::begin();
        std::thread::sleep(Duration::from_millis(5));
        c.step("one");
        c.step("two");
        let s = c.steps();
        assert_eq!(
            s.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
            ["one", "two"]
        );
        assert!(s[0].took >= Duration::from_millis(5), "{s:?}");
        assert!(c.steps().is_empty());
        std::thread::sleep(Duration::from_millis(5));
        c.skip();
        c.step("three");
        let s = c.steps();
        assert_eq!(s.len(), 1);
        assert!(s[0].took < Duration::from_millis(5), "{s:?}");
    }
}
