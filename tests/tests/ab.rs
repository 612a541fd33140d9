//! `verl ab` end to end: the quickstart job on FSDP and on Megatron (one rank, then TP=2 on two CPU
//! ranks) in fp32 agree within 1e-5; a changed learning rate is named at its first diverging
//! step; the report renders in a real browser (headless Chromium) with its charts drawn.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::Value;
use verl_e2e::*;

struct Inputs {
    _dir: tempfile::TempDir,
    root: PathBuf,
    inst: tempfile::TempDir,
}

/// Arithmetic data (enough rows for three steps of the quickstart's batch) and a tiny random
/// model, made by the real binary once per test binary.
fn inputs() -> &'static Inputs {
    static I: OnceLock<Inputs> = OnceLock::new();
    I.get_or_init(|| {
        let inst = install(&[
            "libverl_fsdp.so",
            "libverl_megatron.so",
            "libverl_rewards.so",
            "libfaulty_plugin.so",
        ]);
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let verl = inst.path().join("verl");
        let data = root.join("data");
        let model = root.join("model");
        for args in [
            vec![
                "data",
                "arith",
                "--out",
                data.to_str().unwrap(),
                "--train",
                "400",
                "--val",
                "16",
                "--seed",
                "1",
            ],
            vec![
                "init-model",
                "--out",
                model.to_str().unwrap(),
                "--data",
                data.join("train.parquet").to_str().unwrap(),
                "--vocab",
                "300",
                "--hidden",
                "32",
                "--intermediate",
                "64",
                "--layers",
                "1",
                "--heads",
                "2",
                "--kv-heads",
                "2",
            ],
        ] {
            let o = run(&verl, &args);
            assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        }
        Inputs {
            _dir: dir,
            root,
            inst,
        }
    })
}

const FSDP_FP32: &str =
    "fsdp actor_rollout_ref.actor.fsdp_config.dtype=fp32 actor_rollout_ref.ref.fsdp_config.dtype=fp32";
const MEGATRON_FP32: &str = "megatron actor_rollout_ref.actor.megatron.dtype=float32 actor_rollout_ref.ref.megatron.dtype=float32";

