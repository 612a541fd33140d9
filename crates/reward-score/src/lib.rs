//! verl-reward-score: verl 0.9.1's rule reward scorers (`verl.utils.reward_score`: gsm8k,
//! hendrycks MATH, math_dapo) as plain functions, text in and score out, bit-for-bit verl's.
//! `default_compute_score` routes a sample to its scorer by `data_source` and shapes the result
//! (plain score, or score plus extra metrics).
//!
//! Shared by the `rewards` plugin and the gsm8k tool of the `tools` plugin. It must not know about
//! the plugin ABI, batches or tokens, and must never link libtorch.

pub mod gsm8k;
pub mod math_dapo;
pub mod math_reward;
pub mod pystr;

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde_json::Value;

/// Every way scoring can fail. Messages name the offending key or data source, what was expected
/// and what was found.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RewardError {
    /// verl raises `NotImplementedError` for these; so do we.
    #[error(
        "reward function is not implemented for data_source={data_source:?}: expected one of \
         {known}, or a name starting with \"aime\""
    )]
    UnknownDataSource { data_source: String, known: String },
    /// verl routes this data source to a scorer that this crate does not port (it needs a code
    /// sandbox, sympy, or similar).
    #[error(
        "data_source={data_source:?} is routed by verl to reward_score.{scorer}, which \
         verl-rewards does not implement ({reason})"
    )]
    UnsupportedScorer {
        data_source: String,
        scorer: &'static str,
        reason: &'static str,
    },
    /// A reward option (e.g. from `reward_model.reward_kwargs`) has the wrong type or value.
    #[error("invalid reward option `{key}`: expected {expected}, found {found}")]
    InvalidOption {
        key: String,
        expected: &'static str,
        found: String,
    },
}

/// How gsm8k finds the answer in the solution text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Gsm8kMethod {
    /// The number after the last `#### ` marker (commas stripped).
    #[default]
    Strict,
    /// The last number-like token anywhere (commas kept).
    Flexible,
}

impl Gsm8kMethod {
    pub fn as_str(self) -> &'static str {
        match self {
            Gsm8kMethod::Strict => "strict",
            Gsm8kMethod::Flexible => "flexible",
        }
    }
}

impl fmt::Display for Gsm8kMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Gsm8kMethod {
    type Err = RewardError;
    fn from_str(s: &str) -> Result<Self, RewardError> {
        match s {
            "strict" => Ok(Gsm8kMethod::Strict),
            "flexible" => Ok(Gsm8kMethod::Flexible),
            other => Err(RewardError::InvalidOption {
                key: "method".into(),
                expected: "\"strict\" or \"flexible\"",
                found: format!("{other:?}"),
            }),
        }
    }
}

/// Keyword arguments of the individual scorers. The defaults are verl's defaults, which is what
/// `default_compute_score` uses (it passes none of them).
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreOptions {
    /// gsm8k: answer extraction.
    pub gsm8k_method: Gsm8kMethod,
    /// gsm8k: reward for a well-formed but wrong answer.
    pub format_score: f64,
    /// gsm8k: reward for a correct answer.
    pub score: f64,
    /// math_dapo: compare the raw last `\boxed{}` instead of the Minerva `Answer:` line.
    pub strict_box_verify: bool,
    /// math_dapo strict-box: character indices of the four pause tokens; the window ends at the
    /// last one.
    pub pause_tokens_index: Option<[i64; 4]>,
}

impl Default for ScoreOptions {
    fn default() -> Self {
        ScoreOptions {
            gsm8k_method: Gsm8kMethod::Strict,
            format_score: 0.0,
            score: 1.0,
            strict_box_verify: false,
            pause_tokens_index: None,
        }
    }
}

