//! Building blocks of the decoder: linear, RMSNorm, RoPE, attention, dense and MoE MLPs.
//!
//! Numerics mirror transformers' eager/SDPA code paths so fp32 logits agree to ~1e-6: RMSNorm and
//! RoPE tables are computed in fp32 and cast back, router softmax runs in fp32.

use std::sync::Mutex;

use tch::{nn, Device, Kind, Tensor};

use crate::attention_backend::{AttentionBackend, AttentionCall};
use crate::config::{ModelConfig, RopeScaling};
use crate::error::{NnError, Result};
use crate::tp::TpShard;

mod attention;

mod ffn;

mod rows;

/// How freshly created parameters are filled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum InitMode {
    /// HF `_init_weights`: normal(0, std) for matrices, zeros for biases, ones for norms.
    Random { std: f64 },
    /// Zeros everywhere (norms still ones); used when a checkpoint overwrites everything anyway.
    Zeros,
}

/// Creates variables in a `VarStore` under their HF names and remembers them in order.
pub(crate) struct ParamFactory<'a> {
    root: nn::Path<'a>,
    pub init: InitMode,
    pub params: Vec<(String, Tensor)>,
}

impl<'a> ParamFactory<'a> {
    pub fn new(root: nn::Path<'a>, init: InitMode) -> Self {
        ParamFactory {
            root,
            init,
            params: Vec::new(),
        }
    }

    fn create(&mut self, name: &str, dims: &[i64], init: nn::Init) -> Result<Tensor> {
        // tch forbids '.' inside one path component, so walk the HF name component by component;
        // the var-store key then equals the HF name.
        let (prefix, last) = name
            .rsplit_once('.')
            .ok_or_else(|| NnError::input("parameter name", "a dotted HF name", name))?;
        let mut comps = prefix.split('.');
        let mut path = self.root.sub(comps.next().unwrap_or(prefix));
        for c in comps {
            path = path.sub(c);
        }
        let t = path.f_var(last, dims, init)?;
        self.params.push((name.to_string(), t.shallow_clone()));
        Ok(t)
    }

    pub fn matrix(&mut self, name: &str, dims: &[i64]) -> Result<Tensor> {
        let init = match self.init {
            InitMode::Random { std } => nn::Init::Randn {
                mean: 0.0,
                stdev: std,
            },
            InitMode::Zeros => nn::Init::Const(0.0),
        };
        self.create(name, dims, init)
    }

    pub fn zeros(&mut self, name: &str, dims: &[i64]) -> Result<Tensor> {
        self.create(name, dims, nn::Init::Const(0.0))
    }

    pub fn ones(&mut self, name: &str, dims: &[i64]) -> Result<Tensor> {
        self.create(name, dims, nn::Init::Const(1.0))
    }

    pub fn linear(&mut self, prefix: &str, d_in: i64, d_out: i64, bias: bool) -> Result<Linear> {
        let weight = self.matrix(&format!("{prefix}.weight"), &[d_out, d_in])?;
        let bias = if bias {
            Some(self.zeros(&format!("{prefix}.bias"), &[d_out])?)
        } else {
            None
        };
        Ok(Linear {
            weight,
            bias,
            lora: None,
        })
    }

    pub fn rms_norm(&mut self, prefix: &str, dim: i64, eps: f64) -> Result<RmsNorm> {
        Ok(RmsNorm {
            weight: self.ones(&format!("{prefix}.weight"), &[dim])?,
            eps,
        })
    }
}

#[derive(Debug)]
pub(crate) struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    /// A LoRA adapter ([`crate::lora`]), added to every output of this projection while on.
    pub lora: Option<crate::lora::Adapter>,
}

