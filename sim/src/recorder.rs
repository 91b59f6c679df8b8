//! The run as it goes: the console (human table, quiet, or JSON lines) and the run folder, both
//! written round by round, and the stop request (Ctrl-C, SIGTERM, a closed stdout) that ends a
//! run after the round in flight.
//!
//! Both clocks report to a [`Recorder`]: `start` once, `round` as each round closes, then
//! `finish` (or `fail`). The folder is complete after every round: `config.toml` first,
//! `rounds.csv`, `ledger.csv` and `accuracy.csv` appended and flushed, `metrics.json` rewritten
//! (atomically) with `status = "running"`; `finish` rewrites every file from the run's final
//! record with its status, so an interrupted run leaves a readable folder and never an empty one.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::record::write_atomic;
use anchorage_shared::ledger::CostRecord;
use anyhow::Context;
use indicatif::ProgressBar;
use serde::Serialize;

use crate::accuracy::AccuracyRow;
use crate::config::SimConfig;
use crate::record::{RoundRow, RunStatus, RunSummary, SummaryInputs, human_bytes};

/// How the run talks to its terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Console {
    /// Nothing (the library's default; tests).
    Silent,
    /// The run folder, progress bars (on a terminal), the round table and a summary line.
    Human,
    /// Only the run folder's line and the summary line.
    Quiet,
    /// One JSON object per line on stdout: `start`, each `round`, then `finished` (for scripts).
    Json,
}

/// Why a run stops before its last round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    Interrupt,
    Terminate,
    ClosedStdout,
}

impl StopReason {
    /// The exit status of a stopped run (128 + the signal, as a shell reports it).
    pub fn exit_code(self) -> i32 {
        match self {
            StopReason::Interrupt => 130,
            StopReason::Terminate => 143,
            StopReason::ClosedStdout => 141,
        }
    }

    /// In words, as `metrics.json`'s `stop_reason` and the console say it.
    pub fn describe(self) -> &'static str {
        match self {
            StopReason::Interrupt => "interrupted (SIGINT)",
            StopReason::Terminate => "terminated (SIGTERM)",
            StopReason::ClosedStdout => "stdout closed",
        }
    }
}

/// A request to stop after the round in flight, shared with signal handlers: 0 while none.
#[derive(Clone, Default)]
pub struct StopFlag(Arc<AtomicUsize>);

impl StopFlag {
    /// A flag SIGINT and SIGTERM set. A second signal of either kind exits at once (status 130 /
    /// 143): the user asked twice. The handlers only store to an atomic (async-signal-safe).
    pub fn on_signals() -> anyhow::Result<Self> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let flag = Self::default();
        for (signal, reason) in [(SIGINT, StopReason::Interrupt), (SIGTERM, StopReason::Terminate)] {
            let set = Arc::new(std::sync::atomic::AtomicBool::new(false));
            // Registered first, so the second signal finds `set` already true and exits.
            signal_hook::flag::register_conditional_shutdown(signal, reason.exit_code(), set.clone())?;
            signal_hook::flag::register(signal, set)?;
            signal_hook::flag::register_usize(signal, flag.0.clone(), reason as usize + 1)?;
        }
        Ok(flag)
    }

    pub fn request(&self, reason: StopReason) {
        let _ = self.0.compare_exchange(0, reason as usize + 1, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Prints one line to stdout; a closed stdout asks the run to stop (and later lines are
    /// dropped) instead of panicking as `println!` would.
    pub fn println(&self, line: &str) {
        if self.requested() == Some(StopReason::ClosedStdout) {
            return;
        }
        let mut out = std::io::stdout().lock();
        if writeln!(out, "{line}").and_then(|_| out.flush()).is_err() {
            self.request(StopReason::ClosedStdout);
        }
    }

    pub fn requested(&self) -> Option<StopReason> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            1 => Some(StopReason::Interrupt),
            2 => Some(StopReason::Terminate),
            _ => Some(StopReason::ClosedStdout),
        }
    }
}

