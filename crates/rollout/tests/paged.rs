//! The paged engine against the dense one (`verl_rollout::v1`, the oracle) on tiny random models
//! (CPU, fp32): same tokens, log-probs within 1e-5, whatever the block size, KV budget,
//! concurrency limit or prefix sharing.

use serde_json::json;
use tch::{Kind, Tensor};
use verl_nn::{ModelConfig, ModelOptions, Transformer};
use verl_rollout::{
    generate_with_config, generate_with_stats, v1, EngineConfig, FinishReason, Generation,
    GenerationStats, SamplingParams,
};
use verl_test_support::cuda::cuda_device;

const VOCAB: i64 = 512;

fn model_from(v: serde_json::Value) -> Transformer {
    model_in(v, Kind::Float)
}

fn model_in(v: serde_json::Value, dtype: Kind) -> Transformer {
    tch::manual_seed(11);
    let cfg = ModelConfig::from_value(v, "inline/config.json").unwrap();
    Transformer::new(
        cfg,
        &ModelOptions {
            dtype,
            ..ModelOptions::default()
        },
    )
    .unwrap()
}

/// qwen2-shaped, GQA with 2 query heads per kv head.
fn qwen2() -> Transformer {
    model_from(qwen2_config())
}

fn qwen2_config() -> serde_json::Value {
    json!({
        "model_type": "qwen2",
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "pad_token_id": 0, "initializer_range": 0.2,
        "tie_word_embeddings": false,
    })
}

/// Mistral with a 5-token sliding window on every layer.
fn windowed() -> Transformer {
    model_from(json!({
        "model_type": "mistral",
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6, "initializer_range": 0.2, "sliding_window": 5,
        "tie_word_embeddings": false,
    }))
}

/// Prompts of lengths 5, 2, 9, 4 and 8 (around a 4-token block: partial, tiny, spill-over,
/// exactly one block, exactly two).
fn raw_prompts() -> Vec<Vec<i64>> {
    vec![
        vec![11, 250, 37, 498, 5],
        vec![420, 77],
        vec![3, 14, 159, 265, 358, 479, 323, 84, 6],
        vec![9, 99, 199, 299],
        vec![1, 2, 3, 5, 8, 13, 21, 34],
    ]
}

/// Left-padded `[B, P]` ids and mask.
fn pad(prompts: &[Vec<i64>]) -> (Tensor, Tensor) {
    let width = prompts.iter().map(Vec::len).max().unwrap();
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    for p in prompts {
        let fill = width - p.len();
        ids.extend(std::iter::repeat_n(0, fill).chain(p.iter().copied()));
        mask.extend(std::iter::repeat_n(0i64, fill).chain(std::iter::repeat_n(1, p.len())));
    }
    let shape = [prompts.len() as i64, width as i64];
    (
        Tensor::from_slice(&ids).view(shape),
        Tensor::from_slice(&mask).view(shape),
    )
}

fn rows(t: &Tensor) -> Vec<Vec<i64>> {
    Vec::<Vec<i64>>::try_from(t).unwrap()
}

fn oracle(m: &Transformer, prompts: &[Vec<i64>], params: &SamplingParams) -> Generation {
    let (ids, mask) = pad(prompts);
    v1::generate_with_stats(m, &ids, &mask, params, None)
        .unwrap()
        .0
}

fn paged(
    m: &Transformer,
    prompts: &[Vec<i64>],
    params: &SamplingParams,
    config: &EngineConfig,
) -> (Generation, GenerationStats) {
    let (ids, mask) = pad(prompts);
    generate_with_config(m, &ids, &mask, params, None, config).unwrap()
}

fn blocks(block_size: usize) -> EngineConfig {
    EngineConfig {
        block_size,
        ..EngineConfig::default()
    }
}

