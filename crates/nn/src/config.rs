//! Typed view of an HF `config.json` for the decoder-only families we implement.
//!
//! Defaults for absent keys follow the corresponding transformers `*Config` class, so a config that
//! transformers accepts means the same thing here. The raw JSON is kept so `save_pretrained` can write
//! back every key we do not model (tokenizer ids, generation defaults, ...).

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{NnError, Result};

/// Model families we implement, keyed by HF `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Mixtral,
    Qwen2Moe,
    Qwen3Moe,
}

impl Arch {
    pub const ALL: [Arch; 7] = [
        Arch::Llama,
        Arch::Mistral,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Mixtral,
        Arch::Qwen2Moe,
        Arch::Qwen3Moe,
    ];

    /// The HF `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Mixtral => "mixtral",
            Arch::Qwen2Moe => "qwen2_moe",
            Arch::Qwen3Moe => "qwen3_moe",
        }
    }

    /// Class-name prefix of the HF model classes (`LlamaForCausalLM`, ...).
    pub fn class_prefix(self) -> &'static str {
        match self {
            Arch::Llama => "Llama",
            Arch::Mistral => "Mistral",
            Arch::Qwen2 => "Qwen2",
            Arch::Qwen3 => "Qwen3",
            Arch::Mixtral => "Mixtral",
            Arch::Qwen2Moe => "Qwen2Moe",
            Arch::Qwen3Moe => "Qwen3Moe",
        }
    }

    pub fn from_model_type(s: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.model_type() == s)
    }

    /// HF class names we accept in `architectures` for this family.
    pub fn supported_architectures(self) -> Vec<String> {
        [
            "ForCausalLM",
            "ForSequenceClassification",
            "ForTokenClassification",
            "ForRewardModel",
            "Model",
        ]
        .iter()
        .map(|s| format!("{}{}", self.class_prefix(), s))
        .collect()
    }

    fn supported_model_types() -> String {
        Arch::ALL
            .iter()
            .map(|a| a.model_type())
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn is_moe(self) -> bool {
        matches!(self, Arch::Mixtral | Arch::Qwen2Moe | Arch::Qwen3Moe)
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.model_type())
    }
}

/// RoPE frequency scaling (`rope_scaling` in config.json).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Position interpolation: every inverse frequency divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1 wavelength-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// Mixture-of-experts settings, present for Mixtral / Qwen2-MoE / Qwen3-MoE.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: i64,
    pub top_k: i64,
    /// Hidden size of each routed expert's MLP.
    pub expert_intermediate_size: i64,
    /// Renormalise the top-k routing weights to sum to one (always true for Mixtral).
    pub norm_topk_prob: bool,
    /// Qwen2-MoE: size of the always-on shared expert (gated by a sigmoid); `None` when absent.
    pub shared_expert_intermediate_size: Option<i64>,
    /// Per layer: sparse MoE block (true) or dense MLP of `intermediate_size` (false).
    pub sparse_layers: Vec<bool>,
}

/// A validated model config. Field meanings follow HF; derived per-layer facts are precomputed.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: i64,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections.
    pub qkv_bias: bool,
    /// Bias on the attention output projection.
    pub o_bias: bool,
    /// Bias on gate/up/down projections (Llama `mlp_bias`).
    pub mlp_bias: bool,
    /// Qwen3: RMSNorm over each head's q and k before RoPE.
    pub qk_norm: bool,
    /// Per layer: sliding-window size, `None` for full attention.
    pub layer_windows: Vec<Option<i64>>,
    pub moe: Option<MoeConfig>,
    pub pad_token_id: Option<i64>,
    pub eos_token_ids: Vec<i64>,
    /// Outputs of the sequence-classification head (`len(id2label)` or `num_labels`, HF default 2).
    pub num_labels: i64,
    pub initializer_range: f64,
    /// The full original JSON, rewritten by `save_pretrained`.
    pub raw: Value,
}

