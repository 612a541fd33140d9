//! What both engines share: a validated call ([`Job`]: input checks, per-prompt seeds) and the
//! host-side response buffers ([`Outputs`]). [`crate::v1`] keeps the dense-cache engine as a test
//! oracle and benchmark baseline.

use tch::{Device, Kind, Tensor};
use verl_nn::{HeadKind, Transformer};

use crate::error::{Result, RolloutError};
use crate::params::{FinishReason, Generation, GenerationStats, SamplingParams};
use crate::rng;
use crate::sampler::Sampler;

/// A validated call: what both engines start from.
pub(crate) struct Job {
    pub start: std::time::Instant,
    pub sampler: Sampler,
    pub params: SamplingParams,
    pub b: usize,
    pub p: i64,
    /// int64 `[B, P]` on the model's device.
    pub prompts: Tensor,
    /// int64 0/1 `[B, P]` on the model's device.
    pub mask: Tensor,
    /// Real tokens per prompt.
    pub real: Vec<i64>,
    /// One seed per prompt.
    pub seeds: Vec<u64>,
    /// Decoded rows per prompt: `n`, or 1 when greedy (the n copies are identical).
    pub per_prompt: usize,
    /// A multi-turn call: every sample is its own conversation (no greedy copies), and the
    /// outputs say which tokens were sampled.
    pub turns: bool,
}

impl Job {
    pub fn new(
        model: &Transformer,
        prompts: &Tensor,
        prompt_mask: &Tensor,
        params: &SamplingParams,
        request_seeds: Option<&[u64]>,
    ) -> Result<Job> {
        let start = std::time::Instant::now();
        let sampler = Sampler::new(params)?;
        let (b, p) = check_inputs(model, prompts, prompt_mask, params)?;
        let device = model.device();
        let prompts = prompts.f_to_device(device)?;
        let mask = prompt_mask
            .f_to_device(device)?
            .f_ne(0)?
            .f_to_kind(Kind::Int64)?;
        let real = Vec::<i64>::try_from(&mask.f_sum_dim_intlist(
            [1i64].as_slice(),
            false,
            Kind::Int64,
        )?)?;
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
                    // Every rank of a tensor-parallel model must draw the same tokens.
                    None if model.tp_size() > 1 => {
                        return Err(RolloutError::input(
                            "SamplingParams.seed",
                            "a seed (or request seeds) with a tensor-parallel model, so every \
                             rank samples the same tokens",
                            "None",
                        ))
                    }
                    None => random_seed()?,
                };
                (0..b as u64)
                    .map(|i| rng::derive(base, params.row_offset + i))
                    .collect()
            }
        };
        let per_prompt = if sampler.is_greedy() { 1 } else { params.n };
        Ok(Job {
            start,
            sampler,
            params: params.clone(),
            b,
            p,
            prompts,
            mask,
            real,
            seeds,
            per_prompt,
            turns: false,
        })
    }

    /// This call runs conversations ([`crate::generate_turns`]): each of the `n` samples of a
    /// prompt decodes on its own even when greedy (what a caller appends between turns may
    /// differ per sample).
    pub fn into_turns(mut self) -> Job {
        self.turns = true;
        self.per_prompt = self.params.n;
        self
    }

    /// Decoded rows: `B * per_prompt`.
    pub fn rows(&self) -> usize {
        self.b * self.per_prompt
    }

    /// The random stream of decoded row `r` (prompt `r / per_prompt`, sample `r % per_prompt`).
    pub fn row_key(&self, r: usize) -> u64 {
        rng::derive(
            self.seeds[r / self.per_prompt],
            (r % self.per_prompt) as u64,
        )
    }

    pub fn new_stats(&self) -> GenerationStats {
        GenerationStats {
            prefill_tokens: self.real.iter().sum::<i64>() as usize,
            ..GenerationStats::default()
        }
    }

    /// Buffers of the right shape for this call's decoded rows.
    pub fn outputs(&self) -> Outputs {
        Outputs::new(
            self.rows(),
            self.params.max_new_tokens,
            self.params.pad_token_id,
            self.turns,
        )
    }

    pub fn finish(
        &self,
        out: Outputs,
        mut stats: GenerationStats,
        device: Device,
    ) -> Result<(Generation, GenerationStats)> {
        stats.generated_tokens = out.lengths.iter().sum();
        let generation = out.into_generation(
            self.b,
            self.per_prompt,
            self.params.n,
            self.params.return_log_probs,
            device,
        )?;
        Ok((generation, stats))
    }
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
    Ok(t.f_int64_value(&[0])? as u64)
}

/// Responses being built on the host, one row per decoded sequence.
pub(crate) struct Outputs {
    pub m: usize,
    pub tokens: Vec<i64>,
    pub log_probs: Vec<f32>,
    pub lengths: Vec<usize>,
    pub finish: Vec<FinishReason>,
    /// Multi-turn calls: whether each position was sampled (`false`: appended by the caller).
    pub sampled: Option<Vec<bool>>,
}

impl Outputs {
    fn new(rows: usize, m: usize, pad: i64, turns: bool) -> Outputs {
        Outputs {
            m,
            tokens: vec![pad; rows * m],
            log_probs: vec![0.0; rows * m],
            lengths: vec![0; rows],
            finish: vec![FinishReason::Length; rows],
            sampled: turns.then(|| vec![false; rows * m]),
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
        let mut sampled = Vec::with_capacity(if self.sampled.is_some() { total * m } else { 0 });
        for r in 0..total {
            let s = src(r);
            tokens.extend_from_slice(&self.tokens[s * m..(s + 1) * m]);
            let len = self.lengths[s];
            mask.extend((0..m).map(|t| i64::from(t < len)));
            if let Some(own) = &self.sampled {
                sampled.extend(own[s * m..(s + 1) * m].iter().map(|&b| i64::from(b)));
            }
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
            sampled_mask: if self.sampled.is_some() {
                Some(to(Tensor::f_from_slice(&sampled)?)?)
            } else {
                None
            },
        })
    }
}
