//! `linear_accumulating`: the forward is `x W^T + b`; the backward hands x its gradient and adds
//! W's and b's straight into their `.grad` (creating it on the first micro-batch), so several
//! backward passes sum there as autograd's accumulation would (CPU, f64: equal to 1e-12).

use tch::{Device, Kind, Tensor};
use verl_test_support::cuda::cuda_device;
use verl_torch_ext::linear_accumulating;

fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn gradients_accumulate_into_grad_like_autograd() {
    tch::manual_seed(5);
    let opts = (Kind::Double, Device::Cpu);
    let w = Tensor::randn([6, 4], opts).set_requires_grad(true);
    let b = Tensor::randn([6], opts).set_requires_grad(true);
    let w_ref = w.detach().copy().set_requires_grad(true);
    let b_ref = b.detach().copy().set_requires_grad(true);
    let mut x_grads = Vec::new();
    for mb in 0..3 {
        // [B, T, in] input that needs its own gradient, and a loss weighting every output.
        let x = Tensor::randn([2, 3, 4], opts).set_requires_grad(true);
        let x_ref = x.detach().copy().set_requires_grad(true);
        let g = Tensor::randn([2, 3, 6], opts);
        let y = linear_accumulating(&x, &w, Some(&b)).unwrap();
        let y_ref = x_ref.linear(&w_ref, Some(&b_ref));
        assert!(max_abs(&y, &y_ref) < 1e-12, "forward, micro-batch {mb}");
        (&y * &g).sum(Kind::Double).backward();
        (&y_ref * &g).sum(Kind::Double).backward();
        assert!(
            max_abs(&x.grad(), &x_ref.grad()) < 1e-12,
            "x grad, micro-batch {mb}"
        );
        assert!(
            max_abs(&w.grad(), &w_ref.grad()) < 1e-12,
            "W grad after {mb}"
        );
        assert!(
            max_abs(&b.grad(), &b_ref.grad()) < 1e-12,
            "b grad after {mb}"
        );
        x_grads.push(x.grad());
    }
    // Three micro-batches' worth, not the last one alone.
    assert!(w.grad().abs().sum(Kind::Double).double_value(&[]) > 0.0);
    // Without a bias, and an input that needs no gradient: W's gradient still accumulates.
    let w2 = Tensor::randn([3, 5], opts).set_requires_grad(true);
    let x = Tensor::randn([7, 5], opts);
    let y = linear_accumulating(&x, &w2, None).unwrap();
    y.sum(Kind::Double).backward();
    let want = Tensor::ones([7, 3], opts).tr().mm(&x);
    assert!(max_abs(&w2.grad(), &want) < 1e-12);
    // The weight gets no gradient through autograd itself (it went into .grad): asking for it
    // with run_backward gives none.
    let w3 = Tensor::randn([3, 5], opts).set_requires_grad(true);
    let xr = Tensor::randn([7, 5], opts).set_requires_grad(true);
    let y = linear_accumulating(&xr, &w3, None).unwrap();
    let got = Tensor::run_backward(&[y.sum(Kind::Double)], &[&xr, &w3], false, true);
    assert!(got[0].defined());
    assert!(!got[1].defined() || got[1].abs().sum(Kind::Double).double_value(&[]) == 0.0);
    // A mismatched weight is named.
    let e = linear_accumulating(&x, &Tensor::zeros([3, 4], opts), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("linear_accum"), "{e}");
}

