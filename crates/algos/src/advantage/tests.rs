use super::*;
use crate::stats::{masked_mean, masked_var};

fn grid(rows: &[&[f64]]) -> Grid<f64> {
    Grid::from_rows(rows).unwrap()
}

fn assert_close(got: &Grid<f64>, expected: &[&[f64]], tol: f64) {
    let expected = grid(expected);
    assert_eq!(got.shape(), expected.shape());
    for (i, (g, e)) in got.as_slice().iter().zip(expected.as_slice()).enumerate() {
        assert!(
            (g - e).abs() <= tol,
            "element ({}, {}): got {g}, expected {e}",
            i / got.cols(),
            i % got.cols()
        );
    }
}

/// Outcome rewards on the last response token, as the reward plugin writes them.
fn outcome(scores: &[f64], lengths: &[usize], cols: usize) -> (Grid<f64>, Grid<f64>) {
    let mut rewards = Grid::filled(scores.len(), cols, 0.0);
    let mut mask = Grid::filled(scores.len(), cols, 0.0);
    for (r, (&s, &len)) in scores.iter().zip(lengths).enumerate() {
        rewards[(r, len - 1)] = s;
        mask.row_mut(r)[..len].fill(1.0);
    }
    (rewards, mask)
}

const EPS: f64 = 1e-6;

// ---- GRPO ------------------------------------------------------------------------------------------

#[test]
fn grpo_normalises_by_group_mean_and_sample_std() {
    let (rewards, mask) = outcome(&[1.0, 0.0, 3.0, 1.0], &[2, 3, 1, 2], 3);
    let groups = Groups::from_keys(&["p", "p", "q", "q"]);
    let out = compute_grpo_outcome_advantage(&rewards, &mask, &groups, EPS, true).unwrap();
    // Both groups are {x, x−1} or {3, 1}: sample std of two points is |a−b|/√2.
    let a = 0.5 / (0.5f64.sqrt() + EPS);
    let b = 1.0 / (2.0f64.sqrt() + EPS);
    assert_close(
        &out.advantages,
        &[&[a, a, 0.0], &[-a, -a, -a], &[b, 0.0, 0.0], &[-b, -b, 0.0]],
        1e-12,
    );
    assert_eq!(out.returns, out.advantages);
}

#[test]
fn grpo_without_std_is_dr_grpo_mean_centering() {
    let (rewards, mask) = outcome(&[1.0, 0.0, 0.0], &[1, 1, 1], 1);
    let groups = Groups::from_keys(&[0u64, 0, 0]);
    let out = compute_grpo_outcome_advantage(&rewards, &mask, &groups, EPS, false).unwrap();
    assert_close(
        &out.advantages,
        &[&[2.0 / 3.0], &[-1.0 / 3.0], &[-1.0 / 3.0]],
        1e-15,
    );
}

#[test]
fn grpo_group_of_one_keeps_its_score_over_one_plus_epsilon() {
    let (rewards, mask) = outcome(&[0.7], &[2], 2);
    let out =
        compute_grpo_outcome_advantage(&rewards, &mask, &Groups::from_keys(&["solo"]), EPS, true)
            .unwrap();
    let a = 0.7 / (1.0 + EPS);
    assert_close(&out.advantages, &[&[a, a]], 1e-15);
}

#[test]
fn grpo_all_equal_rewards_give_zero_advantage_not_nan() {
    let (rewards, mask) = outcome(&[1.0, 1.0, 1.0, 1.0], &[1, 2, 3, 3], 3);
    let out =
        compute_grpo_outcome_advantage(&rewards, &mask, &Groups::from_keys(&[1u64; 4]), EPS, true)
            .unwrap();
    assert!(
        out.advantages.as_slice().iter().all(|&x| x == 0.0),
        "{:?}",
        out.advantages
    );
}

#[test]
fn outcome_scores_sum_every_token_and_advantages_follow_a_mask_with_holes() {
    // Rewards spread over tokens (e.g. after a KL penalty) are summed per row; the mask has a hole in the
    // middle (e.g. a tool-output span) and the advantage is zero exactly there.
    let rewards = grid(&[&[0.25, 0.25, 0.5, 0.0], &[0.0, 0.0, 0.0, 0.0]]);
    let mask = grid(&[&[1.0, 0.0, 1.0, 0.0], &[1.0, 1.0, 0.0, 0.0]]);
    let out = compute_grpo_outcome_advantage(
        &rewards,
        &mask,
        &Groups::from_keys(&["a", "a"]),
        EPS,
        false,
    )
    .unwrap();
    assert_close(
        &out.advantages,
        &[&[0.5, 0.0, 0.5, 0.0], &[-0.5, -0.5, 0.0, 0.0]],
        1e-15,
    );
}

