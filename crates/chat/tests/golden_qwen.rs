//! The Qwen2.5-Instruct template, rendered by HF transformers, must be reproduced byte for byte.

mod common;

use verl_chat::{ChatOptions, ChatTemplate};

#[test]
fn qwen2_5_instruct_renders_like_transformers() {
    let (Some(template_path), Some(rows_path)) = (
        common::shared_file("golden/chat_templates/qwen2_5_instruct.jinja"),
        common::shared_file("golden/chat_templates/qwen2_5_instruct_rendered.jsonl"),
    ) else {
        return;
    };
    let source = std::fs::read_to_string(&template_path).unwrap();
    let template = ChatTemplate::new("qwen2_5_instruct.jinja", source).unwrap();
    let rows = std::fs::read_to_string(&rows_path).unwrap();

    let mut checked = 0;
    let mut failures = Vec::new();
    for (lineno, line) in rows
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let row: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("{}:{}: {e}", rows_path.display(), lineno + 1));
        let messages = row["messages"]
            .as_array()
            .expect("`messages` is a list")
            .clone();
        let tools = match &row["tools"] {
            serde_json::Value::Null => None,
            serde_json::Value::Array(t) => Some(t.clone()),
            other => panic!(
                "line {}: `tools` must be null or a list, found {other}",
                lineno + 1
            ),
        };
        let opts = ChatOptions {
            add_generation_prompt: row["add_generation_prompt"].as_bool().expect("bool"),
            tools,
            ..Default::default()
        };
        let want = row["rendered"].as_str().expect("`rendered` is a string");
        let got = template
            .render(&messages, &opts, &serde_json::Map::new())
            .unwrap_or_else(|e| panic!("line {}: {e}", lineno + 1));
        checked += 1;
        if got != want {
            failures.push(format!(
                "line {}: {}",
                lineno + 1,
                common::first_difference(want, &got)
            ));
        }
    }
    println!(
        "checked {checked} golden rows, {} mismatched",
        failures.len()
    );
    assert!(
        checked >= 20,
        "expected at least 20 golden rows, found {checked}"
    );
    assert!(
        failures.is_empty(),
        "{} of {checked} rows differ; first: {}",
        failures.len(),
        failures[0]
    );
}
