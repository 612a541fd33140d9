//! GSM8K for verl's tool agent loop with the built-in `calculator` tool (`verl data gsm8k RAW OUT
//! --tools calculator`).
//!
//! The RL rows are the plain GSM8K rows (same `data_source`, `reward_model`, `extra_info`) with
//! verl's per-row `agent_name: tool_agent` (the column verl's
//! `examples/data_preprocess/gsm8k_tool_agent_loop.py` adds) and an instruction to do the arithmetic
//! with the calculator. They carry no `tools_kwargs`: the calculator keeps no per-row state (verl's
//! example hands the ground truth to its `calc_gsm8k_reward` tool there instead).
//!
//! The SFT rows are multi-turn conversations in verl's `MultiTurnSFTDataset` form (`messages`,
//! `tools`) made from GSM8K's own calculator annotations. In a solution such as
//! `Natalia sold 48/2 = <<48/2=24>>24 clips in May.` each annotation ends an assistant turn: the
//! solution written so far (`Natalia sold 48/2 =`), then the hermes `<tool_call>` for the annotated
//! expression. The calculator's answer (`24`) follows as a `tool` message, and the next assistant turn
//! carries on from the annotated result (`24 clips in May. ...`). The last turn ends in `#### N`. The
//! `<<...>>` markers never reach the text. A currency sign or opening parenthesis written just before a
//! marker (`= $<<12/60=0.2>>0.2`) moves to the next turn with the number it belongs to. An annotation
//! that computes nothing, a bare number or a result written as its own expression (`<<-47=-47>>`,
//! `<<3/4=3/4>>`), loses its marker and makes no call. A solution without annotations is a single
//! answer.
//!
//! Every call is checked against its annotation. The expression (with `x`/`×` read as `*`, `÷` as
//! `/`, and digit-group commas removed) must have a value, and it must equal the annotated result. The
//! `tool` message is the calculator's text for that value: an integer without a decimal point, a
//! decimal in full. A row that fails the check is left out of the SFT files (never out of the RL
//! files), and the drop is counted by reason.
//!
//! The check is the calculator's own arithmetic: `verl-calculator`, which the `calculator` tool of
//! the `tools` plugin answers with (this crate cannot link the plugin: a plugin's export symbols must
//! not enter the `verl` binary).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::{Field, Schema};
use serde_json::{json, Value};
use verl_calculator::{value_of, Number};

use crate::arith::{tool_call_text, CALCULATOR_TOOL, TOOL_AGENT};

/// The calculator's function schema as GSM8K's conversations list it (the quickstart's says
/// integers with + and -; GSM8K's annotations multiply, divide and use decimals).
/// `examples/gsm8k_tools/tools.yaml` holds the same.
pub fn gsm8k_calculator_schema() -> Value {
    json!({
        "type": "function",
        "function": {
            "name": CALCULATOR_TOOL,
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": "numbers with + - * / and parentheses, e.g. 4821 + 3977"
                    }
                },
                "required": ["expression"]
            }
        }
    })
}
use crate::columns::json_column;
use crate::error::{DataError, Result};
use crate::gsm8k::{gsm8k_record_batch_with, read_raw, Gsm8kRow};
use crate::write::write_parquet;

/// Appended (after one space) to every question: the RL prompt and the SFT user message.
pub const GSM8K_TOOL_INSTRUCTION: &str =
    "Work through it step by step, use the calculator tool for every computation, and write the \
     final answer after \"####\".";

// ---------------------------------------------------------------------------------------------
// Expressions.

