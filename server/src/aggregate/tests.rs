//! Each rule against values computed by hand (in the comments), and the screening.

use super::*;
use anchorage_shared::tensor::Encoding;

/// Single-block updates with weight 1 (or `w`).
fn one_block<'a>(vectors: &'a [Vec<f32>], weights: &[f64]) -> Vec<(Vec<&'a [f32]>, f64)> {
    vectors.iter().zip(weights).map(|(v, w)| (vec![v.as_slice()], *w)).collect()
}

fn combine(rule: AggregationRule, vectors: &[Vec<f32>]) -> Vec<f32> {
    let weights = vec![1.0; vectors.len()];
    rule.combine(&one_block(vectors, &weights)).unwrap().remove(0)
}

fn close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    assert!(a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5), "{a:?} vs {b:?}");
}

#[test]
fn mean_is_sample_weighted() {
    // (1·[0, 10] + 3·[4, 2]) / 4 = [12/4, 16/4] = [3, 4]
    let v = vec![vec![0.0, 10.0], vec![4.0, 2.0]];
    let out = AggregationRule::Mean.combine(&one_block(&v, &[1.0, 3.0])).unwrap();
    close(&out[0], &[3.0, 4.0]);
}

#[test]
fn median_of_an_odd_count() {
    // coordinate 0: {1, 2, 7} → 2; coordinate 1: {5, 0, 4} → 4; coordinate 2: {3, 9, 4} → 4
    let v = vec![vec![1.0, 5.0, 3.0], vec![2.0, 0.0, 9.0], vec![7.0, 4.0, 4.0]];
    close(&combine(AggregationRule::Median, &v), &[2.0, 4.0, 4.0]);
}

#[test]
fn median_of_an_even_count_is_the_mean_of_the_middle_two() {
    // coordinate 0: sorted {1, 2, 3, 100} → (2 + 3)/2 = 2.5; coordinate 1: {−2, 0, 4, 10} → (0 + 4)/2 = 2
    let v = vec![vec![1.0, 10.0], vec![3.0, -2.0], vec![100.0, 0.0], vec![2.0, 4.0]];
    close(&combine(AggregationRule::Median, &v), &[2.5, 2.0]);
}

#[test]
fn median_ignores_claimed_sample_counts() {
    // The mean would be (1e9·100 + 1 + 2)/(1e9 + 2) ≈ 100; the median of {1, 2, 100} is 2.
    let v = vec![vec![100.0], vec![1.0], vec![2.0]];
    let out = AggregationRule::Median.combine(&one_block(&v, &[1e9, 1.0, 1.0])).unwrap();
    close(&out[0], &[2.0]);
}

#[test]
fn trimmed_mean_with_trim_0_2_on_five_updates() {
    // k = ⌊0.2·5⌋ = 1 from each end.
    // coordinate 0: sorted {1, 2, 3, 4, 100} → drop 1 and 100 → (2 + 3 + 4)/3 = 3
    // coordinate 1: sorted {−50, 0, 3, 6, 9} → drop −50 and 9 → (0 + 3 + 6)/3 = 3
    let v = vec![vec![1.0, -50.0], vec![2.0, 0.0], vec![3.0, 6.0], vec![4.0, 3.0], vec![100.0, 9.0]];
    close(&combine(AggregationRule::TrimmedMean { trim: 0.2 }, &v), &[3.0, 3.0]);
}

#[test]
fn trimmed_mean_never_trims_everything() {
    // trim 0.45 of 2 updates: ⌊0.9⌋ = 0 → the plain mean (1 + 3)/2 = 2; of 3: ⌊1.35⌋ = 1 → the middle value.
    close(&combine(AggregationRule::TrimmedMean { trim: 0.45 }, &[vec![1.0], vec![3.0]]), &[2.0]);
    close(&combine(AggregationRule::TrimmedMean { trim: 0.45 }, &[vec![1.0], vec![3.0], vec![9.0]]), &[3.0]);
    close(&combine(AggregationRule::TrimmedMean { trim: 0.2 }, &[vec![7.0]]), &[7.0]);
}

