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
    /// A multi-turn call ([`crate::generate_turns`]): int64 `[B*n, max_new_tokens]`, 1 on the
    /// tokens the model sampled, 0 on the tokens the caller appended between turns (tool
    /// responses, template tokens) and on padding. `None` for a single-turn call, where every
    /// real response token is sampled.
    pub sampled_mask: Option<Tensor>,
}

/// Where the time went in one call (for benchmarks and logging).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GenerationStats {
    /// Real (unpadded) prompt tokens prefilled.
    pub prefill_tokens: usize,
    /// Seconds from the start through the first sampled token being on the host.
    pub prefill_secs: f64,
    /// Token positions run through the model by decode steps (rows still in the batch; the
    /// dense engine also counts finished rows not yet compacted away).
    pub decode_tokens: usize,
    /// Seconds after the first token (the paged engine's later admissions included).
    pub decode_secs: f64,
    /// Decode forward passes.
    pub decode_steps: usize,
    /// Response tokens kept (sum of `response_mask`).
    pub generated_tokens: usize,
    /// KV blocks in the pool (each [`EngineConfig::block_size`] tokens); 0 for the dense engine.
    pub kv_blocks: usize,
    /// Most KV blocks in use at once.
    pub peak_kv_blocks: usize,
    /// Running sequences evicted to free KV blocks (their KV is recomputed on readmission).
    pub preemptions: usize,
    /// Positions run through the model again to rebuild the KV of readmitted sequences, and the
    /// prompt tails of samples that rejoined a shared prompt.
    pub recomputed_tokens: usize,
    /// Prefill forwards (admission rounds).
    pub prefill_steps: usize,
    /// Most sequences decoding at once.
    pub max_running: usize,
    /// Decode CUDA graphs captured, seconds spent capturing them, and decode steps replayed
    /// from them.
    pub cuda_graphs: usize,
    pub cuda_graph_capture_secs: f64,
    pub cuda_graph_steps: usize,
    /// Decode steps queued before the host had recorded the previous step's tokens (async
    /// scheduling: the device does not wait for the host between them).
    pub overlapped_steps: usize,
    /// Multi-turn calls: turns that ended with a stop token and waited for the caller, the
    /// appended (tool / template) tokens run through the model on resuming, the positions
    /// recomputed because a waiting sequence's KV had been evicted, and the seconds the engine
    /// sat with nothing to run while every unfinished sequence waited for the caller (part of
    /// `driver_secs`).
    pub turns: usize,
    pub appended_tokens: usize,
    pub evicted_waiting: usize,
    pub idle_secs: f64,
    /// Multi-turn: seconds spent in the caller's driver (answering, and waiting when idle).
    pub driver_secs: f64,
}

/// How the paged engine lays out its KV cache and schedules sequences. Outputs never depend on
/// it; memory and speed do.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV capacity in tokens (rounded down to whole blocks). `None` = room for every sequence at
    /// once (prompt + `max_new_tokens` each, shared prompts counted once). A GPU caller derives it
    /// from free memory and `rollout.gpu_memory_utilization` with
    /// [`EngineConfig::tokens_for_bytes`]. Must hold at least one longest prompt plus
    /// `max_new_tokens`.
    pub kv_cache_tokens: Option<usize>,
    /// Most sequences decoding at once (`None` = no limit beyond the KV budget).
    pub max_num_seqs: Option<usize>,
    /// Most (padded) positions in one prefill forward; a single longer prompt still runs alone.
    pub max_prefill_tokens: usize,
    /// Replay decode steps from captured CUDA graphs (CUDA, dense models; verl's
    /// `rollout.enforce_eager: false`). Outputs are the same either way.
    pub cuda_graphs: bool,
    /// Batch sizes decode graphs are captured for (`rollout.cudagraph_capture_sizes`); `None`:
    /// 1, 2, 4 and every multiple of 8 up to `max_num_seqs` (at most 512). Larger batches run
    /// eagerly.
    pub cuda_graph_sizes: Option<Vec<usize>>,
    /// On CUDA, decode through fused q/k/v and gate/up projections
    /// ([`verl_nn::Transformer::fuse_decode_weights`]). Their copies take
    /// [`verl_nn::Transformer::decode_fusion_bytes`] for the call, which a KV budget should leave
    /// free.
    pub fuse_weights: bool,
    /// Decode attention through the CUDA paged-attention kernel where the build has it; `false`
    /// gathers the blocks and runs SDPA (the reference the kernel is tested against).
    pub paged_attention_kernel: bool,
    /// When every sequence decodes at once, capture the first decode step's graph during the
    /// prefill; `false` captures it at the bucket's second use, like the others.
    pub precapture_decode_graph: bool,
    /// Async scheduling: queue a graphed decode step before the host has recorded the one before
    /// it; `false`: each step waits for the host.
    pub async_decode: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            kv_cache_tokens: None,
            max_num_seqs: None,
            max_prefill_tokens: 16384,
            cuda_graphs: true,
            cuda_graph_sizes: None,
            fuse_weights: true,
            paged_attention_kernel: true,
            precapture_decode_graph: true,
            async_decode: true,
        }
    }
}

impl EngineConfig {
    /// Bytes one cached token takes in `model`'s KV pool (keys and values of every layer).
    pub fn kv_bytes_per_token(model: &verl_nn::Transformer) -> usize {
        let c = model.shard_config();
        let elem = match model.dtype() {
            tch::Kind::Double => 8,
            tch::Kind::Float => 4,
            _ => 2,
        };
        2 * (c.num_hidden_layers * c.num_key_value_heads * c.head_dim) as usize * elem
    }

    /// The token budget that fits in `bytes` of KV memory for `model`.
    pub fn tokens_for_bytes(model: &verl_nn::Transformer, bytes: usize) -> usize {
        bytes / Self::kv_bytes_per_token(model).max(1)
    }
}
