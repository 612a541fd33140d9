//! What `verl bench grpo` reports: each step's phase times, and the last step's FLOPs, throughput
//! and utilisation as a table and as the JSON line of `bench/trl_grpo.py`'s keys.

use serde_json::{json, Value};
use verl_metrics::Timings;

use super::shape::{
    decode_roofline_s, forward_flops, generate_flops, lora_train_flops, train_flops, Shape,
};
use super::GrpoArgs;

const PHASES: [&str; 4] = ["gen", "old_log_prob", "ref", "update"];

#[derive(Debug, Clone, Default)]
pub(super) struct StepTimes {
    pub(super) gen: f64,
    pub(super) old_log_prob: f64,
    /// On-policy step: the old-log-prob pass did not run (see `trainer.skip_on_policy_old_log_prob`).
    pub(super) old_skipped: bool,
    pub(super) reference: f64,
    pub(super) other: f64,
    pub(super) update: f64,
    pub(super) step: f64,
}

impl StepTimes {
    /// A step's times from the phases the step's clock recorded (`update_actor` is the update).
    pub(super) fn from_clock(t: &Timings, old_skipped: bool) -> StepTimes {
        let get = |phase: &str| t.get(phase).unwrap_or(0.0);
        StepTimes {
            gen: get("gen"),
            old_log_prob: get("old_log_prob"),
            old_skipped,
            reference: get("ref"),
            other: get("other"),
            update: get("update_actor"),
            step: get("step"),
        }
    }

    fn phase(&self, name: &str) -> f64 {
        match name {
            "gen" => self.gen,
            "old_log_prob" => self.old_log_prob,
            "ref" => self.reference,
            "update" => self.update,
            "other" => self.other,
            _ => self.step,
        }
    }
    pub(super) fn to_json(&self) -> Value {
        json!({
            "gen": round4(self.gen), "old_log_prob": round4(self.old_log_prob),
            "old_log_prob_skipped": self.old_skipped,
            "ref": round4(self.reference), "other": round4(self.other),
            "update": round4(self.update), "step": round4(self.step),
        })
    }
}

/// Three significant digits at least, one decimal for large values.
pub(super) fn sig(x: f64) -> String {
    if x.abs() >= 100.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.3}")
    }
}

pub(super) fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// FLOPs, throughput and utilisation of one step.
pub(super) struct Report {
    times: StepTimes,
    flops: [f64; 4],
    tokens: [u64; 4],
    peak_tflops: f64,
    hbm_gbps: f64,
    roofline_s: f64,
    /// LoRA: the update's FLOPs leave out the frozen base's weight gradients.
    lora: bool,
}

