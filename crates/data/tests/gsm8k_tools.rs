//! `verl data gsm8k --tools calculator` on the real GSM8K (`../shared/data/gsm8k`).

mod common;

use serde_json::{json, Value};
use verl_data::gsm8k::read_raw;
use verl_data::gsm8k_tools::{gsm8k_tool_conversation, gsm8k_tool_conversations};
use verl_data::{gsm8k_tools_preprocess, read_sft_conversations, MultiturnKeys};

/// Training row 1 (Weng's babysitting), written out in full: two calls, the `$` before each
/// marker moved to the turn that writes the number, the `x` of the text left as written.
#[test]
fn golden_conversation_of_a_real_training_row() {
    let Some(dir) = common::gsm8k_dir() else {
        return;
    };
    let rows = read_raw(&dir.join("train.jsonl"), "train").unwrap();
    let c = gsm8k_tool_conversation(&rows[1]).unwrap();
    let expected = json!([
        {"role": "user", "content": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn? Work through it step by step, use the calculator tool for every computation, and write the final answer after \"####\"."},
        {"role": "assistant", "content": "Weng earns 12/60 =\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12/60\"}}\n</tool_call>"},
        {"role": "tool", "content": "0.2"},
        {"role": "assistant", "content": "$0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 =\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"0.2*50\"}}\n</tool_call>"},
        {"role": "tool", "content": "10"},
        {"role": "assistant", "content": "$10.\n#### 10"}
    ]);
    assert_eq!(Value::Array(c.messages), expected);
    assert_eq!((c.calls, c.normalised, c.bare), (2, 0, 0));
}

/// Without the tool-call blocks and whitespace, a conversation's assistant turns are the
/// solution without its markers: no sentence is lost, moved or rewritten.
fn assistant_text_without_calls(messages: &[Value]) -> String {
    messages
        .iter()
        .filter(|m| m["role"] == "assistant")
        .map(|m| {
            let s = m["content"].as_str().unwrap();
            s.find("<tool_call>").map_or(s, |i| &s[..i]).to_string()
        })
        .collect::<String>()
        .split_whitespace()
        .collect()
}

fn without_markers(answer: &str) -> String {
    let mut out = String::new();
    let mut rest = answer;
    while let Some(open) = rest.find("<<") {
        out.push_str(&rest[..open]);
        let close = rest[open..].find(">>").unwrap();
        rest = &rest[open + close + 2..];
    }
    out.push_str(rest);
    out.split_whitespace().collect()
}

#[test]
fn every_gsm8k_row_becomes_a_conversation_that_keeps_the_solution() {
    let Some(dir) = common::gsm8k_dir() else {
        return;
    };
    for (split, n) in [("train", 7473), ("test", 1319)] {
        let rows = read_raw(&dir.join(format!("{split}.jsonl")), split).unwrap();
        let (conversations, stats) = gsm8k_tool_conversations(&rows);
        assert_eq!(stats.rows, n);
        assert_eq!(stats.dropped_rows(), 0, "{split}: {stats}");
        assert_eq!(conversations.len(), n);
        for (row, c) in rows.iter().zip(&conversations) {
            assert_eq!(
                assistant_text_without_calls(&c.messages),
                without_markers(&row.answer),
                "{split} row {}",
                row.index
            );
            let last = c.messages.last().unwrap()["content"].as_str().unwrap();
            assert!(last.contains("#### "), "{split} row {}: {last}", row.index);
            assert!(c
                .messages
                .iter()
                .all(|m| !m["content"].as_str().unwrap().contains("<<")));
            // user, then (assistant, tool) per call, then the final assistant turn.
            assert_eq!(c.messages.len(), 2 + 2 * c.calls);
        }
    }
}

#[test]
fn preprocess_writes_all_four_files() {
    let Some(dir) = common::gsm8k_dir() else {
        return;
    };
    let out = tempfile::tempdir().unwrap();
    let o = gsm8k_tools_preprocess(&dir, out.path()).unwrap();
    assert_eq!((o.train_rows, o.test_rows), (7473, 1319));
    let rl = common::read_parquet(&o.test);
    assert_eq!(rl.num_rows(), 1319);
    let sft = read_sft_conversations(&[&o.sft_train], &MultiturnKeys::default()).unwrap();
    assert_eq!(sft.len(), o.sft_train_stats.conversations);
    assert_eq!(
        sft[1].messages[2],
        json!({"role": "tool", "content": "0.2"})
    );
}
