//! Minimal SVG charts (no plotting dependency): line charts (with task boundaries where asked),
//! stacked bars, with axes and a legend; heat maps with a colour scale.

use std::fmt::Write;

const W: f64 = 720.0;
const H: f64 = 400.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 160.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 50.0;
const COLOURS: [&str; 8] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];

/// One named series of (x, y) points.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// A labelled vertical line across a line chart at `x`: where a new task starts.
pub struct Mark {
    pub x: f64,
    pub label: String,
}

/// Marks for task starts `(task, x)`, labelled `task K`.
pub fn task_marks(starts: impl IntoIterator<Item = (usize, f64)>) -> Vec<Mark> {
    starts.into_iter().map(|(task, x)| Mark { x, label: format!("task {task}") }).collect()
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Rounded tick positions covering [lo, hi].
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = (hi - lo).max(1e-12);
    let raw = span / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|s| span / s <= 6.0).unwrap_or(10.0 * mag);
    let first = (lo / step).ceil() * step;
    (0..=12).map(|i| first + i as f64 * step).take_while(|t| *t <= hi + step * 1e-9).collect()
}

/// Tick labels that tell neighbouring ticks apart: as many decimals as the step between them
/// needs (0.010 0.012 0.014, not 0.01 0.01 0.01), in k or M for large values.
fn labels(ticks: &[f64]) -> Vec<String> {
    let step = match ticks {
        [a, b, ..] => (b - a).abs(),
        [a] => a.abs().max(1.0),
        [] => return Vec::new(),
    };
    let top = ticks.iter().fold(0.0f64, |m, t| m.max(t.abs()));
    let (scale, suffix) = if top >= 1e6 {
        (1e6, "M")
    } else if top >= 1e3 {
        (1e3, "k")
    } else {
        (1.0, "")
    };
    // The fewest decimals that write the step exactly (2.5k needs one, 0.002 three).
    let step = step / scale;
    let decimals = (0..9).find(|&d| ((step * 10f64.powi(d)).round() - step * 10f64.powi(d)).abs() < 1e-6).unwrap_or(9);
    let decimals = decimals as usize;
    ticks
        .iter()
        .map(|t| {
            let text = format!("{:.*}{suffix}", decimals, t / scale);
            // A tick at zero computed as -1e-17 would print "-0.00".
            if text.starts_with('-') && text[1..].chars().all(|c| matches!(c, '0' | '.' | 'k' | 'M')) {
                text[1..].to_string()
            } else {
                text
            }
        })
        .collect()
}

/// How the `i`-th line of a chart is dashed: the first solid, the rest dashed differently, so a
/// line drawn over another (a maximum equal to the mean) leaves the one beneath visible.
fn dash(i: usize) -> &'static str {
    ["", "7 4", "2 3", "9 3 2 3", "4 4"][i % 5]
}

struct Frame {
    x: (f64, f64),
    y: (f64, f64),
}

impl Frame {
    fn px(&self, x: f64) -> f64 {
        LEFT + (x - self.x.0) / (self.x.1 - self.x.0).max(1e-12) * (W - LEFT - RIGHT)
    }
    fn py(&self, y: f64) -> f64 {
        H - BOTTOM - (y - self.y.0) / (self.y.1 - self.y.0).max(1e-12) * (H - TOP - BOTTOM)
    }
}

/// How the x axis is marked: not at all (bars label their categories), at any round value, or
/// at whole numbers only (rounds).
#[derive(Clone, Copy, PartialEq)]
enum XTicks {
    None,
    Any,
    Whole,
}

fn open(svg: &mut String, title: &str, frame: &Frame, x_label: &str, y_label: &str, x_ticks: XTicks) {
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        (W - RIGHT + LEFT) / 2.0,
        escape(title)
    );
    let y_ticks = ticks(frame.y.0, frame.y.1);
    for (t, text) in y_ticks.iter().zip(labels(&y_ticks)) {
        let y = frame.py(*t);
        let _ = write!(
            svg,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            W - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            text
        );
    }
    let x_ticks: Vec<f64> = match x_ticks {
        XTicks::None => Vec::new(),
        XTicks::Any => ticks(frame.x.0, frame.x.1),
        XTicks::Whole => ticks(frame.x.0, frame.x.1).into_iter().filter(|t| t.fract() == 0.0).collect(),
    };
    for (t, text) in x_ticks.iter().zip(labels(&x_ticks)) {
        let x = frame.px(*t);
        let _ = write!(svg, r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{text}</text>"#, H - BOTTOM + 16.0);
    }
    let _ = write!(
        svg,
        r#"<line x1="{LEFT}" y1="{b}" x2="{r}" y2="{b}" stroke="black"/><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{b}" stroke="black"/><text x="{cx}" y="{xl}" text-anchor="middle">{}</text><text x="16" y="{cy}" text-anchor="middle" transform="rotate(-90 16 {cy})">{}</text>"#,
        escape(x_label),
        escape(y_label),
        b = H - BOTTOM,
        r = W - RIGHT,
        cx = (W - RIGHT + LEFT) / 2.0,
        xl = H - 10.0,
        cy = (H - BOTTOM + TOP) / 2.0,
    );
}

