//! The three roles through the plugin ABI adapters and the host-side contract checks
//! (`verl_plugin_api::testing`), on a tiny random Qwen2 model on CPU.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{json, Value};
use tch::{Kind, Tensor};
use verl_fsdp::FsdpPlugin;
use verl_nn::{HeadKind, ModelOptions, Transformer};
use verl_plugin_api::client::{ActorClient, CriticClient};
use verl_plugin_api::{
    col, testing, Batch, GenerateOptions, InitArgs, LogProbOptions, Role, UpdateOptions,
    ValueOptions,
};
use verl_test_support::model::{model_dir, qwen2_config};
use verl_test_support::{merge, Lcg};

const VOCAB: i64 = 48;

/// A random qwen2-shaped checkpoint (plus a stand-in tokenizer file) in a temp dir.
fn tiny_model() -> tempfile::TempDir {
    model_dir(
        qwen2_config(VOCAB, 32, 64, 2, 128, false),
        None,
        HeadKind::CausalLm,
    )
}

fn config(model: &Path, patch: Value) -> Value {
    let mut c = json!({
        "trainer": {"device": "cpu"},
        "actor_rollout_ref": {
            "model": {"path": model.to_str().unwrap()},
            "actor": {
                "ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 8, "ppo_epochs": 1,
                "grad_clip": 1.0,
                "optim": {"lr": 1e-3, "weight_decay": 0.01},
                "fsdp_config": {"model_dtype": "fp32", "dtype": "fp32"},
            },
            "rollout": {"n": 1, "temperature": 1.0},
            "ref": {"fsdp_config": {"dtype": "fp32"}},
        },
        "critic": {
            "ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 8,
            "optim": {"lr": 1e-2, "weight_decay": 0.0},
            "model": {"fsdp_config": {"model_dtype": "fp32", "dtype": "fp32"}},
        },
    });
    merge(&mut c, &patch);
    c
}

fn actor(model: &Path, patch: Value) -> ActorClient {
    testing::actor::<FsdpPlugin>(&InitArgs::new(Role::Actor, config(model, patch))).unwrap()
}

fn critic(model: &Path, patch: Value) -> CriticClient {
    testing::critic::<FsdpPlugin>(&InitArgs::new(Role::Critic, config(model, patch))).unwrap()
}

fn f32s(b: &Batch, name: &str) -> Vec<f32> {
    b.tensor::<f32>(name).unwrap().data
}

fn i64s(b: &Batch, name: &str) -> Vec<i64> {
    b.tensor::<i64>(name).unwrap().data
}

const PL: usize = 5;
const RL: usize = 6;

/// `rows` sequences with prompts of 2..=5 tokens (left-padded) and responses of 1..=6 tokens
/// (right-padded): unequal token counts, so micro-batch boundaries matter to a local normaliser.
fn sequences(rows: usize, seed: u64) -> Batch {
    let mut rng = Lcg(seed);
    let (mut p, mut pm, mut r, mut rm) = (vec![], vec![], vec![], vec![]);
    for _ in 0..rows {
        let plen = 2 + (rng.next() % 4) as usize;
        let rlen = 1 + (rng.next() % RL as u64) as usize;
        for j in 0..PL {
            let real = j >= PL - plen;
            p.push(if real {
                2 + (rng.next() % (VOCAB as u64 - 2)) as i64
            } else {
                0
            });
            pm.push(real as i64);
        }
        for j in 0..RL {
            let real = j < rlen;
            r.push(if real {
                2 + (rng.next() % (VOCAB as u64 - 2)) as i64
            } else {
                0
            });
            rm.push(real as i64);
        }
    }
    let mut b = Batch::new();
    b.insert_tensor(col::PROMPTS, &[rows, PL], &p);
    b.insert_tensor(col::PROMPT_MASK, &[rows, PL], &pm);
    b.insert_tensor(col::RESPONSES, &[rows, RL], &r);
    b.insert_tensor(col::RESPONSE_MASK, &[rows, RL], &rm);
    b
}

/// The update batch: `seqs` + old log-probs from `actor` + one advantage per row.
fn update_batch(actor: &mut ActorClient, seqs: &Batch, advantages: &[f32]) -> Batch {
    let rows = seqs.rows();
    let old = actor
        .compute_log_prob(seqs, &LogProbOptions::default())
        .unwrap();
    let mut b = seqs.clone();
    b.insert_tensor(col::OLD_LOG_PROBS, &[rows, RL], &f32s(&old, col::LOG_PROBS));
    let adv: Vec<f32> = advantages
        .iter()
        .flat_map(|&a| std::iter::repeat_n(a, RL))
        .collect();
    b.insert_tensor(col::ADVANTAGES, &[rows, RL], &adv);
    b
}

fn masked_row_sums(values: &[f32], mask: &[i64]) -> Vec<f64> {
    values
        .chunks(RL)
        .zip(mask.chunks(RL))
        .map(|(v, m)| {
            v.iter()
                .zip(m)
                .filter(|(_, &m)| m != 0)
                .map(|(&x, _)| x as f64)
                .sum()
        })
        .collect()
}

