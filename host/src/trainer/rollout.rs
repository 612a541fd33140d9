//! Rollouts: what a generation call samples with (seeds, options), which prompts each rank
//! generates for, verl's batch balancing, and a generated batch decoded and scored.

use std::sync::Arc;

use anyhow::bail;
use verl_algos::{Grid, Groups};
use verl_config::Config;
use verl_data::Sample;
use verl_plugin_api::{col, Batch, GenerateOptions, Tensor};

use super::agent::AgentDriver;
use super::dump::DumpRows;
use super::error::TrainerError;
use super::fit::Trainer;
use super::reduce::Ranks;
use super::reward::{RewardInput, RewardOutput};
use super::setup::DataLayout;

/// The seed of one generation call: a function of the job seed and the step only, so a resumed
/// run samples exactly what the uninterrupted one did. It must not depend on the rank: with
/// `GenerateOptions::row_offset` every prompt samples by its global index, so a batch split over
/// ranks generates exactly what one rank would.
pub(super) fn call_seed(seed: u64, step: u64, salt: u64) -> u64 {
    let mut x = seed ^ 0xD1B5_4A32_D192_ED03;
    for v in [step, salt] {
        x = (x ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 29;
    }
    x
}

pub(super) const SALT_TRAIN: u64 = 1;
pub(super) const SALT_GREEDY: u64 = 2;
pub(super) const SALT_VAL: u64 = 3;

/// A training step's generation: `rollout.*` sampling, `rollout.response_length` tokens.
pub(super) fn generate_options(cfg: &Config, eos: &[i64], pad: i64, seed: u64) -> GenerateOptions {
    let r = &cfg.actor_rollout_ref.rollout;
    GenerateOptions {
        n: r.n as u32,
        max_new_tokens: r.response_length as u32,
        temperature: r.temperature,
        top_p: r.top_p,
        top_k: r.top_k,
        do_sample: r.do_sample,
        seed: Some(seed),
        row_offset: 0,
        eos_token_ids: eos.to_vec(),
        pad_token_id: pad,
        ignore_eos: r.ignore_eos,
        return_log_probs: true,
        validate: false,
    }
}

/// A validation generation: `rollout.val_kwargs` sampling, otherwise as training.
pub(super) fn validation_options(
    cfg: &Config,
    eos: &[i64],
    pad: i64,
    seed: u64,
) -> GenerateOptions {
    let vk = &cfg.actor_rollout_ref.rollout.val_kwargs;
    GenerateOptions {
        n: vk.n as u32,
        temperature: vk.temperature,
        top_p: vk.top_p,
        top_k: vk.top_k,
        do_sample: vk.do_sample,
        validate: true,
        ..generate_options(cfg, eos, pad, seed)
    }
}

/// This rank's contiguous slice of a batch of `len` prompts. Whole prompts (and so whole
/// GRPO groups) stay on one rank.
pub(super) fn rank_slice(
    len: usize,
    rank: u32,
    world: u32,
) -> anyhow::Result<std::ops::Range<usize>> {
    let world = world.max(1) as usize;
    if !len.is_multiple_of(world) {
        return Err(TrainerError::Rank {
            rank,
            world_size: world as u32,
            message: format!("{len} prompts do not split evenly over {world} data-parallel ranks"),
        }
        .into());
    }
    let per = len / world;
    Ok(rank as usize * per..(rank as usize + 1) * per)
}

pub(super) fn tensor_f32(b: &Batch, name: &str, call: &str) -> anyhow::Result<Tensor<f32>> {
    Ok(b.tensor_in::<f32>(call, name)?)
}

pub(super) fn grid_f64(t: &Tensor<f32>) -> anyhow::Result<Grid<f64>> {
    Ok(Grid::from_f32(t.rows(), t.cols(), &t.data)?)
}

/// A 0/1 mask as floats, the form every host statistic takes.
pub(super) fn mask_grid(t: &Tensor<i64>) -> anyhow::Result<Grid<f64>> {
    Ok(Grid::new(
        t.rows(),
        t.cols(),
        t.data.iter().map(|&m| (m != 0) as u8 as f64).collect(),
    )?)
}

/// A step's generation after [`balance_rollout`]: this rank's rows, and the step's prompts they
/// answer (positions in the step's batch; the batch's `prompt_index` points into this list).
pub(super) struct Balanced {
    pub(super) batch: Batch,
    pub(super) prompts: Vec<usize>,
    pub(super) metrics: Vec<(String, f64)>,
}

/// verl's `trainer.balance_batch`: reorder the step's responses so data-parallel ranks get equal
/// work (verl's `_balance_batch`, by `calculate_workload` of prompt + response lengths). One rank
/// keeps its rows in verl's order (sorted by workload, then zigzagged, which decides the
/// mini-batches); several ranks trade whole prompt groups (verl's PrefixGrouper rule), so each
/// rank's advantages still see whole groups. Reports verl's `global_seqlen/*` metrics.
pub(super) fn balance_rollout(
    cfg: &Config,
    batch: Batch,
    slice: std::ops::Range<usize>,
    dp: &DataLayout,
    ranks: Ranks<'_>,
) -> anyhow::Result<Balanced> {
    let call = "balance_batch";
    let lengths = |b: &Batch| -> anyhow::Result<Vec<i64>> {
        let pm = b.tensor_in::<i64>(call, col::PROMPT_MASK)?;
        let rm = b.tensor_in::<i64>(call, col::RESPONSE_MASK)?;
        Ok((0..pm.rows())
            .map(|r| {
                let ones = |row: &[i64]| row.iter().filter(|&&m| m != 0).count() as i64;
                ones(pm.row(r)) + ones(rm.row(r))
            })
            .collect())
    };
    // Rows answer prompts by their position in the step's whole batch from here on.
    let mut batch = batch;
    let global: Vec<i64> = batch
        .tensor_in::<i64>(call, col::PROMPT_INDEX)?
        .data
        .iter()
        .map(|&i| i + slice.start as i64)
        .collect();
    batch.insert_tensor(col::PROMPT_INDEX, &[global.len()], &global);
    let (all, mine) = if ranks.is_single() || dp.dp_size <= 1 {
        let groups = cfg
            .actor_rollout_ref
            .actor
            .use_prefix_grouper
            .then(|| Groups::from_keys(&global));
        let balanced = verl_algos::balance_batch(&lengths(&batch)?, 1, groups.as_ref())?;
        (balanced, batch)
    } else {
        // Every rank gathers every replica's rows (a few MB, in data-parallel order) and keeps
        // its own share; the partition is computed identically everywhere.
        let whole = ranks.concat_batches(batch)?;
        let ids: Vec<i64> = whole.tensor_in::<i64>(call, col::PROMPT_INDEX)?.data;
        let groups = Groups::from_keys(&ids);
        let balanced =
            verl_algos::balance_batch(&lengths(&whole)?, dp.dp_size as usize, Some(&groups))?;
        (balanced, whole)
    };
    let rank = if dp.dp_size > 1 {
        dp.dp_rank as usize
    } else {
        0
    };
    let mut mine = mine.select_rows(&all.ranks[rank]);
    // The prompts these rows answer, in first-seen order, and each row's place in that list.
    let ids = mine.tensor_in::<i64>(call, col::PROMPT_INDEX)?.data;
    let mut prompts: Vec<usize> = Vec::new();
    let local: Vec<i64> = ids
        .iter()
        .map(|&p| {
            let p = p as usize;
            let at = prompts.iter().position(|&q| q == p).unwrap_or_else(|| {
                prompts.push(p);
                prompts.len() - 1
            });
            at as i64
        })
        .collect();
    mine.insert_tensor(col::PROMPT_INDEX, &[local.len()], &local);
    Ok(Balanced {
        batch: mine,
        prompts,
        metrics: all.metrics,
    })
}

/// A generated batch decoded and scored: texts and sample metadata per response row.
pub(super) struct Rollout {
    pub(super) responses: Tensor<i64>,
    pub(super) response_mask: Tensor<i64>,
    /// Multi-turn: the tokens the model sampled (the tool turns are 0).
    pub(super) loss_mask: Option<Tensor<i64>>,
    pub(super) prompt_index: Vec<usize>,
    pub(super) reward: RewardOutput,
    pub(super) prompt_text: Vec<String>,
    pub(super) response_text: Vec<String>,
    ground_truth: Vec<serde_json::Value>,
}

impl Rollout {
    /// Rows `keep` as verl's generation dump rows, `score(r)` giving row r's score.
    pub(super) fn dump_rows(
        &self,
        keep: impl IntoIterator<Item = usize>,
        score: impl Fn(usize) -> f64,
    ) -> DumpRows {
        let mut rows = DumpRows::default();
        for r in keep {
            rows.push(
                self.prompt_text[r].clone(),
                self.response_text[r].clone(),
                self.ground_truth[r].clone(),
                score(r),
                self.reward
                    .extra
                    .iter()
                    .map(|(k, v)| (k.clone(), v.get(r).copied().unwrap_or(f64::NAN))),
            );
        }
        rows
    }
}

impl Trainer<'_> {
    /// Generates for `samples` with the actor (untimed: the caller's phase times it), decodes
    /// and scores.
    pub(super) fn generate_and_score(
        &mut self,
        samples: &[&Sample],
        indices: &[usize],
        gen: &GenerateOptions,
    ) -> anyhow::Result<Rollout> {
        let prompts = self.enc.encode(samples, indices)?;
        let batch = match &self.agent {
            None => self.workers.actor.generate(&prompts, gen)?,
            Some(agent) => {
                let agent = Arc::clone(agent);
                let n = gen.n.max(1) as usize;
                let mut driver = AgentDriver::new(
                    &self.enc.tokenizer,
                    &self.enc.chat,
                    &agent,
                    samples,
                    n,
                    gen.max_new_tokens as usize,
                )?;
                let mut b = self
                    .workers
                    .actor
                    .generate_turns(&prompts, gen, &mut driver)?;
                driver.finish().add_columns(&mut b);
                b
            }
        };
        self.score(samples, &batch)
    }

    /// The step's rollout of `prompts` (those of `samples`), timed as `gen`: the actor's
    /// responses, or with `multi_turn.enable` the agent loop's conversations (with each row's
    /// turn and tool-call counts as columns), and the tool metrics.
    pub(super) fn roll_out(
        &mut self,
        prompts: &Batch,
        samples: &[&Sample],
        gen: &GenerateOptions,
    ) -> anyhow::Result<(Batch, Vec<(String, f64)>)> {
        let Some(agent) = self.agent.clone() else {
            return Ok((self.workers.generate(prompts, gen)?, Vec::new()));
        };
        let n = gen.n.max(1) as usize;
        let mut driver = AgentDriver::new(
            &self.enc.tokenizer,
            &self.enc.chat,
            &agent,
            samples,
            n,
            gen.max_new_tokens as usize,
        )?;
        let mut batch = self.workers.generate_turns(prompts, gen, &mut driver)?;
        let report = driver.finish();
        report.add_columns(&mut batch);
        Ok((batch, report.metrics()))
    }

    /// Decodes and scores an already generated batch whose `prompt_index` points into `samples`.
    pub(super) fn score(&mut self, samples: &[&Sample], batch: &Batch) -> anyhow::Result<Rollout> {
        let call = format!("{}.actor.generate", self.workers.actor.plugin());
        let responses = batch.tensor_in::<i64>(&call, col::RESPONSES)?;
        let response_mask = batch.tensor_in::<i64>(&call, col::RESPONSE_MASK)?;
        let prompt_ids = batch.tensor_in::<i64>(&call, col::PROMPTS)?;
        let prompt_mask = batch.tensor_in::<i64>(&call, col::PROMPT_MASK)?;
        let prompt_index: Vec<usize> = batch
            .tensor_in::<i64>(&call, col::PROMPT_INDEX)?
            .data
            .iter()
            .map(|&i| i as usize)
            .collect();
        if let Some(bad) = prompt_index.iter().find(|&&i| i >= samples.len()) {
            bail!(
                "{call}: prompt_index {bad} is out of range for {} prompts",
                samples.len()
            );
        }
        let enc = &self.enc;
        let loss_mask = batch.tensor::<i64>(col::LOSS_MASK).ok();
        let num_turns = batch.tensor::<f32>(super::agent::NUM_TURNS).ok();
        let prompt_text = enc.decode_rows(&prompt_ids, &prompt_mask)?;
        let response_text = enc.decode_rows(&responses, &response_mask)?;
        let s = |r: usize| samples[prompt_index[r]];
        let n = prompt_index.len();
        let data_source: Vec<String> = (0..n).map(|r| s(r).data_source.clone()).collect();
        let ground_truth: Vec<serde_json::Value> = (0..n)
            .map(|r| s(r).reward_model.ground_truth.clone())
            .collect();
        // verl's reward loop tells the reward function each row's `num_turns`.
        let extra_info: Vec<serde_json::Value> = (0..n)
            .map(|r| {
                let mut e = s(r).extra_info.clone();
                if let (Some(t), Some(map)) = (&num_turns, e.as_object_mut()) {
                    map.insert("num_turns".into(), serde_json::json!(t.data[r] as i64));
                }
                e
            })
            .collect();
        let raw_prompt: Vec<&[verl_data::Message]> =
            (0..n).map(|r| s(r).prompt.as_slice()).collect();
        let reward = self.rewards.score(
            self.cfg,
            &RewardInput {
                prompt_text: &prompt_text,
                response_text: &response_text,
                data_source: &data_source,
                ground_truth: &ground_truth,
                extra_info: &extra_info,
                responses: &responses,
                response_mask: &response_mask,
                raw_prompt: &raw_prompt,
                prompts: &prompt_ids,
                prompt_mask: &prompt_mask,
                policy_tokenizer: &enc.tokenizer,
            },
        )?;
        Ok(Rollout {
            responses,
            response_mask,
            loss_mask,
            prompt_index,
            reward,
            prompt_text,
            response_text,
            ground_truth,
        })
    }
}