#[test]
fn krum_scores_by_hand() {
    // 1-D updates 0, 1, 2, 3, 10 with f = 1: n − f − 2 = 2 nearest neighbours.
    // 0: {1, 4, 9, 100} → 1 + 4 = 5;   1: {1, 1, 4, 81} → 2;   2: {4, 1, 1, 64} → 2
    // 3: {9, 4, 1, 49} → 5;           10: {100, 81, 64, 49} → 49 + 64 = 113
    let v: Vec<Vec<f32>> = [0.0, 1.0, 2.0, 3.0, 10.0].iter().map(|&x| vec![x]).collect();
    let flat: Vec<Vec<&[f32]>> = v.iter().map(|x| vec![x.as_slice()]).collect();
    let refs: Vec<&[&[f32]]> = flat.iter().map(Vec::as_slice).collect();
    assert_eq!(krum_scores(&refs, 1), vec![5.0, 2.0, 2.0, 5.0, 113.0]);
    // Krum: the lowest score, ties to the first → update 1.
    close(&combine(AggregationRule::Krum { byzantine: 1, select: 1 }, &v), &[1.0]);
    // Multi-Krum, select 2: updates 1 and 2 → (1 + 2)/2 = 1.5; select 4: 0..3 → 6/4 = 1.5.
    close(&combine(AggregationRule::Krum { byzantine: 1, select: 2 }, &v), &[1.5]);
    close(&combine(AggregationRule::Krum { byzantine: 1, select: 4 }, &v), &[1.5]);
}

#[test]
fn krum_picks_the_honest_cluster_with_2_of_7_attackers() {
    // Five honest updates near (1, 1), two colluding attackers near (−10, −10): f = 2, n = 7 = 2f + 3.
    // Each honest update's 3 nearest are honest (squared distances ≤ 0.08), each attacker's 3
    // nearest include two honest ones (≥ 2·11² = 242 each), so Krum and multi-Krum pick honest ones.
    let honest = [[1.0, 1.0], [1.1, 0.9], [0.9, 1.1], [1.05, 1.0], [0.95, 0.95]];
    let attackers = [[-10.0, -10.0], [-10.1, -9.9]];
    let v: Vec<Vec<f32>> = attackers.iter().chain(&honest).map(|x| x.to_vec()).collect();
    let flat: Vec<Vec<&[f32]>> = v.iter().map(|x| vec![x.as_slice()]).collect();
    let refs: Vec<&[&[f32]]> = flat.iter().map(Vec::as_slice).collect();
    let chosen = krum_select(&refs, 2, 3);
    assert!(chosen.iter().all(|&i| i >= 2), "only honest updates chosen, got {chosen:?}");
    let out = combine(AggregationRule::Krum { byzantine: 2, select: 3 }, &v);
    assert!(out.iter().all(|x| (x - 1.0).abs() < 0.1), "{out:?}");
    let mean = combine(AggregationRule::Mean, &v);
    assert!(mean[0] < -1.0, "the mean is dragged away: {mean:?}");
}

#[test]
fn krum_works_on_the_concatenation_of_blocks() {
    // Two blocks; update 2 is close to the others in block 0 but far away in block 1.
    // f = 0, 1 neighbour: dist²(0,1) = 0 + 1 = 1; dist²(0,2) = 0 + 100 = 100; dist²(1,2) = 0 + 81 = 81
    // scores: 0 → 1, 1 → 1, 2 → 81 → Krum picks update 0.
    let b0 = [vec![1.0f32], vec![1.0], vec![1.0]];
    let b1 = [vec![0.0f32], vec![1.0], vec![10.0]];
    let updates: Vec<(Vec<&[f32]>, f64)> = (0..3).map(|i| (vec![b0[i].as_slice(), b1[i].as_slice()], 1.0)).collect();
    let out = AggregationRule::Krum { byzantine: 0, select: 1 }.combine(&updates).unwrap();
    assert_eq!(out, vec![vec![1.0], vec![0.0]]);
}

#[test]
fn degenerate_inputs_give_errors_or_documented_fallbacks_never_panics() {
    let rules = [
        AggregationRule::Mean,
        AggregationRule::Median,
        AggregationRule::TrimmedMean { trim: 0.2 },
        AggregationRule::Krum { byzantine: 2, select: 1 },
        AggregationRule::Krum { byzantine: 5, select: 9 },
    ];
    for rule in rules {
        assert_eq!(rule.combine(&[]), Err(AggregateError::Empty), "{rule:?}");
        // One update: every rule returns it.
        close(&combine(rule, &[vec![4.0, -1.0]]), &[4.0, -1.0]);
        // Two updates: Krum (fewer than 2f + 3) falls back to 1 neighbour; select is clamped.
        let two = combine(rule, &[vec![0.0], vec![2.0]]);
        assert!(two[0].is_finite(), "{rule:?}");
        let mismatched = [vec![1.0], vec![1.0, 2.0]];
        assert_eq!(rule.combine(&one_block(&mismatched, &[1.0, 1.0])), Err(AggregateError::Inconsistent), "{rule:?}");
    }
    assert!(matches!(
        AggregationRule::TrimmedMean { trim: 0.5 }.combine(&one_block(&[vec![1.0]], &[1.0])),
        Err(AggregateError::InvalidRule(_))
    ));
    assert!(AggregationRule::TrimmedMean { trim: f64::NAN }.validate().is_err());
    assert!(AggregationRule::Krum { byzantine: 1, select: 0 }.validate().is_err());
}

