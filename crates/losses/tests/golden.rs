//! Parity with verl 0.9.1 on `golden/verl_core_algos.json` (float64): every case of the functions this crate
//! owns is run, and every output must match within 1e-6 relative.

mod common;

use std::collections::BTreeMap;

use serde_json::Value;
use tch::Tensor;
use verl_losses::{
    agg_loss, entropy_from_logits, value_loss, ActorLossConfig, AggSpec, KlPenalty, LossAggMode,
    Normaliser, PolicyInputs, PolicyLoss, PolicyLossSection, ValueInputs,
};

use common::{max_rel_err, shared_path, tensor_f64, to_vec};

const OURS: [&str; 5] = [
    "policy_loss",
    "agg_loss",
    "value_loss",
    "entropy_from_logits",
    "kl_penalty",
];
const REL_TOL: f64 = 1e-6;
const ABS_FLOOR: f64 = 1e-9;

fn input<'a>(case: &'a Value, key: &str) -> &'a Value {
    case["inputs"]
        .get(key)
        .unwrap_or_else(|| panic!("case {} has no input {key:?}", case["fn"]))
}

fn param_str<'a>(case: &'a Value, key: &str) -> &'a str {
    case["params"][key]
        .as_str()
        .unwrap_or_else(|| panic!("case {} has no string param {key:?}", case["fn"]))
}

fn param_f64(case: &Value, key: &str) -> Option<f64> {
    case["params"].get(key).and_then(Value::as_f64)
}

/// Runs one case and returns its outputs under the golden file's names.
fn run(case: &Value) -> BTreeMap<String, Vec<f64>> {
    let f = case["fn"].as_str().expect("fn is a string");
    let scalar = |t: &Tensor| vec![t.double_value(&[])];
    let mut out = BTreeMap::new();
    match f {
        "kl_penalty" => {
            let p =
                KlPenalty::parse("kl_penalty", param_str(case, "kl_penalty")).expect("known name");
            let kl = p
                .compute(
                    &tensor_f64(input(case, "logprob")),
                    &tensor_f64(input(case, "ref_logprob")),
                )
                .expect("kl_penalty");
            out.insert("kl".into(), to_vec(&kl));
        }
        "agg_loss" => {
            let mode = LossAggMode::parse("loss_agg_mode", param_str(case, "loss_agg_mode"))
                .expect("mode");
            let spec = AggSpec {
                mode,
                loss_scale_factor: param_f64(case, "loss_scale_factor"),
            };
            let loss = agg_loss(
                &tensor_f64(input(case, "loss_mat")),
                &tensor_f64(input(case, "loss_mask")),
                spec,
                &Normaliser::Local,
            )
            .expect("agg_loss");
            out.insert("loss".into(), scalar(&loss));
        }
        "policy_loss" => {
            let mut cfg = ActorLossConfig {
                policy_loss: PolicyLossSection {
                    loss_mode: param_str(case, "loss_mode").to_string(),
                },
                ..ActorLossConfig::default()
            };
            cfg.clip_ratio_low = param_f64(case, "clip_ratio_low").or(cfg.clip_ratio_low);
            cfg.clip_ratio_high = param_f64(case, "clip_ratio_high").or(cfg.clip_ratio_high);
            cfg.clip_ratio_c = param_f64(case, "clip_ratio_c").unwrap_or(cfg.clip_ratio_c);
            cfg.tau_pos = param_f64(case, "tau_pos").unwrap_or(cfg.tau_pos);
            cfg.tau_neg = param_f64(case, "tau_neg").unwrap_or(cfg.tau_neg);
            let loss = PolicyLoss::from_config(&cfg).expect("policy loss config");
            let mode = LossAggMode::parse("loss_agg_mode", param_str(case, "loss_agg_mode"))
                .expect("mode");
            let (old, lp, adv, mask) = (
                tensor_f64(input(case, "old_log_prob")),
                tensor_f64(input(case, "log_prob")).set_requires_grad(true),
                tensor_f64(input(case, "advantages")),
                tensor_f64(input(case, "response_mask")),
            );
            let weights = case["inputs"].get("rollout_is_weights").map(tensor_f64);
            let o = loss
                .compute(
                    &PolicyInputs {
                        old_log_prob: &old,
                        log_prob: &lp,
                        advantages: &adv,
                        response_mask: &mask,
                        rollout_is_weights: weights.as_ref(),
                    },
                    AggSpec::new(mode),
                    &Normaliser::Local,
                )
                .expect("policy loss");
            out.insert("pg_loss".into(), vec![o.metrics.pg_loss]);
            out.insert(
                "pg_clipfrac".into(),
                o.metrics.pg_clipfrac.into_iter().collect(),
            );
            out.insert(
                "pg_clipfrac_lower".into(),
                o.metrics.pg_clipfrac_lower.into_iter().collect(),
            );
            out.insert("ppo_kl".into(), o.metrics.ppo_kl.into_iter().collect());
            // The differentiable loss and the logged metric are the same number.
            assert_eq!(o.loss.double_value(&[]), o.metrics.pg_loss);
            o.loss.backward();
            out.insert("grad_log_prob".into(), to_vec(&lp.grad()));
        }
        "value_loss" => {
            let mode = LossAggMode::parse("loss_agg_mode", param_str(case, "loss_agg_mode"))
                .expect("mode");
            let (vpreds, returns, values, mask) = (
                tensor_f64(input(case, "vpreds")),
                tensor_f64(input(case, "returns")),
                tensor_f64(input(case, "values")),
                tensor_f64(input(case, "response_mask")),
            );
            let o = value_loss(
                &ValueInputs {
                    vpreds: &vpreds,
                    returns: &returns,
                    values: &values,
                    response_mask: &mask,
                },
                param_f64(case, "cliprange_value").expect("cliprange_value"),
                AggSpec::new(mode),
                &Normaliser::Local,
            )
            .expect("value loss");
            out.insert("vf_loss".into(), vec![o.metrics.vf_loss]);
            out.insert("vf_clipfrac".into(), vec![o.metrics.vf_clipfrac]);
        }
        "entropy_from_logits" => {
            let e = entropy_from_logits(&tensor_f64(input(case, "logits"))).expect("entropy");
            out.insert("entropy".into(), to_vec(&e));
        }
        other => panic!("not one of ours: {other}"),
    }
    out
}

