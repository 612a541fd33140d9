//! Parity with verl 0.9.1: every row of `golden/rewards_verl.jsonl` (verl's own scores on real
//! GSM8K model solutions and MATH-style answers) must be reproduced exactly.

use std::time::Instant;

use serde_json::Value;
use verl_rewards::{default_compute_score, Gsm8kMethod, ScoreOptions};
use verl_test_support::shared_path;

const GOLDEN: &str = "golden/rewards_verl.jsonl";

fn str_field<'a>(row: &'a Value, key: &str, line: usize) -> &'a str {
    row.get(key).and_then(Value::as_str).unwrap_or_else(|| {
        panic!(
            "{GOLDEN} line {line}: `{key}` must be a string, found {:?}",
            row.get(key)
        )
    })
}

fn snippet(s: &str) -> String {
    let n = s.chars().count();
    let tail: String = s.chars().skip(n.saturating_sub(120)).collect();
    format!("{}{tail:?}", if n > 120 { "..." } else { "" })
}

#[test]
fn golden_rewards_match_verl() {
    // Absent: a skip, or a failure under VERL_REQUIRE_SHARED=1 (CI).
    let Some(path) = shared_path(GOLDEN) else {
        return;
    };
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));

    let mut rows = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let row: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("{GOLDEN} line {}: invalid JSON: {e}", i + 1));
        rows.push((i, row));
    }
    assert!(!rows.is_empty(), "{GOLDEN} has no rows");

    let start = Instant::now();
    let mut mismatches = Vec::new();
    for (i, row) in &rows {
        let line = i + 1;
        let data_source = str_field(row, "data_source", line);
        let solution = str_field(row, "solution_str", line);
        let ground_truth = str_field(row, "ground_truth", line);
        let expected = row
            .get("score")
            .and_then(Value::as_f64)
            .unwrap_or_else(|| panic!("{GOLDEN} line {line}: `score` must be a number"));
        let mut opts = ScoreOptions::default();
        if let Some(method) = row.get("method") {
            let method = method
                .as_str()
                .unwrap_or_else(|| panic!("{GOLDEN} line {line}: `method` must be a string"));
            opts.gsm8k_method = method
                .parse::<Gsm8kMethod>()
                .unwrap_or_else(|e| panic!("{GOLDEN} line {line}: {e}"));
        }
        let out = default_compute_score(data_source, solution, ground_truth, None, &opts);
        // math_dapo's `acc` must tell the same story as its +1/-1 score.
        if let Ok(o) = &out {
            if let Some(acc) = o.metric("acc") {
                let want = if o.score == 1.0 { 1.0 } else { 0.0 };
                assert_eq!(
                    acc, want,
                    "row {i} (line {line}): acc disagrees with score {}",
                    o.score
                );
            }
        }
        let got = out.map(|o| o.score);
        if got.as_ref().ok() != Some(&expected) {
            mismatches.push(format!(
                "row {i} (line {line}) {data_source} method={}: expected {expected}, got {got:?}; \
                 ground_truth={ground_truth:?} solution tail={}",
                opts.gsm8k_method,
                snippet(solution)
            ));
        }
    }
    let elapsed = start.elapsed();

    println!(
        "checked {} golden rows in {elapsed:?}: {} mismatches",
        rows.len(),
        mismatches.len()
    );
    for m in mismatches.iter().take(20) {
        println!("  {m}");
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} rows disagree with verl (first shown above)",
        mismatches.len(),
        rows.len()
    );
}

/// verl passes `custom_reward_function.reward_kwargs` to the score function: GSM8K's flexible
/// extraction finds an answer the strict one (`#### N` only) does not.
#[test]
fn reward_kwargs_reach_the_rule_rewards() {
    use verl_plugin_api::{col, Batch, InitArgs, RewardPlugin, Role, ScoreOptions as Call};
    let score = |reward_kwargs: Value| -> f32 {
        let config =
            serde_json::json!({"custom_reward_function": {"reward_kwargs": reward_kwargs}});
        let mut reward =
            verl_rewards::RulesRewardPlugin::create_reward(&InitArgs::new(Role::Reward, config))
                .unwrap();
        let mut b = Batch::new();
        b.insert_strings(
            col::RESPONSE_TEXT,
            // No trailing period: verl's flexible extraction would keep it ("72.").
            &["She sold 72 clips, so the answer is 72"],
        );
        b.insert_strings(col::DATA_SOURCE, &["openai/gsm8k"]);
        b.insert_json(col::GROUND_TRUTH, &[Value::from("72")]);
        b.insert_json(col::EXTRA_INFO, &[Value::Null]);
        let out = reward.score(&b, &Call::default()).unwrap();
        out.tensor::<f32>(col::SCORES).unwrap().data[0]
    };
    assert_eq!(score(serde_json::json!({})), 0.0, "strict needs `#### 72`");
    assert_eq!(score(serde_json::json!({"method": "flexible"})), 1.0);
}
