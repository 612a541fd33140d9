//! One training step, phase by phase as verl's `fit` runs them: generate, reward, old log-probs,
//! reference log-probs, values, advantages, critic and actor updates, validation, checkpoint,
//! metrics. Every phase is a method, timed by [`Timed::timed`] under verl's `timing_s/*` name.

use verl_algos::{
    apply_kl_penalty_across, compute_advantage_across, compute_rollout_correction_across,
    AdvantageInputs, Advantages, Grid, Groups,
};
use verl_data::Sample;
use verl_metrics::{
    compute_throughput_metrics, compute_timing_metrics, StepData, StepSummary, ValGeneration,
};
use verl_plugin_api::{col, Batch, GenerateOptions, LogProbOptions, Tensor, UpdateOptions};

use super::dump::dump_generations;
use super::fit::Trainer;
use super::reduce::Ranks;
use super::rollout::{
    balance_rollout, call_seed, generate_options, grid_f64, mask_grid, rank_slice, tensor_f32,
    Rollout, SALT_GREEDY, SALT_TRAIN,
};
use super::workers::Timed;

/// The step's batch as it grows phase by phase (verl's `batch`), with what the host keeps of it.
struct StepBatch<'d> {
    /// The prompts this rank's rows answer (after balancing), and their dataset indices.
    samples: Vec<&'d Sample>,
    indices: Vec<usize>,
    /// The step's generation options (the greedy baseline samples with the same, greedily).
    gen: GenerateOptions,
    batch: Batch,
    /// The step's metrics so far, in verl's order.
    metrics: Vec<(String, f64)>,
    /// The old-log-prob pass did not run (on-policy step or bypass mode): the update reports
    /// `actor/entropy` itself.
    skip_old: bool,
    old_log_probs: Option<Tensor<f32>>,
    ref_log_probs: Option<Tensor<f32>>,
    values: Option<Grid<f64>>,
}

/// The step's rollout scored, with the response mask every host statistic takes.
struct Scored {
    rollout: Rollout,
    mask: Grid<f64>,
}

/// What the advantage phase computed, for the dumps and the data metrics.
struct StepAdvantages {
    /// The reward functions' token-level scores.
    scores: Grid<f64>,
    /// The scores less the in-reward KL penalty (the scores themselves without it).
    token_rewards: Grid<f64>,
    adv: Advantages,
}

impl Timed for Trainer<'_> {
    type Hook = ();

    fn workers(&mut self) -> &mut super::workers::Workers {
        &mut self.workers
    }
}

impl<'a> Trainer<'a> {
    /// One training step on the loader's batch `data` (of epoch `data.epoch`), then its metrics.
    pub(super) fn step(&mut self, data: &verl_data::Batch) -> anyhow::Result<()> {
        let (s, scored, adv, val_generations) = self.timed("step", |t| {
            let mut s = t.generate(data)?;
            let baselines = t.reward_baselines(&s)?;
            let scored = t.reward(&mut s)?;
            t.old_log_prob(&mut s, &scored)?;
            t.ref_log_prob(&mut s)?;
            t.values(&mut s)?;
            let adv = t.advantages(&mut s, &scored, baselines)?;
            t.dump_rollout(&scored.rollout, &adv)?;
            t.update_critic(&mut s)?;
            t.update_actor(&mut s)?;
            let val_generations = t.validate_if_due(&mut s)?;
            t.save_if_due(data.epoch)?;
            Ok((s, scored, adv, val_generations))
        })?;
        self.log_step(data.epoch, s, &scored, &adv, &val_generations)
    }

