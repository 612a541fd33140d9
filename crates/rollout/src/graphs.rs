//! CUDA graphs for decode steps (vLLM's `enforce_eager: false`).
//!
//! A decode step of a small model is launch-bound: hundreds of small kernels, each costing the
//! host more time to enqueue than the device to run. A captured graph replays all of them with one
//! launch. Graphs need fixed shapes and addresses, so a step is padded to a *bucket*: the batch
//! rounded up to a capture size (`1, 2, 4, 8, 16, 24, ...`, or `cudagraph_capture_sizes`) and the
//! block-table width rounded up (with the paged-attention kernel, which reads only real
//! positions, to the call's longest sequence where that table is small, so one graph per batch
//! size serves the whole call, else to a power of two; without the kernel to a grid of at most
//! ~25% more key positions, masked). The
//! padding rows read and write only the trash block; the outputs of the real rows are exactly
//! what the eager step computes (same kernels, same shapes up to masked padding).
//!
//! A bucket is captured on its second use (one-off shapes stay eager), into one private memory
//! pool shared by all of this call's graphs, and lives as long as the call's KV pool (the graphs
//! hold its addresses). The call's first full batch is captured ahead instead
//! ([`DecodeGraphs::precapture`]), while the device still runs the prefill. Sampling is captured
//! too: inputs go through one static index buffer and one static uniforms buffer per graph, and
//! the sampled tokens (and their log-probs) come back in the graph's static outputs, so a step is
//! two small uploads, one replay and one small download.
//! Any capture failure logs once and leaves the call eager.

use std::collections::HashMap;
use std::time::Instant;

use tch::{Device, Kind, Tensor};
use verl_nn::Transformer;
use verl_torch_ext::CudaGraph;

use crate::block_pool::TRASH_BLOCK;
use crate::error::Result;
use crate::paged_attn::{self, DeviceBatch, HostBatch, KvPool};
use crate::params::EngineConfig;
use crate::sampler::Sampler;

/// Uses of a bucket before it is captured.
const CAPTURE_AFTER_USES: usize = 2;

/// Largest block table (bytes of int64 entries, all rows of the largest batch) whose full width
/// every paged-kernel graph of a call takes. The whole table is uploaded before each replay, so a
/// wider table costs every step; a capture (~10–15 ms, and its bucket's first use eagerly) is
/// paid once per bucket. Past this size (e.g. 512 rows × 128 blocks of 16 = 2,048 tokens) widths
/// go up in powers of two instead.
const FULL_WIDTH_TABLE_BYTES: usize = 512 << 10;

struct Captured {
    graph: CudaGraph,
    /// The static index buffer the graph reads (`HostBatch::flat` layout).
    input: Tensor,
    /// The block tables last copied into `input` (a step whose tables are the same uploads only
    /// the per-row entries before them).
    table: Vec<i64>,
    /// The static uniforms `[batch bucket]` the sampler reads (`None` when greedy).
    uniforms: Option<Tensor>,
    /// The static sampled tokens `[batch bucket]` the graph writes.
    tokens: Tensor,
    /// Their log-probs, when the call returns them.
    log_probs: Option<Tensor>,
}

pub(crate) struct DecodeGraphs {
    sizes: Vec<usize>,
    graphs: HashMap<(usize, usize), Captured>,
    /// The bucket whose graph owns the shared memory pool.
    pool_owner: Option<(usize, usize)>,
    uses: HashMap<(usize, usize), usize>,
    /// Block-table width of every paged-kernel bucket: the call's longest sequence in blocks, or
    /// 0 (powers of two) where that table is larger than [`FULL_WIDTH_TABLE_BYTES`].
    table_width: usize,
    disabled: bool,
    pub captured: usize,
    pub capture_secs: f64,
    pub replays: usize,
}

/// vLLM's default capture sizes: 1, 2, 4, then every multiple of 8 up to `max`.
fn default_sizes(max: usize) -> Vec<usize> {
    let mut v: Vec<usize> = [1, 2, 4].into_iter().filter(|&s| s <= max).collect();
    v.extend((8..=max).step_by(8));
    if v.last().is_some_and(|&l| l < max) {
        v.push(max);
    }
    v
}

/// Block-table width bucket: `nb` rounded up to an eighth of its next power of two (16 → 16,
/// 17 → 20, 33 → 40, ...; at most 25% more), at least 1.
pub(crate) fn blocks_bucket(nb: usize) -> usize {
    let step = (nb.max(1).next_power_of_two() / 8).max(1);
    nb.max(1).div_ceil(step) * step
}

