//! Decode-step GEMMs through cuBLASLt with the algorithm chosen by timing (`src/lt_gemm.cpp`).
//!
//! [`tune_linear`] times cuBLASLt's heuristic algorithms for one (rows, weight, bias, output
//! dtype) shape against libtorch, with the weights cold, among those whose rows equal libtorch's
//! bit for bit at these rows and at a training-size row count; the winner is cached for the
//! process and written to a cache file (`VERL_TUNED_GEMMS_CACHE`, default
//! `~/.cache/verl-rs/tuned_gemms.txt`; `0` for none) that later processes on the same GPU model
//! and cuBLASLt read instead of timing again (a read-back choice is checked and its rows compared
//! again first). Inside a [`tuned_gemm_scope`], [`tuned_linear`] runs a tuned shape with its
//! configuration and answers `None` for anything else (the caller runs libtorch).

use std::cell::Cell;
use std::ffi::{c_char, CStr};
use std::sync::OnceLock;

use tch::Tensor;

use crate::paged_attention::torch_err;
use crate::{check, grad_enabled, CTensor, Result};

extern "C" {
    fn vt_free_error(e: *mut c_char);
    fn vt_lt_available() -> i32;
    fn vt_lt_tune(
        rows: i64,
        w: CTensor,
        b: CTensor,
        fp32: i32,
        wide: i32,
        chosen: *mut i32,
    ) -> *mut c_char;
    fn vt_lt_linear(
        x: CTensor,
        w: CTensor,
        b: CTensor,
        fp32: i32,
        out: *mut *mut torch_sys::C_tensor,
    ) -> *mut c_char;
    fn vt_lt_report(text: *mut *mut c_char) -> *mut c_char;
    fn vt_lt_forget() -> *mut c_char;
}

thread_local! {
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
}

/// Whether cuBLASLt could be loaded for tuned GEMMs (a CUDA build whose libtorch has it).
pub fn tuned_gemms_available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        // SAFETY: no arguments; loads cuBLASLt once.
        unsafe { vt_lt_available() == 1 }
    })
}

/// While alive (and `on`), [`tuned_linear`] on this thread runs tuned shapes; dropping it
/// restores the previous setting.
pub struct TunedGemmScope(bool);

/// Turns [`tuned_linear`] on (`on`) or off for this thread until the guard drops.
pub fn tuned_gemm_scope(on: bool) -> TunedGemmScope {
    let on = on && tuned_gemms_available();
    TunedGemmScope(ACTIVE.with(|c| c.replace(on)))
}

impl Drop for TunedGemmScope {
    fn drop(&mut self) {
        ACTIVE.with(|c| c.set(self.0));
    }
}

/// Whether a [`tuned_gemm_scope`] is on for this thread.
pub fn tuned_gemms_active() -> bool {
    ACTIVE.with(|c| c.get())
}

/// Tunes `x[rows, in] · w[out, in]ᵀ (+ b)` (bf16/fp16 CUDA weight; `fp32_out`: float32 output,
/// no bias) once per process, among the heuristic's algorithms (a few ms) or, with `wide`, also
/// a coarse-to-fine search over the configurations of their algorithm ids that cuBLASLt accepts
/// without split-K (hundreds; up to seconds, mostly loading kernels the first time they run).
/// Synchronises the device and fails inside a CUDA graph capture.
pub fn tune_linear(
    rows: i64,
    w: &Tensor,
    b: Option<&Tensor>,
    fp32_out: bool,
    wide: bool,
) -> Result<Tuned> {
    let mut chosen = 0i32;
    // SAFETY: live tch tensors (b nullable) borrowed for the call.
    let err = unsafe {
        vt_lt_tune(
            rows,
            w.as_ptr(),
            b.map_or(std::ptr::null(), |t| t.as_ptr()),
            i32::from(fp32_out),
            i32::from(wide),
            &mut chosen,
        )
    };
    check("lt_tune", err)?;
    Ok(Tuned {
        chosen: chosen & 1 != 0,
        fresh: chosen & 2 != 0,
        from_file: chosen & 4 != 0,
    })
}