#[test]
fn grpo_rejects_an_index_of_the_wrong_length() {
    let (rewards, mask) = outcome(&[1.0, 0.0, 1.0], &[1, 1, 1], 1);
    let err =
        compute_grpo_outcome_advantage(&rewards, &mask, &Groups::from_keys(&["a", "a"]), EPS, true)
            .unwrap_err();
    assert_eq!(
        err.to_string(),
        "compute_grpo_outcome_advantage: `index` has 2 entries, expected 3 (one per row of `token_level_rewards`)"
    );
}

#[test]
fn estimators_name_a_mismatched_mask() {
    let rewards = Grid::filled(2, 3, 0.0);
    let mask = Grid::filled(2, 2, 1.0);
    let err = compute_rloo_outcome_advantage(&rewards, &mask, &Groups::from_keys(&[0u64, 0]))
        .unwrap_err();
    assert_eq!(
        err,
        AlgoError::ShapeMismatch {
            op: "compute_rloo_outcome_advantage",
            input: "response_mask",
            reference: "token_level_rewards",
            expected: (2, 3),
            found: (2, 2)
        }
    );
}

// ---- RLOO / OPO / GPG ------------------------------------------------------------------------------

#[test]
fn rloo_subtracts_the_mean_of_the_other_samples() {
    let (rewards, mask) = outcome(&[1.0, 0.0, 0.0, 0.4], &[1, 1, 1, 1], 1);
    let groups = Groups::from_keys(&["a", "a", "a", "solo"]);
    let out = compute_rloo_outcome_advantage(&rewards, &mask, &groups).unwrap();
    // 1 − mean(0, 0) = 1; 0 − mean(1, 0) = −0.5; a lone sample keeps its raw score.
    assert_close(&out.advantages, &[&[1.0], &[-0.5], &[-0.5], &[0.4]], 1e-15);
}

#[test]
fn rloo_all_equal_rewards_give_zero() {
    let (rewards, mask) = outcome(&[0.5, 0.5], &[2, 1], 2);
    let out =
        compute_rloo_outcome_advantage(&rewards, &mask, &Groups::from_keys(&[3u64, 3])).unwrap();
    assert!(out.advantages.as_slice().iter().all(|&x| x == 0.0));
}

#[test]
fn opo_baseline_is_weighted_by_response_length() {
    let (rewards, mask) = outcome(&[1.0, 0.0, 0.9], &[1, 3, 2], 3);
    let groups = Groups::from_keys(&["a", "a", "b"]);
    let out = compute_opo_outcome_advantage(&rewards, &mask, &groups).unwrap();
    // Baseline of "a" = (1·1 + 3·0)/4 = 0.25; "b" is alone: baseline 0.
    assert_close(
        &out.advantages,
        &[&[0.75, 0.0, 0.0], &[-0.25, -0.25, -0.25], &[0.9, 0.9, 0.0]],
        1e-15,
    );
}

#[test]
fn gpg_scales_by_batch_over_nonzero_count() {
    let (rewards, mask) = outcome(&[1.0, 0.0, 0.0, 1.0], &[1, 1, 2, 2], 2);
    let groups = Groups::from_keys(&["a", "a", "b", "b"]);
    let out = compute_gpg_outcome_advantage(&rewards, &mask, &groups, 1.0, &mut LocalOnly).unwrap();
    // alpha = 4 / 2 non-zero scores = 2.
    assert_close(
        &out.advantages,
        &[&[1.0, 0.0], &[-1.0, 0.0], &[-1.0, -1.0], &[1.0, 1.0]],
        1e-15,
    );
}

#[test]
fn gpg_with_all_zero_scores_does_not_divide_by_zero() {
    let (rewards, mask) = outcome(&[0.0, 0.0], &[1, 1], 1);
    let out = compute_gpg_outcome_advantage(
        &rewards,
        &mask,
        &Groups::from_keys(&[0u64, 0]),
        1.0,
        &mut LocalOnly,
    )
    .unwrap();
    assert!(out.advantages.as_slice().iter().all(|&x| x == 0.0));
}

