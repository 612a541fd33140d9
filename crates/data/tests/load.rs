mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{ListArray, RecordBatch, StringArray, StructArray};
use arrow_buffer::OffsetBuffer;
use arrow_schema::{DataType, Field, Fields, Schema};
use serde_json::json;
use verl_data::gsm8k::{gsm8k_record_batch, read_raw};
use verl_data::{
    write_arrow_ipc, write_jsonl, write_parquet, DataConfig, DataError, Dataset, Message, Split,
};

fn cfg() -> DataConfig {
    DataConfig::default()
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp dir")
}

/// The first `n` rows of the raw GSM8K test split, as verl-format record batch.
fn gsm8k_batch(dir: &Path, n: usize) -> RecordBatch {
    let mut rows = read_raw(&dir.join("test.jsonl"), "test").unwrap();
    rows.truncate(n);
    gsm8k_record_batch(&rows).unwrap()
}

#[test]
fn loads_shared_gsm8k_parquet() {
    let Some(dir) = common::gsm8k_dir() else {
        return;
    };
    let train = Dataset::load(&[dir.join("train.parquet")], &cfg()).unwrap();
    let test = Dataset::load(&[dir.join("test.parquet")], &cfg()).unwrap();
    assert_eq!(train.len(), 7473);
    assert_eq!(test.len(), 1319);

    let s = &test[0];
    assert_eq!(s.data_source, "openai/gsm8k");
    assert_eq!(s.ability.as_deref(), Some("math"));
    assert_eq!(s.reward_model.style, "rule");
    assert_eq!(s.ground_truth_str(), "18");
    assert_eq!(s.prompt.len(), 1);
    assert_eq!(s.prompt[0].role, "user");
    assert!(s.prompt[0]
        .content
        .starts_with("Janet\u{2019}s ducks lay 16 eggs per day."));
    assert!(s.prompt[0]
        .content
        .ends_with(" Let's think step by step and output the final answer after \"####\"."));
    assert_eq!(s.extra_info["split"], "test");
    assert_eq!(s.extra_index(), Some(0));
    assert!(s.extra_info["answer"]
        .as_str()
        .unwrap()
        .ends_with("#### 18"));
    assert_eq!(s.raw["reward_model"]["ground_truth"], "18");
    assert_eq!(s.origin.row, 0);
    assert_eq!(test[1318].extra_index(), Some(1318));
    assert_eq!(train[7472].extra_info["split"], "train");
}

#[test]
fn concatenates_files_in_order() {
    let Some(dir) = common::gsm8k_dir() else {
        return;
    };
    let paths = [dir.join("test.parquet"), dir.join("train.parquet")];
    let ds = Dataset::load(&paths, &cfg()).unwrap();
    assert_eq!(ds.len(), 1319 + 7473);
    assert_eq!(ds.files(), &paths[..]);
    assert_eq!(ds[1318].extra_info["split"], "test");
    assert_eq!(ds[1319].extra_info["split"], "train");
    assert_eq!(ds[1319].extra_index(), Some(0));
    assert_eq!(ds[1319].path(), paths[1].as_path());
}

