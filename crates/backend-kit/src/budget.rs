//! The generation engine's KV budget for a call, and the checks that every data-parallel rank agrees on a batch's shape.

use tch::{Device, Kind, Tensor};
use verl_nn::Transformer;
use verl_plugin_api::col;

use crate::config::RolloutEngineSection;
use crate::data::{equalize_micro_batches, MicroBatch};
use crate::dp::Dp;
use crate::error::{BackendError, Result, TorchContext};

/// The generation engine's configuration for one call, and where its KV budget came from.
pub struct KvBudget {
    pub config: verl_rollout::EngineConfig,
    /// `gpu_memory_utilization × total − used` in bytes (CUDA only).
    pub budget_bytes: Option<f64>,
    /// KV tokens every sequence of the call needs at most (the engine's default pool).
    pub all_sequences_tokens: usize,
}

impl KvBudget {
    /// Generation metrics (in the output batch's `meta`): the KV pool the engine ran with and how
    /// full it got.
    pub fn metrics(
        &self,
        stats: &verl_rollout::GenerationStats,
    ) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        let tokens = self
            .config
            .kv_cache_tokens
            .unwrap_or(self.all_sequences_tokens);
        m.insert("rollout/kv_cache_tokens".into(), tokens.into());
        m.insert(
            "rollout/kv_cache_source".into(),
            match self.config.kv_cache_tokens {
                Some(_) => "gpu_memory_utilization",
                None => "all sequences",
            }
            .into(),
        );
        if let Some(b) = self.budget_bytes {
            m.insert(
                "rollout/kv_budget_gb".into(),
                (b / (1u64 << 30) as f64).into(),
            );
        }
        m.insert("rollout/kv_blocks".into(), stats.kv_blocks.into());
        m.insert("rollout/peak_kv_blocks".into(), stats.peak_kv_blocks.into());
        m.insert("rollout/preemptions".into(), stats.preemptions.into());
        m.insert("rollout/max_running".into(), stats.max_running.into());
        m.insert("rollout/cuda_graphs".into(), stats.cuda_graphs.into());
        m.insert(
            "rollout/cuda_graph_capture_s".into(),
            stats.cuda_graph_capture_secs.into(),
        );
        m.insert(
            "rollout/cuda_graph_steps".into(),
            stats.cuda_graph_steps.into(),
        );
        m.insert(
            "rollout/overlapped_steps".into(),
            stats.overlapped_steps.into(),
        );
        if stats.turns > 0 || stats.idle_secs > 0.0 {
            // Multi-turn: turns continued, tokens appended between turns, waiting sequences
            // whose KV was evicted, and the time the engine had nothing to run.
            m.insert("rollout/continued_turns".into(), stats.turns.into());
            m.insert(
                "rollout/appended_tokens".into(),
                stats.appended_tokens.into(),
            );
            m.insert(
                "rollout/evicted_waiting".into(),
                stats.evicted_waiting.into(),
            );
            m.insert("rollout/idle_s".into(), stats.idle_secs.into());
            m.insert("rollout/driver_s".into(), stats.driver_secs.into());
            m.insert("rollout/prefill_steps".into(), stats.prefill_steps.into());
        }
        m
    }
}

/// The engine configuration of one generate call: `rollout.max_num_seqs` and
/// `rollout.max_num_batched_tokens` when set; on CUDA a KV cache of
/// `gpu_memory_utilization × total − used` bytes (device memory as `cuMemGetInfo` reports it after
/// the caching allocator's unused blocks are released, taken with the weights resident), capped at what every sequence of the call needs at once; on the CPU
/// (or when the query fails) that everything-fits pool.
pub fn kv_budget(
    model: &Transformer,
    device: Device,
    keys: &RolloutEngineSection,
    prompt_mask: &Tensor,
    params: &verl_rollout::SamplingParams,
) -> Result<KvBudget> {
    let mut config = verl_rollout::EngineConfig::default();
    if let Some(n) = keys.max_num_seqs.filter(|&n| n > 0) {
        config.max_num_seqs = Some(n as usize);
    }
    if let Some(t) = keys.max_num_batched_tokens.filter(|&t| t > 0) {
        config.max_prefill_tokens = t as usize;
    }
    config.cuda_graphs = !keys.enforce_eager;
    if let Some(sizes) = &keys.cudagraph_capture_sizes {
        if sizes.contains(&0) {
            return Err(BackendError::config(
                "actor_rollout_ref.rollout.cudagraph_capture_sizes",
                "a list of batch sizes >= 1 (or null)",
                format!("{sizes:?}"),
            ));
        }
        config.cuda_graph_sizes = Some(sizes.iter().map(|&s| s as usize).collect());
    }
    let util = keys.gpu_memory_utilization;
    if !(util > 0.0 && util <= 1.0) {
        return Err(BackendError::config(
            "actor_rollout_ref.rollout.gpu_memory_utilization",
            "a fraction in (0, 1]",
            util,
        ));
    }
    let lens = Vec::<i64>::try_from(
        &prompt_mask
            .f_ne(0)
            .and_then(|m| m.f_sum_dim_intlist(1, false, Kind::Int64))
            .and_then(|m| m.f_to_device(Device::Cpu))
            .ctx("prompt lengths")?,
    )
    .ctx("prompt lengths")?;
    let (bs, m) = (config.block_size, params.max_new_tokens);
    let per_prompt = if params.is_greedy() {
        1
    } else {
        params.n.max(1)
    };
    let all_sequences_tokens: usize = lens
        .iter()
        .map(|&l| per_prompt * (l as usize + m).div_ceil(bs) * bs)
        .sum();
    let longest = lens.iter().copied().max().unwrap_or(0) as usize;
    let mut budget_bytes = None;
    if let Device::Cuda(gpu) = device {
        // "Used" is what is live (weights, gradients, optimizer state), not what training last
        // touched: the caching allocator's unused segments (the last update's activations) count
        // as free. verl's hybrid engine empties the cache before rollout to the same end; here
        // the pool comes from the same allocator, so the segments stay cached and are only
        // counted (emptying took 61 ms of cudaFree in a traced 0.5B call on an H100).
        match unheld_device_memory(gpu, true) {
            None => tracing::warn!(
                gpu,
                "device memory query failed; the KV cache holds every sequence at once"
            ),
            Some((free, total)) => {
                let used = total.saturating_sub(free) as f64;
                // The engine's fused decode projections are allocated after this query.
                let fusion = if config.fuse_weights {
                    model.decode_fusion_bytes() as f64
                } else {
                    0.0
                };
                let bytes = util * total as f64 - used - fusion;
                budget_bytes = Some(bytes);
                let tokens =
                    verl_rollout::EngineConfig::tokens_for_bytes(model, bytes.max(0.0) as usize);
                let one_seq = (longest + m).div_ceil(bs) * bs;
                if tokens < one_seq {
                    let gib = (1u64 << 30) as f64;
                    return Err(BackendError::config(
                        "actor_rollout_ref.rollout.gpu_memory_utilization",
                        format!(
                            "room for the KV cache of one sequence ({longest} prompt + {m} new tokens = {:.3} GiB) above the {:.2} GiB in use of {:.2} GiB",
                            (one_seq * verl_rollout::EngineConfig::kv_bytes_per_token(model)) as f64 / gib,
                            used / gib,
                            total as f64 / gib
                        ),
                        format!("{util} ({:.3} GiB left for the KV cache)", bytes / gib),
                    ));
                }
                if tokens < all_sequences_tokens {
                    config.kv_cache_tokens = Some(tokens);
                }
            }
        }
    }
    Ok(KvBudget {
        config,
        budget_bytes,
        all_sequences_tokens,
    })
}

