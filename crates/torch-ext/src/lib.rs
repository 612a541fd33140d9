//! libtorch C++ entry points that tch does not bind, reached through a small C++ shim
//! (`src/shim.cpp`, compiled by `build.rs` against the same libtorch as tch):
//!
//! * [`CudaGraph`] / [`capture`]: `at::cuda::CUDAGraph` capture on a side stream (capture cannot
//!   run on the default stream), replay on the current stream, and private memory pools shared
//!   between graphs. Available when the libtorch build has CUDA ([`cuda_graphs_compiled`]).
//! * [`varlen_causal_attention`]: libtorch's flash-attention kernel over variable-length
//!   sequences (CUDA), with autograd.
//! * [`fused_adamw`]: `torch.optim.AdamW(fused=True)`'s multi-tensor kernel (CPU and CUDA).
//! * [`paged_decode_attention`]: decode attention over a block-paged KV cache (CUDA, NVRTC).
//! * [`tune_linear`] / [`tuned_linear`]: decode-step GEMMs through cuBLASLt with the algorithm
//!   chosen by timing among the row-consistent ones (CUDA).
//! * [`sample_rows`], [`token_stats`], [`token_stats_grad`]: fused per-row kernels over fp32
//!   logits for sampling and for the LM head's log-probs / entropy (CUDA, NVRTC).
//!
//! Tensors cross the boundary as tch's `at::Tensor*` handles; C++ exceptions come back as
//! [`TorchExtError`]s, never as unwinding.

use std::ffi::{c_char, c_void, CStr};
use std::ptr::NonNull;

use tch::Tensor;

mod lt_gemm;
mod paged_attention;
mod row_kernels;
pub use lt_gemm::*;
pub use paged_attention::*;
pub use row_kernels::*;

