//! Prefill once, replicate the KV cache per sample, decode step by step.

use std::time::Instant;

use tch::{Device, Kind, Tensor};
use verl_nn::{HeadKind, Transformer};

use crate::error::{Result, RolloutError};
use crate::params::{FinishReason, Generation, GenerationStats, SamplingParams};
use crate::rng;
use crate::sampler::Sampler;

/// Generates `params.n` responses for each of the `B` prompts.
///
/// * `prompts`: int64 `[B, P]`, left-padded (right padding works too: each row continues after
///   its last real token).
/// * `prompt_mask`: `[B, P]` (any integer/bool kind, nonzero = real token); every row needs at
///   least one real token.
///
/// Sample `j` of prompt `i` draws its randomness from a stream keyed by
/// `(seed, params.row_offset + i, j)` only, so a row's tokens do not depend on the other rows of
/// the batch or on the padding width.
pub fn generate(
    model: &Transformer,
    prompts: &Tensor,
    prompt_mask: &Tensor,
    params: &SamplingParams,
) -> Result<Generation> {
    generate_with_stats(model, prompts, prompt_mask, params, None).map(|(g, _)| g)
}

/// [`generate`] with one caller-chosen seed per prompt (`request_seeds[i]` for prompt `i`,
/// `params.seed` unused): a prompt keeps its samples wherever it sits in the batch, which is what
/// a caller that reorders or regroups prompts wants.
pub fn generate_seeded(
    model: &Transformer,
    prompts: &Tensor,
    prompt_mask: &Tensor,
    params: &SamplingParams,
    request_seeds: &[u64],
) -> Result<Generation> {
    generate_with_stats(model, prompts, prompt_mask, params, Some(request_seeds)).map(|(g, _)| g)
}

/// The engine behind [`generate`] / [`generate_seeded`], also reporting timings.
pub fn generate_with_stats(
    model: &Transformer,
    prompts: &Tensor,
    prompt_mask: &Tensor,
    params: &SamplingParams,
    request_seeds: Option<&[u64]>,
) -> Result<(Generation, GenerationStats)> {
    let start = Instant::now();
    let sampler = Sampler::new(params)?;
    let (b, p) = check_inputs(model, prompts, prompt_mask, params)?;
    let device = model.device();
    let prompts = prompts.f_to_device(device)?;
    let mask = prompt_mask
        .f_to_device(device)?
        .f_ne(0)?
        .f_to_kind(Kind::Int64)?;
    let real =
        Vec::<i64>::try_from(&mask.f_sum_dim_intlist([1i64].as_slice(), false, Kind::Int64)?)?;
    if let Some(row) = real.iter().position(|&c| c == 0) {
        return Err(RolloutError::input(
            format!("prompt_mask row {row}"),
            "at least one real token",
            "an all-zero row",
        ));
    }
    let seeds: Vec<u64> = match request_seeds {
        Some(s) if s.len() == b => s.to_vec(),
        Some(s) => {
            return Err(RolloutError::input(
                "request_seeds",
                format!("one seed per prompt ({b})"),
                format!("{} seeds", s.len()),
            ))
        }
        None => {
            let base = match params.seed {
                Some(s) => s,
                None => random_seed()?,
            };
            (0..b as u64)
                .map(|i| rng::derive(base, params.row_offset + i))
                .collect()
        }
    };

    let n = params.n;
    let m = params.max_new_tokens;
    // Greedy samples of one prompt are identical: decode one and copy it n times.
    let per_prompt = if sampler.is_greedy() { 1 } else { n };
    let rows = b * per_prompt;
    let mut stats = GenerationStats {
        prefill_tokens: real.iter().sum::<i64>() as usize,
        ..GenerationStats::default()
    };
    let mut out = Outputs::new(rows, m, params.pad_token_id);
    if m > 0 {
        tch::no_grad(|| {
            decode(
                model,
                &prompts,
                &mask,
                params,
                &sampler,
                Decode {
                    b,
                    p,
                    per_prompt,
                    seeds: &seeds,
                    start,
                },
                &mut out,
                &mut stats,
            )
        })?;
    }
    stats.generated_tokens = out.lengths.iter().sum();
    let generation = out.into_generation(b, per_prompt, n, params.return_log_probs, device)?;
    Ok((generation, stats))
}

fn check_inputs(
    model: &Transformer,
    prompts: &Tensor,
    prompt_mask: &Tensor,
    params: &SamplingParams,
) -> Result<(usize, i64)> {
    if model.head_kind() != HeadKind::CausalLm {
        return Err(RolloutError::input(
            "model head",
            "CausalLm",
            format!("{:?}", model.head_kind()),
        ));
    }
    let s = prompts.size();
    if s.len() != 2 || prompts.kind() != Kind::Int64 || s[0] == 0 || s[1] == 0 {
        return Err(RolloutError::input(
            "prompts",
            "int64 [B, P] with B, P >= 1",
            format!("{:?} {:?}", prompts.kind(), s),
        ));
    }
    if prompt_mask.size() != s {
        return Err(RolloutError::input(
            "prompt_mask",
            format!("shape {s:?} (the prompts')"),
            format!("shape {:?}", prompt_mask.size()),
        ));
    }
    if params.n == 0 {
        return Err(RolloutError::input("SamplingParams.n", ">= 1", "0"));
    }
    let room = model.config().max_position_embeddings;
    let need = s[1] + params.max_new_tokens as i64;
    if room > 0 && need > room {
        return Err(RolloutError::input(
            "prompt length + SamplingParams.max_new_tokens",
            format!("<= max_position_embeddings ({room})"),
            format!("{} + {} = {need}", s[1], params.max_new_tokens),
        ));
    }
    Ok((s[0] as usize, s[1]))
}