/// The legend: a swatch per name (bars), or a stretch of the line as it is drawn (`lines`).
fn legend(svg: &mut String, names: &[&str], lines: bool) {
    for (i, name) in names.iter().enumerate() {
        let y = TOP + 10.0 + i as f64 * 18.0;
        let colour = COLOURS[i % COLOURS.len()];
        let x = W - RIGHT + 8.0;
        let _ = if lines {
            write!(
                svg,
                r#"<line x1="{x:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{colour}" stroke-width="2" stroke-dasharray="{}"/>"#,
                y - 4.0,
                x + 20.0,
                y - 4.0,
                dash(i)
            )
        } else {
            write!(svg, r#"<rect x="{:.1}" y="{:.1}" width="12" height="12" fill="{colour}"/>"#, x + 4.0, y - 10.0)
        };
        let _ = write!(svg, r#"<text x="{:.1}" y="{y:.1}">{}</text>"#, W - RIGHT + 32.0, escape(&fit_legend(name)));
    }
}

/// A legend name that fits the right margin: a long one keeps its end (where run folder names
/// differ: seed, time), after an ellipsis.
fn fit_legend(name: &str) -> String {
    const MAX: usize = 18;
    let n = name.chars().count();
    if n <= MAX { name.to_string() } else { format!("…{}", name.chars().skip(n - (MAX - 1)).collect::<String>()) }
}

fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| (l.min(v), h.max(v)));
    if !lo.is_finite() {
        (0.0, 1.0)
    } else if hi - lo < 1e-12 {
        (lo - 0.5, hi + 0.5)
    } else {
        (lo, hi)
    }
}

/// A line chart; `y_range` fixes the y axis (e.g. 0–100 for accuracy).
pub fn line_chart(title: &str, x_label: &str, y_label: &str, series: &[Series], y_range: Option<(f64, f64)>) -> String {
    line_chart_marked(title, x_label, y_label, series, y_range, &[])
}

/// [`line_chart`] with a thin dashed vertical line at each mark inside the x range, labelled
/// above the plot (labels that would overlap their left neighbour are left out).
pub fn line_chart_marked(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    y_range: Option<(f64, f64)>,
    marks: &[Mark],
) -> String {
    let x = bounds(series.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
    let y = y_range.unwrap_or_else(|| {
        let (lo, hi) = bounds(series.iter().flat_map(|s| s.points.iter().map(|p| p.1)));
        (lo.min(0.0), hi * 1.05)
    });
    let frame = Frame { x, y };
    let mut svg = String::new();
    let whole = series.iter().all(|s| s.points.iter().all(|p| p.0.fract() == 0.0));
    open(&mut svg, title, &frame, x_label, y_label, if whole { XTicks::Whole } else { XTicks::Any });
    // Under the lines: they stay readable where a line runs along a boundary.
    let mut labelled_to = f64::NEG_INFINITY;
    for mark in marks.iter().filter(|m| m.x > x.0 && m.x <= x.1) {
        let px = frame.px(mark.x);
        let _ = write!(
            svg,
            r##"<line class="task-boundary" x1="{px:.1}" y1="{:.1}" x2="{px:.1}" y2="{:.1}" stroke="#666" stroke-width="1" stroke-dasharray="5 4"/>"##,
            TOP - 4.0,
            H - BOTTOM
        );
        // About 6.5 px a character at 11 px.
        let half = mark.label.chars().count() as f64 * 3.3;
        if px - half >= labelled_to + 4.0 {
            let _ = write!(
                svg,
                r##"<text class="task-label" x="{px:.1}" y="{:.1}" text-anchor="middle" font-size="11" fill="#444">{}</text>"##,
                TOP - 8.0,
                escape(&mark.label)
            );
            labelled_to = px + half;
        }
    }
    for (i, s) in series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let path: Vec<String> =
            s.points.iter().map(|(a, b)| format!("{:.1},{:.1}", frame.px(*a), frame.py(*b))).collect();
        let _ = write!(
            svg,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="2" stroke-dasharray="{}" points="{}"/>"#,
            dash(i),
            path.join(" ")
        );
        for (a, b) in &s.points {
            let _ = write!(svg, r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{colour}"/>"#, frame.px(*a), frame.py(*b));
        }
    }
    legend(&mut svg, &series.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), true);
    svg.push_str("</svg>\n");
    svg
}

