//! `grad`: the gradients of inputs given the gradients of several outputs, as a backward from the
//! surrogate `Σ (y · g).sum()` gives them (CPU, f64: bit for bit), `None` for an input the outputs do
//! not reach or that needs no gradient, and the graph kept or freed as asked.

use tch::{Device, Kind, Tensor};
use verl_torch_ext::grad;

#[test]
fn gradients_of_several_outputs_equal_the_surrogate_backward() {
    tch::manual_seed(9);
    let opts = (Kind::Double, Device::Cpu);
    let a = Tensor::randn([4, 3], opts).set_requires_grad(true);
    let w = Tensor::randn([3, 5], opts).set_requires_grad(true);
    let unused = Tensor::randn([2], opts).set_requires_grad(true);
    let frozen = Tensor::randn([4, 3], opts);
    let run = || {
        let h = a.matmul(&w).tanh();
        let y1 = &h * 2.0 + &frozen.sum(Kind::Double);
        let y2 = h.sum_dim_intlist([1].as_slice(), false, Kind::Double).exp();
        (y1, y2)
    };
    let (g1, g2) = (Tensor::randn([4, 5], opts), Tensor::randn([4], opts));
    let (y1, y2) = run();
    let got = grad(&[(&y1, &g1), (&y2, &g2)], &[&a, &w, &unused, &frozen], true).unwrap();
    // The graph was kept: a second call on the same outputs works.
    let again = grad(&[(&y1, &g1)], &[&a], false).unwrap();
    assert!(again[0].is_some());
    let (y1, y2) = run();
    let root = (&y1 * &g1).sum(Kind::Double) + (&y2 * &g2).sum(Kind::Double);
    let want = Tensor::run_backward(&[root], &[&a, &w], false, false);
    assert!(got[0].as_ref().unwrap().equal(&want[0]), "a");
    assert!(got[1].as_ref().unwrap().equal(&want[1]), "w");
    assert!(got[2].is_none(), "an input the outputs do not reach");
    assert!(got[3].is_none(), "an input that needs no gradient");
    // Freed: differentiating through the same graph again fails, and says so.
    let (y1, _) = run();
    assert!(grad(&[(&y1, &g1)], &[&a], false).is_ok());
    let e = grad(&[(&y1, &g1)], &[&a], false).unwrap_err().to_string();
    assert!(e.contains("autograd::grad"), "{e}");
}