/// Errors of this crate: a libtorch call that raised, or inputs it was not given right.
#[derive(Debug, thiserror::Error)]
pub enum TorchExtError {
    #[error("libtorch {op}: {message}")]
    Torch { op: &'static str, message: String },
    #[error("{what}: expected {expected}, found {found}")]
    Input {
        what: &'static str,
        expected: String,
        found: String,
    },
}

pub type Result<T, E = TorchExtError> = std::result::Result<T, E>;

type CTensor = *const torch_sys::C_tensor;

extern "C" {
    fn vt_free_error(e: *mut c_char);
    fn vt_cuda_graphs_compiled() -> i32;
    fn vt_cuda_empty_cache() -> *mut c_char;
    fn vt_cuda_allocator_settings(settings: *const c_char) -> *mut c_char;
    fn vt_cuda_memory_stats(device: i64, out: *mut i64) -> *mut c_char;
    fn vt_cuda_reset_peak_memory_stats(device: i64) -> *mut c_char;
    fn vt_prefer_cublaslt() -> *mut c_char;
    fn vt_clear_grads(ts: *const CTensor, n: i64) -> *mut c_char;
    fn vt_grad_enabled() -> i32;
    fn vt_embedding_accum(
        w: CTensor,
        ids: CTensor,
        padding_idx: i64,
        out: *mut *mut torch_sys::C_tensor,
    ) -> *mut c_char;
    fn vt_linear_accum(
        x: CTensor,
        w: CTensor,
        b: CTensor,
        out: *mut *mut torch_sys::C_tensor,
    ) -> *mut c_char;
    fn vt_linear_pair_accum(
        x: CTensor,
        wa: CTensor,
        wb: CTensor,
        ba: CTensor,
        bb: CTensor,
        a_out: *mut *mut torch_sys::C_tensor,
        b_out: *mut *mut torch_sys::C_tensor,
    ) -> *mut c_char;
    fn vt_linear_into(
        x: CTensor,
        w: CTensor,
        accs: *const CTensor,
        n: i64,
        out: *mut *mut torch_sys::C_tensor,
    ) -> *mut c_char;
    fn vt_grad(
        outputs: *const CTensor,
        grad_outputs: *const CTensor,
        n_out: i64,
        inputs: *const CTensor,
        n_in: i64,
        keep_graph: i32,
        out: *mut *mut torch_sys::C_tensor,
    ) -> *mut c_char;
    fn vt_varlen_attention(
        q: CTensor,
        k: CTensor,
        v: CTensor,
        cu_q: CTensor,
        cu_k: CTensor,
        max_q: i64,
        max_k: i64,
        out: *mut *mut torch_sys::C_tensor,
    ) -> *mut c_char;
    fn vt_fused_adamw(
        params: *const CTensor,
        grads: *const CTensor,
        exp_avgs: *const CTensor,
        exp_avg_sqs: *const CTensor,
        steps: *const CTensor,
        n: i64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
    ) -> *mut c_char;
    fn vt_graph_new(out: *mut *mut c_void) -> *mut c_char;
    fn vt_graph_free(g: *mut c_void);
    fn vt_graph_begin_side(g: *mut c_void, sync: i32) -> *mut c_char;
    fn vt_graph_end_side(g: *mut c_void) -> *mut c_char;
    fn vt_graph_capture_begin(g: *mut c_void, share: *mut c_void) -> *mut c_char;
    fn vt_graph_capture_end(g: *mut c_void) -> *mut c_char;
    fn vt_graph_replay(g: *mut c_void) -> *mut c_char;
    fn vt_copy_nonblocking(dst: CTensor, src: CTensor) -> *mut c_char;
    fn vt_event_record(index: i32, out: *mut *mut c_void) -> *mut c_char;
    fn vt_event_synchronize(e: *mut c_void) -> *mut c_char;
    fn vt_event_free(e: *mut c_void);
    fn vt_side_new(index: i32, out: *mut *mut c_void) -> *mut c_char;
    fn vt_side_fence(side: *mut c_void) -> *mut c_char;
    fn vt_side_join(side: *mut c_void) -> *mut c_char;
    fn vt_side_copy(side: *mut c_void, dst: CTensor, src: CTensor) -> *mut c_char;
    fn vt_side_record(side: *mut c_void, out: *mut *mut c_void) -> *mut c_char;
    fn vt_side_free(side: *mut c_void);
    fn vt_trace_start(cpu: i32) -> *mut c_char;
    fn vt_trace_stop(path: *const c_char) -> *mut c_char;
}

/// Starts libtorch's profiler (kineto) over this process: CUDA kernels and copies, and with
/// `cpu` the aten ops that launched them. [`trace_stop`] ends it.
pub fn trace_start(cpu: bool) -> Result<()> {
    // SAFETY: no arguments borrowed; errors come back as an owned string.
    check("trace_start", unsafe { vt_trace_start(i32::from(cpu)) })
}

/// Stops the profiler [`trace_start`] started and writes its Chrome trace (JSON) to `path`.
pub fn trace_stop(path: &std::path::Path) -> Result<()> {
    let c = std::ffi::CString::new(path.to_string_lossy().as_bytes()).map_err(|_| {
        TorchExtError::Input {
            what: "trace path",
            expected: "a path without NUL bytes".into(),
            found: path.display().to_string(),
        }
    })?;
    // SAFETY: `c` outlives the call.
    check("trace_stop", unsafe { vt_trace_stop(c.as_ptr()) })
}

fn check(op: &'static str, err: *mut c_char) -> Result<()> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null return is a NUL-terminated string malloc'ed by the shim, freed once here.
    let message = unsafe { CStr::from_ptr(err) }
        .to_string_lossy()
        .trim()
        .to_string();
    unsafe { vt_free_error(err) };
    Err(TorchExtError::Torch { op, message })
}

/// Takes ownership of the tensor a shim call allocated into `out` (null after a failed call).
pub(crate) fn adopt(
    op: &'static str,
    err: *mut c_char,
    out: *mut torch_sys::C_tensor,
) -> Result<Tensor> {
    check(op, err)?;
    if out.is_null() {
        return Err(TorchExtError::Torch {
            op,
            message: "no tensor returned".into(),
        });
    }
    // SAFETY: a successful call stored a heap `at::Tensor*` that nothing else owns; tch frees it.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// `torch.cuda.empty_cache()`: hands the CUDA caching allocator's unused blocks back to the driver
/// (after offloading to the host, so the memory is really free for others). A no-op in a build
/// without CUDA or before CUDA was used.
pub fn cuda_empty_cache() -> Result<()> {
    // SAFETY: no arguments; errors come back as a malloc'ed string.
    check("cuda_empty_cache", unsafe { vt_cuda_empty_cache() })
}

/// `torch.cuda.memory._set_allocator_settings(settings)`: the CUDA caching allocator takes
/// `settings` (`PYTORCH_CUDA_ALLOC_CONF` syntax, e.g. `expandable_segments:True`) from now on,
/// for the segments it creates later. An error in a build without CUDA, or for settings libtorch
/// rejects.
pub fn set_cuda_allocator_settings(settings: &str) -> Result<()> {
    let c = std::ffi::CString::new(settings).map_err(|_| TorchExtError::Input {
        what: "cuda_allocator_settings",
        expected: "text without NUL bytes".into(),
        found: format!("{settings:?}"),
    })?;
    // SAFETY: a NUL-terminated string that outlives the call; errors come back as a malloc'ed
    // string.
    check("cuda_allocator_settings", unsafe {
        vt_cuda_allocator_settings(c.as_ptr())
    })
}

/// The CUDA caching allocator's statistics for one device (bytes), as `torch.cuda` reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CudaMemoryStats {
    /// `memory_allocated()`: held by tensors now.
    pub allocated: u64,
    /// `max_memory_allocated()`: the peak of `allocated` since the process started or the last
    /// [`cuda_reset_peak_memory_stats`].
    pub max_allocated: u64,
    /// `memory_reserved()`: segments the allocator holds from the driver now.
    pub reserved: u64,
    /// `max_memory_reserved()`: the peak of `reserved`.
    pub max_reserved: u64,
    /// What [`cuda_empty_cache`] would hand back to the driver: the segments with no block in
    /// use. Device memory in use *by tensors* is `total − free − releasable`, known without paying
    /// for the release (tens of ms of `cudaFree` after a training pass).
    pub releasable: u64,
}

/// [`CudaMemoryStats`] of CUDA device `device`: all zero in a build without CUDA; an error where
/// the allocator keeps no such statistics (e.g. `PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`).
pub fn cuda_memory_stats(device: usize) -> Result<CudaMemoryStats> {
    let mut out = [0i64; 5];
    // SAFETY: `out` holds the 5 values the shim writes and outlives the call; errors come back as
    // a malloc'ed string.
    check("cuda_memory_stats", unsafe {
        vt_cuda_memory_stats(device as i64, out.as_mut_ptr())
    })?;
    let b = |i: usize| out[i].max(0) as u64;
    Ok(CudaMemoryStats {
        allocated: b(0),
        max_allocated: b(1),
        reserved: b(2),
        max_reserved: b(3),
        releasable: b(4),
    })
}

/// `torch.cuda.reset_peak_memory_stats(device)`: later [`cuda_memory_stats`] peaks count from
/// here. Nothing to do in a build without CUDA.
pub fn cuda_reset_peak_memory_stats(device: usize) -> Result<()> {
    // SAFETY: a plain index; errors come back as a malloc'ed string.
    check("cuda_reset_peak_memory_stats", unsafe {
        vt_cuda_reset_peak_memory_stats(device as i64)
    })
}

/// `torch.backends.cuda.preferred_blas_library("cublaslt")`: libtorch's GEMMs (forward and
/// backward) go through cuBLASLt, whose workspace `TORCH_CUBLASLT_WORKSPACE_SIZE` sizes on its own
/// (read at the first cuBLASLt GEMM). An error without CUDA.
pub fn prefer_cublaslt() -> Result<()> {
    // SAFETY: no arguments; errors come back as a malloc'ed string.
    check("prefer_cublaslt", unsafe { vt_prefer_cublaslt() })
}

/// `x W^T (+ b)` recorded by autograd with a backward that accumulates W's and b's gradients
/// straight into their `.grad` (the weight-gradient GEMM adds into an existing `.grad`: one GEMM
/// and one rounding per micro-batch instead of a GEMM, a rounding and a separate add; on CUDA a
/// cuBLASLt call with device-side scale factors, since libtorch's `addmm_` there rounds a 16-bit
/// product before adding) and hands
/// autograd no gradient for them. For `backward()` into `.grad` only: `run_backward` with respect
/// to W or b sees no gradient. Any device.
pub fn linear_accumulating(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: live tch tensors (b nullable) borrowed for the call; the shim allocates `out`.
    let err = unsafe {
        vt_linear_accum(
            x.as_ptr(),
            w.as_ptr(),
            b.map_or(std::ptr::null(), |t| t.as_ptr()),
            &mut out,
        )
    };
    adopt("linear_accum", err, out)
}

/// Two [`linear_accumulating`] projections of one input (a SwiGLU MLP's gate and up):
/// `(x Wa^T (+ ba), x Wb^T (+ bb))` with one backward node whose input gradient is one GEMM and
/// one accumulating GEMM (`addmm_`, one pass fewer than two GEMMs and autograd's separate add; on
/// CUDA the same bits, since libtorch rounds the 16-bit product before adding there; on the CPU
/// it rounds once). The parameters' gradients go straight into their `.grad` as there. Any
/// device.
pub fn linear_pair_accumulating(
    x: &Tensor,
    wa: &Tensor,
    wb: &Tensor,
    ba: Option<&Tensor>,
    bb: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let mut a: *mut torch_sys::C_tensor = std::ptr::null_mut();
    let mut b: *mut torch_sys::C_tensor = std::ptr::null_mut();
    let opt = |t: Option<&Tensor>| t.map_or(std::ptr::null(), |t| t.as_ptr());
    // SAFETY: live tch tensors (biases nullable) borrowed for the call; the shim allocates both
    // outputs or neither.
    let err = unsafe {
        vt_linear_pair_accum(
            x.as_ptr(),
            wa.as_ptr(),
            wb.as_ptr(),
            opt(ba),
            opt(bb),
            &mut a,
            &mut b,
        )
    };
    // Adopted first so that an error frees a half-made pair too.
    let second = (!b.is_null()).then(|| {
        // SAFETY: a heap `at::Tensor*` the shim allocated and nothing else owns.
        unsafe { Tensor::from_ptr(b) }
    });
    let first = adopt("linear_pair_accum", err, a)?;
    let second = second.ok_or_else(|| TorchExtError::Torch {
        op: "linear_pair_accum",
        message: "no second output returned".into(),
    })?;
    Ok((first, second))
}

/// `embedding(w, ids)` (`padding_idx` as torch's: `None`, or a row whose gradient stays zero)
/// recorded by autograd with a backward that adds w's gradient straight into `w.grad`, touching
/// only the rows of the ids present (duplicates summed in the accumulation type, one rounding per
/// row, deterministic on CUDA; `w.grad` starts from zeros where it has none), instead of a dense
/// `[rows, dim]` gradient that autograd then adds: for a large vocabulary (and a tied LM head,
/// whose gradient arrives separately) two passes over the table per micro-batch less. For
/// `backward()` into `.grad` only, as [`linear_accumulating`]. Any device.
pub fn embedding_accumulating(
    w: &Tensor,
    ids: &Tensor,
    padding_idx: Option<i64>,
) -> Result<Tensor> {
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: live tch tensors borrowed for the call; the shim allocates `out`.
    let err = unsafe {
        vt_embedding_accum(
            w.as_ptr(),
            ids.as_ptr(),
            padding_idx.unwrap_or(-1),
            &mut out,
        )
    };
    adopt("embedding_accum", err, out)
}

/// `x W^T` recorded by autograd with a backward that adds W's gradient into `accs` instead of
/// handing it to autograd: `accs` are W's row blocks in order (one, or several when W is a
/// concatenation such as q/k/v), contiguous, each `[rows, in]` in any floating dtype. Each block's
/// weight-gradient GEMM accumulates into its accumulator (beta = 1); from bf16 activations into
/// fp32 accumulators on CUDA the GEMM itself sums in fp32 (Megatron's gradient-accumulation
/// fusion into its fp32 main gradients). `run_backward` with respect to W sees no gradient. Any
/// device.
pub fn linear_into(x: &Tensor, w: &Tensor, accs: &[&Tensor]) -> Result<Tensor> {
    let ptrs: Vec<CTensor> = accs.iter().map(|t| t.as_ptr()).collect();
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: live tch tensors borrowed for the call; the shim copies the handles it keeps and
    // allocates `out`.
    let err = unsafe {
        vt_linear_into(
            x.as_ptr(),
            w.as_ptr(),
            ptrs.as_ptr(),
            ptrs.len() as i64,
            &mut out,
        )
    };
    adopt("linear_into", err, out)
}

/// `torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=keep_graph,
/// allow_unused=True)`: the gradients of `inputs` given `grad_outputs` for `outputs` (each the
/// shape of its output), `None` where an input is unreachable or needs no gradient. Unlike a
/// backward from the surrogate `Σ (y · g).sum()`, it runs no product, sum or their backward over
/// the outputs.
pub fn grad(
    outputs: &[(&Tensor, &Tensor)],
    inputs: &[&Tensor],
    keep_graph: bool,
) -> Result<Vec<Option<Tensor>>> {
    let ys: Vec<CTensor> = outputs.iter().map(|(y, _)| y.as_ptr()).collect();
    let gs: Vec<CTensor> = outputs.iter().map(|(_, g)| g.as_ptr()).collect();
    let xs: Vec<CTensor> = inputs.iter().map(|t| t.as_ptr()).collect();
    let mut out: Vec<*mut torch_sys::C_tensor> = vec![std::ptr::null_mut(); inputs.len()];
    // SAFETY: live tch tensors borrowed for the call; the shim fills `out` (one slot per input)
    // with tensors it allocates, or leaves null.
    let err = unsafe {
        vt_grad(
            ys.as_ptr(),
            gs.as_ptr(),
            ys.len() as i64,
            xs.as_ptr(),
            xs.len() as i64,
            i32::from(keep_graph),
            out.as_mut_ptr(),
        )
    };
    // Adopt every tensor the shim allocated before reporting its error.
    let grads: Vec<Option<Tensor>> = out
        .into_iter()
        // SAFETY: each non-null pointer is a fresh at::Tensor the shim handed over.
        .map(|p| (!p.is_null()).then(|| unsafe { Tensor::from_ptr(p) }))
        .collect();
    check("autograd::grad", err)?;
    Ok(grads)
}

/// Whether autograd records operations on this thread (false inside `tch::no_grad`).
pub fn grad_enabled() -> bool {
    // SAFETY: reads libtorch's thread-local grad mode.
    unsafe { vt_grad_enabled() != 0 }
}

/// `p.grad = None` for every tensor of `params`: the next backward's gradient then becomes `.grad`
/// as it is, where a zeroed `.grad` would cost a zero fill and a copy into it.
pub fn clear_grads<'a>(params: impl IntoIterator<Item = &'a Tensor>) -> Result<()> {
    let ptrs: Vec<_> = params.into_iter().map(|t| t.as_ptr()).collect();
    if ptrs.is_empty() {
        return Ok(());
    }
    // SAFETY: every pointer is a live tch tensor borrowed for the call; the list has its length.
    check("clear_grads", unsafe {
        vt_clear_grads(ptrs.as_ptr(), ptrs.len() as i64)
    })
}

