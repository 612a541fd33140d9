//! (prompt, response) pairs for supervised fine-tuning, read the way verl's `SFTDataset` does: a
//! top-level `prompt_key`/`response_key` column, optionally descended through
//! `prompt_dict_keys`/`response_dict_keys` when the column holds a struct (verl's GSM8K SFT example
//! reads `extra_info.question` / `extra_info.answer`).
//!
//! Multi-turn conversations too, as verl's `MultiTurnSFTDataset` reads them: a `messages` column of
//! chat messages per row, optionally a `tools` column (the tool schemas the chat template lists) and
//! an `enable_thinking` column (a template switch).

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{DataError, Result};
use crate::read::read_table;

/// Which columns hold the text (verl's `data.prompt_key`, `data.response_key`, ...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SftKeys {
    pub prompt_key: String,
    pub response_key: String,
    pub prompt_dict_keys: Vec<String>,
    pub response_dict_keys: Vec<String>,
}

impl Default for SftKeys {
    fn default() -> Self {
        SftKeys {
            prompt_key: "question".into(),
            response_key: "answer".into(),
            prompt_dict_keys: Vec::new(),
            response_dict_keys: Vec::new(),
        }
    }
}

/// One training pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SftPair {
    pub prompt: String,
    pub response: String,
}

fn text_at(
    path: &Path,
    row_no: usize,
    row: &serde_json::Map<String, Value>,
    key: &str,
    dict_keys: &[String],
    present: &[String],
) -> Result<String> {
    let mut v = row.get(key).ok_or_else(|| DataError::MissingColumn {
        path: path.to_path_buf(),
        row: None,
        column: key.to_string(),
        present: present.to_vec(),
    })?;
    let mut column = key.to_string();
    for k in dict_keys {
        column = format!("{column}.{k}");
        v = v.get(k).ok_or_else(|| DataError::WrongType {
            path: path.to_path_buf(),
            row: row_no,
            column: column.clone(),
            expected: format!("a struct with field `{k}`"),
            found: crate::sample::describe(v),
        })?;
    }
    match v {
        Value::String(s) => Ok(s.clone()),
        other => Err(DataError::WrongType {
            path: path.to_path_buf(),
            row: row_no,
            column,
            expected: "a string".into(),
            found: crate::sample::describe(other),
        }),
    }
}

/// Every pair of `paths`, in file then row order.
pub fn read_sft_pairs<P: AsRef<Path>>(paths: &[P], keys: &SftKeys) -> Result<Vec<SftPair>> {
    if paths.is_empty() {
        return Err(DataError::NoFiles);
    }
    let mut out = Vec::new();
    for p in paths {
        let path = p.as_ref();
        let table = read_table(path)?;
        let present: Vec<String> = table.columns.clone().unwrap_or_else(|| {
            table
                .rows
                .first()
                .map(|r| r.keys().cloned().collect())
                .unwrap_or_default()
        });
        for (i, row) in table.rows.iter().enumerate() {
            out.push(SftPair {
                prompt: text_at(
                    path,
                    i,
                    row,
                    &keys.prompt_key,
                    &keys.prompt_dict_keys,
                    &present,
                )?,
                response: text_at(
                    path,
                    i,
                    row,
                    &keys.response_key,
                    &keys.response_dict_keys,
                    &present,
                )?,
            });
        }
    }
    if out.is_empty() {
        return Err(DataError::EmptyDataset {
            paths: paths.iter().map(|p| PathBuf::from(p.as_ref())).collect(),
        });
    }
    Ok(out)
}

/// Which columns hold a conversation (verl's `data.multiturn.{messages_key,tools_key,
/// enable_thinking_key}`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MultiturnKeys {
    pub messages_key: String,
    pub tools_key: String,
    pub enable_thinking_key: String,
}

impl Default for MultiturnKeys {
    fn default() -> Self {
        MultiturnKeys {
            messages_key: "messages".into(),
            tools_key: "tools".into(),
            enable_thinking_key: "enable_thinking".into(),
        }
    }
}

/// One conversation to train on.
#[derive(Clone, Debug, PartialEq)]
pub struct SftConversation {
    /// Chat messages (objects with at least a string `role`), in order.
    pub messages: Vec<Value>,
    /// The row's tool schemas; `None` when the file has no tools column or the row's is null.
    pub tools: Option<Vec<Value>>,
    /// The row's `enable_thinking`; `None` when absent or null.
    pub enable_thinking: Option<bool>,
}