/// The console, the run folder and the stop flag of one run.
pub struct Recorder {
    console: Console,
    folder: Option<RunFolder>,
    stop: StopFlag,
    bar: ProgressBar,
    /// The rows so far, for the `running` metrics.json (one per round: small).
    rows: Vec<RoundRow>,
    initial_accuracy: f64,
    chance: f64,
    started: Instant,
    last_metrics: Option<Instant>,
    announced_stop: bool,
}

impl Recorder {
    /// A recorder that prints nothing and writes no folder.
    pub fn silent() -> Self {
        Self::with(Console::Silent, None, StopFlag::default())
    }

    /// A recorder for `console` that writes the run folder `dir` (created first, with the
    /// configuration `config` as `config.toml`).
    pub fn new(console: Console, dir: Option<&Path>, config: &SimConfig, stop: StopFlag) -> anyhow::Result<Self> {
        let folder = dir.map(|d| RunFolder::create(d, config)).transpose()?;
        Ok(Self::with(console, folder, stop))
    }

    fn with(console: Console, folder: Option<RunFolder>, stop: StopFlag) -> Self {
        Self {
            console,
            folder,
            stop,
            bar: ProgressBar::hidden(),
            rows: Vec::new(),
            initial_accuracy: f64::NAN,
            chance: f64::NAN,
            started: Instant::now(),
            last_metrics: None,
            announced_stop: false,
        }
    }

    pub fn dir(&self) -> Option<&Path> {
        self.folder.as_ref().map(|f| f.dir.as_path())
    }

    /// Whether the run should end after the round in flight (and why).
    pub fn stop_requested(&mut self) -> Option<StopReason> {
        let reason = self.stop.requested()?;
        if !self.announced_stop {
            self.announced_stop = true;
            let round = self.rows.last().map_or(0, |r| r.round);
            self.bar.suspend(|| {
                eprintln!("{}: finishing round {} in flight, then writing the run folder", reason.describe(), round + 1)
            });
            tracing::info!(reason = reason.describe(), "stopping after the round in flight");
        }
        Some(reason)
    }

