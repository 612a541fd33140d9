//! A task the project generates itself: seeded multi-step integer arithmetic word problems in short
//! sentences ("Mia has 7 apples. She buys 5 more. She gives away 3. How many apples does Mia have
//! now?"), written as verl's GSM8K parquet (`data_source = openai/gsm8k`, so the stock gsm8k rule
//! reward scores it) plus (question, worked answer) pairs for supervised fine-tuning.
//!
//! Difficulty is two knobs: how many operations a problem chains and how large the operands are;
//! the quickstart keeps both small so a model of a few hundred thousand parameters can learn it on
//! a CPU in minutes.
//!
//! A third knob makes a deliberately *noisy teacher* for SFT: `sft_noise` is the fraction of the SFT
//! training answers whose final `#### N` is written one too high (the worked steps stay right). A
//! model fine-tuned on that is able to solve the task but unreliable at the last token; RL with the
//! rule reward, which always scores against the correct answer, removes the slips. The RL train and
//! validation ground truth and the SFT validation answers are never noisy.
//!
//! The *tool variant* (`tool_rate`) is the same task with operands too large for a tiny model to
//! add reliably, solved with a `calculator` tool: the RL rows select verl's tool agent loop
//! (`agent_name: tool_agent`) and ask for the calculator, and the SFT rows are multi-turn
//! conversations in verl's `MultiTurnSFTDataset` form (`messages`, `tools`) where a `tool_rate`
//! fraction of the answers call the calculator (hermes `<tool_call>` JSON, as Qwen2.5 writes it)
//! and copy its result into `#### N`, and the rest answer directly (mostly wrong, for a tiny model).
//! RL then has a better behaviour to promote: calling the tool.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::columns::json_column;
use crate::error::{DataError, Result};
use crate::gsm8k::{gsm8k_record_batch, gsm8k_record_batch_with, Gsm8kRow};
use crate::write::write_parquet;

/// The tool the tool variant teaches (its `tool_schema.function.name`).
pub const CALCULATOR_TOOL: &str = "calculator";
/// verl's agent loop name for tool calling (`agent_name` column of the tool variant's RL rows).
pub const TOOL_AGENT: &str = "tool_agent";
/// Appended (after one space) to every question of the tool variant.
pub const TOOL_INSTRUCTION: &str = "Use the calculator, then give the final answer after \"####\".";

/// The calculator's function schema (OpenAI tool form, what verl's tool config holds under
/// `tool_schema` and what the chat template lists). `examples/quickstart/tools.yaml` holds the same.
pub fn calculator_tool_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "function",
        "function": {
            "name": CALCULATOR_TOOL,
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "integers with + and -"}
                },
                "required": ["expression"]
            }
        }
    })
}

/// The assistant's text for one calculator call in hermes form (Qwen2.5's): the JSON as Python's
/// `json.dumps` writes it (`", "` and `": "` separators) between `<tool_call>` lines.
pub fn tool_call_text(expression: &str) -> String {
    let call =
        serde_json::json!({"name": CALCULATOR_TOOL, "arguments": {"expression": expression}});
    format!(
        "<tool_call>\n{}\n</tool_call>",
        crate::py_json::dumps(&call, None)
    )
}

/// What to generate. `Default` is the quickstart's task.
#[derive(Clone, Debug, PartialEq)]
pub struct ArithConfig {
    pub train: usize,
    pub val: usize,
    pub seed: u64,
    /// Operations per problem, drawn uniformly from `min_ops..=max_ops`.
    pub min_ops: usize,
    pub max_ops: usize,
    /// Operands (the start amount and every change) are drawn from `min_operand..=max_operand`.
    pub min_operand: u32,
    pub max_operand: u32,
    /// Fraction (0..=1) of the SFT training answers written with a slip: the final `#### N` one
    /// higher than the worked result. Drawn from its own seeded stream, so the problems themselves
    /// do not depend on it. In the tool variant it slips the direct answers only.
    pub sft_noise: f64,
    /// The tool variant: `Some(rate)` writes RL rows for verl's tool agent loop and multi-turn SFT
    /// rows of which a `rate` fraction call the calculator (drawn from their own seeded stream).
    pub tool_rate: Option<f64>,
}