/// `expression` as the calculator reads it: `x`, `X`, `×` become `*`, `÷` becomes `/`, the dashes
/// `–` and `−` become `-`, and commas between digits (`1,000`) go.
pub fn normalise_expression(expression: &str) -> String {
    let chars: Vec<char> = expression.trim().chars().collect();
    let digit = |i: Option<usize>| {
        i.and_then(|i| chars.get(i))
            .is_some_and(char::is_ascii_digit)
    };
    let mut out = String::with_capacity(expression.len());
    for (i, &c) in chars.iter().enumerate() {
        match c {
            'x' | 'X' | '×' => out.push('*'),
            '÷' => out.push('/'),
            '–' | '−' => out.push('-'),
            ',' if digit(i.checked_sub(1)) && digit(Some(i + 1)) => {}
            c => out.push(c),
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Conversations.

/// Why a GSM8K row has no SFT conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Gsm8kToolDrop {
    /// A `<<` without its `>>`, or an annotation without `=`.
    Malformed { annotation: String },
    /// The calculator has no value for the expression: bad syntax, a division by zero, a value
    /// beyond its 38 digits.
    Expression { expression: String, error: String },
    /// The calculator's value is not the annotated result.
    Differs {
        expression: String,
        annotated: String,
        calculator: String,
    },
}

impl Gsm8kToolDrop {
    /// The reason, as counted in [`Gsm8kToolStats::dropped`].
    pub fn reason(&self) -> &'static str {
        match self {
            Gsm8kToolDrop::Malformed { .. } => "malformed annotation",
            Gsm8kToolDrop::Expression { .. } => "expression error",
            Gsm8kToolDrop::Differs { .. } => "result differs",
        }
    }
}

impl fmt::Display for Gsm8kToolDrop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Gsm8kToolDrop::Malformed { annotation } => {
                write!(f, "malformed annotation `{annotation}`")
            }
            Gsm8kToolDrop::Expression { expression, error } => {
                write!(f, "the calculator has no value for `{expression}`: {error}")
            }
            Gsm8kToolDrop::Differs {
                expression,
                annotated,
                calculator,
            } => write!(
                f,
                "`{expression}` is {calculator} for the calculator, {annotated} in the annotation"
            ),
        }
    }
}

/// One row's SFT conversation.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolConversation {
    /// `{role, content}` messages: user, then (assistant, tool) per call, then the final
    /// assistant turn.
    pub messages: Vec<Value>,
    /// Calculator calls in it.
    pub calls: usize,
    /// Calls whose expression was normalised (see [`normalise_expression`]).
    pub normalised: usize,
    /// Annotations that compute nothing (`<<-47=-47>>`, `<<3/4=3/4>>`), removed without a call.
    pub bare: usize,
}

impl ToolConversation {
    /// Characters of all message contents together (no chat template, no tokens).
    pub fn chars(&self) -> usize {
        self.messages
            .iter()
            .filter_map(|m| m["content"].as_str())
            .map(|s| s.chars().count())
            .sum()
    }
}

/// For messages: the calculator's exact text when there is one, else `num/den` (`10/3`).
fn describe(value: Number) -> String {
    match (value.exact_text(), value.fraction()) {
        (Some(text), _) => text,
        (None, Some((num, den))) => format!("{num}/{den}"),
        (None, None) => value.to_string(),
    }
}

/// Written just before a marker, these belong to the number after it (`$0.2`, `(4`).
const GLUE: &[char] = &['$', '€', '£', '¢', '¥', '('];

fn message(role: &str, content: &str) -> Value {
    json!({"role": role, "content": content})
}