/// Same tokens, masks and finish reasons; log-probs within 1e-5.
fn assert_same(want: &Generation, got: &Generation, what: &str) {
    assert_eq!(
        rows(&got.responses),
        rows(&want.responses),
        "{what}: tokens"
    );
    assert_eq!(
        rows(&got.response_mask),
        rows(&want.response_mask),
        "{what}: mask"
    );
    assert_eq!(got.finish_reasons, want.finish_reasons, "{what}: finish");
    assert_eq!(got.prompt_index, want.prompt_index, "{what}: prompt index");
    match (&want.log_probs, &got.log_probs) {
        (Some(a), Some(b)) => {
            assert_eq!(b.kind(), Kind::Float);
            let d = (a - b).abs().max().double_value(&[]);
            assert!(d < 1e-5, "{what}: max |log-prob diff| = {d:.3e}");
        }
        (None, None) => {}
        _ => panic!("{what}: log-probs present in one output only"),
    }
}

fn sampled(n: usize, m: usize, seed: u64) -> SamplingParams {
    SamplingParams {
        n,
        max_new_tokens: m,
        seed: Some(seed),
        return_log_probs: true,
        pad_token_id: -1,
        ..SamplingParams::default()
    }
}

#[test]
fn greedy_equals_the_dense_engine_for_any_block_size() {
    let m = qwen2();
    let prompts = raw_prompts();
    let params = SamplingParams {
        n: 2,
        max_new_tokens: 11,
        do_sample: false,
        return_log_probs: true,
        ..SamplingParams::default()
    };
    let want = oracle(&m, &prompts, &params);
    // The batch is diverse, so equality means something.
    let w = rows(&want.responses);
    assert!(w[0] != w[2] || w[2] != w[4]);
    for bs in [1, 3, 4, 16] {
        let (got, stats) = paged(&m, &prompts, &params, &blocks(bs));
        assert_same(&want, &got, &format!("block size {bs}"));
        assert_eq!(stats.preemptions, 0);
        assert_eq!(stats.prefill_steps, 1, "block size {bs}: {stats:?}");
        assert_eq!(stats.prefill_tokens, 28);
        assert_eq!(stats.recomputed_tokens, 0);
        assert!(stats.peak_kv_blocks <= stats.kv_blocks, "{stats:?}");
    }
}

#[test]
fn sampling_with_filters_equals_the_dense_engine() {
    let m = qwen2();
    let prompts = raw_prompts();
    for (temperature, top_k, top_p) in [(1.0, -1, 1.0), (0.7, 20, 0.9), (1.3, 5, 1.0)] {
        let params = SamplingParams {
            temperature,
            top_k,
            top_p,
            ..sampled(3, 10, 7)
        };
        let want = oracle(&m, &prompts, &params);
        let (got, _) = paged(&m, &prompts, &params, &blocks(4));
        assert_same(&want, &got, &format!("T={temperature} k={top_k} p={top_p}"));
    }
}

#[test]
fn eos_and_ignore_eos_equal_the_dense_engine() {
    let m = qwen2();
    let prompts = raw_prompts();
    let free = rows(&oracle(&m, &prompts, &sampled(4, 14, 3)).responses);
    // A few tokens of the free run as EOS: rows stop at assorted steps.
    let eos: Vec<i64> = free.iter().step_by(3).map(|r| r[4]).collect();
    let params = SamplingParams {
        eos_token_ids: eos,
        ..sampled(4, 14, 3)
    };
    let want = oracle(&m, &prompts, &params);
    let stops = want
        .finish_reasons
        .iter()
        .filter(|&&f| f == FinishReason::Stop)
        .count();
    assert!(stops >= 5, "only {stops} of 20 rows hit EOS");
    assert!(want.finish_reasons.contains(&FinishReason::Length));
    let (got, stats) = paged(&m, &prompts, &params, &blocks(4));
    assert_same(&want, &got, "eos");
    // Finished rows leave the batch at once.
    assert!(stats.decode_tokens < 20 * stats.decode_steps, "{stats:?}");
    assert_eq!(
        stats.generated_tokens as i64,
        got.response_mask.sum(Kind::Int64).int64_value(&[])
    );
    let ignore = SamplingParams {
        ignore_eos: true,
        ..params.clone()
    };
    let (got, _) = paged(&m, &prompts, &ignore, &blocks(4));
    assert_eq!(rows(&got.responses), free);
    assert_eq!(got.finish_reasons, vec![FinishReason::Length; 20]);
}