// ---- REINFORCE++ -----------------------------------------------------------------------------------

#[test]
fn reinforce_plus_plus_returns_reset_where_the_mask_is_zero() {
    let rewards = grid(&[&[1.0, 0.0, 2.0], &[0.0, 3.0, 0.0]]);
    let mask = grid(&[&[1.0, 0.0, 1.0], &[1.0, 1.0, 0.0]]);
    let out = compute_reinforce_plus_plus_outcome_advantage(&rewards, &mask, 0.5, &mut LocalOnly)
        .unwrap();
    // Row 0: t2 = 2; t1 = 0 + 0.5·2 = 1, then the hole resets the running return; t0 = 1.
    // Row 1: t2 = 0 (masked, reset); t1 = 3; t0 = 0 + 0.5·3 = 1.5.
    assert_close(&out.returns, &[&[1.0, 1.0, 2.0], &[1.5, 3.0, 0.0]], 1e-15);
    assert_eq!(out.advantages[(0, 1)], 0.0);
    assert_eq!(out.advantages[(1, 2)], 0.0);
    assert!(masked_mean(&out.advantages, &mask).unwrap().abs() < 1e-7);
    assert!((masked_var(&out.advantages, &mask, true).unwrap() - 1.0).abs() < 1e-6);
}

#[test]
fn reinforce_plus_plus_baseline_all_equal_rewards_give_zero() {
    let (rewards, mask) = outcome(&[1.0, 1.0, 1.0], &[2, 1, 3], 3);
    let groups = Groups::from_keys(&["a", "a", "a"]);
    let out = compute_reinforce_plus_plus_baseline_outcome_advantage(
        &rewards,
        &mask,
        &groups,
        &mut LocalOnly,
    )
    .unwrap();
    assert!(
        out.advantages.as_slice().iter().all(|&x| x == 0.0),
        "{:?}",
        out.advantages
    );
}

#[test]
fn reinforce_plus_plus_baseline_is_whitened_and_masked() {
    let (rewards, mask) = outcome(&[1.0, 0.0, 2.0, 0.0], &[3, 1, 2, 2], 3);
    let groups = Groups::from_keys(&["a", "a", "b", "b"]);
    let out = compute_reinforce_plus_plus_baseline_outcome_advantage(
        &rewards,
        &mask,
        &groups,
        &mut LocalOnly,
    )
    .unwrap();
    assert!(masked_mean(&out.advantages, &mask).unwrap().abs() < 1e-7);
    assert!((masked_var(&out.advantages, &mask, true).unwrap() - 1.0).abs() < 1e-6);
    // Same sign as score − group mean on every response token, zero elsewhere.
    assert!(out.advantages[(0, 2)] > 0.0 && out.advantages[(1, 0)] < 0.0);
    assert_eq!(out.advantages[(1, 1)], 0.0);
    assert_eq!(out.returns, out.advantages);
}

#[test]
fn whitened_estimators_refuse_a_batch_with_a_single_response_token() {
    let (rewards, mask) = outcome(&[1.0], &[1], 2);
    let err = compute_reinforce_plus_plus_outcome_advantage(&rewards, &mask, 1.0, &mut LocalOnly)
        .unwrap_err();
    assert_eq!(
        err,
        AlgoError::SingleElementMask {
            op: "masked_whiten"
        }
    );
}

// ---- ReMax -----------------------------------------------------------------------------------------

#[test]
fn remax_subtracts_the_greedy_baseline_from_the_reward_to_go() {
    let rewards = grid(&[&[0.0, 0.0, 1.0, 0.0], &[0.5, 0.0, 9.0, 0.0]]);
    let mask = grid(&[&[1.0, 1.0, 1.0, 0.0], &[1.0, 1.0, 0.0, 0.0]]);
    let out = compute_remax_outcome_advantage(&rewards, &[0.25, 1.0], &mask).unwrap();
    // The reward under a zero mask (9.0) never enters the reward-to-go.
    assert_close(
        &out.returns,
        &[&[1.0, 1.0, 1.0, 0.0], &[0.5, 0.0, 0.0, 0.0]],
        1e-15,
    );
    assert_close(
        &out.advantages,
        &[&[0.75, 0.75, 0.75, 0.0], &[-0.5, -1.0, 0.0, 0.0]],
        1e-15,
    );
}

