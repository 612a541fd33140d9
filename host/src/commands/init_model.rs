//! `verl init-model`: a tiny model the project builds itself, in HF layout (`tokenizer.json`,
//! `tokenizer_config.json` with a ChatML template, a Qwen2 `config.json`, random-init
//! `model.safetensors`), so the quickstart's model loads by the same path as a real checkpoint.
//!
//! The tokenizer is trained on every string of the data files, plus, for files of multi-turn
//! conversations (a `messages` column, optionally `tools`), each conversation as the chat template
//! renders it, so the template's own text (tool list, `<tool_call>`, `<tool_response>`) is in the
//! corpus and becomes few tokens.
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
    /// Cut numbers into groups of at most this many digits (1: one token per digit, as Qwen2's
    /// tokenizer), so a number is the same tokens wherever it appears (a tool's result and the
    /// answer that copies it); default: GPT-2's digit runs.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=3))]
    digit_group: Option<u8>,
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
        digit_group: a.digit_group,
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
/// A compact Qwen2.5-shaped ChatML template without the default system prompt: the messages as
/// ChatML turns, plus the assistant header when asked for a generation prompt. With `tools`, a
/// first system turn (the system message's text, if any, then a one-line preamble and one JSON
/// line per tool schema inside `<tools>`); `tool` messages as Qwen2.5 writes them (a user turn of
/// `<tool_response>` blocks, consecutive ones in one turn); an assistant's structured `tool_calls`
/// as `<tool_call>` JSON lines. A conversation without tools, tool messages or tool calls renders
/// as the plain ChatML turns.
pub const CHATML_TEMPLATE: &str = concat!(
    "{%- if tools %}",
    "{{- '<|im_start|>system\\n' }}",
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}",
    "{{- 'Call tools as <tool_call>{\"name\", \"arguments\"}</tool_call>.\\n<tools>' }}",
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}",
    "{{- '\\n</tools><|im_end|>\\n' }}",
    "{%- endif %}",
    "{%- for message in messages %}",
    "{%- if message.role == 'system' and tools and loop.first %}",
    "{%- elif message.role == 'tool' %}",
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}",
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}",
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}",
    "{%- elif message.role == 'assistant' and message.tool_calls %}",
    "{{- '<|im_start|>assistant' }}",
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}",
    "{%- for call in message.tool_calls %}",
    "{%- set f = call.function if call.function is defined else call %}",
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}",
    "{{- f.arguments if f.arguments is string else (f.arguments | tojson) }}",
    "{{- '}\\n</tool_call>' }}",
    "{%- endfor %}",
    "{{- '<|im_end|>\\n' }}",
    "{%- else %}",
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
    "{%- endif %}",
    "{%- endfor %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
);

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
    pub digit_group: Option<u8>,
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
            digit_group: None,
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

