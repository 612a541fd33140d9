//! Decode attention over a block-paged KV cache (vLLM's `paged_attention`): a CUDA kernel that
//! `src/paged_attention.cpp` compiles at run time with NVRTC and launches on libtorch's current
//! stream, plus a pure-torch reference that runs on any device.
//!
//! Layout: per layer `k_cache`, `v_cache` are `[num_blocks, block_size, kv_heads, head_dim]`;
//! sequence `s` attends with its one new query `q[s]` (`[heads, head_dim]`) over positions
//! `p` in `[max(0, seq_len - window), seq_len)`, position `p` living in block
//! `block_table[s, p / block_size]` at offset `p % block_size`. Query head `h` reads kv head
//! `h / (heads / kv_heads)` (GQA). A sequence with no positions gets a zero output.

use std::ffi::{c_char, CStr};

use tch::{Device, Kind, Tensor};

use crate::{check, vt_free_error, Result, TorchExtError};

type CTensor = *const torch_sys::C_tensor;

extern "C" {
    fn vt_paged_attention_source() -> *const c_char;
    fn vt_paged_attention_compile_check(
        dtype: i32,
        head_dim: i32,
        tc: i32,
        arch: i32,
        log: *mut *mut c_char,
    ) -> *mut c_char;
    fn vt_paged_decode_attention_ex(
        q: CTensor,
        k_cache: CTensor,
        v_cache: CTensor,
        block_table: CTensor,
        seq_lens: CTensor,
        scale: f64,
        window: i64,
        out: CTensor,
        kernel: i64,
        num_splits: i64,
    ) -> *mut c_char;
    fn vt_paged_multi_query_attention(
        q: CTensor,
        k_cache: CTensor,
        v_cache: CTensor,
        block_table: CTensor,
        q_rows: CTensor,
        seq_lens: CTensor,
        scale: f64,
        out: CTensor,
    ) -> *mut c_char;
}

/// Which kernel [`paged_decode_attention_with`] launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PagedKernel {
    /// Tensor cores where they apply (bf16/fp16, `head_dim % 64 == 0`, sm_80+), else CUDA cores.
    #[default]
    Auto,
    /// The CUDA-core kernel (every dtype, `head_dim <= 256`).
    CudaCores,
    /// The tensor-core kernel; an error where it does not apply.
    TensorCores,
}

/// Tuning knobs of [`paged_decode_attention_with`]; the defaults choose automatically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PagedAttentionOptions {
    pub kernel: PagedKernel,
    /// Context splits per sequence (flash-decoding); 0 chooses from the batch size, the table's
    /// capacity (or the window) and the GPU's multiprocessor count. Fixed by the shapes only, so
    /// a captured graph stays valid when `seq_lens` changes.
    pub num_splits: usize,
}

/// The kernel in the data types it supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PagedDtype {
    F32,
    BF16,
    F16,
}

impl PagedDtype {
    fn code(self) -> i32 {
        match self {
            PagedDtype::F32 => 0,
            PagedDtype::BF16 => 1,
            PagedDtype::F16 => 2,
        }
    }
}

/// The CUDA C++ source of the kernels (compiled by NVRTC per dtype and head_dim).
pub fn paged_attention_kernel_source() -> String {
    // SAFETY: a static NUL-terminated string owned by the shim.
    unsafe { CStr::from_ptr(vt_paged_attention_source()) }
        .to_string_lossy()
        .into_owned()
}

/// Compiles the kernel (tensor-core variant if `tensor_cores`) for compute capability `arch`
/// (e.g. 90 for sm_90) with NVRTC, without needing a GPU, and returns NVRTC's log (which carries
/// ptxas' register and spill report). Fails with the compiler log.
pub fn paged_attention_compile_check(
    dtype: PagedDtype,
    head_dim: usize,
    tensor_cores: bool,
    arch: u32,
) -> Result<String> {
    let mut log: *mut c_char = std::ptr::null_mut();
    // SAFETY: plain values in, an optional malloc'ed log out (freed below).
    let err = unsafe {
        vt_paged_attention_compile_check(
            dtype.code(),
            head_dim as i32,
            tensor_cores as i32,
            arch as i32,
            &mut log,
        )
    };
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
    check("NVRTC paged attention", err)?;
    Ok(text)
}

