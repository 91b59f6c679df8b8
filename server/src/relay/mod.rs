//! The relay program's link to its parent (DESIGN.md, "one engine, three roles"). The engine in
//! its relay role ([`crate::engine::Role::Relay`], [`crate::Engine::relay`]) opens its parent's
//! rounds, screens and bounds its devices' updates as the root would, and folds each round into
//! one partial aggregate ([`fold`]) that goes up as one participant's update, weighted by its
//! devices' total; the checkpoint holds the partial, so it is durable in the same transaction as
//! the round's close ([`partial_of`]). The uplink ([`uplink`]) carries it to the parent.

pub mod session;
#[cfg(test)]
mod tests;
pub mod uplink;

pub use crate::engine::{fold, partial_of, relay_check as check};

use anchorage_shared::protocol::{Capabilities, Hello, Message};

/// A relay's hello to its parent: its id, the federation's method, and the last round it closed.
pub fn hello(relay_id: &str, method: &str, last_round: Option<u64>) -> Message {
    let mut methods = heapless::Vec::new();
    let _ = methods.push(heapless::String::try_from(method).unwrap_or_default());
    Message::Hello(Box::new(Hello {
        client_id: relay_id.into(),
        capabilities: Capabilities { backend: "relay".into(), memory_mb: 0, methods },
        num_samples: 1,
        last_round,
    }))
}