#[test]
fn jsonl_arrow_and_parquet_round_trips_agree() {
    let Some(dir) = common::gsm8k_dir() else {
        return;
    };
    let t = tmp();
    let batch = gsm8k_batch(&dir, 25);
    let pq = t.path().join("a.parquet");
    let ipc = t.path().join("a.arrow");
    let feather = t.path().join("a.feather");
    write_parquet(&pq, std::slice::from_ref(&batch)).unwrap();
    write_arrow_ipc(&ipc, std::slice::from_ref(&batch)).unwrap();
    write_arrow_ipc(&feather, std::slice::from_ref(&batch)).unwrap();
    let from_pq = Dataset::load(&[&pq], &cfg()).unwrap();
    let from_ipc = Dataset::load(&[&ipc], &cfg()).unwrap();
    let from_feather = Dataset::load(&[&feather], &cfg()).unwrap();

    let jsonl = t.path().join("a.jsonl");
    write_jsonl(&jsonl, from_pq.iter().map(|s| &s.raw)).unwrap();
    let from_jsonl = Dataset::load(&[&jsonl], &cfg()).unwrap();

    // The shared verl file holds the same first rows.
    let reference = Dataset::load(&[dir.join("test.parquet")], &cfg()).unwrap();
    assert_eq!(from_pq.len(), 25);
    for i in 0..25 {
        for other in [&from_ipc, &from_feather, &from_jsonl] {
            assert_eq!(other[i].prompt, from_pq[i].prompt, "row {i}");
            assert_eq!(other[i].reward_model, from_pq[i].reward_model, "row {i}");
            assert_eq!(other[i].extra_info, from_pq[i].extra_info, "row {i}");
            assert_eq!(other[i].raw, from_pq[i].raw, "row {i}");
        }
        assert_eq!(from_pq[i].raw, reference[i].raw, "row {i}");
    }
}

#[test]
fn mixed_formats_concatenate() {
    let Some(dir) = common::gsm8k_dir() else {
        return;
    };
    let t = tmp();
    let batch = gsm8k_batch(&dir, 10);
    let (a, b, c) = (
        t.path().join("a.parquet"),
        t.path().join("b.arrow"),
        t.path().join("c.jsonl"),
    );
    write_parquet(&a, std::slice::from_ref(&batch)).unwrap();
    write_arrow_ipc(&b, &[batch.slice(0, 3)]).unwrap();
    let first = Dataset::load(&[&a], &cfg()).unwrap();
    write_jsonl(&c, first.iter().take(2).map(|s| &s.raw)).unwrap();
    let ds = Dataset::load(&[&c, &a, &b], &cfg()).unwrap();
    assert_eq!(ds.len(), 2 + 10 + 3);
    assert_eq!(ds[2].raw, first[0].raw);
    assert_eq!(ds[12].raw, first[0].raw);
    assert_eq!(ds[14].extra_index(), Some(2));
    assert_eq!(ds[14].origin.row, 2);
    assert_eq!(ds[14].path(), b.as_path());
}

#[test]
fn plain_string_prompt_column_and_custom_prompt_key() {
    let t = tmp();
    let p = t.path().join("q.jsonl");
    std::fs::write(
        &p,
        "{\"question\": \"What is 2+2?\", \"data_source\": \"toy\", \"reward_model\": {\"style\": \"rule\", \"ground_truth\": 4}}\n\n\
         {\"question\": [{\"role\": \"system\", \"content\": \"be brief\"}, {\"role\": \"user\", \"content\": \"3+3?\"}], \"data_source\": \"toy\", \"reward_model\": {\"ground_truth\": [\"6\", \"six\"]}, \"extra_info\": null}\n",
    )
    .unwrap();
    let opts = DataConfig {
        prompt_key: "question".into(),
        ..cfg()
    };
    let ds = Dataset::load(&[&p], &opts).unwrap();
    assert_eq!(ds.len(), 2);
    assert_eq!(ds[0].prompt, vec![Message::new("user", "What is 2+2?")]);
    assert_eq!(ds[0].ground_truth_str(), "4");
    assert_eq!(ds[1].prompt.len(), 2);
    assert_eq!(ds[1].prompt[0], Message::new("system", "be brief"));
    assert_eq!(ds[1].reward_model.ground_truth, json!(["6", "six"]));
    assert_eq!(ds[1].extra_info, json!({}));
    assert_eq!(ds[1].origin.row, 1);
}

