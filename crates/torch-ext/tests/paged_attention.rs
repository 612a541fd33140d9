//! Paged decode attention: the torch reference against per-sequence attention on CPU, the CUDA
//! kernels' source through NVRTC (no GPU needed) and through a CPU emulator of the warp-level
//! primitives (tests/emu), and on a GPU the kernels against the reference (the `…_on_cuda`
//! tests, ignored here: `make test-gpu`).

use std::path::PathBuf;
use std::process::Command;

use tch::{Device, Kind, Tensor};
use verl_test_support::cuda::cuda_device;
use verl_torch_ext::{
    capture, paged_attention_compile_check, paged_attention_kernel_source, paged_decode_attention,
    paged_decode_attention_reference, paged_decode_attention_with, paged_multi_query_attention,
    PagedAttentionOptions, PagedDtype, PagedKernel, TorchExtError,
};

/// A random paged cache and batch: `lens[s]` positions per sequence, block ids shuffled over the
/// whole pool, table entries past a sequence's blocks set to -1 (never read).
struct Case {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    table: Tensor,
    lens: Tensor,
    lens_host: Vec<i64>,
    table_host: Vec<Vec<i64>>,
    block_size: i64,
}

#[allow(clippy::too_many_arguments)]
fn make_case(
    lens: &[i64],
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
    block_size: i64,
    extra_blocks: i64,
    kind: Kind,
    device: Device,
    seed: i64,
) -> Case {
    tch::manual_seed(seed);
    let s = lens.len() as i64;
    let need: Vec<i64> = lens
        .iter()
        .map(|&l| (l + block_size - 1) / block_size)
        .collect();
    let max_blocks = need.iter().copied().max().unwrap_or(0).max(1) + 1;
    let num_blocks = need.iter().sum::<i64>() + extra_blocks;
    let perm =
        Vec::<i64>::try_from(&Tensor::randperm(num_blocks, (Kind::Int64, Device::Cpu))).unwrap();
    let mut next = 0usize;
    let mut table_host = Vec::new();
    for &n in &need {
        let mut row = vec![-1i64; max_blocks as usize];
        for slot in row.iter_mut().take(n as usize) {
            *slot = perm[next];
            next += 1;
        }
        table_host.push(row);
    }
    let flat: Vec<i64> = table_host.iter().flatten().copied().collect();
    // Drawn on the device itself (the 300-sequence GPU cases hold gigabytes of cache).
    let opts = (Kind::Float, device);
    let cache_shape = [num_blocks, block_size, kv_heads, head_dim];
    let q = Tensor::randn([s, heads, head_dim], opts).to_kind(kind);
    let k = Tensor::randn(cache_shape, opts).to_kind(kind);
    let v = Tensor::randn(cache_shape, opts).to_kind(kind);
    Case {
        q,
        k,
        v,
        table: Tensor::from_slice(&flat)
            .reshape([s, max_blocks])
            .to_device(device),
        lens: Tensor::from_slice(lens).to_device(device),
        lens_host: lens.to_vec(),
        table_host,
        block_size,
    }
}

impl Case {
    fn reference(&self, scale: f64, window: Option<i64>) -> Tensor {
        paged_decode_attention_reference(
            &self.q,
            &self.k,
            &self.v,
            &self.table,
            &self.lens,
            scale,
            window,
        )
        .unwrap()
    }

