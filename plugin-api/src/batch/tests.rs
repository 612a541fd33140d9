#[test]
fn rows_are_selected_concatenated_and_moved_as_bytes_unchanged() {
    let mut b = Batch::new();
    b.insert_tensor("ids", &[3, 2], &[1i64, 2, 3, 4, 5, 6]);
    b.insert_tensor("lp", &[3], &[0.5f32, 1.5, 2.5]);
    b.insert_strings("text", &["a", "b", "c"]);
    b.insert_json(
        "extra",
        &[
            serde_json::json!({"i": 0}),
            serde_json::Value::Null,
            serde_json::json!(2),
        ],
    );
    let picked = b.select_rows(&[2, 0, 2]);
    assert_eq!(picked.rows(), 3);
    assert_eq!(
        picked.tensor::<i64>("ids").unwrap().data,
        vec![5, 6, 1, 2, 5, 6]
    );
    assert_eq!(
        picked.tensor::<f32>("lp").unwrap().data,
        vec![2.5, 0.5, 2.5]
    );
    assert_eq!(picked.strings("text").unwrap(), vec!["c", "a", "c"]);
    assert_eq!(
        picked.json("extra").unwrap()[1],
        serde_json::json!({"i": 0})
    );
    let both = Batch::concat(&[b.select_rows(&[0]), b.select_rows(&[1, 2])]).unwrap();
    assert_eq!(both, b);
    let moved = Batch::from_bytes(&b.to_bytes()).unwrap();
    assert_eq!(moved, b);
    assert!(Batch::from_bytes(&b.to_bytes()[..10]).is_err());
    let mut other = Batch::new();
    other.insert_tensor("ids", &[1, 3], &[1i64, 2, 3]);
    assert!(Batch::concat(&[b.clone(), other]).is_err());
}

use super::*;

const SPECS: &[ColumnSpec] = &[
    ColumnSpec::tensor(
        "responses",
        DType::I64,
        &[ROWS, Dim::Named("response_length")],
    ),
    ColumnSpec::tensor(
        "response_mask",
        DType::I64,
        &[ROWS, Dim::Named("response_length")],
    ),
    ColumnSpec::tensor("scores", DType::F32, &[ROWS]).optional(),
];

fn good() -> Batch {
    let mut b = Batch::new();
    b.insert_tensor("responses", &[2, 3], &[1i64, 2, 3, 4, 5, 6]);
    b.insert_tensor("response_mask", &[2, 3], &[1i64, 1, 0, 1, 1, 1]);
    b.insert_strings("data_source", &["a", "b"]);
    b
}

#[test]
fn round_trips_typed_columns() {
    let b = good();
    let t = b.tensor::<i64>("responses").unwrap();
    assert_eq!(t.shape, vec![2, 3]);
    assert_eq!(t.row(1), &[4, 5, 6]);
    assert_eq!(b.strings("data_source").unwrap(), vec!["a", "b"]);
    b.check("test", SPECS, &[]).unwrap();
}

#[test]
fn shape_mismatch_names_column_expected_and_found() {
    let mut b = good();
    b.insert_tensor("response_mask", &[2, 2], &[1i64, 1, 1, 1]);
    let e = b.check("fsdp.Actor.generate", SPECS, &[]).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("fsdp.Actor.generate"), "{msg}");
    assert!(msg.contains("`response_mask`"), "{msg}");
    assert!(msg.contains("[2, 2]"), "{msg}");
    assert!(msg.contains("response_length=3"), "{msg}");
    assert!(msg.contains("fixed by column `responses`"), "{msg}");
}

#[test]
fn dtype_mismatch_is_reported() {
    let mut b = good();
    b.insert_tensor("scores", &[2], &[1.0f64, 2.0]);
    let msg = b
        .check("rewards.score", SPECS, &[])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("`scores` has dtype f64, expected f32"),
        "{msg}"
    );
}

#[test]
fn row_count_must_agree() {
    let mut b = good();
    b.insert_strings("data_source", &["a"]);
    let msg = b.validate("x").unwrap_err().to_string();
    assert!(
        msg.contains("`data_source`") && msg.contains("share the row count"),
        "{msg}"
    );
}

#[test]
fn missing_required_column_lists_present_ones() {
    let mut b = good();
    b.remove("responses");
    let msg = b.check("x", SPECS, &[]).unwrap_err().to_string();
    assert!(msg.contains("`responses` is missing"), "{msg}");
    assert!(msg.contains("response_mask, data_source"), "{msg}");
}

#[test]
fn corrupt_byte_count_is_caught() {
    let mut b = good();
    b.columns[0].bytes.pop();
    let msg = b.validate("x").unwrap_err().to_string();
    assert!(msg.contains("`responses` holds 47 bytes"), "{msg}");
}

#[test]
fn invalid_json_row_is_caught() {
    let mut b = good();
    b.insert_json(
        "extra_info",
        &[serde_json::json!({"a": 1}), serde_json::json!(null)],
    );
    b.validate("x").unwrap();
    b.columns[3].strings[1] = "{not json".into();
    let msg = b.validate("x").unwrap_err().to_string();
    assert!(msg.contains("row 1 of JSON column `extra_info`"), "{msg}");
}

#[test]
fn pre_bound_rows_are_enforced() {
    let b = good();
    let msg = b.check("x", SPECS, &[("rows", 4)]).unwrap_err().to_string();
    assert!(msg.contains("rows=4"), "{msg}");
}