/// The SFT conversation of one GSM8K row (see the module documentation), or why it has none.
pub fn gsm8k_tool_conversation(
    row: &Gsm8kRow,
) -> std::result::Result<ToolConversation, Gsm8kToolDrop> {
    let mut out = ToolConversation {
        messages: vec![message(
            "user",
            &format!("{} {GSM8K_TOOL_INSTRUCTION}", row.question),
        )],
        calls: 0,
        normalised: 0,
        bare: 0,
    };
    // The visible text since the last call.
    let mut pending = String::new();
    let mut rest = row.answer.as_str();
    while let Some(open) = rest.find("<<") {
        pending.push_str(&rest[..open]);
        let after = &rest[open + 2..];
        let Some(close) = after.find(">>") else {
            return Err(Gsm8kToolDrop::Malformed {
                annotation: rest[open..].chars().take(40).collect(),
            });
        };
        let annotation = &after[..close];
        rest = &after[close + 2..];
        let Some((written, annotated)) = annotation.rsplit_once('=') else {
            return Err(Gsm8kToolDrop::Malformed {
                annotation: format!("<<{annotation}>>"),
            });
        };
        let written = written.trim();
        let compact = |s: &str| s.replace(' ', "");
        if Number::parse_decimal(&compact(written)).is_some()
            || compact(written) == compact(annotated)
        {
            out.bare += 1;
            continue;
        }
        let expression = normalise_expression(written);
        let value = value_of(&expression).map_err(|error| Gsm8kToolDrop::Expression {
            expression: expression.clone(),
            error: error.0,
        })?;
        let annotated = annotated.trim();
        let result = (Number::parse_decimal(&annotated.replace(',', "")) == Some(value))
            .then(|| value.to_string())
            .ok_or_else(|| Gsm8kToolDrop::Differs {
                expression: expression.clone(),
                annotated: annotated.to_string(),
                calculator: describe(value),
            })?;
        out.normalised += usize::from(expression != written);
        out.calls += 1;
        let keep = pending.trim_end_matches(GLUE).len();
        let text = pending[..keep].trim();
        let call = tool_call_text(&expression);
        let content = if text.is_empty() {
            call
        } else {
            format!("{text}\n{call}")
        };
        out.messages.push(message("assistant", &content));
        out.messages.push(message("tool", &result));
        pending = pending[keep..].to_string();
    }
    pending.push_str(rest);
    out.messages.push(message("assistant", pending.trim()));
    Ok(out)
}

/// What became of one split's rows in the SFT file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Gsm8kToolStats {
    /// Raw rows read.
    pub rows: usize,
    /// Conversations written.
    pub conversations: usize,
    /// Calculator calls per conversation → conversations with that many.
    pub calls: BTreeMap<usize, usize>,
    /// Reason ([`Gsm8kToolDrop::reason`]) → rows dropped for it.
    pub dropped: BTreeMap<String, usize>,
    /// The first few drops: `(row index, what was wrong)`.
    pub drop_examples: Vec<(i64, String)>,
    /// Calls whose expression was normalised.
    pub normalised: usize,
    /// Annotations that compute nothing, removed without a call.
    pub bare: usize,
    /// The median of [`ToolConversation::chars`] (the upper middle of an even count).
    pub median_chars: usize,
}

impl Gsm8kToolStats {
    pub fn dropped_rows(&self) -> usize {
        self.dropped.values().sum()
    }
}

impl fmt::Display for Gsm8kToolStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let calls: Vec<String> = self
            .calls
            .iter()
            .map(|(k, n)| format!("{k}: {n}"))
            .collect();
        write!(
            f,
            "{} conversations of {} rows; calculator calls per conversation {{{}}}; median {} \
             characters; {} normalised expressions, {} annotations computing nothing; {} dropped",
            self.conversations,
            self.rows,
            calls.join(", "),
            self.median_chars,
            self.normalised,
            self.bare,
            self.dropped_rows()
        )?;
        if !self.dropped.is_empty() {
            let reasons: Vec<String> = self
                .dropped
                .iter()
                .map(|(r, n)| format!("{r}: {n}"))
                .collect();
            write!(f, " ({})", reasons.join(", "))?;
            for (index, why) in &self.drop_examples {
                write!(f, "; row {index}: {why}")?;
            }
        }
        Ok(())
    }
}

const DROP_EXAMPLES: usize = 5;

/// The conversations of `rows` (rows that fail the check left out) and what became of them.
pub fn gsm8k_tool_conversations(rows: &[Gsm8kRow]) -> (Vec<ToolConversation>, Gsm8kToolStats) {
    let mut stats = Gsm8kToolStats {
        rows: rows.len(),
        ..Gsm8kToolStats::default()
    };
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        match gsm8k_tool_conversation(row) {
            Ok(c) => {
                *stats.calls.entry(c.calls).or_default() += 1;
                stats.normalised += c.normalised;
                stats.bare += c.bare;
                out.push(c);
            }
            Err(drop) => {
                *stats.dropped.entry(drop.reason().to_string()).or_default() += 1;
                if stats.drop_examples.len() < DROP_EXAMPLES {
                    stats.drop_examples.push((row.index, drop.to_string()));
                }
            }
        }
    }
    stats.conversations = out.len();
    let mut chars: Vec<usize> = out.iter().map(ToolConversation::chars).collect();
    chars.sort_unstable();
    stats.median_chars = chars.get(chars.len() / 2).copied().unwrap_or(0);
    (out, stats)
}

