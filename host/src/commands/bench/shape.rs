//! The architectures `verl bench grpo` builds (the shapes of their public config.json, the same
//! numbers as `bench/trl_grpo.py`) and the FLOP and byte models its MFU and roofline use.

use anyhow::Context;
use serde_json::{json, Value};

/// The shapes of one architecture (from its public config.json).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    pub name: &'static str,
    pub model_type: &'static str,
    pub vocab: u64,
    pub hidden: u64,
    pub intermediate: u64,
    pub layers: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub max_positions: u64,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub tie_embeddings: bool,
}

/// The same numbers as `bench/trl_grpo.py`'s ARCHS.
pub const ARCHS: &[Shape] = &[
    Shape {
        name: "tiny",
        model_type: "qwen2",
        vocab: 1024,
        hidden: 64,
        intermediate: 128,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        max_positions: 4096,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-6,
        tie_embeddings: false,
    },
    Shape {
        name: "qwen2.5-0.5b",
        model_type: "qwen2",
        vocab: 151936,
        hidden: 896,
        intermediate: 4864,
        layers: 24,
        heads: 14,
        kv_heads: 2,
        max_positions: 32768,
        rope_theta: 1000000.0,
        rms_norm_eps: 1e-6,
        tie_embeddings: true,
    },
    Shape {
        name: "qwen2.5-1.5b",
        model_type: "qwen2",
        vocab: 151936,
        hidden: 1536,
        intermediate: 8960,
        layers: 28,
        heads: 12,
        kv_heads: 2,
        max_positions: 32768,
        rope_theta: 1000000.0,
        rms_norm_eps: 1e-6,
        tie_embeddings: true,
    },
    Shape {
        name: "qwen2.5-7b",
        model_type: "qwen2",
        vocab: 152064,
        hidden: 3584,
        intermediate: 18944,
        layers: 28,
        heads: 28,
        kv_heads: 4,
        max_positions: 32768,
        rope_theta: 1000000.0,
        rms_norm_eps: 1e-6,
        tie_embeddings: false,
    },
    Shape {
        name: "llama3-8b",
        model_type: "llama",
        vocab: 128256,
        hidden: 4096,
        intermediate: 14336,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        max_positions: 8192,
        rope_theta: 500000.0,
        rms_norm_eps: 1e-5,
        tie_embeddings: false,
    },
];

pub fn shape(name: &str) -> anyhow::Result<Shape> {
    ARCHS
        .iter()
        .copied()
        .find(|s| s.name == name)
        .with_context(|| {
            let names: Vec<&str> = ARCHS.iter().map(|s| s.name).collect();
            format!("--arch {name:?}: expected one of {}", names.join(", "))
        })
}

/// bf16: two bytes per parameter and per cached K/V element.
const BF16_BYTES: u64 = 2;