    /// `gen`: this rank's slice of the prompts, sampled by the actor, then balanced across
    /// ranks (`trainer.balance_batch`). Keeps what the rollout engine reports about itself.
    fn generate<'d>(&mut self, data: &'d verl_data::Batch) -> anyhow::Result<StepBatch<'d>> {
        let cfg = self.cfg;
        let slice = rank_slice(data.samples.len(), self.dp.dp_rank, self.dp.dp_size)?;
        let mut samples: Vec<&Sample> = data.samples[slice.clone()].iter().collect();
        let mut indices: Vec<usize> = data.indices[slice.clone()].to_vec();
        let mut metrics = Vec::new();
        let gen = GenerateOptions {
            row_offset: slice.start as u64,
            ..generate_options(
                cfg,
                &self.enc.eos_ids,
                self.enc.pad_id,
                call_seed(cfg.trainer.seed, self.global_step, SALT_TRAIN),
            )
        };
        // Tokenising the prompts counts as generation.
        let prompts = self.timed("gen", |t| t.enc.encode(&samples, &indices))?;
        let (mut batch, tool_metrics) = self.roll_out(&prompts, &samples, &gen)?;
        metrics.extend(self.ranks.metrics(tool_metrics)?);
        if cfg.trainer.balance_batch {
            let balanced = balance_rollout(cfg, batch, slice.clone(), &self.dp, self.ranks)?;
            batch = balanced.batch;
            samples = balanced.prompts.iter().map(|&p| &data.samples[p]).collect();
            indices = balanced.prompts.iter().map(|&p| data.indices[p]).collect();
            metrics.extend(balanced.metrics);
        }
        // KV budget, pool use, preemptions.
        let rollout_meta: Vec<(String, f64)> = batch
            .meta()
            .into_iter()
            .filter(|(k, _)| k.starts_with("rollout/"))
            .filter_map(|(k, v)| v.as_f64().map(|x| (k, x)))
            .collect();
        metrics.extend(self.ranks.metrics(rollout_meta)?);
        Ok(StepBatch {
            samples,
            indices,
            gen,
            batch,
            metrics,
            skip_old: false,
            old_log_probs: None,
            ref_log_probs: None,
            values: None,
        })
    }

    /// `gen_max` (REMAX): each prompt's greedy response scored, the baseline of its samples.
    fn reward_baselines(&mut self, s: &StepBatch) -> anyhow::Result<Option<Vec<f64>>> {
        if !self.algo.estimator.needs_reward_baselines() {
            return Ok(None);
        }
        let greedy = GenerateOptions {
            n: 1,
            do_sample: false,
            seed: Some(call_seed(
                self.cfg.trainer.seed,
                self.global_step,
                SALT_GREEDY,
            )),
            ..s.gen.clone()
        };
        let base = self.timed("gen_max", |t| {
            t.generate_and_score(&s.samples, &s.indices, &greedy)
        })?;
        let mut per_prompt = vec![0.0; s.samples.len()];
        let width = base.responses.cols();
        for (r, &p) in base.prompt_index.iter().enumerate() {
            per_prompt[p] = base.reward.token_level_scores[r * width..(r + 1) * width]
                .iter()
                .sum();
        }
        Ok(Some(per_prompt))
    }

    /// `reward`: every response decoded and scored by the job's reward functions.
    fn reward(&mut self, s: &mut StepBatch) -> anyhow::Result<Scored> {
        let rollout = self.timed("reward", |t| t.score(&s.samples, &s.batch))?;
        s.metrics
            .extend(self.ranks.metrics(rollout.reward.metrics.clone())?);
        // Multi-turn: the model's own tokens (verl's response_mask), not the tool turns.
        let mask = mask_grid(rollout.loss_mask.as_ref().unwrap_or(&rollout.response_mask))?;
        Ok(Scored { rollout, mask })
    }

    /// How the actor and reference recompute log-probs: at the rollout's temperature.
    fn log_prob_options(&self) -> LogProbOptions {
        LogProbOptions {
            temperature: self.cfg.actor_rollout_ref.rollout.temperature,
            with_entropy: true,
            base_model: false,
        }
    }

    /// `old_log_prob`: the actor's log-probs (and entropy) before the update. On-policy steps
    /// never read them (the update takes the ratio against its own detached log-probs, as verl
    /// does), so the pass is skipped unless something else needs them; the update then reports
    /// `actor/entropy` from its own forward (same weights). The rollout-vs-training log-prob
    /// metrics need the pass: verl reports them with `rollout.calculate_log_probs`, and so the
    /// pass runs then. Bypass mode (`algorithm.rollout_correction.bypass_mode`) takes the
    /// rollout's log-probs as the old log-probs on every step, as verl does, and never runs it.
    fn old_log_prob(&mut self, s: &mut StepBatch, scored: &Scored) -> anyhow::Result<()> {
        let cfg = self.cfg;
        let bypass = self.algo.bypass;
        s.skip_old = bypass
            || (on_policy_old_log_prob_unused(
                cfg,
                self.plan.actor.ppo_epochs,
                self.plan.actor.mini_batches_per_step,
            ) && cfg.trainer.critic_warmup <= self.global_step
                && !cfg.actor_rollout_ref.rollout.calculate_log_probs);
        if bypass {
            let (rows, width) = (
                scored.rollout.responses.rows(),
                scored.rollout.responses.cols(),
            );
            let rl = tensor_f32(&s.batch, col::ROLLOUT_LOG_PROBS, "rollout (bypass mode)")?;
            s.batch
                .insert_tensor(col::OLD_LOG_PROBS, &[rows, width], &rl.data);
            s.old_log_probs = Some(rl);
            return Ok(());
        }
        if s.skip_old {
            return Ok(());
        }
        let (old, out) = self
            .workers
            .old_log_prob(&mut s.batch, &self.log_prob_options())?;
        let call = format!("{}.actor.compute_log_prob", self.workers.actor.plugin());
        let entropy = tensor_f32(&out, col::ENTROPY, &call)?;
        let entropy_mean = self.ranks.masked_mean(&grid_f64(&entropy)?, &scored.mask)?;
        s.metrics.push(("actor/entropy".into(), entropy_mean));
        if s.batch.contains(col::ROLLOUT_LOG_PROBS) {
            let rl = tensor_f32(&s.batch, col::ROLLOUT_LOG_PROBS, "rollout")?;
            let diff = rollout_probs_diff(&rl.data, &old.data, &scored.mask, self.ranks)?;
            s.metrics.extend(diff);
        }
        s.old_log_probs = Some(old);
        Ok(())
    }

    /// `ref`: the reference policy's log-probs, when the job has one.
    fn ref_log_prob(&mut self, s: &mut StepBatch) -> anyhow::Result<()> {
        let opts = LogProbOptions {
            with_entropy: false,
            ..self.log_prob_options()
        };
        s.ref_log_probs = self.workers.ref_log_prob(&mut s.batch, &opts)?;
        Ok(())
    }

    /// `values`: the critic's values, when the job has one.
    fn values(&mut self, s: &mut StepBatch) -> anyhow::Result<()> {
        s.values = match self.workers.values(&mut s.batch)? {
            Some(v) => Some(grid_f64(&v)?),
            None => None,
        };
        Ok(())
    }

    /// `adv`: token rewards (the KL penalty in the reward, `algorithm.use_kl_in_reward`), the
    /// decoupled rollout correction, and the estimator's advantages and returns, over the whole
    /// batch.
    fn advantages(
        &mut self,
        s: &mut StepBatch,
        scored: &Scored,
        baselines: Option<Vec<f64>>,
    ) -> anyhow::Result<StepAdvantages> {
        self.timed("adv", |t| t.compute_advantages(s, scored, baselines))
    }

    fn compute_advantages(
        &mut self,
        s: &mut StepBatch,
        scored: &Scored,
        baselines: Option<Vec<f64>>,
    ) -> anyhow::Result<StepAdvantages> {
        let (rollout, mask) = (&scored.rollout, &scored.mask);
        let (rows, width) = (rollout.responses.rows(), rollout.responses.cols());
        let ranks = self.ranks;
        let algo = &mut self.algo;
        let scores = Grid::new(rows, width, rollout.reward.token_level_scores.clone())?;
        let token_rewards = match (
            &s.ref_log_probs,
            &s.old_log_probs,
            self.cfg.algorithm.use_kl_in_reward,
        ) {
            (Some(ref_lp), Some(old_lp), true) => {
                let (old_g, ref_g) = (grid_f64(old_lp)?, grid_f64(ref_lp)?);
                let out = ranks.reducer(|reducer| {
                    apply_kl_penalty_across(
                        &scores,
                        &old_g,
                        &ref_g,
                        mask,
                        &mut algo.kl_ctrl,
                        algo.kl_penalty,
                        reducer,
                    )
                })?;
                s.metrics
                    .extend(out.metrics.to_named().map(|(k, v)| (k.to_string(), v)));
                out.token_level_rewards
            }
            _ => scores.clone(),
        };
        // Decoupled rollout correction: importance weights and rejection against the recomputed
        // old log-probs, before the advantages (which, like the losses, skip rejected tokens).
        let loss_mask = match (&algo.correction, &s.old_log_probs) {
            (Some(c), Some(old)) if c.corrects_in_trainer() => {
                let rl = tensor_f32(&s.batch, col::ROLLOUT_LOG_PROBS, "rollout")?;
                let (old_g, rl_g) = (grid_f64(old)?, grid_f64(&rl)?);
                let out = ranks.reducer(|reducer| {
                    compute_rollout_correction_across(c, &old_g, &rl_g, mask, reducer)
                })?;
                s.metrics.extend(out.metrics);
                if let Some(w) = &out.weights {
                    s.batch
                        .insert_tensor(col::ROLLOUT_IS_WEIGHTS, &[rows, width], &w.to_f32());
                }
                if !c.rs.is_empty() {
                    let m: Vec<i64> = out
                        .response_mask
                        .as_slice()
                        .iter()
                        .map(|&v| v as i64)
                        .collect();
                    s.batch.insert_tensor(col::LOSS_MASK, &[rows, width], &m);
                }
                out.response_mask
            }
            _ => mask.clone(),
        };
        let groups = Groups::from_keys(&rollout.prompt_index);
        let mut inputs = AdvantageInputs::new(&token_rewards, &loss_mask).with_index(&groups);
        if let Some(v) = &s.values {
            inputs = inputs.with_values(v);
        }
        let row_baselines: Option<Vec<f64>> = baselines
            .as_ref()
            .map(|b| rollout.prompt_index.iter().map(|&p| b[p]).collect());
        if let Some(b) = &row_baselines {
            inputs = inputs.with_reward_baselines(b);
        }
        let adv = ranks.reducer(|reducer| {
            compute_advantage_across(algo.estimator, &inputs, &algo.adv_params, reducer)
        })?;
        s.batch.insert_tensor(
            col::ADVANTAGES,
            &[rows, width],
            &to_f32(adv.advantages.as_slice()),
        );
        s.batch.insert_tensor(
            col::RETURNS,
            &[rows, width],
            &to_f32(adv.returns.as_slice()),
        );
        Ok(StepAdvantages {
            scores,
            token_rewards,
            adv,
        })
    }

    /// `dump_rollout_generations` (`trainer.rollout_data_dir`): the step's scored rows.
    fn dump_rollout(&mut self, rollout: &Rollout, adv: &StepAdvantages) -> anyhow::Result<()> {
        let cfg = self.cfg;
        let Some(dir) = &cfg.trainer.rollout_data_dir else {
            return Ok(());
        };
        self.timed("dump_rollout_generations", |t| {
            let seq = row_sums(&adv.scores);
            let rows = rollout.dump_rows(0..rollout.responses.rows(), |r| seq[r]);
            dump_generations(dir, t.global_step, rows, t.ranks)?;
            Ok(())
        })
    }

    /// The updates' options. verl injects the resolved step count into the optimiser config for
    /// LR schedules. Without the old-log-prob pass the update reports actor/entropy itself.
    fn update_options(&self, s: &StepBatch) -> UpdateOptions {
        UpdateOptions {
            global_step: self.global_step,
            temperature: Some(self.cfg.actor_rollout_ref.rollout.temperature),
            extra: serde_json::json!({
                "total_training_steps": self.total_steps,
                "entropy_metric": s.skip_old,
                "bypass_mode": self.algo.bypass,
            }),
        }
    }

    /// `update_critic`, when the job has a critic.
    fn update_critic(&mut self, s: &mut StepBatch) -> anyhow::Result<()> {
        let update = self.update_options(s);
        if let Some(m) = self.workers.update_critic(&s.batch, &update)? {
            s.metrics.extend(self.ranks.metrics(m)?);
        }
        Ok(())
    }

    /// `update_actor`, once `trainer.critic_warmup` steps are done.
    fn update_actor(&mut self, s: &mut StepBatch) -> anyhow::Result<()> {
        if self.cfg.trainer.critic_warmup > self.global_step {
            return Ok(());
        }
        let update = self.update_options(s);
        let m = self.workers.update_actor(&s.batch, &update)?;
        s.metrics.extend(self.ranks.metrics(m)?);
        Ok(())
    }

    /// `testing` every `trainer.test_freq` steps and at the last: the validation metrics join
    /// the step's; returns the samples to log.
    fn validate_if_due(&mut self, s: &mut StepBatch) -> anyhow::Result<Vec<ValGeneration>> {
        let t = &self.cfg.trainer;
        let Some(ds) = self.val_ds.clone() else {
            return Ok(Vec::new());
        };
        if !(t.test_freq > 0
            && (self.is_last_step() || self.global_step.is_multiple_of(t.test_freq as u64)))
        {
            return Ok(Vec::new());
        }
        let v = self.timed("testing", |t| t.validate(&ds))?;
        s.metrics.extend(v.metrics.iter().cloned());
        self.summary.last_validation = Some(v.metrics);
        Ok(v.generations)
    }

    /// `save_checkpoint` every `trainer.save_freq` steps and at the last.
    fn save_if_due(&mut self, epoch: u64) -> anyhow::Result<()> {
        let t = &self.cfg.trainer;
        if !(t.save_freq > 0
            && (self.is_last_step() || self.global_step.is_multiple_of(t.save_freq as u64)))
        {
            return Ok(());
        }
        self.timed("save_checkpoint", |t| {
            let loader = t.loader.state();
            let coef = t.algo.kl_ctrl.value();
            let (step, ranks) = (t.global_step, t.ranks);
            t.checkpoints
                .save(&mut t.workers, step, epoch, coef, &loader, ranks)
        })?;
        self.summary.checkpoints.push(self.global_step);
        Ok(())
    }

    /// The step's metrics in verl's order (training/*, the phases', data, timing, throughput),
    /// logged with the validation samples; the progress line.
    fn log_step(
        &mut self,
        epoch: u64,
        s: StepBatch,
        scored: &Scored,
        adv: &StepAdvantages,
        val_generations: &[ValGeneration],
    ) -> anyhow::Result<()> {
        let rollout = &scored.rollout;
        let rows = rollout.responses.rows();
        let prompt_mask = s.batch.tensor::<i64>(col::PROMPT_MASK)?;
        let ones = |row: &[i64]| row.iter().filter(|&&m| m != 0).count();
        let prompt_lengths: Vec<usize> = (0..rows).map(|r| ones(prompt_mask.row(r))).collect();
        let response_lengths: Vec<usize> = (0..rows)
            .map(|r| ones(rollout.response_mask.row(r)))
            .collect();
        let sequence_scores: Vec<f64> = row_sums(&adv.scores);
        let per_row = |name: &str| -> Option<Vec<f64>> {
            let t = s.batch.tensor::<f32>(name).ok()?;
            Some(t.data.iter().map(|&x| f64::from(x)).collect())
        };
        let (num_turns, tool_call_counts) = (
            per_row(super::agent::NUM_TURNS),
            per_row(super::agent::TOOL_CALL_COUNTS),
        );
        let step_data = StepData {
            max_response_length: rollout.responses.cols(),
            max_prompt_length: prompt_mask.cols(),
            sequence_scores: &sequence_scores,
            token_level_rewards: adv.token_rewards.as_slice(),
            advantages: adv.adv.advantages.as_slice(),
            returns: adv.adv.returns.as_slice(),
            values: s.values.as_ref().map(|v| v.as_slice()),
            response_mask: scored.mask.as_slice(),
            prompt_lengths: &prompt_lengths,
            response_lengths: &response_lengths,
            num_turns: num_turns.as_deref(),
            tool_call_counts: tool_call_counts.as_deref(),
        };
        let step_summary = self
            .ranks
            .step_summary(StepSummary::from_step(&step_data)?)?;
        let timings = self.ranks.slowest(self.workers.take_timings())?;
        let mut all = vec![
            ("training/global_step".to_string(), self.global_step as f64),
            ("training/epoch".to_string(), epoch as f64),
        ];
        merge(&mut all, s.metrics);
        merge(&mut all, step_summary.metrics()?);
        let tokens = step_summary.token_counts();
        merge(&mut all, compute_timing_metrics(&timings, tokens));
        let world = self.opts.world_size.max(1) as usize;
        merge(
            &mut all,
            compute_throughput_metrics(&timings, tokens, world)?,
        );
        self.log(&all, val_generations)?;
        if self.opts.progress && self.opts.rank == 0 {
            let get = |k: &str| all.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
            eprintln!(
                "step {}/{} epoch {epoch}: score/mean {:.4} response_length/mean {:.1} {:.2}s",
                self.global_step,
                self.total_steps,
                get("critic/score/mean").unwrap_or(f64::NAN),
                get("response_length/mean").unwrap_or(f64::NAN),
                get("timing_s/step").unwrap_or(f64::NAN),
            );
        }
        self.summary.global_step = self.global_step;
        self.summary.last_metrics = all;
        Ok(())
    }
}