    /// The first lines: the run folder, the run's headline, the initial accuracy (`None`: the
    /// method has no global model before the first round), the table's header.
    pub fn start(&mut self, headline: &str, initial: Option<f64>, chance: f64, rounds: u64) -> anyhow::Result<()> {
        self.initial_accuracy = initial.unwrap_or(f64::NAN);
        self.chance = chance;
        let dir = self.dir().map(|d| d.display().to_string());
        match self.console {
            Console::Silent => {}
            Console::Human | Console::Quiet => {
                if let Some(dir) = &dir {
                    self.print(&format!("run folder: {dir}"));
                }
                if self.console == Console::Human {
                    self.print(&format!("anchorage sim: {headline}"));
                    let initial = initial.map_or_else(
                        || "– (no global model before the first round)".to_string(),
                        |a| format!("{:.2}%", a * 100.0),
                    );
                    self.print(&format!("initial global accuracy {initial}"));
                    self.print(RoundRow::HEADER);
                    self.bar = crate::progress::bar(rounds, "round");
                }
            }
            Console::Json => {
                #[derive(Serialize)]
                struct Start<'a> {
                    event: &'a str,
                    run_folder: Option<&'a str>,
                    headline: &'a str,
                    initial_accuracy: Option<f64>,
                    rounds: u64,
                }
                let start =
                    Start { event: "start", run_folder: dir.as_deref(), headline, initial_accuracy: initial, rounds };
                self.print(&serde_json::to_string(&start)?);
            }
        }
        self.write_running_metrics()?;
        Ok(())
    }

    /// A closed round: its row on the console, and its row, costs and accuracy records appended
    /// to the run folder. `simulated` is the virtual clock's time at the close.
    pub fn round(
        &mut self,
        row: &RoundRow,
        costs: &[CostRecord],
        accuracy: &[AccuracyRow],
        simulated: Option<Duration>,
    ) -> anyhow::Result<()> {
        match self.console {
            Console::Silent | Console::Quiet => {}
            Console::Human => {
                self.print(&row.table_line());
                self.bar.inc(1);
                let at = simulated.map(|t| format!("simulated {:.0} s, ", t.as_secs_f64())).unwrap_or_default();
                self.bar.set_message(format!("{at}acc {:.1}%", row.accuracy * 100.0));
            }
            Console::Json => {
                #[derive(Serialize)]
                struct Round<'a> {
                    event: &'a str,
                    #[serde(flatten)]
                    row: &'a RoundRow,
                    simulated_seconds: Option<f64>,
                }
                let line = Round { event: "round", row, simulated_seconds: simulated.map(|t| t.as_secs_f64()) };
                self.print(&serde_json::to_string(&line)?);
            }
        }
        if let Some(folder) = self.folder.as_mut() {
            folder.append(row, costs, accuracy)?;
        }
        self.rows.push(row.clone());
        // metrics.json holds every row: rewrite it at most every 2 s (a long run's rows are many).
        if self.last_metrics.is_none_or(|t| t.elapsed() >= Duration::from_secs(2)) {
            self.write_running_metrics()?;
        }
        Ok(())
    }

    /// The run ended (all rounds, or stopped): the final record goes to the folder with its status,
    /// then the summary line. Returns the status written.
    pub fn finish(
        &mut self,
        summary: &mut RunSummary,
        ledger: &[CostRecord],
        accuracy: &[AccuracyRow],
        simulated: Option<Duration>,
    ) -> anyhow::Result<RunStatus> {
        self.bar.finish_and_clear();
        let stopped = self.stop.requested();
        summary.status = match stopped {
            Some(_) => RunStatus::Interrupted,
            None => RunStatus::Finished,
        };
        summary.stop_reason = stopped.map(|r| r.describe().to_string());
        if let Some(folder) = self.folder.as_mut() {
            folder.finish(summary, ledger, accuracy)?;
        }
        let initial = crate::record::percent(summary.initial_accuracy);
        match self.console {
            Console::Silent => {}
            Console::Human | Console::Quiet => {
                let how = stopped.map(|r| format!("{} after round {}; ", r.describe(), summary.rounds.len()));
                let how = how.unwrap_or_default();
                let line = match simulated {
                    Some(t) => format!(
                        "{how}final accuracy {:.2}% (initial {initial}); {:.1} simulated seconds of rounds in {:.1} s",
                        summary.final_accuracy * 100.0,
                        t.as_secs_f64(),
                        summary.wall_seconds
                    ),
                    None => format!(
                        "{how}final accuracy {:.2}% (initial {initial}, chance {:.0}%); mean upload {} payload, \
                         wire/payload {:.4}; {:.1} s",
                        summary.final_accuracy * 100.0,
                        summary.chance * 100.0,
                        summary.mean_upload_payload.map(|b| human_bytes(b as u64)).unwrap_or_else(|| "-".into()),
                        summary.upload_wire_ratio.unwrap_or(f64::NAN),
                        summary.wall_seconds
                    ),
                };
                self.print(&line);
            }
            Console::Json => {
                #[derive(Serialize)]
                struct Finished<'a> {
                    event: &'a str,
                    status: RunStatus,
                    stop_reason: Option<&'a str>,
                    rounds: usize,
                    final_accuracy: f64,
                    wall_seconds: f64,
                    run_folder: Option<String>,
                }
                let line = Finished {
                    event: "finished",
                    status: summary.status,
                    stop_reason: summary.stop_reason.as_deref(),
                    rounds: summary.rounds.len(),
                    final_accuracy: summary.final_accuracy,
                    wall_seconds: summary.wall_seconds,
                    run_folder: self.dir().map(|d| d.display().to_string()),
                };
                self.print(&serde_json::to_string(&line)?);
            }
        }
        Ok(summary.status)
    }

    /// The run failed: the folder keeps what the rounds wrote, and metrics.json says `failed`
    /// with the error.
    pub fn fail(&mut self, error: &anyhow::Error) {
        self.bar.finish_and_clear();
        let mut summary = self.summary_so_far();
        summary.status = RunStatus::Failed;
        summary.stop_reason = Some(format!("{error:#}"));
        if let Some(folder) = &self.folder
            && let Err(e) = folder.write_metrics(&summary)
        {
            tracing::error!(error = %format!("{e:#}"), "could not write metrics.json of a failed run");
        }
    }

    /// A line for the human console (progress bars stay below it).
    pub fn say(&self, line: &str) {
        if self.console == Console::Human {
            self.print(line);
        }
    }

    /// Prints one line to stdout; a closed stdout asks the run to stop and silences the console
    /// (the folder is still written).
    fn print(&self, line: &str) {
        self.bar.suspend(|| self.stop.println(line));
    }

    fn summary_so_far(&self) -> RunSummary {
        let inputs = SummaryInputs {
            initial_accuracy: self.initial_accuracy,
            chance: self.chance,
            late_updates: self.rows.last().map_or(0, |r| r.late_total),
            refused: 0,
            decode_errors: 0,
            wall_seconds: self.started.elapsed().as_secs_f64(),
            local_eval: Default::default(),
        };
        let mut summary = RunSummary::new(inputs, self.rows.clone(), &[], &[]);
        summary.status = RunStatus::Running;
        summary
    }

    fn write_running_metrics(&mut self) -> anyhow::Result<()> {
        if let Some(folder) = &self.folder {
            folder.write_metrics(&self.summary_so_far())?;
            self.last_metrics = Some(Instant::now());
        }
        Ok(())
    }
}