/// `linear_into`: the forward is `x W^T`; the backward hands x its gradient and adds each row
/// block's weight gradient into its accumulator (two blocks of a concatenated weight, over three
/// micro-batches, into f64 and f32 accumulators), and W gets none through autograd.
#[test]
fn linear_into_adds_each_row_blocks_gradient_into_its_accumulator() {
    use verl_torch_ext::linear_into;
    tch::manual_seed(6);
    let opts = (Kind::Double, Device::Cpu);
    let w = Tensor::randn([7, 4], opts).set_requires_grad(true);
    let w_ref = w.detach().copy().set_requires_grad(true);
    let acc_a = Tensor::zeros([3, 4], opts);
    let acc_b = Tensor::zeros([4, 4], (Kind::Float, Device::Cpu));
    for mb in 0..3 {
        let x = Tensor::randn([2, 5, 4], opts).set_requires_grad(true);
        let x_ref = x.detach().copy().set_requires_grad(true);
        let g = Tensor::randn([2, 5, 7], opts);
        let y = linear_into(&x, &w, &[&acc_a, &acc_b]).unwrap();
        let y_ref = x_ref.linear(&w_ref, None::<&Tensor>);
        assert!(max_abs(&y, &y_ref) < 1e-12, "forward, micro-batch {mb}");
        let got = Tensor::run_backward(&[(&y * &g).sum(Kind::Double)], &[&x, &w], false, false);
        (&y_ref * &g).sum(Kind::Double).backward();
        assert!(max_abs(&got[0], &x_ref.grad()) < 1e-12, "x grad {mb}");
        assert!(!got[1].defined(), "W got a gradient through autograd");
        let want = w_ref.grad();
        assert!(
            max_abs(&acc_a, &want.narrow(0, 0, 3)) < 1e-12,
            "block a after {mb}"
        );
        let b = acc_b.to_kind(Kind::Double);
        assert!(
            max_abs(&b, &want.narrow(0, 3, 4)) < 1e-4,
            "block b after {mb}"
        );
    }
    assert!(acc_a.abs().sum(Kind::Double).double_value(&[]) > 0.0);
    // Accumulators that do not tile the weight's rows are refused by name.
    let x = Tensor::randn([2, 4], opts);
    let e = linear_into(&x, &w, &[&acc_a]).unwrap_err().to_string();
    assert!(e.contains("linear_into") && e.contains("3 rows"), "{e}");
}

/// `embedding_accumulating`: the forward is torch's embedding; over two micro-batches with
/// repeated ids and a padding row, `.grad` equals autograd's accumulated dense gradient (the
/// padding row's stays zero, rows of ids never seen stay zero), and autograd hands the table
/// no gradient of its own.
#[test]
fn embedding_gradient_goes_into_grad_rows() {
    use verl_torch_ext::embedding_accumulating;
    tch::manual_seed(9);
    let opts = (Kind::Double, Device::Cpu);
    let w = Tensor::randn([10, 3], opts).set_requires_grad(true);
    let w_ref = w.detach().copy().set_requires_grad(true);
    for (mb, ids) in [[1i64, 4, 4, 7, 2, 4], [7, 7, 0, 2, 9, 1]]
        .iter()
        .enumerate()
    {
        let ids = Tensor::from_slice(ids).view([2, 3]);
        let g = Tensor::randn([2, 3, 3], opts);
        let e = embedding_accumulating(&w, &ids, Some(2)).unwrap();
        let e_ref = Tensor::embedding(&w_ref, &ids, 2, false, false);
        assert!(max_abs(&e, &e_ref) < 1e-12, "forward {mb}");
        (&e * &g).sum(Kind::Double).backward();
        (&e_ref * &g).sum(Kind::Double).backward();
        assert!(max_abs(&w.grad(), &w_ref.grad()) < 1e-12, "grad after {mb}");
    }
    let zero_rows = Tensor::from_slice(&[2i64, 3, 5, 6, 8]);
    let z = w.grad().index_select(0, &zero_rows).abs().sum(Kind::Double);
    assert_eq!(z.double_value(&[]), 0.0);
    assert!(w.grad().abs().sum(Kind::Double).double_value(&[]) > 0.0);
    // No padding row: every id's rows sum (id 2 included).
    let w2 = Tensor::zeros([4, 2], opts).set_requires_grad(true);
    let ids = Tensor::from_slice(&[2i64, 2, 3]);
    embedding_accumulating(&w2, &ids, None)
        .unwrap()
        .sum(Kind::Double)
        .backward();
    let want = Tensor::from_slice(&[0.0f64, 0.0, 0.0, 0.0, 2.0, 2.0, 1.0, 1.0]).view([4, 2]);
    assert!(max_abs(&w2.grad(), &want) < 1e-12);
    let err = embedding_accumulating(&w2, &ids, Some(4))
        .unwrap_err()
        .to_string();
    assert!(err.contains("padding_idx 4"), "{err}");
}

