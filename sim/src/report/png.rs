//! PNG copies of the SVG charts, rendered in-process with resvg and an embedded DejaVu Sans, so
//! the pictures come out the same on any machine, fonts installed or not.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use anyhow::Context;
use resvg::{tiny_skia, usvg};

fn fonts() -> Arc<usvg::fontdb::Database> {
    static FONTS: OnceLock<Arc<usvg::fontdb::Database>> = OnceLock::new();
    FONTS
        .get_or_init(|| {
            let mut db = usvg::fontdb::Database::new();
            db.load_font_data(dejavu::sans::regular().to_vec());
            db.set_sans_serif_family("DejaVu Sans");
            Arc::new(db)
        })
        .clone()
}

fn options() -> usvg::Options<'static> {
    usvg::Options { font_family: "DejaVu Sans".into(), fontdb: fonts(), ..usvg::Options::default() }
}

/// The width in pixels of `text` at `size` px as the PNGs draw it (DejaVu Sans, wider than most
/// sans-serif fonts a browser shows the SVG with), for laying out legends that are not clipped.
pub(crate) fn text_width(text: &str, size: f64) -> f64 {
    if text.trim().is_empty() {
        return 0.0;
    }
    let escaped = text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    let svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="8000" height="100"><text x="0" y="50" font-family="sans-serif" font-size="{size}" xml:space="preserve">{escaped}</text></svg>"#
    );
    match usvg::Tree::from_str(&svg, &options()) {
        Ok(tree) if tree.root().has_children() => tree.root().abs_bounding_box().right() as f64,
        // Not measurable (never expected): DejaVu Sans's widest common glyphs, 0.7 em each.
        _ => text.chars().count() as f64 * size * 0.7,
    }
}

/// Renders `svg` to a PNG file at `path`.
pub(crate) fn write_png(svg: &str, path: &Path) -> anyhow::Result<()> {
    let tree = usvg::Tree::from_str(svg, &options()).context("parsing the chart's SVG")?;
    let size = tree.size().to_int_size();
    let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height()).context("allocating the PNG canvas")?;
    resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
    pixmap.save_png(path).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_measured_in_the_pngs_font() {
        let one = text_width("sim-7-20261125T101229", 12.0);
        // DejaVu Sans: about 7 px a character at 12 px.
        assert!((120.0..180.0).contains(&one), "{one}");
        assert!(text_width("iiii", 12.0) < text_width("WWWW", 12.0));
        assert!((text_width("ab", 24.0) - 2.0 * text_width("ab", 12.0)).abs() < 2.0);
        assert_eq!(text_width("", 12.0), 0.0);
        assert!(text_width("a < b & c", 12.0) > 0.0);
    }
}