/// Causal attention over variable-length sequences through libtorch's flash-attention kernel
/// (`at::_flash_attention_forward` with cumulative lengths, FlashAttention-2's varlen forward),
/// recorded by autograd. `q` `[total_q, heads, D]`, `k`/`v` `[total_k, kv_heads, D]` (bf16 or
/// fp16, one CUDA device, last dim contiguous; `heads` a multiple of `kv_heads`), `cu_q`/`cu_k`
/// int32 `[B + 1]` cumulative lengths on that device, `max_q`/`max_k` the longest. Sequence `i`'s
/// queries `cu_q[i]..cu_q[i+1]` attend to its keys `cu_k[i]..cu_k[i+1]` under a causal mask
/// aligned to the bottom right: with `m` queries and `n >= m` keys, query `j` sees keys
/// `0..=n - m + j` (the queries are the last `m` positions). Scale `1/sqrt(D)`. Returns
/// `[total_q, heads, D]`.
#[allow(clippy::too_many_arguments)]
pub fn varlen_causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_q: &Tensor,
    cu_k: &Tensor,
    max_q: i64,
    max_k: i64,
) -> Result<Tensor> {
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: live tch tensors borrowed for the call; libtorch validates them and the shim
    // allocates `out` on success.
    let err = unsafe {
        vt_varlen_attention(
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            cu_q.as_ptr(),
            cu_k.as_ptr(),
            max_q,
            max_k,
            &mut out,
        )
    };
    adopt("varlen_causal_attention", err, out)
}

