//! gpu-broker-core: the broker's state machine, with no I/O. Every byte the broker holds
//! and every table that says whose it is live in one [`state::State`]; each transition is
//! one method on it that updates everything it concerns and pushes what the daemon must do
//! afterwards (free a block, answer a waiter, tell a session, start a watcher) as an
//! [`effects::Effect`]. The daemon (`gpu-broker`, the shell) holds the one lock around the
//! state, reads the clocks, `/proc` and the devices, passes what it read in, and runs the
//! effects. No runtime, OS binding, RPC or metrics crate is a dependency, and no `unsafe`:
//! the compiler keeps that layering.
//!
//! Layout, from the leaves up:
//!
//! - Vocabulary: [`tier`] (device or host memory), [`units`] (byte sizes), [`error`]
//!   (`BrokerError`, every way a request can fail), [`memory`] (an allocation and the
//!   handle it is mapped through), [`id_map`] (maps keyed by the broker's own ids),
//!   [`defaults`] (the core's settings' defaults), [`request`] (what the core is asked).
//! - Records, one table each: [`quota`] and [`ledger`] (tenants, quotas, usage: quotas are
//!   enforced here), [`pool`] (a device's bytes and its block cache), [`lease`],
//!   [`session`], [`reservations`] (process reservations), [`sharing`] (publications and
//!   imports), [`availability`] (which devices admit grants), [`fd_budget`] (descriptors
//!   held against the limit), [`process_group`], [`views`] (snapshots operators read),
//!   [`kept`] (the records a broker's keeper holds across its restarts).
//! - The queue: [`queue`] (waiters and their order of service), [`overtaking`] (when a
//!   blocked head may be overtaken).
//! - The core: [`state`] (the transitions and the byte-state invariant) and [`effects`]
//!   (what they ask of the shell); [`scheduler`] (compute turns, a core of its own).
//!
//! The model tests drive [`state::State`] and [`scheduler::Turns`] directly (`state/tests.rs`,
//! `scheduler/model.rs`).

#![forbid(unsafe_code)]
// `clippy.toml`'s clocks and I/O are denied in `state` (the transitions) only.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

pub mod availability;
pub mod defaults;
pub mod effects;
pub mod error;
pub mod fd_budget;
pub mod id_map;
pub mod kept;
pub mod lease;
pub mod ledger;
pub mod memory;
pub mod overtaking;
pub mod pool;
pub mod process_group;
pub mod process_place;
pub mod queue;
pub mod quota;
pub mod request;
pub mod reservations;
pub mod scheduler;
pub mod session;
pub mod sharing;
pub mod state;
pub mod tier;
pub mod units;
pub mod views;