/// verl's `training/rollout_probs_diff_*`: how far the sampler's token probabilities are
/// from the trainer's recomputation, over the whole batch (every rank takes part in the
/// reductions, even one without a valid token).
pub(super) fn rollout_probs_diff(
    rollout: &[f32],
    old: &[f32],
    mask: &Grid<f64>,
    ranks: Ranks<'_>,
) -> anyhow::Result<Vec<(String, f64)>> {
    let diffs: Vec<f64> = rollout
        .iter()
        .zip(old)
        .zip(mask.as_slice())
        .filter(|(_, &m)| m != 0.0)
        .map(|((&a, &b), _)| ((a as f64).exp() - (b as f64).exp()).abs())
        .collect();
    let mut first = [diffs.iter().sum::<f64>(), diffs.len() as f64];
    let mut max = [diffs.iter().cloned().fold(0.0, f64::max)];
    ranks.sum(&mut first)?;
    ranks.max(&mut max)?;
    let [sum, n] = first;
    let mean = sum / n.max(1.0);
    // Centred on the batch-wide mean, as a single-process two-pass variance is.
    let mut centred = [diffs.iter().map(|d| (d - mean).powi(2)).sum::<f64>()];
    ranks.sum(&mut centred)?;
    if n == 0.0 {
        return Ok(Vec::new());
    }
    let var = if n > 1.0 { centred[0] / (n - 1.0) } else { 0.0 };
    Ok(vec![
        ("training/rollout_probs_diff_max".into(), max[0]),
        ("training/rollout_probs_diff_mean".into(), mean),
        ("training/rollout_probs_diff_std".into(), var.sqrt()),
    ])
}