thread_local! {
    /// Set while [`crate::Transformer`] runs a forward + `backward()` with gradient-accumulation
    /// fusion on (see [`crate::Transformer::set_grad_accumulation_fusion`]).
    static ACCUMULATE_INTO_GRAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Turns [`Linear::forward`]'s accumulating backward on for this thread until dropped (restoring
/// the previous setting).
pub(crate) struct AccumulateIntoGrad(bool);

impl AccumulateIntoGrad {
    pub fn set(on: bool) -> Self {
        AccumulateIntoGrad(ACCUMULATE_INTO_GRAD.with(|c| c.replace(on)))
    }
}

impl Drop for AccumulateIntoGrad {
    fn drop(&mut self) {
        ACCUMULATE_INTO_GRAD.with(|c| c.set(self.0));
    }
}

/// Whether this thread is inside a [`crate::Transformer`] forward + `backward()` whose
/// parameter gradients accumulate straight into `.grad` (gradient-accumulation fusion, see
/// [`crate::Transformer::set_grad_accumulation_fusion`]) with autograd recording: code that
/// computes a parameter's gradient by hand (the chunked LM head) then adds it into `.grad` too.
pub fn accumulating_into_grad() -> bool {
    ACCUMULATE_INTO_GRAD.with(|c| c.get()) && verl_torch_ext::grad_enabled()
}

impl Linear {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.forward_base(x)?;
        match &self.lora {
            Some(a) => a.add(y, x),
            None => Ok(y),
        }
    }

    fn forward_base(&self, x: &Tensor) -> Result<Tensor> {
        // Under gradient-accumulation fusion, a trainable weight's gradient is added into its
        // .grad by the weight-gradient GEMM itself.
        if self.weight.requires_grad()
            && ACCUMULATE_INTO_GRAD.with(|c| c.get())
            && verl_torch_ext::grad_enabled()
        {
            return Ok(verl_torch_ext::linear_accumulating(
                x,
                &self.weight,
                self.bias.as_ref(),
            )?);
        }
        decode_linear(x, &self.weight, self.bias.as_ref())
    }

    fn gemm(&self) -> (Tensor, Option<Tensor>) {
        (
            self.weight.shallow_clone(),
            self.bias.as_ref().map(Tensor::shallow_clone),
        )
    }
}

/// `x W^T (+ b)`: inside a generation engine's decode step (a
/// [`verl_torch_ext::tuned_gemm_scope`]) a shape tuned with [`crate::Transformer::tune_decode_gemms`]
/// runs with its timed cuBLASLt algorithm (the same bits as libtorch's GEMM); anything else is
/// libtorch's `linear`.
pub(crate) fn decode_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    if let Some(y) = verl_torch_ext::tuned_linear(x, w, b, false)? {
        return Ok(y);
    }
    Ok(x.f_linear(w, b)?)
}

#[derive(Debug)]
pub(crate) struct RmsNorm {
    pub weight: Tensor,
    pub eps: f64,
}

/// The residual stream between decoder layers: hidden states, possibly with the last block's
/// output not yet added, so that the next RMSNorm can add and normalise in one kernel.
pub(crate) enum Residual {
    Done(Tensor),
    Pending(Tensor, Tensor),
}

impl Residual {
    /// The hidden states (any pending add done) and their RMSNorm under `norm`; `fuse`: the
    /// caller runs without autograd, so the add and the norm may be one kernel.
    pub fn normed(self, norm: &RmsNorm, fuse: bool) -> Result<(Tensor, Tensor)> {
        let (h, delta) = match self {
            Residual::Done(h) => (h, None),
            Residual::Pending(h, d) => (h, Some(d)),
        };
        if fuse && norm.fusable(&h, delta.as_ref()) {
            let (sum, normed) =
                verl_torch_ext::add_rms_norm(&h, delta.as_ref(), &norm.weight, norm.eps)?;
            return Ok((sum.unwrap_or(h), normed));
        }
        if norm.fusable_with_grad(&h, delta.as_ref()) {
            // Under gradient-accumulation fusion the weight's gradient goes into its .grad in
            // the backward's own reduction (no separate accumulation).
            let recorded = if norm.weight.requires_grad() && accumulating_into_grad() {
                verl_torch_ext::add_rms_norm_accumulating
            } else {
                verl_torch_ext::add_rms_norm_autograd
            };
            let (sum, normed) = recorded(&h, delta.as_ref(), &norm.weight, norm.eps)?;
            return Ok((sum.unwrap_or(h), normed));
        }
        let h = match delta {
            Some(d) => h.f_add(&d)?,
            None => h,
        };
        let n = norm.forward(&h)?;
        Ok((h, n))
    }

    /// The hidden states with any pending add done.
    pub fn finish(self) -> Result<Tensor> {
        Ok(match self {
            Residual::Done(h) => h,
            Residual::Pending(h, d) => h.f_add(&d)?,
        })
    }
}

impl RmsNorm {
    /// Whether [`verl_torch_ext::add_rms_norm`] can normalise `x` (+ `delta`): CUDA, bf16/fp16 in
    /// the weight's dtype, nothing that autograd records.
    fn fusable(&self, x: &Tensor, delta: Option<&Tensor>) -> bool {
        let kind = x.kind();
        matches!(kind, Kind::BFloat16 | Kind::Half)
            && self.weight.kind() == kind
            && delta.is_none_or(|d| d.kind() == kind && d.size() == x.size())
            && verl_torch_ext::row_kernels_available(x.device())
            && !(verl_torch_ext::grad_enabled()
                && (x.requires_grad()
                    || self.weight.requires_grad()
                    || delta.is_some_and(|d| d.requires_grad())))
    }

