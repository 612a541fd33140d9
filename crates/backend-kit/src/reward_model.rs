//! The reward model role (verl's discriminative reward model): a frozen HF
//! `*ForSequenceClassification` or `Qwen2ForRewardModel` checkpoint that scores whole sequences.
//!
//! The host renders each (prompt, response) with the reward model's own tokenizer and chat
//! template and sends right-padded token ids; this role runs the forward in micro-batches (a
//! fixed number of rows, or a token budget with `use_dynamic_bsz`) and returns the head's output
//! at each row's last real token (the last label when the head has several, as verl's vLLM
//! path reads it). Every rank holds the whole model and scores its own rows. With `offload`, the
//! weights wait in pinned host memory between reward phases and visit the device for them.

use tch::{Device, Kind, Tensor};
use verl_nn::{HeadKind, ModelConfig, ModelOptions, Transformer};
use verl_plugin_api::{
    col, Batch, Error as ApiError, InitArgs, Result as ApiResult, Reward, RewardModelSpec,
    ScoreOptions,
};

use crate::config::{self, parse_dtype, section, TrainerSection};
use crate::error::{BackendError, Result, TorchContext};
use crate::host_params::HostParams;

pub struct RewardModelRole {
    model: Transformer,
    device: Device,
    spec: RewardModelSpec,
    host_params: Option<HostParams>,
    /// Between `onload` and `offload` the weights stay on the device across `score` calls.
    held: bool,
}

impl RewardModelRole {
    pub fn create(init: &InitArgs) -> Result<RewardModelRole> {
        let spec: RewardModelSpec = init
            .extra
            .get("reward_model")
            .cloned()
            .map(serde_json::from_value)
            .transpose()
            .map_err(|e| {
                BackendError::config("InitArgs.extra.reward_model", "a reward model spec", e)
            })?
            .ok_or_else(|| {
                BackendError::config(
                    "InitArgs.extra.reward_model",
                    "the reward model to load",
                    "nothing",
                )
            })?;
        let trainer: TrainerSection = section(&init.config, "trainer")?;
        let device = config::device(&trainer, init.local_rank)?;
        let key = if spec.path_key.is_empty() {
            "reward_model.model.path"
        } else {
            spec.path_key.as_str()
        };
        let dir = config::model_dir(key, &spec.path)?;
        let dtype = parse_dtype("reward.reward_model.rollout.dtype", &spec.dtype)?;
        let cfg = ModelConfig::from_dir(&dir)?;
        let head = HeadKind::of_reward_model(&cfg).ok_or_else(|| {
            let class = cfg
                .raw
                .get("architectures")
                .map(|a| a.to_string())
                .unwrap_or_else(|| "no `architectures`".into());
            BackendError::config(
                key,
                "a reward model: a config.json whose architectures name a \
                 *ForSequenceClassification or *ForRewardModel class",
                format!("{} ({class})", dir.display()),
            )
        })?;
        let opts = ModelOptions {
            device,
            dtype,
            head,
        };
        // `verl bench`: fresh weights of the folder's architecture, nothing to load.
        let random_init = init
            .extra
            .get("random_init")
            .map(|r| r.get("seed").and_then(|s| s.as_i64()).unwrap_or(0));
        let (mut model, report) = match random_init {
            Some(seed) => {
                tch::manual_seed(seed);
                (Transformer::new(cfg, &opts)?, Default::default())
            }
            None => Transformer::from_pretrained_with_report(&dir, &opts)?,
        };
        if !report.initialized.is_empty() {
            return Err(BackendError::config(
                key,
                "a reward model checkpoint with its score head",
                format!(
                    "{} without {} (a reward model with a random head scores noise)",
                    dir.display(),
                    report.initialized.join(", ")
                ),
            ));
        }
        model.set_requires_grad(false)?;
        let host_params = if spec.offload && (device.is_cuda() || cfg!(test)) {
            Some(HostParams::offload(&model, device)?)
        } else {
            None
        };
        Ok(RewardModelRole {
            model,
            device,
            spec,
            host_params,
            held: false,
        })
    }

