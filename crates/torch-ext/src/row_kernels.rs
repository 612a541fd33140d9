//! Fused per-row kernels over fp32 logits `[rows, vocab]` (CUDA, compiled at run time by NVRTC;
//! see `src/row_kernels.cpp`): next-token sampling, and the log-prob / entropy statistics of an
//! LM head with their gradient. Each reads a row once or twice where the equivalent torch ops make
//! five to ten passes over `[rows, vocab]` fp32 tensors. Callers keep a torch path for CPU
//! ([`row_kernels_available`]).

use std::ffi::{c_char, CStr};

use tch::{Device, Kind, Tensor};

use crate::{adopt, check, vt_free_error, Result, TorchExtError};

type CTensor = *const torch_sys::C_tensor;

extern "C" {
    fn vt_cuda_arch(index: i32, arch: *mut i32) -> *mut c_char;
    fn vt_row_kernels_compile_check(arch: i32, log: *mut *mut c_char) -> *mut c_char;
    fn vt_sample_rows(
        logits: CTensor,
        uniforms: CTensor,
        temperature: f64,
        tokens: CTensor,
        log_probs: CTensor,
    ) -> *mut c_char;
    fn vt_token_stats(
        logits: CTensor,
        targets: CTensor,
        temperature: f64,
        log_probs: CTensor,
        entropy: CTensor,
        lse: CTensor,
        mean: CTensor,
    ) -> *mut c_char;
    fn vt_rope(x: CTensor, cos: CTensor, sin: CTensor, out: CTensor) -> *mut c_char;
    fn vt_swiglu(x: CTensor, out: CTensor) -> *mut c_char;
    fn vt_add_rms_norm(
        x: CTensor,
        delta: CTensor,
        weight: CTensor,
        eps: f64,
        sum: CTensor,
        out: CTensor,
    ) -> *mut c_char;
    fn vt_rope_autograd(
        x: CTensor,
        cos: CTensor,
        sin: CTensor,
        out: *mut *mut torch_sys::C_tensor,
    ) -> *mut c_char;
    fn vt_silu_mul(gate: CTensor, up: CTensor, out: *mut *mut torch_sys::C_tensor) -> *mut c_char;
    fn vt_gather_rows(
        x: CTensor,
        index: CTensor,
        offsets: CTensor,
        sources: CTensor,
        out: *mut *mut torch_sys::C_tensor,
    ) -> *mut c_char;
    fn vt_add_rms_norm_autograd(
        x: CTensor,
        delta: CTensor,
        weight: CTensor,
        eps: f64,
        into_grad: i32,
        sum: *mut *mut torch_sys::C_tensor,
        out: *mut *mut torch_sys::C_tensor,
    ) -> *mut c_char;
    fn vt_inject_grads(
        value: CTensor,
        a: CTensor,
        b: CTensor,
        ga: CTensor,
        gb: CTensor,
        b_into_grad: i32,
        out: *mut *mut torch_sys::C_tensor,
    ) -> *mut c_char;
    #[allow(clippy::too_many_arguments)]
    fn vt_inject_grads_product(
        value: CTensor,
        a: CTensor,
        b: CTensor,
        ga: CTensor,
        lhs: CTensor,
        rhs: CTensor,
        b_into_grad: i32,
        out: *mut *mut torch_sys::C_tensor,
    ) -> *mut c_char;
    #[allow(clippy::too_many_arguments)]
    fn vt_rope_store(
        q: CTensor,
        k: CTensor,
        v: CTensor,
        cos: CTensor,
        sin: CTensor,
        slots: CTensor,
        k_cache: CTensor,
        v_cache: CTensor,
        q_out: CTensor,
    ) -> *mut c_char;
    #[allow(clippy::too_many_arguments)]
    fn vt_token_stats_grad(
        logits: CTensor,
        targets: CTensor,
        lse: CTensor,
        mean: CTensor,
        g_log_probs: CTensor,
        g_entropy: CTensor,
        temperature: f64,
        grad: CTensor,
    ) -> *mut c_char;
}

fn ptr(t: Option<&Tensor>) -> CTensor {
    t.map_or(std::ptr::null(), |t| t.as_ptr())
}

fn torch(op: &'static str) -> impl Fn(tch::TchError) -> TorchExtError {
    move |e| TorchExtError::Torch {
        op,
        message: e.to_string(),
    }
}