/// A fresh base seed from libtorch's global CPU generator.
fn random_seed() -> Result<u64> {
    let t = Tensor::f_randint(i64::MAX, [1], (Kind::Int64, Device::Cpu))?;
    Ok(t.int64_value(&[0]) as u64)
}

struct Decode<'a> {
    b: usize,
    p: i64,
    per_prompt: usize,
    seeds: &'a [u64],
    start: Instant,
}

/// Responses being built on the host, one row per decoded sequence.
struct Outputs {
    m: usize,
    tokens: Vec<i64>,
    log_probs: Vec<f32>,
    lengths: Vec<usize>,
    finish: Vec<FinishReason>,
}

impl Outputs {
    fn new(rows: usize, m: usize, pad: i64) -> Outputs {
        Outputs {
            m,
            tokens: vec![pad; rows * m],
            log_probs: vec![0.0; rows * m],
            lengths: vec![0; rows],
            finish: vec![FinishReason::Length; rows],
        }
    }

    /// `[B*per_prompt]` rows -> `[B*n]` rows (greedy rows repeated n times).
    fn into_generation(
        self,
        b: usize,
        per_prompt: usize,
        n: usize,
        with_log_probs: bool,
        device: Device,
    ) -> Result<Generation> {
        let m = self.m;
        let total = b * n;
        let src = |r: usize| if per_prompt == n { r } else { r / n };
        let mut tokens = Vec::with_capacity(total * m);
        let mut mask = Vec::with_capacity(total * m);
        let mut lps = Vec::with_capacity(if with_log_probs { total * m } else { 0 });
        let mut finish = Vec::with_capacity(total);
        for r in 0..total {
            let s = src(r);
            tokens.extend_from_slice(&self.tokens[s * m..(s + 1) * m]);
            let len = self.lengths[s];
            mask.extend((0..m).map(|t| i64::from(t < len)));
            if with_log_probs {
                lps.extend_from_slice(&self.log_probs[s * m..(s + 1) * m]);
            }
            finish.push(self.finish[s]);
        }
        let shape = [total as i64, m as i64];
        let to = |t: Tensor| -> Result<Tensor> { Ok(t.f_view(shape)?.f_to_device(device)?) };
        Ok(Generation {
            responses: to(Tensor::f_from_slice(&tokens)?)?,
            response_mask: to(Tensor::f_from_slice(&mask)?)?,
            log_probs: if with_log_probs {
                Some(to(Tensor::f_from_slice(&lps)?)?)
            } else {
                None
            },
            finish_reasons: finish,
            prompt_index: (0..total).map(|r| (r / n) as i64).collect(),
        })
    }
}

#[allow(clippy::too_many_arguments)]
fn decode(
    model: &Transformer,
    prompts: &Tensor,
    mask: &Tensor,
    params: &SamplingParams,
    sampler: &Sampler,
    d: Decode<'_>,
    out: &mut Outputs,
    stats: &mut GenerationStats,
) -> Result<()> {
    let device = model.device();
    let (b, p, m) = (d.b as i64, d.p, out.m);
    let rows = d.b * d.per_prompt;
    // One stream per decoded row: (prompt seed, sample index).
    let keys: Vec<u64> = (0..rows)
        .map(|r| rng::derive(d.seeds[r / d.per_prompt], (r % d.per_prompt) as u64))
        .collect();

    // Prefill all prompts once. Only the last real position's logits are needed, so the LM head
    // runs on one position per row instead of [B, P, vocab].
    let mut cache = model.new_cache_with_capacity(p + m as i64);
    let hidden = model.forward_hidden(prompts, Some(mask), None, Some(&mut cache))?;
    let last = Tensor::f_arange(p, (Kind::Int64, device))?
        .f_unsqueeze(0)?
        .f_mul(mask)?
        .f_argmax(1, true)?;
    let h = hidden.size()[2];
    let last_hidden =
        hidden.f_gather(1, &last.f_unsqueeze(-1)?.f_expand([b, 1, h], false)?, false)?;
    let mut logits = model.apply_head(&last_hidden, None)?.f_squeeze_dim(1)?;
    drop(hidden);
    if d.per_prompt > 1 {
        let idx: Vec<i64> = (0..rows).map(|r| (r / d.per_prompt) as i64).collect();
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
            Some(Tensor::f_from_slice(&u)?.f_to_device(device)?)
        };
        let (tokens, lp) = sampler.sample(&logits, uniforms.as_ref())?;
        let host_tokens = Vec::<i64>::try_from(&tokens.f_to_device(Device::Cpu)?)?;
        let host_lp = match &lp {
            Some(lp) => Some(Vec::<f32>::try_from(&lp.f_to_device(Device::Cpu)?)?),
            None => None,
        };
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
            stats.prefill_secs = d.start.elapsed().as_secs_f64();
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