impl ScoreOptions {
    /// Reads options from a JSON object using verl's keyword names (`method`, `format_score`,
    /// `score`, `strict_box_verify`, `pause_tokens_index`); absent keys keep their defaults and
    /// unknown keys are rejected so a typo cannot silently change rewards.
    pub fn from_json(value: &Value) -> Result<Self, RewardError> {
        let obj = value
            .as_object()
            .ok_or_else(|| RewardError::InvalidOption {
                key: "<reward options>".into(),
                expected: "a JSON object",
                found: json_kind(value),
            })?;
        let mut opts = ScoreOptions::default();
        for (key, v) in obj {
            let bad = |expected: &'static str| RewardError::InvalidOption {
                key: key.clone(),
                expected,
                found: v.to_string(),
            };
            match key.as_str() {
                "method" => {
                    opts.gsm8k_method = v.as_str().ok_or_else(|| bad("a string"))?.parse()?;
                }
                "format_score" => opts.format_score = v.as_f64().ok_or_else(|| bad("a number"))?,
                "score" => opts.score = v.as_f64().ok_or_else(|| bad("a number"))?,
                "strict_box_verify" => {
                    opts.strict_box_verify = v.as_bool().ok_or_else(|| bad("a boolean"))?;
                }
                "pause_tokens_index" => {
                    const EXPECTED: &str = "null or a list of exactly 4 integers";
                    opts.pause_tokens_index = match v {
                        Value::Null => None,
                        Value::Array(items) if items.len() == 4 => {
                            let mut idx = [0i64; 4];
                            for (slot, item) in idx.iter_mut().zip(items) {
                                *slot = item.as_i64().ok_or_else(|| bad(EXPECTED))?;
                            }
                            Some(idx)
                        }
                        _ => return Err(bad(EXPECTED)),
                    };
                }
                _ => {
                    return Err(RewardError::InvalidOption {
                        key: key.clone(),
                        expected: "one of method, format_score, score, strict_box_verify, \
                                   pause_tokens_index",
                        found: "an unknown key".into(),
                    })
                }
            }
        }
        Ok(opts)
    }
}

fn json_kind(v: &Value) -> String {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
    .to_string()
}

/// A score plus the extra values verl's scorer returned alongside it (math_dapo: `acc` as a JSON
/// boolean, `pred` as a string or null). Empty for scorers that return a bare number.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ScoreOutput {
    pub score: f64,
    pub extra: BTreeMap<String, Value>,
}

impl ScoreOutput {
    fn plain(score: f64) -> Self {
        ScoreOutput {
            score,
            extra: BTreeMap::new(),
        }
    }

    /// An extra value as a metric: numbers as they are, booleans as 1.0 / 0.0 (how verl's
    /// `np.mean` over `reward_extra_info` treats them); None for strings, null or absent keys.
    pub fn metric(&self, key: &str) -> Option<f64> {
        match self.extra.get(key)? {
            Value::Bool(b) => Some(if *b { 1.0 } else { 0.0 }),
            Value::Number(n) => n.as_f64(),
            _ => None,
        }
    }
}

/// Which verl scorer module a data source is routed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scorer {
    Gsm8k,
    /// Hendrycks MATH (`math_reward`).
    Math,
    MathDapo,
    PrimeMath,
    PrimeCode,
    Geo3k,
    SearchR1,
}

const GSM8K_SOURCES: &[&str] = &["openai/gsm8k"];
const MATH_SOURCES: &[&str] = &[
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
];
const MATH_DAPO_SOURCES: &[&str] = &["math_dapo", "math", "math_dapo_reasoning"];
const PRIME_MATH_SOURCES: &[&str] = &[
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
];
const CODE_SOURCES: &[&str] = &["codecontests", "apps", "codeforces", "taco"];
const GEO3K_SOURCES: &[&str] = &["hiyouga/geometry3k"];
const SEARCH_R1_SOURCES: &[&str] = &[
    "searchR1_nq",
    "searchR1_triviaqa",
    "searchR1_popqa",
    "searchR1_hotpotqa",
    "searchR1_2wikimultihopqa",
    "searchR1_musique",
    "searchR1_bamboogle",
];

