//! FedTA's server half (Yu et al., §4.3–4.4).
//!
//! - **Selective Input Knowledge Fusion** (SIKF, Eq. 8): each round one client's input
//!   enhancement (IE) is drawn at random as the student, and the other clients' IE are distilled
//!   into it on a small surrogate set: the MSE between the frozen backbone's features of the
//!   inputs enhanced by the student and by each teacher, minimised by Adam for E epochs. The
//!   student becomes the global IE. The backbone lives where the tensors are: the server half
//!   receives an [`InputDistiller`] from whoever builds it (the simulator builds one on burn) and
//!   stays free of any tensor library. Without a distiller (no surrogate set), when the `sikf`
//!   switch is off, and on the last round of a task, the IE is averaged instead.
//! - **Best Global Prototype Selection** (BGPS, Eq. 9–10): every uploaded prototype and the
//!   previous global ones are stacked by class and one is chosen per class
//!   ([`best_global_prototypes`]); a class whose choice scores below the lock threshold is
//!   locked and keeps its prototype from then on. With the `bgps` switch off, the global
//!   prototype of a class is the count-weighted mean of the round's uploads.
//!
//! The global prototypes and the locked classes are the method's durable state.

use std::collections::BTreeSet;

use anchorage_shared::math::cosine;
use anchorage_shared::method::fedta_blocks::{IE_PREFIX, TAIL_KEYS, TAIL_TRAINED, TAIL_VALUES};
use anchorage_shared::method::{FedTaConfig, MethodParams};
use anchorage_shared::protocol::Update;
use anchorage_shared::prototype::Prototype;
use anchorage_shared::prototype_rules::{ClassMean, Selection, best_global_prototypes, fuse};
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use serde::{Deserialize, Serialize};

use anchorage_shared::math::weighted_mean;

use super::fedavg::average_blocks;
use super::prototypes::uploaded_prototypes;
use super::{MethodError, RoundInfo, ServerMethod};

/// What one distillation produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Distilled {
    /// The student's blocks after distillation (same names and shapes as it came in).
    pub blocks: Vec<ParamBlock>,
    /// The mean distillation loss of each epoch.
    pub losses: Vec<f64>,
}

/// Distils teachers' input enhancement into a student's through a frozen backbone on a
/// surrogate set (FedTA Eq. 8). Built by whoever holds the backbone and the surrogate data.
pub trait InputDistiller: Send {
    /// `student` and each of `teachers` are one client's uploaded IE blocks.
    fn distill(
        &mut self,
        student: &[ParamBlock],
        teachers: &[&[ParamBlock]],
        epochs: u32,
        learning_rate: f32,
    ) -> Result<Distilled, String>;
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct State {
    global: Vec<Prototype>,
    locked: BTreeSet<u32>,
}

/// How the last round's IE was aggregated (for logs and tests).
#[derive(Debug, Clone, PartialEq)]
pub enum IeAggregation {
    /// SIKF into the IE of this client, with the loss per epoch.
    Distilled { student: String, losses: Vec<f64> },
    /// Sample-weighted mean, and why.
    Averaged(&'static str),
}

/// FedTA's server half. See the module docs.
pub struct FedTaServer {
    config: FedTaConfig,
    distiller: Option<Box<dyn InputDistiller>>,
    state: State,
    /// Whether the missing-distiller fallback has been logged.
    warned: bool,
    /// What the last aggregation did with the IE.
    pub last: Option<IeAggregation>,
}

impl FedTaServer {
    /// The server half; `distiller` is `None` where no surrogate set or backbone is at hand
    /// (the IE is then averaged, and the first round says so in the log).
    pub fn new(config: FedTaConfig, distiller: Option<Box<dyn InputDistiller>>) -> Self {
        Self { config, distiller, state: State::default(), warned: false, last: None }
    }

    /// Classes whose global prototype is locked (Eq. 10).
    pub fn locked(&self) -> &BTreeSet<u32> {
        &self.state.locked
    }