/// Reads keys out of the JSON object with errors that name file and key.
struct Keys<'a> {
    path: &'a Path,
    obj: &'a Map<String, Value>,
}

impl<'a> Keys<'a> {
    fn bad(&self, key: &str, expected: &str, found: &Value) -> NnError {
        NnError::InvalidConfig {
            path: self.path.to_path_buf(),
            key: key.to_string(),
            expected: expected.to_string(),
            found: found.to_string(),
        }
    }

    fn missing(&self, key: &str, expected: &str) -> NnError {
        NnError::InvalidConfig {
            path: self.path.to_path_buf(),
            key: key.to_string(),
            expected: expected.to_string(),
            found: "no such key".to_string(),
        }
    }

    /// `None` when absent or null.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn opt_i64(&self, key: &str) -> Result<Option<i64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_i64()
                .map(Some)
                .ok_or_else(|| self.bad(key, "an integer", v)),
        }
    }

    fn pos_i64(&self, key: &str) -> Result<i64> {
        match self.opt_i64(key)? {
            None => Err(self.missing(key, "a positive integer")),
            Some(v) if v > 0 => Ok(v),
            Some(v) => Err(self.bad(key, "a positive integer", &Value::from(v))),
        }
    }

    fn pos_i64_or(&self, key: &str, default: i64) -> Result<i64> {
        match self.opt_i64(key)? {
            None => Ok(default),
            Some(v) if v > 0 => Ok(v),
            Some(v) => Err(self.bad(key, "a positive integer", &Value::from(v))),
        }
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| self.bad(key, "a number", v)),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.bad(key, "true or false", v)),
        }
    }

    fn i64_list(&self, key: &str) -> Result<Vec<i64>> {
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_i64().ok_or_else(|| {
                        self.bad(key, "a list of integers", &Value::Array(items.clone()))
                    })
                })
                .collect(),
            Some(v) => Err(self.bad(key, "a list of integers", v)),
        }
    }

    /// An integer or a list of integers (`eos_token_id`).
    fn i64_or_list(&self, key: &str) -> Result<Vec<i64>> {
        match self.get(key) {
            Some(v) if v.is_i64() => Ok(vec![v.as_i64().unwrap_or_default()]),
            _ => self.i64_list(key),
        }
    }
}

