//! The numbers of two arms, metric by metric: per-step differences, the first step a metric leaves
//! the tolerance, a verdict; and the phase times side by side.

use std::collections::BTreeMap;

use serde::Serialize;

/// Metrics of one run: step → name → value.
pub type Steps = BTreeMap<u64, BTreeMap<String, f64>>;

/// What a metric name is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A number the training computes (losses, scores, KL, lengths, validation).
    Numeric,
    /// Wall-clock time of a phase (`timing_s/*`, `timing_per_token_ms/*`).
    Timing,
    /// Throughput, MFU, memory (`perf/*`).
    Perf,
}

pub fn kind_of(name: &str) -> Kind {
    if name.starts_with("timing_s/") || name.starts_with("timing_per_token_ms/") {
        Kind::Timing
    } else if name.starts_with("perf/") {
        Kind::Perf
    } else {
        Kind::Numeric
    }
}

/// Metrics whose values describe how the work was split, not what was computed: they may differ
/// between layouts without anything being wrong, so they are shown but get no verdict.
fn layout_only(name: &str) -> bool {
    name.starts_with("global_seqlen/") || name.starts_with("rollout/")
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Verdict {
    /// Every step bit for bit.
    Equal,
    /// Every step within the tolerance.
    WithinTolerance,
    /// Leaves the tolerance first at `step`.
    Diverged { step: u64 },
    /// Describes the layout (how tokens split over ranks), not a result: not judged.
    NotJudged,
}

impl Verdict {
    pub fn text(&self) -> String {
        match self {
            Verdict::Equal => "equal".into(),
            Verdict::WithinTolerance => "within tolerance".into(),
            Verdict::Diverged { step } => format!("diverged at step {step}"),
            Verdict::NotJudged => "layout, not judged".into(),
        }
    }
}

/// One metric of both arms.
#[derive(Debug, Clone, Serialize)]
pub struct MetricDiff {
    pub name: String,
    /// The steps both arms logged it, in order, with each arm's value.
    pub steps: Vec<u64>,
    pub a: Vec<f64>,
    pub b: Vec<f64>,
    pub max_abs: f64,
    pub max_rel: f64,
    #[serde(flatten)]
    pub verdict: Verdict,
}

/// `|a − b| ≤ rtol · max(|a|, |b|, floor)`: relative, with a floor so that values near zero (a
/// policy loss of whitened advantages, ±1e-9 of rounding) are compared on the scale of 0.01.
pub fn close(a: f64, b: f64, rtol: f64) -> bool {
    const FLOOR: f64 = 1e-2;
    if a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()) {
        return true;
    }
    (a - b).abs() <= rtol * a.abs().max(b.abs()).max(FLOOR)
}

/// Compares every metric of kind [`Kind::Numeric`] both arms logged.
pub fn compare(a: &Steps, b: &Steps, rtol: f64) -> Vec<MetricDiff> {
    let mut names: Vec<&String> = a
        .values()
        .flat_map(|m| m.keys())
        .filter(|n| kind_of(n) == Kind::Numeric)
        .collect();
    names.sort();
    names.dedup();
    let mut out = Vec::new();
    for name in names {
        let mut d = MetricDiff {
            name: name.clone(),
            steps: Vec::new(),
            a: Vec::new(),
            b: Vec::new(),
            max_abs: 0.0,
            max_rel: 0.0,
            verdict: Verdict::Equal,
        };
        for (step, ma) in a {
            let (Some(&va), Some(&vb)) = (ma.get(name), b.get(step).and_then(|m| m.get(name)))
            else {
                continue;
            };
            d.steps.push(*step);
            d.a.push(va);
            d.b.push(vb);
            let abs = (va - vb).abs();
            if abs.is_finite() {
                d.max_abs = d.max_abs.max(abs);
                d.max_rel = d.max_rel.max(abs / va.abs().max(vb.abs()).max(1e-12));
            }
            if layout_only(name) {
                continue;
            }
            match d.verdict {
                Verdict::Diverged { .. } => {}
                _ if !close(va, vb, rtol) => d.verdict = Verdict::Diverged { step: *step },
                Verdict::Equal if va.to_bits() != vb.to_bits() => {
                    d.verdict = Verdict::WithinTolerance
                }
                _ => {}
            }
        }
        if d.steps.is_empty() {
            continue;
        }
        if layout_only(name) {
            d.verdict = Verdict::NotJudged;
        }
        out.push(d);
    }
    out
}

