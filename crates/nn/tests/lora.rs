//! LoRA adapters: selection, the base model with adapters off, gradients only into adapters,
//! merged export, PEFT folders written and read, and PEFT itself loading ours (fp32 logits).

mod common;

use std::path::Path;
use std::process::Command;

use common::max_abs;
use tch::{Kind, Tensor};
use verl_nn::{LoraConfig, LoraModules, ModelConfig, ModelOptions, SaveOptions, Transformer};

/// Two layers, hidden 32, GQA 4/2 heads, untied head, vocabulary 40; random weights from `seed`.
fn tiny_transformer(dtype: Kind, seed: i64) -> Transformer {
    static GLOBAL_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _only_us = GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(seed);
    let cfg = ModelConfig::from_value(
        serde_json::json!({
            "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": 40, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
            "tie_word_embeddings": false, "initializer_range": 0.2,
            "pad_token_id": 0, "eos_token_id": 1,
        }),
        "inline/config.json",
    )
    .unwrap();
    let opts = ModelOptions {
        dtype,
        ..ModelOptions::default()
    };
    Transformer::new(cfg, &opts).unwrap()
}

fn lora(rank: i64, targets: LoraModules) -> LoraConfig {
    LoraConfig {
        rank,
        alpha: 16.0,
        target_modules: targets,
        exclude_modules: None,
        use_rslora: false,
        modules_to_save: Vec::new(),
    }
}

/// Gives every adapter's B random values (fresh adapters leave the output unchanged).
fn randomise_b(m: &Transformer, seed: i64) {
    tch::manual_seed(seed);
    tch::no_grad(|| {
        for (n, p) in m.named_parameters() {
            if n.ends_with("lora_B.weight") {
                let _ = p.shallow_clone().normal_(0.0, 0.05);
            }
        }
    });
}

fn ids() -> (Tensor, Tensor) {
    let ids = Tensor::from_slice(&[0i64, 0, 5, 9, 13, 2, 7, 3, 11, 4, 6, 8, 12, 30, 21, 17])
        .reshape([2, 8]);
    // The first row is left-padded by two.
    let mask = ids.ne(0).to_kind(Kind::Int64);
    (ids, mask)
}

fn positions(mask: &Tensor) -> Tensor {
    (mask.cumsum(1, Kind::Int64) - 1).clamp_min(0)
}

fn logits(m: &Transformer) -> Tensor {
    let (ids, mask) = ids();
    tch::no_grad(|| {
        m.forward(&ids, Some(&mask), Some(&positions(&mask)), None)
            .unwrap()
    })
}

#[test]
fn all_linear_adapts_every_projection_and_leaves_the_output_until_trained() {
    let mut m = tiny_transformer(Kind::Float, 3);
    let before = logits(&m);
    let report = m.add_lora(&lora(4, LoraModules::AllLinear), 0).unwrap();
    assert_eq!(report.modules, 2 * 7, "7 projections in each of 2 layers");
    // hidden 32, inter 64, q 32, k/v 16: r·(in+out) summed over a layer's projections, 2 layers.
    let per_layer = 4 * ((32 + 32) + 2 * (32 + 16) + (32 + 32) + 2 * (32 + 64) + (64 + 32));
    assert_eq!(report.trainable_params, 2 * per_layer);
    assert_eq!(max_abs(&before, &logits(&m)), 0.0, "B starts at zero");
    let trainable = m.trainable_parameters();
    assert_eq!(trainable.len(), 28);
    for &i in &trainable {
        assert!(m.named_parameters()[i].0.contains(".lora_"));
    }
    assert!(m.base_parameters().iter().all(|(_, p)| !p.requires_grad()));
}

#[test]
fn the_base_model_is_the_adapted_one_with_adapters_off() {
    let mut m = tiny_transformer(Kind::Float, 3);
    let base = logits(&m);
    m.add_lora(&lora(4, LoraModules::AllLinear), 0).unwrap();
    randomise_b(&m, 1);
    let adapted = logits(&m);
    assert!(
        max_abs(&base, &adapted) > 1e-3,
        "the adapters change the output"
    );
    let off = m.without_adapters(logits);
    assert_eq!(
        max_abs(&base, &off),
        0.0,
        "adapters off = the base, bit for bit"
    );
    assert!(m.adapters_enabled(), "switched back on");
    assert_eq!(max_abs(&adapted, &logits(&m)), 0.0);
}

