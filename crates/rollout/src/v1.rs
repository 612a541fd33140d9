//! The first engine: prefill once, replicate a dense KV cache per sample, decode the whole batch
//! step by step, compacting finished rows away once they are a quarter of the batch.
//!
//! Kept as the oracle the paged engine is tested against and as the benchmark baseline; callers
//! use [`crate::generate`]. Its costs (what the paged engine removes): the replicated prompt
//! cache, a cache copy on every compaction, finished rows computed until compaction, and GQA keys
//! and values expanded to every query head by each layer of every step.

use std::time::Instant;

use tch::{Kind, Tensor};
use verl_nn::Transformer;

use crate::engine::{Job, Outputs};
use crate::error::Result;
use crate::params::{FinishReason, Generation, GenerationStats};
use crate::rng;
use crate::SamplingParams;

/// [`crate::generate_with_stats`] on the dense-cache engine: same inputs, same outputs (up to
/// floating-point summation order), different speed.
pub fn generate_with_stats(
    model: &Transformer,
    prompts: &Tensor,
    prompt_mask: &Tensor,
    params: &SamplingParams,
    request_seeds: Option<&[u64]>,
) -> Result<(Generation, GenerationStats)> {
    let job = Job::new(model, prompts, prompt_mask, params, request_seeds)?;
    let mut stats = job.new_stats();
    let mut out = job.outputs();
    if params.max_new_tokens > 0 {
        tch::no_grad(|| decode(model, &job, &mut out, &mut stats))?;
    }
    job.finish(out, stats, model.device())
}

fn decode(
    model: &Transformer,
    job: &Job,
    out: &mut Outputs,
    stats: &mut GenerationStats,
) -> Result<()> {
    let device = model.device();
    let (params, sampler) = (&job.params, &job.sampler);
    let (b, p, m) = (job.b as i64, job.p, out.m);
    let rows = job.rows();
    let keys: Vec<u64> = (0..rows).map(|r| job.row_key(r)).collect();

    // Prefill all prompts once. Only the last real position's logits are needed, so the LM head
    // runs on one position per row instead of [B, P, vocab].
    let mut cache = model.new_cache_with_capacity(p + m as i64);
    let hidden = model.forward_hidden(&job.prompts, Some(&job.mask), None, Some(&mut cache))?;
    let last = Tensor::f_arange(p, (Kind::Int64, device))?
        .f_unsqueeze(0)?
        .f_mul(&job.mask)?
        .f_argmax(1, true)?;
    let h = hidden.size()[2];
    let last_hidden =
        hidden.f_gather(1, &last.f_unsqueeze(-1)?.f_expand([b, 1, h], false)?, false)?;
    let mut logits = model.apply_head(&last_hidden, None)?.f_squeeze_dim(1)?;
    drop(hidden);
    if job.per_prompt > 1 {
        let idx: Vec<i64> = (0..rows).map(|r| (r / job.per_prompt) as i64).collect();
        let idx = Tensor::f_from_slice(&idx)?.f_to_device(device)?;
        cache.select_rows(&idx)?;
        logits = logits.f_index_select(0, &idx)?;
    }

    let mut active: Vec<usize> = (0..rows).collect();
    let mut finished = vec![false; rows];
    let mut decode_start = None;
    for t in 0..m {
        let uniforms = if sampler.is_greedy() {
            None
        } else {
            let u: Vec<f32> = active
                .iter()
                .map(|&r| rng::uniform(keys[r], t as u64) as f32)
                .collect();
            Some(crate::paged_attn::upload_f32(&u, device)?)
        };
        let (tokens, lp) = sampler.sample(&logits, uniforms.as_ref())?;
        let (host_tokens, host_lp) = crate::paged::fetch_samples(&tokens, lp.as_ref())?;
        for (k, &r) in active.iter().enumerate() {
            if finished[r] {
                continue;
            }
            let tok = host_tokens[k];
            out.tokens[r * m + t] = tok;
            if let Some(lp) = &host_lp {
                out.log_probs[r * m + t] = lp[k];
            }
            out.lengths[r] = t + 1;
            if !params.ignore_eos && params.eos_token_ids.contains(&tok) {
                finished[r] = true;
                out.finish[r] = FinishReason::Stop;
            }
        }
        if t == 0 {
            stats.prefill_secs = job.start.elapsed().as_secs_f64();
            decode_start = Some(Instant::now());
        }
        if t + 1 == m || active.iter().all(|&r| finished[r]) {
            break;
        }
        let mut next = tokens;
        // Drop finished rows once they are a quarter of the batch: the cache copy is then paid
        // back by the smaller forwards that follow.
        let dead = active.iter().filter(|&&r| finished[r]).count();
        if dead > 0 && dead * 4 >= active.len() {
            let keep: Vec<i64> = (0..active.len() as i64)
                .filter(|&k| !finished[active[k as usize]])
                .collect();
            let keep = Tensor::f_from_slice(&keep)?.f_to_device(device)?;
            cache.select_rows(&keep)?;
            next = next.f_index_select(0, &keep)?;
            active.retain(|&r| !finished[r]);
        }
        let r = active.len() as i64;
        let ones = Tensor::f_ones([r, 1], (Kind::Int64, device))?;
        logits = model
            .forward(&next.f_view([r, 1])?, Some(&ones), None, Some(&mut cache))?
            .f_squeeze_dim(1)?;
        stats.decode_steps += 1;
        stats.decode_tokens += active.len();
    }
    if let Some(s) = decode_start {
        stats.decode_secs = s.elapsed().as_secs_f64();
    }
    Ok(())
}
