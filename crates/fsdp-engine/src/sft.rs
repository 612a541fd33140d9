//! Supervised fine-tuning on the actor's trainable model, reached through the ABI's extension
//! point: `Actor.call("sft_update", batch, options)` takes one optimizer step and
//! `Actor.call("sft_eval", batch, options)` measures the loss without training.
//!
//! The batch is the PPO update's sequence layout (`prompts`, `prompt_mask`, `responses`,
//! `response_mask`): the loss is the token-mean negative log-likelihood of the response tokens
//! only (verl's SFT trainer masks the prompt out of the loss), normalised by the step's global
//! token count so that micro-batching and gradient accumulation do not change the gradient.
//! Results come back in the returned batch's `meta` object (it has no columns).

use serde::Deserialize;
use tch::{Device, Tensor};
use verl_losses::{AggSpec, LossAggMode, LossScale, MaskCounts, Normaliser};
use verl_plugin_api::Batch;

use crate::forward::{response_logits, token_stats};
use crate::train::TrainableModel;
use verl_backend_kit::config::MicroBatching;
use verl_backend_kit::data::{index_tensor, micro_batches, Sequences};
use verl_backend_kit::dp::Dp;
use verl_backend_kit::error::{BackendError, Result, TorchContext};
use verl_backend_kit::update::StepAt;

pub const SFT_UPDATE: &str = "sft_update";
pub const SFT_EVAL: &str = "sft_eval";

/// Options of both calls (JSON), in verl's SFT trainer's terms.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftOptions {
    /// `data.micro_batch_size_per_gpu`: rows per forward/backward pass.
    pub micro_batch_size_per_gpu: usize,
    /// Optimizer steps of the whole run, for the LR schedule (warmup ratio, cosine decay).
    pub total_training_steps: Option<i64>,
    /// The host's step counter, for error messages.
    pub global_step: u64,
}

impl Default for SftOptions {
    fn default() -> Self {
        SftOptions {
            micro_batch_size_per_gpu: 4,
            total_training_steps: None,
            global_step: 0,
        }
    }
}

fn parse_options(method: &str, options: &serde_json::Value) -> Result<SftOptions> {
    let o: SftOptions = if options.is_null() {
        SftOptions::default()
    } else {
        serde_json::from_value(options.clone()).map_err(|e| {
            BackendError::config(
                format!("Actor.call(\"{method}\") options"),
                "{micro_batch_size_per_gpu, total_training_steps, global_step}",
                e,
            )
        })?
    };
    if o.micro_batch_size_per_gpu == 0 {
        return Err(BackendError::config(
            "data.micro_batch_size_per_gpu",
            "at least 1",
            0,
        ));
    }
    Ok(o)
}

/// The token-mean NLL of the response tokens of `seqs`, from the model's head output over the whole
/// sequence. Prompt positions are never read, so they receive no gradient.
pub fn response_nll(seqs: &Sequences, head_out: &Tensor, norm: &Normaliser) -> Result<Tensor> {
    let logits = response_logits(seqs, head_out, 1.0)?;
    let lp = verl_losses::logprobs_from_logits(&logits, &seqs.responses)?;
    let nll = lp.f_neg().ctx("negate log-probs")?;
    Ok(verl_losses::agg_loss(
        &nll,
        &seqs.response_mask,
        AggSpec::new(LossAggMode::TokenMean),
        norm,
    )?)
}

fn check_single_rank(dp: &Dp, method: &str) -> Result<()> {
    if dp.size == 1 {
        return Ok(());
    }
    Err(BackendError::config(
        "trainer.n_gpus_per_node × trainer.nnodes",
        format!("1 for Actor.call(\"{method}\") (SFT runs on one rank in this build)"),
        dp.size,
    ))
}

fn global_tokens(dp: &Dp, mask: &Tensor) -> Result<MaskCounts> {
    let local = MaskCounts::of_mask(mask)?;
    let mut c = [local.tokens, local.seqs];
    dp.all_reduce_sum(&mut c)?;
    Ok(MaskCounts {
        tokens: c[0],
        seqs: c[1],
    })
}

