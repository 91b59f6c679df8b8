//! JPEG and PNG decoding to 8-bit RGB CHW, with grayscale → RGB and an optional bilinear resize.

use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;

/// A decoded image, interleaved (HWC) with 1 (gray), 2 (gray+alpha), 3 (RGB) or 4 (RGBA) channels.
pub(crate) struct Decoded {
    pub height: usize,
    pub width: usize,
    pub channels: usize,
    pub data: Vec<u8>,
}

const PNG_MAGIC: [u8; 8] = [0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a];

/// Decodes a JPEG or PNG (told apart by their magic bytes).
pub(crate) fn decode(bytes: &[u8]) -> Result<Decoded, String> {
    if bytes.starts_with(&[0xff, 0xd8]) {
        decode_jpeg(bytes)
    } else if bytes.starts_with(&PNG_MAGIC) {
        decode_png(bytes)
    } else {
        Err(format!(
            "neither JPEG (FF D8) nor PNG (89 50 4E 47) magic; first bytes {:02x?}",
            &bytes[..bytes.len().min(8)]
        ))
    }
}

fn decode_jpeg(bytes: &[u8]) -> Result<Decoded, String> {
    let opts = DecoderOptions::default().jpeg_set_out_colorspace(ColorSpace::RGB);
    let mut dec = zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(bytes), opts);
    dec.decode_headers().map_err(|e| format!("JPEG: {e:?}"))?;
    let info = dec.info().ok_or("JPEG: no header")?;
    let channels = dec.output_colorspace().map(|c| c.num_components()).unwrap_or(3);
    let (height, width) = (info.height as usize, info.width as usize);
    let size = dec.output_buffer_size().ok_or("JPEG: unknown output size")?;
    if height == 0 || width == 0 || size != height * width * channels {
        return Err(format!("JPEG: inconsistent size {width}x{height}x{channels} vs buffer {size}"));
    }
    let mut data = vec![0u8; size];
    dec.decode_into(&mut data).map_err(|e| format!("JPEG: {e:?}"))?;
    Ok(Decoded { height, width, channels, data })
}

fn decode_png(bytes: &[u8]) -> Result<Decoded, String> {
    let mut dec = png::Decoder::new(std::io::Cursor::new(bytes));
    dec.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = dec.read_info().map_err(|e| format!("PNG: {e}"))?;
    let size = reader.output_buffer_size().ok_or("PNG: image too large")?;
    let mut data = vec![0u8; size];
    let info = reader.next_frame(&mut data).map_err(|e| format!("PNG: {e}"))?;
    let channels = match info.color_type {
        png::ColorType::Grayscale => 1,
        png::ColorType::GrayscaleAlpha => 2,
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        png::ColorType::Indexed => return Err("PNG: palette not expanded".into()),
    };
    if info.bit_depth != png::BitDepth::Eight {
        return Err(format!("PNG: bit depth {:?} after expansion, expected 8", info.bit_depth));
    }
    let (height, width) = (info.height as usize, info.width as usize);
    let row = width * channels;
    // Drop any per-row padding (there is none for 8-bit, but be exact).
    let data = if info.line_size == row {
        data.truncate(row * height);
        data
    } else {
        (0..height).flat_map(|y| data[y * info.line_size..y * info.line_size + row].to_vec()).collect()
    };
    Ok(Decoded { height, width, channels, data })
}

impl Decoded {
    /// RGB, CHW: gray is copied to the three channels, alpha is dropped.
    pub(crate) fn into_rgb_chw(self) -> Vec<u8> {
        let n = self.height * self.width;
        let mut out = vec![0u8; 3 * n];
        let c = self.channels;
        for p in 0..n {
            let px = &self.data[p * c..p * c + c];
            let (r, g, b) = if c >= 3 { (px[0], px[1], px[2]) } else { (px[0], px[0], px[0]) };
            out[p] = r;
            out[n + p] = g;
            out[2 * n + p] = b;
        }
        out
    }
}

/// Bilinear resize of CHW u8 planes (half-pixel centres, edge clamp, no antialiasing).
pub fn resize_bilinear(src: &[u8], channels: usize, h: usize, w: usize, nh: usize, nw: usize) -> Vec<u8> {
    if (h, w) == (nh, nw) {
        return src.to_vec();
    }
    let mut out = vec![0u8; channels * nh * nw];
    if h == 0 || w == 0 {
        return out;
    }
    let map = |o: usize, n: usize, on: usize| {
        let s = ((o as f32 + 0.5) * n as f32 / on as f32 - 0.5).clamp(0.0, (n - 1) as f32);
        let i0 = s.floor() as usize;
        (i0, (i0 + 1).min(n - 1), s - i0 as f32)
    };
    let xs: Vec<_> = (0..nw).map(|x| map(x, w, nw)).collect();
    for c in 0..channels {
        let plane = &src[c * h * w..(c + 1) * h * w];
        for y in 0..nh {
            let (y0, y1, fy) = map(y, h, nh);
            for (x, &(x0, x1, fx)) in xs.iter().enumerate() {
                let top = plane[y0 * w + x0] as f32 * (1.0 - fx) + plane[y0 * w + x1] as f32 * fx;
                let bot = plane[y1 * w + x0] as f32 * (1.0 - fx) + plane[y1 * w + x1] as f32 * fx;
                out[c * nh * nw + y * nw + x] = (top * (1.0 - fy) + bot * fy).round().clamp(0.0, 255.0) as u8;
            }
        }
    }
    out
}
