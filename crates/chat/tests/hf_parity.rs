//! Optional parity with HF transformers itself: the same trained folder is loaded by
//! `transformers.AutoTokenizer` and by us; rendered chats, ids and decodes must agree.
//! Skips (with a message) when no Python with `transformers` is found: `$VERL_PYTHON`, else
//! `<workspace>/.venv/bin/python`, else `python3`.

mod common;

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use verl_chat::{train_bpe, ChatOptions, Tokenizer};

const CORPUS: &[&str] = &[
    "The quick brown fox jumps over the lazy dog.",
    "What is 2+3? Let's think step by step and output the final answer after \"####\".",
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "system user assistant tool tools function arguments name get_weather city Paris",
    "Unicode: naïve café 数学 🚀 new line\ttab",
];

const SCRIPT: &str = r#"
import json, sys
from transformers import AutoTokenizer
folder, cases_path = sys.argv[1], sys.argv[2]
cases = json.load(open(cases_path))
tok = AutoTokenizer.from_pretrained(folder)
out = {"len": len(tok), "vocab_size": tok.vocab_size, "eos_token_id": tok.eos_token_id,
       "bos_token_id": tok.bos_token_id, "chats": [], "texts": []}
for c in cases["chats"]:
    kw = dict(add_generation_prompt=c["add_generation_prompt"], tools=c["tools"])
    text = tok.apply_chat_template(c["messages"], tokenize=False, **kw)
    ids = tok.apply_chat_template(c["messages"], tokenize=True, **kw)
    out["chats"].append({"text": text, "ids": list(ids)})
for t in cases["texts"]:
    with_special = tok.encode(t, add_special_tokens=True)
    out["texts"].append({
        "with_special": with_special,
        "without_special": tok.encode(t, add_special_tokens=False),
        "decoded": tok.decode(with_special),
        "decoded_skip": tok.decode(with_special, skip_special_tokens=True),
    })
print(json.dumps(out))
"#;

fn python_with_transformers() -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Some(p) = std::env::var_os("VERL_PYTHON") {
        candidates.push(PathBuf::from(p));
    }
    candidates.push(common::workspace_root().join(".venv/bin/python"));
    candidates.push(PathBuf::from("python3"));
    for py in candidates {
        let ok = Command::new(&py)
            .args(["-c", "import transformers"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if ok {
            return Some(py);
        }
    }
    eprintln!("SKIP: no python with `transformers` (set VERL_PYTHON or run scripts/setup.sh)");
    None
}

fn run_hf(python: &Path, folder: &Path, cases: &Value) -> Value {
    let script = folder.join("hf_parity.py");
    std::fs::write(&script, SCRIPT).unwrap();
    let cases_path = folder.join("cases.json");
    std::fs::write(&cases_path, cases.to_string()).unwrap();
    let out = Command::new(python)
        .arg(&script)
        .arg(folder)
        .arg(&cases_path)
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap()
}

fn cases() -> Value {
    let weather_tool = json!({"type": "function", "function": {"name": "get_weather",
        "description": "Weather for a city", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}});
    json!({
        "chats": [
            {"messages": [{"role": "user", "content": "What is 2+3?"}], "tools": null, "add_generation_prompt": true},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "naïve 数学 🚀"}],
             "tools": [weather_tool], "add_generation_prompt": false},
            {"messages": [{"role": "user", "content": "Weather in Paris?"},
                          {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                              "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2.5}}}]},
                          {"role": "tool", "content": "{\"temp\": 21}"}],
             "tools": null, "add_generation_prompt": true},
        ],
        "texts": ["hello world", "<|im_start|>user\nhi<|im_end|>", "Hi , you ! I 'm here", "  spaces\n\ttabs  "],
    })
}