#[test]
fn sliding_window_equals_the_dense_engine() {
    let m = windowed();
    let prompts = raw_prompts();
    for params in [
        SamplingParams {
            do_sample: false,
            ..sampled(1, 12, 0)
        },
        sampled(2, 12, 5),
    ] {
        let want = oracle(&m, &prompts, &params);
        let (got, _) = paged(&m, &prompts, &params, &blocks(4));
        assert_same(&want, &got, "window 5");
    }
}

#[test]
fn prefix_sharing_gives_the_outputs_of_unshared_samples_in_fewer_blocks() {
    let m = qwen2();
    // Prompts of 9 and 6 tokens: two full 4-token blocks + a partial one, and one full + partial.
    let prompts = vec![raw_prompts()[2].clone(), vec![7, 70, 170, 270, 370, 470]];
    let params = sampled(4, 9, 21);
    let (shared, s) = paged(&m, &prompts, &params, &blocks(4));
    // One prefill per prompt, forks for the other samples; the partial prompt block is copied by
    // each sample that writes after it, the full ones are stored once.
    assert_eq!(s.prefill_steps, 1, "{s:?}");
    assert_eq!(s.recomputed_tokens, 0, "{s:?}");
    // Prompt 0: 2 shared + 4 x (ceil(18/4) - 2) = 2 + 4*3; prompt 1: 1 + 4 x (ceil(15/4) - 1).
    assert_eq!(s.peak_kv_blocks, (2 + 4 * 3) + (1 + 4 * 3), "{s:?}");
    assert_eq!(s.kv_blocks, s.peak_kv_blocks);

    // One sequence at a time: every sample prefills its own prompt copy, nothing is shared.
    let alone = EngineConfig {
        max_num_seqs: Some(1),
        ..blocks(4)
    };
    let (unshared, u) = paged(&m, &prompts, &params, &alone);
    assert_same(&unshared, &shared, "shared vs one at a time");
    assert_eq!(u.max_running, 1);
    assert_eq!(u.prefill_steps, 8, "{u:?}");
    // And the dense engine, which replicates the prompt cache per sample, agrees too.
    assert_same(&oracle(&m, &prompts, &params), &shared, "dense");
    // Samples of one prompt do differ: they share the prompt, not the continuation.
    let r = rows(&shared.responses);
    assert!(r[0] != r[1] && r[1] != r[2] && r[2] != r[3]);
}

#[test]
fn a_small_pool_preempts_and_recomputes_with_identical_outputs() {
    let m = qwen2();
    let prompts = raw_prompts();
    let params = SamplingParams {
        eos_token_ids: vec![3, 30, 300],
        ..sampled(3, 16, 8)
    };
    let (want, roomy) = paged(&m, &prompts, &params, &blocks(4));
    assert_eq!(roomy.preemptions, 0);
    // The longest prompt (9) + 16 new tokens needs 7 blocks of 4; give the pool 9 blocks for 15
    // sequences that together need far more.
    let tight = EngineConfig {
        kv_cache_tokens: Some(36),
        ..blocks(4)
    };
    let (got, s) = paged(&m, &prompts, &params, &tight);
    assert_same(&want, &got, "9-block pool");
    assert_eq!(s.kv_blocks, 9);
    assert!(s.peak_kv_blocks <= 9, "{s:?}");
    assert!(s.preemptions > 0, "no preemption: {s:?}");
    assert!(s.recomputed_tokens > 0, "{s:?}");
    assert!(s.prefill_steps > 1, "{s:?}");
    assert_same(&oracle(&m, &prompts, &params), &got, "dense");

    // Greedy with a pool that holds one sequence at a time.
    let greedy = SamplingParams {
        do_sample: false,
        ..params.clone()
    };
    let (want, _) = paged(&m, &prompts, &greedy, &blocks(4));
    let one = EngineConfig {
        kv_cache_tokens: Some(28),
        ..blocks(4)
    };
    let (got, s) = paged(&m, &prompts, &greedy, &one);
    assert_same(&want, &got, "7-block pool");
    assert!(s.max_running >= 1 && s.peak_kv_blocks <= 7, "{s:?}");
}

