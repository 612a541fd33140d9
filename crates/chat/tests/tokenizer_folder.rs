//! A HF-style folder built on the fly (trained byte-level BPE + config files), loaded back and
//! checked for ids, special tokens, eos/pad resolution, chat templating and error messages.

mod common;

use serde_json::json;
use std::path::Path;
use verl_chat::{train_bpe, ChatError, ChatOptions, Message, Tokenizer};

const CORPUS: &[&str] = &[
    "The quick brown fox jumps over the lazy dog.",
    "What is 2+3? Let's think step by step and output the final answer after \"####\".",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "system user assistant tool tools function arguments name",
    "Unicode: naïve café 数学 🚀 new line\ttab",
];

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// ChatML as Qwen writes it, used when the shared golden template is not available.
const FALLBACK_CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n";

fn qwen_template() -> String {
    common::shared_file("golden/chat_templates/qwen2_5_instruct.jinja")
        .map(|p| std::fs::read_to_string(p).unwrap())
        .unwrap_or_else(|| FALLBACK_CHATML.to_owned())
}

/// Writes tokenizer.json, tokenizer_config.json (Qwen-like) and generation_config.json.
fn write_folder(dir: &Path, config: serde_json::Value) {
    let tok = train_bpe(CORPUS, 400, &SPECIALS).unwrap();
    tok.save(dir.join("tokenizer.json"), true).unwrap();
    common::write(
        dir,
        "tokenizer_config.json",
        &serde_json::to_string_pretty(&config).unwrap(),
    );
}

fn qwen_config() -> serde_json::Value {
    json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null,
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": false,
                       "normalized": false, "rstrip": false, "single_word": false, "special": true},
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": false,
        "model_max_length": 131072,
        "chat_template": qwen_template(),
    })
}

fn qwen_folder() -> (tempfile::TempDir, Tokenizer) {
    let dir = tempfile::tempdir().unwrap();
    write_folder(dir.path(), qwen_config());
    common::write(
        dir.path(),
        "generation_config.json",
        r#"{"eos_token_id": [2, 0], "pad_token_id": 0}"#,
    );
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    (dir, tok)
}

#[test]
fn encode_decode_round_trip() {
    let (_dir, tok) = qwen_folder();
    for text in CORPUS
        .iter()
        .copied()
        .chain(["unseen wörds ∑ 🙂 and   spaces\n\n", ""])
    {
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text, "ids {ids:?}");
    }
    // Merges were learnt: a frequent word is fewer tokens than bytes.
    let ids = tok.encode("assistant", false).unwrap();
    assert!(ids.len() < "assistant".len(), "{ids:?}");
    let batch = tok.encode_batch(&["a b", "naïve"], false).unwrap();
    assert_eq!(batch[1], tok.encode("naïve", false).unwrap());
}

#[test]
fn special_tokens_are_atomic_and_skippable() {
    let (_dir, tok) = qwen_folder();
    let (eot, start, end) = (0u32, 1u32, 2u32);
    assert_eq!(tok.token_to_id("<|endoftext|>"), Some(eot));
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(start));
    assert_eq!(tok.id_to_token(end).as_deref(), Some("<|im_end|>"));
    let ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
    assert_eq!(ids[0], start);
    assert_eq!(*ids.last().unwrap(), end);
    assert_eq!(
        ids.iter().filter(|&&i| i <= 2).count(),
        2,
        "special tokens not split: {ids:?}"
    );
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi");
    assert_eq!(
        tok.decode(&ids, false).unwrap(),
        "<|im_start|>user\nhi<|im_end|>"
    );
    // No BOS for a Qwen-like folder, with or without special tokens.
    assert_eq!(
        tok.encode("hi", true).unwrap(),
        tok.encode("hi", false).unwrap()
    );
    assert_eq!(tok.bos_token_id(), None);
}

#[test]
fn eos_pad_and_sizes() {
    let (_dir, tok) = qwen_folder();
    assert_eq!(tok.eos_token_id(), Some(2));
    // Tokenizer eos first, then generation_config ids not yet listed.
    assert_eq!(tok.eos_token_ids(), &[2, 0]);
    assert_eq!(tok.generation_eos_token_ids(), &[2, 0]);
    assert_eq!(tok.pad_token_id(), Some(0));
    assert_eq!(tok.len(), 400);
    assert_eq!(tok.vocab_size(), 400);
    assert_eq!(tok.model_max_length(), Some(131072));
    let vars = tok.special_tokens().template_vars();
    assert_eq!(vars["eos_token"], "<|im_end|>");
    assert_eq!(vars["pad_token"], "<|endoftext|>");
    assert!(!vars.contains_key("bos_token"));
}

