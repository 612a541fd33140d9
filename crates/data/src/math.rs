//! MATH (`DigitalLearningGmbH/MATH-lighteval`) raw → verl-format parquet, row for row what
//! verl's `examples/data_preprocess/math_dataset.py` writes (with `datasets` 4 or newer): the
//! raw columns its map function leaves alone (`level`, `type`) first, then data_source, prompt,
//! ability, reward_model and extra_info; plus the `{split}_example.json` it dumps.
//!
//! `datasets` drops the two columns the map function pops (`problem`, `solution`): they live on
//! only in the prompt and the ground truth.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray, StructArray};
use arrow_schema::{DataType, Field, Fields, Schema};
use serde_json::{json, Map, Value};

use crate::columns::{prompt_field, reward_field, rule_rewards, strings, user_prompts, utf8};
use crate::error::{DataError, Result, Unboxed};
use crate::py_json;
use crate::read::{read_table, Row};
use crate::write::write_parquet;

pub const MATH_DATA_SOURCE: &str = "DigitalLearningGmbH/MATH-lighteval";
/// Appended (after one space) to every problem.
pub const MATH_INSTRUCTION: &str =
    "Let's think step by step and output the final answer within \\boxed{}.";
/// The columns of every MATH-lighteval row (all strings), in the Hub files' order.
pub const MATH_COLUMNS: [&str; 4] = ["problem", "level", "solution", "type"];
/// The columns verl's map function pops: they do not reach the output.
const POPPED: [&str; 2] = ["problem", "solution"];

const BOXED_SPACE: &str = "\\boxed ";
const BOXED_BRACE: &str = "\\boxed{";

/// At most 60 characters of `s` on one line (line breaks shown as `\n`), with `...` when cut:
/// enough to find the spot in a solution, and the error stays one line.
fn snippet(s: &str) -> String {
    let (head, cut) = match s.char_indices().nth(60) {
        Some((end, _)) => (&s[..end], "..."),
        None => (s, ""),
    };
    format!("{}{cut}", head.replace('\n', "\\n").replace('\r', "\\r"))
}

/// verl's `last_boxed_only_string`: the last boxed expression, prefix included.
fn last_boxed(solution: &str) -> Result<&str, Unboxed> {
    // The space form wins over any brace form wherever both are: verl checks it first and
    // keeps everything after its last occurrence up to the next `$` (or the end).
    if let Some(pos) = solution.rfind(BOXED_SPACE) {
        let body = pos + BOXED_SPACE.len();
        let end = solution[body..]
            .find('$')
            .map_or(solution.len(), |i| body + i);
        return Ok(&solution[pos..end]);
    }
    let start = solution
        .rfind("\\boxed")
        .or_else(|| solution.rfind("\\fbox"))
        .ok_or(Unboxed::Missing)?;
    // Brace depth may go negative (a `}` before any `{`); only a return to zero closes, as in
    // verl. Bytes are safe: braces are ASCII and never part of a multi-byte character.
    let mut depth = 0i64;
    for (offset, byte) in solution.as_bytes()[start..].iter().enumerate() {
        match byte {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Ok(&solution[start..=start + offset]);
                }
            }
            _ => {}
        }
    }
    Err(Unboxed::Unclosed {
        from: snippet(&solution[start..]),
    })
}

/// The ground truth verl stores for a MATH solution: `remove_boxed(last_boxed_only_string(s))`,
/// i.e. the content of the last `\boxed{...}` (nested braces kept), or what follows the last
/// `\boxed ` up to the next `$` when that form occurs anywhere.
pub fn extract_boxed_answer(solution: &str) -> Result<&str, Unboxed> {
    let boxed = last_boxed(solution)?;
    if let Some(rest) = boxed.strip_prefix(BOXED_SPACE) {
        return Ok(rest);
    }
    boxed
        .strip_prefix(BOXED_BRACE)
        .and_then(|inner| inner.strip_suffix('}'))
        .ok_or_else(|| Unboxed::NotBoxedBrace {
            found: snippet(boxed),
        })
}

/// One converted row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MathRow {
    pub problem: String,
    pub ground_truth: String,
    /// The raw columns verl keeps, in [`MathSplit::kept_columns`] order (null stays null).
    pub kept: Vec<Option<String>>,
}

impl MathRow {
    pub fn prompt_content(&self) -> String {
        format!("{} {}", self.problem, MATH_INSTRUCTION)
    }
}

/// One split, rows in file order (their position is `extra_info.index`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MathSplit {
    pub split: String,
    /// Every raw column but `problem` and `solution`, in the order `datasets` keeps them:
    /// the schema's for parquet, first appearance for JSONL.
    pub kept_columns: Vec<String>,
    pub rows: Vec<MathRow>,
}

