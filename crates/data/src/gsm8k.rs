//! GSM8K raw → verl-format parquet, row for row what verl's
//! `examples/data_preprocess/gsm8k.py` writes (same columns, nesting, order and values).

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{Int64Array, RecordBatch, StructArray};
use arrow_schema::{DataType, Field, Fields, Schema};
use serde_json::Value;

use crate::columns::{prompt_field, reward_field, rule_rewards, strings, user_prompts, utf8};
use crate::error::{DataError, Result};
use crate::write::write_parquet;

pub const GSM8K_DATA_SOURCE: &str = "openai/gsm8k";
/// Appended (after one space) to every question.
pub const GSM8K_INSTRUCTION: &str =
    "Let's think step by step and output the final answer after \"####\".";

/// The `datasets` feature description verl's parquet files carry, so `datasets.load_dataset`
/// restores the same features from our files.
const HF_FEATURES: &str = r#"{"info": {"features": {"data_source": {"dtype": "string", "_type": "Value"}, "prompt": {"feature": {"role": {"dtype": "string", "_type": "Value"}, "content": {"dtype": "string", "_type": "Value"}}, "_type": "List"}, "ability": {"dtype": "string", "_type": "Value"}, "reward_model": {"style": {"dtype": "string", "_type": "Value"}, "ground_truth": {"dtype": "string", "_type": "Value"}}, "extra_info": {"split": {"dtype": "string", "_type": "Value"}, "index": {"dtype": "int64", "_type": "Value"}, "answer": {"dtype": "string", "_type": "Value"}, "question": {"dtype": "string", "_type": "Value"}}}}}"#;

/// The final answer after the first `#### `, commas removed, as verl's `extract_solution`
/// (regex `#### (\-?[0-9\.\,]+)`). `None` when there is none.
pub fn extract_solution(answer: &str) -> Option<String> {
    const MARK: &str = "#### ";
    let mut from = 0;
    while let Some(found) = answer[from..].find(MARK) {
        let start = from + found + MARK.len();
        let rest = &answer[start..];
        let sign = usize::from(rest.starts_with('-'));
        let body_len = rest[sign..]
            .bytes()
            .take_while(|b| b.is_ascii_digit() || *b == b'.' || *b == b',')
            .count();
        if body_len > 0 {
            return Some(rest[..sign + body_len].replace(',', ""));
        }
        from = start;
    }
    None
}

/// One converted row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gsm8kRow {
    pub split: String,
    pub index: i64,
    pub question: String,
    pub answer: String,
    pub solution: String,
}

impl Gsm8kRow {
    pub fn prompt_content(&self) -> String {
        format!("{} {}", self.question, GSM8K_INSTRUCTION)
    }
}

/// Reads a raw GSM8K JSONL file (`question`, `answer` per line) for `split`.
pub fn read_raw(path: &Path, split: &str) -> Result<Vec<Gsm8kRow>> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let reader = BufReader::new(File::open(path).map_err(io)?);
    let mut rows = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.map_err(io)?;
        if line.trim().is_empty() {
            continue;
        }
        let lineno = i + 1;
        let bad = |message: String| DataError::Preprocess {
            path: path.to_path_buf(),
            line: lineno,
            message,
        };
        let value: Value = serde_json::from_str(&line).map_err(|source| DataError::Json {
            path: path.to_path_buf(),
            line: lineno,
            source,
        })?;
        let field = |name: &str| match value.get(name) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(bad(format!(
                "field `{name}`: expected string, found {}",
                crate::sample::describe(other)
            ))),
            None => Err(bad(format!(
                "missing field `{name}` (GSM8K rows have question, answer)"
            ))),
        };
        let question = field("question")?;
        let answer = field("answer")?;
        let solution = extract_solution(&answer).ok_or_else(|| {
            bad("answer has no final `#### <number>` line (verl's extract_solution asserts)".into())
        })?;
        rows.push(Gsm8kRow {
            split: split.to_string(),
            index: rows.len() as i64,
            question,
            answer,
            solution,
        });
    }
    Ok(rows)
}

fn extra_fields() -> Fields {
    Fields::from(vec![
        utf8("split"),
        Field::new("index", DataType::Int64, true),
        utf8("answer"),
        utf8("question"),
    ])
}

/// The Arrow schema of verl's GSM8K parquet (column order and nested field names included).
pub fn gsm8k_schema() -> Schema {
    gsm8k_schema_with(false)
}

/// `gsm8k_schema`, with verl's per-row agent loop selector `agent_name` after `data_source` when
/// `agent` (the column verl's `gsm8k_tool_agent_loop.py` adds), in the fields and in the
/// `datasets` feature metadata.
fn gsm8k_schema_with(agent: bool) -> Schema {
    let mut fields = vec![
        utf8("data_source"),
        prompt_field(),
        utf8("ability"),
        reward_field(),
        Field::new("extra_info", DataType::Struct(extra_fields()), true),
    ];
    let mut features = HF_FEATURES.to_string();
    if agent {
        fields.insert(1, utf8("agent_name"));
        let v: Value = serde_json::from_str(HF_FEATURES).expect("valid feature metadata");
        let mut out = serde_json::Map::new();
        for (k, f) in v["info"]["features"].as_object().expect("features object") {
            out.insert(k.clone(), f.clone());
            if k == "data_source" {
                out.insert("agent_name".into(), f.clone());
            }
        }
        features = crate::py_json::dumps(&serde_json::json!({"info": {"features": out}}), None);
    }
    Schema::new(fields).with_metadata(HashMap::from([("huggingface".to_string(), features)]))
}