#[test]
fn reward_fn_key_names_the_column_that_routes_rewards() {
    let t = tmp();
    let p = t.path().join("rows.jsonl");
    std::fs::write(
        &p,
        r#"{"prompt": "a", "source": "lighteval/MATH", "data_source": "ignored", "reward_model": {"ground_truth": "1"}}"#,
    )
    .unwrap();
    let opts = DataConfig {
        reward_fn_key: "source".into(),
        ..cfg()
    };
    let ds = Dataset::load(&[&p], &opts).unwrap();
    assert_eq!(ds[0].data_source, "lighteval/MATH");
    // Without the column, the error names it.
    let opts = DataConfig {
        reward_fn_key: "task".into(),
        ..cfg()
    };
    let (_, s) = err_text(Dataset::load(&[&p], &opts));
    assert!(s.contains("`task`"), "{s}");
}

#[test]
fn rows_with_images_videos_or_audio_are_refused_by_name() {
    let t = tmp();
    let p = t.path().join("vl.jsonl");
    let text_only = r#"{"prompt": "a", "data_source": "x", "reward_model": {"ground_truth": "1"}, "images": [], "videos": null}"#;
    let with_image = r#"{"prompt": "b", "data_source": "x", "reward_model": {"ground_truth": "2"}, "images": [{"bytes": "AAAA"}]}"#;
    std::fs::write(&p, format!("{text_only}\n{with_image}\n")).unwrap();
    let (e, s) = err_text(Dataset::load(&[&p], &cfg()));
    assert!(
        matches!(e, DataError::MultimodalRow { row: 1, .. }),
        "{e:?}"
    );
    assert!(
        s.contains("vl.jsonl") && s.contains("`images`") && s.contains("data.image_key"),
        "{s}"
    );
    // The keys name the columns: a video column under another name is found too.
    let v = t.path().join("video.jsonl");
    std::fs::write(
        &v,
        r#"{"prompt": "c", "data_source": "x", "reward_model": {"ground_truth": "3"}, "clip": "v.mp4"}"#,
    )
    .unwrap();
    let opts = DataConfig {
        media_columns: vec![("data.video_key".into(), "clip".into())],
        ..cfg()
    };
    let (_, s) = err_text(Dataset::load(&[&v], &opts));
    assert!(s.contains("`clip`") && s.contains("data.video_key"), "{s}");
    // And audio under verl's default column name (data.audio_key).
    let a = t.path().join("audio.jsonl");
    std::fs::write(
        &a,
        r#"{"prompt": "d", "data_source": "x", "reward_model": {"ground_truth": "4"}, "audios": ["a.wav"]}"#,
    )
    .unwrap();
    let (_, s) = err_text(Dataset::load(&[&a], &cfg()));
    assert!(
        s.contains("`audios`") && s.contains("data.audio_key"),
        "{s}"
    );
    // Text-only rows load.
    std::fs::write(&p, format!("{text_only}\n")).unwrap();
    assert_eq!(Dataset::load(&[&p], &cfg()).unwrap().len(), 1);
}

#[test]
fn json_array_file_loads() {
    let t = tmp();
    let p = t.path().join("rows.json");
    std::fs::write(
        &p,
        r#" [{"prompt": "a", "data_source": "x", "reward_model": {"ground_truth": "1"}},
             {"prompt": "b", "data_source": "x", "reward_model": {"ground_truth": "2"}}]"#,
    )
    .unwrap();
    let ds = Dataset::load(&[&p], &cfg()).unwrap();
    assert_eq!(ds.len(), 2);
    assert_eq!(ds[1].prompt[0].content, "b");
}

// ---- errors ----

fn err_text(r: verl_data::Result<Dataset>) -> (DataError, String) {
    let e = r.unwrap_err();
    let s = e.to_string();
    (e, s)
}

#[test]
fn missing_file_names_path_and_os_error() {
    let p = PathBuf::from("/nonexistent/dir/train.parquet");
    let (e, s) = err_text(Dataset::load(&[&p], &cfg()));
    assert!(matches!(e, DataError::Io { .. }), "{e:?}");
    assert!(s.contains("/nonexistent/dir/train.parquet"), "{s}");
    assert!(s.contains("No such file"), "{s}");
}

