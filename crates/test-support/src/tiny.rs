//! A tiny random Qwen2 model in memory (and saved as an HF folder) for the backends' unit tests.

use tch::Kind;
use verl_nn::{ModelConfig, ModelOptions, SaveOptions, Transformer};

pub const VOCAB: i64 = 40;

/// Two layers, hidden 32, GQA 4/2 heads, untied head; random weights from `seed`, on the CPU.
pub fn tiny_transformer(dtype: Kind, seed: i64) -> Transformer {
    // Seeding and drawing from libtorch's global generator as one step: tests run in parallel
    // threads, and one drawing in between would change this model's weights.
    static GLOBAL_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _only_us = GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(seed);
    let cfg = ModelConfig::from_value(
        serde_json::json!({
            "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
            "tie_word_embeddings": false, "initializer_range": 0.2,
            "pad_token_id": 0, "eos_token_id": 1,
        }),
        "inline/config.json",
    )
    .unwrap();
    Transformer::new(
        cfg,
        &ModelOptions {
            dtype,
            ..ModelOptions::default()
        },
    )
    .unwrap()
}

/// [`tiny_transformer`] (fp32) saved as an HF folder with an empty tokenizer config.
pub fn tiny_model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    tiny_transformer(Kind::Float, 5)
        .save_pretrained(dir.path(), &SaveOptions::default())
        .unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), "{}\n").unwrap();
    dir
}