    /// Whether [`verl_torch_ext::add_rms_norm_autograd`] can add and normalise `x` (+ `delta`)
    /// under autograd (a training forward): as [`RmsNorm::fusable`] but recorded, for hidden
    /// sizes its backward takes.
    fn fusable_with_grad(&self, x: &Tensor, delta: Option<&Tensor>) -> bool {
        verl_torch_ext::grad_enabled()
            && (x.requires_grad()
                || self.weight.requires_grad()
                || delta.is_some_and(|d| d.requires_grad()))
            && delta.is_none_or(|d| d.kind() == x.kind() && d.size() == x.size())
            && verl_torch_ext::add_rms_norm_autograd_applies(x, &self.weight)
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        rms_norm(x, &self.weight, self.eps)
    }
}

/// RMSNorm of `x` over its last dimension, scaled by `weight` (differentiable): libtorch's fused
/// `rms_norm` on CUDA when `x` is in the weight's dtype, else
/// HF's formulation (the mean square in fp32, the normalised value cast back, then the weight).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let kind = x.kind();
    if matches!(x.device(), Device::Cuda(_)) && kind == weight.kind() && kind != Kind::Double {
        let dim = weight.size();
        return Ok(x.f_rms_norm(dim.as_slice(), Some(weight), eps)?);
    }
    let xf = x.f_to_kind(Kind::Float)?;
    let var = xf
        .f_pow_tensor_scalar(2)?
        .f_mean_dim([-1i64].as_slice(), true, None::<Kind>)?;
    let normed = xf
        .f_mul(&var.f_add_scalar(eps)?.f_rsqrt()?)?
        .f_to_kind(kind)?;
    Ok(weight.f_mul(&normed)?)
}

/// Rotary position embedding: inverse frequencies (fp32) computed once from the config, in
/// transformers' operation order (so the tables are bit-identical to HF's and every backend's).
#[derive(Debug)]
pub struct Rope {
    inv_freq: Tensor,
}

impl Rope {
    pub fn new(cfg: &ModelConfig, device: Device) -> Result<Rope> {
        let dim = cfg.head_dim;
        let exponent = Tensor::f_arange_start_step(0, dim, 2, (Kind::Int64, Device::Cpu))?
            .f_to_kind(Kind::Float)?
            .f_div_scalar(dim as f64)?;
        let mut inv_freq = Tensor::f_pow_scalar(cfg.rope_theta, &exponent)?.f_reciprocal()?;
        match cfg.rope_scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => inv_freq = inv_freq.f_div_scalar(factor)?,
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old_ctx,
            }) => {
                // Same operation order as transformers' `_compute_llama3_parameters`, so the
                // fp32 table is bit-identical.
                let low_freq_wavelen = old_ctx / low_freq_factor;
                let high_freq_wavelen = old_ctx / high_freq_factor;
                let wavelen = inv_freq
                    .f_reciprocal()?
                    .f_mul_scalar(2.0 * std::f64::consts::PI)?;
                let is_low = wavelen.f_gt(low_freq_wavelen)?;
                let scaled = inv_freq
                    .f_div_scalar(factor)?
                    .f_where_self(&is_low, &inv_freq)?;
                let smooth = wavelen
                    .f_reciprocal()?
                    .f_mul_scalar(old_ctx)?
                    .f_sub_scalar(low_freq_factor)?
                    .f_div_scalar(high_freq_factor - low_freq_factor)?;
                let one_minus = smooth.f_neg()?.f_add_scalar(1.0)?;
                let smoothed = one_minus
                    .f_mul(&scaled)?
                    .f_div_scalar(factor)?
                    .f_add(&smooth.f_mul(&scaled)?)?;
                let is_medium = wavelen
                    .f_lt(high_freq_wavelen)?
                    .f_logical_not()?
                    .f_logical_and(&is_low.f_logical_not()?)?;
                inv_freq = smoothed.f_where_self(&is_medium, &scaled)?;
            }
        }
        Ok(Rope {
            inv_freq: inv_freq.f_to_device(device)?,
        })
    }

    /// `cos`, `sin` of shape `[B, T, head_dim]` in `kind` for integer `position_ids` `[B, T]`.
    pub fn cos_sin(&self, position_ids: &Tensor, kind: Kind) -> Result<(Tensor, Tensor)> {
        let inv = self.inv_freq.f_to_device(position_ids.device())?;
        let freqs = position_ids
            .f_to_kind(Kind::Float)?
            .f_unsqueeze(-1)?
            .f_mul(&inv)?;
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?;
        Ok((emb.f_cos()?.f_to_kind(kind)?, emb.f_sin()?.f_to_kind(kind)?))
    }
}

fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.size().last().copied().unwrap_or(0);
    let x1 = x.f_narrow(-1, 0, d / 2)?;
    let x2 = x.f_narrow(-1, d / 2, d / 2)?;
    Ok(Tensor::f_cat(&[&x2.f_neg()?, &x1], -1)?)
}

/// Plain causal attention of `q` `[B, H, T, D]` over `k`, `v` `[B, KVH, T, D]` (no mask, GQA in
/// the kernel when `KVH < H`): flash attention on CUDA. For rows whose real tokens come first.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    Ok(Tensor::f_scaled_dot_product_attention(
        q,
        k,
        v,
        None::<&Tensor>,
        0.0,
        true,
        None::<f64>,
        q.size()[1] != k.size()[1],
    )?)
}

/// Whether a shared-prompt forward's attention can run through flash attention's varlen kernel
/// ([`VarlenRows`]): `q` `[1, heads, N, D]` half-precision on a CUDA GPU of compute capability 8.0
/// or newer (FlashAttention-2's) and a head size the kernel takes (a multiple of 8, at most 256).
fn varlen_applies(q: &Tensor, head_dim: i64) -> bool {
    let Device::Cuda(index) = q.device() else {
        return false;
    };
    verl_torch_ext::cuda_arch(index).is_some_and(|a| a >= 80)
        && matches!(q.kind(), Kind::BFloat16 | Kind::Half)
        && head_dim % 8 == 0
        && head_dim <= 256
}

/// Rotary position embedding `x · cos + rotate_half(x) · sin`: `x` `[B, heads, T, D]`,
/// `cos`/`sin` `[B, 1, T, D]`. On CUDA one kernel (an autograd node with a one-kernel backward
/// where x needs a gradient), bit-identical to the torch ops; the ops elsewhere.
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if let Some(out) = fused_rope(x, cos, sin)? {
        return Ok(out);
    }
    Ok(x.f_mul(cos)?.f_add(&rotate_half(x)?.f_mul(sin)?)?)
}

/// [`apply_rope`] in one CUDA kernel, bit-identical to the five torch ops: where nothing needs a
/// gradient (generation and scoring forwards) [`verl_torch_ext::rope`], else
/// [`verl_torch_ext::rope_autograd`], whose backward is one kernel too (training forwards).
/// `None` where it does not apply (CPU, a gradient for cos/sin, other layouts).
fn fused_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Option<Tensor>> {
    let applies = matches!(x.device(), Device::Cuda(_))
        && !cos.requires_grad()
        && !sin.requires_grad()
        && x.dim() == 4
        && cos.dim() == 4
        && cos.size()[1] == 1
        && cos.size() == sin.size()
        && cos.kind() == x.kind()
        && sin.kind() == x.kind()
        && verl_torch_ext::row_kernels_available(x.device());
    if !applies {
        return Ok(None);
    }
    let (c, s) = (cos.f_squeeze_dim(1)?, sin.f_squeeze_dim(1)?);
    let (xs, cs) = (x.size(), c.size());
    if !c.is_contiguous() || !s.is_contiguous() || cs != [xs[0], xs[2], xs[3]] {
        return Ok(None);
    }
    if x.requires_grad() {
        return Ok(Some(verl_torch_ext::rope_autograd(x, &c, &s)?));
    }
    Ok(Some(verl_torch_ext::rope(x, &c, &s)?))
}

/// Per-forward inputs shared by all layers.
pub(crate) struct LayerCtx {
    /// `[B, 1, T, D]`
    pub cos: Tensor,
    pub sin: Tensor,
    /// Boolean attention masks `[B, 1, T, L]` (true = may attend), one per distinct window.
    pub masks: Vec<(Option<i64>, Tensor)>,
    /// Every token is real, nothing is cached and no layer has a window: attention is plain
    /// causal (`is_causal`, GQA in the kernel, no mask; flash attention on CUDA) and `masks` is
    /// empty.
    pub causal: bool,
    /// Set by [`crate::Transformer::set_consistent_attention`] on a causal CUDA forward: attention
    /// where nothing needs a gradient runs through the paged decode kernel, one query per
    /// position, so its arithmetic is exactly that of a generation engine's decode steps.
    pub consistent: Option<ConsistentAttention>,
    /// Set for a packed `[1, N]` forward whose attention runs over rows assembled from the
    /// stream ([`AttentionRows`]).
    pub rows: Option<AttentionRows>,
}