    fn onload(&mut self) -> Result<()> {
        if let Some(h) = &mut self.host_params {
            h.load(&self.model)?;
        }
        Ok(())
    }

    fn offload(&mut self) -> Result<()> {
        if let Some(h) = &mut self.host_params {
            h.unload(&self.model)?;
        }
        Ok(())
    }

    /// Row ranges of the micro-batches, in order.
    fn micro_batches(&self, lens: &[i64]) -> Vec<std::ops::Range<usize>> {
        let mut out = Vec::new();
        let mut start = 0;
        if self.spec.use_dynamic_bsz {
            // Real tokens per micro-batch, as verl counts them (the forward packs rows without
            // padding); a row longer than the budget goes alone.
            let budget = self.spec.max_token_len_per_gpu.max(1) as i64;
            let mut tokens = 0;
            for (i, &l) in lens.iter().enumerate() {
                if i > start && tokens + l > budget {
                    out.push(start..i);
                    start = i;
                    tokens = 0;
                }
                tokens += l;
            }
        } else {
            let rows = self
                .spec
                .micro_batch_size_per_gpu
                .filter(|&m| m > 0)
                .unwrap_or(lens.len().max(1) as u64) as usize;
            while start + rows < lens.len() {
                out.push(start..start + rows);
                start += rows;
            }
        }
        if start < lens.len() {
            out.push(start..lens.len());
        }
        out
    }

    /// One micro-batch as one packed stream of its rows' real tokens (no padded position is
    /// computed; on CUDA in half precision the attention is flash attention's varlen kernel), the
    /// head read at each row's last token.
    fn forward_packed<'a>(
        &self,
        rows: impl Iterator<Item = &'a [i64]>,
        lens: &[i64],
    ) -> Result<Vec<f32>> {
        let n_rows = lens.len() as i64;
        let len = *lens.iter().max().unwrap_or(&1);
        let total: i64 = lens.iter().sum();
        let (mut stream, mut pos) = (Vec::with_capacity(total as usize), Vec::new());
        let (mut gather, mut scatter, mut last) = (Vec::new(), Vec::new(), Vec::new());
        for (a, (row, &l)) in rows.zip(lens).enumerate() {
            let offset = stream.len() as i64;
            stream.extend_from_slice(&row[..l as usize]);
            pos.extend(0..l);
            // Columns past the row's end repeat its last token (causal attention keeps the
            // real columns from seeing them; nothing reads their outputs).
            gather.extend((0..len).map(|c| offset + c.min(l - 1)));
            scatter.extend((0..l).map(|c| a as i64 * len + c));
            last.push(offset + l - 1);
        }
        let up = |v: &[i64], what: &str| -> Result<Tensor> {
            Tensor::from_slice(v)
                .f_to_device(self.device)
                .and_then(|t| t.f_view([1, -1]))
                .ctx(what)
        };
        let attention =
            verl_nn::AttentionRows::from_host(&gather, &scatter, n_rows, len, self.device)?;
        let (ids, pos, last) = (
            up(&stream, "reward model tokens")?,
            up(&pos, "reward model positions")?,
            up(&last, "reward model last tokens")?,
        );
        let out = tch::no_grad(|| -> Result<Tensor> {
            let hidden = self.model.forward_hidden_rows(&ids, &pos, &attention)?;
            let at_last = hidden
                .f_index_select(1, &last.f_view([-1]).ctx("last tokens")?)
                .and_then(|h| h.f_view([n_rows, 1, -1]))
                .ctx("hidden states at the last tokens")?;
            Ok(self.model.apply_head(&at_last, None)?)
        })?;
        let labels = out.size()[1];
        let v = out
            .f_select(1, labels - 1)
            .and_then(|s| s.f_to_kind(Kind::Float))
            .and_then(|s| s.f_to_device(Device::Cpu))
            .ctx("reward model scores to the host")?;
        Vec::<f32>::try_from(&v).ctx("reward model scores")
    }

    fn do_score(&mut self, batch: &Batch) -> Result<Vec<f32>> {
        let ids = batch.tensor::<i64>(col::INPUT_IDS)?;
        let mask = batch.tensor::<i64>(col::ATTENTION_MASK)?;
        let (rows, width) = (ids.shape[0], ids.shape[1]);
        let lens: Vec<i64> = (0..rows)
            .map(|r| {
                mask.data[r * width..(r + 1) * width]
                    .iter()
                    .rposition(|&m| m != 0)
                    .map(|p| p as i64 + 1)
                    .unwrap_or(0)
            })
            .collect();
        if let Some(r) = lens.iter().position(|&l| l == 0) {
            return Err(BackendError::Input {
                call: "RewardModel.score",
                column: col::ATTENTION_MASK.into(),
                expected: "at least one real token per row".into(),
                found: format!("row {r} is all padding"),
            });
        }
        let mut scores = Vec::with_capacity(rows);
        for range in self.micro_batches(&lens) {
            let (row, len) = (&ids.data, &lens[range.clone()]);
            scores.extend(self.forward_packed(range.map(|r| &row[r * width..]), len)?);
        }
        Ok(scores)
    }
}