/// Whether the row kernels can run on `device` with this build (a CUDA device and a shim
/// compiled with CUDA).
pub fn row_kernels_available(device: Device) -> bool {
    matches!(device, Device::Cuda(_)) && crate::cuda_graphs_compiled()
}

/// The compute capability of CUDA device `index` as `major * 10 + minor` (90 for an H100), read
/// once per device from the driver; `None` without CUDA.
pub fn cuda_arch(index: usize) -> Option<u32> {
    use std::sync::atomic::{AtomicU32, Ordering};
    const UNKNOWN: u32 = u32::MAX;
    static CACHE: [AtomicU32; 16] = [const { AtomicU32::new(UNKNOWN) }; 16];
    if let Some(v) = CACHE.get(index).map(|c| c.load(Ordering::Relaxed)) {
        if v != UNKNOWN {
            return (v != 0).then_some(v);
        }
    }
    let mut arch: i32 = 0;
    // SAFETY: a plain value in, an int out.
    let err = unsafe { vt_cuda_arch(index as i32, &mut arch) };
    let arch = check("cuda_arch", err).map_or(0, |()| arch.max(0) as u32);
    if let Some(c) = CACHE.get(index) {
        c.store(arch, Ordering::Relaxed);
    }
    (arch != 0).then_some(arch)
}

/// Compiles the row kernels for compute capability `arch` (e.g. 90) with NVRTC, without a GPU;
/// returns NVRTC's log (ptxas' register and spill report). Fails with the compiler log.
pub fn row_kernels_compile_check(arch: u32) -> Result<String> {
    let mut log: *mut c_char = std::ptr::null_mut();
    // SAFETY: a plain value in, an optional malloc'ed log out (freed below).
    let err = unsafe { vt_row_kernels_compile_check(arch as i32, &mut log) };
    let text = if log.is_null() {
        String::new()
    } else {
        // SAFETY: a NUL-terminated string malloc'ed by the shim, freed once here.
        let t = unsafe { CStr::from_ptr(log) }
            .to_string_lossy()
            .into_owned();
        unsafe { vt_free_error(log) };
        t
    };
    check("NVRTC row kernels", err)?;
    Ok(text)
}

/// Samples one token per row of `logits` (fp32 `[rows, vocab]`, contiguous, CUDA) without
/// top-k/top-p filtering. `uniforms` (fp32 `[rows]` in `[0, 1)`): the inverse CDF of
/// `softmax(logits / temperature)` in vocabulary order at `u`; `None`: greedy (the first maximal
/// logit). Writes int64 `tokens` `[rows]` and, when given, fp32 `log_probs` `[rows]` of those
/// tokens under `log_softmax(logits / temperature)`. Asynchronous; graph-capturable after a first
/// uncaptured call (which compiles the kernels).
pub fn sample_rows_out(
    logits: &Tensor,
    uniforms: Option<&Tensor>,
    temperature: f64,
    tokens: &Tensor,
    log_probs: Option<&Tensor>,
) -> Result<()> {
    // SAFETY: live tch tensors (or null) borrowed for the call; the shim validates them.
    let err = unsafe {
        vt_sample_rows(
            logits.as_ptr(),
            ptr(uniforms),
            temperature,
            tokens.as_ptr(),
            ptr(log_probs),
        )
    };
    check("sample_rows", err)
}

/// [`sample_rows_out`] into new tensors: `(tokens, log_probs if want_log_probs)`.
pub fn sample_rows(
    logits: &Tensor,
    uniforms: Option<&Tensor>,
    temperature: f64,
    want_log_probs: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let rows = logits.size().first().copied().unwrap_or(0);
    let dev = logits.device();
    let tokens = Tensor::f_empty([rows], (Kind::Int64, dev)).map_err(torch("empty"))?;
    let lp = if want_log_probs {
        Some(Tensor::f_empty([rows], (Kind::Float, dev)).map_err(torch("empty"))?)
    } else {
        None
    };
    sample_rows_out(logits, uniforms, temperature, &tokens, lp.as_ref())?;
    Ok((tokens, lp))
}

