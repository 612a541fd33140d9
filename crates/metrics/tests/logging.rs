//! Sinks: backend selection, JSONL lines, native TensorBoard files (checked by our reader, and by TensorBoard's
//! own when a Python with `tensorboard` is at hand), and plots of a logged run.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use verl_metrics::tfevents::{self, read_events, EventWriter, FILE_VERSION};
use verl_metrics::{
    plot_run, ConsoleSink, LoggerOptions, MetricsError, MetricsLogger, RunHistory, Sink,
    TensorboardSink, ValGeneration,
};

fn metrics(step: u64) -> Vec<(String, f64)> {
    let s = step as f64;
    vec![
        ("critic/score/mean".into(), 0.1 * s),
        ("actor/pg_loss".into(), -0.01 * s),
        ("actor/entropy".into(), 1.0 / (s + 1.0)),
        ("response_length/mean".into(), 100.0 + s),
        ("timing_s/step".into(), 2.5),
    ]
}

fn options(dir: &Path, backends: &[&str]) -> LoggerOptions {
    let backends: Vec<String> = backends.iter().map(|s| s.to_string()).collect();
    let mut o = LoggerOptions::from_verl("proj", "exp", &backends);
    o.jsonl_path = dir.join("proj/exp.jsonl");
    o.tensorboard_dir = dir.join("tb");
    o
}

#[test]
fn verl_default_paths_come_from_project_and_experiment() {
    let o = LoggerOptions::from_verl("p", "e", &["console".to_string()]);
    if std::env::var_os("VERL_FILE_LOGGER_PATH").is_none()
        && std::env::var_os("VERL_FILE_LOGGER_ROOT").is_none()
    {
        assert_eq!(o.jsonl_path, Path::new("./p/e.jsonl"));
    }
    if std::env::var_os("TENSORBOARD_DIR").is_none() {
        assert_eq!(o.tensorboard_dir, Path::new("tensorboard_log/p/e"));
    }
}

#[test]
fn backends_are_selected_by_verl_names_once_each_and_unknown_ones_are_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let logger = MetricsLogger::new(&options(
        tmp.path(),
        &["console", "jsonl", "file", "tensorboard", "console"],
    ))
    .unwrap();
    assert_eq!(logger.sink_names(), ["console", "file", "tensorboard"]);
    assert!(logger.warnings().is_empty());

    let err = MetricsLogger::new(&options(tmp.path(), &["tensorbord"])).unwrap_err();
    assert!(matches!(err, MetricsError::UnknownBackend { .. }));
    assert!(
        err.to_string().contains("`tensorbord`") && err.to_string().contains("tensorboard"),
        "{err}"
    );
}

#[test]
fn jsonl_sink_writes_one_flushed_line_per_step_and_appends_on_reopen() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = options(tmp.path(), &["file"]);
    let mut logger = MetricsLogger::new(&opts).unwrap();
    logger.log(1, &metrics(1)).unwrap();
    // Flushed before log returns: readable while the logger is still open.
    let text = fs::read_to_string(&opts.jsonl_path).unwrap();
    assert_eq!(text.lines().count(), 1);
    let v: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(v["step"], 1);
    assert_eq!(v["data"]["response_length/mean"], 101.0);
    logger.log(2, &[("x".into(), f64::NAN)]).unwrap();
    logger.finish().unwrap();
    drop(logger);

    let mut resumed = MetricsLogger::new(&opts).unwrap();
    resumed.log(3, &metrics(3)).unwrap();
    let text = fs::read_to_string(&opts.jsonl_path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[1], r#"{"step":2,"data":{"x":null}}"#);
}

#[test]
fn console_table_prints_key_metrics_aligned_and_full_mode_prints_everything() {
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let mut table = ConsoleSink::table(Box::new(buf.clone()));
    for step in 1..=3 {
        table.log(step, &metrics(step)).unwrap();
    }
    let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert!(
        lines.iter().all(|l| l.len() == lines[0].len()),
        "aligned columns:\n{text}"
    );
    assert_eq!(
        lines[2].split_whitespace().collect::<Vec<_>>(),
        ["2", "0.2000", "-0.0200", "-", "0.3333", "102.0000", "-", "2.5000"]
    );

    let buf = Buf::default();
    let mut full = ConsoleSink::full(Box::new(buf.clone()));
    full.log(7, &[("a/b".into(), 1.0), ("c".into(), 0.25)])
        .unwrap();
    assert_eq!(
        String::from_utf8(buf.0.lock().unwrap().clone()).unwrap(),
        "step:7 - a/b:1.0 - c:0.25\n"
    );
}

