//! What the multi-rank tests share: a tiny random qwen2 checkpoint, job configs, ranks as threads
//! with a store on 127.0.0.1 (the CPU communicator), the step batches and the comparisons against
//! the one-rank FSDP reference.

// Each test binary uses a different subset.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde_json::{json, Value};
use tch::{Kind, Tensor};
use verl_nn::HeadKind;
use verl_plugin_api::client::ActorClient;
use verl_plugin_api::{col, Batch, LogProbOptions, UpdateOptions};
use verl_test_support::model::{model_dir, qwen2_config};
pub use verl_test_support::{merge, Lcg};

pub const VOCAB: i64 = 40;
pub const PL: usize = 4;
pub const RL: usize = 5;
pub const ROWS: usize = 8;
/// Multi-rank runs against one rank, fp32 on the CPU: the layouts sum in different orders, and
/// libtorch's CPU kernels do not fix that order across machines (or, with ranks as threads, across
/// runs). Three updates of the TP 2 × PP 2 layout differed from one rank by up to 1.7e-5 (weights,
/// values) on a 2-core AMD EPYC (AVX-512) box, varying run to run, and stayed under 1e-5 on
/// another; a real layout bug is off by the size of an update (1e-3 and up).
pub const TOL: f64 = 5e-5;

/// A random qwen2-shaped checkpoint: 4 heads / 2 KV heads / 40 MLP columns / 40 tokens, all
/// divisible by TP = 2.
pub fn tiny_model(tied: bool, head: HeadKind) -> tempfile::TempDir {
    tiny_model_with_layers(tied, head, 2)
}

/// [`tiny_model`] with `layers` decoder layers.
pub fn tiny_model_with_layers(tied: bool, head: HeadKind, layers: i64) -> tempfile::TempDir {
    model_dir(qwen2_config(VOCAB, 16, 40, layers, 64, tied), Some(5), head)
}

/// A random Mixtral-shaped checkpoint: the tiny model's attention with two decoder layers whose
/// MLPs are sparse MoE blocks of 4 experts (40 columns each, divisible by TP = 2), top-2 routing,
/// `router_aux_loss_coef` 0.02.
pub fn tiny_mixtral() -> tempfile::TempDir {
    let config = json!({
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
        "vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 40,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
        "tie_word_embeddings": false, "initializer_range": 0.2,
        "pad_token_id": 0, "eos_token_id": 1,
    });
    model_dir(config, Some(7), HeadKind::CausalLm)
}

/// One mini-batch of the whole global batch, one row per micro-batch, fp32 everywhere; the
/// Megatron sections say `tp` and whether the optimizer is distributed.
pub fn config(model: &Path, tp: u64, distributed: bool, patch: Value) -> Value {
    config_pp(model, tp, 1, distributed, patch)
}