fn weights(actor: &mut ActorClient) -> (tempfile::TempDir, HashMap<String, Tensor>) {
    let dir = tempfile::tempdir().unwrap();
    actor.export_hf(dir.path()).unwrap();
    let w = Tensor::read_safetensors(dir.path().join("model.safetensors"))
        .unwrap()
        .into_iter()
        .collect();
    (dir, w)
}

fn max_weight_diff(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .map(|(k, t)| {
            (t.to_kind(Kind::Double) - b[k].to_kind(Kind::Double))
                .abs()
                .max()
                .double_value(&[])
        })
        .fold(0.0, f64::max)
}

fn metric(m: &[(String, f64)], name: &str) -> f64 {
    m.iter()
        .find(|(k, _)| k == name)
        .unwrap_or_else(|| panic!("metric {name} missing from {m:?}"))
        .1
}

#[test]
fn generate_then_compute_log_prob_reproduces_rollout_log_probs() {
    let dir = tiny_model();
    // Micro-batches of 3 rows so the log-prob pass is split unevenly.
    let mut a = actor(
        dir.path(),
        json!({"actor_rollout_ref": {"rollout": {"log_prob_micro_batch_size_per_gpu": 3}}}),
    );
    let prompts = testing::prompts(&[&[5, 6, 7, 8], &[9, 10], &[11, 12, 13]], 0);
    let opts = GenerateOptions {
        n: 2,
        max_new_tokens: 7,
        temperature: 0.8,
        seed: Some(3),
        eos_token_ids: vec![1],
        ..GenerateOptions::default()
    };
    let gen = a.generate(&prompts, &opts).unwrap();
    assert_eq!(gen.rows(), 6);
    assert_eq!(i64s(&gen, col::PROMPT_INDEX), vec![0, 0, 1, 1, 2, 2]);
    assert_eq!(gen.strings(col::FINISH_REASON).unwrap().len(), 6);
    // Same seed, same samples: generation is reproducible.
    let again = a.generate(&prompts, &opts).unwrap();
    assert_eq!(i64s(&gen, col::RESPONSES), i64s(&again, col::RESPONSES));

    let lp = a
        .compute_log_prob(
            &gen,
            &LogProbOptions {
                temperature: 0.8,
                with_entropy: true,
                ..LogProbOptions::default()
            },
        )
        .unwrap();
    let rollout = f32s(&gen, col::ROLLOUT_LOG_PROBS);
    let ours = f32s(&lp, col::LOG_PROBS);
    let mask = i64s(&gen, col::RESPONSE_MASK);
    let mut checked = 0;
    for i in 0..mask.len() {
        if mask[i] != 0 {
            assert!(
                (rollout[i] - ours[i]).abs() < 1e-5,
                "token {i}: rollout {} vs compute_log_prob {}",
                rollout[i],
                ours[i]
            );
            checked += 1;
        }
    }
    assert!(checked >= 6, "only {checked} response tokens");
    let ent = f32s(&lp, col::ENTROPY);
    assert!(ent.iter().all(|e| e.is_finite() && *e >= 0.0));
}

#[test]
fn update_raises_log_prob_of_positively_advantaged_responses() {
    let dir = tiny_model();
    let mut a = actor(
        dir.path(),
        json!({"actor_rollout_ref": {"actor": {"optim": {"lr": 1e-2}}}}),
    );
    let seqs = sequences(8, 1);
    let adv = [1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0];
    let batch = update_batch(&mut a, &seqs, &adv);
    let before = f32s(&batch, col::OLD_LOG_PROBS);
    let m = a
        .update(
            &batch,
            &UpdateOptions {
                global_step: 1,
                ..UpdateOptions::default()
            },
        )
        .unwrap();
    for name in [
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/grad_norm",
        "actor/lr",
    ] {
        assert!(metric(&m, name).is_finite(), "{name}: {m:?}");
    }
    assert_eq!(metric(&m, "actor/lr"), 1e-2);
    assert!(metric(&m, "actor/grad_norm") > 0.0);
    let after = f32s(
        &a.compute_log_prob(&seqs, &LogProbOptions::default())
            .unwrap(),
        col::LOG_PROBS,
    );
    let mask = i64s(&seqs, col::RESPONSE_MASK);
    let (b, f) = (
        masked_row_sums(&before, &mask),
        masked_row_sums(&after, &mask),
    );
    for (i, sign) in adv.iter().enumerate() {
        let delta = f[i] - b[i];
        assert!(
            delta * (*sign as f64) > 0.0,
            "row {i} (advantage {sign}): log-prob moved by {delta}"
        );
    }
}

