//! A client's task stream: per task, the frozen-backbone features of its training and test data.
//! The broadcast's task index says where in the stream the federation is.

use anchorage_shared::MetricKey;
use std::sync::Arc;

use anchorage_data::Dataset;
use anchorage_shared::protocol::{Broadcast, Metric};
use burn::tensor::Device;

use anchorage_model::{Backbone, FeatureCache, Inputs};

/// One task of a client's stream.
#[derive(Debug, Clone)]
pub struct TaskData {
    /// The task's classes (class-incremental) or every class (domain-incremental).
    pub classes: Vec<u32>,
    pub train: FeatureCache,
    /// The client's local test data of the task (may be empty).
    pub test: FeatureCache,
    /// The global test data of the classes this client holds in the task, for GLDP's A^sel (the
    /// local model on the global test set restricted to its own classes); `None` when not asked.
    pub selected: Option<FeatureCache>,
}

/// Which tasks a round may train on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reveal {
    /// Tasks 0..=t in round of task t (continual learning).
    #[default]
    ByTask,
    /// Every task from the start (FedEvolve's source domains, all known in advance).
    All,
}

/// The task stream of one client.
#[derive(Debug, Clone, Default)]
pub struct TaskStream {
    pub tasks: Vec<TaskData>,
    pub reveal: Reveal,
    /// A test set beyond the stream: the unseen target domain of FedEvolve / FedEvp.
    pub target: Option<FeatureCache>,
    /// The local model is evaluated in rounds that are multiples of this (0 or 1: every round).
    /// Evaluating every seen task's test data each round can cost more than the training.
    pub eval_every: u64,
}

impl TaskStream {
    /// Features of every task's `(classes, train, local test)` through `backbone`, cached once
    /// (the raw samples stay beside them, see [`FeatureCache::inputs`]).
    pub fn build<B: Backbone + ?Sized>(backbone: &B, tasks: &[(Vec<u32>, Dataset, Dataset)], device: &Device) -> Self {
        let tasks = tasks
            .iter()
            .map(|(classes, train, test)| TaskData {
                classes: classes.clone(),
                train: FeatureCache::build(backbone, train, 512, device)
                    .with_inputs(Inputs::all(Arc::new(train.clone()))),
                test: FeatureCache::build(backbone, test, 512, device).with_inputs(Inputs::all(Arc::new(test.clone()))),
                selected: None,
            })
            .collect();
        Self { tasks, ..Self::default() }
    }

    /// One task holding all of `train` (every class) and `test`.
    pub fn single<B: Backbone + ?Sized>(backbone: &B, train: &Dataset, test: &Dataset, device: &Device) -> Self {
        let classes = (0..train.num_classes).collect();
        Self::build(backbone, &[(classes, train.clone(), test.clone())], device)
    }

    /// Index of the task a round of task `task` trains on (the last one once the stream ends).
    pub fn current_index(&self, task: u32) -> Option<usize> {
        if self.tasks.is_empty() {
            return None;
        }
        Some(match self.reveal {
            Reveal::ByTask => (task as usize).min(self.tasks.len() - 1),
            Reveal::All => self.tasks.len() - 1,
        })
    }

    /// The task a round of task `task` trains on.
    pub fn current(&self, task: u32) -> Option<&TaskData> {
        self.current_index(task).map(|i| &self.tasks[i])
    }

    /// Every task seen by a round of task `task` (0..=current).
    pub fn seen(&self, task: u32) -> &[TaskData] {
        match self.current_index(task) {
            Some(i) => &self.tasks[..=i],
            None => &[],
        }
    }

    /// The task a round of task `task` trains on, when it holds training samples.
    pub fn training(&self, task: u32) -> Result<&TaskData, super::TrainError> {
        self.current(task).filter(|t| !t.train.is_empty()).ok_or(super::TrainError::NoData)
    }

    /// Every seen task that holds training samples (FedEvolve's and FedEvp's source domains),
    /// never empty.
    pub fn seen_training(&self, task: u32) -> Result<Vec<TaskData>, super::TrainError> {
        let seen: Vec<TaskData> = self.seen(task).iter().filter(|t| !t.train.is_empty()).cloned().collect();
        if seen.is_empty() { Err(super::TrainError::NoData) } else { Ok(seen) }
    }

    /// Training samples of every seen task.
    pub fn seen_samples(&self, task: u32) -> u64 {
        self.seen(task).iter().map(|t| t.train.len() as u64).sum()
    }

    /// Training samples of the current task.
    pub fn current_samples(&self, task: u32) -> u64 {
        self.current(task).map_or(0, |t| t.train.len() as u64)
    }

    /// Whether round `round` evaluates the local model ([`TaskStream::eval_every`]).
    pub fn evaluates(&self, round: u64) -> bool {
        self.eval_every <= 1 || round.is_multiple_of(self.eval_every)
    }

    /// The local model's accuracy on every seen task's test data (`acc.task.K`), on its selected
    /// global test data (`acc.sel.K`, where the stream has it) and on the target (`acc.target`),
    /// with `accuracy` evaluating one test set (`None`: nothing to evaluate). Nothing in rounds
    /// the evaluation policy skips ([`TaskStream::eval_every`]).
    pub fn accuracy_metrics(
        &self,
        broadcast: &Broadcast,
        accuracy: impl Fn(&FeatureCache) -> Option<f64>,
    ) -> Vec<Metric> {
        let mut out = Vec::new();
        if !self.evaluates(broadcast.round) {
            return out;
        }
        let task = broadcast.task;
        if self.target.is_none() {
            for (k, t) in self.seen(task).iter().enumerate() {
                if let Some(a) = accuracy(&t.test) {
                    out.push(Metric::new(MetricKey::TaskAccuracy(k as u32), a));
                }
                if let Some(a) = t.selected.as_ref().and_then(&accuracy) {
                    out.push(Metric::new(MetricKey::SelectedAccuracy(k as u32), a));
                }
            }
        }
        if let Some(a) = self.target.as_ref().and_then(&accuracy) {
            out.push(Metric::new(MetricKey::TargetAccuracy, a));
        }
        out
    }
}