/// How a packed forward's `[1, N]` token stream is attended: attention runs over `rows` rows of
/// `len` columns gathered from the stream, each row causal with its real tokens first, and each
/// stream token takes its output from one (row, column). Every other op (projections, norms,
/// MLPs) runs once per stream token. A GRPO group's samples share their prompt this way: the
/// prompt's tokens appear once in the stream and at the head of every sample's row, so they pass
/// through the weights once, and their keys/values reach every sample's response (their
/// gradients summed over the samples by the gather's backward).
#[derive(Debug)]
pub struct AttentionRows {
    /// int64 `[rows * len]`: the stream index at column `c` of row `a` (index `a * len + c`).
    /// Columns past a row's tokens may repeat any stream index: causal attention keeps every
    /// real column from seeing them, and no token takes its output from them.
    pub gather: Tensor,
    /// int64 `[N]`: for each stream token, `a * len + c` of the column that gives its output.
    pub scatter: Tensor,
    pub rows: i64,
    pub len: i64,
    /// The same attention as variable-length sequences, where the stream's order allows it
    /// ([`AttentionRows::from_host`]); CUDA half-precision training and scoring forwards then run
    /// it through flash attention's varlen kernel instead of the padded rows.
    pub varlen: Option<VarlenRows>,
}

/// [`AttentionRows`] as variable-length sequences: row `a`'s queries are the stream tokens
/// `cu_q[a]..cu_q[a+1]` (its output columns, the last ones of its real columns, in order), its keys
/// and values its real columns `kv_gather[cu_k[a]..cu_k[a+1]]`, with a causal mask aligned to the
/// bottom right. No padded column is computed, no query is repeated (a shared prompt's tokens are
/// queries of one row only), and the outputs come out in stream order.
#[derive(Debug)]
pub struct VarlenRows {
    /// int64 `[total_k]`: the stream index of every row's real columns, row after row.
    pub kv_gather: Tensor,
    /// int32 `[rows + 1]`: cumulative query counts.
    pub cu_q: Tensor,
    /// int32 `[rows + 1]`: cumulative key counts.
    pub cu_k: Tensor,
    pub max_q: i64,
    pub max_k: i64,
    /// int64 `[N + 1]` and `[total_k]`: the inverse of `kv_gather` (stream token `n` is read at
    /// positions `kv_sources[kv_offsets[n]..kv_offsets[n + 1]]`), for the gather's backward
    /// ([`verl_torch_ext::gather_rows`]).
    pub kv_offsets: Tensor,
    pub kv_sources: Tensor,
}

/// The host side of [`VarlenRows`]: `(kv_gather, cu_q, cu_k)`, or `None` when the stream's
/// outputs are not row segments in order (see [`AttentionRows::from_host`]).
pub fn varlen_layout(
    gather: &[i64],
    scatter: &[i64],
    rows: i64,
    len: i64,
) -> Option<(Vec<i64>, Vec<i64>, Vec<i64>)> {
    let (rows, len) = (usize::try_from(rows).ok()?, usize::try_from(len).ok()?);
    if len == 0 || gather.len() != rows * len {
        return None;
    }
    // Per row: (queries, last output column + 1), filled in stream order.
    let mut seg: Vec<(usize, usize)> = vec![(0, 0); rows];
    let mut prev_row = 0usize;
    for &o in scatter {
        let o = usize::try_from(o).ok()?;
        let (a, c) = (o / len, o % len);
        if a >= rows || a < prev_row {
            return None;
        }
        let (q, end) = &mut seg[a];
        // Within a row the outputs are consecutive columns; a row's first output may start
        // anywhere (the columns before it are keys only).
        if *q > 0 && c != *end {
            return None;
        }
        *q += 1;
        *end = c + 1;
        prev_row = a;
    }
    let (mut kv, mut cu_q, mut cu_k) = (Vec::new(), vec![0i64], vec![0i64]);
    for (a, &(q, end)) in seg.iter().enumerate() {
        kv.extend_from_slice(&gather[a * len..a * len + end]);
        cu_q.push(cu_q[a] + q as i64);
        cu_k.push(cu_k[a] + end as i64);
    }
    Some((kv, cu_q, cu_k))
}

/// Index tensors that present a causal `[B, T]` forward to the paged decode kernel: the keys and
/// values `[B, T, n_kv, D]` are a cache of `B` blocks of `T` slots, and query `(b, t)` is a
/// sequence whose block table is `[b]` and whose length is `t + 1`.
pub(crate) struct ConsistentAttention {
    /// int64 `[B*T, 1]`.
    pub table: Tensor,
    /// int64 `[B*T]`.
    pub seq_lens: Tensor,
}