/// `host` (a CPU tensor) on `device` as `kind`, without synchronising the stream when `device` is a
/// GPU: the copy goes from pinned memory (a blocking upload waits for every queued kernel, so the
/// host could not prepare the next step while the device runs this one; a copy from pageable
/// memory may synchronise too). libtorch's caching host allocator keeps the pinned block until the
/// copy has run. Pinning failing (no pinned allocator) is not fatal: the copy is still correct,
/// only possibly synchronising. On the CPU, `host` itself (converted to `kind`).
pub fn upload_nonblocking(
    host: Tensor,
    device: tch::Device,
    kind: tch::Kind,
) -> std::result::Result<Tensor, tch::TchError> {
    if device == tch::Device::Cpu {
        return host.f_to_kind(kind);
    }
    // `_pin_memory` rather than `pin_memory`: tch always passes a device, which the public op
    // deprecates with a warning on every call.
    let src = host.f_internal_pin_memory(device).unwrap_or(host);
    src.f_to_device_(device, kind, true, false)
}

/// `data` as a `shape` tensor of its element kind on `device`. To a GPU it goes straight from `data`
/// into a pinned block ([`pinned_copy`]) and from there with a copy that does not wait for the
/// device ([`upload_nonblocking`]): `Tensor::from_slice` would first zero a fresh pageable buffer
/// and copy into it (the zeroing alone, page faults included, took ~5 ms per 2 MB batch column on
/// the GPU machine, with the device idle), and a pageable upload blocks the host. On the CPU, an
/// owned copy of `data`. `shape` must hold `data.len()` elements.
pub fn upload_slice<T: tch::kind::Element>(
    data: &[T],
    shape: &[i64],
    device: tch::Device,
) -> std::result::Result<Tensor, tch::TchError> {
    let host = pinned_copy(data, shape, device)?;
    if device == tch::Device::Cpu {
        return Ok(host);
    }
    host.f_to_device_(device, T::KIND, true, false)
}

