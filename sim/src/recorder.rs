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
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
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

    /// The signal's name (a closed stdout is SIGPIPE's case).
    fn signal(self) -> &'static str {
        match self {
            StopReason::Interrupt => "SIGINT",
            StopReason::Terminate => "SIGTERM",
            StopReason::ClosedStdout => "SIGPIPE",
        }
    }
}

/// A request to stop after the round in flight, shared with the signal thread: 0 while none.
#[derive(Clone, Default)]
pub struct StopFlag {
    reason: Arc<AtomicUsize>,
    /// The run folder being written (and the lock its metrics.json is written under), for a
    /// second signal to mark before the process quits.
    folder: Arc<Mutex<Option<Watched>>>,
}

/// A run folder a second signal marks as interrupted.
#[derive(Clone)]
struct Watched {
    dir: PathBuf,
    metrics: Arc<Mutex<()>>,
}

impl StopFlag {
    /// A flag SIGINT and SIGTERM set. A second signal of either kind quits at once (status 130 /
    /// 143): the user asked twice. Before it quits, the run folder's `metrics.json` is marked
    /// `interrupted`, with the rounds that closed (waiting at most 2 s for a write in progress),
    /// so that the folder does not say `running` forever; a third signal exits at once whatever
    /// that is doing. The signal handlers themselves only store to atomics and wake the thread
    /// that does the rest (async-signal-safe).
    pub fn on_signals() -> anyhow::Result<Self> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let flag = Self::default();
        let armed = Arc::new(AtomicBool::new(false));
        for signal in [SIGINT, SIGTERM] {
            let code = Self::reason_of(signal).exit_code();
            // Registered before the thread's handler: the third signal finds `armed` and exits.
            signal_hook::flag::register_conditional_shutdown(signal, code, armed.clone())?;
        }
        let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])?;
        let handler = flag.clone();
        std::thread::Builder::new().name("anchorage-signals".into()).spawn(move || {
            let mut seen = 0;
            for signal in signals.forever() {
                let reason = Self::reason_of(signal);
                seen += 1;
                if seen == 1 {
                    handler.reason.store(reason as usize + 1, Ordering::SeqCst);
                } else {
                    armed.store(true, Ordering::SeqCst);
                    handler.quit_now(reason);
                }
            }
        })?;
        Ok(flag)
    }

    fn reason_of(signal: i32) -> StopReason {
        if signal == signal_hook::consts::SIGTERM { StopReason::Terminate } else { StopReason::Interrupt }
    }

    /// The run folder a second signal marks (the last one a [`Recorder`] opened with this flag).
    fn watch(&self, dir: &Path, metrics: Arc<Mutex<()>>) {
        if let Ok(mut folder) = self.folder.lock() {
            *folder = Some(Watched { dir: dir.to_path_buf(), metrics });
        }
    }

    /// The second signal: marks the run folder (see [`Self::on_signals`]) and quits.
    fn quit_now(&self, reason: StopReason) -> ! {
        let watched = self.folder.lock().ok().and_then(|f| f.clone());
        if let Some(w) = watched {
            let deadline = Instant::now() + Duration::from_secs(2);
            let guard = loop {
                match w.metrics.try_lock() {
                    Ok(guard) => break Some(guard),
                    Err(std::sync::TryLockError::Poisoned(p)) => break Some(p.into_inner()),
                    Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(10))
                    }
                    Err(std::sync::TryLockError::WouldBlock) => break None,
                }
            };
            let signal = reason.signal();
            match guard.map(|_guard| mark_quit(&w.dir, reason)) {
                Some(Ok(Some(rounds))) => eprintln!(
                    "{signal} again: quit at once; run folder {} says interrupted after {rounds} rounds",
                    w.dir.display()
                ),
                Some(Ok(None)) => {}
                Some(Err(e)) => eprintln!("{signal} again: quit at once; could not mark {}: {e:#}", w.dir.display()),
                None => eprintln!("{signal} again: quit at once; {} still says running", w.dir.display()),
            }
        }
        // SAFETY: _exit ends the process without running anything else (as the signal handler
        // of a third signal does); nothing is left to flush: stdout lines are flushed one by one.
        unsafe { libc::_exit(reason.exit_code()) }
    }

    pub fn request(&self, reason: StopReason) {
        let _ = self.reason.compare_exchange(0, reason as usize + 1, Ordering::SeqCst, Ordering::SeqCst);
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
        match self.reason.load(Ordering::SeqCst) {
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
    /// configuration `config` as `config.toml`). A folder that already holds a run of another
    /// configuration is refused (its results are not overwritten silently); one that holds a run
    /// of the same configuration is replaced whole (no file of the earlier run stays behind).
    pub fn new(console: Console, dir: Option<&Path>, config: &SimConfig, stop: StopFlag) -> anyhow::Result<Self> {
        Self::open(console, dir, config, stop, false)
    }

    /// [`Self::new`], replacing whatever run `dir` holds (`--force`).
    pub fn new_replacing(
        console: Console,
        dir: Option<&Path>,
        config: &SimConfig,
        stop: StopFlag,
    ) -> anyhow::Result<Self> {
        Self::open(console, dir, config, stop, true)
    }

    fn open(
        console: Console,
        dir: Option<&Path>,
        config: &SimConfig,
        stop: StopFlag,
        replace: bool,
    ) -> anyhow::Result<Self> {
        let say = matches!(console, Console::Human | Console::Quiet);
        let folder = dir.map(|d| RunFolder::create(d, config, replace, say)).transpose()?;
        if let Some(folder) = &folder {
            stop.watch(&folder.dir, folder.metrics_lock.clone());
        }
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
            privacy: None,
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
    /// Held while metrics.json is written, so that a second Ctrl-C marks it whole.
    metrics_lock: Arc<Mutex<()>>,
}

/// The files a run writes into its folder (besides the report's).
const RUN_FILES: [&str; 6] = [
    "config.toml",
    "metrics.json",
    crate::record::ROUNDS_FILE,
    crate::record::LEDGER_CSV_FILE,
    "ledger.json",
    crate::accuracy::FILE,
];

impl RunFolder {
    /// Creates `dir` (if needed) with the effective configuration and empty tables. A folder
    /// holding an earlier run is refused when that run's configuration differs (unless
    /// `replace`); else that run's files (and its report's) are removed first. `say`: tell the
    /// console on stderr when an earlier run is replaced.
    fn create(dir: &Path, config: &SimConfig, replace: bool, say: bool) -> anyhow::Result<Self> {
        let toml = crate::scenario::effective_toml(config)?;
        clear_earlier_run(dir, &toml, replace, say)?;
        std::fs::create_dir_all(dir).with_context(|| format!("creating the run folder {}", dir.display()))?;
        write_atomic(&dir.join("config.toml"), toml.as_bytes())?;
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
            metrics_lock: Arc::default(),
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
        let _writing = self.metrics_lock.lock().unwrap_or_else(|p| p.into_inner());
        write_atomic(&self.dir.join("metrics.json"), serde_json::to_string_pretty(summary)?.as_bytes())
    }

    /// Every table rewritten from the final record (the virtual clock completes rows' wire bytes
    /// and late cost records after the rounds closed), then metrics.json with the status.
    fn finish(&mut self, summary: &RunSummary, ledger: &[CostRecord], accuracy: &[AccuracyRow]) -> anyhow::Result<()> {
        // A second Ctrl-C meanwhile waits: it marks a folder still `running`, or none.
        let _writing = self.metrics_lock.lock().unwrap_or_else(|p| p.into_inner());
        crate::record::write_tables(&self.dir, summary, ledger, accuracy)?;
        write_atomic(&self.dir.join("metrics.json"), serde_json::to_string_pretty(summary)?.as_bytes())
    }
}

/// Makes `dir` ready for a run of configuration `toml`: nothing to do when it does not exist or
/// holds no run. An earlier run of another configuration is refused (unless `replace`); else its
/// files and its report's are removed, so that no table or picture of it stays behind. Other
/// files are left alone.
fn clear_earlier_run(dir: &Path, toml: &str, replace: bool, say: bool) -> anyhow::Result<()> {
    let present: Vec<&str> = RUN_FILES.iter().copied().filter(|f| dir.join(f).exists()).collect();
    if present.is_empty() {
        return Ok(());
    }
    let earlier = std::fs::read_to_string(dir.join("config.toml")).ok();
    let difference = match &earlier {
        None => Some("its config.toml is missing".to_string()),
        Some(text) => config_difference(text, toml),
    };
    if let Some(difference) = &difference
        && !replace
    {
        anyhow::bail!(
            "{} already holds another run ({difference}): give another --out, or --force to replace it",
            dir.display()
        );
    }
    if say {
        let which = if difference.is_some() { "an earlier run" } else { "the earlier run of this configuration" };
        eprintln!("replacing {which} in {}", dir.display());
    }
    let report = crate::report::report_files();
    for name in RUN_FILES.iter().map(|f| f.to_string()).chain(report) {
        let path = dir.join(&name);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {} (of the earlier run)", path.display()));
            }
            _ => {}
        }
    }
    Ok(())
}