impl Reward for RewardModelRole {
    fn score(&mut self, batch: &Batch, _options: &ScoreOptions) -> ApiResult<Batch> {
        let _trace = verl_nn::profile::trace("reward_model", self.device);
        self.onload()?;
        let r = self.do_score(batch);
        if !self.held {
            self.offload()?;
        }
        let s = r?;
        let mut out = Batch::new();
        out.insert_tensor(col::SCORES, &[s.len()], &s);
        Ok(out)
    }

    fn call(
        &mut self,
        method: &str,
        _batch: &Batch,
        _options: &serde_json::Value,
    ) -> ApiResult<Batch> {
        match method {
            "onload" => {
                self.onload()?;
                self.held = true;
            }
            "offload" => {
                self.held = false;
                self.offload()?;
            }
            "memory" => {
                // Answered after the device finished its queued work (timing callers rely on it).
                if let Device::Cuda(i) = self.device {
                    tch::Cuda::synchronize(i as i64);
                }
                let bytes: i64 = self
                    .model
                    .named_parameters()
                    .iter()
                    .map(|(_, p)| p.numel() as i64 * p.kind().elt_size_in_bytes() as i64)
                    .sum();
                let on_device = self.host_params.as_ref().is_none_or(|h| h.on_device());
                let mut b = Batch::new();
                b.insert_tensor("parameter_bytes", &[1], &[bytes]);
                b.insert_tensor("on_device", &[1], &[on_device as i64]);
                return Ok(b);
            }
            other => {
                return Err(ApiError::not_implemented(format!(
                    "reward_model call `{other}` (it answers `onload`, `offload` and `memory`)"
                )))
            }
        }
        Ok(Batch::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use verl_nn::SaveOptions;
    use verl_plugin_api::Role;

    /// The crate's tiny Qwen2 as a sequence classifier with one label, saved as an HF folder.
    fn tiny_rm_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let base = verl_test_support::tiny::tiny_model_dir();
        let mut cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(base.path().join("config.json")).unwrap(),
        )
        .unwrap();
        cfg["architectures"] = serde_json::json!(["Qwen2ForSequenceClassification"]);
        cfg["num_labels"] = serde_json::json!(1);
        let cfg = ModelConfig::from_value(cfg, "inline/config.json").unwrap();
        tch::manual_seed(3);
        let m = Transformer::new(
            cfg,
            &ModelOptions {
                head: HeadKind::SequenceClassification,
                ..ModelOptions::default()
            },
        )
        .unwrap();
        m.save_pretrained(dir.path(), &SaveOptions::default())
            .unwrap();
        dir
    }

    fn role(dir: &std::path::Path, spec: serde_json::Value) -> RewardModelRole {
        let mut init = InitArgs::new(
            Role::RewardModel,
            serde_json::json!({"trainer": {"device": "cpu"}}),
        );
        let mut s = serde_json::json!({"path": dir.to_str().unwrap(), "dtype": "float32"});
        for (k, v) in spec.as_object().unwrap() {
            s[k] = v.clone();
        }
        init.extra = serde_json::json!({ "reward_model": s });
        RewardModelRole::create(&init).unwrap()
    }