impl Shape {
    pub fn head_dim(&self) -> u64 {
        self.hidden / self.heads
    }
    /// Width of the attention (heads × head_dim).
    pub fn attn_dim(&self) -> u64 {
        self.heads * self.head_dim()
    }
    fn kv_dim(&self) -> u64 {
        self.kv_heads * self.head_dim()
    }
    fn qkv_bias(&self) -> bool {
        self.model_type == "qwen2"
    }
    /// Weights of the matmuls one token goes through: every decoder layer's projections plus the
    /// LM head (tied or not: the head matmul runs either way). The embedding lookup is no matmul.
    pub fn matmul_params(&self) -> u64 {
        let (h, a, kv, i) = (
            self.hidden,
            self.attn_dim(),
            self.kv_dim(),
            self.intermediate,
        );
        let layer = h * a + 2 * h * kv + a * h + 3 * h * i;
        self.layers * layer + self.vocab * h
    }
    /// Every parameter, each once (what `sum(p.numel() for p in model.parameters())` counts).
    pub fn n_params(&self) -> u64 {
        let (h, a, kv) = (self.hidden, self.attn_dim(), self.kv_dim());
        let bias = if self.qkv_bias() { a + 2 * kv } else { 0 };
        let norms = 2 * h;
        let head = if self.tie_embeddings {
            0
        } else {
            self.vocab * h
        };
        self.vocab * h + self.layers * (self.matmul_params_per_layer() + bias + norms) + h + head
    }
    fn matmul_params_per_layer(&self) -> u64 {
        (self.matmul_params() - self.vocab * self.hidden) / self.layers
    }
    /// Bytes of K and V cached per token (all layers).
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * self.layers * self.kv_dim() * BF16_BYTES
    }

    /// HF `config.json` of this architecture (EOS = pad = the last id, like `bench/trl_grpo.py`).
    pub fn config_json(&self) -> Value {
        let class = match self.model_type {
            "llama" => "LlamaForCausalLM",
            _ => "Qwen2ForCausalLM",
        };
        let mut c = json!({
            "architectures": [class],
            "model_type": self.model_type,
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "max_position_embeddings": self.max_positions,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "torch_dtype": "bfloat16",
            "eos_token_id": self.vocab - 1,
            "pad_token_id": self.vocab - 1,
            "use_cache": true,
        });
        if self.model_type == "llama" {
            c["attention_bias"] = json!(false);
            c["mlp_bias"] = json!(false);
        }
        c
    }
}

/// FLOPs of one forward pass over `seqs` sequences of `len` tokens:
/// `2·N·tokens` (N = [`Shape::matmul_params`]) plus attention `4·layers·attn_dim·len²` per sequence
/// (Q·Kᵀ and P·V, the full square counted, causal masking not halved — the PaLM/Megatron convention).
pub fn forward_flops(s: &Shape, seqs: u64, len: u64) -> f64 {
    let linear = 2.0 * s.matmul_params() as f64 * (seqs * len) as f64;
    let attn = 4.0 * (s.layers * s.attn_dim()) as f64 * (len * len) as f64 * seqs as f64;
    linear + attn
}

/// FLOPs of a reward model's forward over `seqs` sequences of `len` tokens: [`forward_flops`]
/// with a one-output score head instead of the vocabulary head.
pub fn rm_forward_flops(s: &Shape, seqs: u64, len: u64) -> f64 {
    let tokens = (seqs * len) as f64;
    forward_flops(s, seqs, len) - 2.0 * (s.vocab * s.hidden) as f64 * tokens
        + 2.0 * s.hidden as f64 * tokens
}

/// FLOPs of a training pass (forward + backward = 3 × forward): `6·N·tokens +
/// 12·layers·attn_dim·len²` per sequence. Activation recompute is not counted.
pub fn train_flops(s: &Shape, seqs: u64, len: u64) -> f64 {
    3.0 * forward_flops(s, seqs, len)
}

/// FLOPs of a LoRA training pass: [`train_flops`] without the base's weight-gradient GEMMs
/// (`2·N_matmul·tokens`; the frozen base needs only its input gradients). The adapters' own
/// GEMMs (`6·r·(in+out)` per projection and token, about 2% at rank 64 on 7B) are not counted.
pub fn lora_train_flops(s: &Shape, seqs: u64, len: u64) -> f64 {
    train_flops(s, seqs, len) - 2.0 * s.matmul_params() as f64 * (seqs * len) as f64
}

/// FLOPs of generating `resp` tokens for each of `seqs` sequences after a `prompt`-token prefill:
/// the prefill ([`forward_flops`] over the prompt) yields the first token; each of the `resp − 1`
/// decode steps runs one token through the matmuls (`2·N`) and attends over its context
/// (`4·layers·attn_dim·ctx`, ctx = prompt + k for step k = 1..resp−1).
pub fn generate_flops(s: &Shape, seqs: u64, prompt: u64, resp: u64) -> f64 {
    let steps = resp.saturating_sub(1);
    let ctx_sum = (steps * prompt + steps * (steps + 1) / 2) as f64;
    forward_flops(s, seqs, prompt)
        + seqs as f64
            * (2.0 * s.matmul_params() as f64 * steps as f64
                + 4.0 * (s.layers * s.attn_dim()) as f64 * ctx_sum)
}