/// How an earlier run's `config.toml` differs from this run's, in words (`None`: the same
/// configuration): the first key whose value differs.
fn config_difference(earlier: &str, now: &str) -> Option<String> {
    let (Ok(a), Ok(b)) = (toml::from_str::<toml::Table>(earlier), toml::from_str::<toml::Table>(now)) else {
        return (earlier != now).then(|| "its config.toml differs".to_string());
    };
    if a == b {
        return None;
    }
    let show = |v: Option<&toml::Value>| v.map_or_else(|| "unset".to_string(), |v| v.to_string());
    let key = b.keys().chain(a.keys()).find(|k| a.get(*k) != b.get(*k))?;
    let (was, is) = (show(a.get(key)), show(b.get(key)));
    // A table prints whole: name it only.
    if was.len() + is.len() > 80 {
        return Some(format!("its [{key}] differs from this run's"));
    }
    Some(format!("its {key} = {was}, this run's {key} = {is}"))
}

/// A second signal's mark on a run folder whose metrics.json still says `running`: `interrupted`
/// with the reason, and the rows of every round that closed (from rounds.csv, which is more
/// recent than the metrics.json of a running run). Returns the rounds, or `None` when the folder
/// says something else already (the run had written its final record).
fn mark_quit(dir: &Path, reason: StopReason) -> anyhow::Result<Option<usize>> {
    let path = dir.join("metrics.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut metrics: serde_json::Value = serde_json::from_str(&text).context("parsing metrics.json")?;
    if metrics.get("status").and_then(|s| s.as_str()) != Some("running") {
        return Ok(None);
    }
    let rows: Option<Vec<RoundRow>> = csv::Reader::from_path(dir.join(crate::record::ROUNDS_FILE))
        .ok()
        .and_then(|mut r| r.deserialize().collect::<Result<Vec<RoundRow>, _>>().ok());
    if let Some(rows) = rows {
        if let Some(last) = rows.last().filter(|r| r.accuracy.is_finite()) {
            metrics["final_accuracy"] = serde_json::json!(last.accuracy);
        }
        metrics["rounds"] = serde_json::to_value(&rows)?;
    }
    let rounds = metrics["rounds"].as_array().map_or(0, Vec::len);
    metrics["status"] = "interrupted".into();
    metrics["stop_reason"] = format!(
        "{} twice: quit at once; the round in flight was lost, and the tables end at the last round that closed",
        reason.signal()
    )
    .into();
    write_atomic(&path, serde_json::to_string_pretty(&metrics)?.as_bytes())?;
    Ok(Some(rounds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FederationConfig;

    fn config(rounds: u64) -> SimConfig {
        SimConfig { federation: FederationConfig { rounds, ..Default::default() }, ..SimConfig::default() }
    }

    /// `--out` into a folder that holds a run of another configuration is
    /// refused; the same configuration replaces the earlier run whole, old charts included.
    #[test]
    fn a_folder_holding_another_run_is_not_overwritten_silently() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        let mut first = Recorder::new(Console::Silent, Some(&dir), &config(5), StopFlag::default()).unwrap();
        first.start("test", Some(0.1), 0.1, 5).unwrap();
        first.round(&RoundRow::example(1, 0.5, 0.1), &[], &[], None).unwrap();
        drop(first);
        for stale in ["accuracy_matrix.png", "accuracy_matrix.svg", "report.md", "ledger.json"] {
            std::fs::write(dir.join(stale), "old").unwrap();
        }
        std::fs::write(dir.join("notes.txt"), "mine").unwrap();

        let err = Recorder::new(Console::Silent, Some(&dir), &config(3), StopFlag::default()).err().unwrap();
        let err = format!("{err:#}");
        assert!(err.contains("already holds another run (its rounds = 5, this run's rounds = 3)"), "{err}");
        assert_eq!(std::fs::read_to_string(dir.join("report.md")).unwrap(), "old", "refused: nothing touched");

        // The same configuration again: the earlier run is replaced, nothing of it stays.
        let again = Recorder::new(Console::Silent, Some(&dir), &config(5), StopFlag::default()).unwrap();
        drop(again);
        for stale in ["accuracy_matrix.png", "accuracy_matrix.svg", "report.md", "ledger.json", "metrics.json"] {
            assert!(!dir.join(stale).exists(), "{stale} of the earlier run is still there");
        }
        assert_eq!(std::fs::read_to_string(dir.join("rounds.csv")).unwrap().lines().count(), 1, "the header only");
        assert!(dir.join("notes.txt").exists(), "files that are not the run's stay");

        // Replacing on purpose (`--force`).
        Recorder::new_replacing(Console::Silent, Some(&dir), &config(3), StopFlag::default()).unwrap();
        assert!(std::fs::read_to_string(dir.join("config.toml")).unwrap().contains("rounds = 3"));
    }

    /// A second Ctrl-C marks a running folder `interrupted`, with every
    /// round rounds.csv holds; a folder that says how it ended is left alone.
    #[test]
    fn a_second_signal_marks_a_running_folder() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        let stop = StopFlag::default();
        let mut recorder = Recorder::new(Console::Silent, Some(&dir), &config(9), stop.clone()).unwrap();
        recorder.start("test", Some(0.1), 0.1, 9).unwrap();
        for round in 1..=3 {
            recorder.round(&RoundRow::example(round, 0.1 * round as f64, 0.1), &[], &[], None).unwrap();
        }
        let before: RunSummary =
            serde_json::from_str(&std::fs::read_to_string(dir.join("metrics.json")).unwrap()).unwrap();
        assert_eq!(before.status, RunStatus::Running);
        assert!(before.rounds.len() < 3, "rewritten at most every 2 s: behind rounds.csv");
        let watched = stop.folder.lock().unwrap().clone().expect("the recorder's folder is watched");
        assert_eq!(watched.dir, dir);

        assert_eq!(mark_quit(&dir, StopReason::Interrupt).unwrap(), Some(3));
        let marked: RunSummary =
            serde_json::from_str(&std::fs::read_to_string(dir.join("metrics.json")).unwrap()).unwrap();
        assert_eq!((marked.status, marked.rounds.len()), (RunStatus::Interrupted, 3));
        assert!((marked.final_accuracy - 0.3).abs() < 1e-9);
        assert!(marked.stop_reason.unwrap().starts_with("SIGINT twice: quit at once"));
        assert_eq!(mark_quit(&dir, StopReason::Interrupt).unwrap(), None, "already says how it ended");
    }
}
