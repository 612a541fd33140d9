//! A controlled GRPO learning test: the actor, driven in-process through the plugin ABI, must learn
//! a trivial bandit on a tiny random Qwen2 model on CPU. Reward 1 when the first response token is
//! in a fixed quarter of the vocabulary; GRPO advantages computed here as verl does; `update` with
//! verl's actor defaults (vanilla clipped loss, clip 0.2, token-mean).

use std::path::Path;
use std::time::Instant;

use serde_json::json;
use verl_fsdp::FsdpPlugin;
use verl_nn::{HeadKind, ModelOptions, Transformer};
use verl_plugin_api::client::ActorClient;
use verl_plugin_api::{
    col, testing, Batch, GenerateOptions, InitArgs, LogProbOptions, Role, UpdateOptions,
};
use verl_test_support::model::{model_dir, qwen2_config};

const VOCAB: i64 = 48;
const N: usize = 8;
const RL: usize = 3;
const PROMPTS: [&[i64]; 4] = [&[5, 6, 7, 8], &[9, 10], &[11, 12, 13], &[20, 30, 40]];

/// A random qwen2-shaped checkpoint (plus a stand-in tokenizer file) in a temp dir.
fn tiny_model() -> tempfile::TempDir {
    model_dir(
        qwen2_config(VOCAB, 32, 64, 2, 128, false),
        Some(0),
        HeadKind::CausalLm,
    )
}

/// verl's actor defaults (clip 0.2, token-mean, grad_clip 1, AdamW wd 0.01); `mini_batches`
/// mini-batches per step over the `PROMPTS.len() × N` rows.
fn actor(model: &Path, lr: f64, mini_batches: usize) -> ActorClient {
    let prompts_per_mini = PROMPTS.len() / mini_batches;
    let c = json!({
        "trainer": {"device": "cpu"},
        "actor_rollout_ref": {
            "model": {"path": model.to_str().unwrap()},
            "actor": {
                "ppo_mini_batch_size": prompts_per_mini, "ppo_micro_batch_size_per_gpu": 8,
                "ppo_epochs": 1, "grad_clip": 1.0, "clip_ratio": 0.2,
                "loss_agg_mode": "token-mean",
                "optim": {"lr": lr, "weight_decay": 0.01},
                "fsdp_config": {"model_dtype": "fp32", "dtype": "fp32"},
            },
            "rollout": {"n": N, "temperature": 1.0},
        },
    });
    testing::actor::<FsdpPlugin>(&InitArgs::new(Role::Actor, c)).unwrap()
}

fn f32s(b: &Batch, name: &str) -> Vec<f32> {
    b.tensor::<f32>(name).unwrap().data
}

fn i64s(b: &Batch, name: &str) -> Vec<i64> {
    b.tensor::<i64>(name).unwrap().data
}

/// The reward: the first response token lies in the lowest quarter of the vocabulary (about a
/// quarter of the first tokens of the random model).
fn reward(first_token: i64) -> f64 {
    if first_token < VOCAB / 4 {
        1.0
    } else {
        0.0
    }
}

/// verl's GRPO outcome advantage: per group `(r - mean) / (std + 1e-6)` with the sample
/// (unbiased) std, broadcast over the response tokens and zeroed outside the response mask.
fn grpo_advantages(rewards: &[f64], index: &[i64], mask: &[i64]) -> Vec<f32> {
    let mut per_row = vec![0.0f64; rewards.len()];
    let mut groups: Vec<i64> = index.to_vec();
    groups.sort_unstable();
    groups.dedup();
    for g in groups {
        let rows: Vec<usize> = (0..rewards.len()).filter(|&i| index[i] == g).collect();
        let n = rows.len() as f64;
        let mean = rows.iter().map(|&i| rewards[i]).sum::<f64>() / n;
        let std = if rows.len() > 1 {
            (rows
                .iter()
                .map(|&i| (rewards[i] - mean).powi(2))
                .sum::<f64>()
                / (n - 1.0))
                .sqrt()
        } else {
            1.0
        };
        let mean = if rows.len() > 1 { mean } else { 0.0 };
        for &i in &rows {
            per_row[i] = (rewards[i] - mean) / (std + 1e-6);
        }
    }
    mask.iter()
        .enumerate()
        .map(|(k, &m)| if m != 0 { per_row[k / RL] as f32 } else { 0.0 })
        .collect()
}

