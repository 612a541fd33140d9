//! `verl-rollout`: the generation engine (verl's rollout worker, minus the serving layer).
//!
//! Owns: turning left-padded prompt batches into `n` sampled responses each on a
//! [`verl_nn::Transformer`] — a paged KV cache (a block pool sized by a token budget, per-sequence
//! block tables, the `n` samples of a prompt sharing its blocks with copy-on-write), continuous
//! batching (sequences are admitted as others finish, preempted and recomputed when the pool is
//! full), temperature / top-k / top-p / greedy sampling on the device with per-sequence
//! counter-based seeds (a row's tokens never depend on its batch neighbours or on scheduling), EOS
//! handling, and the rollout log-probs PPO needs (`log_softmax(logits / temperature)`).
//!
//! A tensor-parallel shard ([`verl_nn::Transformer::tp_shard`]) runs too: every rank of its group
//! calls the engine with the same inputs and seed, its KV pool holds the rank's key/value heads
//! only, the logits are all-gathered before sampling (so every rank samples the same tokens and
//! the deterministic scheduler makes the same decisions everywhere), and decoding stays eager (no
//! CUDA graphs).
//!
//! Must not: tokenize, apply chat templates, compute rewards or advantages, shard models or move
//! weights between engines (callers own those); keep device memory after a call returns (the
//! hybrid engine trains next); panic (every libtorch call uses tch's fallible `f_*` API and
//! surfaces as [`RolloutError`]). Device-generic: the same code runs on CPU and CUDA.

mod block_pool;
mod engine;
pub mod error;
mod generate;
mod graphs;
mod paged;
mod paged_attn;
mod params;
mod rng;
mod sampler;
mod turns;
pub mod v1;

pub use error::{Result, RolloutError};
pub use generate::{generate, generate_seeded, generate_with_config, generate_with_stats};
pub use params::{EngineConfig, FinishReason, Generation, GenerationStats, SamplingParams};
pub use turns::{generate_turns, Resume, TurnDriver, TurnEnd};

/// The request seed of the prompt with global index `index` in a call seeded `seed`: what the
/// engine derives for prompt `i` from [`SamplingParams::seed`] and `row_offset + i`. Passing these
/// as request seeds lets a caller generate any subset of a batch, in any grouping, exactly as one
/// call over the whole batch would.
pub fn prompt_seed(seed: u64, index: u64) -> u64 {
    rng::derive(seed, index)
}
