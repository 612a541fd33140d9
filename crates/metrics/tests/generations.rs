//! `trainer.log_val_generations`: the samples chosen are verl's, checked against the installed NumPy
//! (`tests/numpy_select.py`), and the TensorBoard text reads back (with TensorBoard's own reader in
//! `tests/logging.rs`). The tracker clients are tested in `tests/tracking.rs`.
//!
//! The interpreter is `$VERL_PYTHON`, else `python3` on PATH (`scripts/env.sh` puts the project's venv first); it
//! must import numpy (`scripts/requirements-test.txt`): without it these tests fail, they do not skip.

use std::io::Write;
use std::process::{Command, Stdio};

use serde_json::{json, Value};
use verl_metrics::numpy_random::RandomState;
use verl_metrics::tfevents::read_events;
use verl_metrics::{
    select_val_generations, LoggerOptions, MetricsLogger, TrackingOptions, ValGeneration,
};

/// Inputs that order differently by code point than by UTF-16 unit (U+FF5E vs U+1F600) or by case, prefixes,
/// the empty string; combined with a number so that some samples share an input and some do not.
const INPUTS: [&str; 9] = [
    "",
    "a",
    "ab",
    "B",
    "é",
    "z",
    "\u{FF5E}",
    "\u{1F600}",
    "日本",
];

fn samples(count: usize) -> Vec<ValGeneration> {
    (0..count)
        .map(|i| {
            let input = format!("{}{}", INPUTS[(i * 7) % INPUTS.len()], (i * 37) % 13);
            let score = (i % 9) as f64 * 0.25 - 1.0;
            ValGeneration::new(input, format!("out-{i}"), score)
        })
        .collect()
}

fn as_triples(samples: &[ValGeneration]) -> Value {
    samples
        .iter()
        .map(|s| json!([s.input, s.output, s.score]))
        .collect()
}

/// `numpy_select.py`'s answer to `request`.
fn ask_numpy(request: &Value) -> Value {
    let python = TrackingOptions::new("p", "e").python;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/numpy_select.py");
    let mut child = Command::new(&python)
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run `{}`: {e}", python.display()));
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(request.to_string().as_bytes()).unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "numpy_select.py with `{}` failed (is numpy installed?): {}",
        python.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("numpy_select.py prints JSON")
}

#[test]
fn the_selection_and_the_generator_match_numpy_bit_for_bit() {
    let mut cases = Vec::new();
    let mut ours = Vec::new();
    for count in [0usize, 1, 2, 7, 100, 1000] {
        for n in [0, 1, 5, count, count + 3] {
            let all = samples(count);
            cases.push(json!({"samples": as_triples(&all), "n": n}));
            ours.push(as_triples(&select_val_generations(all, n)));
        }
    }
    let draws = 1500; // past the state's first regeneration at 624 outputs
    let numpy = ask_numpy(&json!({"cases": cases, "draws": draws}));

    let theirs = numpy["selections"].as_array().unwrap();
    assert_eq!(theirs.len(), ours.len());
    for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
        assert_eq!(a, b, "case {i}: {}", cases[i]["n"]);
    }

    let mut rs = RandomState::new(42);
    let raw: Vec<u64> = (0..draws).map(|_| u64::from(rs.next_u32())).collect();
    assert_eq!(json!(raw), numpy["raw32"]);
    // A bound above 32 bits takes 64-bit draws (two outputs, the first one high), masked to 40 bits.
    let mut rs = RandomState::new(42);
    let bounded: Vec<u64> = (0..draws)
        .map(|_| rs.random_interval((1 << 40) - 1))
        .collect();
    assert_eq!(json!(bounded), numpy["bounded40"]);
}

#[test]
fn the_same_samples_are_selected_whatever_order_they_arrive_in() {
    // Inputs are unique here, so the sort alone fixes the order.
    let unique: Vec<ValGeneration> = samples(50)
        .into_iter()
        .enumerate()
        .map(|(i, s)| ValGeneration::new(format!("{i:03}"), s.output, s.score))
        .collect();
    let mut unique_reversed = unique.clone();
    unique_reversed.reverse();
    assert_eq!(
        select_val_generations(unique, 10),
        select_val_generations(unique_reversed, 10)
    );
    // Shared inputs (sample i and i+117 here) keep their arrival order, as Python's stable sort keeps it.
    let all = samples(200);
    let mut reversed = all.clone();
    reversed.reverse();
    assert_ne!(
        select_val_generations(all, 200),
        select_val_generations(reversed, 200)
    );
}

#[test]
fn tensorboard_shows_each_validation_as_one_markdown_text_and_the_file_logger_none() {
    let tmp = tempfile::tempdir().unwrap();
    let mut opts = LoggerOptions::from_verl("proj", "exp", &["file".into(), "tensorboard".into()]);
    opts.jsonl_path = tmp.path().join("metrics.jsonl");
    opts.tensorboard_dir = tmp.path().join("tb");
    let mut logger = MetricsLogger::new(&opts).unwrap();
    let first = [
        ValGeneration::new("What is 1+1?", "2", 1.0),
        ValGeneration::new("Solve x²=4 ✓", "x = ±2\n**done**", 0.0),
    ];
    let second = [ValGeneration::new("What is 1+1?", "3", -0.5)];
    logger.log(5, &[("val-core/acc".into(), 0.5)]).unwrap();
    logger.log_generations(5, &first).unwrap();
    logger.log_generations(10, &second).unwrap();
    logger.log_generations(15, &[]).unwrap(); // nothing to log: no event
    logger.finish().unwrap();
    // verl's file logger has no samples: only the metrics line.
    assert_eq!(
        std::fs::read_to_string(&opts.jsonl_path).unwrap(),
        "{\"step\":5,\"data\":{\"val-core/acc\":0.5}}\n"
    );

    let file = std::fs::read_dir(&opts.tensorboard_dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let texts: Vec<(i64, Vec<(String, String)>)> = read_events(&file)
        .unwrap()
        .into_iter()
        .filter(|e| !e.texts.is_empty())
        .map(|e| (e.step, e.texts))
        .collect();
    let tag = "val/generations/text_summary".to_string();
    assert_eq!(
        texts,
        [
            (
                5,
                vec![(
                    tag.clone(),
                    "**Generation Results - Step 5**\n\n\
                     ### Sample 1\n**Input:** What is 1+1?\n\n**Output:** 2\n\n**Score:** 1.0\n\n---\n\n\
                     ### Sample 2\n**Input:** Solve x²=4 ✓\n\n**Output:** x = ±2\n**done**\n\n**Score:** 0.0\n\n---\n\n"
                        .to_string()
                )]
            ),
            (
                10,
                vec![(
                    tag,
                    "**Generation Results - Step 10**\n\n\
                     ### Sample 1\n**Input:** What is 1+1?\n\n**Output:** 3\n\n**Score:** -0.5\n\n---\n\n"
                        .to_string()
                )]
            ),
        ]
    );
}