#[test]
fn gradient_accumulation_does_not_depend_on_micro_batch_boundaries() {
    let dir = tiny_model();
    let seqs = sequences(8, 2);
    let adv = [0.5, -1.0, 2.0, 0.3, -0.7, 1.1, -0.2, 0.9];
    // AdamW is nearly invariant to a uniform gradient scale, so equal-sized micro-batches alone would
    // hide a per-micro-batch normaliser in the weights (the grad_norm check still sees it); the token
    // budget gives uneven micro-batches (every sequence here has at most 11 tokens), which cannot.
    let layouts = [
        json!({"ppo_micro_batch_size_per_gpu": 8}),
        json!({"use_dynamic_bsz": true, "ppo_max_token_len_per_gpu": 16}),
        json!({"ppo_micro_batch_size_per_gpu": 2}),
    ];
    let mut results = Vec::new();
    for (i, layout) in layouts.into_iter().enumerate() {
        // seq-mean-token-mean: the mode where a per-micro-batch normaliser is furthest off.
        let mut patch = json!({"loss_agg_mode": "seq-mean-token-mean", "ppo_epochs": 2});
        merge(&mut patch, &layout);
        // Activation checkpointing recomputes the forward: it must not change the result either.
        let checkpointing = i == 2;
        let mut a = actor(
            dir.path(),
            json!({"actor_rollout_ref": {"actor": patch,
                   "model": {"enable_gradient_checkpointing": checkpointing}}}),
        );
        let batch = update_batch(&mut a, &seqs, &adv);
        let m = a.update(&batch, &UpdateOptions::default()).unwrap();
        results.push((weights(&mut a), m));
    }
    let ((_, w0), m0) = &results[0];
    for ((_, w), m) in &results[1..] {
        let d = max_weight_diff(w0, w);
        assert!(d < 1e-5, "updated weights differ by {d}");
        for name in ["actor/pg_loss", "actor/grad_norm"] {
            let (x, y) = (metric(m0, name), metric(m, name));
            assert!((x - y).abs() < 1e-5 * (1.0 + x.abs()), "{name}: {x} vs {y}");
        }
    }
}

/// Mixed precision (bf16 compute, fp32 masters): each micro-batch's bf16 gradient goes into the
/// fp32 accumulators exactly once (a gradient left in `.grad` would be counted again by the next
/// micro-batch), so splitting the rows moves the update only by bf16 rounding.
#[test]
fn mixed_precision_gradient_accumulation_does_not_depend_on_micro_batch_boundaries() {
    let dir = tiny_model();
    let seqs = sequences(8, 2);
    let adv = [0.5, -1.0, 2.0, 0.3, -0.7, 1.1, -0.2, 0.9];
    let mut results = Vec::new();
    for micro in [8, 2] {
        let mut a = actor(
            dir.path(),
            json!({"actor_rollout_ref": {"actor": {
                "optim": {"lr": 1e-2},
                "fsdp_config": {"model_dtype": "fp32", "dtype": "bf16"},
                "ppo_micro_batch_size_per_gpu": micro,
            }}}),
        );
        let batch = update_batch(&mut a, &seqs, &adv);
        let m = a.update(&batch, &UpdateOptions::default()).unwrap();
        results.push(m);
    }
    for name in ["actor/pg_loss", "actor/grad_norm"] {
        let (x, y) = (metric(&results[0], name), metric(&results[1], name));
        assert!(
            (x - y).abs() < 1e-2 * x.abs().max(1e-3),
            "{name}: one micro-batch {x} vs four {y}"
        );
    }
}

#[test]
fn save_load_then_update_equals_uninterrupted_update() {
    let dir = tiny_model();
    let patch = json!({"actor_rollout_ref": {"actor": {
        "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2,
        "optim": {"lr_scheduler_type": "cosine", "lr_warmup_steps": 1, "total_training_steps": 4, "lr": 1e-2},
    }}});
    let seqs1 = sequences(8, 3);
    let seqs2 = sequences(8, 4);
    let adv = [1.0, -0.5, 0.2, 0.8, -1.0, 0.4, -0.3, 0.6];
    let ckpt = tempfile::tempdir().unwrap();

    let mut a = actor(dir.path(), patch.clone());
    let b1 = update_batch(&mut a, &seqs1, &adv);
    let m1 = a.update(&b1, &UpdateOptions::default()).unwrap();
    assert_eq!(metric(&m1, "actor/lr"), 0.0, "warmup step 0");
    a.save(ckpt.path()).unwrap();
    // Unseeded generation draws from the role's saved RNG state.
    let prompts = testing::prompts(&[&[5, 6, 7], &[8, 9]], 0);
    let unseeded = GenerateOptions {
        max_new_tokens: 5,
        ..GenerateOptions::default()
    };
    let g_a = a.generate(&prompts, &unseeded).unwrap();
    let b2 = update_batch(&mut a, &seqs2, &adv);
    let m2 = a.update(&b2, &UpdateOptions::default()).unwrap();
    let (_, wa) = weights(&mut a);

    let mut b = actor(dir.path(), patch);
    b.load(ckpt.path()).unwrap();
    let g_b = b.generate(&prompts, &unseeded).unwrap();
    assert_eq!(i64s(&g_a, col::RESPONSES), i64s(&g_b, col::RESPONSES));
    let b2_resumed = update_batch(&mut b, &seqs2, &adv);
    assert_eq!(
        f32s(&b2, col::OLD_LOG_PROBS),
        f32s(&b2_resumed, col::OLD_LOG_PROBS)
    );
    let m2_resumed = b.update(&b2_resumed, &UpdateOptions::default()).unwrap();
    let (_, wb) = weights(&mut b);
    assert_eq!(max_weight_diff(&wa, &wb), 0.0);
    assert_eq!(m2, m2_resumed);
    assert!(metric(&m2, "actor/lr") > 0.0);
}

