//! The paged KV cache on the device and attention over it.
//!
//! One tensor holds every layer's keys and values, `[layers, 2, blocks, block_size, kv_heads,
//! head_dim]`, so a copy-on-write of a block is one gather/scatter for all layers. A forward's
//! new keys/values are scattered to their slots (`block * block_size + offset`); attention then
//! gathers each sequence's blocks through its block table into a `[S, kv_heads, L, head_dim]`
//! view and runs SDPA with an additive mask built once per forward. This torch formulation works
//! on CPU and CUDA alike (no custom kernel), so CI exercises the GPU code path.
//!
//! GQA: the queries `[S, heads, T, D]` are viewed as `[S, kv_heads, groups * T, D]` (query head
//! `h` belongs to kv head `h / groups`), so keys and values are read once per kv head instead of
//! being expanded to every query head.

use std::collections::HashMap;

use tch::{Device, Kind, Tensor};
use verl_nn::{AttentionBackend, AttentionCall, NnError, Transformer};

use crate::block_pool::TRASH_BLOCK;
use crate::error::{Result, RolloutError};

/// Per-layer views into the pool storage.
struct LayerViews {
    /// `[blocks * block_size, kv_heads, head_dim]`: scatter target of new keys/values.
    k_slots: Tensor,
    v_slots: Tensor,
    /// `[blocks, block_size, kv_heads, head_dim]`: gather source of block tables.
    k_blocks: Tensor,
    v_blocks: Tensor,
}

pub(crate) struct KvPool {
    data: Tensor,
    layers: Vec<LayerViews>,
    block_size: i64,
    /// Decode attention runs the CUDA paged-attention kernel (CUDA with a torch-ext build that
    /// has it, when the engine asks for it); otherwise blocks are gathered and SDPA runs over
    /// them.
    pub kernel: bool,
    /// The model's [`Transformer::consistent_attention`] (with the kernel): every attention,
    /// prefill included, runs through the kernel with one context split, one query per position,
    /// exactly as the training forward computes it under the same switch.
    pub consistent: bool,
}

impl KvPool {
    /// Zero-filled, so positions no sequence wrote (gathered but masked) hold finite values: a
    /// masked key still multiplies its value by weight 0, and `0 * NaN` would poison the output.
    /// A tensor-parallel shard's pool holds its own key/value heads only.
    pub fn new(
        model: &Transformer,
        num_blocks: usize,
        block_size: usize,
        kernel: bool,
    ) -> Result<KvPool> {
        let c = model.shard_config();
        let (nl, nkv, hd) = (c.num_hidden_layers, c.num_key_value_heads, c.head_dim);
        let (nb, bs) = (num_blocks as i64, block_size as i64);
        let data = Tensor::f_zeros([nl, 2, nb, bs, nkv, hd], (model.dtype(), model.device()))?;
        let mut layers = Vec::with_capacity(nl as usize);
        for l in 0..nl {
            let kv = data.f_select(0, l)?;
            let k_blocks = kv.f_select(0, 0)?;
            let v_blocks = kv.f_select(0, 1)?;
            layers.push(LayerViews {
                k_slots: k_blocks.f_view([nb * bs, nkv, hd])?,
                v_slots: v_blocks.f_view([nb * bs, nkv, hd])?,
                k_blocks,
                v_blocks,
            });
        }
        let kernel = kernel && verl_torch_ext::paged_attention_available(model.device());
        tracing::debug!(
            kernel,
            consistent = kernel && model.consistent_attention(),
            "KV pool"
        );
        Ok(KvPool {
            data,
            layers,
            block_size: bs,
            kernel,
            consistent: kernel && model.consistent_attention(),
        })
    }

    /// Compiles (once per process) the kernels of a decode step and runs each once on one row
    /// of the trash block: the paged-attention kernel and the sampler's (with the rest of the
    /// row kernels). A CUDA-graph capture must not be the first to launch them.
    pub fn warm_kernels(
        &self,
        model: &Transformer,
        sampler: &crate::sampler::Sampler,
    ) -> Result<()> {
        let dev = self.data.device();
        if self.kernel {
            let c = model.shard_config();
            let q = Tensor::f_zeros([1, c.num_attention_heads, c.head_dim], (model.dtype(), dev))?;
            let table = Tensor::f_full([1, 1], TRASH_BLOCK as i64, (Kind::Int64, dev))?;
            let lens = Tensor::f_ones([1], (Kind::Int64, dev))?;
            if let Some(l) = self.layers.first() {
                let _ = verl_torch_ext::paged_decode_attention_with(
                    &q,
                    &l.k_blocks,
                    &l.v_blocks,
                    &table,
                    &lens,
                    1.0,
                    None,
                    verl_torch_ext::PagedAttentionOptions {
                        num_splits: usize::from(self.consistent),
                        ..Default::default()
                    },
                )?;
            }
        }
        let logits = Tensor::f_zeros([1, model.shard_config().vocab_size], (Kind::Float, dev))?;
        let u = (!sampler.is_greedy())
            .then(|| Tensor::f_full([1], 0.5, (Kind::Float, dev)))
            .transpose()?;
        let _ = sampler.sample(&logits, u.as_ref())?;
        Ok(())
    }

