//! verl's metric names and arithmetic (`metric_utils.py`, `metric/utils.py`), checked on hand-computed batches.

use std::collections::BTreeMap;

use verl_metrics::{
    compute_data_metrics, compute_throughput_metrics, compute_timing_metrics,
    process_validation_metrics, reduce_metrics, validation_metrics, InfoColumn, MetricLists,
    MetricsError, StepData, Timings, TokenCounts, BOOTSTRAP_SEED,
};

fn get(metrics: &[(String, f64)], key: &str) -> f64 {
    metrics
        .iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| {
            panic!(
                "missing {key}; have {:?}",
                metrics.iter().map(|m| &m.0).collect::<Vec<_>>()
            )
        })
        .1
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

/// Three responses of width 4: full length (clipped), two tokens, and an aborted one.
struct Batch {
    rewards: Vec<f64>,
    adv: Vec<f64>,
    ret: Vec<f64>,
    values: Vec<f64>,
    mask: Vec<f64>,
}

fn batch() -> Batch {
    Batch {
        rewards: vec![0.0, 0.0, 0.0, 1.0, -0.1, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        adv: vec![1.0, 2.0, 3.0, 4.0, -1.0, -2.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0],
        ret: vec![1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0],
        values: vec![0.5, 1.0, 1.5, 1.0, 0.0, 0.5, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0],
        mask: vec![1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    }
}

fn step_data(b: &Batch, with_values: bool) -> StepData<'_> {
    StepData {
        max_response_length: 4,
        max_prompt_length: 6,
        sequence_scores: &[1.0, 0.5, -3.0],
        token_level_rewards: &b.rewards,
        advantages: &b.adv,
        returns: &b.ret,
        values: with_values.then_some(b.values.as_slice()),
        response_mask: &b.mask,
        prompt_lengths: &[6, 3, 6],
        response_lengths: &[4, 2, 0],
        num_turns: Some(&[2.0, 3.0, 1.0]),
        tool_call_counts: None,
    }
}

#[test]
fn data_metrics_follow_verl_names_and_arithmetic() {
    let b = batch();
    let m = compute_data_metrics(&step_data(&b, true)).unwrap();

    // Scores and rewards skip the aborted third row.
    assert_eq!(get(&m, "critic/score/mean"), 0.75);
    assert_eq!(get(&m, "critic/score/min"), 0.5);
    assert!(close(get(&m, "critic/rewards/mean"), (1.0 + 0.4) / 2.0));
    assert_eq!(get(&m, "critic/rewards/max"), 1.0);
    // Advantages, returns and values only under the response mask.
    assert!(close(get(&m, "critic/advantages/mean"), 7.0 / 6.0));
    assert_eq!(get(&m, "critic/advantages/max"), 4.0);
    assert_eq!(get(&m, "critic/advantages/min"), -2.0);
    assert!(close(get(&m, "critic/returns/mean"), 4.0 / 6.0));
    assert!(close(get(&m, "critic/values/mean"), 4.5 / 6.0));
    // vf_explained_var = 1 − var(ret − v) / (var(ret) + 1e-5), torch.var unbiased.
    let diff = [0.5, 0.0, -0.5, 0.0, 0.0, -0.5];
    let var = |x: &[f64]| {
        let m = x.iter().sum::<f64>() / x.len() as f64;
        x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (x.len() as f64 - 1.0)
    };
    let ret = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0];
    assert!(close(
        get(&m, "critic/vf_explained_var"),
        1.0 - var(&diff) / (var(&ret) + 1e-5)
    ));

    assert_eq!(get(&m, "response_length/mean"), 2.0);
    assert_eq!(get(&m, "response_length/min"), 0.0);
    assert!(close(get(&m, "response_length/clip_ratio"), 1.0 / 3.0));
    assert_eq!(get(&m, "response_length_non_aborted/mean"), 3.0);
    assert_eq!(get(&m, "response_length_non_aborted/clip_ratio"), 0.5);
    assert!(close(get(&m, "response/aborted_ratio"), 1.0 / 3.0));
    assert_eq!(get(&m, "prompt_length/mean"), 5.0);
    assert!(close(get(&m, "prompt_length/clip_ratio"), 2.0 / 3.0));
    assert_eq!(get(&m, "num_turns/max"), 3.0);
    assert_eq!(get(&m, "num_turns/mean"), 2.0);
    assert!(m.iter().all(|(k, _)| !k.starts_with("tool_call_counts")));
}

