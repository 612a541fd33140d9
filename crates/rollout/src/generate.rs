//! The public entry points: [`generate`] / [`generate_seeded`] / [`generate_with_stats`] /
//! [`generate_with_config`] validate the call and run the paged engine ([`crate::paged`]).

use tch::Tensor;
use verl_nn::Transformer;

use crate::engine::Job;
use crate::error::Result;
use crate::params::{EngineConfig, Generation, GenerationStats, SamplingParams};

/// Generates `params.n` responses for each of the `B` prompts.
///
/// * `prompts`: int64 `[B, P]`, left-padded (right padding works too: each row continues after
///   its last real token).
/// * `prompt_mask`: `[B, P]` (any integer/bool kind, nonzero = real token); every row needs at
///   least one real token.
///
/// Sample `j` of prompt `i` draws its randomness from a stream keyed by
/// `(seed, params.row_offset + i, j)` only, so a row's tokens do not depend on the other rows of
/// the batch, on the padding width, or on when the scheduler ran it.
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

/// The engine behind [`generate`] / [`generate_seeded`], also reporting timings. Runs with
/// [`EngineConfig::default`]: a KV pool large enough for every sequence at once.
pub fn generate_with_stats(
    model: &Transformer,
    prompts: &Tensor,
    prompt_mask: &Tensor,
    params: &SamplingParams,
    request_seeds: Option<&[u64]>,
) -> Result<(Generation, GenerationStats)> {
    generate_with_config(
        model,
        prompts,
        prompt_mask,
        params,
        request_seeds,
        &EngineConfig::default(),
    )
}

/// [`generate_with_stats`] with an explicit paged-KV / scheduler configuration (block size, KV
/// token budget, concurrency and prefill limits). Outputs do not depend on `config`.
pub fn generate_with_config(
    model: &Transformer,
    prompts: &Tensor,
    prompt_mask: &Tensor,
    params: &SamplingParams,
    request_seeds: Option<&[u64]>,
    config: &EngineConfig,
) -> Result<(Generation, GenerationStats)> {
    let job = Job::new(model, prompts, prompt_mask, params, request_seeds)?;
    crate::paged::run(model, &job, config)
}
