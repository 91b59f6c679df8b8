//! The server half of the prototype methods: FedAvg of the shared blocks, plus global class
//! prototypes built from the uploaded ones by the method's rule.
//!
//! - GLDP Eq. 11 and FedProK Eq. 9: [`PrototypeRule::Fuse`] (new classes: count-weighted mean;
//!   known classes: β-blend with the previous value).
//! - FedEvolve and FedEvp: [`PrototypeRule::Latest`], the count-weighted mean of this round's
//!   uploads (FedEvolve's φ-prototypes of the last source domain, which the global model predicts
//!   with; FedEvp's evolving prototypes of Eq. 5, which the clients compute over their domains).

use anchorage_shared::protocol::Update;
use anchorage_shared::prototype::Prototype;
use anchorage_shared::prototype_rules::{ClassMean, fuse};
use anchorage_shared::tensor::{Encoding, ParamBlock};
use serde::{Deserialize, Serialize};

use super::fedavg::average_blocks;
use super::{MethodError, RoundInfo, ServerMethod};

/// How uploaded class means become the global prototypes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PrototypeRule {
    Fuse { beta: f32 },
    Latest,
}

/// FedAvg of the blocks and a prototype rule.
#[derive(Debug, Clone)]
pub struct PrototypeMethod {
    name: &'static str,
    rule: PrototypeRule,
    state: State,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct State {
    global: Vec<Prototype>,
}

fn decode(p: &[Prototype]) -> Result<Vec<ClassMean>, MethodError> {
    p.iter().map(|p| Ok(ClassMean { class: p.class, count: p.count, vector: p.values()? })).collect()
}

fn encode(means: &[ClassMean]) -> Vec<Prototype> {
    means.iter().map(|m| Prototype::encode(m.class, m.count, &m.vector, Encoding::F32)).collect()
}

/// Every prototype of the round's updates, decoded (invalid ones are a method error).
pub fn uploaded_prototypes(updates: &[(&str, &Update)]) -> Result<Vec<ClassMean>, MethodError> {
    let mut out = Vec::new();
    for (_, u) in updates {
        for p in &u.prototypes {
            p.validate()?;
            out.extend(decode(std::slice::from_ref(p))?);
        }
    }
    Ok(out)
}

impl PrototypeMethod {
    pub fn new(name: &'static str, rule: PrototypeRule) -> Self {
        Self { name, rule, state: State::default() }
    }

    fn update_prototypes(&mut self, uploads: &[ClassMean]) -> Result<(), MethodError> {
        let global = decode(&self.state.global)?;
        let next = match self.rule {
            PrototypeRule::Fuse { beta } => fuse(&global, uploads, beta),
            PrototypeRule::Latest => fuse(&[], uploads, 0.0),
        };
        self.state.global = encode(&next);
        Ok(())
    }
}

impl ServerMethod for PrototypeMethod {
    fn name(&self) -> &'static str {
        self.name
    }

    fn aggregate(
        &mut self,
        round: &RoundInfo,
        global: &[ParamBlock],
        updates: &[(&str, &Update)],
    ) -> Result<Vec<ParamBlock>, MethodError> {
        let blocks = average_blocks(global, updates, Encoding::F32, &round.rule)?;
        let uploads = uploaded_prototypes(updates)?;
        self.update_prototypes(&uploads)?;
        Ok(blocks)
    }

    fn prototypes(&self) -> Vec<Prototype> {
        self.state.global.clone()
    }

    fn save_state(&self) -> Vec<u8> {
        super::encode_state(&self.state)
    }

    fn load_state(&mut self, state: &[u8]) -> Result<(), MethodError> {
        super::decode_state(state, &mut self.state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(task: u32) -> RoundInfo {
        RoundInfo { round: 1, task, last_of_task: false, rule: crate::aggregate::AggregationRule::Mean }
    }

    fn upload(protos: &[(u32, u64, &[f32])]) -> Update {
        Update {
            prototypes_are: Default::default(),
            round: 1,
            num_samples: 1,
            blocks: vec![],
            prototypes: protos.iter().map(|(c, n, v)| Prototype::encode(*c, *n, v, Encoding::F32)).collect(),
            metrics: vec![],
            compute_seconds: 0.0,
        }
    }

    fn global(m: &PrototypeMethod) -> Vec<(u32, Vec<f32>)> {
        m.prototypes().iter().map(|p| (p.class, p.values().unwrap())).collect()
    }

    #[test]
    fn fuse_weights_new_classes_by_count_and_blends_old_ones() {
        let mut m = PrototypeMethod::new("gldp", PrototypeRule::Fuse { beta: 0.5 });
        let (a, b) = (upload(&[(0, 1, &[0.0, 0.0])]), upload(&[(0, 3, &[4.0, 8.0])]));
        m.aggregate(&round(0), &[], &[("a", &a), ("b", &b)]).unwrap();
        assert_eq!(global(&m), vec![(0, vec![3.0, 6.0])]);
        let c = upload(&[(0, 1, &[1.0, 2.0]), (1, 2, &[5.0, 5.0])]);
        m.aggregate(&round(1), &[], &[("c", &c)]).unwrap();
        // β = 0.5: old class 0 → 0.5·(3,6) + 0.5·(1,2); new class 1 taken as is.
        assert_eq!(global(&m), vec![(0, vec![2.0, 4.0]), (1, vec![5.0, 5.0])]);
    }

    #[test]
    fn latest_replaces_and_state_survives_a_restart() {
        let mut m = PrototypeMethod::new("fedevolve", PrototypeRule::Latest);
        m.aggregate(&round(0), &[], &[("a", &upload(&[(1, 2, &[1.0])]))]).unwrap();
        m.aggregate(&round(1), &[], &[("a", &upload(&[(1, 2, &[3.0])]))]).unwrap();
        assert_eq!(global(&m), vec![(1, vec![3.0])]);
        let mut restarted = PrototypeMethod::new("fedevolve", PrototypeRule::Latest);
        restarted.load_state(&m.save_state()).unwrap();
        assert_eq!(global(&restarted), global(&m));
        assert!(restarted.load_state(b"\xff\xff\xff").is_err());
    }

    #[test]
    fn a_nan_prototype_is_rejected() {
        let mut m = PrototypeMethod::new("gldp", PrototypeRule::Fuse { beta: 0.5 });
        let bad = upload(&[(0, 1, &[f32::NAN])]);
        assert!(m.aggregate(&round(0), &[], &[("a", &bad)]).is_err());
        assert!(m.prototypes().is_empty(), "a failed round leaves the prototypes unchanged");
    }

    #[test]
    fn aggregation_does_not_depend_on_update_order() {
        let ups = [upload(&[(0, 1, &[1.0, 0.0])]), upload(&[(0, 2, &[0.0, 1.0]), (2, 1, &[3.0, 3.0])])];
        let mut x = PrototypeMethod::new("fedprok", PrototypeRule::Fuse { beta: 0.3 });
        let mut y = x.clone();
        x.aggregate(&round(0), &[], &[("a", &ups[0]), ("b", &ups[1])]).unwrap();
        y.aggregate(&round(0), &[], &[("b", &ups[1]), ("a", &ups[0])]).unwrap();
        assert_eq!(x.prototypes(), y.prototypes());
    }
}