impl Default for ArithConfig {
    fn default() -> Self {
        ArithConfig {
            train: 2000,
            val: 128,
            seed: 7,
            min_ops: 1,
            max_ops: 2,
            min_operand: 1,
            max_operand: 9,
            sft_noise: 0.0,
            tool_rate: None,
        }
    }
}

/// One generated problem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArithProblem {
    pub question: String,
    /// The worked solution, one equation per operation, ending in `#### N`.
    pub answer: String,
    /// The problem as one expression for the calculator, e.g. `4821 + 3977 - 12`.
    pub expression: String,
    pub result: i64,
}

const NAMES: &[(&str, &str)] = &[
    ("Mia", "She"),
    ("Tom", "He"),
    ("Ana", "She"),
    ("Ben", "He"),
    ("Zoe", "She"),
    ("Sam", "He"),
    ("Ivy", "She"),
    ("Leo", "He"),
];
const ITEMS: &[&str] = &["apples", "books", "coins", "cards", "pens", "shells"];
const GAINS: &[&str] = &["buys {n} more", "finds {n} more", "gets {n} more"];
const LOSSES: &[&str] = &["gives away {n}", "loses {n}", "sells {n}"];

/// Draws one problem. Amounts never go negative: a loss is drawn only up to the current amount
/// (and only when the amount exceeds `min_operand`).
pub fn arith_problem(rng: &mut impl Rng, cfg: &ArithConfig) -> ArithProblem {
    let max = cfg.max_operand.max(1) as i64;
    let min = (cfg.min_operand.max(1) as i64).min(max);
    let (name, pronoun) = NAMES[rng.gen_range(0..NAMES.len())];
    let item = ITEMS[rng.gen_range(0..ITEMS.len())];
    let ops = rng.gen_range(cfg.min_ops.max(1)..=cfg.max_ops.max(cfg.min_ops.max(1)));
    let mut value = rng.gen_range(min..=max);
    let mut question = format!("{name} has {value} {item}.");
    let mut answer = String::new();
    let mut expression = value.to_string();
    for _ in 0..ops {
        let lose = value > min && rng.gen_bool(0.5);
        let (n, next, template, sign) = if lose {
            let n = rng.gen_range(min..=max.min(value - 1));
            (n, value - n, LOSSES[rng.gen_range(0..LOSSES.len())], '-')
        } else {
            let n = rng.gen_range(min..=max);
            (n, value + n, GAINS[rng.gen_range(0..GAINS.len())], '+')
        };
        question.push_str(&format!(
            " {pronoun} {}.",
            template.replace("{n}", &n.to_string())
        ));
        answer.push_str(&format!("{value} {sign} {n} = {next}. "));
        expression.push_str(&format!(" {sign} {n}"));
        value = next;
    }
    question.push_str(&format!(" How many {item} does {name} have now?"));
    answer.push_str(&format!("#### {value}"));
    ArithProblem {
        question,
        answer,
        expression,
        result: value,
    }
}