/// The run folder's files while the run goes.
struct RunFolder {
    dir: PathBuf,
    rounds: csv::Writer<File>,
    ledger: csv::Writer<File>,
    accuracy: csv::Writer<File>,
}

impl RunFolder {
    /// Creates `dir` (if needed) with the effective configuration and empty tables.
    fn create(dir: &Path, config: &SimConfig) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating the run folder {}", dir.display()))?;
        write_atomic(&dir.join("config.toml"), crate::scenario::effective_toml(config)?.as_bytes())?;
        let open = |name: &str| -> anyhow::Result<csv::Writer<File>> {
            let path = dir.join(name);
            let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
            // Headers are written below, once, even for a table that stays empty.
            Ok(csv::WriterBuilder::new().has_headers(false).from_writer(file))
        };
        let mut folder = Self {
            dir: dir.to_path_buf(),
            rounds: open(crate::record::ROUNDS_FILE)?,
            ledger: open(crate::record::LEDGER_CSV_FILE)?,
            accuracy: open(crate::accuracy::FILE)?,
        };
        // Headers now, so a folder stopped before its first round still has readable tables.
        folder.rounds.write_record(crate::record::ROUNDS_HEADER)?;
        folder.ledger.write_record(anchorage_shared::ledger::CSV_HEADER.split(','))?;
        folder.accuracy.write_record(crate::record::ACCURACY_HEADER_FIELDS)?;
        for w in [&mut folder.rounds, &mut folder.ledger, &mut folder.accuracy] {
            w.flush()?;
        }
        Ok(folder)
    }

    fn append(&mut self, row: &RoundRow, costs: &[CostRecord], accuracy: &[AccuracyRow]) -> anyhow::Result<()> {
        self.rounds.serialize(row)?;
        for c in costs {
            self.ledger.serialize(c)?;
        }
        for a in accuracy {
            self.accuracy.serialize(a)?;
        }
        for w in [&mut self.rounds, &mut self.ledger, &mut self.accuracy] {
            w.flush().with_context(|| format!("appending to the run folder {}", self.dir.display()))?;
        }
        Ok(())
    }

    fn write_metrics(&self, summary: &RunSummary) -> anyhow::Result<()> {
        write_atomic(&self.dir.join("metrics.json"), serde_json::to_string_pretty(summary)?.as_bytes())
    }

    /// Every table rewritten from the final record (the virtual clock completes rows' wire bytes
    /// and late cost records after the rounds closed), then metrics.json with the status.
    fn finish(&mut self, summary: &RunSummary, ledger: &[CostRecord], accuracy: &[AccuracyRow]) -> anyhow::Result<()> {
        crate::record::write_tables(&self.dir, summary, ledger, accuracy)?;
        self.write_metrics(summary)
    }
}