impl DecodeGraphs {
    /// Graphs for one generate call, or `None` where they do not apply: not CUDA, graphs turned
    /// off (`EngineConfig::cuda_graphs`), a MoE model (its routing synchronises with the host),
    /// or a torch-ext build without CUDA (logged). `max_blocks`: table blocks of the call's
    /// longest possible sequence (longest prompt + `max_new_tokens`).
    pub fn new(
        model: &Transformer,
        config: &EngineConfig,
        max_seqs: usize,
        max_blocks: usize,
    ) -> Option<Self> {
        if !config.cuda_graphs || !matches!(model.device(), Device::Cuda(_)) {
            return None;
        }
        if model.config().moe.is_some() {
            tracing::debug!("CUDA graphs off for decode: MoE routing synchronises with the host");
            return None;
        }
        if !verl_torch_ext::cuda_graphs_compiled() {
            tracing::warn!(
                "CUDA graphs unavailable: the torch-ext shim was built without CUDA headers \
                 (run scripts/setup.sh and rebuild); decoding eagerly"
            );
            return None;
        }
        let mut sizes = match &config.cuda_graph_sizes {
            Some(v) if !v.is_empty() => v.clone(),
            _ => default_sizes(max_seqs.clamp(1, 512)),
        };
        sizes.sort_unstable();
        sizes.dedup();
        sizes.retain(|&s| s > 0);
        Some(DecodeGraphs {
            sizes,
            graphs: HashMap::new(),
            pool_owner: None,
            uses: HashMap::new(),
            table_width: match max_seqs.max(1) * max_blocks.max(1) * 8 {
                b if b <= FULL_WIDTH_TABLE_BYTES => max_blocks.max(1),
                _ => 0,
            },
            disabled: false,
            captured: 0,
            capture_secs: 0.0,
            replays: 0,
        })
    }

    fn bucket(&self, s: usize, nb: usize, kernel: bool) -> Option<(usize, usize)> {
        let sb = *self.sizes.iter().find(|&&b| b >= s)?;
        // The paged-attention kernel reads only each sequence's own positions, so a wide table
        // costs only its upload: the call's widest table (one graph per batch size) where it is
        // small, else powers of two (few graphs, at most twice the upload); the gather path
        // reads the whole table, so it gets the finer grid.
        let nbb = if !kernel {
            blocks_bucket(nb)
        } else if self.table_width > 0 {
            nb.max(self.table_width)
        } else {
            nb.max(1).next_power_of_two()
        };
        Some((sb, nbb))
    }

    /// Whether a decode step of `s` rows over `nb` table blocks would replay a captured graph.
    pub fn ready(&self, s: usize, nb: usize, kernel: bool) -> bool {
        !self.disabled
            && self
                .bucket(s, nb, kernel)
                .is_some_and(|k| self.graphs.contains_key(&k))
    }

    /// The sampled tokens `[batch.s]` (and their log-probs) of a decode step run through a graph,
    /// sampling included, or `None` when the caller should run it eagerly (no bucket, not
    /// captured yet, or graphs failed). `uniforms`: one per row (`None` when greedy).
    ///
    /// `prev`: the rows' input tokens come from the device instead of `batch.ids` — row `r` takes
    /// `tokens[rows[r]]` (`rows` `None`: row `r` takes `tokens[r]`), the tokens a previous step
    /// sampled, so the step can be queued before the host has seen them.
    pub fn decode(
        &mut self,
        model: &Transformer,
        pool: &KvPool,
        batch: &HostBatch,
        sampler: &Sampler,
        uniforms: Option<&[f32]>,
        prev: Option<(&Tensor, Option<&Tensor>)>,
    ) -> Result<Option<(Tensor, Option<Tensor>)>> {
        if self.disabled || batch.t != 1 {
            return Ok(None);
        }
        let Some(key) = self.bucket(batch.s, batch.nb, pool.kernel) else {
            return Ok(None);
        };
        let padded = batch.padded(key.0, key.1);
        let flat = padded.flat();
        let padded_u: Option<Vec<f32>> = uniforms.map(|u| {
            let mut v = vec![0.0f32; key.0];
            v[..u.len()].copy_from_slice(u);
            v
        });
        if !self.graphs.contains_key(&key) {
            let uses = self.uses.entry(key).or_insert(0);
            *uses += 1;
            if *uses < CAPTURE_AFTER_USES {
                return Ok(None);
            }
            match self.capture(
                model,
                pool,
                &padded,
                &flat,
                sampler,
                padded_u.as_deref(),
                1,
                false,
            ) {
                Ok(c) => {
                    self.graphs.insert(key, c);
                    self.pool_owner.get_or_insert(key);
                }
                Err(e) => {
                    tracing::warn!("CUDA graph capture failed, decoding eagerly from here: {e}");
                    self.disabled = true;
                    return Ok(None);
                }
            }
        }
        let c = self.graphs.get_mut(&key).expect("inserted above");
        // Host data goes straight into the graph's static buffers (one pinned host-to-device
        // copy each, queued on the stream: no device staging tensor, no device-to-device copy).
        // The block tables change only when a sequence takes a new block (or the batch
        // changes); otherwise only the per-row entries before them go.
        let dev = model.device();
        if c.table == padded.table {
            let head = padded.head_len();
            verl_torch_ext::copy_nonblocking(
                &c.input.f_narrow(0, 0, head as i64)?,
                &paged_attn::pinned(&flat[..head], dev)?,
            )?;
        } else {
            verl_torch_ext::copy_nonblocking(&c.input, &paged_attn::pinned(&flat, dev)?)?;
            c.table.clone_from(&padded.table);
        }
        if let Some((tokens, rows)) = prev {
            // Token ids lead the flat layout (one per row in a decode step).
            let mut ids = c.input.f_narrow(0, 0, batch.s as i64)?;
            match rows {
                Some(rows) => {
                    let _ = tokens.f_index_select_out(&ids, 0, rows)?;
                }
                None => ids.f_copy_(&tokens.f_narrow(0, 0, batch.s as i64)?)?,
            }
        }
        if let (Some(dst), Some(u)) = (&c.uniforms, &padded_u) {
            verl_torch_ext::copy_nonblocking(dst, &paged_attn::pinned(u, dev)?)?;
        }
        c.graph.replay()?;
        self.replays += 1;
        let s = batch.s as i64;
        let lp = match &c.log_probs {
            Some(l) => Some(l.f_narrow(0, 0, s)?),
            None => None,
        };
        Ok(Some((c.tokens.f_narrow(0, 0, s)?, lp)))
    }