/// The raw files of `split` in `raw_dir`: the Hub layout `data/{split}-*.parquet` (sorted, as
/// `datasets` resolves the default config's `data/{split}-*`), else `{split}.jsonl`.
fn split_files(raw_dir: &Path, split: &str) -> Result<Vec<PathBuf>> {
    let io = |source| DataError::Io {
        path: raw_dir.to_path_buf(),
        source,
    };
    if !std::fs::metadata(raw_dir).map_err(io)?.is_dir() {
        return Err(io(std::io::Error::other(
            "expected a directory, found a file",
        )));
    }
    let data = raw_dir.join("data");
    let mut shards = Vec::new();
    match std::fs::read_dir(&data) {
        Ok(entries) => {
            let prefix = format!("{split}-");
            for entry in entries {
                let entry = entry.map_err(|source| DataError::Io {
                    path: data.clone(),
                    source,
                })?;
                let name = entry.file_name();
                let name = name.to_string_lossy();
                if name.starts_with(&prefix) && name.ends_with(".parquet") {
                    shards.push(entry.path());
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(DataError::Io { path: data, source }),
    }
    shards.sort();
    if !shards.is_empty() {
        return Ok(shards);
    }
    let jsonl = raw_dir.join(format!("{split}.jsonl"));
    if jsonl.is_file() {
        return Ok(vec![jsonl]);
    }
    Err(DataError::MissingSplit {
        dir: raw_dir.to_path_buf(),
        split: split.to_string(),
        expected: format!(
            "data/{split}-*.parquet (the Hub layout of {MATH_DATA_SOURCE}) or {split}.jsonl"
        ),
    })
}

/// Reads `split` of a raw MATH-lighteval copy (see [`math_preprocess`] for the layouts).
pub fn read_split(raw_dir: &Path, split: &str) -> Result<MathSplit> {
    let mut tables = Vec::new();
    let mut order: Vec<String> = Vec::new();
    let mut note = |name: &String| {
        if !order.contains(name) {
            order.push(name.clone());
        }
    };
    let files = split_files(raw_dir, split)?;
    for path in &files {
        let table = read_table(path)?;
        match &table.columns {
            // A schema without a column is one error for the file, not one per row.
            Some(columns) => {
                if let Some(missing) = MATH_COLUMNS
                    .iter()
                    .find(|c| !columns.iter().any(|n| n == *c))
                {
                    return Err(DataError::MissingColumn {
                        path: path.clone(),
                        row: None,
                        column: missing.to_string(),
                        present: columns.clone(),
                    });
                }
                columns.iter().for_each(&mut note);
            }
            None => table.rows.iter().flat_map(Row::keys).for_each(&mut note),
        }
        tables.push((path, table.rows));
    }
    let kept_columns: Vec<String> = order
        .into_iter()
        .filter(|c| !POPPED.contains(&c.as_str()))
        .collect();

    let mut rows = Vec::new();
    for (path, file_rows) in tables {
        for (row_index, row) in file_rows.into_iter().enumerate() {
            rows.push(convert_row(path, row_index, &row, &kept_columns)?);
        }
    }
    if rows.is_empty() {
        return Err(DataError::EmptyDataset { paths: files });
    }
    Ok(MathSplit {
        split: split.to_string(),
        kept_columns,
        rows,
    })
}

fn convert_row(
    path: &Path,
    row_index: usize,
    row: &Row,
    kept_columns: &[String],
) -> Result<MathRow> {
    let wrong = |column: &str, expected: &str, found: &Value| DataError::WrongType {
        path: path.to_path_buf(),
        row: row_index,
        column: column.to_string(),
        expected: expected.to_string(),
        found: crate::sample::describe(found),
    };
    if let Some(missing) = MATH_COLUMNS.iter().find(|c| !row.contains_key(**c)) {
        return Err(DataError::MissingColumn {
            path: path.to_path_buf(),
            row: Some(row_index),
            column: missing.to_string(),
            present: row.keys().cloned().collect(),
        });
    }
    // verl concatenates and searches these, so anything but a string stops it.
    let text = |column: &str| match &row[column] {
        Value::String(s) => Ok(s.clone()),
        other => Err(wrong(column, "string", other)),
    };
    let problem = text("problem")?;
    let solution = text("solution")?;
    let ground_truth = extract_boxed_answer(&solution)
        .map_err(|reason| DataError::NoBoxedAnswer {
            path: path.to_path_buf(),
            row: row_index,
            column: "solution".into(),
            reason,
        })?
        .to_string();
    // verl copies the other columns untouched; a missing JSONL key reads as null there too.
    let kept = kept_columns
        .iter()
        .map(|column| match row.get(column) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(wrong(column, "string or null", other)),
        })
        .collect::<Result<_>>()?;
    Ok(MathRow {
        problem,
        ground_truth,
        kept,
    })
}

fn extra_fields() -> Fields {
    Fields::from(vec![
        utf8("split"),
        Field::new("index", DataType::Int64, true),
    ])
}

/// The `datasets` feature description verl's files carry (`json.dumps` of it), so
/// `datasets.load_dataset` restores the same features from our files.
fn hf_features(kept_columns: &[String]) -> String {
    let value = json!({"dtype": "string", "_type": "Value"});
    let mut features: Map<String, Value> = kept_columns
        .iter()
        .map(|c| (c.clone(), value.clone()))
        .collect();
    features.insert("data_source".into(), value.clone());
    features.insert(
        "prompt".into(),
        json!({"feature": {"role": value, "content": value}, "_type": "List"}),
    );
    features.insert("ability".into(), value.clone());
    features.insert(
        "reward_model".into(),
        json!({"style": value, "ground_truth": value}),
    );
    features.insert(
        "extra_info".into(),
        json!({"split": value, "index": {"dtype": "int64", "_type": "Value"}}),
    );
    py_json::dumps(&json!({"info": {"features": features}}), None)
}

/// The Arrow schema of verl's MATH parquet for a split with these kept columns.
pub fn math_schema(kept_columns: &[String]) -> Schema {
    let mut fields: Vec<Field> = kept_columns.iter().map(|c| utf8(c)).collect();
    fields.extend([
        utf8("data_source"),
        prompt_field(),
        utf8("ability"),
        reward_field(),
        Field::new("extra_info", DataType::Struct(extra_fields()), true),
    ]);
    Schema::new(fields).with_metadata(HashMap::from([(
        "huggingface".to_string(),
        hf_features(kept_columns),
    )]))
}

/// Builds the record batch of `split` in verl's schema.
pub fn math_record_batch(split: &MathSplit) -> Result<RecordBatch> {
    let rows = &split.rows;
    let n = rows.len();
    let mut columns: Vec<ArrayRef> = (0..split.kept_columns.len())
        .map(|i| -> ArrayRef {
            Arc::new(StringArray::from_iter(
                rows.iter().map(|r| r.kept[i].as_deref()),
            ))
        })
        .collect();
    let extra = StructArray::new(
        extra_fields(),
        vec![
            strings(std::iter::repeat_n(split.split.as_str(), n)),
            Arc::new(Int64Array::from_iter_values(0..n as i64)),
        ],
        None,
    );
    columns.extend([
        strings(std::iter::repeat_n(MATH_DATA_SOURCE, n)),
        user_prompts(rows.iter().map(MathRow::prompt_content).collect()),
        strings(std::iter::repeat_n("math", n)),
        rule_rewards(rows.iter().map(|r| r.ground_truth.as_str())),
        Arc::new(extra),
    ]);
    RecordBatch::try_new(Arc::new(math_schema(&split.kept_columns)), columns).map_err(|source| {
        DataError::Arrow {
            path: PathBuf::from("<math record batch>"),
            source,
        }
    })
}

/// `json.dump(dataset[0], f, indent=2)`: verl's `{split}_example.json`.
fn example_json(split: &MathSplit) -> String {
    let row = &split.rows[0];
    let mut example: Map<String, Value> = split
        .kept_columns
        .iter()
        .zip(&row.kept)
        .map(|(c, v)| (c.clone(), v.as_deref().map_or(Value::Null, Value::from)))
        .collect();
    example.insert("data_source".into(), MATH_DATA_SOURCE.into());
    example.insert(
        "prompt".into(),
        json!([{"role": "user", "content": row.prompt_content()}]),
    );
    example.insert("ability".into(), "math".into());
    example.insert(
        "reward_model".into(),
        json!({"style": "rule", "ground_truth": row.ground_truth}),
    );
    example.insert(
        "extra_info".into(),
        json!({"split": split.split, "index": 0}),
    );
    py_json::dumps(&Value::Object(example), Some(2))
}

/// Files written by [`math_preprocess`] (each parquet has its `{split}_example.json` beside it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MathOutput {
    pub train: PathBuf,
    pub train_rows: usize,
    pub test: PathBuf,
    pub test_rows: usize,
}

/// Converts a raw copy of `DigitalLearningGmbH/MATH-lighteval` into `out_dir/{train,test}.parquet`
/// plus `out_dir/{train,test}_example.json` (created if needed), in verl's MATH format.
///
/// `raw_dir` is what `huggingface-cli download DigitalLearningGmbH/MATH-lighteval --repo-type
/// dataset` leaves (`data/train-*.parquet`, `data/test-*.parquet`; the per-subject folders are
/// other configs and are ignored, as `load_dataset` does), or a folder with `train.jsonl` and
/// `test.jsonl` holding the same fields.
pub fn math_preprocess(raw_dir: &Path, out_dir: &Path) -> Result<MathOutput> {
    // Both splits are read before anything is written, so a bad test row leaves no half output.
    let train = read_split(raw_dir, "train")?;
    let test = read_split(raw_dir, "test")?;
    std::fs::create_dir_all(out_dir).map_err(|source| DataError::Write {
        path: out_dir.to_path_buf(),
        source,
    })?;
    let write = |split: &MathSplit| -> Result<PathBuf> {
        let out = out_dir.join(format!("{}.parquet", split.split));
        write_parquet(&out, &[math_record_batch(split)?])?;
        let example = out_dir.join(format!("{}_example.json", split.split));
        std::fs::write(&example, example_json(split)).map_err(|source| DataError::Write {
            path: example,
            source,
        })?;
        Ok(out)
    };
    Ok(MathOutput {
        train: write(&train)?,
        train_rows: train.rows.len(),
        test: write(&test)?,
        test_rows: test.rows.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(s: &str) -> Result<&str, Unboxed> {
        extract_boxed_answer(s)
    }

    #[test]
    fn the_last_brace_box_wins_with_nested_braces_kept() {
        assert_eq!(
            answer("$\\boxed{1}$ then $\\boxed{\\frac{1}{2}}$"),
            Ok("\\frac{1}{2}")
        );
        assert_eq!(answer("\\boxed{\\boxed{3}}"), Ok("3"));
        assert_eq!(answer("\\boxed{}"), Ok(""));
        assert_eq!(answer("\\boxed{a}}"), Ok("a"));
        assert_eq!(answer("\\boxed{π²}"), Ok("π²"));
    }

    #[test]
    fn the_space_form_wins_anywhere_and_stops_at_a_dollar() {
        assert_eq!(answer("$\\boxed 5$."), Ok("5"));
        assert_eq!(answer("$\\boxed 3$ and $\\boxed{7}$"), Ok("3"));
        assert_eq!(answer("\\boxed 42 and\nmore"), Ok("42 and\nmore"));
        assert_eq!(answer("$\\boxed {7}$"), Ok("{7}"));
        assert_eq!(answer("$\\boxed  8$"), Ok(" 8"));
    }

    #[test]
    fn fbox_counts_only_without_any_boxed_and_then_fails_like_verl() {
        assert_eq!(answer("\\fbox{1} \\boxed{2}"), Ok("2"));
        assert_eq!(answer("\\boxed{2} \\fbox{1}"), Ok("2"));
        assert_eq!(
            answer("so $\\fbox{5}$"),
            Err(Unboxed::NotBoxedBrace {
                found: "\\fbox{5}".into()
            })
        );
    }

    #[test]
    fn solutions_verl_raises_on_are_refused_with_the_reason() {
        assert_eq!(answer("The answer is 5."), Err(Unboxed::Missing));
        assert_eq!(
            answer("$\\boxed{5$."),
            Err(Unboxed::Unclosed {
                from: "\\boxed{5$.".into()
            })
        );
        // A `}` before any `{` takes the depth below zero; it never returns to zero.
        assert!(matches!(
            answer("$\\boxed}{x}$"),
            Err(Unboxed::Unclosed { .. })
        ));
        assert!(matches!(
            answer("\\boxed\\frac{1}{2}"),
            Err(Unboxed::NotBoxedBrace { found }) if found == "\\boxed\\frac{1}"
        ));
        // `\boxeddot` is a later `\boxed` for rfind, and it has no braces.
        assert!(matches!(
            answer("\\boxed{3} \\boxeddot"),
            Err(Unboxed::Unclosed { .. })
        ));
    }

    #[test]
    fn reasons_quote_the_solution_on_one_line_and_cut_long_ones() {
        let Err(Unboxed::Unclosed { from }) = answer("\\boxed{x\ny") else {
            panic!("expected an unclosed box")
        };
        assert_eq!(from, "\\boxed{x\\ny");
        let long = format!("\\fbox{{{}}}", "é".repeat(100));
        let Err(Unboxed::NotBoxedBrace { found }) = answer(&long) else {
            panic!("expected an fbox")
        };
        assert_eq!(found.chars().count(), 63);
        assert!(found.ends_with("é..."), "{found}");
    }
}
