//! Multi-turn generation: conversations whose turns the caller continues (tool calls, the
//! observations of an environment) while the engine keeps serving every other sequence.
//!
//! A sequence that samples a stop token does not finish: it *waits*, keeping its KV blocks, and
//! the engine reports the turn to the caller's [`TurnDriver`]. The caller answers, now or on a
//! later report, with [`Resume::Continue`] (tokens to append: a tool response rendered by the chat
//! template, then the next assistant header) or [`Resume::Finish`]. Appended tokens go through the
//! model as a prefill of only those positions (the earlier turns' KV is kept), and the sequence
//! samples its next turn in the same continuous batch as everything else. Under memory pressure
//! the KV of waiting sequences is released first; they recompute it when they resume.
//!
//! Token in, token out: a sequence's tokens are exactly the prompt, then everything sampled and
//! appended in order; nothing is decoded and re-encoded. [`crate::Generation::sampled_mask`] marks
//! which response positions the model sampled, and the rollout log-probs are those positions'
//! (0 elsewhere). Sample `j` of prompt `i` draws position `t` of its response from the stream
//! `(seed, i, j, t)` whether position `t - 1` was sampled or appended, so the outputs depend only
//! on the caller's answers, not on when they arrive or on scheduling.

use tch::Tensor;
use verl_nn::Transformer;

use crate::engine::Job;
use crate::error::Result;
use crate::params::{EngineConfig, FinishReason, Generation, GenerationStats, SamplingParams};

/// One sequence's turn, as the engine reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnEnd {
    /// The output row (`prompt * n + sample`).
    pub row: usize,
    /// The tokens sampled in this turn (the stop token included).
    pub tokens: Vec<i64>,
    /// `Stop`: the turn ended with a stop token; `Length`: the response budget is spent.
    pub finish: FinishReason,
    /// The sequence waits for a [`Resume`]; `false` when it is finished (its budget is spent:
    /// a resume for it is an error).
    pub waits: bool,
    /// Response positions used so far (sampled and appended), of `max_new_tokens`.
    pub response_len: usize,
}

/// The caller's answer for a waiting sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// Append `tokens` (masked 0 in [`crate::Generation::sampled_mask`]) and sample the next turn.
    /// The response must keep room for at least one sampled token after them.
    Continue { row: usize, tokens: Vec<i64> },
    /// The conversation is over.
    Finish { row: usize },
}

/// What the engine calls as turns end. `turns` is called after every engine step while any
/// sequence waits (with the turns ended since the last call, possibly none), so answers can
/// arrive as soon as a tool returns; it returns the answers ready now. With `idle` true nothing
/// else can run: it must answer at least one waiting sequence (blocking until it can).
pub trait TurnDriver {
    fn turns(&mut self, ended: Vec<TurnEnd>, idle: bool) -> Result<Vec<Resume>>;
}

/// Multi-turn [`crate::generate_with_config`]: every sample of every prompt is a conversation the
/// `driver` continues turn by turn (see the module docs). Greedy calls decode each sample on its
/// own. Tensor-parallel models are refused (every rank would need the same answers).
pub fn generate_turns(
    model: &Transformer,
    prompts: &Tensor,
    prompt_mask: &Tensor,
    params: &SamplingParams,
    request_seeds: Option<&[u64]>,
    config: &EngineConfig,
    driver: &mut dyn TurnDriver,
) -> Result<(Generation, GenerationStats)> {
    if model.tp_size() > 1 {
        return Err(crate::RolloutError::input(
            "multi-turn generation",
            "a model without tensor parallelism",
            format!("a tensor-parallel shard (tp_size {})", model.tp_size()),
        ));
    }
    let job = Job::new(model, prompts, prompt_mask, params, request_seeds)?.into_turns();
    crate::paged::run_turns(model, &job, config, driver)
}