    fn aggregate_ie(
        &mut self,
        round: &RoundInfo,
        global: &[ParamBlock],
        updates: &[(&str, &Update)],
    ) -> Result<Vec<ParamBlock>, MethodError> {
        let average = |why| -> Result<_, MethodError> {
            Ok((average_blocks(global, updates, Encoding::F32, &round.rule)?, IeAggregation::Averaged(why)))
        };
        let with_blocks: Vec<&(&str, &Update)> = updates.iter().filter(|(_, u)| !u.blocks.is_empty()).collect();
        let (blocks, how) = if !self.config.sikf {
            average("SIKF is switched off")?
        } else if round.last_of_task {
            average("last round of the task")?
        } else if with_blocks.len() < 2 {
            average("fewer than two clients uploaded IE")?
        } else if let Some(distiller) = self.distiller.as_mut() {
            // A seeded draw over the clients sorted by id: the result does not depend on arrival order.
            let mut order: Vec<&(&str, &Update)> = with_blocks;
            order.sort_by(|a, b| a.0.cmp(b.0));
            let mut rng = Rng::derive(round.round, 0x51CF);
            let pick = rng.below(order.len() as u64) as usize;
            let student = order[pick];
            let teachers: Vec<&[ParamBlock]> =
                order.iter().enumerate().filter(|(i, _)| *i != pick).map(|(_, (_, u))| u.blocks.as_slice()).collect();
            for b in &student.1.blocks {
                b.validate()?;
                if b.decode()?.iter().any(|v| !v.is_finite()) {
                    return Err(MethodError::Inconsistent(b.name.clone()));
                }
            }
            match distiller.distill(
                &student.1.blocks,
                &teachers,
                self.config.sikf_epochs,
                self.config.sikf_learning_rate,
            ) {
                Ok(d) => (d.blocks, IeAggregation::Distilled { student: student.0.to_string(), losses: d.losses }),
                Err(e) => {
                    tracing::warn!(round = round.round, error = %e, "FedTA: SIKF failed; averaging IE this round");
                    average("SIKF failed")?
                }
            }
        } else {
            if !self.warned {
                tracing::warn!("FedTA: no surrogate set configured (no distiller); averaging IE instead of SIKF");
                self.warned = true;
            }
            average("no surrogate set")?
        };
        if let IeAggregation::Distilled { student, losses } = &how {
            tracing::info!(round = round.round, %student, ?losses, "FedTA: SIKF distilled the IE");
        } else if let IeAggregation::Averaged(why) = &how {
            tracing::debug!(round = round.round, why, "FedTA: IE averaged");
        }
        self.last = Some(how);
        Ok(blocks)
    }