#[test]
fn without_a_critic_there_are_no_value_metrics() {
    let b = batch();
    let m = compute_data_metrics(&step_data(&b, false)).unwrap();
    assert!(m
        .iter()
        .all(|(k, _)| !k.starts_with("critic/values") && k != "critic/vf_explained_var"));
    assert_eq!(m.len(), 12 + 4 + 4 + 1 + 4 + 3, "{m:?}");
}

#[test]
fn bad_shapes_and_all_aborted_batches_are_errors() {
    let b = batch();
    let mut d = step_data(&b, true);
    d.advantages = &b.adv[..11];
    let err = compute_data_metrics(&d).unwrap_err();
    assert!(matches!(
        err,
        MetricsError::Length {
            input: "advantages",
            expected: 12,
            found: 11,
            ..
        }
    ));
    assert!(
        err.to_string().contains("rows × max_response_length"),
        "{err}"
    );

    let mut d = step_data(&b, true);
    d.response_lengths = &[0, 0, 0];
    assert!(matches!(
        compute_data_metrics(&d),
        Err(MetricsError::AllAborted { rows: 3 })
    ));
}

#[test]
fn timing_per_token_uses_response_tokens_for_gen_and_all_tokens_for_passes() {
    let mut t = Timings::new();
    t.add("gen", 2.0);
    t.add("gen", 1.0); // timed twice: accumulates like marked_timer
    t.add("update_actor", 4.0);
    t.add("reward", 0.5);
    t.add("step", 10.0);
    let tokens = TokenCounts {
        prompt: 500,
        response: 1500,
    };
    let m = compute_timing_metrics(&t, tokens);
    assert_eq!(get(&m, "timing_s/gen"), 3.0);
    assert_eq!(get(&m, "timing_s/reward"), 0.5);
    assert_eq!(get(&m, "timing_per_token_ms/gen"), 3.0 * 1000.0 / 1500.0);
    assert_eq!(
        get(&m, "timing_per_token_ms/update_actor"),
        4.0 * 1000.0 / 2000.0
    );
    assert!(m
        .iter()
        .all(|(k, _)| k != "timing_per_token_ms/reward" && k != "timing_per_token_ms/step"));

    let p = compute_throughput_metrics(&t, tokens, 4).unwrap();
    assert_eq!(get(&p, "perf/total_num_tokens"), 2000.0);
    assert_eq!(get(&p, "perf/time_per_step"), 10.0);
    assert_eq!(get(&p, "perf/throughput"), 2000.0 / (10.0 * 4.0));

    let err = compute_throughput_metrics(&Timings::new(), tokens, 1).unwrap_err();
    assert!(err.to_string().contains("`step` is missing"), "{err}");
}

#[test]
fn reduce_metrics_takes_max_min_or_mean_by_key() {
    let mut lists = MetricLists::default();
    lists.append([
        ("actor/pg_loss", 1.0),
        ("actor/grad_norm_max", 3.0),
        ("x/min_error", 0.5),
    ]);
    lists.append([
        ("actor/pg_loss", 2.0),
        ("actor/grad_norm_max", 5.0),
        ("x/min_error", 0.1),
    ]);
    let r = lists.reduce();
    assert_eq!(r["actor/pg_loss"], 1.5);
    assert_eq!(r["actor/grad_norm_max"], 5.0);
    assert_eq!(r["x/min_error"], 0.1);
    let empty: BTreeMap<String, Vec<f64>> = [("a".to_string(), vec![])].into();
    assert!(reduce_metrics(&empty).is_empty());
}

