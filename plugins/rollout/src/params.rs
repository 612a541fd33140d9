//! What the caller asks for and what it gets back.

use tch::Tensor;

/// Sampling settings for one `generate` call (verl's `actor_rollout_ref.rollout.*` subset).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Samples per prompt (GRPO's group size). The n samples share one prefill.
    pub n: usize,
    /// Response length; outputs are padded to exactly this many columns.
    pub max_new_tokens: usize,
    /// Logits are divided by it before sampling; 0 means greedy.
    pub temperature: f64,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose probability reaches
    /// `top_p` (1.0 disables).
    pub top_p: f64,
    /// Keep only the `top_k` most likely tokens; `<= 0` disables.
    pub top_k: i64,
    /// `false` = greedy (argmax), whatever the temperature.
    pub do_sample: bool,
    /// Base seed; `None` draws one from libtorch's global CPU generator (so `tch::manual_seed`
    /// makes runs reproducible).
    pub seed: Option<u64>,
    /// Global index of this call's first prompt: prompt `i` draws from the stream of prompt
    /// `row_offset + i`, so a batch split over data-parallel ranks samples exactly what one rank
    /// given the whole batch would.
    pub row_offset: u64,
    /// A row stops after emitting any of these (the EOS token is kept, masked 1).
    pub eos_token_ids: Vec<i64>,
    /// Fills response positions after a row stopped.
    pub pad_token_id: i64,
    /// Run every row to `max_new_tokens` even after EOS.
    pub ignore_eos: bool,
    /// Fill [`Generation::log_probs`].
    pub return_log_probs: bool,
}

impl Default for SamplingParams {
    /// One sample, 1.0 temperature, no top-k/top-p, no EOS, 16 new tokens.
    fn default() -> Self {
        SamplingParams {
            n: 1,
            max_new_tokens: 16,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            do_sample: true,
            seed: None,
            row_offset: 0,
            eos_token_ids: Vec::new(),
            pad_token_id: 0,
            ignore_eos: false,
            return_log_probs: false,
        }
    }
}

impl SamplingParams {
    /// Whether tokens are chosen by argmax (no randomness).
    pub fn is_greedy(&self) -> bool {
        !self.do_sample || self.temperature == 0.0
    }
}

/// Why a response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// Emitted an EOS token.
    Stop,
    /// Reached `max_new_tokens`.
    Length,
}

/// The responses of one `generate` call, on the model's device.
#[derive(Debug)]
pub struct Generation {
    /// int64 `[B*n, max_new_tokens]`, right-padded with `pad_token_id`.
    pub responses: Tensor,
    /// int64 `[B*n, max_new_tokens]`: 1 for generated tokens including the EOS token, 0 after.
    pub response_mask: Tensor,
    /// float32 `[B*n, max_new_tokens]`: log-prob of each sampled token under
    /// `log_softmax(logits / temperature)` (the unfiltered sampling distribution, as verl defines
    /// rollout log-probs; temperature 1 when greedy with temperature 0), 0 on padding.
    pub log_probs: Option<Tensor>,
    pub finish_reasons: Vec<FinishReason>,
    /// Row `r` answers prompt `prompt_index[r]`; prompt 0's n samples come first.
    pub prompt_index: Vec<i64>,
}

/// Where the time went in one call (for benchmarks and logging).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GenerationStats {
    /// Real (unpadded) prompt tokens prefilled.
    pub prefill_tokens: usize,
    /// Seconds from the start through the first sampled token being on the host.
    pub prefill_secs: f64,
    /// Token positions run through the model after the first token (rows still in the batch,
    /// finished-but-not-yet-compacted ones included).
    pub decode_tokens: usize,
    /// Seconds of the decode loop after the first token.
    pub decode_secs: f64,
    /// Decode forward passes.
    pub decode_steps: usize,
    /// Response tokens kept (sum of `response_mask`).
    pub generated_tokens: usize,
}