impl ModelConfig {
    /// Reads `<dir>/config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<ModelConfig> {
        let path = dir.as_ref().join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| NnError::Io {
            path: path.clone(),
            source,
        })?;
        ModelConfig::from_json_str(&text, &path)
    }

    /// Parses config JSON text; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: impl AsRef<Path>) -> Result<ModelConfig> {
        let path = path.as_ref();
        let raw: Value = serde_json::from_str(text).map_err(|source| NnError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        ModelConfig::from_value(raw, path)
    }

    pub fn from_value(raw: Value, path: impl AsRef<Path>) -> Result<ModelConfig> {
        let path = path.as_ref();
        let obj = raw.as_object().ok_or_else(|| NnError::InvalidConfig {
            path: path.to_path_buf(),
            key: "<root>".into(),
            expected: "a JSON object".into(),
            found: short(&raw),
        })?;
        let k = Keys { path, obj };

        let model_type = match k.get("model_type") {
            Some(Value::String(s)) => s.clone(),
            Some(v) => return Err(k.bad("model_type", "a string", v)),
            None => return Err(k.missing("model_type", "one of the supported model types")),
        };
        let arch =
            Arch::from_model_type(&model_type).ok_or_else(|| NnError::UnsupportedModelType {
                path: path.to_path_buf(),
                found: model_type.clone(),
                supported: Arch::supported_model_types(),
            })?;
        if let Some(v) = k.get("architectures") {
            let list = v
                .as_array()
                .ok_or_else(|| k.bad("architectures", "a list of class names", v))?;
            let supported = arch.supported_architectures();
            for a in list {
                let name = a
                    .as_str()
                    .ok_or_else(|| k.bad("architectures", "a list of class names", v))?;
                if !supported.iter().any(|s| s == name) {
                    return Err(NnError::UnsupportedArchitecture {
                        path: path.to_path_buf(),
                        model_type,
                        found: name.to_string(),
                        supported: supported.join(", "),
                    });
                }
            }
        }

        let vocab_size = k.pos_i64("vocab_size")?;
        let hidden_size = k.pos_i64("hidden_size")?;
        let intermediate_size = k.pos_i64("intermediate_size")?;
        let num_hidden_layers = k.pos_i64("num_hidden_layers")?;
        let num_attention_heads = k.pos_i64("num_attention_heads")?;
        let kv_default = match arch {
            Arch::Llama => num_attention_heads,
            Arch::Mistral | Arch::Mixtral => 8,
            Arch::Qwen2 | Arch::Qwen3 => 32,
            Arch::Qwen2Moe => 16,
            Arch::Qwen3Moe => 4,
        };
        let num_key_value_heads = k.pos_i64_or("num_key_value_heads", kv_default)?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(k.bad(
                "num_key_value_heads",
                &format!("a divisor of num_attention_heads ({num_attention_heads})"),
                &Value::from(num_key_value_heads),
            ));
        }
        let head_dim = match k.opt_i64("head_dim")? {
            Some(d) if d > 0 => d,
            Some(d) => return Err(k.bad("head_dim", "a positive integer", &Value::from(d))),
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(k.bad(
                        "hidden_size",
                        &format!(
                            "a multiple of num_attention_heads ({num_attention_heads}) when head_dim is absent"
                        ),
                        &Value::from(hidden_size),
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim % 2 != 0 {
            return Err(k.bad(
                "head_dim",
                "an even number (RoPE rotates pairs)",
                &Value::from(head_dim),
            ));
        }

        match k.get("hidden_act") {
            None => {}
            Some(Value::String(s)) if s == "silu" || s == "swish" => {}
            Some(v) => {
                return Err(k.bad(
                    "hidden_act",
                    "\"silu\" (the only activation these families use)",
                    v,
                ))
            }
        }
        if let Some(v) = k.get("partial_rotary_factor") {
            if v.as_f64() != Some(1.0) {
                return Err(k.bad(
                    "partial_rotary_factor",
                    "1.0 (partial rotary is not implemented)",
                    v,
                ));
            }
        }

        let eps_default = if arch == Arch::Mixtral { 1e-5 } else { 1e-6 };
        let rms_norm_eps = k.f64_or("rms_norm_eps", eps_default)?;
        let theta_default = if arch == Arch::Mixtral { 1e6 } else { 1e4 };
        let max_position_embeddings = k.pos_i64_or("max_position_embeddings", 2048)?;
        // transformers >= 5 writes RoPE as `rope_parameters: {rope_type, rope_theta, factor, ...}`
        // (no top-level `rope_theta` or `rope_scaling`); older configs use those two keys.
        let (rope_theta, rope_scaling) = match k.get("rope_parameters") {
            Some(v) => {
                let obj = v
                    .as_object()
                    .ok_or_else(|| k.bad("rope_parameters", "an object", v))?;
                let sub = Keys { path: k.path, obj };
                let theta = match sub.get("rope_theta") {
                    Some(_) => sub.f64_or("rope_theta", theta_default)?,
                    None => k.f64_or("rope_theta", theta_default)?,
                };
                (
                    theta,
                    parse_rope_scaling(&k, "rope_parameters", max_position_embeddings)?,
                )
            }
            None => (
                k.f64_or("rope_theta", theta_default)?,
                parse_rope_scaling(&k, "rope_scaling", max_position_embeddings)?,
            ),
        };
        let tie_word_embeddings = k.bool_or("tie_word_embeddings", false)?;

        let (qkv_bias, o_bias, mlp_bias, qk_norm) = match arch {
            Arch::Llama => {
                let b = k.bool_or("attention_bias", false)?;
                (b, b, k.bool_or("mlp_bias", false)?, false)
            }
            Arch::Mistral | Arch::Mixtral => (false, false, false, false),
            Arch::Qwen2 => (true, false, false, false),
            Arch::Qwen2Moe => (k.bool_or("qkv_bias", true)?, false, false, false),
            Arch::Qwen3 | Arch::Qwen3Moe => {
                let b = k.bool_or("attention_bias", false)?;
                (b, b, false, true)
            }
        };

        let layer_windows = parse_windows(&k, arch, num_hidden_layers)?;
        let moe = if arch.is_moe() {
            Some(parse_moe(&k, arch, num_hidden_layers, intermediate_size)?)
        } else {
            None
        };

        let num_labels = match k.get("id2label") {
            Some(Value::Object(m)) => m.len() as i64,
            Some(v) => return Err(k.bad("id2label", "an object", v)),
            None => k.pos_i64_or("num_labels", 2)?,
        };

        Ok(ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings,
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm,
            layer_windows,
            moe,
            pad_token_id: k.opt_i64("pad_token_id")?,
            eos_token_ids: k.i64_or_list("eos_token_id")?,
            num_labels,
            initializer_range: k.f64_or("initializer_range", 0.02)?,
            raw,
        })
    }

    pub fn num_kv_groups(&self) -> i64 {
        self.num_attention_heads / self.num_key_value_heads
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 80 {
        format!("{}...", &s[..77])
    } else {
        s
    }
}

/// RoPE scaling from `key` (`rope_scaling`, or transformers 5's `rope_parameters`).
fn parse_rope_scaling(k: &Keys, key: &str, max_pos: i64) -> Result<Option<RopeScaling>> {
    let Some(v) = k.get(key) else {
        return Ok(None);
    };
    let obj = v
        .as_object()
        .ok_or_else(|| k.bad(key, "null or an object", v))?;
    let sub = Keys { path: k.path, obj };
    let kind = match sub.get("rope_type").or_else(|| sub.get("type")) {
        Some(Value::String(s)) => s.as_str(),
        Some(t) => return Err(k.bad(&format!("{key}.rope_type"), "a string", t)),
        None => {
            return Err(k.missing(
                &format!("{key}.rope_type"),
                "\"default\", \"linear\" or \"llama3\"",
            ))
        }
    };
    let factor = |sub: &Keys| -> Result<f64> {
        match sub.get("factor") {
            Some(f) => f
                .as_f64()
                .ok_or_else(|| k.bad(&format!("{key}.factor"), "a number", f)),
            None => Err(k.missing(&format!("{key}.factor"), "a number")),
        }
    };
    match kind {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear {
            factor: factor(&sub)?,
        })),
        "llama3" => {
            let num = |name: &str| -> Result<f64> {
                match sub.get(name) {
                    Some(f) => f
                        .as_f64()
                        .ok_or_else(|| k.bad(&format!("{key}.{name}"), "a number", f)),
                    None => Err(k.missing(&format!("{key}.{name}"), "a number")),
                }
            };
            let low = num("low_freq_factor")?;
            let high = num("high_freq_factor")?;
            if high == low {
                return Err(k.bad(
                    &format!("{key}.high_freq_factor"),
                    "a value different from low_freq_factor",
                    &Value::from(high),
                ));
            }
            let orig = match sub.get("original_max_position_embeddings") {
                Some(_) => num("original_max_position_embeddings")?,
                None => max_pos as f64,
            };
            Ok(Some(RopeScaling::Llama3 {
                factor: factor(&sub)?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: orig,
            }))
        }
        other => Err(k.bad(
            &format!("{key}.rope_type"),
            "\"default\", \"linear\" or \"llama3\" (others are not implemented)",
            &Value::from(other),
        )),
    }
}