    /// Straightforward per-sequence attention: pick the sequence's positions one by one through
    /// its block table, repeat kv heads for GQA, softmax in f64.
    fn per_sequence(&self, scale: f64, window: Option<i64>) -> Tensor {
        let qs = self.q.size();
        let (s, h, d) = (qs[0], qs[1], qs[2]);
        let kvh = self.k.size()[2];
        let g = h / kvh;
        let mut outs = Vec::new();
        for i in 0..s as usize {
            let len = self.lens_host[i];
            let lo = window.map_or(0, |w| (len - w).max(0));
            if len <= lo {
                outs.push(Tensor::zeros([h, d], (Kind::Double, Device::Cpu)));
                continue;
            }
            let slots: Vec<Tensor> = (lo..len)
                .map(|p| {
                    let b = self.table_host[i][(p / self.block_size) as usize];
                    let pos = (b * self.block_size + p % self.block_size) as usize;
                    let kv = |c: &Tensor| {
                        c.to_device(Device::Cpu)
                            .to_kind(Kind::Double)
                            .view([-1, kvh, d])
                            .get(pos as i64)
                    };
                    Tensor::stack(&[kv(&self.k), kv(&self.v)], 0)
                })
                .collect();
            let kv = Tensor::stack(&slots, 1); // [2, L, kvh, d]
            let keys = kv
                .get(0)
                .permute([1, 0, 2])
                .repeat_interleave_self_int(g, 0, None);
            let vals = kv
                .get(1)
                .permute([1, 0, 2])
                .repeat_interleave_self_int(g, 0, None);
            let q = self
                .q
                .get(i as i64)
                .to_device(Device::Cpu)
                .to_kind(Kind::Double)
                .unsqueeze(1); // [h, 1, d]
            let probs = (q.matmul(&keys.transpose(1, 2)) * scale).softmax(-1, Kind::Double);
            outs.push(probs.matmul(&vals).squeeze_dim(1));
        }
        Tensor::stack(&outs, 0)
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_device(Device::Cpu).to_kind(Kind::Double)
        - b.to_device(Device::Cpu).to_kind(Kind::Double))
    .abs()
    .max()
    .double_value(&[])
}

// ------------------------------------------------------------------------------------------------
// CPU: the reference.

#[test]
fn reference_matches_per_sequence_attention() {
    let lens = [1i64, 17, 0, 64, 33, 100, 5];
    for (heads, kv, d, bs) in [
        (14, 2, 64, 16),
        (8, 8, 32, 4),
        (32, 8, 128, 12),
        (6, 1, 16, 1),
    ] {
        let case = make_case(&lens, heads, kv, d, bs, 3, Kind::Float, Device::Cpu, 11);
        for window in [None, Some(1), Some(16), Some(50), Some(1000)] {
            let scale = 1.0 / (d as f64).sqrt();
            let got = case.reference(scale, window);
            assert_eq!(got.size(), [lens.len() as i64, heads, d]);
            let want = case.per_sequence(scale, window);
            let diff = max_diff(&got, &want);
            assert!(
                diff < 1e-4,
                "heads {heads}/{kv}, d {d}, bs {bs}, window {window:?}: differs by {diff}"
            );
        }
    }
}

#[test]
fn reference_zeroes_empty_sequences_and_ignores_nan_in_unused_slots() {
    let case = make_case(&[0, 3, 20], 4, 2, 8, 4, 2, Kind::Float, Device::Cpu, 5);
    // Poison every slot not used by any sequence's positions (tail of the last blocks and the
    // spare blocks): weight-0 values must not leak NaN into the output.
    let mut used = vec![false; (case.k.size()[0] * 4) as usize];
    for (i, &len) in case.lens_host.iter().enumerate() {
        for p in 0..len {
            let b = case.table_host[i][(p / 4) as usize];
            used[(b * 4 + p % 4) as usize] = true;
        }
    }
    let unused: Vec<i64> = (0..used.len() as i64)
        .filter(|&i| !used[i as usize])
        .collect();
    let idx = Tensor::from_slice(&unused);
    for c in [&case.k, &case.v] {
        let mut flat = c.view([-1, 2, 8]);
        let _ = flat.index_fill_(0, &idx, f64::NAN);
    }
    let got = case.reference(0.3, None);
    assert!(!bool::try_from(got.isnan().any()).unwrap(), "NaN leaked");
    assert_eq!(got.get(0).abs().max().double_value(&[]), 0.0);
    let want = case.per_sequence(0.3, None);
    assert!(max_diff(&got, &want) < 1e-5);
}

#[test]
fn reference_in_bf16_is_close_to_f64() {
    let lens = [40i64, 7, 129];
    let case = make_case(&lens, 14, 2, 64, 16, 0, Kind::BFloat16, Device::Cpu, 3);
    let got = case.reference(0.125, Some(64));
    assert_eq!(got.kind(), Kind::BFloat16);
    let diff = max_diff(&got, &case.per_sequence(0.125, Some(64)));
    assert!(diff < 2e-2, "bf16 reference differs by {diff}");
}

