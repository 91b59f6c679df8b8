//! Image folders `<root>/<split>/<class>/*.jpg|jpeg|png`, read from a directory or straight from a
//! `.tar` / `.tar.gz` without unpacking.
//!
//! Images are ordered by (label, path inside the split), whatever the order of the directory
//! listing or of the archive, so a tar.gz and its unpacked directory load identically. JPEG and PNG
//! are decoded on all cores into RGB (grayscale is copied to the three channels, alpha dropped),
//! optionally resized (bilinear) to one size.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Component, Path, PathBuf};

use super::decode::{decode, resize_bilinear};
use super::source::GZIP_MAGIC;
use crate::{DataError, ImageSet};

/// How labels are given to class folders.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ClassOrder {
    /// Sorted folder names (label = index in sorted order).
    #[default]
    Sorted,
    /// This list, in this order; a listed class without images, or a folder not listed, is an error.
    List(Vec<String>),
    /// One class a line (first whitespace-separated token) in this file next to the split folders,
    /// e.g. Tiny-ImageNet's `wnids.txt`; same checks as `List`.
    File(String),
}

/// What to read and how.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageFolderOptions {
    /// Split folder: images are `<root>/<split>/<class>/<file>`. `None`: `<root>/<class>/<file>`.
    pub split: Option<String>,
    /// Path of the root inside the directory or archive (e.g. `tiny-imagenet-100`). `None`: any
    /// prefix, as long as all matching images share it.
    pub root: Option<String>,
    pub classes: ClassOrder,
    /// Resize every image to (height, width). `None`: all images must have the first image's size.
    pub resize: Option<(usize, usize)>,
    /// Keep at most this many images per class (the first ones in path order).
    pub max_per_class: Option<usize>,
    /// Decoding threads; 0 = all available cores.
    pub threads: usize,
}

impl ImageFolderOptions {
    /// Images of `split` (`train`, `test`, `val`, …), classes in sorted folder order.
    pub fn split(split: &str) -> Self {
        Self { split: Some(split.to_string()), ..Self::default() }
    }
}

/// The images of a folder tree without their pixels: class names, labels and paths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listing {
    pub class_names: Vec<String>,
    pub labels: Vec<u32>,
    /// Path of each image relative to the split folder (`<class>/<file>`).
    pub names: Vec<String>,
}

struct Found {
    class: String,
    /// `<class>/<file>`, the sort key within a class.
    name: String,
    bytes: Vec<u8>,
}

struct Collected {
    prefix: Vec<String>,
    images: Vec<Found>,
    /// Candidate class-list files: (parent components, contents).
    class_files: Vec<(Vec<String>, String)>,
}

fn is_image(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    !name.starts_with('.') && (lower.ends_with(".jpg") || lower.ends_with(".jpeg") || lower.ends_with(".png"))
}

fn components(p: &Path) -> Option<Vec<String>> {
    let mut out = Vec::new();
    for c in p.components() {
        match c {
            Component::Normal(s) => out.push(s.to_str()?.to_string()),
            Component::CurDir => {}
            _ => return None,
        }
    }
    Some(out)
}

struct Matcher<'a> {
    opts: &'a ImageFolderOptions,
    root: Option<Vec<String>>,
    class_file: Option<&'a str>,
}

enum Match {
    Image { prefix: Vec<String>, class: String, name: String },
    ClassFile { parent: Vec<String> },
    None,
}

impl<'a> Matcher<'a> {
    fn new(opts: &'a ImageFolderOptions) -> Self {
        let root = opts.root.as_ref().map(|r| components(Path::new(r)).unwrap_or_default());
        let class_file = match &opts.classes {
            ClassOrder::File(f) => Some(f.as_str()),
            _ => None,
        };
        Self { opts, root, class_file }
    }

    fn classify(&self, comps: &[String]) -> Match {
        let Some(file) = comps.last() else { return Match::None };
        if Some(file.as_str()) == self.class_file {
            return Match::ClassFile { parent: comps[..comps.len() - 1].to_vec() };
        }
        if !is_image(file) {
            return Match::None;
        }
        let tail = if self.opts.split.is_some() { 3 } else { 2 };
        if comps.len() < tail {
            return Match::None;
        }
        let prefix = &comps[..comps.len() - tail];
        if let Some(split) = &self.opts.split
            && &comps[comps.len() - 3] != split
        {
            return Match::None;
        }
        if let Some(root) = &self.root
            && prefix != root.as_slice()
        {
            return Match::None;
        }
        let class = comps[comps.len() - 2].clone();
        Match::Image { prefix: prefix.to_vec(), name: format!("{class}/{file}"), class }
    }
}

fn tar_err(path: &Path, e: impl std::fmt::Display) -> DataError {
    DataError::Tar { path: path.to_path_buf(), message: e.to_string() }
}