    /// Eq. 9–10 (or the count-weighted mean with BGPS off) over the round's uploads.
    fn select_prototypes(&mut self, round: u64, uploads: &[ClassMean]) -> Result<(), MethodError> {
        let previous: Vec<ClassMean> = self
            .state
            .global
            .iter()
            .map(|p| Ok(ClassMean { class: p.class, count: p.count, vector: p.values()? }))
            .collect::<Result<_, MethodError>>()?;
        if !self.config.bgps {
            let mut next = fuse(&[], uploads, 0.0);
            let kept: Vec<ClassMean> =
                previous.into_iter().filter(|p| !next.iter().any(|n| n.class == p.class)).collect();
            next.extend(kept);
            next.sort_by_key(|m| m.class);
            self.state.global = encode(&next);
            return Ok(());
        }
        // Candidates of one dimension: the previous global ones' (or the first upload's).
        let Some(dim) = previous.first().or(uploads.first()).map(|m| m.vector.len()) else { return Ok(()) };
        let mut stacked: Vec<&ClassMean> = Vec::new();
        stacked.extend(uploads.iter().filter(|m| m.vector.len() == dim && m.count > 0));
        let from_uploads = stacked.len();
        stacked.extend(previous.iter().filter(|m| m.vector.len() == dim));
        let candidates: Vec<(u32, &[f32])> = stacked.iter().map(|m| (m.class, m.vector.as_slice())).collect();
        let selection = best_global_prototypes(&candidates, self.config.lock_threshold, &self.state.locked);
        log_selection(round, &selection, &stacked, from_uploads, uploads, self.state.locked.len());
        let mut next: Vec<ClassMean> =
            previous.iter().filter(|p| self.state.locked.contains(&p.class)).cloned().collect();
        for &i in selection.chosen.values() {
            next.push(stacked[i].clone());
        }
        next.sort_by_key(|m| m.class);
        self.state.locked.extend(selection.newly_locked);
        self.state.global = encode(&next);
        Ok(())
    }
}

/// A diagnostic of what BGPS picks: over the classes chosen this round, the cosine
/// between the chosen prototype and the count-weighted mean of the class's uploads, against the
/// mean cosine of the uploads themselves to that mean (how typical an upload is), and how many
/// picks are a previous global prototype (`stacked` holds `from_uploads` uploads, then those).
fn log_selection(
    round: u64,
    selection: &Selection,
    stacked: &[&ClassMean],
    from_uploads: usize,
    uploads: &[ClassMean],
    locked: usize,
) {
    if !tracing::enabled!(tracing::Level::INFO) {
        return;
    }
    let means = fuse(&[], uploads, 0.0);
    let (mut chosen_cos, mut upload_cos, mut classes, mut previous) = (0.0f64, 0.0f64, 0usize, 0usize);
    for (class, &i) in &selection.chosen {
        let Some(mean) = means.iter().find(|m| m.class == *class) else { continue };
        let own: Vec<&ClassMean> = uploads.iter().filter(|u| u.class == *class && u.count > 0).collect();
        if own.is_empty() || stacked[i].vector.len() != mean.vector.len() {
            continue;
        }
        chosen_cos += cosine(&stacked[i].vector, &mean.vector) as f64;
        upload_cos += own.iter().map(|u| cosine(&u.vector, &mean.vector) as f64).sum::<f64>() / own.len() as f64;
        previous += usize::from(i >= from_uploads);
        classes += 1;
    }
    if classes > 0 {
        tracing::info!(
            round,
            classes,
            locked,
            newly_locked = selection.newly_locked.len(),
            previous_global = previous,
            chosen_to_mean = chosen_cos / classes as f64,
            uploads_to_mean = upload_cos / classes as f64,
            "fedta bgps selection"
        );
    }
}

fn encode(means: &[ClassMean]) -> Vec<Prototype> {
    means.iter().map(|m| Prototype::encode(m.class, m.count, &m.vector, Encoding::F32)).collect()
}

/// The input-enhancement blocks (`ie.*`) and the rest (the shared tail, `share_tail`).
fn split_blocks(blocks: &[ParamBlock]) -> (Vec<ParamBlock>, Vec<ParamBlock>) {
    blocks.iter().cloned().partition(|b| b.name.starts_with(IE_PREFIX))
}

/// The per-anchor rows of a shared tail.
const ANCHOR_ROWS: [&str; 2] = [TAIL_KEYS, TAIL_VALUES];

/// The shared tail's average. Each anchor (a row of `tail.keys` and `tail.values`) is averaged
/// over the clients that trained it, weighted by how many of their samples took it
/// (`tail.trained`), so a class's anchor is not diluted by the untouched copies of clients that
/// never held the class; an anchor no client trained keeps its global value (the anchor rows are
/// always this count-weighted mean, whatever `rule` says). The head, and a tail sent without
/// counts, go through the round's `rule` (the sample-weighted mean by default). The counts
/// themselves come back summed.
fn average_tail(
    global: &[ParamBlock],
    updates: &[(&str, &Update)],
    rule: &crate::aggregate::AggregationRule,
) -> Result<Vec<ParamBlock>, MethodError> {
    let counts: Option<Vec<Vec<f32>>> = updates
        .iter()
        .map(|(_, u)| u.blocks.iter().find(|b| b.name == TAIL_TRAINED).map(|b| b.decode()))
        .collect::<Option<Result<_, _>>>()
        .transpose()?;
    let mut out = average_blocks(global, updates, Encoding::F32, rule)?;
    let Some(counts) = counts else { return Ok(out) };
    // The round's counts, summed over the clients, travel on in the broadcast (every update must
    // have the global's layout), where the clients skip them.
    let anchors = counts.first().map_or(0, Vec::len);
    if counts.iter().any(|c| c.len() != anchors) {
        return Err(MethodError::Inconsistent(TAIL_TRAINED.into()));
    }
    let total: Vec<f32> = (0..anchors).map(|r| counts.iter().map(|c| c[r].max(0.0)).sum()).collect();
    out.retain(|b| b.name != TAIL_TRAINED);
    out.push(ParamBlock::encode(TAIL_TRAINED, &[anchors as u32], &total, Encoding::F32));
    for block in out.iter_mut().filter(|b| ANCHOR_ROWS.contains(&b.name.as_str())) {
        let (rows, width) = match block.tensor.shape.as_slice() {
            [r, w] => (*r as usize, *w as usize),
            _ => return Err(MethodError::Inconsistent(block.name.clone())),
        };
        let mut mean = block.decode()?;
        let previous = global.iter().find(|g| g.name == block.name).map(|g| g.decode()).transpose()?;
        let values: Vec<Vec<f32>> = updates
            .iter()
            .map(|(_, u)| u.blocks.iter().find(|b| b.name == block.name).map(|b| b.decode()).transpose())
            .collect::<Result<Option<Vec<_>>, _>>()?
            .ok_or_else(|| MethodError::Inconsistent(block.name.clone()))?;
        if counts.iter().any(|c| c.len() != rows) || values.iter().any(|v| v.len() != rows * width) {
            return Err(MethodError::Inconsistent(format!("{} rows against {TAIL_TRAINED}", block.name)));
        }
        for r in 0..rows {
            let span = r * width..(r + 1) * width;
            let parts: Vec<(&[f32], f64)> = values
                .iter()
                .zip(&counts)
                .filter(|(_, c)| c[r] > 0.0)
                .map(|(v, c)| (&v[span.clone()], c[r] as f64))
                .collect();
            let row = match (weighted_mean(&parts), &previous) {
                (Some(row), _) => row,
                (None, Some(prev)) if prev.len() == rows * width => prev[span.clone()].to_vec(),
                (None, _) => continue,
            };
            mean[span].copy_from_slice(&row);
        }
        *block = ParamBlock::encode(block.name.clone(), &block.tensor.shape, &mean, Encoding::F32);
    }
    Ok(out)
}

impl ServerMethod for FedTaServer {
    fn name(&self) -> &'static str {
        FedTaConfig::NAME
    }