#[test]
fn rules_read_from_toml() {
    #[derive(Deserialize)]
    struct T {
        robust: RobustConfig,
    }
    let t: T = toml::from_str(
        "[robust]\naggregation = { rule = \"trimmed-mean\", trim = 0.2 }\nmax_norm = 50.0\nmax_norm_z = 3.5\n",
    )
    .unwrap();
    assert_eq!(t.robust.aggregation, AggregationRule::TrimmedMean { trim: 0.2 });
    assert_eq!((t.robust.max_norm, t.robust.max_norm_z), (Some(50.0), Some(3.5)));
    assert_eq!(t.robust.max_samples, DEFAULT_MAX_SAMPLES);
    let t: T = toml::from_str("[robust.aggregation]\nrule = \"krum\"\nbyzantine = 2\nselect = 3\n").unwrap();
    assert_eq!(t.robust.aggregation, AggregationRule::Krum { byzantine: 2, select: 3 });
    let t: T = toml::from_str("[robust]\naggregation = { rule = \"median\" }\n").unwrap();
    assert_eq!(t.robust.aggregation, AggregationRule::Median);
    assert_eq!(toml::from_str::<T>("[robust]\n").unwrap().robust, RobustConfig::default());
    for bad in [
        "[robust]\naggregation = { rule = \"mode\" }\n",
        "[robust]\naggregation = { rule = \"median\", trim = 0.1 }\n",
        "[robust]\naggregation = { rule = \"trimmed-mean\", trim = 0.6 }\n",
        "[robust]\nmax_norm = -1.0\n",
        "[robust]\nmax_samples = 0\n",
        "[robust]\nunknown = 1\n",
    ] {
        assert!(toml::from_str::<T>(bad).is_err(), "{bad}");
    }
}

fn update(values: &[f32], n: u64) -> Update {
    Update {
        prototypes_are: Default::default(),
        round: 1,
        num_samples: n,
        blocks: vec![ParamBlock::encode("w", &[values.len() as u32], values, Encoding::F32)],
        prototypes: vec![],
        metrics: vec![],
        compute_seconds: 0.0,
    }
}

#[test]
fn screening_refuses_non_finite_and_too_large_updates() {
    let global = update(&[1.0, 1.0], 1).blocks;
    let config = RobustConfig { max_norm: Some(10.0), ..RobustConfig::default() };
    // ‖[4, 5] − [1, 1]‖ = ‖[3, 4]‖ = 5
    assert_eq!(config.screen_update(&update(&[4.0, 5.0], 1), &global), Ok(5.0));
    assert!(matches!(config.screen_update(&update(&[f32::NAN, 0.0], 1), &global), Err(ScreenReason::BadTensor(_))));
    assert!(matches!(
        config.screen_update(&update(&[f32::INFINITY, 0.0], 1), &global),
        Err(ScreenReason::BadTensor(_))
    ));
    // ‖[101, 1] − [1, 1]‖ = 100 > 10
    assert!(matches!(config.screen_update(&update(&[101.0, 1.0], 1), &global), Err(ScreenReason::Norm { .. })));
    // Without a norm bound, 1e30 is finite but beyond the default max_abs_value of 1e6.
    assert_eq!(
        RobustConfig::default().screen_update(&update(&[1e30, 0.0], 1), &global),
        Err(ScreenReason::Value { value: 1e30f32 as f64, bound: 1e6 })
    );
    assert!(
        RobustConfig::default().screen_update(&update(&[-1e6, 1e6], 1), &global).is_ok(),
        "the bound itself passes"
    );
    // A looser value bound: f32::MAX twice overflows an f32 norm but not the f64 one.
    let loose = RobustConfig { max_abs_value: f64::MAX, ..RobustConfig::default() };
    assert!(loose.screen_update(&update(&[f32::MAX, f32::MAX], 1), &global).is_ok());
}