struct Step {
    reward: f64,
    generate_s: f64,
    log_prob_s: f64,
    update_s: f64,
}

/// One GRPO step: sample, score, advantages, old log-probs, update. Returns the mean reward of the
/// samples this step trained on.
fn grpo_step(a: &mut ActorClient, step: u64) -> Step {
    let t0 = Instant::now();
    let prompts = testing::prompts(&PROMPTS, 0);
    let gen = a
        .generate(
            &prompts,
            &GenerateOptions {
                n: N as u32,
                max_new_tokens: RL as u32,
                temperature: 1.0,
                seed: Some(1000 + step),
                eos_token_ids: vec![1],
                ..GenerateOptions::default()
            },
        )
        .unwrap();
    let t1 = Instant::now();
    let rows = gen.rows();
    let responses = i64s(&gen, col::RESPONSES);
    let mask = i64s(&gen, col::RESPONSE_MASK);
    let index = i64s(&gen, col::PROMPT_INDEX);
    let rewards: Vec<f64> = (0..rows).map(|i| reward(responses[i * RL])).collect();
    let adv = grpo_advantages(&rewards, &index, &mask);

    let mut batch = Batch::new();
    let pl = gen.tensor::<i64>(col::PROMPTS).unwrap().shape[1];
    batch.insert_tensor(col::PROMPTS, &[rows, pl], &i64s(&gen, col::PROMPTS));
    batch.insert_tensor(col::PROMPT_MASK, &[rows, pl], &i64s(&gen, col::PROMPT_MASK));
    batch.insert_tensor(col::RESPONSES, &[rows, RL], &responses);
    batch.insert_tensor(col::RESPONSE_MASK, &[rows, RL], &mask);
    let old = a
        .compute_log_prob(&batch, &LogProbOptions::default())
        .unwrap();
    let t2 = Instant::now();
    batch.insert_tensor(col::OLD_LOG_PROBS, &[rows, RL], &f32s(&old, col::LOG_PROBS));
    batch.insert_tensor(col::ADVANTAGES, &[rows, RL], &adv);
    a.update(
        &batch,
        &UpdateOptions {
            global_step: step,
            ..UpdateOptions::default()
        },
    )
    .unwrap();
    let t3 = Instant::now();
    Step {
        reward: rewards.iter().sum::<f64>() / rows as f64,
        generate_s: (t1 - t0).as_secs_f64(),
        log_prob_s: (t2 - t1).as_secs_f64(),
        update_s: (t3 - t2).as_secs_f64(),
    }
}

fn curve(model: &Path, lr: f64, mini_batches: usize, steps: u64) -> Vec<f64> {
    let mut a = actor(model, lr, mini_batches);
    (0..steps).map(|s| grpo_step(&mut a, s).reward).collect()
}

fn mean(x: &[f64]) -> f64 {
    x.iter().sum::<f64>() / x.len() as f64
}

/// The first-token bandit is learnt with one and with four mini-batches per step: the mean reward
/// of the last three steps clearly exceeds that of the first two.
#[test]
fn grpo_learns_a_first_token_bandit() {
    let dir = tiny_model();
    for mini_batches in [1, 4] {
        let r = curve(dir.path(), 1e-2, mini_batches, 12);
        eprintln!("mini-batches {mini_batches}: reward {r:.3?}");
        let (first, last) = (mean(&r[..2]), mean(&r[r.len() - 3..]));
        assert!(
            last > first + 0.3 && last > 0.7,
            "{mini_batches} mini-batches: reward did not rise ({first:.3} -> {last:.3}): {r:.3?}"
        );
    }
}