    fn batch() -> Batch {
        let mut b = Batch::new();
        b.insert_tensor(
            col::INPUT_IDS,
            &[3, 4],
            &[5i64, 6, 7, 8, 9, 10, 0, 0, 11, 0, 0, 0],
        );
        b.insert_tensor(
            col::ATTENTION_MASK,
            &[3, 4],
            &[1i64, 1, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0],
        );
        b
    }

    #[test]
    fn micro_batching_leaves_the_scores_as_they_are() {
        let dir = tiny_rm_dir();
        let opts = ScoreOptions::default();
        let whole = role(dir.path(), serde_json::json!({}))
            .score(&batch(), &opts)
            .unwrap();
        let one = role(
            dir.path(),
            serde_json::json!({"micro_batch_size_per_gpu": 1}),
        )
        .score(&batch(), &opts)
        .unwrap();
        let dynamic = role(
            dir.path(),
            serde_json::json!({"use_dynamic_bsz": true, "max_token_len_per_gpu": 4}),
        );
        assert_eq!(dynamic.micro_batches(&[4, 2, 1]), vec![0..1, 1..3]);
        assert_eq!(
            dynamic.micro_batches(&[2, 3, 6, 1]),
            vec![0..1, 1..2, 2..3, 3..4]
        );
        let mut dynamic = dynamic;
        let dynamic = dynamic.score(&batch(), &opts).unwrap();
        let w = whole.tensor::<f32>(col::SCORES).unwrap().data;
        for other in [one, dynamic] {
            let o = other.tensor::<f32>(col::SCORES).unwrap().data;
            for (a, b) in w.iter().zip(&o) {
                assert!((a - b).abs() < 1e-5, "{w:?} vs {o:?}");
            }
        }
        // Different sequences score differently (the head is not constant).
        assert!(w[0] != w[1] && w[1] != w[2], "{w:?}");
    }

    /// `offload` is what the host sets from `reward.reward_model.rollout.free_cache_engine`.
    #[test]
    fn an_offloaded_reward_model_scores_the_same_and_leaves_the_device() {
        let dir = tiny_rm_dir();
        let opts = ScoreOptions::default();
        let want = role(dir.path(), serde_json::json!({}))
            .score(&batch(), &opts)
            .unwrap();
        let mut off = role(dir.path(), serde_json::json!({"offload": true}));
        let on_device = |r: &mut RewardModelRole| {
            r.call("memory", &Batch::new(), &serde_json::Value::Null)
                .unwrap()
                .tensor::<i64>("on_device")
                .unwrap()
                .data[0]
        };
        assert_eq!(on_device(&mut off), 0);
        let got = off.score(&batch(), &opts).unwrap();
        assert_eq!(
            want.tensor::<f32>(col::SCORES).unwrap(),
            got.tensor::<f32>(col::SCORES).unwrap()
        );
        assert_eq!(on_device(&mut off), 0, "weights go back after a score");
        off.call("onload", &Batch::new(), &serde_json::Value::Null)
            .unwrap();
        off.score(&batch(), &opts).unwrap();
        assert_eq!(on_device(&mut off), 1, "held between onload and offload");
        off.call("offload", &Batch::new(), &serde_json::Value::Null)
            .unwrap();
        assert_eq!(on_device(&mut off), 0);
    }

    #[test]
    fn a_causal_lm_is_not_taken_for_a_reward_model() {
        let dir = verl_test_support::tiny::tiny_model_dir();
        let mut init = InitArgs::new(
            Role::RewardModel,
            serde_json::json!({"trainer": {"device": "cpu"}}),
        );
        init.extra = serde_json::json!({"reward_model": {
            "path": dir.path().to_str().unwrap(), "path_key": "reward.reward_model.model_path"}});
        let e = RewardModelRole::create(&init).err().unwrap().to_string();
        assert!(
            e.contains("reward.reward_model.model_path")
                && e.contains("ForSequenceClassification")
                && e.contains("Qwen2ForCausalLM"),
            "{e}"
        );
    }
}