/// `cfg.train` and `cfg.val` problems with no question in both splits (validation measures
/// generalisation, not recall).
pub fn arith_splits(cfg: &ArithConfig) -> Result<(Vec<ArithProblem>, Vec<ArithProblem>)> {
    if cfg.min_ops == 0 || cfg.max_ops < cfg.min_ops {
        return Err(DataError::InvalidConfig {
            key: "arith ops".into(),
            expected: "1 <= min_ops <= max_ops".into(),
            found: format!("min_ops={} max_ops={}", cfg.min_ops, cfg.max_ops),
        });
    }
    if !(0.0..=1.0).contains(&cfg.sft_noise) {
        return Err(DataError::InvalidConfig {
            key: "arith sft_noise".into(),
            expected: "a fraction in 0..=1".into(),
            found: cfg.sft_noise.to_string(),
        });
    }
    if cfg.max_operand == 0 || cfg.min_operand > cfg.max_operand {
        return Err(DataError::InvalidConfig {
            key: "arith min_operand/max_operand".into(),
            expected: "1 <= max_operand and min_operand <= max_operand".into(),
            found: format!(
                "min_operand={} max_operand={}",
                cfg.min_operand, cfg.max_operand
            ),
        });
    }
    if let Some(rate) = cfg.tool_rate {
        if !(0.0..=1.0).contains(&rate) {
            return Err(DataError::InvalidConfig {
                key: "arith tool_rate".into(),
                expected: "a fraction in 0..=1".into(),
                found: rate.to_string(),
            });
        }
    }
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let mut seen = HashSet::new();
    let wanted = cfg.train + cfg.val;
    let mut out = Vec::with_capacity(wanted);
    // Small settings have few distinct problems; give up rather than loop forever.
    let budget = wanted.saturating_mul(50).max(1000);
    for _ in 0..budget {
        if out.len() == wanted {
            break;
        }
        let p = arith_problem(&mut rng, cfg);
        if seen.insert(p.question.clone()) {
            out.push(p);
        }
    }
    if out.len() < wanted {
        return Err(DataError::InvalidConfig {
            key: "arith train/val".into(),
            expected: format!(
                "at most {} distinct problems for max_ops={} max_operand={}",
                out.len(),
                cfg.max_ops,
                cfg.max_operand
            ),
            found: format!("train={} val={}", cfg.train, cfg.val),
        });
    }
    let val = out.split_off(cfg.train);
    Ok((out, val))
}

/// Files written by [`arith_write`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArithOutput {
    /// RL prompts in verl's GSM8K schema.
    pub train: PathBuf,
    pub val: PathBuf,
    /// SFT pairs: `question` (the same user message as the RL prompt) and `answer` (the worked
    /// solution), verl's SFT trainer's default `prompt_key`/`response_key`. In the tool variant,
    /// conversations instead: `messages` and `tools` (verl's multi-turn SFT keys).
    pub sft_train: PathBuf,
    pub sft_val: PathBuf,
    pub train_rows: usize,
    pub val_rows: usize,
    /// Tool variant: how many SFT training conversations call the calculator.
    pub sft_tool_calls: Option<usize>,
}

fn rows(problems: &[ArithProblem], split: &str) -> Vec<Gsm8kRow> {
    problems
        .iter()
        .enumerate()
        .map(|(i, p)| Gsm8kRow {
            split: split.to_string(),
            index: i as i64,
            question: p.question.clone(),
            answer: p.answer.clone(),
            solution: p.result.to_string(),
        })
        .collect()
}

/// The SFT answer with a slip: the worked steps as they are, the final answer one too high.
pub fn slipped_answer(p: &ArithProblem) -> String {
    let steps = p.answer.rsplit_once("#### ").map_or("", |(s, _)| s);
    format!("{steps}#### {}", p.result + 1)
}

/// The SFT training rows: each answer slipped with probability `noise`, from a stream seeded
/// apart from the problems'.
fn noisy_sft_rows(problems: &[ArithProblem], noise: f64, seed: u64) -> Vec<Gsm8kRow> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5f7_0015e);
    let mut out = rows(problems, "train");
    for (row, p) in out.iter_mut().zip(problems) {
        if rng.gen_bool(noise) {
            row.answer = slipped_answer(p);
        }
    }
    out
}

