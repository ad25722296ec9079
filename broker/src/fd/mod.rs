//! Descriptor delivery: how a lease's memory (a CUDA VMM or memfd descriptor) reaches the
//! worker process that may map it, and no other unrecorded one. `handles` decides what a
//! lease reply carries (a ticket, a descriptor already pushed, or none); `tickets` keeps
//! the ticket table; `ticket_server` serves the ticket socket (`ticket_read` reads who
//! wrote a ticket, `ticket_pressure` gives kept connections' slots back);
//! `descriptor_channels` sends a grant's descriptor on its process's channel;
//! `lease_line` serves a session's retained blocks on a connection of its own.

pub mod descriptor_channels;
pub mod handles;
pub mod lease_line;
pub mod ticket_pressure;
pub mod ticket_read;
pub mod ticket_server;
pub mod tickets;