/// Builds the record batch of `rows` in verl's schema.
pub fn gsm8k_record_batch(rows: &[Gsm8kRow]) -> Result<RecordBatch> {
    gsm8k_record_batch_with(rows, GSM8K_INSTRUCTION, None)
}

/// [`gsm8k_record_batch`] with another instruction after each question (one space between), and
/// with an `agent_name` column (verl's per-row agent loop, e.g. `tool_agent`) when given.
pub fn gsm8k_record_batch_with(
    rows: &[Gsm8kRow],
    instruction: &str,
    agent_name: Option<&str>,
) -> Result<RecordBatch> {
    let n = rows.len();
    let extra = StructArray::new(
        extra_fields(),
        vec![
            strings(rows.iter().map(|r| r.split.as_str())),
            Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.index))),
            strings(rows.iter().map(|r| r.answer.as_str())),
            strings(rows.iter().map(|r| r.question.as_str())),
        ],
        None,
    );
    let mut columns = vec![
        strings(std::iter::repeat_n(GSM8K_DATA_SOURCE, n)),
        user_prompts(
            rows.iter()
                .map(|r| format!("{} {instruction}", r.question))
                .collect(),
        ),
        strings(std::iter::repeat_n("math", n)),
        rule_rewards(rows.iter().map(|r| r.solution.as_str())),
        Arc::new(extra),
    ];
    if let Some(agent) = agent_name {
        columns.insert(1, strings(std::iter::repeat_n(agent, n)));
    }
    RecordBatch::try_new(Arc::new(gsm8k_schema_with(agent_name.is_some())), columns).map_err(
        |source| DataError::Arrow {
            path: PathBuf::from("<gsm8k record batch>"),
            source,
        },
    )
}

/// Files written by [`gsm8k_preprocess`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gsm8kOutput {
    pub train: PathBuf,
    pub train_rows: usize,
    pub test: PathBuf,
    pub test_rows: usize,
}

/// Converts `raw_dir/{train,test}.jsonl` into `out_dir/{train,test}.parquet` (created if
/// needed) in verl's GSM8K format.
pub fn gsm8k_preprocess(raw_dir: &Path, out_dir: &Path) -> Result<Gsm8kOutput> {
    std::fs::create_dir_all(out_dir).map_err(|source| DataError::Write {
        path: out_dir.to_path_buf(),
        source,
    })?;
    let convert = |split: &str| -> Result<(PathBuf, usize)> {
        let rows = read_raw(&raw_dir.join(format!("{split}.jsonl")), split)?;
        let out = out_dir.join(format!("{split}.parquet"));
        write_parquet(&out, &[gsm8k_record_batch(&rows)?])?;
        Ok((out, rows.len()))
    };
    let (train, train_rows) = convert("train")?;
    let (test, test_rows) = convert("test")?;
    Ok(Gsm8kOutput {
        train,
        train_rows,
        test,
        test_rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extract_solution_follows_verl_regex() {
        assert_eq!(extract_solution("so\n#### 72").as_deref(), Some("72"));
        assert_eq!(
            extract_solution("#### 1,234.5 dollars").as_deref(),
            Some("1234.5")
        );
        assert_eq!(extract_solution("#### -3").as_deref(), Some("-3"));
        // First marker without a number is skipped, like re.search moving on.
        assert_eq!(extract_solution("#### x\n#### 5").as_deref(), Some("5"));
        assert_eq!(extract_solution("####5"), None);
        assert_eq!(extract_solution("#### -"), None);
        assert_eq!(extract_solution("no answer"), None);
    }

    #[test]
    fn agent_schema_adds_agent_name_after_data_source_in_fields_and_features() {
        let plain = gsm8k_schema();
        let agent = gsm8k_schema_with(true);
        let names = |s: &Schema| {
            s.fields()
                .iter()
                .map(|f| f.name().clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            names(&agent),
            [
                "data_source",
                "agent_name",
                "prompt",
                "ability",
                "reward_model",
                "extra_info"
            ]
        );
        assert_eq!(plain.metadata()["huggingface"], HF_FEATURES);
        let features: Value = serde_json::from_str(&agent.metadata()["huggingface"]).unwrap();
        let keys: Vec<&String> = features["info"]["features"]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(keys, names(&agent).iter().collect::<Vec<_>>());
        assert_eq!(
            features["info"]["features"]["agent_name"],
            serde_json::json!({"dtype": "string", "_type": "Value"})
        );
    }
}