fn flat(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(a) => a.iter().flat_map(flat).collect(),
        other => vec![other.as_f64().expect("numeric output")],
    }
}

/// Runs every case of `cases` whose `fn` is one of `ours` against the recorded outputs. Returns how
/// many cases each fn has and how many ran; panics listing every mismatch.
fn check_cases(
    cases: &[Value],
    ours: &[&'static str],
) -> (BTreeMap<&'static str, usize>, BTreeMap<&'static str, usize>) {
    let mut expected: BTreeMap<&str, usize> = ours.iter().map(|f| (*f, 0)).collect();
    let mut ran: BTreeMap<&str, usize> = ours.iter().map(|f| (*f, 0)).collect();
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let f = case["fn"].as_str().unwrap_or("");
        let Some(count) = expected.get_mut(f) else {
            continue;
        };
        *count += 1;
        let got = run(case);
        let want = case["outputs"].as_object().expect("outputs is an object");
        for (name, value) in want {
            let want = flat(value);
            match got.get(name) {
                None => failures.push(format!(
                    "case {i} ({f} {}): output {name:?} not produced",
                    case["params"]
                )),
                Some(g) => {
                    if g.len() != want.len() {
                        failures.push(format!(
                            "case {i} ({f}): {name} has {} values, want {}",
                            g.len(),
                            want.len()
                        ));
                        continue;
                    }
                    let err = max_rel_err(g, &want, ABS_FLOOR);
                    if err > REL_TOL {
                        failures.push(format!(
                            "case {i} ({f} {}): {name} rel err {err:.3e}: got {g:?}, want {want:?}",
                            case["params"]
                        ));
                    }
                }
            }
        }
        *ran.get_mut(f).expect("counted above") += 1;
    }
    eprintln!("golden cases run per fn: {ran:?}");
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
    (expected, ran)
}

#[test]
fn every_owned_golden_case_matches_verl() {
    // Absent: a skip, or a failure under VERL_REQUIRE_SHARED=1 (CI).
    let Some(path) = shared_path("golden/verl_core_algos.json") else {
        return;
    };
    let text = std::fs::read_to_string(&path).expect("read golden file");
    let doc: Value = serde_json::from_str(&text).expect("golden file is JSON");
    let cases = doc["cases"].as_array().expect("`cases` is an array");
    let (expected, ran) = check_cases(cases, &OURS);
    for f in OURS {
        assert!(
            expected[f] > 0,
            "the golden file has no {f} case: it changed shape, this test would prove nothing"
        );
        assert_eq!(ran[f], expected[f], "not every {f} case was run");
    }
    let total: usize = ran.values().sum();
    assert_eq!(
        total, 48,
        "expected 48 owned cases in verl_core_algos.json (84 in all), ran {total}"
    );
}

/// verl's `geo_mean`, `dppo_tv` and `dppo_kl` losses on `tests/data/verl_policy_losses.json`
/// (written by `scripts/golden_policy_losses.py` from verl's own core_algos.py, float64): the loss,
/// its three metrics and the gradient with respect to `log_prob`, for every aggregation mode,
/// tight and loose trust regions, a truncation that bites, and rollout importance weights.
#[test]
fn gmpo_and_dppo_match_verl_with_their_gradients() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/verl_policy_losses.json");
    let text = std::fs::read_to_string(&path).expect("read tests/data/verl_policy_losses.json");
    let doc: Value = serde_json::from_str(&text).expect("golden file is JSON");
    let cases = doc["cases"].as_array().expect("`cases` is an array");
    let (_, ran) = check_cases(cases, &["policy_loss"]);
    let mut modes: BTreeMap<&str, usize> = BTreeMap::new();
    for case in cases {
        assert!(
            case["outputs"].get("grad_log_prob").is_some(),
            "every case carries verl's gradient"
        );
        *modes.entry(param_str(case, "loss_mode")).or_default() += 1;
    }
    assert_eq!(ran["policy_loss"], 24, "{modes:?}");
    assert_eq!(
        modes,
        BTreeMap::from([("dppo_kl", 8), ("dppo_tv", 8), ("geo_mean", 8)])
    );
}