fn no_tokens(method: &str) -> BackendError {
    BackendError::Input {
        call: "Actor.call",
        column: verl_plugin_api::col::RESPONSE_MASK.into(),
        expected: format!("at least one response token for {method}"),
        found: "an all-zero mask".into(),
    }
}

fn meta_batch(values: &[(&str, f64)]) -> Batch {
    let mut b = Batch::new();
    let map: serde_json::Map<String, serde_json::Value> = values
        .iter()
        .map(|(k, v)| (k.to_string(), serde_json::json!(v)))
        .collect();
    b.set_meta(&map);
    b
}

/// One optimizer step on `batch`. Meta: `train/loss`, `train/lr` (the LR this step used),
/// `train/grad_norm` (before clipping), `train/tokens`.
pub fn update(
    train: &mut TrainableModel,
    dp: &Dp,
    device: Device,
    batch: &Batch,
    options: &serde_json::Value,
) -> Result<Batch> {
    check_single_rank(dp, SFT_UPDATE)?;
    let o = parse_options(SFT_UPDATE, options)?;
    let seqs = Sequences::from_batch(batch, "Actor.call(sft_update)", device)?;
    let counts = global_tokens(dp, &seqs.response_mask)?;
    if counts.tokens == 0.0 {
        return Err(no_tokens(SFT_UPDATE));
    }
    let norm = Normaliser::Global(LossScale::new(counts, 1));
    let lr = train.lr(o.total_training_steps)?;
    let rows: Vec<usize> = (0..seqs.rows()).collect();
    let lengths = seqs.row_lengths()?;
    let parts = micro_batches(
        &rows,
        &lengths,
        MicroBatching::Rows(o.micro_batch_size_per_gpu),
        "data.micro_batch_size_per_gpu",
    )?;
    train.zero_grad()?;
    let mut loss_sum = 0.0;
    for (ui, part) in parts.iter().enumerate() {
        let run = |train: &mut TrainableModel| -> Result<f64> {
            let idx = index_tensor(part, device)?;
            let sub = seqs.select(&idx)?;
            let (loss, ()) = train.forward_backward_with(
                dp,
                &sub.input_ids,
                Some(&sub.attention_mask),
                Some(&sub.position_ids),
                "SFT loss",
                |out| Ok((response_nll(&sub, out, &norm)?, ())),
            )?;
            let v = loss.f_double_value(&[]).ctx("SFT loss value")?;
            if !v.is_finite() {
                return Err(BackendError::NonFinite {
                    role: "actor",
                    step: o.global_step,
                    epoch: 0,
                    mini_batch: 0,
                    micro: format!(", micro-batch {ui}"),
                    metric: "train/loss".into(),
                    value: v,
                });
            }
            train.after_backward()?;
            Ok(v)
        };
        match run(train) {
            Ok(v) => loss_sum += v,
            Err(e) => {
                let _ = train.zero_grad();
                return Err(e);
            }
        }
    }
    let grad_norm = train.finish_mini_batch(
        dp,
        lr,
        StepAt {
            role: "actor",
            step: o.global_step,
            epoch: 0,
            mini_batch: 0,
        },
    )?;
    train.zero_grad()?;
    train.updates += 1;
    let mut loss = [loss_sum];
    dp.all_reduce_sum(&mut loss)?;
    Ok(meta_batch(&[
        ("train/loss", loss[0] / dp.size as f64),
        ("train/lr", lr),
        ("train/grad_norm", grad_norm),
        ("train/tokens", counts.tokens),
    ]))
}