    /// Copies blocks `src[i]` into `dst[i]` in every layer (copy-on-write of shared blocks).
    pub fn copy_blocks(&self, src: &[u32], dst: &[u32]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let device = self.data.device();
        let idx = |b: &[u32]| -> Result<Tensor> {
            let v: Vec<i64> = b.iter().map(|&x| x as i64).collect();
            upload_i64(&v, device)
        };
        let (src, dst) = (idx(src)?, idx(dst)?);
        let rows = self.data.f_index_select(2, &src)?;
        let mut data = self.data.shallow_clone();
        let _ = data.f_index_copy_(2, &dst, &rows)?;
        Ok(())
    }
}

/// Host-to-device copies that do not synchronise the stream
/// ([`verl_torch_ext::upload_slice`]).
pub(crate) fn upload_i64(v: &[i64], device: Device) -> Result<Tensor> {
    Ok(verl_torch_ext::upload_slice(v, &[v.len() as i64], device)?)
}

pub(crate) fn upload_f32(v: &[f32], device: Device) -> Result<Tensor> {
    Ok(verl_torch_ext::upload_slice(v, &[v.len() as i64], device)?)
}

/// `v` in page-locked host memory for `device` (where it is CUDA) — the source of a
/// [`verl_torch_ext::copy_nonblocking`] into a device buffer.
pub(crate) fn pinned<T: tch::kind::Element>(v: &[T], device: Device) -> Result<Tensor> {
    Ok(verl_torch_ext::pinned_copy(v, &[v.len() as i64], device)?)
}

/// One forward's inputs, built on the host: `S` sequences of up to `T` new tokens each
/// (right-padded), attending over their first `nb` blocks.
#[derive(Debug, Default)]
pub(crate) struct HostBatch {
    pub s: usize,
    pub t: usize,
    pub nb: usize,
    /// `[S*T]` token ids (padding: 0).
    pub ids: Vec<i64>,
    /// `[S*T]` absolute positions (padding: 0, which attends to key 0 only).
    pub pos: Vec<i64>,
    /// `[S*T]` pool slots the new keys/values go to (padding: the trash block).
    pub slots: Vec<i64>,
    /// `[S*nb]` block tables (unused entries: the trash block).
    pub table: Vec<i64>,
    /// `[S]` index of each sequence's last new token (its logits are sampled).
    pub last: Vec<i64>,
    /// No row has cached positions: attention needs only this forward's keys/values.
    pub from_scratch: bool,
}

impl HostBatch {
    pub fn new(s: usize, t: usize, nb: usize) -> HostBatch {
        HostBatch {
            s,
            t,
            nb,
            ids: vec![0; s * t],
            pos: vec![0; s * t],
            slots: vec![0; s * t],
            table: vec![0; s * nb],
            last: vec![0; s],
            from_scratch: true,
        }
    }

    /// Fills row `r`: new tokens `tokens` at positions `past..`, block table `table`.
    pub fn set_row(
        &mut self,
        r: usize,
        tokens: &[i64],
        past: usize,
        table: &[u32],
        block_size: usize,
    ) {
        self.from_scratch &= past == 0;
        for (i, &tok) in tokens.iter().enumerate() {
            let p = past + i;
            let k = r * self.t + i;
            self.ids[k] = tok;
            self.pos[k] = p as i64;
            self.slots[k] = (table[p / block_size] as usize * block_size + p % block_size) as i64;
        }
        for (j, &b) in table.iter().take(self.nb).enumerate() {
            self.table[r * self.nb + j] = b as i64;
        }
        self.last[r] = tokens.len().saturating_sub(1) as i64;
    }