/// `data` as a `shape` tensor of its element kind on `device`, copied straight from `data` (no
/// staging block: a view of the slice, then a copy that returns once it has run, so the host waits
/// for the work queued before it). For the batch columns an API call uploads before it queues any
/// work, where [`upload_slice`]'s pinned block saves nothing and its cost depends on the machine:
/// on one H200 machine each ~1 MB column took ~6 ms of host time in `_pin_memory` (libtorch's
/// caching host allocator handing out new blocks; an update's trace spent 30 ms so, device idle),
/// on another 0.03–0.15 ms, where this copy took 0.10–0.13 ms (2 MB: 0.19–0.21 ms; `cargo run
/// --release -p verl-torch-ext --example upload_bench`). On the CPU, an owned copy of `data`.
/// `shape` must hold `data.len()` elements.
pub fn upload_slice_blocking<T: tch::kind::Element>(
    data: &[T],
    shape: &[i64],
    device: tch::Device,
) -> std::result::Result<Tensor, tch::TchError> {
    let numel: i64 = shape.iter().product();
    if device == tch::Device::Cpu || data.is_empty() || numel != data.len() as i64 {
        return upload_slice(data, shape, device);
    }
    // SAFETY: `data` outlives `view`, and the blocking copy has read it all before `view` goes.
    let view = unsafe { slice_view(data, shape)? };
    let out = view.f_to_device_(device, T::KIND, false, true)?;
    drop(view);
    Ok(out)
}

