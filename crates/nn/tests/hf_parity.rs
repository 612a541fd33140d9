//! Parity with transformers (CPU, fp32): tiny random checkpoints made by `tests/py/hf_reference.py`
//! for every family; our logits must match within 1e-4 on real tokens, greedy continuations must be
//! identical (with and without KV cache), and checkpoints we save must load in transformers with
//! identical outputs. Skips (with a message) when the venv Python or transformers is missing.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::{masked_max_abs, max_abs, python, read_safetensors, run_script};
use tch::{Kind, Tensor};
use verl_nn::{Checkpoint, HeadKind, ModelOptions, SaveOptions, Transformer};

const TOL: f64 = 1e-4;
const CASES: [&str; 8] = [
    "llama",
    "llama3_tied",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
];

/// Builds the reference folder once per test binary; `None` when Python is unavailable.
fn reference() -> Option<&'static Path> {
    static REF: OnceLock<Option<PathBuf>> = OnceLock::new();
    REF.get_or_init(|| {
        let py = python()?;
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nn-hf-reference");
        let _ = std::fs::remove_dir_all(&dir);
        let out = run_script(&py, &["make", dir.to_str().expect("utf-8 temp path")]);
        eprintln!("{out}");
        Some(dir)
    })
    .as_deref()
}

fn opts(head: HeadKind) -> ModelOptions {
    ModelOptions {
        head,
        ..ModelOptions::default()
    }
}

fn check_case(case: &str) {
    let Some(root) = reference() else { return };
    let dir = root.join(case);
    let model = Transformer::from_pretrained(dir.join("hf"), &opts(HeadKind::CausalLm))
        .unwrap_or_else(|e| panic!("{case}: {e}"));
    let r = read_safetensors(&dir.join("ref.safetensors"));

    for side in ["left", "right"] {
        let ids = &r[&format!("{side}_ids")];
        let mask = &r[&format!("{side}_mask")];
        let logits = tch::no_grad(|| model.forward(ids, Some(mask), None, None)).unwrap();
        let want = &r[&format!("{side}_logits")];
        assert_eq!(logits.size(), want.size(), "{case} {side}");
        let d = masked_max_abs(&logits, want, mask);
        assert!(
            d < TOL,
            "{case} {side}-padded logits differ from transformers by {d:.3e}"
        );
        eprintln!("{case} {side}: max abs logit diff {d:.2e}");
    }

    let ids = &r["left_ids"];
    let mask = &r["left_mask"];
    let want = &r["greedy_left"];
    let steps = want.size()[1];
    for use_cache in [false, true] {
        let got = model
            .generate_greedy(ids, Some(mask), steps, use_cache)
            .unwrap();
        assert!(
            got.equal(want),
            "{case}: greedy (use_cache={use_cache}) differs from transformers\nours: {got}\nhf: {want}"
        );
    }

    // Incremental decoding must reproduce full-sequence logits, not just their argmax.
    let full_ids = Tensor::cat(&[ids, want], 1);
    let full_mask = Tensor::cat(&[mask, &want.ones_like()], 1);
    let full = tch::no_grad(|| model.forward(&full_ids, Some(&full_mask), None, None)).unwrap();
    let t0 = ids.size()[1];
    let mut cache = model.new_cache();
    let mut pieces = vec![];
    tch::no_grad(|| {
        pieces.push(
            model
                .forward(ids, Some(mask), None, Some(&mut cache))
                .unwrap(),
        );
        // A chunk of 5 tokens, then one at a time.
        pieces.push(
            model
                .forward(&want.narrow(1, 0, 5), None, None, Some(&mut cache))
                .unwrap(),
        );
        for i in 5..steps {
            pieces.push(
                model
                    .forward(&want.narrow(1, i, 1), None, None, Some(&mut cache))
                    .unwrap(),
            );
        }
    });
    assert_eq!(cache.len(), t0 + steps);
    let inc = Tensor::cat(&pieces, 1);
    let d = masked_max_abs(&inc, &full, &full_mask);
    assert!(
        d < TOL,
        "{case}: KV-cache logits differ from full forward by {d:.3e}"
    );
}

#[test]
fn parity_llama() {
    check_case("llama");
}

#[test]
fn parity_llama3_rope_scaling_tied_bias() {
    check_case("llama3_tied");
}

#[test]
fn parity_mistral_sliding_window() {
    check_case("mistral");
}

#[test]
fn parity_qwen2() {
    check_case("qwen2");
}

#[test]
fn parity_qwen3() {
    check_case("qwen3");
}

#[test]
fn parity_mixtral() {
    check_case("mixtral");
}

#[test]
fn parity_qwen2_moe_shared_expert() {
    check_case("qwen2_moe");
}

#[test]
fn parity_qwen3_moe() {
    check_case("qwen3_moe");
}