    /// All index data, flat: ids, positions, slots, last indices, then the block tables (last,
    /// so that a decode graph can take a step's per-row data without a table that did not
    /// change: the first [`HostBatch::head_len`] entries).
    pub fn flat(&self) -> Vec<i64> {
        let mut buf = Vec::with_capacity(3 * self.ids.len() + self.table.len() + self.last.len());
        for part in [&self.ids, &self.pos, &self.slots, &self.last, &self.table] {
            buf.extend_from_slice(part);
        }
        buf
    }

    /// Entries of [`HostBatch::flat`] before the block tables.
    pub fn head_len(&self) -> usize {
        3 * self.s * self.t + self.s
    }

    /// All index data in one non-blocking upload.
    fn upload(&self, device: Device) -> Result<DeviceBatch> {
        let all = upload_i64(&self.flat(), device)?;
        DeviceBatch::from_flat(&all, self.s, self.t, self.nb, self.from_scratch)
    }

    /// A copy padded to `s` rows and `nb` block-table columns (`s`, `nb` at least this batch's):
    /// padding rows read and write only the trash block.
    pub fn padded(&self, s: usize, nb: usize) -> HostBatch {
        let mut out = HostBatch::new(s, self.t, nb);
        out.table.fill(TRASH_BLOCK as i64);
        let n = self.s * self.t;
        out.ids[..n].copy_from_slice(&self.ids);
        out.pos[..n].copy_from_slice(&self.pos);
        out.slots[..n].copy_from_slice(&self.slots);
        for r in 0..self.s {
            out.table[r * nb..r * nb + self.nb]
                .copy_from_slice(&self.table[r * self.nb..(r + 1) * self.nb]);
        }
        out.last[..self.s].copy_from_slice(&self.last);
        out.from_scratch = self.from_scratch;
        out
    }
}

pub(crate) struct DeviceBatch {
    ids: Tensor,
    pos: Tensor,
    slots: Tensor,
    table: Tensor,
    last: Tensor,
    s: i64,
    t: i64,
    nb: i64,
    from_scratch: bool,
}

impl DeviceBatch {
    /// Views into `all`, laid out as [`HostBatch::flat`] writes it.
    pub fn from_flat(
        all: &Tensor,
        s: usize,
        t: usize,
        nb: usize,
        from_scratch: bool,
    ) -> Result<DeviceBatch> {
        let (s, t, nb) = (s as i64, t as i64, nb as i64);
        let st = s * t;
        Ok(DeviceBatch {
            ids: all.f_narrow(0, 0, st)?.f_view([s, t])?,
            pos: all.f_narrow(0, st, st)?.f_view([s, t])?,
            slots: all.f_narrow(0, 2 * st, st)?,
            last: all.f_narrow(0, 3 * st, s)?,
            table: all.f_narrow(0, 3 * st + s, s * nb)?,
            s,
            t,
            nb,
            from_scratch,
        })
    }
}

/// [`AttentionBackend`] over the pool for one forward.
struct PagedAttention<'a> {
    pool: &'a KvPool,
    batch: &'a DeviceBatch,
    /// Additive masks `[S, 1, groups*T or 1, L]` per sliding window, built on first use.
    masks: HashMap<Option<i64>, Tensor>,
    /// Decode steps use the CUDA paged-attention kernel ([`KvPool::kernel`]).
    kernel: bool,
    /// `[S]` context lengths of a decode step (positions + 1), built once per forward.
    seq_lens: Option<Tensor>,
}