#[test]
fn unknown_extension_is_named() {
    let t = tmp();
    let p = t.path().join("data.csv");
    std::fs::write(&p, "a,b\n").unwrap();
    let (e, s) = err_text(Dataset::load(&[&p], &cfg()));
    assert!(matches!(e, DataError::UnknownExtension { .. }), "{e:?}");
    assert!(
        s.contains("data.csv") && s.contains(".csv") && s.contains(".parquet"),
        "{s}"
    );
}

#[test]
fn no_files_is_an_error() {
    let empty: [&str; 0] = [];
    let (e, _) = err_text(Dataset::load(&empty, &cfg()));
    assert!(matches!(e, DataError::NoFiles), "{e:?}");
}

#[test]
fn corrupt_parquet_and_bad_json_are_reported_with_location() {
    let t = tmp();
    let p = t.path().join("broken.parquet");
    std::fs::write(&p, b"definitely not parquet").unwrap();
    let (e, s) = err_text(Dataset::load(&[&p], &cfg()));
    assert!(matches!(e, DataError::Parquet { .. }), "{e:?}");
    assert!(s.contains("broken.parquet"), "{s}");

    let j = t.path().join("broken.jsonl");
    std::fs::write(
        &j,
        "{\"prompt\": \"a\", \"data_source\": \"x\", \"reward_model\": {\"ground_truth\": \"1\"}}\n{oops\n",
    )
    .unwrap();
    let (e, s) = err_text(Dataset::load(&[&j], &cfg()));
    assert!(matches!(e, DataError::Json { line: 2, .. }), "{e:?}");
    assert!(s.contains("broken.jsonl") && s.contains("line 2"), "{s}");

    let k = t.path().join("scalar.jsonl");
    std::fs::write(&k, "[1, 2]\n").unwrap();
    let (e, _) = err_text(Dataset::load(&[&k], &cfg()));
    assert!(matches!(e, DataError::JsonNotObject { .. }), "{e:?}");
}

#[test]
fn missing_column_lists_columns_present() {
    let Some(dir) = common::gsm8k_dir() else {
        return;
    };
    let opts = DataConfig {
        prompt_key: "messages".into(),
        ..cfg()
    };
    let (e, s) = err_text(Dataset::load(&[dir.join("test.parquet")], &opts));
    assert!(
        matches!(e, DataError::MissingColumn { row: None, .. }),
        "{e:?}"
    );
    assert!(s.contains("test.parquet"), "{s}");
    assert!(s.contains("missing column `messages`"), "{s}");
    assert!(
        s.contains("[data_source, prompt, ability, reward_model, extra_info]"),
        "{s}"
    );
}

#[test]
fn missing_column_in_jsonl_names_the_row() {
    let t = tmp();
    let p = t.path().join("m.jsonl");
    std::fs::write(
        &p,
        "{\"prompt\": \"a\", \"data_source\": \"x\", \"reward_model\": {\"ground_truth\": \"1\"}}\n{\"prompt\": \"b\", \"data_source\": \"x\"}\n",
    )
    .unwrap();
    let (e, s) = err_text(Dataset::load(&[&p], &cfg()));
    assert!(
        matches!(e, DataError::MissingColumn { row: Some(1), .. }),
        "{e:?}"
    );
    assert!(
        s.contains("m.jsonl") && s.contains("row 1") && s.contains("`reward_model`"),
        "{s}"
    );
}