#[test]
fn parity_value_and_reward_heads() {
    let Some(root) = reference() else { return };
    for case in ["llama", "qwen3"] {
        let dir = root.join(case);
        let r = read_safetensors(&dir.join("ref.safetensors"));
        let value =
            Transformer::from_pretrained(dir.join("value"), &opts(HeadKind::Value)).unwrap();
        let reward = Transformer::from_pretrained(
            dir.join("reward"),
            &opts(HeadKind::SequenceClassification),
        )
        .unwrap();
        for side in ["left", "right"] {
            let ids = &r[&format!("{side}_ids")];
            let mask = &r[&format!("{side}_mask")];
            let v = tch::no_grad(|| value.forward(ids, Some(mask), None, None)).unwrap();
            let want = r[&format!("value_{side}")].squeeze_dim(-1);
            assert_eq!(v.size(), want.size());
            let d = masked_max_abs(&v, &want, mask);
            assert!(d < TOL, "{case} value {side}: {d:.3e}");
            let s = tch::no_grad(|| reward.forward(ids, Some(mask), None, None)).unwrap();
            let want = &r[&format!("reward_{side}")];
            assert_eq!(s.size(), want.size());
            let d = max_abs(&s, want);
            assert!(d < TOL, "{case} reward {side}: {d:.3e}");
        }
    }
}

/// A critic started from a policy checkpoint: the value head is initialised, `lm_head` skipped.
#[test]
fn value_head_from_policy_checkpoint() {
    let Some(root) = reference() else { return };
    let dir = root.join("llama/hf");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let config = verl_nn::ModelConfig::from_dir(&dir).unwrap();
    let mut critic = Transformer::new(config, &opts(HeadKind::Value)).unwrap();
    let report = critic.load_checkpoint(&ckpt).unwrap();
    assert_eq!(report.initialized, vec!["score.weight", "score.bias"]);
    assert_eq!(report.ignored, vec!["lm_head.weight"]);
}

/// Our saves (single file, sharded, bf16->fp32 round trip, all heads) load in transformers with
/// outputs identical to the reference, and load back in Rust bit-identically.
#[test]
fn transformers_loads_our_checkpoints() {
    let Some(root) = reference() else { return };
    let py = python().expect("python was available for the reference");
    let out_root = root.join("ours");
    let mut args: Vec<String> = vec!["check".into()];
    let mut push = |ours: &Path, case: &str, head: &str| {
        args.push(ours.display().to_string());
        args.push(root.join(case).display().to_string());
        args.push(head.to_string());
    };
    for case in CASES {
        let model =
            Transformer::from_pretrained(root.join(case).join("hf"), &opts(HeadKind::CausalLm))
                .unwrap();
        let ours = out_root.join(case);
        // Mixtral has the most tensors: save it sharded to exercise the index writer/reader.
        let save = if case == "mixtral" {
            SaveOptions {
                max_shard_bytes: 150_000,
                ..SaveOptions::default()
            }
        } else {
            SaveOptions::default()
        };
        model.save_pretrained(&ours, &save).unwrap();
        if case == "mixtral" {
            assert!(ours.join("model.safetensors.index.json").is_file());
            assert!(!ours.join("model.safetensors").exists());
        }
        let back = Transformer::from_pretrained(&ours, &opts(HeadKind::CausalLm)).unwrap();
        for ((n1, a), (n2, b)) in model.named_parameters().iter().zip(back.named_parameters()) {
            assert_eq!(n1, n2);
            assert!(
                a.equal(b),
                "{case}: `{n1}` changed in a save/load round trip"
            );
        }
        push(&ours, case, "causal");
    }
    for (case, head, kind) in [
        ("llama", "value", HeadKind::Value),
        ("qwen3", "reward", HeadKind::SequenceClassification),
    ] {
        let model = Transformer::from_pretrained(root.join(case).join(head), &opts(kind)).unwrap();
        let ours = out_root.join(format!("{case}-{head}"));
        model
            .save_pretrained(&ours, &SaveOptions::default())
            .unwrap();
        push(&ours, case, head);
    }
    let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let out = run_script(&py, &args);
    eprintln!("{out}");
    assert!(out.contains("verdict: OK"), "{out}");
}

/// bf16 / fp16 models run the same code path; their logits track fp32 closely.
#[test]
fn half_precision_tracks_fp32() {
    let Some(root) = reference() else { return };
    let dir = root.join("qwen3_moe");
    let r = read_safetensors(&dir.join("ref.safetensors"));
    let (ids, mask) = (&r["left_ids"], &r["left_mask"]);
    let want = &r["left_logits"];
    let scale = want.abs().max().double_value(&[]);
    for kind in [Kind::BFloat16, Kind::Half] {
        let model = Transformer::from_pretrained(
            dir.join("hf"),
            &ModelOptions {
                dtype: kind,
                ..ModelOptions::default()
            },
        )
        .unwrap();
        assert_eq!(model.named_parameters()[0].1.kind(), kind);
        let logits = tch::no_grad(|| model.forward(ids, Some(mask), None, None)).unwrap();
        assert_eq!(logits.kind(), kind);
        let d = masked_max_abs(&logits, want, mask);
        assert!(
            d < 0.05 * scale,
            "{kind:?}: max abs diff {d:.3e} vs logit scale {scale:.3e}"
        );
    }
}
