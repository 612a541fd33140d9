//! Golden parity with verl 0.9.1: every case of `golden/verl_core_algos.json` whose `fn` this crate owns is
//! recomputed and compared output by output, element by element, within 1e-6 relative.
//!
//! The file lives in the shared reference directory (`$VERL_SHARED_DIR`, else `<workspace>/../shared`); when it
//! is absent the test prints why and passes, since the repository must build without it (with
//! `VERL_REQUIRE_SHARED=1`, as in CI, it fails instead).
//!
//! `golden/seqlen_balancing.json` (in this crate, written by `golden/gen_seqlen_balancing.py` from verl's own
//! `seqlen_balancing.py`) holds the sequence-length balancing cases; those compare exactly: partitions index
//! for index, metrics bit for bit, and verl's assertion failures as errors.

use std::collections::BTreeMap;

use serde_json::Value;
use verl_algos::{
    balance_batch, calculate_workload, compute_advantage, get_group_balanced_partitions,
    get_seqlen_balanced_partitions, karmarkar_karp, kl_penalty, log_seqlen_unbalance,
    masked_whiten, AdvantageEstimator, AdvantageInputs, AdvantageParams, Grid, Groups, KlPenalty,
};

/// The `fn` values of the golden file this crate is responsible for. The others (policy/value losses, loss
/// aggregation, entropy) are checked by the losses plugin.
const OWNED_FNS: &[&str] = &[
    "grpo",
    "rloo",
    "opo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "gpg",
    "gae",
    "kl_penalty",
    "masked_whiten",
];

const REL_TOL: f64 = 1e-6;
/// Lets an exact zero in the reference match a result that is zero up to rounding.
const ABS_FLOOR: f64 = 1e-12;

/// The shared reference data, one helper for every crate's tests (std only, included by path):
/// skipped when absent, a failure under `VERL_REQUIRE_SHARED=1` (CI).
#[allow(dead_code)]
#[path = "../../../crates/test-support/src/shared.rs"]
mod shared;

type Outputs = BTreeMap<String, Grid<f64>>;

fn grid(value: &Value, what: &str) -> Result<Grid<f64>, String> {
    let rows = value
        .as_array()
        .ok_or_else(|| format!("`{what}` is not an array of rows"))?;
    let rows: Vec<Vec<f64>> = rows
        .iter()
        .enumerate()
        .map(|(r, row)| {
            row.as_array()
                .ok_or_else(|| format!("`{what}[{r}]` is not an array"))?
                .iter()
                .enumerate()
                .map(|(c, x)| {
                    x.as_f64()
                        .ok_or_else(|| format!("`{what}[{r}][{c}]` is not a number: {x}"))
                })
                .collect()
        })
        .collect::<Result<_, _>>()?;
    Grid::from_rows(&rows).map_err(|e| format!("`{what}`: {e}"))
}

fn vector(value: &Value, what: &str) -> Result<Vec<f64>, String> {
    value
        .as_array()
        .ok_or_else(|| format!("`{what}` is not an array"))?
        .iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_f64()
                .ok_or_else(|| format!("`{what}[{i}]` is not a number: {x}"))
        })
        .collect()
}

struct Case<'a> {
    fn_name: &'a str,
    params: &'a serde_json::Map<String, Value>,
    inputs: &'a serde_json::Map<String, Value>,
}