#[test]
fn kernel_reports_bad_inputs() {
    let case = make_case(&[3], 4, 2, 64, 16, 0, Kind::Float, Device::Cpu, 1);
    let err = paged_decode_attention(
        &case.q,
        &case.k,
        &case.v,
        &case.table,
        &case.lens,
        1.0,
        None,
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("CUDA") || msg.contains("cuda"),
        "CPU inputs should be refused: {msg}"
    );
}

// ------------------------------------------------------------------------------------------------
// CPU: the CUDA source through NVRTC (needs libnvrtc, not a GPU).

/// NVRTC compiles the kernels; where it cannot run at all (torch-ext built without the CUDA
/// headers, no libnvrtc: `bash scripts/setup.sh` installs both) the test fails saying so.
fn nvrtc_usable() {
    if let Err(e) = paged_attention_compile_check(PagedDtype::F32, 64, false, 80) {
        let m = e.to_string();
        if m.contains("no CUDA") || m.contains("could not load libnvrtc") {
            panic!(
                "NVRTC is unusable here ({m}): this test needs torch-ext built with the CUDA \
                 headers and libnvrtc (no GPU), as `bash scripts/setup.sh` installs them"
            );
        } else {
            panic!("NVRTC compilation failed: {m}");
        }
    }
}

/// Every (kernel, dtype, head_dim) the launcher may pick compiles for sm_80 and sm_90, and the
/// tensor-core kernel at the head dims that matter does not spill registers.
#[test]
fn kernels_compile_with_nvrtc() {
    nvrtc_usable();
    let mut report = String::new();
    for arch in [80u32, 90] {
        for (dtype, tc, dims) in [
            (PagedDtype::BF16, true, &[64usize, 128, 192, 256][..]),
            (PagedDtype::F16, true, &[64, 128, 256][..]),
            (PagedDtype::F32, false, &[64, 80, 128, 256][..]),
            (PagedDtype::BF16, false, &[64, 96, 128, 256][..]),
            (PagedDtype::F16, false, &[64, 128][..]),
        ] {
            for &d in dims {
                let log = paged_attention_compile_check(dtype, d, tc, arch).unwrap_or_else(|e| {
                    panic!("sm_{arch} {dtype:?} d={d} tc={tc}: {e}");
                });
                let main: Vec<&str> = log
                    .lines()
                    .skip_while(|l| !l.contains("vt_pa_main"))
                    .take(4)
                    .collect();
                let spills = main.iter().any(|l| {
                    l.contains("spill") && !l.contains(" 0 bytes spill stores, 0 bytes spill loads")
                });
                let regs = main
                    .iter()
                    .find(|l| l.contains("registers"))
                    .map(|l| l.trim().to_string())
                    .unwrap_or_default();
                report += &format!("sm_{arch} {dtype:?} d={d} tc={tc}: {regs}\n");
                if tc && d <= 128 {
                    assert!(!spills, "sm_{arch} {dtype:?} d={d}: spills\n{log}");
                    // The multi-query kernel (tensor-core programs only) holds 4 (d=64) or 2
                    // (d=128) queries' state without spilling either.
                    let multi: Vec<&str> = log
                        .lines()
                        .skip_while(|l| !l.contains("vt_pa_multi"))
                        .take(4)
                        .collect();
                    assert!(
                        !multi.is_empty(),
                        "sm_{arch} {dtype:?} d={d}: no vt_pa_multi\n{log}"
                    );
                    assert!(
                        !multi.iter().any(|l| l.contains("spill")
                            && !l.contains(" 0 bytes spill stores, 0 bytes spill loads")),
                        "sm_{arch} {dtype:?} d={d}: vt_pa_multi spills\n{log}"
                    );
                }
            }
        }
    }
    eprintln!("{report}");
}

