//! Generation engine behaviour on tiny random qwen2-shaped models (CPU, fp32).

use serde_json::json;
use tch::{Device, Kind, Tensor};
use verl_nn::{HeadKind, ModelConfig, ModelOptions, Transformer};
use verl_rollout::{
    generate, generate_seeded, generate_with_stats, FinishReason, Generation, RolloutError,
    SamplingParams,
};
use verl_test_support::cuda::cuda_device;

const VOCAB: i64 = 1000;
const PAD: i64 = 0;

fn config() -> ModelConfig {
    ModelConfig::from_value(
        json!({
            "model_type": "qwen2",
            "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "pad_token_id": PAD, "initializer_range": 0.1,
            "tie_word_embeddings": false,
        }),
        "inline/config.json",
    )
    .unwrap()
}

/// libtorch's global generator is one per process and tests run on parallel threads: whoever
/// seeds it or draws from it holds this lock, or another test's draws land in between (seen on
/// an H200: `unseeded_calls_follow_the_global_torch_seed` failed under the default test threads).
static GLOBAL_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn model_with(head: HeadKind) -> Transformer {
    let _rng = GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(3);
    Transformer::new(
        config(),
        &ModelOptions {
            head,
            ..ModelOptions::default()
        },
    )
    .unwrap()
}

fn model() -> Transformer {
    model_with(HeadKind::CausalLm)
}

/// Three prompts of lengths 5, 2 and 7.
fn raw_prompts() -> Vec<Vec<i64>> {
    vec![
        vec![11, 250, 37, 998, 5],
        vec![420, 77],
        vec![3, 14, 159, 265, 358, 979, 323],
    ]
}

/// Left-padded (or right-padded) `[B, P]` ids and mask.
fn pad(prompts: &[Vec<i64>], left: bool) -> (Tensor, Tensor) {
    let width = prompts.iter().map(Vec::len).max().unwrap();
    let mut ids = Vec::new();
    let mut mask = Vec::new();
    for p in prompts {
        let fill = width - p.len();
        let (row, m): (Vec<i64>, Vec<i64>) = if left {
            (
                std::iter::repeat_n(PAD, fill)
                    .chain(p.iter().copied())
                    .collect(),
                std::iter::repeat_n(0, fill)
                    .chain(std::iter::repeat_n(1, p.len()))
                    .collect(),
            )
        } else {
            (
                p.iter()
                    .copied()
                    .chain(std::iter::repeat_n(PAD, fill))
                    .collect(),
                std::iter::repeat_n(1, p.len())
                    .chain(std::iter::repeat_n(0, fill))
                    .collect(),
            )
        };
        ids.extend(row);
        mask.extend(m);
    }
    let b = prompts.len() as i64;
    (
        Tensor::from_slice(&ids).view([b, width as i64]),
        Tensor::from_slice(&mask).view([b, width as i64]),
    )
}

fn greedy(m: usize) -> SamplingParams {
    SamplingParams {
        max_new_tokens: m,
        do_sample: false,
        ..SamplingParams::default()
    }
}