/// Per-row statistics of `softmax(logits / temperature)`, all fp32 `[rows]`.
#[derive(Debug)]
pub struct RowStats {
    /// `log_softmax(logits / T)[target]`.
    pub log_probs: Tensor,
    /// `logsumexp - E_p[logits / T]`, when asked.
    pub entropy: Option<Tensor>,
    /// `logsumexp(logits / T)`.
    pub lse: Tensor,
    /// `E_p[logits / T]`.
    pub mean: Tensor,
}

/// [`RowStats`] of fp32 `logits` `[rows, vocab]` (contiguous, CUDA) at int64 `targets` `[rows]`,
/// in one pass over each row. An out-of-range target gives a NaN log-prob.
pub fn token_stats(
    logits: &Tensor,
    targets: &Tensor,
    temperature: f64,
    with_entropy: bool,
) -> Result<RowStats> {
    let rows = logits.size().first().copied().unwrap_or(0);
    let opts = (Kind::Float, logits.device());
    let new = || Tensor::f_empty([rows], opts).map_err(torch("empty"));
    let (log_probs, lse, mean) = (new()?, new()?, new()?);
    let entropy = if with_entropy { Some(new()?) } else { None };
    // SAFETY: live tch tensors (or null) borrowed for the call; the shim validates them.
    let err = unsafe {
        vt_token_stats(
            logits.as_ptr(),
            targets.as_ptr(),
            temperature,
            log_probs.as_ptr(),
            ptr(entropy.as_ref()),
            lse.as_ptr(),
            mean.as_ptr(),
        )
    };
    check("token_stats", err)?;
    Ok(RowStats {
        log_probs,
        entropy,
        lse,
        mean,
    })
}

/// The gradient with respect to the raw `logits` of `Σ g_lp·log_prob + Σ g_ent·entropy` (the
/// [`token_stats`] of the same logits, whose `lse` and `mean` it takes), as a new `[rows, vocab]`
/// tensor of `kind` (fp32, bf16 or f16): `(g_lp·(onehot − p) − g_ent·p·(x/T − E)) / T`.
#[allow(clippy::too_many_arguments)]
pub fn token_stats_grad(
    logits: &Tensor,
    targets: &Tensor,
    lse: &Tensor,
    mean: &Tensor,
    g_log_probs: &Tensor,
    g_entropy: Option<&Tensor>,
    temperature: f64,
    kind: Kind,
) -> Result<Tensor> {
    let grad = Tensor::f_empty(logits.size(), (kind, logits.device())).map_err(torch("empty"))?;
    token_stats_grad_into(
        &grad,
        logits,
        targets,
        lse,
        mean,
        g_log_probs,
        g_entropy,
        temperature,
    )?;
    Ok(grad)
}

/// [`token_stats_grad`] written into `out` (`[rows, vocab]`, contiguous, fp32/bf16/f16; e.g. a
/// block of rows of a larger gradient) instead of a new tensor.
#[allow(clippy::too_many_arguments)]
pub fn token_stats_grad_into(
    out: &Tensor,
    logits: &Tensor,
    targets: &Tensor,
    lse: &Tensor,
    mean: &Tensor,
    g_log_probs: &Tensor,
    g_entropy: Option<&Tensor>,
    temperature: f64,
) -> Result<()> {
    if out.size() != logits.size() || !out.is_contiguous() {
        return Err(TorchExtError::Input {
            what: "token_stats_grad_into out",
            expected: format!(
                "a contiguous tensor of the logits' shape {:?}",
                logits.size()
            ),
            found: format!(
                "{:?}{}",
                out.size(),
                if out.is_contiguous() {
                    ""
                } else {
                    " (not contiguous)"
                }
            ),
        });
    }
    // SAFETY: live tch tensors (or null) borrowed for the call; the shim validates them.
    let err = unsafe {
        vt_token_stats_grad(
            logits.as_ptr(),
            targets.as_ptr(),
            lse.as_ptr(),
            mean.as_ptr(),
            g_log_probs.as_ptr(),
            ptr(g_entropy),
            temperature,
            out.as_ptr(),
        )
    };
    check("token_stats_grad_into", err)
}