fn collect(path: &Path, opts: &ImageFolderOptions, want_bytes: bool) -> Result<Collected, DataError> {
    let matcher = Matcher::new(opts);
    let mut images = Vec::new();
    let mut class_files = Vec::new();
    let mut prefixes: BTreeSet<Vec<String>> = BTreeSet::new();
    let mut on_match = |m: Match, read: &mut dyn FnMut() -> Result<Vec<u8>, DataError>| -> Result<(), DataError> {
        match m {
            Match::Image { prefix, class, name } => {
                let bytes = if want_bytes { read()? } else { Vec::new() };
                prefixes.insert(prefix);
                images.push((Found { class, name, bytes }, prefixes.len()));
            }
            Match::ClassFile { parent } => {
                let text = String::from_utf8_lossy(&read()?).into_owned();
                class_files.push((parent, text));
            }
            Match::None => {}
        }
        Ok(())
    };
    let meta = std::fs::metadata(path).map_err(|e| DataError::io(path, e))?;
    if meta.is_dir() {
        walk(path, path, 0, &matcher, &mut on_match)?;
    } else {
        let mut file = File::open(path).map_err(|e| DataError::io(path, e))?;
        let mut magic = [0u8; 2];
        let gz = file.read_exact(&mut magic).is_ok() && magic == GZIP_MAGIC;
        let file = File::open(path).map_err(|e| DataError::io(path, e))?;
        let reader: Box<dyn Read> = if gz {
            Box::new(flate2::read::MultiGzDecoder::new(BufReader::with_capacity(1 << 20, file)))
        } else {
            Box::new(BufReader::with_capacity(1 << 20, file))
        };
        let mut archive = tar::Archive::new(reader);
        for entry in archive.entries().map_err(|e| tar_err(path, e))? {
            let mut entry = entry.map_err(|e| tar_err(path, e))?;
            if !entry.header().entry_type().is_file() {
                continue;
            }
            let entry_path = entry.path().map_err(|e| tar_err(path, e))?.into_owned();
            let Some(comps) = components(&entry_path) else { continue };
            let m = matcher.classify(&comps);
            let shown = entry_path.display().to_string();
            on_match(m, &mut || {
                let mut buf = Vec::with_capacity(entry.size() as usize);
                entry.read_to_end(&mut buf).map_err(|e| tar_err(path, format!("entry {shown}: {e}")))?;
                Ok(buf)
            })?;
        }
        // Read past the end-of-archive blocks to the end of the stream, so a truncated or corrupt
        // gzip trailer (CRC, length) is an error too.
        let mut rest = archive.into_inner();
        std::io::copy(&mut rest, &mut std::io::sink())
            .map_err(|e| tar_err(path, format!("after the last entry: {e}")))?;
    }
    let split = opts.split.clone().unwrap_or_default();
    if prefixes.len() > 1 {
        let shown: Vec<String> = prefixes.iter().map(|p| format!("{:?}", p.join("/"))).collect();
        return Err(DataError::Invalid(format!(
            "{}: images under several roots {} (split {split:?}); set ImageFolderOptions::root or split",
            path.display(),
            shown.join(", ")
        )));
    }
    let prefix = prefixes.into_iter().next().unwrap_or_default();
    Ok(Collected { prefix, images: images.into_iter().map(|(f, _)| f).collect(), class_files })
}

type OnMatch<'a> = dyn FnMut(Match, &mut dyn FnMut() -> Result<Vec<u8>, DataError>) -> Result<(), DataError> + 'a;

fn walk(base: &Path, dir: &Path, depth: usize, matcher: &Matcher, on_match: &mut OnMatch) -> Result<(), DataError> {
    if depth > 16 {
        return Ok(());
    }
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| DataError::io(dir, e))?
        .map(|e| e.map(|e| e.path()).map_err(|e| DataError::io(dir, e)))
        .collect::<Result<_, _>>()?;
    entries.sort();
    for p in entries {
        let meta = std::fs::metadata(&p).map_err(|e| DataError::io(&p, e))?;
        if meta.is_dir() {
            walk(base, &p, depth + 1, matcher, on_match)?;
        } else if meta.is_file() {
            let Some(comps) = p.strip_prefix(base).ok().and_then(components) else { continue };
            let m = matcher.classify(&comps);
            on_match(m, &mut || std::fs::read(&p).map_err(|e| DataError::io(&p, e)))?;
        }
    }
    Ok(())
}

/// Class names in label order, and the images with their labels sorted by (label, name).
type Resolved = (Vec<String>, Vec<(u32, Found)>);