/// Bytes a decode step must read from device memory at least: every matmul weight once (bf16)
/// plus the K/V cache of `seqs` sequences at context `ctx`.
pub fn decode_step_bytes(s: &Shape, seqs: u64, ctx: f64) -> f64 {
    (s.matmul_params() * BF16_BYTES) as f64 + seqs as f64 * ctx * s.kv_bytes_per_token() as f64
}

/// The decode steps' memory-roofline time: `(resp − 1)` steps × [`decode_step_bytes`] at the mean
/// context of those steps (prompt + resp/2) over the bandwidth `gbps` (1e9 B/s).
pub fn decode_roofline_s(s: &Shape, seqs: u64, prompt: u64, resp: u64, gbps: f64) -> f64 {
    let steps = resp.saturating_sub(1);
    let mean_ctx = prompt as f64 + resp as f64 / 2.0;
    steps as f64 * decode_step_bytes(s, seqs, mean_ctx) / (gbps * 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy() -> Shape {
        // hidden 4, 2 heads (head_dim 2), 1 kv head, intermediate 8, 1 layer, vocab 10, llama.
        Shape {
            name: "toy",
            model_type: "llama",
            vocab: 10,
            hidden: 4,
            intermediate: 8,
            layers: 1,
            heads: 2,
            kv_heads: 1,
            max_positions: 64,
            rope_theta: 1e4,
            rms_norm_eps: 1e-6,
            tie_embeddings: false,
        }
    }

    #[test]
    fn parameter_counts_by_hand() {
        let s = toy();
        // q 4·4 + k 4·2 + v 4·2 + o 4·4 = 48; mlp 3·4·8 = 96; head 10·4 = 40.
        assert_eq!(s.matmul_params(), 48 + 96 + 40);
        // + embedding 40 + 2 layer norms 8 + final norm 4.
        assert_eq!(s.n_params(), 184 + 40 + 8 + 4);
        // k and v: 2 · 1 layer · 2 (kv dim) · 2 bytes.
        assert_eq!(s.kv_bytes_per_token(), 8);
        // Qwen2.5-0.5B: 494,032,768 parameters (the published count).
        assert_eq!(shape("qwen2.5-0.5b").unwrap().n_params(), 494_032_768);
        // Llama-3-8B: 8,030,261,248.
        assert_eq!(shape("llama3-8b").unwrap().n_params(), 8_030_261_248);
    }

    #[test]
    fn flop_and_byte_formulas_by_hand() {
        let s = toy();
        // 2 sequences of 3 tokens: 2·184·6 = 2208 linear; attention 4·1·4·9·2 = 288.
        assert_eq!(forward_flops(&s, 2, 3), 2208.0 + 288.0);
        assert_eq!(train_flops(&s, 2, 3), 3.0 * 2496.0);
        // prompt 3, 3 new tokens, 1 sequence: prefill 2·184·3 + 4·4·9 = 1248;
        // 2 decode steps at ctx 4 and 5: 2·(2·184) + 4·4·(4+5) = 736 + 144.
        assert_eq!(generate_flops(&s, 1, 3, 3), 1248.0 + 736.0 + 144.0);
        // Decode step bytes: weights 184·2 = 368 + 2 seqs · ctx 4 · 8 B = 64.
        assert_eq!(decode_step_bytes(&s, 2, 4.0), 432.0);
        // 2 steps at mean ctx 3 + 3/2 = 4.5: 2·(368 + 2·4.5·8) = 880 bytes at 1e-9 GB/s → 880 s.
        assert!((decode_roofline_s(&s, 2, 3, 3, 1e-9) - 880.0).abs() < 1e-9);
    }

    #[test]
    fn configs_match_the_python_reference_shapes() {
        let c = shape("qwen2.5-1.5b").unwrap().config_json();
        assert_eq!(c["hidden_size"], 1536);
        assert_eq!(c["tie_word_embeddings"], true);
        assert!(shape("gpt2").is_err());
    }
}