/// [`config`] with `pp` pipeline stages.
pub fn config_pp(model: &Path, tp: u64, pp: u64, distributed: bool, patch: Value) -> Value {
    let mg = json!({"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                    "dtype": "fp32", "use_distributed_optimizer": distributed});
    let mut c = json!({
        "trainer": {"device": "cpu"},
        "actor_rollout_ref": {
            "model": {"path": model.to_str().unwrap()},
            "actor": {
                "ppo_mini_batch_size": ROWS, "ppo_micro_batch_size_per_gpu": 1, "ppo_epochs": 2,
                "grad_clip": 0.5, "calculate_entropy": true, "entropy_coeff": 0.01,
                "use_kl_loss": true, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl",
                "optim": {"lr": 2e-2, "weight_decay": 0.01},
                "fsdp_config": {"model_dtype": "fp32", "dtype": "fp32"},
                "megatron": mg.clone(),
            },
            "rollout": {"n": 1, "temperature": 1.0, "log_prob_micro_batch_size_per_gpu": 3},
            "ref": {"fsdp_config": {"dtype": "fp32"}},
        },
        "critic": {
            "ppo_mini_batch_size": ROWS, "ppo_micro_batch_size_per_gpu": 1, "ppo_epochs": 2,
            "grad_clip": 0.5,
            "optim": {"lr": 2e-2, "weight_decay": 0.0},
            "model": {"path": model.to_str().unwrap(),
                      "fsdp_config": {"model_dtype": "fp32", "dtype": "fp32"}},
            "megatron": mg,
        },
    });
    merge(&mut c, &patch);
    c
}

pub use verl_test_support::ranks::Job;

/// The global batch of one step: uneven prompt / response lengths, every update column.
pub fn global_batch(seed: u64) -> Batch {
    let mut rng = Lcg(seed);
    let (mut p, mut pm, mut r, mut rm) = (vec![], vec![], vec![], vec![]);
    let (mut old, mut refl, mut adv, mut val, mut ret) = (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..ROWS {
        let plen = 1 + (rng.next() % PL as u64) as usize;
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
        let a = rng.unit() * 2.0 - 1.0;
        for j in 0..RL {
            let real = j < rlen;
            r.push(if real {
                2 + (rng.next() % (VOCAB as u64 - 2)) as i64
            } else {
                0
            });
            rm.push(real as i64);
            old.push(-3.7 + (rng.unit() - 0.5) * 0.6);
            refl.push(-3.7 + (rng.unit() - 0.5) * 0.4);
            adv.push(a);
            val.push(rng.unit() - 0.5);
            ret.push(rng.unit() * 2.0 - 1.0);
        }
    }
    let mut b = Batch::new();
    b.insert_tensor(col::PROMPTS, &[ROWS, PL], &p);
    b.insert_tensor(col::PROMPT_MASK, &[ROWS, PL], &pm);
    b.insert_tensor(col::RESPONSES, &[ROWS, RL], &r);
    b.insert_tensor(col::RESPONSE_MASK, &[ROWS, RL], &rm);
    b.insert_tensor(col::OLD_LOG_PROBS, &[ROWS, RL], &old);
    b.insert_tensor(col::REF_LOG_PROBS, &[ROWS, RL], &refl);
    b.insert_tensor(col::ADVANTAGES, &[ROWS, RL], &adv);
    b.insert_tensor(col::VALUES, &[ROWS, RL], &val);
    b.insert_tensor(col::RETURNS, &[ROWS, RL], &ret);
    b
}

/// Data-parallel shard `rank` of `world` (contiguous rows); tensor-parallel peers get the same.
pub fn shard_rows(b: &Batch, rank: usize, world: usize) -> Batch {
    let n = b.rows() / world;
    let (start, end) = (rank * n, (rank + 1) * n);
    let mut out = Batch::new();
    for name in b.column_names() {
        if let Ok(t) = b.tensor::<i64>(name) {
            let w = t.cols();
            let data: Vec<i64> = (start..end).flat_map(|i| t.row(i).to_vec()).collect();
            out.insert_tensor(name, &[end - start, w], &data);
        } else {
            let t = b.tensor::<f32>(name).unwrap();
            let w = t.cols();
            let data: Vec<f32> = (start..end).flat_map(|i| t.row(i).to_vec()).collect();
            out.insert_tensor(name, &[end - start, w], &data);
        }
    }
    out
}

pub fn f32s(b: &Batch, name: &str) -> Vec<f32> {
    b.tensor::<f32>(name).unwrap().data
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}

pub type Metrics = BTreeMap<String, f64>;
pub type Weights = HashMap<String, Tensor>;

pub fn read_weights(dir: &Path) -> Weights {
    Tensor::read_safetensors(dir.join("model.safetensors"))
        .unwrap()
        .into_iter()
        .collect()
}

/// The parity tests' actor run on data-parallel rank `dp_rank` of `dp`: log-probs (with entropy)
/// of step 100's batch, three updates on batches 100..103, then log-probs of the last batch.
/// Returns `(per-step metrics, log-probs before, log-probs after)`.
pub fn three_updates(
    a: &mut ActorClient,
    dp_rank: usize,
    dp: usize,
) -> (Vec<Metrics>, Vec<f32>, Vec<f32>) {
    let opts = LogProbOptions {
        with_entropy: true,
        ..LogProbOptions::default()
    };
    let first = shard_rows(&global_batch(100), dp_rank, dp);
    let lp0 = f32s(&a.compute_log_prob(&first, &opts).unwrap(), col::LOG_PROBS);
    let mut metrics = Vec::new();
    let mut last = first;
    for step in 0..3 {
        let b = shard_rows(&global_batch(100 + step), dp_rank, dp);
        let m = a
            .update(
                &b,
                &UpdateOptions {
                    global_step: step + 1,
                    ..UpdateOptions::default()
                },
            )
            .unwrap();
        metrics.push(m.into_iter().collect());
        last = b;
    }
    let lp = f32s(&a.compute_log_prob(&last, &opts).unwrap(), col::LOG_PROBS);
    (metrics, lp0, lp)
}

pub fn export(actor: &mut ActorClient, rank: usize) -> Option<Weights> {
    let dir = tempfile::tempdir().unwrap();
    actor.export_hf(dir.path()).unwrap();
    (rank == 0).then(|| read_weights(dir.path()))
}

pub fn max_weight_diff(a: &Weights, b: &Weights) -> f64 {
    assert_eq!(
        a.keys().collect::<std::collections::BTreeSet<_>>(),
        b.keys().collect::<std::collections::BTreeSet<_>>()
    );
    a.iter()
        .map(|(k, t)| {
            (t.to_kind(Kind::Double) - b[k].to_kind(Kind::Double))
                .abs()
                .max()
                .double_value(&[])
        })
        .fold(0.0, f64::max)
}

pub fn assert_metrics_close(want: &Metrics, got: &Metrics, what: &str) {
    let skip = |k: &String| k.starts_with("perf/");
    assert_eq!(
        want.keys().filter(|k| !skip(k)).collect::<Vec<_>>(),
        got.keys().filter(|k| !skip(k)).collect::<Vec<_>>(),
        "{what}: metric names"
    );
    let off: Vec<String> = want
        .iter()
        .filter(|(k, _)| !skip(k))
        .filter(|(k, x)| (*x - got[*k]).abs() > TOL * (1.0 + x.abs()))
        .map(|(k, x)| format!("{k}: one rank {x}, megatron {}", got[k]))
        .collect();
    assert!(off.is_empty(), "{what}: {off:#?}");
}