impl Report {
    pub(super) fn new(
        s: &Shape,
        a: &GrpoArgs,
        t: &StepTimes,
        peak_tflops: f64,
        hbm_gbps: f64,
        lora: bool,
    ) -> Report {
        let rows = (a.prompts * a.n) as u64;
        let (p, r) = (a.prompt_len as u64, a.response_len as u64);
        let seq = p + r;
        let fwd = forward_flops(s, rows, seq);
        Report {
            times: t.clone(),
            flops: [
                generate_flops(s, rows, p, r),
                fwd,
                fwd,
                if lora {
                    lora_train_flops(s, rows, seq)
                } else {
                    train_flops(s, rows, seq)
                },
            ],
            tokens: [rows * r, rows * seq, rows * seq, rows * seq],
            peak_tflops,
            hbm_gbps,
            roofline_s: decode_roofline_s(s, rows, p, r, hbm_gbps),
            lora,
        }
    }
    fn mfu(&self, flops: f64, secs: f64) -> f64 {
        if secs > 0.0 {
            flops / secs / (self.peak_tflops * 1e12)
        } else {
            0.0
        }
    }
    /// FLOPs of the phases that ran.
    fn step_flops(&self) -> f64 {
        let old = if self.times.old_skipped {
            self.flops[1]
        } else {
            0.0
        };
        self.flops.iter().sum::<f64>() - old
    }
    fn decode_fraction(&self) -> f64 {
        if self.times.gen > 0.0 {
            self.roofline_s / self.times.gen
        } else {
            0.0
        }
    }
    pub(super) fn table(&self, peak_mem: f64, mem_source: &str) -> String {
        let mut o = format!(
            "{:<13} {:>9} {:>12} {:>7} {:>9}\n",
            "phase", "seconds", "tokens/s", "MFU", "HBM roof"
        );
        for (i, name) in PHASES.iter().enumerate() {
            let secs = self.times.phase(name);
            if i == 1 && self.times.old_skipped {
                o.push_str(&format!(
                    "{name:<13} {:>9} (on-policy step, or bypass mode: the update takes its own or the rollout's log-probs, as the trainer)\n",
                    "skipped"
                ));
                continue;
            }
            let roof = if i == 0 {
                format!("{:.1}%", 100.0 * self.decode_fraction())
            } else {
                "-".into()
            };
            o.push_str(&format!(
                "{:<13} {:>9.3} {:>12.0} {:>6.1}% {:>9}\n",
                name,
                secs,
                self.tokens[i] as f64 / secs.max(1e-12),
                100.0 * self.mfu(self.flops[i], secs),
                roof
            ));
        }
        let total = self.step_flops();
        o.push_str(&format!(
            "{:<13} {:>9.3} {:>12.0} {:>6.1}% {:>9}\n",
            "step",
            self.times.step,
            self.tokens[3] as f64 / self.times.step.max(1e-12),
            100.0 * self.mfu(total, self.times.step),
            "-"
        ));
        o.push_str(&format!(
            "peak: {} TFLOP/s bf16 matmul, {} GB/s copy (measured); peak memory {:.2} GiB ({mem_source}, sampled after each phase)\n",
            sig(self.peak_tflops), sig(self.hbm_gbps), peak_mem
        ));
        let update = if self.lora {
            "update 3× forward less the frozen base's weight gradients (2·N·tokens; LoRA adapters' own FLOPs not counted)"
        } else {
            "update 3× forward"
        };
        o.push_str(&format!(
            "FLOPs: forward 2·N·tokens + 4·layers·attn_dim·len² per sequence; {update}; gen = prefill forward + decode 2·N + 4·layers·attn_dim·ctx per token (N = matmul weights incl. LM head). HBM roof: decode steps × (weight bytes + KV bytes at mean context) / bandwidth, over the whole gen time (prefill included).\n",
        ));
        o
    }
    pub(super) fn json(&self, s: &Shape, a: &GrpoArgs, peak_mem: f64, mem_source: &str) -> Value {
        let rows = (a.prompts * a.n) as u64;
        let t = &self.times;
        let total = self.step_flops();
        let tokens = rows * (a.prompt_len + a.response_len) as u64;
        let resp = rows * a.response_len as u64;
        json!({
            "system": "verl-rs",
            "arch": a.arch,
            "device": a.device,
            "dtype": "bf16",
            "prompts": a.prompts,
            "n": a.n,
            "prompt_len": a.prompt_len,
            "response_len": a.response_len,
            "ignore_eos": a.ignore_eos,
            "micro_batch": a.micro_batch,
            "logprob_micro_batch": a.logprob_micro_batch,
            "steps": a.steps,
            "lora_rank": a.lora_rank,
            "n_params": s.n_params(),
            "gen": round4(t.gen),
            "old_log_prob": round4(t.old_log_prob),
            "old_log_prob_skipped": t.old_skipped,
            "ref": round4(t.reference),
            "other": round4(t.other),
            "update": round4(t.update),
            "step": round4(t.step),
            "tokens": tokens,
            "response_tokens": resp,
            "tokens_per_s": (tokens as f64 / t.step.max(1e-12) * 10.0).round() / 10.0,
            "gen_tokens_per_s": (resp as f64 / t.gen.max(1e-12) * 10.0).round() / 10.0,
            "peak_mem_gb": (peak_mem * 1000.0).round() / 1000.0,
            "peak_mem_source": format!("{mem_source}, max over samples after each phase"),
            "mfu_gen": self.mfu(self.flops[0], t.gen),
            "mfu_old_log_prob": self.mfu(self.flops[1], t.old_log_prob),
            "mfu_ref": self.mfu(self.flops[2], t.reference),
            "mfu_update": self.mfu(self.flops[3], t.update),
            "mfu_step": self.mfu(total, t.step),
            "decode_hbm_fraction": self.decode_fraction(),
            "decode_roofline_s": self.roofline_s,
            "peak_tflops": self.peak_tflops,
            "hbm_gbps": self.hbm_gbps,
            "flops": {"gen": self.flops[0], "old_log_prob": self.flops[1], "ref": self.flops[2], "update": self.flops[3]},
        })
    }
}
