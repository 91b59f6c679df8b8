//! The exposition in Prometheus' text format (version 0.0.4), and a lint of it.
//!
//! `prometheus-client` writes OpenMetrics, where a counter's family is named without `_total`
//! (`# TYPE anchorage_connections counter`, sample `anchorage_connections_total`) and units have
//! their own `# UNIT` line. Prometheus' own scrapes ask for OpenMetrics and get it; everything
//! else (`curl`, `promtool check metrics`, most other tools) reads the text format, where the
//! family of a counter is its sample's name. [`to_text_format`] turns one into the other, and
//! [`lint`] checks what `promtool check metrics` checks of our names: every family has `# HELP`
//! and `# TYPE`, counters end in `_total` and nothing else does, and names carry base units.

use std::collections::{BTreeMap, BTreeSet};

/// `Content-Type` of the text format.
pub const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The OpenMetrics exposition `openmetrics` in Prometheus' text format: counter families named
/// with `_total`, `info` families as gauges named with `_info`, no `# UNIT` and no `# EOF`.
pub fn to_text_format(openmetrics: &str) -> String {
    // The families whose name changes, and their new name.
    let mut renamed: BTreeMap<&str, String> = BTreeMap::new();
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.splitn(2, ' ');
            let (name, kind) = (parts.next().unwrap_or(""), parts.next().unwrap_or("").trim());
            match kind {
                "counter" if !name.ends_with("_total") => {
                    renamed.insert(name, format!("{name}_total"));
                }
                "info" if !name.ends_with("_info") => {
                    renamed.insert(name, format!("{name}_info"));
                }
                _ => {}
            }
        }
    }
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            let name = renamed.get(name).map_or(name, String::as_str);
            // OpenMetrics escapes `"` in help texts; the text format does not. prometheus-client
            // ends every help text with a period, after the one most texts here end with.
            let help = help.replace("\\\"", "\"");
            let help = help.strip_suffix('.').filter(|h| h.ends_with('.')).unwrap_or(&help);
            out.push_str(&format!("# HELP {name} {help}\n"));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let kind = match kind.trim() {
                kind @ ("counter" | "gauge" | "histogram" | "summary") => kind,
                "info" => "gauge",
                _ => "untyped",
            };
            let name = renamed.get(name).map_or(name, String::as_str);
            out.push_str(&format!("# TYPE {name} {kind}\n"));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Abbreviated or non-base units `promtool check metrics` objects to, as name parts.
const NOT_BASE_UNITS: [&str; 14] = [
    "ms",
    "milliseconds",
    "us",
    "microseconds",
    "ns",
    "nanoseconds",
    "minutes",
    "hours",
    "days",
    "kb",
    "kilobytes",
    "mb",
    "megabytes",
    "percent",
];

/// What is wrong with an exposition in the text format, one line per problem: a sample without
/// `# HELP` and `# TYPE` for its family, a family declared twice, a counter whose name does not
/// end in `_total` (or a non-counter whose name does), names that are not snake_case, units that
/// are not base units. Empty: nothing wrong.
pub fn lint(text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mut help: BTreeSet<String> = BTreeSet::new();
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    let mut sampled: BTreeSet<String> = BTreeSet::new();
    for (i, line) in text.lines().enumerate() {
        let at = i + 1;
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            if text.trim().is_empty() {
                problems.push(format!("line {at}: {name} has an empty help text"));
            }
            if !help.insert(name.to_string()) {
                problems.push(format!("line {at}: a second # HELP for {name}"));
            }
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            if types.insert(name.to_string(), kind.trim().to_string()).is_some() {
                problems.push(format!("line {at}: a second # TYPE for {name}"));
            }
            if !help.contains(name) {
                problems.push(format!("line {at}: {name} has no # HELP before its # TYPE"));
            }
        } else if line.starts_with('#') || line.trim().is_empty() {
            continue;
        } else {
            let name = line.split(['{', ' ']).next().unwrap_or("");
            let family = family_of(name, &types);
            match family {
                None => problems.push(format!("line {at}: {name} has no # TYPE (and no # HELP)")),
                Some(family) => {
                    sampled.insert(family.to_string());
                }
            }
        }
    }
    for (name, kind) in &types {
        if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
            problems.push(format!("{name}: not snake_case"));
        }
        match kind.as_str() {
            "counter" if !name.ends_with("_total") => problems.push(format!("{name}: a counter must end in _total")),
            "counter" => {}
            _ if name.ends_with("_total") => problems.push(format!("{name}: only a counter may end in _total")),
            _ => {}
        }
        for part in name.split('_') {
            if NOT_BASE_UNITS.contains(&part) {
                problems.push(format!("{name}: `{part}` is not a base unit (seconds, bytes, ratio)"));
            }
        }
    }
    problems
}