    fn aggregate(
        &mut self,
        round: &RoundInfo,
        global: &[ParamBlock],
        updates: &[(&str, &Update)],
    ) -> Result<Vec<ParamBlock>, MethodError> {
        if updates.is_empty() {
            return Err(MethodError::Empty);
        }
        // Validate the prototypes first: a bad upload must leave the state as it was.
        let uploads = uploaded_prototypes(updates)?;
        // The IE goes through SIKF (or is averaged); the rest, shared tail blocks (`share_tail`) and
        // the IE head (`prediction = "head"`), is averaged.
        let (ie_global, tail_global) = split_blocks(global);
        let parts: Vec<(Update, Update)> = updates
            .iter()
            .map(|(_, u)| {
                let (ie, tail) = split_blocks(&u.blocks);
                (Update { blocks: ie, ..(*u).clone() }, Update { blocks: tail, ..(*u).clone() })
            })
            .collect();
        let ie_updates: Vec<(&str, &Update)> = updates.iter().zip(&parts).map(|((c, _), (ie, _))| (*c, ie)).collect();
        let mut blocks = self.aggregate_ie(round, &ie_global, &ie_updates)?;
        if parts.iter().any(|(_, tail)| !tail.blocks.is_empty()) {
            let tail_updates: Vec<(&str, &Update)> =
                updates.iter().zip(&parts).map(|((c, _), (_, tail))| (*c, tail)).collect();
            blocks.extend(average_tail(&tail_global, &tail_updates, &round.rule)?);
        }
        self.select_prototypes(round.round, &uploads)?;
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

    fn round(r: u64, last_of_task: bool) -> RoundInfo {
        RoundInfo { round: r, task: 0, last_of_task, rule: crate::aggregate::AggregationRule::Mean }
    }

    fn update(ie: &[f32], protos: &[(u32, &[f32])]) -> Update {
        Update {
            prototypes_are: Default::default(),
            round: 1,
            num_samples: 1,
            blocks: vec![ParamBlock::encode("ie.sets", &[ie.len() as u32], ie, Encoding::F32)],
            prototypes: protos.iter().map(|(c, v)| Prototype::encode(*c, 1, v, Encoding::F32)).collect(),
            metrics: vec![],
            compute_seconds: 0.0,
        }
    }

    /// Records its inputs; the "distilled" student is the mean of the teachers.
    /// Each call's student and teacher count.
    type Calls = std::sync::Arc<std::sync::Mutex<Vec<(Vec<f32>, usize)>>>;
    struct Recorder(Calls);

    impl InputDistiller for Recorder {
        fn distill(
            &mut self,
            student: &[ParamBlock],
            teachers: &[&[ParamBlock]],
            epochs: u32,
            _lr: f32,
        ) -> Result<Distilled, String> {
            let s = student[0].decode().map_err(|e| e.to_string())?;
            self.0.lock().unwrap().push((s.clone(), teachers.len()));
            let mean: Vec<f32> = (0..s.len())
                .map(|k| teachers.iter().map(|t| t[0].decode().unwrap()[k]).sum::<f32>() / teachers.len() as f32)
                .collect();
            Ok(Distilled {
                blocks: vec![ParamBlock::encode("ie.sets", &student[0].tensor.shape, &mean, Encoding::F32)],
                losses: vec![1.0; epochs as usize],
            })
        }
    }

    fn protos(m: &FedTaServer) -> Vec<(u32, Vec<f32>)> {
        m.prototypes().iter().map(|p| (p.class, p.values().unwrap())).collect()
    }

    #[test]
    fn a_shared_tail_is_averaged_and_kept_out_of_the_distiller() {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut m = FedTaServer::new(FedTaConfig::default(), Some(Box::new(Recorder(seen.clone()))));
        let with_tail = |ie: &[f32], head: &[f32]| {
            let mut u = update(ie, &[]);
            u.blocks.push(ParamBlock::encode("tail.head.weight", &[head.len() as u32], head, Encoding::F32));
            u
        };
        let (a, b, c) =
            (with_tail(&[0.0], &[1.0, 3.0]), with_tail(&[3.0], &[3.0, 5.0]), with_tail(&[6.0], &[5.0, 7.0]));
        let out = m.aggregate(&round(1, false), &[], &[("a", &a), ("b", &b), ("c", &c)]).unwrap();
        let names: Vec<&str> = out.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(names, ["ie.sets", "tail.head.weight"]);
        assert_eq!(out[1].decode().unwrap(), vec![3.0, 5.0], "the tail is the mean of the uploads");
        // The distiller saw IE blocks only: one block per teacher, and two teachers.
        let calls = seen.lock().unwrap();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].0.len(), 1, "the student's IE alone reached the distiller");
        assert_eq!(calls[0].1, 2);
    }