impl PagedAttention<'_> {
    fn views(&self, layer: usize) -> verl_nn::Result<&LayerViews> {
        self.pool
            .layers
            .get(layer)
            .ok_or_else(|| NnError::InvalidInput {
                what: "paged attention layer".into(),
                expected: format!("< {} layers in the KV pool", self.pool.layers.len()),
                found: layer.to_string(),
            })
    }

    /// `[S]` context lengths of a decode step (positions + 1), built on first use.
    fn seq_lens(&mut self) -> verl_nn::Result<Tensor> {
        if let Some(t) = &self.seq_lens {
            return Ok(t.shallow_clone());
        }
        let b = self.batch;
        let t = b.pos.f_view([b.s])?.f_add_scalar(1)?;
        self.seq_lens = Some(t.shallow_clone());
        Ok(t)
    }

    /// A decode step's attention (`q` `[S, H, D]` contiguous, keys/values already stored) through
    /// the paged-attention kernel, as `[S, H, 1, D]`.
    fn decode_kernel(
        &mut self,
        layer: usize,
        q: &Tensor,
        window: Option<i64>,
    ) -> verl_nn::Result<Tensor> {
        let b = self.batch;
        let qs = q.size();
        let (s, h, d) = (qs[0], qs[1], qs[2]);
        let seq_lens = self.seq_lens()?;
        let out = self.kernel(
            layer,
            q,
            &b.table.f_view([s, b.nb])?,
            &seq_lens,
            window,
            usize::from(self.pool.consistent),
        )?;
        Ok(out.f_view([s, h, 1, d])?)
    }

    /// The paged-attention kernel over layer `layer`'s blocks (`q` `[N, H, D]` contiguous, one
    /// block-table row and one length per query), with `num_splits` context splits (0: auto).
    fn kernel(
        &self,
        layer: usize,
        q: &Tensor,
        table: &Tensor,
        seq_lens: &Tensor,
        window: Option<i64>,
        num_splits: usize,
    ) -> verl_nn::Result<Tensor> {
        let views = self.views(layer)?;
        let d = q.size()[2];
        verl_torch_ext::paged_decode_attention_with(
            q,
            &views.k_blocks,
            &views.v_blocks,
            table,
            seq_lens,
            1.0 / (d as f64).sqrt(),
            window,
            verl_torch_ext::PagedAttentionOptions {
                num_splits,
                ..Default::default()
            },
        )
        .map_err(|e| NnError::InvalidInput {
            what: "paged attention kernel".into(),
            expected: "a launch".into(),
            found: e.to_string(),
        })
    }

    fn mask(
        &mut self,
        window: Option<i64>,
        groups: i64,
        kind: Kind,
    ) -> Result<Tensor, tch::TchError> {
        if let Some(m) = self.masks.get(&window) {
            return Ok(m.shallow_clone());
        }
        let b = self.batch;
        let l = b.nb * self.pool.block_size;
        let keys = Tensor::f_arange(l, (Kind::Int64, b.pos.device()))?.f_view([1, 1, l])?;
        let q = b.pos.f_unsqueeze(-1)?;
        let mut allowed = keys.f_le_tensor(&q)?;
        if let Some(w) = window {
            allowed = allowed.f_logical_and(&keys.f_gt_tensor(&q.f_sub_scalar(w)?)?)?;
        }
        let mask = Tensor::f_zeros([b.s, b.t, l], (kind, b.pos.device()))?
            .f_masked_fill(&allowed.f_logical_not()?, f64::NEG_INFINITY)?
            .f_unsqueeze(1)?;
        // One query per sequence broadcasts over the group axis; several are laid out like the
        // grouped queries, group-major.
        let mask = if b.t == 1 {
            mask
        } else {
            mask.f_unsqueeze(2)?
                .f_expand([b.s, 1, groups, b.t, l], false)?
                .f_reshape([b.s, 1, groups * b.t, l])?
        };
        self.masks.insert(window, mask.shallow_clone());
        Ok(mask)
    }
}