fn check_folder(python: &Path, config: Value) {
    let dir = tempfile::tempdir().unwrap();
    let tok = train_bpe(
        CORPUS,
        420,
        &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    .unwrap();
    tok.save(dir.path().join("tokenizer.json"), false).unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        serde_json::to_string(&config).unwrap(),
    )
    .unwrap();
    let ours = Tokenizer::from_dir(dir.path()).unwrap();
    let cases = cases();
    let hf = run_hf(python, dir.path(), &cases);

    assert_eq!(hf["len"], json!(ours.len()), "len(tokenizer)");
    assert_eq!(hf["vocab_size"], json!(ours.vocab_size()), "vocab_size");
    assert_eq!(
        hf["eos_token_id"],
        json!(ours.eos_token_id()),
        "eos_token_id"
    );
    assert_eq!(
        hf["bos_token_id"],
        json!(ours.bos_token_id()),
        "bos_token_id"
    );

    for (i, case) in cases["chats"].as_array().unwrap().iter().enumerate() {
        let messages = case["messages"].as_array().unwrap().clone();
        let opts = ChatOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            tools: case["tools"].as_array().cloned(),
            ..Default::default()
        };
        let text = ours.apply_chat_template(&messages, &opts).unwrap();
        let want = hf["chats"][i]["text"].as_str().unwrap();
        assert!(
            text == want,
            "chat {i}: {}",
            common::first_difference(want, &text)
        );
        let ids = ours.apply_chat_template_ids(&messages, &opts).unwrap();
        assert_eq!(json!(ids), hf["chats"][i]["ids"], "chat {i} ids");
    }
    for (i, text) in cases["texts"].as_array().unwrap().iter().enumerate() {
        let text = text.as_str().unwrap();
        let h = &hf["texts"][i];
        let with = ours.encode(text, true).unwrap();
        assert_eq!(
            json!(with),
            h["with_special"],
            "encode({text:?}, add_special_tokens=True)"
        );
        assert_eq!(
            json!(ours.encode(text, false).unwrap()),
            h["without_special"],
            "{text:?}"
        );
        assert_eq!(
            json!(ours.decode(&with, false).unwrap()),
            h["decoded"],
            "decode {text:?}"
        );
        assert_eq!(
            json!(ours.decode(&with, true).unwrap()),
            h["decoded_skip"],
            "decode skip {text:?}"
        );
    }
}

fn qwen_template() -> Option<String> {
    common::shared_file("golden/chat_templates/qwen2_5_instruct.jinja")
        .map(|p| std::fs::read_to_string(p).unwrap())
}

#[test]
fn matches_transformers_qwen_like_folder() {
    let (Some(python), Some(template)) = (python_with_transformers(), qwen_template()) else {
        return;
    };
    check_folder(
        &python,
        json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "clean_up_tokenization_spaces": false,
            "chat_template": template,
        }),
    );
}

#[test]
fn matches_transformers_bos_and_cleanup_folder() {
    let (Some(python), Some(template)) = (python_with_transformers(), qwen_template()) else {
        return;
    };
    check_folder(
        &python,
        json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": true},
            "eos_token": "<|im_end|>",
            "add_bos_token": true,
            "clean_up_tokenization_spaces": true,
            "additional_special_tokens": ["<tool_call>"],
            "chat_template": template,
        }),
    );
}

#[test]
fn matches_transformers_llama_class_folder() {
    let (Some(python), Some(template)) = (python_with_transformers(), qwen_template()) else {
        return;
    };
    check_folder(
        &python,
        json!({
            "tokenizer_class": "LlamaTokenizerFast",
            // LlamaTokenizerFast's own default unk_token ("<unk>") would be added otherwise;
            // we do not emulate per-class default tokens, real Llama folders declare theirs.
            "unk_token": null,
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "add_eos_token": true,
            "chat_template": template,
        }),
    );
}

const RENDER_SCRIPT: &str = r#"
import json, sys
from transformers.utils.chat_template_utils import render_jinja_template
cases = json.load(open(sys.argv[1]))
out = []
for c in cases:
    try:
        rendered, _ = render_jinja_template(
            conversations=[c["messages"]], tools=c.get("tools"), chat_template=c["template"],
            add_generation_prompt=c.get("add_generation_prompt", False), **c.get("vars", {}))
        out.append({"ok": rendered[0]})
    except Exception as e:
        out.append({"err": str(e)})
