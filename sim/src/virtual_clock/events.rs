//! The virtual clock's events and their queue: ordered by time, then by insertion.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Duration;

use anchorage_client::methods::Trained;
use anchorage_shared::protocol::Message;

pub(super) enum Event {
    /// `conn`: the client's connection when the message left (see [`VirtualClient::conn`](super::client::VirtualClient::conn)).
    ToServer {
        from: usize,
        msg: Message,
        conn: u64,
    },
    /// `wire`: the bytes the message put on the wire, a broadcast's resends after outages included.
    ToClient {
        to: usize,
        msg: Message,
        wire: u64,
        conn: u64,
    },
    /// Training finished, with the device's compute time; `life` tells whether the process
    /// that trained still runs.
    Trained {
        client: usize,
        life: u64,
        round: u64,
        result: Result<(Trained, Duration), String>,
    },
    /// The device becomes unreachable; it returns after `back_after`. `crash`: the process restarts
    /// (work in progress is lost, the store survives).
    Offline {
        client: usize,
        back_after: Duration,
        crash: bool,
    },
    Online {
        client: usize,
    },
    /// From the root to relay `relay` over its link (`[relays]`); `conn`: the relay's connection
    /// when it left (see [`super::tier::VirtualRelay::conn`]).
    ToRelay {
        relay: usize,
        msg: Message,
        conn: u64,
    },
    /// From relay `relay` to the root over its link.
    ToRoot {
        relay: usize,
        msg: Message,
        conn: u64,
    },
    /// Relay `relay`'s process, down since its restart, starts again.
    RelayUp {
        relay: usize,
    },
}

/// Events ordered by time, then by insertion (deterministic for equal times).
#[derive(Default)]
pub(super) struct Queue {
    heap: BinaryHeap<Reverse<(Duration, u64)>>,
    events: HashMap<u64, Event>,
    seq: u64,
}

impl Queue {
    pub(super) fn push(&mut self, at: Duration, event: Event) {
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq)));
        self.events.insert(self.seq, event);
    }

    pub(super) fn peek_time(&self) -> Option<Duration> {
        self.heap.peek().map(|Reverse((t, _))| *t)
    }

    pub(super) fn peek(&self) -> Option<(Duration, &Event)> {
        let Reverse((t, seq)) = self.heap.peek()?;
        self.events.get(seq).map(|e| (*t, e))
    }

    pub(super) fn pop(&mut self) -> Option<(Duration, Event)> {
        let Reverse((t, seq)) = self.heap.pop()?;
        self.events.remove(&seq).map(|e| (t, e))
    }
}