impl AttentionBackend for PagedAttention<'_> {
    /// Decode steps through the kernels: one launch rotates q and k and stores k and v
    /// ([`verl_torch_ext::rope_store`], bit-identical to RoPE's torch ops), then the
    /// paged-attention kernel. Elsewhere (prefill, CPU) the model rotates.
    fn attend_unrotated(
        &mut self,
        call: AttentionCall<'_>,
        cos: &Tensor,
        sin: &Tensor,
    ) -> verl_nn::Result<Option<Tensor>> {
        let qs = call.q.size();
        let (s, t, d) = (qs[0], qs[2], qs[3]);
        let applies = t == 1
            && self.kernel
            && cos.size() == [s, 1, 1, d]
            && sin.size() == [s, 1, 1, d]
            && cos.kind() == call.q.kind()
            && sin.kind() == call.q.kind()
            && verl_torch_ext::row_kernels_available(call.q.device());
        if !applies {
            return Ok(None);
        }
        let flat = |x: &Tensor| x.f_reshape([s, d]).and_then(|x| x.f_contiguous());
        let views = self.views(call.layer)?;
        let q = verl_torch_ext::rope_store(
            &call.q.f_select(2, 0)?,
            &call.k.f_select(2, 0)?,
            &call.v.f_select(2, 0)?,
            &flat(cos)?,
            &flat(sin)?,
            &self.batch.slots,
            &views.k_slots,
            &views.v_slots,
        )
        .map_err(|e| NnError::InvalidInput {
            what: "rope/KV-store kernel".into(),
            expected: "a launch".into(),
            found: e.to_string(),
        })?;
        Ok(Some(self.decode_kernel(call.layer, &q, call.window)?))
    }

    fn attend(&mut self, call: AttentionCall<'_>) -> verl_nn::Result<Tensor> {
        let views = self.views(call.layer)?;
        let qs = call.q.size();
        let (s, h, t, d) = (qs[0], qs[1], qs[2], qs[3]);
        let nkv = call.k.size()[1];
        let groups = h / nkv;
        let b = self.batch;
        let fresh = |x: &Tensor| x.f_transpose(1, 2)?.f_reshape([s * t, nkv, d]);
        let mut k_slots = views.k_slots.shallow_clone();
        let mut v_slots = views.v_slots.shallow_clone();
        let _ = k_slots.f_index_copy_(0, &b.slots, &fresh(call.k)?)?;
        let _ = v_slots.f_index_copy_(0, &b.slots, &fresh(call.v)?)?;
        if self.pool.consistent && t > 1 && call.window.is_none() {
            // Every query as its own decode step (see `KvPool::consistent`): the row of query
            // (s, i) is sequence s's block table, its length the query's position + 1.
            // Consecutive queries of a row share their keys' loads (bit-identical to one decode
            // step per query).
            let q = call
                .q
                .f_transpose(1, 2)?
                .f_contiguous()?
                .f_view([s * t, h, d])?;
            let seq_lens = b.pos.f_view([s * t])?.f_add_scalar(1)?;
            let rows =
                Tensor::f_arange(s * t, (Kind::Int64, q.device()))?.f_floor_divide_scalar(t)?;
            let out = verl_torch_ext::paged_multi_query_attention(
                &q,
                &views.k_blocks,
                &views.v_blocks,
                &b.table.f_view([s, b.nb])?,
                &rows,
                &seq_lens,
                1.0 / (d as f64).sqrt(),
            )
            .map_err(|e| NnError::InvalidInput {
                what: "paged attention kernel (multi-query)".into(),
                expected: "a launch".into(),
                found: e.to_string(),
            })?;
            return Ok(out.f_view([s, t, h, d])?.f_transpose(1, 2)?);
        }
        if b.from_scratch && t > 1 && call.window.is_none() {
            // A prefill of right-padded prompts: each real query sees exactly the keys at or
            // before it, all real and all computed in this forward, so plain causal attention
            // over them needs neither the gather nor a mask (flash attention on CUDA). Padding
            // queries see earlier padding; their outputs are never read.
            return Ok(Tensor::f_scaled_dot_product_attention(
                call.q,
                call.k,
                call.v,
                None::<&Tensor>,
                0.0,
                true,
                None::<f64>,
                true,
            )?);
        }
        if t == 1 && self.kernel {
            // One query per sequence: the paged-attention kernel reads each sequence's keys and
            // values in place through its block table (no gather, no mask).
            let q = call.q.f_reshape([s, h, d])?.f_contiguous()?;
            return self.decode_kernel(call.layer, &q, call.window);
        }
        let l = b.nb * self.pool.block_size;
        let gather = |blocks: &Tensor| -> Result<Tensor, tch::TchError> {
            blocks
                .f_index_select(0, &b.table)?
                .f_view([s, l, nkv, d])?
                .f_transpose(1, 2)
        };
        let (keys, values) = (gather(&views.k_blocks)?, gather(&views.v_blocks)?);
        let mask = self.mask(call.window, groups, call.q.kind())?;
        let q = call.q.f_reshape([s, nkv, groups * t, d])?;
        let out = Tensor::f_scaled_dot_product_attention(
            &q,
            &keys,
            &values,
            Some(&mask),
            0.0,
            false,
            None::<f64>,
            false,
        )?;
        Ok(out.f_reshape([s, h, t, d])?)
    }
}

/// Runs `batch` through `model` against `pool` (storing the new keys/values) and returns the
/// logits of each sequence's last new token, `[S, vocab]`.
pub(crate) fn forward(model: &Transformer, pool: &KvPool, batch: &HostBatch) -> Result<Tensor> {
    if batch.s == 0 || batch.t == 0 {
        return Err(RolloutError::input(
            "paged forward batch",
            "at least one sequence and one token",
            format!("{} sequences x {} tokens", batch.s, batch.t),
        ));
    }
    let dev = batch.upload(model.device())?;
    forward_device(model, pool, &dev)
}