fn parse_windows(k: &Keys, arch: Arch, layers: i64) -> Result<Vec<Option<i64>>> {
    let n = layers as usize;
    let window = k.opt_i64("sliding_window")?;
    if let Some(w) = window {
        if w <= 0 {
            return Err(k.bad(
                "sliding_window",
                "null or a positive integer",
                &Value::from(w),
            ));
        }
    }
    Ok(match arch {
        Arch::Llama => vec![None; n],
        // Mistral / Mixtral apply `sliding_window` (when non-null) to every layer.
        Arch::Mistral | Arch::Mixtral => vec![window; n],
        Arch::Qwen3Moe => {
            let w = if k.bool_or("use_sliding_window", false)? {
                window
            } else {
                None
            };
            vec![w; n]
        }
        Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Moe => {
            let w = if k.bool_or("use_sliding_window", false)? {
                window
            } else {
                None
            };
            let types = match (arch, k.get("layer_types")) {
                (Arch::Qwen2Moe, _) | (_, None) => None,
                (_, Some(Value::Array(items))) => {
                    let kinds: Option<Vec<&str>> = items.iter().map(|v| v.as_str()).collect();
                    match kinds {
                        Some(kinds) if kinds.len() == n => Some(kinds),
                        _ => {
                            return Err(k.bad(
                                "layer_types",
                                &format!("a list of {n} strings (num_hidden_layers)"),
                                &Value::Array(items.clone()),
                            ))
                        }
                    }
                }
                (_, Some(v)) => return Err(k.bad("layer_types", "a list of strings", v)),
            };
            let max_window_layers = k.opt_i64("max_window_layers")?.unwrap_or(28);
            (0..n)
                .map(|i| {
                    let sliding = match &types {
                        Some(kinds) => kinds[i] == "sliding_attention",
                        None => i as i64 >= max_window_layers,
                    };
                    if sliding {
                        w
                    } else {
                        None
                    }
                })
                .collect()
        }
    })
}