/// The kernel source runs on the CPU under an emulator of the warp primitives (shuffles, the
/// m16n8k16 MMA fragment layouts as the PTX ISA documents them, byte permutes), one OS thread per
/// CUDA thread, and matches a float64 reference: this checks the tensor-core fragment algebra,
/// the online softmax, the splits and their merge without a GPU. Needs a C++17 compiler (`CXX`
/// or `c++`).
#[test]
fn kernels_match_reference_under_cpu_emulation() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    assert!(
        Command::new(&cxx).arg("--version").output().is_ok(),
        "this test needs a C++17 compiler: `{cxx}` (`CXX`, else `c++`) does not run"
    );
    // The run-time temp dir: the binary may run on another machine than the one that built it.
    let dir = std::env::temp_dir().join(format!("verl_paged_attention_emu_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("kernel.cu"), paged_attention_kernel_source()).unwrap();
    let harness =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/emu/paged_attention_emu.cpp");
    let exe = dir.join("emu");
    let out = Command::new(&cxx)
        .args(["-std=c++17", "-O2", "-pthread", "-I"])
        .arg(&dir)
        .arg(&harness)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "compiling the emulator failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    let text = String::from_utf8_lossy(&run.stdout);
    eprintln!("{text}{}", String::from_utf8_lossy(&run.stderr));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        run.status.success(),
        "emulated kernels differ from the reference"
    );
}

// ------------------------------------------------------------------------------------------------
// GPU: the kernels against the reference.

/// Largest `|got - want| / (1 + |want|)`: absolute near zero, relative for large outputs (where
/// one bf16 rounding step of the output alone exceeds an absolute bound).
fn scaled_diff(got: &Tensor, want: &Tensor) -> f64 {
    let want = want.to_device(Device::Cpu).to_kind(Kind::Double);
    let got = got.to_device(Device::Cpu).to_kind(Kind::Double);
    ((got - &want).abs() / (want.abs() + 1.0))
        .max()
        .double_value(&[])
}

fn tolerance(kind: Kind) -> f64 {
    match kind {
        Kind::Float => 2e-5,
        Kind::Half => 4e-3,
        _ => 2e-2,
    }
}