/// A CPU tensor of shape `shape` viewing `data` in place (no copy).
///
/// # Safety
/// `shape` must hold exactly `data.len()` elements, and the view must not be used (nor a tensor
/// sharing its storage) after `data` is dropped or changed.
unsafe fn slice_view<T: tch::kind::Element>(
    data: &[T],
    shape: &[i64],
) -> std::result::Result<Tensor, tch::TchError> {
    Tensor::f_from_blob(
        data.as_ptr() as *const u8,
        shape,
        &[],
        T::KIND,
        tch::Device::Cpu,
    )
}

/// A CPU copy of `data` as a `shape` tensor of its element kind, in page-locked memory from
/// libtorch's caching host allocator when `device` is a GPU (the source of a copy that does not
/// synchronise), else in ordinary memory; one copy, nothing zeroed first. Should pinning fail (no
/// pinned allocator) the copy is in ordinary memory. `shape` must hold `data.len()` elements.
pub fn pinned_copy<T: tch::kind::Element>(
    data: &[T],
    shape: &[i64],
    device: tch::Device,
) -> std::result::Result<Tensor, tch::TchError> {
    let numel: i64 = shape.iter().product();
    if device == tch::Device::Cpu || data.is_empty() || numel != data.len() as i64 {
        // (A shape that does not fit the data fails in reshape with libtorch's message.)
        let host = Tensor::f_from_slice(data)?.f_reshape(shape)?;
        return Ok(match device {
            tch::Device::Cpu => host,
            _ => host.f_internal_pin_memory(device).unwrap_or(host),
        });
    }
    // SAFETY: `data` outlives `view`, which is dropped before returning; what is returned is a
    // copy.
    let view = unsafe { slice_view(data, shape)? };
    let copy = match view.f_internal_pin_memory(device) {
        Ok(pinned) => pinned,
        Err(_) => {
            let mut owned = view.f_empty_like()?;
            owned.f_copy_(&view)?;
            owned
        }
    };
    drop(view);
    Ok(copy)
}

/// Whether this build of the shim has CUDA (graphs can be captured when a GPU is present too).
pub fn cuda_graphs_compiled() -> bool {
    // SAFETY: no arguments, no state.
    unsafe { vt_cuda_graphs_compiled() != 0 }
}

/// One step of `torch.optim.AdamW(fused=True)` (no amsgrad, no maximize) on every parameter:
/// `params`, `grads`, `exp_avgs`, `exp_avg_sqs` and `steps` are parallel lists on one device,
/// `steps[i]` a float scalar tensor holding this step's number (1 on the first step; the caller
/// increments it). Parameters and state are updated in place.
#[allow(clippy::too_many_arguments)]
pub fn fused_adamw(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    steps: &[Tensor],
    lr: f64,
    betas: (f64, f64),
    weight_decay: f64,
    eps: f64,
) -> Result<()> {
    let n = params.len();
    for (what, len) in [
        ("fused AdamW grads", grads.len()),
        ("fused AdamW exp_avgs", exp_avgs.len()),
        ("fused AdamW exp_avg_sqs", exp_avg_sqs.len()),
        ("fused AdamW steps", steps.len()),
    ] {
        if len != n {
            return Err(TorchExtError::Input {
                what,
                expected: format!("{n} tensors (one per parameter)"),
                found: len.to_string(),
            });
        }
    }
    if n == 0 {
        return Ok(());
    }
    let ptrs = |ts: &[Tensor]| ts.iter().map(|t| t.as_ptr()).collect::<Vec<_>>();
    let (p, g, m, v, s) = (
        ptrs(params),
        ptrs(grads),
        ptrs(exp_avgs),
        ptrs(exp_avg_sqs),
        ptrs(steps),
    );
    // SAFETY: every pointer is a live tch tensor borrowed for the call; the lists have length n.
    let err = unsafe {
        vt_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            s.as_ptr(),
            n as i64,
            lr,
            betas.0,
            betas.1,
            weight_decay,
            eps,
        )
    };
    check("_fused_adamw_", err)
}

/// A captured CUDA graph (`at::cuda::CUDAGraph`). The memory its captured work allocated lives in
/// the graph's private pool until the graph is dropped; replays rewrite the same addresses, so
/// tensors returned by the capture closure are the graph's outputs after every [`replay`].
///
/// [`replay`]: CudaGraph::replay
pub struct CudaGraph {
    ptr: NonNull<c_void>,
}

impl std::fmt::Debug for CudaGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaGraph").finish_non_exhaustive()
    }
}