/// On the CPU with several intra-op threads, the gradient rows of many repeated ids sum in the
/// same order every time: ten backwards give the same bits (an accumulating `index_put_` races
/// between threads and differed in 9 of 10 repeats of this case).
#[test]
fn embedding_gradient_is_deterministic_on_cpu_threads() {
    use verl_torch_ext::embedding_accumulating;
    tch::set_num_threads(2);
    tch::manual_seed(3);
    let opts = (Kind::Float, Device::Cpu);
    let ids = Tensor::randint(50, [20_000], (Kind::Int64, Device::Cpu));
    let g = Tensor::randn([20_000, 128], opts);
    let grads: Vec<Tensor> = (0..10)
        .map(|_| {
            let w = Tensor::zeros([50, 128], opts).set_requires_grad(true);
            (embedding_accumulating(&w, &ids, None).unwrap() * &g)
                .sum(Kind::Float)
                .backward();
            w.grad().copy()
        })
        .collect();
    for (i, gr) in grads.iter().enumerate() {
        assert!(gr.equal(&grads[0]), "backward {i} differs from backward 0");
    }
}

/// In bf16, on the CPU and on a GPU: adding a micro-batch's weight gradient into `.grad` rounds
/// once (the product accumulated in fp32, added to `.grad` in fp32, one rounding), nearer the
/// exact sum than rounding the product to bf16 first and adding (what autograd's separate
/// accumulation gives, and on CUDA libtorch's `addmm_` too). The GPU case is the `_on_cuda` test.
#[test]
fn accumulation_into_a_bf16_grad_rounds_once() {
    rounds_once_case(Device::Cpu);
}

#[test]
#[ignore = "needs CUDA"]
fn accumulation_into_a_bf16_grad_rounds_once_on_cuda() {
    rounds_once_case(cuda_device());
}

fn rounds_once_case(dev: Device) {
    tch::manual_seed(9);
    let bf = |t: Tensor| t.to_kind(Kind::BFloat16);
    let w = bf(Tensor::randn([96, 64], (Kind::Float, dev))).set_requires_grad(true);
    // Loss weights that bf16 holds exactly: the gradient reaching y is exactly them.
    let step = |x: &Tensor, g: &Tensor| {
        let y = linear_accumulating(x, &w, None).unwrap();
        (y.to_kind(Kind::Float) * g).sum(Kind::Float).backward();
    };
    let x1 = bf(Tensor::randn([300, 64], (Kind::Float, dev)));
    let g1 = bf(Tensor::randn([300, 96], (Kind::Float, dev))).to_kind(Kind::Float);
    step(&x1, &g1);
    let prev = w.grad().copy();
    let x2 = bf(Tensor::randn([300, 64], (Kind::Float, dev)));
    let g2 = bf(Tensor::randn([300, 96], (Kind::Float, dev))).to_kind(Kind::Float);
    step(&x2, &g2);
    let f64s = |t: &Tensor| t.to_kind(Kind::Double);
    let product = f64s(&g2).tr().matmul(&f64s(&x2));
    let exact = f64s(&prev) + &product;
    let twice = bf(f64s(&prev) + f64s(&bf(product.shallow_clone())));
    let err = |t: &Tensor| (f64s(t) - &exact).abs().sum(Kind::Double).double_value(&[]);
    let (e_got, e_twice) = (err(&w.grad()), err(&twice));
    assert!(
        e_got < e_twice,
        "{dev:?}: accumulated error {e_got:.4e}, rounding the product first {e_twice:.4e}"
    );
    // Against rounding the exact sum once: equal but for fp32 accumulation ties.
    let once = bf(exact.shallow_clone());
    let differ = once.ne_tensor(&w.grad()).sum(Kind::Int64).int64_value(&[]);
    assert!(
        differ * 100 < once.numel() as i64,
        "{dev:?}: {differ} of {} elements differ from one rounding of the exact sum",
        once.numel()
    );
}

