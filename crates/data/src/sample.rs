use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{DataError, Result};

/// One chat message of a prompt, as verl stores it (`{"role": ..., "content": ...}`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// verl's `reward_model` column: which scorer style and the reference answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RewardModel {
    pub style: String,
    /// Kept as JSON: datasets store strings (gsm8k), numbers or lists of accepted answers.
    pub ground_truth: Value,
}

impl RewardModel {
    /// The ground truth as text for rule rewards: strings as they are, `null` as "",
    /// numbers and lists in their JSON spelling (`18`, `2.5`, `["a","b"]`).
    pub fn ground_truth_str(&self) -> String {
        match &self.ground_truth {
            Value::String(s) => s.clone(),
            Value::Null => String::new(),
            other => other.to_string(),
        }
    }
}

/// Where a sample came from, so later errors (length function, truncation) can point at it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    pub path: Arc<PathBuf>,
    /// 0-based row within that file (for JSONL: the data line, blank lines not counted).
    pub row: usize,
}

/// One verl-format row.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub prompt: Vec<Message>,
    pub data_source: String,
    pub ability: Option<String>,
    pub reward_model: RewardModel,
    /// Free-form (split, index, question, answer, tools_kwargs...); `{}` when absent or null,
    /// as verl's dataset does.
    pub extra_info: Value,
    /// The whole row, every column, as a JSON object.
    pub raw: Value,
    pub origin: Origin,
}

impl Sample {
    pub fn ground_truth_str(&self) -> String {
        self.reward_model.ground_truth_str()
    }

    /// `extra_info.index` when the dataset provides one (verl passes it on as the sample index).
    pub fn extra_index(&self) -> Option<i64> {
        self.extra_info.get("index").and_then(Value::as_i64)
    }

    /// Builds a sample from one row (a JSON object of column name → value).
    /// `columns` lists the columns of the file (tabular formats) or of the row (JSONL), for
    /// the missing-column error.
    pub(crate) fn from_row(
        row: Map<String, Value>,
        prompt_key: &str,
        reward_fn_key: &str,
        path: &Arc<PathBuf>,
        row_index: usize,
    ) -> Result<Self> {
        let missing = |column: &str| DataError::MissingColumn {
            path: path.as_ref().clone(),
            row: Some(row_index),
            column: column.to_string(),
            present: row.keys().cloned().collect(),
        };
        let wrong = |column: &str, expected: &str, found: String| DataError::WrongType {
            path: path.as_ref().clone(),
            row: row_index,
            column: column.to_string(),
            expected: expected.to_string(),
            found,
        };

        let prompt_value = row.get(prompt_key).ok_or_else(|| missing(prompt_key))?;
        let prompt = parse_prompt(prompt_value)
            .map_err(|found| wrong(prompt_key, PROMPT_EXPECTED, found))?;

        let data_source = match row
            .get(reward_fn_key)
            .ok_or_else(|| missing(reward_fn_key))?
        {
            Value::String(s) => s.clone(),
            other => return Err(wrong(reward_fn_key, "string", describe(other))),
        };

        let ability = match row.get("ability") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => return Err(wrong("ability", "string or null", describe(other))),
        };

        let reward_model = match row
            .get("reward_model")
            .ok_or_else(|| missing("reward_model"))?
        {
            Value::Object(fields) => {
                let style = match fields.get("style") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => {
                        return Err(wrong(
                            "reward_model.style",
                            "string or null",
                            describe(other),
                        ))
                    }
                };
                let ground_truth = fields.get("ground_truth").cloned().ok_or_else(|| {
                    wrong(
                        "reward_model",
                        REWARD_EXPECTED,
                        format!(
                            "struct without `ground_truth` ({})",
                            describe_struct(fields)
                        ),
                    )
                })?;
                RewardModel {
                    style,
                    ground_truth,
                }
            }
            other => return Err(wrong("reward_model", REWARD_EXPECTED, describe(other))),
        };

        let extra_info = match row.get("extra_info") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(v @ Value::Object(_)) => v.clone(),
            Some(other) => return Err(wrong("extra_info", "struct or null", describe(other))),
        };

        Ok(Sample {
            prompt,
            data_source,
            ability,
            reward_model,
            extra_info,
            raw: Value::Object(row),
            origin: Origin {
                path: Arc::clone(path),
                row: row_index,
            },
        })
    }

    pub fn path(&self) -> &Path {
        self.origin.path.as_path()
    }
}

const PROMPT_EXPECTED: &str = "list<struct{role: string, content: string}> or a plain string";
const REWARD_EXPECTED: &str = "struct{style: string, ground_truth}";

