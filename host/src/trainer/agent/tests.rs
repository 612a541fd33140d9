//! The agent loop driven turn by turn as the engine drives it, with a scripted model (turns given
//! as the tokenizer's own split of their text) and the real calculator tool.

use serde_json::json;
use verl_chat::{ChatOptions, Tokenizer};
use verl_config::Config;
use verl_data::Sample;
use verl_plugin_api::turns::{Resume, TurnDriver, TurnEnd};

use super::*;

/// Qwen2.5-Instruct's template, as HF ships it (tools in the system prompt, `tool` messages in
/// a user turn of `<tool_response>` blocks); `None` (SKIP) without the shared data.
fn qwen_template() -> Option<String> {
    let p = verl_test_support::shared_path("golden/chat_templates/qwen2_5_instruct.jinja")?;
    Some(std::fs::read_to_string(&p).unwrap())
}

/// A small BPE with Qwen2.5's template; `None` (SKIP) without the shared data.
fn tokenizer(dir: &std::path::Path) -> Option<Tokenizer> {
    let template = qwen_template()?;
    let tok = verl_chat::train_bpe(
        &[
            "What is 2 + 3? Let me compute. The answer is 5. #### 5 calculator expression",
            "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"2 + 3\"}}\n</tool_call>",
            "<tool_response>\n5\n</tool_response> system user assistant tool You are Qwen",
        ],
        400,
        &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    .unwrap();
    tok.save(dir.join("tokenizer.json"), false).unwrap();
    let tc =
        json!({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": template});
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
    Some(Tokenizer::from_dir(dir).unwrap())
}

fn sample(question: &str, agent: Option<&str>) -> Sample {
    let mut row = json!({
        "prompt": [{"role": "user", "content": question}],
        "data_source": "openai/gsm8k",
        "reward_model": {"style": "rule", "ground_truth": "5"},
        "extra_info": {},
    });
    if let Some(a) = agent {
        row["agent_name"] = json!(a);
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("one.jsonl");
    verl_data::write_jsonl(&path, [&row]).unwrap();
    let ds = verl_data::Dataset::load(&[&path], &verl_data::DataConfig::default()).unwrap();
    ds.samples()[0].clone()
}

const TOOLS: &str = r#"
tools:
  - class_name: calculator
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: calculator
        description: Evaluates an arithmetic expression.
        parameters:
          type: object
          properties:
            expression: {type: string, description: "e.g. 2 + 3"}
          required: [expression]
"#;

/// The agent loop of a multi-turn job with the built-in calculator (`libverl_tools.so`, built
/// next to this test binary as a dev-dependency and found there as next to `verl`).
fn agent(overrides: &[&str]) -> AgentLoop {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tools.yaml");
    std::fs::write(&path, TOOLS).unwrap();
    let tool_key = format!(
        "actor_rollout_ref.rollout.multi_turn.tool_config_path={}",
        path.display()
    );
    let mut o = vec![
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        tool_key.as_str(),
    ];
    o.extend_from_slice(overrides);
    let cfg = Config::from_overrides(&o).unwrap();
    AgentLoop::from_config(&cfg, |p| {
        Ok(crate::tools::ToolSet::load(
            p,
            &crate::tools::ToolPlugins::default(),
        )?)
    })
    .unwrap()
    .unwrap()
}

fn ids(tok: &Tokenizer, text: &str) -> Vec<i64> {
    tok.encode(text, false)
        .unwrap()
        .into_iter()
        .map(i64::from)
        .collect()
}

fn end(row: usize, tokens: Vec<i64>, used: usize) -> TurnEnd {
    TurnEnd {
        row,
        response_len: used + tokens.len(),
        tokens,
        stopped: true,
        waits: true,
    }
}

const CALL: &str = "Let me compute.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"2 + 3\"}}\n</tool_call>";
const ANSWER: &str = "The answer is 5. #### 5";

#[test]
fn tool_turns_are_the_tokens_one_pass_over_the_conversation_gives() {
    let dir = tempfile::tempdir().unwrap();
    let Some(tok) = tokenizer(dir.path()) else {
        return;
    };
    let a = agent(&[]);
    let s = sample("What is 2 + 3?", Some("tool_agent"));
    let chat = ChatOptions::with_generation_prompt();
    let prompt_opts = ChatOptions {
        tools: a.prompt_tools(&s).unwrap(),
        ..chat.clone()
    };
    assert!(
        prompt_opts.tools.is_some(),
        "a tool agent's prompt lists the tools"
    );
    let prompt: Vec<i64> = tok
        .apply_chat_template_ids(&s.prompt, &prompt_opts)
        .unwrap()
        .into_iter()
        .map(i64::from)
        .collect();

    let mut d = AgentDriver::new(&tok, &chat, &a, &[&s], 1, 200).unwrap();
    let turn1 = ids(&tok, &format!("{CALL}<|im_end|>"));
    let answers = d.turns(vec![end(0, turn1.clone(), 0)], true).unwrap();
    let [Resume::Continue {
        row: 0,
        tokens: appended,
    }] = answers.as_slice()
    else {
        panic!("expected the tool turn, got {answers:?}");
    };
    let turn2 = ids(&tok, &format!("{ANSWER}<|im_end|>"));
    let used = turn1.len() + appended.len();
    let answers = d.turns(vec![end(0, turn2.clone(), used)], true).unwrap();
    assert_eq!(
        answers,
        vec![Resume::Finish { row: 0 }],
        "no call: the conversation ends"
    );
    let report = d.finish();
    assert_eq!(
        report.num_turns,
        vec![4.0],
        "2 assistant + 1 user turn + 1, as verl counts"
    );
    assert_eq!(report.tool_calls, vec![1.0]);
    assert_eq!(report.per_tool["calculator"].calls, 1);
    assert_eq!(report.per_tool["calculator"].errors, 0);

    // The whole conversation rendered and tokenized in one pass.
    let messages = json!([
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": ANSWER},
    ]);
    let messages = messages.as_array().unwrap().clone();
    let one_pass: Vec<i64> = tok
        .apply_chat_template_ids(
            &messages,
            &ChatOptions {
                add_generation_prompt: false,
                ..prompt_opts.clone()
            },
        )
        .unwrap()
        .into_iter()
        .map(i64::from)
        .collect();
    let mut ours = prompt.clone();
    ours.extend(&turn1);
    ours.extend(appended);
    ours.extend(&turn2);
    // Token in, token out: the ids the model generated are trained on, never a re-rendering of
    // its turns (verl's `use_inference_chat_template: false`, the only way verl-rs has).
    assert_eq!(one_pass[..ours.len()], ours[..], "token in, token out");
    assert_eq!(
        tok.decode(
            &one_pass[ours.len()..]
                .iter()
                .map(|&t| t as u32)
                .collect::<Vec<_>>(),
            false
        )
        .unwrap(),
        "\n",
        "only the template's newline after the last turn is left"
    );
    // The model's tokens are exactly the assistant turns of the one-pass rendering.
    let mut sampled = vec![1; turn1.len()];
    sampled.extend(std::iter::repeat_n(0, appended.len()));
    sampled.extend(std::iter::repeat_n(1, turn2.len()));
    let own: Vec<u32> = ours[prompt.len()..]
        .iter()
        .zip(&sampled)
        .filter(|(_, &m)| m == 1)
        .map(|(&t, _)| t as u32)
        .collect();
    assert_eq!(
        tok.decode(&own, false).unwrap(),
        format!("{CALL}<|im_end|>{ANSWER}<|im_end|>")
    );
    let tool_text = tok
        .decode(
            &appended.iter().map(|&t| t as u32).collect::<Vec<_>>(),
            false,
        )
        .unwrap();
    assert_eq!(
        tool_text,
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn conversations_end_where_verls_loop_ends_them() {
    let dir = tempfile::tempdir().unwrap();
    let Some(tok) = tokenizer(dir.path()) else {
        return;
    };
    let chat = ChatOptions::with_generation_prompt();
    let call = ids(&tok, &format!("{CALL}<|im_end|>"));
    let two_calls = ids(&tok, &format!("{CALL}{CALL}<|im_end|>"));
    let first = |a: &AgentLoop, s: &Sample, turn: &[i64], budget: usize| {
        let mut d = AgentDriver::new(&tok, &chat, a, &[s], 1, budget).unwrap();
        let r = d.turns(vec![end(0, turn.to_vec(), 0)], true).unwrap();
        (r, d.finish())
    };
    let tool_row = sample("What is 2 + 3?", Some("tool_agent"));
    let is_finish = |r: &[Resume]| matches!(r, [Resume::Finish { row: 0 }]);
    // A tool agent's call runs; with max_parallel_calls=1 only the first of two.
    let (r, rep) = first(&agent(&[]), &tool_row, &two_calls, 200);
    assert!(matches!(r.as_slice(), [Resume::Continue { .. }]), "{r:?}");
    assert_eq!(
        (rep.tool_calls[0], rep.per_tool["calculator"].calls),
        (1.0, 1)
    );
    let (_, rep) = first(
        &agent(&["actor_rollout_ref.rollout.multi_turn.max_parallel_calls=2"]),
        &tool_row,
        &two_calls,
        200,
    );
    assert_eq!(rep.tool_calls[0], 2.0);
    // max_assistant_turns=1: the first turn is the last; max_user_turns=0 is no limit (verl's
    // truthiness).
    let (r, _) = first(
        &agent(&["actor_rollout_ref.rollout.multi_turn.max_assistant_turns=1"]),
        &tool_row,
        &call,
        200,
    );
    assert!(is_finish(&r), "{r:?}");
    let (r, _) = first(
        &agent(&["actor_rollout_ref.rollout.multi_turn.max_user_turns=0"]),
        &tool_row,
        &call,
        200,
    );
    assert!(!is_finish(&r), "{r:?}");
    // A single-turn row (no agent_name, verl's default agent) never calls tools.
    let (r, rep) = first(&agent(&[]), &sample("What is 2 + 3?", None), &call, 200);
    assert!(is_finish(&r) && rep.tool_calls[0] == 0.0, "{r:?}");
    assert_eq!(
        rep.num_turns,
        vec![2.0],
        "single_turn_agent counts 2 turns, as verl's"
    );
    // The default agent can be the tool agent.
    let (r, _) = first(
        &agent(&["actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"]),
        &sample("What is 2 + 3?", None),
        &call,
        200,
    );
    assert!(!is_finish(&r), "{r:?}");
    // A tool turn that would fill the response ends the conversation instead (verl's check).
    let (r, rep) = first(&agent(&[]), &tool_row, &call, call.len() + 5);
    assert!(is_finish(&r), "{r:?}");
    assert_eq!(
        rep.tool_calls[0], 1.0,
        "the call ran; its answer did not fit"
    );
    // A second turn after max_user_turns=1 tool turns ends it.
    let a = agent(&["actor_rollout_ref.rollout.multi_turn.max_user_turns=1"]);
    let mut d = AgentDriver::new(&tok, &chat, &a, &[&tool_row], 1, 400).unwrap();
    let r = d.turns(vec![end(0, call.clone(), 0)], true).unwrap();
    let [Resume::Continue { tokens, .. }] = r.as_slice() else {
        panic!("{r:?}")
    };
    let r = d
        .turns(vec![end(0, call.clone(), call.len() + tokens.len())], true)
        .unwrap();
    assert!(is_finish(&r), "{r:?}");
    // An unknown agent name is refused by row.
    let e = agent(&[])
        .agent_of(&sample("x", Some("react_agent")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("react_agent") && e.contains("tool_agent"), "{e}");
}

#[test]
fn tool_responses_are_cut_as_verl_cuts_them() {
    let dir = tempfile::tempdir().unwrap();
    let Some(tok) = tokenizer(dir.path()) else {
        return;
    };
    let chat = ChatOptions::with_generation_prompt();
    let s = sample("What is 123456789 + 1?", Some("tool_agent"));
    let turn = ids(
        &tok,
        "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"123456789 + 1\"}}\n</tool_call><|im_end|>",
    );
    for (side, want) in [
        ("middle", "12...(truncated)...90"),
        ("left", "(truncated)...56790"),
        ("right", "12345...(truncated)"),
    ] {
        let side_key =
            format!("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side={side}");
        let a = agent(&[
            "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=5",
            &side_key,
        ]);
        let mut d = AgentDriver::new(&tok, &chat, &a, &[&s], 1, 400).unwrap();
        let r = d.turns(vec![end(0, turn.clone(), 0)], true).unwrap();
        let [Resume::Continue { tokens, .. }] = r.as_slice() else {
            panic!("{r:?}")
        };
        let text = tok
            .decode(&tokens.iter().map(|&t| t as u32).collect::<Vec<_>>(), false)
            .unwrap();
        assert!(
            text.contains(&format!("<tool_response>\n{want}\n</tool_response>")),
            "{side}: {text:?}"
        );
    }
}

#[test]
fn hermes_calls_are_parsed_as_verl_parses_them() {
    let (c, bad) = parse_hermes(CALL);
    assert_eq!(bad, 0);
    assert_eq!(
        c,
        vec![ToolCall {
            name: "calculator".into(),
            arguments: r#"{"expression":"2 + 3"}"#.into()
        }]
    );
    // Two calls; a block that is not JSON, one without arguments and an unclosed one are
    // skipped (verl logs them); text around the blocks does not matter.
    let text = "a<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}</tool_call> b \
                <tool_call>not json</tool_call><tool_call>{\"name\": \"g\"}</tool_call>\
                <tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call><tool_call>{\"name\"";
    let (c, bad) = parse_hermes(text);
    assert_eq!(bad, 2);
    let names: Vec<&str> = c.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["f", "g"]);
    assert_eq!(c[1].arguments, "{}");
    assert_eq!(parse_hermes("no calls here"), (vec![], 0));
}
