//! The fast paths against the plain ones, fp32 on CPU: chunked LM head over selected positions vs
//! full `[rows, T, vocab]` logits, unpadded rows vs padded ones, surrogate backward vs the
//! full-logits backward, and the generation engine's configuration.

use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};
use verl_backend_kit::budget::kv_budget;
use verl_backend_kit::config::RolloutEngineSection;
use verl_backend_kit::data::Sequences;
use verl_fsdp::actor::{actor_micro_batch_loss, MicroBatchLoss};
use verl_fsdp::forward::{layout_token_stats, layout_values, response_logits};
use verl_fsdp::packing::{Padding, RowLayout};
use verl_fsdp::FsdpPlugin;
use verl_losses::{
    entropy_from_logits, logprobs_from_logits, ActorInputs, ActorLoss, ActorLossConfig, LossScale,
    MaskCounts, Normaliser,
};
use verl_nn::{HeadKind, ModelConfig, ModelOptions, SaveOptions, Transformer};
use verl_plugin_api::{
    col, testing, Batch, GenerateOptions, InitArgs, LogProbOptions, Role, UpdateOptions,
};
use verl_test_support::cuda::cuda_device;
use verl_test_support::{merge, Lcg};

const VOCAB: i64 = 40;
const PL: usize = 6;
const RL: usize = 7;
const TEMPERATURE: f64 = 0.7;

fn config(tied: bool) -> ModelConfig {
    ModelConfig::from_value(
        json!({
            "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 128,
            "tie_word_embeddings": tied, "initializer_range": 0.3,
            "pad_token_id": 0, "eos_token_id": 1,
        }),
        "inline/config.json",
    )
    .unwrap()
}

fn model(tied: bool, head: HeadKind, seed: i64) -> Transformer {
    tch::manual_seed(seed);
    Transformer::new(
        config(tied),
        &ModelOptions {
            head,
            ..ModelOptions::default()
        },
    )
    .unwrap()
}

