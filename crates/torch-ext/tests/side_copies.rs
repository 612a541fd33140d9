//! `SideCopies`: copies queued on a side stream behind the current stream's work. A copy sees its
//! source as the work queued before the fence left it (not an earlier state), its source may be
//! dropped and its memory handed out again at once without corrupting the copy, a leaf that
//! requires grad can be a destination, and after `finish` every destination holds its value. On
//! the CPU (and CI) the same calls are plain copies; the GPU cases are the `…_on_cuda` tests
//! (`make test-gpu`).

use tch::{Device, Kind, Tensor};
use verl_test_support::cuda::cuda_device;
use verl_torch_ext::SideCopies;

/// A host tensor a device-to-host copy can target without blocking (pinned on a GPU).
fn host_like(t: &Tensor, device: Device) -> Tensor {
    let h = Tensor::zeros(t.size(), (t.kind(), Device::Cpu));
    if device.is_cuda() {
        h.pin_memory(device)
    } else {
        h
    }
}

#[test]
fn copies_see_the_fenced_values_and_outlive_their_sources() {
    copies_see_the_fenced_values_and_outlive_their_sources_case(Device::Cpu);
}

#[test]
#[ignore = "needs CUDA"]
fn copies_see_the_fenced_values_and_outlive_their_sources_on_cuda() {
    copies_see_the_fenced_values_and_outlive_their_sources_case(cuda_device());
}

fn copies_see_the_fenced_values_and_outlive_their_sources_case(dev: Device) {
    let mut side = SideCopies::new(dev).unwrap();
    let n = 4 << 20; // 16 MB of f32 per source
    let mut expected = Vec::new();
    let mut dsts = Vec::new();
    for round in 0..4 {
        // Slow work on the current stream writes the source last: a copy that did not wait
        // for it would read the zeros (or the memory's previous contents).
        let a = Tensor::randn([1024, 1024], (Kind::Float, dev));
        let mut x = a.shallow_clone();
        for _ in 0..8 {
            x = x.matmul(&a) / 32.0;
        }
        let src = Tensor::zeros([n], (Kind::Float, dev));
        src.narrow(0, 0, 1024 * 1024).copy_(&x.reshape([-1]));
        let _ = src
            .narrow(0, 1024 * 1024, n - 1024 * 1024)
            .fill_(round as f64 + 0.5);
        let want = src.to_device(Device::Cpu);
        let dst = host_like(&src, dev);
        side.fence().unwrap();
        side.copy(&dst, &src).unwrap();
        side.close_batch().unwrap();
        drop(src);
        // The freed block is handed out again at once and overwritten on the current stream.
        let reuse = Tensor::full([n], -7.0, (Kind::Float, dev));
        let _ = reuse.sum(Kind::Float);
        side.wait_all_but(1).unwrap();
        assert!(side.pending() <= 1, "{dev:?}");
        expected.push(want);
        dsts.push(dst);
    }
    side.finish().unwrap();
    assert_eq!(side.pending(), 0);
    for (k, (d, w)) in dsts.iter().zip(&expected).enumerate() {
        assert!(d.equal(w), "{dev:?}: copy {k} differs from its source");
    }
}

#[test]
fn a_leaf_that_requires_grad_can_receive_a_copy() {
    a_leaf_that_requires_grad_can_receive_a_copy_case(Device::Cpu);
}

#[test]
#[ignore = "needs CUDA"]
fn a_leaf_that_requires_grad_can_receive_a_copy_on_cuda() {
    a_leaf_that_requires_grad_can_receive_a_copy_case(cuda_device());
}

fn a_leaf_that_requires_grad_can_receive_a_copy_case(dev: Device) {
    let mut side = SideCopies::new(dev).unwrap();
    let src = Tensor::arange(1000, (Kind::Float, dev)) * 0.5;
    let dst = host_like(&src, dev).set_requires_grad(true);
    side.fence().unwrap();
    side.copy(&dst, &src).unwrap();
    drop(side); // waits for the copies
    assert!(dst.requires_grad());
    assert!(dst
        .detach()
        .equal(&(Tensor::arange(1000, (Kind::Float, Device::Cpu)) * 0.5)));
}

#[test]
fn joined_uploads_are_what_the_current_stream_reads() {
    joined_uploads_are_what_the_current_stream_reads_case(Device::Cpu);
}

#[test]
#[ignore = "needs CUDA"]
fn joined_uploads_are_what_the_current_stream_reads_on_cuda() {
    joined_uploads_are_what_the_current_stream_reads_case(cuda_device());
}

fn joined_uploads_are_what_the_current_stream_reads_case(dev: Device) {
    // Uploads queued on the side stream, then joined: the current stream's next kernels (a sum,
    // a copy back) see the whole upload, although the host never waited for it.
    let mut side = SideCopies::new(dev).unwrap();
    let n = 32 << 20; // 128 MB of f32: long enough that an unjoined read would race
    let host = Tensor::arange(n, (Kind::Float, Device::Cpu)).remainder(1000.0);
    let host = if dev.is_cuda() {
        host.pin_memory(dev)
    } else {
        host
    };
    let want = host.sum(Kind::Double).double_value(&[]);
    for _ in 0..3 {
        let d = Tensor::zeros([n], (Kind::Float, dev));
        side.fence().unwrap(); // after the zeros (and any earlier use of the memory)
        side.copy(&d, &host).unwrap();
        side.join().unwrap();
        let got = d.sum(Kind::Double).double_value(&[]);
        assert_eq!(
            got, want,
            "{dev:?}: the current stream read a partial upload"
        );
    }
}
