//! `verl init-model`: a tiny model the project builds itself, in HF layout (`tokenizer.json`,
//! `tokenizer_config.json` with a ChatML template, a Qwen2 `config.json`, random-init
//! `model.safetensors`), so the quickstart's model loads by the same path as a real checkpoint.
//!
//! The host never links libtorch, so the weights are drawn here (seeded, HF's initialisation:
//! normal(0, initializer_range) for matrices, ones for norms, zeros for biases) and written in the
//! safetensors format directly: an 8-byte header length, a JSON header, the little-endian data.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use serde_json::json;

#[derive(clap::Args)]
pub struct InitModelArgs {
    /// The HF folder to write.
    #[arg(long)]
    out: PathBuf,
    /// Data files whose text trains the tokenizer (repeatable).
    #[arg(long, required = true)]
    data: Vec<PathBuf>,
    #[arg(long, default_value_t = 512)]
    vocab: usize,
    #[arg(long, default_value_t = 128)]
    hidden: usize,
    #[arg(long, default_value_t = 256)]
    intermediate: usize,
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    #[arg(long, default_value_t = 256)]
    max_positions: usize,
    #[arg(long, default_value_t = 0.02)]
    init_std: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// `verl init-model`: writes the folder and says what it holds.
pub fn run(a: &InitModelArgs) -> anyhow::Result<ExitCode> {
    let spec = ModelSpec {
        vocab: a.vocab,
        hidden: a.hidden,
        intermediate: a.intermediate,
        layers: a.layers,
        heads: a.heads,
        kv_heads: a.kv_heads,
        max_positions: a.max_positions,
        init_std: a.init_std,
        seed: a.seed,
    };
    let o = init_model(&a.out, &a.data, &spec)?;
    println!(
        "{} (vocab {}, {} parameters)",
        o.dir.display(),
        o.vocab,
        o.parameters
    );
    Ok(ExitCode::SUCCESS)
}

/// Special tokens, in id order: pad, then the ChatML markers (`<|im_end|>` is EOS).
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// Qwen2.5's template without the default system prompt and tool handling: the messages as
/// ChatML turns, plus the assistant header when asked for a generation prompt.
pub const CHATML_TEMPLATE: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// The shape of the model; `Default` is the quickstart's.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub max_positions: usize,
    pub init_std: f64,
    pub seed: u64,
}

impl Default for ModelSpec {
    fn default() -> Self {
        ModelSpec {
            vocab: 512,
            hidden: 128,
            intermediate: 256,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            max_positions: 256,
            init_std: 0.02,
            seed: 0,
        }
    }
}

/// What was written.
#[derive(Debug)]
pub struct InitOutput {
    pub dir: PathBuf,
    pub vocab: usize,
    pub parameters: usize,
}