/// Rotary position embedding `x * cos + rotate_half(x) * sin` in one kernel: `x` `[B, heads, T,
/// head_dim]` (any strides, e.g. a transposed view; fp32/bf16/f16 on CUDA), `cos`/`sin` `[B, T,
/// head_dim]` in x's dtype (contiguous). Returns a dense tensor of x's shape laid out in x's
/// dimension order (a `[B, T, heads, D]` projection viewed as `[B, heads, T, D]` comes back as the
/// same kind of view, so turning it into a `[B·T, heads, D]` token stream is free), bit-identical
/// to those four torch ops (every intermediate rounded to the dtype as they round it). No
/// autograd: for inference paths.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let out = empty_in_stride_order(x)?;
    // SAFETY: live tch tensors borrowed for the call; the shim validates them.
    let err = unsafe { vt_rope(x.as_ptr(), cos.as_ptr(), sin.as_ptr(), out.as_ptr()) };
    check("rope", err)?;
    Ok(out)
}

/// An uninitialised dense tensor of x's shape and dtype whose dimensions lie in memory in the order
/// of x's strides (largest first; ties keep their order).
fn empty_in_stride_order(x: &Tensor) -> Result<Tensor> {
    let (size, stride) = (x.size(), x.stride());
    let mut order: Vec<usize> = (0..size.len()).collect();
    order.sort_by(|&a, &b| stride[b].cmp(&stride[a]));
    let sizes: Vec<i64> = order.iter().map(|&d| size[d]).collect();
    let mut inverse = vec![0i64; order.len()];
    for (i, &d) in order.iter().enumerate() {
        inverse[d] = i as i64;
    }
    Tensor::f_empty(sizes.as_slice(), (x.kind(), x.device()))
        .and_then(|t| t.f_permute(inverse.as_slice()))
        .map_err(torch("empty"))
}

/// `silu(x[.., :I]) * x[.., I:]` of a fused gate/up projection output `x` `[.., 2·I]` (unit
/// stride along the last dimension; fp32/bf16/f16 on CUDA) in one kernel, returned contiguous
/// `[.., I]`: bit-identical to torch's `silu` and `mul` (each rounded to the dtype as they round
/// it), reading the halves in place where torch's strided elementwise path is several times
/// slower. No autograd: for inference paths.
pub fn swiglu(x: &Tensor) -> Result<Tensor> {
    let size = x.size();
    let last = size.last().copied().unwrap_or(0);
    let rows: i64 = size[..size.len().saturating_sub(1)].iter().product();
    let mut out_size = size.clone();
    if let Some(l) = out_size.last_mut() {
        *l = last / 2;
    }
    let x2 = x.f_reshape([rows, last]).map_err(torch("reshape"))?;
    let out = Tensor::f_empty([rows, last / 2], (x.kind(), x.device())).map_err(torch("empty"))?;
    // SAFETY: live tch tensors borrowed for the call; the shim validates them.
    let err = unsafe { vt_swiglu(x2.as_ptr(), out.as_ptr()) };
    check("swiglu", err)?;
    out.f_view(out_size.as_slice()).map_err(torch("view"))
}

/// RMSNorm of the last dimension of `x`, or of `x + delta` (CUDA, no autograd): returns
/// `(x + delta, normed)` with `delta`, `(None, normed)` without. The sum is rounded to the dtype as
/// torch's add rounds it; the norm is computed in fp32 and rounded once. One kernel, each row on
/// its own with a fixed reduction order, so a row's result does not depend on how many rows
/// share the call (a decode step and a log-prob pass over the same tokens agree bit for bit).
/// `x`, `delta` and `weight` share one dtype; `weight` is `[hidden]`.
pub fn add_rms_norm(
    x: &Tensor,
    delta: Option<&Tensor>,
    weight: &Tensor,
    eps: f64,
) -> Result<(Option<Tensor>, Tensor)> {
    let size = x.size();
    let hidden = size.last().copied().unwrap_or(0);
    let rows: i64 = size[..size.len().saturating_sub(1)].iter().product();
    if let Some(d) = delta {
        if d.size() != size {
            return Err(TorchExtError::Input {
                what: "add_rms_norm delta",
                expected: format!("x's shape {size:?}"),
                found: format!("{:?}", d.size()),
            });
        }
    }
    let flat = |t: &Tensor| -> Result<Tensor> {
        t.f_contiguous()
            .and_then(|t| t.f_reshape([rows, hidden]))
            .map_err(torch("reshape"))
    };
    let x2 = flat(x)?;
    let d2 = delta.map(flat).transpose()?;
    let out = Tensor::f_empty([rows, hidden], (x.kind(), x.device())).map_err(torch("empty"))?;
    let sum = d2
        .as_ref()
        .map(|_| Tensor::f_empty([rows, hidden], (x.kind(), x.device())))
        .transpose()
        .map_err(torch("empty"))?;
    let w = weight.f_contiguous().map_err(torch("contiguous"))?;
    let null = std::ptr::null();
    // SAFETY: live tch tensors (or null where the shim allows it) borrowed for the call; the shim
    // validates them.
    let err = unsafe {
        vt_add_rms_norm(
            x2.as_ptr(),
            d2.as_ref().map_or(null, |t| t.as_ptr()),
            w.as_ptr(),
            eps,
            sum.as_ref().map_or(null, |t| t.as_ptr()),
            out.as_ptr(),
        )
    };
    check("add_rms_norm", err)?;
    let shape = |t: Tensor| t.f_view(size.as_slice()).map_err(torch("view"));
    Ok((sum.map(shape).transpose()?, shape(out)?))
}