/// `linear_pair_accumulating`: the two projections of one input as two `linear_accumulating`
/// calls compute them (forward, x's gradient, both weights' and biases' `.grad` over three
/// micro-batches; f64 on the CPU to 1e-12), also when only one output gets a gradient.
#[test]
fn pair_accumulates_like_two_linears() {
    use verl_torch_ext::linear_pair_accumulating;
    tch::manual_seed(9);
    let opts = (Kind::Double, Device::Cpu);
    let leaf = |t: &Tensor| t.detach().copy().set_requires_grad(true);
    let (wa0, wb0) = (Tensor::randn([6, 4], opts), Tensor::randn([5, 4], opts));
    let (ba0, bb0) = (Tensor::randn([6], opts), Tensor::randn([5], opts));
    let (wa, wb, ba, bb) = (leaf(&wa0), leaf(&wb0), leaf(&ba0), leaf(&bb0));
    let (wa_r, wb_r, ba_r, bb_r) = (leaf(&wa0), leaf(&wb0), leaf(&ba0), leaf(&bb0));
    for mb in 0..3 {
        let x = Tensor::randn([2, 3, 4], opts).set_requires_grad(true);
        let x_ref = leaf(&x);
        let (ga, gb) = (
            Tensor::randn([2, 3, 6], opts),
            Tensor::randn([2, 3, 5], opts),
        );
        let (a, b) = linear_pair_accumulating(&x, &wa, &wb, Some(&ba), Some(&bb)).unwrap();
        let a_ref = linear_accumulating(&x_ref, &wa_r, Some(&ba_r)).unwrap();
        let b_ref = linear_accumulating(&x_ref, &wb_r, Some(&bb_r)).unwrap();
        assert!(
            max_abs(&a, &a_ref) < 1e-12 && max_abs(&b, &b_ref) < 1e-12,
            "forward {mb}"
        );
        // The last micro-batch's loss reads only the first output.
        let loss = |a: &Tensor, b: &Tensor| {
            if mb == 2 {
                (a * &ga).sum(Kind::Double)
            } else {
                (a * &ga).sum(Kind::Double) + (b * &gb).sum(Kind::Double)
            }
        };
        loss(&a, &b).backward();
        loss(&a_ref, &b_ref).backward();
        assert!(max_abs(&x.grad(), &x_ref.grad()) < 1e-12, "x grad {mb}");
        for (got, want, name) in [
            (&wa, &wa_r, "wa"),
            (&wb, &wb_r, "wb"),
            (&ba, &ba_r, "ba"),
            (&bb, &bb_r, "bb"),
        ] {
            assert!(
                max_abs(&got.grad(), &want.grad()) < 1e-12,
                "{name} grad after {mb}"
            );
        }
    }
    assert!(wb.grad().abs().sum(Kind::Double).double_value(&[]) > 0.0);
    // Mismatched weights are named.
    let x = Tensor::randn([7, 4], opts);
    let e = linear_pair_accumulating(&x, &wa, &Tensor::zeros([3, 5], opts), None, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("linear_pair_accum"), "{e}");
}

/// On CUDA in bf16 the pair's input gradient (one GEMM, then one accumulating GEMM) has the bits
/// of two GEMMs and autograd's separate add, and the weights' `.grad` those of two
/// `linear_accumulating` calls.
#[test]
#[ignore = "needs CUDA"]
fn pair_input_gradient_has_the_bits_of_two_gemms_and_an_add_on_cuda() {
    use verl_torch_ext::linear_pair_accumulating;
    let dev = cuda_device();
    tch::manual_seed(10);
    let opts = (Kind::BFloat16, dev);
    let leaf = |t: &Tensor| t.detach().copy().set_requires_grad(true);
    let (wa0, wb0) = (
        Tensor::randn([384, 256], opts),
        Tensor::randn([384, 256], opts),
    );
    let (wa, wb, wa_r, wb_r) = (leaf(&wa0), leaf(&wb0), leaf(&wa0), leaf(&wb0));
    for mb in 0..3 {
        let x = Tensor::randn([512, 256], opts).set_requires_grad(true);
        let x_ref = leaf(&x);
        let (ga, gb) = (
            Tensor::randn([512, 384], opts),
            Tensor::randn([512, 384], opts),
        );
        let (a, b) = linear_pair_accumulating(&x, &wa, &wb, None, None).unwrap();
        ((&a * &ga).sum(Kind::Float) + (&b * &gb).sum(Kind::Float)).backward();
        let a_ref = linear_accumulating(&x_ref, &wa_r, None).unwrap();
        let b_ref = linear_accumulating(&x_ref, &wb_r, None).unwrap();
        ((&a_ref * &ga).sum(Kind::Float) + (&b_ref * &gb).sum(Kind::Float)).backward();
        assert!(
            x.grad().equal(&x_ref.grad()),
            "x grad bits, micro-batch {mb}"
        );
        assert!(
            wa.grad().equal(&wa_r.grad()) && wb.grad().equal(&wb_r.grad()),
            "W grads {mb}"
        );
    }
}
