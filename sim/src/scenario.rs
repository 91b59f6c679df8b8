//! Scenario files (`scenarios/*.toml`): one per paper setting. Each holds a `[data]` table (the
//! data crate's [`DataSpec`]) beside the method, model and federation tables.

use std::path::{Path, PathBuf};

use anchorage_data::{DataSpec, PartitionSpec};
use anchorage_shared::method::MethodConfig;
use anyhow::Context;

use crate::SimConfig;

/// Reads the `[data]` table of a scenario file.
pub fn data_spec(path: &Path) -> anyhow::Result<DataSpec> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let doc: toml::Table = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let data = doc.get("data").cloned().with_context(|| format!("{} has no [data] table", path.display()))?;
    data.try_into().with_context(|| format!("the [data] table of {}", path.display()))
}

/// A whole scenario file as a [`SimConfig`]: `[federation]` holds SimConfig fields (clients,
/// rounds, rounds_per_task, local_epochs, batch_size, learning_rate, evolving, ...), `[method]`,
/// `[model]` and `[data]` their tables; `[scenario]` is a description. A plain SimConfig file
/// (no `[scenario]` table) is read as it is.
pub fn sim_config(path: &Path) -> anyhow::Result<crate::SimConfig> {
    ConfigFile::read(path)?.config()
}

/// A scenario or SimConfig file, read: which keys it sets and where they are in it.
pub struct ConfigFile {
    pub path: PathBuf,
    text: String,
    /// The file's keys in SimConfig's shape (a scenario's `[federation]` keys at the top).
    table: toml::Table,
    scenario: bool,
}

impl ConfigFile {
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut doc: toml::Table = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let path = path.to_path_buf();
        if doc.remove("scenario").is_none() {
            return Ok(Self { path, text, table: doc, scenario: false });
        }
        let mut table = match doc.remove("federation") {
            Some(toml::Value::Table(t)) => t,
            Some(_) => anyhow::bail!("{}: [federation] must be a table", path.display()),
            None => toml::Table::new(),
        };
        for key in ["method", "model", "data"] {
            if let Some(v) = doc.remove(key) {
                table.insert(key.into(), v);
            }
        }
        if let Some(extra) = doc.keys().next() {
            anyhow::bail!("{}: unknown table [{extra}]", path.display());
        }
        Ok(Self { path, text, table, scenario: true })
    }

    /// The file as a [`SimConfig`]; a bad key is refused with the line it is on.
    pub fn config(&self) -> anyhow::Result<SimConfig> {
        SimConfig::from_table(self.table.clone()).map_err(|e| {
            let what = if self.scenario { "the scenario" } else { "parsing" };
            match self.line_of(&e.key) {
                Some(line) => anyhow::anyhow!("{what} {}, line {line}: {e}", self.path.display()),
                None => anyhow::anyhow!("{what} {}: {e}", self.path.display()),
            }
        })
    }

    /// The 1-based line that sets a top-level SimConfig key (in a scenario's `[federation]`), or
    /// the header of its table (`[model]`).
    fn line_of(&self, key: &str) -> Option<usize> {
        let home = if self.scenario { "federation" } else { "" };
        let mut table = String::new();
        for (i, line) in self.text.lines().enumerate() {
            let line = line.trim();
            if let Some(header) = line.strip_prefix('[') {
                table = header.trim_start_matches('[').split(']').next().unwrap_or_default().trim().to_string();
                if table == key || table.starts_with(&format!("{key}.")) {
                    return Some(i + 1);
                }
            } else if table == home && line.split(['=', ' ']).next() == Some(key) {
                return Some(i + 1);
            }
        }
        None
    }

    /// The file's value of a SimConfig key (`&["data", "partition", "alpha"]`), if it sets one.
    pub fn get(&self, key: &[&str]) -> Option<&toml::Value> {
        let (last, tables) = key.split_last()?;
        let mut table = &self.table;
        for name in tables {
            table = table.get(*name)?.as_table()?;
        }
        table.get(*last)
    }

    /// A key as a reader finds it in the file: `[federation] clients`, `[data.partition] alpha`.
    pub fn key(&self, key: &[&str]) -> String {
        match key {
            [field] if self.scenario => format!("[federation] {field}"),
            [field] => field.to_string(),
            [tables @ .., field] => format!("[{}] {field}", tables.join(".")),
            [] => String::new(),
        }
    }
}