fn window_arg(window: Option<i64>) -> i64 {
    window.filter(|&w| w > 0).unwrap_or(0)
}

/// Decode attention with the CUDA kernel (all tensors on one CUDA device): `q` `[S, heads,
/// head_dim]`, `k_cache`/`v_cache` `[blocks, block_size, kv_heads, head_dim]` (q's dtype: f32,
/// bf16 or f16; contiguous), `block_table` `[S, max_blocks]` and `seq_lens` `[S]` int64 on the
/// device. Returns `[S, heads, head_dim]` in q's dtype. `window`: attend to the last `window`
/// positions only. Asynchronous on the current stream and graph-capturable once the first call
/// (which compiles the kernel) has run outside the capture.
pub fn paged_decode_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_table: &Tensor,
    seq_lens: &Tensor,
    scale: f64,
    window: Option<i64>,
) -> Result<Tensor> {
    paged_decode_attention_with(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        scale,
        window,
        PagedAttentionOptions::default(),
    )
}

/// [`paged_decode_attention`] with explicit kernel choice and context splits.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_with(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_table: &Tensor,
    seq_lens: &Tensor,
    scale: f64,
    window: Option<i64>,
    options: PagedAttentionOptions,
) -> Result<Tensor> {
    let out = q.f_empty_like().map_err(|e| TorchExtError::Torch {
        op: "empty_like",
        message: e.to_string(),
    })?;
    paged_decode_attention_out(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        scale,
        window,
        options,
        &out,
    )?;
    Ok(out)
}

/// [`paged_decode_attention_with`] writing into `out` (`[S, heads, head_dim]`, q's dtype,
/// contiguous).
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_out(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_table: &Tensor,
    seq_lens: &Tensor,
    scale: f64,
    window: Option<i64>,
    options: PagedAttentionOptions,
    out: &Tensor,
) -> Result<()> {
    let kernel = match options.kernel {
        PagedKernel::Auto => 0,
        PagedKernel::CudaCores => 1,
        PagedKernel::TensorCores => 2,
    };
    // SAFETY: every pointer is a live tch tensor borrowed for the call; the shim validates
    // shapes, dtypes and devices before touching data.
    let err = unsafe {
        vt_paged_decode_attention_ex(
            q.as_ptr(),
            k_cache.as_ptr(),
            v_cache.as_ptr(),
            block_table.as_ptr(),
            seq_lens.as_ptr(),
            scale,
            window_arg(window),
            out.as_ptr(),
            kernel,
            options.num_splits as i64,
        )
    };
    check("paged_decode_attention", err)
}

/// Attention of queries that each attend exactly as their own decode step would
/// ([`paged_decode_attention_with`] with one context split and no window): `q` `[N, heads,
/// head_dim]` (contiguous), query `i` reading row `q_rows[i]` of `block_table` `[rows,
/// max_blocks]` up to its context length `seq_lens[i]` (`q_rows`, `seq_lens` `[N]` int64).
/// Returns `[N, heads, head_dim]`, bit-identical to the decode kernel over the table rows
/// gathered per query; the tensor-core multi-query kernel loads the keys and values that a block
/// of consecutive queries of one row shares once for all of them.
pub fn paged_multi_query_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_table: &Tensor,
    q_rows: &Tensor,
    seq_lens: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let out = Tensor::f_empty(q.size(), (q.kind(), q.device())).map_err(torch_err("empty"))?;
    // SAFETY: live tch tensors borrowed for the call; the shim validates them.
    let err = unsafe {
        vt_paged_multi_query_attention(
            q.as_ptr(),
            k_cache.as_ptr(),
            v_cache.as_ptr(),
            block_table.as_ptr(),
            q_rows.as_ptr(),
            seq_lens.as_ptr(),
            scale,
            out.as_ptr(),
        )
    };
    check("paged_multi_query_attention", err)?;
    Ok(out)
}

fn input(
    what: &'static str,
    expected: impl Into<String>,
    found: impl Into<String>,
) -> TorchExtError {
    TorchExtError::Input {
        what,
        expected: expected.into(),
        found: found.into(),
    }
}

pub(crate) fn torch_err(op: &'static str) -> impl Fn(tch::TchError) -> TorchExtError {
    move |e| TorchExtError::Torch {
        op,
        message: e.to_string(),
    }
}