/// The declared family a sample belongs to: its own name, or for a histogram or summary the name
/// without `_bucket`, `_sum`, `_count`.
fn family_of<'a>(sample: &'a str, types: &BTreeMap<String, String>) -> Option<&'a str> {
    if types.contains_key(sample) {
        return Some(sample);
    }
    ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
        let base = sample.strip_suffix(suffix)?;
        matches!(types.get(base).map(String::as_str), Some("histogram" | "summary")).then_some(base)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPENMETRICS: &str = "# HELP anchorage_connections QUIC connections.\n\
        # TYPE anchorage_connections counter\n\
        anchorage_connections_total 3\n\
        # HELP anchorage_frame_bytes Bytes of \\\"frames\\\".\n\
        # TYPE anchorage_frame_bytes counter\n\
        # UNIT anchorage_frame_bytes bytes\n\
        anchorage_frame_bytes_total{direction=\"up\"} 10\n\
        # HELP anchorage_round_duration_seconds Time.\n\
        # TYPE anchorage_round_duration_seconds histogram\n\
        # UNIT anchorage_round_duration_seconds seconds\n\
        anchorage_round_duration_seconds_sum 0.0\n\
        anchorage_round_duration_seconds_count 0\n\
        anchorage_round_duration_seconds_bucket{le=\"+Inf\"} 0\n\
        # HELP anchorage_ready Ready..\n\
        # TYPE anchorage_ready gauge\n\
        anchorage_ready 1\n\
        # EOF\n";

    #[test]
    fn counters_are_named_by_their_samples_in_the_text_format() {
        let text = to_text_format(OPENMETRICS);
        assert!(text.contains("# HELP anchorage_connections_total QUIC connections.\n"), "{text}");
        assert!(text.contains("# TYPE anchorage_connections_total counter\nanchorage_connections_total 3\n"), "{text}");
        assert!(text.contains("# HELP anchorage_frame_bytes_total Bytes of \"frames\".\n"), "{text}");
        assert!(text.contains("# TYPE anchorage_round_duration_seconds histogram\n"), "{text}");
        assert!(text.contains("# HELP anchorage_ready Ready.\n"), "one period: {text}");
        assert!(!text.contains("# UNIT") && !text.contains("# EOF"), "{text}");
        assert_eq!(lint(&text), Vec::<String>::new());
        // The OpenMetrics original fails the text format's checks, the way promtool says it.
        let problems = lint(OPENMETRICS);
        assert!(
            problems.iter().any(|p| p.contains("anchorage_connections: a counter must end in _total")),
            "{problems:?}"
        );
        assert!(problems.iter().any(|p| p.contains("anchorage_connections_total has no # TYPE")), "{problems:?}");
    }

    #[test]
    fn the_lint_finds_missing_help_bad_suffixes_and_units() {
        let text = "# TYPE a_ms gauge\na_ms 1\n# HELP b_total x\n# TYPE b_total gauge\nb_total 1\nc 2\n";
        let problems = lint(text);
        for expected in [
            "a_ms has no # HELP",
            "a_ms: `ms` is not a base unit",
            "b_total: only a counter may end in _total",
            "c has no # TYPE",
        ] {
            assert!(problems.iter().any(|p| p.contains(expected)), "{expected} in {problems:?}");
        }
    }
}
