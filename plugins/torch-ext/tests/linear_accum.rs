//! `linear_accumulating`: the forward is `x W^T + b`; the backward hands x its gradient and adds
//! W's and b's straight into their `.grad` (creating it on the first micro-batch), so several
//! backward passes sum there as autograd's accumulation would (CPU, f64: equal to 1e-12).

use tch::{Device, Kind, Tensor};
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