fn sft_batch(rows: &[Gsm8kRow]) -> Result<RecordBatch> {
    let schema = Schema::new(vec![
        Field::new("question", DataType::Utf8, true),
        Field::new("answer", DataType::Utf8, true),
    ]);
    RecordBatch::try_new(
        Arc::new(schema),
        vec![
            Arc::new(StringArray::from_iter_values(
                rows.iter().map(|r| r.prompt_content()),
            )),
            Arc::new(StringArray::from_iter_values(
                rows.iter().map(|r| r.answer.clone()),
            )),
        ],
    )
    .map_err(|source| DataError::Arrow {
        path: PathBuf::from("<arith sft record batch>"),
        source,
    })
}

/// The tool variant's SFT conversation for `p`: the user message (the RL prompt), then either a
/// calculator call, its result and `#### N` copied from it (`call`), or the direct worked
/// `answer` (which may carry a slip). Both copy the operands from the question, so every
/// conversation teaches the copying the calculator path needs; only the direct one also has to
/// add.
pub fn tool_conversation(p: &ArithProblem, call: bool, answer: &str) -> serde_json::Value {
    let user = format!("{} {TOOL_INSTRUCTION}", p.question);
    let msg = |role: &str, content: &str| serde_json::json!({"role": role, "content": content});
    let mut messages = vec![msg("user", &user)];
    if call {
        messages.push(msg("assistant", &tool_call_text(&p.expression)));
        messages.push(msg("tool", &p.result.to_string()));
        messages.push(msg("assistant", &format!("#### {}", p.result)));
    } else {
        messages.push(msg("assistant", answer));
    }
    serde_json::Value::Array(messages)
}

/// Multi-turn SFT rows (`messages`, `tools`): each conversation calls the calculator with
/// probability `rate`, from a stream seeded apart from the problems'. Returns the calls made.
fn tool_sft_batch(
    rows: &[Gsm8kRow],
    problems: &[ArithProblem],
    rate: f64,
    seed: u64,
) -> Result<(RecordBatch, usize)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x7001_ca11);
    let mut calls = 0;
    let conversations: Vec<serde_json::Value> = rows
        .iter()
        .zip(problems)
        .map(|(row, p)| {
            let call = rng.gen_bool(rate);
            calls += usize::from(call);
            tool_conversation(p, call, &row.answer)
        })
        .collect();
    let tools = vec![serde_json::json!([calculator_tool_schema()]); rows.len()];
    let arrow = |message: String| DataError::InvalidConfig {
        key: "arith tool SFT rows".into(),
        expected: "uniform JSON rows".into(),
        found: message,
    };
    let messages = json_column(&conversations).map_err(arrow)?;
    let tools = json_column(&tools).map_err(arrow)?;
    let schema = Schema::new(vec![
        Field::new("messages", messages.data_type().clone(), true),
        Field::new("tools", tools.data_type().clone(), true),
    ]);
    let batch =
        RecordBatch::try_new(Arc::new(schema), vec![messages, tools]).map_err(|source| {
            DataError::Arrow {
                path: PathBuf::from("<arith tool SFT record batch>"),
                source,
            }
        })?;
    Ok((batch, calls))
}