    /// Captures the decode step of the call's first full batch (`s` rows) before any decode
    /// step has run, while the device still runs the prefill queued before it: the host
    /// captures meanwhile, and the bucket's first step replays instead of running eagerly and
    /// then waiting for the device to drain before a capture. Only where one table width
    /// serves the call (the paged kernel within [`FULL_WIDTH_TABLE_BYTES`]). A failure is
    /// logged and leaves the bucket to the usual capture on its second use.
    pub fn precapture(
        &mut self,
        model: &Transformer,
        pool: &KvPool,
        s: usize,
        sampler: &Sampler,
    ) -> Result<()> {
        if self.disabled || !pool.kernel || self.table_width == 0 {
            return Ok(());
        }
        let Some(key) = self.bucket(s, 0, true) else {
            return Ok(());
        };
        if self.graphs.contains_key(&key) {
            return Ok(());
        }
        // Nothing is compiled inside a capture: the kernels a decode step launches are
        // compiled (and run once on the trash block) first.
        pool.warm_kernels(model, sampler)?;
        let mut padded = HostBatch::new(key.0, 1, key.1);
        padded.table.fill(TRASH_BLOCK as i64);
        let flat = padded.flat();
        let uniforms = (!sampler.is_greedy()).then(|| vec![0.5f32; key.0]);
        match self.capture(
            model,
            pool,
            &padded,
            &flat,
            sampler,
            uniforms.as_deref(),
            0,
            true,
        ) {
            Ok(c) => {
                self.graphs.insert(key, c);
                self.pool_owner.get_or_insert(key);
            }
            Err(e) => {
                tracing::debug!("decode graph capture ahead of the first step failed: {e}")
            }
        }
        Ok(())
    }