/// Resolves class order and sorts.
fn resolve(path: &Path, opts: &ImageFolderOptions, c: Collected) -> Result<Resolved, DataError> {
    let split = opts.split.clone().unwrap_or_default();
    let found: BTreeSet<String> = c.images.iter().map(|f| f.class.clone()).collect();
    if c.images.is_empty() {
        return Err(DataError::NoImages { path: path.to_path_buf(), split });
    }
    let names: Vec<String> = match &opts.classes {
        ClassOrder::Sorted => found.iter().cloned().collect(),
        ClassOrder::List(list) => list.clone(),
        ClassOrder::File(file) => {
            let text =
                c.class_files.iter().find(|(parent, _)| *parent == c.prefix).map(|(_, t)| t.clone()).ok_or_else(
                    || DataError::NotFound {
                        dir: c.prefix.iter().fold(path.to_path_buf(), |p, c| p.join(c)),
                        what: "class list".into(),
                        candidates: vec![file.clone()],
                    },
                )?;
            text.lines().filter_map(|l| l.split_whitespace().next()).map(str::to_string).collect()
        }
    };
    let index: BTreeMap<&str, u32> = names.iter().enumerate().map(|(i, n)| (n.as_str(), i as u32)).collect();
    for class in &found {
        if !index.contains_key(class.as_str()) {
            return Err(DataError::UnknownClassFolder { path: path.to_path_buf(), class: class.clone() });
        }
    }
    if let Some(missing) = names.iter().find(|n| !found.contains(*n)) {
        return Err(DataError::MissingClassFolder { path: path.to_path_buf(), split, class: missing.clone() });
    }
    let mut labelled: Vec<(u32, Found)> = c.images.into_iter().map(|f| (index[f.class.as_str()], f)).collect();
    labelled.sort_by(|a, b| (a.0, &a.1.name).cmp(&(b.0, &b.1.name)));
    if let Some(k) = opts.max_per_class {
        let mut seen = vec![0usize; names.len()];
        labelled.retain(|(l, _)| {
            seen[*l as usize] += 1;
            seen[*l as usize] <= k
        });
    }
    Ok((names, labelled))
}

/// Lists the images (class names, labels, names) without decoding them.
pub fn list(path: &Path, opts: &ImageFolderOptions) -> Result<Listing, DataError> {
    let collected = collect(path, opts, false)?;
    let (class_names, labelled) = resolve(path, opts, collected)?;
    Ok(Listing {
        class_names,
        labels: labelled.iter().map(|(l, _)| *l).collect(),
        names: labelled.into_iter().map(|(_, f)| f.name).collect(),
    })
}

/// Loads and decodes the images of a directory or a `.tar` / `.tar.gz` to RGB, CHW.
pub fn load(path: &Path, opts: &ImageFolderOptions) -> Result<ImageSet, DataError> {
    let collected = collect(path, opts, true)?;
    let (class_names, labelled) = resolve(path, opts, collected)?;
    let entry_name = |f: &Found| {
        let mut parts = Vec::new();
        parts.extend(opts.split.iter().cloned());
        parts.push(f.name.clone());
        parts.join("/")
    };
    let decode_err =
        |f: &Found, message: String| DataError::Decode { path: path.to_path_buf(), entry: entry_name(f), message };
    let (h, w) = match opts.resize {
        Some(hw) => hw,
        None => {
            let first = &labelled[0].1;
            let d = decode(&first.bytes).map_err(|m| decode_err(first, m))?;
            (d.height, d.width)
        }
    };
    if h == 0 || w == 0 {
        return Err(DataError::Invalid(format!("resize to {h}x{w}: sizes must be positive")));
    }
    let per = 3 * h * w;
    let n = labelled.len();
    let mut pixels = vec![0u8; n * per];
    let threads = if opts.threads == 0 {
        std::thread::available_parallelism().map(|t| t.get()).unwrap_or(1)
    } else {
        opts.threads
    }
    .clamp(1, n.max(1));
    let chunk = n.div_ceil(threads);
    let decode_one = |f: &Found, out: &mut [u8]| -> Result<(), DataError> {
        let d = decode(&f.bytes).map_err(|m| decode_err(f, m))?;
        let (dh, dw) = (d.height, d.width);
        let rgb = d.into_rgb_chw();
        if (dh, dw) == (h, w) {
            out.copy_from_slice(&rgb);
        } else if opts.resize.is_some() {
            out.copy_from_slice(&resize_bilinear(&rgb, 3, dh, dw, h, w));
        } else {
            return Err(DataError::ShapeMismatch {
                path: path.to_path_buf(),
                entry: entry_name(f),
                expected: (h, w),
                found: (dh, dw),
            });
        }
        Ok(())
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = pixels
            .chunks_mut(chunk * per)
            .zip(labelled.chunks(chunk))
            .map(|(out, items)| {
                s.spawn(move || {
                    for (o, (_, f)) in out.chunks_mut(per).zip(items) {
                        decode_one(f, o)?;
                    }
                    Ok::<(), DataError>(())
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join().map_err(|_| DataError::Invalid(format!("{}: a decoding thread panicked", path.display())))?
        })
    })?;
    Ok(ImageSet {
        channels: 3,
        height: h,
        width: w,
        num_classes: class_names.len() as u32,
        pixels,
        labels: labelled.iter().map(|(l, _)| *l).collect(),
        class_names,
    })
}