fn sampling(m: usize, seed: u64) -> SamplingParams {
    SamplingParams {
        max_new_tokens: m,
        temperature: 1.0,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

fn rows(t: &Tensor) -> Vec<Vec<i64>> {
    Vec::<Vec<i64>>::try_from(t).unwrap()
}

fn run(m: &Transformer, prompts: &[Vec<i64>], params: &SamplingParams) -> Generation {
    let (ids, mask) = pad(prompts, true);
    generate(m, &ids, &mask, params).unwrap()
}

#[test]
fn greedy_batch_matches_each_prompt_alone_and_the_uncached_reference() {
    let m = model();
    let prompts = raw_prompts();
    let params = greedy(10);
    let left = run(&m, &prompts, &params);
    assert_eq!(left.responses.size(), [3, 10]);
    let batched = rows(&left.responses);
    for (i, p) in prompts.iter().enumerate() {
        let alone = run(&m, std::slice::from_ref(p), &params);
        assert_eq!(rows(&alone.responses)[0], batched[i], "prompt {i}");
    }
    // verl-nn's cache-free greedy loop is an independent reference for the cached decode.
    let (ids, mask) = pad(&prompts, true);
    let reference = m.generate_greedy(&ids, Some(&mask), 10, false).unwrap();
    assert_eq!(rows(&reference), batched);
    // Right padding continues after each row's last real token.
    let (ids, mask) = pad(&prompts, false);
    let right = generate(&m, &ids, &mask, &params).unwrap();
    assert_eq!(rows(&right.responses), batched);
    // The batch really is diverse: not all prompts produce the same continuation.
    assert!(batched[0] != batched[1] || batched[1] != batched[2]);
    assert!(left.log_probs.is_none());
    assert_eq!(left.finish_reasons, vec![FinishReason::Length; 3]);
    assert_eq!(rows(&left.response_mask), vec![vec![1; 10]; 3]);
}

/// Log-probs of `responses` under a full forward of prompt + response (logits / temperature),
/// `[B*n, M]`.
fn full_forward_log_probs(
    m: &Transformer,
    prompts: &[Vec<i64>],
    g: &Generation,
    temperature: f64,
) -> Tensor {
    let (ids, mask) = pad(prompts, true);
    let idx = Tensor::from_slice(&g.prompt_index);
    let ids = ids.index_select(0, &idx);
    let mask = mask.index_select(0, &idx);
    let p = ids.size()[1];
    let mlen = g.responses.size()[1];
    // Padding after EOS holds pad ids; the mask keeps them out of attention.
    let full_ids = Tensor::cat(&[&ids, &g.responses.clamp(0, VOCAB - 1)], 1);
    let full_mask = Tensor::cat(&[&mask, &g.response_mask], 1);
    let logits = tch::no_grad(|| m.forward(&full_ids, Some(&full_mask), None, None)).unwrap();
    logits
        .narrow(1, p - 1, mlen)
        .to_kind(Kind::Float)
        .divide_scalar(temperature)
        .log_softmax(-1, Kind::Float)
        .gather(-1, &g.responses.clamp(0, VOCAB - 1).unsqueeze(-1), false)
        .squeeze_dim(-1)
        * g.response_mask.to_kind(Kind::Float)
}

#[test]
fn rollout_log_probs_equal_a_full_forward() {
    let m = model();
    let prompts = raw_prompts();
    for (temperature, top_k, top_p, eos) in [
        (0.7, 50, 0.9, vec![]),
        (1.3, -1, 1.0, vec![]),
        // A frequent-token EOS set: some rows stop early, so padding is covered too.
        (1.0, -1, 1.0, (0..200).collect::<Vec<i64>>()),
    ] {
        let params = SamplingParams {
            n: 3,
            max_new_tokens: 12,
            temperature,
            top_k,
            top_p,
            seed: Some(1),
            eos_token_ids: eos.clone(),
            pad_token_id: -1,
            return_log_probs: true,
            ..SamplingParams::default()
        };
        let g = run(&m, &prompts, &params);
        let lp = g.log_probs.as_ref().unwrap();
        assert_eq!(lp.size(), [9, 12]);
        assert_eq!(lp.kind(), Kind::Float);
        let want = full_forward_log_probs(&m, &prompts, &g, temperature);
        let d = (lp - &want).abs().max().double_value(&[]);
        assert!(
            d < 1e-5,
            "T={temperature}: max |rollout - forward| = {d:.3e}"
        );
        // Padding carries zero log-prob; real tokens carry real (negative) ones.
        let pad_lp = lp.masked_select(&g.response_mask.eq(0));
        assert!(pad_lp.numel() == 0 || pad_lp.abs().max().double_value(&[]) == 0.0);
        let real = lp.masked_select(&g.response_mask.ne(0));
        assert!(real.max().double_value(&[]) < 0.0);
        if !eos.is_empty() {
            assert!(
                g.finish_reasons.contains(&FinishReason::Stop),
                "EOS set never hit: {:?}",
                g.finish_reasons
            );
        }
    }
}

#[test]
fn greedy_log_probs_use_temperature_one_when_temperature_is_zero() {
    let m = model();
    let prompts = raw_prompts();
    let params = SamplingParams {
        temperature: 0.0,
        return_log_probs: true,
        ..greedy(6)
    };
    let g = run(&m, &prompts, &params);
    let want = full_forward_log_probs(&m, &prompts, &g, 1.0);
    let d = (g.log_probs.as_ref().unwrap() - &want)
        .abs()
        .max()
        .double_value(&[]);
    assert!(d < 1e-5, "{d:.3e}");
}

#[test]
fn samples_depend_on_seed_prompt_and_sample_index_only() {
    let m = model();
    let prompts = raw_prompts();
    let params = SamplingParams {
        n: 4,
        ..sampling(10, 5)
    };
    let all = run(&m, &prompts, &params);
    assert_eq!(all.prompt_index, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]);
    let all_rows = rows(&all.responses);

    // Same seed, a smaller batch with a different padding width: prompts 0 and 1 unchanged.
    let sub = run(&m, &prompts[..2], &params);
    assert_eq!(rows(&sub.responses), all_rows[..8]);

    // A data-parallel rank holding prompts 1..3 samples them as the whole batch did.
    let tail = run(
        &m,
        &prompts[1..],
        &SamplingParams {
            row_offset: 1,
            ..params.clone()
        },
    );
    assert_eq!(rows(&tail.responses), all_rows[4..]);
    let unshifted = run(&m, &prompts[1..], &params);
    assert_ne!(rows(&unshifted.responses), all_rows[4..]);

    // n samples of one prompt all differ.
    for i in 0..3 {
        for a in 0..4 {
            for b in a + 1..4 {
                assert_ne!(all_rows[4 * i + a], all_rows[4 * i + b], "prompt {i}");
            }
        }
    }

    // A different seed gives different samples.
    let other = run(&m, &prompts, &sampling(10, 6).clone_with_n(4));
    assert_ne!(rows(&other.responses), all_rows);

    // Per-request seeds: a prompt keeps its samples wherever it sits in the batch.
    let seeds = [101u64, 202, 303];
    let (ids, mask) = pad(&prompts, true);
    let fwd = generate_seeded(&m, &ids, &mask, &params, &seeds).unwrap();
    let order = [2usize, 0, 1];
    let permuted: Vec<Vec<i64>> = order.iter().map(|&i| prompts[i].clone()).collect();
    let (ids, mask) = pad(&permuted, true);
    let pseeds: Vec<u64> = order.iter().map(|&i| seeds[i]).collect();
    let rev = generate_seeded(&m, &ids, &mask, &params, &pseeds).unwrap();
    let (fwd, rev) = (rows(&fwd.responses), rows(&rev.responses));
    for (k, &i) in order.iter().enumerate() {
        assert_eq!(rev[4 * k..4 * k + 4], fwd[4 * i..4 * i + 4], "prompt {i}");
    }
}

trait WithN {
    fn clone_with_n(&self, n: usize) -> SamplingParams;
}

impl WithN for SamplingParams {
    fn clone_with_n(&self, n: usize) -> SamplingParams {
        SamplingParams { n, ..self.clone() }
    }
}

#[test]
fn unseeded_calls_follow_the_global_torch_seed() {
    let m = model();
    let prompts = raw_prompts();
    let params = SamplingParams {
        seed: None,
        ..sampling(8, 0)
    };
    let _rng = GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(9);
    let a = rows(&run(&m, &prompts, &params).responses);
    let b = rows(&run(&m, &prompts, &params).responses);
    tch::manual_seed(9);
    let c = rows(&run(&m, &prompts, &params).responses);
    assert_eq!(a, c);
    assert_ne!(a, b);
}

#[test]
fn greedy_n_samples_are_identical_copies() {
    let m = model();
    let prompts = raw_prompts();
    let g = run(
        &m,
        &prompts,
        &SamplingParams {
            n: 3,
            return_log_probs: true,
            ..greedy(7)
        },
    );
    let one = run(&m, &prompts, &greedy(7));
    let r = rows(&g.responses);
    let single = rows(&one.responses);
    assert_eq!(r.len(), 9);
    for (k, row) in r.iter().enumerate() {
        assert_eq!(row, &single[k / 3]);
    }
    assert_eq!(g.log_probs.unwrap().size(), [9, 7]);
}

#[test]
fn top_k_one_and_tiny_top_p_equal_greedy() {
    let m = model();
    let prompts = raw_prompts();
    let want = rows(&run(&m, &prompts, &greedy(10)).responses);
    for params in [
        SamplingParams {
            top_k: 1,
            n: 2,
            ..sampling(10, 42)
        },
        SamplingParams {
            top_p: 1e-6,
            n: 2,
            ..sampling(10, 43)
        },
    ] {
        let got = rows(&run(&m, &prompts, &params).responses);
        for (k, row) in got.iter().enumerate() {
            assert_eq!(row, &want[k / 2], "{params:?}");
        }
    }
    // A plain sample does differ from greedy, so the comparison above means something.
    let free = rows(&run(&m, &prompts, &sampling(10, 42)).responses);
    assert_ne!(free, want);
}

#[test]
fn eos_stops_rows_pads_and_masks() {
    let m = model();
    let prompts = raw_prompts();
    let len = 12;
    let free = rows(&run(&m, &prompts, &greedy(len)).responses);
    // Row 0's fourth greedy token becomes the EOS: row 0 stops at its first occurrence.
    let eos = free[0][3];
    let params = SamplingParams {
        eos_token_ids: vec![eos],
        pad_token_id: -7,
        ..greedy(len)
    };
    let g = run(&m, &prompts, &params);
    let (toks, mask) = (rows(&g.responses), rows(&g.response_mask));
    for (i, row) in free.iter().enumerate() {
        match row.iter().position(|&t| t == eos) {
            Some(q) => {
                assert_eq!(g.finish_reasons[i], FinishReason::Stop, "row {i}");
                assert_eq!(toks[i][..=q], row[..=q], "row {i}");
                assert!(toks[i][q + 1..].iter().all(|&t| t == -7), "row {i}");
                assert!(mask[i][..=q].iter().all(|&x| x == 1));
                assert!(mask[i][q + 1..].iter().all(|&x| x == 0));
            }
            None => {
                assert_eq!(g.finish_reasons[i], FinishReason::Length, "row {i}");
                assert_eq!(&toks[i], row);
                assert_eq!(mask[i], vec![1; len]);
            }
        }
    }
    assert_eq!(g.finish_reasons[0], FinishReason::Stop);
    assert!(mask[0].iter().sum::<i64>() <= 4);

    let ignored = run(
        &m,
        &prompts,
        &SamplingParams {
            ignore_eos: true,
            ..params.clone()
        },
    );
    assert_eq!(rows(&ignored.responses), free);
    assert_eq!(ignored.finish_reasons, vec![FinishReason::Length; 3]);
    assert_eq!(rows(&ignored.response_mask), vec![vec![1; len]; 3]);
}

/// Rows stopping at different steps get compacted out of the batch; the survivors' samples must
/// not notice (their random streams and cache rows follow them).
#[test]
fn sampled_rows_are_unaffected_by_other_rows_stopping() {
    let m = model();
    let prompts = raw_prompts();
    let base = SamplingParams {
        n: 6,
        ..sampling(16, 77)
    };
    let free = run(&m, &prompts, &base);
    let free_rows = rows(&free.responses);
    // EOS = a handful of tokens seen in the free run, so rows stop at assorted steps.
    let eos: Vec<i64> = free_rows
        .iter()
        .map(|r| r[2 + r[0] as usize % 10])
        .collect();
    let (ids, mask) = pad(&prompts, true);
    let (g, stats) = generate_with_stats(
        &m,
        &ids,
        &mask,
        &SamplingParams {
            eos_token_ids: eos.clone(),
            pad_token_id: -1,
            ..base.clone()
        },
        None,
    )
    .unwrap();
    let toks = rows(&g.responses);
    let mut stopped = 0;
    for (r, row) in free_rows.iter().enumerate() {
        let stop = row.iter().position(|t| eos.contains(t));
        let kept = stop.map_or(row.len(), |q| q + 1);
        assert_eq!(toks[r][..kept], row[..kept], "row {r}");
        assert!(toks[r][kept..].iter().all(|&t| t == -1), "row {r}");
        let want = if stop.is_some() {
            stopped += 1;
            FinishReason::Stop
        } else {
            FinishReason::Length
        };
        assert_eq!(g.finish_reasons[r], want, "row {r}");
    }
    assert!(stopped >= 9, "only {stopped} of 18 rows stopped");
    // Compaction happened: fewer positions were decoded than rows x steps.
    assert!(
        stats.decode_tokens < 18 * stats.decode_steps,
        "{stats:?} (no compaction)"
    );
    assert_eq!(
        stats.generated_tokens as i64,
        g.response_mask.sum(Kind::Int64).int64_value(&[])
    );
    assert_eq!(stats.prefill_tokens, 14);
}

#[test]
fn zero_new_tokens_gives_empty_responses() {
    let m = model();
    let g = run(
        &m,
        &raw_prompts(),
        &SamplingParams {
            n: 2,
            return_log_probs: true,
            ..sampling(0, 1)
        },
    );
    assert_eq!(g.responses.size(), [6, 0]);
    assert_eq!(g.response_mask.size(), [6, 0]);
    assert_eq!(g.log_probs.unwrap().size(), [6, 0]);
    assert_eq!(g.prompt_index, [0, 0, 1, 1, 2, 2]);
}

fn err_text(r: Result<Generation, RolloutError>) -> String {
    r.unwrap_err().to_string()
}

#[test]
fn bad_inputs_are_named() {
    let m = model();
    let (ids, mask) = pad(&raw_prompts(), true);
    let p = greedy(4);
    let e = err_text(generate(&m, &ids, &mask.narrow(1, 0, 3), &p));
    assert!(e.contains("prompt_mask") && e.contains("[3, 7]"), "{e}");
    let zero = mask.copy();
    let _ = zero.get(1).fill_(0);
    let e = err_text(generate(&m, &ids, &zero, &p));
    assert!(e.contains("prompt_mask row 1"), "{e}");
    let e = err_text(generate(&m, &ids.to_kind(Kind::Int), &mask, &p));
    assert!(e.contains("prompts") && e.contains("Int"), "{e}");
    let e = err_text(generate(
        &m,
        &ids,
        &mask,
        &SamplingParams { n: 0, ..p.clone() },
    ));
    assert!(e.contains("SamplingParams.n"), "{e}");
    let e = err_text(generate(
        &m,
        &ids,
        &mask,
        &SamplingParams {
            max_new_tokens: 1 << 20,
            ..p.clone()
        },
    ));
    assert!(e.contains("max_position_embeddings"), "{e}");
    let e = err_text(generate_seeded(&m, &ids, &mask, &p, &[1, 2]));
    assert!(e.contains("request_seeds") && e.contains("2 seeds"), "{e}");
    let critic = model_with(HeadKind::Value);
    let e = err_text(generate(&critic, &ids, &mask, &p));
    assert!(e.contains("CausalLm") && e.contains("Value"), "{e}");
    assert_eq!(ids.device(), Device::Cpu);
}

/// The same weights on CUDA give the CPU's greedy tokens and log-probs, and bf16 runs through
/// the sampling path. Needs CUDA (`make test-gpu`).
#[test]
#[ignore = "needs CUDA"]
fn cuda_matches_cpu_on_cuda() {
    cuda_device();
    let cpu = model();
    let dir = tempfile::tempdir().unwrap();
    cpu.save_pretrained(dir.path(), &verl_nn::SaveOptions::default())
        .unwrap();
    let load = |dtype| {
        Transformer::from_pretrained(
            dir.path(),
            &ModelOptions {
                device: Device::Cuda(0),
                dtype,
                ..ModelOptions::default()
            },
        )
        .unwrap()
    };
    let gpu = load(Kind::Float);
    let prompts = raw_prompts();
    let params = SamplingParams {
        return_log_probs: true,
        ..greedy(10)
    };
    let want = run(&cpu, &prompts, &params);
    let (ids, mask) = pad(&prompts, true);
    let cuda = Device::Cuda(0);
    let got = generate(&gpu, &ids.to_device(cuda), &mask.to_device(cuda), &params).unwrap();
    assert_eq!(got.responses.device(), cuda);
    assert_eq!(
        rows(&got.responses.to_device(Device::Cpu)),
        rows(&want.responses)
    );
    let d = (got.log_probs.unwrap().to_device(Device::Cpu) - want.log_probs.unwrap())
        .abs()
        .max()
        .double_value(&[]);
    assert!(d < 1e-3, "CUDA vs CPU log-probs: {d:.3e}");

    let bf16 = load(Kind::BFloat16);
    let sampled = SamplingParams {
        n: 4,
        top_k: 50,
        top_p: 0.9,
        return_log_probs: true,
        ..sampling(10, 3)
    };
    let a = generate(&bf16, &ids.to_device(cuda), &mask.to_device(cuda), &sampled).unwrap();
    let b = generate(&bf16, &ids.to_device(cuda), &mask.to_device(cuda), &sampled).unwrap();
    assert!(a.responses.equal(&b.responses));
    assert_eq!(a.log_probs.unwrap().kind(), Kind::Float);
}