/// The number of clients a partition deals to.
pub fn partition_clients(partition: &mut PartitionSpec) -> &mut usize {
    match partition {
        PartitionSpec::Iid { clients, .. }
        | PartitionSpec::Dirichlet { clients, .. }
        | PartitionSpec::QuantitySkew { clients, .. }
        | PartitionSpec::LongTail { clients, .. }
        | PartitionSpec::Domains { clients, .. } => clients,
        PartitionSpec::Gldp(c) => &mut c.clients,
        PartitionSpec::Fedta(c) => &mut c.clients,
        PartitionSpec::FedprokSync(c) => &mut c.clients,
        PartitionSpec::FedprokAsync(c) => &mut c.clients,
    }
}

/// The configuration a run used, as TOML, with every value it used (the clock included) and no
/// key it did not: the embedded data's knobs go when a `[data]` table replaces them, `threads`
/// on the real clock, the evolving-only keys when the run is not evolving, `data_dir` when the
/// run reads no file. `anchorage sim <run>/config.toml` runs the same federation again.
/// (The `[method]` table carries every method's hyperparameters, whichever method runs.)
pub fn effective_toml(config: &SimConfig) -> anyhow::Result<String> {
    let mut table = toml::Table::try_from(config).context("the run's configuration as TOML")?;
    let mut unused: Vec<&str> = Vec::new();
    if config.data.spec.is_some() {
        unused.extend(["alpha", "noise", "train_per_class", "test_per_class"]);
    }
    if config.systems.clock == crate::Clock::Real {
        unused.push("threads");
    } else {
        unused.push("kill");
    }
    if !config.data.evolving {
        unused.push("target_domains");
    }
    if !reads_files(config) {
        unused.push("data_dir");
    }
    for key in unused {
        table.remove(key);
    }
    Ok(toml::to_string_pretty(&table)?)
}

/// Whether the run reads files from the data folder (a real dataset or pretrained weights).
pub fn reads_files(config: &SimConfig) -> bool {
    files_needed(config).is_some()
}

/// What the run reads from the data folder, in words (none: nothing).
pub fn files_needed(config: &SimConfig) -> Option<String> {
    use anchorage_data::DatasetKind::{Circle, Synthetic};
    let dataset = config.data.spec.as_ref().map(|d| d.dataset).filter(|d| !matches!(d, Synthetic | Circle));
    let backbone = Some(config.model.backbone.as_str()).filter(|b| !matches!(*b, "embedded" | "identity"));
    match (dataset, backbone) {
        (Some(d), _) => Some(format!("the files of the dataset {}", d.name())),
        (None, Some(b)) => Some(format!("the weights of the backbone {b}")),
        (None, None) => None,
    }
}

