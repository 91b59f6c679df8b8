//! `--shrink`: a smaller federation that breaks the same promise. Greedy, as Hypothesis and
//! TigerBeetle's VOPR shrink: try each simpler config in turn (a table, key or array row left
//! out, a count lowered), keep it when the same invariant still breaks, and stop when none does.

use super::{Drawn, Invariant, Verdict, run_drawn};
use crate::virtual_clock::Mutation;

/// Keys a run cannot do without, or whose defaults make a run far longer (more data, local
/// evaluation, the host's compute time): they are lowered, never left out.
const KEPT: &[&str] = &[
    "clock",
    "seed",
    "threads",
    "clients",
    "rounds",
    "method",
    "train_per_class",
    "test_per_class",
    "eval_every",
    "round_deadline_secs",
    "compute_seconds",
];

/// The smallest config found from `drawn` that still breaks `invariant` within `budget` runs,
/// and how many runs the search took.
pub fn shrink(seed: u64, drawn: &Drawn, mutation: Option<Mutation>, invariant: Invariant, budget: u64) -> (Drawn, u64) {
    let mut best = drawn.clone();
    let mut runs = 0;
    loop {
        let Ok(table) = toml::from_str::<toml::Table>(&best.toml) else { return (best, runs) };
        let smaller = simpler(&table).into_iter().find(|candidate| {
            if runs >= budget {
                return false;
            }
            runs += 1;
            let trial = Drawn { toml: toml::to_string(candidate).unwrap_or_default(), faults: best.faults };
            matches!(run_drawn(seed, &trial, mutation).verdict, Verdict::Broken(v) if v.invariant == invariant)
        });
        match smaller {
            Some(table) => best.toml = toml::to_string(&table).unwrap_or_default(),
            None => return (best, runs),
        }
    }
}

/// Every config one step simpler than `table`.
fn simpler(table: &toml::Table) -> Vec<toml::Table> {
    let mut out = Vec::new();
    for (key, value) in table {
        if !KEPT.contains(&key.as_str()) {
            let mut t = table.clone();
            t.remove(key);
            out.push(t);
        }
        match value {
            toml::Value::Integer(n) if *n > 1 && matches!(key.as_str(), "clients" | "rounds" | "min_available") => {
                let mut t = table.clone();
                t.insert(key.clone(), toml::Value::Integer(n - 1));
                out.push(t);
            }
            toml::Value::Array(rows) => {
                for i in 0..rows.len() {
                    let mut rows = rows.clone();
                    rows.remove(i);
                    let mut t = table.clone();
                    t.insert(key.clone(), toml::Value::Array(rows));
                    out.push(t);
                }
            }
            toml::Value::Table(inner) if key != "method" => {
                for smaller in simpler(inner) {
                    let mut t = table.clone();
                    t.insert(key.clone(), toml::Value::Table(smaller));
                    out.push(t);
                }
            }
            _ => {}
        }
    }
    out
}
