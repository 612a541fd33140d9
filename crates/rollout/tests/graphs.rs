//! Decode CUDA graphs and the paged-attention kernel (GPU only: ignored as "needs CUDA", run by
//! `make test-gpu`, failing on a machine without CUDA): the paged engine with the kernel, and replaying captured decode steps, gives
//! the tokens and log-probs of the gather + SDPA path, across ragged lengths, EOS, sliding
//! windows and batch shrinkage (many buckets).

use serde_json::json;
use tch::{Device, Kind, Tensor};
use verl_nn::{ModelConfig, ModelOptions, Transformer};
use verl_rollout::{generate_with_config, EngineConfig, GenerationStats, SamplingParams};
use verl_test_support::cuda::cuda_device;

/// The tests here take turns: they seed libtorch's global generator and one of them flips a
/// process-wide environment variable, so run side by side (cargo's default) each could draw the
/// other's random prompts or run under the other's attention path.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn model(v: serde_json::Value, dtype: Kind) -> Transformer {
    tch::manual_seed(7);
    let cfg = ModelConfig::from_value(v, "inline/config.json").unwrap();
    Transformer::new(
        cfg,
        &ModelOptions {
            device: Device::Cuda(0),
            dtype,
            ..ModelOptions::default()
        },
    )
    .unwrap()
}

fn qwen2() -> serde_json::Value {
    json!({
        "model_type": "qwen2", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "initializer_range": 0.2, "tie_word_embeddings": false,
    })
}

fn run(
    m: &Transformer,
    params: &SamplingParams,
    graphs: bool,
) -> (Vec<Vec<i64>>, Tensor, GenerationStats) {
    run_with(m, params, graphs, None, |_| {})
}

/// [`run`] with one of the engine's reference paths chosen by `tweak`.
fn run_tweaked(
    m: &Transformer,
    params: &SamplingParams,
    graphs: bool,
    tweak: fn(&mut EngineConfig),
) -> (Vec<Vec<i64>>, Tensor, GenerationStats) {
    run_with(m, params, graphs, None, tweak)
}

fn run_with(
    m: &Transformer,
    params: &SamplingParams,
    graphs: bool,
    kv_cache_tokens: Option<usize>,
    tweak: fn(&mut EngineConfig),
) -> (Vec<Vec<i64>>, Tensor, GenerationStats) {
    tch::manual_seed(1);
    let ids = Tensor::randint(300, [6, 11], (Kind::Int64, Device::Cpu));
    // Ragged left-padded prompts: 11, 9, 7, 5, 3 and 1 tokens.
    let mask = Tensor::from_slice(
        &(0..6)
            .flat_map(|r| (0..11).map(move |c| i64::from(c >= 2 * r)))
            .collect::<Vec<_>>(),
    )
    .view([6, 11]);
    let (ids, mask) = (ids.to_device(m.device()), mask.to_device(m.device()));
    let mut config = EngineConfig {
        block_size: 4,
        cuda_graphs: graphs,
        kv_cache_tokens,
        ..EngineConfig::default()
    };
    tweak(&mut config);
    let (g, s) = generate_with_config(m, &ids, &mask, params, None, &config).unwrap();
    let rows = Vec::<Vec<i64>>::try_from(&g.responses.to_device(Device::Cpu)).unwrap();
    let lp = g.log_probs.expect("log-probs").to_device(Device::Cpu);
    (rows, lp, s)
}