/// splitmix64 → Box-Muller normals: deterministic on every platform, no RNG crate needed.
struct Normal(u64);
impl Normal {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn sample(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

enum Init {
    Normal,
    Ones,
    Zeros,
}

/// Writes `tensors` (fp32) as a safetensors file; names sorted, as the reference writer does.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
) -> anyhow::Result<()> {
    let mut order: Vec<&(String, Vec<usize>, Vec<f32>)> = tensors.iter().collect();
    order.sort_by(|a, b| a.0.cmp(&b.0));
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for (name, shape, data) in &order {
        let n: usize = shape.iter().product();
        if n != data.len() {
            bail!(
                "tensor `{name}`: shape {shape:?} needs {n} values, found {}",
                data.len()
            );
        }
        header.insert(
            name.clone(),
            json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + 4 * n]}),
        );
        offset += 4 * n;
    }
    let mut head = serde_json::Value::Object(header).to_string().into_bytes();
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    let mut bytes = Vec::with_capacity(8 + head.len() + offset);
    bytes.extend_from_slice(&(head.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&head);
    for (_, _, data) in &order {
        for v in data {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
    }
    std::fs::write(path, bytes).with_context(|| format!("cannot write {}", path.display()))
}

/// Trains the tokenizer on every string of `data` and writes the whole HF folder into `out`.
pub fn init_model(out: &Path, data: &[PathBuf], spec: &ModelSpec) -> anyhow::Result<InitOutput> {
    if !spec.hidden.is_multiple_of(spec.heads) || !spec.heads.is_multiple_of(spec.kv_heads) {
        bail!(
            "--hidden {} must be a multiple of --heads {}, and --heads a multiple of --kv-heads {}",
            spec.hidden,
            spec.heads,
            spec.kv_heads
        );
    }
    let corpus = verl_data::text_corpus(data)?;
    if corpus.is_empty() {
        bail!("no text in {data:?} to train the tokenizer on");
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let tok = verl_chat::train_bpe(&corpus, spec.vocab, &SPECIAL_TOKENS)?;
    let tok_path = out.join("tokenizer.json");
    tok.save(&tok_path, false)
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", tok_path.display()))?;
    // The trainer stops early when the corpus has fewer distinct merges than asked for.
    let vocab = tok.get_vocab_size(true);
    let id = |t: &str| {
        tok.token_to_id(t)
            .expect("special token registered by train_bpe")
    };
    let (pad, eos) = (id(SPECIAL_TOKENS[0]), id(SPECIAL_TOKENS[2]));
    let write_json = |name: &str, v: serde_json::Value| -> anyhow::Result<()> {
        let p = out.join(name);
        std::fs::write(&p, serde_json::to_string_pretty(&v)? + "\n")
            .with_context(|| format!("cannot write {}", p.display()))
    };
    write_json(
        "tokenizer_config.json",
        json!({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": null,
               "eos_token": SPECIAL_TOKENS[2], "pad_token": SPECIAL_TOKENS[0],
               "model_max_length": spec.max_positions, "chat_template": CHATML_TEMPLATE}),
    )?;
    let hd = spec.hidden / spec.heads;
    write_json(
        "config.json",
        json!({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab,
            "hidden_size": spec.hidden, "intermediate_size": spec.intermediate,
            "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads, "max_position_embeddings": spec.max_positions,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true,
            "hidden_act": "silu", "initializer_range": spec.init_std, "torch_dtype": "float32",
            "use_sliding_window": false, "attention_dropout": 0.0,
            "bos_token_id": null, "eos_token_id": eos, "pad_token_id": pad
        }),
    )?;
    write_json(
        "generation_config.json",
        json!({"eos_token_id": eos, "pad_token_id": pad, "do_sample": false}),
    )?;

    let mut rng = Normal(spec.seed ^ 0x0005_EED0_FA11);
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, init: Init| {
        let n: usize = shape.iter().product();
        let data = (0..n)
            .map(|_| match init {
                Init::Normal => (rng.sample() * spec.init_std) as f32,
                Init::Ones => 1.0,
                Init::Zeros => 0.0,
            })
            .collect();
        tensors.push((name, shape, data));
    };
    let (h, i) = (spec.hidden, spec.intermediate);
    add(
        "model.embed_tokens.weight".into(),
        vec![vocab, h],
        Init::Normal,
    );
    for l in 0..spec.layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), vec![h], Init::Ones);
        add(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            Init::Ones,
        );
        for (proj, rows) in [
            ("q", spec.heads * hd),
            ("k", spec.kv_heads * hd),
            ("v", spec.kv_heads * hd),
        ] {
            add(
                format!("{p}.self_attn.{proj}_proj.weight"),
                vec![rows, h],
                Init::Normal,
            );
            add(
                format!("{p}.self_attn.{proj}_proj.bias"),
                vec![rows],
                Init::Zeros,
            );
        }
        add(
            format!("{p}.self_attn.o_proj.weight"),
            vec![h, spec.heads * hd],
            Init::Normal,
        );
        add(
            format!("{p}.mlp.gate_proj.weight"),
            vec![i, h],
            Init::Normal,
        );
        add(format!("{p}.mlp.up_proj.weight"), vec![i, h], Init::Normal);
        add(
            format!("{p}.mlp.down_proj.weight"),
            vec![h, i],
            Init::Normal,
        );
    }
    add("model.norm.weight".into(), vec![h], Init::Ones);
    let parameters = tensors.iter().map(|t| t.2.len()).sum();
    write_safetensors(&out.join("model.safetensors"), &tensors)?;
    Ok(InitOutput {
        dir: out.to_path_buf(),
        vocab,
        parameters,
    })
}
