mod common;

use common::assert_same_table;
use verl_data::{gsm8k_preprocess, DataError};

#[test]
fn preprocess_reproduces_verl_parquet_row_for_row() {
    let Some(dir) = common::gsm8k_dir() else {
        return;
    };
    let out = tempfile::tempdir().unwrap();
    let res = gsm8k_preprocess(&dir, out.path()).unwrap();
    assert_eq!(res.test_rows, 1319);
    assert_eq!(res.train_rows, 7473);
    assert_same_table(&res.test, &dir.join("test.parquet"));
    assert_same_table(&res.train, &dir.join("train.parquet"));
}

#[test]
fn preprocessed_parquet_is_readable_by_pyarrow() {
    let Some(dir) = common::gsm8k_dir() else {
        return;
    };
    let python = common::python3_with_pyarrow();
    let out = tempfile::tempdir().unwrap();
    let res = gsm8k_preprocess(&dir, out.path()).unwrap();
    let script = r#"
import sys, pyarrow.parquet as pq
ours, ref = pq.read_table(sys.argv[1]), pq.read_table(sys.argv[2])
assert ours.schema.equals(ref.schema, check_metadata=False), (ours.schema, ref.schema)
assert ours.to_pylist() == ref.to_pylist()
print(ours.num_rows)
"#;
    let run = std::process::Command::new(python)
        .args(["-c", script])
        .arg(&res.test)
        .arg(dir.join("test.parquet"))
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "pyarrow check failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&run.stdout).trim(), "1319");
}

#[test]
fn preprocess_errors_name_file_and_line() {
    let raw = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let e = gsm8k_preprocess(raw.path(), out.path()).unwrap_err();
    assert!(matches!(e, DataError::Io { .. }), "{e:?}");
    assert!(e.to_string().contains("train.jsonl"), "{e}");

    std::fs::write(
        raw.path().join("train.jsonl"),
        "{\"question\": \"q\", \"answer\": \"a\\n#### 1\"}\n{\"question\": \"q\", \"answer\": \"no final line\"}\n",
    )
    .unwrap();
    let e = gsm8k_preprocess(raw.path(), out.path()).unwrap_err();
    let s = e.to_string();
    assert!(matches!(e, DataError::Preprocess { line: 2, .. }), "{e:?}");
    assert!(
        s.contains("train.jsonl") && s.contains("line 2") && s.contains("####"),
        "{s}"
    );

    std::fs::write(
        raw.path().join("train.jsonl"),
        "{\"question\": 3, \"answer\": \"#### 1\"}\n",
    )
    .unwrap();
    let s = gsm8k_preprocess(raw.path(), out.path())
        .unwrap_err()
        .to_string();
    assert!(
        s.contains("field `question`: expected string, found number 3"),
        "{s}"
    );
}