/// [`add_rms_norm`] for training forwards: recorded by autograd, the forward the same kernel
/// (bit-identical results), the backward one kernel over the rows plus a sum of per-block
/// weight-gradient shares. `x + delta` and the norm's input gradient are added in fp32 and rounded
/// once, so `x` and `delta` get one gradient (torch's ops round the norm's gradient before the
/// add). CUDA, bf16/fp16 with `hidden % 8 == 0` and `hidden <= 8192` (see
/// [`add_rms_norm_autograd_applies`]); `weight` `[hidden]` in x's dtype.
pub fn add_rms_norm_autograd(
    x: &Tensor,
    delta: Option<&Tensor>,
    weight: &Tensor,
    eps: f64,
) -> Result<(Option<Tensor>, Tensor)> {
    add_rms_norm_recorded(x, delta, weight, eps, false)
}

/// [`add_rms_norm_autograd`] whose backward sums the weight's gradient straight into
/// `weight.grad` (one kernel over the per-block shares, fp32, one rounding; `.grad` made on
/// first use) instead of handing autograd a gradient to add there: for `backward()` into
/// `.grad` only (gradient-accumulation fusion, as [`crate::linear_accumulating`]).
pub fn add_rms_norm_accumulating(
    x: &Tensor,
    delta: Option<&Tensor>,
    weight: &Tensor,
    eps: f64,
) -> Result<(Option<Tensor>, Tensor)> {
    add_rms_norm_recorded(x, delta, weight, eps, true)
}

fn add_rms_norm_recorded(
    x: &Tensor,
    delta: Option<&Tensor>,
    weight: &Tensor,
    eps: f64,
    into_grad: bool,
) -> Result<(Option<Tensor>, Tensor)> {
    let mut sum: *mut torch_sys::C_tensor = std::ptr::null_mut();
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: live tch tensors (or null for no delta) borrowed for the call; the shim validates
    // them and allocates the results.
    let err = unsafe {
        vt_add_rms_norm_autograd(
            x.as_ptr(),
            ptr(delta),
            weight.as_ptr(),
            eps,
            i32::from(into_grad),
            &mut sum,
            &mut out,
        )
    };
    // The sum (allocated only with a delta) is adopted first so that an error frees it too.
    let sum = (!sum.is_null()).then(|| {
        // SAFETY: a heap `at::Tensor*` the shim allocated and nothing else owns.
        unsafe { Tensor::from_ptr(sum) }
    });
    let out = adopt("add_rms_norm_autograd", err, out)?;
    if delta.is_some() && sum.is_none() {
        return Err(TorchExtError::Torch {
            op: "add_rms_norm_autograd",
            message: "no sum returned".into(),
        });
    }
    Ok((sum, out))
}

/// Whether [`add_rms_norm_autograd`] takes rows of `x` (with `weight`): CUDA row kernels, bf16 or
/// fp16 in the weight's dtype, a last dimension that is a multiple of 8 up to 8192.
pub fn add_rms_norm_autograd_applies(x: &Tensor, weight: &Tensor) -> bool {
    let hidden = x.size().last().copied().unwrap_or(0);
    matches!(x.kind(), Kind::BFloat16 | Kind::Half)
        && weight.kind() == x.kind()
        && weight.size() == [hidden]
        && hidden > 0
        && hidden % 8 == 0
        && hidden <= 8192
        && row_kernels_available(x.device())
}