#[test]
fn non_finite_advantages_fail_naming_the_metric_and_leave_weights_unchanged() {
    let dir = tiny_model();
    let mut a = actor(dir.path(), json!({}));
    let seqs = sequences(8, 5);
    let mut batch = update_batch(&mut a, &seqs, &[1.0; 8]);
    let mut adv = f32s(&batch, col::ADVANTAGES);
    adv[0] = f32::NAN;
    batch.insert_tensor(col::ADVANTAGES, &[8, RL], &adv);
    let (_, before) = weights(&mut a);
    let e = a
        .update(
            &batch,
            &UpdateOptions {
                global_step: 7,
                ..UpdateOptions::default()
            },
        )
        .unwrap_err();
    let msg = e.to_string();
    for part in [
        "actor/pg_loss",
        "not finite",
        "global step 7",
        "micro-batch 0",
        "weights are unchanged",
    ] {
        assert!(msg.contains(part), "`{part}` missing from: {msg}");
    }
    let (_, after) = weights(&mut a);
    assert_eq!(max_weight_diff(&before, &after), 0.0);
    // The actor still trains afterwards.
    let good = update_batch(&mut a, &seqs, &[1.0; 8]);
    a.update(&good, &UpdateOptions::default()).unwrap();
}

/// The update fetches every micro-batch's loss and metrics once, after the last is queued: a NaN in a
/// later micro-batch is still reported under that micro-batch's index, before any optimizer step.
#[test]
fn a_non_finite_later_micro_batch_is_named_and_leaves_weights_unchanged() {
    let dir = tiny_model();
    let mut a = actor(
        dir.path(),
        json!({"actor_rollout_ref": {"actor": {"ppo_micro_batch_size_per_gpu": 2}}}),
    );
    let seqs = sequences(8, 5);
    let mut batch = update_batch(&mut a, &seqs, &[1.0; 8]);
    let mut adv = f32s(&batch, col::ADVANTAGES);
    adv[5 * RL] = f32::NAN; // row 5, first response token: rows 4 and 5 are the third micro-batch
    batch.insert_tensor(col::ADVANTAGES, &[8, RL], &adv);
    let (_, before) = weights(&mut a);
    let msg = a
        .update(&batch, &UpdateOptions::default())
        .unwrap_err()
        .to_string();
    for part in ["actor/pg_loss", "not finite", "micro-batch 2"] {
        assert!(msg.contains(part), "`{part}` missing from: {msg}");
    }
    let (_, after) = weights(&mut a);
    assert_eq!(max_weight_diff(&before, &after), 0.0);
    let good = update_batch(&mut a, &seqs, &[1.0; 8]);
    a.update(&good, &UpdateOptions::default()).unwrap();
}

#[test]
fn reference_is_frozen_and_matches_the_initial_policy() {
    let dir = tiny_model();
    // The reference packs rows by a token budget; the actor scores the batch in one pass.
    let cfg = config(
        dir.path(),
        json!({"actor_rollout_ref": {"ref": {"log_prob_use_dynamic_bsz": true,
                                             "log_prob_max_token_len_per_gpu": 12}}}),
    );
    let mut r = testing::reference::<FsdpPlugin>(&InitArgs::new(Role::Reference, cfg)).unwrap();
    let mut a = actor(
        dir.path(),
        json!({"actor_rollout_ref": {"actor": {"optim": {"lr": 1e-2}}}}),
    );
    let seqs = sequences(5, 6);
    let ref_lp = f32s(
        &r.compute_log_prob(&seqs, &LogProbOptions::default())
            .unwrap(),
        col::LOG_PROBS,
    );
    let batch = update_batch(&mut a, &seqs, &[1.0, -1.0, 1.0, -1.0, 1.0]);
    let old = f32s(&batch, col::OLD_LOG_PROBS);
    let d = ref_lp
        .iter()
        .zip(&old)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(
        d < 1e-5,
        "reference and initial actor log-probs differ by {d}"
    );
    let mut with_ref = batch.clone();
    with_ref.insert_tensor(col::REF_LOG_PROBS, &[5, RL], &ref_lp);
    let e = r.update(&with_ref, &UpdateOptions::default()).unwrap_err();
    assert!(e.to_string().contains("frozen"), "{e}");
    a.update(&with_ref, &UpdateOptions::default()).unwrap();
    // The actor moved, the reference did not.
    let ref_after = f32s(
        &r.compute_log_prob(&seqs, &LogProbOptions::default())
            .unwrap(),
        col::LOG_PROBS,
    );
    assert_eq!(ref_lp, ref_after);
    let actor_after = f32s(
        &a.compute_log_prob(&seqs, &LogProbOptions::default())
            .unwrap(),
        col::LOG_PROBS,
    );
    assert_ne!(ref_lp, actor_after);
}