#[test]
fn continuous_batching_admits_as_sequences_finish() {
    let m = qwen2();
    let prompts = raw_prompts();
    let params = SamplingParams {
        eos_token_ids: (0..60).collect(),
        ..sampled(4, 12, 4)
    };
    let (want, all) = paged(&m, &prompts, &params, &blocks(4));
    // Rows whose first token is an EOS retire before the first decode step.
    assert!(all.max_running > 10 && all.max_running <= 20, "{all:?}");
    for (cfg, what) in [
        (
            EngineConfig {
                max_num_seqs: Some(3),
                ..blocks(4)
            },
            "3 at a time",
        ),
        (
            EngineConfig {
                max_prefill_tokens: 10,
                ..blocks(2)
            },
            "10-token prefills",
        ),
    ] {
        let (got, s) = paged(&m, &prompts, &params, &cfg);
        assert_same(&want, &got, what);
        assert!(s.prefill_steps > 1, "{what}: {s:?}");
        if let Some(k) = cfg.max_num_seqs {
            assert!(s.max_running <= k, "{what}: {s:?}");
        }
    }
}

#[test]
fn public_entry_points_run_the_paged_engine() {
    let m = qwen2();
    let (ids, mask) = pad(&raw_prompts());
    let (_, s) = generate_with_stats(&m, &ids, &mask, &sampled(2, 5, 1), None).unwrap();
    assert!(s.kv_blocks > 0 && s.peak_kv_blocks > 0, "{s:?}");
}

#[test]
fn bad_engine_configs_are_named() {
    let m = qwen2();
    let (ids, mask) = pad(&raw_prompts());
    let p = sampled(1, 8, 0);
    let err = |c: EngineConfig| {
        generate_with_config(&m, &ids, &mask, &p, None, &c)
            .unwrap_err()
            .to_string()
    };
    let e = err(EngineConfig {
        kv_cache_tokens: Some(16),
        ..blocks(4)
    });
    assert!(
        e.contains("kv_cache_tokens") && e.contains("9 + 8") && e.contains("16 tokens"),
        "{e}"
    );
    let e = err(blocks(0));
    assert!(e.contains("block_size"), "{e}");
    let e = err(EngineConfig {
        max_num_seqs: Some(0),
        ..EngineConfig::default()
    });
    assert!(e.contains("max_num_seqs"), "{e}");
    let e = err(EngineConfig {
        max_prefill_tokens: 0,
        ..EngineConfig::default()
    });
    assert!(e.contains("max_prefill_tokens"), "{e}");
}

#[test]
fn kv_budget_from_bytes() {
    let m = qwen2();
    // 2 layers x 2 kv heads x head_dim 8 x (k, v) x 4 bytes.
    assert_eq!(EngineConfig::kv_bytes_per_token(&m), 256);
    assert_eq!(EngineConfig::tokens_for_bytes(&m, 1 << 20), 4096);
}

#[test]
fn single_token_responses_finish_at_admission() {
    let m = qwen2();
    let prompts = raw_prompts();
    let params = sampled(3, 1, 2);
    let want = oracle(&m, &prompts, &params);
    let (got, s) = paged(&m, &prompts, &params, &blocks(4));
    assert_same(&want, &got, "one token");
    assert_eq!(s.decode_steps, 0, "{s:?}");
    assert_eq!(got.finish_reasons, vec![FinishReason::Length; 15]);
}

/// bf16 runs through the same path (additive mask in the model dtype); log-probs stay fp32.
#[test]
fn bf16_model_generates() {
    let m = model_in(qwen2_config(), Kind::BFloat16);
    let (ids, mask) = pad(&raw_prompts());
    let params = SamplingParams {
        top_p: 0.9,
        ..sampled(2, 6, 9)
    };
    let (g, _) = generate_with_config(&m, &ids, &mask, &params, None, &blocks(4)).unwrap();
    assert_eq!(g.responses.size(), [10, 6]);
    let lp = g.log_probs.unwrap();
    assert_eq!(lp.kind(), Kind::Float);
    assert!(lp.isfinite().all().int64_value(&[]) == 1);
    assert!(lp.max().double_value(&[]) <= 0.0);
}

