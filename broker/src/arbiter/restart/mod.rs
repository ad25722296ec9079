//! A broker restart that loses no lease: the shell's side of the keeper (`keeper/`).
//! [`Restart`] (reached by [`Arbiter::restart`]) owns what the keeper feature needs beyond
//! the state (`RestartState`: the keeper once taken back, what this start took back, the
//! leases awaiting their session's resume). Its pieces:
//!
//! - `keep.rs`: every change reaches the keeper under the state lock (`Effect::Keep`).
//! - `adopt.rs`: at start, what the keeper held is taken back ([`Restart::adopt_dumped`],
//!   timed in [`RestartReport::phases`]); `process.rs` (process reservations), `shared.rs`
//!   (publications, imports, held blocks) and `stranded.rs` (memory kept outside the
//!   broker) are its steps.
//! - `resume.rs`: a worker resumes its session taken back with its secret.
//! - `relink.rs`: a keeper lost while serving is reconnected and filled again.
//!
//! The locks it adds come after the state lock where both are held (`awaiting_resume` in a
//! resume), never before it.

mod adopt;
mod keep;
mod process;
mod relink;
mod resume;
mod shared;
mod stranded;

#[cfg(test)]
pub(in crate::arbiter) mod adopt_tests;

pub use adopt::{Phase, RestartReport};
pub(crate) use resume::new_resume_secret;

use super::Arbiter;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use uuid::Uuid;

/// A restart of one arbiter ([`Arbiter::restart`]): keeping, taking back, resuming.
pub struct Restart<'a> {
    pub(super) arb: &'a Arbiter,
    pub(super) state: &'a RestartState,
}

/// What the keeper feature holds of one arbiter.
#[derive(Default)]
pub(crate) struct RestartState {
    /// The keeper of sessions and leases across restarts, once taken back.
    keeper: OnceLock<Arc<dyn crate::keeper::Place>>,
    /// What this start took back from the keeper.
    report: Mutex<Option<RestartReport>>,
    /// Leases taken back from the keeper, by session, until the session is resumed (a
    /// resume ends those its worker does not name, and no lease granted since).
    awaiting_resume: Mutex<HashMap<Uuid, Vec<Uuid>>>,
}

impl Restart<'_> {
    /// What this start took back from the keeper (None without a keeper).
    pub(crate) fn report(&self) -> Option<RestartReport> {
        self.state.report.lock().clone()
    }

    /// Is a keeper holding this broker's leases?
    pub(crate) fn keeps_leases(&self) -> bool {
        self.state.keeper.get().is_some_and(|k| !k.is_broken())
    }

    /// The start's steps after the adoption, up to serving (`main` times them): added to
    /// the restart's report, so it covers the whole start.
    pub fn steps_to_serving(&self, steps: Vec<Phase>) {
        let mut r = self.state.report.lock();
        let Some(r) = r.as_mut() else {
            return;
        };
        r.phases.extend(steps);
        tracing::info!(phases = %r.phases_line(), "serving after a restart");
    }
}