impl Case<'_> {
    fn input(&self, key: &str) -> Result<Grid<f64>, String> {
        grid(
            self.inputs
                .get(key)
                .ok_or_else(|| format!("missing input `{key}`"))?,
            key,
        )
    }

    fn f64_param(&self, key: &str) -> Result<f64, String> {
        self.params
            .get(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("missing numeric param `{key}`"))
    }

    /// Fails on any param the case sets that this test does not route, so no setting is silently ignored.
    fn only_params(&self, known: &[&str]) -> Result<(), String> {
        match self.params.keys().find(|k| !known.contains(&k.as_str())) {
            Some(k) => Err(format!(
                "param `{k}` is not routed by this test (known: {known:?})"
            )),
            None => Ok(()),
        }
    }

    fn groups(&self) -> Result<Groups, String> {
        let index = self
            .inputs
            .get("index")
            .and_then(Value::as_array)
            .ok_or("missing input `index`")?;
        // Integer and string uids are both plain keys; their JSON text is a faithful one.
        let keys: Vec<String> = index.iter().map(Value::to_string).collect();
        Ok(Groups::from_keys(&keys))
    }

    fn run(&self) -> Result<Outputs, String> {
        let pair = |out: verl_algos::Advantages| {
            Outputs::from([
                ("advantages".to_owned(), out.advantages),
                ("returns".to_owned(), out.returns),
            ])
        };
        match self.fn_name {
            "kl_penalty" => {
                self.only_params(&["kl_penalty"])?;
                let name = self
                    .params
                    .get("kl_penalty")
                    .and_then(Value::as_str)
                    .ok_or("missing `kl_penalty`")?;
                let penalty: KlPenalty = name.parse().map_err(|e| format!("{e}"))?;
                let kl = kl_penalty(
                    &self.input("logprob")?,
                    &self.input("ref_logprob")?,
                    penalty,
                )
                .map_err(|e| e.to_string())?;
                Ok(Outputs::from([("kl".to_owned(), kl)]))
            }
            "masked_whiten" => {
                self.only_params(&["shift_mean"])?;
                let shift_mean = self
                    .params
                    .get("shift_mean")
                    .map_or(Some(true), Value::as_bool)
                    .ok_or("bad `shift_mean`")?;
                let w = masked_whiten(&self.input("values")?, &self.input("mask")?, shift_mean)
                    .map_err(|e| e.to_string())?;
                Ok(Outputs::from([("whitened".to_owned(), w)]))
            }
            name => {
                let estimator: AdvantageEstimator = name.parse().map_err(|e| format!("{e}"))?;
                let mut params = AdvantageParams::default();
                match estimator {
                    AdvantageEstimator::Gae => {
                        self.only_params(&["gamma", "lam"])?;
                        params.gamma = self.f64_param("gamma")?;
                        params.lam = self.f64_param("lam")?;
                    }
                    AdvantageEstimator::Grpo => {
                        self.only_params(&["norm_adv_by_std_in_grpo", "epsilon"])?;
                        params.epsilon = self.f64_param("epsilon")?;
                        params.norm_adv_by_std_in_grpo = self
                            .params
                            .get("norm_adv_by_std_in_grpo")
                            .and_then(Value::as_bool)
                            .ok_or("missing `norm_adv_by_std_in_grpo`")?;
                    }
                    AdvantageEstimator::ReinforcePlusPlus => {
                        self.only_params(&["gamma"])?;
                        params.gamma = self.f64_param("gamma")?;
                    }
                    // verl overwrites GPG's `alpha` argument with batch size / non-zero count, so it has no
                    // effect and is not a parameter here.
                    AdvantageEstimator::Gpg => {
                        self.only_params(&["f_norm", "alpha"])?;
                        params.f_norm = self.f64_param("f_norm")?;
                    }
                    _ => self.only_params(&[])?,
                }
                let rewards = self.input("token_level_rewards")?;
                let mask = self.input("response_mask")?;
                let values = self
                    .inputs
                    .get("values")
                    .map(|v| grid(v, "values"))
                    .transpose()?;
                let groups = self
                    .inputs
                    .get("index")
                    .map(|_| self.groups())
                    .transpose()?;
                let baselines = self
                    .inputs
                    .get("reward_baselines")
                    .map(|v| vector(v, "reward_baselines"))
                    .transpose()?;
                let mut inputs = AdvantageInputs::new(&rewards, &mask);
                if let Some(v) = &values {
                    inputs = inputs.with_values(v);
                }
                if let Some(g) = &groups {
                    inputs = inputs.with_index(g);
                }
                if let Some(b) = &baselines {
                    inputs = inputs.with_reward_baselines(b);
                }
                compute_advantage(estimator, &inputs, &params)
                    .map(pair)
                    .map_err(|e| e.to_string())
            }
        }
    }
}