/// A phase (or perf metric) of both arms: the mean over the compared steps (the first step is
/// left out when there are more, as it warms kernels and allocators up), and `b / a`.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseRow {
    pub name: String,
    pub a: f64,
    pub b: f64,
    pub ratio: f64,
}

pub fn phases(a: &Steps, b: &Steps, kind: Kind) -> Vec<PhaseRow> {
    let mean = |s: &Steps, name: &str| -> Option<f64> {
        let vals: Vec<f64> = s
            .iter()
            .filter(|(step, _)| s.len() < 2 || **step != *s.keys().next().unwrap())
            .filter_map(|(_, m)| m.get(name).copied())
            .collect();
        (!vals.is_empty()).then(|| vals.iter().sum::<f64>() / vals.len() as f64)
    };
    let mut names: Vec<&String> = a
        .values()
        .chain(b.values())
        .flat_map(|m| m.keys())
        .filter(|n| kind_of(n) == kind)
        .collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .filter_map(|n| {
            let (va, vb) = (mean(a, n)?, mean(b, n)?);
            Some(PhaseRow {
                name: n.clone(),
                a: va,
                b: vb,
                ratio: if va != 0.0 { vb / va } else { f64::NAN },
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steps(rows: &[(u64, &[(&str, f64)])]) -> Steps {
        rows.iter()
            .map(|(s, m)| (*s, m.iter().map(|(k, v)| (k.to_string(), *v)).collect()))
            .collect()
    }

    #[test]
    fn verdicts_name_the_first_step_out_of_tolerance() {
        let a = steps(&[
            (
                1,
                &[
                    ("actor/pg_loss", 0.5),
                    ("critic/score/mean", 0.25),
                    ("timing_s/gen", 1.0),
                ],
            ),
            (
                2,
                &[
                    ("actor/pg_loss", 0.4),
                    ("critic/score/mean", 0.5),
                    ("timing_s/gen", 2.0),
                ],
            ),
            (
                3,
                &[
                    ("actor/pg_loss", 0.3),
                    ("critic/score/mean", 0.75),
                    ("timing_s/gen", 4.0),
                ],
            ),
        ]);
        let b = steps(&[
            (
                1,
                &[
                    ("actor/pg_loss", 0.5),
                    ("critic/score/mean", 0.25),
                    ("timing_s/gen", 2.0),
                ],
            ),
            (
                2,
                &[
                    ("actor/pg_loss", 0.4 + 1e-9),
                    ("critic/score/mean", 0.5),
                    ("timing_s/gen", 3.0),
                ],
            ),
            (
                3,
                &[
                    ("actor/pg_loss", 0.3 + 2e-9),
                    ("critic/score/mean", 0.9),
                    ("timing_s/gen", 6.0),
                ],
            ),
        ]);
        let d = compare(&a, &b, 1e-5);
        // Timings are not numerics.
        assert_eq!(d.len(), 2);
        let by = |n: &str| d.iter().find(|m| m.name == n).unwrap();
        assert_eq!(by("actor/pg_loss").verdict, Verdict::WithinTolerance);
        assert_eq!(
            by("critic/score/mean").verdict,
            Verdict::Diverged { step: 3 }
        );
        assert!((by("critic/score/mean").max_abs - 0.15).abs() < 1e-12);
        // Bitwise the same: equal.
        assert_eq!(compare(&a, &a, 0.0)[0].verdict, Verdict::Equal);
        // Phases: the warm-up step is left out of the mean; b / a.
        let p = phases(&a, &b, Kind::Timing);
        assert_eq!(p.len(), 1);
        assert_eq!((p[0].a, p[0].b), (3.0, 4.5));
        assert!((p[0].ratio - 1.5).abs() < 1e-12);
    }

    #[test]
    fn near_zero_values_are_compared_on_a_floor() {
        assert!(close(1e-9, -1e-9, 1e-5));
        assert!(!close(1.0, 1.1, 1e-2));
        assert!(close(f64::NAN, f64::NAN, 0.0));
    }
}