impl Scorer {
    /// verl's routing, in verl's order (the order matters only for "math", which is math_dapo,
    /// not hendrycks MATH).
    pub fn for_data_source(data_source: &str) -> Result<Scorer, RewardError> {
        let is = |list: &[&str]| list.contains(&data_source);
        if is(GSM8K_SOURCES) {
            Ok(Scorer::Gsm8k)
        } else if is(MATH_SOURCES) {
            Ok(Scorer::Math)
        } else if is(MATH_DAPO_SOURCES) || data_source.starts_with("aime") {
            Ok(Scorer::MathDapo)
        } else if is(PRIME_MATH_SOURCES) {
            Ok(Scorer::PrimeMath)
        } else if is(CODE_SOURCES) {
            Ok(Scorer::PrimeCode)
        } else if is(GEO3K_SOURCES) {
            Ok(Scorer::Geo3k)
        } else if is(SEARCH_R1_SOURCES) {
            Ok(Scorer::SearchR1)
        } else {
            let known: Vec<&str> = [
                GSM8K_SOURCES,
                MATH_SOURCES,
                MATH_DAPO_SOURCES,
                PRIME_MATH_SOURCES,
                CODE_SOURCES,
                GEO3K_SOURCES,
                SEARCH_R1_SOURCES,
            ]
            .concat();
            Err(RewardError::UnknownDataSource {
                data_source: data_source.to_string(),
                known: known.join(", "),
            })
        }
    }

    /// verl's module name for this scorer.
    pub fn module(self) -> &'static str {
        match self {
            Scorer::Gsm8k => "gsm8k",
            Scorer::Math => "math_reward",
            Scorer::MathDapo => "math_dapo",
            Scorer::PrimeMath => "prime_math",
            Scorer::PrimeCode => "prime_code",
            Scorer::Geo3k => "geo3k",
            Scorer::SearchR1 => "search_r1_like_qa_em",
        }
    }
}