/// Whether the old-log-prob pass computes nothing the step uses: one mini-batch and one epoch
/// (the update is on-policy and, like verl's, takes the PPO ratio against its own detached
/// log-probs), no KL penalty in the reward (which reads them), and
/// `trainer.skip_on_policy_old_log_prob` (verl-rs extension, default true) not turned off.
pub(crate) fn on_policy_old_log_prob_unused(
    cfg: &verl_config::Config,
    ppo_epochs: u64,
    mini_batches_per_step: u64,
) -> bool {
    cfg.trainer.skip_on_policy_old_log_prob
        && ppo_epochs == 1
        && mini_batches_per_step == 1
        && !cfg.algorithm.use_kl_in_reward
}

/// verl collects a step's metrics in a dict: a later value under the same name (the actor
/// update's `actor/entropy` after the old-log-prob pass's) replaces the earlier one in place.
pub(super) fn merge(into: &mut Vec<(String, f64)>, more: impl IntoIterator<Item = (String, f64)>) {
    for (k, v) in more {
        match into.iter_mut().find(|(n, _)| *n == k) {
            Some(slot) => slot.1 = v,
            None => into.push((k, v)),
        }
    }
}

fn row_sums(g: &Grid<f64>) -> Vec<f64> {
    g.iter_rows().map(|r| r.iter().sum()).collect()
}

fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}
