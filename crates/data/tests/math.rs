//! `math_preprocess` against files written by verl's own `math_dataset.py` (see
//! `fixtures/math/README.md` for how they were made), and its errors on bad raw data.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{ArrayRef, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use common::{assert_same_table, read_parquet};
use verl_data::{math_preprocess, DataError, Unboxed};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/math")
}

/// Our four files equal verl's: both tables (schema, feature metadata, every value) and both
/// example JSON files byte for byte.
fn assert_same_as_verl(raw: &Path) {
    let out = tempfile::tempdir().unwrap();
    let res = math_preprocess(raw, out.path()).unwrap();
    assert_eq!((res.train_rows, res.test_rows), (41, 38));
    let verl = fixtures().join("verl");
    assert_same_table(&res.train, &verl.join("train.parquet"));
    assert_same_table(&res.test, &verl.join("test.parquet"));
    for example in ["train_example.json", "test_example.json"] {
        assert_eq!(
            std::fs::read_to_string(out.path().join(example)).unwrap(),
            std::fs::read_to_string(verl.join(example)).unwrap(),
            "{example} differs"
        );
    }
}

#[test]
fn hub_layout_reproduces_verl_output_row_for_row() {
    assert_same_as_verl(&fixtures().join("raw"));
}

#[test]
fn jsonl_splits_reproduce_the_same_output() {
    assert_same_as_verl(&fixtures().join("raw-jsonl"));
}

#[test]
fn output_keeps_level_and_type_and_drops_problem_and_solution() {
    let out = tempfile::tempdir().unwrap();
    let res = math_preprocess(&fixtures().join("raw"), out.path()).unwrap();
    let batch = read_parquet(&res.train);
    let names: Vec<&str> = batch
        .schema_ref()
        .fields()
        .iter()
        .map(|f| f.name().as_str())
        .collect();
    assert_eq!(
        names,
        [
            "level",
            "type",
            "data_source",
            "prompt",
            "ability",
            "reward_model",
            "extra_info"
        ]
    );
}

#[test]
fn output_parquet_reads_back_in_pyarrow_like_verls() {
    let python = common::python3_with_pyarrow();
    let out = tempfile::tempdir().unwrap();
    let res = math_preprocess(&fixtures().join("raw"), out.path()).unwrap();
    let script = r#"
import sys, pyarrow.parquet as pq
ours, ref = pq.read_table(sys.argv[1]), pq.read_table(sys.argv[2])
assert ours.schema.equals(ref.schema, check_metadata=True), (ours.schema, ref.schema)
assert ours.to_pylist() == ref.to_pylist()
print(ours.num_rows)
"#;
    let run = std::process::Command::new(python)
        .args(["-c", script])
        .arg(&res.test)
        .arg(fixtures().join("verl/test.parquet"))
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "pyarrow check failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&run.stdout).trim(), "38");
}

const GOOD: &str =
    r#"{"problem": "p", "level": "Level 1", "solution": "$\\boxed{1}$", "type": "Algebra"}"#;

/// A raw folder with `train.jsonl` holding `train` (one JSON row per line) and a good test split.
fn jsonl_raw(train: &[&str]) -> tempfile::TempDir {
    let raw = tempfile::tempdir().unwrap();
    std::fs::write(raw.path().join("train.jsonl"), train.join("\n")).unwrap();
    std::fs::write(raw.path().join("test.jsonl"), GOOD).unwrap();
    raw
}

fn preprocess_err(raw: &Path) -> (DataError, String, tempfile::TempDir) {
    let out = tempfile::tempdir().unwrap();
    let e = math_preprocess(raw, out.path()).unwrap_err();
    let s = e.to_string();
    (e, s, out)
}

#[test]
fn a_missing_split_names_the_layouts_looked_for() {
    let raw = tempfile::tempdir().unwrap();
    let (e, s, _) = preprocess_err(raw.path());
    assert!(
        matches!(&e, DataError::MissingSplit { split, .. } if split == "train"),
        "{e:?}"
    );
    assert!(
        s.contains("data/train-*.parquet") && s.contains("train.jsonl"),
        "{s}"
    );

    std::fs::write(raw.path().join("train.jsonl"), GOOD).unwrap();
    let (e, _, _) = preprocess_err(raw.path());
    assert!(
        matches!(&e, DataError::MissingSplit { split, .. } if split == "test"),
        "{e:?}"
    );
}