#[test]
fn prototypes_are_screened_and_their_counts_capped_like_blocks() {
    use anchorage_shared::prototype::Prototype;
    let global = update(&[0.0], 1).blocks;
    let config = RobustConfig { max_samples: 100, ..RobustConfig::default() };
    let mut u = update(&[0.5], 10);
    u.prototypes = vec![Prototype::encode(3, 1_000_000_000_000_000_000, &[1.0, 2.0], Encoding::F32)];
    assert!(config.screen_update(&u, &global).is_ok());
    assert!(config.cap_samples("a", &mut u), "the prototype's count is beyond max_samples");
    assert_eq!((u.num_samples, u.prototypes[0].count), (10, 100));
    u.prototypes = vec![Prototype::encode(3, 5, &[2e7, 0.0], Encoding::F32)];
    assert_eq!(config.screen_update(&u, &global), Err(ScreenReason::Value { value: 2e7, bound: 1e6 }));
    u.prototypes = vec![Prototype::encode(3, 5, &[f32::NAN, 0.0], Encoding::F32)];
    assert!(matches!(config.screen_update(&u, &global), Err(ScreenReason::BadTensor(_))));
}

#[test]
fn robust_z_scores_by_hand() {
    // norms {1, 1.1, 0.9, 1, 50}: median 1; |x − 1| = {0, 0.1, 0.1, 0, 49} → MAD = 0.1
    // z(50) = 0.6745·49/0.1 = 330.5; z(1.1) = 0.6745; z(0.9) = −0.6745
    let z = robust_z(&[1.0, 1.1, 0.9, 1.0, 50.0]);
    let want = [0.0, 0.6745, -0.6745, 0.0, 330.505];
    assert!(z.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-3), "{z:?}");
    // MAD = 0: {1, 1, 1, 1, 5} → meanAD = 4/5 = 0.8, z(5) = 4/(1.253314·0.8) = 3.989
    let z = robust_z(&[1.0, 1.0, 1.0, 1.0, 5.0]);
    assert!((z[4] - 3.989).abs() < 1e-3 && z[0] == 0.0, "{z:?}");
    assert_eq!(robust_z(&[2.0, 2.0, 2.0]), vec![0.0; 3]);
    assert_eq!(robust_z(&[1.0, 100.0]), vec![0.0; 2], "too few to judge");
}

#[test]
fn screen_round_keeps_every_acked_update_and_bounds_the_outlier() {
    let global = update(&[0.0], 1).blocks;
    let config = RobustConfig { max_norm_z: Some(3.5), max_samples: 100, ..RobustConfig::default() };
    let (a, b, c, d, e) =
        (update(&[1.0], 10), update(&[1.1], 10), update(&[0.9], 1_000_000), update(&[1.0], 10), update(&[50.0], 10));
    let bad = update(&[f32::NAN], 10);
    let inputs = [("a", &a), ("b", &b), ("bad", &bad), ("c", &c), ("d", &d), ("e", &e)];
    let RoundScreen { kept, screened, influence } = config.screen_round(&inputs, &global);
    let kept_ids: Vec<&str> = kept.iter().map(|(c, _)| *c).collect();
    assert_eq!(kept_ids, vec!["a", "b", "c", "d", "e"], "the outlier stays in, bounded");
    assert_eq!(kept[2].1.num_samples, 10, "capped at max_samples, then clipped to the median weight");
    assert!(matches!(kept[0].1, Cow::Borrowed(_)), "untouched updates are not copied");
    let ids: Vec<&str> = screened.iter().map(|s| s.client.as_str()).collect();
    assert_eq!(ids, vec!["bad"]);
    // norms {1, 1.1, 0.9, 1, 50}: lower median 1 → norm_cap bound 2; the z bound is
    // 1 + 3.5 · 0.1/0.6745 = 1.519; e is scaled to it.
    let tau = influence.norm_bound.unwrap();
    assert!((tau - 1.5189).abs() < 1e-3, "{tau}");
    assert_eq!(influence.norm_clipped, vec!["e"]);
    assert!((kept[4].1.blocks[0].decode().unwrap()[0] as f64 - tau).abs() < 1e-5);
    assert_eq!(influence.weight_clipped, vec!["c"]);
}