#[test]
fn target_and_exclude_modules_select_projections_as_peft_does() {
    let mut m = tiny_transformer(Kind::Float, 3);
    let mut cfg = lora(
        2,
        LoraModules::Names(vec!["q_proj".into(), "mlp.down_proj".into()]),
    );
    cfg.exclude_modules = Some(LoraModules::Regex(r"model\.layers\.1\..*".into()));
    let r = m.add_lora(&cfg, 0).unwrap();
    assert_eq!(r.modules, 2, "layer 0's q_proj and down_proj");
    let names: Vec<&str> = m.named_parameters()[m.trainable_parameters()[0]..]
        .iter()
        .map(|(n, _)| n.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "model.layers.0.self_attn.q_proj.lora_A.weight",
            "model.layers.0.self_attn.q_proj.lora_B.weight",
            "model.layers.0.mlp.down_proj.lora_A.weight",
            "model.layers.0.mlp.down_proj.lora_B.weight",
        ]
    );
    let mut none = tiny_transformer(Kind::Float, 3);
    let err = none
        .add_lora(&lora(2, LoraModules::Names(vec!["c_attn".into()])), 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("target_modules"), "{err}");
}

#[test]
fn a_backward_reaches_the_adapters_only() {
    let mut m = tiny_transformer(Kind::Float, 3);
    m.add_lora(&lora(4, LoraModules::AllLinear), 0).unwrap();
    randomise_b(&m, 2);
    for checkpointing in [false, true] {
        m.set_activation_checkpointing(checkpointing);
        for (_, p) in m.named_parameters() {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        let (ids, mask) = ids();
        let _ = m
            .forward_backward(&ids, Some(&mask), Some(&positions(&mask)), |out| {
                Ok(out
                    .to_kind(Kind::Float)
                    .pow_tensor_scalar(2)
                    .mean(None::<Kind>))
            })
            .unwrap();
        for (n, p) in m.named_parameters() {
            let g = p.grad();
            if n.contains(".lora_") {
                assert!(
                    g.defined() && g.abs().sum(Kind::Double).double_value(&[]) > 0.0,
                    "{n}"
                );
            } else {
                assert!(!g.defined(), "{n} is frozen and must get no gradient");
            }
        }
    }
}

#[test]
fn a_merged_export_is_the_adapted_model() {
    let mut m = tiny_transformer(Kind::Float, 3);
    m.add_lora(&lora(4, LoraModules::AllLinear), 0).unwrap();
    randomise_b(&m, 3);
    let dir = tempfile::tempdir().unwrap();
    m.save_pretrained(
        dir.path(),
        &SaveOptions {
            merge_lora: true,
            ..SaveOptions::default()
        },
    )
    .unwrap();
    let merged = Transformer::from_pretrained(dir.path(), &Default::default()).unwrap();
    let d = max_abs(&logits(&m), &logits(&merged));
    assert!(d < 1e-5, "merged export differs by {d}");
    // Unmerged: the base weights, no adapter tensors.
    let plain = tempfile::tempdir().unwrap();
    m.save_pretrained(plain.path(), &SaveOptions::default())
        .unwrap();
    let base = Transformer::from_pretrained(plain.path(), &Default::default()).unwrap();
    assert_eq!(max_abs(&m.without_adapters(logits), &logits(&base)), 0.0);
}

#[test]
fn an_adapter_folder_round_trips() {
    let mut m = tiny_transformer(Kind::Float, 3);
    let cfg = lora(
        4,
        LoraModules::Names(vec!["q_proj".into(), "v_proj".into()]),
    );
    m.add_lora(&cfg, 0).unwrap();
    randomise_b(&m, 4);
    let dir = tempfile::tempdir().unwrap();
    m.save_adapter(dir.path(), "tiny").unwrap();
    let read = LoraConfig::from_adapter_dir(dir.path()).unwrap();
    assert_eq!(read, cfg);
    let mut back = tiny_transformer(Kind::Float, 3);
    back.add_lora(&read, 0).unwrap();
    back.load_adapter(dir.path()).unwrap();
    assert_eq!(max_abs(&logits(&m), &logits(&back)), 0.0);
    // An adapter for other modules is refused, naming a missing tensor.
    let mut other = tiny_transformer(Kind::Float, 3);
    other.add_lora(&lora(4, LoraModules::AllLinear), 0).unwrap();
    let err = other.load_adapter(dir.path()).unwrap_err().to_string();
    assert!(err.contains("k_proj.lora_A.weight"), "{err}");
}

#[test]
fn adapter_settings_we_do_not_implement_are_refused_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let write = |extra: serde_json::Value| {
        let mut v = serde_json::json!({
            "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
            "lora_dropout": 0.0, "bias": "none",
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        std::fs::write(dir.path().join("adapter_config.json"), v.to_string()).unwrap();
    };
    write(serde_json::json!({}));
    assert!(LoraConfig::from_adapter_dir(dir.path()).is_ok());
    for (key, value) in [
        ("lora_dropout", serde_json::json!(0.05)),
        ("use_dora", serde_json::json!(true)),
        ("bias", serde_json::json!("all")),
        ("rank_pattern", serde_json::json!({"q_proj": 4})),
    ] {
        write(serde_json::json!({ key: value }));
        let err = LoraConfig::from_adapter_dir(dir.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{key}: {err}");
    }
}

/// The Python helper that loads our folders with the real PEFT package (fails, not skips, when
/// the test venv lacks it: `scripts/setup.sh` installs `peft`).
fn peft_python() -> std::path::PathBuf {
    let py = common::python().expect("the test venv (scripts/setup.sh) is needed for PEFT parity");
    let ok = Command::new(&py)
        .args(["-c", "import peft"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        ok,
        "{} cannot import peft (scripts/setup.sh installs it)",
        py.display()
    );
    py
}

fn peft_script(py: &Path, args: &[&str]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/peft_reference.py");
    let out = Command::new(py).arg(script).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "peft_reference.py {args:?}:\n{text}");
    text
}

/// PEFT's logits of [`ids`] with the adapter folder on the base folder (`logits`) and with
/// `disable_adapter` (`base_logits`); files go to `work`.
fn peft_logits(
    py: &Path,
    work: &Path,
    base_dir: &Path,
    adapter_dir: &Path,
) -> std::collections::HashMap<String, Tensor> {
    let (inputs, out) = (work.join("in.safetensors"), work.join("out.safetensors"));
    let (ids, mask) = ids();
    Tensor::write_safetensors(&[("input_ids", &ids), ("attention_mask", &mask)], &inputs).unwrap();
    let arg = |p: &Path| p.to_str().unwrap().to_string();
    let args = [
        "logits".to_string(),
        arg(base_dir),
        arg(adapter_dir),
        arg(&inputs),
        arg(&out),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    peft_script(py, &args);
    common::read_safetensors(&out)
}

#[test]
fn peft_loads_our_adapter_and_agrees_on_the_logits() {
    let py = peft_python();
    let mut m = tiny_transformer(Kind::Float, 3);
    let dir = tempfile::tempdir().unwrap();
    let (base_dir, adapter_dir) = (dir.path().join("base"), dir.path().join("adapter"));
    m.save_pretrained(&base_dir, &SaveOptions::default())
        .unwrap();
    m.add_lora(&lora(4, LoraModules::AllLinear), 0).unwrap();
    randomise_b(&m, 5);
    m.save_adapter(&adapter_dir, base_dir.to_str().unwrap())
        .unwrap();
    let theirs = peft_logits(&py, dir.path(), &base_dir, &adapter_dir);
    let (_, mask) = ids();
    let d = common::masked_max_abs(&logits(&m), &theirs["logits"], &mask);
    assert!(d < 1e-5, "PEFT's logits differ from ours by {d}");
    let d0 = common::masked_max_abs(&m.without_adapters(logits), &theirs["base_logits"], &mask);
    assert!(
        d0 < 1e-5,
        "adapters off: PEFT's disable_adapter differs by {d0}"
    );
}

#[test]
fn we_load_an_adapter_peft_made() {
    let py = peft_python();
    let m = tiny_transformer(Kind::Float, 3);
    let dir = tempfile::tempdir().unwrap();
    let (base_dir, adapter_dir) = (dir.path().join("base"), dir.path().join("adapter"));
    m.save_pretrained(&base_dir, &SaveOptions::default())
        .unwrap();
    peft_script(
        &py,
        &[
            "make-adapter",
            base_dir.to_str().unwrap(),
            adapter_dir.to_str().unwrap(),
            "--rank",
            "4",
            "--alpha",
            "8",
            "--seed",
            "11",
        ],
    );
    let cfg = LoraConfig::from_adapter_dir(&adapter_dir).unwrap();
    assert_eq!((cfg.rank, cfg.alpha), (4, 8.0));
    let mut ours = Transformer::from_pretrained(&base_dir, &Default::default()).unwrap();
    ours.add_lora(&cfg, 0).unwrap();
    ours.load_adapter(&adapter_dir).unwrap();
    let theirs = peft_logits(&py, dir.path(), &base_dir, &adapter_dir);
    let (_, mask) = ids();
    let d = common::masked_max_abs(&logits(&ours), &theirs["logits"], &mask);
    assert!(d < 1e-5, "an adapter PEFT made: logits differ by {d}");
    assert!(
        common::masked_max_abs(&logits(&ours), &theirs["base_logits"], &mask) > 1e-4,
        "the adapter must change the output"
    );
}
