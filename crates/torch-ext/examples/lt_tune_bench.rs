//! What tuning the decode GEMMs costs per batch size, and what it buys, on a GPU.
//!
//! `cargo run --release -p verl-torch-ext --example lt_tune_bench [-- ARCH [ROWS...]]` (ARCH `0.5b`
//! or `1.5b`: Qwen2.5's decode shapes, fused q/k/v + bias, o, fused gate/up, down, the fp32-logits
//! LM head; ROWS default 512 256 128 64 32 24 16 8 4 2 1). Runs under the GEMM settings of
//! `consistent_attention` with a cache file of its own (removed at the end). For each row count it
//! tunes every shape over the heuristic's algorithms (as the engine does for every decode batch size
//! after the call's first), then over the wide search (as for the first full batch), and prints the
//! seconds each took and the time of one decode step's GEMMs (µs, weights cold in L2, the layer
//! count's worth) through libtorch and through the tuned choices.

use std::time::Instant;

use tch::{Device, Kind, Tensor};
use verl_torch_ext::{
    forget_tuned_linears, tune_linear, tuned_gemm_scope, tuned_gemms_available, tuned_linear,
};

struct Shape {
    n: i64,
    k: i64,
    bias: bool,
    fp32: bool,
    per_step: i64,
}

fn shapes(arch: &str) -> Vec<Shape> {
    let (h, inter, kv, layers) = match arch {
        "1.5b" => (1536, 8960, 256, 28),
        _ => (896, 4864, 128, 24),
    };
    let s = |n, k, bias, fp32, per_step| Shape {
        n,
        k,
        bias,
        fp32,
        per_step,
    };
    vec![
        s(h + 2 * kv, h, true, false, layers),
        s(h, h, false, false, layers),
        s(2 * inter, h, false, false, layers),
        s(h, inter, false, false, layers),
        s(151_936, h, false, true, 1),
    ]
}

/// µs of one decode step's GEMMs (each shape × its count per step), each run after an L2 flush:
/// 20 queued (flush, GEMM) pairs less 20 queued flushes (the device, not the host, bounds both),
/// median of 5 rounds; `tuned`: through `tuned_linear` where it takes the shape.
fn step_us(ws: &[(Shape, Tensor, Option<Tensor>)], rows: i64, tuned: bool, flush: &Tensor) -> f64 {
    let dev = flush.device();
    let _s = tuned_gemm_scope(tuned);
    let queued = |f: &dyn Fn()| {
        tch::Cuda::synchronize(0);
        let start = Instant::now();
        for _ in 0..20 {
            let _ = flush.sum(Kind::Float);
            f();
        }
        tch::Cuda::synchronize(0);
        start.elapsed().as_secs_f64() / 20.0
    };
    let mut rounds = Vec::new();
    for _ in 0..5 {
        let mut total = 0.0;
        for (s, w, b) in ws {
            let x = Tensor::randn([rows, s.k], (Kind::BFloat16, dev));
            let run = || {
                let _ = match tuned_linear(&x, w, b.as_ref(), s.fp32).unwrap() {
                    Some(y) => y,
                    None if s.fp32 => x.mm_dtype(&w.tr(), Kind::Float),
                    None => x.linear(w, b.as_ref()),
                };
            };
            run();
            let gemm = queued(&run) - queued(&|| {});
            total += gemm.max(0.0) * 1e6 * s.per_step as f64;
        }
        rounds.push(total);
    }
    rounds.sort_by(f64::total_cmp);
    rounds[rounds.len() / 2]
}

fn main() {
    if !tch::Cuda::is_available() || !tuned_gemms_available() {
        eprintln!("lt_tune_bench: no CUDA device or no cuBLASLt");
        return;
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arch = args.first().cloned().unwrap_or_else(|| "0.5b".into());
    let mut rows: Vec<i64> = args.iter().skip(1).filter_map(|a| a.parse().ok()).collect();
    if rows.is_empty() {
        rows = vec![512, 256, 128, 64, 32, 24, 16, 8, 4, 2, 1];
    }
    std::env::set_var("TORCH_CUBLASLT_WORKSPACE_SIZE", "1");
    std::env::set_var("CUBLASLT_WORKSPACE_SIZE", "1");
    let file = std::env::temp_dir().join(format!("lt_tune_bench_{}.txt", std::process::id()));
    std::env::set_var("VERL_TUNED_GEMMS_CACHE", &file);
    verl_torch_ext::prefer_cublaslt().unwrap();
    let dev = Device::Cuda(0);
    let _g = tch::no_grad_guard();
    tch::manual_seed(0);
    let ws: Vec<(Shape, Tensor, Option<Tensor>)> = shapes(&arch)
        .into_iter()
        .map(|s| {
            let w = Tensor::randn([s.n, s.k], (Kind::BFloat16, dev)) * 0.05;
            let b = s
                .bias
                .then(|| Tensor::randn([s.n], (Kind::BFloat16, dev)) * 0.05);
            (s, w, b)
        })
        .collect();
    // 256 MB: five times an H100's L2.
    let flush = Tensor::ones([64 << 20], (Kind::Float, dev));
    println!("qwen2.5-{arch}: one decode step's GEMMs, weights cold in L2 (µs)");
    println!(
        "{:>5} {:>9} {:>7} {:>10} {:>7} {:>10} {:>10} {:>10}",
        "rows", "narrow s", "taken", "wide s", "taken", "libtorch", "narrow", "wide"
    );
    for &r in &rows {
        let tune = |wide: bool| {
            forget_tuned_linears().unwrap();
            let _ = std::fs::remove_file(&file);
            let t = Instant::now();
            let taken: usize = ws
                .iter()
                .map(|(s, w, b)| {
                    usize::from(tune_linear(r, w, b.as_ref(), s.fp32, wide).unwrap().chosen)
                })
                .sum();
            (t.elapsed().as_secs_f64(), taken)
        };
        let base = step_us(&ws, r, false, &flush);
        let (narrow_s, narrow_n) = tune(false);
        let narrow = step_us(&ws, r, true, &flush);
        let (wide_s, wide_n) = tune(true);
        let wide = step_us(&ws, r, true, &flush);
        println!(
            "{r:>5} {narrow_s:>9.2} {narrow_n:>5}/{} {wide_s:>10.2} {wide_n:>5}/{} {base:>10.1} {narrow:>10.1} {wide:>10.1}",
            ws.len(),
            ws.len()
        );
    }
    let _ = std::fs::remove_file(&file);
}