/// `x.index_select(0, index)` recorded by autograd with a backward that sums, for each row of `x`,
/// the gradient rows that read it, in fp32 in the order `sources` lists them, rounded once, in
/// one kernel and without atomics (torch's `index_add_` backward adds in x's dtype through
/// atomics, in no fixed order). `offsets` int64 `[x rows + 1]` and `sources` int64
/// `[index len]` on x's device: row `n` of x is read at positions
/// `sources[offsets[n]..offsets[n + 1]]` of `index` ([`gather_rows_inverse`] builds them).
/// CUDA only.
pub fn gather_rows(
    x: &Tensor,
    index: &Tensor,
    offsets: &Tensor,
    sources: &Tensor,
) -> Result<Tensor> {
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: live tch tensors borrowed for the call; the shim validates them and allocates `out`.
    let err = unsafe {
        vt_gather_rows(
            x.as_ptr(),
            index.as_ptr(),
            offsets.as_ptr(),
            sources.as_ptr(),
            &mut out,
        )
    };
    adopt("gather_rows", err, out)
}

/// The inverse of a row gather over `rows` rows, for [`gather_rows`]: `(offsets, sources)` where
/// `sources[offsets[n]..offsets[n + 1]]` are the positions `i` (ascending) with `index[i] == n`.
/// `None` if an index is out of range.
pub fn gather_rows_inverse(index: &[i64], rows: usize) -> Option<(Vec<i64>, Vec<i64>)> {
    let mut offsets = vec![0i64; rows + 1];
    for &i in index {
        let i = usize::try_from(i).ok().filter(|&i| i < rows)?;
        offsets[i + 1] += 1;
    }
    for n in 0..rows {
        offsets[n + 1] += offsets[n];
    }
    let mut next: Vec<i64> = offsets[..rows].to_vec();
    let mut sources = vec![0i64; index.len()];
    for (pos, &i) in index.iter().enumerate() {
        let slot = &mut next[i as usize];
        sources[*slot as usize] = pos as i64;
        *slot += 1;
    }
    Some((offsets, sources))
}

/// [`rope`] for training forwards: recorded by autograd, whose backward is one kernel too,
/// bit-identical to autograd's backward through the torch ops (`g * cos` plus rotate_half's
/// transpose of `g * sin`, each rounded as they round). `x` `[B, heads, T, head_dim]` (CUDA);
/// `cos`/`sin` `[B, T, head_dim]` contiguous, x's dtype, without gradient. The result keeps x's
/// memory layout where x is dense (a transposed view of a projection), and so does the
/// gradient handed back to x.
pub fn rope_autograd(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: live tch tensors borrowed for the call; the shim validates them and allocates `out`.
    let err = unsafe { vt_rope_autograd(x.as_ptr(), cos.as_ptr(), sin.as_ptr(), &mut out) };
    adopt("rope_autograd", err, out)
}

/// `silu(gate) * up` recorded by autograd (CUDA; one shape, dtype and device for both), forward
/// and backward one kernel each, both bit-identical to torch's `silu` and `mul` and their
/// backward. Saves `gate` and `up` only (torch's ops also keep `silu(gate)`).
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: live tch tensors borrowed for the call; the shim validates them and allocates `out`.
    let err = unsafe { vt_silu_mul(gate.as_ptr(), up.as_ptr(), &mut out) };
    adopt("silu_mul", err, out)
}

/// A tensor equal to `value` whose backward hands precomputed gradients to two tensors: `ga · g`
/// to `a` and `gb · g` to `b`, where `g` is the gradient arriving at the result (`value` is a
/// scalar), each written in its input's dtype in one pass (an fp32 `gb` for a bf16 `b` is
/// rounded once). A `None` gradient gives that input none. For a loss whose gradients were
/// computed by hand (the chunked LM head): one kernel per input instead of differentiating
/// `Σ a·ga + Σ b·gb`. With `b_into_grad` (`b` a leaf that requires grad), `b`'s gradient is
/// added straight into `b.grad` (written there when it has none) and autograd sees none for `b`:
/// one pass over `b`'s size instead of a gradient tensor and autograd's accumulation of it; for
/// `backward()` into `.grad`, as [`crate::linear_accumulating`]. Needs a CUDA build of the
/// extension.
pub fn inject_grads(
    value: &Tensor,
    a: &Tensor,
    ga: Option<&Tensor>,
    b: &Tensor,
    gb: Option<&Tensor>,
    b_into_grad: bool,
) -> Result<Tensor> {
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: live tch tensors (or null for an absent gradient) borrowed for the call.
    let err = unsafe {
        vt_inject_grads(
            value.as_ptr(),
            a.as_ptr(),
            b.as_ptr(),
            ptr(ga),
            ptr(gb),
            i32::from(b_into_grad),
            &mut out,
        )
    };
    adopt("inject_grads", err, out)
}