/// [`forward`] on index data already on the device. Launches device work only (no host
/// synchronisation, no uploads), so a CUDA graph can capture it.
pub(crate) fn forward_device(
    model: &Transformer,
    pool: &KvPool,
    dev: &DeviceBatch,
) -> Result<Tensor> {
    // Decode steps under `consistent_attention` run their GEMMs with the algorithms tuned for
    // their batch size (`Transformer::tune_decode_gemms`), row for row the same bits as libtorch's.
    let _tuned = verl_torch_ext::tuned_gemm_scope(dev.t == 1 && pool.consistent);
    let mut backend = PagedAttention {
        pool,
        batch: dev,
        masks: HashMap::new(),
        kernel: pool.kernel,
        seq_lens: None,
    };
    let hidden = model.forward_hidden_with_backend(&dev.ids, &dev.pos, &mut backend)?;
    let last = if dev.t == 1 {
        hidden
    } else {
        let hs = hidden.size()[2];
        let idx = dev
            .last
            .f_view([dev.s, 1, 1])?
            .f_expand([dev.s, 1, hs], false)?;
        hidden.f_gather(1, &idx, false)?
    };
    match model.lm_head_weight() {
        // fp32 logits from the GEMM (see `verl_nn::linear_fp32`), as the training forward's.
        // A tensor-parallel shard's `[S, vocab / tp]` are all-gathered to `[S, vocab]`.
        Some(w) => {
            let x = last.f_view([dev.s, -1])?;
            let logits = match verl_torch_ext::tuned_linear(&x, w, None, true)? {
                Some(y) => y,
                None => verl_nn::linear_fp32(&x, w)?,
            };
            Ok(model.gather_vocab(logits)?)
        }
        None => Ok(model.apply_head(&last, None)?.f_squeeze_dim(1)?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use verl_nn::{ModelConfig, ModelOptions};

    fn model() -> Transformer {
        tch::manual_seed(5);
        let cfg = ModelConfig::from_value(
            serde_json::json!({
                "model_type": "qwen2", "vocab_size": 97, "hidden_size": 32,
                "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "initializer_range": 0.2, "tie_word_embeddings": false,
            }),
            "inline/config.json",
        )
        .unwrap();
        Transformer::new(cfg, &ModelOptions::default()).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    /// Logits of every position of `tokens` from a plain forward: `[T, vocab]`.
    fn reference(m: &Transformer, tokens: &[i64]) -> Tensor {
        let ids = Tensor::from_slice(tokens).unsqueeze(0);
        tch::no_grad(|| m.forward(&ids, None, None, None))
            .unwrap()
            .squeeze_dim(0)
    }

    #[test]
    fn chunked_and_batched_extends_match_a_plain_forward() {
        let m = model();
        let a: Vec<i64> = vec![5, 17, 33, 2, 90, 41, 8, 60, 12];
        let b: Vec<i64> = vec![71, 3, 3, 44];
        let (ra, rb) = (reference(&m, &a), reference(&m, &b));
        let pool = KvPool::new(&m, 8, 3, true).unwrap();
        // Blocks out of order on purpose; block 0 is the trash block.
        let ta = [5u32, 2, 7];
        let tb = [1u32, 4];
        tch::no_grad(|| {
            // Both sequences in one right-padded forward, `a` only partly (its first 4 tokens).
            let mut batch = HostBatch::new(2, 4, 2);
            batch.set_row(0, &a[..4], 0, &ta, 3);
            batch.set_row(1, &b, 0, &tb, 3);
            let logits = forward(&m, &pool, &batch).unwrap();
            assert!(max_diff(&logits.get(0), &ra.get(3)) < 1e-5);
            assert!(max_diff(&logits.get(1), &rb.get(3)) < 1e-5);
            // Then the rest of `a` after its cached prefix, alone.
            let mut batch = HostBatch::new(1, 5, 3);
            batch.set_row(0, &a[4..], 4, &ta, 3);
            let logits = forward(&m, &pool, &batch).unwrap();
            assert!(max_diff(&logits.get(0), &ra.get(8)) < 1e-5);
            // A copied block serves a second sequence that continues `b` differently.
            pool.copy_blocks(&[4], &[6]).unwrap();
            let mut batch = HostBatch::new(1, 1, 2);
            batch.set_row(0, &[9], 4, &[1, 6], 3);
            let logits = forward(&m, &pool, &batch).unwrap();
            let mut b2 = b.clone();
            b2.push(9);
            assert!(max_diff(&logits.get(0), &reference(&m, &b2).get(4)) < 1e-5);
        });
    }
}