/// `messages` and `tools` (verl's multi-turn SFT keys), each row offered the calculator.
pub fn tool_sft_record_batch(conversations: &[ToolConversation]) -> Result<RecordBatch> {
    let messages: Vec<Value> = conversations
        .iter()
        .map(|c| Value::Array(c.messages.clone()))
        .collect();
    let tools = vec![json!([gsm8k_calculator_schema()]); conversations.len()];
    let shape = |found: String| DataError::InvalidConfig {
        key: "gsm8k tool SFT rows".into(),
        expected: "conversations of one JSON shape".into(),
        found,
    };
    let messages = json_column(&messages).map_err(shape)?;
    let tools = json_column(&tools).map_err(shape)?;
    let schema = Schema::new(vec![
        Field::new("messages", messages.data_type().clone(), true),
        Field::new("tools", tools.data_type().clone(), true),
    ]);
    RecordBatch::try_new(Arc::new(schema), vec![messages, tools]).map_err(|source| {
        DataError::Arrow {
            path: PathBuf::from("<gsm8k tool SFT record batch>"),
            source,
        }
    })
}

/// Files written by [`gsm8k_tools_preprocess`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gsm8kToolsOutput {
    /// RL rows for verl's tool agent loop.
    pub train: PathBuf,
    pub train_rows: usize,
    pub test: PathBuf,
    pub test_rows: usize,
    /// Multi-turn SFT conversations.
    pub sft_train: PathBuf,
    pub sft_train_stats: Gsm8kToolStats,
    pub sft_test: PathBuf,
    pub sft_test_stats: Gsm8kToolStats,
}