/// Stacked bars: one bar per category, one segment per named layer.
pub fn stacked_bars(
    title: &str,
    x_label: &str,
    y_label: &str,
    categories: &[String],
    layers: &[(&str, Vec<f64>)],
) -> String {
    let totals: Vec<f64> =
        (0..categories.len()).map(|c| layers.iter().map(|(_, v)| v.get(c).copied().unwrap_or(0.0)).sum()).collect();
    let hi = totals.iter().cloned().fold(0.0, f64::max).max(1e-9) * 1.05;
    let n = categories.len().max(1) as f64;
    let frame = Frame { x: (0.0, n), y: (0.0, hi) };
    let mut svg = String::new();
    open(&mut svg, title, &Frame { x: (0.5, n + 0.5), y: (0.0, hi) }, x_label, y_label, XTicks::None);
    let width = (W - LEFT - RIGHT) / n * 0.7;
    for (c, name) in categories.iter().enumerate() {
        let x = frame.px(c as f64 + 0.5) - width / 2.0;
        let mut base = 0.0;
        for (l, (_, values)) in layers.iter().enumerate() {
            let v = values.get(c).copied().unwrap_or(0.0);
            if !(v.is_finite() && v > 0.0) {
                continue; // an empty segment (a zero height would print as "-0.0", which SVG rejects)
            }
            let (y0, y1) = (frame.py(base), frame.py(base + v));
            let _ = write!(
                svg,
                r#"<rect x="{x:.1}" y="{y1:.1}" width="{width:.1}" height="{:.1}" fill="{}"/>"#,
                (y0 - y1).max(0.0),
                COLOURS[l % COLOURS.len()]
            );
            base += v;
        }
        if categories.len() <= 30 {
            let _ = write!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                x + width / 2.0,
                H - BOTTOM + 16.0,
                escape(name)
            );
        }
    }
    legend(&mut svg, &layers.iter().map(|(n, _)| *n).collect::<Vec<_>>(), false);
    svg.push_str("</svg>\n");
    svg
}

/// Viridis, sampled: the heat map's colour scale from 0 to 1.
const SCALE: [(u8, u8, u8); 5] =
    [(0x44, 0x01, 0x54), (0x3b, 0x52, 0x8b), (0x21, 0x91, 0x8c), (0x5e, 0xc9, 0x62), (0xfd, 0xe7, 0x25)];