/// The response NLL of `batch` without training. Meta: `nll_sum` and `tokens` (so the host can
/// average exactly over several batches) and `loss = nll_sum / tokens`.
pub fn eval(
    train: &mut TrainableModel,
    dp: &Dp,
    device: Device,
    batch: &Batch,
    options: &serde_json::Value,
) -> Result<Batch> {
    check_single_rank(dp, SFT_EVAL)?;
    let o = parse_options(SFT_EVAL, options)?;
    let seqs = Sequences::from_batch(batch, "Actor.call(sft_eval)", device)?;
    let counts = global_tokens(dp, &seqs.response_mask)?;
    if counts.tokens == 0.0 {
        return Err(no_tokens(SFT_EVAL));
    }
    let rows: Vec<usize> = (0..seqs.rows()).collect();
    let lengths = seqs.row_lengths()?;
    let parts = micro_batches(
        &rows,
        &lengths,
        MicroBatching::Rows(o.micro_batch_size_per_gpu),
        "data.micro_batch_size_per_gpu",
    )?;
    let nll_sum = train.with_full(dp, |model| {
        let mut sum = 0.0;
        for part in &parts {
            let idx = index_tensor(part, device)?;
            let sub = seqs.select(&idx)?;
            let (lp, _) = token_stats(model, &sub, 1.0, false)?;
            sum -= lp
                .f_mul(&sub.response_mask)
                .and_then(|x| x.f_sum(tch::Kind::Double))
                .and_then(|x| x.f_double_value(&[]))
                .ctx("masked NLL sum")?;
        }
        Ok(sum)
    })?;
    let mut s = [nll_sum];
    dp.all_reduce_sum(&mut s)?;
    Ok(meta_batch(&[
        ("nll_sum", s[0]),
        ("tokens", counts.tokens),
        ("loss", s[0] / counts.tokens),
    ]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tch::Kind;
    use verl_nn::{ModelConfig, ModelOptions, SaveOptions, Transformer};
    use verl_plugin_api::{col, testing, InitArgs, Role};

    const VOCAB: i64 = 40;

    fn tiny_model() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let cfg = ModelConfig::from_value(
            json!({
                "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
                "tie_word_embeddings": true, "initializer_range": 0.2,
                "pad_token_id": 0, "eos_token_id": 1,
            }),
            "inline/config.json",
        )
        .unwrap();
        let model = Transformer::new(cfg, &ModelOptions::default()).unwrap();
        model
            .save_pretrained(dir.path(), &SaveOptions::default())
            .unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), "{}\n").unwrap();
        dir
    }

    fn actor(model: &std::path::Path) -> verl_plugin_api::client::ActorClient {
        let cfg = json!({
            "trainer": {"device": "cpu"},
            "actor_rollout_ref": {
                "model": {"path": model.to_str().unwrap()},
                "actor": {
                    "ppo_mini_batch_size": 1, "grad_clip": 1.0,
                    "optim": {"lr": 1e-2, "weight_decay": 0.0},
                    "fsdp_config": {"model_dtype": "fp32", "dtype": "fp32"},
                },
            },
        });
        testing::actor::<crate::FsdpPlugin>(&InitArgs::new(Role::Actor, cfg)).unwrap()
    }

    /// Three rows: left-padded prompts of 3..5 tokens, right-padded responses of 2..4 tokens.
    fn batch() -> Batch {
        let prompts: [&[i64]; 3] = [&[5, 6, 7], &[8, 9, 10, 11], &[12, 13, 14, 15, 16]];
        let responses: [&[i64]; 3] = [&[20, 21, 1], &[22, 23, 24, 1], &[25, 1]];
        let (pw, rw) = (5, 4);
        let mut b = Batch::new();
        let (mut p, mut pm, mut r, mut rm) = (vec![], vec![], vec![], vec![]);
        for (pr, rs) in prompts.iter().zip(responses) {
            for i in 0..pw {
                let k = i as isize - (pw - pr.len()) as isize;
                p.push(if k >= 0 { pr[k as usize] } else { 0 });
                pm.push(i64::from(k >= 0));
            }
            for i in 0..rw {
                r.push(rs.get(i).copied().unwrap_or(0));
                rm.push(i64::from(i < rs.len()));
            }
        }
        b.insert_tensor(col::PROMPTS, &[3, pw], &p);
        b.insert_tensor(col::PROMPT_MASK, &[3, pw], &pm);
        b.insert_tensor(col::RESPONSES, &[3, rw], &r);
        b.insert_tensor(col::RESPONSE_MASK, &[3, rw], &rm);
        b
    }

    fn meta(b: &Batch, k: &str) -> f64 {
        b.meta()[k].as_f64().unwrap()
    }

    #[test]
    fn loss_falls_on_a_fixed_batch_and_eval_agrees_with_the_step_loss() {
        let dir = tiny_model();
        let mut a = actor(dir.path());
        let b = batch();
        let opts = json!({"micro_batch_size_per_gpu": 2, "total_training_steps": 30});
        let before = a.call(SFT_EVAL, &b, &opts).unwrap();
        assert_eq!(meta(&before, "tokens"), 9.0);
        let first = a.call(SFT_UPDATE, &b, &opts).unwrap();
        // The first step's loss is measured before its update: the eval of the same weights.
        assert!(
            (meta(&first, "train/loss") - meta(&before, "loss")).abs() < 1e-4,
            "{:?} vs {:?}",
            first.meta(),
            before.meta()
        );
        assert_eq!(meta(&first, "train/lr"), 1e-2);
        let mut last = 0.0;
        for _ in 0..25 {
            last = meta(&a.call(SFT_UPDATE, &b, &opts).unwrap(), "train/loss");
        }
        let after = meta(&a.call(SFT_EVAL, &b, &opts).unwrap(), "loss");
        assert!(
            after < 0.3 * meta(&before, "loss") && last < meta(&first, "train/loss"),
            "before {} after {after} (last step {last})",
            meta(&before, "loss")
        );
    }

    #[test]
    fn micro_batching_does_not_change_the_loss() {
        let dir = tiny_model();
        let b = batch();
        let losses: Vec<f64> = [1, 3]
            .iter()
            .map(|m| {
                let mut a = actor(dir.path());
                let o = json!({"micro_batch_size_per_gpu": m});
                a.call(SFT_UPDATE, &b, &o).unwrap();
                meta(&a.call(SFT_EVAL, &b, &o).unwrap(), "loss")
            })
            .collect();
        assert!((losses[0] - losses[1]).abs() < 1e-5, "{losses:?}");
    }

    #[test]
    fn prompt_positions_get_no_gradient() {
        let mut b = batch();
        let seqs = Sequences::from_batch(&b, "test", Device::Cpu).unwrap();
        let t = seqs.prompt_len + seqs.response_len;
        let logits =
            Tensor::randn([3, t, VOCAB], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let counts = MaskCounts::of_mask(&seqs.response_mask).unwrap();
        let norm = Normaliser::Global(LossScale::new(counts, 1));
        response_nll(&seqs, &logits, &norm).unwrap().backward();
        let g = logits.grad().abs().sum_dim_intlist(2, false, Kind::Float);
        // Position P-1+j predicts response token j; positions before P-1 are prompt-only.
        let prompt_part = g
            .narrow(1, 0, seqs.prompt_len - 1)
            .sum(Kind::Float)
            .double_value(&[]);
        assert_eq!(prompt_part, 0.0);
        // Padding after a response's end is masked out too (row 2 has 2 of 4 response tokens).
        let pad = g
            .get(2)
            .narrow(0, seqs.prompt_len - 1 + 2, 2)
            .sum(Kind::Float)
            .double_value(&[]);
        assert_eq!(pad, 0.0);
        let resp = g
            .narrow(1, seqs.prompt_len - 1, 2)
            .sum(Kind::Float)
            .double_value(&[]);
        assert!(resp > 0.0);
        // An all-masked batch is an error naming the column.
        let zeros = vec![0i64; 12];
        b.insert_tensor(col::RESPONSE_MASK, &[3, 4], &zeros);
        let dir = tiny_model();
        let e = actor(dir.path())
            .call(SFT_UPDATE, &b, &json!(null))
            .unwrap_err();
        assert!(e.to_string().contains("response_mask"), "{e}");
    }

    #[test]
    fn unknown_option_names_the_call() {
        let dir = tiny_model();
        let e = actor(dir.path())
            .call(SFT_UPDATE, &batch(), &json!({"micro_batch": 2}))
            .unwrap_err();
        assert!(e.to_string().contains("sft_update"), "{e}");
    }
}