    /// Captures a graph of one decode step over `padded` (its index data copied into the
    /// graph's static buffer first); `warmup`: eager runs on the side stream before the
    /// capture (after the device has drained), none when the kernels already ran at these
    /// shapes or were warmed otherwise. Under `consistent_attention` the step's GEMMs are tuned
    /// for its batch size first (`wide`: over every cuBLASLt configuration, for the call's first
    /// full batch; else among the heuristic's).
    #[allow(clippy::too_many_arguments)]
    fn capture(
        &mut self,
        model: &Transformer,
        pool: &KvPool,
        padded: &HostBatch,
        flat: &[i64],
        sampler: &Sampler,
        uniforms: Option<&[f32]>,
        warmup: usize,
        wide: bool,
    ) -> Result<Captured> {
        let start = Instant::now();
        if pool.consistent {
            // Once per batch size and process (a device synchronisation; see
            // `Transformer::tune_decode_gemms`), before the capture that bakes the choice in.
            // A failure (e.g. no memory for the reference GEMMs) leaves libtorch's GEMMs.
            let t = Instant::now();
            match model.tune_decode_gemms(padded.s as i64, wide) {
                Ok(g) if g.timed > 0 => tracing::info!(
                    "decode GEMMs for {} rows tuned in {:.2} s ({}): {} of the step's {} GEMM \
                     shapes run a cuBLASLt configuration faster than libtorch's (once per batch \
                     size; kept in the tuning cache file, see VERL_TUNED_GEMMS_CACHE)",
                    padded.s,
                    t.elapsed().as_secs_f64(),
                    if wide {
                        "wide search"
                    } else {
                        "heuristic's algorithms"
                    },
                    g.chosen,
                    g.shapes,
                ),
                Ok(g) if g.from_file > 0 => tracing::info!(
                    "decode GEMMs for {} rows: {} of the step's {} GEMM shapes run a cuBLASLt \
                     configuration, as the tuning cache file says (checked in {:.2} s)",
                    padded.s,
                    g.chosen,
                    g.shapes,
                    t.elapsed().as_secs_f64(),
                ),
                Ok(_) => {}
                Err(e) => tracing::warn!("tuning the decode GEMMs failed, libtorch's stay: {e}"),
            }
        }
        let dev = model.device();
        let input = Tensor::f_zeros([flat.len() as i64], (Kind::Int64, dev))?;
        let src = paged_attn::upload_i64(flat, dev)?;
        let mut dst = input.shallow_clone();
        dst.f_copy_(&src)?;
        let u_static = match uniforms {
            Some(u) => {
                let t = Tensor::f_zeros([u.len() as i64], (Kind::Float, dev))?;
                let src = paged_attn::upload_f32(u, dev)?;
                let mut dst = t.shallow_clone();
                dst.f_copy_(&src)?;
                Some(t)
            }
            None => None,
        };
        let share = self
            .pool_owner
            .and_then(|k| self.graphs.get(&k))
            .map(|c| &c.graph);
        let (graph, (tokens, log_probs)) =
            verl_torch_ext::capture(share, warmup, || -> Result<(Tensor, Option<Tensor>)> {
                let dev_batch = DeviceBatch::from_flat(&input, padded.s, 1, padded.nb, false)?;
                let logits = paged_attn::forward_device(model, pool, &dev_batch)?;
                sampler.sample(&logits, u_static.as_ref())
            })?;
        self.captured += 1;
        self.capture_secs += start.elapsed().as_secs_f64();
        Ok(Captured {
            graph,
            input,
            table: padded.table.clone(),
            uniforms: u_static,
            tokens,
            log_probs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets() {
        assert_eq!(default_sizes(3), vec![1, 2, 3]);
        assert_eq!(default_sizes(4), vec![1, 2, 4]);
        assert_eq!(default_sizes(20), vec![1, 2, 4, 8, 16, 20]);
        assert_eq!(default_sizes(512).len(), 3 + 64);
        // With the paged-attention kernel every table is as wide as the call's longest sequence
        // (one graph per batch size); the gather path keeps its finer grid.
        let g = DecodeGraphs {
            sizes: default_sizes(512),
            graphs: HashMap::new(),
            pool_owner: None,
            uses: HashMap::new(),
            table_width: 48,
            disabled: false,
            captured: 0,
            capture_secs: 0.0,
            replays: 0,
        };
        assert_eq!(g.bucket(512, 17, true), Some((512, 48)));
        assert_eq!(g.bucket(300, 48, true), Some((304, 48)));
        assert_eq!(g.bucket(3, 1, true), Some((4, 48)));
        assert_eq!(g.bucket(8, 60, true), Some((8, 60)));
        assert_eq!(g.bucket(512, 17, false), Some((512, 20)));
        assert_eq!(g.bucket(513, 17, true), None);
        // A table past FULL_WIDTH_TABLE_BYTES (here 512 rows x 1,152 blocks: a 2K prompt and 16K
        // new tokens) grows in powers of two instead of costing every step its full width.
        assert_eq!(FULL_WIDTH_TABLE_BYTES / (512 * 8), 128);
        let long = DecodeGraphs {
            table_width: 0,
            ..g
        };
        assert_eq!(long.bucket(512, 129, true), Some((512, 256)));
        assert_eq!(long.bucket(512, 700, true), Some((512, 1024)));
        assert_eq!(long.bucket(512, 129, false), Some((512, 160)));
        let nb: Vec<usize> = [0, 1, 2, 3, 5, 16, 17, 24, 33, 48, 49, 100]
            .iter()
            .map(|&n| blocks_bucket(n))
            .collect();
        assert_eq!(nb, vec![1, 1, 2, 3, 5, 16, 20, 24, 40, 48, 56, 112]);
        for n in 1..2000 {
            let b = blocks_bucket(n);
            assert!(b >= n && (b as f64) <= n as f64 * 1.25 + 1.0, "{n} -> {b}");
        }
    }
}
