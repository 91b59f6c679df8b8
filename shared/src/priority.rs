//! Send priorities of the QUIC streams both sides open: the one place that
//! says which stream goes first when several have bytes waiting.
//!
//! QUIC sends a connection's streams through one congestion window. quinn fills each packet from
//! the stream of the highest priority that has data queued (`SendStream::set_priority`; every
//! stream starts at 0, and streams of one level take turns, a packet each). An update of a large
//! model can leave megabytes queued in its stream for minutes on a slow link. Without levels, a
//! prototype-only update sent meanwhile takes turns with it and gets half the link; with them it
//! goes before every block, and control messages go before both.
//!
//! What priorities cannot do: jump packets already sent. A datagram that left the device waits in
//! the link's bottleneck queue (a 3G uplink's 64 KiB is a second) whatever its stream, so a control
//! message behind a running upload still waits about that long plus the round trip
//! (`tests/tests/priorities.rs`, measured in benches/README.md).
//!
//! Three levels, because quinn warns that many levels cost performance:
//!
//! | level | streams |
//! |---|---|
//! | [`Priority::Control`] (2) | the control stream both ways (hello, heartbeats, cost records, acks, refusals), and the server's answers on an upload's stream (the offer's answer) |
//! | [`Priority::Light`] (1) | an update or broadcast that carries no parameter block (prototypes, metrics only) |
//! | [`Priority::Blocks`] (0, quinn's default) | an update or broadcast that carries parameter blocks |
//!
//! Blocks stay at quinn's default so that a stream a future change forgets to give a level can
//! never go ahead of control messages. Both programs can turn the levels off (the client's
//! `ClientOptions::stream_priorities`, the server's `[limits] stream_priorities`): every stream
//! then stays at 0, the baseline the test measures.

use crate::protocol::{Broadcast, Update};

/// A stream's send priority: a higher level is sent first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    /// Parameter blocks: the bulk of every round, sent when nothing else waits.
    Blocks,
    /// A message without parameter blocks (prototypes, metrics): small, and a round may wait on it.
    Light,
    /// Control messages, each a packet or two: never behind anything else.
    Control,
}

impl Priority {
    /// The level quinn's `SendStream::set_priority` takes (higher first; 0 is every stream's
    /// default).
    pub const fn level(self) -> i32 {
        match self {
            Self::Blocks => 0,
            Self::Light => 1,
            Self::Control => 2,
        }
    }

    /// The stream of an update: light when it carries no parameter block.
    pub fn of_update(update: &Update) -> Self {
        if update.blocks.is_empty() { Self::Light } else { Self::Blocks }
    }

    /// The stream of a broadcast: light when it carries no parameter block.
    pub fn of_broadcast(broadcast: &Broadcast) -> Self {
        if broadcast.blocks.is_empty() { Self::Light } else { Self::Blocks }
    }

    /// The priority to give a stream when priorities are `on`; `None` leaves quinn's default.
    pub fn when(self, on: bool) -> Option<Self> {
        on.then_some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prototype::Prototype;
    use crate::tensor::{Encoding, ParamBlock};
    use alloc::vec;

    #[test]
    fn control_goes_first_then_messages_without_blocks_then_blocks() {
        assert!(Priority::Control.level() > Priority::Light.level());
        assert!(Priority::Light.level() > Priority::Blocks.level());
        assert_eq!(Priority::Blocks.level(), 0, "blocks stay at quinn's default");
        let mut update = Update {
            prototypes_are: Default::default(),
            round: 1,
            num_samples: 1,
            blocks: vec![],
            prototypes: vec![Prototype::encode(0, 3, &[1.0, 2.0], Encoding::F32)],
            metrics: vec![],
            compute_seconds: 0.0,
        };
        assert_eq!(Priority::of_update(&update), Priority::Light);
        update.blocks.push(ParamBlock::encode("head.weight", &[2], &[0.5, 0.5], Encoding::F32));
        assert_eq!(Priority::of_update(&update), Priority::Blocks);
        assert_eq!(Priority::Control.when(false), None, "off: quinn's default for every stream");
        assert_eq!(Priority::Control.when(true), Some(Priority::Control));
    }
}