impl CudaGraph {
    fn new() -> Result<CudaGraph> {
        let mut out: *mut c_void = std::ptr::null_mut();
        // SAFETY: the shim writes a heap pointer (freed by Drop) or returns an error.
        check("CUDAGraph()", unsafe { vt_graph_new(&mut out) })?;
        let ptr = NonNull::new(out).ok_or_else(|| TorchExtError::Torch {
            op: "CUDAGraph()",
            message: "no graph returned".into(),
        })?;
        Ok(CudaGraph { ptr })
    }

    /// Launches the captured work on the current stream (asynchronously).
    pub fn replay(&self) -> Result<()> {
        // SAFETY: ptr is a live graph owned by self.
        check("CUDAGraph::replay", unsafe {
            vt_graph_replay(self.ptr.as_ptr())
        })
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: ptr came from vt_graph_new and is freed exactly once.
        unsafe { vt_graph_free(self.ptr.as_ptr()) }
    }
}

/// `dst.copy_(src, non_blocking=true)`: from a CUDA tensor into pinned host memory (or back) the
/// copy is queued on the current stream and this returns at once; wait on a [`CudaEvent`]
/// recorded after it before reading `dst`. Elsewhere an ordinary copy.
pub fn copy_nonblocking(dst: &Tensor, src: &Tensor) -> Result<()> {
    // SAFETY: live tch tensors borrowed for the call; the shim catches libtorch's errors.
    check("copy_(non_blocking)", unsafe {
        vt_copy_nonblocking(dst.as_ptr(), src.as_ptr())
    })
}

/// A CUDA event recorded on a device's current stream: [`CudaEvent::synchronize`] waits for the
/// work queued before it, not for what was queued after (e.g. a device-to-host copy enqueued
/// before the next step's kernels).
pub struct CudaEvent {
    ptr: NonNull<c_void>,
}

impl std::fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEvent").finish_non_exhaustive()
    }
}

impl CudaEvent {
    /// Records an event after the work queued so far on CUDA device `index`'s current stream.
    pub fn record(index: usize) -> Result<CudaEvent> {
        let mut out: *mut c_void = std::ptr::null_mut();
        // SAFETY: the shim writes an event handle (freed by Drop) or returns an error.
        check("CUDA event record", unsafe {
            vt_event_record(index as i32, &mut out)
        })?;
        let ptr = NonNull::new(out).ok_or_else(|| TorchExtError::Torch {
            op: "CUDA event record",
            message: "no event returned".into(),
        })?;
        Ok(CudaEvent { ptr })
    }

    /// Blocks until the work queued before the event has finished.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: ptr is a live event owned by self.
        check("CUDA event synchronize", unsafe {
            vt_event_synchronize(self.ptr.as_ptr())
        })
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: ptr came from vt_event_record and is freed exactly once.
        unsafe { vt_event_free(self.ptr.as_ptr()) }
    }
}

/// Copies queued behind the current stream's work on a side stream of their own, so they run
/// while the current stream goes on (on a GPU, device-to-host copies of one chunk of offloaded
/// state overlap the next chunk's host-to-device copies and its compute: PCIe moves both
/// directions at once). Each batch of copies is fenced after the work queued before it and closed
/// with [`SideCopies::close_batch`]; [`SideCopies::wait_all_but`] bounds how many batches are in
/// flight (their source memory is not reused until they have run) and [`SideCopies::finish`] (also
/// run on drop) waits for all of them, after which the destinations may be read. Off CUDA every
/// copy is an ordinary `copy_` and the rest does nothing, so CPU runs take the same path.
pub struct SideCopies {
    side: Option<NonNull<c_void>>,
    pending: std::collections::VecDeque<CudaEvent>,
}

impl std::fmt::Debug for SideCopies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SideCopies")
            .field("cuda", &self.side.is_some())
            .field("pending", &self.pending.len())
            .finish()
    }
}

impl SideCopies {
    /// A side stream on `device` when it is a CUDA device, plain copies otherwise.
    pub fn new(device: tch::Device) -> Result<SideCopies> {
        let side = match device {
            tch::Device::Cuda(index) => {
                let mut out: *mut c_void = std::ptr::null_mut();
                // SAFETY: the shim writes a side-stream handle (freed by Drop) or an error.
                check("side stream", unsafe {
                    vt_side_new(index as i32, &mut out)
                })?;
                Some(NonNull::new(out).ok_or_else(|| TorchExtError::Torch {
                    op: "side stream",
                    message: "no stream returned".into(),
                })?)
            }
            _ => None,
        };
        Ok(SideCopies {
            side,
            pending: Default::default(),
        })
    }

    /// Makes the copies queued from now on wait for the work queued so far on the current stream
    /// (what wrote their sources).
    pub fn fence(&mut self) -> Result<()> {
        match self.side {
            // SAFETY: a live side stream owned by self.
            Some(s) => check("side stream fence", unsafe { vt_side_fence(s.as_ptr()) }),
            None => Ok(()),
        }
    }

