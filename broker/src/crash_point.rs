//! Crash points for the crash-point matrix (`tests/faults/crash_points.rs`): with
//! `GPU_BROKER_CRASH_AT=<point>[#n]` in its environment the broker SIGKILLs itself the
//! n-th time (1 unless given) it passes `<point>`, so a test can stop it between any two
//! steps whose order matters for a restart. Points: `before-keep:<change>` and
//! `after-keep:<change>` around each write to the keeper (`<change>`: `session`,
//! `session-ended`, `lease`, `lease-ended`, `quarantine`, `quarantine-lifted`, `drain`,
//! `publication`, `publication-ended`, `import`, `import-ended`, `reservation`,
//! `reservation-ended`, `reclaim-asked`, `reclaim-ended`, `held`, `held-let-go`,
//! `lingering`, `lingering-ended`, `stranded`, `stranded-lifted`),
//! and `after:<op>` once an operation's state lock was let go (`<op>`: `reclaim` (a
//! request sent),
//! `reclaim-revoke` (its deadline passed), `quarantine`, `lift`, `publish`, `import`,
//! `release-import`, `reserve`, `release-reservation`, `drain`), and `mid:line-answer`
//! once a lease line's answer is half written. Unset, a pass costs one branch.

use std::sync::atomic::{AtomicU32, Ordering};

/// The environment variable naming the crash point.
pub const CRASH_AT_ENV: &str = "GPU_BROKER_CRASH_AT";

/// Whether this build honours [`CRASH_AT_ENV`] (a release build does not, unless built
/// with the `crash-points` feature).
pub const HONOURED: bool = cfg!(any(debug_assertions, feature = "crash-points"));

/// Where this broker dies, if anywhere.
#[derive(Debug, Default)]
pub struct CrashPoint {
    point: Option<(String, u32)>,
    passed: AtomicU32,
}

impl CrashPoint {
    /// From `spec` (`<point>[#n]`); none for `None` or an empty one.
    pub fn parse(spec: Option<&str>) -> CrashPoint {
        let point = spec
            .filter(|s| !s.is_empty())
            .map(|s| match s.split_once('#') {
                Some((p, n)) => (p.to_string(), n.parse().unwrap_or(1).max(1)),
                None => (s.to_string(), 1),
            });
        CrashPoint {
            point,
            passed: AtomicU32::new(0),
        }
    }

    /// From the environment ([`CRASH_AT_ENV`]), where this build honours it.
    pub fn from_env() -> CrashPoint {
        CrashPoint::for_build(std::env::var(CRASH_AT_ENV).ok().as_deref(), HONOURED)
    }

    /// From `spec` when `honoured`; else none (a set variable is logged as ignored).
    fn for_build(spec: Option<&str>, honoured: bool) -> CrashPoint {
        if honoured {
            return CrashPoint::parse(spec);
        }
        if spec.is_some_and(|s| !s.is_empty()) {
            tracing::warn!("{CRASH_AT_ENV} is set and ignored: this build has no crash points");
        }
        CrashPoint::default()
    }

    /// Passing `point` (`kind:what`): dies here when it is the one, the n-th time.
    pub fn pass(&self, kind: &str, what: &str) {
        let Some((p, n)) = &self.point else { return };
        if p.len() != kind.len() + 1 + what.len() || !p.starts_with(kind) || !p.ends_with(what) {
            return;
        }
        if self.passed.fetch_add(1, Ordering::SeqCst) + 1 == *n {
            tracing::warn!(point = %p, n, "crash point reached: SIGKILL");
            // SAFETY: plain syscalls on this process.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    }

    /// Is `kind:what` the point this broker dies at? (A step split only for the test that
    /// cuts it: an answer written in two parts.)
    pub fn names(&self, kind: &str, what: &str) -> bool {
        self.point.as_ref().is_some_and(|(p, _)| {
            p.len() == kind.len() + 1 + what.len() && p.starts_with(kind) && p.ends_with(what)
        })
    }

    /// Will the `n`-th pass of `kind:what` die? (Tests.)
    #[cfg(test)]
    fn armed_for(&self, kind: &str, what: &str) -> Option<u32> {
        self.point
            .as_ref()
            .filter(|(p, _)| *p == format!("{kind}:{what}"))
            .map(|(_, n)| *n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_names_a_point_and_which_pass() {
        assert_eq!(
            CrashPoint::parse(Some("after-keep:lease#3")).armed_for("after-keep", "lease"),
            Some(3)
        );
        let p = CrashPoint::parse(Some("before-keep:lease-ended"));
        assert_eq!(p.armed_for("before-keep", "lease-ended"), Some(1));
        assert_eq!(p.armed_for("before-keep", "lease"), None);
        assert!(CrashPoint::parse(None).point.is_none());
        assert!(CrashPoint::parse(Some("")).point.is_none());
        // Other points pass without dying (this test process is still here).
        p.pass("before-keep", "lease");
        p.pass("after-keep", "lease-ended");
    }

    /// A production build never dies at a crash point, whatever its environment says.
    #[test]
    fn a_build_without_crash_points_ignores_the_variable() {
        let p = CrashPoint::for_build(Some("after-keep:lease"), false);
        assert_eq!(p.armed_for("after-keep", "lease"), None);
        // Passing it does not kill this test process.
        p.pass("after-keep", "lease");
        let p = CrashPoint::for_build(Some("after-keep:lease"), true);
        assert_eq!(p.armed_for("after-keep", "lease"), Some(1));
    }
}
