//! Minimal SVG charts (no plotting dependency): line charts (with task boundaries where asked),
//! stacked and grouped bars, with axes and a legend; heat maps with a colour scale.
//!
//! The plot area is the same in every chart; the right margin grows with the legend's longest
//! name (measured with the font the PNGs are drawn with), so a legend is never clipped.

use std::fmt::Write;

const H: f64 = 400.0;
const LEFT: f64 = 70.0;
/// The plot area's width.
const PLOT_W: f64 = 490.0;
/// The right margin (the legend's) when the names are short, and at most.
const MIN_RIGHT: f64 = 160.0;
const MAX_RIGHT: f64 = 420.0;
/// From the plot's right edge to a legend name's start (its line or swatch before it).
const LEGEND_TEXT: f64 = 32.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 50.0;
/// A chart's labels' font size (px).
const FONT: f64 = 12.0;
/// Category labels under bars, at most (more categories: every k-th is labelled).
const MAX_CATEGORY_LABELS: usize = 12;
/// Markers drawn along one line, at most (a longer series marks every k-th point).
const MAX_MARKERS: usize = 40;
const COLOURS: [&str; 8] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];

/// One named series of (x, y) points.
pub(crate) struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// A labelled vertical line across a line chart at `x`: where a new task starts.
pub(crate) struct Mark {
    pub x: f64,
    pub label: String,
}

