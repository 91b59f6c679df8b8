//! Scenario files (`scenarios/*.toml`): one per paper setting. Each holds a `[data]` table (the
//! data crate's [`DataSpec`]) beside the method, model and federation tables.

use std::path::Path;

use anchorage_data::DataSpec;
use anyhow::Context;

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
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut doc: toml::Table = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    if doc.remove("scenario").is_none() {
        return toml::from_str(&text).with_context(|| format!("parsing {}", path.display()));
    }
    let mut config = match doc.remove("federation") {
        Some(toml::Value::Table(t)) => t,
        Some(_) => anyhow::bail!("{}: [federation] must be a table", path.display()),
        None => toml::Table::new(),
    };
    for key in ["method", "model", "data"] {
        if let Some(v) = doc.remove(key) {
            config.insert(key.into(), v);
        }
    }
    if let Some(extra) = doc.keys().next() {
        anyhow::bail!("{}: unknown table [{extra}]", path.display());
    }
    toml::Value::Table(config).try_into().with_context(|| format!("the scenario {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_file_has_a_valid_data_table() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                data_spec(&path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
                seen += 1;
            }
        }
        assert!(seen >= 7, "expected the seven paper scenarios, found {seen}");
    }

    #[test]
    fn the_fedta_scenario_is_one_sim_config() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios/fedta_tiny_imagenet.toml");
        let c = sim_config(&path).unwrap_or_else(|e| panic!("{e:#}"));
        let m = &c.method;
        assert_eq!(m.name, "fedta");
        assert_eq!((m.temperature, m.lock_threshold, m.weight_decay), (0.2, 0.25, 0.001));
        assert_eq!((m.ie_pool, m.ie_length, m.anchors), (10, 10, 100));
        assert!(m.tail_anchors && m.sikf && m.bgps);
        assert_eq!((c.clients, c.rounds, c.rounds_per_task, c.batch_size), (5, 25, 5, 16));
        assert_eq!(c.learning_rate, 0.001);
        assert!(anchorage_client::model::zoo::BACKBONES.contains(&c.model.backbone.as_str()));
        let Some(anchorage_data::PartitionSpec::Fedta(p)) = c.data.as_ref().map(|d| &d.partition) else {
            panic!("the FedTA split")
        };
        assert_eq!((p.clients, p.tasks, p.classes_per_task, p.surrogate_per_class), (5, 5, 8, 20));
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