#[test]
fn tensorboard_file_round_trips_through_the_reader() {
    let tmp = tempfile::tempdir().unwrap();
    let mut sink = TensorboardSink::create(tmp.path()).unwrap();
    let name = sink
        .path()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    for step in 1..=3 {
        sink.log(step, &metrics(step)).unwrap();
    }
    // Readable after each log without closing: records are flushed per step.
    let events = read_events(sink.path()).unwrap();
    assert_eq!(events.len(), 4);
    assert_eq!(events[0].file_version.as_deref(), Some(FILE_VERSION));
    assert!(events[0].scalars.is_empty());
    assert_eq!(events[2].step, 2);
    assert!(events[2].wall_time > 1.6e9);
    assert_eq!(
        events[2].scalars[0],
        ("critic/score/mean".to_string(), 0.2f32)
    );
    assert_eq!(events[3].scalars.len(), 5);
}

#[test]
fn corrupted_or_truncated_event_files_are_rejected_with_the_offset() {
    let tmp = tempfile::tempdir().unwrap();
    let path = {
        let mut w = EventWriter::create(tmp.path()).unwrap();
        w.add_scalars(5, &[("loss".into(), 1.0)]).unwrap();
        w.flush().unwrap();
        w.path().to_path_buf()
    };
    let good = fs::read(&path).unwrap();

    let mut flipped = good.clone();
    let last = flipped.len() - 6; // inside the second record's payload
    flipped[last] ^= 0x01;
    fs::write(&path, &flipped).unwrap();
    let err = read_events(&path).unwrap_err().to_string();
    assert!(err.contains("payload CRC"), "{err}");

    fs::write(&path, &good[..good.len() - 3]).unwrap();
    let err = read_events(&path).unwrap_err().to_string();
    assert!(err.contains("the file ends first"), "{err}");

    // The framing itself: length, masked CRC of the length, payload, masked CRC of the payload.
    let len = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    assert_eq!(
        u32::from_le_bytes(good[8..12].try_into().unwrap()),
        tfevents::masked_crc32c(&good[..8])
    );
    let payload = &good[12..12 + len];
    assert_eq!(
        u32::from_le_bytes(good[12 + len..16 + len].try_into().unwrap()),
        tfevents::masked_crc32c(payload)
    );
}

/// The Python to ask: `$VERL_TEST_PYTHON`, else the workspace venv.
fn python() -> PathBuf {
    std::env::var_os("VERL_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"))
}

/// [`python`], which must import tensorboard (`scripts/setup.sh` installs it; `make test` runs it).
fn python_with_tensorboard() -> PathBuf {
    let py = python();
    let out = Command::new(&py)
        .args(["-c", "import tensorboard"])
        .output()
        .unwrap_or_else(|e| panic!("`{}` cannot be run: {e}", py.display()));
    assert!(
        out.status.success(),
        "`{}` cannot import tensorboard (run scripts/setup.sh): {}",
        py.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    py
}

#[test]
fn tensorboard_itself_reads_our_event_files() {
    let py = python_with_tensorboard();
    let tmp = tempfile::tempdir().unwrap();
    let mut sink = TensorboardSink::create(tmp.path()).unwrap();
    for step in 1..=3 {
        sink.log(step, &metrics(step)).unwrap();
    }
    sink.finish().unwrap();
    let script = r#"
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1]); acc.Reload()
for tag in sorted(acc.Tags()["scalars"]):
    print(tag, " ".join(f"{e.step}:{e.value:.6g}" for e in acc.Scalars(tag)))
"#;
    let out = Command::new(&py)
        .args(["-c", script])
        .arg(tmp.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("critic/score/mean 1:0.1 2:0.2 3:0.3"),
        "{text}"
    );
    assert!(
        text.contains("response_length/mean 1:101 2:102 3:103"),
        "{text}"
    );
    assert_eq!(text.lines().count(), 5, "{text}");
}

#[test]
fn tensorboard_itself_reads_our_validation_text() {
    let py = python_with_tensorboard();
    let tmp = tempfile::tempdir().unwrap();
    let mut sink = TensorboardSink::create(tmp.path()).unwrap();
    Sink::log_generations(&mut sink, 7, &[ValGeneration::new("Q é", "A\n日本", 0.25)]).unwrap();
    Sink::finish(&mut sink).unwrap();
    let script = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"tensors": 0}); acc.Reload()