#[test]
fn kl_loss_and_entropy_metrics_with_their_inputs() {
    let dir = tiny_model();
    let mut a = actor(
        dir.path(),
        json!({"actor_rollout_ref": {"actor": {"use_kl_loss": true, "kl_loss_coef": 0.1,
               "entropy_coeff": 0.01, "ppo_micro_batch_size_per_gpu": 3}}}),
    );
    let seqs = sequences(8, 7);
    let mut batch = update_batch(&mut a, &seqs, &[1.0; 8]);
    let old = f32s(&batch, col::OLD_LOG_PROBS);
    let ref_lp: Vec<f32> = old.iter().map(|x| x - 0.1).collect();
    batch.insert_tensor(col::REF_LOG_PROBS, &[8, RL], &ref_lp);
    let m = a.update(&batch, &UpdateOptions::default()).unwrap();
    assert!(metric(&m, "actor/kl_loss") > 0.0, "{m:?}");
    assert!(metric(&m, "actor/entropy") > 0.0, "{m:?}");
    // Missing ref_log_prob with use_kl_loss names the input.
    let no_ref = update_batch(&mut a, &seqs, &[1.0; 8]);
    let e = a.update(&no_ref, &UpdateOptions::default()).unwrap_err();
    assert!(e.to_string().contains("ref_log_prob"), "{e}");
}

#[test]
fn bf16_compute_with_fp32_master_weights_trains_and_resumes() {
    let dir = tiny_model();
    let patch = json!({"actor_rollout_ref": {"actor": {
        "optim": {"lr": 1e-2},
        "fsdp_config": {"model_dtype": "fp32", "dtype": "bf16"},
        "ppo_micro_batch_size_per_gpu": 4,
    }}});
    let mut a = actor(dir.path(), patch.clone());
    let seqs = sequences(8, 8);
    let batch = update_batch(&mut a, &seqs, &[1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0]);
    let m = a.update(&batch, &UpdateOptions::default()).unwrap();
    assert!(metric(&m, "actor/grad_norm") > 0.0);
    let ckpt = tempfile::tempdir().unwrap();
    a.save(ckpt.path()).unwrap();
    assert!(ckpt.path().join("master.safetensors").is_file());
    let next = update_batch(&mut a, &seqs, &[1.0; 8]);
    let m2 = a.update(&next, &UpdateOptions::default()).unwrap();
    let mut b = actor(dir.path(), patch);
    b.load(ckpt.path()).unwrap();
    let m2b = b.update(&next, &UpdateOptions::default()).unwrap();
    assert_eq!(m2, m2b);
}

/// `steps` critic updates toward returns of 0.5 on every response token of `seqs` (8 rows),
/// checking the update's metrics; the value loss of each.
fn train_critic(c: &mut CriticClient, seqs: &Batch, steps: u64) -> Vec<f64> {
    let mask = i64s(seqs, col::RESPONSE_MASK);
    let returns: Vec<f32> = mask.iter().map(|&m| m as f32 * 0.5).collect();
    let mut losses = Vec::new();
    for step in 0..steps {
        let v = c.compute_values(seqs, &ValueOptions::default()).unwrap();
        let values = f32s(&v, col::VALUES);
        assert!(values.iter().zip(&mask).all(|(x, &m)| m != 0 || *x == 0.0));
        let mut batch = seqs.clone();
        batch.insert_tensor(col::VALUES, &[8, RL], &values);
        batch.insert_tensor(col::RETURNS, &[8, RL], &returns);
        let m = c
            .update(
                &batch,
                &UpdateOptions {
                    global_step: step,
                    ..UpdateOptions::default()
                },
            )
            .unwrap();
        for name in [
            "critic/vf_clipfrac",
            "critic/vpred_mean",
            "critic/grad_norm",
            "critic/lr",
        ] {
            assert!(metric(&m, name).is_finite(), "{name}: {m:?}");
        }
        losses.push(metric(&m, "critic/vf_loss"));
    }
    losses
}

#[test]
fn critic_update_reduces_value_loss() {
    let dir = tiny_model();
    let mut c = critic(
        dir.path(),
        json!({"critic": {"ppo_micro_batch_size_per_gpu": 3}}),
    );
    let seqs = sequences(8, 9);
    let losses = train_critic(&mut c, &seqs, 6);
    assert!(
        losses[5] < losses[0] * 0.5,
        "vf_loss did not fall: {losses:?}"
    );
    // Save / load round trip of the critic.
    let ckpt = tempfile::tempdir().unwrap();
    c.save(ckpt.path()).unwrap();
    let mut c2 = critic(
        dir.path(),
        json!({"critic": {"ppo_micro_batch_size_per_gpu": 3}}),
    );
    c2.load(ckpt.path()).unwrap();
    assert_eq!(
        f32s(
            &c.compute_values(&seqs, &ValueOptions::default()).unwrap(),
            col::VALUES
        ),
        f32s(
            &c2.compute_values(&seqs, &ValueOptions::default()).unwrap(),
            col::VALUES
        )
    );
}