print(json.dumps(out))
"#;

/// Jinja2 features real chat templates use (namespace, slicing, Python string methods, tests,
/// filters, loop controls, macros, how values print), rendered by transformers and by us.
/// Known gaps, left out on purpose: `'%s' % x` formatting is unsupported, and pairs from
/// `.items()`/`|items` print as lists (`['a', 1]`) where Python prints tuples (`('a', 1)`).
#[test]
fn template_features_match_jinja2() {
    let Some(python) = python_with_transformers() else {
        return;
    };
    let messages = json!([
        {"role": "system", "content": "  <think>plan</think>\n\nBe brief.  "},
        {"role": "user", "content": "What is 2+3? naïve 🚀"},
        {"role": "assistant", "content": null, "tool_calls": [{"type": "function",
            "function": {"name": "add", "arguments": {"a": 2, "b": 3.0}}}]},
        {"role": "tool", "content": "5", "name": "add"},
        {"role": "user", "content": "thanks"},
    ]);
    let tools = json!([{"type": "function", "function": {"name": "add", "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
        "required": ["a", "b"]}}}]);
    let templates = [
        "{%- set ns = namespace(last_user=-1, n=0) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{% set ns.n = ns.n + 1 %}{%- endif %}{%- endfor %}{{ ns.last_user }}/{{ ns.n }}",
        "{% for m in messages[::-1] %}{{ m.role[:1] }}{% endfor %}|{{ messages[1:]|length }}|{{ messages[-1]['content'][:4] }}",
        "{% set c = messages[0].content %}{{ c.split('</think>')[-1].lstrip('\\n') }}|{{ c.strip().startswith('<think>') }}|{{ c.endswith('x') }}|{{ c.replace('think', 'THINK') }}|{{ c.upper() }}|{{ c.rstrip() }}|{{ '</think>' in c }}|{{ 'a,b'.split(',') }}",
        "{% for m in messages %}{{ m.content is string }},{{ m.tool_calls is defined }},{{ m.content is none }},{{ m.get('name', 'anon') }};{% endfor %}",
        "{{ messages|map(attribute='role')|join(', ') }}|{{ messages|selectattr('role', 'equalto', 'user')|list|length }}|{{ messages|first|tojson }}|{{ (messages|last).role }}|{{ 'x'|default('y') }}|{{ nothing_here|default('dflt') }}|{{ messages[1].content|length }}",
        "{{ none }}|{{ true }}|{{ false }}|{{ 3.0 }}|{{ 7 // 2 }}|{{ 7 % 3 }}|{{ 1.5e20 }}|{{ [1, 'a', none, true] }}|{{ {'k': 'v', 'n': 1} }}|{{ 10 / 4 }}|{{ messages[2].tool_calls[0].function.arguments }}",
        "{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}{% if loop.index > 4 %}{% break %}{% endif %}{{ loop.index }}/{{ loop.length }}{% if loop.first %}^{% endif %}{% if loop.last %}!{% endif %} {% endfor %}",
        "{{ tools|tojson(indent=4) }}|{{ tools[0]|tojson(sort_keys=true) }}|{{ messages[1].content|tojson(ensure_ascii=true) }}|{{ {'a': [1.0, 2.5e-7, 1e16]}|tojson }}|{{ messages[2]|tojson(separators=(',', ':')) }}",
        "{% for k, v in tools[0].function.parameters.properties.items() %}{{ k }}:{{ v.type }};{% endfor %}{{ tools[0].function.keys()|list }}|{{ tools[0].function.parameters.required|join('+') }}",
        "<s>\n  {% for m in messages %}\n    {{ m.role }}\n  {%- endfor %}\n  {%+ if true %}x{% endif %}\n{{- ' y ' -}}\n  z\n",
        "{% macro render(m) %}[{{ m.role }}]{% endmacro %}{% for m in messages %}{{ render(m) }}{% endfor %}{% set content = messages[2].content if messages[2].content is string else '' %}<{{ content }}>",
        "{{ tools is none }}|{{ documents is none }}|{{ add_generation_prompt }}|{{ bos_token }}|{{ enable_thinking }}|{{ messages|length > 1 and messages[0].role == 'system' }}|{{ range(3)|list }}",
        "{%- if messages[0].role != 'user' %}{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}",
        "{{ 'a' ~ none ~ true ~ 1.0 }}",
        "{{ '{} {}'.format(1, 2) }}",
        "{{ messages[0].content.count('t') }}",
        "{{ messages|tojson }}",
        "{{ nothing.attr }}",
        "{{ 1 + none }}",
        "{{ messages[0].content|string|length }}|{{ none|string }}|{{ [1,2]|string }}",
        "{{ messages[1:3]|map(attribute='content')|list }}",
        "{% for m in messages if m.role == 'user' %}{{ m.content[:3] }}{% endfor %}",
        "{{ (messages|selectattr('role','equalto','tool')|first).name }}|{{ messages|rejectattr('content')|list|length }}",
        "{{ messages[0].content.splitlines() }}|{{ 'x'.join(['1','2']) }}|{{ messages[0].content.find('plan') }}",
        "{% if messages[0]['content'] is mapping %}m{% elif messages[0].content is iterable %}i{% endif %}{{ tools[0] is mapping }}",
        "{{ messages|length is divisibleby 5 }}|{{ 3 is odd }}|{{ -3|abs }}|{{ 2.567|round(1) }}|{{ 7|float }}|{{ '7'|int + 1 }}",
        "{{ \"tab\\there é\" }}|{{ 'it\\'s' }}|{{ messages[1].content.title() }}|{{ messages[0].content|trim|length }}|{{ '=' * 3 }}",
    ];
    let cases: Vec<Value> = templates
        .iter()
        .map(|t| {
            json!({"template": t, "messages": messages, "tools": tools, "add_generation_prompt": true,
                   "vars": {"bos_token": "<s>", "enable_thinking": false}})
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("render.py");
    std::fs::write(&script, RENDER_SCRIPT).unwrap();
    let cases_path = dir.path().join("cases.json");
    std::fs::write(&cases_path, Value::Array(cases.clone()).to_string()).unwrap();
    let out = Command::new(&python)
        .arg(&script)
        .arg(&cases_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let hf: Vec<Value> = serde_json::from_str(
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .last()
            .unwrap(),
    )
    .unwrap();

    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let template =
            verl_chat::ChatTemplate::new(format!("case{i}"), case["template"].as_str().unwrap())
                .unwrap();
        let opts = ChatOptions {
            add_generation_prompt: true,
            tools: case["tools"].as_array().cloned(),
            extra_vars: case["vars"].as_object().unwrap().clone(),
            ..Default::default()
        };
        let msgs = case["messages"].as_array().unwrap().clone();
        let ours = template.render(&msgs, &opts, &serde_json::Map::new());
        match (&hf[i], ours) {
            (h, Ok(text)) if h.get("ok").is_some() => {
                let want = h["ok"].as_str().unwrap();
                if want != text {
                    failures.push(format!(
                        "case {i}: {}",
                        common::first_difference(want, &text)
                    ));
                }
            }
            (h, Err(verl_chat::ChatError::TemplateRaised { message, .. }))
                if h.get("err").is_some() =>
            {
                if h["err"].as_str() != Some(message.as_str()) {
                    failures.push(format!(
                        "case {i}: raised {message:?}, transformers raised {}",
                        h["err"]
                    ));
                }
            }
            // Engine errors (undefined attribute, bad operand) word things differently; both
            // failing is what matters.
            (h, Err(e))
                if h.get("err").is_some()
                    && !matches!(e, verl_chat::ChatError::TemplateRaised { .. }) => {}
            (h, ours) => failures.push(format!("case {i}: transformers {h}, ours {ours:?}")),
        }
    }
    println!(
        "compared {} templates with transformers, {} differ",
        cases.len(),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