#[test]
fn remax_names_baselines_of_the_wrong_length() {
    let (rewards, mask) = outcome(&[1.0, 0.0], &[1, 1], 1);
    let err = compute_remax_outcome_advantage(&rewards, &[0.0], &mask).unwrap_err();
    assert!(
        err.to_string()
            .contains("`reward_baselines` has 1 entries, expected 2"),
        "{err}"
    );
}

// ---- GAE -------------------------------------------------------------------------------------------

#[test]
fn gae_returns_are_lambda_returns_and_padding_is_skipped() {
    let rewards = grid(&[&[0.0, 1.0, 0.0], &[0.0, 5.0, 1.0]]);
    let values = grid(&[&[0.2, 0.3, 0.9], &[0.5, 9.0, 0.25]]);
    let mask = grid(&[&[1.0, 1.0, 0.0], &[1.0, 0.0, 1.0]]);
    let out =
        compute_gae_advantage_return(&rewards, &values, &mask, 0.9, 0.8, &mut LocalOnly).unwrap();
    // Row 0 (γ=0.9, λ=0.8): t1: δ = 1 − 0.3 = 0.7; t0: δ = 0.9·0.3 − 0.2 = 0.07, A = 0.07 + 0.72·0.7 = 0.574.
    // Row 1: t2: A = 1 − 0.25 = 0.75; t1 is masked: value and A pass through; t0: δ = 0.9·0.25 − 0.5,
    //        A = −0.275 + 0.72·0.75 = 0.265.
    let raw = [[0.574, 0.7, 0.0], [0.265, 0.75, 0.75]];
    let returns: Vec<Vec<f64>> = raw
        .iter()
        .zip(values.iter_rows())
        .map(|(a, v)| a.iter().zip(v).map(|(a, v)| a + v).collect())
        .collect();
    let returns: Vec<&[f64]> = returns.iter().map(Vec::as_slice).collect();
    assert_close(&out.returns, &returns, 1e-12);
    // Advantages are the raw ones whitened over the mask (every element transformed, none zeroed).
    let raw_grid = grid(&[&raw[0], &raw[1]]);
    let expected = crate::stats::masked_whiten(&raw_grid, &mask, true).unwrap();
    assert_close(
        &out.advantages,
        &expected
            .to_rows()
            .iter()
            .map(Vec::as_slice)
            .collect::<Vec<_>>(),
        1e-12,
    );
    assert_ne!(out.advantages[(0, 2)], 0.0);
}

#[test]
fn gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value() {
    let rewards = grid(&[&[0.1, 0.2, 0.3], &[1.0, 0.0, 0.0]]);
    let values = grid(&[&[0.5, 0.4, 0.1], &[0.3, 0.2, 0.1]]);
    let mask = Grid::filled(2, 3, 1.0);
    let out =
        compute_gae_advantage_return(&rewards, &values, &mask, 1.0, 1.0, &mut LocalOnly).unwrap();
    assert_close(&out.returns, &[&[0.6, 0.5, 0.3], &[1.0, 0.0, 0.0]], 1e-12);
}

#[test]
fn gae_names_mismatched_values() {
    let g = Grid::filled(2, 3, 0.0);
    let err =
        compute_gae_advantage_return(&g, &Grid::filled(3, 3, 0.0), &g, 1.0, 1.0, &mut LocalOnly)
            .unwrap_err();
    assert_eq!(
        err.to_string(),
        "compute_gae_advantage_return: `values` has shape [3, 3], expected [2, 3] (the shape of `token_level_rewards`)"
    );
}

// ---- dispatch --------------------------------------------------------------------------------------

#[test]
fn every_verl_name_parses_and_round_trips_through_serde() {
    for (e, name) in AdvantageEstimator::ALL
        .iter()
        .zip(AdvantageEstimator::NAMES)
    {
        assert_eq!(e.name(), *name);
        assert_eq!(name.parse::<AdvantageEstimator>().unwrap(), *e);
        let json = serde_json::to_string(e).unwrap();
        assert_eq!(json, format!("\"{name}\""));
        assert_eq!(
            serde_json::from_str::<AdvantageEstimator>(&json).unwrap(),
            *e
        );
    }
}

