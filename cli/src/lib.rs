//! The `anchorage` command line's library part: what the operator's commands do that more than
//! the binary needs (the integration tests provision sites with it).

pub mod provision;