    #[test]
    fn the_ie_head_is_averaged_and_kept_out_of_the_distiller() {
        use anchorage_shared::method::fedta_blocks::IE_HEAD_WEIGHT;
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut m = FedTaServer::new(FedTaConfig::default(), Some(Box::new(Recorder(seen.clone()))));
        let with_head = |ie: &[f32], head: &[f32]| {
            let mut u = update(ie, &[]);
            u.blocks.push(ParamBlock::encode(IE_HEAD_WEIGHT, &[head.len() as u32], head, Encoding::F32));
            u
        };
        let (a, b) = (with_head(&[0.0], &[1.0, 4.0]), with_head(&[3.0], &[3.0, 0.0]));
        let out = m.aggregate(&round(1, false), &[], &[("a", &a), ("b", &b)]).unwrap();
        let names: Vec<&str> = out.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(names, ["ie.sets", IE_HEAD_WEIGHT]);
        assert_eq!(out[1].decode().unwrap(), vec![2.0, 2.0], "the IE head is the mean of the uploads");
        assert_eq!(seen.lock().unwrap().len(), 1, "SIKF ran on the IE");
    }

    #[test]
    fn each_anchor_is_averaged_over_the_clients_that_trained_it() {
        let mut m = FedTaServer::new(FedTaConfig::default(), None);
        // Two anchors of width 2. Client a trained anchor 0 (3 samples), b anchors 0 (1) and 1 (2),
        // c trained neither and sends the global values back untouched.
        let tail = |values: &[f32], trained: &[f32], head: f32| {
            let mut u = update(&[0.0], &[]);
            u.blocks.push(ParamBlock::encode("tail.values", &[2, 2], values, Encoding::F32));
            u.blocks.push(ParamBlock::encode("tail.head.bias", &[1], &[head], Encoding::F32));
            u.blocks.push(ParamBlock::encode(TAIL_TRAINED, &[trained.len() as u32], trained, Encoding::F32));
            u
        };
        let global = [ParamBlock::encode("tail.values", &[2, 2], &[9.0, 9.0, 7.0, 7.0], Encoding::F32)];
        let a = tail(&[1.0, 1.0, 7.0, 7.0], &[3.0, 0.0], 0.0);
        let b = tail(&[5.0, 5.0, 1.0, 3.0], &[1.0, 2.0], 3.0);
        let c = tail(&[9.0, 9.0, 7.0, 7.0], &[0.0, 0.0], 6.0);
        let out = m.aggregate(&round(1, false), &global, &[("a", &a), ("b", &b), ("c", &c)]).unwrap();
        let names: Vec<&str> = out.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(names, ["ie.sets", "tail.values", "tail.head.bias", TAIL_TRAINED]);
        assert_eq!(out[3].decode().unwrap(), vec![4.0, 2.0], "the round's counts, summed");
        // Anchor 0: (3·1 + 1·5) / 4 = 2; anchor 1: b's alone. c's untouched copies do not count.
        assert_eq!(out[1].decode().unwrap(), vec![2.0, 2.0, 1.0, 3.0]);
        assert_eq!(out[2].decode().unwrap(), vec![3.0], "the head is the plain mean");
        // An anchor nobody trained keeps its global value.
        let idle = |v: &[f32]| tail(v, &[0.0, 0.0], 0.0);
        let out = m.aggregate(&round(2, false), &global, &[("a", &idle(&[0.0; 4])), ("b", &idle(&[2.0; 4]))]).unwrap();
        assert_eq!(out[1].decode().unwrap(), vec![9.0, 9.0, 7.0, 7.0]);
        // Counts of the wrong length are an error, not a panic.
        let bad = tail(&[1.0; 4], &[1.0, 1.0, 1.0], 0.0);
        assert!(m.aggregate(&round(3, false), &global, &[("a", &a), ("bad", &bad)]).is_err());
    }