/// `|a − e| ≤ 1e-6·|e| + 1e-12`; a NaN on either side fails.
fn within_tolerance(actual: f64, expected: f64) -> bool {
    let diff = (actual - expected).abs();
    diff.is_finite() && diff <= REL_TOL * expected.abs() + ABS_FLOOR
}

/// Compares every expected output; returns one line per mismatch.
fn compare(label: &str, expected: &serde_json::Map<String, Value>, got: &Outputs) -> Vec<String> {
    let mut failures = Vec::new();
    for (key, value) in expected {
        let Some(actual) = got.get(key) else {
            failures.push(format!(
                "{label}: output `{key}` is expected but not produced"
            ));
            continue;
        };
        let expected = match grid(value, key) {
            Ok(g) => g,
            Err(e) => {
                failures.push(format!("{label}: {e}"));
                continue;
            }
        };
        if expected.shape() != actual.shape() {
            failures.push(format!(
                "{label}: `{key}` has shape {:?}, expected {:?}",
                actual.shape(),
                expected.shape()
            ));
            continue;
        }
        let bad: Vec<String> = actual
            .as_slice()
            .iter()
            .zip(expected.as_slice())
            .enumerate()
            .filter(|(_, (&a, &e))| !within_tolerance(a, e))
            .map(|(i, (&a, &e))| {
                let (r, c) = (i / expected.cols(), i % expected.cols());
                format!(
                    "{label}: `{key}`[{r}][{c}] = {a:e}, expected {e:e} (diff {:e})",
                    a - e
                )
            })
            .collect();
        // The first few mismatches of each output locate a bug; hundreds would bury the other outputs.
        const SHOWN: usize = 3;
        if bad.len() > SHOWN {
            let more = format!(
                "{label}: `{key}`: … and {} more mismatching elements",
                bad.len() - SHOWN
            );
            failures.extend(bad.into_iter().take(SHOWN).chain([more]));
        } else {
            failures.extend(bad);
        }
    }
    failures
}

#[test]
fn every_owned_golden_case_matches_verl() {
    let Some(path) = shared::shared_path("golden/verl_core_algos.json") else {
        return;
    };
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: cannot read: {e}", path.display()));
    let doc: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{}: invalid JSON: {e}", path.display()));
    let cases = doc["cases"]
        .as_array()
        .unwrap_or_else(|| panic!("{}: no `cases` array", path.display()));

    let mut expected_per_fn: BTreeMap<&str, usize> = BTreeMap::new();
    let mut ran_per_fn: BTreeMap<&str, usize> = BTreeMap::new();
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let fn_name = case["fn"]
            .as_str()
            .unwrap_or_else(|| panic!("case {i}: no `fn` string"));
        if !OWNED_FNS.contains(&fn_name) {
            continue;
        }
        *expected_per_fn.entry(fn_name).or_default() += 1;
        let empty = serde_json::Map::new();
        let params = case["params"].as_object().unwrap_or(&empty);
        let label = format!("case {i} ({fn_name} {})", Value::Object(params.clone()));
        let (Some(inputs), Some(outputs)) =
            (case["inputs"].as_object(), case["outputs"].as_object())
        else {
            failures.push(format!("{label}: missing `inputs` or `outputs` object"));
            continue;
        };
        match (Case {
            fn_name,
            params,
            inputs,
        })
        .run()
        {
            Ok(got) => {
                *ran_per_fn.entry(fn_name).or_default() += 1;
                failures.extend(compare(&label, outputs, &got));
            }
            Err(e) => failures.push(format!("{label}: could not run: {e}")),
        }
    }

    let ran: usize = ran_per_fn.values().sum();
    let expected: usize = expected_per_fn.values().sum();
    println!(
        "golden: ran {ran} of {expected} owned cases from {}: {ran_per_fn:?}",
        path.display()
    );
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        expected > 0,
        "{}: holds no case for any of {OWNED_FNS:?}",
        path.display()
    );
    assert_eq!(ran_per_fn, expected_per_fn, "some owned cases were not run");
    for fn_name in OWNED_FNS {
        assert!(
            expected_per_fn.contains_key(fn_name),
            "{}: no case for `{fn_name}`",
            path.display()
        );
    }
}

// ---- sequence-length balancing ----------------------------------------------------------------------

