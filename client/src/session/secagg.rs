//! The device's side of a securely aggregated round (SecAgg+, Bell et al. 2020, over
//! `anchorage-secagg`). A device with `secure_aggregation` on (client.toml) never sends its update
//! in the clear: it answers the server's key and share stages while it trains, masks its
//! update into the round's [`Layout`] when the server asks for it (or as soon as training ends,
//! if the ask came first), and reveals shares once. The update stays persisted until the ack
//! that says it is in the round's aggregate, as without SecAgg.
//!
//! The entropy of each round's keys comes from the session's root (32 random bytes from the
//! shell; the operating system's in the field) hashed with the round number, so two rounds
//! never share a key.

use anchorage_secagg::{ClientState, Layout, SecAggError, ServerFrame, ServerMessage, Stage};
use anchorage_shared::protocol::{Message, SecAggFrame, Update};
use anchorage_shared::tensor::ParamBlock;

/// What the session does with a server frame's outcome.
#[derive(Debug)]
pub(super) enum Reply {
    /// Send this on the control stream.
    Control(Message),
    /// Send this masked vector as a resumable transfer (it is as large as an update).
    Masked(Message),
    /// Nothing to send now (the ask for the masked vector waits for training).
    Nothing,
}

/// One round's protocol state on the device.
struct RoundState {
    round: u64,
    state: ClientState,
    layout: Layout,
    /// The ask for the masked vector, held until the update is trained.
    held: Option<ServerMessage>,
    /// The last answer and the stage it answered, sent again if the server asks again (its
    /// answer was lost with a connection).
    last: Option<(Stage, Message)>,
}

/// The device's secure aggregation: its entropy root, the global model of the round it trains
/// (the delta's base), and the round in progress.
pub(super) struct DeviceSecAgg {
    root: [u8; 32],
    base: Option<(u64, Vec<ParamBlock>)>,
    round: Option<RoundState>,
}

impl std::fmt::Debug for DeviceSecAgg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceSecAgg").field("round", &self.round.as_ref().map(|r| r.round)).finish()
    }
}

impl DeviceSecAgg {
    pub(super) fn new(root: [u8; 32]) -> Self {
        Self { root, base: None, round: None }
    }

    /// After a process restart: the round's keys and shares are gone, the root stays.
    pub(super) fn restarted(&self) -> Self {
        Self::new(self.root)
    }

    /// The broadcast of `round`: its blocks are the base every delta is taken from.
    pub(super) fn broadcast(&mut self, round: u64, blocks: &[ParamBlock]) {
        self.base = Some((round, blocks.to_vec()));
    }

    /// A server frame, answered from `pending` (the trained update, if any).
    pub(super) fn on_frame(&mut self, frame: &SecAggFrame, pending: Option<&Update>) -> Result<Reply, SecAggError> {
        let ServerFrame { layout, you, message } = ServerFrame::decode(&frame.body)?;
        if let ServerMessage::Setup(config) = &message {
            if config.round != frame.round {
                return Err(SecAggError::WrongRound { expected: frame.round, got: config.round });
            }
            self.setup(frame.round, layout, you)?;
        }
        let expected = self.round.as_ref().map_or(0, |r| r.round);
        let base = self.base.as_ref().filter(|(r, _)| *r == frame.round).map(|(_, b)| b.as_slice());
        let round = self
            .round
            .as_mut()
            .filter(|r| r.round == frame.round)
            .ok_or(SecAggError::WrongRound { expected, got: frame.round })?;
        round.answer(message, pending, base)
    }

    /// Training of `update` finished: the held ask for the masked vector is answered now.
    pub(super) fn trained(&mut self, update: &Update) -> Result<Reply, SecAggError> {
        let base = self.base.as_ref().filter(|(r, _)| *r == update.round).map(|(_, b)| b.as_slice());
        let Some(round) = self.round.as_mut().filter(|r| r.round == update.round) else { return Ok(Reply::Nothing) };
        match round.held.take() {
            Some(ask) => round.answer(ask, Some(update), base),
            None => Ok(Reply::Nothing),
        }
    }

    /// Round 0: a fresh state with this round's entropy. A second Setup of a round whose shares
    /// this device already revealed is refused (a server that asked twice could unmask it).
    fn setup(
        &mut self,
        round: u64,
        layout: Option<Layout>,
        you: Option<anchorage_secagg::ClientId>,
    ) -> Result<(), SecAggError> {
        let (Some(layout), Some(id)) = (layout, you) else {
            return Err(SecAggError::BadParams("a Setup without the round's layout and this device's id"));
        };
        layout.check()?;
        if let Some(r) = self.round.as_ref().filter(|r| r.round == round && r.state.stage() == Stage::Done) {
            tracing::warn!(round = r.round, "a second Setup for a round this device already unmasked: refused");
            return Err(SecAggError::WrongStage { expected: Stage::Done, got: Stage::AdvertiseKeys });
        }
        let state = ClientState::awaiting_input(id, self.entropy(round));
        self.round = Some(RoundState { round, state, layout, held: None, last: None });
        Ok(())
    }

    fn entropy(&self, round: u64) -> [u8; 32] {
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        ctx.update(b"anchorage secagg round entropy");
        ctx.update(&self.root);
        ctx.update(&round.to_le_bytes());
        let mut out = [0u8; 32];
        out.copy_from_slice(ctx.finish().as_ref());
        out
    }
}

impl RoundState {
    /// Answers one server message: masks the update when asked (holding the ask until it is
    /// trained), and repeats the last answer when the server asks the same again.
    fn answer(
        &mut self,
        message: ServerMessage,
        pending: Option<&Update>,
        base: Option<&[ParamBlock]>,
    ) -> Result<Reply, SecAggError> {
        let stage = message.stage();
        if let Some((last_stage, last)) = self.last.as_ref().filter(|(s, _)| *s == stage) {
            tracing::debug!(round = self.round, ?last_stage, "the server asked again; answering as before");
            return Ok(reply(stage, last.clone()));
        }
        if stage == Stage::MaskedInput && self.state.needs_input() {
            let Some(update) = pending.filter(|u| u.round == self.round) else {
                self.held = Some(message);
                return Ok(Reply::Nothing);
            };
            let sums = update.prototypes_are == anchorage_shared::protocol::PrototypeForm::Sums;
            let base = base.ok_or(SecAggError::BadParams("the round's broadcast (the delta's base) is not here"))?;
            let input = self.layout.encode(update, base, sums)?;
            self.state.provide_input(input);
        }
        let answer = self.state.handle_message(message)?;
        let msg = Message::SecAgg(SecAggFrame { round: self.round, body: answer.encode() });
        self.last = Some((stage, msg.clone()));
        Ok(reply(stage, msg))
    }
}

fn reply(stage: Stage, msg: Message) -> Reply {
    if stage == Stage::MaskedInput { Reply::Masked(msg) } else { Reply::Control(msg) }
}