out = []
for tag in acc.Tags()["tensors"]:
    plugin = acc.SummaryMetadata(tag).plugin_data.plugin_name
    for e in acc.Tensors(tag):
        out.append([tag, plugin, e.step, [s.decode() for s in e.tensor_proto.string_val],
                    [d.size for d in e.tensor_proto.tensor_shape.dim], e.tensor_proto.dtype])
print(json.dumps(out, ensure_ascii=False))
"#;
    let out = Command::new(&py)
        .args(["-c", script])
        .arg(tmp.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: Value = serde_json::from_slice(&out.stdout).unwrap();
    let text = "**Generation Results - Step 7**\n\n### Sample 1\n**Input:** Q é\n\n**Output:** A\n日本\n\n\
                **Score:** 0.25\n\n---\n\n";
    // dtype 7: DT_STRING.
    assert_eq!(
        seen,
        json!([["val/generations/text_summary", "text", 7, [text], [1], 7]])
    );
}

fn logged_run(dir: &Path) -> LoggerOptions {
    let opts = options(dir, &["file", "tensorboard"]);
    let mut logger = MetricsLogger::new(&opts).unwrap();
    for step in 1..=20 {
        let mut m = metrics(step);
        if step % 5 == 0 {
            m.push(("val-core/gsm8k/acc/mean@1".into(), step as f64 / 40.0));
        }
        logger.log(step, &m).unwrap();
    }
    logger.finish().unwrap();
    opts
}

#[test]
fn run_history_reads_jsonl_and_tensorboard_alike() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = logged_run(tmp.path());
    let from_jsonl = RunHistory::load(opts.jsonl_path.parent().unwrap()).unwrap();
    let from_tb = RunHistory::load(&opts.tensorboard_dir).unwrap();
    assert_eq!(from_jsonl.metric_names(), from_tb.metric_names());
    assert_eq!(
        from_jsonl
            .series("val-core/gsm8k/acc/mean@1")
            .unwrap()
            .len(),
        4
    );
    let tb = from_tb.series("actor/entropy").unwrap();
    let js = from_jsonl.series("actor/entropy").unwrap();
    assert!(tb
        .iter()
        .zip(&js)
        .all(|(a, b)| a.0 == b.0 && (a.1 - b.1).abs() < 1e-6));
    assert_eq!(
        from_jsonl.default_metrics(),
        [
            "critic/score/mean",
            "actor/pg_loss",
            "actor/entropy",
            "response_length/mean",
            "timing_s/step",
            "val-core/gsm8k/acc/mean@1"
        ]
    );
}

#[test]
fn torn_last_line_is_skipped_but_a_bad_middle_line_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.jsonl");
    fs::write(
        &path,
        "{\"step\":1,\"data\":{\"a\":1}}\n{\"step\":2,\"metrics\":{\"a\":2}}\n{\"step\":3,\"da",
    )
    .unwrap();
    assert_eq!(
        RunHistory::load(&path).unwrap().series("a").unwrap(),
        [(1, 1.0), (2, 2.0)]
    );
    fs::write(&path, "{\"step\":1,\"data\":{\"a\":1}}\n{\"data\":{}}\n").unwrap();
    let err = RunHistory::load(&path).unwrap_err().to_string();
    assert!(err.contains("line 2") && err.contains("`step`"), "{err}");
}

#[test]
fn plot_run_writes_svg_with_labels_and_png() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = logged_run(tmp.path());
    let run = opts.jsonl_path.parent().unwrap();

    let svg = tmp.path().join("plots/run.svg");
    let drawn = plot_run(run, &["critic/score/mean", "val-core/*"], &svg).unwrap();
    assert_eq!(drawn, ["critic/score/mean", "val-core/gsm8k/acc/mean@1"]);
    let text = fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"), "{}", &text[..60]);
    assert!(text.contains("critic/score/mean") && text.contains("val-core/gsm8k/acc/mean@1"));
    assert!(text.contains("<polyline"), "a line was drawn");

    let png = tmp.path().join("run.png");
    let drawn = plot_run(&opts.tensorboard_dir, &[], &png).unwrap();
    assert_eq!(drawn.len(), 6);
    let bytes = fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    // 6 panels in 2 columns of 640×300.
    assert_eq!(u32::from_be_bytes(bytes[16..20].try_into().unwrap()), 1280);
    assert_eq!(u32::from_be_bytes(bytes[20..24].try_into().unwrap()), 900);

    let err = plot_run(run, &["actor/pg_los"], &svg)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`actor/pg_los`") && err.contains("actor/pg_loss"),
        "{err}"
    );
    let err = plot_run(tmp.path(), &[], &svg).unwrap_err().to_string();
    assert!(err.contains("neither"), "{err}");
}