fn check(m: &Transformer, params: &SamplingParams) {
    // The gather + SDPA decode path (no kernel, no graphs) is the reference for both.
    let (gathered, gathered_lp, _) =
        run_tweaked(m, params, false, |c| c.paged_attention_kernel = false);
    let (eager, eager_lp, es) = run(m, params, false);
    assert_eq!(gathered, eager, "the paged-attention kernel changed tokens");
    let d = (&gathered_lp - &eager_lp).abs().max().double_value(&[]);
    assert!(
        d < 1e-4,
        "kernel log-probs differ from the gather path by {d}"
    );
    let (graphed, graphed_lp, gs) = run(m, params, true);
    assert_eq!(es.cuda_graphs, 0);
    assert!(gs.cuda_graphs > 0, "no graph captured: {gs:?}");
    assert!(gs.cuda_graph_steps > gs.decode_steps / 2, "{gs:?}");
    // Async scheduling: most graphed steps were queued before the previous step's tokens
    // reached the host (rows ending by EOS decode once more, and that token is dropped).
    assert!(gs.overlapped_steps > gs.cuda_graph_steps / 2, "{gs:?}");
    assert_eq!(eager, graphed, "graphed decode changed tokens");
    let d = (&eager_lp - &graphed_lp).abs().max().double_value(&[]);
    assert!(d < 1e-4, "log-probs differ by {d}");
    if params.ignore_eos {
        // Every row decodes to max_new_tokens in one bucket, whose graph is captured while the
        // device runs the prefill: every decode step replays it, the first one included.
        assert_eq!(gs.cuda_graph_steps, gs.decode_steps, "{gs:?}");
        assert_eq!(gs.cuda_graphs, 1, "{gs:?}");
        // Captured at its second use instead (the first step eager): the same tokens.
        let (late, late_lp, ls) =
            run_tweaked(m, params, true, |c| c.precapture_decode_graph = false);
        assert_eq!(ls.cuda_graph_steps + 1, ls.decode_steps, "{ls:?}");
        assert_eq!(
            eager, late,
            "graphs captured at their second use changed tokens"
        );
        let d = (&eager_lp - &late_lp).abs().max().double_value(&[]);
        assert!(d < 1e-4, "log-probs differ by {d}");
    }
    // And without it (each step waits for the host), the same.
    let (sync, sync_lp, ss) = run_tweaked(m, params, true, |c| c.async_decode = false);
    assert_eq!(ss.overlapped_steps, 0, "{ss:?}");
    assert_eq!(eager, sync, "synchronous graphed decode changed tokens");
    let d = (&eager_lp - &sync_lp).abs().max().double_value(&[]);
    assert!(d < 1e-4, "log-probs differ by {d}");
}

#[test]
#[ignore = "needs CUDA"]
fn graphed_decode_matches_eager_on_cuda() {
    let _turn = serial();
    cuda_device();
    let m = model(qwen2(), Kind::Float);
    let sampled = SamplingParams {
        n: 5,
        max_new_tokens: 40,
        do_sample: true,
        seed: Some(3),
        // Tokens below 12 end a row: lengths vary, the batch shrinks through many buckets.
        eos_token_ids: (0..12).collect(),
        return_log_probs: true,
        ..SamplingParams::default()
    };
    check(&m, &sampled);
    let greedy = SamplingParams {
        do_sample: false,
        ignore_eos: true,
        ..sampled.clone()
    };
    check(&m, &greedy);
    let mut windowed = qwen2();
    windowed["model_type"] = json!("mistral");
    windowed["sliding_window"] = json!(6);
    check(&model(windowed, Kind::Float), &sampled);
}

/// A KV pool too small for every sequence at once: preemption, readmission and continuous
/// batching between graphed steps, which async scheduling queues ahead of the host, give the
/// tokens of the eager engine.
#[test]
#[ignore = "needs CUDA"]
fn graphed_async_decode_with_preemption_matches_eager_on_cuda() {
    let _turn = serial();
    cuda_device();
    let m = model(qwen2(), Kind::Float);
    let params = SamplingParams {
        n: 5,
        max_new_tokens: 40,
        do_sample: true,
        seed: Some(5),
        eos_token_ids: (0..6).collect(),
        return_log_probs: true,
        ..SamplingParams::default()
    };
    let (eager, eager_lp, es) = run_with(&m, &params, false, Some(240), |_| {});
    let (graphed, graphed_lp, gs) = run_with(&m, &params, true, Some(240), |_| {});
    assert!(es.preemptions > 0 && gs.preemptions > 0, "{es:?}\n{gs:?}");
    assert!(gs.overlapped_steps > 0, "{gs:?}");
    assert_eq!(eager, graphed, "graphed decode changed tokens");
    let d = (&eager_lp - &graphed_lp).abs().max().double_value(&[]);
    assert!(d < 1e-4, "log-probs differ by {d}");
}