/// [`inject_grads`] with `b`'s gradient given as the product `lhsᵀ · rhs` (`lhs` `[K, b rows]`,
/// `rhs` `[K, b cols]`, one dtype): the GEMM runs in the backward, scaled by the arriving gradient
/// on the device (no host sync), and the factors are released right after it. With `b_into_grad`
/// it is one cuBLASLt GEMM accumulating into `b.grad` with its scale factors read on the device:
/// fp32 accumulation and one rounding into `b.grad` (on an H100 its results differ from libtorch's
/// `addmm_`, which rounds the product to bf16 before adding, in about a quarter of the elements);
/// an fp32 GEMM and one add pass where cuBLASLt cannot run it. For the LM head, whose `[V, H]`
/// weight gradient is otherwise an fp32 buffer summed chunk by chunk and added in another pass.
#[allow(clippy::too_many_arguments)]
pub fn inject_grads_product(
    value: &Tensor,
    a: &Tensor,
    ga: Option<&Tensor>,
    b: &Tensor,
    lhs: &Tensor,
    rhs: &Tensor,
    b_into_grad: bool,
) -> Result<Tensor> {
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: live tch tensors (or null for an absent gradient) borrowed for the call.
    let err = unsafe {
        vt_inject_grads_product(
            value.as_ptr(),
            a.as_ptr(),
            b.as_ptr(),
            ptr(ga),
            lhs.as_ptr(),
            rhs.as_ptr(),
            i32::from(b_into_grad),
            &mut out,
        )
    };
    adopt("inject_grads_product", err, out)
}

/// A decode step's rotary embedding and KV-cache write in one kernel: returns `q` `[S, H, D]`
/// rotated (contiguous); writes `k` `[S, KVH, D]` rotated and `v` as is into row `slots[s]` of
/// `k_cache` / `v_cache` `[rows, KVH, D]` (contiguous). `q`, `k`, `v` may be strided views (unit
/// stride along `D`, e.g. slices of a fused q/k/v projection); `cos`/`sin` `[S, D]` in their
/// dtype. The rotation is bit-identical to [`rope`] (and so to the torch ops). No autograd.
#[allow(clippy::too_many_arguments)]
pub fn rope_store(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    slots: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
) -> Result<Tensor> {
    let out = Tensor::f_empty(q.size(), (q.kind(), q.device())).map_err(torch("empty"))?;
    // SAFETY: live tch tensors borrowed for the call; the shim validates them.
    let err = unsafe {
        vt_rope_store(
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            cos.as_ptr(),
            sin.as_ptr(),
            slots.as_ptr(),
            k_cache.as_ptr(),
            v_cache.as_ptr(),
            out.as_ptr(),
        )
    };
    check("rope_store", err)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::gather_rows_inverse;

    #[test]
    fn gather_inverse_lists_every_reader_in_order() {
        // A shared prompt (stream rows 0, 1) read by two sequences, then their own rows.
        let index = [0i64, 1, 2, 3, 0, 1, 4];
        let (offsets, sources) = gather_rows_inverse(&index, 6).unwrap();
        assert_eq!(offsets, vec![0, 2, 4, 5, 6, 7, 7]);
        assert_eq!(sources, vec![0, 4, 1, 5, 2, 3, 6]);
        // Every position appears once, under the row it reads.
        for n in 0..6 {
            for &i in &sources[offsets[n] as usize..offsets[n + 1] as usize] {
                assert_eq!(index[i as usize], n as i64);
            }
        }
        assert!(gather_rows_inverse(&[0, 6], 6).is_none());
        assert!(gather_rows_inverse(&[-1], 6).is_none());
        assert_eq!(
            gather_rows_inverse(&[], 2).unwrap(),
            (vec![0, 0, 0], vec![])
        );
    }
}