/// `verl --plugin libfaulty_plugin.so ab examples/quickstart/job.yaml …` (the fixture scores the
/// response length, so scores vary even for an untrained model); its summary.json.
fn ab(out: &Path, a: &str, b: &str, extra: &[&str]) -> (std::process::Output, Value) {
    let i = inputs();
    let job = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/quickstart/job.yaml");
    let data = i.root.join("data");
    let common = [
        format!("data.train_files={}", data.join("train.parquet").display()),
        format!("data.val_files={}", data.join("val.parquet").display()),
        format!(
            "actor_rollout_ref.model.path={}",
            i.root.join("model").display()
        ),
        "trainer.val_before_train=false".into(),
        "trainer.test_freq=2".into(),
        "plugins.reward.default=faulty".into(),
    ];
    let mut args: Vec<String> = vec![
        "--plugin".into(),
        i.inst
            .path()
            .join("libfaulty_plugin.so")
            .display()
            .to_string(),
        "ab".into(),
        job.display().to_string(),
    ];
    args.extend(common);
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(["--a".into(), a.into(), "--b".into(), b.into()]);
    args.extend([
        "--steps".into(),
        "3".into(),
        "--out".into(),
        out.display().to_string(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = run(&i.inst.path().join("verl"), &args);
    assert!(
        o.status.success(),
        "verl ab: {}\n{}",
        stdout(&o),
        stderr(&o)
    );
    let summary =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    (o, summary)
}

fn verdicts(summary: &Value) -> Vec<(String, String, Option<u64>)> {
    summary["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap().to_string(),
                m["verdict"].as_str().unwrap().to_string(),
                m["first_diverged_step"].as_u64(),
            )
        })
        .collect()
}

#[test]
fn fsdp_and_megatron_agree_in_fp32_on_one_rank_and_at_tp2_on_two() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ab");
    let (o, s) = ab(&out, FSDP_FP32, MEGATRON_FP32, &[]);
    assert_eq!(
        s["rtol"].as_f64(),
        Some(1e-5),
        "fp32 arms: the fp32 tolerance"
    );
    let v = verdicts(&s);
    assert!(v.len() > 20, "{v:?}");
    let diverged: Vec<_> = v.iter().filter(|m| m.2.is_some()).collect();
    assert!(diverged.is_empty(), "{diverged:?}\n{}", stdout(&o));
    // The scores (response lengths) are real numbers that moved, not zeros.
    let score = &s["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "critic/score/mean")
        .unwrap();
    assert!(score["verdict"] == "equal" || score["verdict"] == "within tolerance");
    assert!(s["config_diff"]
        .as_array()
        .unwrap()
        .iter()
        .any(|d| d["key"] == "actor_rollout_ref.actor.strategy"));
    assert!(stdout(&o).contains("report: "), "{}", stdout(&o));

    // Megatron at TP=2 on two CPU ranks; arm a finished with the same command and is reused.
    let (o, s) = ab(
        &out,
        FSDP_FP32,
        &format!("{MEGATRON_FP32} actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 trainer.n_gpus_per_node=2"),
        &[],
    );
    assert!(
        stderr(&o).contains("arm a (`fsdp") && stderr(&o).contains("reused"),
        "{}",
        stderr(&o)
    );
    let diverged: Vec<_> = verdicts(&s).into_iter().filter(|m| m.2.is_some()).collect();
    assert!(diverged.is_empty(), "TP=2: {diverged:?}\n{}", stdout(&o));
    assert!(
        s["causes"].to_string().contains("tensor-parallel"),
        "{}",
        s["causes"]
    );
}

#[test]
fn a_changed_learning_rate_is_named_at_its_first_diverging_step_and_the_report_renders() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ab");
    let (_, s) = ab(
        &out,
        "fsdp",
        "actor_rollout_ref.actor.optim.lr=3e-3",
        &["actor_rollout_ref.actor.fsdp_config.dtype=fp32"],
    );
    let v = verdicts(&s);
    let step_of = |name: &str| {
        v.iter()
            .find(|m| m.0 == name)
            .unwrap_or_else(|| panic!("{name}: {v:?}"))
            .2
    };
    // The warm-up's first step has LR 0 in both arms: the LRs part at step 2, the update of step
    // 2 changes the policy, and step 3's samples, scores and loss part.
    assert_eq!(step_of("actor/lr"), Some(2));
    assert_eq!(step_of("critic/score/mean"), Some(3));
    assert_eq!(step_of("actor/pg_loss"), Some(3));
    assert!(s["summary"].as_str().unwrap().contains("diverged at step"));

    // The report in a real browser: the charts are drawn (both arms' colours cover pixels), the
    // divergence is marked.
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(
        html.contains("diverged at step 3") && !html.contains("http://")
            || html.contains("xmlns=\"http://www.w3.org/2000/svg\"")
    );
    let png = tmp.path().join("report.png");
    let chromium = ["chromium", "chromium-browser"]
        .into_iter()
        .find(|c| {
            std::process::Command::new(c)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .expect("headless Chromium is installed by `make test` (scripts/setup.sh --tests)");
    let o = std::process::Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1400,2600",
            &format!("--screenshot={}", png.display()),
            &format!("file://{}", out.join("report.html").display()),
        ])
        .output()
        .unwrap();
    assert!(png.exists(), "chromium wrote no screenshot: {}", stderr(&o));
    let (w, h, rgb) = decode_png(&png);
    let near = |c: [u8; 3], t: [u8; 3]| {
        c.iter()
            .zip(t)
            .all(|(a, b)| (*a as i32 - b as i32).abs() <= 12)
    };
    let count = |t: [u8; 3]| rgb.iter().filter(|c| near(**c, t)).count();
    let (blue, orange, red) = (
        count([0x1f, 0x77, 0xb4]),
        count([0xff, 0x7f, 0x0e]),
        count([0xc0, 0x39, 0x2b]),
    );
    // Lines of ~2.5 px over dozens of charts: thousands of pixels of each arm's colour.
    assert!(
        blue > 2000 && orange > 2000,
        "{w}x{h}: arm a {blue} px, arm b {orange} px"
    );
    assert!(red > 200, "divergence marks and verdicts: {red} px");
    // Most of the page is background, not one flat colour: a rendered page.
    let white = count([255, 255, 255]);
    assert!(
        white < rgb.len() * 98 / 100,
        "{white} of {} pixels white",
        rgb.len()
    );
}

fn decode_png(path: &Path) -> (u32, u32, Vec<[u8; 3]>) {
    let decoder = png::Decoder::new(std::fs::File::open(path).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let px = match info.color_type {
        png::ColorType::Rgba => 4,
        png::ColorType::Rgb => 3,
        other => panic!("unexpected PNG colour type {other:?}"),
    };
    let rgb = buf[..info.buffer_size()]
        .chunks(px)
        .map(|c| [c[0], c[1], c[2]])
        .collect();
    (info.width, info.height, rgb)
}
