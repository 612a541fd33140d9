//! Tiny random HF-style model folders (`config.json`, safetensors, a stand-in
//! `tokenizer_config.json`) written by verl-nn, for the backends' tests.

use serde_json::{json, Value};
use verl_nn::{HeadKind, ModelConfig, ModelOptions, SaveOptions, Transformer};

/// The `config.json` of a tiny qwen2: 4 attention heads over 2 KV heads, RMS-norm eps 1e-6,
/// RoPE θ 10 000, weights drawn with std 0.2, pad id 0, eos id 1.
pub fn qwen2_config(
    vocab: i64,
    hidden: i64,
    intermediate: i64,
    layers: i64,
    max_positions: i64,
    tied: bool,
) -> Value {
    json!({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": max_positions,
        "tie_word_embeddings": tied, "initializer_range": 0.2,
        "pad_token_id": 0, "eos_token_id": 1,
    })
}

/// A random model of `config` with `head` (libtorch's generator seeded with `seed` first, when
/// given) saved into a fresh temp dir, with a stand-in `tokenizer_config.json`.
pub fn model_dir(config: Value, seed: Option<i64>, head: HeadKind) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ModelConfig::from_value(config, "inline/config.json").unwrap();
    if let Some(seed) = seed {
        tch::manual_seed(seed);
    }
    let model = Transformer::new(
        cfg,
        &ModelOptions {
            head,
            ..ModelOptions::default()
        },
    )
    .unwrap();
    model
        .save_pretrained(dir.path(), &SaveOptions::default())
        .unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), "{}\n").unwrap();
    dir
}