    /// Makes the work queued from now on on the current stream wait for the copies queued so far
    /// (e.g. uploads it is about to read); the host does not wait.
    pub fn join(&mut self) -> Result<()> {
        match self.side {
            // SAFETY: a live side stream owned by self.
            Some(s) => check("side stream join", unsafe { vt_side_join(s.as_ptr()) }),
            None => Ok(()),
        }
    }

    /// `dst.copy_(src)`, queued on the side stream (see the type's documentation); `src` may be
    /// dropped at once. Fence first when `dst` (or `src`) was allocated on, or last used by, the
    /// current stream: the side stream is ordered after that work only by a fence.
    pub fn copy(&mut self, dst: &Tensor, src: &Tensor) -> Result<()> {
        let side = self.side;
        // Outside autograd: `dst` may be a leaf that requires grad (a master weight).
        tch::no_grad(|| match side {
            // SAFETY: a live side stream owned by self and live tch tensors borrowed for the call.
            Some(s) => check("side stream copy", unsafe {
                vt_side_copy(s.as_ptr(), dst.as_ptr(), src.as_ptr())
            }),
            None => {
                dst.shallow_clone()
                    .f_copy_(src)
                    .map(|_| ())
                    .map_err(|e| TorchExtError::Torch {
                        op: "copy",
                        message: e.to_string(),
                    })
            }
        })
    }

    /// Ends a batch: the copies queued so far form one unit for [`SideCopies::wait_all_but`].
    pub fn close_batch(&mut self) -> Result<()> {
        if let Some(s) = self.side {
            let mut out: *mut c_void = std::ptr::null_mut();
            // SAFETY: a live side stream; the shim writes an event (owned by CudaEvent) or an error.
            check("side stream record", unsafe {
                vt_side_record(s.as_ptr(), &mut out)
            })?;
            let ptr = NonNull::new(out).ok_or_else(|| TorchExtError::Torch {
                op: "side stream record",
                message: "no event returned".into(),
            })?;
            self.pending.push_back(CudaEvent { ptr });
        }
        Ok(())
    }

    /// Waits until at most `keep` closed batches are still running.
    pub fn wait_all_but(&mut self, keep: usize) -> Result<()> {
        while self.pending.len() > keep {
            let ev = self.pending.pop_front().expect("a pending batch");
            ev.synchronize()?;
        }
        Ok(())
    }

    /// Closes the open batch and waits for every copy queued.
    pub fn finish(&mut self) -> Result<()> {
        if self.side.is_some() {
            self.close_batch()?;
        }
        self.wait_all_but(0)
    }

    /// Closed batches still running, as far as the host knows (0 off CUDA).
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}

// SAFETY: the handle names a CUDA stream (and the events, CUDA events), which any thread may use;
// the methods take `&mut self`, so one thread uses it at a time.
unsafe impl Send for SideCopies {}

impl Drop for SideCopies {
    fn drop(&mut self) {
        // Destinations must not be read (nor sources reused by anything but the allocator, which
        // knows) before the copies ran: wait for them even on an error path.
        let _ = self.finish();
        if let Some(s) = self.side.take() {
            // SAFETY: s came from vt_side_new and is freed exactly once.
            unsafe { vt_side_free(s.as_ptr()) }
        }
    }
}

/// Captures what `f` launches into a new graph. `f` runs `warmup` times eagerly on a side stream
/// first (lazy initialisation such as cuBLAS workspaces should not happen inside a capture), then
/// once under capture; its last result (whose tensors are the graph's outputs) is returned with
/// the graph. With a warm-up the device finishes its queued work first (the warm-up reads it);
/// without one nothing waits, so the host can capture while the device runs earlier work. Sharing `pool` with an earlier graph saves memory when the graphs never run
/// concurrently. Nothing in `f` may synchronise with the host or launch work on other streams.
pub fn capture<T, E: From<TorchExtError>>(
    pool: Option<&CudaGraph>,
    warmup: usize,
    mut f: impl FnMut() -> Result<T, E>,
) -> Result<(CudaGraph, T), E> {
    let graph = CudaGraph::new()?;
    let g = graph.ptr.as_ptr();
    // SAFETY: g is live for the whole function; the side stream is restored on every path below.
    check("begin capture stream", unsafe {
        vt_graph_begin_side(g, i32::from(warmup > 0))
    })?;
    let captured = (|| -> Result<T, E> {
        for _ in 0..warmup {
            drop(f()?);
        }
        let share = pool.map_or(std::ptr::null_mut(), |p| p.ptr.as_ptr());
        check("CUDAGraph::capture_begin", unsafe {
            vt_graph_capture_begin(g, share)
        })?;
        let out = f();
        // End the capture whatever `f` did; its error is the one to report.
        let end = check("CUDAGraph::capture_end", unsafe { vt_graph_capture_end(g) });
        let out = out?;
        end?;
        Ok(out)
    })();
    let restore = check("end capture stream", unsafe { vt_graph_end_side(g) });
    let out = captured?;
    restore?;
    Ok((graph, out))
}

#[cfg(test)]
mod tests;
