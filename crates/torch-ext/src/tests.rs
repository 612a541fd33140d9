use super::*;
use tch::{Device, Kind};

/// `cuda:0` for the `#[ignore = "needs CUDA"]` tests (`make test-gpu`), a clear failure where
/// there is none. (verl-test-support's `cuda_device`, which this crate's unit tests cannot
/// use: it links this crate.)
fn cuda_device() -> Device {
    assert!(
        tch::Cuda::is_available(),
        "this test needs a CUDA device and tch::Cuda::is_available() is false; it is \
             #[ignore = \"needs CUDA\"]: run it on a GPU machine with `make test-gpu`"
    );
    Device::Cuda(0)
}

/// A non-blocking copy is a copy (CPU).
#[test]
fn nonblocking_copy_is_a_copy() {
    let src = Tensor::arange(10, (Kind::Int64, Device::Cpu));
    let dst = Tensor::zeros([10], (Kind::Int64, Device::Cpu));
    copy_nonblocking(&dst, &src).unwrap();
    assert!(dst.equal(&src));
}

/// On CUDA the device-to-pinned-host copy of a result still being computed holds it once an
/// event recorded after the copy has completed, while later queued work may still run.
#[test]
#[ignore = "needs CUDA"]
fn nonblocking_copy_and_event_on_cuda() {
    let dev = cuda_device();
    let a = Tensor::randn([2048, 2048], (Kind::Float, dev));
    let sum = a.matmul(&a).sum(Kind::Float).view([1]);
    let host = Tensor::zeros([1], (Kind::Float, Device::Cpu)).internal_pin_memory(dev);
    copy_nonblocking(&host, &sum).unwrap();
    let ev = CudaEvent::record(0).unwrap();
    // More work after the event: the wait below does not need it.
    let _later = a.matmul(&a).matmul(&a);
    ev.synchronize().unwrap();
    let want = sum.to_device(Device::Cpu).double_value(&[0]);
    assert_eq!(host.double_value(&[0]), want);
}

/// The fused kernel against torch.optim.AdamW's formula written out (decoupled decay, bias
/// corrections), over three steps.
#[test]
fn fused_adamw_matches_the_written_out_update() {
    tch::manual_seed(3);
    let shapes: [&[i64]; 3] = [&[5, 7], &[11], &[2, 3, 4]];
    let opts = (Kind::Float, Device::Cpu);
    let params: Vec<Tensor> = shapes.iter().map(|s| Tensor::randn(*s, opts)).collect();
    let initial: Vec<Tensor> = params.iter().map(|p| p.copy()).collect();
    let mut reference: Vec<Tensor> = params.iter().map(|p| p.copy()).collect();
    let zeros = |ps: &[Tensor]| ps.iter().map(|p| p.zeros_like()).collect::<Vec<_>>();
    let (m, v) = (zeros(&params), zeros(&params));
    let (mut rm, mut rv) = (zeros(&params), zeros(&params));
    let steps: Vec<Tensor> = params.iter().map(|_| Tensor::from(0f32)).collect();
    let (lr, b1, b2, wd, eps) = (1e-2, 0.9, 0.999, 0.1, 1e-8);
    for step in 1..=3 {
        let grads: Vec<Tensor> = shapes.iter().map(|s| Tensor::randn(*s, opts)).collect();
        for s in &steps {
            let _ = s.shallow_clone().fill_(step as f64);
        }
        fused_adamw(&params, &grads, &m, &v, &steps, lr, (b1, b2), wd, eps).unwrap();
        let bc1 = 1.0 - f64::powi(b1, step);
        let bc2 = 1.0 - f64::powi(b2, step);
        for (i, g) in grads.iter().enumerate() {
            rm[i] = &rm[i] * b1 + g * (1.0 - b1);
            rv[i] = &rv[i] * b2 + g.square() * (1.0 - b2);
            let denom = rv[i].sqrt() / bc2.sqrt() + eps;
            let upd = &rm[i] / denom * (lr / bc1);
            reference[i] = &reference[i] * (1.0 - lr * wd) - upd;
        }
    }
    for ((a, b), init) in params.iter().zip(&reference).zip(&initial) {
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d < 1e-6, "fused AdamW differs from the formula by {d}");
        let moved = (a - init).abs().max().double_value(&[]);
        assert!(moved > 1e-3, "the parameters did not move");
    }
}

#[test]
fn fused_adamw_refuses_mismatched_lists() {
    let p = vec![Tensor::zeros([2], (Kind::Float, Device::Cpu))];
    let err = fused_adamw(&p, &[], &p, &p, &p, 1e-3, (0.9, 0.99), 0.0, 1e-8).unwrap_err();
    assert!(err.to_string().contains("fused AdamW grads"), "{err}");
}

/// On a GPU: a captured graph replays with new inputs and matches eager.
#[test]
#[ignore = "needs CUDA"]
fn graph_replays_with_new_inputs_on_cuda() {
    let dev = cuda_device();
    assert!(
        cuda_graphs_compiled(),
        "CUDA present but the shim has no CUDA"
    );
    let w = Tensor::randn([64, 64], (Kind::Float, dev));
    let x = Tensor::zeros([8, 64], (Kind::Float, dev));
    let (graph, y) = capture::<_, TorchExtError>(None, 1, || {
        Ok(x.matmul(&w)
            .relu()
            .sum_dim_intlist([1i64].as_slice(), false, Kind::Float))
    })
    .unwrap();
    for _ in 0..3 {
        let input = Tensor::randn([8, 64], (Kind::Float, dev));
        x.shallow_clone().copy_(&input);
        graph.replay().unwrap();
        let eager = input
            .matmul(&w)
            .relu()
            .sum_dim_intlist([1i64].as_slice(), false, Kind::Float);
        let d = (&y - &eager).abs().max().double_value(&[]);
        assert!(d < 1e-4, "graph output differs from eager by {d}");
    }
}