/// Marks for task starts `(task, x)`, labelled `task K`.
pub(crate) fn task_marks(starts: impl IntoIterator<Item = (usize, f64)>) -> Vec<Mark> {
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

/// ` stroke-dasharray="…"` for the `i`-th line, or nothing for a solid one.
fn dash_attr(i: usize) -> String {
    match dash(i) {
        "" => String::new(),
        d => format!(r#" stroke-dasharray="{d}""#),
    }
}

/// The `i`-th series' marker at (x, y): a filled dot for the first, then hollow shapes (square,
/// triangle, diamond, ring), so markers of series that coincide all stay visible.
fn marker(svg: &mut String, i: usize, x: f64, y: f64, colour: &str) {
    let hollow = format!(r#"fill="none" stroke="{colour}" stroke-width="1.5""#);
    let _ = match i % 5 {
        0 => write!(svg, r#"<circle class="marker" cx="{x:.1}" cy="{y:.1}" r="3" fill="{colour}"/>"#),
        1 => {
            write!(svg, r#"<rect class="marker" x="{:.1}" y="{:.1}" width="7" height="7" {hollow}/>"#, x - 3.5, y - 3.5)
        }
        2 => write!(
            svg,
            r#"<path class="marker" d="M{x:.1} {:.1}L{:.1} {:.1}L{:.1} {:.1}Z" {hollow}/>"#,
            y - 4.5,
            x + 4.5,
            y + 3.5,
            x - 4.5,
            y + 3.5
        ),
        3 => write!(
            svg,
            r#"<path class="marker" d="M{x:.1} {:.1}L{:.1} {y:.1}L{x:.1} {:.1}L{:.1} {y:.1}Z" {hollow}/>"#,
            y - 5.0,
            x + 5.0,
            y + 5.0,
            x - 5.0
        ),
        _ => write!(svg, r#"<circle class="marker" cx="{x:.1}" cy="{y:.1}" r="5" {hollow}/>"#),
    };
}

/// A chart's geometry: the data ranges and the right margin its legend needs.
struct Frame {
    x: (f64, f64),
    y: (f64, f64),
    right: f64,
}

impl Frame {
    fn new(x: (f64, f64), y: (f64, f64), legend: &Legend) -> Self {
        Self { x, y, right: legend.right }
    }
    /// The chart's width.
    fn w(&self) -> f64 {
        LEFT + PLOT_W + self.right
    }
    /// The plot area's right edge.
    fn plot_right(&self) -> f64 {
        LEFT + PLOT_W
    }
    fn px(&self, x: f64) -> f64 {
        LEFT + (x - self.x.0) / (self.x.1 - self.x.0).max(1e-12) * PLOT_W
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
    let (w, r) = (frame.w(), frame.plot_right());
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{H}" viewBox="0 0 {w} {H}" font-family="sans-serif" font-size="{FONT}"><rect width="100%" height="100%" fill="white"/><text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        (r + LEFT) / 2.0,
        escape(title)
    );
    let y_ticks = ticks(frame.y.0, frame.y.1);
    for (t, text) in y_ticks.iter().zip(labels(&y_ticks)) {
        let y = frame.py(*t);
        let _ = write!(
            svg,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{r:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
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
        x_tick(svg, frame.px(*t), &text);
    }
    let _ = write!(
        svg,
        r#"<line x1="{LEFT}" y1="{b}" x2="{r}" y2="{b}" stroke="black"/><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{b}" stroke="black"/><text x="{cx}" y="{xl}" text-anchor="middle">{}</text><text x="16" y="{cy}" text-anchor="middle" transform="rotate(-90 16 {cy})">{}</text>"#,
        escape(x_label),
        escape(y_label),
        b = H - BOTTOM,
        cx = (r + LEFT) / 2.0,
        xl = H - 10.0,
        cy = (H - BOTTOM + TOP) / 2.0,
    );
}

/// A labelled tick under the x axis at `x`.
fn x_tick(svg: &mut String, x: f64, text: &str) {
    let b = H - BOTTOM;
    let _ = write!(
        svg,
        r#"<line x1="{x:.1}" y1="{b}" x2="{x:.1}" y2="{:.1}" stroke="black"/><text class="x-tick" x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        b + 4.0,
        b + 16.0,
        escape(text)
    );
}

/// Which categories under bars get a label: all of them up to [`MAX_CATEGORY_LABELS`]; beyond,
/// those whose number is a multiple of a round step (rounds 10, 20, 30, …), or every k-th when
/// they are not numbers.
fn labelled_categories(categories: &[String]) -> Vec<usize> {
    let n = categories.len();
    if n <= MAX_CATEGORY_LABELS {
        return (0..n).collect();
    }
    let numbers: Option<Vec<u64>> = categories.iter().map(|c| c.parse().ok()).collect();
    let nice = |span: f64| {
        let raw = (span / MAX_CATEGORY_LABELS as f64).max(1.0);
        let mag = 10f64.powf(raw.log10().floor());
        let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(10.0 * mag);
        step.round().max(1.0) as u64
    };
    match numbers {
        Some(numbers) => {
            let (lo, hi) = (numbers.iter().min().copied().unwrap_or(0), numbers.iter().max().copied().unwrap_or(0));
            let step = nice((hi - lo) as f64 + 1.0);
            let picked: Vec<usize> = (0..n).filter(|&i| numbers[i] % step == 0).collect();
            // Labels never crowd: gaps in the numbers could put many multiples side by side.
            thin(picked, n)
        }
        None => {
            let step = nice(n as f64) as usize;
            (0..n).filter(|i| i % step == 0).collect()
        }
    }
}

/// At most [`MAX_CATEGORY_LABELS`] of `picked` (every k-th), of `n` categories.
fn thin(picked: Vec<usize>, n: usize) -> Vec<usize> {
    if picked.is_empty() {
        return (0..n).step_by(n.div_ceil(MAX_CATEGORY_LABELS).max(1)).collect();
    }
    let k = picked.len().div_ceil(MAX_CATEGORY_LABELS).max(1);
    picked.into_iter().step_by(k).collect()
}

/// A legend's names, fitted to the right margin, and that margin.
struct Legend {
    names: Vec<String>,
    right: f64,
}

impl Legend {
    /// The margin the longest name needs (at least [`MIN_RIGHT`]); a name longer than
    /// [`MAX_RIGHT`] allows keeps its end (where run folder names differ: seed, time) after an
    /// ellipsis.
    fn new(names: &[&str]) -> Self {
        let room = MAX_RIGHT - LEGEND_TEXT - 12.0;
        let names: Vec<String> = names.iter().map(|n| fit_legend(n, room)).collect();
        let widest = names.iter().map(|n| super::png::text_width(n, FONT)).fold(0.0, f64::max);
        Self { right: (LEGEND_TEXT + widest + 12.0).clamp(MIN_RIGHT, MAX_RIGHT), names }
    }
}

/// The legend: a swatch per name (bars), or a stretch of the line with its marker as it is
/// drawn (`lines`).
fn legend(svg: &mut String, frame: &Frame, legend: &Legend, lines: bool) {
    for (i, name) in legend.names.iter().enumerate() {
        let y = TOP + 10.0 + i as f64 * 18.0;
        let colour = COLOURS[i % COLOURS.len()];
        let x = frame.plot_right() + 8.0;
        if lines {
            let _ = write!(
                svg,
                r#"<line x1="{x:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{colour}" stroke-width="2"{}/>"#,
                y - 4.0,
                x + 20.0,
                y - 4.0,
                dash_attr(i)
            );
            marker(svg, i, x + 10.0, y - 4.0, colour);
        } else {
            let _ =
                write!(svg, r#"<rect x="{:.1}" y="{:.1}" width="12" height="12" fill="{colour}"/>"#, x + 4.0, y - 10.0);
        }
        let _ = write!(
            svg,
            r#"<text class="legend" x="{:.1}" y="{y:.1}">{}</text>"#,
            frame.plot_right() + LEGEND_TEXT,
            escape(name)
        );
    }
}

/// A legend name that fits `room` pixels: a longer one keeps its end after an ellipsis.
fn fit_legend(name: &str, room: f64) -> String {
    if super::png::text_width(name, FONT) <= room {
        return name.to_string();
    }
    let chars: Vec<char> = name.chars().collect();
    (1..chars.len())
        .map(|skip| format!("…{}", chars[skip..].iter().collect::<String>()))
        .find(|n| super::png::text_width(n, FONT) <= room)
        .unwrap_or_else(|| "…".into())
}

fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) =
        values.filter(|v| v.is_finite()).fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| (l.min(v), h.max(v)));
    if !lo.is_finite() {
        (0.0, 1.0)
    } else if hi - lo < 1e-12 {
        (lo - 0.5, hi + 0.5)
    } else {
        (lo, hi)
    }
}

/// A line chart; `y_range` fixes the y axis (e.g. 0–100 for accuracy).
pub(crate) fn line_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    y_range: Option<(f64, f64)>,
) -> String {
    line_chart_marked(title, x_label, y_label, series, y_range, &[])
}

/// [`line_chart`] with a thin dashed vertical line at each mark inside the x range, labelled
/// above the plot (labels that would overlap their left neighbour are left out).
///
/// Each series is a line (from two points on: one point is only its marker) with a marker per
/// point, a different shape per series; a long series marks every k-th point, each series
/// starting at another offset, so that series that run together still show one another's marks.
pub(crate) fn line_chart_marked(
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
    let names = Legend::new(&series.iter().map(|s| s.name.as_str()).collect::<Vec<_>>());
    let frame = Frame::new(x, y, &names);
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
        let points: Vec<(f64, f64)> = s
            .points
            .iter()
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .map(|&(a, b)| (frame.px(a), frame.py(b)))
            .collect();
        // A polyline needs two points (a lone point is only its marker).
        if points.len() >= 2 {
            let path: Vec<String> = points.iter().map(|(a, b)| format!("{a:.1},{b:.1}")).collect();
            let _ = write!(
                svg,
                r#"<polyline fill="none" stroke="{colour}" stroke-width="2"{} points="{}"/>"#,
                dash_attr(i),
                path.join(" ")
            );
        }
        // A long series marks every k-th point, k at least the number of series, each series
        // from its own offset: lines that run together show every series' marks.
        let every = if points.len() > MAX_MARKERS { points.len().div_ceil(MAX_MARKERS).max(series.len()) } else { 1 };
        let offset = i % every;
        for (j, (a, b)) in points.iter().enumerate() {
            if (j + offset) % every == 0 || points.len() == 1 {
                marker(&mut svg, i, *a, *b, colour);
            }
        }
    }
    legend(&mut svg, &frame, &names, true);
    svg.push_str("</svg>\n");
    svg
}

/// Stacked bars: one bar per category, one segment per named layer.
pub(crate) fn stacked_bars(
    title: &str,
    x_label: &str,
    y_label: &str,
    categories: &[String],
    layers: &[(&str, Vec<f64>)],
) -> String {
    let totals: Vec<f64> =
        (0..categories.len()).map(|c| layers.iter().map(|(_, v)| v.get(c).copied().unwrap_or(0.0)).sum()).collect();
    let hi = totals.iter().cloned().filter(|v| v.is_finite()).fold(0.0, f64::max).max(1e-9) * 1.05;
    let n = categories.len().max(1) as f64;
    let names = Legend::new(&layers.iter().map(|(n, _)| *n).collect::<Vec<_>>());
    let frame = Frame::new((0.0, n), (0.0, hi), &names);
    let mut svg = String::new();
    open(&mut svg, title, &Frame::new((0.5, n + 0.5), (0.0, hi), &names), x_label, y_label, XTicks::None);
    let width = (PLOT_W / n * 0.7).min(60.0);
    for c in 0..categories.len() {
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
    }
    for c in labelled_categories(categories) {
        x_tick(&mut svg, frame.px(c as f64 + 0.5), &categories[c]);
    }
    legend(&mut svg, &frame, &names, false);
    svg.push_str("</svg>\n");
    svg
}

/// Grouped ("dodged") bars: per category, one bar per named series side by side, so series of
/// equal values stay told apart.
pub(crate) fn grouped_bars(
    title: &str,
    x_label: &str,
    y_label: &str,
    categories: &[String],
    series: &[(&str, Vec<f64>)],
) -> String {
    let hi = series.iter().flat_map(|(_, v)| v.iter().copied()).filter(|v| v.is_finite()).fold(0.0, f64::max).max(1e-9)
        * 1.05;
    let n = categories.len().max(1) as f64;
    let names = Legend::new(&series.iter().map(|(n, _)| *n).collect::<Vec<_>>());
    let frame = Frame::new((0.0, n), (0.0, hi), &names);
    let mut svg = String::new();
    open(&mut svg, title, &frame, x_label, y_label, XTicks::None);
    // A few rounds do not make slabs: bars at most 40 px wide.
    let group = (PLOT_W / n * 0.8).min(40.0 * series.len().max(1) as f64);
    let bar = group / series.len().max(1) as f64;
    for c in 0..categories.len() {
        let left = frame.px(c as f64 + 0.5) - group / 2.0;
        for (s, (_, values)) in series.iter().enumerate() {
            let v = values.get(c).copied().unwrap_or(0.0);
            if !(v.is_finite() && v > 0.0) {
                continue;
            }
            let (y0, y1) = (frame.py(0.0), frame.py(v));
            let _ = write!(
                svg,
                r#"<rect class="bar" x="{:.1}" y="{y1:.1}" width="{:.1}" height="{:.1}" fill="{}"/>"#,
                left + s as f64 * bar,
                (bar - 1.0).max(0.5),
                (y0 - y1).max(0.0),
                COLOURS[s % COLOURS.len()]
            );
        }
    }
    for c in labelled_categories(categories) {
        x_tick(&mut svg, frame.px(c as f64 + 0.5), &categories[c]);
    }
    legend(&mut svg, &frame, &names, false);
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
pub(crate) fn heat_map(title: &str, matrix: &[Vec<Option<f64>>], row_label: &str, col_label: &str) -> String {
    let grid = HeatGrid::new(matrix);
    let (w, h) = grid.size();
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{:.1}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
        w / 2.0,
        escape(title)
    );
    for (t, row) in matrix.iter().enumerate() {
        grid.row(&mut svg, t, row);
    }
    grid.axes(&mut svg, row_label, col_label);
    grid.legend(&mut svg);
    svg.push_str("</svg>\n");
    svg
}

/// Where a heat map's cells go: the grid's top-left corner, its size, a cell's side and the
/// size of the values printed in the cells.
struct HeatGrid {
    cols: usize,
    cell: f64,
    left: f64,
    top: f64,
    w: f64,
    h: f64,
    font: f64,
}

impl HeatGrid {
    /// The grid of `matrix`: square cells of 22 to 64 px, a row's height at least.
    fn new(matrix: &[Vec<Option<f64>>]) -> Self {
        let rows = matrix.len();
        let cols = matrix.iter().map(Vec::len).max().unwrap_or(0);
        let cell = (440.0 / rows.max(cols).max(1) as f64).clamp(22.0, 64.0);
        let (left, top) = (80.0, 50.0);
        let (w, h) = (cols as f64 * cell, (rows as f64 * cell).max(cell));
        let font = (cell * 0.3).clamp(8.0, 13.0);
        HeatGrid { cols, cell, left, top, w, h, font }
    }

    /// The picture's width and height: the grid with 120 px right of it (the legend) and 56 px
    /// under it (the column labels), 360 px wide at least.
    fn size(&self) -> (f64, f64) {
        ((self.left + self.w + 120.0).max(360.0), self.top + self.h + 56.0)
    }

    /// Row `t`: its label, then a cell per column, coloured and with its value where it has one.
    fn row(&self, svg: &mut String, t: usize, row: &[Option<f64>]) {
        let (cell, font) = (self.cell, self.font);
        let y = self.top + t as f64 * cell;
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{t}</text>"#,
            self.left - 6.0,
            y + cell / 2.0 + 4.0
        );
        for k in 0..self.cols {
            let x = self.left + k as f64 * cell;
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

    /// The column labels under the grid, and the two axis titles.
    fn axes(&self, svg: &mut String, row_label: &str, col_label: &str) {
        let (left, top, grid_w, grid_h) = (self.left, self.top, self.w, self.h);
        for k in 0..self.cols {
            let _ = write!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{k}</text>"#,
                left + (k as f64 + 0.5) * self.cell,
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
    }

    /// The legend right of the grid: a vertical bar of the colour scale, 100% at the top, ticked
    /// every 25%.
    fn legend(&self, svg: &mut String) {
        let top = self.top;
        let (lx, lh) = (self.left + self.w + 30.0, self.h.clamp(100.0, 240.0));
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
    }
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
        // At two decimals these would read "0.01 0.01 0.01 0.02" and "0.00 0.00 0.00".
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
        let frame = Frame { x: (0.0, 9.0), y: (0.0, 100.0), right: MIN_RIGHT };
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
        let room = 150.0;
        assert_eq!(fit_legend("global", room), "global");
        let fitted = fit_legend("a-long-prefix-sim-4-1700000000-run-b", room);
        assert!(fitted.starts_with('…') && fitted.ends_with("1700000000-run-b"), "{fitted}");
        assert!(super::super::png::text_width(&fitted, FONT) <= room);
    }

    /// A legend is never clipped: run folder names are drawn whole, the chart made wider for
    /// them, and the longest name ends inside the picture.
    #[test]
    fn a_legend_is_never_clipped() {
        let names = ["r4", "sim-7-20261125T101229-long-name-b", "r1"];
        let series: Vec<Series> =
            names.iter().map(|n| Series { name: n.to_string(), points: vec![(0.0, 10.0), (1.0, 50.0)] }).collect();
        let s = line_chart("Global accuracy by round", "round", "accuracy (%)", &series, Some((0.0, 100.0)));
        assert!(s.contains(">sim-7-20261125T101229-long-name-b<"), "the whole name: {s}");
        let width: f64 = s.split("width=\"").nth(1).unwrap().split('"').next().unwrap().parse().unwrap();
        let start = LEFT + PLOT_W + LEGEND_TEXT;
        let text = super::super::png::text_width("sim-7-20261125T101229-long-name-b", FONT);
        assert!(start + text < width, "legend ends at {} of {width}", start + text);
        // Short names keep the usual width.
        let short = line_chart("t", "x", "y", &series[..1], None);
        assert!(short.contains(&format!("width=\"{}\"", LEFT + PLOT_W + MIN_RIGHT)), "{short}");
    }

    /// A one-round run's charts draw markers, never polylines of one point (usvg warns of those).
    #[test]
    fn a_single_point_is_a_marker_not_a_polyline() {
        let one = vec![Series { name: "up".into(), points: vec![(1.0, 2.0)] }];
        let s = line_chart("t", "round", "MiB", &one, None);
        assert!(!s.contains("<polyline"), "{s}");
        assert_eq!(s.matches(r#"class="marker""#).count(), 2, "the point and the legend's: {s}");
        assert!(!line_chart("t", "x", "y", &[Series { name: "e".into(), points: vec![] }], None).contains("<polyline"));
    }

    /// Series that coincide are told apart: each has its own marker shape, and long series
    /// stagger their markers.
    #[test]
    fn coinciding_series_stay_visible() {
        let same =
            |name: &str, n: u64| Series { name: name.into(), points: (1..=n).map(|r| (r as f64, 1.0)).collect() };
        let s = line_chart("t", "round", "MiB", &[same("a", 4), same("b", 4), same("c", 4)], None);
        assert!(s.contains("<circle class=\"marker\"") && s.contains("<rect class=\"marker\""), "{s}");
        assert!(s.contains("<path class=\"marker\""), "{s}");
        let long = line_chart("t", "round", "MiB", &[same("a", 100), same("b", 100)], None);
        let at = |tag: &str, attr: &str| -> Vec<f64> {
            long.match_indices(tag)
                .map(|(i, _)| {
                    let rest = &long[i..];
                    let v = rest.split(&format!(" {attr}=\"")).nth(1).unwrap();
                    v.split('"').next().unwrap().parse().unwrap()
                })
                .collect()
        };
        let first = at("<circle class=\"marker\"", "cx");
        let second: Vec<f64> = at("<rect class=\"marker\"", "x").iter().map(|x| x + 3.5).collect();
        // Each at most MAX_MARKERS along the line (and one in the legend), at other rounds.
        assert!((20..=MAX_MARKERS + 1).contains(&first.len()) && (20..=MAX_MARKERS + 1).contains(&second.len()));
        let shared = first.iter().filter(|x| second.iter().any(|y| (*x - y).abs() < 0.5)).count();
        assert!(shared <= 1, "staggered: {first:?} {second:?}");
    }

    /// A 100-round server report: bars over many rounds still label the x axis, with
    /// round numbers at a round step.
    #[test]
    fn bars_over_many_rounds_have_x_labels() {
        let rounds: Vec<String> = (1..=100).map(|r| r.to_string()).collect();
        let labelled: Vec<&str> = labelled_categories(&rounds).into_iter().map(|i| rounds[i].as_str()).collect();
        assert_eq!(labelled, ["10", "20", "30", "40", "50", "60", "70", "80", "90", "100"]);
        let s = stacked_bars("t", "round", "s", &rounds, &[("a", vec![1.0; 100])]);
        assert_eq!(s.matches(r#"class="x-tick""#).count(), 10, "{s}");
        let few: Vec<String> = (1..=5).map(|r| r.to_string()).collect();
        assert_eq!(labelled_categories(&few), [0, 1, 2, 3, 4]);
        // Rounds that do not start at 1 (a server keeps numbering), and names.
        let late: Vec<String> = (995..=1040).map(|r| r.to_string()).collect();
        let l: Vec<&str> = labelled_categories(&late).into_iter().map(|i| late[i].as_str()).collect();
        assert!(l.len() >= 4 && l.len() <= MAX_CATEGORY_LABELS && l.contains(&"1000"), "{l:?}");
        let names: Vec<String> = (0..40).map(|i| format!("c{i}")).collect();
        assert!(labelled_categories(&names).len() <= MAX_CATEGORY_LABELS);
    }

    #[test]
    fn grouped_bars_put_equal_values_side_by_side() {
        let rounds: Vec<String> = (1..=3).map(|r| r.to_string()).collect();
        let s = grouped_bars("t", "round", "MiB", &rounds, &[("a", vec![1.0; 3]), ("b", vec![1.0; 3])]);
        let xs: Vec<f64> = s
            .match_indices(r#"<rect class="bar" x=""#)
            .map(|(i, m)| s[i + m.len()..].split('"').next().unwrap().parse().unwrap())
            .collect();
        assert_eq!(xs.len(), 6);
        assert!(xs[1] > xs[0] && xs[1] < xs[2], "side by side, per round: {xs:?}");
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
