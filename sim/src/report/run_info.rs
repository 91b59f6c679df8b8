//! What a run folder says about its run besides the summary: the method, the federation and the
//! task stream from `config.toml`; and how the run ended, in words.

use std::path::Path;

use anyhow::Context;

use super::accuracy::{AccuracyRow, task_starts};
use crate::record::{RunStatus, RunSummary};

/// A run's settings from its `config.toml`, each `None` where the folder has none (a server's
/// state folder).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunInfo {
    /// `[method] name`.
    pub method: Option<String>,
    pub clients: Option<u64>,
    /// The rounds the run was set to.
    pub rounds: Option<u64>,
    /// 0: a single task.
    pub rounds_per_task: u64,
    /// Evolving domains: one task stream, whatever `rounds_per_task` says.
    pub evolving: bool,
}

impl RunInfo {
    /// Reads `dir/config.toml` when it is there, loosely: keys this version does not know are no
    /// error.
    pub fn read(dir: &Path) -> anyhow::Result<Self> {
        let mut info = Self::default();
        let path = dir.join("config.toml");
        if let Some(text) = read_optional(&path)? {
            let config: toml::Table = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
            let int = |key: &str| config.get(key).and_then(toml::Value::as_integer).and_then(|v| u64::try_from(v).ok());
            info.method = config
                .get("method")
                .and_then(|m| m.get("name"))
                .and_then(toml::Value::as_str)
                .map(str::to_string)
                // `[method]` left out: SimConfig's default.
                .or_else(|| Some(anchorage_shared::method::MethodConfig::default().name().to_string()));
            info.clients = int("clients");
            info.rounds = int("rounds");
            info.rounds_per_task = int("rounds_per_task").unwrap_or(0);
            info.evolving = config.get("evolving").and_then(toml::Value::as_bool).unwrap_or(false);
        }
        Ok(info)
    }

    /// The run's method's registry entry (none for a name this build does not know).
    pub fn method_info(&self) -> Option<&'static anchorage_shared::method::MethodInfo> {
        self.method.as_deref().and_then(|m| anchorage_shared::method::info(&m.to_ascii_lowercase()))
    }

    /// How the run ended, in words: `finished (4 of 4 rounds)`, `interrupted after round 3
    /// (SIGINT)`, `failed after round 2 (the error)`, ...
    pub fn status_text(&self, summary: &RunSummary) -> String {
        let done = summary.rounds.len();
        let of = self.rounds.map(|r| format!(" of {r}")).unwrap_or_default();
        let why = summary.stop_reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default();
        let after = |verb: &str| match summary.rounds.last() {
            Some(last) => format!("{verb} after round {}{why}", last.round),
            None => format!("{verb} before any round closed{why}"),
        };
        match summary.status {
            RunStatus::Finished => format!("finished ({done}{of} rounds)"),
            RunStatus::Interrupted => after("interrupted"),
            RunStatus::Failed => after("failed"),
            // metrics.json never said how the run ended (the report adds when its last round
            // was written, from the run folder's tables).
            RunStatus::Running => match summary.rounds.last() {
                Some(last) => format!("stopped without finishing (or still running): last round {}{of}", last.round),
                None => "stopped without finishing (or still running): no round closed".into(),
            },
        }
    }

    /// `(task, first round)` of each task after the first: from the accuracy records' `task`
    /// column when there are any, else from `rounds_per_task` up to `last_round`.
    pub fn task_starts(&self, rows: Option<&[AccuracyRow]>, last_round: u64) -> Vec<(usize, u64)> {
        if let Some(rows) = rows.filter(|r| !r.is_empty()) {
            return task_starts(rows);
        }
        if self.evolving || self.rounds_per_task == 0 {
            return Vec::new();
        }
        (1..).map(|k| (k, k as u64 * self.rounds_per_task + 1)).take_while(|(_, round)| *round <= last_round).collect()
    }
}

/// A file's text, or `None` when it does not exist.
fn read_optional(path: &Path) -> anyhow::Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::SummaryInputs;

    fn summary(rounds: u64) -> RunSummary {
        let rows = (1..=rounds).map(|round| crate::RoundRow::example(round, 0.5, 1.0)).collect();
        RunSummary::new(SummaryInputs::example(), rows, &[], &[])
    }

    #[test]
    fn config_and_status_are_read_loosely() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(RunInfo::read(dir.path()).unwrap(), RunInfo::default(), "an empty folder says nothing");
        std::fs::write(
            dir.path().join("config.toml"),
            "clients = 3\nrounds = 6\nrounds_per_task = 2\nfuture_key = 1\n[method]\nname = \"fedprok\"\n",
        )
        .unwrap();
        let info = RunInfo::read(dir.path()).unwrap();
        assert_eq!(info.method.as_deref(), Some("fedprok"));
        assert!(info.method_info().is_some_and(|m| m.name == "fedprok" && m.reports_efficiency));
        assert_eq!((info.clients, info.rounds, info.rounds_per_task), (Some(3), Some(6), 2));
        assert_eq!(info.task_starts(None, 5), vec![(1, 3), (2, 5)]);
        let status = |status: RunStatus, reason: Option<&str>, rounds: u64| {
            let mut s = summary(rounds);
            (s.status, s.stop_reason) = (status, reason.map(str::to_string));
            info.status_text(&s)
        };
        assert_eq!(status(RunStatus::Finished, None, 6), "finished (6 of 6 rounds)");
        assert_eq!(status(RunStatus::Interrupted, Some("SIGINT"), 3), "interrupted after round 3 (SIGINT)");
        assert_eq!(status(RunStatus::Failed, None, 0), "failed before any round closed");
        assert_eq!(
            status(RunStatus::Running, None, 2),
            "stopped without finishing (or still running): last round 2 of 6"
        );
        std::fs::write(dir.path().join("config.toml"), "clients = [").unwrap();
        let err = format!("{:#}", RunInfo::read(dir.path()).unwrap_err());
        assert!(err.contains("parsing") && err.contains("config.toml"), "{err}");
    }
}