/// Converts `raw_dir/{train,test}.jsonl` into `out_dir/{train,test}.parquet` (RL rows for the tool
/// agent loop, in place of the plain files) and `out_dir/sft_{train,test}.parquet` (the
/// conversations), creating `out_dir` if needed.
pub fn gsm8k_tools_preprocess(raw_dir: &Path, out_dir: &Path) -> Result<Gsm8kToolsOutput> {
    std::fs::create_dir_all(out_dir).map_err(|source| DataError::Write {
        path: out_dir.to_path_buf(),
        source,
    })?;
    let convert = |split: &str| -> Result<(PathBuf, usize, PathBuf, Gsm8kToolStats)> {
        let rows = read_raw(&raw_dir.join(format!("{split}.jsonl")), split)?;
        let rl = out_dir.join(format!("{split}.parquet"));
        let batch = gsm8k_record_batch_with(&rows, GSM8K_TOOL_INSTRUCTION, Some(TOOL_AGENT))?;
        write_parquet(&rl, &[batch])?;
        let (conversations, stats) = gsm8k_tool_conversations(&rows);
        let sft = out_dir.join(format!("sft_{split}.parquet"));
        write_parquet(&sft, &[tool_sft_record_batch(&conversations)?])?;
        Ok((rl, rows.len(), sft, stats))
    };
    let (train, train_rows, sft_train, sft_train_stats) = convert("train")?;
    let (test, test_rows, sft_test, sft_test_stats) = convert("test")?;
    Ok(Gsm8kToolsOutput {
        train,
        train_rows,
        test,
        test_rows,
        sft_train,
        sft_train_stats,
        sft_test,
        sft_test_stats,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(answer: &str) -> Gsm8kRow {
        Gsm8kRow {
            split: "train".into(),
            index: 3,
            question: "How many?".into(),
            answer: answer.into(),
            solution: crate::gsm8k::extract_solution(answer).unwrap_or_default(),
        }
    }

    fn contents(c: &ToolConversation) -> Vec<(String, String)> {
        c.messages
            .iter()
            .map(|m| {
                (
                    m["role"].as_str().unwrap().to_string(),
                    m["content"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }

    #[test]
    fn expressions_are_normalised_to_the_calculators_operators() {
        assert_eq!(normalise_expression(" 3 x 4 "), "3 * 4");
        assert_eq!(normalise_expression("3×4÷2"), "3*4/2");
        assert_eq!(normalise_expression("1,000 - 2"), "1000 - 2");
        assert_eq!(normalise_expression("(1, 2)"), "(1, 2)");
        assert_eq!(normalise_expression("10 – 4"), "10 - 4");
    }

    #[test]
    fn each_annotation_becomes_a_call_and_the_markers_go() {
        let c = gsm8k_tool_conversation(&row(
            "Each box costs 12/60 = $<<12/60=0.2>>0.2 a minute, so (<<3 x 4=12>>12 in all).\n\
             There are <<-47=-47>>-47 left, <<3/4=3/4>>3/4 of them.\n#### 12",
        ))
        .unwrap();
        assert_eq!((c.calls, c.normalised, c.bare), (2, 1, 2));
        let call = |e: &str| tool_call_text(e);
        assert_eq!(
            contents(&c),
            vec![
                ("user".into(), format!("How many? {GSM8K_TOOL_INSTRUCTION}")),
                (
                    "assistant".into(),
                    format!("Each box costs 12/60 =\n{}", call("12/60"))
                ),
                ("tool".into(), "0.2".into()),
                (
                    "assistant".into(),
                    format!("$0.2 a minute, so\n{}", call("3 * 4"))
                ),
                ("tool".into(), "12".into()),
                (
                    "assistant".into(),
                    "(12 in all).\nThere are -47 left, 3/4 of them.\n#### 12".into()
                ),
            ]
        );
        assert!(c
            .messages
            .iter()
            .all(|m| !m["content"].as_str().unwrap().contains("<<")));
        assert_eq!(c.chars(), {
            let all: Vec<(String, String)> = contents(&c);
            all.iter().map(|(_, s)| s.chars().count()).sum::<usize>()
        });
    }

    #[test]
    fn a_call_at_the_very_start_has_no_text_and_a_solution_without_annotations_is_one_answer() {
        let c = gsm8k_tool_conversation(&row("<<2*3=6>>6 cups.\n#### 6")).unwrap();
        let m = contents(&c);
        assert_eq!(m[1], ("assistant".into(), tool_call_text("2*3")));
        assert_eq!(m[3], ("assistant".into(), "6 cups.\n#### 6".into()));
        let c = gsm8k_tool_conversation(&row("She has 6 cups.\n#### 6")).unwrap();
        assert_eq!(c.calls, 0);
        assert_eq!(
            contents(&c)[1..],
            [(
                "assistant".to_string(),
                "She has 6 cups.\n#### 6".to_string()
            )]
        );
    }

    #[test]
    fn rows_whose_annotation_fails_the_check_are_dropped_with_the_reason() {
        let differs =
            gsm8k_tool_conversation(&row("It is 10/3 = <<10/3=3.33>>3.33\n#### 3.33")).unwrap_err();
        assert_eq!(differs.reason(), "result differs");
        assert_eq!(
            differs.to_string(),
            "`10/3` is 10/3 for the calculator, 3.33 in the annotation"
        );
        let wrong = gsm8k_tool_conversation(&row("<<2+2=5>>5\n#### 5")).unwrap_err();
        assert_eq!(wrong.reason(), "result differs");
        let bad = gsm8k_tool_conversation(&row("<<(2+2=4>>4\n#### 4")).unwrap_err();
        assert_eq!(bad.reason(), "expression error");
        assert!(bad.to_string().contains("missing `)`"), "{bad}");
        let caret = gsm8k_tool_conversation(&row("<<2^3=8>>8\n#### 8")).unwrap_err();
        assert_eq!(caret.reason(), "expression error");
        assert!(
            caret.to_string().contains("write powers as `**`"),
            "{caret}"
        );
        let zero = gsm8k_tool_conversation(&row("<<1/(2-2)=0>>0\n#### 0")).unwrap_err();
        assert_eq!(
            zero.to_string(),
            "the calculator has no value for `1/(2-2)`: division by zero"
        );
        for broken in ["<<2+2=4 and 4\n#### 4", "<<2+2>>4\n#### 4"] {
            let e = gsm8k_tool_conversation(&row(broken)).unwrap_err();
            assert_eq!(e.reason(), "malformed annotation", "{broken}");
        }
        // `%` and `**` are the calculator's operators too.
        let c = gsm8k_tool_conversation(&row("<<7%2=1>>1 and <<2**3=8>>8\n#### 8")).unwrap();
        assert_eq!((c.calls, contents(&c)[4].1.as_str()), (2, "8"));
        // Commas in the annotated result are read as digit groups.
        let c = gsm8k_tool_conversation(&row("<<1000*2=2,000>>2,000\n#### 2000")).unwrap();
        assert_eq!(contents(&c)[2], ("tool".into(), "2000".into()));
    }

    #[test]
    fn stats_count_calls_drops_and_the_median_length() {
        let rows = vec![
            row("<<1+1=2>>2\n#### 2"),
            row("<<2+2=5>>5\n#### 5"),
            row("A <<1+1=2>>2, B <<2+2=4>>4.\n#### 4"),
            row("Just 4.\n#### 4"),
        ];
        let (conversations, stats) = gsm8k_tool_conversations(&rows);
        assert_eq!(conversations.len(), 3);
        assert_eq!(stats.rows, 4);
        assert_eq!(stats.conversations, 3);
        assert_eq!(stats.calls, BTreeMap::from([(0, 1), (1, 1), (2, 1)]));
        assert_eq!(
            stats.dropped,
            BTreeMap::from([("result differs".into(), 1)])
        );
        assert_eq!(stats.drop_examples.len(), 1);
        let mut lens: Vec<usize> = conversations.iter().map(ToolConversation::chars).collect();
        lens.sort_unstable();
        assert_eq!(stats.median_chars, lens[1]);
        let text = stats.to_string();
        assert!(
            text.contains("{0: 1, 1: 1, 2: 1}") && text.contains("1 dropped (result differs: 1)"),
            "{text}"
        );
    }

    #[test]
    fn preprocess_writes_rl_rows_for_the_tool_agent_and_sft_conversations() {
        let raw = tempfile::tempdir().unwrap();
        let lines = [
            r#"{"question": "Q0?", "answer": "Half is 48/2 = <<48/2=24>>24.\n#### 24"}"#,
            r#"{"question": "Q1?", "answer": "Bad <<2+2=5>>5.\n#### 5"}"#,
        ];
        for split in ["train", "test"] {
            std::fs::write(raw.path().join(format!("{split}.jsonl")), lines.join("\n")).unwrap();
        }
        let out = tempfile::tempdir().unwrap();
        let o = gsm8k_tools_preprocess(raw.path(), &out.path().join("gsm8k")).unwrap();
        assert_eq!((o.train_rows, o.test_rows), (2, 2));
        assert_eq!(o.sft_train_stats.conversations, 1);
        assert_eq!(o.sft_test_stats.dropped_rows(), 1);

        let rl = crate::read::read_table(&o.train).unwrap();
        assert_eq!(
            rl.columns.as_deref().unwrap(),
            [
                "data_source",
                "agent_name",
                "prompt",
                "ability",
                "reward_model",
                "extra_info"
            ]
        );
        let r = &rl.rows[1];
        assert_eq!(r["agent_name"], "tool_agent");
        assert_eq!(r["data_source"], "openai/gsm8k");
        assert_eq!(
            r["reward_model"],
            json!({"style": "rule", "ground_truth": "5"})
        );
        assert_eq!(
            r["extra_info"],
            json!({"split": "train", "index": 1, "answer": "Bad <<2+2=5>>5.\n#### 5", "question": "Q1?"})
        );
        assert_eq!(
            r["prompt"],
            json!([{"role": "user", "content": format!("Q1? {GSM8K_TOOL_INSTRUCTION}")}])
        );

        let sft = crate::sft::read_sft_conversations(
            &[&o.sft_test],
            &crate::sft::MultiturnKeys::default(),
        )
        .unwrap();
        assert_eq!(sft.len(), 1);
        assert_eq!(sft[0].tools, Some(vec![gsm8k_calculator_schema()]));
        assert_eq!(
            sft[0].messages[0]["content"],
            rl.rows[0]["prompt"][0]["content"]
        );
        assert_eq!(sft[0].messages[2], json!({"role": "tool", "content": "24"}));
    }
}
