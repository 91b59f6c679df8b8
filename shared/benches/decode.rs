//! Time to decode — or refuse — an update frame, against the frame's size: decoding must stay
//! linear in the bytes a peer sends (the duplicate-name check was quadratic: 80,000 tiny blocks
//! took 11.9 s to refuse). Plain std timing, best of 5.
//!
//! `cargo bench -p anchorage-shared --bench decode`

use std::time::{Duration, Instant};

use anchorage_shared::frame::{decode_frame, encode_frame};
use anchorage_shared::protocol::{MAX_BLOCKS, Message, Update};
use anchorage_shared::tensor::{Encoding, ParamBlock};

fn frame_of(blocks: usize, values_per_block: usize) -> Vec<u8> {
    let blocks = (0..blocks)
        .map(|i| {
            ParamBlock::encode(
                format!("block.{i}"),
                &[values_per_block as u32],
                &vec![0.5; values_per_block],
                Encoding::F32,
            )
        })
        .collect();
    let update = Update {
        prototypes_are: Default::default(),
        round: 1,
        num_samples: 1,
        blocks,
        prototypes: vec![],
        metrics: vec![],
        compute_seconds: 0.0,
    };
    encode_frame(&Message::Update(update), usize::MAX).unwrap()
}

fn best_of(frame: &[u8]) -> (Duration, bool) {
    let mut best = Duration::MAX;
    let mut ok = false;
    for _ in 0..5 {
        let t = Instant::now();
        ok = decode_frame(frame, usize::MAX).is_ok();
        best = best.min(t.elapsed());
    }
    (best, ok)
}

fn main() {
    println!("| blocks | values/block | frame KiB | decoded | time | ns per byte |");
    println!("|---:|---:|---:|---|---:|---:|");
    let cases = [
        (1_000, 1),
        (MAX_BLOCKS, 1),
        (10_000, 1),
        (20_000, 1),
        (40_000, 1),
        (80_000, 1),
        (160_000, 1),
        (64, 16_384),
        (64, 65_536),
        (64, 262_144),
    ];
    for (blocks, values) in cases {
        let frame = frame_of(blocks, values);
        let (time, ok) = best_of(&frame);
        println!(
            "| {blocks} | {values} | {} | {} | {:.2} ms | {:.2} |",
            frame.len() / 1024,
            if ok { "yes" } else { "refused" },
            time.as_secs_f64() * 1e3,
            time.as_nanos() as f64 / frame.len() as f64
        );
    }
}
