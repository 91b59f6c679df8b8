//! A device's share of a scenario's data (`source = "scenario"` in `client.toml`): every device
//! reads the same data spec (dataset, scale, seed, partition) as the scenario file, computes the
//! same split, and keeps its own row of it, the way the simulator's clients do. Only the
//! device's own samples are kept ([`anchorage_data::load_rows`]). The frozen backbone's features
//! are computed once; the raw samples stay beside them for the methods that enhance the
//! backbone's input (FedTA).

use std::path::Path;
use std::sync::Arc;

use anchorage_data::{DataSpec, Dataset};
use anyhow::Context;
use burn::tensor::Device;

use crate::config::{ClientConfig, DataSource};
use crate::methods::{MethodContext, Reveal, TaskStream};
use anchorage_model::{Backbone, FeatureCache, InputBackbone, Inputs, NetSpec, zoo};

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
    // Only this device's rows are kept as samples: its tasks' training and local test rows, and
    // the target domains' rows (train pool), and the test-pool rows of tasks without a local test.
    let held_out = evolving.unwrap_or(0);
    anyhow::ensure!(
        evolving.is_none() || mine.tasks.len() > held_out,
        "{} domains cannot hold out {held_out} as the target and keep a source",
        mine.tasks.len()
    );
    let (mut train_rows, mut test_rows) = (Vec::new(), Vec::new());
    for t in &mine.tasks {
        train_rows.extend(&t.train);
        let (rows, in_train) = t.local_test_rows();
        if in_train { train_rows.extend(rows) } else { test_rows.extend(rows) }
    }
    for rows in [&mut train_rows, &mut test_rows] {
        rows.sort_unstable();
        rows.dedup();
    }
    let loaded = anchorage_data::load_rows(spec, dir, &train_rows, &test_rows).context("loading the data")?;
    // Pool row → row of the loaded (compact) sets.
    let at = |rows: &[usize], r: usize| rows.binary_search(&r).expect("every row of the share was loaded");
    let (train, test) = (&loaded.train, &loaded.test);
    let net: Arc<dyn Backbone + Send + Sync> =
        zoo::load(backbone, train.sample_len(), dir, device).context("building the frozen backbone")?.into();
    let take = |in_train: bool, rows: &[usize]| {
        if in_train {
            train.subset(&rows.iter().map(|&r| at(&train_rows, r)).collect::<Vec<_>>())
        } else {
            test.subset(&rows.iter().map(|&r| at(&test_rows, r)).collect::<Vec<_>>())
        }
    };
    let task = |t: &anchorage_data::partition::TaskSplit| {
        let (rows, in_train) = t.local_test_rows();
        (t.classes.clone(), take(true, &t.train), take(in_train, rows))
    };
    let stream = match evolving {
        None => {
            let tasks: Vec<(Vec<u32>, Dataset, Dataset)> = mine.tasks.iter().map(task).collect();
            TaskStream::build(net.as_ref(), &tasks, device)
        }
        Some(_) => {
            let (sources, target) = mine.tasks.split_at(mine.tasks.len() - held_out);
            let tasks: Vec<(Vec<u32>, Dataset, Dataset)> = sources.iter().map(task).collect();
            let mut rows: Vec<usize> =
                target.iter().flat_map(|t| t.train.iter().chain(&t.local_test)).copied().collect();
            rows.sort_unstable();
            let target = Arc::new(take(true, &rows));
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
    let DataSource::Scenario {
        data_dir,
        client,
        backbone,
        hidden,
        residual,
        model_seed,
        evolving,
        target_domains,
        spec,
    } = &config.data
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
    let net = NetSpec {
        input_dim: share.backbone.net.feature_dim(),
        hidden: hidden.clone(),
        num_classes: share.num_classes,
        seed: *model_seed,
        residual: *residual,
    };
    net.check().map_err(|e| anyhow::anyhow!("[data] residual: {e}"))?;
    Ok(MethodContext {
        net,
        stream: share.stream,
        device: device.clone().autodiff(),
        optimizer: config.optimizer,
        encoding: config.encoding.encoding(),
        seed: *client as u64,
        backbone: Some(share.backbone),
        prototype_release: crate::methods::protos::PrototypeRelease::of(&config.privacy),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn synthetic(partition: &str) -> DataSpec {
        toml::from_str(&format!("dataset = \"synthetic\"\nseed = 4\n[synthetic]\nclasses = 4\nside = 8\ntrain_per_class = 40\ntest_per_class = 10\n{partition}")).unwrap()
    }

    /// The share holds exactly the samples the split gives the device, from its own rows only.
    #[test]
    fn a_share_holds_the_devices_own_samples() {
        let device = Device::flex();
        let dir = Path::new("/nonexistent");
        let spec = synthetic(
            "[partition]\nkind = \"fedta\"\nclients = 3\ntasks = 2\nclasses_per_task = 2\npublic_classes = 4\n",
        );
        let split = anchorage_data::build_split(&spec, &anchorage_data::label_pools(&spec, None).unwrap()).unwrap();
        let all = anchorage_data::load(&spec, None).unwrap();
        let share = load_share(&spec, dir, 1, "embedded", None, &device).unwrap();
        assert_eq!(share.stream.tasks.len(), 2);
        for (t, want) in share.stream.tasks.iter().zip(&split.clients[1].tasks) {
            assert_eq!(t.classes, want.classes);
            let labels: Vec<u32> = want.train.iter().map(|&i| all.train.labels[i]).collect();
            assert_eq!(&t.train.labels_host[..], &labels[..], "the training rows, in the split's order");
            let (rows, in_train) = want.local_test_rows();
            let pool = if in_train { &all.train } else { &all.test };
            assert_eq!(t.test.labels_host.to_vec(), rows.iter().map(|&i| pool.labels[i]).collect::<Vec<_>>());
            let inputs = t.train.inputs.as_ref().expect("raw samples beside the features");
            assert_eq!(inputs.data.sample(inputs.rows[0]), all.train.sample(want.train[0]), "the same pixels");
        }
        assert!(load_share(&spec, dir, 3, "embedded", None, &device).is_err(), "client 3 of 3");
        // Evolving domains: the last one is the target.
        let domains = synthetic("[partition]\nkind = \"domains\"\nclients = 2\ndomains = 3\ntrain_fraction = 0.8\n");
        let share = load_share(&domains, dir, 0, "embedded", Some(1), &device).unwrap();
        assert_eq!((share.stream.tasks.len(), share.stream.reveal), (2, Reveal::All));
        assert!(share.stream.target.as_ref().is_some_and(|t| !t.is_empty()));
        assert!(load_share(&domains, dir, 0, "embedded", Some(3), &device).is_err(), "no source left");
    }
}