/// Left-padded prompts of 1..=6 tokens and right-padded responses of 0..=7 tokens (row 0 has a
/// full prompt and a full response, row 1 an empty response).
fn batch(rows: usize, seed: u64) -> Batch {
    let mut rng = Lcg(seed);
    let (mut p, mut pm, mut r, mut rm) = (vec![], vec![], vec![], vec![]);
    for i in 0..rows {
        let plen = if i == 0 {
            PL
        } else {
            1 + (rng.next() % PL as u64) as usize
        };
        let rlen = match i {
            0 => RL,
            1 => 0,
            _ => (rng.next() % (RL as u64 + 1)) as usize,
        };
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

/// `b` with the prompt (ids and mask) of each group of `n` consecutive rows set to the group's
/// first row's: GRPO's samples of one prompt.
fn share_prompts(b: &Batch, n: usize) -> Batch {
    let mut out = b.clone();
    for name in [col::PROMPTS, col::PROMPT_MASK] {
        let t = b.tensor::<i64>(name).unwrap();
        let data: Vec<i64> = (0..b.rows())
            .flat_map(|i| t.row(i - i % n).to_vec())
            .collect();
        out.insert_tensor(name, &[b.rows(), PL], &data);
    }
    out
}

fn seqs(b: &Batch) -> Sequences {
    Sequences::from_batch(b, "test", Device::Cpu).unwrap()
}

/// Largest `|a - b| / max(1, |b|)`: 1e-6 is a few fp32 ulps at the magnitudes here (|log p| ≈ 10
/// has an ulp of 1e-6), so it allows summation-order differences and nothing else.
fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    let scale = b.abs().clamp_min(1.0);
    ((a - b).abs() / scale).max().double_value(&[])
}

/// The reference: full logits of the (trimmed) padded micro-batch, fp32, every response position.
fn full_logit_stats(m: &Transformer, s: &Sequences, rows: &[usize]) -> (Tensor, Tensor) {
    let idx = Tensor::from_slice(&rows.iter().map(|&r| r as i64).collect::<Vec<_>>());
    let sub = s.select(&idx).unwrap();
    let _g = tch::no_grad_guard();
    let out = m
        .forward(
            &sub.input_ids,
            Some(&sub.attention_mask),
            Some(&sub.position_ids),
            None,
        )
        .unwrap();
    let logits = response_logits(&sub, &out, TEMPERATURE).unwrap();
    (
        logprobs_from_logits(&logits, &sub.responses).unwrap(),
        entropy_from_logits(&logits).unwrap(),
    )
}

#[test]
fn chunked_log_probs_and_entropy_equal_full_logits_padded_or_not() {
    let b = batch(9, 7);
    let s = seqs(&b);
    let rows: Vec<usize> = vec![0, 2, 3, 1, 5, 8];
    for tied in [false, true] {
        let m = model(tied, HeadKind::CausalLm, 11);
        let (want_lp, want_ent) = full_logit_stats(&m, &s, &rows);
        let idx = Tensor::from_slice(&rows.iter().map(|&r| r as i64).collect::<Vec<_>>());
        let mask = s.response_mask.index_select(0, &idx);
        for chunk in [1, 5, 4096] {
            // Keep: every response position, equal to the full logits everywhere.
            let keep = RowLayout::new(&s, &rows, Padding::Keep).unwrap();
            let (lp, ent) = layout_token_stats(&m, &keep, TEMPERATURE, true, chunk).unwrap();
            let d = max_diff(&lp, &want_lp);
            assert!(
                d < 1e-6,
                "tied {tied} chunk {chunk}: log-probs differ by {d}"
            );
            // Entropy sums p·log p over the vocabulary in a different order per layout: a few
            // fp32 ulps apart (1.3e-6 at 2.01 on a 2-core AVX-512 box).
            let d = max_diff(&ent.unwrap(), &want_ent);
            assert!(
                d < 5e-6,
                "tied {tied} chunk {chunk}: entropy differs by {d}"
            );
            // Remove: equal at real response tokens, 0 elsewhere, over shorter rows.
            let rm = RowLayout::new(&s, &rows, Padding::Remove).unwrap();
            assert!(rm.positions() <= keep.positions());
            assert_eq!(
                rm.selected() as f64,
                mask.sum(Kind::Float).double_value(&[])
            );
            let (lp, ent) = layout_token_stats(&m, &rm, TEMPERATURE, true, chunk).unwrap();
            // Shorter rows change the GEMMs' shapes, so the CPU kernels may block (and round) the
            // sums differently: a few ulps at |log p| ≈ 10 (seen above 1e-6 with two test threads
            // sharing the cores). A misplaced position would be off by O(1).
            let d = max_diff(&lp, &(&want_lp * &mask));
            assert!(
                d < 5e-6,
                "tied {tied} chunk {chunk}, unpadded: log-probs differ by {d}"
            );
            let d = max_diff(&ent.unwrap(), &(&want_ent * &mask));
            assert!(
                d < 5e-6,
                "tied {tied} chunk {chunk}, unpadded: entropy differs by {d}"
            );
            assert_eq!(lp.size(), vec![rows.len() as i64, RL as i64]);
        }
    }
}

/// Shared prompts: the same log-probs and entropy as the unpadded layout, from a stream that holds
/// each prompt once (groups of 3, some split by the row choice, one with an empty response).
#[test]
fn shared_prompt_layout_equals_the_unpadded_one() {
    let b = share_prompts(&batch(9, 7), 3);
    let s = seqs(&b);
    let lengths = s.row_lengths().unwrap();
    let pmask = b.tensor::<i64>(col::PROMPT_MASK).unwrap();
    let rmask = b.tensor::<i64>(col::RESPONSE_MASK).unwrap();
    for rows in [
        vec![0, 1, 2, 3, 4, 5, 6, 7, 8],
        vec![0, 1, 2, 4, 5, 8],
        vec![1],
    ] {
        let rm = RowLayout::new(&s, &rows, Padding::Remove).unwrap();
        let sh = RowLayout::new(&s, &rows, Padding::SharedPrompt).unwrap();
        // Stream: each group's prompt once (at least one column), each row's response tokens.
        let mut groups: Vec<usize> = rows.iter().map(|&r| r / 3).collect();
        groups.dedup();
        let prompts: i64 = groups
            .iter()
            .map(|&g| pmask.row(3 * g).iter().sum::<i64>().max(1))
            .sum();
        let responses: i64 = rows.iter().map(|&r| rmask.row(r).iter().sum::<i64>()).sum();
        assert_eq!(
            sh.input_ids.size(),
            vec![1, prompts + responses],
            "rows {rows:?}"
        );
        let unshared: i64 = rows
            .iter()
            .map(|&r| lengths[r].max(pmask.row(r).iter().sum::<i64>() + 1))
            .sum();
        assert!(sh.positions() <= unshared);
        if rows.len() > 3 {
            assert!(
                sh.positions() < rm.positions(),
                "sharing should save tokens"
            );
        }
        assert_eq!(sh.selected(), rm.selected());
        for tied in [false, true] {
            let m = model(tied, HeadKind::CausalLm, 11);
            for chunk in [2, 4096] {
                let (want_lp, want_ent) =
                    layout_token_stats(&m, &rm, TEMPERATURE, true, chunk).unwrap();
                let (lp, ent) = layout_token_stats(&m, &sh, TEMPERATURE, true, chunk).unwrap();
                let what = format!("rows {rows:?} tied {tied} chunk {chunk}");
                let d = max_diff(&lp, &want_lp);
                assert!(d < 1e-6, "{what}: log-probs differ by {d}");
                let d = max_diff(&ent.unwrap(), &want_ent.unwrap());
                assert!(d < 5e-6, "{what}: entropy differs by {d}");
            }
        }
    }
}

#[test]
fn unpadded_rows_are_as_long_as_the_longest_real_row() {
    let b = batch(6, 3);
    let s = seqs(&b);
    let lengths = s.row_lengths().unwrap();
    let rows = vec![1, 2, 4];
    let rm = RowLayout::new(&s, &rows, Padding::Remove).unwrap();
    let longest = rows.iter().map(|&r| lengths[r]).max().unwrap();
    // At least one prompt column stays (it predicts the first response token).
    assert_eq!(rm.input_ids.size()[1], longest);
    assert_eq!(
        rm.attention_mask.sum(Kind::Int64).int64_value(&[]),
        rows.iter().map(|&r| lengths[r]).sum::<i64>()
    );
}

#[test]
fn critic_values_unpadded_equal_padded_at_real_tokens() {
    let b = batch(7, 5);
    let s = seqs(&b);
    let m = model(false, HeadKind::Value, 3);
    let rows: Vec<usize> = (0..7).collect();
    let keep = layout_values(&m, &RowLayout::new(&s, &rows, Padding::Keep).unwrap()).unwrap();
    let rm = layout_values(&m, &RowLayout::new(&s, &rows, Padding::Remove).unwrap()).unwrap();
    // Reference: verl's values[:, -R-1:-1] of the full padded batch.
    let out = tch::no_grad(|| {
        m.forward(
            &s.input_ids,
            Some(&s.attention_mask),
            Some(&s.position_ids),
            None,
        )
        .unwrap()
    });
    let want = s.response_slice(&out).unwrap();
    // A few fp32 ulps: the CPU GEMMs of differently shaped batches sum in different orders, and
    // how they block can change with the threads the BLAS picks under load (2e-6 was seen with
    // the tests of this binary running in parallel on a many-core box).
    assert!(max_diff(&keep, &want) < 5e-6);
    assert!(max_diff(&rm, &(&want * &s.response_mask)) < 5e-6);
}

fn actor_loss() -> ActorLoss {
    let cfg: ActorLossConfig = serde_json::from_value(json!({
        "clip_ratio": 0.1, "entropy_coeff": 0.01, "use_kl_loss": true,
        "kl_loss_coef": 0.05, "kl_loss_type": "low_var_kl", "loss_agg_mode": "seq-mean-token-mean",
    }))
    .unwrap();
    ActorLoss::from_config(&cfg).unwrap()
}

fn grads(m: &Transformer) -> Vec<(String, Tensor)> {
    m.named_parameters()
        .iter()
        .map(|(n, p)| {
            let g = p.grad();
            let g = if g.defined() {
                g.copy()
            } else {
                p.zeros_like()
            };
            (n.clone(), g)
        })
        .collect()
}

fn zero_grads(m: &Transformer) {
    for (_, p) in m.named_parameters() {
        let mut g = p.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
}

/// Off-policy inputs so the ratio is not 1 and some tokens clip.
fn update_inputs(s: &Sequences, rows: &[usize]) -> (Tensor, Tensor, Tensor) {
    let idx = Tensor::from_slice(&rows.iter().map(|&r| r as i64).collect::<Vec<_>>());
    let n = rows.len() as i64;
    tch::manual_seed(5);
    let old = Tensor::randn([n, RL as i64], (Kind::Float, Device::Cpu)) * 0.3 - 3.5;
    let adv = Tensor::randn([n, RL as i64], (Kind::Float, Device::Cpu));
    let reference = Tensor::randn([n, RL as i64], (Kind::Float, Device::Cpu)) * 0.3 - 3.5;
    let mask = s.response_mask.index_select(0, &idx);
    // Callers hand 0 at padding (verl's old log-probs with remove-padding).
    (&old * &mask, adv, &reference * &mask)
}

#[test]
fn surrogate_backward_equals_full_logits_backward() {
    // Pairs share a prompt: rows 0-1 and 6-7 share theirs here, 3 and 4 are alone.
    let b = share_prompts(&batch(8, 21), 2);
    let s = seqs(&b);
    let rows: Vec<usize> = vec![0, 1, 3, 4, 6, 7];
    let loss = actor_loss();
    let (old, adv, reference) = update_inputs(&s, &rows);
    let idx = Tensor::from_slice(&rows.iter().map(|&r| r as i64).collect::<Vec<_>>());
    let mask = s.response_mask.index_select(0, &idx);
    let norm = Normaliser::Global(LossScale::new(MaskCounts::of_mask(&mask).unwrap(), 1));
    for (tied, checkpointing) in [(false, false), (true, false), (true, true)] {
        let mut m = model(tied, HeadKind::CausalLm, 17);
        m.set_activation_checkpointing(checkpointing);
        // Today's path: full logits of the padded micro-batch through `forward_backward`.
        let sub = s.select(&idx).unwrap();
        let mut want_metrics = None;
        let want_loss = m
            .forward_backward(
                &sub.input_ids,
                Some(&sub.attention_mask),
                Some(&sub.position_ids),
                |out| {
                    let logits = response_logits(&sub, out, TEMPERATURE).unwrap();
                    let lp = logprobs_from_logits(&logits, &sub.responses).unwrap();
                    let ent = entropy_from_logits(&logits).unwrap();
                    let o = loss
                        .compute(
                            &ActorInputs {
                                old_log_prob: &old,
                                log_prob: &lp,
                                advantages: &adv,
                                response_mask: &sub.response_mask,
                                entropy: Some(&ent),
                                ref_log_prob: Some(&reference),
                                rollout_is_weights: None,
                            },
                            &norm,
                        )
                        .unwrap();
                    want_metrics = Some(o.metrics);
                    Ok(o.loss)
                },
            )
            .unwrap()
            .double_value(&[]);
        let want = grads(&m);
        let want_metrics = want_metrics.unwrap();
        for padding in [Padding::Keep, Padding::Remove, Padding::SharedPrompt] {
            for chunk in [3, 4096] {
                zero_grads(&m);
                let layout = RowLayout::new(&s, &rows, padding).unwrap();
                let weight = m.lm_head_weight().unwrap().shallow_clone();
                let mut got_metrics = None;
                let got_loss = layout_forward_backward(&m, &layout, |hidden| {
                    let (l, metrics) = actor_micro_batch_loss(
                        &layout,
                        hidden,
                        &weight,
                        &MicroBatchLoss {
                            loss: &loss,
                            norm: &norm,
                            old: &old,
                            advantages: &adv,
                            ref_log_prob: Some(&reference),
                            rollout_is_weights: None,
                            on_policy: false,
                            dummy: false,
                            need_entropy: true,
                            temperature: TEMPERATURE,
                            chunk_tokens: chunk,
                            kept_logits_bytes: 0,
                        },
                    )
                    .unwrap();
                    got_metrics = Some(metrics.resolve().unwrap());
                    Ok(l)
                })
                .unwrap()
                .double_value(&[]);
                let what = format!("tied {tied} ckpt {checkpointing} {padding:?} chunk {chunk}");
                assert!(
                    (got_loss - want_loss).abs() < 1e-6,
                    "{what}: loss {got_loss} vs {want_loss}"
                );
                for (k, v) in &want_metrics {
                    let g = got_metrics.as_ref().unwrap()[k];
                    assert!((g - v).abs() < 1e-6, "{what}: {k} {g} vs {v}");
                }
                let mut worst = 0.0f64;
                for ((n, g), (_, w)) in grads(&m).iter().zip(&want) {
                    // A shared prompt's embedding rows sum several rows' contributions, in an
                    // order that depends on the layout: a few fp32 ulps (1.3e-6 seen).
                    let d = max_diff(g, w);
                    assert!(d < 5e-6, "{what}: gradient of {n} differs by {d}");
                    worst = worst.max(w.abs().max().double_value(&[]));
                }
                assert!(
                    worst > 1e-3,
                    "{what}: gradients should not be trivially zero"
                );
            }
        }
        zero_grads(&m);
    }
}

/// On a GPU in bf16 under gradient-accumulation fusion, two micro-batches: the LM head's weight
/// gradient taken in the backward as one product GEMM into `.grad` (every chunk's logits kept)
/// against the chunked path (nothing kept: a GEMM per chunk into an fp32 buffer, added into
/// `.grad`), both against an fp32 run of the same weights. Tied and untied heads. Needs
/// CUDA (`make test-gpu`).
#[test]
#[ignore = "needs CUDA"]
fn lm_head_product_backward_matches_the_chunked_one_on_cuda() {
    let dev = cuda_device();
    let b = share_prompts(&batch(8, 23), 2);
    let s_cpu = seqs(&b);
    let s = Sequences::from_batch(&b, "test", dev).unwrap();
    let loss = actor_loss();
    let micro: [Vec<usize>; 2] = [vec![0, 1, 3], vec![4, 6, 7]];
    for tied in [true, false] {
        let base = model(tied, HeadKind::CausalLm, 29);
        let build = |kind: Kind, fusion: bool| {
            let mut m = Transformer::new(
                config(tied),
                &ModelOptions {
                    device: dev,
                    dtype: kind,
                    head: HeadKind::CausalLm,
                },
            )
            .unwrap();
            tch::no_grad(|| {
                for ((_, p), (_, q)) in m
                    .named_parameters()
                    .iter()
                    .zip(base.named_parameters().iter())
                {
                    p.shallow_clone().copy_(&q.to_kind(kind));
                }
            });
            m.set_grad_accumulation_fusion(fusion);
            m
        };
        let run = |m: &Transformer, kept: u64| {
            for rows in &micro {
                let (old, adv, reference) = update_inputs(&s_cpu, rows);
                let (old, adv, reference) = (
                    old.to_device(dev),
                    adv.to_device(dev),
                    reference.to_device(dev),
                );
                let idx = Tensor::from_slice(&rows.iter().map(|&r| r as i64).collect::<Vec<_>>());
                let mask = s_cpu.response_mask.index_select(0, &idx);
                let norm =
                    Normaliser::Global(LossScale::new(MaskCounts::of_mask(&mask).unwrap(), 1));
                let layout = RowLayout::new(&s, rows, Padding::SharedPrompt).unwrap();
                let weight = m.lm_head_weight().unwrap().shallow_clone();
                let _loss = layout_forward_backward(m, &layout, |hidden| {
                    let (l, _) = actor_micro_batch_loss(
                        &layout,
                        hidden,
                        &weight,
                        &MicroBatchLoss {
                            loss: &loss,
                            norm: &norm,
                            old: &old,
                            advantages: &adv,
                            ref_log_prob: Some(&reference),
                            rollout_is_weights: None,
                            on_policy: false,
                            dummy: false,
                            need_entropy: true,
                            temperature: TEMPERATURE,
                            chunk_tokens: 5,
                            kept_logits_bytes: kept,
                        },
                    )
                    .unwrap();
                    Ok(l)
                })
                .unwrap();
            }
            grads(m)
        };
        let before = verl_losses::ChunkedLmHead::product_backwards();
        let product = run(&build(Kind::BFloat16, true), 1 << 40);
        let took = verl_losses::ChunkedLmHead::product_backwards() - before;
        assert!(
            took >= micro.len() as u64,
            "tied {tied}: the product path ran {took} times"
        );
        let chunked = run(&build(Kind::BFloat16, true), 0);
        let exact = run(&build(Kind::Float, false), 0);
        for (((name, p), (_, c)), (_, r)) in product.iter().zip(&chunked).zip(&exact) {
            let (p, c, r) = (
                p.to_kind(Kind::Float),
                c.to_kind(Kind::Float),
                r.to_kind(Kind::Float),
            );
            let scale = r.abs().max().double_value(&[]).max(1e-3);
            let max_abs = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
            // bf16 weights and activations put both a few % from the fp32 run; the product path
            // must be no further from it than the chunked one, and close to that one.
            let (dp, dc) = (max_abs(&p, &r), max_abs(&c, &r));
            assert!(
                dp <= 1.25 * dc + 1e-2 * scale,
                "tied {tied} {name}: product {dp:.3e}, chunked {dc:.3e} from fp32 (scale {scale:.3e})"
            );
            let dpc = max_abs(&p, &c);
            assert!(
                dpc <= 2e-2 * scale,
                "tied {tied} {name}: product vs chunked {dpc:.3e} (scale {scale:.3e})"
            );
        }
    }
}

/// The forward-backward of a micro-batch as the actor runs it for `layout` (padded, unpadded, or a
/// shared-prompt stream).
fn layout_forward_backward(
    m: &Transformer,
    layout: &RowLayout,
    loss_fn: impl FnOnce(&Tensor) -> verl_nn::Result<Tensor>,
) -> verl_nn::Result<Tensor> {
    match &layout.attention_rows {
        Some(rows) => {
            m.forward_backward_hidden_rows(&layout.input_ids, &layout.position_ids, rows, loss_fn)
        }
        None => m.forward_backward_hidden(
            &layout.input_ids,
            Some(&layout.attention_mask),
            Some(&layout.position_ids),
            loss_fn,
        ),
    }
}

// ---- through the plugin ----

fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let m = model(false, HeadKind::CausalLm, 29);
    m.save_pretrained(dir.path(), &SaveOptions::default())
        .unwrap();
    dir
}

fn plugin_config(dir: &std::path::Path, patch: Value) -> Value {
    let mut c = json!({
        "trainer": {"device": "cpu"},
        "actor_rollout_ref": {
            "model": {"path": dir.to_str().unwrap()},
            "actor": {
                "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 3, "ppo_epochs": 2,
                "entropy_coeff": 0.01, "calculate_entropy": true,
                "optim": {"lr": 1e-3, "weight_decay": 0.01},
                "fsdp_config": {"model_dtype": "fp32", "dtype": "fp32"},
            },
            "rollout": {"n": 1, "temperature": 1.0, "log_prob_micro_batch_size_per_gpu": 3},
        },
    });
    merge(&mut c, &patch);
    c
}

fn f32s(b: &Batch, name: &str) -> Vec<f32> {
    b.tensor::<f32>(name).unwrap().data
}

#[test]
fn remove_padding_trains_like_the_padded_path() {
    let dir = model_dir();
    let mut runs = Vec::new();
    for remove in [false, true] {
        let cfg = plugin_config(
            dir.path(),
            json!({"actor_rollout_ref": {"model": {"use_remove_padding": remove}}}),
        );
        let mut a = testing::actor::<FsdpPlugin>(&InitArgs::new(Role::Actor, cfg)).unwrap();
        let b = batch(8, 40);
        let lp_opts = LogProbOptions {
            temperature: 1.0,
            with_entropy: true,
            ..LogProbOptions::default()
        };
        let first = a.compute_log_prob(&b, &lp_opts).unwrap();
        let mut up = b.clone();
        up.insert_tensor(col::OLD_LOG_PROBS, &[8, RL], &f32s(&first, col::LOG_PROBS));
        let adv: Vec<f32> = (0..8 * RL).map(|i| ((i % 5) as f32 - 2.0) * 0.5).collect();
        up.insert_tensor(col::ADVANTAGES, &[8, RL], &adv);
        let metrics = a.update(&up, &UpdateOptions::default()).unwrap();
        let after = a.compute_log_prob(&b, &lp_opts).unwrap();
        runs.push((first, metrics, after));
    }
    let mask: Vec<i64> = batch(8, 40).tensor::<i64>(col::RESPONSE_MASK).unwrap().data;
    let close = |x: &Batch, y: &Batch, name: &str, tol: f32| {
        let (x, y) = (f32s(x, name), f32s(y, name));
        for i in 0..mask.len() {
            if mask[i] != 0 {
                assert!(
                    (x[i] - y[i]).abs() < tol,
                    "{name} token {i}: {} vs {}",
                    x[i],
                    y[i]
                );
            } else {
                // verl's unpadded path writes 0 at padding.
                assert_eq!(y[i], 0.0, "{name} token {i} of the unpadded run");
            }
        }
    };
    // A few fp32 ulps (|log p| ≈ 3 here): the padded and unpadded GEMMs sum in different orders,
    // which can also change with the threads the CPU BLAS picks under load (1.4e-6 was seen with
    // this binary's tests running in parallel on a many-core box).
    close(&runs[0].0, &runs[1].0, col::LOG_PROBS, 5e-6);
    // A few fp32 ulps: the entropy's sums run in a different order per layout (1.3e-6 at 2.01
    // was seen on a 2-core AVX-512 box).
    close(&runs[0].0, &runs[1].0, col::ENTROPY, 5e-6);
    close(&runs[0].2, &runs[1].2, col::LOG_PROBS, 1e-5);
    assert_ne!(
        f32s(&runs[0].0, col::LOG_PROBS),
        f32s(&runs[0].2, col::LOG_PROBS),
        "the update should change the policy"
    );
    for (k, v) in &runs[0].1 {
        let w = runs[1].1.iter().find(|(n, _)| n == k).unwrap().1;
        assert!((v - w).abs() < 1e-5 * v.abs().max(1.0), "{k}: {v} vs {w}");
    }
}

/// `actor.use_prefix_grouper`: log-probs, entropy, update metrics and the updated policy of the
/// shared-prompt path equal the unshared one (groups of 4 split across micro-batches of 3, one
/// empty response), for the actor and the reference.
#[test]
fn prefix_grouper_trains_like_the_unshared_path() {
    let dir = model_dir();
    let b = share_prompts(&batch(8, 40), 4);
    // Static micro-batches of 3 rows, or token budgets (rows of up to 13 tokens; a budget of 20
    // holds one group's stream in part only, so groups are split as well as packed).
    let dynamic = json!({"actor_rollout_ref": {
        "actor": {"use_dynamic_bsz": true, "ppo_max_token_len_per_gpu": 20},
        "rollout": {"log_prob_use_dynamic_bsz": true, "log_prob_max_token_len_per_gpu": 20},
        "ref": {"log_prob_use_dynamic_bsz": true, "log_prob_max_token_len_per_gpu": 20},
    }});
    for batching in [json!({}), dynamic] {
        check_prefix_grouper(dir.path(), &b, &batching);
    }
}

fn check_prefix_grouper(dir: &std::path::Path, b: &Batch, batching: &Value) {
    let lp_opts = LogProbOptions {
        temperature: 1.0,
        with_entropy: true,
        ..LogProbOptions::default()
    };
    let mut runs = Vec::new();
    for share in [false, true] {
        let mut patch = batching.clone();
        merge(
            &mut patch,
            &json!({"actor_rollout_ref": {"actor": {"use_prefix_grouper": share}}}),
        );
        let cfg = plugin_config(dir, patch);
        let reference =
            testing::reference::<FsdpPlugin>(&InitArgs::new(Role::Reference, cfg.clone()))
                .unwrap()
                .compute_log_prob(b, &lp_opts)
                .unwrap();
        let mut a = testing::actor::<FsdpPlugin>(&InitArgs::new(Role::Actor, cfg)).unwrap();
        let first = a.compute_log_prob(b, &lp_opts).unwrap();
        let mut up = b.clone();
        up.insert_tensor(col::OLD_LOG_PROBS, &[8, RL], &f32s(&first, col::LOG_PROBS));
        let adv: Vec<f32> = (0..8 * RL).map(|i| ((i % 5) as f32 - 2.0) * 0.5).collect();
        up.insert_tensor(col::ADVANTAGES, &[8, RL], &adv);
        let metrics = a.update(&up, &UpdateOptions::default()).unwrap();
        let after = a.compute_log_prob(b, &lp_opts).unwrap();
        runs.push((first, metrics, after, reference));
    }
    let close = |x: &Batch, y: &Batch, name: &str, tol: f32| {
        let (x, y) = (f32s(x, name), f32s(y, name));
        let d = x
            .iter()
            .zip(&y)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(
            d < tol,
            "{batching}: {name}: shared-prompt path differs by {d}"
        );
    };
    // A few fp32 ulps at |log p| ≈ 3.7 (GEMMs over a different number of rows round
    // differently; 1.9e-6 seen), far below what a wrong attention row would change.
    close(&runs[0].0, &runs[1].0, col::LOG_PROBS, 1e-5);
    close(&runs[0].0, &runs[1].0, col::ENTROPY, 1e-5);
    close(&runs[0].3, &runs[1].3, col::LOG_PROBS, 1e-5);
    close(&runs[0].2, &runs[1].2, col::LOG_PROBS, 1e-5);
    assert_ne!(
        f32s(&runs[0].0, col::LOG_PROBS),
        f32s(&runs[0].2, col::LOG_PROBS),
        "the update should change the policy"
    );
    // Micro-batch averages (clip fractions, ...) depend on how rows are cut, which token budgets
    // do differently for shared prompts; the loss, its gradient and the policy do not.
    let cut_free = [
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/grad_norm",
        "actor/entropy",
    ];
    let dynamic = batching
        .pointer("/actor_rollout_ref/actor/use_dynamic_bsz")
        .is_some();
    for (k, v) in runs[0]
        .1
        .iter()
        .filter(|(k, _)| !dynamic || cut_free.contains(&k.as_str()))
    {
        let w = runs[1].1.iter().find(|(n, _)| n == k).unwrap().1;
        assert!(
            (v - w).abs() < 1e-5 * v.abs().max(1.0),
            "{batching}: {k}: {v} vs {w}"
        );
    }
}

#[test]
fn engine_keys_shape_generation_but_not_its_outputs() {
    let dir = model_dir();
    let prompts = testing::prompts(&[&[5, 6, 7, 8], &[9, 10], &[11, 12, 13]], 0);
    let opts = GenerateOptions {
        n: 3,
        max_new_tokens: 6,
        temperature: 0.9,
        seed: Some(4),
        eos_token_ids: vec![1],
        return_log_probs: true,
        ..GenerateOptions::default()
    };
    let mut outs = Vec::new();
    for patch in [
        json!({}),
        json!({"actor_rollout_ref": {"rollout": {"max_num_seqs": 2, "max_num_batched_tokens": 5}}}),
    ] {
        let cfg = plugin_config(dir.path(), patch);
        let mut a = testing::actor::<FsdpPlugin>(&InitArgs::new(Role::Actor, cfg)).unwrap();
        outs.push(a.generate(&prompts, &opts).unwrap());
    }
    let ids = |b: &Batch| b.tensor::<i64>(col::RESPONSES).unwrap().data;
    assert_eq!(ids(&outs[0]), ids(&outs[1]));
    for o in &outs {
        let meta = o.meta();
        // CPU: every sequence fits (3 prompts × 3 samples × ceil((len + 6) / 16) blocks).
        assert_eq!(meta["rollout/kv_cache_source"], "all sequences");
        assert_eq!(meta["rollout/kv_cache_tokens"], 9 * 16);
    }
    assert_eq!(outs[1].meta()["rollout/max_running"], 2);
}

#[test]
fn kv_budget_rejects_a_utilization_outside_zero_one() {
    let m = model(false, HeadKind::CausalLm, 1);
    let mask = Tensor::ones([2, 4], (Kind::Int64, Device::Cpu));
    let params = verl_rollout::SamplingParams {
        n: 2,
        max_new_tokens: 8,
        ..verl_rollout::SamplingParams::default()
    };
    let keys = RolloutEngineSection {
        gpu_memory_utilization: 1.5,
        ..RolloutEngineSection::default()
    };
    let e = kv_budget(&m, Device::Cpu, &keys, &mask, &params)
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("gpu_memory_utilization") && e.to_string().contains("1.5"),
        "{e}"
    );
    let keys = RolloutEngineSection {
        max_num_seqs: Some(3),
        max_num_batched_tokens: Some(100),
        ..RolloutEngineSection::default()
    };
    let b = kv_budget(&m, Device::Cpu, &keys, &mask, &params).unwrap();
    assert_eq!(b.config.kv_cache_tokens, None);
    assert_eq!(b.config.max_num_seqs, Some(3));
    assert_eq!(b.config.max_prefill_tokens, 100);
    assert_eq!(b.all_sequences_tokens, 2 * 2 * 16);
}