/// Mean and max |rollout log-prob − scoring-forward log-prob| over the generated tokens, with the
/// model's consistent attention `on` for both the engine and the forward.
fn rollout_vs_forward(m: &mut Transformer, on: bool) -> (f64, f64) {
    m.set_consistent_attention(on);
    let (b, p, n) = (4i64, 13i64, 3i64);
    tch::manual_seed(2);
    let ids = Tensor::randint(300, [b, p], (Kind::Int64, Device::Cpu));
    // Left-padded prompts of 13, 10, 7 and 4 tokens.
    let lens: Vec<i64> = (0..b).map(|r| p - 3 * r).collect();
    let mask = Tensor::from_slice(
        &(0..b)
            .flat_map(|r| (0..p).map(move |c| i64::from(c >= 3 * r)))
            .collect::<Vec<_>>(),
    )
    .view([b, p]);
    let params = SamplingParams {
        n: n as usize,
        max_new_tokens: 37,
        do_sample: true,
        seed: Some(11),
        ignore_eos: true,
        return_log_probs: true,
        ..SamplingParams::default()
    };
    let config = EngineConfig {
        block_size: 16,
        ..EngineConfig::default()
    };
    let dev = m.device();
    let (g, _) = generate_with_config(
        m,
        &ids.to_device(dev),
        &mask.to_device(dev),
        &params,
        None,
        &config,
    )
    .unwrap();
    let rollout_lp = g.log_probs.expect("log-probs").to_device(Device::Cpu);
    let resp = g.responses.to_device(Device::Cpu);
    let r = resp.size()[1];
    // The scoring layout of the training passes: each row's real tokens first (prompt ‖ response),
    // padding after them, no mask (causal attention keeps real tokens from the padding).
    let rows = b * n;
    let width = p + r;
    let mut input = vec![0i64; (rows * width) as usize];
    for (row, &prompt) in g.prompt_index.iter().enumerate() {
        let len = lens[prompt as usize];
        let prompt_ids = Vec::<i64>::try_from(&ids.get(prompt).narrow(0, p - len, len)).unwrap();
        let resp_ids = Vec::<i64>::try_from(&resp.get(row as i64)).unwrap();
        let at = row * width as usize;
        input[at..at + len as usize].copy_from_slice(&prompt_ids);
        input[at + len as usize..at + (len + r) as usize].copy_from_slice(&resp_ids);
    }
    let input = Tensor::from_slice(&input)
        .view([rows, width])
        .to_device(dev);
    let (mut sum, mut max) = (0f64, 0f64);
    tch::no_grad(|| {
        let hidden = m.forward_hidden(&input, None, None, None).unwrap();
        let w = m.lm_head_weight().unwrap();
        for (row, &prompt) in g.prompt_index.iter().enumerate() {
            let len = lens[prompt as usize];
            // States len-1 .. len+r-2 predict the r response tokens.
            let h = hidden.get(row as i64).narrow(0, len - 1, r);
            let logits = verl_nn::linear_fp32(&h, w).unwrap();
            let lp = logits
                .log_softmax(-1, Kind::Float)
                .gather(1, &resp.get(row as i64).to_device(dev).unsqueeze(1), false)
                .squeeze_dim(1)
                .to_device(Device::Cpu);
            let d = (&lp - rollout_lp.get(row as i64)).abs();
            sum += d.sum(Kind::Double).double_value(&[]);
            max = max.max(d.max().double_value(&[]));
        }
    });
    (sum / (rows * r) as f64, max)
}

#[test]
#[ignore = "needs CUDA"]
fn consistent_attention_makes_rollout_log_probs_match_the_scoring_forward_on_cuda() {
    let _turn = serial();
    cuda_device();
    // bf16, head_dim 64 (the tensor-core kernel) and 32 (the CUDA-core kernel).
    for (hidden, heads) in [(256, 4), (128, 4)] {
        let mut cfg = qwen2();
        cfg["hidden_size"] = json!(hidden);
        cfg["num_attention_heads"] = json!(heads);
        let mut m = model(cfg, Kind::BFloat16);
        let (off_mean, off_max) = rollout_vs_forward(&mut m, false);
        let (on_mean, on_max) = rollout_vs_forward(&mut m, true);
        eprintln!(
            "head_dim {}: flash forward mean {off_mean:.3e} max {off_max:.3e}; \
             consistent mean {on_mean:.3e} max {on_max:.3e}",
            hidden / heads
        );
        assert!(
            on_mean < 1e-5 && on_max < 1e-3,
            "consistent: {on_mean} / {on_max}"
        );
        assert!(
            off_mean > 10.0 * on_mean,
            "flash {off_mean} vs consistent {on_mean}"
        );
    }
}
