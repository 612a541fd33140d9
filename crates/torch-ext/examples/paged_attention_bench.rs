//! Times the paged decode-attention kernel against the torch formulations on a GPU.
//!
//! `cargo run --release -p verl-torch-ext --example paged_attention_bench [-- S CONTEXT HEADS
//! KV_HEADS HEAD_DIM SHARED N BLOCK_SIZE]` (defaults: S = 512 sequences, context 768; heads 14 /
//! kv 2, head_dim 64, bf16, blocks of 16, block ids shuffled; SHARED > 0: groups of N sequences share
//! their first SHARED positions' blocks, as the n samples of a prompt do in the engine). Prints µs per call and the achieved GB/s of K/V read (every sequence's
//! keys and values read once: S * context * kv_heads * head_dim * 2 bytes * 2).

use std::time::Instant;

use tch::{Device, Kind, Tensor};
use verl_torch_ext::{
    capture, paged_decode_attention_reference, paged_decode_attention_with, PagedAttentionOptions,
    PagedKernel, TorchExtError,
};

fn time_us(iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    tch::Cuda::synchronize(0);
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    tch::Cuda::synchronize(0);
    t.elapsed().as_secs_f64() * 1e6 / iters as f64
}

fn main() {
    if !tch::Cuda::is_available() {
        eprintln!("paged_attention_bench: no CUDA device");
        return;
    }
    let args: Vec<i64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let s = args.first().copied().unwrap_or(512);
    let ctx = args.get(1).copied().unwrap_or(768);
    let heads = args.get(2).copied().unwrap_or(14);
    let kvh = args.get(3).copied().unwrap_or(2);
    let d = args.get(4).copied().unwrap_or(64);
    let shared = args.get(5).copied().unwrap_or(0);
    let group = args.get(6).copied().unwrap_or(8).max(1);
    let bs = args.get(7).copied().unwrap_or(16).max(1);
    let dev = Device::Cuda(0);
    let kind = Kind::BFloat16;
    tch::manual_seed(0);
    let mb = (ctx + bs - 1) / bs;
    let nb = s * mb + 8;
    let table = Tensor::randperm(nb, (Kind::Int64, dev))
        .narrow(0, 0, s * mb)
        .reshape([s, mb]);
    // Shared prefix: every sequence of a group points at its first member's prefix blocks.
    let sb = shared / bs;
    if sb > 0 {
        let first = Tensor::arange(s, (Kind::Int64, dev)).floor_divide_scalar(group) * group;
        let prefix = table.index_select(0, &first).narrow(1, 0, sb);
        let mut head = table.narrow(1, 0, sb);
        head.copy_(&prefix);
    }
    let lens = Tensor::full([s], ctx, (Kind::Int64, dev));
    let q = Tensor::randn([s, heads, d], (Kind::Float, dev)).to_kind(kind);
    let k = Tensor::randn([nb, bs, kvh, d], (Kind::Float, dev)).to_kind(kind);
    let v = Tensor::randn([nb, bs, kvh, d], (Kind::Float, dev)).to_kind(kind);
    let scale = 1.0 / (d as f64).sqrt();
    let kv_bytes = (s * ctx * kvh * d * 2 * 2) as f64;
    println!(
        "S={s} context={ctx} heads={heads}/{kvh} head_dim={d} bf16 block_size={bs} shared prefix {shared} per {group}: {:.1} MB of K/V per call (counted unshared)",
        kv_bytes / 1e6
    );
    let report = |name: &str, us: f64| {
        println!(
            "{name:<44} {us:>9.1} µs   {:>7.1} GB/s",
            kv_bytes / (us * 1e-6) / 1e9
        );
    };

    let want = paged_decode_attention_reference(&q, &k, &v, &table, &lens, scale, None).unwrap();
    let mut variants = vec![("kernel auto".to_string(), PagedAttentionOptions::default())];
    for n in [1usize, 2, 3, 4] {
        variants.push((
            format!("kernel tensor cores, {n} split(s)"),
            PagedAttentionOptions {
                kernel: PagedKernel::TensorCores,
                num_splits: n,
            },
        ));
    }
    variants.push((
        "kernel CUDA cores (fallback), auto splits".into(),
        PagedAttentionOptions {
            kernel: PagedKernel::CudaCores,
            num_splits: 0,
        },
    ));
    for (name, opts) in &variants {
        let run = || paged_decode_attention_with(&q, &k, &v, &table, &lens, scale, None, *opts);
        let got = run().unwrap();
        let diff = (got.to_kind(Kind::Float) - want.to_kind(Kind::Float))
            .abs()
            .max()
            .double_value(&[]);
        let us = time_us(100, || {
            let _ = run().unwrap();
        });
        report(&format!("{name} (max diff {diff:.1e})"), us);
    }

    // The same call captured in a CUDA graph (no launch overhead).
    let opts = PagedAttentionOptions::default();
    let (graph, _out) = capture::<_, TorchExtError>(None, 1, || {
        paged_decode_attention_with(&q, &k, &v, &table, &lens, scale, None, opts)
    })
    .unwrap();
    report(
        "kernel auto, CUDA graph replay",
        time_us(100, || graph.replay().unwrap()),
    );

    report(
        "reference (gather + fp32 softmax)",
        time_us(20, || {
            let _ =
                paged_decode_attention_reference(&q, &k, &v, &table, &lens, scale, None).unwrap();
        }),
    );
    // What the rollout engine does today: gather every block, SDPA with an additive mask.
    let l = mb * bs;
    let flat = table.reshape([s * mb]);
    let mask = Tensor::zeros([s, 1, 1, l], (kind, dev));
    report(
        "engine today (gather + masked SDPA, bf16)",
        time_us(20, || {
            let g = |c: &Tensor| {
                c.index_select(0, &flat)
                    .view([s, l, kvh, d])
                    .transpose(1, 2)
            };
            let qg = q.view([s, kvh, heads / kvh, d]);
            let _ = Tensor::scaled_dot_product_attention(
                &qg,
                &g(&k),
                &g(&v),
                Some(&mask),
                0.0,
                false,
                Some(scale),
                false,
            );
        }),
    );
}