    #[test]
    fn without_a_distiller_the_ie_is_averaged() {
        let mut m = FedTaServer::new(FedTaConfig::default(), None);
        let (a, b) = (update(&[0.0, 2.0], &[]), update(&[2.0, 0.0], &[]));
        let out = m.aggregate(&round(1, false), &[], &[("a", &a), ("b", &b)]).unwrap();
        assert_eq!(out[0].decode().unwrap(), vec![1.0, 1.0]);
        assert_eq!(m.last, Some(IeAggregation::Averaged("no surrogate set")));
    }

    #[test]
    fn sikf_distils_into_one_client_and_is_skipped_on_the_last_round_of_a_task() {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut m = FedTaServer::new(FedTaConfig::default(), Some(Box::new(Recorder(seen.clone()))));
        let ups = [update(&[1.0], &[]), update(&[2.0], &[]), update(&[3.0], &[])];
        let out = m.aggregate(&round(3, false), &[], &[("c", &ups[2]), ("a", &ups[0]), ("b", &ups[1])]).unwrap();
        let (student, teachers) = seen.lock().unwrap()[0].clone();
        assert_eq!(teachers, 2, "the other two clients teach");
        let others: f32 = (6.0 - student[0]) / 2.0;
        assert_eq!(out[0].decode().unwrap(), vec![others]);
        assert!(matches!(m.last, Some(IeAggregation::Distilled { .. })));
        // The draw does not depend on arrival order.
        let seen2 = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut m2 = FedTaServer::new(FedTaConfig::default(), Some(Box::new(Recorder(seen2.clone()))));
        m2.aggregate(&round(3, false), &[], &[("a", &ups[0]), ("b", &ups[1]), ("c", &ups[2])]).unwrap();
        assert_eq!(seen2.lock().unwrap()[0].0, student);
        // Last round of a task: no distillation, the mean.
        let out = m.aggregate(&round(4, true), &[], &[("a", &ups[0]), ("b", &ups[1]), ("c", &ups[2])]).unwrap();
        assert_eq!(seen.lock().unwrap().len(), 1);
        assert_eq!(out[0].decode().unwrap(), vec![2.0]);
        assert_eq!(m.last, Some(IeAggregation::Averaged("last round of the task")));
    }