/// Measurement (not a check): reward curves over learning rates and mini-batch counts, and the
/// time of one step's generate / compute_log_prob / update. `cargo test --test learns -- --ignored
/// --nocapture`; `VERL_LEARNS_THREADS` sets torch's intra-op threads.
#[test]
#[ignore = "measurement, not a check: run by name with --ignored --nocapture"]
fn sweep_learning_rates_and_time_the_step() {
    if let Some(t) = std::env::var("VERL_LEARNS_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        tch::set_num_threads(t);
    }
    eprintln!("torch threads: {}", tch::get_num_threads());
    let dir = tiny_model();
    for lr in [3e-4, 1e-3, 3e-3, 1e-2] {
        for mini_batches in [1, 4] {
            let r = curve(dir.path(), lr, mini_batches, 15);
            eprintln!("lr {lr:e} mini-batches {mini_batches}: reward {r:.2?}");
        }
    }
    for mini_batches in [1, 4] {
        let mut a = actor(dir.path(), 1e-3, mini_batches);
        let steps: Vec<Step> = (0..6).map(|s| grpo_step(&mut a, s)).collect();
        let avg = |f: fn(&Step) -> f64| mean(&steps[1..].iter().map(f).collect::<Vec<_>>());
        eprintln!(
            "mini-batches {mini_batches}: generate {:.1} ms, compute_log_prob {:.1} ms, update {:.1} ms",
            avg(|s| s.generate_s) * 1e3,
            avg(|s| s.log_prob_s) * 1e3,
            avg(|s| s.update_s) * 1e3,
        );
    }
}

/// A random model of the quickstart's shape (vocab 512, hidden 128, 2 layers).
fn quickstart_model() -> tempfile::TempDir {
    let config = json!({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": false, "initializer_range": 0.02,
        "pad_token_id": 0, "eos_token_id": 1,
    });
    model_dir(config, Some(0), HeadKind::CausalLm)
}

fn ms(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e3
}