#[test]
fn prompt_as_list_of_strings_in_arrow_file_is_a_type_error() {
    let t = tmp();
    let p = t.path().join("bad.arrow");
    let item = Arc::new(Field::new("item", DataType::Utf8, true));
    let prompt = ListArray::new(
        item.clone(),
        OffsetBuffer::from_lengths([1, 2]),
        Arc::new(StringArray::from(vec!["hi", "a", "b"])),
        None,
    );
    let rm_fields = Fields::from(vec![Field::new("ground_truth", DataType::Utf8, true)]);
    let rm = StructArray::new(
        rm_fields.clone(),
        vec![Arc::new(StringArray::from(vec!["1", "2"]))],
        None,
    );
    let schema = Schema::new(vec![
        Field::new("prompt", DataType::List(item), true),
        Field::new("data_source", DataType::Utf8, true),
        Field::new("reward_model", DataType::Struct(rm_fields), true),
    ]);
    let batch = RecordBatch::try_new(
        Arc::new(schema),
        vec![
            Arc::new(prompt),
            Arc::new(StringArray::from(vec!["x", "x"])),
            Arc::new(rm),
        ],
    )
    .unwrap();
    write_arrow_ipc(&p, &[batch]).unwrap();
    let (e, s) = err_text(Dataset::load(&[&p], &cfg()));
    assert!(matches!(e, DataError::WrongType { row: 0, .. }), "{e:?}");
    assert!(
        s.contains("bad.arrow") && s.contains("row 0") && s.contains("column `prompt`"),
        "{s}"
    );
    assert!(
        s.contains("expected list<struct{role: string, content: string}>"),
        "{s}"
    );
    assert!(s.contains("found list<string>"), "{s}");
}

#[test]
fn empty_file_set_is_an_error() {
    let t = tmp();
    let p = t.path().join("empty.jsonl");
    std::fs::write(&p, "\n").unwrap();
    let (e, s) = err_text(Dataset::load(&[&p], &cfg()));
    assert!(matches!(e, DataError::EmptyDataset { .. }), "{e:?}");
    assert!(s.contains("empty.jsonl"), "{s}");
}

// ---- selection and filtering ----

/// Fake templated length: one token per whitespace-separated word, plus 5 template tokens.
fn fake_len(s: &verl_data::Sample) -> Result<usize, verl_data::BoxError> {
    Ok(s.prompt
        .iter()
        .map(|m| m.content.split_whitespace().count())
        .sum::<usize>()
        + 5)
}

