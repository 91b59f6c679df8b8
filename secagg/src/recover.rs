//! Round 4 on the server: rebuild b_u of every survivor and s_v of every dropped client from t
//! shares, strip PRG(b_u) and the dropped clients' pairwise masks from the running sum (Bonawitz
//! et al. 2017, Fig. 4 round 4; Bell et al. 2020, §3, with each client's neighbours only).
//!
//! Every secret is checked to have t shares before any is rebuilt, so a round short of shares
//! fails without computing anything from them.

use x25519_dalek::PublicKey;

use crate::error::SecAggError;
use crate::keys;
use crate::mask::{self, Op};
use crate::messages::ClientId;
use crate::server::{Aggregate, ServerState};
use crate::shares;

impl ServerState {
    /// Unmasks the running sum; the sum leaves the state with the [`Aggregate`].
    pub(crate) fn close_unmask(&mut self) -> Result<Aggregate, SecAggError> {
        self.check_share_counts()?;
        let round = self.config.round;
        let mut sum = std::mem::take(&mut self.sum);
        for &u in &self.live {
            let b = shares::combine(&self.self_mask_shares[&u], self.threshold)?;
            mask::apply(&mut sum, &keys::self_mask_seed(&b, round), Op::Sub);
        }
        for &v in &self.dropped {
            self.remove_pairwise(&mut sum, v)?;
        }
        self.self_mask_shares.clear();
        self.mask_key_shares.clear();
        Ok(Aggregate { round, sum, contributors: self.live.len() as u32 })
    }

    /// Every survivor's b_u and every dropped client's s_v has at least t shares.
    fn check_share_counts(&self) -> Result<(), SecAggError> {
        let need = self.threshold;
        let count = |m: &std::collections::BTreeMap<ClientId, Vec<_>>, c: &ClientId| m.get(c).map_or(0, Vec::len);
        let short = self
            .live
            .iter()
            .map(|u| count(&self.self_mask_shares, u))
            .chain(self.dropped.iter().map(|v| count(&self.mask_key_shares, v)))
            .find(|&have| have < need);
        match short {
            Some(have) => Err(SecAggError::BelowThreshold { what: "shares of a secret", have, need }),
            None => Ok(()),
        }
    }

    /// Rebuilds s_v, checks it against v's advertised key, and removes v's pairwise mask from each
    /// surviving neighbour w (w applied `Op::pairwise(w, v)`; its inverse removes it).
    fn remove_pairwise(&self, sum: &mut [u32], v: ClientId) -> Result<(), SecAggError> {
        let s = shares::combine(&self.mask_key_shares[&v], self.threshold)?;
        let secret = keys::mask_secret(&s);
        if PublicKey::from(&secret).to_bytes() != self.keys[&v].mask {
            return Err(SecAggError::ReconstructionMismatch(v));
        }
        for w in self.neighbours_in(v, &self.live) {
            let shared = keys::agree(&secret, &self.keys[&w].mask, w)?;
            let seed = keys::pairwise_seed(&shared, self.config.round, w, v);
            mask::apply(sum, &seed, Op::pairwise(w, v).inverse());
        }
        Ok(())
    }
}