#[test]
fn one_update_holds_at_most_two_over_n_of_the_weight_whatever_it_claims() {
    let global = update(&[0.0, 0.0], 1).blocks;
    let config = RobustConfig::default();
    for n in [2usize, 3, 4, 5, 10, 100] {
        let honest: Vec<Update> = (0..n - 1).map(|i| update(&[1.0, -1.0], 500 + 37 * i as u64)).collect();
        let attacker = update(&[-1.0, 1.0], u64::MAX);
        let mut inputs: Vec<(&str, &Update)> = honest.iter().map(|u| ("h", u)).collect();
        inputs.push(("x", &attacker));
        let RoundScreen { kept, .. } = config.screen_round(&inputs, &global);
        let total: f64 = kept.iter().map(|(_, u)| u.num_samples as f64).sum();
        let share = kept.last().unwrap().1.num_samples as f64 / total;
        assert!(share <= 2.0 / n as f64 + 1e-9, "n = {n}: share {share}");
    }
    // Unbounded, the same claim takes the round.
    let honest = update(&[1.0, -1.0], 500);
    let attacker = update(&[-1.0, 1.0], 1_000_000_000);
    let RoundScreen { kept, .. } = RobustConfig::unbounded().screen_round(&[("h", &honest), ("x", &attacker)], &global);
    assert_eq!(kept[1].1.num_samples, 1_000_000_000);
}

#[test]
fn prototype_counts_are_clipped_per_class() {
    use anchorage_shared::prototype::Prototype;
    let global = update(&[0.0], 1).blocks;
    let mut updates = Vec::new();
    for (count, v) in [(10, 0.1), (12, 0.2), (1_000_000, 0.3)] {
        let mut u = update(&[v], 10);
        u.prototypes = vec![Prototype::encode(4, count, &[1.0, 2.0], Encoding::F32)];
        updates.push(u);
    }
    let inputs: Vec<(&str, &Update)> = vec![("a", &updates[0]), ("b", &updates[1]), ("c", &updates[2])];
    let RoundScreen { kept, influence, .. } = RobustConfig::default().screen_round(&inputs, &global);
    assert_eq!(kept[2].1.prototypes[0].count, 12, "to the class's lower median");
    assert_eq!(influence.weight_clipped, vec!["c"]);
}

#[test]
fn changes_of_no_size_or_one_direction_are_refused_before_the_ack() {
    let n = 1024;
    let global = update(&vec![0.5; n], 1).blocks;
    let config = RobustConfig::default();
    let honest: Vec<f32> = (0..n).map(|i| 0.5 + if i % 3 == 0 { 0.01 } else { -0.01 }).collect();
    let check = |values: &[f32], previous: Option<f64>| {
        let u = update(values, 100);
        let norm = config.screen_update(&u, &global).unwrap();
        config.screen_change(&u, &global, norm, previous)
    };
    assert_eq!(check(&honest, Some(0.3)), Ok(()));
    assert_eq!(check(&vec![0.5; n], None), Err(ScreenReason::NoChange), "the global sent back");
    let tiny: Vec<f32> = honest.iter().map(|v| 0.5 + (v - 0.5) * 1e-4).collect();
    assert!(matches!(check(&tiny, Some(0.3)), Err(ScreenReason::TooSmall { .. })));
    assert_eq!(check(&tiny, None), Ok(()), "no reference yet: the ratio does not run");
    let shift: Vec<f32> = vec![0.5 + 2e-5; n];
    assert!(matches!(check(&shift, None), Err(ScreenReason::OneWay { .. })));
    // Off switches.
    let off = RobustConfig::unbounded();
    let u = update(&shift, 100);
    assert_eq!(off.screen_change(&u, &global, 1e-3, Some(1.0)), Ok(()));
}

#[test]
fn bounds_read_from_toml_turn_off_with_false_and_round_trip() {
    let c: RobustConfig = toml::from_str("weight_cap = false\nnorm_cap = 3.0").unwrap();
    assert_eq!((c.weight_cap, c.norm_cap, c.min_norm_ratio), (None, Some(3.0), Some(0.01)));
    let unbounded = RobustConfig::unbounded();
    let written = toml::to_string(&unbounded).unwrap();
    assert_eq!(toml::from_str::<RobustConfig>(&written).unwrap(), unbounded, "{written}");
    let err = toml::from_str::<RobustConfig>("weight_cap = -1.0").unwrap_err().to_string();
    assert!(err.contains("weight_cap must be positive"), "{err}");
}