fn labels(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn validation_metrics_group_by_source_and_prompt() {
    // gsm8k: two prompts × 4 samples; math: one prompt × 1 sample.
    let sources = [
        "gsm8k", "gsm8k", "gsm8k", "gsm8k", "gsm8k", "gsm8k", "gsm8k", "gsm8k", "math",
    ];
    let uids = ["a", "a", "a", "a", "b", "b", "b", "b", "c"];
    let acc = vec![1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0];
    let infos = vec![
        ("acc".to_string(), InfoColumn::Numbers(acc)),
        ("score".to_string(), InfoColumn::Numbers(vec![2.0; 9])),
        (
            "pred".to_string(),
            InfoColumn::Labels(labels(&["7", "3", "7", "7", "1", "2", "2", "9", "5"])),
        ),
    ];
    let table = process_validation_metrics(&sources, &uids, &infos, BOOTSTRAP_SEED).unwrap();
    let g = &table["gsm8k"]["acc"];
    assert_eq!(g["mean@4"], (0.75 + 0.25) / 2.0);
    // np.std (population): prompt a → sqrt(3/16), prompt b → sqrt(3/16).
    assert!(close(g["std@4"], (3.0f64 / 16.0).sqrt()));
    for n in [2, 4] {
        assert!(g[&format!("best@{n}/mean")] >= g[&format!("worst@{n}/mean")]);
        assert!(g.contains_key(&format!("maj@{n}/std")));
    }
    // best of 4 draws from prompt a (3 of 4 correct) is almost surely 1; prompt b (1 of 4) 1 − (3/4)^4 ≈ 0.68.
    assert!(
        (g["best@4/mean"] - (1.0 + 0.684) / 2.0).abs() < 0.05,
        "{}",
        g["best@4/mean"]
    );
    // Majority at 4 in prompt a is "7" (correct) almost always; in prompt b "2" (wrong) most often.
    assert!(
        g["maj@4/mean"] > 0.4 && g["maj@4/mean"] < 0.6,
        "{}",
        g["maj@4/mean"]
    );
    assert!(
        !table["gsm8k"].contains_key("pred"),
        "label columns get no statistics"
    );
    assert_eq!(table["math"]["acc"].keys().collect::<Vec<_>>(), ["mean@1"]);

    let named = validation_metrics(&table, Some(&[1.0, 2.0]));
    let names: Vec<&str> = named.iter().map(|(k, _)| k.as_str()).collect();
    assert!(names.contains(&"val-core/gsm8k/acc/mean@4"));
    assert!(names.contains(&"val-core/gsm8k/acc/best@4/std"));
    assert!(names.contains(&"val-core/gsm8k/acc/maj@4/mean"));
    assert!(names.contains(&"val-aux/gsm8k/acc/std@4"));
    assert!(names.contains(&"val-aux/gsm8k/acc/best@2/mean"));
    assert!(
        names.contains(&"val-aux/gsm8k/score/mean@4"),
        "score is not the core variable when acc exists"
    );
    assert!(names.contains(&"val-core/math/acc/mean@1"));
    assert_eq!(get(&named, "val-aux/num_turns/mean"), 1.5);
}

#[test]
fn validation_core_variable_is_reward_without_acc_and_results_are_deterministic() {
    let infos = vec![(
        "reward".to_string(),
        InfoColumn::Numbers(vec![0.1, 0.9, 0.4]),
    )];
    let run = || process_validation_metrics(&["d"; 3], &["u"; 3], &infos, BOOTSTRAP_SEED).unwrap();
    let t = run();
    assert_eq!(t, run());
    let named = validation_metrics(&t, None);
    assert!(named.iter().any(|(k, _)| k == "val-core/d/reward/mean@3"));
    assert!(named
        .iter()
        .any(|(k, _)| k == "val-core/d/reward/best@3/mean"));
    assert!(named
        .iter()
        .any(|(k, _)| k == "val-aux/d/reward/worst@3/mean"));

    let err = process_validation_metrics(&["d"; 3], &["u"; 2], &infos, 1).unwrap_err();
    assert!(err.to_string().contains("sample_uids"), "{err}");
    let short = vec![("acc".to_string(), InfoColumn::Numbers(vec![1.0]))];
    let err = process_validation_metrics(&["d"; 3], &["u"; 3], &short, 1).unwrap_err();
    assert!(
        err.to_string()
            .contains("column `acc` has 1 entries, expected 3"),
        "{err}"
    );
}
