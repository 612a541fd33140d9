//! Multi-turn generation through the plugin's ABI (`generate_turns`, a host-side turn driver
//! lent across it) on a tiny random Qwen2 model on CPU: the batch it returns carries every turn
//! and every appended token, `loss_mask` marks the sampled ones, and the actor's training forward
//! (`compute_log_prob`) gives the rollout log-probs back at every sampled token, across turns.

use serde_json::json;
use verl_fsdp::FsdpPlugin;
use verl_nn::HeadKind;
use verl_plugin_api::turns::{Resume, TurnDriver, TurnEnd};
use verl_plugin_api::{col, testing, Batch, GenerateOptions, InitArgs, LogProbOptions, Role};
use verl_test_support::model::{model_dir, qwen2_config};

const VOCAB: i64 = 64;
const RL: u32 = 40;

/// Appends three tokens after each of a row's first two turns, then finishes it.
#[derive(Default)]
struct TwoToolTurns {
    turns: std::collections::HashMap<usize, Vec<TurnEnd>>,
}

fn appended(row: usize, k: usize) -> Vec<i64> {
    vec![40 + row as i64 % 8, 50 + k as i64, 60]
}

impl TurnDriver for TwoToolTurns {
    fn turns(&mut self, ended: Vec<TurnEnd>, _idle: bool) -> verl_plugin_api::Result<Vec<Resume>> {
        let mut answers = Vec::new();
        for e in ended {
            let (row, waits, used) = (e.row, e.waits, e.response_len);
            let seen = self.turns.entry(row).or_default();
            let k = seen.len();
            seen.push(e);
            if !waits {
                continue;
            }
            answers.push(if k < 2 && used + 3 < RL as usize {
                Resume::Continue {
                    row,
                    tokens: appended(row, k),
                }
            } else {
                Resume::Finish { row }
            });
        }
        Ok(answers)
    }
}

#[test]
fn turns_cross_the_abi_and_the_training_forward_gives_their_log_probs_back() {
    let dir = model_dir(
        qwen2_config(VOCAB, 32, 64, 2, 128, false),
        None,
        HeadKind::CausalLm,
    );
    let cfg = json!({
        "trainer": {"device": "cpu"},
        "actor_rollout_ref": {
            "model": {"path": dir.path().to_str().unwrap()},
            "actor": {
                "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 4,
                "fsdp_config": {"model_dtype": "fp32", "dtype": "fp32"},
            },
            "rollout": {"n": 2, "temperature": 1.0, "log_prob_micro_batch_size_per_gpu": 3},
        },
    });
    let mut actor = testing::actor::<FsdpPlugin>(&InitArgs::new(Role::Actor, cfg)).unwrap();
    let prompts = verl_plugin_api::contract::prompt_batch(&[&[1, 2, 3, 4], &[5, 6]], 0);
    let opts = GenerateOptions {
        n: 2,
        max_new_tokens: RL,
        seed: Some(7),
        // Frequent stop tokens: every row ends a few turns early.
        eos_token_ids: (0..12).collect(),
        pad_token_id: 0,
        return_log_probs: true,
        ..GenerateOptions::default()
    };
    let mut driver = TwoToolTurns::default();
    let out: Batch = actor.generate_turns(&prompts, &opts, &mut driver).unwrap();
    let (resp, mask) = (
        out.tensor::<i64>(col::RESPONSES).unwrap(),
        out.tensor::<i64>(col::RESPONSE_MASK).unwrap(),
    );
    let loss = out.tensor::<i64>(col::LOSS_MASK).unwrap();
    assert_eq!(resp.shape, vec![4, RL as usize]);
    let mut continued = 0;
    for r in 0..4 {
        let turns = &driver.turns[&r];
        let mut want = Vec::new();
        let mut sampled = Vec::new();
        for (k, t) in turns.iter().enumerate() {
            want.extend(&t.tokens);
            sampled.extend(std::iter::repeat_n(1i64, t.tokens.len()));
            if k + 1 < turns.len() {
                want.extend(appended(r, k));
                sampled.extend([0, 0, 0]);
                continued += 1;
            }
        }
        let row = |t: &verl_plugin_api::Tensor<i64>| {
            t.data[r * RL as usize..(r + 1) * RL as usize].to_vec()
        };
        assert_eq!(row(&resp)[..want.len()], want[..], "row {r}");
        assert_eq!(row(&loss)[..want.len()], sampled[..], "row {r}");
        assert!(row(&loss)[want.len()..].iter().all(|&m| m == 0));
        assert!(row(&mask)[..want.len()].iter().all(|&m| m == 1));
        assert!(row(&mask)[want.len()..].iter().all(|&m| m == 0));
    }
    assert!(
        continued >= 4,
        "too few continued turns to test ({continued})"
    );
    assert!(out.meta().contains_key("rollout/continued_turns"));

    // The training forward over the whole conversation: the same log-prob at every sampled
    // token (appended tokens are not the model's and carry none).
    let rollout = out.tensor::<f32>(col::ROLLOUT_LOG_PROBS).unwrap();
    let lp = actor
        .compute_log_prob(
            &out,
            &LogProbOptions {
                temperature: 1.0,
                ..LogProbOptions::default()
            },
        )
        .unwrap()
        .tensor::<f32>(col::LOG_PROBS)
        .unwrap();
    let mut worst = 0f32;
    for i in 0..loss.data.len() {
        if loss.data[i] == 1 {
            worst = worst.max((lp.data[i] - rollout.data[i]).abs());
        } else {
            assert_eq!(
                rollout.data[i], 0.0,
                "position {i}: an appended token has no log-prob"
            );
        }
    }
    assert!(
        worst < 1e-4,
        "max |training - rollout| over sampled tokens = {worst:.3e}"
    );
}