    #[test]
    fn bgps_picks_locks_and_survives_a_restart() {
        let mut m = FedTaServer::new(FedTaConfig { lock_threshold: 0.25, ..FedTaConfig::default() }, None);
        // The hand-made set of the shared BGPS test, uploaded by two clients.
        let a = update(&[0.0], &[(0, &[1.0, 0.9]), (1, &[0.9, 1.0])]);
        let b = update(&[0.0], &[(0, &[1.0, -1.0]), (2, &[-1.0, -1.0])]);
        m.aggregate(&round(1, false), &[], &[("a", &a), ("b", &b)]).unwrap();
        assert_eq!(
            protos(&m),
            vec![(0, vec![1.0, -1.0]), (1, vec![0.9, 1.0]), (2, vec![-1.0, -1.0])],
            "class 0: the candidate least similar to the other classes"
        );
        assert_eq!(m.locked(), &[1, 2].into_iter().collect());
        // A locked class keeps its prototype whatever is uploaded later.
        let c = update(&[0.0], &[(1, &[5.0, -5.0]), (2, &[3.0, 3.0])]);
        m.aggregate(&round(2, false), &[], &[("c", &c)]).unwrap();
        let now = protos(&m);
        assert_eq!(now[1], (1, vec![0.9, 1.0]));
        assert_eq!(now[2], (2, vec![-1.0, -1.0]));
        let mut restarted = FedTaServer::new(FedTaConfig::default(), None);
        restarted.load_state(&m.save_state()).unwrap();
        assert_eq!(protos(&restarted), now);
        assert_eq!(restarted.locked(), m.locked());
        assert!(restarted.load_state(b"\xff\xff\xff\xff").is_err());
    }

    #[test]
    fn without_bgps_the_uploads_are_averaged_and_a_nan_is_refused() {
        let mut m = FedTaServer::new(FedTaConfig { bgps: false, ..FedTaConfig::default() }, None);
        let a = update(&[0.0], &[(0, &[0.0, 2.0])]);
        let b = update(&[0.0], &[(0, &[2.0, 0.0]), (1, &[1.0, 1.0])]);
        m.aggregate(&round(1, false), &[], &[("a", &a), ("b", &b)]).unwrap();
        assert_eq!(protos(&m), vec![(0, vec![1.0, 1.0]), (1, vec![1.0, 1.0])]);
        let before = m.save_state();
        let bad = update(&[0.0], &[(0, &[f32::NAN, 0.0])]);
        assert!(m.aggregate(&round(2, false), &[], &[("x", &bad)]).is_err());
        assert_eq!(m.save_state(), before, "a refused round leaves the state as it was");
    }
}