/// `Err` carries a description of what was found, for the caller to wrap with file/row/column.
fn parse_prompt(value: &Value) -> std::result::Result<Vec<Message>, String> {
    match value {
        // A bare string column is a single-turn prompt from the user.
        Value::String(s) => Ok(vec![Message::new("user", s.clone())]),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let Value::Object(fields) = item else {
                    return Err(format!(
                        "{} (element {i} is {})",
                        describe(value),
                        describe(item)
                    ));
                };
                let field = |name: &str| match fields.get(name) {
                    Some(Value::String(s)) => Ok(s.clone()),
                    Some(other) => Err(format!(
                        "element {i} field `{name}` of type {}",
                        describe(other)
                    )),
                    None => Err(format!(
                        "element {i} without field `{name}` ({})",
                        describe_struct(fields)
                    )),
                };
                Ok(Message {
                    role: field("role")?,
                    content: field("content")?,
                })
            })
            .collect(),
        other => Err(describe(other)),
    }
}

/// A short type-and-value description of a JSON value for error messages,
/// e.g. `list<string> ["hi", ...]` or `struct{role, text}`.
pub(crate) fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("bool {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) => format!("string {}", short(s)),
        Value::Array(items) => match items.first() {
            None => "empty list".into(),
            Some(first) => format!("list<{}>", type_name(first)),
        },
        Value::Object(fields) => describe_struct(fields),
    }
}

fn describe_struct(fields: &Map<String, Value>) -> String {
    let inner: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("{k}: {}", type_name(v)))
        .collect();
    format!("struct{{{}}}", inner.join(", "))
}

fn type_name(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(_) => "bool".into(),
        Value::Number(_) => "number".into(),
        Value::String(_) => "string".into(),
        Value::Array(items) => match items.first() {
            None => "list".into(),
            Some(first) => format!("list<{}>", type_name(first)),
        },
        Value::Object(fields) => describe_struct(fields),
    }
}

fn short(s: &str) -> String {
    const MAX: usize = 40;
    if s.chars().count() <= MAX {
        format!("{s:?}")
    } else {
        let head: String = s.chars().take(MAX).collect();
        format!("{head:?}...")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn row(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    fn path() -> Arc<PathBuf> {
        Arc::new(PathBuf::from("mem.jsonl"))
    }

    #[test]
    fn string_prompt_becomes_one_user_message() {
        let s = Sample::from_row(
            row(json!({"prompt": "hi", "data_source": "d", "reward_model": {"ground_truth": 3}})),
            "prompt",
            "data_source",
            &path(),
            0,
        )
        .unwrap();
        assert_eq!(s.prompt, vec![Message::new("user", "hi")]);
        assert_eq!(s.ground_truth_str(), "3");
        assert_eq!(s.reward_model.style, "");
        assert_eq!(s.extra_info, json!({}));
    }

    #[test]
    fn ground_truth_spellings() {
        let gt = |v: Value| {
            RewardModel {
                style: "rule".into(),
                ground_truth: v,
            }
            .ground_truth_str()
        };
        assert_eq!(gt(json!("72")), "72");
        assert_eq!(gt(json!(2.5)), "2.5");
        assert_eq!(gt(json!(["a", "b"])), r#"["a","b"]"#);
        assert_eq!(gt(Value::Null), "");
    }

    #[test]
    fn list_of_strings_prompt_is_rejected_with_what_was_found() {
        let err = Sample::from_row(
            row(json!({"prompt": ["hello"], "data_source": "d", "reward_model": {"ground_truth": "1"}})),
            "prompt",
            "data_source",
            &path(),
            7,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("mem.jsonl"), "{err}");
        assert!(err.contains("row 7"), "{err}");
        assert!(err.contains("column `prompt`"), "{err}");
        assert!(
            err.contains("list<struct{role: string, content: string}>"),
            "{err}"
        );
        assert!(err.contains("list<string>"), "{err}");
    }

    #[test]
    fn message_without_content_is_rejected() {
        let err = Sample::from_row(
            row(json!({"q": [{"role": "user", "text": "x"}], "data_source": "d", "reward_model": {"ground_truth": "1"}})),
            "q",
            "data_source",
            &path(),
            0,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("without field `content`"), "{err}");
        assert!(err.contains("column `q`"), "{err}");
    }

    #[test]
    fn missing_column_lists_present_ones() {
        let err = Sample::from_row(
            row(json!({"question": "x", "data_source": "d"})),
            "prompt",
            "data_source",
            &path(),
            2,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("missing column `prompt`"), "{err}");
        // Columns are listed in the order the row has them.
        assert!(err.contains("question, data_source"), "{err}");
    }
}
