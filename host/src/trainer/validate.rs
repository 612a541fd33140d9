//! verl's `_validate`: generate with `rollout.val_kwargs` over the whole validation set, score,
//! and reduce per data source to `val-core/...` / `val-aux/...`, the rows of every rank gathered
//! first so the table is the one a single rank would build.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use verl_data::{DataLoader, Dataset, LoaderOptions, Sample};
use verl_metrics::{
    process_validation_metrics, select_val_generations, validation_metrics, InfoColumn,
    ValGeneration, BOOTSTRAP_SEED,
};
use verl_plugin_api::GenerateOptions;

use super::dump::{dump_generations, DumpRows};
use super::fit::Trainer;
use super::reduce::Ranks;
use super::rollout::{call_seed, rank_slice, validation_options, SALT_VAL};

/// One validation: verl's `val-core/...` metrics, and the samples `trainer.log_val_generations`
/// asks to log (verl's selection; empty when it is 0).
pub(super) struct Validation {
    pub(super) metrics: Vec<(String, f64)>,
    pub(super) generations: Vec<ValGeneration>,
}

/// One validation batch's scored rows on one rank, as sent to the others (floats as bits, so
/// the gathered table is exactly the one a single rank would build).
#[derive(Debug, Default, Serialize, Deserialize)]
struct ValRows {
    /// Prompt and response texts, for `trainer.log_val_generations` (empty when it is 0).
    inputs: Vec<String>,
    outputs: Vec<String>,
    sources: Vec<String>,
    uids: Vec<String>,
    scores: Vec<u64>,
    extra: Vec<(String, Vec<u64>)>,
}

impl Trainer<'_> {
    /// Validates on `ds` at the current step.
    pub(super) fn validate(&mut self, ds: &Arc<Dataset>) -> anyhow::Result<Validation> {
        let cfg = self.cfg;
        let world = self.dp.dp_size.max(1) as usize;
        let mut loader = DataLoader::with_options(
            ds.clone(),
            LoaderOptions::validation(&self.dcfg, ds.len()),
            None,
        )?;
        let (mut sources, mut uids, mut scores) = (Vec::new(), Vec::new(), Vec::new());
        let mut generations = Vec::new();
        let mut extra: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
        let mut batch_no = 0u64;
        let mut dump = DumpRows::default();
        while let Some(b) = loader.next_batch() {
            let real = b.samples.len();
            // verl pads a validation batch to a multiple of the data-parallel size by repeating
            // its first prompts, and drops what the padding generated.
            let padded = real.div_ceil(world) * world;
            let all: Vec<&Sample> = (0..padded).map(|i| &b.samples[i % real]).collect();
            let all_indices: Vec<usize> = (0..padded).map(|i| b.indices[i % real]).collect();
            let slice = rank_slice(padded, self.dp.dp_rank, self.dp.dp_size)?;
            let samples = &all[slice.clone()];
            let gen = GenerateOptions {
                row_offset: slice.start as u64,
                ..validation_options(
                    cfg,
                    &self.enc.eos_ids,
                    self.enc.pad_id,
                    call_seed(cfg.trainer.seed, batch_no, SALT_VAL),
                )
            };
            let r = self.generate_and_score(samples, &all_indices[slice.clone()], &gen)?;
            let keep: Vec<usize> = (0..r.prompt_index.len())
                .filter(|&row| slice.start + r.prompt_index[row] < real)
                .collect();
            let texts = |t: &[String]| -> Vec<String> {
                if cfg.trainer.log_val_generations > 0 {
                    keep.iter().map(|&row| t[row].clone()).collect()
                } else {
                    Vec::new()
                }
            };
            let mine = ValRows {
                inputs: texts(&r.prompt_text),
                outputs: texts(&r.response_text),
                sources: keep
                    .iter()
                    .map(|&row| samples[r.prompt_index[row]].data_source.clone())
                    .collect(),
                uids: keep
                    .iter()
                    .map(|&row| all_indices[slice.start + r.prompt_index[row]].to_string())
                    .collect(),
                scores: keep
                    .iter()
                    .map(|&row| r.reward.scores[row].to_bits())
                    .collect(),
                extra: r
                    .reward
                    .extra
                    .iter()
                    .map(|(k, v)| {
                        let col = keep
                            .iter()
                            .map(|&row| v.get(row).copied().unwrap_or(f64::NAN).to_bits())
                            .collect();
                        (k.clone(), col)
                    })
                    .collect(),
            };
            if cfg.trainer.validation_data_dir.is_some() {
                let part = r.dump_rows(keep.iter().copied(), |row| r.reward.scores[row]);
                let parts = self.ranks.gather(part)?;
                if self.opts.rank == 0 {
                    for p in parts {
                        dump.append(p);
                    }
                }
            }
            for part in self.ranks.gather(mine)? {
                let before = scores.len();
                for ((input, output), &score) in
                    part.inputs.into_iter().zip(part.outputs).zip(&part.scores)
                {
                    generations.push(ValGeneration::new(input, output, f64::from_bits(score)));
                }
                sources.extend(part.sources);
                uids.extend(part.uids);
                scores.extend(part.scores.into_iter().map(f64::from_bits));
                for (k, v) in part.extra {
                    let col = extra.entry(k).or_insert_with(|| vec![f64::NAN; before]);
                    col.resize(before, f64::NAN);
                    col.extend(v.into_iter().map(f64::from_bits));
                }
            }
            batch_no += 1;
        }
        let mut infos = vec![("reward".to_string(), InfoColumn::Numbers(scores.clone()))];
        for (k, mut v) in extra {
            v.resize(scores.len(), f64::NAN);
            if k != "reward" {
                infos.push((k, InfoColumn::Numbers(v)));
            }
        }
        if let Some(dir) = &cfg.trainer.validation_data_dir {
            // The rows were gathered batch by batch above; rank 0 holds them all.
            if self.opts.rank == 0 {
                dump_generations(dir, self.global_step, dump, Ranks::default())?;
            }
        }
        let table = process_validation_metrics(&sources, &uids, &infos, BOOTSTRAP_SEED)?;
        let n = cfg.trainer.log_val_generations as usize;
        Ok(Validation {
            metrics: validation_metrics(&table, None),
            generations: select_val_generations(generations, n),
        })
    }
}