impl ConsistentAttention {
    /// For a packed forward: query `i` of the stream reads row `scatter[i] / len` of the
    /// assembled keys/values up to its own column.
    pub fn for_rows(rows: &AttentionRows) -> Result<Self> {
        Ok(ConsistentAttention {
            table: rows
                .scatter
                .f_floor_divide_scalar(rows.len)?
                .f_view([-1, 1])?,
            seq_lens: rows.scatter.f_remainder(rows.len)?.f_add_scalar(1)?,
        })
    }

    /// The kernel over queries `q` `[queries, H, D]` and the key/value rows `k`, `v`
    /// `[rows, len, n_kv, D]` (one split, so each query's arithmetic is a decode step's).
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, head_dim: i64) -> Result<Tensor> {
        // The multi-query kernel: consecutive queries of one row share their keys' loads, each
        // computed as its own decode step (row r's block table is [r]).
        let rows = k.size()[0];
        let table = Tensor::f_arange(rows, (Kind::Int64, q.device()))?.f_view([rows, 1])?;
        Ok(verl_torch_ext::paged_multi_query_attention(
            q,
            k,
            v,
            &table,
            &self.table.f_view([-1])?,
            &self.seq_lens,
            1.0 / (head_dim as f64).sqrt(),
        )?)
    }

    pub fn new(b: i64, t: i64, device: tch::Device) -> Result<Self> {
        let opts = (Kind::Int64, device);
        Ok(ConsistentAttention {
            table: Tensor::f_arange(b, opts)?
                .f_repeat_interleave_self_int(t, Some(0), None)?
                .f_view([b * t, 1])?,
            seq_lens: Tensor::f_arange_start(1, t + 1, opts)?.f_repeat([b])?,
        })
    }
}

impl LayerCtx {
    fn mask(&self, window: Option<i64>) -> Result<&Tensor> {
        self.masks
            .iter()
            .find(|(w, _)| *w == window)
            .map(|(_, m)| m)
            .ok_or_else(|| {
                NnError::input("attention window", format!("{window:?}"), "no mask built")
            })
    }
}

/// One layer's KV-cache entry and where this forward's keys/values go.
pub(crate) struct KvSlot<'a> {
    pub entry: &'a mut Option<(Tensor, Tensor)>,
    /// Tokens already cached.
    pub past: i64,
    /// Preallocated length (write in place), or `None` (grow by concatenation).
    pub capacity: Option<i64>,
}

impl KvSlot<'_> {
    /// Stores `k`, `v` (`[B, n_kv, T, D]`) and returns keys/values over all `past + T` positions.
    fn append(self, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        match self.capacity {
            None => {
                let (k, v) = match self.entry.take() {
                    None => (k, v),
                    Some((pk, pv)) => {
                        (Tensor::f_cat(&[&pk, &k], 2)?, Tensor::f_cat(&[&pv, &v], 2)?)
                    }
                };
                *self.entry = Some((k.shallow_clone(), v.shallow_clone()));
                Ok((k, v))
            }
            Some(cap) => {
                let t = k.size()[2];
                if self.entry.is_none() {
                    let mut shape = k.size();
                    shape[2] = cap;
                    *self.entry = Some((
                        Tensor::f_zeros(&shape, (k.kind(), k.device()))?,
                        Tensor::f_zeros(&shape, (v.kind(), v.device()))?,
                    ));
                }
                let (kb, vb) = self
                    .entry
                    .as_ref()
                    .ok_or_else(|| NnError::input("KV cache", "allocated buffers", "none"))?;
                kb.f_narrow(2, self.past, t)?.f_copy_(&k)?;
                vb.f_narrow(2, self.past, t)?.f_copy_(&v)?;
                Ok((
                    kb.f_narrow(2, 0, self.past + t)?,
                    vb.f_narrow(2, 0, self.past + t)?,
                ))
            }
        }
    }
}

#[derive(Debug)]
pub(crate) struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
    pub window: Option<i64>,
    /// Tensor-parallel shard: this layer holds local heads only and o_proj's output is a partial
    /// sum (see [`crate::tp`]).
    pub tp: Option<TpShard>,
    /// q/k/v weights (and biases) concatenated into one projection while a generation engine
    /// decodes ([`crate::Transformer::fuse_decode_weights`]): one GEMM instead of three.
    fused_qkv: Mutex<Option<(Tensor, Option<Tensor>)>>,
    /// q's, k's and v's LoRA adapters stacked for decoding ([`crate::lora::fuse_adapters`]).
    lora_qkv: Mutex<Option<(Tensor, Tensor)>>,
}