#[test]
fn pad_falls_back_to_eos_and_generation_eos_int() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = qwen_config();
    cfg.as_object_mut().unwrap().remove("pad_token");
    write_folder(dir.path(), cfg);
    common::write(
        dir.path(),
        "generation_config.json",
        r#"{"eos_token_id": 0}"#,
    );
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.pad_token_id(), Some(2));
    assert_eq!(tok.special_tokens().pad.as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.eos_token_ids(), &[2, 0]);
}

#[test]
fn missing_special_token_is_added_like_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = qwen_config();
    cfg["additional_special_tokens"] = json!(["<tool_call>", {"content": "</tool_call>"}]);
    write_folder(dir.path(), cfg);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.len(), 402);
    assert_eq!(tok.vocab_size(), 400);
    let open = tok.token_to_id("<tool_call>").unwrap();
    let ids = tok.encode("x<tool_call>y", false).unwrap();
    assert!(ids.contains(&open), "{ids:?}");
    assert_eq!(tok.decode(&ids, true).unwrap(), "xy");
}

#[test]
fn add_bos_token_and_clean_up_spaces() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = qwen_config();
    cfg["tokenizer_class"] = json!("LlamaTokenizerFast");
    cfg["bos_token"] = json!("<|endoftext|>");
    cfg["add_bos_token"] = json!(true);
    cfg["clean_up_tokenization_spaces"] = json!(true);
    write_folder(dir.path(), cfg);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let with = tok.encode("hello there", true).unwrap();
    let without = tok.encode("hello there", false).unwrap();
    assert_eq!(with[0], 0);
    assert_eq!(&with[1..], &without[..]);
    // Chat templates are tokenized without the BOS policy.
    let ids = tok
        .apply_chat_template_ids(&[Message::user("hi")], &ChatOptions::default())
        .unwrap();
    assert_ne!(ids[0], 0);
    let ids = tok.encode("Hi , you !", false).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), "Hi, you!");
}