const SEQLEN_BALANCING: &str = include_str!("golden/seqlen_balancing.json");

/// The verl functions `seqlen_balancing.json` exercises (`balance_batch` is `RayPPOTrainer._balance_batch`).
const BALANCING_FNS: &[&str] = &[
    "calculate_workload",
    "karmarkar_karp",
    "get_seqlen_balanced_partitions",
    "get_group_balanced_partitions",
    "log_seqlen_unbalance",
    "balance_batch",
];

/// What one balancing case produces; a field is `None` when the function does not produce it.
#[derive(Debug, Default, PartialEq)]
struct Balanced {
    workloads: Option<Vec<i64>>,
    partitions: Option<Vec<Vec<usize>>>,
    metrics: Option<Vec<(String, f64)>>,
}

fn ints<T: TryFrom<i64>>(value: &Value, what: &str) -> Result<Vec<T>, String> {
    value
        .as_array()
        .ok_or_else(|| format!("`{what}` is not an array"))?
        .iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_i64().and_then(|x| T::try_from(x).ok()).ok_or_else(|| {
                format!("`{what}[{i}]` is not an integer of the expected range: {x}")
            })
        })
        .collect()
}

fn index_lists(value: &Value, what: &str) -> Result<Vec<Vec<usize>>, String> {
    value
        .as_array()
        .ok_or_else(|| format!("`{what}` is not an array"))?
        .iter()
        .enumerate()
        .map(|(i, p)| ints(p, &format!("{what}[{i}]")))
        .collect()
}

fn strings(value: &Value, what: &str) -> Result<Vec<String>, String> {
    value
        .as_array()
        .ok_or_else(|| format!("`{what}` is not an array"))?
        .iter()
        .map(|x| x.as_str().map(str::to_owned))
        .collect::<Option<_>>()
        .ok_or_else(|| format!("`{what}` is not an array of strings"))
}

/// `[[name, value], …]` with each value the text Python printed, parsed by Rust's correctly rounded parser.
fn named_metrics(value: &Value) -> Result<Vec<(String, f64)>, String> {
    value
        .as_array()
        .ok_or("`metrics` is not an array")?
        .iter()
        .map(|pair| match pair.as_array().map(Vec::as_slice) {
            Some([Value::String(name), Value::String(text)]) => text
                .parse()
                .map(|v| (name.clone(), v))
                .map_err(|e| format!("metric `{name}`: `{text}`: {e}")),
            _ => Err(format!("metric {pair} is not a [name, value-text] pair")),
        })
        .collect()
}

struct BalancingCase<'a> {
    fn_name: &'a str,
    params: &'a Value,
    inputs: &'a Value,
}

impl BalancingCase<'_> {
    fn usize_param(&self, key: &str) -> Result<usize, String> {
        self.params[key]
            .as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| format!("missing integer param `{key}`"))
    }

    fn bool_param(&self, key: &str) -> Result<bool, String> {
        self.params[key]
            .as_bool()
            .ok_or_else(|| format!("missing bool param `{key}`"))
    }

    /// The outer error is a malformed case; the inner one is the function's own answer.
    fn run(&self) -> Result<Result<Balanced, verl_algos::AlgoError>, String> {
        let input = |key: &str| &self.inputs[key];
        Ok(match self.fn_name {
            "calculate_workload" => {
                let seqlens: Vec<i64> = ints(input("seqlens"), "seqlens")?;
                Ok(Balanced {
                    workloads: Some(seqlens.into_iter().map(calculate_workload).collect()),
                    ..Balanced::default()
                })
            }
            "karmarkar_karp" | "get_seqlen_balanced_partitions" => {
                let values: Vec<i64> = ints(input("values"), "values")?;
                let (k, equal_size) = (self.usize_param("k")?, self.bool_param("equal_size")?);
                let partition = if self.fn_name == "karmarkar_karp" {
                    karmarkar_karp
                } else {
                    get_seqlen_balanced_partitions
                };
                partition(&values, k, equal_size).map(|p| Balanced {
                    partitions: Some(p),
                    ..Balanced::default()
                })
            }
            "get_group_balanced_partitions" => {
                let seqlens: Vec<i64> = ints(input("seqlens"), "seqlens")?;
                let uids = strings(input("uids"), "uids")?;
                get_group_balanced_partitions(&seqlens, &uids, self.usize_param("k")?).map(|p| {
                    Balanced {
                        partitions: Some(p),
                        ..Balanced::default()
                    }
                })
            }
            "log_seqlen_unbalance" => {
                let seqlens: Vec<i64> = ints(input("seqlens"), "seqlens")?;
                let partitions = index_lists(input("partitions"), "partitions")?;
                let prefix = self.params["prefix"].as_str().ok_or("missing `prefix`")?;
                log_seqlen_unbalance(&seqlens, &partitions, prefix).map(|m| Balanced {
                    metrics: Some(m),
                    ..Balanced::default()
                })
            }
            "balance_batch" => {
                let seqlens: Vec<i64> = ints(input("seqlens"), "seqlens")?;
                let groups = match self.inputs.get("uids") {
                    Some(uids) => Some(Groups::from_keys(&strings(uids, "uids")?)),
                    None => None,
                };
                balance_batch(&seqlens, self.usize_param("dp_size")?, groups.as_ref()).map(|b| {
                    Balanced {
                        partitions: Some(b.ranks),
                        metrics: Some(b.metrics),
                        ..Balanced::default()
                    }
                })
            }
            other => return Err(format!("unknown fn `{other}`")),
        })
    }
}