/// Every conversation of `paths`, in file then row order. The messages column is required; the
/// tools and enable_thinking columns are optional, as in verl.
pub fn read_sft_conversations<P: AsRef<Path>>(
    paths: &[P],
    keys: &MultiturnKeys,
) -> Result<Vec<SftConversation>> {
    if paths.is_empty() {
        return Err(DataError::NoFiles);
    }
    let mut out = Vec::new();
    for p in paths {
        let path = p.as_ref();
        let table = read_table(path)?;
        let present: Vec<String> = table.columns.clone().unwrap_or_else(|| {
            table
                .rows
                .first()
                .map(|r| r.keys().cloned().collect())
                .unwrap_or_default()
        });
        let wrong =
            |row: usize, column: &str, expected: &str, found: &Value| DataError::WrongType {
                path: path.to_path_buf(),
                row,
                column: column.to_string(),
                expected: expected.to_string(),
                found: crate::sample::describe(found),
            };
        for (i, row) in table.rows.iter().enumerate() {
            let messages = match row.get(&keys.messages_key) {
                None => {
                    return Err(DataError::MissingColumn {
                        path: path.to_path_buf(),
                        row: table.columns.is_none().then_some(i),
                        column: keys.messages_key.clone(),
                        present: present.clone(),
                    })
                }
                Some(Value::Array(m)) if !m.is_empty() => m.clone(),
                Some(other) => {
                    return Err(wrong(
                        i,
                        &keys.messages_key,
                        "a non-empty list of chat messages",
                        other,
                    ))
                }
            };
            for m in &messages {
                if !m.get("role").is_some_and(Value::is_string) {
                    return Err(wrong(
                        i,
                        &keys.messages_key,
                        "messages with a string `role`",
                        m,
                    ));
                }
            }
            let tools = match row.get(&keys.tools_key) {
                None | Some(Value::Null) => None,
                Some(Value::Array(t)) => Some(t.clone()),
                Some(other) => {
                    return Err(wrong(i, &keys.tools_key, "a list of tool schemas", other))
                }
            };
            let enable_thinking = match row.get(&keys.enable_thinking_key) {
                None | Some(Value::Null) => None,
                Some(Value::Bool(b)) => Some(*b),
                Some(other) => return Err(wrong(i, &keys.enable_thinking_key, "a boolean", other)),
            };
            out.push(SftConversation {
                messages,
                tools,
                enable_thinking,
            });
        }
    }
    if out.is_empty() {
        return Err(DataError::EmptyDataset {
            paths: paths.iter().map(|p| PathBuf::from(p.as_ref())).collect(),
        });
    }
    Ok(out)
}

/// Every string in every row of `paths` (nested values included), in file then row order: the
/// corpus a tokenizer for this data is trained on.
pub fn text_corpus<P: AsRef<Path>>(paths: &[P]) -> Result<Vec<String>> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::String(s) => out.push(s.clone()),
            Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            Value::Object(o) => o.values().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    if paths.is_empty() {
        return Err(DataError::NoFiles);
    }
    let mut out = Vec::new();
    for p in paths {
        for row in read_table(p.as_ref())?.rows {
            row.values().for_each(|v| walk(v, &mut out));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_flat_and_nested_keys_and_names_missing_ones() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.jsonl");
        std::fs::write(
            &p,
            "{\"q\": \"1+1?\", \"extra_info\": {\"answer\": \"#### 2\"}}\n",
        )
        .unwrap();
        let keys = SftKeys {
            prompt_key: "q".into(),
            response_key: "extra_info".into(),
            prompt_dict_keys: vec![],
            response_dict_keys: vec!["answer".into()],
        };
        let pairs = read_sft_pairs(&[&p], &keys).unwrap();
        assert_eq!(
            pairs,
            vec![SftPair {
                prompt: "1+1?".into(),
                response: "#### 2".into()
            }]
        );
        let e = read_sft_pairs(&[&p], &SftKeys::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("missing column `question`") && e.contains("d.jsonl"),
            "{e}"
        );
        let bad = SftKeys {
            response_dict_keys: vec!["solution".into()],
            ..keys
        };
        let e = read_sft_pairs(&[&p], &bad).unwrap_err().to_string();
        assert!(e.contains("extra_info.solution"), "{e}");
    }

    #[test]
    fn reads_conversations_with_optional_tools_and_names_bad_rows() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.jsonl");
        std::fs::write(
            &p,
            concat!(
                "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, ",
                "{\"role\": \"assistant\", \"content\": \"yo\"}], ",
                "\"tools\": [{\"type\": \"function\"}], \"enable_thinking\": false}\n",
                "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}], \"tools\": null}\n",
            ),
        )
        .unwrap();
        let c = read_sft_conversations(&[&p], &MultiturnKeys::default()).unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].messages[1]["content"], "yo");
        assert_eq!(
            c[0].tools,
            Some(vec![serde_json::json!({"type": "function"})])
        );
        assert_eq!(c[0].enable_thinking, Some(false));
        assert_eq!((c[1].tools.as_ref(), c[1].enable_thinking), (None, None));

        let keys = MultiturnKeys {
            messages_key: "conversation".into(),
            ..MultiturnKeys::default()
        };
        let e = read_sft_conversations(&[&p], &keys)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing column `conversation`"), "{e}");
        let bad = dir.path().join("bad.jsonl");
        std::fs::write(&bad, "{\"messages\": [{\"content\": \"no role\"}]}\n").unwrap();
        let e = read_sft_conversations(&[&bad], &MultiturnKeys::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad.jsonl") && e.contains("`role`"), "{e}");
    }
}