/// `[B, n_kv, L, D]` -> `[B, n_kv * groups, L, D]`, each kv head repeated for its query group.
pub fn repeat_kv(x: &Tensor, groups: i64) -> Result<Tensor> {
    if groups == 1 {
        return Ok(x.shallow_clone());
    }
    let s = x.size();
    Ok(x.f_unsqueeze(2)?
        .f_expand([s[0], s[1], groups, s[2], s[3]], false)?
        .f_reshape([s[0], s[1] * groups, s[2], s[3]])?)
}

/// Whether `silu(gate) * up` over a fused gate/up output `gu` runs as one CUDA kernel
/// ([`verl_torch_ext::swiglu`], bit-identical to the two torch ops, which read the two strided
/// halves slowly). Only reached on no-grad paths (the fused projection is never differentiated).
fn fused_swiglu(gu: &Tensor) -> bool {
    matches!(gu.device(), Device::Cuda(_))
        && !gu.requires_grad()
        && verl_torch_ext::row_kernels_available(gu.device())
}

/// `silu(g) * u`: on CUDA one autograd-recorded kernel forward and one backward
/// ([`verl_torch_ext::silu_mul`], bit-identical to the torch ops and their backward, and it keeps
/// no `silu(g)` for the backward), else the two torch ops.
pub fn silu_mul(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if matches!(g.device(), Device::Cuda(_))
        && g.size() == u.size()
        && g.kind() == u.kind()
        && matches!(g.kind(), Kind::Float | Kind::BFloat16 | Kind::Half)
        && verl_torch_ext::row_kernels_available(g.device())
    {
        return Ok(verl_torch_ext::silu_mul(g, u)?);
    }
    Ok(g.f_silu()?.f_mul(u)?)
}

/// SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
#[derive(Debug)]
pub(crate) struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    /// gate and up weights concatenated while a generation engine decodes (dense layers without
    /// gate/up biases; [`crate::Transformer::fuse_decode_weights`]).
    fused_gate_up: Mutex<Option<Tensor>>,
    /// gate's and up's LoRA adapters stacked for decoding ([`crate::lora::fuse_adapters`]).
    lora_gate_up: Mutex<Option<(Tensor, Tensor)>>,
}

/// Sparse MoE block: softmax router (fp32), top-k, optional renormalisation, optional sigmoid-gated
/// shared expert (Qwen2-MoE). No token dropping, no capacity limit.
#[derive(Debug)]
pub(crate) struct Moe {
    router: Linear,
    experts: Vec<Mlp>,
    top_k: i64,
    norm_topk_prob: bool,
    shared: Option<(Mlp, Linear)>,
}

#[derive(Debug)]
pub(crate) enum FeedForward {
    Dense(Mlp),
    Sparse(Moe),
}

#[derive(Debug)]
pub(crate) struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: FeedForward,
    /// Tensor-parallel shard (see [`crate::tp`]): the MLP holds a block of columns and its output
    /// is a partial sum.
    tp: Option<TpShard>,
}

impl DecoderLayer {
    /// The dense projections of layer `i` under their module names (none for an MoE block's
    /// experts and router: [`crate::lora`] refuses MoE models before asking).
    pub(crate) fn projections_mut(&mut self, i: usize) -> Vec<(String, &mut Linear)> {
        let p = format!("model.layers.{i}");
        let a = &mut self.self_attn;
        let mut out = vec![
            (format!("{p}.self_attn.q_proj"), &mut a.q_proj),
            (format!("{p}.self_attn.k_proj"), &mut a.k_proj),
            (format!("{p}.self_attn.v_proj"), &mut a.v_proj),
            (format!("{p}.self_attn.o_proj"), &mut a.o_proj),
        ];
        if let FeedForward::Dense(m) = &mut self.mlp {
            out.push((format!("{p}.mlp.gate_proj"), &mut m.gate));
            out.push((format!("{p}.mlp.up_proj"), &mut m.up));
            out.push((format!("{p}.mlp.down_proj"), &mut m.down));
        }
        out
    }

    /// Builds (`on`) or drops the decode-time fused projections of this layer (attention q/k/v,
    /// a dense MLP's gate/up; MoE experts stay unfused); returns the bytes they hold.
    pub fn fuse(&self, on: bool) -> Result<usize> {
        let mut bytes = self.self_attn.fuse(on)?;
        if let FeedForward::Dense(mlp) = &self.mlp {
            bytes += mlp.fuse(on)?;
        }
        Ok(bytes)
    }

    /// The (weight, bias) of each GEMM a decode step runs in this layer (dense MLPs; MoE experts
    /// and tensor-parallel shards stay with libtorch).
    pub fn decode_gemms(&self) -> Vec<(Tensor, Option<Tensor>)> {
        let mut out = self.self_attn.decode_gemms();
        if let (FeedForward::Dense(mlp), None) = (&self.mlp, &self.tp) {
            out.extend(mlp.decode_gemms());
        }
        out
    }