/// Measurement (not a check): the quickstart's update (128 rows = 16 prompts × 8, prompt 64 +
/// response 20 tokens, 4 mini-batches of 32 rows, micro 32) against compute_log_prob on the same
/// rows (micro 64), split into forward, forward+backward, and optimizer steps.
#[test]
#[ignore = "measurement, not a check: run by name with --ignored --nocapture"]
fn time_update_against_compute_log_prob() {
    if let Some(t) = std::env::var("VERL_LEARNS_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        tch::set_num_threads(t);
    }
    eprintln!("torch threads: {}", tch::get_num_threads());
    let dir = quickstart_model();
    let (rows, pl, rl) = (128usize, 64usize, 20usize);
    let mut rng = 12345u64;
    let mut next = || {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        rng >> 33
    };
    let mut b = Batch::new();
    let p: Vec<i64> = (0..rows * pl).map(|_| 2 + (next() % 500) as i64).collect();
    let r: Vec<i64> = (0..rows * rl).map(|_| 2 + (next() % 500) as i64).collect();
    b.insert_tensor(col::PROMPTS, &[rows, pl], &p);
    b.insert_tensor(col::PROMPT_MASK, &[rows, pl], &vec![1i64; rows * pl]);
    b.insert_tensor(col::RESPONSES, &[rows, rl], &r);
    b.insert_tensor(col::RESPONSE_MASK, &[rows, rl], &vec![1i64; rows * rl]);
    let adv: Vec<f32> = (0..rows * rl)
        .map(|k| if (k / rl) % 2 == 0 { 1.0 } else { -1.0 })
        .collect();
    b.insert_tensor(col::ADVANTAGES, &[rows, rl], &adv);
    let make = |mini_prompts: usize, micro: usize, log_prob_micro: usize| {
        let c = json!({
            "trainer": {"device": "cpu"},
            "actor_rollout_ref": {
                "model": {"path": dir.path().to_str().unwrap()},
                "actor": {
                    "ppo_mini_batch_size": mini_prompts, "ppo_micro_batch_size_per_gpu": micro,
                    "optim": {"lr": 1e-4},
                    "fsdp_config": {"model_dtype": "fp32", "dtype": "fp32"},
                },
                "rollout": {"n": N, "log_prob_micro_batch_size_per_gpu": log_prob_micro},
            },
        });
        testing::actor::<FsdpPlugin>(&InitArgs::new(Role::Actor, c)).unwrap()
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let reps = 5;
    for (label, mini, micro, lpm) in [
        ("4 minis x micro 32", 4, 32, 64),
        ("1 mini x micro 32", 16, 32, 64),
        ("1 mini x micro 128", 16, 128, 32),
    ] {
        let mut a = make(mini, micro, lpm);
        let old = a.compute_log_prob(&b, &LogProbOptions::default()).unwrap();
        let mut batch = b.clone();
        batch.insert_tensor(col::OLD_LOG_PROBS, &[rows, rl], &f32s(&old, col::LOG_PROBS));
        let lp = median(
            (0..reps)
                .map(|_| {
                    ms(|| {
                        a.compute_log_prob(&b, &LogProbOptions::default()).unwrap();
                    })
                })
                .collect(),
        );
        let up = median(
            (0..reps)
                .map(|_| {
                    ms(|| {
                        a.update(&batch, &UpdateOptions::default()).unwrap();
                    })
                })
                .collect(),
        );
        eprintln!(
            "{label}: compute_log_prob (micro {lpm}) {lp:.1} ms, update {up:.1} ms ({:.1}x)",
            up / lp
        );
    }
    // The pieces, on the model itself: forward without grad, forward + backward, and the
    // clip + AdamW step, for one 32-row micro-batch.
    let mut model = Transformer::from_pretrained(dir.path(), &ModelOptions::default()).unwrap();
    model.set_requires_grad(true).unwrap();
    let ids = tch::Tensor::cat(
        &[
            tch::Tensor::from_slice(&p[..32 * pl]).view([32, pl as i64]),
            tch::Tensor::from_slice(&r[..32 * rl]).view([32, rl as i64]),
        ],
        1,
    );
    let fwd = median(
        (0..reps)
            .map(|_| {
                ms(|| {
                    drop(tch::no_grad(|| {
                        model.forward(&ids, None, None, None).unwrap()
                    }))
                })
            })
            .collect(),
    );
    let fb = median(
        (0..reps)
            .map(|_| {
                ms(|| {
                    let _ = model
                        .forward_backward(&ids, None, None, |out| {
                            Ok(out.log_softmax(-1, tch::Kind::Float).mean(tch::Kind::Float))
                        })
                        .unwrap();
                })
            })
            .collect(),
    );
    let params: Vec<tch::Tensor> = model
        .named_parameters()
        .iter()
        .map(|(_, p)| p.shallow_clone())
        .collect();
    let grads: Vec<tch::Tensor> = params.iter().map(|p| p.grad()).collect();
    let cfg: verl_backend_kit::config::OptimSection =
        serde_json::from_value(json!({"lr": 1e-4})).unwrap();
    let mut opt = verl_backend_kit::optim::AdamW::new(&cfg, "optim", &params).unwrap();
    let step = median(
        (0..reps)
            .map(|_| {
                ms(|| {
                    verl_backend_kit::optim::clip_grad_norm(&grads, 1.0).unwrap();
                    opt.step(&params, &grads, 1e-4).unwrap();
                })
            })
            .collect(),
    );
    eprintln!(
        "32 rows x {} tokens: forward (no grad) {fwd:.1} ms, forward+backward {fb:.1} ms, \
         clip+AdamW {step:.1} ms ({} tensors)",
        pl + rl,
        params.len()
    );
}