/// On CUDA (pinned non-blocking uploads, flash/efficient SDPA): fp32 matches the dense engine,
/// a tight pool still completes identically, bf16 sampling is deterministic. Needs CUDA.
#[test]
#[ignore = "needs CUDA"]
fn cuda_paged_matches_dense_on_cuda() {
    let cuda = cuda_device();
    let load = |dtype| {
        tch::manual_seed(11);
        let cfg = ModelConfig::from_value(qwen2_config(), "inline/config.json").unwrap();
        Transformer::new(
            cfg,
            &ModelOptions {
                device: cuda,
                dtype,
                ..ModelOptions::default()
            },
        )
        .unwrap()
    };
    let m = load(Kind::Float);
    let prompts = raw_prompts();
    let (ids, mask) = pad(&prompts);
    let (ids, mask) = (ids.to_device(cuda), mask.to_device(cuda));
    let params = SamplingParams {
        eos_token_ids: vec![3, 30, 300],
        ..sampled(3, 16, 8)
    };
    let cpu = |g: Generation| Generation {
        responses: g.responses.to_device(tch::Device::Cpu),
        response_mask: g.response_mask.to_device(tch::Device::Cpu),
        log_probs: g.log_probs.map(|t| t.to_device(tch::Device::Cpu)),
        ..g
    };
    let want = cpu(v1::generate_with_stats(&m, &ids, &mask, &params, None)
        .unwrap()
        .0);
    for cfg in [
        blocks(16),
        EngineConfig {
            kv_cache_tokens: Some(36),
            ..blocks(4)
        },
    ] {
        let (got, _) = generate_with_config(&m, &ids, &mask, &params, None, &cfg).unwrap();
        assert_eq!(got.responses.device(), cuda);
        let got = cpu(got);
        assert_eq!(rows(&got.responses), rows(&want.responses), "{cfg:?}");
        let d = (got.log_probs.unwrap() - want.log_probs.as_ref().unwrap())
            .abs()
            .max()
            .double_value(&[]);
        assert!(d < 1e-3, "{cfg:?}: {d:.3e}");
    }
    let bf16 = load(Kind::BFloat16);
    let a = generate_with_config(&bf16, &ids, &mask, &params, None, &blocks(16)).unwrap();
    let b = generate_with_config(&bf16, &ids, &mask, &params, None, &blocks(16)).unwrap();
    assert!(a.0.responses.equal(&b.0.responses));
}

/// Random prompts, sampling settings and engine configurations (tight pools, small batches,
/// small prefills, odd block sizes) against the dense engine.
#[test]
fn random_configurations_equal_the_dense_engine() {
    let m = qwen2();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = |k: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % k
    };
    let mut preempted = 0;
    for case in 0..10 {
        let b = 1 + next(4) as usize;
        let prompts: Vec<Vec<i64>> = (0..b)
            .map(|_| {
                (0..1 + next(13))
                    .map(|_| next(VOCAB as u64) as i64)
                    .collect()
            })
            .collect();
        let longest = prompts.iter().map(Vec::len).max().unwrap();
        let new_tokens = 1 + next(14) as usize;
        let params = SamplingParams {
            n: 1 + next(4) as usize,
            do_sample: next(4) != 0,
            top_k: [-1, 7][next(2) as usize],
            eos_token_ids: (0..next(40) as i64).collect(),
            ..sampled(1, new_tokens, next(1000))
        };
        let bs = 1 + next(6) as usize;
        let one_seq = (longest + new_tokens).div_ceil(bs) * bs;
        let cfg = EngineConfig {
            block_size: bs,
            kv_cache_tokens: [None, Some(one_seq), Some(one_seq + 3 * bs)][next(3) as usize],
            max_num_seqs: [None, Some(1 + next(5) as usize)][next(2) as usize],
            max_prefill_tokens: [16384, 1 + next(24) as usize][next(2) as usize],
            ..EngineConfig::default()
        };
        let want = oracle(&m, &prompts, &params);
        let (got, s) = paged(&m, &prompts, &params, &cfg);
        assert_same(&want, &got, &format!("case {case}: {params:?} {cfg:?}"));
        assert!(s.peak_kv_blocks <= s.kv_blocks, "case {case}: {s:?}");
        preempted += s.preemptions;
    }
    assert!(preempted > 0, "no case preempted anything");
}