#[test]
fn unknown_estimator_lists_the_valid_names() {
    let err = serde_json::from_str::<AdvantageEstimator>("\"ppo\"")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(
            "`algorithm.adv_estimator`: unknown value `ppo`, expected one of: gae, grpo, reinforce_plus_plus, \
             reinforce_plus_plus_baseline, remax, rloo, opo, gpg"
        ),
        "{err}"
    );
}

#[test]
fn verl_estimators_not_implemented_here_say_so() {
    let err = "grpo_vectorized".parse::<AdvantageEstimator>().unwrap_err();
    assert!(matches!(err, AlgoError::Unsupported { .. }), "{err:?}");
    assert!(err.to_string().contains("use `grpo`"), "{err}");
    assert!(matches!(
        "grpo_passk".parse::<AdvantageEstimator>(),
        Err(AlgoError::Unsupported { .. })
    ));
}

#[test]
fn params_default_like_verl() {
    let p: AdvantageParams = serde_json::from_str(r#"{"gamma": 0.99}"#).unwrap();
    assert_eq!(
        p,
        AdvantageParams {
            gamma: 0.99,
            ..AdvantageParams::default()
        }
    );
    assert_eq!(
        AdvantageParams::default(),
        AdvantageParams {
            gamma: 1.0,
            lam: 1.0,
            norm_adv_by_std_in_grpo: true,
            epsilon: 1e-6,
            f_norm: 1.0
        }
    );
}

#[test]
fn dispatch_reports_the_missing_input_for_each_estimator() {
    let (rewards, mask) = outcome(&[1.0, 0.0], &[1, 1], 1);
    let inputs = AdvantageInputs::new(&rewards, &mask);
    let params = AdvantageParams::default();
    for e in AdvantageEstimator::ALL {
        let res = compute_advantage(e, &inputs, &params);
        let missing = if e.needs_values() {
            Some("values")
        } else if e.needs_groups() {
            Some("index")
        } else if e.needs_reward_baselines() {
            Some("reward_baselines")
        } else {
            None
        };
        match missing {
            Some(input) => match res {
                Err(AlgoError::MissingInput {
                    estimator,
                    input: got,
                    ..
                }) => {
                    assert_eq!((estimator, got), (e.name(), input));
                }
                other => panic!("{e}: expected a missing `{input}` error, got {other:?}"),
            },
            None => assert!(res.is_ok(), "{e}: {res:?}"),
        }
    }
}

#[test]
fn dispatch_routes_params_to_the_estimator() {
    let (rewards, mask) = outcome(&[1.0, 0.0], &[1, 1], 1);
    let groups = Groups::from_keys(&["a", "a"]);
    let inputs = AdvantageInputs::new(&rewards, &mask).with_index(&groups);
    let dr_grpo = AdvantageParams {
        norm_adv_by_std_in_grpo: false,
        ..AdvantageParams::default()
    };
    let out = compute_advantage(AdvantageEstimator::Grpo, &inputs, &dr_grpo).unwrap();
    assert_close(&out.advantages, &[&[0.5], &[-0.5]], 1e-15);

    let baselines = [0.5, 0.5];
    let inputs = inputs.with_reward_baselines(&baselines);
    let out = compute_advantage(
        AdvantageEstimator::Remax,
        &inputs,
        &AdvantageParams::default(),
    )
    .unwrap();
    assert_close(&out.advantages, &[&[0.5], &[-0.5]], 1e-15);
}

/// GPG's alpha counts non-zero scores over the whole batch, not the shard.
#[test]
fn gpg_across_ranks_uses_the_whole_batch_count() {
    struct OtherRank;
    impl CrossRankSum for OtherRank {
        fn sum_in_place(&mut self, values: &mut [f64]) -> std::result::Result<(), String> {
            // The other rank holds 4 rows, all with zero score.
            values[0] += 4.0;
            Ok(())
        }
    }
    let (rewards, mask) = outcome(&[1.0, 0.0], &[1, 1], 1);
    let groups = Groups::from_keys(&["a", "a"]);
    let inputs = AdvantageInputs::new(&rewards, &mask).with_index(&groups);
    let out = compute_advantage_across(
        AdvantageEstimator::Gpg,
        &inputs,
        &AdvantageParams::default(),
        &mut OtherRank,
    )
    .unwrap();
    // alpha = 6 rows / 1 non-zero = 6; centred scores ±0.5.
    assert_close(&out.advantages, &[&[3.0], &[-3.0]], 1e-12);
}