    pub fn new(f: &mut ParamFactory, cfg: &ModelConfig, i: usize) -> Result<Self> {
        let p = format!("model.layers.{i}");
        let sparse = cfg
            .moe
            .as_ref()
            .map(|m| m.sparse_layers.get(i).copied().unwrap_or(false))
            .unwrap_or(false);
        let mlp = if sparse {
            // Mixtral keeps the historical module name `block_sparse_moe`.
            let name = if cfg.arch == crate::config::Arch::Mixtral {
                "block_sparse_moe"
            } else {
                "mlp"
            };
            FeedForward::Sparse(Moe::new(f, cfg, &format!("{p}.{name}"))?)
        } else {
            FeedForward::Dense(Mlp::new(
                f,
                &format!("{p}.mlp"),
                ["gate_proj", "up_proj", "down_proj"],
                cfg.hidden_size,
                cfg.intermediate_size,
                cfg.mlp_bias,
            )?)
        };
        Ok(DecoderLayer {
            input_layernorm: f.rms_norm(
                &format!("{p}.input_layernorm"),
                cfg.hidden_size,
                cfg.rms_norm_eps,
            )?,
            self_attn: Attention::new(f, cfg, &format!("{p}.self_attn"), i)?,
            post_attention_layernorm: f.rms_norm(
                &format!("{p}.post_attention_layernorm"),
                cfg.hidden_size,
                cfg.rms_norm_eps,
            )?,
            mlp,
            tp: None,
        })
    }

    /// Makes this layer one tensor-parallel shard (its parameters must already have the local
    /// shapes of [`crate::tp`]'s layout). Dense layers only.
    pub fn set_tp(&mut self, shard: TpShard) -> Result<()> {
        if let FeedForward::Sparse(_) = self.mlp {
            return Err(NnError::input(
                "tensor-parallel layer",
                "a dense MLP",
                "a sparse MoE block",
            ));
        }
        self.self_attn.tp = Some(shard.clone());
        self.tp = Some(shard);
        Ok(())
    }

    pub fn window(&self) -> Option<i64> {
        self.self_attn.window
    }

    pub fn forward(&self, h: &Tensor, ctx: &LayerCtx, kv: Option<KvSlot<'_>>) -> Result<Tensor> {
        self.forward_res(Residual::Done(h.shallow_clone()), ctx, kv, false)?
            .finish()
    }

    /// [`DecoderLayer::forward`] on the residual stream: the MLP's output is left pending for
    /// the next norm. `fuse`: the caller runs without autograd (see [`Residual::normed`]).
    pub(crate) fn forward_res(
        &self,
        res: Residual,
        ctx: &LayerCtx,
        kv: Option<KvSlot<'_>>,
        fuse: bool,
    ) -> Result<Residual> {
        let (h, x) = res.normed(&self.input_layernorm, fuse)?;
        let a = self.self_attn.forward(&x, ctx, kv)?;
        self.finish(h, a, fuse)
    }

    /// [`DecoderLayer::forward_res`] with attention delegated to `backend`.
    pub(crate) fn forward_with_backend(
        &self,
        res: Residual,
        cos: &Tensor,
        sin: &Tensor,
        layer: usize,
        backend: &mut dyn AttentionBackend,
        fuse: bool,
    ) -> Result<Residual> {
        let (h, x) = res.normed(&self.input_layernorm, fuse)?;
        let a = self
            .self_attn
            .forward_with_backend(&x, cos, sin, layer, backend)?;
        self.finish(h, a, fuse)
    }

    /// Residual add and post-attention norm, MLP (its output pending).
    fn finish(&self, h: Tensor, a: Tensor, fuse: bool) -> Result<Residual> {
        let (h, x) = Residual::Pending(h, a).normed(&self.post_attention_layernorm, fuse)?;
        let m = self.feed_forward(&x)?;
        Ok(Residual::Pending(h, m))
    }

    /// The feed-forward block alone (dense MLP or sparse MoE) on normed hidden states `x`.
    pub fn feed_forward(&self, x: &Tensor) -> Result<Tensor> {
        match (&self.mlp, &self.tp) {
            (FeedForward::Dense(mlp), None) => mlp.forward(x),
            (FeedForward::Sparse(moe), None) => moe.forward(x),
            (FeedForward::Dense(mlp), Some(tp)) => mlp.forward_tp(x, tp),
            (FeedForward::Sparse(_), Some(_)) => Err(NnError::input(
                "tensor-parallel layer",
                "a dense MLP",
                "a sparse MoE block",
            )),
        }
    }
}

#[cfg(test)]
mod tests;