#[test]
fn bos_eos_flags_follow_the_tokenizer_class() {
    let encode_hi = |cfg: serde_json::Value| {
        let dir = tempfile::tempdir().unwrap();
        write_folder(dir.path(), cfg);
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let plain = tok.encode("hi", false).unwrap();
        let ids = tok.encode("hi", true).unwrap();
        (plain, ids)
    };
    let base = json!({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"});
    let with = |extra: serde_json::Value| {
        let mut cfg = base.clone();
        cfg.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        cfg
    };
    // transformers' generic fast tokenizer ignores the flags: tokenizer.json decides.
    let (plain, ids) = encode_hi(with(
        json!({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": true}),
    ));
    assert_eq!(ids, plain);
    // Llama defaults to adding BOS; explicit flags win.
    let (plain, ids) = encode_hi(with(json!({"tokenizer_class": "LlamaTokenizerFast"})));
    assert_eq!(ids, [vec![0], plain.clone()].concat());
    let (plain, ids) = encode_hi(with(
        json!({"tokenizer_class": "LlamaTokenizer", "add_bos_token": false, "add_eos_token": true}),
    ));
    assert_eq!(ids, [plain.clone(), vec![2]].concat());
    let (plain, ids) = encode_hi(with(json!({"tokenizer_class": "GPTNeoXTokenizerFast"})));
    assert_eq!(ids, plain);
}

#[test]
fn chat_template_render_and_ids() {
    let (_dir, tok) = qwen_folder();
    let messages = vec![Message::system("Be brief."), Message::user("What is 2+3?")];
    let text = tok
        .apply_chat_template(&messages, &ChatOptions::with_generation_prompt())
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tok
        .apply_chat_template_ids(&messages, &ChatOptions::with_generation_prompt())
        .unwrap();
    assert_eq!(ids, tok.encode(&text, false).unwrap());
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 3);
    assert_eq!(tok.decode(&ids, false).unwrap(), text);

    // serde_json values work too, including tool calls.
    let json_msgs = vec![json!({"role": "user", "content": "What is 2+3?"})];
    let from_json = tok
        .apply_chat_template(&json_msgs, &ChatOptions::default())
        .unwrap();
    assert!(
        from_json.ends_with("<|im_start|>user\nWhat is 2+3?<|im_end|>\n"),
        "{from_json}"
    );
}

#[test]
fn named_templates_and_template_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = qwen_config();
    cfg["chat_template"] = json!([
        {"name": "default", "template": "D{{ messages|length }}"},
        {"name": "tool_use", "template": "T{{ tools|length }}"},
    ]);
    write_folder(dir.path(), cfg);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let msgs = [Message::user("x")];
    assert_eq!(tok.chat_templates().names(), vec!["default", "tool_use"]);
    assert_eq!(
        tok.apply_chat_template(&msgs, &ChatOptions::default())
            .unwrap(),
        "D1"
    );
    let tools = ChatOptions {
        tools: Some(vec![json!({"type": "function"})]),
        ..Default::default()
    };
    assert_eq!(tok.apply_chat_template(&msgs, &tools).unwrap(), "T1");
    let named = ChatOptions {
        template_name: Some("nope".into()),
        ..Default::default()
    };
    let err = tok.apply_chat_template(&msgs, &named).unwrap_err();
    assert!(
        matches!(err, ChatError::UnknownTemplateName { .. }),
        "{err}"
    );

    // chat_template.jinja beside the config replaces the default template.
    common::write(dir.path(), "chat_template.jinja", "J{{ eos_token }}\n");
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(
        tok.apply_chat_template(&msgs, &ChatOptions::default())
            .unwrap(),
        "J<|im_end|>"
    );
    assert_eq!(tok.apply_chat_template(&msgs, &tools).unwrap(), "T1");
}

#[test]
fn folder_without_template_or_config() {
    let dir = tempfile::tempdir().unwrap();
    let tok = train_bpe(CORPUS, 300, &SPECIALS).unwrap();
    tok.save(dir.path().join("tokenizer.json"), false).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.eos_token_ids(), &[] as &[u32]);
    assert_eq!(tok.pad_token_id(), None);
    let err = tok
        .apply_chat_template(&[Message::user("x")], &ChatOptions::default())
        .unwrap_err();
    assert!(matches!(err, ChatError::NoChatTemplate { .. }));
    assert!(err.to_string().contains("chat_template.jinja"), "{err}");
}

fn load_err(dir: &Path) -> String {
    Tokenizer::from_dir(dir).unwrap_err().to_string()
}

#[test]
fn error_messages_name_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let msg = load_err(dir.path());
    assert!(
        msg.contains("tokenizer.json") && msg.contains("not found"),
        "{msg}"
    );

    write_folder(dir.path(), json!({"eos_token": 5}));
    let msg = load_err(dir.path());
    assert!(
        msg.contains("tokenizer_config.json")
            && msg.contains("`eos_token`")
            && msg.contains("found a number 5"),
        "{msg}"
    );

    write_folder(dir.path(), json!({"chat_template": [{"name": "default"}]}));
    let msg = load_err(dir.path());
    assert!(
        msg.contains("`chat_template[0]`") && msg.contains("`template`"),
        "{msg}"
    );

    write_folder(dir.path(), json!({"chat_template": "{% for %}"}));
    let msg = load_err(dir.path());
    assert!(msg.contains("`default` does not compile"), "{msg}");

    write_folder(dir.path(), json!({"add_bos_token": "yes"}));
    let msg = load_err(dir.path());
    assert!(
        msg.contains("`add_bos_token`") && msg.contains("true or false"),
        "{msg}"
    );

    write_folder(dir.path(), json!({"tokenizer_class": "LlamaTokenizerFast"}));
    let msg = load_err(dir.path());
    assert!(msg.contains("no bos_token"), "{msg}");

    write_folder(dir.path(), qwen_config());
    common::write(
        dir.path(),
        "generation_config.json",
        r#"{"eos_token_id": "2"}"#,
    );
    let msg = load_err(dir.path());
    assert!(
        msg.contains("generation_config.json") && msg.contains("`eos_token_id`"),
        "{msg}"
    );
    common::write(
        dir.path(),
        "generation_config.json",
        r#"{"eos_token_id": [2, -1]}"#,
    );
    let msg = load_err(dir.path());
    assert!(msg.contains("`eos_token_id[1]`"), "{msg}");

    common::write(dir.path(), "generation_config.json", "{not json");
    let msg = load_err(dir.path());
    assert!(
        msg.contains("generation_config.json: not valid JSON"),
        "{msg}"
    );

    std::fs::remove_file(dir.path().join("generation_config.json")).unwrap();
    common::write(dir.path(), "tokenizer.json", r#"{"model": 3}"#);
    let msg = load_err(dir.path());
    assert!(
        msg.contains("tokenizer.json") && msg.contains("rejected"),
        "{msg}"
    );
}

#[test]
fn train_bpe_rejects_tiny_vocab() {
    let err = train_bpe(CORPUS, 100, &SPECIALS).unwrap_err();
    assert!(err.to_string().contains("vocab_size 100"), "{err}");
}