#[test]
fn filtering_overlong_prompts_uses_the_length_fn() {
    let ds_samples = common::synthetic(70); // i % 7 + 1 words each
    let mut ds = Dataset::from_samples(ds_samples);
    let report = ds.filter_overlong(8, &fake_len).unwrap(); // keeps 1..=3 words
    assert_eq!(report.before, 70);
    assert_eq!(report.kept, 30);
    assert_eq!(report.removed, 40);
    assert_eq!(report.shortest_removed, Some(9));
    assert!(ds.iter().all(|s| fake_len(s).unwrap() <= 8));
    // Order of the kept rows is preserved.
    let idx: Vec<i64> = ds.iter().map(|s| s.extra_index().unwrap()).collect();
    assert!(idx.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn filtering_everything_away_says_how_many_and_why() {
    let mut ds = Dataset::from_samples(common::synthetic(10));
    let e = ds.filter_overlong(3, &fake_len).unwrap_err();
    let s = e.to_string();
    assert!(
        matches!(
            e,
            DataError::EmptyAfterFilter {
                total: 10,
                filtered: 10,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(s.contains("10 of 10"), "{s}");
    assert!(s.contains("max_prompt_length=3"), "{s}");
    assert!(s.contains("shortest has 6 tokens"), "{s}");
}

#[test]
fn failing_length_fn_names_the_sample() {
    let mut ds = Dataset::from_samples(common::synthetic(5));
    let e = ds
        .filter_overlong(100, &|s| {
            if s.extra_index() == Some(3) {
                Err("template exploded".into())
            } else {
                Ok(1)
            }
        })
        .unwrap_err();
    let s = e.to_string();
    assert!(
        matches!(e, DataError::PromptLength { index: 3, .. }),
        "{e:?}"
    );
    assert!(
        s.contains("sample 3") && s.contains("template exploded"),
        "{s}"
    );
}

#[test]
fn prepare_applies_max_samples_then_filter() {
    let t = tmp();
    let p = t.path().join("s.jsonl");
    write_jsonl(
        &p,
        common::synthetic(70)
            .iter()
            .map(|s| {
                json!({
                    "prompt": [{"role": "user", "content": s.prompt[0].content}],
                    "data_source": "synthetic",
                    "reward_model": {"style": "rule", "ground_truth": "0"},
                    "extra_info": s.extra_info,
                })
            })
            .collect::<Vec<_>>()
            .iter(),
    )
    .unwrap();

    let opts = DataConfig {
        filter_overlong_prompts: true,
        max_prompt_length: 8,
        train_max_samples: 14,
        val_max_samples: -1,
        shuffle: false,
        ..cfg()
    };
    let e = Dataset::prepare(&[&p], &opts, Split::Train, None).unwrap_err();
    assert!(matches!(e, DataError::MissingPromptLengthFn), "{e:?}");

    let (ds, report) = Dataset::prepare(&[&p], &opts, Split::Train, Some(&fake_len)).unwrap();
    let report = report.unwrap();
    assert_eq!((report.before, report.kept), (14, 6));
    assert_eq!(ds.len(), 6);
    let (val, _) = Dataset::prepare(&[&p], &opts, Split::Val, Some(&fake_len)).unwrap();
    assert_eq!(val.len(), 30);

    // Random selection: reproducible with a seed, different across seeds.
    let pick = |seed| {
        let o = DataConfig {
            filter_overlong_prompts: false,
            shuffle: true,
            seed: Some(seed),
            ..opts.clone()
        };
        let (ds, _) = Dataset::prepare(&[&p], &o, Split::Train, None).unwrap();
        ds.iter()
            .map(|s| s.extra_index().unwrap())
            .collect::<Vec<_>>()
    };
    let a = pick(1);
    assert_eq!(a.len(), 14);
    assert_eq!(a, pick(1));
    assert_ne!(a, pick(2));
    let mut d = a.clone();
    d.sort_unstable();
    d.dedup();
    assert_eq!(d.len(), 14);
}

/// Files as pandas/pyarrow write them: zstd parquet, lz4 feather v2 (pyarrow's default),
/// pandas `to_json(orient="records", lines=True)`.
#[test]
fn reads_what_pyarrow_and_pandas_write() {
    let Some(dir) = common::gsm8k_dir() else {
        return;
    };
    let t = tmp();
    let script = r#"
import sys, os
import pyarrow.parquet as pq, pyarrow.feather as feather
src, out = sys.argv[1], sys.argv[2]
t = pq.read_table(src).slice(0, 40)
pq.write_table(t, os.path.join(out, "z.parquet"), compression="zstd")
feather.write_feather(t, os.path.join(out, "f.feather"))
try:
    t.to_pandas().to_json(os.path.join(out, "p.jsonl"), orient="records", lines=True, force_ascii=False)
except ImportError:
    pass
"#;
    let run = std::process::Command::new(common::python3_with_pyarrow())
        .args(["-c", script])
        .arg(dir.join("test.parquet"))
        .arg(t.path())
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let reference = Dataset::load(&[dir.join("test.parquet")], &cfg()).unwrap();
    let mut files = vec![t.path().join("z.parquet"), t.path().join("f.feather")];
    if t.path().join("p.jsonl").exists() {
        files.push(t.path().join("p.jsonl"));
    }
    for f in files {
        let ds = Dataset::load(&[&f], &cfg()).unwrap();
        assert_eq!(ds.len(), 40, "{}", f.display());
        for i in 0..40 {
            assert_eq!(ds[i].raw, reference[i].raw, "{} row {i}", f.display());
        }
    }
}