fn parse_moe(k: &Keys, arch: Arch, layers: i64, intermediate_size: i64) -> Result<MoeConfig> {
    let n = layers as usize;
    Ok(match arch {
        Arch::Mixtral => MoeConfig {
            num_experts: k.pos_i64_or("num_local_experts", 8)?,
            top_k: k.pos_i64_or("num_experts_per_tok", 2)?,
            expert_intermediate_size: intermediate_size,
            norm_topk_prob: true,
            shared_expert_intermediate_size: None,
            sparse_layers: vec![true; n],
        },
        _ => {
            let (experts, top_k, moe_inter, shared) = if arch == Arch::Qwen2Moe {
                (
                    60,
                    4,
                    1408,
                    Some(k.pos_i64_or("shared_expert_intermediate_size", 5632)?),
                )
            } else {
                (128, 8, 768, None)
            };
            let num_experts = match k.opt_i64("num_experts")? {
                None => experts,
                Some(e) if e >= 0 => e,
                Some(e) => {
                    return Err(k.bad("num_experts", "a non-negative integer", &Value::from(e)))
                }
            };
            let step = k.pos_i64_or("decoder_sparse_step", 1)?;
            let mlp_only = k.i64_list("mlp_only_layers")?;
            let sparse_layers = (0..layers)
                .map(|i| !mlp_only.contains(&i) && num_experts > 0 && (i + 1) % step == 0)
                .collect();
            MoeConfig {
                num_experts,
                top_k: k.pos_i64_or("num_experts_per_tok", top_k)?,
                expert_intermediate_size: k.pos_i64_or("moe_intermediate_size", moe_inter)?,
                norm_topk_prob: k.bool_or("norm_topk_prob", false)?,
                shared_expert_intermediate_size: shared,
                sparse_layers,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<ModelConfig> {
        ModelConfig::from_value(v, "test/config.json")
    }

    fn base(model_type: &str) -> Value {
        serde_json::json!({
            "model_type": model_type,
            "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        })
    }

    #[test]
    fn unsupported_model_type_lists_supported() {
        let err = parse(base("gpt2")).unwrap_err().to_string();
        assert!(err.contains("\"gpt2\""), "{err}");
        assert!(
            err.contains("llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe"),
            "{err}"
        );
        assert!(err.contains("test/config.json"), "{err}");
    }

    #[test]
    fn unsupported_architecture_is_named() {
        let mut v = base("llama");
        v["architectures"] = serde_json::json!(["LlamaForQuestionAnswering"]);
        let err = parse(v).unwrap_err().to_string();
        assert!(
            err.contains("LlamaForQuestionAnswering") && err.contains("LlamaForCausalLM"),
            "{err}"
        );
    }

    #[test]
    fn missing_and_mistyped_keys_are_named() {
        let mut v = base("qwen2");
        v.as_object_mut().unwrap().remove("hidden_size");
        let err = parse(v).unwrap_err().to_string();
        assert!(
            err.contains("`hidden_size`") && err.contains("no such key"),
            "{err}"
        );
        let mut v = base("qwen2");
        v["num_key_value_heads"] = serde_json::json!(3);
        let err = parse(v).unwrap_err().to_string();
        assert!(
            err.contains("num_key_value_heads") && err.contains("divisor"),
            "{err}"
        );
        let mut v = base("llama");
        v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
        let err = parse(v).unwrap_err().to_string();
        assert!(err.contains("yarn") && err.contains("llama3"), "{err}");
    }

    #[test]
    fn family_specific_fields() {
        let c = parse(base("qwen2")).unwrap();
        assert!(c.qkv_bias && !c.o_bias && !c.qk_norm && c.moe.is_none());
        assert_eq!(c.head_dim, 16);
        let mut v = base("qwen3");
        v["head_dim"] = serde_json::json!(32);
        let c = parse(v).unwrap();
        assert!(c.qk_norm && !c.qkv_bias);
        assert_eq!(c.head_dim, 32);
        let mut v = base("llama");
        v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
        v["eos_token_id"] = serde_json::json!([1, 2]);
        let c = parse(v).unwrap();
        assert!(
            matches!(c.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0)
        );
        assert_eq!(c.eos_token_ids, vec![1, 2]);
        let mut v = base("qwen3_moe");
        v["num_experts"] = serde_json::json!(4);
        v["mlp_only_layers"] = serde_json::json!([1]);
        v["norm_topk_prob"] = serde_json::json!(true);
        let c = parse(v).unwrap();
        let m = c.moe.unwrap();
        assert_eq!(m.sparse_layers, vec![true, false]);
        assert!(m.norm_topk_prob);
        let mut v = base("mistral");
        v["sliding_window"] = serde_json::json!(16);
        assert_eq!(parse(v).unwrap().layer_windows, vec![Some(16), Some(16)]);
        let mut v = base("qwen2");
        v["sliding_window"] = serde_json::json!(16);
        v["use_sliding_window"] = serde_json::json!(false);
        assert_eq!(parse(v).unwrap().layer_windows, vec![None, None]);
    }

    #[test]
    fn transformers_5_rope_parameters_are_read() {
        let mut v = serde_json::json!({
            "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        });
        let c = ModelConfig::from_value(v.clone(), "inline/config.json").unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert_eq!(c.rope_scaling, None);
        v["rope_parameters"] = serde_json::json!({"rope_type": "llama3", "rope_theta": 500000.0,
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192});
        let c = ModelConfig::from_value(v.clone(), "inline/config.json").unwrap();
        assert!(
            matches!(c.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0)
        );
        v["rope_parameters"] =
            serde_json::json!({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0});
        let e = ModelConfig::from_value(v, "inline/config.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rope_parameters.rope_type") && e.contains("yarn"),
            "{e}"
        );
    }
}