/// The scale's colour of `v` in [0, 1] (clamped).
fn scale_colour(v: f64) -> String {
    let x = v.clamp(0.0, 1.0) * (SCALE.len() - 1) as f64;
    let i = (x.floor() as usize).min(SCALE.len() - 2);
    let f = x - i as f64;
    let (a, b) = (SCALE[i], SCALE[i + 1]);
    let mix = |p: u8, q: u8| (p as f64 + (q as f64 - p as f64) * f).round() as u8;
    format!("#{:02x}{:02x}{:02x}", mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

/// A heat map of `matrix` (values in [0, 1], shown in percent; `None`: a grey cell with no value):
/// row `t` labelled `t` under the axis title `row_label`, column `k` under `col_label`, the value
/// printed in each cell, and a colour legend from 0 to 100%.
pub fn heat_map(title: &str, matrix: &[Vec<Option<f64>>], row_label: &str, col_label: &str) -> String {
    let rows = matrix.len();
    let cols = matrix.iter().map(Vec::len).max().unwrap_or(0);
    let cell = (440.0 / rows.max(cols).max(1) as f64).clamp(22.0, 64.0);
    let (left, top, bottom, right) = (80.0, 50.0, 56.0, 120.0);
    let (grid_w, grid_h) = (cols as f64 * cell, (rows as f64 * cell).max(cell));
    let (w, h) = ((left + grid_w + right).max(360.0), top + grid_h + bottom);
    let font = (cell * 0.3).clamp(8.0, 13.0);
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{:.1}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
        w / 2.0,
        escape(title)
    );
    for (t, row) in matrix.iter().enumerate() {
        let y = top + t as f64 * cell;
        let _ =
            write!(svg, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{t}</text>"#, left - 6.0, y + cell / 2.0 + 4.0);
        for k in 0..cols {
            let x = left + k as f64 * cell;
            let value = row.get(k).copied().flatten();
            let fill = value.map(scale_colour).unwrap_or_else(|| "#eeeeee".into());
            let _ = write!(
                svg,
                r#"<rect class="cell" x="{x:.1}" y="{y:.1}" width="{cell:.1}" height="{cell:.1}" fill="{fill}" stroke="white"/>"#
            );
            if let Some(v) = value {
                let text = if cell >= 40.0 { format!("{:.1}", v * 100.0) } else { format!("{:.0}", v * 100.0) };
                let ink = if v < 0.6 { "white" } else { "black" };
                let _ = write!(
                    svg,
                    r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="{font:.0}" fill="{ink}">{text}</text>"#,
                    x + cell / 2.0,
                    y + cell / 2.0 + font * 0.35
                );
            }
        }
    }
    for k in 0..cols {
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{k}</text>"#,
            left + (k as f64 + 0.5) * cell,
            top + grid_h + 16.0
        );
    }
    let cy = top + grid_h / 2.0;
    let _ = write!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text><text x="22" y="{cy:.1}" text-anchor="middle" transform="rotate(-90 22 {cy:.1})">{}</text>"#,
        left + grid_w / 2.0,
        top + grid_h + 40.0,
        escape(col_label),
        escape(row_label)
    );
    // The legend: a vertical bar, 100% at the top.
    let (lx, lh) = (left + grid_w + 30.0, grid_h.clamp(100.0, 240.0));
    svg.push_str(r#"<defs><linearGradient id="scale" x1="0" y1="1" x2="0" y2="0">"#);
    for (i, _) in SCALE.iter().enumerate() {
        let at = i as f64 / (SCALE.len() - 1) as f64;
        let _ = write!(svg, r#"<stop offset="{at}" stop-color="{}"/>"#, scale_colour(at));
    }
    let _ = write!(
        svg,
        r##"</linearGradient></defs><rect x="{lx:.1}" y="{top}" width="16" height="{lh:.1}" fill="url(#scale)" stroke="#999"/>"##
    );
    for pct in [0, 25, 50, 75, 100] {
        let y = top + lh * (1.0 - pct as f64 / 100.0);
        let _ = write!(
            svg,
            r#"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="black"/><text x="{:.1}" y="{:.1}">{pct}%</text>"#,
            lx + 16.0,
            lx + 20.0,
            lx + 24.0,
            y + 4.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 100.0), vec![0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        let t = ticks(0.13, 0.87);
        assert!(t.first().unwrap() >= &0.13 && t.last().unwrap() <= &0.87 && t.len() >= 3, "{t:?}");
    }

    #[test]
    fn tick_labels_tell_neighbours_apart() {
        // The issue's cases: "0.01 0.01 0.01 0.02" and "0.00 0.00 0.00".
        assert_eq!(labels(&ticks(0.010, 0.018)), ["0.010", "0.012", "0.014", "0.016", "0.018"]);
        assert_eq!(labels(&ticks(0.0, 0.004)), ["0.000", "0.001", "0.002", "0.003", "0.004"]);
        let small = labels(&ticks(0.0, 0.004));
        let distinct: std::collections::BTreeSet<&String> = small.iter().collect();
        assert_eq!(distinct.len(), small.len(), "{small:?}");
        assert_eq!(labels(&ticks(0.0, 100.0)), ["0", "20", "40", "60", "80", "100"]);
        assert_eq!(labels(&[0.0, 2500.0, 5000.0]), ["0.0k", "2.5k", "5.0k"]);
        assert_eq!(labels(&[-0.0, 0.5]), ["0.0", "0.5"]);
    }

    #[test]
    fn charts_are_well_formed_svg() {
        let s =
            line_chart("a <b>", "x", "y", &[Series { name: "s".into(), points: vec![(1.0, 2.0), (2.0, 3.0)] }], None);
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("a &lt;b&gt;") && s.contains("<polyline"));
        let b = stacked_bars("t", "x", "y", &["1".into(), "2".into()], &[("a", vec![1.0, 2.0]), ("b", vec![0.5, 0.0])]);
        assert_eq!(b.matches("<rect x=").count(), 3 + 2, "three non-empty segments and two legend swatches");
        assert!(!b.contains("height=\"-"), "no negative or negative-zero heights");
    }

    #[test]
    fn task_boundaries_are_drawn_where_the_task_changes() {
        use crate::report::{AccuracyRow, task_starts};
        // Rounds 1–9, three rounds a task (or one task throughout), as accuracy.csv says it.
        let rows = |tasks: u64| -> Vec<AccuracyRow> {
            (1..=9u64)
                .map(|round| {
                    let task = ((round - 1) / (9 / tasks)) as usize;
                    AccuracyRow { round, task, model: "global".into(), test_task: task, accuracy: 0.5 }
                })
                .collect()
        };
        let series = || vec![Series { name: "global".into(), points: (0..=9).map(|r| (r as f64, 50.0)).collect() }];
        let chart = |tasks: u64| {
            let marks = task_marks(task_starts(&rows(tasks)).into_iter().map(|(k, r)| (k, r as f64 - 1.0)));
            line_chart_marked("accuracy", "round", "%", &series(), Some((0.0, 100.0)), &marks)
        };
        let three = chart(3);
        assert_eq!(three.matches(r#"class="task-boundary""#).count(), 2, "{three}");
        assert!(three.contains(">task 1<") && three.contains(">task 2<") && !three.contains(">task 0<"));
        assert!(three.contains("stroke-dasharray=\"5 4\""), "dashed");
        // Task 1 starts with round 4: the line stands at x = 3, where its first round begins.
        let frame = Frame { x: (0.0, 9.0), y: (0.0, 100.0) };
        assert!(three.contains(&format!(r#"class="task-boundary" x1="{:.1}""#, frame.px(3.0))), "{three}");
        let one = chart(1);
        assert!(!one.contains("task-boundary") && !one.contains(">task "), "{one}");
        assert_eq!(one, line_chart("accuracy", "round", "%", &series(), Some((0.0, 100.0))));
        // Crowded boundaries keep their lines and drop the labels that would overlap.
        let many: Vec<Mark> = task_marks((1..60).map(|k| (k, k as f64 * 0.15)));
        let crowded = line_chart_marked("a", "r", "%", &series(), None, &many);
        assert_eq!(crowded.matches(r#"class="task-boundary""#).count(), 59);
        let labels = crowded.matches(r#"class="task-label""#).count();
        assert!((5..59).contains(&labels), "{labels} labels");
    }

    #[test]
    fn long_legend_names_keep_their_end() {
        assert_eq!(fit_legend("global"), "global");
        assert_eq!(fit_legend("sim-4-1700000000-run-b"), "…-1700000000-run-b");
    }

    #[test]
    fn a_heat_map_has_a_cell_per_entry_with_its_value() {
        let m = vec![
            vec![Some(0.9), None, None],
            vec![Some(0.5), Some(0.875), None],
            vec![Some(0.0), Some(0.25), Some(1.0)],
        ];
        let s = heat_map("tasks & <models>", &m, "after task t", "test task k");
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert_eq!(s.matches(r#"class="cell""#).count(), 9, "one cell per entry, evaluated or not");
        for v in [">90.0<", ">50.0<", ">87.5<", ">0.0<", ">25.0<", ">100.0<"] {
            assert!(s.contains(v), "{v} printed");
        }
        assert_eq!(s.matches(r##"fill="#eeeeee""##).count(), 3, "three entries not evaluated");
        assert!(s.contains("after task t") && s.contains("test task k") && s.contains("tasks &amp; &lt;models&gt;"));
        assert!(s.contains(">100%<") && s.contains(">0%<") && s.contains("linearGradient"), "a colour legend");
        assert_eq!((scale_colour(0.0).as_str(), scale_colour(1.0).as_str()), ("#440154", "#fde725"));
        let big = vec![vec![Some(0.5); 20]; 20];
        let s = heat_map("t", &big, "r", "c");
        assert_eq!(s.matches(r#"class="cell""#).count(), 400);
        assert!(s.contains(">50<"), "small cells print whole percents");
        assert!(heat_map("empty", &[], "r", "c").ends_with("</svg>\n"));
    }
}
