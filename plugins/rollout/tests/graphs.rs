//! Decode CUDA graphs and the paged-attention kernel (GPU only; skipped with a note on a machine
//! without CUDA): the paged engine with the kernel, and replaying captured decode steps, gives
//! the tokens and log-probs of the gather + SDPA path, across ragged lengths, EOS, sliding
//! windows and batch shrinkage (many buckets).

use serde_json::json;
use tch::{Device, Kind, Tensor};
use verl_nn::{ModelConfig, ModelOptions, Transformer};
use verl_rollout::{generate_with_config, EngineConfig, GenerationStats, SamplingParams};

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
    let config = EngineConfig {
        block_size: 4,
        cuda_graphs: graphs,
        ..EngineConfig::default()
    };
    let (g, s) = generate_with_config(m, &ids, &mask, params, None, &config).unwrap();
    let rows = Vec::<Vec<i64>>::try_from(&g.responses.to_device(Device::Cpu)).unwrap();
    let lp = g.log_probs.expect("log-probs").to_device(Device::Cpu);
    (rows, lp, s)
}

fn check(m: &Transformer, params: &SamplingParams) {
    // The gather + SDPA decode path (no kernel, no graphs) is the reference for both.
    std::env::set_var("VERL_PAGED_ATTENTION_KERNEL", "0");
    let (gathered, gathered_lp, _) = run(m, params, false);
    std::env::remove_var("VERL_PAGED_ATTENTION_KERNEL");
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
    assert_eq!(eager, graphed, "graphed decode changed tokens");
    let d = (&eager_lp - &graphed_lp).abs().max().double_value(&[]);
    assert!(d < 1e-4, "log-probs differ by {d}");
}

#[test]
fn graphed_decode_matches_eager() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
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