#[test]
fn export_hf_loads_back_with_tokenizer_files() {
    let dir = tiny_model();
    let mut a = actor(
        dir.path(),
        json!({"actor_rollout_ref": {"actor": {"optim": {"lr": 1e-2}}}}),
    );
    let seqs = sequences(8, 10);
    let batch = update_batch(&mut a, &seqs, &[1.0; 8]);
    a.update(&batch, &UpdateOptions::default()).unwrap();
    let (out, _) = weights(&mut a);
    assert!(out.path().join("tokenizer_config.json").is_file());
    let loaded = Transformer::from_pretrained(
        out.path(),
        &ModelOptions {
            head: HeadKind::CausalLm,
            ..ModelOptions::default()
        },
    )
    .unwrap();
    assert_eq!(loaded.config().vocab_size, VOCAB);
    // A reference role on the exported folder scores like the trained actor.
    let cfg = config(out.path(), json!({}));
    let mut r = testing::reference::<FsdpPlugin>(&InitArgs::new(Role::Reference, cfg)).unwrap();
    let x = f32s(
        &r.compute_log_prob(&seqs, &LogProbOptions::default())
            .unwrap(),
        col::LOG_PROBS,
    );
    let y = f32s(
        &a.compute_log_prob(&seqs, &LogProbOptions::default())
            .unwrap(),
        col::LOG_PROBS,
    );
    let d = x
        .iter()
        .zip(&y)
        .map(|(p, q)| (p - q).abs())
        .fold(0.0f32, f32::max);
    assert!(d < 1e-5, "exported model differs by {d}");
    transformers_loads(out.path());
}