/// Range and name checks of a configuration before anything runs; an error names the key and
/// the file it came from.
pub fn check(config: &SimConfig, file: Option<&ConfigFile>) -> anyhow::Result<()> {
    let ensure = |ok: bool, key: &[&str], value: &dyn std::fmt::Display, rule: &str| match (ok, file) {
        (true, _) => Ok(()),
        (false, Some(f)) => Err(anyhow::anyhow!("{} = {value} in {}: {rule}", f.key(key), f.path.display())),
        (false, None) => Err(anyhow::anyhow!("{} = {value}: {rule}", key.join("."))),
    };
    let c = config;
    ensure(c.federation.clients >= 1, &["clients"], &c.federation.clients, "must be at least 1")?;
    ensure(c.federation.rounds >= 1, &["rounds"], &c.federation.rounds, "must be at least 1")?;
    ensure(c.federation.local_epochs >= 1, &["local_epochs"], &c.federation.local_epochs, "must be at least 1")?;
    ensure(c.federation.batch_size >= 1, &["batch_size"], &c.federation.batch_size, "must be at least 1")?;
    ensure(
        (0.0..=1.0).contains(&c.systems.straggler_ratio),
        &["straggler_ratio"],
        &c.systems.straggler_ratio,
        "must be within [0, 1]",
    )?;
    ensure(
        c.federation.fraction > 0.0 && c.federation.fraction <= 1.0,
        &["fraction"],
        &c.federation.fraction,
        "must be in (0, 1]",
    )?;
    ensure(
        c.federation.learning_rate.is_finite() && c.federation.learning_rate > 0.0,
        &["learning_rate"],
        &c.federation.learning_rate,
        "must be a number above 0",
    )?;
    ensure(c.output.eval_every >= 1, &["eval_every"], &c.output.eval_every, "must be at least 1")?;
    ensure(
        c.output.eval_fraction > 0.0 && c.output.eval_fraction <= 1.0,
        &["eval_fraction"],
        &c.output.eval_fraction,
        "must be in (0, 1]",
    )?;
    match &c.data.spec {
        None => ensure(c.data.alpha > 0.0, &["alpha"], &c.data.alpha, "must be above 0 (inf: IID)"),
        Some(data) => {
            ensure(data.scale > 0.0 && data.scale <= 1.0, &["data", "scale"], &data.scale, "must be in (0, 1]")?;
            if let Some(t) = data.test_scale {
                ensure(t > 0.0 && t <= 1.0, &["data", "test_scale"], &t, "must be in (0, 1]")?;
            }
            let evolving = matches!(data.partition, anchorage_data::PartitionSpec::Domains { .. });
            let validation = data.validation;
            ensure((0.0..1.0).contains(&validation), &["data", "validation"], &validation, "must be in [0, 1)")?;
            ensure(
                !(evolving && validation > 0.0),
                &["data", "validation"],
                &validation,
                "takes no fraction under a domains partition: evolving shifts validate on the last source domain's \
                 held-out rows (leave it out and set evaluate_on = \"validation\")",
            )?;
            let on_validation = data.evaluate_on == anchorage_data::EvaluateOn::Validation;
            ensure(
                !(on_validation && !evolving && validation == 0.0),
                &["data", "evaluate_on"],
                &"validation",
                "needs a validation split: set [data] validation (e.g. 0.1) or --validation",
            )?;
            let split = *partition_clients(&mut data.partition.clone());
            let rule = format!(
                "the federation has {} clients, the data split {split}; make them equal (--clients sets both)",
                c.federation.clients
            );
            ensure(split == c.federation.clients, &["data", "partition", "clients"], &split, &rule)
        }
    }
}