/// Writes `train.parquet`, `val.parquet`, `sft_train.parquet` and `sft_val.parquet` into `out_dir`.
pub fn arith_write(out_dir: &Path, cfg: &ArithConfig) -> Result<ArithOutput> {
    std::fs::create_dir_all(out_dir).map_err(|source| DataError::Write {
        path: out_dir.to_path_buf(),
        source,
    })?;
    let (train_p, val_p) = arith_splits(cfg)?;
    let sft_train = noisy_sft_rows(&train_p, cfg.sft_noise, cfg.seed);
    let (train, val) = (rows(&train_p, "train"), rows(&val_p, "test"));
    let mut out = ArithOutput {
        train: out_dir.join("train.parquet"),
        val: out_dir.join("val.parquet"),
        sft_train: out_dir.join("sft_train.parquet"),
        sft_val: out_dir.join("sft_val.parquet"),
        train_rows: train.len(),
        val_rows: val.len(),
        sft_tool_calls: None,
    };
    match cfg.tool_rate {
        None => {
            write_parquet(&out.train, &[gsm8k_record_batch(&train)?])?;
            write_parquet(&out.val, &[gsm8k_record_batch(&val)?])?;
            write_parquet(&out.sft_train, &[sft_batch(&sft_train)?])?;
            write_parquet(&out.sft_val, &[sft_batch(&val)?])?;
        }
        Some(rate) => {
            let rl = |rows: &[Gsm8kRow]| {
                gsm8k_record_batch_with(rows, TOOL_INSTRUCTION, Some(TOOL_AGENT))
            };
            write_parquet(&out.train, &[rl(&train)?])?;
            write_parquet(&out.val, &[rl(&val)?])?;
            let (sft, calls) = tool_sft_batch(&sft_train, &train_p, rate, cfg.seed)?;
            write_parquet(&out.sft_train, &[sft])?;
            let (sft, _) = tool_sft_batch(&val, &val_p, rate, cfg.seed ^ 1)?;
            write_parquet(&out.sft_val, &[sft])?;
            out.sft_tool_calls = Some(calls);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gsm8k::extract_solution;

    /// Re-does the worked solution's arithmetic from the question text alone.
    fn solve(question: &str) -> i64 {
        let nums: Vec<i64> = question
            .split(|c: char| !c.is_ascii_digit())
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().unwrap())
            .collect();
        let mut v = nums[0];
        let sentences: Vec<&str> = question.split(". ").skip(1).collect();
        for (s, n) in sentences.iter().zip(&nums[1..]) {
            if LOSSES
                .iter()
                .any(|t| s.contains(t.split(' ').next().unwrap()))
            {
                v -= n;
            } else {
                v += n;
            }
        }
        v
    }

    #[test]
    fn problems_are_correct_seeded_and_in_gsm8k_answer_form() {
        let cfg = ArithConfig {
            train: 300,
            val: 50,
            seed: 3,
            min_ops: 1,
            max_ops: 3,
            min_operand: 1,
            max_operand: 12,
            sft_noise: 0.0,
            tool_rate: None,
        };
        let (train, val) = arith_splits(&cfg).unwrap();
        assert_eq!((train.len(), val.len()), (300, 50));
        for p in train.iter().chain(&val) {
            assert_eq!(solve(&p.question), p.result, "{p:?}");
            assert!(p.result >= 1, "{p:?}");
            assert_eq!(extract_solution(&p.answer), Some(p.result.to_string()));
            let steps = p.answer.matches(" = ").count();
            assert!((1..=3).contains(&steps), "{p:?}");
        }
        let train_q: HashSet<_> = train.iter().map(|p| &p.question).collect();
        assert!(val.iter().all(|p| !train_q.contains(&p.question)));
        assert_eq!(arith_splits(&cfg).unwrap(), (train, val));
        let other = arith_splits(&ArithConfig { seed: 4, ..cfg }).unwrap();
        assert_ne!(other.0[0], arith_splits(&cfg).unwrap().0[0]);
    }

    #[test]
    fn impossible_sizes_and_bad_knobs_are_named() {
        let tiny = ArithConfig {
            train: 100_000,
            val: 1,
            seed: 0,
            min_ops: 1,
            max_ops: 1,
            min_operand: 1,
            max_operand: 2,
            sft_noise: 0.0,
            tool_rate: None,
        };
        let e = arith_splits(&tiny).unwrap_err().to_string();
        assert!(
            e.contains("distinct problems") && e.contains("train=100000"),
            "{e}"
        );
        let bad = ArithConfig {
            min_ops: 3,
            max_ops: 2,
            ..ArithConfig::default()
        };
        assert!(arith_splits(&bad)
            .unwrap_err()
            .to_string()
            .contains("min_ops=3"));
        let noisy = ArithConfig {
            sft_noise: 1.5,
            ..ArithConfig::default()
        };
        assert!(arith_splits(&noisy)
            .unwrap_err()
            .to_string()
            .contains("sft_noise"));
    }

    #[test]
    fn sft_noise_slips_only_the_sft_training_answers() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = ArithConfig {
            train: 400,
            val: 40,
            sft_noise: 0.5,
            ..ArithConfig::default()
        };
        let out = arith_write(dir.path(), &cfg).unwrap();
        let (train, val) = arith_splits(&cfg).unwrap();
        // The problems do not depend on the noise.
        assert_eq!(
            (train.clone(), val.clone()),
            arith_splits(&ArithConfig {
                sft_noise: 0.0,
                ..cfg.clone()
            })
            .unwrap()
        );
        let sft = crate::read::read_table(&out.sft_train).unwrap();
        let mut slipped = 0;
        for (row, p) in sft.rows.iter().zip(&train) {
            let a = row["answer"].as_str().unwrap();
            if a == p.answer {
                continue;
            }
            assert_eq!(a, slipped_answer(p));
            assert_eq!(extract_solution(a), Some((p.result + 1).to_string()));
            slipped += 1;
        }
        assert!((150..=250).contains(&slipped), "{slipped} of 400 slipped");
        // RL ground truth and SFT validation stay correct.
        let rl = crate::read::read_table(&out.train).unwrap();
        for (row, p) in rl.rows.iter().zip(&train) {
            assert_eq!(
                row["reward_model"]["ground_truth"].as_str().unwrap(),
                p.result.to_string()
            );
        }
        let sv = crate::read::read_table(&out.sft_val).unwrap();
        for (row, p) in sv.rows.iter().zip(&val) {
            assert_eq!(row["answer"].as_str().unwrap(), p.answer);
        }
        // Seeded: the same slips again.
        let dir2 = tempfile::tempdir().unwrap();
        let out2 = arith_write(dir2.path(), &cfg).unwrap();
        assert_eq!(
            std::fs::read(&out.sft_train).unwrap(),
            std::fs::read(&out2.sft_train).unwrap()
        );
    }

    #[test]
    fn writes_rl_and_sft_parquet_that_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = ArithConfig {
            train: 20,
            val: 5,
            ..ArithConfig::default()
        };
        let out = arith_write(dir.path(), &cfg).unwrap();
        let rl = crate::read::read_table(&out.train).unwrap();
        assert_eq!(rl.rows.len(), 20);
        let r = &rl.rows[0];
        assert_eq!(r["data_source"], "openai/gsm8k");
        let content = r["prompt"][0]["content"].as_str().unwrap();
        assert!(
            content.ends_with(crate::gsm8k::GSM8K_INSTRUCTION),
            "{content}"
        );
        let gt = r["reward_model"]["ground_truth"].as_str().unwrap();
        assert!(r["extra_info"]["answer"]
            .as_str()
            .unwrap()
            .ends_with(&format!("#### {gt}")));
        let sft = crate::read::read_table(&out.sft_val).unwrap();
        assert_eq!(sft.rows.len(), 5);
        assert!(sft.rows[0]["answer"].as_str().unwrap().contains("#### "));
        assert!(sft.rows[0]["question"]
            .as_str()
            .unwrap()
            .contains("How many"));
    }

    fn tool_cfg() -> ArithConfig {
        ArithConfig {
            train: 300,
            val: 20,
            seed: 11,
            min_ops: 1,
            max_ops: 2,
            min_operand: 100,
            max_operand: 9999,
            sft_noise: 0.0,
            tool_rate: Some(0.3),
        }
    }

    /// Evaluates `a + b - c`.
    fn eval(expression: &str) -> i64 {
        let mut parts = expression.split(' ');
        let mut v: i64 = parts.next().unwrap().parse().unwrap();
        while let (Some(op), Some(n)) = (parts.next(), parts.next()) {
            let n: i64 = n.parse().unwrap();
            v = if op == "+" { v + n } else { v - n };
        }
        v
    }

    #[test]
    fn tool_call_text_is_hermes_json_with_python_separators() {
        assert_eq!(
            tool_call_text("4821 + 3977 - 12"),
            "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"4821 + 3977 - 12\"}}\n</tool_call>"
        );
    }

    #[test]
    fn tool_variant_problems_have_large_operands_and_a_matching_expression() {
        let cfg = tool_cfg();
        let (train, val) = arith_splits(&cfg).unwrap();
        for p in train.iter().chain(&val) {
            assert_eq!(solve(&p.question), p.result, "{p:?}");
            assert_eq!(eval(&p.expression), p.result, "{p:?}");
            let operands: Vec<i64> = p
                .expression
                .split(' ')
                .step_by(2)
                .map(|n| n.parse().unwrap())
                .collect();
            assert!((2..=3).contains(&operands.len()), "{p:?}");
            assert!(operands.iter().all(|n| (100..=9999).contains(n)), "{p:?}");
        }
        // The tool rate draws from its own stream: the problems are the task's without tools.
        let plain = ArithConfig {
            tool_rate: None,
            ..cfg.clone()
        };
        assert_eq!(arith_splits(&plain).unwrap(), (train, val));
    }

    #[test]
    fn tool_variant_writes_agent_rows_and_conversations_seeded() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = tool_cfg();
        let out = arith_write(dir.path(), &cfg).unwrap();
        let (train, val) = arith_splits(&cfg).unwrap();
        for (file, problems) in [(&out.train, &train), (&out.val, &val)] {
            let rl = crate::read::read_table(file).unwrap();
            assert_eq!(
                rl.columns.as_deref().unwrap()[..2],
                ["data_source".to_string(), "agent_name".to_string()]
            );
            for (row, p) in rl.rows.iter().zip(problems) {
                assert_eq!(row["data_source"], "openai/gsm8k");
                assert_eq!(row["agent_name"], TOOL_AGENT);
                assert_eq!(
                    row["prompt"][0]["content"],
                    format!("{} {TOOL_INSTRUCTION}", p.question)
                );
                assert_eq!(
                    row["reward_model"]["ground_truth"],
                    p.result.to_string().as_str()
                );
                assert_eq!(row["extra_info"]["answer"], p.answer.as_str());
            }
        }
        let sft = crate::read::read_table(&out.sft_train).unwrap();
        assert_eq!(sft.rows.len(), 300);
        let mut calls = 0;
        for (row, p) in sft.rows.iter().zip(&train) {
            assert_eq!(row["tools"], serde_json::json!([calculator_tool_schema()]));
            let m = row["messages"].as_array().unwrap();
            let user = format!("{} {TOOL_INSTRUCTION}", p.question);
            let n = p.result;
            let expected = if m.len() == 4 {
                calls += 1;
                let call = format!(
                    "<tool_call>\n{{\"name\": \"calculator\", \"arguments\": {{\"expression\": \"{}\"}}}}\n</tool_call>",
                    p.expression
                );
                serde_json::json!([
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": call},
                    {"role": "tool", "content": n.to_string()},
                    {"role": "assistant", "content": format!("#### {n}")},
                ])
            } else {
                serde_json::json!([
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": p.answer},
                ])
            };
            assert_eq!(row["messages"], expected);
        }
        assert_eq!(out.sft_tool_calls, Some(calls));
        assert!((60..=120).contains(&calls), "{calls} of 300 call the tool");
        // Seeded: the same files again.
        let dir2 = tempfile::tempdir().unwrap();
        let out2 = arith_write(dir2.path(), &cfg).unwrap();
        for (a, b) in [(&out.train, &out2.train), (&out.sft_train, &out2.sft_train)] {
            assert_eq!(std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
        }
        let bad = ArithConfig {
            tool_rate: Some(1.5),
            ..cfg
        };
        assert!(arith_splits(&bad)
            .unwrap_err()
            .to_string()
            .contains("tool_rate"));
    }
}