/// Optional: HF transformers loads the export (skipped when the venv lacks it).
fn transformers_loads(dir: &Path) {
    let py = std::env::var_os("VERL_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"));
    let has = std::process::Command::new(&py)
        .args(["-c", "import transformers"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !has {
        eprintln!(
            "SKIP: {} cannot import transformers; HF load of the export not checked",
            py.display()
        );
        return;
    }
    let out = std::process::Command::new(&py)
        .args([
            "-c",
            "import sys, transformers; m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]); print(type(m).__name__)",
            dir.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "transformers failed to load the export:\n{text}"
    );
    assert!(text.contains("Qwen2ForCausalLM"), "{text}");
}

#[test]
fn config_errors_name_the_key() {
    let dir = tiny_model();
    let bad = |patch: Value| {
        testing::actor::<FsdpPlugin>(&InitArgs::new(Role::Actor, config(dir.path(), patch)))
            .err()
            .expect("creation should fail")
            .to_string()
    };
    let e = bad(json!({"actor_rollout_ref": {"actor": {"fsdp_config": {"dtype": "int8"}}}}));
    assert!(
        e.contains("actor_rollout_ref.actor.fsdp_config.dtype"),
        "{e}"
    );
    let e = bad(json!({"trainer": {"device": "tpu"}}));
    assert!(e.contains("trainer.device"), "{e}");
    let e = bad(json!({"actor_rollout_ref": {"actor": {"optim": {"optimizer": "SGD"}}}}));
    assert!(e.contains("actor_rollout_ref.actor.optim.optimizer"), "{e}");
    // The cosine schedule needs the total step count: reported at the first update.
    let mut a = actor(
        dir.path(),
        json!({"actor_rollout_ref": {"actor": {"optim": {"lr_scheduler_type": "cosine"}}}}),
    );
    let seqs = sequences(4, 11);
    let batch = update_batch(&mut a, &seqs, &[1.0; 4]);
    let e = a.update(&batch, &UpdateOptions::default()).unwrap_err();
    assert!(e.to_string().contains("total_training_steps"), "{e}");
    // ... which the host can pass per call.
    a.update(
        &batch,
        &UpdateOptions {
            extra: json!({"total_training_steps": 10}),
            ..UpdateOptions::default()
        },
    )
    .unwrap();
}

#[test]
fn critic_values_are_read_at_the_positions_before_each_response_token() {
    let dir = tiny_model();
    let mut c = critic(
        dir.path(),
        json!({"critic": {"forward_micro_batch_size_per_gpu": 2}}),
    );
    let seqs = sequences(5, 12);
    let values = f32s(
        &c.compute_values(&seqs, &ValueOptions::default()).unwrap(),
        col::VALUES,
    );
    // The critic's weights, value head included, as saved.
    let ckpt = tempfile::tempdir().unwrap();
    c.save(ckpt.path()).unwrap();
    let model = Transformer::from_pretrained(
        ckpt.path().join("model"),
        &ModelOptions {
            head: HeadKind::Value,
            ..ModelOptions::default()
        },
    )
    .unwrap();
    let ids = Tensor::cat(
        &[
            Tensor::from_slice(&i64s(&seqs, col::PROMPTS)).view([5, PL as i64]),
            Tensor::from_slice(&i64s(&seqs, col::RESPONSES)).view([5, RL as i64]),
        ],
        1,
    );
    let mask = Tensor::cat(
        &[
            Tensor::from_slice(&i64s(&seqs, col::PROMPT_MASK)).view([5, PL as i64]),
            Tensor::from_slice(&i64s(&seqs, col::RESPONSE_MASK)).view([5, RL as i64]),
        ],
        1,
    );
    let out = tch::no_grad(|| model.forward(&ids, Some(&mask), None, None).unwrap());
    let rmask = i64s(&seqs, col::RESPONSE_MASK);
    for i in 0..5 {
        for j in 0..RL {
            let want = if rmask[i * RL + j] != 0 {
                out.double_value(&[i as i64, (PL - 1 + j) as i64])
            } else {
                0.0
            };
            let got = values[i * RL + j] as f64;
            assert!(
                (got - want).abs() < 1e-5,
                "row {i} token {j}: {got} vs {want}"
            );
        }
    }
}

/// LoRA: the actor trains its adapters only (the base weights stay bit for bit those of the
/// model folder), and its base model with the adapters off, asked for with
/// `LogProbOptions::base_model` (the reference policy of a LoRA job), is exactly a frozen
/// reference built from the same folder, before and after updates. An export merges.
#[test]
fn lora_actor_trains_its_adapters_and_its_base_is_the_reference() {
    let dir = tiny_model();
    let lora = json!({"actor_rollout_ref": {
        "model": {"lora_rank": 4, "lora_alpha": 8},
        "actor": {"optim": {"lr": 1e-2}},
    }});
    let mut a = actor(dir.path(), lora.clone());
    let mut r = testing::reference::<FsdpPlugin>(&InitArgs::new(
        Role::Reference,
        config(dir.path(), json!({})),
    ))
    .unwrap();
    let seqs = sequences(6, 9);
    let base_opts = LogProbOptions {
        base_model: true,
        ..LogProbOptions::default()
    };
    let lp = |c: &mut ActorClient, o: &LogProbOptions| {
        f32s(&c.compute_log_prob(&seqs, o).unwrap(), col::LOG_PROBS)
    };
    let reference = lp(&mut r, &LogProbOptions::default());
    assert_eq!(lp(&mut a, &base_opts), reference, "adapters off = the base");
    assert_eq!(
        lp(&mut a, &LogProbOptions::default()),
        reference,
        "fresh adapters (B = 0) leave the policy as it was"
    );
    for step in 1..=3 {
        let b = update_batch(&mut a, &seqs, &[1.0, -1.0, 1.0, -1.0, 1.0, -1.0]);
        a.update(
            &b,
            &UpdateOptions {
                global_step: step,
                ..UpdateOptions::default()
            },
        )
        .unwrap();
    }
    assert_ne!(
        lp(&mut a, &LogProbOptions::default()),
        reference,
        "the adapters trained"
    );
    assert_eq!(
        lp(&mut a, &base_opts),
        reference,
        "the base is still the reference"
    );
    assert_ne!(
        lp(&mut a, &LogProbOptions::default()),
        reference,
        "adapters back on after a base pass"
    );
    // Generation decodes with the adapters: its log-probs are the trained policy's.
    let prompts = testing::prompts(&[&[5, 6, 7, 8], &[9, 10]], 0);
    let opts = GenerateOptions {
        n: 2,
        max_new_tokens: 6,
        seed: Some(4),
        eos_token_ids: vec![1],
        ..GenerateOptions::default()
    };
    let gen = a.generate(&prompts, &opts).unwrap();
    let rollout = f32s(&gen, col::ROLLOUT_LOG_PROBS);
    let policy = f32s(
        &a.compute_log_prob(&gen, &LogProbOptions::default())
            .unwrap(),
        col::LOG_PROBS,
    );
    let base = f32s(
        &a.compute_log_prob(&gen, &base_opts).unwrap(),
        col::LOG_PROBS,
    );
    let mask = i64s(&gen, col::RESPONSE_MASK);
    let gap = |x: &[f32]| -> f32 {
        (0..mask.len())
            .filter(|&i| mask[i] != 0)
            .map(|i| (rollout[i] - x[i]).abs())
            .fold(0.0, f32::max)
    };
    assert!(
        gap(&policy) < 1e-5,
        "rollout vs the adapted policy: {}",
        gap(&policy)
    );
    assert!(
        gap(&base) > 1e-3,
        "the rollout used the adapters ({})",
        gap(&base)
    );

    // The checkpoint: base weights as in the model folder, adapters in PEFT's folder.
    let ckpt = tempfile::tempdir().unwrap();
    a.save(ckpt.path()).unwrap();
    let original: HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.path().join("model.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    let saved: HashMap<String, Tensor> =
        Tensor::read_safetensors(ckpt.path().join("model/model.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(
        max_weight_diff(&original, &saved),
        0.0,
        "the base weights are bit-identical"
    );
    let adapter = ckpt.path().join("lora_adapter");
    assert!(adapter.join("adapter_config.json").is_file());
    let tensors = Tensor::read_safetensors(adapter.join("adapter_model.safetensors")).unwrap();
    assert_eq!(
        tensors.len(),
        2 * 2 * 7,
        "A and B of 7 projections in 2 layers"
    );
    assert!(tensors
        .iter()
        .all(|(k, _)| k.starts_with("base_model.model.model.layers.")));
    // Resume into a fresh LoRA actor: the same policy.
    let mut back = actor(dir.path(), lora);
    back.load(ckpt.path()).unwrap();
    assert_eq!(
        lp(&mut back, &LogProbOptions::default()),
        lp(&mut a, &LogProbOptions::default())
    );

    // The HF export is the merged model (plus the adapter folder).
    let (export, merged) = weights(&mut a);
    assert!(export
        .path()
        .join("lora_adapter/adapter_model.safetensors")
        .is_file());
    assert!(
        max_weight_diff(&original, &merged) > 0.0,
        "merged projections moved"
    );
    assert_eq!(
        original["model.embed_tokens.weight"].size(),
        merged["model.embed_tokens.weight"].size()
    );

    // lora_adapter_path starts a new actor from the exported PEFT adapter: the trained policy.
    let adapter_dir = export.path().join("lora_adapter");
    let mut resumed = actor(
        dir.path(),
        json!({"actor_rollout_ref": {"model": {"lora_adapter_path": adapter_dir.to_str().unwrap()}}}),
    );
    assert_eq!(
        lp(&mut resumed, &LogProbOptions::default()),
        lp(&mut a, &LogProbOptions::default())
    );
    assert_eq!(lp(&mut resumed, &base_opts), reference);

    // No adapters: base_model is refused, not silently the policy.
    let mut plain = actor(dir.path(), json!({}));
    let e = plain
        .compute_log_prob(&seqs, &base_opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains("base_model") && e.contains("lora_rank"), "{e}");
    // A reference role of a LoRA job is refused: the actor is the reference.
    let e = testing::reference::<FsdpPlugin>(&InitArgs::new(
        Role::Reference,
        config(
            dir.path(),
            json!({"actor_rollout_ref": {"model": {"lora_rank": 4}}}),
        ),
    ))
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("base_model"), "{e}");
}

/// A LoRA critic (`critic.model.lora_rank`): its value loss falls, only the adapters and the value
/// head (trained in full, PEFT's modules_to_save) move, and a checkpoint restores it; its adapter
/// folder is PEFT's token-classification layout with the head beside the adapters.
#[test]
fn critic_lora_trains_its_adapters_and_value_head_only() {
    let dir = tiny_model();
    let patch = json!({"critic": {
        "ppo_micro_batch_size_per_gpu": 4,
        "model": {"lora_rank": 4, "lora_alpha": 8},
    }});
    let mut c = critic(dir.path(), patch.clone());
    let seqs = sequences(8, 9);
    let losses = train_critic(&mut c, &seqs, 6);
    assert!(
        losses[5] < losses[0] * 0.5,
        "vf_loss did not fall: {losses:?}"
    );
    let ckpt = tempfile::tempdir().unwrap();
    c.save(ckpt.path()).unwrap();
    let original: HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.path().join("model.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    let saved: HashMap<String, Tensor> =
        Tensor::read_safetensors(ckpt.path().join("model/model.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    for (name, t) in &saved {
        if name.starts_with("score.") {
            continue;
        }
        assert!(original[name].equal(t), "{name} moved");
    }
    let adapter = ckpt.path().join("lora_adapter");
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["task_type"], "TOKEN_CLS");
    assert_eq!(cfg["modules_to_save"], json!(["score"]));
    let keys: Vec<String> = Tensor::read_safetensors(adapter.join("adapter_model.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(
        keys.len(),
        2 * 2 * 7 + 2,
        "28 adapter matrices, the head's weight and bias: {keys:?}"
    );
    assert!(
        keys.contains(&"base_model.model.score.weight".to_string()),
        "{keys:?}"
    );
    let mut back = critic(dir.path(), patch);
    back.load(ckpt.path()).unwrap();
    assert_eq!(
        f32s(
            &c.compute_values(&seqs, &ValueOptions::default()).unwrap(),
            col::VALUES
        ),
        f32s(
            &back
                .compute_values(&seqs, &ValueOptions::default())
                .unwrap(),
            col::VALUES
        )
    );
    // critic.model.lora_adapter_path: a new critic from that folder (adapters and head) values
    // the rows as the trained one.
    let mut from_adapter = critic(
        dir.path(),
        json!({"critic": {"model": {"lora_adapter_path": adapter.to_str().unwrap()}}}),
    );
    assert_eq!(
        f32s(
            &c.compute_values(&seqs, &ValueOptions::default()).unwrap(),
            col::VALUES
        ),
        f32s(
            &from_adapter
                .compute_values(&seqs, &ValueOptions::default())
                .unwrap(),
            col::VALUES
        )
    );
}
