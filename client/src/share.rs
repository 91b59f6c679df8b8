//! A device's share of a scenario's data (`source = "scenario"` in `client.toml`): every device
//! reads the same data spec (dataset, scale, seed, partition) as the scenario file, computes the
//! same split, and keeps its own row of it, the way the simulator's clients do. The frozen
//! backbone's features are computed once; the raw samples stay beside them for the methods that
//! enhance the backbone's input (FedTA).

use std::path::Path;
use std::sync::Arc;

use anchorage_data::{DataSpec, Dataset};
use anyhow::Context;
use burn::tensor::Device;

use crate::config::{ClientConfig, DataSource};
use crate::methods::{MethodContext, Reveal, TaskStream};
use crate::model::{Backbone, FeatureCache, InputBackbone, Inputs, NetSpec, zoo};

/// This device's tasks, ready to train on.
pub struct Share {
    pub stream: TaskStream,
    pub backbone: InputBackbone,
    pub num_classes: usize,
    /// Where the data came from, for the log.
    pub source: String,
}

/// Client `client`'s share of `spec`'s split, with features through `backbone` (a
/// [`zoo`] name; pretrained weights are read from `data_dir/weights`). `evolving`: the last
/// `target_domains` domains are the unseen target (FedEvolve / FedEvp); otherwise the tasks are
/// revealed one by one.
pub fn load_share(
    spec: &DataSpec,
    data_dir: &Path,
    client: usize,
    backbone: &str,
    evolving: Option<usize>,
    device: &Device,
) -> anyhow::Result<Share> {
    let dir = Some(data_dir);
    let pools = anchorage_data::label_pools(spec, dir).context("reading the labels")?;
    let split = anchorage_data::build_split(spec, &pools).context("partitioning")?;
    let mine = split
        .clients
        .get(client)
        .with_context(|| format!("client index {client} is outside the split's {} clients", split.num_clients()))?;
    anyhow::ensure!(!mine.tasks.is_empty(), "the split gives client {client} no tasks");
    let loaded = anchorage_data::load(spec, dir).context("loading the data")?;
    let (train, test) = (&loaded.train, &loaded.test);
    let net: Arc<dyn Backbone + Send + Sync> =
        zoo::load(backbone, train.sample_len(), dir, device).context("building the frozen backbone")?.into();
    let pool = |in_train: bool, rows: &[usize]| if in_train { train.subset(rows) } else { test.subset(rows) };
    let task = |t: &anchorage_data::partition::TaskSplit| {
        let (rows, in_train) = t.local_test_rows();
        (t.classes.clone(), train.subset(&t.train), pool(in_train, rows))
    };
    let stream = match evolving {
        None => {
            let tasks: Vec<(Vec<u32>, Dataset, Dataset)> = mine.tasks.iter().map(task).collect();
            TaskStream::build(net.as_ref(), &tasks, device)
        }
        Some(held_out) => {
            let n = mine.tasks.len();
            anyhow::ensure!(n > held_out, "{n} domains cannot hold out {held_out} as the target and keep a source");
            let (sources, target) = mine.tasks.split_at(n - held_out);
            let tasks: Vec<(Vec<u32>, Dataset, Dataset)> = sources.iter().map(task).collect();
            let mut rows: Vec<usize> =
                target.iter().flat_map(|t| t.train.iter().chain(&t.local_test)).copied().collect();
            rows.sort_unstable();
            let target = Arc::new(train.subset(&rows));
            let target =
                FeatureCache::build(net.as_ref(), &target, 512, device).with_inputs(Inputs::all(target.clone()));
            TaskStream { reveal: Reveal::All, target: Some(target), ..TaskStream::build(net.as_ref(), &tasks, device) }
        }
    };
    Ok(Share {
        stream,
        backbone: InputBackbone { net, sample_shape: train.sample_shape.clone() },
        num_classes: train.num_classes as usize,
        source: loaded.source.clone(),
    })
}

/// The method context of a `client.toml` whose data source is a scenario share: the share through
/// the frozen backbone, the trainable model the config names, and the config's method, optimizer
/// and encoding. `device` is the plain compute device (training runs on its autodiff form).
pub fn scenario_context(config: &ClientConfig, device: &Device) -> anyhow::Result<MethodContext> {
    let DataSource::Scenario { data_dir, client, backbone, hidden, model_seed, evolving, target_domains, spec } =
        &config.data
    else {
        anyhow::bail!("the data source is not a scenario share");
    };
    let share = load_share(spec, data_dir, *client, backbone, evolving.then_some(*target_domains), device)
        .with_context(|| format!("this device's share (client {client}) of the scenario data"))?;
    tracing::info!(
        client,
        tasks = share.stream.tasks.len(),
        train = share.stream.tasks.iter().map(|t| t.train.len()).sum::<usize>(),
        backbone = %backbone,
        source = %share.source,
        "local data (this device's share of the scenario split)"
    );
    Ok(MethodContext {
        method: config.method.clone(),
        net: NetSpec {
            input_dim: share.backbone.net.feature_dim(),
            hidden: hidden.clone(),
            num_classes: share.num_classes,
            seed: *model_seed,
        },
        stream: share.stream,
        device: device.clone().autodiff(),
        optimizer: config.optimizer,
        encoding: crate::encoding::parse(&config.encoding)?,
        seed: *client as u64,
        backbone: Some(share.backbone),
    })
}
