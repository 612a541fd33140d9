//! `verl bench grpo --rm-arch`: a reward model scoring each step's rollouts, colocated, timed per
//! call (onload, score, offload).

use std::time::Instant;

use serde_json::{json, Value};
use verl_config::Config;
use verl_plugin_api::{col, Batch, InitArgs, Role};

use super::report::{round4, sig};
use super::shape::{rm_forward_flops, shape, Shape};

/// The reward model of `--rm-arch`: a backend reward_model role on random weights.
pub(super) struct BenchRm {
    shape: Shape,
    client: verl_plugin_api::client::RewardModelClient,
    offload: bool,
    /// Per timed step: (onload, score, offload) seconds, and the rows and tokens scored.
    times: Vec<(f64, f64, f64)>,
    rows: usize,
    tokens: usize,
}

impl BenchRm {
    pub(super) fn create(
        backend: &crate::LoadedPlugin,
        arch: &str,
        cfg: &Config,
        dir: &std::path::Path,
        seed: u64,
    ) -> anyhow::Result<BenchRm> {
        let shape = shape(arch)?;
        std::fs::create_dir_all(dir)?;
        let mut c = shape.config_json();
        c["architectures"] = json!([match shape.model_type {
            "llama" => "LlamaForSequenceClassification",
            _ => "Qwen2ForSequenceClassification",
        }]);
        c["num_labels"] = json!(1);
        std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&c)?)?;
        let spec = crate::trainer::reward_model::reward_model_spec(cfg, &dir.to_string_lossy(), 1);
        let offload = spec.offload;
        let mut init = InitArgs::new(Role::RewardModel, serde_json::to_value(cfg)?);
        init.extra = json!({"reward_model": spec, "random_init": {"seed": seed + 1}});
        let client = backend.create_reward_model(&init)?;
        Ok(BenchRm {
            shape,
            client,
            offload,
            times: Vec::new(),
            rows: 0,
            tokens: 0,
        })
    }

    /// The reward phase on a generated batch: prompt + response ids (folded into the reward
    /// model's vocabulary, as a re-tokenisation would give ids of its own), right-padded.
    pub(super) fn score(&mut self, gen: &Batch) -> anyhow::Result<()> {
        let p = gen.tensor::<i64>(col::PROMPTS)?;
        let pm = gen.tensor::<i64>(col::PROMPT_MASK)?;
        let r = gen.tensor::<i64>(col::RESPONSES)?;
        let rm = gen.tensor::<i64>(col::RESPONSE_MASK)?;
        let fold = (self.shape.vocab - 1) as i64;
        let rows: Vec<Vec<i64>> = (0..r.rows())
            .map(|i| {
                let prompt = p.row(i).iter().zip(pm.row(i)).filter(|(_, &m)| m != 0);
                let resp = r.row(i).iter().zip(rm.row(i)).filter(|(_, &m)| m != 0);
                prompt.chain(resp).map(|(&t, _)| t % fold).collect()
            })
            .collect();
        let w = rows.iter().map(Vec::len).max().unwrap_or(1);
        let mut ids = vec![fold; rows.len() * w];
        let mut mask = vec![0i64; rows.len() * w];
        for (i, row) in rows.iter().enumerate() {
            ids[i * w..i * w + row.len()].copy_from_slice(row);
            mask[i * w..i * w + row.len()].fill(1);
        }
        let mut b = Batch::new();
        b.insert_tensor(col::INPUT_IDS, &[rows.len(), w], &ids);
        b.insert_tensor(col::ATTENTION_MASK, &[rows.len(), w], &mask);
        let t = Instant::now();
        self.client.call("onload", &Value::Null)?;
        // The `memory` answer is read after the device finished the copy.
        self.client.call("memory", &Value::Null)?;
        let t_on = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let scores = self.client.score(&b)?;
        let t_score = t.elapsed().as_secs_f64();
        let t = Instant::now();
        self.client.call("offload", &Value::Null)?;
        self.client.call("memory", &Value::Null)?;
        let t_off = t.elapsed().as_secs_f64();
        anyhow::ensure!(
            scores.len() == rows.len(),
            "reward model: wrong score count"
        );
        self.times.push((t_on, t_score, t_off));
        self.rows = rows.len();
        self.tokens = rows.iter().map(Vec::len).sum();
        Ok(())
    }

    pub(super) fn report(&self, peak_tflops: f64, peak_mem: f64) -> (String, Value) {
        let (on, sc, off) = self.times.last().copied().unwrap_or_default();
        let flops = rm_forward_flops(
            &self.shape,
            self.rows as u64,
            (self.tokens / self.rows.max(1)) as u64,
        );
        let mfu = flops / sc.max(1e-12) / (peak_tflops * 1e12);
        let tps = self.tokens as f64 / sc.max(1e-12);
        let table = format!(
            "reward model {} ({} M params, bf16 unless set): {} rows, {} tokens; score {:.3}s \
             ({:.0} tokens/s, MFU {:.1}%), onload {:.3}s, offload {:.3}s (weights {} between \
             steps), phase {:.3}s; process peak {:.1} GiB\n",
            self.shape.name,
            sig(self.shape.n_params() as f64 / 1e6),
            self.rows,
            self.tokens,
            sc,
            tps,
            100.0 * mfu,
            on,
            off,
            if self.offload {
                "in host memory"
            } else {
                "on the GPU"
            },
            on + sc + off,
            peak_mem
        );
        let json = json!({
            "arch": self.shape.name, "rows": self.rows, "tokens": self.tokens,
            "onload_s": round4(on), "score_s": round4(sc), "offload_s": round4(off),
            "phase_s": round4(on + sc + off), "tokens_per_s": tps.round(), "mfu": (mfu * 1e4).round() / 1e4,
            "offloaded_between_steps": self.offload,
            "per_step": self.times.iter().map(|(a, b, c)| json!([round4(*a), round4(*b), round4(*c)])).collect::<Vec<_>>(),
        });
        (table, json)
    }
}