/// Fails unless every rank of `dp` got `rows` rows: ranks step through mini-batches (and their
/// collectives) together.
pub fn same_rows_on_every_rank(dp: &Dp, rows: usize, call: &'static str) -> Result<()> {
    if !dp.is_sharded() {
        return Ok(());
    }
    let mut v = [rows as f64, -(rows as f64)];
    dp.all_reduce_max(&mut v)?;
    if v[0] != rows as f64 || -v[1] != rows as f64 {
        return Err(BackendError::Input {
            call,
            column: col::RESPONSES.into(),
            expected: "the same number of rows on every data-parallel rank".into(),
            found: format!(
                "{rows} rows on rank {}, between {} and {} across ranks",
                dp.rank, -v[1], v[0]
            ),
        });
    }
    Ok(())
}

/// The micro-batches of one mini-batch, as many on every rank (see [`equalize_micro_batches`]).
pub fn same_micro_batch_count(dp: &Dp, parts: Vec<Vec<usize>>) -> Result<Vec<MicroBatch>> {
    let mut n = [parts.len() as f64];
    dp.all_reduce_max(&mut n)?;
    Ok(equalize_micro_batches(parts, n[0] as usize))
}

/// Bytes of fp32 LM-head logits an update may keep from a micro-batch's forward for its backward
/// (saving one head GEMM per chunk): a quarter of the device memory no tensor holds now
/// ([`unheld_device_memory`]), so keeping them cannot take the last of it; 0 off CUDA or when
/// the query fails.
pub fn kept_logits_budget(device: Device) -> u64 {
    let Device::Cuda(gpu) = device else { return 0 };
    unheld_device_memory(gpu, false).map_or(0, |(free, _)| free as u64 / 4)
}

/// `(bytes no tensor holds, total bytes)` of CUDA device `gpu`: `cuMemGetInfo`'s free bytes plus
/// the caching allocator's releasable segments ([`verl_torch_ext::CudaMemoryStats::releasable`],
/// what `empty_cache` would hand back, counted without paying for the release). Where the
/// allocator keeps no statistics, the cache is emptied first with `empty_otherwise` (else its
/// segments count as held). `None` when the query fails.
pub(crate) fn unheld_device_memory(gpu: usize, empty_otherwise: bool) -> Option<(usize, usize)> {
    let releasable = match verl_torch_ext::cuda_memory_stats(gpu) {
        Ok(s) => s.releasable,
        Err(_) if !empty_otherwise => 0,
        Err(e) => {
            tracing::debug!("allocator statistics unavailable ({e}); emptying the cache");
            verl_torch_ext::cuda_empty_cache().ok()?;
            0
        }
    };
    verl_comm::nccl::cuda_context(gpu)
        .ok()
        .and_then(|ctx| ctx.mem_get_info().ok())
        .map(|(free, total)| (free.saturating_add(releasable as usize), total))
}

/// Tokens per LM-head chunk: about 256 Mi fp32 logits (1 GiB) per chunk, between 256 and 8192
/// tokens (1766 for a 152k vocabulary).
pub fn head_chunk_tokens(vocab: i64) -> i64 {
    ((1i64 << 28) / vocab.max(1)).clamp(256, 8192)
}