#[test]
fn a_missing_raw_dir_is_an_io_error_naming_it() {
    let (e, s, _) = preprocess_err(Path::new("/nonexistent/math-raw"));
    assert!(matches!(e, DataError::Io { .. }), "{e:?}");
    assert!(s.contains("/nonexistent/math-raw"), "{s}");
}

#[test]
fn a_parquet_shard_without_a_column_names_file_and_column() {
    let raw = tempfile::tempdir().unwrap();
    std::fs::create_dir(raw.path().join("data")).unwrap();
    let schema = Arc::new(Schema::new(
        ["problem", "level", "solution"]
            .map(|c| Field::new(c, DataType::Utf8, true))
            .to_vec(),
    ));
    let columns: Vec<ArrayRef> = ["p", "Level 1", "\\boxed{1}"]
        .map(|v| Arc::new(StringArray::from(vec![v])) as ArrayRef)
        .to_vec();
    let shard = raw.path().join("data/train-00000-of-00001.parquet");
    verl_data::write_parquet(&shard, &[RecordBatch::try_new(schema, columns).unwrap()]).unwrap();
    let (e, s, _) = preprocess_err(raw.path());
    assert!(
        matches!(&e, DataError::MissingColumn { row: None, column, .. } if column == "type"),
        "{e:?}"
    );
    assert!(
        s.contains("train-00000-of-00001.parquet") && s.contains("missing column `type`"),
        "{s}"
    );
}

#[test]
fn an_unreadable_shard_names_the_file() {
    let raw = tempfile::tempdir().unwrap();
    std::fs::create_dir(raw.path().join("data")).unwrap();
    std::fs::write(
        raw.path().join("data/train-00000-of-00001.parquet"),
        b"not parquet",
    )
    .unwrap();
    let (e, s, _) = preprocess_err(raw.path());
    assert!(matches!(e, DataError::Parquet { .. }), "{e:?}");
    assert!(s.contains("train-00000-of-00001.parquet"), "{s}");
}

#[test]
fn a_jsonl_row_without_a_field_names_file_row_and_column() {
    let raw = jsonl_raw(&[
        GOOD,
        r#"{"problem": "p", "solution": "\\boxed{1}", "type": "x"}"#,
    ]);
    let (e, s, _) = preprocess_err(raw.path());
    assert!(
        matches!(&e, DataError::MissingColumn { row: Some(1), column, .. } if column == "level"),
        "{e:?}"
    );
    assert!(s.contains("train.jsonl") && s.contains("row 1"), "{s}");
}

#[test]
fn a_non_string_problem_or_level_is_a_type_error() {
    let raw =
        jsonl_raw(&[r#"{"problem": 3, "level": "L", "solution": "\\boxed{1}", "type": "x"}"#]);
    let (_, s, _) = preprocess_err(raw.path());
    assert!(
        s.contains("row 0, column `problem`: expected string, found number 3"),
        "{s}"
    );
    let raw =
        jsonl_raw(&[r#"{"problem": "p", "level": 5, "solution": "\\boxed{1}", "type": "x"}"#]);
    let (_, s, _) = preprocess_err(raw.path());
    assert!(
        s.contains("column `level`: expected string or null, found number 5"),
        "{s}"
    );
}

#[test]
fn a_solution_without_an_extractable_answer_is_refused_as_verl_would_fail() {
    let no_box = r#"{"problem": "p", "level": "L", "solution": "It is 5.", "type": "x"}"#;
    let raw = jsonl_raw(&[GOOD, GOOD, no_box]);
    let (e, s, out) = preprocess_err(raw.path());
    assert!(
        matches!(
            &e,
            DataError::NoBoxedAnswer {
                row: 2,
                reason: Unboxed::Missing,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        s.contains("train.jsonl")
            && s.contains("row 2, column `solution`")
            && s.contains("no `\\boxed` or `\\fbox`"),
        "{s}"
    );
    // Nothing is written when a split is bad.
    assert!(!out.path().join("train.parquet").exists());

    let fbox = r#"{"problem": "p", "level": "L", "solution": "$\\fbox{5}$", "type": "x"}"#;
    let (e, s, _) = preprocess_err(jsonl_raw(&[fbox]).path());
    assert!(
        matches!(
            &e,
            DataError::NoBoxedAnswer {
                reason: Unboxed::NotBoxedBrace { .. },
                ..
            }
        ),
        "{e:?}"
    );
    assert!(s.contains("`\\fbox{5}`") && s.contains("asserts"), "{s}");
}