/// Ragged lengths 1..3000 (with block-boundary and tile-boundary cases), `n` sequences.
fn ragged_lens(n: usize, seed: u64) -> Vec<i64> {
    let fixed = [1i64, 2, 15, 16, 17, 63, 64, 65, 3000, 1000, 255, 257];
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|i| {
            if i < fixed.len() && n > 1 {
                fixed[i]
            } else {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                1 + ((x >> 33) % 3000) as i64
            }
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn check_gpu_case(
    dev: Device,
    kind: Kind,
    lens: &[i64],
    heads: i64,
    kv: i64,
    d: i64,
    bs: i64,
    window: Option<i64>,
    options: PagedAttentionOptions,
) {
    let case = make_case(lens, heads, kv, d, bs, 4, kind, dev, 7 + d + heads);
    let scale = 1.0 / (d as f64).sqrt();
    let got = paged_decode_attention_with(
        &case.q,
        &case.k,
        &case.v,
        &case.table,
        &case.lens,
        scale,
        window,
        options,
    )
    .unwrap_or_else(|e| panic!("{kind:?} {heads}/{kv} d={d} {options:?}: {e}"));
    let want = case.reference(scale, window);
    assert_eq!(got.size(), want.size());
    assert_eq!(got.kind(), kind);
    assert!(!bool::try_from(got.isnan().any()).unwrap(), "NaN in output");
    let diff = scaled_diff(&got, &want);
    eprintln!(
        "{kind:?} heads {heads}/{kv} d={d} bs={bs} S={} window {window:?} {options:?}: max diff {diff:.2e}",
        lens.len()
    );
    assert!(
        diff < tolerance(kind),
        "{kind:?} heads {heads}/{kv} d={d} bs={bs} S={} window {window:?} {options:?}: differs by {diff}",
        lens.len()
    );
}

#[test]
#[ignore = "needs CUDA"]
fn gpu_kernel_matches_reference_on_cuda() {
    let dev = cuda_device();
    for kind in [Kind::BFloat16, Kind::Half, Kind::Float] {
        for (heads, kv) in [(14i64, 2i64), (32, 8)] {
            for d in [64i64, 128] {
                for (n, window) in [
                    (1usize, None),
                    (300, None),
                    (300, Some(700)),
                    (1, Some(100)),
                ] {
                    let lens = ragged_lens(n, (d + heads) as u64 + n as u64);
                    check_gpu_case(
                        dev,
                        kind,
                        &lens,
                        heads,
                        kv,
                        d,
                        16,
                        window,
                        PagedAttentionOptions::default(),
                    );
                }
            }
        }
    }
}

/// Both kernels, forced splits (the reduce path), odd block sizes and head dims, more than 8
/// query heads per kv head, and a sequence with no positions.
#[test]
#[ignore = "needs CUDA"]
fn gpu_kernel_variants_match_reference_on_cuda() {
    let dev = cuda_device();
    let lens = ragged_lens(37, 5);
    let mut with_empty = lens.clone();
    with_empty[3] = 0;
    for kind in [Kind::BFloat16, Kind::Half] {
        for kernel in [PagedKernel::TensorCores, PagedKernel::CudaCores] {
            for num_splits in [1usize, 3, 0] {
                let options = PagedAttentionOptions { kernel, num_splits };
                check_gpu_case(dev, kind, &lens, 14, 2, 128, 16, None, options);
                check_gpu_case(dev, kind, &with_empty, 32, 8, 64, 32, Some(513), options);
                check_gpu_case(dev, kind, &lens, 20, 2, 64, 16, None, options); // 10 heads per kv
                check_gpu_case(dev, kind, &lens, 16, 1, 256, 8, Some(37), options);
                check_gpu_case(dev, kind, &lens[..5], 8, 2, 64, 12, None, options);
                // bs not 2^k
            }
        }
    }
    for d in [80i64, 96, 256] {
        let options = PagedAttentionOptions::default();
        check_gpu_case(dev, Kind::Float, &lens, 12, 4, d, 16, Some(300), options);
        check_gpu_case(dev, Kind::BFloat16, &lens, 12, 4, d, 16, None, options);
    }
}

#[test]
#[ignore = "needs CUDA"]
fn gpu_kernel_rejects_what_it_cannot_do_on_cuda() {
    let dev = cuda_device();
    let case = make_case(&[5, 9], 4, 2, 64, 16, 0, Kind::BFloat16, dev, 2);
    let bad_q = case.q.to_kind(Kind::Float);
    let err = paged_decode_attention(&bad_q, &case.k, &case.v, &case.table, &case.lens, 1.0, None)
        .unwrap_err();
    assert!(err.to_string().contains("dtype"), "{err}");
    let lens32 = case.lens.to_kind(Kind::Int);
    let err = paged_decode_attention(&case.q, &case.k, &case.v, &case.table, &lens32, 1.0, None)
        .unwrap_err();
    assert!(err.to_string().contains("int64"), "{err}");
    let f32case = make_case(&[5], 4, 2, 64, 16, 0, Kind::Float, dev, 2);
    let options = PagedAttentionOptions {
        kernel: PagedKernel::TensorCores,
        num_splits: 0,
    };
    let err = paged_decode_attention_with(
        &f32case.q,
        &f32case.k,
        &f32case.v,
        &f32case.table,
        &f32case.lens,
        1.0,
        None,
        options,
    )
    .unwrap_err();
    assert!(err.to_string().contains("tensor-core"), "{err}");
}

/// Queries of table rows through the multi-query kernel (tensor cores) or its fallback (fp32), in
/// row order and interleaved as in a packed stream: bit-identical to the decode kernel run once
/// per query over each query's table row.
#[test]
#[ignore = "needs CUDA"]
fn gpu_multi_query_matches_one_decode_step_per_query_on_cuda() {
    let dev = cuda_device();
    for kind in [Kind::BFloat16, Kind::Half, Kind::Float] {
        for (heads, kv, d, bs, t) in [
            (14i64, 2i64, 64i64, 16i64, 37i64),
            (12, 2, 128, 16, 21),
            (20, 2, 128, 8, 9),
            (32, 8, 64, 12, 5),
        ] {
            // Rows of 0..300 cached positions plus t queries each.
            let past: Vec<i64> = (0..11).map(|i| (i * 29) % 300).collect();
            let lens: Vec<i64> = past.iter().map(|&p| p + t).collect();
            let case = make_case(&lens, heads, kv, d, bs, 4, kind, dev, 5 + d + t);
            let s = lens.len() as i64;
            let q = Tensor::randn([s * t, heads, d], (Kind::Float, dev)).to_kind(kind);
            let q_lens: Vec<i64> = past
                .iter()
                .flat_map(|&p| (0..t).map(move |i| p + i + 1))
                .collect();
            let q_lens = Tensor::from_slice(&q_lens).to_device(dev);
            let scale = 1.0 / (d as f64).sqrt();
            // Queries in row order (t even), or as a packed stream has them (t odd: runs of 3
            // per row, interleaved), so that blocks of consecutive queries straddle rows.
            let mut rows: Vec<i64> = (0..s).flat_map(|r| (0..t).map(move |_| r)).collect();
            let mut q_lens = q_lens;
            if t % 2 == 1 {
                let host = Vec::<i64>::try_from(&q_lens.to_device(Device::Cpu)).unwrap();
                let mut order: Vec<usize> = Vec::new();
                for i0 in (0..t as usize).step_by(3) {
                    for r in 0..s as usize {
                        for i in i0..(i0 + 3).min(t as usize) {
                            order.push(r * t as usize + i);
                        }
                    }
                }
                rows = order.iter().map(|&i| rows[i]).collect();
                let lens: Vec<i64> = order.iter().map(|&i| host[i]).collect();
                q_lens = Tensor::from_slice(&lens).to_device(dev);
            }
            let rows = Tensor::from_slice(&rows).to_device(dev);
            let got = paged_multi_query_attention(
                &q,
                &case.k,
                &case.v,
                &case.table,
                &rows,
                &q_lens,
                scale,
            )
            .unwrap_or_else(|e| panic!("{kind:?} {heads}/{kv} d={d}: {e}"));
            let table = case.table.index_select(0, &rows);
            let want = paged_decode_attention_with(
                &q,
                &case.k,
                &case.v,
                &table,
                &q_lens,
                scale,
                None,
                PagedAttentionOptions {
                    kernel: PagedKernel::Auto,
                    num_splits: 1,
                },
            )
            .unwrap();
            let what = format!("{kind:?} {heads}/{kv} d={d} bs={bs} t={t}");
            assert!(!bool::try_from(got.isnan().any()).unwrap(), "{what}: NaN");
            assert!(
                got.equal(&want),
                "{what}: differs (max {})",
                scaled_diff(&got, &want)
            );
            eprintln!("{what}: bit-identical");
        }
    }
}

/// The kernel (with context splits, so the scratch allocation and the reduce launch are captured
/// too) inside a CUDA graph: replays with new lengths and queries match the reference.
#[test]
#[ignore = "needs CUDA"]
fn gpu_kernel_replays_in_a_cuda_graph_on_cuda() {
    let dev = cuda_device();
    for (kind, num_splits) in [
        (Kind::BFloat16, 0usize),
        (Kind::BFloat16, 4),
        (Kind::Float, 2),
    ] {
        let lens = ragged_lens(24, 9);
        let case = make_case(&lens, 14, 2, 64, 16, 0, kind, dev, 4);
        let options = PagedAttentionOptions {
            kernel: PagedKernel::Auto,
            num_splits,
        };
        let (q, lens_dev) = (case.q.copy(), case.lens.copy());
        let (graph, out) = capture::<_, TorchExtError>(None, 1, || {
            paged_decode_attention_with(
                &q,
                &case.k,
                &case.v,
                &case.table,
                &lens_dev,
                0.125,
                None,
                options,
            )
        })
        .unwrap();
        for round in 0..3i64 {
            // Shorter lengths (the table still covers them) and fresh queries.
            let new_lens = case.lens.shallow_clone() - round * 7;
            let new_lens = new_lens.clamp_min(0);
            let new_q = Tensor::randn(q.size(), (Kind::Float, dev)).to_kind(kind);
            lens_dev.shallow_clone().copy_(&new_lens);
            q.shallow_clone().copy_(&new_q);
            graph.replay().unwrap();
            let want = paged_decode_attention_reference(
                &new_q,
                &case.k,
                &case.v,
                &case.table,
                &new_lens,
                0.125,
                None,
            )
            .unwrap();
            let diff = scaled_diff(&out, &want);
            eprintln!("graph {kind:?} splits {num_splits} round {round}: max diff {diff:.2e}");
            assert!(diff < tolerance(kind), "graph replay differs by {diff}");
        }
    }
}