/// The same attention in plain torch ops on any device (gather every sequence's blocks, masked
/// softmax in fp32): the tests' reference and a CPU fallback. Same arguments and result as
/// [`paged_decode_attention`]; block-table entries past a sequence's length may hold anything.
pub fn paged_decode_attention_reference(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_table: &Tensor,
    seq_lens: &Tensor,
    scale: f64,
    window: Option<i64>,
) -> Result<Tensor> {
    let qs = q.size();
    let ks = k_cache.size();
    if qs.len() != 3 {
        return Err(input("q", "[S, heads, head_dim]", format!("{qs:?}")));
    }
    if ks.len() != 4 || ks[3] != qs[2] || v_cache.size() != ks {
        return Err(input(
            "k_cache/v_cache",
            format!("[blocks, block_size, kv_heads, {}] each", qs[2]),
            format!("{ks:?} and {:?}", v_cache.size()),
        ));
    }
    let (s, h, d) = (qs[0], qs[1], qs[2]);
    let (nb, bs, kvh) = (ks[0], ks[1], ks[2]);
    if kvh < 1 || h % kvh != 0 {
        return Err(input(
            "heads",
            format!("a multiple of kv_heads ({kvh})"),
            h.to_string(),
        ));
    }
    let ts = block_table.size();
    if ts.len() != 2 || ts[0] != s || seq_lens.size() != [s] {
        return Err(input(
            "block_table/seq_lens",
            format!("[{s}, max_blocks] and [{s}]"),
            format!("{ts:?} and {:?}", seq_lens.size()),
        ));
    }
    let mb = ts[1];
    let g = h / kvh;
    let l = mb * bs;
    let dev = q.device();
    let e = torch_err("paged attention reference");
    let f = || -> Result<Tensor, tch::TchError> {
        // Entries past a sequence's blocks are masked below; clamp them so the gather is valid.
        let table = block_table
            .f_to_device(dev)?
            .f_clamp(0, (nb - 1).max(0))?
            .f_reshape([s * mb])?;
        let gather = |cache: &Tensor| -> Result<Tensor, tch::TchError> {
            cache
                .f_index_select(0, &table)?
                .f_reshape([s, l, kvh, d])?
                .f_permute([0, 2, 1, 3])?
                .f_to_kind(Kind::Float)
        };
        let len = seq_lens
            .f_to_device(dev)?
            .f_clamp_max(l)?
            .f_reshape([s, 1])?;
        let pos = Tensor::f_arange(l, (Kind::Int64, dev))?.f_reshape([1, l])?;
        let mut allowed = pos.f_lt_tensor(&len)?;
        if let Some(w) = window.filter(|&w| w > 0) {
            allowed = allowed.f_logical_and(&pos.f_ge_tensor(&len.f_sub_scalar(w)?)?)?;
        }
        let allowed = allowed.f_reshape([s, 1, 1, l])?; // [S, kvh, G, L] broadcast
        let not_allowed = allowed.f_logical_not()?;
        let keys = gather(k_cache)?;
        // Unwritten slots may hold NaN: zero masked values so that weight 0 never meets them.
        let values = gather(v_cache)?.f_masked_fill(&not_allowed.f_reshape([s, 1, l, 1])?, 0.0)?;
        let qf = q.f_to_kind(Kind::Float)?.f_reshape([s, kvh, g, d])?;
        let logits = qf
            .f_matmul(&keys.f_transpose(-1, -2)?)?
            .f_mul_scalar(scale)?
            .f_masked_fill(&not_allowed, f64::NEG_INFINITY)?;
        // Rows without keys are all -inf (softmax NaN): zero them.
        let probs = logits
            .f_softmax(-1, Kind::Float)?
            .f_masked_fill(&not_allowed, 0.0)?;
        probs
            .f_matmul(&values)?
            .f_reshape([s, h, d])?
            .f_to_kind(q.kind())
    };
    if l == 0 || s == 0 {
        return q.f_zeros_like().map_err(e);
    }
    f().map_err(e)
}

/// Whether [`paged_decode_attention`] can run on `device` with this build (a CUDA device and a
/// shim compiled with CUDA); callers fall back to [`paged_decode_attention_reference`] otherwise.
pub fn paged_attention_available(device: Device) -> bool {
    matches!(device, Device::Cuda(_)) && crate::cuda_graphs_compiled()
}
