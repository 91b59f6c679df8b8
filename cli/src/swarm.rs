//! `anchorage swarm`: seeded whole-federation runs with every promise checked after every step
//! (`anchorage_sim::swarm`), one seed or a range, a summary table, `--shrink` on a failure.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anchorage_sim::swarm::{self, Outcome, Verdict};
use anchorage_sim::virtual_clock::Mutation;
use anyhow::Context;
use clap::Args;

#[derive(Args)]
pub(crate) struct SwarmArgs {
    /// The first seed (with --seeds, the first of a range).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// How many seeds to run, from --seed on.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    seeds: u64,
    /// Print each seed's drawn config (a file `anchorage sim --config` reads) before its run.
    #[arg(long)]
    print: bool,
    /// On a failure, look for a smaller config that breaks the same promise, and print it.
    #[arg(long)]
    shrink: bool,
    /// The most runs --shrink tries (each is a whole run of a candidate config).
    #[arg(long, default_value_t = 40)]
    shrink_runs: u64,
    /// A stand-in for a bug in the root's engine, to see a checker catch it.
    #[arg(long, value_enum)]
    mutate: Option<Mutation>,
    /// Also write every seed's outcome as one JSON line to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Run this config file (one `--print` wrote, or `--shrink` found) under the checkers
    /// instead of drawing one; --seed seeds the faults only the swarm injects.
    #[arg(long, conflicts_with = "seeds")]
    config: Option<PathBuf>,
}

/// Runs the seeds; a broken promise makes the command fail (exit 1) after the summary.
pub(crate) fn swarm(args: SwarmArgs) -> anyhow::Result<()> {
    let mut json = match &args.json {
        Some(path) => Some(std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("--json {}", path.display()))?,
        )),
        None => None,
    };
    let mut outcomes = Vec::new();
    let given = match &args.config {
        Some(path) => Some(std::fs::read_to_string(path).with_context(|| format!("--config {}", path.display()))?),
        None => None,
    };
    for seed in args.seed..args.seed.saturating_add(args.seeds) {
        let drawn = match &given {
            Some(toml) => swarm::Drawn { toml: toml.clone(), faults: Default::default() },
            None => swarm::draw(seed),
        };
        if args.print {
            println!("{}", drawn.toml);
        }
        let outcome = swarm::run_drawn(seed, &drawn, args.mutate);
        if let Some(out) = json.as_mut() {
            use std::io::Write as _;
            writeln!(out, "{}", serde_json::to_string(&outcome)?)?;
        }
        match &outcome.verdict {
            Verdict::Held { rounds } if args.seeds == 1 => {
                println!(
                    "seed {seed}: every promise held ({rounds} rounds, {} steps, {} checks, trace {:016x})",
                    outcome.steps, outcome.checks, outcome.trace
                )
            }
            Verdict::Refused(why) if args.seeds == 1 => println!("seed {seed}: refused before the run: {why}"),
            Verdict::Broken(v) => {
                println!("{}", outcome.failure_of(args.config.as_deref()).unwrap_or_default());
                if args.shrink {
                    let (small, runs) = swarm::shrink(seed, &drawn, args.mutate, v.invariant, args.shrink_runs);
                    println!(
                        "  shrunk in {runs} runs to a config that still breaks {}:\n{}",
                        v.invariant.name(),
                        small.toml
                    );
                }
            }
            _ => {}
        }
        outcomes.push(outcome);
    }
    if args.seeds > 1 {
        print!("{}", summary(&outcomes));
    }
    let broken = outcomes.iter().filter(|o| matches!(o.verdict, Verdict::Broken(_))).count();
    anyhow::ensure!(broken == 0, "{broken} of {} seeds broke a promise", outcomes.len());
    Ok(())
}

/// The long run's table: seeds, steps, faults by kind, checks, failures by invariant.
fn summary(outcomes: &[Outcome]) -> String {
    let count = |f: &dyn Fn(&Outcome) -> u64| outcomes.iter().map(f).sum::<u64>();
    let refused = outcomes.iter().filter(|o| matches!(o.verdict, Verdict::Refused(_))).count();
    let mut broken: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for o in outcomes {
        if let Verdict::Broken(v) = &o.verdict {
            broken.entry(v.invariant.name()).or_default().push(o.seed);
        }
    }
    let mut s = format!(
        "| seeds run | refused by the table | steps | checks | device crashes | relay restarts | relay outages | failovers | hostile devices | messages duplicated |\n|---|---|---|---|---|---|---|---|---|---|\n| {} | {refused} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
        outcomes.len(),
        count(&|o| o.steps),
        count(&|o| o.checks),
        count(&|o| o.crashes),
        count(&|o| o.relay_restarts),
        count(&|o| o.faults.relay_outages),
        count(&|o| o.faults.failovers),
        count(&|o| o.faults.hostile_devices),
        count(&|o| o.duplicated),
    );
    s.push_str("\n| invariant | broken in seeds |\n|---|---|\n");
    for invariant in swarm::INVARIANTS {
        let seeds = broken.get(invariant.name()).map(|s| s.len()).unwrap_or(0);
        let first: Vec<String> =
            broken.get(invariant.name()).into_iter().flatten().take(8).map(u64::to_string).collect();
        s.push_str(&format!(
            "| {} | {seeds}{} |\n",
            invariant.name(),
            if first.is_empty() { String::new() } else { format!(" (first: {})", first.join(", ")) }
        ));
    }
    s
}