/// What [`tune_linear`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuned {
    /// A cuBLASLt configuration beat libtorch: [`tuned_linear`] runs it from now on.
    pub chosen: bool,
    /// This call settled the shape (else it was settled before in this process).
    pub fresh: bool,
    /// This call took the choice from the cache file (`VERL_TUNED_GEMMS_CACHE`) after checking
    /// it again (its run gives the reference's bits) instead of timing.
    pub from_file: bool,
}

/// `x W^T (+ b)` (`x` `[..., in]`) with the tuned algorithm of its shape, or `None` (nothing
/// launched) outside a [`tuned_gemm_scope`], under autograd, or for a shape that was not tuned or
/// where libtorch won: the caller then runs libtorch's GEMM, which gives the same bits.
pub fn tuned_linear(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    fp32_out: bool,
) -> Result<Option<Tensor>> {
    if !tuned_gemms_active() || x.requires_grad() || grad_enabled() || !x.is_contiguous() {
        return Ok(None);
    }
    let size = x.size();
    let Some(&k) = size.last() else {
        return Ok(None);
    };
    let x2 = x.f_view([-1, k]).map_err(torch_err("lt_linear"))?;
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: live tch tensors (b nullable) borrowed for the call; the shim allocates `out` or
    // leaves it null.
    let err = unsafe {
        vt_lt_linear(
            x2.as_ptr(),
            w.as_ptr(),
            b.map_or(std::ptr::null(), |t| t.as_ptr()),
            i32::from(fp32_out),
            &mut out,
        )
    };
    check("lt_linear", err)?;
    if out.is_null() {
        return Ok(None);
    }
    // SAFETY: a successful call stored a heap `at::Tensor*` that nothing else owns; tch frees it.
    let y = unsafe { Tensor::from_ptr(out) };
    let mut dims = size;
    if let Some(last) = dims.last_mut() {
        *last = w.size()[0];
    }
    Ok(Some(
        y.f_view(dims.as_slice()).map_err(torch_err("lt_linear"))?,
    ))
}

/// One line per shape tuned in this process: the algorithm taken (or libtorch kept), its time
/// and libtorch's, and how many of the heuristic's algorithms were row-consistent.
pub fn tuned_linear_report() -> Result<Vec<String>> {
    let mut text: *mut c_char = std::ptr::null_mut();
    // SAFETY: the shim stores a malloc'ed NUL-terminated string in `text`.
    check("lt_report", unsafe { vt_lt_report(&mut text) })?;
    if text.is_null() {
        return Ok(Vec::new());
    }
    // SAFETY: a NUL-terminated string malloc'ed by the shim, freed once here.
    let s = unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .to_string();
    unsafe { vt_free_error(text) };
    Ok(s.lines().map(str::to_string).collect())
}

/// Forgets every shape tuned in this process (the cache file stays): [`tuned_linear`] answers
/// `None` until a shape is tuned again, which then reads the cache file first.
pub fn forget_tuned_linears() -> Result<()> {
    // SAFETY: no arguments.
    check("lt_forget", unsafe { vt_lt_forget() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn outside_a_scope_or_on_the_cpu_nothing_runs() {
        let x = Tensor::ones([4, 8], (Kind::Float, Device::Cpu));
        let w = Tensor::ones([3, 8], (Kind::Float, Device::Cpu));
        let _g = tch::no_grad_guard();
        assert!(tuned_linear(&x, &w, None, false).unwrap().is_none());
        let _s = tuned_gemm_scope(true);
        // CPU operands are never taken, scope or not.
        assert!(tuned_linear(&x, &w, None, false).unwrap().is_none());
        {
            let _off = tuned_gemm_scope(false);
            assert!(!tuned_gemms_active());
        }
        assert_eq!(tuned_gemms_active(), tuned_gemms_available());
    }

    #[test]
    fn tuning_names_what_is_wrong_with_its_operands() {
        let w = Tensor::ones([3, 8], (Kind::Float, Device::Cpu));
        let e = tune_linear(4, &w, None, false, false)
            .unwrap_err()
            .to_string();
        if tuned_gemms_available() {
            assert!(
                e.contains("weight must be a contiguous 2-D bf16/fp16 CUDA tensor"),
                "{e}"
            );
        } else {
            assert!(e.contains("cuBLASLt") || e.contains("no cuBLASLt"), "{e}");
        }
    }
}
