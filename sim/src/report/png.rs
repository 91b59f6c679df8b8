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

/// Renders `svg` to a PNG file at `path`.
pub fn write_png(svg: &str, path: &Path) -> anyhow::Result<()> {
    let options = usvg::Options { font_family: "DejaVu Sans".into(), fontdb: fonts(), ..usvg::Options::default() };
    let tree = usvg::Tree::from_str(svg, &options).context("parsing the chart's SVG")?;
    let size = tree.size().to_int_size();
    let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height()).context("allocating the PNG canvas")?;
    resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
    pixmap.save_png(path).with_context(|| format!("writing {}", path.display()))
}