/// The conversations of the files in `data` that have a `messages` column (verl's multi-turn SFT
/// layout), rendered with [`CHATML_TEMPLATE`] and their `tools`; other files add nothing.
fn rendered_conversations(data: &[PathBuf]) -> anyhow::Result<Vec<String>> {
    let template = verl_chat::ChatTemplate::new("init-model", CHATML_TEMPLATE)?;
    let keys = verl_data::MultiturnKeys::default();
    let mut out = Vec::new();
    for path in data {
        let conversations = match verl_data::read_sft_conversations(&[path], &keys) {
            Ok(c) => c,
            Err(verl_data::DataError::MissingColumn { column, .. })
                if column == keys.messages_key =>
            {
                continue
            }
            Err(e) => return Err(e.into()),
        };
        for c in conversations {
            let opts = verl_chat::ChatOptions {
                tools: c.tools,
                ..Default::default()
            };
            out.push(
                template
                    .render(&c.messages, &opts, &Default::default())
                    .with_context(|| format!("rendering a conversation of {}", path.display()))?,
            );
        }
    }
    Ok(out)
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
    let mut corpus = verl_data::text_corpus(data)?;
    corpus.extend(rendered_conversations(data)?);
    if corpus.is_empty() {
        bail!("no text in {data:?} to train the tokenizer on");
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let tok = verl_chat::train_bpe_with(
        &corpus,
        spec.vocab,
        &SPECIAL_TOKENS,
        verl_chat::BpeOptions {
            digit_group: spec.digit_group,
        },
    )?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};
    use verl_chat::{ChatOptions, ChatTemplate};

    /// The template as it was before tool support: conversations without tools must render
    /// exactly as it did.
    const PLAIN: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

    fn render(src: &str, messages: &[Value], tools: Option<Vec<Value>>, gen: bool) -> String {
        let opts = ChatOptions {
            add_generation_prompt: gen,
            tools,
            ..Default::default()
        };
        ChatTemplate::new("t", src)
            .unwrap()
            .render(messages, &opts, &Default::default())
            .unwrap()
    }

    fn calculator() -> Value {
        verl_data::calculator_tool_schema()
    }

    #[test]
    fn without_tools_renders_as_the_plain_chatml_template() {
        let conversations = [
            vec![json!({"role": "user", "content": "Mia has 7 apples. How many?"})],
            vec![
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "2 + 2?"}),
                json!({"role": "assistant", "content": "#### 4"}),
                json!({"role": "user", "content": ""}),
            ],
        ];
        for c in &conversations {
            for gen in [false, true] {
                assert_eq!(
                    render(CHATML_TEMPLATE, c, None, gen),
                    render(PLAIN, c, None, gen)
                );
            }
        }
        // An empty tool list is no tools.
        let c = &conversations[1];
        assert_eq!(
            render(CHATML_TEMPLATE, c, Some(vec![]), true),
            render(PLAIN, c, None, true)
        );
    }

    #[test]
    fn with_tools_renders_the_tool_block_calls_and_responses_qwen_style() {
        let call = verl_data::tool_call_text("4821 + 3977");
        let conversation = [
            json!({"role": "user", "content": "Add them."}),
            json!({"role": "assistant", "content": call}),
            json!({"role": "tool", "content": "8798"}),
            json!({"role": "assistant", "content": "#### 8798"}),
        ];
        let golden = concat!(
            "<|im_start|>system\n",
            "Call tools as <tool_call>{\"name\", \"arguments\"}</tool_call>.\n",
            "<tools>\n",
            "{\"type\": \"function\", \"function\": {\"name\": \"calculator\", \"description\": ",
            "\"Evaluate an arithmetic expression.\", \"parameters\": {\"type\": \"object\", ",
            "\"properties\": {\"expression\": {\"type\": \"string\", \"description\": ",
            "\"integers with + and -\"}}, \"required\": [\"expression\"]}}}\n",
            "</tools><|im_end|>\n",
            "<|im_start|>user\nAdd them.<|im_end|>\n",
            "<|im_start|>assistant\n<tool_call>\n",
            "{\"name\": \"calculator\", \"arguments\": {\"expression\": \"4821 + 3977\"}}\n",
            "</tool_call><|im_end|>\n",
            "<|im_start|>user\n<tool_response>\n8798\n</tool_response><|im_end|>\n",
            "<|im_start|>assistant\n#### 8798<|im_end|>\n",
        );
        let tools = Some(vec![calculator()]);
        assert_eq!(
            render(CHATML_TEMPLATE, &conversation, tools.clone(), false),
            golden
        );

        // verl's multi-turn SFT renders message by message, the tools with the first: the pieces
        // add up to the whole.
        let pieces: String = conversation
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let t = if i == 0 { tools.clone() } else { None };
                render(CHATML_TEMPLATE, std::slice::from_ref(m), t, false)
            })
            .collect();
        assert_eq!(pieces, golden);

        // A system message joins the tool block; structured tool_calls render as the call text;
        // consecutive tool messages share one user turn.
        let structured = [
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "Add them."}),
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calculator",
                 "arguments": {"expression": "4821 + 3977"}}},
                {"name": "calculator", "arguments": "{\"expression\": \"1 + 1\"}"}]}),
            json!({"role": "tool", "content": "8798"}),
            json!({"role": "tool", "content": "2"}),
        ];
        let out = render(CHATML_TEMPLATE, &structured, tools, true);
        assert!(
            out.starts_with("<|im_start|>system\nBe brief.\n\nCall tools as "),
            "{out}"
        );
        assert_eq!(out.matches("Be brief.").count(), 1, "{out}");
        let tail = concat!(
            "<|im_start|>assistant\n<tool_call>\n",
            "{\"name\": \"calculator\", \"arguments\": {\"expression\": \"4821 + 3977\"}}\n",
            "</tool_call>\n<tool_call>\n",
            "{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1 + 1\"}}\n",
            "</tool_call><|im_end|>\n",
            "<|im_start|>user\n<tool_response>\n8798\n</tool_response>\n",
            "<tool_response>\n2\n</tool_response><|im_end|>\n",
            "<|im_start|>assistant\n",
        );
        assert!(out.ends_with(tail), "{out}");
    }

    #[test]
    fn tokenizer_corpus_holds_rendered_conversations_and_digits_split() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = verl_data::ArithConfig {
            train: 200,
            val: 8,
            min_operand: 100,
            max_operand: 9999,
            tool_rate: Some(0.5),
            ..verl_data::ArithConfig::default()
        };
        let data = verl_data::arith_write(&dir.path().join("data"), &cfg).unwrap();
        // Files without a messages column add nothing; conversations add their rendering.
        assert!(rendered_conversations(std::slice::from_ref(&data.train))
            .unwrap()
            .is_empty());
        let rendered = rendered_conversations(std::slice::from_ref(&data.sft_train)).unwrap();
        assert_eq!(rendered.len(), 200);
        assert!(rendered.iter().any(|r| r.contains("<tool_response>\n")));

        let spec = ModelSpec {
            vocab: 1024,
            hidden: 16,
            intermediate: 32,
            heads: 2,
            kv_heads: 1,
            digit_group: Some(1),
            ..ModelSpec::default()
        };
        let out = dir.path().join("model");
        init_model(&out, &[data.train, data.sft_train], &spec).unwrap();
        let tok = verl_chat::Tokenizer::from_dir(&out).unwrap();
        let ids = tok.encode("#### 8798", false).unwrap();
        let pieces: Vec<String> = ids
            .iter()
            .map(|&i| tok.decode(&[i], false).unwrap())
            .collect();
        assert_eq!(pieces, ["####", " ", "8", "7", "9", "8"]);
        // The template's own strings were in the corpus: `<tool_response>` is a few merges, not
        // one token per byte.
        assert!(tok.encode("<tool_response>", false).unwrap().len() <= 5);
    }

    #[test]
    fn the_quickstart_tool_config_lists_the_schema_the_sft_data_was_rendered_with() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/quickstart/tools.yaml");
        let text = std::fs::read_to_string(&path).unwrap();
        let cfg: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
        let tools = cfg["tools"].as_sequence().unwrap();
        assert_eq!(tools.len(), 1);
        assert_eq!(
            tools[0]["class_name"].as_str(),
            Some(verl_data::CALCULATOR_TOOL)
        );
        let schema: Value = serde_json::to_value(&tools[0]["tool_schema"]).unwrap();
        // Equal as JSON and in key order, so the prompt the RL job renders is the SFT prompt.
        assert_eq!(
            serde_json::to_string(&schema).unwrap(),
            serde_json::to_string(&calculator()).unwrap()
        );
    }
}
