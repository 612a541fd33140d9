#![allow(dead_code)]

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_select::concat::concat_batches;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use verl_data::{Message, Origin, RewardModel, Sample};

/// The shared reference data, one helper for every crate's tests (std only, included by path):
/// skipped when absent, a failure under `VERL_REQUIRE_SHARED=1` (CI).
#[path = "../../../../crates/test-support/src/shared.rs"]
mod shared;

/// `$VERL_SHARED_DIR`, else `<workspace>/../shared`, `data/gsm8k`; `None` (after saying so) when
/// absent, or a panic under `VERL_REQUIRE_SHARED=1`.
pub fn gsm8k_dir() -> Option<PathBuf> {
    shared::shared_path("data/gsm8k")
}

pub fn read_parquet(path: &Path) -> RecordBatch {
    let builder = ParquetRecordBatchReaderBuilder::try_new(File::open(path).unwrap()).unwrap();
    let schema = builder.schema().clone();
    let batches: Vec<RecordBatch> = builder.build().unwrap().map(|b| b.unwrap()).collect();
    concat_batches(&schema, &batches).unwrap()
}

/// Compares our file with verl's: same columns in the same order, same nested types and
/// field names, same values row by row, same `datasets` feature metadata.
pub fn assert_same_table(ours: &Path, verl: &Path) {
    let (a, b) = (read_parquet(ours), read_parquet(verl));
    let (sa, sb) = (a.schema(), b.schema());
    assert_eq!(sa.fields(), sb.fields(), "schema differs");
    assert_eq!(
        sa.metadata().get("huggingface"),
        sb.metadata().get("huggingface"),
        "datasets feature metadata differs"
    );
    assert_eq!(a.num_rows(), b.num_rows());
    for (i, field) in sa.fields().iter().enumerate() {
        let (ca, cb) = (a.column(i), b.column(i));
        if ca != cb {
            // Point at the first differing row for a readable failure.
            let ra = verl_data::array_to_json(ca.as_ref()).unwrap();
            let rb = verl_data::array_to_json(cb.as_ref()).unwrap();
            let row = ra.iter().zip(&rb).position(|(x, y)| x != y);
            panic!(
                "column `{}` differs at row {row:?}: ours {:?} verl {:?}",
                field.name(),
                row.map(|r| &ra[r]),
                row.map(|r| &rb[r])
            );
        }
    }
}

/// `n` synthetic samples whose prompt content is `"q{i}"` repeated `i % 7 + 1` times.
pub fn synthetic(n: usize) -> Vec<Sample> {
    let path = Arc::new(PathBuf::from("synthetic"));
    (0..n)
        .map(|i| Sample {
            prompt: vec![Message::new("user", format!("q{i} ").repeat(i % 7 + 1))],
            data_source: "synthetic".into(),
            ability: None,
            reward_model: RewardModel {
                style: "rule".into(),
                ground_truth: serde_json::json!(i.to_string()),
            },
            extra_info: serde_json::json!({ "index": i }),
            raw: serde_json::json!({ "index": i }),
            origin: Origin {
                path: Arc::clone(&path),
                row: i,
            },
        })
        .collect()
}

/// `python3` (the venv's, on PATH under `make test`), which must import pyarrow: `scripts/setup.sh`
/// installs it, so its absence is a broken set-up, not a reason to skip.
pub fn python3_with_pyarrow() -> &'static str {
    let out = std::process::Command::new("python3")
        .args(["-c", "import pyarrow"])
        .output()
        .unwrap_or_else(|e| panic!("python3 cannot be run: {e} (source scripts/env.sh)"));
    assert!(
        out.status.success(),
        "python3 cannot import pyarrow (run scripts/setup.sh and source scripts/env.sh): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    "python3"
}