/// `current` switched to the method `name` (`--method`): the keys the two methods share keep
/// their values, the new method's other keys take its defaults. Returns the config and the keys
/// of `current` set away from their defaults that `name` does not have (dropped, `key = value`).
pub fn switch_method(current: &MethodConfig, name: &str) -> anyhow::Result<(MethodConfig, Vec<String>)> {
    let defaults = MethodConfig::named(name)
        .with_context(|| format!("unknown method `{name}` (known: {})", anchorage_shared::method::Names))?;
    let table = |m: &MethodConfig| match toml::Value::try_from(m) {
        Ok(toml::Value::Table(t)) => Ok(t),
        _ => Err(anyhow::anyhow!("method `{}` does not serialise as a table", m.name())),
    };
    let old = table(current)?;
    let old_defaults = table(&(current.info().defaults)())?;
    let mut kept = toml::Table::new();
    kept.insert("name".into(), name.into());
    let mut dropped = Vec::new();
    for (key, value) in old.into_iter().filter(|(k, _)| k != "name") {
        // The new method has the key when a table of its name and that key alone is accepted.
        let mut probe = toml::Table::new();
        probe.insert("name".into(), name.into());
        probe.insert(key.clone(), value.clone());
        if toml::Value::Table(probe).try_into::<MethodConfig>().is_ok() {
            kept.insert(key, value);
        } else if old_defaults.get(&key) != Some(&value) {
            dropped.push(format!("{key} = {value}"));
        }
    }
    let switched = if kept.len() == 1 { defaults } else { toml::Value::Table(kept).try_into()? };
    Ok((switched, dropped))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_file_has_a_valid_data_table() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios");
        let mut seen = 0;
        let files = std::fs::read_dir(&dir).unwrap().chain(std::fs::read_dir(dir.join("fidelity")).unwrap());
        for entry in files {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                data_spec(&path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
                let file = ConfigFile::read(&path).unwrap();
                check(&file.config().unwrap(), Some(&file)).unwrap_or_else(|e| panic!("{e:#}"));
                seen += 1;
            }
        }
        assert!(seen >= 7, "expected the seven paper scenarios, found {seen}");
    }

    #[test]
    fn the_fedta_scenario_is_one_sim_config() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios/fedta_tiny_imagenet.toml");
        let c = sim_config(&path).unwrap_or_else(|e| panic!("{e:#}"));
        let MethodConfig::FedTa(m) = &c.method else { panic!("{:?}", c.method) };
        assert_eq!((m.temperature, m.lock_threshold, m.weight_decay), (0.2, 0.25, 0.001));
        assert_eq!((m.ie_pool, m.ie_length, m.anchors), (10, 10, 100));
        assert!(m.tail_anchors && m.sikf && m.bgps);
        assert_eq!(
            (c.federation.clients, c.federation.rounds, c.data.rounds_per_task, c.federation.batch_size),
            (5, 25, 5, 16)
        );
        assert_eq!(c.federation.learning_rate, 0.001);
        assert!(anchorage_model::zoo::BACKBONES.contains(&c.model.backbone.as_str()));
        let Some(anchorage_data::PartitionSpec::Fedta(p)) = c.data.spec.as_ref().map(|d| &d.partition) else {
            panic!("the FedTA split")
        };
        assert_eq!((p.clients, p.tasks, p.classes_per_task, p.surrogate_per_class), (5, 5, 8, 20));
    }

    #[test]
    fn switching_the_method_keeps_the_keys_both_have() {
        let gldp: MethodConfig = toml::from_str("name = \"gldp\"\nbeta = 0.9\nlambda = 0.3").unwrap();
        let (fedprok, dropped) = switch_method(&gldp, "fedprok").unwrap();
        let MethodConfig::FedProK(p) = &fedprok else { panic!("{fedprok:?}") };
        assert_eq!((p.beta, p.replay_ratio), (0.9, 1.0), "beta kept, replay_ratio the default");
        assert_eq!(dropped.len(), 1, "only lambda is set away from GLDP's defaults: {dropped:?}");
        assert!(dropped[0].starts_with("lambda = 0.3"), "{dropped:?}");
        let (fedavg, _) = switch_method(&gldp, "fedavg").unwrap();
        assert_eq!(fedavg, MethodConfig::default());
        let error = format!("{:#}", switch_method(&gldp, "fedavgx").unwrap_err());
        assert!(error.contains("unknown method `fedavgx`"), "{error}");
    }

    #[test]
    fn a_validation_split_is_checked_against_the_partition() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.toml");
        let refused = |data: &str, partition: &str| {
            std::fs::write(
                &path,
                format!("clients = 10\n[data]\ndataset = \"synthetic\"\n{data}\n[data.partition]\n{partition}\n"),
            )
            .unwrap();
            let file = ConfigFile::read(&path).unwrap();
            check(&file.config().unwrap(), Some(&file)).err().map(|e| format!("{e:#}"))
        };
        let iid = "kind = \"iid\"\nclients = 10";
        let domains = "kind = \"domains\"\nclients = 10\ndomains = 3";
        assert_eq!(refused("validation = 0.1\nevaluate_on = \"validation\"", iid), None);
        assert_eq!(refused("evaluate_on = \"validation\"", domains), None, "the last source domain");
        let error = refused("evaluate_on = \"validation\"", iid).unwrap();
        assert!(error.contains("[data] evaluate_on") && error.contains("needs a validation split"), "{error}");
        let error = refused("validation = 0.1", domains).unwrap();
        assert!(error.contains("[data] validation") && error.contains("last source domain"), "{error}");
        let error = refused("validation = 1.5", iid).unwrap();
        assert!(error.contains("must be in [0, 1)"), "{error}");
    }

    #[test]
    fn a_gldp_table_with_a_fedta_key_is_refused_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.toml");
        std::fs::write(&path, "[method]\nname = \"gldp\"\nie_pool = 4\n").unwrap();
        let error = format!("{:#}", sim_config(&path).unwrap_err());
        assert!(error.contains("method `gldp`") && error.contains("unknown field `ie_pool`"), "{error}");
    }

    #[test]
    fn a_file_without_data_is_a_clear_error() {
        let dir = std::env::temp_dir().join(format!("anchorage-scenario-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("empty.toml");
        std::fs::write(&path, "[method]\nname = \"fedavg\"\n").unwrap();
        let err = format!("{:#}", data_spec(&path).unwrap_err());
        assert!(err.contains("no [data] table"), "{err}");
    }
}