/// Port of verl's `default_compute_score`. `extra_info` is accepted for signature parity; verl's
/// rule scorers ignore it. `opts` carries the scorers' keyword arguments (verl's defaults via
/// `ScoreOptions::default()`).
pub fn default_compute_score(
    data_source: &str,
    solution: &str,
    ground_truth: &str,
    _extra_info: Option<&Value>,
    opts: &ScoreOptions,
) -> Result<ScoreOutput, RewardError> {
    let scorer = Scorer::for_data_source(data_source)?;
    let unsupported = |reason| RewardError::UnsupportedScorer {
        data_source: data_source.to_string(),
        scorer: scorer.module(),
        reason,
    };
    match scorer {
        Scorer::Gsm8k => Ok(ScoreOutput::plain(gsm8k::compute_score(
            solution,
            ground_truth,
            opts.gsm8k_method,
            opts.format_score,
            opts.score,
        ))),
        Scorer::Math => Ok(ScoreOutput::plain(math_reward::compute_score(
            solution,
            ground_truth,
        ))),
        Scorer::MathDapo => {
            let r = math_dapo::compute_score(
                solution,
                ground_truth,
                opts.strict_box_verify,
                opts.pause_tokens_index.as_ref(),
            );
            let mut extra = BTreeMap::new();
            extra.insert("acc".to_string(), Value::Bool(r.acc));
            extra.insert(
                "pred".to_string(),
                r.pred.map_or(Value::Null, Value::String),
            );
            Ok(ScoreOutput {
                score: r.score,
                extra,
            })
        }
        Scorer::PrimeMath => Err(unsupported("it needs sympy-based symbolic equivalence")),
        Scorer::PrimeCode => Err(unsupported("it needs a code-execution sandbox")),
        Scorer::Geo3k => Err(unsupported("it needs mathruler's sympy-based grader")),
        Scorer::SearchR1 => Err(unsupported("not ported yet")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn score(ds: &str, sol: &str, gt: &str) -> Result<ScoreOutput, RewardError> {
        default_compute_score(ds, sol, gt, None, &ScoreOptions::default())
    }

    #[test]
    fn routing_matches_verl() {
        assert_eq!(Scorer::for_data_source("openai/gsm8k"), Ok(Scorer::Gsm8k));
        for ds in MATH_SOURCES {
            assert_eq!(Scorer::for_data_source(ds), Ok(Scorer::Math));
        }
        for ds in [
            "math",
            "math_dapo",
            "math_dapo_reasoning",
            "aime24",
            "aime_2025",
            "aime",
        ] {
            assert_eq!(Scorer::for_data_source(ds), Ok(Scorer::MathDapo), "{ds}");
        }
        assert_eq!(
            Scorer::for_data_source("numina_olympiads"),
            Ok(Scorer::PrimeMath)
        );
        assert_eq!(Scorer::for_data_source("taco"), Ok(Scorer::PrimeCode));
        assert_eq!(
            Scorer::for_data_source("hiyouga/geometry3k"),
            Ok(Scorer::Geo3k)
        );
        assert_eq!(Scorer::for_data_source("searchR1_nq"), Ok(Scorer::SearchR1));
        // Exact, case-sensitive names: near misses are unknown.
        for ds in [
            "gsm8k",
            "openai/GSM8K",
            "AIME24",
            "MATH",
            " math",
            "lighteval/math",
        ] {
            assert!(
                matches!(
                    Scorer::for_data_source(ds),
                    Err(RewardError::UnknownDataSource { .. })
                ),
                "{ds}"
            );
        }
    }

    #[test]
    fn unknown_data_source_error_names_it() {
        let err = score("my/dataset", "x", "y").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("data_source=\"my/dataset\""), "{msg}");
        assert!(msg.contains("openai/gsm8k"), "{msg}");
    }

    #[test]
    fn unported_scorers_say_so() {
        let err = score("codecontests", "x", "y").unwrap_err();
        assert!(matches!(
            err,
            RewardError::UnsupportedScorer {
                scorer: "prime_code",
                ..
            }
        ));
        assert!(err.to_string().contains("codecontests"));
    }

    #[test]
    fn result_shapes() {
        let r = score("openai/gsm8k", "#### 3", "3").unwrap();
        assert_eq!(r, ScoreOutput::plain(1.0));
        let r = score("HuggingFaceH4/MATH-500", "\\boxed{3}", "3").unwrap();
        assert_eq!(r, ScoreOutput::plain(1.0));
        let r = score("aime2024", "Answer: 3", "3").unwrap();
        assert_eq!(r.score, 1.0);
        assert_eq!(r.extra["acc"], json!(true));
        assert_eq!(r.extra["pred"], json!("3"));
        assert_eq!(r.metric("acc"), Some(1.0));
        assert_eq!(r.metric("pred"), None);
        let r = score("math", "Answer: 4", "3").unwrap();
        assert_eq!((r.score, r.metric("acc")), (-1.0, Some(0.0)));
    }

    #[test]
    fn options_change_gsm8k() {
        let opts = ScoreOptions {
            gsm8k_method: Gsm8kMethod::Flexible,
            format_score: 0.1,
            score: 2.0,
            ..ScoreOptions::default()
        };
        let s = |sol: &str| {
            default_compute_score("openai/gsm8k", sol, "5", None, &opts)
                .unwrap()
                .score
        };
        assert_eq!(s("so 5"), 2.0);
        assert_eq!(s("so 6"), 0.1);
        assert_eq!(s("none"), 0.0);
    }

    #[test]
    fn options_from_json() {
        let o = ScoreOptions::from_json(&json!({
            "method": "flexible", "format_score": 0.1, "score": 1,
            "strict_box_verify": true, "pause_tokens_index": [1, 2, 3, 4]
        }))
        .unwrap();
        assert_eq!(o.gsm8k_method, Gsm8kMethod::Flexible);
        assert_eq!((o.format_score, o.score), (0.1, 1.0));
        assert!(o.strict_box_verify);
        assert_eq!(o.pause_tokens_index, Some([1, 2, 3, 4]));
        assert_eq!(
            ScoreOptions::from_json(&json!({})).unwrap(),
            ScoreOptions::default()
        );

        let err = ScoreOptions::from_json(&json!({"method": "loose"})).unwrap_err();
        assert!(err.to_string().contains("\"loose\""), "{err}");
        let err = ScoreOptions::from_json(&json!({"pause_tokens_index": [1, 2]})).unwrap_err();
        assert!(err.to_string().contains("pause_tokens_index"), "{err}");
        let err = ScoreOptions::from_json(&json!({"metod": "strict"})).unwrap_err();
        assert!(err.to_string().contains("metod"), "{err}");
        assert!(ScoreOptions::from_json(&json!([1])).is_err());
    }
}
