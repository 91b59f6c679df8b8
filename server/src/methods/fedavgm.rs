//! FedAvgM (Hsu et al. 2019, "Measuring the effects of non-identical data distribution", Alg. 1;
//! Flower's `FedAvgM`): FedAvg's mean taken as a pseudo-gradient and applied with server momentum,
//!
//! Δ_t = w_t − mean_t,   v_{t+1} = β · v_t + Δ_t,   w_{t+1} = w_t − η · v_{t+1},
//!
//! with β the server momentum and η the server learning rate (β = 0, η = 1 is FedAvg). The
//! velocity is the method's durable state: it is saved with every checkpoint.

use anchorage_shared::method::{FedAvgMConfig, MethodParams};
use anchorage_shared::protocol::Update;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use serde::{Deserialize, Serialize};

use super::{MethodError, RoundInfo, ServerMethod, average_blocks, decode_state, encode_state};

/// FedAvgM's server half. See the module docs.
#[derive(Debug, Clone)]
pub struct FedAvgM {
    config: FedAvgMConfig,
    state: Velocity,
}

/// v, per block name.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Velocity {
    blocks: Vec<(String, Vec<f32>)>,
}

impl FedAvgM {
    pub fn new(config: FedAvgMConfig) -> Self {
        Self { config, state: Velocity::default() }
    }
}

impl ServerMethod for FedAvgM {
    fn name(&self) -> &'static str {
        FedAvgMConfig::NAME
    }

    fn aggregate(
        &mut self,
        round: &RoundInfo,
        global: &[ParamBlock],
        updates: &[(&str, &Update)],
    ) -> Result<Vec<ParamBlock>, MethodError> {
        let mean = average_blocks(global, updates, Encoding::F32, &round.rule)?;
        let (beta, eta) = (self.config.server_momentum, self.config.server_learning_rate);
        let mut next = Vec::with_capacity(mean.len());
        let mut velocity = Vec::with_capacity(mean.len());
        for block in mean {
            let Some(current) = global.iter().find(|g| g.name == block.name) else {
                // A block the global model does not hold yet: taken as averaged.
                next.push(block);
                continue;
            };
            let (w, m) = (current.decode()?, block.decode()?);
            if w.len() != m.len() {
                return Err(MethodError::Inconsistent(block.name.clone()));
            }
            let old = self.state.blocks.iter().find(|(n, v)| *n == block.name && v.len() == w.len());
            let v: Vec<f32> = match old {
                Some((_, v)) => v.iter().zip(w.iter().zip(&m)).map(|(v, (w, m))| beta * v + (w - m)).collect(),
                None => w.iter().zip(&m).map(|(w, m)| w - m).collect(),
            };
            let values: Vec<f32> = w.iter().zip(&v).map(|(w, v)| w - eta * v).collect();
            next.push(ParamBlock::encode(block.name.clone(), &block.tensor.shape, &values, Encoding::F32));
            velocity.push((block.name, v));
        }
        self.state.blocks = velocity;
        Ok(next)
    }

    fn save_state(&self) -> Vec<u8> {
        encode_state(&self.state)
    }

    fn load_state(&mut self, state: &[u8]) -> Result<(), MethodError> {
        decode_state(state, &mut self.state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aggregate::AggregationRule;

    fn block(values: &[f32]) -> ParamBlock {
        ParamBlock::encode("w", &[values.len() as u32], values, Encoding::F32)
    }

    fn update(values: &[f32]) -> Update {
        Update {
            prototypes_are: Default::default(),
            round: 1,
            num_samples: 1,
            blocks: vec![block(values)],
            prototypes: Vec::new(),
            metrics: Vec::new(),
            compute_seconds: 0.0,
        }
    }

    fn round() -> RoundInfo {
        RoundInfo { round: 1, task: 0, last_of_task: false, rule: AggregationRule::Mean }
    }

    fn step(m: &mut FedAvgM, global: &[f32], clients: &[&[f32]]) -> Vec<f32> {
        let updates: Vec<Update> = clients.iter().map(|c| update(c)).collect();
        let refs: Vec<(&str, &Update)> = updates.iter().map(|u| ("c", u)).collect();
        m.aggregate(&round(), &[block(global)], &refs).unwrap()[0].decode().unwrap()
    }

    #[test]
    fn without_momentum_at_rate_one_it_is_fedavg() {
        let mut m = FedAvgM::new(FedAvgMConfig { server_learning_rate: 1.0, server_momentum: 0.0 });
        assert_eq!(step(&mut m, &[0.0, 0.0], &[&[1.0, 2.0], &[3.0, 4.0]]), [2.0, 3.0]);
    }

    #[test]
    fn momentum_carries_the_last_rounds_step() {
        let mut m = FedAvgM::new(FedAvgMConfig { server_learning_rate: 1.0, server_momentum: 0.5 });
        // Round 1: Δ = 0 − 2 = −2, v = −2, w = 2.
        assert_eq!(step(&mut m, &[0.0], &[&[2.0]]), [2.0]);
        // Round 2: the clients stay at 2, Δ = 0, v = 0.5 · (−2) = −1, w = 2 + 1 = 3.
        assert_eq!(step(&mut m, &[2.0], &[&[2.0]]), [3.0]);
        // A restarted server goes on from the saved velocity.
        let mut restarted = FedAvgM::new(m.config.clone());
        restarted.load_state(&m.save_state()).unwrap();
        assert_eq!(restarted.state, m.state);
        assert!(restarted.load_state(&[0xFF; 3]).is_err(), "unreadable state is an error");
    }
}