fn expected_balanced(outputs: &Value) -> Result<Balanced, String> {
    let outputs = outputs.as_object().ok_or("`outputs` is not an object")?;
    if let Some(key) = outputs
        .keys()
        .find(|k| !["workloads", "partitions", "metrics"].contains(&k.as_str()))
    {
        return Err(format!("output `{key}` is not compared by this test"));
    }
    Ok(Balanced {
        workloads: outputs
            .get("workloads")
            .map(|w| ints(w, "workloads"))
            .transpose()?,
        partitions: outputs
            .get("partitions")
            .map(|p| index_lists(p, "partitions"))
            .transpose()?,
        metrics: outputs.get("metrics").map(named_metrics).transpose()?,
    })
}

#[test]
fn seqlen_balanced_partitions_match_verl() {
    let doc: Value = serde_json::from_str(SEQLEN_BALANCING)
        .unwrap_or_else(|e| panic!("golden/seqlen_balancing.json: invalid JSON: {e}"));
    let cases = doc["cases"]
        .as_array()
        .expect("golden/seqlen_balancing.json: no `cases` array");

    let mut ran: BTreeMap<&str, usize> = BTreeMap::new();
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let fn_name = case["fn"]
            .as_str()
            .unwrap_or_else(|| panic!("case {i}: no `fn` string"));
        let label = format!("seqlen_balancing case {i} ({fn_name} {})", case["params"]);
        let got = match (BalancingCase {
            fn_name,
            params: &case["params"],
            inputs: &case["inputs"],
        })
        .run()
        {
            Ok(got) => got,
            Err(e) => {
                failures.push(format!("{label}: could not run: {e}"));
                continue;
            }
        };
        *ran.entry(fn_name).or_default() += 1;
        match (case.get("raises"), got) {
            (Some(raised), Ok(out)) => {
                failures.push(format!("{label}: verl raised {raised}, got {out:?}"))
            }
            (Some(_), Err(_)) => {}
            (None, Err(e)) => failures.push(format!("{label}: verl succeeded, got error: {e}")),
            (None, Ok(out)) => match expected_balanced(&case["outputs"]) {
                // Metric values are compared with `==`: they come from the same integer sums and divisions.
                Ok(expected) if expected == out => {}
                Ok(expected) => failures.push(format!(
                    "{label}:\n  got      {out:?}\n  expected {expected:?}"
                )),
                Err(e) => failures.push(format!("{label}: {e}")),
            },
        }
    }

    println!(
        "seqlen_balancing golden: ran {} cases: {ran:?}",
        cases.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from verl:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    for fn_name in BALANCING_FNS {
        assert!(
            ran.contains_key(fn_name),
            "golden/seqlen_balancing.json: no case for `{fn_name}`"
        );
    }
}
