//! A reward plugin to copy: the response scores 1 when it ends with the ground truth, minus 0.1
//! for every word past `max_words` (a reward keyword argument, default 50).
//!
//! ```text
//! cargo build --release
//! verl --plugin target/release/libkeyword_reward.so run job.yaml plugins.reward.default=keyword
//! ```

use verl_plugin_api::{Result, RewardRow, RowReward};

#[derive(Default)]
pub struct Keyword;

impl RowReward for Keyword {
    const NAME: &'static str = "keyword";
    const DESCRIPTION: &'static str =
        "1 when the response ends with the ground truth, minus a length penalty";

    fn score(&mut self, row: &RewardRow<'_>) -> Result<f32> {
        let max_words = row.kwargs["max_words"].as_u64().unwrap_or(50) as usize;
        let hit = row.response.trim_end().ends_with(&row.ground_truth_str());
        let over = row
            .response
            .split_whitespace()
            .count()
            .saturating_sub(max_words);
        Ok(hit as u8 as f32 - 0.1 * over as f32)
    }
}

verl_plugin_api::export_row_reward!(Keyword);

#[cfg(test)]
mod tests {
    use super::*;
    use verl_plugin_api::{col, sdk::RowRewardPlugin, testing, InitArgs, Role, ScoreOptions};

    #[test]
    fn scores_through_the_abi_like_the_host_calls_it() {
        let mut reward = testing::reward::<RowRewardPlugin<Keyword>>(&InitArgs::new(
            Role::Reward,
            serde_json::json!({}),
        ))
        .unwrap();
        let batch = testing::reward_batch(&[
            ("s", "so the answer is 42", "42"),
            ("s", "the answer is 41", "42"),
            ("s", "one two three four 42", "42"),
        ]);
        let opts = ScoreOptions {
            kwargs: serde_json::json!({"max_words": 3}),
        };
        let out = reward.score(&batch, &opts).unwrap();
        let s = out.tensor::<f32>(col::SCORES).unwrap().data;
        assert_eq!(s.len(), 3);
        assert!((s[0] - 0.8).abs() < 1e-6, "{s:?}");
        assert!((s[1] - -0.1).abs() < 1e-6, "{s:?}");
        assert!((s[2] - 0.8).abs() < 1e-6, "{s:?}");
    }
}
