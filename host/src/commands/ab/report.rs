//! The comparison as people read it: `report.html` (one self-contained file, inline SVG, no
//! script, no network), `summary.json` and a console table.

use std::fmt::Write;

use serde_json::json;

use super::compare::{MetricDiff, PhaseRow, Verdict};
use super::ArmRun;

const COLOR_A: &str = "#1f77b4";
const COLOR_B: &str = "#ff7f0e";

pub struct Report<'a> {
    pub a: &'a ArmRun,
    pub b: &'a ArmRun,
    pub job: String,
    pub steps: u64,
    pub rtol: f64,
    pub machine: serde_json::Value,
    pub diffs: Vec<MetricDiff>,
    pub timings: Vec<PhaseRow>,
    pub perf: Vec<PhaseRow>,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn num(x: f64) -> String {
    if x.is_nan() {
        "–".into()
    } else if x == 0.0 || (x.abs() >= 1e-3 && x.abs() < 1e5) {
        let s = format!("{x:.6}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        format!("{x:.3e}")
    }
}

impl Report<'_> {
    /// Keys whose resolved values differ between the arms.
    pub fn config_diff(&self) -> Vec<(String, String, String)> {
        let (a, b) = (&self.a.config, &self.b.config);
        let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
        keys.sort();
        keys.dedup();
        keys.into_iter()
            .filter(|k| !k.starts_with("trainer.default_local_dir"))
            .filter_map(|k| {
                let (va, vb) = (a.get(k), b.get(k));
                (va != vb).then(|| {
                    (
                        k.clone(),
                        va.cloned().unwrap_or_else(|| "–".into()),
                        vb.cloned().unwrap_or_else(|| "–".into()),
                    )
                })
            })
            .collect()
    }

    fn counts(&self) -> (usize, usize, usize) {
        let mut c = (0, 0, 0);
        for d in &self.diffs {
            match d.verdict {
                Verdict::Equal => c.0 += 1,
                Verdict::WithinTolerance => c.1 += 1,
                Verdict::Diverged { .. } => c.2 += 1,
                Verdict::NotJudged => {}
            }
        }
        c
    }

    fn diverged(&self) -> Vec<&MetricDiff> {
        let mut v: Vec<&MetricDiff> = self
            .diffs
            .iter()
            .filter(|d| matches!(d.verdict, Verdict::Diverged { .. }))
            .collect();
        v.sort_by_key(|d| match d.verdict {
            Verdict::Diverged { step } => (step, d.name.clone()),
            _ => (0, d.name.clone()),
        });
        v
    }

    /// Where the arms' numbers can part, read from their configs.
    pub fn causes(&self) -> Vec<String> {
        let mut out = Vec::new();
        let cfg = |r: &ArmRun, k: &str| r.config.get(k).cloned().unwrap_or_default();
        let backend = |r: &ArmRun| r.backend["name"].as_str().unwrap_or("?").to_string();
        if backend(self.a) != backend(self.b) {
            out.push(format!(
                "the two backends ({} and {}) run the same math through different kernels \
                 (fused or unfused norms and activations, their own GEMM calls), which round \
                 differently unless both compute in fp32",
                backend(self.a),
                backend(self.b)
            ));
        }
        for r in [self.a, self.b] {
            let strat = cfg(r, "actor_rollout_ref.actor.strategy");
            let dtype = if strat.contains("megatron") {
                cfg(r, "actor_rollout_ref.actor.megatron.dtype")
            } else {
                cfg(r, "actor_rollout_ref.actor.fsdp_config.dtype")
            };
            if !(dtype.contains("32")) {
                out.push(format!(
                    "arm {} computes in {} (not fp32): its kernels' rounding differs from any \
                     other's",
                    r.name,
                    if dtype == "null" || dtype.is_empty() {
                        "bfloat16 (the default)".to_string()
                    } else {
                        dtype.trim_matches('"').to_string()
                    }
                ));
            }
            let tp = cfg(
                r,
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
            );
            if strat.contains("megatron") && tp != "1" && !tp.is_empty() {
                out.push(format!(
                    "arm {} splits each GEMM over {tp} tensor-parallel ranks: its reductions sum \
                     in another order",
                    r.name
                ));
            }
        }
        let diff = self.config_diff();
        let settings: Vec<&str> = diff
            .iter()
            .map(|(k, _, _)| k.as_str())
            .filter(|k| {
                !k.ends_with(".strategy")
                    && *k != "model_engine"
                    && !k.contains("dtype")
                    && !k.starts_with("plugins.")
            })
            .collect();
        if !settings.is_empty() {
            out.push(format!(
                "the arms differ in {} setting(s): {}",
                settings.len(),
                settings.join(", ")
            ));
        }
        out
    }

    /// The one-paragraph summary at the top.
    pub fn summary(&self) -> String {
        let (eq, within, div) = self.counts();
        let mut s = format!(
            "Arm a (`{}`) and arm b (`{}`) each ran {} step(s) of {}. Of {} metrics compared \
             (relative tolerance {}), {eq} are equal bit for bit, {within} within tolerance and {div} \
             diverged",
            self.a.spec.text,
            self.b.spec.text,
            self.steps,
            self.job,
            eq + within + div,
            num(self.rtol)
        );
        let d = self.diverged();
        if d.is_empty() {
            s.push('.');
        } else {
            let first: Vec<String> = d
                .iter()
                .take(4)
                .map(|m| format!("{} ({})", m.name, m.verdict.text()))
                .collect();
            let _ = write!(
                s,
                ": first {}{}.",
                first.join(", "),
                if d.len() > 4 { ", …" } else { "" }
            );
        }
        if let Some(step) = self.timings.iter().find(|p| p.name == "timing_s/step") {
            let _ = write!(
                s,
                " A step took {} s in arm a and {} s in arm b (b/a = {}).",
                num(step.a),
                num(step.b),
                num(step.ratio)
            );
        }
        s
    }

    pub fn summary_json(&self) -> serde_json::Value {
        let (eq, within, div) = self.counts();
        json!({
            "job": self.job,
            "steps": self.steps,
            "rtol": self.rtol,
            "summary": self.summary(),
            "counts": {"equal": eq, "within_tolerance": within, "diverged": div},
            "arms": {
                "a": {"spec": self.a.spec.text, "backend": self.a.backend, "wall_s": self.a.wall_s,
                      "checkpoint_bytes": self.a.checkpoint_bytes},
                "b": {"spec": self.b.spec.text, "backend": self.b.backend, "wall_s": self.b.wall_s,
                      "checkpoint_bytes": self.b.checkpoint_bytes},
            },
            "machine": self.machine,
            "config_diff": self.config_diff().iter().map(|(k, a, b)| json!({"key": k, "a": a, "b": b})).collect::<Vec<_>>(),
            "causes": self.causes(),
            "metrics": self.diffs.iter().map(|d| json!({
                "name": d.name, "verdict": d.verdict.text(),
                "first_diverged_step": match d.verdict { Verdict::Diverged { step } => Some(step), _ => None },
                "max_abs_diff": d.max_abs, "max_rel_diff": d.max_rel,
            })).collect::<Vec<_>>(),
            "timings": self.timings,
            "perf": self.perf,
        })
    }

    /// The console table.
    pub fn console(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{}\n", self.summary());
        let _ = writeln!(
            s,
            "{:<44} {:<24} {:>12} {:>12}",
            "metric", "verdict", "max |Δ|", "max rel Δ"
        );
        let mut rows: Vec<&MetricDiff> = self.diffs.iter().collect();
        rows.sort_by_key(|d| {
            (
                !matches!(d.verdict, Verdict::Diverged { .. }),
                d.name.clone(),
            )
        });
        for d in rows {
            let _ = writeln!(
                s,
                "{:<44} {:<24} {:>12} {:>12}",
                d.name,
                d.verdict.text(),
                num(d.max_abs),
                num(d.max_rel)
            );
        }
        let _ = writeln!(
            s,
            "\n{:<44} {:>12} {:>12} {:>8}",
            "phase / perf", "a", "b", "b/a"
        );
        for p in self.timings.iter().chain(&self.perf) {
            let _ = writeln!(
                s,
                "{:<44} {:>12} {:>12} {:>8}",
                p.name,
                num(p.a),
                num(p.b),
                num(p.ratio)
            );
        }
        s
    }

    /// One metric's chart: both arms over the steps.
    fn chart(d: &MetricDiff) -> String {
        let (w, h, pad_l, pad_r, pad_t, pad_b) = (340.0, 170.0, 56.0, 10.0, 24.0, 28.0);
        let vals: Vec<f64> =
            d.a.iter()
                .chain(&d.b)
                .copied()
                .filter(|v| v.is_finite())
                .collect();
        let (mut lo, mut hi) = vals
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &v| {
                (l.min(v), h.max(v))
            });
        if !lo.is_finite() {
            (lo, hi) = (0.0, 1.0);
        }
        if hi - lo < 1e-12 * hi.abs().max(1.0) {
            let m = hi.abs().max(1.0) * 0.05;
            lo -= m;
            hi += m;
        }
        let (s0, s1) = (
            *d.steps.first().unwrap_or(&0) as f64,
            *d.steps.last().unwrap_or(&1) as f64,
        );
        let x = |s: u64| {
            if s1 > s0 {
                pad_l + (s as f64 - s0) / (s1 - s0) * (w - pad_l - pad_r)
            } else {
                (pad_l + w - pad_r) / 2.0
            }
        };
        let y = |v: f64| pad_t + (hi - v) / (hi - lo) * (h - pad_t - pad_b);
        let line = |vals: &[f64], color: &str, dash: &str| {
            let pts: Vec<String> = d
                .steps
                .iter()
                .zip(vals)
                .filter(|(_, v)| v.is_finite())
                .map(|(s, v)| format!("{:.1},{:.1}", x(*s), y(*v)))
                .collect();
            let dots: String = pts
                .iter()
                .map(|p| {
                    let (cx, cy) = p.split_once(',').unwrap();
                    format!("<circle cx=\"{cx}\" cy=\"{cy}\" r=\"3\" fill=\"{color}\"/>")
                })
                .collect();
            format!(
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2.5\" {dash} points=\"{}\"/>{dots}",
                pts.join(" ")
            )
        };
        let verdict_color = match d.verdict {
            Verdict::Diverged { .. } => "#c0392b",
            Verdict::NotJudged => "#777",
            _ => "#1e8449",
        };
        let mut svg = format!(
            "<svg class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\">\
             <text x=\"{pad_l}\" y=\"15\" font-size=\"12\" font-weight=\"bold\">{}</text>\
             <text x=\"{}\" y=\"15\" font-size=\"11\" text-anchor=\"end\" fill=\"{verdict_color}\">{}</text>\
             <rect x=\"{pad_l}\" y=\"{pad_t}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#ccc\"/>\
             <text x=\"{}\" y=\"{}\" font-size=\"10\" text-anchor=\"end\">{}</text>\
             <text x=\"{}\" y=\"{}\" font-size=\"10\" text-anchor=\"end\">{}</text>",
            esc(&d.name),
            w - pad_r,
            esc(&d.verdict.text()),
            w - pad_l - pad_r,
            h - pad_t - pad_b,
            pad_l - 4.0,
            pad_t + 9.0,
            num(hi),
            pad_l - 4.0,
            h - pad_b,
            num(lo),
        );
        for s in &d.steps {
            let _ = write!(
                svg,
                "<text x=\"{:.1}\" y=\"{}\" font-size=\"10\" text-anchor=\"middle\">{s}</text>",
                x(*s),
                h - pad_b + 13.0
            );
        }
        if let Verdict::Diverged { step } = d.verdict {
            let _ = write!(
                svg,
                "<line x1=\"{0:.1}\" x2=\"{0:.1}\" y1=\"{pad_t}\" y2=\"{1}\" stroke=\"#c0392b\" stroke-dasharray=\"3 3\"/>",
                x(step),
                h - pad_b
            );
        }
        svg.push_str(&line(&d.a, COLOR_A, ""));
        svg.push_str(&line(&d.b, COLOR_B, "stroke-dasharray=\"6 4\""));
        svg.push_str("</svg>");
        svg
    }

    pub fn html(&self) -> String {
        let mut h = String::new();
        let _ = write!(
            h,
            "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>verl ab: {} vs {}</title>\
             <style>body{{font-family:sans-serif;margin:24px;max-width:1500px}}\
             table{{border-collapse:collapse;margin:8px 0 20px}}td,th{{border:1px solid #ddd;padding:3px 8px;font-size:13px;text-align:left}}\
             th{{background:#f4f4f4}}td.n{{text-align:right;font-family:monospace}}.charts{{display:flex;flex-wrap:wrap;gap:8px}}\
             .div{{color:#c0392b;font-weight:bold}}.ok{{color:#1e8449}}.key{{display:inline-block;width:24px;height:4px;margin:0 6px 3px 12px}}\
             p.summary{{font-size:15px;line-height:1.5;background:#f8f8f2;padding:12px;border-left:4px solid #888}}</style></head><body>",
            esc(&self.a.spec.text),
            esc(&self.b.spec.text)
        );
        let _ = write!(
            h,
            "<h1>verl ab</h1><p class=\"summary\" id=\"summary\">{}</p>\
             <p><span class=\"key\" style=\"background:{COLOR_A}\"></span>arm a: <code>{}</code>\
             <span class=\"key\" style=\"background:{COLOR_B}\"></span>arm b (dashed): <code>{}</code></p>",
            esc(&self.summary()),
            esc(&self.a.spec.text),
            esc(&self.b.spec.text)
        );
        // Identity.
        h.push_str("<h2>Identity</h2><table><tr><th></th><th>arm a</th><th>arm b</th></tr>");
        for (label, f) in [
            ("backend", "name"),
            ("version", "version"),
            ("plugin API", "api_version"),
            ("library", "path"),
        ] {
            let _ = write!(
                h,
                "<tr><th>{label}</th><td>{}</td><td>{}</td></tr>",
                esc(&show(&self.a.backend[f])),
                esc(&show(&self.b.backend[f]))
            );
        }
        let _ = write!(
            h,
            "<tr><th>build</th><td>{}</td><td>{}</td></tr>\
             <tr><th>seed (trainer.seed / data.seed)</th><td>{} / {}</td><td>{} / {}</td></tr>\
             <tr><th>wall time</th><td class=\"n\">{} s</td><td class=\"n\">{} s</td></tr></table>",
            esc(&show(&self.a.backend["build"])),
            esc(&show(&self.b.backend["build"])),
            esc(self
                .a
                .config
                .get("trainer.seed")
                .map(String::as_str)
                .unwrap_or("–")),
            esc(self
                .a
                .config
                .get("data.seed")
                .map(String::as_str)
                .unwrap_or("–")),
            esc(self
                .b
                .config
                .get("trainer.seed")
                .map(String::as_str)
                .unwrap_or("–")),
            esc(self
                .b
                .config
                .get("data.seed")
                .map(String::as_str)
                .unwrap_or("–")),
            num(self.a.wall_s),
            num(self.b.wall_s)
        );
        let _ = write!(
            h,
            "<p>Machine: {}</p><h3>Config keys that differ</h3><table><tr><th>key</th><th>arm a</th><th>arm b</th></tr>",
            esc(&machine_line(&self.machine))
        );
        for (k, a, b) in self.config_diff() {
            let _ = write!(
                h,
                "<tr><td><code>{}</code></td><td>{}</td><td>{}</td></tr>",
                esc(&k),
                esc(&a),
                esc(&b)
            );
        }
        h.push_str("</table>");
        let causes = self.causes();
        if !causes.is_empty() {
            h.push_str("<h3>Where the numbers can part</h3><ul>");
            for c in causes {
                let _ = write!(h, "<li>{}</li>", esc(&c));
            }
            h.push_str("</ul>");
        }
        // Numerics.
        h.push_str("<h2>Numerics</h2><table id=\"verdicts\"><tr><th>metric</th><th>verdict</th><th>max |Δ|</th><th>max rel Δ</th><th>per step |Δ|</th></tr>");
        let mut rows: Vec<&MetricDiff> = self.diffs.iter().collect();
        rows.sort_by_key(|d| {
            (
                !matches!(d.verdict, Verdict::Diverged { .. }),
                d.name.clone(),
            )
        });
        for d in &rows {
            let cls = if matches!(d.verdict, Verdict::Diverged { .. }) {
                "div"
            } else {
                "ok"
            };
            let per: Vec<String> =
                d.a.iter()
                    .zip(&d.b)
                    .map(|(a, b)| num((a - b).abs()))
                    .collect();
            let _ = write!(
                h,
                "<tr><td><code>{}</code></td><td class=\"{cls}\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
                esc(&d.name),
                esc(&d.verdict.text()),
                num(d.max_abs),
                num(d.max_rel),
                per.join(" · ")
            );
        }
        h.push_str("</table><div class=\"charts\">");
        for d in &rows {
            h.push_str(&Self::chart(d));
        }
        h.push_str("</div>");
        // Performance.
        h.push_str("<h2>Performance</h2><p>Means over the steps after the first (which warms up).</p><table id=\"perf\"><tr><th></th><th>arm a</th><th>arm b</th><th>b / a</th></tr>");
        for p in self.timings.iter().chain(&self.perf) {
            let _ = write!(
                h,
                "<tr><td><code>{}</code></td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
                esc(&p.name),
                num(p.a),
                num(p.b),
                num(p.ratio)
            );
        }
        let gb = |b: Option<u64>| b.map(|b| num(b as f64 / 1e9)).unwrap_or_else(|| "–".into());
        let _ = write!(
            h,
            "<tr><td>checkpoint of the last step (GB)</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr></table>",
            gb(self.a.checkpoint_bytes),
            gb(self.b.checkpoint_bytes),
            match (self.a.checkpoint_bytes, self.b.checkpoint_bytes) {
                (Some(a), Some(b)) if a > 0 => num(b as f64 / a as f64),
                _ => "–".into(),
            }
        );
        h.push_str("</body></html>\n");
        h
    }
}

fn machine_line(m: &serde_json::Value) -> String {
    let gpus: Vec<String> = m["gpus"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|g| g.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    format!(
        "host {}, {}, {} cores, {}",
        m["host"].as_str().unwrap_or("?"),
        m["cpu"].as_str().unwrap_or("?"),
        m["cores"],
        if gpus.is_empty() {
            "no GPU".to_string()
        } else {
            gpus.join("; ")
        }
    )
}

fn show(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => "–".into(),
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Object(m) => m
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| format!("{k} {}", show(v)))
            .collect::<Vec<_>>()
            .join(", "),
        other => other.to_string(),
    }
}
